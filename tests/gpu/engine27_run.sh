#!/usr/bin/env bash
# engine27_run.sh LOGDIR MODEL_XZ_PART2 - the default model assembled from
# two parts (final27b_run.sh says why), then make gpu-test's suite (the
# engine suite on SmolLM2 with near-ties allowed on the GPU).
. "$(dirname "$0")/run_lib.sh"
default_model "${2:-}"
gpu_test
sed -n '/^== SLUICE_TEST_DEVICE=cuda build/,/passed,/p' "$L/gpu_test.log" | head -40
grep -h "near-ties" "$L/gpu_test.log"

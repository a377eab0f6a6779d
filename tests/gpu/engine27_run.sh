#!/usr/bin/env bash
# engine27_run.sh LOGDIR MODEL_XZ_PART2 - the default model assembled from
# two parts (final27b_run.sh says why), then make gpu-test's suite (the
# engine suite on SmolLM2 with near-ties allowed on the GPU).
. "$(dirname "$0")/run_lib.sh"
M=models/SmolLM2-135M-Instruct.Q4_1.gguf
if [ -f /tmp/keep/pa ] && [ -f "${2:-}" ]; then
    mkdir -p models
    cat /tmp/keep/pa "$2" | python3 -c "import lzma,sys; sys.stdout.buffer.write(lzma.decompress(sys.stdin.buffer.read()))" > $M
    echo "model: $(sha256sum $M | cut -c1-16) (want b179c9523d0e6a0f)"
else
    echo "model: a part is missing, SmolLM2 skipped"
fi
gpu_test
sed -n '/^== SLUICE_TEST_DEVICE=cuda build/,/passed,/p' "$L/gpu_test.log" | head -40
grep -h "near-ties" "$L/gpu_test.log"

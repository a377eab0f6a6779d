#!/usr/bin/env bash
# tp2_18_run.sh LOGDIR - the eighteenth round at TP=2 (two GPUs): end to
# end against the CPU and against TP=1 (the long chunks split per rank's
# KV heads), the engine suite.
. "$(dirname "$0")/run_lib.sh"
nvidia-smi -L
t e2e_tp2 150 env SLUICE_TEST_TP=2 build/tests/gpu/test_gpu_e2e
t e2e_tp2_ref 150 env SLUICE_TEST_TP=2 SLUICE_TEST_REF=cuda build/tests/gpu/test_gpu_e2e
t engine_tp2 150 env SLUICE_TEST_TP=2 SLUICE_TEST_DEVICE=cuda SLUICE_TEST_MODEL=tests/models/tiny-qwen3 build/tests/test_engine
t engine_tp2_d128 150 env SLUICE_TEST_TP=2 SLUICE_TEST_DEVICE=cuda SLUICE_TEST_MODEL=tests/models/tiny-qwen3-d128 build/tests/test_engine
grep -hE "over [0-9]+ cached|^FAIL|failed:|skipped" "$L"/e2e_tp2*.log "$L"/engine_tp2*.log | head -30

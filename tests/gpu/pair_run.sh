#!/usr/bin/env bash
# pair_run.sh LOGDIR - experiment: the one-token qkv GEMV (norm prologue)
# with two rows per warp, 3 blocks an SM, so its 6144 rows run in one wave
# (SLUICE_GEMV_PAIR=1, the default since; 0: one row a warp). GEMV tests,
# e2e and the engine suite with it, then
# batch-1 decode alternating.
. "$(dirname "$0")/run_lib.sh"
nvidia-smi -L
export SLUICE_GEMV_PAIR=1
t gemv_pair 240 env SLUICE_TEST_ONLY=gemv build/tests/gpu/test_kernels
t e2e_pair 120 build/tests/gpu/test_gpu_e2e
t engine_pair 120 env SLUICE_TEST_DEVICE=cuda SLUICE_TEST_MODEL=tests/models/tiny-qwen3 build/tests/test_engine
unset SLUICE_GEMV_PAIR
ab_b1 SLUICE_GEMV_PAIR 2 0 1

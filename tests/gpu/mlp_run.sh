#!/usr/bin/env bash
# mlp_run.sh LOGDIR - the decode MLP whose down GEMV reads h as gate/up
# stores it (cuda_gemv_mlp, tagged words): the GEMV tests and the MLP test
# under memcheck, e2e with it taken at SmolLM2's F = 1536
# (SLUICE_GEMV_MMA_MIN_IN=1536) and without, e2e and the engine suite as
# they are, then batch-1 decode alternating SLUICE_GEMV_TAGGED=0 / 1.
. "$(dirname "$0")/run_lib.sh"
nvidia-smi -L
K=build/tests/gpu/test_kernels
t gemv 300 env SLUICE_TEST_ONLY=gemv $K
grep -E "FAIL|failed:|mlp " "$L/gemv.log" | head -20
t memcheck_mlp 300 env SLUICE_TEST_ONLY=gemv_mlp compute-sanitizer --tool memcheck $K
t e2e_tagged 120 env SLUICE_GEMV_MMA_MIN_IN=1536 build/tests/gpu/test_gpu_e2e
t e2e_plain 120 env SLUICE_GEMV_MMA_MIN_IN=1536 SLUICE_GEMV_TAGGED=0 build/tests/gpu/test_gpu_e2e
grep -E "FAIL|failed:" "$L/e2e_tagged.log" | head
ab_b1 SLUICE_GEMV_TAGGED 2 0 1
e2e_tests

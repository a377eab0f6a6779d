#!/usr/bin/env bash
# final23_run.sh LOGDIR - the twenty-third round's tree on one H200: make
# gpu-test; the tagged MLP's test under memcheck and racecheck, e2e with the
# tagged MLP taken at SmolLM2's F = 1536 under memcheck; batch-1 decode
# alternating SLUICE_GEMV_TAGGED=0 / 1; decode at batches 1-8, 64, 256; then
# bench_gpu (TTFT, the 16K prefill step).
. "$(dirname "$0")/run_lib.sh"
nvidia-smi -L
gpu_test
K=build/tests/gpu/test_kernels
t memcheck_mlp 120 env SLUICE_TEST_ONLY=gemv_mlp compute-sanitizer --tool memcheck $K
t racecheck_mlp 120 env SLUICE_TEST_ONLY=gemv_mlp compute-sanitizer --tool racecheck $K
t memcheck_e2e_tagged 240 env SLUICE_GEMV_MMA_MIN_IN=1536 compute-sanitizer --tool memcheck build/tests/gpu/test_gpu_e2e
ab_b1 SLUICE_GEMV_TAGGED 3 0 1
batches_bench 1

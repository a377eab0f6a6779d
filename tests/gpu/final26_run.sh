#!/usr/bin/env bash
# final26_run.sh LOGDIR - the twenty-sixth round's tree: batch 1/8/64/256
# decode against the last round's (build/old_bench_gpu, 3d81253),
# alternating; compute-sanitizer on the RoPE-fold decode tests; make
# gpu-test's suite.
. "$(dirname "$0")/run_lib.sh"
nvidia-smi -L
builds_decode 2 old_bench_gpu tests/gpu/bench_gpu
K=build/tests/gpu/test_kernels
t memcheck_fold 120 env SLUICE_TEST_ONLY=rope_fold compute-sanitizer --tool memcheck $K
t racecheck_fold 120 env SLUICE_TEST_ONLY=rope_fold compute-sanitizer --tool racecheck $K
gpu_test

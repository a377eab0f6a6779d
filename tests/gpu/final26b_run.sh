#!/usr/bin/env bash
# final26b_run.sh LOGDIR - the early cos/sin and the idle blocks' exit held
# to the plain decode build: decode at batches 1, 8, 64, 256 against
# 3d81253 (build/old_bench_gpu) and 6ab31ce (build/mid_bench_gpu),
# alternating; the RoPE-fold tests under compute-sanitizer; make gpu-test.
. "$(dirname "$0")/run_lib.sh"
nvidia-smi -L
builds_decode 2 old_bench_gpu mid_bench_gpu tests/gpu/bench_gpu
K=build/tests/gpu/test_kernels
t memcheck_fold 120 env SLUICE_TEST_ONLY=rope_fold compute-sanitizer --tool memcheck $K
gpu_test

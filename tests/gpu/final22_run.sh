#!/usr/bin/env bash
# final22_run.sh LOGDIR - the twenty-second round's tree on one H200: make
# gpu-test, the RoPE-fold decode tests under memcheck and racecheck, e2e
# under memcheck, then
# decode at batches 1-8, 64 and 256 (two rounds) and the 16K prefill step.
. "$(dirname "$0")/run_lib.sh"
nvidia-smi -L
gpu_test
K=build/tests/gpu/test_kernels
t memcheck_fold 240 env SLUICE_TEST_ONLY=rope_fold compute-sanitizer --tool memcheck $K
t memcheck_e2e 240 compute-sanitizer --tool memcheck build/tests/gpu/test_gpu_e2e
t racecheck_fold 240 env SLUICE_TEST_ONLY=rope_fold compute-sanitizer --tool racecheck $K
batches_bench 2

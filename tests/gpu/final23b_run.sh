#!/usr/bin/env bash
# final23b_run.sh LOGDIR - the twenty-third round's last tree on one H200
# (the tagged MLP and the decode attention launched early): make gpu-test;
# the RoPE-fold decode tests under memcheck and racecheck, the tagged MLP's
# test and e2e under memcheck; batch-1 decode alternating
# SLUICE_CUDA_ATTN_PDL=0 / 1; decode at batches 1-8, 64, 256; bench_gpu.
. "$(dirname "$0")/run_lib.sh"
nvidia-smi -L
gpu_test
K=build/tests/gpu/test_kernels
t memcheck_fold 240 env SLUICE_TEST_ONLY=rope_fold compute-sanitizer --tool memcheck $K
t racecheck_fold 240 env SLUICE_TEST_ONLY=rope_fold compute-sanitizer --tool racecheck $K
t memcheck_mlp 120 env SLUICE_TEST_ONLY=gemv_mlp compute-sanitizer --tool memcheck $K
t memcheck_e2e 240 compute-sanitizer --tool memcheck build/tests/gpu/test_gpu_e2e
ab_b1 SLUICE_CUDA_ATTN_PDL 2 0 1
batches_bench 1

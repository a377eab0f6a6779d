#!/usr/bin/env bash
# final27b_run.sh LOGDIR [MODEL_XZ_PART2] - the twenty-seventh round's tree
# (X_FETCH removed): the default model assembled from two parts (it is
# larger than one call's tree: the first part was left in /tmp/keep by the
# call before, the second travels with this one), then make gpu-test's
# suite (test_gpu_e2e runs SmolLM2 against the CPU backend and HF's
# goldens when the model is there), decode batches against the last
# round's tree (build/old_bench_gpu, fb72a36), memcheck on the sampler
# and e2e (rank 0's kernels write mapped host memory).
. "$(dirname "$0")/run_lib.sh"
nvidia-smi -L
default_model "${2:-}"
gpu_test
grep -A12 "^smollm2" "$L/gpu_test.log" | head -40
grep -E "near-ties" "$L/gpu_test.log" | head -4
builds_decode 2 old_bench_gpu tests/gpu/bench_gpu
t memcheck_sample 120 compute-sanitizer --tool memcheck build/tests/gpu/test_sample
t memcheck_e2e 150 compute-sanitizer --tool memcheck build/tests/gpu/test_gpu_e2e

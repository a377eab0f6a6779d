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
D="SLUICE_BENCH_ONLY=decode SLUICE_BENCH_DECODE=1x1024,1x1024,8x1024,64x1024,256x1024"
for r in 1 2; do
  for b in old_bench_gpu tests/gpu/bench_gpu; do
    timeout -k 5 90 env $D build/$b >"$L/d_$(basename $b)_$r.log" 2>&1
    echo "$b rc=$?: $(grep -E '^decode batch' "$L/d_$(basename $b)_$r.log" | sed 's/ ctx//; s/floor.*//; s/ms.step = //; s/decode batch/b/' | tr '\n' ' ')"
  done
done
t memcheck_sample 120 compute-sanitizer --tool memcheck build/tests/gpu/test_sample
t memcheck_e2e 150 compute-sanitizer --tool memcheck build/tests/gpu/test_gpu_e2e

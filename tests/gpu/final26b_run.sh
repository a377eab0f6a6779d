#!/usr/bin/env bash
# final26b_run.sh LOGDIR - the early cos/sin and the idle blocks' exit held
# to the plain decode build: decode at batches 1, 8, 64, 256 against
# 3d81253 (build/old_bench_gpu) and 6ab31ce (build/mid_bench_gpu),
# alternating; the RoPE-fold tests under compute-sanitizer; make gpu-test.
. "$(dirname "$0")/run_lib.sh"
nvidia-smi -L
D="SLUICE_BENCH_ONLY=decode SLUICE_BENCH_DECODE=1x1024,1x1024,8x1024,64x1024,256x1024"
for r in 1 2; do
    for b in old_bench_gpu mid_bench_gpu tests/gpu/bench_gpu; do
        timeout -k 5 90 env $D build/$b >"$L/d_$(basename $b)_$r.log" 2>&1
        echo "$b rc=$?: $(grep -E '^decode batch' "$L/d_$(basename $b)_$r.log" | sed 's/ ctx//; s/floor.*//; s/ms.step = //; s/decode batch/b/' | tr '\n' ' ')"
    done
done
K=build/tests/gpu/test_kernels
t memcheck_fold 120 env SLUICE_TEST_ONLY=rope_fold compute-sanitizer --tool memcheck $K
gpu_test

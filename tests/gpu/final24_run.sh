#!/usr/bin/env bash
# final24_run.sh LOGDIR - the twenty-fourth round's tree: make gpu-test,
# sanitizers on the RoPE-fold decode tests (both builds of the decode
# kernel), decode batches 16-256 with its 3-blocks-an-SM build off / on,
# then batches_bench (batches 1-8, 64, 256, bench_gpu).
. "$(dirname "$0")/run_lib.sh"
nvidia-smi -L
gpu_test
K=build/tests/gpu/test_kernels
t memcheck_fold 240 env SLUICE_TEST_ONLY=rope_fold compute-sanitizer --tool memcheck $K
t racecheck_fold 300 env SLUICE_TEST_ONLY=rope_fold compute-sanitizer --tool racecheck $K
for v in 0 4; do
    timeout -k 5 150 env SLUICE_CUDA_DEC_WIDE_T=$v SLUICE_BENCH_ONLY=decode SLUICE_BENCH_DECODE=16x1024,32x1024,64x1024,256x1024 \
        build/tests/gpu/bench_gpu >"$L/wide_$v.log" 2>&1
    echo "SLUICE_CUDA_DEC_WIDE_T=$v rc=$?: $(grep -E '^decode batch' "$L/wide_$v.log" | sed 's/ ctx//; s/floor.*//; s/ms.step = //; s/decode batch/b/' | tr '\n' ' ')"
done
batches_bench 2

#!/usr/bin/env bash
# final25b_run.sh LOGDIR - the last code commit (the plain decode build's
# merge from shared memory on by default): make gpu-test, batch-1 decode
# with SLUICE_CUDA_DEC_MSM=0 / default.
. "$(dirname "$0")/run_lib.sh"
nvidia-smi -L
gpu_test
for r in 1 2; do
    for v in 0 1; do
        timeout -k 5 60 env SLUICE_CUDA_DEC_MSM=$v SLUICE_BENCH_ONLY=decode SLUICE_BENCH_DECODE=1x1024,1x1024,8x1024 build/tests/gpu/bench_gpu >"$L/b_${v}_$r.log" 2>&1
        echo "MSM=$v rc=$?: $(grep -E '^decode batch' "$L/b_${v}_$r.log" | sed 's/ ctx//; s/floor.*//; s/ms.step = //; s/decode batch/b/' | tr '\n' ' ')"
    done
done

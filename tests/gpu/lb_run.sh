#!/usr/bin/env bash
# lb_run.sh LOGDIR - experiment: the decode kernel's plain build (169
# registers) against builds with __launch_bounds__(128, 1) (176) and
# (128, 2) (175), SLUICE_CUDA_DEC_LB=0|1|2: batch-1 decode, alternating,
# and batch 2.
. "$(dirname "$0")/run_lib.sh"
nvidia-smi -L
for r in 1 2 3; do
    for v in 0 1 2; do
        timeout -k 5 120 env SLUICE_CUDA_DEC_LB=$v SLUICE_BENCH_ONLY=decode SLUICE_BENCH_DECODE=1x1024,2x1024 build/tests/gpu/bench_gpu >"$L/lb_${v}_$r.log" 2>&1
        echo "LB=$v round $r rc=$?: $(grep -E '^decode batch' "$L/lb_${v}_$r.log" | sed 's/ ctx//; s/floor.*//; s/ms.step = //; s/decode batch/b/' | tr '\n' ' ')"
    done
done
t k_fold 120 env SLUICE_CUDA_DEC_LB=1 SLUICE_TEST_ONLY=rope_fold build/tests/gpu/test_kernels

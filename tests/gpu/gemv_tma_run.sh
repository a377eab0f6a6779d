#!/bin/bash
# gemv_tma_run.sh - cuda_gemv_tma on one GPU: the GEMV tests (bit for bit
# against gemv.cu's kernels), the backend with it against the kernel path and
# the CPU, memcheck on its kernel test, then batch-1 decode (bench_gpu) with
# each fused GEMV on it (SLUICE_CUDA_GEMV_TMA bits: 1 qkv, 2 o, 4 gate|up,
# 8 down) against none, alternating, REPS rounds; CONFIG: MASK or
# MASK:SLOTS:EARLY (SLUICE_GEMV_TMA_SLOTS, SLUICE_GEMV_TMA_EARLY).
#   tests/gpu/gemv_tma_run.sh LOGDIR REPS [CONFIG...]
. "$(dirname "$0")/run_lib.sh"
t gemv 120 env SLUICE_TEST_ONLY=gemv build/tests/gpu/test_kernels
grep -E "FAIL|CHECK|note" "$L/gemv.log" | head
t e2e 120 build/tests/gpu/test_gemv_tma_e2e
grep -E "context|FAIL|CHECK|note" "$L/e2e.log" | head -12
t memcheck 240 env SLUICE_TEST_ONLY=gemv_tma compute-sanitizer --tool memcheck build/tests/gpu/test_kernels
B=build/tests/gpu/bench_gpu
d() { # NAME ENV...
    local n=$1
    shift
    t "$n" 30 env "$@" SLUICE_BENCH_ONLY=decode $B
    echo "   $(grep -E 'decode batch 1' "$L/$n.log")"
}
reps=$2
shift 2
for r in $(seq "$reps"); do
    d k$r SLUICE_CUDA_GEMV_TMA=0
    for c in "$@"; do
        IFS=: read -r m ns e <<<"$c"
        d "t${m}_${ns:-d}_${e:-d}_$r" SLUICE_CUDA_GEMV_TMA=$m ${ns:+SLUICE_GEMV_TMA_SLOTS=$ns} ${e:+SLUICE_GEMV_TMA_EARLY=$e}
    done
done

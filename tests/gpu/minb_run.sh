#!/usr/bin/env bash
# minb_run.sh LOGDIR - the one-row warp GEMVs compiled for more blocks an SM
# (SLUICE_GEMV_MINB for the plain kernels, SLUICE_GEMV_MINBS for SwiGLU's):
# the GEMV tests under some settings (every row against the reference, the
# fusions bit for bit the unfused kernels), then batch-1 decode (bench_gpu,
# Llama-3.1-8B shape) for each setting in CFGS and for the previous build's
# bench_gpu (build/tests/gpu/bench_gpu_prev, "prev") if present,
# alternating, ROUNDS times (default 2).
. "$(dirname "$0")/run_lib.sh"
nvidia-smi -L
K=build/tests/gpu/test_kernels
t gemv_def 180 env SLUICE_TEST_ONLY=gemv $K
t gemv_6_3 180 env SLUICE_TEST_ONLY=gemv SLUICE_GEMV_MINB=6 SLUICE_GEMV_MINBS=3 $K
t gemv_8_4 180 env SLUICE_TEST_ONLY=gemv SLUICE_GEMV_MINB=8 SLUICE_GEMV_MINBS=4 $K
grep -E "FAIL|failed:" "$L"/gemv_*.log | head
B=build/tests/gpu/bench_gpu
CFGS=${CFGS:-"prev def MINB=5 MINB=6 MINB=8 MINBS=3 MINBS=4 MINB=6,MINBS=3"}
for r in $(seq 1 "${ROUNDS:-2}"); do
  for c in $CFGS; do
    b=$B; envs=()
    if [ "$c" = prev ]; then [ -x ${B}_prev ] || continue; b=${B}_prev
    elif [ "$c" != def ]; then for kv in ${c//,/ }; do envs+=("SLUICE_GEMV_$kv"); done; fi
    n="dec_${c//[=,]/_}_$r"
    timeout -k 5 120 env SLUICE_BENCH_ONLY=decode "${envs[@]}" $b > "$L/$n.log" 2>&1
    echo "$c round $r rc=$?: $(grep -E 'decode batch 1' "$L/$n.log")"
  done
done

#!/usr/bin/env bash
# rpw_run.sh LOGDIR - the warp GEMV with several rows per warp
# (SLUICE_GEMV_RPW / SLUICE_GEMV_RPWN) and the norm kernels' early second
# batch (SLUICE_GEMV_PRE): the GEMV tests under each setting (every row
# against the reference, the fusions bit for bit the unfused kernels), then
# batch-1 decode (bench_gpu, Llama-3.1-8B shape) for each setting and for
# build/sluice_prev's bench_gpu (build/tests/gpu/bench_gpu_prev) if present,
# alternating, ROUNDS times (default 2).
. "$(dirname "$0")/run_lib.sh"
nvidia-smi -L
K=build/tests/gpu/test_kernels
t gemv_def 180 env SLUICE_TEST_ONLY=gemv $K
t gemv_r3n2p 180 env SLUICE_TEST_ONLY=gemv SLUICE_GEMV_RPW=3 SLUICE_GEMV_RPWN=2 SLUICE_GEMV_PRE=1 $K
t gemv_r5n7 180 env SLUICE_TEST_ONLY=gemv SLUICE_GEMV_RPW=5 SLUICE_GEMV_RPWN=7 $K
grep -E "FAIL|failed:" "$L"/gemv_*.log | head
B=build/tests/gpu/bench_gpu
CFGS=${CFGS:-"prev def PRE=1 RPWN=2 RPWN=4 RPWN=8 RPW=2 RPW=4 RPWN=4,PRE=1 RPW=2,RPWN=4"}
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

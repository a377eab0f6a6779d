#!/usr/bin/env bash
# abl23_run.sh LOGDIR - the round's final tree: batch-1 decode with each of
# its switches off in turn (SLUICE_GEMV_TAGGED=0, SLUICE_CUDA_ATTN_PDL=0,
# SLUICE_GEMV_PAIR=0) against all on, alternating, two rounds.
. "$(dirname "$0")/run_lib.sh"
nvidia-smi -L
for r in 1 2; do
  for v in NONE SLUICE_GEMV_TAGGED SLUICE_CUDA_ATTN_PDL SLUICE_GEMV_PAIR; do
    timeout -k 5 120 env $v=0 SLUICE_BENCH_ONLY=decode build/tests/gpu/bench_gpu > "$L/dec_${v}_$r.log" 2>&1
    echo "off=$v round $r rc=$?: $(grep -E '^decode batch 1 ' "$L/dec_${v}_$r.log")"
  done
done

#!/usr/bin/env bash
# attn_pdl_run.sh LOGDIR - experiment: the decode attention launched early
# (SLUICE_CUDA_ATTN_PDL=1: PDL attribute, its first K/V tile requested
# while the qkv GEMV still runs, griddepcontrol.wait before q). Its tests,
# e2e and the engine suite with it on, then decode alternating 0 / 1.
. "$(dirname "$0")/run_lib.sh"
nvidia-smi -L
export SLUICE_CUDA_ATTN_PDL=1
dec_tests rope_fold
unset SLUICE_CUDA_ATTN_PDL
for r in 1 2; do
  for v in 0 1; do
    timeout -k 5 120 env SLUICE_BENCH_ONLY=decode SLUICE_BENCH_DECODE=8x1024,64x1024 SLUICE_CUDA_ATTN_PDL=$v build/tests/gpu/bench_gpu > "$L/dec_${v}_$r.log" 2>&1
    echo "attn_pdl=$v round $r rc=$?: $(grep -E '^decode batch' "$L/dec_${v}_$r.log" | tr '\n' ' ')"
  done
done

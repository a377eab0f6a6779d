#!/usr/bin/env bash
# attn_blk_run.sh LOGDIR - experiment: one layer's decode attention block by
# block (SLUICE_CUDA_TRACE), tickets and clusters, with and without EARLY.
. "$(dirname "$0")/run_lib.sh"
nvidia-smi -L
for c in "" "SLUICE_CUDA_DEC_EARLY=1" "SLUICE_CUDA_DEC_CLUSTER=1" "SLUICE_CUDA_DEC_EARLY=1 SLUICE_CUDA_DEC_CLUSTER=1"; do
  timeout -k 5 120 env SLUICE_BENCH_ONLY=decode SLUICE_CUDA_TRACE=20 $c build/tests/gpu/bench_gpu > "$L/blk.log" 2>&1
  echo "== $c"; grep -E "trace attn block|trace mean attn|^trace  8[0-3] |^decode batch 1 " "$L/blk.log"
done

#!/usr/bin/env bash
# ablate_run.sh - where a batch-1 decode step of the Llama-3.1-8B shape goes
# inside the graph: the step time with each kernel class left out
# (SLUICE_CUDA_ABLATE; outputs wrong, timing only), under $CFG (default
# SLUICE_CUDA_FUSED=0, so that the RMSNorms are kernels of their own). Logs
# under $1; one line per setting on stdout.
. "$(dirname "$0")/run_lib.sh"
for ab in none attn norm qkv o gu down head attn,norm qkv,o,gu,down ${EXTRA_ABLATE:-}; do
    n=abl_$(echo "$ab" | tr ',' '_')
    t "$n" 60 env ${CFG:-SLUICE_CUDA_FUSED=0} SLUICE_CUDA_ABLATE=$([ "$ab" = none ] || echo "$ab") SLUICE_BENCH_ONLY=decode build/tests/gpu/bench_gpu >/dev/null
    echo "  [$ab] $(grep -E '^decode' "$L/$n.log" | sed -E 's/ ctx: / /; s/; floor.*//' | tr '\n' ' ')"
done

#!/usr/bin/env bash
# overhead_run.sh LOGDIR - what a batch-1 decode step costs besides its
# layers: bench_gpu's batch-1 decode as built, with every layer kernel left
# out (SLUICE_CUDA_ABLATE, outputs wrong: embedding, final norm, argmax,
# graph launch, the host's step), and with the LM head kept too; twice.
. "$(dirname "$0")/run_lib.sh"
for r in 1 2; do
  for a in none "attn,norm,qkv,o,gu,down,head" "attn,norm,qkv,o,gu,down"; do
    n=$(echo "$a" | tr ',' '_')
    if [ "$a" = none ]; then e=""; else e="SLUICE_CUDA_ABLATE=$a"; fi
    t "dec_${n}_$r" 60 env $e SLUICE_BENCH_ONLY=decode build/tests/gpu/bench_gpu
    echo "  ablate=$a: $(grep -E 'decode batch 1' "$L/dec_${n}_$r.log" | sed -E 's/; floor.*//')"
  done
done

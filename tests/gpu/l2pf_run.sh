#!/usr/bin/env bash
# l2pf_run.sh LOGDIR - experiment: batch-1 decode with the next kernel's
# weights asked of L2 ahead of use (SLUICE_CUDA_L2PF_O=MB: the o weights by
# the decode attention's blocks; SLUICE_CUDA_L2PF=MB: each fused GEMV's
# warps, once done, the next GEMV's first MB). e2e with both on first.
# Rounds alternate the settings in CONFIGS ("O,G" pairs).
. "$(dirname "$0")/run_lib.sh"
nvidia-smi -L
t e2e_pf 120 env SLUICE_CUDA_L2PF_O=8 SLUICE_CUDA_L2PF=4 build/tests/gpu/test_gpu_e2e
CONFIGS=${CONFIGS:-"0,0 8,0 16,0 32,0 0,8 0,16 0,32 16,8 32,16"}
for r in ${ROUNDS:-1 2}; do
  for c in $CONFIGS; do
    o=${c%,*} g=${c#*,}
    timeout -k 5 120 env SLUICE_BENCH_ONLY=decode SLUICE_CUDA_L2PF_O=$o SLUICE_CUDA_L2PF=$g build/tests/gpu/bench_gpu > "$L/dec_${o}_${g}_$r.log" 2>&1
    echo "o=$o g=$g round $r rc=$?: $(grep -E '^decode batch 1 ' "$L/dec_${o}_${g}_$r.log")"
  done
done

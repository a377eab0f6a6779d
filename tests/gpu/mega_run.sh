#!/bin/bash
# mega_run.sh - cuda_mega (SLUICE_CUDA_MEGA=1) on one GPU: its test, then
# batch-1 decode (bench_gpu) against the kernel path, per ring slots issued
# past the current phase (SLUICE_MEGA_AHEAD), with and without attention
# (SLUICE_CUDA_ABLATE=attn; outputs wrong), REPS rounds.
#   tests/gpu/mega_run.sh LOGDIR REPS [AHEAD...]
. "$(dirname "$0")/run_lib.sh"
t mega 90 build/tests/gpu/test_mega
grep -E "context|FAIL|CHECK" "$L/mega.log" | head -30
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
    d k$r SLUICE_CUDA_MEGA=0
    for i in "$@"; do d m${i}_$r SLUICE_CUDA_MEGA=1 SLUICE_MEGA_AHEAD=$i; done
    d ak$r SLUICE_CUDA_MEGA=0 SLUICE_CUDA_ABLATE=attn
    for i in "$@"; do d am${i}_$r SLUICE_CUDA_MEGA=1 SLUICE_MEGA_AHEAD=$i SLUICE_CUDA_ABLATE=attn; done
done

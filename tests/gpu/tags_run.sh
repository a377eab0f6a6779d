#!/usr/bin/env bash
# tags_run.sh LOGDIR - the decode attention's splits merged through tagged
# words (SLUICE_CUDA_DEC_TAGS, default on) against the ticket merge (=0) and
# the tree before (build/old_bench_gpu, when carried): batch-1 decode
# alternating, batches 2-8; then the decode-kernel tests, sanitizers on the
# RoPE-fold tests, e2e and the engine suite.
. "$(dirname "$0")/run_lib.sh"
nvidia-smi -L
b1() { # NAME BIN ENV...
    local n=$1 bin=$2
    shift 2
    timeout -k 5 120 env "$@" SLUICE_BENCH_ONLY=decode SLUICE_BENCH_DECODE=1x1024,2x1024,4x1024,8x1024 "$bin" >"$L/b_$n.log" 2>&1
    echo "$n rc=$?: $(grep -E '^decode batch' "$L/b_$n.log" | sed 's/ ctx//; s/floor.*//; s/ms.step = //' | tr '\n' ' ')"
}
for r in 1 2; do
    [ -x build/old_bench_gpu ] && b1 old_$r build/old_bench_gpu X=1
    b1 tickets_$r build/tests/gpu/bench_gpu SLUICE_CUDA_DEC_TAGS=0
    b1 tags_$r build/tests/gpu/bench_gpu SLUICE_CUDA_DEC_TAGS=1
done
dec_tests "${FOLD:-rope_fold}"

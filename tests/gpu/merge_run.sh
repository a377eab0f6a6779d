#!/usr/bin/env bash
# merge_run.sh LOGDIR - the o GEMV's residual read after the wait (mid) and
# the decode merge's loads in one round (new), against the tree before
# (old): batch-1 decode alternating; then the decode-kernel tests, the
# sanitizers on the RoPE-fold tests, the GEMV tests, e2e and the engine.
. "$(dirname "$0")/run_lib.sh"
nvidia-smi -L
K=build/tests/gpu/test_kernels
b1() { # NAME BIN
    timeout -k 5 120 env SLUICE_BENCH_ONLY=decode SLUICE_BENCH_DECODE=1x1024,1x1024,2x1024,8x1024,64x1024 "$2" >"$L/b_$1.log" 2>&1
    echo "$1 rc=$?: $(grep -E '^decode batch' "$L/b_$1.log" | sed 's/ ctx//; s/floor.*//; s/ms.step = //; s/decode batch/b/' | tr '\n' ' ')"
}
for r in 1 2 3; do
    b1 old_$r build/old_bench_gpu
    b1 mid_$r build/mid_bench_gpu
    b1 new_$r build/tests/gpu/bench_gpu
done
t k_gemv 120 env SLUICE_TEST_ONLY=gemv $K
dec_tests rope_fold

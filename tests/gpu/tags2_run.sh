#!/usr/bin/env bash
# tags2_run.sh LOGDIR - decode at batches 1-8, alternating: the tree before
# (build/old_bench_gpu), the same with the decode kernel at 3 blocks an SM
# (build/old_lb3_bench_gpu: __launch_bounds__(128, 3)), and this tree with
# the splits merged by tickets (SLUICE_CUDA_DEC_TAGS=0) and tagged words.
. "$(dirname "$0")/run_lib.sh"
nvidia-smi -L
b1() { # NAME BIN ENV...
    local n=$1 bin=$2
    shift 2
    timeout -k 5 120 env "$@" SLUICE_BENCH_ONLY=decode SLUICE_BENCH_DECODE=1x1024,2x1024,4x1024,8x1024 "$bin" >"$L/b_$n.log" 2>&1
    echo "$n rc=$?: $(grep -E '^decode batch' "$L/b_$n.log" | sed 's/ ctx//; s/floor.*//; s/ms.step = //' | tr '\n' ' ')"
}
for r in 1 2; do
    b1 old_$r build/old_bench_gpu X=1
    b1 old_lb3_$r build/old_lb3_bench_gpu X=1
    b1 tickets_$r build/tests/gpu/bench_gpu SLUICE_CUDA_DEC_TAGS=0
    b1 tags_$r build/tests/gpu/bench_gpu SLUICE_CUDA_DEC_TAGS=1
done
t k_dec 180 env SLUICE_TEST_ONLY=attention_decode build/tests/gpu/test_kernels
t k_fold 180 env SLUICE_TEST_ONLY=rope_fold build/tests/gpu/test_kernels

#!/usr/bin/env bash
# wide_run.sh LOGDIR - the decode kernel's build at 3 blocks an SM for steps
# of SLUICE_CUDA_DEC_WIDE_T tokens and more (default 4; 0 never), against
# the tree before (build/old_bench_gpu, when carried): decode at 1K context,
# batches 1-32 alternating; then the decode-kernel tests.
. "$(dirname "$0")/run_lib.sh"
nvidia-smi -L
b1() { # NAME BIN ENV...
    local n=$1 bin=$2
    shift 2
    timeout -k 5 120 env "$@" SLUICE_BENCH_ONLY=decode SLUICE_BENCH_DECODE=1x1024,2x1024,4x1024,8x1024,16x1024,32x1024 "$bin" >"$L/b_$n.log" 2>&1
    echo "$n rc=$?: $(grep -E '^decode batch' "$L/b_$n.log" | sed 's/ ctx//; s/floor.*//; s/ms.step = //; s/decode batch/b/' | tr '\n' ' ')"
}
for r in 1 2; do
    [ -x build/old_bench_gpu ] && b1 old_$r build/old_bench_gpu X=1
    b1 never_$r build/tests/gpu/bench_gpu SLUICE_CUDA_DEC_WIDE_T=0
    b1 wide4_$r build/tests/gpu/bench_gpu SLUICE_CUDA_DEC_WIDE_T=4
    b1 wide2_$r build/tests/gpu/bench_gpu SLUICE_CUDA_DEC_WIDE_T=2
done
t k_dec 180 env SLUICE_TEST_ONLY=attention_decode build/tests/gpu/test_kernels
t k_kv8 180 env SLUICE_TEST_ONLY=kv8 build/tests/gpu/test_kernels
t k_fold 180 env SLUICE_TEST_ONLY=rope_fold build/tests/gpu/test_kernels
t e2e 120 build/tests/gpu/test_gpu_e2e
t engine 120 env SLUICE_TEST_DEVICE=cuda SLUICE_TEST_MODEL=tests/models/tiny-qwen3 build/tests/test_engine

#!/usr/bin/env bash
# final24b_run.sh LOGDIR - the round's last code commit (the default of
# SLUICE_CUDA_DEC_WIDE_T stated in token x KV head pairs): decode at
# batches 1-8 and 256, default against never (=0) and 4; e2e, the engine
# suite, the decode-kernel tests.
. "$(dirname "$0")/run_lib.sh"
nvidia-smi -L
for r in 1 2; do
    for v in default 0 4; do
        e=X=1
        [ $v = default ] || e=SLUICE_CUDA_DEC_WIDE_T=$v
        timeout -k 5 120 env $e SLUICE_BENCH_ONLY=decode SLUICE_BENCH_DECODE=1x1024,2x1024,4x1024,8x1024,256x1024 build/tests/gpu/bench_gpu >"$L/w_${v}_$r.log" 2>&1
        echo "wide_t=$v round $r rc=$?: $(grep -E '^decode batch' "$L/w_${v}_$r.log" | sed 's/ ctx//; s/floor.*//; s/ms.step = //; s/decode batch/b/' | tr '\n' ' ')"
    done
done
t k_dec 180 env SLUICE_TEST_ONLY=attention_decode build/tests/gpu/test_kernels
t k_fold 120 env SLUICE_TEST_ONLY=rope_fold build/tests/gpu/test_kernels
e2e_tests

#!/usr/bin/env bash
# idle26_run.sh LOGDIR - experiment: the decode attention's idle blocks
# exiting at once, the merging block triggering the o GEMV
# (SLUICE_CUDA_DEC_X bits, attn.cu): tests, batch-1 decode alternating,
# traced steps.
. "$(dirname "$0")/run_lib.sh"
nvidia-smi -L
t k_fold 180 env SLUICE_TEST_ONLY=rope_fold build/tests/gpu/test_kernels
t k_dec 180 env SLUICE_TEST_ONLY=attention_decode build/tests/gpu/test_kernels
t e2e_x11 90 env SLUICE_CUDA_DEC_X=11 build/tests/gpu/test_gpu_e2e
t e2e_x7 90 env SLUICE_CUDA_DEC_X=7 build/tests/gpu/test_gpu_e2e
for r in 1 2; do
    for v in 1 3 7 11; do
        timeout -k 5 60 env SLUICE_CUDA_DEC_X=$v SLUICE_BENCH_ONLY=decode SLUICE_BENCH_DECODE=1x1024,1x1024,8x1024 build/tests/gpu/bench_gpu >"$L/b_${v}_$r.log" 2>&1
        echo "X=$v rc=$?: $(grep -E '^decode batch' "$L/b_${v}_$r.log" | sed 's/ ctx//; s/floor.*//; s/ms.step = //; s/decode batch/b/' | tr '\n' ' ')"
    done
done
for v in 3 11; do
    timeout -k 5 60 env SLUICE_CUDA_DEC_X=$v SLUICE_CUDA_TRACE=40 SLUICE_BENCH_ONLY=decode SLUICE_BENCH_DECODE=1x1024 build/tests/gpu/bench_gpu >"$L/trace_$v.log" 2>&1
    echo "== trace X=$v rc=$?"
    grep -E "trace mean (attn|o) " "$L/trace_$v.log"
done
t e2e_tp1 90 build/tests/gpu/test_gpu_e2e
t engine_tp1 90 env SLUICE_TEST_DEVICE=cuda SLUICE_TEST_MODEL=tests/models/tiny-qwen3 build/tests/test_engine

#!/usr/bin/env bash
# merge26_run.sh LOGDIR - experiment: the decode merge's split weights by
# warp shuffles (SLUICE_CUDA_DEC_X bit 16, attn.cu): tests, batch-1/8
# decode alternating, a traced step.
. "$(dirname "$0")/run_lib.sh"
nvidia-smi -L
t k_fold 180 env SLUICE_TEST_ONLY=rope_fold build/tests/gpu/test_kernels
t k_dec 180 env SLUICE_TEST_ONLY=attention_decode build/tests/gpu/test_kernels
t k_kv8 180 env SLUICE_TEST_ONLY=kv8 build/tests/gpu/test_kernels
t e2e_tp1 90 build/tests/gpu/test_gpu_e2e
for r in 1 2 3; do
    for v in 3 19; do
        timeout -k 5 60 env SLUICE_CUDA_DEC_X=$v SLUICE_BENCH_ONLY=decode SLUICE_BENCH_DECODE=1x1024,1x1024,8x1024,64x1024 build/tests/gpu/bench_gpu >"$L/b_${v}_$r.log" 2>&1
        echo "X=$v rc=$?: $(grep -E '^decode batch' "$L/b_${v}_$r.log" | sed 's/ ctx//; s/floor.*//; s/ms.step = //; s/decode batch/b/' | tr '\n' ' ')"
    done
done
timeout -k 5 60 env SLUICE_CUDA_DEC_X=1 SLUICE_BENCH_ONLY=decode SLUICE_BENCH_DECODE=1x1024,1x1024,8x1024 build/tests/gpu/bench_gpu >"$L/b_1.log" 2>&1
echo "X=1 rc=$?: $(grep -E '^decode batch' "$L/b_1.log" | sed 's/ ctx//; s/floor.*//; s/ms.step = //; s/decode batch/b/' | tr '\n' ' ')"
timeout -k 5 60 env SLUICE_CUDA_DEC_X=0 SLUICE_BENCH_ONLY=decode SLUICE_BENCH_DECODE=1x1024,1x1024,8x1024 build/tests/gpu/bench_gpu >"$L/b_0.log" 2>&1
echo "X=0 rc=$?: $(grep -E '^decode batch' "$L/b_0.log" | sed 's/ ctx//; s/floor.*//; s/ms.step = //; s/decode batch/b/' | tr '\n' ' ')"
timeout -k 5 60 env SLUICE_CUDA_TRACE=40 SLUICE_BENCH_ONLY=decode SLUICE_BENCH_DECODE=1x1024 build/tests/gpu/bench_gpu >"$L/trace.log" 2>&1
echo "== trace rc=$?"
grep -E "trace mean (attn|o) " "$L/trace.log"
t engine_tp1 90 env SLUICE_TEST_DEVICE=cuda SLUICE_TEST_MODEL=tests/models/tiny-qwen3 build/tests/test_engine

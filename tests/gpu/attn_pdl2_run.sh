#!/usr/bin/env bash
# attn_pdl2_run.sh LOGDIR - experiment: the decode attention launched early
# by PDL (SLUICE_CUDA_ATTN_PDL=1; 5f0067b tried it before the qkv GEMV ran
# in one wave): the decode and RoPE-fold tests and e2e with it, then decode
# at batches 1-8 alternating.
. "$(dirname "$0")/run_lib.sh"
nvidia-smi -L
export SLUICE_CUDA_ATTN_PDL=1
t k_dec 180 env SLUICE_TEST_ONLY=attention_decode build/tests/gpu/test_kernels
t k_fold 180 env SLUICE_TEST_ONLY=rope_fold build/tests/gpu/test_kernels
t e2e 120 build/tests/gpu/test_gpu_e2e
t engine 120 env SLUICE_TEST_DEVICE=cuda SLUICE_TEST_MODEL=tests/models/tiny-qwen3 build/tests/test_engine
unset SLUICE_CUDA_ATTN_PDL
for r in 1 2; do
  for v in 0 1; do
    timeout -k 5 120 env SLUICE_CUDA_ATTN_PDL=$v SLUICE_BENCH_ONLY=decode SLUICE_BENCH_DECODE=2x1024,4x1024,8x1024 build/tests/gpu/bench_gpu > "$L/dec_${v}_$r.log" 2>&1
    echo "attn_pdl=$v round $r rc=$?: $(grep -E '^decode batch' "$L/dec_${v}_$r.log" | sed 's/ ctx//; s/floor.*//; s/ms.step = //' | tr '\n' ' ')"
  done
done

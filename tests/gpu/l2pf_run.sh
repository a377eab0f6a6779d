#!/usr/bin/env bash
# l2pf_run.sh - one device call after the L2 prefetch of small decode steps
# and the prefill RoPE / RMSNorm kernels: their kernel tests (memcheck on the
# RoPE ones), end to end vs CPU/HF, the engine suite on CUDA (bf16 and fp8
# KV); batch-1 decode with the prefetch off, on (the default: all of o) and
# with part of gate|up too; batches 2-8 with and without it; the prefill
# step with the new RMSNorm kernel and without it. Logs under $1.
. "$(dirname "$0")/run_lib.sh"
nvidia-smi -L
t k_rope 120 env SLUICE_TEST_ONLY=rope build/tests/gpu/test_kernels
t k_norm 60 env SLUICE_TEST_ONLY=rmsnorm build/tests/gpu/test_kernels
grep -E "FAIL|failed:" "$L/k_rope.log" "$L/k_norm.log" | head -20
t e2e_tp1 90 build/tests/gpu/test_gpu_e2e
e="env SLUICE_TEST_DEVICE=cuda SLUICE_TEST_MODEL=tests/models/tiny-qwen3"
t engine_tp1 90 $e build/tests/test_engine
t engine_kv8 90 $e SLUICE_TEST_KV=fp8 build/tests/test_engine
grep -E "FAIL|failed:" "$L/e2e_tp1.log" "$L/engine_tp1.log" "$L/engine_kv8.log" | head
B=build/tests/gpu/bench_gpu
for v in 0 default 1000,8 1000,16 16; do
  if [ $v = default ]; then t d1_$v 60 env SLUICE_BENCH_ONLY=decode $B
  else t d1_$v 60 env SLUICE_L2_PF=$v SLUICE_BENCH_ONLY=decode $B; fi
  echo "  L2_PF=$v: $(grep -E 'decode batch 1 ' "$L/d1_$v.log")"
done
t d1_lines 60 env SLUICE_L2_PF_BULK=0 SLUICE_BENCH_ONLY=decode $B; echo "  lines: $(grep -E 'decode batch 1 ' "$L/d1_lines.log")"
t dsmall_pf 60 env SLUICE_L2_PF_MAXT=8 SLUICE_BENCH_DECODE=2x1024,4x1024,8x1024 SLUICE_BENCH_ONLY=decode $B
t dsmall_nopf 60 env SLUICE_L2_PF=0 SLUICE_BENCH_DECODE=2x1024,4x1024,8x1024 SLUICE_BENCH_ONLY=decode $B
grep -E "decode batch [248] " "$L/dsmall_pf.log" "$L/dsmall_nopf.log"
t prefill 90 env SLUICE_BENCH_ONLY=prefill $B; grep -E "prefill" "$L/prefill.log"
t prefill_oldnorm 90 env SLUICE_CUDA_NORM_WIDE=0 SLUICE_BENCH_ONLY=prefill $B; grep -E "prefill" "$L/prefill_oldnorm.log"
t memcheck_rope 120 env SLUICE_TEST_ONLY=rope compute-sanitizer --tool memcheck build/tests/gpu/test_kernels
t memcheck_norm 60 env SLUICE_TEST_ONLY=rmsnorm compute-sanitizer --tool memcheck build/tests/gpu/test_kernels

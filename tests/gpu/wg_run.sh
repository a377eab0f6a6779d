#!/usr/bin/env bash
# wg_run.sh - the warpgroup-MMA prefill attention (attn_wg.cu): every
# attention kernel test (SLUICE_TEST_ONLY=attention: the bulk-tensor-copy
# gather by default), the prefill cases again with the cp.async gather
# (SLUICE_CUDA_ATTN_TMA=0), memcheck on the prefill cases, bench_attn with
# each gather and with attn.cu's kernel (SLUICE_CUDA_ATTN_WG=0), the prefill
# figures of bench_gpu with it and without it, then end to end. Logs under $1.
. "$(dirname "$0")/run_lib.sh"
nvidia-smi -L
K=build/tests/gpu/test_kernels
t k_attn 400 env SLUICE_TEST_ONLY=attention $K
grep -E "FAIL|failed:|wgmma" "$L/k_attn.log" | head -30
t k_tc_cpasync 300 env SLUICE_CUDA_ATTN_TMA=0 SLUICE_TEST_ONLY=attention_tc $K
grep -E "FAIL|failed:" "$L/k_tc_cpasync.log" | head
for v in "" "SLUICE_CUDA_ATTN_TMA=0" "SLUICE_CUDA_ATTN_WG=0"; do
    echo "bench_attn $v"; env $v build/tests/gpu/bench_attn | grep -E "128-row"
done
B=build/tests/gpu/bench_gpu
t pre 120 env SLUICE_BENCH_ONLY=prefill $B; grep -E "prefill" "$L/pre.log"
t pre0 120 env SLUICE_CUDA_ATTN_WG=0 SLUICE_BENCH_ONLY=prefill $B; grep -E "prefill" "$L/pre0.log"
t memcheck_tc 300 env SLUICE_TEST_ONLY=attention_tc compute-sanitizer --tool memcheck $K
e2e_tests

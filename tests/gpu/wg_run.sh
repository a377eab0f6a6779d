#!/usr/bin/env bash
# wg_run.sh - the warpgroup-MMA prefill attention (attn_wg.cu): its kernel
# tests (and the same cases on attn.cu's kernel, and with the fp8 cache),
# memcheck on them, bench_attn and the prefill figures of bench_gpu with it
# and without it (SLUICE_CUDA_ATTN_WG=0), then end to end. Logs under $1.
. "$(dirname "$0")/run_lib.sh"
nvidia-smi -L
K=build/tests/gpu/test_kernels
t k_tc 300 env SLUICE_TEST_ONLY=attention_tc $K
grep -E "FAIL|failed:|wgmma" "$L/k_tc.log" | head -30
t bench_attn 120 build/tests/gpu/bench_attn; cat "$L/bench_attn.log" | tail -8
t bench_attn0 120 env SLUICE_CUDA_ATTN_WG=0 build/tests/gpu/bench_attn; tail -8 "$L/bench_attn0.log"
B=build/tests/gpu/bench_gpu
t pre 120 env SLUICE_BENCH_ONLY=prefill $B; grep -E "prefill" "$L/pre.log"
t pre0 120 env SLUICE_CUDA_ATTN_WG=0 SLUICE_BENCH_ONLY=prefill $B; grep -E "prefill" "$L/pre0.log"
t memcheck_tc 300 env SLUICE_TEST_ONLY=attention_tc compute-sanitizer --tool memcheck $K
e2e_tests

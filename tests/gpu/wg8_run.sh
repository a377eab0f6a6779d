#!/usr/bin/env bash
# wg8_run.sh LOGDIR - the fp8 KV cache on the warpgroup prefill attention
# kernel (attn_wg.cu): the prefill attention tests with the fp8 cache (the
# warpgroup kernel, its cp.async gather, attn.cu's kernel) and the bf16
# ones (all of test_kernels), with SAN=1 only memcheck and racecheck on the fp8 ones; bench_attn per cache, the
# engine suite with the fp8 cache, bench_gpu's prefill per cache, and the
# long-context run (long_ctx_run.sh's bench_gpu part) per cache. QUICK=1:
# the fp8 tests (with each widening), bench_attn (fp8 with each widening,
# with SLUICE_CUDA_ATTN_WG8_ABLATE=1, on attn.cu's kernel), the long
# prompt, bench_gpu's prefill per cache.
. "$(dirname "$0")/run_lib.sh"
K=build/tests/gpu/test_kernels
if [ "${SAN:-0}" = 1 ]; then
    t memcheck_kv8 300 env SLUICE_TEST_ONLY=attention_tc_kv8 compute-sanitizer --tool memcheck $K
    t memcheck_wg8 120 env SLUICE_TEST_ONLY=attention_wg8_small compute-sanitizer --tool memcheck $K
    t racecheck_wg8 300 env SLUICE_TEST_ONLY=attention_wg8_small compute-sanitizer --tool racecheck $K
    t kernels 400 $K
    grep -E "FAIL|failed:" "$L/kernels.log" | head
    echo "fp8 cases on the warpgroup kernel: $(grep -cE "fp8 KV wgmma" "$L/kernels.log")"
    exit 0
fi
if [ "${QUICK:-0}" = 1 ]; then # the fp8 tests, bench_attn with and without the widening, the long prompt
    t k_tc_kv8 300 env SLUICE_TEST_ONLY=attention_tc_kv8 $K
    t k_tc_kv8_cvt0 300 env SLUICE_CUDA_ATTN_WG8_CVT=0 SLUICE_TEST_ONLY=attention_tc_kv8 $K
    t bench_attn_fp8_cvt0 120 env SLUICE_BENCH_KV=fp8 SLUICE_CUDA_ATTN_WG8_CVT=0 build/tests/gpu/bench_attn
    t bench_attn_bf16 120 build/tests/gpu/bench_attn
    t bench_attn_fp8 120 env SLUICE_BENCH_KV=fp8 build/tests/gpu/bench_attn
    t bench_attn_fp8_abl 120 env SLUICE_BENCH_KV=fp8 SLUICE_CUDA_ATTN_WG8_ABLATE=1 build/tests/gpu/bench_attn
    t bench_attn_fp8_nowg 120 env SLUICE_BENCH_KV=fp8 SLUICE_CUDA_ATTN_WG=0 build/tests/gpu/bench_attn
    grep -E "128-row" "$L"/bench_attn_*.log
    t long_fp8 240 env SLUICE_BENCH_LONG=${LONG:-131072} SLUICE_BENCH_KV=fp8 build/tests/gpu/bench_gpu
    grep -E "^long prompt" "$L/long_fp8.log"
    for kv in auto fp8; do
        t prefill_$kv 120 env SLUICE_BENCH_ONLY=prefill SLUICE_BENCH_KV=$kv build/tests/gpu/bench_gpu
        grep -h "^prefill" "$L/prefill_$kv.log"
    done
    exit 0
fi
t kernels 400 $K
grep -E "FAIL|failed:" "$L/kernels.log" | head
echo "fp8 cases on the warpgroup kernel: $(grep -cE "fp8 KV wgmma" "$L/kernels.log")"
t bench_attn_bf16 120 build/tests/gpu/bench_attn
t bench_attn_fp8 120 env SLUICE_BENCH_KV=fp8 build/tests/gpu/bench_attn
grep -E "128-row|RoPE" "$L/bench_attn_bf16.log" "$L/bench_attn_fp8.log"
t prefill_bf16 120 env SLUICE_BENCH_ONLY=prefill build/tests/gpu/bench_gpu
t prefill_fp8 120 env SLUICE_BENCH_ONLY=prefill SLUICE_BENCH_KV=fp8 build/tests/gpu/bench_gpu
grep -h "^prefill" "$L/prefill_bf16.log" "$L/prefill_fp8.log"
t long_fp8 240 env SLUICE_BENCH_LONG=${LONG:-131072} SLUICE_BENCH_KV=fp8 build/tests/gpu/bench_gpu
grep -E "^long prompt" "$L/long_fp8.log"
t engine_kv8 120 env SLUICE_TEST_DEVICE=cuda SLUICE_TEST_MODEL=tests/models/tiny-qwen3 SLUICE_TEST_KV=fp8 build/tests/test_engine

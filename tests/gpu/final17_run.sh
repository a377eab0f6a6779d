#!/usr/bin/env bash
# final17_run.sh LOGDIR - the seventeenth round's last call (one H200): the
# fp8 widening against its first version (bench_attn against bench_attn_v0,
# a build with -DSLUICE_WG8_V0, when present), the fp8 kernel tests under
# memcheck and racecheck, the long prompt with the fp8 cache, bench_gpu's
# prefill per cache, the issue's offline run with the fp8 cache, then make
# gpu-test's suite.
. "$(dirname "$0")/run_lib.sh"
K=build/tests/gpu/test_kernels
for r in 1 2; do
    t attn_fp8_$r 60 env SLUICE_BENCH_KV=fp8 build/tests/gpu/bench_attn
    [ -x build/tests/gpu/bench_attn_v0 ] && t attn_fp8_v0_$r 60 env SLUICE_BENCH_KV=fp8 build/tests/gpu/bench_attn_v0
done
t attn_bf16 60 build/tests/gpu/bench_attn
grep -E "128-row" "$L"/attn_*.log
t k_tc_kv8 120 env SLUICE_TEST_ONLY=attention_tc_kv8 $K
t memcheck_wg8 120 env SLUICE_TEST_ONLY=attention_wg8_small compute-sanitizer --tool memcheck $K
t racecheck_wg8 200 env SLUICE_TEST_ONLY=attention_wg8_small compute-sanitizer --tool racecheck $K
t long_fp8 120 env SLUICE_BENCH_LONG=131072 SLUICE_BENCH_KV=fp8 build/tests/gpu/bench_gpu
grep -E "^long" "$L/long_fp8.log"
for kv in auto fp8; do
    t prefill_$kv 60 env SLUICE_BENCH_ONLY=prefill SLUICE_BENCH_KV=$kv build/tests/gpu/bench_gpu
    grep -h "^prefill" "$L/prefill_$kv.log"
done
RB_SKIP_SMALL=1 RB_FLAGS="--kv-cache-dtype fp8" RB_TIMEOUT=150 bash tests/gpu/run_batch_gpu.sh 1000 /tmp/rb 2>&1 | tail -2
a=$(date +%s); BUILD=build timeout -k 5 ${SUITE_SECS:-300} tests/gpu/run_gpu_tests.sh > "$L/gpu_test.log" 2>&1
echo "gpu-test rc=$? $(( $(date +%s) - a ))s: $(tail -1 "$L/gpu_test.log")"
grep -E "FAIL|near-ties \(|failed:" "$L/gpu_test.log" | sort | uniq -c | head -20

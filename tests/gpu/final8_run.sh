#!/usr/bin/env bash
# final8_run.sh - the eighth round's verification on a 2-GPU host:
#   PART=1: make gpu-test (BUILD=build tests/gpu/run_gpu_tests.sh: one GPU,
#           then TP=2), bench_gpu on one GPU and at TP=2;
#   PART=2: sluice bench against sluice serve (14.6K-token prompts, cache
#           bust vs hit), compute-sanitizer memcheck and racecheck on the
#           prefill attention tests (the warpgroup kernel's cases).
# Logs under $1.
. "$(dirname "$0")/run_lib.sh"
nvidia-smi -L
if [ "${PART:-1}" = 1 ]; then
    a=$(date +%s); BUILD=build timeout -k 5 420 bash tests/gpu/run_gpu_tests.sh >"$L/gpu_test.log" 2>&1
    echo "gpu-test rc=$? $(($(date +%s) - a))s: $(tail -1 "$L/gpu_test.log")"
    grep -E "FAIL|failed:|^== " "$L/gpu_test.log" | head -30
    t bench1 120 build/tests/gpu/bench_gpu; grep -E "decode|prefill" "$L/bench1.log"
    t bench_tp2 120 env SLUICE_TEST_TP=2 SLUICE_BENCH_ONLY=prefill build/tests/gpu/bench_gpu
    grep -E "prefill" "$L/bench_tp2.log"
else
    bash "$(dirname "$0")/serve_bench_run.sh" "$L/serve"
    K=build/tests/gpu/test_kernels
    t memcheck_tc 200 env SLUICE_TEST_ONLY=attention_tc compute-sanitizer --tool memcheck $K
    t racecheck_tc 300 env SLUICE_TEST_ONLY=attention_tc compute-sanitizer --tool racecheck $K
fi

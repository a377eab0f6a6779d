#!/usr/bin/env bash
# ab_attn_run.sh - prefill attention A/B: the prefill attention tests on
# this build, then bench_attn of this build against another binary ($2,
# e.g. the previous build's bench_attn) alternating, REPS rounds (default
# 2), then the prefill figures of bench_gpu (alternating with another
# build's bench_gpu, $3, if given). Logs under $1.
. "$(dirname "$0")/run_lib.sh"
OTHER=${2:?the other bench_attn}
nvidia-smi -L
t k_tc 300 env SLUICE_TEST_ONLY=attention_tc build/tests/gpu/test_kernels
grep -E "FAIL|failed:" "$L/k_tc.log" | head
for r in $(seq "${REPS:-2}"); do
    for b in build/tests/gpu/bench_attn "$OTHER"; do
        echo "$b"; $b | grep -E "128-row"
    done
done
for r in $(seq "${REPS:-2}"); do
    for b in build/tests/gpu/bench_gpu ${3:-}; do
        echo "$b"; env SLUICE_BENCH_ONLY=prefill $b 2>&1 | grep -E "prefill"
    done
done
if [ -n "${MEMCHECK:-}" ]; then
    t memcheck_tc 200 env SLUICE_TEST_ONLY=attention_tc compute-sanitizer --tool memcheck build/tests/gpu/test_kernels
fi

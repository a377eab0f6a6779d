#!/usr/bin/env bash
# pp_run.sh - the warpgroup prefill attention with and without the
# consumers' ping-pong (SLUICE_CUDA_ATTN_PP): the attention tests on the
# default (ping-pong) build, then bench_attn alternating the two, REPS
# rounds (default 2). Logs under $1.
. "$(dirname "$0")/run_lib.sh"
nvidia-smi -L
K=build/tests/gpu/test_kernels
t k_attn 400 env SLUICE_TEST_ONLY=attention $K
grep -E "FAIL|failed:|wgmma" "$L/k_attn.log" | head -30
for r in $(seq "${REPS:-2}"); do
    for v in 1 0; do
        echo "bench_attn SLUICE_CUDA_ATTN_PP=$v"
        env SLUICE_CUDA_ATTN_PP=$v build/tests/gpu/bench_attn | grep -E "128-row"
    done
done
if [ -n "${PROF:-}" ]; then
    SLUICE_CUDA_ATTN_PP=${PROF_PP:-0} SKIP=29 bash "$(dirname "$0")/wg_prof_run.sh" "$L/prof" | tail -62
fi

#!/usr/bin/env bash
# st16_30_run.sh LOGDIR - EXPERIMENT (thirtieth round): the warpgroup prefill
# attention storing O through shared memory with 16-byte coalesced stores
# (SLUICE_CUDA_ATTN_ST16=1, the default of this build) against the
# fragment stores (=0): the attention tests with each, racecheck on them,
# bench_attn with the per-block stamps for each (twice, alternating), then
# bench_gpu's prefill for each.
. "$(dirname "$0")/run_lib.sh"
nvidia-smi -L
K=build/tests/gpu/test_kernels
t k_tc 240 env SLUICE_TEST_ONLY=attention_tc $K
t k_tc_old 240 env SLUICE_TEST_ONLY=attention_tc SLUICE_CUDA_ATTN_ST16=0 $K
t k_wg8 120 env SLUICE_TEST_ONLY=wg8 $K
grep -E "FAIL|failed:" "$L/k_tc.log" "$L/k_wg8.log" | head
for r in 1 2; do
    for v in 1 0; do t attn_$v$r 120 env SLUICE_CUDA_ATTN_ST16=$v SLUICE_BENCH_TRACE=1 build/tests/gpu/bench_attn; done
done
for f in attn_11 attn_01 attn_12 attn_02; do echo "== $f"; grep -E "128-row|trace" "$L/$f.log"; done
for r in 1; do
    for v in 1 0; do
        t pre_$v$r 200 env SLUICE_CUDA_ATTN_ST16=$v SLUICE_BENCH_ONLY=prefill build/tests/gpu/bench_gpu
        echo "ST16=$v: $(grep -h prefill "$L/pre_$v$r.log" | tr '\n' ' ')"
    done
done
t race_tc 200 env SLUICE_TEST_ONLY=attention_tc compute-sanitizer --tool racecheck $K
t mem_tc 150 env SLUICE_TEST_ONLY=attention_tc compute-sanitizer --tool memcheck $K

#!/usr/bin/env bash
# wgtrace30_run.sh LOGDIR - EXPERIMENT (thirtieth round): where the prefill
# attention's time goes at 8 prompts of 2048 against a 16K context's last
# chunk, from the warpgroup kernel's per-block %globaltimer stamps
# (bench_attn SLUICE_BENCH_TRACE=1, twice), bench_attn without them, and
# the prefill attention tests with the stamping code built in.
. "$(dirname "$0")/run_lib.sh"
nvidia-smi -L
t kernels_prefill 240 env SLUICE_TEST_ONLY=attention_tc build/tests/gpu/test_kernels
t bench_plain 120 build/tests/gpu/bench_attn
for r in 1 2; do t trace$r 120 env SLUICE_BENCH_TRACE=1 build/tests/gpu/bench_attn; done
grep -h "TFLOP\|trace" "$L/bench_plain.log" "$L/trace1.log" "$L/trace2.log"

#!/usr/bin/env bash
# norm_split_run.sh LOGDIR - the RMSNorm split across the o and gate|up
# warpgroup GEMMs (cuda_gemm_wg_residual_norm / cuda_gemm_wg_swiglu_rms):
# the warpgroup GEMM tests (RACE=1: racecheck and memcheck on the split's
# test too), PREFILL (default 2) rounds of the prefill step with the split
# on and off (SLUICE_CUDA_NORM_SPLIT), E2E=1 end to end and the engine
# suite with the warpgroup path on every step of 5+ tokens, FULL=1 then
# make gpu-test's suite (run_gpu_tests.sh).
. "$(dirname "$0")/run_lib.sh"
t kernels 60 env SLUICE_TEST_ONLY=gemm_wg build/tests/gpu/test_kernels
grep -E "FAIL|skipped|CHECK|gemm_wg_norm" "$L/kernels.log" | head -12
if [ -n "${RACE:-}" ]; then
  t racecheck 240 env SLUICE_TEST_ONLY=gemm_wg_norm compute-sanitizer --tool racecheck build/tests/gpu/test_kernels
  grep -m6 -E "CHECK|FAIL|Race reported|Error" "$L/racecheck.log" | cut -c1-220
  t memcheck 240 env SLUICE_TEST_ONLY=gemm_wg_norm compute-sanitizer --tool memcheck build/tests/gpu/test_kernels
  grep -m6 -E "CHECK|FAIL|Invalid" "$L/memcheck.log" | cut -c1-220
fi
if [ -n "${E2E:-}" ]; then
  t e2e_all 90 env SLUICE_CUDA_GEMM_WG_MIN_T=1 build/tests/gpu/test_gpu_e2e
  t engine_all 120 env SLUICE_CUDA_GEMM_WG_MIN_T=1 SLUICE_TEST_DEVICE=cuda \
    SLUICE_TEST_MODEL=tests/models/tiny-qwen3 build/tests/test_engine
  grep -hE "FAIL|near-ties \(" "$L"/e2e_all.log "$L"/engine_all.log | head
fi
for r in $(seq "${PREFILL:-2}"); do
  for m in 1 0; do
    t "prefill_${m}_$r" 60 env SLUICE_CUDA_NORM_SPLIT=$m SLUICE_BENCH_ONLY=prefill build/tests/gpu/bench_gpu
    echo "  split=$m: $(grep -E 'prefill' "$L/prefill_${m}_$r.log" | sed 's/ ([0-9]* TFLOP[^)]*)//;s/prefill //' | tr '\n' ' ')"
  done
done
if [ -n "${FULL:-}" ]; then
  BUILD=build t gputest 420 tests/gpu/run_gpu_tests.sh "$L/gt"
  tail -3 "$L/gputest.log"
fi

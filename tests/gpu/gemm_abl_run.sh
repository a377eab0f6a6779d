#!/usr/bin/env bash
# gemm_abl_run.sh LOGDIR - the warpgroup GEMM (gemm_wg.cu) against cuBLAS:
# its kernel test (RACE=1: racecheck and memcheck too), bench_gemm's gate|up
# alone and sustained (SLUICE_BENCH_WG=2) for each of VARIANTS
# (comma-separated SLUICE_GEMM_WG_* settings; ABLATE: 1 no epilogue, 2 the
# MMAs on the first stages without further loads, 3 both, timing only;
# GROUP=N row slices a group), CHAIN=1: bench_gemm's 32-layer chains
# (SLUICE_BENCH_WG=1), then PREFILL (default 2) rounds of the prefill step
# of MODES (default "off gu"): cuBLAS + the SwiGLU kernel (off), the fused
# gate|up (gu). E2E=1
# then runs end to end and the engine suite with the kernel on every step
# of 5+ tokens.
. "$(dirname "$0")/run_lib.sh"
t kernels 120 env SLUICE_TEST_ONLY=gemm_wg build/tests/gpu/test_kernels
grep -E "FAIL|skipped|CHECK" "$L/kernels.log" | head -5
if [ -n "${RACE:-}" ]; then
  t racecheck 240 env SLUICE_TEST_ONLY=gemm_wg compute-sanitizer --tool racecheck build/tests/gpu/test_kernels
  grep -m6 -E "CHECK|FAIL|Race reported|Error" "$L/racecheck.log" | cut -c1-220
  t memcheck 240 env SLUICE_TEST_ONLY=gemm_wg compute-sanitizer --tool memcheck build/tests/gpu/test_kernels
  grep -m6 -E "CHECK|FAIL|Invalid" "$L/memcheck.log" | cut -c1-220
fi
for v in ${VARIANTS:-}; do
  envs=$(echo "$v" | tr ',' '\n' | sed 's/^/SLUICE_GEMM_WG_/' | tr '\n' ' ')
  n=$(echo "$v" | tr ',=' '__')
  t "bg_$n" 90 env $envs SLUICE_BENCH_WG=2 build/tests/gpu/bench_gemm
  grep -E "^wg gate" "$L/bg_$n.log" | sed "s/^wg gate|up /  $v: /"
done
if [ -n "${CHAIN:-}" ]; then
  t chain 120 env SLUICE_BENCH_WG=1 build/tests/gpu/bench_gemm
  grep -E "^wg" "$L/chain.log"
fi
for r in $(seq "${PREFILL:-2}"); do
  for m in ${MODES:-off gu}; do
    t "prefill_${m}_$r" 60 env SLUICE_CUDA_GEMM_WG=$([ $m = off ] && echo 0 || echo 1) \
      SLUICE_BENCH_ONLY=prefill build/tests/gpu/bench_gpu
    echo "  $m: $(grep -E 'prefill' "$L/prefill_${m}_$r.log" | sed 's/ ([0-9]* TFLOP[^)]*)//;s/prefill //' | tr '\n' ' ')"
  done
done
if [ -n "${E2E:-}" ]; then
  t e2e_all 150 env SLUICE_CUDA_GEMM_WG_MIN_T=1 build/tests/gpu/test_gpu_e2e
  t engine_all 150 env SLUICE_CUDA_GEMM_WG_MIN_T=1 SLUICE_TEST_DEVICE=cuda \
    SLUICE_TEST_MODEL=tests/models/tiny-qwen3 build/tests/test_engine
  grep -hE "FAIL|near-ties \(" "$L"/e2e_all.log "$L"/engine_all.log | head
fi

#!/usr/bin/env bash
# gemm_wg_run.sh LOGDIR [REPS] - the warpgroup GEMM (gemm_wg.cu) on an H200:
# its kernel test, memcheck and racecheck on it, the SASS's MMA count,
# bench_gemm's comparison with cuBLAS at the power cap (SLUICE_BENCH_WG=1),
# and the prefill step with the fused gate|up on and off, alternating, REPS
# rounds. FULL=1 also runs make gpu-test's suite and the whole bench_gpu
# with it on and off; NOBENCH=1 leaves bench_gemm out. X2=1 (two GPUs)
# instead: bench_gpu, then end to end and the engine suite with the kernel on
# every step of 5+ tokens at TP=1 and TP=2, and the TP=2 prefill step.
. "$(dirname "$0")/run_lib.sh"
REPS=${2:-2}
if [ -n "${X2:-}" ]; then
  t bench 60 build/tests/gpu/bench_gpu; grep -E "decode|prefill" "$L/bench.log"
  for tp in 1 2; do
    t "e2e_tp${tp}_min1" 150 env SLUICE_TEST_TP=$tp SLUICE_CUDA_GEMM_WG_MIN_T=1 build/tests/gpu/test_gpu_e2e
    t "engine_tp${tp}_min1" 120 env SLUICE_TEST_TP=$tp SLUICE_CUDA_GEMM_WG_MIN_T=1 SLUICE_TEST_DEVICE=cuda \
      SLUICE_TEST_MODEL=tests/models/tiny-qwen3 build/tests/test_engine
  done
  grep -hE "FAIL|near-ties \(" "$L"/e2e_*.log "$L"/engine_*.log | head
  for m in 1 0; do
    t "bench_tp2_wg$m" 60 env SLUICE_TEST_TP=2 SLUICE_CUDA_GEMM_WG=$m SLUICE_BENCH_ONLY=prefill build/tests/gpu/bench_gpu
    grep -E "prefill" "$L/bench_tp2_wg$m.log" | sed "s/^/  wg=$m: /"
  done
  exit 0
fi
t kernels 120 env SLUICE_TEST_ONLY=gemm_wg build/tests/gpu/test_kernels
grep -E "gemm_wg|FAIL|skipped" "$L/kernels.log" | head -20
if command -v cuobjdump >/dev/null; then
  cuobjdump -sass build/tests/gpu/test_kernels 2>/dev/null | awk '/Function : .*gemm_wg_kernel/{f=1} /Function : /&&!/gemm_wg/{f=0} f' > "$L/gemm_wg.sass"
  echo "sass: HGMMA $(grep -c HGMMA "$L/gemm_wg.sass"), WARPGROUP.DEPBAR $(grep -c 'WARPGROUP.DEPBAR' "$L/gemm_wg.sass")"
fi
t memcheck 180 env SLUICE_TEST_ONLY=gemm_wg compute-sanitizer --tool memcheck build/tests/gpu/test_kernels
t racecheck 180 env SLUICE_TEST_ONLY=gemm_wg compute-sanitizer --tool racecheck build/tests/gpu/test_kernels
if [ -z "${NOBENCH:-}" ]; then
  t bench_gemm 240 env SLUICE_BENCH_WG=1 build/tests/gpu/bench_gemm; grep -E "sustained|alone|^wg|error" "$L/bench_gemm.log"
fi
for r in $(seq "$REPS"); do
  for m in 1 0; do
    t "prefill_wg${m}_$r" 60 env SLUICE_CUDA_GEMM_WG=$m SLUICE_BENCH_ONLY=prefill build/tests/gpu/bench_gpu
    echo "  wg=$m: $(grep -E 'prefill' "$L/prefill_wg${m}_$r.log" | sed 's/ ([0-9]* TFLOP[^)]*)//' | tr '\n' ' ')"
  done
done
if [ -n "${FULL:-}" ]; then
  for m in 1 0; do
    t "bench_wg$m" 90 env SLUICE_CUDA_GEMM_WG=$m build/tests/gpu/bench_gpu
    grep -E "decode|prefill" "$L/bench_wg$m.log" | sed "s/^/  wg=$m: /"
  done
  a=$(date +%s); BUILD=build timeout -k 5 400 tests/gpu/run_gpu_tests.sh > "$L/gpu_test.log" 2>&1
  echo "gpu-test rc=$? $(( $(date +%s) - a ))s: $(tail -1 "$L/gpu_test.log")"
  grep -E "FAIL|near-tie|rc=" "$L/gpu_test.log" | head -20
fi

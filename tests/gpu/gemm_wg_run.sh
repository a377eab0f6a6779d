#!/usr/bin/env bash
# gemm_wg_run.sh - the warpgroup GEMM (gemm_wg.cu) on an H200: its kernel
# test, memcheck and racecheck on it, the SASS's MMA count, bench_gemm's
# comparison with cuBLAS at the power cap (SLUICE_BENCH_WG=1), and the
# prefill step with the fused gate|up (CTA pairs, single CTAs) and off,
# alternating, REPS rounds. QUICK=1: only the kernel test, SASS and bench_gemm.
. "$(dirname "$0")/run_lib.sh"
REPS=${2:-2}
t kernels 120 env SLUICE_TEST_ONLY=gemm_wg build/tests/gpu/test_kernels
grep -E "gemm_wg|FAIL|skipped" "$L/kernels.log" | head -20
if command -v cuobjdump >/dev/null; then
  cuobjdump -sass build/tests/gpu/test_kernels 2>/dev/null | awk '/Function : .*gemm_wg_kernel/{f=1} /Function : /&&!/gemm_wg/{f=0} f' > "$L/gemm_wg.sass"
  echo "sass: HGMMA $(grep -c HGMMA "$L/gemm_wg.sass"), WARPGROUP.DEPBAR $(grep -c 'WARPGROUP.DEPBAR' "$L/gemm_wg.sass"), WARPGROUP.ARRIVE $(grep -c 'WARPGROUP.ARRIVE' "$L/gemm_wg.sass")"
fi
if [ -z "${QUICK:-}" ]; then
t memcheck 180 env SLUICE_TEST_ONLY=gemm_wg compute-sanitizer --tool memcheck build/tests/gpu/test_kernels
t racecheck 180 env SLUICE_TEST_ONLY=gemm_wg compute-sanitizer --tool racecheck build/tests/gpu/test_kernels
fi
t bench_gemm 240 env SLUICE_BENCH_WG=1 build/tests/gpu/bench_gemm; grep -E "sustained|alone|^wg|error" "$L/bench_gemm.log"
[ -n "${QUICK:-}" ] && REPS=0
for r in $(seq "$REPS"); do
  for m in 1:2 1:1 0:2; do
    n="prefill_wg${m%:*}_cl${m#*:}_$r"
    t "$n" 60 env SLUICE_CUDA_GEMM_WG=${m%:*} SLUICE_CUDA_GEMM_CL=${m#*:} SLUICE_BENCH_ONLY=prefill build/tests/gpu/bench_gpu
    echo "  wg=${m%:*} cl=${m#*:}: $(grep -E 'prefill' "$L/$n.log" | sed 's/ ([0-9]* TFLOP[^)]*)//' | tr '\n' ' ')"
  done
done

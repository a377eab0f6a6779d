#!/usr/bin/env bash
# gemm_wg_ncu2.sh - ncu's warp states on the fused gate|up kernel (CTA pairs)
# and on cuBLAS's gate|up, then the prefill step with and without it.
. "$(dirname "$0")/run_lib.sh"
t kernels 120 env SLUICE_TEST_ONLY=gemm_wg build/tests/gpu/test_kernels
grep -E "FAIL|skipped|passed" "$L/kernels.log" | head -5
for k in wg cublas; do
  if [ $k = wg ]; then K='regex:gemm_wg_kernel'; else K='regex:^(?!gemm_wg).*'; fi
  t ncu_$k 200 ncu --section WarpStateStats --section SchedulerStats --section MemoryWorkloadAnalysis -k "$K" --launch-skip 2 --launch-count 1 env SLUICE_BENCH_WG=1 build/tests/gpu/bench_gemm
  grep -E 'Stall|stall|Warp Cycles|Eligible|Issued|No Eligible|DRAM Throughput|L2 Hit|Mem Busy|Max Bandwidth|cycles being stalled' "$L/ncu_$k.log" | head -30
done
for r in 1 2 3 4; do
  for m in 1:1 0:1 1:2; do
    n="prefill_wg${m%:*}_cl${m#*:}_$r"
    t "$n" 60 env SLUICE_CUDA_GEMM_WG=${m%:*} SLUICE_CUDA_GEMM_CL=${m#*:} SLUICE_BENCH_ONLY=prefill build/tests/gpu/bench_gpu
    echo "  wg=${m%:*} cl=${m#*:}: $(grep -E 'one 16384' "$L/$n.log" | sed 's/ ([0-9]* TFLOP[^)]*)//')"
  done
done

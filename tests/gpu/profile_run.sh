#!/usr/bin/env bash
# profile_run.sh - compute-sanitizer on the kernel tests and a per-kernel
# profile (ncu) of batch-1 decode on the Llama-3.1-8B shape. Logs under $1.
CS=${CS:-compute-sanitizer}
NCU=${NCU:-ncu}
. "$(dirname "$0")/run_lib.sh"
nvidia-smi -L
[ -n "${SKIP_SAN:-}" ] || {
t memcheck_kernels 200 $CS --tool memcheck --leak-check no build/tests/gpu/test_kernels
t memcheck_sample 120 $CS --tool memcheck build/tests/gpu/test_sample
t racecheck_kernels 240 $CS --tool racecheck build/tests/gpu/test_kernels
t synccheck_kernels 120 $CS --tool synccheck build/tests/gpu/test_kernels
}
B="env SLUICE_BENCH_ONLY=decode build/tests/gpu/bench_gpu"
for v in base "SLUICE_CUDA_FUSED=1" "SLUICE_PDL=1" "SLUICE_CUDA_FUSED=1 SLUICE_PDL=1" ${EXTRA_VARIANTS:-}; do
  e=$v; [ "$v" = base ] && e=
  t "dec_${v// /_}" 60 env $e $B; grep decode "$L/dec_${v// /_}.log"
done
t ncu_step 180 $NCU --clock-control none --profile-from-start off --metrics gpu__time_duration.sum --csv \
  env SLUICE_BENCH_ONLY=decode SLUICE_BENCH_PROFILE=1 build/tests/gpu/bench_gpu
python3 tests/gpu/ncu_sum.py "$L/ncu_step.log" 2 | tee "$L/ncu_summary.txt"
t ncu_gemv 180 $NCU --clock-control none --profile-from-start off -k regex:"gemv|attn|combine|rope|rmsnorm|swiglu|argmax" --launch-count 14 \
  --metrics gpu__time_duration.sum,dram__bytes_read.sum,dram__throughput.avg.pct_of_peak_sustained_elapsed,sm__warps_active.avg.pct_of_peak_sustained_active,launch__grid_size,launch__block_size,launch__registers_per_thread \
  env SLUICE_BENCH_ONLY=decode SLUICE_BENCH_PROFILE=1 build/tests/gpu/bench_gpu
grep -E '^  [a-z]|^    [a-z_]+__' "$L/ncu_gemv.log" | head -150 > "$L/ncu_gemv_summary.txt"

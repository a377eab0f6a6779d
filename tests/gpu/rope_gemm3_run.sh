#!/usr/bin/env bash
# rope_gemm3_run.sh LOGDIR - where the QKV GEMM's RoPE epilogue spends its
# time: bench_gemm's SLUICE_BENCH_WG=3 under each SLUICE_GEMM_WG_ABLATE
# setting (benchmarks only, outputs wrong): 0 as built, 1 no epilogue, 4
# the stores into shared memory, 8 no cos/sin loads, 16 no RoPE, 12 both 4 and 8.
. "$(dirname "$0")/run_lib.sh"
nvidia-smi -L
for ab in ${ABLS:-0 1 4 16}; do
  t "bg_$ab" 120 env SLUICE_BENCH_WG=3 SLUICE_GEMM_WG_ABLATE=$ab build/tests/gpu/bench_gemm
  grep -E "fused|wg plain alone" "$L/bg_$ab.log" | sed "s/^/  ablate=$ab: /"
done

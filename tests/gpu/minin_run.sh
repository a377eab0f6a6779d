#!/usr/bin/env bash
# minin_run.sh LOGDIR - batch-1 decode with the tensor-core GEMV for the
# projections whose rows are at least SLUICE_GEMV_MMA_MIN_IN long (8192:
# the down projection, in 14336; 4096: all; 1000000: none, the warp kernels),
# the GEMV tests with it first. Three rounds, alternating.
. "$(dirname "$0")/run_lib.sh"
nvidia-smi -L
t gemv_minin 180 env SLUICE_TEST_ONLY=gemv SLUICE_GEMV_MMA_MIN_IN=8192 build/tests/gpu/test_kernels
for r in 1 2 3; do
  for m in 1000000 8192 4096; do
    envs=(SLUICE_GEMV_MMA_MIN_IN=$m)
    timeout -k 5 120 env SLUICE_BENCH_ONLY=decode "${envs[@]}" build/tests/gpu/bench_gpu > "$L/dec_${m}_$r.log" 2>&1
    echo "min_in $m round $r rc=$?: $(grep -E 'decode batch 1' "$L/dec_${m}_$r.log")"
  done
done

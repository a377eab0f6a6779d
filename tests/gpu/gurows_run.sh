#!/usr/bin/env bash
# gurows_run.sh LOGDIR - experiment: the tagged MLP's gate/up GEMV with 2 or
# 4 row pairs a warp, one after the other (SLUICE_GEMV_GUROWS=2|4; fewer
# blocks, so fewer norm prologues and the down GEMV launched earlier): its
# test, then batch-1 decode alternating 1 / 2 / 4.
. "$(dirname "$0")/run_lib.sh"
nvidia-smi -L
t mlp_r2 120 env SLUICE_GEMV_GUROWS=2 SLUICE_TEST_ONLY=gemv build/tests/gpu/test_kernels
t mlp_r4 120 env SLUICE_GEMV_GUROWS=4 SLUICE_TEST_ONLY=gemv_mlp build/tests/gpu/test_kernels
for r in 1 2; do
  for v in 1 2 4; do
    timeout -k 5 120 env SLUICE_BENCH_ONLY=decode SLUICE_GEMV_GUROWS=$v build/tests/gpu/bench_gpu > "$L/dec_${v}_$r.log" 2>&1
    echo "rows=$v round $r rc=$?: $(grep -E '^decode batch 1 ' "$L/dec_${v}_$r.log")"
  done
done

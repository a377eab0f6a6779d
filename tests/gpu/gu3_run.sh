#!/usr/bin/env bash
# gu3_run.sh LOGDIR - experiment: the tagged MLP's gate/up GEMV at 3 blocks
# an SM (80 registers; SLUICE_GEMV_GU3=1) against 2: its test, then batch-1
# decode alternating.
. "$(dirname "$0")/run_lib.sh"
nvidia-smi -L
t mlp_gu3 120 env SLUICE_GEMV_GU3=1 SLUICE_TEST_ONLY=gemv_mlp build/tests/gpu/test_kernels
for r in 1 2 3; do
  for v in 0 1; do
    timeout -k 5 120 env SLUICE_BENCH_ONLY=decode SLUICE_GEMV_GU3=$v build/tests/gpu/bench_gpu > "$L/dec_${v}_$r.log" 2>&1
    echo "gu3=$v round $r rc=$?: $(grep -E '^decode batch 1 ' "$L/dec_${v}_$r.log")"
  done
done

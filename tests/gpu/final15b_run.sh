#!/usr/bin/env bash
# final15b_run.sh LOGDIR - after the backend's start-up warm-up (2-GPU
# host): a prefix-cache hit's time to first token from the first hit on
# (hit_ttft_run.sh, then again with SLUICE_CUDA_WARMUP=0), make gpu-test's
# suite, and tp_check.sh (rank-failure injection while serving: the warm-up
# must not shift SLUICE_TP_FAULT's step count).
. "$(dirname "$0")/run_lib.sh"
nvidia-smi -L
for w in 1 0; do
  a=$(date +%s.%N)
  SLUICE_CUDA_WARMUP=$w N=3 tests/gpu/hit_ttft_run.sh "$L/hit_w$w" 2>&1 | grep -E "up after|miss|hit" | sed "s/^/  warmup=$w: /"
  echo "  warmup=$w: whole run $(python3 -c "print(round($(date +%s.%N) - $a, 1))") s"
done
a=$(date +%s); BUILD=build timeout -k 5 420 tests/gpu/run_gpu_tests.sh > "$L/gpu_test.log" 2>&1
echo "gpu-test rc=$? $(( $(date +%s) - a ))s: $(tail -1 "$L/gpu_test.log")"
grep -E "FAIL|near-ties \(|failed:" "$L/gpu_test.log" | sort | uniq -c | head -20
timeout -k 5 300 tests/gpu/tp_check.sh 2 "$L/tp" 2>&1 | grep -E "fault|client|FAIL|tp_check"

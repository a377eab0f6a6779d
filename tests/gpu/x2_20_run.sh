#!/usr/bin/env bash
# x2_20_run.sh LOGDIR - the twentieth round's verification on two H200s:
# make gpu-test (run_gpu_tests.sh: with 2 GPUs the TP=2 runs, whose decode
# steps of 2-8 tokens now take the tensor-core GEMV in every projection),
# then TP=2 decode at batches 1-8 with this build's bench_gpu and the
# previous one's (build/tests/gpu/bench_gpu_prev), alternating, twice.
. "$(dirname "$0")/run_lib.sh"
nvidia-smi -L
a=$(date +%s)
BUILD=build timeout -k 5 ${GPU_TEST_SECS:-400} tests/gpu/run_gpu_tests.sh >"$L/gpu_test.log" 2>&1
echo "gpu-test rc=$? $(($(date +%s) - a))s: $(tail -1 "$L/gpu_test.log")"
grep -E "^== |FAIL|failed:" "$L/gpu_test.log" | grep -vE "^== .*passed" | grep -B1 -E "FAIL|failed:" | head -40
B=build/tests/gpu/bench_gpu
for r in 1 2; do
  for b in ${B}_prev $B; do
    [ -x $b ] || continue
    n=tp2_$(basename $b)_$r
    timeout -k 5 120 env SLUICE_TEST_TP=2 SLUICE_BENCH_ONLY=decode SLUICE_BENCH_DECODE=2x1024,4x1024,8x1024 $b > "$L/$n.log" 2>&1
    echo "$n rc=$?: $(grep -E 'decode batch' "$L/$n.log" | sed -e 's/ ctx//' -e 's/; floor.*//' | tr '\n' ' ')"
  done
done

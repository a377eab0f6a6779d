#!/usr/bin/env bash
# dec_trigger_run.sh LOGDIR - experiment, one H200: the decode attention
# kernel lets the o projection's GEMV launch at once (SLUICE_DEC_TRIGGER=1)
# while that GEMV loads nothing before its wait (SLUICE_GEMV_LATE=1): its
# blocks sit resident, so only the launch is hidden. Batch-1 decode, three
# rounds alternating with the default and with LATE alone; e2e with both.
. "$(dirname "$0")/run_lib.sh"
nvidia-smi -L
t e2e_trig 120 env SLUICE_DEC_TRIGGER=1 SLUICE_GEMV_LATE=1 build/tests/gpu/test_gpu_e2e
for r in 1 2 3; do
  for c in default late trig; do
    envs=(X=1)
    [ $c = late ] && envs=(SLUICE_GEMV_LATE=1)
    [ $c = trig ] && envs=(SLUICE_DEC_TRIGGER=1 SLUICE_GEMV_LATE=1)
    timeout -k 5 120 env "${envs[@]}" SLUICE_BENCH_ONLY=decode SLUICE_BENCH_DECODE=4x1024 build/tests/gpu/bench_gpu > "$L/dec_${c}_$r.log" 2>&1
    echo "$c round $r rc=$?: $(grep -E 'decode batch' "$L/dec_${c}_$r.log" | sed -e 's/; floor.*//' | tr '\n' ' ')"
  done
done

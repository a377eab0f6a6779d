#!/usr/bin/env bash
# prefill_where_run.sh - where a 16384-token prefill step of the Llama-3.1-8B
# shape goes: the step timed with the SM clock and power sampled every 20 ms
# (nvidia-smi: does a long GEMM burst pull the clock down?), then ncu kernel
# durations over one step at the clocks the GPU picks (ncu_sum.py). Logs
# under $1.
. "$(dirname "$0")/run_lib.sh"
nvidia-smi -L
nvidia-smi --query-gpu=timestamp,clocks.sm,clocks.mem,power.draw,temperature.gpu,clocks_event_reasons.active \
  --format=csv,noheader -lms 20 > "$L/clocks.csv" 2>&1 &
smi=$!
t prefill 90 env SLUICE_BENCH_ONLY=prefill build/tests/gpu/bench_gpu; grep -E "prefill" "$L/prefill.log"
kill $smi 2>/dev/null; wait $smi 2>/dev/null
awk -F', ' '{print $2, $4, $6}' "$L/clocks.csv" | sort | uniq -c | sort -rn | head -12
t ncu_prefill 240 ncu --clock-control none --profile-from-start off --metrics gpu__time_duration.sum --csv \
  env SLUICE_BENCH_PROFILE=prefill build/tests/gpu/bench_gpu
python3 tests/gpu/ncu_sum.py "$L/ncu_prefill.log" 1 | head -16 | tee "$L/ncu_prefill_summary.txt"

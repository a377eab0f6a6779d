#!/usr/bin/env bash
# final19c_run.sh LOGDIR - sluice bench's 14.6K-token cache bust and hit
# (serve_bench_run.sh) with the step budget weighed by attention (the
# default) and by tokens alone (SLUICE_WEIGH_BUDGET=0), alternating, twice.
. "$(dirname "$0")/run_lib.sh"
nvidia-smi -L
for r in 1 2; do
  for w in 1 0; do
    echo "== SLUICE_WEIGH_BUDGET=$w, round $r"
    SLUICE_WEIGH_BUDGET=$w RUNS=3 bash "$(dirname "$0")/serve_bench_run.sh" "$L/w${w}_$r" 2>&1 | grep -E "up=|bust|hit|TTFT|rc="
  done
done

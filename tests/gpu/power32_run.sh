#!/usr/bin/env bash
# power32_run.sh LOGDIR - one device call (binaries from pack_bins.sh): the
# GPU's power draw and SM clock, sampled every 20 ms by nvidia-smi, while
# bench_gemm runs its sustained GEMM chains (random and zero activations)
# and while bench_gpu runs prefill steps back to back (SLUICE_BENCH_BIG=16:
# 8 and 16 prompts of 2048 a step); power_sum.py gives each run's power,
# clock and energy a step. Logs under $1.
. "$(dirname "$0")/run_lib.sh"
nvidia-smi -L
nvidia-smi -q -d POWER,CLOCK,PERFORMANCE >"$L/smi_before.txt" 2>&1
grep -E "Power Limit|Power Draw|Max Clocks|SM  |Graphics" "$L/smi_before.txt" | head -20
F=timestamp,clocks.sm,power.draw.instant,power.draw.average,enforced.power.limit,temperature.gpu,clocks_event_reasons.active
nvidia-smi --query-gpu=$F --format=csv,noheader,nounits -c 1 >/dev/null 2>&1 ||
    F=timestamp,clocks.sm,power.draw,power.draw,enforced.power.limit,temperature.gpu,clocks_event_reasons.active
echo "fields: $F"
stamp() { while IFS= read -r l; do echo "$(date '+%Y/%m/%d %H:%M:%S.%3N') $l"; done; }
sampled() { # NAME SECONDS CMD...: CMD timed with its lines stamped, the GPU sampled meanwhile
    local n=$1 s=$2
    shift 2
    nvidia-smi --query-gpu=$F --format=csv,noheader,nounits -lms 20 >"$L/$n.csv" 2>&1 &
    local smi=$!
    timeout -k 5 "$s" stdbuf -oL "$@" 2>&1 | stamp >"$L/$n.log"
    kill $smi 2>/dev/null
    wait $smi 2>/dev/null
    cut -d' ' -f3- "$L/$n.log" | grep -E "sustained|prefill|TFLOP" | head -20
    python3 "$(dirname "$0")/power_sum.py" "$L/$n.csv" "$L/$n.log"
}
sampled gemm 150 build/tests/gpu/bench_gemm
sampled prefill 300 env SLUICE_BENCH_ONLY=prefill SLUICE_BENCH_BIG=16 build/tests/gpu/bench_gpu
nvidia-smi -q -d POWER,CLOCK,PERFORMANCE >"$L/smi_after.txt" 2>&1

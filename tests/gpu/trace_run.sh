#!/usr/bin/env bash
# trace_run.sh LOGDIR - experiment: batch-1 decode's kernel timeline from
# per-block %globaltimer stamps (SLUICE_CUDA_TRACE=N dumps step N), with a
# plain run for the perturbation.
. "$(dirname "$0")/run_lib.sh"
nvidia-smi -L
B="env SLUICE_BENCH_ONLY=decode SLUICE_BENCH_DECODE=1x1024,1x1024 build/tests/gpu/bench_gpu"
timeout -k 5 120 $B > "$L/plain.log" 2>&1
echo "plain: $(grep -E '^decode batch' "$L/plain.log" | tr '\n' ' ')"
for n in 20 40; do
    timeout -k 5 120 env SLUICE_CUDA_TRACE=$n $B > "$L/trace_$n.log" 2>&1
    echo "== trace step $n rc=$?: $(grep -E '^decode batch' "$L/trace_$n.log" | tr '\n' ' ')"
    grep -E "trace mean" "$L/trace_$n.log"
done
grep -E "^trace +[0-9]" "$L/trace_40.log" | head -40

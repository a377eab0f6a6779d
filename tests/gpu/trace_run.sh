#!/usr/bin/env bash
# trace_run.sh LOGDIR - experiment: batch-1 decode's kernel timeline from
# per-block %globaltimer stamps (SLUICE_CUDA_TRACE=N dumps step N), the
# default build and with the attention launched early.
. "$(dirname "$0")/run_lib.sh"
nvidia-smi -L
for v in "" "SLUICE_CUDA_ATTN_PDL=1"; do
  for n in 10 30; do
    timeout -k 5 120 env SLUICE_BENCH_ONLY=decode SLUICE_CUDA_TRACE=$n $v build/tests/gpu/bench_gpu > "$L/trace_${n}_${v:+pdl}.log" 2>&1
    echo "== trace step $n $v rc=$?"
    grep -E "^decode batch 1 |trace mean" "$L/trace_${n}_${v:+pdl}.log"
  done
done
grep -E "^trace +([0-9]|1[0-9]|8[0-9]|9[0-9]) " "$L/trace_30_.log"

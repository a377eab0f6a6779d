#!/usr/bin/env bash
# dec_lean_run.sh - one device call after the decode kernel's shared-memory
# diet (both caches): decode and fp8 kernel tests, memcheck and racecheck on
# the RoPE-fold tests (both caches), end to end, the engine suite with each
# cache, run-batch's cpu-vs-cuda check; bench_gpu (prefill, decode batches)
# and 256 x 1536 / 64 x 2048 with each cache; the offline run-batch
# (1000 x ~1000 in / 1000 out) with the fp8 cache. Logs under $1.
. "$(dirname "$0")/run_lib.sh"
nvidia-smi -L
dec_tests rope_fold
B=build/tests/gpu/bench_gpu
t bench_gpu 120 $B; grep -E "decode|prefill" "$L/bench_gpu.log"
t dec_bf16 120 env SLUICE_BENCH_ONLY=batches SLUICE_BENCH_DECODE=256x1536,64x2048 $B; grep -E "decode" "$L/dec_bf16.log"
t dec_fp8 120 env SLUICE_BENCH_KV=fp8 SLUICE_BENCH_ONLY=batches SLUICE_BENCH_DECODE=256x1536,64x2048 $B; grep -E "decode" "$L/dec_fp8.log"
a=$(date +%s); RB_FLAGS="--kv-cache-dtype fp8" timeout -k 5 300 bash tests/gpu/run_batch_gpu.sh 1000 "$L/rb" > "$L/rb.log" 2>&1
echo "run-batch fp8 rc=$? $(( $(date +%s) - a ))s"; grep -vE "^\s*$" "$L/rb.log" | tail -4

#!/usr/bin/env bash
# dec_lean_run.sh - one device call after the decode kernel's shared-memory
# diet (both caches): decode and fp8 kernel tests, memcheck and racecheck on
# the RoPE-fold tests (both caches), end to end, the engine suite with each
# cache, run-batch's cpu-vs-cuda check; bench_gpu (prefill, decode batches)
# and 256 x 1536 / 64 x 2048 with each cache; the offline run-batch
# (1000 x ~1000 in / 1000 out) with the fp8 cache. Logs under $1.
. "$(dirname "$0")/run_lib.sh"
nvidia-smi -L
K=build/tests/gpu/test_kernels
t k_dec 180 env SLUICE_TEST_ONLY=attention_decode $K
t k_kv8 180 env SLUICE_TEST_ONLY=kv8 $K
grep -E "FAIL|failed:" "$L/k_dec.log" "$L/k_kv8.log" | head
t memcheck_fold 240 env SLUICE_TEST_ONLY=rope_fold compute-sanitizer --tool memcheck $K
t racecheck_fold 240 env SLUICE_TEST_ONLY=rope_fold compute-sanitizer --tool racecheck $K
t sample 60 build/tests/gpu/test_sample
t e2e_tp1 90 build/tests/gpu/test_gpu_e2e
e="env SLUICE_TEST_DEVICE=cuda SLUICE_TEST_MODEL=tests/models/tiny-qwen3"
t engine_tp1 90 $e build/tests/test_engine
t engine_kv8 90 $e SLUICE_TEST_KV=fp8 build/tests/test_engine
grep -E "FAIL|failed:" "$L/e2e_tp1.log" "$L/engine_tp1.log" "$L/engine_kv8.log" | head
B=build/tests/gpu/bench_gpu
t bench_gpu 120 $B; grep -E "decode|prefill" "$L/bench_gpu.log"
t dec_bf16 120 env SLUICE_BENCH_ONLY=batches SLUICE_BENCH_DECODE=256x1536,64x2048 $B; grep -E "decode" "$L/dec_bf16.log"
t dec_fp8 120 env SLUICE_BENCH_KV=fp8 SLUICE_BENCH_ONLY=batches SLUICE_BENCH_DECODE=256x1536,64x2048 $B; grep -E "decode" "$L/dec_fp8.log"
a=$(date +%s); RB_FLAGS="--kv-cache-dtype fp8" timeout -k 5 300 bash tests/gpu/run_batch_gpu.sh 1000 "$L/rb" > "$L/rb.log" 2>&1
echo "run-batch fp8 rc=$? $(( $(date +%s) - a ))s"; grep -vE "^\s*$" "$L/rb.log" | tail -4

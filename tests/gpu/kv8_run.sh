#!/usr/bin/env bash
# kv8_run.sh - one device call for the fp8 KV cache: the kernel tests (all of
# them, fp8 included; memcheck and racecheck on the fp8 attention tests), the
# device sampler, end to end vs CPU/HF (bf16 cache), the engine suite on CUDA
# with the bf16 and the fp8 cache; decode of the Llama-3.1-8B shape at long
# contexts and prefill with each cache; and, with RB=N, the run-batch
# throughput run with each. Logs under $1; a summary on stdout.
. "$(dirname "$0")/run_lib.sh"
nvidia-smi -L
core_tests 240
D=${DECODES:-256x1536,256x512,64x2048}
for kv in auto fp8; do
  t bench_$kv 120 env SLUICE_BENCH_KV=$kv SLUICE_BENCH_DECODE=$D build/tests/gpu/bench_gpu
  echo "  [KV $kv] $(grep -E '^(decode|prefill)' "$L/bench_$kv.log" | sed -E 's/; floor.*//; s/ \(.*GEMMs\)//' | tr '\n' '|')"
done
t memcheck_kv8 150 env SLUICE_TEST_ONLY=attention_kv8 compute-sanitizer --tool memcheck build/tests/gpu/test_kernels
t memcheck_fold_kv8 60 env SLUICE_TEST_ONLY=fold_kv8 compute-sanitizer --tool memcheck build/tests/gpu/test_kernels
t racecheck_fold_kv8 90 env SLUICE_TEST_ONLY=fold_kv8 compute-sanitizer --tool racecheck build/tests/gpu/test_kernels
[ -n "${TC_RACE:-}" ] && t racecheck_tc_kv8 150 env SLUICE_TEST_ONLY=tc_kv8 compute-sanitizer --tool racecheck build/tests/gpu/test_kernels
# the throughput runs only when the kernels pass
if [ -n "${RB:-}" ] && grep -q '^[0-9]* passed, 0 failed' "$L/kernels.log"; then
  for kv in ${RB_KV:-fp8 auto}; do
    a=$(date +%s); RB_FLAGS="--kv-cache-dtype $kv" RB_SKIP_SMALL=1 timeout -k 5 200 bash tests/gpu/run_batch_gpu.sh "$RB" "$L/rb_$kv" > "$L/rb_$kv.log" 2>&1
    echo "run-batch $RB KV $kv rc=$? $(( $(date +%s) - a ))s"; tail -1 "$L/rb_$kv.log"
  done
fi

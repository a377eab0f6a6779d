#!/usr/bin/env bash
# final_x2_run.sh - a last short call on a 2-GPU host, most important first:
# the fp8 KV kernel tests (racecheck on the folded decode ones), tensor
# parallelism end to end (TP=2 vs CPU/HF, vs TP=1) and the engine suite at
# TP=2 (bf16 and fp8 caches), fp8 vs bf16 decode on one GPU, TP=2 with and
# without PDL, then run-batch with the fp8 cache and memcheck. Logs under $1.
. "$(dirname "$0")/run_lib.sh"
nvidia-smi -L
t kernels_kv8 150 env SLUICE_TEST_ONLY=kv8 build/tests/gpu/test_kernels
grep -E "FAIL|failed:" "$L/kernels_kv8.log" | head -10
t racecheck_fold_kv8 90 env SLUICE_TEST_ONLY=fold_kv8 compute-sanitizer --tool racecheck build/tests/gpu/test_kernels
t e2e_tp2 90 env SLUICE_TEST_TP=2 build/tests/gpu/test_gpu_e2e
t e2e_tp2_vs_tp1 90 env SLUICE_TEST_TP=2 SLUICE_TEST_REF=cuda build/tests/gpu/test_gpu_e2e
E="env SLUICE_TEST_DEVICE=cuda SLUICE_TEST_MODEL=tests/models/tiny-qwen3"
t engine_tp2 60 $E SLUICE_TEST_TP=2 build/tests/test_engine
t engine_tp2_kv8 60 $E SLUICE_TEST_TP=2 SLUICE_TEST_KV=fp8 build/tests/test_engine
t engine_tp1_kv8 60 $E SLUICE_TEST_KV=fp8 build/tests/test_engine
grep -E "FAIL|failed:" "$L"/e2e_tp2*.log "$L"/engine_*.log | head
D=${DECODES:-256x1536,64x2048}
for kv in fp8 auto; do
  t bench_$kv 60 env SLUICE_BENCH_ONLY=decode SLUICE_BENCH_KV=$kv SLUICE_BENCH_DECODE=$D build/tests/gpu/bench_gpu
  echo "  [KV $kv] $(grep -E '^decode' "$L/bench_$kv.log" | sed -E 's/; floor.*//' | tr '\n' '|')"
done
t e2e_tp2_pdl 90 env SLUICE_PDL=1 SLUICE_TEST_TP=2 build/tests/gpu/test_gpu_e2e
for p in 0 1; do
  t bench_tp2_pdl$p 60 env SLUICE_PDL=$p SLUICE_TEST_TP=2 SLUICE_BENCH_ONLY=decode build/tests/gpu/bench_gpu
  echo "  [TP=2 SLUICE_PDL=$p] $(grep -E '^decode' "$L/bench_tp2_pdl$p.log" | sed -E 's/; floor.*//')"
done
if grep -q '^[0-9]* passed, 0 failed' "$L/kernels_kv8.log"; then
  a=$(date +%s); RB_FLAGS="--kv-cache-dtype fp8" RB_SKIP_SMALL=1 timeout -k 5 200 bash tests/gpu/run_batch_gpu.sh 1000 "$L/rb_fp8" > "$L/rb_fp8.log" 2>&1
  echo "run-batch 1000 KV fp8 rc=$? $(( $(date +%s) - a ))s"; tail -1 "$L/rb_fp8.log"
fi
t memcheck_kv8 150 env SLUICE_TEST_ONLY=attention_kv8 compute-sanitizer --tool memcheck build/tests/gpu/test_kernels

#!/usr/bin/env bash
# x2_lean_run.sh - a last call on a 2-GPU host after the decode kernel's
# shared-memory diet and the prefill RoPE / RMSNorm kernels: tensor
# parallelism end to end (TP=2 vs CPU/HF, vs TP=1), the engine suite at TP=2
# with each cache, bench_gpu at TP=2, then the offline run-batch (1000 x
# ~1000 in / 1000 out) on one GPU with the default bf16 cache. Logs under $1.
. "$(dirname "$0")/run_lib.sh"
nvidia-smi -L
t e2e_tp2 90 env SLUICE_TEST_TP=2 build/tests/gpu/test_gpu_e2e
t e2e_tp2_vs_tp1 90 env SLUICE_TEST_TP=2 SLUICE_TEST_REF=cuda build/tests/gpu/test_gpu_e2e
E="env SLUICE_TEST_DEVICE=cuda SLUICE_TEST_MODEL=tests/models/tiny-qwen3"
t engine_tp2 60 $E SLUICE_TEST_TP=2 build/tests/test_engine
t engine_tp2_kv8 60 $E SLUICE_TEST_TP=2 SLUICE_TEST_KV=fp8 build/tests/test_engine
grep -E "FAIL|failed:" "$L"/e2e_tp2*.log "$L"/engine_*.log | head
t bench_tp2 90 env SLUICE_TEST_TP=2 build/tests/gpu/bench_gpu; grep -E "decode|prefill" "$L/bench_tp2.log"
a=$(date +%s); RB_SKIP_SMALL=1 timeout -k 5 240 bash tests/gpu/run_batch_gpu.sh 1000 "$L/rb" > "$L/rb.log" 2>&1
echo "run-batch bf16 rc=$? $(( $(date +%s) - a ))s"; grep -vE "^\s*$" "$L/rb.log" | tail -3

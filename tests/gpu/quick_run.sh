#!/usr/bin/env bash
# quick_run.sh - a short device call after a kernel change: the kernel tests
# (memcheck and racecheck on the tests named by $ONLY), end to end vs CPU/HF,
# the engine suite on CUDA (TP 2 too with 2 GPUs), and batch-1/batched decode.
. "$(dirname "$0")/run_lib.sh"
t kernels 90 build/tests/gpu/test_kernels
grep -E "FAIL|failed:|rope folded" "$L/kernels.log" | head -20
t e2e_tp1 60 build/tests/gpu/test_gpu_e2e
t engine_tp1 60 env SLUICE_TEST_DEVICE=cuda SLUICE_TEST_MODEL=tests/models/tiny-qwen3 build/tests/test_engine
grep -E "FAIL|failed:" "$L/e2e_tp1.log" "$L/engine_tp1.log" | head
t bench_gpu 60 build/tests/gpu/bench_gpu; grep -E "decode|prefill" "$L/bench_gpu.log"
t dec_off 30 env SLUICE_CUDA_ATTN_DEC=0 SLUICE_BENCH_ONLY=decode build/tests/gpu/bench_gpu; grep -E "decode" "$L/dec_off.log"
t dec_simt 60 env SLUICE_CUDA_ATTN_DEC_TC=0 build/tests/gpu/bench_gpu; grep -E "decode" "$L/dec_simt.log"
t dec_unfused 30 env SLUICE_CUDA_FUSED=0 SLUICE_BENCH_ONLY=decode build/tests/gpu/bench_gpu; grep -E "decode" "$L/dec_unfused.log"
if [ "${ngpu:-0}" -ge 2 ]; then
  t engine_tp2 60 env SLUICE_TEST_TP=2 SLUICE_TEST_DEVICE=cuda SLUICE_TEST_MODEL=tests/models/tiny-qwen3 build/tests/test_engine
  t e2e_tp2_vs_tp1 60 env SLUICE_TEST_TP=2 SLUICE_TEST_REF=cuda build/tests/gpu/test_gpu_e2e
  t bench_tp2 60 env SLUICE_TEST_TP=2 SLUICE_BENCH_ONLY=decode build/tests/gpu/bench_gpu; grep -E "decode" "$L/bench_tp2.log"
fi
t memcheck 60 env SLUICE_TEST_ONLY="${ONLY:-rope_fold}" compute-sanitizer --tool memcheck build/tests/gpu/test_kernels
t racecheck 60 env SLUICE_TEST_ONLY="${ONLY:-rope_fold}" compute-sanitizer --tool racecheck build/tests/gpu/test_kernels
if [ -n "${RB:-}" ]; then
  a=$(date +%s); RB_SKIP_SMALL=1 timeout -k 5 90 bash tests/gpu/run_batch_gpu.sh "$RB" "$L/rb" > "$L/rb.log" 2>&1
  echo "run-batch $RB rc=$? $(( $(date +%s) - a ))s"; tail -2 "$L/rb.log"
fi

#!/usr/bin/env bash
# decode_run.sh - the checks and timings of the decode work (issue 6) in one
# device call: kernel tests (+ memcheck; racecheck on the decode attention
# with RACECHECK=1), the device sampler, end to end vs CPU/HF, the engine
# suite on CUDA (TP 1 and, with 2 GPUs, TP 2), bench_kernels, bench_gpu with
# the decode attention kernel and without (SLUICE_CUDA_ATTN_DEC=0), and
# run-batch throughput (RB=N requests). Logs under $1; a summary on stdout.
. "$(dirname "$0")/run_lib.sh"
nvidia-smi -L
t kernels 120 build/tests/gpu/test_kernels
grep -E "FAIL|failed:" "$L/kernels.log" | head -20
t memcheck_kernels 200 compute-sanitizer --tool memcheck build/tests/gpu/test_kernels
[ -n "${RACECHECK:-}" ] && t racecheck_dec 240 env SLUICE_TEST_ONLY=attention_decode compute-sanitizer --tool racecheck build/tests/gpu/test_kernels
t sample 90 build/tests/gpu/test_sample
t e2e_tp1 150 build/tests/gpu/test_gpu_e2e
grep -E "near-ties \(|FAIL|failed:" "$L/e2e_tp1.log" | head -10
t engine_tp1 120 env SLUICE_TEST_DEVICE=cuda SLUICE_TEST_MODEL=tests/models/tiny-qwen3 build/tests/test_engine
grep -E "FAIL|failed:" "$L/engine_tp1.log" | head -10
if [ "${ngpu:-0}" -ge 2 ]; then
  t engine_tp2 120 env SLUICE_TEST_TP=2 SLUICE_TEST_DEVICE=cuda SLUICE_TEST_MODEL=tests/models/tiny-qwen3 build/tests/test_engine
  t e2e_tp2 150 env SLUICE_TEST_TP=2 build/tests/gpu/test_gpu_e2e
  t e2e_tp2_vs_tp1 150 env SLUICE_TEST_TP=2 SLUICE_TEST_REF=cuda build/tests/gpu/test_gpu_e2e
  t bench_gpu_tp2 150 env SLUICE_TEST_TP=2 build/tests/gpu/bench_gpu; grep "decode batch" "$L/bench_gpu_tp2.log"
fi
t bench_kernels 120 build/tests/gpu/bench_kernels
grep -E "attention decode|argmax|rmsnorm T|swiglu T" "$L/bench_kernels.log"
for v in base SLUICE_CUDA_ATTN_DEC=0 base2; do
  e=$v; [ "${v#base}" != "$v" ] && e=
  t "bench_${v//[= ]/_}" 150 env $e build/tests/gpu/bench_gpu; echo "[$v]"; grep -E "decode|prefill" "$L/bench_${v//[= ]/_}.log"
done
if [ -n "${RB:-}" ]; then
  a=$(date +%s); RB_SKIP_SMALL=1 timeout -k 5 240 bash tests/gpu/run_batch_gpu.sh "$RB" "$L/rb" > "$L/rb.log" 2>&1
  echo "run-batch $RB rc=$? $(( $(date +%s) - a ))s"; tail -5 "$L/rb.log"
fi

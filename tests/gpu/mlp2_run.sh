#!/usr/bin/env bash
# mlp2_run.sh LOGDIR - experiment: where the tagged MLP's time goes: batch-1
# decode with SLUICE_GEMV_TAGGED=0 / 1 / 2 (2: the down GEMV waits for the
# gate/up GEMV as before, tags only), with PDL and without; first the GEMV tests and e2e with it at F = 1536.
. "$(dirname "$0")/run_lib.sh"
nvidia-smi -L
t gemv 300 env SLUICE_TEST_ONLY=gemv build/tests/gpu/test_kernels
grep -E "FAIL|failed:|mlp " "$L/gemv.log" | head -20
t e2e_tagged 120 env SLUICE_GEMV_MMA_MIN_IN=1536 build/tests/gpu/test_gpu_e2e
for p in 1 0; do
  for v in 0 1 2; do
    timeout -k 5 120 env SLUICE_PDL=$p SLUICE_BENCH_ONLY=decode SLUICE_GEMV_TAGGED=$v build/tests/gpu/bench_gpu > "$L/dec_${p}_${v}.log" 2>&1
    echo "pdl=$p tagged=$v rc=$?: $(grep -E '^decode batch 1 ' "$L/dec_${p}_${v}.log")"
  done
done

#!/usr/bin/env bash
# final13_run.sh LOGDIR - the thirteenth round's last call (best on a 2-GPU
# host): make gpu-test's suite, bench_gpu with the fused gate|up on and off
# (TP=1), the prefill step at TP=2 on and off, racecheck on the GEMM test.
. "$(dirname "$0")/run_lib.sh"
nvidia-smi -L
a=$(date +%s); BUILD=build timeout -k 5 420 tests/gpu/run_gpu_tests.sh > "$L/gpu_test.log" 2>&1
echo "gpu-test rc=$? $(( $(date +%s) - a ))s: $(tail -1 "$L/gpu_test.log")"
grep -E "FAIL|near-ties \(|failed:" "$L/gpu_test.log" | sort | uniq -c | head -20
for m in 1 0; do
  t "bench_wg$m" 90 env SLUICE_CUDA_GEMM_WG=$m build/tests/gpu/bench_gpu
  grep -E "decode|prefill" "$L/bench_wg$m.log" | sed -E 's/; floor.*//' | sed "s/^/  wg=$m: /"
done
if [ "${ngpu:-0}" -ge 2 ]; then
  for m in 1 0; do
    t "bench_tp2_wg$m" 60 env SLUICE_TEST_TP=2 SLUICE_CUDA_GEMM_WG=$m SLUICE_BENCH_ONLY=prefill build/tests/gpu/bench_gpu
    grep -E "prefill" "$L/bench_tp2_wg$m.log" | sed "s/^/  TP=2 wg=$m: /"
  done
fi
t racecheck 240 env SLUICE_TEST_ONLY=gemm_wg compute-sanitizer --tool racecheck build/tests/gpu/test_kernels

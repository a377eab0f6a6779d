#!/usr/bin/env bash
# rope_gemm_run.sh LOGDIR - the fifteenth round: RoPE and the KV write in
# the QKV GEMM's epilogue (cuda_gemm_wg_rope). Its kernel test, the 16K
# prefill step with it on and off (SLUICE_CUDA_GEMM_WG_ROPE, alternating),
# make gpu-test's suite, racecheck on the kernel test.
. "$(dirname "$0")/run_lib.sh"
nvidia-smi -L
t k_rope 90 env SLUICE_TEST_ONLY=gemm_wg_rope build/tests/gpu/test_kernels
grep -E "gemm_wg_rope|FAIL" "$L/k_rope.log" | head -12
for r in 1 2; do
  for m in 1 0; do
    t "pre_rope${m}_$r" 90 env SLUICE_CUDA_GEMM_WG_ROPE=$m SLUICE_BENCH_ONLY=prefill build/tests/gpu/bench_gpu
    grep -E "prefill|TTFT" "$L/pre_rope${m}_$r.log" | sed "s/^/  rope=$m: /"
  done
done
if [ "${GPUTEST:-1}" = 1 ]; then
  a=$(date +%s); BUILD=build timeout -k 5 300 tests/gpu/run_gpu_tests.sh > "$L/gpu_test.log" 2>&1
  echo "gpu-test rc=$? $(( $(date +%s) - a ))s: $(tail -1 "$L/gpu_test.log")"
  grep -E "FAIL|near-ties \(|failed:" "$L/gpu_test.log" | sort | uniq -c | head -20
fi
if [ "${RACE:-1}" = 1 ]; then
  t racecheck 150 env SLUICE_TEST_ONLY=gemm_wg_rope compute-sanitizer --tool racecheck build/tests/gpu/test_kernels
fi

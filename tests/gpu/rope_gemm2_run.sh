#!/usr/bin/env bash
# rope_gemm2_run.sh LOGDIR - the QKV GEMM with RoPE in its epilogue, timed
# alone (SLUICE_BENCH_WG=3 bench_gemm), with the epilogue and without
# (SLUICE_GEMM_WG_ABLATE=1, outputs wrong); racecheck on its kernel test.
. "$(dirname "$0")/run_lib.sh"
nvidia-smi -L
t k_rope 90 env SLUICE_TEST_ONLY=gemm_wg_rope build/tests/gpu/test_kernels
t racecheck 150 env SLUICE_TEST_ONLY=gemm_wg_rope compute-sanitizer --tool racecheck build/tests/gpu/test_kernels
grep -E "Race reported|hazard" "$L/racecheck.log" | head -3
t bg 120 env SLUICE_BENCH_WG=3 build/tests/gpu/bench_gemm
grep qkv "$L/bg.log"
t bg_abl 120 env SLUICE_BENCH_WG=3 SLUICE_GEMM_WG_ABLATE=1 build/tests/gpu/bench_gemm
grep qkv "$L/bg_abl.log" | sed 's/^/  no epilogue: /'
# the 16K prefill step with it on and off, alternating
for r in $(seq 1 "${PRE:-0}"); do
  for m in 1 0; do
    t "pre_rope${m}_$r" 90 env SLUICE_CUDA_GEMM_WG_ROPE=$m SLUICE_BENCH_ONLY=prefill build/tests/gpu/bench_gpu
    grep -E "prefill" "$L/pre_rope${m}_$r.log" | sed "s/^/  rope=$m: /"
  done
done

#!/usr/bin/env bash
# mma_run.sh LOGDIR - the tensor-core GEMV (gemv.cu's "mma" kernel, taken by
# "auto" for 2-8 rows of x): the GEMV tests (every variant against the
# reference, the fusions bit for bit the unfused kernels, four fused layers
# in a graph with PDL), memcheck and racecheck on them; end to end and the
# engine suite with each cache, and the engine suite with the fused GEMVs at
# 2-4 tokens too (SLUICE_CUDA_FUSED_T=4); then bench_gpu's batch-1 decode
# and decode batches of 2-8 (or DECODE's) at 1K context for the previous build
# (build/tests/gpu/bench_gpu_prev, if present), this one, and this one with
# SLUICE_CUDA_FUSED_T=4 (FUSED4=1), alternating, ROUNDS times (default 2);
# with GPUTEST=1 first what make gpu-test runs.
. "$(dirname "$0")/run_lib.sh"
nvidia-smi -L
K=build/tests/gpu/test_kernels
if [ "${GPUTEST:-0}" = 1 ]; then
  a=$(date +%s); BUILD=build timeout -k 5 420 tests/gpu/run_gpu_tests.sh > "$L/gpu_test.log" 2>&1
  echo "gpu-test rc=$? $(( $(date +%s) - a ))s: $(tail -1 "$L/gpu_test.log")"
fi
t gemv 180 env SLUICE_TEST_ONLY=gemv $K
grep -E "FAIL|failed:" "$L"/gemv*.log | head
t memcheck_gemv 240 env SLUICE_TEST_ONLY=gemv compute-sanitizer --tool memcheck $K
t racecheck_gemv 240 env SLUICE_TEST_ONLY=gemv compute-sanitizer --tool racecheck $K
e2e_tests
t engine_fused4 90 env SLUICE_CUDA_FUSED_T=4 SLUICE_TEST_DEVICE=cuda SLUICE_TEST_MODEL=tests/models/tiny-qwen3 build/tests/test_engine
t engine_fused4_kv8 90 env SLUICE_CUDA_FUSED_T=4 SLUICE_TEST_KV=fp8 SLUICE_TEST_DEVICE=cuda SLUICE_TEST_MODEL=tests/models/tiny-qwen3 build/tests/test_engine
grep -E "FAIL|failed:" "$L"/engine_fused4*.log | head
B=build/tests/gpu/bench_gpu
for r in $(seq 1 "${ROUNDS:-2}"); do
  for c in prev def $([ "${FUSED4:-0}" = 1 ] && echo fused4); do
    b=$B; envs=()
    [ $c = prev ] && { [ -x ${B}_prev ] || continue; b=${B}_prev; }
    [ $c = fused4 ] && envs=(SLUICE_CUDA_FUSED_T=4)
    timeout -k 5 120 env SLUICE_BENCH_ONLY=decode SLUICE_BENCH_DECODE=${DECODE:-2x1024,3x1024,4x1024,5x1024,6x1024,7x1024,8x1024} "${envs[@]}" $b > "$L/dec_${c}_$r.log" 2>&1
    echo "$c round $r rc=$?: $(grep -E 'decode batch' "$L/dec_${c}_$r.log" | sed -e 's/ ctx//' -e 's/; floor.*//' | tr '\n' ' ')"
  done
done

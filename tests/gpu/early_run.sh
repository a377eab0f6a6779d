#!/usr/bin/env bash
# early_run.sh LOGDIR - experiment: the decode attention's split that writes
# the token's K and V requests its first tiles before RoPE, RoPE writing
# the token's row into the stage (SLUICE_CUDA_DEC_EARLY=1). Its tests, e2e
# and the engine suite with it, then batch-1 decode and traces per setting.
. "$(dirname "$0")/run_lib.sh"
nvidia-smi -L
export SLUICE_CUDA_DEC_EARLY=1
t k_dec 180 env SLUICE_TEST_ONLY=attention_decode build/tests/gpu/test_kernels
t k_fold 180 env SLUICE_TEST_ONLY=rope_fold build/tests/gpu/test_kernels
t memcheck_fold 240 env SLUICE_TEST_ONLY=rope_fold compute-sanitizer --tool memcheck build/tests/gpu/test_kernels
t racecheck_fold 240 env SLUICE_TEST_ONLY=rope_fold compute-sanitizer --tool racecheck build/tests/gpu/test_kernels
t e2e_early 120 env SLUICE_CUDA_DEC_KMIN=32 build/tests/gpu/test_gpu_e2e
t e2e_early_clu 120 env SLUICE_CUDA_DEC_KMIN=32 SLUICE_CUDA_DEC_CLUSTER=1 build/tests/gpu/test_gpu_e2e
t engine_early 120 env SLUICE_TEST_DEVICE=cuda SLUICE_TEST_MODEL=tests/models/tiny-qwen3 build/tests/test_engine
t engine_early8 120 env SLUICE_TEST_KV=fp8 SLUICE_TEST_DEVICE=cuda SLUICE_TEST_MODEL=tests/models/tiny-qwen3 build/tests/test_engine
unset SLUICE_CUDA_DEC_EARLY
grep -E "FAIL|failed:" $L/k_dec.log $L/k_fold.log $L/e2e_early.log | head
CONFIGS=${CONFIGS:-"base EARLY=1 EARLY=1,CLU=1 EARLY=1,TRIG=1"}
envs() { local c=$1 e=(); [ "$c" = base ] && return; for kv in ${c//,/ }; do case $kv in TRIG=*) e+=(SLUICE_CUDA_ATTN_TRIG=${kv#*=});; CLU=*) e+=(SLUICE_CUDA_DEC_CLUSTER=${kv#*=});; EARLY=*) e+=(SLUICE_CUDA_DEC_EARLY=${kv#*=});; PDL=*) e+=(SLUICE_CUDA_ATTN_PDL=${kv#*=});; esac; done; echo "${e[@]}"; }
for r in ${ROUNDS:-1 2}; do
  for c in $CONFIGS; do
    timeout -k 5 120 env SLUICE_BENCH_ONLY=decode SLUICE_BENCH_DECODE=8x1024,64x1024 $(envs $c) build/tests/gpu/bench_gpu > "$L/dec_${c}_$r.log" 2>&1
    echo "$c round $r rc=$?: $(grep -E '^decode batch' "$L/dec_${c}_$r.log" | sed 's/ ctx//; s/floor.*//' | tr '\n' ' ')"
  done
done
for c in $CONFIGS; do
  timeout -k 5 120 env SLUICE_BENCH_ONLY=decode SLUICE_CUDA_TRACE=20 $(envs $c) build/tests/gpu/bench_gpu > "$L/trace_${c}.log" 2>&1
  echo "== trace $c"; grep -E "trace mean (attn|o )" "$L/trace_${c}.log"
done

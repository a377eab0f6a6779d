#!/usr/bin/env bash
# clu16_run.sh LOGDIR - experiment: decode attention merged in clusters of
# up to 16 blocks for steps of at most SLUICE_CUDA_DEC_CLUSTER tokens, with
# the own split's early tiles (SLUICE_CUDA_DEC_EARLY=1) and the ticket's one
# fence. Tests with them on, then decode batches 1-8 per setting, a trace.
. "$(dirname "$0")/run_lib.sh"
nvidia-smi -L
export SLUICE_CUDA_DEC_EARLY=1
[ -n "${KTESTS:-}" ] && t k_dec 180 env SLUICE_TEST_ONLY=attention_decode build/tests/gpu/test_kernels
[ -n "${KTESTS:-}" ] && t k_fold 180 env SLUICE_TEST_ONLY=rope_fold build/tests/gpu/test_kernels
t e2e_clu 120 env SLUICE_CUDA_DEC_KMIN=32 SLUICE_CUDA_DEC_CLUSTER=8 build/tests/gpu/test_gpu_e2e
t memcheck_e2e 300 env SLUICE_CUDA_DEC_KMIN=32 SLUICE_CUDA_DEC_CLUSTER=8 compute-sanitizer --tool memcheck build/tests/gpu/test_gpu_e2e
t engine_clu 120 env SLUICE_CUDA_DEC_KMIN=32 SLUICE_CUDA_DEC_CLUSTER=8 SLUICE_TEST_DEVICE=cuda SLUICE_TEST_MODEL=tests/models/tiny-qwen3 build/tests/test_engine
t engine_tick8 120 env SLUICE_TEST_KV=fp8 SLUICE_TEST_DEVICE=cuda SLUICE_TEST_MODEL=tests/models/tiny-qwen3 build/tests/test_engine
unset SLUICE_CUDA_DEC_EARLY
grep -E "FAIL|failed:" $L/k_dec.log $L/e2e_clu.log $L/engine_clu.log | head
CONFIGS=${CONFIGS:-"EARLY=1 EARLY=1,CLU=1 EARLY=1,CLU=4"}
envs() { local c=$1 e=(); [ "$c" = base ] && return; for kv in ${c//,/ }; do case $kv in TRIG=*) e+=(SLUICE_CUDA_ATTN_TRIG=${kv#*=});; CLU=*) e+=(SLUICE_CUDA_DEC_CLUSTER=${kv#*=});; EARLY=*) e+=(SLUICE_CUDA_DEC_EARLY=${kv#*=});; esac; done; echo "${e[@]}"; }
for r in ${ROUNDS:-1 2}; do
  for c in $CONFIGS; do
    timeout -k 5 120 env SLUICE_BENCH_ONLY=decode SLUICE_BENCH_DECODE=2x1024,4x1024,8x1024 $(envs $c) build/tests/gpu/bench_gpu > "$L/dec_${c}_$r.log" 2>&1
    echo "$c round $r rc=$?: $(grep -E '^decode batch' "$L/dec_${c}_$r.log" | sed 's/ ctx//; s/floor.*//; s/ms.step = //' | tr '\n' ' ')"
  done
done
timeout -k 5 120 env SLUICE_BENCH_ONLY=decode SLUICE_CUDA_TRACE=20 SLUICE_CUDA_DEC_EARLY=1 SLUICE_CUDA_DEC_CLUSTER=1 build/tests/gpu/bench_gpu > "$L/trace.log" 2>&1
grep -E "trace mean" "$L/trace.log"

#!/usr/bin/env bash
# clu_run.sh LOGDIR - experiment: the decode attention's splits merged
# through a thread-block cluster's shared memory (SLUICE_CUDA_DEC_CLUSTER=1)
# instead of tickets. e2e and the engine suite with it (32 keys a split, so
# short contexts split too), then batch-1 decode and traces per setting.
. "$(dirname "$0")/run_lib.sh"
nvidia-smi -L
C="SLUICE_CUDA_DEC_CLUSTER=1 SLUICE_CUDA_DEC_KMIN=32"
t e2e_clu 120 env $C build/tests/gpu/test_gpu_e2e
t e2e_tick 120 env SLUICE_CUDA_DEC_KMIN=32 build/tests/gpu/test_gpu_e2e
t engine_clu 120 env $C SLUICE_TEST_DEVICE=cuda SLUICE_TEST_MODEL=tests/models/tiny-qwen3 build/tests/test_engine
t engine_clu8 120 env $C SLUICE_TEST_KV=fp8 SLUICE_TEST_DEVICE=cuda SLUICE_TEST_MODEL=tests/models/tiny-qwen3 build/tests/test_engine
t memcheck_e2e 300 env $C compute-sanitizer --tool memcheck build/tests/gpu/test_gpu_e2e
grep -E "FAIL|failed:" $L/e2e_clu.log $L/engine_clu.log | head
CONFIGS=${CONFIGS:-"base CLU=1 CLU=1,TRIG=1 TRIG=1"}
envs() { local c=$1 e=(); [ "$c" = base ] && return; for kv in ${c//,/ }; do case $kv in TRIG=*) e+=(SLUICE_CUDA_ATTN_TRIG=${kv#*=});; CLU=*) e+=(SLUICE_CUDA_DEC_CLUSTER=${kv#*=});; PDL=*) e+=(SLUICE_CUDA_ATTN_PDL=${kv#*=});; esac; done; echo "${e[@]}"; }
for r in ${ROUNDS:-1 2}; do
  for c in $CONFIGS; do
    timeout -k 5 120 env SLUICE_BENCH_ONLY=decode SLUICE_BENCH_DECODE=8x1024,64x1024 $(envs $c) build/tests/gpu/bench_gpu > "$L/dec_${c}_$r.log" 2>&1
    echo "$c round $r rc=$?: $(grep -E '^decode batch' "$L/dec_${c}_$r.log" | sed 's/ ctx//; s/floor.*//' | tr '\n' ' ')"
  done
done
for c in $CONFIGS; do
  timeout -k 5 120 env SLUICE_BENCH_ONLY=decode SLUICE_CUDA_TRACE=20 $(envs $c) build/tests/gpu/bench_gpu > "$L/trace_${c}.log" 2>&1
  echo "== trace $c"; grep -E "trace mean" "$L/trace_${c}.log"
done

#!/usr/bin/env bash
# pre_run.sh LOGDIR - experiment: the one-token warp GEMVs' batches 1..PRE
# into shared memory before griddepcontrol.wait (SLUICE_GEMV_PRE), and the
# decode attention's merging blocks letting the o GEMV start
# (SLUICE_CUDA_ATTN_TRIG=1). Tests with them on, then batch-1 decode per
# setting (CONFIGS, rounds alternate), then one traced step per setting.
. "$(dirname "$0")/run_lib.sh"
nvidia-smi -L
K=build/tests/gpu/test_kernels
t gemv_pre3 240 env SLUICE_TEST_ONLY=gemv SLUICE_GEMV_PRE=3 $K
t gemv_pre1 240 env SLUICE_TEST_ONLY=gemv SLUICE_GEMV_PRE=1 $K
t memcheck_pre3 300 env SLUICE_TEST_ONLY=gemv_fused SLUICE_GEMV_PRE=3 compute-sanitizer --tool memcheck $K
t e2e_trig 120 env SLUICE_CUDA_ATTN_TRIG=1 SLUICE_GEMV_PRE=3 build/tests/gpu/test_gpu_e2e
t engine_trig 120 env SLUICE_CUDA_ATTN_TRIG=1 SLUICE_GEMV_PRE=3 SLUICE_TEST_DEVICE=cuda SLUICE_TEST_MODEL=tests/models/tiny-qwen3 build/tests/test_engine
CONFIGS=${CONFIGS:-"base TRIG=1 PRE=1 PRE=2 PRE=3 TRIG=1,PRE=2 TRIG=1,PRE=3"}
envs() { local c=$1 e=(); [ "$c" = base ] && return; for kv in ${c//,/ }; do case $kv in TRIG=*) e+=(SLUICE_CUDA_ATTN_TRIG=${kv#*=});; PRE=*) e+=(SLUICE_GEMV_PRE=${kv#*=});; esac; done; echo "${e[@]}"; }
for r in ${ROUNDS:-1 2}; do
  for c in $CONFIGS; do
    timeout -k 5 120 env SLUICE_BENCH_ONLY=decode $(envs $c) build/tests/gpu/bench_gpu > "$L/dec_${c}_$r.log" 2>&1
    echo "$c round $r rc=$?: $(grep -E '^decode batch 1 ' "$L/dec_${c}_$r.log")"
  done
done
for c in $CONFIGS; do
  timeout -k 5 120 env SLUICE_BENCH_ONLY=decode SLUICE_CUDA_TRACE=20 $(envs $c) build/tests/gpu/bench_gpu > "$L/trace_${c}.log" 2>&1
  echo "== trace $c"; grep -E "trace mean" "$L/trace_${c}.log"
done

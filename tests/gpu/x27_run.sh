#!/usr/bin/env bash
# x27_run.sh LOGDIR - experiment (twenty-seventh round): a decode graph's
# step inputs in the bucket's layout (default) against the full layout
# (SLUICE_X_FULL=1), argmax into mapped host memory (SLUICE_X_MAP=1);
# the step's parts by CUDA events (SLUICE_X_EV=1); everything but the
# layers left (SLUICE_CUDA_ABLATE); e2e tests with each.
. "$(dirname "$0")/run_lib.sh"
nvidia-smi -L
B=build/tests/gpu/bench_gpu
D="SLUICE_BENCH_ONLY=decode SLUICE_BENCH_DECODE=1x1024,1x1024,8x1024,64x1024"
for v in full compact map; do
  case $v in full) e="SLUICE_X_FULL=1";; compact) e="SLUICE_X_FULL=0";; map) e="SLUICE_X_MAP=1";; esac
  timeout -k 5 60 env $e SLUICE_X_EV=1 SLUICE_BENCH_ONLY=decode $B >"$L/ev_$v.log" 2>&1
  echo "ev $v rc=$?: $(grep -E '^x_ev|^decode batch 1 ' "$L/ev_$v.log" | sed 's/floor.*//' | tr '\n' ' ')"
  timeout -k 5 60 env $e SLUICE_X_EV=1 SLUICE_CUDA_ABLATE=attn,norm,qkv,o,gu,down,head SLUICE_BENCH_ONLY=decode $B >"$L/evab_$v.log" 2>&1
  echo "ablated $v rc=$?: $(grep -E '^x_ev|^decode batch 1 ' "$L/evab_$v.log" | sed 's/floor.*//' | tr '\n' ' ')"
done
for r in 1 2 3; do
  for v in full compact map; do
    case $v in full) e="SLUICE_X_FULL=1";; compact) e="SLUICE_X_FULL=0";; map) e="SLUICE_X_MAP=1";; esac
    timeout -k 5 90 env $e $D $B >"$L/d_${v}_$r.log" 2>&1
    echo "$v $r rc=$?: $(grep -E '^decode batch' "$L/d_${v}_$r.log" | sed 's/ ctx//; s/floor.*//; s/ms.step = //; s/decode batch/b/' | tr '\n' ' ')"
  done
done
e2e_tests
t e2e_map 90 env SLUICE_X_MAP=1 build/tests/gpu/test_gpu_e2e
t engine_map 90 env SLUICE_X_MAP=1 SLUICE_TEST_DEVICE=cuda SLUICE_TEST_MODEL=tests/models/tiny-qwen3 build/tests/test_engine

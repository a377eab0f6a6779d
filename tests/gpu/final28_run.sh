#!/usr/bin/env bash
# final28_run.sh LOGDIR P2 - the twenty-eighth round's tree: make gpu-test
# with the default model (its second xz part P2; run_lib.sh's
# default_model); batch-1 decode with SLUICE_GEMV_LATE=0 / 1 and an
# experiment (build/x16_bench_gpu: the late prologue reading 8 KB of x as
# bf16, timing only: the values are the f32 residual's halves), alternating;
# bench_gpu (TTFT, the 16K prefill step).
. "$(dirname "$0")/run_lib.sh"
nvidia-smi -L
default_model "$2"
gpu_test
grep -E "near-tie|sampled token|late scale" "$L/gpu_test.log" | head -20
D="SLUICE_BENCH_ONLY=decode SLUICE_BENCH_DECODE=1x1024,1x1024,8x1024"
for r in 1 2 3; do
  for v in l0 l1 x16; do
    case $v in l0) b=build/tests/gpu/bench_gpu; e="SLUICE_GEMV_LATE=0";; l1) b=build/tests/gpu/bench_gpu; e="SLUICE_GEMV_LATE=1";; x16) b=build/x16_bench_gpu; e="SLUICE_GEMV_LATE=1";; esac
    timeout -k 5 90 env $e $D $b >"$L/d_${v}_$r.log" 2>&1
    echo "$v $r rc=$?: $(grep -E '^decode batch' "$L/d_${v}_$r.log" | sed 's/ ctx//; s/floor.*//; s/ms.step = //; s/decode batch/b/' | tr '\n' ' ')"
  done
done
timeout -k 5 200 build/tests/gpu/bench_gpu >"$L/bench.log" 2>&1
echo "bench_gpu rc=$?:"; grep -E "prefill|TTFT|decode batch 1 " "$L/bench.log"

#!/usr/bin/env bash
# final27_run.sh LOGDIR - the twenty-seventh round: decode batches against
# the last round's tree (build/old_bench_gpu, fb72a36), alternating, with
# the experiment SLUICE_X_FETCH off / on (the decode graph fetching its
# inputs from mapped host memory); everything but the layers left out;
# bench_gpu (TTFT, the 16K prefill step); e2e with the fetch; memcheck on
# the sampler and e2e (kernels writing mapped host memory); make gpu-test.
. "$(dirname "$0")/run_lib.sh"
nvidia-smi -L
D="SLUICE_BENCH_ONLY=decode SLUICE_BENCH_DECODE=1x1024,1x1024,8x1024,64x1024,256x1024"
for r in 1 2; do
  for v in old f0 f1; do
    case $v in old) b=build/old_bench_gpu; e="";; f0) b=build/tests/gpu/bench_gpu; e="SLUICE_X_FETCH=0";; f1) b=build/tests/gpu/bench_gpu; e="SLUICE_X_FETCH=1";; esac
    timeout -k 5 100 env $e $D $b >"$L/d_${v}_$r.log" 2>&1
    echo "$v $r rc=$?: $(grep -E '^decode batch' "$L/d_${v}_$r.log" | sed 's/ ctx//; s/floor.*//; s/ms.step = //; s/decode batch/b/' | tr '\n' ' ')"
  done
done
A="SLUICE_CUDA_ABLATE=attn,norm,qkv,o,gu,down,head SLUICE_BENCH_ONLY=decode"
for v in old f0 f1 old f0 f1; do
  case $v in old) b=build/old_bench_gpu; e="";; f0) b=build/tests/gpu/bench_gpu; e="SLUICE_X_FETCH=0";; f1) b=build/tests/gpu/bench_gpu; e="SLUICE_X_FETCH=1";; esac
  timeout -k 5 60 env $e $A $b >"$L/ab_$v.log" 2>&1
  echo "ablated $v rc=$?: $(grep -E '^decode batch 1 ' "$L/ab_$v.log" | sed 's/floor.*//')"
done
timeout -k 5 200 build/tests/gpu/bench_gpu >"$L/bench.log" 2>&1
echo "bench_gpu rc=$?:"; grep -E "prefill|TTFT|decode batch 1 " "$L/bench.log"
t e2e_fetch 90 env SLUICE_X_FETCH=1 build/tests/gpu/test_gpu_e2e
t engine_fetch 90 env SLUICE_X_FETCH=1 SLUICE_TEST_DEVICE=cuda SLUICE_TEST_MODEL=tests/models/tiny-qwen3 build/tests/test_engine
t memcheck_sample 120 compute-sanitizer --tool memcheck build/tests/gpu/test_sample
t memcheck_e2e 150 compute-sanitizer --tool memcheck build/tests/gpu/test_gpu_e2e
gpu_test

#!/usr/bin/env bash
# persist28b_run.sh LOGDIR - the persistent gate/up GEMV as the default
# (SLUICE_GEMV_GU_PERSIST): its tests (both grids), memcheck and racecheck on
# them, e2e and the engine suite; batch-1 decode against the tree before it
# (build/old_bench_gpu) and with it off; the o GEMV on a persistent grid
# (SLUICE_GEMV_O_BPS=2|3: an experiment whose launch, the XS warp kernel
# with PERSIST at N blocks an SM, was measured slower and not kept; the
# switch is now ignored); batches 8 / 64 once.
. "$(dirname "$0")/run_lib.sh"
nvidia-smi -L
K=build/tests/gpu/test_kernels
t k_gemv 120 env SLUICE_TEST_ONLY=gemv $K
grep -E "mlp E|FAIL|failed:" "$L/k_gemv.log" | head -12
t memcheck_mlp 200 env SLUICE_TEST_ONLY=gemv_mlp compute-sanitizer --tool memcheck $K
t racecheck_mlp 200 env SLUICE_TEST_ONLY=gemv_mlp compute-sanitizer --tool racecheck $K
e2e_tests
D="SLUICE_BENCH_ONLY=decode SLUICE_BENCH_DECODE=1x1024,1x1024"
for r in 1 2 3; do
  for v in old p0 p1 o2 o3; do
    case $v in old) b=build/old_bench_gpu; e="";; p0) b=build/tests/gpu/bench_gpu; e="SLUICE_GEMV_GU_PERSIST=0";; p1) b=build/tests/gpu/bench_gpu; e="";; o2) b=build/tests/gpu/bench_gpu; e="SLUICE_GEMV_O_BPS=2";; o3) b=build/tests/gpu/bench_gpu; e="SLUICE_GEMV_O_BPS=3";; esac
    timeout -k 5 90 env $e $D $b >"$L/d_${v}_$r.log" 2>&1
    echo "$v $r rc=$?: $(grep -E '^decode batch' "$L/d_${v}_$r.log" | sed 's/ ctx//; s/floor.*//; s/ms.step = //; s/decode batch/b/' | tr '\n' ' ')"
  done
done
D="SLUICE_BENCH_ONLY=decode SLUICE_BENCH_DECODE=8x1024,64x1024"
for v in old p1; do
  case $v in old) b=build/old_bench_gpu;; p1) b=build/tests/gpu/bench_gpu;; esac
  timeout -k 5 90 env $D $b >"$L/w_$v.log" 2>&1
  echo "$v rc=$?: $(grep -E '^decode batch' "$L/w_$v.log" | sed 's/ ctx//; s/floor.*//; s/ms.step = //; s/decode batch/b/' | tr '\n' ' ')"
done

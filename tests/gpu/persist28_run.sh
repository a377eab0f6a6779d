#!/usr/bin/env bash
# persist28_run.sh LOGDIR - experiment: the one-token gate/up GEMV on a
# persistent grid (SLUICE_GEMV_GU_BPS=N blocks an SM, each warp taking rows
# j, j + S, ..., the next row's first chunks requested with the current
# row's last), against the default 1792-block grid and the tree before the
# change (build/old_bench_gpu), alternating; the tagged MLP's tests with it.
. "$(dirname "$0")/run_lib.sh"
nvidia-smi -L
K=build/tests/gpu/test_kernels
for n in 1 2; do
  t k_mlp_$n 120 env SLUICE_GEMV_GU_BPS=$n SLUICE_TEST_ONLY=gemv_mlp $K
  grep -E "mlp E|FAIL" "$L/k_mlp_$n.log" | head -8
done
t e2e_bps2 90 env SLUICE_GEMV_GU_BPS=2 build/tests/gpu/test_gpu_e2e
D="SLUICE_BENCH_ONLY=decode SLUICE_BENCH_DECODE=1x1024,1x1024"
for r in 1 2 3; do
  for v in old b0 b1 b2; do
    case $v in old) b=build/old_bench_gpu; e="";; b0) b=build/tests/gpu/bench_gpu; e="SLUICE_GEMV_GU_BPS=0";; b1) b=build/tests/gpu/bench_gpu; e="SLUICE_GEMV_GU_BPS=1";; b2) b=build/tests/gpu/bench_gpu; e="SLUICE_GEMV_GU_BPS=2";; esac
    timeout -k 5 90 env $e $D $b >"$L/d_${v}_$r.log" 2>&1
    echo "$v $r rc=$?: $(grep -E '^decode batch' "$L/d_${v}_$r.log" | sed 's/ ctx//; s/floor.*//; s/ms.step = //; s/decode batch/b/' | tr '\n' ' ')"
  done
done

#!/usr/bin/env bash
# late28_run.sh LOGDIR - the twenty-eighth round: the one-token norm GEMVs
# scaling their sums (SLUICE_GEMV_LATE=1, the default) against the scale on
# x (=0, the last round's kernels), alternating: decode at batches 1, 1, 8
# (64, 256 once each); the GEMV tests, memcheck and racecheck on them; e2e
# and the engine suite (late on); bench_gpu.
. "$(dirname "$0")/run_lib.sh"
nvidia-smi -L
K=build/tests/gpu/test_kernels
t k_gemv 240 env SLUICE_TEST_ONLY=gemv $K
grep -E "late scale|FAIL|failed:|mlp E" "$L/k_gemv.log" | head -30
D="SLUICE_BENCH_ONLY=decode SLUICE_BENCH_DECODE=1x1024,1x1024,8x1024"
for r in 1 2 3 4; do
  for v in 0 1; do
    [ $r = 4 ] && D="SLUICE_BENCH_ONLY=decode SLUICE_BENCH_DECODE=1x1024,64x1024,256x1024"
    timeout -k 5 90 env SLUICE_GEMV_LATE=$v $D build/tests/gpu/bench_gpu >"$L/d_${v}_$r.log" 2>&1
    echo "late=$v $r rc=$?: $(grep -E '^decode batch' "$L/d_${v}_$r.log" | sed 's/ ctx//; s/floor.*//; s/ms.step = //; s/decode batch/b/' | tr '\n' ' ')"
  done
done
e2e_tests
t memcheck_gemv 240 env SLUICE_TEST_ONLY=gemv_fused compute-sanitizer --tool memcheck $K
t racecheck_gemv 300 env SLUICE_TEST_ONLY=gemv_fused compute-sanitizer --tool racecheck $K

#!/usr/bin/env bash
# pro_run.sh LOGDIR - the norm prologue's sum of squares with all loads of
# four steps issued first, against the tree before (build/old_bench_gpu,
# carried): decode at 1K context, batches 1, 2, 8 alternating; the GEMV
# tests, memcheck on them, e2e and the engine suite.
. "$(dirname "$0")/run_lib.sh"
nvidia-smi -L
K=build/tests/gpu/test_kernels
b1() { # NAME BIN ENV...
    local n=$1 bin=$2
    shift 2
    timeout -k 5 120 env "$@" SLUICE_BENCH_ONLY=decode SLUICE_BENCH_DECODE=1x1024,1x1024,2x1024,8x1024 "$bin" >"$L/b_$n.log" 2>&1
    echo "$n rc=$?: $(grep -E '^decode batch' "$L/b_$n.log" | sed 's/ ctx//; s/floor.*//; s/ms.step = //; s/decode batch/b/' | tr '\n' ' ')"
}
for r in 1 2 3; do
    [ -x build/old_bench_gpu ] && b1 old_$r build/old_bench_gpu X=1
    b1 new_$r build/tests/gpu/bench_gpu X=1
    b1 xs_$r build/tests/gpu/bench_gpu SLUICE_GEMV_XS=1
done
t k_gemv_xs 120 env SLUICE_TEST_ONLY=gemv SLUICE_GEMV_XS=1 $K
t k_gemv 120 env SLUICE_TEST_ONLY=gemv $K
t k_gemv_nwsm0 120 env SLUICE_TEST_ONLY=gemv SLUICE_GEMV_NWSM=0 $K
grep -E "FAIL|failed:" "$L/k_gemv.log" "$L/k_gemv_nwsm0.log" | head
t memcheck_gemv 240 env SLUICE_GEMV_XS=1 SLUICE_TEST_ONLY=gemv compute-sanitizer --tool memcheck $K
t racecheck_gemv 240 env SLUICE_TEST_ONLY=gemv_fused compute-sanitizer --tool racecheck $K
e2e_tests
t e2e_xs 90 env SLUICE_GEMV_XS=1 build/tests/gpu/test_gpu_e2e

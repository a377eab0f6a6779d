#!/usr/bin/env bash
# nwsm_run.sh LOGDIR - the norm GEMVs' weights staged in shared memory before
# the wait (SLUICE_GEMV_NWSM, default on): the GEMV tests on and off,
# memcheck and racecheck on them, e2e; then decode at 1K context, batches
# 1-8, on and off alternating.
. "$(dirname "$0")/run_lib.sh"
nvidia-smi -L
K=build/tests/gpu/test_kernels
b1() { # NAME ENV...
    local n=$1
    shift
    timeout -k 5 120 env "$@" SLUICE_BENCH_ONLY=decode SLUICE_BENCH_DECODE=1x1024,1x1024,2x1024,4x1024,8x1024 build/tests/gpu/bench_gpu >"$L/b_$n.log" 2>&1
    echo "$n rc=$?: $(grep -E '^decode batch' "$L/b_$n.log" | sed 's/ ctx//; s/floor.*//; s/ms.step = //; s/decode batch/b/' | tr '\n' ' ')"
}
for r in 1 2 3; do
    b1 on_$r SLUICE_GEMV_NWSM=1
    b1 off_$r SLUICE_GEMV_NWSM=0
done
t k_gemv_on 180 env SLUICE_TEST_ONLY=gemv $K
t k_gemv_off 180 env SLUICE_TEST_ONLY=gemv SLUICE_GEMV_NWSM=0 $K
grep -E "FAIL|failed:" "$L/k_gemv_on.log" "$L/k_gemv_off.log" | head
t memcheck_gemv 240 env SLUICE_TEST_ONLY=gemv_fused compute-sanitizer --tool memcheck $K
t racecheck_gemv 240 env SLUICE_TEST_ONLY=gemv_fused compute-sanitizer --tool racecheck $K
t memcheck_mlp 240 env SLUICE_TEST_ONLY=gemv_mlp compute-sanitizer --tool memcheck $K
t e2e 120 build/tests/gpu/test_gpu_e2e
t engine 120 env SLUICE_TEST_DEVICE=cuda SLUICE_TEST_MODEL=tests/models/tiny-qwen3 build/tests/test_engine

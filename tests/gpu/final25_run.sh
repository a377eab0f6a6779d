#!/usr/bin/env bash
# final25_run.sh LOGDIR - the twenty-fifth round's tree: make gpu-test,
# sanitizers on the norm GEMVs and the RoPE-fold decode tests, decode at 1K
# context against the session's first tree (build/old_bench_gpu, carried)
# alternating, SLUICE_GEMV_XS off / on at batch 1, then bench_gpu (TTFT,
# the 16K prefill step).
. "$(dirname "$0")/run_lib.sh"
nvidia-smi -L
gpu_test
K=build/tests/gpu/test_kernels
t memcheck_gemv 240 env SLUICE_TEST_ONLY=gemv compute-sanitizer --tool memcheck $K
t racecheck_gemv 240 env SLUICE_TEST_ONLY=gemv_fused compute-sanitizer --tool racecheck $K
t memcheck_fold 240 env SLUICE_TEST_ONLY=rope_fold compute-sanitizer --tool memcheck $K
t racecheck_fold 300 env SLUICE_TEST_ONLY=rope_fold compute-sanitizer --tool racecheck $K
b() { # NAME BIN ENV...
    local n=$1 bin=$2
    shift 2
    timeout -k 5 150 env "$@" SLUICE_BENCH_ONLY=decode SLUICE_BENCH_DECODE=1x1024,1x1024,2x1024,4x1024,8x1024,16x1024,64x1024,256x1024 "$bin" >"$L/b_$n.log" 2>&1
    echo "$n rc=$?: $(grep -E '^decode batch' "$L/b_$n.log" | sed 's/ ctx//; s/floor.*//; s/ms.step = //; s/decode batch/b/' | tr '\n' ' ')"
}
for r in 1 2; do
    [ -x build/old_bench_gpu ] && b old_$r build/old_bench_gpu X=1
    b new_$r build/tests/gpu/bench_gpu X=1
done
for r in 1 2; do
    timeout -k 5 60 env SLUICE_GEMV_XS=0 SLUICE_BENCH_ONLY=decode SLUICE_BENCH_DECODE=1x1024,1x1024 build/tests/gpu/bench_gpu >"$L/xs0_$r.log" 2>&1
    echo "XS=0 rc=$?: $(grep -E '^decode batch' "$L/xs0_$r.log" | sed 's/ ctx//; s/floor.*//; s/ms.step = //; s/decode batch/b/' | tr '\n' ' ')"
    timeout -k 5 60 env SLUICE_BENCH_ONLY=decode SLUICE_BENCH_DECODE=1x1024,1x1024 build/tests/gpu/bench_gpu >"$L/xs1_$r.log" 2>&1
    echo "XS=1 rc=$?: $(grep -E '^decode batch' "$L/xs1_$r.log" | sed 's/ ctx//; s/floor.*//; s/ms.step = //; s/decode batch/b/' | tr '\n' ' ')"
done
timeout -k 5 200 build/tests/gpu/bench_gpu >"$L/bench.log" 2>&1
echo "bench_gpu rc=$?:"
grep -E "prefill|TTFT|decode batch 1 " "$L/bench.log"

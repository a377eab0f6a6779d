#!/usr/bin/env bash
# final22_run.sh LOGDIR - the twenty-second round's tree on one H200: make
# gpu-test, the RoPE-fold decode tests under memcheck and racecheck, e2e
# under memcheck, then
# decode at batches 1-8, 64 and 256 (two rounds) and the 16K prefill step.
. "$(dirname "$0")/run_lib.sh"
nvidia-smi -L
BUILD=build timeout 420 tests/gpu/run_gpu_tests.sh > "$L/gpu_test.log" 2>&1
echo "gpu-test rc=$?: $(tail -1 "$L/gpu_test.log")"
grep -E "FAIL|failed:" "$L/gpu_test.log" | head
K=build/tests/gpu/test_kernels
t memcheck_fold 240 env SLUICE_TEST_ONLY=rope_fold compute-sanitizer --tool memcheck $K
t memcheck_e2e 240 compute-sanitizer --tool memcheck build/tests/gpu/test_gpu_e2e
t racecheck_fold 240 env SLUICE_TEST_ONLY=rope_fold compute-sanitizer --tool racecheck $K
for r in 1 2; do
  timeout -k 5 150 env SLUICE_BENCH_ONLY=decode SLUICE_BENCH_DECODE=2x1024,4x1024,8x1024,64x1024,256x1024 build/tests/gpu/bench_gpu > "$L/dec_$r.log" 2>&1
  echo "decode round $r rc=$?: $(grep -E '^decode batch' "$L/dec_$r.log" | sed 's/ ctx//; s/floor.*//; s/ms.step = //' | tr '\n' ' ')"
done
timeout -k 5 200 build/tests/gpu/bench_gpu > "$L/bench.log" 2>&1
echo "bench_gpu rc=$?:"; grep -E "prefill|TTFT|decode batch 1 " "$L/bench.log"

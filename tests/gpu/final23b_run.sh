#!/usr/bin/env bash
# final23b_run.sh LOGDIR - the twenty-third round's last tree on one H200
# (the tagged MLP and the decode attention launched early): make gpu-test;
# the RoPE-fold decode tests under memcheck and racecheck, the tagged MLP's
# test and e2e under memcheck; batch-1 decode alternating
# SLUICE_CUDA_ATTN_PDL=0 / 1; decode at batches 1-8, 64, 256; bench_gpu.
. "$(dirname "$0")/run_lib.sh"
nvidia-smi -L
BUILD=build timeout 420 tests/gpu/run_gpu_tests.sh > "$L/gpu_test.log" 2>&1
echo "gpu-test rc=$?: $(tail -1 "$L/gpu_test.log")"
grep -E "FAIL|failed:" "$L/gpu_test.log" | head
K=build/tests/gpu/test_kernels
t memcheck_fold 240 env SLUICE_TEST_ONLY=rope_fold compute-sanitizer --tool memcheck $K
t racecheck_fold 240 env SLUICE_TEST_ONLY=rope_fold compute-sanitizer --tool racecheck $K
t memcheck_mlp 120 env SLUICE_TEST_ONLY=gemv_mlp compute-sanitizer --tool memcheck $K
t memcheck_e2e 240 compute-sanitizer --tool memcheck build/tests/gpu/test_gpu_e2e
for r in 1 2; do
  for v in 0 1; do
    timeout -k 5 120 env SLUICE_CUDA_ATTN_PDL=$v SLUICE_BENCH_ONLY=decode build/tests/gpu/bench_gpu > "$L/dec1_${v}_$r.log" 2>&1
    echo "attn_pdl=$v round $r rc=$?: $(grep -E '^decode batch 1 ' "$L/dec1_${v}_$r.log")"
  done
done
timeout -k 5 150 env SLUICE_BENCH_ONLY=decode SLUICE_BENCH_DECODE=2x1024,4x1024,8x1024,64x1024,256x1024 build/tests/gpu/bench_gpu > "$L/dec.log" 2>&1
echo "decode rc=$?: $(grep -E '^decode batch' "$L/dec.log" | sed 's/ ctx//; s/floor.*//; s/ms.step = //' | tr '\n' ' ')"
timeout -k 5 200 build/tests/gpu/bench_gpu > "$L/bench.log" 2>&1
echo "bench_gpu rc=$?:"; grep -E "prefill|TTFT|decode batch 1 " "$L/bench.log"

#!/usr/bin/env bash
# ring_run.sh LOGDIR - the ring GEMV (SLUICE_GEMV_VARIANT=5: the warp
# kernel's rows and sums, weights streamed through per-warp shared-memory
# rings by cp.async, SLUICE_GEMV_RING chunk columns in flight a warp): the
# GEMV tests with each depth (the ring kernel bit for bit the warp kernel,
# the fusions bit for bit the unfused ones), memcheck and racecheck on them;
# then batch-1 decode (bench_gpu) on the warp kernel and on the ring kernel
# at each depth, alternating, ROUNDS times (default 2).
. "$(dirname "$0")/run_lib.sh"
nvidia-smi -L
K=build/tests/gpu/test_kernels
for d in 16 4 8 32; do t gemv_r$d 180 env SLUICE_TEST_ONLY=gemv SLUICE_GEMV_RING=$d $K; done
grep -E "FAIL|failed:" "$L"/gemv_r*.log | head
t memcheck_gemv 240 env SLUICE_TEST_ONLY=gemv compute-sanitizer --tool memcheck $K
t racecheck_gemv 240 env SLUICE_TEST_ONLY=gemv compute-sanitizer --tool racecheck $K
B=build/tests/gpu/bench_gpu
for r in $(seq 1 "${ROUNDS:-2}"); do
  for c in ${CFGS:-warp 8 16 32}; do
    envs=(); [ "$c" != warp ] && envs=(SLUICE_GEMV_VARIANT=5 SLUICE_GEMV_RING=$c)
    timeout -k 5 120 env SLUICE_BENCH_ONLY=decode "${envs[@]}" $B > "$L/dec_${c}_$r.log" 2>&1
    echo "$c round $r rc=$?: $(grep -E 'decode batch 1' "$L/dec_${c}_$r.log")"
  done
done

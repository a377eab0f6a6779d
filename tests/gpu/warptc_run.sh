#!/usr/bin/env bash
# warptc_run.sh LOGDIR - the one-row warp GEMV with its sums on the tensor
# cores (SLUICE_GEMV_VARIANT=5) against "auto" (3): the GEMV tests (every
# variant, 5 included) and memcheck on them, then batch-1 decode, three
# rounds alternating: auto; warptc; warptc with the down projection on it
# too (SLUICE_GEMV_MMA_MIN_IN=1000000).
. "$(dirname "$0")/run_lib.sh"
nvidia-smi -L
t gemv 240 env SLUICE_TEST_ONLY=gemv build/tests/gpu/test_kernels
t gemv_memcheck 400 compute-sanitizer --tool memcheck env SLUICE_TEST_ONLY=gemv build/tests/gpu/test_kernels
for r in 1 2 3; do
  for c in 3 5 5x; do
    envs=(SLUICE_GEMV_VARIANT=${c%x})
    [ "$c" = 5x ] && envs+=(SLUICE_GEMV_MMA_MIN_IN=1000000)
    timeout -k 5 120 env SLUICE_BENCH_ONLY=decode "${envs[@]}" build/tests/gpu/bench_gpu > "$L/dec_${c}_$r.log" 2>&1
    echo "variant $c round $r rc=$?: $(grep -E 'decode batch' "$L/dec_${c}_$r.log" | tr '\n' ' ')"
  done
done

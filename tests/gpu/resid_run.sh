#!/usr/bin/env bash
# resid_run.sh - the bf16 residual (eleventh round): make gpu-test,
# memcheck on the GEMV and RMSNorm kernel tests, then bench_gpu (prefill,
# batch-1 and batched decode) of this build against OTHER's bench_gpu (the
# build before), alternating, REPS rounds; the issue's 1000-request run-batch
# when RB=1.
#   tests/gpu/resid_run.sh LOGDIR OTHER_BENCH_GPU [REPS]
. "$(dirname "$0")/run_lib.sh"
OTHER=$2
t gputest 300 env BUILD=build bash tests/gpu/run_gpu_tests.sh
grep -E "^== |^FAIL|passed, [0-9]+ failed$|failed:" "$L/gputest.log" | head -40
t memcheck 150 env SLUICE_TEST_ONLY=gemv_fused compute-sanitizer --tool memcheck build/tests/gpu/test_kernels
t memcheck2 60 env SLUICE_TEST_ONLY=rmsnorm compute-sanitizer --tool memcheck build/tests/gpu/test_kernels
t racecheck 150 env SLUICE_TEST_ONLY=gemv_layers compute-sanitizer --tool racecheck build/tests/gpu/test_kernels
for i in $(seq "${3:-2}"); do
    for b in other new; do
        bin=build/tests/gpu/bench_gpu; [ $b = other ] && bin=$OTHER
        t bench_${b}_$i 60 $bin
        grep -E "^prefill|^decode" "$L/bench_${b}_$i.log" | sed "s/^/  $b: /"
    done
done
if [ "${RB:-0}" = 1 ]; then
    a=$(date +%s); RB_SKIP_SMALL=1 timeout -k 5 150 bash tests/gpu/run_batch_gpu.sh 1000 "$L/rb" > "$L/rb.log" 2>&1
    echo "run-batch 1000 rc=$? $(( $(date +%s) - a ))s"; tail -3 "$L/rb.log"
fi

#!/usr/bin/env bash
# resid_run.sh - the residual in bf16 (SLUICE_CUDA_RESID, eleventh round):
# the kernel tests, end to end vs CPU/HF and the engine suite on CUDA under
# each mode, then the prefill step under modes 0/1/2, alternating, REPS rounds.
#   tests/gpu/resid_run.sh LOGDIR [REPS]
. "$(dirname "$0")/run_lib.sh"
t kernels 150 build/tests/gpu/test_kernels
grep -E "FAIL|failed:|bf16|scale" "$L/kernels.log" | head -30
for r in 0 1 2; do
    t e2e_r$r 90 env SLUICE_CUDA_RESID=$r build/tests/gpu/test_gpu_e2e
    grep -E "FAIL|failed:|logits vs|near-ties \(" "$L/e2e_r$r.log" | head -40
done
for r in 1 2; do
    t engine_r$r 90 env SLUICE_CUDA_RESID=$r SLUICE_TEST_DEVICE=cuda SLUICE_TEST_MODEL=tests/models/tiny-qwen3 build/tests/test_engine
    grep -E "FAIL|failed:" "$L/engine_r$r.log" | head
done
for i in $(seq "${2:-2}"); do
    for r in 0 1 2; do
        t pf_${r}_$i 60 env SLUICE_CUDA_RESID=$r SLUICE_BENCH_ONLY=prefill build/tests/gpu/bench_gpu
        grep -E "^prefill" "$L/pf_${r}_$i.log" | sed "s/^/  resid $r: /"
    done
done

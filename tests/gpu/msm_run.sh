#!/usr/bin/env bash
# msm_run.sh LOGDIR - experiment: the plain decode build merges from a
# shared-memory copy of the partials (SLUICE_CUDA_DEC_MSM=1), one round of
# loads: batch-1 decode off / on alternating; the decode and RoPE-fold
# tests, racecheck and memcheck on them, e2e, with it on.
. "$(dirname "$0")/run_lib.sh"
nvidia-smi -L
K=build/tests/gpu/test_kernels
b1() { # NAME ENV...
    local n=$1
    shift
    timeout -k 5 120 env "$@" SLUICE_BENCH_ONLY=decode SLUICE_BENCH_DECODE=1x1024,1x1024,2x1024 build/tests/gpu/bench_gpu >"$L/b_$n.log" 2>&1
    echo "$n rc=$?: $(grep -E '^decode batch' "$L/b_$n.log" | sed 's/ ctx//; s/floor.*//; s/ms.step = //; s/decode batch/b/' | tr '\n' ' ')"
}
for r in 1 2 3; do
    b1 off_$r X=1
    b1 on_$r SLUICE_CUDA_DEC_MSM=1
done
t k_dec 180 env SLUICE_CUDA_DEC_MSM=1 SLUICE_TEST_ONLY=attention_decode $K
t k_fold 180 env SLUICE_CUDA_DEC_MSM=1 SLUICE_TEST_ONLY=rope_fold $K
t memcheck_fold 120 env SLUICE_CUDA_DEC_MSM=1 SLUICE_TEST_ONLY=rope_fold compute-sanitizer --tool memcheck $K
t racecheck_fold 200 env SLUICE_CUDA_DEC_MSM=1 SLUICE_TEST_ONLY=rope_fold compute-sanitizer --tool racecheck $K
t e2e 90 env SLUICE_CUDA_DEC_MSM=1 build/tests/gpu/test_gpu_e2e

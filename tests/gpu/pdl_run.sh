#!/usr/bin/env bash
# pdl_run.sh - one device call for the decode launch work: the GEMV kernel
# tests (warp kernel with 4/8/16 chunks in flight, PDL on and off; memcheck
# and racecheck on them), then batch-1..256 decode of the Llama-3.1-8B shape
# under each launch setting (SLUICE_PDL, SLUICE_GEMV_CH, SLUICE_CUDA_FUSED).
# Logs under $1; a summary on stdout.
. "$(dirname "$0")/run_lib.sh"
nvidia-smi -L
t kernels 120 build/tests/gpu/test_kernels
grep -E "FAIL|failed:" "$L/kernels.log" | head -20
t memcheck_gemv 120 env SLUICE_TEST_ONLY=gemv compute-sanitizer --tool memcheck build/tests/gpu/test_kernels
t racecheck_gemv 120 env SLUICE_TEST_ONLY=gemv compute-sanitizer --tool racecheck build/tests/gpu/test_kernels
for cfg in "SLUICE_PDL=0" "SLUICE_PDL=1" "SLUICE_PDL=1 SLUICE_GEMV_CH=8" "SLUICE_PDL=1 SLUICE_GEMV_CH=16" \
           "SLUICE_PDL=0 SLUICE_GEMV_CH=16" "SLUICE_PDL=1 SLUICE_CUDA_FUSED=1" ${EXTRA_CFG:-}; do
    n=dec_$(echo "$cfg" | tr ' =' '_-')
    t "$n" 60 env $cfg SLUICE_BENCH_ONLY=decode build/tests/gpu/bench_gpu
    echo "  [$cfg] $(grep -E '^decode' "$L/$n.log" | sed -E 's/ ctx: .* = / /; s/; floor.*//' | tr '\n' ' ')"
done
t e2e_pdl 150 env SLUICE_PDL=1 build/tests/gpu/test_gpu_e2e
t engine_pdl 120 env SLUICE_PDL=1 SLUICE_TEST_DEVICE=cuda SLUICE_TEST_MODEL=tests/models/tiny-qwen3 build/tests/test_engine
grep -E "near-ties \(|FAIL|failed:" "$L/e2e_pdl.log" "$L/engine_pdl.log" | head -10

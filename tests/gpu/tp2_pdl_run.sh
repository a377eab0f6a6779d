#!/usr/bin/env bash
# tp2_pdl_run.sh - the checks that would let PDL default on with several GPUs
# (run on nvidia-h200-x2): TP=2 end to end (vs CPU/HF and vs TP=1) and the
# engine suite at TP=2 with SLUICE_PDL=1, then TP=2 decode with and without
# it, and the decode attention tests under racecheck with room for the
# 100K-token context. Logs under $1; a summary on stdout.
. "$(dirname "$0")/run_lib.sh"
nvidia-smi -L
t e2e_tp2_pdl 150 env SLUICE_PDL=1 SLUICE_TEST_TP=2 build/tests/gpu/test_gpu_e2e
t e2e_tp2_vs_tp1_pdl 150 env SLUICE_PDL=1 SLUICE_TEST_TP=2 SLUICE_TEST_REF=cuda build/tests/gpu/test_gpu_e2e
t engine_tp2_pdl 120 env SLUICE_PDL=1 SLUICE_TEST_TP=2 SLUICE_TEST_DEVICE=cuda SLUICE_TEST_MODEL=tests/models/tiny-qwen3 build/tests/test_engine
grep -E "near-ties \(|FAIL|failed:" "$L"/e2e_tp2*.log "$L/engine_tp2_pdl.log" | head -10
for p in 0 1; do
    t bench_tp2_pdl$p 90 env SLUICE_PDL=$p SLUICE_TEST_TP=2 build/tests/gpu/bench_gpu
    echo "  [SLUICE_PDL=$p] $(grep -E '^decode' "$L/bench_tp2_pdl$p.log" | sed -E 's/ ctx: .* = / /; s/; floor.*//' | tr '\n' ' ')"
done
t racecheck_dec 400 env SLUICE_TEST_ONLY=attention_decode compute-sanitizer --tool racecheck build/tests/gpu/test_kernels

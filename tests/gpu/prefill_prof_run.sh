#!/usr/bin/env bash
# prefill_prof_run.sh - one device call after a change to the prefill-path
# kernels (RoPE, RMSNorm, SwiGLU) or host sampling: the kernel tests (memcheck
# and racecheck on the RoPE ones), the device sampler, end to end vs CPU/HF
# and the engine suite on CUDA; the whole bench_gpu; decode of 256 sequences
# at long contexts with and without attention (SLUICE_CUDA_ABLATE=attn: what
# attention costs there); and a per-kernel profile (ncu, kernel durations) of
# one 16384-token prefill step of the Llama-3.1-8B shape. Logs under $1.
. "$(dirname "$0")/run_lib.sh"
nvidia-smi -L
core_tests 240
t bench_gpu 90 build/tests/gpu/bench_gpu; grep -E "decode|prefill" "$L/bench_gpu.log"
D=${DECODES:-256x1536,256x512,64x2048}
t dec_long 120 env SLUICE_BENCH_DECODE=$D SLUICE_BENCH_ONLY=decode build/tests/gpu/bench_gpu; grep -E "decode" "$L/dec_long.log"
t dec_long_noattn 120 env SLUICE_CUDA_ABLATE=attn SLUICE_BENCH_DECODE=$D SLUICE_BENCH_ONLY=decode build/tests/gpu/bench_gpu
grep -E "decode" "$L/dec_long_noattn.log"
t memcheck_rope 90 env SLUICE_TEST_ONLY=rope compute-sanitizer --tool memcheck build/tests/gpu/test_kernels
t racecheck_rope 120 env SLUICE_TEST_ONLY=rope compute-sanitizer --tool racecheck build/tests/gpu/test_kernels
t ncu_prefill 240 ${NCU:-ncu} --clock-control none --profile-from-start off --metrics gpu__time_duration.sum --csv \
  env SLUICE_BENCH_PROFILE=prefill build/tests/gpu/bench_gpu
python3 tests/gpu/ncu_sum.py "$L/ncu_prefill.log" 1 | head -16 | tee "$L/ncu_prefill_summary.txt"

#!/usr/bin/env bash
# rope_attn_prof_run.sh - one device call after a change to the prefill RoPE
# kernel: the RoPE tests (memcheck too), end to end vs CPU/HF, the engine
# suite on CUDA; the prefill step; the prefill step with attention and the
# norms left out (SLUICE_CUDA_ABLATE=attn,norm: the GEMMs and SwiGLU at the
# clocks a long burst gets); bench_attn; ncu's full section set on one
# prefill attention launch (stall reasons, pipes, shared memory). Logs under $1.
. "$(dirname "$0")/run_lib.sh"
nvidia-smi -L
t k_rope 120 env SLUICE_TEST_ONLY=rope build/tests/gpu/test_kernels
t memcheck_rope 120 env SLUICE_TEST_ONLY=rope compute-sanitizer --tool memcheck build/tests/gpu/test_kernels
grep -E "FAIL|failed:" "$L/k_rope.log" | head
t e2e_tp1 90 build/tests/gpu/test_gpu_e2e
e="env SLUICE_TEST_DEVICE=cuda SLUICE_TEST_MODEL=tests/models/tiny-qwen3"
t engine_tp1 90 $e build/tests/test_engine
t engine_kv8 90 $e SLUICE_TEST_KV=fp8 build/tests/test_engine
B=build/tests/gpu/bench_gpu
t prefill 90 env SLUICE_BENCH_ONLY=prefill $B; grep -E "prefill" "$L/prefill.log"
t prefill_gemms 90 env SLUICE_CUDA_ABLATE=attn,norm SLUICE_BENCH_ONLY=prefill $B; grep -E "prefill" "$L/prefill_gemms.log"
t d1 60 env SLUICE_BENCH_ONLY=decode $B; grep -E "decode batch 1 " "$L/d1.log"
t bench_attn 120 build/tests/gpu/bench_attn; grep -vE "^\s*$" "$L/bench_attn.log" | tail -8
NCU=$(command -v ncu || echo /usr/local/cuda/bin/ncu)
t ncu_tc 240 $NCU --clock-control none -k regex:attn_tc_kernel --launch-skip 4 --launch-count 1 --set full \
  --import-source no build/tests/gpu/bench_attn
grep -E "Duration|Registers|Achieved Occupancy|Theoretical Occupancy|Stall|Warp Cycles Per|Issued Ipc|Issue Slots|Shared Memory|Bank|L2 Hit|L1/TEX Hit|DRAM Throughput|Memory Throughput|Compute \(SM\)|Block Limit|Grid Size|Waves|Tensor|pipe|One or More|No Eligible" "$L/ncu_tc.log" | head -80
t ncu_rope 120 $NCU --clock-control none --profile-from-start off -k regex:rope_kv --launch-count 1 --set full \
  --import-source no env SLUICE_BENCH_PROFILE=prefill $B
grep -E "Duration|DRAM Throughput|Memory Throughput|Achieved Occupancy|Registers|Waves" "$L/ncu_rope.log" | head -12

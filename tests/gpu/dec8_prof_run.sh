#!/usr/bin/env bash
# dec8_prof_run.sh - the RoPE tests, the prefill step (and with attention or
# the norms left out: what each costs in place), and ncu's full section set
# on one fp8 decode attention launch at 256 sequences x 1536 context (issue
# slots, shared-memory instructions, stall reasons). Logs under $1.
. "$(dirname "$0")/run_lib.sh"
nvidia-smi -L
t k_rope 120 env SLUICE_TEST_ONLY=rope build/tests/gpu/test_kernels
grep -E "FAIL|failed:" "$L/k_rope.log" | head
t e2e_tp1 90 build/tests/gpu/test_gpu_e2e
B=build/tests/gpu/bench_gpu
t prefill 90 env SLUICE_BENCH_ONLY=prefill $B; grep -E "prefill" "$L/prefill.log"
t prefill_noattn 90 env SLUICE_CUDA_ABLATE=attn SLUICE_BENCH_ONLY=prefill $B; grep -E "prefill" "$L/prefill_noattn.log"
t prefill_nonorm 90 env SLUICE_CUDA_ABLATE=norm SLUICE_BENCH_ONLY=prefill $B; grep -E "prefill" "$L/prefill_nonorm.log"
NCU=$(command -v ncu || echo /usr/local/cuda/bin/ncu)
t ncu_rope 120 $NCU --clock-control none --profile-from-start off -k regex:rope_kv --launch-count 1 \
  --metrics gpu__time_duration.sum,dram__throughput.avg.pct_of_peak_sustained_elapsed env SLUICE_BENCH_PROFILE=prefill $B
grep -E "rope_kv|duration|dram__" "$L/ncu_rope.log" | head -6
t ncu_dec8 240 $NCU --clock-control none -k regex:attn_dec_kernel --launch-skip 40 --launch-count 1 --set full \
  --import-source no env SLUICE_BENCH_KV=fp8 SLUICE_BENCH_ONLY=decode SLUICE_BENCH_DECODE=256x1536 $B
grep -E "attn_dec|Duration|Registers|Achieved Occupancy|Theoretical Occupancy|Warp Cycles Per Issued|Issue Slots|Issued Ipc|DRAM Throughput|Memory Throughput|Block Limit|Waves|Eligible|highest-utilized|stalled|represents" "$L/ncu_dec8.log" | head -50

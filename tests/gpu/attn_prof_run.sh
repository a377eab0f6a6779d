#!/usr/bin/env bash
# attn_prof_run.sh - ncu's full section set on one decode attention launch of
# a batch-1 decode step (Llama-3.1-8B shape, 1K context), caches not
# flushed: where the kernel's time goes (stall reasons, memory). Logs under $1.
. "$(dirname "$0")/run_lib.sh"
NCU=$(command -v ncu || echo /usr/local/cuda/bin/ncu)
t ncu_attn 240 $NCU --clock-control none --cache-control none --profile-from-start off -k regex:"attn_dec|add_rmsnorm" --launch-count 3 \
  --set full --import-source no env SLUICE_BENCH_ONLY=decode SLUICE_BENCH_PROFILE=1 ${CFG:-} build/tests/gpu/bench_gpu
grep -E "Duration|Elapsed Cycles|Registers|Achieved Occupancy|Stall|Warp Cycles|Issued Ipc|L2 Hit|DRAM Throughput|Memory Throughput|Block Limit|Grid Size|Waves" "$L/ncu_attn.log" | head -60

#!/usr/bin/env bash
# kv8_perm_run.sh - one device call after a change to the fp8 decode tiles:
# the fp8 kernel tests and the bf16 decode ones, memcheck and racecheck on
# the fp8 ones, end to end and the engine suite with each cache; fp8 and bf16
# decode at batch 1 and at 256 x 1536 / 64 x 2048; ncu's full section set on
# one fp8 decode launch at 256 x 1536; the sustained GEMM ceiling
# (bench_gemm) with the SM clock sampled. Logs under $1.
. "$(dirname "$0")/run_lib.sh"
nvidia-smi -L
dec_tests rope_fold_kv8
B=build/tests/gpu/bench_gpu
t dec_fp8 120 env SLUICE_BENCH_KV=fp8 SLUICE_BENCH_ONLY=decode SLUICE_BENCH_DECODE=256x1536,64x2048 $B; grep -E "decode" "$L/dec_fp8.log"
t dec_bf16 120 env SLUICE_BENCH_ONLY=decode SLUICE_BENCH_DECODE=256x1536,64x2048 $B; grep -E "decode" "$L/dec_bf16.log"
NCU=$(command -v ncu || echo /usr/local/cuda/bin/ncu)
t ncu_dec8 240 $NCU --clock-control none -k regex:attn_dec_kernel --launch-skip 40 --launch-count 1 --set full \
  --import-source no env SLUICE_BENCH_KV=fp8 SLUICE_BENCH_ONLY=batches SLUICE_BENCH_DECODE=256x1536 $B
grep -E "attn_dec|Duration|Registers Per|Achieved Occupancy|Warp Cycles Per Issued|Issue Slots|DRAM Throughput|Block Limit Shared|Eligible Warps|highest-utilized|represents" "$L/ncu_dec8.log" | head -30
nvidia-smi --query-gpu=timestamp,clocks.sm,power.draw,clocks_event_reasons.active --format=csv,noheader -lms 50 > "$L/gemm_clocks.csv" 2>&1 &
smi=$!
t gemm 120 build/tests/gpu/bench_gemm; cat "$L/gemm.log"
kill $smi 2>/dev/null; wait $smi 2>/dev/null
awk -F', ' '$3+0 > 300 {print $2}' "$L/gemm_clocks.csv" | sort | uniq -c | sort -rn | head -8

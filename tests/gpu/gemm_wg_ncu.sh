#!/usr/bin/env bash
# gemm_wg_ncu.sh - ncu on one gate|up GEMM of bench_gemm (16384 x 28672 x
# 4096): cuBLAS's (its kernel name: tile, cluster) and the warpgroup
# kernel's with SwiGLU (CTA pairs), the bytes each moves through L2 and
# shared memory, and its pipes.
. "$(dirname "$0")/run_lib.sh"
M="gpu__time_duration.sum,sm__throughput.avg.pct_of_peak_sustained_elapsed,lts__t_bytes.sum,dram__bytes_read.sum,dram__bytes_write.sum,lts__t_sectors_srcunit_tex_op_write.sum,smsp__inst_executed.sum,l1tex__data_pipe_lsu_wavefronts_mem_shared.sum,sm__pipe_tensor_op_hmma_cycles_active.avg.pct_of_peak_sustained_elapsed,sm__cycles_elapsed.avg.per_second,lts__t_sectors_srcunit_tex.sum,sm__ctas_launched.sum"
# the first cuBLAS launches of bench_gemm: qkv, o, gate|up, down
t ncu_cublas 200 ncu --metrics "$M" -k regex:'^(?!gemm_wg).*' --launch-skip 2 --launch-count 1 env SLUICE_BENCH_WG=1 build/tests/gpu/bench_gemm
grep -E '^\s+[a-z_]+.*(sum|avg|pct)|  [A-Za-z_0-9]+.*\(' "$L/ncu_cublas.log" | head -20
t ncu_wg 200 ncu --metrics "$M" -k regex:'gemm_wg_kernel' --launch-skip 2 --launch-count 1 env SLUICE_BENCH_WG=1 build/tests/gpu/bench_gemm
grep -E '^\s+[a-z_]+.*(sum|avg|pct)|  [A-Za-z_0-9]+.*\(' "$L/ncu_wg.log" | head -20

#!/usr/bin/env bash
# wg_prof_run.sh - where the warpgroup-MMA prefill attention kernel spends
# its time: ncu's warp stall reasons and pipe use on one launch (bench_attn's
# last 16K-context chunk), its SASS; bench_attn. Logs under $1.
. "$(dirname "$0")/run_lib.sh"
nvidia-smi -L
t bench_attn 120 build/tests/gpu/bench_attn; grep -E "128-row" "$L/bench_attn.log"
NCU=$(command -v ncu || echo /usr/local/cuda/bin/ncu)
t ncu_wg 240 $NCU --clock-control none -k regex:attn_wg_kernel --launch-skip ${SKIP:-29} --launch-count 1 \
  --section WarpStateStats --section ComputeWorkloadAnalysis --section SpeedOfLight --section MemoryWorkloadAnalysis \
  --metrics regex:smsp__average_warps_issue_stalled_.*_per_issue_active.ratio,regex:sm__pipe_.*_cycles_active.avg.pct_of_peak_sustained_active,regex:sm__inst_executed_pipe_.*.sum \
  --import-source no build/tests/gpu/bench_attn
grep -E "stalled|pipe|Duration" "$L/ncu_wg.log" | awk '$NF+0 > 0.05 || /Duration/' | sort -k3 -n -r | head -60
OBJ=$(command -v cuobjdump || echo /usr/local/cuda/bin/cuobjdump)
$OBJ -sass -fun _Z14attn_wg_kernel14cuda_attn_args build/tests/gpu/bench_attn > "$L/wg.sass" 2>&1
echo "sass lines $(wc -l < "$L/wg.sass")"
grep -oE "^\s+/\*[0-9a-f]+\*/\s+[A-Z][A-Z0-9.]*" "$L/wg.sass" | awk '{print $2}' | sed 's/\..*//' | sort | uniq -c | sort -rn | head -30

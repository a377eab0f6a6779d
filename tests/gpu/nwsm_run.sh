#!/usr/bin/env bash
# nwsm_run.sh LOGDIR - experiment: the norm GEMVs' prologue. SLUICE_GEMV_NWSM
# (1: the norm weights staged in shared memory before the wait by
# cp.async.ca in every norm GEMV, 2: only in the qkv pair kernel, 3: every
# one by cp.async.cg) and SLUICE_GEMV_PRE2=1 (the tagged gate/up GEMV's
# second weight batch before the wait), 4 (2, and the gate/up GEMV's
# first SLUICE_GEMV_NWB blocks, default 2 an SM): batch-1 decode alternating, the
# traced timeline of each, the GEMV tests under each.
. "$(dirname "$0")/run_lib.sh"
nvidia-smi -L
K=build/tests/gpu/test_kernels
b1() { # NAME ENV...
    local n=$1
    shift
    timeout -k 5 120 env "$@" SLUICE_BENCH_ONLY=decode SLUICE_BENCH_DECODE=1x1024,1x1024,2x1024,8x1024 build/tests/gpu/bench_gpu >"$L/b_$n.log" 2>&1
    echo "$n rc=$?: $(grep -E '^decode batch' "$L/b_$n.log" | sed 's/ ctx//; s/floor.*//; s/ms.step = //; s/decode batch/b/' | tr '\n' ' ')"
}
V=${V:-"base:X=1 nw2:SLUICE_GEMV_NWSM=2 nw4:SLUICE_GEMV_NWSM=4 nw4a:SLUICE_GEMV_NWSM=4,SLUICE_GEMV_NWB=132 nw4b:SLUICE_GEMV_NWSM=4,SLUICE_GEMV_NWB=528"}
for r in 1 2 3; do
    for v in $V; do b1 ${v%%:*}_$r $(echo ${v#*:} | tr ',' ' '); done
done
for v in $V; do
    timeout -k 5 120 env $(echo ${v#*:} | tr ',' ' ') SLUICE_CUDA_TRACE=30 SLUICE_BENCH_ONLY=decode SLUICE_BENCH_DECODE=1x1024 build/tests/gpu/bench_gpu >"$L/tr_${v%%:*}.log" 2>&1
    echo "== trace ${v%%:*}"; grep "trace mean" "$L/tr_${v%%:*}.log"
done
for v in $V; do
    t k_${v%%:*} 120 env $(echo ${v#*:} | tr ',' ' ') SLUICE_TEST_ONLY=gemv $K
done
t racecheck_nw4 240 env SLUICE_GEMV_NWSM=4 SLUICE_TEST_ONLY=gemv_mlp compute-sanitizer --tool racecheck $K

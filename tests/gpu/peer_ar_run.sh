#!/usr/bin/env bash
# peer_ar_run.sh LOGDIR - the one-shot peer all-reduce on two H200s: its
# kernel test (2 ranks on the two GPUs, 3 on one) with memcheck, make
# gpu-test (the TP=2 suites take it on every decode step), the rank-failure
# check (tp_check.sh's part 2: the waits must end), e2e on the NCCL and the
# unfused paths, then TP=2 decode: NCCL (SLUICE_TP_PEER_AR=0), the peer
# kernel unfused (SLUICE_CUDA_FUSED=0), the peer kernel with the norms in
# the GEMVs and the residual add in the all-reduce (the default),
# alternating, twice.
. "$(dirname "$0")/run_lib.sh"
nvidia-smi -L
nvidia-smi topo -m | head -4
t peer 120 env SLUICE_TEST_ONLY=peer build/tests/gpu/test_kernels
grep -E "peer all-reduce" "$L/peer.log" | head -20
t peer_memcheck 240 compute-sanitizer --tool memcheck env SLUICE_TEST_ONLY=peer build/tests/gpu/test_kernels
if [ "${GPUTEST:-1}" = 1 ]; then
  a=$(date +%s)
  BUILD=build timeout -k 5 ${GPU_TEST_SECS:-330} tests/gpu/run_gpu_tests.sh >"$L/gpu_test.log" 2>&1
  echo "gpu-test rc=$? $(($(date +%s) - a))s: $(tail -1 "$L/gpu_test.log")"
  grep -E "^== |FAIL|failed:" "$L/gpu_test.log" | grep -vE "^== .*passed" | grep -B1 -E "FAIL|failed:" | head -30
fi
# the other two TP=2 paths end to end: NCCL, and the peer kernel unfused
t e2e_tp2_nccl 150 env SLUICE_TP_PEER_AR=0 SLUICE_TEST_TP=2 build/tests/gpu/test_gpu_e2e
t e2e_tp2_unfused 150 env SLUICE_CUDA_FUSED=0 SLUICE_TEST_TP=2 build/tests/gpu/test_gpu_e2e
FAULT_ONLY=1 timeout -k 5 90 tests/gpu/tp_check.sh 2 "$L/fault" 2>&1 | tail -4
# NCCL; the peer kernel unfused (SLUICE_CUDA_FUSED=0); the peer kernel with the fused path (default)
for r in 1 2; do
  for p in nccl unfused fused; do
    envs=(SLUICE_TP_PEER_AR=1)
    [ $p = nccl ] && envs=(SLUICE_TP_PEER_AR=0)
    [ $p = unfused ] && envs+=(SLUICE_CUDA_FUSED=0)
    n=tp2_${p}_$r
    timeout -k 5 150 env "${envs[@]}" SLUICE_TEST_TP=2 SLUICE_BENCH_ONLY=decode \
      SLUICE_BENCH_DECODE=${DECODE:-2x1024,4x1024,8x1024,64x1024} build/tests/gpu/bench_gpu > "$L/$n.log" 2>&1
    echo "$n rc=$?: $(grep -E 'decode batch' "$L/$n.log" | sed -e 's/ ctx//' -e 's/; floor.*//' | tr '\n' ' ')"
  done
done

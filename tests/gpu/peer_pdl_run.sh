#!/usr/bin/env bash
# peer_pdl_run.sh LOGDIR - two H200s, TP=2: programmatic dependent launch
# with the peer all-reduce (SLUICE_PDL=1: the GEMV after the all-reduce
# loads weights while it waits) against the default (plain launches),
# batches 1-64, alternating, twice; e2e and the engine suite at TP=2 with
# it; then batches 128 and 256 with the peer kernel up to 8 MiB
# (SLUICE_TP_PEER_AR_MAX) against NCCL there (the default).
. "$(dirname "$0")/run_lib.sh"
nvidia-smi -L
t e2e_tp2_pdl 150 env SLUICE_PDL=1 SLUICE_TEST_TP=2 build/tests/gpu/test_gpu_e2e
t engine_tp2_pdl 150 env SLUICE_PDL=1 SLUICE_TEST_TP=2 SLUICE_TEST_DEVICE=cuda SLUICE_TEST_MODEL=tests/models/tiny-qwen3 build/tests/test_engine
bench() { # name, env...
  local n=$1; shift
  timeout -k 5 150 env "$@" SLUICE_TEST_TP=2 SLUICE_BENCH_ONLY=decode build/tests/gpu/bench_gpu > "$L/$n.log" 2>&1
  echo "$n rc=$?: $(grep -E 'decode batch' "$L/$n.log" | sed -e 's/ ctx//' -e 's/; floor.*//' | tr '\n' ' ')"
}
for r in 1 2; do
  bench plain_$r SLUICE_PDL=0 SLUICE_BENCH_DECODE=2x1024,4x1024,8x1024,64x1024
  bench pdl_$r SLUICE_PDL=1 SLUICE_BENCH_DECODE=2x1024,4x1024,8x1024,64x1024
done
bench big_nccl SLUICE_BENCH_DECODE=128x1024,256x1024
bench big_peer SLUICE_TP_PEER_AR_MAX=8388608 SLUICE_BENCH_DECODE=128x1024,256x1024
bench big_nccl2 SLUICE_BENCH_DECODE=128x1024,256x1024
bench big_peer2 SLUICE_TP_PEER_AR_MAX=8388608 SLUICE_BENCH_DECODE=128x1024,256x1024

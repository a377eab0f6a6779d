#!/usr/bin/env bash
# final21_run.sh LOGDIR - the twenty-first round's tree on two H200s: make
# gpu-test (the TP=2 suites on the peer all-reduce, the fused path and PDL,
# all now the defaults), the rank-failure check, all-reduce latency (NCCL and
# the peer kernel, bench_nccl), then decode: TP=2 batches
# 1-256 with this build and NCCL's path (SLUICE_TP_PEER_AR=0), alternating,
# twice, and one GPU at batch 1; TP=2 prefill with the peer kernel up to
# 64 MiB against NCCL; served chats at TP=2 on both paths.
. "$(dirname "$0")/run_lib.sh"
nvidia-smi -L
a=$(date +%s)
BUILD=build timeout -k 5 ${GPU_TEST_SECS:-330} tests/gpu/run_gpu_tests.sh >"$L/gpu_test.log" 2>&1
echo "gpu-test rc=$? $(($(date +%s) - a))s: $(tail -1 "$L/gpu_test.log")"
grep -E "^== |FAIL|failed:" "$L/gpu_test.log" | grep -vE "^== .*passed" | grep -B1 -E "FAIL|failed:" | head -30
FAULT_ONLY=1 timeout -k 5 90 tests/gpu/tp_check.sh 2 "$L/fault" 2>&1 | tail -4
timeout -k 5 120 build/tests/gpu/bench_nccl 2 2>&1 | tee "$L/bench_nccl.log"
bench() { # name, env...
  local n=$1; shift
  timeout -k 5 150 env "$@" SLUICE_BENCH_ONLY=decode build/tests/gpu/bench_gpu > "$L/$n.log" 2>&1
  echo "$n rc=$?: $(grep -E 'decode batch' "$L/$n.log" | sed -e 's/ ctx//' -e 's/; floor.*//' | tr '\n' ' ')"
}
D=2x1024,4x1024,8x1024,64x1024,128x1024,256x1024
for r in 1 2; do
  bench tp2_nccl_$r SLUICE_TP_PEER_AR=0 SLUICE_TEST_TP=2 SLUICE_BENCH_DECODE=$D
  bench tp2_$r SLUICE_TEST_TP=2 SLUICE_BENCH_DECODE=$D
done
bench tp1 SLUICE_TEST_TP=1
# prefill at TP=2: the 2048-token prompt's 32 MiB all-reduces on the peer
# kernel (limit 64 MiB) against NCCL (the default limit); the 16K step stays on NCCL
for r in 1; do
  timeout -k 5 150 env SLUICE_TEST_TP=2 SLUICE_BENCH_ONLY=prefill build/tests/gpu/bench_gpu > "$L/pf_nccl_$r.log" 2>&1
  echo "prefill nccl $r: $(grep -E '^prefill' "$L/pf_nccl_$r.log" | tr '\n' ' ')"
  timeout -k 5 150 env SLUICE_TEST_TP=2 SLUICE_TP_PEER_AR_MAX=67108864 SLUICE_BENCH_ONLY=prefill build/tests/gpu/bench_gpu > "$L/pf_peer_$r.log" 2>&1
  echo "prefill peer $r: $(grep -E '^prefill' "$L/pf_peer_$r.log" | tr '\n' ' ')"
done
# served at TP=2: 1 and 4 streamed chats, NCCL's path (as before this
# round: plain launches, no peer kernel) against the default
CONFIGS="build/sluice:SLUICE_TP_PEER_AR=0 build/sluice" NS="1 4" LIMIT=150 \
  MODEL_ARGS="tools/configs/llama-3.1-8b-vocab49k --load-format dummy --tokenizer tests/models/tiny-qwen3 --device cuda --kv-cache-memory 20G --tensor-parallel-size 2" \
  timeout -k 5 200 tests/gpu/small_batch_chat_run.sh "$L/served" 2>&1 | tail -12

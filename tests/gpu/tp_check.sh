#!/usr/bin/env bash
# tp_check.sh - tensor parallelism on a host with 2+ GPUs (make gpu-test; issue 9).
#  1. the GPU suites at TP=N: test_gpu_e2e against the CPU backend and HF
#     goldens, then against one GPU (SLUICE_TEST_REF=cuda), and test_engine
#     (batch invariance, chunked prefill, prefix reuse, preemption) on tiny-qwen3;
#  2. a rank failure (SLUICE_TP_FAULT) while serving: the server must stop
#     with a message within seconds, never hang;
#  3. all-reduce latency (bench_nccl).
# Usage: tests/gpu/tp_check.sh [N] [logdir]   (FAULT_ONLY=1: part 2 alone)
set -u
N=${1:-2}
LOG=${2:-/tmp/tp_check}
mkdir -p "$LOG"
export NCCL_NVLS_ENABLE=0
fails=0
run() { # name, timeout, command...
    local name=$1 t=$2; shift 2
    local s=$(date +%s.%N)
    timeout "$t" "$@" >"$LOG/$name.log" 2>&1
    local rc=$?
    printf '%-28s rc=%d  %5.1f s  %s\n' "$name" $rc "$(awk "BEGIN{print $(date +%s.%N) - $s}")" "$(tail -1 "$LOG/$name.log")"
    [ $rc -eq 0 ] || fails=$((fails + 1))
}
if [ "${FAULT_ONLY:-0}" != 1 ]; then
run e2e_tp${N}_vs_cpu 150 env SLUICE_TEST_TP=$N build/tests/gpu/test_gpu_e2e
run e2e_tp${N}_vs_tp1 150 env SLUICE_TEST_TP=$N SLUICE_TEST_REF=cuda build/tests/gpu/test_gpu_e2e
run engine_tp1_tinyq3 120 env SLUICE_TEST_DEVICE=cuda SLUICE_TEST_TP=1 SLUICE_TEST_MODEL=tests/models/tiny-qwen3 build/tests/test_engine
run engine_tp${N}_tinyq3 120 env SLUICE_TEST_DEVICE=cuda SLUICE_TEST_TP=$N SLUICE_TEST_MODEL=tests/models/tiny-qwen3 build/tests/test_engine
fi

# 2. rank N-1 fails at its 3rd step while a chat is running
PORT=18911
s=$(date +%s.%N)
SLUICE_TP_FAULT=$((N - 1)):3 timeout -k 5 60 build/sluice serve tests/models/tiny-qwen3 --port $PORT --tensor-parallel-size $N \
    --max-model-len 1024 >"$LOG/fault_server.log" 2>&1 &
SP=$!
python3 - $PORT >"$LOG/fault_client.log" 2>&1 <<'PY'
import http.client, json, sys, time
port = int(sys.argv[1])
for _ in range(600):
    try:
        c = http.client.HTTPConnection("127.0.0.1", port, timeout=5); c.request("GET", "/health")
        if c.getresponse().status == 200: break
    except Exception: pass
    time.sleep(0.2)
body = {"model": "tests/models/tiny-qwen3", "messages": [{"role": "user", "content": "hello there"}], "max_tokens": 64}
try:
    c = http.client.HTTPConnection("127.0.0.1", port, timeout=60)
    c.request("POST", "/v1/chat/completions", json.dumps(body), {"Content-Type": "application/json"})
    r = c.getresponse(); print("status", r.status, r.read()[:300])
except Exception as e:
    print("client saw:", type(e).__name__, e)
PY
wait $SP
rc=$?
el=$(awk "BEGIN{print $(date +%s.%N) - $s}")
msg=$(grep -m1 "stopping" "$LOG/fault_server.log")
echo "fault injection (rank $((N - 1)) at step 3): server exit $rc after $el s: $msg"
echo "  client: $(tail -1 "$LOG/fault_client.log")"
if [ $rc -eq 124 ] || [ -z "$msg" ]; then echo "  FAIL: the server hung or gave no message"; fails=$((fails + 1)); fi

if [ "${FAULT_ONLY:-0}" != 1 ]; then
run bench_nccl 120 build/tests/gpu/bench_nccl $N
cat "$LOG/bench_nccl.log"
fi
echo "tp_check: $fails failed"
[ $fails -eq 0 ]

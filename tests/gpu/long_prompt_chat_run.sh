#!/usr/bin/env bash
# long_prompt_chat_run.sh LOGDIR - chats beside a long *interactive* prompt,
# one GPU (Llama-3.1-8B shape, dummy weights, --max-model-len 131072), a
# server for each of CONFIGS: BINARY[:VAR=V[,VAR=V...]], the environment of
# the server (default "build/sluice build/sluice:SLUICE_YIELD_LONG_PREFILL=0
# build/sluice:SLUICE_WEIGH_BUDGET=0,SLUICE_YIELD_LONG_PREFILL=0": the
# scheduler's rules on, the long prompt not yielding to chats, nor the budget
# weighed by attention; e.g. also a build of the tree before a change):
#   1. a chat of ~LP prompt tokens alone (4 out): its time to first token;
#   2. the same length again (another document), and C chats of ~P tokens
#      (64 out) started 0.5 s apart from 0.5 s after it: their TTFT and the
#      gaps between their chunks while the long prompt is in prefill.
# MODEL_ARGS: another model (a dry run on the CPU:
# "tests/models/tiny-qwen3 --device cpu", with small LP and MAXLEN).
. "$(dirname "$0")/run_lib.sh"
PORT=${PORT:-8126}
k=0
for cfg in ${CONFIGS:-build/sluice build/sluice:SLUICE_YIELD_LONG_PREFILL=0 \
    build/sluice:SLUICE_WEIGH_BUDGET=0,SLUICE_YIELD_LONG_PREFILL=0}; do
  b=${cfg%%:*} e=""
  case $cfg in *:*) e=$(echo "${cfg#*:}" | tr , ' ') ;; esac
  k=$((k + 1)) n=$(basename "$b")_$k
  echo "== $b $e"
  env $e $b serve ${MODEL_ARGS:-tools/configs/llama-3.1-8b-vocab49k --load-format dummy \
      --tokenizer tests/models/tiny-qwen3 --device cuda --kv-cache-memory 60G} --served-model-name m --port "$PORT" \
      --max-model-len ${MAXLEN:-131072} --max-num-batched-tokens ${BUDGET:-8192} --data-dir "$L/data_$n" \
      >"$L/server_$n.log" 2>&1 &
  srv=$!
  timeout -k 5 ${LIMIT:-240} python3 - "$srv" "$PORT" "${LP:-100000}" "${C:-6}" "${P:-500}" <<'PY'
import statistics, sys, threading, time
sys.path.insert(0, "tests")
sys.path.insert(0, "tests/gpu")
import sluice_testlib as lib
from chatload import text_of, stream_chat
srv, port, lp, nchat, ptok = (int(x) for x in sys.argv[1:])
clock = time.perf_counter
if not lib.wait_healthy(port, srv, timeout=300, interval=0.5):
    sys.exit("the server exited, or did not answer /health in 300 s")
stream_chat(port, text_of(ptok, 1), 8, clock)  # warm
t0, times = stream_chat(port, text_of(lp, 2), 4, clock)
print(f"long prompt alone: TTFT {(times[0] - t0) * 1e3:.0f} ms")
res = {}
def run(key, text, n):
    try:
        res[key] = stream_chat(port, text, n, clock)
    except Exception as e:
        res[key] = e
th = [threading.Thread(target=run, args=("long", text_of(lp, 3), 4))]
th[0].start()
for k in range(nchat):
    time.sleep(0.5)
    th.append(threading.Thread(target=run, args=(k, text_of(ptok, 100 + k), 64)))
    th[-1].start()
for t in th:
    t.join()
bad = [v for v in res.values() if isinstance(v, Exception)]
if bad:
    sys.exit(f"failed: {bad[0]}")
lt0, lts = res["long"]
end = lts[0]  # the long prompt's prefill ends with its first token
print(f"long prompt beside {nchat} chats: TTFT {(end - lt0) * 1e3:.0f} ms")
ttft, gaps, during = [], [], 0
for k in range(nchat):
    c0, ts = res[k]
    ttft.append((ts[0] - c0) * 1e3)
    for a, b in zip(ts, ts[1:]):
        if b <= end:
            gaps.append((b - a) * 1e3)
    during += sum(1 for t in ts if t <= end)
print(f"chats: TTFT ms {[round(x) for x in ttft]}, median {statistics.median(ttft):.0f}, max {max(ttft):.0f}")
if gaps:
    gaps.sort()
    print(f"chats' gaps between chunks during the long prefill: {len(gaps)}, median {statistics.median(gaps):.0f} ms, "
          f"p90 {gaps[int(0.9 * (len(gaps) - 1))]:.0f} ms, max {gaps[-1]:.0f} ms; {during} chunks in "
          f"{(end - lt0):.1f} s")
PY
  echo "client rc=$?"
  kill "$srv" 2>/dev/null; wait "$srv"
  grep -E "ready|rror" "$L/server_$n.log" | head -3
  rm -rf "$L/data_$n"
done

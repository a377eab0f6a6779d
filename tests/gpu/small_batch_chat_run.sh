#!/usr/bin/env bash
# small_batch_chat_run.sh LOGDIR - a few chats at once through the real
# server, one GPU (Llama-3.1-8B shape, dummy weights): for each of CONFIGS
# (BINARY[:VAR=V[,VAR=V...]], default "build/sluice_prev build/sluice"), a
# server, then for each N of NS (default "1 2 4 8"), N streamed chats of ~P
# prompt tokens (default 200) and NOUT tokens out (default 256) started
# together, twice: their time between chunks (median over all gaps) and
# the aggregate output tok/s. MODEL_ARGS: another model (a dry run on the
# CPU: "tests/models/tiny-qwen3 --device cpu").
. "$(dirname "$0")/run_lib.sh"
PORT=${PORT:-8127}
k=0
for cfg in ${CONFIGS:-build/sluice_prev build/sluice}; do
  b=${cfg%%:*} e=""
  case $cfg in *:*) e=$(echo "${cfg#*:}" | tr , ' ') ;; esac
  [ -x "$b" ] || continue
  k=$((k + 1)) n=$(basename "$b")_$k
  echo "== $b $e"
  env $e $b serve ${MODEL_ARGS:-tools/configs/llama-3.1-8b-vocab49k --load-format dummy \
      --tokenizer tests/models/tiny-qwen3 --device cuda --kv-cache-memory 20G} --served-model-name m --port "$PORT" \
      --max-model-len ${MAXLEN:-4096} \
      --data-dir "$L/data_$n" >"$L/server_$n.log" 2>&1 &
  srv=$!
  timeout -k 5 ${LIMIT:-200} python3 - "$srv" "$PORT" "${P:-200}" "${NOUT:-256}" ${NS:-1 2 4 8} <<'PY'
import statistics, sys, threading, time
sys.path.insert(0, "tests")
sys.path.insert(0, "tests/gpu")
import sluice_testlib as lib
from chatload import text_of, stream_chat
srv, port, ptok, out = (int(x) for x in sys.argv[1:5])
ns = [int(x) for x in sys.argv[5:]]
clock = time.perf_counter
if not lib.wait_healthy(port, srv, timeout=300, interval=0.5):
    sys.exit("the server exited, or did not answer /health in 300 s")
stream_chat(port, text_of(ptok, 1), 8, clock)  # warm
for n in ns:
    for rnd in range(2):
        res = {}
        def run(i):
            res[i] = stream_chat(port, text_of(ptok, 1000 * n + 100 * rnd + i), out, clock)
        th = [threading.Thread(target=run, args=(i,)) for i in range(n)]
        t0 = clock()
        for t in th:
            t.start()
        for t in th:
            t.join()
        t1 = clock()
        gaps = [(b - a) * 1e3 for i in range(n) for a, b in zip(res[i][1][out // 4:], res[i][1][out // 4 + 1:])]
        chunks = sum(len(res[i][1]) for i in range(n))
        print(f"{n} chats, round {rnd + 1}: between chunks median {statistics.median(gaps):.2f} ms; "
              f"{chunks / (t1 - t0):.0f} output tok/s over {t1 - t0:.2f} s")
PY
  echo "client rc=$?"
  kill "$srv" 2>/dev/null; wait "$srv"
  grep -E "rror" "$L/server_$n.log" | head -3
  rm -rf "$L/data_$n"
done

#!/usr/bin/env bash
# serve_bench_run.sh - `sluice bench` against `sluice serve` on the
# Llama-3.1-8B shape (dummy weights, the 49K vocabulary; BENCHMARKS.md
# "sluice bench on one H200"): 14.6K-token prompts, cache bust vs hit, then
# the server stopped. Logs under $1.
. "$(dirname "$0")/run_lib.sh"
PORT=${PORT:-8123}
build/sluice serve tools/configs/llama-3.1-8b-vocab49k --load-format dummy --tokenizer tests/models/tiny-qwen3 \
    --device cuda --served-model-name llama8b --port "$PORT" --max-model-len 16384 --kv-cache-memory 40G \
    --max-num-batched-tokens 8192 --enable-prompt-tokens-details >"$L/server.log" 2>&1 &
srv=$!
up=0
for i in $(seq 240); do
    kill -0 "$srv" 2>/dev/null || break
    if { exec 3<>/dev/tcp/127.0.0.1/"$PORT"; } 2>/dev/null; then
        printf 'GET /health HTTP/1.0\r\n\r\n' >&3
        if head -1 <&3 | grep -q " 200"; then up=1; exec 3<&-; break; fi
        exec 3<&-
    fi
    sleep 0.5
done
echo "server up=$up after ~$((i / 2)) s"
if [ $up = 1 ]; then
    timeout -k 5 300 build/sluice bench --url "http://127.0.0.1:$PORT" --prompt-tokens 14600 --max-tokens 256 \
        --runs "${RUNS:-3}" >"$L/bench.log" 2>&1
    echo "bench rc=$?"; cat "$L/bench.log" | tail -12
fi
kill "$srv" 2>/dev/null; wait "$srv"
tail -3 "$L/server.log"

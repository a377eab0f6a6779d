#!/usr/bin/env bash
# hit_ttft_run.sh LOGDIR - where a prefix-cache hit's time to first token
# goes (Llama-3.1-8B shape, dummy weights, the 49K vocabulary, as in
# serve_bench_run.sh): a 14.6K-token prompt once (miss), then again N
# times (hits), each streamed; per request the client's TTFT and the
# server's (the sluice:time_to_first_token_seconds sum before and after:
# the engine's submit -> first token), plus a /tokenize of the same prompt
# (the host's tokenizer time, round trip). Extra serve flags: $SERVE_FLAGS;
# P prompt tokens (14600; past the corpus it repeats), N hits (6), MAXLEN.
. "$(dirname "$0")/run_lib.sh"
PORT=${PORT:-8123}
# MODEL_ARGS: another model (a dry run on the CPU: "models/... --device cpu")
build/sluice serve ${MODEL_ARGS:-tools/configs/llama-3.1-8b-vocab49k --load-format dummy --tokenizer tests/models/tiny-qwen3 \
    --device cuda --kv-cache-memory 40G} --served-model-name llama8b --port "$PORT" --max-model-len ${MAXLEN:-16384} \
    --max-num-batched-tokens 8192 ${SERVE_FLAGS:-} >"$L/server.log" 2>&1 &
srv=$!
timeout -k 5 ${TIMEOUT:-200} python3 - "$PORT" "${N:-6}" "${P:-14600}" <<'PY'
import http.client, json, sys, time
sys.path.insert(0, "tests")
import sluice_testlib as lib
port, n, ptok = int(sys.argv[1]), int(sys.argv[2]), int(sys.argv[3])
t_up = time.time()
if not lib.wait_healthy(port, timeout=200, interval=0.5):
    sys.exit("the server did not answer /health in 200 s")
print(f"server up after ~{time.time() - t_up:.0f} s")
def post(path, body):
    c = http.client.HTTPConnection("127.0.0.1", port, timeout=600)
    c.request("POST", path, json.dumps(body), {"Content-Type": "application/json"})
    return c.getresponse()
def metric(name):
    c = http.client.HTTPConnection("127.0.0.1", port, timeout=30); c.request("GET", "/metrics")
    for line in c.getresponse().read().decode().splitlines():
        if line.startswith(name + " ") or line.startswith(name + "{"):
            return float(line.split()[-1])
    return float("nan")
words = open("tools/bench/corpus/python-reference.txt").read().split()
text = " ".join(words)
count = lambda t: json.load(post("/tokenize", {"model": "llama8b", "messages": [{"role": "user", "content": t}]}))["count"]
while count(text) < ptok:  # a longer prompt than the corpus: the corpus again
    text = text + "\n\n" + text
while True:
    r = json.load(post("/tokenize", {"model": "llama8b", "messages": [{"role": "user", "content": text}]}))
    if r["count"] <= ptok: break
    text = text[: int(len(text) * ptok / r["count"] * 0.995)]
print("prompt tokens", r["count"])
def chat(tag):
    s0 = metric("sluice:time_to_first_token_seconds_sum")
    t0 = time.perf_counter()
    resp = post("/v1/chat/completions", {"model": "llama8b", "messages": [{"role": "user", "content": text}],
                                         "max_tokens": 16, "stream": True, "temperature": 0, "ignore_eos": True})
    ttft = None; ntok = 0
    while True:
        line = resp.readline()
        if not line: break
        if not line.startswith(b"data: {"): continue
        ch = json.loads(line[6:]).get("choices") or [{}]
        if (ch[0].get("delta") or {}).get("content"):  # a token with text, not the role chunk
            if ttft is None: ttft = time.perf_counter() - t0
            ntok += 1
    tot = time.perf_counter() - t0
    s1 = metric("sluice:time_to_first_token_seconds_sum")
    print(f"{tag}: client TTFT {ttft*1e3:.1f} ms, server TTFT {(s1-s0)*1e3:.1f} ms, {ntok} chunks, "
          f"{(tot-ttft)/max(ntok-1,1)*1e3:.2f} ms per later chunk")
chat("miss")
for k in range(n): chat(f"hit {k}")
for k in range(3):
    t0 = time.perf_counter(); post("/tokenize", {"model": "llama8b", "messages": [{"role": "user", "content": text}]}).read()
    print(f"/tokenize round trip {(time.perf_counter()-t0)*1e3:.1f} ms")
PY
kill "$srv" 2>/dev/null; wait "$srv"
grep -E "ready|error" "$L/server.log" | head -3

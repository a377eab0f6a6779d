#!/usr/bin/env bash
# chat_beside_batch_run.sh LOGDIR - interactive chat while a Batch API job
# saturates the engine (the mission's promise), Llama-3.1-8B shape with
# dummy weights as in hit_ttft_run.sh:
#   1. C streamed chats with the engine idle (prompt ~P tokens, 64 out);
#   2. a batch of B lines (~BP prompt tokens each, BO out, ignore_eos)
#      uploaded through /v1/files and started through /v1/batches;
#   3. once the engine runs at least R batch sequences, C chats again, then
#      the batch's progress and the decode rate, and the batch is cancelled
#      (WAIT=1: waited for, its time and prefill rate printed).
# Per chat: the client's time to the first token with text and the mean
# time between later chunks. MODEL_ARGS: another model (a dry run on the
# CPU: "tests/models/tiny-qwen3 --device cpu"). Prompts longer than the
# corpus wrap around it (long documents: BP=100000 with MAXLEN=131072).
. "$(dirname "$0")/run_lib.sh"
PORT=${PORT:-8124}
build/sluice serve ${MODEL_ARGS:-tools/configs/llama-3.1-8b-vocab49k --load-format dummy --tokenizer tests/models/tiny-qwen3 \
    --device cuda --kv-cache-memory 60G} --served-model-name m --port "$PORT" --max-model-len ${MAXLEN:-4096} \
    --max-num-seqs ${SEQS:-256} --max-num-batched-tokens 8192 --data-dir "$L/data" ${SERVE_FLAGS:-} >"$L/server.log" 2>&1 &
srv=$!
timeout -k 5 ${LIMIT:-400} python3 - "$srv" "$PORT" "${C:-12}" "${P:-500}" "${B:-2000}" "${BP:-1000}" "${BO:-256}" "${R:-128}" "${WAIT:-0}" <<'PY'
import http.client, json, statistics, sys, time, uuid
sys.path.insert(0, "tests")
sys.path.insert(0, "tests/gpu")
import sluice_testlib as lib
srv, port, nchat, ptok, nb, bptok, bout, want_running, wait = (int(x) for x in sys.argv[1:])
t_up = time.time()
if not lib.wait_healthy(port, srv, timeout=300, interval=0.5):
    sys.exit("the server exited, or did not answer /health in 300 s")
print(f"server up after ~{time.time() - t_up:.0f} s")
def req(method, path, body=None, headers=None):
    c = http.client.HTTPConnection("127.0.0.1", port, timeout=600)
    c.request(method, path, body, headers or {"Content-Type": "application/json"})
    r = c.getresponse()
    return r.status, r.read()
def metrics():
    out = {}
    for line in req("GET", "/metrics")[1].decode().splitlines():
        if line.startswith("sluice:") and " " in line and "{" not in line:
            k, v = line.rsplit(" ", 1)
            out[k] = float(v)
    return out
from chatload import text_of, stream_chat
def chat(seed):
    t0, times = stream_chat(port, text_of(ptok, seed), 64, time.perf_counter)
    ttft = times[0] - t0 if times else float("inf")
    itl = (times[-1] - times[0]) / max(len(times) - 1, 1) if times else float("nan")
    return ttft, itl, len(times)
def chats(tag, base):
    res = [chat(base + k) for k in range(nchat)]
    tt = sorted(r[0] * 1e3 for r in res); it = [r[1] * 1e3 for r in res]
    print(f"{tag}: TTFT ms in order: {[round(r[0] * 1e3) for r in res]}")
    print(f"{tag}: {nchat} chats, TTFT median {statistics.median(tt):.1f} ms, max {tt[-1]:.1f} ms; "
          f"between chunks median {statistics.median(it):.2f} ms, max {max(it):.2f} ms; chunks {[r[2] for r in res][:4]}...")
chats("idle", 1000)
lines = []
for k in range(nb):
    body = {"model": "m", "messages": [{"role": "user", "content": text_of(bptok, 50000 + k)}],
            "max_tokens": bout, "ignore_eos": True, "temperature": 0}
    lines.append(json.dumps({"custom_id": f"r{k}", "method": "POST", "url": "/v1/chat/completions", "body": body}))
data = ("\n".join(lines) + "\n").encode()
bnd = uuid.uuid4().hex
form = (f"--{bnd}\r\nContent-Disposition: form-data; name=\"purpose\"\r\n\r\nbatch\r\n"
        f"--{bnd}\r\nContent-Disposition: form-data; name=\"file\"; filename=\"b.jsonl\"\r\n"
        f"Content-Type: application/jsonl\r\n\r\n").encode() + data + f"\r\n--{bnd}--\r\n".encode()
st, out = req("POST", "/v1/files", form, {"Content-Type": f"multipart/form-data; boundary={bnd}"})
fid = json.loads(out)["id"]
st, out = req("POST", "/v1/batches", json.dumps({"input_file_id": fid, "endpoint": "/v1/chat/completions",
                                                  "completion_window": "24h"}))
bid = json.loads(out)["id"]
print(f"batch {bid}: {nb} lines of ~{bptok} prompt tokens, {bout} out; {len(data)/1e6:.1f} MB")
t0 = time.time()
mb = metrics()
while time.time() - t0 < 120:
    m = metrics()
    if m.get("sluice:num_requests_running", 0) >= want_running: break
    if json.loads(req("GET", f"/v1/batches/{bid}")[1])["status"] in ("completed", "failed"): break
    time.sleep(0.5)
print(f"engine running {m.get('sluice:num_requests_running', 0):.0f} sequences after {time.time()-t0:.1f} s")
m0, b0, t1 = metrics(), json.loads(req("GET", f"/v1/batches/{bid}")[1])["request_counts"]["completed"], time.time()
chats("beside the batch", 2000)
m1, t2 = metrics(), time.time()
b1 = json.loads(req("GET", f"/v1/batches/{bid}")[1])["request_counts"]["completed"]
d = lambda k: m1.get("sluice:" + k, 0) - m0.get("sluice:" + k, 0)
dec, steps = d("decode_tokens_total"), d("engine_steps_total")
ttft_n = d("time_to_first_token_seconds_count")
print(f"during the chats ({t2-t1:.1f} s): {m1.get('sluice:num_requests_running', 0):.0f} running, "
      f"{dec/(t2-t1):.0f} decode tok/s, {d('prefill_tokens_computed_total')/(t2-t1):.0f} prefill tok/s, "
      f"batch lines done {b0} -> {b1}; {steps:.0f} steps, {(t2-t1)/max(steps,1)*1e3:.1f} ms each; "
      f"server TTFT mean {d('time_to_first_token_seconds_sum')/max(ttft_n,1)*1e3:.1f} ms over {ttft_n:.0f}; "
      f"queue time mean {d('request_queue_time_seconds_sum')/max(d('request_queue_time_seconds_count'),1)*1e3:.1f} ms; "
      f"preemptions {d('num_preemptions_total'):.0f}")
if wait:
    while json.loads(req("GET", f"/v1/batches/{bid}")[1])["status"] not in ("completed", "failed", "expired"):
        time.sleep(0.25)
    m2, t3 = metrics(), time.time()
    bt = json.loads(req("GET", f"/v1/batches/{bid}")[1])
    pre = m2.get("sluice:prefill_tokens_computed_total", 0) - mb.get("sluice:prefill_tokens_computed_total", 0)
    print(f"batch {bt['status']} {bt['request_counts']} in {t3-t0:.1f} s: {pre/(t3-t0):.0f} prefill tok/s overall "
          f"({pre:.0f} tokens, chats' included)")
else:
    st, out = req("POST", f"/v1/batches/{bid}/cancel")
    print("cancel:", st, json.loads(out).get("status"))
PY
echo "client rc=$?"
kill "$srv" 2>/dev/null; wait "$srv"
grep -E "ready|rror" "$L/server.log" | head -3

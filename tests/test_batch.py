#!/usr/bin/env python3
"""Integration tests of the Batch API: the real `sluice serve` with the default
model and a temp --data-dir, driven with the official `openai` client, curl,
raw HTTP and `sluice batch`. Covers the whole flow, validation failures,
cancel mid-run, expiry (short window via --allow-short-completion-windows),
listing with pagination, crash safety (kill -9 several times while a batch
runs; every custom_id ends with exactly one result, equal to a clean run's)
and coexistence (a chat's time to first token while a batch saturates the
engine).

Prints one line per test and ends with "N passed, N failed" (tools/run_tests.sh).
"""
import hashlib
import http.client
import json
import os
import random
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
import traceback

sys.path.insert(0, os.path.dirname(__file__))
import sluice_testlib as lib  # noqa: E402
from sluice_testlib import BIN, free_port  # noqa: E402

KEY = "sk-batch-test"
NAME = "smol"
MAX_LINES = 2000
MAX_BYTES = 8 << 20
TMP = tempfile.mkdtemp(prefix="sluice-test-batch-")
TERMINAL = ("completed", "failed", "expired", "cancelled")


class Server:
    """One `sluice serve` process on a data dir; restartable."""

    def __init__(self, name, data_dir, extra=()):
        self.name, self.data_dir, self.extra = name, data_dir, list(extra)
        self.port = free_port()
        self.proc = None
        self.log = lib.log_file(f"test_batch_{name}.log", "a")

    @property
    def url(self):
        return f"http://127.0.0.1:{self.port}"

    def start(self):
        self.proc = lib.start_server(
            ["--port", str(self.port), "--served-model-name", NAME, "--api-key", KEY,
             "--max-model-len", "512", "--max-num-seqs", "16", "--kv-cache-memory", "256M", "--data-dir",
             self.data_dir, "--max-batch-file-lines", str(MAX_LINES), "--max-batch-file-bytes", str(MAX_BYTES),
             "--allow-short-completion-windows", "--max-request-bytes", "65536"] + self.extra, stdout=self.log)
        if lib.wait_healthy(self.port, self.proc):
            return
        if self.proc.poll() is not None:
            raise RuntimeError(f"server {self.name} exited with {self.proc.returncode}")
        raise RuntimeError("server did not become ready")

    @property
    def backend(self):
        """The backend the server's ready line names (its log's last)."""
        self.log.flush()
        return lib.log_backend(f"test_batch_{self.name}.log")

    def fast(self, cpu, other):
        """cpu on the CPU backend, else other: the work a test needs to
        still be running when it acts, at the GPU's speed"""
        return cpu if self.backend in (None, "cpu") else other

    def kill9(self):
        self.proc.kill()
        self.proc.wait()

    def stop(self):
        if self.proc:
            lib.stop_server(self.proc, timeout=15)

    def client(self):
        from openai import OpenAI
        return OpenAI(base_url=self.url + "/v1", api_key=KEY, max_retries=0, timeout=120)


def request(srv, method, path, body=None, key=KEY, raw=None, headers=None, timeout=120):
    c = http.client.HTTPConnection("127.0.0.1", srv.port, timeout=timeout)
    h = {"Content-Type": "application/json"}
    if key:
        h["Authorization"] = "Bearer " + key
    h.update(headers or {})
    data = raw if raw is not None else (json.dumps(body) if body is not None else None)
    c.request(method, path, body=data, headers=h)
    r = c.getresponse()
    text = r.read()
    c.close()
    try:
        text = text.decode()
    except UnicodeDecodeError:
        pass
    return r.status, text


def metrics(srv):
    _, text = request(srv, "GET", "/metrics")
    return lib.parse_metrics(text)


def chat_line(cid, content, max_tokens, url="/v1/chat/completions", logprobs=False):
    """A greedy request line; logprobs: with its top logprobs, which judge a
    divergence on the GPU (lib.greedy_agree)"""
    if url == "/v1/completions":
        body = {"model": NAME, "prompt": content, "max_tokens": max_tokens, "temperature": 0}
    else:
        body = {"model": NAME, "messages": [{"role": "user", "content": content}], "max_tokens": max_tokens,
                "temperature": 0}
    if logprobs:
        body.update(logprobs=True, top_logprobs=lib.TOP_LOGPROBS)
    return {"custom_id": cid, "method": "POST", "url": url, "body": body}


def write_jsonl(name, lines):
    path = os.path.join(TMP, name)
    with open(path, "w") as f:
        for l in lines:
            f.write((l if isinstance(l, str) else json.dumps(l)) + "\n")
    return path


def wait_batch(client, bid, timeout=200, until=TERMINAL):
    deadline = time.time() + timeout
    b = client.batches.retrieve(bid)
    while b.status not in until:
        assert time.time() < deadline, f"batch {bid} still {b.status} after {timeout}s: {b.request_counts}"
        time.sleep(0.25)
        b = client.batches.retrieve(bid)
    return b


def read_lines(client, file_id):
    return [json.loads(l) for l in client.files.content(file_id).text.splitlines() if l.strip()]


def answer(line):
    """What a greedy run must reproduce: text, finish reason, token counts."""
    body = line["response"]["body"]
    ch = body["choices"][0]
    text = ch["message"]["content"] if "message" in ch else ch["text"]
    return text, ch["finish_reason"], body["usage"]["prompt_tokens"], body["usage"]["completion_tokens"]


def submit(client, path, endpoint="/v1/chat/completions", window="24h", metadata=None):
    f = client.files.create(file=open(path, "rb"), purpose="batch")
    return client.batches.create(input_file_id=f.id, endpoint=endpoint, completion_window=window,
                                 metadata=metadata)


# ---- tests on the shared server ---------------------------------------------------------------

def test_openai_flow(srv):
    c = srv.client()
    prompts = ["What is the capital of France?", "Name a color.", "Count to three.", "Say hello.",
               "What is 2+2?", "Name an animal."]
    lines = [chat_line(f"req-{i}", p, 6 + i % 3, logprobs=True) for i, p in enumerate(prompts)]
    path = write_jsonl("flow.jsonl", lines)
    f = c.files.create(file=open(path, "rb"), purpose="batch")
    assert f.object == "file" and f.purpose == "batch" and f.bytes == os.path.getsize(path), f
    assert f.filename == "flow.jsonl", f.filename
    assert c.files.retrieve(f.id).id == f.id
    assert c.files.content(f.id).content == open(path, "rb").read()
    b = c.batches.create(input_file_id=f.id, endpoint="/v1/chat/completions", completion_window="24h",
                         metadata={"job": "flow"})
    assert b.object == "batch" and b.status in ("validating", "in_progress"), b
    assert b.metadata == {"job": "flow"} and b.input_file_id == f.id and b.request_counts.total == 6, b
    b = wait_batch(c, b.id)
    assert b.status == "completed", b
    assert b.request_counts.completed == 6 and b.request_counts.failed == 0, b.request_counts
    assert b.output_file_id and not b.error_file_id, b
    assert b.in_progress_at and b.finalizing_at and b.completed_at and b.completed_at >= b.created_at, b
    out = read_lines(c, b.output_file_id)
    assert [o["custom_id"] for o in out] == [l["custom_id"] for l in lines]  # input order
    for o in out:
        assert o["error"] is None and o["response"]["status_code"] == 200, o
        assert o["id"].startswith("batch_req_") and o["response"]["request_id"], o
    assert "Paris" in answer(out[0])[0], out[0]
    # a batch result equals the same request sent to /v1/chat/completions
    # (greedy; on the GPU but for a near-tie)
    for i in (0, 3):
        r = c.chat.completions.create(**lines[i]["body"])
        got = out[i]["response"]["body"]["choices"][0]
        lib.expect_greedy_agree(r.choices[0].message.content, r.choices[0].logprobs, answer(out[i])[0],
                                got.get("logprobs"), srv.backend)
    assert c.files.retrieve(b.output_file_id).purpose == "batch_output"


def test_n_choices(srv):
    """A row with n > 1 gets n choices, each equal to the same request sent to
    /v1/chat/completions (same derived seeds; on the GPU a choice may part at
    a draw on a boundary, lib.sampled_agree)."""
    c = srv.client()
    k = lib.TOP_LOGPROBS
    body = {"model": NAME, "messages": [{"role": "user", "content": "Tell me a word."}], "max_tokens": 6,
            "temperature": 1.0, "seed": 5, "n": 3, "logprobs": True, "top_logprobs": k}
    lines = [{"custom_id": "n3", "method": "POST", "url": "/v1/chat/completions", "body": dict(body, top_k=k)},
             chat_line("n1", "Say hello.", 4)]
    b = wait_batch(c, submit(c, write_jsonl("n.jsonl", lines)).id)
    assert b.status == "completed" and b.request_counts.completed == 2, b
    out = read_lines(c, b.output_file_id)
    got = out[0]["response"]["body"]["choices"]
    assert [ch["index"] for ch in got] == [0, 1, 2], out[0]
    r = c.chat.completions.create(**body, extra_body={"top_k": k})
    assert len(r.choices) == 3, r
    for i, (ch, g) in enumerate(zip(r.choices, got)):
        lib.expect_sampled_agree(ch.message.content, ch.logprobs, g["message"]["content"], g.get("logprobs"),
                                 srv.backend, body["seed"], body["temperature"], k, choice=i)
    assert len(out[1]["response"]["body"]["choices"]) == 1


def test_responses_batch(srv):
    """A batch on /v1/responses: each result body is a Response object with
    the text /v1/responses gives for the same request."""
    c = srv.client()
    bodies = [{"model": NAME, "input": "What is the capital of France?", "max_output_tokens": 8, "temperature": 0},
              {"model": NAME, "instructions": "Answer briefly.", "input": [{"role": "user", "content": "Say hi."}],
               "max_output_tokens": 6, "temperature": 0}]
    lines = [{"custom_id": f"r{i}", "method": "POST", "url": "/v1/responses", "body": bd} for i, bd in enumerate(bodies)]
    lines.append({"custom_id": "bad", "method": "POST", "url": "/v1/responses", "body": {"model": NAME, "input": 5}})
    b = wait_batch(c, submit(c, write_jsonl("resp.jsonl", lines), endpoint="/v1/responses").id)
    assert b.status == "completed" and b.request_counts.completed == 2 and b.request_counts.failed == 1, b
    out = read_lines(c, b.output_file_id)
    for o, bd in zip(out, bodies):
        body = o["response"]["body"]
        assert body["object"] == "response" and body["id"].startswith("resp_"), body
        direct = c.responses.create(**bd)
        assert body["output"][0]["content"][0]["text"] == direct.output_text, (body, direct)
    err = read_lines(c, b.error_file_id)
    assert err[0]["custom_id"] == "bad" and err[0]["response"]["status_code"] == 400, err

def curl(*args):
    r = subprocess.run(["curl", "-sS", "-H", f"Authorization: Bearer {KEY}"] + list(args), capture_output=True,
                       text=True, timeout=120)
    assert r.returncode == 0, r.stderr
    return r.stdout


def test_curl_flow_completions(srv):
    lines = [chat_line(f"c{i}", f"The number {i} is", 4, url="/v1/completions") for i in range(4)]
    path = write_jsonl("curl.jsonl", lines)
    f = json.loads(curl("-F", "purpose=batch", "-F", f"file=@{path}", srv.url + "/v1/files"))
    assert f["id"].startswith("file-") and f["bytes"] == os.path.getsize(path), f
    b = json.loads(curl(srv.url + "/v1/batches", "-H", "Content-Type: application/json", "-d",
                        json.dumps({"input_file_id": f["id"], "endpoint": "/v1/completions",
                                    "completion_window": "24h"})))
    deadline = time.time() + 200
    while b["status"] not in TERMINAL:
        assert time.time() < deadline, b
        time.sleep(0.25)
        b = json.loads(curl(srv.url + "/v1/batches/" + b["id"]))
    assert b["status"] == "completed" and b["request_counts"] == {"total": 4, "completed": 4, "failed": 0}, b
    out_path = os.path.join(TMP, "curl.out.jsonl")
    curl("-o", out_path, srv.url + f"/v1/files/{b['output_file_id']}/content")
    out = [json.loads(l) for l in open(out_path)]
    assert [o["custom_id"] for o in out] == ["c0", "c1", "c2", "c3"]
    for o in out:
        body = o["response"]["body"]
        assert body["object"] == "text_completion" and body["usage"]["completion_tokens"] == 4, o


def run_cli(*args, timeout=200):
    env = dict(os.environ, SLUICE_API_KEY=KEY)
    return subprocess.run([BIN, "batch"] + list(args), capture_output=True, text=True, timeout=timeout, env=env)


def test_cli(srv):
    path = write_jsonl("cli.jsonl", [chat_line(f"k{i}", f"Say the word {w}.", 3) for i, w in
                                     enumerate(["apple", "river", "cloud"])])
    r = run_cli("submit", path, "--url", srv.url, "--wait", "--poll-interval", "0.3")
    assert r.returncode == 0, (r.stdout, r.stderr)
    bid = r.stdout.strip()
    assert bid.startswith("batch_"), r.stdout
    assert "3/3 done" in r.stderr and "ETA" in r.stderr, r.stderr
    out_path = os.path.join(TMP, "cli.output.jsonl")
    out = [json.loads(l) for l in open(out_path)]
    assert [o["custom_id"] for o in out] == ["k0", "k1", "k2"], out
    r = run_cli("status", bid, "--url", srv.url)
    assert r.returncode == 0 and "completed" in r.stdout and "3/3" in r.stdout, r
    r = run_cli("list", "--url", srv.url + "/v1", "--limit", "100")
    assert r.returncode == 0 and bid in r.stdout, r
    res = os.path.join(TMP, "cli.results.jsonl")
    r = run_cli("results", bid, "-o", res, "--url", srv.url)
    assert r.returncode == 0 and open(res).read() == open(out_path).read(), r
    r = run_cli("cancel", bid, "--url", srv.url)
    assert r.returncode == 1 and "400" in r.stderr and "cancel" in r.stderr, r  # completed: cannot cancel
    r = run_cli("status", "batch_nope", "--url", srv.url)
    assert r.returncode == 1 and "404" in r.stderr, r
    r = run_cli("list", "--url", f"http://127.0.0.1:{free_port()}")
    assert r.returncode == 1 and "cannot connect" in r.stderr, r
    r = subprocess.run([BIN, "batch", "status", bid, "--url", srv.url], capture_output=True, text=True,
                       env={k: v for k, v in os.environ.items() if k not in ("SLUICE_API_KEY", "OPENAI_API_KEY")})
    assert r.returncode == 1 and "401" in r.stderr, r


def test_validation_failure(srv):
    c = srv.client()
    good = chat_line("ok-1", "Hi", 2)
    lines = [good, "{not json", {"method": "POST", "url": "/v1/chat/completions", "body": good["body"]},
             dict(good), dict(good, custom_id="x", url="/v1/embeddings"),
             chat_line("s", "Hi", 2) | {"body": dict(good["body"], stream=True)}]
    b = submit(c, write_jsonl("bad.jsonl", lines))
    b = wait_batch(c, b.id, timeout=30)
    assert b.status == "failed" and b.failed_at, b
    errs = b.errors.data
    assert sorted({e.line for e in errs}) == [2, 3, 4, 5, 6], errs
    assert all(e.code and e.message for e in errs), errs
    assert b.request_counts.total == 0 and not b.output_file_id, b


def expect_error(srv, status, method, path, body=None, raw=None, key=KEY, headers=None, param=None):
    st, text = request(srv, method, path, body, key=key, raw=raw, headers=headers)
    assert st == status, (method, path, st, text)
    err = json.loads(text)["error"]
    assert err["message"] and err["type"], err
    if param:
        assert err["param"] == param, err
    return err


def multipart(fields, boundary="XyZ-boundary"):
    out = b""
    for name, (filename, data) in fields.items():
        disp = f'form-data; name="{name}"' + (f'; filename="{filename}"' if filename else "")
        out += f"--{boundary}\r\nContent-Disposition: {disp}\r\n\r\n".encode() + data + b"\r\n"
    return out + f"--{boundary}--\r\n".encode(), {"Content-Type": f"multipart/form-data; boundary={boundary}"}


def test_api_errors(srv):
    c = srv.client()
    expect_error(srv, 404, "GET", "/v1/batches/batch_nope")
    expect_error(srv, 404, "GET", "/v1/files/file-nope")
    expect_error(srv, 404, "GET", "/v1/files/file-nope/content")
    expect_error(srv, 404, "DELETE", "/v1/files/file-nope")
    expect_error(srv, 404, "POST", "/v1/batches/batch_nope/cancel")
    expect_error(srv, 401, "GET", "/v1/batches", key=None)
    expect_error(srv, 401, "POST", "/v1/files", key="sk-wrong", raw="x")
    expect_error(srv, 405, "DELETE", "/v1/batches")
    expect_error(srv, 400, "POST", "/v1/batches", {"endpoint": "/v1/chat/completions", "completion_window": "24h"},
                 param="input_file_id")
    f = c.files.create(file=open(write_jsonl("one.jsonl", [chat_line("a", "Hi", 1)]), "rb"), purpose="batch")
    expect_error(srv, 400, "POST", "/v1/batches", {"input_file_id": f.id, "endpoint": "/v1/embeddings",
                                                   "completion_window": "24h"})
    expect_error(srv, 400, "POST", "/v1/batches", {"input_file_id": f.id, "endpoint": "/v1/chat/completions",
                                                   "completion_window": "forever"})
    expect_error(srv, 400, "POST", "/v1/batches", {"input_file_id": f.id, "endpoint": "/v1/chat/completions",
                                                   "completion_window": "24h", "metadata": "x"}, param="metadata")
    expect_error(srv, 404, "POST", "/v1/batches", {"input_file_id": "file-nope", "endpoint": "/v1/chat/completions",
                                                   "completion_window": "24h"})
    expect_error(srv, 400, "POST", "/v1/batches", raw="{nope")
    expect_error(srv, 400, "POST", "/v1/files", raw="{}")  # not multipart
    body, h = multipart({"purpose": (None, b"fine-tune"), "file": ("a.jsonl", b"{}\n")})
    expect_error(srv, 400, "POST", "/v1/files", raw=body, headers=h, param="purpose")
    body, h = multipart({"purpose": (None, b"batch")})
    expect_error(srv, 400, "POST", "/v1/files", raw=body, headers=h, param="file")
    body, h = multipart({"purpose": (None, b"batch"), "file": ("a.jsonl", b"{}\n")})
    expect_error(srv, 400, "POST", "/v1/files", raw=body[:-30], headers=h)  # truncated
    too_many = "\n".join(json.dumps(chat_line(f"l{i}", "Hi", 1)) for i in range(MAX_LINES + 1)).encode()
    body, h = multipart({"purpose": (None, b"batch"), "file": ("big.jsonl", too_many)})
    err = expect_error(srv, 400, "POST", "/v1/files", raw=body, headers=h)
    assert str(MAX_LINES) in err["message"], err
    body, h = multipart({"purpose": (None, b"batch"), "file": ("huge.jsonl", b"x" * (MAX_BYTES + 10))})
    expect_error(srv, 413, "POST", "/v1/files", raw=body, headers=h)
    try:  # past libevent's own cap: it answers 413 and may close before reading everything
        st, _ = request(srv, "POST", "/v1/files", raw=b"y" * (MAX_BYTES + (2 << 20)), headers=h)
        assert st == 413, st
    except (ConnectionResetError, BrokenPipeError):
        pass
    # the part order does not matter, quoted boundaries work, the server keeps serving
    body, h = multipart({"file": ("q.jsonl", b'{"a":1}\n'), "purpose": (None, b"batch")}, boundary="a b")
    h["Content-Type"] = 'multipart/form-data; boundary="a b"'
    st, text = request(srv, "POST", "/v1/files", raw=body, headers=h)
    assert st == 200 and json.loads(text)["bytes"] == 8, (st, text)
    r = c.chat.completions.create(model=NAME, messages=[{"role": "user", "content": "Hi"}], max_tokens=2)
    assert r.choices[0].message.content


def test_upload_large_and_delete(srv):
    c = srv.client()
    pad = "lorem ipsum " * 400
    lines = [chat_line(f"big-{i}", f"{i} {pad}", 1) for i in range(MAX_LINES // 2)]
    path = write_jsonl("large.jsonl", lines)
    size = os.path.getsize(path)
    assert 4 << 20 < size < MAX_BYTES, size
    t0 = time.time()
    f = c.files.create(file=open(path, "rb"), purpose="batch")
    up = time.time() - t0
    assert f.bytes == size, f
    got = c.files.content(f.id).content
    assert hashlib.sha256(got).hexdigest() == hashlib.sha256(open(path, "rb").read()).hexdigest()
    page = c.files.list(purpose="batch", limit=1)
    assert page.data[0].id == f.id and page.has_more, page
    d = c.files.delete(f.id)
    assert d.deleted and d.id == f.id, d
    expect_error(srv, 404, "GET", f"/v1/files/{f.id}")
    expect_error(srv, 404, "GET", f"/v1/files/{f.id}/content")
    print(f"     upload of {size / 1e6:.1f} MB in {up:.2f}s", flush=True)


def test_cancel_mid_run(srv):
    c = srv.client()
    n = srv.fast(120, 1200)
    lines = [chat_line(f"cx{i}", f"Tell me a story about the number {i}.", srv.fast(8, 32)) for i in range(n)]
    b = submit(c, write_jsonl("cancel.jsonl", lines))
    b = wait_batch(c, b.id, until=("in_progress",), timeout=30)
    deadline = time.time() + 200
    while b.request_counts.completed < 1:
        assert time.time() < deadline and b.status == "in_progress", b
        time.sleep(0.2)
        b = c.batches.retrieve(b.id)
    b = c.batches.cancel(b.id)
    assert b.status in ("cancelling", "cancelled") and b.cancelling_at, b
    b = wait_batch(c, b.id, timeout=60)
    assert b.status == "cancelled" and b.cancelled_at, b
    n_done = b.request_counts.completed
    assert 1 <= n_done < n, b.request_counts
    assert b.output_file_id, b
    out = read_lines(c, b.output_file_id)
    assert len(out) == n_done and all(o["response"]["status_code"] == 200 for o in out)
    # every other row was cancelled (before it ran, or stopped while it ran):
    # in the error file once, counted as failed (completed + failed = total)
    errs = read_lines(c, b.error_file_id)
    assert b.request_counts.failed == n - n_done and b.request_counts.total == n, b.request_counts
    assert len(errs) == n - n_done and all(e["error"]["code"] == "batch_cancelled" for e in errs), errs[:2]
    assert sorted(o["custom_id"] for o in out + errs) == sorted(l["custom_id"] for l in lines)
    # the rows that were running were aborted in the engine: it drains at once
    deadline = time.time() + 30
    while time.time() < deadline:
        m = metrics(srv)
        if m["sluice:num_requests_running"] == 0 and m["sluice:kv_blocks_used"] == 0:
            break
        time.sleep(0.2)
    assert m["sluice:num_requests_running"] == 0 and m["sluice:kv_blocks_used"] == 0, m
    assert c.batches.cancel(b.id).status == "cancelled"  # idempotent


def test_expiry(srv):
    c = srv.client()
    n = srv.fast(150, 1800)
    lines = [chat_line(f"ex{i}", f"Describe the number {i} in detail.", srv.fast(24, 64)) for i in range(n)]
    b = submit(c, write_jsonl("expire.jsonl", lines), window="3s")
    assert b.completion_window == "3s" and b.expires_at - b.created_at == 3, b
    b = wait_batch(c, b.id, timeout=60)
    assert b.status == "expired" and b.expired_at, b
    rc = b.request_counts
    assert rc.total == n and rc.completed + rc.failed == n and rc.completed < n, rc
    errs = read_lines(c, b.error_file_id)
    assert len(errs) == rc.failed and all(e["error"]["code"] == "batch_expired" for e in errs), errs[:2]
    if rc.completed:
        assert len(read_lines(c, b.output_file_id)) == rc.completed
    deadline = time.time() + 30
    while metrics(srv)["sluice:num_requests_running"] > 0 and time.time() < deadline:
        time.sleep(0.2)
    assert metrics(srv)["sluice:num_requests_running"] == 0


def ttft(srv, content):
    from openai import OpenAI
    c = OpenAI(base_url=srv.url + "/v1", api_key=KEY, max_retries=0, timeout=120)
    t0 = time.time()
    for chunk in c.chat.completions.create(model=NAME, messages=[{"role": "user", "content": content}],
                                           max_tokens=4, temperature=0, stream=True):
        if chunk.choices and chunk.choices[0].delta.content:
            return time.time() - t0
    return time.time() - t0


def test_coexistence(srv):
    c = srv.client()
    questions = ["What is the capital of Spain?", "Name a fruit.", "What is 3+3?", "Name a planet.",
                 "Say good morning."]
    idle = statistics.median(ttft(srv, q) for q in questions)
    lines = [chat_line(f"co{i}", f"Write a long essay about topic number {i}.", 16 + i % 8)
             for i in range(srv.fast(200, 1500))]
    b = submit(c, write_jsonl("coexist.jsonl", lines))

    deadline = time.time() + 60
    while metrics(srv)["sluice:num_requests_running"] < 8:
        assert time.time() < deadline, metrics(srv)
        time.sleep(0.1)
    m0 = metrics(srv)
    busy = [ttft(srv, q) for q in questions]
    m1 = metrics(srv)
    busy_m = statistics.median(busy)
    steps = m1["sluice:engine_steps_total"] - m0["sluice:engine_steps_total"]
    seqs = (m1["sluice:decode_tokens_total"] - m0["sluice:decode_tokens_total"]) / max(steps, 1)
    assert c.batches.retrieve(b.id).status == "in_progress"
    print(f"     chat TTFT idle {idle * 1000:.0f} ms, under a saturating batch {busy_m * 1000:.0f} ms "
          f"(x{busy_m / idle:.1f}; {seqs:.1f} sequences per step meanwhile)", flush=True)
    c.batches.cancel(b.id)
    wait_batch(c, b.id, timeout=60)
    # the batch kept the engine busy while the chats ran: beside a streaming chat a step is held to twice the
    # chat's own (--interactive-itl-target auto), so the batch decodes take turns, several to a step
    assert seqs >= 4, seqs
    assert busy_m <= max(10 * idle, idle + 1.5), (idle, busy)


def test_listing_pagination(srv):
    c = srv.client()
    st, text = request(srv, "GET", "/v1/batches?limit=100")
    assert st == 200
    full = json.loads(text)
    ids = [b["id"] for b in full["data"]]
    assert len(ids) >= 6 and not full["has_more"], full
    created = [b["created_at"] for b in full["data"]]
    assert created == sorted(created, reverse=True)  # newest first
    paged = [b.id for b in c.batches.list(limit=3)]  # the client follows has_more / after
    assert paged == ids, (paged, ids)
    page = json.loads(request(srv, "GET", f"/v1/batches?limit=2&after={ids[1]}")[1])
    assert [b["id"] for b in page["data"]] == ids[2:4] and page["has_more"] and page["first_id"] == ids[2], page
    last = json.loads(request(srv, "GET", f"/v1/batches?after={ids[-2]}")[1])
    assert [b["id"] for b in last["data"]] == ids[-1:] and not last["has_more"], last
    expect_error(srv, 400, "GET", "/v1/batches?limit=0", param="limit")
    expect_error(srv, 400, "GET", "/v1/batches?limit=abc", param="limit")
    files = [f.id for f in c.files.list(purpose="batch_output")]
    assert len(files) >= 4 and len(set(files)) == len(files), files


# ---- crash safety: its own server, killed with SIGKILL while the batch runs ----------------

def test_crash_safety(_):
    data = os.path.join(TMP, "crash-data")
    srv = Server("crash", data)
    try:
        srv.start()
        c = srv.client()
        n = srv.fast(160, 1500)
        lines = [chat_line(f"cr{i:04d}", f"Item {i}: give one word.", srv.fast(2, 24) + i % 2, logprobs=True)
                 for i in range(n)]
        path = write_jsonl("crash.jsonl", lines)
        clean = wait_batch(c, submit(c, path).id, timeout=300)
        assert clean.status == "completed" and clean.request_counts.completed == n, clean
        ref = {o["custom_id"]: o for o in read_lines(c, clean.output_file_id)}
        bid = submit(c, path).id
        kills, rng = 0, random.Random(1234)
        for _ in range(4):
            # kill at a random moment after some more rows were committed
            b = c.batches.retrieve(bid)
            target = b.request_counts.completed + rng.randint(3, min(n // 8, 20))
            while b.status not in TERMINAL and b.request_counts.completed < target:
                time.sleep(0.05)
                b = c.batches.retrieve(bid)
            if b.status in TERMINAL:
                break
            time.sleep(rng.uniform(0, 0.3))
            srv.kill9()
            kills += 1
            print(f"     kill -9 #{kills} at {b.request_counts.completed}/{n} completed", flush=True)
            srv.start()
            c = srv.client()
        b = wait_batch(c, bid, timeout=300)
        assert b.status == "completed", b
        assert b.request_counts.completed == n and b.request_counts.failed == 0, b.request_counts
        out = read_lines(c, b.output_file_id)
        ids = [o["custom_id"] for o in out]
        assert ids == [l["custom_id"] for l in lines], "every custom_id exactly once, in input order"
        # the same results as the clean run (greedy; on the GPU rows run
        # again after a kill may part from it at a near-tie)
        diff, ties = [], []
        for o in out:
            r = ref[o["custom_id"]]
            if answer(o) == answer(r):
                continue
            lp = [x["response"]["body"]["choices"][0].get("logprobs") for x in (r, o)]
            same, why = lib.greedy_agree(answer(r)[0], lp[0], answer(o)[0], lp[1], srv.backend)
            (ties if same and why else diff).append(f'{o["custom_id"]}: {why}')
        for t in ties:
            print("     " + t, flush=True)
        assert not diff, f"{len(diff)} results differ from the clean run: {diff[:5]}"
        assert kills >= 2, f"only {kills} kills landed while the batch ran"
    finally:
        srv.stop()


def main():
    if lib.missing_prereqs("test_batch"):
        return 1
    if not shutil.which("curl"):
        print("test_batch: curl is missing")
        print("0 passed, 1 failed")
        return 1
    srv = Server("main", os.path.join(TMP, "data"))
    passed = failed = 0
    try:
        srv.start()
        tests = [test_openai_flow, test_n_choices, test_responses_batch, test_curl_flow_completions, test_cli, test_validation_failure,
                 test_api_errors, test_upload_large_and_delete, test_cancel_mid_run, test_expiry, test_coexistence,
                 test_listing_pagination, test_crash_safety]
        passed, failed = lib.run_tests(tests, srv, proc=srv.proc, only=sys.argv[1:])
    except Exception:
        failed += 1
        print("FAIL setup")
        traceback.print_exc(file=sys.stdout)
    finally:
        srv.stop()
        shutil.rmtree(TMP, ignore_errors=True)
    return lib.summary(passed, failed)


if __name__ == "__main__":
    sys.exit(main())

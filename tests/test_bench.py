#!/usr/bin/env python3
"""Integration tests of `sluice bench`: against the real `sluice serve` with the
default model (the table, its averages, prefix reuse visible as a lower TTFT,
p_tok against the server's own counters, CSV/JSON/plot, the load mode), and
against tiny fake servers (no /tokenize, HTTP 500, a stream that ends early,
nothing listening).

Prints one line per test and ends with "N passed, N failed" (tools/run_tests.sh).
"""
import http.client
import http.server
import json
import os
import shutil
import subprocess
import sys
import tempfile
import threading
import time

sys.path.insert(0, os.path.dirname(__file__))
import sluice_testlib as lib  # noqa: E402
from sluice_testlib import BIN, free_port  # noqa: E402

NAME = "smol"
KEY = "sk-bench"
COLS = ["run", "cache", "pp tok/s", "tg tok/s", "e2e tok/s", "TTFT s", "total s", "p_tok", "c_tok"]
TMP = tempfile.mkdtemp(prefix="sluice-test-bench-")

PORT = free_port()


def metrics():
    c = http.client.HTTPConnection("127.0.0.1", PORT, timeout=30)
    c.request("GET", "/metrics")
    text = c.getresponse().read().decode()
    c.close()
    return lib.parse_metrics(text)


def bench(*args, port=None, env=None, timeout=600):
    cmd = [BIN, "bench", "--url", f"http://127.0.0.1:{port or PORT}", *args]
    return subprocess.run(cmd, capture_output=True, text=True, timeout=timeout, env=env)


def parse_table(out):
    lines = out.strip("\n").split("\n")
    assert lines[0].split("\t") == COLS, lines[0]
    rows = [l.split("\t") for l in lines[1:]]
    for r in rows:
        assert len(r) == len(COLS), r
    return rows


def num(s):
    return None if s == "-" else float(s)


def close(a, b, rel=0.02, abs_=0.0015):
    return abs(a - b) <= max(abs_, rel * max(abs(a), abs(b)))


# ---- against the real server ----

TABLE = {}


def test_table_real_server():
    before = metrics()
    csv, js, png = (os.path.join(TMP, f) for f in ("t.csv", "t.json", "t.png"))
    extra = ["--plot", png] if shutil.which("gnuplot") else []
    r = bench("--api-key", KEY, "--prompt-tokens", "600", "--max-tokens", "8", "--runs", "2", "--csv", csv,
              "--json", js, *extra)
    assert r.returncode == 0, r.stderr
    after = metrics()
    rows = parse_table(r.stdout)
    runs = [x for x in rows if x[0] != "avg"]
    avgs = {x[1]: x for x in rows if x[0] == "avg"}
    assert [x[0] for x in runs] == ["1", "2", "3", "4"], runs
    assert [x[1] for x in runs] == ["bust", "bust", "hit", "hit"], runs
    assert sorted(avgs) == ["bust", "hit"] and len(rows) == 6, rows
    with open(js) as f:
        j = json.load(f)
    keys = ["pp_tok_s", "tg_tok_s", "e2e_tok_s", "ttft_s", "total_s", "p_tok", "c_tok"]
    for x, jr in zip(runs, j["rows"]):
        for v, k, d in zip(x[2:], keys, (1, 1, 1, 3, 3, 0, 0)):  # the table rounds the JSON's values
            assert abs(float(v) - jr[k]) <= 0.5 * 10 ** -d + 1e-6 * abs(jr[k]), (k, x, jr)
        pp, tg, e2e, ttft, total, p, c = (jr[k] for k in keys)
        assert p == 600 and c == 8, x  # sized exactly with /tokenize; ignore_eos gives max_tokens
        assert 0 < ttft < total, x
        # the JSON keeps 7 significant digits of seconds (6 decimals at least): the rates follow from them
        assert close(pp, p / ttft, rel=1e-4), jr
        assert close(e2e, c / total, rel=1e-4), jr
        assert close(tg, (c - 1) / (total - ttft), rel=1e-3), jr
    for kind in ("bust", "hit"):  # the averages row is the mean of its rows
        mine = [x for x in runs if x[1] == kind]
        for k in range(2, 9):
            mean = sum(num(x[k]) for x in mine) / len(mine)
            assert close(num(avgs[kind][k]), mean, rel=0.005, abs_=0.06), (kind, COLS[k], avgs[kind][k], mean)
    # prefix reuse end to end: a hit is faster to first token than a bust (one
    # token computed instead of 600; the margin shrinks on a crowded machine)
    assert num(avgs["hit"][5]) < num(avgs["bust"][5]), avgs
    assert min(num(x[5]) for x in runs[2:]) < min(num(x[5]) for x in runs[:2]), runs
    # p_tok is what the server counted: its prompt-token counter grew by the warm-up plus every row
    warm = [l for l in r.stderr.splitlines() if l.startswith("warm-up:")]
    assert warm, r.stderr
    warm_p = int(warm[0].split("p_tok ")[1].split(",")[0])
    grown = after["sluice:prompt_tokens_total"] - before["sluice:prompt_tokens_total"]
    assert grown == warm_p + sum(num(x[7]) for x in runs), (grown, warm_p, runs)
    # the server saw the hits as cached prefixes
    hits = after["sluice:prefix_cache_hits_total"] - before["sluice:prefix_cache_hits_total"]
    assert hits >= 2 * 592, hits
    # CSV and JSON carry the same numbers
    with open(csv) as f:
        assert [l.split(",") for l in f.read().strip().split("\n")] == [COLS] + rows
    assert j["model"] == NAME and j["sized_with"] == "tokenize" and len(j["rows"]) == 4, j
    for x, jr in zip(runs, j["rows"]):
        assert jr["cache"] == x[1] and jr["p_tok"] == int(x[7]) and close(jr["ttft_s"], num(x[5])), (jr, x)
    assert all(jr["cached_tokens"] >= 592 for jr in j["rows"][2:]), j["rows"]
    assert close(j["averages"]["hit"]["ttft_s"], num(avgs["hit"][5])), j["averages"]
    if extra:
        with open(png, "rb") as f:
            assert f.read(8) == b"\x89PNG\r\n\x1a\n"
    TABLE["stdout"] = r.stdout


def test_load_mode():
    js = os.path.join(TMP, "load.json")
    r = bench("--api-key", KEY, "--model", NAME, "--prompt-tokens", "120", "--max-tokens", "6", "--concurrency", "3",
              "--num-prompts", "6", "--json", js)
    assert r.returncode == 0, r.stderr
    lines = r.stdout.strip().split("\n")
    assert lines[0] == "metric\tvalue", lines
    m = {k: float(v) for k, v in (l.split("\t") for l in lines[1:])}
    assert m["requests"] == 6 and m["concurrency"] == 3, m
    assert m["TTFT p50 s"] <= m["TTFT p90 s"] <= m["TTFT p99 s"], m
    assert m["ITL p50 ms"] <= m["ITL p90 ms"] <= m["ITL p99 ms"], m
    assert close(m["req/s"], m["requests"] / m["wall s"], abs_=0.002), m
    assert close(m["output tok/s"], 6 * 6 / m["wall s"], abs_=0.11), m
    with open(js) as f:
        j = json.load(f)
    p = [row["p_tok"] for row in j["rows"]]
    assert all(60 <= x <= 180 for x in p) and len(set(p)) > 1, p  # seeded lengths in [T/2, 3T/2]


def test_plot_needs_gnuplot():
    env = dict(os.environ, PATH="/nonexistent")
    r = bench("--plot", os.path.join(TMP, "x.png"), env=env)
    assert r.returncode == 2 and "gnuplot" in r.stderr and "gnuplot-nox" in r.stderr, r.stderr


def test_bad_flags():
    r = bench("--runs", "0")
    assert r.returncode == 2 and "out of range" in r.stderr, r.stderr
    r = bench("--prompt-tokens", "abc")
    assert r.returncode == 2 and "--prompt-tokens" in r.stderr, r.stderr
    r = subprocess.run([BIN, "bench", "--url", "https://example.com"], capture_output=True, text=True)
    assert r.returncode == 2 and "https" in r.stderr, r.stderr


def test_too_long_for_server():
    r = bench("--api-key", KEY, "--model", NAME, "--prompt-tokens", "4000", "--max-tokens", "200")
    assert r.returncode == 1 and "max_model_len 2048" in r.stderr, r.stderr


# ---- against fake servers ----

class Fake(http.server.BaseHTTPRequestHandler):
    """mode: 'ok' (a complete chunked stream, no /tokenize), '500', or 'early'
    (the chunked stream stops before [DONE] and the connection closes)."""
    mode = "ok"
    protocol_version = "HTTP/1.1"

    def log_message(self, *a):
        pass

    def _json(self, status, obj):
        body = json.dumps(obj).encode()
        self.send_response(status)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(body)))
        self.send_header("Connection", "close")
        self.end_headers()
        self.wfile.write(body)

    def _chunk(self, data):
        self.wfile.write(b"%x\r\n%s\r\n" % (len(data), data))
        self.wfile.flush()

    def do_GET(self):
        if self.path == "/v1/models":
            return self._json(200, {"object": "list", "data": [{"id": "fake-model", "object": "model"}]})
        self._json(404, {"error": {"message": "no such route", "type": "invalid_request_error"}})

    def do_POST(self):
        n = int(self.headers.get("Content-Length", "0"))
        req = json.loads(self.rfile.read(n) or b"{}")
        if self.mode == "500":
            return self._json(500, {"error": {"message": "fake backend exploded", "type": "server_error"}})
        if self.path != "/v1/chat/completions":
            return self._json(404, {"error": {"message": "no such route", "type": "invalid_request_error"}})
        assert req["stream"] and req["stream_options"]["include_usage"]
        p_tok = 10 + len(req["messages"][0]["content"]) // 4
        self.send_response(200)
        self.send_header("Content-Type", "text/event-stream")
        self.send_header("Transfer-Encoding", "chunked")
        self.send_header("Connection", "close")
        self.end_headers()
        c_tok = req["max_tokens"]
        self._chunk(b'data: {"choices":[{"index":0,"delta":{"role":"assistant","content":""}}]}\n\n')
        for i in range(c_tok):
            time.sleep(0.002)
            ev = {"choices": [{"index": 0, "delta": {"content": f" w{i}"}, "finish_reason": None}]}
            # split one event over two chunks: the client must join them
            data = ("data: " + json.dumps(ev) + "\n\n").encode()
            self._chunk(data[:7])
            self._chunk(data[7:])
            if self.mode == "early" and i == 1:
                self.wfile.flush()
                self.close_connection = True
                return  # no terminating chunk, no [DONE]
        self._chunk(b'data: {"choices":[],"usage":{"prompt_tokens":%d,"completion_tokens":%d}}\n\n' % (p_tok, c_tok))
        self._chunk(b"data: [DONE]\n\n")
        self.wfile.write(b"0\r\n\r\n")


def fake_server(mode):
    handler = type("FakeHandler", (Fake,), {"mode": mode})
    srv = http.server.ThreadingHTTPServer(("127.0.0.1", 0), handler)
    threading.Thread(target=srv.serve_forever, daemon=True).start()
    return srv


def test_fake_server_without_tokenize():
    srv = fake_server("ok")
    js = os.path.join(TMP, "fake.json")
    try:
        r = bench("--prompt-tokens", "3000", "--max-tokens", "5", "--runs", "2", "--json", js,
                  port=srv.server_address[1])
    finally:
        srv.shutdown()
    assert r.returncode == 0, r.stderr
    assert "no usable /tokenize" in r.stderr and "model fake-model" in r.stderr, r.stderr
    rows = parse_table(r.stdout)
    for x in rows:
        assert abs(num(x[7]) - 3000) <= 60, x  # sized from the warm-ups' usage
        assert num(x[8]) == 5, x
    # the fake server's first token comes within ~2 ms: the JSON's seconds
    # keep 7 significant digits, so the rates still follow from them
    with open(js) as f:
        for jr in json.load(f)["rows"]:
            assert 0 < jr["ttft_s"] < 0.1, jr
            assert close(jr["pp_tok_s"], jr["p_tok"] / jr["ttft_s"], rel=1e-5, abs_=0), jr
            assert close(jr["e2e_tok_s"], jr["c_tok"] / jr["total_s"], rel=1e-5, abs_=0), jr


def test_load_mode_seed_fixes_lengths():
    srv = fake_server("ok")
    lens = []
    try:
        for seed in ("42", "42", "7"):
            js = os.path.join(TMP, "seed.json")
            r = bench("--prompt-tokens", "400", "--max-tokens", "3", "--concurrency", "4", "--num-prompts", "8",
                      "--seed", seed, "--json", js, port=srv.server_address[1])
            assert r.returncode == 0, r.stderr
            with open(js) as f:
                lens.append([row["p_tok"] for row in json.load(f)["rows"]])
    finally:
        srv.shutdown()
    assert lens[0] == lens[1] and lens[0] != lens[2], lens
    assert all(200 - 20 <= x <= 600 + 20 for x in lens[0] + lens[2]), lens


def test_fake_server_500():
    srv = fake_server("500")
    try:
        r = bench("--model", "m", port=srv.server_address[1])
    finally:
        srv.shutdown()
    assert r.returncode == 1, r
    assert "HTTP 500" in r.stderr and "fake backend exploded" in r.stderr, r.stderr
    assert r.stdout == "", r.stdout


def test_fake_server_stream_ends_early():
    srv = fake_server("early")
    try:
        r = bench("--model", "m", "--max-tokens", "6", port=srv.server_address[1])
    finally:
        srv.shutdown()
    assert r.returncode == 1, r
    assert "ended early" in r.stderr and "[DONE]" in r.stderr, r.stderr


def test_unreachable_server():
    r = bench("--model", "m", port=free_port(), timeout=60)
    assert r.returncode == 1, r
    assert "cannot connect" in r.stderr and "Connection refused" in r.stderr, r.stderr


def main():
    if lib.missing_prereqs("test_bench"):
        return 1
    log = lib.log_file("test_bench.log")
    proc = lib.start_server(["--port", str(PORT), "--served-model-name", NAME, "--api-key", KEY,
                             "--max-model-len", "2048", "--enable-prompt-tokens-details", "--kv-cache-memory", "256M",
                             # one thread: no barrier stalls when other jobs share the cores
                             "--threads", "1"],
                            stdout=log)
    try:
        lib.wait_healthy(PORT, proc)
        tests = [test_bad_flags, test_plot_needs_gnuplot, test_unreachable_server, test_fake_server_500,
                 test_fake_server_stream_ends_early, test_fake_server_without_tokenize, test_load_mode_seed_fixes_lengths,
                 test_table_real_server,
                 test_load_mode, test_too_long_for_server]
        passed, failed = lib.run_tests(tests, proc=proc)
    finally:
        lib.stop_server(proc)
        log.close()
        shutil.rmtree(TMP, ignore_errors=True)
    if TABLE.get("stdout"):
        print(TABLE["stdout"], end="")
    return lib.summary(passed, failed)


if __name__ == "__main__":
    sys.exit(main())

#!/usr/bin/env python3
"""The HTTP layer's limits (issue 46), against the real `sluice serve` with the
default model and raw sockets: header and per-route body caps checked before
the body is read, the API key before a body is buffered, conflicting
Content-Lengths, HEAD, idle / slow / half-sent connections closed by the
timeouts, half-closed clients answered, aborted streams neither leaked nor
counted as successes, and a server at its fd limit that keeps answering
/health without spinning.

    python3 tests/test_http_limits.py                # what `make test` runs
    python3 tests/test_http_limits.py --aborts 3000  # the long leak check; with
        SLUICE_BIN=<an -fsanitize=address build>, LeakSanitizer reports at exit

Prints one line per test and ends with "N passed, N failed".
"""
import argparse
import http.client
import json
import os
import resource
import socket
import struct
import sys
import threading
import time

sys.path.insert(0, os.path.dirname(__file__))
import sluice_testlib as lib  # noqa: E402

KEY = "sk-limits"
NAME = "smol"
PORT = lib.free_port()
PROC = None
ABORTS = 60
KEEP_ALIVE, HEADER_TIMEOUT = 1.0, 2.0


def raw(data, port=None, read_timeout=10, shut=False):
    """Sends data on a new connection and returns everything read until the
    server closes (or read_timeout)."""
    s = socket.create_connection(("127.0.0.1", port or PORT))
    s.settimeout(read_timeout)
    try:
        s.sendall(data)
        if shut:
            s.shutdown(socket.SHUT_WR)
        out = b""
        while True:
            try:
                d = s.recv(65536)
            except (ConnectionResetError, socket.timeout):
                break
            if not d:
                break
            out += d
        return out
    finally:
        s.close()


def status_of(resp):
    """The final status of a raw response (interim 1xx skipped)."""
    while resp.startswith(b"HTTP/1.1 1"):
        resp = resp[resp.index(b"\r\n\r\n") + 4:]
    return int(resp.split(b" ", 2)[1]) if resp.startswith(b"HTTP/") else None


def head(method, path, extra=b"", key=KEY, length=None):
    h = b"%s %s HTTP/1.1\r\nHost: x\r\n" % (method.encode(), path.encode())
    if key:
        h += b"Authorization: Bearer " + key.encode() + b"\r\n"
    if length is not None:
        h += b"Content-Type: application/json\r\nContent-Length: %d\r\n" % length
    return h + extra + b"\r\n"


def rss_kb(pid):
    with open(f"/proc/{pid}/status") as f:
        for line in f:
            if line.startswith("VmRSS:"):
                return int(line.split()[1])
    return 0


def cpu_s(pid):
    with open(f"/proc/{pid}/stat") as f:
        fields = f.read().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def metrics(port=None):
    c = http.client.HTTPConnection("127.0.0.1", port or PORT, timeout=30)
    c.request("GET", "/metrics")
    text = c.getresponse().read().decode()
    c.close()
    return lib.parse_metrics(text)


def chat_body(stream, max_tokens=4):
    return json.dumps({"model": NAME, "messages": [{"role": "user", "content": "Say hi."}],
                       "max_tokens": max_tokens, "temperature": 0, "stream": stream}).encode()


# ---- heads and bodies ----

def test_big_header_431():
    """A 1 MB header gets 431 (libevent's own answer would be 413), read while
    the client is still sending it, and the server keeps serving."""
    r = raw(head("GET", "/health", b"X-Big: " + b"a" * (1 << 20) + b"\r\n"))
    assert status_of(r) == 431, r[:200]
    assert b"--max-header-bytes" in r
    r = raw(head("GET", "/health", b"".join(b"X-H%d: v\r\n" % i for i in range(300))))
    assert status_of(r) == 431, r[:200]
    assert lib.health(PORT) == 200


def test_body_refused_before_read():
    """190 MB POSTs to /health, and to chat without the API key, are refused
    from their heads: the server answers before a body byte and its memory
    does not grow. An upload to /v1/files keeps its large cap."""
    before = rss_kb(PROC.pid)
    for path, key, want in (("/health", KEY, 413), ("/v1/chat/completions", "wrong", 401),
                            ("/v1/chat/completions", KEY, 413), ("/v1/files", None, 401)):
        for _ in range(3):
            s = socket.create_connection(("127.0.0.1", PORT))
            s.settimeout(10)
            s.sendall(head("POST", path, key=key, length=190_000_000) + b"{" * 65536)
            r = s.recv(65536)
            s.close()
            assert status_of(r) == want, (path, r[:300])
    grown = rss_kb(PROC.pid) - before
    assert grown < 20_000, f"RSS grew {grown} kB"
    print(f"     12 refused 190 MB POSTs: RSS {grown:+d} kB", flush=True)
    # the upload route takes a large body: no early answer to its head
    s = socket.create_connection(("127.0.0.1", PORT))
    s.settimeout(1.0)
    s.sendall(head("POST", "/v1/files", length=150_000_000))
    try:
        early = s.recv(100)
    except socket.timeout:
        early = None
    s.close()
    assert early is None, early
    # and an upload over a megabyte goes through (after its 100 Continue)
    line = json.dumps({"custom_id": "r", "method": "POST", "url": "/v1/chat/completions",
                       "body": {"model": NAME, "messages": [{"role": "user", "content": "x" * 400}]}})
    data = "\n".join(line.replace('"r"', f'"r{i}"') for i in range(3000)).encode() + b"\n"
    b = b"sluiceboundary"
    form = (b"--" + b + b'\r\nContent-Disposition: form-data; name="purpose"\r\n\r\nbatch\r\n--' + b +
            b'\r\nContent-Disposition: form-data; name="file"; filename="b.jsonl"\r\n'
            b"Content-Type: application/octet-stream\r\n\r\n" + data + b"\r\n--" + b + b"--\r\n")
    s = socket.create_connection(("127.0.0.1", PORT))
    s.settimeout(60)
    s.sendall(b"POST /v1/files HTTP/1.1\r\nHost: x\r\nAuthorization: Bearer " + KEY.encode() +
              b"\r\nContent-Type: multipart/form-data; boundary=" + b + b"\r\nContent-Length: %d\r\n"
              b"Expect: 100-continue\r\n\r\n" % len(form))
    assert s.recv(100).startswith(b"HTTP/1.1 100"), "no 100 Continue"
    s.sendall(form)
    r = b""
    while b'"status"' not in r:
        d = s.recv(65536)
        if not d:
            break
        r += d
    s.close()
    assert status_of(r) == 200 and b'"bytes":%d' % len(data) in r.replace(b" ", b""), (len(data), r[:400])
    # chunked: refused as it grows past the route's cap
    chunk = b"%x\r\n%s\r\n" % (40000, b"x" * 40000)
    r = raw(head("POST", "/health", b"Transfer-Encoding: chunked\r\n") + chunk * 3)
    assert status_of(r) == 413, r[:200]


def test_conflicting_content_length():
    body = chat_body(False, 1)
    r = raw(head("POST", "/v1/chat/completions", b"Content-Length: %d\r\n" % (len(body) + 1), length=len(body)) + body)
    assert status_of(r) == 400 and b"conflicting Content-Length" in r, r[:300]
    # the same length twice is no conflict
    r = raw(head("POST", "/tokenize", b"Content-Length: 17\r\n", length=17) + b'{"prompt": "hi!"}')
    assert status_of(r) == 200, r[:300]


def test_head_where_get():
    c = http.client.HTTPConnection("127.0.0.1", PORT, timeout=10)
    for path in ("/health", "/v1/models", "/version", "/metrics", "/v1/files", "/v1/batches"):
        c.request("HEAD", path, headers={"Authorization": "Bearer " + KEY})
        r = c.getresponse()
        assert r.status == 200 and r.read() == b"", (path, r.status)
    c.request("GET", "/v1/models", headers={"Authorization": "Bearer " + KEY})  # the connection is still in step
    r = c.getresponse()
    assert r.status == 200 and json.loads(r.read())["data"][0]["id"] == NAME
    c.request("HEAD", "/v1/chat/completions")
    r = c.getresponse()
    assert r.status == 405 and r.getheader("Allow") == "POST"
    c.close()


# ---- timeouts ----

def test_idle_connections_closed():
    """600 connections (silent, half-sent, idle after a request) are all
    closed by the timeouts; a request running longer than the keep-alive
    timeout is not."""
    socks = []
    for i in range(600):
        s = socket.create_connection(("127.0.0.1", PORT))
        if i % 3 == 1:
            s.sendall(b"GET /health HTTP/1.1\r\nHost: x\r\n")
        elif i % 3 == 2:
            s.sendall(b"GET /health HTTP/1.1\r\nHost: x\r\n\r\n")
        socks.append(s)
    t0 = time.time()
    slow = {}

    def long_request():
        c = http.client.HTTPConnection("127.0.0.1", PORT, timeout=120)
        c.request("POST", "/v1/chat/completions", body=chat_body(False, 40),
                  headers={"Authorization": "Bearer " + KEY, "Content-Type": "application/json"})
        r = c.getresponse()
        slow["status"], slow["t"] = r.status, time.time() - t0
        r.read()
    th = threading.Thread(target=long_request)
    th.start()
    closed = 0
    for s in socks:
        s.settimeout(max(0.1, KEEP_ALIVE + HEADER_TIMEOUT + 3 - (time.time() - t0)))
        try:
            data = b""
            while True:
                d = s.recv(4096)
                if not d:
                    closed += 1
                    break
                data += d
        except (socket.timeout, ConnectionResetError):
            pass
        s.close()
    took = time.time() - t0
    th.join()
    assert closed == 600, f"{closed} of 600 closed in {took:.1f}s"
    assert slow["status"] == 200, slow
    print(f"     600 idle connections closed in {took:.1f}s; a {slow['t']:.1f}s request ran through", flush=True)


def test_slowloris():
    """A head trickled a line at a time is cut at --timeout-header."""
    s = socket.create_connection(("127.0.0.1", PORT))
    t0 = time.time()
    try:
        s.sendall(b"GET /health HTTP/1.1\r\n")
        for _ in range(40):
            time.sleep(0.25)
            s.sendall(b"X-Slow: 1\r\n")
    except OSError:
        pass
    s.close()
    took = time.time() - t0
    assert took < HEADER_TIMEOUT + 2, took


# ---- clients that leave ----

def test_half_close_gets_reply():
    """A client that shuts its sending side after the request still gets the
    reply, streamed or not."""
    for stream in (False, True):
        body = chat_body(stream)
        r = raw(head("POST", "/v1/chat/completions", length=len(body)) + body, read_timeout=60, shut=True)
        assert status_of(r) == 200, r[:300]
        assert (b"data: [DONE]" in r) if stream else (b'"finish_reason"' in r), r[-300:]


def abort_streams(n, port=None):
    """n streamed requests whose clients hang up once the reply starts, in
    turn with a FIN (the server's probe finds the socket closed) and with a
    reset (a write fails: evhttp drops the connection and hands the request
    back, the leak of issue 46)."""
    body = chat_body(True, 16)
    req = head("POST", "/v1/chat/completions", length=len(body)) + body
    for i in range(n):
        s = socket.create_connection(("127.0.0.1", port or PORT))
        s.settimeout(60)
        s.sendall(req)
        got = s.recv(4096)
        assert got.startswith(b"HTTP/1.1 200"), (i, got[:100])
        if i % 2:
            s.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
        s.close()


def settle(m0, n, port=None, timeout=120):
    """Metrics once n requests finished after m0 (as successes or failures)
    and nothing runs."""
    deadline = time.time() + timeout
    while time.time() < deadline:
        m = metrics(port)
        done = sum(m[k] - m0[k] for k in ("sluice:request_success_total", "sluice:request_failure_total"))
        if done >= n and m["sluice:num_requests_running"] == 0 and m["sluice:num_requests_waiting"] == 0:
            return m
        time.sleep(0.2)
    raise AssertionError(f"{n} requests not finished {timeout} s after their clients left")


def test_aborted_streams():
    """Aborted streams free what they held (RSS flat after a warm-up; under
    an ASan build LeakSanitizer checks at exit) and count as failures, not
    successes."""
    m = metrics()
    abort_streams(10)
    m0 = settle(m, 10)
    rss0 = rss_kb(PROC.pid)
    t0 = time.time()
    abort_streams(ABORTS)
    m1 = settle(m0, ABORTS)
    grown = rss_kb(PROC.pid) - rss0
    ok = m1["sluice:request_success_total"] - m0["sluice:request_success_total"]
    bad = m1["sluice:request_failure_total"] - m0["sluice:request_failure_total"]
    assert ok == 0 and bad == ABORTS, (ok, bad)
    assert m1["sluice:kv_blocks_used"] == 0, m1
    # the leak this guards against: ~2.1 kB an aborted stream
    assert grown < max(512, ABORTS * 2.1 * 0.4), f"RSS grew {grown} kB over {ABORTS} aborted streams"
    print(f"     {ABORTS} aborted streams in {time.time() - t0:.1f}s: RSS {grown:+d} kB", flush=True)


# ---- the fd limit ----

def test_fd_limit():
    """Under a 128-file limit, 300 connections held open: the server neither
    spins on accept() nor floods its log, and /health keeps answering (the
    oldest idle connection makes room). Then with a cap above the fd limit,
    where accept() itself fails."""
    for cap_args in ([], ["--max-connections", "1000"]):
        port = lib.free_port()
        log = lib.log_file("test_http_limits_fd.log")
        proc = lib.start_server(["--port", str(port), "--served-model-name", NAME, "--max-model-len", "256",
                                 "--max-num-seqs", "4", "--kv-cache-memory", "64M", "--threads", "1", "--timeout-keep-alive", "600",
                                 "--timeout-header", "600", "--data-dir", os.path.join(lib.ROOT, "build",
                                                                                       "test_http_limits_fd.d")]
                                + cap_args, stdout=log,
                                preexec_fn=lambda: resource.setrlimit(resource.RLIMIT_NOFILE, (128, 128)))
        socks = []
        try:
            assert lib.wait_healthy(port, proc), "the server did not start"
            for _ in range(300):
                try:
                    socks.append(socket.create_connection(("127.0.0.1", port), timeout=2))
                except OSError:
                    break
            time.sleep(0.5)
            cpu0, t0 = cpu_s(proc.pid), time.time()
            answered = 0
            for _ in range(5):
                try:
                    answered += lib.health(port, timeout=5) == 200
                except OSError:
                    pass
                time.sleep(0.4)
            busy = (cpu_s(proc.pid) - cpu0) / (time.time() - t0)
            log.flush()
            with open(os.path.join(lib.ROOT, "build", "test_http_limits_fd.log"), errors="replace") as f:
                lines = f.read().count("\n")
            assert answered == 5, f"/health answered {answered} of 5 ({cap_args})"
            assert busy < 0.5, f"the server used {busy:.0%} of a core while idle at its fd limit ({cap_args})"
            assert lines < 40, f"{lines} log lines ({cap_args})"
            print(f"     {len(socks)} connections held, fd limit 128 {' '.join(cap_args)}: /health 5 of 5, "
                  f"{busy:.0%} CPU, {lines} log lines", flush=True)
        finally:
            for s in socks:
                s.close()
            lib.stop_server(proc)
            log.close()


def main():
    global PROC, ABORTS
    ap = argparse.ArgumentParser()
    ap.add_argument("--aborts", type=int, default=ABORTS, help="aborted streams in test_aborted_streams")
    ap.add_argument("only", nargs="*", help="test names to run (all when none)")
    a = ap.parse_args()
    ABORTS = a.aborts
    if lib.missing_prereqs("test_http_limits"):
        return 1
    log = lib.log_file("test_http_limits.log")
    PROC = lib.start_server(["--port", str(PORT), "--served-model-name", NAME, "--api-key", KEY,
                             "--max-model-len", "256", "--max-num-seqs", "8", "--kv-cache-memory", "64M", "--threads", "1",
                             "--timeout-keep-alive", str(KEEP_ALIVE), "--timeout-header", str(HEADER_TIMEOUT),
                             "--data-dir", os.path.join(lib.ROOT, "build", "test_http_limits.d")], stdout=log)
    try:
        lib.wait_healthy(PORT, PROC)
        tests = [test_big_header_431, test_body_refused_before_read, test_conflicting_content_length,
                 test_head_where_get, test_idle_connections_closed, test_slowloris, test_half_close_gets_reply,
                 test_aborted_streams, test_fd_limit]
        passed, failed = lib.run_tests(tests, proc=PROC, only=a.only)
    finally:
        lib.stop_server(PROC)
        log.close()
    return lib.summary(passed, failed)


if __name__ == "__main__":
    sys.exit(main())

#!/usr/bin/env python3
"""The scheduler's rules for chats, through the real `sluice serve` with the
default model on the CPU and a small step budget (64 tokens), so a long
prompt's prefill takes many steps:
  - a chat that arrives while a long chat prompt is in prefill gets its
    first token before the long prompt does (room for waiting prompts,
    fewest tokens left first);
  - --long-prefill-token-threshold N (vLLM's flag): a prompt moves by at
    most N tokens a step, so it takes at least len / N steps;
  - --max-num-partial-prefills / --max-long-partial-prefills (vLLM's): a
    second long prompt waits for the first, and a short chat passes it.

Prints one line per test and ends with "N passed, N failed".
"""
import http.client
import json
import os
import subprocess
import sys
import threading
import time

sys.path.insert(0, os.path.dirname(__file__))
import sluice_testlib as lib  # noqa: E402

BUDGET = 64


class Server:
    def __init__(self, extra, log_name):
        self.port = lib.free_port()
        self.log = lib.log_file(log_name)
        self.proc = lib.start_server(["--port", str(self.port), "--served-model-name", "m", "--device", "cpu",
                                      "--max-model-len", "2048", "--max-num-batched-tokens", str(BUDGET),
                                      "--max-num-seqs", "8", "--kv-cache-memory", "256M"] + extra, stdout=self.log)
        if not lib.wait_healthy(self.port, self.proc):
            raise RuntimeError(f"the server did not start: see build/{log_name}")

    def post(self, path, body):
        c = http.client.HTTPConnection("127.0.0.1", self.port, timeout=300)
        c.request("POST", path, json.dumps(body), {"Content-Type": "application/json"})
        r = c.getresponse()
        return r.status, r.read()

    def metric(self, name):
        c = http.client.HTTPConnection("127.0.0.1", self.port, timeout=30)
        c.request("GET", "/metrics")
        for line in c.getresponse().read().decode().splitlines():
            if line.startswith("sluice:" + name + " "):
                return float(line.split()[1])
        raise KeyError(name)

    def prompt_tokens(self, text):
        st, out = self.post("/tokenize", {"model": "m", "messages": [{"role": "user", "content": text}]})
        assert st == 200, out
        return json.loads(out)["count"]

    def stop(self):
        lib.stop_server(self.proc)
        self.log.close()


def long_text(n_words, tag):
    return f"Document {tag}. " + " ".join(f"line {i} of the report says nothing new" for i in range(n_words // 8))


def first_token_time(srv, text, max_tokens, out, key):
    """Streams a chat; out[key] = (time of the first chunk with text, number of such chunks)."""
    body = {"model": "m", "messages": [{"role": "user", "content": text}], "max_tokens": max_tokens,
            "temperature": 0, "ignore_eos": True, "stream": True}
    c = http.client.HTTPConnection("127.0.0.1", srv.port, timeout=300)
    c.request("POST", "/v1/chat/completions", json.dumps(body), {"Content-Type": "application/json"})
    r = c.getresponse()
    first, n = None, 0
    for line in r:
        if not line.startswith(b"data: {"):
            continue
        ch = json.loads(line[6:]).get("choices") or [{}]
        if (ch[0].get("delta") or {}).get("content"):
            n += 1
            if first is None:
                first = time.monotonic()
    out[key] = (first, n, r.status)


def test_chat_beside_long_prompt(srv):
    text = long_text(1400, "long")
    n_long = srv.prompt_tokens(text)
    assert n_long > 20 * BUDGET, n_long  # many steps of prefill
    res = {}
    p0 = srv.metric("prefill_tokens_computed_total")
    t = threading.Thread(target=first_token_time, args=(srv, text, 2, res, "long"))
    t.start()
    # the chat arrives once the long prompt is in prefill, well before its end
    deadline = time.monotonic() + 120
    while srv.metric("prefill_tokens_computed_total") - p0 < 2 * BUDGET and time.monotonic() < deadline:
        time.sleep(0.02)
    done = srv.metric("prefill_tokens_computed_total") - p0
    assert 0 < done < n_long - 8 * BUDGET, (done, n_long)
    first_token_time(srv, "Say hello.", 4, res, "chat")
    t.join()
    (t_long, n1, s1), (t_chat, n2, s2) = res["long"], res["chat"]
    assert s1 == 200 and s2 == 200 and n1 >= 1 and n2 >= 1, res
    assert t_chat < t_long, f"the chat's first token came {t_chat - t_long:.2f} s after the long prompt's"


def test_long_prefill_threshold(srv_thr):
    text = long_text(200, "thr")
    n = srv_thr.prompt_tokens(text)
    s0 = srv_thr.metric("engine_steps_total")
    st, out = srv_thr.post("/v1/chat/completions", {"model": "m", "messages": [{"role": "user", "content": text}],
                                                    "max_tokens": 1, "temperature": 0})
    assert st == 200, out
    steps = srv_thr.metric("engine_steps_total") - s0
    assert steps >= (n + 15) // 16, (steps, n)  # 16 tokens a step at most, not the budget's 64


def test_partial_prefills(srv_pp):
    """--max-num-partial-prefills 2 --max-long-partial-prefills 1 (threshold
    48): a second long chat waits while the first one's prompt runs, and a
    short chat behind it starts and finishes first"""
    srv = srv_pp
    text_a, text_b = long_text(1400, "a"), long_text(400, "b")
    n_a = srv.prompt_tokens(text_a)
    assert n_a > 20 * 48, n_a
    res = {}
    p0 = srv.metric("prefill_tokens_computed_total")
    ta = threading.Thread(target=first_token_time, args=(srv, text_a, 2, res, "a"))
    ta.start()
    deadline = time.monotonic() + 120
    while srv.metric("prefill_tokens_computed_total") - p0 < 2 * 48 and time.monotonic() < deadline:
        time.sleep(0.02)
    tb = threading.Thread(target=first_token_time, args=(srv, text_b, 2, res, "b"))
    tb.start()
    while srv.metric("num_requests_waiting") < 1 and time.monotonic() < deadline:
        time.sleep(0.01)
    s0 = srv.metric("engine_steps_total")
    while srv.metric("engine_steps_total") < s0 + 3 and time.monotonic() < deadline:
        time.sleep(0.01)
    waiting, running = srv.metric("num_requests_waiting"), srv.metric("num_requests_running")
    done = srv.metric("prefill_tokens_computed_total") - p0
    assert done < n_a - 8 * 48, (done, n_a)  # a's prompt is still running
    assert waiting == 1 and running == 1, (waiting, running)  # b waits: one long prompt at a time
    first_token_time(srv, "Say hello.", 2, res, "c")
    waiting = srv.metric("num_requests_waiting")
    ta.join()
    tb.join()
    assert waiting == 1, waiting  # c started and finished while b still waited
    (t_a, _, s_a), (t_b, _, s_b), (t_c, _, s_c) = res["a"], res["b"], res["c"]
    assert s_a == s_b == s_c == 200, res
    assert t_c < t_a < t_b, res


def main():
    if lib.missing_prereqs("test_chat_rules"):
        return 1
    passed = failed = 0
    for extra, log_name, tests in [([], "test_chat_rules.log", [test_chat_beside_long_prompt]),
                                   (["--long-prefill-token-threshold", "16"], "test_chat_rules_thr.log",
                                    [test_long_prefill_threshold]),
                                   (["--long-prefill-token-threshold", "48", "--max-num-partial-prefills", "2",
                                     "--max-long-partial-prefills", "1"], "test_chat_rules_pp.log",
                                    [test_partial_prefills])]:
        try:
            srv = Server(extra, log_name)
        except RuntimeError as e:
            print(f"FAIL {', '.join(t.__name__ for t in tests)}: {e}", flush=True)
            failed += len(tests)
            continue
        try:
            p, f = lib.run_tests(tests, srv, proc=srv.proc)
        finally:
            srv.stop()
        passed, failed = passed + p, failed + f
    return lib.summary(passed, failed)


if __name__ == "__main__":
    sys.exit(main())

#!/usr/bin/env python3
"""Integration tests: the real `sluice serve` with the default model, driven
with raw HTTP (like curl) and with the official `openai` Python client.

Prints one line per test and ends with "N passed, N failed" (tools/run_tests.sh).
"""
import http.client
import json
import os
import socket
import subprocess
import sys
import threading
import time

sys.path.insert(0, os.path.dirname(__file__))
import sluice_testlib as lib  # noqa: E402

KEY = "sk-test-key"
NAME = "smol"
MAX_LEN = 512
MAX_BODY = 65536

PORT = lib.free_port()
BACKEND = None  # the server's, from its ready line (main)


def request(method, path, body=None, key=KEY, raw=None, timeout=120):
    c = http.client.HTTPConnection("127.0.0.1", PORT, timeout=timeout)
    headers = {"Content-Type": "application/json"}
    if key:
        headers["Authorization"] = "Bearer " + key
    data = raw if raw is not None else (json.dumps(body) if body is not None else None)
    c.request(method, path, body=data, headers=headers)
    r = c.getresponse()
    text = r.read().decode()
    c.close()
    return r.status, text


def metrics():
    _, text = request("GET", "/metrics")
    return lib.parse_metrics(text)


CHAT = {"model": NAME, "messages": [{"role": "user", "content": "What is the capital of France?"}],
        "max_tokens": 12, "temperature": 0}


def ok_request():
    st, text = request("POST", "/v1/chat/completions", CHAT)
    assert st == 200, (st, text)
    return json.loads(text)


def test_health_and_models():
    st, _ = request("GET", "/health", key=None)
    assert st == 200
    from openai import OpenAI
    client = OpenAI(base_url=f"http://127.0.0.1:{PORT}/v1", api_key=KEY)
    models = client.models.list()
    assert [m.id for m in models.data] == [NAME]
    m = client.models.retrieve(NAME)
    assert m.id == NAME and m.object == "model", m
    import openai
    try:
        client.models.retrieve("no-such-model")
        raise AssertionError("retrieved a model that is not served")
    except openai.NotFoundError as e:
        assert e.body["param"] == "model", e.body
    st, text = request("GET", "/version", key=None)
    assert st == 200 and json.loads(text)["version"], text
    assert request("GET", f"/v1/models/{NAME}", key=None)[0] == 401  # the API key guards it like /v1/models


def test_chat_nonstream_and_stream_agree():
    from openai import OpenAI
    client = OpenAI(base_url=f"http://127.0.0.1:{PORT}/v1", api_key=KEY)
    r = client.chat.completions.create(**CHAT)
    text = r.choices[0].message.content
    assert r.object == "chat.completion" and text and r.choices[0].finish_reason in ("stop", "length")
    assert r.usage.prompt_tokens > 0 and r.usage.completion_tokens > 0
    assert r.usage.total_tokens == r.usage.prompt_tokens + r.usage.completion_tokens
    assert "Paris" in text, text
    parts, usage, finish = [], None, None
    for chunk in client.chat.completions.create(**CHAT, stream=True, stream_options={"include_usage": True}):
        if chunk.usage:
            usage = chunk.usage
        for ch in chunk.choices:
            if ch.delta.content:
                parts.append(ch.delta.content)
            if ch.finish_reason:
                finish = ch.finish_reason
    assert "".join(parts) == text, ("".join(parts), text)
    assert finish == r.choices[0].finish_reason
    assert usage and usage.completion_tokens == r.usage.completion_tokens


def test_completions():
    from openai import OpenAI
    client = OpenAI(base_url=f"http://127.0.0.1:{PORT}/v1", api_key=KEY)
    r = client.completions.create(model=NAME, prompt="The capital of France is", max_tokens=4, temperature=0,
                                  logprobs=2)
    assert r.choices[0].text.startswith(" Paris"), r.choices[0].text
    assert r.choices[0].finish_reason == "length" and r.usage.completion_tokens == 4
    assert len(r.choices[0].logprobs.tokens) == 4 and len(r.choices[0].logprobs.top_logprobs[0]) == 2
    # sampled, not greedy: each step's top_logprobs holds the sampled token (first) besides the top 1
    rs = client.completions.create(model=NAME, prompt="Once upon a time", max_tokens=16, temperature=1.5, seed=3,
                                   logprobs=1)
    lp = rs.choices[0].logprobs
    off_top = 0
    for tok, val, top in zip(lp.tokens, lp.token_logprobs, lp.top_logprobs):
        assert list(top)[0] == tok and abs(top[tok] - val) < 1e-4 and 1 <= len(top) <= 2, (tok, val, top)
        off_top += len(top) == 2
    assert off_top > 0, lp  # this seed samples below the top token at least once
    streamed = "".join(c.choices[0].text for c in client.completions.create(
        model=NAME, prompt="The capital of France is", max_tokens=4, temperature=0, stream=True) if c.choices)
    assert streamed == r.choices[0].text


def test_curl():
    """The README's curl lines work as written (with the test server's key)."""
    def curl(*args):
        r = subprocess.run(["curl", "-sS", "-w", "\n%{http_code}", "-H", "Authorization: Bearer " + KEY] + list(args),
                           capture_output=True, text=True, timeout=120)
        body, code = r.stdout.rsplit("\n", 1)
        return int(code), body
    code, body = curl(f"http://127.0.0.1:{PORT}/v1/chat/completions", "-H", "Content-Type: application/json",
                      "-d", json.dumps(CHAT))
    assert code == 200 and "Paris" in json.loads(body)["choices"][0]["message"]["content"], body
    code, body = curl("-N", f"http://127.0.0.1:{PORT}/v1/chat/completions", "-H", "Content-Type: application/json",
                      "-d", json.dumps(dict(CHAT, stream=True)))
    assert code == 200 and body.rstrip().endswith("data: [DONE]"), body
    code, body = curl(f"http://127.0.0.1:{PORT}/v1/chat/completions", "-d", "{oops")
    assert code == 400 and json.loads(body)["error"]["code"] == 400, body
    code, body = curl(f"http://127.0.0.1:{PORT}/metrics")
    assert code == 200 and "sluice:num_requests_running" in body


# seeded requests that a GPU run may judge by lib.sampled_agree: top_k within
# the top logprobs they return
SEEDED = dict(top_k=lib.TOP_LOGPROBS, logprobs=True, top_logprobs=lib.TOP_LOGPROBS)


def test_seed_reproducible():
    """The same seeded request twice gives the same text (the second run's
    prompt comes from the prefix cache)."""
    body = dict(CHAT, temperature=1.0, seed=1234, max_tokens=16, **SEEDED)
    a, b = (json.loads(request("POST", "/v1/chat/completions", body)[1])["choices"][0] for _ in range(2))
    lib.expect_sampled_agree(a["message"]["content"], a["logprobs"], b["message"]["content"], b["logprobs"],
                             BACKEND, body["seed"], body["temperature"], lib.TOP_LOGPROBS)


def test_seeded_draws_follow_the_sampler():
    """Each token of a seeded top-k request is the one model_sample's draw
    picks from that step's top-k logprobs (lib.seeded_draws: the request's
    RNG, and choice 1's derived seed), up to the 6 digits logprobs carry."""
    T, k, seed = 0.8, lib.TOP_LOGPROBS, 4321
    body = dict(CHAT, temperature=T, seed=seed, max_tokens=16, n=2, **SEEDED)
    r = json.loads(request("POST", "/v1/chat/completions", body)[1])
    for ch in r["choices"]:
        draws = lib.seeded_draws(seed, ch["index"])
        for j, (tok, top) in enumerate(lib.token_logprobs(ch["logprobs"])):
            assert len(top) == k, top
            u = next(draws)
            pick, near = lib.draw_pick(u, top, T, lib.DRAW_SLACK)
            assert pick == tok or near, (ch["index"], j, tok, pick, u, top)


def test_prefix_cache_reported():
    doc = " ".join(f"word{i}" for i in range(120))
    body = {"model": NAME, "messages": [{"role": "user", "content": doc}], "max_tokens": 2, "temperature": 0}
    request("POST", "/v1/chat/completions", body)
    st, text = request("POST", "/v1/chat/completions", body)
    u = json.loads(text)["usage"]
    assert u["prompt_tokens_details"]["cached_tokens"] >= (u["prompt_tokens"] - 1) // 16 * 16 - 16, u


def test_tokenize_roundtrip():
    s = "Hello, sluice! Ünïcödé 東京 🚀"
    st, text = request("POST", "/tokenize", {"model": NAME, "prompt": s})
    assert st == 200, text
    toks = json.loads(text)
    assert toks["count"] == len(toks["tokens"]) > 0 and toks["max_model_len"] == MAX_LEN
    st, text = request("POST", "/detokenize", {"model": NAME, "tokens": toks["tokens"]})
    assert st == 200 and json.loads(text)["prompt"] == s


def expect_error(status, method, path, body=None, raw=None, key=KEY, param=None):
    st, text = request(method, path, body, key=key, raw=raw)
    assert st == status, (st, text)
    err = json.loads(text)["error"]
    assert err["message"] and err["type"] and "code" in err, err
    if param:
        assert err["param"] == param, err
    ok_request()  # the server keeps serving


def test_errors_then_success():
    expect_error(400, "POST", "/v1/chat/completions", raw="{not json")
    expect_error(400, "POST", "/v1/chat/completions", dict(CHAT, temperature="hot"), param="temperature")
    expect_error(400, "POST", "/v1/chat/completions", dict(CHAT, messages="hi"), param="messages")
    expect_error(400, "POST", "/v1/chat/completions", dict(CHAT, max_tokens=-3), param="max_tokens")
    expect_error(404, "POST", "/v1/chat/completions", dict(CHAT, model="no-such-model"), param="model")
    long_prompt = "hello " * (MAX_LEN + 50)
    expect_error(400, "POST", "/v1/completions", {"model": NAME, "prompt": long_prompt, "max_tokens": 4})
    expect_error(401, "POST", "/v1/chat/completions", CHAT, key=None)
    expect_error(401, "POST", "/v1/chat/completions", CHAT, key="sk-wrong")
    expect_error(413, "POST", "/v1/chat/completions", raw=json.dumps(dict(CHAT, pad="x" * (MAX_BODY + 10))))
    expect_error(404, "GET", "/v1/nothing-here")
    expect_error(405, "GET", "/v1/chat/completions")
    expect_error(400, "POST", "/v1/chat/completions", dict(CHAT, stream_options={"include_usage": True}),
                 param="stream_options")


def stream_chat(i, results):
    try:
        from openai import OpenAI
        client = OpenAI(base_url=f"http://127.0.0.1:{PORT}/v1", api_key=KEY, max_retries=0, timeout=300)
        body = {"model": NAME, "messages": [{"role": "user", "content": f"Count to {i % 7 + 2}."}],
                "max_tokens": 8, "temperature": 0, "logprobs": True, "top_logprobs": lib.TOP_LOGPROBS}
        text, lp = "", []
        for c in client.chat.completions.create(**body, stream=True):
            if c.choices:
                text += c.choices[0].delta.content or ""
                lp += (c.choices[0].logprobs.content or []) if c.choices[0].logprobs else []
        ref = json.loads(request("POST", "/v1/chat/completions", body)[1])["choices"][0]
        results[i] = (text, lp, ref["message"]["content"], ref["logprobs"])
    except Exception as e:  # recorded and asserted in the main thread
        results[i] = e


def test_concurrent_streams_batched():
    before = metrics()
    results = [None] * 32
    threads = [threading.Thread(target=stream_chat, args=(i, results)) for i in range(32)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    for r in results:
        assert isinstance(r, tuple), r
        # batched stream == the same request alone (greedy; on the GPU but for a near-tie)
        assert r[0], r
        lib.expect_greedy_agree(r[0], r[1], r[2], r[3], BACKEND)
    after = metrics()
    steps = after["sluice:engine_steps_total"] - before["sluice:engine_steps_total"]
    decode = after["sluice:decode_tokens_total"] - before["sluice:decode_tokens_total"]
    assert steps > 0 and decode / steps > 1.5, (decode, steps)  # several sequences per step


def test_disconnect_frees_blocks():
    socks = []
    body = json.dumps({"model": NAME, "messages": [{"role": "user", "content": "Tell me a long story."}],
                       "max_tokens": 400, "temperature": 0.8, "ignore_eos": True, "stream": True, "n": 2}).encode()
    for _ in range(4):  # 4 streams of 2 choices each
        s = socket.create_connection(("127.0.0.1", PORT))
        s.sendall(b"POST /v1/chat/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                  b"Authorization: Bearer " + KEY.encode() + b"\r\nContent-Length: " + str(len(body)).encode() +
                  b"\r\n\r\n" + body)
        socks.append(s)
    for s in socks:
        assert b"data:" in s.recv(4096)
    deadline = time.time() + 30
    while metrics()["sluice:num_requests_running"] < 1 and time.time() < deadline:
        time.sleep(0.1)
    assert metrics()["sluice:num_requests_running"] >= 1
    for s in socks:
        s.close()
    deadline = time.time() + 60
    while time.time() < deadline:
        m = metrics()
        if m["sluice:num_requests_running"] == 0 and m["sluice:kv_blocks_used"] == 0:
            break
        time.sleep(0.2)
    m = metrics()
    assert m["sluice:num_requests_running"] == 0 and m["sluice:kv_blocks_used"] == 0, m
    ok_request()


def test_disconnect_unstreamed():
    """A client that hangs up on an unstreamed request (nothing is written to
    it until the reply) stops the request at once, not at max_tokens."""
    body = json.dumps({"model": NAME, "messages": [{"role": "user", "content": "Tell me a long story."}],
                       "max_tokens": 400, "temperature": 0.8, "ignore_eos": True}).encode()
    s = socket.create_connection(("127.0.0.1", PORT))
    s.sendall(b"POST /v1/chat/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
              b"Authorization: Bearer " + KEY.encode() + b"\r\nContent-Length: " + str(len(body)).encode() +
              b"\r\n\r\n" + body)
    deadline = time.time() + 30
    while metrics()["sluice:num_requests_running"] < 1 and time.time() < deadline:
        time.sleep(0.05)
    before = metrics()
    assert before["sluice:num_requests_running"] == 1, before
    s.close()
    deadline = time.time() + 10
    while metrics()["sluice:num_requests_running"] > 0 and time.time() < deadline:
        time.sleep(0.05)
    m = metrics()
    assert m["sluice:num_requests_running"] == 0 and m["sluice:kv_blocks_used"] == 0, m
    # stopped early: far fewer than the 400 tokens it asked for
    made = m["sluice:decode_tokens_total"] - before["sluice:decode_tokens_total"]
    assert made < 300, made
    ok_request()


TOOLS = [{"type": "function", "function": {"name": "get_weather", "parameters": {
    "type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}}}]


def test_tools_without_parser():
    """No --tool-call-parser: tools with tool_choice "auto" (given or implied)
    are refused with vLLM's message; "none" and a named function still run."""
    for extra in ({}, {"tool_choice": "auto"}):
        st, text = request("POST", "/v1/chat/completions", dict(CHAT, tools=TOOLS, **extra))
        assert st == 400, (st, text)
        assert "--enable-auto-tool-choice" in json.loads(text)["error"]["message"], text
    st, text = request("POST", "/v1/chat/completions", dict(CHAT, tools=TOOLS, tool_choice="none"))
    assert st == 200, (st, text)
    named = {"type": "function", "function": {"name": "get_weather"}}
    st, text = request("POST", "/v1/chat/completions", dict(CHAT, tools=TOOLS, tool_choice=named, max_tokens=24))
    assert st == 200 and json.loads(text)["choices"][0]["message"]["tool_calls"], (st, text)


def test_tool_round_trip_null_content():
    """The OpenAI client sends an assistant turn of tool calls back with
    "content": null (or none at all): it renders as "", as in vLLM."""
    call = {"id": "call_1", "type": "function", "function": {"name": "get_weather", "arguments": "{\"city\": \"Paris\"}"}}
    for turn in ({"role": "assistant", "content": None, "tool_calls": [call]},
                 {"role": "assistant", "tool_calls": [call]}, {"role": "assistant", "content": None}):
        msgs = [{"role": "user", "content": "Weather in Paris?"}, turn,
                {"role": "tool", "tool_call_id": "call_1", "content": "sunny, 21 C"}]
        st, text = request("POST", "/v1/chat/completions", dict(CHAT, messages=msgs, max_tokens=4))
        assert st == 200, (turn, st, text)


def test_long_text_refused_before_tokenizing():
    """A text longer than max-model-len tokens could ever cover is refused
    without tokenizing it (one token is at most 81 bytes of SmolLM2's text);
    a shorter one that still does not fit is refused after, by its count."""
    for kind, body in (("chat", dict(CHAT, messages=[{"role": "user", "content": "x" * 50000}])),
                       ("completions", {"model": NAME, "prompt": "x" * 50000, "max_tokens": 4})):
        st, text = request("POST", "/v1/" + ("chat/completions" if kind == "chat" else "completions"), body)
        assert st == 400 and "at least" in json.loads(text)["error"]["message"], (kind, st, text)
    st, text = request("POST", "/v1/completions", {"model": NAME, "prompt": "x" * 30000, "max_tokens": 4})
    msg = json.loads(text)["error"]["message"]
    assert st == 400 and "at least" not in msg and "maximum context length" in msg, (st, text)
    ok_request()


def test_n_choices():
    """n > 1: n choices from one prompt (distinct seeded streams, reproducible;
    greedy ones identical), streamed with per-choice indexes, usage summed."""
    from openai import OpenAI
    client = OpenAI(base_url=f"http://127.0.0.1:{PORT}/v1", api_key=KEY)
    body = dict(CHAT, n=3, temperature=1.0, seed=77, max_tokens=12, logprobs=True, top_logprobs=lib.TOP_LOGPROBS,
                extra_body={"top_k": lib.TOP_LOGPROBS})

    def agree(got, want):  # seeded choices: lib.sampled_agree's (text, logprobs) pairs
        for i, ((gt, gl), (wt, wl)) in enumerate(zip(got, want)):
            lib.expect_sampled_agree(gt, gl, wt, wl, BACKEND, body["seed"], body["temperature"], lib.TOP_LOGPROBS,
                                     choice=i)
        assert len(got) == len(want), (got, want)
    r = client.chat.completions.create(**body)
    assert [c.index for c in r.choices] == [0, 1, 2], r
    texts = [c.message.content for c in r.choices]
    assert len(set(texts)) > 1, texts
    assert 3 <= r.usage.completion_tokens <= 36, r.usage  # summed over the choices
    assert r.usage.total_tokens == r.usage.prompt_tokens + r.usage.completion_tokens
    runs = [(c.message.content, c.logprobs) for c in r.choices]
    again = client.chat.completions.create(**body)
    agree([(c.message.content, c.logprobs) for c in again.choices], runs)
    # choice 0 is the request as if n were 1
    one = client.chat.completions.create(**dict(body, n=1))
    agree([(c.message.content, c.logprobs) for c in one.choices], runs[:1])
    greedy = client.chat.completions.create(**dict(CHAT, n=2, temperature=0))
    assert greedy.choices[0].message.content == greedy.choices[1].message.content
    parts, lps, finish, usage = {0: [], 1: []}, {0: [], 1: []}, {}, None
    for chunk in client.chat.completions.create(**dict(body, n=2), stream=True, stream_options={"include_usage": True}):
        if chunk.usage:
            usage = chunk.usage
        for ch in chunk.choices:
            if ch.delta.content:
                parts[ch.index].append(ch.delta.content)
            if ch.logprobs and ch.logprobs.content:
                lps[ch.index] += ch.logprobs.content
            if ch.finish_reason:
                finish[ch.index] = ch.finish_reason
    agree([("".join(parts[i]), lps[i]) for i in (0, 1)], runs[:2])
    assert set(finish) == {0, 1} and usage and usage.prompt_tokens == r.usage.prompt_tokens, (finish, usage)
    assert 2 <= usage.completion_tokens <= 24, usage
    c = client.completions.create(model=NAME, prompt="The capital of France is", max_tokens=3, n=2, temperature=0)
    assert [x.index for x in c.choices] == [0, 1] and c.choices[0].text == c.choices[1].text
    assert c.usage.completion_tokens == 6, c.usage
    for bad in (0, 65):
        expect_error(400, "POST", "/v1/chat/completions", dict(CHAT, n=bad), param="n")

def test_logit_bias():
    """logit_bias bans and forces tokens (greedy), through the openai client;
    bad maps are a 400 naming the parameter."""
    from openai import OpenAI
    client = OpenAI(base_url=f"http://127.0.0.1:{PORT}/v1", api_key=KEY)
    base = dict(model=NAME, prompt="The capital of France is", max_tokens=1, temperature=0)
    first = client.completions.create(**base).choices[0].text
    st, text = request("POST", "/tokenize", {"model": NAME, "prompt": first, "add_special_tokens": False})
    ids = json.loads(text)["tokens"]
    assert st == 200 and len(ids) == 1, (first, text)
    banned = client.completions.create(**base, logit_bias={str(ids[0]): -100}).choices[0].text
    assert banned != first, (banned, first)
    st, text = request("POST", "/tokenize", {"model": NAME, "prompt": " Rome", "add_special_tokens": False})
    rome = json.loads(text)["tokens"]
    forced = client.completions.create(**dict(base, max_tokens=1), logit_bias={str(rome[0]): 100}).choices[0].text
    st, text = request("POST", "/detokenize", {"model": NAME, "tokens": rome[:1]})
    assert forced == json.loads(text)["prompt"], (forced, text)
    for bad in ({"abc": 1}, {"5": 101}, {"5": "x"}, [1, 2], {"999999999": 5}):
        expect_error(400, "POST", "/v1/completions", dict(base, logit_bias=bad))

def test_min_tokens():
    """min_tokens keeps the end-of-sequence token out until that many tokens
    (greedy: the same text up to where it would have stopped)."""
    body = {"model": NAME, "messages": [{"role": "user", "content": "Say hello."}], "max_tokens": 100,
            "temperature": 0, "logprobs": True, "top_logprobs": lib.TOP_LOGPROBS}
    st, text = request("POST", "/v1/chat/completions", body)
    plain = json.loads(text)
    n0 = plain["usage"]["completion_tokens"]
    assert st == 200 and plain["choices"][0]["finish_reason"] == "stop" and n0 <= 80, plain
    st, text = request("POST", "/v1/chat/completions", dict(body, min_tokens=n0 + 10))
    longer = json.loads(text)
    assert st == 200 and longer["usage"]["completion_tokens"] >= n0 + 10, longer
    a, b = plain["choices"][0], longer["choices"][0]
    lib.expect_greedy_agree(a["message"]["content"], a["logprobs"], b["message"]["content"], b["logprobs"], BACKEND,
                            prefix=True)
    expect_error(400, "POST", "/v1/chat/completions", dict(body, min_tokens=101), param="min_tokens")
    expect_error(400, "POST", "/v1/chat/completions", dict(body, min_tokens=-1), param="min_tokens")

def test_json_mode():
    """response_format json_object: the reply parses as one JSON object
    (greedy and sampled, chat and streamed); json_schema: the object has the
    schema's properties in order with their types, the required ones at
    least; unsupported schemas are a
    clear 400."""
    from openai import OpenAI
    client = OpenAI(base_url=f"http://127.0.0.1:{PORT}/v1", api_key=KEY)
    msgs = [{"role": "user", "content": "Describe a cat as JSON with the keys name, color and age."}]
    for extra in ({"temperature": 0}, {"temperature": 1.0, "seed": 3}, {"temperature": 0.7, "seed": 9, "n": 2}):
        r = client.chat.completions.create(model=NAME, messages=msgs, max_tokens=120,
                                           response_format={"type": "json_object"}, **extra)
        for ch in r.choices:
            # a sampled choice may still be inside a long string at max_tokens: then it is a prefix
            if ch.finish_reason == "length" and extra["temperature"] > 0:
                assert ch.message.content.lstrip().startswith("{"), ch.message.content
                continue
            assert ch.finish_reason == "stop", (ch, extra)
            obj = json.loads(ch.message.content)
            assert isinstance(obj, dict), ch.message.content
    text = "".join(c.choices[0].delta.content or "" for c in client.chat.completions.create(
        model=NAME, messages=msgs, max_tokens=120, temperature=0, response_format={"type": "json_object"},
        stream=True) if c.choices)
    assert isinstance(json.loads(text), dict), text
    # schema mode: the properties in order (those not required may be left out), with their types
    schema = {"type": "object", "properties": {
        "name": {"type": "string"}, "color": {"enum": ["black", "white", "orange", "grey"]},
        "age": {"type": "integer"}, "indoor": {"type": "boolean"},
        "toys": {"type": "array", "items": {"type": "string"}, "maxItems": 3}}, "required": ["name"],
        "additionalProperties": False}
    for extra in ({"temperature": 0}, {"temperature": 0.8, "seed": 4}):
        r = client.chat.completions.create(model=NAME, messages=msgs, max_tokens=150, response_format={
            "type": "json_schema", "json_schema": {"name": "cat", "schema": schema, "strict": True}}, **extra)
        ch = r.choices[0]
        if ch.finish_reason == "length" and extra["temperature"] > 0:
            assert ch.message.content.startswith('{"name"') or ch.message.content.lstrip().startswith("{"), ch
            continue
        assert ch.finish_reason == "stop", ch
        obj = json.loads(ch.message.content)
        # the required name, then any of the optional properties, in the schema's order
        order = ["name", "color", "age", "indoor", "toys"]
        assert list(obj) == [k for k in order if k in obj] and "name" in obj, obj
        assert isinstance(obj["name"], str) and obj.get("color", "grey") in schema["properties"]["color"]["enum"], obj
        assert isinstance(obj.get("age", 0), int) and isinstance(obj.get("indoor", True), bool), obj
        assert isinstance(obj.get("toys", []), list) and len(obj.get("toys", [])) <= 3, obj
        assert all(isinstance(t, str) for t in obj.get("toys", [])), obj
    for bad in ({}, {"schema": {"type": "object", "properties": {"a": {"not": {}}}}}, {"schema": {"anyOf": []}}):
        expect_error(400, "POST", "/v1/chat/completions",
                     {"model": NAME, "messages": msgs, "response_format": {"type": "json_schema", "json_schema": bad}},
                     param="response_format")
    expect_error(400, "POST", "/v1/chat/completions",
                 {"model": NAME, "messages": msgs, "response_format": "json"}, param="response_format")

def test_responses_api():
    """POST /v1/responses through the openai client: the same text as chat,
    streamed events in order with the deltas adding up to the final text,
    max_output_tokens -> incomplete, structured output, clear 400s (non-function
    tools, previous_response_id, other input items)."""
    from openai import OpenAI, BadRequestError
    client = OpenAI(base_url=f"http://127.0.0.1:{PORT}/v1", api_key=KEY)
    q = "What is the capital of France?"
    r = client.responses.create(model=NAME, input=q, max_output_tokens=16, temperature=0)
    chat = client.chat.completions.create(model=NAME, messages=[{"role": "user", "content": q}], max_tokens=16,
                                          temperature=0)
    assert r.object == "response" and r.status == "completed" and r.id.startswith("resp_"), r
    assert r.output_text == chat.choices[0].message.content and "Paris" in r.output_text, (r.output_text, chat)
    assert r.usage.input_tokens == chat.usage.prompt_tokens and r.usage.output_tokens == chat.usage.completion_tokens
    cut = client.responses.create(model=NAME, instructions="Answer at length.",
                                  input=[{"role": "user", "content": [{"type": "input_text", "text": q}]}],
                                  max_output_tokens=3, temperature=0)
    assert cut.status == "incomplete" and cut.incomplete_details.reason == "max_output_tokens", cut
    types, text, final = [], "", None
    for ev in client.responses.create(model=NAME, input=q, max_output_tokens=16, temperature=0, stream=True):
        types.append(ev.type)
        if ev.type == "response.output_text.delta":
            text += ev.delta
        if ev.type == "response.completed":
            final = ev.response
    assert types[:4] == ["response.created", "response.in_progress", "response.output_item.added",
                         "response.content_part.added"], types
    assert types[-4:] == ["response.output_text.done", "response.content_part.done", "response.output_item.done",
                          "response.completed"], types
    assert text == r.output_text and final.output_text == text, (text, final)
    j = client.responses.create(model=NAME, input="Describe a cat as JSON.", max_output_tokens=80, temperature=0,
                                text={"format": {"type": "json_schema", "name": "cat", "schema": {
                                    "type": "object", "properties": {"name": {"type": "string"},
                                                                     "age": {"type": "integer"}}}}})
    obj = json.loads(j.output_text)
    assert list(obj) == ["name", "age"] and isinstance(obj["age"], int), obj
    for bad in ({"input": "x", "tools": [{"type": "web_search"}]}, {"input": 5},
                {"input": "x", "previous_response_id": "resp_1"}, {"input": [{"type": "function_call"}]}):
        try:
            client.responses.create(model=NAME, **bad)
            raise AssertionError(f"accepted {bad}")
        except BadRequestError as e:
            assert e.status_code == 400, e

def test_prompt_list():
    """completions with a list of prompts: n choices per prompt, in order
    (prompt p's choices at p*n ..), each equal to that prompt alone; usage
    counts every prompt once."""
    from openai import OpenAI
    client = OpenAI(base_url=f"http://127.0.0.1:{PORT}/v1", api_key=KEY)
    prompts = ["The capital of France is", "One, two, three,", "The color of the sky is"]
    r = client.completions.create(model=NAME, prompt=prompts, max_tokens=4, temperature=0, n=2)
    assert [c.index for c in r.choices] == list(range(6)), r
    alone = [client.completions.create(model=NAME, prompt=p, max_tokens=4, temperature=0) for p in prompts]
    for p, a in enumerate(alone):
        assert r.choices[2 * p].text == r.choices[2 * p + 1].text == a.choices[0].text, (p, r.choices, a)
    assert r.usage.prompt_tokens == sum(a.usage.prompt_tokens for a in alone), r.usage
    assert r.usage.completion_tokens == sum(2 * a.usage.completion_tokens for a in alone), r.usage
    streamed = {}
    for chunk in client.completions.create(model=NAME, prompt=prompts[:2], max_tokens=4, temperature=0, stream=True):
        for ch in chunk.choices:
            streamed[ch.index] = streamed.get(ch.index, "") + ch.text
    assert streamed == {0: alone[0].choices[0].text, 1: alone[1].choices[0].text}, streamed
    expect_error(400, "POST", "/v1/completions", {"model": NAME, "prompt": ["a", 5]}, param="prompt")
    expect_error(400, "POST", "/v1/completions", {"model": NAME, "prompt": ["ok", "x" * 3000], "max_tokens": 4})

def main():
    if lib.missing_prereqs("test_server"):
        return 1
    log = lib.log_file("test_server.log")
    proc = lib.start_server(["--port", str(PORT), "--served-model-name", NAME, "--api-key", KEY,
                             "--max-model-len", str(MAX_LEN), "--max-request-bytes", str(MAX_BODY),
                             "--enable-prompt-tokens-details", "--max-num-seqs", "32", "--kv-cache-memory", "256M"],
                            stdout=log)
    global BACKEND
    try:
        lib.wait_healthy(PORT, proc)
        log.flush()
        BACKEND = lib.log_backend("test_server.log")
        print(f"     server on backend {BACKEND}", flush=True)
        tests = [test_health_and_models, test_chat_nonstream_and_stream_agree, test_completions, test_curl,
                 test_seed_reproducible, test_seeded_draws_follow_the_sampler, test_prefix_cache_reported, test_tokenize_roundtrip,
                 test_errors_then_success, test_concurrent_streams_batched, test_disconnect_frees_blocks,
                 test_disconnect_unstreamed, test_tools_without_parser, test_tool_round_trip_null_content,
                 test_long_text_refused_before_tokenizing,
                 test_n_choices, test_logit_bias, test_min_tokens, test_json_mode, test_responses_api, test_prompt_list]
        passed, failed = lib.run_tests(tests, proc=proc)
    finally:
        lib.stop_server(proc)
        log.close()
    return lib.summary(passed, failed)


if __name__ == "__main__":
    sys.exit(main())

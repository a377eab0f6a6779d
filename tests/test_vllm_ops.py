"""What a vLLM user reaches for on day one, against the real server with the
official `openai` client and plain HTTP (curl's view): vLLM's request fields
(each works or is a 400 naming it), prompt logprobs and echo, token-id
prompts, vLLM's /metrics names read the way its Grafana dashboard reads them,
CORS, the API key from the environment, SIGTERM draining, and a model named
by its Hugging Face id found in the local cache.
"""
import http.client
import json
import math
import os
import re
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time

sys.path.insert(0, os.path.dirname(__file__))
import sluice_testlib as lib  # noqa: E402
from sluice_testlib import BIN, MODEL, ROOT, free_port  # noqa: E402

import openai  # noqa: E402

KEY = "sk-ops-test"
NAME = "ops-model"
# random weights, SmolLM2's tokenizer: fast enough on a loaded machine; the tests compare the server with itself
TINY = os.path.join(ROOT, "tests", "models", "tiny-llama")


def start(args, log, env=None):
    return subprocess.Popen([BIN, "serve", TINY] + list(args), stdout=log, stderr=subprocess.STDOUT, env=env)


def http_req(port, method, path, body=None, headers=None, key=KEY):
    """(status, headers dict lower-cased, body text)."""
    c = http.client.HTTPConnection("127.0.0.1", port, timeout=120)
    h = {"Content-Type": "application/json"}
    if key:
        h["Authorization"] = "Bearer " + key
    h.update(headers or {})
    data = body if isinstance(body, (bytes, str)) or body is None else json.dumps(body)
    c.request(method, path, data, h)
    r = c.getresponse()
    text = r.read().decode("utf-8", "replace")
    hs = {k.lower(): v for k, v in r.getheaders()}
    c.close()
    return r.status, hs, text


def tokenize(port, text):
    st, _, t = http_req(port, "POST", "/tokenize", {"prompt": text, "add_special_tokens": False})
    assert st == 200, t
    return json.loads(t)["tokens"]


def client(port):
    return openai.OpenAI(base_url=f"http://127.0.0.1:{port}/v1", api_key=KEY, max_retries=0)


def complete(port, **body):
    body.setdefault("model", NAME)
    body.setdefault("temperature", 0)
    st, _, t = http_req(port, "POST", "/v1/completions", body)
    return st, json.loads(t)


# ---- vLLM's request fields --------------------------------------------------------------------------------


def word_tokens(port, prompt, n):
    """The greedy continuation's token texts, and the index of the first that is a plain word."""
    st, r = complete(port, prompt=prompt, max_tokens=n, logprobs=0, ignore_eos=True)
    assert st == 200, r
    toks = r["choices"][0]["logprobs"]["tokens"]
    k = next(i for i, t in enumerate(toks) if i >= 2 and t.strip().isalpha() and t.strip() not in "".join(toks[:i]))
    return toks, k


def test_include_stop_str_in_output(port):
    c = client(port)
    toks, k = word_tokens(port, "1, 2, 3,", 16)
    stop = toks[k].strip()
    cut = c.completions.create(model=NAME, prompt="1, 2, 3,", max_tokens=16, temperature=0, stop=[stop],
                               extra_body={"ignore_eos": True})
    kept = c.completions.create(model=NAME, prompt="1, 2, 3,", max_tokens=16, temperature=0, stop=[stop],
                                extra_body={"include_stop_str_in_output": True, "ignore_eos": True})
    assert cut.choices[0].finish_reason == kept.choices[0].finish_reason == "stop"
    assert kept.choices[0].text == cut.choices[0].text + stop, (cut.choices[0].text, kept.choices[0].text, stop)


def test_allowed_token_ids(port):
    ids = tokenize(port, " seven")
    assert len(ids) >= 1
    tid = ids[0]
    st, r = complete(port, prompt="Count:", max_tokens=4, allowed_token_ids=[tid], ignore_eos=True,
                     logprobs=0)
    assert st == 200, r
    toks = r["choices"][0]["logprobs"]["tokens"]
    piece = json.loads(http_req(port, "POST", "/detokenize", {"tokens": [tid]})[2])["prompt"]
    assert toks == [piece] * 4, (toks, piece)
    st, r = complete(port, prompt="x", max_tokens=2, allowed_token_ids=[10 ** 9])
    assert st == 400 and "allowed_token_ids" in json.dumps(r), r


def test_bad_words(port):
    toks, k = word_tokens(port, "1, 2, 3,", 12)
    st, r2 = complete(port, prompt="1, 2, 3,", max_tokens=12, bad_words=[toks[k]], logprobs=0, ignore_eos=True)
    assert st == 200, r2
    got = r2["choices"][0]["logprobs"]["tokens"]
    assert got[:k] == toks[:k] and toks[k] not in got, (toks, got)
    st, r3 = complete(port, prompt="1, 2, 3,", max_tokens=10, bad_words="4")
    assert st == 400 and r3["error"]["param"] == "bad_words", r3


def test_truncate_prompt_tokens(port):
    ids = tokenize(port, "one two three four five six seven eight")
    st, full = complete(port, prompt=ids[-3:], max_tokens=5)
    st, r = complete(port, prompt="one two three four five six seven eight", max_tokens=5, truncate_prompt_tokens=3)
    assert st == 200, r
    assert r["usage"]["prompt_tokens"] == 3, r["usage"]
    assert r["choices"][0]["text"] == full["choices"][0]["text"], (r, full)
    st, r = complete(port, prompt="hi", max_tokens=2, truncate_prompt_tokens=10 ** 7)
    assert st == 400 and r["error"]["param"] == "truncate_prompt_tokens", r


def test_skip_special_tokens(port):
    special = tokenize(port, "<|im_start|>")
    assert len(special) == 1, special
    body = dict(prompt="Hi", max_tokens=2, allowed_token_ids=special, ignore_eos=True)
    st, skipped = complete(port, **body)
    st2, kept = complete(port, skip_special_tokens=False, spaces_between_special_tokens=True, **body)
    assert st == st2 == 200, (skipped, kept)
    assert skipped["choices"][0]["text"] == "", skipped
    assert kept["choices"][0]["text"] == "<|im_start|><|im_start|>", kept


def test_prompt_logprobs_match_sampling(port):
    """A prompt token's logprob is what sampling gave it when it was generated."""
    ids = tokenize(port, "The capital of France is")
    st, a = complete(port, prompt=ids, max_tokens=1, logprobs=1)
    assert st == 200, a
    t_text = a["choices"][0]["logprobs"]["tokens"][0]
    lp = a["choices"][0]["logprobs"]["token_logprobs"][0]
    nxt = tokenize(port, t_text)
    st, b = complete(port, prompt=ids + nxt[:1], max_tokens=1, prompt_logprobs=2)
    assert st == 200, b
    plp = b["choices"][0]["prompt_logprobs"]
    assert plp[0] is None and len(plp) == len(ids) + 1, plp
    for i, entry in enumerate(plp[1:], 1):
        tid = str((ids + nxt[:1])[i])
        assert tid in entry and "rank" in entry[tid] and "decoded_token" in entry[tid], entry
        assert 1 <= len(entry) <= 3, entry
    last = plp[-1][str(nxt[0])]
    assert abs(last["logprob"] - lp) < 1e-3, (last, lp)
    assert last["rank"] == 1  # greedy picked it
    st, _, t = http_req(port, "POST", "/v1/chat/completions", {"model": NAME, "messages": [{"role": "user", "content": "Hi"}],
                                                          "max_tokens": 1, "prompt_logprobs": 0})
    chat = json.loads(t)
    assert st == 200 and chat["prompt_logprobs"][0] is None, t  # vLLM: beside the choices, one list for the chat
    assert len(chat["prompt_logprobs"]) == chat["usage"]["prompt_tokens"], t
    assert all(len(e) == 1 for e in chat["prompt_logprobs"][1:]), t
    st, r = complete(port, prompt="x", max_tokens=2, prompt_logprobs=1, stream=True)
    assert st == 400 and r["error"]["param"] == "prompt_logprobs", r


def test_echo_with_logprobs(port):
    """lm-eval's loglikelihood request: echo, logprobs, max_tokens 1."""
    c = client(port)
    prompt = "The capital of France is"
    r = c.completions.create(model=NAME, prompt=prompt, max_tokens=1, temperature=0, echo=True, logprobs=1)
    ch = r.choices[0]
    assert ch.text.startswith(prompt), ch.text
    n = r.usage.prompt_tokens
    lp = ch.logprobs
    assert len(lp.tokens) == n + 1 and lp.token_logprobs[0] is None and lp.top_logprobs[0] is None
    assert all(isinstance(x, float) for x in lp.token_logprobs[1:]), lp.token_logprobs
    assert "".join(lp.tokens[:n]) == prompt, (lp.tokens, prompt)
    assert lp.text_offset[0] == 0 and lp.text_offset[n] == len(prompt), lp.text_offset
    plain = c.completions.create(model=NAME, prompt=prompt, max_tokens=3, temperature=0, echo=True)
    assert plain.choices[0].text.startswith(prompt) and plain.choices[0].logprobs is None
    streamed = "".join(ch.choices[0].text for ch in c.completions.create(
        model=NAME, prompt=prompt, max_tokens=3, temperature=0, echo=True, stream=True) if ch.choices)
    assert streamed == plain.choices[0].text, (streamed, plain.choices[0].text)


def test_token_id_list_prompts(port):
    a, b = tokenize(port, "Hello there"), tokenize(port, "Once upon")
    st, both = complete(port, prompt=[a, b], max_tokens=4)
    assert st == 200, both
    st, one = complete(port, prompt=a, max_tokens=4)
    st, two = complete(port, prompt=b, max_tokens=4)
    assert [c["text"] for c in both["choices"]] == [one["choices"][0]["text"], two["choices"][0]["text"]], both
    st, single = complete(port, prompt=[a], max_tokens=4)
    assert st == 200 and single["choices"][0]["text"] == one["choices"][0]["text"], single
    st, r = complete(port, prompt=[a, []], max_tokens=4)
    assert st == 400 and r["error"]["param"] == "prompt", r


def test_continue_final_message(port):
    msgs = [{"role": "user", "content": "Name a city."}, {"role": "assistant", "content": "The capital of France is"}]
    st, _, t = http_req(port, "POST", "/apply-template",
                        {"messages": msgs, "continue_final_message": True, "add_generation_prompt": False})
    assert st == 200, t
    prompt = json.loads(t)["prompt"]
    assert prompt.endswith("The capital of France is"), prompt
    c = client(port)
    chat = c.chat.completions.create(model=NAME, messages=msgs, max_tokens=4, temperature=0,
                                     extra_body={"continue_final_message": True, "add_generation_prompt": False})
    comp = complete(port, prompt=prompt, max_tokens=4)[1]
    assert chat.choices[0].message.content == comp["choices"][0]["text"], (chat, comp)
    st, _, t = http_req(port, "POST", "/v1/chat/completions",
                        {"model": NAME, "messages": msgs, "continue_final_message": True, "add_generation_prompt": True})
    assert st == 400 and "continue_final_message" in t, t
    st, _, t = http_req(port, "POST", "/apply-template", {"messages": msgs[:1], "add_generation_prompt": False})
    assert st == 200 and not json.loads(t)["prompt"].rstrip().endswith("assistant"), t


def test_return_tokens_as_token_ids(port):
    ids = tokenize(port, "Hello there")
    st, r = complete(port, prompt=ids, max_tokens=3, logprobs=1, echo=True, return_tokens_as_token_ids=True)
    assert st == 200, r
    toks = r["choices"][0]["logprobs"]["tokens"]
    assert toks[:len(ids)] == [f"token_id:{i}" for i in ids], toks
    assert all(re.fullmatch(r"token_id:\d+", t) for t in toks), toks
    st, r = complete(port, prompt="x", max_tokens=1, add_special_tokens="no")
    assert st == 400 and r["error"]["param"] == "add_special_tokens", r


def test_fields_still_refused_name_themselves(port):
    for field, value in (("use_beam_search", True), ("best_of", 2), ("suffix", "x")):
        st, r = complete(port, prompt="x", max_tokens=1, **{field: value})
        assert st == 400 and field in r["error"]["message"], (field, r)
    st, r = complete(port, prompt="x", max_tokens=1, echo=True, stream=True, logprobs=1)
    assert st == 400 and r["error"]["param"] == "echo", r


# ---- defects --------------------------------------------------------------------------------------------------

WEATHER = {"type": "function", "function": {"name": "get_weather", "parameters": {
    "type": "object", "properties": {"city": {"type": "string", "enum": ["Paris", "Rome"]}}, "required": ["city"]}}}


def test_required_tool_finishes_with_tool_calls(port):
    c = client(port)
    msgs = [{"role": "user", "content": "Weather in Paris?"}]
    r = c.chat.completions.create(model=NAME, messages=msgs, tools=[WEATHER], tool_choice="required", max_tokens=60,
                                  temperature=0)
    ch = r.choices[0]
    assert ch.finish_reason == "tool_calls", ch
    args = ch.message.tool_calls[0].function.arguments
    assert args.startswith("{") and args.endswith("}"), repr(args)
    json.loads(args)
    named = c.chat.completions.create(model=NAME, messages=msgs, tools=[WEATHER], max_tokens=60, temperature=0,
                                      tool_choice={"type": "function", "function": {"name": "get_weather"}})
    assert named.choices[0].finish_reason == "stop", named  # a named function: OpenAI's and vLLM's "stop"
    assert named.choices[0].message.tool_calls[0].function.arguments == args
    parts, fins = [], []
    for chunk in c.chat.completions.create(model=NAME, messages=msgs, tools=[WEATHER], tool_choice="required",
                                           max_tokens=60, temperature=0, stream=True):
        for ch in chunk.choices:
            for tc in ch.delta.tool_calls or []:
                parts.append(tc.function.arguments or "")
            if ch.finish_reason:
                fins.append(ch.finish_reason)
    assert fins == ["tool_calls"], fins
    assert "".join(parts) == args and not (parts[0] + parts[1])[:1].isspace(), parts[:3]


def test_invalid_utf8_is_400(port):
    body = b'{"model":"' + NAME.encode() + b'","prompt":"caf\xc3\x28 \xff","max_tokens":1}'
    st, _, t = http_req(port, "POST", "/v1/completions", body)
    assert st == 400 and "UTF-8" in t, (st, t)
    body = b'{"model":"' + NAME.encode() + b'","messages":[{"role":"user","content":"\xed\xa0\x80"}]}'
    st, _, t = http_req(port, "POST", "/v1/chat/completions", body)
    assert st == 400 and "UTF-8" in t, (st, t)
    ok = '{"model":"%s","prompt":"caf\u00e9 \u4e2d \U0001F600","max_tokens":1}' % NAME
    st, _, t = http_req(port, "POST", "/v1/completions", ok.encode("utf-8"))
    assert st == 200, t


def test_batch_wait_exit_status(port):
    """`sluice batch submit --wait`: exit 1 when every request failed; without a terminal, no line per poll."""
    d = tempfile.mkdtemp(prefix="sluice-bw-")
    try:
        path = os.path.join(d, "bad.jsonl")
        with open(path, "w") as f:
            for i in range(3):
                f.write(json.dumps({"custom_id": f"b{i}", "method": "POST", "url": "/v1/completions",
                                    "body": {"model": "no-such-model", "prompt": "x", "max_tokens": 1}}) + "\n")
        args = [BIN, "batch", "submit", path, "--wait", "--poll-interval", "0.02", "--url",
                f"http://127.0.0.1:{port}", "--api-key", KEY]
        r = subprocess.run(args, capture_output=True, text=True, timeout=120)
        assert r.returncode == 1, (r.returncode, r.stderr)
        assert "3 failed of 3" in r.stderr, r.stderr
        progress = [ln for ln in r.stderr.splitlines() if ln.startswith("[batch] ") and "done (" in ln]
        assert 1 <= len(progress) <= 4, r.stderr  # status changes only, however many polls
        good = os.path.join(d, "good.jsonl")
        with open(good, "w") as f:
            f.write(json.dumps(batch_lines(1)[0]) + "\n")
        r = subprocess.run(args[:2] + ["submit", good] + args[4:], capture_output=True, text=True, timeout=120)
        assert r.returncode == 0, r.stderr
    finally:
        shutil.rmtree(d, ignore_errors=True)


def test_responses_echo_request(port):
    """The Response object carries the request's settings; background is refused, never run synchronously."""
    c = client(port)
    tool = {"type": "function", "name": "get_weather", "parameters": WEATHER["function"]["parameters"]}
    r = c.responses.create(model=NAME, input="Weather?", instructions="Be brief.", max_output_tokens=5,
                           temperature=0.3, top_p=0.9, tools=[tool], tool_choice="none", parallel_tool_calls=False,
                           text={"format": {"type": "text"}}, metadata={"k": "v"})
    assert r.instructions == "Be brief." and r.max_output_tokens == 5, r
    assert abs(r.temperature - 0.3) < 1e-9 and abs(r.top_p - 0.9) < 1e-9, r
    assert r.tool_choice == "none" and r.parallel_tool_calls is False, r
    assert [t.name for t in r.tools] == ["get_weather"], r.tools
    assert r.text.format.type == "text" and r.metadata == {"k": "v"}, r
    d = c.responses.create(model=NAME, input="Hi", max_output_tokens=3)
    assert d.tools == [] and d.tool_choice == "auto" and d.parallel_tool_calls is True and d.instructions is None
    events = list(c.responses.create(model=NAME, input="Hi", max_output_tokens=3, temperature=0.5, stream=True))
    assert events[0].response.temperature == 0.5 and events[-1].response.temperature == 0.5, events[-1]
    st, _, t = http_req(port, "POST", "/v1/responses", {"model": NAME, "input": "Hi", "background": True})
    assert st == 400 and json.loads(t)["error"]["param"] == "background", t
    try:
        c.responses.retrieve(r.id)
        raise AssertionError("retrieve answered")
    except openai.NotFoundError as e:
        assert "not stored" in str(e), e


# ---- operations ---------------------------------------------------------------------------------------------


def test_api_key_from_env(port):
    st, _, _ = http_req(port, "GET", "/v1/models", key=None)
    assert st == 401
    st, _, _ = http_req(port, "GET", "/v1/models", key="wrong")
    assert st == 401
    assert client(port).models.list().data[0].id == NAME


def test_cors(port):
    st, h, _ = http_req(port, "OPTIONS", "/v1/chat/completions", key=None,
                        headers={"Origin": "http://app.example", "Access-Control-Request-Method": "POST",
                                 "Access-Control-Request-Headers": "authorization, content-type"})
    assert st == 200, (st, h)
    assert h.get("access-control-allow-origin") == "*", h
    assert "POST" in h.get("access-control-allow-methods", ""), h
    assert "authorization" in h.get("access-control-allow-headers", "").lower(), h
    st, h, _ = http_req(port, "GET", "/v1/models", headers={"Origin": "http://app.example"})
    assert st == 200 and h.get("access-control-allow-origin") == "*", h
    st, h, _ = http_req(port, "GET", "/v1/models")
    assert "access-control-allow-origin" not in h
    if shutil.which("curl"):  # a browser's preflight as curl sends it
        r = subprocess.run(["curl", "-s", "-i", "-X", "OPTIONS", f"http://127.0.0.1:{port}/v1/completions",
                            "-H", "Origin: http://app.example", "-H", "Access-Control-Request-Method: POST"],
                           capture_output=True, text=True, timeout=30)
        assert r.stdout.startswith("HTTP/1.1 200") and "Access-Control-Allow-Origin: *" in r.stdout, r.stdout


def test_cors_restricted():
    port = free_port()
    d = tempfile.mkdtemp(prefix="sluice-cors-")
    proc = start(["--port", str(port), "--threads", "1", "--data-dir", d, "--allowed-origins",
                  '["http://ok.example"]', "--allowed-methods", '["GET","POST"]', "--allow-credentials"],
                 subprocess.DEVNULL)
    try:
        assert lib.wait_healthy(port, proc)
        pre = {"Access-Control-Request-Method": "POST"}
        st, h, _ = http_req(port, "OPTIONS", "/v1/models", key=None, headers=dict(pre, Origin="http://ok.example"))
        assert st == 200 and h.get("access-control-allow-origin") == "http://ok.example", h
        assert h.get("access-control-allow-credentials") == "true", h
        st, h, _ = http_req(port, "OPTIONS", "/v1/models", key=None, headers=dict(pre, Origin="http://evil.example"))
        assert st == 400 and "access-control-allow-origin" not in h, (st, h)
        st, h, _ = http_req(port, "OPTIONS", "/v1/models", key=None,
                            headers={"Origin": "http://ok.example", "Access-Control-Request-Method": "DELETE"})
        assert st == 400, st
    finally:
        lib.stop_server(proc)
        shutil.rmtree(d, ignore_errors=True)
    r = subprocess.run([BIN, "serve", TINY, "--allowed-origins", "[1]"], capture_output=True, text=True, timeout=30)
    assert r.returncode == 2 and "--allowed-origins" in r.stderr, r.stderr


def test_hf_cache_model():
    hub = tempfile.mkdtemp(prefix="sluice-hf-")
    try:
        snap = os.path.join(hub, "hub", "models--acme--tiny-llama", "snapshots", "0123abcd")
        os.makedirs(os.path.dirname(snap))
        shutil.copytree(os.path.join(ROOT, "tests", "models", "tiny-llama"), snap)
        os.makedirs(os.path.join(hub, "hub", "models--acme--tiny-llama", "refs"))
        with open(os.path.join(hub, "hub", "models--acme--tiny-llama", "refs", "main"), "w") as f:
            f.write("0123abcd")
        env = dict(os.environ, HF_HOME=hub)
        env.pop("HF_HUB_CACHE", None)
        r = subprocess.run([BIN, "info", "acme/tiny-llama"], capture_output=True, text=True, env=env, timeout=60)
        assert r.returncode == 0 and "arch: llama" in r.stdout + r.stderr, r.stdout + r.stderr
        r = subprocess.run([BIN, "info", "acme/absent"], capture_output=True, text=True, env=env, timeout=60)
        assert r.returncode != 0 and "models--acme--absent" in r.stderr and "downloads nothing" in r.stderr, r.stderr
    finally:
        shutil.rmtree(hub, ignore_errors=True)


def read_stream(port, started, body, out, i):
    """One streamed completion: out[i] = (its data lines, whether it ended with [DONE] after a finish_reason,
    the finish reasons); started[i] once its first bytes came."""
    try:
        c = http.client.HTTPConnection("127.0.0.1", port, timeout=120)
        c.request("POST", "/v1/completions", json.dumps(body),
                  {"Content-Type": "application/json", "Authorization": "Bearer " + KEY})
        r = c.getresponse()
        data = r.read(64)
        started[i] = True
        data = (data + r.read()).decode()
        lines = [ln[6:] for ln in data.split("\n") if ln.startswith("data: ")]
        fin = [json.loads(x)["choices"][0]["finish_reason"] for x in lines if x != "[DONE]" and json.loads(x).get("choices")]
        out[i] = (lines, bool(lines) and lines[-1] == "[DONE]" and any(f for f in fin),
                  [f for f in fin if f])
    except Exception as e:  # noqa: BLE001
        out[i] = ([], False, repr(e))


def batch_lines(n, max_tokens=24):
    return [{"custom_id": f"row-{i}", "method": "POST", "url": "/v1/completions",
             "body": {"model": NAME, "prompt": f"Story {i}:", "max_tokens": max_tokens, "ignore_eos": True,
                      "temperature": 0}} for i in range(n)]


def test_sigterm_drains():
    """kill -TERM during 8 streams and a running batch: every stream ends with
    a finish_reason and [DONE]; the batch finishes after a restart with each
    row exactly once."""
    port = free_port()
    d = tempfile.mkdtemp(prefix="sluice-term-")
    log = lib.log_file("test_vllm_ops_term.log")
    args = ["--port", str(port), "--threads", "2", "--data-dir", d, "--served-model-name", NAME,
            "--shutdown-timeout", "3", "--max-num-seqs", "16"]
    env = dict(os.environ, VLLM_API_KEY=KEY)
    proc = start(args, log, env=env)
    try:
        assert lib.wait_healthy(port, proc)
        c = client(port)
        path = d + ".jsonl"
        with open(path, "w") as f:
            for ln in batch_lines(12, 16):
                f.write(json.dumps(ln) + "\n")
        fid = c.files.create(file=open(path, "rb"), purpose="batch").id
        bid = c.batches.create(input_file_id=fid, endpoint="/v1/completions", completion_window="24h").id
        out, started = [None] * 8, [False] * 8
        ts = [threading.Thread(target=read_stream, args=(port, started, {
            "model": NAME, "prompt": f"Tell me about {i}", "max_tokens": 8 if i % 2 else 1900, "ignore_eos": True,
            "stream": True}, out, i)) for i in range(8)]
        for t in ts:
            t.start()
        # the streams are running (their first bytes came) and so is the batch (its rows were claimed at create)
        deadline = time.time() + 60
        while time.time() < deadline and not (c.batches.retrieve(bid).status == "in_progress" and
                                              all(started)):
            time.sleep(0.05)
        time.sleep(0.5)
        t0 = time.time()
        proc.send_signal(signal.SIGTERM)
        for t in ts:
            t.join(60)
        rc = proc.wait(30)
        took = time.time() - t0
        assert rc == 0, rc
        assert took < 3 + 8, took
        for i, o in enumerate(out):
            assert o is not None and o[1], (i, o and o[0][-3:], o and o[2])
            assert o[2] in (["length"], ["abort"]), o[2]
        reasons = [o[2][0] for o in out]
        # what was cut was cut at --shutdown-timeout, not before: the drain waited for it
        assert "abort" not in reasons or took >= 3 - 0.1, (reasons, took)
    finally:
        lib.stop_server(proc)
    proc = start(args, log, env=env)
    try:
        assert lib.wait_healthy(port, proc)
        c = client(port)
        deadline = time.time() + 120
        while time.time() < deadline:
            b = c.batches.retrieve(bid)
            if b.status in ("completed", "failed", "cancelled", "expired"):
                break
            time.sleep(0.2)
        assert b.status == "completed", b
        assert b.request_counts.total == 12 and b.request_counts.completed == 12, b.request_counts
        rows = [json.loads(x) for x in c.files.content(b.output_file_id).text.splitlines() if x]
        ids = [r["custom_id"] for r in rows]
        assert sorted(ids) == sorted(f"row-{i}" for i in range(12)), ids
    finally:
        lib.stop_server(proc)
        shutil.rmtree(d, ignore_errors=True)
        os.unlink(path)


# ---- metrics: the vLLM dashboard's queries -------------------------------------------------------------------

# The series vLLM's Grafana dashboard (examples/online_serving/prometheus_grafana/grafana.json) and its newer
# panels select, each as (metric name, required labels); $model_name is the served name.
DASHBOARD = [
    ('histogram_quantile(0.99, sum by(le) (rate(vllm:e2e_request_latency_seconds_bucket{model_name="$model_name"}[$__rate_interval])))',
     "vllm:e2e_request_latency_seconds_bucket", ["le"]),
    ('rate(vllm:e2e_request_latency_seconds_sum{model_name="$model_name"}[$__rate_interval])',
     "vllm:e2e_request_latency_seconds_sum", []),
    ('rate(vllm:e2e_request_latency_seconds_count{model_name="$model_name"}[$__rate_interval])',
     "vllm:e2e_request_latency_seconds_count", []),
    ('rate(vllm:prompt_tokens_total{model_name="$model_name"}[$__rate_interval])', "vllm:prompt_tokens_total", []),
    ('rate(vllm:generation_tokens_total{model_name="$model_name"}[$__rate_interval])', "vllm:generation_tokens_total", []),
    ('histogram_quantile(0.99, sum by(le) (rate(vllm:time_per_output_token_seconds_bucket{model_name="$model_name"}[$__rate_interval])))',
     "vllm:time_per_output_token_seconds_bucket", ["le"]),
    ('histogram_quantile(0.99, sum by(le) (rate(vllm:inter_token_latency_seconds_bucket{model_name="$model_name"}[$__rate_interval])))',
     "vllm:inter_token_latency_seconds_bucket", ["le"]),
    ('vllm:num_requests_running{model_name="$model_name"}', "vllm:num_requests_running", []),
    ('vllm:num_requests_waiting{model_name="$model_name"}', "vllm:num_requests_waiting", []),
    ('histogram_quantile(0.99, sum by(le) (rate(vllm:time_to_first_token_seconds_bucket{model_name="$model_name"}[$__rate_interval])))',
     "vllm:time_to_first_token_seconds_bucket", ["le"]),
    ('vllm:gpu_cache_usage_perc{model_name="$model_name"}', "vllm:gpu_cache_usage_perc", []),
    ('vllm:kv_cache_usage_perc{model_name="$model_name"}', "vllm:kv_cache_usage_perc", []),
    ('sum by(le) (increase(vllm:request_prompt_tokens_bucket{model_name="$model_name"}[$__rate_interval]))',
     "vllm:request_prompt_tokens_bucket", ["le"]),
    ('sum by(le) (increase(vllm:request_generation_tokens_bucket{model_name="$model_name"}[$__rate_interval]))',
     "vllm:request_generation_tokens_bucket", ["le"]),
    ('sum by(finished_reason) (increase(vllm:request_success_total{model_name="$model_name"}[$__rate_interval]))',
     "vllm:request_success_total", ["finished_reason"]),
    ('rate(vllm:request_queue_time_seconds_sum{model_name="$model_name"}[$__rate_interval])',
     "vllm:request_queue_time_seconds_sum", []),
    ('rate(vllm:request_prefill_time_seconds_sum{model_name="$model_name"}[$__rate_interval])',
     "vllm:request_prefill_time_seconds_sum", []),
    ('rate(vllm:request_decode_time_seconds_sum{model_name="$model_name"}[$__rate_interval])',
     "vllm:request_decode_time_seconds_sum", []),
    ('rate(vllm:request_max_num_generation_tokens_sum{model_name="$model_name"}[$__rate_interval])',
     "vllm:request_max_num_generation_tokens_sum", []),
    ('rate(vllm:prefix_cache_hits_total{model_name="$model_name"}[$__rate_interval]) / '
     'rate(vllm:prefix_cache_queries_total{model_name="$model_name"}[$__rate_interval])',
     "vllm:prefix_cache_queries_total", []),
    ('vllm:prefix_cache_hits_total{model_name="$model_name"}', "vllm:prefix_cache_hits_total", []),
    ('vllm:num_preemptions_total{model_name="$model_name"}', "vllm:num_preemptions_total", []),
]

SAMPLE = re.compile(r'^([a-zA-Z_:][a-zA-Z0-9_:]*)(?:\{(.*)\})? (\S+)$')
LABEL = re.compile(r'([a-zA-Z_][a-zA-Z0-9_]*)="((?:[^"\\]|\\.)*)"')


def parse_exposition(text):
    """[(name, {label: value}, value)] of a Prometheus text exposition, checking each family's TYPE line."""
    out, types = [], {}
    for ln in text.splitlines():
        if ln.startswith("# TYPE "):
            _, _, name, kind = ln.split(" ", 3)
            assert name not in types, f"family {name} declared twice"
            types[name] = kind
            continue
        if not ln or ln.startswith("#"):
            continue
        m = SAMPLE.match(ln)
        assert m, f"not a sample line: {ln!r}"
        labels = dict(LABEL.findall(m.group(2) or ""))
        out.append((m.group(1), labels, float(m.group(3))))
    for name, _, _ in out:
        base = re.sub(r"_(bucket|sum|count)$", "", name)
        assert name in types or base in types, f"{name} has no TYPE line"
    return out


def test_dashboard_queries_return_series(port):
    """After chats and a batch ran: each dashboard query selects at least one
    series with the served model_name, and the counters moved."""
    c = client(port)
    c.chat.completions.create(model=NAME, messages=[{"role": "user", "content": "Hi"}], max_tokens=5)
    for ch in c.chat.completions.create(model=NAME, messages=[{"role": "user", "content": "Hey"}], max_tokens=5,
                                        stream=True):
        pass
    d = tempfile.mkdtemp(prefix="sluice-mb-")
    path = os.path.join(d, "in.jsonl")  # not the server's data directory
    with open(path, "w") as f:
        for ln in batch_lines(3):
            f.write(json.dumps(ln) + "\n")
    fid = c.files.create(file=open(path, "rb"), purpose="batch").id
    bid = c.batches.create(input_file_id=fid, endpoint="/v1/completions", completion_window="24h").id
    deadline = time.time() + 120
    while time.time() < deadline and c.batches.retrieve(bid).status != "completed":
        time.sleep(0.2)
    shutil.rmtree(d, ignore_errors=True)
    st, h, text = http_req(port, "GET", "/metrics", key=None)
    assert st == 200, st
    samples = parse_exposition(text)
    for query, metric, need in DASHBOARD:
        sel = query.replace("$model_name", NAME)
        got = [s for s in samples if s[0] == metric and s[1].get("model_name") == NAME and all(k in s[1] for k in need)]
        assert got, f"no series for {sel}"
    val = {(n, tuple(sorted(lb.items()))): v for n, lb, v in samples}

    def one(name, **lb):
        lb["model_name"] = NAME
        return val[(name, tuple(sorted(lb.items())))]
    assert one("vllm:prompt_tokens_total") > 0 and one("vllm:generation_tokens_total") >= 10
    assert one("vllm:request_success_total", finished_reason="length") >= 5
    assert one("vllm:e2e_request_latency_seconds_count") >= 5
    assert one("vllm:e2e_request_latency_seconds_bucket", le="+Inf") == one("vllm:e2e_request_latency_seconds_count")
    assert one("vllm:request_generation_tokens_bucket", le="+Inf") >= 5
    assert one("vllm:time_to_first_token_seconds_count") >= 5
    # sluice's own: the batch queue and the chat/batch split
    sv = {(n, tuple(sorted(lb.items()))): v for n, lb, v in samples if n.startswith("sluice:")}
    assert sv[("sluice:batches", (("status", "completed"),))] >= 1, sv
    assert sv[("sluice:batch_requests", (("state", "completed"),))] >= 3
    assert sv[("sluice:requests_finished_total", (("class", "batch"), ("finished_reason", "length")))] >= 3
    assert sv[("sluice:requests_finished_total", (("class", "interactive"), ("finished_reason", "length")))] >= 2


def main():
    if lib.missing_prereqs("test_vllm_ops"):
        return 1
    port = free_port()
    d = tempfile.mkdtemp(prefix="sluice-ops-")
    log = lib.log_file("test_vllm_ops.log")
    env = dict(os.environ, VLLM_API_KEY=KEY)
    env.pop("SLUICE_API_KEY", None)
    proc = start(["--port", str(port), "--threads", "2", "--data-dir", d, "--served-model-name", NAME], log, env=env)
    passed = failed = 0
    try:
        if not lib.wait_healthy(port, proc):
            print("FAIL the server did not start (build/test_vllm_ops.log)")
            return lib.summary(0, 1)
        p, f = lib.run_tests([test_include_stop_str_in_output, test_allowed_token_ids, test_bad_words,
                              test_truncate_prompt_tokens, test_skip_special_tokens,
                              test_prompt_logprobs_match_sampling, test_echo_with_logprobs, test_token_id_list_prompts,
                              test_continue_final_message, test_return_tokens_as_token_ids,
                              test_fields_still_refused_name_themselves,
                              test_required_tool_finishes_with_tool_calls, test_invalid_utf8_is_400,
                              test_batch_wait_exit_status, test_responses_echo_request,
                              test_api_key_from_env, test_cors, test_dashboard_queries_return_series], port, proc=proc)
        passed, failed = passed + p, failed + f
    finally:
        lib.stop_server(proc)
        shutil.rmtree(d, ignore_errors=True)
    p, f = lib.run_tests([test_cors_restricted, test_hf_cache_model, test_sigterm_drains])
    return lib.summary(passed + p, failed + f)


if __name__ == "__main__":
    sys.exit(main())

#!/usr/bin/env python3
"""Request and model validation over HTTP and the command line (issue 46):

- a NUL character (\\u0000) inside a message or a prompt is kept: the later
  messages and the generation prompt are still there (chat, completions,
  /v1/responses, a list of prompts);
- chat_template_kwargs cannot replace the template's own variables;
- a wrong type is a 400 naming the field, on chat, completions and
  /v1/responses (whose errors name max_output_tokens, not max_tokens);
- damaged model files are refused at start-up, naming what is wrong: a config
  value of the wrong type, a tokenizer larger than the vocabulary, NaN weights
  (sluice info always; serve and run-batch with --check-weights).

Prints one line per test and ends with "N passed, N failed" (tools/run_tests.sh).
"""
import http.client
import json
import os
import shutil
import struct
import subprocess
import sys
import tempfile

sys.path.insert(0, os.path.dirname(__file__))
import sluice_testlib as lib  # noqa: E402

NAME = "smol"
PORT = lib.free_port()
TINY = os.path.join(lib.ROOT, "tests", "models", "tiny-llama")


def request(method, path, body=None, raw=None):
    c = http.client.HTTPConnection("127.0.0.1", PORT, timeout=120)
    data = raw if raw is not None else (json.dumps(body) if body is not None else None)
    c.request(method, path, body=data, headers={"Content-Type": "application/json"})
    r = c.getresponse()
    text = r.read().decode()
    c.close()
    return r.status, text


def post(path, body):
    st, text = request("POST", path, body)
    assert st == 200, (path, body, st, text)
    return json.loads(text)


def expect_400(path, body, param, word=None):
    st, text = request("POST", path, body)
    assert st == 400, (body, st, text)
    err = json.loads(text)["error"]
    assert err["param"] == param and err["type"] == "invalid_request_error", (body, err)
    if word:
        assert word in err["message"], (body, err)
    return err


def chat(messages, **kw):
    return post("/v1/chat/completions", dict(model=NAME, messages=messages, max_tokens=1, temperature=0, **kw))


def tokens(body):
    """/tokenize's count for a chat or completions body: the render and the tokenizer, no forward pass."""
    return post("/tokenize", dict(model=NAME, **body))["count"]


def three_messages(c):
    return [{"role": "system", "content": f"be{c}brief"}, {"role": "user", "content": [{"type": "text", "text": f"x{c}y"}]},
            {"role": "user", "content": "the second message is here"}]


def test_nul_in_chat_keeps_the_rest():
    # \u0001 is one byte and one token, like \u0000: an equal count means nothing after the NUL was lost
    nul, one = tokens({"messages": three_messages("\u0000")}), tokens({"messages": three_messages("\u0001")})
    short = tokens({"messages": [{"role": "system", "content": "be"}]})
    assert nul == one and nul > short + 10, (nul, one, short)
    rendered = post("/apply-template", {"messages": [{"role": "user", "content": "a\u0000b"},
                                                     {"role": "user", "content": "second"}]})["prompt"]
    assert "a\u0000b" in rendered and "second" in rendered and rendered.endswith("assistant\n"), rendered
    # the request itself (parse, render, tokenize, engine) counts the same prompt
    r = chat(three_messages("\u0000"))
    assert r["usage"]["prompt_tokens"] == one, (r["usage"], one)


def test_nul_in_completions_and_responses():
    text = "one\u0000two three four"
    one = tokens({"prompt": text.replace("\u0000", "\u0001")})
    assert tokens({"prompt": text}) == one and tokens({"prompt": [text]}) == one and one >= 5, one
    r = post("/v1/completions", {"model": NAME, "prompt": [text], "max_tokens": 1, "temperature": 0})
    assert r["usage"]["prompt_tokens"] == one, (r["usage"], one)
    words = "x\u0000y and more words"
    r = post("/v1/responses", {"model": NAME, "input": words, "max_output_tokens": 1})
    want = tokens({"messages": [{"role": "user", "content": words.replace("\u0000", "\u0001")}]})
    assert r["usage"]["input_tokens"] == want, (r["usage"], want)
    # stop strings are matched as C strings: a NUL in one is refused, not cut short
    expect_400("/v1/completions", {"model": NAME, "prompt": "a", "stop": ["x\u0000y"]}, "stop")


def test_kwargs_cannot_replace_template_variables():
    msgs = [{"role": "user", "content": "hi"}]
    for key, val in [("messages", []), ("bos_token", "<evil>"), ("eos_token", ""), ("add_generation_prompt", False),
                     ("tools", []), ("raise_exception", "x")]:
        expect_400("/v1/chat/completions", {"model": NAME, "messages": msgs, "chat_template_kwargs": {key: val}},
                   "chat_template_kwargs." + key, key)
    # the template's own switches and new variables stay allowed
    post("/apply-template", {"messages": msgs, "chat_template_kwargs": {"enable_thinking": False, "custom_flag": 1}})
    rendered = post("/apply-template", {"messages": msgs, "add_generation_prompt": False})["prompt"]
    assert not rendered.endswith("assistant\n"), rendered


CHAT_MSGS = [{"role": "user", "content": "hi"}]


def test_wrong_types_are_400_naming_the_field():
    chat_cases = [({"user": 5}, "user"), ({"tool_choice": 5}, "tool_choice"), ({"echo": 1}, "echo"),
                  ({"model": None}, "model"), ({"tools": 5}, "tools"), ({"parallel_tool_calls": "y"}, "parallel_tool_calls"),
                  ({"metadata": 1}, "metadata"), ({"stream_options": 5, "stream": True}, "stream_options"),
                  ({"max_completion_tokens": 4, "max_tokens": "4"}, "max_tokens"), ({"n": "2"}, "n"),
                  ({"chat_template": "{{ 1 }}"}, "chat_template"), ({"tool_choice": "required"}, "tool_choice")]
    for extra, param in chat_cases:
        body = {"model": NAME, "messages": CHAT_MSGS, "max_tokens": 1}
        body.update(extra)
        expect_400("/v1/chat/completions", body, param)
    expect_400("/v1/chat/completions", {"model": NAME, "messages": [{"role": "user"}]}, "messages[0].content")
    expect_400("/v1/chat/completions", {"model": NAME, "messages": [{"role": "user", "content": "a", "name": 7}]},
               "messages[0].name")
    for extra, param in [({"user": 5}, "user"), ({"echo": 1}, "echo"), ({"model": None}, "model"),
                         ({"max_tokens": "4"}, "max_tokens")]:
        body = {"model": NAME, "prompt": "hi", "max_tokens": 1}
        body.update(extra)
        expect_400("/v1/completions", body, param)
    for extra, param in [({"text": 5}, "text"), ({"text": {"format": {"type": "xml"}}}, "text.format"),
                         ({"tools": 5}, "tools"), ({"user": 5}, "user"), ({"store": "no"}, "store"),
                         ({"max_output_tokens": "x"}, "max_output_tokens"), ({"model": None}, "model")]:
        body = {"model": NAME, "input": "hi"}
        body.update(extra)
        expect_400("/v1/responses", body, param)
    assert lib.health(PORT) == 200


def test_responses_errors_name_responses_fields():
    err = expect_400("/v1/responses", {"model": NAME, "input": "hi", "max_output_tokens": 10 ** 6}, "max_output_tokens")
    assert "max_tokens" not in err["message"].replace("max_output_tokens", ""), err
    err = expect_400("/v1/responses", {"model": NAME, "input": "hi", "max_output_tokens": 0}, "max_output_tokens")
    err = expect_400("/v1/responses", {"model": NAME, "input": "hi",
                                       "text": {"format": {"type": "json_schema", "schema": {"type": "nosuch"}}}},
                     "text.format")
    assert "response_format" not in err["message"], err


# ---- model files ----

def run(args, timeout=120):
    p = subprocess.run([lib.BIN] + args, capture_output=True, text=True, timeout=timeout)
    return p.returncode, p.stdout + p.stderr


def tiny_copy(tmp, name):
    d = os.path.join(tmp, name)
    shutil.copytree(TINY, d, symlinks=False)
    return d


def edit_json(path, fn):
    with open(path) as f:
        obj = json.load(f)
    fn(obj)
    with open(path, "w") as f:
        json.dump(obj, f)


def poke_nan(d, tensor, k):
    """Writes a bf16 NaN as element k of tensor in d's model.safetensors."""
    path = os.path.join(d, "model.safetensors")
    with open(path, "r+b") as f:
        n = struct.unpack("<Q", f.read(8))[0]
        head = json.loads(f.read(n))
        f.seek(8 + n + head[tensor]["data_offsets"][0] + 2 * k)
        f.write(struct.pack("<H", 0x7FC0))


def serve_fails(d, *flags):
    """Runs `sluice serve d flags`: (exit status, output) once it exits, or None when it became ready."""
    port = lib.free_port()
    p = subprocess.Popen([lib.BIN, "serve", d, "--port", str(port), "--kv-cache-memory", "16M", "--threads", "1"]
                         + list(flags),
                         stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    if lib.wait_healthy(port, p, timeout=60):
        lib.stop_server(p)
        return None
    out = lib.stop_server(p)
    return p.returncode, out


def test_model_files_checked_at_load():
    with tempfile.TemporaryDirectory(prefix="sluice_validation_") as tmp:
        # a config value of the wrong type: named, not replaced by a default
        d = tiny_copy(tmp, "theta")
        edit_json(os.path.join(d, "config.json"), lambda c: c["rope_parameters"].update(rope_theta="x"))
        rc, out = run(["info", d])
        assert rc == 1 and "rope_theta" in out, (rc, out)
        res = serve_fails(d)
        assert res and res[0] != 0 and "rope_theta" in res[1], res
        # a tokenizer with more tokens than the embedding has rows: both sizes at start-up
        d = tiny_copy(tmp, "vocab")
        edit_json(os.path.join(d, "tokenizer.json"), lambda t: t["added_tokens"].append(
            {"id": 49200, "content": "<extra>", "single_word": False, "lstrip": False, "rstrip": False,
             "normalized": False, "special": True}))
        res = serve_fails(d)
        assert res and "49201" in res[1] and "49152" in res[1], res
        # NaN weights: sluice info always looks; serve and run-batch when asked
        d = tiny_copy(tmp, "nan")
        poke_nan(d, "model.layers.0.self_attn.v_proj.weight", 5)
        rc, out = run(["info", d])
        assert rc == 1 and "model.layers.0.self_attn.v_proj.weight" in out and "NaN" in out, (rc, out)
        res = serve_fails(d, "--check-weights")
        assert res and "model.layers.0.self_attn.v_proj.weight" in res[1], res
        assert serve_fails(d) is None  # not asked: the load does not read every weight
        inp = os.path.join(tmp, "in.jsonl")
        with open(inp, "w") as f:
            f.write(json.dumps({"custom_id": "a", "method": "POST", "url": "/v1/completions",
                                "body": {"prompt": "hi", "max_tokens": 1}}) + "\n")
        rc, out = run(["run-batch", "--model", d, "-i", inp, "-o", os.path.join(tmp, "out.jsonl"), "--check-weights",
                       "--kv-cache-memory", "16M", "--quiet"])
        assert rc != 0 and "model.layers.0.self_attn.v_proj.weight" in out, (rc, out)
        # the clean copy passes every check
        rc, out = run(["info", TINY])
        assert rc == 0 and "weight values: all finite" in out, (rc, out)


def test_info_shows_the_mtp_layer():
    """sluice info names a checkpoint's MTP layer, its kinds and what its KV adds; a checkpoint whose config counts
    one it does not hold says it loads without."""
    rc, out = run(["info", os.path.join(lib.ROOT, "tests", "models", "mtp", "dsv3")])
    assert rc == 0 and "mtp: 1 layer(s) (mla + moe)" in out and "160 bytes per token f32" in out, (rc, out)
    rc, out = run(["info", os.path.join(lib.ROOT, "tests", "models", "tiny-glm4-moe")])
    assert rc == 0 and "loaded without MTP layers" in out and "mtp:" not in out, (rc, out)


def test_info_shows_the_pool_key_bytes():
    """sluice info counts the GPU's cached k-pool keys: f32, index_head_dim a pool, in the layers that run their own
    indexer (glm5-mla: indexer_types full, shared, full; 16 dims, pools of 4: 2 x 16 x 4 / 4 bytes a token)."""
    rc, out = run(["info", os.path.join(lib.ROOT, "tests", "models", "glm5", "glm5-mla")])
    assert rc == 0 and "4 keys a pool, 4 pools a query" in out and "each pool's key: 32 bytes a token" in out, (rc, out)


def test_run_batch_lines():
    """run-batch parses lines as the server parses bodies: NULs kept, wrong types named, Responses names."""
    with tempfile.TemporaryDirectory(prefix="sluice_validation_") as tmp:
        lines = [("nul", "/v1/completions", {"prompt": "one\u0000two three", "max_tokens": 1}),
                 ("one", "/v1/completions", {"prompt": "one\u0001two three", "max_tokens": 1}),
                 ("user", "/v1/chat/completions", {"messages": CHAT_MSGS, "user": 5}),
                 ("resp", "/v1/responses", {"input": "hi", "max_output_tokens": 10 ** 6})]
        inp, out = os.path.join(tmp, "in.jsonl"), os.path.join(tmp, "out.jsonl")
        with open(inp, "w") as f:
            for cid, url, body in lines:
                f.write(json.dumps({"custom_id": cid, "method": "POST", "url": url, "body": body}) + "\n")
        rc, text = run(["run-batch", "--model", TINY, "-i", inp, "-o", out, "--kv-cache-memory", "16M", "--quiet",
                        "--threads", "1"])
        assert rc == 0, (rc, text)
        with open(out) as f:
            res = {r["custom_id"]: r["response"] for r in map(json.loads, f)}
        assert res["nul"]["status_code"] == 200 and res["one"]["status_code"] == 200, res
        assert res["nul"]["body"]["usage"]["prompt_tokens"] == res["one"]["body"]["usage"]["prompt_tokens"], res
        assert res["user"]["status_code"] == 400 and res["user"]["body"]["error"]["param"] == "user", res["user"]
        assert res["resp"]["body"]["error"]["param"] == "max_output_tokens", res["resp"]


def main():
    if lib.missing_prereqs("test_validation"):
        return 1
    log = lib.log_file("test_validation.log")
    proc = lib.start_server(["--port", str(PORT), "--served-model-name", NAME, "--max-model-len", "512",
                             "--kv-cache-memory", "64M", "--max-num-seqs", "8", "--threads", "1"], stdout=log)
    try:
        if not lib.wait_healthy(PORT, proc):
            print("FAIL the server did not start")
            return lib.summary(0, 1)
        tests = [test_nul_in_chat_keeps_the_rest, test_nul_in_completions_and_responses,
                 test_kwargs_cannot_replace_template_variables, test_wrong_types_are_400_naming_the_field,
                 test_responses_errors_name_responses_fields]
        passed, failed = lib.run_tests(tests, proc=proc)
    finally:
        lib.stop_server(proc)
        log.close()
    p2, f2 = lib.run_tests([test_model_files_checked_at_load, test_info_shows_the_mtp_layer,
                            test_info_shows_the_pool_key_bytes, test_run_batch_lines])
    return lib.summary(passed + p2, failed + f2)


if __name__ == "__main__":
    sys.exit(main())

#!/usr/bin/env python3
"""Issue 11: the vLLM command lines our first users run start `sluice serve`
unchanged (model swapped for the default model, TP 1, lengths scaled to this
machine); ignored flags are reported one line each; bad flags are refused.

Prints one line per test and ends with "N passed, N failed".
"""
import http.client
import json
import os
import socket
import subprocess
import sys

sys.path.insert(0, os.path.dirname(__file__))
import sluice_testlib as lib  # noqa: E402
from sluice_testlib import BIN, MODEL, free_port  # noqa: E402


def chat(port, name):
    c = http.client.HTTPConnection("127.0.0.1", port, timeout=120)
    c.request("POST", "/v1/chat/completions", json.dumps({
        "model": name, "messages": [{"role": "user", "content": "Say hi."}], "max_tokens": 4, "temperature": 0}),
        {"Content-Type": "application/json"})
    r = c.getresponse()
    body = json.loads(r.read())
    assert r.status == 200, body
    assert body["model"] == name and body["choices"][0]["message"]["content"] is not None, body
    return body


def serve_and_chat(args, name=None):
    """Starts the server with args, waits for /health, chats as name (none:
    no chat), stops it; returns its stderr."""
    port = free_port()
    args = [a.replace("PORT", str(port)) for a in args]
    proc = lib.start_server(args, stdout=subprocess.PIPE, text=True)
    try:
        if not lib.wait_healthy(port, proc) and proc.poll() is not None:
            raise AssertionError("server exited: " + proc.stdout.read())
        if name:
            chat(port, name)
    finally:
        out = lib.stop_server(proc, timeout=30)
    return out


def serve_ready(args):
    """Starts the server with args, waits for /health, stops it; returns its stderr."""
    return serve_and_chat(args)


def run_fail(args, cmd="serve", rc=None):
    argv = [BIN, cmd, MODEL] if cmd == "serve" else [BIN, cmd, "--model", MODEL]
    p = subprocess.run(argv + args, capture_output=True, text=True, timeout=120)
    assert p.returncode != 0 if rc is None else p.returncode == rc, (p.returncode, p.stderr)
    return p.stderr


FIRST = ["--served-model-name", "default_assistant_model", "--tensor-parallel-size", "1",
         "--gpu-memory-utilization", "0.98", "--max-model-len", "2048", "--max-num-seqs", "1",
         "--max-num-batched-tokens", "2048", "--reasoning-parser", "glm45", "--enable-auto-tool-choice",
         "--tool-call-parser", "glm47", "--enable-prompt-tokens-details", "--enable-prefix-caching",
         "--trust-remote-code", "--port", "PORT",
         "--compilation-config", '{"cudagraph_mode":"FULL_AND_PIECEWISE","cudagraph_capture_sizes":[1]}']
MTP3 = ["--speculative-config", '{"method":"mtp","num_speculative_tokens":3,"draft_sample_method":"greedy"}']


def test_first_command_line():
    """the seed's command line serves the default model; its MTP drafts need a
    model with MTP layers, which the default model has not: a start-up error
    that says so (tests/test_spec_mtp.c runs them on models that have them)"""
    out = serve_and_chat(FIRST, "default_assistant_model")
    lines = [l for l in out.splitlines() if " ignored: " in l]
    assert any("--compilation-config" in l and "FULL_AND_PIECEWISE" in l for l in lines), out
    assert any("--compilation-config" in l and "cudagraph_capture_sizes" in l for l in lines), out
    err = run_fail([a.replace("PORT", str(free_port())) for a in FIRST] + MTP3)
    assert "mtp" in err and "no MTP layers" in err, err


def test_second_command_line():
    out = serve_and_chat([
        "--served-model-name", "glm53-flash-awq", "--tensor-parallel-size", "1", "--host", "0.0.0.0",
        "--port", "PORT", "--max-model-len", "4096", "--no-enable-prefix-caching", "--hf-overrides",
        '{"text_config": {"index_topk": null, "index_n_heads": null, "index_head_dim": null, "index_kpool": null}}',
        "--compilation-config", "{\"cudagraph_mode\": \"FULL_DECODE_ONLY\"}", "--gpu-memory-utilization", "0.94",
        "--max-num-batched-tokens", "4096", "--reasoning-parser", "glm47", "--tool-call-parser", "glm47",
        "--enable-auto-tool-choice"], "glm53-flash-awq")
    for key in ("index_topk", "index_n_heads", "index_head_dim", "index_kpool"):
        assert any("--hf-overrides" in l and f"text_config.{key}" in l and "ignored" in l
                   for l in out.splitlines()), (key, out)
    assert "FULL_DECODE_ONLY" not in out  # honoured, so not reported


GLM5 = os.path.join(lib.ROOT, "tests", "models", "glm5", "glm5-hybrid")  # KDA + MLA layers


def glm5_chats(port, name, cached):
    """A chat and a streamed chat through the reasoning parser: both answer, the
    reply carries reasoning_content beside content, and the streamed deltas add
    up to the whole reply (greedy, so both runs generate the same text). The
    chat again gives the same reply: with prefix caching (cached) as a hit,
    the recurrent layers resuming from a snapshot."""
    req = {"model": name, "messages": [{"role": "user", "content": "Think, then answer."}], "max_tokens": 12,
           "temperature": 0}
    c = http.client.HTTPConnection("127.0.0.1", port, timeout=120)
    c.request("POST", "/v1/chat/completions", json.dumps(req), {"Content-Type": "application/json"})
    r = c.getresponse()
    body = json.loads(r.read())
    assert r.status == 200, body
    msg = body["choices"][0]["message"]
    assert "reasoning_content" in msg and body["usage"]["completion_tokens"] == 12, body
    c.request("POST", "/v1/chat/completions", json.dumps(dict(req, stream=True)), {"Content-Type": "application/json"})
    r = c.getresponse()
    assert r.status == 200
    content, reasoning, done = "", "", False
    for line in r.read().decode().splitlines():
        if not line.startswith("data: "):
            continue
        if line == "data: [DONE]":
            done = True
            continue
        d = json.loads(line[6:])["choices"][0]["delta"]
        content += d.get("content") or ""
        reasoning += d.get("reasoning_content") or ""
    assert done and content == (msg["content"] or "") and reasoning == (msg["reasoning_content"] or ""), (
        content, reasoning, msg)
    c.request("POST", "/v1/chat/completions", json.dumps(req), {"Content-Type": "application/json"})
    r = c.getresponse()
    again = json.loads(r.read())
    assert r.status == 200 and again["choices"][0]["message"] == msg, (again, msg)
    hit = (again["usage"].get("prompt_tokens_details") or {}).get("cached_tokens") or 0
    assert (hit > 0) == cached, again["usage"]


def serve_glm5(args, name, cached):
    """The seed's command lines on the tiny glm5_next checkpoint (model path
    swapped, lengths scaled to its 512 positions); returns the server's output."""
    port = free_port()
    args = [a.replace("PORT", str(port)) for a in args]
    proc = subprocess.Popen([BIN, "serve", GLM5] + args, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    try:
        if not lib.wait_healthy(port, proc) and proc.poll() is not None:
            raise AssertionError("server exited: " + proc.stdout.read())
        glm5_chats(port, name, cached)
    finally:
        out = lib.stop_server(proc, timeout=30)
    return out


def test_glm5_first_command_line():
    # the whole line, its MTP drafts included: sluice does not run glm5_next's MTP layer (no reference models
    # it), so it says so in one line and serves without speculation
    out = serve_glm5([
        "--served-model-name", "default_assistant_model", "--tensor-parallel-size", "1",
        "--gpu-memory-utilization", "0.98", "--max-model-len", "512", "--max-num-seqs", "1",
        "--max-num-batched-tokens", "512", "--reasoning-parser", "glm45", "--enable-auto-tool-choice",
        "--tool-call-parser", "glm47", "--enable-prompt-tokens-details", "--enable-prefix-caching",
        "--trust-remote-code", "--port", "PORT",
        "--compilation-config", '{"cudagraph_mode":"FULL_AND_PIECEWISE","cudagraph_capture_sizes":[1]}'] + MTP3,
        "default_assistant_model", True)
    assert "vision tower" in out, out  # the checkpoint's vision tower is skipped, said once
    assert [l for l in out.splitlines() if "--speculative-config: method mtp ignored" in l and "KDA" in l], out
    assert "speculative decoding:" not in out, out  # the ready lines name no drafter
    # with n-gram drafts it serves (the CPU backend rolls the KDA state back to the last accepted draft): the
    # same chats, the same greedy replies
    serve_glm5(["--device", "cpu", "--served-model-name", "glm5-ngram", "--max-model-len", "512",
                "--max-num-seqs", "1", "--reasoning-parser", "glm45", "--enable-prefix-caching", "--port", "PORT",
                "--speculative-config",
                '{"method":"ngram","num_speculative_tokens":3,"prompt_lookup_min":1,"prompt_lookup_max":3}'],
               "glm5-ngram", True)


def test_glm5_second_command_line():
    out = serve_glm5([
        "--served-model-name", "glm53-flash-awq", "--tensor-parallel-size", "1", "--host", "127.0.0.1",
        "--port", "PORT", "--max-model-len", "512", "--no-enable-prefix-caching", "--hf-overrides",
        '{"text_config": {"index_topk": null, "index_n_heads": null, "index_head_dim": null, "index_kpool": null}}',
        "--compilation-config", "{\"cudagraph_mode\": \"FULL_DECODE_ONLY\"}", "--gpu-memory-utilization", "0.94",
        "--max-num-batched-tokens", "512", "--reasoning-parser", "glm47", "--tool-call-parser", "glm47",
        "--enable-auto-tool-choice"], "glm53-flash-awq", False)
    # on glm5_next the indexer's keys are honoured (the indexer is switched off), so none is reported
    assert not [l for l in out.splitlines() if "--hf-overrides" in l and "ignored" in l], out


def test_enforce_eager_honoured():
    # vLLM's switch for CUDA graphs: honoured (the CUDA backend captures
    # none, and its ready line says so), so neither spelling is reported as
    # ignored; the CPU backend has no graphs, so its ready line does not
    # mention it
    out = serve_and_chat(["--port", "PORT", "--enforce-eager",
                          "--compilation-config", '{"cudagraph_mode": "NONE"}'], MODEL)
    assert not [l for l in out.splitlines() if " ignored: " in l], out
    backend = lib.backend_in(out)
    assert backend, out
    if backend == "cuda":
        assert "enforce-eager: no CUDA graphs" in out, out
    else:
        assert "enforce-eager" not in out, out
    if backend == "cuda":  # without the flags the graphs are on
        assert "enforce-eager" not in serve_ready(["--port", "PORT"])


def test_hf_override_applies():
    port = free_port()
    out = serve_and_chat(["--port", "PORT", "--hf-overrides", '{"max_position_embeddings": 1024}'], MODEL)
    assert "max-model-len 1024" in out, out  # the override lowered the model's context


def test_scheduler_flags():
    """vLLM's scheduler flags: --long-prefill-token-threshold is honoured (a
    prompt's chunk per step) and the partial-prefill limits are honoured
    (checked as vLLM checks them), the others are accepted and each reported
    where sluice differs; an unknown policy is refused"""
    out = serve_and_chat(["--port", "PORT", "--long-prefill-token-threshold", "64", "--enable-chunked-prefill",
                          "--max-num-partial-prefills", "2", "--max-long-partial-prefills", "1",
                          "--scheduling-policy", "priority"], MODEL)
    lines = [l for l in out.splitlines() if " ignored: " in l]
    assert len(lines) == 1 and "--scheduling-policy" in lines[0], out
    err = run_fail(["--max-num-partial-prefills", "2", "--max-long-partial-prefills", "3"], rc=2)
    assert "--max-long-partial-prefills 3 is more than --max-num-partial-prefills 2" in err, err
    err = run_fail(["--max-num-partial-prefills", "0"], rc=2)
    assert "--max-num-partial-prefills 0 is out of range (1.." in err, err
    err = run_fail(["-i", "in.jsonl", "-o", "out.jsonl", "--max-long-partial-prefills", "2"], "run-batch", rc=2)
    assert "--max-long-partial-prefills 2 is more than --max-num-partial-prefills 1" in err, err
    out = serve_and_chat(["--port", "PORT", "--no-enable-chunked-prefill", "--scheduling-policy", "fcfs"], MODEL)
    lines = [l for l in out.splitlines() if " ignored: " in l]
    assert len(lines) == 1 and "--no-enable-chunked-prefill" in lines[0], out
    err = run_fail(["--scheduling-policy", "lifo"], rc=2)
    assert "--scheduling-policy 'lifo' is not one of fcfs, priority" in err, err
    err = run_fail(["--long-prefill-token-threshold", "-1"], rc=2)
    assert "--long-prefill-token-threshold -1 is out of range (0.." in err, err
    err = run_fail(["-i", "in.jsonl", "-o", "out.jsonl", "--long-prefill-token-threshold", "-1"], "run-batch", rc=2)
    assert "--long-prefill-token-threshold -1 is out of range (0.." in err, err


def test_malformed_json_flag():
    err = run_fail(["--compilation-config", "{cudagraph_mode: FULL"])
    assert "--compilation-config" in err and "JSON" in err, err
    err = run_fail(["--hf-overrides", "[1,2"])
    assert "--hf-overrides" in err, err


def test_unknown_flag():
    err = run_fail(["--no-such-flag", "1"])
    assert "--no-such-flag" in err, err


def test_impossible_max_model_len():
    err = run_fail(["--port", str(free_port()), "--max-model-len", "8192", "--kv-cache-memory", "16M"])
    assert "largest --max-model-len that fits is" in err, err


def test_kv_cache_dtype():
    """fp8 (vLLM's spelling, or fp8_e4m3) is the GPU's fp8 KV cache: refused at
    start-up on the CPU, as are fp8_e5m2 and unknown values, before loading"""
    for value, words in [("fp8", "needs the cuda device"), ("fp8_e4m3", "needs the cuda device"),
                         ("fp8_e5m2", "not supported"), ("int4", "unknown")]:
        err = run_fail(["--device", "cpu", "--kv-cache-dtype", value])
        assert "--kv-cache-dtype " + value in err and words in err, err


def test_human_readable_ints():
    """vLLM's human_readable_int for the token counts: k m g t decimal (with
    decimals), K M G T binary (without), int range only"""
    out = serve_ready(["--port", "PORT", "--max-model-len", "1.5k", "--max-num-batched-tokens", "1K"])
    assert "max-model-len 1500," in out and "max-num-batched-tokens 1024)" in out, out
    for cmd, extra in [("serve", []), ("run-batch", ["-i", "in.jsonl", "-o", "out.jsonl"]),
                       ("generate", ["--prompt", "hi"])]:
        err = run_fail(extra + ["--max-model-len", "1.5K"], cmd, rc=2)
        assert "'1.5K' for --max-model-len" in err and "decimals are only allowed with the lowercase" in err \
            and "did you mean 1.5k?" in err, err
    err = run_fail(["--max-num-batched-tokens", "3g"], rc=2)
    assert "'3g' for --max-num-batched-tokens" in err and "out of range (at most 2147483647)" in err, err
    err = run_fail(["--max-model-len", "32x"], rc=2)
    assert "'32x' for --max-model-len" in err and "32k" in err, err
    help_text = subprocess.run([BIN, "serve", "--help"], capture_output=True, text=True).stderr
    assert any("--max-model-len" in l and "32k" in l for l in help_text.splitlines()), help_text


def test_range_errors_name_the_flag():
    """every range check at start-up names the flag, its value and the range;
    0 for the engine sizes is refused (as in vLLM), not read as the default"""
    serve = [(["--port", "99999"], "--port 99999 is out of range (1..65535)"),
             (["--gpu-memory-utilization", "1.5"], "--gpu-memory-utilization 1.5 is out of range (above 0, at most 1)"),
             (["--max-num-seqs", "0"], "--max-num-seqs 0 is out of range (1.."),
             (["--max-num-seqs", "-4"], "--max-num-seqs -4 is out of range (1.."),
             (["--max-num-batched-tokens", "0"], "--max-num-batched-tokens 0 is out of range (1.."),
             (["--max-model-len", "0"], "--max-model-len 0 is out of range"),
             (["--block-size", "0"], "--block-size 0 is out of range (1..1024)"),
             (["--min-batch-share", "2"], "--min-batch-share 2 is out of range (0..1)"),
             (["--tensor-parallel-size", "0"], "--tensor-parallel-size 0 is out of range (at least 1)"),
             (["--max-num-seqs", "64", "--max-num-batched-tokens", "32"],
              "--max-num-batched-tokens 32 is less than --max-num-seqs 64")]
    for args, words in serve:
        err = run_fail(args, rc=2)
        assert words in err and "see --help" not in err, (args, err)
    io = ["-i", "in.jsonl", "-o", "out.jsonl"]
    for args, words in [(["--max-num-seqs", "0"], "--max-num-seqs 0 is out of range (1..65536)"),
                        (["--max-num-batched-tokens", "0"], "--max-num-batched-tokens 0 is out of range (1..1048576)"),
                        (["--gpu-memory-utilization", "0"], "--gpu-memory-utilization 0 is out of range"),
                        (["--max-num-seqs", "8", "--max-num-batched-tokens", "4"],
                         "--max-num-batched-tokens 4 is less than --max-num-seqs 8")]:
        err = run_fail(io + args, "run-batch", rc=2)
        assert words in err, (args, err)
    for args, words in [(["--top-p", "0"], "--top-p 0 is out of range (above 0, at most 1)"),
                        (["--temperature", "-1"], "--temperature -1 is out of range (at least 0)"),
                        (["--max-model-len", "8"], "--max-model-len 8 is out of range (at least 16)")]:
        err = run_fail(["--prompt", "hi"] + args, "generate", rc=2)
        assert words in err and "sampling flag" not in err, (args, err)


def test_listen_errors_say_why():
    """no stale errno ("Success"): a bad address, a name that does not
    resolve and a port in use each say what is wrong"""
    err = run_fail(["--host", "256.1.1.1", "--port", str(free_port())], rc=1)
    assert "cannot listen on 256.1.1.1:" in err and "not a valid IPv4 or IPv6 address" in err, err
    assert "Success" not in err, err
    err = run_fail(["--host", "no-such-host.invalid", "--port", str(free_port())], rc=1)
    assert "no-such-host.invalid" in err and "does not resolve" in err and "Success" not in err, err
    with socket.socket() as busy:
        busy.bind(("127.0.0.1", 0))
        busy.listen()
        port = busy.getsockname()[1]
        err = run_fail(["--port", str(port)], rc=1)
    assert f"cannot listen on 127.0.0.1:{port}: Address already in use" in err, err


def test_ready_line_example():
    """the ready line's curl example reaches the server (127.0.0.1 for a
    wildcard host) and, with --api-key, says where the key goes without
    printing it; --gpu-memory-utilization on the CPU is reported as ignored"""
    key = "s3cret-key-not-to-print"
    out = serve_ready(["--port", "PORT", "--host", "0.0.0.0", "--api-key", key, "--device", "cpu",
                       "--gpu-memory-utilization", "0.5"])
    ready = [l for l in out.splitlines() if " ready on " in l]
    tries = [l for l in out.splitlines() if l.startswith("try: curl ")]
    assert len(ready) == 1 and "http://0.0.0.0:" in ready[0], out
    assert len(tries) == 1 and "curl http://127.0.0.1:" in tries[0], out
    assert "-H \"Authorization: Bearer $SLUICE_API_KEY\"" in tries[0], out
    assert key not in out, out
    notes = [l for l in out.splitlines() if "--gpu-memory-utilization" in l and " ignored: " in l]
    assert len(notes) == 1 and "0.5 ignored" in notes[0] and "CPU" in notes[0], out
    # without a key, no Authorization header; without the flag, no notice
    out = serve_ready(["--port", "PORT", "--device", "cpu"])
    tries = [l for l in out.splitlines() if l.startswith("try: curl ")]
    assert len(tries) == 1 and "curl http://127.0.0.1:" in tries[0] and "Authorization" not in tries[0], out
    assert "--gpu-memory-utilization" not in out, out


def test_several_served_names():
    """--served-model-name a b: requests may name either, /v1/models lists
    both, replies carry the first (as vLLM); another name is a 404."""
    port = free_port()
    proc = lib.start_server(["--port", str(port), "--served-model-name", "smol", "my-alias", "--max-model-len", "512"],
                            stdout=subprocess.PIPE, text=True)
    try:
        if not lib.wait_healthy(port, proc) and proc.poll() is not None:
            raise AssertionError("server exited: " + proc.stdout.read())
        assert chat(port, "smol")["model"] == "smol"
        c = http.client.HTTPConnection("127.0.0.1", port, timeout=120)
        c.request("POST", "/v1/chat/completions", json.dumps({
            "model": "my-alias", "messages": [{"role": "user", "content": "Say hi."}], "max_tokens": 2}),
            {"Content-Type": "application/json"})
        r = c.getresponse()
        body = json.loads(r.read())
        assert r.status == 200 and body["model"] == "smol", body
        for path, want in (("/v1/models", 200), ("/v1/models/my-alias", 200), ("/v1/models/other", 404)):
            c.request("GET", path)
            r = c.getresponse()
            data = json.loads(r.read())
            assert r.status == want, (path, r.status, data)
            if path == "/v1/models":
                assert [m["id"] for m in data["data"]] == ["smol", "my-alias"], data
        c.request("POST", "/v1/chat/completions", json.dumps({
            "model": "other", "messages": [{"role": "user", "content": "Say hi."}], "max_tokens": 2}),
            {"Content-Type": "application/json"})
        r = c.getresponse()
        assert r.status == 404, r.read()
        r.read()
    finally:
        lib.stop_server(proc, timeout=30)


def main():
    if lib.missing_prereqs("test_vllm_flags"):
        return 1
    passed, failed = lib.run_tests([test_first_command_line, test_second_command_line,
                                    test_glm5_first_command_line, test_glm5_second_command_line,
                                    test_enforce_eager_honoured,
                                    test_hf_override_applies,
                                    test_scheduler_flags, test_malformed_json_flag, test_unknown_flag, test_impossible_max_model_len,
                                    test_kv_cache_dtype, test_human_readable_ints, test_range_errors_name_the_flag,
                                    test_listen_errors_say_why, test_ready_line_example,
                                    test_several_served_names])
    return lib.summary(passed, failed)


if __name__ == "__main__":
    sys.exit(main())

#!/usr/bin/env python3
"""Issue 11: the vLLM command lines our first users run start `sluice serve`
unchanged (model swapped for the default model, TP 1, lengths scaled to this
machine); ignored flags are reported one line each; bad flags are refused.

Prints one line per test and ends with "N passed, N failed".
"""
import http.client
import json
import os
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


def serve_and_chat(args, name):
    """Starts the server with args, waits for /health, chats, stops it; returns its stderr."""
    port = free_port()
    args = [a.replace("PORT", str(port)) for a in args]
    proc = lib.start_server(args, stdout=subprocess.PIPE, text=True)
    try:
        if not lib.wait_healthy(port, proc) and proc.poll() is not None:
            raise AssertionError("server exited: " + proc.stdout.read())
        chat(port, name)
    finally:
        out = lib.stop_server(proc, timeout=30)
    return out


def run_fail(args):
    p = subprocess.run([BIN, "serve", MODEL] + args, capture_output=True, text=True, timeout=120)
    assert p.returncode != 0, p
    return p.stderr


def test_first_command_line():
    out = serve_and_chat([
        "--served-model-name", "default_assistant_model", "--tensor-parallel-size", "1",
        "--gpu-memory-utilization", "0.98", "--max-model-len", "2048", "--max-num-seqs", "1",
        "--max-num-batched-tokens", "2048", "--reasoning-parser", "glm45", "--enable-auto-tool-choice",
        "--tool-call-parser", "glm47", "--enable-prompt-tokens-details", "--enable-prefix-caching",
        "--trust-remote-code", "--port", "PORT",
        "--compilation-config", '{"cudagraph_mode":"FULL_AND_PIECEWISE","cudagraph_capture_sizes":[1]}',
        "--speculative-config", '{"method":"mtp","num_speculative_tokens":3,"draft_sample_method":"greedy"}'],
        "default_assistant_model")
    lines = [l for l in out.splitlines() if " ignored: " in l]
    assert any("--compilation-config" in l and "FULL_AND_PIECEWISE" in l for l in lines), out
    assert any("--compilation-config" in l and "cudagraph_capture_sizes" in l for l in lines), out
    assert any("--speculative-config" in l and "mtp" in l for l in lines), out


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


def test_enforce_eager_honoured():
    # vLLM's switch for CUDA graphs: honoured (the CUDA backend captures
    # none), so neither spelling is reported as ignored; the CPU backend has
    # no graphs, so its ready line does not mention it
    out = serve_and_chat(["--port", "PORT", "--enforce-eager",
                          "--compilation-config", '{"cudagraph_mode": "NONE"}'], MODEL)
    assert not [l for l in out.splitlines() if " ignored: " in l], out
    assert "enforce-eager" not in out, out


def test_hf_override_applies():
    port = free_port()
    out = serve_and_chat(["--port", "PORT", "--hf-overrides", '{"max_position_embeddings": 1024}'], MODEL)
    assert "max-model-len 1024" in out, out  # the override lowered the model's context


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


def main():
    if lib.missing_prereqs("test_vllm_flags"):
        return 1
    passed, failed = lib.run_tests([test_first_command_line, test_second_command_line, test_enforce_eager_honoured,
                                    test_hf_override_applies,
                                    test_malformed_json_flag, test_unknown_flag, test_impossible_max_model_len,
                                    test_kv_cache_dtype])
    return lib.summary(passed, failed)


if __name__ == "__main__":
    sys.exit(main())

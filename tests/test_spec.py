"""Speculative decoding against the real server: --speculative-config with
n-gram drafts gives the greedy text of a server without it, streamed token by
token, and /metrics counts the drafts and the accepted ones under vLLM's names
(vllm:spec_decode_*); run-batch gives the text it gives without drafts; bad
configurations are start-up errors naming what is wrong, and the keys sluice
ignores are reported.
"""
import http.client
import json
import os
import subprocess
import sys

sys.path.insert(0, os.path.dirname(__file__))
import sluice_testlib as lib  # noqa: E402
from sluice_testlib import BIN, MODEL, free_port  # noqa: E402

NGRAM = '{"method":"ngram","num_speculative_tokens":3,"prompt_lookup_min":1,"prompt_lookup_max":4}'
# an answer that quotes its document: the model copies, and prompt lookup drafts what it copies
DOC = ("The river rose through the night, and by morning the low fields along the valley were under water. "
       "Farmers moved their animals to the hills, and the old mill by the bridge let the flood pass through its "
       "open sluice gates as it always had.")
PROMPTS = [DOC + "\n\nRepeat the text above word for word.\n\n" + DOC[:40],
           DOC + "\n\nQuote the second sentence.\n\nFarmers moved"]


def post(port, path, body):
    c = http.client.HTTPConnection("127.0.0.1", port, timeout=300)
    try:
        c.request("POST", path, json.dumps(body), {"Content-Type": "application/json"})
        r = c.getresponse()
        return r.status, r.read().decode()
    finally:
        c.close()


def metrics(port):
    c = http.client.HTTPConnection("127.0.0.1", port, timeout=30)
    try:
        c.request("GET", "/metrics")
        return lib.parse_metrics(c.getresponse().read().decode())
    finally:
        c.close()


def spec_counter(m, name):
    """The value of vllm:NAME_total (any labels), or None when absent."""
    for k, v in m.items():
        if k.startswith("vllm:" + name + "_total{"):
            return v
    return None


def run_server(args):
    """(texts of PROMPTS greedy, the streamed text of the first, /metrics before and after, the log)"""
    port = free_port()
    proc = lib.start_server(["--port", str(port), "--max-num-seqs", "4"] + args, stdout=subprocess.PIPE, text=True)
    try:
        assert lib.wait_healthy(port, proc), "server did not start: " + (proc.stdout.read() if proc.poll() is not None else "")
        before = metrics(port)
        texts = []
        for p in PROMPTS:
            st, body = post(port, "/v1/completions", {"model": MODEL, "prompt": p, "max_tokens": 40, "temperature": 0})
            assert st == 200, body
            texts.append(json.loads(body)["choices"][0]["text"])
        st, body = post(port, "/v1/completions",
                        {"model": MODEL, "prompt": PROMPTS[0], "max_tokens": 40, "temperature": 0, "stream": True})
        assert st == 200, body
        chunks = [json.loads(line[6:]) for line in body.splitlines() if line.startswith("data: {")]
        streamed = "".join(c["choices"][0]["text"] for c in chunks if c.get("choices"))
        after = metrics(port)
    finally:
        log = lib.stop_server(proc, timeout=30)
    return texts, streamed, chunks, before, after, log


def test_ngram_same_text_and_metrics():
    plain, plain_stream, _, _, plain_m, _ = run_server([])
    assert spec_counter(plain_m, "spec_decode_num_drafts") is None, "spec metrics without speculative decoding"
    texts, streamed, chunks, before, after, _ = run_server(["--speculative-config", NGRAM])
    assert texts == plain, (texts, plain)
    assert streamed == texts[0] == plain_stream, (streamed, texts[0])
    # token by token: more chunks than the verifications that made them
    drafts = spec_counter(after, "spec_decode_num_drafts") - spec_counter(before, "spec_decode_num_drafts")
    draft_tokens = spec_counter(after, "spec_decode_num_draft_tokens")
    accepted = spec_counter(after, "spec_decode_num_accepted_tokens")
    per_pos = [v for k, v in after.items() if k.startswith("vllm:spec_decode_num_accepted_tokens_per_pos_total{")]
    assert drafts > 0 and draft_tokens >= drafts, after
    assert 0 < accepted <= draft_tokens, after
    assert len(per_pos) == 3 and sum(per_pos) == accepted, per_pos
    assert all(per_pos[i] >= per_pos[i + 1] for i in range(2)), per_pos
    assert len([c for c in chunks if c.get("choices") and c["choices"][0]["text"]]) >= 20, len(chunks)
    print(f"  drafts {drafts:.0f}, draft tokens {draft_tokens:.0f}, accepted {accepted:.0f}, per position {per_pos}")


def run_fail(args):
    p = subprocess.run([BIN, "serve", MODEL, "--port", str(free_port())] + args, capture_output=True, text=True,
                       timeout=120)
    assert p.returncode != 0, p.stderr
    return p.stderr


def test_bad_configs_refused():
    err = run_fail(["--speculative-config", '{"method":"ngram","num_speculative_tokens":5}'])
    assert "num_speculative_tokens" in err and "1 to 4" in err, err
    err = run_fail(["--speculative-config", '{"method":"ngram"}'])
    assert "needs num_speculative_tokens" in err, err
    err = run_fail(["--speculative-config", '{"method":"ngram","num_speculative_tokens":2,"prompt_lookup_min":4,'
                                            '"prompt_lookup_max":2}'])
    assert "prompt_lookup_min 4 is more than prompt_lookup_max 2" in err, err
    err = run_fail(["--speculative-config", '{"method":"mtp","num_speculative_tokens":1}'])
    assert "MTP layers" in err, err


def test_ignored_keys_reported():
    port = free_port()
    cfg = '{"method":"ngram","num_speculative_tokens":2,"disable_by_batch_size":8,"model":"x"}'
    proc = lib.start_server(["--port", str(port), "--speculative-config", cfg], stdout=subprocess.PIPE, text=True)
    try:
        assert lib.wait_healthy(port, proc)
    finally:
        log = lib.stop_server(proc, timeout=30)
    assert "'disable_by_batch_size'" in log and "'model'" in log, log
    port = free_port()
    proc = lib.start_server(["--port", str(port), "--speculative-config", '{"method":"eagle","model":"m"}'],
                            stdout=subprocess.PIPE, text=True)
    try:
        assert lib.wait_healthy(port, proc)
    finally:
        log = lib.stop_server(proc, timeout=30)
    assert "method 'eagle' ignored" in log, log


def test_run_batch_same_text():
    """run-batch runs the same scheduler: greedy lines give the same text with and without n-gram drafts"""
    import tempfile
    with tempfile.TemporaryDirectory() as d:
        inp = os.path.join(d, "in.jsonl")
        with open(inp, "w") as f:
            for i, p in enumerate(PROMPTS * 2):
                f.write(json.dumps({"custom_id": f"r{i}", "method": "POST", "url": "/v1/completions",
                                    "body": {"prompt": p, "max_tokens": 24 + 4 * i, "temperature": 0}}) + "\n")
        texts = []
        for extra in ([], ["--speculative-config", NGRAM]):
            out = os.path.join(d, "out.jsonl")
            p = subprocess.run([BIN, "run-batch", "--model", MODEL, "-i", inp, "-o", out, "--quiet",
                                "--max-model-len", "1024"] + extra, capture_output=True, text=True, timeout=600)
            assert p.returncode == 0, p.stderr
            with open(out) as f:
                texts.append([json.loads(l)["response"]["body"]["choices"][0]["text"] for l in f])
        assert texts[0] == texts[1] and all(texts[0]), texts


def main():
    if lib.missing_prereqs("test_spec"):
        return 1
    passed, failed = lib.run_tests([test_ngram_same_text_and_metrics, test_bad_configs_refused,
                                    test_ignored_keys_reported, test_run_batch_same_text])
    return lib.summary(passed, failed)


if __name__ == "__main__":
    sys.exit(main())

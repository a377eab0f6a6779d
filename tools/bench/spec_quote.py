#!/usr/bin/env python3
"""Decode speed on a summarisation-like workload whose answers quote their
document (what n-gram drafts are for), against a running server: sluice
serve with and without --speculative-config, or vLLM.

    python3 tools/bench/spec_quote.py --url http://127.0.0.1:8011 [--requests 6] [--concurrency 1]
                                      [--max-tokens 128] [--doc tools/bench/corpus/python-reference.txt] [--doc-chars 2400]

Each request is a greedy streamed chat: a slice of the document, then "quote
its first two paragraphs word for word". Prints, per request and on average,
the decode speed ((completion tokens - 1) / (end - first token)), and from
/metrics the drafts, the mean accepted length (1 + accepted / drafts) and the
acceptance per position (vLLM's vllm:spec_decode_* counters; absent without
speculative decoding). Not a test: a benchmark tool, standard library only.
"""
import argparse
import http.client
import json
import os
import threading
import time
import urllib.parse

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def conn(url, timeout=600):
    u = urllib.parse.urlparse(url)
    return http.client.HTTPConnection(u.hostname, u.port or 80, timeout=timeout)


def spec_counters(url):
    c = conn(url, 30)
    c.request("GET", "/metrics")
    text = c.getresponse().read().decode()
    c.close()
    out = {"drafts": 0.0, "draft_tokens": 0.0, "accepted": 0.0, "pos": {}}
    found = False
    for line in text.splitlines():
        if line.startswith("#") or " " not in line:
            continue
        k, v = line.rsplit(" ", 1)
        for key, name in (("drafts", "vllm:spec_decode_num_drafts_total"),
                          ("draft_tokens", "vllm:spec_decode_num_draft_tokens_total"),
                          ("accepted", "vllm:spec_decode_num_accepted_tokens_total")):
            if k == name or k.startswith(name + "{"):
                out[key] += float(v)
                found = True
        if k.startswith("vllm:spec_decode_num_accepted_tokens_per_pos_total{") and 'position="' in k:
            p = int(k.split('position="')[1].split('"')[0])
            out["pos"][p] = out["pos"].get(p, 0.0) + float(v)
    return out if found else None


def first_model(url):
    c = conn(url, 30)
    c.request("GET", "/v1/models")
    m = json.loads(c.getresponse().read())["data"][0]["id"]
    c.close()
    return m


def one(url, model, doc, max_tokens, res):
    body = {"model": model, "stream": True, "stream_options": {"include_usage": True}, "temperature": 0,
            "max_tokens": max_tokens,
            "messages": [{"role": "user", "content": doc + "\n\nQuote the first two paragraphs of the document above "
                                                          "word for word."}]}
    c = conn(url)
    t0 = time.time()
    c.request("POST", "/v1/chat/completions", json.dumps(body), {"Content-Type": "application/json"})
    r = c.getresponse()
    first = None
    usage = None
    text = []
    for raw in r:
        line = raw.decode().strip()
        if not line.startswith("data: ") or line == "data: [DONE]":
            continue
        ev = json.loads(line[6:])
        if ev.get("usage"):
            usage = ev["usage"]
        for ch in ev.get("choices", []):
            piece = ch.get("delta", {}).get("content")
            if piece:
                if first is None:
                    first = time.time()
                text.append(piece)
    end = time.time()
    c.close()
    n = usage["completion_tokens"] if usage else 0
    res.update(ttft=(first or end) - t0, total=end - t0, c_tok=n,
               decode_tok_s=(n - 1) / (end - first) if first and n > 1 and end > first else float("nan"),
               text="".join(text))


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--url", default="http://127.0.0.1:8000")
    ap.add_argument("--requests", type=int, default=6)
    ap.add_argument("--concurrency", type=int, default=1)
    ap.add_argument("--max-tokens", type=int, default=128)
    ap.add_argument("--doc", default=os.path.join(ROOT, "tools", "bench", "corpus", "python-reference.txt"))
    ap.add_argument("--doc-chars", type=int, default=2400)
    a = ap.parse_args()
    text = open(a.doc).read()
    model = first_model(a.url)
    docs = []
    for i in range(a.requests):
        off = (i * 40009) % max(1, len(text) - a.doc_chars)
        off = text.rfind("\n\n", 0, off) + 2 if off else 0  # start at a paragraph
        docs.append(text[off:off + a.doc_chars])
    before = spec_counters(a.url)
    results = [dict() for _ in docs]
    t0 = time.time()
    pending = list(range(len(docs)))
    lock = threading.Lock()

    def worker():
        while True:
            with lock:
                if not pending:
                    return
                i = pending.pop(0)
            one(a.url, model, docs[i], a.max_tokens, results[i])

    ths = [threading.Thread(target=worker) for _ in range(a.concurrency)]
    for t in ths:
        t.start()
    for t in ths:
        t.join()
    wall = time.time() - t0
    after = spec_counters(a.url)
    for i, r in enumerate(results):
        print(f"request {i + 1}: {r['c_tok']} tokens, TTFT {r['ttft']:.2f} s, decode {r['decode_tok_s']:.2f} tok/s")
    rates = [r["decode_tok_s"] for r in results if r["decode_tok_s"] == r["decode_tok_s"]]
    out_tok = sum(r["c_tok"] for r in results)
    print(f"mean decode tok/s\t{sum(rates) / len(rates):.2f}")
    print(f"output tok/s (wall)\t{out_tok / wall:.2f}")
    if before and after:
        d = after["drafts"] - before["drafts"]
        dt = after["draft_tokens"] - before["draft_tokens"]
        acc = after["accepted"] - before["accepted"]
        pos = [(after["pos"].get(p, 0) - before["pos"].get(p, 0)) / d if d else 0 for p in sorted(after["pos"])]
        print(f"drafts\t{d:.0f} ({dt:.0f} draft tokens, {acc:.0f} accepted)")
        print(f"mean accepted length\t{1 + acc / d if d else float('nan'):.3f}")
        print(f"acceptance\t{acc / dt if dt else float('nan'):.3f}")
        print("acceptance per position\t" + " ".join(f"{p:.3f}" for p in pos))
    print("first answer: " + results[0]["text"][:300].replace("\n", " "))


if __name__ == "__main__":
    main()

#!/usr/bin/env python3
"""Writes the run-batch benchmark inputs of BENCHMARKS.md (issue 3):
  in64.jsonl   64 chat requests (questions from the bench corpus), max_tokens 32, greedy, ignore_eos
  rep2k.jsonl  3 identical completions requests with a ~1.9K-token prompt, max_tokens 1
usage: python3 tools/bench/make_batch_inputs.py OUTDIR
"""
import json, os, sys

out = sys.argv[1]
os.makedirs(out, exist_ok=True)
root = os.path.dirname(os.path.abspath(__file__))
corpus = open(os.path.join(root, "corpus", "python-reference.txt"), encoding="utf-8").read()
paras = [p.strip() for p in corpus.split("\n\n") if 80 < len(p.strip()) < 600]
with open(os.path.join(out, "in64.jsonl"), "w") as f:
    for i in range(64):
        body = {"model": "smol", "messages": [{"role": "user", "content": "Explain briefly: " + paras[i * 7]}],
                "max_tokens": 32, "temperature": 0, "ignore_eos": True}
        f.write(json.dumps({"custom_id": f"q{i}", "method": "POST", "url": "/v1/chat/completions",
                            "body": body}) + "\n")
doc = corpus[:8000]
with open(os.path.join(out, "rep2k.jsonl"), "w") as f:
    for i in range(3):
        body = {"model": "smol", "prompt": doc, "max_tokens": 1, "temperature": 0}
        f.write(json.dumps({"custom_id": f"r{i}", "method": "POST", "url": "/v1/completions", "body": body}) + "\n")

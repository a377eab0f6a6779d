#!/usr/bin/env bash
# many_seqs_run.sh - run-batch on CUDA with --max-num-seqs 1024 (decode
# graphs up to 1024 sequences: attention grids of 32768 items) against 64,
# tiny-qwen3, 1100 greedy requests; prints how many completions match and
# any failed lines. Logs under $1.
. "$(dirname "$0")/run_lib.sh"
python3 - "$L" <<'PY'
import json, random, sys
random.seed(11)
with open(f"{sys.argv[1]}/req.jsonl", "w") as f:
    for i in range(1100):
        text = f"Item {i}: " + " ".join(random.choice("alpha beta gamma delta river stone light".split()) for _ in range(3 + i % 9))
        body = {"model": "m", "messages": [{"role": "user", "content": text}], "max_tokens": 12, "temperature": 0}
        f.write(json.dumps({"custom_id": f"r{i}", "method": "POST", "url": "/v1/chat/completions", "body": body}) + "\n")
PY
for n in 1024 64; do
    a=$(date +%s)
    build/sluice run-batch --model tests/models/tiny-qwen3 --served-model-name m -i "$L/req.jsonl" -o "$L/out_$n.jsonl" \
        --device cuda --max-num-seqs $n --max-num-batched-tokens 8192 --quiet > "$L/rb_$n.log" 2>&1
    echo "max-num-seqs $n rc=$? $(( $(date +%s) - a ))s, $(wc -l < "$L/out_$n.jsonl") lines"
done
python3 - "$L" <<'PY'
import json, sys
L = sys.argv[1]
def load(n):
    r = {}
    for line in open(f"{L}/out_{n}.jsonl"):
        d = json.loads(line)
        b = (d.get("response") or {}).get("body") or {}
        r[d["custom_id"]] = (d.get("error"), b.get("choices", [{}])[0].get("message", {}).get("content"))
    return r
a, b = load(1024), load(64)
err = sum(1 for v in a.values() if v[0] or v[1] is None)
same = sum(1 for k in a if k in b and a[k] == b[k])
print(f"1024: {len(a)} results, {err} failed; identical to 64: {same} of {len(a)}")
PY

#!/usr/bin/env bash
# run_batch_gpu.sh - the CUDA backend under the real scheduler (run on a GPU host).
#  1. tiny-qwen3: the same greedy batch through `run-batch` on cpu and on cuda;
#     reports how many completions are identical (differences only at near-ties).
#  2. offline throughput (issue 6): N requests (default 1000) of ~1000 prompt
#     tokens and 1000 output tokens (ignore_eos) on the Llama-3.1-8B shape with
#     dummy weights; prints output tok/s.
# Usage: tests/gpu/run_batch_gpu.sh [N] [outdir]
#   RB_TP=2: the 8B run at --tensor-parallel-size 2; RB_SKIP_SMALL=1: skip part 1;
#   RB_FLAGS: more run-batch flags for the 8B run (e.g. --kv-cache-dtype fp8).
set -u
N=${1:-1000}
OUT=${2:-/tmp/rb_gpu}
mkdir -p "$OUT"
S=build/sluice
python3 - "$OUT" "$N" <<'PY'
import json, random, sys
out, n = sys.argv[1], int(sys.argv[2])
random.seed(7)
words = ("the of and to in is was for on that with as by at from his her they this which were "
         "river mountain city language science music history water light system market energy "
         "people story garden window morning winter number paper island").split()
with open(f"{out}/small.jsonl", "w") as f:
    for i in range(24):
        text = f"Request {i}: " + " ".join(random.choice(words) for _ in range(5 + 13 * (i % 7)))
        body = {"model": "m", "messages": [{"role": "user", "content": text}], "max_tokens": 48, "temperature": 0}
        f.write(json.dumps({"custom_id": f"s{i}", "method": "POST", "url": "/v1/chat/completions", "body": body}) + "\n")
with open(f"{out}/big.jsonl", "w") as f:
    for i in range(n):
        text = f"{i} " + " ".join(random.choice(words) for _ in range(980))
        body = {"model": "m", "messages": [{"role": "user", "content": text}], "max_tokens": 1000,
                "temperature": 0, "ignore_eos": True}
        f.write(json.dumps({"custom_id": f"b{i}", "method": "POST", "url": "/v1/chat/completions", "body": body}) + "\n")
PY
for dev in $([ "${RB_SKIP_SMALL:-0}" = 1 ] || echo cpu cuda); do
    $S run-batch --model tests/models/tiny-qwen3 --served-model-name m -i "$OUT/small.jsonl" -o "$OUT/small_$dev.jsonl" \
        --device $dev --max-num-seqs 16 --quiet || echo "run-batch $dev failed"
done
[ "${RB_SKIP_SMALL:-0}" = 1 ] || python3 - "$OUT" <<'PY'
import json, sys
out = sys.argv[1]
def load(p):
    r = {}
    for line in open(p):
        o = json.loads(line)
        b = (o.get("response") or {}).get("body") or {}
        r[o["custom_id"]] = b.get("choices", [{}])[0].get("message", {}).get("content")
    return r
a, b = load(f"{out}/small_cpu.jsonl"), load(f"{out}/small_cuda.jsonl")
same = sum(1 for k in a if a[k] is not None and a[k] == b.get(k))
print(f"run-batch tiny-qwen3 greedy: {same} of {len(a)} completions identical on cpu and cuda")
PY
start=$(date +%s.%N)
timeout ${RB_TIMEOUT:-3000} $S run-batch --model tools/configs/llama-3.1-8b --load-format dummy --tokenizer tests/models/tiny-qwen3 \
    --served-model-name m -i "$OUT/big.jsonl" -o "$OUT/big_out.jsonl" --device cuda --tensor-parallel-size ${RB_TP:-1} --max-num-seqs 256 \
    --max-num-batched-tokens 8192 --max-model-len 2304 --kv-cache-memory 80G --quiet ${RB_FLAGS:-} || echo "run-batch 8B failed"
end=$(date +%s.%N)
python3 - "$OUT" "$start" "$end" <<'PY'
import json, sys
out, t0, t1 = sys.argv[1], float(sys.argv[2]), float(sys.argv[3])
pt = ct = n = 0
for line in open(f"{out}/big_out.jsonl"):
    o = json.loads(line)
    u = ((o.get("response") or {}).get("body") or {}).get("usage") or {}
    pt += u.get("prompt_tokens", 0); ct += u.get("completion_tokens", 0); n += 1
dt = t1 - t0
print(f"run-batch Llama-3.1-8B shape (dummy, bf16, TP={__import__('os').environ.get('RB_TP', '1')} {__import__('os').environ.get('RB_FLAGS', '')}): {n} requests, {pt} prompt + {ct} output tokens in {dt:.1f} s "
      f"(load included): {ct/dt:.0f} output tok/s, {(pt+ct)/dt:.0f} total tok/s")
PY

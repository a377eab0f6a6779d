#!/usr/bin/env bash
# final15_run.sh LOGDIR - the fifteenth round's last call (best on a 2-GPU
# host): make gpu-test's suite; --enforce-eager against the default (CUDA
# graphs) through run-batch on tiny-qwen3 (300 greedy requests: outputs
# identical, times) and serve's ready line; bench_gpu (TP=1).
. "$(dirname "$0")/run_lib.sh"
nvidia-smi -L
a=$(date +%s); BUILD=build timeout -k 5 420 tests/gpu/run_gpu_tests.sh > "$L/gpu_test.log" 2>&1
echo "gpu-test rc=$? $(( $(date +%s) - a ))s: $(tail -1 "$L/gpu_test.log")"
grep -E "FAIL|near-ties \(|failed:" "$L/gpu_test.log" | sort | uniq -c | head -20
python3 - "$L" <<'PY'
import json, random, sys
random.seed(5)
with open(f"{sys.argv[1]}/req.jsonl", "w") as f:
    for i in range(300):
        text = f"Note {i}: " + " ".join(random.choice("north wind paper lamp orbit seed glass".split()) for _ in range(4 + i % 11))
        body = {"model": "m", "messages": [{"role": "user", "content": text}], "max_tokens": 48, "temperature": 0}
        f.write(json.dumps({"custom_id": f"r{i}", "method": "POST", "url": "/v1/chat/completions", "body": body}) + "\n")
PY
for m in graphs eager; do
  x=; [ $m = eager ] && x=--enforce-eager
  a=$(date +%s.%N)
  timeout -k 5 120 build/sluice run-batch --model tests/models/tiny-qwen3 --served-model-name m -i "$L/req.jsonl" \
      -o "$L/out_$m.jsonl" --device cuda --max-num-seqs 64 --quiet $x > "$L/rb_$m.log" 2>&1
  echo "run-batch $m rc=$? $(python3 -c "print(round($(date +%s.%N) - $a, 2))") s, $(wc -l < "$L/out_$m.jsonl") lines"
done
python3 - "$L" <<'PY'
import json, sys
L = sys.argv[1]
def load(m):
    r = {}
    for line in open(f"{L}/out_{m}.jsonl"):
        d = json.loads(line)
        b = (d.get("response") or {}).get("body") or {}
        r[d["custom_id"]] = (d.get("error"), b.get("choices", [{}])[0].get("message", {}).get("content"))
    return r
a, b = load("graphs"), load("eager")
bad = sum(1 for v in list(a.values()) + list(b.values()) if v[0] or v[1] is None)
same = sum(1 for k in a if k in b and a[k] == b[k])
print(f"eager vs graphs: {same} of {len(a)} identical, {bad} failed")
PY
timeout -k 5 60 build/sluice serve tests/models/tiny-qwen3 --device cuda --port 8321 --enforce-eager > "$L/serve_eager.log" 2>&1 &
for i in $(seq 60); do grep -q "ready on" "$L/serve_eager.log" && break; sleep 1; done
grep -o "backend cuda.*graphs)" "$L/serve_eager.log"; kill %1 2>/dev/null; wait
t bench 150 build/tests/gpu/bench_gpu
grep -E "decode|prefill" "$L/bench.log" | sed -E 's/; floor.*//'

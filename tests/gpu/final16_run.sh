#!/usr/bin/env bash
# final16_run.sh LOGDIR - the sixteenth round's verification (best on a
# 2-GPU host): make gpu-test's suite; the rank-failure test; serve with a
# step budget below the warm-up's chunk (--max-num-batched-tokens 4) and a
# short context (--max-model-len 64): it must start and answer; bench_gpu.
. "$(dirname "$0")/run_lib.sh"
nvidia-smi -L
a=$(date +%s); BUILD=build timeout -k 5 420 tests/gpu/run_gpu_tests.sh > "$L/gpu_test.log" 2>&1
echo "gpu-test rc=$? $(( $(date +%s) - a ))s: $(tail -1 "$L/gpu_test.log")"
grep -E "FAIL|near-ties \(|failed:" "$L/gpu_test.log" | sort | uniq -c | head -20
if [ "$ngpu" -ge 2 ]; then
  FAULT_ONLY=1 timeout -k 5 90 tests/gpu/tp_check.sh 2 "$L/fault" > "$L/fault.log" 2>&1
  echo "fault rc=$?"; tail -3 "$L/fault.log"
fi
for cfg in "--max-num-batched-tokens 4" "--max-model-len 64" "--max-num-batched-tokens 4 --max-num-seqs 2 --max-model-len 40"; do
  n=$(echo "$cfg" | tr -dc 'a-z0-9')
  timeout -k 5 60 build/sluice serve tests/models/tiny-qwen3 --device cuda --port 8322 $cfg > "$L/serve_$n.log" 2>&1 &
  for i in $(seq 60); do grep -q "ready on" "$L/serve_$n.log" && break; sleep 1; done
  r=$(curl -s -m 20 localhost:8322/v1/chat/completions -H 'content-type: application/json' \
      -d '{"model":"tests/models/tiny-qwen3","messages":[{"role":"user","content":"hi there"}],"max_tokens":8}' | head -c 300)
  echo "serve $cfg: $(grep -c 'ready on' "$L/serve_$n.log") ready; $(grep -i 'warm' "$L/serve_$n.log" | head -2); reply: $r"
  kill %1 2>/dev/null; wait
done
t bench 150 build/tests/gpu/bench_gpu
grep -E "decode|prefill" "$L/bench.log" | sed -E 's/; floor.*//'

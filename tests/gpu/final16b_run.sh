#!/usr/bin/env bash
# final16b_run.sh LOGDIR - the sixteenth round's second call: make
# gpu-test's suite on this tree (server and tokenizer changes), then chat
# beside a saturating Batch API job (chat_beside_batch_run.sh).
. "$(dirname "$0")/run_lib.sh"
nvidia-smi -L
a=$(date +%s); BUILD=build timeout -k 5 330 tests/gpu/run_gpu_tests.sh > "$L/gpu_test.log" 2>&1
echo "gpu-test rc=$? $(( $(date +%s) - a ))s: $(tail -1 "$L/gpu_test.log")"
grep -E "FAIL|near-ties \(|failed:" "$L/gpu_test.log" | sort | uniq -c | head -20
LIMIT=240 "$(dirname "$0")/chat_beside_batch_run.sh" "$L/cbb"

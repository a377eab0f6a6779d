#!/usr/bin/env bash
# final16c_run.sh LOGDIR - chat beside a saturating batch job
# (chat_beside_batch_run.sh) with --batch-step-tokens 0 (batch prefill fills
# the whole 8192-token step budget, as before the flag) and at its default
# 2048: batch prompts of ~1000 tokens, then of ~3000 (long documents: most
# steps carry batch prefill).
. "$(dirname "$0")/run_lib.sh"
nvidia-smi -L
for cfg in ${CFGS:-1000:0 1000:2048 3000:0 3000:2048}; do
  set -- ${cfg/:/ }
  echo "== batch prompts ~$1 tokens, --batch-step-tokens $2"
  BP=$1 BO=${BO:-128} R=${R:-100} LIMIT=200 SERVE_FLAGS="--batch-step-tokens $2" \
      "$(dirname "$0")/chat_beside_batch_run.sh" "$L/cbb_$1_$2" 2>&1 | grep -E "idle|beside|during|running|rc="
  rm -rf "$L/cbb_$1_$2/data"
done

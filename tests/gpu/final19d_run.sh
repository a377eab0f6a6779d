#!/usr/bin/env bash
# final19d_run.sh LOGDIR - the batch's yield to a chat's prompt (sched
# batch_yield, on by default; SLUICE_BATCH_YIELD=0 off): chat beside a
# saturating Batch API job of ~3000-token prompts (chat_beside_batch_run.sh,
# --batch-step-tokens 2048, R running sequences, C chats), alternating,
# ROUNDS times.
. "$(dirname "$0")/run_lib.sh"
nvidia-smi -L
for r in $(seq ${ROUNDS:-2}); do
  for y in 1 0; do
    echo "== SLUICE_BATCH_YIELD=$y, round $r"
    SLUICE_BATCH_YIELD=$y BP=3000 BO=128 R=${R:-60} C=${C:-8} LIMIT=150 SERVE_FLAGS="--batch-step-tokens 2048" \
        "$(dirname "$0")/chat_beside_batch_run.sh" "$L/y${y}_$r" 2>&1 | grep -E "beside|during|rc="
    rm -rf "$L/y${y}_$r/data"
  done
done

#!/usr/bin/env bash
# final18b_run.sh LOGDIR - the weighed batch step cap on the final tree:
# chat beside a batch of ~100K-token documents (long_chat_run.sh, the
# default cap only), then beside ~3000-token prompts as the sixteenth round
# measured (final16c_run.sh with --batch-step-tokens 2048).
. "$(dirname "$0")/run_lib.sh"
BENCH=0 KS=model B=6 BP=90000 bash "$(dirname "$0")/long_chat_run.sh" "$L/long"
CFGS="3000:2048" bash "$(dirname "$0")/final16c_run.sh" "$L/short"

#!/usr/bin/env bash
# final19_run.sh LOGDIR - the nineteenth round on one H200: test_gpu_e2e
# (with the dummy head_dim-128 model of 2 KV heads), the engine suite on
# CUDA (the scheduler's new rules run under it), then
# long_prompt_chat_run.sh over CONFIGS (e.g. with build/sluice_prev, the
# tree before this round).
. "$(dirname "$0")/run_lib.sh"
nvidia-smi -L
t e2e 150 build/tests/gpu/test_gpu_e2e
grep -E "FAIL|failed:|dummy|tokens .* over" "$L/e2e.log" | head -20
t engine 120 env SLUICE_TEST_DEVICE=cuda SLUICE_TEST_MODEL=tests/models/tiny-qwen3 build/tests/test_engine
"$(dirname "$0")/long_prompt_chat_run.sh" "$L/lp"

#!/usr/bin/env bash
# x2_19b_run.sh LOGDIR - on two H200s: TP=2 end to end (vs CPU/HF, vs TP=1;
# the dummy model of 2 KV heads reaches the split long tiles of head_dim
# 128), the engine suite at TP=2, then long_prompt_chat_run.sh over CONFIGS
# on GPU 0.
. "$(dirname "$0")/run_lib.sh"
nvidia-smi -L
t e2e_tp2 120 env SLUICE_TEST_TP=2 build/tests/gpu/test_gpu_e2e
t e2e_tp2_vs_tp1 120 env SLUICE_TEST_TP=2 SLUICE_TEST_REF=cuda build/tests/gpu/test_gpu_e2e
grep -A3 -E "^dummy" "$L/e2e_tp2.log" "$L/e2e_tp2_vs_tp1.log"
t engine_tp2 90 env SLUICE_TEST_DEVICE=cuda SLUICE_TEST_MODEL=tests/models/tiny-qwen3 SLUICE_TEST_TP=2 build/tests/test_engine
grep -E "FAIL|failed:" "$L"/e2e_tp2*.log "$L/engine_tp2.log" | head
CUDA_VISIBLE_DEVICES=0 "$(dirname "$0")/long_prompt_chat_run.sh" "$L/lp"

#!/usr/bin/env bash
# x2_19_run.sh LOGDIR - the nineteenth round's verification on two H200s:
# make gpu-test (run_gpu_tests.sh: with 2 GPUs the TP=2 runs, which now
# reach the split long tiles of head_dim 128 through the dummy model of 2
# KV heads), then long_prompt_chat_run.sh over CONFIGS on GPU 0.
. "$(dirname "$0")/run_lib.sh"
nvidia-smi -L
a=$(date +%s)
BUILD=build timeout -k 5 ${GPU_TEST_SECS:-360} tests/gpu/run_gpu_tests.sh >"$L/gpu_test.log" 2>&1
echo "gpu-test rc=$? $(($(date +%s) - a))s: $(tail -1 "$L/gpu_test.log")"
grep -E "^== |FAIL|failed:|^note|dummy|over 800 cached" "$L/gpu_test.log" | grep -vE "^== .*passed" | head -60
CUDA_VISIBLE_DEVICES=0 "$(dirname "$0")/long_prompt_chat_run.sh" "$L/lp"

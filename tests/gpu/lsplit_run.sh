#!/usr/bin/env bash
# lsplit_run.sh LOGDIR - after the long-tile split (cuda_backend.c
# long_splits, partials at the step's stride): the kernel tests (memcheck on
# the stride tests), end to end, then long_chat_run.sh: 64K-token prompts in
# short chunks with and without the split, and chat beside a batch of long
# documents with the weighed step cap.
. "$(dirname "$0")/run_lib.sh"
nvidia-smi -L
t kernels 240 build/tests/gpu/test_kernels
t memcheck 120 env SLUICE_TEST_ONLY=pstride compute-sanitizer --tool memcheck build/tests/gpu/test_kernels
t e2e 150 build/tests/gpu/test_gpu_e2e
grep -E "over [0-9]+ cached|^FAIL|failed:" "$L/e2e.log" | head -20
CHUNKS=${CHUNKS:-512 700 2048} LKS=${LKS:-0 4096} KS=${KS:-model} bash "$(dirname "$0")/long_chat_run.sh" "$L/lc"

#!/usr/bin/env bash
# final18_run.sh LOGDIR - the eighteenth round's tree: make gpu-test (one
# GPU), then bench_gpu's headline figures (prefill step, TTFT, decode).
. "$(dirname "$0")/run_lib.sh"
nvidia-smi -L
t gputest 420 env BUILD=build tests/gpu/run_gpu_tests.sh
grep -E "^== |passed, [0-9]+ failed$|^FAIL|near-ties" "$L/gputest.log" | grep -B1 -E "failed$|FAIL|near" | tail -40
t bench 150 build/tests/gpu/bench_gpu
grep -E "prefill|TTFT|decode batch" "$L/bench.log" | head -12

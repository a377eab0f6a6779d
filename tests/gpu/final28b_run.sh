#!/usr/bin/env bash
# final28b_run.sh LOGDIR P2 - the round's last tree: make gpu-test with the
# default model (second xz part P2, run_lib.sh's default_model); decode at
# batches 1, 1, 8, 64, 256 against the tree before the persistent gate/up
# GEMV (build/old_bench_gpu, 8ec5ffa), alternating; bench_gpu.
. "$(dirname "$0")/run_lib.sh"
nvidia-smi -L
default_model "$2"
gpu_test
grep -E "sampled token|smollm2|prompt [0-9]: greedy" "$L/gpu_test.log" | tail -8
builds_decode 2 old_bench_gpu tests/gpu/bench_gpu
timeout -k 5 200 build/tests/gpu/bench_gpu >"$L/bench.log" 2>&1
echo "bench_gpu rc=$?:"; grep -E "prefill|TTFT|decode batch 1 " "$L/bench.log"

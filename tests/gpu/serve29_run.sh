#!/usr/bin/env bash
# serve29_run.sh LOGDIR P2 - make gpu-test's runner with the default model
# (run_lib.sh's default_model, second xz part P2) and the openai client
# from carried wheels (.whl, README of the device tool), so that the Python
# integration tests (server, Batch API, flags) run against servers on the
# GPU, with the kernel, e2e and engine suites. The model is left in
# /tmp/keep/model.gguf for a next call on the same warm host. BENCH=1: then
# bench_gpu (TTFT, the 16K prefill step, batch-1 decode). PY_ONLY=1
# (passed on to run_gpu_tests.sh): only the Python suites and the backend
# check.
. "$(dirname "$0")/run_lib.sh"
nvidia-smi -L
if [ -d .whl ]; then
    python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl &&
        export PYTHONPATH=/tmp/site
fi
python3 -c 'import openai; print("openai", openai.__version__)'
default_model "$2"
cp models/SmolLM2-135M-Instruct.Q4_1.gguf /tmp/keep/model.gguf 2>/dev/null
GPU_TEST_SECS=${GPU_TEST_SECS:-540} gpu_test
awk '/^== /{r=substr($0,4,110)} /^[0-9]+ passed, [0-9]+ failed$/{print $0 "  <- " r}' "$L/gpu_test.log"
grep -h "near-tie at\|sampled split at\|kill -9\|chat TTFT" "$L/gpu_test.log"
if [ -n "${BENCH:-}" ]; then
    timeout -k 5 200 build/tests/gpu/bench_gpu >"$L/bench.log" 2>&1
    echo "bench_gpu rc=$?:"; grep -E "prefill|TTFT|decode batch 1 " "$L/bench.log"
fi

#!/usr/bin/env bash
# run_gpu_tests.sh - what `make gpu-test` runs on a GPU host: every
# tests/gpu/test_* binary, the engine suite (batch invariance, chunked
# prefill, prefix reuse, preemption) on the CUDA backend (again with the fp8
# KV cache; tiny-qwen3 and tiny-qwen3-d128, whose head_dim 128 takes the
# warpgroup prefill attention), and with 2+ GPUs the
# tensor-parallel runs (TP=2 vs CPU/HF, TP=2 vs TP=1, the engine at TP=2,
# and the first and last again with the fused gate|up on every step), and
# with the default model the Python integration tests (server, Batch API,
# flags) against servers on the GPU (with 2+ GPUs the server and Batch API
# ones again at TP=2; PY_ONLY=1: the Python ones alone).
# Ends with one line "N passed, N failed".
set -u
export NCCL_NVLS_ENABLE=${NCCL_NVLS_ENABLE:-0}
B=${BUILD:-build}
MODEL=models/SmolLM2-135M-Instruct.Q4_1.gguf
ngpu=$(nvidia-smi -L 2>/dev/null | grep -c '^GPU' || true)
runs=()
for t in "$B"/tests/gpu/test_*; do runs+=("$t"); done
if [ -f "$MODEL" ]; then runs+=("SLUICE_TEST_DEVICE=cuda $B/tests/test_engine")
else runs+=("SLUICE_TEST_DEVICE=cuda SLUICE_TEST_MODEL=tests/models/tiny-qwen3 $B/tests/test_engine"); fi
runs+=("SLUICE_TEST_KV=fp8 SLUICE_TEST_DEVICE=cuda SLUICE_TEST_MODEL=tests/models/tiny-qwen3 $B/tests/test_engine")
# head_dim 128 (the warpgroup prefill attention on sm_90), with each KV cache
runs+=("SLUICE_TEST_DEVICE=cuda SLUICE_TEST_MODEL=tests/models/tiny-qwen3-d128 $B/tests/test_engine"
       "SLUICE_TEST_KV=fp8 SLUICE_TEST_DEVICE=cuda SLUICE_TEST_MODEL=tests/models/tiny-qwen3-d128 $B/tests/test_engine")
# the fused gate|up GEMM (sm_90) serves steps of 128+ tokens: once more
# with it on every step of 5+ tokens, end to end and in the engine suite
runs+=("SLUICE_CUDA_GEMM_WG_MIN_T=1 $B/tests/gpu/test_gpu_e2e"
       "SLUICE_CUDA_GEMM_WG_MIN_T=1 SLUICE_TEST_DEVICE=cuda SLUICE_TEST_MODEL=tests/models/tiny-qwen3 $B/tests/test_engine")
if [ "${ngpu:-0}" -ge 2 ]; then
    runs+=("SLUICE_TEST_TP=2 $B/tests/gpu/test_gpu_e2e"
           "SLUICE_TEST_TP=2 SLUICE_TEST_REF=cuda $B/tests/gpu/test_gpu_e2e"
           "SLUICE_TEST_TP=2 SLUICE_TEST_DEVICE=cuda SLUICE_TEST_MODEL=tests/models/tiny-qwen3 $B/tests/test_engine"
           "SLUICE_TEST_TP=2 SLUICE_CUDA_GEMM_WG_MIN_T=1 $B/tests/gpu/test_gpu_e2e"
           "SLUICE_TEST_TP=2 SLUICE_CUDA_GEMM_WG_MIN_T=1 SLUICE_TEST_DEVICE=cuda SLUICE_TEST_MODEL=tests/models/tiny-qwen3 $B/tests/test_engine")
fi
# the HTTP server, the Batch API's queue and the vLLM flags served on this
# GPU (the default device where one is present): the Python integration
# tests with the default model, when it and the openai client are here
# (test_chat_rules pins --device cpu and stays out); then one check that
# every server they logged ran on the cuda backend
py_logs="build/test_server.log build/test_batch_*.log build/test_chat_tools.log build/test_bench.log"
if [ -n "${PY_ONLY:-}" ]; then runs=(); fi # PY_ONLY=1: these alone
if [ -f "$MODEL" ] && python3 -c 'import openai' 2>/dev/null; then
    rm -f $py_logs
    for py in tests/test_*.py; do
        case $py in *test_chat_rules.py) continue ;; esac
        runs+=("SLUICE_BIN=$B/sluice PYTHONUNBUFFERED=1 python3 $py")
    done
    runs+=("bash tests/gpu/backend_check.sh cuda $py_logs")
    if [ "${ngpu:-0}" -ge 2 ]; then # the server and the Batch API at TP=2 (their logs: the check above has read them)
        runs+=("SLUICE_TEST_SERVE_ARGS=--tensor-parallel-size=2 SLUICE_BIN=$B/sluice PYTHONUNBUFFERED=1 python3 tests/test_server.py"
               "SLUICE_TEST_SERVE_ARGS=--tensor-parallel-size=2 SLUICE_BIN=$B/sluice PYTHONUNBUFFERED=1 python3 tests/test_batch.py")
    fi
else
    echo "== the Python integration tests: skipped (no default model or no openai module)"
fi
p=0 f=0
for r in "${runs[@]}"; do
    echo "== $r"
    out=$(env $r 2>&1)
    echo "$out"
    line=$(echo "$out" | grep -E '^[0-9]+ passed, [0-9]+ failed$' | tail -n 1)
    if [ -n "$line" ]; then
        p=$((p + ${line%% passed*})); ff=${line#*, }; f=$((f + ${ff%% failed}))
    else
        f=$((f + 1))
    fi
done
echo "$p passed, $f failed"
[ $f -eq 0 ]

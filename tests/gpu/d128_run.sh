#!/usr/bin/env bash
# d128_run.sh LOGDIR - makes tests/models/tiny-qwen3-d128 with HF transformers
# (tests/golden/make_tiny_d128.py; a copy goes to $OUT when set), then runs
# the head_dim-128 kernels end to end on it: test_gpu_e2e (every tiny model,
# this one against the CPU backend and HF), the engine suite on CUDA with the
# bf16 and the fp8 KV cache, each again on attn.cu's prefill kernel
# (SLUICE_CUDA_ATTN_WG=0), and the fp8 suite with the warpgroup kernel's
# widening left out (SLUICE_CUDA_ATTN_WG8_ABLATE=1), which must fail: proof
# that the suite reaches that kernel.
. "$(dirname "$0")/run_lib.sh"
M=tests/models/tiny-qwen3-d128
[ -f $M/golden.json ] || { python3 tests/golden/make_tiny_d128.py $M > "$L/make.log" 2>&1; echo "make rc=$?"; tail -4 "$L/make.log"; }
[ -n "${OUT:-}" ] && cp -r $M "$OUT/"
t e2e 200 build/tests/gpu/test_gpu_e2e
grep -E "^tiny|near-ties|FAIL" "$L/e2e.log" | head -20
E="env SLUICE_TEST_DEVICE=cuda SLUICE_TEST_MODEL=$M"
t engine 120 $E build/tests/test_engine
t engine_kv8 120 $E SLUICE_TEST_KV=fp8 build/tests/test_engine
t engine_nowg 120 $E SLUICE_CUDA_ATTN_WG=0 build/tests/test_engine
t engine_kv8_nowg 120 $E SLUICE_TEST_KV=fp8 SLUICE_CUDA_ATTN_WG=0 build/tests/test_engine
t engine_kv8_ablated 120 $E SLUICE_TEST_KV=fp8 SLUICE_CUDA_ATTN_WG8_ABLATE=1 build/tests/test_engine
grep -hE "FAIL|failed:" "$L"/engine*.log | head -20

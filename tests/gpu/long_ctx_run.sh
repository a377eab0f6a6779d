#!/usr/bin/env bash
# long_ctx_run.sh LOGDIR - long contexts on one GPU (Llama-3.1-8B shape,
# dummy weights): bench_gpu's SLUICE_BENCH_LONG (a prompt of LONG tokens,
# 131072 by default, prefilled in 8192-token chunks, then batch-1 decode at
# contexts up to it, each against its floor) with the bf16 and the fp8 KV
# cache; then `sluice serve` with --max-model-len 131072 answering a
# ~120K-token chat prompt twice (a miss, then a prefix-cache hit) through
# hit_ttft_run.sh.
. "$(dirname "$0")/run_lib.sh"
N=${LONG:-131072}
t long_bf16 240 env SLUICE_BENCH_LONG=$N build/tests/gpu/bench_gpu
grep -E "^long|^shape" "$L/long_bf16.log"
t long_fp8 240 env SLUICE_BENCH_LONG=$N SLUICE_BENCH_KV=fp8 build/tests/gpu/bench_gpu
grep -E "^long" "$L/long_fp8.log"
[ "${SERVE:-1}" = 1 ] && MAXLEN=131072 P=${P:-120000} N=2 TIMEOUT=300 bash tests/gpu/hit_ttft_run.sh "$L/serve" 2>&1 | tail -8

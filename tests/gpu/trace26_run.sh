#!/usr/bin/env bash
# trace26_run.sh LOGDIR - experiment: RoPE's cos/sin loaded before the
# decode attention's wait (SLUICE_CUDA_DEC_CS=0 / 1): the RoPE-fold and
# decode tests, batch-1 decode alternating, then a traced step.
. "$(dirname "$0")/run_lib.sh"
nvidia-smi -L
t k_fold 180 env SLUICE_TEST_ONLY=rope_fold build/tests/gpu/test_kernels
t k_dec 180 env SLUICE_TEST_ONLY=attention_decode build/tests/gpu/test_kernels
grep -E "FAIL|failed:" "$L/k_fold.log" "$L/k_dec.log" | head
for r in 1 2 3; do
    for v in 0 1; do
        timeout -k 5 60 env SLUICE_CUDA_DEC_CS=$v SLUICE_BENCH_ONLY=decode SLUICE_BENCH_DECODE=1x1024,1x1024,8x1024 build/tests/gpu/bench_gpu >"$L/b_${v}_$r.log" 2>&1
        echo "CS=$v rc=$?: $(grep -E '^decode batch' "$L/b_${v}_$r.log" | sed 's/ ctx//; s/floor.*//; s/ms.step = //; s/decode batch/b/' | tr '\n' ' ')"
    done
done
for v in 1 0; do
    timeout -k 5 60 env SLUICE_CUDA_DEC_CS=$v SLUICE_CUDA_TRACE=40 SLUICE_BENCH_ONLY=decode SLUICE_BENCH_DECODE=1x1024 build/tests/gpu/bench_gpu >"$L/trace_$v.log" 2>&1
    echo "== trace CS=$v rc=$?"
    grep -E "trace mean" "$L/trace_$v.log"
done
t e2e_tp1 90 build/tests/gpu/test_gpu_e2e

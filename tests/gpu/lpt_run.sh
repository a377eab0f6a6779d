#!/usr/bin/env bash
# lpt_run.sh LOGDIR - prefill attention items longest first
# (SLUICE_CUDA_ATTN_LPT, on by default) against step order: test_gpu_e2e
# and the engine suite on CUDA (LPT on), then bench_gpu's prefill
# (SLUICE_BENCH_ONLY=prefill) alternating LPT on / off, REPS rounds, and
# the 16K step without attention (SLUICE_CUDA_ABLATE=attn) for its share;
# then a 64K prompt in chunks of 8192 with each.
. "$(dirname "$0")/run_lib.sh"
nvidia-smi -L
t e2e 150 build/tests/gpu/test_gpu_e2e
t engine 120 env SLUICE_TEST_DEVICE=cuda SLUICE_TEST_MODEL=tests/models/tiny-qwen3-d128 build/tests/test_engine
grep -E "FAIL|failed:" "$L/e2e.log" "$L/engine.log" | head
for r in $(seq ${REPS:-3}); do
  for l in 1 0; do
    t pf_${l}_$r 120 env SLUICE_CUDA_ATTN_LPT=$l SLUICE_BENCH_ONLY=prefill build/tests/gpu/bench_gpu
    echo "  [LPT $l] $(grep -E '^prefill' "$L/pf_${l}_$r.log" | sed -E 's/ \(.*GEMMs\)//' | tr '\n' '|')"
  done
done
t pf_noattn 120 env SLUICE_CUDA_ABLATE=attn SLUICE_BENCH_ONLY=prefill build/tests/gpu/bench_gpu
echo "  [no attention] $(grep -E '^prefill' "$L/pf_noattn.log" | sed -E 's/ \(.*GEMMs\)//' | tr '\n' '|')"
for l in 1 0; do
  t long_$l 120 env SLUICE_CUDA_ATTN_LPT=$l SLUICE_BENCH_LONG=65536 SLUICE_BENCH_CHUNK=8192 build/tests/gpu/bench_gpu
  echo "  [LPT $l] $(grep -E '^long prompt' "$L/long_$l.log")"
done

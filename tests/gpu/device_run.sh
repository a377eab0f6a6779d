#!/usr/bin/env bash
# device_run.sh - the GPU checks and benchmarks of issues 6 and 9 in one go
# (what we run through the device tool on a 2 x H200 host). Logs under $1.
#   correctness: kernels (incl. tensor-core attention, fused GEMVs), the device
#   sampler, end to end vs CPU/HF at TP=1, tensor parallelism (tp_check.sh);
#   speed: attention kernels, Llama-3.1-8B shape at TP=1/TP=2 (and TP=2 without
#   collectives), a Qwen2.5-72B shape at TP=2.
. "$(dirname "$0")/run_lib.sh"
nvidia-smi -L
t kernels 150 build/tests/gpu/test_kernels
t sample 90 build/tests/gpu/test_sample
t e2e_tp1 150 build/tests/gpu/test_gpu_e2e
grep -E "GPU backend|greedy|seeded|near-ties|FAIL" "$L/e2e_tp1.log" | head -20
bash tests/gpu/tp_check.sh 2 "$L/tp" 2>&1 | tee "$L/tp_check.txt"
t bench_attn 60 build/tests/gpu/bench_attn; cat "$L/bench_attn.log" | tail -12
for tp in 1 2; do t bench8b_tp$tp 150 env SLUICE_TEST_TP=$tp build/tests/gpu/bench_gpu; cat "$L/bench8b_tp$tp.log"; done
t bench8b_tp2_nocomm 150 env SLUICE_TEST_TP=2 SLUICE_TP_SKIP_COMM=1 build/tests/gpu/bench_gpu; grep decode "$L/bench8b_tp2_nocomm.log"
t bench72b_tp2 240 env SLUICE_TEST_TP=2 SLUICE_BENCH_SEQS=32 build/tests/gpu/bench_gpu tools/configs/qwen2.5-72b; cat "$L/bench72b_tp2.log"

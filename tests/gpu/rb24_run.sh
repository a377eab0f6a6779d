#!/usr/bin/env bash
# rb24_run.sh LOGDIR - the issue's offline run (1000 x ~1000 in / 1000 out,
# run_batch_gpu.sh) with the decode kernel's 3-blocks-an-SM build off / on,
# bf16 KV cache; then on with the fp8 cache.
. "$(dirname "$0")/run_lib.sh"
nvidia-smi -L
for v in 0 4; do
    SLUICE_CUDA_DEC_WIDE_T=$v RB_SKIP_SMALL=1 timeout 280 tests/gpu/run_batch_gpu.sh 1000 "$L/rb_$v" 2>&1 | tail -1 | sed "s/^/SLUICE_CUDA_DEC_WIDE_T=$v: /"
done
RB_FLAGS="--kv-cache-dtype fp8" RB_SKIP_SMALL=1 timeout 200 tests/gpu/run_batch_gpu.sh 1000 "$L/rb_fp8" 2>&1 | tail -1

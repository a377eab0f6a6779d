#!/usr/bin/env bash
# long_chat_run.sh LOGDIR - chat beside a batch of long documents, one GPU
# (Llama-3.1-8B shape, dummy weights):
#   1. bench_gpu's SLUICE_BENCH_LONG=65536 prefilled in chunks of CHUNKS
#      tokens (512 2048 8192: what a short chunk deep into a document costs),
#      with SLUICE_CUDA_LONG_SPLIT_KEYS of LKS (4096, the default; 0: no
#      split of long tiles);
#   2. chat_beside_batch_run.sh with B documents of ~BP tokens
#      (--max-model-len 131072), --batch-step-tokens 2048 counted in tokens
#      (SLUICE_BATCH_PAIR_COST=0, the cap before it was weighed) and weighed
#      by the keys each token attends to (the default), each batch waited for.
. "$(dirname "$0")/run_lib.sh"
nvidia-smi -L
if [ "${BENCH:-1}" = 1 ]; then
  for c in ${CHUNKS:-512 2048 8192}; do
    for lk in ${LKS:-4096}; do # SLUICE_CUDA_LONG_SPLIT_KEYS (0: long tiles never split)
      echo "-- chunks of $c, SLUICE_CUDA_LONG_SPLIT_KEYS=$lk"
      t long_c${c}_$lk 120 env SLUICE_BENCH_LONG=65536 SLUICE_BENCH_CHUNK=$c SLUICE_CUDA_LONG_SPLIT_KEYS=$lk \
          build/tests/gpu/bench_gpu
      grep -E "^long prompt" "$L/long_c${c}_$lk.log"
    done
  done
fi
for k in ${KS:-0 model}; do
  echo "== --batch-step-tokens 2048, SLUICE_BATCH_PAIR_COST=$k"
  if [ "$k" = model ]; then unset SLUICE_BATCH_PAIR_COST; else export SLUICE_BATCH_PAIR_COST=$k; fi
  MAXLEN=131072 B=${B:-8} BP=${BP:-100000} BO=${BO:-16} C=${C:-6} R=1 WAIT=1 LIMIT=${LIMIT:-260} PORT=8125 \
      "$(dirname "$0")/chat_beside_batch_run.sh" "$L/lc_$k" 2>&1 | grep -E "idle|beside|during|running|batch |rc="
  rm -rf "$L/lc_$k/data"
done
unset SLUICE_BATCH_PAIR_COST

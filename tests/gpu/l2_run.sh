#!/usr/bin/env bash
# l2_run.sh LOGDIR - experiment: does a bulk L2 prefetch turn the o GEMV's
# weight reads into L2 hits (SLUICE_BENCH_L2=1 bench_kernels)?
. "$(dirname "$0")/run_lib.sh"
nvidia-smi -L
t l2 300 env SLUICE_BENCH_L2=1 build/tests/gpu/bench_kernels
cat "$L/l2.log"
which nsys ncu; ls /usr/local/cuda/bin; ls /opt 2>/dev/null

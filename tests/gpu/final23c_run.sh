#!/usr/bin/env bash
# final23c_run.sh LOGDIR - the round's last commit (enqueue's failure path
# clears the tagged h): make gpu-test and batch-1 decode.
. "$(dirname "$0")/run_lib.sh"
nvidia-smi -L
gpu_test
ab_b1 SLUICE_GEMV_TAGGED 1 1

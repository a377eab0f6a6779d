# run_lib.sh - sourced by the device scripts (device_run, decode_run,
# profile_run, quick_run, prefill_prof_run, kv8_run, ...): the log folder L
# ($1 of the script), NCCL without NVLink SHARP, the GPU count ngpu, and
#   t NAME SECONDS CMD...   CMD under a timeout, its output in $L/NAME.log,
#                           one line: exit status, seconds, the result lines
#   core_tests SECONDS      the one-GPU correctness runs (below)
#   e2e_tests               their end-to-end part
#   dec_tests FOLD          after a decode-kernel change: its tests (bf16 and
#                           fp8), memcheck + racecheck on the RoPE-fold tests
#                           named FOLD, the sampler, e2e, the engine suite
#                           with each cache
#   gpu_test                make gpu-test's runner: its last line, failures
#   ab_b1 VAR ROUNDS V...   batch-1 decode with VAR=V for each V in turn,
#                           ROUNDS times
#   default_model PART2     the default model (98 MB: more than one call
#                           carries with the tracked tree) rebuilt from two
#                           xz parts: /tmp/keep/pa, left by the call before
#                           on the same warm host, and PART2 (this call's)
#   builds_decode ROUNDS B...  decode at batches 1, 1, 8, 64, 256 with each
#                           bench binary B (under build/) in turn, ROUNDS times
#   batches_bench ROUNDS    decode at batches 1-8, 64, 256 (ROUNDS times),
#                           then bench_gpu (TTFT, the 16K prefill step)
set -u
L=${1:-/tmp/$(basename "$0" .sh)}
mkdir -p "$L"
export NCCL_NVLS_ENABLE=0
ngpu=$(nvidia-smi -L 2>/dev/null | grep -c '^GPU' || true)
t() {
    local n=$1 s=$2
    shift 2
    local a=$(date +%s)
    timeout -k 5 "$s" "$@" >"$L/$n.log" 2>&1
    local rc=$?
    echo "$n rc=$rc $(($(date +%s) - a))s: $(grep -E 'passed, [0-9]+ failed|ERROR SUMMARY|RACECHECK SUMMARY|^FAIL' "$L/$n.log" | tail -3 | tr '\n' ' ')"
}

# e2e_tests: the device sampler, end to end vs CPU/HF, the engine suite on
# CUDA with the bf16 and the fp8 KV cache; failures listed
e2e_tests() {
    t sample 60 build/tests/gpu/test_sample
    t e2e_tp1 90 build/tests/gpu/test_gpu_e2e
    local e="env SLUICE_TEST_DEVICE=cuda SLUICE_TEST_MODEL=tests/models/tiny-qwen3"
    t engine_tp1 90 $e build/tests/test_engine
    t engine_kv8 90 $e SLUICE_TEST_KV=fp8 build/tests/test_engine
    grep -E "FAIL|failed:" "$L/e2e_tp1.log" "$L/engine_tp1.log" "$L/engine_kv8.log" | head
}

# core_tests KERNEL_SECS: the correctness part of a call on one GPU: the
# kernel tests, then e2e_tests
core_tests() {
    t kernels "$1" build/tests/gpu/test_kernels
    grep -E "FAIL|failed:" "$L/kernels.log" | head -20
    e2e_tests
}

dec_tests() {
    local K=build/tests/gpu/test_kernels
    t k_dec 180 env SLUICE_TEST_ONLY=attention_decode $K
    t k_kv8 180 env SLUICE_TEST_ONLY=kv8 $K
    grep -E "FAIL|failed:" "$L/k_dec.log" "$L/k_kv8.log" | head
    t memcheck_fold 240 env SLUICE_TEST_ONLY="$1" compute-sanitizer --tool memcheck $K
    t racecheck_fold 240 env SLUICE_TEST_ONLY="$1" compute-sanitizer --tool racecheck $K
    e2e_tests
}

gpu_test() {
    BUILD=build timeout "${GPU_TEST_SECS:-420}" tests/gpu/run_gpu_tests.sh >"$L/gpu_test.log" 2>&1
    echo "gpu-test rc=$?: $(tail -1 "$L/gpu_test.log")"
    grep -E "FAIL|failed:" "$L/gpu_test.log" | head
}

default_model() {
    local m=models/SmolLM2-135M-Instruct.Q4_1.gguf
    if [ -f /tmp/keep/pa ] && [ -f "${1:-}" ]; then
        mkdir -p models
        cat /tmp/keep/pa "$1" | python3 -c "import lzma,sys; sys.stdout.buffer.write(lzma.decompress(sys.stdin.buffer.read()))" >$m
        echo "model: $(sha256sum $m | cut -c1-16) (want b179c9523d0e6a0f)"
    else
        echo "model: a part is missing, SmolLM2 skipped"
    fi
}

builds_decode() {
    local n=$1 r b
    shift
    local D="SLUICE_BENCH_ONLY=decode SLUICE_BENCH_DECODE=1x1024,1x1024,8x1024,64x1024,256x1024"
    for r in $(seq "$n"); do
        for b in "$@"; do
            timeout -k 5 90 env $D build/$b >"$L/d_$(basename $b)_$r.log" 2>&1
            echo "$b rc=$?: $(grep -E '^decode batch' "$L/d_$(basename $b)_$r.log" | sed 's/ ctx//; s/floor.*//; s/ms.step = //; s/decode batch/b/' | tr '\n' ' ')"
        done
    done
}

batches_bench() {
    local r
    for r in $(seq "$1"); do
        timeout -k 5 150 env SLUICE_BENCH_ONLY=decode SLUICE_BENCH_DECODE=2x1024,4x1024,8x1024,64x1024,256x1024 \
            build/tests/gpu/bench_gpu >"$L/dec_$r.log" 2>&1
        echo "decode round $r rc=$?: $(grep -E '^decode batch' "$L/dec_$r.log" | sed 's/ ctx//; s/floor.*//; s/ms.step = //' | tr '\n' ' ')"
    done
    timeout -k 5 200 build/tests/gpu/bench_gpu >"$L/bench.log" 2>&1
    echo "bench_gpu rc=$?:"
    grep -E "prefill|TTFT|decode batch 1 " "$L/bench.log"
}

ab_b1() {
    local var=$1 n=$2 r v
    shift 2
    for r in $(seq "$n"); do
        for v in "$@"; do
            timeout -k 5 120 env "$var=$v" SLUICE_BENCH_ONLY=decode build/tests/gpu/bench_gpu >"$L/b1_${var}_${v}_$r.log" 2>&1
            echo "$var=$v round $r rc=$?: $(grep -E '^decode batch 1 ' "$L/b1_${var}_${v}_$r.log")"
        done
    done
}

#!/usr/bin/env bash
# run.sh - the GPU checks and benchmarks, on a host with a GPU (`make
# gpu-test` runs `check`, `make bench` runs `bench gpu`). Run from anywhere;
# the binaries must be built (make -j build/sluice and the tests/gpu ones).
#
#   tests/gpu/run.sh check [--python-only | --no-python]
#   tests/gpu/run.sh bench [OPTIONS] NAME...
#   tests/gpu/run.sh pack [FILE...]
#
# check: every tests/gpu/test_* binary (test_gpu_e2e: also every packed
#   int4/int8 checkpoint of tests/models/quant against the CPU); the engine
#   suite (batch invariance, chunked prefill, prefix reuse, preemption) on the
#   CUDA backend: with the bf16 KV cache on the default model (tiny-qwen3 when
#   models/ lacks it), with fp8 on tiny-qwen3, and with each on
#   tiny-qwen3-d128 (head_dim 128: the warpgroup prefill attention on sm_90),
#   and with bf16 on glm5-mla (glm5_next: MLA, MoE, hyper-connections);
#   test_gpu_e2e and the engine suite on tiny-qwen3 once more with the fused
#   gate|up GEMM on every step of 5+ tokens; the engine suite on an MoE model
#   (tiny-qwen3-moe-ctx2k: tiny-qwen3-moe's weights with a 2048-token
#   context, which the suite's 512-token requests need) and on an MLA model
#   (tests/models/mla/dsv3-qlora), bf16 and fp8; the MTP layer (test_mtp,
#   test_spec_mtp: transformers' drafts, output with drafts = without); drafts
#   on KDA models (test_spec_kda: the state rolled back to the last accepted
#   draft, output with drafts = without); with 2+ GPUs, test_gpu_e2e at
#   TP=2 against the CPU and against one GPU (it also makes a rank fail and
#   checks that the others stop) and the engine suite on tiny-qwen3,
#   tiny-qwen3-moe-ctx2k and dsv3-qlora at TP=2,
#   each again with the fused GEMM, test_glm5_layers (every glm5_next
#   layer's hyper-connection streams), test_spec_kda, test_mtp and test_spec_mtp at TP=2; then, with the default model in models/
#   and the openai module, the Python integration tests (all but
#   test_chat_rules.py, which pins --device cpu) against servers on the GPU
#   (test_server.py and test_batch.py again at TP=2 with 2+ GPUs) and a check
#   that every server they logged ran on the cuda backend. --python-only:
#   those alone; --no-python: without them.
#   Ends with one line "N passed, N failed".
#
# bench NAME...: each benchmark behind a current figure of BENCHMARKS.md
#   (the Llama-3.1-8B shape with dummy weights unless said), its output on
#   stdout and under the log folder:
#   gpu                bench_gpu: TTFT of 2048 tokens, a 16K-token prefill step,
#                      batch-1 decode at 1K context, decode batches 8 / 64 / 256
#   decode             decode at 1K context, batches 1, 2, 4, 8, 16, 64, 128, 256
#   moe                the Qwen3-30B-A3B shape, bf16 and int4 g128 experts:
#                      first bench_moe (one MoE layer's kernels, 1 to 16384
#                      tokens, eager and in a CUDA graph, GB/s over the chosen
#                      experts' bytes, the path taken and a line a stage, the
#                      experts on each path: GEMVs, grouped GEMM; the router's
#                      logits on tensor cores, rgemm), then the
#                      model (tools/configs/qwen3-30b-a3b, -w4a16): bench_gpu's
#                      steps, decode at batch 64 and 256 too
#   quant              packed weights beside bf16 (tools/configs/llama-3.1-8b,
#                      -w4g128: int4 group 128, -w8: int8 per channel; bf16
#                      lm_head): TTFT of 2048, a 16K-token prefill step,
#                      batch-1 decode at 1K context and batch 16; first bench_qgemm,
#                      each packed GEMM alone at those shapes (GB/s) beside the bf16 GEMV
#   long               one 32K and one 131K-token prompt in chunks of 8192
#                      (TTFT), then batch-1 decode over them; each KV cache
#   mla                the DeepSeek-V2-Lite shape (tools/configs/deepseek-v2-lite-shape: MLA +
#                      64 experts top-6, dummy bf16): first bench_mla, the MLA attention
#                      kernels alone on 8192-token chunks (tensor cores vs SIMT, and
#                      the expanded form; each KV cache); batch-1 decode at 1K, then
#                      one 32K and one 131K-token prompt (TTFT) and batch-1 decode
#                      over each; the 32K prompt again with the absorbed form's prefill
#   mtp                bench_mtp: speculation's cost a step with MTP drafts at the
#                      DeepSeek-V2-Lite shape with one MTP layer (tools/configs/
#                      deepseek-v2-lite-mtp, dummy bf16): a plain decode step, one
#                      with the MTP sub-step, a verify step of K = 1..3 drafts without
#                      and with the MTP layer's pass, batches 1 and 8 at 1K context;
#                      then the Llama-3.1-8B shape's decode and verify steps alone
#                      (what verifying n-gram drafts costs)
#   gemm               bench_gemm: the sustained cuBLAS GEMM ceiling at the power
#                      cap, and the warpgroup GEMMs beside it
#   attn               bench_attn: the prefill attention kernels, each KV cache
#   kernels            bench_kernels: each decode kernel and GEMV alone
#   kda                bench_kda: the KDA recurrence at GLM-5.3-Flash's shape, decode and
#                      prefill steps, one block a head against the value columns split;
#                      prefill of 1K, 4K and 14.6K tokens, the recurrence against the
#                      chunked kernels (ms a layer); then again at 32 heads (a TP=2 rank)
#   glm5               GLM-5.3-Flash's parts on one GPU: its MoE layer (bench_moe --glm5),
#                      the DSA indexer alone (bench_mla --indexer), then the shape cut
#                      to 8 layers (tools/configs/glm-5.3-flash-8layers, dummy mixed
#                      weights): a 14.6K-token prompt (TTFT) and decode over it
#   nccl               bench_nccl: one all-reduce, NCCL and the peer kernel (2+ GPUs)
#   power              the GPU's power and SM clock (nvidia-smi every 20 ms)
#                      during bench_gemm and sustained prefill steps (power_sum.py)
#   chat-beside-batch  streamed chats beside a Batch API job of ~3000-token prompts
#   long-chat          streamed chats beside a batch of 6 ~90K-token documents
#   long-prompt-chat   6 chats arriving 0.5 s apart beside one ~100K-token chat prompt
#   hit-ttft           a 14.6K-token prompt, then 6 prefix-cache hits: TTFT of each
#   hit-ttft-long      the same at ~119K tokens
#   small-batch-chat   1, 2 and 4 streamed chats at once through the server
#   serve-bench        `sluice bench` (14.6K-token prompts, cache bust and hit)
#   run-batch          `sluice run-batch` of 1000 x (~1000 in, 1000 out), load included
#   spec-quote         answers that quote their document (tools/bench/spec_quote.py) on the
#                      default model, served without and then with 4 n-gram drafts
#                      (--model-args: another model's sluice serve arguments)
#   OPTIONS: --log=DIR (/tmp/sluice-gpu-bench), --tp=N (gpu, decode, quant,
#   long, nccl and the served ones: N GPUs), --kv-cache-dtype=fp8 (gpu,
#   decode, quant, long, attn, the served ones), --nccl (gpu, decode, quant,
#   long: every all-reduce through NCCL), --sluice=BIN (the served ones: another build, build/sluice),
#   --serve-arg=FLAG (repeatable: more flags for the served ones' server or
#   run-batch, e.g. --serve-arg=--interactive-itl-target=100), --model-args="..."
#   (the served ones on another model; a dry run on the CPU:
#   --model-args="tests/models/tiny-qwen3 --device cpu" --serve-arg=--max-model-len=2048).
#
# pack [FILE...]: build/sluice, test_engine, test_mtp, test_spec_mtp, test_spec_kda, the GPU test and bench binaries
#   and FILEs,
#   stripped and packed into .carry/bin.tar.xz (~2 MB: the binaries share
#   one fatbin, which a 256 MiB xz dictionary stores once), for a device
#   without a compiler. There: python3 -c "import tarfile;
#   tarfile.open('.carry/bin.tar.xz').extractall('.')".
set -u -o pipefail
cd "$(dirname "$0")/../.."
B=${BUILD:-build}
MODEL=models/SmolLM2-135M-Instruct.Q4_1.gguf
export NCCL_NVLS_ENABLE=${NCCL_NVLS_ENABLE:-0} # NVLink SHARP is not set up on our hosts
ngpu=$(nvidia-smi -L 2>/dev/null | grep -c '^GPU' || true)
ngpu=${ngpu:-0}

usage() {
    sed -n '2,/^set -u/p' "$0" | sed '$d; s/^# \{0,1\}//' >&2
    exit 2
}

# backend_check NAME LOG...: whether every server log given (missing ones
# skipped) says its servers ran on backend NAME: each "ready" line names the
# backend, and none names another; "N passed, N failed"
backend_check() {
    local want=$1 p=0 f=0 l n other
    shift
    for l in "$@"; do
        [ -f "$l" ] || continue
        n=$(grep -c "(backend $want," "$l")
        other=$(grep -E "ready on .*\(backend " "$l" | grep -vc "(backend $want,")
        if [ "$n" -gt 0 ] && [ "$other" -eq 0 ]; then
            echo "ok   $l: $n servers on $want"
            p=$((p + 1))
        else
            echo "FAIL $l: $n servers on $want, $other on another backend"
            f=$((f + 1))
        fi
    done
    [ $((p + f)) -gt 0 ] || { echo "FAIL no server log found"; f=1; }
    echo "$p passed, $f failed"
}

check() {
    local py=1 c=1
    case "${1:-}" in
    --python-only) c=0 ;;
    --no-python) py=0 ;;
    "") ;;
    *) usage ;;
    esac
    local runs=() e="SLUICE_TEST_DEVICE=cuda SLUICE_TEST_MODEL=tests/models/tiny-qwen3"
    local e128="SLUICE_TEST_DEVICE=cuda SLUICE_TEST_MODEL=tests/models/tiny-qwen3-d128" t
    local emla="SLUICE_TEST_DEVICE=cuda SLUICE_TEST_MODEL=tests/models/mla/dsv3-qlora" # MLA: the latent cache
    if [ $c = 1 ]; then
        # executables only: an object the generic %.o rule made there (`make build/tests/gpu/test_x.o`,
        # a compile check) or any other file beside them is not a test
        for t in "$B"/tests/gpu/test_*; do [ -f "$t" ] && [ -x "$t" ] && runs+=("$t"); done
        if [ -f "$MODEL" ]; then runs+=("SLUICE_TEST_DEVICE=cuda $B/tests/test_engine"); else runs+=("$e $B/tests/test_engine"); fi
        runs+=("SLUICE_TEST_KV=fp8 $e $B/tests/test_engine" "$e128 $B/tests/test_engine"
               "SLUICE_TEST_KV=fp8 $e128 $B/tests/test_engine"
               "SLUICE_TEST_DEVICE=cuda SLUICE_TEST_MODEL=tests/models/glm5/glm5-mla $B/tests/test_engine"
               "$B/tests/gpu/test_gpu_e2e --gemm-wg-min-t=1" "$e $B/tests/test_engine --gemm-wg-min-t=1"
               "SLUICE_TEST_DEVICE=cuda SLUICE_TEST_MODEL=tests/models/tiny-qwen3-moe-ctx2k $B/tests/test_engine"
               "$emla $B/tests/test_engine" "SLUICE_TEST_KV=fp8 $emla $B/tests/test_engine"
               "$B/tests/test_mtp --device=cuda" "$B/tests/test_spec_mtp --device=cuda"
               "$B/tests/test_spec_kda --device=cuda")
        if [ "$ngpu" -ge 2 ]; then
            runs+=("$B/tests/gpu/test_gpu_e2e --tp=2"
                   "$B/tests/gpu/test_gpu_e2e --tp=2 --ref=cuda"
                   "SLUICE_TEST_TP=2 $e $B/tests/test_engine"
                   "$B/tests/gpu/test_glm5_layers --tp=2"
                   "$B/tests/test_spec_kda --device=cuda --tp=2"
                   "$B/tests/test_mtp --device=cuda --tp=2" "$B/tests/test_spec_mtp --device=cuda --tp=2"
                   "SLUICE_TEST_TP=2 SLUICE_TEST_DEVICE=cuda SLUICE_TEST_MODEL=tests/models/tiny-qwen3-moe-ctx2k $B/tests/test_engine"
                   "SLUICE_TEST_TP=2 $emla $B/tests/test_engine"
                   "$B/tests/gpu/test_gpu_e2e --tp=2 --gemm-wg-min-t=1"
                   "SLUICE_TEST_TP=2 $e $B/tests/test_engine --gemm-wg-min-t=1")
        fi
    fi
    # the HTTP server, the Batch API's queue and the vLLM flags served on this
    # GPU (the default device where one is present); test_chat_rules pins
    # --device cpu and stays out
    local py_logs="build/test_server.log build/test_batch_*.log build/test_chat_tools.log build/test_bench.log"
    if [ $py = 1 ] && [ -f "$MODEL" ] && python3 -c 'import openai' 2>/dev/null; then
        rm -f $py_logs
        for t in tests/test_*.py; do
            case $t in *test_chat_rules.py) continue ;; esac
            runs+=("SLUICE_BIN=$B/sluice PYTHONUNBUFFERED=1 python3 $t")
        done
        runs+=("BACKEND_CHECK")
        if [ "$ngpu" -ge 2 ]; then # their logs: the check above has read them
            local tp="SLUICE_TEST_SERVE_ARGS=--tensor-parallel-size=2 SLUICE_BIN=$B/sluice PYTHONUNBUFFERED=1"
            runs+=("$tp python3 tests/test_server.py" "$tp python3 tests/test_batch.py")
        fi
    elif [ $py = 1 ]; then
        echo "== the Python integration tests: skipped (no default model or no openai module)"
    fi
    local p=0 f=0 r out line ff
    for r in "${runs[@]}"; do
        echo "== $r"
        if [ "$r" = BACKEND_CHECK ]; then out=$(backend_check cuda $py_logs 2>&1); else out=$(env $r 2>&1); fi
        echo "$out"
        line=$(echo "$out" | grep -E '^[0-9]+ passed, [0-9]+ failed$' | tail -n 1)
        if [ -n "$line" ]; then
            p=$((p + ${line%% passed*})) ff=${line#*, }
            f=$((f + ${ff%% failed}))
        else
            f=$((f + 1))
        fi
    done
    echo "$p passed, $f failed"
    [ $f -eq 0 ]
}

# bench NAME: see the top. G: bench_gpu's options from --tp, --kv-cache-dtype, --nccl.
bench_one() {
    local n=$1 d="$L/$1" s
    mkdir -p "$d"
    echo "== $n ($(nvidia-smi --query-gpu=name --format=csv,noheader 2>/dev/null | head -1), $ngpu GPU(s))"
    case $n in
    gpu) timeout -k 5 300 "$B/tests/gpu/bench_gpu" $G 2>&1 | tee "$d/bench_gpu.log" ;;
    quant)
        timeout -k 5 300 "$B/tests/gpu/bench_qgemm" 2>&1 | tee "$d/bench_qgemm.log"
        for s in llama-3.1-8b llama-3.1-8b-w4g128 llama-3.1-8b-w8; do
            echo "-- $s"
            timeout -k 5 300 "$B/tests/gpu/bench_gpu" $G --seqs=16 --decode=16x1024 "tools/configs/$s" 2>&1 | tee "$d/$s.log"
        done ;;
    decode)
        timeout -k 5 300 "$B/tests/gpu/bench_gpu" $G --only=decode \
            --decode=2x1024,4x1024,8x1024,16x1024,64x1024,128x1024,256x1024 2>&1 | tee "$d/bench_gpu.log" ;;
    long) # each KV cache unless --kv-cache-dtype names one
        for k in ${KVD:-auto fp8}; do
            for s in 32768 131072; do
                timeout -k 5 600 "$B/tests/gpu/bench_gpu" $G0 --kv-cache-dtype=$k --long=$s 2>&1 | tee "$d/long_${k}_$s.log"
            done
        done ;;
    moe)
        timeout -k 5 300 "$B/tests/gpu/bench_moe" 2>&1 | tee "$d/bench_moe.log"
        timeout -k 5 300 "$B/tests/gpu/bench_moe" --int4 2>&1 | tee "$d/bench_moe_int4.log"
        for s in qwen3-30b-a3b qwen3-30b-a3b-w4a16; do
            echo "-- $s"
            timeout -k 5 600 "$B/tests/gpu/bench_gpu" $G --decode=64x1024,256x256 "tools/configs/$s" 2>&1 | tee "$d/$s.log"
        done ;;
    mla) # the DeepSeek-V2-Lite shape (MLA + MoE, dummy bf16): batch-1 decode at 1K, then over 32K and 131K
        s=tools/configs/deepseek-v2-lite-shape
        for k in ${KVD:-auto fp8}; do
            timeout -k 5 120 "$B/tests/gpu/bench_mla" $([ "$k" = auto ] || echo "--kv-cache-dtype=$k") 2>&1 |
                tee "$d/bench_mla_$k.log"
        done
        timeout -k 5 300 "$B/tests/gpu/bench_gpu" $G --only=decode "$s" 2>&1 | tee "$d/decode.log"
        for n in 32768 131072; do
            timeout -k 5 400 "$B/tests/gpu/bench_gpu" $G0 --long=$n "$s" 2>&1 | tee "$d/long_$n.log"
        done
        # the 32K prompt with its prefill in the absorbed form too (the default takes the expanded form)
        timeout -k 5 400 "$B/tests/gpu/bench_gpu" $G0 --long=32768 --mla-absorbed "$s" 2>&1 |
            tee "$d/long_32768_absorbed.log" ;;
    mtp) timeout -k 5 400 "$B/tests/gpu/bench_mtp" 2>&1 | tee "$d/bench_mtp.log"
        timeout -k 5 300 "$B/tests/gpu/bench_mtp" tools/configs/llama-3.1-8b 2>&1 | tee "$d/bench_verify_8b.log" ;;
    gemm) timeout -k 5 300 "$B/tests/gpu/bench_gemm" --wg 2>&1 | tee "$d/bench_gemm.log" ;;
    attn)
        for k in ${KVD:-auto fp8}; do
            timeout -k 5 300 "$B/tests/gpu/bench_attn" $([ "$k" = auto ] || echo "--kv-cache-dtype=$k") 2>&1 |
                tee "$d/bench_attn_$k.log"
        done ;;
    kernels) timeout -k 5 300 "$B/tests/gpu/bench_kernels" 2>&1 | tee "$d/bench_kernels.log" ;;
    kda) { timeout -k 5 300 "$B/tests/gpu/bench_kda"; timeout -k 5 300 "$B/tests/gpu/bench_kda" --heads=32; } 2>&1 |
             tee "$d/bench_kda.log" ;;
    glm5) { timeout -k 5 120 "$B/tests/gpu/bench_moe" --glm5 1 8; timeout -k 5 120 "$B/tests/gpu/bench_mla" --indexer
            timeout -k 5 300 "$B/tests/gpu/bench_gpu" $G --long=14600 tools/configs/glm-5.3-flash-8layers \
                tests/models/kda/glm5-kda; } 2>&1 | tee "$d/bench_glm5.log" ;;
    nccl)
        if [ "$ngpu" -lt 2 ]; then echo "nccl: needs 2+ GPUs, skipped"; return 0; fi
        timeout -k 5 120 "$B/tests/gpu/bench_nccl" "${TP:-2}" 2>&1 | tee "$d/bench_nccl.log" ;;
    power) power "$d" ;;
    chat-beside-batch) served "$d" chat-beside-batch --concurrent ;;
    long-chat)
        served "$d" chat-beside-batch --batch 6 --batch-prompt 90000 --batch-out 16 --chats 6 --running 1 --wait \
            --max-model-len 131072 ;;
    long-prompt-chat) served "$d" long-prompt-chat ;;
    hit-ttft) served "$d" hit-ttft ;;
    hit-ttft-long) served "$d" hit-ttft --prompt 119000 --max-model-len 131072 ;;
    small-batch-chat) served "$d" small-batch-chat ;;
    serve-bench) served "$d" serve-bench ;;
    run-batch) served "$d" run-batch ;;
    spec-quote) spec_quote "$d" ;;
    *) echo "bench: no benchmark named $n (the names: tests/gpu/run.sh with no argument)" >&2; return 2 ;;
    esac
}

served() { # DIR NAME [OPTIONS]: scenarios.py with this run's common options
    local d=$1
    shift
    timeout -k 10 3300 python3 tests/gpu/scenarios.py --log "$d" --sluice "$SLUICE" ${TP:+--tp "$TP"} \
        ${KVD:+--kv-cache-dtype "$KVD"} ${MA:+--model-args "$MA"} ${SERVE_ARGS[@]+"${SERVE_ARGS[@]}"} "$@" 2>&1 |
        tee "$d/client.log"
}

spec_quote() { # DIR: the default model (or --model-args) served without, then with n-gram drafts
    local d=$1 port=18431 k pid
    local ma=${MA:-$MODEL}
    for k in 0 4; do
        local sc=()
        [ $k = 0 ] || sc=(--speculative-config \
            "{\"method\":\"ngram\",\"num_speculative_tokens\":$k,\"prompt_lookup_min\":2,\"prompt_lookup_max\":4}")
        # shellcheck disable=SC2086 # the model arguments are words
        "$SLUICE" serve $ma --port $port "${sc[@]}" >"$d/serve_$k.log" 2>&1 &
        pid=$!
        python3 -c "import sys; sys.path.insert(0, 'tests'); import sluice_testlib as lib; sys.exit(0 if lib.wait_healthy($port, $pid, timeout=300, interval=0.5) else 1)" ||
            { echo "spec-quote: the server did not come up (see $d/serve_$k.log)"; kill $pid; return 1; }
        echo "-- $k drafts"
        timeout -k 5 600 python3 tools/bench/spec_quote.py --url "http://127.0.0.1:$port" --requests 4 \
            --max-tokens 128 2>&1 | tee "$d/quote_$k.log"
        kill $pid
        wait $pid 2>/dev/null
    done
}

power() { # DIR: bench_gemm and sustained prefill steps, the GPU sampled meanwhile
    local d=$1 F
    nvidia-smi -q -d POWER,CLOCK,PERFORMANCE >"$d/smi_before.txt" 2>&1
    grep -E "Power Limit|Power Draw|Max Clocks|SM  |Graphics" "$d/smi_before.txt" | head -20
    F=timestamp,clocks.sm,power.draw.instant,power.draw.average,enforced.power.limit,temperature.gpu
    F=$F,clocks_event_reasons.active
    nvidia-smi --query-gpu=$F --format=csv,noheader,nounits -c 1 >/dev/null 2>&1 ||
        F=timestamp,clocks.sm,power.draw,power.draw,enforced.power.limit,temperature.gpu,clocks_event_reasons.active
    local run
    for run in "gemm 150 $B/tests/gpu/bench_gemm" "prefill 300 $B/tests/gpu/bench_gpu --only=prefill --big=16"; do
        set -- $run
        local n=$1 s=$2
        shift 2
        nvidia-smi --query-gpu=$F --format=csv,noheader,nounits -lms 20 >"$d/$n.csv" 2>&1 &
        local smi=$!
        timeout -k 5 "$s" stdbuf -oL "$@" 2>&1 |
            while IFS= read -r l; do echo "$(date '+%Y/%m/%d %H:%M:%S.%3N') $l"; done >"$d/$n.log"
        kill $smi 2>/dev/null
        wait $smi 2>/dev/null
        cut -d' ' -f3- "$d/$n.log" | grep -E "sustained|prefill|TFLOP" | head -20
        python3 tests/gpu/power_sum.py "$d/$n.csv" "$d/$n.log"
    done
    nvidia-smi -q -d POWER,CLOCK,PERFORMANCE >"$d/smi_after.txt" 2>&1
}

bench() {
    L=/tmp/sluice-gpu-bench TP="" KVD="" NCCL="" SLUICE=$B/sluice SERVE_ARGS=() MA=""
    local names=() a
    for a in "$@"; do
        case $a in
        --log=*) L=${a#--log=} ;;
        --tp=*) TP=${a#--tp=} ;;
        --kv-cache-dtype=*) KVD=${a#--kv-cache-dtype=} ;;
        --nccl) NCCL=1 ;;
        --sluice=*) SLUICE=${a#--sluice=} ;;
        --serve-arg=*) SERVE_ARGS+=("--serve-arg=${a#--serve-arg=}") ;;
        --model-args=*) MA=${a#--model-args=} ;;
        -*) usage ;;
        *) names+=("$a") ;;
        esac
    done
    [ ${#names[@]} -gt 0 ] || usage
    G0="${TP:+--tp=$TP} ${NCCL:+--nccl}"
    G="$G0 ${KVD:+--kv-cache-dtype=$KVD}"
    mkdir -p "$L"
    nvidia-smi -L
    local rc=0
    for a in "${names[@]}"; do bench_one "$a" || rc=1; done
    return $rc
}

pack() {
    set -e
    local t f
    t=$(mktemp -d)
    for f in "$B/sluice" "$B/tests/test_engine" "$B/tests/test_mtp" "$B/tests/test_spec_mtp" "$B/tests/test_spec_kda" \
        "$B"/tests/gpu/* "$@"; do
        [ -f "$f" ] || continue
        [[ $f != "$B"/tests/gpu/* || -x $f ]] || continue # the binaries there, not a stray object
        mkdir -p "$t/$(dirname "$f")"
        strip -o "$t/$f" "$f"
    done
    mkdir -p .carry
    tar -C "$t" -cf - "$(echo "$B" | cut -d/ -f1)" | xz -T1 --lzma2=preset=1,dict=512MiB >.carry/bin.tar.xz
    rm -rf "$t"
    ls -la .carry/bin.tar.xz
}

cmd=${1:-}
[ $# -gt 0 ] && shift
case $cmd in
check) check "$@" ;;
bench) bench "$@" ;;
pack) pack "$@" ;;
*) usage ;;
esac

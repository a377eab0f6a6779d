/* bench_gpu.c - GPU backend timings on a dummy-weight shape (not a test).
 *
 *   build/tests/gpu/bench_gpu [OPTIONS] [config_dir] [tokenizer]
 *   (defaults: tools/configs/llama-3.1-8b, tests/models/tiny-qwen3)
 *   --tp=N               N tensor-parallel ranks
 *   --seqs=N             KV for N sequences (256) and the largest decode batch
 *   --only=decode        batch-1 decode alone (=prefill: the prefill timings
 *                        alone; =batches: --decode's batches alone)
 *   --decode=BxC[,BxC...]  after batch-1 decode, decode of B sequences at
 *                        context C each instead of the fixed batches
 *   --kv-cache-dtype=fp8 the fp8 KV cache
 *   --big=N (N > 8)      after the 16K-token step, prefill sustained (8 steps
 *                        back to back) at 8 and at N prompts of 2048 a step, twice
 *   --long=N             one sequence of N tokens instead of everything above:
 *                        its prompt prefilled in chunks of --chunk tokens (8192,
 *                        serve's --max-num-batched-tokens) as the scheduler runs
 *                        them (TTFT, each chunk's time), then batch-1 decode over
 *                        that written cache at contexts up to N, each against its
 *                        floor (weights + the context's KV at --bw)
 *   --bw=TBPS            the memory bandwidth the floors assume (H200 4.3, H100
 *                        3.35, else 3.35: what each sustains on a copy)
 *   --profile=decode     after the timed decode steps, two more inside
 *                        cudaProfilerStart/Stop (for `ncu --profile-from-start
 *                        off`); =prefill: after the timed prefill, one more
 *                        16K-token step inside them, then stop
 *   --enforce-eager      no CUDA graphs;  --no-warmup  no start-up warm-up
 *   --nccl               every tensor-parallel all-reduce through NCCL
 *   --mla-absorbed       MLA prompts in the absorbed form, as decode steps run
 *                        (cuda_tuning.mla_expand off), to compare with the
 *                        expanded form prefill steps take by default
 *   benchmarks only, wrong outputs (cuda_tuning, cuda/tuning.h):
 *   --ablate=attn,norm,qkv,o,gu,down,head,moe  leave those kernels out of every
 *                        step, to see what each costs
 *   --skip-comm          tensor parallelism without its collectives
 *
 * Drives the backend with hand-made steps (no scheduler): TTFT of one
 * 2048-token prompt, prefill throughput of a 16K-token step (8 x 2048),
 * batch-1 decode at 1K context, and batched decode at 8 / 64 / 256 sequences
 * (at 1024, 256 and 64 tokens of context: 16K tokens at most).
 * Wall-clock per forward() (each ends in a stream sync), median of repeats.
 */
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

#include <cuda_profiler_api.h>
#include <cuda_runtime.h>

#include "cuda/tuning.h"
#include "model/backend.h"
#include "tests/gpu/gpu_util.h"

#define BS 16
static double g_bw; /* bytes a second the floors assume (--bw, else by device) */
static int g_ctxb = 160; /* blocks per sequence (2560 tokens; --long sets more) */


static model_backend *g_be;
static int g_V;
static int32_t *g_bt; /* [seq][g_ctxb] */
static struct model_sampling g_s;

/* One step: ns sequences, each len tokens at positions start..start+len-1,
 * all of them prompt positions (a prompt of start + len tokens, as the
 * scheduler marks a prefill: MLA takes the expanded form for them; a
 * decode step's one token a sequence the absorbed form all the same). */
static double step(int ns, int start, int len)
{
    int T = ns * len;
    int32_t *ids = malloc(T * 4), *pos = malloc(T * 4), *hist = calloc((size_t)(start + len), 4);
    int64_t *slots = malloc(T * 8);
    struct step_seq *sq = calloc(ns, sizeof *sq);
    static uint64_t r = 1;
    for (int k = 0, t = 0; k < ns; k++) {
        sq[k] = (struct step_seq){.query_start = t, .query_len = len, .context_len = start + len,
                                  .block_table = g_bt + (size_t)k * g_ctxb, .n_blocks = g_ctxb, .want_sample = true,
                                  .sampling = &g_s, .history = hist, .n_prompt = start + len,
                                  .n_history = start + len,
                                  .state_slot = k};
        for (int j = 0; j < len; j++, t++) {
            int p = start + j;
            r = r * 6364136223846793005ULL + 1442695040888963407ULL;
            ids[t] = (int32_t)((r >> 33) % (uint64_t)g_V);
            pos[t] = p;
            slots[t] = (int64_t)sq[k].block_table[p / BS] * BS + p % BS;
        }
    }
    struct step st = {.n_tokens = T, .token_ids = ids, .positions = pos, .slots = slots, .n_seqs = ns, .seqs = sq};
    char err[256];
    double t0 = now_s();
    if (g_be->ops->forward(g_be, &st, err, sizeof err)) {
        fprintf(stderr, "forward: %s\n", err);
        exit(1);
    }
    double dt = now_s() - t0;
    free(ids), free(pos), free(slots), free(sq), free(hist);
    return dt;
}

static double median_decode(int ns, int ctx, int n)
{
    double *t = malloc(n * sizeof *t);
    step(ns, ctx, 1); /* warm-up: graph capture for this bucket */
    for (int i = 0; i < n; i++) t[i] = step(ns, ctx + 1 + i, 1);
    qsort(t, n, sizeof *t, cmp_double);
    double m = t[n / 2];
    free(t);
    return m;
}


/* --long: one long sequence, chunked prefill then decode (see the header). */
static void bench_long(int n, int chunk, size_t wbytes, size_t kv_tok)
{
    if (chunk < 1 || chunk > 16384) chunk = 8192;
    double total = 0, first = 0, last = 0;
    int n_chunks = 0;
    for (int start = 0; start < n; start += chunk) {
        int len = n - start < chunk ? n - start : chunk;
        double t = step(1, start, len);
        if (!n_chunks) first = t;
        last = t;
        total += t;
        n_chunks++;
    }
    printf("long prompt %d tokens in %d chunks of %d: TTFT %.3f s = %.0f tok/s; first chunk %.1f ms (%.0f tok/s), "
           "last %.1f ms (%.0f tok/s, over %d cached)\n",
           n, n_chunks, chunk, total, n / total, first * 1e3, (n < chunk ? n : chunk) / first, last * 1e3,
           (n - (n_chunks - 1) * chunk) / last, (n_chunks - 1) * chunk);
    int ctxs[] = {1024, 8192, 32768, 65536, 131072, 262144, 524288};
    for (int i = 0; i < (int)(sizeof ctxs / sizeof *ctxs); i++) {
        int c = ctxs[i] < n - 40 ? ctxs[i] : n - 40;
        if (c < 1 || (i && ctxs[i - 1] >= n - 40)) break;
        double d = median_decode(1, c, 32);
        double floor_s = (double)(wbytes + (size_t)c * kv_tok) / g_bw;
        printf("long decode batch 1 @ %d ctx: %.3f ms/step = %.1f tok/s; floor %.3f ms (weights + %.2f GB of KV) = "
               "%.1f tok/s (%.0f%%)\n",
               c, d * 1e3, 1 / d, floor_s * 1e3, (double)c * kv_tok / 1e9, 1 / floor_s, 100 * floor_s / d);
    }
}

/* bytes one pass over weight matrix t reads on the GPU: bf16, or packed
 * codes plus f16/bf16 scales and byte zero points (cuda/qgemm.h); 0 for a
 * tensor the layer lacks */
static size_t read_bytes(const struct model_tensor *t)
{
    if (!t->data && t->dtype != MODEL_DT_QPACK) return 0;
    size_t rows = t->ne[1] > 0 ? (size_t)t->ne[1] : 1, cols = (size_t)t->ne[0];
    if (t->dtype != MODEL_DT_QPACK || !t->quant) return rows * cols * 2;
    const struct model_quant *q = t->quant;
    return rows * ((cols * (size_t)q->bits + 7) / 8 + 15) / 16 * 16 + rows * (size_t)q->n_groups * (q->sym ? 2 : 3);
}

/* The weight bytes a batch-1 decode step reads: every layer's mixer (GQA,
 * MLA with its indexer, KDA), its FFN (dense; MoE: the router, top-k routed
 * experts, the shared experts), the LM head. */
static size_t decode_bytes(const model *m)
{
    const struct model_config *c = model_get_config(m);
    const struct model_weights *w = model_get_weights(m);
    size_t b = read_bytes(c->tie_embeddings ? &w->tok_embd : &w->lm_head);
    for (int l = 0; l < c->n_layer; l++) {
        const struct model_layer_weights *L = &w->layers[l];
        struct model_layer_kind k = model_layer_kind_of(c, l);
        if (k.mixer == MODEL_MIXER_MLA) {
            const struct model_mla_weights *a = &L->mla;
            const struct model_tensor *ts[] = {&a->q_a, &a->q_b, &a->q, &a->kv_a, &a->kv_b, &a->o,
                                               &a->ix_wq_b, &a->ix_wk, &a->ix_weights, &a->ix_kpool_gate};
            for (size_t i = 0; i < sizeof ts / sizeof ts[0]; i++) b += read_bytes(ts[i]);
        } else if (k.mixer == MODEL_MIXER_KDA) {
            const struct model_kda_weights *a = &L->kda;
            const struct model_tensor *ts[] = {&a->q, &a->k, &a->v, &a->f_a, &a->f_b, &a->b, &a->g_a, &a->g_b, &a->o};
            for (size_t i = 0; i < sizeof ts / sizeof ts[0]; i++) b += read_bytes(ts[i]);
        } else {
            const struct model_tensor *ts[] = {&L->wq, &L->wk, &L->wv, &L->wo};
            for (size_t i = 0; i < sizeof ts / sizeof ts[0]; i++) b += read_bytes(ts[i]);
        }
        if (k.ffn == MODEL_FFN_MOE) {
            const struct model_moe_weights *e = &L->moe;
            b += read_bytes(&e->router) + read_bytes(&e->sh_gate) + read_bytes(&e->sh_up) + read_bytes(&e->sh_down);
            /* expert 0's bytes for each of the top-k (experts of a layer share a format but where ignore says) */
            b += (size_t)c->moe.n_expert_used * (read_bytes(&e->gate[0]) + read_bytes(&e->up[0]) + read_bytes(&e->down[0]));
        } else {
            const struct model_tensor *ts[] = {&L->w_gate, &L->w_up, &L->w_down};
            for (size_t i = 0; i < sizeof ts / sizeof ts[0]; i++) b += read_bytes(ts[i]);
        }
    }
    return b;
}

/* the value of option name ("--name=value") in a, or NULL */
static const char *opt(const char *a, const char *name)
{
    size_t n = strlen(name);
    return !strncmp(a, name, n) && a[n] == '=' ? a + n + 1 : NULL;
}

int main(int argc, char **argv)
{
    const char *pos_args[2] = {"tools/configs/llama-3.1-8b", "tests/models/tiny-qwen3"};
    const char *only = NULL, *prof = NULL, *decode_list = NULL, *kv = NULL, *v;
    int tp = 1, nseq = 256, long_n = 0, big = 0, chunk = 8192, npos = 0;
    bool eager = false;
    for (int i = 1; i < argc; i++) {
        const char *a = argv[i];
        if ((v = opt(a, "--tp"))) tp = atoi(v);
        else if ((v = opt(a, "--seqs"))) nseq = atoi(v);
        else if ((v = opt(a, "--only"))) only = v;
        else if ((v = opt(a, "--decode"))) decode_list = v;
        else if ((v = opt(a, "--kv-cache-dtype"))) kv = v;
        else if ((v = opt(a, "--big"))) big = atoi(v);
        else if ((v = opt(a, "--long"))) long_n = atoi(v);
        else if ((v = opt(a, "--chunk"))) chunk = atoi(v);
        else if ((v = opt(a, "--bw"))) g_bw = atof(v) * 1e12;
        else if ((v = opt(a, "--profile"))) prof = v;
        else if (!strcmp(a, "--enforce-eager")) eager = true;
        else if (!strcmp(a, "--no-warmup")) cuda_tuning.warmup = false;
        else if (!strcmp(a, "--nccl")) cuda_tuning.tp_peer_allreduce = false;
        else if (!strcmp(a, "--skip-comm")) cuda_tuning.tp_skip_comm = true;
        else if (!strcmp(a, "--mla-absorbed")) cuda_tuning.mla_expand = false;
        else if ((v = opt(a, "--ablate")) && cuda_ablate_parse(v) >= 0)
            cuda_tuning.ablate = (unsigned)cuda_ablate_parse(v);
        else if (a[0] != '-' && npos < 2) pos_args[npos++] = a;
        else {
            fprintf(stderr, "bench_gpu: unknown or bad argument %s (options: tests/gpu/bench_gpu.c)\n", a);
            return 2;
        }
    }
    const char *cfg = pos_args[0], *tok = pos_args[1];
    char err[512];
    if (g_bw <= 0) {
        struct cudaDeviceProp prop;
        bool h200 = cudaGetDeviceProperties(&prop, 0) == cudaSuccess && strstr(prop.name, "H200");
        g_bw = h200 ? 4.3e12 : 3.35e12;
    }
    double t0 = now_s();
    struct model_load_opts lo = {.tokenizer = tok, .load_format = "dummy"};
    model *m = model_load(cfg, &lo, err, sizeof err);
    if (!m) {
        fprintf(stderr, "load: %s\n", err);
        return 1;
    }
    const struct model_config *c = model_get_config(m);
    g_V = c->n_vocab;
    if (tp < 1) tp = 1;
    if (nseq < 8) nseq = 8;
    if (long_n > 0) { /* one sequence: its blocks, every one of them */
        if (long_n < 2048) long_n = 2048;
        nseq = 1;
        g_ctxb = (long_n + BS - 1) / BS + 1;
    }
    if (big <= 8 || big > nseq) big = 0;
    struct model_backend_opts bo = {.device = "cuda", .max_tokens_per_step = big > 8 ? big * 2048 : 16384,
                                    .max_seqs_per_step = 256,
                                    .max_ctx = g_ctxb * BS, .tensor_parallel_size = tp,
                                    .kv_cache_dtype = kv, .enforce_eager = eager};
    g_be = model_backend_create(m, &bo, err, sizeof err);
    if (!g_be) {
        fprintf(stderr, "backend: %s\n", err);
        return 1;
    }
    if (g_be->ops->kv_alloc(g_be, nseq * g_ctxb, BS, err, sizeof err)) {
        fprintf(stderr, "kv: %s\n", err);
        return 1;
    }
    /* recurrent layers (KDA): a state slot a sequence, slot i for sequence i */
    if (model_state_bytes(c) > 0 && g_be->ops->state_alloc(g_be, nseq, err, sizeof err)) {
        fprintf(stderr, "state: %s\n", err);
        return 1;
    }
    g_bt = malloc((size_t)nseq * g_ctxb * 4);
    for (int i = 0; i < nseq * g_ctxb; i++) g_bt[i] = (int32_t)((i * 7919L) % (nseq * g_ctxb)); /* scattered */
    model_sampling_default(&g_s);
    size_t wbytes = 0, lbytes = 0, hbytes = 0; /* all, the layers', the LM head's */
    {
        size_t E = c->n_embd, F = c->n_ff, Q = (size_t)c->n_head * c->head_dim, KV = (size_t)c->n_head_kv * c->head_dim;
        lbytes = 2 * c->n_layer * (E * (Q + 2 * KV) + Q * E + 3 * E * F);
        hbytes = 2 * (size_t)c->n_vocab * E;
        /* what a decode step reads: packed weights (a quantization_config) at
         * their codes, scales and zero points */
        wbytes = decode_bytes(m);
    }
    /* a prefill step's GEMM flops: 2 a bf16 weight (2 bytes) for every token
     * through the layers, the LM head for each sequence's last token only */
#define PREFILL_FLOPS(ntok, nseq) ((double)lbytes * (ntok) + (double)hbytes * (nseq))
    printf("shape %s: %d layers, embd %d, ff %d, heads %d/%d, vocab %d; weights read per step %.2f GB; load %.1f s; "
           "tensor parallel %d\n",
           cfg, c->n_layer, c->n_embd, c->n_ff, c->n_head, c->n_head_kv, c->n_vocab, wbytes / 1e9, now_s() - t0, tp);
    wbytes /= (size_t)tp; /* each GPU reads its share: the floor below is per GPU */

    if (long_n > 0) {
        bool kv8 = false; /* as the backend read --kv-cache-dtype (it accepted it above) */
        model_kv_dtype(&bo, "cuda", &kv8, err, sizeof err);
        /* one GPU's KV bytes a token, every layer kind as the backend lays it out */
        size_t kv_tok = g_be->ops->kv_block_bytes(g_be, BS) / BS;
        (void)kv8;
        step(1, 0, 64); /* warm-up */
        bench_long(long_n, chunk, wbytes, kv_tok);
        goto done;
    }
    bool decode_only = only && (strcmp(only, "decode") == 0 || strcmp(only, "batches") == 0);
    step(1, 0, 64); /* warm-up */
    if (decode_only) goto decode;
    double tt[5];
    for (int i = 0; i < 5; i++) tt[i] = step(1, 0, 2048);
    qsort(tt, 5, sizeof *tt, cmp_double);
    printf("prefill 1 x 2048: TTFT %.1f ms (%.0f tok/s, %.0f TFLOP/s on the GEMMs)\n", tt[2] * 1e3, 2048 / tt[2],
           PREFILL_FLOPS(2048, 1) / tt[2] / 1e12);
    for (int i = 0; i < 3; i++) tt[i] = step(8, 0, 2048);
    qsort(tt, 3, sizeof *tt, cmp_double);
    printf("prefill 8 x 2048 (one 16384-token step): %.1f ms, %.0f tok/s (%.0f TFLOP/s on the GEMMs)\n",
           tt[1] * 1e3, 16384 / tt[1], PREFILL_FLOPS(16384, 8) / tt[1] / 1e12);
    for (int r = 0; big > 0 && r < 4; r++) { /* sustained: 8 steps back to back, 8 and big prompts alternating */
        int ns = r % 2 ? big : 8;
        double sum = 0;
        for (int i = 0; i < 8; i++) sum += step(ns, 0, 2048);
        printf("prefill %d x 2048 sustained (8 steps of %d tokens): %.1f ms a step, %.0f tok/s\n", ns, ns * 2048,
               sum / 8 * 1e3, ns * 2048 * 8 / sum);
    }
    if (only && strcmp(only, "prefill") == 0) goto done;
    if (prof && strcmp(prof, "prefill") == 0) { /* one 16384-token step for ncu, then stop */
        cudaProfilerStart();
        step(8, 0, 2048);
        cudaProfilerStop();
        goto done;
    }

decode:
    if (only && strcmp(only, "batches") == 0) goto batches;
    step(1, 0, 1024);
    double d1 = median_decode(1, 1024, 128);
    printf("decode batch 1 @ 1K ctx: %.3f ms/step = %.1f tok/s; floor %.1f tok/s at %.2f TB/s (%.0f%%)\n", d1 * 1e3,
           1 / d1, g_bw / wbytes, g_bw / 1e12, 100 * (1 / d1) / (g_bw / wbytes));
    if (prof && strcmp(prof, "decode") == 0) {
        cudaProfilerStart();
        step(1, 1200, 1), step(1, 1201, 1);
        cudaProfilerStop();
    }
batches:
    if (decode_list) { /* "BxC,...": batch B at context C (KV unwritten: timing only) */
        for (const char *q = decode_list; *q;) {
            int b = 0, ctx = 0, n = 0;
            if (sscanf(q, "%dx%d%n", &b, &ctx, &n) != 2 || b < 1 || b > nseq || ctx < 1 || ctx + 40 > g_ctxb * BS) {
                fprintf(stderr, "--decode: expected BxC with B <= %d, C <= %d\n", nseq, g_ctxb * BS - 40);
                return 1;
            }
            double d = median_decode(b, ctx, 32);
            printf("decode batch %d @ %d ctx: %.3f ms/step = %.0f tok/s\n", b, ctx, d * 1e3, b / d);
            q += n;
            if (*q == ',') q++;
        }
        goto done;
    }
    if (decode_only) goto done;
    int bsz[] = {8, 64, 256};
    for (int k = 0; k < 3; k++) {
        int b = bsz[k];
        if (b > nseq) break;
        step(b, 0, 1024 > 16384 / b ? 16384 / b : 1024);
        int ctx = 1024 > 16384 / b ? 16384 / b : 1024;
        double d = median_decode(b, ctx, 32);
        printf("decode batch %d @ %d ctx: %.3f ms/step = %.0f tok/s\n", b, ctx, d * 1e3, b / d);
    }
done:
    model_backend_destroy(g_be);
    model_free(m);
    return 0;
}

/* cuda_backend.c - the GPU backend (model/backend.h, device "cuda") for the
 * Llama family on one GPU or, tensor parallel, across N GPUs of one host.
 *
 * Tensor parallelism (opts->tensor_parallel_size = N > 1, Megatron style):
 * rank k runs on device k with its own stream, cuBLAS handle and NCCL
 * communicator (ncclCommInitAll). Q|K|V and gate|up are split by output rows
 * (rank k holds heads [k H/N, (k+1) H/N), KV heads likewise, FFN columns
 * [k F/N, (k+1) F/N)); the output and down projections are split by input
 * columns, each rank's f32 partial product is summed by an all-reduce and
 * rounded to bf16 once, as the one-GPU path rounds its GEMM output. Small
 * all-reduces (decode steps: up to 8 MiB / (N - 1)) run
 * as one kernel over peer memory (tp.cu, cuda_peer_allreduce: every rank
 * reads every rank's partial over NVLink/PCIe and sums in rank order, the
 * bf16 rounding in the same pass) when every pair of GPUs has peer access;
 * larger ones, and all of them with cuda_tuning.tp_peer_allreduce off, through NCCL. The
 * embedding and the LM head are split by vocabulary: a rank gathers the
 * embedding rows it holds (zeros elsewhere) and an all-reduce completes x; for
 * the LM head each rank reduces its slice of every logit row to (max, sum,
 * argmax), an all-gather shares those and every rank combines them in the
 * same order, so all ranks agree on the greedy token. Rows sampled on the
 * host copy each rank's slice into one pinned row. Head counts, KV heads and
 * FFN width must divide by N (checked at creation). An MLA layer's latent
 * projections run whole on every rank and its heads split after them (its
 * latent cache whole on every rank: cuda/mla.h). The scheduler and KV pool
 * stay single: every rank receives the same step (one pinned input buffer)
 * and holds its KV heads of every block.
 *
 * The backend is four files: this one (creation, KV memory, warm-up,
 * teardown), weights.c (a rank's share of the model and its working
 * memory), step.c (a step: the plan, the launches, graphs, forward()) and
 * crew.c (the rank threads); cuda_internal.h holds what they share.
 *
 * KV memory, per rank: one region per layer at k->kv_off[l], its size its
 * kind's entry per token (kv_layer_token_bytes, so a block's bytes are the
 * sum over the plan's layers): a GQA layer K then V, each
 * [n_blocks + 1][block_size][n_kv_heads / N][head_dim]; an MLA layer
 * [n_blocks + 1][block_size][kv_lora_rank + qk_rope_head_dim] (the normed
 * latent and the rope key, no heads, no V: cuda/mla.h); a layer without
 * paged entries nothing. bf16, or fp8 e4m3 (--kv-cache-dtype fp8: half the
 * bytes per token, so twice the tokens in the same memory; written by
 * RoPE's KV write or MLA's entry write, widened exactly by every attention
 * kernel as it loads); the last block is the pad block. With opts.mtp the MTP
 * layer's region (layer n_layer, its kind's entry) follows the decoder
 * layers', then each block's kept hidden state, bf16 [n_blocks + 1][E]
 * (cuda/mtp.h), at k->kv_off[n_layer + 1].
 *
 * Memory: weights, KV, activations for max_tokens_per_step tokens, logits for
 * max_seqs_per_step rows and the pinned staging buffers are allocated at
 * creation and kv_alloc; forward() allocates nothing.
 *
 * Settings that are not flags come from cuda_tuning (tuning.h), copied at
 * creation. Testing aid: tp_fault_rank / tp_fault_step make a rank fail its
 * STEP-th forward (counted from 1) before enqueueing anything, as a dead GPU
 * would, while the other ranks wait in their collectives. Benchmark aids
 * (outputs wrong): tp_skip_comm leaves the collectives out, so the
 * difference in step time is what they cost; ablate leaves kernels out.
 */
#include <cuda_runtime.h>
#include <math.h>
#include <nccl.h>
#include <omp.h>
#include <stdatomic.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "cuda/cuda_internal.h"
#include "cuda/hc.h"
#include "cuda/kda.h"
#include "cuda/mla.h"
#include "cuda/moe.h"
#include "cuda/mtp.h"

bool model_cuda_available(void)
{
    int n = 0;
    return cudaGetDeviceCount(&n) == cudaSuccess && n > 0;
}

/* ---- construction -------------------------------------------------------------- */

static size_t kv_block_bytes(model_backend *mb, int block_size);
static int kv_alloc(model_backend *mb, int n_blocks, int block_size, char *err, size_t errlen);
static int warmup(struct cuda_backend *b, char *err, size_t errlen);
static int run_warmup(struct cuda_backend *b, char *err, size_t errlen);
static void destroy(model_backend *mb);
static size_t state_slot_bytes(model_backend *mb);
static int state_alloc(model_backend *mb, int n_slots, char *err, size_t errlen);


static const struct model_backend_ops cuda_ops = {
    .name = "cuda",
    .kv_block_bytes = kv_block_bytes,
    .kv_alloc = kv_alloc,
    .state_slot_bytes = state_slot_bytes,
    .state_alloc = state_alloc,
    .forward = cuda_forward,
    .destroy = destroy,
    .mtp_draft = cuda_mtp_draft,
};

struct cuda_tuning cuda_tuning = CUDA_TUNING_DEFAULTS;

/* cuda_tuning.ablate from a benchmark's option: kernels to leave out of
 * every step, to measure what each costs inside the decode graph (the step
 * time without it) */
int cuda_ablate_parse(const char *s)
{
    static const char *const names[] = {"attn", "norm", "qkv", "o", "gu", "down", "head", "moe"};
    int m = 0;
    while (s && *s) {
        size_t n = strcspn(s, ",");
        int bit = 0;
        for (int i = 0; i < (int)(sizeof names / sizeof *names); i++)
            if (strlen(names[i]) == n && !strncmp(s, names[i], n)) bit = 1 << i;
        if (!bit) return -1;
        m |= bit;
        s += n + (s[n] == ',');
    }
    return m;
}

/* Decides b->peer (before the ranks initialize: they enable peer access and
 * allocate the buffers): N <= CUDA_PEER_MAX ranks with peer access between
 * every pair, and t.tp_peer_allreduce. The abort flag lives in pinned
 * host memory mapped into every device. */
static int peer_setup(struct cuda_backend *b, char *err, size_t errlen)
{
    b->peer = b->tp <= CUDA_PEER_MAX && b->t.tp_peer_allreduce;
    for (int i = 0; i < b->tp && b->peer; i++)
        for (int j = 0; j < b->tp && b->peer; j++) {
            int ok = 0;
            if (i != j && (cudaDeviceCanAccessPeer(&ok, b->r[i].dev, b->r[j].dev) != cudaSuccess || !ok))
                b->peer = false;
        }
    if (!b->peer) return 0;
    /* each rank reads N - 1 peers' buffers, a ring all-reduce moves about
     * twice one buffer: the bound shrinks with N (8 MiB measured at N = 2
     * only: every decode step's all-reduces fit, and up to there the one
     * launch beat NCCL's) */
    size_t bytes = ((size_t)8 << 20) / (size_t)(b->tp - 1);
    b->peer_elems = bytes / 4;
    if (b->peer_elems > (size_t)b->max_tokens * b->c.n_embd) b->peer_elems = (size_t)b->max_tokens * b->c.n_embd;
    CK(cudaHostAlloc((void **)&b->peer_abort, sizeof(int), cudaHostAllocMapped | cudaHostAllocPortable));
    *b->peer_abort = 0;
    return 0;
fail:
    return SL_EDEVICE;
}

model_backend *model_cuda_backend_create(const model *m, const struct model_backend_opts *opts, char *err,
                                         size_t errlen)
{
    if (!m) {
        sl_seterr(err, errlen, "no model");
        return NULL;
    }
    int ndev = 0;
    if (cudaGetDeviceCount(&ndev) != cudaSuccess || ndev <= 0) {
        sl_seterr(err, errlen, "no CUDA device");
        return NULL;
    }
    const struct model_config *c = model_get_config(m);
    int N = opts && opts->tensor_parallel_size > 1 ? opts->tensor_parallel_size : 1;
    if (N > ndev || N > MAX_TP) {
        sl_seterr(err, errlen, "--tensor-parallel-size %d: this host has %d GPU%s%s", N, ndev, ndev == 1 ? "" : "s",
                  N > MAX_TP ? " (and at most 16 ranks are supported)" : "");
        return NULL;
    }
    /* the plan first: a kind it lacks is the reason, whatever its shapes */
    /* gqa: some layer is GQA; plain: every layer gqa + dense + plain residual (the fused one-token path may run) */
    bool gqa = false, plain = true;
    for (int l = 0; l < c->n_layer; l++) {
        struct model_layer_kind k = model_layer_kind_of(c, l);
        gqa |= k.mixer == MODEL_MIXER_GQA;
        plain &= k.mixer == MODEL_MIXER_GQA && k.ffn == MODEL_FFN_DENSE && k.resid == MODEL_RESID_PLAIN;
        if ((k.mixer != MODEL_MIXER_GQA && k.mixer != MODEL_MIXER_MLA && k.mixer != MODEL_MIXER_KDA) ||
            (k.ffn != MODEL_FFN_DENSE && k.ffn != MODEL_FFN_MOE)) {
            sl_seterr(err, errlen,
                      "cuda: layer %d is %s + %s; the GPU backend runs gqa, mla or kda + dense or moe layers only "
                      "(use --device cpu)",
                      l, model_mixer_name(k.mixer), model_ffn_name(k.ffn));
            return NULL;
        }
        if (k.ffn == MODEL_FFN_MOE && cuda_moe_check(c, N, l, err, errlen)) return NULL;
    }
    if (cuda_mla_check(c, N, err, errlen)) return NULL;
    if (c->hc.mult > 0 && cuda_hc_check(c, err, errlen)) return NULL;
    if (model_tp_check(c, N, err, errlen)) return NULL;
    /* speculative method mtp: the MTP layer (layer n_layer of the plan) too (backend.c has refused a model
     * without one) */
    bool mtp = opts && opts->mtp && c->n_mtp_layer > 0;
    if (mtp && cuda_mtp_check(c, N, err, errlen)) return NULL;
    if (gqa && (c->head_dim % 8 || c->head_dim > 256 || c->n_head / c->n_head_kv > CUDA_ATTN_ROWS)) {
        sl_seterr(err, errlen, "cuda: head_dim %d / %d heads per KV head unsupported (head_dim %% 8 == 0, <= 256; <= %d)",
               c->head_dim, c->n_head / c->n_head_kv, CUDA_ATTN_ROWS);
        return NULL;
    }
    struct cuda_backend *b = calloc(1, sizeof *b);
    if (!b) {
        sl_seterr(err, errlen, "out of memory");
        return NULL;
    }
    b->base.ops = &cuda_ops;
    b->base.m = m;
    b->c = *c;
    if (!mtp) b->c.n_mtp_layer = 0; /* the MTP layer's weights stay unread */
    b->base.has_mtp = mtp;
    b->w = model_get_weights(m);
    b->tp = N;
    if (model_kv_dtype(opts, "cuda", &b->kv8, err, errlen)) {
        free(b);
        return NULL;
    }
    b->t = cuda_tuning;
    b->skip_comm = N > 1 && b->t.tp_skip_comm;
    if (b->skip_comm) fprintf(stderr, "cuda: tp_skip_comm: collectives left out, outputs are wrong\n");
    if (b->t.ablate) fprintf(stderr, "cuda: ablate 0x%x: kernels left out, outputs are wrong\n", b->t.ablate);
    b->max_tokens = opts && opts->max_tokens_per_step > 0 ? opts->max_tokens_per_step : 2048;
    b->max_seqs = opts && opts->max_seqs_per_step > 0 ? opts->max_seqs_per_step : 256;
    if (b->max_seqs > b->max_tokens) b->max_seqs = b->max_tokens;
    /* speculative decoding: a sequence with drafts gets a logit row for each
     * verified position, sampled on the host (step.c, verify_rows) */
    b->max_draft = opts && opts->max_draft_tokens > 0 ? opts->max_draft_tokens : 0;
    b->base.max_draft_tokens = b->max_draft;
    long mr = (long)b->max_seqs * (1 + b->max_draft);
    b->max_rows = mr > b->max_tokens ? b->max_tokens : (int)mr;
    b->max_ctx = opts && opts->max_ctx > 0 ? opts->max_ctx : c->n_ctx_train;
    if (b->max_ctx <= 0) b->max_ctx = 4096;
    b->graphs = !(opts && opts->enforce_eager);
    for (int l = 0; l < c->n_layer; l++) {
        const struct model_layer_weights *lw = &b->w->layers[l];
        const struct model_tensor *ts[] = {&lw->wq, &lw->wk, &lw->wv, &lw->wo, &lw->w_gate, &lw->w_up, &lw->w_down};
        for (size_t i = 0; i < sizeof ts / sizeof ts[0]; i++) b->qlayers |= ts[i]->dtype == MODEL_DT_QPACK;
    }
    /* the fused decode kernels read bf16 weights only */
    b->fused = c->n_embd % 8 == 0 && c->n_ff % 8 == 0 && (c->n_head * c->head_dim) % 8 == 0 &&
               (size_t)CUDA_GEMV_MAX_T * c->n_embd * 2 <= CUDA_GEMV_NORM_SMEM && !b->qlayers && plain &&
               c->moe.swiglu_limit == 0 && c->moe.n_expert == 0 && !mtp; /* MTP reads x and delta after the step */
    b->warmup = b->t.warmup;
    b->state_bytes = model_state_bytes(c) / (size_t)N; /* each rank holds its KDA heads' share (kda_step.c) */
    /* drafts on KDA layers: the slots rolled to the last accepted one after the verification, by replaying the
     * accepted drafts' inputs (cuda/kda.h; each rank its heads, so at any TP) */
    b->base.state_rollback = true;
    b->tc_rows = cuda_attention_tc_ok(c->head_dim, c->n_head / c->n_head_kv) ? CUDA_ATTN_TC_ROWS : 0;
    b->part_rows = (int)((b->max_tokens < 256 ? b->max_tokens : 256) * (c->n_head / c->n_head_kv));
    b->r = calloc((size_t)N, sizeof *b->r);
    if (!b->r) {
        sl_seterr(err, errlen, "out of memory");
        goto fail;
    }
    for (int i = 0; i < N; i++) b->r[i] = (struct rank){.b = b, .id = i, .dev = i};
    if (N > 1 && peer_setup(b, err, errlen)) goto fail;
    /* programmatic dependent launch: with N > 1 on only with the peer
     * all-reduce, which lets the GEMV after it start loading weights (TP=2
     * batch-1 decode 326 -> 339 tok/s; with NCCL's kernels between them it
     * was no faster, 288.3 vs 288.2) */
    if (N > 1 && !b->peer) cuda_gemv_select(-1, 0, -1);
    struct cudaDeviceProp prop;
    CK(cudaSetDevice(0));
    CK(cudaGetDeviceProperties(&prop, 0));
    b->n_sm = prop.multiProcessorCount;
    if (N > 1) {
        ncclComm_t comms[MAX_TP];
        int devs[MAX_TP];
        for (int i = 0; i < N; i++) devs[i] = i;
        NC(ncclCommInitAll(comms, N, devs));
        for (int i = 0; i < N; i++) b->r[i].comm = comms[i];
        CK(cudaSetDevice(0));
    }
    size_t S = b->max_rows, T = b->max_tokens, V = c->n_vocab;
    CK(cudaHostAlloc((void **)&b->hout, S * (8 + sizeof *b->hsout), cudaHostAllocMapped | cudaHostAllocPortable));
    CK(cudaHostGetDevicePointer((void **)&b->dout, b->hout, 0));
    b->hout_tok = (int32_t *)b->hout, b->hout_lp = (float *)(b->hout + S * 4);
    b->hsout = (struct cuda_sample_out *)(b->hout + S * 8);
    if (cuda_crew_run(b, JOB_INIT, err, errlen)) goto fail;
    CK(cudaSetDevice(0));
    if (cuda_mla_xsetup(b, err, errlen)) goto fail;
    if (mtp && cuda_mtp_create(b, err, errlen)) goto fail;

    CK(cudaHostAlloc((void **)&b->hlog, S * V * 4, cudaHostAllocPortable));
    b->nt = omp_get_max_threads();
    b->samp_bytes = (model_sample_scratch_bytes(c->n_vocab) + 63) & ~(size_t)63;
    b->samp = malloc(b->samp_bytes * (size_t)b->nt);
    b->host_rows = malloc(S * sizeof *b->host_rows);
    b->row_seq = malloc(S * sizeof *b->row_seq);
    b->tok_seq = malloc(T * sizeof *b->tok_seq);
    b->row_host = calloc(S, sizeof *b->row_host);
    b->row_mode = calloc(S, 1);
    b->rng_before = calloc(S, sizeof *b->rng_before);
    b->pen_mark = calloc(V, sizeof *b->pen_mark);
    b->dev_sample = N == 1;
    if (!b->samp || !b->host_rows || !b->row_seq || !b->tok_seq || !b->row_host || !b->row_mode || !b->rng_before ||
        !b->pen_mark) {
        sl_seterr(err, errlen, "out of host memory");
        goto fail;
    }
    for (int bk = 1; bk <= b->max_seqs && b->n_bucket < NBUCKET; bk *= 2) b->bucket[b->n_bucket++] = bk;
    if (b->n_bucket < NBUCKET && b->bucket[b->n_bucket - 1] != b->max_seqs) b->bucket[b->n_bucket++] = b->max_seqs;
    return &b->base;
fail:
    destroy(&b->base);
    return NULL;
}

/* ---- KV ------------------------------------------------------------------------ */

/* Bytes of layer l's entry of one token on each GPU: its kind's values
 * (model_kv_token_elems; a GQA layer's KV heads split over the N ranks, an
 * MLA latent whole on each; none for a layer without paged entries). */
static size_t kv_layer_token_bytes(const struct cuda_backend *b, int l)
{
    size_t n = (size_t)model_kv_token_elems(&b->c, l);
    if (model_layer_kind_of(&b->c, l).mixer == MODEL_MIXER_GQA) n /= (size_t)b->tp;
    return n * (b->kv8 ? 1 : 2);
}

/* Bytes of one block on each GPU: the sum over the decoder layers, and with
 * opts.mtp the MTP layer's entries and the block's hidden state (bf16; its
 * tag lives on the host but is counted, as model_mtp_kv_bytes_per_block
 * says), and the indexer's cached pool keys (k-pools; allocated apart,
 * cuda_mla_kv_alloc). */
static size_t kv_block_bytes(model_backend *mb, int block_size)
{
    struct cuda_backend *b = (struct cuda_backend *)mb;
    size_t n = 0;
    for (int l = 0; l < model_n_layer_all(&b->c); l++) n += kv_layer_token_bytes(b, l);
    return n * (size_t)block_size + model_mtp_kv_bytes_per_block(&b->c, 2) +
           cuda_mla_pool_block_bytes(&b->c, block_size);
}

static void drop_graphs(struct rank *k)
{
    for (int i = 0; i < NBUCKET; i++) {
        if (k->gexec[i]) {
            cudaGraphExecDestroy(k->gexec[i]);
            k->gexec[i] = NULL;
        }
        for (int v = 0; v < VGRAPH_K; v++)
            if (k->vexec[v][i]) {
                cudaGraphExecDestroy(k->vexec[v][i]);
                k->vexec[v][i] = NULL;
            }
    }
}

static size_t al(size_t o) { return (o + 15) & ~(size_t)15; }

int cuda_rank_kv_alloc(struct rank *k, char *err, size_t errlen)
{
    struct cuda_backend *b = k->b;
    int n_blocks = b->job.kv_blocks, block_size = b->job.block_size;
    CK(cudaSetDevice(k->dev));
    drop_graphs(k);
    cudaFree(k->kv);
    cudaFree(k->din);
    k->kv = NULL, k->din = NULL;
    size_t per_block = kv_block_bytes(&b->base, block_size) - cuda_mla_pool_block_bytes(&b->c, block_size);
    /* one more block: the pad block that padded graph tokens write */
    if (cuda_dmalloc((void **)&k->kv, (size_t)(n_blocks + 1) * per_block, err, errlen)) {
        sl_seterr(err, errlen, "kv_alloc: out of GPU memory on GPU %d for %d blocks (%.2f GB)", k->dev, n_blocks,
                  (double)(n_blocks + 1) * per_block / 1e9);
        return SL_ENOMEM;
    }
    k->kv_layer = (size_t)(n_blocks + 1) * block_size * k->KVH * b->c.head_dim;
    size_t n_all = (size_t)model_n_layer_all(&b->c);
    if (!k->kv_off && !(k->kv_off = malloc((n_all + 1) * sizeof *k->kv_off))) {
        sl_seterr(err, errlen, "out of host memory");
        return SL_ENOMEM;
    }
    for (size_t l = 0, o = 0; l <= n_all; l++) { /* the last: the end (the MTP hidden states) */
        k->kv_off[l] = o;
        if (l < n_all) o += (size_t)(n_blocks + 1) * block_size * kv_layer_token_bytes(b, (int)l);
    }
    if (cuda_dmalloc((void **)&k->din, b->lay.total, err, errlen)) return SL_ENOMEM;
    return cuda_mla_kv_alloc(k, n_blocks, block_size, err, errlen);
fail:
    return SL_EDEVICE;
}

/* The offsets of the regions a step fills, for steps of up to T tokens
 * and items attention items (y's srows, pen and total are left alone);
 * returns the end of the block tables (bt_cap entries). A step fills the
 * start of each region, so it copies the prefix of hin up to its last
 * block-table entry. */
static size_t lay_steps(struct inlay *y, size_t T, size_t S, size_t items, int bt_cap, bool kda, size_t mla)
{
    size_t o = 0;
    y->slots = o, o = al(o + T * 8);
    y->ids = o, o = al(o + T * 4);
    y->pos = o, o = al(o + T * 4);
    y->tok_part = o, o = al(o + T * 4);
    y->tok_nsplit = o, o = al(o + T * 4);
    y->tok_bt = o, o = al(o + T * 4);
    y->rows = o, o = al(o + S * 4);
    y->n_items = o, o = al(o + 4);
    y->items = o, o = al(o + items * sizeof(struct cuda_attn_item));
    y->max_items = (int)items;
    /* KDA: a step's sequences (at most min(T, S)) and its snapshots (each at a distinct query position) */
    y->kda_seqs = o, o = al(o + (kda ? (T < S ? T : S) : 0) * sizeof(struct cuda_kda_seq));
    y->kda_snaps = o, o = al(o + (kda ? T : 0) * sizeof(struct cuda_kda_snap));
    y->max_kda_snaps = kda ? (int)T : 0;
    y->mla = o, o = al(o + mla);
    y->bt = o, o = al(o + (size_t)bt_cap * 4);
    return o;
}

/* The layout a step packs into: a graph's (Tp tokens, Tp logit rows, the Tp *
 * MAXSPLIT items its attention grid reads) has the regions sized for Tp, so
 * a batch-1 step copies a few KB, where the full layout (sized for
 * max_tokens) puts ~1 MB before the block tables at 16K tokens a step. Its
 * regions end before the full layout's block tables end, inside din. */
struct inlay cuda_step_lay(const struct cuda_backend *b, int gi, int Tp)
{
    struct inlay y = b->lay_full;
    size_t items = (size_t)Tp * CUDA_ATTN_MAXSPLIT;
    if (gi >= 0 && items <= (size_t)y.max_items && Tp <= b->max_tokens)
        lay_steps(&y, (size_t)Tp, (size_t)Tp, items, b->bt_cap, b->state_bytes > 0, 0);
    return y;
}

static int kv_alloc(model_backend *mb, int n_blocks, int block_size, char *err, size_t errlen)
{
    struct cuda_backend *b = (struct cuda_backend *)mb;
    if (n_blocks <= 0 || block_size <= 0 || block_size > (1 << 20)) {
        sl_seterr(err, errlen, "kv_alloc: bad size (%d blocks of %d)", n_blocks, block_size);
        return SL_EINVAL;
    }
    if (b->base.fatal) {
        sl_seterr(err, errlen, "%s", b->base.fatal);
        return SL_EDEVICE;
    }
    cudaFreeHost(b->hin);
    b->hin = NULL, b->kv_blocks = 0;
    size_t T = b->max_tokens, S = b->max_seqs;
    /* items: a step's (splits only in steps of <= 256 tokens), and at least
     * the grid of every decode graph (Tp * MAXSPLIT, Tp <= S): the kernels
     * read a block's item before they know n_items */
    b->bt_cap = (int)(S * ((size_t)(b->max_ctx + block_size - 1) / block_size + 1));
    struct inlay *y = &b->lay_full;
    size_t o = lay_steps(y, T, b->max_rows, T + S + (S > 256 ? S : 256) * CUDA_ATTN_MAXSPLIT, b->bt_cap,
                         b->state_bytes > 0,
                         b->xplan ? cuda_mla_xbytes(b->max_tokens, b->max_seqs, b->xplan->max_items) : 0);
    size_t pc = S * (size_t)b->max_ctx;
    b->pen_cap = (int)(pc < 65536 ? 65536 : pc > (1u << 20) ? (1u << 20) : pc);
    y->srows = o, o = al(o + (size_t)b->max_rows * sizeof(struct cuda_sample_row));
    y->pen = o, o = al(o + (size_t)b->pen_cap * sizeof(struct cuda_sample_pen));
    y->total = o;
    b->lay = *y;
    cudaError_t e = cudaHostAlloc((void **)&b->hin, o, cudaHostAllocPortable);
    if (e != cudaSuccess) {
        sl_seterr(err, errlen, "kv_alloc: step buffers: %s", cudaGetErrorString(e));
        return SL_ENOMEM;
    }
    b->job.kv_blocks = n_blocks;
    b->job.block_size = block_size;
    int rc = cuda_crew_run(b, JOB_KV, err, errlen);
    if (rc && atomic_load(&b->failed)) {
        /* the ranks aborted their communicators: nothing can run any more */
        snprintf(b->dead, sizeof b->dead, "the GPU backend stopped: %s", err);
        b->base.fatal = b->dead;
    }
    if (rc) return rc;
    b->kv_blocks = n_blocks;
    b->block_size = block_size;
    if (b->mtp && (rc = cuda_mtp_kv_alloc(b, n_blocks, err, errlen))) return rc;
    return run_warmup(b, err, errlen);
}

/* The recurrent layers' states (kda_step.c), one slot per running sequence or snapshot; the bytes
 * of one slot on each GPU (each rank holds its KDA heads' share), as kv_block_bytes counts. */
static size_t state_slot_bytes(model_backend *mb) { return ((struct cuda_backend *)mb)->state_bytes; }

static int state_alloc(model_backend *mb, int n_slots, char *err, size_t errlen)
{
    struct cuda_backend *b = (struct cuda_backend *)mb;
    if (n_slots <= 0 || b->state_bytes == 0 || (size_t)n_slots > SIZE_MAX / b->state_bytes) {
        sl_seterr(err, errlen, "state_alloc: bad size (%d slots of %zu bytes)", n_slots, b->state_bytes);
        return SL_EINVAL;
    }
    if (b->base.fatal) {
        sl_seterr(err, errlen, "%s", b->base.fatal);
        return SL_EDEVICE;
    }
    /* the decode graphs hold the old pool's address */
    for (int i = 0; i < b->tp; i++) {
        cudaSetDevice(b->r[i].dev);
        drop_graphs(&b->r[i]);
    }
    b->state_slots = 0;
    int rc = cuda_kda_state_alloc(b, n_slots, err, errlen);
    if (rc) return rc;
    b->state_slots = n_slots;
    return b->kv_blocks ? run_warmup(b, err, errlen) : 0;
}

/* The warm-up once, after the first kv_alloc, or, with recurrent layers,
 * once their state slots are allocated too. */
static int run_warmup(struct cuda_backend *b, char *err, size_t errlen)
{
    if (!b->warmup || (b->state_bytes && !b->state_slots)) return 0;
    b->warmup = false;
    b->warming = true; /* tp_fault_step counts serving's steps only */
    int rc = warmup(b, err, errlen);
    b->warming = false;
    return rc;
}

/* One step of ns sequences of len tokens each at positions start.., sequence
 * k over blocks k * nbk .. (k + 1) * nbk - 1; the last token of each
 * sampled with *sp, or with nd > 0 its last nd tokens drafts to verify
 * (random token ids: what they are does not matter). */
static int warm_step(struct cuda_backend *b, int ns, int nbk, int start, int len, int nd,
                     const struct model_sampling *sp, char *err, size_t errlen)
{
    int T = ns * len, bs = b->block_size, rc = SL_ENOMEM;
    int32_t *ids = malloc((size_t)T * 4), *pos = malloc((size_t)T * 4), *bt = malloc((size_t)ns * nbk * 4);
    int32_t *hist = malloc((size_t)T * 4), *prompt = calloc((size_t)ns * (start + len), 4);
    int64_t *slots = malloc((size_t)T * 8);
    uint64_t *rng = calloc((size_t)ns, sizeof *rng);
    struct step_seq *sq = calloc((size_t)ns, sizeof *sq);
    struct model_sample_out *so = calloc((size_t)ns * (nd + 1), sizeof *so);
    if (ids && pos && bt && hist && prompt && slots && rng && sq && so) {
        for (int k = 0, t = 0; k < ns; k++) {
            for (int j = 0; j < nbk; j++) bt[k * nbk + j] = k * nbk + j;
            rng[k] = 0x9E3779B97F4A7C15ull + (uint64_t)k;
            sq[k] = (struct step_seq){.query_start = t, .query_len = len, .context_len = start + len,
                                      .block_table = bt + (size_t)k * nbk, .n_blocks = nbk, .want_sample = true,
                                      .sampling = sp, .rng = &rng[k], .state_slot = k};
            if (nd > 0) {
                /* the history: the query's tokens, the last nd of them the drafts */
                sq[k].history = hist + t, sq[k].n_prompt = len - nd, sq[k].n_history = len - nd;
                sq[k].n_draft = nd, sq[k].spec_out = so + (size_t)k * (nd + 1);
            } else if (len > 1) {
                /* a prompt's chunk (MLA's expanded form; zeros for its ids: penalties are off) */
                sq[k].history = prompt + (size_t)k * (start + len);
                sq[k].n_prompt = sq[k].n_history = start + len;
            }
            for (int i = 0; i < len; i++, t++) {
                int p = start + i;
                ids[t] = (int32_t)(((uint64_t)t * 2654435761u) % (uint64_t)b->c.n_vocab);
                pos[t] = p;
                slots[t] = (int64_t)bt[k * nbk + p / bs] * bs + p % bs;
                hist[t] = ids[t];
            }
        }
        struct step st = {.n_tokens = T, .token_ids = ids, .positions = pos, .slots = slots, .n_seqs = ns, .seqs = sq};
        rc = cuda_forward(&b->base, &st, err, errlen);
    } else {
        sl_seterr(err, errlen, "warm-up: out of host memory");
    }
    free(ids), free(pos), free(bt), free(hist), free(prompt), free(slots), free(rng), free(sq), free(so);
    return rc;
}

/* After the first kv_alloc: runs the kinds of step serving will, so that a
 * first request does not pay for what happens once (the kernels' lazy
 * loading, cuBLAS's first calls, each decode bucket's graph capture): a
 * prefill of up to 512 tokens, an 8-token chunk over it (split attention,
 * sampled), and a decode step at every graph bucket the pool's blocks can
 * hold; with method mtp each bucket's verify step too (its sequences' drafts
 * K = max_draft_tokens: the verify graph, when K <= VGRAPH_K) and, after each
 * step, the MTP pass graphs of the steps of its shape (cuda_mtp_pack), so
 * that the first speculative step of a bucket captures nothing. It writes
 * only KV blocks the engine has not handed out yet. A
 * step the configuration refuses only ends it early (with a line on
 * stderr); a failed GPU fails kv_alloc.
 * tuning.warmup off skips it (the first prefix-cache hit after start took
 * 25-37 ms in the engine without it, 7.7 with it, 6.2 later). */
static int warmup(struct cuda_backend *b, char *err, size_t errlen)
{
    int bs = b->block_size, C = b->max_tokens < 8 ? b->max_tokens : 8; /* the chunk's tokens */
    int P = b->max_tokens < 512 ? b->max_tokens : 512;
    if (P > b->max_ctx - C) P = b->max_ctx - C;
    int nbk = (P + C + bs - 1) / bs;
    if (P < 1 || nbk > b->kv_blocks) return 0;
    struct model_sampling greedy, samp;
    model_sampling_default(&greedy);
    samp = greedy;
    samp.temperature = 1.0f, samp.top_p = 0.9f, samp.seed = 1;
    int rc = warm_step(b, 1, nbk, 0, P, 0, &greedy, err, errlen);
    if (!rc) rc = warm_step(b, 1, nbk, P, C, 0, &samp, err, errlen);
    for (int i = 0; !rc && i < b->n_bucket; i++)
        if (b->bucket[i] <= b->kv_blocks && b->bucket[i] <= b->max_tokens &&
            (!b->state_bytes || b->bucket[i] <= b->state_slots))
            rc = warm_step(b, b->bucket[i], 1, 0, 1, 0, &greedy, err, errlen);
    /* method mtp: verify steps of K drafts a sequence, from position 1 (a sequence's first step has none) */
    int K = b->max_draft, vb = (K + 2 + bs - 1) / bs;
    for (int i = 0; !rc && b->mtp && K > 0 && !b->state_bytes && i < b->n_bucket; i++)
        if (b->bucket[i] * vb <= b->kv_blocks && b->bucket[i] * (K + 1) <= b->max_tokens &&
            K + 2 <= b->max_ctx)
            rc = warm_step(b, b->bucket[i], vb, 1, K + 1, K, &greedy, err, errlen);
    if (rc && !b->base.fatal) { /* a step this configuration refuses: serving can still start */
        fprintf(stderr, "cuda: warm-up left unfinished: %s\n", err);
        return 0;
    }
    if (rc) {
        char why[256];
        snprintf(why, sizeof why, "%s", err);
        sl_seterr(err, errlen, "warm-up: %s", why);
    }
    return rc;
}

/* ---- teardown ------------------------------------------------------------------ */

static void rank_free(struct rank *k, const struct model_config *c)
{
    cudaSetDevice(k->dev);
    if (k->st) cudaStreamSynchronize(k->st);
    drop_graphs(k);
    cuda_mtp_free(k);
    if (k->L) {
        for (int l = 0; l < model_n_layer_all(c); l++) {
            struct clayer *L = &k->L[l];
            cuda_mla_free(k, l);
            cudaFree(L->wqkv), cudaFree(L->wo), cudaFree(L->wgu), cudaFree(L->wdown);
            cudaFree(L->attn_norm), cudaFree(L->ffn_norm), cudaFree(L->bqkv), cudaFree(L->q_norm), cudaFree(L->k_norm);
            cuda_hc_free(k, l);
            cuda_moe_free(k, l);
            cuda_kda_free(k, l);
        }
        free(k->L);
    }
    if (k->lm_head != k->tok_embd) cudaFree(k->lm_head);
    cudaFree(k->tok_embd), cudaFree(k->out_norm), cudaFree(k->rope_cos), cudaFree(k->rope_sin), cudaFree(k->kv);
    cudaFree(k->x), cudaFree(k->xn), cudaFree(k->qkv), cudaFree(k->q), cudaFree(k->att), cudaFree(k->delta);
    cudaFree(k->deltaf), cudaFree(k->gu), cudaFree(k->h), cudaFree(k->hfin), cudaFree(k->logits);
    if (k->id) cudaFree(k->tok), cudaFree(k->lp), cudaFree(k->sout);
    cudaFree(k->amp), cudaFree(k->amp_all), cudaFree(k->part);
    cudaFree(k->cnt), cudaFree(k->pbuf[0]), cudaFree(k->pbuf[1]), cudaFree(k->pbuf[2]), cudaFree(k->pflags);
    cudaFree(k->pepoch), cudaFree(k->hw);
    cudaFree(k->din), cudaFree(k->blas_ws);
    free(k->kv_off);
    for (int i = 0; i < k->n_qmem; i++) cudaFree(k->qmem[i]);
    free(k->qmem);
    cudaFree(k->qws.deq), cudaFree(k->qws.xperm);
    if (k->blas) cublasDestroy(k->blas);
    if (k->comm) ncclCommDestroy(k->comm);
    if (k->st) cudaStreamDestroy(k->st);
}

static void destroy(model_backend *mb)
{
    struct cuda_backend *b = (struct cuda_backend *)mb;
    if (!b) return;
    if (b->crew) {
        pthread_mutex_lock(&b->mu);
        b->cur = JOB_EXIT;
        atomic_fetch_add(&b->gen, 1);
        pthread_cond_broadcast(&b->go);
        pthread_mutex_unlock(&b->mu);
        for (int i = 1; i < b->tp; i++)
            if (b->r[i].th_started) pthread_join(b->r[i].th, NULL);
        pthread_mutex_destroy(&b->mu);
        pthread_cond_destroy(&b->go);
        pthread_cond_destroy(&b->done);
    }
    /* after a failure the streams may never finish: leave the GPUs to the
     * process exit rather than wait on them */
    if (b->r && !b->base.fatal)
        for (int i = 0; i < b->tp; i++) rank_free(&b->r[i], &b->c);
    free(b->r);
    cuda_mtp_destroy(b);
    cuda_mla_xfree(b);
    cudaFreeHost(b->hin), cudaFreeHost(b->hout), cudaFreeHost(b->hlog), cudaFreeHost(b->peer_abort);
    free(b->samp), free(b->host_rows), free(b->row_seq), free(b->tok_seq), free(b->row_host), free(b->row_mode), free(b->rng_before);
    free(b->pen_mark);
    free(b);
}

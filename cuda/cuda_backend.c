/* cuda_backend.c - the GPU backend (model/backend.h, device "cuda") for the
 * Llama family on one NVIDIA GPU.
 *
 * Numerics: every weight matrix is converted to bf16 at creation (GGUF
 * Q4_0/Q4_1/Q8_0/F16 dequantized on the host with model_tensor_to_f32, then
 * rounded to nearest even); norm weights and biases stay f32. Activations
 * between kernels are bf16, the residual stream is f32, every GEMM (cuBLAS,
 * bf16 in, f32 compute) and every reduction accumulates in f32. Fused Q|K|V
 * and gate|up matrices make one GEMM each.
 *
 * A step: the host packs the step's inputs (token ids, positions, slots,
 * block tables, attention work items, logit rows) into one pinned buffer at
 * fixed offsets and copies it in one transfer; the layers run on one stream;
 * the LM head runs for the rows that need logits only (f32 logits); the
 * greedy token and its logprob are computed on the device, and only they
 * come back. Rows that need more than greedy (temperature, penalties, top
 * logprobs) or raw logits (logits_out) copy their logit row back and are
 * sampled on the host by model_sample(): the same code and RNG stream as the
 * CPU backend, so a seeded request draws the same uniform numbers on both; its
 * token differs from the CPU's only where the logits themselves differ (bf16
 * weights) enough to move the draw across a candidate boundary.
 *
 * Decode-only steps (every sequence one token) run as a CUDA graph captured
 * once per batch-size bucket (1, 2, 4, ... max_seqs): the step is padded to
 * the bucket with tokens that write the backend's private pad block and are
 * never read. SLUICE_CUDA_GRAPHS=0 turns graphs off.
 *
 * KV memory: per layer K then V, each [n_blocks + 1][block_size][n_kv_heads][head_dim]
 * bf16; the last block is the pad block.
 *
 * Memory: weights, KV, activations for max_tokens_per_step tokens, logits for
 * max_seqs_per_step rows and the pinned staging buffers are allocated at
 * creation and kv_alloc; forward() allocates nothing.
 */
#include <cublas_v2.h>
#include <cuda_runtime.h>
#include <math.h>
#include <stdarg.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "cuda/kernels.h"
#include "model/backend.h"

#define NBUCKET 10

struct clayer {
    uint16_t *wqkv;     /* [(H + 2 KVH) D][E] bf16, device */
    uint16_t *wo;       /* [E][H D] */
    uint16_t *wgu;      /* [2F][E]: gate rows then up rows */
    uint16_t *wdown;    /* [E][F] */
    float *attn_norm, *ffn_norm; /* [E] f32, device */
    float *bqkv;        /* [(H + 2 KVH) D] or NULL */
    float *q_norm, *k_norm; /* [D] or NULL */
};

/* Offsets (in bytes) of the per-step inputs inside hin/din. */
struct inlay {
    size_t slots, ids, pos, tok_part, tok_nsplit, rows, n_items, items, bt_off, bt, total;
};

struct cuda_backend {
    struct model_backend base;
    struct model_config c;
    int max_tokens, max_seqs, max_ctx, n_sm;
    cudaStream_t st;
    cublasHandle_t blas;
    void *blas_ws;

    uint16_t *tok_embd, *lm_head;   /* [V][E] bf16 (the same when tied) */
    float *out_norm;                /* [E] */
    struct clayer *L;               /* [n_layer] */
    float *rope_cos, *rope_sin;     /* [max_ctx][rope_dim/2] */

    uint16_t *kv;                   /* see the file comment */
    int kv_blocks, block_size;
    size_t kv_layer;                /* elements of one layer's K (or V) */

    /* activations, [max_tokens] rows unless said otherwise, device */
    float *x;                       /* [E] f32 residual */
    uint16_t *xn, *qkv, *q, *att, *delta, *gu, *h; /* [E], [QKV], [Q], [Q], [E], [2F], [F] */
    uint16_t *hfin;                 /* [max_seqs][E] */
    float *logits;                  /* [max_seqs][V] */
    int32_t *tok;                   /* [max_seqs] */
    float *lp;                      /* [max_seqs] */
    float *part;                    /* attention split partials */
    int part_rows;

    /* step inputs: pinned host and device mirrors at the same offsets */
    struct inlay lay;
    uint8_t *hin, *din;
    int max_items, bt_cap;
    int32_t *hout_tok;              /* [max_seqs] pinned */
    float *hout_lp;                 /* [max_seqs] pinned */
    float *hlog;                    /* [max_seqs][V] pinned: rows sampled on the host */
    void *samp;                     /* model_sample scratch */
    int *row_seq, *tok_seq;         /* host scratch */

    bool graphs;                    /* SLUICE_CUDA_GRAPHS=0: off */
    bool gemv;                      /* our GEMV for <= CUDA_GEMV_MAX_T rows; SLUICE_CUDA_GEMV=0: cuBLAS */
    int bucket[NBUCKET], n_bucket;
    cudaGraphExec_t gexec[NBUCKET];
};


#define CK(call)                                                                                     \
    do {                                                                                             \
        cudaError_t e_ = (call);                                                                     \
        if (e_ != cudaSuccess) {                                                                     \
            sl_seterr(err, errlen, "%s failed: %s (%s, %s:%d)", #call, cudaGetErrorString(e_), __func__, \
                   __FILE__, __LINE__);                                                              \
            goto fail;                                                                               \
        }                                                                                            \
    } while (0)
#define CB(call)                                                                                     \
    do {                                                                                             \
        cublasStatus_t s_ = (call);                                                                  \
        if (s_ != CUBLAS_STATUS_SUCCESS) {                                                           \
            sl_seterr(err, errlen, "%s failed: %s (%s, %s:%d)", #call, cublasGetStatusString(s_),       \
                   __func__, __FILE__, __LINE__);                                                    \
            goto fail;                                                                               \
        }                                                                                            \
    } while (0)

bool model_cuda_available(void)
{
    int n = 0;
    return cudaGetDeviceCount(&n) == cudaSuccess && n > 0;
}

/* ---- construction -------------------------------------------------------------- */

static size_t kv_block_bytes(model_backend *mb, int block_size);
static int kv_alloc(model_backend *mb, int n_blocks, int block_size, char *err, size_t errlen);
static int forward(model_backend *mb, struct step *s, char *err, size_t errlen);
static void destroy(model_backend *mb);

static const struct model_backend_ops cuda_ops = {
    .name = "cuda",
    .kv_block_bytes = kv_block_bytes,
    .kv_alloc = kv_alloc,
    .forward = forward,
    .destroy = destroy,
};

static uint16_t to_bf16(float f)
{
    uint32_t u;
    memcpy(&u, &f, 4);
    if ((u & 0x7fffffffu) > 0x7f800000u) return 0x7fc0; /* NaN */
    u += 0x7fffu + ((u >> 16) & 1u);                     /* round to nearest even */
    return (uint16_t)(u >> 16);
}

#define STAGE_ELEMS ((size_t)16 << 20) /* bf16 elements per staging transfer (32 MB) */

/* Copies rows [0, rows) of t (each `cols` wide) as bf16 to dst (device).
 * stage: pinned [STAGE_ELEMS] bf16; tmp: host [STAGE_ELEMS] f32. */
static int upload_bf16(const struct model_tensor *t, int64_t rows, int64_t cols, uint16_t *dst,
                       uint16_t *stage, float *tmp, char *err, size_t errlen)
{
    int64_t n = rows * cols, rows_per = (int64_t)(STAGE_ELEMS / (size_t)cols);
    if (rows_per < 1) {
        sl_seterr(err, errlen, "tensor %s: rows too long to stage", t->name ? t->name : "?");
        return SL_EUNSUP;
    }
    for (int64_t r0 = 0; r0 < rows; r0 += rows_per) {
        int64_t nr = rows - r0 < rows_per ? rows - r0 : rows_per, ne = nr * cols, first = r0 * cols;
        if (t->dtype == MODEL_DT_BF16) {
            const uint16_t *src = (const uint16_t *)t->data + first;
#pragma omp parallel for schedule(static)
            for (int64_t i = 0; i < ne; i += 65536)
                memcpy(stage + i, src + i, (size_t)(ne - i < 65536 ? ne - i : 65536) * 2);
        } else {
            /* row-aligned pieces, so quantized blocks are never split */
#pragma omp parallel for schedule(dynamic, 16)
            for (int64_t r = 0; r < nr; r++) {
                model_tensor_to_f32(t, first + r * cols, cols, tmp + r * cols);
                for (int64_t i = 0; i < cols; i++) stage[r * cols + i] = to_bf16(tmp[r * cols + i]);
            }
        }
        cudaError_t e = cudaMemcpy(dst + first, stage, (size_t)ne * 2, cudaMemcpyHostToDevice);
        if (e != cudaSuccess) {
            sl_seterr(err, errlen, "upload %s: %s", t->name ? t->name : "?", cudaGetErrorString(e));
            return SL_EDEVICE;
        }
    }
    (void)n;
    return 0;
}

static int upload_f32(const struct model_tensor *t, int64_t n, float *dst, char *err, size_t errlen)
{
    float *h = malloc((size_t)n * sizeof *h);
    if (!h) {
        sl_seterr(err, errlen, "out of host memory");
        return SL_ENOMEM;
    }
    model_tensor_to_f32(t, 0, n, h);
    cudaError_t e = cudaMemcpy(dst, h, (size_t)n * sizeof *h, cudaMemcpyHostToDevice);
    free(h);
    if (e != cudaSuccess) {
        sl_seterr(err, errlen, "upload %s: %s", t->name ? t->name : "?", cudaGetErrorString(e));
        return SL_EDEVICE;
    }
    return 0;
}

static int dmalloc(void **p, size_t n, char *err, size_t errlen)
{
    cudaError_t e = cudaMalloc(p, n ? n : 16);
    if (e != cudaSuccess) {
        *p = NULL;
        sl_seterr(err, errlen, "cudaMalloc(%.2f GB) failed: %s", n / 1e9, cudaGetErrorString(e));
        return SL_ENOMEM;
    }
    return 0;
}

/* The RoPE tables, computed exactly as the CPU backend does (double, then f32). */
static int rope_tables(struct cuda_backend *b, const struct model_weights *w, char *err, size_t errlen)
{
    const struct model_config *c = &b->c;
    int half = c->rope_dim / 2;
    double *inv = malloc((size_t)half * sizeof *inv);
    float *cs = malloc((size_t)b->max_ctx * half * sizeof *cs), *sn = malloc((size_t)b->max_ctx * half * sizeof *sn);
    int rc = SL_ENOMEM;
    if (!inv || !cs || !sn) {
        sl_seterr(err, errlen, "out of host memory");
        goto out;
    }
    model_rope_inv_freq(c, w, inv);
#pragma omp parallel for schedule(static)
    for (int p = 0; p < b->max_ctx; p++)
        for (int i = 0; i < half; i++) {
            double a = (double)p * inv[i];
            cs[(size_t)p * half + i] = (float)cos(a);
            sn[(size_t)p * half + i] = (float)sin(a);
        }
    size_t bytes = (size_t)b->max_ctx * half * sizeof(float);
    if ((rc = dmalloc((void **)&b->rope_cos, bytes, err, errlen)) ||
        (rc = dmalloc((void **)&b->rope_sin, bytes, err, errlen)))
        goto out;
    rc = SL_EDEVICE;
    if (cudaMemcpy(b->rope_cos, cs, bytes, cudaMemcpyHostToDevice) != cudaSuccess ||
        cudaMemcpy(b->rope_sin, sn, bytes, cudaMemcpyHostToDevice) != cudaSuccess) {
        sl_seterr(err, errlen, "upload of the RoPE tables failed");
        goto out;
    }
    rc = 0;
out:
    free(inv);
    free(cs);
    free(sn);
    return rc;
}

model_backend *model_cuda_backend_create(const model *m, const struct model_backend_opts *opts, char *err,
                                         size_t errlen)
{
    if (!m) {
        sl_seterr(err, errlen, "no model");
        return NULL;
    }
    if (!model_cuda_available()) {
        sl_seterr(err, errlen, "no CUDA device");
        return NULL;
    }
    const struct model_config *c = model_get_config(m);
    const struct model_weights *w = model_get_weights(m);
    struct cuda_backend *b = calloc(1, sizeof *b);
    uint16_t *stage = NULL;
    float *tmp = NULL;
    if (!b) {
        sl_seterr(err, errlen, "out of memory");
        return NULL;
    }
    b->base.ops = &cuda_ops;
    b->base.m = m;
    b->c = *c;
    b->max_tokens = opts && opts->max_tokens_per_step > 0 ? opts->max_tokens_per_step : 2048;
    b->max_seqs = opts && opts->max_seqs_per_step > 0 ? opts->max_seqs_per_step : 256;
    if (b->max_seqs > b->max_tokens) b->max_seqs = b->max_tokens;
    b->max_ctx = opts && opts->max_ctx > 0 ? opts->max_ctx : c->n_ctx_train;
    if (b->max_ctx <= 0) b->max_ctx = 4096;
    const char *ge = getenv("SLUICE_CUDA_GRAPHS");
    b->graphs = !(ge && strcmp(ge, "0") == 0);
    ge = getenv("SLUICE_CUDA_GEMV");
    b->gemv = !(ge && strcmp(ge, "0") == 0);
    if (c->head_dim % 8 || c->head_dim > 256 || c->n_head / c->n_head_kv > CUDA_ATTN_ROWS) {
        sl_seterr(err, errlen, "cuda: head_dim %d / %d heads per KV head unsupported (head_dim %% 8 == 0, <= 256; <= %d)",
               c->head_dim, c->n_head / c->n_head_kv, CUDA_ATTN_ROWS);
        goto fail;
    }
    struct cudaDeviceProp prop;
    CK(cudaSetDevice(0));
    CK(cudaGetDeviceProperties(&prop, 0));
    b->n_sm = prop.multiProcessorCount;
    CK(cudaStreamCreateWithFlags(&b->st, cudaStreamNonBlocking));
    CK(cuda_attention_prepare(c->head_dim));
    CB(cublasCreate(&b->blas));
    CB(cublasSetStream(b->blas, b->st));
    /* a fixed workspace: cuBLAS then never allocates, inside graph capture too */
    if (dmalloc(&b->blas_ws, (size_t)32 << 20, err, errlen)) goto fail;
    CB(cublasSetWorkspace(b->blas, b->blas_ws, (size_t)32 << 20));

    size_t E = c->n_embd, F = c->n_ff, D = c->head_dim, H = c->n_head, KVH = c->n_head_kv, V = c->n_vocab;
    size_t Q = H * D, KV = KVH * D, QKV = Q + 2 * KV;
    CK(cudaMallocHost((void **)&stage, STAGE_ELEMS * 2));
    tmp = malloc(STAGE_ELEMS * sizeof *tmp);
    b->L = calloc((size_t)c->n_layer, sizeof *b->L);
    if (!tmp || !b->L) {
        sl_seterr(err, errlen, "out of host memory");
        goto fail;
    }
#define MAT(dst, t, rows, cols)                                                                    \
    do {                                                                                           \
        if (upload_bf16((t), (rows), (cols), (dst), stage, tmp, err, errlen)) goto fail;           \
    } while (0)
#define VEC(dst, t, n)                                                                             \
    do {                                                                                           \
        if (dmalloc((void **)&(dst), (n) * sizeof(float), err, errlen) ||                          \
            upload_f32((t), (int64_t)(n), (dst), err, errlen))                                     \
            goto fail;                                                                             \
    } while (0)
    if (dmalloc((void **)&b->tok_embd, V * E * 2, err, errlen)) goto fail;
    MAT(b->tok_embd, &w->tok_embd, V, E);
    if (c->tie_embeddings) {
        b->lm_head = b->tok_embd;
    } else {
        if (dmalloc((void **)&b->lm_head, V * E * 2, err, errlen)) goto fail;
        MAT(b->lm_head, &w->lm_head, V, E);
    }
    VEC(b->out_norm, &w->out_norm, E);
    for (int l = 0; l < c->n_layer; l++) {
        const struct model_layer_weights *lw = &w->layers[l];
        struct clayer *L = &b->L[l];
        if (dmalloc((void **)&L->wqkv, QKV * E * 2, err, errlen) || dmalloc((void **)&L->wo, E * Q * 2, err, errlen) ||
            dmalloc((void **)&L->wgu, 2 * F * E * 2, err, errlen) || dmalloc((void **)&L->wdown, E * F * 2, err, errlen))
            goto fail;
        MAT(L->wqkv, &lw->wq, Q, E);
        MAT(L->wqkv + Q * E, &lw->wk, KV, E);
        MAT(L->wqkv + (Q + KV) * E, &lw->wv, KV, E);
        MAT(L->wo, &lw->wo, E, Q);
        MAT(L->wgu, &lw->w_gate, F, E);
        MAT(L->wgu + F * E, &lw->w_up, F, E);
        MAT(L->wdown, &lw->w_down, E, F);
        VEC(L->attn_norm, &lw->attn_norm, E);
        VEC(L->ffn_norm, &lw->ffn_norm, E);
        if (c->qkv_bias) {
            if (dmalloc((void **)&L->bqkv, QKV * sizeof(float), err, errlen) ||
                upload_f32(&lw->bq, (int64_t)Q, L->bqkv, err, errlen) ||
                upload_f32(&lw->bk, (int64_t)KV, L->bqkv + Q, err, errlen) ||
                upload_f32(&lw->bv, (int64_t)KV, L->bqkv + Q + KV, err, errlen))
                goto fail;
        }
        if (c->qk_norm) {
            VEC(L->q_norm, &lw->q_norm, D);
            VEC(L->k_norm, &lw->k_norm, D);
        }
    }
#undef MAT
#undef VEC
    cudaFreeHost(stage);
    stage = NULL;
    free(tmp);
    tmp = NULL;
    if (rope_tables(b, w, err, errlen)) goto fail;

    size_t T = b->max_tokens, S = b->max_seqs;
    b->part_rows = (int)((T < 256 ? T : 256) * (H / KVH));
    if (dmalloc((void **)&b->x, T * E * 4, err, errlen) || dmalloc((void **)&b->xn, T * E * 2, err, errlen) ||
        dmalloc((void **)&b->qkv, T * QKV * 2, err, errlen) || dmalloc((void **)&b->q, T * Q * 2, err, errlen) ||
        dmalloc((void **)&b->att, T * Q * 2, err, errlen) || dmalloc((void **)&b->delta, T * E * 2, err, errlen) ||
        dmalloc((void **)&b->gu, T * 2 * F * 2, err, errlen) || dmalloc((void **)&b->h, T * F * 2, err, errlen) ||
        dmalloc((void **)&b->hfin, S * E * 2, err, errlen) || dmalloc((void **)&b->logits, S * V * 4, err, errlen) ||
        dmalloc((void **)&b->tok, S * 4, err, errlen) || dmalloc((void **)&b->lp, S * 4, err, errlen) ||
        dmalloc((void **)&b->part, (size_t)b->part_rows * KVH * CUDA_ATTN_MAXSPLIT * (D + 2) * 4, err, errlen))
        goto fail;
    CK(cudaMallocHost((void **)&b->hout_tok, S * 4));
    CK(cudaMallocHost((void **)&b->hout_lp, S * 4));
    CK(cudaMallocHost((void **)&b->hlog, S * V * 4));
    b->samp = malloc(model_sample_scratch_bytes(c->n_vocab));
    b->row_seq = malloc(S * sizeof *b->row_seq);
    b->tok_seq = malloc(T * sizeof *b->tok_seq);
    if (!b->samp || !b->row_seq || !b->tok_seq) {
        sl_seterr(err, errlen, "out of host memory");
        goto fail;
    }
    for (int bk = 1; bk <= b->max_seqs && b->n_bucket < NBUCKET; bk *= 2) b->bucket[b->n_bucket++] = bk;
    if (b->n_bucket < NBUCKET && b->bucket[b->n_bucket - 1] != b->max_seqs) b->bucket[b->n_bucket++] = b->max_seqs;
    return &b->base;
fail:
    if (stage) cudaFreeHost(stage);
    free(tmp);
    destroy(&b->base);
    return NULL;
}

/* ---- KV ------------------------------------------------------------------------ */

static size_t kv_block_bytes(model_backend *mb, int block_size)
{
    struct cuda_backend *b = (struct cuda_backend *)mb;
    return 2 * (size_t)b->c.n_layer * (size_t)block_size * b->c.n_head_kv * b->c.head_dim * 2;
}

static void drop_graphs(struct cuda_backend *b)
{
    for (int i = 0; i < NBUCKET; i++)
        if (b->gexec[i]) {
            cudaGraphExecDestroy(b->gexec[i]);
            b->gexec[i] = NULL;
        }
}

static size_t al(size_t o) { return (o + 15) & ~(size_t)15; }

static int kv_alloc(model_backend *mb, int n_blocks, int block_size, char *err, size_t errlen)
{
    struct cuda_backend *b = (struct cuda_backend *)mb;
    if (n_blocks <= 0 || block_size <= 0 || block_size > (1 << 20)) {
        sl_seterr(err, errlen, "kv_alloc: bad size (%d blocks of %d)", n_blocks, block_size);
        return SL_EINVAL;
    }
    drop_graphs(b);
    cudaFree(b->kv);
    cudaFree(b->din);
    cudaFreeHost(b->hin);
    b->kv = NULL, b->din = NULL, b->hin = NULL, b->kv_blocks = 0;
    size_t per_block = kv_block_bytes(mb, block_size);
    /* one more block: the pad block that padded graph tokens write */
    if (dmalloc((void **)&b->kv, (size_t)(n_blocks + 1) * per_block, err, errlen)) {
        sl_seterr(err, errlen, "kv_alloc: out of GPU memory for %d blocks (%.2f GB)", n_blocks,
               (double)(n_blocks + 1) * per_block / 1e9);
        return SL_ENOMEM;
    }
    b->kv_blocks = n_blocks;
    b->block_size = block_size;
    b->kv_layer = (size_t)(n_blocks + 1) * block_size * b->c.n_head_kv * b->c.head_dim;

    size_t T = b->max_tokens, S = b->max_seqs;
    b->max_items = (int)(T + S + 256 * CUDA_ATTN_MAXSPLIT);
    b->bt_cap = (int)(S * ((size_t)(b->max_ctx + block_size - 1) / block_size + 1));
    struct inlay *y = &b->lay;
    size_t o = 0;
    y->slots = o, o = al(o + T * 8);
    y->ids = o, o = al(o + T * 4);
    y->pos = o, o = al(o + T * 4);
    y->tok_part = o, o = al(o + T * 4);
    y->tok_nsplit = o, o = al(o + T * 4);
    y->rows = o, o = al(o + S * 4);
    y->n_items = o, o = al(o + 4);
    y->items = o, o = al(o + (size_t)b->max_items * sizeof(struct cuda_attn_item));
    y->bt_off = o, o = al(o + S * 4);
    y->bt = o, o = al(o + (size_t)b->bt_cap * 4);
    y->total = o;
    cudaError_t e = cudaMallocHost((void **)&b->hin, o);
    if (e == cudaSuccess) e = cudaMalloc((void **)&b->din, o);
    if (e != cudaSuccess) {
        sl_seterr(err, errlen, "kv_alloc: step buffers: %s", cudaGetErrorString(e));
        return SL_ENOMEM;
    }
    return 0;
}

/* ---- forward ------------------------------------------------------------------- */

static bool sampling_valid(const struct model_sampling *s)
{
    return s->temperature >= 0.0f && s->top_p > 0.0f && s->top_p <= 1.0f && s->min_p >= 0.0f &&
           s->min_p <= 1.0f && s->repetition_penalty > 0.0f && isfinite(s->presence_penalty) &&
           isfinite(s->frequency_penalty) && s->top_logprobs >= 0 && s->top_logprobs <= MODEL_MAX_TOP_LOGPROBS;
}

/* Greedy with nothing that needs the whole distribution: the device answers. */
static bool device_greedy(const struct step_seq *q)
{
    const struct model_sampling *s = q->sampling;
    return !q->logits_out && (s->temperature == 0.0f || s->top_k == 1) && s->repetition_penalty == 1.0f &&
           s->presence_penalty == 0.0f && s->frequency_penalty == 0.0f && s->top_logprobs == 0;
}

static int check_step(struct cuda_backend *b, const struct step *s, char *err, size_t errlen)
{
    if (!b->kv) {
        sl_seterr(err, errlen, "forward: KV memory not allocated (kv_alloc)");
        return SL_EINVAL;
    }
    struct model_step_limits lim = {.n_vocab = b->c.n_vocab, .max_tokens = b->max_tokens, .max_seqs = b->max_seqs,
                                    .max_ctx = b->max_ctx, .block_size = b->block_size, .kv_blocks = b->kv_blocks};
    int rc = model_step_check(s, &lim, b->tok_seq, err, errlen);
    if (rc) return rc;
    /* the device sampler runs before the host could refuse bad parameters */
    for (int i = 0; i < s->n_seqs; i++)
        if (s->seqs[i].want_sample && !sampling_valid(s->seqs[i].sampling)) {
            sl_seterr(err, errlen, "forward: seq %d: bad sampling parameters", i);
            return SL_EINVAL;
        }
    return 0;
}

#define HIN(b, f, type) ((type *)((b)->hin + (b)->lay.f))
#define DIN(b, f, type) ((type *)((b)->din + (b)->lay.f))

/* Packs the step into hin. Tokens [n_tokens, Tp) and rows [R, Rp) are
 * padding (decode graphs). Returns the bytes of hin to copy, or 0 when the
 * step does not fit the buffers. *R gets the number of logit rows. */
static size_t pack_step(struct cuda_backend *b, const struct step *s, int Tp, int *R)
{
    int T = s->n_tokens, bs = b->block_size, grp = b->c.n_head / b->c.n_head_kv, KVH = b->c.n_head_kv;
    int qt = CUDA_ATTN_ROWS / grp;
    int64_t *slots = HIN(b, slots, int64_t);
    int32_t *ids = HIN(b, ids, int32_t), *pos = HIN(b, pos, int32_t), *tpart = HIN(b, tok_part, int32_t),
            *tns = HIN(b, tok_nsplit, int32_t), *rows = HIN(b, rows, int32_t), *bt_off = HIN(b, bt_off, int32_t),
            *bt = HIN(b, bt, int32_t);
    struct cuda_attn_item *items = HIN(b, items, struct cuda_attn_item);
    int64_t pad_slot = (int64_t)b->kv_blocks * bs;
    for (int t = 0; t < Tp; t++) {
        bool real = t < T;
        slots[t] = real ? s->slots[t] : pad_slot;
        ids[t] = real ? s->token_ids[t] : 0;
        pos[t] = real ? s->positions[t] : 0;
        tpart[t] = -1;
        tns[t] = 0;
    }
    int nbt = 0, r = 0, tiles = 0;
    for (int i = 0; i < s->n_seqs; i++) {
        const struct step_seq *q = &s->seqs[i];
        int nb = (q->context_len + bs - 1) / bs;
        if (nbt + nb > b->bt_cap) return 0;
        bt_off[i] = nbt;
        memcpy(bt + nbt, q->block_table, (size_t)nb * 4);
        nbt += nb;
        tiles += (q->query_len + qt - 1) / qt;
        if (q->want_sample || q->logits_out) {
            b->row_seq[r] = i;
            rows[r++] = q->query_start + q->query_len - 1;
        }
    }
    *R = r;
    /* split-K only when the step is short (decode-like) and its tiles alone
     * would leave the GPU idle */
    bool split_ok = Tp <= 256;
    int units = tiles * KVH, want = units >= 2 * b->n_sm ? 1 : (2 * b->n_sm + units - 1) / units;
    int n = 0, part = 0;
    for (int i = 0; i < s->n_seqs; i++) {
        const struct step_seq *q = &s->seqs[i];
        for (int t0 = q->query_start; t0 < q->query_start + q->query_len; t0 += qt) {
            int nq = q->query_start + q->query_len - t0 < qt ? q->query_start + q->query_len - t0 : qt;
            int kv_hi = 0;
            for (int t = t0; t < t0 + nq; t++)
                if (pos[t] + 1 > kv_hi) kv_hi = pos[t] + 1;
            int ns = 1;
            if (split_ok && want > 1) {
                ns = (kv_hi + 63) / 64; /* short items: a block's latency is per 32-key tile */
                if (ns > want) ns = want;
                if (ns > CUDA_ATTN_MAXSPLIT) ns = CUDA_ATTN_MAXSPLIT;
                if (part + nq * grp > b->part_rows) ns = 1;
                if (ns < 1) ns = 1;
            }
            int chunk = ((kv_hi + ns - 1) / ns + 31) / 32 * 32;
            if (n + ns > b->max_items) return 0;
            for (int k = 0; k < ns; k++) {
                int lo = k * chunk, hi = lo + chunk < kv_hi ? lo + chunk : kv_hi;
                items[n++] = (struct cuda_attn_item){.seq = i, .t0 = t0, .nq = nq, .kv_lo = lo, .kv_hi = hi,
                                                     .split = k, .nsplit = ns, .part = part};
            }
            if (ns > 1) {
                for (int t = t0; t < t0 + nq; t++) {
                    tpart[t] = part + (t - t0) * grp;
                    tns[t] = ns;
                }
                part += nq * grp;
            }
        }
    }
    *HIN(b, n_items, int32_t) = n;
    for (int k = r; k < (Tp < b->max_seqs ? Tp : b->max_seqs); k++) rows[k] = k; /* graph padding rows */
    return b->lay.bt + (size_t)nbt * 4;
}

static cublasStatus_t gemm(struct cuda_backend *b, const uint16_t *x, const uint16_t *W, void *y, bool yf32, int T,
                           int in, int out)
{
    const float one = 1.0f, zero = 0.0f;
    if (b->gemv && T <= CUDA_GEMV_MAX_T && in % 8 == 0)
        return cuda_gemv(W, x, y, yf32, T, in, out, b->st) == cudaSuccess ? CUBLAS_STATUS_SUCCESS
                                                                             : CUBLAS_STATUS_EXECUTION_FAILED;
    return cublasGemmEx(b->blas, CUBLAS_OP_T, CUBLAS_OP_N, out, T, in, &one, W, CUDA_R_16BF, in, x, CUDA_R_16BF, in,
                        &zero, y, yf32 ? CUDA_R_32F : CUDA_R_16BF, out, CUBLAS_COMPUTE_32F, CUBLAS_GEMM_DEFAULT);
}

/* Enqueues the whole forward pass for T tokens (some maybe padding), R logit
 * rows, and max_items attention items, up to the greedy tokens. */
static int enqueue(struct cuda_backend *b, int T, int R, int max_items, bool decode, char *err, size_t errlen)
{
    const struct model_config *c = &b->c;
    int E = c->n_embd, F = c->n_ff, H = c->n_head, KVH = c->n_head_kv, D = c->head_dim, V = c->n_vocab;
    int Q = H * D, QKV = Q + 2 * KVH * D;
    cudaStream_t st = b->st;
    CK(cuda_embed(b->tok_embd, DIN(b, ids, int32_t), T, E, b->x, st));
    for (int l = 0; l < c->n_layer; l++) {
        const struct clayer *L = &b->L[l];
        /* the previous layer's MLP output joins the residual here */
        CK(cuda_add_rmsnorm(b->x, l ? b->delta : NULL, L->attn_norm, NULL, T, E, c->norm_eps, b->xn, st));
        CB(gemm(b, b->xn, L->wqkv, b->qkv, false, T, E, QKV));
        uint16_t *kc = b->kv + (size_t)(2 * l) * b->kv_layer, *vc = b->kv + (size_t)(2 * l + 1) * b->kv_layer;
        struct cuda_rope_args ra = {
            .qkv = b->qkv, .bias = L->bqkv, .q_norm = L->q_norm, .k_norm = L->k_norm, .cos = b->rope_cos,
            .sin = b->rope_sin, .pos = DIN(b, pos, int32_t), .slots = DIN(b, slots, int64_t), .T = T, .H = H,
            .KVH = KVH, .D = D, .rope_dim = c->rope_dim, .neox = c->rope_type == MODEL_ROPE_NEOX,
            .eps = c->norm_eps, .q = b->q, .kc = kc, .vc = vc,
        };
        CK(cuda_rope_kv(&ra, st));
        struct cuda_attn_args aa = {
            .q = b->q, .kc = kc, .vc = vc, .pos = DIN(b, pos, int32_t), .bt = DIN(b, bt, int32_t),
            .bt_off = DIN(b, bt_off, int32_t), .items = DIN(b, items, struct cuda_attn_item),
            .n_items = DIN(b, n_items, int32_t), .max_items = max_items,
            .max_rows = decode ? H / KVH : CUDA_ATTN_ROWS, .H = H, .KVH = KVH, .D = D,
            .block_size = b->block_size, .scale = 1.0f / sqrtf((float)D), .part = b->part,
            .tok_part = DIN(b, tok_part, int32_t), .tok_nsplit = DIN(b, tok_nsplit, int32_t), .T = T, .out = b->att,
        };
        CK(cuda_attention(&aa, st));
        CB(gemm(b, b->att, L->wo, b->delta, false, T, Q, E));
        CK(cuda_add_rmsnorm(b->x, b->delta, L->ffn_norm, NULL, T, E, c->norm_eps, b->xn, st));
        CB(gemm(b, b->xn, L->wgu, b->gu, false, T, E, 2 * F));
        CK(cuda_swiglu(b->gu, T, F, b->h, st));
        CB(gemm(b, b->h, L->wdown, b->delta, false, T, F, E));
    }
    if (R > 0) {
        CK(cuda_add_rmsnorm(b->x, b->delta, b->out_norm, DIN(b, rows, int32_t), R, E, c->norm_eps, b->hfin, st));
        CB(gemm(b, b->hfin, b->lm_head, b->logits, true, R, E, V));
        CK(cuda_argmax_lse(b->logits, R, V, b->tok, b->lp, st));
    }
    return 0;
fail:
    return SL_EDEVICE;
}

static int forward(model_backend *mb, struct step *s, char *err, size_t errlen)
{
    struct cuda_backend *b = (struct cuda_backend *)mb;
    if (!s) {
        sl_seterr(err, errlen, "forward: no step");
        return SL_EINVAL;
    }
    int rc = check_step(b, s, err, errlen);
    if (rc) return rc;
    const struct model_config *c = &b->c;
    int V = c->n_vocab;
    bool decode = s->n_tokens == s->n_seqs;
    int gi = -1;
    if (decode && b->graphs)
        for (int i = 0; i < b->n_bucket; i++)
            if (b->bucket[i] >= s->n_tokens && b->bucket[i] <= b->max_tokens) {
                gi = i;
                break;
            }
    int Tp = gi >= 0 ? b->bucket[gi] : s->n_tokens, R = 0;
    size_t nbytes = pack_step(b, s, Tp, &R);
    if (!nbytes) {
        sl_seterr(err, errlen, "forward: step exceeds the backend's buffers");
        return SL_EINVAL;
    }
    CK(cudaMemcpyAsync(b->din, b->hin, nbytes, cudaMemcpyHostToDevice, b->st));
    if (gi >= 0) {
        if (!b->gexec[gi]) {
            cudaGraph_t g = NULL;
            CK(cudaStreamBeginCapture(b->st, cudaStreamCaptureModeThreadLocal));
            rc = enqueue(b, Tp, Tp, Tp * CUDA_ATTN_MAXSPLIT, true, err, errlen);
            cudaError_t e = cudaStreamEndCapture(b->st, &g);
            if (rc) {
                if (g) cudaGraphDestroy(g);
                return rc;
            }
            CK(e);
            e = cudaGraphInstantiate(&b->gexec[gi], g, 0);
            cudaGraphDestroy(g);
            CK(e);
        }
        CK(cudaGraphLaunch(b->gexec[gi], b->st));
    } else {
        if ((rc = enqueue(b, s->n_tokens, R, *HIN(b, n_items, int32_t), decode, err, errlen))) return rc;
    }
    if (R > 0) {
        CK(cudaMemcpyAsync(b->hout_tok, b->tok, (size_t)R * 4, cudaMemcpyDeviceToHost, b->st));
        CK(cudaMemcpyAsync(b->hout_lp, b->lp, (size_t)R * 4, cudaMemcpyDeviceToHost, b->st));
        for (int r = 0; r < R; r++) {
            const struct step_seq *q = &s->seqs[b->row_seq[r]];
            if (q->logits_out || (q->want_sample && !device_greedy(q)))
                CK(cudaMemcpyAsync(b->hlog + (size_t)r * V, b->logits + (size_t)r * V, (size_t)V * 4,
                                   cudaMemcpyDeviceToHost, b->st));
        }
    }
    CK(cudaStreamSynchronize(b->st));
    for (int r = 0; r < R; r++) {
        struct step_seq *q = &s->seqs[b->row_seq[r]];
        float *lg = b->hlog + (size_t)r * V;
        if (q->logits_out) memcpy(q->logits_out, lg, (size_t)V * 4);
        if (!q->want_sample) continue;
        if (device_greedy(q)) {
            if (b->hout_tok[r] < 0) {
                sl_seterr(err, errlen, "forward: seq %d: logits are not finite", b->row_seq[r]);
                return SL_EINVAL;
            }
            q->out.token = b->hout_tok[r];
            q->out.logprob = b->hout_lp[r];
            q->out.n_top = 0;
        } else if (model_sample(lg, V, q->sampling, q->history, q->n_prompt, q->n_history, q->rng, b->samp,
                                &q->out) != 0) {
            sl_seterr(err, errlen, "forward: seq %d: bad sampling parameters", b->row_seq[r]);
            return SL_EINVAL;
        }
    }
    return 0;
fail:
    return SL_EDEVICE;
}

/* ---- teardown ------------------------------------------------------------------ */

static void destroy(model_backend *mb)
{
    struct cuda_backend *b = (struct cuda_backend *)mb;
    if (!b) return;
    if (b->st) cudaStreamSynchronize(b->st);
    drop_graphs(b);
    if (b->L) {
        for (int l = 0; l < b->c.n_layer; l++) {
            struct clayer *L = &b->L[l];
            cudaFree(L->wqkv), cudaFree(L->wo), cudaFree(L->wgu), cudaFree(L->wdown);
            cudaFree(L->attn_norm), cudaFree(L->ffn_norm), cudaFree(L->bqkv), cudaFree(L->q_norm), cudaFree(L->k_norm);
        }
        free(b->L);
    }
    if (b->lm_head != b->tok_embd) cudaFree(b->lm_head);
    cudaFree(b->tok_embd), cudaFree(b->out_norm), cudaFree(b->rope_cos), cudaFree(b->rope_sin), cudaFree(b->kv);
    cudaFree(b->x), cudaFree(b->xn), cudaFree(b->qkv), cudaFree(b->q), cudaFree(b->att), cudaFree(b->delta);
    cudaFree(b->gu), cudaFree(b->h), cudaFree(b->hfin), cudaFree(b->logits), cudaFree(b->tok), cudaFree(b->lp);
    cudaFree(b->part), cudaFree(b->din), cudaFree(b->blas_ws);
    cudaFreeHost(b->hin), cudaFreeHost(b->hout_tok), cudaFreeHost(b->hout_lp), cudaFreeHost(b->hlog);
    free(b->samp), free(b->row_seq), free(b->tok_seq);
    if (b->blas) cublasDestroy(b->blas);
    if (b->st) cudaStreamDestroy(b->st);
    free(b);
}

/* weights.c - a rank's share of the model (cuda_rank_init): its shard of
 * the weights uploaded and packed, its RoPE tables and the working memory
 * a step uses, all sized at creation.
 *
 * Numerics: every weight matrix is converted to bf16 at creation (GGUF
 * Q4_0/Q4_1/Q8_0/F16 dequantized on the host with model_tensor_to_f32, then
 * rounded to nearest even), but packed int4/int8 safetensors weights
 * (W4A16/W8A16: compressed-tensors, AWQ, GPTQ), which are converted to the
 * one packed device layout of qgemm.h and multiplied by its mixed-input
 * kernels (a layer with any of them takes the unfused kernels; q|k|v and
 * gate|up stay one packed matrix when their parts are packed alike, else run
 * part by part); norm weights and biases stay f32. Activations
 * between kernels are bf16, the residual stream is f32, every GEMM (cuBLAS,
 * bf16 in, f32 compute) and every reduction accumulates in f32. Fused Q|K|V
 * and gate|up matrices make one GEMM each.
 */
#include <cuda_runtime.h>
#include <math.h>
#include <nccl.h>
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

static uint16_t to_bf16(float f)
{
    uint32_t u;
    memcpy(&u, &f, 4);
    if ((u & 0x7fffffffu) > 0x7f800000u) return 0x7fc0; /* NaN */
    u += 0x7fffu + ((u >> 16) & 1u);                     /* round to nearest even */
    return (uint16_t)(u >> 16);
}

#define STAGE_ELEMS ((size_t)16 << 20) /* elements per staging transfer (32 MB of bf16) */

/* Copies rows [r0, r0 + nr) x columns [c0, c0 + nc) of t, a matrix of `cols`
 * columns, as bf16 [nr][nc] to dst (device). stage: pinned [STAGE_ELEMS]
 * bf16; tmp: host [STAGE_ELEMS] f32. Quantized rows are dequantized whole,
 * so blocks are never split. */
static int upload_bf16(const struct model_tensor *t, int64_t cols, int64_t r0, int64_t nr, int64_t c0, int64_t nc,
                       uint16_t *dst, uint16_t *stage, float *tmp, char *err, size_t errlen)
{
    int64_t rows_per = (int64_t)(STAGE_ELEMS / (size_t)cols);
    if (rows_per < 1) {
        sl_seterr(err, errlen, "tensor %s: rows too long to stage", t->name ? t->name : "?");
        return SL_EUNSUP;
    }
    for (int64_t a = 0; a < nr; a += rows_per) {
        int64_t n = nr - a < rows_per ? nr - a : rows_per;
        if (t->dtype == MODEL_DT_BF16) {
            const uint16_t *src = (const uint16_t *)t->data;
#pragma omp parallel for schedule(static)
            for (int64_t r = 0; r < n; r++)
                memcpy(stage + r * nc, src + (r0 + a + r) * cols + c0, (size_t)nc * 2);
        } else {
#pragma omp parallel for schedule(dynamic, 16)
            for (int64_t r = 0; r < n; r++) {
                float *row = tmp + r * cols;
                model_tensor_to_f32(t, (r0 + a + r) * cols, cols, row);
                for (int64_t i = 0; i < nc; i++) stage[r * nc + i] = to_bf16(row[c0 + i]);
            }
        }
        cudaError_t e = cudaMemcpy(dst + a * nc, stage, (size_t)(n * nc) * 2, cudaMemcpyHostToDevice);
        if (e != cudaSuccess) {
            sl_seterr(err, errlen, "upload %s: %s", t->name ? t->name : "?", cudaGetErrorString(e));
            return SL_EDEVICE;
        }
    }
    return 0;
}

/* Copies elements [off, off + n) of t as f32 to dst (device). */
static int upload_f32(const struct model_tensor *t, int64_t off, int64_t n, float *dst, char *err, size_t errlen)
{
    float *h = malloc((size_t)(off + n) * sizeof *h);
    if (!h) {
        sl_seterr(err, errlen, "out of host memory");
        return SL_ENOMEM;
    }
    model_tensor_to_f32(t, 0, off + n, h);
    cudaError_t e = cudaMemcpy(dst, h + off, (size_t)n * sizeof *h, cudaMemcpyHostToDevice);
    free(h);
    if (e != cudaSuccess) {
        sl_seterr(err, errlen, "upload %s: %s", t->name ? t->name : "?", cudaGetErrorString(e));
        return SL_EDEVICE;
    }
    return 0;
}

int cuda_dmalloc(void **p, size_t n, char *err, size_t errlen)
{
    cudaError_t e = cudaMalloc(p, n ? n : 16);
    if (e != cudaSuccess) {
        *p = NULL;
        sl_seterr(err, errlen, "cudaMalloc(%.2f GB) failed: %s", n / 1e9, cudaGetErrorString(e));
        return SL_ENOMEM;
    }
    return 0;
}

int cuda_upload_vec(const struct model_tensor *t, size_t first, size_t n, float (*map)(float), float **dst, char *err,
                    size_t errlen)
{
    if (!t->data || (size_t)model_tensor_nelem(t) < first + n) {
        sl_seterr(err, errlen, "cuda: tensor %s: absent or smaller than %zu elements", t->name ? t->name : "?",
                  first + n);
        return SL_EFORMAT;
    }
    float *h = malloc(n * sizeof *h);
    if (!h) {
        sl_seterr(err, errlen, "out of host memory");
        return SL_ENOMEM;
    }
    model_tensor_to_f32(t, (int64_t)first, (int64_t)n, h);
    if (map)
        for (size_t i = 0; i < n; i++) h[i] = map(h[i]);
    int rc = cuda_dmalloc((void **)dst, n * sizeof *h, err, errlen);
    if (!rc && cudaMemcpy(*dst, h, n * sizeof *h, cudaMemcpyHostToDevice) != cudaSuccess) {
        sl_seterr(err, errlen, "cuda: upload of %s failed", t->name ? t->name : "?");
        rc = SL_EDEVICE;
    }
    free(h);
    return rc;
}

/* ---- packed weights -------------------------------------------------------------- */

/* A device copy of src[0..n) recorded in k->qmem (rank_free frees it). */
static void *qdup(struct rank *k, const void *src, size_t n, char *err, size_t errlen)
{
    if (k->n_qmem == k->cap_qmem) {
        int cap = k->cap_qmem ? 2 * k->cap_qmem : 64;
        void **m = realloc(k->qmem, (size_t)cap * sizeof *m);
        if (!m) {
            sl_seterr(err, errlen, "out of host memory");
            return NULL;
        }
        k->qmem = m, k->cap_qmem = cap;
    }
    void *d;
    if (cuda_dmalloc(&d, n, err, errlen)) return NULL;
    k->qmem[k->n_qmem++] = d;
    if (src) {
        cudaError_t e = cudaMemcpy(d, src, n, cudaMemcpyHostToDevice);
        if (e != cudaSuccess) {
            sl_seterr(err, errlen, "upload of a packed weight: %s", cudaGetErrorString(e));
            return NULL;
        }
    }
    return d;
}

/* Whether two repacked blocks can be stacked into one packed matrix. */
static bool qcompat(const struct model_qrepack *a, const struct model_qrepack *b)
{
    return a->bits == b->bits && a->cols == b->cols && a->group == b->group && a->n_groups == b->n_groups &&
           a->row_bytes == b->row_bytes && a->f16 == b->f16 && !a->perm && !b->perm;
}

/* rp[0..n) (compatible, or n == 1) stacked by rows into one packed matrix
 * on the device. A block without zero codes gets 2^(bits-1) where another
 * has them. */
static int qmat_upload(struct rank *k, const struct model_qrepack *rp, int n, struct cuda_qmat *out, char *err,
                       size_t errlen)
{
    int64_t rows = 0, ng = rp[0].n_groups, rb = rp[0].row_bytes;
    bool zeros = false;
    for (int i = 0; i < n; i++) rows += rp[i].rows, zeros |= rp[i].zeros != NULL;
    uint8_t *hq = malloc((size_t)(rows * rb)), *hz = zeros ? malloc((size_t)(rows * ng)) : NULL;
    uint16_t *hs = malloc((size_t)(rows * ng) * 2);
    int rc = SL_ENOMEM;
    if (!hq || !hs || (zeros && !hz)) {
        sl_seterr(err, errlen, "out of host memory");
        goto out;
    }
    for (int64_t i = 0, r = 0; i < n; r += rp[i].rows, i++) {
        memcpy(hq + r * rb, rp[i].qw, (size_t)(rp[i].rows * rb));
        memcpy(hs + r * ng, rp[i].scales, (size_t)(rp[i].rows * ng) * 2);
        if (!zeros) continue;
        if (rp[i].zeros) memcpy(hz + r * ng, rp[i].zeros, (size_t)(rp[i].rows * ng));
        else memset(hz + r * ng, 1 << (rp[i].bits - 1), (size_t)(rp[i].rows * ng));
    }
    *out = (struct cuda_qmat){.bits = rp[0].bits, .rows = (int)rows, .cols = (int)rp[0].cols, .group = rp[0].group,
                              .n_groups = (int)ng, .row_bytes = (int)rb, .f16 = rp[0].f16};
    rc = SL_EDEVICE;
    if (!(out->qw = qdup(k, hq, (size_t)(rows * rb), err, errlen)) ||
        !(out->scales = qdup(k, hs, (size_t)(rows * ng) * 2, err, errlen)) ||
        (zeros && !(out->zeros = qdup(k, hz, (size_t)(rows * ng), err, errlen))) ||
        (rp[0].perm && !(out->perm = qdup(k, rp[0].perm, (size_t)rp[0].cols * 4, err, errlen))))
        goto out;
    rc = 0;
out:
    free(hq), free(hs), free(hz);
    return rc;
}

/* One projection's weight on rank k: parts i < n are rows [r0[i], r0[i] +
 * nr[i]) x columns [c0, c0 + nc) of t[i] (a matrix of `cols` columns),
 * stacked in order. With every part bf16 (or another dense or GGUF dtype):
 * one bf16 matrix into *dense, as always. With any part packed: *dense
 * NULL and the parts in P, fused into one packed matrix when all are
 * packed alike (the same bits, group, scale dtype, no act-order), else
 * each on its own (a packed part the device layout cannot hold exactly is
 * dequantized to bf16, said on stderr). A column range that cuts a group
 * is an error naming the tensor. */
static int upload_proj(struct rank *k, const struct model_tensor *const *t, const int64_t *r0, const int64_t *nr,
                       int n, int64_t cols, int64_t c0, int64_t nc, uint16_t **dense, struct qproj *P,
                       uint16_t *stage, float *tmp, char *err, size_t errlen)
{
    struct model_qrepack rp[3];
    bool packed[3] = {false, false, false}, any = false, fuse = true;
    int64_t tot = 0;
    int rc = 0;
    memset(rp, 0, sizeof rp);
    memset(P, 0, sizeof *P);
    *dense = NULL;
    for (int i = 0; i < n; i++) {
        tot += nr[i];
        if (t[i]->dtype != MODEL_DT_QPACK) continue;
        char why[256];
        rc = model_quant_repack(t[i], r0[i], nr[i], c0, nc, &rp[i], why, sizeof why);
        if (rc == SL_EUNSUP) {
            if (k->id == 0) fprintf(stderr, "cuda: %s: dequantized to bf16 at upload\n", why);
            rc = 0;
            continue;
        }
        if (rc) {
            sl_seterr(err, errlen, "cuda: %s", why);
            goto out;
        }
        packed[i] = any = true;
    }
    if (!any) {
        if ((rc = cuda_dmalloc((void **)dense, (size_t)(tot * nc) * 2, err, errlen))) goto out;
        for (int64_t i = 0, off = 0; i < n; off += nr[i], i++)
            if ((rc = upload_bf16(t[i], cols, r0[i], nr[i], c0, nc, *dense + off * nc, stage, tmp, err, errlen)))
                goto out;
        goto out;
    }
    for (int i = 0; i < n; i++) fuse &= packed[i] && (n == 1 || qcompat(&rp[0], &rp[i]));
    if (fuse) {
        P->n = 1;
        P->p[0].rows = (int)tot;
        rc = qmat_upload(k, rp, n, &P->p[0].q, err, errlen);
        goto out;
    }
    P->n = n;
    for (int64_t i = 0, off = 0; i < n; off += nr[i], i++) {
        P->p[i].rows = (int)nr[i], P->p[i].off = (int)off;
        if (packed[i]) {
            rc = qmat_upload(k, &rp[i], 1, &P->p[i].q, err, errlen);
        } else {
            rc = SL_EDEVICE;
            if ((P->p[i].w = qdup(k, NULL, (size_t)(nr[i] * nc) * 2, err, errlen)))
                rc = upload_bf16(t[i], cols, r0[i], nr[i], c0, nc, P->p[i].w, stage, tmp, err, errlen);
        }
        if (rc) goto out;
    }
out:
    for (int i = 0; i < n; i++) model_qrepack_free(&rp[i]);
    return rc;
}

/* What cuda_qgemm's workspace must hold for P's packed parts: *deq bytes
 * of bf16 tiles (whole matrices up to 64 MB, else tiles of that size, at
 * least 16 rows; whole: the whole matrix, for the gate|up matrix that long
 * steps dequantize for the warpgroup GEMM), *xp act-order activations. */
static void qws_need(const struct qproj *P, bool whole, size_t *deq, size_t *xp)
{
    for (int i = 0; i < P->n; i++) {
        const struct cuda_qmat *q = &P->p[i].q;
        if (P->p[i].w) continue;
        size_t row = (size_t)q->cols * 2, rows = whole ? (size_t)q->rows : ((size_t)64 << 20) / row;
        if (rows < 16) rows = 16;
        if (rows > (size_t)q->rows) rows = (size_t)q->rows;
        if (rows * row > *deq) *deq = rows * row;
        if (q->perm && (size_t)CUDA_QGEMV_MMA_MAX_T * q->cols > *xp) *xp = (size_t)CUDA_QGEMV_MMA_MAX_T * q->cols;
    }
}

int cuda_upload_proj(struct rank *k, const struct model_tensor *const *t, const int64_t *r0, const int64_t *nr, int n,
                     int64_t cols, int64_t c0, int64_t nc, uint16_t **dense, struct qproj *P, uint16_t *stage,
                     float *tmp, char *err, size_t errlen)
{
    return upload_proj(k, t, r0, nr, n, cols, c0, nc, dense, P, stage, tmp, err, errlen);
}

void cuda_qws_need(const struct qproj *P, bool whole, size_t *deq, size_t *xp) { qws_need(P, whole, deq, xp); }

/* The RoPE tables, computed exactly as the CPU backend does (double, then f32). */
static int rope_tables(struct rank *k, char *err, size_t errlen)
{
    const struct cuda_backend *b = k->b;
    const struct model_config *c = &b->c;
    int half = c->rope_dim / 2;
    double *inv = malloc((size_t)half * sizeof *inv);
    float *cs = malloc((size_t)b->max_ctx * half * sizeof *cs), *sn = malloc((size_t)b->max_ctx * half * sizeof *sn);
    int rc = SL_ENOMEM;
    if (!inv || !cs || !sn) {
        sl_seterr(err, errlen, "out of host memory");
        goto out;
    }
    model_rope_inv_freq(c, b->w, inv);
#pragma omp parallel for schedule(static)
    for (int p = 0; p < b->max_ctx; p++)
        for (int i = 0; i < half; i++) {
            double a = (double)p * inv[i];
            cs[(size_t)p * half + i] = (float)cos(a);
            sn[(size_t)p * half + i] = (float)sin(a);
        }
    size_t bytes = (size_t)b->max_ctx * half * sizeof(float);
    if ((rc = cuda_dmalloc((void **)&k->rope_cos, bytes, err, errlen)) ||
        (rc = cuda_dmalloc((void **)&k->rope_sin, bytes, err, errlen)))
        goto out;
    rc = SL_EDEVICE;
    if (cudaMemcpy(k->rope_cos, cs, bytes, cudaMemcpyHostToDevice) != cudaSuccess ||
        cudaMemcpy(k->rope_sin, sn, bytes, cudaMemcpyHostToDevice) != cudaSuccess) {
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

/* Rank k's part of creation, on its own thread: stream, cuBLAS, its shard
 * of the weights, RoPE tables and activations. */
int cuda_rank_init(struct rank *k, char *err, size_t errlen)
{
    struct cuda_backend *b = k->b;
    const struct model_config *c = &b->c;
    const struct model_weights *w = b->w;
    uint16_t *stage = NULL;
    float *tmp = NULL;
    int N = b->tp, id = k->id;
    CK(cudaSetDevice(k->dev));
    CK(cudaStreamCreateWithFlags(&k->st, cudaStreamNonBlocking));
    CK(cuda_attention_prepare(c->head_dim));
    CK(cuda_gemm_wg_prepare());
    CB(cublasCreate(&k->blas));
    CB(cublasSetStream(k->blas, k->st));
    /* a fixed workspace: cuBLAS then never allocates, inside graph capture too */
    if (cuda_dmalloc(&k->blas_ws, (size_t)32 << 20, err, errlen)) goto fail;
    CB(cublasSetWorkspace(k->blas, k->blas_ws, (size_t)32 << 20));

    size_t E = c->n_embd, D = c->head_dim, H = c->n_head, KVH = c->n_head_kv, F = c->n_ff;
    size_t Q = H * D, KV = KVH * D;
    size_t Hl = H / N, KVl = KVH / N * D, Ql = Hl * D, Fl = F / N, QKVl = Ql + 2 * KVl;
    k->H = (int)Hl, k->KVH = (int)(KVH / N), k->F = (int)Fl;
    int64_t vper = (c->n_vocab + N - 1) / N;
    k->v0 = (int)(vper * id);
    k->vn = (int)(c->n_vocab - k->v0 < vper ? c->n_vocab - k->v0 : vper);
    CK(cudaMallocHost((void **)&stage, STAGE_ELEMS * 2));
    tmp = malloc(STAGE_ELEMS * sizeof *tmp);
    int n_all = model_n_layer_all(c); /* the MTP layer after the decoder layers (opts.mtp; else 0 of them) */
    k->L = calloc((size_t)n_all, sizeof *k->L);
    if (!tmp || !k->L) {
        sl_seterr(err, errlen, "out of host memory");
        goto fail;
    }
#define MAT(dst, t, cols, r0, nr, c0, nc)                                                           \
    do {                                                                                           \
        if (upload_bf16((t), (cols), (r0), (nr), (c0), (nc), (dst), stage, tmp, err, errlen)) goto fail; \
    } while (0)
#define VEC(dst, t, off, n)                                                                        \
    do {                                                                                           \
        if (cuda_dmalloc((void **)&(dst), (n) * sizeof(float), err, errlen) ||                          \
            upload_f32((t), (int64_t)(off), (int64_t)(n), (dst), err, errlen))                     \
            goto fail;                                                                             \
    } while (0)
    size_t vn = (size_t)k->vn, v0 = (size_t)k->v0;
    if (cuda_dmalloc((void **)&k->tok_embd, vn * E * 2, err, errlen)) goto fail;
    MAT(k->tok_embd, &w->tok_embd, E, v0, vn, 0, E);
    if (c->tie_embeddings) {
        k->lm_head = k->tok_embd;
    } else {
        const struct model_tensor *th[1] = {&w->lm_head};
        int64_t h0[1] = {(int64_t)v0}, hn[1] = {(int64_t)vn};
        if (upload_proj(k, th, h0, hn, 1, E, 0, E, &k->lm_head, &k->qhead, stage, tmp, err, errlen)) goto fail;
    }
    VEC(k->out_norm, &w->out_norm, 0, E);
    for (int l = 0; l < n_all; l++) {
        const struct model_layer_weights *lw = &w->layers[l];
        struct clayer *L = &k->L[l];
        /* column-parallel q|k|v and gate|up (rows of each part), row-parallel o and down (columns) */
        const struct model_tensor *tqkv[3] = {&lw->wq, &lw->wk, &lw->wv}, *to[1] = {&lw->wo},
                                  *tgu[2] = {&lw->w_gate, &lw->w_up}, *td[1] = {&lw->w_down};
        int64_t qkv0[3] = {(int64_t)(id * Ql), (int64_t)(id * KVl), (int64_t)(id * KVl)},
                qkvn[3] = {(int64_t)Ql, (int64_t)KVl, (int64_t)KVl}, z0[1] = {0}, En[1] = {(int64_t)E},
                gu0[2] = {(int64_t)(id * Fl), (int64_t)(id * Fl)}, gun[2] = {(int64_t)Fl, (int64_t)Fl};
        /* a GQA layer's q|k|v and o here; an MLA or KDA layer's in its upload (cuda/mla.c, cuda/kda_step.c) */
        bool gqa = model_layer_kind_of(c, l).mixer == MODEL_MIXER_GQA;
        bool mla = model_layer_kind_of(c, l).mixer == MODEL_MIXER_MLA;
        bool moe = model_layer_kind_of(c, l).ffn == MODEL_FFN_MOE; /* its experts: cuda/moe_layer.c */
        if (mla && cuda_mla_upload(k, l, err, errlen)) goto fail;
        if (model_layer_kind_of(c, l).mixer == MODEL_MIXER_KDA && cuda_kda_upload(k, l, err, errlen)) goto fail;
        if ((gqa && (upload_proj(k, tqkv, qkv0, qkvn, 3, E, 0, E, &L->wqkv, &L->qqkv, stage, tmp, err, errlen) ||
                     upload_proj(k, to, z0, En, 1, Q, id * Ql, Ql, &L->wo, &L->qo, stage, tmp, err, errlen))) ||
            (!moe && upload_proj(k, tgu, gu0, gun, 2, E, 0, E, &L->wgu, &L->qgu, stage, tmp, err, errlen)) ||
            (!moe && upload_proj(k, td, z0, En, 1, F, id * Fl, Fl, &L->wdown, &L->qdown, stage, tmp, err, errlen)) ||
            (moe && cuda_moe_upload(k, l, err, errlen)))
            goto fail;
        VEC(L->attn_norm, &lw->attn_norm, 0, E);
        VEC(L->ffn_norm, &lw->ffn_norm, 0, E);
        if (c->qkv_bias && gqa) {
            if (cuda_dmalloc((void **)&L->bqkv, QKVl * sizeof(float), err, errlen) ||
                upload_f32(&lw->bq, (int64_t)(id * Ql), (int64_t)Ql, L->bqkv, err, errlen) ||
                upload_f32(&lw->bk, (int64_t)(id * KVl), (int64_t)KVl, L->bqkv + Ql, err, errlen) ||
                upload_f32(&lw->bv, (int64_t)(id * KVl), (int64_t)KVl, L->bqkv + Ql + KVl, err, errlen))
                goto fail;
        }
        if (c->qk_norm && gqa) {
            VEC(L->q_norm, &lw->q_norm, 0, D);
            VEC(L->k_norm, &lw->k_norm, 0, D);
        }
        if (model_layer_kind_of(c, l).resid == MODEL_RESID_HC && cuda_hc_upload(k, l, err, errlen)) goto fail;
    }
#undef MAT
#undef VEC
    if (c->n_mtp_layer > 0 && cuda_mtp_upload(k, stage, tmp, err, errlen)) goto fail;
    (void)KV;
    cudaFreeHost(stage);
    stage = NULL;
    free(tmp);
    tmp = NULL;
    if (rope_tables(k, err, errlen)) goto fail;
    {
        size_t deq = 0, xp = 0;
        /* sm_90 prefill steps dequantize a packed gate|up matrix whole for the
         * warpgroup GEMM with SwiGLU fused (as bf16 weights take it) */
        bool wg = b->max_tokens >= b->t.gemm_wg_min_t && cuda_gemm_wg_ok(b->max_tokens, (int)E, (int)(2 * Fl));
        qws_need(&k->qhead, false, &deq, &xp);
        if (k->mtpx) qws_need(&k->mtpx->qeh, false, &deq, &xp);
        for (int l = 0; l < n_all; l++) {
            qws_need(&k->L[l].qqkv, false, &deq, &xp), qws_need(&k->L[l].qo, false, &deq, &xp);
            qws_need(&k->L[l].qgu, wg && k->L[l].qgu.n == 1, &deq, &xp), qws_need(&k->L[l].qdown, false, &deq, &xp);
            cuda_kda_qws_need(k, l, &deq, &xp);
        }
        if (deq && (cuda_dmalloc((void **)&k->qws.deq, deq, err, errlen) ||
                    (xp && cuda_dmalloc((void **)&k->qws.xperm, xp * 2, err, errlen))))
            goto fail;
        k->qws.deq_bytes = deq, k->qws.xperm_elems = xp;
    }

    size_t T = b->max_tokens, S = b->max_rows; /* S: logit rows */
    size_t gus = c->moe.swiglu_limit > 0 ? 4 : 2; /* glm5_next's gate|up are f32 (cuda/hc.h cuda_swiglu_limit) */
    if (cuda_dmalloc((void **)&k->x, T * E * 4, err, errlen) || cuda_dmalloc((void **)&k->xn, T * E * 2, err, errlen) ||
        cuda_dmalloc((void **)&k->qkv, T * QKVl * 2, err, errlen) || cuda_dmalloc((void **)&k->q, T * Ql * 2, err, errlen) ||
        cuda_dmalloc((void **)&k->att, T * Ql * 2, err, errlen) || cuda_dmalloc((void **)&k->delta, T * E * 2, err, errlen) ||
        cuda_dmalloc((void **)&k->gu, T * 2 * Fl * gus, err, errlen) || cuda_dmalloc((void **)&k->h, T * Fl * 2, err, errlen) ||
        cuda_dmalloc((void **)&k->hfin, S * E * 2, err, errlen) || cuda_dmalloc((void **)&k->logits, S * vn * 4, err, errlen) ||
        cuda_dmalloc((void **)&k->part, (size_t)b->part_rows * k->KVH * CUDA_ATTN_MAXSPLIT * (D + 2) * 4, err, errlen))
        goto fail;
    if (k->id == 0) {
        k->tok = (int32_t *)b->dout, k->lp = (float *)(b->dout + S * 4);
        k->sout = (struct cuda_sample_out *)(b->dout + S * 8);
    } else if (cuda_dmalloc((void **)&k->tok, S * 4, err, errlen) || cuda_dmalloc((void **)&k->lp, S * 4, err, errlen) ||
               cuda_dmalloc((void **)&k->sout, S * sizeof *k->sout, err, errlen)) {
        goto fail;
    }
    if (cuda_dmalloc((void **)&k->amp, CUDA_ARGMAX_SLICES * S * sizeof *k->amp, err, errlen) ||
        cuda_dmalloc((void **)&k->cnt, T * k->KVH * 4, err, errlen) ||
        cuda_dmalloc((void **)&k->hw, Fl * sizeof *k->hw, err, errlen))
        goto fail;
    CK(cudaMemset(k->cnt, 0, T * k->KVH * 4));
    CK(cudaMemset(k->hw, 0, Fl * sizeof *k->hw));
    if (N > 1 && (cuda_dmalloc((void **)&k->deltaf, T * E * 4, err, errlen) ||
                  cuda_dmalloc((void **)&k->amp_all, (size_t)N * S * sizeof *k->amp_all, err, errlen)))
        goto fail;
    if (b->peer) {
        /* once per pair and process (a later backend finds it on) */
        static _Atomic uint32_t peer_on[MAX_TP];
        for (int p = 0; p < N; p++) {
            uint32_t bit = 1u << b->r[p].dev;
            if (p == k->id || (atomic_load(&peer_on[k->dev]) & bit)) continue;
            cudaError_t e = cudaDeviceEnablePeerAccess(b->r[p].dev, 0);
            if (e == cudaErrorPeerAccessAlreadyEnabled) cudaGetLastError();
            else CK(e);
            atomic_fetch_or(&peer_on[k->dev], bit);
        }
        size_t fb = (size_t)CUDA_PEER_BLOCKS * CUDA_PEER_MAX * 4;
        for (int i = 0; i < 3; i++)
            if (cuda_dmalloc((void **)&k->pbuf[i], b->peer_elems * 4, err, errlen)) goto fail;
        if (cuda_dmalloc((void **)&k->pflags, fb, err, errlen) ||
            cuda_dmalloc((void **)&k->pepoch, CUDA_PEER_BLOCKS * 4, err, errlen))
            goto fail;
        CK(cudaMemset(k->pflags, 0, fb));
        CK(cudaMemset(k->pepoch, 0, CUDA_PEER_BLOCKS * 4));
    }
    if (N > 1) {
        /* NCCL connects its peers on the first collective, which cannot
         * happen inside a graph capture: one eager all-reduce and all-gather
         * now (all ranks initialize concurrently) */
        CK(cudaMemsetAsync(k->deltaf, 0, E * 4, k->st));
        NC(ncclAllReduce(k->deltaf, k->deltaf, E, ncclFloat, ncclSum, k->comm, k->st));
        NC(ncclAllGather(k->amp, k->amp_all, S * sizeof *k->amp / 4, ncclInt32, k->comm, k->st));
        if (cuda_rank_wait(k, err, errlen)) goto fail;
    }
    return 0;
fail:
    if (stage) cudaFreeHost(stage);
    free(tmp);
    return SL_EDEVICE;
}

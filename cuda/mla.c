/* mla.c - multi-head latent attention on the GPU backend: the creation
 * check, a layer's upload, the rank's tables and scratch, and the mixer's
 * launches (mla.h says what the step computes). */
#include <cuda_runtime.h>
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "cuda/cuda_internal.h"
#include "cuda/mla.h"

int cuda_mla_check(const struct model_config *c, int N, char *err, size_t errlen)
{
    const struct model_mla_config *a = &c->mla;
    int first = -1;
    for (int l = 0; l < c->n_layer && first < 0; l++)
        if (model_layer_kind_of(c, l).mixer == MODEL_MIXER_MLA) first = l;
    if (first < 0) return 0;
    if (c->n_head % N) {
        sl_seterr(err, errlen, "cuda: layer %d is MLA with %d heads: --tensor-parallel-size %d must divide them",
                  first, c->n_head, N);
        return SL_EUNSUP;
    }
    if (a->index_topk > 0 && (a->q_lora_rank <= 0 || a->index_head_dim > 256 ||
                              (a->index_kpool > 0 && a->index_topk < a->index_kpool) ||
                              a->index_head_dim < a->qk_rope_head_dim ||
                              !cuda_mla_indexer_fits(a->index_n_heads, a->index_head_dim))) {
        sl_seterr(err, errlen,
                  "cuda: layer %d is MLA with a DSA indexer the GPU backend does not run yet (%s): "
                  "--hf-overrides '{\"index_topk\": null}' (glm5_next: '{\"text_config\": {\"index_topk\": "
                  "null}}') makes it dense MLA, or use --device cpu",
                  first, "its shape");
        return SL_EUNSUP;
    }
    if (a->kv_lora_rank <= 0 || a->kv_lora_rank > CUDA_MLA_MAX_C || a->kv_lora_rank % 2 ||
        a->qk_rope_head_dim % 2 || a->qk_rope_head_dim > 256 || a->qk_nope_head_dim <= 0 || a->v_head_dim <= 0) {
        sl_seterr(err, errlen,
                  "cuda: MLA shape unsupported (kv_lora_rank %d: even, 2..%d; qk_rope_head_dim %d: even, <= 256; "
                  "qk_nope_head_dim %d, v_head_dim %d: > 0)",
                  a->kv_lora_rank, CUDA_MLA_MAX_C, a->qk_rope_head_dim, a->qk_nope_head_dim, a->v_head_dim);
        return SL_EUNSUP;
    }
    return 0;
}

static uint16_t to_bf16(float f)
{
    uint32_t u;
    memcpy(&u, &f, 4);
    if ((u & 0x7fffffffu) > 0x7f800000u) return 0x7fc0; /* NaN */
    u += 0x7fffu + ((u >> 16) & 1u);                     /* round to nearest even */
    return (uint16_t)(u >> 16);
}

/* Rows [r0, r0 + nr) x columns [c0, c0 + nc) of t, a [rows][cols] matrix
 * (a vector: rows 1), of any dtype (packed and GGUF weights dequantized
 * exactly on the host), into a new device buffer [nr][nc], bf16 (f32: as
 * f32). */
static int up(const struct model_tensor *t, int64_t rows, int64_t cols, int64_t r0, int64_t nr, int64_t c0,
              int64_t nc, bool f32, void **dst, char *err, size_t errlen)
{
    *dst = NULL;
    if (!t->data || model_tensor_nelem(t) != rows * cols) {
        sl_seterr(err, errlen, "cuda: MLA tensor %s: %lld elements, want %lld", t->name ? t->name : "?",
                  (long long)(t->data ? model_tensor_nelem(t) : 0), (long long)(rows * cols));
        return SL_EFORMAT;
    }
    int64_t n = nr * nc;
    float *h = malloc((size_t)(nr * cols) * sizeof *h);
    if (!h) {
        sl_seterr(err, errlen, "out of host memory");
        return SL_ENOMEM;
    }
    model_tensor_to_f32(t, r0 * cols, nr * cols, h);
    /* in place, row by row: element i of the output never lies after element i of the input */
    for (int64_t r = 0; r < nr; r++)
        for (int64_t i = 0; i < nc; i++) h[r * nc + i] = h[r * cols + c0 + i];
    if (!f32) {
        uint16_t *hb = (uint16_t *)h; /* element i's bf16 goes below element i's f32 */
        for (int64_t i = 0; i < n; i++) hb[i] = to_bf16(h[i]);
    }
    size_t bytes = (size_t)n * (f32 ? 4 : 2);
    int rc = cuda_dmalloc(dst, bytes, err, errlen);
    if (!rc && cudaMemcpy(*dst, h, bytes, cudaMemcpyHostToDevice) != cudaSuccess) {
        sl_seterr(err, errlen, "upload %s failed", t->name ? t->name : "?");
        rc = SL_EDEVICE;
    }
    free(h);
    return rc;
}

/* The rank's RoPE tables, as cpu_mla.c builds them (the angle in float,
 * cos and sin in double times the attention factor), and the scratch. */
static int rank_upload(struct rank *k, char *err, size_t errlen)
{
    const struct cuda_backend *b = k->b;
    const struct model_config *c = &b->c;
    const struct model_mla_config *a = &c->mla;
    struct cuda_mla_rank *x = calloc(1, sizeof *x);
    if (!x) {
        sl_seterr(err, errlen, "out of host memory");
        return SL_ENOMEM;
    }
    k->mlax = x;
    size_t T = b->max_tokens, H = (size_t)k->H, C = a->kv_lora_rank, R = a->qk_rope_head_dim, Dn = a->qk_nope_head_dim,
           Dv = a->v_head_dim, QL = a->q_lora_rank > 0 ? a->q_lora_rank : 1, half = R / 2, X = b->max_ctx;
    if (half > 0) {
        size_t ni = (size_t)(c->rope_dim > (int)R ? c->rope_dim : (int)R) / 2;
        double *inv = malloc(ni * sizeof *inv);
        float *cs = malloc(X * half * sizeof *cs), *sn = malloc(X * half * sizeof *sn);
        int rc = SL_ENOMEM;
        if (!inv || !cs || !sn) {
            sl_seterr(err, errlen, "out of host memory");
        } else {
            model_rope_inv_freq(c, b->w, inv);
            double af = a->rope_attn_factor > 0 ? a->rope_attn_factor : 1.0;
            for (size_t p = 0; p < X; p++)
                for (size_t i = 0; i < half; i++) {
                    float ang = (float)p * (float)inv[i];
                    cs[p * half + i] = (float)(cos(ang) * af);
                    sn[p * half + i] = (float)(sin(ang) * af);
                }
            size_t bytes = X * half * sizeof(float);
            rc = cuda_dmalloc((void **)&x->rcos, bytes, err, errlen);
            if (!rc) rc = cuda_dmalloc((void **)&x->rsin, bytes, err, errlen);
            if (!rc && (cudaMemcpy(x->rcos, cs, bytes, cudaMemcpyHostToDevice) != cudaSuccess ||
                        cudaMemcpy(x->rsin, sn, bytes, cudaMemcpyHostToDevice) != cudaSuccess)) {
                sl_seterr(err, errlen, "upload of the MLA RoPE tables failed");
                rc = SL_EDEVICE;
            }
        }
        free(inv), free(cs), free(sn);
        if (rc) return rc;
    }
    if (cuda_dmalloc((void **)&x->qa, T * QL * 4, err, errlen) ||
        cuda_dmalloc((void **)&x->qan, T * QL * 2, err, errlen) ||
        cuda_dmalloc((void **)&x->q, T * H * (Dn + R) * 4, err, errlen) ||
        cuda_dmalloc((void **)&x->qn, T * H * Dn * 2, err, errlen) ||
        cuda_dmalloc((void **)&x->kva, T * (C + R) * 4, err, errlen) ||
        cuda_dmalloc((void **)&x->qlat, T * H * C * 4, err, errlen) ||
        cuda_dmalloc((void **)&x->olat, T * H * C * 2, err, errlen) ||
        cuda_dmalloc((void **)&x->att, T * H * Dv * 2, err, errlen))
        return SL_ENOMEM;
    size_t pb = cuda_mla_attn_part_bytes((int)T, (int)H, (int)C, (int)R);
    if (pb && cuda_dmalloc((void **)&x->apart, pb, err, errlen)) return SL_ENOMEM;
    if (a->index_topk > 0) {
        size_t IH = a->index_n_heads, ID = a->index_head_dim;
        x->K = a->index_topk < b->max_ctx ? a->index_topk : b->max_ctx;
        x->KS = x->K + (a->index_kpool > 0 ? a->index_kpool : 0);
        /* the scores of a step's queries over the whole context would be [T][max_ctx] (8.6 GB at 16384
         * tokens and 128K): the indexer scores them ixT at a time in 256 MiB at most */
        size_t cap = ((size_t)256 << 20) / (X * 4);
        cap = cap < 65535 ? cap : 65535; /* the score kernel's grid takes the tokens in y */
        x->ixT = (int)(T < cap ? T : cap > 0 ? cap : 1);
        if (cuda_dmalloc((void **)&x->ixq, T * IH * ID * 4, err, errlen) ||
            cuda_dmalloc((void **)&x->ixk, T * ID * 4, err, errlen) ||
            cuda_dmalloc((void **)&x->ixw, T * IH * 4, err, errlen) ||
            cuda_dmalloc((void **)&x->ixs, (size_t)x->ixT * X * 4, err, errlen) ||
            cuda_dmalloc((void **)&x->sel, T * (size_t)x->KS * 4, err, errlen) ||
            cuda_dmalloc((void **)&x->nsel, T * 4, err, errlen) ||
            (a->index_kpool > 0 && cuda_dmalloc((void **)&x->ixg, T * ID * 4, err, errlen)))
            return SL_ENOMEM;
    }
    return 0;
}

int cuda_mla_upload(struct rank *k, int l, char *err, size_t errlen)
{
    const struct cuda_backend *b = k->b;
    const struct model_config *c = &b->c;
    const struct model_mla_config *a = &c->mla;
    const struct model_mla_weights *w = &b->w->layers[l].mla;
    if (!k->mlax && rank_upload(k, err, errlen)) return SL_ENOMEM;
    struct cuda_mla_layer *L = calloc(1, sizeof *L);
    if (!L) {
        sl_seterr(err, errlen, "out of host memory");
        return SL_ENOMEM;
    }
    k->L[l].mla = L;
    /* tensor parallel: the latent (q_a, kv_a) whole on every rank, heads
     * [h0, h0 + Hl) of q_b / q and kv_b by rows, their columns of o */
    int64_t E = c->n_embd, H = c->n_head, C = a->kv_lora_rank, R = a->qk_rope_head_dim, Dn = a->qk_nope_head_dim,
            Dv = a->v_head_dim, QL = a->q_lora_rank, Dq = Dn + R, Hl = k->H, h0 = (int64_t)k->id * Hl;
    int rc;
    if (QL > 0) {
        if ((rc = up(&w->q_a, QL, E, 0, QL, 0, E, false, (void **)&L->q_a, err, errlen)) ||
            (rc = up(&w->q_a_norm, 1, QL, 0, 1, 0, QL, true, (void **)&L->q_a_norm, err, errlen)) ||
            (rc = up(&w->q_b, H * Dq, QL, h0 * Dq, Hl * Dq, 0, QL, false, (void **)&L->q_b, err, errlen)))
            return rc;
    } else if ((rc = up(&w->q, H * Dq, E, h0 * Dq, Hl * Dq, 0, E, false, (void **)&L->q, err, errlen))) {
        return rc;
    }
    if ((rc = up(&w->kv_a, C + R, E, 0, C + R, 0, E, false, (void **)&L->kv_a, err, errlen)) ||
        (rc = up(&w->kv_a_norm, 1, C, 0, 1, 0, C, true, (void **)&L->kv_a_norm, err, errlen)) ||
        (rc = up(&w->kv_b, H * (Dn + Dv), C, h0 * (Dn + Dv), Hl * (Dn + Dv), 0, C, false, (void **)&L->kv_b, err,
                 errlen)) ||
        (rc = up(&w->o, E, H * Dv, 0, E, h0 * Dv, Hl * Dv, false, (void **)&L->o, err, errlen)))
        return rc;
    L->W = (int)model_kv_token_elems(c, l);
    L->ix = a->index_topk > 0 && a->index_full && l < c->n_layer && a->index_full[l];
    if (L->ix) {
        int64_t IH = a->index_n_heads, ID = a->index_head_dim;
        if ((rc = up(&w->ix_wq_b, IH * ID, QL, 0, IH * ID, 0, QL, false, (void **)&L->ix_wq_b, err, errlen)) ||
            (rc = up(&w->ix_wk, ID, E, 0, ID, 0, E, false, (void **)&L->ix_wk, err, errlen)) ||
            (rc = up(&w->ix_weights, IH, E, 0, IH, 0, E, false, (void **)&L->ix_w, err, errlen)) ||
            (rc = up(&w->ix_k_norm, 1, ID, 0, 1, 0, ID, true, (void **)&L->ix_kn, err, errlen)) ||
            (rc = up(&w->ix_k_norm_b, 1, ID, 0, 1, 0, ID, true, (void **)&L->ix_kb, err, errlen)))
            return rc;
        int64_t KP = a->index_kpool;
        for (int i = 0; i < l; i++) L->ix_i += model_layer_kind_of(c, i).mixer == MODEL_MIXER_MLA && a->index_full[i];
        if (KP > 0 &&
            ((rc = up(&w->ix_kpool_gate, ID, E, 0, ID, 0, E, false, (void **)&L->ix_gate, err, errlen)) ||
             (rc = up(&w->ix_kpool_ape, KP, ID, 0, KP, 0, ID, true, (void **)&L->ix_ape, err, errlen))))
            return rc;
    }
    return 0;
}

void cuda_mla_free(struct rank *k, int l)
{
    struct cuda_mla_layer *L = k->L ? k->L[l].mla : NULL;
    if (L) {
        cudaFree(L->q_a), cudaFree(L->q_b), cudaFree(L->q), cudaFree(L->kv_a), cudaFree(L->kv_b), cudaFree(L->o);
        cudaFree(L->q_a_norm), cudaFree(L->kv_a_norm);
        cudaFree(L->ix_wq_b), cudaFree(L->ix_wk), cudaFree(L->ix_w), cudaFree(L->ix_kn), cudaFree(L->ix_kb);
        cudaFree(L->ix_gate), cudaFree(L->ix_ape);
        free(L);
        k->L[l].mla = NULL;
    }
    struct cuda_mla_rank *x = k->mlax;
    if (x && l == k->b->c.n_layer - 1) {
        cudaFree(x->rcos), cudaFree(x->rsin), cudaFree(x->qa), cudaFree(x->qan), cudaFree(x->q), cudaFree(x->qn);
        cudaFree(x->kva), cudaFree(x->qlat), cudaFree(x->olat), cudaFree(x->att), cudaFree(x->apart);
        cudaFree(x->ixq), cudaFree(x->ixk), cudaFree(x->ixw), cudaFree(x->ixs), cudaFree(x->sel), cudaFree(x->nsel);
        cudaFree(x->ixg), cudaFree(x->ixpool);
        free(x);
        k->mlax = NULL;
    }
}

/* The layers that run their own indexer with k-pools, each with an array of pool keys. */
static int pool_layers(const struct model_config *c)
{
    const struct model_mla_config *a = &c->mla;
    int n = 0;
    if (a->index_topk <= 0 || a->index_kpool <= 0 || !a->index_full) return 0;
    for (int l = 0; l < c->n_layer; l++)
        n += model_layer_kind_of(c, l).mixer == MODEL_MIXER_MLA && a->index_full[l];
    return n;
}

size_t cuda_mla_pool_block_bytes(const struct model_config *c, int block_size)
{
    int KP = c->mla.index_kpool;
    if (KP <= 0 || block_size <= 0) return 0;
    return (size_t)pool_layers(c) * ((block_size + KP - 1) / KP) * c->mla.index_head_dim * sizeof(float);
}

int cuda_mla_kv_alloc(struct rank *k, int n_blocks, int block_size, char *err, size_t errlen)
{
    const struct model_config *c = &k->b->c;
    struct cuda_mla_rank *x = k->mlax;
    if (!x) return 0;
    cudaFree(x->ixpool);
    x->ixpool = NULL, x->ixpool_n = 0;
    size_t bytes = cuda_mla_pool_block_bytes(c, block_size);
    if (!bytes) return 0;
    x->ixpool_n = (size_t)(n_blocks + 1) * bytes / sizeof(float) / (size_t)pool_layers(c);
    /* never read before written (a pool's key is computed in the step that completes it) */
    return cuda_dmalloc((void **)&x->ixpool, (size_t)(n_blocks + 1) * bytes, err, errlen) ? SL_ENOMEM : 0;
}

/* y[T][out] = x[T][in] W^T, W bf16 [out][in]; y bf16 or f32 */
static cublasStatus_t gemm(struct rank *k, const uint16_t *x, const uint16_t *W, void *y, bool yf32, int T, int in,
                           int out)
{
    const float one = 1.0f, zero = 0.0f;
    return cublasGemmEx(k->blas, CUBLAS_OP_T, CUBLAS_OP_N, out, T, in, &one, W, CUDA_R_16BF, in, x, CUDA_R_16BF, in,
                        &zero, y, yf32 ? CUDA_R_32F : CUDA_R_16BF, out, CUBLAS_COMPUTE_32F, CUBLAS_GEMM_DEFAULT);
}

int cuda_mla_mixer(struct rank *k, int l, int T, bool decode, char *err, size_t errlen)
{
    struct cuda_backend *b = k->b;
    const struct model_config *c = &b->c;
    const struct model_mla_config *a = &c->mla;
    const struct cuda_mla_layer *L = k->L[l].mla;
    struct cuda_mla_rank *x = k->mlax;
    int E = c->n_embd, H = k->H, C = a->kv_lora_rank, R = a->qk_rope_head_dim, Dn = a->qk_nope_head_dim,
        Dv = a->v_head_dim, QL = a->q_lora_rank, Dq = Dn + R, W = Dn + Dv; /* H: this rank's heads */
    float leps = a->latent_norm_eps;
    cudaStream_t st = k->st;
    const int32_t *pos = (const int32_t *)(k->din + k->lay.pos);
    if (QL > 0) {
        CB(gemm(k, k->xn, L->q_a, x->qa, true, T, E, QL));
        CK(cuda_mla_rmsnorm(x->qa, QL, L->q_a_norm, QL, leps, T, x->qan, QL, st));
        CB(gemm(k, x->qan, L->q_b, x->q, true, T, QL, H * Dq));
    } else {
        CB(gemm(k, k->xn, L->q, x->q, true, T, E, H * Dq));
    }
    CB(gemm(k, k->xn, L->kv_a, x->kva, true, T, E, C + R));
    void *cache = (char *)k->kv + k->kv_off[l];
    struct cuda_mla_kv_args ka = {
        .q = x->q, .qn = x->qn, .kva = x->kva, .kv_norm = L->kv_a_norm, .cos = x->rcos, .sin = x->rsin,
        .pos = pos, .slots = (const int64_t *)(k->din + k->lay.slots), .cache = cache, .T = T, .H = H, .Dn = Dn,
        .R = R, .C = C, .W = L->W, .eps = leps, .interleave = a->rope_interleave, .kv8 = b->kv8,
    };
    CK(cuda_mla_kv_write(&ka, st));
    const int32_t *tok_bt = (const int32_t *)(k->din + k->lay.tok_bt), *bt = (const int32_t *)(k->din + k->lay.bt);
    if (L->ix) {
        /* every key of the step is in the cache before any query scores them (one kernel after another) */
        int IH = a->index_n_heads, ID = a->index_head_dim;
        CB(gemm(k, x->qan, L->ix_wq_b, x->ixq, true, T, QL, IH * ID));
        CB(gemm(k, k->xn, L->ix_wk, x->ixk, true, T, E, ID));
        CB(gemm(k, k->xn, L->ix_w, x->ixw, true, T, E, IH));
        if (L->ix_gate) CB(gemm(k, k->xn, L->ix_gate, x->ixg, true, T, E, ID));
        /* in chunks of ixT queries: a chunk's keys are written before its queries score, and a query's
         * keys (positions up to its own) are its sequence's tokens before it, in this chunk or an earlier */
        for (int t0 = 0; t0 < T; t0 += x->ixT) {
            struct cuda_mla_ix_args ia = {
                .q = x->ixq + (size_t)t0 * IH * ID, .k = x->ixk + (size_t)t0 * ID,
                .g = L->ix_gate ? x->ixg + (size_t)t0 * ID : NULL, .ape = L->ix_ape, .w = x->ixw + (size_t)t0 * IH,
                .kn = L->ix_kn, .kb = L->ix_kb, .cos = x->rcos, .sin = x->rsin, .pos = pos + t0,
                .tok_bt = tok_bt + t0, .bt = bt, .slots = ka.slots + t0, .cache = cache, .scores = x->ixs,
                .sel = x->sel + (size_t)t0 * x->KS, .nsel = x->nsel + t0, .T = T - t0 < x->ixT ? T - t0 : x->ixT,
                .IH = IH, .ID = ID, .R = R, .C = C, .W = L->W, .K = x->K, .KS = x->KS, .max_ctx = b->max_ctx,
                .block_size = b->block_size, .KP = a->index_kpool,
                .want = a->index_kpool > 0 ? a->index_topk / a->index_kpool : 0, .tail = a->index_kpool_tail,
                .kv8 = b->kv8, .pk = x->ixpool ? x->ixpool + (size_t)L->ix_i * x->ixpool_n : NULL,
                .PB = a->index_kpool > 0 ? (b->block_size + a->index_kpool - 1) / a->index_kpool : 0,
            };
            CK(cuda_mla_indexer(&ia, st));
        }
    }
    const float one = 1.0f, zero = 0.0f;
    /* q_lat[t][h] = W_K,h^T q_nope[t][h]: per head (C x Dn, column-major view of W_K,h) x (Dn x T) */
    CB(cublasGemmStridedBatchedEx(k->blas, CUBLAS_OP_N, CUBLAS_OP_N, C, T, Dn, &one, L->kv_b, CUDA_R_16BF, C,
                                  (long long)W * C, x->qn, CUDA_R_16BF, H * Dn, Dn, &zero, x->qlat, CUDA_R_32F, H * C,
                                  C, H, CUBLAS_COMPUTE_32F, CUBLAS_GEMM_DEFAULT));
    /* the choice a layer attends: its own, or the last full layer's before it in this step (none yet: every key) */
    bool chosen = false;
    for (int i = 0; i <= l && x->K > 0 && !chosen; i++) chosen = k->L[i].mla && k->L[i].mla->ix;
    struct cuda_mla_attn_args aa = {
        .qlat = x->qlat, .q = x->q, .cache = cache, .pos = pos, .tok_bt = tok_bt, .bt = bt,
        /* with the indexer on, every layer attends the keys of the last layer that chose (shared layers too) */
        .sel = chosen ? x->sel : NULL, .nsel = chosen ? x->nsel : NULL, .olat = x->olat, .part = x->apart,
        .T = T, .H = H, .Dn = Dn, .R = R, .C = C, .W = L->W, .K = x->KS, .block_size = b->block_size, .scale = a->softmax_scale,
        .kv8 = b->kv8, .key0 = x->key0,
    };
    /* prefill chunks on the tensor cores where the shape fits (the indexer's choice too); decode steps (one
     * token a sequence: a block of the tensor-core kernel would walk each of its tokens' contexts in turn)
     * and short steps (which the SIMT kernel's key splits fill the GPU with) on the SIMT kernel */
    if (!decode && T >= b->t.mla_prefill_min_t && cuda_mla_prefill_ok(&aa)) CK(cuda_mla_prefill(&aa, st));
    else CK(cuda_mla_attention(&aa, st));
    /* att[t][h] = W_V,h o_lat[t][h]: per head (Dv x C) x (C x T) */
    CB(cublasGemmStridedBatchedEx(k->blas, CUBLAS_OP_T, CUBLAS_OP_N, Dv, T, C, &one, L->kv_b + (size_t)Dn * C,
                                  CUDA_R_16BF, C, (long long)W * C, x->olat, CUDA_R_16BF, H * C, C, &zero, x->att,
                                  CUDA_R_16BF, H * Dv, Dv, H, CUBLAS_COMPUTE_32F, CUBLAS_GEMM_DEFAULT));
    /* this rank's heads' share of o_proj, summed over the ranks into delta */
    const struct qproj dense = {0}; /* o is bf16 (packed MLA weights are dequantized at upload) */
    return cuda_proj_rows(k, x->att, &dense, L->o, T, H * Dv, E, 0, false, err, errlen);
fail:
    return SL_EDEVICE;
}

/* moe_layer.c - the GPU backend's MoE layers (moe.h): upload of a layer's router
 * and experts, the rank's step scratch, and the step (cuda_moe_ffn).
 *
 * Upload: each expert's gate, up and down matrices (routed experts, then
 * the shared experts as expert NE) go into one device allocation per expert,
 * each matrix in the format the checkpoint gives it: bf16 (f32/f16/GGUF
 * matrices rounded to bf16, as weights.c does for dense ones), or a packed
 * int4/int8 weight converted to qgemm.h's device layout (act-order: the
 * inverse permutation kept, so the kernels read the natural activations); a
 * packed weight the layout cannot hold exactly is dequantized to bf16 (said
 * on stderr). The router stays as the file stores it when that is bf16
 * (else f32), so the routing sees the file's exact weights; qwen2_moe's
 * shared-expert gate rides as its last row.
 */
#include <cuda_runtime.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "cuda/cuda_internal.h"
#include "cuda/moe.h"

static uint16_t to_bf16(float f)
{
    uint32_t u;
    memcpy(&u, &f, 4);
    if ((u & 0x7fffffffu) > 0x7f800000u) return 0x7fc0; /* NaN */
    u += 0x7fffu + ((u >> 16) & 1u);                     /* round to nearest even */
    return (uint16_t)(u >> 16);
}

int cuda_moe_check(const struct model_config *c, int tp, int l, char *err, size_t errlen)
{
    const struct model_moe_config *mc = &c->moe;
    if (mc->n_ff_expert % tp || mc->n_ff_shared % tp) {
        sl_seterr(err, errlen,
                  "cuda: layer %d is moe: its expert intermediate size %d (shared %d) does not divide by "
                  "--tensor-parallel-size %d",
                  l, mc->n_ff_expert, mc->n_ff_shared, tp);
        return SL_EUNSUP;
    }
    if (mc->n_expert < 1 || mc->n_expert > CUDA_MOE_MAX_EXPERTS || mc->n_expert_used > mc->n_expert) {
        sl_seterr(err, errlen, "cuda: layer %d is moe with %d experts (top-%d): the GPU backend takes 1 to %d", l,
                  mc->n_expert, mc->n_expert_used, CUDA_MOE_MAX_EXPERTS);
        return SL_EUNSUP;
    }
    return 0;
}

/* A device allocation recorded in the layer (cuda_moe_free frees it). */
static void *dalloc(struct cuda_moe_layer *L, size_t n, char *err, size_t errlen)
{
    if (L->n_mem == L->cap_mem) {
        int cap = L->cap_mem ? 2 * L->cap_mem : 64;
        void **m = realloc(L->mem, (size_t)cap * sizeof *m);
        if (!m) {
            sl_seterr(err, errlen, "out of host memory");
            return NULL;
        }
        L->mem = m, L->cap_mem = cap;
    }
    void *d;
    if (cuda_dmalloc(&d, n, err, errlen)) return NULL;
    L->mem[L->n_mem++] = d;
    return d;
}

/* One expert matrix on the host, ready to copy: bf16 rows, or a repacked
 * packed weight (with its inverse permutation). */
struct staged {
    uint16_t *bf;              /* [rows][cols] or NULL */
    struct model_qrepack rp;   /* rp.qw set: packed */
    int32_t *iperm;            /* [cols] or NULL */
    size_t off[5], bytes;      /* in the expert's allocation: w or qw, scales, zeros, iperm; total */
};

static size_t al256(size_t n) { return (n + 255) & ~(size_t)255; }

static void staged_free(struct staged *s)
{
    free(s->bf);
    free(s->iperm);
    model_qrepack_free(&s->rp);
    memset(s, 0, sizeof *s);
}

/* Rows [r0, r0 + rows) x columns [c0, c0 + cols) of t, a matrix of `width`
 * columns (a rank's share of an expert matrix). */
static int stage(struct rank *k, const struct model_tensor *t, int64_t width, int64_t r0, int64_t rows, int64_t c0,
                 int64_t cols, const char *what, struct staged *s, char *err, size_t errlen)
{
    memset(s, 0, sizeof *s);
    if (!t->data) {
        sl_seterr(err, errlen, "cuda: %s missing", what);
        return SL_EFORMAT;
    }
    if (t->dtype == MODEL_DT_QPACK) {
        char why[256];
        int rc = model_quant_repack(t, r0, rows, c0, cols, &s->rp, why, sizeof why);
        if (rc == 0) {
            const struct model_qrepack *p = &s->rp;
            size_t ng = (size_t)rows * p->n_groups;
            if (p->perm) {
                if (!(s->iperm = malloc((size_t)cols * 4))) goto oom;
                for (int64_t i = 0; i < cols; i++) s->iperm[p->perm[i]] = (int32_t)i;
            }
            s->off[0] = 0;
            s->off[1] = al256((size_t)(rows * p->row_bytes));
            s->off[2] = s->off[1] + al256(ng * 2);
            s->off[3] = s->off[2] + (p->zeros ? al256(ng) : 0);
            s->bytes = s->off[3] + (s->iperm ? al256((size_t)cols * 4) : 0);
            return 0;
        }
        if (rc != SL_EUNSUP) {
            sl_seterr(err, errlen, "cuda: %s: %s", what, why);
            return rc;
        }
        if (k->id == 0) fprintf(stderr, "cuda: %s: dequantized to bf16 at upload\n", why);
        model_qrepack_free(&s->rp);
    }
    if (!(s->bf = malloc((size_t)(rows * cols) * 2))) goto oom;
    if (t->dtype == MODEL_DT_BF16) {
        const uint16_t *src = (const uint16_t *)t->data;
        for (int64_t r = 0; r < rows; r++) memcpy(s->bf + r * cols, src + (r0 + r) * width + c0, (size_t)cols * 2);
    } else {
        /* whole rows: quantized blocks are never split */
        float *row = malloc((size_t)width * sizeof *row);
        if (!row) goto oom;
        for (int64_t r = 0; r < rows; r++) {
            model_tensor_to_f32(t, (r0 + r) * width, width, row);
            for (int64_t i = 0; i < cols; i++) s->bf[r * cols + i] = to_bf16(row[c0 + i]);
        }
        free(row);
    }
    s->bytes = al256((size_t)(rows * cols) * 2);
    return 0;
oom:
    sl_seterr(err, errlen, "out of host memory");
    staged_free(s);
    return SL_ENOMEM;
}

/* Copies s to dev + base and fills m. */
static int place(const struct staged *s, char *dev, size_t base, int64_t rows, int64_t cols, struct cuda_moe_mat *m,
                 char *err, size_t errlen)
{
    memset(m, 0, sizeof *m);
    char *d = dev + base;
    if (s->bf) {
        CK(cudaMemcpy(d, s->bf, (size_t)(rows * cols) * 2, cudaMemcpyHostToDevice));
        m->w = (const uint16_t *)d;
        return 0;
    }
    const struct model_qrepack *p = &s->rp;
    size_t ng = (size_t)rows * p->n_groups;
    CK(cudaMemcpy(d + s->off[0], p->qw, (size_t)(rows * p->row_bytes), cudaMemcpyHostToDevice));
    CK(cudaMemcpy(d + s->off[1], p->scales, ng * 2, cudaMemcpyHostToDevice));
    if (p->zeros) CK(cudaMemcpy(d + s->off[2], p->zeros, ng, cudaMemcpyHostToDevice));
    if (s->iperm) CK(cudaMemcpy(d + s->off[3], s->iperm, (size_t)cols * 4, cudaMemcpyHostToDevice));
    m->qw = (const uint8_t *)(d + s->off[0]);
    m->scales = (const uint16_t *)(d + s->off[1]);
    m->zeros = p->zeros ? (const uint8_t *)(d + s->off[2]) : NULL;
    m->iperm = s->iperm ? (const int32_t *)(d + s->off[3]) : NULL;
    m->bits = p->bits, m->group = p->group, m->n_groups = p->n_groups, m->row_bytes = (int)p->row_bytes;
    m->f16 = p->f16;
    return 0;
fail:
    return SL_EDEVICE;
}

/* Expert (gate, up [F][E], down [E][F]) into one device allocation: rank
 * k's rows [k F/N, (k+1) F/N) of gate and up, those columns of down. */
static int upload_expert(struct rank *k, struct cuda_moe_layer *L, int l, const char *who,
                         const struct model_tensor *g, const struct model_tensor *u, const struct model_tensor *d,
                         int F, int E, struct cuda_moe_expert *out, char *err, size_t errlen)
{
    struct staged s[3];
    memset(s, 0, sizeof s);
    char what[3][96];
    static const char *const nm[3] = {"gate", "up", "down"};
    for (int i = 0; i < 3; i++) snprintf(what[i], sizeof what[i], "layer %d %s %s", l, who, nm[i]);
    const int64_t Fl = F / k->b->tp, f0 = Fl * k->id;
    int rc;
    if ((rc = stage(k, g, E, f0, Fl, 0, E, what[0], &s[0], err, errlen)) ||
        (rc = stage(k, u, E, f0, Fl, 0, E, what[1], &s[1], err, errlen)) ||
        (rc = stage(k, d, F, 0, E, f0, Fl, what[2], &s[2], err, errlen)))
        goto out;
    F = (int)Fl;
    size_t b1 = s[0].bytes, b2 = b1 + s[1].bytes;
    char *dev = dalloc(L, b2 + s[2].bytes, err, errlen);
    rc = SL_ENOMEM;
    if (!dev) goto out;
    out->F = F;
    if ((rc = place(&s[0], dev, 0, F, E, &out->gate, err, errlen)) ||
        (rc = place(&s[1], dev, b1, F, E, &out->up, err, errlen)) ||
        (rc = place(&s[2], dev, b2, E, F, &out->down, err, errlen)))
        goto out;
out:
    for (int i = 0; i < 3; i++) staged_free(&s[i]);
    return rc;
}

/* The rank's step scratch, sized for max_tokens (every MoE layer shares it). */
static int rank_scratch(struct rank *k, char *err, size_t errlen)
{
    const struct cuda_backend *b = k->b;
    const struct model_moe_config *mc = &b->c.moe;
    struct cuda_moe_rank *R = calloc(1, sizeof *R);
    if (!R) {
        sl_seterr(err, errlen, "out of host memory");
        return SL_ENOMEM;
    }
    k->moex = R;
    size_t T = b->max_tokens, NE = mc->n_expert, S = mc->n_expert_used + (mc->n_ff_shared > 0), E = b->c.n_embd;
    R->Fmax = (mc->n_ff_expert > mc->n_ff_shared ? mc->n_ff_expert : mc->n_ff_shared) / b->tp;
    if (cuda_dmalloc((void **)&R->logits, T * (NE + 1) * 4, err, errlen) ||
        cuda_dmalloc((void **)&R->idx, T * S * 4, err, errlen) || cuda_dmalloc((void **)&R->wt, T * S * 4, err, errlen) ||
        cuda_dmalloc((void **)&R->count, (NE + 1) * 4, err, errlen) ||
        cuda_dmalloc((void **)&R->start, (NE + 2) * 4, err, errlen) ||
        cuda_dmalloc((void **)&R->list, T * S * 4, err, errlen) ||
        cuda_dmalloc((void **)&R->act, (NE + 2) * 4, err, errlen) ||
        cuda_dmalloc((void **)&R->h, T * S * (size_t)R->Fmax * 2, err, errlen) ||
        cuda_dmalloc((void **)&R->y, T * S * E * 4, err, errlen))
        return SL_ENOMEM;
    /* zero between steps (moe.h): the small path's routing counts its blocks on count[0] */
    cudaError_t ce = cudaMemset(R->count, 0, (NE + 1) * 4);
    if (ce != cudaSuccess) {
        sl_seterr(err, errlen, "cudaMemset: %s", cudaGetErrorString(ce));
        return SL_EDEVICE;
    }
    return 0;
}

int cuda_moe_upload(struct rank *k, int l, char *err, size_t errlen)
{
    const struct cuda_backend *b = k->b;
    const struct model_config *c = &b->c;
    const struct model_moe_config *mc = &c->moe;
    const struct model_moe_weights *mw = &b->w->layers[l].moe;
    int NE = mc->n_expert, E = c->n_embd, rc;
    float *hf = NULL;
    if (!k->moex && (rc = rank_scratch(k, err, errlen))) return rc;
    struct cuda_moe_layer *L = calloc(1, sizeof *L);
    if (!L) goto oom;
    k->L[l].moe = L; /* from here cuda_moe_free cleans up */
    if (!(L->hex = calloc((size_t)NE + 1, sizeof *L->hex))) goto oom;
    for (int e = 0; e < NE; e++) {
        char who[32];
        snprintf(who, sizeof who, "expert %d", e);
        if (!mw->gate || !mw->up || !mw->down) {
            sl_seterr(err, errlen, "cuda: layer %d: experts missing", l);
            return SL_EFORMAT;
        }
        if ((rc = upload_expert(k, L, l, who, &mw->gate[e], &mw->up[e], &mw->down[e], mc->n_ff_expert, E, &L->hex[e],
                                err, errlen)))
            return rc;
    }
    if (mc->n_ff_shared > 0 && (rc = upload_expert(k, L, l, "shared experts", &mw->sh_gate, &mw->sh_up, &mw->sh_down,
                                                   mc->n_ff_shared, E, &L->hex[NE], err, errlen)))
        return rc;
    /* a layer with any packed expert takes the packed GEMM threshold (the
     * packed GEMVs are the slower ones) and the GEMM's shared memory for
     * streaming codes; mixed layers are rare (ignore lists leave whole
     * layers or the shared experts in bf16) */
    L->packed = false;
    for (int e = 0; e <= NE; e++)
        L->packed |= L->hex[e].F > 0 && (!L->hex[e].gate.w || !L->hex[e].up.w || !L->hex[e].down.w);
    /* the routed experts of one kind and the shared ones of one (the usual case, the same or not): the
     * small path's kernels for those kinds alone */
    L->streamed = cuda_moe_streamed(L->hex, NE, E, &L->streamed_shared);
    /* the router (+ qwen2_moe's shared-expert gate as row NE) */
    int R = NE + (mc->shared_gated ? 1 : 0);
    if (!mw->router.data || (mc->shared_gated && !mw->sh_weigh.data)) {
        sl_seterr(err, errlen, "cuda: layer %d: the router%s missing", l,
                  mw->router.data ? "'s shared-expert gate is" : " is");
        return SL_EFORMAT;
    }
    L->router_f32 = mw->router.dtype != MODEL_DT_BF16 || (mc->shared_gated && mw->sh_weigh.dtype != MODEL_DT_BF16);
    size_t es = L->router_f32 ? 4 : 2;
    if (!(L->router = dalloc(L, (size_t)R * E * es, err, errlen))) return SL_ENOMEM;
    if (!L->router_f32) {
        CK(cudaMemcpy(L->router, mw->router.data, (size_t)NE * E * 2, cudaMemcpyHostToDevice));
        if (mc->shared_gated)
            CK(cudaMemcpy((char *)L->router + (size_t)NE * E * 2, mw->sh_weigh.data, (size_t)E * 2,
                          cudaMemcpyHostToDevice));
    } else {
        if (!(hf = malloc((size_t)R * E * 4))) goto oom;
        model_tensor_to_f32(&mw->router, 0, (int64_t)NE * E, hf);
        if (mc->shared_gated) model_tensor_to_f32(&mw->sh_weigh, 0, E, hf + (size_t)NE * E);
        CK(cudaMemcpy(L->router, hf, (size_t)R * E * 4, cudaMemcpyHostToDevice));
        free(hf);
        hf = NULL;
    }
    if (mw->router_bias.data) {
        if (!(hf = malloc((size_t)NE * 4))) goto oom;
        model_tensor_to_f32(&mw->router_bias, 0, NE, hf);
        if (!(L->bias = dalloc(L, (size_t)NE * 4, err, errlen))) goto fail;
        CK(cudaMemcpy(L->bias, hf, (size_t)NE * 4, cudaMemcpyHostToDevice));
        free(hf);
        hf = NULL;
    }
    if (!(L->dex = dalloc(L, ((size_t)NE + 1) * sizeof *L->dex, err, errlen))) return SL_ENOMEM;
    CK(cudaMemcpy(L->dex, L->hex, ((size_t)NE + 1) * sizeof *L->dex, cudaMemcpyHostToDevice));
    return 0;
oom:
    free(hf);
    sl_seterr(err, errlen, "out of host memory");
    return SL_ENOMEM;
fail:
    free(hf);
    return SL_EDEVICE;
}

void cuda_moe_free(struct rank *k, int l)
{
    struct cuda_moe_layer *L = k->L ? k->L[l].moe : NULL;
    if (L) {
        for (int i = 0; i < L->n_mem; i++) cudaFree(L->mem[i]);
        free(L->mem);
        free(L->hex);
        free(L);
        k->L[l].moe = NULL;
    }
    struct cuda_moe_rank *R = k->moex;
    if (R && l == k->b->c.n_layer - 1) {
        cudaFree(R->logits), cudaFree(R->idx), cudaFree(R->wt), cudaFree(R->count), cudaFree(R->start);
        cudaFree(R->list), cudaFree(R->act), cudaFree(R->h), cudaFree(R->y);
        free(R);
        k->moex = NULL;
    }
}

static struct cuda_moe_args ffn_args(struct rank *k, int l, int T)
{
    const struct model_moe_config *mc = &k->b->c.moe;
    const struct cuda_moe_layer *L = k->L[l].moe;
    const struct cuda_moe_rank *R = k->moex;
    SL_ASSERT(L && R && T <= k->b->max_tokens);
    struct cuda_moe_args a = {
        .T = T, .E = k->b->c.n_embd, .NE = mc->n_expert, .K = mc->n_expert_used,
        .S = mc->n_expert_used + (mc->n_ff_shared > 0), .Fmax = R->Fmax,
        .sigmoid = mc->router == MODEL_ROUTER_SIGMOID, .norm_topk = mc->norm_topk, .n_group = mc->n_group,
        .topk_group = mc->topk_group, .shared_gated = mc->shared_gated, .scale = mc->scale,
        .swiglu_limit = mc->swiglu_limit, .xn = k->xn, .router = L->router, .router_f32 = L->router_f32,
        .bias = L->bias, .ex = L->dex, .streamed = L->streamed, .streamed_shared = L->streamed_shared,
        .packed = L->packed, .logits = R->logits, .idx = R->idx, .wt = R->wt,
        .count = R->count, .start = R->start, .list = R->list, .act = R->act, .h = R->h, .y = R->y, .out = k->delta,
    };
    return a;
}

bool cuda_moe_ffn_fuses(struct rank *k, int l, int T)
{
    if (k->b->tp != 1 || !k->L[l].moe || !k->moex || T != 1) return false;
    struct cuda_moe_args a = ffn_args(k, l, T);
    return cuda_moe_fuses(&a);
}

int cuda_moe_ffn(struct rank *k, int l, int T, bool decode, const float *nw, char *err, size_t errlen)
{
    (void)decode; /* one path: the expert kernels take any T */
    struct cuda_moe_args a = ffn_args(k, l, T);
    if (nw) {
        SL_ASSERT(k->b->tp == 1);
        a.xf = k->x, a.nw = nw, a.eps = k->b->c.norm_eps, a.resid = k->x;
    }
    if (k->b->tp == 1) {
        CK(cuda_moe_forward(&a, k->st));
        return 0;
    }
    /* N > 1: this rank's partial sum, all-reduced (NCCL), rounded to bf16 once */
    size_t n = (size_t)T * a.E;
    a.outf = k->deltaf;
    CK(cuda_moe_forward(&a, k->st));
    if (!k->b->skip_comm) NC(ncclAllReduce(k->deltaf, k->deltaf, n, ncclFloat, ncclSum, k->comm, k->st));
    CK(cuda_f32_to_bf16(k->deltaf, n, k->delta, k->st));
    return 0;
fail:
    return SL_EDEVICE;
}

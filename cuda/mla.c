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

/* The expanded form's widths for c on this device: 1 and *DK, *DV, or 0
 * where it does not run (turned off, the indexer, no kernel for the head
 * widths). */
static int x_widths(const struct cuda_backend *b, int *DK, int *DV)
{
    const struct model_mla_config *a = &b->c.mla;
    return b->t.mla_expand && a->index_topk <= 0 &&
           cuda_attention_tc_pair(a->qk_nope_head_dim + a->qk_rope_head_dim, a->v_head_dim, DK, DV);
}

/* The expanded form's scratch on rank k (mla.h), sized for one sequence of
 * max_ctx keys: it counts in the memory the KV cache is planned from (it is
 * allocated before). Where the GPU has no room, none: the absorbed form
 * everywhere (said on stderr). */
static void x_alloc(struct rank *k, struct cuda_mla_rank *x)
{
    const struct cuda_backend *b = k->b;
    const struct model_mla_config *a = &b->c.mla;
    int DK, DV;
    if (!x_widths(b, &DK, &DV)) return;
    size_t rows = ((size_t)b->max_ctx + CUDA_MLA_XBS - 1) / CUDA_MLA_XBS * CUDA_MLA_XBS, H = (size_t)k->H,
           C = a->kv_lora_rank, kv = rows * H * (DK + DV) * 2;
    int32_t *iota = malloc(rows / CUDA_MLA_XBS * 4);
    bool ok = iota && cudaMalloc((void **)&x->xlat, rows * C * 2) == cudaSuccess &&
              cudaMalloc((void **)&x->xk, kv) == cudaSuccess &&
              cudaMalloc((void **)&x->xq, (size_t)b->max_tokens * H * DK * 2) == cudaSuccess &&
              cudaMalloc((void **)&x->xiota, rows / CUDA_MLA_XBS * 4) == cudaSuccess &&
              cudaMemset(x->xk, 0, kv) == cudaSuccess && cuda_attention_prepare_pair(DK, DV) == cudaSuccess;
    if (ok) {
        for (size_t i = 0; i < rows / CUDA_MLA_XBS; i++) iota[i] = (int32_t)i;
        ok = cudaMemcpy(x->xiota, iota, rows / CUDA_MLA_XBS * 4, cudaMemcpyHostToDevice) == cudaSuccess;
    }
    free(iota);
    if (ok) {
        x->xv = x->xk + rows * H * DK;
        return;
    }
    cudaGetLastError(); /* the failed allocation's error is not the backend's */
    cudaFree(x->xlat), cudaFree(x->xk), cudaFree(x->xq), cudaFree(x->xiota);
    x->xlat = x->xk = x->xv = x->xq = NULL, x->xiota = NULL;
    fprintf(stderr, "cuda: GPU %d has no room for MLA's expanded-form scratch (%.2f GB at %d tokens of context): "
                    "prefill attends in the absorbed form\n",
            k->dev, (double)(rows * C * 2 + kv) / 1e9, b->max_ctx);
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
    x_alloc(k, x);
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
        cudaFree(x->xlat), cudaFree(x->xk), cudaFree(x->xq), cudaFree(x->xiota);
        free(x);
        k->mlax = NULL;
    }
}

/* ---- the expanded form: the plan ----------------------------------------------- */

static size_t al16(size_t o) { return (o + 15) & ~(size_t)15; }

size_t cuda_mla_xbytes(int max_tokens, int max_seqs, int max_items)
{
    size_t T = (size_t)max_tokens, S = (size_t)max_seqs;
    return al16(S * sizeof(struct cuda_mla_xseq)) + al16(S * 4) + 3 * al16(T * 4) +
           al16((size_t)max_items * sizeof(struct cuda_attn_item));
}

struct cuda_mla_xdev cuda_mla_xdev_at(uint8_t *base, int max_tokens, int max_seqs)
{
    size_t T = (size_t)max_tokens, S = (size_t)max_seqs, o = 0;
    struct cuda_mla_xdev d;
    d.seqs = (struct cuda_mla_xseq *)(base + o), o += al16(S * sizeof(struct cuda_mla_xseq));
    d.n_items = (int32_t *)(base + o), o += al16(S * 4);
    d.tok_part = (int32_t *)(base + o), o += al16(T * 4);
    d.tok_nsplit = (int32_t *)(base + o), o += al16(T * 4);
    d.aidx = (int32_t *)(base + o), o += al16(T * 4);
    d.items = (struct cuda_attn_item *)(base + o);
    return d;
}

/* the absorbed tokens' gathered rows, 256-byte aligned regions */
static size_t al256(size_t o) { return (o + 255) & ~(size_t)255; }

size_t cuda_mla_comp_bytes(int n, int H, int Dq, int Dn, int Dv)
{
    size_t N = (size_t)n, h = (size_t)H;
    return al256(N * h * Dq * 4) + al256(N * h * Dn * 2) + al256(N * h * Dv * 2) + 2 * al256(N * 4);
}

struct cuda_mla_comp cuda_mla_comp_at(void *base, int n, int H, int Dq, int Dn, int Dv)
{
    size_t N = (size_t)n, h = (size_t)H, o = 0;
    uint8_t *p = base;
    struct cuda_mla_comp c;
    c.q = (float *)(p + o), o += al256(N * h * Dq * 4);
    c.qn = (uint16_t *)(p + o), o += al256(N * h * Dn * 2);
    c.att = (uint16_t *)(p + o), o += al256(N * h * Dv * 2);
    c.pos = (int32_t *)(p + o), o += al256(N * 4);
    c.tok_bt = (int32_t *)(p + o);
    return c;
}

/* A sequence's tokens at prompt positions take the expanded form, the
 * rest the absorbed one, as cpu_mla.c decides (so a position is computed
 * one way whatever the chunking, but in decode steps, which keep the
 * absorbed form and their graphs). Items of qrows tokens a sequence (the
 * H heads as KV heads: one head a block); where the step's items alone
 * would not fill the SMs (a short chunk deep into a context), each item's
 * keys split over up to 2 n_sm / items blocks (at least 256 keys a split),
 * as far as the partials' room allows. */
bool cuda_mla_xplan(struct cuda_mla_xplan *p, const struct cuda_mla_xin *in, int n, const int32_t *pos, int T,
                    const struct cuda_mla_xdev *d)
{
    p->n_seq = p->n_groups = p->Te = p->pstride = 0;
    p->Ta = T;
    p->compact = false;
    int rows = 0, tiles = 0, qr = p->qrows;
    for (int i = 0; i < n; i++) {
        const struct cuda_mla_xin *q = &in[i];
        int m = q->n_prompt - (q->context_len - q->query_len);
        m = m < 0 ? 0 : m > q->query_len ? q->query_len : m;
        if (m <= 0) continue;
        int nk = pos[q->query_start + m - 1] + 1, r = (nk + CUDA_MLA_XBS - 1) / CUDA_MLA_XBS * CUDA_MLA_XBS;
        if (r > p->rows || p->n_seq >= p->max_seqs) return false; /* beyond max_ctx: never */
        if (!p->n_groups || rows + r > p->rows) {
            p->g[p->n_groups++] = (struct cuda_mla_xgroup){.seq0 = p->n_seq};
            rows = 0;
        }
        struct cuda_mla_xgroup *g = &p->g[p->n_groups - 1];
        d->seqs[p->n_seq] = (struct cuda_mla_xseq){.row0 = rows, .n = nk, .bt0 = q->bt0};
        p->src[p->n_seq++] = i;
        g->nseq++;
        rows += r;
        g->rows = rows;
        g->max_n = nk > g->max_n ? nk : g->max_n;
        p->Te += m;
        tiles += (m + qr - 1) / qr;
    }
    if (!p->Te) return false;
    long units = (long)tiles * p->H;
    int want = units >= p->n_sm ? 1 : (int)((2L * p->n_sm + units - 1) / units);
    want = want > CUDA_ATTN_MAXSPLIT ? CUDA_ATTN_MAXSPLIT : want;
    /* tokens whose keys may split: a part row each, [H][want][DV + 2] f32 */
    size_t per = (size_t)p->H * want * (p->DV + 2) * 4;
    long pcap = want > 1 ? (long)(p->part_bytes / per) : 0;
    for (int t = 0; t < T; t++) d->tok_part[t] = -1, d->tok_nsplit[t] = 0, d->aidx[t] = 1;
    int ni = 0, part = 0;
    bool split = false;
    for (int gi = 0; gi < p->n_groups; gi++) {
        struct cuda_mla_xgroup *g = &p->g[gi];
        g->item0 = ni;
        for (int si = g->seq0; si < g->seq0 + g->nseq; si++) {
            const struct cuda_mla_xin *q = &in[p->src[si]];
            int m = q->n_prompt - (q->context_len - q->query_len);
            m = m > q->query_len ? q->query_len : m;
            int bt0 = d->seqs[si].row0 / CUDA_MLA_XBS;
            for (int t0 = q->query_start; t0 < q->query_start + m; t0 += qr) {
                int nq = q->query_start + m - t0 < qr ? q->query_start + m - t0 : qr, hi = pos[t0 + nq - 1] + 1;
                int ns = 1;
                if (want > 1 && part + nq <= pcap) {
                    ns = (hi + 255) / 256;
                    ns = ns > want ? want : ns < 1 ? 1 : ns;
                }
                int chunk = ((hi + ns - 1) / ns + 63) / 64 * 64;
                ns = (hi + chunk - 1) / chunk;
                if (ni + ns > p->max_items) return false;
                for (int k = 0; k < ns; k++)
                    d->items[ni++] = (struct cuda_attn_item){.bt0 = bt0, .t0 = t0, .nq = nq, .kv_lo = k * chunk,
                                                             .kv_hi = (k + 1) * chunk < hi ? (k + 1) * chunk : hi,
                                                             .split = k, .nsplit = ns, .part = part};
                for (int t = t0; t < t0 + nq; t++) {
                    d->aidx[t] = 0;
                    if (ns > 1) d->tok_part[t] = part + (t - t0), d->tok_nsplit[t] = ns;
                }
                if (ns > 1) part += nq, split = true;
            }
        }
        g->nitem = ni - g->item0;
        d->n_items[gi] = g->nitem;
    }
    p->pstride = split ? want : 0;
    /* the absorbed tokens, ascending, over the flags */
    int na = 0;
    for (int t = 0; t < T; t++)
        if (d->aidx[t]) d->aidx[na++] = t;
    p->Ta = na;
    p->compact = na > 0 && (p->H * p->Dv) % 2 == 0 &&
                 cuda_mla_comp_bytes(na, p->H, p->Dn + p->R, p->Dn, p->Dv) <= p->comp_bytes;
    return true;
}

int cuda_mla_xsetup(struct cuda_backend *b, char *err, size_t errlen)
{
    const struct model_mla_config *a = &b->c.mla;
    int DK, DV;
    if (!x_widths(b, &DK, &DV)) return 0;
    for (int i = 0; i < b->tp; i++)
        if (!b->r[i].mlax || !b->r[i].mlax->xk) return 0; /* some rank has no scratch (or no MLA layer) */
    struct cuda_mla_xplan *p = calloc(1, sizeof *p);
    if (!p || !(p->g = calloc((size_t)b->max_seqs, sizeof *p->g)) ||
        !(p->src = calloc((size_t)b->max_seqs, sizeof *p->src)) ||
        !(p->in = calloc((size_t)b->max_seqs, sizeof *p->in))) {
        if (p) free(p->g), free(p->src), free(p);
        sl_seterr(err, errlen, "out of host memory");
        return SL_ENOMEM;
    }
    const struct rank *k = &b->r[0];
    p->rows = (b->max_ctx + CUDA_MLA_XBS - 1) / CUDA_MLA_XBS * CUDA_MLA_XBS;
    p->H = k->H, p->DK = DK, p->DV = DV;
    p->Dn = a->qk_nope_head_dim, p->R = a->qk_rope_head_dim, p->Dv = a->v_head_dim;
    p->qrows = b->t.mla_expand_rows == 64 ? 64 : 128;
    p->n_sm = b->n_sm, p->max_tokens = b->max_tokens, p->max_seqs = b->max_seqs;
    p->max_items = 2 * ((b->max_tokens + p->qrows - 1) / p->qrows + b->max_seqs) + 2 * b->n_sm + 64;
    p->part_bytes = k->mlax->apart ? cuda_mla_attn_part_bytes(b->max_tokens, k->H, a->kv_lora_rank, p->R) : 0;
    p->comp_bytes = (size_t)p->rows * k->H * (DK + DV) * 2;
    b->xplan = p;
    return 0;
}

void cuda_mla_xfree(struct cuda_backend *b)
{
    if (b->xplan) free(b->xplan->g), free(b->xplan->src), free(b->xplan->in), free(b->xplan);
    b->xplan = NULL;
}

bool cuda_mla_step_plan(struct cuda_backend *b, const struct step *s)
{
    struct cuda_mla_xplan *p = b->xplan;
    if (!p || s->n_seqs > p->max_seqs) return false;
    struct cuda_mla_xin *in = p->in;
    for (int i = 0, bt0 = 0; i < s->n_seqs; i++) {
        const struct step_seq *q = &s->seqs[i];
        in[i] = (struct cuda_mla_xin){.query_start = q->query_start, .query_len = q->query_len,
                                      .context_len = q->context_len, .n_prompt = q->n_prompt, .bt0 = bt0};
        bt0 += (q->context_len + b->block_size - 1) / b->block_size;
    }
    struct cuda_mla_xdev d = cuda_mla_xdev_at(b->hin + b->lay.mla, b->max_tokens, b->max_seqs);
    return cuda_mla_xplan(p, in, s->n_seqs, s->positions, s->n_tokens, &d);
}

/* ---- the expanded form: a group's launches ---------------------------------------- */

int cuda_mla_xrun(cublasHandle_t blas, const struct cuda_mla_xrun_args *a, cudaStream_t st, char *err,
                  size_t errlen)
{
    const struct cuda_mla_xg_args *g = &a->g;
    int C = g->C, Dn = g->Dn, Dv = g->Dv, H = g->H, W = Dn + Dv;
    const float one = 1.0f, zero = 0.0f;
    CK(cuda_mla_xgather(g, st));
    /* K[r][h][0 .. Dn) = lat[r] . W_K,h rows; V[r][h][0 .. Dv) = lat[r] . W_V,h rows: per head (Dn x C) x
     * (C x rows) into its columns of the scratch rows */
    CB(cublasGemmStridedBatchedEx(blas, CUBLAS_OP_T, CUBLAS_OP_N, Dn, a->rows, C, &one, a->kv_b, CUDA_R_16BF, C,
                                  (long long)W * C, g->lat, CUDA_R_16BF, C, 0, &zero, g->k, CUDA_R_16BF, H * g->DK,
                                  g->DK, H, CUBLAS_COMPUTE_32F, CUBLAS_GEMM_DEFAULT));
    CB(cublasGemmStridedBatchedEx(blas, CUBLAS_OP_T, CUBLAS_OP_N, Dv, a->rows, C, &one, a->kv_b + (size_t)Dn * C,
                                  CUDA_R_16BF, C, (long long)W * C, g->lat, CUDA_R_16BF, C, 0, &zero, g->v,
                                  CUDA_R_16BF, H * g->DV, g->DV, H, CUBLAS_COMPUTE_32F, CUBLAS_GEMM_DEFAULT));
    CK(cuda_attention(&a->at, st));
    return 0;
fail:
    return SL_EDEVICE;
}

size_t cuda_mla_pool_block_bytes(const struct model_config *c, int block_size)
{
    int KP = c->mla.index_kpool;
    if (KP <= 0 || block_size <= 0) return 0;
    return (size_t)model_kpool_indexer_layers(c) * ((block_size + KP - 1) / KP) * c->mla.index_head_dim * sizeof(float);
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
    x->ixpool_n = (size_t)(n_blocks + 1) * bytes / sizeof(float) / (size_t)model_kpool_indexer_layers(c);
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
    /* the choice a layer attends: its own, or the last full layer's before it in this step (none yet: every key) */
    bool chosen = false;
    for (int i = 0; i <= l && x->K > 0 && !chosen; i++) chosen = k->L[i].mla && k->L[i].mla->ix;
    /* the step's expanded tokens (cuda_mla_step_plan): not in the MTP layer (keys from 1), nor over a choice */
    const struct cuda_mla_xplan *xp = b->xplan_on && x->xk && x->key0 == 0 && !chosen ? b->xplan : NULL;
    struct cuda_mla_xdev xd = {0};
    if (xp) xd = cuda_mla_xdev_at(k->din + k->lay.mla, b->max_tokens, b->max_seqs);
    int Ta = xp ? xp->Ta : T; /* tokens in the absorbed form */
    if (Ta > 0) {
        /* the absorbed form over every token, or over its own gathered into the scratch (the expanded form
         * fills it only after them) */
        const float *aq = x->q;
        const uint16_t *aqn = x->qn;
        const int32_t *apos = pos, *atbt = tok_bt;
        uint16_t *aatt = x->att;
        int TA = T;
        struct cuda_mla_comp cp = {0};
        if (xp && xp->compact) {
            cp = cuda_mla_comp_at(x->xk, Ta, H, Dq, Dn, Dv);
            CK(cuda_mla_compact(xd.aidx, Ta, x->q, x->qn, pos, tok_bt, H, Dq, Dn, &cp, st));
            aq = cp.q, aqn = cp.qn, apos = cp.pos, atbt = cp.tok_bt, aatt = cp.att, TA = Ta;
        }
        const float one = 1.0f, zero = 0.0f;
        /* q_lat[t][h] = W_K,h^T q_nope[t][h]: per head (C x Dn, column-major view of W_K,h) x (Dn x T) */
        CB(cublasGemmStridedBatchedEx(k->blas, CUBLAS_OP_N, CUBLAS_OP_N, C, TA, Dn, &one, L->kv_b, CUDA_R_16BF, C,
                                      (long long)W * C, aqn, CUDA_R_16BF, H * Dn, Dn, &zero, x->qlat, CUDA_R_32F,
                                      H * C, C, H, CUBLAS_COMPUTE_32F, CUBLAS_GEMM_DEFAULT));
        struct cuda_mla_attn_args aa = {
            .qlat = x->qlat, .q = aq, .cache = cache, .pos = apos, .tok_bt = atbt, .bt = bt,
            /* with the indexer on, every layer attends the keys of the last layer that chose (shared layers too) */
            .sel = chosen ? x->sel : NULL, .nsel = chosen ? x->nsel : NULL, .olat = x->olat, .part = x->apart,
            .T = TA, .H = H, .Dn = Dn, .R = R, .C = C, .W = L->W, .K = x->KS, .block_size = b->block_size,
            .scale = a->softmax_scale, .kv8 = b->kv8, .key0 = x->key0,
        };
        /* prefill chunks on the tensor cores where the shape fits (the indexer's choice too); decode steps (one
         * token a sequence: a block of the tensor-core kernel would walk each of its tokens' contexts in turn)
         * and short steps (which the SIMT kernel's key splits fill the GPU with) on the SIMT kernel */
        if (!decode && TA >= b->t.mla_prefill_min_t && cuda_mla_prefill_ok(&aa)) CK(cuda_mla_prefill(&aa, st));
        else CK(cuda_mla_attention(&aa, st));
        /* att[t][h] = W_V,h o_lat[t][h]: per head (Dv x C) x (C x T) */
        CB(cublasGemmStridedBatchedEx(k->blas, CUBLAS_OP_T, CUBLAS_OP_N, Dv, TA, C, &one, L->kv_b + (size_t)Dn * C,
                                      CUDA_R_16BF, C, (long long)W * C, x->olat, CUDA_R_16BF, H * C, C, &zero, aatt,
                                      CUDA_R_16BF, H * Dv, Dv, H, CUBLAS_COMPUTE_32F, CUBLAS_GEMM_DEFAULT));
        if (aatt != x->att) CK(cuda_mla_scatter(xd.aidx, Ta, aatt, H * Dv, x->att, st));
    }
    if (xp) {
        /* the expanded form, group by group (one, unless the step's contexts exceed the scratch together),
         * each over the step's tokens: its items name only its sequences' */
        CK(cuda_mla_xq(x->q, T, H, Dq, xp->DK, x->xq, st));
        for (int gi = 0; gi < xp->n_groups; gi++) {
            const struct cuda_mla_xgroup *g = &xp->g[gi];
            struct cuda_mla_xrun_args xr = {
                .g = {.cache = cache, .bt = bt, .seqs = xd.seqs + g->seq0, .n_seqs = g->nseq, .max_n = g->max_n,
                      .C = C, .R = R, .W = L->W, .Dn = Dn, .H = H, .DK = xp->DK, .block_size = b->block_size,
                      .kv8 = b->kv8, .lat = x->xlat, .k = x->xk, .v = x->xv, .Dv = Dv, .DV = xp->DV},
                .kv_b = L->kv_b, .rows = g->rows,
                .at = {.q = x->xq, .kc = x->xk, .vc = x->xv, .pos = pos, .bt = x->xiota, .items = xd.items + g->item0,
                       .n_items = xd.n_items + gi, .max_items = g->nitem, .max_rows = xp->qrows, .H = H, .KVH = H,
                       .D = xp->DK, .block_size = CUDA_MLA_XBS, .scale = a->softmax_scale, .part = x->apart,
                       .pstride = xp->pstride, .tok_part = xd.tok_part, .tok_nsplit = xd.tok_nsplit, .T = T,
                       .out = x->att, .Dv = xp->DV, .Do = Dv},
            };
            if (cuda_mla_xrun(k->blas, &xr, st, err, errlen)) return SL_EDEVICE;
        }
    }
    /* this rank's heads' share of o_proj, summed over the ranks into delta */
    const struct qproj dense = {0}; /* o is bf16 (packed MLA weights are dequantized at upload) */
    return cuda_proj_rows(k, x->att, &dense, L->o, T, H * Dv, E, 0, false, err, errlen);
fail:
    return SL_EDEVICE;
}

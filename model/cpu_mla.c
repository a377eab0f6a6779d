/* cpu_mla.c - multi-head latent attention on the CPU backend (cpu_internal.h).
 *
 * One MLA layer over a step, as transformers' DeepseekV3Attention and
 * GlmMoeDsaAttention compute it:
 *   q      = q_b(rmsnorm(q_a(xn))) or q_proj(xn)        per head [nope | rope]
 *   latent = rmsnorm(kv_a(xn)[:C]),  k_rope = kv_a(xn)[C:]   (one per token, shared by every head)
 *   RoPE on q's rope part and k_rope: adjacent pairs (rope_interleave) or halves,
 *        cos and sin times YaRN's attention factor
 *   score  = (q_nope . k_nope_h(latent) + q_rope . k_rope) * softmax_scale
 *   out_h  = sum_j p_j v_h(latent_j),  x += o_proj(out)
 * where kv_b holds per head nope rows of K then v rows of V over the latent.
 *
 * The paged entry of a token is [latent C | k_rope R | indexer key] (no
 * heads, no V), written for every token of the step before any attends.
 *
 * Two forms, both exact to the reference within rounding:
 * - expanded (query tokens at prompt positions: prefill chunks): the
 *   context's latents are multiplied out through kv_b once per step into
 *   per-head K and V, then ordinary attention;
 * - absorbed (query tokens past the prompt: decoding, verify steps,
 *   recomputes): q_nope is taken into the latent space
 *   through kv_b's K rows (q_lat_h = W_K,h^T q_nope_h), the scores and the
 *   weighted sum run over the latents themselves, and kv_b's V rows map the
 *   result up once per head. No per-key expansion: the decode cost per key is
 *   H (C + R) for the scores and H C for the sum.
 * Each form is batch invariant on its own (every value has one fixed order of
 * operations), so a chunk's logits do not depend on what else is in the step;
 * the two forms differ from each other by rounding only.
 *
 * The DSA indexer (glm_moe_dsa, index_topk > 0): per query, the score of key
 * j is sum_h w_h relu(q_ix,h . k_ix,j / sqrt(D_ix)) with w = weights_proj(xn)
 * / sqrt(H_ix); the index_topk best keys (ties to the earlier position) are
 * the only ones attended. A layer whose indexer is "shared" reuses the
 * previous full layer's choice, which stays in this file's scratch between
 * the layers of one forward.
 *
 * glm5_next's indexer (index_kpool > 0, Glm5NextTextIndexer) scores pools of
 * kpool consecutive keys instead: a pool's key is, per channel d, the sum
 * over its tokens of softmax_i(gate_i[d] + ape[i][d]) k_i[d], with gate =
 * kpool_gate . xn kept in the paged entry beside the key; a query chooses
 * its index_topk / kpool best whole pools that end at or before it and,
 * with the tail switch, the tokens of its own incomplete pool. No RoPE.
 */
#include <math.h>
#include <omp.h>
#include <stdlib.h>
#include <string.h>

#include "cpu_internal.h"

struct mla_layer {
    float *q_a_norm, *kv_a_norm;        /* [QL], [C] */
    float *ix_k_norm, *ix_k_norm_b;     /* [ID] x2; NULL without an own indexer */
    float *attn_norm;                   /* [E] */
    struct wmat q_a, q_b, q, kv_a, kv_b, o;
    struct wmat ix_wq_b, ix_wk, ix_w, ix_gate;
    float *ix_ape;                      /* [kpool][ID] (k-pools only) */
    bool ix;                            /* runs its own indexer */
};

struct cpu_mla {
    struct model_config c;
    int E, H, Dn, R, Dv, C, QL, IH, ID, K; /* K: index_topk capped at max_ctx; 0 = dense */
    int KP, KS;                         /* k-pool size (0: per key); a token's choice stride in sel */
    int nt, max_tokens, max_ctx;
    struct mla_layer *L;                /* [model_n_layer_all]; only MLA layers filled */
    float *wmem;                        /* owned: the f32 norm vectors */
    float *rcos, *rsin;                 /* [max_ctx][R/2], times the YaRN attention factor */
    /* scratch, [max_tokens] rows unless said otherwise */
    float *xn;                          /* [E] */
    float *qa;                          /* [QL] normed q latent (the indexer reads it too) */
    float *q;                           /* [H][Dn + R] */
    float *kva;                         /* [C + R] */
    float *att;                         /* [H][Dv] */
    float *out;                         /* [E] */
    float *qlat, *olat;                 /* [H][C] absorbed query, latent output */
    float *latg;                        /* [max_ctx][C] a sequence's latents, gathered */
    float *kvx;                         /* [max_ctx][H][Dn + Dv] expanded K and V */
    float *scores;                      /* [nt][max_ctx] */
    float *rowbuf;                      /* [nt][C] dequantized kv_b rows */
    int *abs_t;                         /* [max_tokens] tokens in the absorbed form */
    /* indexer */
    float *ixq, *ixk, *ixw, *ixg;       /* [IH][ID], [ID], [IH], [ID] (k-pools: the gate scores) */
    float *poolk;                       /* [max_ctx / KP][ID] one sequence's pool keys */
    int32_t *sel;                       /* [max_tokens][KS] chosen keys, ascending */
    int *nsel;                          /* [max_tokens]: count, or -1 = every causal key */
    float *heap_s;                      /* [nt][K] */
    int32_t *heap_j;                    /* [nt][K] */
    uint8_t *mark;                      /* [nt][max_ctx] */
    float *ixm;                         /* borrowed, or NULL: cpu_mla_index_margins' destination [n_layer][T] */
};

/* ---- construction --------------------------------------------------------------- */

int cpu_mla_max_in(const struct model_config *c)
{
    const struct model_mla_config *a = &c->mla;
    if (a->kv_lora_rank <= 0) return 0;
    int m = c->n_embd;
    if (a->q_lora_rank > m) m = a->q_lora_rank;
    if (a->kv_lora_rank > m) m = a->kv_lora_rank;
    if (c->n_head * a->v_head_dim > m) m = c->n_head * a->v_head_dim;
    return m;
}

void cpu_mla_destroy(struct cpu_mla *a)
{
    if (!a) return;
    void *p[] = {a->L, a->wmem, a->rcos, a->rsin, a->xn, a->qa, a->q, a->kva, a->att, a->out, a->qlat, a->olat,
                 a->latg, a->kvx, a->scores, a->rowbuf, a->abs_t, a->ixq, a->ixk, a->ixw, a->sel, a->nsel,
                 a->heap_s, a->heap_j, a->mark, a->ixg, a->poolk};
    for (size_t i = 0; i < sizeof p / sizeof *p; i++) free(p[i]);
    free(a);
}

struct cpu_mla *cpu_mla_create(const struct cpu_backend *b, const struct model_config *c,
                               const struct model_weights *w, int max_tokens, int max_ctx, char *err, size_t errlen)
{
    const struct model_mla_config *mc = &c->mla;
    struct cpu_mla *a = calloc(1, sizeof *a);
    if (!a) goto oom;
    a->c = *c;
    a->E = c->n_embd, a->H = c->n_head, a->Dn = mc->qk_nope_head_dim, a->R = mc->qk_rope_head_dim;
    a->Dv = mc->v_head_dim, a->C = mc->kv_lora_rank, a->QL = mc->q_lora_rank;
    a->IH = mc->index_n_heads, a->ID = mc->index_head_dim;
    a->K = mc->index_topk > 0 ? (mc->index_topk < max_ctx ? mc->index_topk : max_ctx) : 0;
    a->KP = mc->index_kpool;
    a->KS = a->K + (a->KP > 0 ? a->KP : 0);
    a->nt = cpu_threads(b), a->max_tokens = max_tokens, a->max_ctx = max_ctx;
    size_t T = (size_t)max_tokens, X = (size_t)max_ctx, nt = (size_t)a->nt, E = a->E, H = a->H, C = a->C,
           Dq = (size_t)a->Dn + a->R, half = (size_t)a->R / 2;
    int n_all = model_n_layer_all(c);
    a->L = calloc((size_t)n_all, sizeof *a->L);
    a->wmem = cpu_zalloc((size_t)n_all * (E + a->QL + C + 2 * (size_t)a->ID + (size_t)a->KP * a->ID) *
                         sizeof(float));
    if (!a->L || !a->wmem) goto oom;
    float *p = a->wmem;
    for (int l = 0; l < n_all; l++) {
        if (model_layer_kind_of(c, l).mixer != MODEL_MIXER_MLA) continue;
        const struct model_mla_weights *lw = &w->layers[l].mla;
        struct mla_layer *L = &a->L[l];
        VEC(L->attn_norm, &w->layers[l].attn_norm, E);
        if (a->QL > 0) {
            VEC(L->q_a_norm, &lw->q_a_norm, a->QL);
            MAT(L->q_a, &lw->q_a);
            MAT(L->q_b, &lw->q_b);
        } else {
            MAT(L->q, &lw->q);
        }
        VEC(L->kv_a_norm, &lw->kv_a_norm, C);
        MAT(L->kv_a, &lw->kv_a);
        MAT(L->kv_b, &lw->kv_b);
        MAT(L->o, &lw->o);
        L->ix = a->K > 0 && mc->index_full && l < c->n_layer && mc->index_full[l];
        if (L->ix) {
            VEC(L->ix_k_norm, &lw->ix_k_norm, a->ID);
            VEC(L->ix_k_norm_b, &lw->ix_k_norm_b, a->ID);
            MAT(L->ix_wq_b, &lw->ix_wq_b);
            MAT(L->ix_wk, &lw->ix_wk);
            MAT(L->ix_w, &lw->ix_weights);
            if (a->KP > 0) {
                VEC(L->ix_ape, &lw->ix_kpool_ape, (size_t)a->KP * a->ID);
                MAT(L->ix_gate, &lw->ix_kpool_gate);
            }
        }
    }
    a->rcos = cpu_zalloc(X * half * sizeof(float));
    a->rsin = cpu_zalloc(X * half * sizeof(float));
    a->xn = cpu_zalloc(T * E * sizeof(float));
    a->qa = cpu_zalloc(T * (size_t)(a->QL > 0 ? a->QL : 1) * sizeof(float));
    a->q = cpu_zalloc(T * H * Dq * sizeof(float));
    a->kva = cpu_zalloc(T * (C + a->R) * sizeof(float));
    a->att = cpu_zalloc(T * H * a->Dv * sizeof(float));
    a->out = cpu_zalloc(T * E * sizeof(float));
    a->qlat = cpu_zalloc(T * H * C * sizeof(float));
    a->olat = cpu_zalloc(T * H * C * sizeof(float));
    a->latg = cpu_zalloc(X * C * sizeof(float));
    a->kvx = cpu_zalloc(X * H * (a->Dn + a->Dv) * sizeof(float));
    a->scores = cpu_zalloc(nt * X * sizeof(float));
    a->rowbuf = cpu_zalloc(nt * C * sizeof(float));
    a->abs_t = cpu_zalloc(T * sizeof(int));
    if (!a->rcos || !a->rsin || !a->xn || !a->qa || !a->q || !a->kva || !a->att || !a->out || !a->qlat ||
        !a->olat || !a->latg || !a->kvx || !a->scores || !a->rowbuf || !a->abs_t)
        goto oom;
    if (a->K > 0) {
        a->ixq = cpu_zalloc(T * a->IH * a->ID * sizeof(float));
        a->ixk = cpu_zalloc(T * a->ID * sizeof(float));
        a->ixw = cpu_zalloc(T * a->IH * sizeof(float));
        a->sel = cpu_zalloc(T * a->KS * sizeof(int32_t));
        a->nsel = cpu_zalloc(T * sizeof(int));
        a->heap_s = cpu_zalloc(nt * a->K * sizeof(float));
        a->heap_j = cpu_zalloc(nt * a->K * sizeof(int32_t));
        a->mark = cpu_zalloc(nt * X);
        if (!a->ixq || !a->ixk || !a->ixw || !a->sel || !a->nsel || !a->heap_s || !a->heap_j || !a->mark) goto oom;
        if (a->KP > 0) {
            a->ixg = cpu_zalloc(T * a->ID * sizeof(float));
            a->poolk = cpu_zalloc((X / a->KP + 1) * a->ID * sizeof(float));
            if (!a->ixg || !a->poolk) goto oom;
        }
    }
    if (half > 0) {
        double *inv = malloc(half * sizeof *inv);
        if (!inv) goto oom;
        model_rope_inv_freq(c, w, inv);
        double af = mc->rope_attn_factor > 0 ? mc->rope_attn_factor : 1.0;
        for (size_t pos = 0; pos < X; pos++)
            for (size_t i = 0; i < half; i++) {
                /* transformers: cos(pos * inv) * attention_factor, in float */
                float ang = (float)pos * (float)inv[i];
                a->rcos[pos * half + i] = (float)(cos(ang) * af);
                a->rsin[pos * half + i] = (float)(sin(ang) * af);
            }
        free(inv);
    }
    return a;
oom:
    sl_seterr(err, errlen, "out of memory for the MLA layers (%d tokens, context %d)", max_tokens, max_ctx);
fail:
    cpu_mla_destroy(a);
    return NULL;
}

/* ---- the step --------------------------------------------------------------------- */

static void rope_mla(float *x, const float *cs, const float *sn, int R, bool interleave)
{
    int half = R / 2;
    for (int i = 0; i < half; i++) {
        int i0 = interleave ? 2 * i : i, i1 = interleave ? 2 * i + 1 : i + half;
        float u = x[i0], v = x[i1];
        x[i0] = u * cs[i] - v * sn[i];
        x[i1] = v * cs[i] + u * sn[i];
    }
}

/* LayerNorm with bias over n (nn.LayerNorm: biased variance, sums in double). */
static void layernorm(float *x, const float *w, const float *bias, int n, float eps)
{
    double m = 0, v = 0;
    for (int i = 0; i < n; i++) m += x[i];
    m /= n;
    for (int i = 0; i < n; i++) v += (x[i] - m) * (x[i] - m);
    float r = (float)(1.0 / sqrt(v / n + eps));
    for (int i = 0; i < n; i++) x[i] = (float)((x[i] - m) * r) * w[i] + bias[i];
}

static inline const float *entry(const float *kv, const int32_t *bt, int j, int bs, int width)
{
    return kv + ((size_t)bt[j / bs] * bs + j % bs) * width;
}

/* heap "less": a lower score, or the same score at a later position (kept last) */
static inline bool hless(const float *s, const int32_t *j, int a, int b)
{
    return s[a] < s[b] || (s[a] == s[b] && j[a] > j[b]);
}

static void sift_down(float *s, int32_t *j, int n, int i)
{
    for (;;) {
        int l = 2 * i + 1, r = l + 1, m = i;
        if (l < n && hless(s, j, l, m)) m = l;
        if (r < n && hless(s, j, r, m)) m = r;
        if (m == i) return;
        float ts = s[i];
        int32_t tj = j[i];
        s[i] = s[m], j[i] = j[m], s[m] = ts, j[m] = tj;
        i = m;
    }
}

/* The margin of a choice of the best of a query's scores: (the last chosen
 * score - the best one left out) / the largest |score| of the query, 0 on a
 * tie (cpu_internal.h: cpu_backend_index_margins). */
static float choice_margin(float kth, float out, float amax)
{
    return amax > 0 ? (kth - out) / amax : 0.0f;
}

/* Token t's keys: the K best indexer scores among positions 0..pos; margin:
 * NULL (serving: nothing more is computed) or where its choice_margin goes. */
static void index_select(struct cpu_mla *a, const struct step *s, const int *tok_seq, const float *kv, int bs,
                         int width, int t, float *margin)
{
    int pos = s->positions[t], n = pos + 1, K = a->K, th = omp_get_thread_num();
    if (n <= K) {
        a->nsel[t] = -1;
        return;
    }
    float left = -INFINITY, amax = 0.0f; /* the best score left out, the largest |score| */
    const int32_t *bt = s->seqs[tok_seq[t]].block_table;
    float *hs = a->heap_s + (size_t)th * K;
    int32_t *hj = a->heap_j + (size_t)th * K;
    uint8_t *mark = a->mark + (size_t)th * a->max_ctx;
    const float *qt = a->ixq + (size_t)t * a->IH * a->ID, *wt = a->ixw + (size_t)t * a->IH;
    float sc = 1.0f / sqrtf((float)a->ID);
    int hn = 0;
    for (int j = 0; j < n; j++) {
        const float *kj = entry(kv, bt, j, bs, width) + a->C + a->R;
        float v = 0.0f;
        for (int h = 0; h < a->IH; h++) {
            float d = cpu_dot(qt + (size_t)h * a->ID, kj, a->ID) * sc;
            v += wt[h] * (d > 0 ? d : 0);
        }
        if (margin && fabsf(v) > amax) amax = fabsf(v);
        if (hn < K) {
            hs[hn] = v, hj[hn] = j;
            if (++hn == K)
                for (int i = K / 2 - 1; i >= 0; i--) sift_down(hs, hj, K, i);
        } else if (v > hs[0]) { /* a later equal score never displaces an earlier one */
            if (margin && hs[0] > left) left = hs[0];
            hs[0] = v, hj[0] = j;
            sift_down(hs, hj, K, 0);
        } else if (margin && v > left) {
            left = v;
        }
    }
    if (margin) *margin = choice_margin(hs[0], left, amax);
    for (int j = 0; j < n; j++) mark[j] = 0;
    for (int i = 0; i < K; i++) mark[hj[i]] = 1;
    int32_t *out = a->sel + (size_t)t * a->KS;
    int k = 0;
    for (int j = 0; j < n; j++)
        if (mark[j]) out[k++] = j;
    a->nsel[t] = k;
}

/* Sequence si's pool keys for its whole pools: a->poolk[p][ID]. */
static void pool_keys(struct cpu_mla *a, const struct mla_layer *L, const struct step *s, int si, const float *kv,
                      int bs, int width)
{
    const struct step_seq *q = &s->seqs[si];
    int KP = a->KP, ID = a->ID, np = q->context_len / KP;
#pragma omp parallel for schedule(static) num_threads(a->nt) if (np >= 16)
    for (int p = 0; p < np; p++) {
        float *pk = a->poolk + (size_t)p * ID;
        for (int d = 0; d < ID; d++) {
            float lg[KP], mx = -INFINITY, sum = 0.0f;
            for (int i = 0; i < KP; i++) {
                lg[i] = entry(kv, q->block_table, p * KP + i, bs, width)[a->C + a->R + ID + d] + L->ix_ape[i * ID + d];
                if (lg[i] > mx) mx = lg[i];
            }
            for (int i = 0; i < KP; i++) {
                lg[i] = expf(lg[i] - mx);
                sum += lg[i];
            }
            float v = 0.0f;
            for (int i = 0; i < KP; i++) v += lg[i] / sum * entry(kv, q->block_table, p * KP + i, bs, width)[a->C + a->R + d];
            pk[d] = v;
        }
    }
}

/* Token t's keys under k-pools: its index_topk / KP best whole pools that end
 * at or before it (a->poolk holds its sequence's), then its own incomplete
 * pool's tokens (with the tail switch), ascending; margin as index_select's,
 * over the pools' scores. */
static void pool_select(struct cpu_mla *a, const struct step *s, const int *tok_seq, int t, float *margin)
{
    int pos = s->positions[t], KP = a->KP, nvis = (pos + 1) / KP, th = omp_get_thread_num();
    int np_all = s->seqs[tok_seq[t]].context_len / KP;
    int want = a->c.mla.index_topk / KP;
    if (want > np_all) want = np_all;
    bool tail = a->c.mla.index_kpool_tail;
    int32_t *out = a->sel + (size_t)t * a->KS;
    int k = 0;
    if (nvis <= want) {
        if (tail) {
            a->nsel[t] = -1; /* every whole pool and the tail: all keys 0..pos */
            return;
        }
        for (int j = 0; j < nvis * KP; j++) out[k++] = j;
    } else {
        float *hs = a->heap_s + (size_t)th * a->K;
        int32_t *hj = a->heap_j + (size_t)th * a->K;
        uint8_t *mark = a->mark + (size_t)th * a->max_ctx;
        const float *qt = a->ixq + (size_t)t * a->IH * a->ID, *wt = a->ixw + (size_t)t * a->IH;
        float sc = 1.0f / sqrtf((float)a->ID);
        int hn = 0;
        float left = -INFINITY, amax = 0.0f;
        for (int p = 0; p < nvis; p++) {
            const float *pk = a->poolk + (size_t)p * a->ID;
            float v = 0.0f;
            for (int h = 0; h < a->IH; h++) {
                float d = cpu_dot(qt + (size_t)h * a->ID, pk, a->ID) * sc;
                v += wt[h] * (d > 0 ? d : 0);
            }
            if (margin && fabsf(v) > amax) amax = fabsf(v);
            if (hn < want) {
                hs[hn] = v, hj[hn] = p;
                if (++hn == want)
                    for (int i = want / 2 - 1; i >= 0; i--) sift_down(hs, hj, want, i);
            } else if (v > hs[0]) {
                if (margin && hs[0] > left) left = hs[0];
                hs[0] = v, hj[0] = p;
                sift_down(hs, hj, want, 0);
            } else if (margin && v > left) {
                left = v;
            }
        }
        if (margin && want > 0) *margin = choice_margin(hs[0], left, amax);
        for (int p = 0; p < nvis; p++) mark[p] = 0;
        for (int i = 0; i < want; i++) mark[hj[i]] = 1;
        for (int p = 0; p < nvis; p++)
            if (mark[p])
                for (int i = 0; i < KP; i++) out[k++] = p * KP + i;
    }
    if (tail)
        for (int j = nvis * KP; j <= pos; j++) out[k++] = j;
    a->nsel[t] = k;
}

/* softmax over sc[0..n) in place; returns 1 / sum */
static float softmax(float *sc, int n)
{
    float mx = -INFINITY, sum = 0.0f;
    for (int i = 0; i < n; i++)
        if (sc[i] > mx) mx = sc[i];
    for (int i = 0; i < n; i++) {
        sc[i] = expf(sc[i] - mx);
        sum += sc[i];
    }
    return 1.0f / sum;
}

/* The keys token t attends: key i of n is keys ? keys[i] : i. */
static void keys_of(const struct cpu_mla *a, int t, int pos, const int32_t **keys, int *n)
{
    *keys = NULL;
    *n = pos + 1;
    if (a->K > 0 && a->nsel[t] >= 0) {
        *keys = a->sel + (size_t)t * a->KS;
        *n = a->nsel[t];
    }
}

/* Expanded form for the first m query tokens of sequence si: its context up
 * to the last of them through kv_b. */
static void attend_expanded(struct cpu_mla *a, const struct cpu_backend *b, const struct mla_layer *L,
                            const struct step *s, int si, int m, const float *kv, int bs, int width, int key0)
{
    const struct step_seq *q = &s->seqs[si];
    int H = a->H, C = a->C, Dn = a->Dn, Dv = a->Dv, R = a->R, Dq = Dn + R, W = Dn + Dv,
        n = q->context_len - q->query_len + m;
    float scale = a->c.mla.softmax_scale;
    for (int j = 0; j < n; j++) memcpy(a->latg + (size_t)j * C, entry(kv, q->block_table, j, bs, width), C * sizeof(float));
    cpu_matmul(b, a->kvx, a->latg, &L->kv_b, NULL, n, C, H * W);
#pragma omp parallel for collapse(2) schedule(dynamic, 1) num_threads(a->nt)
    for (int t = q->query_start; t < q->query_start + m; t++)
        for (int h = 0; h < H; h++) {
            const int32_t *keys;
            int nk;
            keys_of(a, t, s->positions[t], &keys, &nk);
            int k0 = keys ? 0 : key0;
            const float *qh = a->q + ((size_t)t * H + h) * Dq;
            float *sc = a->scores + (size_t)omp_get_thread_num() * a->max_ctx;
            for (int i = k0; i < nk; i++) {
                int j = keys ? keys[i] : i;
                const float *kr = entry(kv, q->block_table, j, bs, width) + C;
                sc[i] = (cpu_dot(qh, a->kvx + ((size_t)j * H + h) * W, Dn) + cpu_dot(qh + Dn, kr, R)) * scale;
            }
            float inv = softmax(sc + k0, nk - k0);
            float *o = a->att + ((size_t)t * H + h) * Dv;
            memset(o, 0, (size_t)Dv * sizeof(float));
            for (int i = k0; i < nk; i++) {
                int j = keys ? keys[i] : i;
                cpu_axpy(o, sc[i] * inv, a->kvx + ((size_t)j * H + h) * W + Dn, Dv);
            }
        }
}

/* Absorbed form for the n tokens in a->abs_t (one query token each). */
static void attend_absorbed(struct cpu_mla *a, const struct mla_layer *L, const struct step *s, const int *tok_seq,
                            int n, const float *kv, int bs, int width, int key0)
{
    int H = a->H, C = a->C, Dn = a->Dn, Dv = a->Dv, R = a->R, Dq = Dn + R, W = Dn + Dv;
    float scale = a->c.mla.softmax_scale;
    /* q_lat_h = sum_d q_nope_h[d] W_K,h[d]: rows in ascending d, one thread per head */
#pragma omp parallel for schedule(static) num_threads(a->nt)
    for (int h = 0; h < H; h++) {
        float *row = a->rowbuf + (size_t)omp_get_thread_num() * C;
        for (int i = 0; i < n; i++) memset(a->qlat + ((size_t)a->abs_t[i] * H + h) * C, 0, (size_t)C * sizeof(float));
        for (int d = 0; d < Dn; d++) {
            cpu_deq_row(&L->kv_b, (int64_t)h * W + d, row);
            for (int i = 0; i < n; i++) {
                int t = a->abs_t[i];
                cpu_axpy(a->qlat + ((size_t)t * H + h) * C, a->q[((size_t)t * H + h) * Dq + d], row, C);
            }
        }
    }
#pragma omp parallel for collapse(2) schedule(dynamic, 1) num_threads(a->nt)
    for (int i = 0; i < n; i++)
        for (int h = 0; h < H; h++) {
            int t = a->abs_t[i];
            const int32_t *bt = s->seqs[tok_seq[t]].block_table;
            const int32_t *keys;
            int nk;
            keys_of(a, t, s->positions[t], &keys, &nk);
            int k0 = keys ? 0 : key0;
            const float *ql = a->qlat + ((size_t)t * H + h) * C, *qr = a->q + ((size_t)t * H + h) * Dq + Dn;
            float *sc = a->scores + (size_t)omp_get_thread_num() * a->max_ctx;
            for (int k = k0; k < nk; k++) {
                const float *e = entry(kv, bt, keys ? keys[k] : k, bs, width);
                sc[k] = (cpu_dot(ql, e, C) + cpu_dot(qr, e + C, R)) * scale;
            }
            float inv = softmax(sc + k0, nk - k0);
            float *o = a->olat + ((size_t)t * H + h) * C;
            memset(o, 0, (size_t)C * sizeof(float));
            for (int k = k0; k < nk; k++) cpu_axpy(o, sc[k] * inv, entry(kv, bt, keys ? keys[k] : k, bs, width), C);
        }
    /* one up-projection per head: out_h[e] = W_V,h[e] . o_lat_h */
#pragma omp parallel for schedule(static) num_threads(a->nt)
    for (int h = 0; h < H; h++) {
        float *row = a->rowbuf + (size_t)omp_get_thread_num() * C;
        for (int e = 0; e < Dv; e++) {
            cpu_deq_row(&L->kv_b, (int64_t)h * W + Dn + e, row);
            for (int i = 0; i < n; i++) {
                int t = a->abs_t[i];
                a->att[((size_t)t * H + h) * Dv + e] = cpu_dot(row, a->olat + ((size_t)t * H + h) * C, C);
            }
        }
    }
}

void cpu_mla_mixer(struct cpu_mla *a, const struct cpu_backend *b, const struct step *s, const int *tok_seq, int l,
                   const float *x, float *dst, float *kv, int bs, int key0)
{
    const struct mla_layer *L = &a->L[l];
    const struct model_config *c = &a->c;
    int T = s->n_tokens, E = a->E, H = a->H, C = a->C, R = a->R, QL = a->QL, Dq = a->Dn + R, half = R / 2;
    int width = (int)model_kv_token_elems(c, l);
    float eps = c->norm_eps, leps = c->mla.latent_norm_eps;
    bool inter = c->mla.rope_interleave;
#pragma omp parallel for num_threads(a->nt) if (T >= 8)
    for (int t = 0; t < T; t++) cpu_rmsnorm(a->xn + (size_t)t * E, x + (size_t)t * E, L->attn_norm, E, eps);
    unsigned bf = cpu_bf16_families(b); /* 0 but in tests (cpu_backend_emulate_bf16) */
    if (bf & CPU_BF16_XN) cpu_round_bf16(a->xn, (size_t)T * E);
    if (QL > 0) {
        cpu_matmul(b, a->qa, a->xn, &L->q_a, NULL, T, E, QL);
        for (int t = 0; t < T; t++) cpu_rmsnorm(a->qa + (size_t)t * QL, a->qa + (size_t)t * QL, L->q_a_norm, QL, leps);
        if (bf & CPU_BF16_MLA) cpu_round_bf16(a->qa, (size_t)T * QL);
        cpu_matmul(b, a->q, a->qa, &L->q_b, NULL, T, QL, H * Dq);
    } else {
        cpu_matmul(b, a->q, a->xn, &L->q, NULL, T, E, H * Dq);
    }
    cpu_matmul(b, a->kva, a->xn, &L->kv_a, NULL, T, E, C + R);
    if (L->ix) {
        cpu_matmul(b, a->ixq, a->qa, &L->ix_wq_b, NULL, T, QL, a->IH * a->ID);
        cpu_matmul(b, a->ixk, a->xn, &L->ix_wk, NULL, T, E, a->ID);
        cpu_matmul(b, a->ixw, a->xn, &L->ix_w, NULL, T, E, a->IH);
        if (a->KP > 0) cpu_matmul(b, a->ixg, a->xn, &L->ix_gate, NULL, T, E, a->ID);
    }
#pragma omp parallel for num_threads(a->nt) if (T >= 8)
    for (int t = 0; t < T; t++) {
        int pos = s->positions[t];
        const float *cs = a->rcos + (size_t)pos * half, *sn = a->rsin + (size_t)pos * half;
        float *kt = a->kva + (size_t)t * (C + R);
        cpu_rmsnorm(kt, kt, L->kv_a_norm, C, leps);
        rope_mla(kt + C, cs, sn, R, inter);
        for (int h = 0; h < H; h++) rope_mla(a->q + ((size_t)t * H + h) * Dq + a->Dn, cs, sn, R, inter);
        float *e = kv + (size_t)s->slots[t] * width;
        if (bf & CPU_BF16_MLA) cpu_round_bf16(kt, (size_t)(C + R));
        memcpy(e, kt, (size_t)(C + R) * sizeof(float));
        if (L->ix) {
            /* GlmMoeDsaIndexer: rope on the first R dims of each head, always in pairs */
            float *k = a->ixk + (size_t)t * a->ID;
            layernorm(k, L->ix_k_norm, L->ix_k_norm_b, a->ID, 1e-6f);
            rope_mla(k, cs, sn, R, true);
            for (int h = 0; h < a->IH; h++) rope_mla(a->ixq + ((size_t)t * a->IH + h) * a->ID, cs, sn, R, true);
            float wsc = 1.0f / sqrtf((float)a->IH);
            for (int h = 0; h < a->IH; h++) a->ixw[(size_t)t * a->IH + h] *= wsc;
            memcpy(e + C + R, k, (size_t)a->ID * sizeof(float));
            if (a->KP > 0) memcpy(e + C + R + a->ID, a->ixg + (size_t)t * a->ID, (size_t)a->ID * sizeof(float));
        }
    }
    /* every key of the step is in the cache now */
    if (L->ix && a->KP > 0) {
        for (int si = 0; si < s->n_seqs; si++) {
            const struct step_seq *q = &s->seqs[si];
            if (q->query_len <= 0) continue;
            pool_keys(a, L, s, si, kv, bs, width);
#pragma omp parallel for schedule(dynamic, 1) num_threads(a->nt)
            for (int t = q->query_start; t < q->query_start + q->query_len; t++)
                pool_select(a, s, tok_seq, t, a->ixm ? a->ixm + (size_t)l * T + t : NULL);
        }
    } else if (L->ix) {
#pragma omp parallel for schedule(dynamic, 1) num_threads(a->nt)
        for (int t = 0; t < T; t++) index_select(a, s, tok_seq, kv, bs, width, t, a->ixm ? a->ixm + (size_t)l * T + t : NULL);
    }
    /* A token at a prompt position takes the expanded form, one past the
     * prompt (decoding, a verify step's tokens, a preempted sequence's
     * recompute) the absorbed form: a position is computed one way whatever
     * else its step holds, so cached, chunked, speculative and recomputed
     * runs give the bits of a plain one */
    int n_abs = 0;
    for (int si = 0; si < s->n_seqs; si++) {
        const struct step_seq *q = &s->seqs[si];
        int m = q->n_prompt - (q->context_len - q->query_len);
        m = m < 0 ? 0 : m > q->query_len ? q->query_len : m;
        if (m > 0) attend_expanded(a, b, L, s, si, m, kv, bs, width, key0);
        for (int t = q->query_start + m; t < q->query_start + q->query_len; t++) a->abs_t[n_abs++] = t;
    }
    if (n_abs > 0) attend_absorbed(a, L, s, tok_seq, n_abs, kv, bs, width, key0);
    if (bf & CPU_BF16_MLA) cpu_round_bf16(a->att, (size_t)T * H * a->Dv);
    cpu_matmul(b, a->out, a->att, &L->o, NULL, T, H * a->Dv, E);
    for (size_t i = 0; i < (size_t)T * E; i++) dst[i] += a->out[i];
}

void cpu_mla_index_margins(struct cpu_mla *a, float *dst) { a->ixm = dst; }

/* loader_dummy.c - random weights from a configuration alone (loader_dummy.h),
 * as vLLM's --load-format dummy: large shapes can be served and measured
 * without downloading them. The numbers are deterministic (a fixed seed). */
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "loader_dummy.h"
#include "quant.h"

#define SLACK ((int64_t)1 << 20) /* elements of offset room between windows */

struct dummy {
    uint16_t *pool;  /* [n_pool] bf16 uniform in +-0.02 */
    uint16_t *ones;  /* [n_vec] bf16 1.0 */
    uint16_t *zeros; /* [n_vec] bf16 0.0 */
    int64_t n_pool, n_vec;
    int next;        /* windows handed out, for offsets */
    /* packed weights (a quantization_config): their descriptors, one pool
     * of random bytes (codes, zero points) and bf16 scale pools */
    struct model_quant *quants;
    int n_quants;
    uint8_t *bytes;
    int64_t n_bytes;
    uint16_t *scales[2];  /* int4, int8 */
    int64_t n_scales;
    int32_t **gidx;       /* act-order indexes, one per packed weight that has one */
    int n_gidx;
    struct model_tensor *experts; /* [MoE layers][3][n_expert] expert views */
    struct model_mtp_weights *mtp; /* [n_mtp_layer] */
};

static uint64_t mix(uint64_t z)
{
    z = (z ^ (z >> 30)) * 0xbf58476d1ce4e5b9ULL;
    z = (z ^ (z >> 27)) * 0x94d049bb133111ebULL;
    return z ^ (z >> 31);
}

static void mat(struct dummy *d, struct model_tensor *t, const char *name, int64_t rows, int64_t cols)
{
    int64_t off = ((int64_t)d->next++ * 7919 * 64) % SLACK;
    *t = (struct model_tensor){.name = name, .dtype = MODEL_DT_BF16, .ndim = 2, .ne = {cols, rows, 1, 1},
                               .data = d->pool + off, .nbytes = (size_t)(rows * cols) * 2};
}

/* t as a random packed weight [rows][cols] of the scheme (compressed-tensors
 * pack-quantized: codes and zero points windows into the byte pool, scales
 * into the bf16 pool of its bits) */
static int qmat(struct dummy *d, struct model_tensor *t, const char *name, int64_t rows, int64_t cols, int bits,
                int group, bool sym, bool act, char *err, size_t errlen)
{
    if (group > 0 && group % 8) {
        snprintf(err, errlen, "%s: groups of %d columns (dummy weights take multiples of 8)", name, group);
        return SL_EUNSUP;
    }
    if ((cols * bits) % 32 || (rows * bits) % 32) {
        snprintf(err, errlen, "%s: %lld x %lld does not pack into 32-bit words at %d bits", name, (long long)rows,
                 (long long)cols, bits);
        return SL_EUNSUP;
    }
    struct model_quant *q = &d->quants[d->n_quants++];
    int64_t ng = group > 0 ? (cols + group - 1) / group : 1;
    int64_t off = ((int64_t)d->next++ * 7919 * 64) % SLACK;
    *q = (struct model_quant){.layout = MODEL_QL_CT, .rows = rows, .cols = cols, .bits = bits,
                              .group = group > 0 ? group : (int)cols, .n_groups = ng, .sym = sym, .act_order = act,
                              .scale_dt = MODEL_DT_BF16};
    q->qweight = d->bytes + off;
    q->scales = d->scales[bits == 8] + off;
    if (!sym) q->zeros = d->bytes + (SLACK - off);
    if (act && ng > 1) {
        int32_t *g = malloc((size_t)cols * 4);
        if (!g) return SL_ENOMEM;
        d->gidx[d->n_gidx++] = g;
        /* a random permutation's positions, in groups: every group holds `group` columns */
        for (int64_t k = 0; k < cols; k++) g[k] = (int32_t)k;
        for (int64_t k = cols - 1; k > 0; k--) {
            int64_t j = (int64_t)(mix((uint64_t)(d->next * 1000003 + k)) % (uint64_t)(k + 1));
            int32_t v = g[k];
            g[k] = g[j], g[j] = v;
        }
        for (int64_t k = 0; k < cols; k++) g[k] /= group;
        q->g_idx = g;
    } else {
        q->act_order = false;
    }
    *t = (struct model_tensor){.name = name, .dtype = MODEL_DT_QPACK, .ndim = 2, .ne = {cols, rows, 1, 1},
                               .data = q->qweight, .nbytes = (size_t)(rows * cols * bits / 8), .quant = q};
    return 0;
}

/* A projection: packed where qc quantizes module (its HF name), else bf16. */
static int proj(struct dummy *d, const struct quant_cfg *qc, struct model_tensor *t, const char *name,
                const char *module, int64_t rows, int64_t cols, char *err, size_t errlen)
{
    int bits, group;
    bool sym, act;
    int rc = quant_cfg_scheme(qc, module, true, &bits, &group, &sym, &act, err, errlen);
    if (rc < 0) return rc;
    if (rc == 0) {
        mat(d, t, name, rows, cols);
        return 0;
    }
    return qmat(d, t, name, rows, cols, bits, group, sym, act, err, errlen);
}

static void vec(struct dummy *d, struct model_tensor *t, const char *name, int64_t n, bool one)
{
    *t = (struct model_tensor){.name = name, .dtype = MODEL_DT_BF16, .ndim = 1, .ne = {n, 1, 1, 1},
                               .data = one ? d->ones : d->zeros, .nbytes = (size_t)n * 2};
}

/* What a weight takes in memory: a packed one's codes, scales and zeros. */
static size_t held_bytes(const struct model_tensor *t)
{
    if (t->dtype != MODEL_DT_QPACK || !t->quant) return t->nbytes;
    const struct model_quant *q = t->quant;
    return (size_t)(q->rows * q->cols * q->bits / 8) + (size_t)(q->rows * q->n_groups) * 2 +
           (q->sym ? 0 : (size_t)(q->rows * q->n_groups * q->bits / 8)) + (q->g_idx ? (size_t)q->cols * 4 : 0);
}

int model_dummy_weights(const struct model_config *c, const struct quant_cfg *qc, struct model_weights *w,
                        void **owner, char *err, size_t errlen)
{
    int rc = SL_ENOMEM;
    int64_t E = c->n_embd, F = c->n_ff, D = c->head_dim, Q = (int64_t)c->n_head * D,
            KV = (int64_t)c->n_head_kv * D, V = c->n_vocab;
    int64_t big = V * E, n_all = model_n_layer_all(c);
    if (F * E > big) big = F * E;
    if (2 * E * E > big) big = 2 * E * E; /* an MTP layer's eh_proj */
    if (Q * E > big) big = Q * E;
    int64_t nv = E > F ? E : F;
    if (Q > nv) nv = Q;
    const struct model_mla_config *a = &c->mla;
    int64_t H = c->n_head, QL = a->q_lora_rank, C = a->kv_lora_rank, R = a->qk_rope_head_dim,
            Dq = a->qk_nope_head_dim + R, KB = H * (a->qk_nope_head_dim + a->v_head_dim), IX = a->index_n_heads,
            ID = a->index_head_dim;
    int64_t HC = c->hc.mult, KHD = (int64_t)c->kda.n_head * c->kda.head_dim;
    if (HC * (2 + HC) * HC * E > big) big = HC * (2 + HC) * HC * E;
    if (KHD * E > big) big = KHD * E;
    if ((2 + HC) * HC > nv) nv = (2 + HC) * HC;
    if (C > 0) { /* MLA: the widest matrices and vectors of its layers */
        int64_t m[] = {QL * E, H * Dq * (QL > 0 ? QL : E), (C + R) * E, KB * C, E * H * a->v_head_dim,
                       IX * ID * QL, ID * E, IX * E, (int64_t)a->index_kpool * ID};
        for (size_t i = 0; i < sizeof m / sizeof *m; i++)
            if (m[i] > big) big = m[i];
        if (QL > nv) nv = QL;
        if (C > nv) nv = C;
        if (ID > nv) nv = ID;
    }
    int64_t KH = c->kda.n_head, KD = c->kda.head_dim, KC = KH * KD;
    if (KC > 0) { /* KDA: q/k/v and o [C][E], the conv taps, dt_bias [C] */
        if (KC * E > big) big = KC * E;
        if (KC * c->kda.conv_kernel > big) big = KC * c->kda.conv_kernel;
        if (KC > nv) nv = KC;
    }
    const struct model_moe_config *mc = &c->moe;
    int64_t FE = mc->n_ff_expert, FS = mc->n_ff_shared, NE = mc->n_expert;
    if (FE * E > big) big = FE * E;
    if (FS * E > big) big = FS * E;
    if (NE * E > big) big = NE * E;
    if (FE > nv) nv = FE;
    if (FS > nv) nv = FS;
    if (NE > nv) nv = NE;
    int n_moe = 0;
    for (int l = 0; l < n_all; l++) n_moe += model_layer_kind_of(c, l).ffn == MODEL_FFN_MOE;
    /* glm5_next's MTP modules (mla.n_mtp_layers, after the plan's layers): an MLA + MoE decoder layer each,
     * counted, never run */
    int n_mtp = C > 0 && NE > 0 ? a->n_mtp_layers : 0;
    struct model_layer_weights *mtp = NULL;
    struct dummy *d = calloc(1, sizeof *d);
    if (!d) goto oom;
    d->n_pool = big + SLACK;
    d->n_vec = nv;
    d->pool = malloc((size_t)d->n_pool * 2);
    d->ones = malloc((size_t)nv * 2);
    d->zeros = calloc((size_t)nv, 2);
    w->layers = calloc((size_t)n_all, sizeof *w->layers);
    d->experts = calloc((size_t)(n_moe + n_mtp) * 3 * (size_t)NE + 1, sizeof *d->experts);
    w->mtp = d->mtp = calloc((size_t)c->n_mtp_layer + 1, sizeof *d->mtp);
    mtp = calloc((size_t)n_mtp + 1, sizeof *mtp);
    if (!mtp) goto oom;
    if (!d->pool || !d->ones || !d->zeros || !w->layers || !d->experts || !d->mtp) goto oom;
    struct model_tensor *ex = d->experts;
    if (qc) {
        /* codes (up to a byte a weight) and zero points in one pool of random
         * bytes; scales (at most a group of 8 columns each) in bf16 pools of
         * about 0.02 / 2^(bits-1), so that the weights span what the bf16
         * dummies do */
        int nmax = 16 * ((int)n_all + n_mtp) + 1 + (n_moe + n_mtp) * (3 + 3 * (int)NE); /* a KDA layer has 9
                                                                                            projections */
        d->quants = calloc((size_t)nmax, sizeof *d->quants);
        d->gidx = calloc((size_t)nmax, sizeof *d->gidx);
        d->n_bytes = big + 2 * SLACK;
        d->n_scales = big / 8 + nv + 2 * SLACK;
        d->bytes = malloc((size_t)d->n_bytes);
        d->scales[0] = malloc((size_t)d->n_scales * 2);
        d->scales[1] = malloc((size_t)d->n_scales * 2);
        if (!d->quants || !d->gidx || !d->bytes || !d->scales[0] || !d->scales[1]) goto oom;
#pragma omp parallel for schedule(static)
        for (int64_t i = 0; i < d->n_bytes; i++)
            d->bytes[i] = (uint8_t)(mix((uint64_t)i * 0x9e3779b97f4a7c15ULL + 777) >> 56);
        for (int b = 0; b < 2; b++) {
            float base = 0.02f / (b ? 128.0f : 8.0f);
#pragma omp parallel for schedule(static)
            for (int64_t i = 0; i < d->n_scales; i++) {
                float f = base * (0.5f + 0.5f * (float)((mix((uint64_t)i + 99) >> 11) * 0x1.0p-53));
                uint32_t u;
                memcpy(&u, &f, 4);
                d->scales[b][i] = (uint16_t)((u + 0x7fffu + ((u >> 16) & 1u)) >> 16);
            }
        }
    }
    /* uniform in +-0.02 as bf16: sign, then exponent/mantissa of a float in [0, 0.02) */
#pragma omp parallel for schedule(static)
    for (int64_t i = 0; i < d->n_pool; i++) {
        uint64_t r = mix((uint64_t)i * 0x9e3779b97f4a7c15ULL + 12345);
        float f = (float)((r >> 11) * 0x1.0p-53) * 0.04f - 0.02f;
        uint32_t u;
        memcpy(&u, &f, 4);
        d->pool[i] = (uint16_t)((u + 0x7fffu + ((u >> 16) & 1u)) >> 16);
    }
    for (int64_t i = 0; i < nv; i++) d->ones[i] = 0x3f80;
    mat(d, &w->tok_embd, "token_embd (dummy)", V, E);
    vec(d, &w->out_norm, "output_norm (dummy)", E, true);
    if (c->tie_embeddings)
        w->lm_head = w->tok_embd;
    else if ((rc = proj(d, qc, &w->lm_head, "output (dummy)", "lm_head", V, E, err, errlen)))
        goto fail;
    for (int i = 0; i < c->n_mtp_layer; i++) {
        struct model_mtp_weights *t = &w->mtp[i];
        char mod[80];
        snprintf(mod, sizeof mod, "model.layers.%d.eh_proj", c->n_layer + i);
        vec(d, &t->enorm, "enorm (dummy)", E, true);
        vec(d, &t->hnorm, "hnorm (dummy)", E, true);
        vec(d, &t->head_norm, "shared_head.norm (dummy)", E, true);
        if ((rc = proj(d, qc, &t->eh_proj, "eh_proj (dummy)", mod, E, 2 * E, err, errlen))) goto fail;
    }
    for (int l = 0; l < n_all + n_mtp; l++) {
        struct model_layer_weights *L = l < n_all ? &w->layers[l] : &mtp[l - n_all];
        struct model_layer_kind kind = l < n_all ? model_layer_kind_of(c, l)
                                                 : (struct model_layer_kind){MODEL_MIXER_MLA, MODEL_FFN_MOE,
                                                                             MODEL_RESID_PLAIN};
        char mod[7][80];
        static const char *const pn[7] = {"self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj",
                                          "self_attn.o_proj", "mlp.gate_proj", "mlp.up_proj", "mlp.down_proj"};
        for (int i = 0; i < 7; i++) snprintf(mod[i], sizeof mod[i], "model.layers.%d.%s", l, pn[i]);
        vec(d, &L->attn_norm, "attn_norm (dummy)", E, true);
        if (kind.resid == MODEL_RESID_HC) {
            struct model_hc_weights *hs[2] = {&L->hc_attn, &L->hc_ffn};
            for (int k = 0; k < 2; k++) {
                mat(d, &hs[k]->fn, "hc_fn (dummy)", (2 + HC) * HC, HC * E);
                vec(d, &hs[k]->base, "hc_base (dummy)", (2 + HC) * HC, false);
                vec(d, &hs[k]->scale, "hc_scale (dummy)", 3, true);
            }
        }
        if (kind.mixer == MODEL_MIXER_MLA) {
            struct model_mla_weights *A = &L->mla;
            char mm[6][96];
            static const char *const mn[6] = {"q_a_proj", "q_b_proj", "q_proj", "kv_a_proj_with_mqa", "kv_b_proj",
                                              "o_proj"};
            for (int i = 0; i < 6; i++) snprintf(mm[i], sizeof mm[i], "model.layers.%d.self_attn.%s", l, mn[i]);
            if (QL > 0) {
                if ((rc = proj(d, qc, &A->q_a, "q_a_proj (dummy)", mm[0], QL, E, err, errlen)) ||
                    (rc = proj(d, qc, &A->q_b, "q_b_proj (dummy)", mm[1], H * Dq, QL, err, errlen)))
                    goto fail;
                vec(d, &A->q_a_norm, "q_a_layernorm (dummy)", QL, true);
            } else if ((rc = proj(d, qc, &A->q, "q_proj (dummy)", mm[2], H * Dq, E, err, errlen))) {
                goto fail;
            }
            if ((rc = proj(d, qc, &A->kv_a, "kv_a_proj_with_mqa (dummy)", mm[3], C + R, E, err, errlen)) ||
                (rc = proj(d, qc, &A->kv_b, "kv_b_proj (dummy)", mm[4], KB, C, err, errlen)) ||
                (rc = proj(d, qc, &A->o, "o_proj (dummy)", mm[5], E, H * a->v_head_dim, err, errlen)))
                goto fail;
            vec(d, &A->kv_a_norm, "kv_a_layernorm (dummy)", C, true);
            if (l < c->n_layer && a->index_topk > 0 && a->index_full && a->index_full[l]) {
                mat(d, &A->ix_wq_b, "indexer.wq_b (dummy)", IX * ID, QL);
                mat(d, &A->ix_wk, "indexer.wk (dummy)", ID, E);
                vec(d, &A->ix_k_norm, "indexer.k_norm (dummy)", ID, true);
                vec(d, &A->ix_k_norm_b, "indexer.k_norm.bias (dummy)", ID, false);
                mat(d, &A->ix_weights, "indexer.weights_proj (dummy)", IX, E);
                if (a->index_kpool > 0) {
                    mat(d, &A->ix_kpool_ape, "indexer.index_kpool_compress_ape (dummy)", a->index_kpool, ID);
                    mat(d, &A->ix_kpool_gate, "indexer.index_kpool_compress_gate (dummy)", ID, E);
                }
            }
            goto ffn;
        }
        if (kind.mixer == MODEL_MIXER_KDA) {
            /* KDA: every projection as the config quantizes its module, the small tensors bf16 (A_log and
               dt_bias 0, o_norm 1) */
            struct model_kda_weights *K = &L->kda;
            /* the in-memory module names a quantization_config's targets and ignore use (forget_gate.*) */
            static const char *const kn[9] = {"q_proj", "k_proj", "v_proj", "forget_gate.f_a_proj",
                                              "forget_gate.f_b_proj", "b_proj", "g_a_proj", "g_b_proj", "o_proj"};
            struct model_tensor *kt[9] = {&K->q, &K->k, &K->v, &K->f_a, &K->f_b, &K->b, &K->g_a, &K->g_b, &K->o};
            const int64_t kr[9] = {KC, KC, KC, KD, KC, KH, KD, KC, E}, kcol[9] = {E, E, E, E, KD, E, E, KD, KC};
            for (int i = 0; i < 9; i++) {
                char km[96];
                snprintf(km, sizeof km, "model.layers.%d.self_attn.%s", l, kn[i]);
                static const char *const dn[9] = {"kda q_proj (dummy)", "kda k_proj (dummy)", "kda v_proj (dummy)",
                                                  "kda f_a_proj (dummy)", "kda f_b_proj (dummy)", "kda b_proj (dummy)",
                                                  "kda g_a_proj (dummy)", "kda g_b_proj (dummy)", "kda o_proj (dummy)"};
                if ((rc = proj(d, qc, kt[i], dn[i], km, kr[i], kcol[i], err, errlen))) goto fail;
            }
            for (int i = 0; i < 3; i++) mat(d, &K->conv[i], "kda conv1d (dummy)", KC, c->kda.conv_kernel);
            vec(d, &K->dt_bias, "kda dt_bias (dummy)", KC, false);
            vec(d, &K->A_log, "kda A_log (dummy)", KH, false);
            vec(d, &K->o_norm, "kda o_norm (dummy)", KD, true);
            goto ffn;
        }
        if ((rc = proj(d, qc, &L->wq, "attn_q (dummy)", mod[0], Q, E, err, errlen)) ||
            (rc = proj(d, qc, &L->wk, "attn_k (dummy)", mod[1], KV, E, err, errlen)) ||
            (rc = proj(d, qc, &L->wv, "attn_v (dummy)", mod[2], KV, E, err, errlen)) ||
            (rc = proj(d, qc, &L->wo, "attn_output (dummy)", mod[3], E, Q, err, errlen)))
            goto fail;
        if (c->qkv_bias) {
            vec(d, &L->bq, "attn_q.bias (dummy)", Q, false);
            vec(d, &L->bk, "attn_k.bias (dummy)", KV, false);
            vec(d, &L->bv, "attn_v.bias (dummy)", KV, false);
        }
        if (c->qk_norm) {
            vec(d, &L->q_norm, "attn_q_norm (dummy)", D, true);
            vec(d, &L->k_norm, "attn_k_norm (dummy)", D, true);
        }
    ffn:
        vec(d, &L->ffn_norm, "ffn_norm (dummy)", E, true);
        if (kind.ffn == MODEL_FFN_MOE) {
            struct model_moe_weights *mw = &L->moe;
            char mn[3][160];
            mat(d, &mw->router, "ffn_gate_inp (dummy)", NE, E);
            vec(d, &mw->router_bias, "exp_probs_b (dummy)", NE, false);
            mw->gate = ex, mw->up = ex + NE, mw->down = ex + 2 * NE;
            ex += 3 * NE;
            for (int e = 0; e < NE; e++) {
                static const char *const en[3] = {"gate_proj", "up_proj", "down_proj"};
                for (int i = 0; i < 3; i++) snprintf(mn[i], sizeof mn[i], "model.layers.%d.mlp.experts.%d.%s", l, e, en[i]);
                if ((rc = proj(d, qc, &mw->gate[e], "ffn_gate_exps (dummy)", mn[0], FE, E, err, errlen)) ||
                    (rc = proj(d, qc, &mw->up[e], "ffn_up_exps (dummy)", mn[1], FE, E, err, errlen)) ||
                    (rc = proj(d, qc, &mw->down[e], "ffn_down_exps (dummy)", mn[2], E, FE, err, errlen)))
                    goto fail;
            }
            if (FS > 0) {
                const char *sh = mc->shared_gated ? "shared_expert" : "shared_experts";
                static const char *const en[3] = {"gate_proj", "up_proj", "down_proj"};
                for (int i = 0; i < 3; i++) snprintf(mn[i], sizeof mn[i], "model.layers.%d.mlp.%s.%s", l, sh, en[i]);
                if ((rc = proj(d, qc, &mw->sh_gate, "ffn_gate_shexp (dummy)", mn[0], FS, E, err, errlen)) ||
                    (rc = proj(d, qc, &mw->sh_up, "ffn_up_shexp (dummy)", mn[1], FS, E, err, errlen)) ||
                    (rc = proj(d, qc, &mw->sh_down, "ffn_down_shexp (dummy)", mn[2], E, FS, err, errlen)))
                    goto fail;
                if (mc->shared_gated) mat(d, &mw->sh_weigh, "ffn_gate_inp_shexp (dummy)", 1, E);
            }
            continue;
        }
        if ((rc = proj(d, qc, &L->w_gate, "ffn_gate (dummy)", mod[4], F, E, err, errlen)) ||
            (rc = proj(d, qc, &L->w_up, "ffn_up (dummy)", mod[5], F, E, err, errlen)) ||
            (rc = proj(d, qc, &L->w_down, "ffn_down (dummy)", mod[6], E, F, err, errlen)))
            goto fail;
    }
    for (int i = 0; i < n_mtp; i++) {
        /* the module's decoder layer, then enorm, hnorm, eh_proj [E][2E] and shared_head (norm, head [V][E]) */
        const struct model_layer_weights *L = &mtp[i];
        const struct model_mla_weights *A = &L->mla;
        const struct model_tensor *t[] = {&L->attn_norm, &L->ffn_norm, &A->q_a, &A->q_a_norm, &A->q_b, &A->q,
                                          &A->kv_a, &A->kv_a_norm, &A->kv_b, &A->o, &L->moe.router,
                                          &L->moe.router_bias, &L->moe.sh_gate, &L->moe.sh_up, &L->moe.sh_down};
        for (size_t k = 0; k < sizeof t / sizeof *t; k++)
            if (t[k]->data) w->mtp_bytes += held_bytes(t[k]), w->mtp_tensors++;
        for (int e = 0; e < NE; e++) {
            w->mtp_bytes += held_bytes(&L->moe.gate[e]) + held_bytes(&L->moe.up[e]) + held_bytes(&L->moe.down[e]);
            w->mtp_tensors += 3;
        }
        char mod[96];
        struct model_tensor eh;
        snprintf(mod, sizeof mod, "model.layers.%d.eh_proj", (int)n_all + i);
        if ((rc = proj(d, qc, &eh, "eh_proj (dummy)", mod, E, 2 * E, err, errlen))) goto fail;
        w->mtp_bytes += held_bytes(&eh) + (size_t)(3 * E) * 2 + (size_t)(V * E) * 2;
        w->mtp_tensors += 5;
    }
    free(mtp);
    *owner = d;
    return 0;
oom:
    snprintf(err, errlen, "out of memory for dummy weights");
fail:
    free(mtp);
    model_dummy_free(d);
    return rc;
}

void model_dummy_free(void *owner)
{
    struct dummy *d = owner;
    if (!d) return;
    free(d->pool);
    free(d->ones);
    free(d->zeros);
    for (int i = 0; i < d->n_gidx; i++) free(d->gidx[i]);
    free(d->gidx);
    free(d->quants);
    free(d->bytes);
    free(d->scales[0]);
    free(d->scales[1]);
    free(d->experts);
    free(d->mtp);
    free(d);
}

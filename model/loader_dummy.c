/* loader_dummy.c - random weights from a configuration alone (loader_dummy.h),
 * as vLLM's --load-format dummy: large shapes can be served and measured
 * without downloading them. The numbers are deterministic (a fixed seed). */
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "loader_dummy.h"

#define SLACK ((int64_t)1 << 20) /* elements of offset room between windows */

struct dummy {
    uint16_t *pool;  /* [n_pool] bf16 uniform in +-0.02 */
    uint16_t *ones;  /* [n_vec] bf16 1.0 */
    uint16_t *zeros; /* [n_vec] bf16 0.0 */
    int64_t n_pool, n_vec;
    int next;        /* windows handed out, for offsets */
    struct model_tensor *experts; /* [MoE layers][3][n_expert] expert views */
    const struct quant_cfg *qc;   /* borrowed: which matrices are packed, or NULL */
    struct model_quant *quants;   /* [cap_quants] descriptors of the packed ones */
    int n_quants, cap_quants;
    uint16_t *scales;             /* [n_scales] bf16 scales of every packed matrix */
    int64_t n_scales;
    char err[160];                /* why a packed matrix could not be made */
};

static uint64_t mix(uint64_t z)
{
    z = (z ^ (z >> 30)) * 0xbf58476d1ce4e5b9ULL;
    z = (z ^ (z >> 27)) * 0x94d049bb133111ebULL;
    return z ^ (z >> 31);
}

/* Matrix `name` [rows][cols]; module: its HF module name (for the
 * quantization config; NULL: never packed), linear: an nn.Linear there. */
static void mat(struct dummy *d, struct model_tensor *t, const char *name, const char *module, bool linear,
                int64_t rows, int64_t cols)
{
    int64_t off = ((int64_t)d->next++ * 7919 * 64) % SLACK;
    *t = (struct model_tensor){.name = name, .dtype = MODEL_DT_BF16, .ndim = 2, .ne = {cols, rows, 1, 1},
                               .data = d->pool + off, .nbytes = (size_t)(rows * cols) * 2};
    int bits, group;
    if (!d->qc || !module || !quant_cfg_claims(d->qc, module, linear, &bits, &group)) return;
    if (group == 0) group = (int)cols;
    int64_t ng = cols / group;
    if (cols % group || (cols * bits) % 32 || rows * ng > d->n_scales || d->n_quants == d->cap_quants) {
        if (!d->err[0])
            snprintf(d->err, sizeof d->err, "dummy weights: %s [%lld][%lld] cannot be packed int%d group %d", module,
                     (long long)rows, (long long)cols, bits, group);
        return;
    }
    struct model_quant *q = &d->quants[d->n_quants++];
    *q = (struct model_quant){.layout = MODEL_QL_CT, .rows = rows, .cols = cols, .bits = bits, .group = group,
                              .n_groups = ng, .sym = true, .scale_dt = MODEL_DT_BF16,
                              .qweight = d->pool + off, .scales = d->scales};
    t->dtype = MODEL_DT_QPACK;
    t->nbytes = (size_t)(rows * cols * bits / 8);
    t->quant = q;
}

static void vec(struct dummy *d, struct model_tensor *t, const char *name, int64_t n, bool one)
{
    *t = (struct model_tensor){.name = name, .dtype = MODEL_DT_BF16, .ndim = 1, .ne = {n, 1, 1, 1},
                               .data = one ? d->ones : d->zeros, .nbytes = (size_t)n * 2};
}

int model_dummy_weights(const struct model_config *c, const struct quant_cfg *qc, struct model_weights *w,
                        void **owner, char *err, size_t errlen)
{
    int64_t E = c->n_embd, F = c->n_ff, D = c->head_dim, Q = (int64_t)c->n_head * D,
            KV = (int64_t)c->n_head_kv * D, V = c->n_vocab;
    int64_t big = V * E;
    if (F * E > big) big = F * E;
    if (Q * E > big) big = Q * E;
    const struct model_moe_config *mc = &c->moe;
    int64_t FE = mc->n_ff_expert, FS = mc->n_ff_shared, NE = mc->n_expert;
    if (FE * E > big) big = FE * E;
    if (FS * E > big) big = FS * E;
    if (NE * E > big) big = NE * E;
    int64_t nv = E > F ? E : F;
    if (Q > nv) nv = Q;
    if (NE > nv) nv = NE;
    int n_moe = 0;
    for (int l = 0; l < c->n_layer; l++) n_moe += model_layer_kind_of(c, l).ffn == MODEL_FFN_MOE;
    struct dummy *d = calloc(1, sizeof *d);
    if (!d) goto oom;
    d->n_pool = big + SLACK;
    d->n_vec = nv;
    d->pool = malloc((size_t)d->n_pool * 2);
    d->ones = malloc((size_t)nv * 2);
    d->zeros = calloc((size_t)nv, 2);
    w->layers = calloc((size_t)c->n_layer, sizeof *w->layers);
    d->experts = calloc((size_t)n_moe * 3 * (size_t)NE + 1, sizeof *d->experts);
    if (!d->pool || !d->ones || !d->zeros || !w->layers || !d->experts) goto oom;
    if (qc) {
        /* groups of 8 columns or more: every packed matrix fits big / 8 scales */
        d->qc = qc;
        d->cap_quants = 2 + 7 * c->n_layer + n_moe * (5 + 3 * (int)NE);
        d->n_scales = big / 8 + nv;
        d->quants = calloc((size_t)d->cap_quants, sizeof *d->quants);
        d->scales = malloc((size_t)d->n_scales * 2);
        if (!d->quants || !d->scales) goto oom;
    }
    struct model_tensor *ex = d->experts;
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
    for (int64_t i = 0; i < d->n_scales; i++) d->scales[i] = 0x3ba4; /* bf16 0.005: codes -8..7 span +-0.04 */
    mat(d, &w->tok_embd, "token_embd (dummy)", NULL, false, V, E);
    vec(d, &w->out_norm, "output_norm (dummy)", E, true);
    if (c->tie_embeddings)
        w->lm_head = w->tok_embd;
    else
        mat(d, &w->lm_head, "output (dummy)", "lm_head", true, V, E);
    char mod[160];
#define M(fmt, ...) (snprintf(mod, sizeof mod, "model.layers.%d." fmt, l, ##__VA_ARGS__), mod)
    for (int l = 0; l < c->n_layer; l++) {
        struct model_layer_weights *L = &w->layers[l];
        vec(d, &L->attn_norm, "attn_norm (dummy)", E, true);
        mat(d, &L->wq, "attn_q (dummy)", M("self_attn.q_proj"), true, Q, E);
        mat(d, &L->wk, "attn_k (dummy)", M("self_attn.k_proj"), true, KV, E);
        mat(d, &L->wv, "attn_v (dummy)", M("self_attn.v_proj"), true, KV, E);
        mat(d, &L->wo, "attn_output (dummy)", M("self_attn.o_proj"), true, E, Q);
        if (c->qkv_bias) {
            vec(d, &L->bq, "attn_q.bias (dummy)", Q, false);
            vec(d, &L->bk, "attn_k.bias (dummy)", KV, false);
            vec(d, &L->bv, "attn_v.bias (dummy)", KV, false);
        }
        if (c->qk_norm) {
            vec(d, &L->q_norm, "attn_q_norm (dummy)", D, true);
            vec(d, &L->k_norm, "attn_k_norm (dummy)", D, true);
        }
        vec(d, &L->ffn_norm, "ffn_norm (dummy)", E, true);
        if (model_layer_kind_of(c, l).ffn == MODEL_FFN_MOE) {
            struct model_moe_weights *mw = &L->moe;
            mat(d, &mw->router, "ffn_gate_inp (dummy)", M("mlp.gate"), false, NE, E);
            vec(d, &mw->router_bias, "exp_probs_b (dummy)", NE, false);
            mw->gate = ex, mw->up = ex + NE, mw->down = ex + 2 * NE;
            ex += 3 * NE;
            for (int e = 0; e < NE; e++) {
                mat(d, &mw->gate[e], "ffn_gate_exps (dummy)", M("mlp.experts.%d.gate_proj", e), true, FE, E);
                mat(d, &mw->up[e], "ffn_up_exps (dummy)", M("mlp.experts.%d.up_proj", e), true, FE, E);
                mat(d, &mw->down[e], "ffn_down_exps (dummy)", M("mlp.experts.%d.down_proj", e), true, E, FE);
            }
            if (FS > 0) {
                const char *sh = mc->shared_gated ? "shared_expert" : "shared_experts";
                mat(d, &mw->sh_gate, "ffn_gate_shexp (dummy)", M("mlp.%s.gate_proj", sh), true, FS, E);
                mat(d, &mw->sh_up, "ffn_up_shexp (dummy)", M("mlp.%s.up_proj", sh), true, FS, E);
                mat(d, &mw->sh_down, "ffn_down_shexp (dummy)", M("mlp.%s.down_proj", sh), true, E, FS);
                if (mc->shared_gated) mat(d, &mw->sh_weigh, "ffn_gate_inp_shexp (dummy)", NULL, false, 1, E);
            }
            continue;
        }
        mat(d, &L->w_gate, "ffn_gate (dummy)", M("mlp.gate_proj"), true, F, E);
        mat(d, &L->w_up, "ffn_up (dummy)", M("mlp.up_proj"), true, F, E);
        mat(d, &L->w_down, "ffn_down (dummy)", M("mlp.down_proj"), true, E, F);
    }
#undef M
    if (d->err[0]) {
        snprintf(err, errlen, "%s", d->err);
        model_dummy_free(d);
        return SL_EUNSUP;
    }
    *owner = d;
    return 0;
oom:
    model_dummy_free(d);
    snprintf(err, errlen, "out of memory for dummy weights");
    return SL_ENOMEM;
}

void model_dummy_free(void *owner)
{
    struct dummy *d = owner;
    if (!d) return;
    free(d->pool);
    free(d->ones);
    free(d->zeros);
    free(d->experts);
    free(d->quants);
    free(d->scales);
    free(d);
}

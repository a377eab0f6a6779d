/* moe.c - mixture-of-experts FFN layers (moe.h): the config keys, the
 * weights, the router, and the CPU backend's MoE block.
 *
 * The reference is transformers 5.25: Qwen3MoeSparseMoeBlock (softmax top-k,
 * optional renormalisation, no shared expert) and Glm4MoeMoE /
 * DeepseekV3MoE (sigmoid scores, correction bias used only to choose,
 * group-limited choice, renormalisation + 1e-20, routed_scaling_factor, shared
 * experts added after the routed sum), and Glm5NextTextExperts' clamped SwiGLU.
 *
 * CPU compute: the tokens of a step are grouped by expert so an expert's rows
 * are dequantized once per step (and only the chosen experts' rows are read),
 * but every (row, token) dot product is the same sequence of operations
 * whatever the grouping, and each token sums its experts in ascending expert
 * order: a token's result depends on its own input only (batch invariance).
 */
#include "moe.h"

#include <math.h>
#include <omp.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#if defined(__AVX2__) && defined(__FMA__)
#include <immintrin.h>
#endif

/* ---- configuration ---------------------------------------------------------------- */

/* Per model_type: which router, and transformers' defaults for the keys a
 * config may leave out. */
struct moe_family {
    const char *model_type;
    enum model_router router;
    int n_expert, n_used, n_ff, n_shared, n_group, topk_group, first_dense;
    float scale;
    bool norm_topk;
};
static const struct moe_family families[] = {
    {"qwen3_moe", MODEL_ROUTER_SOFTMAX, 128, 8, 768, 0, 1, 1, 0, 1.0f, false},
    {"glm4_moe", MODEL_ROUTER_SIGMOID, 128, 8, 1408, 1, 1, 1, 1, 1.0f, true},
    {"deepseek_v3", MODEL_ROUTER_SIGMOID, 256, 8, 2048, 1, 8, 4, 3, 2.5f, true},
    {"qwen2_moe", MODEL_ROUTER_SOFTMAX, 60, 4, 1408, 0, 1, 1, 0, 1.0f, false},
    /* Glm5NextTextConfig (its text_config, or a flat config); mlp_layer_types decides per layer */
    {"glm5_next_text", MODEL_ROUTER_SIGMOID, 288, 8, 2048, 1, 1, 1, 3, 2.5f, true},
    {"glm5_next", MODEL_ROUTER_SIGMOID, 288, 8, 2048, 1, 1, 1, 3, 2.5f, true},
};

static int get_int(const json_doc *d, int obj, const char *key, int def, int lo, int hi, int *out, char *err,
                   size_t errlen)
{
    int i = json_get(d, obj, key);
    int64_t v = def;
    if (i >= 0 && !json_is_null(d, i) && (!json_is_num(d, i) || json_i64(d, i, &v) != 0)) {
        sl_seterr(err, errlen, "config.json: %s must be an integer", key);
        return SL_EFORMAT;
    }
    if (v < lo || v > hi) {
        sl_seterr(err, errlen, "config.json: %s is %lld, expected %d to %d", key, (long long)v, lo, hi);
        return SL_EFORMAT;
    }
    *out = (int)v;
    return 0;
}

static int get_float(const json_doc *d, int obj, const char *key, float def, float *out, char *err, size_t errlen)
{
    int i = json_get(d, obj, key);
    double v = def;
    if (i >= 0 && !json_is_null(d, i) && (!json_is_num(d, i) || json_f64(d, i, &v) != 0 || !isfinite(v) || v < 0)) {
        sl_seterr(err, errlen, "config.json: %s must be a non-negative number", key);
        return SL_EFORMAT;
    }
    *out = (float)v;
    return 0;
}

static int get_bool(const json_doc *d, int obj, const char *key, bool def, bool *out, char *err, size_t errlen)
{
    int i = json_get(d, obj, key);
    *out = def;
    if (i >= 0 && !json_is_null(d, i) && (!json_is_bool(d, i) || json_bool(d, i, out) != 0)) {
        sl_seterr(err, errlen, "config.json: %s must be true or false", key);
        return SL_EFORMAT;
    }
    return 0;
}

int moe_hf_config(const json_doc *d, int obj, struct model_config *c, bool **sparse, char *err, size_t errlen)
{
    *sparse = NULL;
    memset(&c->moe, 0, sizeof c->moe);
    int mt = json_get(d, obj, "model_type");
    const struct moe_family *f = NULL;
    for (size_t i = 0; mt >= 0 && i < sizeof families / sizeof *families; i++)
        if (json_str_eq(d, mt, families[i].model_type)) f = &families[i];
    int rc, L = c->n_layer;
    float limit = 0;
    /* GLM-5.3's clamp applies to every SwiGLU, dense layers included (Glm5NextTextConfig's default 10) */
    bool g5 = f && strncmp(f->model_type, "glm5_next", 9) == 0;
    if ((rc = get_float(d, obj, "swiglu_limit", g5 ? 10.0f : 0.0f, &limit, err, errlen))) return rc;
    c->moe.swiglu_limit = limit;
    if (!f) return 0;
    struct model_moe_config *m = &c->moe;
    m->router = f->router;
    /* qwen3_moe's checkpoints say num_experts; transformers 5 saves its
     * attribute's other name num_local_experts; glm4_moe/deepseek_v3 say
     * n_routed_experts */
    const char *ne_key = json_get(d, obj, "n_routed_experts") >= 0    ? "n_routed_experts"
                         : json_get(d, obj, "num_experts") >= 0        ? "num_experts"
                                                                       : "num_local_experts";
    int n_shared = 0, first_dense = 0, step = 1;
    if ((rc = get_int(d, obj, ne_key, f->n_expert, 0, 1 << 16, &m->n_expert, err, errlen)) ||
        (rc = get_int(d, obj, "num_experts_per_tok", f->n_used, 1, 1 << 16, &m->n_expert_used, err, errlen)) ||
        (rc = get_int(d, obj, "moe_intermediate_size", f->n_ff, 1, 1 << 22, &m->n_ff_expert, err, errlen)) ||
        (rc = get_bool(d, obj, "norm_topk_prob", f->norm_topk, &m->norm_topk, err, errlen)))
        return rc;
    m->scale = 1.0f;
    m->n_group = m->topk_group = 1;
    if (f->router == MODEL_ROUTER_SIGMOID) {
        if ((rc = get_int(d, obj, "n_shared_experts", f->n_shared, 0, 1024, &n_shared, err, errlen)) ||
            (rc = get_float(d, obj, "routed_scaling_factor", f->scale, &m->scale, err, errlen)) ||
            (rc = get_int(d, obj, "n_group", f->n_group, 1, 1 << 16, &m->n_group, err, errlen)) ||
            (rc = get_int(d, obj, "topk_group", f->topk_group, 1, 1 << 16, &m->topk_group, err, errlen)) ||
            (rc = get_int(d, obj, "first_k_dense_replace", f->first_dense, 0, 1 << 20, &first_dense, err, errlen)))
            return rc;
        m->n_ff_shared = n_shared * m->n_ff_expert;
    } else {
        if ((rc = get_int(d, obj, "decoder_sparse_step", 1, 1, 1 << 20, &step, err, errlen))) return rc;
        if (strcmp(f->model_type, "qwen2_moe") == 0) {
            /* one shared expert of its own width, weighed by a sigmoid gate */
            if ((rc = get_int(d, obj, "shared_expert_intermediate_size", 5632, 0, 1 << 22, &m->n_ff_shared, err,
                              errlen)))
                return rc;
            m->shared_gated = m->n_ff_shared > 0;
        }
    }
    if (m->n_expert == 0) { /* transformers: num_experts 0 makes every layer dense */
        memset(m, 0, sizeof *m);
        c->moe.swiglu_limit = limit;
        return 0;
    }
    if (m->n_expert_used > m->n_expert) {
        sl_seterr(err, errlen, "config.json: num_experts_per_tok (%d) exceeds the %d experts", m->n_expert_used,
                  m->n_expert);
        return SL_EFORMAT;
    }
    if (m->n_expert % m->n_group || m->topk_group > m->n_group ||
        (m->n_group > 1 && m->n_expert / m->n_group < 2) ||
        m->topk_group * (m->n_expert / m->n_group) < m->n_expert_used) {
        sl_seterr(err, errlen,
                  "config.json: n_group %d / topk_group %d do not fit %d experts with %d per token (groups must "
                  "divide the experts, hold 2 or more each, and the chosen groups hold at least top-k)",
                  m->n_group, m->topk_group, m->n_expert, m->n_expert_used);
        return SL_EFORMAT;
    }
    bool *sp = calloc((size_t)L, sizeof *sp);
    if (!sp) {
        sl_seterr(err, errlen, "out of memory");
        return SL_ENOMEM;
    }
    if (f->router == MODEL_ROUTER_SIGMOID) {
        for (int l = 0; l < L; l++) sp[l] = l >= first_dense;
    } else {
        for (int l = 0; l < L; l++) sp[l] = (l + 1) % step == 0;
        int ol = json_get(d, obj, "mlp_only_layers");
        if (ol >= 0 && !json_is_null(d, ol)) {
            if (!json_is_arr(d, ol)) goto bad_list;
            for (int k = 0; k < json_size(d, ol); k++) {
                int64_t v;
                if (json_i64(d, json_at(d, ol, k), &v) != 0) goto bad_list;
                if (v >= 0 && v < L) sp[v] = false;
            }
        }
    }
    int mlt = json_get(d, obj, "mlp_layer_types");
    if (mlt >= 0 && !json_is_null(d, mlt)) {
        if (!json_is_arr(d, mlt) || json_size(d, mlt) < L) {
            sl_seterr(err, errlen, "config.json: mlp_layer_types must list all %d layers", L);
            free(sp);
            return SL_EFORMAT;
        }
        for (int l = 0; l < L; l++) {
            int e = json_at(d, mlt, l);
            if (json_str_eq(d, e, "sparse")) {
                sp[l] = true;
            } else if (json_str_eq(d, e, "dense")) {
                sp[l] = false;
            } else {
                sl_seterr(err, errlen, "config.json: mlp_layer_types[%d] must be \"dense\" or \"sparse\"", l);
                free(sp);
                return SL_EFORMAT;
            }
        }
    }
    *sparse = sp;
    return 0;
bad_list:
    sl_seterr(err, errlen, "config.json: mlp_only_layers must be a list of layer numbers");
    free(sp);
    return SL_EFORMAT;
}

/* ---- weights ---------------------------------------------------------------------- */

/* Expert e's [rows][cols] slice of a fused 3-D tensor [E][k * rows][cols] at
 * row block `part`. Only plain dtypes slice by bytes. */
static int slice(const struct model_tensor *t, int e, int part, int64_t rows, int64_t cols, struct model_tensor *out,
                 char *err, size_t errlen)
{
    size_t es = t->dtype == MODEL_DT_F32 ? 4 : t->dtype == MODEL_DT_BF16 || t->dtype == MODEL_DT_F16 ? 2 : 0;
    if (!es) {
        sl_seterr(err, errlen, "tensor %s: fused experts in %s are not supported (only f32/f16/bf16)", t->name,
                  model_dtype_name(t->dtype));
        return SL_EUNSUP;
    }
    int64_t per = t->ne[1] * t->ne[0]; /* elements per expert */
    *out = (struct model_tensor){.name = t->name, .dtype = t->dtype, .ndim = 2, .ne = {cols, rows, 1, 1}};
    out->data = (const char *)t->data + ((size_t)e * per + (size_t)part * rows * cols) * es;
    out->nbytes = (size_t)(rows * cols) * es;
    return 0;
}

static int fused_shape(const struct model_tensor *t, int64_t e, int64_t rows, int64_t cols, char *err,
                       size_t errlen)
{
    if (t->ndim == 3 && t->ne[2] == e && t->ne[1] == rows && t->ne[0] == cols) return 0;
    sl_seterr(err, errlen, "tensor %s has shape [%lld, %lld, %lld] (ne order), expected [%lld, %lld, %lld]",
              t->name, (long long)t->ne[0], (long long)t->ne[1], (long long)t->ne[2], (long long)cols,
              (long long)rows, (long long)e);
    return SL_EFORMAT;
}

int moe_bind_layer(model *m, const struct model_config *c, const char *prefix, struct model_moe_weights *w,
                   struct model_tensor *experts, char *err, size_t errlen)
{
    const struct model_moe_config *mc = &c->moe;
    int64_t E = c->n_embd, NE = mc->n_expert, F = mc->n_ff_expert, S = mc->n_ff_shared;
    char name[512];
    int rc;
    snprintf(name, sizeof name, "%s.gate.weight", prefix);
    if ((rc = model_loader_weight(m, name, NE, E, false, &w->router, err, errlen))) return rc;
    snprintf(name, sizeof name, "%s.gate.e_score_correction_bias", prefix);
    if ((rc = model_loader_weight(m, name, 0, NE, true, &w->router_bias, err, errlen))) return rc;
    w->gate = experts;
    w->up = experts + NE;
    w->down = experts + 2 * NE;
    /* transformers 5's in-memory layout, which some exports save as is:
     * gate_up_proj [E][2F][H] (gate rows first), down_proj [E][H][F] */
    struct model_tensor gu, dn;
    snprintf(name, sizeof name, "%s.experts.gate_up_proj", prefix);
    rc = model_loader_tensor(m, name, &gu);
    if (rc == 1) {
        snprintf(name, sizeof name, "%s.experts.gate_up_proj.weight", prefix);
        rc = model_loader_tensor(m, name, &gu);
    }
    if (rc < 0) {
        sl_seterr(err, errlen, "tensor %s: unsupported dtype or rank", name);
        return rc;
    }
    if (rc == 0) {
        snprintf(name, sizeof name, "%s.experts.down_proj", prefix);
        rc = model_loader_tensor(m, name, &dn);
        if (rc == 1) {
            snprintf(name, sizeof name, "%s.experts.down_proj.weight", prefix);
            rc = model_loader_tensor(m, name, &dn);
        }
        if (rc != 0) {
            sl_seterr(err, errlen, "%s: %s.experts.gate_up_proj without a usable down_proj", name, prefix);
            return rc < 0 ? rc : SL_EFORMAT;
        }
        if ((rc = fused_shape(&gu, NE, 2 * F, E, err, errlen)) || (rc = fused_shape(&dn, NE, E, F, err, errlen)))
            return rc;
        for (int e = 0; e < NE; e++)
            if ((rc = slice(&gu, e, 0, F, E, &w->gate[e], err, errlen)) ||
                (rc = slice(&gu, e, 1, F, E, &w->up[e], err, errlen)) ||
                (rc = slice(&dn, e, 0, E, F, &w->down[e], err, errlen)))
                return rc;
    } else {
        for (int e = 0; e < NE; e++) {
            snprintf(name, sizeof name, "%s.experts.%d.gate_proj.weight", prefix, e);
            if ((rc = model_loader_weight(m, name, F, E, false, &w->gate[e], err, errlen))) return rc;
            snprintf(name, sizeof name, "%s.experts.%d.up_proj.weight", prefix, e);
            if ((rc = model_loader_weight(m, name, F, E, false, &w->up[e], err, errlen))) return rc;
            snprintf(name, sizeof name, "%s.experts.%d.down_proj.weight", prefix, e);
            if ((rc = model_loader_weight(m, name, E, F, false, &w->down[e], err, errlen))) return rc;
        }
    }
    if (S > 0) {
        /* glm4_moe/deepseek_v3: shared_experts; qwen2_moe: shared_expert (+ its gate) */
        const char *sh = mc->shared_gated ? "shared_expert" : "shared_experts";
        snprintf(name, sizeof name, "%s.%s.gate_proj.weight", prefix, sh);
        if ((rc = model_loader_weight(m, name, S, E, false, &w->sh_gate, err, errlen))) return rc;
        snprintf(name, sizeof name, "%s.%s.up_proj.weight", prefix, sh);
        if ((rc = model_loader_weight(m, name, S, E, false, &w->sh_up, err, errlen))) return rc;
        snprintf(name, sizeof name, "%s.%s.down_proj.weight", prefix, sh);
        if ((rc = model_loader_weight(m, name, E, S, false, &w->sh_down, err, errlen))) return rc;
        if (mc->shared_gated) {
            snprintf(name, sizeof name, "%s.shared_expert_gate.weight", prefix);
            if ((rc = model_loader_weight(m, name, 1, E, false, &w->sh_weigh, err, errlen))) return rc;
        }
    }
    return 0;
}

/* ---- the router ------------------------------------------------------------------- */

/* The k largest of v[0..n) whose mask is set (mask NULL: all), ties to the
 * lower index, into idx[] (in order of choice). */
static void top_k(const float *v, const unsigned char *mask, int n, int k, int32_t *idx)
{
    for (int j = 0; j < k; j++) {
        int best = -1;
        for (int i = 0; i < n; i++) {
            if (mask && !mask[i]) continue;
            bool taken = false;
            for (int q = 0; q < j && !taken; q++) taken = idx[q] == i;
            if (taken) continue;
            if (best < 0 || v[i] > v[best]) best = i;
        }
        idx[j] = best;
    }
}

void model_moe_route(const struct model_moe_config *mc, const float *logits, const float *bias, int32_t *idx,
                     float *wt, float *scratch)
{
    int n = mc->n_expert, k = mc->n_expert_used;
    float *s = scratch, *choice = scratch + n;
    if (mc->router == MODEL_ROUTER_SOFTMAX) {
        float mx = logits[0];
        for (int i = 1; i < n; i++)
            if (logits[i] > mx) mx = logits[i];
        float sum = 0.0f;
        for (int i = 0; i < n; i++) {
            s[i] = expf(logits[i] - mx);
            sum += s[i];
        }
        for (int i = 0; i < n; i++) s[i] /= sum;
        top_k(s, NULL, n, k, idx);
    } else {
        for (int i = 0; i < n; i++) {
            s[i] = 1.0f / (1.0f + expf(-logits[i]));
            choice[i] = s[i] + (bias ? bias[i] : 0.0f);
        }
        unsigned char mask[n];
        memset(mask, 1, (size_t)n);
        if (mc->n_group > 1) {
            int G = mc->n_group, per = n / G;
            float gs[G];
            for (int g = 0; g < G; g++) {
                int32_t two[2];
                top_k(choice + g * per, NULL, per, 2, two);
                gs[g] = choice[g * per + two[0]] + choice[g * per + two[1]];
            }
            int32_t keep[G];
            top_k(gs, NULL, G, mc->topk_group, keep);
            memset(mask, 0, (size_t)n);
            for (int j = 0; j < mc->topk_group; j++) memset(mask + keep[j] * per, 1, (size_t)per);
        }
        top_k(choice, mask, n, k, idx);
    }
    /* ascending expert order: the order every backend sums them in */
    for (int i = 1; i < k; i++)
        for (int j = i; j > 0 && idx[j - 1] > idx[j]; j--) {
            int32_t t = idx[j];
            idx[j] = idx[j - 1];
            idx[j - 1] = t;
        }
    float sum = 0.0f;
    for (int j = 0; j < k; j++) {
        wt[j] = s[idx[j]];
        sum += wt[j];
    }
    if (mc->norm_topk) {
        /* transformers adds 1e-20 to the sigmoid router's denominator only */
        float den = mc->router == MODEL_ROUTER_SIGMOID ? sum + 1e-20f : sum;
        for (int j = 0; j < k; j++) wt[j] /= den;
    }
    if (mc->router == MODEL_ROUTER_SIGMOID)
        for (int j = 0; j < k; j++) wt[j] *= mc->scale;
}

float model_moe_route_margin(const struct model_moe_config *mc, const float *logits, const float *bias,
                             float *scratch)
{
    int n = mc->n_expert, k = mc->n_expert_used;
    float *c = scratch, *slope = scratch + n; /* each candidate's selection score and its d/dlogit */
    for (int i = 0; i < n; i++) {
        if (mc->router == MODEL_ROUTER_SOFTMAX) { /* the order of the probabilities is the logits' */
            c[i] = logits[i];
            slope[i] = 1.0f;
        } else {
            float s = 1.0f / (1.0f + expf(-logits[i]));
            c[i] = s + (bias ? bias[i] : 0.0f);
            slope[i] = s * (1.0f - s);
        }
    }
    unsigned char mask[n], chosen[n];
    memset(mask, 1, (size_t)n);
    memset(chosen, 0, (size_t)n);
    float m = INFINITY;
    if (mc->n_group > 1) {
        /* groups by the sum of their two best, as model_moe_route */
        int G = mc->n_group, per = n / G;
        float gs[G], gsl[G];
        int32_t keep[G];
        unsigned char kept[G];
        for (int g = 0; g < G; g++) {
            int32_t two[2];
            top_k(c + g * per, NULL, per, 2, two);
            gs[g] = c[g * per + two[0]] + c[g * per + two[1]];
            gsl[g] = slope[g * per + two[0]] + slope[g * per + two[1]];
        }
        top_k(gs, NULL, G, mc->topk_group, keep);
        memset(kept, 0, (size_t)G);
        for (int j = 0; j < mc->topk_group; j++) kept[keep[j]] = 1;
        for (int a = 0; a < G; a++)
            for (int d = 0; d < G; d++)
                if (kept[a] && !kept[d] && (gs[a] - gs[d]) / (gsl[a] + gsl[d]) < m)
                    m = (gs[a] - gs[d]) / (gsl[a] + gsl[d]);
        for (int g = 0; g < G; g++) memset(mask + g * per, kept[g], (size_t)per);
    }
    int32_t idx[k];
    top_k(c, mask, n, k, idx);
    for (int j = 0; j < k; j++) chosen[idx[j]] = 1;
    for (int a = 0; a < n; a++)
        for (int d = 0; d < n && chosen[a]; d++)
            if (mask[d] && !chosen[d] && (c[a] - c[d]) / (slope[a] + slope[d]) < m)
                m = (c[a] - c[d]) / (slope[a] + slope[d]);
    return m;
}

/* ---- CPU compute ------------------------------------------------------------------ */

#define RB 16 /* weight rows dequantized at a time */

struct moe_layer_cpu {
    float *router;      /* [n_expert][n_embd] f32 (owned, in moe_cpu.wmem) */
    float *bias;        /* [n_expert] or NULL */
    float *sh_weigh;    /* [n_embd] the shared experts' gate, or NULL */
    const struct model_moe_weights *w; /* borrowed from the model */
};

struct moe_cpu {
    struct model_config c;
    int nt, max_tokens, slots;  /* slots per token: top-k, + 1 for the shared experts */
    int fmax;                   /* widest expert intermediate (routed or shared) */
    struct moe_layer_cpu *L;    /* [model_n_layer_all]; router NULL for dense layers */
    float *wmem;                /* routers and biases, f32 */
    float *logits;              /* [max_tokens][n_expert] */
    int32_t *idx;               /* [max_tokens][slots] expert of each slot (n_expert: shared) */
    float *wt;                  /* [max_tokens][slots] */
    int *count, *start;         /* [n_expert + 1], [n_expert + 2]: assignments per expert, offsets */
    int *list;                  /* [max_tokens * slots] assignments (token * slots + slot) by expert */
    int *items;                 /* [(n_expert + 1) * nblk] work items: expert * nblk + row block */
    int nblk;                   /* row blocks of the widest matrix */
    float *h;                   /* [max_tokens * slots][fmax] activations */
    float *y;                   /* [max_tokens * slots][n_embd] expert outputs */
    float *wbuf;                /* [nt][2][RB][max(n_embd, fmax)] dequantized rows per thread */
    float *rscr;                /* [nt][2 * n_expert] router scratch */
    int wrow;
};

/* The one dot product every (row, token) pair uses: 8 lanes of fused
 * multiply-adds, reduced in a fixed tree, then the tail, so grouping never
 * changes a bit (the AVX2 and portable forms give the same bits). */
static float dot(const float *a, const float *b, int n)
{
    int i = 0;
#if defined(__AVX2__) && defined(__FMA__)
    __m256 acc = _mm256_setzero_ps();
    for (; i + 8 <= n; i += 8) acc = _mm256_fmadd_ps(_mm256_loadu_ps(a + i), _mm256_loadu_ps(b + i), acc);
    __m128 h = _mm_add_ps(_mm256_castps256_ps128(acc), _mm256_extractf128_ps(acc, 1));
    h = _mm_add_ps(h, _mm_movehl_ps(h, h));
    h = _mm_add_ss(h, _mm_movehdup_ps(h));
    float r = _mm_cvtss_f32(h);
#else
    float s[8] = {0};
    for (; i + 8 <= n; i += 8)
        for (int j = 0; j < 8; j++) s[j] = fmaf(a[i + j], b[i + j], s[j]);
    float r = ((s[0] + s[4]) + (s[2] + s[6])) + ((s[1] + s[5]) + (s[3] + s[7]));
#endif
    for (; i < n; i++) r = fmaf(a[i], b[i], r);
    return r;
}

static void deq_rows(const struct model_tensor *t, int r0, int n, float *dst)
{
    int64_t in = t->ne[0];
    model_tensor_to_f32(t, (int64_t)r0 * in, (int64_t)n * in, dst);
}

static void *zalloc(size_t n)
{
    void *p = NULL;
    if (posix_memalign(&p, 64, n ? n : 64) != 0) return NULL;
    memset(p, 0, n);
    return p;
}

struct moe_cpu *moe_cpu_create(const struct model_config *c, const struct model_weights *w, int max_tokens,
                               int n_threads, char *err, size_t errlen)
{
    const struct model_moe_config *mc = &c->moe;
    struct moe_cpu *b = calloc(1, sizeof *b);
    if (!b) goto oom;
    b->c = *c;
    b->nt = n_threads > 0 ? n_threads : 1;
    b->max_tokens = max_tokens;
    b->slots = mc->n_expert_used + (mc->n_ff_shared > 0);
    b->fmax = mc->n_ff_expert > mc->n_ff_shared ? mc->n_ff_expert : mc->n_ff_shared;
    int n_all = model_n_layer_all(c);
    b->L = calloc((size_t)n_all, sizeof *b->L);
    int n_moe = 0;
    for (int l = 0; l < n_all; l++) n_moe += model_layer_kind_of(c, l).ffn == MODEL_FFN_MOE;
    size_t NE = mc->n_expert, E = c->n_embd, T = max_tokens, S = b->slots;
    b->wmem = zalloc((size_t)n_moe * (NE * (E + 1) + E) * sizeof(float));
    if (!b->L || !b->wmem) goto oom;
    float *p = b->wmem;
    for (int l = 0; l < n_all; l++) {
        if (model_layer_kind_of(c, l).ffn != MODEL_FFN_MOE) continue;
        const struct model_moe_weights *mw = &w->layers[l].moe;
        struct moe_layer_cpu *L = &b->L[l];
        L->w = mw;
        L->router = p;
        model_tensor_to_f32(&mw->router, 0, (int64_t)(NE * E), p);
        p += NE * E;
        if (mw->router_bias.data) {
            L->bias = p;
            model_tensor_to_f32(&mw->router_bias, 0, (int64_t)NE, p);
        }
        p += NE;
        if (mc->shared_gated) {
            if (!mw->sh_weigh.data) {
                sl_seterr(err, errlen, "layer %d: the shared expert's gate is missing", l);
                goto fail;
            }
            L->sh_weigh = p;
            model_tensor_to_f32(&mw->sh_weigh, 0, (int64_t)E, p);
        }
        p += E;
        const struct model_tensor *ts[] = {&mw->sh_gate, &mw->sh_up, &mw->sh_down};
        for (size_t i = 0; i < 3; i++)
            if (mc->n_ff_shared > 0 && !ts[i]->data) {
                sl_seterr(err, errlen, "layer %d: shared experts missing", l);
                goto fail;
            }
    }
    b->wrow = (int)(E > (size_t)b->fmax ? E : (size_t)b->fmax);
    int nblk = b->nblk = (b->wrow + RB - 1) / RB;
    b->logits = zalloc(T * NE * sizeof(float));
    b->idx = zalloc(T * S * sizeof(int32_t));
    b->wt = zalloc(T * S * sizeof(float));
    b->count = zalloc((NE + 1) * sizeof(int));
    b->start = zalloc((NE + 2) * sizeof(int));
    b->list = zalloc(T * S * sizeof(int));
    b->items = zalloc((NE + 1) * (size_t)nblk * sizeof(int));
    b->h = zalloc(T * S * (size_t)b->fmax * sizeof(float));
    b->y = zalloc(T * S * E * sizeof(float));
    b->wbuf = zalloc((size_t)b->nt * 2 * RB * (size_t)b->wrow * sizeof(float));
    b->rscr = zalloc((size_t)b->nt * 2 * NE * sizeof(float));
    if (!b->logits || !b->idx || !b->wt || !b->count || !b->start || !b->list || !b->items || !b->h || !b->y ||
        !b->wbuf || !b->rscr)
        goto oom;
    return b;
oom:
    sl_seterr(err, errlen, "out of memory for the MoE scratch (%d tokens)", max_tokens);
fail:
    moe_cpu_destroy(b);
    return NULL;
}

static inline float swiglu(float g, float u, float limit)
{
    if (limit > 0) {
        g = g < limit ? g : limit;
        u = u < -limit ? -limit : u > limit ? limit : u;
    }
    return g / (1.0f + expf(-g)) * u;
}

void moe_cpu_forward(struct moe_cpu *b, int l, const float *xn, float *x_out, int T, float *margin)
{
    const struct model_config *c = &b->c;
    const struct model_moe_config *mc = &c->moe;
    const struct moe_layer_cpu *L = &b->L[l];
    const struct model_moe_weights *mw = L->w;
    int E = c->n_embd, NE = mc->n_expert, K = mc->n_expert_used, S = b->slots;
    float limit = mc->swiglu_limit;
    SL_ASSERT(L->router && T <= b->max_tokens);

    /* route every token (its own row only) */
#pragma omp parallel for schedule(static) num_threads(b->nt) if (T >= 4)
    for (int t = 0; t < T; t++) {
        const float *x = xn + (size_t)t * E;
        float *lg = b->logits + (size_t)t * NE;
        for (int e = 0; e < NE; e++) lg[e] = dot(L->router + (size_t)e * E, x, E);
        model_moe_route(mc, lg, L->bias, b->idx + (size_t)t * S, b->wt + (size_t)t * S,
                        b->rscr + (size_t)omp_get_thread_num() * 2 * NE);
        if (margin)
            margin[t] = model_moe_route_margin(mc, lg, L->bias, b->rscr + (size_t)omp_get_thread_num() * 2 * NE);
        if (S > K) {
            b->idx[(size_t)t * S + K] = NE;
            b->wt[(size_t)t * S + K] = L->sh_weigh ? 1.0f / (1.0f + expf(-dot(L->sh_weigh, x, E))) : 1.0f;
        }
    }

    /* group the assignments by expert (the shared experts are expert NE) */
    memset(b->count, 0, (size_t)(NE + 1) * sizeof(int));
    for (int a = 0; a < T * S; a++) b->count[b->idx[a]]++;
    b->start[0] = 0;
    for (int e = 0; e <= NE; e++) b->start[e + 1] = b->start[e] + b->count[e];
    memset(b->count, 0, (size_t)(NE + 1) * sizeof(int));
    for (int a = 0; a < T * S; a++) {
        int e = b->idx[a];
        b->list[b->start[e] + b->count[e]++] = a;
    }

    /* gate/up: work items are (expert, block of intermediate rows) */
    int n_items = 0;
    for (int e = 0; e <= NE; e++) {
        if (!b->count[e]) continue;
        int F = e < NE ? mc->n_ff_expert : mc->n_ff_shared;
        for (int r0 = 0; r0 < F; r0 += RB) b->items[n_items++] = e * b->nblk + r0 / RB;
    }
#pragma omp parallel for schedule(dynamic, 1) num_threads(b->nt)
    for (int it = 0; it < n_items; it++) {
        int e = b->items[it] / b->nblk, r0 = b->items[it] % b->nblk * RB;
        bool sh = e == NE;
        int F = sh ? mc->n_ff_shared : mc->n_ff_expert, nr = F - r0 < RB ? F - r0 : RB;
        const struct model_tensor *gt = sh ? &mw->sh_gate : &mw->gate[e], *ut = sh ? &mw->sh_up : &mw->up[e];
        float *gw = b->wbuf + (size_t)omp_get_thread_num() * 2 * RB * b->wrow, *uw = gw + (size_t)RB * b->wrow;
        deq_rows(gt, r0, nr, gw);
        deq_rows(ut, r0, nr, uw);
        for (int i = b->start[e]; i < b->start[e + 1]; i++) {
            int a = b->list[i];
            const float *x = xn + (size_t)(a / S) * E;
            float *h = b->h + (size_t)a * b->fmax;
            for (int r = 0; r < nr; r++)
                h[r0 + r] = swiglu(dot(gw + (size_t)r * E, x, E), dot(uw + (size_t)r * E, x, E), limit);
        }
    }

    /* down: work items are (expert, block of output rows) */
    n_items = 0;
    for (int e = 0; e <= NE; e++) {
        if (!b->count[e]) continue;
        for (int r0 = 0; r0 < E; r0 += RB) b->items[n_items++] = e * b->nblk + r0 / RB;
    }
#pragma omp parallel for schedule(dynamic, 1) num_threads(b->nt)
    for (int it = 0; it < n_items; it++) {
        int e = b->items[it] / b->nblk, r0 = b->items[it] % b->nblk * RB;
        bool sh = e == NE;
        int F = sh ? mc->n_ff_shared : mc->n_ff_expert, nr = E - r0 < RB ? E - r0 : RB;
        float *dw = b->wbuf + (size_t)omp_get_thread_num() * 2 * RB * b->wrow;
        deq_rows(sh ? &mw->sh_down : &mw->down[e], r0, nr, dw);
        for (int i = b->start[e]; i < b->start[e + 1]; i++) {
            int a = b->list[i];
            const float *h = b->h + (size_t)a * b->fmax;
            float *y = b->y + (size_t)a * E;
            for (int r = 0; r < nr; r++) y[r0 + r] = dot(dw + (size_t)r * F, h, F);
        }
    }

    /* per token: its experts in ascending order, weighed, then the shared
     * experts, summed in the first slot's row, then added to the residual */
#pragma omp parallel for schedule(static) num_threads(b->nt) if (T >= 4)
    for (int t = 0; t < T; t++) {
        float *o = b->y + (size_t)t * S * E, w0 = b->wt[(size_t)t * S];
        for (int i = 0; i < E; i++) o[i] = w0 * o[i];
        for (int j = 1; j < K; j++) {
            float w = b->wt[(size_t)t * S + j];
            const float *y = b->y + ((size_t)t * S + j) * E;
            for (int i = 0; i < E; i++) o[i] += w * y[i];
        }
        if (S > K) {
            float w = b->wt[(size_t)t * S + K];
            const float *y = b->y + ((size_t)t * S + K) * E;
            for (int i = 0; i < E; i++) o[i] += w * y[i];
        }
        float *x = x_out + (size_t)t * E;
        for (int i = 0; i < E; i++) x[i] += o[i];
    }
}

void moe_cpu_destroy(struct moe_cpu *b)
{
    if (!b) return;
    free(b->L);
    free(b->wmem);
    free(b->logits);
    free(b->idx);
    free(b->wt);
    free(b->count);
    free(b->start);
    free(b->list);
    free(b->items);
    free(b->h);
    free(b->y);
    free(b->wbuf);
    free(b->rscr);
    free(b);
}

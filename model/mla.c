/* mla.c - multi-head latent attention on the model side (mla.h): config keys,
 * tensors, and the KV entry of each layer kind (MTP layers included).
 *
 * Reference: transformers' modeling_deepseek_v3.py and modeling_glm_moe_dsa.py
 * (DeepseekV3Attention, GlmMoeDsaAttention, GlmMoeDsaIndexer) and
 * modeling_rope_utils.py (_compute_yarn_parameters, yarn_apply_mscale). */
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "mla.h"

int64_t model_kv_token_elems(const struct model_config *c, int layer)
{
    struct model_layer_kind k = model_layer_kind_of(c, layer);
    switch (k.mixer) {
    case MODEL_MIXER_GQA: return 2 * (int64_t)c->n_head_kv * c->head_dim;
    case MODEL_MIXER_MLA: {
        const struct model_mla_config *a = &c->mla;
        bool ix = a->index_topk > 0 && a->index_full && layer < c->n_layer && a->index_full[layer];
        /* k-pools keep each token's gate scores beside its key (a pool's key is built once it is whole) */
        int64_t per = a->index_kpool > 0 ? 2 * (int64_t)a->index_head_dim : a->index_head_dim;
        return (int64_t)a->kv_lora_rank + a->qk_rope_head_dim + (ix ? per : 0);
    }
    case MODEL_MIXER_KDA: return 0; /* a state per sequence instead (model_state_layer_elems) */
    }
    return 0;
}

size_t model_kv_bytes_per_token(const struct model_config *c, size_t elem_bytes)
{
    size_t n = 0;
    for (int l = 0; l < c->n_layer; l++) n += (size_t)model_kv_token_elems(c, l) * elem_bytes;
    return n;
}

int model_kpool_indexer_layers(const struct model_config *c)
{
    const struct model_mla_config *a = &c->mla;
    int n = 0;
    if (a->index_topk <= 0 || a->index_kpool <= 0 || !a->index_full) return 0;
    for (int l = 0; l < c->n_layer; l++) n += model_layer_kind_of(c, l).mixer == MODEL_MIXER_MLA && a->index_full[l];
    return n;
}

size_t model_mtp_kv_bytes_per_token(const struct model_config *c, size_t elem_bytes)
{
    size_t n = 0;
    for (int l = c->n_layer; l < model_n_layer_all(c); l++) n += (size_t)model_kv_token_elems(c, l) * elem_bytes;
    return n;
}

size_t model_mtp_kv_bytes_per_block(const struct model_config *c, size_t elem_bytes)
{
    return c->n_mtp_layer > 0 ? (size_t)c->n_embd * elem_bytes + sizeof(int32_t) : 0;
}

/* ---- config.json ------------------------------------------------------------ */

static int get_int(const json_doc *d, int obj, const char *key, int def, int lo, int *out, char *err, size_t errlen)
{
    int i = obj < 0 ? -1 : json_get(d, obj, key);
    int64_t v = def;
    if (i >= 0 && !json_is_null(d, i) && (json_i64(d, i, &v) != 0 || v < lo || v > (1 << 24))) {
        sl_seterr(err, errlen, "config.json: %s must be an integer from %d to %d", key, lo, 1 << 24);
        return SL_EFORMAT;
    }
    *out = (int)v;
    return 0;
}

static int get_num(const json_doc *d, int obj, const char *key, double def, double *out, char *err, size_t errlen)
{
    int i = obj < 0 ? -1 : json_get(d, obj, key);
    *out = def;
    if (i >= 0 && !json_is_null(d, i) && (json_f64(d, i, out) != 0 || !isfinite(*out))) {
        sl_seterr(err, errlen, "config.json: %s must be a number", key);
        return SL_EFORMAT;
    }
    return 0;
}

/* YaRN's mscale (the paper's Eq. 21), as transformers' yarn_get_mscale */
static double yarn_mscale(double scale, double mscale)
{
    return scale <= 1 ? 1.0 : 0.1 * mscale * log(scale) + 1.0;
}

static int mla_yarn(const json_doc *d, int rp, struct model_config *c, double *softmax_mult, char *err, size_t errlen)
{
    struct model_mla_config *a = &c->mla;
    double factor, af, mscale, mscale_all, bf, bs, orig;
    int rc;
    if ((rc = get_num(d, rp, "factor", 0, &factor, err, errlen)) ||
        (rc = get_num(d, rp, "attention_factor", 0, &af, err, errlen)) ||
        (rc = get_num(d, rp, "mscale", 0, &mscale, err, errlen)) ||
        (rc = get_num(d, rp, "mscale_all_dim", 0, &mscale_all, err, errlen)) ||
        (rc = get_num(d, rp, "beta_fast", 0, &bf, err, errlen)) ||
        (rc = get_num(d, rp, "beta_slow", 0, &bs, err, errlen)) ||
        (rc = get_num(d, rp, "original_max_position_embeddings", 0, &orig, err, errlen)))
        return rc;
    if (!(orig >= 1)) {
        sl_seterr(err, errlen, "config.json: yarn rope scaling without original_max_position_embeddings");
        return SL_EFORMAT;
    }
    if (factor == 0) factor = c->n_ctx_train / orig; /* transformers: the context ratio when factor is null */
    if (!(factor > 0)) {
        sl_seterr(err, errlen, "config.json: yarn rope scaling factor %g must be positive", factor);
        return SL_EFORMAT;
    }
    if (af == 0)
        af = mscale != 0 && mscale_all != 0 ? yarn_mscale(factor, mscale) / yarn_mscale(factor, mscale_all)
                                            : yarn_mscale(factor, 1.0);
    bool trunc = true;
    int t = json_get(d, rp, "truncate");
    if (t >= 0 && !json_is_null(d, t) && json_bool(d, t, &trunc) != 0) {
        sl_seterr(err, errlen, "config.json: rope truncate must be true or false");
        return SL_EFORMAT;
    }
    a->yarn_factor = (float)factor;
    a->yarn_beta_fast = (float)(bf != 0 ? bf : 32);
    a->yarn_beta_slow = (float)(bs != 0 ? bs : 1);
    a->yarn_orig_ctx = (int)orig;
    a->yarn_truncate = trunc;
    a->rope_attn_factor = (float)af;
    /* yarn_apply_mscale: MLA scales q.k by mscale(factor, mscale_all_dim)^2 as well */
    *softmax_mult = mscale_all != 0 ? yarn_mscale(factor, mscale_all) * yarn_mscale(factor, mscale_all) : 1.0;
    return 0;
}

int mla_hf_config(const json_doc *d, int obj, int rp, struct model_config *c, uint8_t **index_full, char *err,
                  size_t errlen)
{
    struct model_mla_config *a = &c->mla;
    bool g5 = c->arch == MODEL_ARCH_GLM5_NEXT, glm = c->arch == MODEL_ARCH_GLM_MOE_DSA || g5;
    int rc, ql = 0, dense = 0, n_ix_types = 0;
    *index_full = NULL;
    memset(a, 0, sizeof *a);
    /* Glm5NextTextConfig's defaults where they differ */
    if ((rc = get_int(d, obj, "kv_lora_rank", 512, 1, &a->kv_lora_rank, err, errlen)) ||
        (rc = get_int(d, obj, "q_lora_rank", g5 ? 1536 : 0, 0, &ql, err, errlen)) ||
        (rc = get_int(d, obj, "qk_nope_head_dim", g5 ? 256 : 128, 1, &a->qk_nope_head_dim, err, errlen)) ||
        (rc = get_int(d, obj, "qk_rope_head_dim", g5 ? 0 : 64, 0, &a->qk_rope_head_dim, err, errlen)) ||
        (rc = get_int(d, obj, "v_head_dim", g5 ? 256 : 128, 1, &a->v_head_dim, err, errlen)) ||
        (rc = get_int(d, obj, "first_k_dense_replace", glm ? 3 : 3, 0, &dense, err, errlen)) ||
        (g5 && (rc = get_int(d, obj, "num_nextn_predict_layers", 0, 0, &a->n_mtp_layers, err, errlen))))
        return rc;
    a->q_lora_rank = ql;
    if (glm && ql == 0) {
        sl_seterr(err, errlen, "config.json: %s needs q_lora_rank", model_arch_name(c->arch));
        return SL_EFORMAT;
    }
    if (a->qk_rope_head_dim % 2) {
        sl_seterr(err, errlen, "config.json: qk_rope_head_dim %d must be even", a->qk_rope_head_dim);
        return SL_EFORMAT;
    }
    bool bias = false, inter = true;
    int bi = json_get(d, obj, "attention_bias"), ri = json_get(d, obj, "rope_interleave");
    if ((bi >= 0 && !json_is_null(d, bi) && json_bool(d, bi, &bias) != 0) ||
        (ri >= 0 && !json_is_null(d, ri) && json_bool(d, ri, &inter) != 0)) {
        sl_seterr(err, errlen, "config.json: attention_bias and rope_interleave must be true or false");
        return SL_EFORMAT;
    }
    if (bias) {
        sl_seterr(err, errlen, "unsupported: attention_bias in a %s checkpoint", model_arch_name(c->arch));
        return SL_EUNSUP;
    }
    a->rope_interleave = glm ? true : inter; /* GlmMoeDsaAttention always interleaves */
    /* q_a_layernorm, kv_a_layernorm: their own default 1e-6, but glm5_next builds them with rms_norm_eps */
    a->latent_norm_eps = g5 ? c->norm_eps : 1e-6f;
    a->rope_attn_factor = 1.0f;

    /* every FFN of the leading first_k_dense_replace layers is dense
     * (glm_moe_dsa: mlp_layer_types, when given, must say the same shape) */
    a->n_dense_layers = dense < c->n_layer ? dense : c->n_layer;
    int mt = json_get(d, obj, "mlp_layer_types");
    if (g5) {
        a->n_dense_layers = 0; /* mlp_layer_types alone decides, layer by layer (moe_hf_config) */
    } else if (mt >= 0 && json_is_arr(d, mt)) {
        int n = json_size(d, mt), k = 0;
        while (k < n && json_str_eq(d, json_at(d, mt, k), "dense")) k++;
        for (int j = k; j < n; j++)
            if (!json_str_eq(d, json_at(d, mt, j), "sparse")) {
                sl_seterr(err, errlen, "config.json: mlp_layer_types[%d] is neither dense nor sparse after the dense "
                                       "prefix", j);
                return SL_EUNSUP;
            }
        a->n_dense_layers = k < c->n_layer ? k : c->n_layer;
    }

    double mult = 1.0;
    if (rp >= 0 && !g5) { /* glm5_next has no RoPE, whatever rope_parameters say */
        int t = json_get(d, rp, "rope_type");
        if (t < 0) t = json_get(d, rp, "type");
        if (t >= 0 && json_str_eq(d, t, "yarn") && (rc = mla_yarn(d, rp, c, &mult, err, errlen))) return rc;
    }
    a->softmax_scale = (float)(1.0 / sqrt((double)(a->qk_nope_head_dim + a->qk_rope_head_dim)) * mult);

    if (glm) {
        if ((rc = get_int(d, obj, "index_topk", 2048, 1, &a->index_topk, err, errlen)) ||
            (rc = get_int(d, obj, "index_n_heads", 32, 1, &a->index_n_heads, err, errlen)) ||
            (rc = get_int(d, obj, "index_head_dim", 128, 1, &a->index_head_dim, err, errlen)))
            return rc;
        int ti = json_get(d, obj, "index_topk");
        if (ti >= 0 && json_is_null(d, ti)) a->index_topk = 0;
        if (g5) {
            /* k-pools (Glm5NextTextIndexer); transformers refuses a budget that is not whole pools */
            if ((rc = get_int(d, obj, "index_kpool", 16, 1, &a->index_kpool, err, errlen))) return rc;
            bool tail = true;
            int tt = json_get(d, obj, "index_kpool_always_select_tail");
            if (tt >= 0 && !json_is_null(d, tt) && json_bool(d, tt, &tail) != 0) {
                sl_seterr(err, errlen, "config.json: index_kpool_always_select_tail must be true or false");
                return SL_EFORMAT;
            }
            a->index_kpool_tail = tail;
            if (a->index_topk > 0 && a->index_topk % a->index_kpool) {
                sl_seterr(err, errlen, "config.json: index_topk %d is not a multiple of index_kpool %d", a->index_topk,
                          a->index_kpool);
                return SL_EFORMAT;
            }
        }
        if (a->index_head_dim < a->qk_rope_head_dim) {
            sl_seterr(err, errlen, "config.json: index_head_dim %d is smaller than qk_rope_head_dim %d",
                      a->index_head_dim, a->qk_rope_head_dim);
            return SL_EFORMAT;
        }
        uint8_t *f = calloc((size_t)c->n_layer, 1);
        if (!f) return SL_ENOMEM;
        /* indexer_types, else the pattern from index_topk_freq / index_skip_topk_offset
         * (GlmMoeDsaConfig.__post_init__: full where max(i - offset + 1, 0) % freq == 0) */
        int it = json_get(d, obj, "indexer_types"), freq = 1, off = 2;
        if (it >= 0 && json_is_arr(d, it)) {
            n_ix_types = json_size(d, it);
            for (int l = 0; l < c->n_layer && l < n_ix_types; l++) f[l] = json_str_eq(d, json_at(d, it, l), "full");
        }
        int pt = json_get(d, obj, "index_topk_pattern"); /* glm5_next: "FSSF...", F full, S shared */
        if (n_ix_types == 0 && pt >= 0 && json_is_str(d, pt)) {
            char pat[4096];
            int pn = json_str(d, pt, pat, sizeof pat);
            for (int l = 0; l < c->n_layer && l < pn; l++) f[l] = pat[l] == 'F';
            n_ix_types = pn > 0 ? pn : 0;
        }
        if (n_ix_types == 0) {
            if ((rc = get_int(d, obj, "index_topk_freq", 1, 1, &freq, err, errlen)) ||
                (rc = get_int(d, obj, "index_skip_topk_offset", 2, 0, &off, err, errlen))) {
                free(f);
                return rc;
            }
            for (int l = 0; l < c->n_layer; l++) f[l] = ((l - off + 1 > 0 ? l - off + 1 : 0) % freq) == 0;
        }
        if (!f[0]) {
            sl_seterr(err, errlen, "config.json: the first layer's indexer is shared, with no full layer before it");
            free(f);
            return SL_EFORMAT;
        }
        *index_full = f;
        a->index_full = f;
    }
    c->head_dim = a->qk_nope_head_dim + a->qk_rope_head_dim;
    c->rope_dim = a->qk_rope_head_dim;
    c->n_head_kv = c->n_head;
    return 0;
}

/* ---- tensors ------------------------------------------------------------------- */

int mla_bind_layer(const struct model_config *c, int l, int fl, mla_get_fn get, void *ctx,
                   struct model_mla_weights *w, char *err, size_t errlen)
{
    const struct model_mla_config *a = &c->mla;
    int64_t E = c->n_embd, H = c->n_head, Dq = a->qk_nope_head_dim + a->qk_rope_head_dim, C = a->kv_lora_rank,
            R = a->qk_rope_head_dim, QL = a->q_lora_rank;
    char name[256];
    int rc;
#define T(field, suffix, rows, cols)                                                                   \
    do {                                                                                               \
        snprintf(name, sizeof name, "model.layers.%d.self_attn.%s", fl, suffix);                      \
        if ((rc = get(ctx, name, rows, cols, false, &w->field, err, errlen))) return rc;               \
    } while (0)
    if (QL > 0) {
        T(q_a, "q_a_proj.weight", QL, E);
        T(q_a_norm, "q_a_layernorm.weight", 0, QL);
        T(q_b, "q_b_proj.weight", H * Dq, QL);
    } else {
        T(q, "q_proj.weight", H * Dq, E);
    }
    T(kv_a, "kv_a_proj_with_mqa.weight", C + R, E);
    T(kv_a_norm, "kv_a_layernorm.weight", 0, C);
    T(kv_b, "kv_b_proj.weight", H * (a->qk_nope_head_dim + a->v_head_dim), C);
    T(o, "o_proj.weight", E, H * a->v_head_dim);
    if (a->index_topk > 0 && a->index_full && l < c->n_layer && a->index_full[l]) {
        int64_t IH = a->index_n_heads, ID = a->index_head_dim;
        T(ix_wq_b, "indexer.wq_b.weight", IH * ID, QL);
        T(ix_wk, "indexer.wk.weight", ID, E);
        T(ix_k_norm, "indexer.k_norm.weight", 0, ID);
        T(ix_k_norm_b, "indexer.k_norm.bias", 0, ID);
        T(ix_weights, "indexer.weights_proj.weight", IH, E);
        if (a->index_kpool > 0) {
            /* parameters, not nn.Linear: no ".weight", never quantized */
            T(ix_kpool_ape, "indexer.index_kpool_compress_ape", a->index_kpool, ID);
            T(ix_kpool_gate, "indexer.index_kpool_compress_gate", ID, E);
        }
    }
#undef T
    return 0;
}

int mla_count_mtp(const struct model_config *c, int first, const char *prefix_text, const st_set *st, mla_get_fn get,
                  void *ctx, int *n_tensors, size_t *n_bytes, char *err, size_t errlen)
{
    int64_t E = c->n_embd;
    *n_tensors = 0;
    *n_bytes = 0;
    for (int i = 0; i < c->mla.n_mtp_layers; i++) {
        int l = first + i, rc;
        char name[256], prefix[128];
        const struct { const char *suffix; int64_t rows, cols; } need[] = {
            {"enorm.weight", 0, E}, {"hnorm.weight", 0, E}, {"eh_proj.weight", E, 2 * E},
        };
        for (size_t k = 0; k < sizeof need / sizeof *need; k++) {
            struct model_tensor t;
            snprintf(name, sizeof name, "model.layers.%d.%s", l, need[k].suffix);
            rc = get(ctx, name, need[k].rows, need[k].cols, true, &t, err, errlen);
            if (rc) return rc;
            if (!t.data) {
                sl_seterr(err, errlen,
                          "num_nextn_predict_layers is %d but %s is missing (--hf-overrides "
                          "'{\"num_nextn_predict_layers\": 0}' loads the model without its MTP layers)",
                          c->mla.n_mtp_layers, name);
                return SL_EFORMAT;
            }
        }
        snprintf(prefix, sizeof prefix, "%slayers.%d.", prefix_text, l);
        size_t pl = strlen(prefix);
        for (int k = 0; st && k < st_n_tensors(st); k++) {
            const struct st_tensor *t = st_tensor_at(st, k);
            if (strncmp(t->name, prefix, pl) == 0) {
                (*n_tensors)++;
                *n_bytes += t->nbytes;
            }
        }
    }
    return 0;
}

/* loader.c - model_load(): a GGUF file or an HF checkpoint directory becomes
 * a `model` (config + borrowed weight views + tokenizer + chat template).
 *
 * Both formats end in the same struct model_config / struct model_weights.
 * Weights stay in the mmapped files (the gguf_file or st_set the model owns);
 * every tensor is shape-checked against the config here, so a backend can
 * trust the shapes. Tensor names handed out in struct model_tensor are owned
 * by the model (a name pool).
 */
#include <ctype.h>
#include <dirent.h>
#include <errno.h>
#include <limits.h>
#include <math.h>
#include <stdarg.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>

#include "gguf.h"
#include "base/json.h"
#include "model.h"
#include "safetensors.h"
#include "loader_dummy.h"
#include "glm5.h"
#include "kda.h"
#include "mla.h"
#include "moe.h"
#include "overrides.h"
#include "quant.h"
#include "tokenizer.h"

struct model {
    struct model_config cfg;
    struct model_weights w;
    model_tok *tok;
    char *chat_template;    /* owned, or NULL */
    gguf_file *gguf;        /* owned mapping (GGUF), or NULL */
    st_set *st;             /* owned mappings (HF dir), or NULL */
    void *dummy;            /* owned random weights (--load-format dummy), or NULL */
    char **names;           /* owned tensor names */
    int n_names, cap_names;
    struct quant_cfg *qcfg;          /* config.json's quantization_config, or NULL */
    struct model_quant **quants;     /* owned descriptors of the packed weights */
    int n_quants, cap_quants;
    struct model_layer_kind *layer_kind; /* owned plan of layers, cfg.layer_kind */
    uint8_t *index_full;             /* owned cfg.mla.index_full, or NULL */
    const char *hf_overrides;        /* borrowed from the load options during model_load */
    int n_layer_file;                /* decoder layers the checkpoint has (MTP modules follow them) */
    bool *moe_sparse;                    /* owned [n_moe_sparse]: MoE layers, or NULL */
    int n_moe_sparse;                    /* n_layer at config time (an override may change it) */
    struct model_tensor *moe_experts;    /* owned expert views, 3 * n_expert per MoE layer */
    struct model_mtp_weights *mtp;       /* owned w.mtp, [cfg.n_mtp_layer] */
    bool file_decides;                   /* binding an MTP layer: a dense weight the config calls quantized is
                                            taken as the file holds it (get_weight_st) */
    bool *kda_layer;                     /* owned [n_kda_layer]: glm5_next's linear_attention layers, or NULL */
    int n_kda_layer;                     /* n_layer at config time */
    const char *text_prefix;             /* where the file keeps the text model: NULL for "model.", else
                                            "model.language_model." (glm5_next with its vision tower) */
};


const char *model_mixer_name(enum model_mixer k)
{
    switch (k) {
    case MODEL_MIXER_GQA: return "gqa";
    case MODEL_MIXER_MLA: return "mla";
    case MODEL_MIXER_KDA: return "kda";
    }
    return "?";
}

const char *model_ffn_name(enum model_ffn k)
{
    switch (k) {
    case MODEL_FFN_DENSE: return "dense";
    case MODEL_FFN_MOE: return "moe";
    }
    return "?";
}

/* The plan of layers from the (overridden) config: GQA attention, or MLA for
 * deepseek_v3 and glm_moe_dsa, KDA or MLA by glm5_next's layer_types; the
 * FFN is MoE where the config's MoE keys say (moe_hf_config:
 * first_k_dense_replace, mlp_only_layers, mlp_layer_types ...), else dense;
 * the residual is hyper-connection streams where the config has hc_mult.
 * The MTP layers after them take the model's mixer and, where the model has
 * experts, the MoE FFN (transformers' get_mtp_config: first_k_dense_replace 0). */
static int plan_layers(model *m, char *err, size_t errlen)
{
    const struct model_config *c = &m->cfg;
    bool mla = c->mla.kv_lora_rank > 0;
    free(m->layer_kind);
    m->layer_kind = calloc((size_t)model_n_layer_all(c), sizeof *m->layer_kind);
    if (!m->layer_kind) {
        sl_seterr(err, errlen, "out of memory");
        return SL_ENOMEM;
    }
    for (int l = 0; l < c->n_layer; l++) {
        bool sparse = m->moe_sparse && l < m->n_moe_sparse && m->moe_sparse[l];
        bool kda = m->kda_layer && l < m->n_kda_layer && m->kda_layer[l];
        if (mla && c->arch != MODEL_ARCH_GLM5_NEXT && l >= c->mla.n_dense_layers && !sparse) {
            sl_seterr(err, errlen, "layer %d of this %s checkpoint is past its %d dense layers but has no MoE FFN "
                      "in the config (n_routed_experts)", l, model_arch_name(c->arch), c->mla.n_dense_layers);
            return SL_EUNSUP;
        }
        m->layer_kind[l] = (struct model_layer_kind){kda ? MODEL_MIXER_KDA : mla ? MODEL_MIXER_MLA : MODEL_MIXER_GQA,
                                                     sparse ? MODEL_FFN_MOE : MODEL_FFN_DENSE,
                                                     c->hc.mult > 0 ? MODEL_RESID_HC : MODEL_RESID_PLAIN};
    }
    for (int l = c->n_layer; l < model_n_layer_all(c); l++)
        m->layer_kind[l] = (struct model_layer_kind){mla ? MODEL_MIXER_MLA : MODEL_MIXER_GQA,
                                                     c->moe.n_expert > 0 ? MODEL_FFN_MOE : MODEL_FFN_DENSE,
                                                     MODEL_RESID_PLAIN};
    m->cfg.layer_kind = m->layer_kind;
    return 0;
}

/* The configuration as it will run: --hf-overrides applied, then the plan of
 * layers, before any tensor is bound (an override may drop tensors: a layer
 * count, index_topk null, num_nextn_predict_layers 0). */
static int config_final(model *m, char *err, size_t errlen)
{
    m->n_layer_file = m->cfg.n_layer;
    if (m->hf_overrides && model_config_override(&m->cfg, m->hf_overrides, err, errlen)) return SL_EINVAL;
    return plan_layers(m, err, errlen);
}

static void kind_words(const struct model_config *c, struct model_layer_kind k, char *out, size_t cap)
{
    int n = k.mixer == MODEL_MIXER_KDA
                ? snprintf(out, cap, "kda %dx%d + %s", c->kda.n_head, c->kda.head_dim, model_ffn_name(k.ffn))
                : snprintf(out, cap, "%s + %s", model_mixer_name(k.mixer), model_ffn_name(k.ffn));
    if (k.ffn == MODEL_FFN_MOE && n > 0 && (size_t)n < cap) {
        const struct model_moe_config *mc = &c->moe;
        n += snprintf(out + n, cap - (size_t)n, " %d experts top-%d", mc->n_expert, mc->n_expert_used);
        if (mc->shared_gated && (size_t)n < cap)
            n += snprintf(out + n, cap - (size_t)n, " (+1 gated shared)");
        else if (mc->n_ff_shared > 0 && (size_t)n < cap)
            n += snprintf(out + n, cap - (size_t)n, " (+%d shared)", mc->n_ff_shared / mc->n_ff_expert);
        if (mc->router == MODEL_ROUTER_SIGMOID && (size_t)n < cap)
            n += snprintf(out + n, cap - (size_t)n, ", sigmoid router%s", mc->n_group > 1 ? " by groups" : "");
    }
    if (k.resid == MODEL_RESID_HC && n > 0 && (size_t)n < cap)
        snprintf(out + n, cap - (size_t)n, ", %d hyper-connection streams", c->hc.mult);
}

size_t model_plan_describe(const struct model_config *c, char *out, size_t cap)
{
    size_t len = 0;
    if (cap) out[0] = 0;
    for (int l = 0; l < c->n_layer;) {
        struct model_layer_kind k = model_layer_kind_of(c, l);
        int e = l;
        while (e + 1 < c->n_layer && model_layer_kind_of(c, e + 1).mixer == k.mixer &&
               model_layer_kind_of(c, e + 1).ffn == k.ffn && model_layer_kind_of(c, e + 1).resid == k.resid)
            e++;
        char what[160], range[32];
        kind_words(c, k, what, sizeof what);
        if (e > l) snprintf(range, sizeof range, "%d-%d", l, e);
        else snprintf(range, sizeof range, "%d", l);
        int n = snprintf(out + (len < cap ? len : cap), len < cap ? cap - len : 0, "%s%s: %s", l ? "; " : "",
                         range, what);
        len += (size_t)(n > 0 ? n : 0);
        l = e + 1;
    }
    return len;
}

const char *model_arch_name(enum model_arch a)
{
    switch (a) {
    case MODEL_ARCH_LLAMA: return "llama";
    case MODEL_ARCH_QWEN2: return "qwen2";
    case MODEL_ARCH_QWEN3: return "qwen3";
    case MODEL_ARCH_MISTRAL: return "mistral";
    case MODEL_ARCH_DEEPSEEK_V3: return "deepseek_v3";
    case MODEL_ARCH_GLM_MOE_DSA: return "glm_moe_dsa";
    case MODEL_ARCH_QWEN3_MOE: return "qwen3_moe";
    case MODEL_ARCH_GLM4_MOE: return "glm4_moe";
    case MODEL_ARCH_QWEN2_MOE: return "qwen2_moe";
    case MODEL_ARCH_GLM5_NEXT: return "glm5_next";
    }
    return "?";
}

static int arch_from_name(const char *s, size_t n, enum model_arch *out)
{
    static const struct { const char *name; enum model_arch a; } tab[] = {
        {"llama", MODEL_ARCH_LLAMA}, {"qwen2", MODEL_ARCH_QWEN2}, {"qwen3", MODEL_ARCH_QWEN3},
        {"mistral", MODEL_ARCH_MISTRAL}, {"deepseek_v3", MODEL_ARCH_DEEPSEEK_V3},
        {"glm_moe_dsa", MODEL_ARCH_GLM_MOE_DSA}, {"qwen3_moe", MODEL_ARCH_QWEN3_MOE},
        {"glm4_moe", MODEL_ARCH_GLM4_MOE}, {"qwen2_moe", MODEL_ARCH_QWEN2_MOE},
        {"glm5_next", MODEL_ARCH_GLM5_NEXT}, {"glm5_next_text", MODEL_ARCH_GLM5_NEXT},
    };
    for (size_t i = 0; i < sizeof tab / sizeof tab[0]; i++)
        if (strlen(tab[i].name) == n && memcmp(tab[i].name, s, n) == 0) {
            *out = tab[i].a;
            return 0;
        }
    return -1;
}

static const char *pool_name(model *m, const char *name)
{
    if (m->n_names == m->cap_names) {
        int cap = m->cap_names ? 2 * m->cap_names : 64;
        char **p = realloc(m->names, (size_t)cap * sizeof *p);
        if (!p) return NULL;
        m->names = p;
        m->cap_names = cap;
    }
    char *s = strdup(name);
    if (!s) return NULL;
    m->names[m->n_names++] = s;
    return s;
}

/* ---- tensors: lookup + shape check ------------------------------------------- */

/* The file's name of a "model.*" tensor: the text model of a multimodal
 * checkpoint (glm5_next) lives under model.language_model. */
static const char *file_name(const model *m, const char *name, char *buf, size_t cap)
{
    if (!m->text_prefix || strncmp(name, "model.", 6) != 0) return name;
    snprintf(buf, cap, "%s%s", m->text_prefix, name + 6);
    return buf;
}

/* Finds `name` in whichever file the model maps and fills *t. Returns 0,
 * 1 when absent (t->data NULL), or a negative status. */
static int find_tensor(model *m, const char *name, struct model_tensor *t)
{
    memset(t, 0, sizeof *t);
    t->ndim = 1;
    for (int i = 0; i < 4; i++) t->ne[i] = 1;
    if (m->gguf) {
        const struct gguf_tensor *g = gguf_find_tensor(m->gguf, name);
        if (!g) return 1;
        switch (g->type) {
        case GGUF_T_F32: t->dtype = MODEL_DT_F32; break;
        case GGUF_T_F16: t->dtype = MODEL_DT_F16; break;
        case GGUF_T_BF16: t->dtype = MODEL_DT_BF16; break;
        case GGUF_T_Q8_0: t->dtype = MODEL_DT_Q8_0; break;
        case GGUF_T_Q4_0: t->dtype = MODEL_DT_Q4_0; break;
        case GGUF_T_Q4_1: t->dtype = MODEL_DT_Q4_1; break;
        default: return SL_EUNSUP;
        }
        t->ndim = (int)g->ndim;
        for (int i = 0; i < 4; i++) t->ne[i] = g->ne[i];
        t->data = g->data;
        t->nbytes = g->nbytes;
    } else {
        char fn[600];
        name = file_name(m, name, fn, sizeof fn);
        const struct st_tensor *s = st_find(m->st, name);
        if (!s) return 1;
        if (s->ndim > 4) return SL_EUNSUP;
        t->dtype = s->dtype;
        t->ndim = s->ndim;
        for (int i = 0; i < s->ndim; i++) t->ne[i] = s->shape[s->ndim - 1 - i];
        t->data = s->data;
        t->nbytes = s->nbytes;
    }
    t->name = pool_name(m, name);
    return t->name ? 0 : SL_ENOMEM;
}

static char *read_file(const char *path, size_t *len);

/* ---- quantized weights (HF directories) ----------------------------------------- */

/* quantization_config from dir/config.json (kept apart from hf_config: the
 * format of each weight is decided per tensor, the config only cross-checks). */
static int hf_quant_config(model *m, const char *dir, char *err, size_t errlen)
{
    char path[4096];
    snprintf(path, sizeof path, "%s/config.json", dir);
    size_t len = 0;
    char *src = read_file(path, &len);
    if (!src) return 0; /* hf_config already said why */
    int rc = quant_cfg_parse(src, len, &m->qcfg, err, errlen);
    free(src);
    return rc;
}

/* Matrix `name` (a "<module>.weight" name) of an HF checkpoint in whatever
 * form the file holds: dense or packed (model/quant.c decides). */
static int get_weight_st(model *m, const char *name, int64_t rows, int64_t cols, bool optional,
                         struct model_tensor *t, char *err, size_t errlen)
{
    char module[512], fname[600], full[600];
    name = file_name(m, name, full, sizeof full);
    size_t n = strlen(name);
    if (n < 7 || strcmp(name + n - 7, ".weight") != 0 || n - 7 >= sizeof module) {
        sl_seterr(err, errlen, "tensor %s: not a weight name", name);
        return SL_EINVAL;
    }
    memcpy(module, name, n - 7);
    module[n - 7] = 0;
    if (m->n_quants == m->cap_quants) {
        int cap = m->cap_quants ? 2 * m->cap_quants : 64;
        struct model_quant **p = realloc(m->quants, (size_t)cap * sizeof *p);
        if (!p) return SL_ENOMEM;
        m->quants = p;
        m->cap_quants = cap;
    }
    struct model_quant *q = calloc(1, sizeof *q);
    if (!q) return SL_ENOMEM;
    /* nn.Embedding is not nn.Linear, nor is transformers 5's MoE router (a
     * parameter of its TopKRouter): a "Linear" target reaches neither */
    bool linear = strstr(name, "embed_tokens") == NULL && !(n > 16 && strcmp(name + n - 16, ".mlp.gate.weight") == 0);
    /* exports quantize the decoder layers and often leave the MTP layer (or
     * its experts) in bf16 without listing it in ignore: there the file's
     * dense weight is what runs, whatever the config's targets say */
    const struct quant_cfg *qc = m->qcfg;
    if (m->file_decides && qc) {
        const struct st_tensor *d = st_find(m->st, name);
        if (d && (d->dtype == MODEL_DT_BF16 || d->dtype == MODEL_DT_F16 || d->dtype == MODEL_DT_F32)) qc = NULL;
    }
    memset(t, 0, sizeof *t);
    char alias[600];
    const char *claim = m->cfg.arch == MODEL_ARCH_GLM5_NEXT ? glm5_module_path(module, alias, sizeof alias) : module;
    int rc = quant_load_weight_as(m->st, qc, module, claim, linear, rows, cols, t, q, fname, sizeof fname, err,
                                  errlen);
    if (rc != 0 || t->dtype != MODEL_DT_QPACK) free(q);
    if (rc < 0) return rc;
    if (rc == 1) {
        memset(t, 0, sizeof *t);
        if (optional) return 0;
        sl_seterr(err, errlen, "missing tensor %s (nor a quantized form of it)", name);
        return SL_EFORMAT;
    }
    if (t->dtype == MODEL_DT_QPACK) {
        m->quants[m->n_quants++] = q;
        t->quant = q;
    }
    t->name = pool_name(m, fname);
    if (!t->name) return SL_ENOMEM;
    if (t->ne[0] != cols || t->ne[1] != rows) {
        sl_seterr(err, errlen, "tensor %s has shape [%lld, %lld] (ne order), expected [%lld, %lld]", fname,
                  (long long)t->ne[0], (long long)t->ne[1], (long long)cols, (long long)rows);
        return SL_EFORMAT;
    }
    return 0;
}

/* Loads tensor `name` and checks it is [rows][cols] (rows = 0: a vector of
 * cols). optional: absence is fine (t->data stays NULL). */
static int get_tensor(model *m, const char *name, int64_t rows, int64_t cols, bool optional,
                      struct model_tensor *t, char *err, size_t errlen)
{
    size_t nl = strlen(name);
    if (m->st && rows != 0 && nl > 7 && strcmp(name + nl - 7, ".weight") == 0)
        return get_weight_st(m, name, rows, cols, optional, t, err, errlen);
    int rc = find_tensor(m, name, t);
    if (rc < 0) {
        sl_seterr(err, errlen, rc == SL_ENOMEM ? "out of memory" : "tensor %s: unsupported dtype or rank",
               name);
        return rc;
    }
    if (rc == 1) {
        if (optional) return 0;
        sl_seterr(err, errlen, "missing tensor %s", name);
        return SL_EFORMAT;
    }
    bool ok = rows == 0 ? (t->ne[0] == cols && t->ne[1] == 1 && t->ne[2] == 1 && t->ne[3] == 1)
                        : (t->ne[0] == cols && t->ne[1] == rows && t->ne[2] == 1 && t->ne[3] == 1);
    if (!ok) {
        sl_seterr(err, errlen,
               "tensor %s has shape [%lld, %lld, %lld, %lld] (ne order), expected [%lld, %lld]", name,
               (long long)t->ne[0], (long long)t->ne[1], (long long)t->ne[2], (long long)t->ne[3],
               (long long)cols, (long long)(rows ? rows : 1));
        return SL_EFORMAT;
    }
    return 0;
}

int model_loader_weight(model *m, const char *name, int64_t rows, int64_t cols, bool optional,
                        struct model_tensor *t, char *err, size_t errlen)
{
    return get_tensor(m, name, rows, cols, optional, t, err, errlen);
}

int model_loader_tensor(model *m, const char *name, struct model_tensor *t) { return find_tensor(m, name, t); }

/* The keys a config value came from, per format, so an error names what
 * the user can find in the file. */
struct cfg_keys {
    const char *file, *n_layer, *n_embd, *n_ff, *n_head, *n_head_kv, *head_dim, *rope_dim, *n_vocab, *n_ctx, *eps,
        *theta;
};
static const struct cfg_keys hf_keys = {
    "config.json", "num_hidden_layers", "hidden_size", "intermediate_size", "num_attention_heads",
    "num_key_value_heads", "head_dim", "head_dim", "vocab_size", "max_position_embeddings", "rms_norm_eps",
    "rope_theta",
};
static const struct cfg_keys gguf_keys = {
    "GGUF", "block_count", "embedding_length", "feed_forward_length", "attention.head_count",
    "attention.head_count_kv", "attention.key_length", "rope.dimension_count", "token_embd.weight rows",
    "context_length", "attention.layer_norm_rms_epsilon", "rope.freq_base",
};

static int check_config(const struct model_config *c, const struct cfg_keys *k, char *err, size_t errlen)
{
    const struct { const char *key; int v, max; } sizes[] = {
        {k->n_layer, c->n_layer, 100000}, {k->n_embd, c->n_embd, 1 << 20}, {k->n_ff, c->n_ff, 1 << 22},
        {k->n_head, c->n_head, 4096}, {k->n_head_kv, c->n_head_kv, 4096}, {k->head_dim, c->head_dim, 4096},
        {k->rope_dim, c->rope_dim, 4096}, {k->n_vocab, c->n_vocab, 1 << 24}, {k->n_ctx, c->n_ctx_train, 1 << 30},
    };
    for (size_t i = 0; i < sizeof sizes / sizeof *sizes; i++)
        if (sizes[i].v <= 0 || sizes[i].v > sizes[i].max) {
            if (sizes[i].v == 0 && sizes[i].key == k->rope_dim && c->mla.kv_lora_rank > 0) continue; /* no RoPE */
            sl_seterr(err, errlen, "%s: %s is %d, expected 1 to %d", k->file, sizes[i].key, sizes[i].v, sizes[i].max);
            return SL_EFORMAT;
        }
    if (c->n_head % c->n_head_kv != 0) {
        sl_seterr(err, errlen, "%s: %s (%d) must divide %s (%d)", k->file, k->n_head_kv, c->n_head_kv, k->n_head,
                  c->n_head);
        return SL_EFORMAT;
    }
    if (c->head_dim % 2 || c->rope_dim % 2 || c->rope_dim > c->head_dim) {
        sl_seterr(err, errlen, "%s: %s (%d) and %s (%d) must be even, the rotated part at most the head", k->file,
                  k->head_dim, c->head_dim, k->rope_dim, c->rope_dim);
        return SL_EFORMAT;
    }
    if (!(c->norm_eps > 0) || !isfinite(c->norm_eps) || c->norm_eps > 1) {
        sl_seterr(err, errlen, "%s: %s is %g, expected a number in (0, 1]", k->file, k->eps, c->norm_eps);
        return SL_EFORMAT;
    }
    if (!(c->rope_theta > 0) || !isfinite(c->rope_theta)) {
        sl_seterr(err, errlen, "%s: %s is %g, expected a positive number", k->file, k->theta, c->rope_theta);
        return SL_EFORMAT;
    }
    if (c->rope_llama3_factor != 0.0f &&
        (!(c->rope_llama3_factor > 0) || !isfinite(c->rope_llama3_factor) ||
         !(c->rope_llama3_high_freq > c->rope_llama3_low_freq) || !(c->rope_llama3_low_freq > 0) ||
         !isfinite(c->rope_llama3_high_freq) || c->rope_llama3_orig_ctx <= 0)) {
        sl_seterr(err, errlen,
                  "%s: bad llama3 rope scaling (factor %g, low_freq_factor %g, high_freq_factor %g, "
                  "original_max_position_embeddings %d)",
                  k->file, c->rope_llama3_factor, c->rope_llama3_low_freq, c->rope_llama3_high_freq,
                  c->rope_llama3_orig_ctx);
        return SL_EFORMAT;
    }
    return 0;
}

/* Names per format: fmt strings take the layer number. */
struct names {
    const char *tok_embd, *out_norm, *lm_head;
    const char *attn_norm, *wq, *wk, *wv, *wo, *bq, *bk, *bv, *q_norm, *k_norm;
    const char *ffn_norm, *w_gate, *w_up, *w_down;
};
static const struct names gguf_names = {
    "token_embd.weight", "output_norm.weight", "output.weight",
    "blk.%d.attn_norm.weight", "blk.%d.attn_q.weight", "blk.%d.attn_k.weight",
    "blk.%d.attn_v.weight", "blk.%d.attn_output.weight", "blk.%d.attn_q.bias",
    "blk.%d.attn_k.bias", "blk.%d.attn_v.bias", "blk.%d.attn_q_norm.weight",
    "blk.%d.attn_k_norm.weight", "blk.%d.ffn_norm.weight", "blk.%d.ffn_gate.weight",
    "blk.%d.ffn_up.weight", "blk.%d.ffn_down.weight",
};
static const struct names hf_names = {
    "model.embed_tokens.weight", "model.norm.weight", "lm_head.weight",
    "model.layers.%d.input_layernorm.weight", "model.layers.%d.self_attn.q_proj.weight",
    "model.layers.%d.self_attn.k_proj.weight", "model.layers.%d.self_attn.v_proj.weight",
    "model.layers.%d.self_attn.o_proj.weight", "model.layers.%d.self_attn.q_proj.bias",
    "model.layers.%d.self_attn.k_proj.bias", "model.layers.%d.self_attn.v_proj.bias",
    "model.layers.%d.self_attn.q_norm.weight", "model.layers.%d.self_attn.k_norm.weight",
    "model.layers.%d.post_attention_layernorm.weight", "model.layers.%d.mlp.gate_proj.weight",
    "model.layers.%d.mlp.up_proj.weight", "model.layers.%d.mlp.down_proj.weight",
};

static int mla_get(void *ctx, const char *name, int64_t rows, int64_t cols, bool optional, struct model_tensor *t,
                   char *err, size_t errlen)
{
    return get_tensor(ctx, name, rows, cols, optional, t, err, errlen);
}

/* Tensors of the file under prefix: how many and their bytes. */
static int count_prefix(const model *m, const char *prefix, size_t *bytes)
{
    char full[300];
    prefix = file_name(m, prefix, full, sizeof full);
    size_t pl = strlen(prefix);
    int n = 0;
    for (int k = 0; m->st && k < st_n_tensors(m->st); k++) {
        const struct st_tensor *t = st_tensor_at(m->st, k);
        if (strncmp(t->name, prefix, pl) == 0) {
            n++;
            if (bytes) *bytes += t->nbytes;
        }
    }
    return n;
}

/* MTP module i's own parts (model_mtp_weights) from file layer fl, and the
 * count of everything under its prefix. */
static int bind_mtp(model *m, int i, int fl, char *err, size_t errlen)
{
    int64_t E = m->cfg.n_embd;
    struct model_mtp_weights *t = &m->w.mtp[i];
    const struct { const char *suffix; int64_t rows, cols; struct model_tensor *dst; } need[] = {
        {"enorm.weight", 0, E, &t->enorm}, {"hnorm.weight", 0, E, &t->hnorm},
        {"eh_proj.weight", E, 2 * E, &t->eh_proj}, {"shared_head.norm.weight", 0, E, &t->head_norm},
    };
    char name[256], prefix[64];
    for (size_t k = 0; k < sizeof need / sizeof *need; k++) {
        snprintf(name, sizeof name, "model.layers.%d.%s", fl, need[k].suffix);
        int rc = get_tensor(m, name, need[k].rows, need[k].cols, true, need[k].dst, err, errlen);
        if (rc) return rc;
        if (!need[k].dst->data) {
            sl_seterr(err, errlen,
                      "num_nextn_predict_layers is %d but %s is missing (--hf-overrides "
                      "'{\"num_nextn_predict_layers\": 0}' loads the model without its MTP layers)",
                      m->cfg.n_mtp_layer, name);
            return SL_EFORMAT;
        }
    }
    snprintf(prefix, sizeof prefix, "model.layers.%d.", fl);
    m->w.mtp_tensors += count_prefix(m, prefix, &m->w.mtp_bytes);
    return 0;
}

static int kda_find(void *ctx, const char *name, struct model_tensor *t) { return find_tensor(ctx, name, t); }

static int load_weights(model *m, const struct names *nm, char *err, size_t errlen)
{
    struct model_config *c = &m->cfg;
    struct model_weights *w = &m->w;
    int64_t E = c->n_embd, F = c->n_ff, Q = (int64_t)c->n_head * c->head_dim,
            KV = (int64_t)c->n_head_kv * c->head_dim, V = c->n_vocab, D = c->head_dim;
    int rc;
    if ((rc = get_tensor(m, nm->tok_embd, V, E, false, &w->tok_embd, err, errlen))) return rc;
    if ((rc = get_tensor(m, nm->out_norm, 0, E, false, &w->out_norm, err, errlen))) return rc;
    if (c->tie_embeddings) {
        w->lm_head = w->tok_embd;
    } else {
        if ((rc = get_tensor(m, nm->lm_head, V, E, m->gguf != NULL, &w->lm_head, err, errlen)))
            return rc;
        if (!w->lm_head.data) { /* GGUF without output.weight: tied */
            c->tie_embeddings = true;
            w->lm_head = w->tok_embd;
        }
    }
    if (m->gguf) {
        rc = get_tensor(m, "rope_freqs.weight", 0, c->rope_dim / 2, true, &w->rope_freqs, err, errlen);
        if (rc) return rc;
    }
    char name[256];
    if (c->n_mtp_layer > 0) {
        /* exports often drop the MTP layers and keep the config's count: none of
         * them in the file is a model without MTP, part of one is an error */
        snprintf(name, sizeof name, "model.layers.%d.", m->n_layer_file);
        if (count_prefix(m, name, NULL) == 0) {
            fprintf(stderr, "sluice: num_nextn_predict_layers is %d but the checkpoint has no tensor under %s: "
                    "loaded without MTP layers\n", c->n_mtp_layer, name);
            c->n_mtp_layer = 0;
        }
    }
    int n_all = model_n_layer_all(c);
    w->layers = calloc((size_t)n_all, sizeof *w->layers);
    if (c->n_mtp_layer > 0) w->mtp = m->mtp = calloc((size_t)c->n_mtp_layer, sizeof *w->mtp);
    if (!w->layers || (c->n_mtp_layer > 0 && !w->mtp)) {
        sl_seterr(err, errlen, "out of memory");
        return SL_ENOMEM;
    }
    int n_moe = 0;
    for (int l = 0; l < n_all; l++) n_moe += model_layer_kind_of(c, l).ffn == MODEL_FFN_MOE;
    struct model_tensor *ex = NULL;
    if (n_moe) {
        ex = m->moe_experts = calloc((size_t)n_moe * 3 * c->moe.n_expert, sizeof *ex);
        if (!ex) {
            sl_seterr(err, errlen, "out of memory");
            return SL_ENOMEM;
        }
    }
#define T(field, fmt, rows, cols, opt)                                                           \
    do {                                                                                         \
        snprintf(name, sizeof name, fmt, fl);                                                    \
        if ((rc = get_tensor(m, name, rows, cols, opt, &L->field, err, errlen))) goto fail;      \
    } while (0)
    for (int l = 0; l < n_all; l++) {
        struct model_layer_weights *L = &w->layers[l];
        /* an MTP layer's number in the file follows the file's decoder layers */
        int fl = l < c->n_layer ? l : m->n_layer_file + (l - c->n_layer);
        m->file_decides = l >= c->n_layer;
        T(attn_norm, nm->attn_norm, 0, E, false);
        if (model_layer_kind_of(c, l).resid == MODEL_RESID_HC && (rc = glm5_bind_hc(c, l, mla_get, m, L, err, errlen)))
            return rc;
        if (model_layer_kind_of(c, l).mixer == MODEL_MIXER_KDA) {
            char prefix[64];
            snprintf(prefix, sizeof prefix, "model.layers.%d.self_attn", l);
            struct kda_lookup lk = {.get = mla_get, .find = kda_find, .ctx = m};
            if ((rc = kda_bind_layer(&c->kda, c->n_embd, prefix, &lk, &L->kda, err, errlen))) return rc;
            goto ffn;
        }
        if (model_layer_kind_of(c, l).mixer == MODEL_MIXER_MLA) {
            if ((rc = mla_bind_layer(c, l, fl, mla_get, m, &L->mla, err, errlen))) goto fail;
            goto ffn;
        }
        T(wq, nm->wq, Q, E, false);
        T(wk, nm->wk, KV, E, false);
        T(wv, nm->wv, KV, E, false);
        T(wo, nm->wo, E, Q, false);
        if (c->qkv_bias) {
            T(bq, nm->bq, 0, Q, false);
            T(bk, nm->bk, 0, KV, false);
            T(bv, nm->bv, 0, KV, false);
        }
        if (c->qk_norm) {
            T(q_norm, nm->q_norm, 0, D, false);
            T(k_norm, nm->k_norm, 0, D, false);
        }
    ffn:
        T(ffn_norm, nm->ffn_norm, 0, E, false);
        if (model_layer_kind_of(c, l).ffn == MODEL_FFN_MOE) {
            char prefix[64];
            snprintf(prefix, sizeof prefix, "model.layers.%d.mlp", fl);
            if ((rc = moe_bind_layer(m, c, prefix, &L->moe, ex, err, errlen))) goto fail;
            ex += 3 * c->moe.n_expert;
            goto next;
        }
        T(w_gate, nm->w_gate, F, E, false);
        T(w_up, nm->w_up, F, E, false);
        T(w_down, nm->w_down, E, F, false);
    next:
        if (l >= c->n_layer && (rc = bind_mtp(m, l - c->n_layer, fl, err, errlen))) {
            m->file_decides = false;
            return rc; /* its message names the override */
        }
        continue;
    fail:
        m->file_decides = false;
        if (l >= c->n_layer) {
            char why[400];
            snprintf(why, sizeof why, "%s", err);
            sl_seterr(err, errlen, "MTP layer %d: %s (--hf-overrides '{\"num_nextn_predict_layers\": 0}' loads the "
                      "model without its MTP layers)", fl, why);
        }
        return rc;
    }
#undef T
    m->file_decides = false;
    if (c->mla.n_mtp_layers > 0 && m->st)
        return mla_count_mtp(c, m->n_layer_file, m->text_prefix ? m->text_prefix : "model.", m->st, mla_get, m,
                             &w->mtp_tensors, &w->mtp_bytes, err, errlen);
    return 0;
}

static void arch_traits(struct model_config *c)
{
    c->qkv_bias = c->arch == MODEL_ARCH_QWEN2;
    c->qk_norm = c->arch == MODEL_ARCH_QWEN3 || c->arch == MODEL_ARCH_QWEN3_MOE;
}

/* ---- GGUF ------------------------------------------------------------------ */

/* A metadata value that is there but of the wrong type is an error naming
 * the key, never the default: a default would run a different model. */
static int gguf_int(const gguf_file *f, const char *arch, const char *key, int64_t def, bool req,
                    int *out, char *err, size_t errlen)
{
    char k[128];
    int64_t v;
    snprintf(k, sizeof k, "%s.%s", arch, key);
    if (gguf_get_i64(f, k, &v) != 0) {
        if (gguf_find(f, k) >= 0) {
            sl_seterr(err, errlen, "GGUF key %s is not an integer", k);
            return SL_EFORMAT;
        }
        if (req) {
            sl_seterr(err, errlen, "GGUF key %s missing", k);
            return SL_EFORMAT;
        }
        v = def;
    }
    if (v < 0 || v > (1LL << 30)) {
        sl_seterr(err, errlen, "GGUF key %s out of range (%lld)", k, (long long)v);
        return SL_EFORMAT;
    }
    *out = (int)v;
    return 0;
}

static int gguf_float(const gguf_file *f, const char *arch, const char *key, double def, float *out, char *err,
                      size_t errlen)
{
    char k[128];
    double v = def;
    snprintf(k, sizeof k, "%s.%s", arch, key);
    if (gguf_get_f64(f, k, &v) != 0 && gguf_find(f, k) >= 0) {
        sl_seterr(err, errlen, "GGUF key %s is not a floating-point number", k);
        return SL_EFORMAT;
    }
    *out = (float)v;
    return 0;
}

static int load_gguf(model *m, const char *path, char *err, size_t errlen)
{
    m->gguf = gguf_open(path, err, errlen);
    if (!m->gguf) return SL_EFORMAT;
    gguf_file *f = m->gguf;
    struct model_config *c = &m->cfg;
    struct gguf_str s;
    if (gguf_get_str(f, "general.architecture", &s) != 0) {
        sl_seterr(err, errlen, "%s: no general.architecture", path);
        return SL_EFORMAT;
    }
    char arch[64];
    snprintf(arch, sizeof arch, "%.*s", (int)(s.len < 63 ? s.len : 63), s.p);
    if (arch_from_name(s.p, s.len, &c->arch) != 0 || c->arch == MODEL_ARCH_DEEPSEEK_V3 ||
        c->arch == MODEL_ARCH_GLM_MOE_DSA) {
        /* MLA's keys are read from config.json only: such a model loads from its HF directory */
        sl_seterr(err, errlen, "unsupported architecture '%s' in GGUF", arch);
        return SL_EUNSUP;
    }
    int rc;
    if ((rc = gguf_int(f, arch, "block_count", 0, true, &c->n_layer, err, errlen)) ||
        (rc = gguf_int(f, arch, "embedding_length", 0, true, &c->n_embd, err, errlen)) ||
        (rc = gguf_int(f, arch, "feed_forward_length", 0, true, &c->n_ff, err, errlen)) ||
        (rc = gguf_int(f, arch, "attention.head_count", 0, true, &c->n_head, err, errlen)))
        return rc;
    if ((rc = gguf_int(f, arch, "attention.head_count_kv", c->n_head, false, &c->n_head_kv, err,
                       errlen)) ||
        (rc = gguf_int(f, arch, "context_length", 2048, false, &c->n_ctx_train, err, errlen)) ||
        (rc = gguf_int(f, arch, "attention.key_length", c->n_head ? c->n_embd / c->n_head : 0,
                       false, &c->head_dim, err, errlen)) ||
        (rc = gguf_int(f, arch, "rope.dimension_count", c->head_dim, false, &c->rope_dim, err,
                       errlen)))
        return rc;
    if ((rc = gguf_float(f, arch, "attention.layer_norm_rms_epsilon", 1e-5, &c->norm_eps, err, errlen)) ||
        (rc = gguf_float(f, arch, "rope.freq_base", 10000.0, &c->rope_theta, err, errlen)))
        return rc;
    c->rope_type = (c->arch == MODEL_ARCH_LLAMA || c->arch == MODEL_ARCH_MISTRAL) ? MODEL_ROPE_NORM
                                                                                  : MODEL_ROPE_NEOX;
    char k[128];
    snprintf(k, sizeof k, "%s.rope.scaling.type", arch);
    if (gguf_find(f, k) >= 0 && gguf_get_str(f, k, &s) != 0) {
        sl_seterr(err, errlen, "GGUF key %s is not a string", k);
        return SL_EFORMAT;
    }
    if (gguf_get_str(f, k, &s) == 0 && !(s.len == 4 && memcmp(s.p, "none", 4) == 0) &&
        !(s.len == 6 && memcmp(s.p, "llama3", 6) == 0)) {
        sl_seterr(err, errlen, "unsupported rope scaling '%.*s'", (int)(s.len < 32 ? s.len : 32), s.p);
        return SL_EUNSUP;
    }
    const struct gguf_tensor *te = gguf_find_tensor(f, "token_embd.weight");
    c->n_vocab = te && te->ne[1] <= (1 << 30) ? (int)te->ne[1] : 0;
    arch_traits(c);
    c->tie_embeddings = gguf_find_tensor(f, "output.weight") == NULL;
    if ((rc = check_config(c, &gguf_keys, err, errlen))) return rc;
    if ((rc = config_final(m, err, errlen))) return rc;
    if ((rc = load_weights(m, &gguf_names, err, errlen))) return rc;
    if (gguf_find(f, "tokenizer.chat_template") >= 0 && gguf_get_str(f, "tokenizer.chat_template", &s) != 0) {
        sl_seterr(err, errlen, "GGUF key tokenizer.chat_template is not a string");
        return SL_EFORMAT;
    }
    if (gguf_get_str(f, "tokenizer.chat_template", &s) == 0) {
        m->chat_template = strndup(s.p, s.len);
        if (!m->chat_template) return SL_ENOMEM;
    }
    return 0;
}

/* ---- HF directory ------------------------------------------------------------- */

static char *read_file(const char *path, size_t *len)
{
    FILE *fp = fopen(path, "rb");
    if (!fp) return NULL;
    char *buf = NULL;
    long n;
    if (fseek(fp, 0, SEEK_END) != 0 || (n = ftell(fp)) < 0 || n > (1L << 30) ||
        fseek(fp, 0, SEEK_SET) != 0)
        goto done;
    buf = malloc((size_t)n + 1);
    if (!buf) goto done;
    if (fread(buf, 1, (size_t)n, fp) != (size_t)n) {
        free(buf);
        buf = NULL;
        goto done;
    }
    buf[n] = 0;
    *len = (size_t)n;
done:
    fclose(fp);
    return buf;
}

/* config.json values: absent or null takes the default; present with the
 * wrong type or out of range is an error naming the key (a default in its
 * place would run a different model than the checkpoint describes). */
static int jint(const json_doc *d, int obj, const char *key, int def, bool req, int *out,
                char *err, size_t errlen)
{
    int i = obj < 0 ? -1 : json_get(d, obj, key);
    int64_t v = def;
    if (i < 0 || json_is_null(d, i)) {
        if (req) {
            sl_seterr(err, errlen, "config.json: missing %s", key);
            return SL_EFORMAT;
        }
    } else if (!json_is_num(d, i) || json_i64(d, i, &v) != 0) {
        size_t n = 0;
        const char *raw = json_raw(d, i, &n);
        sl_seterr(err, errlen, "config.json: %s must be an integer, got %.*s", key, (int)(n < 40 ? n : 40), raw);
        return SL_EFORMAT;
    } else if (v < 0 || v > (1LL << 30)) {
        sl_seterr(err, errlen, "config.json: %s is %lld, expected 0 to %d", key, (long long)v, 1 << 30);
        return SL_EFORMAT;
    }
    *out = (int)v;
    return 0;
}

static int jflt(const json_doc *d, int obj, const char *key, double def, float *out, char *err, size_t errlen)
{
    int i = obj < 0 ? -1 : json_get(d, obj, key);
    double v = def;
    if (i >= 0 && !json_is_null(d, i) && (!json_is_num(d, i) || json_f64(d, i, &v) != 0 || !isfinite(v))) {
        size_t n = 0;
        const char *raw = json_raw(d, i, &n);
        sl_seterr(err, errlen, "config.json: %s must be a number, got %.*s", key, (int)(n < 40 ? n : 40), raw);
        return SL_EFORMAT;
    }
    *out = (float)v;
    return 0;
}

static int jbool(const json_doc *d, int obj, const char *key, bool def, bool *out, char *err, size_t errlen)
{
    int i = json_get(d, obj, key);
    *out = def;
    if (i >= 0 && !json_is_null(d, i) && (!json_is_bool(d, i) || json_bool(d, i, out) != 0)) {
        sl_seterr(err, errlen, "config.json: %s must be true or false", key);
        return SL_EFORMAT;
    }
    return 0;
}

/* An optional object member: -1 when absent or null; -2 (error written) when
 * it is something else. */
static int jobj(const json_doc *d, int obj, const char *key, char *err, size_t errlen)
{
    int i = json_get(d, obj, key);
    if (i < 0 || json_is_null(d, i)) return -1;
    if (json_is_obj(d, i)) return i;
    sl_seterr(err, errlen, "config.json: %s must be an object", key);
    return -2;
}

static int hf_config(model *m, const char *dir, char *err, size_t errlen)
{
    char path[4096];
    snprintf(path, sizeof path, "%s/config.json", dir);
    size_t len = 0;
    char *src = read_file(path, &len);
    if (!src) {
        sl_seterr(err, errlen, "%s: cannot read (%s)", path, strerror(errno));
        return SL_EIO;
    }
    json_doc d;
    char jerr[200];
    int rc = json_parse(&d, src, len, jerr, sizeof jerr);
    if (rc) {
        sl_seterr(err, errlen, "%s: %s", path, jerr);
        free(src);
        return SL_EFORMAT;
    }
    struct model_config *c = &m->cfg;
    rc = SL_EFORMAT;
    int o = 0; /* the object holding the text model's keys */
    int mt = json_get(&d, 0, "model_type");
    size_t n = 0;
    const char *s = mt >= 0 && json_is_str(&d, mt) ? json_raw(&d, mt, &n) : NULL;
    if (!s) {
        sl_seterr(err, errlen, "%s: no model_type", path);
        goto out;
    }
    if (arch_from_name(s, n, &c->arch) != 0) {
        sl_seterr(err, errlen, "unsupported architecture '%.*s'", (int)(n < 64 ? n : 64), s);
        rc = SL_EUNSUP;
        goto out;
    }
    /* a multimodal config (glm5_next) nests the text model's keys in text_config */
    if (c->arch == MODEL_ARCH_GLM5_NEXT) {
        int tc = jobj(&d, 0, "text_config", err, errlen);
        if (tc == -2) goto out;
        if (tc >= 0) o = tc;
    }
    if ((rc = jint(&d, o, "num_hidden_layers", 0, true, &c->n_layer, err, errlen)) ||
        (rc = jint(&d, o, "hidden_size", 0, true, &c->n_embd, err, errlen)) ||
        (rc = jint(&d, o, "intermediate_size", 0, true, &c->n_ff, err, errlen)) ||
        (rc = jint(&d, o, "num_attention_heads", 0, true, &c->n_head, err, errlen)) ||
        (rc = jint(&d, o, "vocab_size", 0, true, &c->n_vocab, err, errlen)) ||
        (rc = jint(&d, o, "num_key_value_heads", c->n_head, false, &c->n_head_kv, err, errlen)) ||
        (rc = jint(&d, o, "max_position_embeddings", 2048, false, &c->n_ctx_train, err, errlen)) ||
        (rc = jint(&d, o, "head_dim", c->n_head ? c->n_embd / c->n_head : 0, false, &c->head_dim,
                   err, errlen)))
        goto out;
    int act = json_get(&d, o, "hidden_act");
    if (act >= 0 && !json_is_null(&d, act) && !json_is_str(&d, act)) {
        sl_seterr(err, errlen, "config.json: hidden_act must be a string");
        rc = SL_EFORMAT;
        goto out;
    }
    rc = SL_EUNSUP;
    if (act >= 0 && !json_is_null(&d, act) && !json_str_eq(&d, act, "silu")) {
        sl_seterr(err, errlen, "unsupported hidden_act (only silu)");
        goto out;
    }
    bool attn_bias, mlp_bias;
    if ((rc = jbool(&d, o, "attention_bias", false, &attn_bias, err, errlen)) ||
        (rc = jbool(&d, o, "mlp_bias", false, &mlp_bias, err, errlen)))
        goto out;
    if ((c->arch == MODEL_ARCH_LLAMA || c->arch == MODEL_ARCH_MISTRAL || c->arch == MODEL_ARCH_QWEN3 ||
         c->arch == MODEL_ARCH_QWEN3_MOE || c->arch == MODEL_ARCH_GLM4_MOE) &&
        (c->arch == MODEL_ARCH_GLM4_MOE ? mlp_bias : attn_bias || mlp_bias)) {
        sl_seterr(err, errlen, "unsupported: attention_bias/mlp_bias in a %s checkpoint",
               model_arch_name(c->arch));
        rc = SL_EUNSUP;
        goto out;
    }
    c->rope_dim = c->head_dim;
    if ((rc = jflt(&d, o, "rms_norm_eps", 1e-6, &c->norm_eps, err, errlen))) goto out;
    /* transformers < 5: rope_theta + rope_scaling; >= 5: rope_parameters */
    rc = SL_EFORMAT;
    int rp = jobj(&d, o, "rope_parameters", err, errlen), rs = jobj(&d, o, "rope_scaling", err, errlen);
    if (rp == -2 || rs == -2) goto out;
    if ((rc = jflt(&d, o, "rope_theta", 10000.0, &c->rope_theta, err, errlen)) ||
        (rc = jflt(&d, rp, "rope_theta", c->rope_theta, &c->rope_theta, err, errlen)))
        goto out;
    if (rs < 0) rs = rp;
    if (rs >= 0) {
        int t = json_get(&d, rs, "rope_type");
        if (t < 0) t = json_get(&d, rs, "type");
        if (t >= 0 && !json_is_null(&d, t) && !json_is_str(&d, t)) {
            sl_seterr(err, errlen, "config.json: rope_type must be a string");
            rc = SL_EFORMAT;
            goto out;
        }
        if (t >= 0 && json_str_eq(&d, t, "llama3")) {
            float orig = 8192;
            if ((rc = jflt(&d, rs, "factor", 0, &c->rope_llama3_factor, err, errlen)) ||
                (rc = jflt(&d, rs, "low_freq_factor", 1.0, &c->rope_llama3_low_freq, err, errlen)) ||
                (rc = jflt(&d, rs, "high_freq_factor", 4.0, &c->rope_llama3_high_freq, err, errlen)) ||
                (rc = jflt(&d, rs, "original_max_position_embeddings", 8192, &orig, err, errlen)))
                goto out;
            c->rope_llama3_orig_ctx = orig > 0 && orig < 1e9f ? (int)orig : 0;
            if (c->rope_llama3_factor <= 0) {
                sl_seterr(err, errlen, "config.json: llama3 rope scaling without factor");
                rc = SL_EFORMAT;
                goto out;
            }
        } else if (t >= 0 && json_str_eq(&d, t, "yarn") &&
                   (c->arch == MODEL_ARCH_DEEPSEEK_V3 || c->arch == MODEL_ARCH_GLM_MOE_DSA)) {
            /* mla_hf_config reads it */
        } else if (t >= 0 && !json_is_null(&d, t) && !json_str_eq(&d, t, "default")) {
            size_t tn = 0;
            const char *ts = json_raw(&d, t, &tn);
            sl_seterr(err, errlen, "unsupported rope scaling '%.*s'", (int)(tn < 32 ? tn : 32),
                   ts ? ts : "");
            rc = SL_EUNSUP;
            goto out;
        }
    }
    /* Sliding-window attention is not implemented: cap the context at the
     * window, where full attention is exactly the same thing. */
    bool use_sw = c->arch == MODEL_ARCH_MISTRAL || c->arch == MODEL_ARCH_LLAMA;
    int win = 0;
    if ((rc = jbool(&d, o, "use_sliding_window", use_sw, &use_sw, err, errlen)) ||
        (rc = jint(&d, o, "sliding_window", 0, false, &win, err, errlen)))
        goto out;
    if (use_sw && win > 0 && win < c->n_ctx_train) c->n_ctx_train = win;
    c->rope_type = MODEL_ROPE_NEOX;
    arch_traits(c);
    if (c->arch == MODEL_ARCH_QWEN2_MOE &&
        (rc = jbool(&d, o, "qkv_bias", true, &c->qkv_bias, err, errlen)))
        goto out;
    if (c->arch == MODEL_ARCH_GLM4_MOE) {
        /* q/k/v biases and q/k norms are switches here; RoPE turns the first
         * partial_rotary_factor of each head (its default 0.5) */
        float prf = 0.5f;
        c->qkv_bias = attn_bias;
        if ((rc = jbool(&d, o, "use_qk_norm", false, &c->qk_norm, err, errlen)) ||
            (rc = jflt(&d, o, "partial_rotary_factor", prf, &prf, err, errlen)) ||
            (rc = jflt(&d, rp, "partial_rotary_factor", prf, &prf, err, errlen)))
            goto out;
        if (!(prf > 0 && prf <= 1)) {
            sl_seterr(err, errlen, "config.json: partial_rotary_factor is %g, expected (0, 1]", prf);
            rc = SL_EFORMAT;
            goto out;
        }
        c->rope_dim = (int)(c->head_dim * prf);
    }
    if ((rc = jbool(&d, o, "tie_word_embeddings", false, &c->tie_embeddings, err, errlen))) goto out;
    if ((c->arch == MODEL_ARCH_DEEPSEEK_V3 || c->arch == MODEL_ARCH_GLM_MOE_DSA || c->arch == MODEL_ARCH_GLM5_NEXT) &&
        (rc = mla_hf_config(&d, o, rs, c, &m->index_full, err, errlen)))
        goto out;
    if ((rc = check_config(c, &hf_keys, err, errlen))) goto out;
    /* the MTP modules after the decoder layers (transformers: num_mtp_layers); glm5_next's are
     * mla.n_mtp_layers (mla_hf_config), counted, not run */
    if ((c->arch == MODEL_ARCH_DEEPSEEK_V3 || c->arch == MODEL_ARCH_GLM_MOE_DSA || c->arch == MODEL_ARCH_GLM4_MOE) &&
        (rc = jint(&d, 0, "num_nextn_predict_layers", 0, false, &c->n_mtp_layer, err, errlen)))
        goto out;
    if (c->n_mtp_layer > 64) {
        sl_seterr(err, errlen, "config.json: num_nextn_predict_layers is %d, expected 0 to 64", c->n_mtp_layer);
        rc = SL_EFORMAT;
        goto out;
    }
    if (c->arch == MODEL_ARCH_GLM5_NEXT) {
        if ((rc = glm5_hf_config(&d, o, c, &m->kda_layer, err, errlen))) goto out;
        m->n_kda_layer = c->n_layer;
    }
    rc = moe_hf_config(&d, o, c, &m->moe_sparse, err, errlen);
    m->n_moe_sparse = c->n_layer;
out:
    json_free(&d);
    free(src);
    return rc;
}

/* chat_template from tokenizer_config.json (string, or a list of
 * {name, template}: the "default" one), else chat_template.jinja. */
static int hf_chat_template(model *m, const char *dir)
{
    char path[4096];
    size_t len = 0;
    snprintf(path, sizeof path, "%s/tokenizer_config.json", dir);
    char *src = read_file(path, &len);
    if (src) {
        json_doc d;
        char jerr[64];
        if (json_parse(&d, src, len, jerr, sizeof jerr) == 0) {
            int t = json_get(&d, 0, "chat_template");
            if (t >= 0 && json_is_arr(&d, t)) {
                int pick = -1;
                for (int k = 0; k < json_size(&d, t); k++) {
                    int e = json_at(&d, t, k), nm = json_get(&d, e, "name");
                    if (pick < 0 || (nm >= 0 && json_str_eq(&d, nm, "default")))
                        pick = json_get(&d, e, "template");
                }
                t = pick;
            }
            if (t >= 0 && json_is_str(&d, t)) m->chat_template = json_strdup(&d, t, NULL);
            json_free(&d);
        }
        free(src);
        if (m->chat_template) return 0;
    }
    snprintf(path, sizeof path, "%s/chat_template.jinja", dir);
    m->chat_template = read_file(path, &len);
    return 0;
}

/* The weights of an HF directory whose config hf_config() read (and the plan
 * decided). */
static int load_hf(model *m, const char *dir, bool dummy, char *err, size_t errlen)
{
    int rc = hf_config(m, dir, err, errlen);
    if (rc) return rc;
    if ((rc = config_final(m, err, errlen))) return rc;
    if ((rc = hf_quant_config(m, dir, err, errlen))) return rc;
    if (dummy) return model_dummy_weights(&m->cfg, m->qcfg, &m->w, &m->dummy, err, errlen);
    m->st = st_open_dir(dir, err, errlen);
    if (!m->st) return SL_EFORMAT;
    if (st_find(m->st, "model.language_model.embed_tokens.weight")) {
        /* a multimodal checkpoint (glm5_next): the text model and, beside it, a vision tower sluice does
         * not run; the file decides, not the config */
        m->text_prefix = "model.language_model.";
        int nv = 0;
        size_t vb = 0;
        for (int k = 0; k < st_n_tensors(m->st); k++) {
            const struct st_tensor *t = st_tensor_at(m->st, k);
            if (strncmp(t->name, "model.language_model.", 21) != 0 && strcmp(t->name, "lm_head.weight") != 0 &&
                strncmp(t->name, "lm_head.", 8) != 0)
                nv++, vb += t->nbytes;
        }
        if (nv > 0)
            fprintf(stderr, "sluice: %s: the vision tower (%d tensors, %.2f MB beside model.language_model.) is not "
                            "loaded: sluice serves the text model\n", dir, nv, vb / 1e6);
    }
    if ((rc = load_weights(m, &hf_names, err, errlen))) return rc;
    return hf_chat_template(m, dir);
}

/* ---- public --------------------------------------------------------------------- */

#define TENSORS_PER_LAYER 52 /* at most, in all_tensors */
/* How many tensors all_tensors() may list. */
static int max_tensors(const model *m)
{
    int n = 4 + TENSORS_PER_LAYER * model_n_layer_all(&m->cfg) + 4 * m->cfg.n_mtp_layer;
    for (int l = 0; l < model_n_layer_all(&m->cfg); l++)
        if (model_layer_kind_of(&m->cfg, l).ffn == MODEL_FFN_MOE) n += 6 + 3 * m->cfg.moe.n_expert;
    return n;
}

static void all_tensors(const model *m, const struct model_tensor **out, int *n)
{
    const struct model_weights *w = &m->w;
    int k = 0;
    out[k++] = &w->tok_embd;
    out[k++] = &w->out_norm;
    if (!m->cfg.tie_embeddings) out[k++] = &w->lm_head;
    for (int i = 0; i < m->cfg.n_mtp_layer && w->mtp; i++) {
        out[k++] = &w->mtp[i].enorm;
        out[k++] = &w->mtp[i].hnorm;
        out[k++] = &w->mtp[i].eh_proj;
        out[k++] = &w->mtp[i].head_norm;
    }
    for (int l = 0; l < model_n_layer_all(&m->cfg); l++) {
        const struct model_layer_weights *L = &w->layers[l];
        const struct model_mla_weights *A = &L->mla;
        const struct model_tensor *t[] = {&L->attn_norm, &L->wq, &L->wk, &L->wv, &L->wo,
                                          &L->bq, &L->bk, &L->bv, &L->q_norm, &L->k_norm,
                                          &A->q_a, &A->q_a_norm, &A->q_b, &A->q, &A->kv_a, &A->kv_a_norm,
                                          &A->kv_b, &A->o, &A->ix_wq_b, &A->ix_wk, &A->ix_k_norm,
                                          &A->ix_k_norm_b, &A->ix_weights, &A->ix_kpool_ape, &A->ix_kpool_gate,
                                          &L->ffn_norm, &L->w_gate, &L->w_up, &L->w_down,
                                          &L->hc_attn.fn, &L->hc_attn.base, &L->hc_attn.scale,
                                          &L->hc_ffn.fn, &L->hc_ffn.base, &L->hc_ffn.scale,
                                          &L->kda.q, &L->kda.k, &L->kda.v, &L->kda.conv[0], &L->kda.conv[1],
                                          &L->kda.conv[2], &L->kda.f_a, &L->kda.f_b, &L->kda.dt_bias, &L->kda.A_log,
                                          &L->kda.b, &L->kda.g_a, &L->kda.g_b, &L->kda.o_norm, &L->kda.o};
        for (size_t i = 0; i < sizeof t / sizeof t[0]; i++)
            if (t[i]->data) out[k++] = t[i];
        if (model_layer_kind_of(&m->cfg, l).ffn != MODEL_FFN_MOE) continue;
        const struct model_moe_weights *mw = &L->moe;
        const struct model_tensor *s[] = {&mw->router, &mw->router_bias, &mw->sh_gate, &mw->sh_up, &mw->sh_down,
                                          &mw->sh_weigh};
        for (size_t i = 0; i < sizeof s / sizeof s[0]; i++)
            if (s[i]->data) out[k++] = s[i];
        for (int e = 0; e < m->cfg.moe.n_expert; e++) {
            out[k++] = &mw->gate[e];
            out[k++] = &mw->up[e];
            out[k++] = &mw->down[e];
        }
    }
    *n = k;
}

size_t model_weight_bytes(const model *m)
{
    int cap = max_tensors(m), n = 0;
    const struct model_tensor **ts = malloc((size_t)cap * sizeof *ts);
    size_t sum = m->w.mtp_bytes;
    if (!ts) return sum;
    all_tensors(m, ts, &n);
    for (int i = 0; i < n; i++) {
        const struct model_tensor *t = ts[i];
        if (t->dtype != MODEL_DT_QPACK || !t->quant) {
            sum += t->nbytes;
            continue;
        }
        /* a packed weight: its codes, plus a scale (and zero) per group and row */
        const struct model_quant *q = t->quant;
        size_t sb = q->scale_dt == MODEL_DT_F32 ? 4 : 2;
        sum += (size_t)(q->rows * q->cols * q->bits / 8) + (size_t)(q->rows * q->n_groups) * sb +
               (q->sym ? 0 : (size_t)(q->rows * q->n_groups * q->bits / 8)) + (q->g_idx ? (size_t)q->cols * 4 : 0);
    }
    free(ts);
    return sum;
}

int model_check_weights(const model *m, char *err, size_t errlen)
{
    int cap = max_tensors(m), n = 0;
    const struct model_tensor **ts = malloc((size_t)cap * sizeof *ts);
    if (!ts) {
        sl_seterr(err, errlen, "out of memory");
        return SL_ENOMEM;
    }
    all_tensors(m, ts, &n);
    if (m->w.rope_freqs.data) ts[n++] = &m->w.rope_freqs;
    /* per tensor: the first bad element, or -1; the lowest tensor is reported */
    int64_t *bad = malloc((size_t)n * sizeof *bad);
    float *badv = malloc((size_t)n * sizeof *badv);
    int rc = 0;
    if (!bad || !badv) {
        sl_seterr(err, errlen, "out of memory");
        rc = SL_ENOMEM;
        goto done;
    }
    enum { CHUNK = 1 << 16 }; /* a multiple of every quantized block (32) */
#pragma omp parallel
    {
        float *buf = malloc(CHUNK * sizeof *buf);
#pragma omp for schedule(dynamic, 1)
        for (int i = 0; i < n; i++) {
            bad[i] = -1;
            int64_t ne = model_tensor_nelem(ts[i]);
            for (int64_t at = 0; buf && at < ne && bad[i] < 0; at += CHUNK) {
                int64_t k = ne - at < CHUNK ? ne - at : CHUNK;
                model_tensor_to_f32(ts[i], at, k, buf);
                for (int64_t j = 0; j < k; j++)
                    if (!isfinite(buf[j])) {
                        bad[i] = at + j;
                        badv[i] = buf[j];
                        break;
                    }
            }
            if (!buf) bad[i] = -2;
        }
        free(buf);
    }
    for (int i = 0; i < n && !rc; i++) {
        if (bad[i] == -2) {
            sl_seterr(err, errlen, "out of memory");
            rc = SL_ENOMEM;
        } else if (bad[i] >= 0) {
            sl_seterr(err, errlen, "tensor %s holds %s at element %lld of %lld (%s): the weights are damaged",
                      ts[i]->name, isnan(badv[i]) ? "NaN" : "an infinity", (long long)bad[i],
                      (long long)model_tensor_nelem(ts[i]), model_dtype_name(ts[i]->dtype));
            rc = SL_EFORMAT;
        }
    }
done:
    free(bad);
    free(badv);
    free(ts);
    return rc;
}

/* Faults the mapped weights in, printing progress: only worth it (and only
 * done) for big models, so a user sees the load move. */
static void prefault_progress(const model *m)
{
    int cap = max_tensors(m), n = 0;
    const struct model_tensor **ts = malloc((size_t)cap * sizeof *ts);
    if (!ts) return;
    all_tensors(m, ts, &n);
    size_t total = 0, done = 0;
    for (int i = 0; i < n; i++) total += ts[i]->nbytes;
    if (total < ((size_t)1 << 30)) {
        free(ts);
        return;
    }
    size_t next = total / 10;
    volatile unsigned char sink = 0;
    for (int i = 0; i < n; i++) {
        const unsigned char *p = ts[i]->data;
        for (size_t o = 0; o < ts[i]->nbytes; o += 4096) sink ^= p[o];
        done += ts[i]->nbytes;
        if (done >= next || i == n - 1) {
            fprintf(stderr, "loading: %d/%d tensors, %.2f/%.2f GB\n", i + 1, n, done / 1e9,
                    total / 1e9);
            next += total / 10;
        }
    }
    (void)sink;
    free(ts);
}

/* Whether name looks like a Hugging Face repository id ("org/name"). */
static bool hf_id_like(const char *name)
{
    const char *sl = strchr(name, '/');
    if (!sl || strchr(sl + 1, '/') || sl == name || !sl[1] || name[0] == '.') return false;
    for (const char *p = name; *p; p++)
        if (!(isalnum((unsigned char)*p) || strchr("._-/", *p))) return false;
    return true;
}

/* The local Hugging Face hub cache, as huggingface_hub finds it: HF_HUB_CACHE,
 * else HF_HOME/hub, else XDG_CACHE_HOME/huggingface/hub, else
 * ~/.cache/huggingface/hub. */
static void hf_hub_dir(char *out, size_t cap)
{
    const char *v;
    if ((v = getenv("HF_HUB_CACHE")) && *v) snprintf(out, cap, "%s", v);
    else if ((v = getenv("HF_HOME")) && *v) snprintf(out, cap, "%s/hub", v);
    else if ((v = getenv("XDG_CACHE_HOME")) && *v) snprintf(out, cap, "%s/huggingface/hub", v);
    else snprintf(out, cap, "%s/.cache/huggingface/hub", (v = getenv("HOME")) && *v ? v : ".");
}

/* A repository id found in the local Hugging Face cache: its snapshot of
 * refs/main (else the only or newest snapshot) into out; a snapshot holding
 * no config.json but one .gguf file gives that file. Nothing is downloaded.
 * 0, or -1 with err saying where it looked. */
static int hf_cache_resolve(const char *id, char *out, size_t cap, char *err, size_t errlen)
{
    char hub[PATH_MAX], repo[PATH_MAX + 300], rev[256] = "";
    hf_hub_dir(hub, sizeof hub);
    snprintf(repo, sizeof repo, "%s/models--", hub);
    for (const char *p = id; *p && strlen(repo) + 3 < sizeof repo; p++) {
        size_t n = strlen(repo);
        if (*p == '/') snprintf(repo + n, sizeof repo - n, "--");
        else repo[n] = *p, repo[n + 1] = '\0';
    }
    char ref[PATH_MAX + 400];
    snprintf(ref, sizeof ref, "%s/refs/main", repo);
    FILE *f = fopen(ref, "r");
    if (f) {
        if (!fgets(rev, sizeof rev, f)) rev[0] = '\0';
        fclose(f);
        rev[strcspn(rev, " \r\n")] = '\0';
    }
    char snaps[PATH_MAX + 400];
    snprintf(snaps, sizeof snaps, "%s/snapshots", repo);
    if (!rev[0] || strchr(rev, '/')) { /* no refs/main: the newest snapshot */
        DIR *d = opendir(snaps);
        double newest = -1;
        for (struct dirent *e = d ? readdir(d) : NULL; e; e = readdir(d)) {
            char p[PATH_MAX + 700];
            struct stat st;
            if (e->d_name[0] == '.' || strlen(e->d_name) >= sizeof rev) continue;
            snprintf(p, sizeof p, "%s/%s", snaps, e->d_name);
            if (stat(p, &st) || !S_ISDIR(st.st_mode) || (double)st.st_mtime <= newest) continue;
            newest = (double)st.st_mtime;
            snprintf(rev, sizeof rev, "%s", e->d_name);
        }
        if (d) closedir(d);
    }
    struct stat st;
    snprintf(out, cap, "%s/%s", snaps, rev);
    if (!rev[0] || stat(out, &st) || !S_ISDIR(st.st_mode)) {
        sl_seterr(err, errlen,
                  "'%s' is not a file or directory, and the Hugging Face cache has no snapshot of it (looked in %s); "
                  "sluice downloads nothing: fetch it first (`hf download %s`), or give a local path",
                  id, repo, id);
        return -1;
    }
    char cfg[PATH_MAX + 1000];
    snprintf(cfg, sizeof cfg, "%s/config.json", out);
    if (stat(cfg, &st) == 0) return 0;
    DIR *d = opendir(out); /* a GGUF repository: its one .gguf file */
    int n = 0;
    char one[PATH_MAX] = "";
    for (struct dirent *e = d ? readdir(d) : NULL; e; e = readdir(d)) {
        size_t l = strlen(e->d_name);
        if (l > 5 && !strcmp(e->d_name + l - 5, ".gguf")) n++, snprintf(one, sizeof one, "%s", e->d_name);
    }
    if (d) closedir(d);
    if (n == 1) {
        size_t l = strlen(out);
        snprintf(out + l, cap - l, "/%s", one);
        return 0;
    }
    if (n > 1) {
        sl_seterr(err, errlen, "the cached snapshot %s holds %d .gguf files: give the one to serve as a path", out, n);
        return -1;
    }
    return 0; /* load_hf names what is missing */
}

model *model_load(const char *path, const struct model_load_opts *opts, char *err, size_t errlen)
{
    if (!path) {
        sl_seterr(err, errlen, "no model path");
        return NULL;
    }
    model *m = calloc(1, sizeof *m);
    if (!m) {
        sl_seterr(err, errlen, "out of memory");
        return NULL;
    }
    struct stat st;
    char cached[PATH_MAX + 800];
    if (stat(path, &st) != 0 && errno == ENOENT && hf_id_like(path)) {
        if (hf_cache_resolve(path, cached, sizeof cached, err, errlen)) goto fail;
        path = cached;
    }
    if (stat(path, &st) != 0) {
        sl_seterr(err, errlen, "%s: %s", path, strerror(errno));
        goto fail;
    }
    bool dir = S_ISDIR(st.st_mode);
    const char *lf = opts && opts->load_format ? opts->load_format : "auto";
    bool dummy = strcmp(lf, "dummy") == 0;
    if (!dummy && strcmp(lf, "auto") != 0) {
        sl_seterr(err, errlen, "unknown load format '%s' (expected auto or dummy)", lf);
        goto fail;
    }
    if (dummy && !dir) {
        sl_seterr(err, errlen, "--load-format dummy takes a directory holding a config.json");
        goto fail;
    }
    m->hf_overrides = opts ? opts->hf_overrides : NULL;
    if ((dir ? load_hf(m, path, dummy, err, errlen) : load_gguf(m, path, err, errlen)) != 0) goto fail;
    m->hf_overrides = NULL;

    char terr[256] = "";
    const char *tp = opts && opts->tokenizer ? opts->tokenizer : NULL;
    if (!tp) {
        m->tok = dir ? model_tok_from_hf_dir(path, terr, sizeof terr)
                     : model_tok_from_gguf(m->gguf, terr, sizeof terr);
    } else if (stat(tp, &st) == 0 && S_ISDIR(st.st_mode)) {
        m->tok = model_tok_from_hf_dir(tp, terr, sizeof terr);
    } else {
        gguf_file *tf = gguf_open(tp, terr, sizeof terr);
        if (tf) {
            m->tok = model_tok_from_gguf(tf, terr, sizeof terr);
            gguf_close(tf);
        }
    }
    if (!m->tok) {
        sl_seterr(err, errlen, "tokenizer (%s): %s", tp ? tp : path, terr);
        goto fail;
    }
    /* A token the embedding has no row for would be found at the first
     * request that uses it, deep in the forward pass; a smaller tokenizer
     * is fine (embeddings are often padded to a round size). */
    if (model_tok_n_vocab(m->tok) > m->cfg.n_vocab) {
        sl_seterr(err, errlen,
                  "the tokenizer (%s) has %d tokens but the model's vocabulary has %d (%s): token ids from %d up "
                  "would have no embedding row",
                  tp ? tp : path, model_tok_n_vocab(m->tok), m->cfg.n_vocab,
                  dir ? "config.json vocab_size" : "token_embd.weight rows", m->cfg.n_vocab);
        goto fail;
    }
    if (opts && opts->progress && !dummy) prefault_progress(m); /* dummy views share one pool: nothing to fault */
    if (opts && opts->check_weights && !dummy && model_check_weights(m, err, errlen)) goto fail;
    return m;
fail:
    model_free(m);
    return NULL;
}

void model_free(model *m)
{
    if (!m) return;
    if (m->tok) model_tok_free(m->tok);
    free(m->chat_template);
    free(m->w.layers);
    free(m->layer_kind);
    free(m->index_full);
    free(m->moe_sparse);
    free(m->kda_layer);
    free(m->moe_experts);
    free(m->mtp);
    model_dummy_free(m->dummy);
    for (int i = 0; i < m->n_names; i++) free(m->names[i]);
    free(m->names);
    for (int i = 0; i < m->n_quants; i++) free(m->quants[i]);
    free(m->quants);
    quant_cfg_free(m->qcfg);
    if (m->gguf) gguf_close(m->gguf);
    if (m->st) st_close(m->st);
    free(m);
}

const struct model_config *model_get_config(const model *m) { return &m->cfg; }
const struct model_weights *model_get_weights(const model *m) { return &m->w; }
const model_tok *model_get_tok(const model *m) { return m->tok; }
const char *model_chat_template(const model *m) { return m->chat_template; }

double model_attn_pair_cost(const struct model_config *c)
{
    /* per layer: QK^T and PV are 2 * head_dim multiply-adds per query head
     * and key; the projections Q|K|V, O and gate|up|down are one
     * multiply-add per weight per token */
    double q = (double)c->n_head * c->head_dim, kv = (double)c->n_head_kv * c->head_dim, e = c->n_embd;
    double ff = c->n_ff;
    if (c->layer_kind && c->n_layer > 0) { /* MoE layers: the experts a token runs, averaged over layers */
        double sum = 0;
        for (int l = 0; l < c->n_layer; l++)
            sum += c->layer_kind[l].ffn == MODEL_FFN_MOE
                       ? (double)c->moe.n_expert_used * c->moe.n_ff_expert + c->moe.n_ff_shared
                       : c->n_ff;
        ff = sum / c->n_layer;
    }
    double proj = e * (q + 2.0 * kv) + q * e + 3.0 * e * ff;
    const struct model_mla_config *a = &c->mla;
    if (a->kv_lora_rank > 0) {
        /* MLA prefill (the expanded form): q.k over nope + rope and p.v over v_head_dim per head; the
         * projections q (through q_lora or not), kv_a, o and the MLP per token */
        double H = c->n_head, dq = a->qk_nope_head_dim + a->qk_rope_head_dim, ql = a->q_lora_rank;
        double pq = ql > 0 ? e * ql + ql * H * dq : e * H * dq;
        proj = pq + e * (a->kv_lora_rank + a->qk_rope_head_dim) + H * a->v_head_dim * e + 3.0 * e * ff;
        return proj > 0 ? H * (dq + a->v_head_dim) / proj : 0.0;
    }
    return proj > 0 ? 2.0 * q / proj : 0.0;
}

/* transformers' _compute_yarn_parameters for frequency i of a dim-wide rope */
static double yarn_inv_freq(const struct model_mla_config *a, double base, int dim, int i)
{
    double pos = pow(base, 2.0 * i / dim), extra = 1.0 / pos, inter = 1.0 / (a->yarn_factor * pos);
    double lo = dim * log(a->yarn_orig_ctx / (a->yarn_beta_fast * 2 * M_PI)) / (2 * log(base)),
           hi = dim * log(a->yarn_orig_ctx / (a->yarn_beta_slow * 2 * M_PI)) / (2 * log(base));
    if (a->yarn_truncate) {
        lo = floor(lo);
        hi = ceil(hi);
    }
    if (lo < 0) lo = 0;
    if (hi > dim - 1) hi = dim - 1;
    if (lo == hi) hi += 0.001;
    double ramp = (i - lo) / (hi - lo);
    ramp = ramp < 0 ? 0 : ramp > 1 ? 1 : ramp;
    double ex = 1.0 - ramp; /* the extrapolation share */
    return inter * (1.0 - ex) + extra * ex;
}

void model_rope_inv_freq(const struct model_config *c, const struct model_weights *w, double *inv)
{
    int half = c->rope_dim / 2;
    for (int i = 0; i < half; i++) {
        double f = pow((double)c->rope_theta, -2.0 * i / c->rope_dim);
        if (c->rope_llama3_factor > 0) {
            /* transformers' _compute_llama3_parameters */
            double factor = c->rope_llama3_factor, lo = c->rope_llama3_low_freq, hi = c->rope_llama3_high_freq,
                   old = c->rope_llama3_orig_ctx;
            double wavelen = 2.0 * M_PI / f, lo_wl = old / lo, hi_wl = old / hi;
            if (wavelen > lo_wl) {
                f = f / factor;
            } else if (wavelen >= hi_wl) {
                double sm = (old / wavelen - lo) / (hi - lo);
                f = (1.0 - sm) * f / factor + sm * f;
            }
        }
        if (c->mla.yarn_factor > 0) f = yarn_inv_freq(&c->mla, c->rope_theta, c->rope_dim, i);
        if (w && w->rope_freqs.data) {
            float d;
            model_tensor_to_f32(&w->rope_freqs, i, 1, &d);
            f = f / d;
        }
        inv[i] = f;
    }
}

/* ---- weight formats per tensor family (sluice info) ------------------------------- */

/* The format of a weight matrix as sluice info prints it. */
static void weight_format(const struct model_tensor *t, char *out, size_t cap)
{
    if (t->dtype == MODEL_DT_QPACK && t->quant) {
        model_quant_describe(t->quant, out, cap);
        return;
    }
    snprintf(out, cap, "%s", model_dtype_name(t->dtype));
    for (char *p = out; *p; p++)
        if (*p >= 'A' && *p <= 'Z') *p = (char)(*p - 'A' + 'a');
}

/* name without "model." and the part after the last '.' (weight, qweight,
 * weight_packed); with layer = true the layer number becomes '*'. */
static void family_of(const char *name, bool wild, char *out, size_t cap)
{
    if (strncmp(name, "model.", 6) == 0) name += 6;
    const char *end = strrchr(name, '.');
    size_t n = end ? (size_t)(end - name) : strlen(name), o = 0;
    for (size_t i = 0; i < n && o + 1 < cap; i++) {
        bool after = (i >= 7 && strncmp(name + i - 7, "layers.", 7) == 0) ||
                     (i >= 8 && strncmp(name + i - 8, "experts.", 8) == 0) ||
                     (i >= 4 && strncmp(name + i - 4, "blk.", 4) == 0);
        if (wild && after && name[i] >= '0' && name[i] <= '9') {
            while (i + 1 < n && name[i + 1] >= '0' && name[i + 1] <= '9') i++;
            out[o++] = '*';
        } else {
            out[o++] = name[i];
        }
    }
    out[o] = 0;
}

struct fam {
    char key[160], fmt[96];
    bool mixed;  /* layers differ: listed per layer */
    bool merged; /* folded into a parent.* line */
};

size_t model_weight_formats(const model *m, char *out, size_t cap)
{
    int cap_t = max_tensors(m), n = 0;
    const struct model_tensor **ts = malloc((size_t)cap_t * sizeof *ts);
    struct fam *f = calloc((size_t)cap_t, sizeof *f);
    size_t len = 0;
    if (cap) out[0] = 0;
    if (!ts || !f) goto out;
    all_tensors(m, ts, &n);
    int nf = 0;
    for (int i = 0; i < n; i++) {
        const struct model_tensor *t = ts[i];
        if (t->ndim != 2 || t->ne[1] <= 1 || !t->name) continue; /* matrices only */
        struct fam e = {0};
        family_of(t->name, true, e.key, sizeof e.key);
        weight_format(t, e.fmt, sizeof e.fmt);
        int j = 0;
        while (j < nf && strcmp(f[j].key, e.key) != 0) j++;
        if (j == nf) f[nf++] = e;
        else if (strcmp(f[j].fmt, e.fmt) != 0) f[j].mixed = true;
    }
    /* a parent whose children (all uniform) share one format becomes parent.* */
    for (int i = 0; i < nf; i++) {
        const char *dot = strrchr(f[i].key, '.');
        if (f[i].mixed || f[i].merged || !dot || !strchr(f[i].key, '*')) continue;
        size_t pl = (size_t)(dot - f[i].key) + 1;
        int kids = 0;
        bool same = true;
        for (int j = 0; j < nf; j++)
            if (strncmp(f[j].key, f[i].key, pl) == 0 && !strchr(f[j].key + pl, '.')) {
                kids++;
                if (f[j].mixed || strcmp(f[j].fmt, f[i].fmt) != 0) same = false;
            }
        if (kids < 2 || !same) continue;
        for (int j = 0; j < nf; j++)
            if (j != i && strncmp(f[j].key, f[i].key, pl) == 0 && !strchr(f[j].key + pl, '.')) f[j].merged = true;
        snprintf(f[i].key + pl, sizeof f[i].key - pl, "*");
    }
    for (int i = 0; i < nf; i++) {
        if (f[i].merged) continue;
        if (!f[i].mixed) {
            int k = snprintf(out + (len < cap ? len : cap), len < cap ? cap - len : 0, "%s: %s\n", f[i].key, f[i].fmt);
            len += (size_t)(k > 0 ? k : 0);
            continue;
        }
        if (strstr(f[i].key, "experts.*")) {
            /* thousands of experts: each format once, with how many hold it */
            char fmts[8][96];
            int cnt[8] = {0}, nfm = 0;
            for (int j = 0; j < n; j++) {
                char key[160], fmt[96];
                if (ts[j]->ndim != 2 || ts[j]->ne[1] <= 1 || !ts[j]->name) continue;
                family_of(ts[j]->name, true, key, sizeof key);
                if (strcmp(key, f[i].key) != 0) continue;
                weight_format(ts[j], fmt, sizeof fmt);
                int q = 0;
                while (q < nfm && strcmp(fmts[q], fmt) != 0) q++;
                if (q == nfm && nfm < 8) snprintf(fmts[nfm++], sizeof fmts[0], "%s", fmt);
                if (q < nfm) cnt[q]++;
            }
            int k = snprintf(out + (len < cap ? len : cap), len < cap ? cap - len : 0, "%s:", f[i].key);
            len += (size_t)(k > 0 ? k : 0);
            for (int q = 0; q < nfm; q++) {
                k = snprintf(out + (len < cap ? len : cap), len < cap ? cap - len : 0, "%s %s (%d)", q ? "," : "",
                             fmts[q], cnt[q]);
                len += (size_t)(k > 0 ? k : 0);
            }
            k = snprintf(out + (len < cap ? len : cap), len < cap ? cap - len : 0, "\n");
            len += (size_t)(k > 0 ? k : 0);
            continue;
        }
        /* per layer */
        for (int j = 0; j < n; j++) {
            char key[160], one[160], fmt[96];
            if (ts[j]->ndim != 2 || ts[j]->ne[1] <= 1 || !ts[j]->name) continue;
            family_of(ts[j]->name, true, key, sizeof key);
            if (strcmp(key, f[i].key) != 0) continue;
            family_of(ts[j]->name, false, one, sizeof one);
            weight_format(ts[j], fmt, sizeof fmt);
            int k = snprintf(out + (len < cap ? len : cap), len < cap ? cap - len : 0, "%s: %s\n", one, fmt);
            len += (size_t)(k > 0 ? k : 0);
        }
    }
out:
    free(ts);
    free(f);
    return len;
}

const struct model_tensor *model_first_packed(const model *m)
{
    const struct model_weights *w = &m->w;
    if (w->tok_embd.dtype == MODEL_DT_QPACK) return &w->tok_embd;
    if (w->lm_head.dtype == MODEL_DT_QPACK) return &w->lm_head;
    for (int l = 0; l < m->cfg.n_layer && w->layers; l++) {
        const struct model_layer_weights *L = &w->layers[l];
        const struct model_mla_weights *A = &L->mla;
        const struct model_tensor *t[] = {&L->wq, &L->wk, &L->wv, &L->wo, &L->w_gate, &L->w_up, &L->w_down,
                                          &A->q_a, &A->q_b, &A->q, &A->kv_a, &A->kv_b, &A->o,
                                          &A->ix_wq_b, &A->ix_wk, &A->ix_weights};
        for (size_t i = 0; i < sizeof t / sizeof t[0]; i++)
            if (t[i]->dtype == MODEL_DT_QPACK) return t[i];
        if (model_layer_kind_of(&m->cfg, l).ffn != MODEL_FFN_MOE) continue;
        for (int e = 0; e < m->cfg.moe.n_expert; e++) {
            const struct model_tensor *x[] = {&L->moe.gate[e], &L->moe.up[e], &L->moe.down[e]};
            for (size_t i = 0; i < 3; i++)
                if (x[i]->dtype == MODEL_DT_QPACK) return x[i];
        }
    }
    return NULL;
}

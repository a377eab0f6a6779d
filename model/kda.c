/* kda.c - KDA linear attention on the model side (kda.h): config keys,
 * tensors, and the recurrent state a sequence keeps per layer.
 *
 * Reference: transformers' modeling_glm5_next.py (Glm5NextTextLinearAttention,
 * Glm5NextTextForgetGate) and configuration_glm5_next.py; the checkpoint's
 * own names are those conversion_mapping.py maps from (q/k/v_conv1d,
 * f_a_proj, f_b_proj, dt_bias and A_log directly under self_attn). */
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "kda.h"

int64_t model_state_layer_elems(const struct model_config *c, int layer)
{
    if (model_layer_kind_of(c, layer).mixer != MODEL_MIXER_KDA) return 0;
    const struct model_kda_config *k = &c->kda;
    int64_t C = (int64_t)k->n_head * k->head_dim;
    return C * k->head_dim + (int64_t)(k->conv_kernel - 1) * 3 * C;
}

size_t model_state_bytes(const struct model_config *c)
{
    size_t n = 0;
    for (int l = 0; l < c->n_layer; l++) n += (size_t)model_state_layer_elems(c, l) * sizeof(float);
    return n;
}

size_t model_state_replay_bytes(const struct model_config *c)
{
    size_t n = 0, C = (size_t)c->kda.n_head * (size_t)c->kda.head_dim;
    for (int l = 0; l < c->n_layer; l++)
        if (model_layer_kind_of(c, l).mixer == MODEL_MIXER_KDA) n += (4 * C + (size_t)c->kda.n_head) * sizeof(float);
    return n;
}

/* ---- config.json ------------------------------------------------------------ */

static int get_int(const json_doc *d, int obj, const char *key, int def, int *out, char *err, size_t errlen)
{
    int i = obj < 0 ? -1 : json_get(d, obj, key);
    int64_t v = def;
    if (i >= 0 && !json_is_null(d, i) && (json_i64(d, i, &v) != 0 || v < 1 || v > 65536)) {
        sl_seterr(err, errlen, "config.json: %s must be an integer from 1 to 65536", key);
        return SL_EFORMAT;
    }
    *out = (int)v;
    return 0;
}

/* A lower bound: an absent key keeps what is set, null clears it, a number sets it. */
static int get_bound(const json_doc *d, int obj, const char *key, bool *has, float *v, char *err, size_t errlen)
{
    int i = obj < 0 ? -1 : json_get(d, obj, key);
    if (i < 0) return 0;
    if (json_is_null(d, i)) {
        *has = false;
        return 0;
    }
    double x;
    if (json_f64(d, i, &x) != 0 || !isfinite(x) || x >= 0) {
        sl_seterr(err, errlen, "config.json: %s must be a negative number or null", key);
        return SL_EFORMAT;
    }
    *has = true;
    *v = (float)x;
    return 0;
}

int kda_hf_config(const json_doc *d, int obj, struct model_kda_config *k, char *err, size_t errlen)
{
    memset(k, 0, sizeof *k);
    k->has_lower_bound = true;
    k->lower_bound = -5.0f;
    int rc;
    if ((rc = get_int(d, obj, "linear_num_heads", 64, &k->n_head, err, errlen)) ||
        (rc = get_int(d, obj, "linear_head_dim", 128, &k->head_dim, err, errlen)) ||
        (rc = get_int(d, obj, "linear_conv_kernel_dim", 4, &k->conv_kernel, err, errlen)) ||
        (rc = get_bound(d, obj, "linear_lower_bound", &k->has_lower_bound, &k->lower_bound, err, errlen)))
        return rc;
    int la = obj < 0 ? -1 : json_get(d, obj, "linear_attn_config");
    if (la >= 0 && json_is_obj(d, la)) {
        if ((rc = get_int(d, la, "num_heads", k->n_head, &k->n_head, err, errlen)) ||
            (rc = get_int(d, la, "head_dim", k->head_dim, &k->head_dim, err, errlen)) ||
            (rc = get_int(d, la, "short_conv_kernel_size", k->conv_kernel, &k->conv_kernel, err, errlen)) ||
            (rc = get_bound(d, la, "gate_lower_bound", &k->has_lower_bound, &k->lower_bound, err, errlen)))
            return rc;
        bool safe = true;
        int sg = json_get(d, la, "safe_gate");
        if (sg >= 0 && !json_is_null(d, sg) && json_bool(d, sg, &safe) != 0) {
            sl_seterr(err, errlen, "config.json: linear_attn_config.safe_gate must be true or false");
            return SL_EFORMAT;
        }
        if (safe && !k->has_lower_bound) {
            k->has_lower_bound = true;
            k->lower_bound = -5.0f;
        }
    }
    return 0;
}

/* ---- tensors ---------------------------------------------------------------- */

static bool float_dtype(enum model_dtype dt)
{
    return dt == MODEL_DT_F32 || dt == MODEL_DT_BF16 || dt == MODEL_DT_F16;
}

static size_t dtype_bytes(enum model_dtype dt) { return dt == MODEL_DT_F32 ? 4 : 2; }

/* A small tensor of n values (any shape), found under prefix.name or
 * prefix.alt. */
static int find_small(const struct kda_lookup *lk, const char *prefix, const char *name, const char *alt, int64_t n,
                      struct model_tensor *t, char *err, size_t errlen)
{
    char full[512];
    snprintf(full, sizeof full, "%s.%s", prefix, name);
    int rc = lk->find(lk->ctx, full, t);
    if (rc == 1 && alt) {
        snprintf(full, sizeof full, "%s.%s", prefix, alt);
        rc = lk->find(lk->ctx, full, t);
    }
    if (rc < 0) {
        sl_seterr(err, errlen, "tensor %s: unsupported dtype or rank", full);
        return rc;
    }
    if (rc == 1) {
        sl_seterr(err, errlen, "missing tensor %s.%s", prefix, name);
        return SL_EFORMAT;
    }
    if (!float_dtype(t->dtype) || model_tensor_nelem(t) != n) {
        sl_seterr(err, errlen, "tensor %s: expected %lld f32/bf16/f16 values, found %lld of %s", full, (long long)n,
                  (long long)model_tensor_nelem(t), model_dtype_name(t->dtype));
        return SL_EFORMAT;
    }
    return 0;
}

/* The conv of channels [C][K] at element offset first of t, as a 2-D view. */
static struct model_tensor conv_view(const struct model_tensor *t, int64_t first, int64_t C, int K)
{
    struct model_tensor v = *t;
    v.ndim = 2;
    v.ne[0] = K, v.ne[1] = C, v.ne[2] = 1, v.ne[3] = 1;
    v.data = (const uint8_t *)t->data + (size_t)first * dtype_bytes(t->dtype);
    v.nbytes = (size_t)(C * K) * dtype_bytes(t->dtype);
    return v;
}

static int bind_conv(const struct model_kda_config *k, const char *prefix, const struct kda_lookup *lk,
                     struct model_kda_weights *w, char *err, size_t errlen)
{
    int64_t C = (int64_t)k->n_head * k->head_dim;
    int K = k->conv_kernel;
    static const char *part[3] = {"q_conv1d", "k_conv1d", "v_conv1d"};
    struct model_tensor t;
    char name[512];
    snprintf(name, sizeof name, "%s.conv1d.weight", prefix);
    int rc = lk->find(lk->ctx, name, &t);
    if (rc < 0) {
        sl_seterr(err, errlen, "tensor %s: unsupported dtype or rank", name);
        return rc;
    }
    if (rc == 0) { /* fused q|k|v, transformers' in-memory layout */
        if (!float_dtype(t.dtype) || t.ne[0] != K || model_tensor_nelem(&t) != 3 * C * K) {
            sl_seterr(err, errlen, "tensor %s: expected [%lld, 1, %d] f32/bf16/f16", name, (long long)(3 * C), K);
            return SL_EFORMAT;
        }
        for (int i = 0; i < 3; i++) w->conv[i] = conv_view(&t, i * C * K, C, K);
        return 0;
    }
    for (int i = 0; i < 3; i++) {
        snprintf(name, sizeof name, "%s.%s.weight", prefix, part[i]);
        rc = lk->find(lk->ctx, name, &t);
        if (rc < 0) {
            sl_seterr(err, errlen, "tensor %s: unsupported dtype or rank", name);
            return rc;
        }
        if (rc == 1) {
            sl_seterr(err, errlen, "missing tensor %s (nor a fused %s.conv1d.weight)", name, prefix);
            return SL_EFORMAT;
        }
        if (!float_dtype(t.dtype) || t.ne[0] != K || model_tensor_nelem(&t) != C * K) {
            sl_seterr(err, errlen, "tensor %s: expected [%lld, 1, %d] f32/bf16/f16", name, (long long)C, K);
            return SL_EFORMAT;
        }
        w->conv[i] = conv_view(&t, 0, C, K);
    }
    return 0;
}

int kda_bind_layer(const struct model_kda_config *k, int n_embd, const char *prefix, const struct kda_lookup *lk,
                   struct model_kda_weights *w, char *err, size_t errlen)
{
    int64_t E = n_embd, H = k->n_head, D = k->head_dim, C = H * D;
    memset(w, 0, sizeof *w);
    char name[512];
    int rc;
#define M(field, nm, rows, cols)                                                                                  \
    do {                                                                                                          \
        snprintf(name, sizeof name, "%s.%s.weight", prefix, nm);                                                  \
        if ((rc = lk->get(lk->ctx, name, rows, cols, false, &w->field, err, errlen))) return rc;                  \
    } while (0)
/* the forget gate's matrices: directly under the prefix in checkpoints, under forget_gate. in memory */
#define MF(field, nm, rows, cols)                                                                                 \
    do {                                                                                                          \
        snprintf(name, sizeof name, "%s.%s.weight", prefix, nm);                                                  \
        if ((rc = lk->get(lk->ctx, name, rows, cols, true, &w->field, err, errlen))) return rc;                   \
        if (!w->field.data) M(field, "forget_gate." nm, rows, cols);                                              \
    } while (0)
    M(q, "q_proj", C, E);
    M(k, "k_proj", C, E);
    M(v, "v_proj", C, E);
    MF(f_a, "f_a_proj", D, E);
    MF(f_b, "f_b_proj", C, D);
    M(b, "b_proj", H, E);
    M(g_a, "g_a_proj", D, E);
    M(g_b, "g_b_proj", C, D);
    M(o, "o_proj", E, C);
#undef M
#undef MF
    if ((rc = find_small(lk, prefix, "dt_bias", "forget_gate.dt_bias", C, &w->dt_bias, err, errlen)) ||
        (rc = find_small(lk, prefix, "A_log", "forget_gate.A_log", H, &w->A_log, err, errlen)) ||
        (rc = find_small(lk, prefix, "o_norm.weight", NULL, D, &w->o_norm, err, errlen)))
        return rc;
    return bind_conv(k, prefix, lk, w, err, errlen);
}

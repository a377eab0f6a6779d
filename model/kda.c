/* kda.c - KDA linear attention on the model side (kda.h): its tensors and
 * the recurrent state a sequence keeps per layer (the config keys are
 * model/glm5.c's).
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

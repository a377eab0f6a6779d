/* glm5.c - glm5_next's config keys and hyper-connection tensors (glm5.h).
 *
 * Reference: transformers 5.25 configuration_glm5_next.py
 * (Glm5NextTextConfig.__post_init__) and conversion_mapping.py's "glm5_next"
 * renamings (the checkpoint's names). */
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "glm5.h"
#include "kda.h"

static int get_int(const json_doc *d, int obj, const char *key, int def, int lo, int hi, int *out, char *err,
                   size_t errlen)
{
    int i = obj < 0 ? -1 : json_get(d, obj, key);
    int64_t v = def;
    if (i >= 0 && !json_is_null(d, i) && (!json_is_num(d, i) || json_i64(d, i, &v) != 0 || v < lo || v > hi)) {
        sl_seterr(err, errlen, "config.json: %s must be an integer from %d to %d", key, lo, hi);
        return SL_EFORMAT;
    }
    *out = (int)v;
    return 0;
}

static int get_num(const json_doc *d, int obj, const char *key, double def, float *out, char *err, size_t errlen)
{
    int i = obj < 0 ? -1 : json_get(d, obj, key);
    double v = def;
    if (i >= 0 && !json_is_null(d, i) && (!json_is_num(d, i) || json_f64(d, i, &v) != 0 || !isfinite(v))) {
        sl_seterr(err, errlen, "config.json: %s must be a number", key);
        return SL_EFORMAT;
    }
    *out = (float)v;
    return 0;
}

int glm5_hf_config(const json_doc *d, int obj, struct model_config *c, bool **linear, char *err, size_t errlen)
{
    struct model_hc_config *h = &c->hc;
    int rc, L = c->n_layer;
    *linear = NULL;
    if ((rc = get_int(d, obj, "hc_mult", 4, 1, 64, &h->mult, err, errlen)) ||
        (rc = get_int(d, obj, "hc_sinkhorn_iters", 20, 1, 1000, &h->sinkhorn_iters, err, errlen)) ||
        (rc = get_num(d, obj, "hc_eps", 1e-6, &h->eps, err, errlen)) ||
        (rc = kda_hf_config(d, obj, &c->kda, err, errlen)))
        return rc;
    bool *lin = calloc((size_t)L, sizeof *lin);
    if (!lin) {
        sl_seterr(err, errlen, "out of memory");
        return SL_ENOMEM;
    }
    int lt = json_get(d, obj, "layer_types");
    if (lt >= 0 && !json_is_null(d, lt)) {
        if (!json_is_arr(d, lt) || json_size(d, lt) < L) {
            sl_seterr(err, errlen, "config.json: layer_types must list all %d layers", L);
            free(lin);
            return SL_EFORMAT;
        }
        for (int l = 0; l < L; l++) {
            int e = json_at(d, lt, l);
            if (json_str_eq(d, e, "linear_attention")) {
                lin[l] = true;
            } else if (!json_str_eq(d, e, "indexed_attention") && !json_str_eq(d, e, "full_attention") &&
                       !json_str_eq(d, e, "deepseek_sparse_attention")) {
                size_t n = 0;
                const char *raw = json_raw(d, e, &n);
                sl_seterr(err, errlen,
                          "config.json: layer_types[%d] is %.*s, expected linear_attention, indexed_attention, "
                          "full_attention or deepseek_sparse_attention", l, (int)(n < 40 ? n : 40), raw ? raw : "");
                free(lin);
                return SL_EFORMAT;
            }
        }
    } else {
        for (int l = 0; l < L; l++) lin[l] = l % 4 != 3;
    }
    bool any = false;
    for (int l = 0; l < L; l++) any |= lin[l];
    if (!any) memset(&c->kda, 0, sizeof c->kda);
    *linear = lin;
    return 0;
}

const char *glm5_module_path(const char *module, char *buf, size_t cap)
{
    static const char *const moved[] = {".self_attn.f_a_proj", ".self_attn.f_b_proj"};
    size_t n = strlen(module);
    for (size_t i = 0; i < sizeof moved / sizeof *moved; i++) {
        size_t k = strlen(moved[i]);
        if (n >= k && strcmp(module + n - k, moved[i]) == 0) {
            snprintf(buf, cap, "%.*s.self_attn.forget_gate.%s", (int)(n - k), module, moved[i] + 11);
            return buf;
        }
    }
    return module;
}

int glm5_bind_hc(const struct model_config *c, int l, mla_get_fn get, void *ctx, struct model_layer_weights *w,
                 char *err, size_t errlen)
{
    int64_t hc = c->hc.mult, n = (2 + hc) * hc;
    static const char *const site[2] = {"attn", "ffn"};
    struct model_hc_weights *ws[2] = {&w->hc_attn, &w->hc_ffn};
    char name[160];
    int rc;
    for (int s = 0; s < 2; s++) {
        snprintf(name, sizeof name, "model.layers.%d.hc_%s_fn", l, site[s]);
        if ((rc = get(ctx, name, n, hc * c->n_embd, false, &ws[s]->fn, err, errlen))) return rc;
        snprintf(name, sizeof name, "model.layers.%d.hc_%s_base", l, site[s]);
        if ((rc = get(ctx, name, 0, n, false, &ws[s]->base, err, errlen))) return rc;
        snprintf(name, sizeof name, "model.layers.%d.hc_%s_scale", l, site[s]);
        if ((rc = get(ctx, name, 0, 3, false, &ws[s]->scale, err, errlen))) return rc;
    }
    return 0;
}

/* overrides.c - --hf-overrides on a loaded model_config (overrides.h). */
#include "overrides.h"

#include <math.h>
#include <stdio.h>
#include <string.h>

#include "base/json.h"

static void ignored(const char *key, const char *why)
{
    fprintf(stderr, "sluice: --hf-overrides: '%s' ignored: %s\n", key, why);
}

/* Applies the members of object obj to c (already a copy). */
static int apply(struct model_config *c, const json_doc *d, int obj, const char *prefix, char *err, size_t errlen)
{
    int n = json_size(d, obj);
    for (int k = 0, i = obj + 1; k < n; k++, i = json_skip(d, i + 1)) {
        char key[128], full[300];
        if (json_str(d, i, key, sizeof key) < 0) {
            snprintf(err, errlen, "--hf-overrides: a key is not a valid string");
            return SL_EINVAL;
        }
        snprintf(full, sizeof full, "%s%s", prefix, key);
        int v = i + 1;
        double x;
        int64_t iv;
        if (!strcmp(key, "text_config") && json_is_obj(d, v)) {
            int rc = apply(c, d, v, "text_config.", err, errlen);
            if (rc) return rc;
        } else if (!strcmp(key, "index_topk") && c->mla.index_n_heads > 0) {
            /* the DSA indexer (glm_moe_dsa): null = dense MLA, its tensors not loaded */
            if (json_is_null(d, v)) {
                c->mla.index_topk = 0;
            } else {
                if (json_i64(d, v, &iv) || iv < 1 || iv > INT32_MAX) goto bad;
                c->mla.index_topk = (int)iv;
            }
        } else if ((!strcmp(key, "index_n_heads") || !strcmp(key, "index_head_dim") || !strcmp(key, "index_kpool")) &&
                   c->mla.index_n_heads > 0 && json_is_null(d, v)) {
            /* the indexer's shape made null: no indexer, as index_topk null says */
            c->mla.index_topk = 0;
        } else if (!strcmp(key, "num_nextn_predict_layers")) {
            /* glm5_next counts its MTP layers apart (mla.n_mtp_layers: loaded, not run) */
            int *n_mtp = c->arch == MODEL_ARCH_GLM5_NEXT ? &c->mla.n_mtp_layers : &c->n_mtp_layer;
            if (json_is_null(d, v)) {
                *n_mtp = 0;
            } else {
                if (json_i64(d, v, &iv) || iv < 0) goto bad;
                if (iv > *n_mtp) {
                    snprintf(err, errlen, "--hf-overrides: %s=%lld exceeds the %d MTP layers the checkpoint has", full,
                             (long long)iv, *n_mtp);
                    return SL_EINVAL;
                }
                *n_mtp = (int)iv;
            }
        } else if (json_is_null(d, v)) {
            ignored(full, "null switches off a feature this model does not have");
        } else if (!strcmp(key, "max_position_embeddings")) {
            if (json_i64(d, v, &iv) || iv < 16 || iv > INT32_MAX) goto bad;
            c->n_ctx_train = (int)iv;
        } else if (!strcmp(key, "rope_theta")) {
            if (json_f64(d, v, &x) || !(x > 0)) goto bad;
            c->rope_theta = (float)x;
        } else if (!strcmp(key, "rms_norm_eps")) {
            if (json_f64(d, v, &x) || !(x > 0) || x > 1) goto bad;
            c->norm_eps = (float)x;
        } else if (!strcmp(key, "num_hidden_layers")) {
            if (json_i64(d, v, &iv) || iv < 1) goto bad;
            if (iv > c->n_layer) {
                snprintf(err, errlen, "--hf-overrides: %s=%lld exceeds the %d layers the checkpoint has", full,
                         (long long)iv, c->n_layer);
                return SL_EINVAL;
            }
            c->n_layer = (int)iv;
        } else if (!strcmp(key, "sliding_window") || !strcmp(key, "use_sliding_window")) {
            ignored(full, "sluice runs full attention for these architectures");
        } else {
            ignored(full, "not a setting of this model's architecture in sluice");
        }
        continue;
    bad:
        snprintf(err, errlen, "--hf-overrides: invalid value for '%s'", full);
        return SL_EINVAL;
    }
    return 0;
}

int model_config_override(struct model_config *c, const char *json, char *err, size_t errlen)
{
    json_doc d;
    char perr[200];
    if (json_parse(&d, json, strlen(json), perr, sizeof perr)) {
        snprintf(err, errlen, "--hf-overrides is not valid JSON: %s", perr);
        return SL_EINVAL;
    }
    int rc = SL_EINVAL;
    if (!json_is_obj(&d, 0)) {
        snprintf(err, errlen, "--hf-overrides must be a JSON object");
    } else {
        struct model_config tmp = *c;
        rc = apply(&tmp, &d, 0, "", err, errlen);
        if (!rc) *c = tmp;
    }
    json_free(&d);
    return rc;
}

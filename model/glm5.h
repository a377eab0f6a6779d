/* glm5.h - GLM-5.3-Flash (glm5_next) on the model side (internal to model/):
 * its own config keys (the hyper-connections, the KDA layers' shape, the
 * per-layer mixer schedule) and its hyper-connection tensors. The MLA layers
 * are model/mla.c's, the MoE FFNs model/moe.c's; the CPU hyper-connection
 * step is model/cpu_hc.c. */
#ifndef SLUICE_GLM5_H
#define SLUICE_GLM5_H

#include <stdbool.h>
#include <stddef.h>

#include "base/json.h"
#include "mla.h"
#include "model.h"

/* Reads glm5_next's keys of config.json object obj (the text_config, or the
 * top level of a flat config) into c->hc and c->kda (c->n_layer already
 * read): hc_mult, hc_sinkhorn_iters, hc_eps; the KDA layers' shape
 * (kda_hf_config, model/kda.h; zero when no layer is KDA); layer_types,
 * whose every transformers spelling is accepted: "linear_attention" (KDA),
 * "indexed_attention", "full_attention", "deepseek_sparse_attention" (MLA);
 * absent, every 4th layer is MLA as Glm5NextTextConfig says. *linear gets a
 * new [n_layer] mask of the KDA layers (the caller frees). Returns 0, or
 * SL_EFORMAT naming the key. */
int glm5_hf_config(const json_doc *d, int obj, struct model_config *c, bool **linear, char *err, size_t errlen);

/* The in-memory module path transformers gives the file's module `module`
 * (conversion_mapping.py's "glm5_next" renamings: self_attn.f_a_proj and
 * f_b_proj live under self_attn.forget_gate.), which a quantization_config's
 * targets and ignore name; module itself when they agree. buf holds an
 * alias. */
const char *glm5_module_path(const char *module, char *buf, size_t cap);

/* Binds layer l's two hyper-connection sites ("model.layers.<l>.hc_attn_fn",
 * _base, _scale and hc_ffn_*: the checkpoint's names, which transformers
 * renames attn_hc.fn ...) into w, shape-checked. */
int glm5_bind_hc(const struct model_config *c, int l, mla_get_fn get, void *ctx, struct model_layer_weights *w,
                 char *err, size_t errlen);

#endif

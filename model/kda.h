/* kda.h - KDA linear attention on the model side (internal to model/): the
 * linear-attention keys of config.json, a layer's tensors, and the state a
 * sequence keeps per layer (model_state_layer_elems in model.h). The CPU step
 * is model/cpu_kda.c; the types are model.h's struct model_kda_config and
 * struct model_kda_weights. */
#ifndef SLUICE_KDA_H
#define SLUICE_KDA_H

#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>

#include "base/json.h"
#include "model.h"

/* Reads the KDA keys of the config object obj of d into *k, as transformers'
 * Glm5NextTextConfig reads them: linear_num_heads (64), linear_head_dim (128),
 * linear_conv_kernel_dim (4), linear_lower_bound (-5.0 when absent; null: no
 * lower bound, the softplus form), or the same inside a linear_attn_config
 * object (num_heads, head_dim, short_conv_kernel_size, gate_lower_bound, and
 * safe_gate, true by default, which gives a null bound -5.0). Returns 0, or
 * SL_EFORMAT with a message naming the key. */
int kda_hf_config(const json_doc *d, int obj, struct model_kda_config *k, char *err, size_t errlen);

/* The loader's lookups, for binding: get is a shape-checked matrix
 * [rows][cols] in whatever format the file holds it (rows 0: a vector of
 * cols); find a raw tensor of any rank (0 found, 1 absent, < 0 error). */
struct kda_lookup {
    int (*get)(void *ctx, const char *name, int64_t rows, int64_t cols, bool optional, struct model_tensor *t,
               char *err, size_t errlen);
    int (*find)(void *ctx, const char *name, struct model_tensor *t);
    void *ctx;
};

/* Binds one KDA layer's tensors under prefix (e.g.
 * "model.language_model.layers.0.self_attn"): q/k/v_proj, the conv as
 * q/k/v_conv1d.weight [C][1][K] each or one fused conv1d.weight [3C][1][K]
 * (f32, bf16 or f16), f_a_proj, f_b_proj, dt_bias [C], A_log (H values, any
 * shape), b_proj, g_a_proj, g_b_proj, o_norm.weight [D], o_proj. The forget
 * gate's tensors may also sit under "forget_gate." (transformers' module
 * path). Returns 0, or a negative status with a message naming the tensor. */
int kda_bind_layer(const struct model_kda_config *k, int n_embd, const char *prefix, const struct kda_lookup *lk,
                   struct model_kda_weights *w, char *err, size_t errlen);

#endif

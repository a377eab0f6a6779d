/* mla.h - multi-head latent attention on the model side (internal to model/):
 * the MLA keys of config.json, the per-layer tensors, and the KV entry each
 * layer kind keeps per token.
 * The CPU step is model/cpu_mla.c. */
#ifndef SLUICE_MLA_H
#define SLUICE_MLA_H

#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>

#include "base/json.h"
#include "model.h"
#include "safetensors.h"

/* Reads the MLA keys of config.json object obj of d (0, or glm5_next's text_config) into c (c->arch is an MLA
 * architecture, the generic keys are read): ranks, head dims, rope_interleave,
 * YaRN (rope_parameters or rope_scaling: rp is that object or -1), the softmax
 * scale as transformers computes it, the dense-FFN prefix and the
 * DSA indexer. Sets head_dim = nope + rope, rope_dim = rope and n_head_kv =
 * n_head. *index_full gets a new [n_layer] array (caller owns) or NULL.
 * Returns 0, or SL_EFORMAT / SL_EUNSUP with a message naming the key. */
int mla_hf_config(const json_doc *d, int obj, int rp, struct model_config *c, uint8_t **index_full, char *err,
                  size_t errlen);

/* Looks up one tensor for mla_bind_layer (the loader's shape-checked lookup:
 * rows 0 means a vector of cols). */
typedef int (*mla_get_fn)(void *ctx, const char *name, int64_t rows, int64_t cols, bool optional,
                          struct model_tensor *t, char *err, size_t errlen);

/* Binds plan layer l's attention tensors (HF names under
 * "model.layers.<fl>.self_attn.", fl its number in the file: an MTP layer's
 * differs when num_hidden_layers is overridden) into w, shape-checked; the
 * indexer's only when the layer runs one with index_topk > 0 (index_topk null
 * skips them even where the file has them; MTP layers run none). */
int mla_bind_layer(const struct model_config *c, int l, int fl, mla_get_fn get, void *ctx,
                   struct model_mla_weights *w, char *err, size_t errlen);

/* glm5_next's MTP modules (mla.n_mtp_layers, counted, not run): layers
 * first .. first + n_mtp - 1 of the file (after the last decoder layer). Checks each has enorm, hnorm and eh_proj of the right
 * shapes (through get, "model.layers.<l>." names) and counts every tensor
 * under "<prefix_text>layers.<l>." in st (prefix_text: where the file keeps
 * the text model, "model." or "model.language_model.").
 * Returns 0 or SL_EFORMAT naming the missing tensor and the override that
 * switches MTP off. */
int mla_count_mtp(const struct model_config *c, int first, const char *prefix_text, const st_set *st, mla_get_fn get,
                  void *ctx, int *n_tensors, size_t *n_bytes, char *err, size_t errlen);

#endif

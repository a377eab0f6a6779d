/* overrides.h - vLLM's --hf-overrides applied to a loaded configuration
 * (internal to model/; model_load applies model_load_opts.hf_overrides). */
#ifndef SLUICE_OVERRIDES_H
#define SLUICE_OVERRIDES_H

#include <stddef.h>

#include "model.h"

/* Applies the JSON object json to c: keys sluice's config has (HF names:
 * max_position_embeddings, rope_theta, rms_norm_eps, num_hidden_layers (only
 * lowered), sliding_window, index_topk (null: the DSA indexer off, dense MLA;
 * index_n_heads, index_head_dim or index_kpool null say the same),
 * num_nextn_predict_layers (only lowered; 0 or null: MTP layers not loaded), ...) take effect; "text_config" is applied the
 * same way (multimodal configs nest the text model there); every other key
 * is reported on stderr as ignored, one line each, saying why. Returns 0, or
 * SL_EINVAL with a message naming the key (malformed JSON, wrong type, a
 * value the loaded weights cannot honour); nothing is changed on error. */
int model_config_override(struct model_config *c, const char *json, char *err, size_t errlen);

#endif

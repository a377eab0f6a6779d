/* quant.h - quantized weights in safetensors checkpoints: which format each
 * weight is in (decided from the tensors the file holds, with config.json's
 * quantization_config as a cross-check) and row dequantization.
 *
 * Formats: compressed-tensors pack-quantized (int4/int8, group or channel
 * scales, zero points, act-order g_idx) and int-quantized (int8), AutoAWQ GEMM
 * and GPTQ (v1/v2 zeros, g_idx). The layouts are in model.h (enum
 * model_qlayout). Internal to model/.
 */
#ifndef SLUICE_QUANT_H
#define SLUICE_QUANT_H

#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>

#include "model.h"
#include "safetensors.h"

/* config.json's quantization_config, parsed. */
struct quant_cfg;

/* Parses the quantization_config object of config.json (text[0..len)).
 * *out is NULL when there is none (a dense checkpoint). Unsupported methods
 * (fp8, bitsandbytes, ...) are refused here with their name. */
int quant_cfg_parse(const char *text, size_t len, struct quant_cfg **out, char *err, size_t errlen);
void quant_cfg_free(struct quant_cfg *qc);

/* The weight of module `module` (e.g. "model.layers.0.mlp.gate_proj", whose
 * dense form is "<module>.weight"), expected [rows][cols] (out, in). linear:
 * the module is an nn.Linear (what a config target "Linear" names).
 * Decides the format from the tensors present; fills t (dtype, ne, data,
 * nbytes; t->name is left to the caller) and, for a packed weight, *q (which
 * t->quant must then point to). Returns 0, 1 when no form of the weight is
 * present, or a negative status with a message naming the tensor (shape
 * mismatches, a config that claims another format, malformed parts).
 * *file_name receives the name of the tensor that holds the values. */
int quant_load_weight(const st_set *st, const struct quant_cfg *qc, const char *module, bool linear, int64_t rows,
                      int64_t cols, struct model_tensor *t, struct model_quant *q, char *file_name,
                      size_t file_name_cap, char *err, size_t errlen);

/* Row r of a packed weight as f32 into dst[q->cols]: exactly the values the
 * format's reference dequantizer gives (in the scale's dtype). */
void quant_deq_row(const struct model_quant *q, int64_t r, float *dst);

#endif

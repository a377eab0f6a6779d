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
/* The same, the config consulted under `claim` (the in-memory module path
 * the config's targets and ignore name, where the file's name differs:
 * glm5_next's self_attn.f_a_proj is transformers' self_attn.forget_gate.f_a_proj). */
int quant_load_weight_as(const st_set *st, const struct quant_cfg *qc, const char *module, const char *claim,
                         bool linear, int64_t rows, int64_t cols, struct model_tensor *t, struct model_quant *q,
                         char *file_name, size_t file_name_cap, char *err, size_t errlen);

/* What the config says of module `module` (linear: an nn.Linear), for
 * --load-format dummy, which has no file to decide from: 1 with its scheme
 * (group 0: per channel; sym as configured, true where AWQ/GPTQ leave it to
 * the file) when it is quantized, 0 when it stays dense, a negative status
 * with a message for a scheme sluice does not run (fp8, ...). */
int quant_cfg_scheme(const struct quant_cfg *qc, const char *module, bool linear, int *bits, int *group, bool *sym,
                     bool *act_order, char *err, size_t errlen);

/* Row r of a packed weight as f32 into dst[q->cols]: exactly the values the
 * format's reference dequantizer gives (in the scale's dtype). */
/* exact IEEE half -> single (subnormals, infinities, NaN payloads) */
float quant_f16_to_f32(uint16_t h);
/* f32 -> bf16 -> f32, round to nearest even (finite inputs) */
float quant_round_bf16(float x);
void quant_deq_row(const struct model_quant *q, int64_t r, float *dst);

/* Round-to-nearest symmetric quantization of one row w[cols] (bf16 values)
 * as compressed-tensors computes it: per group of `group` columns scale =
 * bf16(absmax / ((2^bits - 1) / 2)), q = clamp(round-half-even(bf16(w /
 * scale))); writes the pack-quantized words packed[cols*bits/32] (q +
 * 2^(bits-1), low bits first) and the bf16 scales[ceil(cols/group)]. */
void quant_rtn_row(const float *w, int64_t cols, int bits, int group, uint32_t *packed, uint16_t *scales);

#endif

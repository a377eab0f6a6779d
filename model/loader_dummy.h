/* loader_dummy.h - random weights for a configuration alone (--load-format
 * dummy), internal to model/: loader.c calls it after reading config.json. */
#ifndef SLUICE_LOADER_DUMMY_H
#define SLUICE_LOADER_DUMMY_H

#include "model.h"
#include "quant.h"

/* Fills w with bf16 views of the shapes c asks for. The values come from one
 * shared pool of random numbers (uniform in +-0.02 for matrices, 1 for norm
 * weights, 0 for biases), which *owner holds: every matrix is a window into
 * it at its own offset, so an 8B shape costs ~1 GB of host memory, not 16.
 * qc (config.json's quantization_config, or NULL): a matrix it quantizes
 * (compressed-tensors int4/int8, by its HF module name) is a packed
 * symmetric weight instead, its codes random bytes of the same pool and its
 * scales 0.02/2^(bits-1), so the values stay in the bf16 ones' range.
 * Returns 0, or a negative sl_status with a message in err. */
struct quant_cfg;
/* qc: config.json's quantization_config, or NULL. Where it quantizes a
 * projection, that projection is a random packed weight in the
 * compressed-tensors pack-quantized layout of the configured scheme (codes
 * and zero points uniform over their range, bf16 scales of about 0.02 / 2^(bits-1),
 * act-order with a random g_idx of equal-size groups), so that the
 * quantized kernels can be timed on shapes we cannot download. */
int model_dummy_weights(const struct model_config *c, const struct quant_cfg *qc, struct model_weights *w,
                        void **owner, char *err, size_t errlen);
void model_dummy_free(void *owner);

#endif

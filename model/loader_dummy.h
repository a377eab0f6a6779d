/* loader_dummy.h - random weights for a configuration alone (--load-format
 * dummy), internal to model/: loader.c calls it after reading config.json. */
#ifndef SLUICE_LOADER_DUMMY_H
#define SLUICE_LOADER_DUMMY_H

#include "model.h"

/* Fills w with bf16 views of the shapes c asks for. The values come from one
 * shared pool of random numbers (uniform in +-0.02 for matrices, 1 for norm
 * weights, 0 for biases), which *owner holds: every matrix is a window into
 * it at its own offset, so an 8B shape costs ~1 GB of host memory, not 16.
 * Returns 0, or a negative sl_status with a message in err. */
int model_dummy_weights(const struct model_config *c, struct model_weights *w, void **owner, char *err,
                        size_t errlen);
void model_dummy_free(void *owner);

#endif

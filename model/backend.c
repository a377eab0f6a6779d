/* backend.c - picking a backend by name (model/backend.h), and the weak
 * stand-ins for the CUDA backend that cuda/ overrides when built with nvcc. */
#include <stdio.h>
#include <string.h>

#include "backend.h"

__attribute__((weak)) bool model_cuda_available(void) { return false; }

__attribute__((weak)) model_backend *model_cuda_backend_create(const model *m,
                                                                const struct model_backend_opts *opts,
                                                                char *err, size_t errlen)
{
    (void)m;
    (void)opts;
    if (err && errlen) snprintf(err, errlen, "this build has no CUDA backend");
    return NULL;
}

model_backend *model_backend_create(const model *m, const struct model_backend_opts *opts, char *err,
                                    size_t errlen)
{
    const char *dev = opts ? opts->device : NULL;
    if (!m) {
        if (err && errlen) snprintf(err, errlen, "no model");
        return NULL;
    }
    if (!dev) dev = model_cuda_available() ? "cuda" : "cpu";
    if (strcmp(dev, "cpu") == 0) return model_cpu_backend_create(m, opts, err, errlen);
    if (strcmp(dev, "cuda") == 0) return model_cuda_backend_create(m, opts, err, errlen);
    if (err && errlen) snprintf(err, errlen, "unknown device '%s' (expected cpu or cuda)", dev);
    return NULL;
}

void model_backend_destroy(model_backend *b)
{
    if (b && b->ops && b->ops->destroy) b->ops->destroy(b);
}

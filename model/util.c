/* util.c - the small shared pieces of model.h: the assertion handler. */
#include <stdarg.h>
#include <stdio.h>
#include <stdlib.h>

#include "backend.h"

void sl_assert_fail(const char *expr, const char *file, int line)
{
    fprintf(stderr, "sluice: assertion failed: %s (%s:%d)\n", expr, file, line);
    fflush(stderr);
    abort();
}

/* Stand-in for builds without cuda/ (which overrides it). */
__attribute__((weak)) int model_cuda_describe(char *buf, size_t cap)
{
    snprintf(buf, cap, "this build has no CUDA support");
    return -1;
}

void sl_seterr(char *err, size_t errlen, const char *fmt, ...)
{
    if (!err || !errlen) return;
    va_list ap;
    va_start(ap, fmt);
    vsnprintf(err, errlen, fmt, ap);
    va_end(ap);
}

/* Stand-in for builds without cuda/ (which overrides it). */
__attribute__((weak)) int model_cuda_mem_info(int device, size_t *free_bytes, size_t *total_bytes)
{
    (void)device;
    *free_bytes = *total_bytes = 0;
    return -1;
}

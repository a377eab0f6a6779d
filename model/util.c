/* util.c - the small shared pieces of model.h: the assertion handler. */
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

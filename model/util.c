/* util.c - weak stand-ins for the cuda/ entry points, for builds without CUDA. */
#include <stdarg.h>
#include <stdio.h>
#include <stdlib.h>

#include "backend.h"

/* Stand-in for builds without cuda/ (which overrides it). */
__attribute__((weak)) int model_cuda_describe(char *buf, size_t cap)
{
    snprintf(buf, cap, "this build has no CUDA support");
    return -1;
}

/* Stand-in for builds without cuda/ (which overrides it). */
__attribute__((weak)) int model_cuda_mem_info(int device, size_t *free_bytes, size_t *total_bytes)
{
    (void)device;
    *free_bytes = *total_bytes = 0;
    return -1;
}

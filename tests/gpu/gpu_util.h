/* gpu_util.h - small helpers the GPU tests and benchmarks share: a seeded
 * random stream, bf16 rounding as the backend does it, a wall clock and a
 * comparator for medians. Header-only (static inline). */
#ifndef SLUICE_TESTS_GPU_UTIL_H
#define SLUICE_TESTS_GPU_UTIL_H

#include <stdint.h>
#include <string.h>
#include <time.h>

static uint64_t g_rng = 88172645463325252ULL;
static inline float frand(void) /* uniform in [-1, 1) */
{
    g_rng ^= g_rng << 13, g_rng ^= g_rng >> 7, g_rng ^= g_rng << 17;
    return (float)((g_rng >> 11) * 0x1.0p-53) * 2.0f - 1.0f;
}
static inline uint16_t bf(float f) /* round to nearest even */
{
    uint32_t u;
    memcpy(&u, &f, 4);
    u += 0x7fffu + ((u >> 16) & 1u);
    return (uint16_t)(u >> 16);
}
static inline float fb(uint16_t h)
{
    uint32_t u = (uint32_t)h << 16;
    float f;
    memcpy(&f, &u, 4);
    return f;
}
static inline double now_s(void)
{
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return ts.tv_sec + ts.tv_nsec * 1e-9;
}
static inline int cmp_double(const void *a, const void *b)
{
    double x = *(const double *)a, y = *(const double *)b;
    return (x > y) - (x < y);
}
#endif

/* gpu_util.h - small helpers the GPU tests and benchmarks share: a seeded
 * random stream, bf16 rounding as the backend does it, a wall clock, a
 * comparator for medians, device buffers (a copy of host data, poisoned with
 * NaN, zeroed; a checked copy back) and the relative error the kernel tests
 * report. Header-only (static inline). */
#ifndef SLUICE_TESTS_GPU_UTIL_H
#define SLUICE_TESTS_GPU_UTIL_H

#include <cuda_runtime.h>
#include <math.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
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
/* n bytes on the device (16 when n is 0), a copy of h when h is given;
 * aborts when the device has no room (a test cannot go on). These set-up
 * helpers return only once the device holds the bytes: a pageable copy or a
 * memset may still be in flight when it returns, and a kernel on a
 * non-blocking stream does not wait for the legacy stream they run on. */
static inline void *dup_dev(const void *h, size_t n)
{
    void *d = NULL;
    if (cudaMalloc(&d, n ? n : 16) != cudaSuccess) abort();
    if (h && n) cudaMemcpy(d, h, n, cudaMemcpyHostToDevice);
    cudaDeviceSynchronize();
    return d;
}
/* n bytes of 0xff: NaN in f32 and bf16, so a value a kernel never wrote fails */
static inline void *poisoned(size_t n)
{
    void *d = dup_dev(NULL, n);
    cudaMemset(d, 0xff, n ? n : 16);
    cudaDeviceSynchronize();
    return d;
}
static inline void *zeroed(size_t n)
{
    void *d = dup_dev(NULL, n);
    cudaMemset(d, 0, n ? n : 16);
    cudaDeviceSynchronize();
    return d;
}
/* n bytes back to h; a failed copy says why and leaves h NaN */
static inline void get(void *h, const void *d, size_t n)
{
    if (cudaMemcpy(h, d, n, cudaMemcpyDeviceToHost) != cudaSuccess) {
        printf("  copy back failed: %s\n", cudaGetErrorString(cudaGetLastError()));
        memset(h, 0xff, n);
    }
}
/* ||a - b|| / ||b||; NaN anywhere -> inf */
static inline double nerr(const float *a, const double *b, size_t n)
{
    double num = 0, den = 0;
    for (size_t i = 0; i < n; i++) {
        if (isnan(a[i])) return INFINITY;
        num += (a[i] - b[i]) * (a[i] - b[i]);
        den += b[i] * b[i];
    }
    return sqrt(num / (den > 0 ? den : 1));
}

#endif

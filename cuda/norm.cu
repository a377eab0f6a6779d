/* norm.cu - embedding gather and the fused residual add + RMSNorm (kernels.h). */
#include <stdlib.h>
#include <string.h>

#include "cuda/bf16.cuh"
#include "cuda/kernels.h"
#include "cuda/norm.cuh"
#include "cuda/pdl.cuh"

static __global__ void embed_kernel(const uint16_t *tab, const int32_t *ids, int E, float *x)
{
    int t = blockIdx.x;
    const uint16_t *row = tab + (size_t)ids[t] * E;
    for (int i = threadIdx.x; i < E; i += blockDim.x) x[(size_t)t * E + i] = bf2f(row[i]);
}

/* One block of rms_threads(E) threads per row (a PDL launch: pdl.cuh); the sum of squares in f32 in
 * norm.cuh's order (the CPU reference sums in double: a ~1e-7 difference). */
static __global__ void add_rmsnorm_kernel(float *x, const uint16_t *delta, const float *w,
                                          const int32_t *rows, int E, float eps, uint16_t *out)
{
    __shared__ float sh[32];
    pdl_trigger();
    pdl_wait();
    int r = blockIdx.x;
    int t = rows ? rows[r] : r;
    float *xr = x + (size_t)t * E;
    const uint16_t *dr = delta ? delta + (size_t)t * E : NULL;
    float ss = 0.0f;
    for (int i = threadIdx.x; i < E; i += blockDim.x) {
        float v = xr[i];
        if (dr) {
            v += bf2f(dr[i]);
            if (!rows) xr[i] = v;
        }
        ss = rms_acc(ss, v);
    }
    ss = block_sum(ss, sh);
    float inv = rms_inv(ss, E, eps);
    uint16_t *o = out + (size_t)r * E;
    for (int i = threadIdx.x; i < E; i += blockDim.x) {
        /* each thread reads back what it wrote itself: no barrier needed */
        float v = xr[i];
        if (dr && rows) v += bf2f(dr[i]);
        o[i] = rms_out(w[i], v, inv);
    }
}

/* Steps of more than CUDA_GEMV_MAX_T rows (prefill), where a cuBLAS GEMM
 * follows and norm.cuh's order (the GEMV prologue's) need not be kept: 256
 * threads per row of E = 1024 NV, each with NV 4-element chunks (at 4 (c 256
 * + thread)) loaded at once and kept in registers, summed chunk by chunk. */
#define WIDE_THREADS 256
template <int NV>
static __global__ void __launch_bounds__(WIDE_THREADS) add_rmsnorm_wide_kernel(float *x, const uint16_t *delta,
                                                                              const float *w, int E, float eps,
                                                                              uint16_t *out)
{
    __shared__ float sh[32];
    pdl_trigger();
    pdl_wait();
    const int tid = threadIdx.x;
    float4 *xr = (float4 *)(x + (size_t)blockIdx.x * E);
    float4 v[NV];
#pragma unroll
    for (int c = 0; c < NV; c++) v[c] = xr[c * WIDE_THREADS + tid];
    if (delta) {
        const uint2 *dr = (const uint2 *)(delta + (size_t)blockIdx.x * E);
        uint2 d[NV];
#pragma unroll
        for (int c = 0; c < NV; c++) d[c] = dr[c * WIDE_THREADS + tid];
#pragma unroll
        for (int c = 0; c < NV; c++) {
            v[c].x += bf2f((uint16_t)d[c].x), v[c].y += bf2f((uint16_t)(d[c].x >> 16));
            v[c].z += bf2f((uint16_t)d[c].y), v[c].w += bf2f((uint16_t)(d[c].y >> 16));
            xr[c * WIDE_THREADS + tid] = v[c];
        }
    }
    float ss = 0.0f;
#pragma unroll
    for (int c = 0; c < NV; c++) ss = rms_acc(rms_acc(rms_acc(rms_acc(ss, v[c].x), v[c].y), v[c].z), v[c].w);
    float inv = rms_inv(block_sum(ss, sh), E, eps);
    const float4 *w4 = (const float4 *)w;
    uint2 *o = (uint2 *)(out + (size_t)blockIdx.x * E);
#pragma unroll
    for (int c = 0; c < NV; c++) {
        float4 g = w4[c * WIDE_THREADS + tid];
        o[c * WIDE_THREADS + tid] = make_uint2(rms_out(g.x, v[c].x, inv) | (uint32_t)rms_out(g.y, v[c].y, inv) << 16,
                                               rms_out(g.z, v[c].z, inv) | (uint32_t)rms_out(g.w, v[c].w, inv) << 16);
    }
}

static int threads_for(int n)
{
    int t = 32;
    while (t < n && t < 1024) t *= 2;
    return t;
}

extern "C" cudaError_t cuda_embed(const uint16_t *tab, const int32_t *ids, int T, int E, float *x, cudaStream_t st)
{
    if (T <= 0) return cudaSuccess;
    embed_kernel<<<T, threads_for(E > 1024 ? 1024 : E), 0, st>>>(tab, ids, E, x);
    return cudaGetLastError();
}

extern "C" cudaError_t cuda_add_rmsnorm(float *x, const uint16_t *delta, const float *w, const int32_t *rows,
                                        int T, int E, float eps, uint16_t *out, cudaStream_t st)
{
    if (T <= 0) return cudaSuccess;
    if (!rows && T > CUDA_GEMV_MAX_T && E % 1024 == 0) {
        dim3 g(T), b(WIDE_THREADS);
        switch (E / 1024) {
        case 1: return pdl_launch(add_rmsnorm_wide_kernel<1>, g, b, 0, st, x, delta, w, E, eps, out);
        case 2: return pdl_launch(add_rmsnorm_wide_kernel<2>, g, b, 0, st, x, delta, w, E, eps, out);
        case 3: return pdl_launch(add_rmsnorm_wide_kernel<3>, g, b, 0, st, x, delta, w, E, eps, out);
        case 4: return pdl_launch(add_rmsnorm_wide_kernel<4>, g, b, 0, st, x, delta, w, E, eps, out);
        case 5: return pdl_launch(add_rmsnorm_wide_kernel<5>, g, b, 0, st, x, delta, w, E, eps, out);
        case 6: return pdl_launch(add_rmsnorm_wide_kernel<6>, g, b, 0, st, x, delta, w, E, eps, out);
        case 8: return pdl_launch(add_rmsnorm_wide_kernel<8>, g, b, 0, st, x, delta, w, E, eps, out);
        }
    }
    return pdl_launch(add_rmsnorm_kernel, dim3(T), dim3(rms_threads(E)), 0, st, x, delta, w, rows, E, eps, out);
}

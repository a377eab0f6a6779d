/* gemv.cu - y = x W^T for a few rows of x (decode), bandwidth-bound
 * (kernels.h). cuBLAS's bf16 path for n <= 4 reads the weights at well under
 * the copy bandwidth; here each warp streams one weight row with 16-byte
 * loads (all of them in flight: the row is unrolled), dots it with every x
 * row (read through L1/L2, tiny), and reduces across the warp. */
#include "cuda/bf16.cuh"
#include "cuda/kernels.h"

#define GEMV_WARPS 8

template <int NT, bool F32OUT>
static __global__ void __launch_bounds__(32 * GEMV_WARPS) gemv_kernel(const uint16_t *__restrict__ W,
                                                                      const uint16_t *__restrict__ x, void *y,
                                                                      int in, int out)
{
    int lane = threadIdx.x & 31;
    int row = blockIdx.x * GEMV_WARPS + (threadIdx.x >> 5);
    if (row >= out) return;
    const uint4 *w4 = (const uint4 *)(W + (size_t)row * in);
    int n4 = in / 8;
    float acc[NT];
#pragma unroll
    for (int t = 0; t < NT; t++) acc[t] = 0.0f;
#pragma unroll 4
    for (int i = lane; i < n4; i += 32) {
        uint4 wv = __ldcs(w4 + i); /* streamed once: keep it out of the way of x in L1 */
        const uint16_t *wh = (const uint16_t *)&wv;
        float wf[8];
#pragma unroll
        for (int e = 0; e < 8; e++) wf[e] = bf2f(wh[e]);
#pragma unroll
        for (int t = 0; t < NT; t++) {
            uint4 xv = __ldg((const uint4 *)(x + (size_t)t * in) + i);
            const uint16_t *xh = (const uint16_t *)&xv;
#pragma unroll
            for (int e = 0; e < 8; e++) acc[t] += wf[e] * bf2f(xh[e]);
        }
    }
#pragma unroll
    for (int t = 0; t < NT; t++) {
        float s = warp_sum(acc[t]);
        if (lane == 0) {
            if (F32OUT)
                ((float *)y)[(size_t)t * out + row] = s;
            else
                ((uint16_t *)y)[(size_t)t * out + row] = f2bf(s);
        }
    }
}

template <bool F32OUT>
static cudaError_t launch(const uint16_t *W, const uint16_t *x, void *y, int T, int in, int out, cudaStream_t st)
{
    dim3 grid((out + GEMV_WARPS - 1) / GEMV_WARPS);
    switch (T) {
    case 1: gemv_kernel<1, F32OUT><<<grid, 32 * GEMV_WARPS, 0, st>>>(W, x, y, in, out); break;
    case 2: gemv_kernel<2, F32OUT><<<grid, 32 * GEMV_WARPS, 0, st>>>(W, x, y, in, out); break;
    case 3: gemv_kernel<3, F32OUT><<<grid, 32 * GEMV_WARPS, 0, st>>>(W, x, y, in, out); break;
    case 4: gemv_kernel<4, F32OUT><<<grid, 32 * GEMV_WARPS, 0, st>>>(W, x, y, in, out); break;
    default: return cudaErrorInvalidValue;
    }
    return cudaGetLastError();
}

extern "C" cudaError_t cuda_gemv(const uint16_t *W, const uint16_t *x, void *y, bool y_f32, int T, int in, int out,
                                 cudaStream_t st)
{
    if (T < 1 || T > CUDA_GEMV_MAX_T || in % 8 || ((uintptr_t)W | (uintptr_t)x) % 16) return cudaErrorInvalidValue;
    return y_f32 ? launch<true>(W, x, y, T, in, out, st) : launch<false>(W, x, y, T, in, out, st);
}

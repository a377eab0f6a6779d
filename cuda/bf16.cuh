/* bf16.cuh - device helpers shared by the kernels (internal to cuda/). */
#ifndef SLUICE_CUDA_BF16_CUH
#define SLUICE_CUDA_BF16_CUH

#include <cuda_bf16.h>
#include <stdint.h>

static __device__ __forceinline__ float bf2f(uint16_t v) { return __uint_as_float((uint32_t)v << 16); }
static __device__ __forceinline__ uint16_t f2bf(float f)
{
    __nv_bfloat16 b = __float2bfloat16_rn(f);
    return *(uint16_t *)&b;
}
static __device__ __forceinline__ float warp_sum(float v)
{
    for (int o = 16; o; o >>= 1) v += __shfl_xor_sync(0xffffffffu, v, o);
    return v;
}
static __device__ __forceinline__ float warp_max(float v)
{
    for (int o = 16; o; o >>= 1) v = fmaxf(v, __shfl_xor_sync(0xffffffffu, v, o));
    return v;
}
/* Sum over the block (blockDim.x a multiple of 32, <= 1024); sh has 32 floats. */
static __device__ __forceinline__ float block_sum(float v, float *sh)
{
    int lane = threadIdx.x & 31, w = threadIdx.x >> 5, nw = blockDim.x >> 5;
    v = warp_sum(v);
    __syncthreads();
    if (lane == 0) sh[w] = v;
    __syncthreads();
    v = lane < nw ? sh[lane] : 0.0f;
    return warp_sum(v);
}
static __device__ __forceinline__ float block_max(float v, float *sh)
{
    int lane = threadIdx.x & 31, w = threadIdx.x >> 5, nw = blockDim.x >> 5;
    v = warp_max(v);
    __syncthreads();
    if (lane == 0) sh[w] = v;
    __syncthreads();
    v = lane < nw ? sh[lane] : -INFINITY;
    return warp_max(v);
}
/* Argmax over the block in (value desc, id asc) order: each thread passes its
 * own best (*v, *i) and every thread gets the block's back. shv, shi: 32
 * entries of shared memory each. */
static __device__ __forceinline__ void block_argmax(float *v, int *i, float *shv, int *shi)
{
    float best = *v;
    int bi = *i;
    for (int o = 16; o; o >>= 1) {
        float ov = __shfl_xor_sync(0xffffffffu, best, o);
        int oi = __shfl_xor_sync(0xffffffffu, bi, o);
        if (ov > best || (ov == best && oi < bi)) best = ov, bi = oi;
    }
    int lane = threadIdx.x & 31, w = threadIdx.x >> 5, nw = blockDim.x >> 5;
    if (lane == 0) shv[w] = best, shi[w] = bi;
    __syncthreads();
    if (w == 0) {
        best = lane < nw ? shv[lane] : -INFINITY;
        bi = lane < nw ? shi[lane] : 0x7fffffff;
        for (int o = 16; o; o >>= 1) {
            float ov = __shfl_xor_sync(0xffffffffu, best, o);
            int oi = __shfl_xor_sync(0xffffffffu, bi, o);
            if (ov > best || (ov == best && oi < bi)) best = ov, bi = oi;
        }
        if (lane == 0) shv[0] = best, shi[0] = bi;
    }
    __syncthreads();
    *v = shv[0];
    *i = shi[0];
}
#endif

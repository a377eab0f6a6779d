/* bf16.cuh - device helpers shared by the kernels (internal to cuda/). */
#ifndef SLUICE_CUDA_BF16_CUH
#define SLUICE_CUDA_BF16_CUH

#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_fp8.h>
#include <stdint.h>

static __device__ __forceinline__ float bf2f(uint16_t v) { return __uint_as_float((uint32_t)v << 16); }
static __device__ __forceinline__ uint16_t f2bf(float f)
{
    __nv_bfloat16 b = __float2bfloat16_rn(f);
    return *(uint16_t *)&b;
}
/* SwiGLU of one bf16 gate/up pair: bf16(silu(g) * u); every SwiGLU kernel
 * and epilogue (act.cu, gemv.cu, gemm_wg.cu) computes it so, bit for bit.
 * The approximate division (2 ulp; 0 where 1 + e^-g passes 2^126, g < -87,
 * where silu(g) rounds to a bf16 denormal at most) keeps it short. */
static __device__ __forceinline__ uint16_t swiglu1(uint16_t g16, uint16_t u16)
{
    float g = bf2f(g16), u = bf2f(u16);
    return f2bf(__fdividef(g, 1.0f + __expf(-g)) * u);
}
/* fp8 e4m3 KV cache (scale 1): f -> e4m3, rounded to nearest even, saturated
 * to +-448; two e4m3 (the first in the low byte) -> packed f16x2, f32 or
 * packed bf16x2, exact (every e4m3 value is an f16 and a bf16 value) */
static __device__ __forceinline__ uint8_t f2e4m3(float f)
{
    return (uint8_t)__nv_cvt_float_to_fp8(f, __NV_SATFINITE, __NV_E4M3);
}
static __device__ __forceinline__ uint32_t e4m3x2_to_h2(uint16_t v) /* packed f16x2 */
{
    __half2_raw h = __nv_cvt_fp8x2_to_halfraw2((__nv_fp8x2_storage_t)v, __NV_E4M3);
    return (uint32_t)h.x | (uint32_t)h.y << 16;
}
static __device__ __forceinline__ float2 e4m3x2_to_f2(uint16_t v)
{
    __half2_raw h = __nv_cvt_fp8x2_to_halfraw2((__nv_fp8x2_storage_t)v, __NV_E4M3);
    return __half22float2(*(const __half2 *)&h);
}
static __device__ __forceinline__ uint32_t e4m3x2_to_bf2(uint16_t v)
{
    float2 f = e4m3x2_to_f2(v);
    __nv_bfloat162 b = __floats2bfloat162_rn(f.x, f.y);
    return *(const uint32_t *)&b;
}
/* 8 e4m3 (bytes in order) -> 8 f32 */
static __device__ __forceinline__ void e4m3x8_to_f(uint2 v, float *f)
{
    const uint16_t *h = (const uint16_t *)&v;
#pragma unroll
    for (int i = 0; i < 4; i++) {
        float2 p = e4m3x2_to_f2(h[i]);
        f[2 * i] = p.x, f[2 * i + 1] = p.y;
    }
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

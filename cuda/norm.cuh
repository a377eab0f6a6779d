/* norm.cuh - the arithmetic of RMSNorm, shared by norm.cu (cuda_add_rmsnorm)
 * and gemv.cu (the GEMVs that normalize their input in a prologue), so the
 * fused path produces bit for bit the bf16 vector the unfused one does
 * (internal to cuda/).
 *
 * The order of the sum of squares is part of the contract: rms_threads(E)
 * threads, thread i summing x[i], x[i + n], x[i + 2n], ... with one fma each,
 * then warp_sum in each warp, then warp_sum over the warps' sums in warp
 * order (bf16.cuh's block_sum). */
#ifndef SLUICE_CUDA_NORM_CUH
#define SLUICE_CUDA_NORM_CUH

#include "cuda/bf16.cuh"

/* threads (a power of two, 32 .. 1024) that sum one row of E */
static __host__ __device__ __forceinline__ int rms_threads(int E)
{
    int n = E / 4 < 32 ? 32 : E / 4, t = 32;
    while (t < n && t < 1024) t *= 2;
    return t;
}
static __device__ __forceinline__ float rms_acc(float ss, float v) { return __fmaf_rn(v, v, ss); }
static __device__ __forceinline__ float rms_inv(float ss, int E, float eps) { return rsqrtf(ss / (float)E + eps); }
static __device__ __forceinline__ uint16_t rms_out(float w, float v, float inv) { return f2bf(w * (v * inv)); }

#endif

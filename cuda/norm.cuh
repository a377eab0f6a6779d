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

/* The RMSNorm of one row of E floats with the bits cuda_add_rmsnorm gives
 * it, by a block of any size (blockDim.x a multiple of 32, rms_threads(E)
 * a multiple of it or smaller), in a GEMV's prologue (qgemm.cu, moe.cu):
 * thread tid plays the threads tid + j blockDim.x (j < RMS_J) of
 * rms_threads(E), each value of the row that thread sums held in a
 * register (v[j][k]: element tid + j blockDim.x + k rms_threads(E), k <
 * RMS_K; 0 past the row, and fma(0, 0, s) == s), so the row is one round of
 * loads. rms_regs_fit(E, blockDim.x): E within those registers (up to 16
 * blockDim.x); the callers' hosts check it. */
#define RMS_J 4
#define RMS_K 4
static __host__ __device__ __forceinline__ bool rms_regs_fit(int E, int bd)
{
    const int nv = rms_threads(E);
    return E > 0 && bd % 32 == 0 && E <= RMS_K * nv && (nv % bd == 0 ? nv / bd <= RMS_J : nv < bd);
}
/* row's values (x, or the norm's weights) into v */
static __device__ __forceinline__ void rms_load(const float *row, int E, float (&v)[RMS_J][RMS_K])
{
    const int nv = rms_threads(E), bd = (int)blockDim.x, tid = threadIdx.x;
#pragma unroll
    for (int j = 0; j < RMS_J; j++)
#pragma unroll
        for (int k = 0; k < RMS_K; k++) {
            const int t = tid + j * bd, i = t + k * nv;
            v[j][k] = t < nv && i < E ? row[i] : 0.0f;
        }
}
/* the inverse RMS from v (rms_load's x); sh: 32 floats, free again only after a barrier. Every thread of
 * the block calls it and gets inv. */
static __device__ __forceinline__ float rms_inv_regs(const float (&v)[RMS_J][RMS_K], int E, float eps, float *sh)
{
    const int nv = rms_threads(E), bd = (int)blockDim.x, tid = threadIdx.x, lane = tid & 31;
#pragma unroll
    for (int j = 0; j < RMS_J; j++) {
        float ss = 0.0f;
#pragma unroll
        for (int k = 0; k < RMS_K; k++) ss = rms_acc(ss, v[j][k]);
        ss = warp_sum(ss);
        const int t = tid + j * bd;
        if (lane == 0 && t < nv) sh[t >> 5] = ss;
    }
    __syncthreads();
    return rms_inv(warp_sum(lane < nv / 32 ? sh[lane] : 0.0f), E, eps);
}
/* out[i] = rms_out(w[i], x[i], inv) for the row's elements this thread holds */
static __device__ __forceinline__ void rms_store(const float (&x)[RMS_J][RMS_K], const float (&w)[RMS_J][RMS_K],
                                                 int E, float inv, uint16_t *out)
{
    const int nv = rms_threads(E), bd = (int)blockDim.x, tid = threadIdx.x;
#pragma unroll
    for (int j = 0; j < RMS_J; j++)
#pragma unroll
        for (int k = 0; k < RMS_K; k++) {
            const int t = tid + j * bd, i = t + k * nv;
            if (t < nv && i < E) out[i] = rms_out(w[j][k], x[j][k], inv);
        }
}

#endif

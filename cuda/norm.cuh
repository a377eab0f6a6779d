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

/* barriers and loads for rms_rows256 */
struct sync_block {
    __device__ __forceinline__ void operator()() const { __syncthreads(); }
};
struct ld_plain {
    __device__ __forceinline__ float operator()(const float *p) const { return *p; }
};

/* The NT rows of xf ([NT][in] f32) through cuda_add_rmsnorm's arithmetic
 * into xs ([NT][in] bf16, shared memory) by threads 0..255 of the block:
 * nv <= 1024 virtual threads; virtual warp warp + 8k is this warp's k-th,
 * its sum in nsh[k] (32 floats, shared). The loops run over i0 outside and
 * k inside so that a thread's loads are independent of each other. sync():
 * a barrier of those 256 threads; ld(p): how xf is read. Ends with sync(). */
template <int NT, typename Sync, typename Ld>
static __device__ __forceinline__ void rms_rows256(const float *xf, const float *nw, float eps, int in, uint16_t *xs,
                                                   float *nsh, Sync sync, Ld ld)
{
    const int tid = threadIdx.x, lane = tid & 31, warp = tid >> 5;
    const int nv = rms_threads(in), nvw = nv / 32;
    for (int t = 0; t < NT; t++) {
        const float *xr = xf + (size_t)t * in;
        float ss[4] = {0.0f, 0.0f, 0.0f, 0.0f};
#pragma unroll 4
        for (int i0 = 0; i0 < in; i0 += nv)
#pragma unroll
            for (int k = 0; k < 4; k++) {
                int vw = warp + 8 * k, i = i0 + vw * 32 + lane;
                if (vw < nvw && i < in) ss[k] = rms_acc(ss[k], ld(xr + i));
            }
#pragma unroll
        for (int k = 0; k < 4; k++) {
            float s = warp_sum(ss[k]);
            if (lane == 0 && warp + 8 * k < nvw) nsh[warp + 8 * k] = s;
        }
        sync();
        float inv = rms_inv(warp_sum(lane < nvw ? nsh[lane] : 0.0f), in, eps);
#pragma unroll 4
        for (int i = tid; i < in; i += 256) xs[(size_t)t * in + i] = rms_out(nw[i], ld(xr + i), inv);
        sync(); /* xs complete; nsh free for the next row */
    }
}

#endif

/* tile.cuh - shared-memory staging and small math helpers of the attention
 * kernels (attn.cu, attn_wg.cu; internal to cuda/). */
#ifndef SLUICE_CUDA_TILE_CUH
#define SLUICE_CUDA_TILE_CUH

#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <stdint.h>

#include "cuda/kernels.h"

static __device__ __forceinline__ uint32_t smem_u32(const void *p) { return (uint32_t)__cvta_generic_to_shared(p); }

/* This block's item into wi: item blockIdx.x, or with rev the
 * blockIdx.x-th from the last (longest first in a prefill step); false past
 * *n_items. items holds max_items = gridDim.x entries, so the item is
 * loaded together with n_items, not after it (prefill steps launch exactly
 * n_items blocks: the guess from the last holds). */
static __device__ __forceinline__ bool attn_item(const struct cuda_attn_args &a, bool rev, struct cuda_attn_item &wi)
{
    const int bx = (int)blockIdx.x, guess = rev ? (int)gridDim.x - 1 - bx : bx;
    wi = a.items[guess];
    const int n = *a.n_items, it = rev ? n - 1 - bx : bx;
    if (it < 0 || it >= n) return false;
    if (it != guess) wi = a.items[it];
    return true;
}
/* 16 bytes global -> shared, L2 only; ok == false writes 16 zero bytes and reads nothing */
static __device__ __forceinline__ void cp_async16(uint32_t dst, const void *src, bool ok)
{
    asm volatile("cp.async.cg.shared.global [%0], [%1], 16, %2;\n" ::"r"(dst), "l"(src), "r"(ok ? 16 : 0) : "memory");
}
static __device__ __forceinline__ void cp_async_commit(void) { asm volatile("cp.async.commit_group;\n" ::: "memory"); }
template <int N>
static __device__ __forceinline__ void cp_async_wait(void)
{
    asm volatile("cp.async.wait_group %0;\n" ::"n"(N) : "memory");
}
static __device__ __forceinline__ float ex2(float x)
{
    float y;
    asm("ex2.approx.ftz.f32 %0, %1;\n" : "=f"(y) : "f"(x));
    return y;
}
/* lo in the low half: the lower column / key index of an mma fragment pair */
static __device__ __forceinline__ uint32_t pack_bf2(float lo, float hi)
{
    __nv_bfloat162 v = __floats2bfloat162_rn(lo, hi);
    return *reinterpret_cast<uint32_t *>(&v);
}
static __device__ __forceinline__ uint32_t pack_h2(float lo, float hi)
{
    __half2 v = __floats2half2_rn(lo, hi);
    return *reinterpret_cast<uint32_t *>(&v);
}

/* One step of the online softmax for this lane's two query rows of a
 * prefill tile: x0, x1 are their largest scores among the lane's columns
 * (a row lives in the 4 lanes of a quad); the running maxima m0, m1 (log2
 * units; scores scale by sl2) move on, the row sums l0, l1 take the factors
 * c0, c1 (the accumulators must too), and u0, u1 are what to subtract from
 * the scaled scores before exp2 (0, not -inf, for a row that has seen
 * nothing yet: its p stay 0 and its zeros, not NaN). */
static __device__ __forceinline__ void softmax_step(float x0, float x1, float sl2, float &m0, float &m1, float &l0,
                                                    float &l1, float &u0, float &u1, float &c0, float &c1)
{
    x0 = fmaxf(x0, __shfl_xor_sync(0xffffffffu, x0, 1));
    x0 = fmaxf(x0, __shfl_xor_sync(0xffffffffu, x0, 2));
    x1 = fmaxf(x1, __shfl_xor_sync(0xffffffffu, x1, 1));
    x1 = fmaxf(x1, __shfl_xor_sync(0xffffffffu, x1, 2));
    float n0 = fmaxf(m0, x0 * sl2), n1 = fmaxf(m1, x1 * sl2);
    u0 = n0 == -INFINITY ? 0.0f : n0, u1 = n1 == -INFINITY ? 0.0f : n1;
    c0 = ex2(m0 - u0), c1 = ex2(m1 - u1);
    m0 = n0, m1 = n1;
    l0 *= c0, l1 *= c1;
}

/* The end of a prefill tile kernel (attn_tc_kernel, attn_wg_kernel) for
 * this lane's two query rows r0 and r0 + 8 of item wi: the row sums l0, l1
 * summed over the lane's quad, then O / l as bf16, or the SIMT kernel's
 * partial for a split item (max in natural-log units, unnormalized acc).
 * D: the value width (a.Dv, or a.D where that is 0); the output rows hold
 * the first a.Do of its columns where a.Do > 0 (even), else all D.
 * oa(dt, e): the lane's O accumulator e (an mma C fragment's order) of
 * columns 8 dt + 2 (lane & 3) .. + 1; rows from nrows on are dropped. */
template <int D, typename OA>
static __device__ __forceinline__ void tc_store_rows(const struct cuda_attn_args &a, const struct cuda_attn_item &wi,
                                                     int g, int grp, int nrows, int r0, float l0, float l1, float m0,
                                                     float m1, OA oa)
{
    constexpr int DT = D / 8;
    const int lane = threadIdx.x & 31;
    l0 += __shfl_xor_sync(0xffffffffu, l0, 1);
    l0 += __shfl_xor_sync(0xffffffffu, l0, 2);
    l1 += __shfl_xor_sync(0xffffffffu, l1, 1);
    l1 += __shfl_xor_sync(0xffffffffu, l1, 2);
#pragma unroll
    for (int hf = 0; hf < 2; hf++) {
        int r = r0 + 8 * hf;
        if (r >= nrows) continue;
        int t = wi.t0 + r / grp, h = g * grp + r % grp, d0 = (lane & 3) * 2;
        float l = hf ? l1 : l0, m = hf ? m1 : m0;
        if (wi.nsplit <= 1) {
            float inv = l > 0.0f ? 1.0f / l : 0.0f;
            const int Do = a.Do > 0 ? a.Do : D; /* a narrower output drops the padding columns */
            uint16_t *op = a.out + ((size_t)t * a.H + h) * Do + d0;
#pragma unroll
            for (int dt = 0; dt < DT; dt++)
                if (Do == D || dt * 8 + d0 < Do)
                    *(uint32_t *)(op + dt * 8) = pack_bf2(oa(dt, 2 * hf) * inv, oa(dt, 2 * hf + 1) * inv);
        } else {
            int ps = a.pstride > 0 ? a.pstride : CUDA_ATTN_MAXSPLIT;
            float *pp = a.part + (((size_t)(wi.part + r) * a.KVH + g) * ps + wi.split) * (D + 2);
            if ((lane & 3) == 0) pp[0] = m * 0.6931471805599453f, pp[1] = l;
#pragma unroll
            for (int dt = 0; dt < DT; dt++) pp[2 + dt * 8 + d0] = oa(dt, 2 * hf), pp[3 + dt * 8 + d0] = oa(dt, 2 * hf + 1);
        }
    }
}

#endif

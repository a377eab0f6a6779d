/* rope.cuh - one head of one token through the step between the QKV
 * projection and attention (internal to cuda/): shared by rope.cu's kernel
 * and the decode attention kernel, which folds it in (attn.cu), so both
 * write the same bits (bf16, or fp8 e4m3 into an fp8 KV cache). */
#ifndef SLUICE_CUDA_ROPE_CUH
#define SLUICE_CUDA_ROPE_CUH

#include "cuda/bf16.cuh"
#include "cuda/kernels.h"

#define ROPE_MAXD 256

/* dst[i] = x as bf16, or as fp8 e4m3 (f8: a KV cache row of the fp8 cache) */
static __device__ __forceinline__ void rope_put(void *dst, int i, float x, bool f8)
{
    if (f8)
        ((uint8_t *)dst)[i] = f2e4m3(x);
    else
        ((uint16_t *)dst)[i] = f2bf(x);
}

/* One warp: head h (q heads, then k heads, then v heads) of token t: add the
 * QKV bias, RMSNorm q and k over head_dim, rotate q and k, write to dst [D]:
 * bf16, or fp8 e4m3 when f8 (K and V heads into the fp8 cache). v: the
 * warp's scratch of D floats (shared memory). */
static __device__ __forceinline__ void rope_head(const struct cuda_rope_args &a, int t, int h, float *v, void *dst,
                                                 bool f8)
{
    int lane = threadIdx.x & 31, D = a.D, nh = a.H + 2 * a.KVH, half = a.rope_dim / 2;
    int p = a.pos[t];
    const float *cs = a.cos + (size_t)p * half, *sn = a.sin + (size_t)p * half;
    const uint16_t *src = a.qkv + ((size_t)t * nh + h) * D;
    const float *bias = a.bias ? a.bias + (size_t)h * D : NULL;
    float ss = 0.0f;
    for (int d = lane; d < D; d += 32) {
        float x = bf2f(src[d]);
        if (bias) x += bias[d];
        v[d] = x;
        ss += x * x;
    }
    bool isq = h < a.H, isk = !isq && h < a.H + a.KVH;
    const float *nw = isq ? a.q_norm : isk ? a.k_norm : NULL;
    if (nw) {
        ss = warp_sum(ss);
        float inv = rsqrtf(ss / (float)D + a.eps);
        for (int d = lane; d < D; d += 32) v[d] = nw[d] * (v[d] * inv);
    }
    __syncwarp();
    if (isq || isk) {
        for (int i = lane; i < half; i += 32) {
            int i0 = a.neox ? i : 2 * i, i1 = a.neox ? i + half : 2 * i + 1;
            float x0 = v[i0], x1 = v[i1];
            rope_put(dst, i0, x0 * cs[i] - x1 * sn[i], f8);
            rope_put(dst, i1, x0 * sn[i] + x1 * cs[i], f8);
        }
        for (int d = a.rope_dim + lane; d < D; d += 32) rope_put(dst, d, v[d], f8);
    } else {
        for (int d = lane; d < D; d += 32) rope_put(dst, d, v[d], f8);
    }
    __syncwarp();
}

#endif

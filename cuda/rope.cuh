/* rope.cuh - one head of one token through the step between the QKV
 * projection and attention (internal to cuda/): shared by rope.cu's kernel
 * and the decode attention kernel, which folds it in (attn.cu), so both
 * write the same bits. */
#ifndef SLUICE_CUDA_ROPE_CUH
#define SLUICE_CUDA_ROPE_CUH

#include "cuda/bf16.cuh"
#include "cuda/kernels.h"

#define ROPE_MAXD 256

/* One warp: head h (q heads, then k heads, then v heads) of token t: add the
 * QKV bias, RMSNorm q and k over head_dim, rotate q and k, write bf16 to dst
 * [D]. v: the warp's scratch of D floats (shared memory). */
static __device__ __forceinline__ void rope_head(const struct cuda_rope_args &a, int t, int h, float *v,
                                                 uint16_t *dst)
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
            dst[i0] = f2bf(x0 * cs[i] - x1 * sn[i]);
            dst[i1] = f2bf(x0 * sn[i] + x1 * cs[i]);
        }
        for (int d = a.rope_dim + lane; d < D; d += 32) dst[d] = f2bf(v[d]);
    } else {
        for (int d = lane; d < D; d += 32) dst[d] = f2bf(v[d]);
    }
    __syncwarp();
}

#endif

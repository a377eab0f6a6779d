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

/* rope_head for D = 32 V with the whole head rotated (Llama, Qwen: D 128;
 * SmolLM2: D 64), as rope_vec_load then rope_vec_finish: lane l holds
 * elements [lV, lV + V) in registers, so a head is one V-element load and
 * one store per lane, no shared memory. NORM pairs (2i, 2i + 1) sit in one
 * lane; a NEOX pair (i, i + D/2) in lanes l and l ^ 16. Same arithmetic per
 * element as the general path; the q/k norm's sum of squares runs in this
 * layout's order. ROPE_VEC_OK: the shapes it takes (rope.cu's kernel picks
 * by it too). */
#define ROPE_VEC_OK(D, rope_dim) ((rope_dim) == (D) && ((D) == 128 || (D) == 64))
template <int V>
static __device__ __forceinline__ void rope_vec_load(const struct cuda_rope_args &a, int t, int h, float (&x)[V])
{
    const int nh = a.H + 2 * a.KVH, e0 = (threadIdx.x & 31) * V;
    const uint16_t *src = a.qkv + ((size_t)t * nh + h) * (32 * V) + e0;
    if constexpr (V == 4) {
        uint2 u = *(const uint2 *)src;
        x[0] = bf2f((uint16_t)u.x), x[1] = bf2f((uint16_t)(u.x >> 16));
        x[2] = bf2f((uint16_t)u.y), x[3] = bf2f((uint16_t)(u.y >> 16));
    } else {
        uint32_t u = *(const uint32_t *)src;
        x[0] = bf2f((uint16_t)u), x[1] = bf2f((uint16_t)(u >> 16));
    }
}
/* lane's cos and sin at position p for rope_vec_finish_cs (the tables:
 * no kernel of a step writes them) */
template <int V>
struct rope_cs {
    float c[V], s[V];
};
template <int V>
static __device__ __forceinline__ void rope_vec_cs(const struct cuda_rope_args &a, int p, rope_cs<V> &r)
{
    constexpr int half = 16 * V;
    const int lane = threadIdx.x & 31, e0 = lane * V;
    const float *cs = a.cos + (size_t)p * half, *sn = a.sin + (size_t)p * half;
#pragma unroll
    for (int j = 0; j < V; j++) {
        int i = a.neox ? (lane & 15) * V + j : (e0 + (j & ~1)) / 2;
        r.c[j] = cs[i], r.s[j] = sn[i];
    }
}
/* rope_vec_finish with the cos and sin from rope_vec_cs */
template <int V>
static __device__ __forceinline__ void rope_vec_finish_cs(const struct cuda_rope_args &a, int h, float (&x)[V],
                                                          const rope_cs<V> &r, void *dst, bool f8)
{
    constexpr int D = 32 * V;
    const int lane = threadIdx.x & 31, e0 = lane * V;
    if (a.bias)
#pragma unroll
        for (int j = 0; j < V; j++) x[j] += a.bias[(size_t)h * D + e0 + j];
    bool isq = h < a.H, isk = !isq && h < a.H + a.KVH;
    const float *nw = isq ? a.q_norm : isk ? a.k_norm : NULL;
    if (nw) {
        float ss = 0.0f;
#pragma unroll
        for (int j = 0; j < V; j++) ss += x[j] * x[j];
        float inv = rsqrtf(warp_sum(ss) / (float)D + a.eps);
#pragma unroll
        for (int j = 0; j < V; j++) x[j] = nw[e0 + j] * (x[j] * inv);
    }
    float y[V];
    if (isq || isk) {
        if (a.neox) {
            bool lo = lane < 16;
#pragma unroll
            for (int j = 0; j < V; j++) {
                float pr = __shfl_xor_sync(0xffffffffu, x[j], 16);
                y[j] = lo ? x[j] * r.c[j] - pr * r.s[j] : pr * r.s[j] + x[j] * r.c[j];
            }
        } else {
#pragma unroll
            for (int j = 0; j < V; j += 2) {
                y[j] = x[j] * r.c[j] - x[j + 1] * r.s[j];
                y[j + 1] = x[j] * r.s[j] + x[j + 1] * r.c[j];
            }
        }
    } else {
#pragma unroll
        for (int j = 0; j < V; j++) y[j] = x[j];
    }
    if (f8) {
        uint32_t u = 0;
#pragma unroll
        for (int j = 0; j < V; j++) u |= (uint32_t)f2e4m3(y[j]) << (8 * j);
        if constexpr (V == 4)
            ((uint32_t *)dst)[lane] = u;
        else
            ((uint16_t *)dst)[lane] = (uint16_t)u;
    } else {
        uint32_t u0 = f2bf(y[0]) | (uint32_t)f2bf(y[1]) << 16;
        if constexpr (V == 4)
            ((uint2 *)dst)[lane] = make_uint2(u0, f2bf(y[2]) | (uint32_t)f2bf(y[3]) << 16);
        else
            ((uint32_t *)dst)[lane] = u0;
    }
}

/* the rest of rope_head_vec for the head rope_vec_load read into x, at position p */
template <int V>
static __device__ __forceinline__ void rope_vec_finish(const struct cuda_rope_args &a, int h, int p, float (&x)[V],
                                                       void *dst, bool f8)
{
    rope_cs<V> r = {};
    if (h < a.H + a.KVH) rope_vec_cs<V>(a, p, r); /* q and k heads only: v is not rotated */
    rope_vec_finish_cs<V>(a, h, x, r, dst, f8);
}

template <int V>
static __device__ __forceinline__ void rope_head_vec(const struct cuda_rope_args &a, int t, int h, void *dst, bool f8)
{
    float x[V];
    rope_vec_load<V>(a, t, h, x);
    rope_vec_finish<V>(a, h, a.pos[t], x, dst, f8);
}

/* One warp: head h (q heads, then k heads, then v heads) of token t: add the
 * QKV bias, RMSNorm q and k over head_dim, rotate q and k, write to dst [D]:
 * bf16, or fp8 e4m3 when f8 (K and V heads into the fp8 cache). v: the
 * warp's scratch of D floats (shared memory; unused by rope_head_vec). dst
 * 8-byte aligned. */
static __device__ __forceinline__ void rope_head(const struct cuda_rope_args &a, int t, int h, float *v, void *dst,
                                                 bool f8)
{
    if (ROPE_VEC_OK(a.D, a.rope_dim)) {
        if (a.D == 128)
            rope_head_vec<4>(a, t, h, dst, f8);
        else
            rope_head_vec<2>(a, t, h, dst, f8);
        return;
    }
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

/* rope.cu - the step between the QKV projection and attention, fused
 * (kernels.h): per head, add the QKV bias (qwen2), RMSNorm q and k over
 * head_dim (qwen3), rotate q and k (NORM: adjacent pairs; NEOX: halves; the
 * cos/sin tables carry llama3 scaling), then write q out and k, v into their
 * paged KV slots. Blocks of ROPE_WARPS warps, one warp per head: grid (T,
 * heads / ROPE_WARPS), so a decode step's 48 heads run on 6 SMs at once, not
 * one after another on one. */
#include "cuda/bf16.cuh"
#include "cuda/kernels.h"

#define ROPE_WARPS 8
#define ROPE_MAXD 256

static __global__ void rope_kv_kernel(struct cuda_rope_args a)
{
    __shared__ float buf[ROPE_WARPS][ROPE_MAXD];
    int t = blockIdx.x, lane = threadIdx.x & 31, w = threadIdx.x >> 5;
    int D = a.D, nh = a.H + 2 * a.KVH, half = a.rope_dim / 2;
    int p = a.pos[t];
    const float *cs = a.cos + (size_t)p * half, *sn = a.sin + (size_t)p * half;
    int64_t slot = a.slots[t];
    float *v = buf[w];
    for (int h = blockIdx.y * ROPE_WARPS + w; h < nh; h += gridDim.y * ROPE_WARPS) {
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
        uint16_t *dst;
        if (isq)
            dst = a.q + ((size_t)t * a.H + h) * D;
        else if (isk)
            dst = a.kc + ((size_t)slot * a.KVH + (h - a.H)) * D;
        else
            dst = a.vc + ((size_t)slot * a.KVH + (h - a.H - a.KVH)) * D;
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
}

extern "C" cudaError_t cuda_rope_kv(const struct cuda_rope_args *a, cudaStream_t st)
{
    if (a->T <= 0) return cudaSuccess;
    if (a->D > ROPE_MAXD || a->rope_dim > a->D) return cudaErrorInvalidValue;
    int nh = a->H + 2 * a->KVH;
    rope_kv_kernel<<<dim3(a->T, (nh + ROPE_WARPS - 1) / ROPE_WARPS), 32 * ROPE_WARPS, 0, st>>>(*a);
    return cudaGetLastError();
}

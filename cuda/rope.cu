/* rope.cu - the step between the QKV projection and attention, fused
 * (kernels.h): per head, add the QKV bias (qwen2), RMSNorm q and k over
 * head_dim (qwen3), rotate q and k (NORM: adjacent pairs; NEOX: halves; the
 * cos/sin tables carry llama3 scaling), then write q out and k, v into their
 * paged KV slots (bf16, or fp8 e4m3 with an fp8 cache). Blocks of ROPE_WARPS
 * warps, one warp per head: grid (T, heads / ROPE_WARPS), so a decode step's
 * 48 heads run on 6 SMs at once, not one after another on one. */
#include "cuda/rope.cuh"

#define ROPE_WARPS 8

static __global__ void rope_kv_kernel(struct cuda_rope_args a)
{
    __shared__ float buf[ROPE_WARPS][ROPE_MAXD];
    int t = blockIdx.x, w = threadIdx.x >> 5;
    int64_t slot = a.slots[t];
    size_t es = a.kv8 ? 1 : 2; /* bytes per KV element */
    for (int h = blockIdx.y * ROPE_WARPS + w; h < a.H + 2 * a.KVH; h += gridDim.y * ROPE_WARPS) {
        void *dst;
        if (h < a.H)
            dst = a.q + ((size_t)t * a.H + h) * a.D;
        else if (h < a.H + a.KVH)
            dst = (char *)a.kc + ((size_t)slot * a.KVH + (h - a.H)) * a.D * es;
        else
            dst = (char *)a.vc + ((size_t)slot * a.KVH + (h - a.H - a.KVH)) * a.D * es;
        rope_head(a, t, h, buf[w], dst, h >= a.H && a.kv8);
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

/* rope.cu - the step between the QKV projection and attention, fused
 * (kernels.h): per head, add the QKV bias (qwen2), RMSNorm q and k over
 * head_dim (qwen3), rotate q and k (NORM: adjacent pairs; NEOX: halves; the
 * cos/sin tables carry llama3 scaling), then write q out and k, v into their
 * paged KV slots (bf16, or fp8 e4m3 with an fp8 cache). Blocks of ROPE_WARPS
 * warps over one token's heads: ROPE_HPW heads per warp on the register path
 * (D 64 or 128, whole heads rotated: rope.cuh's rope_head_vec), one head per
 * warp otherwise. Decode steps on the decode attention kernel fold this in
 * and do not launch it. */
#include "cuda/rope.cuh"

#define ROPE_WARPS 8

/* where head h of token t (KV slot slot) goes: q, or its row of the KV cache */
static __device__ __forceinline__ void *rope_dst(const struct cuda_rope_args &a, int t, int64_t slot, int h)
{
    size_t es = a.kv8 ? 1 : 2; /* bytes per KV element */
    if (h < a.H) return a.q + ((size_t)t * a.H + h) * a.D;
    if (h < a.H + a.KVH) return (char *)a.kc + ((size_t)slot * a.KVH + (h - a.H)) * a.D * es;
    return (char *)a.vc + ((size_t)slot * a.KVH + (h - a.H - a.KVH)) * a.D * es;
}

static __global__ void rope_kv_kernel(struct cuda_rope_args a)
{
    __shared__ float buf[ROPE_WARPS][ROPE_MAXD];
    int t = blockIdx.x, w = threadIdx.x >> 5;
    int64_t slot = a.slots[t];
    for (int h = blockIdx.y * ROPE_WARPS + w; h < a.H + 2 * a.KVH; h += gridDim.y * ROPE_WARPS)
        rope_head(a, t, h, buf[w], rope_dst(a, t, slot, h), h >= a.H && a.kv8);
}

/* The register path (rope_head_vec's shapes): each warp ROPE_HPW heads of
 * the token, every head's load issued before the first is used (a prefill
 * step's RoPE is bound by latency, not bytes, with one head per warp) */
#define ROPE_HPW 4
template <int V>
static __global__ void rope_kv_vec_kernel(struct cuda_rope_args a)
{
    int t = blockIdx.x, nh = a.H + 2 * a.KVH, h0 = blockIdx.y * ROPE_WARPS * ROPE_HPW + (threadIdx.x >> 5);
    int p = a.pos[t];
    int64_t slot = a.slots[t];
    float x[ROPE_HPW][V];
#pragma unroll
    for (int j = 0; j < ROPE_HPW; j++)
        if (h0 + j * ROPE_WARPS < nh) rope_vec_load<V>(a, t, h0 + j * ROPE_WARPS, x[j]);
#pragma unroll
    for (int j = 0; j < ROPE_HPW; j++) {
        int h = h0 + j * ROPE_WARPS;
        if (h < nh) rope_vec_finish<V>(a, h, p, x[j], rope_dst(a, t, slot, h), h >= a.H && a.kv8);
    }
}

extern "C" cudaError_t cuda_rope_kv(const struct cuda_rope_args *a, cudaStream_t st)
{
    if (a->T <= 0) return cudaSuccess;
    if (a->D > ROPE_MAXD || a->rope_dim > a->D) return cudaErrorInvalidValue;
    int nh = a->H + 2 * a->KVH;
    if (ROPE_VEC_OK(a->D, a->rope_dim)) { /* rope_head's register path */
        dim3 grid(a->T, (nh + ROPE_WARPS * ROPE_HPW - 1) / (ROPE_WARPS * ROPE_HPW));
        if (a->D == 128)
            rope_kv_vec_kernel<4><<<grid, 32 * ROPE_WARPS, 0, st>>>(*a);
        else
            rope_kv_vec_kernel<2><<<grid, 32 * ROPE_WARPS, 0, st>>>(*a);
        return cudaGetLastError();
    }
    rope_kv_kernel<<<dim3(a->T, (nh + ROPE_WARPS - 1) / ROPE_WARPS), 32 * ROPE_WARPS, 0, st>>>(*a);
    return cudaGetLastError();
}

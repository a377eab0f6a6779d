/* attn.cu - paged attention for mixed batches (kernels.h).
 *
 * Work comes as items (struct cuda_attn_item) built on the host per step:
 * a tile of consecutive query tokens of one sequence (CUDA_ATTN_ROWS query
 * rows = tokens x the heads of one KV group) against a range of its key
 * positions. A block (4 warps) stages the tile's queries in shared memory,
 * then walks the key range 32 positions at a time through the block table,
 * staging K and V as f32, with an online softmax per row (FlashAttention's
 * recurrence, on the SIMT cores). Prefill chunks get one item per tile over
 * their cached prefix plus their causal part; short steps over long contexts
 * (decode) split the key range over several items (split-K), whose partials
 * the combine kernel merges, so one long sequence still fills the GPU.
 *
 * Shared memory: Q [4, 8 or 32 rows][D] + K, V [32][D + 1] f32 (padded: conflict-free
 * column reads); D <= 256.
 */
#include "cuda/bf16.cuh"
#include "cuda/kernels.h"

#define KT 32
#define WARPS 4
/* RPW: query rows per warp, so an item holds at most WARPS * RPW rows: 8 for
 * prefill tiles (32 rows), 1 or 2 for decode (one token's group of heads),
 * so a decode item computes no dead rows. */
template <int DPL, int RPW>
static __global__ void __launch_bounds__(32 * WARPS) attn_kernel(struct cuda_attn_args a)
{
    extern __shared__ float smem[];
    int it = blockIdx.x;
    if (it >= *a.n_items) return;
    struct cuda_attn_item wi = a.items[it];
    int g = blockIdx.y, D = a.D, grp = a.H / a.KVH, bs = a.block_size;
    int lane = threadIdx.x & 31, w = threadIdx.x >> 5;
    int nrows = wi.nq * grp;
    /* Q holds only the rows this instance can have: decode blocks stay small,
     * so more of them fit on an SM */
    float *Qs = smem, *Ks = Qs + WARPS * RPW * D, *Vs = Ks + KT * (D + 1);
    const int32_t *bt = a.bt + a.bt_off[wi.seq];

    for (int i = threadIdx.x; i < WARPS * RPW * D; i += blockDim.x) {
        int r = i / D, d = i % D;
        float v = 0.0f;
        if (r < nrows) {
            int t = wi.t0 + r / grp, h = g * grp + r % grp;
            v = bf2f(a.q[((size_t)t * a.H + h) * D + d]) * a.scale;
        }
        Qs[i] = v;
    }
    int rpos[RPW];
#pragma unroll
    for (int k = 0; k < RPW; k++) {
        int r = w + WARPS * k;
        rpos[k] = r < nrows ? a.pos[wi.t0 + r / grp] : -1; /* -1: inactive row sees nothing */
    }
    float m[RPW], l[RPW], acc[RPW][DPL];
#pragma unroll
    for (int k = 0; k < RPW; k++) {
        m[k] = -INFINITY;
        l[k] = 0.0f;
#pragma unroll
        for (int i = 0; i < DPL; i++) acc[k][i] = 0.0f;
    }
    int vec = D / 8; /* 16-byte chunks per key row */
    for (int k0 = wi.kv_lo; k0 < wi.kv_hi; k0 += KT) {
        __syncthreads();
        /* unrolled so every thread's loads are in flight before the first store */
#pragma unroll 4
        for (int i = threadIdx.x; i < KT * vec; i += blockDim.x) {
            int j = i / vec, c = i % vec, kp = k0 + j;
            float kf[8], vf[8];
            if (kp < wi.kv_hi) {
                int64_t slot = (int64_t)bt[kp / bs] * bs + kp % bs;
                size_t off = ((size_t)slot * a.KVH + g) * D + c * 8;
                uint4 kr = *(const uint4 *)(a.kc + off), vr = *(const uint4 *)(a.vc + off);
                const uint16_t *kh = (const uint16_t *)&kr, *vh = (const uint16_t *)&vr;
#pragma unroll
                for (int e = 0; e < 8; e++) kf[e] = bf2f(kh[e]), vf[e] = bf2f(vh[e]);
            } else {
#pragma unroll
                for (int e = 0; e < 8; e++) kf[e] = 0.0f, vf[e] = 0.0f;
            }
#pragma unroll
            for (int e = 0; e < 8; e++) {
                Ks[j * (D + 1) + c * 8 + e] = kf[e];
                Vs[j * (D + 1) + c * 8 + e] = vf[e];
            }
        }
        __syncthreads();
        /* scores: lane = key */
        float s[RPW], s1[RPW]; /* two chains per row: decode has one row per warp */
#pragma unroll
        for (int k = 0; k < RPW; k++) s[k] = 0.0f, s1[k] = 0.0f;
        const float *kr = Ks + lane * (D + 1);
#pragma unroll 4
        for (int d = 0; d < D; d += 2) {
            float kv0 = kr[d], kv1 = kr[d + 1];
#pragma unroll
            for (int k = 0; k < RPW; k++) {
                s[k] += Qs[(w + WARPS * k) * D + d] * kv0;
                s1[k] += Qs[(w + WARPS * k) * D + d + 1] * kv1;
            }
        }
#pragma unroll
        for (int k = 0; k < RPW; k++) s[k] += s1[k];
        int kp = k0 + lane;
        float p[RPW];
#pragma unroll
        for (int k = 0; k < RPW; k++) {
            bool ok = kp < wi.kv_hi && kp <= rpos[k];
            float sk = ok ? s[k] : -INFINITY;
            float mn = fmaxf(m[k], warp_max(sk));
            if (mn == -INFINITY) {
                p[k] = 0.0f;
                continue;
            }
            p[k] = ok ? __expf(sk - mn) : 0.0f;
            float corr = __expf(m[k] - mn);
            l[k] = l[k] * corr + warp_sum(p[k]);
            m[k] = mn;
#pragma unroll
            for (int i = 0; i < DPL; i++) acc[k][i] *= corr;
        }
        for (int jj = 0; jj < KT; jj++) {
            float vv[DPL];
#pragma unroll
            for (int i = 0; i < DPL; i++) {
                int d = lane + 32 * i;
                vv[i] = d < D ? Vs[jj * (D + 1) + d] : 0.0f;
            }
#pragma unroll
            for (int k = 0; k < RPW; k++) {
                float pj = __shfl_sync(0xffffffffu, p[k], jj);
#pragma unroll
                for (int i = 0; i < DPL; i++) acc[k][i] += pj * vv[i];
            }
        }
    }
#pragma unroll
    for (int k = 0; k < RPW; k++) {
        int r = w + WARPS * k;
        if (r >= nrows) continue;
        int t = wi.t0 + r / grp, h = g * grp + r % grp;
        if (wi.nsplit <= 1) {
            float inv = l[k] > 0.0f ? 1.0f / l[k] : 0.0f;
#pragma unroll
            for (int i = 0; i < DPL; i++) {
                int d = lane + 32 * i;
                if (d < D) a.out[((size_t)t * a.H + h) * D + d] = f2bf(acc[k][i] * inv);
            }
        } else {
            float *pp = a.part + (((size_t)(wi.part + r) * a.KVH + g) * CUDA_ATTN_MAXSPLIT + wi.split) * (D + 2);
            if (lane == 0) pp[0] = m[k], pp[1] = l[k];
#pragma unroll
            for (int i = 0; i < DPL; i++) {
                int d = lane + 32 * i;
                if (d < D) pp[2 + d] = acc[k][i];
            }
        }
    }
}

/* Merges the split partials of each split token: one warp per (token, head),
 * lane s reads split s's (max, sum) (nsplit <= 32), so every load of a head
 * is issued at once rather than one split after another. */
static __global__ void combine_kernel(struct cuda_attn_args a)
{
    int t = blockIdx.x, lane = threadIdx.x & 31, h = blockIdx.y * (blockDim.x >> 5) + (threadIdx.x >> 5);
    int base = a.tok_part[t], ns = a.tok_nsplit[t];
    if (base < 0 || ns <= 1 || h >= a.H) return;
    int grp = a.H / a.KVH, D = a.D;
    const float *pp = a.part + ((size_t)(base + h % grp) * a.KVH + h / grp) * CUDA_ATTN_MAXSPLIT * (D + 2);
    float ms = lane < ns ? pp[lane * (D + 2)] : -INFINITY;
    float ls = lane < ns ? pp[lane * (D + 2) + 1] : 0.0f;
    float M = warp_max(ms);
    float wgt = ms == -INFINITY ? 0.0f : __expf(ms - M);
    float L = warp_sum(ls * wgt);
    float inv = L > 0.0f ? 1.0f / L : 0.0f;
    for (int d = lane; d < D; d += 32) {
        float o = 0.0f;
#pragma unroll 8
        for (int s = 0; s < ns; s++) o += pp[s * (D + 2) + 2 + d] * __shfl_sync(0xffffffffu, wgt, s);
        a.out[((size_t)t * a.H + h) * D + d] = f2bf(o * inv);
    }
}

template <int DPL>
static cudaError_t set_smem(void)
{
    int need = (CUDA_ATTN_ROWS * 32 * DPL + 2 * KT * (32 * DPL + 1)) * (int)sizeof(float);
    if (need <= 48 * 1024) return cudaSuccess;
    cudaError_t e = cudaFuncSetAttribute(attn_kernel<DPL, 1>, cudaFuncAttributeMaxDynamicSharedMemorySize, need);
    if (e == cudaSuccess)
        e = cudaFuncSetAttribute(attn_kernel<DPL, 2>, cudaFuncAttributeMaxDynamicSharedMemorySize, need);
    if (e == cudaSuccess)
        e = cudaFuncSetAttribute(attn_kernel<DPL, 8>, cudaFuncAttributeMaxDynamicSharedMemorySize, need);
    return e;
}

extern "C" cudaError_t cuda_attention_prepare(int D)
{
    return D <= 32 ? set_smem<1>() : D <= 64 ? set_smem<2>() : D <= 128 ? set_smem<4>() : set_smem<8>();
}

template <int DPL>
static cudaError_t launch(const struct cuda_attn_args *a, cudaStream_t st)
{
    int qrows = a->max_rows <= WARPS ? WARPS : a->max_rows <= 2 * WARPS ? 2 * WARPS : CUDA_ATTN_ROWS;
    size_t sm = (size_t)(qrows * a->D + 2 * KT * (a->D + 1)) * sizeof(float);
    dim3 grid(a->max_items, a->KVH);
    if (a->max_rows <= WARPS)
        attn_kernel<DPL, 1><<<grid, 32 * WARPS, sm, st>>>(*a);
    else if (a->max_rows <= 2 * WARPS)
        attn_kernel<DPL, 2><<<grid, 32 * WARPS, sm, st>>>(*a);
    else
        attn_kernel<DPL, 8><<<grid, 32 * WARPS, sm, st>>>(*a);
    cudaError_t e = cudaGetLastError();
    if (e != cudaSuccess) return e;
    combine_kernel<<<dim3(a->T, (a->H + 3) / 4), 128, 0, st>>>(*a);
    return cudaGetLastError();
}

extern "C" cudaError_t cuda_attention(const struct cuda_attn_args *a, cudaStream_t st)
{
    if (a->max_items <= 0 || a->T <= 0) return cudaSuccess;
    if (a->D % 8 || a->D > 256 || a->H % a->KVH || a->H / a->KVH > CUDA_ATTN_ROWS) return cudaErrorInvalidValue;
    if (a->D <= 32) return launch<1>(a, st);
    if (a->D <= 64) return launch<2>(a, st);
    if (a->D <= 128) return launch<4>(a, st);
    return launch<8>(a, st);
}

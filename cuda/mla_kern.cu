/* mla_kern.cu - multi-head latent attention's kernels (mla.h): the latent norm,
 * the paged entry write with RoPE, and the absorbed attention over the
 * latent cache. Simple kernels (one block per row or per token x head, f32
 * accumulation); their plain-C references are in tests/gpu/test_mla.c. */
#include <math.h>

#include "cuda/bf16.cuh"
#include "cuda/mla.h"

#define THREADS 256
#define TILE 64 /* keys scored per pass of the attention */

/* one cache element as f32: bf16, or fp8 e4m3 (exact) */
static __device__ __forceinline__ float ld_kv(const void *c, size_t i, bool kv8)
{
    if (kv8) {
        __half_raw h = __nv_cvt_fp8_to_halfraw(((const __nv_fp8_storage_t *)c)[i], __NV_E4M3);
        return __half2float(*(const __half *)&h);
    }
    return bf2f(((const uint16_t *)c)[i]);
}
static __device__ __forceinline__ void st_kv(void *c, size_t i, float v, bool kv8)
{
    if (kv8) ((uint8_t *)c)[i] = f2e4m3(v);
    else ((uint16_t *)c)[i] = f2bf(v);
}

static __global__ void rmsnorm_kernel(const float *x, int xs, const float *w, int n, float eps, uint16_t *out, int os)
{
    __shared__ float sh[32];
    const float *xr = x + (size_t)blockIdx.x * xs;
    float ss = 0.0f;
    for (int i = threadIdx.x; i < n; i += blockDim.x) ss = fmaf(xr[i], xr[i], ss);
    ss = block_sum(ss, sh);
    float inv = rsqrtf(ss / (float)n + eps);
    uint16_t *o = out + (size_t)blockIdx.x * os;
    for (int i = threadIdx.x; i < n; i += blockDim.x) o[i] = f2bf(w[i] * (xr[i] * inv));
}

extern "C" cudaError_t cuda_mla_rmsnorm(const float *x, int xs, const float *w, int n, float eps, int T,
                                        uint16_t *out, int os, cudaStream_t st)
{
    if (T <= 0) return cudaSuccess;
    rmsnorm_kernel<<<T, THREADS, 0, st>>>(x, xs, w, n, eps, out, os);
    return cudaGetLastError();
}

/* rotate pair i of a rope part of R values (adjacent pairs or halves) */
static __device__ __forceinline__ void rope_pair(float *x, int i, int R, bool inter, float cs, float sn)
{
    int i0 = inter ? 2 * i : i, i1 = inter ? 2 * i + 1 : i + R / 2;
    float u = x[i0], v = x[i1];
    x[i0] = u * cs - v * sn;
    x[i1] = v * cs + u * sn;
}

/* One block per token. */
static __global__ void kv_write_kernel(struct cuda_mla_kv_args a)
{
    __shared__ float sh[32];
    __shared__ float kr[256]; /* the rope key, R <= 256 (checked at creation) */
    int t = blockIdx.x, C = a.C, R = a.R, half = R / 2, Dq = a.Dn + R, p = a.pos[t];
    const float *kv = a.kva + (size_t)t * (C + R);
    size_t e0 = (size_t)a.slots[t] * (C + R);
    float ss = 0.0f;
    for (int i = threadIdx.x; i < C; i += blockDim.x) ss = fmaf(kv[i], kv[i], ss);
    ss = block_sum(ss, sh);
    float inv = rsqrtf(ss / (float)C + a.eps);
    for (int i = threadIdx.x; i < C; i += blockDim.x) st_kv(a.cache, e0 + i, a.kv_norm[i] * (kv[i] * inv), a.kv8);
    for (int i = threadIdx.x; i < R; i += blockDim.x) kr[i] = kv[C + i];
    __syncthreads();
    const float *cs = a.cos ? a.cos + (size_t)p * half : NULL, *sn = a.sin ? a.sin + (size_t)p * half : NULL;
    if (threadIdx.x < half) rope_pair(kr, threadIdx.x, R, a.interleave, cs[threadIdx.x], sn[threadIdx.x]);
    __syncthreads();
    for (int i = threadIdx.x; i < R; i += blockDim.x) st_kv(a.cache, e0 + C + i, kr[i], a.kv8);
    /* the queries: each (head, pair) by one thread, then q_nope to bf16 */
    float *q = a.q + (size_t)t * a.H * Dq;
    for (int j = threadIdx.x; j < a.H * half; j += blockDim.x) {
        int h = j / half, i = j % half;
        rope_pair(q + (size_t)h * Dq + a.Dn, i, R, a.interleave, cs[i], sn[i]);
    }
    uint16_t *qn = a.qn + (size_t)t * a.H * a.Dn;
    for (int j = threadIdx.x; j < a.H * a.Dn; j += blockDim.x) qn[j] = f2bf(q[(size_t)(j / a.Dn) * Dq + j % a.Dn]);
}

extern "C" cudaError_t cuda_mla_kv_write(const struct cuda_mla_kv_args *a, cudaStream_t st)
{
    if (a->T <= 0) return cudaSuccess;
    if (a->R > 256 || a->R % 2 || (a->R > 0 && (!a->cos || !a->sin))) return cudaErrorInvalidValue;
    kv_write_kernel<<<a->T, THREADS, 0, st>>>(*a);
    return cudaGetLastError();
}

#define CPT (CUDA_MLA_MAX_C / THREADS) /* latent values per thread */

/* One block per (head, token): its keys 0..pos in tiles of TILE, each
 * warp scoring keys (lanes over the entry), then the online softmax and
 * the weighted latent sum, thread i holding values i, i + THREADS, ... */
static __global__ void __launch_bounds__(THREADS) attn_kernel(struct cuda_mla_attn_args a)
{
    extern __shared__ float smem[]; /* ql[C], qr[R], sc[TILE], pv[TILE] */
    int h = blockIdx.x, t = blockIdx.y, C = a.C, R = a.R, W = C + R, Dq = a.Dn + R;
    int lane = threadIdx.x & 31, wp = threadIdx.x >> 5, nw = THREADS / 32;
    float *ql = smem, *qr = ql + C, *sc = qr + R, *pv = sc + TILE;
    const float *qls = a.qlat + ((size_t)t * a.H + h) * C, *qrs = a.q + ((size_t)t * a.H + h) * Dq + a.Dn;
    for (int i = threadIdx.x; i < C; i += THREADS) ql[i] = qls[i];
    for (int i = threadIdx.x; i < R; i += THREADS) qr[i] = qrs[i];
    __syncthreads();
    int n = a.pos[t] + 1, bs = a.block_size;
    const int32_t *bt = a.bt + a.tok_bt[t];
    float acc[CPT], m = -INFINITY, l = 0.0f;
#pragma unroll
    for (int k = 0; k < CPT; k++) acc[k] = 0.0f;
    for (int j0 = 0; j0 < n; j0 += TILE) {
        for (int i = wp; i < TILE; i += nw) {
            int j = j0 + i;
            float s = -INFINITY;
            if (j < n) {
                size_t e = ((size_t)bt[j / bs] * bs + j % bs) * W;
                float d = 0.0f;
                for (int c = lane; c < C; c += 32) d = fmaf(ql[c], ld_kv(a.cache, e + c, a.kv8), d);
                for (int c = lane; c < R; c += 32) d = fmaf(qr[c], ld_kv(a.cache, e + C + c, a.kv8), d);
                s = warp_sum(d) * a.scale;
            }
            if (lane == 0) sc[i] = s;
        }
        __syncthreads();
        float mx = m;
        for (int i = 0; i < TILE; i++) mx = fmaxf(mx, sc[i]);
        if (threadIdx.x < TILE) pv[threadIdx.x] = j0 + threadIdx.x < n ? __expf(sc[threadIdx.x] - mx) : 0.0f;
        __syncthreads();
        float corr = __expf(m - mx), ps = 0.0f; /* m = -inf at the first tile: corr 0 */
        for (int i = 0; i < TILE; i++) ps += pv[i];
        l = l * corr + ps;
        m = mx;
#pragma unroll
        for (int k = 0; k < CPT; k++) acc[k] *= corr;
        int nt = n - j0 < TILE ? n - j0 : TILE;
        for (int i = 0; i < nt; i++) {
            int j = j0 + i;
            size_t e = ((size_t)bt[j / bs] * bs + j % bs) * W;
            float p = pv[i];
#pragma unroll
            for (int k = 0; k < CPT; k++) {
                int c = threadIdx.x + k * THREADS;
                if (c < C) acc[k] = fmaf(p, ld_kv(a.cache, e + c, a.kv8), acc[k]);
            }
        }
        __syncthreads(); /* sc and pv are rewritten by the next tile */
    }
    uint16_t *o = a.olat + ((size_t)t * a.H + h) * C;
    float il = 1.0f / l;
#pragma unroll
    for (int k = 0; k < CPT; k++) {
        int c = threadIdx.x + k * THREADS;
        if (c < C) o[c] = f2bf(acc[k] * il);
    }
}

extern "C" cudaError_t cuda_mla_attention(const struct cuda_mla_attn_args *a, cudaStream_t st)
{
    if (a->T <= 0) return cudaSuccess;
    if (a->C > CUDA_MLA_MAX_C || a->C <= 0) return cudaErrorInvalidValue;
    size_t sm = ((size_t)a->C + a->R + 2 * TILE) * sizeof(float);
    attn_kernel<<<dim3(a->H, a->T), THREADS, sm, st>>>(*a);
    return cudaGetLastError();
}

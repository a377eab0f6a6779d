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
    size_t e0 = (size_t)a.slots[t] * a.W;
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
    int h = blockIdx.x, t = blockIdx.y, C = a.C, R = a.R, W = a.W, Dq = a.Dn + R;
    int lane = threadIdx.x & 31, wp = threadIdx.x >> 5, nw = THREADS / 32;
    float *ql = smem, *qr = ql + C, *sc = qr + R, *pv = sc + TILE;
    const float *qls = a.qlat + ((size_t)t * a.H + h) * C, *qrs = a.q + ((size_t)t * a.H + h) * Dq + a.Dn;
    for (int i = threadIdx.x; i < C; i += THREADS) ql[i] = qls[i];
    for (int i = threadIdx.x; i < R; i += THREADS) qr[i] = qrs[i];
    __syncthreads();
    int n = a.pos[t] + 1, bs = a.block_size;
    const int32_t *bt = a.bt + a.tok_bt[t], *keys = NULL; /* key i is keys ? keys[i] : i */
    if (a.sel && a.nsel[t] >= 0) keys = a.sel + (size_t)t * a.K, n = a.nsel[t];
    float acc[CPT], m = -INFINITY, l = 0.0f;
#pragma unroll
    for (int k = 0; k < CPT; k++) acc[k] = 0.0f;
    for (int j0 = 0; j0 < n; j0 += TILE) {
        for (int i = wp; i < TILE; i += nw) {
            int j = j0 + i;
            float s = -INFINITY;
            if (j < n) {
                if (keys) j = keys[j];
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
            int j = keys ? keys[j0 + i] : j0 + i;
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
    float il = l > 0.0f ? 1.0f / l : 0.0f; /* no key chosen (k-pools without a tail, before the first pool): 0 */
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

/* ---- the DSA indexer ---- */

/* One block per token: the key's LayerNorm (biased variance), RoPE on its
 * first R dims in pairs, into the entry; the queries' rope parts; the
 * weights scaled. */
static __global__ void ix_prep_kernel(struct cuda_mla_ix_args a)
{
    __shared__ float sh[32];
    __shared__ float kk[256]; /* ID <= 256 (checked at creation) */
    int t = blockIdx.x, ID = a.ID, half = a.R / 2, p = a.pos[t];
    const float *k = a.k + (size_t)t * ID;
    float s = 0.0f;
    for (int i = threadIdx.x; i < ID; i += blockDim.x) s += k[i];
    float m = block_sum(s, sh) / (float)ID, v = 0.0f;
    for (int i = threadIdx.x; i < ID; i += blockDim.x) v = fmaf(k[i] - m, k[i] - m, v);
    float r = rsqrtf(block_sum(v, sh) / (float)ID + 1e-6f);
    for (int i = threadIdx.x; i < ID; i += blockDim.x) kk[i] = (k[i] - m) * r * a.kn[i] + a.kb[i];
    __syncthreads();
    const float *cs = a.cos ? a.cos + (size_t)p * half : NULL, *sn = a.sin ? a.sin + (size_t)p * half : NULL;
    if (threadIdx.x < half) rope_pair(kk, threadIdx.x, a.R, true, cs[threadIdx.x], sn[threadIdx.x]);
    __syncthreads();
    size_t e0 = (size_t)a.slots[t] * a.W + a.C + a.R;
    for (int i = threadIdx.x; i < ID; i += blockDim.x) st_kv(a.cache, e0 + i, kk[i], a.kv8);
    if (a.g)
        for (int i = threadIdx.x; i < ID; i += blockDim.x) st_kv(a.cache, e0 + ID + i, a.g[(size_t)t * ID + i], a.kv8);
    float *q = a.q + (size_t)t * a.IH * ID;
    for (int j = threadIdx.x; j < a.IH * half; j += blockDim.x)
        rope_pair(q + (size_t)(j / half) * ID, j % half, a.R, true, cs[j % half], sn[j % half]);
    float ws = rsqrtf((float)a.IH);
    for (int h = threadIdx.x; h < a.IH; h += blockDim.x) a.w[(size_t)t * a.IH + h] *= ws;
}

/* One block per token: a warp per key, lanes over the key's dims, the
 * heads in order. */
static __global__ void ix_score_kernel(struct cuda_mla_ix_args a)
{
    extern __shared__ float smem[]; /* q[IH][ID], w[IH] */
    int t = blockIdx.x, ID = a.ID, IH = a.IH, lane = threadIdx.x & 31, wp = threadIdx.x >> 5, nw = blockDim.x >> 5;
    float *q = smem, *w = q + IH * ID;
    for (int i = threadIdx.x; i < IH * ID; i += blockDim.x) q[i] = a.q[(size_t)t * IH * ID + i];
    for (int i = threadIdx.x; i < IH; i += blockDim.x) w[i] = a.w[(size_t)t * IH + i];
    __syncthreads();
    int KP = a.KP, n = KP > 0 ? (a.pos[t] + 1) / KP : a.pos[t] + 1, bs = a.block_size;
    const int32_t *bt = a.bt + a.tok_bt[t];
    float sc = rsqrtf((float)ID);
    for (int j = wp; j < n; j += nw) { /* key j, or pool j */
        float kr[8]; /* dims lane, lane + 32, ... (ID <= 256) */
        if (KP == 0) {
            size_t e = ((size_t)bt[j / bs] * bs + j % bs) * a.W + a.C + a.R;
#pragma unroll
            for (int u = 0; u < 8; u++) kr[u] = lane + 32 * u < ID ? ld_kv(a.cache, e + lane + 32 * u, a.kv8) : 0.0f;
        } else {
            /* the pool's key, channel by channel as cpu_mla.c's pool_keys */
#pragma unroll
            for (int u = 0; u < 8; u++) {
                int d = lane + 32 * u;
                kr[u] = 0.0f;
                if (d >= ID) continue;
                float mx = -INFINITY, sum = 0.0f, v = 0.0f;
                for (int i = 0; i < KP; i++) {
                    int p = j * KP + i;
                    size_t e = ((size_t)bt[p / bs] * bs + p % bs) * a.W + a.C + a.R;
                    mx = fmaxf(mx, ld_kv(a.cache, e + ID + d, a.kv8) + a.ape[i * ID + d]);
                }
                for (int i = 0; i < KP; i++) {
                    int p = j * KP + i;
                    size_t e = ((size_t)bt[p / bs] * bs + p % bs) * a.W + a.C + a.R;
                    sum += __expf(ld_kv(a.cache, e + ID + d, a.kv8) + a.ape[i * ID + d] - mx);
                }
                for (int i = 0; i < KP; i++) {
                    int p = j * KP + i;
                    size_t e = ((size_t)bt[p / bs] * bs + p % bs) * a.W + a.C + a.R;
                    float w = __expf(ld_kv(a.cache, e + ID + d, a.kv8) + a.ape[i * ID + d] - mx);
                    v += w / sum * ld_kv(a.cache, e + d, a.kv8);
                }
                kr[u] = v;
            }
        }
        float v = 0.0f;
        for (int h = 0; h < IH; h++) {
            float d = 0.0f;
#pragma unroll
            for (int u = 0; u < 8; u++)
                if (lane + 32 * u < ID) d = fmaf(q[h * ID + lane + 32 * u], kr[u], d);
            d = warp_sum(d) * sc;
            v += w[h] * (d > 0.0f ? d : 0.0f);
        }
        if (lane == 0) a.scores[(size_t)t * a.max_ctx + j] = v;
    }
}

/* an order-keeping map of floats to unsigned ints */
static __device__ __forceinline__ uint32_t ord(float f)
{
    uint32_t b = __float_as_uint(f);
    return b & 0x80000000u ? ~b : b | 0x80000000u;
}

/* One block per token: the K-th best score by a bitwise search over the
 * ordered values (32 counting passes), then the keys above it and the
 * earliest of those equal to it, written in ascending order. */
static __global__ void __launch_bounds__(THREADS) ix_topk_kernel(struct cuda_mla_ix_args a)
{
    __shared__ float sh[32];
    __shared__ int wt[THREADS / 32], wk[THREADS / 32];
    /* n candidates (keys, or whole pools of KP keys), K of them chosen */
    int t = blockIdx.x, pos = a.pos[t], KP = a.KP > 0 ? a.KP : 1, n = (pos + 1) / KP, K = a.KP > 0 ? a.want : a.K;
    int lane = threadIdx.x & 31, wp = threadIdx.x >> 5;
    bool tail = a.KP > 0 && a.tail;
    int32_t *out = a.sel + (size_t)t * a.KS;
    if (n <= K) {
        if (a.KP == 0 || tail) { /* every key 0..pos */
            if (threadIdx.x == 0) a.nsel[t] = -1;
            return;
        }
        for (int j = threadIdx.x; j < n * KP; j += THREADS) out[j] = j; /* the whole pools, no tail */
        if (threadIdx.x == 0) a.nsel[t] = n * KP;
        return;
    }
    const float *s = a.scores + (size_t)t * a.max_ctx;
    uint32_t v = 0;
    for (int b = 31; b >= 0; b--) {
        uint32_t cand = v | (1u << b);
        float c = 0.0f;
        for (int j = threadIdx.x; j < n; j += THREADS) c += ord(s[j]) >= cand ? 1.0f : 0.0f;
        if (block_sum(c, sh) >= (float)K) v = cand; /* every thread gets the same sum */
    }
    float g = 0.0f;
    for (int j = threadIdx.x; j < n; j += THREADS) g += ord(s[j]) > v ? 1.0f : 0.0f;
    int need = K - (int)block_sum(g, sh); /* ties at v to take, earliest first */
    int tie0 = 0, out0 = 0;
    unsigned lt = (1u << lane) - 1u;
    for (int c0 = 0; c0 < n; c0 += THREADS) {
        int j = c0 + threadIdx.x;
        uint32_t u = j < n ? ord(s[j]) : 0u;
        bool tie = j < n && u == v;
        unsigned bt = __ballot_sync(0xffffffffu, tie);
        if (lane == 0) wt[wp] = __popc(bt);
        __syncthreads();
        int before = tie0 + __popc(bt & lt), all_t = 0;
        for (int i = 0; i < THREADS / 32; i++) {
            if (i < wp) before += wt[i];
            all_t += wt[i];
        }
        bool take = j < n && (u > v || (tie && before < need));
        unsigned bk = __ballot_sync(0xffffffffu, take);
        if (lane == 0) wk[wp] = __popc(bk);
        __syncthreads();
        int at = out0 + __popc(bk & lt), all_k = 0;
        for (int i = 0; i < THREADS / 32; i++) {
            if (i < wp) at += wk[i];
            all_k += wk[i];
        }
        if (take && at < K)
            for (int i = 0; i < KP; i++) out[at * KP + i] = j * KP + i;
        tie0 += all_t, out0 += all_k;
        __syncthreads(); /* wt and wk are rewritten by the next chunk */
    }
    int m = (out0 < K ? out0 : K) * KP, nt = tail ? pos + 1 - n * KP : 0;
    for (int i = threadIdx.x; i < nt; i += THREADS) out[m + i] = n * KP + i; /* the query's own pool */
    if (threadIdx.x == 0) a.nsel[t] = m + nt;
}

extern "C" cudaError_t cuda_mla_indexer(const struct cuda_mla_ix_args *a, cudaStream_t st)
{
    if (a->T <= 0) return cudaSuccess;
    if (a->ID > 256 || a->R > a->ID || a->R % 2 || a->K <= 0 || (a->KP > 0 && (!a->ape || !a->g || a->want < 1)))
        return cudaErrorInvalidValue;
    ix_prep_kernel<<<a->T, THREADS, 0, st>>>(*a);
    size_t sm = ((size_t)a->IH * a->ID + a->IH) * sizeof(float);
    if (sm > 48 * 1024) return cudaErrorInvalidValue;
    ix_score_kernel<<<a->T, THREADS, sm, st>>>(*a);
    ix_topk_kernel<<<a->T, THREADS, 0, st>>>(*a);
    return cudaGetLastError();
}

/* mla_kern.cu - multi-head latent attention's kernels (mla.h): the latent norm,
 * the paged entry write with RoPE, the absorbed attention over the latent
 * cache, and the DSA indexer (its entry write, the k-pools' cached keys,
 * the scores split over blocks, the radix top-K). Simple kernels (one block
 * per row or token; the attention's and the scores' blocks below), f32
 * accumulation; their plain-C references are in tests/gpu/test_mla.c. */
#include <math.h>

#include "cuda/bf16.cuh"
#include "cuda/mla.h"

#define THREADS 256

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

/* The absorbed attention is multi-query attention over one shared key per
 * position (the entry's latent and rope parts; the value is the latent), so
 * a block takes every head of a group (heads in groups whose queries fit
 * shared memory) for one token and one split of its keys: each tile of TK
 * entries is read once into shared memory (bf16 pairs; e4m3 is exact in
 * bf16) and used by all the group's heads. The keys of a token are split
 * over S blocks (flash-decoding) when T x groups alone would not fill the
 * GPU; S depends only on T and the shape (never on positions: a graph
 * captured for a step replays for any later context), each split takes
 * ceil(n / S) keys but at least MINCH, and writes its unnormalized latent
 * sum, max and sum of weights per head to part; combine_kernel merges them. */
#define TK 32     /* keys per tile: one per lane when scoring */
#define HGM 16    /* heads of a group at most: two per warp; 2 accumulators each per thread */
#define NBLK 528  /* blocks a step aims for (four per SM of an H100; two fit at once) before splitting stops */
#define SMAX 256  /* splits at most */
#define LDU 8     /* cache loads a thread has in flight while filling a tile */
#define MINCH 32  /* keys a split takes at least (a tile) */
#define SMEM_MAX (96 * 1024) /* shared memory a block may take: under sm_89's 99 KB opt-in */

struct attn_geom {
    int hg, G, S, RS; /* heads per group, groups, splits, a tile row's stride in bf16 pairs */
    size_t sm;        /* dynamic shared memory */
};

/* 0, or -1 where the shape does not fit (C odd or over CUDA_MLA_MAX_C, R odd, the entry too wide) */
static int attn_plan(int T, int H, int C, int R, struct attn_geom *g)
{
    if (C <= 0 || C > CUDA_MLA_MAX_C || C % 2 || R < 0 || R % 2 || H <= 0 || T <= 0) return -1;
    int CP = (C + R) / 2;
    g->RS = CP | 1; /* odd: lanes reading a pair of their own key hit distinct banks */
    size_t fixed = (size_t)TK * g->RS * 4 + TK * 8 + ((size_t)TK * HGM + 3 * HGM) * 4 + 16, per = (size_t)(C + R) * 4;
    if (fixed + per > SMEM_MAX) return -1;
    int hg = (int)((SMEM_MAX - fixed) / per);
    hg = hg < HGM ? hg : HGM;
    hg = hg < H ? hg : H;
    g->G = (H + hg - 1) / hg;
    g->hg = (H + g->G - 1) / g->G; /* the groups evened out (as many: hg <= the fit) */
    long long tg = (long long)T * g->G;
    g->S = tg >= NBLK / 2 ? 1 : (int)(NBLK / tg < SMAX ? NBLK / tg : SMAX);
    g->sm = ((size_t)g->hg * (C + R) + 3) / 4 * 16 + fixed; /* the queries padded to 16 bytes */
    return 0;
}

extern "C" size_t cuda_mla_attn_part_bytes(int max_tokens, int H, int C, int R)
{
    size_t most = 0;
    for (int T = 1; T <= max_tokens; T++) {
        struct attn_geom g;
        if (attn_plan(T, H, C, R, &g)) return 0;
        size_t b = g.S > 1 ? (size_t)T * g.S * H * (C + 2) * sizeof(float) : 0;
        most = b > most ? b : most;
    }
    return most;
}

/* the cache values i, i + 1 as bf16 bits (low half the first); w_even: i is even (one 4-byte load) */
static __device__ __forceinline__ uint32_t ld_pair(const void *c, size_t i, bool kv8, bool w_even)
{
    if (kv8) {
        float x0 = ld_kv(c, i, true), x1 = ld_kv(c, i + 1, true); /* e4m3 is exact in bf16 */
        return (__float_as_uint(x0) >> 16) | (__float_as_uint(x1) & 0xffff0000u);
    }
    if (w_even) return ((const uint32_t *)c)[i / 2];
    const uint16_t *u = (const uint16_t *)c;
    return (uint32_t)u[i] | ((uint32_t)u[i + 1] << 16);
}

/* Block (split s, token t, head group z), THREADS threads: warp w scores
 * (lane = key) and soft-maxes heads w and w + 8 of the group; thread i
 * accumulates latent values 2i, 2i + 1 of every head (C <= 2 THREADS). */
static __global__ void __launch_bounds__(THREADS) attn_kernel(struct cuda_mla_attn_args a, int hg, int S, int RS)
{
    extern __shared__ float4 smem4[];
    float *smem = (float *)smem4;
    int s = blockIdx.x, t = blockIdx.y, h0 = blockIdx.z * hg, C = a.C, R = a.R, CR = C + R, CP = CR / 2;
    int nh = a.H - h0 < hg ? a.H - h0 : hg, Dq = a.Dn + R, bs = a.block_size;
    int tid = threadIdx.x, lane = tid & 31, wp = tid >> 5;
    float *qs = smem;                                      /* [hg][CR] */
    uint32_t *tl = (uint32_t *)(qs + ((size_t)hg * CR + 3) / 4 * 4); /* [TK][RS] bf16 pairs */
    long long *eo = (long long *)(tl + TK * RS);           /* [TK] the tile's entries' offsets in the cache */
    float *ps = (float *)(eo + TK);                        /* [TK][HGM] weights */
    float *cr = ps + TK * HGM;                             /* [HGM] the tile's rescale */
    float *ml = cr + HGM;                                  /* [2][HGM] max and sum at the end */
    const float *ql = a.qlat + ((size_t)t * a.H + h0) * C, *qr = a.q + ((size_t)t * a.H + h0) * Dq + a.Dn;
    for (int i = tid; i < TK * HGM + 3 * HGM; i += THREADS) ps[i] = 0.0f;
    int n = a.pos[t] + 1 - a.key0;
    const int32_t *bt = a.bt + a.tok_bt[t], *keys = NULL; /* key i is keys ? keys[i] : key0 + i */
    if (a.sel && a.nsel[t] >= 0) keys = a.sel + (size_t)t * a.K, n = a.nsel[t];
    int ch = (n + S - 1) / S;
    ch = ch < MINCH ? MINCH : ch;
    int k0 = s * ch, k1 = n - k0 < ch ? n : k0 + ch; /* k0 >= n: an empty split (max -inf, sum 0) */
    for (int i = tid; i < nh * CR && k0 < k1; i += THREADS) {
        int h = i / CR, c = i - h * CR;
        qs[i] = c < C ? ql[(size_t)h * C + c] : qr[(size_t)h * Dq + c - C];
    }
    bool w_even = !(a.W & 1);
    int ha = wp, hb = wp + 8;
    float ma = -INFINITY, la = 0.0f, mb = -INFINITY, lb = 0.0f;
    float acc[HGM][2];
#pragma unroll
    for (int h = 0; h < HGM; h++) acc[h][0] = acc[h][1] = 0.0f;
    __syncthreads();
    for (int j0 = k0; j0 < k1; j0 += TK) {
        int nk = k1 - j0 < TK ? k1 - j0 : TK;
        if (tid < nk) {
            int j = keys ? keys[j0 + tid] : a.key0 + j0 + tid;
            eo[tid] = ((long long)bt[j / bs] * bs + j % bs) * a.W;
        }
        __syncthreads();
        /* LDU loads issued before their stores: the latency overlapped, not paid per value */
        for (int i0 = tid; i0 < TK * CP; i0 += LDU * THREADS) {
            uint32_t v[LDU];
#pragma unroll
            for (int u = 0; u < LDU; u++) {
                int i = i0 + u * THREADS, k = i / CP;
                v[u] = 0; /* past the split's end: zeros (weight 0) */
                if (i < TK * CP && k < nk) v[u] = ld_pair(a.cache, (size_t)eo[k] + 2 * (i - k * CP), a.kv8, w_even);
            }
#pragma unroll
            for (int u = 0; u < LDU; u++) {
                int i = i0 + u * THREADS, k = i / CP;
                if (i < TK * CP) tl[k * RS + i - k * CP] = v[u];
            }
        }
        __syncthreads();
        if (ha < nh) {
            const float2 *qa = (const float2 *)(qs + (size_t)ha * CR);
            const float2 *qb = (const float2 *)(qs + (size_t)(hb < nh ? hb : ha) * CR); /* no head b: a's again */
            const uint32_t *row = tl + lane * RS;
            float da = 0.0f, db = 0.0f;
            for (int cp = 0; cp < CP; cp++) {
                uint32_t v = row[cp];
                float x0 = __uint_as_float(v << 16), x1 = __uint_as_float(v & 0xffff0000u);
                float2 u = qa[cp], w = qb[cp];
                da = fmaf(u.x, x0, fmaf(u.y, x1, da));
                db = fmaf(w.x, x0, fmaf(w.y, x1, db));
            }
            bool ok = lane < nk; /* lane 0 always: the tile has a key */
            float sa = ok ? da * a.scale : -INFINITY, mx = fmaxf(ma, warp_max(sa));
            float p = __expf(sa - mx), c = __expf(ma - mx); /* ma = -inf at the first tile: c 0 */
            la = la * c + warp_sum(p), ma = mx;
            ps[lane * HGM + ha] = p;
            if (lane == 0) cr[ha] = c;
            if (hb < nh) {
                float sb = ok ? db * a.scale : -INFINITY, my = fmaxf(mb, warp_max(sb));
                float pb = __expf(sb - my), cb = __expf(mb - my);
                lb = lb * cb + warp_sum(pb), mb = my;
                ps[lane * HGM + hb] = pb;
                if (lane == 0) cr[hb] = cb;
            }
        }
        __syncthreads();
        if (2 * tid < C) {
#pragma unroll
            for (int h = 0; h < HGM; h++) acc[h][0] *= cr[h], acc[h][1] *= cr[h];
            for (int k = 0; k < nk; k++) {
                uint32_t v = tl[k * RS + tid];
                float x0 = __uint_as_float(v << 16), x1 = __uint_as_float(v & 0xffff0000u);
                const float4 *p4 = (const float4 *)(ps + k * HGM);
#pragma unroll
                for (int q = 0; q < HGM / 4; q++) {
                    float4 p = p4[q];
                    float *a0 = acc[4 * q], *a1 = acc[4 * q + 1], *a2 = acc[4 * q + 2], *a3 = acc[4 * q + 3];
                    a0[0] = fmaf(p.x, x0, a0[0]), a0[1] = fmaf(p.x, x1, a0[1]);
                    a1[0] = fmaf(p.y, x0, a1[0]), a1[1] = fmaf(p.y, x1, a1[1]);
                    a2[0] = fmaf(p.z, x0, a2[0]), a2[1] = fmaf(p.z, x1, a2[1]);
                    a3[0] = fmaf(p.w, x0, a3[0]), a3[1] = fmaf(p.w, x1, a3[1]);
                }
            }
        }
        __syncthreads(); /* the tile, ps and cr are rewritten by the next tile */
    }
    if (lane == 0 && ha < nh) ml[ha] = ma, ml[HGM + ha] = la;
    if (lane == 0 && hb < nh) ml[hb] = mb, ml[HGM + hb] = lb;
    __syncthreads();
    if (2 * tid >= C) return;
#pragma unroll
    for (int h = 0; h < HGM; h++) {
        if (h >= nh) continue;
        float m = ml[h], l = ml[HGM + h];
        size_t row = (size_t)t * a.H + h0 + h;
        if (S == 1) {
            float il = l > 0.0f ? 1.0f / l : 0.0f; /* no key chosen (k-pools without a tail, before the first pool): 0 */
            uint16_t *o = a.olat + row * C + 2 * tid;
            o[0] = f2bf(acc[h][0] * il), o[1] = f2bf(acc[h][1] * il);
        } else {
            float *pr = a.part + (((size_t)t * S + s) * a.H + h0 + h) * (C + 2);
            if (k0 < k1) pr[2 * tid] = acc[h][0], pr[2 * tid + 1] = acc[h][1]; /* an empty split's never read */
            if (tid == 0) pr[C] = m, pr[C + 1] = l;
        }
    }
}

/* One block per (head, token): the splits' partial sums rescaled to the
 * common max and normalized by the total weight. */
static __global__ void __launch_bounds__(THREADS) combine_kernel(const float *part, int S, int H, int C, uint16_t *olat)
{
    __shared__ float w[SMAX], il;
    int h = blockIdx.x, t = blockIdx.y, lane = threadIdx.x & 31;
    size_t st = (size_t)H * (C + 2);
    const float *p = part + ((size_t)t * S * H + h) * (C + 2); /* split s at p + s st */
    if (threadIdx.x < 32) {
        float M = -INFINITY;
        for (int s = lane; s < S; s += 32) M = fmaxf(M, p[s * st + C]);
        M = warp_max(M);
        float L = 0.0f;
        for (int s = lane; s < S; s += 32) {
            float m = p[s * st + C], ws = m == -INFINITY ? 0.0f : __expf(m - M); /* an empty split: 0 */
            w[s] = ws;
            L = fmaf(ws, p[s * st + C + 1], L);
        }
        L = warp_sum(L);
        if (lane == 0) il = L > 0.0f ? 1.0f / L : 0.0f;
    }
    __syncthreads();
    uint16_t *o = olat + ((size_t)t * H + h) * C;
    for (int c = threadIdx.x; c < C; c += THREADS) {
        float v = 0.0f;
        for (int s = 0; s < S; s++)
            if (w[s] != 0.0f) v = fmaf(w[s], p[s * st + c], v);
        o[c] = f2bf(v * il);
    }
}

extern "C" cudaError_t cuda_mla_attention(const struct cuda_mla_attn_args *a, cudaStream_t st)
{
    if (a->T <= 0) return cudaSuccess;
    struct attn_geom g;
    if (attn_plan(a->T, a->H, a->C, a->R, &g)) return cudaErrorInvalidValue;
    if (!a->part) g.S = 1; /* no scratch for the partial sums: one split */
    if (a->T > 65535) return cudaErrorInvalidValue;
    cudaError_t e = cudaFuncSetAttribute(attn_kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, (int)g.sm);
    if (e != cudaSuccess) return e;
    attn_kernel<<<dim3(g.S, a->T, g.G), THREADS, g.sm, st>>>(*a, g.hg, g.S, g.RS);
    if (g.S > 1) combine_kernel<<<dim3(a->H, a->T), THREADS, 0, st>>>(a->part, g.S, a->H, a->C, a->olat);
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

/* One block per token whose position completes a pool (k-pools): the
 * pool's key, channel by channel as cpu_mla.c's pool_keys (f32, expf), into
 * pk at its last token's slot (the pad block's for graph padding). Every
 * key and gate of the step is in the cache (ix_prep_kernel ran), and the
 * pool's earlier tokens are this step's or an earlier one's. */
static __global__ void ix_pool_kernel(struct cuda_mla_ix_args a)
{
    int t = blockIdx.x, p = a.pos[t], KP = a.KP, ID = a.ID, bs = a.block_size;
    if ((p + 1) % KP) return;
    const int32_t *bt = a.bt + a.tok_bt[t];
    long long sl = a.slots[t];
    float *o = a.pk + ((size_t)(sl / bs) * a.PB + (size_t)(sl % bs) / KP) * ID;
    int p0 = p + 1 - KP;
    for (int d = threadIdx.x; d < ID; d += blockDim.x) {
        float mx = -INFINITY, sum = 0.0f, v = 0.0f;
        for (int i = 0; i < KP; i++) {
            int j = p0 + i;
            size_t e = ((size_t)bt[j / bs] * bs + j % bs) * a.W + a.C + a.R;
            mx = fmaxf(mx, ld_kv(a.cache, e + ID + d, a.kv8) + a.ape[i * ID + d]);
        }
        for (int i = 0; i < KP; i++) {
            int j = p0 + i;
            size_t e = ((size_t)bt[j / bs] * bs + j % bs) * a.W + a.C + a.R;
            sum += expf(ld_kv(a.cache, e + ID + d, a.kv8) + a.ape[i * ID + d] - mx);
        }
        for (int i = 0; i < KP; i++) {
            int j = p0 + i;
            size_t e = ((size_t)bt[j / bs] * bs + j % bs) * a.W + a.C + a.R;
            float w = expf(ld_kv(a.cache, e + ID + d, a.kv8) + a.ape[i * ID + d] - mx);
            v += w / sum * ld_kv(a.cache, e + d, a.kv8);
        }
        o[d] = v;
    }
}

/* The scores: a block per (split s, token t) takes the token's candidates
 * (keys, or whole pools' cached keys) [k0, k1) in tiles of nt, each tile's
 * keys widened to f32 into shared memory beside the token's queries and
 * weights. Thread (hl = tid % hg, cg = tid / hg) takes heads hl + hg i (the
 * heads padded with zero queries and weights to 4 hg nr) against candidates
 * IXCT cg .. IXCT cg + IXCT - 1, in float4 steps over the dims; its heads'
 * w_h relu(q_h . k / sqrt(ID)) are summed, then the hg lanes of a candidate
 * by shuffles. Every candidate's score takes the same order of operations
 * wherever it lies, so equal keys score equal (the choice's ties). The
 * splits S come from T alone (a decode step's few tokens spread over the
 * GPU; graph-safe at any context), each split whole tiles, at least one. */
#define IXT 256   /* the score kernel's threads */
#define IXCT 2    /* candidates a thread scores per tile */
#define IXLD 4    /* loads (of 4 dims) a thread has in flight while filling a tile */
#define IXBLK 528 /* score blocks a step aims for before its tokens stop splitting */
#define IXSMAX 256

struct ix_geom {
    int hg, nr, idp, qs, nt, S; /* lanes over heads, head rounds, dims padded to 4, a row's stride, tile, splits */
    size_t sm;
};

static void ix_plan(int T, int IH, int ID, struct ix_geom *g)
{
    int hq = (IH + 3) / 4;
    g->hg = 1;
    while (g->hg < hq && g->hg < 32) g->hg *= 2;
    g->nr = (hq + g->hg - 1) / g->hg;
    g->idp = (ID + 3) / 4 * 4;
    g->qs = g->idp + 4; /* rows of 4 + a multiple of 4 floats: lanes of different rows hit different banks */
    g->nt = IXT / g->hg * IXCT;
    g->S = T >= IXBLK / 2 ? 1 : (IXBLK / T < IXSMAX ? IXBLK / T : IXSMAX);
    size_t HP = (size_t)4 * g->hg * g->nr;
    g->sm = (HP * g->qs + HP + (size_t)g->nt * g->qs) * sizeof(float) + (size_t)g->nt * sizeof(long long);
}

/* dims d .. d + 3 of the key at o (in pk with k-pools, pk NULL: in the cache), zeros past ID; vec: aligned */
static __device__ __forceinline__ float4 ix_key4(const float *pk, const void *cache, int ID, bool kv8, long long o,
                                                 int d, bool vec)
{
    if (vec && pk) return *(const float4 *)(pk + o + d);
    if (vec && kv8) {
        uint32_t u = *(const uint32_t *)((const uint8_t *)cache + o + d);
        float x[4];
#pragma unroll
        for (int k = 0; k < 4; k++) {
            __half_raw h = __nv_cvt_fp8_to_halfraw((__nv_fp8_storage_t)(u >> 8 * k), __NV_E4M3);
            x[k] = __half2float(*(const __half *)&h);
        }
        return make_float4(x[0], x[1], x[2], x[3]);
    }
    if (vec) {
        uint2 u = *(const uint2 *)((const uint16_t *)cache + o + d);
        return make_float4(__uint_as_float(u.x << 16), __uint_as_float(u.x & 0xffff0000u),
                           __uint_as_float(u.y << 16), __uint_as_float(u.y & 0xffff0000u));
    }
    float x[4];
#pragma unroll
    for (int k = 0; k < 4; k++)
        x[k] = d + k >= ID ? 0.0f : pk ? pk[o + d + k] : ld_kv(cache, (size_t)o + d + k, kv8);
    return make_float4(x[0], x[1], x[2], x[3]);
}

static __global__ void __launch_bounds__(IXT, 4) ix_score_kernel(struct cuda_mla_ix_args a, int hg, int nr, int idp,
                                                               int qs, int nt, int S)
{
    extern __shared__ float4 ix_smem4[];
    int HP = 4 * hg * nr;
    float *qsm = (float *)ix_smem4;              /* [HP][qs] */
    float *wsm = qsm + (size_t)HP * qs;          /* [HP] */
    float *ks = wsm + HP;                        /* [nt][qs] */
    long long *eo = (long long *)(ks + (size_t)nt * qs); /* [nt] a candidate's key: its offset in cache or pk */
    int s = blockIdx.x, t = blockIdx.y, ID = a.ID, IH = a.IH, KP = a.KP, bs = a.block_size, tid = threadIdx.x;
    int n = KP > 0 ? (a.pos[t] + 1) / KP : a.pos[t] + 1;
    int ch = (n + S - 1) / S;
    ch = (ch + nt - 1) / nt * nt;
    ch = ch > 0 ? ch : nt;
    int k0 = s * ch, k1 = n - k0 < ch ? n : k0 + ch;
    if (k0 >= k1) return; /* the whole block: nothing in this split */
    const float *qg = a.q + (size_t)t * IH * ID;
    for (int i = tid; i < HP * qs; i += IXT) {
        int h = i / qs, d = i - h * qs;
        qsm[i] = h < IH && d < ID ? qg[(size_t)h * ID + d] : 0.0f;
    }
    for (int i = tid; i < HP; i += IXT) wsm[i] = i < IH ? a.w[(size_t)t * IH + i] : 0.0f;
    const int32_t *bt = a.bt + a.tok_bt[t];
    int hl = tid & (hg - 1), cg = tid / hg, q4 = idp / 4;
    /* whole aligned groups of 4 dims: pool keys (16 bytes), bf16 (8) or e4m3 (4) keys */
    bool vec = ID % 4 == 0 && (KP > 0 || (a.W % 4 == 0 && (a.C + a.R) % 4 == 0));
    const float *pk = KP > 0 ? a.pk : NULL;
    float sc = rsqrtf((float)ID);
    float *out = a.scores + (size_t)t * a.max_ctx;
    for (int j0 = k0; j0 < k1; j0 += nt) {
        int nk = k1 - j0 < nt ? k1 - j0 : nt;
        __syncthreads(); /* the last tile's keys and offsets read */
        for (int i = tid; i < nk; i += IXT) {
            int j = j0 + i;
            if (KP > 0) {
                int pl = j * KP + KP - 1; /* the pool's last token */
                eo[i] = ((long long)bt[pl / bs] * a.PB + (pl % bs) / KP) * ID;
            } else {
                eo[i] = ((long long)bt[j / bs] * bs + j % bs) * a.W + a.C + a.R;
            }
        }
        __syncthreads();
        for (int i0 = tid; i0 < nt * q4; i0 += IXLD * IXT) {
            float4 v[IXLD];
#pragma unroll
            for (int u = 0; u < IXLD; u++) {
                int i = i0 + u * IXT, c = i / q4, d = 4 * (i - c * q4);
                v[u] = make_float4(0.0f, 0.0f, 0.0f, 0.0f); /* past the tile's keys or dims: zeros */
                if (i < nt * q4 && c < nk) v[u] = ix_key4(pk, a.cache, ID, a.kv8, eo[c], d, vec);
            }
#pragma unroll
            for (int u = 0; u < IXLD; u++) {
                int i = i0 + u * IXT, c = i / q4, d = 4 * (i - c * q4);
                if (i < nt * q4) *(float4 *)(ks + c * qs + d) = v[u];
            }
        }
        __syncthreads();
        float part[IXCT];
#pragma unroll
        for (int u = 0; u < IXCT; u++) part[u] = 0.0f;
        const float *kr = ks + (size_t)cg * IXCT * qs;
        for (int r = 0; r < nr; r++) {
            const float *qr = qsm + (size_t)(hl + 4 * hg * r) * qs; /* head hl + hg (4 r + i) at qr + i hg qs */
            float acc[4][IXCT];
#pragma unroll
            for (int i = 0; i < 4; i++)
#pragma unroll
                for (int u = 0; u < IXCT; u++) acc[i][u] = 0.0f;
            for (int d = 0; d < idp; d += 4) {
                float4 qv[4], kv[IXCT];
#pragma unroll
                for (int i = 0; i < 4; i++) qv[i] = *(const float4 *)(qr + (size_t)i * hg * qs + d);
#pragma unroll
                for (int u = 0; u < IXCT; u++) kv[u] = *(const float4 *)(kr + (size_t)u * qs + d);
#pragma unroll
                for (int i = 0; i < 4; i++)
#pragma unroll
                    for (int u = 0; u < IXCT; u++) {
                        float x = acc[i][u];
                        x = fmaf(qv[i].x, kv[u].x, x);
                        x = fmaf(qv[i].y, kv[u].y, x);
                        x = fmaf(qv[i].z, kv[u].z, x);
                        acc[i][u] = fmaf(qv[i].w, kv[u].w, x);
                    }
            }
#pragma unroll
            for (int i = 0; i < 4; i++) {
                float wh = wsm[hl + hg * (4 * r + i)];
#pragma unroll
                for (int u = 0; u < IXCT; u++) {
                    float dd = acc[i][u] * sc;
                    part[u] += wh * (dd > 0.0f ? dd : 0.0f);
                }
            }
        }
        for (int o = 1; o < hg; o <<= 1)
#pragma unroll
            for (int u = 0; u < IXCT; u++) part[u] += __shfl_xor_sync(0xffffffffu, part[u], o);
        if (hl == 0)
#pragma unroll
            for (int u = 0; u < IXCT; u++) {
                int c = cg * IXCT + u;
                if (c < nk) out[j0 + c] = part[u];
            }
    }
}

/* an order-keeping map of floats to unsigned ints; -0 takes +0's value, as
 * the CPU's float compare makes them a tie (a score is -0 when every head's
 * ReLU is 0 and a weight is negative) */
static __device__ __forceinline__ uint32_t ord(float f)
{
    uint32_t b = __float_as_uint(f);
    if (b == 0x80000000u) b = 0u;
    return b & 0x80000000u ? ~b : b | 0x80000000u;
}

/* v's exclusive prefix sum over the block's threads (in thread order); *total: the sum of all; sh: 32 ints */
static __device__ int block_excl_scan(int v, int *sh, int *total)
{
    int lane = threadIdx.x & 31, wp = threadIdx.x >> 5, nw = blockDim.x >> 5, inc = v;
    for (int o = 1; o < 32; o <<= 1) {
        int y = __shfl_up_sync(0xffffffffu, inc, o);
        if (lane >= o) inc += y;
    }
    if (lane == 31) sh[wp] = inc;
    __syncthreads();
    int before = 0, tot = 0;
    for (int i = 0; i < nw; i++) {
        int x = sh[i];
        before += i < wp ? x : 0;
        tot += x;
    }
    __syncthreads(); /* sh reusable */
    *total = tot;
    return before + inc - v;
}

/* One block per token: the K-th best score by a radix select over the
 * ordered values (four passes of an 8-bit shared histogram, each counting
 * the candidates whose higher bits match the digits found so far; a warp's
 * equal digits added once), then, each thread over a contiguous run of the
 * candidates, the ones above it and the earliest of those equal to it
 * (ranked by a block scan), written in ascending order. */
#define TKT 512
static __global__ void __launch_bounds__(TKT) ix_topk_kernel(struct cuda_mla_ix_args a)
{
    __shared__ int hist[256], sh[32];
    __shared__ uint32_t s_pref;
    __shared__ int s_kk;
    /* n candidates (keys, or whole pools of KP keys), K of them chosen */
    int t = blockIdx.x, pos = a.pos[t], KP = a.KP > 0 ? a.KP : 1, n = (pos + 1) / KP, K = a.KP > 0 ? a.want : a.K;
    int tid = threadIdx.x, lane = tid & 31, wp = tid >> 5;
    bool tail = a.KP > 0 && a.tail;
    int32_t *out = a.sel + (size_t)t * a.KS;
    if (n <= K) {
        if (a.KP == 0 || tail) { /* every key 0..pos */
            if (tid == 0) a.nsel[t] = -1;
            return;
        }
        for (int j = tid; j < n * KP; j += TKT) out[j] = j; /* the whole pools, no tail */
        if (tid == 0) a.nsel[t] = n * KP;
        return;
    }
    const float *s = a.scores + (size_t)t * a.max_ctx;
    uint32_t pref = 0, mask = 0;
    int kk = K; /* the rank sought among the candidates matching pref under mask, from the top */
    for (int shift = 24; shift >= 0; shift -= 8) {
        for (int i = tid; i < 256; i += TKT) hist[i] = 0;
        __syncthreads();
        for (int j0 = 0; j0 < n; j0 += TKT) {
            int j = j0 + tid;
            uint32_t u = j < n ? ord(s[j]) : 0u;
            int dig = j < n && (u & mask) == pref ? (int)((u >> shift) & 255u) : 256;
            if (!__any_sync(0xffffffffu, dig < 256)) continue; /* later passes: most warps match nothing */
            unsigned peers = __match_any_sync(0xffffffffu, dig);
            if (dig < 256 && lane == __ffs(peers) - 1) atomicAdd(&hist[dig], __popc(peers));
        }
        __syncthreads();
        if (wp == 0) { /* lane l: digits 255 - 8 l down to 248 - 8 l */
            int c[8], tot = 0;
#pragma unroll
            for (int i = 0; i < 8; i++) c[i] = hist[255 - 8 * lane - i], tot += c[i];
            int inc = tot;
            for (int o = 1; o < 32; o <<= 1) {
                int y = __shfl_up_sync(0xffffffffu, inc, o);
                if (lane >= o) inc += y;
            }
            int acc = inc - tot; /* candidates in higher digits */
            if (acc < kk && kk <= inc) { /* the K-th is in this lane's digits: one lane */
#pragma unroll
                for (int i = 0; i < 8; i++) {
                    if (acc < kk && kk <= acc + c[i]) {
                        s_pref = pref | (uint32_t)(255 - 8 * lane - i) << shift;
                        s_kk = kk - acc;
                    }
                    acc += c[i];
                }
            }
        }
        __syncthreads();
        pref = s_pref, kk = s_kk, mask |= 255u << shift;
    }
    /* pref: the K-th best's value; K - kk candidates above it, kk of those equal to it taken */
    int per = (n + TKT - 1) / TKT, jb = tid * per, je = n - jb < per ? n : jb + per, nties = 0, nabove = 0, tot;
    for (int j = jb; j < je; j++) {
        uint32_t u = ord(s[j]);
        nabove += u > pref;
        nties += u == pref;
    }
    int tr = block_excl_scan(nties, sh, &tot); /* the rank of this run's first tie */
    int take_t = kk - tr < 0 ? 0 : kk - tr < nties ? kk - tr : nties;
    int at = block_excl_scan(nabove + take_t, sh, &tot);
    for (int j = jb; j < je; j++) {
        uint32_t u = ord(s[j]);
        bool take = u > pref;
        if (u == pref) take = tr++ < kk;
        if (take) {
            for (int i = 0; i < KP; i++) out[at * KP + i] = j * KP + i;
            at++;
        }
    }
    int m = K * KP, nt = tail ? pos + 1 - n * KP : 0;
    for (int i = tid; i < nt; i += TKT) out[m + i] = n * KP + i; /* the query's own pool */
    if (tid == 0) a.nsel[t] = m + nt;
}

extern "C" bool cuda_mla_indexer_fits(int IH, int ID)
{
    struct ix_geom g;
    if (IH <= 0 || ID <= 0 || ID > 256) return false;
    ix_plan(1, IH, ID, &g);
    return g.sm <= SMEM_MAX;
}

extern "C" cudaError_t cuda_mla_indexer(const struct cuda_mla_ix_args *a, cudaStream_t st)
{
    if (a->T <= 0) return cudaSuccess;
    if (a->ID > 256 || a->R > a->ID || a->R % 2 || a->K <= 0 || a->T > 65535 ||
        (a->KP > 0 && (!a->ape || !a->g || a->want < 1 || !a->pk || a->PB != (a->block_size + a->KP - 1) / a->KP)))
        return cudaErrorInvalidValue;
    struct ix_geom g;
    ix_plan(a->T, a->IH, a->ID, &g);
    if (g.sm > SMEM_MAX) return cudaErrorInvalidValue;
    cudaError_t e = cudaFuncSetAttribute(ix_score_kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, (int)g.sm);
    if (e != cudaSuccess) return e;
    ix_prep_kernel<<<a->T, THREADS, 0, st>>>(*a);
    if (a->KP > 0) ix_pool_kernel<<<a->T, a->ID <= 128 ? 128 : 256, 0, st>>>(*a);
    ix_score_kernel<<<dim3(g.S, a->T), IXT, g.sm, st>>>(*a, g.hg, g.nr, g.idp, g.qs, g.nt, g.S);
    ix_topk_kernel<<<a->T, TKT, 0, st>>>(*a);
    return cudaGetLastError();
}

/* STATUS: an experiment, measured slower than the kernel path (batch-1
 * decode of the Llama-3.1-8B shape on an H200: 180.6-182.2 tok/s against
 * 222.6-223.2) and removed again in the commit after this one; BENCHMARKS.md,
 * "GPU, tenth round", says what was measured and why it loses.
 *
 * mega.cu - a one-token decode step's layers in one persistent kernel
 * (kernels.h: cuda_mega): one block per SM walks every layer's phases, the
 * blocks meeting at a grid barrier between phases, while one warp per block
 * streams the block's share of every weight matrix through a ring in shared
 * memory, running ahead of the compute across the barriers.
 *
 * Why. Batch-1 decode is the weights read once per token. Launched as
 * kernels, each GEMV ramps up and drains (BENCHMARKS.md, ninth round: ~19 us
 * a layer lost in the four GEMVs) and attention's chain of dependent steps
 * leaves the memory idle (~9 us a layer). Here the weights do not depend on
 * anything the step computes, so the producer warp keeps requesting them
 * through every barrier, the attention phase and the phase tails; the
 * compute only has to keep up with a full ring.
 *
 * The weight stream. Every matrix's rows are dealt out to the G blocks in
 * contiguous ranges ([p R / G, (p + 1) R / G) of R units; a gate|up unit is
 * gate row j and up row j). A block's rows go in groups of up to 8 units,
 * one unit per consumer warp; a group is streamed in rounds of 2 KB: round k
 * holds chunk k (bytes [2048 k, 2048 k + 2048)) of each row of each unit, so
 * eight rows are read side by side and the ring need not hold whole rows. A
 * ring slot is one 2 KB chunk with two mbarriers: full (the bulk copy has
 * landed) and empty (its warp has read it). Slot numbers count the block's
 * stream from the start of the kernel; both sides derive them from the same
 * walk (walk_phase), so no slot is ever skipped or read twice.
 *
 * Bits. Consumer warp w sums its row exactly as gemv.cu's warp kernel does
 * (lane l: 16-byte chunks l, l + 32, ... in K order, then the xor butterfly),
 * the norms are rms_rows256 (cuda_add_rmsnorm's order) and the epilogues are
 * the fused kernels' (bf16 qkv; x += bf16(o) and bf16(down); h = silu(bf16 g)
 * bf16 u): every GEMV output is bit for bit the one-token fused path's. The
 * attention phase is its own f32 flash-decoding (below), so the step as a
 * whole is not bit-identical to the kernel path; it is checked against it
 * and the CPU backend (test_gpu_e2e).
 *
 * Phases per layer, each ending at a grid barrier:
 *   qkv   RMSNorm of x into shared memory, qkv = xn Wqkv^T (bf16)
 *   attn  items (KV head g, split s) over the blocks: RoPE of the group's q
 *         heads (rope.cuh, so the bits of cuda_rope_kv), and in the split
 *         holding the new position the K and V write; then each warp runs
 *         32 keys at a time (a lane per key for q.k, a lane per 4 dims for
 *         P V) with an online softmax in f32; the 8 warps merge in shared
 *         memory. One split: the output directly; else a partial row.
 *   merge (more than one split) each head's splits into att (bf16)
 *   o     x += att Wo^T
 *   gu    RMSNorm of x, h = SwiGLU(xn Wgu^T)
 *   down  x += h Wdown^T
 * The grid barrier is a counter in global memory (zeroed before the launch),
 * each block adding one per barrier (release) and spinning until it reaches
 * the barrier's count times G (acquire). All G blocks must be resident at
 * once: G is the SM count and a block takes most of an SM's shared memory,
 * and the launch comes after its predecessor has finished (no PDL).
 *
 * Limits (cuda_mega_ok): sm_90, head_dim 128 with RoPE over the whole head,
 * 1..8 query heads per KV head, a bf16 KV cache, hidden, q and FFN widths
 * multiples of 1024 (whole 2 KB chunks). */
#include <math.h>

#include "cuda/bf16.cuh"
#include "cuda/kernels.h"
#include "cuda/mbar.cuh"
#include "cuda/norm.cuh"
#include "cuda/rope.cuh"

#define MG_NW 8                       /* consumer warps */
#define MG_THREADS (32 * (MG_NW + 1)) /* + the producer warp */
#define MG_CB 2048                    /* bytes per ring slot */
#define MG_CE (MG_CB / 2)             /* bf16 per slot */
#define MG_SMEM 232448                /* the opt-in shared memory per block on sm_90 */
#define MG_MIN_SLOTS 32
#define MG_SLACK 1024                 /* static shared memory and slack */
#define MG_KEYS 64                    /* keys per attention split at least */

#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
#define MG_ARCH 1
#endif

/* one phase: R units of NR rows of `in` bf16 each; row r of unit j is
 * W + (j + r * roff) * in */
struct mg_phase {
    const uint16_t *W;
    int R, NR, in, roff;
};

#ifdef MG_ARCH
static __device__ __forceinline__ struct mg_phase mg_get(const struct cuda_mega_args &a, const struct cuda_mega_layer &L,
                                                         int ph)
{
    int Q = a.H * a.D, QKV = Q + 2 * a.KVH * a.D;
    switch (ph) {
    case 0: return {L.wqkv, QKV, 1, a.E, 0};
    case 1: return {L.wo, a.E, 1, Q, 0};
    case 2: return {L.wgu, a.F, 2, a.E, a.F};
    default: return {L.wdown, a.E, 1, a.F, 0};
    }
}

static __device__ __forceinline__ void bulk_copy(uint32_t dst, const void *src, uint32_t bytes, uint32_t bar)
{
    asm volatile("cp.async.bulk.shared::cluster.global.mbarrier::complete_tx::bytes [%0], [%1], %2, [%3];\n" ::"r"(dst),
                 "l"(src), "r"(bytes), "r"(bar)
                 : "memory");
}
static __device__ __forceinline__ void bar_consumers(void) { asm volatile("bar.sync 1, 256;\n" ::: "memory"); }
struct sync_consumers {
    __device__ __forceinline__ void operator()() const { bar_consumers(); }
};

/* the grid barrier (consumer threads only): n counts this block's barriers */
static __device__ __forceinline__ void grid_sync(unsigned *ctr, unsigned &n)
{
    bar_consumers();
    n++;
    if (threadIdx.x == 0) {
        unsigned want = n * gridDim.x, v;
        __threadfence();
        atomicAdd(ctr, 1u);
        for (;;) {
            asm volatile("ld.acquire.gpu.global.u32 %0, [%1];\n" : "=r"(v) : "l"(ctr) : "memory");
            if (v >= want) break;
            __nanosleep(20);
        }
        __threadfence();
    }
    bar_consumers();
}

/* a block's end of the ring; s: the next slot of the stream; issued: slots
 * the producer has issued, limit: slots it may issue (shared memory) */
struct mg_ring {
    const uint8_t *buf;
    uint32_t full, empty;
    int NS;
    volatile unsigned *issued, *limit;
    unsigned s;
};

/* ---- the producer warp ---- */

/* this block's units of a phase */
static __device__ __forceinline__ void mg_range(int R, int &u0, int &u1)
{
    u0 = (int)((long long)R * blockIdx.x / gridDim.x);
    u1 = (int)((long long)R * (blockIdx.x + 1) / gridDim.x);
}

static __device__ void mg_produce(const struct cuda_mega_args &a, uint32_t ring, uint32_t full, uint32_t empty, int NS,
                                  volatile unsigned *issued, volatile unsigned *limit)
{
    const int lane = threadIdx.x & 31, cb = MG_CB, ce = MG_CE;
    unsigned s = 0;
    for (int l = 0; l < a.n_layer; l++)
        for (int ph = 0; ph < 4; ph++) {
            struct mg_phase P = mg_get(a, a.L[l], ph);
            int u0, u1, nch = P.in / ce;
            mg_range(P.R, u0, u1);
            for (int g0 = u0; g0 < u1; g0 += MG_NW) {
                int nu = min(MG_NW, u1 - g0), n = nu * P.NR;
                for (int k = 0; k < nch; k++, s += n) {
                    while (s + n > *limit) __nanosleep(64); /* the consumers open each phase (mg_open) */
                    if (lane < n) {
                        unsigned sl = s + lane;
                        int ps = (int)(sl % NS), w = lane / P.NR, r = lane % P.NR;
                        if (sl >= (unsigned)NS) mbar_wait(empty + 8 * ps, (int)((sl / NS - 1) & 1));
                        const uint16_t *src = P.W + (size_t)(g0 + w + r * P.roff) * P.in + (size_t)k * ce;
                        mbar_expect_tx(full + 8 * ps, cb);
                        bulk_copy(ring + ps * cb, src, cb, full + 8 * ps);
                    }
                    __syncwarp();
                    if (lane == 0) *issued = s + n;
                }
            }
        }
}

/* ---- the consumers ---- */

enum { MG_BF16, MG_RESID, MG_SWIGLU };

/* y = (x in shared memory) W^T over this block's units of the phase, warp w
 * taking unit w of each group; s: the slot counter, advanced past the phase */
template <int NR, int EPI>
static __device__ __forceinline__ void mg_gemv(const struct mg_phase &P, struct mg_ring &R, const uint16_t *xv,
                                               void *y)
{
    const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5, NS = R.NS, nch = P.in / MG_CE;
    const uint32_t full = R.full, empty = R.empty;
    unsigned &s = R.s;
    int u0, u1;
    mg_range(P.R, u0, u1);
    for (int g0 = u0; g0 < u1; g0 += MG_NW) {
        const int nu = min(MG_NW, u1 - g0);
        if (warp < nu) {
            float acc[NR];
#pragma unroll
            for (int r = 0; r < NR; r++) acc[r] = 0.0f;
            for (int k = 0; k < nch; k++) {
                const uint4 *x4 = (const uint4 *)xv + k * (MG_CE / 8);
#pragma unroll
                for (int r = 0; r < NR; r++) {
                    unsigned sl = s + (unsigned)((k * nu + warp) * NR + r);
                    int ps = (int)(sl % NS);
                    /* the slot's barrier parity is ambiguous until the producer has issued
                     * it: the position's previous copy (another warp's slot) may not have
                     * landed yet, as copies land out of order */
                    while (*R.issued <= sl) {
                    }
                    mbar_wait(full + 8 * ps, (int)((sl / NS) & 1));
                    const uint4 *w4 = (const uint4 *)(R.buf + (size_t)ps * MG_CB);
#pragma unroll
                    for (int u = 0; u < MG_CB / 512; u++) {
                        float wf[8], xf[8];
                        unpack8(w4[u * 32 + lane], wf);
                        unpack8(x4[u * 32 + lane], xf);
#pragma unroll
                        for (int e = 0; e < 8; e++) acc[r] += wf[e] * xf[e];
                    }
                    __syncwarp();
                    if (lane == 0) mbar_arrive(empty + 8 * ps);
                }
            }
#pragma unroll
            for (int r = 0; r < NR; r++) acc[r] = warp_sum(acc[r]);
            if (lane == 0) {
                int j = g0 + warp;
                if (EPI == MG_BF16) ((uint16_t *)y)[j] = f2bf(acc[0]);
                if (EPI == MG_RESID) ((float *)y)[j] = __ldcg((float *)y + j) + bf2f(f2bf(acc[0]));
                if (EPI == MG_SWIGLU) {
                    float g = bf2f(f2bf(acc[0])), u = bf2f(f2bf(acc[NR - 1]));
                    ((uint16_t *)y)[j] = f2bf(g / (1.0f + __expf(-g)) * u);
                }
            }
        }
        s += (unsigned)(nch * nu * NR);
    }
}

/* Lets the producer issue this block's slots of phase P and `ahead` slots
 * past it. Called once the phase's inputs are in shared memory: until then
 * it has at most `ahead` slots of requests in flight, so the barrier's and
 * the prologue's loads do not queue behind a ring's worth of weights. */
static __device__ __forceinline__ void mg_open(const struct mg_phase &P, const struct mg_ring &R, int ahead)
{
    if (threadIdx.x == 0) {
        int u0, u1;
        mg_range(P.R, u0, u1);
        *R.limit = R.s + (unsigned)((u1 - u0) * P.NR * (P.in / MG_CE) + ahead);
    }
}

/* n elements of T (16 bytes) from global memory (written in this kernel, by
 * other blocks) into shared memory, every load of a thread issued before
 * its first store: one round trip for up to 2048 x 16 bytes */
template <typename T>
static __device__ __forceinline__ void mg_load(const T *src, T *dst, int n)
{
    for (int i0 = threadIdx.x; i0 < n; i0 += 256 * 8) {
        T v[8];
#pragma unroll
        for (int u = 0; u < 8; u++)
            if (i0 + 256 * u < n) v[u] = __ldcg(src + i0 + 256 * u);
#pragma unroll
        for (int u = 0; u < 8; u++)
            if (i0 + 256 * u < n) dst[i0 + 256 * u] = v[u];
    }
    bar_consumers();
}

/* RMSNorm of x (global, written by other blocks) into xs (bf16, shared),
 * through a copy of x in shared memory (xf): cuda_add_rmsnorm's bits */
static __device__ __forceinline__ void mg_norm(const float *x, const float *nw, float eps, int E, uint16_t *xs, float *xf,
                                               float *nsh)
{
    mg_load((const float4 *)x, (float4 *)xf, E / 4);
    rms_rows256<1>(xf, nw, eps, E, xs, nsh, sync_consumers{}, ld_plain{});
}

/* Attention of the step's one token, split s of KV head g (keys [lo, hi)),
 * see the top of the file. sm: shared scratch (the x vector's space). */
template <int GS>
static __device__ void mg_attn_item(const struct cuda_mega_args &a, const struct cuda_rope_args &ra, const uint16_t *kc,
                                    const uint16_t *vc, int g, int sp, int S, int lo, int hi, float *sm)
{
    constexpr int D = 128;
    const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5, tid = threadIdx.x, KVH = a.KVH;
    float *qf = sm;                           /* [GS][D] q * scale */
    float *wo = qf + GS * D;                  /* [8][GS][D] */
    float *wm = wo + MG_NW * GS * D;          /* [8][GS] */
    float *wl = wm + MG_NW * GS;              /* [8][GS] */
    uint16_t *qb = (uint16_t *)(wl + MG_NW * GS); /* [GS][D] */
    const int pos = a.pos[0];
    const bool own = pos >= lo && pos < hi;
    for (int j = warp; j < GS + (own ? 2 : 0); j += MG_NW) {
        if (j < GS) {
            rope_head(ra, 0, g * GS + j, NULL, qb + j * D, false);
        } else {
            size_t o = ((size_t)a.slots[0] * KVH + g) * D;
            bool k = j == GS;
            rope_head(ra, 0, (k ? a.H : a.H + KVH) + g, NULL, (uint16_t *)(k ? kc : vc) + o, false);
        }
    }
    bar_consumers();
    for (int i = tid; i < GS * D; i += 256) qf[i] = bf2f(qb[i]) * a.scale;
    bar_consumers();

    float m[GS], l[GS], o[GS][4];
#pragma unroll
    for (int h = 0; h < GS; h++) {
        m[h] = -INFINITY, l[h] = 0.0f;
#pragma unroll
        for (int e = 0; e < 4; e++) o[h][e] = 0.0f;
    }
    const int bs = a.block_size;
    for (int kb = lo + warp * 32; kb < hi; kb += MG_NW * 32) {
        /* the tile's loads early: lane j's key row and the 4 dims of V this
         * lane owns for keys 0..15 first, keys 16..31 once K is used */
        const int key = kb + lane;
        const bool ok = key < hi;
        const long long slot = ok ? (long long)a.bt[key / bs] * bs + key % bs : 0;
        const uint4 *kr = (const uint4 *)(kc + ((size_t)slot * KVH + g) * D);
        uint4 kv[D / 8];
#pragma unroll
        for (int c = 0; c < D / 8; c++) kv[c] = ok ? kr[c] : make_uint4(0, 0, 0, 0);
        uint2 va[16], vb[16];
        auto vload = [&](uint2(&v)[16], int j0) {
#pragma unroll
            for (int j = 0; j < 16; j++) {
                long long sj = __shfl_sync(0xffffffffu, slot, j0 + j);
                v[j] = kb + j0 + j < hi ? *(const uint2 *)(vc + ((size_t)sj * KVH + g) * D + lane * 4)
                                        : make_uint2(0, 0);
            }
        };
        vload(va, 0);
        float sc[GS];
#pragma unroll
        for (int h = 0; h < GS; h++) sc[h] = 0.0f;
#pragma unroll
        for (int c = 0; c < D / 8; c++) {
            float kf[8];
            unpack8(kv[c], kf);
#pragma unroll
            for (int h = 0; h < GS; h++) {
                const float4 *q4 = (const float4 *)(qf + h * D + c * 8);
                float4 qa = q4[0], qc = q4[1];
                sc[h] += qa.x * kf[0] + qa.y * kf[1] + qa.z * kf[2] + qa.w * kf[3] + qc.x * kf[4] + qc.y * kf[5] +
                         qc.z * kf[6] + qc.w * kf[7];
            }
        }
        vload(vb, 16);
#pragma unroll
        for (int h = 0; h < GS; h++) {
            float mx = warp_max(ok ? sc[h] : -INFINITY), mn = fmaxf(m[h], mx);
            float corr = __expf(m[h] - mn), p = ok ? __expf(sc[h] - mn) : 0.0f;
            l[h] = l[h] * corr + warp_sum(p);
#pragma unroll
            for (int e = 0; e < 4; e++) o[h][e] *= corr;
            m[h] = mn, sc[h] = p;
        }
#pragma unroll
        for (int j = 0; j < 32; j++) {
            uint2 v = j < 16 ? va[j] : vb[j - 16];
            float vf[4] = {bf2f((uint16_t)v.x), bf2f((uint16_t)(v.x >> 16)), bf2f((uint16_t)v.y),
                           bf2f((uint16_t)(v.y >> 16))};
#pragma unroll
            for (int h = 0; h < GS; h++) {
                float pj = __shfl_sync(0xffffffffu, sc[h], j); /* 0 past hi */
#pragma unroll
                for (int e = 0; e < 4; e++) o[h][e] += pj * vf[e];
            }
        }
    }
#pragma unroll
    for (int h = 0; h < GS; h++) {
#pragma unroll
        for (int e = 0; e < 4; e++) wo[(warp * GS + h) * D + lane * 4 + e] = o[h][e];
        if (lane == 0) wm[warp * GS + h] = m[h], wl[warp * GS + h] = l[h];
    }
    bar_consumers();
    for (int i = tid; i < GS * D; i += 256) {
        int h = i / D, d = i % D;
        float M = -INFINITY;
        for (int w = 0; w < MG_NW; w++) M = fmaxf(M, wm[w * GS + h]);
        float L = 0.0f, O = 0.0f;
        for (int w = 0; w < MG_NW; w++) {
            float f = wl[w * GS + h] > 0.0f ? __expf(wm[w * GS + h] - M) : 0.0f;
            L += wl[w * GS + h] * f, O += wo[(w * GS + h) * D + d] * f;
        }
        if (S == 1) {
            a.att[(size_t)(g * GS + h) * D + d] = f2bf(O / L);
        } else {
            float *pr = a.part + ((size_t)(g * S + sp) * GS + h) * (D + 2);
            pr[d] = O;
            if (d == 0) pr[D] = M, pr[D + 1] = L;
        }
    }
    bar_consumers(); /* the scratch is free */
}

template <int GS>
static __device__ void mg_attention(const struct cuda_mega_args &a, int l, float *sm, unsigned *ctr, unsigned &nb)
{
    constexpr int D = 128;
    const uint16_t *kc = a.kv + (size_t)(2 * l) * a.kv_layer, *vc = kc + a.kv_layer;
    const struct cuda_mega_layer &L = a.L[l];
    struct cuda_rope_args ra = {
        .qkv = a.qkv, .bias = L.bqkv, .q_norm = L.q_norm, .k_norm = L.k_norm, .cos = a.cos, .sin = a.sin,
        .pos = a.pos, .slots = a.slots, .T = 1, .H = a.H, .KVH = a.KVH, .D = D, .rope_dim = D, .neox = a.neox,
        .eps = a.eps, .q = NULL, .kc = (void *)kc, .vc = (void *)vc, .kv8 = false,
    };
    const int ctx = a.pos[0] + 1, G = gridDim.x;
    /* splits: at least MG_KEYS keys each, at most one round of items */
    int S = (ctx + MG_KEYS - 1) / MG_KEYS, smax = max(1, min(CUDA_ATTN_MAXSPLIT, G / a.KVH));
    if (S > smax) S = smax;
    int ks = ((ctx + S - 1) / S + 31) / 32 * 32;
    S = (ctx + ks - 1) / ks;
    for (int it = blockIdx.x; it < a.KVH * S; it += G) {
        int g = it / S, sp = it % S, lo = sp * ks, hi = min(ctx, lo + ks);
        mg_attn_item<GS>(a, ra, kc, vc, g, sp, S, lo, hi, sm);
    }
    if (S == 1) return;
    grid_sync(ctr, nb);
    for (int hh = blockIdx.x; hh < a.H; hh += G) {
        int g = hh / GS, h = hh % GS;
        for (int d = threadIdx.x; d < D; d += 256) {
            float M = -INFINITY;
            for (int s = 0; s < S; s++) M = fmaxf(M, __ldcg(a.part + ((size_t)(g * S + s) * GS + h) * (D + 2) + D));
            float L = 0.0f, O = 0.0f;
            for (int s = 0; s < S; s++) {
                const float *pr = a.part + ((size_t)(g * S + s) * GS + h) * (D + 2);
                float f = __expf(__ldcg(pr + D) - M);
                L += __ldcg(pr + D + 1) * f, O += __ldcg(pr + d) * f;
            }
            a.att[(size_t)hh * D + d] = f2bf(O / L);
        }
    }
}
#endif /* MG_ARCH */

template <int GS>
static __global__ void __launch_bounds__(MG_THREADS, 1) mega_kernel(const struct cuda_mega_args a, int NS)
{
#ifdef MG_ARCH
    extern __shared__ __align__(128) uint8_t smem[];
    __shared__ float nsh[32];
    uint8_t *ring = smem;
    uint16_t *xv = (uint16_t *)(smem + (size_t)NS * MG_CB);
    uint64_t *bars = (uint64_t *)((uint8_t *)xv + a.xv_bytes);
    const uint32_t full = (uint32_t)__cvta_generic_to_shared(bars), empty = full + 8 * NS;
    if (threadIdx.x == 0)
        for (int i = 0; i < NS; i++) mbar_init(full + 8 * i, 1), mbar_init(empty + 8 * i, 1);
    __syncthreads();
    __shared__ unsigned issued, limit;
    const int ahead = a.ahead > 0 && a.ahead < NS ? a.ahead : NS;
    if (threadIdx.x == 0) {
        issued = 0;
        const struct mg_phase P0 = mg_get(a, a.L[0], 0);
        int u0, u1;
        mg_range(P0.R, u0, u1);
        limit = (unsigned)((u1 - u0) * (P0.in / MG_CE) + ahead); /* phase qkv of layer 0 opens at once */
    }
    __syncthreads();
    if (threadIdx.x >= 32 * MG_NW) {
        mg_produce(a, (uint32_t)__cvta_generic_to_shared(ring), full, empty, NS, &issued, &limit);
        return;
    }
    struct mg_ring R = {ring, full, empty, NS, &issued, &limit, 0};
    unsigned nb = 0;
    const int Q = a.H * a.D;
    float *xf = (float *)(xv + a.E); /* the norm's copy of x */
    /* benchmark switches (outputs wrong): no grid barriers, no norms or vector loads */
    const bool gsync = !(a.dbg & 1), norm = !(a.dbg & 4);
    auto sync = [&]() {
        if (gsync) grid_sync(a.bar, nb);
    };
    for (int l = 0; l < a.n_layer; l++) {
        const struct cuda_mega_layer &L = a.L[l];
        struct mg_phase P = mg_get(a, L, 0);
        if (norm) mg_norm(a.x, L.attn_norm, a.eps, a.E, xv, xf, nsh);
        mg_open(P, R, ahead);
        mg_gemv<1, MG_BF16>(P, R, xv, a.qkv);
        if (!a.skip_attn) {
            grid_sync(a.bar, nb);
            mg_attention<GS>(a, l, (float *)xv, a.bar, nb);
        }
        sync();
        P = mg_get(a, L, 1);
        if (norm) mg_load((const uint4 *)a.att, (uint4 *)xv, Q / 8);
        mg_open(P, R, ahead);
        mg_gemv<1, MG_RESID>(P, R, xv, a.x);
        sync();
        P = mg_get(a, L, 2);
        if (norm) mg_norm(a.x, L.ffn_norm, a.eps, a.E, xv, xf, nsh);
        mg_open(P, R, ahead);
        mg_gemv<2, MG_SWIGLU>(P, R, xv, a.h);
        sync();
        P = mg_get(a, L, 3);
        if (norm) mg_load((const uint4 *)a.h, (uint4 *)xv, a.F / 8);
        mg_open(P, R, ahead);
        mg_gemv<1, MG_RESID>(P, R, xv, a.x);
        sync();
    }
#endif
}

/* shared memory of the attention scratch for GS heads per KV head */
static size_t attn_scratch(int gs) { return (size_t)gs * 128 * 4 * (1 + MG_NW) + 2 * MG_NW * gs * 4 + gs * 128 * 2; }

static size_t xv_bytes(int E, int Q, int F, int gs)
{
    size_t n = (size_t)(E > Q ? E : Q);
    if ((size_t)F > n) n = F;
    n *= 2;
    if ((size_t)E * 6 > n) n = (size_t)E * 6; /* the norm: x in f32 after the bf16 output */
    if (attn_scratch(gs) > n) n = attn_scratch(gs);
    return (n + 127) / 128 * 128;
}

int cuda_mega_ok(int E, int H, int KVH, int D, int rope_dim, int F, bool kv8)
{
    int dev = 0, cc = 0, gs = KVH > 0 ? H / KVH : 0;
    if (cudaGetDevice(&dev) != cudaSuccess ||
        cudaDeviceGetAttribute(&cc, cudaDevAttrComputeCapabilityMajor, dev) != cudaSuccess)
        return 0;
    if (cc < 9 || kv8 || D != 128 || rope_dim != D || KVH < 1 || H % KVH || (gs != 1 && gs != 2 && gs != 4 && gs != 8))
        return 0;
    if (E % MG_CE || (H * D) % MG_CE || F % MG_CE) return 0;
    return xv_bytes(E, H * D, F, gs) + MG_SLACK + (size_t)MG_MIN_SLOTS * (MG_CB + 16) <= MG_SMEM;
}

template <int GS>
static cudaError_t launch(const struct cuda_mega_args *a, int G, cudaStream_t st)
{
    struct cuda_mega_args b = *a;
    b.xv_bytes = (int)xv_bytes(a->E, a->H * a->D, a->F, GS);
    int NS = (int)((MG_SMEM - MG_SLACK - b.xv_bytes) / (MG_CB + 16));
    if (NS < MG_MIN_SLOTS) return cudaErrorInvalidValue;
    mega_kernel<GS><<<G, MG_THREADS, (size_t)NS * (MG_CB + 16) + b.xv_bytes, st>>>(b, NS);
    return cudaGetLastError();
}

cudaError_t cuda_mega_prepare(void)
{
    cudaError_t e = cudaSuccess;
    int n = MG_SMEM - MG_SLACK;
    if (e == cudaSuccess) e = cudaFuncSetAttribute(mega_kernel<1>, cudaFuncAttributeMaxDynamicSharedMemorySize, n);
    if (e == cudaSuccess) e = cudaFuncSetAttribute(mega_kernel<2>, cudaFuncAttributeMaxDynamicSharedMemorySize, n);
    if (e == cudaSuccess) e = cudaFuncSetAttribute(mega_kernel<4>, cudaFuncAttributeMaxDynamicSharedMemorySize, n);
    if (e == cudaSuccess) e = cudaFuncSetAttribute(mega_kernel<8>, cudaFuncAttributeMaxDynamicSharedMemorySize, n);
    return e;
}

cudaError_t cuda_mega(const struct cuda_mega_args *a, cudaStream_t st)
{
    int dev = 0, G = 0;
    cudaError_t e = cudaGetDevice(&dev);
    if (e == cudaSuccess) e = cudaDeviceGetAttribute(&G, cudaDevAttrMultiProcessorCount, dev);
    if (e != cudaSuccess) return e;
    if (!cuda_mega_ok(a->E, a->H, a->KVH, a->D, a->D, a->F, false)) return cudaErrorInvalidValue;
    e = cudaMemsetAsync(a->bar, 0, sizeof *a->bar, st);
    if (e != cudaSuccess) return e;
    switch (a->H / a->KVH) {
    case 1: return launch<1>(a, G, st);
    case 2: return launch<2>(a, G, st);
    case 4: return launch<4>(a, G, st);
    default: return launch<8>(a, G, st);
    }
}

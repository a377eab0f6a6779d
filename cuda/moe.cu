/* moe.cu - the MoE FFN's kernels (moe.h): router logits and routing,
 * grouping tokens by expert (a counting sort), the experts' gate|up with
 * SwiGLU and down over each expert's gathered rows, and the weighted sum;
 * for small steps (cuda_moe_small) the logits, routing and grouping in one
 * launch, gate|up cut finer, and the down projection fused with the
 * weighted sum, chained by programmatic dependent launch (kernels of the
 * layer's expert kinds: its routed experts' and, where they differ, its
 * shared experts').
 *
 * The expert kernels are SIMT and GEMV-shaped (expert_kernel): a warp takes
 * a few weight rows of one active expert and streams them once per pass
 * over 1, 2 or 8 of the expert's tokens, so a decode step reads each
 * chosen expert's weights about once, and only theirs. Lane l takes the
 * 16-byte chunks l, l + 32, ... of each of its rows (8 bf16, 16 int8 or 32
 * int4 weights), a chunk of every one of its rows (gate and up: 8)
 * requested before any is used, so many loads are in flight per SM. A
 * packed weight is dequantized exactly as qgemm.cu does ((code - zero) *
 * scale, rounded once to the scale's dtype): int4 two at a time in packed
 * bf16/f16 arithmetic (the code in the mantissa of 128 + u or 1024 + u,
 * less 128 + z or 1024 + z, times the scale: one rounding), int8 through
 * the 2^23 exponent trick in f32; a chunk's group parameters are read once
 * where the chunk lies in one group. Act-order and odd-width matrices take
 * an element-by-element path out of line (dot_slow). Each
 * (row, token) output is one fixed sequence of f32 operations (the lane's
 * chunks in order, then the xor butterfly), whatever the pass width, the
 * rows a warp takes or the grid, so its bits do not depend on the other
 * tokens of the step: a token's result is the same alone or in a batch,
 * and the small-step kernels give the general ones' bits. Steps of many
 * rows per expert (cuda_moe_gemm_takes; never a small step) run the experts
 * as a grouped GEMM on tensor cores instead (moe_gemm.cu), and steps of
 * cuda_tuning.moe_router_gemm_min_t tokens or more their bf16 router logits
 * (cuda_moe_router_gemm): other sums, other last bits, chosen by the
 * step's size, as the dense layers' GEMV and GEMM are.
 */
#include <math.h>

#include "cuda/bf16.cuh"
#include "cuda/moe.h"
#include "cuda/norm.cuh"
#include "cuda/pdl.cuh"
#include "cuda/tuning.h"

#define MOE_THREADS 256

/* ---- routing ------------------------------------------------------------------------ */

#define LG_WARPS 8                /* warps of a router row's sum (and of the fused routing block) */
#define LG_THREADS (LG_WARPS * 32) /* a router row's virtual lanes */
#define LG_U 4                     /* router chunks a thread keeps in registers (E up to 8192) */
#define LG_TB 16                   /* tokens a block sums before it adds up the warps' partials */

/* 8 activations of a bf16 row, columns [c, c + 8), zeros past cols (vec:
 * cols % 8 == 0 and the row 16-byte aligned, so a chunk is one load): the
 * x pieces of the router's logits and of the experts' dot products */
static __device__ __forceinline__ void act8(const uint16_t *row, int c, int cols, bool vec, float *f)
{
    if (vec && c + 8 <= cols) {
        const uint4 v = *(const uint4 *)(row + c);
        const uint32_t p[4] = {v.x, v.y, v.z, v.w};
#pragma unroll
        for (int j = 0; j < 4; j++) f[2 * j] = __uint_as_float(p[j] << 16), f[2 * j + 1] = __uint_as_float(p[j] & 0xffff0000u);
        return;
    }
#pragma unroll
    for (int j = 0; j < 8; j++) f[j] = c + j < cols ? bf2f(row[c + j]) : 0.0f;
}

/* 8 router weights of row wr, columns [c, c + 8), zeros past E */
template <bool F32>
static __device__ __forceinline__ void router8(const void *router, int e, int E, int c, bool vec, float *w)
{
    if (F32) {
        const float *wr = (const float *)router + (size_t)e * E + c;
        if (vec) {
            const float4 a = __ldg((const float4 *)wr), b = __ldg((const float4 *)wr + 1);
            w[0] = a.x, w[1] = a.y, w[2] = a.z, w[3] = a.w, w[4] = b.x, w[5] = b.y, w[6] = b.z, w[7] = b.w;
        } else {
#pragma unroll
            for (int j = 0; j < 8; j++) w[j] = c + j < E ? wr[j] : 0.0f;
        }
    } else {
        const uint16_t *wr = (const uint16_t *)router + (size_t)e * E + c;
        if (vec) {
            const uint4 v = __ldg((const uint4 *)wr);
            const uint32_t p[4] = {v.x, v.y, v.z, v.w};
#pragma unroll
            for (int j = 0; j < 4; j++) w[2 * j] = __uint_as_float(p[j] << 16), w[2 * j + 1] = __uint_as_float(p[j] & 0xffff0000u);
        } else {
#pragma unroll
            for (int j = 0; j < 8; j++) w[j] = c + j < E ? bf2f(wr[j]) : 0.0f;
        }
    }
}

/* logits[t][e] = x[t] . router[e] for tokens [t0, t1) of one router row e,
 * by a whole block of LG_THREADS threads (every thread calls it: block-wide
 * barriers), so a row's E columns are spread over 8 warps and a step's
 * router over as many blocks as it has rows. The one sum every path's SIMT
 * logits take (logits_kernel, logits_route_kernel): thread v sums the
 * 8-column chunks v, v + LG_THREADS, ... in order (an fmaf chain from 0),
 * each warp adds its lanes' sums by the xor butterfly, and the 8 warps'
 * totals are added in warp order. The router chunks are read once (the
 * first LG_U of a thread's kept in registers) and requested before
 * pdl_wait where PDL (the router is a weight; x may be the predecessor's
 * output). part: LG_TB x LG_WARPS floats of shared memory. nrm (one token,
 * the routing kernel of a step whose norm rides in it: cuda_moe_fuses):
 * after the wait x is made here as cuda_add_rmsnorm makes it, from the
 * residual nrm->xf, into nrm->xs (shared, E) and by block 0 into nrm->xn. */
struct moe_norm_in {
    const float *xf, *nw;
    float eps;
    uint16_t *xs, *xn;
};
template <bool F32, bool PDL>
static __device__ __forceinline__ void logit_row(const void *router, int e, int E, const uint16_t *x, int t0, int t1,
                                                 int ld, float *logits, float *part,
                                                 const moe_norm_in *nrm = nullptr)
{
    const int tid = threadIdx.x, lane = tid & 31, warp = tid >> 5;
    const bool vec = (E & 7) == 0;
    const int nch = (E + 7) / 8;
    float w[LG_U][8];
#pragma unroll
    for (int u = 0; u < LG_U; u++)
        if (tid + LG_THREADS * u < nch) router8<F32>(router, e, E, (tid + LG_THREADS * u) * 8, vec, w[u]);
    float nwv[RMS_J][RMS_K]; /* nrm: the norm's weights, requested with the router's row */
    if (nrm) rms_load(nrm->nw, E, nwv);
    if (PDL) {
        pdl_trigger();
        pdl_wait(); /* x, and the scratch the last step's kernels used, from here on */
    }
    if (nrm) { /* x in one round of loads */
        float xv[RMS_J][RMS_K];
        rms_load(nrm->xf, E, xv);
        const float inv = rms_inv_regs(xv, E, nrm->eps, part);
        rms_store(xv, nwv, E, inv, nrm->xs);
        if (nrm->xn) rms_store(xv, nwv, E, inv, nrm->xn);
        __syncthreads(); /* xs written, part free again */
        x = nrm->xs;
    }
    for (int tb = t0; tb < t1; tb += LG_TB) {
        const int nt = t1 - tb < LG_TB ? t1 - tb : LG_TB;
        for (int m = 0; m < nt; m++) {
            const uint16_t *xr = x + (size_t)(tb + m) * E;
            float acc = 0.0f;
#pragma unroll
            for (int u = 0; u < LG_U; u++) {
                const int c = (tid + LG_THREADS * u) * 8;
                if (c >= E) break;
                float xf[8];
                act8(xr, c, E, vec, xf);
#pragma unroll
                for (int j = 0; j < 8; j++) acc = fmaf(w[u][j], xf[j], acc);
            }
            for (int ch = tid + LG_THREADS * LG_U; ch < nch; ch += LG_THREADS) {
                float wr[8], xf[8];
                router8<F32>(router, e, E, ch * 8, vec, wr);
                act8(xr, ch * 8, E, vec, xf);
#pragma unroll
                for (int j = 0; j < 8; j++) acc = fmaf(wr[j], xf[j], acc);
            }
            acc = warp_sum(acc);
            if (lane == 0) part[m * LG_WARPS + warp] = acc;
        }
        __syncthreads();
        if (tid < nt) {
            float s = part[tid * LG_WARPS];
#pragma unroll
            for (int i = 1; i < LG_WARPS; i++) s = __fadd_rn(s, part[tid * LG_WARPS + i]);
            logits[(size_t)(tb + tid) * ld + e] = s;
        }
        __syncthreads(); /* part free again */
    }
}

/* logits[t][e] = x[t] . router[e] for e < R: block (e, token block of
 * LG_TB) sums row e against its tokens (logit_row). */
template <bool F32>
static __global__ void __launch_bounds__(LG_THREADS) logits_kernel(const uint16_t *x, const void *router, int T,
                                                                   int E, int ld, float *logits)
{
    __shared__ float part[LG_TB * LG_WARPS];
    const int t0 = blockIdx.y * LG_TB, t1 = t0 + LG_TB < T ? t0 + LG_TB : T;
    logit_row<F32, false>(router, blockIdx.x, E, x, t0, t1, ld, logits, part);
}

static cudaError_t launch_logits(const struct cuda_moe_args *a, cudaStream_t st)
{
    const int R = a->NE + (a->shared_gated ? 1 : 0);
    dim3 lg((unsigned)R, (unsigned)((a->T + LG_TB - 1) / LG_TB));
    if (a->router_f32)
        logits_kernel<true><<<lg, LG_THREADS, 0, st>>>(a->xn, a->router, a->T, a->E, a->NE + 1, a->logits);
    else
        logits_kernel<false><<<lg, LG_THREADS, 0, st>>>(a->xn, a->router, a->T, a->E, a->NE + 1, a->logits);
    return cudaGetLastError();
}

/* The best of v[0..n) whose mask byte is set (mask NULL: all), ties to the
 * lower index, as model/moe.c's top_k picks each of its k; -1 when none.
 * Every lane of the warp gets the answer. */
static __device__ int warp_best(const float *v, const unsigned char *mask, int n)
{
    const int lane = threadIdx.x & 31;
    float best = 0.0f;
    int bi = -1;
    for (int i = lane; i < n; i += 32) {
        if (mask && !mask[i]) continue;
        if (bi < 0 || v[i] > best) best = v[i], bi = i; /* ascending within the lane: the first max stays */
    }
    for (int o = 16; o; o >>= 1) {
        float ov = __shfl_xor_sync(0xffffffffu, best, o);
        int oi = __shfl_xor_sync(0xffffffffu, bi, o);
        if (oi >= 0 && (bi < 0 || ov > best || (ov == best && oi < bi))) best = ov, bi = oi;
    }
    return bi;
}

/* An order key of f (not NaN): keys compare as the values do, -0 and +0
 * alike; never 0 (the key of a masked-out element). */
static __device__ __forceinline__ uint32_t order_key(float f)
{
    uint32_t u = __float_as_uint(f);
    if (u == 0x80000000u) u = 0u; /* -0: +0's key */
    return u & 0x80000000u ? ~u : u | 0x80000000u;
}

/* The largest key of this lane's elements lane, lane + 32, ... of key[0..n)
 * (0: none), its first (lowest) index into *bi. */
static __device__ __forceinline__ uint32_t lane_best(const uint32_t *key, int n, int *bi)
{
    uint32_t best = 0;
    int b = -1;
#pragma unroll 4
    for (int i = threadIdx.x & 31; i < n; i += 32) {
        const uint32_t k = key[i];
        if (k > best) best = k, b = i;
    }
    *bi = b;
    return best;
}

/* Bytes of one warp's routing scratch: s, choice [NE], group scores [G],
 * the chosen [K] (ints), then the mask [NE] and group flags [G] (bytes). */
static size_t route_smem(int NE, int G, int K)
{
    size_t b = (size_t)(2 * NE + G + K) * 4 + (size_t)NE + (size_t)G;
    return (b + 15) & ~(size_t)15;
}

/* One warp: model_moe_route over token t's logits, into idx/wt [T][S]
 * (and idx into sidx [T][S], shared memory, unless NULL); base: the warp's
 * route_smem bytes. */
static __device__ void route_token(const struct cuda_moe_args &a, int t, unsigned char *base, int *sidx = nullptr)
{
    const int lane = threadIdx.x & 31;
    const int NE = a.NE, K = a.K, G = a.n_group;
    float *s = (float *)base, *choice = s + NE, *gs = choice + NE;
    int *sel = (int *)(gs + G);
    unsigned char *mask = (unsigned char *)(sel + K), *gtaken = mask + NE;
    /* read through L2 (__ldcg): in the small path's fused kernel other blocks wrote them */
    const float *lg = a.logits + (size_t)t * (NE + 1);
    const float *v; /* what the experts are chosen by */
    if (!a.sigmoid) {
        /* the logits kept in s (a lane's own elements) for the exponentials: one L2 round trip */
        float mx = -INFINITY;
        for (int i = lane; i < NE; i += 32) {
            const float l = __ldcg(lg + i);
            s[i] = l;
            mx = fmaxf(mx, l);
        }
        mx = warp_max(mx);
        float sum = 0.0f;
        for (int i = lane; i < NE; i += 32) {
            s[i] = expf(s[i] - mx);
            sum += s[i];
        }
        sum = warp_sum(sum);
        for (int i = lane; i < NE; i += 32) s[i] /= sum, mask[i] = 1;
        v = s;
    } else {
        for (int i = lane; i < NE; i += 32) {
            s[i] = 1.0f / (1.0f + expf(-__ldcg(lg + i)));
            choice[i] = s[i] + (a.bias ? a.bias[i] : 0.0f);
            mask[i] = G > 1 ? 0 : 1;
        }
        v = choice;
        __syncwarp();
        if (G > 1) {
            /* a group's score: its two best choice values (ties to the lower index) */
            const int per = NE / G;
            for (int g = lane; g < G; g += 32) {
                const float *c = choice + (size_t)g * per;
                int b1 = 0;
                for (int i = 1; i < per; i++)
                    if (c[i] > c[b1]) b1 = i;
                int b2 = -1;
                for (int i = 0; i < per; i++)
                    if (i != b1 && (b2 < 0 || c[i] > c[b2])) b2 = i;
                gs[g] = c[b1] + c[b2];
                gtaken[g] = 1; /* still a candidate */
            }
            __syncwarp();
            for (int j = 0; j < a.topk_group; j++) {
                int g = warp_best(gs, gtaken, G);
                __syncwarp();
                if (lane == 0) gtaken[g] = 0;
                for (int i = lane; i < per; i += 32) mask[(size_t)g * per + i] = 1;
                __syncwarp();
            }
        }
    }
    __syncwarp();
    /* The top K of v among the mask, ties to the lower index (warp_best K times, as top_k picks them):
     * each value's order key (order_key: larger keys for larger values, 0 for the masked) in place of
     * choice, which nothing reads after this; each lane keeps the best of its own elements (lane,
     * lane + 32, ...), the warp takes the largest key by redux, the lowest index among the lanes that
     * hold it, and only the lane that gave it up looks for its next best. */
    uint32_t *key = (uint32_t *)choice;
    for (int i = lane; i < NE; i += 32) key[i] = mask[i] ? order_key(v[i]) : 0u; /* a lane's own: no sync */
    int bi;
    uint32_t bk = lane_best(key, NE, &bi);
    for (int j = 0; j < K; j++) {
        const uint32_t mk = __reduce_max_sync(0xffffffffu, bk);
        const int b = mk ? (int)__reduce_min_sync(0xffffffffu, bk == mk ? (unsigned)bi : 0xffffffffu)
                         : 0; /* none left: the config refuses it */
        if (lane == 0) sel[j] = b;
        if (mk && (b & 31) == lane) {
            key[b] = 0;
            bk = lane_best(key, NE, &bi);
        }
    }
    __syncwarp();
    /* ascending expert order, the order every backend sums them in: slot j's place is the number of
     * choices below it (ties, only when none was left: the earlier first), into key (free again) */
    int *srt = (int *)key;
    for (int j = lane; j < K; j += 32) {
        const int e = sel[j];
        int pos = 0;
        for (int i = 0; i < K; i++) pos += sel[i] < e || (sel[i] == e && i < j);
        srt[pos] = e;
    }
    __syncwarp();
    /* the weights' sum in ascending expert order (every lane the same sum) */
    float sum = 0.0f;
    for (int j = 0; j < K; j++) sum += s[srt[j]];
    /* transformers adds 1e-20 to the sigmoid router's denominator only */
    const float den = a.sigmoid ? sum + 1e-20f : sum;
    int32_t *idx = a.idx + (size_t)t * a.S;
    float *wt = a.wt + (size_t)t * a.S;
    for (int j = lane; j < K; j += 32) {
        const int e = srt[j];
        float w = s[e];
        if (a.norm_topk) w /= den;
        if (a.sigmoid) w *= a.scale;
        idx[j] = e;
        wt[j] = w;
        if (sidx) sidx[t * a.S + j] = e;
    }
    if (lane == 0 && a.S > K) {
        if (sidx) sidx[t * a.S + K] = NE;
        idx[K] = NE;
        wt[K] = a.shared_gated ? 1.0f / (1.0f + expf(-__ldcg(lg + NE))) : 1.0f;
    }
}

/* One warp a token: route_token. */
static __global__ void route_kernel(struct cuda_moe_args a, size_t per_warp)
{
    extern __shared__ __align__(16) unsigned char smem[];
    const int warp = threadIdx.x >> 5;
    const int t = blockIdx.x * (blockDim.x >> 5) + warp;
    if (t >= a.T) return;
    route_token(a, t, smem + (size_t)warp * per_warp);
}

/* The arguments' checks every routing entry makes. */
static bool route_args_ok(const struct cuda_moe_args *a)
{
    return a->NE >= 1 && a->NE <= CUDA_MOE_MAX_EXPERTS && a->K >= 1 && a->K <= a->NE && a->n_group >= 1 &&
           a->NE % a->n_group == 0 && a->topk_group >= 1 && a->topk_group <= a->n_group && a->S >= a->K &&
           a->S <= a->K + 1;
}

extern "C" cudaError_t cuda_moe_route(const struct cuda_moe_args *a, cudaStream_t st)
{
    if (a->T <= 0) return cudaSuccess;
    if (!route_args_ok(a)) return cudaErrorInvalidValue;
    /* big steps: a bf16 router's logits on tensor cores (the small path's cuda_moe_route_group never) */
    const int rg_min = cuda_tuning.moe_router_gemm_min_t;
    cudaError_t e =
        !a->router_f32 && rg_min >= 0 && a->T >= rg_min ? cuda_moe_router_gemm(a, st) : launch_logits(a, st);
    if (e != cudaSuccess) return e;
    size_t per = route_smem(a->NE, a->n_group, a->K);
    int warps = 4;
    while (warps > 1 && per * warps > 48 * 1024) warps /= 2;
    if (per * warps > 48 * 1024) return cudaErrorInvalidValue;
    route_kernel<<<(unsigned)((a->T + warps - 1) / warps), warps * 32, per * warps, st>>>(*a, per);
    return cudaGetLastError();
}

/* ---- grouping by expert ------------------------------------------------------------- */

static __global__ void hist_kernel(const int32_t *idx, int n, int32_t *count)
{
    int i = blockIdx.x * blockDim.x + threadIdx.x;
    if (i < n) atomicAdd(&count[idx[i]], 1);
}

/* One block: start[] the exclusive prefix sum of count[0..n), start[n] the
 * total; act[] the experts with any assignment in ascending order, act[n]
 * their number (n = NE + 1); count[] zeroed again for the scatter's
 * cursors. */
static __global__ void scan_kernel(int32_t *count, int n, int32_t *start, int32_t *act)
{
    __shared__ int ps[MOE_THREADS], pa[MOE_THREADS];
    const int tid = threadIdx.x, chunk = (n + MOE_THREADS - 1) / MOE_THREADS;
    const int lo = tid * chunk, hi = lo + chunk < n ? lo + chunk : n;
    int s = 0, na = 0;
    for (int e = lo; e < hi; e++) s += count[e], na += count[e] > 0;
    ps[tid] = s, pa[tid] = na;
    __syncthreads();
    if (tid == 0) {
        int rs = 0, ra = 0;
        for (int i = 0; i < MOE_THREADS; i++) {
            int x = ps[i], y = pa[i];
            ps[i] = rs, pa[i] = ra;
            rs += x, ra += y;
        }
        start[n] = rs;
        act[n] = ra;
    }
    __syncthreads();
    s = ps[tid], na = pa[tid];
    for (int e = lo; e < hi; e++) {
        int c = count[e];
        start[e] = s;
        if (c > 0) act[na++] = e;
        s += c;
        count[e] = 0;
    }
}

static __global__ void scatter_kernel(const int32_t *idx, int n, const int32_t *start, int32_t *cursor,
                                      int32_t *list)
{
    int i = blockIdx.x * blockDim.x + threadIdx.x;
    if (i >= n) return;
    int e = idx[i];
    list[start[e] + atomicAdd(&cursor[e], 1)] = i;
}

/* The whole grouping in one block, counts in shared memory (steps of up
 * to GROUP1_MAX assignments: decode steps, one launch instead of four). */
#define GROUP1_MAX 8192
#define GROUP1_THREADS 1024
static __global__ void __launch_bounds__(GROUP1_THREADS) group1_kernel(const int32_t *idx, int n, int ne,
                                                                      int32_t *start, int32_t *act, int32_t *list)
{
    __shared__ int cnt[CUDA_MOE_MAX_EXPERTS + 1], st0[CUDA_MOE_MAX_EXPERTS + 1], ps[GROUP1_THREADS],
        pa[GROUP1_THREADS];
    const int tid = threadIdx.x;
    for (int e = tid; e < ne; e += GROUP1_THREADS) cnt[e] = 0;
    __syncthreads();
    for (int i = tid; i < n; i += GROUP1_THREADS) atomicAdd(&cnt[idx[i]], 1);
    __syncthreads();
    /* the exclusive prefix sum, thread tid over its contiguous chunk */
    const int chunk = (ne + GROUP1_THREADS - 1) / GROUP1_THREADS;
    const int lo = tid * chunk, hi = lo + chunk < ne ? lo + chunk : ne;
    int s = 0, na = 0;
    for (int e = lo; e < hi; e++) s += cnt[e], na += cnt[e] > 0;
    ps[tid] = s, pa[tid] = na;
    __syncthreads();
    if (tid == 0) {
        int rs = 0, ra = 0;
        for (int i = 0; i < GROUP1_THREADS; i++) {
            int x = ps[i], y = pa[i];
            ps[i] = rs, pa[i] = ra;
            rs += x, ra += y;
        }
        start[ne] = rs;
        act[ne] = ra;
    }
    __syncthreads();
    s = ps[tid], na = pa[tid];
    for (int e = lo; e < hi; e++) {
        int c = cnt[e];
        st0[e] = s;
        start[e] = s;
        if (c > 0) act[na++] = e;
        s += c;
        cnt[e] = 0;
    }
    __syncthreads();
    for (int i = tid; i < n; i += GROUP1_THREADS) {
        int e = idx[i];
        list[st0[e] + atomicAdd(&cnt[e], 1)] = i;
    }
}

extern "C" cudaError_t cuda_moe_group(const struct cuda_moe_args *a, cudaStream_t st)
{
    if (a->T <= 0) return cudaSuccess;
    const int n = a->T * a->S, nb = (n + MOE_THREADS - 1) / MOE_THREADS;
    if (n <= GROUP1_MAX) {
        group1_kernel<<<1, GROUP1_THREADS, 0, st>>>(a->idx, n, a->NE + 1, a->start, a->act, a->list);
        return cudaGetLastError();
    }
    cudaError_t e = cudaMemsetAsync(a->count, 0, (size_t)(a->NE + 1) * sizeof(int32_t), st);
    if (e != cudaSuccess) return e;
    hist_kernel<<<nb, MOE_THREADS, 0, st>>>(a->idx, n, a->count);
    scan_kernel<<<1, MOE_THREADS, 0, st>>>(a->count, a->NE + 1, a->start, a->act);
    scatter_kernel<<<nb, MOE_THREADS, 0, st>>>(a->idx, n, a->start, a->count, a->list);
    /* count[] zero again between steps: the small path's routing kernel counts its blocks on count[0] */
    if ((e = cudaGetLastError()) != cudaSuccess) return e;
    return cudaMemsetAsync(a->count, 0, (size_t)(a->NE + 1) * sizeof(int32_t), st);
}

/* ---- small steps: logits, routing and grouping in one launch ---------------------------- */

#define RG_WARPS LG_WARPS /* warps of the fused routing block (a router row's): a token each, in turn */

/* Exclusive prefix sum of v over the block (blockDim.x a multiple of 32);
 * the total into *total; sh: 32 ints. Every thread of the block calls it. */
static __device__ int block_exscan(int v, int *sh, int *total)
{
    const int lane = threadIdx.x & 31, w = threadIdx.x >> 5, nw = blockDim.x >> 5;
    int x = v;
    for (int o = 1; o < 32; o <<= 1) {
        int y = __shfl_up_sync(0xffffffffu, x, o);
        if (lane >= o) x += y;
    }
    if (lane == 31) sh[w] = x;
    __syncthreads();
    if (w == 0) {
        int s = lane < nw ? sh[lane] : 0;
        for (int o = 1; o < 32; o <<= 1) {
            int y = __shfl_up_sync(0xffffffffu, s, o);
            if (lane >= o) s += y;
        }
        if (lane < nw) sh[lane] = s; /* inclusive, by warp */
    }
    __syncthreads();
    *total = sh[nw - 1];
    const int r = (w ? sh[w - 1] : 0) + x - v;
    __syncthreads(); /* sh free again */
    return r;
}

/* Shared bytes of the fused routing kernel: the logits' warp partials
 * (logit_row), the last block's flag and the step's idx (RG_SIDX: up to
 * CUDA_MOE_SMALL_SLOTS), together RG_HEAD bytes, then RG_WARPS routing
 * scratches, the counts and starts [NE + 1] each, 32 ints of scan scratch. */
#define RG_SIDX (LG_TB * LG_WARPS * 4 + 16)
#define RG_HEAD (RG_SIDX + CUDA_MOE_SMALL_SLOTS * 4)
static size_t route_group_smem(const struct cuda_moe_args *a)
{
    return RG_HEAD + RG_WARPS * route_smem(a->NE, a->n_group, a->K) + (size_t)(2 * (a->NE + 1) + 32) * 4;
}

/* One block of RG_WARPS warps: every token routed as route_kernel does (the
 * same route_token), then the grouping as cuda_moe_group does it: counts
 * per expert (shared memory), their exclusive prefix sum (start[], the
 * active experts in act[]) and the scatter into list[]. The scan packs an
 * expert's count (low 16 bits) with whether it has any (high 16): small
 * steps have at most CUDA_MOE_SMALL_SLOTS assignments. The grouping reads
 * the step's idx from sidx, the copy route_token keeps in shared memory.
 * Every thread of the block calls it (block-wide barriers). */
static __device__ void route_group_block(const struct cuda_moe_args &a, unsigned char *smem, int *sidx,
                                         size_t per_warp)
{
    const int warp = threadIdx.x >> 5, tid = threadIdx.x, NE1 = a.NE + 1, n = a.T * a.S;
    for (int t = warp; t < a.T; t += RG_WARPS) {
        route_token(a, t, smem + (size_t)warp * per_warp, sidx);
        __syncwarp(); /* every lane done with the scratch before the next token's */
    }
    int *cnt = (int *)(smem + RG_WARPS * per_warp), *st0 = cnt + NE1, *sh = st0 + NE1;
    for (int e = tid; e < NE1; e += blockDim.x) cnt[e] = 0;
    __syncthreads(); /* sidx[] (idx, kept in shared memory: no global round trip) and cnt[] ready */
    for (int i = tid; i < n; i += blockDim.x) atomicAdd(&cnt[sidx[i]], 1);
    __syncthreads();
    const int chunk = (NE1 + (int)blockDim.x - 1) / (int)blockDim.x;
    const int lo = tid * chunk < NE1 ? tid * chunk : NE1, hi = lo + chunk < NE1 ? lo + chunk : NE1;
    int s = 0, na = 0;
    for (int e = lo; e < hi; e++) s += cnt[e], na += cnt[e] > 0;
    int total;
    const int ex = block_exscan(s | na << 16, sh, &total);
    s = ex & 0xffff, na = ex >> 16;
    for (int e = lo; e < hi; e++) {
        const int c = cnt[e];
        st0[e] = s;
        a.start[e] = s;
        if (c > 0) a.act[na++] = e;
        s += c;
        cnt[e] = 0;
    }
    if (tid == 0) a.start[NE1] = total & 0xffff, a.act[NE1] = total >> 16;
    __syncthreads();
    for (int i = tid; i < n; i += blockDim.x) {
        const int e = sidx[i];
        a.list[st0[e] + atomicAdd(&cnt[e], 1)] = i;
    }
}

/* Small steps: the router's logits, the routing and the grouping in one
 * launch. Block e sums router row e against every token of the step
 * (logit_row: logits_kernel's sums, bit for bit; the row requested before
 * pdl_wait, as the router is a weight), so the router is read by as many
 * blocks as it has rows. Then every block fences its logits and counts
 * itself done on a.count[0] (atomicInc with the grid's size less one: the
 * counter wraps back to zero as the last block takes it, so it is zero
 * again for the next launch or graph replay without a reset of its own);
 * the last block routes and groups the whole step (route_group_block),
 * reading the other blocks' logits through L2. */
template <bool F32>
static __global__ void __launch_bounds__(RG_WARPS * 32) logits_route_kernel(struct cuda_moe_args a, size_t per_warp,
                                                                              size_t nsmem)
{
    extern __shared__ __align__(16) unsigned char smem[];
    float *part = (float *)smem;
    int *flag = (int *)(smem + LG_TB * LG_WARPS * 4);
    if (a.xf) { /* one token: its norm first (cuda_moe_fuses), block 0 keeping it for the experts */
        const moe_norm_in nrm = {a.xf, a.nw, a.eps, (uint16_t *)(smem + nsmem), blockIdx.x ? nullptr : (uint16_t *)a.xn};
        logit_row<F32, true>(a.router, blockIdx.x, a.E, a.xn, 0, 1, a.NE + 1, a.logits, part, &nrm);
    } else {
        logit_row<F32, true>(a.router, blockIdx.x, a.E, a.xn, 0, a.T, a.NE + 1, a.logits, part);
    }
    __threadfence(); /* this block's logits visible device-wide before it counts itself done */
    __syncthreads();
    if (threadIdx.x == 0) *flag = atomicInc((unsigned *)a.count, gridDim.x - 1) == gridDim.x - 1;
    __syncthreads();
    const bool last = *flag;
    if (!last) return; /* the whole block */
    __threadfence();
    route_group_block(a, smem + RG_HEAD, (int *)(smem + RG_SIDX), per_warp);
}

extern "C" int cuda_moe_small(const struct cuda_moe_args *a)
{
    return a->T >= 1 && a->T * a->S <= CUDA_MOE_SMALL_SLOTS && a->S <= 32 && route_args_ok(a) &&
           route_group_smem(a) <= 48 * 1024;
}

/* the routing kernel's shared memory with the norm's row after it (16-byte aligned) */
static size_t route_norm_smem(const struct cuda_moe_args *a) { return (route_group_smem(a) + 15) / 16 * 16; }

extern "C" int cuda_moe_fuses(const struct cuda_moe_args *a)
{
    return a->T == 1 && !a->outf && cuda_moe_small(a) && route_norm_smem(a) + (size_t)a->E * 2 <= 48 * 1024 &&
           rms_regs_fit(a->E, RG_WARPS * 32);
}

extern "C" cudaError_t cuda_moe_route_group(const struct cuda_moe_args *a, cudaStream_t st)
{
    if (a->T <= 0) return cudaSuccess;
    if (!cuda_moe_small(a)) return cudaErrorInvalidValue;
    const dim3 g((unsigned)(a->NE + (a->shared_gated ? 1 : 0))); /* a block a router row */
    if (a->xf && !cuda_moe_fuses(a)) return cudaErrorInvalidValue;
    const size_t per = route_smem(a->NE, a->n_group, a->K), ns = route_norm_smem(a);
    const size_t smem = a->xf ? ns + (size_t)a->E * 2 : route_group_smem(a);
    if (a->router_f32) return pdl_launch(logits_route_kernel<true>, g, dim3(RG_WARPS * 32), smem, st, *a, per, ns);
    return pdl_launch(logits_route_kernel<false>, g, dim3(RG_WARPS * 32), smem, st, *a, per, ns);
}

/* ---- the experts -------------------------------------------------------------------- */

/* Weight (r, c) of m, a matrix of `cols` columns, as f32: bf16, or the
 * packed code at c's position dequantized as qgemm.cu does. */
static __device__ __noinline__ float weight(const cuda_moe_mat &m, int r, int c, int cols)
{
    if (m.w) return bf2f(m.w[(size_t)r * cols + c]);
    const int p = m.iperm ? m.iperm[c] : c;
    const uint8_t *row = m.qw + (size_t)r * m.row_bytes;
    uint32_t u;
    if (m.bits == 4) {
        uint32_t word = *(const uint32_t *)(row + (p >> 3) * 4);
        int nib = (p & 7) / 2 + 4 * (p & 1); /* the layout's nibble of column p (model.h) */
        u = (word >> (4 * nib)) & 0xFu;
    } else {
        u = row[p];
    }
    const size_t gi = (size_t)r * m.n_groups + (m.n_groups > 1 ? p / m.group : 0);
    const int z = m.zeros ? (int)m.zeros[gi] : 1 << (m.bits - 1);
    const uint16_t sr = m.scales[gi];
    const float sc = m.f16 ? __half2float(__ushort_as_half(sr)) : bf2f(sr);
    const float w = (float)((int)u - z) * sc; /* exact in f32 */
    return m.f16 ? __half2float(__float2half_rn(w)) : bf2f(f2bf(w));
}

/* pdl_wait(), then (trig) pdl_trigger() */
static __device__ __forceinline__ void pdl_wait_then(bool trig)
{
    pdl_wait();
    if (trig) pdl_trigger();
}

static __device__ __forceinline__ float swiglu_f(float g, float u, float limit)
{
    if (limit > 0.0f) {
        g = fminf(g, limit);
        u = fminf(fmaxf(u, -limit), limit);
    }
    return g / (1.0f + expf(-g)) * u;
}

/* How a matrix is streamed: its 16-byte chunks decoded in registers (bf16
 * rows of a multiple of 8 columns; packed int4/int8 in natural column order
 * with groups of a multiple of 8 columns), or element by element in 8-column
 * chunks (odd bf16 widths, act-order, anything else). */
enum { MK_BF16, MK_Q4, MK_Q8, MK_SLOW };

static __device__ __forceinline__ int mat_kind(const cuda_moe_mat &m, int cols)
{
    if (m.w) return (cols & 7) == 0 ? MK_BF16 : MK_SLOW;
    if (m.iperm || (m.row_bytes & 15) || (m.n_groups > 1 && (m.group & 7))) return MK_SLOW;
    return m.bits == 4 ? MK_Q4 : m.bits == 8 ? MK_Q8 : MK_SLOW;
}

/* mat_kind on the host, for cuda_moe_streamed */
static int mat_kind_host(const cuda_moe_mat &m, int cols)
{
    if (m.w) return (cols & 7) == 0 ? MK_BF16 : MK_SLOW;
    if (m.iperm || (m.row_bytes & 15) || (m.n_groups > 1 && (m.group & 7))) return MK_SLOW;
    return m.bits == 4 ? MK_Q4 : m.bits == 8 ? MK_Q8 : MK_SLOW;
}

/* The one streamed kind of experts [e0, e1) of hex (CUDA_MOE_STREAM_*), 0
 * where they are not of one, -1 where none has rows. */
static int streamed_of(const struct cuda_moe_expert *hex, int e0, int e1, int E)
{
    int kind = -1;
    for (int e = e0; e < e1; e++) {
        const struct cuda_moe_expert &x = hex[e];
        if (x.F <= 0) continue; /* no shared experts */
        const int k[3] = {mat_kind_host(x.gate, E), mat_kind_host(x.up, E), mat_kind_host(x.down, x.F)};
        for (int i = 0; i < 3; i++) {
            if (kind < 0) kind = k[i];
            if (k[i] != kind) return 0;
        }
    }
    if (kind < 0) return -1;
    return kind == MK_Q4 ? CUDA_MOE_STREAM_INT4 : kind == MK_Q8 ? CUDA_MOE_STREAM_INT8
                                                  : kind == MK_BF16 ? CUDA_MOE_STREAM_BF16 : 0;
}

extern "C" int cuda_moe_streamed(const struct cuda_moe_expert *hex, int NE, int E, int *shared)
{
    const int r = streamed_of(hex, 0, NE, E), s = streamed_of(hex, NE, NE + 1, E);
    const int routed = r < 0 ? 0 : r;
    if (shared) *shared = s < 0 ? routed : s;
    return routed;
}

/* What the small path runs a's experts on: SMALL_ANY (kernels that decode
 * every kind), SMALL_ONE (every expert matrix of a.streamed's kind) or
 * SMALL_MIXED (the routed experts of a.streamed's kind, the shared ones of
 * a.streamed_shared's, another: each in kernels of its own) */
enum { SMALL_ANY, SMALL_ONE, SMALL_MIXED };
static int small_mode(const struct cuda_moe_args *a)
{
    if (!a->streamed) return SMALL_ANY;
    if (a->S == a->K || a->streamed_shared == a->streamed) return SMALL_ONE;
    return a->streamed_shared ? SMALL_MIXED : SMALL_ANY;
}

/* weights: read once, never again in this kernel: kept out of L1 */
static __device__ __forceinline__ uint4 ld_stream(const uint4 *p)
{
    uint4 v;
    asm volatile("ld.global.nc.L1::no_allocate.v4.u32 {%0, %1, %2, %3}, [%4];"
                 : "=r"(v.x), "=r"(v.y), "=r"(v.z), "=r"(v.w)
                 : "l"(p));
    return v;
}

static __device__ __forceinline__ uint32_t lop_or_and(uint32_t x, uint32_t mask, uint32_t bits)
{
    uint32_t r;
    asm("lop3.b32 %0, %1, %2, %3, 0xEA;\n" : "=r"(r) : "r"(x), "r"(mask), "r"(bits)); /* (x & mask) | bits */
    return r;
}

static __device__ __forceinline__ uint32_t bf2_sub(uint32_t a, uint32_t b)
{
    __nv_bfloat162 r = __hsub2(*(const __nv_bfloat162 *)&a, *(const __nv_bfloat162 *)&b);
    return *(const uint32_t *)&r;
}
static __device__ __forceinline__ uint32_t bf2_mul(uint32_t a, uint32_t b)
{
    __nv_bfloat162 r = __hmul2_rn(*(const __nv_bfloat162 *)&a, *(const __nv_bfloat162 *)&b);
    return *(const uint32_t *)&r;
}
static __device__ __forceinline__ uint32_t h2_sub(uint32_t a, uint32_t b)
{
    __half2 r = __hsub2(*(const __half2 *)&a, *(const __half2 *)&b);
    return *(const uint32_t *)&r;
}
static __device__ __forceinline__ uint32_t h2_mul(uint32_t a, uint32_t b)
{
    __half2 r = __hmul2_rn(*(const __half2 *)&a, *(const __half2 *)&b);
    return *(const uint32_t *)&r;
}

static __device__ __forceinline__ uint32_t word_of(const uint4 &v, int i)
{
    return i == 0 ? v.x : i == 1 ? v.y : i == 2 ? v.z : v.w;
}

/* A packed row's group parameters as deq_piece takes them: int4, the
 * scale and 128 + z (bf16) or 1024 + z (f16) twice each (packed pairs);
 * int8, the scale as f32 (a) and 2^23 + z (b). */
template <int KIND>
static __device__ __forceinline__ uint2 group_params(const cuda_moe_mat &M, size_t gi)
{
    const int z = M.zeros ? (int)__ldg(M.zeros + gi) : (KIND == MK_Q4 ? 8 : 128);
    const uint32_t sr = __ldg(M.scales + gi);
    if (KIND == MK_Q4) return make_uint2(sr * 0x10001u, ((M.f16 ? 0x6400u : 0x4300u) | (uint32_t)z) * 0x10001u);
    const float s = M.f16 ? __half2float(__ushort_as_half((uint16_t)sr)) : bf2f((uint16_t)sr);
    return make_uint2(__float_as_uint(s), __float_as_uint(8388608.0f + (float)z));
}

/* The 8 weights of one 8-column piece of a packed row (int4: the word lo,
 * column j in nibble j / 2 + 4 (j % 2), the layout's order (model.h); int8:
 * the bytes of lo, then hi), group parameters q (group_params), as f32:
 * (u - z) * scale rounded once to the scale's dtype, as weight() computes
 * it. int4: pair i (nibbles i and i + 4, columns 2i and 2i + 1) becomes 128
 * + u (bf16) or 1024 + u (f16) by or-ing the code into the mantissa; less
 * 128 + z (1024 + z) it is u - z exactly; the packed multiply by the scale
 * rounds the exact product once. int8: 2^23 + u as f32, less 2^23 + z,
 * times the scale (exact), rounded in pairs. */
template <int KIND>
static __device__ __forceinline__ void deq_piece(uint32_t lo, uint32_t hi, uint2 q, bool f16, float *w)
{
    if (KIND == MK_Q4) {
        if (!f16) {
#pragma unroll
            for (int i = 0; i < 4; i++) {
                const uint32_t d = bf2_mul(bf2_sub(lop_or_and(lo >> (4 * i), 0x000F000Fu, 0x43004300u), q.y), q.x);
                w[2 * i] = __uint_as_float(d << 16), w[2 * i + 1] = __uint_as_float(d & 0xffff0000u);
            }
        } else {
#pragma unroll
            for (int i = 0; i < 4; i++) {
                const uint32_t d = h2_mul(h2_sub(lop_or_and(lo >> (4 * i), 0x000F000Fu, 0x64006400u), q.y), q.x);
                const float2 f = __half22float2(*(const __half2 *)&d);
                w[2 * i] = f.x, w[2 * i + 1] = f.y;
            }
        }
    } else {
        const float s = __uint_as_float(q.x), zf = __uint_as_float(q.y);
        float p[8];
#pragma unroll
        for (int j = 0; j < 8; j++)
            p[j] = (__uint_as_float(__byte_perm(j < 4 ? lo : hi, 0x4B000000u, 0x7540 | (j & 3))) - zf) * s;
#pragma unroll
        for (int j = 0; j < 8; j += 2) {
            if (f16) {
                const float2 f = __half22float2(__floats2half2_rn(p[j], p[j + 1]));
                w[j] = f.x, w[j + 1] = f.y;
            } else {
                const __nv_bfloat162 b = __floats2bfloat162_rn(p[j], p[j + 1]);
                const uint32_t v = *(const uint32_t *)&b;
                w[j] = __uint_as_float(v << 16), w[j + 1] = __uint_as_float(v & 0xffff0000u);
            }
        }
    }
}

/* dot_pass for MK_SLOW matrices: 8-column chunks l, l + 32, ... of lane
 * l, weight() element by element; the partial sums into o[(n R + r) TT + m]. */
template <int NM, int R, int TT>
static __device__ __noinline__ void dot_slow(const cuda_moe_mat *pA, const cuda_moe_mat *pB, int r0, int rows,
                                             int cols, const uint16_t *const *xr, bool xvec, float *o)
{
    const int lane = threadIdx.x & 31;
    float acc[NM][R][TT];
#pragma unroll
    for (int n = 0; n < NM; n++)
#pragma unroll
        for (int r = 0; r < R; r++)
#pragma unroll
            for (int m = 0; m < TT; m++) acc[n][r][m] = 0.0f;
    const int nch = (cols + 7) / 8;
    for (int ch = lane; ch < nch; ch += 32) {
        const int c = ch * 8;
        float xf[TT][8];
#pragma unroll
        for (int m = 0; m < TT; m++) act8(xr[m], c, cols, xvec, xf[m]);
#pragma unroll
        for (int n = 0; n < NM; n++) {
            const cuda_moe_mat &M = n ? *pB : *pA;
#pragma unroll
            for (int r = 0; r < R; r++) {
                if (r0 + r >= rows) continue;
                float w[8];
#pragma unroll
                for (int j = 0; j < 8; j++) w[j] = c + j < cols ? weight(M, r0 + r, c + j, cols) : 0.0f;
#pragma unroll
                for (int m = 0; m < TT; m++)
#pragma unroll
                    for (int j = 0; j < 8; j++) acc[n][r][m] = fmaf(w[j], xf[m][j], acc[n][r][m]);
            }
        }
    }
#pragma unroll
    for (int n = 0; n < NM; n++)
#pragma unroll
        for (int r = 0; r < R; r++)
#pragma unroll
            for (int m = 0; m < TT; m++) o[(n * R + r) * TT + m] = acc[n][r][m];
}

/* acc[n][r][m] = row r0 + r of matrix n (A, then B; both of kind KIND, of
 * `cols` columns, `rows` rows) . x row m, for the rows below `rows`, as
 * this lane's partial sum (the caller's warp_sum completes it). Lane l
 * takes the 16-byte chunks l, l + 32, ... (CPC columns each) in order, an
 * 8-column piece at a time, columns in order: the same f32 sequence for a
 * (row, x row) whatever NM, R, TT or U. The U chunks of all NM x R rows are
 * requested before any is used, then the group parameters of all of them
 * (where a chunk lies in one group), then the x pieces as they are used
 * (the act-order and odd-width matrices of MK_SLOW: element by element, as
 * weight() reads them). DOWN (the small path's down kernels, dc_rows): a
 * chunk's x pieces requested together, and rows past `rows` not skipped
 * (their sums: products of zero weights, unused), so that the pass's R
 * chains interleave; the same bits for the rows below `rows`. WAIT:
 * pdl_wait() once the first chunks are requested (x is the predecessor
 * kernel's output; the weights are not), and by every lane before it
 * returns; WAIT 2: pdl_trigger() right after it (the dependent kernel may
 * start once this one's inputs are done). */
template <int KIND, int NM, int R, int TT, int U, int WAIT = 0, bool DOWN = false>
static __device__ __forceinline__ void dot_pass(const cuda_moe_mat &A, const cuda_moe_mat &B, int r0, int rows,
                                                int cols, const uint16_t *const (&xr)[TT], bool xvec,
                                                float (&acc)[NM][R][TT])
{
    const int lane = threadIdx.x & 31;
#pragma unroll
    for (int n = 0; n < NM; n++)
#pragma unroll
        for (int r = 0; r < R; r++)
#pragma unroll
            for (int m = 0; m < TT; m++) acc[n][r][m] = 0.0f;
    if (KIND == MK_SLOW) {
        /* out of line, so its calls do not cost the streamed kinds registers */
        if (WAIT) pdl_wait_then(WAIT == 2);
        float o[NM * R * TT];
        dot_slow<NM, R, TT>(&A, &B, r0, rows, cols, xr, xvec, o);
#pragma unroll
        for (int n = 0; n < NM; n++)
#pragma unroll
            for (int r = 0; r < R; r++)
#pragma unroll
                for (int m = 0; m < TT; m++) acc[n][r][m] = o[(n * R + r) * TT + m];
        return;
    }
    constexpr int CPC = KIND == MK_BF16 ? 8 : KIND == MK_Q4 ? 32 : 16; /* columns a chunk */
    constexpr int SUB = CPC / 8;
    const int nch = (cols + CPC - 1) / CPC;
    /* whether a chunk lies in one group of matrix n (its parameters read once a chunk) */
    bool one[NM];
#pragma unroll
    for (int n = 0; n < NM; n++) {
        const cuda_moe_mat &M = n ? B : A;
        one[n] = KIND == MK_BF16 || M.n_groups == 1 || M.group % CPC == 0;
    }
    /* not unrolled: the compiler would keep two rounds' loads live (twice the registers, half the warps) */
#pragma unroll 1
    for (int ch0 = lane; ch0 < nch; ch0 += 32 * U) {
        uint4 wv[NM][R][U];
#pragma unroll
        for (int u = 0; u < U; u++) {
            const int ch = ch0 + 32 * u;
#pragma unroll
            for (int n = 0; n < NM; n++) {
                const cuda_moe_mat &M = n ? B : A;
#pragma unroll
                for (int r = 0; r < R; r++) {
                    const int row = r0 + r;
                    const uint4 *p = KIND == MK_BF16 ? (const uint4 *)(M.w + (size_t)row * cols)
                                                     : (const uint4 *)(M.qw + (size_t)row * M.row_bytes);
                    wv[n][r][u] = ch < nch && row < rows ? ld_stream(p + ch) : make_uint4(0, 0, 0, 0);
                }
            }
        }
        /* the group parameters of the chunks' rows (the first piece's, for a chunk across groups) */
        uint2 q[NM][R][U];
        if (KIND != MK_BF16) {
#pragma unroll
            for (int u = 0; u < U; u++) {
                const int ch = ch0 + 32 * u;
#pragma unroll
                for (int n = 0; n < NM; n++) {
                    const cuda_moe_mat &M = n ? B : A;
                    const int g = M.n_groups > 1 ? ch * CPC / M.group : 0;
#pragma unroll
                    for (int r = 0; r < R; r++)
                        q[n][r][u] = ch < nch && r0 + r < rows
                                         ? group_params<KIND>(M, (size_t)(r0 + r) * M.n_groups + g)
                                         : make_uint2(0, 0);
                }
            }
        }
        if (WAIT && ch0 == lane) pdl_wait_then(WAIT == 2);
#pragma unroll
        for (int u = 0; u < U; u++) {
            const int ch = ch0 + 32 * u;
            if (ch >= nch) break;
            /* DOWN (x is h, the gate|up kernel's output, from L2): the chunk's x pieces requested at once
             * where they fit in a few registers (TT SUB <= 4), one round trip for them rather than one a
             * piece (the same values: act8 reads them alike) */
            constexpr bool XPRE = DOWN && TT * SUB <= 4;
            const bool whole = XPRE && xvec && (ch + 1) * CPC <= cols;
            uint4 xv[XPRE ? TT : 1][XPRE ? SUB : 1];
            if (XPRE && whole) {
#pragma unroll
                for (int m = 0; m < (XPRE ? TT : 1); m++)
#pragma unroll
                    for (int sub = 0; sub < (XPRE ? SUB : 1); sub++)
                        xv[m][sub] = *(const uint4 *)(xr[m] + ch * CPC + sub * 8);
            }
#pragma unroll
            for (int sub = 0; sub < SUB; sub++) {
                const int c = ch * CPC + sub * 8;
                if (c >= cols) break;
                float xf[TT][8];
#pragma unroll
                for (int m = 0; m < TT; m++) {
                    if (XPRE && whole) {
                        const uint4 v = xv[XPRE ? m : 0][XPRE ? sub : 0];
                        const uint32_t p[4] = {v.x, v.y, v.z, v.w};
#pragma unroll
                        for (int j = 0; j < 4; j++)
                            xf[m][2 * j] = __uint_as_float(p[j] << 16),
                                      xf[m][2 * j + 1] = __uint_as_float(p[j] & 0xffff0000u);
                    } else {
                        act8(xr[m], c, cols, xvec, xf[m]);
                    }
                }
#pragma unroll
                for (int n = 0; n < NM; n++) {
                    const cuda_moe_mat &M = n ? B : A;
#pragma unroll
                    for (int r = 0; r < R; r++) {
                        /* DOWN (up to 8 rows a pass): no test of the row, so the R chains interleave (rows
                         * past the matrix have zero weights and parameters: zero products, and their sums
                         * are not used); elsewhere it stays (the registers of more live chains) */
                        if (!DOWN && r0 + r >= rows) continue;
                        const uint4 v = wv[n][r][u];
                        float w[8];
                        if (KIND == MK_BF16) {
#pragma unroll
                            for (int i = 0; i < 4; i++) {
                                const uint32_t b = word_of(v, i);
                                w[2 * i] = __uint_as_float(b << 16), w[2 * i + 1] = __uint_as_float(b & 0xffff0000u);
                            }
                        } else {
                            /* a chunk across groups (groups of 8 or 16 columns, or 48, ...): this piece's */
                            if (sub > 0 && !one[n] && r0 + r < rows)
                                q[n][r][u] = group_params<KIND>(M, (size_t)(r0 + r) * M.n_groups + c / M.group);
                            if (KIND == MK_Q4) deq_piece<MK_Q4>(word_of(v, sub), 0u, q[n][r][u], M.f16, w);
                            else deq_piece<MK_Q8>(word_of(v, 2 * sub), word_of(v, 2 * sub + 1), q[n][r][u], M.f16, w);
                        }
#pragma unroll
                        for (int m = 0; m < TT; m++)
#pragma unroll
                            for (int j = 0; j < 8; j++) acc[n][r][m] = fmaf(w[j], xf[m][j], acc[n][r][m]);
                    }
                }
            }
        }
    }
    if (WAIT) pdl_wait_then(WAIT == 2); /* lanes without a chunk (idempotent for the others) */
}

/* dot_pass for a kind known at run time (uniform across the warp) */
template <int NM, int R, int TT, int U>
static __device__ __forceinline__ void dot_any(int kind, const cuda_moe_mat &A, const cuda_moe_mat &B, int r0,
                                               int rows, int cols, const uint16_t *const (&xr)[TT], bool xvec,
                                               float (&acc)[NM][R][TT])
{
    switch (kind) {
    case MK_BF16: dot_pass<MK_BF16, NM, R, TT, U>(A, B, r0, rows, cols, xr, xvec, acc); break;
    case MK_Q4: dot_pass<MK_Q4, NM, R, TT, U>(A, B, r0, rows, cols, xr, xvec, acc); break;
    case MK_Q8: dot_pass<MK_Q8, NM, R, TT, U>(A, B, r0, rows, cols, xr, xvec, acc); break;
    default: dot_pass<MK_SLOW, NM, R, TT, U>(A, B, r0, rows, cols, xr, xvec, acc); break;
    }
}

#define NW 4 /* warps a block of the expert kernels */
#define RW 4 /* rows a warp of the expert kernels (in passes of 4 rows at one token, 2 at two, 1 at 8) */
#define TG 8 /* an expert's tokens a block takes at a time (in passes of 8, 2 and 1) */

/* One pass of expert_kernel: the warp's RW rows from r0w (R at a time)
 * against TT of the expert's assignments lp[0 .. TT): GU, h = SwiGLU(gate
 * x, up x) (gate and up in one dot_pass); else y = down h. */
template <bool GU, int TT>
static __device__ __forceinline__ void expert_pass(const struct cuda_moe_args &a, const cuda_moe_mat &W,
                                                   const cuda_moe_mat &U, int kw, int ku, int rows, int cols, int r0w,
                                                   const int32_t *lp)
{
    constexpr int R = TT == 1 ? 4 : TT == 2 ? 2 : 1;
    static_assert(RW % R == 0, "a warp's rows in whole passes");
    const int lane = threadIdx.x & 31;
    int as[TT];
    const uint16_t *xr[TT];
#pragma unroll
    for (int m = 0; m < TT; m++) {
        as[m] = lp[m];
        xr[m] = GU ? a.xn + (size_t)(as[m] / a.S) * a.E : a.h + (size_t)as[m] * a.Fmax;
    }
    const bool xvec = ((GU ? a.E : a.Fmax) & 7) == 0;
#pragma unroll
    for (int rr = 0; rr < RW; rr += R) {
        const int r0 = r0w + rr;
        if (r0 >= rows) break;
        float acc[GU ? 2 : 1][R][TT];
        /* gate and up of two kinds (a checkpoint quantizing one of them): both element by element */
        dot_any<GU ? 2 : 1, R, TT, 1>(kw == ku ? kw : MK_SLOW, W, U, r0, rows, cols, xr, xvec, acc);
#pragma unroll
        for (int r = 0; r < R; r++)
#pragma unroll
            for (int m = 0; m < TT; m++) {
                const float g = warp_sum(acc[0][r][m]), u = GU ? warp_sum(acc[GU ? 1 : 0][r][m]) : 0.0f;
                if (lane != (r * TT + m) % 32 || r0 + r >= rows) continue;
                if (GU) a.h[(size_t)as[m] * a.Fmax + r0 + r] = f2bf(swiglu_f(g, u, a.swiglu_limit));
                else a.y[(size_t)as[m] * a.E + r0 + r] = g;
            }
    }
}

/* GU: h[a] = SwiGLU(gate x, up x) for the expert's assignments a (x the
 * token's row of xn); else y[a] = down h[a]. Grid: (expert slot, row block,
 * token group); a warp takes RW rows, the expert's tokens in groups of up
 * to TG (passes of 8, 2, 1, up to TTMAX: a token alone pays for one). Every (row,
 * token) output is dot_pass's one sequence of operations then the xor
 * butterfly, whatever the pass, the token's place among its expert's
 * tokens or the grid (batch invariance). */
template <bool GU, int TTMAX>
static __global__ void __launch_bounds__(NW * 32) expert_kernel(struct cuda_moe_args a)
{
    const int n_act = a.act[a.NE + 1];
    if ((int)blockIdx.x >= n_act) return;
    const int e = a.act[blockIdx.x];
    const int F = a.ex[e].F, rows = GU ? F : a.E, cols = GU ? a.E : F;
    const int warp = threadIdx.x >> 5;
    const int r0 = (blockIdx.y * NW + warp) * RW;
    if (r0 >= rows || cols <= 0) return; /* the whole warp; no block-wide barrier below */
    const int base = a.start[e], cnt = a.start[e + 1] - base;
    const cuda_moe_mat W = GU ? a.ex[e].gate : a.ex[e].down, U = a.ex[e].up;
    const int kw = mat_kind(W, cols), ku = GU ? mat_kind(U, cols) : kw;
    for (int c0 = blockIdx.z * TG; c0 < cnt; c0 += gridDim.z * TG) {
        const int n = cnt - c0 < TG ? cnt - c0 : TG;
        for (int d = 0; d < n;) {
            const int rem = n - d;
            const int32_t *lp = a.list + base + c0 + d;
            if constexpr (TTMAX >= 8) {
                if (rem >= 8) {
                    expert_pass<GU, 8>(a, W, U, kw, ku, rows, cols, r0, lp);
                    d += 8;
                    continue;
                }
            }
            if constexpr (TTMAX >= 2) {
                if (rem >= 2) {
                    expert_pass<GU, 2>(a, W, U, kw, ku, rows, cols, r0, lp);
                    d += 2;
                    continue;
                }
            }
            expert_pass<GU, 1>(a, W, U, kw, ku, rows, cols, r0, lp);
            d += 1;
        }
    }
}

static cudaError_t launch_expert(bool gu, const struct cuda_moe_args *a, cudaStream_t st)
{
    /* an expert holds at most T assignments (a token picks it once) */
    int slots = a->T * a->K < a->NE ? a->T * a->K : a->NE;
    slots += a->S > a->K;
    int groups = (a->T + TG - 1) / TG;
    if (groups > 16) groups = 16;
    const int rows = gu ? a->Fmax : a->E;
    dim3 g((unsigned)slots, (unsigned)((rows + NW * RW - 1) / (NW * RW)), (unsigned)groups);
    /* passes of at most 1 token (one-token steps), 2 (decode steps: an expert has one or two tokens) or 8:
     * the wider passes' registers are not paid where they cannot help (any choice gives the same bits) */
    void (*k)(struct cuda_moe_args);
    if (a->T == 1) k = gu ? expert_kernel<true, 1> : expert_kernel<false, 1>;
    else if (a->T * a->S <= CUDA_MOE_SMALL_SLOTS) k = gu ? expert_kernel<true, 2> : expert_kernel<false, 2>;
    else k = gu ? expert_kernel<true, 8> : expert_kernel<false, 8>;
    k<<<g, NW * 32, 0, st>>>(*a);
    return cudaGetLastError();
}

extern "C" cudaError_t cuda_moe_gate_up(const struct cuda_moe_args *a, cudaStream_t st)
{
    if (a->T <= 0) return cudaSuccess;
    return launch_expert(true, a, st);
}

extern "C" cudaError_t cuda_moe_down(const struct cuda_moe_args *a, cudaStream_t st)
{
    if (a->T <= 0) return cudaSuccess;
    return launch_expert(false, a, st);
}

extern "C" cudaError_t cuda_moe_experts(const struct cuda_moe_args *a, cudaStream_t st)
{
    if (a->T <= 0) return cudaSuccess;
    /* many rows per expert: tensor cores (moe_gemm.cu); else the GEMVs */
    if (cuda_moe_gemm_takes(a)) return cuda_moe_gemm(a, st);
    cudaError_t e = cuda_moe_gate_up(a, st);
    return e != cudaSuccess ? e : cuda_moe_down(a, st);
}

/* ---- small steps: gate|up and down + combine ------------------------------------------ */

/* The small path's expert kernels give each (row, token) output the bits
 * expert_kernel gives it (dot_pass's one sequence, then the butterfly);
 * what differs is how the work is cut: a warp takes few rows and, per
 * pass, as many rows R and chunks a lane U (small_shape) as make 4 to 8
 * 16-byte loads a lane in flight at once (at the Qwen3-30B-A3B shape int4
 * gate|up 2 rows x 1 chunk x gate and up, in two rounds; int4 down 8 rows
 * x 1 chunk, one pass), so a one-token step has thousands of warps with
 * their weights requested early, where expert_kernel's
 * 4-row, 1-chunk passes took 246 registers (two blocks an SM) and a
 * dependent round trip per chunk. Both take part in programmatic dependent
 * launch (pdl.cuh): gate|up waits for the routing before it reads
 * anything, then lets down + combine start; that one requests its first
 * down weights (its slots' experts from idx: the routing is done once
 * gate|up has waited) before it waits for h. A layer whose shared experts
 * are of another kind than its routed ones (SMALL_MIXED: GLM-5.3-Flash's
 * int4 routed and int8 shared) runs four kernels instead of two, each of
 * one kind (a kernel's registers are its widest kind's): gate|up of the
 * routed slots, gate|up of the shared slot (every token's slot K: no
 * routing needed, so it lets the next kernel start at once and requests
 * its first weights before it waits), the shared slot's down rows into y
 * (f32, where the general path keeps them), and the routed slots' down +
 * combine, which adds that product last, as combine_kernel adds slot K. */
template <int KIND, int NM> struct small_shape {
    /* NM 2 (gate|up: GS_RW rows a warp): int4 2 rows x 1 chunk (a 2048-column row in two rounds: with
     * the registers of one round, 6 blocks an SM fit, gs_min_blocks), int8 and bf16 1 x 4; NM 1 (down:
     * DC_ROWS rows a warp): int4 8 x 1, int8 4 x 2, bf16 2 x 4; element by element 1 x 1 */
    static constexpr int R = KIND == MK_SLOW  ? 1
                             : KIND == MK_Q4  ? (NM == 2 ? 2 : 8)
                             : KIND == MK_Q8  ? (NM == 2 ? 1 : 4)
                                              : (NM == 2 ? 1 : 2);
    static constexpr int U = KIND == MK_SLOW  ? 1
                             : KIND == MK_Q4  ? 1
                             : KIND == MK_Q8  ? (NM == 2 ? 4 : 2)
                                              : 4;
};

#define GS_WARPS 4 /* warps a block of the small gate|up kernel */
#define GS_RW 2    /* rows a warp of it */

/* The warp's GS_RW rows from r0 (R at a time) of gate and up against
 * ntok <= TT of the expert's assignments, lp[0 .. ntok) or (SH, the shared
 * experts: every token's slot K) those of tokens t0 .. t0 + ntok: h =
 * SwiGLU(gate x, up x), as expert_pass stores it (the extra lanes of a
 * pass take the first assignment again and store nothing). SH: x is read
 * only after pdl_wait (dot_pass's WAIT: the first pass's weights are
 * requested before it). */
template <int KIND, int TT, bool SH = false>
static __device__ __forceinline__ void gu_small_rows(const struct cuda_moe_args &a, const cuda_moe_mat &W,
                                                     const cuda_moe_mat &U, int F, int r0, const int32_t *lp, int t0,
                                                     int ntok)
{
    constexpr int R = small_shape<KIND, 2>::R, UU = small_shape<KIND, 2>::U;
    static_assert(GS_RW % R == 0, "a warp's rows in whole passes");
    const int lane = threadIdx.x & 31;
    int as[TT];
    const uint16_t *xr[TT];
#pragma unroll
    for (int m = 0; m < TT; m++) {
        as[m] = SH ? (t0 + (m < ntok ? m : 0)) * a.S + a.K : lp[m < ntok ? m : 0];
        xr[m] = a.xn + (size_t)(as[m] / a.S) * a.E;
    }
    const bool xvec = (a.E & 7) == 0;
#pragma unroll
    for (int rr = 0; rr < GS_RW; rr += R) {
        const int rp = r0 + rr;
        if (rp >= F) break;
        float acc[2][R][TT];
        dot_pass<KIND, 2, R, TT, UU, SH ? 1 : 0>(W, U, rp, F, a.E, xr, xvec, acc);
#pragma unroll
        for (int r = 0; r < R; r++)
#pragma unroll
            for (int m = 0; m < TT; m++) {
                const float g = warp_sum(acc[0][r][m]), u = warp_sum(acc[1][r][m]);
                if (lane != (r * TT + m) % 32 || rp + r >= F || m >= ntok) continue;
                a.h[(size_t)as[m] * a.Fmax + rp + r] = f2bf(swiglu_f(g, u, a.swiglu_limit));
            }
    }
}

/* gu_small_rows for KIND (>= 0: every expert's, cuda_moe_args.streamed), or
 * (-1) the kind found at run time, uniform across the warp */
template <int TT, int KIND>
static __device__ __forceinline__ void gu_small_any(int kind, const struct cuda_moe_args &a, const cuda_moe_mat &W,
                                                    const cuda_moe_mat &U, int F, int r0, const int32_t *lp, int ntok)
{
    if constexpr (KIND >= 0) {
        (void)kind;
        gu_small_rows<KIND, TT>(a, W, U, F, r0, lp, 0, ntok);
    } else {
        switch (kind) {
        case MK_Q4: gu_small_rows<MK_Q4, TT>(a, W, U, F, r0, lp, 0, ntok); break;
        case MK_Q8: gu_small_rows<MK_Q8, TT>(a, W, U, F, r0, lp, 0, ntok); break;
        case MK_BF16: gu_small_rows<MK_BF16, TT>(a, W, U, F, r0, lp, 0, ntok); break;
        default: gu_small_rows<MK_SLOW, TT>(a, W, U, F, r0, lp, 0, ntok); break;
        }
    }
}

/* Which slots a small gate|up kernel takes: every active expert's, the
 * routed experts' only, or the shared experts' only (a layer whose shared
 * experts are of another kind than the routed ones: SMALL_MIXED) */
enum { GU_ALL, GU_ROUTED, GU_SHARED };

/* The shared experts' gate|up (GU_SHARED): block (0, row block), a warp's
 * GS_RW rows against every token's slot K in passes of up to TTMAX tokens
 * (the general path's bits: the same dot_pass sequence, whatever the
 * pass). It needs no routing (slot K of every token is theirs); the
 * weights of its first pass are requested before pdl_wait. */
template <int TTMAX, int KIND>
static __device__ __forceinline__ void gu_shared_warp(const struct cuda_moe_args &a)
{
    const int F = a.ex[a.NE].F;
    const int r0 = (blockIdx.y * GS_WARPS + (threadIdx.x >> 5)) * GS_RW;
    if (r0 >= F || a.E <= 0) {
        pdl_wait(); /* every thread waits (pdl.cuh) */
        return;
    }
    const cuda_moe_mat W = a.ex[a.NE].gate, U = a.ex[a.NE].up;
    for (int d = 0; d < a.T;) {
        const int rem = a.T - d;
        if constexpr (TTMAX >= 4) {
            if (rem >= 3) {
                gu_small_rows<KIND, 4, true>(a, W, U, F, r0, nullptr, d, rem < 4 ? rem : 4);
                d += 4;
                continue;
            }
            if (rem == 2) {
                gu_small_rows<KIND, 2, true>(a, W, U, F, r0, nullptr, d, 2);
                d += 2;
                continue;
            }
        }
        gu_small_rows<KIND, 1, true>(a, W, U, F, r0, nullptr, d, 1);
        d += 1;
    }
}

/* Blocks an SM must hold of the small gate|up kernel for KIND at passes
 * of up to TTMAX tokens: int4 one-token steps 6 (at most 80 registers): a
 * one-token step at the Qwen3-30B-A3B shape has 8 x 96 blocks, which 6 an
 * SM run in one wave on 132 SMs, where 5 (96 registers) left a second wave
 * of 108 blocks, each warp's load round trip and decode overlapped by
 * nothing; each warp now takes its rows in two rounds of a chunk a lane, so
 * one round's decode overlaps other warps' loads. */
static constexpr int gs_min_blocks(int kind, int ttmax, int mode)
{
    return kind == MK_Q4 && ttmax == 1 && mode != GU_SHARED ? 6 : 1; /* the shared experts': one expert's rows */
}

/* Small steps' gate|up: grid (active expert slot, row block of GS_WARPS x
 * GS_RW rows); a warp takes GS_RW rows of its expert against the expert's
 * assignments in passes of up to TTMAX (4 or 1) tokens. KIND: the one kind
 * of the experts it takes (cuda_moe_args.streamed, or .streamed_shared for
 * GU_SHARED), or -1: each expert's found at run time (a kernel that can
 * decode every kind holds the registers of the widest: 240 against
 * int4's 78). MODE: which slots (GU_*; GU_SHARED: gu_shared_warp, which
 * lets its successor start at once: the shared experts' down kernel reads
 * nothing but weights before it waits). */
template <int TTMAX, int KIND, int MODE>
static __global__ void __launch_bounds__(GS_WARPS * 32, gs_min_blocks(KIND, TTMAX, MODE))
    gate_up_small_kernel(struct cuda_moe_args a)
{
    if constexpr (MODE == GU_SHARED) {
        pdl_trigger();
        gu_shared_warp<TTMAX, KIND>(a);
        return;
    }
    pdl_wait();    /* act, start, list: the routing's */
    pdl_trigger(); /* after the wait: down + combine, started early, may read idx */
    const int n_act = a.act[a.NE + 1];
    if ((int)blockIdx.x >= n_act) return;
    const int e = a.act[blockIdx.x];
    if (MODE == GU_ROUTED && e == a.NE) return; /* the shared experts: their own kernel */
    const int F = a.ex[e].F;
    const int r0 = (blockIdx.y * GS_WARPS + (threadIdx.x >> 5)) * GS_RW;
    if (r0 >= F || a.E <= 0) return; /* the whole warp; no block-wide barrier below */
    const int base = a.start[e], cnt = a.start[e + 1] - base;
    const cuda_moe_mat W = a.ex[e].gate, U = a.ex[e].up;
    int kind = KIND;
    if (KIND < 0) {
        /* gate and up of two kinds (a checkpoint quantizing one of them): both element by element */
        const int kw = mat_kind(W, a.E), ku = mat_kind(U, a.E);
        kind = kw == ku ? kw : MK_SLOW;
    }
    for (int d = 0; d < cnt;) {
        const int rem = cnt - d;
        const int32_t *lp = a.list + base + d;
        if constexpr (TTMAX >= 4) {
            if (rem >= 3) {
                gu_small_any<4, KIND>(kind, a, W, U, F, r0, lp, rem < 4 ? rem : 4);
                d += 4;
                continue;
            }
            if (rem == 2) {
                gu_small_any<2, KIND>(kind, a, W, U, F, r0, lp, 2);
                d += 2;
                continue;
            }
        }
        gu_small_any<1, KIND>(kind, a, W, U, F, r0, lp, 1);
        d += 1;
    }
}

typedef void (*moe_kernel_fn)(struct cuda_moe_args);

/* The gate|up kernel for kind code st (CUDA_MOE_STREAM_*; 0: any kind, GU_ALL only) at T tokens */
template <int MODE> static moe_kernel_fn gate_up_kernel(int st, int T)
{
    switch (st) {
    case CUDA_MOE_STREAM_INT4:
        return T == 1 ? gate_up_small_kernel<1, MK_Q4, MODE> : gate_up_small_kernel<4, MK_Q4, MODE>;
    case CUDA_MOE_STREAM_INT8:
        return T == 1 ? gate_up_small_kernel<1, MK_Q8, MODE> : gate_up_small_kernel<4, MK_Q8, MODE>;
    case CUDA_MOE_STREAM_BF16:
        return T == 1 ? gate_up_small_kernel<1, MK_BF16, MODE> : gate_up_small_kernel<4, MK_BF16, MODE>;
    default: break;
    }
    if constexpr (MODE == GU_ALL) return T == 1 ? gate_up_small_kernel<1, -1, MODE> : gate_up_small_kernel<4, -1, MODE>;
    return nullptr;
}

extern "C" cudaError_t cuda_moe_gate_up_small(const struct cuda_moe_args *a, cudaStream_t st)
{
    if (a->T <= 0) return cudaSuccess;
    if (!cuda_moe_small(a)) return cudaErrorInvalidValue;
    /* an expert holds at most T assignments (a token picks it once) */
    const int routed = a->T * a->K < a->NE ? a->T * a->K : a->NE;
    const unsigned rb = (unsigned)((a->Fmax + GS_WARPS * GS_RW - 1) / GS_WARPS / GS_RW);
    const int mode = small_mode(a);
    if (mode != SMALL_MIXED) {
        const dim3 g((unsigned)(routed + (a->S > a->K)), rb);
        return pdl_launch(gate_up_kernel<GU_ALL>(mode == SMALL_ONE ? a->streamed : 0, a->T), g, dim3(GS_WARPS * 32),
                          0, st, *a);
    }
    /* the routed slots, then the shared experts' (in every token's slot K), each kernel of its kind */
    cudaError_t e = pdl_launch(gate_up_kernel<GU_ROUTED>(a->streamed, a->T), dim3((unsigned)routed, rb),
                               dim3(GS_WARPS * 32), 0, st, *a);
    if (e != cudaSuccess) return e;
    return pdl_launch(gate_up_kernel<GU_SHARED>(a->streamed_shared, a->T), dim3(1, rb), dim3(GS_WARPS * 32), 0, st,
                      *a);
}

#define DC_ROWS 8   /* output rows a block of the fused down + combine kernel */
#define DC_WARPS 16 /* its most warps: a slot each (more slots: in turn) */

/* Down rows [row0, row0 + DC_ROWS) of W (E x F) against one h row, R at a
 * time (small_shape), each sum into ys[row - row0] (the bits
 * expert_kernel<false> stores in y); the first pass's weights requested
 * before pdl_wait (WAIT 2: then pdl_trigger, dot_pass's). */
template <int KIND, bool LEAN, int WAIT = 1>
static __device__ __forceinline__ void dc_rows(const cuda_moe_mat &W, int E, int F, int row0, const uint16_t *h,
                                               bool xvec, float *ys)
{
    /* LEAN (the kernel that decodes every kind): half the rows a pass, or its 128 registers spill */
    constexpr int R0 = small_shape<KIND, 1>::R, R = LEAN && R0 > 1 ? R0 / 2 : R0, UU = small_shape<KIND, 1>::U;
    static_assert(DC_ROWS % R == 0, "a tile in whole passes");
    const int lane = threadIdx.x & 31;
    const uint16_t *const xr[1] = {h};
#pragma unroll
    for (int rr = 0; rr < DC_ROWS; rr += R) {
        const int r0 = row0 + rr;
        if (r0 >= E) break;
        float acc[1][R][1];
        dot_pass<KIND, 1, R, 1, UU, WAIT, !LEAN>(W, W, r0, E, F, xr, xvec, acc);
#pragma unroll
        for (int r = 0; r < R; r++) {
            const float v = warp_sum(acc[0][r][0]);
            if (lane == r) ys[rr + r] = v;
        }
    }
}

/* Small steps: down and the weighted sum in one kernel. Block (t, row
 * tile): warp j takes token t's slot j (and j + DC_WARPS, ...), its
 * expert's down rows of the tile against the slot's h (dc_rows); the
 * products meet in shared memory and thread i sums row i's over the slots
 * in order as combine_kernel does. Tokens are the grid's fast dimension,
 * so an expert two tokens share is read from L2 the second time. KIND as
 * gate_up_small_kernel's (the routed experts' for SHY). SHY (SMALL_MIXED):
 * the warps take the routed slots only; the shared slot's down product is
 * down_shared_kernel's, in y where the general path has it, and comes
 * last in the sum, as slot K does in combine_kernel's. */
template <int KIND, bool SHY>
static __global__ void __launch_bounds__(DC_WARPS * 32) down_combine_kernel(struct cuda_moe_args a)
{
    __shared__ float ys[32][DC_ROWS];
    const int t = blockIdx.x, row0 = blockIdx.y * DC_ROWS, ns = SHY ? a.K : a.S;
    const bool xvec = (a.Fmax & 7) == 0;
    for (int j = threadIdx.x >> 5; j < ns; j += blockDim.x >> 5) {
        /* the routing's idx and the expert table are read before the wait (the kernels before this one let
         * it start only once the routing was done); through L2, as this SM's L1 may have seen none of it */
        const int as = t * a.S + j, e = __ldcg(a.idx + as);
        const int F = a.ex[e].F;
        const cuda_moe_mat W = a.ex[e].down;
        const uint16_t *h = a.h + (size_t)as * a.Fmax;
        if constexpr (KIND >= 0) {
            dc_rows<KIND, false>(W, a.E, F, row0, h, xvec, ys[j]);
        } else {
            switch (mat_kind(W, F)) {
            case MK_Q4: dc_rows<MK_Q4, true>(W, a.E, F, row0, h, xvec, ys[j]); break;
            case MK_Q8: dc_rows<MK_Q8, true>(W, a.E, F, row0, h, xvec, ys[j]); break;
            case MK_BF16: dc_rows<MK_BF16, true>(W, a.E, F, row0, h, xvec, ys[j]); break;
            default: dc_rows<MK_SLOW, true>(W, a.E, F, row0, h, xvec, ys[j]); break;
            }
        }
    }
    pdl_wait(); /* every thread, whatever it took above */
    __syncthreads();
    const int i = threadIdx.x;
    if (i >= DC_ROWS || row0 + i >= a.E) return;
    const float *w = a.wt + (size_t)t * a.S;
    float o = __fmul_rn(w[0], ys[0][i]);
    for (int s = 1; s < ns; s++) o = __fadd_rn(o, __fmul_rn(w[s], ys[s][i]));
    if (SHY) o = __fadd_rn(o, __fmul_rn(w[a.K], __ldcg(a.y + ((size_t)t * a.S + a.K) * a.E + row0 + i)));
    const size_t oi = (size_t)t * a.E + row0 + i;
    if (a.outf) a.outf[oi] = o;
    else if (a.resid) a.resid[oi] = a.resid[oi] + bf2f(f2bf(o)); /* cuda_add_rmsnorm's add of out */
    else a.out[oi] = f2bf(o);
}

#define DS_WARPS 4 /* warps (DC_ROWS-row tiles) a block of the shared experts' down kernel */

/* SMALL_MIXED: the shared experts' down rows for every token, into y of
 * its slot K (f32, the bits expert_kernel<false> stores there), for
 * down_combine_kernel<KIND, true> to add. Block (t, DS_WARPS row tiles),
 * a warp a tile (dc_rows: the first pass's weights requested before the
 * wait, which waits for the shared gate|up; then the combine may start:
 * the routing, which it reads before its own wait, is done by then). */
template <int KIND>
static __global__ void __launch_bounds__(DS_WARPS * 32) down_shared_kernel(struct cuda_moe_args a)
{
    const int t = blockIdx.x, row0 = (blockIdx.y * DS_WARPS + (threadIdx.x >> 5)) * DC_ROWS;
    const int F = a.ex[a.NE].F;
    if (row0 >= a.E || F <= 0) {
        pdl_wait_then(true);
        return;
    }
    const size_t as = (size_t)t * a.S + a.K;
    dc_rows<KIND, false, 2>(a.ex[a.NE].down, a.E, F, row0, a.h + as * a.Fmax, (a.Fmax & 7) == 0,
                            a.y + as * a.E + row0);
}

/* The down + combine kernel for kind code st (as gate_up_kernel's; SHY: SMALL_MIXED's routed one) */
template <bool SHY> static moe_kernel_fn down_combine_fn(int st)
{
    switch (st) {
    case CUDA_MOE_STREAM_INT4: return down_combine_kernel<MK_Q4, SHY>;
    case CUDA_MOE_STREAM_INT8: return down_combine_kernel<MK_Q8, SHY>;
    case CUDA_MOE_STREAM_BF16: return down_combine_kernel<MK_BF16, SHY>;
    default: break;
    }
    if constexpr (!SHY) return down_combine_kernel<-1, false>;
    return nullptr;
}

static moe_kernel_fn down_shared_fn(int st)
{
    return st == CUDA_MOE_STREAM_INT4   ? down_shared_kernel<MK_Q4>
           : st == CUDA_MOE_STREAM_INT8 ? down_shared_kernel<MK_Q8>
           : st == CUDA_MOE_STREAM_BF16 ? down_shared_kernel<MK_BF16>
                                        : nullptr;
}

extern "C" cudaError_t cuda_moe_down_combine(const struct cuda_moe_args *a, cudaStream_t st)
{
    if (a->T <= 0) return cudaSuccess;
    if (!cuda_moe_small(a) || (a->resid && !cuda_moe_fuses(a))) return cudaErrorInvalidValue;
    const dim3 g((unsigned)a->T, (unsigned)((a->E + DC_ROWS - 1) / DC_ROWS));
    const int mode = small_mode(a);
    if (mode != SMALL_MIXED) {
        const dim3 b(32 * (a->S < DC_WARPS ? a->S : DC_WARPS));
        return pdl_launch(down_combine_fn<false>(mode == SMALL_ONE ? a->streamed : 0), g, b, 0, st, *a);
    }
    /* the shared experts' products first (their own kind's kernel), then the routed slots' and the sum */
    const dim3 gs((unsigned)a->T, (unsigned)((a->E + DS_WARPS * DC_ROWS - 1) / (DS_WARPS * DC_ROWS)));
    cudaError_t e = pdl_launch(down_shared_fn(a->streamed_shared), gs, dim3(DS_WARPS * 32), 0, st, *a);
    if (e != cudaSuccess) return e;
    const dim3 b(32 * (a->K < DC_WARPS ? a->K : DC_WARPS));
    return pdl_launch(down_combine_fn<true>(a->streamed), g, b, 0, st, *a);
}

/* out[t] = sum over t's slots in order of wt y (the CPU's order and
 * roundings: a product, then a sum), rounded to bf16 (or into outf as f32) */
static __global__ void combine_kernel(const float *y, const float *wt, int S, int E, uint16_t *out, float *outf)
{
    const int t = blockIdx.x;
    const float *w = wt + (size_t)t * S, *yt = y + (size_t)t * S * E;
    for (int i = threadIdx.x; i < E; i += blockDim.x) {
        float o = __fmul_rn(w[0], yt[i]);
        for (int j = 1; j < S; j++) o = __fadd_rn(o, __fmul_rn(w[j], yt[(size_t)j * E + i]));
        if (outf) outf[(size_t)t * E + i] = o;
        else out[(size_t)t * E + i] = f2bf(o);
    }
}

extern "C" cudaError_t cuda_moe_combine(const struct cuda_moe_args *a, cudaStream_t st)
{
    if (a->T <= 0) return cudaSuccess;
    combine_kernel<<<a->T, MOE_THREADS, 0, st>>>(a->y, a->wt, a->S, a->E, a->out, a->outf);
    return cudaGetLastError();
}

extern "C" cudaError_t cuda_moe_forward(const struct cuda_moe_args *a, cudaStream_t st)
{
    cudaError_t e;
    if ((a->xf || a->resid) && !cuda_moe_fuses(a)) return cudaErrorInvalidValue;
    if (cuda_moe_small(a)) {
        if ((e = cuda_moe_route_group(a, st)) != cudaSuccess || (e = cuda_moe_gate_up_small(a, st)) != cudaSuccess)
            return e;
        return cuda_moe_down_combine(a, st);
    }
    if ((e = cuda_moe_route(a, st)) != cudaSuccess || (e = cuda_moe_group(a, st)) != cudaSuccess ||
        (e = cuda_moe_experts(a, st)) != cudaSuccess)
        return e;
    return cuda_moe_combine(a, st);
}

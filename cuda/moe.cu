/* moe.cu - the MoE FFN's kernels (moe.h): router logits and routing,
 * grouping tokens by expert (a counting sort), the experts' gate|up with
 * SwiGLU and down over each expert's gathered rows, and the weighted sum.
 *
 * The expert kernels are SIMT and GEMV-shaped (expert_kernel): a warp takes
 * a few weight rows of one active expert and streams them once per group of
 * up to 8 of the expert's tokens, so a decode step reads each chosen
 * expert's weights about once, and only theirs. A weight is read as bf16, or
 * dequantized from the packed layout exactly as qgemm.cu does ((code - zero)
 * * scale, exact in f32, rounded once to the scale's dtype). Each (row,
 * token) output is one fixed sequence of f32 operations over the columns,
 * so its bits do not depend on the other tokens of the step: a token's
 * result is the same alone or in a batch. No tensor cores yet: long prefill
 * steps re-read an expert's weights (from L2) once per 8 of its tokens and
 * are compute bound on the SIMT cores.
 */
#include <math.h>

#include "cuda/bf16.cuh"
#include "cuda/moe.h"

#define MOE_THREADS 256

/* ---- routing ------------------------------------------------------------------------ */

/* logits[t][e] = x[t] . router[e] for e < R: one warp a row, lane l
 * summing the 8-column chunks l, l + 32, ... in order (16-byte loads where
 * E % 8 == 0), then the xor butterfly (a fixed order). */
template <bool F32>
static __global__ void logits_kernel(const uint16_t *x, const void *router, int T, int E, int R, int ld,
                                     float *logits)
{
    const int t = blockIdx.x, warp = threadIdx.x >> 5, lane = threadIdx.x & 31;
    const int e = blockIdx.y * (MOE_THREADS / 32) + warp;
    if (t >= T || e >= R) return;
    const uint16_t *xr = x + (size_t)t * E;
    const bool vec = (E & 7) == 0;
    float acc = 0.0f;
    for (int c = lane * 8; c < E; c += 32 * 8) {
        float xf[8], w[8];
        if (vec) {
            const uint4 v = *(const uint4 *)(xr + c);
            const uint32_t p[4] = {v.x, v.y, v.z, v.w};
#pragma unroll
            for (int j = 0; j < 4; j++) xf[2 * j] = __uint_as_float(p[j] << 16), xf[2 * j + 1] = __uint_as_float(p[j] & 0xffff0000u);
        } else {
#pragma unroll
            for (int j = 0; j < 8; j++) xf[j] = c + j < E ? bf2f(xr[c + j]) : 0.0f;
        }
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
#pragma unroll
        for (int j = 0; j < 8; j++) acc = fmaf(w[j], xf[j], acc);
    }
    acc = warp_sum(acc);
    if (lane == 0) logits[(size_t)t * ld + e] = acc;
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

/* Bytes of one warp's routing scratch: s, choice [NE], group scores [G],
 * the chosen [K] (ints), then the mask [NE] and group flags [G] (bytes). */
static size_t route_smem(int NE, int G, int K)
{
    size_t b = (size_t)(2 * NE + G + K) * 4 + (size_t)NE + (size_t)G;
    return (b + 15) & ~(size_t)15;
}

/* One warp a token: model_moe_route over its logits, into idx/wt [T][S]. */
static __global__ void route_kernel(struct cuda_moe_args a, size_t per_warp)
{
    extern __shared__ __align__(16) unsigned char smem[];
    const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31;
    const int t = blockIdx.x * (blockDim.x >> 5) + warp;
    if (t >= a.T) return;
    const int NE = a.NE, K = a.K, G = a.n_group;
    unsigned char *base = smem + (size_t)warp * per_warp;
    float *s = (float *)base, *choice = s + NE, *gs = choice + NE;
    int *sel = (int *)(gs + G);
    unsigned char *mask = (unsigned char *)(sel + K), *gtaken = mask + NE;
    const float *lg = a.logits + (size_t)t * (NE + 1);
    const float *v; /* what the experts are chosen by */
    if (!a.sigmoid) {
        float mx = -INFINITY;
        for (int i = lane; i < NE; i += 32) mx = fmaxf(mx, lg[i]);
        mx = warp_max(mx);
        float sum = 0.0f;
        for (int i = lane; i < NE; i += 32) {
            s[i] = expf(lg[i] - mx);
            sum += s[i];
        }
        sum = warp_sum(sum);
        for (int i = lane; i < NE; i += 32) s[i] /= sum, mask[i] = 1;
        v = s;
    } else {
        for (int i = lane; i < NE; i += 32) {
            s[i] = 1.0f / (1.0f + expf(-lg[i]));
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
    for (int j = 0; j < K; j++) {
        int b = warp_best(v, mask, NE);
        __syncwarp();
        if (lane == 0) sel[j] = b < 0 ? 0 : b, mask[b < 0 ? 0 : b] = 0; /* none left: the config refuses it */
        __syncwarp();
    }
    if (lane) return;
    /* ascending expert order: the order every backend sums them in */
    for (int i = 1; i < K; i++)
        for (int j = i; j > 0 && sel[j - 1] > sel[j]; j--) {
            int x = sel[j];
            sel[j] = sel[j - 1], sel[j - 1] = x;
        }
    int32_t *idx = a.idx + (size_t)t * a.S;
    float *wt = a.wt + (size_t)t * a.S, sum = 0.0f;
    for (int j = 0; j < K; j++) {
        idx[j] = sel[j];
        wt[j] = s[sel[j]];
        sum += wt[j];
    }
    if (a.norm_topk) {
        /* transformers adds 1e-20 to the sigmoid router's denominator only */
        float den = a.sigmoid ? sum + 1e-20f : sum;
        for (int j = 0; j < K; j++) wt[j] /= den;
    }
    if (a.sigmoid)
        for (int j = 0; j < K; j++) wt[j] *= a.scale;
    if (a.S > K) {
        idx[K] = NE;
        wt[K] = a.shared_gated ? 1.0f / (1.0f + expf(-lg[NE])) : 1.0f;
    }
}

extern "C" cudaError_t cuda_moe_route(const struct cuda_moe_args *a, cudaStream_t st)
{
    if (a->T <= 0) return cudaSuccess;
    if (a->NE < 1 || a->NE > CUDA_MOE_MAX_EXPERTS || a->K < 1 || a->K > a->NE || a->n_group < 1 ||
        a->NE % a->n_group || a->topk_group < 1 || a->topk_group > a->n_group || a->S < a->K || a->S > a->K + 1)
        return cudaErrorInvalidValue;
    const int R = a->NE + (a->shared_gated ? 1 : 0);
    dim3 lg((unsigned)a->T, (unsigned)((R + MOE_THREADS / 32 - 1) / (MOE_THREADS / 32)));
    if (a->router_f32)
        logits_kernel<true><<<lg, MOE_THREADS, 0, st>>>(a->xn, a->router, a->T, a->E, R, a->NE + 1, a->logits);
    else
        logits_kernel<false><<<lg, MOE_THREADS, 0, st>>>(a->xn, a->router, a->T, a->E, R, a->NE + 1, a->logits);
    cudaError_t e = cudaGetLastError();
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
    return cudaGetLastError();
}

/* ---- the experts -------------------------------------------------------------------- */

/* Weight (r, c) of m, a matrix of `cols` columns, as f32: bf16, or the
 * packed code at c's position dequantized as qgemm.cu does. */
static __device__ __forceinline__ float weight(const cuda_moe_mat &m, int r, int c, int cols)
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

static __device__ __forceinline__ float swiglu_f(float g, float u, float limit)
{
    if (limit > 0.0f) {
        g = fminf(g, limit);
        u = fminf(fmaxf(u, -limit), limit);
    }
    return g / (1.0f + expf(-g)) * u;
}

/* The 8 weights of row r, columns [8 ch, 8 ch + 8) of m (a matrix of `cols`
 * columns) as f32, zeros past the row: one 16-byte load (bf16, cols % 8 ==
 * 0) or one word of codes (packed; a chunk is inside one group, as groups
 * are multiples of 8 columns), else element by element. */
static __device__ __forceinline__ void weights8(const cuda_moe_mat &m, int r, int ch, int cols, float *w)
{
    const int c = ch * 8;
    if (m.w) {
        const uint16_t *row = m.w + (size_t)r * cols;
        if ((cols & 7) == 0) {
            const uint4 v = __ldg((const uint4 *)(row + c));
            const uint32_t p[4] = {v.x, v.y, v.z, v.w};
#pragma unroll
            for (int j = 0; j < 4; j++) w[2 * j] = __uint_as_float(p[j] << 16), w[2 * j + 1] = __uint_as_float(p[j] & 0xffff0000u);
        } else {
#pragma unroll
            for (int j = 0; j < 8; j++) w[j] = c + j < cols ? bf2f(row[c + j]) : 0.0f;
        }
        return;
    }
    if (m.iperm || c + 8 > cols) {
#pragma unroll
        for (int j = 0; j < 8; j++) w[j] = c + j < cols ? weight(m, r, c + j, cols) : 0.0f;
        return;
    }
    const uint8_t *row = m.qw + (size_t)r * m.row_bytes;
    const size_t gi = (size_t)r * m.n_groups + (m.n_groups > 1 ? c / m.group : 0);
    const int z = m.zeros ? (int)m.zeros[gi] : 1 << (m.bits - 1);
    const uint16_t sr = m.scales[gi];
    const float sc = m.f16 ? __half2float(__ushort_as_half(sr)) : bf2f(sr);
    uint32_t lo, hi = 0;
    if (m.bits == 4) {
        lo = __ldg((const uint32_t *)(row + c / 2));
    } else {
        const uint2 v = __ldg((const uint2 *)(row + c));
        lo = v.x, hi = v.y;
    }
#pragma unroll
    for (int j = 0; j < 8; j++) {
        /* int4: column j in nibble j / 2 + 4 (j % 2) (the layout's order, model.h) */
        const uint32_t u = m.bits == 4 ? (lo >> (4 * ((j >> 1) + 4 * (j & 1)))) & 0xFu
                                       : ((j < 4 ? lo : hi) >> (8 * (j & 3))) & 0xFFu;
        const float x = (float)((int)u - z) * sc; /* exact in f32 */
        w[j] = m.f16 ? __half2float(__float2half_rn(x)) : bf2f(f2bf(x));
    }
}

/* 8 activations of a bf16 row, columns [c, c + 8), zeros past cols */
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

#define NW 4 /* warps a block of the expert kernels */

/* GU: h[a] = SwiGLU(gate x, up x) for the expert's assignments a (x the
 * token's row of xn); else y[a] = down h[a]. Grid: (expert slot, row block,
 * token group); a warp takes R rows (gate and up rows with GU) and the
 * expert's tokens TT at a time. Lane l sums the 8-column chunks l, l + 32,
 * ... of a row in order, then the lanes combine by the xor butterfly: every
 * (row, token) output is that one sequence of operations whatever TT, the
 * token's place among its expert's tokens or the grid (batch invariance).
 * The weights stream in 16-byte chunks a lane (or a word of codes), read
 * once per TT tokens. */
template <bool GU, int R, int TT>
static __global__ void __launch_bounds__(NW * 32) expert_kernel(struct cuda_moe_args a)
{
    const int n_act = a.act[a.NE + 1];
    if ((int)blockIdx.x >= n_act) return;
    const int e = a.act[blockIdx.x];
    const int F = a.ex[e].F, rows = GU ? F : a.E, cols = GU ? a.E : F;
    const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
    const int r0 = (blockIdx.y * NW + warp) * R;
    if (r0 >= rows || cols <= 0) return; /* the whole warp; no block-wide barrier below */
    const int base = a.start[e], cnt = a.start[e + 1] - base;
    const cuda_moe_mat W = GU ? a.ex[e].gate : a.ex[e].down, U = a.ex[e].up;
    const int ld = GU ? a.E : a.Fmax; /* the input rows' stride */
    const bool vec = (ld & 7) == 0;
    const uint16_t *src = GU ? a.xn : a.h;
    const int nch = (cols + 7) / 8;
    for (int c0 = blockIdx.z * TT; c0 < cnt; c0 += gridDim.z * TT) {
        int as[TT];
        const uint16_t *xr[TT];
#pragma unroll
        for (int m = 0; m < TT; m++) {
            as[m] = c0 + m < cnt ? a.list[base + c0 + m] : -1;
            xr[m] = as[m] >= 0 ? src + (size_t)(GU ? as[m] / a.S : as[m]) * ld : NULL;
        }
        float acc[R][TT], accu[GU ? R : 1][TT];
#pragma unroll
        for (int r = 0; r < R; r++)
#pragma unroll
            for (int m = 0; m < TT; m++) acc[r][m] = 0.0f, accu[GU ? r : 0][m] = 0.0f;
        for (int ch = lane; ch < nch; ch += 32) {
            float xf[TT][8];
#pragma unroll
            for (int m = 0; m < TT; m++) {
                if (xr[m]) {
                    act8(xr[m], ch * 8, cols, vec, xf[m]);
                } else {
#pragma unroll
                    for (int j = 0; j < 8; j++) xf[m][j] = 0.0f;
                }
            }
#pragma unroll
            for (int r = 0; r < R; r++) {
                if (r0 + r >= rows) continue;
                float w[8];
                weights8(W, r0 + r, ch, cols, w);
#pragma unroll
                for (int m = 0; m < TT; m++)
#pragma unroll
                    for (int j = 0; j < 8; j++) acc[r][m] = fmaf(w[j], xf[m][j], acc[r][m]);
                if (GU) {
                    weights8(U, r0 + r, ch, cols, w);
#pragma unroll
                    for (int m = 0; m < TT; m++)
#pragma unroll
                        for (int j = 0; j < 8; j++) accu[GU ? r : 0][m] = fmaf(w[j], xf[m][j], accu[GU ? r : 0][m]);
                }
            }
        }
#pragma unroll
        for (int r = 0; r < R; r++)
#pragma unroll
            for (int m = 0; m < TT; m++) {
                const float g = warp_sum(acc[r][m]), u = GU ? warp_sum(accu[GU ? r : 0][m]) : 0.0f;
                if (lane != (r * TT + m) % 32 || r0 + r >= rows || as[m] < 0) continue;
                if (GU) a.h[(size_t)as[m] * a.Fmax + r0 + r] = f2bf(swiglu_f(g, u, a.swiglu_limit));
                else a.y[(size_t)as[m] * a.E + r0 + r] = g;
            }
    }
}

/* Both expert launches with TT tokens a group. */
template <int TT>
static cudaError_t launch_experts(const struct cuda_moe_args *a, int slots, cudaStream_t st)
{
    constexpr int RG = 2, RD = 4; /* rows a warp: gate|up (2 + 2 matrices' rows), down */
    int groups = (a->T + TT - 1) / TT;
    if (groups > 16) groups = 16;
    dim3 g1((unsigned)slots, (unsigned)((a->Fmax + NW * RG - 1) / (NW * RG)), (unsigned)groups);
    expert_kernel<true, RG, TT><<<g1, NW * 32, 0, st>>>(*a);
    dim3 g2((unsigned)slots, (unsigned)((a->E + NW * RD - 1) / (NW * RD)), (unsigned)groups);
    expert_kernel<false, RD, TT><<<g2, NW * 32, 0, st>>>(*a);
    return cudaGetLastError();
}

extern "C" cudaError_t cuda_moe_experts(const struct cuda_moe_args *a, cudaStream_t st)
{
    if (a->T <= 0) return cudaSuccess;
    if (cuda_moe_gemm_takes(a)) return cuda_moe_gemm(a, st); /* many rows per expert: tensor cores (moe_gemm.cu) */
    /* an expert holds at most T assignments (a token picks it once) */
    int slots = a->T * a->K < a->NE ? a->T * a->K : a->NE;
    slots += a->S > a->K;
    /* tokens a group: any choice gives the same bits (see expert_kernel); fewer
     * waste less on steps of few tokens */
    if (a->T == 1) return launch_experts<1>(a, slots, st);
    if (a->T <= 2) return launch_experts<2>(a, slots, st);
    if (a->T <= 4) return launch_experts<4>(a, slots, st);
    return launch_experts<8>(a, slots, st);
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
    if ((e = cuda_moe_route(a, st)) != cudaSuccess || (e = cuda_moe_group(a, st)) != cudaSuccess ||
        (e = cuda_moe_experts(a, st)) != cudaSuccess)
        return e;
    return cuda_moe_combine(a, st);
}

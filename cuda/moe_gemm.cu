/* moe_gemm.cu - the MoE experts as a grouped GEMM on tensor cores (moe.h),
 * for steps with many rows per active expert (prefill, big decode batches).
 * cuda_moe_experts takes it when cuda_moe_gemm_takes says so; the contract
 * is expert_kernel's (moe.cu): gate|up with the (clamped) SwiGLU into h
 * (bf16), down into y (f32), over the grouping cuda_moe_group made.
 *
 * One launch for gate|up, one for down. A block computes a BM-row tile of
 * one expert's gathered assignments (rows: a.list[start[e] ..]) against
 * 128 weight rows (64 gate + the same 64 up rows, or 128 down rows), k in
 * 32-column steps through a 3- or 4-stage cp.async pipeline in dynamic shared
 * memory: the activations (gathered by token for gate|up, by assignment for
 * down), bf16 weights, and for packed weights (int4/int8, qgemm.h's layout)
 * their codes and the words holding their scales and zeros, so no global
 * load waits on the ALU; a packed stage is dequantized from shared memory
 * into the stage's bf16 B tile (qgemm.cu's formula, as moe.cu's weight()) before
 * the warps' mma.sync m16n8k16 bf16 -> f32, fed by ldmatrix (rows padded
 * to 80 bytes: no bank conflicts). BM follows the step's rows per expert
 * (gemm_bm: 16, 32, 64 or 128, the last with 8 warps), so small steps do
 * not pay MMAs on padding and big ones reuse each weight tile more; at
 * most 86 KB of shared memory a block (sm_89 has 99 KB).
 *
 * The grid depends on T and the shapes only (CUDA graphs): x every row
 * tile the step could have (ceil(T S / BM) plus one per possible active
 * expert), y the weight-row tiles; each block finds its (expert, row tile)
 * from the prefix sums over a.act and leaves when past the end, or past
 * its expert's F.
 *
 * The same kernel computes the router's logits (GM_ROUTER: rows are
 * tokens, B the bf16 router, f32 out): cuda_moe_router_gemm.
 *
 * Numerics: each output element is its k tiles in ascending order, each an
 * MMA chain over 16 columns into one f32 accumulator: a fixed sequence for
 * the element whatever the other rows of its tile, so the path is batch
 * invariant (no split-K, no atomics), and BM does not change its bits. It sums in another order than the
 * GEMV path, so the two differ in the last bits (and in bf16 roundings of h
 * that follow); the path is chosen from the step's shape. f16-scaled packed
 * weights are rounded once more, to bf16, in the tiles (as qgemm.cu's
 * dequantizing path does). Odd widths (cols % 8 != 0) and act-order
 * weights load element by element.
 */
#include <math.h>

#include "cuda/bf16.cuh"
#include "cuda/moe.h"
#include "cuda/tuning.h"

#define GM_BN 128               /* weight rows a block */
#define GM_BK 32                /* columns a k step */
#define GM_LDS (GM_BK + 8)      /* shared row stride (elements): 80 bytes, so ldmatrix has no bank conflicts */
/* k steps in the pipeline (one computed, the others loading): 4 for the
 * short tiles of small steps, which are bound by the weights' latency and
 * bandwidth; 3 for 64 and 128 rows, whose MMAs hide more of it (and 4
 * stages of 128 rows would pass sm_89's 99 KB) */
#define GM_STAGES(bm) ((bm) <= 32 ? 4 : 3)
#define GM_QB 32                /* bytes of codes a weight row a k step (int8: 32 columns; int4 uses 16) */

enum { GM_GU, GM_DOWN, GM_ROUTER }; /* what a launch computes */

/* Shared memory of one stage: A [BM][LDS] and B [BN][LDS] bf16, then (not
 * for the router) the packed rows' codes [BN][QB], their scale and zero
 * words [BN][4] (one a row, or one per 8-column chunk where groups are
 * narrower than a k step), and where in each word its value lies [BN][4]
 * (bytes: the scale's half, then the zero's byte, shifted by 1). */
static constexpr __host__ __device__ int gm_stage_bytes(int bm, bool packed)
{
    return (bm + GM_BN) * GM_LDS * 2 + (packed ? GM_BN * GM_QB + 2 * GM_BN * 4 * 4 + GM_BN * 4 : 0);
}

static __device__ __forceinline__ uint32_t smem_u32(const void *p)
{
    return (uint32_t)__cvta_generic_to_shared(p);
}

static __device__ __forceinline__ void cp_async16(void *dst, const void *src)
{
    asm volatile("cp.async.cg.shared.global [%0], [%1], 16;\n" ::"r"(smem_u32(dst)), "l"(src) : "memory");
}

static __device__ __forceinline__ void cp_async_commit(void)
{
    asm volatile("cp.async.commit_group;\n" ::: "memory");
}

static __device__ __forceinline__ void cp_async_wait_all(void)
{
    asm volatile("cp.async.wait_all;\n" ::: "memory");
}

/* the 4-byte word holding p's 2-byte scale or 1-byte zero: the packed
 * sections are 256-byte aligned and padded (moe_layer.c), so the word lies
 * inside them; the reader picks its half or byte */
static __device__ __forceinline__ void cp_async4_word(void *dst, const void *p)
{
    const void *w = (const void *)((uintptr_t)p & ~(uintptr_t)3);
    asm volatile("cp.async.ca.shared.global [%0], [%1], 4;\n" ::"r"(smem_u32(dst)), "l"(w) : "memory");
}

/* until at most n of this thread's latest commit groups are in flight */
template <int n>
static __device__ __forceinline__ void cp_async_wait(void)
{
    asm volatile("cp.async.wait_group %0;\n" ::"n"(n) : "memory");
}

static __device__ __forceinline__ void ldsm_x4(uint32_t &r0, uint32_t &r1, uint32_t &r2, uint32_t &r3, const void *p)
{
    asm volatile("ldmatrix.sync.aligned.m8n8.x4.shared.b16 {%0, %1, %2, %3}, [%4];\n"
                 : "=r"(r0), "=r"(r1), "=r"(r2), "=r"(r3)
                 : "r"(smem_u32(p))
                 : "memory");
}

/* c += a b: a 16 x 16 (row), b 16 x 8 (col), bf16, f32 accumulators */
static __device__ __forceinline__ void mma_bf16(float *c, const uint32_t *a, uint32_t b0, uint32_t b1)
{
    asm volatile("mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32 {%0, %1, %2, %3}, {%4, %5, %6, %7}, "
                 "{%8, %9}, {%0, %1, %2, %3};\n"
                 : "+f"(c[0]), "+f"(c[1]), "+f"(c[2]), "+f"(c[3])
                 : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b0), "r"(b1));
}

/* (code - zero) * scale, exact in f32, rounded to the scale's dtype: moe.cu's
 * weight() and qgemm.cu */
static __device__ __forceinline__ float gm_deq(int u, int z, float sc, int f16)
{
    const float x = (float)(u - z) * sc;
    return f16 ? __half2float(__float2half_rn(x)) : bf2f(f2bf(x));
}

/* Weight (r, c) of m (`cols` columns) as f32, element by element (moe.cu's
 * weight(): odd widths and act-order) */
static __device__ float gm_weight(const cuda_moe_mat &m, int r, int c, int cols)
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
    return gm_deq((int)u, z, sc, m.f16);
}

/* moe.cu's swiglu_f */
static __device__ __forceinline__ float gm_swiglu(float g, float u, float limit)
{
    if (limit > 0.0f) {
        g = fminf(g, limit);
        u = fminf(fmaxf(u, -limit), limit);
    }
    return g / (1.0f + expf(-g)) * u;
}

static __device__ __forceinline__ uint4 pack8(const float *w)
{
    uint4 v;
    v.x = (uint32_t)f2bf(w[0]) | (uint32_t)f2bf(w[1]) << 16;
    v.y = (uint32_t)f2bf(w[2]) | (uint32_t)f2bf(w[3]) << 16;
    v.z = (uint32_t)f2bf(w[4]) | (uint32_t)f2bf(w[5]) << 16;
    v.w = (uint32_t)f2bf(w[6]) | (uint32_t)f2bf(w[7]) << 16;
    return v;
}


/* two f32 as packed bf16 (round to nearest even, the first in the low half) */
static __device__ __forceinline__ uint32_t pack2(float lo, float hi)
{
    const __nv_bfloat162 b = __floats2bfloat162_rn(lo, hi);
    return *(const uint32_t *)&b;
}

/* GM_GU: h[a][n] = SwiGLU(gate x, up x) for a block of 64 gate columns n;
 * GM_DOWN: y[a][n] = down h[a] for 128 columns n; GM_ROUTER: logits[t][n]
 * = router[n] . xn[t] for 128 columns n. A block: BM rows (assignments of
 * one expert, or tokens) by 128 weight rows, WM x WN warps of (BM / WM) x
 * (128 / WN). Grid (row tiles, n tiles). */
template <int MODE, int BM, int WM, int WN>
static __global__ void __launch_bounds__(WM *WN * 32) moe_gemm_kernel(struct cuda_moe_args a)
{
    constexpr bool GU = MODE == GM_GU, RT = MODE == GM_ROUTER;
    constexpr int THREADS = WM * WN * 32, MI = BM / (16 * WM), NJ = GM_BN / (8 * WN);
    static_assert(MI >= 1 && MI * 16 * WM == BM && NJ * 8 * WN == GM_BN && NJ % 4 == 0, "tile shape");
    /* the stage's size: room for codes where the layer has packed experts */
    const int SB = gm_stage_bytes(BM, !RT && a.packed);
    extern __shared__ __align__(16) unsigned char gsm[];
    __shared__ cuda_moe_mat smat[2]; /* gate (or down), up */
    __shared__ int rowid[BM];        /* the tile's assignments (tokens: the router), -1 past its rows */
    __shared__ int wsum[THREADS / 32];
    __shared__ int s_e, s_t0;
    const int tid = threadIdx.x, lane = tid & 31, warp = tid >> 5;
    const int tile = (int)blockIdx.x;
    int rows, cols, n0, ld;
    const uint16_t *src;
    if (RT) {
        rows = a.NE + (a.shared_gated ? 1 : 0), cols = a.E, ld = a.E, src = a.xn;
        n0 = (int)blockIdx.y * GM_BN;
        if (n0 >= rows || tile * BM >= a.T || cols <= 0) return; /* the whole block */
        for (int i = tid; i < BM; i += THREADS) rowid[i] = tile * BM + i < a.T ? tile * BM + i : -1;
    } else {
        /* which expert's row tile this is: tiles are numbered over the active
         * experts in a.act order, ceil(count / BM) each (a block scan over
         * a.act, THREADS experts a round) */
        const int n_act = a.act[a.NE + 1];
        if (tid == 0) s_e = -1;
        int running = 0;
        for (int b0 = 0; b0 < n_act; b0 += THREADS) {
            const int i = b0 + tid;
            int e = -1, c = 0;
            if (i < n_act) {
                e = a.act[i];
                c = (a.start[e + 1] - a.start[e] + BM - 1) / BM;
            }
            int x = c; /* inclusive scan within the warp */
#pragma unroll
            for (int o = 1; o < 32; o <<= 1) {
                const int y = __shfl_up_sync(0xffffffffu, x, o);
                if (lane >= o) x += y;
            }
            if (lane == 31) wsum[warp] = x;
            __syncthreads();
            int pre = 0, tot = 0;
#pragma unroll
            for (int w = 0; w < THREADS / 32; w++) {
                if (w < warp) pre += wsum[w];
                tot += wsum[w];
            }
            const int incl = running + pre + x;
            if (c > 0 && tile >= incl - c && tile < incl) s_e = e, s_t0 = incl - c;
            running += tot;
            __syncthreads(); /* wsum is reused; s_e is seen by all */
            if (running > tile) break; /* block-uniform */
        }
        __syncthreads();
        const int e = s_e;
        if (e < 0) return; /* past the step's tiles (the whole block) */
        const int F = a.ex[e].F;
        rows = GU ? F : a.E, cols = GU ? a.E : F; /* weight rows (outputs), the inner dimension */
        ld = GU ? a.E : a.Fmax, src = GU ? a.xn : a.h;
        n0 = (int)blockIdx.y * (GU ? GM_BN / 2 : GM_BN);
        if (n0 >= rows || cols <= 0) return;
        const int base = a.start[e] + (tile - s_t0) * BM, nr = min(BM, a.start[e + 1] - base);
        for (int i = tid; i < BM; i += THREADS) rowid[i] = i < nr ? a.list[base + i] : -1;
        if (tid == 0) smat[0] = GU ? a.ex[e].gate : a.ex[e].down;
        if (tid == 1 && GU) smat[1] = a.ex[e].up;
    }
    __syncthreads();

    /* B rows 0..63 are gate rows n0 .., 64..127 the same up rows (GU), or
     * rows n0 + 0..127; a packed half streams its codes (16-byte aligned
     * rows, no act order, a layer marked packed: qfast) and their scale and
     * zero words by cp.async and is dequantized from shared memory (else
     * element by element) */
    const bool avec = (ld & 7) == 0, bvec = (cols & 7) == 0;
    bool packed_any = false;
    unsigned qfast = 0, one = 3; /* bit h: half h streams its codes; its k steps lie in one group */
    if (!RT) {
#pragma unroll
        for (int h = 0; h < (GU ? 2 : 1); h++) {
            const cuda_moe_mat &m = smat[h];
            if (m.w) continue;
            packed_any = true;
            if (a.packed && !m.iperm && (m.bits == 4 || m.bits == 8) && (m.row_bytes & 15) == 0 &&
                ((uintptr_t)m.qw & 15) == 0)
                qfast |= 1u << h;
            if (!(m.n_groups == 1 || m.group % GM_BK == 0)) one &= ~(1u << h);
        }
    }
    const int nk = (cols + GM_BK - 1) / GM_BK;
    auto wrow = [&](int r) -> int { /* B row r's weight row, -1 past the matrix */
        const int w = n0 + (GU ? (r & 63) : r);
        return w < rows ? w : -1;
    };
    auto As = [&](int s) { return (uint16_t(*)[GM_LDS])(gsm + s * SB); };
    auto Bs = [&](int s) { return (uint16_t(*)[GM_LDS])(gsm + s * SB + BM * GM_LDS * 2); };
    auto Qs = [&](int s) { return (uint8_t(*)[GM_QB])(gsm + s * SB + (BM + GM_BN) * GM_LDS * 2); };
    auto Ss = [&](int s) { return (uint32_t(*)[4])(gsm + s * SB + (BM + GM_BN) * GM_LDS * 2 + GM_BN * GM_QB); };
    auto Zs = [&](int s) {
        return (uint32_t(*)[4])(gsm + s * SB + (BM + GM_BN) * GM_LDS * 2 + GM_BN * GM_QB + GM_BN * 16);
    };
    auto Ps = [&](int s) {
        return (uint8_t(*)[4])(gsm + s * SB + (BM + GM_BN) * GM_LDS * 2 + GM_BN * GM_QB + GM_BN * 32);
    };

    /* k step kt's loads into stage s: cp.async where the rows allow, the
     * rest (zeros past the matrices, odd widths) stored directly */
    auto issue = [&](int kt, int s) {
        const int k0 = kt * GM_BK;
        for (int i = tid; i < BM * 4; i += THREADS) {
            const int r = i >> 2, c = k0 + (i & 3) * 8, as = rowid[r];
            uint16_t *d = &As(s)[r][(i & 3) * 8];
            const uint16_t *ar = as >= 0 ? src + (size_t)(GU ? as / a.S : as) * ld : nullptr;
            if (ar && avec && c + 8 <= cols) {
                cp_async16(d, ar + c);
            } else {
                float v[8];
#pragma unroll
                for (int j = 0; j < 8; j++) v[j] = ar && c + j < cols ? bf2f(ar[c + j]) : 0.0f;
                *(uint4 *)d = pack8(v);
            }
        }
        for (int i = tid; i < GM_BN * 4; i += THREADS) {
            const int r = i >> 2, c = k0 + (i & 3) * 8, w = wrow(r);
            uint16_t *d = &Bs(s)[r][(i & 3) * 8];
            if (w < 0 || c >= cols) {
                *(uint4 *)d = make_uint4(0, 0, 0, 0);
                continue;
            }
            const uint16_t *wb = RT ? (const uint16_t *)a.router : smat[GU && r >= 64].w;
            if (!wb) continue; /* packed: dequant() fills it */
            const uint16_t *wr = wb + (size_t)w * cols;
            if (bvec) {
                cp_async16(d, wr + c);
            } else {
                float v[8];
#pragma unroll
                for (int j = 0; j < 8; j++) v[j] = c + j < cols ? bf2f(wr[c + j]) : 0.0f;
                *(uint4 *)d = pack8(v);
            }
        }
        if constexpr (!RT) {
            if (!packed_any) return;
            /* codes: int4 16 bytes a row (32 columns), int8 two 16-byte halves; the
             * rows are padded to 16 bytes, so a started chunk is inside the row */
            for (int i = tid; i < GM_BN * 2; i += THREADS) {
                const int r = i >> 1, hq = i & 1, w = wrow(r), hf = GU && r >= 64;
                if (w < 0 || !(qfast >> hf & 1)) continue;
                const cuda_moe_mat &m = smat[hf];
                const int off = m.bits == 4 ? (hq ? -1 : k0 / 2) : k0 + hq * 16;
                if (off < 0 || off >= m.row_bytes) continue;
                cp_async16(&Qs(s)[r][hq * 16], m.qw + (size_t)w * m.row_bytes + off);
            }
            /* the scale (and zero) words: one a row where the k step is inside one
             * group, else one per 8-column chunk */
            for (int i = tid; i < GM_BN * 4; i += THREADS) {
                const int r = i >> 2, cc = i & 3, c = k0 + cc * 8, w = wrow(r), hf = GU && r >= 64;
                if (w < 0 || !(qfast >> hf & 1) || c >= cols || (cc && (one >> hf & 1))) continue;
                const cuda_moe_mat &m = smat[hf];
                const size_t gi = (size_t)w * m.n_groups + (m.n_groups > 1 ? c / m.group : 0);
                cp_async4_word(&Ss(s)[r][cc], m.scales + gi);
                if (m.zeros) cp_async4_word(&Zs(s)[r][cc], m.zeros + gi);
                Ps(s)[r][cc] = (uint8_t)(((uintptr_t)(m.scales + gi) >> 1 & 1) |
                                         (m.zeros ? ((uintptr_t)(m.zeros + gi) & 3) << 1 : 0));
            }
        }
    };

    /* The packed rows of stage s (k step kt) into its B tile as bf16: the
     * formula of moe.cu's weight() ((code - zero) * scale, exact in f32, then
     * rounded to the scale's dtype and to bf16), the int-to-float by the
     * 2^23 trick (exact: both terms are 2^23 plus an integer under 2^8) */
    auto dequant = [&](int kt, int s) {
        const int k0 = kt * GM_BK;
        for (int i = tid; i < GM_BN * 4; i += THREADS) {
            const int r = i >> 2, cc = i & 3, c = k0 + cc * 8, w = wrow(r), hf = GU && r >= 64;
            const cuda_moe_mat &m = smat[hf];
            if (m.w || w < 0 || c >= cols) continue; /* bf16 rows and zeros: issue() did them */
            uint4 *d = (uint4 *)&Bs(s)[r][cc * 8];
            if (!(qfast >> hf & 1) || c + 8 > cols) {
                float v[8];
#pragma unroll
                for (int j = 0; j < 8; j++) v[j] = c + j < cols ? gm_weight(m, w, c + j, cols) : 0.0f;
                *d = pack8(v);
                continue;
            }
            const int sl = (one >> hf & 1) ? 0 : cc;
            const unsigned pb = Ps(s)[r][sl];
            const uint32_t sw = Ss(s)[r][sl] >> (16 * (pb & 1));
            const int z = m.zeros ? (int)((Zs(s)[r][sl] >> (8 * (pb >> 1))) & 0xFFu) : 1 << (m.bits - 1);
            const float sc = m.f16 ? __half2float(__ushort_as_half((uint16_t)sw)) : bf2f((uint16_t)sw);
            const float fz = __int_as_float(0x4B000000 + z);
            uint32_t lo, hi = 0;
            if (m.bits == 4) {
                lo = *(const uint32_t *)&Qs(s)[r][cc * 4];
            } else {
                const uint2 v = *(const uint2 *)&Qs(s)[r][cc * 8];
                lo = v.x, hi = v.y;
            }
            float x[8];
#pragma unroll
            for (int j = 0; j < 8; j++) {
                /* int4: column j in nibble j / 2 + 4 (j % 2) (the layout's order, model.h) */
                const uint32_t u = m.bits == 4 ? (lo >> (4 * ((j >> 1) + 4 * (j & 1)))) & 0xFu
                                               : ((j < 4 ? lo : hi) >> (8 * (j & 3))) & 0xFFu;
                x[j] = __fmul_rn(__fsub_rn(__int_as_float(0x4B000000 | (int)u), fz), sc);
                if (m.f16) x[j] = __half2float(__float2half_rn(x[j]));
            }
            *d = make_uint4(pack2(x[0], x[1]), pack2(x[2], x[3]), pack2(x[4], x[5]), pack2(x[6], x[7]));
        }
    };

    /* warp (wm, wn): tile rows wm MI 16 + ..; its NJ n subtiles of 8 B rows:
     * GU, gate rows wn NJ/2 8 + .. (j < NJ/2) and the same up rows (j >=
     * NJ/2, B rows 64 + ...); else B rows wn NJ 8 + .. */
    const int wm = warp / WN, wn = warp % WN;
    float acc[MI][NJ][4];
#pragma unroll
    for (int mi = 0; mi < MI; mi++)
#pragma unroll
        for (int j = 0; j < NJ; j++)
#pragma unroll
            for (int q = 0; q < 4; q++) acc[mi][j][q] = 0.0f;

    auto compute = [&](int s) {
        uint16_t(*A)[GM_LDS] = As(s);
        uint16_t(*B)[GM_LDS] = Bs(s);
#pragma unroll
        for (int kk = 0; kk < GM_BK; kk += 16) {
            uint32_t af[MI][4], bfr[NJ][2];
#pragma unroll
            for (int mi = 0; mi < MI; mi++)
                ldsm_x4(af[mi][0], af[mi][1], af[mi][2], af[mi][3],
                        &A[wm * MI * 16 + mi * 16 + (lane & 15)][kk + (lane >> 4) * 8]);
#pragma unroll
            for (int jp = 0; jp < NJ / 2; jp++) {
                const int nb = !GU ? wn * NJ * 8 + jp * 16
                               : jp < NJ / 4 ? wn * (NJ / 2) * 8 + jp * 16
                                             : 64 + wn * (NJ / 2) * 8 + (jp - NJ / 4) * 16;
                ldsm_x4(bfr[2 * jp][0], bfr[2 * jp][1], bfr[2 * jp + 1][0], bfr[2 * jp + 1][1],
                        &B[nb + (lane & 7) + ((lane >> 4) << 3)][kk + ((lane >> 3) & 1) * 8]);
            }
#pragma unroll
            for (int mi = 0; mi < MI; mi++)
#pragma unroll
                for (int j = 0; j < NJ; j++) mma_bf16(acc[mi][j], af[mi], bfr[j][0], bfr[j][1]);
        }
    };

    /* ST - 1 k steps ahead. Stage kt % ST is refilled at step
     * kt + 1, after the barrier that ends every warp's reads of it. */
    constexpr int ST = GM_STAGES(BM);
    for (int p = 0; p < ST - 1; p++) {
        if (p < nk) issue(p, p);
        cp_async_commit();
    }
    for (int kt = 0; kt < nk; kt++) {
        const int s = kt % ST;
        cp_async_wait<ST - 2>(); /* this thread's copies of step kt are in */
        __syncthreads();         /* everyone's; and step kt - 1 is computed */
        if (packed_any) {        /* block-uniform */
            dequant(kt, s);
            __syncthreads();
        }
        if (kt + ST - 1 < nk) issue(kt + ST - 1, (kt + ST - 1) % ST);
        cp_async_commit();
        compute(s);
    }
    cp_async_wait_all();

    /* accumulator q of subtile j: tile row g (q < 2) or g + 8, column 2t + (q & 1) */
    const int g = lane >> 2, t = lane & 3;
#pragma unroll
    for (int mi = 0; mi < MI; mi++)
#pragma unroll
        for (int hf = 0; hf < 2; hf++) {
            const int as = rowid[wm * MI * 16 + mi * 16 + g + 8 * hf];
            if (as < 0) continue;
            if (GU) {
                uint16_t *hr = a.h + (size_t)as * a.Fmax;
#pragma unroll
                for (int j = 0; j < NJ / 2; j++)
#pragma unroll
                    for (int q = 0; q < 2; q++) {
                        const int n = n0 + wn * (NJ / 2) * 8 + j * 8 + 2 * t + q;
                        if (n < rows)
                            hr[n] = f2bf(gm_swiglu(acc[mi][j][2 * hf + q], acc[mi][j + NJ / 2][2 * hf + q],
                                                   a.swiglu_limit));
                    }
            } else {
                float *yr = RT ? a.logits + (size_t)as * (a.NE + 1) : a.y + (size_t)as * a.E;
#pragma unroll
                for (int j = 0; j < NJ; j++)
#pragma unroll
                    for (int q = 0; q < 2; q++) {
                        const int n = n0 + wn * NJ * 8 + j * 8 + 2 * t + q;
                        if (n < rows) yr[n] = acc[mi][j][2 * hf + q];
                    }
            }
        }
}

/* One launch: dynamic shared memory for GM_STAGES(BM) stages (over the 48 KB
 * default where packed; at most 86 KB, under sm_89's 99 KB; bf16 layers
 * take less, so more blocks share an SM). The attribute is set at every
 * launch over 48 KB (no stream operation: graph capture takes it, as
 * flash-attention's launches under PyTorch's graphs do), so it holds for
 * whichever device is current. */
template <int MODE, int BM, int WM, int WN>
static cudaError_t gm_launch(const struct cuda_moe_args *a, unsigned gx, unsigned gy, cudaStream_t st)
{
    constexpr int most = GM_STAGES(BM) * gm_stage_bytes(BM, MODE != GM_ROUTER);
    static_assert(most + 1024 <= 99 * 1024, "sm_89 shared memory");
    const int smem = GM_STAGES(BM) * gm_stage_bytes(BM, MODE != GM_ROUTER && a->packed); /* as the kernel's SB */
    void (*k)(struct cuda_moe_args) = moe_gemm_kernel<MODE, BM, WM, WN>;
    if (smem > 48 * 1024) {
        cudaError_t e = cudaFuncSetAttribute((const void *)k, cudaFuncAttributeMaxDynamicSharedMemorySize, most);
        if (e != cudaSuccess) return e;
    }
    k<<<dim3(gx, gy), WM * WN * 32, smem, st>>>(*a);
    return cudaGetLastError();
}

/* The row tile for a step, from its average rows per routed expert (T K /
 * NE): tiles much taller than an expert's rows multiply the MMA work by
 * padding (at 64 rows and 2-16 rows an expert the GEMM was compute bound on
 * it: 777 us at T 64 and 764 at T 256, Qwen3-30B-A3B shape, H100), taller
 * ones reuse each B tile for more rows on big steps. Any choice gives the
 * same bits (each element is the same MMA chain), so the step's shape may
 * pick it. */
static int gemm_bm(const struct cuda_moe_args *a)
{
    const long long rk = (long long)a->T * a->K, ne = a->NE;
    return rk < 12 * ne ? 16 : rk < 48 * ne ? 32 : rk < 384 * ne ? 64 : 128;
}

/* Row tiles a step can have: sum over experts of ceil(count / bm) <=
 * ceil(T S / bm) + the experts that can be active (each adds under one) */
static long long gemm_tiles(const struct cuda_moe_args *a, int bm)
{
    const long long n = (long long)a->T * a->S, routed = (long long)a->T * a->K;
    return (n + bm - 1) / bm + (routed < a->NE ? routed : a->NE) + (a->S > a->K);
}

extern "C" int cuda_moe_gemm_takes(const struct cuda_moe_args *a)
{
    const float m = a->packed ? cuda_tuning.moe_gemm_min_rows_packed : cuda_tuning.moe_gemm_min_rows;
    return m >= 0.0f && a->T > 0 && (double)a->T * a->K >= (double)m * a->NE;
}

template <int BM, int WM, int WN>
static cudaError_t gemm_launches(const struct cuda_moe_args *a, cudaStream_t st)
{
    const unsigned tiles = (unsigned)gemm_tiles(a, BM);
    cudaError_t e = gm_launch<GM_GU, BM, WM, WN>(a, tiles, (unsigned)((a->Fmax + GM_BN / 2 - 1) / (GM_BN / 2)), st);
    if (e != cudaSuccess) return e;
    return gm_launch<GM_DOWN, BM, WM, WN>(a, tiles, (unsigned)((a->E + GM_BN - 1) / GM_BN), st);
}

extern "C" cudaError_t cuda_moe_gemm(const struct cuda_moe_args *a, cudaStream_t st)
{
    if (a->T <= 0) return cudaSuccess;
    if (a->E <= 0 || a->Fmax <= 0 || a->K <= 0 || a->NE <= 0 || gemm_tiles(a, 16) > 0x7fffffffLL)
        return cudaErrorInvalidValue;
    switch (gemm_bm(a)) {
    case 16: return gemm_launches<16, 1, 4>(a, st);
    case 32: return gemm_launches<32, 1, 4>(a, st);
    case 64: return gemm_launches<64, 2, 2>(a, st);
    default: return gemm_launches<128, 4, 2>(a, st);
    }
}

extern "C" cudaError_t cuda_moe_router_gemm(const struct cuda_moe_args *a, cudaStream_t st)
{
    if (a->T <= 0) return cudaSuccess;
    if (a->router_f32 || a->E <= 0 || a->NE <= 0) return cudaErrorInvalidValue;
    const unsigned ny = (unsigned)((a->NE + (a->shared_gated ? 1 : 0) + GM_BN - 1) / GM_BN);
    /* 16-token tiles keep more blocks busy on the router's few columns; 64
     * reuse each B tile for more tokens on big steps */
    if (a->T < 1024) return gm_launch<GM_ROUTER, 16, 1, 4>(a, (unsigned)((a->T + 15) / 16), ny, st);
    return gm_launch<GM_ROUTER, 64, 2, 2>(a, (unsigned)((a->T + 63) / 64), ny, st);
}

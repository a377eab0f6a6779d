/* moe_gemm.cu - the MoE experts as a grouped GEMM on tensor cores (moe.h),
 * for steps with many rows per active expert (prefill, big decode batches).
 * cuda_moe_experts takes it when cuda_moe_gemm_takes says so; the contract
 * is expert_kernel's (moe.cu): gate|up with the (clamped) SwiGLU into h
 * (bf16), down into y (f32), over the grouping cuda_moe_group made.
 *
 * One launch for gate|up, one for down. A block computes a 64-row tile of
 * one expert's gathered assignments (rows: a.list[start[e] ..]) against
 * 128 weight rows (64 gate + the same 64 up rows, or 128 down rows), k in
 * 32-column steps: the activations stream into shared memory by cp.async
 * (gathered by token for gate|up, by assignment for down), the weights by
 * cp.async too (bf16) or through registers, dequantized (packed int4/int8,
 * qgemm.h's layout: the formula of moe.cu's weights8, then stored as bf16),
 * both double buffered; 4 warps of 32 x 64 take mma.sync m16n8k16 bf16 ->
 * f32 fed by ldmatrix.
 *
 * The grid depends on T and the shapes only (CUDA graphs): x the weight-row
 * tiles, y every row tile the step could have (ceil(T S / 64) plus one per
 * possible active expert); each block finds its (expert, row tile) from the
 * prefix sums over a.act and leaves when past the end, or past its expert's
 * F.
 *
 * Numerics: each output element is its k tiles in ascending order, each an
 * MMA chain over 16 columns into one f32 accumulator: a fixed sequence for
 * the element whatever the other rows of its tile, so the path is batch
 * invariant (no split-K, no atomics). It sums in another order than the
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

#define GM_BM 64                /* assignments a tile */
#define GM_BN 128               /* weight rows a block */
#define GM_BK 32                /* columns a k step */
#define GM_LDS (GM_BK + 8)      /* shared row stride (elements): 80 bytes, so ldmatrix has no bank conflicts */
#define GM_THREADS 128          /* 4 warps, 2 x 2 over the 64 x 128 tile */

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
 * weights8 and qgemm.cu */
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

/* GU: h[a][n] = SwiGLU(gate x, up x) for a block of 64 gate columns n;
 * else y[a][n] = down h[a] for 128 columns n. Grid (n tiles, row tiles). */
template <bool GU>
static __global__ void __launch_bounds__(GM_THREADS) moe_gemm_kernel(struct cuda_moe_args a)
{
    __shared__ __align__(16) uint16_t As[2][GM_BM][GM_LDS];
    __shared__ __align__(16) uint16_t Bs[2][GM_BN][GM_LDS];
    __shared__ cuda_moe_mat smat[2]; /* gate (or down), up */
    __shared__ int rowid[GM_BM];     /* the tile's assignments, -1 past the expert's */
    __shared__ int wsum[GM_THREADS / 32];
    __shared__ int s_e, s_t0;
    const int tid = threadIdx.x, lane = tid & 31, warp = tid >> 5;
    const int tile = (int)blockIdx.y;

    /* which expert's row tile this is: tiles are numbered over the active
     * experts in a.act order, ceil(count / 64) each (a block scan over a.act,
     * 128 experts a round) */
    const int n_act = a.act[a.NE + 1];
    if (tid == 0) s_e = -1;
    int running = 0;
    for (int b0 = 0; b0 < n_act; b0 += GM_THREADS) {
        const int i = b0 + tid;
        int e = -1, c = 0;
        if (i < n_act) {
            e = a.act[i];
            c = (a.start[e + 1] - a.start[e] + GM_BM - 1) / GM_BM;
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
        for (int w = 0; w < GM_THREADS / 32; w++) {
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
    const int rows = GU ? F : a.E, cols = GU ? a.E : F; /* weight rows (outputs), the inner dimension */
    const int n0 = (int)blockIdx.x * (GU ? GM_BN / 2 : GM_BN);
    if (n0 >= rows || cols <= 0) return;
    const int base = a.start[e] + (tile - s_t0) * GM_BM, nr = min(GM_BM, a.start[e + 1] - base);
    if (tid < GM_BM) rowid[tid] = tid < nr ? a.list[base + tid] : -1;
    if (tid == 0) smat[0] = GU ? a.ex[e].gate : a.ex[e].down;
    if (tid == 1 && GU) smat[1] = a.ex[e].up;
    __syncthreads();

    /* what this thread loads: 8 columns (chunk cc) of tile rows rr, rr + 32
     * of A and rr + 32 i (i < 4) of B; B rows 0..63 are gate rows n0 ..,
     * 64..127 the same up rows (GU), or down rows n0 + 0..127 */
    const int cc = tid & 3, rr = tid >> 2;
    const int ld = GU ? a.E : a.Fmax; /* the input rows' stride */
    const bool avec = (ld & 7) == 0;
    const uint16_t *src = GU ? a.xn : a.h;
    const uint16_t *arow[2];
#pragma unroll
    for (int i = 0; i < 2; i++) {
        const int as = rowid[rr + 32 * i];
        arow[i] = as >= 0 ? src + (size_t)(GU ? as / a.S : as) * ld : nullptr;
    }
    int brow[4];
#pragma unroll
    for (int i = 0; i < 4; i++) {
        const int r = n0 + rr + 32 * (GU ? (i & 1) : i);
        brow[i] = r < rows ? r : -1;
    }
    const bool bvec = (cols & 7) == 0; /* bf16 weight rows 16-byte aligned */
    const int nk = (cols + GM_BK - 1) / GM_BK;
    uint32_t qlo[4], qhi[4]; /* the packed chunks in flight: codes, scale, zero */
    float qsc[4];
    int qz[4];

    /* Issues k step kt's loads into buffer buf: cp.async for A and bf16 B;
     * packed B into registers (store() finishes it). */
    auto fetch = [&](int kt, int buf) {
        const int c = kt * GM_BK + cc * 8;
#pragma unroll
        for (int i = 0; i < 2; i++) {
            uint16_t *d = &As[buf][rr + 32 * i][cc * 8];
            if (arow[i] && avec && c + 8 <= cols) {
                cp_async16(d, arow[i] + c);
            } else {
                float v[8];
#pragma unroll
                for (int j = 0; j < 8; j++) v[j] = arow[i] && c + j < cols ? bf2f(arow[i][c + j]) : 0.0f;
                *(uint4 *)d = pack8(v);
            }
        }
#pragma unroll
        for (int i = 0; i < 4; i++) {
            const cuda_moe_mat &m = smat[GU && i >= 2 ? 1 : 0];
            if (brow[i] < 0 || c >= cols) continue;
            if (m.w) {
                if (bvec) cp_async16(&Bs[buf][rr + 32 * i][cc * 8], m.w + (size_t)brow[i] * cols + c);
            } else if (!m.iperm && c + 8 <= cols) {
                const uint8_t *row = m.qw + (size_t)brow[i] * m.row_bytes;
                const size_t gi = (size_t)brow[i] * m.n_groups + (m.n_groups > 1 ? c / m.group : 0);
                if (m.bits == 4) {
                    qlo[i] = __ldg((const uint32_t *)(row + c / 2)), qhi[i] = 0;
                } else {
                    const uint2 v = __ldg((const uint2 *)(row + c));
                    qlo[i] = v.x, qhi[i] = v.y;
                }
                const uint16_t sr = __ldg(m.scales + gi);
                qsc[i] = m.f16 ? __half2float(__ushort_as_half(sr)) : bf2f(sr);
                qz[i] = m.zeros ? (int)__ldg(m.zeros + gi) : 1 << (m.bits - 1);
            }
        }
    };
    /* The B rows fetch() did not cp.async: zeros past the matrix, the packed
     * chunks dequantized, the odd ones element by element. */
    auto store = [&](int kt, int buf) {
        const int c = kt * GM_BK + cc * 8;
#pragma unroll
        for (int i = 0; i < 4; i++) {
            const cuda_moe_mat &m = smat[GU && i >= 2 ? 1 : 0];
            float w[8];
            if (brow[i] < 0 || c >= cols) {
#pragma unroll
                for (int j = 0; j < 8; j++) w[j] = 0.0f;
            } else if (m.w) {
                if (bvec) continue;
#pragma unroll
                for (int j = 0; j < 8; j++) w[j] = c + j < cols ? bf2f(m.w[(size_t)brow[i] * cols + c + j]) : 0.0f;
            } else if (!m.iperm && c + 8 <= cols) {
#pragma unroll
                for (int j = 0; j < 8; j++) {
                    /* int4: column j in nibble j / 2 + 4 (j % 2) (the layout's order, model.h) */
                    const uint32_t u = m.bits == 4 ? (qlo[i] >> (4 * ((j >> 1) + 4 * (j & 1)))) & 0xFu
                                                   : ((j < 4 ? qlo[i] : qhi[i]) >> (8 * (j & 3))) & 0xFFu;
                    w[j] = gm_deq((int)u, qz[i], qsc[i], m.f16);
                }
            } else {
#pragma unroll
                for (int j = 0; j < 8; j++) w[j] = c + j < cols ? gm_weight(m, brow[i], c + j, cols) : 0.0f;
            }
            *(uint4 *)&Bs[buf][rr + 32 * i][cc * 8] = pack8(w);
        }
    };

    /* warp (wm, wn): tile rows wm*32 + 0..31; its 8 n subtiles of 8 B rows:
     * GU, gate rows wn*32 + 0..31 (j < 4) and the same up rows (j >= 4, B
     * rows 64 + ...); down, B rows wn*64 + 0..63 */
    const int wm = warp >> 1, wn = warp & 1;
    float acc[2][8][4];
#pragma unroll
    for (int mi = 0; mi < 2; mi++)
#pragma unroll
        for (int j = 0; j < 8; j++)
#pragma unroll
            for (int q = 0; q < 4; q++) acc[mi][j][q] = 0.0f;

    auto compute = [&](int buf) {
#pragma unroll
        for (int kk = 0; kk < GM_BK; kk += 16) {
            uint32_t af[2][4], bfr[8][2];
#pragma unroll
            for (int mi = 0; mi < 2; mi++)
                ldsm_x4(af[mi][0], af[mi][1], af[mi][2], af[mi][3],
                        &As[buf][wm * 32 + mi * 16 + (lane & 15)][kk + (lane >> 4) * 8]);
#pragma unroll
            for (int jp = 0; jp < 4; jp++) {
                const int nb = GU ? (jp < 2 ? wn * 32 + jp * 16 : 64 + wn * 32 + (jp - 2) * 16) : wn * 64 + jp * 16;
                ldsm_x4(bfr[2 * jp][0], bfr[2 * jp][1], bfr[2 * jp + 1][0], bfr[2 * jp + 1][1],
                        &Bs[buf][nb + (lane & 7) + ((lane >> 4) << 3)][kk + ((lane >> 3) & 1) * 8]);
            }
#pragma unroll
            for (int mi = 0; mi < 2; mi++)
#pragma unroll
                for (int j = 0; j < 8; j++) mma_bf16(acc[mi][j], af[mi], bfr[j][0], bfr[j][1]);
        }
    };

    fetch(0, 0);
    cp_async_commit();
    store(0, 0);
    cp_async_wait_all();
    __syncthreads();
    for (int kt = 0; kt < nk; kt++) {
        const int buf = kt & 1;
        /* the other buffer was last read before the previous iteration's barrier */
        if (kt + 1 < nk) {
            fetch(kt + 1, buf ^ 1);
            cp_async_commit();
        }
        compute(buf);
        if (kt + 1 < nk) store(kt + 1, buf ^ 1);
        cp_async_wait_all();
        __syncthreads();
    }

    /* accumulator q of subtile j: tile row g (q < 2) or g + 8, column 2t + (q & 1) */
    const int g = lane >> 2, t = lane & 3;
#pragma unroll
    for (int mi = 0; mi < 2; mi++)
#pragma unroll
        for (int hf = 0; hf < 2; hf++) {
            const int as = rowid[wm * 32 + mi * 16 + g + 8 * hf];
            if (as < 0) continue;
            if (GU) {
                uint16_t *hr = a.h + (size_t)as * a.Fmax;
#pragma unroll
                for (int j = 0; j < 4; j++)
#pragma unroll
                    for (int q = 0; q < 2; q++) {
                        const int n = n0 + wn * 32 + j * 8 + 2 * t + q;
                        if (n < rows)
                            hr[n] = f2bf(gm_swiglu(acc[mi][j][2 * hf + q], acc[mi][j + 4][2 * hf + q], a.swiglu_limit));
                    }
            } else {
                float *yr = a.y + (size_t)as * a.E;
#pragma unroll
                for (int j = 0; j < 8; j++)
#pragma unroll
                    for (int q = 0; q < 2; q++) {
                        const int n = n0 + wn * 64 + j * 8 + 2 * t + q;
                        if (n < rows) yr[n] = acc[mi][j][2 * hf + q];
                    }
            }
        }
}

/* Row tiles a step can have: sum over experts of ceil(count / 64) <=
 * ceil(T S / 64) + the experts that can be active (each adds under one) */
static long long gemm_tiles(const struct cuda_moe_args *a)
{
    const long long n = (long long)a->T * a->S, routed = (long long)a->T * a->K;
    return (n + GM_BM - 1) / GM_BM + (routed < a->NE ? routed : a->NE) + (a->S > a->K);
}

extern "C" int cuda_moe_gemm_takes(const struct cuda_moe_args *a)
{
    const int m = cuda_tuning.moe_gemm_min_rows;
    return m >= 0 && a->T > 0 && (long long)a->T * a->K >= (long long)m * a->NE && gemm_tiles(a) <= 65535;
}

extern "C" cudaError_t cuda_moe_gemm(const struct cuda_moe_args *a, cudaStream_t st)
{
    if (a->T <= 0) return cudaSuccess;
    const long long tiles = gemm_tiles(a);
    if (tiles > 65535 || a->E <= 0 || a->Fmax <= 0) return cudaErrorInvalidValue;
    dim3 g1((unsigned)((a->Fmax + GM_BN / 2 - 1) / (GM_BN / 2)), (unsigned)tiles);
    moe_gemm_kernel<true><<<g1, GM_THREADS, 0, st>>>(*a);
    cudaError_t e = cudaGetLastError();
    if (e != cudaSuccess) return e;
    dim3 g2((unsigned)((a->E + GM_BN - 1) / GM_BN), (unsigned)tiles);
    moe_gemm_kernel<false><<<g2, GM_THREADS, 0, st>>>(*a);
    return cudaGetLastError();
}

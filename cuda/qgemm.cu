/* qgemm.cu - the mixed-input GEMMs of packed int4/int8 weights (qgemm.h).
 *
 * GEMV (1-8 rows of x, decode), two kernels. The tensor-core one (below,
 * qgemv_mma_kernel; bf16 scales) dequantizes in packed bf16 arithmetic
 * straight into MMA fragments. The SIMT one (f16 scales, odd shapes, and
 * every weight under cuda_qgemv_select(0)): a warp owns R consecutive output rows and
 * streams them along the input dimension, lane l taking the 16-byte chunks
 * l, l + 32, ... of every one of its rows (32 int4 or 16 int8 codes a chunk,
 * one 128-bit load per row, kept out of L1); the rows of x are read once a
 * chunk for all R rows and all T rows of x, so W is read once for the whole
 * step. Each 8-code piece is dequantized exactly as the reference does:
 * code and zero become f32 through the 2^23 exponent trick (0x4B000000 | u
 * is 2^23 + u), the difference times the scale is exact in f32, and one
 * conversion rounds it to the scale's dtype (two at a time). The scale and
 * zero of a piece's group are two small loads that hit L1 (a row's groups
 * are adjacent). Sums in f32: lane l sums its chunks in order, the lanes
 * combine by the xor butterfly.
 *
 * The gate|up projection may end in SwiGLU (cuda_qgemm_swiglu): a block of
 * the tensor-core kernel then takes a tile of gate rows and the same tile
 * of up rows, and its epilogue stores SwiGLU of the two bf16-rounded sums.
 *
 * Both GEMVs take part in programmatic dependent launch (pdl.cuh): they
 * let the next kernel launch at once, and, launched early themselves,
 * request their first weights before waiting for the previous kernel.
 *
 * Larger steps: row tiles of W dequantized to bf16 (the same arithmetic,
 * then rounded to bf16) into a workspace, each multiplied by cuBLAS (bf16
 * in, f32 compute): correct for any T, and for long prefill steps the
 * dequantization is a small part of the GEMM's time.
 *
 * Act-order weights: their columns were sorted by group at upload, so every
 * kernel sees plain groups; the GEMV reads x gathered through the
 * permutation (one small kernel, T x cols elements), the dequantizer
 * writes each weight at its original column, so cuBLAS takes x as it is.
 */
#include "cuda/bf16.cuh"
#include "cuda/kernels.h"
#include "cuda/norm.cuh"
#include "cuda/pdl.cuh"
#include "cuda/qgemm.h"

#define QW 4 /* warps a block */

struct qparams {
    const uint8_t *qw;
    const uint16_t *scales;
    const uint8_t *zeros;
    const int32_t *perm;
    const uint16_t *x;
    void *y;
    int rows, cols, group, n_groups, row_bytes, ldy, T;
    int F; /* the SwiGLU kernels: gate rows (W holds F gate rows, then F up rows) */
    bool f16, yf32;
    /* the tensor-core kernel's NORM build: x = rmsnorm(xf) by nw, eps (cuda_qgemv_rmsnorm) */
    const float *xf, *nw;
    float eps;
    float *resid; /* else y: resid += the bf16-rounded sums (cuda_qgemv_residual) */
};

static qparams qparams_of(const cuda_qmat *w)
{
    qparams p = {};
    p.qw = w->qw, p.scales = w->scales, p.zeros = w->zeros, p.perm = w->perm;
    p.rows = w->rows, p.cols = w->cols, p.group = w->group, p.n_groups = w->n_groups, p.row_bytes = w->row_bytes;
    p.f16 = w->f16;
    return p;
}

/* weights: read once, never again in this kernel: keep them out of L1 */
static __device__ __forceinline__ uint4 ld_stream(const uint4 *p)
{
    uint4 v;
    asm volatile("ld.global.nc.L1::no_allocate.v4.u32 {%0, %1, %2, %3}, [%4];"
                 : "=r"(v.x), "=r"(v.y), "=r"(v.z), "=r"(v.w)
                 : "l"(p));
    return v;
}

static __device__ __forceinline__ float scale_f(const qparams &p, size_t gi)
{
    uint16_t s = p.scales[gi];
    return p.f16 ? __half2float(__ushort_as_half(s)) : bf2f(s);
}

/* The 8 weights of codes lo (int4: 8 nibbles in the layout's order; int8: 4 bytes, then hi's 4),
 * zero z, scale s: (u - z) * s rounded to the scale's dtype, as f32. */
template <int BITS>
static __device__ __forceinline__ void deq8(uint32_t lo, uint32_t hi, int z, float s, bool f16, float *w)
{
    const float zf = 8388608.0f + (float)z;
    float p[8];
#pragma unroll
    for (int j = 0; j < 8; j++) {
        /* int4: column j in nibble j / 2 + 4 (j % 2) (the layout's order, model.h) */
        uint32_t u = BITS == 4 ? (lo >> (4 * ((j >> 1) + 4 * (j & 1)))) & 0xFu
                               : ((j < 4 ? lo : hi) >> (8 * (j & 3))) & 0xFFu;
        p[j] = (__uint_as_float(0x4B000000u | u) - zf) * s;
    }
    if (f16) {
#pragma unroll
        for (int j = 0; j < 8; j += 2) {
            float2 f = __half22float2(__floats2half2_rn(p[j], p[j + 1]));
            w[j] = f.x, w[j + 1] = f.y;
        }
    } else {
#pragma unroll
        for (int j = 0; j < 8; j += 2) {
            __nv_bfloat162 b = __floats2bfloat162_rn(p[j], p[j + 1]);
            uint32_t v = *(const uint32_t *)&b;
            w[j] = __uint_as_float(v << 16), w[j + 1] = __uint_as_float(v & 0xffff0000u);
        }
    }
}

/* x[c .. c+8) of a row of `cols` as f32, zeros past the row */
static __device__ __forceinline__ void load_x8(const uint16_t *xr, int c, int cols, bool vec, float *f)
{
    if (vec && c + 8 <= cols) {
        uint4 v = *(const uint4 *)(xr + c);
        f[0] = __uint_as_float(v.x << 16), f[1] = __uint_as_float(v.x & 0xffff0000u);
        f[2] = __uint_as_float(v.y << 16), f[3] = __uint_as_float(v.y & 0xffff0000u);
        f[4] = __uint_as_float(v.z << 16), f[5] = __uint_as_float(v.z & 0xffff0000u);
        f[6] = __uint_as_float(v.w << 16), f[7] = __uint_as_float(v.w & 0xffff0000u);
        return;
    }
#pragma unroll
    for (int j = 0; j < 8; j++) f[j] = c + j < cols ? bf2f(xr[c + j]) : 0.0f;
}

template <int BITS, int M, int R>
__global__ void __launch_bounds__(QW * 32) qgemv_kernel(qparams p)
{
    constexpr int CPC = 128 / BITS; /* columns a 16-byte chunk */
    constexpr int SUB = CPC / 8;    /* 8-column pieces a chunk */
    const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
    const int r0 = (blockIdx.x * QW + warp) * R;
    pdl_trigger();
    if (r0 >= p.rows) return; /* the whole warp: no block-wide barrier below; warp 0 of block 0 always waits */
    pdl_wait();
    const int nch = p.row_bytes >> 4;
    const bool xvec = (p.cols & 7) == 0;
    float acc[R][M];
#pragma unroll
    for (int r = 0; r < R; r++)
#pragma unroll
        for (int m = 0; m < M; m++) acc[r][m] = 0.0f;
    for (int ch = lane; ch < nch; ch += 32) {
        uint4 wv[R];
#pragma unroll
        for (int r = 0; r < R; r++)
            wv[r] = r0 + r < p.rows ? ld_stream((const uint4 *)(p.qw + (size_t)(r0 + r) * p.row_bytes) + ch)
                                    : make_uint4(0, 0, 0, 0);
#pragma unroll
        for (int sub = 0; sub < SUB; sub++) {
            const int c = ch * CPC + sub * 8;
            if (c < p.cols) {
                float xf[M][8];
#pragma unroll
                for (int m = 0; m < M; m++) load_x8(p.x + (size_t)m * p.cols, c, p.cols, xvec, xf[m]);
                const int g = c / p.group;
#pragma unroll
                for (int r = 0; r < R; r++) {
                    if (r0 + r < p.rows) {
                        const size_t gi = (size_t)(r0 + r) * p.n_groups + g;
                        const float s = scale_f(p, gi);
                        const int z = p.zeros ? (int)p.zeros[gi] : 1 << (BITS - 1);
                        const uint32_t *wd = (const uint32_t *)&wv[r];
                        float w[8];
                        deq8<BITS>(BITS == 4 ? wd[sub] : wd[2 * sub], BITS == 4 ? 0u : wd[2 * sub + 1], z, s, p.f16,
                                   w);
#pragma unroll
                        for (int m = 0; m < M; m++)
#pragma unroll
                            for (int j = 0; j < 8; j++) acc[r][m] = fmaf(w[j], xf[m][j], acc[r][m]);
                    }
                }
            }
        }
    }
#pragma unroll
    for (int r = 0; r < R; r++)
#pragma unroll
        for (int m = 0; m < M; m++) {
            float v = warp_sum(acc[r][m]);
            if (lane == (r * M + m) % 32 && r0 + r < p.rows) {
                size_t o = (size_t)m * p.ldy + (size_t)(r0 + r);
                if (p.yf32) ((float *)p.y)[o] = v;
                else ((uint16_t *)p.y)[o] = f2bf(v);
            }
        }
}

/* ---- the tensor-core GEMV ------------------------------------------------------------- */

#define MW 8           /* warps a block of the tensor-core GEMV (K split 8 ways: Llama-8B's o and down
                          projections are 256 blocks, one to two an SM, so each needs many warps) */
#define QMMA_MAX_T CUDA_QGEMV_MMA_MAX_T /* rows of x it takes (8 a group, up to 8 groups) */
#define MU 2 /* its stretches in flight per warp */
/* Rows up to which cuda_qgemm takes the tensor-core kernel rather than
 * dequantize + cuBLAS, by format: measured (bench_qgemm's crossover, H100,
 * Llama-3.1-8B's four projections summed) int4 g128 at 48 rows 459 us
 * packed against 451 dequantized (a wash), at 64 rows 612 against 447; int8
 * at 64 rows 392 against 468 (still faster) */
#define QMMA_MAX_T4 48

static __device__ __forceinline__ void mma_bf16(float (&d)[4], uint32_t a0, uint32_t a1, uint32_t a2, uint32_t a3,
                                                uint32_t b0, uint32_t b1)
{
    asm("mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32 {%0, %1, %2, %3}, {%4, %5, %6, %7}, {%8, %9}, "
        "{%0, %1, %2, %3};\n"
        : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3])
        : "r"(a0), "r"(a1), "r"(a2), "r"(a3), "r"(b0), "r"(b1));
}

static __device__ __forceinline__ uint32_t lop_or_and(uint32_t x, uint32_t mask, uint32_t bits)
{
    uint32_t r;
    asm("lop3.b32 %0, %1, %2, %3, 0xEA;\n" : "=r"(r) : "r"(x), "r"(mask), "r"(bits)); /* (x & mask) | bits */
    return r;
}

static __device__ __forceinline__ uint32_t bf2_mul(uint32_t a, uint32_t b)
{
    __nv_bfloat162 r = __hmul2_rn(*(const __nv_bfloat162 *)&a, *(const __nv_bfloat162 *)&b);
    return *(const uint32_t *)&r;
}

static __device__ __forceinline__ uint32_t bf2_sub(uint32_t a, uint32_t b)
{
    __nv_bfloat162 r = __hsub2(*(const __nv_bfloat162 *)&a, *(const __nv_bfloat162 *)&b);
    return *(const uint32_t *)&r;
}

/* Columns 2i, 2i + 1 of one word of codes (the layout's pair i) as exact
 * bf16 weights, packed: int4: (0x4300 | u) is the bf16 128 + u, less
 * 128 + z is u - z exactly; int8: 2^23 + u as f32, less 2^23 + z, then
 * packed to bf16 (exact: |u - z| <= 255). Times the scale: one rounding to
 * bf16, the reference's. z2: bf16x2 of 128 + z (int4); zf: 2^23 + z (int8). */
template <int BITS>
static __device__ __forceinline__ uint32_t deq_pair(uint32_t w, int i, uint32_t z2, float zf, uint32_t s2)
{
    uint32_t d;
    if (BITS == 4) {
        d = bf2_sub(lop_or_and(w >> (4 * i), 0x000F000Fu, 0x43004300u), z2);
    } else {
        float lo = __uint_as_float(__byte_perm(w, 0x4B000000u, 0x7540 + 2 * i)) - zf;
        float hi = __uint_as_float(__byte_perm(w, 0x4B000000u, 0x7541 + 2 * i)) - zf;
        __nv_bfloat162 b = __floats2bfloat162_rn(lo, hi);
        d = *(const uint32_t *)&b;
    }
    return bf2_mul(d, s2);
}

/* A block owns 16 output rows and runs them through mma.m16n8k16 with the
 * rows of x as the MMA's 8 columns (tokens past T read as zeros). Lane
 * (g, t) = (lane / 4, lane % 4) holds rows g and g + 8; its four k slots
 * 2t, 2t + 1, 2t + 8, 2t + 9 of a k-step are four adjacent columns of its
 * own 16-byte chunk of each row (the k order inside a step is free as long
 * as A and B agree), so the weights arrive in one 128-bit load per row and
 * chunk, already in fragment order, and x in one 64-bit load per step. A
 * stretch is the 64 bytes of a row the four lanes of a row cover; warp w
 * takes stretches w, w + MW, ...; the warps' sums meet in shared memory. */
template <int BITS, int NT, bool SW, bool NORM = false>
__global__ void __launch_bounds__(MW * 32) qgemv_mma_kernel(qparams p)
{
    static_assert(!NORM || (NT == 1 && !SW), "the norm prologue: one row of x");
    extern __shared__ __align__(16) uint16_t xs[]; /* NORM: the normalized row */
    constexpr int CPT = 128 / BITS; /* columns of a lane's chunk */
    constexpr int CPS = 4 * CPT;    /* columns of a stretch */
    constexpr int KS = CPT / 4;     /* k-steps a chunk */
    constexpr int NR = SW ? 2 : 1;  /* row tiles: SW, a gate tile and its up tile */
    __shared__ float red[MW - 1][32][4 * NT * NR];
    const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5, g = lane >> 2, t = lane & 3;
    /* the lane's rows g and g + 8 of the tile (of each tile: gate rows, then up rows F further) */
    const int nrows = SW ? p.F : p.rows, ra = blockIdx.x * 16 + g, rb = ra + 8;
    const bool va = ra < nrows, vb = rb < nrows;
    const uint8_t *pa[NR], *pb[NR];
    size_t ia0[NR], ib0[NR]; /* scale/zero row offsets */
#pragma unroll
    for (int h = 0; h < NR; h++) {
        const size_t xa = (size_t)(va ? ra : 0) + (size_t)h * p.F, xb = (size_t)(vb ? rb : 0) + (size_t)h * p.F;
        pa[h] = p.qw + xa * p.row_bytes, pb[h] = p.qw + xb * p.row_bytes;
        ia0[h] = xa * p.n_groups, ib0[h] = xb * p.n_groups;
    }
    const int nst = (p.row_bytes + 63) / 64, K = (nst + MW * MU - 1) / (MW * MU);
    pdl_trigger();
    float acc[NR][NT][4];
#pragma unroll
    for (int h = 0; h < NR; h++)
#pragma unroll
        for (int j = 0; j < NT; j++) acc[h][j][0] = acc[h][j][1] = acc[h][j][2] = acc[h][j][3] = 0.0f;
    /* step i: stretches warp + MW (MU i + u); the next step's requested before this one's are used */
    uint4 wa[NR][MU], wb[NR][MU], na[NR][MU], nb[NR][MU];
    auto load = [&](uint4(&a)[NR][MU], uint4(&b)[NR][MU], int i) {
#pragma unroll
        for (int u = 0; u < MU; u++) {
            const int st = warp + MW * (MU * i + u), boff = st * 64 + t * 16;
            const bool in = st < nst && boff < p.row_bytes;
#pragma unroll
            for (int h = 0; h < NR; h++) {
                a[h][u] = va && in ? ld_stream((const uint4 *)(pa[h] + boff)) : make_uint4(0, 0, 0, 0);
                b[h][u] = vb && in ? ld_stream((const uint4 *)(pb[h] + boff)) : make_uint4(0, 0, 0, 0);
            }
        }
    };
    load(wa, wb, 0);
    float nwv[NORM ? RMS_J : 1][RMS_K]; /* NORM: the norm's weights, requested with the first codes */
    if constexpr (NORM) rms_load(p.nw, p.cols, nwv);
    pdl_wait(); /* x may be read from here on (weights only before) */
    if constexpr (NORM) {
        /* cuda_add_rmsnorm's bits: x in one round of loads, while the first codes are on their way */
        __shared__ float nsh[32];
        float xv[RMS_J][RMS_K];
        rms_load(p.xf, p.cols, xv);
        rms_store(xv, nwv, p.cols, rms_inv_regs(xv, p.cols, p.eps, nsh), xs);
        __syncthreads();
    }
    for (int i = 0; i < K; i++) {
        if (i + 1 < K) load(na, nb, i + 1);
#pragma unroll
        for (int u = 0; u < MU; u++) {
            const int st = warp + MW * (MU * i + u);
            if (st >= nst) break; /* warp-uniform */
            const int col0 = st * CPS + t * CPT;
            int gi = col0 / p.group;
            gi = gi < p.n_groups ? gi : p.n_groups - 1; /* a chunk past the last column: codes 0, x 0 */
            uint32_t sa2[NR], sb2[NR], za2[NR], zb2[NR];
            float zaf[NR], zbf[NR];
#pragma unroll
            for (int h = 0; h < NR; h++) {
                const size_t ia = ia0[h] + gi, ib = ib0[h] + gi;
                const uint32_t sa = p.scales[ia], sb = p.scales[ib];
                const int za = p.zeros ? (int)p.zeros[ia] : 1 << (BITS - 1);
                const int zb = p.zeros ? (int)p.zeros[ib] : 1 << (BITS - 1);
                sa2[h] = sa | sa << 16, sb2[h] = sb | sb << 16;
                za2[h] = (0x4300u | (uint32_t)za) * 0x10001u, zb2[h] = (0x4300u | (uint32_t)zb) * 0x10001u;
                zaf[h] = 8388608.0f + (float)za, zbf[h] = 8388608.0f + (float)zb;
            }
#pragma unroll
            for (int ks = 0; ks < KS; ks++) {
                /* this step's columns col0 + 4 ks .. + 3: int4 pairs 2 (ks % 2), +1 of word ks / 2;
                 * int8 pairs 0, 1 of word ks */
                const int i0 = BITS == 4 ? 2 * (ks & 1) : 0, wi = BITS == 4 ? ks >> 1 : ks;
                uint32_t a[NR][4];
#pragma unroll
                for (int h = 0; h < NR; h++) {
                    const uint32_t wda = ((const uint32_t *)&wa[h][u])[wi], wdb = ((const uint32_t *)&wb[h][u])[wi];
                    a[h][0] = deq_pair<BITS>(wda, i0, za2[h], zaf[h], sa2[h]);
                    a[h][1] = deq_pair<BITS>(wdb, i0, zb2[h], zbf[h], sb2[h]);
                    a[h][2] = deq_pair<BITS>(wda, i0 + 1, za2[h], zaf[h], sa2[h]);
                    a[h][3] = deq_pair<BITS>(wdb, i0 + 1, zb2[h], zbf[h], sb2[h]);
                }
                const int col = col0 + 4 * ks;
#pragma unroll
                for (int j = 0; j < NT; j++) { /* tokens 8j .. 8j + 7: the MMA's columns */
                    const int tok = 8 * j + g;
                    uint2 b = make_uint2(0, 0);
                    if (tok < p.T && col < p.cols) /* cols % 4 == 0: the four are whole */
                        b = NORM ? *(const uint2 *)(xs + col) : *(const uint2 *)(p.x + (size_t)tok * p.cols + col);
#pragma unroll
                    for (int h = 0; h < NR; h++) mma_bf16(acc[h][j], a[h][0], a[h][1], a[h][2], a[h][3], b.x, b.y);
                }
            }
        }
#pragma unroll
        for (int h = 0; h < NR; h++)
#pragma unroll
            for (int u = 0; u < MU; u++) wa[h][u] = na[h][u], wb[h][u] = nb[h][u];
    }
    if (warp > 0) {
#pragma unroll
        for (int h = 0; h < NR; h++)
#pragma unroll
            for (int j = 0; j < NT; j++)
#pragma unroll
                for (int e = 0; e < 4; e++) red[warp - 1][lane][4 * (NT * h + j) + e] = acc[h][j][e];
    }
    __syncthreads();
    if (warp > 0) return;
#pragma unroll
    for (int w = 0; w < MW - 1; w++)
#pragma unroll
        for (int h = 0; h < NR; h++)
#pragma unroll
            for (int j = 0; j < NT; j++)
#pragma unroll
                for (int e = 0; e < 4; e++) acc[h][j][e] += red[w][lane][4 * (NT * h + j) + e];
    /* C fragment: rows g (e 0, 1) and g + 8 (e 2, 3), tokens 8j + 2t and 8j + 2t + 1. SW: the gate and
     * up sums rounded to bf16, then SwiGLU, as cuda_swiglu does over the stored gate|up */
#pragma unroll
    for (int j = 0; j < NT; j++)
#pragma unroll
        for (int e = 0; e < 4; e++) {
            const int row = e < 2 ? ra : rb, tok = 8 * j + 2 * t + (e & 1);
            if (row < nrows && tok < p.T) {
                size_t o = (size_t)tok * p.ldy + (size_t)row;
                if (SW) ((uint16_t *)p.y)[o] = swiglu1(f2bf(acc[0][j][e]), f2bf(acc[NR - 1][j][e]));
                else if (p.resid) p.resid[o] = p.resid[o] + bf2f(f2bf(acc[0][j][e])); /* cuda_add_rmsnorm's add */
                else if (p.yf32) ((float *)p.y)[o] = acc[0][j][e];
                else ((uint16_t *)p.y)[o] = f2bf(acc[0][j][e]);
            }
        }
}

static int g_variant = 1; /* cuda_qgemv_select */

extern "C" void cuda_qgemv_select(int variant) { g_variant = variant; }

/* whether the tensor-core GEMV takes w */
static bool mma_ok(const cuda_qmat *w)
{
    int cpt = 128 / w->bits;
    return g_variant == 1 && !w->f16 && w->cols % 8 == 0 && (w->n_groups == 1 || w->group % cpt == 0);
}

template <int BITS, int NT, bool SW = false, bool NORM = false>
static cudaError_t launch_mma(const qparams &p, cudaStream_t st)
{
    return pdl_launch(qgemv_mma_kernel<BITS, NT, SW, NORM>, dim3(((SW ? p.F : p.rows) + 15) / 16), dim3(MW * 32),
                      NORM ? (size_t)p.cols * 2 : 0, st, p);
}

/* T <= QMMA_MAX_T rows of x: ceil(T / 8) MMAs per dequantized fragment */
template <int BITS>
static cudaError_t launch_mma_t(const qparams &p, cudaStream_t st)
{
    switch ((p.T + 7) / 8) {
    case 1: return launch_mma<BITS, 1>(p, st);
    case 2: return launch_mma<BITS, 2>(p, st);
    case 3: return launch_mma<BITS, 3>(p, st);
    case 4: return launch_mma<BITS, 4>(p, st);
    case 5: return launch_mma<BITS, 5>(p, st);
    case 6: return launch_mma<BITS, 6>(p, st);
    case 7: return launch_mma<BITS, 7>(p, st);
    case 8: return launch_mma<BITS, 8>(p, st);
    }
    return cudaErrorInvalidValue;
}

template <int BITS, int M>
static cudaError_t launch_gemv(const qparams &p, cudaStream_t st)
{
    constexpr int R = M <= 2 ? 4 : 8;
    int blocks = (p.rows + QW * R - 1) / (QW * R);
    return pdl_launch(qgemv_kernel<BITS, M, R>, dim3(blocks), dim3(QW * 32), 0, st, p);
}

template <int BITS>
static cudaError_t launch_gemv_t(const qparams &p, int T, cudaStream_t st)
{
    switch (T) {
    case 1: return launch_gemv<BITS, 1>(p, st);
    case 2: return launch_gemv<BITS, 2>(p, st);
    case 3: return launch_gemv<BITS, 3>(p, st);
    case 4: return launch_gemv<BITS, 4>(p, st);
    case 5: return launch_gemv<BITS, 5>(p, st);
    case 6: return launch_gemv<BITS, 6>(p, st);
    case 7: return launch_gemv<BITS, 7>(p, st);
    case 8: return launch_gemv<BITS, 8>(p, st);
    }
    return cudaErrorInvalidValue;
}

extern "C" cudaError_t cuda_qgemv(const struct cuda_qmat *w, const uint16_t *x, void *y, bool yf32, int ldy, int T,
                                  cudaStream_t st)
{
    if (T <= 0) return cudaSuccess;
    const bool mma = mma_ok(w);
    if (T > (mma ? QMMA_MAX_T : CUDA_QGEMV_MAX_T) || (w->bits != 4 && w->bits != 8) || w->row_bytes % 16 ||
        (w->n_groups > 1 && w->group % 8))
        return cudaErrorInvalidValue;
    qparams p = qparams_of(w);
    p.x = x, p.y = y, p.yf32 = yf32, p.ldy = ldy, p.T = T;
    if (mma) return w->bits == 4 ? launch_mma_t<4>(p, st) : launch_mma_t<8>(p, st);
    return w->bits == 4 ? launch_gemv_t<4>(p, T, st) : launch_gemv_t<8>(p, T, st);
}

/* the NORM build's row of x in shared memory: up to 32 KB (no opt-in above 48 KB needed) */
#define QNORM_MAX_COLS 16384

extern "C" bool cuda_qgemv_fuses(const struct cuda_qmat *w, bool norm)
{
    return w && mma_ok(w) && !w->perm && w->row_bytes % 16 == 0 && (w->bits == 4 || w->bits == 8) &&
           w->cols <= QNORM_MAX_COLS && (!norm || rms_regs_fit(w->cols, MW * 32));
}

extern "C" cudaError_t cuda_qgemv_rmsnorm(const struct cuda_qmat *w, const float *x, const float *nw, float eps,
                                          uint16_t *y, cudaStream_t st)
{
    if (!cuda_qgemv_fuses(w, true)) return cudaErrorInvalidValue;
    qparams p = qparams_of(w);
    p.xf = x, p.nw = nw, p.eps = eps, p.y = y, p.ldy = w->rows, p.T = 1;
    return w->bits == 4 ? launch_mma<4, 1, false, true>(p, st) : launch_mma<8, 1, false, true>(p, st);
}

extern "C" cudaError_t cuda_qgemv_residual(const struct cuda_qmat *w, const uint16_t *x, float *resid, int T,
                                           cudaStream_t st)
{
    if (T <= 0) return cudaSuccess;
    if (!cuda_qgemv_fuses(w, false) || T > QMMA_MAX_T) return cudaErrorInvalidValue;
    qparams p = qparams_of(w);
    p.x = x, p.resid = resid, p.ldy = w->rows, p.T = T;
    return w->bits == 4 ? launch_mma_t<4>(p, st) : launch_mma_t<8>(p, st);
}

/* xp[t][k] = x[t][perm[k]] */
__global__ void gather_kernel(const uint16_t *x, const int32_t *perm, int T, int cols, uint16_t *xp)
{
    size_t i = (size_t)blockIdx.x * blockDim.x + threadIdx.x;
    if (i >= (size_t)T * cols) return;
    size_t t = i / cols, k = i % cols;
    xp[i] = x[t * cols + perm[k]];
}

/* rows [r0, r0 + nr) to bf16 out [nr][cols], each weight at its column of x */
template <int BITS>
__global__ void dequant_kernel(qparams p, int r0, int nr, uint16_t *out)
{
    const int npc = (p.cols + 7) / 8;
    size_t i = (size_t)blockIdx.x * blockDim.x + threadIdx.x;
    if (i >= (size_t)nr * npc) return;
    const int r = (int)(i / npc), c = (int)(i % npc) * 8;
    const uint8_t *row = p.qw + (size_t)(r0 + r) * p.row_bytes;
    uint32_t lo, hi = 0;
    if (BITS == 4) {
        lo = *(const uint32_t *)(row + c / 2);
    } else {
        uint2 v = *(const uint2 *)(row + c);
        lo = v.x, hi = v.y;
    }
    const size_t gi = (size_t)(r0 + r) * p.n_groups + c / p.group;
    float w[8];
    deq8<BITS>(lo, hi, p.zeros ? (int)p.zeros[gi] : 1 << (BITS - 1), scale_f(p, gi), p.f16, w);
    uint16_t *o = out + (size_t)r * p.cols;
    if (p.perm) {
#pragma unroll
        for (int j = 0; j < 8; j++)
            if (c + j < p.cols) o[p.perm[c + j]] = f2bf(w[j]);
    } else if ((p.cols & 7) == 0) {
        uint4 v;
        v.x = (uint32_t)f2bf(w[0]) | (uint32_t)f2bf(w[1]) << 16;
        v.y = (uint32_t)f2bf(w[2]) | (uint32_t)f2bf(w[3]) << 16;
        v.z = (uint32_t)f2bf(w[4]) | (uint32_t)f2bf(w[5]) << 16;
        v.w = (uint32_t)f2bf(w[6]) | (uint32_t)f2bf(w[7]) << 16;
        *(uint4 *)(o + c) = v;
    } else {
#pragma unroll
        for (int j = 0; j < 8; j++)
            if (c + j < p.cols) o[c + j] = f2bf(w[j]);
    }
}

extern "C" cudaError_t cuda_qdequant(const struct cuda_qmat *w, int r0, int nr, uint16_t *out, cudaStream_t st)
{
    if (nr <= 0) return cudaSuccess;
    if ((w->bits != 4 && w->bits != 8) || r0 < 0 || r0 + nr > w->rows || (w->n_groups > 1 && w->group % 8))
        return cudaErrorInvalidValue;
    qparams p = qparams_of(w);
    size_t n = (size_t)nr * ((w->cols + 7) / 8);
    unsigned blocks = (unsigned)((n + 255) / 256);
    if (w->bits == 4) dequant_kernel<4><<<blocks, 256, 0, st>>>(p, r0, nr, out);
    else dequant_kernel<8><<<blocks, 256, 0, st>>>(p, r0, nr, out);
    return cudaGetLastError();
}

extern "C" cublasStatus_t cuda_qgemm(const struct cuda_qmat *w, const uint16_t *x, void *y, bool yf32, int ldy, int T,
                                     const struct cuda_qgemm_ws *ws, cublasHandle_t blas, cudaStream_t st)
{
    if (T <= 0) return CUBLAS_STATUS_SUCCESS;
    /* the GEMV up to 8 rows of x, and on the tensor-core kernel up to
     * QMMA_MAX_T (int4: QMMA_MAX_T4) where an act-order weight's gathered x fits the workspace */
    bool gemv = T <= CUDA_QGEMV_MAX_T ||
                (mma_ok(w) && T <= (w->bits == 4 ? QMMA_MAX_T4 : QMMA_MAX_T) &&
                 (!w->perm || (ws && ws->xperm_elems >= (size_t)T * w->cols)));
    if (gemv) {
        const uint16_t *xx = x;
        if (w->perm) {
            size_t n = (size_t)T * w->cols;
            if (!ws || !ws->xperm || ws->xperm_elems < n) return CUBLAS_STATUS_INVALID_VALUE;
            gather_kernel<<<(unsigned)((n + 255) / 256), 256, 0, st>>>(x, w->perm, T, w->cols, ws->xperm);
            if (cudaGetLastError() != cudaSuccess) return CUBLAS_STATUS_EXECUTION_FAILED;
            xx = ws->xperm;
        }
        return cuda_qgemv(w, xx, y, yf32, ldy, T, st) == cudaSuccess ? CUBLAS_STATUS_SUCCESS
                                                                     : CUBLAS_STATUS_EXECUTION_FAILED;
    }
    if (!ws || !ws->deq) return CUBLAS_STATUS_INVALID_VALUE;
    int tile = (int)(ws->deq_bytes / ((size_t)w->cols * 2));
    if (tile > w->rows) tile = w->rows;
    if (tile < 1) return CUBLAS_STATUS_INVALID_VALUE;
    const float one = 1.0f, zero = 0.0f;
    for (int r = 0; r < w->rows; r += tile) {
        int n = w->rows - r < tile ? w->rows - r : tile;
        if (cuda_qdequant(w, r, n, ws->deq, st) != cudaSuccess) return CUBLAS_STATUS_EXECUTION_FAILED;
        void *yr = yf32 ? (void *)((float *)y + r) : (void *)((uint16_t *)y + r);
        cublasStatus_t s = cublasGemmEx(blas, CUBLAS_OP_T, CUBLAS_OP_N, n, T, w->cols, &one, ws->deq, CUDA_R_16BF,
                                        w->cols, x, CUDA_R_16BF, w->cols, &zero, yr, yf32 ? CUDA_R_32F : CUDA_R_16BF,
                                        ldy, CUBLAS_COMPUTE_32F, CUBLAS_GEMM_DEFAULT);
        if (s != CUBLAS_STATUS_SUCCESS) return s;
    }
    return CUBLAS_STATUS_SUCCESS;
}

extern "C" cublasStatus_t cuda_qgemm_swiglu(const struct cuda_qmat *w, const uint16_t *x, uint16_t *h, uint16_t *gu,
                                            int T, const struct cuda_qgemm_ws *ws, cublasHandle_t blas,
                                            cudaStream_t st)
{
    if (T <= 0) return CUBLAS_STATUS_SUCCESS;
    if (w->rows % 2) return CUBLAS_STATUS_INVALID_VALUE;
    const int F = w->rows / 2;
    if (mma_ok(w) && T >= CUDA_QGEMM_SWIGLU_MIN_T && T <= CUDA_QGEMM_SWIGLU_MAX_T &&
        (!w->perm || (ws && ws->xperm && ws->xperm_elems >= (size_t)T * w->cols))) {
        const uint16_t *xx = x;
        if (w->perm) {
            size_t n = (size_t)T * w->cols;
            gather_kernel<<<(unsigned)((n + 255) / 256), 256, 0, st>>>(x, w->perm, T, w->cols, ws->xperm);
            if (cudaGetLastError() != cudaSuccess) return CUBLAS_STATUS_EXECUTION_FAILED;
            xx = ws->xperm;
        }
        qparams p = qparams_of(w);
        p.x = xx, p.y = h, p.ldy = F, p.T = T, p.F = F;
        cudaError_t e = w->bits == 4 ? launch_mma<4, 2, true>(p, st) : launch_mma<8, 2, true>(p, st);
        return e == cudaSuccess ? CUBLAS_STATUS_SUCCESS : CUBLAS_STATUS_EXECUTION_FAILED;
    }
    cublasStatus_t s = cuda_qgemm(w, x, gu, false, 2 * F, T, ws, blas, st);
    if (s != CUBLAS_STATUS_SUCCESS) return s;
    return cuda_swiglu(gu, T, F, h, st) == cudaSuccess ? CUBLAS_STATUS_SUCCESS : CUBLAS_STATUS_EXECUTION_FAILED;
}

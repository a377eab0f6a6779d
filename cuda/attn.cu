/* attn.cu - paged attention for mixed batches (kernels.h).
 *
 * Work comes as items (struct cuda_attn_item) built on the host per step:
 * a tile of consecutive query tokens of one sequence (query rows = tokens x
 * the heads of one KV group) against a range of its key positions. Prefill
 * chunks get one item per tile over their cached prefix plus their causal
 * part; short steps over long contexts (decode) split the key range over
 * several items (split-K), whose partials the combine kernel merges, so one
 * long sequence still fills the GPU. Three kernels take the same items, and
 * cuda_attention() picks by the step's max_rows (and split tickets):
 *
 *   decode-only steps whose args carry split tickets (cnt), max_rows == grp
 *     <= 8, D 64 or 128: the decode kernel (below, before the tensor-core
 *     one), which merges its own splits: no combine launch.
 *
 *   max_rows <= CUDA_ATTN_ROWS (32): the SIMT kernel. A block (4 warps) stages
 *     the tile's queries in shared memory, then walks the key range 32
 *     positions at a time through the block table, staging K and V as f32,
 *     with an online softmax per row (FlashAttention's recurrence, on the
 *     CUDA cores). Any head_dim % 8 == 0 up to 256. Shared memory: Q [4, 8 or
 *     32 rows][D] + K, V [32][D + 1] f32 (padded: conflict-free column reads).
 *
 *   CUDA_ATTN_ROWS < max_rows <= CUDA_ATTN_TC_ROWS (128): the tensor-core
 *     kernel (FlashAttention-2 on mma.sync m16n8k16 bf16, f32 accumulate),
 *     for prefill tiles; only where cuda_attention_tc_ok(D, grp) (D 64 or 128).
 *     A block of 4 warps (max_rows <= 64) or 8 warps (<= 128) gives each warp
 *     16 query rows; Q is loaded once into registers (A fragments). Keys go
 *     64 at a time: K and V rows are gathered through the block table with
 *     cp.async (16 bytes, zero-filled past the range) into bf16 shared memory
 *     rows padded by 16 bytes (ldmatrix reads 8 rows at 16-byte-distinct
 *     banks), double-buffered so the next tile's gather overlaps this tile's
 *     math. S = Q K^T (ldmatrix for K), causal/range mask only on tiles that
 *     need it, online softmax in f32 registers (exp2, scale folded in), P
 *     rounded to bf16 as the A operand of O += P V (ldmatrix.trans for V).
 *     A warp skips the math of key tiles entirely after its rows' positions.
 *     Output as bf16 O / l, or the same f32 partials (max, sum, acc) as the
 *     SIMT kernel when the item is split, so the combine kernel serves both.
 *     Shared memory: 2 stages x (K, V) x [64][D + 8] bf16 (68 KB at D 128,
 *     36 KB at D 64); Q is staged through the second stage before the loop.
 *     Blocks take items last first: a prefill's last tiles see the most keys,
 *     so starting them first shortens the tail. On compute capability 9.0
 *     the 128-row items at D 128 go to attn_wg.cu's kernel instead
 *     (warpgroup MMA, bulk tensor copies; with the fp8 cache too). The same
 *     kernel takes values narrower than the keys (args.Dv, bf16 caches: MLA's
 *     expanded heads, keys 192 and values 128, cuda/mla.h): V rows of their
 *     own width in each stage, and where 128 query rows of the wider keys do
 *     not fit one stage, Q is staged over both before the first tile loads.
 *
 * The fp8 KV cache (args.kv8, --kv-cache-dtype fp8): K and V are e4m3 bytes
 * (scale 1), every value of which is exactly a bf16 and an f16 value, so each
 * kernel computes as it does over a bf16 cache of the same values. The SIMT
 * kernel widens 8 bytes at a time as it stages K and V. The prefill kernel's
 * cp.async copies land packed at the end of each stage and are widened to
 * the bf16 rows in place (kv8_widen); attn_wg.cu's kernel widens its stages
 * to f16 and runs f16 MMAs. The decode kernel reads the e4m3 rows straight
 * into f16 mma fragments, two stages per warp (dec_tile).
 */
#include <stdlib.h>
#include <string.h>

#include "cuda/bf16.cuh"
#include "cuda/kernels.h"
#include "cuda/rope.cuh"
#include "cuda/pdl.cuh"
#include "cuda/tile.cuh"

#define KT 32
#define WARPS 4
/* RPW: query rows per warp, so an item holds at most WARPS * RPW rows: 8 for
 * prefill tiles (32 rows), 1 or 2 for decode (one token's group of heads),
 * so a decode item computes no dead rows. */
template <int DPL, int RPW, bool KV8>
static __global__ void __launch_bounds__(32 * WARPS) attn_kernel(struct cuda_attn_args a)
{
    extern __shared__ float smem[];
    struct cuda_attn_item wi;
    if (!attn_item(a, false, wi)) return;
    int g = blockIdx.y, D = a.D, grp = a.H / a.KVH, bs = a.block_size;
    int lane = threadIdx.x & 31, w = threadIdx.x >> 5;
    int nrows = wi.nq * grp;
    /* Q holds only the rows this instance can have: decode blocks stay small,
     * so more of them fit on an SM */
    float *Qs = smem, *Ks = Qs + WARPS * RPW * D, *Vs = Ks + KT * (D + 1);
    const int32_t *bt = a.bt + wi.bt0;

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
                if constexpr (KV8) {
                    e4m3x8_to_f(*(const uint2 *)((const uint8_t *)a.kc + off), kf);
                    e4m3x8_to_f(*(const uint2 *)((const uint8_t *)a.vc + off), vf);
                } else {
                    uint4 kr = *(const uint4 *)((const uint16_t *)a.kc + off);
                    uint4 vr = *(const uint4 *)((const uint16_t *)a.vc + off);
                    const uint16_t *kh = (const uint16_t *)&kr, *vh = (const uint16_t *)&vr;
#pragma unroll
                    for (int e = 0; e < 8; e++) kf[e] = bf2f(kh[e]), vf[e] = bf2f(vh[e]);
                }
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
            int ps = a.pstride > 0 ? a.pstride : CUDA_ATTN_MAXSPLIT;
            float *pp = a.part + (((size_t)(wi.part + r) * a.KVH + g) * ps + wi.split) * (D + 2);
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
    /* D: the partials' value width; Do: the output's (the first Do of them) */
    int grp = a.H / a.KVH, D = a.Dv > 0 ? a.Dv : a.D, Do = a.Do > 0 ? a.Do : D,
        ps = a.pstride > 0 ? a.pstride : CUDA_ATTN_MAXSPLIT;
    const float *pp = a.part + ((size_t)(base + h % grp) * a.KVH + h / grp) * ps * (D + 2);
    float ms = lane < ns ? pp[lane * (D + 2)] : -INFINITY;
    float ls = lane < ns ? pp[lane * (D + 2) + 1] : 0.0f;
    float M = warp_max(ms);
    float wgt = ms == -INFINITY ? 0.0f : __expf(ms - M);
    float L = warp_sum(ls * wgt);
    float inv = L > 0.0f ? 1.0f / L : 0.0f;
    for (int d = lane; d < Do; d += 32) {
        float o = 0.0f;
#pragma unroll 8
        for (int s = 0; s < ns; s++) o += pp[s * (D + 2) + 2 + d] * __shfl_sync(0xffffffffu, wgt, s);
        a.out[((size_t)t * a.H + h) * Do + d] = f2bf(o * inv);
    }
}


/* ---- tensor-core helpers (the decode and prefill kernels) ---- */

#define TC_BN 64 /* keys per tile */

static __device__ __forceinline__ void ldsm_x4(uint32_t addr, uint32_t r[4])
{
    asm volatile("ldmatrix.sync.aligned.m8n8.x4.shared.b16 {%0, %1, %2, %3}, [%4];\n"
                 : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3])
                 : "r"(addr)
                 : "memory");
}
static __device__ __forceinline__ void ldsm_x4_t(uint32_t addr, uint32_t r[4])
{
    asm volatile("ldmatrix.sync.aligned.m8n8.x4.trans.shared.b16 {%0, %1, %2, %3}, [%4];\n"
                 : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3])
                 : "r"(addr)
                 : "memory");
}
/* c += a (16x16 row-major bf16) * b (16x8 col-major bf16), f32 accumulate */
static __device__ __forceinline__ void mma_bf16(float c[4], const uint32_t a[4], uint32_t b0, uint32_t b1)
{
    asm("mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32 {%0, %1, %2, %3}, {%4, %5, %6, %7}, {%8, %9}, "
        "{%0, %1, %2, %3};\n"
        : "+f"(c[0]), "+f"(c[1]), "+f"(c[2]), "+f"(c[3])
        : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b0), "r"(b1));
}
/* fp8 KV (args.kv8) in the prefill kernel: a tile's K and V rows (ROWS: K rows, then V
 * rows) arrive by cp.async as D bytes each at byte kv8_off of their stage,
 * past the bf16 rows [ROWS][D + 8] the math reads, and are widened into those
 * rows in place, in row order. A bf16 row r ends at byte 2r(D + 8) + 2D,
 * never past the first fp8 byte of row r + 1 (kv8_off + (r + 1) D), so
 * widening any leading run of chunks overwrites only bytes already read. */
template <int D, int ROWS>
static __host__ __device__ constexpr int kv8_off(void)
{
    return ROWS * (D + 8) * 2 - ROWS * D;
}
/* The widening, by the block's NTHR threads, in rounds: every thread reads
 * its chunks of the round, all synchronize, then write them as bf16; ends
 * synchronized. */
template <int D, int ROWS, int NTHR>
static __device__ __forceinline__ void kv8_widen(uint16_t *stage)
{
    constexpr int CPR = D / 16, PER = ROWS * CPR / NTHR, RC = PER < 4 ? PER : 4;
    static_assert(ROWS * CPR % NTHR == 0 && PER % RC == 0, "chunks split evenly");
    const uint8_t *src = (const uint8_t *)stage + kv8_off<D, ROWS>();
    const int tid = threadIdx.x;
#pragma unroll
    for (int r0 = 0; r0 < PER; r0 += RC) {
        uint4 v[RC];
#pragma unroll
        for (int k = 0; k < RC; k++) v[k] = *(const uint4 *)(src + (size_t)((r0 + k) * NTHR + tid) * 16);
        __syncthreads();
#pragma unroll
        for (int k = 0; k < RC; k++) {
            int c = (r0 + k) * NTHR + tid, row = c / CPR, col = c % CPR * 16;
            const uint16_t *h = (const uint16_t *)&v[k];
            uint4 lo = make_uint4(e4m3x2_to_bf2(h[0]), e4m3x2_to_bf2(h[1]), e4m3x2_to_bf2(h[2]), e4m3x2_to_bf2(h[3]));
            uint4 hi = make_uint4(e4m3x2_to_bf2(h[4]), e4m3x2_to_bf2(h[5]), e4m3x2_to_bf2(h[6]), e4m3x2_to_bf2(h[7]));
            *(uint4 *)(stage + row * (D + 8) + col) = lo;
            *(uint4 *)(stage + row * (D + 8) + col + 8) = hi;
        }
        __syncthreads();
    }
}

/* S = Q K^T for a tile of 8 NT keys staged at kb ([keys][DP] bf16), Q's A
 * fragments qf over KC 16-dim chunks; kofs: this lane's ldmatrix offset */
template <int NT, int KC, int DP>
static __device__ __forceinline__ void tile_scores(float (&s)[NT][4], const uint32_t (&qf)[KC][4], uint32_t kb,
                                                   int kofs)
{
#pragma unroll
    for (int nt = 0; nt < NT; nt++) s[nt][0] = s[nt][1] = s[nt][2] = s[nt][3] = 0.0f;
#pragma unroll
    for (int kc = 0; kc < KC; kc++)
#pragma unroll
        for (int np = 0; np < NT / 2; np++) {
            uint32_t b[4];
            ldsm_x4(kb + (kofs + np * 16 * DP + kc * 16) * 2, b);
            mma_bf16(s[2 * np], qf[kc], b[0], b[1]);
            mma_bf16(s[2 * np + 1], qf[kc], b[2], b[3]);
        }
}

/* O += P V for the tile's V staged at vb: S's C fragments of key tiles 2kk,
 * 2kk + 1 (now P) are P's A fragment (LO: rows 8-15 are zero rows, their P
 * is 0); vofs: this lane's ldmatrix offset */
template <int NT, int DT, int DP, bool LO>
static __device__ __forceinline__ void tile_pv(float (&o)[DT][4], const float (&s)[NT][4], uint32_t vb, int vofs)
{
#pragma unroll
    for (int kk = 0; kk < NT / 2; kk++) {
        uint32_t pa[4] = {pack_bf2(s[2 * kk][0], s[2 * kk][1]), LO ? 0u : pack_bf2(s[2 * kk][2], s[2 * kk][3]),
                          pack_bf2(s[2 * kk + 1][0], s[2 * kk + 1][1]),
                          LO ? 0u : pack_bf2(s[2 * kk + 1][2], s[2 * kk + 1][3])};
#pragma unroll
        for (int dp = 0; dp < DT / 2; dp++) {
            uint32_t b[4];
            ldsm_x4_t(vb + (vofs + kk * 16 * DP + dp * 16) * 2, b);
            mma_bf16(o[2 * dp], pa, b[0], b[1]);
            mma_bf16(o[2 * dp + 1], pa, b[2], b[3]);
        }
    }
}

/* The fp8 decode tile (dec_tile<D, true>): e4m3 rows of RSB bytes read
 * straight into f16 mma fragments (e4m3 -> f16 is exact; q and P are f16
 * here, the accumulators f32). */
static __device__ __forceinline__ void mma_f16(float c[4], const uint32_t a[4], uint32_t b0, uint32_t b1)
{
    asm("mma.sync.aligned.m16n8k16.row.col.f32.f16.f16.f32 {%0, %1, %2, %3}, {%4, %5, %6, %7}, {%8, %9}, "
        "{%0, %1, %2, %3};\n"
        : "+f"(c[0]), "+f"(c[1]), "+f"(c[2]), "+f"(c[3])
        : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b0), "r"(b1));
}
/* The fp8 tiles are read in a permuted order, so that each lane's bytes of a
 * K or V row are contiguous (a 16-byte shared-memory load or two per row,
 * not one load per byte pair): in S = q K^T, reduction index kk of chunk kc
 * is dim dec8_kdim(kc, kk) (q's A fragments use the same order, dec8_qfrag),
 * and in O += P V, column n of output tile dt is dim n DT + dt
 * (dec8_col). Sums over dims then run in another order than the bf16
 * tile's; every product is the same. */
static __host__ __device__ constexpr int dec8_kdim(int KC, int kc, int kk)
{
    return kk % 8 / 2 * 4 * KC + kc * 4 + kk / 8 * 2 + kk % 2;
}
static __host__ __device__ constexpr int dec8_col(int DT, int dt, int n) { return n * DT + dt; }
/* N bytes at p (16-byte aligned) as N / 4 words */
template <int N>
static __device__ __forceinline__ void lds_words(const uint8_t *p, uint32_t (&w)[N / 4])
{
    if constexpr (N % 16 == 0) {
#pragma unroll
        for (int i = 0; i < N / 16; i++) {
            uint4 v = ((const uint4 *)p)[i];
            w[4 * i] = v.x, w[4 * i + 1] = v.y, w[4 * i + 2] = v.z, w[4 * i + 3] = v.w;
        }
    } else {
        static_assert(N == 8, "8 or a multiple of 16 bytes");
        uint2 v = *(const uint2 *)p;
        w[0] = v.x, w[1] = v.y;
    }
}
/* The decode kernel's q A fragments from the bf16 rows q [grp][D] (heads as
 * rows; rows past grp, and rows 8-15, zero): bf16 in mma order, or (KV8) f16
 * in dec8_kdim's order */
template <int KC, bool KV8>
static __device__ __forceinline__ void dec_qfrag(uint32_t (&qf)[KC][4], const uint16_t *q, int grp)
{
    const int lane = threadIdx.x & 31, gq = lane >> 2, tq = lane & 3;
    const bool ok = gq < grp;
#pragma unroll
    for (int kc = 0; kc < KC; kc++) {
        const uint16_t *r = q + gq * 16 * KC + (KV8 ? dec8_kdim(KC, kc, 2 * tq) : kc * 16 + 2 * tq);
        if constexpr (KV8) {
            qf[kc][0] = ok ? pack_h2(bf2f(r[0]), bf2f(r[1])) : 0u;
            qf[kc][2] = ok ? pack_h2(bf2f(r[2]), bf2f(r[3])) : 0u;
        } else {
            qf[kc][0] = ok ? *(const uint32_t *)r : 0u;
            qf[kc][2] = ok ? *(const uint32_t *)(r + 8) : 0u;
        }
        qf[kc][1] = qf[kc][3] = 0u;
    }
}
/* S = q K^T over the tile's K rows at ks: lane (gq, tq) reads 4 KC bytes of
 * key row gq at dec8_kdim(KC, 0, 2tq); word kc holds the B fragment's two
 * pairs */
template <int NT, int KC, int RSB, bool SW>
static __device__ __forceinline__ void tile_scores8(float (&s)[NT][4], const uint32_t (&qf)[KC][4], const uint8_t *ks)
{
    const int lane = threadIdx.x & 31, gq = lane >> 2, tq = lane & 3;
    const uint8_t *kr = ks + gq * RSB + (SW ? 0 : dec8_kdim(KC, 0, 2 * tq));
#pragma unroll
    for (int nt = 0; nt < NT; nt++) {
        uint32_t w[KC];
        if constexpr (SW) { /* D 128: chunks 2tq and 2tq + 1 of key row 8 nt + gq, swizzled by gq */
            static_assert(KC == 8, "SW is D 128");
            uint4 u0 = *(const uint4 *)(kr + nt * 8 * RSB + ((2 * tq) ^ gq) * 16),
                  u1 = *(const uint4 *)(kr + nt * 8 * RSB + ((2 * tq + 1) ^ gq) * 16);
            w[0] = u0.x, w[1] = u0.y, w[2] = u0.z, w[3] = u0.w, w[4] = u1.x, w[5] = u1.y, w[6] = u1.z, w[7] = u1.w;
        } else {
            lds_words<4 * KC>(kr + nt * 8 * RSB, w);
        }
        s[nt][0] = s[nt][1] = s[nt][2] = s[nt][3] = 0.0f;
#pragma unroll
        for (int kc = 0; kc < KC; kc++)
            mma_f16(s[nt], qf[kc], e4m3x2_to_h2((uint16_t)w[kc]), e4m3x2_to_h2((uint16_t)(w[kc] >> 16)));
    }
}
/* O += P V over the tile's V rows at vs: lane (gq, tq) reads DT bytes at
 * dim gq DT of key rows 2tq, 2tq + 1, 2tq + 8, 2tq + 9; byte dt of two rows
 * is one B fragment pair; P's A fragment as in tile_pv (rows 8-15 zero) */
template <int NT, int DT, int RSB, bool SW>
static __device__ __forceinline__ void tile_pv8(float (&o)[DT][4], const float (&s)[NT][4], const uint8_t *vs)
{
    const int lane = threadIdx.x & 31, gq = lane >> 2, tq = lane & 3;
    /* SW (D 128): the lane's chunk gq of rows 2tq (+8) and 2tq + 1 (+9), swizzled by those rows */
    const uint8_t *vr = vs + tq * 2 * RSB + (SW ? 0 : dec8_col(DT, 0, gq));
    const int s0 = SW ? (gq ^ (2 * tq)) * 16 : 0, s1 = SW ? (gq ^ (2 * tq + 1)) * 16 : 0;
#pragma unroll
    for (int kk = 0; kk < NT / 2; kk++) {
        uint32_t pa[4] = {pack_h2(s[2 * kk][0], s[2 * kk][1]), 0u, pack_h2(s[2 * kk + 1][0], s[2 * kk + 1][1]), 0u};
        const uint8_t *p = vr + kk * 16 * RSB;
        uint32_t r0[DT / 4], r1[DT / 4], r8[DT / 4], r9[DT / 4];
        lds_words<DT>(p + s0, r0), lds_words<DT>(p + RSB + s1, r1), lds_words<DT>(p + 8 * RSB + s0, r8);
        lds_words<DT>(p + 9 * RSB + s1, r9);
#pragma unroll
        for (int dt = 0; dt < DT; dt++) {
            const unsigned sel = (dt % 4) | (dt % 4 + 4) << 4;
            uint16_t b0 = (uint16_t)__byte_perm(r0[dt / 4], r1[dt / 4], sel);
            uint16_t b1 = (uint16_t)__byte_perm(r8[dt / 4], r9[dt / 4], sel);
            mma_f16(o[dt], pa, e4m3x2_to_h2(b0), e4m3x2_to_h2(b1));
        }
    }
}

/* ---- decode kernel ------------------------------------------------------------
 *
 * Decode-only steps (one query token per item, its grp <= 8 heads; D 64 or
 * 128) where args carry split tickets (cnt). A block of DEC_NW warps takes one
 * item: each warp walks its own 32-key tiles of the item's range (tile w,
 * w + DEC_NW, ...) with no block barrier inside the loop. Each warp copies
 * its tile's K and V rows into its own shared-memory stage with cp.async
 * (the next tile's requested before this one is used), then S^T = q K^T and
 * O += P V by mma.m16n8k16 with the group's heads as the rows, P rounded to
 * bf16 as in the prefill kernel, and an online softmax in the exp2 domain.
 * (The same math in SIMT, q broadcast from shared memory and P passed round
 * the warp, was slower: batch 1 / 8 / 64 / 256 at 206.4 / 1246 / 8245 /
 * 19185 tok/s against 217.5 / 1478 / 10260 / 23493 on the tensor cores,
 * Llama-8B shape on the H200.)
 * The warps' states merge in shared memory in warp order. A split item
 * stores (max, sum, acc) partials (log2 domain) and takes a ticket; the last
 * of the token's splits to finish merges all of them in split order and
 * writes the output, then resets the ticket to 0: no combine launch, and the
 * result does not depend on which split finished last. */
#define DEC_NW 4
/* The warp tile: BN keys; a warp stages its tile's K
 * rows then V rows, RSB bytes each: [BN][D + 8] bf16 (ldmatrix reads it), or
 * with the fp8 cache [D + 16] bytes ([D] at D 128, SW below) read straight
 * into f16 mma fragments (no widening pass), in two stages per warp (at most
 * the bytes of one bf16 stage):
 * the next tile is requested before this one is used, so a warp keeps a tile
 * in flight while it computes. SB: a warp's stages. Each warp's state goes
 * into its own stages once its last tile is read, and q's fragments come
 * straight from Qb, so a block's dynamic shared memory is DEC_NW x SB alone
 * (three blocks an SM at D 128, not two). fp8 rows at D 128 carry no
 * padding (SW: 16-byte chunk c of row j sits at chunk c ^ (j & 7), so the
 * fragment loads below meet no bank conflicts). */
template <int D, bool KV8>
struct dec_tile {
    static constexpr bool SW = KV8 && D == 128;
    static constexpr int BN = 32, RSB = KV8 ? (SW ? D : D + 16) : (D + 8) * 2, NST = KV8 ? 2 : 1,
                         SB = NST * 2 * BN * RSB;
};
template <int D, int GM, bool KV8>
static constexpr size_t dec_tc_smem(void)
{
    static_assert(GM * D * 4 <= dec_tile<D, KV8>::SB, "a warp's state fits its stages");
    return (size_t)DEC_NW * dec_tile<D, KV8>::SB;
}

/* One warp's keys [k0, k0 + BN) of head group g into its stage st (K rows,
 * then V rows, as dec_tile says), zeros past hi, key `skip`'s rows not
 * requested at all (the caller writes them); committed, not waited for.
 * Lane l looks up the slots of keys k0 + l, k0 + 32 + l, ... */
template <int D, bool KV8>
static __device__ __forceinline__ void dec_load_kv(const struct cuda_attn_args &a, const int32_t *bt, int g, int k0,
                                                   int hi, uint8_t *st, int skip = -1)
{
    using TL = dec_tile<D, KV8>;
    constexpr int ES = KV8 ? 1 : 2, CH = D * ES / 16, NS = TL::BN / 32; /* 16-byte chunks per row, slots per lane */
    static_assert(32 % CH == 0, "a round of chunks stays within one slot group");
    const uint8_t *kc = (const uint8_t *)a.kc, *vc = (const uint8_t *)a.vc;
    int lane = threadIdx.x & 31, bs = a.block_size;
    long long slot[NS];
#pragma unroll
    for (int k = 0; k < NS; k++) {
        int kp = k0 + 32 * k + lane;
        slot[k] = kp == skip ? -2 : kp < hi ? (long long)bt[kp / bs] * bs + kp % bs : -1;
    }
#pragma unroll
    for (int u = 0; u < TL::BN * CH / 32; u++) {
        int i = u * 32 + lane, j = i / CH, c = i % CH;
        long long sj = __shfl_sync(0xffffffffu, slot[u * 32 / CH / 32], j & 31);
        size_t off = sj >= 0 ? ((size_t)sj * a.KVH + g) * D * ES + c * 16 : 0;
        int cs = TL::SW ? c ^ (j & 7) : c; /* (TL::BN + j) & 7 == j & 7 */
        if (sj == -2) continue; /* key skip: left to the caller */
        cp_async16(smem_u32(st + j * TL::RSB + cs * 16), kc + off, sj >= 0);
        cp_async16(smem_u32(st + (TL::BN + j) * TL::RSB + cs * 16), vc + off, sj >= 0);
    }
    cp_async_commit();
}

template <int D, int GM, bool KV8, bool MREG = false>
static __device__ __forceinline__ void attn_dec_body(const struct cuda_attn_args &a)
{
    constexpr int DP = D + 8;
    __shared__ float Wm[DEC_NW][GM], Wl[DEC_NW][GM];
    __shared__ int last;
    extern __shared__ __align__(16) uint16_t dsm[]; /* dec_tc_smem's layout */
    struct cuda_attn_item wi;
    if (!attn_item(a, false, wi)) {
        /* an idle block (the grid is sized for the graph's longest step)
         * of the plain build leaves at once: waiting, it held an SM slot
         * that a working block of the next head needed while the qkv GEMV
         * still ran. Block (0, 0) works whenever any does; it waits anyway,
         * so that this kernel's completion implies its predecessors' even
         * with no item. Not in the 3-blocks-an-SM build (MREG), where batch
         * 64 lost 1.1% with this and the early cos/sin below */
        if (MREG || (blockIdx.x == 0 && blockIdx.y == 0)) pdl_wait();
        return;
    }
    int g = blockIdx.y, grp = a.H / a.KVH, KVH = a.KVH;
    int lane = threadIdx.x & 31, w = threadIdx.x >> 5, t = wi.t0;
    const int32_t *bt = a.bt + wi.bt0;
    const float qscale = a.scale * 1.4426950408889634f; /* log2(e): exp2 below */
    using TL = dec_tile<D, KV8>;
    uint8_t *stage = (uint8_t *)dsm + (size_t)w * TL::SB;
    /* the warps' states: warp v's [GM][D] at Wa + v * WS, in its own stages */
    constexpr int WS = TL::SB / 4;
    float *const Wa = (float *)dsm;
    int hi = wi.kv_hi < a.pos[t] + 1 ? wi.kv_hi : a.pos[t] + 1;
    /* every warp's first tile is requested before q is ready. In the
     * split that writes the token's K and V (own) the token's row is left
     * out: RoPE below writes it into the stage as well as into the cache
     * (unswizzled stages; with the swizzled fp8 stages own's warps load
     * after the KV write). The split holding the token was the last to
     * finish: batch-1 decode 220.4-220.7 -> 222.4-222.8 tok/s. */
    int tpos = a.pos[t];
    bool own = a.rope.qkv && tpos >= wi.kv_lo && tpos < wi.kv_hi; /* this split writes the token's K and V */
    const bool early = !own || !TL::SW;
    const int wp = (tpos - wi.kv_lo) / TL::BN; /* own: the warp whose first tile holds the token, if < DEC_NW */
    if (early && wi.kv_lo + TL::BN * w < hi)
        dec_load_kv<D, KV8>(a, bt, g, wi.kv_lo + TL::BN * w, hi, stage, own ? tpos : -1);
    /* RoPE's cos and sin at the token's position (tables no kernel
     * writes) before the wait: the q path after it is then one round trip,
     * not two (batch-1 decode +0.3%).
     * The plain build only, as the idle blocks' exit above */
    constexpr int RV = D / 32;
    rope_cs<RV> rcs;
    const bool rvec = !MREG && (D == 128 || D == 64) && a.rope.qkv && ROPE_VEC_OK(a.rope.D, a.rope.rope_dim);
    if (rvec) rope_vec_cs<RV>(a.rope, tpos, rcs);
    pdl_wait(); /* launched early (PDL): q and the KV write wait for the qkv GEMV; the tiles above did not */
    /* q of this block's heads: from the raw projection through RoPE when
     * it is folded in (and the split that holds the token's position writes
     * its K and V, before any warp of this block reads them; no other block
     * does), else from a.q */
    __shared__ __align__(16) uint16_t Qb[GM][D]; /* rope_head writes 8 bytes per lane */
    if (rvec) {
        for (int r = w; r < grp; r += DEC_NW) {
            float x[RV];
            rope_vec_load<RV>(a.rope, t, g * grp + r, x);
            rope_vec_finish_cs<RV>(a.rope, g * grp + r, x, rcs, Qb[r], false);
        }
        if (own && w < 2) { /* as below: K (warp 0) or V (warp 1) into the cache, and into the stage */
            int h = a.H + w * KVH + g;
            float x[RV];
            rope_vec_load<RV>(a.rope, t, h, x);
            size_t off = ((size_t)a.rope.slots[t] * KVH + g) * D * (KV8 ? 1 : 2);
            float xk[RV];
#pragma unroll
            for (int j = 0; j < RV; j++) xk[j] = x[j];
            rope_vec_finish_cs<RV>(a.rope, h, x, rcs, (char *)(w ? a.rope.vc : a.rope.kc) + off, KV8);
            if (early && wp < DEC_NW) {
                int j = tpos - wi.kv_lo - TL::BN * wp;
                rope_vec_finish_cs<RV>(a.rope, h, xk, rcs,
                                       (uint8_t *)dsm + (size_t)wp * TL::SB + (size_t)(w ? TL::BN + j : j) * TL::RSB, KV8);
            }
        }
    } else if (a.rope.qkv) {
        __shared__ float Rv[DEC_NW][D];
        for (int r = w; r < grp; r += DEC_NW) rope_head(a.rope, t, g * grp + r, Rv[w], Qb[r], false);
        if (own && w < 2) {
            size_t off = ((size_t)a.rope.slots[t] * KVH + g) * D * (KV8 ? 1 : 2);
            rope_head(a.rope, t, a.H + w * KVH + g, Rv[w], (char *)(w ? a.rope.vc : a.rope.kc) + off, KV8);
            if (early && wp < DEC_NW) { /* and into warp wp's stage, row j of K (warp 0) or V (warp 1) */
                int j = tpos - wi.kv_lo - TL::BN * wp;
                rope_head(a.rope, t, a.H + w * KVH + g, Rv[w],
                          (uint8_t *)dsm + (size_t)wp * TL::SB + (size_t)(w ? TL::BN + j : j) * TL::RSB, KV8);
            }
        }
    } else {
        for (int i = threadIdx.x; i < grp * D; i += blockDim.x)
            Qb[i / D][i % D] = a.q[((size_t)t * a.H + g * grp + i / D) * D + i % D];
    }
    __syncthreads();
    {
        /* tensor cores (mma.m16n8k16, the fragment layouts of the prefill
         * kernel below): S^T = q K^T with the heads as the 16 rows (rows past
         * grp zero), P in bf16 (f16 with fp8 K and V), O += P V; lane 4 gq +
         * tq owns head gq */
        constexpr int KC = D / 16, DT = D / 8, NT = TL::BN / 8;
        uint32_t qf[KC][4];
        dec_qfrag<KC, KV8>(qf, &Qb[0][0], grp);
        float o[DT][4];
#pragma unroll
        for (int dt = 0; dt < DT; dt++) o[dt][0] = o[dt][1] = o[dt][2] = o[dt][3] = 0.0f;
        float m0 = -INFINITY, l0 = 0.0f;
        const int kofs = ((lane & 7) + ((lane >> 4) << 3)) * DP + ((lane >> 3) & 1) * 8;
        const int vofs = (lane & 15) * DP + (lane >> 4) * 8;
        const uint32_t kb = smem_u32(stage), vb = kb + TL::BN * TL::RSB;
        bool first = early; /* this tile is requested already */
        int cur = 0;       /* its stage */
        for (int k0 = wi.kv_lo + TL::BN * w; k0 < hi; k0 += TL::BN * DEC_NW) {
            uint8_t *st = stage + cur * 2 * TL::BN * TL::RSB;
            if (!first) dec_load_kv<D, KV8>(a, bt, g, k0, hi, st);
            bool pre = TL::NST == 2 && k0 + TL::BN * DEC_NW < hi; /* the next tile, into the other stage */
            if (pre) dec_load_kv<D, KV8>(a, bt, g, k0 + TL::BN * DEC_NW, hi, stage + (cur ^ 1) * 2 * TL::BN * TL::RSB);
            if (pre)
                cp_async_wait<1>();
            else
                cp_async_wait<0>();
            __syncwarp();
            float s[NT][4];
            if constexpr (KV8)
                tile_scores8<NT, KC, TL::RSB, TL::SW>(s, qf, st);
            else
                tile_scores<NT, KC, DP>(s, qf, kb, kofs);
            /* keys past hi (zeros in the stage) out; rows gq + 8 are zero rows */
            float x0 = -INFINITY;
#pragma unroll
            for (int nt = 0; nt < NT; nt++)
#pragma unroll
                for (int e = 0; e < 2; e++) {
                    int kp = k0 + nt * 8 + (lane & 3) * 2 + e;
                    s[nt][e] = kp < hi ? s[nt][e] * qscale : -INFINITY;
                    x0 = fmaxf(x0, s[nt][e]);
                }
            x0 = fmaxf(x0, __shfl_xor_sync(0xffffffffu, x0, 1));
            x0 = fmaxf(x0, __shfl_xor_sync(0xffffffffu, x0, 2));
            float n0 = fmaxf(m0, x0); /* finite: key k0 < hi */
            float c0 = exp2f(m0 - n0);
            m0 = n0;
            l0 *= c0;
#pragma unroll
            for (int dt = 0; dt < DT; dt++) o[dt][0] *= c0, o[dt][1] *= c0;
#pragma unroll
            for (int nt = 0; nt < NT; nt++) {
                s[nt][0] = exp2f(s[nt][0] - n0), s[nt][1] = exp2f(s[nt][1] - n0);
                s[nt][2] = s[nt][3] = 0.0f;
                l0 += s[nt][0] + s[nt][1];
            }
            if constexpr (KV8)
                tile_pv8<NT, DT, TL::RSB, TL::SW>(o, s, st + TL::BN * TL::RSB);
            else
                tile_pv<NT, DT, DP, true>(o, s, vb, vofs);
            __syncwarp(); /* the stage is read: the next tile may overwrite it */
            first = pre;
            cur ^= TL::NST - 1;
        }
        l0 += __shfl_xor_sync(0xffffffffu, l0, 1);
        l0 += __shfl_xor_sync(0xffffffffu, l0, 2);
        int r = lane >> 2, d0 = (lane & 3) * 2;
        if (r < GM) {
            if ((lane & 3) == 0) Wm[w][r] = m0, Wl[w][r] = l0;
#pragma unroll
            for (int dt = 0; dt < DT; dt++) {
                /* fp8: tile_pv8's column order */
                int c0 = KV8 ? dec8_col(DT, dt, d0) : dt * 8 + d0, c1 = KV8 ? dec8_col(DT, dt, d0 + 1) : c0 + 1;
                Wa[w * WS + r * D + c0] = o[dt][0], Wa[w * WS + r * D + c1] = o[dt][1];
            }
        }
    }
    __syncthreads();
    bool split = wi.nsplit > 1;
    for (int i = threadIdx.x; i < grp * D; i += blockDim.x) {
        int r = i / D, d = i % D;
        float M = -INFINITY, L = 0.0f, A = 0.0f;
#pragma unroll
        for (int v = 0; v < DEC_NW; v++) M = fmaxf(M, Wm[v][r]);
        if (M > -INFINITY) {
#pragma unroll
            for (int v = 0; v < DEC_NW; v++) {
                float e = exp2f(Wm[v][r] - M);
                L += Wl[v][r] * e, A += Wa[v * WS + r * D + d] * e;
            }
        }
        if (!split) {
            a.out[((size_t)t * a.H + g * grp + r) * D + d] = f2bf(L > 0.0f ? A / L : 0.0f);
        } else {
            float *pp = a.part + (((size_t)(wi.part + r) * KVH + g) * CUDA_ATTN_MAXSPLIT + wi.split) * (D + 2);
            if (d == 0) pp[0] = M, pp[1] = L;
            pp[2 + d] = A;
        }
    }
    if (!split) return;
    /* the ticket: the block's partials are ordered before it by the barrier
     * and thread 0's fence, and the last block's thread 0 fences again
     * before its barrier (the pattern of cooperative groups' grid sync) */
    __syncthreads();
    if (threadIdx.x == 0) {
        __threadfence();
        last = atomicAdd(&a.cnt[t * KVH + g], 1) == wi.nsplit - 1;
        if (last) __threadfence();
    }
    __syncthreads();
    if (!last) return;
    /* the merge: every split's (max, sum), the weights per row, then each
     * output's accumulators (independent loads) */
    __shared__ float Sw[GM][CUDA_ATTN_MAXSPLIT], Sinv[GM];
    int ns = wi.nsplit;
    const float *pbase = a.part + ((size_t)wi.part * KVH + g) * CUDA_ATTN_MAXSPLIT * (D + 2);
    const size_t prow = (size_t)KVH * CUDA_ATTN_MAXSPLIT * (D + 2); /* from one part row to the next */
    /* MREG, at most KR splits: this thread's accumulators are requested
     * first, with the (max, sum) pairs, into registers: one round of loads,
     * not two. Only in the 3-blocks-an-SM build: decode at 1K context, batch
     * 8 1582-1587 -> 1609-1614 tok/s, batch 64 +0.6%; in the plain build
     * ptxas then gives the kernel 156 registers, not 169, and batch 1 lost
     * 0.5% */
    constexpr int NO = (GM * D + 32 * DEC_NW - 1) / (32 * DEC_NW), KR = 64 / NO;
    const bool reg = MREG && ns <= KR;
    float pa[NO][KR];
    if (reg)
#pragma unroll
        for (int m = 0; m < NO; m++) {
            int i = threadIdx.x + m * 32 * DEC_NW, r = i / D, d = i % D;
#pragma unroll
            for (int k = 0; k < KR; k++)
                pa[m][k] = i < grp * D && k < ns ? __ldcg(pbase + r * prow + 2 + d + k * (D + 2)) : 0.0f;
        }
    /* the plain build, where they fit: the partials it merges copied into
     * its stages (free now) by cp.async (L2 only), one round of loads where
     * the pairs' and the accumulators' took two; registers stay as they were
     * (169), unlike MREG's: batch-1 decode 241.8-242.6 -> 242.6-242.9 tok/s */
    const int pst = (ns * (D + 2) + 3) & ~3; /* floats per row r in the copy */
    const bool msm = !MREG && (size_t)grp * pst * 4 <= (size_t)DEC_NW * dec_tile<D, KV8>::SB;
    const float *ps = (const float *)dsm;
    if (msm) {
        for (int i = threadIdx.x; i < grp * (pst / 4); i += blockDim.x) {
            int r = i / (pst / 4), c = i % (pst / 4);
            cp_async16(smem_u32(dsm + (size_t)(r * pst + 4 * c) * 2), pbase + r * prow + 4 * c, true);
        }
        cp_async_commit();
        cp_async_wait<0>();
        __syncthreads();
    }
    /* each row's split weights by one warp, lane k for split k (ns <=
     * CUDA_ATTN_MAXSPLIT = 32), by shuffles: one barrier, not two, and no
     * serial loop over the splits (batch-1 decode +0.3%, batch 8 +0.5%) */
    static_assert(CUDA_ATTN_MAXSPLIT <= 32, "a lane per split");
    for (int r = w; r < grp; r += DEC_NW) {
        const bool ok = lane < ns;
        float m = -INFINITY, l = 0.0f;
        if (ok && msm)
            m = ps[r * pst + lane * (D + 2)], l = ps[r * pst + lane * (D + 2) + 1];
        else if (ok)
            m = __ldcg(pbase + r * prow + lane * (D + 2)), l = __ldcg(pbase + r * prow + lane * (D + 2) + 1);
        float M = warp_max(m);
        float e = m == -INFINITY ? 0.0f : exp2f(m - M);
        float L = warp_sum(l * e);
        if (ok) Sw[r][lane] = e;
        if (lane == 0) Sinv[r] = L > 0.0f ? 1.0f / L : 0.0f;
    }
    __syncthreads();
    if (reg) {
#pragma unroll
        for (int m = 0; m < NO; m++) {
            int i = threadIdx.x + m * 32 * DEC_NW, r = i / D, d = i % D;
            if (i >= grp * D) continue;
            float A = 0.0f;
#pragma unroll
            for (int k = 0; k < KR; k++)
                if (k < ns) A += pa[m][k] * Sw[r][k];
            a.out[((size_t)t * a.H + g * grp + r) * D + d] = f2bf(A * Sinv[r]);
        }
    } else if (msm) {
        for (int i = threadIdx.x; i < grp * D; i += blockDim.x) {
            int r = i / D, d = i % D;
            const float *pp = ps + r * pst + 2 + d;
            float A = 0.0f;
#pragma unroll 8
            for (int k = 0; k < ns; k++) A += pp[k * (D + 2)] * Sw[r][k];
            a.out[((size_t)t * a.H + g * grp + r) * D + d] = f2bf(A * Sinv[r]);
        }
    } else
    for (int i = threadIdx.x; i < grp * D; i += blockDim.x) {
        int r = i / D, d = i % D;
        const float *pp = pbase + r * prow + 2 + d;
        float A = 0.0f;
#pragma unroll 8
        for (int k = 0; k < ns; k++) A += __ldcg(pp + k * (D + 2)) * Sw[r][k];
        a.out[((size_t)t * a.H + g * grp + r) * D + d] = f2bf(A * Sinv[r]);
    }
    if (threadIdx.x == 0) a.cnt[t * KVH + g] = 0;
}

template <int D, int GM, bool KV8>
static __global__ void __launch_bounds__(32 * DEC_NW) attn_dec_kernel(struct cuda_attn_args a)
{
    attn_dec_body<D, GM, KV8>(a);
}
/* The same held to 3 blocks an SM (at most 168 registers; the plain build
 * takes 169-171 at D 128 with the bf16 cache, so 2 blocks an SM, and runs
 * each block faster). For steps of more blocks than fit 2 an SM
 * (a.dec_wide): decode at 1K context, batch 4 / 8 / 16 / 256 +1.3 / +3.3 /
 * +4.1 / +11.6%; but batch 1 -1.3% and batch 2 -0.7%, hence the 32 token x
 * KV-head pairs a GPU from which the backend takes it */
template <int D, int GM, bool KV8>
static __global__ void __launch_bounds__(32 * DEC_NW, 3) attn_dec_kernel3(struct cuda_attn_args a)
{
    attn_dec_body<D, GM, KV8, true>(a);
}

/* The kernel for args a: GM 4 or 8 and, for a.dec_wide at D 128, the build
 * held to 3 blocks an SM */
template <int D, bool KV8>
static void (*dec_kernel_for(const struct cuda_attn_args *a))(struct cuda_attn_args)
{
    bool g4 = a->H / a->KVH <= 4;
    if constexpr (D == 128)
        if (a->dec_wide) return g4 ? attn_dec_kernel3<D, 4, KV8> : attn_dec_kernel3<D, 8, KV8>;
    return g4 ? attn_dec_kernel<D, 4, KV8> : attn_dec_kernel<D, 8, KV8>;
}

template <int D, bool KV8>
static cudaError_t launch_dec(const struct cuda_attn_args *a, cudaStream_t st)
{
    dim3 grid(a->max_items, a->KVH), blk(32 * DEC_NW);
    bool g4 = a->H / a->KVH <= 4;
    size_t sm = g4 ? dec_tc_smem<D, 4, KV8>() : dec_tc_smem<D, 8, KV8>();
    /* launched early by PDL (its blocks request their first K/V tiles while
     * the qkv GEMV finishes): batch-1 decode 227.9-228.0 -> 231.4 tok/s once
     * the qkv GEMV ran in one wave (before, at 1.45 waves, it did not pay).
     * No early trigger for the next kernel: letting the o projection's GEMV
     * start loading weights while this kernel runs measured slower (batch-1
     * decode 207.3 vs 217.5 tok/s) */
    return pdl_launch_as(true, dec_kernel_for<D, KV8>(a), grid, blk, sm, st, *a);
}

/* ---- tensor-core kernel (prefill tiles) -------------------------------------- */

/* Gathers keys [k0, k0 + TC_BN) of head group g into ks (K, rows of D + 8)
 * and ks + TC_BN * (D + 8) (V, rows of DV + 8), zeros past kv_hi (so masked
 * keys multiply zeros, never stale NaNs). Every thread of the block issues
 * its share; not yet committed. DV != D (MLA's expanded heads) with a bf16
 * cache only. */
template <int D, int DV, int NTHR, bool KV8>
static __device__ __forceinline__ void tc_load_kv(const struct cuda_attn_args &a, const int32_t *bt, int g, int k0,
                                                  int kv_hi, uint16_t *ks)
{
    static_assert(D == DV || !KV8, "fp8 caches have one width");
    int bs = a.block_size;
    if constexpr (D == DV) {
        /* chunks and staged rows as in dec_load_kv (fp8: packed rows at kv8_off) */
        constexpr int EPC = KV8 ? 16 : 8, CH = D / EPC, RS = KV8 ? D : D + 8, ES = KV8 ? 1 : 2;
        static_assert(TC_BN * CH % NTHR == 0, "K/V chunks split evenly over the block");
        uint8_t *st = (uint8_t *)ks + (KV8 ? kv8_off<D, 2 * TC_BN>() : 0);
        const uint8_t *kc = (const uint8_t *)a.kc, *vc = (const uint8_t *)a.vc;
#pragma unroll
        for (int k = 0; k < TC_BN * CH / NTHR; k++) {
            int i = threadIdx.x + k * NTHR, j = i / CH, c = i % CH, kp = k0 + j;
            bool ok = kp < kv_hi;
            size_t off = 0;
            if (ok) {
                int64_t slot = (int64_t)bt[kp / bs] * bs + kp % bs;
                off = (((size_t)slot * a.KVH + g) * D + c * EPC) * ES;
            }
            cp_async16(smem_u32(st + (j * RS + c * EPC) * ES), kc + off, ok);
            cp_async16(smem_u32(st + ((TC_BN + j) * RS + c * EPC) * ES), vc + off, ok);
        }
    } else {
        constexpr int CH = D / 8, CHV = DV / 8, NK = (TC_BN * CH + NTHR - 1) / NTHR,
                      NV = (TC_BN * CHV + NTHR - 1) / NTHR;
        const uint16_t *kc = (const uint16_t *)a.kc, *vc = (const uint16_t *)a.vc;
        uint16_t *vs = ks + TC_BN * (D + 8);
#pragma unroll
        for (int k = 0; k < NK; k++) {
            int i = threadIdx.x + k * NTHR, j = i / CH, c = i % CH, kp = k0 + j;
            if (TC_BN * CH % NTHR && i >= TC_BN * CH) break;
            bool ok = kp < kv_hi;
            size_t off = 0;
            if (ok) off = ((size_t)((int64_t)bt[kp / bs] * bs + kp % bs) * a.KVH + g) * D + c * 8;
            cp_async16(smem_u32(ks + j * (D + 8) + c * 8), kc + off, ok);
        }
#pragma unroll
        for (int k = 0; k < NV; k++) {
            int i = threadIdx.x + k * NTHR, j = i / CHV, c = i % CHV, kp = k0 + j;
            if (TC_BN * CHV % NTHR && i >= TC_BN * CHV) break;
            bool ok = kp < kv_hi;
            size_t off = 0;
            if (ok) off = ((size_t)((int64_t)bt[kp / bs] * bs + kp % bs) * a.KVH + g) * DV + c * 8;
            cp_async16(smem_u32(vs + j * (DV + 8) + c * 8), vc + off, ok);
        }
    }
}

/* One item x one KV head group (blockIdx.y) per block; NW warps of 16 query
 * rows each. Fragment layouts (PTX ISA, mma.m16n8k16): lane = 4 * gq + tq;
 * A regs {(gq, 2tq..+1), (gq+8, 2tq..), (gq, 2tq+8..), (gq+8, 2tq+8..)} (row, k);
 * B regs {(k 2tq..+1, n gq), (k 2tq+8.., n gq)}; C {(gq, 2tq), (gq, 2tq+1),
 * (gq+8, 2tq), (gq+8, 2tq+1)}. So this lane owns query rows w*16 + gq and
 * w*16 + gq + 8, keys 8nt + 2tq..+1 of S and columns 8dt + 2tq..+1 of O. */
/* Blocks per SM the register budget aims at (ptxas -v, sm_90): 4 warps fit
 * 3 blocks (168 registers at D 128, no real spills); 8 warps at D 128 need
 * ~230 registers (a cap of 128 spills), so 1 block; 2 at D 64. */
/* Keys of 192 and values of 128 (MLA's expanded heads): 12 more Q fragment
 * registers than at 128, so a register budget of 2 blocks of 4 warps an SM. */
#define TC_MINB(D, NW) ((D) > 128 ? ((NW) == 4 ? 2 : 1) : (NW) == 4 ? 3 : (D) == 64 ? 2 : 1)
template <int D, int DV, int NW, bool KV8>
static __global__ void __launch_bounds__(32 * NW, TC_MINB(D, NW)) attn_tc_kernel(struct cuda_attn_args a)
{
    constexpr int NTHR = 32 * NW, BM = 16 * NW, DP = D + 8, DVP = DV + 8, CH = D / 8;
    constexpr int NT = TC_BN / 8, KC = D / 16, DT = DV / 8;
    /* Q staged in the second K+V stage while the first tile loads, or, where it does not fit there (keys
     * wider than values), over both stages before the first tile loads */
    constexpr bool QS1 = BM * DP <= TC_BN * (DP + DVP);
    static_assert(BM * DP <= 2 * TC_BN * (DP + DVP), "Q is staged in the K+V stages");
    static_assert(D % 16 == 0 && DV % 16 == 0 && BM * CH % NTHR == 0, "shape");
    extern __shared__ __align__(16) uint16_t tsm[];
    struct cuda_attn_item wi;
    if (!attn_item(a, true, wi)) return;
    int g = blockIdx.y, grp = a.H / a.KVH;
    int lane = threadIdx.x & 31, w = threadIdx.x >> 5;
    int nrows = wi.nq * grp;
    if (nrows <= 0 || nrows > BM) return; /* whole block: wi is uniform */
    const int32_t *bt = a.bt + wi.bt0;
    uint16_t *stg1 = tsm + TC_BN * (DP + DVP); /* stage s at tsm + s * TC_BN * (DP + DVP): K, then V */
    uint16_t *qs = QS1 ? stg1 : tsm;

    /* Q -> stage 1 (rows past nrows zero), K/V tile 0 -> stage 0 (without QS1: after Q is in registers) */
#pragma unroll
    for (int k = 0; k < BM * CH / NTHR; k++) {
        int i = threadIdx.x + k * NTHR, r = i / CH, c = i % CH;
        bool ok = r < nrows;
        const uint16_t *src = a.q;
        if (ok) src = a.q + ((size_t)(wi.t0 + r / grp) * a.H + g * grp + r % grp) * D + c * 8;
        cp_async16(smem_u32(qs + r * DP + c * 8), src, ok);
    }
    cp_async_commit();
    int ntile = wi.kv_hi > wi.kv_lo ? (wi.kv_hi - wi.kv_lo + TC_BN - 1) / TC_BN : 0;
    if (QS1 && ntile > 0) tc_load_kv<D, DV, NTHR, KV8>(a, bt, g, wi.kv_lo, wi.kv_hi, tsm);
    cp_async_commit();
    cp_async_wait<0>();
    __syncthreads();
    uint32_t qf[KC][4];
    {
        uint32_t qb = smem_u32(qs + (w * 16 + (lane & 15)) * DP + (lane >> 4) * 8);
#pragma unroll
        for (int kc = 0; kc < KC; kc++) ldsm_x4(qb + kc * 16 * 2, qf[kc]);
    }
    if constexpr (!QS1) {
        __syncthreads(); /* every warp has its Q: the stages are free */
        if (ntile > 0) tc_load_kv<D, DV, NTHR, KV8>(a, bt, g, wi.kv_lo, wi.kv_hi, tsm);
        cp_async_commit(); /* the loop's first wait leaves only the newest group (none) outstanding */
    }
    /* positions of this lane's two rows; rows past nrows borrow the last
     * row's (their results are dropped), so they never force a mask */
    int r0 = w * 16 + (lane >> 2), r1 = r0 + 8;
    int p0 = a.pos[wi.t0 + min(r0, nrows - 1) / grp], p1 = a.pos[wi.t0 + min(r1, nrows - 1) / grp];
    int wmax = __reduce_max_sync(0xffffffffu, max(p0, p1)), wmin = __reduce_min_sync(0xffffffffu, min(p0, p1));
    if (w * 16 >= nrows) wmax = -1; /* no row of this warp is real: it only helps load */

    float o[DT][4];
#pragma unroll
    for (int dt = 0; dt < DT; dt++) o[dt][0] = o[dt][1] = o[dt][2] = o[dt][3] = 0.0f;
    float m0 = -INFINITY, m1 = -INFINITY, l0 = 0.0f, l1 = 0.0f; /* m in log2 units */
    const float sl2 = a.scale * 1.4426950408889634f;
    /* per-lane ldmatrix offsets (elements) within a K or V tile */
    const int kofs = ((lane & 7) + ((lane >> 4) << 3)) * DP + ((lane >> 3) & 1) * 8;
    const int vofs = (lane & 15) * DVP + (lane >> 4) * 8;
    for (int ti = 0; ti < ntile; ti++) {
        int k0 = wi.kv_lo + ti * TC_BN;
        /* everyone is done with the other stage (last tile's math, or the Q staging) */
        __syncthreads();
        if (ti + 1 < ntile) tc_load_kv<D, DV, NTHR, KV8>(a, bt, g, k0 + TC_BN, wi.kv_hi, (ti & 1) ? tsm : stg1);
        cp_async_commit(); /* maybe empty: keeps "all but the newest group" = this tile */
        cp_async_wait<1>();
        __syncthreads();
        if constexpr (KV8) kv8_widen<D, 2 * TC_BN, NTHR>((ti & 1) ? stg1 : tsm);
        if (k0 > wmax) continue; /* warp-uniform: the whole tile is after this warp's rows */
        const uint32_t kb = smem_u32((ti & 1) ? stg1 : tsm), vb = kb + TC_BN * DP * 2;

        float s[NT][4];
        tile_scores<NT, KC, DP>(s, qf, kb, kofs);
        if (k0 + TC_BN > wi.kv_hi || k0 + TC_BN - 1 > wmin) { /* warp-uniform */
#pragma unroll
            for (int nt = 0; nt < NT; nt++)
#pragma unroll
                for (int e = 0; e < 4; e++) {
                    int kp = k0 + nt * 8 + (lane & 3) * 2 + (e & 1);
                    if (kp >= wi.kv_hi || kp > (e < 2 ? p0 : p1)) s[nt][e] = -INFINITY;
                }
        }
        /* online softmax: a row lives in the 4 lanes of a quad */
        float x0 = -INFINITY, x1 = -INFINITY;
#pragma unroll
        for (int nt = 0; nt < NT; nt++) {
            x0 = fmaxf(x0, fmaxf(s[nt][0], s[nt][1]));
            x1 = fmaxf(x1, fmaxf(s[nt][2], s[nt][3]));
        }
        float u0, u1, c0, c1;
        softmax_step(x0, x1, sl2, m0, m1, l0, l1, u0, u1, c0, c1);
#pragma unroll
        for (int dt = 0; dt < DT; dt++) o[dt][0] *= c0, o[dt][1] *= c0, o[dt][2] *= c1, o[dt][3] *= c1;
#pragma unroll
        for (int nt = 0; nt < NT; nt++) {
            s[nt][0] = ex2(fmaf(s[nt][0], sl2, -u0));
            s[nt][1] = ex2(fmaf(s[nt][1], sl2, -u0));
            s[nt][2] = ex2(fmaf(s[nt][2], sl2, -u1));
            s[nt][3] = ex2(fmaf(s[nt][3], sl2, -u1));
            l0 += s[nt][0] + s[nt][1];
            l1 += s[nt][2] + s[nt][3];
        }
        tile_pv<NT, DT, DVP, false>(o, s, vb, vofs);
    }
    tc_store_rows<DV>(a, wi, g, grp, nrows, r0, l0, l1, m0, m1, [&](int dt, int e) { return o[dt][e]; });
}

/* 2 stages x (K [TC_BN][D + 8], V [TC_BN][DV + 8]) bf16; the same for either block size */
template <int D, int DV = D>
static constexpr int tc_smem(void)
{
    return 2 * TC_BN * (D + 8 + DV + 8) * 2;
}

/* raises k's dynamic shared-memory limit to bytes (set whatever the size:
 * static shared memory counts against the default 48 KB too) */
template <typename K>
static cudaError_t smem_limit(K k, int bytes, cudaError_t e)
{
    if (e != cudaSuccess) return e;
    return cudaFuncSetAttribute(k, cudaFuncAttributeMaxDynamicSharedMemorySize, bytes);
}

template <int DPL, bool KV8>
static cudaError_t set_smem(cudaError_t e)
{
    int need = (CUDA_ATTN_ROWS * 32 * DPL + 2 * KT * (32 * DPL + 1)) * (int)sizeof(float);
    e = smem_limit(attn_kernel<DPL, 1, KV8>, need, e);
    e = smem_limit(attn_kernel<DPL, 2, KV8>, need, e);
    return smem_limit(attn_kernel<DPL, 8, KV8>, need, e);
}

template <int D, bool KV8>
static cudaError_t set_smem_tc(cudaError_t e)
{
    e = smem_limit(attn_tc_kernel<D, D, 4, KV8>, tc_smem<D>(), e);
    e = smem_limit(attn_tc_kernel<D, D, 8, KV8>, tc_smem<D>(), e);
    e = smem_limit(attn_dec_kernel<D, 4, KV8>, (int)dec_tc_smem<D, 4, KV8>(), e);
    e = smem_limit(attn_dec_kernel<D, 8, KV8>, (int)dec_tc_smem<D, 8, KV8>(), e);
    if constexpr (D == 128) {
        e = smem_limit(attn_dec_kernel3<D, 4, KV8>, (int)dec_tc_smem<D, 4, KV8>(), e);
        e = smem_limit(attn_dec_kernel3<D, 8, KV8>, (int)dec_tc_smem<D, 8, KV8>(), e);
    }
    return e;
}

template <int DPL>
static cudaError_t set_smem_both(void)
{
    return set_smem<DPL, true>(set_smem<DPL, false>(cudaSuccess));
}

extern "C" int cuda_attention_tc_ok(int D, int grp)
{
    return (D == 64 || D == 128) && grp >= 1 && grp <= CUDA_ATTN_TC_ROWS;
}

extern "C" cudaError_t cuda_attention_prepare(int D)
{
    cudaError_t e = D <= 32    ? set_smem_both<1>()
                    : D <= 64  ? set_smem_both<2>()
                    : D <= 128 ? set_smem_both<4>()
                               : set_smem_both<8>();
    if (D == 64) e = set_smem_tc<64, true>(set_smem_tc<64, false>(e));
    if (D == 128) e = set_smem_tc<128, true>(set_smem_tc<128, false>(e));
    if (D == 128 && e == cudaSuccess) e = cuda_attention_wg_prepare();
    return e;
}

template <int DPL, bool KV8>
static cudaError_t launch(const struct cuda_attn_args *a, cudaStream_t st)
{
    int qrows = a->max_rows <= WARPS ? WARPS : a->max_rows <= 2 * WARPS ? 2 * WARPS : CUDA_ATTN_ROWS;
    size_t sm = (size_t)(qrows * a->D + 2 * KT * (a->D + 1)) * sizeof(float);
    dim3 grid(a->max_items, a->KVH);
    if (a->max_rows <= WARPS)
        attn_kernel<DPL, 1, KV8><<<grid, 32 * WARPS, sm, st>>>(*a);
    else if (a->max_rows <= 2 * WARPS)
        attn_kernel<DPL, 2, KV8><<<grid, 32 * WARPS, sm, st>>>(*a);
    else
        attn_kernel<DPL, 8, KV8><<<grid, 32 * WARPS, sm, st>>>(*a);
    cudaError_t e = cudaGetLastError();
    if (e != cudaSuccess) return e;
    combine_kernel<<<dim3(a->T, (a->H + 3) / 4), 128, 0, st>>>(*a);
    return cudaGetLastError();
}

template <int D, bool KV8, int DV = D>
static cudaError_t launch_tc(const struct cuda_attn_args *a, cudaStream_t st)
{
    dim3 grid(a->max_items, a->KVH);
    cudaError_t e = cudaSuccess;
    if (D == DV && cuda_attention_wg_ok(a))
        e = cuda_attention_wg(a, st);
    else if (a->max_rows <= 64)
        attn_tc_kernel<D, DV, 4, KV8><<<grid, 128, tc_smem<D, DV>(), st>>>(*a);
    else
        attn_tc_kernel<D, DV, 8, KV8><<<grid, 256, tc_smem<D, DV>(), st>>>(*a);
    if (e == cudaSuccess) e = cudaGetLastError();
    if (e != cudaSuccess) return e;
    combine_kernel<<<dim3(a->T, (a->H + 3) / 4), 128, 0, st>>>(*a);
    return cudaGetLastError();
}

extern "C" int cuda_attention_dec_ok(int D, int grp) { return (D == 64 || D == 128) && grp >= 1 && grp <= 8; }

/* the (keys, values) widths the tensor-core kernel is built for besides equal ones */
static const int tc_pairs[][2] = {{32, 16}, {192, 128}};

extern "C" int cuda_attention_tc_pair(int Dk, int Dv, int *D, int *Dv_pad)
{
    for (size_t i = 0; i < sizeof tc_pairs / sizeof tc_pairs[0]; i++)
        if (Dk > 0 && Dv > 0 && Dk <= tc_pairs[i][0] && Dv <= tc_pairs[i][1]) {
            *D = tc_pairs[i][0], *Dv_pad = tc_pairs[i][1];
            return 1;
        }
    return 0;
}

static bool tc_pair_built(int D, int Dv)
{
    for (size_t i = 0; i < sizeof tc_pairs / sizeof tc_pairs[0]; i++)
        if (D == tc_pairs[i][0] && Dv == tc_pairs[i][1]) return true;
    return false;
}

template <int D, int DV>
static cudaError_t set_smem_pair(void)
{
    cudaError_t e = smem_limit(attn_tc_kernel<D, DV, 4, false>, tc_smem<D, DV>(), cudaSuccess);
    return smem_limit(attn_tc_kernel<D, DV, 8, false>, tc_smem<D, DV>(), e);
}

extern "C" cudaError_t cuda_attention_prepare_pair(int D, int Dv)
{
    if (D == 32 && Dv == 16) return set_smem_pair<32, 16>();
    if (D == 192 && Dv == 128) return set_smem_pair<192, 128>();
    return cudaErrorInvalidValue;
}


/* the kernel for a's step (cuda_attention, below) */
template <bool KV8>
static cudaError_t attention(const struct cuda_attn_args *a, bool dec, cudaStream_t st)
{
    if (dec) return a->D == 64 ? launch_dec<64, KV8>(a, st) : launch_dec<128, KV8>(a, st);
    if (a->Dv > 0 && a->Dv != a->D) { /* checked in cuda_attention: a built pair, bf16, the tensor cores */
        if constexpr (KV8) return cudaErrorInvalidValue;
        else return a->D == 32 ? launch_tc<32, false, 16>(a, st) : launch_tc<192, false, 128>(a, st);
    }
    if (a->max_rows > CUDA_ATTN_ROWS) {
        if (a->max_rows > CUDA_ATTN_TC_ROWS || !cuda_attention_tc_ok(a->D, a->H / a->KVH))
            return cudaErrorInvalidValue;
        return a->D == 64 ? launch_tc<64, KV8>(a, st) : launch_tc<128, KV8>(a, st);
    }
    if (a->H / a->KVH > CUDA_ATTN_ROWS) return cudaErrorInvalidValue;
    if (a->D <= 32) return launch<1, KV8>(a, st);
    if (a->D <= 64) return launch<2, KV8>(a, st);
    if (a->D <= 128) return launch<4, KV8>(a, st);
    return launch<8, KV8>(a, st);
}

extern "C" cudaError_t cuda_attention(const struct cuda_attn_args *a, cudaStream_t st)
{
    if (a->max_items <= 0 || a->T <= 0) return cudaSuccess;
    if (a->D % 8 || a->D > 256 || a->KVH <= 0 || a->H % a->KVH) return cudaErrorInvalidValue;
    if (a->Dv > 0 && a->Dv != a->D &&
        (!tc_pair_built(a->D, a->Dv) || a->kv8 || a->cnt || a->rope.qkv || a->max_rows <= CUDA_ATTN_ROWS ||
         a->max_rows > CUDA_ATTN_TC_ROWS || a->H / a->KVH > a->max_rows || a->Do < 0 || a->Do > a->Dv || a->Do % 2))
        return cudaErrorInvalidValue; /* two widths: the tensor-core kernel's built pairs only */
    if ((a->Do > 0 && a->Do != (a->Dv > 0 ? a->Dv : a->D) && (a->Dv <= 0 || a->Dv == a->D)) || a->Dv < 0)
        return cudaErrorInvalidValue; /* a narrower output only with two widths */
    bool dec = a->cnt && a->max_rows == a->H / a->KVH && cuda_attention_dec_ok(a->D, a->H / a->KVH);
    if (a->pstride < 0 || a->pstride > CUDA_ATTN_MAXSPLIT || (dec && a->pstride && a->pstride != CUDA_ATTN_MAXSPLIT))
        return cudaErrorInvalidValue; /* the decode kernel's partials are strided by MAXSPLIT */
    if (a->rope.qkv && (!dec || a->rope.D != a->D || a->rope.rope_dim > a->D || a->rope.H != a->H ||
                        a->rope.KVH != a->KVH || a->rope.kc != a->kc || a->rope.vc != a->vc ||
                        a->rope.kv8 != a->kv8))
        return cudaErrorInvalidValue; /* only the decode kernel folds RoPE in */
    return a->kv8 ? attention<true>(a, dec, st) : attention<false>(a, dec, st);
}

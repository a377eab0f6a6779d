/* kda_chunk.cu - the KDA delta rule in chunks (kda_chunk.h), three kernels:
 *  - prep, parallel over the step's tokens: the conv + SiLU of q, k, v, the
 *    L2 norms of q and k, into the work buffer;
 *  - one block per (sequence, head, block of value columns) walks the
 *    sequence's chunks in order, each chunk in shared memory as recur_chunked
 *    (model/cpu_kda.c) does it, step for step (expf as there), the matrix
 *    products on the tensor cores:
 *      P1  the chunk's q, k (every channel of the head), v (the block's
 *          columns) and the gate's input, copied asynchronously; sigmoid(b)
 *      P2  the log-decays and the decays, then G, the log-decays' cumulative
 *          sums (a thread a channel)
 *      P3  A[t][s] = beta_t sum_c k_t k_s e^(G_t - G_s) (s < t), P[t][s] the
 *          same with q_t (s <= t): s in t's sub-chunk of 16 directly (every
 *          sub-chunk at once, f32 on the SIMT units, e^(G_t - G_s) the product
 *          of the decays of tokens s+1 .. t as the recurrence has it, where
 *          recur_chunked takes an exp a pair), s before it from per-row
 *          factors (k_s e^(B - G_s), k_t e^(G_t - B), B = G before the
 *          sub-chunk: no exp a pair) as the products Y X^T, a sub-chunk at a
 *          time
 *      P4  q e^G_t, k e^G_t, k e^(G_L - G_t) in place of q, k, G
 *      P5  u = beta (v - (k e^G)^T S0) (a product), then the triangular solve
 *          u_t -= A[t][s] u_s, s in order, a sub-chunk of rows at a time
 *          (against the rows before it a product, then inside it a thread a
 *          column)
 *      P6  o_t = (q e^G)^T S0 + sum_{s <= t} P[t][s] u_s, into o32 (products)
 *      P7  S = e^G_L S0 + sum_t (k_t e^(G_L - G_t)) u_t^T (a product); a
 *          snapshot's S here
 *    The products (kc_mma_block): mma.sync m16n8k8 tf32, a warp a 16 x 16
 *    (P5 to P7) or 16 x 8 (P3, the solve) block of the output, each operand
 *    split hi + lo in tf32 and hi hi + lo hi + hi lo accumulated in f32
 *    (3xTF32: ~f32 accuracy, as the state, carried over a long prompt's
 *    hundreds of chunks, needs; test_kda's long cases), three tensor-core
 *    products for each f32 one, still far fewer cycles than the f32 FMAs
 *    were. The block's S columns stay in shared memory from the first chunk
 *    to the last;
 *  - the gated output norm (parallel over tokens) and the conv tails.
 * Every exponent is <= 0 (a difference of cumulative log-decays later minus
 * earlier, or one of them), so nothing overflows whatever the gate.
 *
 * Shared memory (floats; rows padded so that every fragment load is free of
 * bank conflicts, kc_dp / kc_lp / kc_up): q, k, G [L][D + 4], X [L - 16][D +
 * 4], Y [2][16][D + 4] (before them, the decays [L][D + 4]), S transposed [cols][D + 4], v / u [L][cols + 8], A
 * and P [L][L + 4], beta [L], G_L and e^G_L [D]: at D 128 and L 64, 202 KB at
 * 32 columns, 226.5 KB at 64 (an H100's or H200's 227 KB: the mixer's choice
 * at 64 heads); on sm_89 (99 KB) the longest chunk that fits is 16 at 32
 * columns, 32 at 16 (cuda_kda_chunk_len: the same kernel, the chunk length
 * by the device's shared memory). */
#include <cuda_pipeline.h>

#include "cuda/bf16.cuh"
#include "cuda/kda_chunk.h"

/* threads a block: >= CUDA_KDA_MAX_D (thread c < D owns channel c's cumulative sum); 16 warps, since a chunk
 * block has an SM to itself and its loops are chains of shared-memory reads */
#define KC_THREADS 512
#define KC_WARPS (KC_THREADS / 32)
#define KC_DL ((CUDA_KDA_MAX_D + 31) / 32)                       /* a lane's channels in the prep kernel */
#define KC_SUB 16  /* the sub-chunks of P3 and P5 (model/cpu_kda.c's KDA_SUB) */
#define KC_DC ((CUDA_KDA_MAX_D + 7) / 8) /* a lane's channels in P3's diagonal blocks (8 lanes a row s) */
/* P3's diagonal blocks take a warp per (sub-chunk, 4 rows s): every warp once at the longest chunk */
static_assert(KC_WARPS == (CUDA_KDA_CHUNK_MAX / KC_SUB) * (KC_SUB / 4),
              "P3's diagonal blocks: a warp per (sub-chunk, 4 rows)");
#define KC_TRI (KC_SUB * (KC_SUB + 1) / 2) /* the (t, s <= t) pairs of a sub-chunk */
/* the prep and output kernels' blocks a (sequence, head), its tokens strided over them: 8 x 16 warps keep a
 * 14.6K-token prompt's heads on every SM, and a prefill step's grid spans max_seqs entries, most of them
 * padding, whose blocks only start and stop */
#define KC_OUT_Z 8

static __device__ __forceinline__ float kc_sigm(float x) { return 1.0f / (1.0f + expf(-x)); }

/* Input channel ch (of 3C) of row `row`, the low part added when given (kda.cu's kda_in) */
static __device__ __forceinline__ float kc_in(const struct cuda_kda_args &a, size_t row, size_t ch)
{
    size_t i = row * 3 * (size_t)a.H * a.D + ch;
    return a.qkv_lo ? a.qkv[i] + a.qkv_lo[i] : a.qkv[i];
}

/* The conv input of channel ch at position ps of sequence q (ps >= q.p0 - (K-1)):
 * the step's row, or before the step the slot's tail [K-1][3C] */
static __device__ __forceinline__ float kc_conv_in(const struct cuda_kda_args &a, const struct cuda_kda_seq &q,
                                                   const float *tail, int ps, size_t ch)
{
    if (ps >= q.p0) return kc_in(a, (size_t)(q.t0 + ps - q.p0), ch);
    return tail[(size_t)(ps - q.p0 + a.K - 1) * 3 * (size_t)a.H * a.D + ch];
}

/* The rows of the X (k_s e^(B - G_s), s before the sub-chunk) and Y (k_t, q_t
 * e^(G_t - B), t in it) buffers for chunks of L */
static __host__ __device__ int kc_xrows(int L) { return (L + KC_SUB - 1) / KC_SUB * KC_SUB - KC_SUB; }
static __host__ __device__ int kc_yrows(int L) { return L < KC_SUB ? L : KC_SUB; }

/* Row strides (floats) of the shared arrays, padded so that a warp's fragment loads (kc_mma_block: 8 rows g
 * by 4 columns q, or 4 rows q by 8 columns g) fall in 32 different banks: q, k, G, X, Y and S^T, read as
 * (row g, column q), D + 4 (= 4 mod 32 at D a multiple of 32); A and P likewise L + 4; u, read as (row q,
 * column g), cols + 8 (= 8 mod 32 at cols a multiple of 32) */
static __host__ __device__ int kc_dp(int D) { return D + 4; }
static __host__ __device__ int kc_lp(int L) { return L + 4; }
static __host__ __device__ int kc_up(int cols) { return cols + 8; }

/* q, k, G [L][DP], X, Y0, Y1, S^T [cols][DP], u [L][UP], A and P [L][LP], beta [L], G_L and e^G_L [D] */
static __host__ __device__ size_t kc_smem_floats(int L, int D, int cols)
{
    return (3 * (size_t)L + kc_xrows(L) + 2 * (size_t)kc_yrows(L) + cols) * kc_dp(D) + (size_t)L * kc_up(cols) +
           2 * (size_t)L * kc_lp(L) + L + 2 * (size_t)D;
}

/* Before kda_chunk_kernel, blocks (head blockIdx.x, sequence blockIdx.y,
 * token slice blockIdx.z), a warp a token, lane l channels l, l + 32, ..:
 * the conv + SiLU of the token's q, k, v channels of the head (from the
 * step's rows, or the slot's tail before the step), q and k L2-normed (q
 * scaled by 1/sqrt(D)), into work [T][3C] (q|k|v as qkv). Every token at
 * once: the conv's reads are latency, spread here over the whole GPU. */
static __global__ void __launch_bounds__(KC_THREADS) kda_chunk_prep_kernel(struct cuda_kda_args a, float *work)
{
    const struct cuda_kda_seq q = a.seqs[blockIdx.y];
    if (q.n <= 0) return;
    const int h = blockIdx.x, D = a.D, K = a.K, C = a.H * D, lane = threadIdx.x & 31, nw = blockDim.x >> 5;
    const float *tail = a.states + (size_t)q.slot * a.slot_floats + a.off + (size_t)C * D;
    const float qscale = 1.0f / sqrtf((float)D);
    for (int t = blockIdx.z * nw + (threadIdx.x >> 5); t < q.n; t += gridDim.z * nw) {
        const int pos = q.p0 + t;
        float *w = work + (size_t)(q.t0 + t) * 3 * C + (size_t)h * D;
        for (int pt = 0; pt < 3; pt++) {
            float y[KC_DL], ss = 0.0f;
#pragma unroll
            for (int m = 0; m < KC_DL; m++) {
                const int c = lane + 32 * m;
                y[m] = 0.0f;
                if (c < D) {
                    const size_t ch = (size_t)pt * C + (size_t)h * D + c;
                    float acc = 0.0f;
                    for (int j = 0; j < K; j++)
                        acc = fmaf(a.conv[ch * K + j], kc_conv_in(a, q, tail, pos - (K - 1) + j, ch), acc);
                    y[m] = acc * kc_sigm(acc);
                    ss = fmaf(y[m], y[m], ss);
                }
            }
            float r = 1.0f;
            if (pt < 2) { /* pt is the same for the whole warp */
                for (int o = 16; o > 0; o >>= 1) ss += __shfl_xor_sync(0xffffffffu, ss, o);
                r = 1.0f / sqrtf(ss + 1e-6f);
            }
#pragma unroll
            for (int m = 0; m < KC_DL; m++) {
                const int c = lane + 32 * m;
                if (c < D) w[(size_t)pt * C + c] = pt == 0 ? y[m] * r * qscale : pt == 1 ? y[m] * r : y[m];
            }
        }
    }
}

/* A matrix in shared memory for kc_mma_block: element (i, j) at p[i s0 + j s1], 0 outside [0, n0) x [0, n1)
 * (the products' edges: a chunk or a column block shorter than the tiles) */
struct kc_mat {
    const float *p;
    int s0, s1, n0, n1;
};

static __device__ __forceinline__ float kc_at(const kc_mat &x, int i, int j)
{
    return i < x.n0 && j < x.n1 ? x.p[i * x.s0 + j * x.s1] : 0.0f;
}

/* x as hi + lo, both tf32: hi x rounded to tf32, lo the rest (exact in f32) rounded to tf32 */
static __device__ __forceinline__ void kc_split(float x, uint32_t &hi, uint32_t &lo)
{
    asm("cvt.rna.tf32.f32 %0, %1;" : "=r"(hi) : "f"(x));
    const float r = x - __uint_as_float(hi);
    asm("cvt.rna.tf32.f32 %0, %1;" : "=r"(lo) : "f"(r));
}

/* d += a b, one m16n8k8 tf32 tensor-core product, f32 accumulation */
static __device__ __forceinline__ void kc_mma(float (&d)[4], const uint32_t (&a)[4], uint32_t b0, uint32_t b1)
{
    asm("mma.sync.aligned.m16n8k8.row.col.f32.tf32.tf32.f32 {%0, %1, %2, %3}, {%4, %5, %6, %7}, {%8, %9}, "
        "{%0, %1, %2, %3};"
        : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3])
        : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b0), "r"(b1));
}

/* acc[j] += sum_{k < K} A(m, k) B(k, n) for the warp's block of 16 rows m0 .. and 8 NT columns n0 .. (tile j
 * the columns n0 + 8 j ..), on the tensor cores in split precision (3xTF32: hi hi + (lo hi + hi lo), f32
 * accumulation; ~f32 accuracy where one tf32 product would keep 11 bits). The small terms go to their own
 * accumulator, added at the end: more accurate, and the three products of a k step are independent, not one
 * chain of mma latencies. The fragments of mma.m16n8k8 .tf32 (PTX ISA, "Matrix Fragments for mma.m16n8k8";
 * kda_chunk.h's cuda_kda_frag_*, which test_kda checks on the host), g = lane / 4, q = lane % 4: A a0 (g, q),
 * a1 (g + 8, q), a2 (g, q + 4), a3 (g + 8, q + 4); B b0 (q, g), b1 (q + 4, g); C c0 (g, 2q), c1 (g, 2q + 1),
 * c2 (g + 8, 2q), c3 (g + 8, 2q + 1) (kc_crow, kc_ccol). tri:
 * A(m, k) taken as 0 for k > m (P's upper triangle, never written). Every argument warp-uniform (mma.sync
 * wants the whole warp). */
template <int NT>
static __device__ __forceinline__ void kc_mma_block(float (&acc)[NT][4], const kc_mat &A, const kc_mat &B, int m0,
                                                    int n0, int K, bool tri)
{
    const int lane = threadIdx.x & 31;
    float s1[NT][4], s2[NT][4];
#pragma unroll
    for (int j = 0; j < NT; j++)
#pragma unroll
        for (int i = 0; i < 4; i++) s1[j][i] = s2[j][i] = 0.0f;
    for (int k0 = 0; k0 < K; k0 += 8) {
        uint32_t ah[4], al[4];
#pragma unroll
        for (int i = 0; i < 4; i++) {
            const int m = m0 + cuda_kda_frag_arow(lane, i), k = k0 + cuda_kda_frag_acol(lane, i);
            kc_split(k < K && !(tri && k > m) ? kc_at(A, m, k) : 0.0f, ah[i], al[i]);
        }
#pragma unroll
        for (int j = 0; j < NT; j++) {
            uint32_t bh[2], bl[2];
#pragma unroll
            for (int i = 0; i < 2; i++) {
                const int k = k0 + cuda_kda_frag_brow(lane, i);
                kc_split(k < K ? kc_at(B, k, n0 + 8 * j + cuda_kda_frag_bcol(lane)) : 0.0f, bh[i], bl[i]);
            }
            kc_mma(s1[j], al, bh[0], bh[1]);
            kc_mma(s2[j], ah, bl[0], bl[1]);
            kc_mma(acc[j], ah, bh[0], bh[1]);
        }
    }
#pragma unroll
    for (int j = 0; j < NT; j++)
#pragma unroll
        for (int i = 0; i < 4; i++) acc[j][i] += s1[j][i] + s2[j][i];
}

/* The row and the column of acc[j][i] of kc_mma_block's block at (m0, n0) */
static __device__ __forceinline__ int kc_crow(int m0, int i) { return m0 + cuda_kda_frag_crow(threadIdx.x & 31, i); }
static __device__ __forceinline__ int kc_ccol(int n0, int j, int i)
{
    return n0 + 8 * j + cuda_kda_frag_ccol(threadIdx.x & 31, i);
}

/* One block per (sequence blockIdx.y, head h and its column block cb:
 * blockIdx.x = h nb + cb), KC_THREADS threads; the products a warp a block
 * of 16 x 16 (P5 to P7) or 16 x 8 (P3, the solve) outputs at a time. */
static __global__ void __launch_bounds__(KC_THREADS)
    kda_chunk_kernel(struct cuda_kda_args a, const float *work, int Lc, int cols, int nb)
{
    extern __shared__ float sm[];
    const struct cuda_kda_seq q = a.seqs[blockIdx.y];
    if (q.n <= 0) return;
    const int h = blockIdx.x / nb, c0 = blockIdx.x % nb * cols, D = a.D, H = a.H, C = H * D;
    const int nc = D - c0 < cols ? D - c0 : cols, DP = kc_dp(D), LP = kc_lp(Lc), UP = kc_up(cols);
    const int tid = threadIdx.x, nt = blockDim.x, warp = tid >> 5;
    float *Qs = sm, *Ks = Qs + Lc * DP, *Gs = Ks + Lc * DP, *Xs = Gs + Lc * DP;
    float *Y0 = Xs + kc_xrows(Lc) * DP, *Y1 = Y0 + kc_yrows(Lc) * DP;
    float *Ss = Y1 + kc_yrows(Lc) * DP, *Us = Ss + cols * DP, *As = Us + Lc * UP;
    float *Ps = As + Lc * LP, *bs = Ps + Lc * LP, *gl = bs + Lc, *eg = gl + D;
    float *Ds = Xs; /* P2 to P3's diagonal blocks: the decays [L][DP], in X and Y ([>= L][DP] together) */
    float *slot = a.states + (size_t)q.slot * a.slot_floats + a.off;
    float *Sg = slot + (size_t)h * D * D; /* this head's S in the slot, S[k][v] */
    const size_t n3 = 3 * (size_t)C;
    const float Ah = a.A[h];

    /* Ss holds the block's columns of S transposed: Ss[j DP + c] = S[c][c0 + j] */
    for (int i = tid; i < D * nc; i += nt) Ss[(i % nc) * DP + i / nc] = Sg[(size_t)(i / nc) * D + c0 + i % nc];
    int snap = 0;
    for (int t0 = 0; t0 < q.n;) {
        /* the chunk [t0, e): to the next grid point, the step's end or the next snapshot (uniform over the block) */
        int e = ((q.p0 + t0) / Lc + 1) * Lc - q.p0;
        if (e > q.n) e = q.n;
        while (snap < q.n_snaps && a.snaps[q.snap0 + snap].pos <= q.p0 + t0) snap++;
        if (snap < q.n_snaps && a.snaps[q.snap0 + snap].pos - q.p0 < e) e = a.snaps[q.snap0 + snap].pos - q.p0;
        const int L = e - t0;
        const size_t r0 = (size_t)(q.t0 + t0); /* the chunk's first row in the step */

        /* P1: the prepared q, k (every channel of the head), v (the block's columns) and the gate's input f
         * of the chunk's rows, copied asynchronously (one wait for all of them); sigmoid(b) */
        for (int i = tid; i < L * D; i += nt) {
            const int t = i / D, c = i % D;
            const float *w = work + (r0 + t) * n3 + (size_t)h * D + c;
            __pipeline_memcpy_async(Qs + t * DP + c, w, 4);
            __pipeline_memcpy_async(Ks + t * DP + c, w + C, 4);
            __pipeline_memcpy_async(Gs + t * DP + c, a.fg + (r0 + t) * C + (size_t)h * D + c, 4);
        }
        for (int i = tid; i < L * nc; i += nt) {
            const int t = i / nc, j = i % nc;
            const float *w = work + (r0 + t) * n3 + 2 * (size_t)C + (size_t)h * D + c0 + j;
            __pipeline_memcpy_async(Us + t * UP + j, w, 4);
        }
        __pipeline_commit();
        for (int t = tid; t < L; t += nt) bs[t] = kc_sigm(a.beta[(r0 + t) * H + h]);
        /* the next chunk's rows of the head (q, k, v, f: 128-byte lines) into L2 while this one computes, so
         * that its P1 waits on L2, not on memory (the step's rows of this sequence only) */
        {
            const int ne = q.n - e < Lc ? q.n - e : Lc, lines = (D + 31) / 32;
            for (int i = tid; i < ne * 4 * lines; i += nt) {
                const int t = i / (4 * lines), part = i / lines % 4, l = i % lines;
                const size_t row = r0 + L + t, ch = (size_t)h * D + 32 * (size_t)l;
                const float *p = part < 3 ? work + row * n3 + (size_t)part * C + ch : a.fg + row * C + ch;
                asm volatile("prefetch.L2 [%0];" ::"l"(p)); /* generic address */
            }
        }
        __pipeline_wait_prior(0);
        __syncthreads();

        /* P2: the log-decays g from f (every (t, c) at once) and the decays e^g (into Ds, P3's), then G, their
         * cumulative sums (a thread a channel) */
        for (int i = tid; i < L * D; i += nt) {
            const int o = i / D * DP + i % D;
            const float g = Gs[o] + a.dt_bias[(size_t)h * D + i % D];
            const float lg = a.lower_bound ? a.lb * kc_sigm(Ah * g) : -Ah * (g > 20.0f ? g : log1pf(expf(g)));
            Gs[o] = lg;
            Ds[o] = expf(lg);
        }
        __syncthreads();
        if (tid < D) { /* 8 rows' loads ahead of their adds: the chain is the adds alone */
            float run = 0.0f;
            for (int tb = 0; tb < L; tb += 8) {
                float g[8];
#pragma unroll
                for (int i = 0; i < 8; i++) g[i] = tb + i < L ? Gs[(tb + i) * DP + tid] : 0.0f;
#pragma unroll
                for (int i = 0; i < 8; i++)
                    if (tb + i < L) Gs[(tb + i) * DP + tid] = run += g[i];
            }
            gl[tid] = run;
            eg[tid] = expf(run);
        }
        __syncthreads();

        /* P3: A and P. First the pairs inside each sub-chunk of KC_SUB rows, their decays e^(G_t - G_s) as
         * the recurrence has them, the products of the tokens' decays d_u = e^(g_u), s < u <= t (each <= 1: no
         * overflow; no exp a pair), walked down t for each s: warp w the sub-chunk w % 4 (so that each SM
         * quarter gets one of each sub-chunk's warps), its rows s 4 (w / 4) .. + 3, 8 lanes a row s, lane j of
         * them the channels j, j + 8, .., the 8 partial sums added by shuffles in a fixed order */
        {
            const int lane = tid & 31, isub = warp % 4, r = isub * KC_SUB, re = L < r + KC_SUB ? L : r + KC_SUB;
            const int sw = r + warp / 4 * 4, s = sw + (lane >> 3), part = lane & 7;
            float E[KC_DC], kss[KC_DC];
#pragma unroll
            for (int j = 0; j < KC_DC; j++) {
                const int c = part + 8 * j;
                E[j] = 1.0f;
                kss[j] = c < D && s < re ? Ks[s * DP + c] : 0.0f;
            }
            for (int t = sw; t < re; t++) { /* warp-uniform: the shuffles want the whole warp */
                float ac = 0.0f, pc = 0.0f;
#pragma unroll
                for (int j = 0; j < KC_DC; j++) {
                    const int c = part + 8 * j;
                    if (c < D) {
                        if (t > s) E[j] *= Ds[t * DP + c];
                        const float x = kss[j] * E[j];
                        ac = fmaf(Ks[t * DP + c], x, ac);
                        pc = fmaf(Qs[t * DP + c], x, pc);
                    }
                }
#pragma unroll
                for (int o = 1; o < 8; o <<= 1) {
                    ac += __shfl_xor_sync(0xffffffffu, ac, o);
                    pc += __shfl_xor_sync(0xffffffffu, pc, o);
                }
                if (part == 0 && s < re && t >= s) {
                    As[t * LP + s] = ac * bs[t];
                    Ps[t * LP + s] = pc;
                }
            }
        }
        __syncthreads(); /* Ds is X's and Y's */
        /* then the rows t of each later sub-chunk against s before it, from the factors X and Y (B = G_{r-1}:
         * every exponent <= 0; no exp a pair): Y0 X^T and Y1 X^T on the tensor cores, a warp a 16 x 8 tile
         * of A or P (other entries than the loop above) */
        for (int r = KC_SUB; r < L; r += KC_SUB) {
            const int m = L - r < KC_SUB ? L - r : KC_SUB;
            const float *B = Gs + (r - 1) * DP;
            for (int i = tid; i < r * D; i += nt) {
                const int s = i / D, c = i % D;
                Xs[s * DP + c] = Ks[s * DP + c] * expf(B[c] - Gs[s * DP + c]);
            }
            for (int i = tid; i < m * D; i += nt) {
                const int t = i / D, c = i % D;
                const float et = expf(Gs[(r + t) * DP + c] - B[c]);
                Y0[t * DP + c] = Ks[(r + t) * DP + c] * et;
                Y1[t * DP + c] = Qs[(r + t) * DP + c] * et;
            }
            __syncthreads();
            const kc_mat X = {Xs, 1, DP, D, r}; /* (c, s): X^T */
            for (int it = warp; it < 2 * (r / 8); it += KC_WARPS) {
                const int isp = it & 1, n0 = (it >> 1) * 8;
                const kc_mat Y = {isp ? Y1 : Y0, DP, 1, m, D};
                float acc[1][4] = {};
                kc_mma_block<1>(acc, Y, X, 0, n0, D, false);
#pragma unroll
                for (int i = 0; i < 4; i++) {
                    const int t = kc_crow(0, i), s = kc_ccol(n0, 0, i);
                    if (t < m && s < r) {
                        if (isp)
                            Ps[(r + t) * LP + s] = acc[0][i];
                        else
                            As[(r + t) * LP + s] = acc[0][i] * bs[r + t];
                    }
                }
            }
            __syncthreads(); /* X and Y are the next sub-chunk's */
        }
        __syncthreads();

        /* P4: q e^G, k e^G and k e^(G_L - G) in place of q, k and G */
        for (int i = tid; i < L * D; i += nt) {
            const int o = i / D * DP + i % D;
            const float G = Gs[o], eG = expf(G), k = Ks[o];
            Qs[o] = Qs[o] * eG;
            Ks[o] = k * eG;
            Gs[o] = k * expf(gl[i % D] - G);
        }
        __syncthreads();

        /* P5: u = beta (v - (k e^G)^T S0), a warp a 16 x 16 block of u */
        const int nm = (L + 15) / 16, nn = (nc + 15) / 16;
        {
            const kc_mat Kg = {Ks, DP, 1, L, D}, S0 = {Ss, 1, DP, D, nc};
            for (int it = warp; it < nm * nn; it += KC_WARPS) {
                const int m0 = it / nn * 16, n0 = it % nn * 16;
                float acc[2][4] = {};
                kc_mma_block<2>(acc, Kg, S0, m0, n0, D, false);
#pragma unroll
                for (int j = 0; j < 2; j++)
#pragma unroll
                    for (int i = 0; i < 4; i++) {
                        const int t = kc_crow(m0, i), jj = kc_ccol(n0, j, i);
                        if (t < L && jj < nc) Us[t * UP + jj] = bs[t] * (Us[t * UP + jj] - acc[j][i]);
                    }
            }
        }
        __syncthreads();
        /* the solve, u_t -= A[t][s] u_s for s = 0 .. t-1 in order, a sub-chunk of rows at a time: against the
         * rows before it (a product: a warp a 16 x 8 tile), then inside it (a thread a column) */
        for (int r = 0; r < L; r += KC_SUB) {
            const int re = L - r < KC_SUB ? L : r + KC_SUB;
            if (r > 0) {
                const kc_mat Ar = {As + r * LP, LP, 1, re - r, r}, Ub = {Us, UP, 1, r, nc};
                for (int it = warp; it < (nc + 7) / 8; it += KC_WARPS) {
                    const int n0 = it * 8;
                    float acc[1][4] = {};
                    kc_mma_block<1>(acc, Ar, Ub, 0, n0, r, false);
#pragma unroll
                    for (int i = 0; i < 4; i++) {
                        const int t = kc_crow(0, i), jj = kc_ccol(n0, 0, i);
                        if (t < re - r && jj < nc) Us[(r + t) * UP + jj] -= acc[0][i];
                    }
                }
                __syncthreads();
            }
            if (tid < nc) { /* the sub-chunk's u of the column in registers: the chain is FMAs alone */
                float uu[KC_SUB];
#pragma unroll
                for (int i = 0; i < KC_SUB; i++) uu[i] = r + i < re ? Us[(r + i) * UP + tid] : 0.0f;
#pragma unroll
                for (int i = 1; i < KC_SUB; i++)
                    if (r + i < re) {
                        const float *arow = As + (r + i) * LP + r;
                        float u = uu[i];
#pragma unroll
                        for (int s = 0; s < i; s++) u = fmaf(-arow[s], uu[s], u);
                        uu[i] = u;
                    }
#pragma unroll
                for (int i = 1; i < KC_SUB; i++)
                    if (r + i < re) Us[(r + i) * UP + tid] = uu[i];
            }
            __syncthreads();
        }

        /* P6: the outputs before the norm, (q e^G)^T S0 + P u (P lower-triangular: its k range ends at the
         * block's last row), a warp a 16 x 16 block */
        {
            const kc_mat Qg = {Qs, DP, 1, L, D}, S0 = {Ss, 1, DP, D, nc}, Pm = {Ps, LP, 1, L, L};
            const kc_mat Um = {Us, UP, 1, L, nc};
            for (int it = warp; it < nm * nn; it += KC_WARPS) {
                const int m0 = it / nn * 16, n0 = it % nn * 16;
                float acc[2][4] = {};
                kc_mma_block<2>(acc, Qg, S0, m0, n0, D, false);
                kc_mma_block<2>(acc, Pm, Um, m0, n0, L < m0 + 16 ? L : m0 + 16, true);
#pragma unroll
                for (int j = 0; j < 2; j++)
#pragma unroll
                    for (int i = 0; i < 4; i++) {
                        const int t = kc_crow(m0, i), jj = kc_ccol(n0, j, i);
                        if (t < L && jj < nc) a.o32[(r0 + t) * C + (size_t)h * D + c0 + jj] = acc[j][i];
                    }
            }
        }
        __syncthreads(); /* P6 reads S0 */

        /* P7: the state after the chunk, S = e^G_L S0 + (k e^(G_L - G))^T u, a warp a 16 x 16 block of S
         * (rows c, columns j), its own: read, accumulated and written back by the same lanes */
        {
            const kc_mat Kd = {Gs, 1, DP, D, L}, Um = {Us, UP, 1, L, nc};
            const int nms = (D + 15) / 16;
            for (int it = warp; it < nms * nn; it += KC_WARPS) {
                const int m0 = it / nn * 16, n0 = it % nn * 16;
                float acc[2][4];
#pragma unroll
                for (int j = 0; j < 2; j++)
#pragma unroll
                    for (int i = 0; i < 4; i++) {
                        const int c = kc_crow(m0, i), jj = kc_ccol(n0, j, i);
                        acc[j][i] = c < D && jj < nc ? eg[c] * Ss[jj * DP + c] : 0.0f;
                    }
                kc_mma_block<2>(acc, Kd, Um, m0, n0, L, false);
#pragma unroll
                for (int j = 0; j < 2; j++)
#pragma unroll
                    for (int i = 0; i < 4; i++) {
                        const int c = kc_crow(m0, i), jj = kc_ccol(n0, j, i);
                        if (c < D && jj < nc) Ss[jj * DP + c] = acc[j][i];
                    }
            }
        }
        __syncthreads(); /* S complete; the next chunk rewrites q, k, G, u, A, P */
        t0 = e;
        while (snap < q.n_snaps && a.snaps[q.snap0 + snap].pos == q.p0 + t0) {
            float *sl = a.states + (size_t)a.snaps[q.snap0 + snap].slot * a.slot_floats + a.off + (size_t)h * D * D;
            for (int i = tid; i < D * nc; i += nt) sl[(size_t)(i / nc) * D + c0 + i % nc] = Ss[(i % nc) * DP + i / nc];
            snap++;
        }
    }
    for (int i = tid; i < D * nc; i += nt) Sg[(size_t)(i / nc) * D + c0 + i % nc] = Ss[(i % nc) * DP + i / nc];
}

/* After kda_chunk_kernel, blocks (head blockIdx.x, sequence blockIdx.y,
 * token slice blockIdx.z): each warp the gated RMS norm of tokens z nw + w,
 * strided by KC_OUT_Z nw (the recurrence's kda_out_kernel walks them one by
 * one: here they are independent); block z 0 also the conv tails, a thread a
 * (part, channel): the snapshots' first (they read the old tail), then the
 * slot's in place, oldest row first (row j reads row j + n or a step row). */
static __global__ void kda_chunk_out_kernel(struct cuda_kda_args a)
{
    const struct cuda_kda_seq q = a.seqs[blockIdx.y];
    if (q.n <= 0) return;
    const int h = blockIdx.x, D = a.D, K = a.K, C = a.H * D, lane = threadIdx.x & 31, nw = blockDim.x >> 5;
    for (int t = blockIdx.z * nw + (threadIdx.x >> 5); t < q.n; t += gridDim.z * nw) {
        const size_t row = (size_t)(q.t0 + t) * C + (size_t)h * D;
        float ss = 0.0f;
        for (int c = lane; c < D; c += 32) ss = fmaf(a.o32[row + c], a.o32[row + c], ss);
        for (int o = 16; o > 0; o >>= 1) ss += __shfl_xor_sync(0xffffffffu, ss, o);
        const float r = 1.0f / sqrtf(ss / (float)D + a.eps);
        for (int c = lane; c < D; c += 32)
            a.out[row + c] = f2bf(a.o_norm[c] * (a.o32[row + c] * r) * kc_sigm(a.gate[row + c]));
    }
    if (blockIdx.z != 0) return;
    float *tail = a.states + (size_t)q.slot * a.slot_floats + a.off + (size_t)C * D;
    const size_t n3 = 3 * (size_t)C;
    for (int i = threadIdx.x; i < 3 * D; i += blockDim.x) {
        const size_t ch = (size_t)(i / D) * C + (size_t)h * D + i % D;
        for (int k = 0; k < q.n_snaps; k++) {
            const int P = a.snaps[q.snap0 + k].pos;
            if (P <= q.p0 || P > q.p0 + q.n) continue;
            float *sl = a.states + (size_t)a.snaps[q.snap0 + k].slot * a.slot_floats + a.off + (size_t)C * D;
            for (int j = 0; j < K - 1; j++) sl[(size_t)j * n3 + ch] = kc_conv_in(a, q, tail, P - (K - 1) + j, ch);
        }
        for (int j = 0; j < K - 1; j++)
            tail[(size_t)j * n3 + ch] = kc_conv_in(a, q, tail, q.p0 + q.n - (K - 1) + j, ch);
    }
}

extern "C" cudaError_t cuda_kda_chunk_prepare(void)
{
    int dev, optin;
    cudaError_t e = cudaGetDevice(&dev);
    if (e == cudaSuccess) e = cudaDeviceGetAttribute(&optin, cudaDevAttrMaxSharedMemoryPerBlockOptin, dev);
    if (e == cudaSuccess)
        e = cudaFuncSetAttribute(kda_chunk_kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, optin);
    return e;
}

/* The largest dynamic shared memory a block may have on this device (0: unknown) */
static size_t kc_optin(void)
{
    int dev, optin;
    if (cudaGetDevice(&dev) != cudaSuccess ||
        cudaDeviceGetAttribute(&optin, cudaDevAttrMaxSharedMemoryPerBlockOptin, dev) != cudaSuccess)
        return 0;
    return (size_t)optin;
}

static int kc_cols(int D, int cols)
{
    int c = cols ? cols : CUDA_KDA_COLS;
    return c > D ? D : c;
}

extern "C" int cuda_kda_chunk_len(int D, int cols)
{
    size_t optin = kc_optin();
    cols = kc_cols(D, cols);
    for (int L = CUDA_KDA_CHUNK_MAX; L >= 8; L /= 2)
        if (kc_smem_floats(L, D, cols) * sizeof(float) <= optin) return L;
    return 0;
}

extern "C" cudaError_t cuda_kda_chunk(const struct cuda_kda_args *a, int chunk, float *work, cudaStream_t st)
{
    if (a->n_seqs <= 0) return cudaSuccess;
    if (a->D < 1 || a->D > CUDA_KDA_MAX_D || a->K < 1 || a->K > CUDA_KDA_MAX_K || a->cols < 0 || !a->o32 || !work ||
        chunk < 0 || chunk > CUDA_KDA_CHUNK_MAX)
        return cudaErrorInvalidValue;
    /* cols 0: CUDA_KDA_COLS, wider while the heads' blocks outnumber the SMs (a block has an SM to itself, and
     * a second wave would double the time: 64 heads on an H100 take 64 columns, 128 blocks) */
    int cols = a->cols, sms = 0, dev;
    if (!cols) {
        cols = CUDA_KDA_COLS;
        if (cudaGetDevice(&dev) == cudaSuccess &&
            cudaDeviceGetAttribute(&sms, cudaDevAttrMultiProcessorCount, dev) == cudaSuccess)
            while (cols < a->D && a->H * ((a->D + cols - 1) / cols) > sms) cols *= 2;
    }
    cols = kc_cols(a->D, cols);
    int L = chunk ? chunk : cuda_kda_chunk_len(a->D, cols);
    size_t smem = kc_smem_floats(L, a->D, cols) * sizeof(float);
    if (L < 1 || smem > kc_optin()) return cudaErrorInvalidValue;
    int nb = (a->D + cols - 1) / cols;
    kda_chunk_prep_kernel<<<dim3((unsigned)a->H, (unsigned)a->n_seqs, KC_OUT_Z), KC_THREADS, 0, st>>>(*a, work);
    cudaError_t e = cudaGetLastError();
    if (e != cudaSuccess) return e;
    kda_chunk_kernel<<<dim3((unsigned)(a->H * nb), (unsigned)a->n_seqs), KC_THREADS, smem, st>>>(*a, work, L, cols,
                                                                                                  nb);
    if ((e = cudaGetLastError()) != cudaSuccess) return e;
    kda_chunk_out_kernel<<<dim3((unsigned)a->H, (unsigned)a->n_seqs, KC_OUT_Z), KC_THREADS, 0, st>>>(*a);
    return cudaGetLastError();
}

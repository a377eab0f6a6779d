/* kda_chunk.cu - the KDA delta rule in chunks (kda_chunk.h): one block per
 * (sequence, head, block of value columns) walks the sequence's chunks in
 * order, each chunk in shared memory as recur_chunked (model/cpu_kda.c) does
 * it, step for step and sum for sum (f32; the exponentials are expf, the
 * CPU's too); then a second kernel, parallel over tokens, the gated output
 * norm, and the conv tails. See recur_chunked for the algebra:
 *   P1  the conv + SiLU of the chunk's q, k (every channel of the head) and v
 *       (the block's columns), each output from its K inputs (the step's
 *       rows, or the slot's tail before the step); the log-decays; sigmoid(b)
 *   P2  the L2 norms of q and k per token; G = the cumulative log-decays
 *   P3  A[t][s] = beta_t sum_c k_t k_s e^(G_t - G_s) (s < t), P[t][s] the same
 *       with q_t (s <= t): one thread a (t, s) pair
 *   P4  q e^G_t, k e^G_t, k e^(G_L - G_t) in place of q, k, G
 *   P5  u = beta (v - (k e^G)^T S0), then the triangular solve u_t -= A[t][s]
 *       u_s in order (one thread a column: no barrier inside)
 *   P6  o_t = (q e^G)^T S0 + sum_{s <= t} P[t][s] u_s, into o32
 *   P7  S = e^G_L S0 + sum_t (k_t e^(G_L - G_t)) u_t^T; a snapshot's S here
 * The block's S columns stay in shared memory from the first chunk to the
 * last. Every exponent is <= 0 (a difference of cumulative log-decays later
 * minus earlier, or one of them), so nothing overflows whatever the gate.
 *
 * Shared memory (floats): q, k, G [L][D + 1] (the padding spreads a column
 * over the banks when a warp's threads read different rows), S [D][cols],
 * v / u [L][cols], A and P [L][L + 1], beta [L], G_L and e^G_L [D]: 158 KB at
 * L 64, D 128, cols 32; 80 KB at L 32 (sm_89's 99 KB). */
#include "cuda/bf16.cuh"
#include "cuda/kda_chunk.h"

#define KC_THREADS 256 /* >= CUDA_KDA_MAX_D: thread c < D owns channel c's cumulative sum */
#define KC_OUT_Z 32    /* the output kernel's blocks a (sequence, head): its tokens strided over them */

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

static __host__ __device__ size_t kc_smem_floats(int L, int D, int cols)
{
    return 3 * (size_t)L * (D + 1) + (size_t)D * cols + (size_t)L * cols + 2 * (size_t)L * (L + 1) + L + 2 * (size_t)D;
}

static __global__ void __launch_bounds__(KC_THREADS) kda_chunk_kernel(struct cuda_kda_args a, int Lc, int cols, int nb)
{
    extern __shared__ float sm[];
    const struct cuda_kda_seq q = a.seqs[blockIdx.y];
    if (q.n <= 0) return;
    const int h = blockIdx.x / nb, c0 = blockIdx.x % nb * cols, D = a.D, K = a.K, H = a.H, C = H * D;
    const int nc = D - c0 < cols ? D - c0 : cols, DP = D + 1, LP = Lc + 1, tid = threadIdx.x, nt = blockDim.x;
    const int lane = tid & 31, warp = tid >> 5, nw = nt >> 5;
    float *Qs = sm, *Ks = Qs + (size_t)Lc * DP, *Gs = Ks + (size_t)Lc * DP, *Ss = Gs + (size_t)Lc * DP;
    float *Us = Ss + (size_t)D * cols, *As = Us + (size_t)Lc * cols, *Ps = As + (size_t)Lc * LP;
    float *bs = Ps + (size_t)Lc * LP, *gl = bs + Lc, *eg = gl + D;
    float *slot = a.states + (size_t)q.slot * a.slot_floats + a.off;
    float *Sg = slot + (size_t)h * D * D; /* this head's S in the slot, S[k][v] */
    const float *tail = slot + (size_t)C * D;
    const float qscale = 1.0f / sqrtf((float)D), Ah = a.A[h];

    for (int i = tid; i < D * nc; i += nt)
        Ss[(size_t)(i / nc) * cols + i % nc] = Sg[(size_t)(i / nc) * D + c0 + i % nc];
    int snap = 0;
    for (int t0 = 0; t0 < q.n;) {
        /* the chunk [t0, e): to the next grid point, the step's end or the next snapshot (uniform over the block) */
        int e = ((q.p0 + t0) / Lc + 1) * Lc - q.p0;
        if (e > q.n) e = q.n;
        while (snap < q.n_snaps && a.snaps[q.snap0 + snap].pos <= q.p0 + t0) snap++;
        if (snap < q.n_snaps && a.snaps[q.snap0 + snap].pos - q.p0 < e) e = a.snaps[q.snap0 + snap].pos - q.p0;
        const int L = e - t0;
        const size_t r0 = (size_t)(q.t0 + t0); /* the chunk's first row in the step */

        /* P1: conv + SiLU (q, k: D channels each; v: the nc columns), log-decays, betas */
        const int W = 2 * D + nc;
        for (int i = tid; i < L * W; i += nt) {
            const int t = i / W, r = i % W;
            const size_t ch = r < D       ? (size_t)h * D + r
                              : r < 2 * D ? (size_t)C + (size_t)h * D + (r - D)
                                          : 2 * (size_t)C + (size_t)h * D + c0 + (r - 2 * D);
            const int pos = q.p0 + t0 + t;
            float acc = 0.0f;
            for (int j = 0; j < K; j++)
                acc = fmaf(a.conv[ch * K + j], kc_conv_in(a, q, tail, pos - (K - 1) + j, ch), acc);
            const float y = acc * kc_sigm(acc);
            if (r < D)
                Qs[(size_t)t * DP + r] = y;
            else if (r < 2 * D)
                Ks[(size_t)t * DP + (r - D)] = y;
            else
                Us[(size_t)t * cols + (r - 2 * D)] = y;
        }
        for (int i = tid; i < L * D; i += nt) {
            const int t = i / D, c = i % D;
            float g = a.fg[(r0 + t) * C + (size_t)h * D + c] + a.dt_bias[(size_t)h * D + c], lg;
            if (a.lower_bound)
                lg = a.lb * kc_sigm(Ah * g);
            else
                lg = -Ah * (g > 20.0f ? g : log1pf(expf(g)));
            Gs[(size_t)t * DP + c] = lg;
        }
        for (int t = tid; t < L; t += nt) bs[t] = kc_sigm(a.beta[(r0 + t) * H + h]);
        __syncthreads();

        /* P2: q, k normalised per token (a warp a row), q scaled; G cumulative per channel (a thread a channel) */
        for (int pr = warp; pr < 2 * L; pr += nw) {
            float *x = (pr & 1 ? Ks : Qs) + (size_t)(pr >> 1) * DP;
            float ss = 0.0f;
            for (int c = lane; c < D; c += 32) ss = fmaf(x[c], x[c], ss);
            for (int o = 16; o > 0; o >>= 1) ss += __shfl_xor_sync(0xffffffffu, ss, o);
            const float r = 1.0f / sqrtf(ss + 1e-6f);
            for (int c = lane; c < D; c += 32) x[c] = pr & 1 ? x[c] * r : x[c] * r * qscale;
        }
        if (tid < D) {
            float run = 0.0f;
            for (int t = 0; t < L; t++) Gs[(size_t)t * DP + tid] = run += Gs[(size_t)t * DP + tid];
            gl[tid] = run;
            eg[tid] = expf(run);
        }
        __syncthreads();

        /* P3: A and P, a thread a (t, s) pair of the lower triangle (s <= t), p = t (t + 1) / 2 + s */
        const int np = L * (L + 1) / 2;
        for (int p = tid; p < np; p += nt) {
            int t = (int)((sqrtf(8.0f * (float)p + 1.0f) - 1.0f) * 0.5f);
            while (t * (t + 1) / 2 > p) t--;
            while ((t + 1) * (t + 2) / 2 <= p) t++;
            const int s = p - t * (t + 1) / 2;
            const float *kt = Ks + (size_t)t * DP, *qt = Qs + (size_t)t * DP, *gt = Gs + (size_t)t * DP;
            const float *ks = Ks + (size_t)s * DP, *gs = Gs + (size_t)s * DP;
            float ac = 0.0f, pc = 0.0f;
            for (int c = 0; c < D; c++) {
                const float x = ks[c] * expf(gt[c] - gs[c]);
                ac = fmaf(kt[c], x, ac);
                pc = fmaf(qt[c], x, pc);
            }
            As[(size_t)t * LP + s] = ac * bs[t];
            Ps[(size_t)t * LP + s] = pc;
        }
        __syncthreads();

        /* P4: q e^G, k e^G and k e^(G_L - G) in place of q, k and G */
        for (int i = tid; i < L * D; i += nt) {
            const size_t o = (size_t)(i / D) * DP + i % D;
            const float G = Gs[o], eG = expf(G), k = Ks[o];
            Qs[o] = Qs[o] * eG;
            Ks[o] = k * eG;
            Gs[o] = k * expf(gl[i % D] - G);
        }
        __syncthreads();

        /* P5: u = beta (v - (k e^G)^T S0) for every (t, column), then the solve down each column */
        for (int i = tid; i < L * nc; i += nt) {
            const int t = i / nc, j = i % nc;
            const float *kg = Ks + (size_t)t * DP;
            float m = 0.0f;
            for (int c = 0; c < D; c++) m = fmaf(kg[c], Ss[(size_t)c * cols + j], m);
            Us[(size_t)t * cols + j] = bs[t] * (Us[(size_t)t * cols + j] - m);
        }
        __syncthreads();
        if (tid < nc)
            for (int t = 1; t < L; t++) {
                float u = Us[(size_t)t * cols + tid];
                for (int s = 0; s < t; s++) u = fmaf(-As[(size_t)t * LP + s], Us[(size_t)s * cols + tid], u);
                Us[(size_t)t * cols + tid] = u;
            }
        __syncthreads();

        /* P6: the outputs before the norm */
        for (int i = tid; i < L * nc; i += nt) {
            const int t = i / nc, j = i % nc;
            const float *qg = Qs + (size_t)t * DP, *pt = Ps + (size_t)t * LP;
            float o = 0.0f;
            for (int c = 0; c < D; c++) o = fmaf(qg[c], Ss[(size_t)c * cols + j], o);
            for (int s = 0; s <= t; s++) o = fmaf(pt[s], Us[(size_t)s * cols + j], o);
            a.o32[(r0 + t) * C + (size_t)h * D + c0 + j] = o;
        }
        __syncthreads(); /* P6 reads S0 */

        /* P7: the state after the chunk */
        for (int i = tid; i < D * nc; i += nt) {
            const int c = i / nc, j = i % nc;
            float x = eg[c] * Ss[(size_t)c * cols + j];
            for (int t = 0; t < L; t++) x = fmaf(Gs[(size_t)t * DP + c], Us[(size_t)t * cols + j], x);
            Ss[(size_t)c * cols + j] = x;
        }
        __syncthreads(); /* S complete; the next chunk rewrites q, k, G, u, A, P */
        t0 = e;
        while (snap < q.n_snaps && a.snaps[q.snap0 + snap].pos == q.p0 + t0) {
            float *sl = a.states + (size_t)a.snaps[q.snap0 + snap].slot * a.slot_floats + a.off + (size_t)h * D * D;
            for (int i = tid; i < D * nc; i += nt)
                sl[(size_t)(i / nc) * D + c0 + i % nc] = Ss[(size_t)(i / nc) * cols + i % nc];
            snap++;
        }
    }
    for (int i = tid; i < D * nc; i += nt)
        Sg[(size_t)(i / nc) * D + c0 + i % nc] = Ss[(size_t)(i / nc) * cols + i % nc];
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

extern "C" cudaError_t cuda_kda_chunk(const struct cuda_kda_args *a, int chunk, cudaStream_t st)
{
    if (a->n_seqs <= 0) return cudaSuccess;
    if (a->D < 1 || a->D > CUDA_KDA_MAX_D || a->K < 1 || a->K > CUDA_KDA_MAX_K || a->cols < 0 || !a->o32 ||
        chunk < 0 || chunk > CUDA_KDA_CHUNK_MAX)
        return cudaErrorInvalidValue;
    int cols = kc_cols(a->D, a->cols), L = chunk ? chunk : cuda_kda_chunk_len(a->D, a->cols);
    size_t smem = kc_smem_floats(L, a->D, cols) * sizeof(float);
    if (L < 1 || smem > kc_optin()) return cudaErrorInvalidValue;
    int nb = (a->D + cols - 1) / cols;
    kda_chunk_kernel<<<dim3((unsigned)(a->H * nb), (unsigned)a->n_seqs), KC_THREADS, smem, st>>>(*a, L, cols, nb);
    cudaError_t e = cudaGetLastError();
    if (e != cudaSuccess) return e;
    kda_chunk_out_kernel<<<dim3((unsigned)a->H, (unsigned)a->n_seqs, KC_OUT_Z), KC_THREADS, 0, st>>>(*a);
    return cudaGetLastError();
}

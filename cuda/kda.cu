/* kda.cu - KDA linear attention kernels (kda.h): the state slots' start of a
 * step, the per-(sequence, head, column block) recurrence with the conv, the
 * L2 norms and the gates folded in, then per (sequence, head) the gated
 * output norm and the conv tails; and the low part of xn for the q|k|v
 * projection. Per element the arithmetic is model/cpu_kda.c's (the same
 * fused multiply-adds in the same order for the conv and the delta rule's
 * updates of S) but for the sums: the delta rule's two sums over the key
 * dimension in 4 interleaved partial sums (the CPU: one chain), the norms'
 * in f32 (the CPU: double). A verify step's drafts (cuda_kda_seq.nd) leave
 * the slot at the last non-draft token and their inputs in the replay
 * scratch; the replay (cuda_kda_args.replay) runs the same two kernels over
 * those inputs, without outputs (kda.h). */
#include "cuda/bf16.cuh"
#include "cuda/kda.h"
#include "cuda/norm.cuh"

static __global__ void kda_begin_kernel(float *states, size_t slot_floats, const struct cuda_kda_seq *seqs)
{
    const struct cuda_kda_seq q = seqs[blockIdx.y];
    if (q.n <= 0 || q.mode == CUDA_KDA_CONTINUE) return;
    float *dst = states + (size_t)q.slot * slot_floats;
    const float *src = states + (size_t)q.from * slot_floats;
    size_t stride = (size_t)gridDim.x * blockDim.x;
    for (size_t i = (size_t)blockIdx.x * blockDim.x + threadIdx.x; i < slot_floats; i += stride)
        dst[i] = q.mode == CUDA_KDA_ZERO ? 0.0f : src[i];
}

extern "C" cudaError_t cuda_kda_begin(float *states, size_t slot_floats, const struct cuda_kda_seq *seqs, int n_seqs,
                                      cudaStream_t st)
{
    if (n_seqs <= 0) return cudaSuccess;
    size_t blocks = (slot_floats + 255) / 256;
    dim3 grid((unsigned)(blocks < 64 ? blocks : 64), (unsigned)n_seqs);
    kda_begin_kernel<<<grid, 256, 0, st>>>(states, slot_floats, seqs);
    return cudaGetLastError();
}

static __device__ __forceinline__ float sigm(float x) { return 1.0f / (1.0f + expf(-x)); }

/* The sum of v over the block (every thread gets it); sh: [32]. */
static __device__ float kda_block_sum(float v, float *sh)
{
    for (int o = 16; o > 0; o >>= 1) v += __shfl_xor_sync(0xffffffffu, v, o);
    int w = threadIdx.x >> 5, nw = (blockDim.x + 31) >> 5;
    __syncthreads(); /* sh may still be read by a previous call */
    if ((threadIdx.x & 31) == 0) sh[w] = v;
    __syncthreads();
    float s = 0.0f;
    for (int i = 0; i < nw; i++) s += sh[i];
    return s;
}

/* Input channel ch (of 3C) of row `row`: the projection of xn, plus that of
 * xn's low part when given. */
static __device__ __forceinline__ float kda_in(const struct cuda_kda_args &a, size_t row, size_t ch)
{
    size_t i = row * 3 * (size_t)a.H * a.D + ch;
    return a.qkv_lo ? a.qkv[i] + a.qkv_lo[i] : a.qkv[i];
}

/* One block per (sequence blockIdx.y, head h and its column block cb:
 * blockIdx.x = h * nb + cb), blockDim.x >= D and >= 4 cols (a multiple of
 * 32, the same for every split): thread d < D owns channel d of the head's q
 * and k (their conv windows, the L2 norms over the whole head), thread d <
 * nc also channel c0 + d of v (c0 = cb cols). Column c0 + i of S is held in
 * the registers of the four threads 4i .. 4i + 3 (one warp), thread 4i + j
 * its rows k = j mod 4: the delta rule's two sums over k are the four
 * interleaved partial sums (k mod 4) the column's threads each chain in k's
 * order, added (m0 + m1) + (m2 + m3) by two shuffles, so no result depends
 * on the split, and a token costs a quarter of a one-thread-a-column walk.
 * The outputs o (before the norm) go to o32; the conv tails are
 * cuda_kda_recur's second kernel's. Shared memory: q, k, decay, v [D]. */
#define KDA_KR ((CUDA_KDA_MAX_D + 3) / 4) /* the rows of S a thread holds */
#define KDA_RT_NARROW 128                   /* blocks of up to this many threads: the register-rich kernel */
/* MAXT: the block's most threads. The usual split (32 columns, D 128) runs
 * 128 threads and keeps S and the conv windows in up to 255 registers; a
 * bound of 512 (four threads a column of 128) would cap every launch at 64
 * registers and spill S to local memory (2.7x slower a decode step), so
 * only the wide splits take that instantiation. */
template <int MAXT>
static __global__ void __launch_bounds__(MAXT) kda_recur_kernel(struct cuda_kda_args a, int cols, int nb)
{
    extern __shared__ float smem[];
    __shared__ float red[32];
    const struct cuda_kda_seq q = a.seqs[blockIdx.y];
    if (q.n <= 0) return;
    const int h = blockIdx.x / nb, c0 = blockIdx.x % nb * cols, D = a.D, K = a.K, H = a.H, C = H * D,
              d = threadIdx.x;
    const int nc = D - c0 < cols ? D - c0 : cols;
    const int cl = d >> 2, jq = d & 3; /* the column c0 + cl whose rows k = jq mod 4 this thread holds */
    const bool own = d < D, col = d < nc, cw = cl < nc;
    const int keep = q.n - q.nd; /* drafts: the slot keeps the state after this many tokens (kda.h) */
    float *qs = smem, *ks = qs + D, *ds = ks + D, *vs = ds + D;
    float *slot = a.states + (size_t)q.slot * a.slot_floats + a.off;
    float *Sg = slot + (size_t)h * D * D;                 /* this head's S in the slot, S[k][v] */
    const float *tail = slot + (size_t)C * D;             /* [K-1][3C] */
    const size_t n3 = 3 * (size_t)C;
    /* the channels of q, k (d) and v (c0 + d) this thread convolves */
    const size_t chan[3] = {(size_t)h * D + d, (size_t)C + (size_t)h * D + d, 2 * (size_t)C + (size_t)h * D + c0 + d};

    float w[3][CUDA_KDA_MAX_K], win[3][CUDA_KDA_MAX_K];
#pragma unroll
    for (int pt = 0; pt < 3; pt++) {
        const bool mine = pt < 2 ? own : col;
#pragma unroll
        for (int j = 0; j < CUDA_KDA_MAX_K; j++) {
            w[pt][j] = mine && j < K ? a.conv[chan[pt] * K + j] : 0.0f;
            win[pt][j] = mine && j < K - 1 ? tail[(size_t)j * n3 + chan[pt]] : 0.0f;
        }
    }
    float S[KDA_KR]; /* S[jq + 4 i][c0 + cl] */
#pragma unroll
    for (int i = 0; i < KDA_KR; i++) {
        const int k = jq + 4 * i;
        S[i] = cw && k < D ? Sg[(size_t)k * D + c0 + cl] : 0.0f;
    }
    const float dtb = own ? a.dt_bias[(size_t)h * D + d] : 0.0f, A = a.A[h];
    const float qscale = 1.0f / sqrtf((float)D);
    int snap = 0;
    for (int t = 0; t < q.n; t++) {
        const size_t row = (size_t)(q.t0 + t);
        /* the conv over the last K inputs (window, then this token), oldest first, and SiLU */
        float cv[3];
#pragma unroll
        for (int pt = 0; pt < 3; pt++) {
            const bool mine = pt < 2 ? own : col;
            float x = mine ? kda_in(a, row, chan[pt]) : 0.0f, acc = 0.0f;
#pragma unroll
            for (int j = 0; j < CUDA_KDA_MAX_K - 1; j++)
                if (j < K - 1) acc = fmaf(w[pt][j], win[pt][j], acc);
#pragma unroll
            for (int j = 0; j < CUDA_KDA_MAX_K; j++)
                if (j == K - 1) acc = fmaf(w[pt][j], x, acc);
#pragma unroll
            for (int j = 0; j < CUDA_KDA_MAX_K - 1; j++)
                if (j < K - 2) win[pt][j] = win[pt][j + 1];
#pragma unroll
            for (int j = 0; j < CUDA_KDA_MAX_K - 1; j++)
                if (j == K - 2) win[pt][j] = x;
            cv[pt] = acc * sigm(acc);
        }
        /* l2 norms of q and k over the head, q scaled by 1/sqrt(D) */
        float rq = 1.0f / sqrtf(kda_block_sum(own ? cv[0] * cv[0] : 0.0f, red) + 1e-6f);
        float rk = 1.0f / sqrtf(kda_block_sum(own ? cv[1] * cv[1] : 0.0f, red) + 1e-6f);
        float g = own ? a.fg[row * C + (size_t)h * D + d] + dtb : 0.0f, lg;
        if (a.lower_bound)
            lg = a.lb * sigm(A * g);
        else
            lg = -A * (g > 20.0f ? g : log1pf(expf(g)));
        float beta = sigm(a.beta[row * H + h]);
        if (own) {
            qs[d] = cv[0] * rq * qscale;
            ks[d] = cv[1] * rk;
            ds[d] = expf(lg);
        }
        if (col) vs[d] = cv[2];
        __syncthreads();
        /* decay and read: m = S^T k (every thread of the block takes part in the shuffles) */
        float m = 0.0f;
#pragma unroll
        for (int i = 0; i < KDA_KR; i++) {
            const int k = jq + 4 * i;
            if (k < D) {
                const float s = S[i] * ds[k];
                S[i] = s;
                m = fmaf(ks[k], s, m);
            }
        }
        m += __shfl_xor_sync(0xffffffffu, m, 1);
        m += __shfl_xor_sync(0xffffffffu, m, 2);
        const float delta = cw ? (vs[cl] - m) * beta : 0.0f;
        /* write and output: S += k delta^T, o = S^T q */
        float o = 0.0f;
#pragma unroll
        for (int i = 0; i < KDA_KR; i++) {
            const int k = jq + 4 * i;
            if (k < D) {
                const float s = fmaf(ks[k], delta, S[i]);
                S[i] = s;
                o = fmaf(qs[k], s, o);
            }
        }
        o += __shfl_xor_sync(0xffffffffu, o, 1);
        o += __shfl_xor_sync(0xffffffffu, o, 2);
        if (cw) {
            if (jq == 0 && !a.replay) a.o32[row * C + (size_t)h * D + c0 + cl] = o;
            /* the last token before the drafts: its state is the slot's */
            if (q.nd > 0 && t == keep - 1)
#pragma unroll
                for (int i = 0; i < KDA_KR; i++)
                    if (jq + 4 * i < D) Sg[(size_t)(jq + 4 * i) * D + c0 + cl] = S[i];
        }
        /* snapshots' S after this token (their tails: kda_out_kernel) */
        while (snap < q.n_snaps && a.snaps[q.snap0 + snap].pos == q.p0 + t + 1) {
            float *sl = a.states + (size_t)a.snaps[q.snap0 + snap].slot * a.slot_floats + a.off + (size_t)h * D * D;
            if (cw)
#pragma unroll
                for (int i = 0; i < KDA_KR; i++)
                    if (jq + 4 * i < D) sl[(size_t)(jq + 4 * i) * D + c0 + cl] = S[i];
            snap++;
        }
        __syncthreads(); /* qs, ks, ds, vs are rewritten by the next token */
    }
    if (q.nd > 0 || !cw) return; /* with drafts the slot got its state before them */
#pragma unroll
    for (int i = 0; i < KDA_KR; i++)
        if (jq + 4 * i < D) Sg[(size_t)(jq + 4 * i) * D + c0 + cl] = S[i];
}

/* After kda_recur_kernel, one block per (sequence blockIdx.y, head
 * blockIdx.x), thread d < D channel d of the head: the gated RMS norm of
 * each token's output, and the conv tails (the last K-1 inputs of q, k, v
 * channel d) of the snapshots after their tokens and of the slot at the end
 * (with drafts: after the last token before them, each draft's inputs saved
 * for the replay). The tails are written here, after every column block has
 * read them. The replay: the tail only. */
static __global__ void kda_out_kernel(struct cuda_kda_args a)
{
    __shared__ float red[32];
    const struct cuda_kda_seq q = a.seqs[blockIdx.y];
    if (q.n <= 0) return;
    const int h = blockIdx.x, D = a.D, K = a.K, C = a.H * D, d = threadIdx.x;
    const bool own = d < D;
    const int keep = q.n - q.nd;
    float *tail = a.states + (size_t)q.slot * a.slot_floats + a.off + (size_t)C * D;
    const size_t n3 = 3 * (size_t)C, ch = (size_t)h * D + d;
    float win[3][CUDA_KDA_MAX_K];
#pragma unroll
    for (int pt = 0; pt < 3; pt++)
#pragma unroll
        for (int j = 0; j < CUDA_KDA_MAX_K; j++)
            win[pt][j] = own && j < K - 1 ? tail[(size_t)j * n3 + (size_t)pt * C + ch] : 0.0f;
    const float onw = own && !a.replay ? a.o_norm[d] : 0.0f;
    int snap = 0;
    for (int t = 0; t < q.n; t++) {
        const size_t row = (size_t)(q.t0 + t);
        /* a draft: its inputs into the replay scratch, as the kernels read them */
        const bool save = q.nd > 0 && t >= keep && own;
        const size_t srow = (size_t)(q.spec0 + t - keep);
#pragma unroll
        for (int pt = 0; pt < 3; pt++) {
            float x = own ? kda_in(a, row, (size_t)pt * C + ch) : 0.0f;
            if (save) a.spec_qkv[srow * 3 * C + (size_t)pt * C + ch] = x;
#pragma unroll
            for (int j = 0; j < CUDA_KDA_MAX_K - 1; j++)
                if (j < K - 2) win[pt][j] = win[pt][j + 1];
#pragma unroll
            for (int j = 0; j < CUDA_KDA_MAX_K - 1; j++)
                if (j == K - 2) win[pt][j] = x;
        }
        if (save) {
            a.spec_fg[srow * C + ch] = a.fg[row * C + ch];
            if (d == 0) a.spec_beta[srow * a.H + h] = a.beta[row * a.H + h];
        }
        if (q.nd > 0 && t == keep - 1 && own) /* the slot's tail: before the drafts */
#pragma unroll
            for (int pt = 0; pt < 3; pt++)
#pragma unroll
                for (int j = 0; j < CUDA_KDA_MAX_K - 1; j++)
                    if (j < K - 1) tail[(size_t)j * n3 + (size_t)pt * C + ch] = win[pt][j];
        if (a.replay) continue; /* no outputs, no snapshots */
        float o = own ? a.o32[row * C + ch] : 0.0f;
        float r = 1.0f / sqrtf(kda_block_sum(own ? o * o : 0.0f, red) / (float)D + a.eps);
        if (own) a.out[row * C + ch] = f2bf(onw * (o * r) * sigm(a.gate[row * C + ch]));
        /* snapshots after this token: the window (the inputs before position pos) */
        while (snap < q.n_snaps && a.snaps[q.snap0 + snap].pos == q.p0 + t + 1) {
            float *sl = a.states + (size_t)a.snaps[q.snap0 + snap].slot * a.slot_floats + a.off + (size_t)C * D;
            if (own)
#pragma unroll
                for (int pt = 0; pt < 3; pt++)
#pragma unroll
                    for (int j = 0; j < CUDA_KDA_MAX_K - 1; j++)
                        if (j < K - 1) sl[(size_t)j * n3 + (size_t)pt * C + ch] = win[pt][j];
            snap++;
        }
    }
    if (own && q.nd == 0)
#pragma unroll
        for (int pt = 0; pt < 3; pt++)
#pragma unroll
            for (int j = 0; j < CUDA_KDA_MAX_K - 1; j++)
                if (j < K - 1) tail[(size_t)j * n3 + (size_t)pt * C + ch] = win[pt][j];
}

/* hl[t] = xn[t] and hl[T + t] = bf16(y - xn[t]) with y the f32 RMS norm of
 * x[t] that xn[t] rounds (norm.cuh's order): one block per row. */
static __global__ void kda_xsplit_kernel(const float *x, const float *w, const uint16_t *xn, int T, int E, float eps,
                                         uint16_t *hl)
{
    __shared__ float sh[32];
    const size_t r = blockIdx.x;
    const float *xr = x + r * E;
    float ss = 0.0f;
    for (int i = threadIdx.x; i < E; i += blockDim.x) ss = rms_acc(ss, xr[i]);
    ss = block_sum(ss, sh);
    float inv = rms_inv(ss, E, eps);
    for (int i = threadIdx.x; i < E; i += blockDim.x) {
        uint16_t hi = xn[r * E + i];
        hl[r * E + i] = hi;
        hl[((size_t)T + r) * E + i] = f2bf(w[i] * (xr[i] * inv) - bf2f(hi));
    }
}

extern "C" cudaError_t cuda_kda_xsplit(const float *x, const float *w, const uint16_t *xn, int T, int E, float eps,
                                       uint16_t *hl, cudaStream_t st)
{
    if (T <= 0) return cudaSuccess;
    kda_xsplit_kernel<<<(unsigned)T, rms_threads(E), 0, st>>>(x, w, xn, T, E, eps, hl);
    return cudaGetLastError();
}

extern "C" cudaError_t cuda_kda_prepare(void)
{
    const int smem = (int)(4 * (size_t)CUDA_KDA_MAX_D * sizeof(float));
    cudaError_t e = cudaFuncSetAttribute(kda_recur_kernel<KDA_RT_NARROW>,
                                         cudaFuncAttributeMaxDynamicSharedMemorySize, smem);
    if (e != cudaSuccess) return e;
    return cudaFuncSetAttribute(kda_recur_kernel<4 * CUDA_KDA_MAX_D>, cudaFuncAttributeMaxDynamicSharedMemorySize,
                                smem);
}

extern "C" cudaError_t cuda_kda_recur(const struct cuda_kda_args *a, cudaStream_t st)
{
    if (a->n_seqs <= 0) return cudaSuccess;
    if (a->D < 1 || a->D > CUDA_KDA_MAX_D || a->K < 1 || a->K > CUDA_KDA_MAX_K || a->cols < 0 ||
        (!a->replay && !a->o32) || (a->replay && a->qkv_lo))
        return cudaErrorInvalidValue;
    int cols = a->cols ? a->cols : CUDA_KDA_COLS;
    if (cols > a->D) cols = a->D;
    int nb = (a->D + cols - 1) / cols;
    size_t smem = 4 * (size_t)a->D * sizeof(float);
    int threads = (a->D + 31) / 32 * 32, rt = (4 * cols + 31) / 32 * 32; /* four threads a column */
    if (rt < threads) rt = threads;
    const dim3 g((unsigned)(a->H * nb), (unsigned)a->n_seqs);
    if (rt <= KDA_RT_NARROW)
        kda_recur_kernel<KDA_RT_NARROW><<<g, rt, smem, st>>>(*a, cols, nb);
    else
        kda_recur_kernel<4 * CUDA_KDA_MAX_D><<<g, rt, smem, st>>>(*a, cols, nb);
    cudaError_t e = cudaGetLastError();
    if (e != cudaSuccess) return e;
    kda_out_kernel<<<dim3((unsigned)a->H, (unsigned)a->n_seqs), threads, 0, st>>>(*a);
    return cudaGetLastError();
}

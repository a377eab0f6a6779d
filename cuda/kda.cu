/* kda.cu - KDA linear attention kernels (kda.h): the state slots' start of a
 * step, and the per-(sequence, head) recurrence with the conv, the norms and
 * the gates folded in. Per element the arithmetic is model/cpu_kda.c's (the
 * same fused multiply-adds in the same order for the conv and the delta
 * rule; the norms' sums in f32 where the CPU sums in double). */
#include "cuda/bf16.cuh"
#include "cuda/kda.h"

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

/* One block per (sequence blockIdx.y, head blockIdx.x), blockDim.x >= D (a
 * multiple of 32): thread d owns channel d of the head's q, k and v (its conv
 * window) and column d of S (S[k][d] for every k). Shared memory: S [D][D],
 * then q, k, decay [D] each. */
static __global__ void kda_recur_kernel(struct cuda_kda_args a)
{
    extern __shared__ float smem[];
    __shared__ float red[32];
    const struct cuda_kda_seq q = a.seqs[blockIdx.y];
    if (q.n <= 0) return;
    const int h = blockIdx.x, D = a.D, K = a.K, H = a.H, C = H * D, d = threadIdx.x;
    const bool own = d < D;
    float *S = smem, *qs = S + (size_t)D * D, *ks = qs + D, *ds = ks + D;
    float *slot = a.states + (size_t)q.slot * a.slot_floats + a.off;
    float *Sg = slot + (size_t)h * D * D;                 /* this head's S in the slot */
    float *tail = slot + (size_t)C * D;                   /* [K-1][3C] */
    const size_t n3 = 3 * (size_t)C;

    float w[3][CUDA_KDA_MAX_K], win[3][CUDA_KDA_MAX_K];
#pragma unroll
    for (int pt = 0; pt < 3; pt++)
#pragma unroll
        for (int j = 0; j < CUDA_KDA_MAX_K; j++) {
            w[pt][j] = own && j < K ? a.conv[((size_t)pt * C + (size_t)h * D + d) * K + j] : 0.0f;
            win[pt][j] = own && j < K - 1 ? tail[(size_t)j * n3 + (size_t)pt * C + (size_t)h * D + d] : 0.0f;
        }
    if (own)
        for (int k = 0; k < D; k++) S[(size_t)k * D + d] = Sg[(size_t)k * D + d];
    const float dtb = own ? a.dt_bias[(size_t)h * D + d] : 0.0f, A = a.A[h];
    const float onw = own ? a.o_norm[d] : 0.0f, qscale = 1.0f / sqrtf((float)D);
    int snap = 0;
    for (int t = 0; t < q.n; t++) {
        const size_t row = (size_t)(q.t0 + t);
        /* the conv over the last K inputs (window, then this token), oldest first, and SiLU */
        float cv[3];
#pragma unroll
        for (int pt = 0; pt < 3; pt++) {
            float x = own ? a.qkv[row * n3 + (size_t)pt * C + (size_t)h * D + d] : 0.0f, acc = 0.0f;
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
        __syncthreads();
        float o = 0.0f;
        if (own) {
            /* decay and read: m = S^T k, column d */
            float m = 0.0f;
            for (int k = 0; k < D; k++) {
                float s = S[(size_t)k * D + d] * ds[k];
                S[(size_t)k * D + d] = s;
                m = fmaf(ks[k], s, m);
            }
            float delta = (cv[2] - m) * beta;
            /* write and output: S += k delta^T, o = S^T q */
            for (int k = 0; k < D; k++) {
                float s = fmaf(ks[k], delta, S[(size_t)k * D + d]);
                S[(size_t)k * D + d] = s;
                o = fmaf(qs[k], s, o);
            }
        }
        /* the gated RMS norm of the head's output */
        float r = 1.0f / sqrtf(kda_block_sum(own ? o * o : 0.0f, red) / (float)D + a.eps);
        if (own) a.out[row * C + (size_t)h * D + d] = f2bf(onw * (o * r) * sigm(a.gate[row * C + (size_t)h * D + d]));
        /* snapshots after this token: S and the window (the inputs before position pos) */
        while (snap < q.n_snaps && a.snaps[q.snap0 + snap].pos == q.p0 + t + 1) {
            float *sl = a.states + (size_t)a.snaps[q.snap0 + snap].slot * a.slot_floats + a.off;
            if (own) {
                for (int k = 0; k < D; k++) sl[(size_t)h * D * D + (size_t)k * D + d] = S[(size_t)k * D + d];
#pragma unroll
                for (int pt = 0; pt < 3; pt++)
#pragma unroll
                    for (int j = 0; j < CUDA_KDA_MAX_K - 1; j++)
                        if (j < K - 1)
                            sl[(size_t)C * D + (size_t)j * n3 + (size_t)pt * C + (size_t)h * D + d] = win[pt][j];
            }
            snap++;
        }
        __syncthreads(); /* qs, ks, ds are rewritten by the next token */
    }
    if (own) {
        for (int k = 0; k < D; k++) Sg[(size_t)k * D + d] = S[(size_t)k * D + d];
#pragma unroll
        for (int pt = 0; pt < 3; pt++)
#pragma unroll
            for (int j = 0; j < CUDA_KDA_MAX_K - 1; j++)
                if (j < K - 1) tail[(size_t)j * n3 + (size_t)pt * C + (size_t)h * D + d] = win[pt][j];
    }
}

extern "C" cudaError_t cuda_kda_prepare(void)
{
    return cudaFuncSetAttribute(kda_recur_kernel, cudaFuncAttributeMaxDynamicSharedMemorySize,
                                (int)(((size_t)CUDA_KDA_MAX_D * CUDA_KDA_MAX_D + 3 * CUDA_KDA_MAX_D) * sizeof(float)));
}

extern "C" cudaError_t cuda_kda_recur(const struct cuda_kda_args *a, cudaStream_t st)
{
    if (a->n_seqs <= 0) return cudaSuccess;
    if (a->D < 1 || a->D > CUDA_KDA_MAX_D || a->K < 1 || a->K > CUDA_KDA_MAX_K) return cudaErrorInvalidValue;
    size_t smem = ((size_t)a->D * a->D + 3 * (size_t)a->D) * sizeof(float);
    int threads = (a->D + 31) / 32 * 32;
    dim3 grid((unsigned)a->H, (unsigned)a->n_seqs);
    kda_recur_kernel<<<grid, threads, smem, st>>>(*a);
    return cudaGetLastError();
}

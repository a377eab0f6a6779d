/* hc.cu - the hyper-connection kernels (hc.h) and glm5_next's clamped SwiGLU.
 *
 * Simple kernels, f32 throughout. The collapse's products and sums, the
 * write-back and the mean are rounded one operation at a time (__fmul_rn,
 * __fadd_rn: no fused multiply-add), in stream order, as the CPU reference
 * (model/cpu_hc.c, built without contraction) computes them, so from the
 * same inputs they give its bits; the mixing logits m (a dot product over
 * N E values, summed in chunks) and the streams' sum of squares (f32 here,
 * double there) differ from it by rounding only. */
#include <math.h>

#include "cuda/bf16.cuh"
#include "cuda/hc.h"

#define HC_THREADS 256

static int hc_chunks(int N, int E) { return (N * E + CUDA_HC_CHUNK - 1) / CUDA_HC_CHUNK; }

extern "C" size_t cuda_hc_part_elems(int T, int N, int E)
{
    return (size_t)T * hc_chunks(N, E) * ((2 + N) * N + 1);
}

static __global__ void hc_expand_kernel(const float *x, int T, int N, int E, float *xs)
{
    size_t n = (size_t)T * N * E;
    for (size_t i = (size_t)blockIdx.x * blockDim.x + threadIdx.x; i < n; i += (size_t)gridDim.x * blockDim.x) {
        size_t t = i / ((size_t)N * E), e = i % E;
        xs[i] = x[t * E + e];
    }
}

static unsigned grid_for(size_t n)
{
    size_t b = (n + HC_THREADS - 1) / HC_THREADS;
    if (b > 132 * 16) b = 132 * 16;
    return (unsigned)(b ? b : 1);
}

extern "C" cudaError_t cuda_hc_expand(const float *x, int T, int N, int E, float *xs, cudaStream_t st)
{
    if (T <= 0) return cudaSuccess;
    hc_expand_kernel<<<grid_for((size_t)T * N * E), HC_THREADS, 0, st>>>(x, T, N, E, xs);
    return cudaGetLastError();
}

/* Block (t, s): over elements [s CHUNK, (s + 1) CHUNK) of token t's streams
 * v, each thread its elements in order, then the warps' sums in order:
 * part[t][s][m] = sum fn[m][i] v[i] for m < M, part[t][s][M] = sum v[i]^2. */
template <int N>
static __global__ void __launch_bounds__(HC_THREADS) hc_mix_kernel(const float *xs, const float *fn, int E, float *part)
{
    constexpr int M = (2 + N) * N, W = HC_THREADS / 32;
    __shared__ float sh[W][M + 1];
    const int NE = N * E, t = blockIdx.x, s = blockIdx.y, S = gridDim.y;
    const float *v = xs + (size_t)t * NE;
    float acc[M + 1];
#pragma unroll
    for (int m = 0; m <= M; m++) acc[m] = 0.0f;
    int i0 = s * CUDA_HC_CHUNK, i1 = i0 + CUDA_HC_CHUNK < NE ? i0 + CUDA_HC_CHUNK : NE;
    for (int i = i0 + threadIdx.x; i < i1; i += HC_THREADS) {
        float a = v[i];
        acc[M] = fmaf(a, a, acc[M]);
#pragma unroll
        for (int m = 0; m < M; m++) acc[m] = fmaf(fn[(size_t)m * NE + i], a, acc[m]);
    }
    int lane = threadIdx.x & 31, w = threadIdx.x >> 5;
#pragma unroll
    for (int m = 0; m <= M; m++) {
        float r = warp_sum(acc[m]);
        if (lane == 0) sh[w][m] = r;
    }
    __syncthreads();
    for (int m = threadIdx.x; m <= M; m += HC_THREADS) {
        float r = sh[0][m];
        for (int k = 1; k < W; k++) r += sh[k][m];
        part[((size_t)t * S + s) * (M + 1) + m] = r;
    }
}

static __device__ __forceinline__ float hc_sigmoid(float x) { return 1.0f / (1.0f + expf(-x)); }

/* One block per token: the chunks' sums in order, then pre, post and comb
 * as cpu_hc_pre computes them (thread i < N: pre_i, post_i; thread
 * i N + j < N N: comb_ij, each row's or column's sum in the CPU's order,
 * the passes separated by barriers), then x = sum_i pre_i xs_i. */
template <int N>
static __global__ void __launch_bounds__(HC_THREADS)
    hc_pre_kernel(const float *xs, const float *part, int S, const float *base, const float *scale, int E, int iters,
                  float eps, float norm_eps, float *x, float *post, float *comb)
{
    constexpr int M = (2 + N) * N;
    __shared__ float mix[M + 1], pre[N], cb[N * N];
    const int t = blockIdx.x, NE = N * E, tid = threadIdx.x;
    for (int m = tid; m <= M; m += HC_THREADS) {
        const float *p = part + (size_t)t * S * (M + 1) + m;
        float r = p[0];
        for (int s = 1; s < S; s++) r += p[(size_t)s * (M + 1)];
        mix[m] = r;
    }
    __syncthreads();
    /* the CPU normalises the streams first (r in double from the sum of squares) */
    const float r = (float)(1.0 / sqrt((double)mix[M] / NE + (double)norm_eps));
    const float *bs = base, *sc = scale;
    const int i = tid / N, j = tid % N; /* comb_ij for tid < N N */
    const bool mine = tid < N * N;
    if (tid < N) {
        pre[tid] = hc_sigmoid(__fadd_rn(__fmul_rn(__fmul_rn(mix[tid], r), sc[0]), bs[tid])) + eps;
        post[(size_t)t * N + tid] =
            2.0f * hc_sigmoid(__fadd_rn(__fmul_rn(__fmul_rn(mix[N + tid], r), sc[1]), bs[N + tid]));
    }
    float v = 0.0f;
    if (mine) cb[tid] = __fadd_rn(__fmul_rn(__fmul_rn(mix[2 * N + tid], r), sc[2]), bs[2 * N + tid]);
    __syncthreads();
    if (mine) { /* a softmax over each row */
        float mx = -INFINITY;
        for (int k = 0; k < N; k++) mx = cb[i * N + k] > mx ? cb[i * N + k] : mx;
        v = expf(cb[tid] - mx);
    }
    __syncthreads();
    if (mine) cb[tid] = v;
    __syncthreads();
    if (mine) {
        float sum = 0.0f;
        for (int k = 0; k < N; k++) sum += cb[i * N + k];
        v = cb[tid] / sum + eps;
    }
    __syncthreads();
    if (mine) cb[tid] = v;
    __syncthreads();
    for (int it = 0; it < iters; it++) {
        if (it > 0) { /* rows (the first pass is columns only) */
            if (mine) {
                float sum = 0.0f;
                for (int k = 0; k < N; k++) sum += cb[i * N + k];
                v = cb[tid] / (sum + eps);
            }
            __syncthreads();
            if (mine) cb[tid] = v;
            __syncthreads();
        }
        if (mine) {
            float sum = 0.0f;
            for (int k = 0; k < N; k++) sum += cb[k * N + j];
            v = cb[tid] / (sum + eps);
        }
        __syncthreads();
        if (mine) cb[tid] = v;
        __syncthreads();
    }
    if (mine) comb[(size_t)t * N * N + tid] = cb[tid];
    const float *xv = xs + (size_t)t * NE;
    float *o = x + (size_t)t * E;
    for (int e = tid; e < E; e += HC_THREADS) {
        float acc = __fmul_rn(pre[0], xv[e]);
#pragma unroll
        for (int k = 1; k < N; k++) acc = __fadd_rn(acc, __fmul_rn(pre[k], xv[(size_t)k * E + e]));
        o[e] = acc;
    }
}

template <int N>
static cudaError_t collapse_n(const float *xs, const float *fn, const float *base, const float *scale, int T, int E,
                              int iters, float eps, float norm_eps, float *part, float *x, float *post, float *comb,
                              cudaStream_t st)
{
    int S = hc_chunks(N, E);
    hc_mix_kernel<N><<<dim3(T, S), HC_THREADS, 0, st>>>(xs, fn, E, part);
    hc_pre_kernel<N><<<T, HC_THREADS, 0, st>>>(xs, part, S, base, scale, E, iters, eps, norm_eps, x, post, comb);
    return cudaGetLastError();
}

extern "C" cudaError_t cuda_hc_collapse(const float *xs, const float *fn, const float *base, const float *scale,
                                        int T, int N, int E, int iters, float eps, float norm_eps, float *part,
                                        float *x, float *post, float *comb, cudaStream_t st)
{
    if (T <= 0) return cudaSuccess;
#define HC_CASE(n) \
    case n: return collapse_n<n>(xs, fn, base, scale, T, E, iters, eps, norm_eps, part, x, post, comb, st)
    switch (N) {
        HC_CASE(1); HC_CASE(2); HC_CASE(3); HC_CASE(4); HC_CASE(5); HC_CASE(6); HC_CASE(7); HC_CASE(8);
    }
#undef HC_CASE
    return cudaErrorInvalidValue;
}

/* One thread per (token, element): every stream's value read, then written. */
template <int N>
static __global__ void hc_writeback_kernel(float *xs, const uint16_t *y, const float *post, const float *comb, int T,
                                           int E)
{
    size_t n = (size_t)T * E;
    for (size_t k = (size_t)blockIdx.x * blockDim.x + threadIdx.x; k < n; k += (size_t)gridDim.x * blockDim.x) {
        size_t t = k / E, e = k % E;
        float *v = xs + t * N * E + e, old[N];
        const float *cb = comb + t * N * N, *po = post + t * N;
        float yt = bf2f(y[k]);
#pragma unroll
        for (int i = 0; i < N; i++) old[i] = v[(size_t)i * E];
#pragma unroll
        for (int j = 0; j < N; j++) {
            float acc = __fmul_rn(cb[j], old[0]);
#pragma unroll
            for (int i = 1; i < N; i++) acc = __fadd_rn(acc, __fmul_rn(cb[i * N + j], old[i]));
            v[(size_t)j * E] = __fadd_rn(__fmul_rn(po[j], yt), acc);
        }
    }
}

extern "C" cudaError_t cuda_hc_writeback(float *xs, const uint16_t *y, const float *post, const float *comb, int T,
                                         int N, int E, cudaStream_t st)
{
    if (T <= 0) return cudaSuccess;
    unsigned g = grid_for((size_t)T * E);
#define HC_CASE(n) \
    case n: hc_writeback_kernel<n><<<g, HC_THREADS, 0, st>>>(xs, y, post, comb, T, E); break
    switch (N) {
        HC_CASE(1); HC_CASE(2); HC_CASE(3); HC_CASE(4); HC_CASE(5); HC_CASE(6); HC_CASE(7); HC_CASE(8);
    default: return cudaErrorInvalidValue;
    }
#undef HC_CASE
    return cudaGetLastError();
}

static __global__ void hc_mean_kernel(const float *xs, int T, int N, int E, float *x)
{
    size_t n = (size_t)T * E;
    for (size_t k = (size_t)blockIdx.x * blockDim.x + threadIdx.x; k < n; k += (size_t)gridDim.x * blockDim.x) {
        size_t t = k / E, e = k % E;
        const float *v = xs + t * N * E + e;
        float acc = v[0];
        for (int i = 1; i < N; i++) acc = __fadd_rn(acc, v[(size_t)i * E]);
        x[k] = acc / (float)N;
    }
}

extern "C" cudaError_t cuda_hc_mean(const float *xs, int T, int N, int E, float *x, cudaStream_t st)
{
    if (T <= 0) return cudaSuccess;
    hc_mean_kernel<<<grid_for((size_t)T * E), HC_THREADS, 0, st>>>(xs, T, N, E, x);
    return cudaGetLastError();
}

static __global__ void swiglu_limit_kernel(const float *gu, int T, int F, float lim, uint16_t *h)
{
    size_t n = (size_t)T * F;
    for (size_t i = (size_t)blockIdx.x * blockDim.x + threadIdx.x; i < n; i += (size_t)gridDim.x * blockDim.x) {
        size_t t = i / F, j = i % F;
        float g = gu[t * 2 * F + j], u = gu[t * 2 * F + F + j];
        g = g < lim ? g : lim;
        u = u < -lim ? -lim : u > lim ? lim : u;
        h[i] = f2bf(__fmul_rn(g / (1.0f + expf(-g)), u));
    }
}

extern "C" cudaError_t cuda_swiglu_limit(const float *gu, int T, int F, float limit, uint16_t *h, cudaStream_t st)
{
    if (T <= 0 || F <= 0) return cudaSuccess;
    swiglu_limit_kernel<<<grid_for((size_t)T * F), HC_THREADS, 0, st>>>(gu, T, F, limit, h);
    return cudaGetLastError();
}

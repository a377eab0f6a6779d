/* mtp.cu - the MTP layer's kernels (mtp.h): its input (two RMSNorms into one
 * row), row copies for the per-block hidden states, a plain GQA attention
 * that leaves the positions below key0 out, and the device's side of the
 * pass after a step: its verification walk, which lets the drafts follow the
 * step without the host (cuda_mtp_accept), and the draft tokens' clamp.
 * Simple on purpose (one block per row, f32 accumulation): correctness comes
 * before speed here. */
#include <math.h>

#include "cuda/bf16.cuh"
#include "cuda/mtp.h"

#define IN_THREADS 256

/* one block per token: the embedding's norm, then the hidden state's */
static __global__ void __launch_bounds__(IN_THREADS)
    in_kernel(const float *e, const uint16_t *hk, const uint16_t *hblk, const int32_t *src, const float *enorm,
              const float *hnorm, int E, float eps, uint16_t *out)
{
    __shared__ float sh[32];
    int j = blockIdx.x;
    const float *ej = e + (size_t)j * E;
    int s = src[j];
    const uint16_t *h = s >= 0 ? hk + (size_t)s * E : hblk + (size_t)(-s - 1) * E;
    uint16_t *o = out + (size_t)j * 2 * E;
    float ss = 0.0f;
    for (int i = threadIdx.x; i < E; i += IN_THREADS) ss += ej[i] * ej[i];
    float r = rsqrtf(block_sum(ss, sh) / (float)E + eps);
    for (int i = threadIdx.x; i < E; i += IN_THREADS) o[i] = f2bf(enorm[i] * (ej[i] * r));
    ss = 0.0f;
    for (int i = threadIdx.x; i < E; i += IN_THREADS) {
        float v = bf2f(h[i]);
        ss += v * v;
    }
    r = rsqrtf(block_sum(ss, sh) / (float)E + eps);
    for (int i = threadIdx.x; i < E; i += IN_THREADS) o[E + i] = f2bf(hnorm[i] * (bf2f(h[i]) * r));
}

extern "C" cudaError_t cuda_mtp_in(const float *e, const uint16_t *hk, const uint16_t *hblk, const int32_t *src,
                                   const float *enorm, const float *hnorm, int n, int E, float eps, uint16_t *out,
                                   cudaStream_t st)
{
    if (n <= 0) return cudaSuccess;
    in_kernel<<<n, IN_THREADS, 0, st>>>(e, hk, hblk, src, enorm, hnorm, E, eps, out);
    return cudaGetLastError();
}

static __global__ void rows_kernel(uint16_t *dst, const int32_t *dst_row, const uint16_t *src, const int32_t *src_row,
                                   int E)
{
    int i = blockIdx.x;
    uint16_t *d = dst + (size_t)dst_row[i] * E;
    const uint16_t *s = src + (size_t)src_row[i] * E;
    for (int c = threadIdx.x; c < E; c += blockDim.x) d[c] = s[c];
}

extern "C" cudaError_t cuda_mtp_rows(uint16_t *dst, const int32_t *dst_row, const uint16_t *src,
                                     const int32_t *src_row, int n, int E, cudaStream_t st)
{
    if (n <= 0) return cudaSuccess;
    rows_kernel<<<n, 256, 0, st>>>(dst, dst_row, src, src_row, E);
    return cudaGetLastError();
}

#define AT_WARPS 4
#define AT_DMAX 256 /* head_dim at most (the backend's creation check) */

static __device__ __forceinline__ float kv_at(const void *c, size_t i, bool kv8)
{
    if (kv8) return e4m3x2_to_f2((uint16_t)((const uint8_t *)c)[i]).x;
    return bf2f(((const uint16_t *)c)[i]);
}

/* Block (token t, head h): warp w takes keys key0 + w, key0 + w + AT_WARPS,
 * ... <= pos with an online softmax (lane: dims lane, lane + 32, ...), then
 * the warps' partial results are merged. */
static __global__ void __launch_bounds__(AT_WARPS * 32) attn_kernel(struct cuda_mtp_attn_args a)
{
    __shared__ float sm[AT_WARPS], sl[AT_WARPS];
    __shared__ float sacc[AT_WARPS][AT_DMAX];
    int t = blockIdx.x, h = blockIdx.y, lane = threadIdx.x & 31, w = threadIdx.x >> 5;
    int D = a.D, bs = a.block_size, p = a.pos[t], g = h / (a.H / a.KVH);
    const int32_t *bt = a.bt + a.tok_bt[t];
    const uint16_t *qh = a.q + ((size_t)t * a.H + h) * D;
    float q[AT_DMAX / 32], acc[AT_DMAX / 32];
#pragma unroll
    for (int i = 0; i < AT_DMAX / 32; i++) {
        int d = lane + 32 * i;
        q[i] = d < D ? bf2f(qh[d]) : 0.0f;
        acc[i] = 0.0f;
    }
    float m = -INFINITY, l = 0.0f;
    for (int j = a.key0 + w; j <= p; j += AT_WARPS) {
        size_t off = ((size_t)((int64_t)bt[j / bs] * bs + j % bs) * a.KVH + g) * D;
        float s = 0.0f;
#pragma unroll
        for (int i = 0; i < AT_DMAX / 32; i++) {
            int d = lane + 32 * i;
            if (d < D) s += q[i] * kv_at(a.kc, off + d, a.kv8);
        }
        s = warp_sum(s) * a.scale;
        float mn = fmaxf(m, s), c = __expf(m - mn), e = __expf(s - mn);
        l = l * c + e;
#pragma unroll
        for (int i = 0; i < AT_DMAX / 32; i++) {
            int d = lane + 32 * i;
            if (d < D) acc[i] = acc[i] * c + e * kv_at(a.vc, off + d, a.kv8);
        }
        m = mn;
    }
    if (lane == 0) sm[w] = m, sl[w] = l;
#pragma unroll
    for (int i = 0; i < AT_DMAX / 32; i++) {
        int d = lane + 32 * i;
        if (d < D) sacc[w][d] = acc[i];
    }
    __syncthreads();
    float M = -INFINITY, L = 0.0f;
    for (int i = 0; i < AT_WARPS; i++) M = fmaxf(M, sm[i]);
    for (int i = 0; i < AT_WARPS; i++)
        if (sm[i] > -INFINITY) L += sl[i] * __expf(sm[i] - M);
    uint16_t *o = a.out + ((size_t)t * a.H + h) * D;
    for (int d = threadIdx.x; d < D; d += AT_WARPS * 32) {
        float v = 0.0f;
        for (int i = 0; i < AT_WARPS; i++)
            if (sm[i] > -INFINITY) v += sacc[i][d] * __expf(sm[i] - M);
        o[d] = f2bf(L > 0.0f ? v / L : 0.0f);
    }
}

extern "C" cudaError_t cuda_mtp_attention(const struct cuda_mtp_attn_args *a, cudaStream_t st)
{
    if (a->T <= 0) return cudaSuccess;
    if (a->D > AT_DMAX || a->D <= 0 || a->KVH <= 0 || a->H % a->KVH) return cudaErrorInvalidValue;
    attn_kernel<<<dim3((unsigned)a->T, (unsigned)a->H), AT_WARPS * 32, 0, st>>>(*a);
    return cudaGetLastError();
}

/* one thread per draft row: the device's verification of the sequence's
 * drafts (model_sample_verify's greedy walk, as step.c's verify_greedy takes
 * it), then each iteration's inputs */
static __global__ void accept_kernel(struct cuda_mtp_accept_args a)
{
    int j = blockIdx.x * blockDim.x + threadIdx.x;
    if (j >= a.Sp) return;
    int ns = *a.ns, bs = a.block_size, p = 0, tok = 0, kd = 0, tbt = 0, src0 = 0, dst = a.pad_row;
    if (j < ns) {
        const struct cuda_mtp_dseq *q = &a.sq[j];
        int i = 0;
        for (;; i++) {
            tok = a.tok[q->row0 + i];
            if (tok < 0 || i >= q->nd || tok != q->vd[i]) break;
        }
        p = q->a + i, src0 = q->q0 + i, tbt = q->tbt;
        kd = q->cover - 1 - p;
        kd = kd < 0 ? 0 : kd > a.K ? a.K : kd;
        dst = a.bt[tbt + p / bs];
        a.out_p[j] = p, a.out_k[j] = kd, a.out_tok[j] = tok;
        if (tok < 0 || tok >= a.V) tok = 0; /* not finite: the host refuses the row; any token drafts alike */
    }
    a.kdst[j] = dst, a.ksrc[j] = src0;
    size_t rb = CUDA_MTP_R_BYTES(a.Sp);
    for (int it = 0; it < a.K; it++) {
        uint8_t *r = a.r1 + (size_t)it * rb;
        bool on = j < ns && it < kd;
        int ps = on ? p + 1 + it : 0;
        ((int64_t *)r)[j] = on ? (int64_t)a.bt[tbt + ps / bs] * bs + ps % bs : a.pad_slot;
        ((int32_t *)(r + CUDA_MTP_R_IDS(a.Sp)))[j] = it == 0 ? tok : 0; /* later iterations read the argmax */
        ((int32_t *)(r + CUDA_MTP_R_POS(a.Sp)))[j] = ps;
        ((int32_t *)(r + CUDA_MTP_R_TBT(a.Sp)))[j] = on ? tbt : 0;
        ((int32_t *)(r + CUDA_MTP_R_SRC(a.Sp)))[j] = it == 0 ? src0 : a.g0 + j;
    }
}

extern "C" cudaError_t cuda_mtp_accept(const struct cuda_mtp_accept_args *a, cudaStream_t st)
{
    if (a->Sp <= 0) return cudaSuccess;
    accept_kernel<<<(a->Sp + 127) / 128, 128, 0, st>>>(*a);
    return cudaGetLastError();
}

static __global__ void fix_ids_kernel(int32_t *ids, int n, int V)
{
    int i = blockIdx.x * blockDim.x + threadIdx.x;
    if (i < n && (ids[i] < 0 || ids[i] >= V)) ids[i] = 0;
}

extern "C" cudaError_t cuda_mtp_fix_ids(int32_t *ids, int n, int V, cudaStream_t st)
{
    if (n <= 0) return cudaSuccess;
    fix_ids_kernel<<<(n + 127) / 128, 128, 0, st>>>(ids, n, V);
    return cudaGetLastError();
}

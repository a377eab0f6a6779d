/* mla_expand.cu - the expanded form's small kernels (mla.h): the queries
 * to bf16 rows of the attention's key width, the gather of each sequence's
 * paged entries into the scratch (latents for the up-projection, the rope
 * key into every head's K), and the absorbed tokens' gather and scatter
 * for steps that hold both forms. The up-projections (cuBLAS) and the
 * attention (attn.cu) are mla.c's launches. Memory-bound copies, one warp
 * a row. */
#include "cuda/bf16.cuh"
#include "cuda/mla.h"

#define XROWS 8 /* rows a block: one a warp */

static __global__ void xq_kernel(const float *q, int T, int H, int Dq, int DK, uint16_t *xq)
{
    size_t n = (size_t)T * H * (DK / 2);
    for (size_t j = (size_t)blockIdx.x * blockDim.x + threadIdx.x; j < n; j += (size_t)gridDim.x * blockDim.x) {
        size_t row = j / (DK / 2);
        int c = (int)(j % (DK / 2)) * 2;
        const float *qr = q + row * Dq;
        float v0 = c < Dq ? qr[c] : 0.0f, v1 = c + 1 < Dq ? qr[c + 1] : 0.0f;
        ((uint32_t *)xq)[j] = (uint32_t)f2bf(v0) | ((uint32_t)f2bf(v1) << 16);
    }
}

extern "C" cudaError_t cuda_mla_xq(const float *q, int T, int H, int Dq, int DK, uint16_t *xq, cudaStream_t st)
{
    if (T <= 0) return cudaSuccess;
    if (DK % 2 || Dq > DK) return cudaErrorInvalidValue;
    size_t n = (size_t)T * H * (DK / 2);
    int blocks = (int)((n + 255) / 256 < 4096 ? (n + 255) / 256 : 4096);
    xq_kernel<<<blocks, 256, 0, st>>>(q, T, H, Dq, DK, xq);
    return cudaGetLastError();
}

/* two cache values from element i (even) as a bf16 pair, low half the first (e4m3 is exact in bf16) */
static __device__ __forceinline__ uint32_t ld2(const void *c, size_t i, bool kv8)
{
    if (kv8) {
        uint16_t w = ((const uint16_t *)c)[i / 2];
        __half_raw h0 = __nv_cvt_fp8_to_halfraw((__nv_fp8_storage_t)(w & 0xff), __NV_E4M3);
        __half_raw h1 = __nv_cvt_fp8_to_halfraw((__nv_fp8_storage_t)(w >> 8), __NV_E4M3);
        float f0 = __half2float(*(const __half *)&h0), f1 = __half2float(*(const __half *)&h1);
        return (__float_as_uint(f0) >> 16) | (__float_as_uint(f1) & 0xffff0000u);
    }
    return ((const uint32_t *)c)[i / 2];
}

/* block (x, s): rows x * XROWS .. of sequence s, one a warp */
static __global__ void xgather_kernel(struct cuda_mla_xg_args a)
{
    const struct cuda_mla_xseq sq = a.seqs[blockIdx.y];
    int j = blockIdx.x * XROWS + (threadIdx.x >> 5), lane = threadIdx.x & 31;
    if (j >= sq.n) return;
    int bs = a.block_size;
    int64_t slot = (int64_t)a.bt[sq.bt0 + j / bs] * bs + j % bs;
    size_t e = (size_t)slot * a.W, r = (size_t)sq.row0 + j;
    uint32_t *lat = (uint32_t *)(a.lat + r * a.C);
    for (int c = lane; c < a.C / 2; c += 32) lat[c] = ld2(a.cache, e + 2 * c, a.kv8);
    /* every head's K: the rope key after the nope part (the up-projection writes that), zeros to DK */
    int tail = a.DK - a.Dn;
    uint16_t *k = a.k + r * a.H * a.DK + a.Dn;
    for (int i = lane; i < a.H * tail; i += 32) {
        int h = i / tail, c = i % tail;
        uint16_t x = 0;
        if (c < a.R) {
            uint32_t p = ld2(a.cache, e + a.C + (c & ~1), a.kv8);
            x = (uint16_t)(c & 1 ? p >> 16 : p);
        }
        k[(size_t)h * a.DK + c] = x;
    }
    /* V's padding columns zero (the scratch may have held the absorbed tokens' rows) */
    int vt = a.DV - a.Dv;
    if (vt > 0) {
        uint16_t *vr = a.v + r * a.H * a.DV + a.Dv;
        for (int i = lane; i < a.H * vt; i += 32) vr[(size_t)(i / vt) * a.DV + i % vt] = 0;
    }
}

extern "C" cudaError_t cuda_mla_xgather(const struct cuda_mla_xg_args *a, cudaStream_t st)
{
    if (a->n_seqs <= 0 || a->max_n <= 0) return cudaSuccess;
    if (a->C % 2 || a->R % 2 || a->W % 2 || a->Dn + a->R > a->DK || a->Dv > a->DV || (a->DV > a->Dv && !a->v))
        return cudaErrorInvalidValue;
    dim3 grid((a->max_n + XROWS - 1) / XROWS, a->n_seqs);
    xgather_kernel<<<grid, 32 * XROWS, 0, st>>>(*a);
    return cudaGetLastError();
}

static __global__ void compact_kernel(const int32_t *idx, const float *q, const uint16_t *qn, const int32_t *pos,
                                      const int32_t *tok_bt, int nq, int nn, struct cuda_mla_comp c)
{
    int i = blockIdx.x, t = idx[i];
    const float *qs = q + (size_t)t * nq;
    float *qd = c.q + (size_t)i * nq;
    for (int j = threadIdx.x; j < nq; j += blockDim.x) qd[j] = qs[j];
    const uint16_t *ns = qn + (size_t)t * nn;
    uint16_t *nd = c.qn + (size_t)i * nn;
    for (int j = threadIdx.x; j < nn; j += blockDim.x) nd[j] = ns[j];
    if (threadIdx.x == 0) c.pos[i] = pos[t], c.tok_bt[i] = tok_bt[t];
}

extern "C" cudaError_t cuda_mla_compact(const int32_t *idx, int n, const float *q, const uint16_t *qn,
                                        const int32_t *pos, const int32_t *tok_bt, int H, int Dq, int Dn,
                                        const struct cuda_mla_comp *c, cudaStream_t st)
{
    if (n <= 0) return cudaSuccess;
    compact_kernel<<<n, 256, 0, st>>>(idx, q, qn, pos, tok_bt, H * Dq, H * Dn, *c);
    return cudaGetLastError();
}

static __global__ void scatter_kernel(const int32_t *idx, const uint32_t *src, int w2, uint32_t *dst)
{
    int i = blockIdx.x;
    const uint32_t *s = src + (size_t)i * w2;
    uint32_t *d = dst + (size_t)idx[i] * w2;
    for (int j = threadIdx.x; j < w2; j += blockDim.x) d[j] = s[j];
}

extern "C" cudaError_t cuda_mla_scatter(const int32_t *idx, int n, const uint16_t *src, int w, uint16_t *dst,
                                        cudaStream_t st)
{
    if (n <= 0) return cudaSuccess;
    if (w % 2) return cudaErrorInvalidValue;
    scatter_kernel<<<n, 256, 0, st>>>(idx, (const uint32_t *)src, w / 2, (uint32_t *)dst);
    return cudaGetLastError();
}

/* qgemm.h - y = x W^T with W packed int4/int8 (W4A16, W8A16): the GPU
 * backend's mixed-input GEMMs (qgemm.cu; internal to cuda/).
 *
 * W is in the one device layout every checkpoint format is converted to at
 * upload (model/model.h, struct model_qrepack, which is its host image):
 * per output row the codes along the input dimension (int4 low nibble
 * first), rows padded to 16 bytes; f16 or bf16 scales [rows][n_groups];
 * uint8 zero codes [rows][n_groups] or none (2^(bits-1)); act-order weights
 * have their columns sorted by group once at upload and a permutation the
 * activations are gathered through.
 *
 * Numerics: each weight is (code - zero) * scale, exact in f32, rounded to
 * the scale's dtype, as the CPU reference (quant_deq_row) does; products
 * and sums in f32. The GEMV keeps the f16 value; the dequantize + cuBLAS
 * path (larger T) stores bf16 tiles, which rounds f16 weights once more (as
 * the backend does for f16 checkpoints).
 */
#ifndef SLUICE_CUDA_QGEMM_H
#define SLUICE_CUDA_QGEMM_H

#include <cublas_v2.h>
#include <cuda_runtime.h>
#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>

#ifdef __cplusplus
extern "C" {
#endif

#define CUDA_QGEMV_MAX_T 8      /* rows of x the GEMV takes on any weight */
#define CUDA_QGEMV_MMA_MAX_T 64 /* ... and on its tensor-core kernel (qgemm.cu says which weights) */

/* A packed weight on the device (pointers device memory, 16-byte aligned). */
struct cuda_qmat {
    int bits;               /* 4 or 8 */
    int rows, cols;         /* out, in */
    int group, n_groups;    /* columns per group (a multiple of 8, or >= cols when n_groups == 1) */
    int row_bytes;          /* a multiple of 16, >= cols * bits / 8 */
    bool f16;               /* scales are f16, else bf16 */
    const uint8_t *qw;      /* [rows][row_bytes] */
    const uint16_t *scales; /* [rows][n_groups] */
    const uint8_t *zeros;   /* [rows][n_groups], or NULL */
    const int32_t *perm;    /* [cols]: position k holds column perm[k] of x (act-order), or NULL */
};

/* Scratch memory of cuda_qgemm (device): xperm [T][cols] bf16 for
 * act-order weights in the GEMV (T up to CUDA_QGEMV_MMA_MAX_T; a step whose
 * gathered x does not fit takes the dequantizing path, or fails at T <=
 * CUDA_QGEMV_MAX_T); deq, deq_bytes >= one row of the weight in bf16, for
 * the dequantized tiles of larger steps (the weight is done in as many row
 * tiles as fit). */
struct cuda_qgemm_ws {
    uint16_t *xperm;
    size_t xperm_elems;
    uint16_t *deq;
    size_t deq_bytes;
};

/* y[t][j] (row stride ldy elements, f32 when yf32 else bf16) = sum_k
 * x[t][k] W[j][k] for t < T, j < w->rows; x [T][cols] bf16 contiguous.
 * T <= CUDA_QGEMV_MAX_T, or CUDA_QGEMV_MMA_MAX_T where the tensor-core
 * kernel takes W: the GEMV (reads W once for all T rows); else row tiles of
 * W dequantized to bf16 into ws->deq, each multiplied by cuBLAS (blas must
 * be bound to st). Enqueues only; no allocation, no host logic
 * that depends on data (graph capture safe). Returns
 * CUBLAS_STATUS_EXECUTION_FAILED for a failed kernel launch,
 * CUBLAS_STATUS_INVALID_VALUE for a workspace too small. */
cublasStatus_t cuda_qgemm(const struct cuda_qmat *w, const uint16_t *x, void *y, bool yf32, int ldy, int T,
                          const struct cuda_qgemm_ws *ws, cublasHandle_t blas, cudaStream_t st);

/* The gate|up projection with SwiGLU: W holds F = rows / 2 gate rows, then
 * F up rows; h[t][j] = bf16(silu(g) * u) of the bf16-rounded outputs j and
 * F + j, bit for bit cuda_qgemm into gu [T][2F] followed by cuda_swiglu
 * (which it runs where the fused kernel does not apply: from
 * CUDA_QGEMM_SWIGLU_MIN_T to CUDA_QGEMM_SWIGLU_MAX_T rows on the tensor-core
 * GEMV's weights). h [T][F]. Below 9 rows the GEMV then cuda_swiglu is
 * faster (H100, 28672 x 4096 int4 g128: 36.8 us + the SwiGLU against 48.1
 * fused at 1 row); at 16 the fused kernel wins (72.8 against 86.3 us). */
#define CUDA_QGEMM_SWIGLU_MIN_T (CUDA_QGEMV_MAX_T + 1)
#define CUDA_QGEMM_SWIGLU_MAX_T 16
cublasStatus_t cuda_qgemm_swiglu(const struct cuda_qmat *w, const uint16_t *x, uint16_t *h, uint16_t *gu, int T,
                                 const struct cuda_qgemm_ws *ws, cublasHandle_t blas, cudaStream_t st);

/* The pieces, for tests: the GEMV alone (T as above; x already in W's
 * column order) and the dequantization of rows [r0, r0 + nr) to
 * bf16 [nr][cols] in x's column order. */
cudaError_t cuda_qgemv(const struct cuda_qmat *w, const uint16_t *x, void *y, bool yf32, int ldy, int T,
                       cudaStream_t st);
cudaError_t cuda_qdequant(const struct cuda_qmat *w, int r0, int nr, uint16_t *out, cudaStream_t st);
/* Decode's fused forms, on the tensor-core GEMV's weights without act order
 * (cuda_qgemv_fuses; norm: with up to 4096 columns, the norm prologue's
 * registers): cuda_qgemv_rmsnorm, y = bf16(rmsnorm(x) W^T) for one
 * row of x (f32) with norm weight nw: the norm in the GEMV's prologue, bit
 * for bit cuda_add_rmsnorm (no delta) then cuda_qgemv; cuda_qgemv_residual,
 * resid[t][j] += bf16(x[t] W^T)[j] (T up to CUDA_QGEMV_MMA_MAX_T, resid
 * [T][rows]): bit for bit cuda_qgemv into a bf16 delta, then
 * cuda_add_rmsnorm's add. One launch each where the unfused forms take two. */
bool cuda_qgemv_fuses(const struct cuda_qmat *w, bool norm);
cudaError_t cuda_qgemv_rmsnorm(const struct cuda_qmat *w, const float *x, const float *nw, float eps, uint16_t *y,
                               cudaStream_t st);
cudaError_t cuda_qgemv_residual(const struct cuda_qmat *w, const uint16_t *x, float *resid, int T, cudaStream_t st);
/* Which GEMV kernel cuda_qgemv runs, for tests and benchmarks: 0 the SIMT
 * kernel for every weight; 1 (the default) the tensor-core kernel where the
 * weight allows it (bf16 scales, cols a multiple of 8, groups a multiple of
 * 32 columns for int4, 16 for int8, or per channel), the SIMT one
 * elsewhere. Process-wide; set it outside graph capture. */
void cuda_qgemv_select(int variant);

#ifdef __cplusplus
}
#endif
#endif

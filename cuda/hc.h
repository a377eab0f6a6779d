/* hc.h - hyper-connection streams (mHC, MODEL_RESID_HC) on the GPU backend
 * (internal to cuda/): the kernels (hc.cu) and the step's residual code for
 * such layers (hc.c), which does exactly what model/cpu_hc.c does. Per
 * token, with N = hc_mult streams of E values, at each of a layer's two
 * sites (0 before the mixer, 1 before the FFN):
 *   in:  m = fn . (xs / rms(xs)); pre, post, comb (Sinkhorn-normalised) from
 *        m, base and scale; x = sum_i pre_i xs_i; k->xn = rmsnorm(x) with the
 *        block's norm weight
 *   out: xs_j = post_j delta + sum_i comb_ij xs_i       (delta: the block's output)
 * and the head reads the streams' mean. The streams are f32 [T][N][E] per
 * rank; with N > 1 ranks every rank holds all of them and computes the same
 * (the blocks' outputs are already summed over ranks, identically on every
 * rank), so tensor parallelism needs nothing more. */
#ifndef SLUICE_CUDA_HC_H
#define SLUICE_CUDA_HC_H

#include <cuda_runtime.h>
#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>

#ifdef __cplusplus
extern "C" {
#endif

#define CUDA_HC_MAX_N 8          /* streams the kernels take (hc_mult; glm5_next: 4) */
#define CUDA_HC_CHUNK 1024       /* elements of a token's N E streams per block of cuda_hc_collapse's first pass */

/* ---- hc.cu: the kernels ---- */

/* xs[t][i][:] = x[t][:] for i < N (the embedding into every stream). */
cudaError_t cuda_hc_expand(const float *x, int T, int N, int E, float *xs, cudaStream_t st);
/* Floats of cuda_hc_collapse's scratch `part` for T tokens. */
size_t cuda_hc_part_elems(int T, int N, int E);
/* The collapse of one site for T tokens: from the streams xs [T][N][E] f32
 * and the site's fn [(2+N) N][N E], base [(2+N) N], scale [3] (f32,
 * device), x [T][E] f32 = sum_i pre_i xs_i, and the token's post [T][N] and
 * Sinkhorn-normalised comb [T][N][N] (iters iterations, the first over
 * columns only, as cpu_hc.c) for cuda_hc_writeback. eps: hc_eps; norm_eps:
 * the streams' unweighted RMS norm's. part: cuda_hc_part_elems floats. Two
 * launches: each block of the first sums fn . xs and xs . xs over one
 * CUDA_HC_CHUNK of a token (f32, fixed order); the second, one block per
 * token, adds the chunks in order and does the rest. N <= CUDA_HC_MAX_N. */
cudaError_t cuda_hc_collapse(const float *xs, const float *fn, const float *base, const float *scale, int T, int N,
                             int E, int iters, float eps, float norm_eps, float *part, float *x, float *post,
                             float *comb, cudaStream_t st);
/* The write-back: xs[t][j][e] = post[t][j] y[t][e] + sum_i comb[t][i][j] xs[t][i][e]
 * (in stream order), y [T][E] bf16 the block's output. */
cudaError_t cuda_hc_writeback(float *xs, const uint16_t *y, const float *post, const float *comb, int T, int N,
                              int E, cudaStream_t st);
/* x[t][e] = (sum_i xs[t][i][e]) / N: what the head normalises (Glm5NextTextHyperHead). */
cudaError_t cuda_hc_mean(const float *xs, int T, int N, int E, float *x, cudaStream_t st);
/* glm5_next's clamped SwiGLU over the fused gate|up projection gu [T][2F]
 * f32: g = min(gate, limit), u = clamp(up, -limit, limit),
 * h[t][i] = bf16(g / (1 + exp(-g)) u), as the CPU backend's dense FFN.
 * gate|up stay f32 (the GEMM's f32 output) where other models' are bf16: on
 * glm5-kda (tests/gpu/test_gpu_e2e.c) rounding them to bf16 alone moved the
 * logits 3.5e-2 of max|logit| on the CPU, and with every other bf16 tensor
 * of the GPU's step took them from 4.0e-2 to 7.1e-2, past bf16 tolerance. */
cudaError_t cuda_swiglu_limit(const float *gu, int T, int F, float limit, uint16_t *h, cudaStream_t st);

/* ---- hc.c: the step's residual for MODEL_RESID_HC layers ---- */

struct rank;
struct model_config;
struct model_backend;

/* A layer's two sites on a rank, f32 device copies: [0] before the mixer, [1] before the FFN. */
struct cuda_hc_layer {
    float *fn[2];    /* [(2+N) N][N E] */
    float *base[2];  /* [(2+N) N] */
    float *scale[2]; /* [3] */
};
/* A rank's streams and the sites' scratch, sized for b->max_tokens. */
struct cuda_hc_rank {
    float *xs;       /* [T][N][E] the residual streams */
    float *part;     /* cuda_hc_part_elems */
    float *post;     /* [T][N] the last collapse's, for its write-back */
    float *comb;     /* [T][N][N] */
    float *trace;    /* host, or NULL: cuda_backend_trace's destination (rank 0) */
};

/* At creation: whether the GPU takes c's hyper-connections (streams up to
 * CUDA_HC_MAX_N); 0, or SL_EUNSUP with a message. */
int cuda_hc_check(const struct model_config *c, char *err, size_t errlen);
/* Layer l's sites onto rank k (k->L[l].hc); the first call also allocates
 * the rank's streams and scratch (k->hcx). */
int cuda_hc_upload(struct rank *k, int l, char *err, size_t errlen);
/* Frees layer l's sites, and the rank's part if still held. */
void cuda_hc_free(struct rank *k, int l);
/* After the embedding (in k->x): every stream of T tokens gets it; trace entry 0. */
int cuda_hc_begin(struct rank *k, int T, char *err, size_t errlen);
/* Site `site` of layer l: the streams' collapse, normalised with the
 * block's norm weight (attn_norm, ffn_norm), into k->xn (k->x holds the
 * collapse in f32 meanwhile). */
int cuda_hc_in(struct rank *k, int l, int site, int T, char *err, size_t errlen);
/* After the block: its output k->delta written back into the streams;
 * after site 1, trace entry l + 1. */
int cuda_hc_out(struct rank *k, int l, int site, int T, char *err, size_t errlen);
/* Before the head: the streams' mean into k->x (the final norm reads it). */
int cuda_hc_final(struct rank *k, int T, char *err, size_t errlen);

/* Tests: after every layer of each later forward, rank 0's streams of all
 * the step's tokens are copied into dst (host): [n_layer + 1][n_tokens][hc]
 * [n_embd], entry 0 the embedding, as cpu_backend_trace. A model with
 * hyper-connections only, and a backend made with enforce_eager (a step
 * captured into a graph fails saying so). NULL stops it. */
void cuda_backend_trace(struct model_backend *b, float *dst);

#ifdef __cplusplus
}
#endif
#endif

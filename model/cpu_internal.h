/* cpu_internal.h - what the CPU backend's layer kinds in other files share
 * with model/cpu_backend.c (internal to model/): the weight-matrix view and
 * the kernels, with cpu_backend.c's batch-invariance contract (one fixed
 * accumulation order per output element, whatever the batch), the MLA and
 * KDA mixers' entry points (model/cpu_mla.c, model/cpu_kda.c) and the
 * hyper-connection sites' (model/cpu_hc.c). */
#ifndef SLUICE_CPU_INTERNAL_H
#define SLUICE_CPU_INTERNAL_H

#include <stddef.h>
#include <stdint.h>

#include "backend.h"

/* A weight matrix [rows][in] in its stored encoding, borrowed from the model. */
struct wmat {
    enum model_dtype dt;
    const uint8_t *data;
    size_t row_bytes;
    int in;
    const struct model_quant *quant; /* MODEL_DT_QPACK: the packed layout (model/quant.c dequantizes) */
};

struct cpu_backend;

/* y[T][out] = x[T][in] . w[out][in]^T (+ bias): OpenMP over output rows; in
 * must not exceed the widest input the backend was sized for. */
void cpu_matmul(const struct cpu_backend *b, float *y, const float *x, const struct wmat *w, const float *bias, int T,
                int in, int out);
/* y = x / rms(x) * w over n (the sum of squares in double). */
void cpu_rmsnorm(float *y, const float *x, const float *w, int n, float eps);
/* The dot product every kernel uses (its fixed accumulation order). */
float cpu_dot(const float *w, const float *x, int n);
/* o[d] += p * v[d], a separate multiply and add each. */
void cpu_axpy(float *o, float p, const float *v, int n);
/* Row r of w as f32 into dst[w->in]. */
void cpu_deq_row(const struct wmat *w, int64_t r, float *dst);
int cpu_wmat_init(struct wmat *m, const struct model_tensor *t, char *err, size_t errlen);
int cpu_threads(const struct cpu_backend *b);
/* 64-byte aligned, zeroed; NULL when out of memory (free() releases it). */
void *cpu_zalloc(size_t n);

/* Binding a layer kind's weights at creation. VEC points dst at the next n
 * floats of the cursor p (a float * the caller declares, into one block it
 * sized) and copies t's first n elements there as f32; MAT binds a matrix
 * view of t, or sets err/errlen and goes to the caller's fail label. */
#define VEC(dst, t, n)                                                                             \
    do {                                                                                           \
        (dst) = p;                                                                                 \
        model_tensor_to_f32((t), 0, (int64_t)(n), p);                                              \
        p += (n);                                                                                  \
    } while (0)
#define MAT(dst, t)                                                                                \
    do {                                                                                           \
        if (cpu_wmat_init(&(dst), (t), err, errlen)) goto fail;                                    \
    } while (0)

/* ---- MLA (model/cpu_mla.c) ---- */

struct cpu_mla;
/* The widest matrix input an MLA layer of c multiplies (sizes the backend's
 * dequantization scratch); 0 without MLA layers. */
int cpu_mla_max_in(const struct model_config *c);
/* Converts the MLA layers' small weights, binds the matrices and allocates
 * the scratch for max_tokens tokens over contexts of max_ctx. NULL with a
 * message on failure. */
struct cpu_mla *cpu_mla_create(const struct cpu_backend *b, const struct model_config *c,
                               const struct model_weights *w, int max_tokens, int max_ctx, char *err, size_t errlen);
/* One MLA layer over the step: dst[T][n_embd] += o(attention(norm(x))),
 * reading and writing layer l's paged entries kv
 * ([kv_blocks][block_size][entry] f32, entry = model_kv_token_elems).
 * tok_seq[t] is token t's sequence. dst may be x. Keys before position key0
 * are not attended (1 for an MTP layer, which has no entry at 0; key0 > 0
 * needs the layer without a DSA indexer). */
void cpu_mla_mixer(struct cpu_mla *a, const struct cpu_backend *b, const struct step *s, const int *tok_seq, int l,
                   const float *x, float *dst, float *kv, int block_size, int key0);
void cpu_mla_destroy(struct cpu_mla *a);
/* Where later layers write their indexer margins (cpu_backend_index_margins),
 * or NULL. */
void cpu_mla_index_margins(struct cpu_mla *a, float *dst);

/* ---- KDA (model/cpu_kda.c) ---- */

struct cpu_kda;
/* The widest matrix input a KDA layer of c multiplies; 0 without KDA layers. */
int cpu_kda_max_in(const struct model_config *c);
/* Converts the KDA layers' small weights (conv taps, dt_bias, exp(A_log),
 * o_norm) to f32, binds the matrices and allocates the scratch for
 * max_tokens tokens. NULL with a message on failure. */
struct cpu_kda *cpu_kda_create(const struct cpu_backend *b, const struct model_config *c,
                               const struct model_weights *w, int max_tokens, char *err, size_t errlen);
/* Before a step's first layer: each sequence's state slot (states
 * [n_slots][model_state_bytes / 4] f32) zeroed when its first query position
 * is 0, or copied from slot state_from (state_restore). */
void cpu_kda_begin(const struct cpu_kda *a, const struct step *s, float *states);
/* One KDA layer over the step: out[T][n_embd] = the layer's output for the
 * normed input xn[T][n_embd] (no residual added); each sequence's tokens run
 * in order from its slot's state, which is left after its last token, and the
 * step's snapshots are written into their slots. */
void cpu_kda_mixer(struct cpu_kda *a, const struct cpu_backend *b, const struct step *s, int l, const float *xn,
                   float *out, float *states);
/* The delta rule in chunks of `chunk` tokens (the chunked form, cuda/kda_chunk.cu's
 * reference: cpu_kda.c), or token by token (0, the default). Chunks lie on the
 * absolute position grid (multiples of chunk) and end at snapshots, so a
 * prompt split across steps at grid points gives the bits of one pass; other
 * splits agree to f32 rounding. 0, or SL_ENOMEM / SL_EINVAL. */
int cpu_kda_set_chunk(struct cpu_kda *a, int chunk);
void cpu_kda_destroy(struct cpu_kda *a);

/* A backend that runs only the kernels above (cpu_matmul...): nt threads,
 * matrix inputs up to max_in wide. For running one layer kind alone (tests);
 * free with cpu_kernels_destroy. NULL when out of memory. */
struct cpu_backend *cpu_kernels_create(int nt, int max_in);
void cpu_kernels_destroy(struct cpu_backend *b);

/* ---- hyper-connections (model/cpu_hc.c) ---- */

struct cpu_hc;
/* Converts every MODEL_RESID_HC layer's two sites (fn stays in its stored
 * encoding, base and scale become f32) and sizes the scratch for max_tokens
 * tokens. NULL with a message on failure. */
struct cpu_hc *cpu_hc_create(const struct model_config *c, const struct model_weights *w, int max_tokens, char *err,
                             size_t errlen);
/* Site `site` (0: before the mixer, 1: before the FFN) of layer l over T
 * tokens: from the streams xs[T][hc][n_embd], the block's input x[T][n_embd]
 * (the pre-weighted sum of the streams); the post and comb weights of each
 * token are kept for cpu_hc_post. */
void cpu_hc_pre(struct cpu_hc *h, const struct cpu_backend *b, int l, int site, const float *xs, float *x, int T);
/* xs[t][j] = post[t][j] y[t] + sum_i comb[t][i][j] xs[t][i], with the last
 * cpu_hc_pre's weights. */
void cpu_hc_post(struct cpu_hc *h, float *xs, const float *y, int T);
void cpu_hc_destroy(struct cpu_hc *h);

/* Tests: after every layer of each later forward, the residual of all the
 * step's tokens is copied into dst: [n_layer + 1][n_tokens][hc][n_embd]
 * (hc 1 for a plain residual; entry 0 is the embedding). NULL stops it. */
void cpu_backend_trace(model_backend *b, float *dst);
/* Tests: the CUDA backend's bf16 roundings emulated on the CPU backend's
 * f32 path, by family (the device tests' tolerances come from what they
 * move: tests/test_kda.c, tests/gpu/test_gpu_e2e.c). Each family rounds to
 * bf16 (nearest even) a tensor the GPU keeps in bf16:
 *   CPU_BF16_XN      the blocks' normed inputs (MLA, dense and MoE FFNs,
 *                    KDA's f_a, b, g_a; not KDA's q|k|v, which the GPU
 *                    takes from xn in two parts);
 *   CPU_BF16_KDA     KDA's f_a and g_a outputs and its normed, gated output
 *                    (o_proj's input);
 *   CPU_BF16_MLA     MLA's normed q latent, its cache entries and the
 *                    attention's output (o_proj's input);
 *   CPU_BF16_FFN     the dense FFN's h (down's input);
 *   CPU_BF16_FFN_GU  the dense FFN's gate and up (glm5_next's stay f32 on
 *                    the GPU: cuda/hc.h);
 *   CPU_BF16_DELTA   every block's output (hyper-connection models);
 *   CPU_BF16_FINAL   the final norm's output (the head's input).
 * 0 (the default) is the plain f32 reference. */
enum {
    CPU_BF16_XN = 1 << 0,
    CPU_BF16_KDA = 1 << 1,
    CPU_BF16_MLA = 1 << 2,
    CPU_BF16_FFN = 1 << 3,
    CPU_BF16_FFN_GU = 1 << 4,
    CPU_BF16_DELTA = 1 << 5,
    CPU_BF16_FINAL = 1 << 6,
};
void cpu_backend_emulate_bf16(model_backend *b, unsigned families);
/* The families b rounds (cpu_backend_emulate_bf16), and the rounding. */
unsigned cpu_bf16_families(const struct cpu_backend *b);
void cpu_round_bf16(float *x, size_t n);

/* Tests: each later forward writes every token's routing margin
 * (model_moe_route_margin: router-logit units) per layer into
 * dst[n_layer][n_tokens]: INFINITY where the layer routes nothing. A device
 * backend whose output departs from the CPU's at a token with a small margin
 * may have chosen other experts there (bf16). NULL stops it. */
void cpu_backend_route_margins(model_backend *b, float *dst);

/* Tests: each later forward writes, per layer that runs its own DSA indexer
 * and token whose query chooses (more keys, or with k-pools more whole
 * pools, than index_topk takes), the indexer's top-k margin into
 * dst[n_layer][n_tokens]: (the K-th best score - the (K+1)-th) / the
 * largest |score| of that query (relative: bf16 moves a score by a share of
 * its size), 0 on an exact tie; with k-pools the same over the pools' scores
 * (index_topk / kpool of them chosen). INFINITY where nothing is chosen
 * (every key taken, a layer sharing another's choice, no indexer). NULL
 * stops it. */
void cpu_backend_index_margins(model_backend *b, float *dst);

#endif

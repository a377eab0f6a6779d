/* kernels.h - host launchers of the GPU backend's kernels (internal to cuda/).
 *
 * One op family per .cu file: norm.cu (embedding gather, fused residual add +
 * RMSNorm), rope.cu (QKV bias, q/k RMSNorm, RoPE and the paged KV write, fused),
 * attn.cu (paged attention for mixed batches: SIMT and tensor-core kernels, split-K, and its combine),
 * gemv.cu (few-row GEMV for decode, fused norm/SwiGLU/residual variants), act.cu (SwiGLU),
 * sample.cu (argmax + log-sum-exp; the full sampler), tp.cu (what tensor parallelism adds).
 * Every pointer argument is device memory unless said otherwise; bf16 values
 * travel as uint16_t so this header stays plain C. Each launcher only
 * enqueues on `st` and returns the launch error (cudaSuccess when queued);
 * none allocates, so all of them can be captured in a CUDA graph.
 * Plain-C references of each live in tests/gpu/test_kernels.c; cuda_sample's
 * reference is model_sample itself (tests/gpu/test_sample.c).
 */
#ifndef SLUICE_CUDA_KERNELS_H
#define SLUICE_CUDA_KERNELS_H

#include <cuda_runtime.h>
#include <stdbool.h>
#include <stdint.h>

#ifdef __cplusplus
extern "C" {
#endif

/* ---- norm.cu ---- */
/* x[t][:] = float(tab[ids[t]][:]) for t < T; tab [n_vocab][E] bf16, x [T][E] f32. */
cudaError_t cuda_embed(const uint16_t *tab, const int32_t *ids, int T, int E, float *x, cudaStream_t st);
/* Fused residual add + RMSNorm over rows of E:
 *   rows == NULL: for t < T: x[t] += delta[t] (delta may be NULL); out[t] = bf16(w * x[t] / rms(x[t]))
 *   rows != NULL: for r < T: v = x[rows[r]] (+ delta[rows[r]]), not stored; out[r] = bf16(w * v / rms(v))
 * x [*][E] f32, delta [*][E] bf16, w [E] f32, out [T][E] bf16. Up to
 * CUDA_GEMV_MAX_T rows the sum of squares runs in norm.cuh's order (the fused
 * GEMV prologue's bits); larger steps without rows, E a multiple of 1024,
 * take a kernel that sums in another order. */
cudaError_t cuda_add_rmsnorm(float *x, const uint16_t *delta, const float *w, const int32_t *rows, int T,
                             int E, float eps, uint16_t *out, cudaStream_t st);

/* ---- rope.cu ---- */
struct cuda_rope_args {
    const uint16_t *qkv;    /* [T][(H + 2*KVH) * D] bf16: q heads, k heads, v heads */
    const float *bias;      /* [(H + 2*KVH) * D] or NULL (qwen2) */
    const float *q_norm, *k_norm; /* [D] or NULL (qwen3) */
    const float *cos, *sin; /* [max_ctx][rope_dim/2] */
    const int32_t *pos;     /* [T] */
    const int64_t *slots;   /* [T] KV slot of each token */
    int T, H, KVH, D, rope_dim;
    bool neox;
    float eps;
    uint16_t *q;            /* out [T][H][D] bf16 */
    void *kc, *vc;          /* KV cache of the layer: [n_slots][KVH][D] bf16, or fp8 e4m3 when kv8 */
    bool kv8;               /* the KV cache holds fp8 e4m3 (scale 1: the value rounded to nearest, saturated
                             * to +-448), not bf16 */
};
cudaError_t cuda_rope_kv(const struct cuda_rope_args *a, cudaStream_t st);

/* ---- attn.cu ---- */
/* One unit of attention work: query tokens t0 .. t0+nq-1 (one sequence,
 * consecutive in the step) against key positions [kv_lo, kv_hi) of that
 * sequence, for one KV head group (grid.y); the sequence's block table
 * starts at bt + bt0. Causal: a query at position p sees keys <= p.
 * nsplit > 1: this item is split `split` of nsplit of its tile and writes a
 * partial (max, sum, acc) row at part + row; otherwise it writes the output
 * directly. */
struct cuda_attn_item {
    int32_t bt0, t0, nq, kv_lo, kv_hi, split, nsplit, part;
};
#define CUDA_ATTN_ROWS 32   /* query rows (tokens x heads of a group) per item */
#define CUDA_ATTN_MAXSPLIT 32
/* Tensor-core path (prefill). Where cuda_attention_tc_ok(D, H / KVH) and it
 * is not turned off, a step that is not decode-only is packed with
 * CUDA_ATTN_TC_ROWS / grp tokens per item (not CUDA_ATTN_ROWS / grp), and
 * its args carry max_rows = CUDA_ATTN_TC_ROWS. Everything else about the
 * items stays the same (split-K, kv ranges, partial rows). cuda_attention()
 * runs the tensor-core kernel whenever max_rows > CUDA_ATTN_ROWS: with 4
 * warps (64-row blocks) when max_rows <= 64, else 8 warps (128-row blocks).
 * Decode-only steps keep max_rows = grp and the SIMT kernel. */
#define CUDA_ATTN_TC_ROWS 128
/* 1 when the tensor-core kernel supports head_dim D and grp = H / KVH heads
 * per KV head (D 64 or 128, grp <= CUDA_ATTN_TC_ROWS). Pure; any thread. */
int cuda_attention_tc_ok(int D, int grp);
struct cuda_attn_args {
    const uint16_t *q;          /* [T][H][D] bf16 */
    const void *kc, *vc;        /* [n_slots][KVH][D] bf16, or fp8 e4m3 when kv8 */
    bool kv8;                   /* fp8 e4m3 KV cache: every kernel widens K and V to bf16 on load (exact) and
                                 * computes as with a bf16 cache (the decode kernel: to f16) */
    const int32_t *pos;         /* [T] */
    const int32_t *bt;          /* flat block tables (an item's at bt + bt0) */
    const struct cuda_attn_item *items; /* [max_items]: a block reads its item while n_items is on its way */
    const int32_t *n_items;     /* device scalar: items beyond it are no-ops */
    int max_items;              /* grid size (>= *n_items) */
    int max_rows;               /* >= query rows (nq * H / KVH) of every item; <= CUDA_ATTN_ROWS: SIMT kernel,
                                 * <= CUDA_ATTN_TC_ROWS: tensor-core kernel (see above) */
    int H, KVH, D, block_size;
    float scale;
    float *part;                /* [n_part_rows][KVH][pstride][D + 2] f32 partials */
    int pstride;                /* splits per (part row, KV head) in part, >= every item's nsplit; 0:
                                 * CUDA_ATTN_MAXSPLIT (the decode kernel takes only that) */
    const int32_t *tok_part;    /* [T] part row of the token's first head, -1 if not split */
    const int32_t *tok_nsplit;  /* [T] */
    int T;
    uint16_t *out;              /* [T][H][D] bf16 */
    int32_t *cnt;               /* [T][KVH] split tickets, all 0 between launches (the decode kernel leaves them
                                 * 0), or NULL: with it, decode-only steps (max_rows == H / KVH and
                                 * cuda_attention_dec_ok) take the decode kernel, which merges its own splits */
    bool dec_wide;              /* decode kernel at head_dim 128 on the tensor cores: the build held to 3
                                 * blocks an SM (fewer registers; for steps of more blocks than 2 an SM:
                                 * see attn.cu) */
    struct cuda_rope_args rope; /* decode kernel only: with rope.qkv set, the kernel does cuda_rope_kv's work
                                 * for its tokens (q from rope.qkv, not q; each token's K and V written to its
                                 * slot by the split that holds its position), so cuda_rope_kv is not run */
    int Dv;                     /* V's width (vc [n_slots][KVH][Dv]), the partials' and the output's: 0 means
                                 * D. Other than D only on the tensor-core kernel at the widths
                                 * cuda_attention_tc_pair gives, with a bf16 cache (MLA's expanded form:
                                 * keys [nope | rope], values narrower) */
    int Do;                     /* the output's width per head (out [T][H][Do]): its first Do of the Dv
                                 * columns, the rest (zero padding) dropped; 0 means Dv */
};
/* Keys of Dk and values of Dv columns (Dv != Dk) on the tensor-core kernel:
 * 1 and the widths *D >= Dk, *Dv_pad >= Dv it is built for (the inputs
 * zero-padded to them), or 0 where none holds them (instances: keys 192 and
 * values 128, DeepSeek's MLA heads expanded; keys 32 and values 16, the
 * small test models'). Pure; any thread. */
int cuda_attention_tc_pair(int Dk, int Dv, int *D, int *Dv_pad);
/* Raises the tensor-core kernel's shared-memory limit for that pair (bf16
 * cache); call once before any graph capture. */
cudaError_t cuda_attention_prepare_pair(int D, int Dv);
/* 1 when the decode kernel takes head_dim D with grp heads per KV head. */
int cuda_attention_dec_ok(int D, int grp);
cudaError_t cuda_attention(const struct cuda_attn_args *a, cudaStream_t st);
/* Raises the kernel's shared-memory limit for head_dim D; call once before
 * any graph capture. */
cudaError_t cuda_attention_prepare(int D);
/* attn_wg.cu: the tensor-core path's 128-row items at head_dim 128 run on
 * Hopper's warpgroup MMA on compute capability 9.0 (cuda_attention picks
 * it). _select: on 1 / off 0 (attn.cu's kernel) for tests and benchmarks,
 * -1 the default (on where the device runs it); call it outside graph
 * capture. */
int cuda_attention_wg_ok(const struct cuda_attn_args *a);
void cuda_attention_wg_select(int on);
cudaError_t cuda_attention_wg_prepare(void);
cudaError_t cuda_attention_wg(const struct cuda_attn_args *a, cudaStream_t st);

/* ---- gemv.cu ---- */
/* Few-row GEMVs for decode and their fusions. All: T <= CUDA_GEMV_MMA_MAX_T
 * rows (past CUDA_GEMV_MAX_T, every variant takes the tensor-core kernel;
 * the norm launchers within CUDA_GEMV_NORM_SMEM), W [rows][in] bf16, in % 8 == 0, W and bf16 x 16-byte aligned, f32
 * accumulation; otherwise cudaErrorInvalidValue and nothing is launched.
 * For in >= 2048 (and cuda_gemv_select's variant != 0) every launcher here sums
 * each output in the same order, so a fusion gives bit for bit what the
 * unfused kernels give on the same data. cuda_gemv_swiglu always sums as
 * cuda_gemv does for the same T and in (the warp kernel's order where
 * cuda_gemv takes the warp kernel), so it is exact in every variant.
 * The kernels are launched with programmatic dependent launch on sm_90 (they
 * read nothing written by earlier kernels before waiting for them); see
 * gemv.cu for which kernel takes which shape. */
#define CUDA_GEMV_MAX_T 4
#define CUDA_GEMV_MMA_MAX_T 8
/* y[t][o] = sum_i x[t][i] W[o][i] for t < T: W [out][in] bf16, x [T][in]
 * bf16, y [T][out] bf16 or f32 (y_f32). */
cudaError_t cuda_gemv(const uint16_t *W, const uint16_t *x, void *y, bool y_f32, int T, int in, int out,
                      cudaStream_t st);
/* The residual add in the epilogue: xres[t][o] += float(bf16(sum_i x[t][i] W[o][i])),
 * exactly cuda_gemv to bf16 followed by cuda_add_rmsnorm's x += delta.
 * W [out][in] bf16, x [T][in] bf16, xres [T][out] f32 (must not overlap x). */
cudaError_t cuda_gemv_residual(const uint16_t *W, const uint16_t *x, float *xres, int T, int in, int out,
                               cudaStream_t st);
/* SwiGLU in the epilogue of the fused gate|up projection: with g, u the bf16
 * of rows i and F + i of x W^T, h[t][i] = bf16(silu(g) * u), exactly
 * cuda_gemv to gu [T][2F] then cuda_swiglu. Wgu [2F][in] bf16 (gate rows,
 * then up rows), x [T][in] bf16, h [T][F] bf16. */
cudaError_t cuda_gemv_swiglu(const uint16_t *Wgu, const uint16_t *x, uint16_t *h, int T, int in, int F,
                             cudaStream_t st);
/* RMSNorm in the prologue: y = bf16(xn W^T) with xn[t] = bf16(nw * x[t] / rms(x[t]))
 * computed exactly as cuda_add_rmsnorm(x, NULL, nw, NULL, T, in, eps, xn)
 * does (same bf16 values); x is only read. Except at one row with the warp
 * kernel (the batch-1 decode path) unless cuda_gemv_late(0): there y = bf16(inv(x[t]) * (bf16(nw * x[t]) W^T)), the
 * norm's scale applied to the sums (same inv; gemv.cu, norm_rows_late), so
 * the bits differ from the unfused chain's by one rounding's place. The
 * same holds for the two calls below. x [T][in] f32, nw [in] f32,
 * W [out][in] bf16, y [T][out] bf16; T * in * 2 <= CUDA_GEMV_NORM_SMEM. */
#define CUDA_GEMV_NORM_SMEM (48 * 1024)
cudaError_t cuda_gemv_rmsnorm(const uint16_t *W, const float *x, const float *nw, float eps, uint16_t *y, int T,
                              int in, int out, cudaStream_t st);
/* Both: h = cuda_gemv_swiglu(Wgu, xn) with xn as in cuda_gemv_rmsnorm.
 * x [T][in] f32, nw [in] f32, Wgu [2F][in] bf16, h [T][F] bf16. */
cudaError_t cuda_gemv_rmsnorm_swiglu(const uint16_t *Wgu, const float *x, const float *nw, float eps, uint16_t *h,
                                     int T, int in, int F, cudaStream_t st);
/* A decode layer's MLP at once: cuda_gemv_rmsnorm_swiglu(Wgu, x, nw, eps,
 * h), then cuda_gemv_residual(Wd, h, x), bit for bit. Where it can (one
 * token and gemv.cu's default kernels: cuda_gemv_mlp_tagged) the down GEMV
 * starts while the gate/up GEMV still runs and reads each value of h as
 * soon as it is stored: h goes to hw [F] instead (tag << 16 | bf16), and
 * each down warp waits for words carrying this call's tag. So a call's tag
 * (1 ... 65535) must differ from the one hw was last written with (a
 * decoder passes its layer number + 1: two layers or more, and clears hw
 * after a step cut short). hw: zero at first; NULL gives the two plain
 * launches. Wd [E][F]. */
cudaError_t cuda_gemv_mlp(const uint16_t *Wgu, const uint16_t *Wd, float *x, const float *nw, float eps, uint16_t *h,
                          int T, int E, int F, uint32_t *hw, int tag, cudaStream_t st);
/* whether cuda_gemv_mlp overlaps its two GEMVs at this shape (given hw) */
bool cuda_gemv_mlp_tagged(int T, int E, int F);
/* For benchmarks and tests: variant 0 warp, 1 block, 2 persistent, 3 auto,
 * 4 tensor-core (-1 keeps it), pdl 0/1 (-1 keeps it), ch 4/8/16 chunks per
 * lane in flight in the warp kernels for rows of <= 4096 (other values keep
 * it); the defaults are 3, 1 on sm_90 and later, 4. Not thread-safe;
 * call it outside graph capture, with no launch in flight on another thread. */
void cuda_gemv_select(int variant, int pdl, int ch);
/* For tests: the one-row norm prologue's late scale (above) on (1, and -1:
 * the default) or off (0); the same conditions as cuda_gemv_select */
void cuda_gemv_late(int on);
/* For tests: cuda_gemv_mlp's tagged gate/up GEMV on one wave of blocks (1,
 * and -1: the default) or one block per 8 rows (0); the sums are the same
 * either way */
void cuda_gemv_persist(int on);

/* ---- gemm_wg.cu ---- */
/* Prefill GEMMs on Hopper's warpgroup MMA (compute capability 9.0 only),
 * f32 accumulation in one fixed order per output whatever T. ok: this
 * device runs them (unless cuda_gemm_wg_select(0)) for these sizes (in a
 * multiple of 8, out and 2F of 16; outputs 16-byte aligned); otherwise the
 * launchers return cudaErrorInvalidValue and launch nothing. prepare: once
 * per device before the first launch.
 * select: 1/0 forces on/off (where the device can), -1 the default (on);
 * not thread-safe, for tests and benchmarks. The backend's gate|up takes
 * cuda_gemm_wg_swiglu from cuda_tuning.gemm_wg_min_t tokens a step (128:
 * below, cuBLAS + cuda_swiglu measured faster: 32 tokens 6.27 against
 * 6.59 ms a step, 64 the same, 128 7.04 against 6.91). */
int cuda_gemm_wg_ok(int T, int in, int out);
cudaError_t cuda_gemm_wg_prepare(void);
void cuda_gemm_wg_select(int on);
/* y = bf16(x W^T): W [out][in] bf16, x [T][in] bf16, y [T][out] bf16 */
cudaError_t cuda_gemm_wg(const uint16_t *W, const uint16_t *x, uint16_t *y, int T, int in, int out,
                         cudaStream_t st);
/* h[t][j] = bf16(silu(g) * u) with g, u the bf16 of rows j and F + j of
 * x Wgu^T: what cuda_swiglu makes of that product (the product's own sums
 * are this kernel's, not cuBLAS's). Wgu [2F][in] bf16, x [T][in], h [T][F]. */
cudaError_t cuda_gemm_wg_swiglu(const uint16_t *Wgu, const uint16_t *x, uint16_t *h, int T, int in, int F,
                                cudaStream_t st);

/* ---- act.cu ---- */
/* h[t][i] = bf16(silu(gu[t][i]) * gu[t][F + i]) for i < F; gu [T][2F], h [T][F] bf16. */
cudaError_t cuda_swiglu(const uint16_t *gu, int T, int F, uint16_t *h, cudaStream_t st);

/* ---- sample.cu ---- */
/* For each row r < R of logits [R][V] f32: tok[r] = argmax (lowest id on ties),
 * logprob[r] = logits[r][tok] - logsumexp(logits[r]). NaN rows give tok -1.
 * Each row is split into up to CUDA_ARGMAX_SLICES slices reduced by their own
 * blocks (tp.cu's cuda_argmax_part), then combined in slice order
 * (cuda_argmax_combine): scratch holds CUDA_ARGMAX_SLICES * R parts. */
#define CUDA_ARGMAX_SLICES 32
struct cuda_argmax_part;
cudaError_t cuda_argmax_lse(const float *logits, int R, int V, struct cuda_argmax_part *scratch, int32_t *tok,
                            float *logprob, cudaStream_t st);

/* The whole of model_sample() (model/sampler.c) on the device, one block per
 * row, so only token ids and logprobs come back. Same order of operations,
 * same float arithmetic, the same (logit desc, id asc) candidate order; the
 * sums the CPU makes in double are made in double here too (in another order
 * where the CPU sums a whole row, so they may differ in the last bits: a
 * choice can differ only where u or top_p falls within ~1e-15 of a boundary).
 * Rows must hold parameters model_sample accepts (the host validates). */
#define CUDA_SAMPLE_CAP 2048     /* most candidates sorted on the device per row */
#define CUDA_SAMPLE_MAX_TOP 20   /* == MODEL_MAX_TOP_LOGPROBS */
struct cuda_sample_row {         /* one logit row to sample, built by the host */
    double u;                    /* model_rng_uniform(request rng), drawn only when temperature > 0 &&
                                    top_k != 1, exactly as model_sample draws it; else unused */
    float temperature, top_p, min_p;
    float log_min_p;             /* logf(min_p) computed on the host (model_sample's limit, bit for bit);
                                    unused when min_p == 0 */
    float repetition_penalty, presence_penalty, frequency_penalty;
    int32_t top_k, top_logprobs; /* top_logprobs 0..CUDA_SAMPLE_MAX_TOP */
    int32_t pen_off, n_pen;      /* this row's penalty entries: pen[pen_off .. pen_off + n_pen) */
};
/* One distinct id of the row's history (prompt + generated ids); the repetition
 * penalty applies to every listed id once, presence/frequency to those with
 * count > 0. Ids must be distinct within a row and in [0, V). */
struct cuda_sample_pen {
    int32_t id;
    int32_t count;               /* occurrences among the generated ids (not the prompt) */
};
struct cuda_sample_out {
    int32_t token;               /* -1 unless status == 0 */
    float logprob;               /* of token, before temperature (as model_sample) */
    int32_t n_top;
    int32_t status;              /* 0: done. 1: not finished here (more than CUDA_SAMPLE_CAP candidates
                                    would need sorting, or top_k > CUDA_SAMPLE_CAP); the row's logits are
                                    penalized: the host runs model_sample on them with the penalties off
                                    and the rng as it was before u was drawn. -1: a NaN or +inf logit, or
                                    all -inf (model_sample fails the same way); nothing else valid */
    int32_t top_ids[CUDA_SAMPLE_MAX_TOP];
    float top_logprobs[CUDA_SAMPLE_MAX_TOP];
};
/* Samples each row r < R of logits [R][V] f32, which are penalized in place
 * as model_sample does (also for status 1 and -1 rows), into out[r]. rows [R],
 * pen (NULL when no row has entries), out [R]: device memory. */
cudaError_t cuda_sample(float *logits, int R, int V, const struct cuda_sample_row *rows,
                        const struct cuda_sample_pen *pen, struct cuda_sample_out *out, cudaStream_t st);
/* Host helper: writes the distinct ids of history (n_prompt prompt ids, then
 * the generated ones, all in [0, V)) with their generated counts to pen and
 * returns how many (<= n_history). mark [V] is host scratch that must be all
 * zero and is left all zero. */
int cuda_sample_pen_build(const int32_t *history, int n_prompt, int n_history, int32_t *mark,
                          struct cuda_sample_pen *pen);

/* ---- tp.cu (tensor parallelism) ---- */
/* x[t][:] = float(tab[ids[t] - v0][:]) when v0 <= ids[t] < v0 + vn, else 0:
 * the rank holding rows [v0, v0 + vn) of the embedding; an all-reduce (sum)
 * of x over the ranks gives the full gather. tab [vn][E] bf16, x [T][E] f32. */
cudaError_t cuda_embed_shard(const uint16_t *tab, const int32_t *ids, int T, int E, int v0, int vn, float *x,
                             cudaStream_t st);
/* dst[i] = bf16(src[i]) for i < n (round to nearest even). */
cudaError_t cuda_f32_to_bf16(const float *src, size_t n, uint16_t *dst, cudaStream_t st);
/* The one-shot all-reduce over peer memory (all ranks in one process, peer
 * access enabled between every pair): each rank's kernel signals the others
 * through flags in their memory, waits for theirs, then reads every rank's
 * f32 buffer and sums them in rank order (so every rank computes the same
 * bits), writing bf16 (rounded once), f32, or adding into an f32 residual.
 * One launch replaces an NCCL all-reduce and the conversion after it. It is
 * launched plainly (it starts once its predecessor has completed) and lets
 * a PDL-launched successor start at once.
 * Contract (the caller's): every rank makes the same calls with the same n,
 * in the same order; the kernel before this one on each rank's stream wrote
 * that rank's src; and consecutive calls use different src buffers, so a
 * rank never overwrites a buffer a slower peer may still be reading (that
 * peer has started the call after, so it has finished this one). Buffers
 * 16-byte aligned (cudaMalloc's). A nonzero *abort (host memory mapped into
 * the device) ends every wait: the outputs are then wrong, for a backend
 * that is stopping. */
#define CUDA_PEER_MAX 8     /* ranks */
#define CUDA_PEER_BLOCKS 64 /* blocks of one call at most: per-block flags */
struct cuda_peer_ar {
    const float *src[CUDA_PEER_MAX]; /* every rank's input for this call, [n] f32 */
    unsigned *flags[CUDA_PEER_MAX];  /* every rank's flags, [CUDA_PEER_BLOCKS][CUDA_PEER_MAX], zeroed at start */
    unsigned *epoch;                 /* this rank's call counters, [CUDA_PEER_BLOCKS], zeroed at start */
    const volatile int *abort;
    int n_ranks, rank;
};
/* out_bf16 [n] or out_f32 [n] (the other NULL) = the sum over the ranks of
 * src; with add, out_f32 += the sum rounded to bf16 (as a residual x += a
 * bf16 delta: cuda_add_rmsnorm's addition, bit for bit) */
cudaError_t cuda_peer_allreduce(const struct cuda_peer_ar *a, size_t n, uint16_t *out_bf16, float *out_f32, bool add,
                                cudaStream_t st);
/* A rank's reduction of one logit row over its vocabulary slice. */
struct cuda_argmax_part {
    float max;      /* largest logit of the slice */
    float sum;      /* sum of exp(logit - max) over the slice */
    int32_t id;     /* global id of the first max; -1: NaN or +inf in the slice; -2: all -inf */
    int32_t pad;
};
/* part[r] for each row r < R of logits [R][vn] f32 (ids v0 .. v0 + vn - 1). */
cudaError_t cuda_argmax_part(const float *logits, int R, int vn, int v0, struct cuda_argmax_part *part,
                             cudaStream_t st);
/* The same with each row cut into ns slices of ceil(vn / ns) logits: parts
 * [ns][R] (slice-major), to combine with N = ns. */
cudaError_t cuda_argmax_slices(const float *logits, int R, int vn, int v0, int ns, struct cuda_argmax_part *part,
                               cudaStream_t st);
/* Combines parts [N][R] (rank-major, ranks in vocabulary order) into tok[r]
 * (lowest id on ties; -1 when a slice had NaN/inf or every logit is -inf) and
 * logprob[r] = max - logsumexp, as cuda_argmax_lse does on one rank. */
cudaError_t cuda_argmax_combine(const struct cuda_argmax_part *parts, int N, int R, int32_t *tok, float *logprob,
                                cudaStream_t st);

#ifdef __cplusplus
}
#endif
#endif

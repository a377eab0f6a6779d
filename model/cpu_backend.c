/* cpu_backend.c - the CPU reference backend (model/backend.h, device "cpu").
 *
 * Plain f32 arithmetic. The big matrices stay in the checkpoint's own encoding
 * (borrowed from the model's mapping: Q4_0/Q4_1/Q8_0/F16/BF16/F32, or packed
 * int4/int8 with group scales, zero points and act-order indexes, which
 * model/quant.c dequantizes by row, whatever module holds them) and are
 * dequantized a block of rows at a time into per-thread f32 scratch right
 * before use: the f32 values are exactly those model_tensor_to_f32() gives,
 * so the result is bit-identical to dequantizing everything at creation, but
 * decode reads 4-6x fewer bytes (it is memory bound). Norm weights and biases
 * are converted to f32 at creation. The model must outlive the backend.
 *
 * The forward pass is the textbook Llama block (RMSNorm, QKV (+bias),
 * per-head q/k RMSNorm, RoPE (NORM or NEOX, llama3 scaling), causal GQA
 * attention through the block table, output projection, SwiGLU MLP; an MLA
 * layer's attention is model/cpu_mla.c's, hyper-connection streams around
 * the blocks model/cpu_hc.c's), then the
 * LM head for the rows that need logits and the sampler. Each layer writes the
 * K/V of every token in the step before any token attends, so sequences in
 * one step may share blocks (a shared prefix, or one 1-token sequence per
 * position as the parity test does). A step is validated first (ids, ranges,
 * block indices, slot == block_table[pos / bs] * bs + pos % bs): bad input
 * gets SL_EINVAL, never a crash.
 *
 * Threads: OpenMP over output rows (matmuls), (token, head) pairs
 * (attention) and sequences (sampling); the caller is the one engine thread.
 *
 * Batch invariance: every output element is computed by exactly one thread
 * with one fixed sequence of operations that depends only on the row's own
 * inputs (the dot kernels below all share one accumulation order, whatever
 * the tiling), so a sequence's logits are bit-identical whether it runs
 * alone, batched with others, chunked or decoded token by token.
 *
 * MTP (opts.mtp; backend.h says what is kept): after the step's sampling,
 * forward() runs the MTP layer over its entries as a step of its own (a
 * "sub-step": token q with position q, made from the token at q and the
 * hidden state of q - 1), through the same mixers as the decoder layers with
 * position 0 left out of attention (the MTP layer has no entry there); only
 * its KV writes matter there, so its FFN is skipped. mtp_draft() runs the
 * same layer one token per sequence, FFN and head included, k times in a
 * chain. The final-normed hidden states of the last step stay in hkeep until
 * the next forward(); each block keeps one (hblk, its position in htag) with
 * the KV.
 *
 * Memory: small weights, RoPE tables, activations for max_tokens_per_step tokens
 * (plus max_seqs_per_step with MTP: a sub-step holds at most one entry more
 * per sequence than the step), logits for max_seqs_per_step rows and
 * per-thread attention scores are all allocated at creation; forward()
 * allocates nothing.
 */
#include <math.h>
#include <omp.h>
#include <stdarg.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#if defined(__AVX2__) && defined(__FMA__)
#include <immintrin.h>
#endif

#include "backend.h"
#include "cpu_internal.h"
#include "moe.h"
#include "quant.h"

struct layer_f32 {
    float *attn_norm;               /* [n_embd] */
    struct wmat wq, wk, wv, wo;     /* [n_head*hd][n_embd], [n_kv*hd][n_embd] x2, [n_embd][n_head*hd] */
    float *bq, *bk, *bv;            /* [n_head*hd], [n_kv*hd] x2; NULL without qkv_bias */
    float *q_norm, *k_norm;         /* [hd]; NULL without qk_norm */
    float *ffn_norm;                /* [n_embd] */
    struct wmat w_gate, w_up, w_down; /* [n_ff][n_embd] x2, [n_embd][n_ff] */
};

/* An MTP layer's own parts (model_mtp_weights) */
struct mtp_f32 {
    float *enorm, *hnorm, *head_norm; /* [n_embd] */
    struct wmat eh;                 /* [n_embd][2 n_embd] */
};

struct cpu_backend {
    struct model_backend base;
    struct model_config c;          /* the model's, n_mtp_layer 0 unless opts.mtp */
    int nt;                         /* OpenMP threads */
    int max_tokens, max_seqs, max_ctx;
    int max_draft, max_rows;        /* drafts a sequence at most; logits rows a step (max_seqs each 1 + max_draft) */
    int cap;                        /* rows of token scratch: max_tokens (+ max_seqs with MTP) */
    int n_kvl;                      /* layers with KV: n_layer, + the MTP layer with opts.mtp */
    int key0;                       /* attention() leaves out positions below it (1 in the MTP layer) */

    float *wmem;                    /* owned: the small f32 weights (norms, biases), carved below */
    float *out_norm;                /* [n_embd] */
    struct wmat tok_embd, lm_head;  /* [n_vocab][n_embd] each (the same when tied) */
    float *wbuf;                    /* [nt][ROW_BLOCK][max_in] dequantized weight rows per thread */
    int max_in;
    struct layer_f32 *L;            /* [n_layer] */
    float *rope_cos, *rope_sin;     /* [max_ctx][rope_dim/2] */

    float *kv;                      /* owned: per layer its entries [kv_blocks][block_size][entry]: a GQA layer
                                       K then V, each [n_kv][hd]; an MLA layer latent + rope (model/cpu_mla.c) */
    int kv_blocks, block_size;
    size_t kv_layer;                /* floats in one GQA layer's K (or V) */
    size_t *kv_off;                 /* [n_layer] first float of each layer's entries in kv */
    struct cpu_mla *mla;            /* the MLA layers' weights and scratch, or NULL */
    struct cpu_hc *hc;              /* the hyper-connection sites, or NULL (a plain residual) */
    int n_streams;                  /* residual streams per token: hc_mult, or 1 */
    float *xs;                      /* [max_tokens][n_streams][n_embd] the residual streams (hc only) */
    float *y;                       /* [max_tokens][n_embd] a block's output (hc only) */
    float *trace;                   /* borrowed, or NULL: cpu_backend_trace's destination */
    float *margins;                 /* borrowed, or NULL: cpu_backend_route_margins' destination */
    float *ix_margins;              /* borrowed, or NULL: cpu_backend_index_margins' destination */
    unsigned bf16;                  /* CPU_BF16_* families rounded (cpu_backend_emulate_bf16; tests) */
    struct cpu_kda *kda;            /* the KDA layers' weights and scratch, or NULL */
    float *states;                  /* owned: [state_slots + spec_slots][state_bytes / 4] recurrent states (KDA
                                       layers), then the scratch a verify step keeps its verified states in */
    int state_slots;
    size_t state_bytes;             /* one slot (model_state_bytes) */
    int spec_slots;                 /* scratch slots after state_slots: grown to a step's verified positions */
    struct step_seq *kseqs;         /* [max_seqs] the step's sequences as the KDA layers see them */
    int *kbase;                     /* [max_seqs] each one's first scratch slot */
    int32_t *kpos, *kslot;          /* [kcap] their snapshot lists: the step's and the verified positions' */
    int kcap;

    /* scratch, [max_tokens] rows unless said otherwise */
    float *x, *xn;                  /* [n_embd] residual stream, normed / projected */
    float *hkda;                    /* [n_embd] a KDA layer's output (KDA models only) */
    float *q, *att;                 /* [n_head*hd] */
    float *k, *v;                   /* [n_kv*hd] */
    float *gate, *up;               /* [n_ff] */
    float *hfin;                    /* [max_rows][n_embd] final hidden of logit rows */
    float *logits;                  /* [max_rows][n_vocab] */
    float *scores;                  /* [nt][max_ctx] attention scores per thread */
    int *tok_seq;                   /* [max_tokens] sequence of each token */
    int *row_seq;                   /* [max_seqs] each sampled sequence, in row order */
    int *row_first;                 /* [max_seqs] its first logits row */
    void *samp;                     /* [nt] sampler scratch, samp_bytes each */
    size_t samp_bytes;
    struct moe_cpu *moe;            /* owned: the MoE layers' routers and scratch (model/moe.c), or NULL */

    /* MTP (c.n_mtp_layer > 0) */
    struct mtp_f32 *mtp;            /* [n_mtp_layer] */
    float *hblk;                    /* [kv_blocks][n_embd] in kv: the hidden state each block keeps */
    int32_t *htag;                  /* [kv_blocks] in kv: its position (-1: none) */
    float *hkeep;                   /* [max_tokens][n_embd] final-normed hidden states of the last step */
    int *last_q0, *last_pos0, *last_len; /* [max_seqs] the last step's sequences: first token, position, count */
    int last_n;                     /* sequences in the last step; -1 after a failed or no forward */
    int32_t *sub_tok, *sub_pos;     /* [cap] a sub-step's tokens and positions */
    int64_t *sub_slot;              /* [cap] */
    const float **sub_h;            /* [cap] the hidden state each sub-step token takes */
    struct step_seq *sub_seqs;      /* [max_seqs] */
    int *sub_req;                   /* [max_seqs] the draft request of each sub-step sequence */
    float *mtp_in;                  /* [cap][2 n_embd] enorm(embed) | hnorm(h) */
    float *mtp_g;                   /* [max_seqs][n_embd] each draft request's chained hidden state */
};

void cpu_round_bf16(float *x, size_t n)
{
    for (size_t i = 0; i < n; i++) {
        uint32_t u;
        memcpy(&u, &x[i], 4);
        if ((u & 0x7fffffffu) > 0x7f800000u) continue; /* NaN stays */
        u = (u + 0x7fffu + ((u >> 16) & 1u)) & 0xffff0000u;
        memcpy(&x[i], &u, 4);
    }
}

/* x[n] to bf16 when b emulates family f. */
static void round_if(const struct cpu_backend *b, unsigned f, float *x, size_t n)
{
    if (b->bf16 & f) cpu_round_bf16(x, n);
}


/* ---- kernels ------------------------------------------------------------------- */

/* One (weight row, input row) dot product is always: two 8-lane accumulators
 * over 16-element chunks (FMA), their sum reduced in a fixed tree, then the
 * tail added with scalar FMAs. The multi-row/multi-token kernels repeat that
 * exact sequence per pair, only interleaved, so tiling never changes a bit. */
#if defined(__AVX2__) && defined(__FMA__)
static inline float hsum8(__m256 v)
{
    __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
    s = _mm_add_ps(s, _mm_movehl_ps(s, s));
    s = _mm_add_ss(s, _mm_movehdup_ps(s));
    return _mm_cvtss_f32(s);
}

static inline float dot1(const float *w, const float *x, int n)
{
    __m256 a0 = _mm256_setzero_ps(), a1 = _mm256_setzero_ps();
    int i = 0;
    for (; i + 16 <= n; i += 16) {
        a0 = _mm256_fmadd_ps(_mm256_loadu_ps(w + i), _mm256_loadu_ps(x + i), a0);
        a1 = _mm256_fmadd_ps(_mm256_loadu_ps(w + i + 8), _mm256_loadu_ps(x + i + 8), a1);
    }
    float s = hsum8(_mm256_add_ps(a0, a1));
    for (; i < n; i++) s = fmaf(w[i], x[i], s);
    return s;
}

/* one weight row against 4 input rows */
static inline void dot_w1x4(const float *w, const float *x0, const float *x1, const float *x2,
                            const float *x3, int n, float *o)
{
    __m256 a00 = _mm256_setzero_ps(), a01 = a00, a10 = a00, a11 = a00, a20 = a00, a21 = a00,
           a30 = a00, a31 = a00;
    int i = 0;
    for (; i + 16 <= n; i += 16) {
        __m256 w0 = _mm256_loadu_ps(w + i), w1 = _mm256_loadu_ps(w + i + 8);
        a00 = _mm256_fmadd_ps(w0, _mm256_loadu_ps(x0 + i), a00);
        a01 = _mm256_fmadd_ps(w1, _mm256_loadu_ps(x0 + i + 8), a01);
        a10 = _mm256_fmadd_ps(w0, _mm256_loadu_ps(x1 + i), a10);
        a11 = _mm256_fmadd_ps(w1, _mm256_loadu_ps(x1 + i + 8), a11);
        a20 = _mm256_fmadd_ps(w0, _mm256_loadu_ps(x2 + i), a20);
        a21 = _mm256_fmadd_ps(w1, _mm256_loadu_ps(x2 + i + 8), a21);
        a30 = _mm256_fmadd_ps(w0, _mm256_loadu_ps(x3 + i), a30);
        a31 = _mm256_fmadd_ps(w1, _mm256_loadu_ps(x3 + i + 8), a31);
    }
    float s0 = hsum8(_mm256_add_ps(a00, a01)), s1 = hsum8(_mm256_add_ps(a10, a11)),
          s2 = hsum8(_mm256_add_ps(a20, a21)), s3 = hsum8(_mm256_add_ps(a30, a31));
    for (; i < n; i++) {
        s0 = fmaf(w[i], x0[i], s0);
        s1 = fmaf(w[i], x1[i], s1);
        s2 = fmaf(w[i], x2[i], s2);
        s3 = fmaf(w[i], x3[i], s3);
    }
    o[0] = s0, o[1] = s1, o[2] = s2, o[3] = s3;
}

/* 4 weight rows against one input row (decode) */
static inline void dot_w4x1(const float *w0, const float *w1, const float *w2, const float *w3,
                            const float *x, int n, float *o)
{
    __m256 a00 = _mm256_setzero_ps(), a01 = a00, a10 = a00, a11 = a00, a20 = a00, a21 = a00,
           a30 = a00, a31 = a00;
    int i = 0;
    for (; i + 16 <= n; i += 16) {
        __m256 x0 = _mm256_loadu_ps(x + i), x1 = _mm256_loadu_ps(x + i + 8);
        a00 = _mm256_fmadd_ps(_mm256_loadu_ps(w0 + i), x0, a00);
        a01 = _mm256_fmadd_ps(_mm256_loadu_ps(w0 + i + 8), x1, a01);
        a10 = _mm256_fmadd_ps(_mm256_loadu_ps(w1 + i), x0, a10);
        a11 = _mm256_fmadd_ps(_mm256_loadu_ps(w1 + i + 8), x1, a11);
        a20 = _mm256_fmadd_ps(_mm256_loadu_ps(w2 + i), x0, a20);
        a21 = _mm256_fmadd_ps(_mm256_loadu_ps(w2 + i + 8), x1, a21);
        a30 = _mm256_fmadd_ps(_mm256_loadu_ps(w3 + i), x0, a30);
        a31 = _mm256_fmadd_ps(_mm256_loadu_ps(w3 + i + 8), x1, a31);
    }
    float s0 = hsum8(_mm256_add_ps(a00, a01)), s1 = hsum8(_mm256_add_ps(a10, a11)),
          s2 = hsum8(_mm256_add_ps(a20, a21)), s3 = hsum8(_mm256_add_ps(a30, a31));
    for (; i < n; i++) {
        s0 = fmaf(w0[i], x[i], s0);
        s1 = fmaf(w1[i], x[i], s1);
        s2 = fmaf(w2[i], x[i], s2);
        s3 = fmaf(w3[i], x[i], s3);
    }
    o[0] = s0, o[1] = s1, o[2] = s2, o[3] = s3;
}
#else
/* Portable fallback with the same structure (16 lanes, fixed reduction). */
static inline float dot1(const float *w, const float *x, int n)
{
    float a[16] = {0};
    int i = 0;
    for (; i + 16 <= n; i += 16)
        for (int j = 0; j < 16; j++) a[j] = fmaf(w[i + j], x[i + j], a[j]);
    for (int j = 0; j < 8; j++) a[j] += a[j + 8];
    for (int j = 0; j < 4; j++) a[j] += a[j + 4];
    a[0] += a[2], a[1] += a[3];
    float s = a[0] + a[1];
    for (; i < n; i++) s = fmaf(w[i], x[i], s);
    return s;
}
static inline void dot_w1x4(const float *w, const float *x0, const float *x1, const float *x2,
                            const float *x3, int n, float *o)
{
    o[0] = dot1(w, x0, n), o[1] = dot1(w, x1, n), o[2] = dot1(w, x2, n), o[3] = dot1(w, x3, n);
}
static inline void dot_w4x1(const float *w0, const float *w1, const float *w2, const float *w3,
                            const float *x, int n, float *o)
{
    o[0] = dot1(w0, x, n), o[1] = dot1(w1, x, n), o[2] = dot1(w2, x, n), o[3] = dot1(w3, x, n);
}
#endif

#define ROW_BLOCK 16

static size_t row_bytes(enum model_dtype dt, int in)
{
    switch (dt) {
    case MODEL_DT_F32: return (size_t)in * 4;
    case MODEL_DT_F16:
    case MODEL_DT_BF16: return (size_t)in * 2;
    case MODEL_DT_Q8_0: return (size_t)in / 32 * 34;
    case MODEL_DT_Q4_0: return (size_t)in / 32 * 18;
    case MODEL_DT_Q4_1: return (size_t)in / 32 * 20;
    default: return 0; /* packed weights are addressed through their descriptor */
    }
}

/* Row r of w as f32 into dst[w->in]: the same values as model_tensor_to_f32
 * (q * d for Q8_0/Q4_0, q * d + m for Q4_1, each rounded once: no FMA). */
static void deq_row(const struct wmat *w, int64_t r, float *dst)
{
    if (w->dt == MODEL_DT_QPACK) {
        quant_deq_row(w->quant, r, dst);
        return;
    }
    const uint8_t *p = w->data + (size_t)r * w->row_bytes;
    int n = w->in;
#if defined(__AVX2__) && defined(__FMA__) && defined(__F16C__)
    switch (w->dt) {
    case MODEL_DT_F32: memcpy(dst, p, (size_t)n * 4); return;
    case MODEL_DT_Q8_0:
        for (int i = 0; i < n; i += 32, p += 34) {
            __m256 d = _mm256_set1_ps(_cvtsh_ss((uint16_t)(p[0] | p[1] << 8)));
            for (int j = 0; j < 32; j += 8) {
                __m128i q = _mm_loadl_epi64((const __m128i *)(p + 2 + j));
                _mm256_storeu_ps(dst + i + j,
                                 _mm256_mul_ps(_mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(q)), d));
            }
        }
        return;
    case MODEL_DT_Q4_0:
    case MODEL_DT_Q4_1: {
        bool q41 = w->dt == MODEL_DT_Q4_1;
        size_t bsz = q41 ? 20 : 18;
        const __m128i lo_mask = _mm_set1_epi8(0x0F), eight = _mm_set1_epi8(8);
        for (int i = 0; i < n; i += 32, p += bsz) {
            __m256 d = _mm256_set1_ps(_cvtsh_ss((uint16_t)(p[0] | p[1] << 8)));
            __m256 m = _mm256_set1_ps(q41 ? _cvtsh_ss((uint16_t)(p[2] | p[3] << 8)) : 0.0f);
            __m128i qs = _mm_loadu_si128((const __m128i *)(p + (q41 ? 4 : 2)));
            __m128i lo = _mm_and_si128(qs, lo_mask), hi = _mm_and_si128(_mm_srli_epi16(qs, 4), lo_mask);
            if (!q41) {
                lo = _mm_sub_epi8(lo, eight);
                hi = _mm_sub_epi8(hi, eight);
            }
            __m128i parts[4] = {lo, _mm_srli_si128(lo, 8), hi, _mm_srli_si128(hi, 8)};
            for (int j = 0; j < 4; j++) {
                __m256 v = _mm256_mul_ps(_mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(parts[j])), d);
                if (q41) v = _mm256_add_ps(v, m);
                _mm256_storeu_ps(dst + i + 8 * j, v);
            }
        }
        return;
    }
    case MODEL_DT_F16:
        for (int i = 0; i < n; i += 8) {
            if (i + 8 > n) break;
            _mm256_storeu_ps(dst + i, _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)(p + 2 * i))));
        }
        for (int i = n & ~7; i < n; i++) dst[i] = _cvtsh_ss((uint16_t)(p[2 * i] | p[2 * i + 1] << 8));
        return;
    case MODEL_DT_BF16: {
        int i = 0;
        for (; i + 8 <= n; i += 8)
            _mm256_storeu_si256((__m256i *)(dst + i),
                                _mm256_slli_epi32(_mm256_cvtepu16_epi32(_mm_loadu_si128((const __m128i *)(p + 2 * i))), 16));
        for (; i < n; i++) {
            uint32_t bits = (uint32_t)(p[2 * i] | p[2 * i + 1] << 8) << 16;
            memcpy(dst + i, &bits, 4);
        }
        return;
    }
    default: break;
    }
#endif
    struct model_tensor t = {.dtype = w->dt, .ndim = 1, .ne = {n, 1, 1, 1}, .data = p,
                             .nbytes = w->row_bytes};
    model_tensor_to_f32(&t, 0, n, dst);
}

/* y[T][out] = x[T][in] . w[out][in]^T (+ bias[out]). Parallel over blocks of
 * output rows; a block is dequantized into the thread's scratch, then 4 input
 * rows share each weight row. */
static void matmul(const struct cpu_backend *b, float *y, const float *x, const struct wmat *wm,
                   const float *bias, int T, int in, int out)
{
    int nblk = (out + ROW_BLOCK - 1) / ROW_BLOCK;
    SL_ASSERT(wm->in == in && in <= b->max_in);
#pragma omp parallel for schedule(guided) num_threads(b->nt)
    for (int blk = 0; blk < nblk; blk++) {
        int r0 = blk * ROW_BLOCK, r1 = r0 + ROW_BLOCK < out ? r0 + ROW_BLOCK : out;
        const float *w;
        if (wm->dt == MODEL_DT_F32) {
            w = (const float *)wm->data;
        } else if (T < 4) {
            /* decode: 4 rows at a time, so the dequantized rows stay in L1 */
            float *buf = b->wbuf + (size_t)omp_get_thread_num() * ROW_BLOCK * b->max_in;
            for (int r = r0; r < r1; r += 4) {
                int nr = r1 - r < 4 ? r1 - r : 4;
                for (int k = 0; k < nr; k++) deq_row(wm, r + k, buf + (size_t)k * in);
                for (int t = 0; t < T; t++) {
                    const float *xt = x + (size_t)t * in;
                    float *yt = y + (size_t)t * out;
                    if (nr == 4)
                        dot_w4x1(buf, buf + in, buf + 2 * (size_t)in, buf + 3 * (size_t)in, xt, in,
                                 yt + r);
                    else
                        for (int k = 0; k < nr; k++) yt[r + k] = dot1(buf + (size_t)k * in, xt, in);
                }
            }
            if (bias)
                for (int tt = 0; tt < T; tt++)
                    for (int r = r0; r < r1; r++) y[(size_t)tt * out + r] += bias[r];
            continue;
        } else {
            float *buf = b->wbuf + (size_t)omp_get_thread_num() * ROW_BLOCK * b->max_in;
            for (int r = r0; r < r1; r++) deq_row(wm, r, buf + (size_t)(r - r0) * in);
            w = buf - (size_t)r0 * in; /* so that w + r * in addresses row r */
        }
        int t = 0;
        for (; t + 4 <= T; t += 4) {
            const float *x0 = x + (size_t)t * in;
            for (int r = r0; r < r1; r++) {
                float o[4];
                dot_w1x4(w + (size_t)r * in, x0, x0 + in, x0 + 2 * (size_t)in, x0 + 3 * (size_t)in,
                         in, o);
                for (int j = 0; j < 4; j++) y[(size_t)(t + j) * out + r] = o[j];
            }
        }
        for (; t < T; t++) {
            const float *xt = x + (size_t)t * in;
            float *yt = y + (size_t)t * out;
            int r = r0;
            for (; r + 4 <= r1; r += 4) {
                const float *wr = w + (size_t)r * in;
                dot_w4x1(wr, wr + in, wr + 2 * (size_t)in, wr + 3 * (size_t)in, xt, in, yt + r);
            }
            for (; r < r1; r++) yt[r] = dot1(w + (size_t)r * in, xt, in);
        }
        if (bias)
            for (int tt = 0; tt < T; tt++)
                for (int r = r0; r < r1; r++) y[(size_t)tt * out + r] += bias[r];
    }
}

/* y = x / rms(x) * w over n elements (the sum of squares in double). */
static void rmsnorm(float *y, const float *x, const float *w, int n, float eps)
{
    double ss = 0.0;
    for (int i = 0; i < n; i++) ss += (double)x[i] * x[i];
    float r = (float)(1.0 / sqrt(ss / n + eps));
    for (int i = 0; i < n; i++) y[i] = w[i] * (x[i] * r);
}

static void rope(float *x, const float *cs, const float *sn, int rope_dim, enum model_rope type)
{
    int half = rope_dim / 2;
    if (type == MODEL_ROPE_NORM) {
        for (int i = 0; i < half; i++) {
            float a = x[2 * i], c = x[2 * i + 1];
            x[2 * i] = a * cs[i] - c * sn[i];
            x[2 * i + 1] = a * sn[i] + c * cs[i];
        }
    } else {
        for (int i = 0; i < half; i++) {
            float a = x[i], c = x[i + half];
            x[i] = a * cs[i] - c * sn[i];
            x[i + half] = a * sn[i] + c * cs[i];
        }
    }
}

/* ---- construction -------------------------------------------------------------- */

static size_t backend_kv_block_bytes(model_backend *mb, int block_size);
static int backend_kv_alloc(model_backend *mb, int n_blocks, int block_size, char *err, size_t errlen);
static size_t backend_state_slot_bytes(model_backend *mb);
static int backend_state_alloc(model_backend *mb, int n_slots, char *err, size_t errlen);
static int backend_forward(model_backend *mb, struct step *s, char *err, size_t errlen);
static void backend_destroy(model_backend *mb);
static int backend_mtp_draft(model_backend *mb, struct model_mtp_req *r, int n, char *err, size_t errlen);

static const struct model_backend_ops cpu_ops = {
    .name = "cpu",
    .kv_block_bytes = backend_kv_block_bytes,
    .kv_alloc = backend_kv_alloc,
    .state_slot_bytes = backend_state_slot_bytes,
    .state_alloc = backend_state_alloc,
    .forward = backend_forward,
    .destroy = backend_destroy,
    .mtp_draft = backend_mtp_draft,
};

static int wmat_init(struct wmat *m, const struct model_tensor *t, char *err, size_t errlen)
{
    int64_t in = t->ne[0];
    bool quant = t->dtype == MODEL_DT_Q8_0 || t->dtype == MODEL_DT_Q4_0 || t->dtype == MODEL_DT_Q4_1;
    bool packed = t->dtype == MODEL_DT_QPACK;
    bool ints = t->dtype == MODEL_DT_I8 || t->dtype == MODEL_DT_I32 || t->dtype == MODEL_DT_I64;
    if (!t->data || in <= 0 || in > (1 << 24) || (quant && in % 32) || ints ||
        (packed && (!t->quant || t->quant->cols != in || t->quant->rows != t->ne[1])) ||
        t->nbytes < row_bytes(t->dtype, (int)in) * (size_t)t->ne[1]) {
        sl_seterr(err, errlen, "tensor %s: unusable layout (%s, %lld columns)", t->name ? t->name : "?",
               model_dtype_name(t->dtype), (long long)in);
        return SL_EUNSUP;
    }
    m->dt = t->dtype;
    m->data = t->data;
    m->quant = t->quant;
    m->in = (int)in;
    m->row_bytes = row_bytes(t->dtype, (int)in);
    return 0;
}

static void *zalloc(size_t n)
{
    void *p = NULL;
    if (posix_memalign(&p, 64, n ? n : 64) != 0) return NULL;
    memset(p, 0, n);
    return p;
}

static void rope_tables(struct cpu_backend *b, const struct model_weights *w)
{
    const struct model_config *c = &b->c;
    int half = c->rope_dim / 2;
    double inv[4096];
    model_rope_inv_freq(c, w, inv);
    for (int p = 0; p < b->max_ctx; p++)
        for (int i = 0; i < half; i++) {
            double a = (double)p * inv[i];
            b->rope_cos[(size_t)p * half + i] = (float)cos(a);
            b->rope_sin[(size_t)p * half + i] = (float)sin(a);
        }
}

model_backend *model_cpu_backend_create(const model *m, const struct model_backend_opts *opts,
                                        char *err, size_t errlen)
{
    if (!m) {
        sl_seterr(err, errlen, "no model");
        return NULL;
    }
    const struct model_config *c = model_get_config(m);
    const struct model_weights *w = model_get_weights(m);
    struct cpu_backend *b = calloc(1, sizeof *b);
    if (!b) {
        sl_seterr(err, errlen, "out of memory");
        return NULL;
    }
    b->base.ops = &cpu_ops;
    b->base.m = m;
    b->base.has_prompt_logprobs = true;
    b->c = *c;
    bool mtp = opts && opts->mtp && c->n_mtp_layer > 0;
    if (!mtp) b->c.n_mtp_layer = 0; /* the MTP layers' weights stay unread */
    c = &b->c;
    b->base.has_mtp = mtp;
    b->last_n = -1;
    if (mtp && c->n_mtp_layer != 1) {
        sl_seterr(err, errlen, "speculative method mtp: %d MTP layers; the cpu backend runs one", c->n_mtp_layer);
        goto fail;
    }
    if (mtp && c->mla.index_topk > 0) {
        sl_seterr(err, errlen, "speculative method mtp: the MTP layer of a model with the DSA indexer on is not "
                  "implemented (index_topk null turns the indexer off)");
        goto fail;
    }
    b->nt = opts && opts->n_threads > 0 ? opts->n_threads : omp_get_num_procs();
    b->max_tokens = opts && opts->max_tokens_per_step > 0 ? opts->max_tokens_per_step : 2048;
    b->max_seqs = opts && opts->max_seqs_per_step > 0 ? opts->max_seqs_per_step : 256;
    b->max_ctx = opts && opts->max_ctx > 0 ? opts->max_ctx : c->n_ctx_train;
    b->max_draft = opts && opts->max_draft_tokens > 0 ? opts->max_draft_tokens : 0;
    b->max_rows = b->max_seqs * (1 + b->max_draft);
    b->base.max_draft_tokens = b->max_draft;
    if (b->max_ctx <= 0) b->max_ctx = 4096;
    if (c->rope_dim / 2 > 4096) {
        sl_seterr(err, errlen, "rope_dim %d too large", c->rope_dim);
        goto fail;
    }

    size_t E = c->n_embd, F = c->n_ff, D = c->head_dim, Q = (size_t)c->n_head * D,
           KV = (size_t)c->n_head_kv * D, V = c->n_vocab;
    int n_all = model_n_layer_all(c);
    size_t per_layer = 2 * E + (c->qkv_bias ? Q + 2 * KV : 0) + (c->qk_norm ? 2 * D : 0);
    size_t nw = E + per_layer * n_all + 3 * E * c->n_mtp_layer;
    b->wmem = zalloc(nw * sizeof(float));
    b->L = calloc((size_t)n_all, sizeof *b->L);
    b->kv_off = calloc((size_t)n_all, sizeof *b->kv_off);
    b->mtp = calloc((size_t)c->n_mtp_layer + 1, sizeof *b->mtp);
    b->n_kvl = n_all;
    if (!b->wmem || !b->L || !b->kv_off || !b->mtp) {
        sl_seterr(err, errlen, "out of memory");
        goto fail;
    }
    float *p = b->wmem;
    MAT(b->tok_embd, &w->tok_embd);
    VEC(b->out_norm, &w->out_norm, E);
    if (c->tie_embeddings)
        b->lm_head = b->tok_embd;
    else
        MAT(b->lm_head, &w->lm_head);
    for (int i = 0; i < c->n_mtp_layer; i++) {
        const struct model_mtp_weights *mw = &w->mtp[i];
        VEC(b->mtp[i].enorm, &mw->enorm, E);
        VEC(b->mtp[i].hnorm, &mw->hnorm, E);
        VEC(b->mtp[i].head_norm, &mw->head_norm, E);
        MAT(b->mtp[i].eh, &mw->eh_proj);
    }
    for (int l = 0; l < n_all; l++) {
        const struct model_layer_weights *lw = &w->layers[l];
        struct layer_f32 *L = &b->L[l];
        VEC(L->attn_norm, &lw->attn_norm, E);
        if (model_layer_kind_of(c, l).mixer == MODEL_MIXER_GQA) {
            MAT(L->wq, &lw->wq);
            MAT(L->wk, &lw->wk);
            MAT(L->wv, &lw->wv);
            MAT(L->wo, &lw->wo);
        }
        if (c->qkv_bias) {
            VEC(L->bq, &lw->bq, Q);
            VEC(L->bk, &lw->bk, KV);
            VEC(L->bv, &lw->bv, KV);
        }
        if (c->qk_norm) {
            VEC(L->q_norm, &lw->q_norm, D);
            VEC(L->k_norm, &lw->k_norm, D);
        }
        VEC(L->ffn_norm, &lw->ffn_norm, E);
        if (model_layer_kind_of(c, l).ffn == MODEL_FFN_MOE) continue; /* model/moe.c holds its weights */
        MAT(L->w_gate, &lw->w_gate);
        MAT(L->w_up, &lw->w_up);
        MAT(L->w_down, &lw->w_down);
    }
    SL_ASSERT((size_t)(p - b->wmem) == nw);
    b->max_in = (int)(E > F ? E : F);
    if ((size_t)b->max_in < Q) b->max_in = (int)Q;
    if (b->max_in < cpu_mla_max_in(c)) b->max_in = cpu_mla_max_in(c);
    if (mtp && (size_t)b->max_in < 2 * E) b->max_in = (int)(2 * E); /* eh_proj */
    if (c->hc.mult > 0 && b->max_in < c->hc.mult * c->n_embd) b->max_in = c->hc.mult * c->n_embd;
    if (b->max_in < cpu_kda_max_in(c)) b->max_in = cpu_kda_max_in(c);
    b->wbuf = zalloc((size_t)b->nt * ROW_BLOCK * b->max_in * sizeof(float));

    b->cap = b->max_tokens + (mtp ? b->max_seqs : 0);
    size_t T = b->cap, S = b->max_seqs, half = c->rope_dim / 2;
    b->rope_cos = zalloc((size_t)b->max_ctx * half * sizeof(float));
    b->rope_sin = zalloc((size_t)b->max_ctx * half * sizeof(float));
    b->x = zalloc(T * E * sizeof(float));
    b->xn = zalloc(T * E * sizeof(float));
    b->q = zalloc(T * Q * sizeof(float));
    b->att = zalloc(T * Q * sizeof(float));
    b->k = zalloc(T * KV * sizeof(float));
    b->v = zalloc(T * KV * sizeof(float));
    b->gate = zalloc(T * F * sizeof(float));
    b->up = zalloc(T * F * sizeof(float));
    b->hfin = zalloc((size_t)b->max_rows * E * sizeof(float));
    b->logits = zalloc((size_t)b->max_rows * V * sizeof(float));
    b->scores = zalloc((size_t)b->nt * b->max_ctx * sizeof(float));
    b->tok_seq = zalloc(T * sizeof(int));
    b->row_seq = zalloc(S * sizeof(int));
    b->row_first = zalloc(S * sizeof(int));
    b->samp_bytes = (model_sample_scratch_bytes(c->n_vocab) + 63) & ~(size_t)63;
    b->samp = zalloc((size_t)b->nt * b->samp_bytes);
    if (!b->rope_cos || !b->rope_sin || !b->x || !b->xn || !b->q || !b->att || !b->k || !b->v ||
        !b->gate || !b->up || !b->hfin || !b->logits || !b->scores || !b->tok_seq || !b->row_seq ||
        !b->row_first || !b->samp || !b->wbuf) {
        sl_seterr(err, errlen, "out of memory for scratch (%d tokens, %d seqs, ctx %d)", b->max_tokens,
               b->max_seqs, b->max_ctx);
        goto fail;
    }
    if (mtp) {
        b->hkeep = zalloc((size_t)b->max_tokens * E * sizeof(float));
        b->last_q0 = zalloc(S * sizeof(int));
        b->last_pos0 = zalloc(S * sizeof(int));
        b->last_len = zalloc(S * sizeof(int));
        b->sub_tok = zalloc(T * sizeof(int32_t));
        b->sub_pos = zalloc(T * sizeof(int32_t));
        b->sub_slot = zalloc(T * sizeof(int64_t));
        b->sub_h = zalloc(T * sizeof(float *));
        b->sub_seqs = zalloc(S * sizeof(struct step_seq));
        b->sub_req = zalloc(S * sizeof(int));
        b->mtp_in = zalloc(T * 2 * E * sizeof(float));
        b->mtp_g = zalloc(S * E * sizeof(float));
        if (!b->hkeep || !b->last_q0 || !b->last_pos0 || !b->last_len || !b->sub_tok || !b->sub_pos ||
            !b->sub_slot || !b->sub_h || !b->sub_seqs || !b->sub_req || !b->mtp_in || !b->mtp_g) {
            sl_seterr(err, errlen, "out of memory for the MTP scratch (%d tokens, %d seqs)", b->max_tokens,
                      b->max_seqs);
            goto fail;
        }
    }
    if (c->moe.n_expert > 0 && !(b->moe = moe_cpu_create(c, w, b->cap, b->nt, err, errlen))) goto fail;
    rope_tables(b, w);
    if (c->mla.kv_lora_rank > 0 &&
        !(b->mla = cpu_mla_create(b, c, w, b->cap, b->max_ctx, err, errlen)))
        goto fail;
    b->n_streams = 1;
    if (c->hc.mult > 0) {
        b->n_streams = c->hc.mult;
        b->xs = zalloc(T * (size_t)c->hc.mult * E * sizeof(float));
        b->y = zalloc(T * E * sizeof(float));
        if (!b->xs || !b->y) {
            sl_seterr(err, errlen, "out of memory for the residual streams (%d tokens)", b->max_tokens);
            goto fail;
        }
        if (!(b->hc = cpu_hc_create(c, w, b->max_tokens, err, errlen))) goto fail;
    }
    b->state_bytes = model_state_bytes(c);
    if (b->state_bytes > 0 && !(b->hkda = zalloc(T * E * sizeof(float)))) {
        sl_seterr(err, errlen, "out of memory for scratch");
        goto fail;
    }
    if (b->state_bytes > 0 && !(b->kda = cpu_kda_create(b, c, w, b->max_tokens, err, errlen))) goto fail;
    if (b->state_bytes > 0 && (!(b->kseqs = calloc((size_t)b->max_seqs, sizeof *b->kseqs)) ||
                               !(b->kbase = calloc((size_t)b->max_seqs, sizeof *b->kbase)))) {
        sl_seterr(err, errlen, "out of memory for scratch");
        goto fail;
    }
    b->base.state_rollback = true; /* spec_states / spec_rollback */
    return &b->base;
fail:
    backend_destroy(&b->base);
    return NULL;
}

/* ---- KV ------------------------------------------------------------------------ */

/* Each layer's entry as its kind declares it (model_kv_token_elems). */
static size_t backend_kv_block_bytes(model_backend *mb, int block_size)
{
    struct cpu_backend *b = (struct cpu_backend *)mb;
    return (size_t)block_size * (model_kv_bytes_per_token(&b->c, sizeof(float)) +
                                 model_mtp_kv_bytes_per_token(&b->c, sizeof(float))) +
           model_mtp_kv_bytes_per_block(&b->c, sizeof(float));
}

static int backend_kv_alloc(model_backend *mb, int n_blocks, int block_size, char *err, size_t errlen)
{
    struct cpu_backend *b = (struct cpu_backend *)mb;
    if (n_blocks <= 0 || block_size <= 0 || block_size > (1 << 20)) {
        sl_seterr(err, errlen, "kv_alloc: bad size (%d blocks of %d)", n_blocks, block_size);
        return SL_EINVAL;
    }
    size_t per_block = backend_kv_block_bytes(mb, block_size);
    if ((size_t)n_blocks > SIZE_MAX / per_block) {
        sl_seterr(err, errlen, "kv_alloc: size overflow");
        return SL_ENOMEM;
    }
    free(b->kv);
    b->kv = NULL;
    b->kv_blocks = 0;
    b->kv = zalloc((size_t)n_blocks * per_block);
    if (!b->kv) {
        sl_seterr(err, errlen, "kv_alloc: out of memory for %.2f GB",
               (double)n_blocks * per_block / 1e9);
        return SL_ENOMEM;
    }
    b->kv_blocks = n_blocks;
    b->block_size = block_size;
    b->kv_layer = (size_t)n_blocks * block_size * b->c.n_head_kv * b->c.head_dim;
    size_t off = 0;
    for (int l = 0; l < b->n_kvl; l++) {
        b->kv_off[l] = off;
        off += (size_t)n_blocks * block_size * (size_t)model_kv_token_elems(&b->c, l);
    }
    b->hblk = NULL;
    b->htag = NULL;
    if (b->c.n_mtp_layer > 0) {
        b->hblk = b->kv + off;
        b->htag = (int32_t *)(b->hblk + (size_t)n_blocks * b->c.n_embd);
        for (int i = 0; i < n_blocks; i++) b->htag[i] = -1;
    }
    b->last_n = -1;
    return 0;
}

/* The recurrent layers' states, one slot per running sequence or snapshot. */
static size_t backend_state_slot_bytes(model_backend *mb) { return ((struct cpu_backend *)mb)->state_bytes; }

static int backend_state_alloc(model_backend *mb, int n_slots, char *err, size_t errlen)
{
    struct cpu_backend *b = (struct cpu_backend *)mb;
    if (n_slots <= 0 || b->state_bytes == 0 || (size_t)n_slots > SIZE_MAX / b->state_bytes) {
        sl_seterr(err, errlen, "state_alloc: bad size (%d slots of %zu bytes)", n_slots, b->state_bytes);
        return SL_EINVAL;
    }
    free(b->states);
    b->state_slots = b->spec_slots = 0;
    b->states = zalloc((size_t)n_slots * b->state_bytes);
    if (!b->states) {
        sl_seterr(err, errlen, "state_alloc: out of memory for %.2f GB", (double)n_slots * b->state_bytes / 1e9);
        return SL_ENOMEM;
    }
    b->state_slots = n_slots;
    return 0;
}

/* ---- forward ------------------------------------------------------------------- */

static int check_step(struct cpu_backend *b, const struct step *s, char *err, size_t errlen)
{
    if (!b->kv) {
        sl_seterr(err, errlen, "forward: KV memory not allocated (kv_alloc)");
        return SL_EINVAL;
    }
    if (b->state_bytes > 0 && !b->states) {
        sl_seterr(err, errlen, "forward: recurrent state slots not allocated (state_alloc)");
        return SL_EINVAL;
    }
    struct model_step_limits lim = {.n_vocab = b->c.n_vocab, .max_tokens = b->max_tokens, .max_seqs = b->max_seqs,
                                    .max_ctx = b->max_ctx, .block_size = b->block_size, .kv_blocks = b->kv_blocks,
                                    .max_draft = b->max_draft, .state_slots = b->state_bytes > 0 ? b->state_slots : 0,
                                    .state_rollback = true};
    return model_step_check(s, &lim, b->tok_seq, err, errlen);
}

/* o[d] += p * v[d], each a separate multiply and add (the same rounding as the
 * scalar loop, whatever the width). */
static inline void axpy(float *o, float p, const float *v, int n)
{
    int d = 0;
#if defined(__AVX2__)
    __m256 pv = _mm256_set1_ps(p);
    for (; d + 8 <= n; d += 8)
        _mm256_storeu_ps(o + d, _mm256_add_ps(_mm256_loadu_ps(o + d),
                                              _mm256_mul_ps(pv, _mm256_loadu_ps(v + d))));
#endif
    for (; d < n; d++) o[d] += p * v[d];
}

/* Causal attention of every token's query heads over its sequence's
 * positions key0..pos, read through the block table. */
static void attention(struct cpu_backend *b, const struct step *s, int layer)
{
    const struct model_config *c = &b->c;
    int T = s->n_tokens, H = c->n_head, D = c->head_dim, KVH = c->n_head_kv, bs = b->block_size;
    int grp = H / KVH;
    const float *K = b->kv + b->kv_off[layer];
    const float *Vc = K + b->kv_layer;
    float scale = 1.0f / sqrtf((float)D);
#pragma omp parallel for collapse(2) schedule(dynamic, 1) num_threads(b->nt)
    for (int t = 0; t < T; t++) {
        for (int h = 0; h < H; h++) {
            const struct step_seq *q = &s->seqs[b->tok_seq[t]];
            int pos = s->positions[t], g = h / grp;
            const float *qv = b->q + ((size_t)t * H + h) * D;
            float *sc = b->scores + (size_t)omp_get_thread_num() * b->max_ctx;
            float *o = b->att + ((size_t)t * H + h) * D;
            const int32_t *bt = q->block_table;
            size_t kstride = (size_t)KVH * D; /* floats between consecutive slots */
            int n = pos + 1, k0 = b->key0;
            float mx = -INFINITY;
            /* walk the block table block by block (no division per position) */
            for (int j0 = k0 / bs * bs; j0 < n; j0 += bs) {
                const float *kb = K + ((size_t)bt[j0 / bs] * bs * KVH + g) * D;
                int jn = n - j0 < bs ? n - j0 : bs;
                for (int jj = j0 < k0 ? k0 - j0 : 0; jj < jn; jj++) {
                    float v = dot1(qv, kb + jj * kstride, D) * scale;
                    sc[j0 + jj] = v;
                    if (v > mx) mx = v;
                }
            }
            float sum = 0.0f;
            for (int j = k0; j < n; j++) {
                sc[j] = expf(sc[j] - mx);
                sum += sc[j];
            }
            float inv = 1.0f / sum;
            for (int d = 0; d < D; d++) o[d] = 0.0f;
            for (int j0 = k0 / bs * bs; j0 < n; j0 += bs) {
                const float *vb = Vc + ((size_t)bt[j0 / bs] * bs * KVH + g) * D;
                int jn = n - j0 < bs ? n - j0 : bs;
                for (int jj = j0 < k0 ? k0 - j0 : 0; jj < jn; jj++) axpy(o, sc[j0 + jj] * inv, vb + jj * kstride, D);
            }
        }
    }
}

/* One layer's GQA attention block: dst += o(attention(rope(q), rope(k), v))
 * over the normed x, K and V written to the paged cache first. */
static void gqa_mixer(struct cpu_backend *b, const struct step *s, int l, float *dst)
{
    const struct model_config *c = &b->c;
    const struct layer_f32 *L = &b->L[l];
    int T = s->n_tokens, E = c->n_embd, H = c->n_head, KVH = c->n_head_kv, D = c->head_dim, Q = H * D,
        KV = KVH * D, half = c->rope_dim / 2;
    float eps = c->norm_eps;
#pragma omp parallel for num_threads(b->nt) if (T >= 8)
    for (int t = 0; t < T; t++)
        rmsnorm(b->xn + (size_t)t * E, b->x + (size_t)t * E, L->attn_norm, E, eps);
    matmul(b, b->q, b->xn, &L->wq, L->bq, T, E, Q);
    matmul(b, b->k, b->xn, &L->wk, L->bk, T, E, KV);
    matmul(b, b->v, b->xn, &L->wv, L->bv, T, E, KV);
    float *Kc = b->kv + b->kv_off[l];
    float *Vc = Kc + b->kv_layer;
#pragma omp parallel for num_threads(b->nt) if (T >= 8)
    for (int t = 0; t < T; t++) {
        int pos = s->positions[t];
        const float *cs = b->rope_cos + (size_t)pos * half, *sn = b->rope_sin + (size_t)pos * half;
        for (int h = 0; h < H; h++) {
            float *qh = b->q + (size_t)t * Q + (size_t)h * D;
            if (L->q_norm) rmsnorm(qh, qh, L->q_norm, D, eps);
            rope(qh, cs, sn, c->rope_dim, c->rope_type);
        }
        for (int h = 0; h < KVH; h++) {
            float *kh = b->k + (size_t)t * KV + (size_t)h * D;
            if (L->k_norm) rmsnorm(kh, kh, L->k_norm, D, eps);
            rope(kh, cs, sn, c->rope_dim, c->rope_type);
        }
        memcpy(Kc + (size_t)s->slots[t] * KV, b->k + (size_t)t * KV, KV * sizeof(float));
        memcpy(Vc + (size_t)s->slots[t] * KV, b->v + (size_t)t * KV, KV * sizeof(float));
    }
    attention(b, s, l);
    matmul(b, b->xn, b->att, &L->wo, NULL, T, Q, E);
    for (size_t i = 0; i < (size_t)T * E; i++) dst[i] += b->xn[i];
}

/* Speculative decoding on recurrent layers (backend.h, step_seq.n_draft):
 * the state after each verified position but the last, context_len -
 * n_draft + j tokens for j < n_draft, goes to scratch slot base + j (after
 * the pool's slots, grown here to the step's drafts) as one more snapshot of
 * the step, beside the step's own; the state after the last query token
 * stays in the sequence's slot. The KDA layers take s's sequences with
 * these merged lists (b->kseqs); spec_rollback copies the accepted one back.
 * Returns the step the KDA layers run (s itself without drafts), or NULL
 * out of memory. */
static const struct step *spec_states(struct cpu_backend *b, const struct step *s, struct step *ks, char *err,
                                      size_t errlen)
{
    int need = 0, nsn = 0;
    for (int i = 0; i < s->n_seqs; i++) need += s->seqs[i].n_draft, nsn += s->seqs[i].n_snaps;
    if (need == 0) return s;
    if (need > b->spec_slots) { /* the pool's slots move with it (aligned as state_alloc's) */
        float *st = zalloc((size_t)(b->state_slots + need) * b->state_bytes);
        if (!st) goto oom;
        memcpy(st, b->states, (size_t)b->state_slots * b->state_bytes);
        free(b->states);
        b->states = st;
        b->spec_slots = need;
    }
    if (need + nsn > b->kcap) {
        int32_t *p = realloc(b->kpos, (size_t)(need + nsn) * sizeof *p);
        if (p) b->kpos = p;
        int32_t *q = realloc(b->kslot, (size_t)(need + nsn) * sizeof *q);
        if (q) b->kslot = q;
        if (!p || !q) goto oom;
        b->kcap = need + nsn;
    }
    *ks = *s;
    ks->seqs = b->kseqs;
    int slot = b->state_slots, k = 0;
    for (int i = 0; i < s->n_seqs; i++) {
        const struct step_seq *q = &s->seqs[i];
        struct step_seq *kq = &b->kseqs[i];
        *kq = *q;
        b->kbase[i] = slot;
        if (q->n_draft == 0) continue;
        /* merged in ascending order (a position both lists name is written twice, the same state) */
        kq->snap_pos = b->kpos + k;
        kq->snap_slot = b->kslot + k;
        int a = 0, v = 0, p0 = q->context_len - q->n_draft;
        while (a < q->n_snaps || v < q->n_draft) {
            bool own = v == q->n_draft || (a < q->n_snaps && q->snap_pos[a] <= p0 + v);
            b->kpos[k] = own ? q->snap_pos[a] : p0 + v;
            b->kslot[k++] = own ? q->snap_slot[a++] : slot + v++;
        }
        kq->n_snaps = q->n_snaps + q->n_draft;
        slot += q->n_draft;
    }
    return ks;
oom:
    sl_seterr(err, errlen, "forward: out of memory for the verified positions' states (%d of %zu bytes)", need,
              b->state_bytes);
    return NULL;
}

/* After the verification: a sequence that accepted a < n_draft drafts gets
 * the state after its last accepted one (scratch slot base + a) back. */
static void spec_rollback(struct cpu_backend *b, const struct step *s)
{
    for (int i = 0; i < s->n_seqs; i++) {
        const struct step_seq *q = &s->seqs[i];
        int a = q->n_spec_out - 1;
        if (q->n_draft == 0 || a < 0 || a >= q->n_draft) continue;
        memcpy(b->states + (size_t)q->state_slot * (b->state_bytes / sizeof(float)),
               b->states + (size_t)(b->kbase[i] + a) * (b->state_bytes / sizeof(float)), b->state_bytes);
    }
}

/* One layer's KDA block: dst += kda(rmsnorm(x)) (model/cpu_kda.c). */
static void kda_mixer(struct cpu_backend *b, const struct step *s, int l, float *dst)
{
    const struct model_config *c = &b->c;
    int T = s->n_tokens, E = c->n_embd;
#pragma omp parallel for num_threads(b->nt) if (T >= 8)
    for (int t = 0; t < T; t++)
        rmsnorm(b->xn + (size_t)t * E, b->x + (size_t)t * E, b->L[l].attn_norm, E, c->norm_eps);
    cpu_kda_mixer(b->kda, b, s, l, b->xn, b->hkda, b->states);
    for (size_t i = 0; i < (size_t)T * E; i++) dst[i] += b->hkda[i];
}

/* One layer's dense SwiGLU FFN block: dst += down(silu(gate(xn)) * up(xn)). */
static void dense_ffn(struct cpu_backend *b, int l, int T, float *dst)
{
    const struct model_config *c = &b->c;
    const struct layer_f32 *L = &b->L[l];
    int E = c->n_embd, F = c->n_ff;
#pragma omp parallel for num_threads(b->nt) if (T >= 8)
    for (int t = 0; t < T; t++)
        rmsnorm(b->xn + (size_t)t * E, b->x + (size_t)t * E, L->ffn_norm, E, c->norm_eps);
    round_if(b, CPU_BF16_XN, b->xn, (size_t)T * E);
    matmul(b, b->gate, b->xn, &L->w_gate, NULL, T, E, F);
    matmul(b, b->up, b->xn, &L->w_up, NULL, T, E, F);
    round_if(b, CPU_BF16_FFN_GU, b->gate, (size_t)T * F);
    round_if(b, CPU_BF16_FFN_GU, b->up, (size_t)T * F);
#pragma omp parallel for num_threads(b->nt) if (T >= 8)
    for (size_t i = 0; i < (size_t)T * F; i++) {
        float g = b->gate[i], u = b->up[i], lim = c->moe.swiglu_limit;
        if (lim > 0) { /* GLM-5.3's clamped SwiGLU */
            g = g < lim ? g : lim;
            u = u < -lim ? -lim : u > lim ? lim : u;
        }
        b->gate[i] = g / (1.0f + expf(-g)) * u;
    }
    round_if(b, CPU_BF16_FFN, b->gate, (size_t)T * F);
    matmul(b, b->xn, b->gate, &L->w_down, NULL, T, F, E);
    for (size_t i = 0; i < (size_t)T * E; i++) dst[i] += b->xn[i];
}

/* One layer's MoE FFN block: dst += moe(xn) (model/moe.c); margins: NULL or
 * [T] the tokens' routing margins. */
static void moe_ffn(struct cpu_backend *b, int l, int T, float *dst, float *margins)
{
    const struct model_config *c = &b->c;
    int E = c->n_embd;
#pragma omp parallel for num_threads(b->nt) if (T >= 8)
    for (int t = 0; t < T; t++)
        rmsnorm(b->xn + (size_t)t * E, b->x + (size_t)t * E, b->L[l].ffn_norm, E, c->norm_eps);
    round_if(b, CPU_BF16_XN, b->xn, (size_t)T * E);
    moe_cpu_forward(b->moe, l, b->xn, dst, T, margins);
}

/* Token t's hidden state before the final norm into dst[n_embd]: the
 * residual, or the streams' mean (Glm5NextTextHyperHead). */
static void final_hidden(const struct cpu_backend *b, int t, float *dst)
{
    int E = b->c.n_embd, N = b->n_streams;
    if (!b->hc) {
        memcpy(dst, b->x + (size_t)t * E, (size_t)E * sizeof(float));
        return;
    }
    const float *v = b->xs + (size_t)t * N * E;
    for (int e = 0; e < E; e++) {
        float acc = v[e];
        for (int i = 1; i < N; i++) acc += v[(size_t)i * E + e];
        dst[e] = acc / (float)N;
    }
}

static void trace_copy(struct cpu_backend *b, int at, int T)
{
    size_t n = (size_t)T * b->n_streams * b->c.n_embd;
    memcpy(b->trace + (size_t)at * n, b->hc ? b->xs : b->x, n * sizeof(float));
}


/* ---- MTP ----------------------------------------------------------------------- */

static inline int64_t slot_of(const int32_t *bt, int pos, int bs)
{
    return (int64_t)bt[pos / bs] * bs + pos % bs;
}

/* The MTP layer over the sub-step in b->sub_* (n tokens, ns sequences):
 * x = eh_proj([enorm(embed(token)) | hnorm(h)]), then its mixer, which writes
 * the tokens' entries before any attends (position 0 left out), and with ffn
 * its FFN. b->x holds each token's output (before the head's norm). */
static void mtp_layer(struct cpu_backend *b, int n, int ns, bool ffn)
{
    const struct model_config *c = &b->c;
    const struct mtp_f32 *M = &b->mtp[0];
    int E = c->n_embd, l = c->n_layer;
    float eps = c->norm_eps;
    for (int j = 0; j < n; j++) deq_row(&b->tok_embd, b->sub_tok[j], b->xn + (size_t)j * E);
#pragma omp parallel for num_threads(b->nt) if (n >= 8)
    for (int j = 0; j < n; j++) {
        float *in = b->mtp_in + (size_t)j * 2 * E;
        rmsnorm(in, b->xn + (size_t)j * E, M->enorm, E, eps);
        rmsnorm(in + E, b->sub_h[j], M->hnorm, E, eps);
    }
    matmul(b, b->x, b->mtp_in, &M->eh, NULL, n, 2 * E, E);
    struct step sub = {.n_tokens = n, .token_ids = b->sub_tok, .positions = b->sub_pos, .slots = b->sub_slot,
                       .n_seqs = ns, .seqs = b->sub_seqs};
    for (int si = 0; si < ns; si++)
        for (int t = b->sub_seqs[si].query_start; t < b->sub_seqs[si].query_start + b->sub_seqs[si].query_len; t++)
            b->tok_seq[t] = si;
    struct model_layer_kind k = model_layer_kind_of(c, l);
    b->key0 = 1;
    switch (k.mixer) {
    case MODEL_MIXER_GQA: gqa_mixer(b, &sub, l, b->x); break;
    case MODEL_MIXER_MLA:
        cpu_mla_mixer(b->mla, b, &sub, b->tok_seq, l, b->x, b->x, b->kv + b->kv_off[l], b->block_size, 1);
        break;
    case MODEL_MIXER_KDA: break; /* refused at creation: MTP layers take the model's mixer, GQA or MLA */
    }
    b->key0 = 0;
    if (!ffn) return;
    switch (k.ffn) {
    case MODEL_FFN_DENSE: dense_ffn(b, l, n, b->x); break;
    case MODEL_FFN_MOE: moe_ffn(b, l, n, b->x, NULL); break;
    }
}

/* Leaves the hidden state h of position pos in its block (bt's). */
static inline void keep_hidden(struct cpu_backend *b, const int32_t *bt, int pos, const float *h)
{
    int blk = bt[pos / b->block_size];
    memcpy(b->hblk + (size_t)blk * b->c.n_embd, h, (size_t)b->c.n_embd * sizeof(float));
    b->htag[blk] = pos;
}

/* After a step's sampling: keeps its final-normed hidden states (hkeep; in
 * each block, the block end's and each sequence's last one) and writes the MTP
 * entries backend.h lists: a when a - 1's block holds a - 1's hidden state,
 * and a + 1 .. b. Only the entries matter here: the FFN is skipped. */
static void mtp_after_step(struct cpu_backend *b, const struct step *s)
{
    const struct model_config *c = &b->c;
    int T = s->n_tokens, E = c->n_embd, bs = b->block_size;
#pragma omp parallel for num_threads(b->nt) if (T >= 8)
    for (int t = 0; t < T; t++) {
        float *h = b->hkeep + (size_t)t * E;
        final_hidden(b, t, h);
        rmsnorm(h, h, b->out_norm, E, c->norm_eps);
    }
    int n = 0, ns = 0;
    for (int si = 0; si < s->n_seqs; si++) {
        const struct step_seq *q = &s->seqs[si];
        int q0 = q->query_start, len = q->query_len, a = q->context_len - len, z = q->context_len - 1;
        const int32_t *bt = q->block_table;
        b->last_q0[si] = q0, b->last_pos0[si] = a, b->last_len[si] = len;
        if (len <= 0) continue;
        int start = n;
#define ADD(tok, pos, h)                                                                           \
    do {                                                                                           \
        b->sub_tok[n] = (tok), b->sub_pos[n] = (pos), b->sub_slot[n] = slot_of(bt, (pos), bs);     \
        b->sub_h[n] = (h);                                                                         \
        n++;                                                                                       \
    } while (0)
        if (a > 0 && b->htag[bt[(a - 1) / bs]] == a - 1) {
            /* copied: this step may leave another hidden state in that block */
            float *h = b->mtp_g + (size_t)si * E;
            memcpy(h, b->hblk + (size_t)bt[(a - 1) / bs] * E, (size_t)E * sizeof(float));
            ADD(s->token_ids[q0], a, h);
        }
        for (int p = a + 1; p <= z; p++) ADD(s->token_ids[q0 + p - a], p, b->hkeep + (size_t)(q0 + p - a - 1) * E);
#undef ADD
        if (n == start) continue;
        /* only the entries matter here: n_prompt picks an MLA layer's cheaper form (absorbed for a few
         * tokens, expanded for many) */
        b->sub_seqs[ns] = (struct step_seq){.query_start = start, .query_len = n - start, .context_len = z + 1,
                                            .block_table = bt, .n_blocks = q->n_blocks,
                                            .n_prompt = n - start > 64 ? z + 1 : 0};
        ns++;
    }
    for (int si = 0; si < s->n_seqs; si++) {
        const struct step_seq *q = &s->seqs[si];
        int q0 = q->query_start, len = q->query_len, a = q->context_len - len;
        for (int k = 0; k < len; k++)
            if ((a + k + 1) % bs == 0 || k == len - 1)
                keep_hidden(b, q->block_table, a + k, b->hkeep + (size_t)(q0 + k) * E);
    }
    b->last_n = s->n_seqs;
    if (n > 0) mtp_layer(b, n, ns, false);
}

static int backend_mtp_draft(model_backend *mb, struct model_mtp_req *r, int n, char *err, size_t errlen)
{
    struct cpu_backend *b = (struct cpu_backend *)mb;
    const struct model_config *c = &b->c;
    int E = c->n_embd, V = c->n_vocab, bs = b->block_size, kmax = 0;
    if (!b->base.has_mtp) {
        sl_seterr(err, errlen, "mtp_draft: the backend was created without MTP (opts.mtp)");
        return SL_EUNSUP;
    }
    struct model_step_limits lim = {.n_vocab = V, .max_seqs = b->max_seqs, .max_ctx = b->max_ctx,
                                    .block_size = bs, .kv_blocks = b->kv_blocks};
    if (model_mtp_check(r, n, &lim, b->last_n, b->last_pos0, b->last_len, &kmax, err, errlen)) return SL_EINVAL;
    /* p's hidden state stays in its block: a forward() from p + 1 writes p + 1's entry itself */
    for (int j = 0; j < n; j++)
        keep_hidden(b, r[j].block_table, r[j].pos,
                    b->hkeep + (size_t)(b->last_q0[r[j].seq] + r[j].pos - b->last_pos0[r[j].seq]) * E);
    for (int it = 0; it < kmax; it++) {
        int ns = 0;
        for (int j = 0; j < n; j++) {
            const struct model_mtp_req *q = &r[j];
            if (it >= (q->k > 1 ? q->k : 1)) continue;
            int p = q->pos + 1 + it;
            b->sub_tok[ns] = it == 0 ? q->token : q->drafts[it - 1];
            b->sub_pos[ns] = p;
            b->sub_slot[ns] = slot_of(q->block_table, p, bs);
            b->sub_h[ns] = it == 0 ? b->hkeep + (size_t)(b->last_q0[q->seq] + q->pos - b->last_pos0[q->seq]) * E
                                   : b->mtp_g + (size_t)j * E;
            b->sub_seqs[ns] = (struct step_seq){.query_start = ns, .query_len = 1, .context_len = p + 1,
                                                .block_table = q->block_table, .n_blocks = q->n_blocks};
            b->sub_req[ns] = j;
            ns++;
        }
        mtp_layer(b, ns, ns, true);
        /* the head: g = head_norm(x), each request's next hidden state (mtp_layer has read the last one) */
        int R = 0;
        for (int t = 0; t < ns; t++) {
            int j = b->sub_req[t];
            float *g = b->mtp_g + (size_t)j * E;
            rmsnorm(g, b->x + (size_t)t * E, b->mtp[0].head_norm, E, c->norm_eps);
            if (it < r[j].k) {
                memcpy(b->hfin + (size_t)R * E, g, (size_t)E * sizeof(float));
                b->row_seq[R++] = j;
            }
        }
        if (R == 0) continue;
        matmul(b, b->logits, b->hfin, &b->lm_head, NULL, R, E, V);
#pragma omp parallel for schedule(static) num_threads(b->nt) if (R > 1)
        for (int i = 0; i < R; i++) {
            struct model_mtp_req *q = &r[b->row_seq[i]];
            const float *lg = b->logits + (size_t)i * V;
            int best = 0;
            for (int v = 1; v < V; v++)
                if (lg[v] > lg[best]) best = v;
            q->drafts[it] = best;
            if (q->logits) memcpy(q->logits + (size_t)it * V, lg, (size_t)V * sizeof(float));
        }
    }
    return 0;
}

static int backend_forward(model_backend *mb, struct step *s, char *err, size_t errlen)
{
    struct cpu_backend *b = (struct cpu_backend *)mb;
    if (!s) {
        sl_seterr(err, errlen, "forward: no step");
        return SL_EINVAL;
    }
    b->last_n = -1;
    int rc = check_step(b, s, err, errlen);
    if (rc) return rc;
    const struct model_config *c = &b->c;
    int T = s->n_tokens, E = c->n_embd;
    float eps = c->norm_eps;

    int NS = b->n_streams;
    for (int t = 0; t < T; t++) {
        deq_row(&b->tok_embd, s->token_ids[t], b->x + (size_t)t * E);
        for (int i = 0; b->hc && i < NS; i++) /* the embedding copied into every stream */
            memcpy(b->xs + ((size_t)t * NS + i) * E, b->x + (size_t)t * E, (size_t)E * sizeof(float));
    }
    if (b->trace) trace_copy(b, 0, T);
    for (size_t i = 0; b->margins && i < (size_t)c->n_layer * T; i++) b->margins[i] = INFINITY; /* no choice */
    for (size_t i = 0; b->ix_margins && i < (size_t)c->n_layer * T; i++) b->ix_margins[i] = INFINITY;
    struct step kstep;
    const struct step *ks = s; /* what the KDA layers run: s, with the verified positions' states kept */
    if (b->kda && !(ks = spec_states(b, s, &kstep, err, errlen))) return SL_ENOMEM;
    if (b->kda) cpu_kda_begin(b->kda, ks, b->states);

    for (int l = 0; l < c->n_layer; l++) {
        struct model_layer_kind k = model_layer_kind_of(c, l);
        /* hyper-connections: each block reads the streams' collapse (in x) and its output (y alone) goes
         * back into the streams; a plain residual adds the output to x itself */
        bool hc = k.resid == MODEL_RESID_HC;
        float *dst = hc ? b->y : b->x;
        if (hc) {
            cpu_hc_pre(b->hc, b, l, 0, b->xs, b->x, T);
            memset(b->y, 0, (size_t)T * E * sizeof(float));
        }
        switch (k.mixer) {
        case MODEL_MIXER_GQA: gqa_mixer(b, s, l, dst); break;
        case MODEL_MIXER_MLA:
            cpu_mla_mixer(b->mla, b, s, b->tok_seq, l, b->x, dst, b->kv + b->kv_off[l], b->block_size, 0);
            break;
        case MODEL_MIXER_KDA: kda_mixer(b, ks, l, dst); break;
        }
        if (hc) {
            round_if(b, CPU_BF16_DELTA, b->y, (size_t)T * E);
            cpu_hc_post(b->hc, b->xs, b->y, T);
            cpu_hc_pre(b->hc, b, l, 1, b->xs, b->x, T);
            memset(b->y, 0, (size_t)T * E * sizeof(float));
        }
        switch (k.ffn) {
        case MODEL_FFN_DENSE: dense_ffn(b, l, T, dst); break;
        case MODEL_FFN_MOE: moe_ffn(b, l, T, dst, b->margins ? b->margins + (size_t)l * T : NULL); break;
        }
        if (hc) {
            round_if(b, CPU_BF16_DELTA, b->y, (size_t)T * E);
            cpu_hc_post(b->hc, b->xs, b->y, T);
        }
        if (b->trace) trace_copy(b, l + 1, T);
    }

    /* prompt logprobs: every query position but the prompt's last, max_seqs rows at a time */
    for (int i = 0; i < s->n_seqs; i++) {
        struct step_seq *q = &s->seqs[i];
        if (!q->prompt_out) continue;
        int p0 = q->context_len - q->query_len;
        for (int k0 = 0; k0 < q->query_len; k0 += b->max_seqs) {
            int R = 0;
            for (int k = k0; k < q->query_len && k < k0 + b->max_seqs; k++) {
                if (p0 + k + 1 >= q->n_prompt) break;
                float *hr = b->hfin + (size_t)R * E;
                final_hidden(b, q->query_start + k, hr);
                rmsnorm(hr, hr, b->out_norm, E, eps);
                R++;
            }
            if (R == 0) break;
            matmul(b, b->logits, b->hfin, &b->lm_head, NULL, R, E, c->n_vocab);
#pragma omp parallel for schedule(static) num_threads(b->nt) if (R > 1)
            for (int r = 0; r < R; r++) {
                int p = p0 + k0 + r;
                model_logprob_row(b->logits + (size_t)r * c->n_vocab, c->n_vocab, q->history[p + 1], q->prompt_top,
                                  &q->prompt_out[p + 1]);
            }
        }
    }

    /* LM head only for the last query token of the sequences that want it,
     * and for a sequence with drafts the n_draft tokens before it too */
    int R = 0, N = 0;
    bool mtp = b->base.has_mtp;
    for (int i = 0; i < s->n_seqs; i++) {
        struct step_seq *q = &s->seqs[i];
        if (!q->want_sample && !q->logits_out) continue;
        b->row_seq[N] = i;
        b->row_first[N++] = R;
        for (int t = q->query_start + q->query_len - 1 - q->n_draft; t < q->query_start + q->query_len; t++) {
            float *hr = b->hfin + (size_t)R * E;
            final_hidden(b, t, hr);
            rmsnorm(hr, hr, b->out_norm, E, eps);
            round_if(b, CPU_BF16_FINAL, hr, (size_t)E);
            R++;
        }
    }
    if (R == 0) {
        if (mtp) mtp_after_step(b, s);
        return 0;
    }
    matmul(b, b->logits, b->hfin, &b->lm_head, NULL, R, E, c->n_vocab);
    /* sequences sample independently (each its own RNG): in parallel; a
     * sequence's drafts in order, each row after the one before it */
#pragma omp parallel for schedule(dynamic, 1) num_threads(b->nt) if (N > 1)
    for (int u = 0; u < N; u++) {
        struct step_seq *q = &s->seqs[b->row_seq[u]];
        float *lg = b->logits + (size_t)b->row_first[u] * c->n_vocab;
        if (q->logits_out) memcpy(q->logits_out, lg, (size_t)c->n_vocab * sizeof(float));
        if (!q->want_sample) continue;
        void *scr = (char *)b->samp + (size_t)omp_get_thread_num() * b->samp_bytes;
        if (q->n_draft > 0) {
            model_sample_verify(lg, q->n_draft, c->n_vocab, q->sampling, q->history, q->n_prompt, q->n_history,
                                q->rng, scr, q->spec_out, &q->n_spec_out);
            continue;
        }
        /* the parameters were checked with the step: a failure here is this row's logits */
        if (model_sample(lg, c->n_vocab, q->sampling, q->history, q->n_prompt, q->n_history, q->rng,
                         scr, &q->out) != 0) {
            q->out.token = -1;
            q->out.n_top = 0;
        }
    }
    if (b->kda && ks != s) spec_rollback(b, s);
    if (mtp) mtp_after_step(b, s);
    return 0;
}

/* ---- teardown ------------------------------------------------------------------ */

static void backend_destroy(model_backend *mb)
{
    struct cpu_backend *b = (struct cpu_backend *)mb;
    if (!b) return;
    cpu_mla_destroy(b->mla);
    cpu_hc_destroy(b->hc);
    free(b->xs);
    free(b->y);
    cpu_kda_destroy(b->kda);
    free(b->states);
    free(b->kseqs);
    free(b->kbase);
    free(b->kpos);
    free(b->kslot);
    free(b->hkda);
    free(b->kv_off);
    free(b->wmem);
    free(b->wbuf);
    free(b->L);
    free(b->rope_cos);
    free(b->rope_sin);
    free(b->kv);
    free(b->x);
    free(b->xn);
    free(b->q);
    free(b->att);
    free(b->k);
    free(b->v);
    free(b->gate);
    free(b->up);
    free(b->hfin);
    free(b->logits);
    free(b->scores);
    free(b->tok_seq);
    free(b->row_first);
    free(b->row_seq);
    free(b->samp);
    moe_cpu_destroy(b->moe);
    free(b->mtp);
    free(b->hkeep);
    free(b->last_q0);
    free(b->last_pos0);
    free(b->last_len);
    free(b->sub_tok);
    free(b->sub_pos);
    free(b->sub_slot);
    free(b->sub_h);
    free(b->sub_seqs);
    free(b->sub_req);
    free(b->mtp_in);
    free(b->mtp_g);
    free(b);
}

/* ---- for the layer kinds in other files (cpu_internal.h) ------------------------ */

void cpu_matmul(const struct cpu_backend *b, float *y, const float *x, const struct wmat *w, const float *bias, int T,
                int in, int out)
{
    matmul(b, y, x, w, bias, T, in, out);
}
void cpu_rmsnorm(float *y, const float *x, const float *w, int n, float eps) { rmsnorm(y, x, w, n, eps); }
float cpu_dot(const float *w, const float *x, int n) { return dot1(w, x, n); }
void cpu_axpy(float *o, float p, const float *v, int n) { axpy(o, p, v, n); }
void cpu_deq_row(const struct wmat *w, int64_t r, float *dst) { deq_row(w, r, dst); }
int cpu_wmat_init(struct wmat *m, const struct model_tensor *t, char *err, size_t errlen)
{
    return wmat_init(m, t, err, errlen);
}
int cpu_threads(const struct cpu_backend *b) { return b->nt; }
void cpu_backend_trace(model_backend *mb, float *dst) { ((struct cpu_backend *)mb)->trace = dst; }
void cpu_backend_route_margins(model_backend *mb, float *dst) { ((struct cpu_backend *)mb)->margins = dst; }

void cpu_backend_index_margins(model_backend *mb, float *dst)
{
    struct cpu_backend *b = (struct cpu_backend *)mb;
    b->ix_margins = dst;
    if (b->mla) cpu_mla_index_margins(b->mla, dst);
}
void cpu_backend_emulate_bf16(model_backend *mb, unsigned families) { ((struct cpu_backend *)mb)->bf16 = families; }
unsigned cpu_bf16_families(const struct cpu_backend *b) { return b->bf16; }
void *cpu_zalloc(size_t n) { return zalloc(n); }

struct cpu_backend *cpu_kernels_create(int nt, int max_in)
{
    struct cpu_backend *b = calloc(1, sizeof *b);
    if (!b) return NULL;
    b->nt = nt > 0 ? nt : omp_get_num_procs();
    b->max_in = max_in;
    b->wbuf = zalloc((size_t)b->nt * ROW_BLOCK * max_in * sizeof(float));
    if (!b->wbuf) {
        free(b);
        return NULL;
    }
    return b;
}

void cpu_kernels_destroy(struct cpu_backend *b)
{
    if (!b) return;
    free(b->wbuf);
    free(b);
}

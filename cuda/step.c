/* step.c - one step of the GPU backend: forward() packs the step's plan,
 * runs every rank's layers (enqueue, or a decode graph) and reads the
 * tokens back.
 *
 * A step: the host packs the step's inputs (token ids, positions, slots,
 * block tables, attention work items, logit rows, sampling parameters) into
 * one pinned buffer at fixed offsets and each rank copies it in one
 * transfer; the layers run on the rank's stream; the LM head runs for the
 * rows that need logits only (f32 logits). Tokens are chosen on the device
 * and only they come back: greedy rows by argmax (cuda_argmax_lse, or the
 * distributed argmax with N > 1); rows with temperature, top-k/p, min-p,
 * penalties or top logprobs by the device sampler (cuda_sample, one GPU),
 * which does what model_sample() does with the uniform number the host drew
 * from the request's RNG where model_sample would draw it, so a seeded
 * request follows the CPU backend's RNG stream; a row whose candidate set is
 * too large to sort on the device is finished by model_sample on the host
 * (exact, rare). With N > 1 such rows, rows with a logit_bias or a JSON-mode
 * mask, and rows
 * whose raw logits a test asks for (logits_out), copy their logit row (each
 * rank its slice) to the host and model_sample() picks there.
 *
 * Speculative decoding (opts->max_draft_tokens): a sequence with n_draft
 * drafts gets a logit row for each of its last n_draft + 1 query tokens; a
 * greedy one is verified from the device's argmax of each row
 * (verify_greedy), any other copies its rows to the host for
 * model_sample_verify. A step whose sequences all verify the same K <=
 * VGRAPH_K drafts (K + 1 query tokens each) runs as a graph of its own per
 * batch bucket and K (verify_k), padded as decode graphs are. On KDA layers
 * the slots are then rolled to the last accepted draft (cuda_kda_rollback:
 * the accepted drafts replayed, cuda/kda.h).
 * With method mtp the MTP layer's pass (its sub-step, and drafts for the
 * greedy sequences) follows each step on the same stream, every rank its
 * share, a graph of its own per bucket (cuda/mtp.c).
 *
 * Prefill attention runs on the tensor cores (items of up to 128 query rows)
 * where the head shape allows, else on the SIMT kernel; decode-only steps take
 * the decode kernel (attn.cu: split-K whose last split merges the others, so
 * no combine launch; RoPE and the KV write folded in, so no RoPE launch
 * either) where it takes the head shape. With the GEMVs, SwiGLU rides in the
 * gate|up GEMV's epilogue.
 *
 * Decode-only steps (every sequence one token) run as a CUDA graph (per rank,
 * NCCL calls included) captured once per batch-size bucket (1, 2, 4, ...
 * max_seqs): the step is padded to the bucket with tokens that write the
 * backend's private pad block and are never read. --enforce-eager
 * (opts->enforce_eager) turns graphs off.
 */
#include <cublas_v2.h>
#include <cuda_runtime.h>
#include <math.h>
#include <nccl.h>
#include <omp.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "cuda/cuda_internal.h"
#include "cuda/hc.h"
#include "cuda/kda.h"
#include "cuda/mla.h"
#include "cuda/moe.h"
#include "cuda/mtp.h"

/* ---- forward ------------------------------------------------------------------- */

/* Greedy with nothing that needs the whole distribution: the device answers. */
static bool device_greedy(const struct step_seq *q)
{
    const struct model_sampling *s = q->sampling;
    return !q->logits_out && (s->temperature == 0.0f || s->top_k == 1) && s->repetition_penalty == 1.0f &&
           s->presence_penalty == 0.0f && s->frequency_penalty == 0.0f && s->top_logprobs == 0 &&
           s->n_logit_bias == 0 && !s->allow;
}

static int check_step(struct cuda_backend *b, const struct step *s, char *err, size_t errlen)
{
    if (!b->kv_blocks) {
        sl_seterr(err, errlen, "forward: KV memory not allocated (kv_alloc)");
        return SL_EINVAL;
    }
    struct model_step_limits lim = {.n_vocab = b->c.n_vocab, .max_tokens = b->max_tokens, .max_seqs = b->max_seqs,
                                    .max_ctx = b->max_ctx, .block_size = b->block_size, .kv_blocks = b->kv_blocks,
                                    .max_draft = b->max_draft, .state_slots = b->state_bytes ? b->state_slots : 0,
                                    .state_rollback = true};
    if (b->state_bytes && !b->state_slots) {
        sl_seterr(err, errlen, "forward: recurrent state slots not allocated (state_alloc)");
        return SL_EINVAL;
    }
    /* sampling parameters included: the device sampler runs before the host could refuse them */
    return model_step_check(s, &lim, b->tok_seq, err, errlen);
}

#define HIN(b, f, type) ((type *)((b)->hin + (b)->lay.f))

/* The device sampler's inputs for the step's R logit rows (every row gets
 * one; greedy rows are temperature 0): parameters, the uniform each
 * ROW_SAMPLE row draws from its request's RNG exactly where model_sample
 * would, and the penalty entries. A row whose entries do not fit goes to the
 * host. Sets job.n_samp and job.n_pen. */
static void pack_sampling(struct cuda_backend *b, const struct step *s, int R)
{
    struct cuda_sample_row *sr = HIN(b, srows, struct cuda_sample_row);
    struct cuda_sample_pen *pen = HIN(b, pen, struct cuda_sample_pen);
    int ns = 0, np = 0;
    for (int r = 0; r < R; r++) {
        sr[r] = (struct cuda_sample_row){.temperature = 0.0f, .top_p = 1.0f, .repetition_penalty = 1.0f};
        if (b->row_mode[r] != ROW_SAMPLE) continue;
        struct step_seq *q = &s->seqs[b->row_seq[r]];
        const struct model_sampling *p = q->sampling;
        bool pens = p->repetition_penalty != 1.0f || p->presence_penalty != 0.0f || p->frequency_penalty != 0.0f;
        if (pens && np + q->n_history > b->pen_cap) {
            b->row_mode[r] = ROW_HOST;
            b->row_host[r] = true;
            continue;
        }
        struct cuda_sample_row *w = &sr[r];
        *w = (struct cuda_sample_row){.temperature = p->temperature, .top_p = p->top_p, .min_p = p->min_p,
                                      .log_min_p = p->min_p > 0.0f ? logf(p->min_p) : 0.0f,
                                      .repetition_penalty = p->repetition_penalty,
                                      .presence_penalty = p->presence_penalty,
                                      .frequency_penalty = p->frequency_penalty, .top_k = p->top_k,
                                      .top_logprobs = p->top_logprobs, .pen_off = np};
        if (pens) {
            w->n_pen = cuda_sample_pen_build(q->history, q->n_prompt, q->n_history, b->pen_mark, pen + np);
            np += w->n_pen;
        }
        uint64_t dummy = 0, *rng = q->rng ? q->rng : &dummy;
        b->rng_before[r] = *rng;
        if (p->temperature > 0.0f && p->top_k != 1) w->u = model_rng_uniform(rng);
        ns++;
    }
    b->job.n_samp = ns;
    b->job.n_pen = np;
}
#define DIN(k, f, type) ((type *)((k)->din + (k)->lay.f))

/* Packs the step into hin. Tokens [n_tokens, Tp) and rows [R, Rp) are
 * padding (decode graphs). Returns the bytes of hin to copy, or 0 when the
 * step does not fit the buffers. *R gets the number of logit rows. */
/* Whether a step runs on the decode attention kernel (which also does RoPE
 * and the KV write): one answer for packing and launch. */
static bool dec_kernel(const struct cuda_backend *b, bool decode)
{
    return decode && cuda_attention_dec_ok(b->c.head_dim, b->c.n_head / b->c.n_head_kv);
}

/* blocks of a sequence's table that the step reads (its share of the flat bt) */
static int seq_blocks(const struct step_seq *q, int bs) { return (q->context_len + bs - 1) / bs; }

/* A prefill step's tiles that attend to at least t.long_split_keys keys ("long"
 * tiles: a chunk deep into a long document) take many times the others'
 * time, and when they are few they leave SMs idle in their last wave (a
 * chunk of 430 tokens at 100K context: 14 tiles x 8 KV heads = 112 blocks
 * on 132 SMs). long_splits picks how many parts (1-8) to split each long
 * tile's keys into: the count whose blocks fill their waves best, by at
 * least 3% over fewer, each part >= long_keys / 2 keys. */
static int long_splits(const struct cuda_backend *b, const struct step *s, int qt, int KVH)
{
    int n = 0, kmin = INT32_MAX, long_keys = b->t.long_split_keys;
    if (long_keys <= 0) return 1;
    for (int i = 0; i < s->n_seqs; i++) {
        const struct step_seq *q = &s->seqs[i];
        int p0 = q->context_len - q->query_len; /* positions of the sequence's step tokens: p0 .. context_len - 1 */
        for (int t0 = 0; t0 < q->query_len; t0 += qt) {
            int hi = p0 + (t0 + qt < q->query_len ? t0 + qt : q->query_len); /* the tile's last key + 1 */
            if (hi >= long_keys) n++, kmin = hi < kmin ? hi : kmin;
        }
    }
    int u = n * KVH, best = 1;
    if (!u || u >= 3 * b->n_sm) return 1;
    double fill = (double)u / ((u + b->n_sm - 1) / b->n_sm * b->n_sm);
    for (int k = 2; k <= 8 && kmin / k >= long_keys / 2; k++) {
        double f = (double)u * k / ((u * k + b->n_sm - 1) / b->n_sm * b->n_sm);
        if (f > fill * 1.03) fill = f, best = k;
    }
    return best;
}

static size_t pack_step(struct cuda_backend *b, const struct step *s, int Tp, int *R)
{
    int T = s->n_tokens, bs = b->block_size, grp = b->c.n_head / b->c.n_head_kv, KVH = b->r[0].KVH;
    bool decode = s->n_tokens == s->n_seqs;
    /* prefill on the tensor cores: bigger tiles; decode-only steps (and their
     * graphs) keep the SIMT kernel with one token's heads per item */
    b->job.max_rows = decode ? grp : b->tc_rows ? b->tc_rows : CUDA_ATTN_ROWS;
    int qt = (decode || !b->tc_rows ? CUDA_ATTN_ROWS : b->tc_rows) / grp;
    int64_t *slots = HIN(b, slots, int64_t);
    int32_t *ids = HIN(b, ids, int32_t), *pos = HIN(b, pos, int32_t), *tpart = HIN(b, tok_part, int32_t),
            *tns = HIN(b, tok_nsplit, int32_t), *tbt = HIN(b, tok_bt, int32_t), *rows = HIN(b, rows, int32_t),
            *bt = HIN(b, bt, int32_t);
    struct cuda_attn_item *items = HIN(b, items, struct cuda_attn_item);
    int64_t pad_slot = (int64_t)b->kv_blocks * bs;
    for (int t = 0; t < Tp; t++) {
        bool real = t < T;
        slots[t] = real ? s->slots[t] : pad_slot;
        ids[t] = real ? s->token_ids[t] : 0;
        pos[t] = real ? s->positions[t] : 0;
        tpart[t] = -1;
        tns[t] = 0;
        tbt[t] = 0; /* padding (position 0) attends the first sequence's first key; its output is dropped */
    }
    int nbt = 0, r = 0, tiles = 0;
    for (int i = 0; i < s->n_seqs; i++) {
        const struct step_seq *q = &s->seqs[i];
        int nb = seq_blocks(q, bs);
        if (nbt + nb > b->bt_cap) return 0;
        memcpy(bt + nbt, q->block_table, (size_t)nb * 4);
        for (int t = q->query_start; t < q->query_start + q->query_len; t++) tbt[t] = nbt;
        nbt += nb;
        tiles += (q->query_len + qt - 1) / qt;
        if (q->want_sample && q->n_draft > 0) {
            /* verification: a row for each of the last n_draft + 1 query
             * tokens, in order; greedy ones keep the device's argmax, the
             * others go to the host whole (model_sample_verify draws them in
             * order from the request's RNG). logits_out gets the first. */
            bool g = device_greedy(q);
            for (int t = q->query_start + q->query_len - 1 - q->n_draft; t < q->query_start + q->query_len; t++) {
                b->row_seq[r] = i;
                b->row_mode[r] = g ? ROW_GREEDY : ROW_HOST;
                b->row_host[r] = !g;
                rows[r++] = t;
            }
        } else if (q->want_sample || q->logits_out) {
            b->row_seq[r] = i;
            b->row_mode[r] = !q->want_sample || device_greedy(q) ? ROW_GREEDY
                             : b->dev_sample && !q->logits_out && !q->sampling->n_logit_bias &&
                                       !q->sampling->allow
                                   ? ROW_SAMPLE
                                                                                             : ROW_HOST;
            b->row_host[r] = q->logits_out || b->row_mode[r] == ROW_HOST;
            rows[r++] = q->query_start + q->query_len - 1;
        }
    }
    *R = r;
    /* split-K only when the step is short (decode-like) and its tiles alone
     * would leave the GPU idle */
    bool split_ok = Tp <= 256;
    int units = tiles * KVH, want = units >= 2 * b->n_sm ? 1 : (2 * b->n_sm + units - 1) / units;
    /* longer prefill steps: split the tiles that reach far back (a chunk deep
     * into a long document) when that fills the SMs' waves better */
    int lns = !split_ok && !decode && b->tc_rows ? long_splits(b, s, qt, KVH) : 1, ps = lns > 1 ? lns : 0;
    b->job.pstride = ps;
    int part_cap = b->part_rows * (CUDA_ATTN_MAXSPLIT / (ps ? ps : CUDA_ATTN_MAXSPLIT)); /* rows at stride ps */
    /* keys per split at least: the decode kernel's 4 warps take 32 each, and
     * at least 128 keys a split measured fastest at batch 1 (223 tok/s
     * against 216-220 at 32-256; larger batches did not move), in multiples
     * of 128 */
    bool dk = dec_kernel(b, decode);
    int n = 0, part = 0, kmin = dk ? 128 : 64, kround = dk ? 128 : 32;
    for (int i = 0, bt0 = 0; i < s->n_seqs; bt0 += seq_blocks(&s->seqs[i], bs), i++) {
        const struct step_seq *q = &s->seqs[i];
        for (int t0 = q->query_start; t0 < q->query_start + q->query_len; t0 += qt) {
            int nq = q->query_start + q->query_len - t0 < qt ? q->query_start + q->query_len - t0 : qt;
            int kv_hi = 0;
            for (int t = t0; t < t0 + nq; t++)
                if (pos[t] + 1 > kv_hi) kv_hi = pos[t] + 1;
            int ns = 1;
            if (split_ok && want > 1) {
                /* short items: a block's latency is per 32-key tile (per warp in the decode kernel) */
                ns = (kv_hi + kmin - 1) / kmin;
                if (ns > want) ns = want;
                if (ns > CUDA_ATTN_MAXSPLIT) ns = CUDA_ATTN_MAXSPLIT;
                if (part + nq * grp > b->part_rows) ns = 1;
                if (ns < 1) ns = 1;
            }
            int kr = kround;
            if (lns > 1 && kv_hi >= b->t.long_split_keys && part + nq * grp <= part_cap)
                ns = lns, kr = 128; /* whole 128-key tiles of the warpgroup kernel */
            int chunk = ((kv_hi + ns - 1) / ns + kr - 1) / kr * kr;
            if (n + ns > b->lay.max_items) return 0;
            for (int k = 0; k < ns; k++) {
                int lo = k * chunk, hi = lo + chunk < kv_hi ? lo + chunk : kv_hi;
                items[n++] = (struct cuda_attn_item){.bt0 = bt0, .t0 = t0, .nq = nq, .kv_lo = lo, .kv_hi = hi,
                                                     .split = k, .nsplit = ns, .part = part};
            }
            if (ns > 1) {
                for (int t = t0; t < t0 + nq; t++) {
                    tpart[t] = part + (t - t0) * grp;
                    tns[t] = ns;
                }
                part += nq * grp;
            }
        }
    }
    *HIN(b, n_items, int32_t) = n;
    if (b->state_bytes && !cuda_kda_pack(b, s, Tp)) return 0;
    for (int k = r; k < (Tp < b->max_rows ? Tp : b->max_rows); k++) rows[k] = k; /* graph padding rows */
    pack_sampling(b, s, r);
    return b->lay.bt + (size_t)nbt * 4;
}

static cublasStatus_t gemm(struct rank *k, const uint16_t *x, const uint16_t *W, void *y, bool yf32, int T, int in,
                           int out)
{
    const float one = 1.0f, zero = 0.0f;
    if (T <= CUDA_GEMV_MMA_MAX_T && in % 8 == 0)
        return cuda_gemv(W, x, y, yf32, T, in, out, k->st) == cudaSuccess ? CUBLAS_STATUS_SUCCESS
                                                                             : CUBLAS_STATUS_EXECUTION_FAILED;
    return cublasGemmEx(k->blas, CUBLAS_OP_T, CUBLAS_OP_N, out, T, in, &one, W, CUDA_R_16BF, in, x, CUDA_R_16BF, in,
                        &zero, y, yf32 ? CUDA_R_32F : CUDA_R_16BF, out, CUBLAS_COMPUTE_32F, CUBLAS_GEMM_DEFAULT);
}

/* y = x W^T for a projection of `out` outputs: its bf16 matrix W (gemm) or,
 * P->n > 0, its parts, each into its columns of y (row stride out). */
static cublasStatus_t proj(struct rank *k, const struct qproj *P, const uint16_t *W, const uint16_t *x, void *y,
                           bool yf32, int T, int in, int out)
{
    if (!P->n) return gemm(k, x, W, y, yf32, T, in, out);
    const float one = 1.0f, zero = 0.0f;
    for (int i = 0; i < P->n; i++) {
        const struct qpart *q = &P->p[i];
        void *yi = yf32 ? (void *)((float *)y + q->off) : (void *)((uint16_t *)y + q->off);
        cublasStatus_t s =
            q->w ? cublasGemmEx(k->blas, CUBLAS_OP_T, CUBLAS_OP_N, q->rows, T, in, &one, q->w, CUDA_R_16BF, in, x,
                                CUDA_R_16BF, in, &zero, yi, yf32 ? CUDA_R_32F : CUDA_R_16BF, out, CUBLAS_COMPUTE_32F,
                                CUBLAS_GEMM_DEFAULT)
                 : cuda_qgemm(&q->q, x, yi, yf32, out, T, &k->qws, k->blas, k->st);
        if (s != CUBLAS_STATUS_SUCCESS) return s;
    }
    return CUBLAS_STATUS_SUCCESS;
}

cublasStatus_t cuda_proj(struct rank *k, const struct qproj *P, const uint16_t *W, const uint16_t *x, void *y,
                         bool yf32, int T, int in, int out)
{
    return proj(k, P, W, x, y, yf32, T, in, out);
}

/* Whether an all-reduce of n floats goes through cuda_peer_allreduce. Every
 * all-reduce of a step has n = T E, so a step takes one path for all of
 * them. */
static bool use_peer(const struct cuda_backend *b, size_t n) { return b->peer && !b->skip_comm && n <= b->peer_elems; }

/* cuda_peer_allreduce's arguments for rank k's input buffer i. Buffers:
 * 0 for the o projection, 1 for down, 2 for the embedding, so consecutive
 * all-reduces (..., o, down, next step's embedding, o, ...) never share a
 * buffer, as the kernel's contract asks. */
static struct cuda_peer_ar peer_args(const struct rank *k, int i)
{
    const struct cuda_backend *b = k->b;
    struct cuda_peer_ar a = {.epoch = k->pepoch, .abort = b->peer_abort, .n_ranks = b->tp, .rank = k->id};
    for (int p = 0; p < b->tp; p++) a.src[p] = b->r[p].pbuf[i], a.flags[p] = b->r[p].pflags;
    return a;
}

/* A row-parallel projection: y = x W^T summed over the ranks, rounded to
 * bf16 once from the f32 sum, into delta, or with resid (the fused path)
 * added into the residual x: on one GPU in the GEMV's epilogue, with N > 1
 * in the peer all-reduce (the fused path runs only when use_peer). buf: its
 * peer all-reduce buffer. */
static int proj_rows(struct rank *k, const uint16_t *x, const struct qproj *P, const uint16_t *W, int T, int in,
                     int E, int buf, bool resid, char *err, size_t errlen)
{
    size_t n = (size_t)T * E;
    if (k->b->tp == 1) {
        if (resid) CK(cuda_gemv_residual(W, x, k->x, T, in, E, k->st));
        else CB(proj(k, P, W, x, k->delta, false, T, in, E));
        return 0;
    }
    if (use_peer(k->b, n)) {
        CB(proj(k, P, W, x, k->pbuf[buf], true, T, in, E));
        struct cuda_peer_ar a = peer_args(k, buf);
        CK(cuda_peer_allreduce(&a, n, resid ? NULL : k->delta, resid ? k->x : NULL, resid, k->st));
        return 0;
    }
    CB(proj(k, P, W, x, k->deltaf, true, T, in, E));
    if (!k->b->skip_comm) NC(ncclAllReduce(k->deltaf, k->deltaf, n, ncclFloat, ncclSum, k->comm, k->st));
    CK(cuda_f32_to_bf16(k->deltaf, n, k->delta, k->st));
    return 0;
fail:
    return SL_EDEVICE;
}

int cuda_proj_rows(struct rank *k, const uint16_t *x, const struct qproj *P, const uint16_t *W, int T, int in, int E,
                   int buf, bool resid, char *err, size_t errlen)
{
    return proj_rows(k, x, P, W, T, in, E, buf, resid, err, errlen);
}

/* x = the embeddings of T tokens ids: with N > 1 each rank's vocabulary
 * rows, and an all-reduce (peer buffer 2) completes them. */
int cuda_embed_rows(struct rank *k, const int32_t *ids, int T, char *err, size_t errlen)
{
    struct cuda_backend *b = k->b;
    int E = b->c.n_embd;
    cudaStream_t st = k->st;
    if (b->tp == 1) {
        CK(cuda_embed(k->tok_embd, ids, T, E, k->x, st));
        return 0;
    }
    bool pr = use_peer(b, (size_t)T * E);
    CK(cuda_embed_shard(k->tok_embd, ids, T, E, k->v0, k->vn, pr ? k->pbuf[2] : k->x, st));
    if (pr) {
        struct cuda_peer_ar a = peer_args(k, 2);
        CK(cuda_peer_allreduce(&a, (size_t)T * E, NULL, k->x, false, st));
    } else if (!b->skip_comm) {
        NC(ncclAllReduce(k->x, k->x, (size_t)T * E, ncclFloat, ncclSum, k->comm, st));
    }
    return 0;
fail:
    return SL_EDEVICE;
}

/* The greedy tokens of R logit rows (k->logits, this rank's vocabulary
 * slice): with N > 1 every rank's (max, sum, argmax) parts all-gathered and
 * combined in rank order, so every rank gets the same tokens. */
int cuda_head_argmax(struct rank *k, int R, int32_t *tok, float *lp, char *err, size_t errlen)
{
    struct cuda_backend *b = k->b;
    cudaStream_t st = k->st;
    if (b->tp == 1) {
        CK(cuda_argmax_lse(k->logits, R, k->vn, k->amp, tok, lp, st));
        return 0;
    }
    CK(cuda_argmax_part(k->logits, R, k->vn, k->v0, k->amp, st));
    if (!b->skip_comm) NC(ncclAllGather(k->amp, k->amp_all, (size_t)R * sizeof *k->amp / 4, ncclInt32, k->comm, st));
    CK(cuda_argmax_combine(k->amp_all, b->tp, R, tok, lp, st));
    return 0;
fail:
    return SL_EDEVICE;
}

/* whether projection P is one packed matrix with fused decode forms (cuda_qgemv_fuses; norm: the norm's) */
static bool qmat_fuses(const struct qproj *P, bool norm)
{
    return P->n == 1 && !P->p[0].w && cuda_qgemv_fuses(&P->p[0].q, norm);
}

/* Enqueues rank k's whole forward pass for T tokens (some maybe padding), R
 * logit rows, and max_items attention items, up to the greedy tokens. */
static int enqueue(struct rank *k, int T, int R, int max_items, bool decode, char *err, size_t errlen)
{
    struct cuda_backend *b = k->b;
    const struct model_config *c = &b->c;
    int E = c->n_embd, F = k->F, H = k->H, KVH = k->KVH, D = c->head_dim;
    int Q = H * D, QKV = Q + 2 * KVH * D;
    cudaStream_t st = k->st;
    enum cudaStreamCaptureStatus cs;
    if (cuda_embed_rows(k, DIN(k, ids, int32_t), T, err, errlen)) goto fail;
    /* decode of one token: the norms ride in the GEMV prologues,
     * SwiGLU and the residual adds in their epilogues (bit-identical to the
     * unfused kernels, but for the norm's scale, which the one-token GEMVs
     * apply to their sums: kernels.h, cuda_gemv_late); x then already
     * holds every layer's output. Only at
     * T = 1, where the GEMVs are warp kernels: at 2-4 tokens the fused
     * kernels measured slower than the unfused ones (block kernels 164.4 vs
     * 148.4 us per layer at T = 4; tensor-core kernels 603 vs 838 tok/s at
     * batch 4: each block normalizes all T rows before its first MMA).
     * With N > 1 only when the all-reduces go through the peer kernel: the
     * residual adds are then in it, after the sums */
    bool fz = b->fused && T == 1 && (b->tp == 1 || use_peer(b, (size_t)T * E));
    /* decode of one token where fz is off (packed weights, MoE layers): the
     * same idea on the kernels that have fused forms, each bit for bit the
     * unfused pair: the attention norm in the packed qkv GEMV's prologue,
     * the o and down projections adding into x in their epilogues, the FFN
     * norm in the MoE routing kernel's prologue and the MoE output added into
     * x in its combine (one GPU; not with MTP, which reads x and delta
     * after the step, nor hyper-connections) */
    const bool qf = !fz && T == 1 && b->tp == 1 && !k->hcx && !b->base.has_mtp && !(b->t.ablate & CUDA_ABLATE_NORM);
    /* hyper-connections: the embedding into every stream */
    if (k->hcx && cuda_hc_begin(k, T, err, errlen)) goto fail;
    /* Each layer: the residual -> k->xn, the mixer (k->xn -> k->delta), k->delta -> the residual and the
     * residual -> k->xn, the FFN (k->xn -> k->delta), k->delta -> the residual. A plain residual adds a
     * block's output in the next norm (pend: k->delta not yet in k->x); hyper-connection streams take
     * it back at once (cuda/hc.h). fz: the norms, SwiGLU and the adds ride in the GEMVs. */
    bool pend = false;
    for (int l = 0; l < c->n_layer; l++) {
        const struct clayer *L = &k->L[l];
        const struct model_layer_kind lk = model_layer_kind_of(c, l);
        const bool hc = lk.resid == MODEL_RESID_HC;
        unsigned ab = b->t.ablate;
        const bool qfl = qf && lk.mixer == MODEL_MIXER_GQA;
        const bool qkv_f = qfl && !pend && !(ab & CUDA_ABLATE_QKV) && qmat_fuses(&L->qqkv, true);
        const bool o_f = qfl && qmat_fuses(&L->qo, false);
        bool ffn_f = false; /* the FFN's output added into x */
        if (hc) {
            if (cuda_hc_in(k, l, 0, T, err, errlen)) goto fail;
        } else if (!fz && !qkv_f && !(ab & CUDA_ABLATE_NORM)) {
            /* the previous layer's MLP output joins the residual here */
            CK(cuda_add_rmsnorm(k->x, pend ? k->delta : NULL, L->attn_norm, NULL, T, E, c->norm_eps, k->xn, st));
        }
        if (lk.mixer == MODEL_MIXER_GQA) {
            if (fz) {
                if (!(ab & CUDA_ABLATE_QKV))
                    CK(cuda_gemv_rmsnorm(L->wqkv, k->x, L->attn_norm, c->norm_eps, k->qkv, T, E, QKV, st));
            } else if (qkv_f) {
                CK(cuda_qgemv_rmsnorm(&L->qqkv.p[0].q, k->x, L->attn_norm, c->norm_eps, k->qkv, st));
            } else {
                if (!(ab & CUDA_ABLATE_QKV)) CB(proj(k, &L->qqkv, L->wqkv, k->xn, k->qkv, false, T, E, QKV));
            }
            size_t es = b->kv8 ? 1 : 2; /* bytes per KV element */
            char *kc = (char *)k->kv + k->kv_off[l], *vc = kc + k->kv_layer * es; /* kv_off: cuda_rank_kv_alloc */
            struct cuda_rope_args ra = {
                .qkv = k->qkv, .bias = L->bqkv, .q_norm = L->q_norm, .k_norm = L->k_norm, .cos = k->rope_cos,
                .sin = k->rope_sin, .pos = DIN(k, pos, int32_t), .slots = DIN(k, slots, int64_t), .T = T, .H = H,
                .KVH = KVH, .D = D, .rope_dim = c->rope_dim, .neox = c->rope_type == MODEL_ROPE_NEOX,
                .eps = c->norm_eps, .q = k->q, .kc = kc, .vc = vc, .kv8 = b->kv8,
            };
            /* decode steps on the decode kernel fold RoPE and the KV write in */
            bool dk = dec_kernel(b, decode);
            if (!dk && !(ab & CUDA_ABLATE_ATTN)) CK(cuda_rope_kv(&ra, st));
            struct cuda_attn_args aa = {
                .q = k->q, .kc = kc, .vc = vc, .kv8 = b->kv8, .pos = DIN(k, pos, int32_t), .bt = DIN(k, bt, int32_t),
                .items = DIN(k, items, struct cuda_attn_item),
                .n_items = DIN(k, n_items, int32_t), .max_items = max_items,
                .max_rows = decode ? H / KVH : b->job.max_rows, .H = H, .KVH = KVH, .D = D,
                .block_size = b->block_size, .scale = 1.0f / sqrtf((float)D), .part = k->part,
                .pstride = decode ? 0 : b->job.pstride,
                .tok_part = DIN(k, tok_part, int32_t), .tok_nsplit = DIN(k, tok_nsplit, int32_t), .T = T, .out = k->att,
                /* pack_step splits a decode step's items until they fill ~2 blocks
                 * an SM, so from 32 token x KV head pairs (4 tokens of Llama-8B on
                 * one GPU) at 1K context its blocks outnumber what 2 an SM hold:
                 * there the decode kernel's 3-blocks-an-SM build */
                .cnt = dk ? k->cnt : NULL,
                .dec_wide = T * KVH >= 32,
                .rope = dk ? ra : (struct cuda_rope_args){0},
            };
            if (!(ab & CUDA_ABLATE_ATTN)) CK(cuda_attention(&aa, st));
            if (o_f && !(ab & CUDA_ABLATE_O)) CK(cuda_qgemv_residual(&L->qo.p[0].q, k->att, k->x, T, st));
            else if (!(ab & CUDA_ABLATE_O) && proj_rows(k, k->att, &L->qo, L->wo, T, Q, E, 0, fz, err, errlen)) goto fail;
        } else if (lk.mixer == MODEL_MIXER_MLA) {
            /* the MLA mixer (cuda/mla.h): reads xn, leaves its output in delta (fz is off: b->fused) */
            if (cuda_mla_mixer(k, l, T, decode, err, errlen)) goto fail;
        } else if (lk.mixer == MODEL_MIXER_KDA) {
            /* KDA (cuda/kda_step.c): reads xn, its output in delta, as the o projection leaves it */
            if (cuda_kda_mixer(k, l, T, decode, err, errlen)) goto fail;
        }
        if (fz) {
            if (b->tp == 1 && c->n_layer >= 2 && !(ab & (CUDA_ABLATE_GU | CUDA_ABLATE_DOWN))) {
                /* one GPU: the down GEMV reads h as gate/up stores it, tagged
                 * with the layer (consecutive calls differ) */
                CK(cuda_gemv_mlp(L->wgu, L->wdown, k->x, L->ffn_norm, c->norm_eps, k->h, T, E, F, k->hw, l + 1, st));
                continue;
            }
            if (!(ab & CUDA_ABLATE_GU))
                CK(cuda_gemv_rmsnorm_swiglu(L->wgu, k->x, L->ffn_norm, c->norm_eps, k->h, T, E, F, st));
            if (!(ab & CUDA_ABLATE_DOWN) && proj_rows(k, k->h, &L->qdown, L->wdown, T, F, E, 1, true, err, errlen))
                goto fail;
            continue;
        }
        if (hc) {
            if (cuda_hc_out(k, l, 0, T, err, errlen) || cuda_hc_in(k, l, 1, T, err, errlen)) goto fail;
        } else if (!(ab & CUDA_ABLATE_NORM)) {
            ffn_f = o_f && lk.ffn == MODEL_FFN_MOE && !(ab & CUDA_ABLATE_MOE) && cuda_moe_ffn_fuses(k, l, T);
            if (!ffn_f) CK(cuda_add_rmsnorm(k->x, o_f ? NULL : k->delta, L->ffn_norm, NULL, T, E, c->norm_eps, k->xn, st));
        }
        if (lk.ffn == MODEL_FFN_DENSE) {
            bool gu_gemv = !L->qgu.n && T <= CUDA_GEMV_MMA_MAX_T && E % 8 == 0;
            if (!(ab & CUDA_ABLATE_GU) && c->moe.swiglu_limit > 0) {
                /* glm5_next's clamped SwiGLU: after the projection, whatever its format; gate|up in f32 (hc.h) */
                CB(proj(k, &L->qgu, L->wgu, k->xn, k->gu, true, T, E, 2 * F));
                CK(cuda_swiglu_limit((const float *)k->gu, T, F, c->moe.swiglu_limit, k->h, st));
            } else if (!(ab & CUDA_ABLATE_GU) && gu_gemv) {
                /* SwiGLU in the GEMV's epilogue: bit for bit the two kernels below */
                CK(cuda_gemv_swiglu(L->wgu, k->xn, k->h, T, E, F, st));
            } else if (!(ab & CUDA_ABLATE_GU) && !L->qgu.n && T >= b->t.gemm_wg_min_t && cuda_gemm_wg_ok(T, E, 2 * F)) {
                /* sm_90: SwiGLU in the warpgroup GEMM's epilogue, gate|up never stored */
                CK(cuda_gemm_wg_swiglu(L->wgu, k->xn, k->h, T, E, F, st));
            } else if (!(ab & CUDA_ABLATE_GU) && L->qgu.n == 1 && !L->qgu.p[0].w && T > CUDA_QGEMV_MMA_MAX_T &&
                       T >= b->t.gemm_wg_min_t && cuda_gemm_wg_ok(T, E, 2 * F) &&
                       k->qws.deq_bytes >= (size_t)2 * F * E * 2) {
                /* a long step: gate|up dequantized whole, then the warpgroup GEMM with SwiGLU, as bf16 weights */
                CK(cuda_qdequant(&L->qgu.p[0].q, 0, 2 * F, k->qws.deq, st));
                CK(cuda_gemm_wg_swiglu(k->qws.deq, k->xn, k->h, T, E, F, st));
            } else if (!(ab & CUDA_ABLATE_GU) && L->qgu.n == 1 && !L->qgu.p[0].w) {
                /* one packed gate|up matrix: SwiGLU in the GEMV's epilogue where it can be */
                CB(cuda_qgemm_swiglu(&L->qgu.p[0].q, k->xn, k->h, k->gu, T, &k->qws, k->blas, st));
            } else if (!(ab & CUDA_ABLATE_GU)) {
                CB(proj(k, &L->qgu, L->wgu, k->xn, k->gu, false, T, E, 2 * F));
                CK(cuda_swiglu(k->gu, T, F, k->h, st));
            }
            ffn_f = qfl && !(ab & CUDA_ABLATE_DOWN) && qmat_fuses(&L->qdown, false);
            if (ffn_f) CK(cuda_qgemv_residual(&L->qdown.p[0].q, k->h, k->x, T, st));
            else if (!(ab & CUDA_ABLATE_DOWN) && proj_rows(k, k->h, &L->qdown, L->wdown, T, F, E, 1, false, err, errlen))
                goto fail;
        } else if (lk.ffn == MODEL_FFN_MOE) {
            if (!(ab & CUDA_ABLATE_MOE) && cuda_moe_ffn(k, l, T, decode, ffn_f ? L->ffn_norm : NULL, err, errlen))
                goto fail;
        }
        if (hc && cuda_hc_out(k, l, 1, T, err, errlen)) goto fail;
        pend = !hc && !ffn_f;
    }
    if (R > 0) {
        /* hyper-connections: the head reads the streams' mean */
        if (k->hcx && cuda_hc_final(k, T, err, errlen)) goto fail;
        CK(cuda_add_rmsnorm(k->x, pend && !fz ? k->delta : NULL, k->out_norm, DIN(k, rows, int32_t), R, E,
                            c->norm_eps, k->hfin, st));
        if (!(b->t.ablate & CUDA_ABLATE_HEAD))
            CB(proj(k, &k->qhead, k->lm_head, k->hfin, k->logits, true, R, E, k->vn));
        if (cuda_head_argmax(k, R, k->tok, k->lp, err, errlen)) goto fail;
    }
    return 0;
fail:
    /* a step cut short may leave the tagged h with a tag the next step's
     * first layers use again (cuda_gemv_mlp): clear it (a captured step
     * ran nothing) */
    if (cudaStreamIsCapturing(st, &cs) == cudaSuccess && cs == cudaStreamCaptureStatusNone)
        cudaMemsetAsync(k->hw, 0, (size_t)k->F * sizeof *k->hw, st);
    return SL_EDEVICE;
}

int cuda_graph_run(struct rank *k, cudaGraphExec_t *ge, int (*fn)(struct rank *k, void *arg, char *err, size_t errlen),
                   void *arg, char *err, size_t errlen)
{
    if (!*ge) {
        cudaGraph_t g = NULL;
        CK(cudaStreamBeginCapture(k->st, cudaStreamCaptureModeThreadLocal));
        int rc = fn(k, arg, err, errlen);
        cudaError_t e = cudaStreamEndCapture(k->st, &g);
        if (rc) {
            if (g) cudaGraphDestroy(g);
            return rc;
        }
        CK(e);
        e = cudaGraphInstantiate(ge, g, 0);
        cudaGraphDestroy(g);
        if (e != cudaSuccess) *ge = NULL;
        CK(e);
    }
    CK(cudaGraphLaunch(*ge, k->st));
    return 0;
fail:
    return SL_EDEVICE;
}

/* A graph's step: every one of its Tp padded tokens a logit row */
static int enqueue_bucket(struct rank *k, void *arg, char *err, size_t errlen)
{
    (void)arg;
    int Tp = k->b->job.Tp;
    return enqueue(k, Tp, Tp, Tp * CUDA_ATTN_MAXSPLIT, k->b->job.decode, err, errlen);
}

int cuda_rank_forward(struct rank *k, char *err, size_t errlen)
{
    struct cuda_backend *b = k->b;
    int Tp = b->job.Tp, R = b->job.R, gi = b->job.gi, V = b->c.n_vocab, rc;
    CK(cudaSetDevice(k->dev));
    if (!b->warming && ++k->steps == b->t.tp_fault_step && k->id == b->t.tp_fault_rank) {
        sl_seterr(err, errlen, "GPU %d: injected fault at step %ld (tuning.tp_fault_rank)", k->dev, k->steps);
        return SL_EDEVICE;
    }
    k->lay = b->lay;
    CK(cudaMemcpyAsync(k->din, b->hin, b->job.nbytes, cudaMemcpyHostToDevice, k->st));
    if (b->job.n_samp) {
        CK(cudaMemcpyAsync(k->din + b->lay.srows, b->hin + b->lay.srows, (size_t)R * sizeof(struct cuda_sample_row),
                           cudaMemcpyHostToDevice, k->st));
        if (b->job.n_pen)
            CK(cudaMemcpyAsync(k->din + b->lay.pen, b->hin + b->lay.pen,
                               (size_t)b->job.n_pen * sizeof(struct cuda_sample_pen), cudaMemcpyHostToDevice, k->st));
    }
    if (gi >= 0) {
        /* a decode step's graph, or a verify step's (K + 1 tokens a sequence, every row a logit row) */
        cudaGraphExec_t *ge = b->job.vk ? &k->vexec[b->job.vk - 1][gi] : &k->gexec[gi];
        if ((rc = cuda_graph_run(k, ge, enqueue_bucket, NULL, err, errlen))) return rc;
    } else {
        if ((rc = enqueue(k, Tp, R, b->job.n_items, b->job.decode, err, errlen))) return rc;
    }
    if (R > 0) {
        for (int r = 0; r < R; r++)
            if (b->row_host[r])
                CK(cudaMemcpyAsync(b->hlog + (size_t)r * V + k->v0, k->logits + (size_t)r * k->vn,
                                   (size_t)k->vn * 4, cudaMemcpyDeviceToHost, k->st));
        /* after the raw rows are copied: the sampler penalizes in place */
        if (b->job.n_samp) {
            CK(cuda_sample(k->logits, R, V, DIN(k, srows, struct cuda_sample_row),
                           b->job.n_pen ? DIN(k, pen, struct cuda_sample_pen) : NULL, k->sout, k->st));
        }
    }
    /* method mtp: the MTP layer's pass (every rank its share), after the rows the host reads are copied */
    if (k->mtpx && (rc = cuda_mtp_rank_pass(k, err, errlen))) return rc;
    return cuda_rank_wait(k, err, errlen);
fail:
    return SL_EDEVICE;
}

/* model_sample_verify for a greedy sequence from the device's argmax and
 * logprob of its rows r .. r + n_draft (the same tokens and logprobs
 * model_sample picks from those rows): each row's token is emitted; the walk
 * stops after the first that is not the next draft, or after a row that could
 * not be sampled (token -1). */
static void verify_greedy(const struct cuda_backend *b, struct step_seq *q, int r)
{
    q->n_spec_out = 0;
    for (int i = 0; i <= q->n_draft; i++) {
        struct model_sample_out *o = &q->spec_out[i];
        o->token = b->hout_tok[r + i];
        o->logprob = b->hout_lp[r + i];
        o->n_top = 0;
        q->n_spec_out = i + 1;
        if (o->token < 0 || i == q->n_draft || o->token != q->history[q->n_history + i]) break;
    }
}

/* A step every sequence of which verifies the same K drafts (query: its
 * last token and the K drafts, so every query token is a logit row, in
 * order): K, which a graph per batch bucket can run (Tp = bucket (K + 1)
 * tokens: short steps, whose attention takes splits and no long-key
 * partials); else 0. Not with recurrent layers (their state snapshots and
 * rollback are per step) nor hyper-connections. */
static int verify_k(const struct cuda_backend *b, const struct step *s)
{
    if (b->state_bytes || b->r[0].hcx || s->n_seqs <= 0) return 0;
    int K = s->seqs[0].n_draft;
    if (K < 1 || K > VGRAPH_K) return 0;
    for (int i = 0; i < s->n_seqs; i++) {
        const struct step_seq *q = &s->seqs[i];
        if (!q->want_sample || q->n_draft != K || q->query_len != K + 1 || q->prompt_out) return 0;
    }
    return K;
}

int cuda_forward(model_backend *mb, struct step *s, char *err, size_t errlen)
{
    struct cuda_backend *b = (struct cuda_backend *)mb;
    if (!s) {
        sl_seterr(err, errlen, "forward: no step");
        return SL_EINVAL;
    }
    if (b->base.fatal) {
        sl_seterr(err, errlen, "%s", b->base.fatal);
        return SL_EDEVICE;
    }
    if (b->mtp) cuda_mtp_forget(b);
    int rc = check_step(b, s, err, errlen);
    if (rc) return rc;
    int V = b->c.n_vocab;
    bool decode = s->n_tokens == s->n_seqs;
    int gi = -1, vk = decode ? 0 : verify_k(b, s);
    if ((decode || vk) && b->graphs)
        for (int i = 0; i < b->n_bucket; i++) {
            int tp = b->bucket[i] * (1 + vk);
            if (b->bucket[i] >= s->n_seqs && tp <= b->max_tokens && (!vk || (tp <= b->max_rows && tp <= 256))) {
                gi = i;
                break;
            }
        }
    int Tp = gi >= 0 ? b->bucket[gi] * (1 + vk) : s->n_tokens, R = 0;
    b->lay = cuda_step_lay(b, gi, Tp);
    size_t nbytes = pack_step(b, s, Tp, &R);
    if (!nbytes) {
        sl_seterr(err, errlen, "forward: step exceeds the backend's buffers");
        return SL_EINVAL;
    }
    /* MLA's expanded form for prompt positions (cuda/mla.h): prefill steps, in the full layout */
    b->xplan_on = gi < 0 && !decode && cuda_mla_step_plan(b, s);
    b->job.Tp = Tp, b->job.R = R, b->job.gi = gi, b->job.vk = gi >= 0 ? vk : 0, b->job.decode = decode;
    b->job.nbytes = nbytes;
    b->job.n_items = *HIN(b, n_items, int32_t);
    if (b->mtp && (rc = cuda_mtp_pack(b, s, err, errlen))) return rc;
    if ((rc = cuda_crew_run(b, JOB_FORWARD, err, errlen))) {
        /* a GPU that failed mid-step leaves its stream, its KV and (with N > 1)
         * its communicators unusable: no later step can run */
        snprintf(b->dead, sizeof b->dead, "the GPU backend stopped: %s", err);
        b->base.fatal = b->dead;
        return SL_EDEVICE;
    }
    int nh = 0; /* rows model_sample picks: after this loop, in parallel */
    for (int r = 0; r < R; r++) {
        struct step_seq *q = &s->seqs[b->row_seq[r]];
        float *lg = b->hlog + (size_t)r * V;
        if (q->want_sample && q->n_draft > 0) {
            if (q->logits_out) memcpy(q->logits_out, lg, (size_t)V * 4); /* the first verified position's */
            if (b->row_mode[r] == ROW_GREEDY) verify_greedy(b, q, r);
            else b->host_rows[nh++] = r; /* model_sample_verify, below */
            r += q->n_draft;
            continue;
        }
        if (q->logits_out) memcpy(q->logits_out, lg, (size_t)V * 4);
        if (!q->want_sample) continue;
        if (b->row_mode[r] == ROW_GREEDY) {
            q->out.token = b->hout_tok[r]; /* -1: this row's logits are not finite (backend.h) */
            q->out.logprob = b->hout_lp[r];
            q->out.n_top = 0;
            continue;
        }
        if (b->row_mode[r] == ROW_SAMPLE) {
            const struct cuda_sample_out *o = &b->hsout[r];
            if (o->status == 0) {
                q->out.token = o->token;
                q->out.logprob = o->logprob;
                q->out.n_top = o->n_top;
                memcpy(q->out.top_ids, o->top_ids, sizeof q->out.top_ids);
                memcpy(q->out.top_logprobs, o->top_logprobs, sizeof q->out.top_logprobs);
                continue;
            }
            if (o->status < 0) {
                q->out.token = -1, q->out.n_top = 0;
                continue;
            }
            /* more candidates than the device sorts: the host finishes from the
             * penalized row, with the RNG as it was before the draw */
            struct rank *k0 = &b->r[0];
            if (cudaMemcpy(lg, k0->logits + (size_t)r * k0->vn, (size_t)V * 4, cudaMemcpyDeviceToHost) !=
                cudaSuccess) {
                sl_seterr(err, errlen, "forward: copying a logit row back failed");
                return SL_EDEVICE;
            }
            if (q->rng) *q->rng = b->rng_before[r];
        }
        b->host_rows[nh++] = r;
    }
    /* sequences sample independently (each its own RNG): in parallel, as the
     * CPU backend does (JSON-mode rows are masked here) */
#pragma omp parallel for schedule(dynamic, 1) num_threads(b->nt) if (nh > 1)
    for (int i = 0; i < nh; i++) {
        int r = b->host_rows[i];
        struct step_seq *q = &s->seqs[b->row_seq[r]];
        void *scr = (char *)b->samp + (size_t)omp_get_thread_num() * b->samp_bytes;
        int rc;
        if (q->n_draft > 0) { /* rows r .. r + n_draft, sampled in order */
            model_sample_verify(b->hlog + (size_t)r * V, q->n_draft, V, q->sampling, q->history, q->n_prompt,
                                q->n_history, q->rng, scr, q->spec_out, &q->n_spec_out);
            continue;
        }
        if (b->row_mode[r] == ROW_SAMPLE) { /* the device applied the penalties */
            struct model_sampling p = *q->sampling;
            p.repetition_penalty = 1.0f, p.presence_penalty = 0.0f, p.frequency_penalty = 0.0f;
            rc = model_sample(b->hlog + (size_t)r * V, V, &p, NULL, 0, 0, q->rng, scr, &q->out);
        } else {
            rc = model_sample(b->hlog + (size_t)r * V, V, q->sampling, q->history, q->n_prompt, q->n_history, q->rng,
                              scr, &q->out);
        }
        if (rc != 0) q->out.token = -1, q->out.n_top = 0;
    }
    /* KDA layers: each verified sequence's slot advanced over its accepted drafts (cuda/kda.h) */
    if (b->state_bytes && b->max_draft && (rc = cuda_kda_rollback(b, s, err, errlen))) {
        snprintf(b->dead, sizeof b->dead, "the GPU backend stopped: %s", err);
        b->base.fatal = b->dead;
        return SL_EDEVICE;
    }
    /* the MTP layer's pass ran with the step (cuda/mtp.c): its tags */
    if (b->mtp) cuda_mtp_after_step(b, s);
    return 0;
}

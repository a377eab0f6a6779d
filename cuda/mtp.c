/* mtp.c - the MTP layer on the GPU backend: the creation check, its own
 * parts' upload, the per-block hidden states, the sub-step after each
 * forward() and ops->mtp_draft (mtp.h says what and why; model/cpu_backend.c's
 * MTP section is the reference, step by step).
 *
 * First version: the sub-step and the drafts run eagerly on the caller's
 * thread once the step is done (outside the decode CUDA graphs), each ending
 * with a stream synchronization, on one GPU. A sub-step holds at most the
 * step's tokens (a sequence's entries are a + 1 .. z, and a only in place of
 * none), so the rank's max_tokens scratch holds it. */
#include <cuda_runtime.h>
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "cuda/cuda_internal.h"
#include "cuda/hc.h"
#include "cuda/mla.h"
#include "cuda/moe.h"
#include "cuda/mtp.h"

#define HIN(b, f, type) ((type *)((b)->hin + (b)->lay.f))
#define DIN(k, f, type) ((type *)((k)->din + (k)->b->lay.f))

/* ---- creation ------------------------------------------------------------------ */

int cuda_mtp_check(const struct model_config *c, int N, char *err, size_t errlen)
{
    if (c->n_mtp_layer != 1) {
        sl_seterr(err, errlen, "speculative method mtp: %d MTP layers; the cuda backend runs one", c->n_mtp_layer);
        return SL_EUNSUP;
    }
    if (N > 1) {
        sl_seterr(err, errlen, "speculative method mtp: the cuda backend runs the MTP layer on one GPU only "
                  "(--tensor-parallel-size %d); use method ngram, or one GPU", N);
        return SL_EUNSUP;
    }
    if (c->mla.index_topk > 0) {
        sl_seterr(err, errlen, "speculative method mtp: the MTP layer of a model with the DSA indexer on is not "
                  "implemented (index_topk null turns the indexer off)");
        return SL_EUNSUP;
    }
    if (c->hc.mult > 0) {
        sl_seterr(err, errlen, "speculative method mtp: the cuda backend does not run the MTP layer of a model "
                  "with hyper-connections yet");
        return SL_EUNSUP;
    }
    struct model_layer_kind k = model_layer_kind_of(c, c->n_layer);
    if ((k.mixer != MODEL_MIXER_GQA && k.mixer != MODEL_MIXER_MLA) || k.resid != MODEL_RESID_PLAIN ||
        (k.ffn != MODEL_FFN_DENSE && k.ffn != MODEL_FFN_MOE)) {
        sl_seterr(err, errlen, "speculative method mtp: the MTP layer is %s + %s; the cuda backend runs gqa or mla + "
                  "dense or moe there", model_mixer_name(k.mixer), model_ffn_name(k.ffn));
        return SL_EUNSUP;
    }
    if (k.mixer == MODEL_MIXER_GQA && (c->head_dim % 8 || c->head_dim > 256 || c->n_head % c->n_head_kv)) {
        sl_seterr(err, errlen, "speculative method mtp: the MTP layer's attention (head_dim %d, %d heads over %d KV "
                  "heads) is not one the cuda backend runs there (head_dim a multiple of 8, <= 256; heads a multiple "
                  "of the KV heads)", c->head_dim, c->n_head, c->n_head_kv);
        return SL_EUNSUP;
    }
    if (k.ffn == MODEL_FFN_MOE) return cuda_moe_check(c, N, c->n_layer, err, errlen);
    return 0;
}

int cuda_mtp_upload(struct rank *k, uint16_t *stage, float *tmp, char *err, size_t errlen)
{
    const struct cuda_backend *b = k->b;
    const struct model_config *c = &b->c;
    const struct model_mtp_weights *mw = &b->w->mtp[0];
    size_t E = c->n_embd, T = b->max_tokens, S = b->max_seqs, cap = T + S;
    struct cuda_mtp_rank *x = calloc(1, sizeof *x);
    if (!x) {
        sl_seterr(err, errlen, "out of host memory");
        return SL_ENOMEM;
    }
    k->mtpx = x;
    int rc;
    if ((rc = cuda_upload_vec(&mw->enorm, 0, E, NULL, &x->enorm, err, errlen)) ||
        (rc = cuda_upload_vec(&mw->hnorm, 0, E, NULL, &x->hnorm, err, errlen)) ||
        (rc = cuda_upload_vec(&mw->head_norm, 0, E, NULL, &x->head_norm, err, errlen)))
        return rc;
    const struct model_tensor *t[1] = {&mw->eh_proj};
    int64_t r0[1] = {0}, nr[1] = {(int64_t)E};
    if ((rc = cuda_upload_proj(k, t, r0, nr, 1, (int64_t)(2 * E), 0, (int64_t)(2 * E), &x->eh, &x->qeh, stage, tmp,
                               err, errlen)))
        return rc;
    if ((rc = cuda_dmalloc((void **)&x->in, T * 2 * E * 2, err, errlen)) ||
        (rc = cuda_dmalloc((void **)&x->hk, cap * E * 2, err, errlen)) ||
        (rc = cuda_dmalloc((void **)&x->didx, (T + 2 * cap) * 4, err, errlen)))
        return rc;
    return 0;
}

void cuda_mtp_free(struct rank *k)
{
    struct cuda_mtp_rank *x = k->mtpx;
    if (!x) return;
    /* a packed eh_proj's parts live in k->qmem */
    cudaFree(x->enorm), cudaFree(x->hnorm), cudaFree(x->head_norm), cudaFree(x->eh);
    cudaFree(x->in), cudaFree(x->hk), cudaFree(x->didx);
    free(x);
    k->mtpx = NULL;
}

int cuda_mtp_create(struct cuda_backend *b, char *err, size_t errlen)
{
    struct cuda_mtp *m = calloc(1, sizeof *m);
    if (!m) {
        sl_seterr(err, errlen, "out of host memory");
        return SL_ENOMEM;
    }
    b->mtp = m;
    size_t T = b->max_tokens, S = b->max_seqs, cap = T + S;
    m->cap = (int)cap;
    m->last_n = -1;
    m->last_q0 = calloc(S, sizeof(int)), m->last_pos0 = calloc(S, sizeof(int)), m->last_len = calloc(S, sizeof(int));
    m->sub_tok = calloc(cap, 4), m->sub_pos = calloc(cap, 4), m->sub_src = calloc(cap, 4), m->sub_seq = calloc(cap, 4);
    m->sub_slot = calloc(cap, 8);
    m->sub_bt = calloc(cap, sizeof *m->sub_bt), m->sub_nb = calloc(cap, sizeof(int));
    m->keep_dst = calloc(cap, 4), m->keep_src = calloc(cap, 4), m->keep_pos = calloc(cap, sizeof(int));
    m->req_t = calloc(S, sizeof(int)), m->row_req = calloc(S, sizeof(int));
    if (!m->last_q0 || !m->last_pos0 || !m->last_len || !m->sub_tok || !m->sub_pos || !m->sub_src || !m->sub_seq ||
        !m->sub_slot || !m->sub_bt || !m->sub_nb || !m->keep_dst || !m->keep_src || !m->keep_pos || !m->req_t || !m->row_req) {
        sl_seterr(err, errlen, "out of host memory for the MTP scratch");
        return SL_ENOMEM;
    }
    cudaError_t e = cudaHostAlloc((void **)&m->hidx, (T + 2 * cap) * 4, cudaHostAllocPortable);
    if (e != cudaSuccess) {
        m->hidx = NULL;
        sl_seterr(err, errlen, "MTP step buffer: %s", cudaGetErrorString(e));
        return SL_ENOMEM;
    }
    return 0;
}

void cuda_mtp_destroy(struct cuda_backend *b)
{
    struct cuda_mtp *m = b->mtp;
    if (!m) return;
    free(m->htag), free(m->stamp);
    free(m->last_q0), free(m->last_pos0), free(m->last_len);
    free(m->sub_tok), free(m->sub_pos), free(m->sub_src), free(m->sub_seq), free(m->sub_slot);
    free(m->sub_bt), free(m->sub_nb), free(m->keep_dst), free(m->keep_src), free(m->keep_pos), free(m->req_t), free(m->row_req);
    if (m->hidx) cudaFreeHost(m->hidx);
    free(m);
    b->mtp = NULL;
}

int cuda_mtp_kv_alloc(struct cuda_backend *b, int n_blocks, char *err, size_t errlen)
{
    struct cuda_mtp *m = b->mtp;
    const struct rank *k = &b->r[0];
    free(m->htag), free(m->stamp);
    m->htag = malloc((size_t)n_blocks * sizeof *m->htag);
    m->stamp = calloc((size_t)n_blocks, sizeof *m->stamp);
    m->kv_blocks = 0;
    m->last_n = -1;
    if (!m->htag || !m->stamp) {
        sl_seterr(err, errlen, "kv_alloc: out of host memory for the MTP tags");
        return SL_ENOMEM;
    }
    for (int i = 0; i < n_blocks; i++) m->htag[i] = -1;
    m->gen = 0;
    m->hblk = (uint16_t *)((char *)k->kv + k->kv_off[model_n_layer_all(&b->c)]);
    m->kv_blocks = n_blocks;
    return 0;
}

void cuda_mtp_forget(struct cuda_backend *b) { b->mtp->last_n = -1; }

/* ---- the layer --------------------------------------------------------------------- */

static inline int64_t slot_of(const int32_t *bt, int pos, int bs)
{
    return (int64_t)bt[pos / bs] * bs + pos % bs;
}

/* The sub-step's n tokens (sub_*) into the step buffers: ids, positions,
 * slots and block tables where the layers read them (the full layout, din),
 * the hidden-state rows into didx; copies both on the stream. */
static int load_sub(struct cuda_backend *b, struct rank *k, int n, char *err, size_t errlen)
{
    struct cuda_mtp *m = b->mtp;
    b->lay = b->lay_full;
    int64_t *slots = HIN(b, slots, int64_t);
    int32_t *ids = HIN(b, ids, int32_t), *pos = HIN(b, pos, int32_t), *tbt = HIN(b, tok_bt, int32_t),
            *bt = HIN(b, bt, int32_t);
    int nbt = 0, last = -1, off = 0;
    for (int j = 0; j < n; j++) {
        int si = m->sub_seq[j];
        if (si != last) {
            SL_ASSERT(nbt + m->sub_nb[si] <= b->bt_cap);
            memcpy(bt + nbt, m->sub_bt[si], (size_t)m->sub_nb[si] * 4);
            off = nbt, nbt += m->sub_nb[si], last = si;
        }
        ids[j] = m->sub_tok[j], pos[j] = m->sub_pos[j], slots[j] = m->sub_slot[j], tbt[j] = off;
        m->hidx[j] = m->sub_src[j];
    }
    CK(cudaMemcpyAsync(k->din, b->hin, b->lay.bt + (size_t)nbt * 4, cudaMemcpyHostToDevice, k->st));
    CK(cudaMemcpyAsync(k->mtpx->didx, m->hidx, (size_t)n * 4, cudaMemcpyHostToDevice, k->st));
    return 0;
fail:
    return SL_EDEVICE;
}

/* The MTP layer over the loaded sub-step of n tokens: x = eh_proj([enorm(embed)
 * | hnorm(h)]), its mixer (each token's entry written before any attends,
 * position 0 left out), and with ffn its FFN; k->x then holds the residual
 * before the last block's output, k->delta that output (the FFN's with ffn). */
static int run_layer(struct cuda_backend *b, struct rank *k, int n, bool ffn, char *err, size_t errlen)
{
    const struct model_config *c = &b->c;
    struct cuda_mtp_rank *x = k->mtpx;
    int E = c->n_embd, l = c->n_layer, H = k->H, KVH = k->KVH, D = c->head_dim, Q = H * D, QKV = Q + 2 * KVH * D;
    float eps = c->norm_eps;
    const struct clayer *L = &k->L[l];
    const struct model_layer_kind lk = model_layer_kind_of(c, l);
    cudaStream_t st = k->st;
    CK(cuda_embed(k->tok_embd, DIN(k, ids, int32_t), n, E, k->x, st));
    CK(cuda_mtp_in(k->x, x->hk, b->mtp->hblk, x->didx, x->enorm, x->hnorm, n, E, eps, x->in, st));
    CB(cuda_proj(k, &x->qeh, x->eh, x->in, k->x, true, n, 2 * E, E));
    CK(cuda_add_rmsnorm(k->x, NULL, L->attn_norm, NULL, n, E, eps, k->xn, st));
    if (lk.mixer == MODEL_MIXER_GQA) {
        CB(cuda_proj(k, &L->qqkv, L->wqkv, k->xn, k->qkv, false, n, E, QKV));
        size_t es = b->kv8 ? 1 : 2;
        char *kc = (char *)k->kv + k->kv_off[l], *vc = kc + k->kv_layer * es;
        struct cuda_rope_args ra = {
            .qkv = k->qkv, .bias = L->bqkv, .q_norm = L->q_norm, .k_norm = L->k_norm, .cos = k->rope_cos,
            .sin = k->rope_sin, .pos = DIN(k, pos, int32_t), .slots = DIN(k, slots, int64_t), .T = n, .H = H,
            .KVH = KVH, .D = D, .rope_dim = c->rope_dim, .neox = c->rope_type == MODEL_ROPE_NEOX, .eps = eps,
            .q = k->q, .kc = kc, .vc = vc, .kv8 = b->kv8,
        };
        CK(cuda_rope_kv(&ra, st));
        struct cuda_mtp_attn_args aa = {
            .q = k->q, .kc = kc, .vc = vc, .pos = DIN(k, pos, int32_t), .tok_bt = DIN(k, tok_bt, int32_t),
            .bt = DIN(k, bt, int32_t), .out = k->att, .T = n, .H = H, .KVH = KVH, .D = D,
            .block_size = b->block_size, .key0 = 1, .scale = 1.0f / sqrtf((float)D), .kv8 = b->kv8,
        };
        CK(cuda_mtp_attention(&aa, st));
        if (cuda_proj_rows(k, k->att, &L->qo, L->wo, n, Q, E, 0, false, err, errlen)) return SL_EDEVICE;
    } else {
        k->mlax->key0 = 1;
        int rc = cuda_mla_mixer(k, l, n, false, err, errlen);
        k->mlax->key0 = 0;
        if (rc) return rc;
    }
    if (!ffn) return 0;
    CK(cuda_add_rmsnorm(k->x, k->delta, L->ffn_norm, NULL, n, E, eps, k->xn, st));
    if (lk.ffn == MODEL_FFN_MOE) return cuda_moe_ffn(k, l, n, false, err, errlen);
    int F = k->F;
    CB(cuda_proj(k, &L->qgu, L->wgu, k->xn, k->gu, false, n, E, 2 * F));
    if (c->moe.swiglu_limit > 0) CK(cuda_swiglu_limit(k->gu, n, F, c->moe.swiglu_limit, k->h, st));
    else CK(cuda_swiglu(k->gu, n, F, k->h, st));
    return cuda_proj_rows(k, k->h, &L->qdown, L->wdown, n, F, E, 1, false, err, errlen);
fail:
    return SL_EDEVICE;
}

/* Queues hidden state keep_src[i] (an hk row) into block keep_dst[i]'s hblk
 * row for i < nk, the later of two for one block winning (as the CPU's
 * sequential copies leave it), and sets the tags (keep_pos[i]). */
static int keep_rows(struct cuda_backend *b, struct rank *k, int nk, char *err, size_t errlen)
{
    struct cuda_mtp *m = b->mtp;
    if (nk <= 0) return 0;
    size_t T = b->max_tokens, cap = m->cap;
    int32_t *dst = m->hidx + T, *src = m->hidx + T + cap;
    int w = 0;
    if (++m->gen == 0) { /* the stamps wrapped: start them over */
        memset(m->stamp, 0, (size_t)m->kv_blocks * sizeof *m->stamp);
        m->gen = 1;
    }
    for (int i = nk - 1; i >= 0; i--) {
        int blk = m->keep_dst[i];
        if (m->stamp[blk] == m->gen) continue;
        m->stamp[blk] = m->gen;
        m->htag[blk] = m->keep_pos[i];
        dst[w] = blk, src[w] = m->keep_src[i], w++;
    }
    int32_t *dd = k->mtpx->didx + T;
    CK(cudaMemcpyAsync(dd, dst, (size_t)w * 4, cudaMemcpyHostToDevice, k->st));
    CK(cudaMemcpyAsync(dd + cap, src, (size_t)w * 4, cudaMemcpyHostToDevice, k->st));
    CK(cuda_mtp_rows(m->hblk, dd, k->mtpx->hk, dd + cap, w, b->c.n_embd, k->st));
    return 0;
fail:
    return SL_EDEVICE;
}

/* A CUDA failure here leaves the stream and the KV unusable, as one in a step does. */
static int stop(struct cuda_backend *b, const char *err)
{
    snprintf(b->dead, sizeof b->dead, "the GPU backend stopped: %s", err);
    b->base.fatal = b->dead;
    return SL_EDEVICE;
}

/* ---- after a step -------------------------------------------------------------- */

int cuda_mtp_after_step(struct cuda_backend *b, const struct step *s, char *err, size_t errlen)
{
    /* the warm-up's steps keep nothing: their blocks are not handed out yet */
    if (b->warming) return 0;
    struct cuda_mtp *m = b->mtp;
    struct rank *k = &b->r[0];
    struct cuda_mtp_rank *x = k->mtpx;
    const struct model_config *c = &b->c;
    int T = s->n_tokens, E = c->n_embd, bs = b->block_size;
    CK(cudaSetDevice(k->dev));
    /* the final-normed hidden states: the residual plus the last block's
     * output, which the head adds for its rows only (the fused one-token path
     * is off with MTP, and creation refuses hyper-connections) */
    CK(cuda_add_rmsnorm(k->x, k->delta, k->out_norm, NULL, T, E, c->norm_eps, x->hk, k->st));
    int n = 0, ns = 0, nk = 0;
    for (int si = 0; si < s->n_seqs; si++) {
        const struct step_seq *q = &s->seqs[si];
        int q0 = q->query_start, len = q->query_len, a = q->context_len - len, z = q->context_len - 1;
        const int32_t *bt = q->block_table;
        m->last_q0[si] = q0, m->last_pos0[si] = a, m->last_len[si] = len;
        if (len <= 0) continue;
        int start = n;
#define ADD(tok, p, src)                                                                                    \
    do {                                                                                                    \
        m->sub_tok[n] = (tok), m->sub_pos[n] = (p), m->sub_slot[n] = slot_of(bt, (p), bs), m->sub_src[n] = (src); \
        m->sub_seq[n] = ns;                                                                                 \
        n++;                                                                                                \
    } while (0)
        /* a's entry from a - 1's hidden state, still in its block: read before this step's keeps replace it */
        if (a > 0 && m->htag[bt[(a - 1) / bs]] == a - 1) ADD(s->token_ids[q0], a, -bt[(a - 1) / bs] - 1);
        for (int p = a + 1; p <= z; p++) ADD(s->token_ids[q0 + p - a], p, q0 + p - a - 1);
#undef ADD
        if (n == start) continue;
        m->sub_bt[ns] = bt, m->sub_nb[ns] = (z + bs) / bs;
        ns++;
    }
    SL_ASSERT(n <= b->max_tokens);
    /* keeps: each block's end and each sequence's last position */
    for (int si = 0; si < s->n_seqs; si++) {
        const struct step_seq *q = &s->seqs[si];
        int q0 = q->query_start, len = q->query_len, a = q->context_len - len;
        for (int i = 0; i < len; i++)
            if ((a + i + 1) % bs == 0 || i == len - 1) {
                m->keep_dst[nk] = q->block_table[(a + i) / bs], m->keep_src[nk] = q0 + i;
                m->keep_pos[nk++] = a + i;
            }
    }
    SL_ASSERT(nk <= b->max_tokens);
    if (n > 0 && (load_sub(b, k, n, err, errlen) || run_layer(b, k, n, false, err, errlen))) return stop(b, err);
    if (keep_rows(b, k, nk, err, errlen)) return stop(b, err);
    if (cuda_rank_wait(k, err, errlen)) return stop(b, err);
    m->last_n = s->n_seqs;
    return 0;
fail:
    return stop(b, err);
}

/* ---- drafts -------------------------------------------------------------------- */

int cuda_mtp_draft(model_backend *mb, struct model_mtp_req *r, int n, char *err, size_t errlen)
{
    struct cuda_backend *b = (struct cuda_backend *)mb;
    const struct model_config *c = &b->c;
    struct cuda_mtp *m = b->mtp;
    int E = c->n_embd, V = c->n_vocab, bs = b->block_size, kmax = 0;
    if (!b->base.has_mtp || !m) {
        sl_seterr(err, errlen, "mtp_draft: the backend was created without MTP (opts.mtp)");
        return SL_EUNSUP;
    }
    if (b->base.fatal) {
        sl_seterr(err, errlen, "%s", b->base.fatal);
        return SL_EDEVICE;
    }
    struct model_step_limits lim = {.n_vocab = V, .max_seqs = b->max_seqs, .max_ctx = b->max_ctx,
                                    .block_size = bs, .kv_blocks = b->kv_blocks};
    if (model_mtp_check(r, n, &lim, m->last_n, m->last_pos0, m->last_len, &kmax, err, errlen)) return SL_EINVAL;
    if (n == 0) return 0;
    struct rank *k = &b->r[0];
    struct cuda_mtp_rank *x = k->mtpx;
    int T = b->max_tokens;
    uint16_t *g = x->hk + (size_t)T * E; /* [max_seqs][E]: the chained hidden states, row t of the last iteration */
    CK(cudaSetDevice(k->dev));
    /* p's hidden state stays in its block: a forward() from p + 1 writes p + 1's entry itself */
    for (int j = 0; j < n; j++) {
        m->keep_dst[j] = r[j].block_table[r[j].pos / bs];
        m->keep_src[j] = m->last_q0[r[j].seq] + r[j].pos - m->last_pos0[r[j].seq];
        m->keep_pos[j] = r[j].pos;
    }
    if (keep_rows(b, k, n, err, errlen)) return stop(b, err);
    for (int it = 0; it < kmax; it++) {
        int ns = 0;
        for (int j = 0; j < n; j++) {
            const struct model_mtp_req *q = &r[j];
            if (it >= (q->k > 1 ? q->k : 1)) continue;
            int p = q->pos + 1 + it;
            m->sub_tok[ns] = it == 0 ? q->token : q->drafts[it - 1];
            m->sub_pos[ns] = p;
            m->sub_slot[ns] = slot_of(q->block_table, p, bs);
            m->sub_src[ns] = it == 0 ? m->last_q0[q->seq] + q->pos - m->last_pos0[q->seq] : T + m->req_t[j];
            m->sub_seq[ns] = ns;
            m->sub_bt[ns] = q->block_table, m->sub_nb[ns] = p / bs + 1;
            m->req_t[j] = ns;
            m->row_req[ns] = j;
            ns++;
        }
        if (load_sub(b, k, ns, err, errlen) || run_layer(b, k, ns, true, err, errlen)) return stop(b, err);
        /* the head: g = head_norm(x + the FFN's output), each request's next hidden state (the layer has read
         * the last one), then the shared LM head's greedy token (ties to the lower id) */
        CK(cuda_add_rmsnorm(k->x, k->delta, x->head_norm, NULL, ns, E, c->norm_eps, g, k->st));
        CB(cuda_proj(k, &k->qhead, k->lm_head, g, k->logits, true, ns, E, V));
        CK(cuda_argmax_lse(k->logits, ns, V, k->amp, k->tok, k->lp, k->st));
        if (cuda_rank_wait(k, err, errlen)) return stop(b, err);
        for (int t = 0; t < ns; t++) {
            struct model_mtp_req *q = &r[m->row_req[t]];
            if (it >= q->k) continue;
            int32_t tok = b->hout_tok[t];
            q->drafts[it] = tok >= 0 && tok < V ? tok : 0; /* -1: logits not finite; any token verifies alike */
            if (q->logits)
                CK(cudaMemcpy(q->logits + (size_t)it * V, k->logits + (size_t)t * V, (size_t)V * 4,
                              cudaMemcpyDeviceToHost));
        }
    }
    return 0;
fail:
    return stop(b, err);
}

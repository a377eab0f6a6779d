/* mtp.c - the MTP layer on the GPU backend: the creation check, its own
 * parts' upload, the per-block hidden states, the sub-step after each
 * forward() and ops->mtp_draft (mtp.h says what and why; model/cpu_backend.c's
 * MTP section is the reference, step by step).
 *
 * After each step its pass (cuda_mtp_pack on the host, cuda_mtp_rank_pass
 * on the rank's stream) writes the step's MTP entries and drafts for the
 * sequences whose tokens the device picks, with no host round trip in
 * between, as a graph per bucket; ops->mtp_draft hands those drafts out and
 * runs the eager path (a wait per draft) for any other request. A sub-step
 * holds at most the step's tokens (a sequence's entries are a + 1 .. z, and
 * a only in place of none), so the rank's max_tokens scratch holds it. */
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
#define DIN(k, f, type) ((type *)((k)->din + (k)->lay.f))

/* Drafts the device makes a sequence after a step (cuda_mtp.K). */
static int mtp_k(const struct cuda_backend *b) { return b->max_draft < CUDA_MTP_MAXD ? b->max_draft : CUDA_MTP_MAXD; }

/* ---- creation ------------------------------------------------------------------ */

int cuda_mtp_check(const struct model_config *c, int N, char *err, size_t errlen)
{
    if (c->n_mtp_layer != 1) {
        sl_seterr(err, errlen, "speculative method mtp: %d MTP layers; the cuda backend runs one", c->n_mtp_layer);
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
        (rc = cuda_dmalloc((void **)&x->didx, (T + 2 * cap) * 4, err, errlen)) ||
        (rc = cuda_dmalloc((void **)&x->dlp, S * 4, err, errlen)))
        return rc;
    /* rank 0's results are the backend's mapped buffer (cuda_mtp_create) */
    if (k->id > 0 && (rc = cuda_dmalloc((void **)&x->res, ((size_t)mtp_k(b) + 3) * S * 4, err, errlen))) return rc;
    return 0;
}

/* The pass graphs hold mdin's and the KV's addresses: dropped when either moves. */
static void drop_pass_graphs(struct cuda_mtp_rank *x)
{
    for (int i = 0; i < CUDA_MTP_GT; i++)
        for (int j = 0; j < CUDA_MTP_GS; j++)
            if (x->gx[i][j]) {
                cudaGraphExecDestroy(x->gx[i][j]);
                x->gx[i][j] = NULL;
            }
}

void cuda_mtp_free(struct rank *k)
{
    struct cuda_mtp_rank *x = k->mtpx;
    if (!x) return;
    /* a packed eh_proj's parts live in k->qmem */
    cudaFree(x->enorm), cudaFree(x->hnorm), cudaFree(x->head_norm), cudaFree(x->eh);
    drop_pass_graphs(x);
    cudaFree(x->in), cudaFree(x->hk), cudaFree(x->didx), cudaFree(x->mdin), cudaFree(x->dlp);
    if (k->id > 0) cudaFree(x->res);
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
    m->dev_j = calloc(S, sizeof(int)), m->dev_seq = calloc(S, sizeof(int)), m->ereq = calloc(S, sizeof *m->ereq);
    m->K = mtp_k(b);
    if (!m->last_q0 || !m->last_pos0 || !m->last_len || !m->sub_tok || !m->sub_pos || !m->sub_src || !m->sub_seq ||
        !m->sub_slot || !m->sub_bt || !m->sub_nb || !m->keep_dst || !m->keep_src || !m->keep_pos || !m->req_t ||
        !m->row_req || !m->dev_j || !m->dev_seq || !m->ereq) {
        sl_seterr(err, errlen, "out of host memory for the MTP scratch");
        return SL_ENOMEM;
    }
    cudaError_t e = cudaHostAlloc((void **)&m->hidx, (T + 2 * cap) * 4, cudaHostAllocPortable);
    if (e != cudaSuccess) {
        m->hidx = NULL;
        sl_seterr(err, errlen, "MTP step buffer: %s", cudaGetErrorString(e));
        return SL_ENOMEM;
    }
    /* the pass's results, written by its kernels into host memory (as the step's tokens are) */
    e = cudaHostAlloc((void **)&m->hres, ((size_t)m->K + 3) * S * 4, cudaHostAllocMapped | cudaHostAllocPortable);
    if (e != cudaSuccess) m->hres = NULL;
    else e = cudaHostGetDevicePointer((void **)&m->dres, m->hres, 0);
    if (e != cudaSuccess) {
        sl_seterr(err, errlen, "MTP draft buffer: %s", cudaGetErrorString(e));
        return SL_ENOMEM;
    }
    b->r[0].mtpx->res = m->dres;
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
    free(m->dev_j), free(m->dev_seq), free(m->ereq);
    if (m->hidx) cudaFreeHost(m->hidx);
    if (m->hres) cudaFreeHost(m->hres);
    if (m->mhin) cudaFreeHost(m->mhin);
    free(m);
    b->mtp = NULL;
}

static size_t al16(size_t o) { return (o + 15) & ~(size_t)15; }

/* The pass's layout for Tn sub-step rows and Sp draft rows (mtp.h). */
static struct cuda_mtp_lay pass_lay(const struct cuda_backend *b, int Tn, int Sp)
{
    struct cuda_mtp_lay y;
    size_t o = 0;
    y.ns = o, o = al16(o + 4);
    y.dseq = o, o = al16(o + (size_t)Sp * sizeof(struct cuda_mtp_dseq));
    y.kdst = o, o = al16(o + (size_t)Tn * 4);
    y.ksrc = o, o = al16(o + (size_t)Tn * 4);
    y.ddst = o, o = al16(o + (size_t)Sp * 4);
    y.dsrc = o, o = al16(o + (size_t)Sp * 4);
    y.r0 = o, o += CUDA_MTP_R_BYTES(Tn);
    y.rs = CUDA_MTP_R_BYTES(Sp);
    y.r1 = o, o += (size_t)b->mtp->K * y.rs;
    y.bt = o, o = al16(o + (size_t)b->bt_cap * 4);
    y.total = o;
    return y;
}

int cuda_mtp_kv_alloc(struct cuda_backend *b, int n_blocks, char *err, size_t errlen)
{
    struct cuda_mtp *m = b->mtp;
    /* the pass's buffers, for its largest layout (bt_cap is kv_alloc's) */
    size_t need = pass_lay(b, b->max_tokens, b->max_seqs).total;
    if (m->mhin) cudaFreeHost(m->mhin);
    m->mhin = NULL, m->mbytes = 0;
    for (int i = 0; i < b->tp; i++) {
        struct rank *k = &b->r[i];
        struct cuda_mtp_rank *x = k->mtpx;
        if (cudaSetDevice(k->dev) != cudaSuccess) {
            sl_seterr(err, errlen, "kv_alloc: cudaSetDevice failed");
            return SL_EDEVICE;
        }
        drop_pass_graphs(x);
        cudaFree(x->mdin);
        x->mdin = NULL;
        if (cuda_dmalloc((void **)&x->mdin, need, err, errlen)) return SL_ENOMEM;
        x->hblk = (uint16_t *)((char *)k->kv + k->kv_off[model_n_layer_all(&b->c)]);
    }
    cudaSetDevice(b->r[0].dev);
    cudaError_t e = cudaHostAlloc((void **)&m->mhin, need, cudaHostAllocPortable);
    if (e != cudaSuccess) {
        m->mhin = NULL;
        sl_seterr(err, errlen, "kv_alloc: MTP step buffer: %s", cudaGetErrorString(e));
        return SL_ENOMEM;
    }
    m->mbytes = need;
    free(m->htag), free(m->stamp);
    m->htag = malloc((size_t)n_blocks * sizeof *m->htag);
    m->stamp = calloc((size_t)n_blocks, sizeof *m->stamp);
    m->kv_blocks = 0;
    m->last_n = -1;
    m->run = false;
    if (!m->htag || !m->stamp) {
        sl_seterr(err, errlen, "kv_alloc: out of host memory for the MTP tags");
        return SL_ENOMEM;
    }
    for (int i = 0; i < n_blocks; i++) m->htag[i] = -1;
    m->gen = 0;
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
 * slots and block tables where the layers read them (the full layout), the
 * hidden-state rows into hidx; returns the bytes of hin to copy (each rank
 * copies them, load_rows). */
static size_t load_sub(struct cuda_backend *b, int n)
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
    return b->lay.bt + (size_t)nbt * 4;
}

/* Rank k's copies of load_sub's rows (nbytes of hin, n hidden rows) on its stream. */
static int load_rows(struct rank *k, int n, size_t nbytes, char *err, size_t errlen)
{
    struct cuda_backend *b = k->b;
    k->lay = b->lay_full;
    CK(cudaMemcpyAsync(k->din, b->hin, nbytes, cudaMemcpyHostToDevice, k->st));
    CK(cudaMemcpyAsync(k->mtpx->didx, b->mtp->hidx, (size_t)n * 4, cudaMemcpyHostToDevice, k->st));
    return 0;
fail:
    return SL_EDEVICE;
}

/* The MTP layer over n tokens (ids; src: cuda_mtp_in's hidden rows; their
 * positions, slots and block tables through k->din as k->lay places them):
 * x = eh_proj([enorm(embed) | hnorm(h)]), its mixer (each token's entry written before any attends,
 * position 0 left out), and with ffn its FFN; k->x then holds the residual
 * before the last block's output, k->delta that output (the FFN's with ffn). */
static int run_layer(struct cuda_backend *b, struct rank *k, int n, const int32_t *ids, const int32_t *src, bool ffn,
                     char *err, size_t errlen)
{
    const struct model_config *c = &b->c;
    struct cuda_mtp_rank *x = k->mtpx;
    int E = c->n_embd, l = c->n_layer, H = k->H, KVH = k->KVH, D = c->head_dim, Q = H * D, QKV = Q + 2 * KVH * D;
    float eps = c->norm_eps;
    const struct clayer *L = &k->L[l];
    const struct model_layer_kind lk = model_layer_kind_of(c, l);
    cudaStream_t st = k->st;
    if (cuda_embed_rows(k, ids, n, err, errlen)) return SL_EDEVICE;
    CK(cuda_mtp_in(k->x, x->hk, x->hblk, src, x->enorm, x->hnorm, n, E, eps, x->in, st));
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
    if (lk.ffn == MODEL_FFN_MOE) return cuda_moe_ffn(k, l, n, false, NULL, err, errlen);
    int F = k->F;
    bool lim = c->moe.swiglu_limit > 0; /* glm5_next: gate|up in f32 (hc.h) */
    CB(cuda_proj(k, &L->qgu, L->wgu, k->xn, k->gu, lim, n, E, 2 * F));
    if (lim) CK(cuda_swiglu_limit((const float *)k->gu, n, F, c->moe.swiglu_limit, k->h, st));
    else CK(cuda_swiglu(k->gu, n, F, k->h, st));
    return cuda_proj_rows(k, k->h, &L->qdown, L->wdown, n, F, E, 1, false, err, errlen);
fail:
    return SL_EDEVICE;
}

/* The keeps keep_dst/keep_src[0..nk) as (block, hk row) pairs into dst/src,
 * the later of two for one block winning (as the CPU's sequential copies
 * leave it), each kept block's tag set (keep_pos[i]); returns how many. */
static int dedup_keeps(struct cuda_mtp *m, int nk, int32_t *dst, int32_t *src)
{
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
    return w;
}

/* The keeps keep_dst/keep_src[0..nk) into hidx, deduplicated and tagged by
 * dedup_keeps; returns how many (keep_rows queues them). */
static int keep_host(struct cuda_backend *b, int nk)
{
    struct cuda_mtp *m = b->mtp;
    if (nk <= 0) return 0;
    size_t T = b->max_tokens, cap = m->cap;
    return dedup_keeps(m, nk, m->hidx + T, m->hidx + T + cap);
}

/* Queues keep_host's w hidden states (hk rows) into their blocks' hblk rows on k's stream. */
static int keep_rows(struct rank *k, int w, char *err, size_t errlen)
{
    struct cuda_backend *b = k->b;
    struct cuda_mtp *m = b->mtp;
    if (w <= 0) return 0;
    size_t T = b->max_tokens, cap = m->cap;
    int32_t *dd = k->mtpx->didx + T;
    CK(cudaMemcpyAsync(dd, m->hidx + T, (size_t)w * 4, cudaMemcpyHostToDevice, k->st));
    CK(cudaMemcpyAsync(dd + cap, m->hidx + T + cap, (size_t)w * 4, cudaMemcpyHostToDevice, k->st));
    CK(cuda_mtp_rows(k->mtpx->hblk, dd, k->mtpx->hk, dd + cap, w, b->c.n_embd, k->st));
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

/* ---- the pass after a step ---------------------------------------------------- */

/* The smallest power of two >= need (its log2 in *idx), at most cap. */
static int bucket_of(int need, int cap, int *idx)
{
    int i = 0;
    while ((1 << i) < need) i++;
    *idx = i;
    return (1 << i) < cap ? (1 << i) : cap;
}

/* The pass's shape for need sub-step rows (tokens or keeps) and ns drafted
 * sequences: its rows Tn and draft rows Sp, and the graph (*gt, *gs) that
 * runs it (false: none, eager; then Tn = need, Sp = ns). */
static bool graph_of(const struct cuda_backend *b, int need, int ns, int *Tn, int *Sp, int *gt, int *gs)
{
    *Tn = need, *Sp = ns, *gt = -1, *gs = -1;
    if (!b->graphs || need > 1 << (CUDA_MTP_GT - 1)) return false;
    int it, is = 0;
    int scap = b->max_seqs < b->max_tokens ? b->max_seqs : b->max_tokens; /* the layer's scratch rows */
    int tn = bucket_of(need, b->max_tokens, &it), sp = ns ? bucket_of(ns, scap, &is) : 0;
    if (ns) is++;
    if (is >= CUDA_MTP_GS) return false;
    *Tn = tn, *Sp = sp, *gt = it, *gs = is;
    return true;
}

/* The warm-up's step s: the pass graphs of the steps of its shape, those of
 * B = prev + 1 .. n_seqs sequences of len tokens each (prev: the batch bucket
 * below n_seqs; a decode or verify step whose sequences' positions before the
 * step have their hidden states kept, as serving's do, so len sub-step
 * tokens a sequence), drafted for when dr. */
static void warm_shapes(struct cuda_backend *b, const struct step *s, bool dr)
{
    struct cuda_mtp *m = b->mtp;
    m->n_warm = 0;
    if (!b->graphs || s->n_seqs <= 0) return;
    int len = s->seqs[0].query_len, prev = 0;
    for (int i = 0; i < b->n_bucket; i++)
        if (b->bucket[i] < s->n_seqs && b->bucket[i] > prev) prev = b->bucket[i];
    for (int B = prev + 1; B <= s->n_seqs; B++) {
        int Tn, Sp, gt, gs, i;
        if (!graph_of(b, B * len, dr ? B : 0, &Tn, &Sp, &gt, &gs)) continue;
        for (i = 0; i < m->n_warm && (m->warm[i][0] != gt || m->warm[i][1] != gs); i++) {}
        if (i < m->n_warm) continue;
        m->warm[i][0] = gt, m->warm[i][1] = gs, m->warm[i][2] = Tn, m->warm[i][3] = Sp;
        m->n_warm++;
    }
}

int cuda_mtp_pack(struct cuda_backend *b, const struct step *s, char *err, size_t errlen)
{
    struct cuda_mtp *m = b->mtp;
    m->run = false;
    int bs = b->block_size, K = m->K, n = 0, nk = 0, ns = 0, r = 0;
    /* drafts on the device: for sequences whose tokens it picks (greedy), and only
     * in steps without device-sampled rows (a row the device sampler leaves to
     * the host reads the step's logits after the pass, which the drafts' head
     * overwrites) */
    bool drafts = K > 0 && b->job.n_samp == 0;
    if (b->warming) {
        /* the warm-up's steps keep nothing (their blocks are not handed out yet): their passes capture graphs */
        const struct step_seq *q = &s->seqs[0];
        warm_shapes(b, s, drafts && q->want_sample && b->row_mode[0] == ROW_GREEDY && q->n_draft <= CUDA_MTP_MAXD);
        m->run = m->n_warm > 0;
        return 0;
    }
    /* counts first: the sub-step's tokens, the keeps, the drafted sequences */
    for (int si = 0; si < s->n_seqs; si++) {
        const struct step_seq *q = &s->seqs[si];
        int len = q->query_len, a = q->context_len - len, row0 = r;
        m->dev_j[si] = -1;
        m->last_q0[si] = q->query_start, m->last_pos0[si] = a, m->last_len[si] = len;
        if (q->want_sample && q->n_draft > 0) r += q->n_draft + 1; /* pack_step's rows, in its order */
        else if (q->want_sample || q->logits_out) r++;
        if (len <= 0) continue;
        n += len - 1 + (a > 0 && m->htag[q->block_table[(a - 1) / bs]] == a - 1);
        for (int i = 0; i < len; i++) nk += (a + i + 1) % bs == 0 || i == len - 1;
        if (drafts && q->want_sample && b->row_mode[row0] == ROW_GREEDY && q->n_draft <= CUDA_MTP_MAXD) {
            m->dev_j[si] = ns;
            m->dev_seq[ns++] = si;
        }
    }
    int Tn, Sp, gt, gs;
    graph_of(b, n > nk ? n : nk, ns, &Tn, &Sp, &gt, &gs);
    struct cuda_mtp_lay L = pass_lay(b, Tn, Sp);
    uint8_t *h = m->mhin, *r0 = h + L.r0;
    int64_t *slots = (int64_t *)r0, pad_slot = (int64_t)b->kv_blocks * bs;
    int32_t *ids = (int32_t *)(r0 + CUDA_MTP_R_IDS(Tn)), *pos = (int32_t *)(r0 + CUDA_MTP_R_POS(Tn)),
            *tbt = (int32_t *)(r0 + CUDA_MTP_R_TBT(Tn)), *src = (int32_t *)(r0 + CUDA_MTP_R_SRC(Tn)),
            *bt = (int32_t *)(h + L.bt), *kd = (int32_t *)(h + L.kdst), *ks = (int32_t *)(h + L.ksrc);
    struct cuda_mtp_dseq *dq = (struct cuda_mtp_dseq *)(h + L.dseq);
    *(int32_t *)(h + L.ns) = ns;
    int nbt = 0;
    n = 0, nk = 0, r = 0;
    for (int si = 0; si < s->n_seqs; si++) {
        const struct step_seq *q = &s->seqs[si];
        int q0 = q->query_start, len = q->query_len, a = q->context_len - len, z = q->context_len - 1, row0 = r;
        const int32_t *qbt = q->block_table;
        if (q->want_sample && q->n_draft > 0) r += q->n_draft + 1;
        else if (q->want_sample || q->logits_out) r++;
        if (len <= 0) continue;
        /* its blocks: the step's, and for a drafted sequence those up to position z + K that its table holds */
        int nb0 = (q->context_len + bs - 1) / bs, nb = nb0, j = m->dev_j[si];
        if (j >= 0) {
            int want = (z + K) / bs + 1;
            if (want > q->n_blocks) want = q->n_blocks;
            while (nb < want && qbt[nb] >= 0 && qbt[nb] < b->kv_blocks) nb++;
        }
        if (nbt + nb > b->bt_cap) nb = nb0;
        if (nbt + nb > b->bt_cap) {
            sl_seterr(err, errlen, "forward: the MTP layer's block tables exceed the backend's buffers");
            return SL_EINVAL;
        }
        memcpy(bt + nbt, qbt, (size_t)nb * 4);
        int off = nbt;
        nbt += nb;
#define ADD(tok, p, sr)                                                                                        \
    do {                                                                                                       \
        ids[n] = (tok), pos[n] = (p), slots[n] = slot_of(qbt, (p), bs), src[n] = (sr), tbt[n] = off;           \
        n++;                                                                                                   \
    } while (0)
        /* a's entry from a - 1's hidden state, still in its block: read before this step's keeps replace it */
        if (a > 0 && m->htag[qbt[(a - 1) / bs]] == a - 1) ADD(s->token_ids[q0], a, -qbt[(a - 1) / bs] - 1);
        for (int p = a + 1; p <= z; p++) ADD(s->token_ids[q0 + p - a], p, q0 + p - a - 1);
#undef ADD
        /* keeps: each block's end and the sequence's last position */
        for (int i = 0; i < len; i++)
            if ((a + i + 1) % bs == 0 || i == len - 1) {
                m->keep_dst[nk] = qbt[(a + i) / bs], m->keep_src[nk] = q0 + i;
                m->keep_pos[nk++] = a + i;
            }
        if (j >= 0) {
            int nd = q->n_draft > 0 ? q->n_draft : 0; /* rows row0 .. row0 + nd: positions z - nd .. z */
            dq[j] = (struct cuda_mtp_dseq){.row0 = row0, .nd = nd, .a = z - nd, .q0 = q0 + len - 1 - nd,
                                           .cover = nb * bs, .tbt = off};
            for (int i = 0; i < nd; i++) dq[j].vd[i] = q->history[q->n_history + i];
        }
    }
    SL_ASSERT(n <= Tn && nk <= Tn);
    m->nl = n;
    for (int t = n; t < Tn; t++) ids[t] = 0, pos[t] = 0, slots[t] = pad_slot, src[t] = 0, tbt[t] = 0;
    /* the keeps and their tags */
    int w = dedup_keeps(m, nk, kd, ks);
    m->nw = w;
    for (int t = w; t < Tn; t++) kd[t] = b->kv_blocks, ks[t] = 0; /* padding: hblk's spare row */
    m->Tn = Tn, m->Sp = Sp, m->ns = ns, m->gt = gt, m->gs = gs;
    m->nbytes = L.bt + (size_t)nbt * 4;
    m->run = true;
    return 0;
}

/* Makes region r (n rows) the layer code's step inputs: k->din and k->lay;
 * bt the block tables. */
static void use_region(struct rank *k, uint8_t *r, int n, uint8_t *bt)
{
    struct inlay y;
    memset(&y, 0, sizeof y);
    y.slots = 0, y.ids = CUDA_MTP_R_IDS(n), y.pos = CUDA_MTP_R_POS(n), y.tok_bt = CUDA_MTP_R_TBT(n);
    y.bt = (size_t)(bt - r);
    k->din = r;
    k->lay = y;
}

/* The pass over regions of Tn rows (the sub-step's nl tokens, its nw keeps)
 * and Sp draft rows, enqueued on k's stream (a graph captures it with nl =
 * nw = Tn). */
static int pass(struct rank *k, int Tn, int nl, int nw, int Sp, char *err, size_t errlen)
{
    struct cuda_backend *b = k->b;
    struct cuda_mtp *m = b->mtp;
    struct cuda_mtp_rank *x = k->mtpx;
    const struct model_config *c = &b->c;
    int E = c->n_embd, V = c->n_vocab, S = b->max_seqs, K = m->K, rc = 0;
    cudaStream_t st = k->st;
    struct cuda_mtp_lay L = pass_lay(b, Tn, Sp);
    uint8_t *base = x->mdin, *din = k->din, *btp = base + L.bt;
    struct inlay lay = k->lay;
    if (nl > 0) {
        uint8_t *r0 = base + L.r0;
        use_region(k, r0, Tn, btp);
        if ((rc = run_layer(b, k, nl, (const int32_t *)(r0 + CUDA_MTP_R_IDS(Tn)),
                            (const int32_t *)(r0 + CUDA_MTP_R_SRC(Tn)), false, err, errlen)))
            goto out;
    }
    /* the step's hidden states into their blocks: after the sub-step, which read the ones there */
    CK(cuda_mtp_rows(x->hblk, (const int32_t *)(base + L.kdst), x->hk, (const int32_t *)(base + L.ksrc), nw, E, st));
    if (Sp > 0 && K > 0) {
        struct cuda_mtp_accept_args aa = {
            .sq = (const struct cuda_mtp_dseq *)(base + L.dseq), .ns = (const int32_t *)(base + L.ns),
            .tok = k->tok, .bt = (const int32_t *)btp, .Sp = Sp, .K = K, .V = V, .block_size = b->block_size,
            .pad_row = b->kv_blocks, .pad_slot = (int64_t)b->kv_blocks * b->block_size, .g0 = b->max_tokens,
            .kdst = (int32_t *)(base + L.ddst), .ksrc = (int32_t *)(base + L.dsrc), .r1 = base + L.r1,
            .out_p = x->res + (size_t)K * S, .out_k = x->res + (size_t)(K + 1) * S,
            .out_tok = x->res + (size_t)(K + 2) * S,
        };
        CK(cuda_mtp_accept(&aa, st));
        /* the accepted position's hidden state stays in its block: a forward() from p + 1 writes p + 1's entry */
        CK(cuda_mtp_rows(x->hblk, aa.kdst, x->hk, aa.ksrc, Sp, E, st));
        uint16_t *g = x->hk + (size_t)b->max_tokens * E; /* [Sp][E]: the chained hidden states, row j's */
        for (int it = 0; it < K; it++) {
            uint8_t *ri = base + L.r1 + (size_t)it * L.rs;
            use_region(k, ri, Sp, btp);
            const int32_t *ids = it == 0 ? (const int32_t *)(ri + CUDA_MTP_R_IDS(Sp)) : x->res + (size_t)(it - 1) * S;
            if ((rc = run_layer(b, k, Sp, ids, (const int32_t *)(ri + CUDA_MTP_R_SRC(Sp)), true, err, errlen)))
                goto out;
            /* the head: g = head_norm(x + the FFN's output), each row's next hidden state (the layer has
             * read the last one), then the shared LM head's greedy token (ties to the lower id) */
            CK(cuda_add_rmsnorm(k->x, k->delta, x->head_norm, NULL, Sp, E, c->norm_eps, g, st));
            CB(cuda_proj(k, &k->qhead, k->lm_head, g, k->logits, true, Sp, E, k->vn));
            if ((rc = cuda_head_argmax(k, Sp, x->res + (size_t)it * S, x->dlp, err, errlen))) goto out;
            CK(cuda_mtp_fix_ids(x->res + (size_t)it * S, Sp, V, st));
        }
    }
out:
    k->din = din, k->lay = lay;
    return rc;
fail:
    rc = SL_EDEVICE;
    goto out;
}

/* A graph's pass: every one of the bucket's Tn entries (arg: int [2], Tn and Sp) */
static int pass_graph(struct rank *k, void *arg, char *err, size_t errlen)
{
    const int *sh = arg;
    return pass(k, sh[0], sh[0], sh[0], sh[1], err, errlen);
}

int cuda_mtp_rank_pass(struct rank *k, char *err, size_t errlen)
{
    struct cuda_backend *b = k->b;
    struct cuda_mtp *m = b->mtp;
    struct cuda_mtp_rank *x = k->mtpx;
    const struct model_config *c = &b->c;
    if (!m || !x || !m->run) return 0;
    if (b->warming) {
        /* all zeros: no drafted sequence, every entry at position 0 of block 0 (which the MTP layer's
         * attention never reads), every keep into block 0's row, which no tag names yet */
        CK(cudaMemsetAsync(x->mdin, 0, m->mbytes, k->st));
        for (int i = 0; i < m->n_warm; i++) {
            int rc = cuda_graph_run(k, &x->gx[m->warm[i][0]][m->warm[i][1]], pass_graph, &m->warm[i][2], err, errlen);
            if (rc) return rc;
        }
        return 0;
    }
    CK(cudaMemcpyAsync(x->mdin, m->mhin, m->nbytes, cudaMemcpyHostToDevice, k->st));
    /* the step's final-normed hidden states: the residual plus the last block's
     * output, which the head adds for its rows only (the fused one-token path
     * is off with MTP, and creation refuses hyper-connections) */
    CK(cuda_add_rmsnorm(k->x, k->delta, k->out_norm, NULL, b->job.Tp, c->n_embd, c->norm_eps, x->hk, k->st));
    if (m->gt < 0) return pass(k, m->Tn, m->nl, m->nw, m->Sp, err, errlen);
    int sh[2] = {m->Tn, m->Sp};
    return cuda_graph_run(k, &x->gx[m->gt][m->gs], pass_graph, sh, err, errlen);
fail:
    return SL_EDEVICE;
}

void cuda_mtp_after_step(struct cuda_backend *b, const struct step *s)
{
    struct cuda_mtp *m = b->mtp;
    if (!m->run) return;
    if (b->warming) { /* its pass kept nothing and drafted for no one */
        m->run = false;
        return;
    }
    /* the accepted positions' hidden states the pass kept */
    const int32_t *op = m->hres + (size_t)m->K * b->max_seqs;
    for (int j = 0; j < m->ns && m->K > 0; j++) {
        const struct step_seq *q = &s->seqs[m->dev_seq[j]];
        int p = op[j];
        m->htag[q->block_table[p / b->block_size]] = p;
    }
    m->last_n = s->n_seqs;
}

/* ---- drafts -------------------------------------------------------------------- */

int cuda_mtp_draft(model_backend *mb, struct model_mtp_req *r, int n, char *err, size_t errlen)
{
    struct cuda_backend *b = (struct cuda_backend *)mb;
    const struct model_config *c = &b->c;
    struct cuda_mtp *m = b->mtp;
    int V = c->n_vocab, bs = b->block_size, kmax = 0;
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
    /* what the pass after the step drafted (from the position the device
     * accepted, with the token it picked there, no logits kept) is handed
     * out; the other requests take the eager path below */
    int ne = 0, S = b->max_seqs;
    const int32_t *op = m->hres + (size_t)m->K * S, *ok = op + S, *ot = ok + S;
    kmax = 0;
    for (int j = 0; j < n; j++) {
        struct model_mtp_req *q = &r[j];
        int d = m->run ? m->dev_j[q->seq] : -1;
        if (d >= 0 && !q->logits && q->pos == op[d] && q->token == ot[d] && q->k <= ok[d]) {
            for (int i = 0; i < q->k; i++) {
                int32_t t = m->hres[(size_t)i * S + d];
                q->drafts[i] = t >= 0 && t < V ? t : 0; /* -1: logits not finite; any token verifies alike */
            }
            continue;
        }
        m->ereq[ne++] = *q;
        if ((q->k > 1 ? q->k : 1) > kmax) kmax = q->k > 1 ? q->k : 1;
    }
    r = m->ereq, n = ne;
    if (n == 0) return 0;
    int T = b->max_tokens;
    /* p's hidden state stays in its block: a forward() from p + 1 writes p + 1's entry itself */
    for (int j = 0; j < n; j++) {
        m->keep_dst[j] = r[j].block_table[r[j].pos / bs];
        m->keep_src[j] = m->last_q0[r[j].seq] + r[j].pos - m->last_pos0[r[j].seq];
        m->keep_pos[j] = r[j].pos;
    }
    m->e_nw = keep_host(b, n);
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
        m->e_it = it, m->e_n = ns;
        m->e_bytes = load_sub(b, ns);
        /* every rank its share of the layer and the head; the tokens come back in rank 0's mapped buffer */
        if (cuda_crew_run(b, JOB_MTP_DRAFT, err, errlen)) return stop(b, err);
        m->e_nw = 0;
        for (int t = 0; t < ns; t++) {
            struct model_mtp_req *q = &r[m->row_req[t]];
            if (it >= q->k) continue;
            int32_t tok = b->hout_tok[t];
            q->drafts[it] = tok >= 0 && tok < V ? tok : 0; /* -1: logits not finite; any token verifies alike */
        }
    }
    return 0;
}

int cuda_mtp_rank_draft(struct rank *k, char *err, size_t errlen)
{
    struct cuda_backend *b = k->b;
    const struct model_config *c = &b->c;
    struct cuda_mtp *m = b->mtp;
    struct cuda_mtp_rank *x = k->mtpx;
    int E = c->n_embd, V = c->n_vocab, ns = m->e_n, it = m->e_it;
    uint16_t *g = x->hk + (size_t)b->max_tokens * E; /* [max_seqs][E]: the chained hidden states, row t of the last
                                                        iteration */
    CK(cudaSetDevice(k->dev));
    if (keep_rows(k, m->e_nw, err, errlen) || load_rows(k, ns, m->e_bytes, err, errlen) ||
        run_layer(b, k, ns, DIN(k, ids, int32_t), x->didx, true, err, errlen))
        return SL_EDEVICE;
    /* the head: g = head_norm(x + the FFN's output), each request's next hidden state (the layer has read
     * the last one), then the shared LM head's greedy token (ties to the lower id) */
    CK(cuda_add_rmsnorm(k->x, k->delta, x->head_norm, NULL, ns, E, c->norm_eps, g, k->st));
    CB(cuda_proj(k, &k->qhead, k->lm_head, g, k->logits, true, ns, E, k->vn));
    if (cuda_head_argmax(k, ns, k->tok, k->lp, err, errlen) || cuda_rank_wait(k, err, errlen)) return SL_EDEVICE;
    /* the logits a request asks for: each rank its vocabulary slice */
    for (int t = 0; t < ns; t++) {
        const struct model_mtp_req *q = &m->ereq[m->row_req[t]];
        if (it < q->k && q->logits)
            CK(cudaMemcpy(q->logits + (size_t)it * V + k->v0, k->logits + (size_t)t * k->vn, (size_t)k->vn * 4,
                          cudaMemcpyDeviceToHost));
    }
    return 0;
fail:
    return SL_EDEVICE;
}

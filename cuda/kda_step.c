/* kda_step.c - KDA linear attention on the GPU backend, host side (kda.h): a
 * layer's upload, the state-slot pool, the step's per-sequence inputs and
 * the mixer's launches.
 *
 * Tensor parallelism splits the KDA heads: rank k holds heads [k H/N,
 * (k+1) H/N) of q, k, v (their conv channels), f_b, b, g_b, dt_bias and
 * A_log, the whole of f_a, g_a and o_norm, and o_proj's matching columns
 * (row-parallel: the ranks' partial outputs are summed like the o
 * projection's). Its state slots hold its heads only: per KDA layer [H/N][D][D]
 * S then the tail [K-1][3 C/N] (at N = 1 the CPU's layout). Its replay
 * scratch (drafts, kda.h) holds its heads' inputs too, and each rank
 * replays its own heads: the rollback needs no collective. */
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "cuda/cuda_internal.h"
#include "cuda/kda.h"
#include "cuda/kda_chunk.h"

struct cuda_kda_layer {
    struct qproj qqkv, qfa, qfb, qb, qga, qgb, qo; /* packed parts (n 0: the bf16 matrix below) */
    uint16_t *wqkv, *wfa, *wfb, *wb, *wga, *wgb, *wo; /* [3C][E], [D][E], [C][D], [H][E], [D][E], [C][D], [E][C] */
    float *conv;            /* [3][C][K] */
    float *dt_bias;         /* [C] */
    float *A;               /* [H] exp(A_log) */
    float *o_norm;          /* [D] */
    size_t off;             /* this layer's first float in a state slot */
    float *spec_qkv, *spec_fg, *spec_beta; /* its part of the rank's replay scratch (NULL without drafts) */
};

struct cuda_kda_rank {
    int E, H, D, C, K, last; /* this rank's heads H (C = H D); last: the last KDA layer (frees the rank's share) */
    int h0;                 /* its first head */
    size_t slot_floats;
    float *states;          /* [n_slots][slot_floats], device */
    int n_slots;
    /* scratch, [max_tokens] rows */
    float *qkv;             /* [2 max_tokens][3C]: the projections of xn's bf16 rows, then of their low parts */
    uint16_t *hl;           /* [2 max_tokens][E]: xn, then its low parts (cuda_kda_xsplit) */
    float *o32;             /* [C]: the recurrence's outputs before the norm */
    float *fg, *gate;       /* [C] */
    float *beta;            /* [H] */
    uint16_t *fa, *ga;      /* [D] bf16: the inputs of f_b and g_b */
    uint16_t *o;            /* [C] bf16: o_proj's input */
    float *kcw;             /* [3C] the chunked path's work (cuda_kda_chunk), or NULL: that path off */
    uint16_t *stage;        /* upload staging (pinned), until the last layer is up */
    float *tmp;
    /* the replay scratch (kda.h): per KDA layer [spec_rows][3C] q|k|v, [spec_rows][C] fg, [spec_rows][H] beta;
     * spec_rows = max_seqs x max_draft draft tokens (0 and NULL without drafts) */
    float *spec;
    size_t spec_rows;
    /* the replay's launches captured per batch bucket (b->bucket: entries padded to it), with the state pool and
     * step-input mirror they were captured over (a new one of either: captured again) */
    cudaGraphExec_t roll[NBUCKET];
    const void *roll_states, *roll_din;
    size_t roll_off;        /* and the entries' offset in it */
};

static void drop_roll(struct cuda_kda_rank *x)
{
    for (int i = 0; i < NBUCKET; i++)
        if (x->roll[i]) {
            cudaGraphExecDestroy(x->roll[i]);
            x->roll[i] = NULL;
        }
}

/* Floats of one KDA layer's share of the replay scratch. */
static size_t spec_layer_floats(const struct cuda_kda_rank *x)
{
    return x->spec_rows * (4 * (size_t)x->C + (size_t)x->H);
}

#define STAGE ((size_t)16 << 20) /* as weights.c's STAGE_ELEMS */

static int rank_setup(struct rank *k, char *err, size_t errlen)
{
    struct cuda_backend *b = k->b;
    const struct model_config *c = &b->c;
    const struct model_kda_config *kc = &c->kda;
    if (kc->n_head <= 0 || kc->head_dim <= 0 || kc->conv_kernel <= 0) {
        sl_seterr(err, errlen, "cuda: KDA layers without linear_num_heads, linear_head_dim or linear_conv_kernel_dim");
        return SL_EFORMAT;
    }
    if (kc->head_dim > CUDA_KDA_MAX_D || kc->conv_kernel > CUDA_KDA_MAX_K) {
        sl_seterr(err, errlen, "cuda: KDA linear_head_dim %d / linear_conv_kernel_dim %d unsupported (at most %d / %d)",
                  kc->head_dim, kc->conv_kernel, CUDA_KDA_MAX_D, CUDA_KDA_MAX_K);
        return SL_EUNSUP;
    }
    int N = b->tp;
    if (kc->n_head % N) {
        sl_seterr(err, errlen, "cuda: --tensor-parallel-size %d does not divide the %d KDA heads (linear_num_heads)", N,
                  kc->n_head);
        return SL_EUNSUP;
    }
    struct cuda_kda_rank *x = calloc(1, sizeof *x);
    if (!x) {
        sl_seterr(err, errlen, "out of host memory");
        return SL_ENOMEM;
    }
    k->kdax = x;
    x->E = c->n_embd, x->H = kc->n_head / N, x->D = kc->head_dim, x->C = x->H * kc->head_dim;
    x->K = kc->conv_kernel, x->h0 = k->id * x->H;
    for (int l = 0; l < c->n_layer; l++)
        if (model_layer_kind_of(c, l).mixer == MODEL_MIXER_KDA) x->last = l;
    x->slot_floats = model_state_bytes(c) / sizeof(float) / (size_t)N;
    size_t T = b->max_tokens, C = x->C, D = x->D, H = x->H;
    /* drafts: every draft token a step can verify keeps its inputs for the replay, in every KDA layer; at
     * creation, so the memory plan counts it before the KV pool */
    int n_kda = 0;
    for (int l = 0; l < c->n_layer; l++) n_kda += model_layer_kind_of(c, l).mixer == MODEL_MIXER_KDA;
    x->spec_rows = b->max_draft > 0 ? (size_t)b->max_seqs * (size_t)b->max_draft : 0;
    size_t spec_bytes = (size_t)n_kda * spec_layer_floats(x) * sizeof(float);
    if (spec_bytes && cuda_dmalloc((void **)&x->spec, spec_bytes, err, errlen)) {
        sl_seterr(err, errlen, "cuda: out of GPU memory on GPU %d for the KDA layers' draft replay scratch (%.2f GB: "
                  "%d sequences x %d drafts x %zu bytes; lower --max-num-seqs or num_speculative_tokens)", k->dev,
                  spec_bytes / 1e9, b->max_seqs, b->max_draft, model_state_replay_bytes(c) / (size_t)N);
        return SL_ENOMEM;
    }
    if (k->id == 0) b->base.spec_state_bytes = spec_bytes;
    if (cuda_dmalloc((void **)&x->qkv, 2 * T * 3 * C * 4, err, errlen) ||
        cuda_dmalloc((void **)&x->hl, 2 * T * (size_t)x->E * 2, err, errlen) ||
        cuda_dmalloc((void **)&x->o32, T * C * 4, err, errlen) ||
        cuda_dmalloc((void **)&x->fg, T * C * 4, err, errlen) ||
        cuda_dmalloc((void **)&x->gate, T * C * 4, err, errlen) ||
        cuda_dmalloc((void **)&x->beta, T * H * 4, err, errlen) ||
        cuda_dmalloc((void **)&x->fa, T * D * 2, err, errlen) || cuda_dmalloc((void **)&x->ga, T * D * 2, err, errlen) ||
        cuda_dmalloc((void **)&x->o, T * C * 2, err, errlen) ||
        (b->t.kda_chunk_min_t > 0 && b->t.kda_chunk_min_t <= (int)T &&
         cuda_dmalloc((void **)&x->kcw, T * 3 * C * 4, err, errlen)))
        return SL_ENOMEM;
    /* graph padding rows go through o_proj too: finite from the start */
    if (cudaMemset(x->o, 0, T * C * 2) != cudaSuccess || cuda_kda_prepare() != cudaSuccess ||
        cuda_kda_chunk_prepare() != cudaSuccess ||
        cudaMallocHost((void **)&x->stage, STAGE * 2) != cudaSuccess) {
        sl_seterr(err, errlen, "cuda: KDA setup: %s", cudaGetErrorString(cudaGetLastError()));
        return SL_EDEVICE;
    }
    if (!(x->tmp = malloc(STAGE * sizeof *x->tmp))) {
        sl_seterr(err, errlen, "out of host memory");
        return SL_ENOMEM;
    }
    return 0;
}

int cuda_kda_upload(struct rank *k, int l, char *err, size_t errlen)
{
    struct cuda_backend *b = k->b;
    const struct model_config *c = &b->c;
    int rc;
    if (!k->kdax && (rc = rank_setup(k, err, errlen))) return rc;
    struct cuda_kda_rank *x = k->kdax;
    struct cuda_kda_layer *L = calloc(1, sizeof *L);
    if (!L) {
        sl_seterr(err, errlen, "out of host memory");
        return SL_ENOMEM;
    }
    k->L[l].kda = L;
    const struct model_kda_weights *kw = &b->w->layers[l].kda;
    int64_t E = x->E, H = x->H, D = x->D, C = x->C, K = x->K, Cf = C * b->tp, h0 = x->h0, c0 = h0 * D;
    int ki = 0; /* the layer's index among the KDA layers: its part of the replay scratch */
    for (int i = 0; i < l; i++) {
        L->off += (size_t)model_state_layer_elems(c, i) / (size_t)b->tp;
        ki += model_layer_kind_of(c, i).mixer == MODEL_MIXER_KDA;
    }
    if (x->spec) {
        L->spec_qkv = x->spec + (size_t)ki * spec_layer_floats(x);
        L->spec_fg = L->spec_qkv + x->spec_rows * 3 * (size_t)x->C;
        L->spec_beta = L->spec_fg + x->spec_rows * (size_t)x->C;
    }
    const struct model_tensor *tqkv[3] = {&kw->q, &kw->k, &kw->v}, *tfa[1] = {&kw->f_a}, *tfb[1] = {&kw->f_b},
                              *tb[1] = {&kw->b}, *tga[1] = {&kw->g_a}, *tgb[1] = {&kw->g_b}, *to[1] = {&kw->o};
    /* this rank's rows: its heads' channels (C of them, from c0), its heads (H, from h0) */
    int64_t z[1] = {0}, rc3[3] = {c0, c0, c0}, rc1[1] = {c0}, rh[1] = {h0}, nC[3] = {C, C, C}, nD[1] = {D},
            nH[1] = {H}, nE[1] = {E};
    if ((rc = cuda_upload_proj(k, tqkv, rc3, nC, 3, E, 0, E, &L->wqkv, &L->qqkv, x->stage, x->tmp, err, errlen)) ||
        (rc = cuda_upload_proj(k, tfa, z, nD, 1, E, 0, E, &L->wfa, &L->qfa, x->stage, x->tmp, err, errlen)) ||
        (rc = cuda_upload_proj(k, tfb, rc1, nC, 1, D, 0, D, &L->wfb, &L->qfb, x->stage, x->tmp, err, errlen)) ||
        (rc = cuda_upload_proj(k, tb, rh, nH, 1, E, 0, E, &L->wb, &L->qb, x->stage, x->tmp, err, errlen)) ||
        (rc = cuda_upload_proj(k, tga, z, nD, 1, E, 0, E, &L->wga, &L->qga, x->stage, x->tmp, err, errlen)) ||
        (rc = cuda_upload_proj(k, tgb, rc1, nC, 1, D, 0, D, &L->wgb, &L->qgb, x->stage, x->tmp, err, errlen)) ||
        (rc = cuda_upload_proj(k, to, z, nE, 1, Cf, c0, C, &L->wo, &L->qo, x->stage, x->tmp, err, errlen)) ||
        (rc = cuda_upload_vec(&kw->dt_bias, (size_t)c0, (size_t)C, NULL, &L->dt_bias, err, errlen)) ||
        (rc = cuda_upload_vec(&kw->A_log, (size_t)h0, (size_t)H, expf, &L->A, err, errlen)) ||
        (rc = cuda_upload_vec(&kw->o_norm, 0, (size_t)D, NULL, &L->o_norm, err, errlen)))
        return rc;
    size_t ck = (size_t)(C * K);
    float *h = malloc(3 * ck * sizeof *h);
    if (!h) {
        sl_seterr(err, errlen, "out of host memory");
        return SL_ENOMEM;
    }
    for (int i = 0; i < 3; i++) model_tensor_to_f32(&kw->conv[i], c0 * K, (int64_t)ck, h + i * ck);
    rc = cuda_dmalloc((void **)&L->conv, 3 * ck * sizeof *h, err, errlen);
    if (!rc && cudaMemcpy(L->conv, h, 3 * ck * sizeof *h, cudaMemcpyHostToDevice) != cudaSuccess) {
        sl_seterr(err, errlen, "cuda: upload of layer %d's KDA conv failed", l);
        rc = SL_EDEVICE;
    }
    free(h);
    if (rc) return rc;
    if (l == x->last) { /* the staging buffers are not needed any more */
        cudaFreeHost(x->stage), free(x->tmp);
        x->stage = NULL, x->tmp = NULL;
    }
    return 0;
}

void cuda_kda_free(struct rank *k, int l)
{
    struct cuda_kda_layer *L = k->L ? k->L[l].kda : NULL;
    if (L) { /* packed parts live in k->qmem */
        cudaFree(L->wqkv), cudaFree(L->wfa), cudaFree(L->wfb), cudaFree(L->wb), cudaFree(L->wga), cudaFree(L->wgb);
        cudaFree(L->wo), cudaFree(L->conv), cudaFree(L->dt_bias), cudaFree(L->A), cudaFree(L->o_norm);
        free(L);
        k->L[l].kda = NULL;
    }
    struct cuda_kda_rank *x = k->kdax;
    if (x && l == x->last) {
        cudaFree(x->states), cudaFree(x->qkv), cudaFree(x->hl), cudaFree(x->o32), cudaFree(x->fg), cudaFree(x->spec);
        cudaFree(x->gate), cudaFree(x->beta);
        cudaFree(x->fa), cudaFree(x->ga), cudaFree(x->o), cudaFree(x->kcw);
        if (x->stage) cudaFreeHost(x->stage);
        free(x->tmp);
        drop_roll(x);
        free(x);
        k->kdax = NULL;
    }
}

void cuda_kda_qws_need(const struct rank *k, int l, size_t *deq, size_t *xp)
{
    const struct cuda_kda_layer *L = k->L[l].kda;
    if (!L) return;
    const struct qproj *p[] = {&L->qqkv, &L->qfa, &L->qfb, &L->qb, &L->qga, &L->qgb, &L->qo};
    for (size_t i = 0; i < sizeof p / sizeof *p; i++) cuda_qws_need(p[i], false, deq, xp);
}

int cuda_kda_state_alloc(struct cuda_backend *b, int n_slots, char *err, size_t errlen)
{
    for (int r = 0; r < b->tp; r++) {
        struct rank *k = &b->r[r];
        struct cuda_kda_rank *x = k->kdax;
        if (!x) continue;
        if (cudaSetDevice(k->dev) != cudaSuccess) {
            sl_seterr(err, errlen, "state_alloc: GPU %d unavailable", k->dev);
            return SL_EDEVICE;
        }
        cudaFree(x->states);
        x->states = NULL, x->n_slots = 0;
        size_t bytes = (size_t)n_slots * x->slot_floats * sizeof(float);
        if (cuda_dmalloc((void **)&x->states, bytes, err, errlen)) {
            sl_seterr(err, errlen, "state_alloc: out of GPU memory on GPU %d for %d state slots (%.2f GB)", k->dev,
                      n_slots, (double)bytes / 1e9);
            return SL_ENOMEM;
        }
        if (cudaMemset(x->states, 0, bytes) != cudaSuccess) {
            sl_seterr(err, errlen, "state_alloc: %s", cudaGetErrorString(cudaGetLastError()));
            return SL_EDEVICE;
        }
        x->n_slots = n_slots;
    }
    cudaSetDevice(b->r[0].dev); /* the caller's thread drives rank 0 */
    return 0;
}

/* The number of kda_seqs entries a step of Tp tokens launches over: every
 * token's sequence in a decode step (graph padding included), else up to
 * max_seqs (entries past n_seqs are padding). */
static int kda_grid(const struct cuda_backend *b, int Tp, bool decode)
{
    return decode || Tp < b->max_seqs ? Tp : b->max_seqs;
}

/* The drafts of q whose inputs the replay keeps: the verified ones (backend.h). */
static int spec_drafts(const struct step_seq *q) { return q->want_sample && q->n_draft > 0 ? q->n_draft : 0; }

bool cuda_kda_pack(struct cuda_backend *b, const struct step *s, int Tp)
{
    struct cuda_kda_seq *sq = (struct cuda_kda_seq *)(b->hin + b->lay.kda_seqs);
    struct cuda_kda_snap *sn = (struct cuda_kda_snap *)(b->hin + b->lay.kda_snaps);
    int G = kda_grid(b, Tp, s->n_tokens == s->n_seqs), ns = 0, spec0 = 0;
    if (s->n_seqs > G) return false;
    for (int i = 0; i < s->n_seqs; i++) {
        const struct step_seq *q = &s->seqs[i];
        if (q->n_snaps < 0 || ns + q->n_snaps > b->lay.max_kda_snaps) return false;
        /* drafts (model_step_check: at most max_draft, after at least one other query token): their rows of
         * the replay scratch, in the order cuda_kda_rollback counts them */
        int nd = spec_drafts(q);
        if (nd > 0 && (nd >= q->query_len || spec0 + nd > b->max_seqs * b->max_draft)) return false;
        int mode = q->context_len == q->query_len ? CUDA_KDA_ZERO
                   : q->state_restore             ? CUDA_KDA_RESTORE
                                                  : CUDA_KDA_CONTINUE;
        sq[i] = (struct cuda_kda_seq){.t0 = q->query_start, .n = q->query_len,
                                      .p0 = q->context_len - q->query_len, .slot = q->state_slot, .mode = mode,
                                      .from = q->state_restore ? q->state_from : q->state_slot, .snap0 = ns,
                                      .n_snaps = q->n_snaps, .nd = nd, .spec0 = nd > 0 ? spec0 : 0};
        for (int j = 0; j < q->n_snaps; j++) sn[ns + j] = (struct cuda_kda_snap){q->snap_pos[j], q->snap_slot[j]};
        ns += q->n_snaps;
        spec0 += nd;
    }
    for (int i = s->n_seqs; i < G; i++) sq[i] = (struct cuda_kda_seq){0};
    b->job.kda_drafts = spec0 > 0;
    return true;
}

int cuda_kda_mixer(struct rank *k, int l, int T, bool decode, char *err, size_t errlen)
{
    struct cuda_backend *b = k->b;
    struct cuda_kda_rank *x = k->kdax;
    const struct cuda_kda_layer *L = k->L[l].kda;
    cudaStream_t st = k->st;
    int E = x->E, H = x->H, D = x->D, C = x->C, G = kda_grid(b, T, decode);
    const struct cuda_kda_seq *seqs = (const struct cuda_kda_seq *)(k->din + b->lay.kda_seqs);
    /* the slots' start once a step, before its first KDA layer reads them */
    bool first = true;
    for (int i = 0; i < l && first; i++) first = !k->L[i].kda;
    if (first) CK(cuda_kda_begin(x->states, x->slot_floats, seqs, G, st));
    /* q|k|v from xn to ~2^-17 (kda.h): its bf16 rows and their low parts as 2T rows of one GEMM */
    CK(cuda_kda_xsplit(k->x, k->L[l].attn_norm, k->xn, T, E, b->c.norm_eps, x->hl, st));
    CB(cuda_proj(k, &L->qqkv, L->wqkv, x->hl, x->qkv, true, 2 * T, E, 3 * C));
    CB(cuda_proj(k, &L->qfa, L->wfa, k->xn, x->fa, false, T, E, D));
    CB(cuda_proj(k, &L->qfb, L->wfb, x->fa, x->fg, true, T, D, C));
    CB(cuda_proj(k, &L->qb, L->wb, k->xn, x->beta, true, T, E, H));
    CB(cuda_proj(k, &L->qga, L->wga, k->xn, x->ga, false, T, E, D));
    CB(cuda_proj(k, &L->qgb, L->wgb, x->ga, x->gate, true, T, D, C));
    const struct model_kda_config *kc = &b->c.kda;
    struct cuda_kda_args a = {
        .qkv = x->qkv, .qkv_lo = x->qkv + (size_t)T * 3 * C, .fg = x->fg, .beta = x->beta, .gate = x->gate,
        .conv = L->conv, .dt_bias = L->dt_bias,
        .A = L->A, .o_norm = L->o_norm, .states = x->states, .slot_floats = x->slot_floats, .off = L->off,
        .seqs = seqs, .snaps = (const struct cuda_kda_snap *)(k->din + b->lay.kda_snaps), .n_seqs = G, .H = H,
        .D = D, .K = x->K, .lower_bound = kc->has_lower_bound, .lb = kc->lower_bound, .eps = b->c.norm_eps,
        .o32 = x->o32, .out = x->o, .spec_qkv = L->spec_qkv, .spec_fg = L->spec_fg, .spec_beta = L->spec_beta,
    };
    /* a sequence with drafts (cuda_kda_seq.nd > 0) needs the recurrence's handling: its slot left before the
     * drafts and their inputs in the replay scratch (kda.h), else the rollback replays over a state that
     * already holds them; the chunked kernels do not keep them */
    bool chunk = !decode && x->kcw && T >= b->t.kda_chunk_min_t && !b->job.kda_drafts;
    CK(chunk ? cuda_kda_chunk(&a, b->t.kda_chunk_len, x->kcw, st) : cuda_kda_recur(&a, st));
    return cuda_proj_rows(k, x->o, &L->qo, L->wo, T, C, E, 0, false, err, errlen);
fail:
    return SL_EDEVICE;
}

int cuda_kda_rollback(struct cuda_backend *b, const struct step *s, char *err, size_t errlen)
{
    /* the step is done (forward() waited for it): its kda_seqs region of hin is free for the replay's entries */
    struct cuda_kda_seq *sq = (struct cuda_kda_seq *)(b->hin + b->lay.kda_seqs);
    int n = 0, spec0 = 0;
    for (int i = 0; i < s->n_seqs; i++) {
        const struct step_seq *q = &s->seqs[i];
        int nd = spec_drafts(q);
        if (nd == 0) continue;
        /* accepted drafts: spec_out's tokens but the last (the correction or the bonus token; a row that could
         * not be sampled ends the walk there too, as on the CPU) */
        int a = q->n_spec_out - 1;
        if (a > nd) a = nd;
        if (a > 0)
            sq[n++] = (struct cuda_kda_seq){.t0 = spec0, .n = a, .p0 = q->context_len - nd, .slot = q->state_slot,
                                            .mode = CUDA_KDA_CONTINUE};
        spec0 += nd;
    }
    if (n == 0) return 0;
    /* padded to a batch bucket (entries of no tokens), so a few captured launches serve every step */
    int bk = 0;
    while (bk < b->n_bucket - 1 && b->bucket[bk] < n) bk++;
    int np = b->bucket[bk] >= n ? b->bucket[bk] : n;
    for (int i = n; i < np; i++) sq[i] = (struct cuda_kda_seq){0};
    b->job.kda_roll = np;
    return cuda_crew_run(b, JOB_KDA_ROLLBACK, err, errlen);
}

/* The replay's launches over n entries of the kda_seqs region on rank k's stream. */
static int roll_launch(struct rank *k, int n, char *err, size_t errlen)
{
    struct cuda_backend *b = k->b;
    struct cuda_kda_rank *x = k->kdax;
    const struct model_kda_config *kc = &b->c.kda;
    for (int l = 0; l < b->c.n_layer; l++) {
        const struct cuda_kda_layer *L = k->L[l].kda;
        if (!L) continue;
        struct cuda_kda_args a = {
            .qkv = L->spec_qkv, .fg = L->spec_fg, .beta = L->spec_beta, .conv = L->conv, .dt_bias = L->dt_bias,
            .A = L->A, .states = x->states, .slot_floats = x->slot_floats, .off = L->off,
            .seqs = (const struct cuda_kda_seq *)(k->din + b->lay.kda_seqs), .n_seqs = n, .H = x->H, .D = x->D,
            .K = x->K, .lower_bound = kc->has_lower_bound, .lb = kc->lower_bound, .eps = b->c.norm_eps,
            .replay = true,
        };
        CK(cuda_kda_recur(&a, k->st));
    }
    return 0;
fail:
    return SL_EDEVICE;
}

/* roll_launch for a graph: arg the bucket's entries */
static int roll_bucket(struct rank *k, void *arg, char *err, size_t errlen)
{
    return roll_launch(k, *(const int *)arg, err, errlen);
}

int cuda_kda_rank_rollback(struct rank *k, char *err, size_t errlen)
{
    struct cuda_backend *b = k->b;
    struct cuda_kda_rank *x = k->kdax;
    int n = b->job.kda_roll;
    CK(cudaSetDevice(k->dev));
    if (!x || n <= 0) return 0;
    size_t off = b->lay.kda_seqs;
    CK(cudaMemcpyAsync(k->din + off, b->hin + off, (size_t)n * sizeof(struct cuda_kda_seq), cudaMemcpyHostToDevice,
                       k->st));
    int gi = -1;
    for (int i = 0; b->graphs && i < b->n_bucket; i++)
        if (b->bucket[i] == n) gi = i;
    if (gi < 0) { /* --enforce-eager, or more entries than a bucket */
        int rc = roll_launch(k, n, err, errlen);
        return rc ? rc : cuda_rank_wait(k, err, errlen);
    }
    if (x->roll_states != x->states || x->roll_din != k->din || x->roll_off != off) {
        drop_roll(x); /* state_alloc or kv_alloc since the captures */
        x->roll_states = x->states, x->roll_din = k->din, x->roll_off = off;
    }
    int rc = cuda_graph_run(k, &x->roll[gi], roll_bucket, &n, err, errlen);
    return rc ? rc : cuda_rank_wait(k, err, errlen);
fail:
    return SL_EDEVICE;
}

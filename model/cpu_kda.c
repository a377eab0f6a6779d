/* cpu_kda.c - KDA linear attention on the CPU backend (cpu_internal.h).
 *
 * One KDA layer over a step, as transformers' Glm5NextTextLinearAttention
 * computes it (its recurrent form, recurrent_kimi_delta_attention, with
 * use_qk_l2norm_in_kernel), per token t of a sequence, per head h
 * (D = head_dim, C = n_head D):
 *   q|k|v  = silu(causal depthwise conv over the last K inputs of
 *            q_proj(xn)|k_proj(xn)|v_proj(xn))
 *   q, k   = l2norm(q_h), l2norm(k_h)  (x / sqrt(sum x^2 + 1e-6)); q /= sqrt(D)
 *   g      = f_b(f_a(xn)) + dt_bias;  log-decay per channel
 *            lower_bound sigmoid(exp(A_log_h) g)  or  -exp(A_log_h) softplus(g)
 *   beta   = sigmoid(b_proj(xn)_h)
 *   S     *= exp(g) (row k of S scaled by channel k's decay)
 *   S     += k (beta (v - S^T k))^T;   o = S^T q
 *   out    = o_proj(rmsnorm(o_h) o_norm sigmoid(g_b(g_a(xn))_h))
 *
 * Token by token is the default form here: a prompt split across steps at
 * any point gives the state of one pass bit for bit (a step only continues
 * the recurrence), and so does a decode. The chunked form of the reference
 * (recur_chunked, cpu_kda_set_chunk) is the same arithmetic reassociated into
 * matrix products; it is the reference for cuda/kda_chunk.cu and off by
 * default: the recurrence costs 4 n_head head_dim^2 multiply-adds a token
 * against the projections' 4 n_embd C (GLM-5.3: 4.2M against 134M, 3%), and
 * the chunked form does more arithmetic a token (its exps, and the
 * intra-chunk matrices): measured, a mixer of 8 heads of 128 over 512 tokens
 * took 144 ms token by token, 388 ms in chunks of 16, 600 ms in chunks of 64
 * (2 threads).
 *
 * Batch invariance: the projections are cpu_matmul's (row independent); the
 * conv runs per (sequence, channel), the recurrence per (sequence, head),
 * each by one thread in token order, so nothing depends on the rest of the
 * step.
 *
 * A sequence's state for one layer, inside its slot (model_state_layer_elems):
 * [H][D][D] S (S[k][v], k the key channel), then the conv tail [K-1][3C]: the
 * last K-1 projected inputs before the next token (q|k|v), oldest first,
 * zeros before the sequence's start.
 */
#include <math.h>
#include <omp.h>
#include <stdlib.h>
#include <string.h>
#if defined(__AVX2__) && defined(__FMA__)
#include <immintrin.h>
#endif

#include "cpu_internal.h"

struct kda_layer {
    struct wmat q, k, v, f_a, f_b, b, g_a, g_b, o;
    float *conv;            /* [3][C][K] taps: q, k, v parts */
    float *dt_bias;         /* [C] */
    float *A;               /* [H] exp(A_log) */
    float *o_norm;          /* [D] */
    size_t off;             /* first float of this layer's state in a slot */
};

struct cpu_kda {
    struct model_config c;
    int E, H, D, C, K, nt, max_tokens;
    size_t slot_floats;     /* one state slot: every KDA layer */
    struct kda_layer *L;    /* [n_layer]; only KDA layers filled */
    float *wmem;            /* owned: the f32 small weights */
    /* scratch, [max_tokens] rows unless said otherwise */
    float *proj[3];         /* [C] q, k, v projections (the conv's inputs) */
    float *cv[3];           /* [C] after the conv and SiLU; q, k then normalised */
    float *fa, *ga;         /* [D] */
    float *dec;             /* [C] exp(log-decay) per channel */
    float *beta;            /* [H] */
    float *gate;            /* [C] */
    float *o;               /* [C] */
    float *xr;              /* [E] xn rounded to bf16 for f_a, b, g_a (cpu_backend_emulate_bf16: tests) */
    float *kvm;             /* [nt][D] per thread: S^T k, then delta */
    int chunk;              /* the delta rule's tokens a chunk (cpu_kda_set_chunk); 0: token by token */
    float *cwork;           /* [nt][chunk_floats(chunk, D)] per thread: recur_chunked's matrices */
};

/* ---- construction --------------------------------------------------------------- */

int cpu_kda_max_in(const struct model_config *c)
{
    int m = 0;
    for (int l = 0; l < c->n_layer; l++)
        if (model_layer_kind_of(c, l).mixer == MODEL_MIXER_KDA) m = c->n_embd;
    if (!m) return 0;
    int C = c->kda.n_head * c->kda.head_dim;
    return C > m ? C : m;
}

void cpu_kda_destroy(struct cpu_kda *a)
{
    if (!a) return;
    void *p[] = {a->L, a->wmem, a->proj[0], a->proj[1], a->proj[2], a->cv[0], a->cv[1], a->cv[2], a->fa, a->ga,
                 a->dec, a->beta, a->gate, a->o, a->xr, a->kvm, a->cwork};
    for (size_t i = 0; i < sizeof p / sizeof *p; i++) free(p[i]);
    free(a);
}

struct cpu_kda *cpu_kda_create(const struct cpu_backend *b, const struct model_config *c,
                               const struct model_weights *w, int max_tokens, char *err, size_t errlen)
{
    const struct model_kda_config *k = &c->kda;
    if (k->n_head <= 0 || k->head_dim <= 0 || k->conv_kernel <= 0) {
        sl_seterr(err, errlen, "KDA layers without linear_num_heads, linear_head_dim or linear_conv_kernel_dim");
        return NULL;
    }
    struct cpu_kda *a = calloc(1, sizeof *a);
    if (!a) goto oom;
    a->c = *c;
    a->E = c->n_embd, a->H = k->n_head, a->D = k->head_dim, a->C = k->n_head * k->head_dim, a->K = k->conv_kernel;
    a->nt = cpu_threads(b), a->max_tokens = max_tokens;
    size_t T = (size_t)max_tokens, C = a->C, D = a->D, H = a->H, K = a->K;
    int n_kda = 0;
    for (int l = 0; l < c->n_layer; l++) n_kda += model_layer_kind_of(c, l).mixer == MODEL_MIXER_KDA;
    a->L = calloc((size_t)c->n_layer, sizeof *a->L);
    a->wmem = cpu_zalloc((size_t)n_kda * (3 * C * K + C + H + D) * sizeof(float));
    for (int i = 0; i < 3; i++) {
        a->proj[i] = cpu_zalloc(T * C * sizeof(float));
        a->cv[i] = cpu_zalloc(T * C * sizeof(float));
    }
    a->fa = cpu_zalloc(T * D * sizeof(float));
    a->ga = cpu_zalloc(T * D * sizeof(float));
    a->dec = cpu_zalloc(T * C * sizeof(float));
    a->beta = cpu_zalloc(T * H * sizeof(float));
    a->gate = cpu_zalloc(T * C * sizeof(float));
    a->o = cpu_zalloc(T * C * sizeof(float));
    a->xr = cpu_zalloc(T * (size_t)a->E * sizeof(float));
    a->kvm = cpu_zalloc((size_t)a->nt * D * sizeof(float));
    if (!a->L || !a->wmem || !a->proj[0] || !a->proj[1] || !a->proj[2] || !a->cv[0] || !a->cv[1] || !a->cv[2] ||
        !a->fa || !a->ga || !a->dec || !a->beta || !a->gate || !a->o || !a->xr || !a->kvm)
        goto oom;
    float *p = a->wmem;
    size_t off = 0;
    for (int l = 0; l < c->n_layer; l++) {
        if (model_layer_kind_of(c, l).mixer != MODEL_MIXER_KDA) continue;
        const struct model_kda_weights *kw = &w->layers[l].kda;
        struct kda_layer *L = &a->L[l];
        const struct model_tensor *mats[9] = {&kw->q, &kw->k, &kw->v, &kw->f_a, &kw->f_b, &kw->b, &kw->g_a, &kw->g_b,
                                              &kw->o};
        struct wmat *dst[9] = {&L->q, &L->k, &L->v, &L->f_a, &L->f_b, &L->b, &L->g_a, &L->g_b, &L->o};
        for (int i = 0; i < 9; i++)
            if (cpu_wmat_init(dst[i], mats[i], err, errlen)) goto fail;
        L->conv = p;
        for (int i = 0; i < 3; i++) model_tensor_to_f32(&kw->conv[i], 0, (int64_t)(C * K), p + i * C * K);
        p += 3 * C * K;
        L->dt_bias = p;
        model_tensor_to_f32(&kw->dt_bias, 0, (int64_t)C, p);
        p += C;
        L->A = p;
        model_tensor_to_f32(&kw->A_log, 0, (int64_t)H, p);
        for (size_t h = 0; h < H; h++) p[h] = expf(p[h]);
        p += H;
        L->o_norm = p;
        model_tensor_to_f32(&kw->o_norm, 0, (int64_t)D, p);
        p += D;
        L->off = off;
        off += (size_t)model_state_layer_elems(c, l);
    }
    a->slot_floats = off;
    return a;
oom:
    sl_seterr(err, errlen, "out of memory for the KDA layers (%d tokens)", max_tokens);
fail:
    cpu_kda_destroy(a);
    return NULL;
}

/* ---- the step ------------------------------------------------------------------- */

void cpu_kda_begin(const struct cpu_kda *a, const struct step *s, float *states)
{
    for (int i = 0; i < s->n_seqs; i++) {
        const struct step_seq *q = &s->seqs[i];
        float *st = states + (size_t)q->state_slot * a->slot_floats;
        if (q->context_len == q->query_len)
            memset(st, 0, a->slot_floats * sizeof(float));
        else if (q->state_restore)
            memcpy(st, states + (size_t)q->state_from * a->slot_floats, a->slot_floats * sizeof(float));
    }
}

static inline float sigmoidf(float x) { return 1.0f / (1.0f + expf(-x)); }

/* The conv input of channel c (part pt) at position pos for a sequence whose
 * step starts at p0 with its first token at row t0 (rows of proj), reading
 * the tail [K-1][3C] for positions before p0. */
static inline float conv_in(const struct cpu_kda *a, int pt, int c, int pos, int p0, int t0, const float *tail)
{
    if (pos >= p0) return a->proj[pt][(size_t)(t0 + pos - p0) * a->C + c];
    return tail[(size_t)(pos - p0 + a->K - 1) * 3 * a->C + (size_t)pt * a->C + c];
}

/* The short causal conv + SiLU of every sequence of the step, then its new
 * tail and the tails of its snapshots. Parallel over (sequence, channel). */
static void conv_step(struct cpu_kda *a, const struct step *s, const struct kda_layer *L, float *states)
{
    int C = a->C, K = a->K, n3 = 3 * C;
#pragma omp parallel for collapse(2) schedule(static) num_threads(a->nt)
    for (int i = 0; i < s->n_seqs; i++) {
        for (int ch = 0; ch < n3; ch++) {
            const struct step_seq *q = &s->seqs[i];
            int pt = ch / C, c = ch % C, t0 = q->query_start, n = q->query_len, p0 = q->context_len - n;
            float *tail = states + (size_t)q->state_slot * a->slot_floats + L->off + (size_t)C * a->D;
            const float *w = L->conv + ((size_t)pt * C + c) * K;
            for (int t = 0; t < n; t++) {
                int pos = p0 + t;
                float acc = 0.0f;
                for (int j = 0; j < K; j++) acc = fmaf(w[j], conv_in(a, pt, c, pos - (K - 1) + j, p0, t0, tail), acc);
                a->cv[pt][(size_t)(t0 + t) * C + c] = acc * sigmoidf(acc);
            }
            /* snapshots first: they may read the old tail */
            for (int k = 0; k < q->n_snaps; k++) {
                float *sn = states + (size_t)q->snap_slot[k] * a->slot_floats + L->off + (size_t)C * a->D;
                int P = q->snap_pos[k];
                for (int j = 0; j < K - 1; j++)
                    sn[(size_t)j * n3 + ch] = conv_in(a, pt, c, P - (K - 1) + j, p0, t0, tail);
            }
            /* in place, oldest first: row j reads row j + n or later, not yet written */
            for (int j = 0; j < K - 1; j++)
                tail[(size_t)j * n3 + ch] = conv_in(a, pt, c, p0 + n - (K - 1) + j, p0, t0, tail);
        }
    }
}

/* x / sqrt(sum x^2 + 1e-6) * scale over n (the sum in double) */
static void l2norm(float *x, int n, float scale)
{
    double ss = 0.0;
    for (int i = 0; i < n; i++) ss += (double)x[i] * x[i];
    float r = (float)(1.0 / sqrt(ss + 1e-6)) * scale;
    for (int i = 0; i < n; i++) x[i] *= r;
}

#define KDA_SUB 16 /* recur_chunked's sub-chunks (cuda/kda_chunk.cu's too) */

/* The floats recur_chunked's matrices take for chunks of Lc tokens */
static size_t chunk_floats(int Lc, int D) { return (size_t)Lc * D * 5 + 2 * (size_t)Lc * Lc + D; }

int cpu_kda_set_chunk(struct cpu_kda *a, int chunk)
{
    if (chunk < 0 || chunk > 4096) return SL_EINVAL;
    float *w = NULL;
    if (chunk && !(w = cpu_zalloc((size_t)a->nt * chunk_floats(chunk, a->D) * sizeof(float)))) return SL_ENOMEM;
    free(a->cwork);
    a->cwork = w, a->chunk = chunk;
    return 0;
}

/* The two passes over one row S[k][0..D) per token: decay and read
 * (S *= d; m += kk S), then write and output (S += kk delta; o += qk S).
 * The AVX2 forms do per element exactly the scalar operations (a multiply,
 * then one fused multiply-add), so the bits are the same either way. */
static inline void row_decay_read(float *S, float d, float kk, float *m, int D)
{
    int v = 0;
#if defined(__AVX2__) && defined(__FMA__)
    __m256 dv = _mm256_set1_ps(d), kv = _mm256_set1_ps(kk);
    for (; v + 8 <= D; v += 8) {
        __m256 sv = _mm256_mul_ps(_mm256_loadu_ps(S + v), dv);
        _mm256_storeu_ps(S + v, sv);
        _mm256_storeu_ps(m + v, _mm256_fmadd_ps(kv, sv, _mm256_loadu_ps(m + v)));
    }
#endif
    for (; v < D; v++) {
        S[v] *= d;
        m[v] = fmaf(kk, S[v], m[v]);
    }
}

static inline void row_write_out(float *S, float kk, const float *delta, float qk, float *o, int D)
{
    int v = 0;
#if defined(__AVX2__) && defined(__FMA__)
    __m256 kv = _mm256_set1_ps(kk), qv = _mm256_set1_ps(qk);
    for (; v + 8 <= D; v += 8) {
        __m256 sv = _mm256_fmadd_ps(kv, _mm256_loadu_ps(delta + v), _mm256_loadu_ps(S + v));
        _mm256_storeu_ps(S + v, sv);
        _mm256_storeu_ps(o + v, _mm256_fmadd_ps(qv, sv, _mm256_loadu_ps(o + v)));
    }
#endif
    for (; v < D; v++) {
        S[v] = fmaf(kk, delta[v], S[v]);
        o[v] = fmaf(qk, S[v], o[v]);
    }
}

/* The delta rule of head h of sequence q over its tokens, from and into its
 * slot's S; the snapshots' S copied after their token. */
static void recur(struct cpu_kda *a, const struct step_seq *q, const struct kda_layer *L, int h, float *states,
                  float *kvm)
{
    int C = a->C, D = a->D, n = q->query_len, p0 = q->context_len - n;
    size_t hoff = L->off + (size_t)h * D * D;
    float *S = states + (size_t)q->state_slot * a->slot_floats + hoff;
    int snap = 0;
    for (int t = 0; t < n; t++) {
        size_t row = (size_t)(q->query_start + t) * C + (size_t)h * D;
        const float *qv = a->cv[0] + row, *kv = a->cv[1] + row, *vv = a->cv[2] + row, *dec = a->dec + row;
        float beta = a->beta[(size_t)(q->query_start + t) * a->H + h];
        float *o = a->o + row;
        for (int v = 0; v < D; v++) kvm[v] = 0.0f;
        for (int k = 0; k < D; k++) row_decay_read(S + (size_t)k * D, dec[k], kv[k], kvm, D);
        for (int v = 0; v < D; v++) kvm[v] = (vv[v] - kvm[v]) * beta;
        for (int v = 0; v < D; v++) o[v] = 0.0f;
        for (int k = 0; k < D; k++) row_write_out(S + (size_t)k * D, kv[k], kvm, qv[k], o, D);
        while (snap < q->n_snaps && q->snap_pos[snap] == p0 + t + 1) {
            memcpy(states + (size_t)q->snap_slot[snap] * a->slot_floats + hoff, S, (size_t)D * D * sizeof(float));
            snap++;
        }
    }
}

/* The delta rule of head h of sequence q in chunks, the same recurrence
 * reassociated (the chunked form of the reference's chunk_kda; cuda/kda_chunk.cu
 * does these steps in this order). Per chunk of L tokens, with S0 the state
 * before it, g[t] the log-decays (a->dec holds them in this mode), G[t] =
 * g[0] + .. + g[t] per channel (<= 0, falling), u[t] the delta of token t
 * (beta_t (v_t - k_t^T S'), S' the state decayed through t):
 *   A[t][s] = beta_t sum_c k_t k_s e^(G_t - G_s),  s < t
 *   P[t][s] =        sum_c q_t k_s e^(G_t - G_s),  s <= t
 *   u_t = beta_t (v_t - (k_t e^G_t)^T S0) - sum_{s<t} A[t][s] u_s  (the lower-triangular solve, in order)
 *   o_t = (q_t e^G_t)^T S0 + sum_{s<=t} P[t][s] u_s
 *   S   = e^G_L S0 + sum_s (k_s e^(G_L - G_s)) u_s^T   (L the chunk's last token)
 * Every exponent is a difference G_t - G_s with s <= t, or G_t itself: <= 0,
 * so nothing overflows however strong the decay (a factor that underflows
 * is one whose true value is below f32's range too). In A and P, s before
 * t's sub-chunk of KDA_SUB tokens takes e^(G_t - G_s) as e^(G_t - B) e^(B - G_s),
 * B the G just before that sub-chunk: both factors <= 1, and on the GPU one
 * per row rather than one per pair (the pairs inside a sub-chunk keep theirs). Chunks end on the
 * absolute position grid (multiples of a->chunk) and at the snapshots' positions,
 * so the chunks after a snapshot are those of a run restored from it. */
static void recur_chunked(struct cpu_kda *a, const struct step_seq *q, const struct kda_layer *L, int h,
                          float *states, float *w)
{
    int C = a->C, D = a->D, n = q->query_len, p0 = q->context_len - n, Lc = a->chunk;
    size_t hoff = L->off + (size_t)h * D * D;
    float *S = states + (size_t)q->state_slot * a->slot_floats + hoff;
    float *G = w, *Qg = G + (size_t)Lc * D, *Kg = Qg + (size_t)Lc * D, *Kd = Kg + (size_t)Lc * D;
    float *U = Kd + (size_t)Lc * D, *A = U + (size_t)Lc * D, *P = A + (size_t)Lc * Lc, *eg = P + (size_t)Lc * Lc;
    int snap = 0;
    for (int t0 = 0; t0 < n;) {
        int e = ((p0 + t0) / Lc + 1) * Lc - p0;
        if (e > n) e = n;
        while (snap < q->n_snaps && q->snap_pos[snap] <= p0 + t0) snap++;
        if (snap < q->n_snaps && q->snap_pos[snap] - p0 < e) e = q->snap_pos[snap] - p0;
        int Lt = e - t0;
        size_t r0 = (size_t)(q->query_start + t0) * C + (size_t)h * D;
        const float *qv = a->cv[0] + r0, *kv = a->cv[1] + r0, *vv = a->cv[2] + r0, *lg = a->dec + r0;
        const float *beta = a->beta + (size_t)(q->query_start + t0) * a->H + h;
#define TK(p, t, c) (p)[(size_t)(t) * C + (c)] /* row t of the chunk in a [T][C] array */
#define TD(p, t, c) (p)[(size_t)(t) * D + (c)]
        for (int c = 0; c < D; c++) {
            float run = 0.0f;
            for (int t = 0; t < Lt; t++) TD(G, t, c) = run += TK(lg, t, c);
        }
        /* A and P: s in t's sub-chunk of KDA_SUB tokens directly, e^(G_t - G_s) a channel; s before it as
         * (k_t e^(G_t - B)) (k_s e^(B - G_s)), B the G before t's sub-chunk: both exponents <= 0 */
        for (int t = 0; t < Lt; t++) {
            int r = t / KDA_SUB * KDA_SUB;
            for (int s = 0; s <= t; s++) {
                float ac = 0.0f, pc = 0.0f;
                for (int c = 0; c < D; c++) {
                    if (s < r) {
                        float B = TD(G, r - 1, c), et = expf(TD(G, t, c) - B);
                        float x = TK(kv, s, c) * expf(B - TD(G, s, c));
                        ac = fmaf(TK(kv, t, c) * et, x, ac);
                        pc = fmaf(TK(qv, t, c) * et, x, pc);
                    } else {
                        float x = TK(kv, s, c) * expf(TD(G, t, c) - TD(G, s, c));
                        ac = fmaf(TK(kv, t, c), x, ac);
                        pc = fmaf(TK(qv, t, c), x, pc);
                    }
                }
                A[(size_t)t * Lc + s] = ac * beta[(size_t)t * a->H];
                P[(size_t)t * Lc + s] = pc;
            }
        }
        for (int t = 0; t < Lt; t++)
            for (int c = 0; c < D; c++) {
                float eG = expf(TD(G, t, c));
                TD(Qg, t, c) = TK(qv, t, c) * eG;
                TD(Kg, t, c) = TK(kv, t, c) * eG;
                TD(Kd, t, c) = TK(kv, t, c) * expf(TD(G, Lt - 1, c) - TD(G, t, c));
            }
        for (int c = 0; c < D; c++) eg[c] = expf(TD(G, Lt - 1, c));
        for (int t = 0; t < Lt; t++)
            for (int j = 0; j < D; j++) {
                float m = 0.0f;
                for (int c = 0; c < D; c++) m = fmaf(TD(Kg, t, c), S[(size_t)c * D + j], m);
                float u = beta[(size_t)t * a->H] * (TK(vv, t, j) - m);
                for (int s = 0; s < t; s++) u = fmaf(-A[(size_t)t * Lc + s], TD(U, s, j), u);
                TD(U, t, j) = u;
            }
        for (int t = 0; t < Lt; t++)
            for (int j = 0; j < D; j++) {
                float o = 0.0f;
                for (int c = 0; c < D; c++) o = fmaf(TD(Qg, t, c), S[(size_t)c * D + j], o);
                for (int s = 0; s <= t; s++) o = fmaf(P[(size_t)t * Lc + s], TD(U, s, j), o);
                TK(a->o + r0, t, j) = o;
            }
        for (int c = 0; c < D; c++)
            for (int j = 0; j < D; j++) {
                float x = eg[c] * S[(size_t)c * D + j];
                for (int t = 0; t < Lt; t++) x = fmaf(TD(Kd, t, c), TD(U, t, j), x);
                S[(size_t)c * D + j] = x;
            }
#undef TK
#undef TD
        t0 = e;
        while (snap < q->n_snaps && q->snap_pos[snap] == p0 + t0) {
            memcpy(states + (size_t)q->snap_slot[snap] * a->slot_floats + hoff, S, (size_t)D * D * sizeof(float));
            snap++;
        }
    }
}

void cpu_kda_mixer(struct cpu_kda *a, const struct cpu_backend *b, const struct step *s, int l, const float *xn,
                   float *out, float *states)
{
    const struct kda_layer *L = &a->L[l];
    int T = s->n_tokens, E = a->E, H = a->H, D = a->D, C = a->C;
    const struct model_kda_config *kc = &a->c.kda;
    unsigned bf = cpu_bf16_families(b); /* 0 but in tests (cpu_backend_emulate_bf16) */
    const float *xs = xn; /* f_a's, b's and g_a's input */
    if (bf & CPU_BF16_XN) {
        memcpy(a->xr, xn, (size_t)T * E * sizeof(float));
        cpu_round_bf16(a->xr, (size_t)T * E);
        xs = a->xr;
    }
    cpu_matmul(b, a->proj[0], xn, &L->q, NULL, T, E, C);
    cpu_matmul(b, a->proj[1], xn, &L->k, NULL, T, E, C);
    cpu_matmul(b, a->proj[2], xn, &L->v, NULL, T, E, C);
    cpu_matmul(b, a->fa, xs, &L->f_a, NULL, T, E, D);
    if (bf & CPU_BF16_KDA) cpu_round_bf16(a->fa, (size_t)T * D);
    cpu_matmul(b, a->dec, a->fa, &L->f_b, NULL, T, D, C);
    cpu_matmul(b, a->beta, xs, &L->b, NULL, T, E, H);
    cpu_matmul(b, a->ga, xs, &L->g_a, NULL, T, E, D);
    if (bf & CPU_BF16_KDA) cpu_round_bf16(a->ga, (size_t)T * D);
    cpu_matmul(b, a->gate, a->ga, &L->g_b, NULL, T, D, C);
    conv_step(a, s, L, states);

    float qscale = 1.0f / sqrtf((float)D);
#pragma omp parallel for schedule(static) num_threads(a->nt) if (T >= 4)
    for (int t = 0; t < T; t++) {
        for (int h = 0; h < H; h++) {
            size_t row = (size_t)t * C + (size_t)h * D;
            l2norm(a->cv[0] + row, D, 1.0f);
            for (int d = 0; d < D; d++) a->cv[0][row + d] *= qscale;
            l2norm(a->cv[1] + row, D, 1.0f);
            float A = L->A[h];
            for (int d = 0; d < D; d++) {
                float g = a->dec[row + d] + L->dt_bias[(size_t)h * D + d], lg;
                if (kc->has_lower_bound)
                    lg = kc->lower_bound * sigmoidf(A * g);
                else
                    lg = -A * (g > 20.0f ? g : log1pf(expf(g)));
                a->dec[row + d] = a->chunk ? lg : expf(lg);
            }
            a->beta[(size_t)t * H + h] = sigmoidf(a->beta[(size_t)t * H + h]);
        }
    }

#pragma omp parallel for collapse(2) schedule(dynamic, 1) num_threads(a->nt)
    for (int i = 0; i < s->n_seqs; i++)
        for (int h = 0; h < H; h++) {
            int th = omp_get_thread_num();
            if (a->chunk)
                recur_chunked(a, &s->seqs[i], L, h, states, a->cwork + (size_t)th * chunk_floats(a->chunk, D));
            else
                recur(a, &s->seqs[i], L, h, states, a->kvm + (size_t)th * D);
        }

    float eps = a->c.norm_eps;
#pragma omp parallel for schedule(static) num_threads(a->nt) if (T >= 4)
    for (int t = 0; t < T; t++) {
        for (int h = 0; h < H; h++) {
            size_t row = (size_t)t * C + (size_t)h * D;
            float *o = a->o + row;
            double ss = 0.0;
            for (int d = 0; d < D; d++) ss += (double)o[d] * o[d];
            float r = (float)(1.0 / sqrt(ss / D + eps));
            for (int d = 0; d < D; d++) o[d] = L->o_norm[d] * (o[d] * r) * sigmoidf(a->gate[row + d]);
        }
    }
    if (bf & CPU_BF16_KDA) cpu_round_bf16(a->o, (size_t)T * C);
    cpu_matmul(b, out, a->o, &L->o, NULL, T, C, E);
}

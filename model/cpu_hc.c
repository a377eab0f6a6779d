/* cpu_hc.c - manifold-constrained hyper-connections (mHC) on the CPU backend
 * (cpu_internal.h), as transformers' Glm5NextTextHyperConnection computes a
 * site, per token, with N = hc streams of E values:
 *   m      = fn . (xs / rms(xs))             xs flattened to N E, fn [(2 + N) N][N E]
 *   pre_i  = sigmoid(m_i s0 + b_i) + eps
 *   post_j = 2 sigmoid(m_{N+j} s1 + b_{N+j})
 *   comb   = softmax_j(m_{2N+iN+j} s2 + b_{2N+iN+j}) + eps, then divided by its
 *            column sums (+ eps), then iters - 1 times by its row sums and its
 *            column sums (Sinkhorn-Knopp: a doubly stochastic mix)
 *   x      = sum_i pre_i xs_i                           the block's input
 *   xs'_j  = post_j block(x) + sum_i comb_ij xs_i       the streams after it
 * Every value depends on its own token only (batch invariant); sums run in
 * stream order.
 */
#include <math.h>
#include <stdlib.h>
#include <string.h>

#include "cpu_internal.h"

struct hc_site {
    struct wmat fn;
    float *base;   /* [(2 + N) N] */
    float *scale;  /* [3] */
};

struct cpu_hc {
    int N, E, iters, n_layer, max_tokens;
    float eps, norm_eps;
    struct hc_site *s; /* [n_layer][2]; fn.data NULL where the layer has none */
    float *wmem;       /* owned: the f32 bases and scales */
    float *xn;         /* [max_tokens][N E] normed streams */
    float *mix;        /* [max_tokens][(2 + N) N] */
    float *post;       /* [max_tokens][N] */
    float *comb;       /* [max_tokens][N][N] */
};

struct cpu_hc *cpu_hc_create(const struct model_config *c, const struct model_weights *w, int max_tokens, char *err,
                             size_t errlen)
{
    struct cpu_hc *h = calloc(1, sizeof *h);
    if (!h) goto oom;
    int N = h->N = c->hc.mult, E = h->E = c->n_embd, M = (2 + N) * N;
    h->iters = c->hc.sinkhorn_iters, h->eps = c->hc.eps, h->norm_eps = c->norm_eps;
    h->n_layer = c->n_layer, h->max_tokens = max_tokens;
    h->s = calloc((size_t)c->n_layer * 2, sizeof *h->s);
    h->wmem = cpu_zalloc((size_t)c->n_layer * 2 * (M + 3) * sizeof(float));
    size_t T = (size_t)max_tokens;
    h->xn = cpu_zalloc(T * N * E * sizeof(float));
    h->mix = cpu_zalloc(T * M * sizeof(float));
    h->post = cpu_zalloc(T * N * sizeof(float));
    h->comb = cpu_zalloc(T * N * N * sizeof(float));
    if (!h->s || !h->wmem || !h->xn || !h->mix || !h->post || !h->comb) goto oom;
    float *p = h->wmem;
    for (int l = 0; l < c->n_layer; l++) {
        if (model_layer_kind_of(c, l).resid != MODEL_RESID_HC) continue;
        const struct model_hc_weights *ws[2] = {&w->layers[l].hc_attn, &w->layers[l].hc_ffn};
        for (int k = 0; k < 2; k++) {
            struct hc_site *st = &h->s[2 * l + k];
            if (cpu_wmat_init(&st->fn, &ws[k]->fn, err, errlen)) goto fail;
            st->base = p;
            model_tensor_to_f32(&ws[k]->base, 0, M, p);
            p += M;
            st->scale = p;
            model_tensor_to_f32(&ws[k]->scale, 0, 3, p);
            p += 3;
        }
    }
    return h;
oom:
    sl_seterr(err, errlen, "out of memory for the hyper-connections (%d tokens)", max_tokens);
fail:
    cpu_hc_destroy(h);
    return NULL;
}

static inline float sigmoidf(float x) { return 1.0f / (1.0f + expf(-x)); }

void cpu_hc_pre(struct cpu_hc *h, const struct cpu_backend *b, int l, int site, const float *xs, float *x, int T)
{
    const struct hc_site *st = &h->s[2 * l + site];
    int N = h->N, E = h->E, NE = N * E, M = (2 + N) * N;
    SL_ASSERT(st->fn.data && T <= h->max_tokens);
    /* the unweighted RMSNorm over all streams (sum of squares in double, as cpu_rmsnorm) */
#pragma omp parallel for schedule(static) num_threads(cpu_threads(b)) if (T >= 8)
    for (int t = 0; t < T; t++) {
        const float *v = xs + (size_t)t * NE;
        double ss = 0.0;
        for (int i = 0; i < NE; i++) ss += (double)v[i] * v[i];
        float r = (float)(1.0 / sqrt(ss / NE + h->norm_eps));
        float *o = h->xn + (size_t)t * NE;
        for (int i = 0; i < NE; i++) o[i] = v[i] * r;
    }
    cpu_matmul(b, h->mix, h->xn, &st->fn, NULL, T, NE, M);
#pragma omp parallel for schedule(static) num_threads(cpu_threads(b)) if (T >= 8)
    for (int t = 0; t < T; t++) {
        const float *m = h->mix + (size_t)t * M, *bs = st->base, *sc = st->scale;
        float pre[N], *post = h->post + (size_t)t * N, *cb = h->comb + (size_t)t * N * N;
        for (int i = 0; i < N; i++) {
            pre[i] = sigmoidf(m[i] * sc[0] + bs[i]) + h->eps;
            post[i] = 2.0f * sigmoidf(m[N + i] * sc[1] + bs[N + i]);
        }
        for (int i = 0; i < N; i++) {
            float *row = cb + i * N, mx = -INFINITY, sum = 0.0f;
            for (int j = 0; j < N; j++) {
                row[j] = m[2 * N + i * N + j] * sc[2] + bs[2 * N + i * N + j];
                if (row[j] > mx) mx = row[j];
            }
            for (int j = 0; j < N; j++) {
                row[j] = expf(row[j] - mx);
                sum += row[j];
            }
            for (int j = 0; j < N; j++) row[j] = row[j] / sum + h->eps;
        }
        for (int it = 0; it < h->iters; it++) {
            if (it > 0) /* rows (the first pass is columns only) */
                for (int i = 0; i < N; i++) {
                    float sum = 0.0f;
                    for (int j = 0; j < N; j++) sum += cb[i * N + j];
                    for (int j = 0; j < N; j++) cb[i * N + j] /= sum + h->eps;
                }
            for (int j = 0; j < N; j++) {
                float sum = 0.0f;
                for (int i = 0; i < N; i++) sum += cb[i * N + j];
                for (int i = 0; i < N; i++) cb[i * N + j] /= sum + h->eps;
            }
        }
        const float *v = xs + (size_t)t * NE;
        float *o = x + (size_t)t * E;
        for (int e = 0; e < E; e++) {
            float acc = pre[0] * v[e];
            for (int i = 1; i < N; i++) acc += pre[i] * v[(size_t)i * E + e];
            o[e] = acc;
        }
    }
}

void cpu_hc_post(struct cpu_hc *h, float *xs, const float *y, int T)
{
    int N = h->N, E = h->E;
#pragma omp parallel for schedule(static) if (T >= 8)
    for (int t = 0; t < T; t++) {
        float *v = xs + (size_t)t * N * E, old[N];
        const float *post = h->post + (size_t)t * N, *cb = h->comb + (size_t)t * N * N, *yt = y + (size_t)t * E;
        for (int e = 0; e < E; e++) {
            for (int i = 0; i < N; i++) old[i] = v[(size_t)i * E + e];
            for (int j = 0; j < N; j++) {
                float acc = cb[j] * old[0];
                for (int i = 1; i < N; i++) acc += cb[i * N + j] * old[i];
                v[(size_t)j * E + e] = post[j] * yt[e] + acc;
            }
        }
    }
}

void cpu_hc_destroy(struct cpu_hc *h)
{
    if (!h) return;
    free(h->s);
    free(h->wmem);
    free(h->xn);
    free(h->mix);
    free(h->post);
    free(h->comb);
    free(h);
}

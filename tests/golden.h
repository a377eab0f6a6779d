/* golden.h - HF transformers goldens (tests/golden/make_goldens.py and the
 * generators beside it) for the backend tests (tests/test_forward.c,
 * test_mla.c, test_moe.c, test_quant.c, tests/gpu/test_gpu_e2e.c): per prompt
 * the input ids, HF's top-TOPK logits at every position and its greedy
 * continuation; and the checks a checkpoint test runs against them on the
 * CPU backend (golden_backend, golden_step, golden_worst, golden_chunked,
 * golden_greedy).
 *
 *   struct golden g;
 *   if (golden_load(path, &g) == 0) { ...; golden_free(&g); }
 *
 * Include after tests/test.h.
 */
#ifndef SLUICE_TEST_GOLDEN_H
#define SLUICE_TEST_GOLDEN_H

#include <math.h>
#include <stdbool.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "base/json.h"
#include "model/backend.h"
#include "sched/sched.h"
#include "tests/test.h"

#define TOPK 20    /* top logits per position */
#define NGREEDY 64 /* greedy tokens */
#define MAXP 8     /* prompts */

struct prompt {
    int n;              /* input ids */
    int32_t *ids;       /* [n + NGREEDY]: ids then the golden greedy continuation */
    int32_t *top_ids;   /* [n][TOPK] */
    float *top_logits;  /* [n][TOPK] */
    int n_greedy;
};

struct golden {
    int np;
    struct prompt p[MAXP];
};

static inline int read_ints(const json_doc *d, int arr, int32_t *out, int cap)
{
    int n = json_size(d, arr);
    if (!json_is_arr(d, arr) || n > cap) return -1;
    int i = arr + 1;
    for (int k = 0; k < n; k++, i = json_skip(d, i)) {
        int64_t v;
        if (json_i64(d, i, &v) != 0) return -1;
        out[k] = (int32_t)v;
    }
    return n;
}

static inline int read_floats(const json_doc *d, int arr, float *out, int cap)
{
    int n = json_size(d, arr);
    if (!json_is_arr(d, arr) || n > cap) return -1;
    int i = arr + 1;
    for (int k = 0; k < n; k++, i = json_skip(d, i)) {
        double v;
        if (json_f64(d, i, &v) != 0) return -1;
        out[k] = (float)v;
    }
    return n;
}

static inline void golden_free(struct golden *g)
{
    for (int i = 0; i < g->np; i++) {
        free(g->p[i].ids);
        free(g->p[i].top_ids);
        free(g->p[i].top_logits);
    }
    memset(g, 0, sizeof *g);
}

static inline int golden_load(const char *path, struct golden *g)
{
    memset(g, 0, sizeof *g);
    size_t len;
    char *src = test_slurp(path, &len);
    if (!src) return -1;
    json_doc d;
    char err[128];
    int rc = -1;
    if (json_parse(&d, src, len, err, sizeof err) != 0) {
        printf("  %s: %s\n", path, err);
        free(src);
        return -1;
    }
    int ps = json_get(&d, 0, "prompts");
    if (!json_is_arr(&d, ps)) goto out;
    int e = ps + 1;
    for (int k = 0; k < json_size(&d, ps) && k < MAXP; k++, e = json_skip(&d, e)) {
        struct prompt *p = &g->p[g->np++];
        int ids = json_get(&d, e, "ids"), ti = json_get(&d, e, "top_ids"),
            tl = json_get(&d, e, "top_logits"), gr = json_get(&d, e, "greedy");
        int n = json_size(&d, ids);
        if (n <= 0 || json_size(&d, ti) != n || json_size(&d, tl) != n) goto out;
        p->n = n;
        p->ids = calloc((size_t)n + NGREEDY, sizeof *p->ids);
        p->top_ids = calloc((size_t)n * TOPK, sizeof *p->top_ids);
        p->top_logits = calloc((size_t)n * TOPK, sizeof *p->top_logits);
        if (!p->ids || !p->top_ids || !p->top_logits) goto out;
        if (read_ints(&d, ids, p->ids, n) != n) goto out;
        p->n_greedy = read_ints(&d, gr, p->ids + n, NGREEDY);
        if (p->n_greedy < 0) goto out;
        int r = ti + 1, s = tl + 1;
        for (int pos = 0; pos < n; pos++, r = json_skip(&d, r), s = json_skip(&d, s)) {
            if (read_ints(&d, r, p->top_ids + pos * TOPK, TOPK) != TOPK ||
                read_floats(&d, s, p->top_logits + pos * TOPK, TOPK) != TOPK)
                goto out;
        }
    }
    rc = 0;
out:
    if (rc) printf("  %s: malformed golden\n", path);
    json_free(&d);
    free(src);
    return rc;
}

/* ---- a checkpoint's logits against its golden, on the CPU backend ---- */

/* One sequence's place in a backend: its block table bt[n_blocks] of
 * block_size-token blocks; logit rows of nv floats. */
struct golden_run {
    model_backend *be;
    const int32_t *bt;
    int n_blocks, block_size, nv;
};

/* A CPU backend over m for steps and contexts of up to 256 and max_ctx tokens,
 * its KV pool kv_blocks blocks of block_size tokens. NULL after a failed check
 * naming name and the reason. */
static inline model_backend *golden_backend(const model *m, int n_threads, int max_ctx, int kv_blocks, int block_size,
                                            const char *name)
{
    char err[512];
    struct model_backend_opts bo = {.device = "cpu", .n_threads = n_threads, .max_tokens_per_step = 256,
                                    .max_seqs_per_step = 256, .max_ctx = max_ctx};
    model_backend *be = model_backend_create(m, &bo, err, sizeof err);
    CHECKF(be != NULL, "%s: %s", name, err);
    if (be && be->ops->kv_alloc(be, kv_blocks, block_size, err, sizeof err) != 0) {
        CHECKF(0, "%s: kv_alloc: %s", name, err);
        model_backend_destroy(be);
        be = NULL;
    }
    return be;
}

/* One step over positions start..start+n-1 of ids (n <= 256) in r's blocks.
 * all: each position a 1-token sequence of its own, logits[n][nv]; else one
 * sequence sampled greedily (as serving steps it), its last position's
 * logits in logits[nv]. Returns forward's status, printing a failure. */
static inline int golden_step(const struct golden_run *r, const int32_t *ids, int start, int n, bool all,
                              float *logits)
{
    static int32_t pos[256];
    static int64_t slots[256];
    static struct step_seq sq[256];
    char err[256];
    if (n > 256) return -1;
    uint64_t rng = model_rng_seed(0);
    struct model_sampling greedy;
    model_sampling_default(&greedy);
    int bs = r->block_size;
    for (int t = 0; t < n; t++) {
        int p = start + t;
        pos[t] = p;
        slots[t] = (int64_t)r->bt[p / bs] * bs + p % bs;
        sq[t] = (struct step_seq){.query_start = t, .query_len = 1, .context_len = p + 1, .block_table = r->bt,
                                  .n_blocks = r->n_blocks, .logits_out = logits + (size_t)t * r->nv};
    }
    if (!all)
        sq[0] = (struct step_seq){.query_start = 0, .query_len = n, .context_len = start + n, .block_table = r->bt,
                                  .n_blocks = r->n_blocks, .logits_out = logits, .want_sample = true,
                                  .sampling = &greedy, .history = ids, .n_prompt = start + n,
                                  .n_history = start + n, .rng = &rng};
    struct step st = {.n_tokens = n, .token_ids = ids + start, .positions = pos, .slots = slots,
                      .n_seqs = all ? n : 1, .seqs = sq};
    int rc = r->be->ops->forward(r->be, &st, err, sizeof err);
    if (rc) printf("  forward: %s\n", err);
    return rc;
}

static inline int golden_argmax(const float *v, int n)
{
    int b = 0;
    for (int i = 1; i < n; i++)
        if (v[i] > v[b]) b = i;
    return b;
}

/* The largest |logit - golden| over the golden's top TOPK at position pos,
 * relative to its largest |logit|; lg: that position's logits[nv]. */
static inline double golden_rel_err(const float *lg, const struct prompt *p, int pos, int nv)
{
    double md = 0, mr = 0;
    for (int k = 0; k < TOPK; k++) {
        int id = p->top_ids[pos * TOPK + k];
        float ref = p->top_logits[pos * TOPK + k];
        double dd = id >= 0 && id < nv ? fabs((double)lg[id] - ref) : INFINITY;
        md = dd > md ? dd : md;
        mr = fabs(ref) > mr ? fabs(ref) : mr;
    }
    return md / (mr > 0 ? mr : 1);
}

/* worst, or the largest golden_rel_err over p's positions (all: logits[p->n][nv]), whichever is larger; NaN wins. */
static inline double golden_worst(const float *all, const struct prompt *p, int nv, double worst)
{
    for (int pos = 0; pos < p->n; pos++) {
        double r = golden_rel_err(all + (size_t)pos * nv, p, pos, nv);
        if (!(r <= worst)) worst = r;
    }
    return worst;
}

/* The prompt ids[0..n) prefilled in chunks of `chunk` tokens, never one of 1
 * (that would be a decode step: a chunk of 1 is made 2 by starting a token
 * early); the last chunk's logits in one[nv]. Returns the first failure. */
static inline int golden_chunked(const struct golden_run *r, const int32_t *ids, int n, int chunk, float *one)
{
    int rc = 0;
    for (int s = 0; s < n && !rc; s += chunk) {
        int k = n - s < chunk ? n - s : chunk;
        if (k == 1 && s > 0) k = 2, s--;
        rc = golden_step(r, ids, s, k, false, one);
    }
    return rc;
}

/* Greedy decoding of p, one token a step, from one (the last prompt
 * position's logits, in r's blocks) against the golden continuation; seq
 * (room for p->n + p->n_greedy ids) ends up holding the sequence and one the
 * last step's logits. Returns the first token that differs, or -1. */
static inline int golden_greedy(const struct golden_run *r, const struct prompt *p, float *one, int32_t *seq)
{
    memcpy(seq, p->ids, (size_t)p->n * sizeof *seq);
    int first_diff = -1;
    for (int k = 0; k < p->n_greedy; k++) {
        int tok = golden_argmax(one, r->nv);
        seq[p->n + k] = tok;
        if (first_diff < 0 && tok != p->ids[p->n + k]) first_diff = k;
        if (k + 1 < p->n_greedy) CHECK(golden_step(r, seq, p->n + k, 1, false, one) == 0);
    }
    return first_diff;
}

/* ---- through the engine ---- */

/* One request's run: its tokens (the first GOLDEN_MAX_GEN), the prompt
 * tokens it found cached, whether it ended. Zero it before submitting. */
#define GOLDEN_MAX_GEN 16
struct golden_result {
    int32_t tok[GOLDEN_MAX_GEN];
    int n, cached;
    bool done;
};

/* Waits until n requests whose user pointers are golden_results end. */
static inline void golden_collect(sched_engine *e, int n)
{
    struct sched_evbuf b;
    sched_evbuf_init(&b);
    int left = n;
    while (left > 0) {
        int k = sched_engine_wait(e, &b, 120.0);
        CHECK(k > 0);
        if (k <= 0) break;
        for (int i = 0; i < k; i++) {
            const struct sched_event *ev = &b.ev[i];
            struct golden_result *r = ev->user;
            if (ev->kind == SCHED_EV_TOKEN) {
                if (r->n < GOLDEN_MAX_GEN) r->tok[r->n++] = ev->token;
            } else {
                r->done = true;
                r->cached = ev->usage.cached_tokens;
                left--;
            }
        }
    }
    sched_evbuf_deinit(&b);
}

#endif

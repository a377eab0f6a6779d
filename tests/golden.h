/* golden.h - HF transformers goldens (tests/golden/make_goldens.py) for the
 * backend tests (tests/test_forward.c, tests/gpu/test_gpu_e2e.c): per prompt
 * the input ids, HF's top-TOPK logits at every position and its greedy
 * continuation.
 *
 *   struct golden g;
 *   if (golden_load(path, &g) == 0) { ...; golden_free(&g); }
 *
 * Include after tests/test.h.
 */
#ifndef SLUICE_TEST_GOLDEN_H
#define SLUICE_TEST_GOLDEN_H

#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "base/json.h"
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

#endif

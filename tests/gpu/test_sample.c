/* test_sample.c - cuda_sample (cuda/sample.cu) against model_sample() itself
 * (make gpu-test; needs a GPU). Every row is sampled twice from the same
 * logits, history, parameters and RNG state: by model_sample on the host and
 * by cuda_sample with u drawn by model_rng_uniform exactly when model_sample
 * draws it. Exact: token, top ids, status, the penalized logits bit for bit;
 * logprobs within 1e-5. Rows the device hands back (status 1) are finished as
 * the backend would (model_sample over the device's penalized logits with the
 * penalties off) and must give model_sample's answer exactly.
 */
#include <cuda_runtime.h>
#include <math.h>
#include <stdbool.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "cuda/kernels.h"
#include "model/model.h"
#include "tests/test.h"

_Static_assert(CUDA_SAMPLE_MAX_TOP == MODEL_MAX_TOP_LOGPROBS, "top logprob arrays differ");

static uint64_t g_rng = 0x2545f4914f6cdd1dULL;
static double urand(void) /* uniform in [0, 1) */
{
    g_rng ^= g_rng << 13, g_rng ^= g_rng >> 7, g_rng ^= g_rng << 17;
    return (double)(g_rng >> 11) * 0x1.0p-53;
}
static int irand(int n) { return (int)(urand() * n); }
static float gauss(void)
{
    double a = urand(), b = urand();
    return (float)(sqrt(-2.0 * log(1.0 - a)) * cos(6.283185307179586 * b));
}

enum kind { PEAKED, TIES, NEGINF, FEW, GAUSS, FLAT, NANROW, INFROW, ALLNEG };
static const char *kind_name[] = {"peaked", "ties", "neginf", "few", "gauss", "flat", "nan", "+inf", "all-inf"};

struct mix {
    float t, top_p, min_p, rep, pres, freq;
    int top_k, tl;
    enum kind kind;
};

static const struct mix greedy_mixes[] = {
    {0, 1, 0, 1, 0, 0, 0, 0, PEAKED},       {0, 1, 0, 1, 0, 0, 0, 5, PEAKED},
    {0, 1, 0, 1, 0, 0, 0, 20, TIES},        {0, 1, 0, 1.3f, 0, 0, 0, 20, PEAKED},
    {0.7f, 1, 0, 1, 0, 0, 1, 5, GAUSS},     {0, 1, 0, 1, 0, 0, 0, 20, NEGINF},
    {0, 1, 0, 1, 0, 0, 0, 20, FEW},         {0, 1, 0, 1, 0, 0, 0, 20, FLAT},
    {0, 0.5f, 0.05f, 1.3f, 0.5f, 0.3f, 40, 3, PEAKED},
};
static const struct mix other_mixes[] = {
    /* penalties */
    {0.7f, 0.9f, 0, 1.3f, 0, 0, 0, 5, PEAKED},
    {1.3f, 1, 0, 1.3f, 0.5f, 0.3f, 40, 0, PEAKED},
    {1.0f, 1, 0.05f, 1, 0.5f, 0.3f, 0, 20, PEAKED},
    {0.7f, 0.5f, 0, 1.3f, -0.4f, 0.8f, 0, 5, PEAKED},
    /* ties at the top_k / top_logprobs / nucleus cut */
    {0.7f, 1, 0, 1, 0, 0, 40, 20, TIES},
    {1.3f, 0.9f, 0, 1, 0, 0, 0, 5, TIES},
    {1.0f, 0.5f, 0.05f, 1, 0, 0, 0, 20, TIES},
    {1.0f, 1, 0, 1.3f, 0, 0, 0, 20, TIES},
    /* -inf entries */
    {0.7f, 0.9f, 0, 1, 0, 0, 0, 5, NEGINF},
    {1.3f, 1, 0.05f, 1.3f, 0, 0.3f, 40, 20, NEGINF},
    {1.0f, 1, 0, 1, 0, 0, 0, 0, NEGINF},
    /* three finite logits: top_k and top_logprobs beyond them */
    {1.0f, 0.5f, 0, 1, 0, 0, 40, 20, FEW},
    {0.7f, 1, 0, 1, 0, 0, 2, 20, FEW},
    {1.3f, 1, 0.05f, 1, 0, 0, 0, 5, FEW},
    /* wide rows */
    {0.7f, 0.5f, 0, 1, 0, 0, 0, 5, GAUSS},
    {1.3f, 1, 0.05f, 1, 0, 0, 0, 0, GAUSS},
    {0.7f, 1, 0, 1, 0, 0, 500, 5, GAUSS},
    {1.0f, 0.9f, 0, 1, 0, 0, 2000, 0, GAUSS},
    /* flat: all equal; the big vocabularies overflow the device's capacity */
    {1.0f, 0.9f, 0, 1, 0, 0, 0, 0, FLAT},
    {1.0f, 1, 0, 1, 0, 0, 40, 20, FLAT},
    {1.0f, 1, 0, 1, 0, 0, 3000, 0, FLAT},
    {0.7f, 0.9f, 0.05f, 1, 0, 0, 0, 5, FLAT},
    /* not finite: model_sample fails, the device says -1 */
    {1.0f, 0.9f, 0, 1.3f, 0, 0, 40, 5, NANROW},
    {0, 1, 0, 1, 0, 0, 0, 0, INFROW},
    {1.0f, 1, 0, 1, 0, 0, 0, 0, ALLNEG},
};

/* one row's logits by kind */
static void make_row(float *lg, int V, enum kind kind)
{
    int nb = 0; /* boosted ids: a peak that holds nearly all the mass */
    switch (kind) {
    case PEAKED:
    case NEGINF:
    case NANROW:
    case INFROW: {
        static const int bs[] = {5, 100, 1000};
        nb = bs[irand(3)];
        if (nb > V / 4) nb = V / 4 > 0 ? V / 4 : 1;
        for (int i = 0; i < V; i++) lg[i] = 2.0f * gauss();
        for (int j = 0; j < nb; j++) lg[irand(V)] = 20.0f + 1.5f * gauss();
        break;
    }
    case TIES:
        nb = 300 > V / 4 ? (V / 4 > 0 ? V / 4 : 1) : 300;
        for (int i = 0; i < V; i++) lg[i] = floorf(2.0f * gauss());
        for (int j = 0; j < nb; j++) lg[irand(V)] = 15.0f + floorf(gauss());
        break;
    case FEW:
        for (int i = 0; i < V; i++) lg[i] = -INFINITY;
        for (int j = 0; j < 3; j++) lg[irand(V)] = 2.0f * gauss();
        break;
    case GAUSS:
        for (int i = 0; i < V; i++) lg[i] = 3.0f * gauss();
        break;
    case FLAT:
        for (int i = 0; i < V; i++) lg[i] = 0.5f;
        break;
    case ALLNEG:
        for (int i = 0; i < V; i++) lg[i] = -INFINITY;
        break;
    }
    if (kind == NEGINF)
        for (int i = 0; i < V; i++)
            if (urand() < 0.3) lg[i] = -INFINITY;
    if (kind == NANROW) lg[irand(V)] = NAN;
    if (kind == INFROW) lg[irand(V)] = INFINITY;
}

/* logprobs agree: within 1e-5, or the same infinity */
static bool lp_close(float a, float b) { return a == b || fabsf(a - b) <= 1e-5f; }

static int cmp_desc(const void *a, const void *b)
{
    double x = *(const double *)a, y = *(const double *)b;
    return (x < y) - (x > y);
}

/* What status the device may give this row (penalized logits pl): 0, 1, -1,
 * or 2 for "0 or 1" (the nucleus is near the capacity, where the device's
 * margin decides). */
static int expected_status(const float *pl, int V, const struct model_sampling *s, int rc)
{
    if (rc != 0) return -1;
    if (!(s->temperature > 0.0f && s->top_k != 1)) return 0;
    int nc = 0;
    for (int i = 0; i < V; i++) nc += pl[i] > -INFINITY;
    if (s->top_k > 0 && s->top_k < nc) return s->top_k > CUDA_SAMPLE_CAP ? 1 : 0;
    if (!(s->top_p < 1.0f)) return 0;
    float inv_t = 1.0f / s->temperature, mx = -INFINITY;
    double *v = malloc((size_t)V * sizeof *v);
    int n = 0;
    for (int i = 0; i < V; i++)
        if (pl[i] > -INFINITY) {
            v[n++] = pl[i] * inv_t;
            if (pl[i] > mx) mx = pl[i];
        }
    double cmx = mx * inv_t, z = 0.0, cum = 0.0;
    qsort(v, (size_t)n, sizeof *v, cmp_desc);
    for (int i = 0; i < n; i++) z += exp(v[i] - cmx);
    int keep = n;
    for (int i = 0; i < n; i++) {
        cum += exp(v[i] - cmx) / z;
        if (cum >= s->top_p) {
            keep = i + 1;
            break;
        }
    }
    int need = 0;
    for (int i = 0; i < n; i++) need += v[i] >= v[keep - 1];
    if (s->min_p > 0.0f) {
        double lim = (float)((float)cmx + logf(s->min_p));
        int m = 0;
        for (int i = 0; i < n; i++) m += v[i] >= lim;
        if (m < need) need = m;
    }
    free(v);
    return need <= CUDA_SAMPLE_CAP / 2 ? 0 : need > CUDA_SAMPLE_CAP ? 1 : 2;
}

static int n_status[3]; /* rows the device answered: [0] done, [1] handed back, [2] not finite */

static void run_vocab(int V)
{
    const int n_g = sizeof greedy_mixes / sizeof greedy_mixes[0], n_o = sizeof other_mixes / sizeof other_mixes[0];
    enum { GRID = 24 }; /* t {0.7, 1.3} x top_k {0, 40} x top_p {1, 0.9, 0.5} x min_p {0, 0.05} */
    const int R = n_g + GRID + n_o, NP = 40, NH = 65;
    struct mix *mx = malloc((size_t)R * sizeof *mx);
    int r = 0;
    for (int i = 0; i < n_g; i++) mx[r++] = greedy_mixes[i];
    static const float ts[] = {0.7f, 1.3f}, ps[] = {1.0f, 0.9f, 0.5f}, mps[] = {0.0f, 0.05f};
    static const int ks[] = {0, 40}, tls[] = {0, 5, 20};
    for (int g = 0; g < GRID; g++)
        mx[r++] = (struct mix){ts[g % 2], ps[(g / 4) % 3], mps[g / 12], 1, 0, 0, ks[(g / 2) % 2], tls[g % 3], PEAKED};
    for (int i = 0; i < n_o; i++) mx[r++] = other_mixes[i];

    float *lg = malloc((size_t)R * V * 4), *ref = malloc((size_t)R * V * 4), *dev = malloc((size_t)R * V * 4);
    int32_t *hist = malloc((size_t)R * NH * 4), *mark = calloc((size_t)V, 4);
    struct cuda_sample_pen *pen = malloc((size_t)R * NH * sizeof *pen);
    struct cuda_sample_row *rows = calloc((size_t)R, sizeof *rows);
    struct cuda_sample_out *out = malloc((size_t)R * sizeof *out);
    struct model_sample_out *want = malloc((size_t)R * sizeof *want);
    struct model_sampling *sp = malloc((size_t)R * sizeof *sp);
    uint64_t *rng0 = malloc((size_t)R * 8);
    int *rc = malloc((size_t)R * sizeof *rc);
    void *scratch = malloc(model_sample_scratch_bytes(V));
    int n_pen = 0;

    for (r = 0; r < R; r++) {
        float *row = lg + (size_t)r * V;
        make_row(row, V, mx[r].kind);
        /* history: half of it among the row's best ids, with repeats */
        int32_t *h = hist + (size_t)r * NH;
        for (int i = 0; i < NH; i++) {
            if (i > 0 && urand() < 0.3) {
                h[i] = h[irand(i)];
            } else if (urand() < 0.5) {
                int b = irand(V);
                for (int j = 0; j < 8; j++) {
                    int c = irand(V);
                    if (row[c] > row[b]) b = c;
                }
                h[i] = b;
            } else {
                h[i] = irand(V);
            }
        }
        struct model_sampling *s = &sp[r];
        model_sampling_default(s);
        s->temperature = mx[r].t, s->top_p = mx[r].top_p, s->min_p = mx[r].min_p, s->top_k = mx[r].top_k;
        s->repetition_penalty = mx[r].rep, s->presence_penalty = mx[r].pres, s->frequency_penalty = mx[r].freq;
        s->top_logprobs = mx[r].tl;
        s->seed = 1000u + (uint64_t)r * 7919u + (uint64_t)V;
        rng0[r] = model_rng_seed(s->seed);
        for (int i = 0; i < 20; i++) model_rng_uniform(&rng0[r]); /* a request some tokens in */

        struct cuda_sample_row *w = &rows[r];
        uint64_t st = rng0[r];
        w->u = s->temperature > 0.0f && s->top_k != 1 ? model_rng_uniform(&st) : 0.0;
        w->temperature = s->temperature, w->top_p = s->top_p, w->min_p = s->min_p;
        w->log_min_p = s->min_p > 0.0f ? logf(s->min_p) : 0.0f;
        w->repetition_penalty = s->repetition_penalty, w->presence_penalty = s->presence_penalty;
        w->frequency_penalty = s->frequency_penalty, w->top_k = s->top_k, w->top_logprobs = s->top_logprobs;
        w->pen_off = n_pen;
        w->n_pen = cuda_sample_pen_build(h, NP, NH, mark, pen + n_pen);
        n_pen += w->n_pen;

        /* the reference */
        float *rr = ref + (size_t)r * V;
        memcpy(rr, row, (size_t)V * 4);
        uint64_t rs = rng0[r];
        rc[r] = model_sample(rr, V, s, h, NP, NH, &rs, scratch, &want[r]);
        CHECKF(rc[r] != 0 || rs == st, "V=%d row %d: model_sample drew %s than the host did", V, r,
               rs == rng0[r] ? "less" : "differently");
    }
    for (int i = 0; i < V; i++)
        if (mark[i]) {
            CHECKF(0, "cuda_sample_pen_build left mark[%d] set", i);
            break;
        }

    float *dlg = NULL;
    struct cuda_sample_row *drows = NULL;
    struct cuda_sample_pen *dpen = NULL;
    struct cuda_sample_out *dout = NULL;
    if (cudaMalloc((void **)&dlg, (size_t)R * V * 4) || cudaMalloc((void **)&drows, (size_t)R * sizeof *rows) ||
        cudaMalloc((void **)&dpen, (size_t)(n_pen + 1) * sizeof *pen) ||
        cudaMalloc((void **)&dout, (size_t)R * sizeof *out)) {
        CHECKF(0, "cudaMalloc failed");
        return;
    }
    cudaMemcpy(dlg, lg, (size_t)R * V * 4, cudaMemcpyHostToDevice);
    cudaMemcpy(drows, rows, (size_t)R * sizeof *rows, cudaMemcpyHostToDevice);
    cudaMemcpy(dpen, pen, (size_t)n_pen * sizeof *pen, cudaMemcpyHostToDevice);
    cudaMemset(dout, 0xff, (size_t)R * sizeof *out); /* NaN / -1 everywhere: unwritten fields fail */
    CHECK(cuda_sample(dlg, R, V, drows, dpen, dout, 0) == cudaSuccess);
    cudaError_t e = cudaDeviceSynchronize();
    CHECKF(e == cudaSuccess, "V=%d: %s", V, cudaGetErrorString(e));
    cudaMemcpy(dev, dlg, (size_t)R * V * 4, cudaMemcpyDeviceToHost);
    cudaMemcpy(out, dout, (size_t)R * sizeof *out, cudaMemcpyDeviceToHost);

    for (r = 0; r < R; r++) {
        const float *dr = dev + (size_t)r * V, *rr = ref + (size_t)r * V;
        const struct cuda_sample_out *o = &out[r];
        const struct model_sample_out *w = &want[r];
        char what[256];
        snprintf(what, sizeof what, "V=%d row %d (%s t=%g k=%d p=%g min_p=%g rep=%g pres=%g freq=%g tl=%d)", V, r,
                 kind_name[mx[r].kind], mx[r].t, mx[r].top_k, mx[r].top_p, mx[r].min_p, mx[r].rep, mx[r].pres,
                 mx[r].freq, mx[r].tl);
        int bad = -1;
        for (int i = 0; i < V && bad < 0; i++)
            if (memcmp(&dr[i], &rr[i], 4) && !(isnan(dr[i]) && isnan(rr[i]))) bad = i;
        CHECKF(bad < 0, "%s: penalized logit %d: device %.9g, host %.9g", what, bad, bad < 0 ? 0 : dr[bad],
               bad < 0 ? 0 : rr[bad]);
        int ex = expected_status(rr, V, &sp[r], rc[r]);
        CHECKF(o->status == ex || (ex == 2 && (o->status == 0 || o->status == 1)), "%s: status %d, expected %d", what,
               o->status, ex);
        if (o->status == -1) {
            n_status[2]++;
            CHECKF(rc[r] != 0, "%s: device says not finite, model_sample returned %d", what, rc[r]);
            continue;
        }
        if (rc[r] != 0) continue; /* already reported */
        struct model_sample_out fb = {0};
        if (o->status == 1) { /* what the backend does with it */
            n_status[1]++;
            struct model_sampling s = sp[r];
            s.repetition_penalty = 1.0f, s.presence_penalty = 0.0f, s.frequency_penalty = 0.0f;
            float *row = malloc((size_t)V * 4);
            memcpy(row, dr, (size_t)V * 4);
            uint64_t rs = rng0[r];
            CHECK(model_sample(row, V, &s, NULL, 0, 0, &rs, scratch, &fb) == 0);
            free(row);
            o = NULL;
        } else {
            n_status[0]++;
        }
        int tok = o ? o->token : fb.token, n_top = o ? o->n_top : fb.n_top;
        float lp = o ? o->logprob : fb.logprob;
        const int32_t *ids = o ? o->top_ids : fb.top_ids;
        const float *tlp = o ? o->top_logprobs : fb.top_logprobs;
        CHECKF(tok == w->token, "%s: token %d, model_sample %d", what, tok, w->token);
        CHECKF(lp_close(lp, w->logprob), "%s: logprob %.8g, model_sample %.8g", what, lp, w->logprob);
        CHECKF(n_top == w->n_top, "%s: n_top %d, model_sample %d", what, n_top, w->n_top);
        for (int i = 0; i < w->n_top && n_top == w->n_top; i++) {
            CHECKF(ids[i] == w->top_ids[i], "%s: top %d id %d, model_sample %d", what, i, ids[i], w->top_ids[i]);
            CHECKF(lp_close(tlp[i], w->top_logprobs[i]), "%s: top %d logprob %.8g, model_sample %.8g", what,
                   i, tlp[i], w->top_logprobs[i]);
        }
    }
    cudaFree(dlg), cudaFree(drows), cudaFree(dpen), cudaFree(dout);
    free(mx), free(lg), free(ref), free(dev), free(hist), free(mark), free(pen), free(rows), free(out);
    free(want), free(sp), free(rng0), free(rc), free(scratch);
}

static void test_sample_v17(void) { run_vocab(17); }
static void test_sample_v1000(void) { run_vocab(1000); }
static void test_sample_v49152(void) { run_vocab(49152); }
static void test_sample_v151936(void) { run_vocab(151936); }

/* The same rows many times over: the device must give the same answer every
 * time (no race in the reductions, the gathers or the sort). */
static void test_sample_repeatable(void)
{
    const int R = 64, V = 49152;
    float *lg = malloc((size_t)R * V * 4);
    struct cuda_sample_row *rows = calloc((size_t)R, sizeof *rows);
    for (int r = 0; r < R; r++) {
        make_row(lg + (size_t)r * V, V, r % 2 ? TIES : PEAKED);
        rows[r] = (struct cuda_sample_row){.u = urand(), .temperature = 1.0f, .top_p = r % 3 ? 0.9f : 1.0f,
                                           .min_p = 0.0f, .repetition_penalty = 1.0f, .top_k = r % 4 ? 0 : 40,
                                           .top_logprobs = 20};
    }
    float *dlg = NULL;
    struct cuda_sample_row *drows = NULL;
    struct cuda_sample_out *dout = NULL, *first = malloc((size_t)R * sizeof *first),
                           *again = malloc((size_t)R * sizeof *again);
    if (cudaMalloc((void **)&dlg, (size_t)R * V * 4) || cudaMalloc((void **)&drows, (size_t)R * sizeof *rows) ||
        cudaMalloc((void **)&dout, (size_t)R * sizeof *first)) {
        CHECKF(0, "cudaMalloc failed");
        return;
    }
    cudaMemcpy(dlg, lg, (size_t)R * V * 4, cudaMemcpyHostToDevice);
    cudaMemcpy(drows, rows, (size_t)R * sizeof *rows, cudaMemcpyHostToDevice);
    int diff = 0;
    for (int it = 0; it < 20; it++) {
        cudaMemset(dout, 0xff, (size_t)R * sizeof *first);
        CHECK(cuda_sample(dlg, R, V, drows, NULL, dout, 0) == cudaSuccess);
        cudaMemcpy(it ? again : first, dout, (size_t)R * sizeof *first, cudaMemcpyDeviceToHost);
        if (it) diff += memcmp(first, again, (size_t)R * sizeof *first) != 0;
    }
    CHECKF(diff == 0, "%d of 19 reruns differ", diff);
    int done = 0;
    for (int r = 0; r < R; r++) done += first[r].status == 0;
    CHECKF(done == R, "%d of %d rows done on the device", done, R);
    cudaFree(dlg), cudaFree(drows), cudaFree(dout);
    free(lg), free(rows), free(first), free(again);
}

int main(void)
{
    int n = 0;
    if (cudaGetDeviceCount(&n) != cudaSuccess || n == 0) {
        printf("no GPU: skipped\n0 passed, 0 failed\n");
        return 0;
    }
    RUN(test_sample_v17);
    RUN(test_sample_v1000);
    RUN(test_sample_v49152);
    RUN(test_sample_v151936);
    RUN(test_sample_repeatable);
    printf("rows: %d done on the device, %d handed to the host, %d not finite\n", n_status[0], n_status[1],
           n_status[2]);
    return test_summary();
}

/* test_glm5_layers.c - glm5_next on the GPU backend layer by layer: every
 * layer's hidden state (all 4 hyper-connection streams of every token),
 * not only the logits, against the CPU backend and against transformers
 * (make gpu-test; needs a GPU). The residual is where a wrong stream
 * poisons every later layer while the logits may still look plausible.
 *
 * For each tiny checkpoint of tests/models/glm5 (glm5-mla: 3 MLA layers
 * with the DSA indexer, dense + MoE FFNs; glm5-hybrid: 3 KDA layers and an
 * MLA one; glm5-mixed: glm5-hybrid in the seed's int4/int8/bf16 scheme), the
 * 70-token prompt of golden.json (past one 64-token KDA chunk): its first 66
 * tokens prefilled in one step, then its last 4 decoded one token a step
 * as generated tokens (past n_prompt: MLA's absorbed form),
 * on the CPU backend and on the GPU backend (enforce_eager; the trace of
 * cuda_backend_trace and cpu_backend_trace: the streams after the
 * embedding and after every layer). Per layer entry, the largest |gpu -
 * cpu| over the step's tokens and streams relative to the CPU's largest
 * value must stay within bf16 tolerance (tol, per model: see main; each
 * entry printed), and
 * where the checkpoint has transformers' streams (hidden.f32 at some
 * positions of that prompt) the GPU's against them too; each step's last
 * logits against the CPU's.
 *
 * Routing flips: these checkpoints have MoE layers and the DSA indexer,
 * whose choices (experts; the top-K keys or k-pools) have near-ties on
 * random weights (router margins of 0.4% and indexer margins of 0.05% on
 * the 66-token prompt), which bf16 activations tip the other way; a flipped
 * choice moves that token's streams by 0.1-0.4 and, through attention, every
 * later token's. So, as test_gpu_e2e does for MoE models, the check ends at
 * the first token beyond tolerance in any layer entry (a suspected flip):
 * every layer entry of the tokens before it is checked, the tokens after it
 * (and the later decode steps) are reported only. The flip must be
 * explained: the CPU backend reports every token's routing margin
 * (cpu_backend_route_margins), and the first token beyond tolerance, or
 * an earlier one whose entries moved more than tol / 2, must have a margin
 * under ROUTE_TIE (test_gpu_e2e.c says where that comes from), else the
 * token must be at or past index_topk on a model with the DSA indexer (an
 * indexer flip; then at least a quarter of the prompt must come before it).
 * The first token must be within tolerance. So a broken layer (wrong from
 * the first token, or at a token where no choice is close) still fails.
 * --tp=N runs the GPU at TP=N (every
 * rank holds all streams; rank 0's are traced); a creation refused naming
 * --tensor-parallel-size (a kind not split yet) is noted, not failed.
 */
#include <limits.h>
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>

#include "base/json.h"
#include "cuda/hc.h"
#include "model/backend.h"
#include "model/cpu_internal.h"
#include "model/model.h"
#include "tests/golden.h"
#include "tests/test.h"

#define BLOCK 16
#define REGION 8  /* blocks: 128 positions */
#define DECODE 4  /* the prompt's last tokens, one a step */
#define ROUTE_TIE 0.05 /* router-logit units: a margin bf16 may flip (test_gpu_e2e.c) */

static int g_tp = 1;

static model_backend *make(model *m, const char *dev, char *err, size_t errlen)
{
    struct model_backend_opts bo = {.device = dev, .n_threads = 2, .max_tokens_per_step = 128,
                                    .max_seqs_per_step = 8, .max_ctx = REGION * BLOCK, .enforce_eager = true,
                                    .tensor_parallel_size = strcmp(dev, "cuda") ? 0 : g_tp};
    model_backend *be = model_backend_create(m, &bo, err, errlen);
    if (!be) return NULL;
    if (be->ops->kv_alloc(be, REGION, BLOCK, err, errlen) ||
        (be->ops->state_slot_bytes && be->ops->state_slot_bytes(be) > 0 && be->ops->state_alloc(be, 1, err, errlen))) {
        model_backend_destroy(be);
        return NULL;
    }
    return be;
}

/* One sequence (state slot 0), tokens start .. start + n - 1 of ids, a prompt of n_prompt tokens; the
 * last one's logits into lg. */
static int step(model_backend *be, const int32_t *ids, int n_prompt, int start, int n, float *lg, char *err,
                size_t errlen)
{
    int32_t pos[128], bt[REGION];
    int64_t slots[128];
    for (int j = 0; j < REGION; j++) bt[j] = REGION - 1 - j; /* not in order */
    for (int t = 0; t < n; t++) {
        pos[t] = start + t;
        slots[t] = (int64_t)bt[pos[t] / BLOCK] * BLOCK + pos[t] % BLOCK;
    }
    struct step_seq sq = {.query_start = 0, .query_len = n, .context_len = start + n, .block_table = bt,
                          .n_blocks = REGION, .logits_out = lg, .history = ids, .n_prompt = n_prompt,
                          .n_history = start + n, .state_slot = 0};
    struct step st = {.n_tokens = n, .token_ids = ids + start, .positions = pos, .slots = slots, .n_seqs = 1,
                      .seqs = &sq};
    return be->ops->forward(be, &st, err, errlen);
}

/* the largest |b| over n values (1 when all are 0) */
static double peak(const float *b, size_t n)
{
    double den = 0;
    for (size_t i = 0; i < n; i++) den = fabs(b[i]) > den ? fabs(b[i]) : den;
    return den > 0 ? den : 1;
}

/* the largest |a - b| over n values relative to den; a NaN in a: infinity */
static double dev(const float *a, const float *b, size_t n, double den)
{
    double num = 0;
    for (size_t i = 0; i < n; i++) {
        if (isnan(a[i])) return INFINITY;
        double d = fabs((double)a[i] - b[i]);
        num = d > num ? d : num;
    }
    return num / den;
}

static double rel(const float *a, const float *b, size_t n)
{
    double num = 0, den = 0;
    for (size_t i = 0; i < n; i++) {
        if (isnan(a[i])) return INFINITY;
        double d = fabs((double)a[i] - b[i]);
        num = d > num ? d : num;
        den = fabs(b[i]) > den ? fabs(b[i]) : den;
    }
    return num / (den > 0 ? den : 1);
}

/* transformers' streams (hidden.f32): [layers + 1][np][hc][E] at positions pos[np] of the prompt */
struct hf_hidden {
    float *v;
    int32_t pos[64];
    int np;
};

static void load_hf(const char *dir, int nl, int hc, int E, struct hf_hidden *h)
{
    char path[300];
    size_t len, hlen;
    memset(h, 0, sizeof *h);
    snprintf(path, sizeof path, "%s/hidden.json", dir);
    char *src = test_slurp(path, &len);
    if (!src) return; /* glm5-mixed has none: the CPU alone is the reference */
    json_doc d;
    char jerr[128];
    if (json_parse(&d, src, len, jerr, sizeof jerr) == 0) {
        h->np = read_ints(&d, json_get(&d, 0, "positions"), h->pos, 64);
        json_free(&d);
    }
    free(src);
    snprintf(path, sizeof path, "%s/hidden.f32", dir);
    h->v = (float *)test_slurp(path, &hlen);
    CHECKF(h->v && hlen == (size_t)nl * h->np * hc * E * sizeof(float), "%s: unexpected size", path);
    if (h->v && hlen != (size_t)nl * h->np * hc * E * sizeof(float)) {
        free(h->v);
        h->v = NULL;
    }
}

/* The smallest routing margin of token t of a step of n tokens (margins [n_layer][n]). */
static float tok_margin(const float *m, int L, int n, int t)
{
    float r = INFINITY;
    for (int l = 0; l < L; l++) r = m[(size_t)l * n + t] < r ? m[(size_t)l * n + t] : r;
    return r;
}

static void run(const char *name, double tol)
{
    char dir[200], gold[240], err[512];
    snprintf(dir, sizeof dir, "tests/models/glm5/%s", name);
    snprintf(gold, sizeof gold, "%s/golden.json", dir);
    struct stat sb;
    struct golden g;
    if (stat(gold, &sb) != 0 || golden_load(gold, &g) != 0) {
        printf("note: %s absent, skipped\n", gold);
        return;
    }
    model *m = model_load(dir, NULL, err, sizeof err);
    CHECKF(m != NULL, "%s: %s", dir, err);
    if (!m) {
        golden_free(&g);
        return;
    }
    const struct model_config *c = model_get_config(m);
    int E = c->n_embd, hc = c->hc.mult > 0 ? c->hc.mult : 1, L1 = c->n_layer + 1, V = c->n_vocab;
    const struct prompt *p = &g.p[g.np - 1]; /* the longest */
    for (int i = 0; i < g.np; i++)
        if (g.p[i].n > p->n) p = &g.p[i];
    printf("%s: %d layers, %d streams, a %d-token prompt (%d prefilled, %d decoded), GPU at TP=%d\n", name,
           c->n_layer, hc, p->n, p->n - DECODE, DECODE, g_tp);
    if (model_tp_check(c, g_tp, err, sizeof err)) {
        printf("note: %s skipped at TP=%d: %s\n", name, g_tp, err);
        model_free(m);
        golden_free(&g);
        return;
    }
    model_backend *cpu = make(m, "cpu", err, sizeof err);
    CHECKF(cpu != NULL, "cpu backend: %s", err);
    model_backend *gpu = cpu ? make(m, "cuda", err, sizeof err) : NULL;
    if (cpu && !gpu && g_tp > 1 && strstr(err, "tensor-parallel")) {
        /* a kind without its TP split yet must say so at creation: allowed, noted */
        printf("note: %s refused at TP=%d: %s\n", name, g_tp, err);
    } else {
        CHECKF(gpu != NULL, "cuda backend: %s", err);
    }
    struct hf_hidden hf;
    load_hf(dir, L1, hc, E, &hf);
    size_t per = (size_t)(p->n - DECODE) * hc * E; /* one entry of the prefill's trace */
    float *tc = malloc(L1 * per * sizeof *tc), *tg = malloc(L1 * per * sizeof *tg);
    float *lc = malloc((size_t)V * 4), *lg = malloc((size_t)V * 4);
    float *mg = malloc((size_t)c->n_layer * (p->n - DECODE) * sizeof *mg);
    float *pm = malloc((size_t)p->n * sizeof *pm); /* each position's margin, where it moved (else INFINITY) */
    for (int i = 0; i < p->n; i++) pm[i] = INFINITY;
    bool flipped = false; /* a step before this one had a suspected flip: report only */
    int ix0 = INT_MAX;    /* the first position where the DSA indexer chooses */
    for (int l = 0; l < c->n_layer && c->mla.index_topk > 0; l++)
        if (model_layer_kind_of(c, l).mixer == MODEL_MIXER_MLA) ix0 = c->mla.index_topk;
    for (int k = 0; cpu && gpu && k <= DECODE; k++) {
        int start = k ? p->n - DECODE + k - 1 : 0, n = k ? 1 : p->n - DECODE;
        size_t e1 = (size_t)n * hc * E;
        memset(tg, 0xff, L1 * e1 * sizeof *tg); /* NaN: an entry never written fails */
        cpu_backend_trace(cpu, tc);
        cpu_backend_route_margins(cpu, mg);
        cuda_backend_trace(gpu, tg);
        int rc = step(cpu, p->ids, p->n - DECODE, start, n, lc, err, sizeof err);
        CHECKF(rc == 0, "cpu step: %s", err);
        if (!rc) rc = step(gpu, p->ids, p->n - DECODE, start, n, lg, err, sizeof err);
        CHECKF(rc == 0, "cuda step: %s", err);
        cpu_backend_trace(cpu, NULL);
        cpu_backend_route_margins(cpu, NULL);
        cuda_backend_trace(gpu, NULL);
        if (rc) break;
        double worst = 0, worst_hf = 0;
        int wl = 0;
        printf("  %s %d..%d: per layer entry vs CPU", k ? "decode" : "prefill", start, start + n - 1);
        for (int l = 0; l < L1; l++) {
            double e = rel(tg + l * e1, tc + l * e1, e1);
            printf(" %.2e", e);
            if (e > worst) worst = e, wl = l;
        }
        /* the first token beyond tolerance in any layer entry (each entry's
         * deviation relative to the CPU's largest value of the whole step) */
        int tf = n;
        for (int t = 0; t < n && tf == n; t++) {
            double wt = 0; /* token t's worst entry */
            for (int l = 0; l < L1; l++) {
                size_t o = l * e1 + (size_t)t * hc * E;
                double d = dev(tg + o, tc + o, (size_t)hc * E, peak(tc + l * e1, e1));
                wt = d > wt ? d : wt;
            }
            pm[start + t] = wt > tol / 2 ? tok_margin(mg, c->n_layer, n, t) : INFINITY;
            if (wt > tol) tf = t;
        }
        double wb = 0; /* the worst over the tokens before tf */
        for (int l = 0; l < L1 && tf > 0; l++) {
            double e = dev(tg + l * e1, tc + l * e1, (size_t)tf * hc * E, peak(tc + l * e1, e1));
            wb = e > wb ? e : wb;
        }
        /* transformers' streams at the positions this step holds, before tf */
        for (int l = 0; l < L1; l++)
            for (int i = 0; hf.v && i < hf.np; i++) {
                int t = hf.pos[i] - start;
                if (t < 0 || t >= tf) continue;
                double eh = rel(tg + l * e1 + (size_t)t * hc * E, hf.v + ((size_t)l * hf.np + i) * hc * E,
                                (size_t)hc * E);
                worst_hf = eh > worst_hf ? eh : worst_hf;
            }
        double el = rel(lg, lc, V);
        printf("; vs HF %.2e; last logits vs CPU %.2e\n", worst_hf, el);
        if (flipped) {
            printf("    (after a suspected flip: reported only)\n");
            continue;
        }
        if (tf < n) {
            /* what explains it: a routing near-tie at or before it (a moved token), else the indexer */
            int q = -1;
            for (int i = 0; i <= start + tf; i++)
                if (pm[i] < ROUTE_TIE && (q < 0 || pm[i] < pm[q])) q = i;
            printf("    suspected flip at position %d (layer entries up to %.3g in the step); %d of %d tokens checked, "
                   "within %.2e; ", start + tf, worst, tf, n, wb);
            if (q >= 0)
                printf("a routing near-tie at position %d (margin %.4f < %.2f)\n", q, pm[q], ROUTE_TIE);
            else
                printf("%s\n", start + tf >= ix0 ? "the indexer chooses there" : "no near-tie, no indexer choice");
            CHECKF(start + tf > 0, "%s step %d: the first token is beyond tolerance: not a flip", name, k);
            CHECKF(q >= 0 || start + tf >= ix0,
                   "%s step %d: position %d beyond tolerance with every routing margin clear and no indexer choice: "
                   "not a flip", name, k, start + tf);
            CHECKF(q >= 0 || k > 0 || tf * 4 >= n, "%s: only %d of %d prompt tokens before the first (indexer) flip",
                   name, tf, n);
            flipped = true;
            continue;
        }
        CHECKF(worst <= tol, "%s step %d: layer entry %d's streams differ from the CPU's by %.3g", name, k, wl, worst);
        CHECKF(worst_hf <= tol, "%s step %d: streams differ from transformers' by %.3g", name, k, worst_hf);
        CHECKF(el <= tol, "%s step %d: logits differ from the CPU's by %.3g", name, k, el);
    }
    free(tc), free(tg), free(lc), free(lg), free(hf.v), free(mg), free(pm);
    model_backend_destroy(gpu);
    model_backend_destroy(cpu);
    model_free(m);
    golden_free(&g);
}

/* Tolerances: bf16 activations through a few layers. On the CPU with every
 * tensor the GPU keeps in bf16 rounded so (test_gpu_e2e.c's GLM5_TOL), the
 * 66-token prefill's worst layer entry before any routing flip and before
 * the indexer chooses (position 16) was 1.5e-2 on glm5-mla, 5.7e-2 on
 * glm5-hybrid and 8.6e-2 on glm5-mixed; with gate|up in bf16 as the GPU had
 * them then, 6.4e-2 at glm5-hybrid's position 1 and 9.4e-2 at glm5-mixed's
 * position 2, where the first H100 run saw its "flips" (these, not
 * routing: no expert was chosen otherwise before position 28). A routing
 * flip moved a token's entries by 0.14 to 0.73. */
static void test_glm5_mla(void) { run("glm5-mla", 5e-2); }
static void test_glm5_hybrid(void) { run("glm5-hybrid", 0.11); }
static void test_glm5_mixed(void) { run("glm5-mixed", 0.11); }

int main(int argc, char **argv)
{
    for (int i = 1; i < argc; i++) {
        if (!strncmp(argv[i], "--tp=", 5) && atoi(argv[i] + 5) >= 1) {
            g_tp = atoi(argv[i] + 5);
        } else {
            fprintf(stderr, "usage: %s [--tp=N]\n", argv[0]);
            return 2;
        }
    }
    if (!model_cuda_available()) {
        printf("no GPU: skipped\n0 passed, 0 failed\n");
        return 0;
    }
    RUN(test_glm5_mla);
    RUN(test_glm5_hybrid);
    RUN(test_glm5_mixed);
    return test_summary();
}

/* bench_mtp.c - what speculation with MTP drafts costs a step on the GPU
 * backend (not a test), at a dummy-weight MLA + MoE shape with one MTP layer
 * (default tools/configs/deepseek-v2-lite-mtp: DeepSeek-V2-Lite's sizes,
 * num_nextn_predict_layers 1), batches 1 and 8 at 1K context each:
 *
 *   decode        a plain decode step (a backend without the MTP layer);
 *   sub-step      a decode step with the MTP layer on and no drafts
 *                 (max_draft_tokens 0): the step and its MTP sub-step;
 *   verify K      a step verifying K drafts a sequence (K = 1..3; the MTP
 *                 layer off): the main model's share of speculation;
 *   verify K+MTP  the same step with the MTP layer on (max_draft_tokens K):
 *                 the step, its sub-step and K drafts a sequence made on the
 *                 device after it, then ops->mtp_draft handing them out: the
 *                 whole of a speculative step (the target: <= 1.3x
 *                 decode).
 *
 * Each figure is the median wall time of 30 forward() calls (each ends in a
 * stream sync; with the MTP layer on, mtp_draft included) after 5, with the
 * ratio to decode at that batch. Drafts are random tokens (the dummy MTP
 * layer's acceptance is meaningless): the cost does not depend on them.
 *
 * A model without an MTP layer (e.g. tools/configs/llama-3.1-8b) gets the
 * decode and verify K columns alone: what a step verifying n-gram drafts
 * costs (drafts from anywhere cost the same).
 *
 *   build/tests/gpu/bench_mtp [--enforce-eager] [--ctx=N] [--tp=N] [--device=cpu] [config_dir] [tokenizer]
 *   (defaults: tools/configs/deepseek-v2-lite-mtp, tests/models/tiny-qwen3; tokenizer "-": the model's
 *   own; --ctx: the context, up to 1024; --tp: N GPUs, tensor parallel; --device=cpu: a dry run of the
 *   driver on a tiny model)
 */
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

#include <cuda_runtime.h>

#include "model/backend.h"

#define BS 16
#define CTXMAX 1024
#define NSEQ 8
#define KMAX 3
#define CTXB ((CTXMAX + 2 * KMAX + 2 + BS - 1) / BS + 1) /* blocks a sequence holds */
#define RUNS 30
#define WARM 5

static int CTX = CTXMAX;           /* --ctx */
static int g_tp = 1;               /* --tp */
static const char *g_dev = "cuda"; /* --device */

static double now_s(void)
{
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return ts.tv_sec + ts.tv_nsec * 1e-9;
}

static int cmp_d(const void *a, const void *b)
{
    double x = *(const double *)a, y = *(const double *)b;
    return x < y ? -1 : x > y;
}

static char err[512];
static int g_V;
static int32_t g_bt[NSEQ][CTXB];
static int32_t g_hist[NSEQ][CTXMAX + 2 * KMAX + 2];
static struct model_sampling g_greedy;

static uint32_t rnd(void)
{
    static uint64_t r = 88172645463325252ull;
    r ^= r << 13, r ^= r >> 7, r ^= r << 17;
    return (uint32_t)(r >> 11);
}

/* One step of sequences i0 .. i0 + ns - 1 from position start: each its
 * last token and k drafts (verified when k > 0), or a prompt of len tokens
 * when len > 0 (not sampled). With mtp, the drafts are then asked as the
 * engine asks them (k from the accepted position). Returns the wall time of
 * forward() (and mtp_draft), or -1 on failure. */
static double step(model_backend *be, int i0, int ns, int start, int k, int len, bool mtp)
{
    static int32_t ids[NSEQ * CTXMAX], pos[NSEQ * CTXMAX];
    static int64_t slots[NSEQ * CTXMAX];
    static struct model_sample_out so[NSEQ][KMAX + 1];
    static int32_t drafts[NSEQ][KMAX];
    struct step_seq sq[NSEQ];
    struct model_mtp_req rq[NSEQ];
    int T = 0, n = len > 0 ? len : 1 + k;
    for (int s = 0; s < ns; s++) {
        int i = i0 + s;
        for (int j = 0; j < n; j++) g_hist[i][start + j] = (int32_t)(rnd() % (uint32_t)g_V);
        sq[s] = (struct step_seq){.query_start = T, .query_len = n, .context_len = start + n,
                                  .block_table = g_bt[i], .n_blocks = CTXB, .want_sample = len == 0,
                                  .sampling = &g_greedy, .history = g_hist[i], .n_prompt = start + n - k,
                                  .n_history = start + n - k, .n_draft = len > 0 ? 0 : k, .spec_out = so[s]};
        for (int j = 0; j < n; j++, T++) {
            int p = start + j;
            ids[T] = g_hist[i][p], pos[T] = p;
            slots[T] = (int64_t)g_bt[i][p / BS] * BS + p % BS;
        }
    }
    struct step st = {.n_tokens = T, .token_ids = ids, .positions = pos, .slots = slots, .n_seqs = ns, .seqs = sq};
    double t0 = now_s();
    if (be->ops->forward(be, &st, err, sizeof err)) return -1;
    if (mtp && len == 0) {
        for (int s = 0; s < ns; s++) {
            int ne = k > 0 ? sq[s].n_spec_out : 1;
            int32_t tok = k > 0 ? so[s][ne - 1].token : sq[s].out.token;
            rq[s] = (struct model_mtp_req){.seq = s, .pos = start + ne - 1, .token = tok < 0 ? 0 : tok, .k = k,
                                           .block_table = g_bt[i0 + s], .n_blocks = CTXB, .drafts = drafts[s]};
        }
        if (be->ops->mtp_draft(be, rq, ns, err, sizeof err)) return -1;
    }
    return now_s() - t0;
}

/* The median step time (ms) of ns sequences at CTX, k drafts each. */
static double median_ms(model_backend *be, int ns, int k, bool mtp)
{
    double t[RUNS];
    for (int i = 0; i < WARM + RUNS; i++) {
        double s = step(be, 0, ns, CTX, k, 0, mtp);
        if (s < 0) return -1;
        if (i >= WARM) t[i - WARM] = s;
    }
    qsort(t, RUNS, sizeof t[0], cmp_d);
    return t[RUNS / 2] * 1e3;
}

/* A backend (MTP on with max_draft_tokens kd, or off with KMAX) with every sequence's CTX-token prompt in. */
static model_backend *backend(const model *m, bool mtp, int kd, bool eager)
{
    struct model_backend_opts bo = {.device = g_dev, .n_threads = 2, .max_tokens_per_step = 2048,
                                    .max_seqs_per_step = NSEQ, .max_ctx = (CTX + 2 * KMAX + 2 + BS - 1) / BS * BS,
                                    .enforce_eager = eager, .mtp = mtp, .tensor_parallel_size = g_tp,
                                    .max_draft_tokens = mtp ? kd : KMAX};
    model_backend *be = model_backend_create(m, &bo, err, sizeof err);
    if (!be) return NULL;
    if (be->ops->kv_alloc(be, NSEQ * CTXB, BS, err, sizeof err)) {
        model_backend_destroy(be);
        return NULL;
    }
    for (int i = 0; i < NSEQ; i++) /* one prompt a step */
        if (step(be, i, 1, 0, 0, CTX, false) < 0) {
            model_backend_destroy(be);
            return NULL;
        }
    return be;
}

int main(int argc, char **argv)
{
    const char *cfg = "tools/configs/deepseek-v2-lite-mtp", *tok = "tests/models/tiny-qwen3";
    bool eager = false;
    int npos = 0;
    for (int i = 1; i < argc; i++) {
        if (!strcmp(argv[i], "--enforce-eager")) eager = true;
        else if (!strncmp(argv[i], "--device=", 9)) g_dev = argv[i] + 9;
        else if (!strncmp(argv[i], "--ctx=", 6) && atoi(argv[i] + 6) >= 16 && atoi(argv[i] + 6) <= CTXMAX)
            CTX = atoi(argv[i] + 6);
        else if (!strncmp(argv[i], "--tp=", 5) && atoi(argv[i] + 5) >= 1)
            g_tp = atoi(argv[i] + 5);
        else if (argv[i][0] != '-' && npos == 0) cfg = argv[i], npos++;
        else if ((argv[i][0] != '-' || !strcmp(argv[i], "-")) && npos == 1) tok = argv[i], npos++;
        else {
            fprintf(stderr, "bench_mtp: unknown argument %s (options: tests/gpu/bench_mtp.c)\n", argv[i]);
            return 2;
        }
    }
    int ndev = 0;
    bool cuda = !strcmp(g_dev, "cuda");
    if (cuda && (cudaGetDeviceCount(&ndev) != cudaSuccess || ndev == 0)) {
        printf("no GPU: skipped\n");
        return 0;
    }
    struct cudaDeviceProp prop;
    if (cuda) cudaGetDeviceProperties(&prop, 0);
    else snprintf(prop.name, sizeof prop.name, "%s", g_dev);
    struct model_load_opts lo = {.tokenizer = strcmp(tok, "-") ? tok : NULL, .load_format = "dummy"};
    model *m = model_load(cfg, &lo, err, sizeof err);
    if (!m) {
        fprintf(stderr, "load: %s\n", err);
        return 1;
    }
    const struct model_config *c = model_get_config(m);
    const bool has_mtp = c->n_mtp_layer > 0; /* else decode and verify K alone */
    g_V = c->n_vocab;
    model_sampling_default(&g_greedy);
    for (int i = 0; i < NSEQ; i++)
        for (int j = 0; j < CTXB; j++) g_bt[i][j] = (int32_t)(((long)(i * CTXB + j) * 7919L) % (NSEQ * CTXB));
    printf("%s x%d, %s: %d layers%s, hidden %d, batch 1 and %d at %d context, %s; median of %d steps, ms\n",
           prop.name, g_tp, cfg, c->n_layer, has_mtp ? " + 1 MTP" : " (no MTP layer: decode and verify only)", c->n_embd, NSEQ, CTX,
           !cuda ? "no graphs" : eager ? "--enforce-eager" : "CUDA graphs", RUNS);
    static const int batches[2] = {1, NSEQ};
    /* [batch][case]: 0 decode, 1 sub-step, 1 + K verify K, 4 + K verify K + MTP */
    double ms[2][2 + 2 * KMAX];
    int rc = 0;
    for (int cfgi = 0; cfgi < (has_mtp ? 2 + KMAX : 1) && !rc; cfgi++) {
        /* cfgi 0: MTP off (decode, verify K); 1: MTP on, no drafts (the sub-step); 1 + K: MTP on, K drafts */
        bool mtp = cfgi > 0;
        int kd = mtp ? cfgi - 1 : 0;
        model_backend *be = backend(m, mtp, kd, eager);
        if (!be) {
            fprintf(stderr, "backend (MTP %s, %d drafts): %s\n", mtp ? "on" : "off", kd, err);
            rc = 1;
            break;
        }
        for (int b = 0; b < 2 && !rc; b++) {
            double t = 0;
            if (!mtp) {
                t = ms[b][0] = median_ms(be, batches[b], 0, false);
                for (int k = 1; k <= KMAX && t >= 0; k++) t = ms[b][1 + k] = median_ms(be, batches[b], k, false);
            } else if (kd == 0) {
                t = ms[b][1] = median_ms(be, batches[b], 0, false); /* forward() alone: the step and its sub-step */
            } else {
                t = ms[b][4 + kd] = median_ms(be, batches[b], kd, true);
            }
            if (t < 0) {
                fprintf(stderr, "step (MTP %s, %d drafts, batch %d): %s\n", mtp ? "on" : "off", kd, batches[b], err);
                rc = 1;
            }
        }
        model_backend_destroy(be);
    }
    for (int b = 0; b < 2 && !rc; b++) {
        double d = ms[b][0];
        printf("batch %d: decode %.3f", batches[b], d);
        if (has_mtp) printf(" | sub-step %.3f (%.2fx)", ms[b][1], ms[b][1] / d);
        for (int k = 1; k <= KMAX; k++) {
            printf(" | verify %d %.3f (%.2fx)", k, ms[b][1 + k], ms[b][1 + k] / d);
            if (has_mtp) printf(", +MTP %.3f (%.2fx)", ms[b][4 + k], ms[b][4 + k] / d);
        }
        printf("\n");
    }
    model_free(m);
    return rc;
}

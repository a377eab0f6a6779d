/* test_spec_mtp.c - speculative decoding with the model's own MTP layer
 * (method mtp), end to end on the CPU, on the tiny checkpoints of
 * tests/models/mtp/ (deepseek_v3; glm4_moe; glm4_moe with an int8 MTP layer,
 * and with int8 decoder layers beside a bf16 MTP layer)
 * and their goldens from transformers (tests/golden/mtp/make_mtp.py):
 *  - the scheduler's drafts after each step (sched_draft_wants), made by the
 *    backend's ops->mtp_draft, are transformers' MtpModel drafts at the
 *    golden's draft positions, and its argmax at p + 1 everywhere else;
 *  - the engine (method mtp, 3 drafts) gives the greedy continuation of a
 *    run without drafts, which is transformers' own, token for token, with
 *    drafts verified and the KV pool left clean.
 *
 * --device=cuda runs it on the GPU backend (tests/gpu/run.sh
 * check; --tp=N: N GPUs): there the drafts must be transformers' where its top-2 margin is
 * clear of bf16's error (GPU_TOL of the top logit's magnitude, twice), and
 * only while the generated tokens are still transformers' (a near tie of the
 * main model may part them); the engine's output with drafts must be the
 * output without them on the same backend, up to a first difference that is
 * a near tie of the run without drafts (top-2 logprobs within NEAR_TIE_NATS,
 * the two tokens those two, as test_engine allows on the GPU).
 */
#include <math.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "base/json.h"
#include "kvpool/kvpool.h"
#include "model/backend.h"
#include "model/model.h"
#include "sched/sched.h"
#include "tests/golden.h"
#include "tests/test.h"

#define MDIR "tests/models/mtp"
#define MAXL 64
#define MTOP 8
#define KD 3
#define GPU_TOL 3e-2
#define NEAR_TIE_NATS 0.3f

static char err[512];
static const char *g_device = "cpu"; /* --device=NAME */
static int g_tp = 1;                 /* --tp=N: N GPUs */
static bool on_cpu(void) { return !strcmp(g_device, "cpu"); }

/* the golden: ids (prompt then transformers' greedy tokens), the MTP layer's
 * argmax at each position, and 3 chained drafts from a few positions */
struct mgold {
    int n, n_prompt, nd;
    int32_t ids[MAXL];
    int32_t mtp_top[MAXL]; /* [q] the MTP entry at q's argmax */
    bool mtp_clear[MAXL];  /* [q] its margin over the runner-up is clear of the backend's error */
    struct {
        int pos, token;
        int32_t drafts[KD];
        bool clear[KD];
    } d[8];
};

/* Whether top logits ref[MTOP] (best first) have a clear argmax (always on the CPU: exact there). */
static bool clear_margin(const float *ref)
{
    if (on_cpu()) return true;
    double mr = 0;
    for (int k = 0; k < MTOP; k++) mr = fabs(ref[k]) > mr ? fabs(ref[k]) : mr;
    return ref[0] - ref[1] > 2 * GPU_TOL * (mr > 0 ? mr : 1);
}

static int load_golden(const char *name, struct mgold *g)
{
    char path[300];
    snprintf(path, sizeof path, "%s/%s/golden.json", MDIR, name);
    memset(g, 0, sizeof *g);
    size_t len;
    char *src = test_slurp(path, &len);
    if (!src) return -1;
    json_doc d;
    int rc = -1;
    if (json_parse(&d, src, len, err, sizeof err) != 0) {
        free(src);
        return -1;
    }
    int64_t v;
    int mtp = json_get(&d, 0, "mtp"), dr = json_get(&d, 0, "drafts");
    if (json_i64(&d, json_get(&d, 0, "n_prompt"), &v) != 0) goto out;
    g->n_prompt = (int)v;
    if ((g->n = read_ints(&d, json_get(&d, 0, "ids"), g->ids, MAXL)) <= 0 || json_size(&d, mtp) != g->n - 1) goto out;
    for (int k = 0, e = mtp + 1; k < g->n - 1; k++, e = json_skip(&d, e)) {
        int32_t top[MTOP];
        float lg[MTOP];
        if (read_ints(&d, json_get(&d, e, "top_ids"), top, MTOP) != MTOP ||
            read_floats(&d, json_get(&d, e, "top_logits"), lg, MTOP) != MTOP)
            goto out;
        g->mtp_top[k + 1] = top[0];
        g->mtp_clear[k + 1] = clear_margin(lg);
    }
    g->nd = json_size(&d, dr);
    if (g->nd <= 0 || g->nd > 8) goto out;
    for (int k = 0, e = dr + 1; k < g->nd; k++, e = json_skip(&d, e)) {
        if (json_i64(&d, json_get(&d, e, "pos"), &v)) goto out;
        g->d[k].pos = (int)v;
        if (json_i64(&d, json_get(&d, e, "token"), &v)) goto out;
        g->d[k].token = (int)v;
        if (read_ints(&d, json_get(&d, e, "drafts"), g->d[k].drafts, KD) != KD) goto out;
        int tl = json_get(&d, e, "top_logits");
        for (int i = 0, b = tl + 1; i < KD; i++, b = json_skip(&d, b)) {
            float lg[MTOP];
            if (tl < 0 || read_floats(&d, b, lg, MTOP) != MTOP) goto out;
            g->d[k].clear[i] = clear_margin(lg);
        }
    }
    rc = 0;
out:
    json_free(&d);
    free(src);
    return rc;
}

static model_backend *mtp_backend(const model *m)
{
    struct model_backend_opts bo = {.device = g_device, .tensor_parallel_size = g_tp, .n_threads = 2, .max_tokens_per_step = 64, .max_seqs_per_step = 8,
                                    .max_ctx = 128, .mtp = true, .max_draft_tokens = KD};
    model_backend *be = model_backend_create(m, &bo, err, sizeof err);
    CHECKF(be != NULL, "backend: %s", err);
    return be;
}

static struct sched_request greedy_req(const struct mgold *g)
{
    struct sched_request r;
    memset(&r, 0, sizeof r);
    r.prompt = g->ids;
    r.n_prompt = g->n_prompt;
    r.max_tokens = g->n - g->n_prompt;
    r.ignore_eos = true;
    r.priority = SCHED_PRIO_BATCH;
    model_sampling_default(&r.sampling);
    return r;
}

static int32_t got[MAXL];
static int n_got;
static void collect(void *arg, const struct sched_event *ev)
{
    (void)arg;
    if (ev->kind == SCHED_EV_TOKEN && n_got < MAXL) got[n_got++] = ev->token;
}

/* The scheduler and the backend by hand: after every step each listed
 * sequence's drafts are made by mtp_draft and compared with transformers'. */
static void drafts_like_transformers(const char *name, const struct mgold *g, model_backend *be)
{
    enum { BS = 4, NB = 64 };
    kv_pool *p = kv_pool_create(NB, BS, false, err, sizeof err);
    if (!p || be->ops->kv_alloc(be, NB, BS, err, sizeof err)) {
        CHECKF(0, "%s: pool: %s", name, err);
        kv_pool_destroy(p);
        return;
    }
    struct sched_config c = {.block_size = BS, .max_num_seqs = 4, .max_num_batched_tokens = 64, .max_model_len = 128,
                             .spec = {.method = SCHED_SPEC_MTP, .num_speculative_tokens = KD, .always = true}};
    /* no tokenizer: the goldens' ids go past the tiny tokenizer's vocabulary (the model's is larger) */
    sched *s = sched_create(&c, p, NULL, err, sizeof err);
    CHECKF(s != NULL, "%s", err);
    if (!s) {
        kv_pool_destroy(p);
        return;
    }
    struct sched_request r = greedy_req(g);
    sched_req *q = sched_req_create(s, &r, 1, err, sizeof err);
    CHECKF(q != NULL, "%s", err);
    if (q) sched_add(s, q);
    n_got = 0;
    int golden_hits = 0, argmax_checks = 0, steps = 0;
    struct step st;
    static struct model_mtp_req req[4];
    while (sched_has_work(s) && steps++ < 100) {
        CHECK(sched_plan_step(s, &st) > 0);
        if (be->ops->forward(be, &st, err, sizeof err)) {
            for (int i = 0; i < st.n_seqs; i++)
                printf("  seq %d: query %d+%d context %d blocks %d draft %d\n", i, st.seqs[i].query_start,
                       st.seqs[i].query_len, st.seqs[i].context_len, st.seqs[i].n_blocks, st.seqs[i].n_draft);
            CHECKF(0, "forward: %s", err);
            break;
        }
        sched_complete_step(s, &st, collect, NULL);
        struct sched_draft_want *w;
        int n = sched_draft_wants(s, &w);
        for (int i = 0; i < n; i++)
            req[i] = (struct model_mtp_req){.seq = w[i].seq, .pos = w[i].pos, .token = w[i].token, .k = w[i].k,
                                            .block_table = w[i].block_table, .n_blocks = w[i].n_blocks,
                                            .drafts = w[i].drafts};
        if (n > 0 && be->ops->mtp_draft(be, req, n, err, sizeof err)) {
            CHECKF(0, "mtp_draft: %s", err);
            break;
        }
        /* the GPU: only while the tokens so far are transformers' (the drafts follow them) */
        bool same = on_cpu() || !memcmp(got, g->ids + g->n_prompt, sizeof(int32_t) * (size_t)n_got);
        for (int i = 0; i < n; i++) {
            w[i].n_made = w[i].k;
            int pos = w[i].pos;
            if (!same) continue;
            CHECK(w[i].token == g->ids[pos + 1]);
            for (int j = 0; j < g->nd; j++)
                if (g->d[j].pos == pos && w[i].k == KD) {
                    golden_hits++;
                    for (int k = 0; k < KD; k++) {
                        if (w[i].drafts[k] != g->d[j].drafts[k] && !g->d[j].clear[k]) break; /* a near tie */
                        CHECKF(w[i].drafts[k] == g->d[j].drafts[k], "%s: draft %d from %d is %d, transformers %d", name,
                               k, pos, w[i].drafts[k], g->d[j].drafts[k]);
                    }
                }
            if (w[i].k >= 1 && pos + 2 < g->n && g->mtp_clear[pos + 1]) {
                argmax_checks++;
                CHECKF(w[i].drafts[0] == g->mtp_top[pos + 1], "%s: first draft from %d is %d, transformers %d", name,
                       pos, w[i].drafts[0], g->mtp_top[pos + 1]);
            }
        }
    }
    bool golden = n_got == g->n - g->n_prompt && !memcmp(got, g->ids + g->n_prompt, sizeof(int32_t) * (size_t)n_got);
    if (!golden && !on_cpu()) /* the engine test below holds the GPU to its own output without drafts */
        printf("  %s: the GPU's greedy tokens part from transformers' (bf16; a near tie of the main model)\n", name);
    else
        CHECKF(golden, "%s: %d tokens, not transformers' greedy ones", name, n_got);
    struct sched_stats ss;
    sched_get_stats(s, &ss);
    printf("  %s: %d steps for %d tokens, %llu verifications, %llu of %llu drafts accepted; %d draft chains and %d "
           "first drafts checked against transformers\n",
           name, steps, n_got, (unsigned long long)ss.spec_drafts, (unsigned long long)ss.spec_accepted_tokens,
           (unsigned long long)ss.spec_draft_tokens, golden_hits, argmax_checks);
    CHECK(ss.spec_drafts > 0);
    CHECK(argmax_checks > 0 || !on_cpu());
    CHECKF(golden_hits > 0 || !on_cpu(), "%s: no golden draft position reached with 3 drafts", name);
    sched_destroy(s);
    CHECKF(kv_pool_available(p) == NB, "%d blocks left", kv_pool_available(p));
    kv_pool_destroy(p);
}

/* The engine with method mtp against one without drafts: the same tokens,
 * for three prompts at once (batched verification): the golden's, its ids
 * folded into the tokenizer's vocabulary (the engine checks prompts against
 * it), and two shifted copies. */
static void engine_same_output(const char *name, const struct mgold *g, model_backend *be)
{
    enum { NR = 3 };
    int32_t out[2][NR][MAXL], prompt[NR][MAXL];
    static struct model_sample_out top[NR][MAXL]; /* the GPU: each token's top 2 in the run without drafts */
    int n_out[2][NR], nt = model_tok_n_vocab(model_get_tok(be->m));
    for (int i = 0; i < NR; i++)
        for (int j = 0; j < g->n_prompt; j++) prompt[i][j] = (g->ids[j] + 31 * i) % nt;
    for (int spec = 0; spec < 2; spec++) {
        struct sched_engine_opts o;
        memset(&o, 0, sizeof o);
        o.sched.block_size = 4;
        o.sched.max_num_seqs = 4;
        o.sched.max_num_batched_tokens = 64;
        o.sched.max_model_len = 128;
        if (spec) o.sched.spec = (struct sched_spec_config){.method = SCHED_SPEC_MTP, .num_speculative_tokens = KD,
                                                           .always = true};
        o.kv_blocks = 128;
        sched_engine *e = sched_engine_create(be, &o, err, sizeof err);
        CHECKF(e != NULL, "%s", err);
        if (!e) return;
        memset(n_out[spec], 0, sizeof n_out[spec]);
        int sent = 0;
        for (int i = 0; i < NR; i++) {
            struct sched_request r = greedy_req(g);
            r.prompt = prompt[i];
            r.user = (void *)(intptr_t)i;
            if (!on_cpu()) r.logprobs = true, r.sampling.top_logprobs = 2; /* still greedy: the near-tie check */
            int rc = sched_engine_submit(e, &r, NULL, err, sizeof err);
            CHECKF(rc == 0, "%s", err);
            sent += rc == 0;
        }
        struct sched_evbuf b;
        sched_evbuf_init(&b);
        for (int done = 0; done < sent;) {
            int k = sched_engine_wait(e, &b, 60.0);
            CHECK(k > 0);
            if (k <= 0) break;
            for (int j = 0; j < k; j++) {
                int i = (int)(intptr_t)b.ev[j].user;
                if (b.ev[j].kind == SCHED_EV_TOKEN && n_out[spec][i] < MAXL) {
                    if (!spec && b.ev[j].has_logprobs) top[i][n_out[spec][i]] = b.ev[j].sample;
                    out[spec][i][n_out[spec][i]++] = b.ev[j].token;
                }
                if (b.ev[j].kind == SCHED_EV_FINISH) done++;
            }
        }
        sched_evbuf_deinit(&b);
        struct sched_engine_stats st;
        sched_engine_get_stats(e, &st);
        if (spec) CHECKF(st.sched.spec_drafts > 0, "%s: the engine verified no MTP drafts", name);
        CHECK(st.kv.blocks_used == 0);
        sched_engine_destroy(e);
    }
    for (int i = 0; i < NR; i++) {
        bool same = n_out[0][i] == g->n - g->n_prompt && n_out[1][i] == n_out[0][i] &&
                    !memcmp(out[1][i], out[0][i], sizeof(int32_t) * (size_t)n_out[0][i]);
        if (!same && !on_cpu() && n_out[0][i] == g->n - g->n_prompt && n_out[1][i] == n_out[0][i]) {
            int j = 0;
            while (out[0][i][j] == out[1][i][j]) j++;
            const struct model_sample_out *o = &top[i][j];
            same = o->n_top >= 2 && o->top_logprobs[0] - o->top_logprobs[1] < NEAR_TIE_NATS &&
                   ((o->top_ids[0] == out[0][i][j] && o->top_ids[1] == out[1][i][j]) ||
                    (o->top_ids[1] == out[0][i][j] && o->top_ids[0] == out[1][i][j]));
            printf("  %s: request %d token %d: %d without drafts, %d with; top-2 %d %d, logprobs %.4f %.4f: %s\n", name,
                   i, j, out[0][i][j], out[1][i][j], o->top_ids[0], o->top_ids[1], o->top_logprobs[0],
                   o->top_logprobs[1], same ? "near-tie" : "NOT a near-tie");
        }
        CHECKF(same, "%s: request %d differs with MTP drafts", name, i);
    }
}

static void run(const char *name)
{
    struct mgold *g = calloc(1, sizeof *g);
    char path[256];
    snprintf(path, sizeof path, "%s/%s", MDIR, name);
    if (!g || load_golden(name, g) != 0) {
        CHECKF(0, "%s: no or bad golden.json", name);
        free(g);
        return;
    }
    struct model_load_opts lo = {0};
    model *m = model_load(path, &lo, err, sizeof err);
    CHECKF(m != NULL, "%s: %s", path, err);
    model_backend *be = m ? mtp_backend(m) : NULL;
    if (be) {
        drafts_like_transformers(name, g, be);
        engine_same_output(name, g, be);
    }
    model_backend_destroy(be);
    model_free(m);
    free(g);
}

static void test_dsv3(void) { run("dsv3"); }
static void test_glm4moe(void) { run("glm4moe"); }
static void test_glm4moe_int8_mtp(void) { run("glm4moe-w8mtp"); }
static void test_glm4moe_int8_main(void) { run("glm4moe-w8main"); }

int main(int argc, char **argv)
{
    for (int i = 1; i < argc; i++) {
        if (!strncmp(argv[i], "--device=", 9) && argv[i][9]) {
            g_device = argv[i] + 9;
        } else if (!strncmp(argv[i], "--tp=", 5) && atoi(argv[i] + 5) >= 1) {
            g_tp = atoi(argv[i] + 5);
        } else {
            fprintf(stderr, "usage: %s [--device=cpu|cuda] [--tp=N]\n", argv[0]);
            return 2;
        }
    }
    printf("speculative decoding with the MTP layer on device %s, %d rank(s)\n", g_device, g_tp);
    RUN(test_dsv3);
    RUN(test_glm4moe);
    RUN(test_glm4moe_int8_mtp);
    RUN(test_glm4moe_int8_main);
    return test_summary();
}

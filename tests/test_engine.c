/* test_engine.c - the engine on the default model (CPU backend, greedy):
 * batched, chunked, cached and preempted runs give exactly the tokens of a
 * lone run; stop strings, refusal and abort; the request features (logit_bias,
 * min_tokens, JSON and schema mode, seeded sampling) on whatever backend runs
 * the suite. Small token counts throughout so the whole file runs in about a
 * minute on two cores.
 *
 * The same suite runs on the GPU (make gpu-test): SLUICE_TEST_DEVICE=cuda,
 * SLUICE_TEST_TP=N (tensor-parallel ranks), SLUICE_TEST_MODEL=path (a model
 * whose heads divide by N), SLUICE_TEST_KV=fp8 (the fp8 KV cache). */
#include <math.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/wait.h>

#include "model/backend.h"
#include "base/json.h"
#include "model/model.h"
#include "sched/sched.h"
#include "test.h"

#define MODEL_PATH "models/SmolLM2-135M-Instruct.Q4_1.gguf"
#define MAX_REQ 40
#define MAX_GEN 64

static char err[512];
static const char *g_path = MODEL_PATH, *g_device = "cpu"; /* SLUICE_TEST_MODEL, SLUICE_TEST_DEVICE */
static int g_tp = 1;                                        /* SLUICE_TEST_TP */
static model *m;
static model_backend *be;
static int32_t text_ids[2048];
static int n_text_ids;

struct result {
    int32_t tok[MAX_GEN];
    int n;
    char text[1024];
    size_t text_len;
    bool done;
    struct sched_usage usage;
    enum sched_finish finish;
    struct model_sample_out samp[MAX_GEN]; /* each token's sample, where logprobs were asked for */
};

static int n_notify;
static void on_notify(void *arg)
{
    (void)arg;
    __atomic_add_fetch(&n_notify, 1, __ATOMIC_RELAXED);
}

/* An engine on be; k > 0: with n-gram drafts (k a step, always) from d (NULL: prompt lookup) */
static sched_engine *spec_engine(int seqs, int budget, int max_len, int kv_blocks, bool cache, int k,
                                 const struct sched_drafter *d)
{
    struct sched_engine_opts o;
    memset(&o, 0, sizeof o);
    o.sched.block_size = 16;
    o.sched.max_num_seqs = seqs;
    o.sched.max_num_batched_tokens = budget;
    o.sched.max_model_len = max_len;
    if (k > 0)
        o.sched.spec = (struct sched_spec_config){.method = SCHED_SPEC_NGRAM, .num_speculative_tokens = k,
                                                  .prompt_lookup_min = 1, .prompt_lookup_max = 4, .always = true};
    o.kv_blocks = kv_blocks;
    o.enable_prefix_caching = cache;
    o.drafter = d;
    o.notify = on_notify;
    sched_engine *e = sched_engine_create(be, &o, err, sizeof err);
    CHECKF(e != NULL, "%s", err);
    return e;
}

static sched_engine *engine(int seqs, int budget, int max_len, int kv_blocks, bool cache)
{
    return spec_engine(seqs, budget, max_len, kv_blocks, cache, 0, NULL);
}

static struct sched_request greedy(const int32_t *p, int n, int max_tokens)
{
    struct sched_request r;
    memset(&r, 0, sizeof r);
    r.prompt = p;
    r.n_prompt = n;
    r.max_tokens = max_tokens;
    r.priority = SCHED_PRIO_BATCH;
    r.ignore_eos = true;
    model_sampling_default(&r.sampling);
    return r;
}

/* Waits until every result in res[0..n) is done; events find their result
 * through user. */
static void collect(sched_engine *e, struct result *res, int n)
{
    struct sched_evbuf b;
    sched_evbuf_init(&b);
    int left = 0;
    for (int i = 0; i < n; i++) left += !res[i].done;
    while (left > 0) {
        int k = sched_engine_wait(e, &b, 120.0);
        CHECK(k > 0);
        if (k <= 0) break;
        for (int i = 0; i < k; i++) {
            const struct sched_event *ev = &b.ev[i];
            struct result *r = ev->user;
            if (r->text_len + ev->text_len < sizeof r->text) {
                memcpy(r->text + r->text_len, ev->text, ev->text_len);
                r->text_len += ev->text_len;
                r->text[r->text_len] = '\0';
            }
            if (ev->kind == SCHED_EV_TOKEN) {
                if (r->n < MAX_GEN) {
                    if (ev->has_logprobs) r->samp[r->n] = ev->sample;
                    r->tok[r->n++] = ev->token;
                }
            } else {
                r->done = true;
                r->usage = ev->usage;
                r->finish = ev->finish;
                left--;
            }
        }
    }
    sched_evbuf_deinit(&b);
}

static void run_one(sched_engine *e, const struct sched_request *rq, struct result *res)
{
    memset(res, 0, sizeof *res);
    struct sched_request r = *rq;
    r.user = res;
    CHECKF(sched_engine_submit(e, &r, NULL, err, sizeof err) == 0, "%s", err);
    collect(e, res, 1);
}

static void run_all(sched_engine *e, const struct sched_request *rq, int n, struct result *res)
{
    memset(res, 0, sizeof *res * (size_t)n);
    for (int i = 0; i < n; i++) {
        struct sched_request r = rq[i];
        r.user = &res[i];
        CHECKF(sched_engine_submit(e, &r, NULL, err, sizeof err) == 0, "%s", err);
    }
    collect(e, res, n);
}

static bool same(const struct result *a, const struct result *b)
{
    return a->n == b->n && !memcmp(a->tok, b->tok, sizeof a->tok[0] * (size_t)a->n);
}

/* On the GPU, GEMM tiling and kernel choice change with the step's shape, so
 * a batched (chunked, preempted, cached) run may round differently from a
 * lone one (DESIGN.md, "Batch invariance"): a greedy divergence is allowed
 * there only at a near-tie. At the first differing token the lone run's
 * prefix is run again alone for one token with its top-2 logprobs: the two
 * tokens must be those two, within NEAR_TIE_NATS of each other (a top-2
 * logprob gap is the top-2 logit gap; test_gpu_e2e's bound, 2% of max
 * |logit|, is ~0.36 at SmolLM2's logit scale). On the CPU: exact. */
#define NEAR_TIE_NATS 0.3f
static int n_near_ties;

/* The lone run's next token after its first j generated ones, run again
 * alone with its top n logprobs into *o */
static bool lone_next(const struct sched_request *rq, const struct result *ref, int j, int n,
                      struct model_sample_out *o)
{
    int32_t ids[1024];
    if (rq->n_prompt + j > (int)(sizeof ids / sizeof ids[0])) return false;
    memcpy(ids, rq->prompt, sizeof ids[0] * (size_t)rq->n_prompt);
    memcpy(ids + rq->n_prompt, ref->tok, sizeof ids[0] * (size_t)j);
    struct sched_request p = greedy(ids, rq->n_prompt + j, 1);
    p.logprobs = true;
    p.sampling.top_logprobs = n;
    sched_engine *e = engine(4, 1024, 1024, 128, false);
    if (!e) return false;
    struct result r;
    run_one(e, &p, &r);
    sched_engine_destroy(e);
    *o = r.samp[0];
    return o->n_top >= n;
}

static int first_diff(const struct result *a, const struct result *b)
{
    int j = 0;
    while (a->tok[j] == b->tok[j]) j++;
    return j;
}

static bool match(const struct sched_request *rq, const struct result *ref, const struct result *got)
{
    if (same(ref, got)) return true;
    if (!strcmp(g_device, "cpu") || ref->n != got->n) return false;
    int j = first_diff(ref, got);
    struct model_sample_out o;
    if (!lone_next(rq, ref, j, 2, &o)) {
        printf("  token %d: %d alone, %d here; no top-2 logprobs from the lone run\n", j, ref->tok[j], got->tok[j]);
        return false;
    }
    bool tie = o.top_logprobs[0] - o.top_logprobs[1] < NEAR_TIE_NATS &&
               ((o.top_ids[0] == ref->tok[j] && o.top_ids[1] == got->tok[j]) ||
                (o.top_ids[1] == ref->tok[j] && o.top_ids[0] == got->tok[j]));
    printf("  token %d: %d alone, %d here; alone's top-2 %d %d, logprobs %.4f %.4f: %s\n", j, ref->tok[j],
           got->tok[j], o.top_ids[0], o.top_ids[1], o.top_logprobs[0], o.top_logprobs[1],
           tie ? "near-tie" : "NOT a near-tie");
    n_near_ties += tie;
    return tie;
}

/* The token that the draw u picks from one step's sample o (its top-k
 * logprobs, best first) under s: model_sample's arithmetic, top-k, then the
 * top_p nucleus, then the draw over what is left. *near says whether u lies
 * within 1e-4 of the mass of a boundary it passed, or the nucleus's cut
 * does (logprobs carry about 7 digits: there either side may be the
 * sampler's). */
static int32_t draw_pick(double u, const struct model_sample_out *o, const struct model_sampling *s, bool *near)
{
    double e[MODEL_MAX_TOP_LOGPROBS], z = 0, cum = 0;
    int k = s->top_k, keep = k;
    for (int i = 0; i < k; i++) e[i] = exp((double)(o->top_logprobs[i] - o->top_logprobs[0]) / s->temperature), z += e[i];
    *near = false;
    for (int i = 0; i < k && s->top_p < 1.0f; i++) {
        cum += e[i] / z;
        *near |= fabs(cum - s->top_p) < 1e-4;
        if (cum >= s->top_p) {
            keep = i + 1;
            break;
        }
    }
    z = cum = 0;
    for (int i = 0; i < keep; i++) z += e[i];
    for (int i = 0; i < keep; i++) {
        cum += e[i];
        *near |= fabs(u * z - cum) < 1e-4 * z;
        if (u * z < cum) return o->top_ids[i];
    }
    return o->top_ids[keep - 1];
}

/* match() for a seeded request sampled with temperature T and top_k <= 20
 * (no min_p, no penalties), both runs made with their top-k logprobs: on
 * the GPU a first differing token j passes only where the draw explains it.
 * The seed's j-th draw must pick each run's own token from that run's own
 * top-k logprobs at j (so it lies between the two runs' boundaries), and
 * the logprobs of the tokens both runs list must differ by less than
 * NEAR_TIE_NATS. tests/sluice_testlib.py's sampled_agree is the same rule
 * for the server's responses. */
static bool match_sampled(const struct sched_request *rq, const struct result *ref, const struct result *got)
{
    if (same(ref, got)) return true;
    const struct model_sampling *s = &rq->sampling;
    int k = s->top_k;
    if (!strcmp(g_device, "cpu") || ref->n != got->n || s->temperature <= 0 || k < 2 || k > MODEL_MAX_TOP_LOGPROBS ||
        s->min_p > 0)
        return false;
    int j = first_diff(ref, got);
    const struct model_sample_out *a = &ref->samp[j], *b = &got->samp[j];
    if (a->n_top < k || b->n_top < k) {
        printf("  sampled token %d: %d / %d top logprobs, top_k %d needs as many\n", j, a->n_top, b->n_top, k);
        return false;
    }
    uint64_t rng = model_rng_seed(s->seed);
    for (int i = 0; i < j; i++) model_rng_uniform(&rng); /* one draw a token */
    double u = model_rng_uniform(&rng), gap = -1; /* the largest, over the tokens both list */
    for (int x = 0; x < k; x++)
        for (int y = 0; y < k; y++)
            if (a->top_ids[x] == b->top_ids[y]) gap = fmax(gap, fabs((double)a->top_logprobs[x] - b->top_logprobs[y]));
    if (gap < 0) gap = INFINITY;
    bool near;
    int32_t pa = draw_pick(u, a, s, &near), pb = draw_pick(u, b, s, &near);
    bool split = pa == ref->tok[j] && pb == got->tok[j] && gap < NEAR_TIE_NATS;
    printf("  %s at token %d: %d alone, %d here; draw %.6f picks %d / %d from each run's top %d, logprobs within "
           "%.4f\n",
           split ? "sampled split" : "NOT a split the draw explains", j, ref->tok[j], got->tok[j], u, pa, pb, k, gap);
    n_near_ties += split;
    return split;
}

/* ---- the requests: slices of one tokenized text, mixed lengths ---- */

enum { N_REQ = 32, GEN = 4 };
static struct sched_request reqs[N_REQ];
static struct result alone[N_REQ];

static void make_reqs(void)
{
    for (int i = 0; i < N_REQ; i++) {
        int len = 3 + (i * 37) % 61;
        reqs[i] = greedy(text_ids + (i * 13) % 200, len, GEN);
    }
}

static void test_alone(void)
{
    sched_engine *e = engine(4, 256, 512, 64, false);
    if (!e) return;
    for (int i = 0; i < N_REQ; i++) {
        run_one(e, &reqs[i], &alone[i]);
        CHECK(alone[i].n == GEN && alone[i].finish == SCHED_FINISH_LENGTH);
        CHECK(alone[i].usage.prompt_tokens == reqs[i].n_prompt && alone[i].usage.completion_tokens == GEN);
    }
    sched_engine_destroy(e);
}

static void test_batch_invariance(void)
{
    sched_engine *e = engine(64, 1024, 512, 256, false);
    if (!e) return;
    struct result res[N_REQ];
    run_all(e, reqs, N_REQ, res);
    for (int i = 0; i < N_REQ; i++) CHECKF(match(&reqs[i], &alone[i], &res[i]), "request %d differs batched", i);
    struct sched_engine_stats st;
    sched_engine_get_stats(e, &st);
    CHECKF(st.sched.steps < N_REQ * GEN, "%llu steps: not batched", (unsigned long long)st.sched.steps);
    sched_engine_destroy(e);
}

/* The engine under the time policy, half the requests chats (batch decodes
 * wait for the chats' prefills in each step): every
 * result is still the lone run's; every step was timed into the cost model
 * (which left its prior), and each class's first tokens and gaps were
 * counted in its own histograms. */
static void test_time_policy(void)
{
    struct sched_engine_opts o;
    memset(&o, 0, sizeof o);
    o.sched.block_size = 16;
    o.sched.max_num_seqs = 64;
    o.sched.max_num_batched_tokens = 1024;
    o.sched.max_model_len = 512;
    sched_config_policy_defaults(&o.sched);
    /* targets this machine's steps never reach: how they bind is test_sched's
     * (planned by a fixed cost model); here a step's time must not decide
     * how long the test runs */
    o.sched.itl_target_s = 10.0;
    o.sched.ttft_target_s = 30.0;
    o.sched.expect_interactive = true;
    o.kv_blocks = 256;
    sched_engine *e = sched_engine_create(be, &o, err, sizeof err);
    CHECKF(e != NULL, "%s", err);
    if (!e) return;
    struct sched_engine_stats s0;
    sched_engine_get_stats(e, &s0);
    struct sched_request rq[N_REQ];
    int n_chat = 0, gaps[SCHED_N_PRIO] = {0, 0};
    for (int i = 0; i < N_REQ; i++) {
        rq[i] = reqs[i];
        if (i % 2) rq[i].priority = SCHED_PRIO_INTERACTIVE, n_chat++;
        gaps[rq[i].priority] += rq[i].max_tokens - 1;
    }
    struct result res[N_REQ];
    run_all(e, rq, N_REQ, res);
    for (int i = 0; i < N_REQ; i++) CHECKF(match(&rq[i], &alone[i], &res[i]), "request %d differs under the targets", i);
    struct sched_engine_stats st;
    sched_engine_get_stats(e, &st);
    const struct sched_stats *ss = &st.sched;
    CHECKF(ss->step_measured.count == ss->steps && ss->step_planned.count == ss->steps && ss->steps > 0,
           "%llu steps, %llu timed", (unsigned long long)ss->steps, (unsigned long long)ss->step_measured.count);
    CHECKF(memcmp(ss->cost, s0.sched.cost, sizeof ss->cost) != 0, "the cost model never moved from its prior");
    CHECKF(ss->ttft[SCHED_PRIO_INTERACTIVE].count == (uint64_t)n_chat &&
               ss->ttft[SCHED_PRIO_BATCH].count == (uint64_t)(N_REQ - n_chat),
           "first tokens: %llu chat, %llu batch", (unsigned long long)ss->ttft[0].count,
           (unsigned long long)ss->ttft[1].count);
    CHECKF(ss->itl[0].count == (uint64_t)gaps[0] && ss->itl[1].count == (uint64_t)gaps[1],
           "gaps: %llu chat (want %d), %llu batch (want %d)", (unsigned long long)ss->itl[0].count, gaps[0],
           (unsigned long long)ss->itl[1].count, gaps[1]);
    sched_engine_destroy(e);
}

static void test_chunked_prefill(void)
{
    sched_engine *e = engine(4, 16, 512, 64, false);
    if (!e) return;
    /* the longest prompts split into chunks of at most 16 tokens */
    struct result res[3];
    int idx[3] = {1, 5, 9};
    struct sched_request rq[3];
    for (int i = 0; i < 3; i++) rq[i] = reqs[idx[i]];
    run_all(e, rq, 3, res);
    for (int i = 0; i < 3; i++) CHECKF(match(&rq[i], &alone[idx[i]], &res[i]), "request %d differs chunked", idx[i]);
    struct sched_engine_stats st;
    sched_engine_get_stats(e, &st);
    int total = 0;
    for (int i = 0; i < 3; i++) total += rq[i].n_prompt;
    CHECKF(st.sched.steps >= (uint64_t)total / 16, "%llu steps", (unsigned long long)st.sched.steps);
    sched_engine_destroy(e);
}

static void test_prefix_reuse(void)
{
    enum { PREFIX = 150 };
    int32_t a[PREFIX + 20], b[PREFIX + 20];
    memcpy(a, text_ids, sizeof a);
    memcpy(b, text_ids, sizeof b);
    for (int i = PREFIX; i < PREFIX + 20; i++) b[i] = text_ids[400 + i];
    struct sched_request ra = greedy(a, PREFIX + 20, GEN), rb = greedy(b, PREFIX + 20, GEN);
    struct result off_b, ra_res, rb_res;
    sched_engine *e = engine(4, 256, 512, 64, false);
    if (!e) return;
    run_one(e, &rb, &off_b);
    CHECK(off_b.usage.cached_tokens == 0);
    sched_engine_destroy(e);

    e = engine(4, 256, 512, 64, true);
    if (!e) return;
    run_one(e, &ra, &ra_res);
    struct sched_engine_stats s0, s1;
    sched_engine_get_stats(e, &s0);
    run_one(e, &rb, &rb_res);
    sched_engine_get_stats(e, &s1);
    CHECKF(rb_res.usage.cached_tokens >= PREFIX / 16 * 16, "cached %d", rb_res.usage.cached_tokens);
    CHECKF(s1.sched.prompt_tokens_computed - s0.sched.prompt_tokens_computed ==
               (uint64_t)(rb.n_prompt - rb_res.usage.cached_tokens),
           "computed %llu", (unsigned long long)(s1.sched.prompt_tokens_computed - s0.sched.prompt_tokens_computed));
    CHECK(match(&rb, &off_b, &rb_res));
    CHECK(s1.kv.hit_tokens > 0);
    sched_engine_destroy(e);
}

static void test_preemption(void)
{
    /* 6 requests of 20 prompt + 16 generated tokens (3 blocks each at the end) in a pool of 6 blocks */
    enum { NP = 6, PGEN = 16 };
    struct sched_request rq[NP];
    struct result solo[NP], res[NP];
    for (int i = 0; i < NP; i++) rq[i] = greedy(text_ids + 17 * i, 20, PGEN);
    sched_engine *e = engine(8, 256, 96, 64, false);
    if (!e) return;
    for (int i = 0; i < NP; i++) run_one(e, &rq[i], &solo[i]);
    sched_engine_destroy(e);
    e = engine(8, 256, 96, 6, true);
    if (!e) return;
    run_all(e, rq, NP, res);
    struct sched_engine_stats st;
    sched_engine_get_stats(e, &st);
    CHECKF(st.sched.preemptions > 0, "no preemption");
    printf("  preemptions: %llu\n", (unsigned long long)st.sched.preemptions);
    int counted = 0;
    for (int i = 0; i < NP; i++) {
        CHECK(res[i].finish == SCHED_FINISH_LENGTH && res[i].n == PGEN);
        CHECKF(match(&rq[i], &solo[i], &res[i]), "request %d differs after preemption", i);
        counted += res[i].usage.n_preemptions;
    }
    CHECK((uint64_t)counted == st.sched.preemptions);
    CHECK(st.kv.blocks_used == 0 && st.kv.blocks_free + st.kv.blocks_cached == st.kv.blocks_total);
    sched_engine_destroy(e);
}

static void test_stop_string_and_refusal(void)
{
    sched_engine *e = engine(4, 256, 256, 64, false);
    if (!e) return;
    struct sched_request r = greedy(reqs[3].prompt, reqs[3].n_prompt, 12);
    struct result full, cut;
    run_one(e, &r, &full);
    CHECK(full.n == 12 && full.text_len > 6);
    /* stop at a piece of the middle of the text */
    size_t at = full.text_len / 2;
    char stop[4] = {full.text[at], full.text[at + 1], full.text[at + 2], 0};
    const char *stops[1] = {stop};
    r.stop = stops;
    r.n_stop = 1;
    run_one(e, &r, &cut);
    const char *hit = strstr(full.text, stop);
    CHECK(hit != NULL && cut.finish == SCHED_FINISH_STOP);
    CHECKF(hit && cut.text_len == (size_t)(hit - full.text) && !memcmp(cut.text, full.text, cut.text_len),
           "cut '%s' full '%s' stop '%s'", cut.text, full.text, stop);
    /* refusal at submit */
    r = greedy(text_ids, 250, 10);
    CHECK(sched_engine_submit(e, &r, NULL, err, sizeof err) == SL_EINVAL);
    CHECKF(strstr(err, "maximum context length is 256") != NULL, "%s", err);
    sched_engine_destroy(e);
}

static void test_abort(void)
{
    sched_engine *e = engine(4, 256, 256, 64, true);
    if (!e) return;
    struct result r;
    memset(&r, 0, sizeof r);
    struct sched_request rq = greedy(text_ids, 100, 150);
    rq.user = &r;
    uint64_t id;
    CHECK(sched_engine_submit(e, &rq, &id, err, sizeof err) == 0);
    struct sched_evbuf b;
    sched_evbuf_init(&b);
    CHECK(sched_engine_wait(e, &b, 60.0) > 0 && b.ev[0].kind == SCHED_EV_TOKEN);
    sched_engine_abort(e, id);
    bool aborted = false;
    for (int tries = 0; tries < 100 && !aborted; tries++) {
        int k = sched_engine_wait(e, &b, 10.0);
        for (int i = 0; i < k; i++)
            if (b.ev[i].kind == SCHED_EV_FINISH) aborted = b.ev[i].finish == SCHED_FINISH_ABORT;
    }
    CHECK(aborted);
    struct sched_engine_stats st;
    sched_engine_get_stats(e, &st);
    CHECK(st.kv.blocks_used == 0 && st.kv.blocks_free + st.kv.blocks_cached == st.kv.blocks_total);
    CHECK(__atomic_load_n(&n_notify, __ATOMIC_RELAXED) > 0); /* the consumer callback ran */
    sched_evbuf_deinit(&b);
    sched_engine_destroy(e);
}

/* Sinks: each request's events go to the sink it was submitted with and
 * nowhere else, each sink's notifier runs for its own events only, and a
 * sink that is gone drops the events of its requests still running. */
static int n_sink_notify[2];
static void on_sink(void *arg) { __atomic_add_fetch((int *)arg, 1, __ATOMIC_RELAXED); }

static void test_sinks(void)
{
    sched_engine *e = engine(4, 256, 256, 64, true);
    if (!e) return;
    sched_sink *k[2] = {sched_sink_create(e, on_sink, &n_sink_notify[0]), sched_sink_create(e, on_sink, &n_sink_notify[1])};
    CHECK(k[0] && k[1]);
    if (!k[0] || !k[1]) goto out;
    struct result r[3];
    memset(r, 0, sizeof r);
    for (int i = 0; i < 3; i++) {
        struct sched_request rq = greedy(text_ids + 10 * i, 20, 4);
        rq.user = &r[i];
        rq.sink = i < 2 ? k[i] : NULL; /* the third goes to the engine's own outbox */
        CHECKF(sched_engine_submit(e, &rq, NULL, err, sizeof err) == 0, "%s", err);
    }
    struct sched_evbuf b;
    sched_evbuf_init(&b);
    int finished[3] = {0}, tokens[3] = {0};
    for (int tries = 0; tries < 200 && !(finished[0] && finished[1] && finished[2]); tries++) {
        for (int s = 0; s < 3; s++) {
            int n = s < 2 ? sched_sink_wait(k[s], &b, 0.05) : sched_engine_wait(e, &b, 0.05);
            for (int i = 0; i < n; i++) {
                CHECKF(b.ev[i].user == &r[s], "sink %d got an event of another submitter", s);
                if (b.ev[i].user != &r[s]) continue;
                if (b.ev[i].kind == SCHED_EV_FINISH) finished[s]++;
                else tokens[s]++;
            }
        }
    }
    for (int s = 0; s < 3; s++) CHECKF(finished[s] == 1 && tokens[s] == 4, "submitter %d: %d finishes, %d tokens", s, finished[s], tokens[s]);
    CHECK(__atomic_load_n(&n_sink_notify[0], __ATOMIC_RELAXED) > 0 && __atomic_load_n(&n_sink_notify[1], __ATOMIC_RELAXED) > 0);
    /* a sink that goes away while its request runs: nothing arrives anywhere
     * else, and the request still ends (its blocks come back) */
    struct sched_request rq = greedy(text_ids, 100, 60);
    rq.user = &r[0];
    rq.sink = k[0];
    uint64_t id;
    CHECK(sched_engine_submit(e, &rq, &id, err, sizeof err) == 0);
    CHECK(sched_sink_wait(k[0], &b, 120.0) > 0 && b.ev[0].kind == SCHED_EV_TOKEN); /* it runs */
    sched_sink_destroy(k[0]);
    k[0] = NULL;
    sched_engine_abort(e, id);
    struct sched_engine_stats st;
    for (int tries = 0; tries < 1200; tries++) {
        CHECK(sched_engine_wait(e, &b, 0.05) == 0 && sched_sink_poll(k[1], &b) == 0);
        sched_engine_get_stats(e, &st);
        if (st.kv.blocks_used == 0 && st.sched.n_running == 0 && st.sched.n_waiting == 0) break;
    }
    CHECK(st.kv.blocks_used == 0 && st.sched.n_running == 0);
    sched_evbuf_deinit(&b);
out:
    sched_sink_destroy(k[0]);
    sched_sink_destroy(k[1]);
    sched_engine_destroy(e);
}

/* ---- request features: what the HTTP tests cover on the CPU, here at the
 * engine so that the GPU run covers them too ---- */

static bool is_stop_id(int32_t t)
{
    const int32_t *ids;
    int n = model_tok_stop_ids(model_get_tok(m), &ids);
    for (int i = 0; i < n; i++)
        if (ids[i] == t) return true;
    return false;
}

static bool in_result(const struct result *r, int32_t t)
{
    for (int i = 0; i < r->n; i++)
        if (r->tok[i] == t) return true;
    return false;
}

/* A normal, non-stop token of the text that r never generated (the one a
 * +100 bias then forces). */
static int32_t other_token(const struct result *r)
{
    const model_tok *tok = model_get_tok(m);
    for (int i = 0; i < n_text_ids; i++) {
        int32_t t = text_ids[i];
        if (!in_result(r, t) && !is_stop_id(t) && model_tok_attr(tok, t) == MODEL_TOK_NORMAL) return t;
    }
    return -1;
}

/* Checks r's output against a copy of the fresh recognizer g0: the generated
 * bytes (decoded by the tokenizer; a final stop token has none) and the
 * streamed text are never refused, and an output that ended at a stop token
 * is one complete object. */
static void check_json(const char *what, const struct result *r, const struct sched_guide *g0)
{
    char buf[4096];
    bool stopped = r->finish == SCHED_FINISH_STOP;
    CHECKF(r->done && r->n > 0 && r->n <= MAX_GEN && (stopped || r->finish == SCHED_FINISH_LENGTH),
           "%s: finish %s, %d tokens", what, sched_finish_name(r->finish), r->n);
    if (r->n <= 0) return;
    CHECKF(!stopped || is_stop_id(r->tok[r->n - 1]), "%s: stopped on %d", what, r->tok[r->n - 1]);
    long len = model_tok_decode(model_get_tok(m), r->tok, r->n - stopped, false, buf, sizeof buf - 1);
    CHECK(len > 0 && (size_t)len < sizeof buf);
    if (len <= 0 || (size_t)len >= sizeof buf) return;
    buf[len] = '\0';
    struct sched_guide g = *g0;
    long at = -1;
    for (long i = 0; i < len && at < 0; i++)
        if (!sched_guide_step(&g, (uint8_t)buf[i])) at = i;
    CHECKF(at < 0, "%s: byte %ld refused in '%s'", what, at, buf);
    CHECKF(at >= 0 || !stopped || sched_guide_done(&g), "%s: stopped before the object closed: '%s'", what, buf);
    g = *g0;
    bool ok = true;
    for (size_t i = 0; i < r->text_len && ok; i++) ok = sched_guide_step(&g, (uint8_t)r->text[i]);
    CHECKF(ok && (!stopped || sched_guide_done(&g)), "%s: streamed text '%s'", what, r->text);
    for (long i = 0; i < len; i++)
        if (buf[i] == '\n' || buf[i] == '\r' || buf[i] == '\t') buf[i] = ' ';
    printf("  %s: %s after %d tokens: %.80s\n", what, sched_finish_name(r->finish), r->n, buf);
}

/* JSON mode's mask cache as the engine uses it: a step's rows point into the
 * cache (sched_guide_mask_ref), so a mask handed out must survive every miss
 * of the same step (epoch), even more distinct states than the cache holds;
 * every mask, cached or computed, equals one computed from scratch. */
static void guide_at(struct sched_guide *g, const char *prefix, int depth, int ws)
{
    sched_guide_init(g);
    for (const char *p = prefix; *p; p++) CHECK(sched_guide_step(g, (uint8_t)*p));
    for (int i = 0; i < depth; i++) CHECK(sched_guide_step(g, '['));
    for (int i = 0; i < ws; i++) CHECK(sched_guide_step(g, ' '));
}

static void test_json_mask_cache(void)
{
    const model_tok *tok = model_get_tok(m);
    int n = model_tok_n_vocab(tok);
    struct sched_guide_vocab *v = sched_guide_vocab_create(tok), *fresh = sched_guide_vocab_create(tok);
    uint8_t *own = malloc((size_t)n), *own2 = malloc((size_t)n), *want = malloc((size_t)n), *got = malloc((size_t)n);
    CHECK(v && fresh && own && own2 && want && got);
    if (!v || !fresh || !own || !own2 || !want || !got) goto out;
    struct sched_guide a, g;
    guide_at(&a, "{\"a\":", 0, 0);
    sched_guide_mask(&a, fresh, NULL, 0, want);
    sched_guide_vocab_epoch(v);
    const uint8_t *pa = sched_guide_mask_ref(&a, v, NULL, 0, own);
    CHECK(pa == own && !memcmp(pa, want, (size_t)n)); /* computed: into own */
    const uint8_t *pa2 = sched_guide_mask_ref(&a, v, NULL, 0, own2);
    CHECK(pa2 != own2 && !memcmp(pa2, want, (size_t)n)); /* seen: the cached copy */
    int states = 0, bad = 0;
    for (int pass = 0; pass < 2; pass++) {
        for (int d = 0; d <= 20; d++)
            for (int w = 0; w <= 10; w++) {
                if (!d && !w) continue;
                guide_at(&g, "{\"a\":", d, w);
                const uint8_t *p = sched_guide_mask_ref(&g, v, NULL, 0, got);
                sched_guide_mask(&g, fresh, NULL, 0, own2);
                bad += memcmp(p, own2, (size_t)n) != 0;
                states += pass == 0;
            }
        /* the step's first mask was not replaced by the misses after it */
        if (pass == 0) CHECKF(!memcmp(pa2, want, (size_t)n), "a mask in use was overwritten by %d misses", states);
        sched_guide_vocab_epoch(v);
    }
    CHECKF(!bad, "%d of %d masks differ from masks computed from scratch", bad, 2 * states);
    CHECK(states > 128);
out:
    sched_guide_vocab_destroy(v);
    sched_guide_vocab_destroy(fresh);
    free(own), free(own2), free(want), free(got);
}

static void test_request_features(void)
{
    sched_engine *e = engine(8, 256, 512, 64, false);
    if (!e) return;
    const model_tok *tok = model_get_tok(m);
    const int32_t *p = reqs[3].prompt;
    int np = reqs[3].n_prompt;

    /* logit_bias: -100 bans the greedy first token, +100 forces another one */
    struct result base, res[4];
    struct sched_request r = greedy(p, np, 4);
    run_one(e, &r, &base);
    int32_t t0 = base.tok[0], u = other_token(&base);
    CHECK(base.n == 4 && u >= 0 && u != t0);
    struct model_logit_bias ban = {t0, -100.0f}, force = {u, 100.0f};
    struct sched_request rb[2] = {r, r};
    rb[0].sampling.logit_bias = &ban;
    rb[0].sampling.n_logit_bias = 1;
    rb[1].sampling.logit_bias = &force;
    rb[1].sampling.n_logit_bias = 1;
    run_all(e, rb, 2, res);
    CHECKF(res[0].n == 4 && res[0].tok[0] != t0, "banned %d came first", t0);
    CHECK(res[1].n == 4);
    for (int i = 0; i < res[1].n; i++) CHECKF(res[1].tok[i] == u, "token %d is %d, forced %d", i, res[1].tok[i], u);

    /* min_tokens: a stop id biased +100 ends the output at once, unless
     * min_tokens holds it back for that many tokens; once with the model's
     * stop ids, once with a request's stop_token_ids (honoured with ignore_eos) */
    const int32_t *stop_ids;
    int n_stop = model_tok_stop_ids(tok, &stop_ids);
    struct model_logit_bias eos_bias[8], u_bias = {u, 100.0f};
    int nb = 0;
    for (int i = 0; i < n_stop && nb < 8; i++) eos_bias[nb++] = (struct model_logit_bias){stop_ids[i], 100.0f};
    CHECKF(nb > 0, "the model has no stop ids");
    struct sched_request rm[4];
    for (int i = 0; i < 4; i++) {
        rm[i] = greedy(p, np, 8);
        rm[i].min_tokens = i % 2 ? 3 : 0;
        if (i < 2) {
            rm[i].ignore_eos = false;
            rm[i].sampling.logit_bias = eos_bias;
            rm[i].sampling.n_logit_bias = nb;
        } else {
            rm[i].stop_token_ids = &u;
            rm[i].n_stop_token_ids = 1;
            rm[i].sampling.logit_bias = &u_bias;
            rm[i].sampling.n_logit_bias = 1;
        }
    }
    run_all(e, rm, 4, res);
    for (int i = 0; i < 4; i++) {
        int want = rm[i].min_tokens + 1;
        int32_t last = res[i].n > 0 ? res[i].tok[res[i].n - 1] : -1;
        CHECKF(res[i].finish == SCHED_FINISH_STOP && res[i].n == want && res[i].usage.completion_tokens == want,
               "min_tokens %d (%s): %s after %d tokens", rm[i].min_tokens, i < 2 ? "eos" : "stop_token_ids",
               sched_finish_name(res[i].finish), res[i].n);
        CHECK(i < 2 ? is_stop_id(last) : last == u);
        for (int k = 0; k + 1 < res[i].n; k++)
            CHECKF(i < 2 ? !is_stop_id(res[i].tok[k]) : res[i].tok[k] != u, "request %d: stop id %d at %d", i,
                   res[i].tok[k], k);
    }

    /* JSON and schema mode, greedy and sampled, in one batch, next to a plain
     * request whose output the recognizer must refuse (so the check can fail) */
    const char *roles[1] = {"user"};
    const char *msgs[1] = {"Describe a cat as a JSON object with the keys \"name\" and \"ok\"."};
    char chat[512];
    model_chatml_render(roles, msgs, 1, true, chat, sizeof chat);
    int32_t jp[256];
    int njp = model_tok_encode(tok, chat, strlen(chat), false, true, jp, 256);
    CHECK(njp > 0 && njp <= 256);
    const char *schema_text = "{\"type\":\"object\",\"properties\":{\"name\":{\"type\":\"string\"},"
                              "\"ok\":{\"type\":\"boolean\"}},\"required\":[\"name\",\"ok\"]}";
    json_doc d;
    CHECKF(json_parse(&d, schema_text, strlen(schema_text), err, sizeof err) == 0, "%s", err);
    struct sched_schema *sc = sched_schema_compile(&d, 0, false, err, sizeof err);
    json_free(&d);
    CHECKF(sc != NULL, "%s", err);
    if (njp > 0 && njp <= 256 && sc) {
        enum { JGEN = 48 };
        struct sched_request rj[5];
        struct result jr[5];
        for (int i = 0; i < 4; i++) {
            rj[i] = greedy(jp, njp, JGEN);
            rj[i].ignore_eos = false;
            rj[i].json_object = i < 2;
            rj[i].schema = i < 2 ? NULL : sc;
            if (i % 2) {
                rj[i].sampling.temperature = 1.0f;
                rj[i].sampling.seed = 7 + (uint64_t)i;
            }
        }
        rj[4] = greedy(p, np, 8);
        run_all(e, rj, 5, jr);
        struct sched_guide gj, gs;
        sched_guide_init(&gj);
        sched_guide_init_schema(&gs, sc);
        check_json("json greedy", &jr[0], &gj);
        check_json("json sampled", &jr[1], &gj);
        check_json("schema greedy", &jr[2], &gs);
        check_json("schema sampled", &jr[3], &gs);
        struct sched_guide g = gj;
        bool refused = false;
        for (size_t i = 0; i < jr[4].text_len && !refused; i++) refused = !sched_guide_step(&g, (uint8_t)jr[4].text[i]);
        CHECKF(refused, "unconstrained text passes as JSON: '%s'", jr[4].text);
    }
    sched_schema_free(sc);

    /* seeded sampling: the same tokens twice alone, and in a batch beside
     * itself, a greedy request and another seed */
    struct sched_request rs = greedy(p, np, 12);
    rs.sampling.temperature = 0.8f;
    rs.sampling.top_p = 0.9f;
    rs.sampling.top_k = 20;
    rs.sampling.seed = 1234;
    rs.logprobs = true; /* match_sampled reads both runs' top-k */
    rs.sampling.top_logprobs = rs.sampling.top_k;
    struct result s1, s2;
    run_one(e, &rs, &s1);
    run_one(e, &rs, &s2);
    CHECK(s1.n == 12 && same(&s1, &s2));
    /* match_sampled's port of the sampler picks each token from its own
     * top-k and the seed's draws, but near a boundary */
    uint64_t rng = model_rng_seed(rs.sampling.seed);
    for (int i = 0; i < s1.n; i++) {
        bool near;
        int32_t t = draw_pick(model_rng_uniform(&rng), &s1.samp[i], &rs.sampling, &near);
        CHECKF(t == s1.tok[i] || near, "token %d: the draw picks %d, the sampler %d", i, t, s1.tok[i]);
    }
    struct sched_request rsb[4] = {reqs[0], rs, rs, rs};
    rsb[3].sampling.seed = 99;
    rsb[3].prompt = reqs[5].prompt;
    rsb[3].n_prompt = reqs[5].n_prompt;
    run_all(e, rsb, 4, res);
    CHECKF(same(&res[1], &res[2]), "seeded request differs from itself in one batch");
    CHECKF(match_sampled(&rs, &s1, &res[1]), "seeded request differs batched");
    CHECK(res[0].n == GEN && res[3].n == 12);
    sched_engine_destroy(e);
}


/* run-batch streams its input through a ring of 2 x 4 x max-num-seqs + 64
 * lines: 90 lines at --max-num-seqs 1 wrap the 72-line ring, and the output
 * still has every line once, in input order (valid and invalid mixed; some
 * with "n": 2, answered with two choices). */
static void test_run_batch_stream(void)
{
    const char *in = "build/tests/run_batch_stream_in.jsonl", *out = "build/tests/run_batch_stream_out.jsonl";
    FILE *f = fopen(in, "w");
    CHECK(f != NULL);
    if (!f) return;
    enum { NL = 90 };
    for (int i = 0; i < NL; i++) {
        if (i % 3 == 2)
            fprintf(f, "{\"custom_id\":\"c%d\",\"method\":\"GET\"}\n", i);
        else
            fprintf(f, "{\"custom_id\":\"c%d\",\"method\":\"POST\",\"url\":\"/v1/completions\",\"body\":"
                       "{\"prompt\":\"Number %d is\",\"max_tokens\":1,\"temperature\":0,\"n\":%d}}\n",
                    i, i, i % 5 == 0 ? 2 : 1);
    }
    fclose(f);
    char cmd[1024];
    snprintf(cmd, sizeof cmd,
             "build/sluice run-batch --model %s -i %s -o %s --max-num-seqs 1 --max-num-batched-tokens 64 "
             "--max-model-len 256 --kv-cache-memory 32M --quiet --device %s --tensor-parallel-size %d",
             g_path, in, out, g_device, g_tp);
    CHECK(system(cmd) == 0);
    f = fopen(out, "r");
    CHECK(f != NULL);
    if (!f) return;
    char line[8192], want[64];
    int k = 0, ok = 0;
    while (fgets(line, sizeof line, f)) {
        snprintf(want, sizeof want, "\"custom_id\":\"c%d\"", k);
        bool bad = k % 3 == 2;
        /* every fifth line asks for two choices */
        bool two = !bad && k % 5 == 0, has1 = strstr(line, "\"index\":1") != NULL;
        ok += strstr(line, want) && (bad ? strstr(line, "\"response\":null") != NULL
                                         : strstr(line, "\"status_code\":200") != NULL && two == has1);
        k++;
    }
    fclose(f);
    CHECKF(k == NL && ok == NL, "%d lines, %d as expected, of %d", k, ok, NL);
}

/* ---- speculative decoding ---- */

/* A quoting prompt: a passage, then its first words again, so that the
 * model goes on copying and n-gram drafts are accepted (the workload drafts
 * are for: an answer that quotes its document). */
enum { NQ = 4, QGEN = 16 };
static int32_t qprompt[NQ][160];
static struct sched_request qreq[NQ];
static struct result qref[NQ]; /* each alone, without drafts */

static void make_quotes(void)
{
    for (int i = 0; i < NQ; i++) {
        int off = 23 * i, body = 90 + 5 * i, lead = 6 + 3 * i;
        memcpy(qprompt[i], text_ids + off, sizeof(int32_t) * (size_t)body);
        memcpy(qprompt[i] + body, text_ids + off, sizeof(int32_t) * (size_t)lead);
        qreq[i] = greedy(qprompt[i], body + lead, QGEN);
    }
}

static void spec_counts(sched_engine *e, struct sched_stats *s)
{
    struct sched_engine_stats st;
    sched_engine_get_stats(e, &st);
    *s = st.sched;
}

static void check_spec_stats(const char *what, const struct sched_stats *s, bool want_accepts)
{
    uint64_t per_pos = 0;
    for (int i = 0; i < SCHED_MAX_SPEC_TOKENS; i++) per_pos += s->spec_accepted_per_pos[i];
    CHECKF(s->spec_drafts > 0 && s->spec_draft_tokens >= s->spec_drafts, "%s: %llu drafts, %llu draft tokens", what,
           (unsigned long long)s->spec_drafts, (unsigned long long)s->spec_draft_tokens);
    CHECKF(per_pos == s->spec_accepted_tokens && s->spec_accepted_tokens <= s->spec_draft_tokens,
           "%s: accepted %llu, per position %llu", what, (unsigned long long)s->spec_accepted_tokens,
           (unsigned long long)per_pos);
    if (want_accepts) CHECKF(s->spec_accepted_tokens > 0, "%s: no draft was accepted", what);
    printf("  %s: %llu verifications, %llu drafts, %llu accepted (mean accepted length %.2f)\n", what,
           (unsigned long long)s->spec_drafts, (unsigned long long)s->spec_draft_tokens,
           (unsigned long long)s->spec_accepted_tokens,
           s->spec_drafts ? 1.0 + (double)s->spec_accepted_tokens / (double)s->spec_drafts : 0.0);
}

/* Whether n-gram lookup (spec_engine's prompt_lookup 1..4) would have
 * proposed a right first draft somewhere along the reference outputs: a
 * model that does not repeat its context (a random one, e.g. dsv3-qlora)
 * has accepted drafts nowhere, so none are asked of it; one that copies the
 * quoted passage (the tiny dense models) must accept some. */
static bool lookup_hits(const struct sched_request *rq, const struct result *ref, int n)
{
    int32_t seq[1024], d[1];
    for (int i = 0; i < n; i++) {
        int np = rq[i].n_prompt;
        if (np + ref[i].n > (int)(sizeof seq / sizeof seq[0])) continue;
        memcpy(seq, rq[i].prompt, sizeof seq[0] * (size_t)np);
        memcpy(seq + np, ref[i].tok, sizeof seq[0] * (size_t)ref[i].n);
        /* the first token comes from the prefill and the last has no room
         * for drafts: the verified ones lie between */
        for (int j = 1; j < ref[i].n - 1; j++)
            if (sched_ngram_propose(seq, np + j, 1, 4, 1, d) == 1 && d[0] == ref[i].tok[j]) return true;
    }
    return false;
}

/* got's logprobs (and the top ones both list) against ref's over the tokens
 * before their first difference: on the CPU bitwise; on the GPU a verified
 * position's row comes from a multi-token step, whose kernels round
 * differently from a decode step's, so within NEAR_TIE_NATS (the bound
 * match_sampled puts on the same comparison). A verify that read the wrong
 * rows is off by whole nats. */
static void check_logprobs(const char *what, const struct result *ref, const struct result *got)
{
    bool cpu = !strcmp(g_device, "cpu");
    int n = ref->n < got->n ? ref->n : got->n, j = 0;
    while (j < n && ref->tok[j] == got->tok[j]) j++;
    for (int t = 0; t < j; t++) {
        const struct model_sample_out *a = &got->samp[t], *b = &ref->samp[t];
        bool eq = a->token == b->token && a->n_top == b->n_top &&
                  (cpu ? a->logprob == b->logprob : fabsf(a->logprob - b->logprob) < NEAR_TIE_NATS);
        for (int x = 0; eq && x < a->n_top; x++) {
            if (cpu) {
                eq = a->top_ids[x] == b->top_ids[x] && a->top_logprobs[x] == b->top_logprobs[x];
                continue;
            }
            for (int y = 0; y < b->n_top; y++)
                if (a->top_ids[x] == b->top_ids[y]) eq = fabsf(a->top_logprobs[x] - b->top_logprobs[y]) < NEAR_TIE_NATS;
        }
        CHECKF(eq, "%s: token %d: logprob %.6f with drafts, %.6f without", what, t, a->logprob, b->logprob);
    }
}

/* Greedy output with n-gram drafts is the output without them: batched,
 * chunked (a budget of 16 tokens), with prefix hits and with preemption.
 * On the GPU a verify step is multi-token, so it may round differently
 * from the decode steps of the run without drafts: a greedy split is
 * allowed there at a near-tie only (match()), as between batched and lone
 * runs. */
static void test_spec_greedy(void)
{
    if (be->max_draft_tokens < 3) {
        printf("  the %s backend verifies no drafts: skipped\n", be->ops->name);
        return;
    }
    make_quotes();
    sched_engine *e = engine(8, 256, 512, 64, false);
    if (!e) return;
    for (int i = 0; i < NQ; i++) run_one(e, &qreq[i], &qref[i]);
    sched_engine_destroy(e);
    bool repeats = lookup_hits(qreq, qref, NQ), repeats3 = lookup_hits(qreq, qref, 3);
    if (!repeats) printf("  n-gram lookup matches nowhere in the outputs without drafts: no accepts required\n");

    struct result res[NQ];
    struct sched_stats st;
    e = spec_engine(8, 256, 512, 64, false, 3, NULL);
    if (!e) return;
    run_all(e, qreq, NQ, res);
    for (int i = 0; i < NQ; i++) CHECKF(match(&qreq[i], &qref[i], &res[i]), "request %d differs with drafts, batched", i);
    spec_counts(e, &st);
    check_spec_stats("batched", &st, repeats);
    sched_engine_destroy(e);

    e = spec_engine(4, 16, 512, 64, false, 4, NULL);
    if (!e) return;
    run_all(e, qreq, 3, res);
    for (int i = 0; i < 3; i++) CHECKF(match(&qreq[i], &qref[i], &res[i]), "request %d differs with drafts, chunked", i);
    spec_counts(e, &st);
    check_spec_stats("chunked", &st, repeats3);
    sched_engine_destroy(e);

    e = spec_engine(8, 256, 512, 64, true, 2, NULL);
    if (!e) return;
    run_all(e, qreq, NQ, res);
    run_all(e, qreq, NQ, res); /* again: every prompt's full blocks are cached now */
    int cached = 0;
    for (int i = 0; i < NQ; i++) {
        CHECKF(match(&qreq[i], &qref[i], &res[i]), "request %d differs with drafts and a prefix hit", i);
        cached += res[i].usage.cached_tokens;
    }
    CHECKF(cached > 0, "no prefix hit");
    spec_counts(e, &st);
    check_spec_stats("prefix hits", &st, repeats);
    sched_engine_destroy(e);

    /* a pool of 16 blocks for four requests of up to 9 blocks */
    e = spec_engine(8, 32, 160, 16, true, 4, NULL); /* chunks of 32: admitted prompts grow into the pool */
    if (!e) return;
    run_all(e, qreq, NQ, res);
    for (int i = 0; i < NQ; i++) CHECKF(match(&qreq[i], &qref[i], &res[i]), "request %d differs with drafts and preemption", i);
    spec_counts(e, &st);
    CHECKF(st.preemptions > 0, "no preemption");
    check_spec_stats("preempted", &st, repeats);
    struct sched_engine_stats es;
    sched_engine_get_stats(e, &es);
    CHECK(es.kv.blocks_used == 0 && es.kv.blocks_free + es.kv.blocks_cached == es.kv.blocks_total);
    sched_engine_destroy(e);
}

/* max_tokens and stop strings end the output at the exact token even
 * inside a run of accepted drafts; logprobs are those of decoding without
 * drafts; a seeded sampled run gives the tokens it gives without drafts; a
 * drafter that is always wrong changes nothing but the speed; a guided
 * request decodes without drafts. */
static int wrong_drafts(void *arg, uint64_t id, const int32_t *tokens, int n, int k, int32_t *draft)
{
    (void)id;
    int nv = *(const int *)arg;
    for (int i = 0; i < k; i++) draft[i] = (tokens[n - 1] + 7 + 13 * i) % nv;
    return k;
}

static void test_spec_exact(void)
{
    if (be->max_draft_tokens < 4) return;
    sched_engine *e = spec_engine(16, 512, 512, 128, false, 4, NULL);
    if (!e) return;
    /* every max_tokens from 1 to 12 on the first quoting prompt */
    enum { NM = 12 };
    struct sched_request rm[NM];
    struct result res[NM];
    for (int i = 0; i < NM; i++) rm[i] = qreq[0], rm[i].max_tokens = i + 1;
    run_all(e, rm, NM, res);
    static struct result cut_ref; /* qref[0]'s first i + 1 tokens */
    for (int i = 0; i < NM; i++) {
        cut_ref = qref[0];
        cut_ref.n = i + 1;
        CHECKF(res[i].n == i + 1 && res[i].finish == SCHED_FINISH_LENGTH && match(&rm[i], &cut_ref, &res[i]),
               "max_tokens %d: %d tokens", i + 1, res[i].n);
    }
    cut_ref.n = NM; /* the longest run's drafts: where lookup finds the model's next token, some are accepted */
    bool repeats = lookup_hits(&qreq[0], &cut_ref, 1);
    /* a stop string at each of several places of the reference text */
    int n_cut = 0;
    for (int i = 0; i < NQ; i++) {
        const struct result *f = &qref[i];
        size_t at = f->text_len / 3 + (size_t)i;
        if (f->text_len < 12 || at + 3 >= f->text_len) continue;
        char stop[4] = {f->text[at], f->text[at + 1], f->text[at + 2], 0};
        const char *stops[1] = {stop};
        struct sched_request r = qreq[i];
        r.stop = stops;
        r.n_stop = 1;
        struct result cut;
        run_one(e, &r, &cut);
        const char *hit = strstr(f->text, stop);
        bool ok = hit && cut.finish == SCHED_FINISH_STOP && cut.text_len == (size_t)(hit - f->text) &&
                  !memcmp(cut.text, f->text, cut.text_len);
        if (!ok && strcmp(g_device, "cpu") && cut.n > 0 && cut.n <= f->n) {
            /* on the GPU the run with drafts may split from the reference at a near-tie before the stop */
            cut_ref = *f;
            cut_ref.n = cut.n;
            ok = !same(&cut_ref, &cut) && match(&r, &cut_ref, &cut);
        }
        CHECKF(ok, "request %d: cut '%s' full '%s' stop '%s'", i, cut.text, f->text, stop);
        n_cut++;
    }
    CHECK(n_cut >= 3);
    struct sched_stats st;
    spec_counts(e, &st);
    check_spec_stats("max_tokens and stop strings", &st, repeats);

    /* logprobs and a seeded sampled run: the same with and without drafts
     * (on the GPU: a split only where a near-tie or the draw explains it,
     * logprobs within a tolerance up to it) */
    struct sched_request rs[2] = {qreq[1], qreq[2]};
    rs[0].logprobs = true;
    rs[0].sampling.top_logprobs = 3;
    rs[1].logprobs = true;
    rs[1].sampling.temperature = 0.8f;
    rs[1].sampling.top_k = 20;
    rs[1].sampling.top_logprobs = 20; /* match_sampled reads both runs' top-k */
    rs[1].sampling.seed = 1234;
    struct result with[2], with2[2], without[2];
    run_all(e, rs, 2, with);
    run_all(e, rs, 2, with2);
    sched_engine_destroy(e);
    e = engine(8, 256, 512, 64, false);
    if (!e) return;
    run_all(e, rs, 2, without);
    sched_engine_destroy(e);
    CHECKF(match(&rs[0], &without[0], &with[0]) && match(&rs[0], &with[0], &with2[0]),
           "greedy run differs with drafts");
    CHECKF(match_sampled(&rs[1], &without[1], &with[1]) && match_sampled(&rs[1], &with[1], &with2[1]),
           "seeded run differs with drafts");
    check_logprobs("greedy", &without[0], &with[0]);
    check_logprobs("seeded", &without[1], &with[1]);

    /* an always-wrong drafter: acceptance near zero, the same output */
    int nv = model_tok_n_vocab(model_get_tok(m));
    struct sched_drafter bad = {.propose = wrong_drafts, .arg = &nv};
    e = spec_engine(8, 256, 512, 64, false, 3, &bad);
    if (!e) return;
    struct result res2[NQ];
    run_all(e, qreq, NQ, res2);
    for (int i = 0; i < NQ; i++) CHECKF(match(&qreq[i], &qref[i], &res2[i]), "request %d differs with wrong drafts", i);
    spec_counts(e, &st);
    check_spec_stats("wrong drafts", &st, false);
    CHECKF(st.spec_accepted_tokens * 10 <= st.spec_draft_tokens, "wrong drafts accepted: %llu of %llu",
           (unsigned long long)st.spec_accepted_tokens, (unsigned long long)st.spec_draft_tokens);
    /* a guided request decodes without drafts */
    struct sched_request rj = qreq[0];
    rj.json_object = true;
    rj.max_tokens = 8;
    struct sched_stats s0;
    spec_counts(e, &s0);
    struct result jr;
    run_one(e, &rj, &jr);
    spec_counts(e, &st);
    CHECKF(jr.n > 0 && st.spec_draft_tokens == s0.spec_draft_tokens, "a guided request carried drafts");
    sched_engine_destroy(e);
}

/* A backend that fails for good after `left` steps (a GPU or rank dying):
 * every request in flight finishes with an error event (no consumer waits
 * forever), the engine reports the failure and refuses new requests. */
struct dying {
    struct model_backend base;
    model_backend *inner;
    int left;
};
static size_t dying_block_bytes(model_backend *b, int bs)
{
    model_backend *in = ((struct dying *)b)->inner;
    return in->ops->kv_block_bytes(in, bs);
}
static int dying_kv_alloc(model_backend *b, int n, int bs, char *e, size_t el)
{
    model_backend *in = ((struct dying *)b)->inner;
    return in->ops->kv_alloc(in, n, bs, e, el);
}
static int dying_forward(model_backend *b, struct step *s, char *e, size_t el)
{
    struct dying *d = (struct dying *)b;
    if (d->left-- <= 0) {
        d->base.fatal = "GPU 1 fell off the bus (test)";
        snprintf(e, el, "%s", d->base.fatal);
        return SL_EDEVICE;
    }
    return d->inner->ops->forward(d->inner, s, e, el);
}
static void dying_destroy(model_backend *b) { (void)b; }

static void test_backend_fatal(void)
{
    static const struct model_backend_ops ops = {.name = "dying", .kv_block_bytes = dying_block_bytes,
                                                 .kv_alloc = dying_kv_alloc, .forward = dying_forward,
                                                 .destroy = dying_destroy};
    struct dying d = {.base = {.ops = &ops, .m = be->m}, .inner = be, .left = 3};
    model_backend *real = be;
    be = &d.base;
    sched_engine *e = engine(4, 256, 256, 64, false);
    be = real;
    if (!e) return;
    struct result res[4];
    struct sched_request rq[4];
    for (int i = 0; i < 4; i++) rq[i] = greedy(text_ids + 10 * i, 20 + i, 12);
    CHECK(!sched_engine_fatal(e, NULL, 0));
    run_all(e, rq, 4, res);
    for (int i = 0; i < 4; i++) CHECKF(res[i].done && res[i].finish == SCHED_FINISH_ERROR, "request %d finish %d", i, res[i].finish);
    char msg[128];
    CHECK(sched_engine_fatal(e, msg, sizeof msg) && strstr(msg, "fell off the bus"));
    struct sched_request r = greedy(text_ids, 10, 4);
    CHECK(sched_engine_submit(e, &r, NULL, err, sizeof err) == SL_EDEVICE && strstr(err, "fell off the bus"));
    sched_engine_destroy(e);
}

/* A row that cannot be sampled (out.token -1: its logits not finite) ends
 * that request with an error; the requests beside it in the same steps
 * finish as they would alone. */
static int32_t g_poison; /* first prompt token of the request whose rows fail */
static int poisoning_forward(model_backend *b, struct step *s, char *e, size_t el)
{
    model_backend *in = ((struct dying *)b)->inner;
    int rc = in->ops->forward(in, s, e, el);
    for (int i = 0; !rc && i < s->n_seqs; i++)
        if (s->seqs[i].want_sample && s->seqs[i].history[0] == g_poison) s->seqs[i].out.token = -1;
    return rc;
}

static void test_row_failure_isolated(void)
{
    static const struct model_backend_ops ops = {.name = "poisoning", .kv_block_bytes = dying_block_bytes,
                                                 .kv_alloc = dying_kv_alloc, .forward = poisoning_forward,
                                                 .destroy = dying_destroy};
    struct dying d = {.base = {.ops = &ops, .m = be->m}, .inner = be};
    model_backend *real = be;
    be = &d.base;
    sched_engine *e = engine(4, 256, 256, 64, false);
    be = real;
    if (!e) return;
    struct result res[3];
    struct sched_request rq[3] = {reqs[0], reqs[1], reqs[2]};
    g_poison = rq[1].prompt[0];
    CHECK(rq[0].prompt[0] != g_poison && rq[2].prompt[0] != g_poison);
    run_all(e, rq, 3, res);
    CHECK(res[1].done && res[1].finish == SCHED_FINISH_ERROR && res[1].n == 0);
    CHECK(same(&res[0], &alone[0]) && res[0].finish == SCHED_FINISH_LENGTH);
    CHECK(same(&res[2], &alone[2]) && res[2].finish == SCHED_FINISH_LENGTH);
    CHECK(!sched_engine_fatal(e, NULL, 0));
    sched_engine_destroy(e);
}

/* `sluice run-batch` end to end through the real binary: output in input
 * order, good lines answered, bad lines with error lines, the rest still run. */
static void test_run_batch(void)
{
    const char *in = "build/tests/run_batch_in.jsonl", *out = "build/tests/run_batch_out.jsonl";
    FILE *f = fopen(in, "w");
    CHECK(f != NULL);
    if (!f) return;
    fputs("{\"custom_id\":\"r0\",\"method\":\"POST\",\"url\":\"/v1/chat/completions\",\"body\":{\"model\":\"smol\","
          "\"messages\":[{\"role\":\"user\",\"content\":\"What is the capital of France?\"}],\"max_tokens\":6,"
          "\"temperature\":0}}\n"
          "this is not json\n"
          "{\"custom_id\":\"r2\",\"method\":\"POST\",\"url\":\"/v1/completions\",\"body\":{\"prompt\":\"Once upon a time\","
          "\"max_tokens\":5,\"temperature\":0,\"logprobs\":1}}\n"
          "\n"
          "{\"custom_id\":\"r3\",\"method\":\"POST\",\"url\":\"/v1/embeddings\",\"body\":{}}\n"
          "{\"custom_id\":\"r4\",\"method\":\"POST\",\"url\":\"/v1/chat/completions\",\"body\":{\"messages\":[],\"max_tokens\":3}}\n"
          "{\"custom_id\":\"r5\",\"method\":\"POST\",\"url\":\"/v1/chat/completions\",\"body\":{\"messages\":[{\"role\":\"user\","
          "\"content\":[{\"type\":\"text\",\"text\":\"Hi\"}]}],\"max_tokens\":4,\"temperature\":0,\"top_p\":1.5}}\n"
          "{\"custom_id\":\"r6\",\"method\":\"POST\",\"url\":\"/v1/completions\",\"body\":{\"model\":\"other\",\"prompt\":\"x\"}}\n"
          "{\"custom_id\":\"r7\",\"method\":\"POST\",\"url\":\"/v1/completions\",\"body\":{\"prompt\":\"The river\","
          "\"max_tokens\":900}}\n"
          "{\"custom_id\":\"r8\",\"method\":\"POST\",\"url\":\"/v1/chat/completions\",\"body\":{\"messages\":[{\"role\":\"user\","
          "\"content\":[{\"type\":\"text\",\"text\":\"Hi\"}]}],\"max_completion_tokens\":4,\"temperature\":0}}\n",
          f);
    fclose(f);
    char cmd[1024];
    snprintf(cmd, sizeof cmd,
             "build/sluice run-batch --model %s --served-model-name smol -i %s -o %s --max-model-len 512 "
             "--kv-cache-memory 64M --quiet --device %s --tensor-parallel-size %d --gpu-memory-utilization 0.85",
             g_path, in, out, g_device, g_tp);
    CHECK(system(cmd) == 0);
    {
        /* usage errors, before the model loads: vLLM's --gpu-memory-utilization
         * is a fraction in (0, 1]; --kv-cache-dtype fp8 needs the GPU, and
         * fp8_e5m2 or an unknown dtype is refused */
        const char *flags[] = {"--gpu-memory-utilization 1.5", "--kv-cache-dtype fp8 --device cpu",
                               "--kv-cache-dtype fp8_e5m2", "--kv-cache-dtype bf8"};
        for (int i = 0; i < 4; i++) {
            char bad[1024];
            snprintf(bad, sizeof bad, "build/sluice run-batch --model %s -i %s -o %s.bad %s 2>/dev/null", g_path, in, out,
                     flags[i]);
            int st = system(bad);
            CHECKF(WIFEXITED(st) && WEXITSTATUS(st) == 2, "%s: status %d", flags[i], st);
        }
    }
    f = fopen(out, "r");
    CHECK(f != NULL);
    if (!f) return;
    /* expected per line: custom_id, status (0 = response null) */
    const char *ids[] = {"r0", NULL, "r2", "r3", "r4", "r5", "r6", "r7", "r8"};
    int status[] = {200, 0, 200, 0, 400, 400, 404, 400, 200};
    char line[65536];
    int k = 0;
    while (fgets(line, sizeof line, f)) {
        json_doc d;
        CHECKF(json_parse(&d, line, strlen(line), err, sizeof err) == 0, "line %d: %s", k, err);
        if (k >= 9) {
            k++;
            json_free(&d);
            continue;
        }
        int cid = json_get(&d, 0, "custom_id"), resp = json_get(&d, 0, "response"), e = json_get(&d, 0, "error");
        CHECK(json_str_eq(&d, json_get(&d, 0, "id"), "") == false);
        if (ids[k]) CHECKF(cid >= 0 && json_str_eq(&d, cid, ids[k]), "line %d: custom_id", k);
        else CHECK(cid >= 0 && json_is_null(&d, cid));
        if (status[k] == 0) {
            CHECKF(resp >= 0 && json_is_null(&d, resp) && e >= 0 && json_is_obj(&d, e), "line %d", k);
            CHECK(json_get(&d, e, "message") >= 0 && json_get(&d, e, "code") >= 0);
        } else {
            int64_t sc = 0;
            CHECKF(resp >= 0 && json_i64(&d, json_get(&d, resp, "status_code"), &sc) == 0 && sc == status[k],
                   "line %d: status %lld, want %d", k, (long long)sc, status[k]);
            int body = json_get(&d, resp, "body");
            CHECK(body >= 0 && json_is_obj(&d, body) && json_is_null(&d, e));
            if (status[k] == 200) {
                int usage = json_get(&d, body, "usage");
                int det = usage >= 0 ? json_get(&d, usage, "prompt_tokens_details") : -1;
                CHECKF(det >= 0 && json_get(&d, det, "cached_tokens") >= 0, "line %d: no cached_tokens", k);
                int choices = json_get(&d, body, "choices");
                int c0 = choices >= 0 ? json_at(&d, choices, 0) : -1;
                CHECK(c0 >= 0 && json_get(&d, c0, "finish_reason") >= 0);
                CHECK(json_str_eq(&d, json_get(&d, body, "model"), "smol"));
                if (k == 2) CHECK(json_is_obj(&d, json_get(&d, c0, "logprobs")));
            } else {
                int eo = json_get(&d, body, "error");
                CHECK(eo >= 0 && json_get(&d, eo, "message") >= 0);
                if (k == 5) CHECK(json_str_eq(&d, json_get(&d, eo, "param"), "top_p"));
            }
        }
        json_free(&d);
        k++;
    }
    fclose(f);
    CHECKF(k == 9, "%d output lines for 9 input lines", k);
}

#ifdef SLUICE_CUDA
#include "cuda/tuning.h"
#endif

/* --gemm-wg-min-t=N (a CUDA build; tests/gpu/run.sh check): the fused
 * gate|up GEMM from N tokens a step, so that short steps reach it too */
int main(int argc, char **argv)
{
    struct model_load_opts lo = {0};
    for (int i = 1; i < argc; i++) {
#ifdef SLUICE_CUDA
        if (!strncmp(argv[i], "--gemm-wg-min-t=", 16) && atoi(argv[i] + 16) > 0) {
            cuda_tuning.gemm_wg_min_t = atoi(argv[i] + 16);
            continue;
        }
#endif
        fprintf(stderr, "unknown argument %s\n", argv[i]);
        return 2;
    }
    if (getenv("SLUICE_TEST_MODEL")) g_path = getenv("SLUICE_TEST_MODEL");
    if (getenv("SLUICE_TEST_DEVICE")) g_device = getenv("SLUICE_TEST_DEVICE");
    if (getenv("SLUICE_TEST_TP")) g_tp = atoi(getenv("SLUICE_TEST_TP"));
    m = model_load(g_path, &lo, err, sizeof err);
    if (!m) {
        printf("cannot load %s: %s\n", g_path, err);
        return 1;
    }
    struct model_backend_opts bo = {.device = g_device, .max_tokens_per_step = 1024, .max_seqs_per_step = 64,
                                    .max_ctx = 512, .tensor_parallel_size = g_tp, .max_draft_tokens = 4,
                                    .kv_cache_dtype = getenv("SLUICE_TEST_KV")};
    printf("engine on %s, device %s, %d rank(s)%s%s\n", g_path, g_device, g_tp, bo.kv_cache_dtype ? ", KV cache " : "",
           bo.kv_cache_dtype ? bo.kv_cache_dtype : "");
    be = model_backend_create(m, &bo, err, sizeof err);
    if (!be) {
        printf("backend: %s\n", err);
        return 1;
    }
    const char *text =
        "The river rose through the night, and by morning the low fields along the valley were under "
        "water. Farmers moved their animals to the hills, and the old mill by the bridge, which had stood "
        "for two hundred years, let the flood pass through its open sluice gates as it always had. In the "
        "town, the baker opened late; the school stayed closed; the children watched the brown water from "
        "the church steps and counted the trees that floated by. By noon the rain stopped. The mayor spoke "
        "on the radio about sandbags, pumps and the long work of cleaning up, and asked everyone who had a "
        "boat to help the families on the east bank, where the water was deepest. Many answered. A "
        "fisherman named Tomas made eleven trips before dark, carrying people, dogs, a piano bench and a "
        "crate of hens. When the water finally went down, three days later, the valley smelled of mud and "
        "cut grass, and the mill wheel began, slowly, to turn again. Everyone agreed that the sluice had "
        "saved the lower town, and the council voted to repair the old gates before the next spring, when "
        "the snow on the mountains would melt and the river would rise once more, as it did every year, "
        "reminding the valley that water always finds its way.";
    n_text_ids = model_tok_encode(model_get_tok(m), text, strlen(text), false, false, text_ids, 2048);
    if (n_text_ids < 600) {
        /* the text is repeated to reach the slices the tests take */
        for (int i = n_text_ids; i < 700 && n_text_ids > 0; i++) text_ids[i] = text_ids[i % n_text_ids];
        n_text_ids = 700;
    }
    make_reqs();
    RUN(test_alone);
    RUN(test_batch_invariance);
    RUN(test_time_policy);
    RUN(test_chunked_prefill);
    RUN(test_prefix_reuse);
    RUN(test_preemption);
    RUN(test_stop_string_and_refusal);
    RUN(test_abort);
    RUN(test_sinks);
    RUN(test_request_features);
    RUN(test_json_mask_cache);
    RUN(test_spec_greedy);
    RUN(test_spec_exact);
    RUN(test_backend_fatal);
    RUN(test_row_failure_isolated);
    RUN(test_run_batch);
    RUN(test_run_batch_stream);
    model_backend_destroy(be);
    model_free(m);
    if (strcmp(g_device, "cpu"))
        printf("near-ties (a batched, chunked, cached or preempted run's greedy token != the lone run's, top-2 within "
               "%.2f nats; or a seeded token's split the draw explains): %d\n", NEAR_TIE_NATS, n_near_ties);
    return test_summary();
}

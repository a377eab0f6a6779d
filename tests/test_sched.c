/* test_sched.c - the scheduler's step plans, asserted exactly, on a fake
 * forward pass: the sampled token is a fixed function of the sequence's
 * history, so a recomputed (preempted) sequence must produce the same ids. */
#include <math.h>
#include <stdint.h>
#include <string.h>

#define PCRE2_CODE_UNIT_WIDTH 8
#include <pcre2.h>

#include "kvpool/kvpool.h"
#include "model/backend.h"
#include "model/gguf.h"
#include "model/tokenizer.h"
#include "sched/sched.h"
#include "test.h"

static char err[512];

/* events collected by the emit callback */
#define MAX_EV 4096
static struct sched_event evs[MAX_EV];
static int n_ev;
static void collect(void *arg, const struct sched_event *ev)
{
    (void)arg;
    if (n_ev < MAX_EV) evs[n_ev++] = *ev;
}

/* the fake model's token after a history of n tokens whose last is prev */
static int32_t fake_next(int32_t prev, int n)
{
    uint32_t h = (uint32_t)prev * 2654435761u + (uint32_t)n * 40503u;
    return (int32_t)(h % 1000u);
}

static int32_t fake_token(const int32_t *hist, int n) { return fake_next(hist[n - 1], n); }

/* The fake backend: checks the plan's invariants, then "samples". */
static void fake_forward(struct step *st, int block_size)
{
    for (int i = 0; i < st->n_seqs; i++) {
        struct step_seq *q = &st->seqs[i];
        for (int t = q->query_start; t < q->query_start + q->query_len; t++) {
            int p = st->positions[t];
            CHECK(p == q->context_len - q->query_len + (t - q->query_start));
            CHECK(st->slots[t] == (int64_t)q->block_table[p / block_size] * block_size + p % block_size);
            CHECK(st->token_ids[t] == q->history[p]);
        }
        if (q->n_draft > 0) { /* verification: the fake token at each position, while it is the draft */
            CHECK(q->want_sample && q->query_len == q->n_draft + 1 && q->spec_out);
            int n = 0;
            for (int i = 0; i <= q->n_draft; i++) {
                int32_t tk = fake_token(q->history, q->n_history + i);
                memset(&q->spec_out[n], 0, sizeof q->spec_out[n]);
                q->spec_out[n++].token = tk;
                if (i == q->n_draft || tk != q->history[q->n_history + i]) break;
            }
            q->n_spec_out = n;
        } else if (q->want_sample) {
            q->out.token = fake_token(q->history, q->n_history);
        }
    }
}

static struct sched_request req(const int32_t *prompt, int n, int max_tokens, enum sched_priority prio)
{
    struct sched_request r;
    memset(&r, 0, sizeof r);
    r.prompt = prompt;
    r.n_prompt = n;
    r.max_tokens = max_tokens;
    r.priority = prio;
    model_sampling_default(&r.sampling);
    return r;
}

static sched *mk(kv_pool *p, int seqs, int budget, int max_len, float share)
{
    struct sched_config c = {.block_size = kv_pool_block_size(p), .max_num_seqs = seqs,
                             .max_num_batched_tokens = budget, .max_model_len = max_len,
                             .min_batch_share = share};
    sched *s = sched_create(&c, p, NULL, err, sizeof err);
    CHECKF(s != NULL, "%s", err);
    return s;
}

static uint64_t submit(sched *s, const struct sched_request *r, uint64_t id)
{
    sched_req *q = sched_req_create(s, r, id, err, sizeof err);
    CHECKF(q != NULL, "%s", err);
    if (q) sched_add(s, q);
    return id;
}

static void test_step_composition(void)
{
    kv_pool *p = kv_pool_create(64, 4, false, err, sizeof err);
    sched *s = mk(p, 4, 8, 64, 0.0f);
    int32_t a[10], b[3];
    for (int i = 0; i < 10; i++) a[i] = 100 + i;
    for (int i = 0; i < 3; i++) b[i] = 200 + i;
    struct sched_request ra = req(a, 10, 3, SCHED_PRIO_BATCH), rb = req(b, 3, 2, SCHED_PRIO_BATCH);
    submit(s, &ra, 1);
    submit(s, &rb, 2);
    struct step st;
    n_ev = 0;
    /* step 1: A's first chunk fills the budget */
    CHECK(sched_plan_step(s, &st) == 8);
    CHECK(st.n_seqs == 1 && sched_step_req_id(s, 0) == 1);
    CHECK(st.seqs[0].query_len == 8 && st.seqs[0].context_len == 8 && !st.seqs[0].want_sample);
    for (int t = 0; t < 8; t++) CHECK(st.token_ids[t] == 100 + t && st.positions[t] == t);
    fake_forward(&st, 4);
    sched_complete_step(s, &st, collect, NULL);
    CHECK(n_ev == 0);
    /* step 2: A's last 2 prompt tokens (sampled), then B admitted whole */
    CHECK(sched_plan_step(s, &st) == 5);
    CHECK(st.n_seqs == 2 && sched_step_req_id(s, 0) == 1 && sched_step_req_id(s, 1) == 2);
    CHECK(st.seqs[0].query_start == 0 && st.seqs[0].query_len == 2 && st.seqs[0].context_len == 10 &&
          st.seqs[0].want_sample);
    CHECK(st.positions[0] == 8 && st.positions[1] == 9 && st.token_ids[1] == 109);
    CHECK(st.seqs[1].query_start == 2 && st.seqs[1].query_len == 3 && st.seqs[1].want_sample);
    CHECK(st.token_ids[2] == 200 && st.positions[2] == 0 && st.positions[4] == 2);
    fake_forward(&st, 4);
    sched_complete_step(s, &st, collect, NULL);
    CHECK(n_ev == 2 && evs[0].kind == SCHED_EV_TOKEN && evs[0].id == 1 && evs[1].id == 2);
    /* step 3: two decodes at positions 10 and 3 */
    CHECK(sched_plan_step(s, &st) == 2);
    CHECK(st.n_seqs == 2 && st.positions[0] == 10 && st.positions[1] == 3);
    CHECK(st.token_ids[0] == evs[0].token && st.token_ids[1] == evs[1].token);
    CHECK(st.seqs[0].n_history == 11 && st.seqs[0].n_prompt == 10);
    fake_forward(&st, 4);
    sched_complete_step(s, &st, collect, NULL);
    /* B (max_tokens 2) finished with "length" */
    CHECK(n_ev == 5 && evs[4].kind == SCHED_EV_FINISH && evs[4].id == 2 &&
          evs[4].finish == SCHED_FINISH_LENGTH && evs[4].usage.completion_tokens == 2 &&
          evs[4].usage.prompt_tokens == 3);
    CHECK(sched_plan_step(s, &st) == 1);
    fake_forward(&st, 4);
    sched_complete_step(s, &st, collect, NULL);
    CHECK(!sched_has_work(s));
    CHECK(sched_plan_step(s, &st) == 0);
    CHECK(kv_pool_available(p) == 64);
    sched_destroy(s);
    kv_pool_destroy(p);
}

/* With the budget saturated by batch prefills, an interactive request is
 * admitted in the very next step. */
static void test_priority(void)
{
    kv_pool *p = kv_pool_create(256, 16, false, err, sizeof err);
    sched *s = mk(p, 8, 32, 512, 0.0f);
    int32_t big[300], small[5];
    for (int i = 0; i < 300; i++) big[i] = i;
    for (int i = 0; i < 5; i++) small[i] = 900 + i;
    struct sched_request rb = req(big, 300, 4, SCHED_PRIO_BATCH), ri = req(small, 5, 4, SCHED_PRIO_INTERACTIVE);
    submit(s, &rb, 1);
    submit(s, &rb, 2);
    struct step st;
    CHECK(sched_plan_step(s, &st) == 32 && st.n_seqs == 1);
    fake_forward(&st, 16);
    sched_complete_step(s, &st, collect, NULL);
    submit(s, &ri, 3);
    CHECK(sched_plan_step(s, &st) == 32);
    CHECK(st.n_seqs == 2 && sched_step_req_id(s, 0) == 3 && st.seqs[0].query_len == 5);
    CHECK(sched_step_req_id(s, 1) == 1 && st.seqs[1].query_len == 27);
    fake_forward(&st, 16);
    sched_complete_step(s, &st, collect, NULL);
    /* next step: the interactive decode comes first */
    CHECK(sched_plan_step(s, &st) == 32 && sched_step_req_id(s, 0) == 3 && st.seqs[0].query_len == 1);
    sched_destroy(s);
    kv_pool_destroy(p);
}

/* A long interactive prompt cannot take the batch share when batch waits. */
static void test_min_batch_share(void)
{
    kv_pool *p = kv_pool_create(256, 16, false, err, sizeof err);
    sched *s = mk(p, 8, 32, 512, 0.25f);
    int32_t big[300];
    for (int i = 0; i < 300; i++) big[i] = i;
    struct sched_request ri = req(big, 300, 4, SCHED_PRIO_INTERACTIVE), rb = req(big, 200, 4, SCHED_PRIO_BATCH);
    submit(s, &ri, 1);
    submit(s, &rb, 2);
    struct step st;
    CHECK(sched_plan_step(s, &st) == 32);
    CHECK(st.n_seqs == 2 && st.seqs[0].query_len == 24 && st.seqs[1].query_len == 8);
    fake_forward(&st, 16);
    sched_complete_step(s, &st, collect, NULL);
    sched_destroy(s);
    /* no batch work: the interactive request gets everything */
    s = mk(p, 8, 32, 512, 0.25f);
    submit(s, &ri, 1);
    CHECK(sched_plan_step(s, &st) == 32 && st.n_seqs == 1);
    sched_destroy(s);
    kv_pool_destroy(p);
}

static int one_step(sched *s, struct step *st, int bs);
static bool in_step(uint64_t id);

static int drain(sched *s, kv_pool *p, int bs);


/* 1000 prompt ids, 0..996 then 0..2, for the budget tests. */
static const int32_t *ramp(void)
{
    static int32_t ids[1000];
    for (int i = 0; i < 1000; i++) ids[i] = i % 997;
    return ids;
}

/* A scheduler over p with a long interactive prompt (600 tokens of ramp())
 * that has run its first step of 64: budget 64, 4 sequences. */
static sched *long_prompt_started(kv_pool *p, struct sched_request *rl)
{
    struct sched_config c = {.block_size = 16, .max_num_seqs = 4, .max_num_batched_tokens = 64, .max_model_len = 1024};
    sched *s = sched_create(&c, p, NULL, err, sizeof err);
    struct step st;
    *rl = req(ramp(), 600, 2, SCHED_PRIO_INTERACTIVE);
    submit(s, rl, 1);
    CHECK(one_step(s, &st, 16) == 64);
    return s;
}

/* Interactive prompts that arrive beside a long one's prefill start in the
 * next step: the running prefill leaves the waiting ones room (up to half
 * the budget), and running prefills go fewest tokens left first. */
static void test_interactive_room(void)
{
    const int32_t *big = ramp();
    kv_pool *p = kv_pool_create(128, 16, false, err, sizeof err);
    struct sched_request rl, r10 = req(big + 600, 10, 8, SCHED_PRIO_INTERACTIVE),
                             r100 = req(big + 700, 100, 2, SCHED_PRIO_INTERACTIVE);
    sched *s = long_prompt_started(p, &rl);
    struct step st;
    /* a 10-token chat: the long prompt leaves it 10 */
    submit(s, &r10, 2);
    int n = one_step(s, &st, 16);
    CHECKF(n == 64 && st.n_seqs == 2 && st.seqs[0].query_len == 54 && st.seqs[1].query_len == 10,
           "beside a 10-token chat: step %d, %d seqs, %d + %d", n, st.n_seqs, st.seqs[0].query_len,
           st.n_seqs > 1 ? st.seqs[1].query_len : -1);
    /* a 100-token chat: room for half the budget; the 10-token chat decodes */
    submit(s, &r100, 3);
    n = one_step(s, &st, 16);
    CHECKF(n == 64 && st.n_seqs == 3 && st.seqs[1].query_len == 31 && st.seqs[2].query_len == 32,
           "beside a 100-token chat: step %d, %d seqs, long %d, chat %d", n, st.n_seqs, st.seqs[1].query_len,
           st.n_seqs > 2 ? st.seqs[2].query_len : -1);
    /* the chat's 68 left go before the long prompt's 465, then the rest */
    n = one_step(s, &st, 16);
    CHECKF(n == 64 && st.n_seqs == 2 && st.seqs[1].query_len == 63 && st.seqs[1].context_len == 95,
           "then: step %d, %d seqs, %d tokens to %d", n, st.n_seqs, st.seqs[1].query_len, st.seqs[1].context_len);
    n = one_step(s, &st, 16);
    CHECKF(n == 64 && st.n_seqs == 3 && st.seqs[1].query_len == 5 && st.seqs[2].query_len == 58,
           "and: step %d, %d seqs, %d + %d", n, st.n_seqs, st.seqs[1].query_len, st.n_seqs > 2 ? st.seqs[2].query_len : -1);
    sched_destroy(s);
    kv_pool_destroy(p);
}

/* long_prefill_token_threshold (vLLM's flag): every prefill, of either
 * class, running or admitted, moves by at most that many tokens a step. */
static void test_long_prefill_threshold(void)
{
    static int32_t big[200];
    for (int i = 0; i < 200; i++) big[i] = i;
    kv_pool *p = kv_pool_create(64, 16, false, err, sizeof err);
    struct sched_config c = {.block_size = 16, .max_num_seqs = 4, .max_num_batched_tokens = 64, .max_model_len = 256,
                             .long_prefill_token_threshold = 10};
    sched *s = sched_create(&c, p, NULL, err, sizeof err);
    struct sched_request a = req(big, 25, 2, SCHED_PRIO_INTERACTIVE), b = req(big + 50, 6, 2, SCHED_PRIO_INTERACTIVE),
                         d = req(big + 100, 30, 2, SCHED_PRIO_BATCH);
    submit(s, &a, 1);
    submit(s, &b, 2);
    submit(s, &d, 3);
    struct step st;
    int n = one_step(s, &st, 16);
    CHECKF(n == 26 && st.n_seqs == 3 && st.seqs[0].query_len == 10 && st.seqs[1].query_len == 6 &&
               st.seqs[2].query_len == 10, "first step: %d tokens in %d seqs", n, st.n_seqs);
    /* b decodes; a and d move by 10 again (b's decode first, then a, then d) */
    n = one_step(s, &st, 16);
    CHECKF(n == 21 && st.n_seqs == 3 && st.seqs[1].query_len == 10 && st.seqs[2].query_len == 10,
           "second step: %d tokens in %d seqs", n, st.n_seqs);
    sched_destroy(s);
    c.long_prefill_token_threshold = -1;
    CHECK(sched_create(&c, p, NULL, err, sizeof err) == NULL && strstr(err, "long_prefill_token_threshold -1"));
    kv_pool_destroy(p);
}

/* vLLM's limits on concurrent partial prefills: with 2 prompts a step, 1
 * of them long, a second long prompt waits in its place while the short
 * ones behind it start; at the default (1) any number move; bad limits are
 * refused. The threshold (20) both defines long and caps a chunk. */
static void test_partial_prefills(void)
{
    static int32_t big[200];
    for (int i = 0; i < 200; i++) big[i] = i;
    for (int prio = 0; prio < SCHED_N_PRIO; prio++)
        for (int lim = 1; lim <= 2; lim++) {
            kv_pool *p = kv_pool_create(64, 16, false, err, sizeof err);
            struct sched_config c = {.block_size = 16, .max_num_seqs = 8, .max_num_batched_tokens = 64,
                                     .max_model_len = 256, .long_prefill_token_threshold = 20,
                                     .max_num_partial_prefills = lim, .max_long_partial_prefills = 1};
            sched *s = sched_create(&c, p, NULL, err, sizeof err);
            CHECKF(s != NULL, "%s", err);
            struct sched_request a = req(big, 100, 2, prio), b = req(big + 100, 40, 2, prio),
                                 cc = req(big + 150, 8, 2, prio), d = req(big + 170, 6, 2, prio);
            submit(s, &a, 1), submit(s, &b, 2), submit(s, &cc, 3), submit(s, &d, 4);
            struct step st;
            int n = one_step(s, &st, 16);
            if (lim == 1)
                CHECKF(n == 54 && in_step(1) && in_step(2) && in_step(3) && in_step(4),
                       "prio %d, no limit: first step %d tokens", prio, n);
            else
                CHECKF(n == 28 && in_step(1) && !in_step(2) && in_step(3) && !in_step(4),
                       "prio %d, 2 prompts (1 long): first step %d tokens, b %d d %d", prio, n, in_step(2), in_step(4));
            if (lim == 2) {
                /* c decodes, a moves, d passes the waiting b */
                n = one_step(s, &st, 16);
                CHECKF(n == 27 && in_step(1) && !in_step(2) && in_step(3) && in_step(4), "prio %d: second step %d tokens",
                       prio, n);
                int steps = 2;
                while (!in_step(2) && steps < 20) one_step(s, &st, 16), steps++;
                CHECKF(steps == 5, "prio %d: b started in step %d (a's prompt takes 5)", prio, steps);
            }
            CHECK(drain(s, p, 16) > 0 && !sched_has_work(s));
            sched_destroy(s);
            kv_pool_destroy(p);
        }
    /* the budget shared: a long prompt and a short one behind it move
     * together, 32 + 8 of 64 tokens; once alone, the long one takes it all
     * (no threshold: long is more than 4% of max_model_len, 10 tokens) */
    {
        kv_pool *p = kv_pool_create(64, 16, false, err, sizeof err);
        struct sched_config c = {.block_size = 16, .max_num_seqs = 8, .max_num_batched_tokens = 64,
                                 .max_model_len = 256, .max_num_partial_prefills = 2, .max_long_partial_prefills = 1};
        sched *s = sched_create(&c, p, NULL, err, sizeof err);
        struct sched_request a = req(big, 200, 2, SCHED_PRIO_BATCH), cc = req(big + 150, 8, 2, SCHED_PRIO_BATCH);
        submit(s, &a, 1), submit(s, &cc, 2);
        struct step st;
        int n = one_step(s, &st, 16);
        CHECKF(n == 40 && st.n_seqs == 2 && st.seqs[0].query_len == 32 && st.seqs[1].query_len == 8,
               "shared step: %d tokens in %d seqs", n, st.n_seqs);
        n = one_step(s, &st, 16);
        CHECKF(n == 64 && st.n_seqs == 2 && st.seqs[1].query_len == 63, "alone: %d tokens", n);
        CHECK(drain(s, p, 16) > 0 && !sched_has_work(s));
        sched_destroy(s);
        kv_pool_destroy(p);
    }
    /* every slot taken (two batch decodes, one long chat prompt): a second
     * long chat that the limits hold back takes no batch sequence's slot
     * (it could not start; batch would only take the slot back) until the
     * first one's prompt is short */
    {
        kv_pool *p = kv_pool_create(64, 16, false, err, sizeof err);
        struct sched_config c = {.block_size = 16, .max_num_seqs = 3, .max_num_batched_tokens = 64,
                                 .max_model_len = 256, .long_prefill_token_threshold = 20,
                                 .max_num_partial_prefills = 2, .max_long_partial_prefills = 1};
        sched *s = sched_create(&c, p, NULL, err, sizeof err);
        struct sched_request b1 = req(big, 4, 40, SCHED_PRIO_BATCH), b2 = req(big + 10, 4, 40, SCHED_PRIO_BATCH),
                             a = req(big + 20, 100, 2, SCHED_PRIO_INTERACTIVE),
                             b = req(big + 130, 60, 2, SCHED_PRIO_INTERACTIVE);
        submit(s, &b1, 1), submit(s, &b2, 2);
        struct step st;
        one_step(s, &st, 16);
        submit(s, &a, 3);
        one_step(s, &st, 16);
        submit(s, &b, 4);
        struct sched_stats ss;
        int steps = 0;
        for (; steps < 3; steps++) one_step(s, &st, 16); /* a: 40, 60, 80 of 100 tokens */
        sched_get_stats(s, &ss);
        CHECKF(ss.preemptions == 0 && !in_step(4), "a held-back long chat: %llu preemptions, in step %d",
               (unsigned long long)ss.preemptions, in_step(4));
        /* a's last 20 tokens are not long: b starts beside them, in a batch sequence's slot */
        one_step(s, &st, 16);
        sched_get_stats(s, &ss);
        CHECKF(in_step(3) && in_step(4) && ss.preemptions == 1, "the second long chat: started %d, %llu preemptions",
               in_step(4), (unsigned long long)ss.preemptions);
        CHECK(drain(s, p, 16) > 0 && !sched_has_work(s));
        sched_destroy(s);
        kv_pool_destroy(p);
    }
    kv_pool *p = kv_pool_create(64, 16, false, err, sizeof err);
    struct sched_config c = {.block_size = 16, .max_num_seqs = 8, .max_num_batched_tokens = 64, .max_model_len = 256,
                             .max_num_partial_prefills = 2, .max_long_partial_prefills = 3};
    CHECK(sched_create(&c, p, NULL, err, sizeof err) == NULL && strstr(err, "max_long_partial_prefills 3"));
    c.max_long_partial_prefills = 0;
    CHECK(sched_create(&c, p, NULL, err, sizeof err) == NULL && strstr(err, "max_long_partial_prefills 0"));
    kv_pool_destroy(p);
}

/* counts finish events (test_plan_fuzz) */
static void count_finish(void *arg, const struct sched_event *ev)
{
    if (ev->kind == SCHED_EV_FINISH) ++*(int *)arg;
}

/* Random configurations (budget, sequences, pool, shares, latency targets,
 * cost models, granules) and random arrivals of both classes:
 * every step plans at least one token within the budget and max_num_seqs,
 * the pool stays consistent, and every request finishes (nothing starves,
 * whatever the caps). */
static int fuzz_rand(uint32_t *st, int n)
{
    *st = *st * 1664525u + 1013904223u;
    return (int)((*st >> 8) % (uint32_t)n);
}

static void test_plan_fuzz(void)
{
    static int32_t big[1200];
    for (int i = 0; i < 1200; i++) big[i] = (i * 7919) % 997;
    uint32_t rs = 12345;
#define RND(n) fuzz_rand(&rs, (n))
    static const double ks[] = {0.0, 1e-6, 5e-5, 1e-3}, itls[] = {0.0, 0.002, 0.02, 0.2}, fixed[] = {0.0, 0.005, 0.05};
    static const int grans[] = {0, 8, 16};
    static const float shares[] = {0.0f, 0.125f, 0.25f};
    for (int round = 0; round < 150; round++) {
        int budget = 16 + RND(113);
        int seqs = 1 + RND(6);
        if (budget < seqs) budget = seqs;
        int blocks = 16 + RND(49);
        kv_pool *p = kv_pool_create(blocks, 16, RND(2), err, sizeof err);
        struct sched_config c = {.block_size = 16, .max_num_seqs = seqs, .max_num_batched_tokens = budget,
                                 .max_model_len = 256};
        c.min_batch_share = shares[RND(3)];
        c.itl_target_s = itls[RND(4)];
        c.ttft_target_s = RND(2) ? 5.0 * c.itl_target_s : 0.0;
        c.expect_interactive = RND(2);
        c.step_granule = grans[RND(3)];
        c.long_prefill_token_threshold = (int[]){0, 0, 7, 40}[RND(4)];
        c.max_num_partial_prefills = RND(4);
        c.max_long_partial_prefills = 1 + RND(c.max_num_partial_prefills > 1 ? c.max_num_partial_prefills : 1);
        sched *s = sched_create(&c, p, NULL, err, sizeof err);
        CHECKF(s != NULL, "%s", err);
        if (!s) {
            kv_pool_destroy(p);
            continue;
        }
        /* a model with a fixed part, tokens and pairs; the steps are timed by it */
        struct sched_cost *cm = sched_cost_model(s);
        double k = ks[RND(4)], f = fixed[RND(3)];
        cm->coef[SCHED_COST_STEP] = f;
        cm->coef[SCHED_COST_PREFILL] = cm->coef[SCHED_COST_DECODE] = 1e-3;
        cm->coef[SCHED_COST_PAIR] = cm->coef[SCHED_COST_DECODE_KEY] = k;
        bool timed = RND(2);
        enum { NR = 12 };
        struct sched_request r[NR];
        int arrive[NR], submitted = 0, finished = 0, steps = 0;
        for (int i = 0; i < NR; i++) {
            int len = 1 + RND(200);
            int off = RND(1000);
            int max_tokens = 1 + RND(8);
            enum sched_priority prio = RND(2) ? SCHED_PRIO_INTERACTIVE : SCHED_PRIO_BATCH;
            r[i] = req(big + off, len, max_tokens, prio);
            arrive[i] = RND(40);
        }
        struct step st;
        bool ok = true;
        while (ok && steps < 4000 && (submitted < NR || sched_has_work(s))) {
            for (int i = 0; i < NR; i++)
                if (arrive[i] == steps) submit(s, &r[i], (uint64_t)i + 1), submitted++;
            if (!sched_has_work(s)) {
                steps++;
                continue;
            }
            int n = sched_plan_step(s, &st);
            ok = n > 0 && n <= budget && st.n_seqs <= seqs;
            CHECKF(ok, "round %d (budget %d, seqs %d, itl %g, ttft %g, k %g, fixed %g, granule %d), step %d: %d tokens, "
                   "%d seqs", round, budget, seqs, c.itl_target_s, c.ttft_target_s, k, f, c.step_granule, steps, n,
                   st.n_seqs);
            if (!ok) break;
            fake_forward(&st, 16);
            sched_complete_step(s, &st, count_finish, &finished);
            if (timed) {
                struct sched_step_shape x;
                sched_step_plan(s, &x);
                sched_step_timed(s, f + 1e-3 * (x.x[SCHED_COST_PREFILL] + x.x[SCHED_COST_DECODE]) +
                                        k * (x.x[SCHED_COST_PAIR] + x.x[SCHED_COST_DECODE_KEY]) + 1e-4);
            }
            ok = kv_debug_check(p, err, sizeof err) == 0;
            CHECKF(ok, "round %d, step %d: %s", round, steps, err);
            steps++;
        }
        CHECKF(finished == NR, "round %d (budget %d, seqs %d, itl %g, ttft %g, k %g, fixed %g): %d of %d finished in %d "
               "steps", round, budget, seqs, c.itl_target_s, c.ttft_target_s, k, f, finished, NR, steps);
        sched_destroy(s);
        kv_pool_destroy(p);
    }
#undef RND
}

/* Runs everything to completion; returns the number of steps. */
static int drain(sched *s, kv_pool *p, int bs)
{
    struct step st;
    int steps = 0;
    while (sched_has_work(s) && steps < 10000) {
        int n = sched_plan_step(s, &st);
        CHECK(n > 0);
        if (n <= 0) break;
        fake_forward(&st, bs);
        sched_complete_step(s, &st, collect, NULL);
        CHECKF(kv_debug_check(p, err, sizeof err) == 0, "%s", err);
        steps++;
    }
    return steps;
}

/* Collects request id's generated tokens from the events. */
static int tokens_of(uint64_t id, int32_t *out)
{
    int n = 0;
    for (int i = 0; i < n_ev; i++)
        if (evs[i].id == id && evs[i].kind == SCHED_EV_TOKEN) out[n++] = evs[i].token;
    return n;
}

static void test_preemption(void)
{
    enum { N = 6, PL = 9, GEN = 12 };
    int32_t prompts[N][PL];
    for (int r = 0; r < N; r++)
        for (int i = 0; i < PL; i++) prompts[r][i] = 10 * r + i + 1;
    /* alone: a big pool, one at a time */
    int32_t alone[N][GEN];
    for (int r = 0; r < N; r++) {
        kv_pool *p = kv_pool_create(64, 4, true, err, sizeof err);
        sched *s = mk(p, 8, 64, 64, 0.0f);
        struct sched_request rq = req(prompts[r], PL, GEN, SCHED_PRIO_BATCH);
        n_ev = 0;
        submit(s, &rq, 1);
        drain(s, p, 4);
        CHECK(tokens_of(1, alone[r]) == GEN);
        sched_destroy(s);
        kv_pool_destroy(p);
    }
    /* together in a pool of 8 blocks (32 tokens): each needs 6 blocks at the end */
    kv_pool *p = kv_pool_create(8, 4, true, err, sizeof err);
    sched *s = mk(p, 8, 16, 32, 0.0f);
    n_ev = 0;
    for (int r = 0; r < N; r++) {
        struct sched_request rq = req(prompts[r], PL, GEN, r % 2 ? SCHED_PRIO_INTERACTIVE : SCHED_PRIO_BATCH);
        submit(s, &rq, (uint64_t)r + 1);
    }
    drain(s, p, 4);
    struct sched_stats ss;
    sched_get_stats(s, &ss);
    CHECKF(ss.preemptions > 0, "preemptions %llu", (unsigned long long)ss.preemptions);
    CHECK(ss.finished == N);
    for (int r = 0; r < N; r++) {
        int32_t got[GEN * 2];
        CHECK(tokens_of((uint64_t)r + 1, got) == GEN);
        CHECKF(!memcmp(got, alone[r], sizeof alone[r]), "request %d differs after preemption", r);
    }
    int preempted = 0;
    for (int i = 0; i < n_ev; i++)
        if (evs[i].kind == SCHED_EV_FINISH) preempted += evs[i].usage.n_preemptions;
    CHECK((uint64_t)preempted == ss.preemptions);
    CHECK(kv_pool_available(p) == 8);
    sched_destroy(s);
    kv_pool_destroy(p);
}

/* the request ids of the last step planned through plan() or one_step() */
static uint64_t step_ids[64];
static int n_step_ids;

static int plan(sched *s, struct step *st)
{
    int n = sched_plan_step(s, st);
    n_step_ids = 0;
    for (int i = 0; i < st->n_seqs && i < 64; i++) step_ids[n_step_ids++] = sched_step_req_id(s, i);
    return n;
}

/* Plans and runs one step with the fake forward; returns the tokens planned. */
static int one_step(sched *s, struct step *st, int bs)
{
    int n = plan(s, st);
    if (n > 0) {
        fake_forward(st, bs);
        sched_complete_step(s, st, collect, NULL);
    }
    return n;
}

static bool in_step(uint64_t id)
{
    for (int i = 0; i < n_step_ids; i++)
        if (step_ids[i] == id) return true;
    return false;
}

/* ---- the time budget (latency targets and the cost model) ---- */

/* A cost model with only these terms (seconds), the others 0. */
static void set_cost(sched *s, double step, double prefill, double decode)
{
    struct sched_cost *c = sched_cost_model(s);
    memset(c->coef, 0, sizeof c->coef);
    c->coef[SCHED_COST_STEP] = step;
    c->coef[SCHED_COST_PREFILL] = prefill;
    c->coef[SCHED_COST_DECODE] = decode;
}

/* How many of the running batch requests (ids 1..n) are in the last step. */
static int batch_in_step(int n)
{
    int k = 0;
    for (int i = 1; i <= n; i++) k += in_step((uint64_t)i);
    return k;
}

/* The policy, by the cost model's plan (no clock): a batch of 12 long
 * prompts (a step of 5 ms, 1 ms a prefill token, 4 ms a decode; itl 50 ms,
 * ttft 250 ms). Before any chat, steps are the token budget (run-batch),
 * or the TTFT room where chats may come at any time (serve). A chat that
 * arrives is in the very next step, which is planned within the
 * inter-token target: batch decodes sit out (keeping their KV) for it, and
 * take turns in the chat's decode steps. Once the chat is done, steps grow
 * back to the TTFT room (250 - 50 ms), or to the whole token budget when
 * that fits. */
static void test_time_budget(void)
{
    enum { NB = 12 };
    const int32_t *big = ramp();
    kv_pool *p = kv_pool_create(512, 16, false, err, sizeof err);
    struct sched_config c = {.block_size = 16, .max_num_seqs = 16, .max_num_batched_tokens = 256,
                             .max_model_len = 1024, .min_batch_share = 0.1f, .itl_target_s = 0.05,
                             .ttft_target_s = 0.25};
    sched *s = sched_create(&c, p, NULL, err, sizeof err);
    CHECKF(s != NULL, "%s", err);
    if (!s) return;
    set_cost(s, 0.005, 0.001, 0.004);
    struct sched_request rb[NB];
    for (int i = 0; i < NB; i++) {
        rb[i] = req(big + 10 * i, 60 + 10 * i, 40, SCHED_PRIO_BATCH);
        submit(s, &rb[i], (uint64_t)i + 1);
    }
    struct step st;
    /* no chat yet: the whole token budget, however long that takes */
    int n = one_step(s, &st, 16);
    CHECKF(n == 256 && sched_step_plan(s, NULL) > 0.25, "before any chat: %d tokens, %.3f s", n,
           sched_step_plan(s, NULL));
    for (int i = 0; i < 8; i++) one_step(s, &st, 16);
    struct sched_stats ss;
    sched_get_stats(s, &ss);
    CHECKF(ss.n_running == NB && ss.n_waiting == 0, "%d running, %d waiting", ss.n_running, ss.n_waiting);
    /* a chat arrives: in the very next step, within 50 ms; batch decodes sit out */
    struct sched_request rc = req(big + 500, 10, 6, SCHED_PRIO_INTERACTIVE);
    submit(s, &rc, 100);
    n = one_step(s, &st, 16);
    double t = sched_step_plan(s, NULL);
    int nb = batch_in_step(NB);
    CHECKF(in_step(100) && st.seqs[0].query_len == 10 && t <= 0.05 + 1e-9 && nb > 0 && nb < NB,
           "the chat's first step: %s, %d tokens, %.4f s, %d of %d batch decodes", in_step(100) ? "in" : "not in", n,
           t, nb, NB);
    sched_get_stats(s, &ss);
    CHECK(ss.decodes_sat_out == (uint64_t)(NB - nb));
    /* its decodes: every step within 50 ms, and the batch decodes take turns */
    bool seen[NB + 1] = {false};
    for (int k = 0; k < 5; k++) {
        n = one_step(s, &st, 16);
        t = sched_step_plan(s, NULL);
        nb = batch_in_step(NB);
        CHECKF(in_step(100) && t <= 0.05 + 1e-9 && nb < NB, "the chat's decode %d: %.4f s, %d batch decodes", k, t, nb);
        for (int i = 1; i <= NB; i++) seen[i] |= in_step((uint64_t)i);
    }
    for (int i = 1; i <= NB; i++) CHECKF(seen[i], "batch request %d never decoded beside the chat", i);
    sched_get_stats(s, &ss);
    CHECK(ss.n_running == NB); /* nobody was preempted: the decodes that sat out kept their KV */
    /* the chat is done, a long batch prompt comes: the step grows back to
     * the TTFT room, 200 ms (the 12 decodes and what fits of the prompt) */
    struct sched_request rl = req(big, 600, 2, SCHED_PRIO_BATCH);
    submit(s, &rl, 200);
    n = one_step(s, &st, 16);
    t = sched_step_plan(s, NULL);
    CHECKF(!in_step(100) && batch_in_step(NB) == NB && in_step(200) && t > 0.19 && t <= 0.2 + 1e-9,
           "after the chat: %d tokens, %.4f s, %d batch decodes", n, t, batch_in_step(NB));
    /* on a faster device, to the whole token budget */
    set_cost(s, 0.005, 0.0002, 0.0004);
    n = plan(s, &st);
    CHECKF(n == 256 && in_step(200) && sched_step_plan(s, NULL) <= 0.2, "grown back: %d tokens, %.4f s", n,
           sched_step_plan(s, NULL));
    sched_destroy(s);
    /* where chats may come at any time (serve), the first batch step leaves one the room already */
    c.expect_interactive = true;
    s = sched_create(&c, p, NULL, err, sizeof err);
    set_cost(s, 0.005, 0.001, 0.004);
    submit(s, &rl, 200);
    n = plan(s, &st);
    t = sched_step_plan(s, NULL);
    CHECKF(n < 256 && t > 0.19 && t <= 0.2 + 1e-9, "serving, before any chat: %d tokens, %.4f s", n, t);
    sched_destroy(s);
    kv_pool_destroy(p);
}

/* The default inter-token target, twice a step of the chats alone (a step
 * of 5 ms, 4 ms a decode: 9 ms alone, an 18 ms target): beside 12 batch
 * decodes a chat's decode steps stay within it, the batch decodes take
 * turns in what is left, and between chats a step leaves the TTFT room less
 * that target. Faster chats (a cheaper device) get a tighter target. */
static void test_itl_auto(void)
{
    enum { NB = 12 };
    const int32_t *big = ramp();
    kv_pool *p = kv_pool_create(512, 16, false, err, sizeof err);
    struct sched_config c = {.block_size = 16, .max_num_seqs = 16, .max_num_batched_tokens = 256,
                             .max_model_len = 1024, .min_batch_share = 0.1f, .itl_auto_factor = 2.0,
                             .ttft_target_s = 0.25, .expect_interactive = true};
    sched *s = sched_create(&c, p, NULL, err, sizeof err);
    CHECKF(s != NULL, "%s", err);
    if (!s) return;
    set_cost(s, 0.005, 0.001, 0.004);
    struct sched_request rb[NB];
    for (int i = 0; i < NB; i++) {
        rb[i] = req(big + 10 * i, 20 + i, 60, SCHED_PRIO_BATCH);
        submit(s, &rb[i], (uint64_t)i + 1);
    }
    struct step st;
    for (int i = 0; i < 4; i++) one_step(s, &st, 16);
    double t = sched_step_plan(s, NULL);
    CHECKF(batch_in_step(NB) == NB && t <= 0.25 - 0.018 + 1e-9 && t > 0.018, "no chat: %.4f s, %d decodes", t,
           batch_in_step(NB));
    struct sched_request rc = req(big + 500, 10, 8, SCHED_PRIO_INTERACTIVE);
    submit(s, &rc, 100);
    one_step(s, &st, 16); /* its prompt */
    bool seen[NB + 1] = {false};
    for (int k = 0; k < 6; k++) {
        one_step(s, &st, 16);
        t = sched_step_plan(s, NULL);
        int nb = batch_in_step(NB);
        CHECKF(in_step(100) && t <= 0.018 + 1e-9 && nb >= 1 && nb < NB, "the chat's decode %d: %.4f s, %d batch decodes",
               k, t, nb);
        for (int i = 1; i <= NB; i++) seen[i] |= in_step((uint64_t)i);
    }
    int turns = 0;
    for (int i = 1; i <= NB; i++) turns += seen[i];
    CHECKF(turns >= 6, "%d of %d batch requests decoded beside the chat", turns, NB);
    /* a faster device: the target follows the chat's own step (2 x 2.5 ms) */
    set_cost(s, 0.002, 0.0002, 0.0005);
    one_step(s, &st, 16);
    t = sched_step_plan(s, NULL);
    CHECKF(in_step(100) && t <= 0.005 + 1e-9, "faster: %.4f s", t);
    sched_destroy(s);
    kv_pool_destroy(p);
}

/* A chat whose prompt takes longer than the inter-token target beside a
 * batch: its first token comes in one step (batch fills nothing past the
 * chat's own prompt, batch decodes sit out); without batch decodes running
 * it is the same. Its decodes then keep the inter-token target. */
static void test_first_token_room(void)
{
    const int32_t *big = ramp();
    kv_pool *p = kv_pool_create(512, 16, false, err, sizeof err);
    struct sched_config c = {.block_size = 16, .max_num_seqs = 16, .max_num_batched_tokens = 256,
                             .max_model_len = 1024, .min_batch_share = 0.0f, .itl_target_s = 0.05,
                             .ttft_target_s = 0.25};
    sched *s = sched_create(&c, p, NULL, err, sizeof err);
    set_cost(s, 0.005, 0.001, 0.004);
    struct sched_request rb = req(big, 700, 40, SCHED_PRIO_BATCH);
    submit(s, &rb, 1);
    struct step st;
    one_step(s, &st, 16);
    struct sched_request rc = req(big + 800, 100, 4, SCHED_PRIO_INTERACTIVE);
    submit(s, &rc, 2);
    int n = one_step(s, &st, 16);
    double t = sched_step_plan(s, NULL);
    CHECKF(n == 100 && st.n_seqs == 1 && in_step(2) && t <= 0.2 + 1e-9, "a 100-token chat: %d tokens, %.4f s", n, t);
    n = one_step(s, &st, 16);
    t = sched_step_plan(s, NULL);
    CHECKF(in_step(2) && in_step(1) && t <= 0.05 + 1e-9 && n > 1, "its decode: %d tokens, %.4f s", n, t);
    sched_destroy(s);
    kv_pool_destroy(p);
}

/* A device so slow (or so loaded) that a step's fixed part alone is past
 * every target: chunks are not cut to a token a step (which would pay the
 * fixed part again for each): batch alone fills the token budget, and a
 * chat's prompt goes whole. */
static void test_overloaded(void)
{
    const int32_t *big = ramp();
    kv_pool *p = kv_pool_create(512, 16, false, err, sizeof err);
    struct sched_config c = {.block_size = 16, .max_num_seqs = 16, .max_num_batched_tokens = 256,
                             .max_model_len = 1024, .min_batch_share = 0.1f, .itl_target_s = 0.05,
                             .ttft_target_s = 0.2, .expect_interactive = true};
    sched *s = sched_create(&c, p, NULL, err, sizeof err);
    set_cost(s, 0.5, 0.001, 0.004);
    struct sched_request rb = req(big, 700, 40, SCHED_PRIO_BATCH), rc = req(big + 800, 100, 4, SCHED_PRIO_INTERACTIVE);
    struct sched_request rs[3] = {req(big + 10, 100, 4, SCHED_PRIO_BATCH), req(big + 20, 100, 4, SCHED_PRIO_BATCH),
                                  req(big + 30, 100, 4, SCHED_PRIO_BATCH)};
    submit(s, &rb, 1);
    struct step st;
    int n = one_step(s, &st, 16);
    CHECKF(n == 256, "batch alone: %d tokens", n);
    /* but only that far: a step of several prompts is the fixed part twice, not more */
    sched *s2 = sched_create(&c, p, NULL, err, sizeof err);
    set_cost(s2, 0.5, 0.01, 0.004);
    for (int i = 0; i < 3; i++) submit(s2, &rs[i], 10 + (uint64_t)i);
    n = plan(s2, &st);
    CHECKF(n == 50 && sched_step_plan(s2, NULL) <= 1.0 + 1e-9, "three prompts: %d tokens in %d, %.3f s",
           n, st.n_seqs, sched_step_plan(s2, NULL));
    sched_destroy(s2);
    submit(s, &rc, 2);
    n = one_step(s, &st, 16);
    CHECKF(in_step(2) && st.seqs[0].query_len == 100, "the chat's prompt: %d of 100 tokens",
           st.n_seqs ? st.seqs[0].query_len : 0);
    sched_destroy(s);
    kv_pool_destroy(p);
}

/* The cost model learns a device from its step times alone: from a prior
 * 100 times off, shapes of every kind (prefill, decode, mixed, deep
 * contexts) timed by a known linear model with +-2% noise. */
static void test_cost_calibration(void)
{
    const double truth[SCHED_COST_N] = {0.004, 2e-4, 3e-8, 5e-4, 1e-8, 1e-4};
    struct sched_cost c;
    sched_cost_init(&c, 2e-2, 1e-4);
    uint32_t rs = 7;
    struct sched_step_shape x;
    for (int i = 0; i < 300; i++) {
        memset(&x, 0, sizeof x);
        x.x[SCHED_COST_STEP] = 1;
        int kind = fuzz_rand(&rs, 3);
        if (kind != 1) { /* a prefill chunk */
            double len = 1 + fuzz_rand(&rs, 2048), n0 = fuzz_rand(&rs, 30000);
            x.x[SCHED_COST_PREFILL] = len;
            x.x[SCHED_COST_PAIR] = len * n0 + len * (len + 1) / 2;
        }
        if (kind != 0) { /* decodes */
            double d = 1 + fuzz_rand(&rs, 256);
            x.x[SCHED_COST_DECODE] = d;
            x.x[SCHED_COST_DECODE_KEY] = d * (1 + fuzz_rand(&rs, 8000));
        }
        x.x[SCHED_COST_SAMPLE] = x.x[SCHED_COST_DECODE] + fuzz_rand(&rs, 64); /* prompts that end */
        double t = 0;
        for (int k = 0; k < SCHED_COST_N; k++) t += truth[k] * x.x[k];
        t *= 1.0 + 0.02 * (fuzz_rand(&rs, 201) - 100) / 100.0;
        sched_cost_observe(&c, &x, t);
    }
    for (int k = 0; k < SCHED_COST_N; k++)
        CHECKF(fabs(c.coef[k] - truth[k]) <= 0.1 * truth[k], "term %d: %g, truth %g", k, c.coef[k], truth[k]);
    /* and predicts new shapes within 3% */
    double worst = 0;
    for (int i = 0; i < 100; i++) {
        memset(&x, 0, sizeof x);
        x.x[SCHED_COST_STEP] = 1;
        double len = fuzz_rand(&rs, 512), d = fuzz_rand(&rs, 64), n0 = fuzz_rand(&rs, 4000);
        x.x[SCHED_COST_PREFILL] = len;
        x.x[SCHED_COST_PAIR] = len * n0 + len * (len + 1) / 2;
        x.x[SCHED_COST_DECODE] = d;
        x.x[SCHED_COST_DECODE_KEY] = d * n0;
        x.x[SCHED_COST_SAMPLE] = d + 1;
        double t = 0;
        for (int k = 0; k < SCHED_COST_N; k++) t += truth[k] * x.x[k];
        double e = fabs(sched_cost_time(&c, &x) - t) / t;
        if (e > worst) worst = e;
    }
    CHECKF(worst < 0.03, "worst prediction error %.1f%%", worst * 100);
}

/* In the loop, as the engine runs it: the scheduler's steps timed by a
 * device it does not know (its prior is 50 times too fast), a batch and a
 * long streaming chat. Within a few dozen steps the plans match the device,
 * and the chat's steps keep the inter-token target as they run. */
static void test_calibration_in_loop(void)
{
    const int32_t *big = ramp();
    kv_pool *p = kv_pool_create(512, 16, false, err, sizeof err);
    struct sched_config c = {.block_size = 16, .max_num_seqs = 16, .max_num_batched_tokens = 512,
                             .max_model_len = 1024, .min_batch_share = 0.1f, .itl_target_s = 0.05,
                             .ttft_target_s = 0.25, .prior_token_s = 2e-5, .prior_pair_ratio = 1e-3};
    sched *s = sched_create(&c, p, NULL, err, sizeof err);
    struct sched_request rb[8];
    for (int i = 0; i < 8; i++) {
        rb[i] = req(big + 20 * i, 300 + 20 * i, 200, SCHED_PRIO_BATCH);
        submit(s, &rb[i], (uint64_t)i + 1);
    }
    struct sched_request rc = req(big + 900, 20, 300, SCHED_PRIO_INTERACTIVE);
    submit(s, &rc, 100);
    struct step st;
    int late = 0, chat_steps = 0;
    double worst = 0;
    for (int k = 0; k < 200 && sched_has_work(s); k++) {
        n_ev = 0;
        if (one_step(s, &st, 16) <= 0) break;
        struct sched_step_shape x;
        double planned = sched_step_plan(s, &x);
        /* the device: 3 ms a step, 1 ms a token, 1 us a pair or key */
        double t = 0.003 + 0.001 * x.x[SCHED_COST_PREFILL] + 0.001 * x.x[SCHED_COST_DECODE] +
                   1e-6 * (x.x[SCHED_COST_PAIR] + x.x[SCHED_COST_DECODE_KEY]);
        sched_step_timed(s, t);
        if (k < 40) continue;
        double e = fabs(planned - t) / t;
        if (e > worst) worst = e;
        if (in_step(100)) {
            chat_steps++;
            late += t > 0.05 * 1.02;
        }
    }
    CHECKF(chat_steps >= 100 && late == 0 && worst < 0.05, "%d chat steps after calibrating, %d over the target; "
           "worst plan error %.1f%%", chat_steps, late, worst * 100);
    sched_destroy(s);
    kv_pool_destroy(p);
}

/* Batch decodes fill every slot: an interactive request still starts in the
 * very next step, pushing out the most recently admitted batch sequence, which
 * later completes with the same tokens as when run alone. */
static void test_interactive_takes_slot(void)
{
    enum { N = 4, PL = 9, GEN = 10, BS = 4 };
    int32_t prompts[N + 1][PL];
    for (int r = 0; r <= N; r++)
        for (int i = 0; i < PL; i++) prompts[r][i] = 50 * r + i + 3;
    int32_t alone[N + 1][GEN];
    for (int r = 0; r <= N; r++) {
        kv_pool *p = kv_pool_create(64, BS, true, err, sizeof err);
        sched *s = mk(p, N, 64, 64, 0.0f);
        struct sched_request rq = req(prompts[r], PL, GEN, SCHED_PRIO_BATCH);
        n_ev = 0;
        submit(s, &rq, 1);
        drain(s, p, BS);
        CHECK(tokens_of(1, alone[r]) == GEN);
        sched_destroy(s);
        kv_pool_destroy(p);
    }
    for (int cache = 0; cache < 2; cache++) {
        kv_pool *p = kv_pool_create(64, BS, cache, err, sizeof err);
        sched *s = mk(p, N, 64, 64, 0.25f);
        n_ev = 0;
        for (int r = 0; r < N; r++) {
            struct sched_request rq = req(prompts[r], PL, GEN, SCHED_PRIO_BATCH);
            submit(s, &rq, (uint64_t)r + 1);
        }
        struct step st;
        CHECK(one_step(s, &st, BS) == N * PL && st.n_seqs == N); /* all prefilled */
        CHECK(one_step(s, &st, BS) == N && st.n_seqs == N);      /* all decoding */
        struct sched_stats ss;
        sched_get_stats(s, &ss);
        CHECK(ss.n_running == N && ss.preemptions == 0);

        /* a batch request does not push out batch work */
        struct sched_request rb = req(prompts[N], PL, GEN, SCHED_PRIO_BATCH);
        submit(s, &rb, 100);
        CHECK(one_step(s, &st, BS) == N && !in_step(100));
        sched_get_stats(s, &ss);
        CHECK(ss.preemptions == 0 && ss.n_waiting == 1);

        struct sched_request ri = req(prompts[N], PL, GEN, SCHED_PRIO_INTERACTIVE);
        submit(s, &ri, 200);
        CHECK(plan(s, &st) == (N - 1) + PL);
        CHECK(st.n_seqs == N && sched_step_req_id(s, N - 1) == 200);
        CHECK(st.seqs[N - 1].query_len == PL && st.seqs[N - 1].want_sample);
        for (int i = 0; i < N - 1; i++) CHECK(sched_step_req_id(s, i) == (uint64_t)i + 1);
        CHECK(!in_step(N) && !in_step(100)); /* the victim, and no batch admission */
        sched_get_stats(s, &ss);
        CHECK(ss.preemptions == 1 && ss.n_running == N && ss.n_waiting == 2);
        fake_forward(&st, BS);
        sched_complete_step(s, &st, collect, NULL);
        /* the interactive request decodes next; the victim waits for a slot */
        CHECK(plan(s, &st) == N && sched_step_req_id(s, 0) == 200 && !in_step(N));
        fake_forward(&st, BS);
        sched_complete_step(s, &st, collect, NULL);

        drain(s, p, BS);
        sched_get_stats(s, &ss);
        CHECK(ss.finished == N + 2 && ss.preemptions == 1);
        for (int r = 0; r < N; r++) {
            int32_t got[GEN * 2];
            CHECK(tokens_of((uint64_t)r + 1, got) == GEN);
            CHECKF(!memcmp(got, alone[r], sizeof alone[r]), "request %d differs after preemption", r + 1);
        }
        int32_t got[GEN * 2];
        CHECK(tokens_of(100, got) == GEN && !memcmp(got, alone[N], sizeof alone[N]));
        CHECK(tokens_of(200, got) == GEN && !memcmp(got, alone[N], sizeof alone[N]));
        for (int i = 0; i < n_ev; i++)
            if (evs[i].kind == SCHED_EV_FINISH)
                CHECKF(evs[i].usage.n_preemptions == (evs[i].id == N), "id %llu preempted %d times",
                       (unsigned long long)evs[i].id, evs[i].usage.n_preemptions);
        CHECK(kv_pool_available(p) == 64);
        sched_destroy(s);
        kv_pool_destroy(p);
    }
}

/* An interactive request never pushes out another interactive one: with the
 * slots held by interactive work (and one batch sequence), the first new
 * interactive request takes the batch sequence's slot, the second waits. */
static void test_interactive_never_preempts_interactive(void)
{
    enum { N = 3, PL = 5, BS = 4 };
    kv_pool *p = kv_pool_create(64, BS, false, err, sizeof err);
    sched *s = mk(p, N, 64, 64, 0.0f);
    int32_t t[PL];
    for (int i = 0; i < PL; i++) t[i] = 700 + i;
    struct sched_request ri = req(t, PL, 20, SCHED_PRIO_INTERACTIVE), rb = req(t, PL, 20, SCHED_PRIO_BATCH);
    submit(s, &ri, 1);
    submit(s, &ri, 2);
    submit(s, &rb, 3);
    n_ev = 0;
    struct step st;
    CHECK(one_step(s, &st, BS) == N * PL);
    CHECK(one_step(s, &st, BS) == N);
    submit(s, &ri, 4);
    submit(s, &ri, 5);
    CHECK(plan(s, &st) == 2 + PL);
    CHECK(st.n_seqs == N && in_step(1) && in_step(2) && in_step(4));
    CHECK(!in_step(3) && !in_step(5));
    fake_forward(&st, BS);
    sched_complete_step(s, &st, collect, NULL);
    struct sched_stats ss;
    for (int k = 0; k < 5; k++) {
        CHECK(one_step(s, &st, BS) == N && !in_step(5) && !in_step(3));
        sched_get_stats(s, &ss);
        CHECK(ss.preemptions == 1 && ss.n_running == N && ss.n_waiting == 2);
    }
    drain(s, p, BS);
    sched_get_stats(s, &ss);
    CHECK(ss.finished == 5 && ss.preemptions == 1);
    for (int i = 0; i < n_ev; i++)
        if (evs[i].kind == SCHED_EV_FINISH) CHECK(evs[i].usage.n_preemptions == (evs[i].id == 3));
    sched_destroy(s);
    kv_pool_destroy(p);
}

/* No preemption for a request the step could not start anyway: every token
 * of the budget goes to decodes and the batch share. */
static void test_no_useless_slot_preemption(void)
{
    enum { N = 4, BS = 4 };
    kv_pool *p = kv_pool_create(64, BS, false, err, sizeof err);
    sched *s = mk(p, N, N, 64, 1.0f);
    int32_t t[2] = {5, 6};
    struct sched_request rb = req(t, 1, 30, SCHED_PRIO_BATCH), ri = req(t, 2, 4, SCHED_PRIO_INTERACTIVE);
    for (int r = 0; r < N; r++) submit(s, &rb, (uint64_t)r + 1);
    struct step st;
    CHECK(one_step(s, &st, BS) == N);
    submit(s, &ri, 9);
    for (int k = 0; k < 3; k++) CHECK(one_step(s, &st, BS) == N && !in_step(9));
    struct sched_stats ss;
    sched_get_stats(s, &ss);
    CHECK(ss.preemptions == 0 && ss.n_waiting == 1);
    sched_destroy(s);
    kv_pool_destroy(p);
}

static void test_refusal(void)
{
    kv_pool *p = kv_pool_create(4, 4, false, err, sizeof err);
    sched *s = mk(p, 4, 16, 32, 0.0f);
    int32_t t[40] = {0};
    struct sched_request r = req(t, 20, 13, SCHED_PRIO_BATCH);
    err[0] = 0;
    CHECK(sched_req_create(s, &r, 1, err, sizeof err) == NULL);
    CHECKF(strstr(err, "maximum context length is 32") != NULL, "%s", err);
    r = req(t, 10, 10, SCHED_PRIO_BATCH); /* fits 32 but not a 16-token pool */
    CHECK(sched_req_create(s, &r, 1, err, sizeof err) == NULL);
    CHECKF(strstr(err, "KV cache holds 4 blocks") != NULL, "%s", err);
    r = req(t, 0, 4, SCHED_PRIO_BATCH);
    CHECK(sched_req_create(s, &r, 1, err, sizeof err) == NULL);
    r = req(t, 4, 0, SCHED_PRIO_BATCH);
    CHECK(sched_req_create(s, &r, 1, err, sizeof err) == NULL);
    r = req(t, 4, 4, SCHED_PRIO_BATCH);
    r.sampling.top_p = 0;
    CHECK(sched_req_create(s, &r, 1, err, sizeof err) == NULL);
    sched_destroy(s);
    kv_pool_destroy(p);
}

static void test_abort(void)
{
    kv_pool *p = kv_pool_create(32, 4, true, err, sizeof err);
    sched *s = mk(p, 4, 8, 64, 0.0f);
    int32_t t[30];
    for (int i = 0; i < 30; i++) t[i] = i + 7;
    struct sched_request r = req(t, 30, 8, SCHED_PRIO_BATCH);
    submit(s, &r, 1);
    submit(s, &r, 2);
    struct step st;
    n_ev = 0;
    CHECK(sched_plan_step(s, &st) == 8);
    fake_forward(&st, 4);
    sched_complete_step(s, &st, collect, NULL);
    CHECK(kv_pool_available(p) < 32);
    CHECK(sched_abort(s, 1, collect, NULL) == 0); /* running */
    CHECK(sched_abort(s, 2, collect, NULL) == 0); /* waiting */
    CHECK(sched_abort(s, 3, collect, NULL) == SL_EINVAL);
    CHECK(n_ev == 2 && evs[0].finish == SCHED_FINISH_ABORT && evs[1].finish == SCHED_FINISH_ABORT);
    CHECK(!sched_has_work(s));
    CHECK(kv_pool_available(p) == 32);
    CHECKF(kv_debug_check(p, err, sizeof err) == 0, "%s", err);
    sched_destroy(s);
    kv_pool_destroy(p);
}

static void test_prefix_cache(void)
{
    kv_pool *p = kv_pool_create(64, 4, true, err, sizeof err);
    sched *s = mk(p, 4, 64, 64, 0.0f);
    int32_t a[22], b[22];
    for (int i = 0; i < 22; i++) a[i] = b[i] = i + 1;
    b[18] = 999; /* shares 18 tokens: 4 full blocks */
    struct sched_request ra = req(a, 22, 2, SCHED_PRIO_BATCH), rb = req(b, 22, 2, SCHED_PRIO_BATCH);
    n_ev = 0;
    submit(s, &ra, 1);
    drain(s, p, 4);
    submit(s, &rb, 2);
    struct step st;
    CHECK(sched_plan_step(s, &st) == 6);
    CHECK(st.positions[0] == 16 && st.seqs[0].context_len == 22);
    fake_forward(&st, 4);
    sched_complete_step(s, &st, collect, NULL);
    drain(s, p, 4);
    CHECK(n_ev > 0 && evs[n_ev - 1].kind == SCHED_EV_FINISH && evs[n_ev - 1].usage.cached_tokens == 16);
    /* the whole prompt cached: the last token still runs */
    submit(s, &ra, 3);
    CHECK(sched_plan_step(s, &st) == 2 && st.positions[0] == 20);
    sched_destroy(s);
    kv_pool_destroy(p);
}

/* JSON mode's recognizer: RFC 8259 objects accepted byte by byte and marked
 * done at the top-level '}'; everything else refused at the first bad byte. */
static bool guide_accepts(const char *doc, bool *done)
{
    struct sched_guide g;
    sched_guide_init(&g);
    for (const char *p = doc; *p; p++)
        if (!sched_guide_step(&g, (uint8_t)*p)) return false;
    *done = sched_guide_done(&g);
    return true;
}

static void test_json_guide(void)
{
    static const char *ok[] = {
        "{}", " {\n}", "{\"a\": 1}", "{\"a\":[1,2.5e-3,-0,0.5E+7,{\"b\":null}],\"c\":\"x\\u00e9\\n\\\"\"}",
        "{\"t\":true,\"f\":false,\"n\":null,\"e\":[],\"o\":{},\"s\":\"\\/\\b\\f\\r\\t\"}",
        "{\"k\": \"caf\xc3\xa9 \xe6\x9d\xb1\"}", "{\"a\":[[[[1]]]]}", "{\"n\":10}", "{\"n\":-12.75e10 }",
    };
    for (unsigned i = 0; i < sizeof ok / sizeof *ok; i++) {
        bool done = false;
        CHECKF(guide_accepts(ok[i], &done) && done, "refused or incomplete: %s", ok[i]);
    }
    static const char *prefix[] = {"{", "{\"a\"", "{\"a\":", "{\"a\":[1,", "{\"a\":\"x\\u00", "{\"a\":12",
                                   "{\"a\":tr"};
    for (unsigned i = 0; i < sizeof prefix / sizeof *prefix; i++) {
        bool done = true;
        CHECKF(guide_accepts(prefix[i], &done) && !done, "prefix refused or done: %s", prefix[i]);
    }
    static const char *bad[] = {
        "[]", "\"x\"", "1", "{\"a\" 1}", "{\"a\":01}", "{\"a\":1,}", "{\"a\":\"\x01\"}", "{\"a\":tru}",
        "{\"a\":-}", "{\"a\":1.}", "{\"a\":1e}", "{a:1}", "{\"a\":\"\\x\"}", "{\"a\":\"\\u12g4\"}",
        "{\"a\":1]", "{} ", "{}x", "{\"a\":[1}", "{,}", "{\"a\":.5}", "{\"a\":+1}",
        "{                    \"a\":1}", /* more than 16 whitespace bytes in a row */
    };
    for (unsigned i = 0; i < sizeof bad / sizeof *bad; i++) {
        bool done = false;
        CHECKF(!guide_accepts(bad[i], &done), "accepted: %s", bad[i]);
    }
    /* depth limit */
    char deep[128] = "{\"a\":";
    for (int i = 0; i < SCHED_GUIDE_MAX_DEPTH; i++) strcat(deep, "[");
    bool done;
    CHECK(!guide_accepts(deep, &done));
}

/* Schema mode: a compiled schema accepts exactly the objects it describes
 * (the properties in order, those not required optional), refuses the rest,
 * and refuses schemas outside the supported subset with the keyword named. */
static struct sched_schema *schema_of(const char *text, char *err, size_t errlen)
{
    json_doc d;
    if (json_parse(&d, text, strlen(text), err, errlen)) return NULL;
    struct sched_schema *sc = sched_schema_compile(&d, 0, false, err, errlen);
    json_free(&d);
    return sc;
}

static int schema_accepts(const struct sched_schema *sc, const char *doc, bool *done)
{
    struct sched_guide g;
    sched_guide_init_schema(&g, sc);
    for (const char *p = doc; *p; p++)
        if (!sched_guide_step(&g, (uint8_t)*p)) return (int)(p - doc); /* the refused byte */
    *done = sched_guide_done(&g);
    return -1;
}

static void test_json_schema_guide(void)
{
    char err[256];
    struct sched_schema *sc = schema_of(
        "{\"type\":\"object\",\"title\":\"x\",\"properties\":{\"name\":{\"type\":\"string\"},\"age\":{\"type\":\"integer\"},"
        "\"score\":{\"type\":\"number\"},\"ok\":{\"type\":\"boolean\"},\"tags\":{\"type\":\"array\",\"items\":"
        "{\"type\":\"string\"}},\"pet\":{\"type\":\"object\",\"properties\":{\"kind\":{\"enum\":[\"cat\",\"dog\"]},"
        "\"n\":{\"type\":\"null\"}},\"required\":[\"kind\"]}},\"required\":[\"name\"],\"additionalProperties\":false}",
        err, sizeof err);
    CHECKF(sc != NULL, "%s", err);
    if (!sc) return;
    static const char *ok[] = {
        "{\"name\":\"Al\",\"age\":3,\"score\":-1.5e2,\"ok\":true,\"tags\":[\"a\",\"b\"],\"pet\":{\"kind\":\"cat\",\"n\":null}}",
        " { \"name\" : \"A\\\"l\\u00e9\" , \"age\" : -0 , \"score\" : 7 , \"ok\" : false , \"tags\" : [ ] , "
        "\"pet\" : { \"kind\" : \"dog\" , \"n\" : null } }",
    };
    for (unsigned i = 0; i < sizeof ok / sizeof *ok; i++) {
        bool done = false;
        int at = schema_accepts(sc, ok[i], &done);
        CHECKF(at < 0 && done, "refused at byte %d or incomplete: %s", at, ok[i]);
    }
    struct { const char *doc; const char *why; } bad[] = {
        {"{\"age\":3}", "order"},
        {"{}", "missing required property"},
        {"{\"name\":\"A\",\"nick\":1}", "unknown property"},
        {"{\"name\":\"A\",\"age\":3.5}", "integer"},
        {"{\"name\":\"A\",\"age\":3,\"score\":1,\"ok\":true,\"tags\":[1]}", "item type"},
        {"{\"name\":\"A\",\"age\":3,\"score\":1,\"ok\":\"true\"}", "boolean as string"},
        {"{\"name\":\"A\",\"age\":3,\"score\":1,\"ok\":true,\"tags\":[],\"pet\":{\"kind\":\"cow\"", "enum"},
        {"{\"name\":\"A\",\"age\":3,\"score\":1,\"ok\":true,\"tags\":[\"a\",],", "trailing comma"},
        {"[", "root"},
    };
    for (unsigned i = 0; i < sizeof bad / sizeof *bad; i++) {
        bool done = false;
        CHECKF(schema_accepts(sc, bad[i].doc, &done) >= 0, "accepted (%s): %s", bad[i].why, bad[i].doc);
    }
    bool done = true;
    CHECK(schema_accepts(sc, "{\"name\":\"Al\",\"age\":12", &done) < 0 && !done); /* a prefix */
    struct sched_schema *two = schema_of("{\"type\":\"object\",\"properties\":{\"t\":{\"type\":\"array\","
                                         "\"items\":{\"type\":\"integer\"},\"maxItems\":2}}}", err, sizeof err);
    CHECKF(two != NULL, "%s", err);
    CHECK(two && schema_accepts(two, "{\"t\":[1,2]}", &done) < 0 && done);
    CHECK(two && schema_accepts(two, "{\"t\":[]}", &done) < 0 && done);
    CHECK(two && schema_accepts(two, "{\"t\":[1,2,", &done) == 9); /* the third item's comma */
    sched_schema_free(two);
    /* a tagged union inside an array with minItems (the shape of "required" tool calls) */
    json_doc ud;
    const char *us = "{\"type\":\"array\",\"minItems\":1,\"items\":{\"anyOf\":["
                     "{\"type\":\"object\",\"properties\":{\"name\":{\"const\":\"a\"},\"p\":{\"type\":\"integer\"}}},"
                     "{\"type\":\"object\",\"properties\":{\"name\":{\"const\":\"b\"},\"p\":{\"type\":\"object\","
                     "\"properties\":{},\"additionalProperties\":false}}}]}}";
    CHECK(json_parse(&ud, us, strlen(us), err, sizeof err) == 0);
    struct sched_schema *un = sched_schema_compile(&ud, 0, true, err, sizeof err);
    CHECKF(un != NULL, "%s", err);
    struct sched_schema *root_obj = sched_schema_compile(&ud, 0, false, err, sizeof err); /* users: object roots */
    CHECK(root_obj == NULL && strstr(err, "top-level"));
    sched_schema_free(root_obj);
    json_free(&ud);
    if (un) {
        CHECK(schema_accepts(un, "[{\"name\":\"a\",\"p\":3},{\"name\":\"b\",\"p\":{}}]", &done) < 0 && done);
        CHECK(schema_accepts(un, "[ { \"name\" : \"b\" , \"p\" : { } } ]", &done) < 0 && done);
        CHECK(schema_accepts(un, "[]", &done) == 1);                              /* minItems */
        CHECK(schema_accepts(un, "[{\"name\":\"c\"", &done) == 10);            /* not a tag */
        CHECK(schema_accepts(un, "[{\"name\":\"b\",\"p\":3", &done) == 17);  /* b's p is {} */
        CHECK(schema_accepts(un, "[{\"name\":\"a\",\"p\":{", &done) == 17);  /* a's p is an integer */
    }
    /* an object root is still required of users, but a tagged union compiles */
    sched_schema_free(un);
    struct sched_schema *empty = sched_schema_empty_object();
    CHECK(empty && schema_accepts(empty, "{ }", &done) < 0 && done);
    CHECK(empty && schema_accepts(empty, "{\"a\":1}", &done) == 1);
    sched_schema_free(empty);
    struct sched_schema *cp = sched_schema_copy(sc);
    CHECK(cp && schema_accepts(cp, ok[0], &done) < 0 && done);
    sched_schema_free(cp);
    sched_schema_free(sc);
    static const struct { const char *schema, *says; } refused[] = {
        {"{\"type\":\"object\",\"properties\":{\"a\":{\"not\":{}}}}", "'not'"},
        {"{\"anyOf\":[{\"type\":\"string\"}]}", "top-level"},
        {"{\"type\":\"object\",\"properties\":{\"a\":{\"anyOf\":[{\"type\":\"object\",\"properties\":{\"x\":"
         "{\"type\":\"string\"}}},{\"type\":\"object\",\"properties\":{\"y\":{\"type\":\"string\"}}}]}}}", "tagged"},
        {"{\"type\":\"object\",\"properties\":{\"a\":{\"anyOf\":[{\"type\":\"string\"},{\"type\":\"string\","
         "\"format\":\"date\"}]}}}", "same character ('\"')"},
        {"{\"type\":\"string\"}", "top-level"},
        {"{\"type\":\"object\",\"properties\":{\"a\":{\"type\":\"string\",\"pattern\":\"(?=x)\"}}}", "lookaround"},
        {"{\"type\":\"object\",\"properties\":{\"a\":{\"$ref\":\"#/$defs/B\"}}}", "points at nothing"},
        {"{\"type\":\"object\",\"properties\":{\"a\":{\"type\":\"integer\",\"minimum\":3,\"maximum\":2}}}", "minimum"},
        {"{\"type\":\"object\",\"properties\":{\"a\":{\"type\":\"array\",\"uniqueItems\":true}}}", "uniqueItems"},
    };
    for (unsigned i = 0; i < sizeof refused / sizeof *refused; i++) {
        err[0] = 0;
        struct sched_schema *r = schema_of(refused[i].schema, err, sizeof err);
        CHECKF(r == NULL && strstr(err, refused[i].says), "%s -> '%s'", refused[i].schema, err);
        sched_schema_free(r);
    }
}

/* Random damage to a schema and to documents: compile and recognizer must
 * refuse or accept, never crash or read out of bounds (run under ASan when
 * in doubt). */
/* Feeds doc to a fresh guide of sc: -1 when every byte was taken (then
 * *end says whether the output may end there), else the refused byte. */
static int guide_run(const struct sched_schema *sc, const char *doc, size_t n, bool *end)
{
    struct sched_guide g;
    sched_guide_init_schema(&g, sc);
    for (size_t i = 0; i < n; i++)
        if (!sched_guide_step(&g, (uint8_t)doc[i])) return (int)i;
    *end = sched_guide_can_stop(&g);
    return -1;
}

/* pcre2 is the oracle: a regex guide takes a string whole iff pcre2 matches
 * it whole, and refuses a byte only when pcre2 says no string starts with
 * the bytes so far (partial matching). */
static void check_regex_like_pcre2(const struct sched_schema *sc, const char *pattern, const char *alphabet,
                                   uint64_t seed)
{
    int ec;
    PCRE2_SIZE eo;
    char anchored[512];
    snprintf(anchored, sizeof anchored, "\\A(?:%s)\\z", pattern); /* $ would also match before a final newline */
    pcre2_code *re = pcre2_compile((PCRE2_SPTR)anchored, PCRE2_ZERO_TERMINATED, PCRE2_UTF, &ec, &eo, NULL);
    CHECKF(re != NULL, "pcre2 refused %s", pattern);
    if (!re) return;
    pcre2_match_data *md = pcre2_match_data_create_from_pattern(re, NULL);
    size_t na = strlen(alphabet);
    int agree = 0;
    for (int it = 0; it < 3000; it++) {
        char s[16];
        seed = seed * 6364136223846793005ULL + 1442695040888963407ULL;
        int len = (int)(seed >> 60) % 9;
        for (int i = 0; i < len; i++) {
            seed = seed * 6364136223846793005ULL + 1442695040888963407ULL;
            s[i] = alphabet[(seed >> 33) % na];
        }
        bool end = false;
        int at = guide_run(sc, s, (size_t)len, &end);
        int full = pcre2_match(re, (PCRE2_SPTR)s, (size_t)len, 0, 0, md, NULL);
        if (at < 0) {
            CHECKF((full >= 0) == end, "%s on '%.*s': guide %d, pcre2 %d", pattern, len, s, end, full);
            agree += (full >= 0) == end;
        } else {
            /* the refused prefix s[0..at] starts no match */
            int part = pcre2_match(re, (PCRE2_SPTR)s, (size_t)at + 1, 0, PCRE2_PARTIAL_HARD, md, NULL);
            CHECKF(part == PCRE2_ERROR_NOMATCH, "%s refused byte %d of '%.*s', pcre2 says %d", pattern, at, len, s, part);
        }
    }
    CHECK(agree > 0);
    pcre2_match_data_free(md);
    pcre2_code_free(re);
}

static void test_regex_guide(void)
{
    static const struct { const char *re, *alphabet; } cases[] = {
        {"[a-c]+x?", "abcx-"},
        {"(ab|cd){2,3}", "abcd"},
        {"\\d{3}-\\d{2}", "0129-a"},
        {"[^x]*y", "xyab"},
        {"a.b", "ab\n."},
        {"(a|b)*c(d|e)?", "abcde"},
        {"x{0,2}y+", "xy"},
        {"[A-Z][a-z]{1,3}", "Aab1"},
        {"\\w+@\\w+\\.com", "a@.com"},
        {"(foo|foobar)(baz)?", "fobarz"},
        {"(?:\\+|-)?[0-9]+(\\.[0-9]*)?", "+-0.9"},
    };
    char err[256];
    for (unsigned i = 0; i < sizeof cases / sizeof *cases; i++) {
        struct sched_schema *sc = sched_schema_from_regex(cases[i].re, strlen(cases[i].re), err, sizeof err);
        CHECKF(sc != NULL, "%s: %s", cases[i].re, err);
        if (sc) check_regex_like_pcre2(sc, cases[i].re, cases[i].alphabet, 77 + i);
        sched_schema_free(sc);
    }
    static const struct { const char *re, *says; } refused[] = {
        {"(?=a)b", "lookaround"}, {"(a)\\1", "backreferences"}, {"a\\bb", "word boundaries"}, {"(a", "parenthes"},
        {"a^b", "'^'"}, {"*a", "quantifier"}, {"a{5,2}", "repetition"},
    };
    for (unsigned i = 0; i < sizeof refused / sizeof *refused; i++) {
        err[0] = 0;
        struct sched_schema *sc = sched_schema_from_regex(refused[i].re, strlen(refused[i].re), err, sizeof err);
        CHECKF(sc == NULL && strstr(err, refused[i].says), "%s -> '%s'", refused[i].re, err);
        sched_schema_free(sc);
    }
    /* a top-level number (guided_json takes any root) may end once complete */
    json_doc nd;
    const char *ns = "{\"type\":\"integer\",\"maximum\":150}";
    CHECK(json_parse(&nd, ns, strlen(ns), err, sizeof err) == 0);
    struct sched_schema *num = sched_schema_compile(&nd, 0, true, err, sizeof err);
    json_free(&nd);
    bool end = false;
    CHECK(num && guide_run(num, "12", 2, &end) < 0 && end);
    CHECK(num && guide_run(num, "-", 1, &end) < 0 && !end);
    CHECK(num && guide_run(num, "151", 3, &end) == 2);
    sched_schema_free(num);
    /* choice: the strings as they are, regex characters included */
    const char *ch[] = {"yes", "no", "a.b"};
    size_t cl[] = {3, 2, 3};
    struct sched_schema *c = sched_schema_from_choice(ch, cl, 3, err, sizeof err);
    CHECKF(c != NULL, "%s", err);
    CHECK(c && guide_run(c, "yes", 3, &end) < 0 && end);
    CHECK(c && guide_run(c, "a.b", 3, &end) < 0 && end);
    CHECK(c && guide_run(c, "ye", 2, &end) < 0 && !end);
    CHECK(c && guide_run(c, "axb", 3, &end) == 1);
    CHECK(c && guide_run(c, "yess", 4, &end) == 3);
    sched_schema_free(c);
    /* GBNF: the same language as a regex, checked against pcre2 */
    const char *gb = "# a tuple of numbers\nroot ::= \"(\" num (\",\" ws num)* \")\"\nnum ::= [0-9]+ | \"-\" [1-9] [0-9]*\n"
                     "ws ::= [ ]?\n";
    struct sched_schema *gs = sched_schema_from_grammar(gb, strlen(gb), err, sizeof err);
    CHECKF(gs != NULL, "%s", err);
    if (gs) check_regex_like_pcre2(gs, "\\((?:[0-9]+|-[1-9][0-9]*)(?:, ?(?:[0-9]+|-[1-9][0-9]*))*\\)", "(),- 019", 5);
    sched_schema_free(gs);
    const char *multi = "root ::= item\n  | \"[\" item \"]\"\nitem ::= (\n  \"a\" |\n  \"b\" )\n";
    gs = sched_schema_from_grammar(multi, strlen(multi), err, sizeof err);
    CHECKF(gs != NULL, "%s", err);
    CHECK(gs && guide_run(gs, "[b]", 3, &end) < 0 && end);
    CHECK(gs && guide_run(gs, "a", 1, &end) < 0 && end);
    sched_schema_free(gs);
    static const struct { const char *g, *says; } gbad[] = {
        {"root ::= \"a\" root | \"b\"", "recursive"}, {"root ::= foo", "undefined rule 'foo'"},
        {"start ::= \"a\"", "undefined rule 'root'"}, {"root = \"a\"", "name ::="},
    };
    for (unsigned i = 0; i < sizeof gbad / sizeof *gbad; i++) {
        err[0] = 0;
        struct sched_schema *x = sched_schema_from_grammar(gbad[i].g, strlen(gbad[i].g), err, sizeof err);
        CHECKF(x == NULL && strstr(err, gbad[i].says), "%s -> '%s'", gbad[i].g, err);
        sched_schema_free(x);
    }
}

static bool doc_ok(const struct sched_schema *sc, const char *doc)
{
    bool done = false;
    return schema_accepts(sc, doc, &done) < 0 && done;
}

/* What pydantic writes: $defs/$ref (recursive too), Optional (anyOf with
 * null), type lists, enums of any type, bounds, formats, patterns, lengths,
 * maps and free values. */
static void test_schema_features(void)
{
    char err[256];
    struct sched_schema *sc = schema_of(
        "{\"$defs\":{\"Pet\":{\"properties\":{\"kind\":{\"type\":\"string\"}},\"required\":[\"kind\"],\"title\":\"Pet\","
        "\"type\":\"object\"},\"Node\":{\"type\":\"object\",\"properties\":{\"v\":{\"type\":\"integer\"},\"next\":"
        "{\"anyOf\":[{\"$ref\":\"#/$defs/Node\"},{\"type\":\"null\"}]}},\"required\":[\"v\",\"next\"]}},"
        "\"properties\":{\"name\":{\"type\":\"string\"},\"pet\":{\"$ref\":\"#/$defs/Pet\"},\"nick\":{\"anyOf\":"
        "[{\"type\":\"string\"},{\"type\":\"null\"}],\"default\":null},\"list\":{\"$ref\":\"#/$defs/Node\"}},"
        "\"required\":[\"name\",\"pet\"],\"type\":\"object\"}", err, sizeof err);
    CHECKF(sc != NULL, "%s", err);
    if (sc) {
        CHECK(doc_ok(sc, "{\"name\":\"a\",\"pet\":{\"kind\":\"c\"}}"));
        CHECK(doc_ok(sc, "{\"name\":\"a\",\"pet\":{\"kind\":\"c\"},\"nick\":null}"));
        CHECK(doc_ok(sc, "{\"name\":\"a\",\"pet\":{\"kind\":\"c\"},\"nick\":\"z\",\"list\":{\"v\":1,\"next\":{\"v\":2,"
                         "\"next\":null}}}"));
        CHECK(!doc_ok(sc, "{\"name\":\"a\",\"pet\":{\"kind\":1}}"));
        CHECK(!doc_ok(sc, "{\"name\":\"a\",\"pet\":{}}"));
        CHECK(!doc_ok(sc, "{\"name\":\"a\",\"pet\":{\"kind\":\"c\"},\"list\":{\"v\":1}}"));
    }
    sched_schema_free(sc);
    /* bounds: every integer from -300 to 300, and decimals, against the arithmetic */
    sc = schema_of("{\"type\":\"object\",\"properties\":{\"i\":{\"type\":\"integer\",\"minimum\":10,\"maximum\":250},"
                   "\"x\":{\"type\":\"number\",\"exclusiveMinimum\":-0.5,\"maximum\":1.5}},\"required\":[\"i\"]}",
                   err, sizeof err);
    CHECKF(sc != NULL, "%s", err);
    for (int v = -300; sc && v <= 300; v++) {
        char doc[64];
        snprintf(doc, sizeof doc, "{\"i\":%d}", v);
        CHECKF(doc_ok(sc, doc) == (v >= 10 && v <= 250), "%s", doc);
    }
    uint64_t r = 99;
    for (int it = 0; sc && it < 2000; it++) {
        char num[32], doc[64];
        r = r * 6364136223846793005ULL + 1442695040888963407ULL;
        int ip = (int)(r >> 40) % 3, fd = (int)(r >> 50) % 4;
        snprintf(num, sizeof num, "%s%d", (r >> 20) % 3 == 0 ? "-" : "", ip);
        if (fd) {
            strcat(num, ".");
            for (int k = 0; k < fd; k++) {
                r = r * 6364136223846793005ULL + 1442695040888963407ULL;
                char dd[2] = {(char)('0' + (r >> 33) % 10), 0};
                strcat(num, dd);
            }
        }
        double v = strtod(num, NULL);
        snprintf(doc, sizeof doc, "{\"i\":10,\"x\":%s}", num);
        CHECKF(doc_ok(sc, doc) == (v > -0.5 && v <= 1.5), "%s", doc);
    }
    bool done;
    CHECK(sc && schema_accepts(sc, "{\"i\":10,\"x\":1e", &done) == 13); /* no exponent with bounds */
    CHECK(sc && schema_accepts(sc, "{\"i\":3", &done) < 0);            /* 30 .. 39 are in range */
    CHECK(sc && schema_accepts(sc, "{\"i\":260", &done) == 7);         /* 260 is out of range */
    sched_schema_free(sc);
    /* strings: lengths, formats, patterns (pcre2 is not needed: the cases are plain) */
    sc = schema_of("{\"type\":\"object\",\"properties\":{\"s\":{\"type\":\"string\",\"minLength\":2,\"maxLength\":4},"
                   "\"d\":{\"type\":\"string\",\"format\":\"date\"},\"t\":{\"type\":\"string\",\"format\":\"date-time\"},"
                   "\"u\":{\"type\":\"string\",\"format\":\"uuid\"},\"e\":{\"type\":\"string\",\"format\":\"email\"},"
                   "\"p\":{\"type\":\"string\",\"pattern\":\"^[A-Z]{2}\\\\d$\"},\"q\":{\"type\":\"string\",\"pattern\":\"x\"}}}",
                   err, sizeof err);
    CHECKF(sc != NULL, "%s", err);
    static const struct { const char *doc; bool ok; } strs[] = {
        {"{\"s\":\"ab\"}", true}, {"{\"s\":\"abcd\"}", true}, {"{\"s\":\"a\"}", false}, {"{\"s\":\"abcde\"}", false},
        {"{\"s\":\"\xc3\xa9\xc3\xa9\xc3\xa9\xc3\xa9\"}", true}, {"{\"s\":\"\\u00e9x\"}", true},
        {"{\"d\":\"2024-02-29\"}", true}, {"{\"d\":\"2024-13-01\"}", false}, {"{\"d\":\"2024-1-01\"}", false},
        {"{\"t\":\"2024-01-02T03:04:05Z\"}", true}, {"{\"t\":\"2024-01-02T03:04:05.123+02:00\"}", true},
        {"{\"t\":\"2024-01-02 03:04\"}", false},
        {"{\"u\":\"123e4567-e89b-12d3-a456-426614174000\"}", true}, {"{\"u\":\"123e4567e89b\"}", false},
        {"{\"e\":\"a.b+c@mail.example.io\"}", true}, {"{\"e\":\"a@b\"}", false}, {"{\"e\":\"@b.io\"}", false},
        {"{\"p\":\"AB1\"}", true}, {"{\"p\":\"A1\"}", false}, {"{\"p\":\"AB12\"}", false},
        {"{\"q\":\"abxcd\"}", true}, {"{\"q\":\"abc\"}", false},
    };
    for (unsigned i = 0; sc && i < sizeof strs / sizeof *strs; i++)
        CHECKF(doc_ok(sc, strs[i].doc) == strs[i].ok, "%s should be %s", strs[i].doc, strs[i].ok ? "taken" : "refused");
    sched_schema_free(sc);
    /* enums of any type, type lists, maps, any value */
    sc = schema_of("{\"type\":\"object\",\"properties\":{\"e\":{\"enum\":[1,10,2.5,\"a\",null,{\"k\":[1, 2]}]},"
                   "\"n\":{\"type\":[\"integer\",\"null\"]},\"m\":{\"type\":\"object\",\"additionalProperties\":"
                   "{\"type\":\"integer\"}},\"any\":{},\"c\":{\"const\":3}}}", err, sizeof err);
    CHECKF(sc != NULL, "%s", err);
    static const struct { const char *doc; bool ok; } vals[] = {
        {"{\"e\":1}", true}, {"{\"e\":10}", true}, {"{\"e\":2.5}", true}, {"{\"e\":\"a\"}", true}, {"{\"e\":null}", true},
        {"{\"e\":{\"k\":[1,2]}}", true}, {"{\"e\":3}", false}, {"{\"e\":100}", false}, {"{\"e\":\"b\"}", false},
        {"{\"n\":5}", true}, {"{\"n\":null}", true}, {"{\"n\":\"x\"}", false}, {"{\"n\":1.5}", false},
        {"{\"m\":{\"a\":1,\"b\":2}}", true}, {"{\"m\":{}}", true}, {"{\"m\":{\"a\":\"x\"}}", false},
        {"{\"any\":[1,{\"a\":null,\"b\":[true,\"s\"]},-2.5e3]}", true}, {"{\"any\":tru}", false},
        {"{\"c\":3}", true}, {"{\"c\":30}", false}, {"{\"e\":1,\"c\":3}", true}, {"{\"c\":3,\"e\":1}", false},
    };
    for (unsigned i = 0; sc && i < sizeof vals / sizeof *vals; i++)
        CHECKF(doc_ok(sc, vals[i].doc) == vals[i].ok, "%s should be %s", vals[i].doc, vals[i].ok ? "taken" : "refused");
    sched_schema_free(sc);
}

/* The mask against the plain definition, token by token on GPT-2's
 * vocabulary: a token is allowed iff the guide takes all of its bytes (and
 * the stop id iff the output may end). Covers the fast paths (plain strings,
 * DFA walks, maxLength counts) and the mask cache. */
static void test_guide_mask_exact(void)
{
    char err[256], path[512];
    snprintf(path, sizeof path, "%s/ggml-vocab-gpt-2.gguf", TEST_VOCAB_DIR);
    gguf_file *f = gguf_open(path, err, sizeof err);
    model_tok *tok = f ? model_tok_from_gguf(f, err, sizeof err) : NULL;
    CHECKF(tok != NULL, "%s", err);
    if (!tok) {
        gguf_close(f);
        return;
    }
    int V = model_tok_n_vocab(tok);
    struct sched_guide_vocab *gv = sched_guide_vocab_create(tok);
    uint8_t *allow = malloc((size_t)V);
    struct sched_schema *sc = schema_of(
        "{\"type\":\"object\",\"properties\":{\"s\":{\"type\":\"string\",\"maxLength\":5},\"d\":{\"type\":\"string\","
        "\"pattern\":\"^[a-z]+[0-9]?$\"},\"n\":{\"type\":\"integer\",\"minimum\":-5,\"maximum\":120},\"o\":{\"anyOf\":"
        "[{\"type\":\"number\"},{\"type\":\"null\"}]},\"f\":{\"type\":\"string\"}},\"required\":[\"s\"]}", err, sizeof err);
    const char *re = "(ab|cd)+[0-9]{0,3}";
    struct sched_schema *rx = sched_schema_from_regex(re, strlen(re), err, sizeof err);
    CHECK(gv && allow && sc && rx);
    static const struct { int which; const char *prefix; } states[] = {
        {0, ""}, {0, "{"}, {0, "{\"s\":\"ab"}, {0, "{\"s\":\"abcd"}, {0, "{\"s\":\"\",\"d\":\"x"},
        {0, "{\"s\":\"\",\"d\":\"x1"}, {0, "{\"s\":\"\",\"n\":1"}, {0, "{\"s\":\"\",\"n\":-"}, {0, "{\"s\":\"\",\"o\":"},
        {0, "{\"s\":\"\",\"f\":\"free te"}, {0, "{\"s\":\"\"}"}, {1, ""}, {1, "ab"}, {1, "abcd1"}, {1, "ab123"},
    };
    int32_t stop = 50256; /* <|endoftext|> */
    for (int rep = 0; rep < 2 && sc && rx && gv && allow; rep++) /* the second pass reads the cache */
        for (unsigned i = 0; i < sizeof states / sizeof *states; i++) {
            struct sched_guide g;
            sched_guide_init_schema(&g, states[i].which ? rx : sc);
            bool fed = true;
            for (const char *p = states[i].prefix; *p; p++) fed = fed && sched_guide_step(&g, (uint8_t)*p);
            CHECKF(fed, "prefix refused: %s", states[i].prefix);
            sched_guide_vocab_epoch(gv);
            sched_guide_mask(&g, gv, &stop, 1, allow);
            int wrong = 0, first_wrong = -1, n_allowed = 0;
            for (int t = 0; t < V; t++) {
                size_t len = 0;
                const char *b = model_tok_bytes(tok, t, &len);
                bool ok;
                if (t == stop) {
                    ok = sched_guide_can_stop(&g);
                } else if (sched_guide_done(&g) || !b || !len || model_tok_attr(tok, t) != MODEL_TOK_NORMAL) {
                    ok = false;
                } else {
                    struct sched_guide c = g;
                    ok = true;
                    for (size_t k = 0; k < len && ok; k++) ok = sched_guide_step(&c, (uint8_t)b[k]);
                }
                n_allowed += ok;
                if (ok != (allow[t] != 0)) {
                    if (first_wrong < 0) first_wrong = t;
                    wrong++;
                }
            }
            CHECKF(!wrong && n_allowed > 0, "state '%s': %d tokens differ (first %d), %d allowed", states[i].prefix,
                   wrong, first_wrong, n_allowed);
        }
    sched_schema_free(sc);
    sched_schema_free(rx);
    free(allow);
    sched_guide_vocab_destroy(gv);
    model_tok_free(tok);
    gguf_close(f);
}

/* Random patterns and grammars: compiled or refused with a reason, never a
 * crash or a read past the text (run under ASan when in doubt). */
static void test_regex_fuzz(void)
{
    static const char alpha[] = "ab()[]{}|*+?.^$\\-,019dwsx\"=:# \n";
    uint64_t r = 4242;
    int compiled = 0;
    for (int it = 0; it < 3000; it++) {
        char p[24], err[256] = "";
        r = r * 6364136223846793005ULL + 1442695040888963407ULL;
        int n = 1 + (int)(r >> 59);
        for (int i = 0; i < n; i++) {
            r = r * 6364136223846793005ULL + 1442695040888963407ULL;
            p[i] = alpha[(r >> 33) % (sizeof alpha - 1)];
        }
        struct sched_schema *sc = it % 2 ? sched_schema_from_regex(p, (size_t)n, err, sizeof err)
                                         : sched_schema_from_grammar(p, (size_t)n, err, sizeof err);
        CHECKF(sc || err[0], "'%.*s' refused without a reason", n, p);
        compiled += sc != NULL;
        sched_schema_free(sc);
    }
    printf("  regex fuzz: %d of 3000 compiled\n", compiled);
    CHECK(compiled > 100);
}

static void test_guide_fuzz(void)
{
    const char *base =
        "{\"type\":\"object\",\"properties\":{\"a\":{\"type\":\"string\"},\"b\":{\"type\":\"array\",\"items\":"
        "{\"type\":\"object\",\"properties\":{\"c\":{\"enum\":[\"x\",\"y\",true,null]},\"d\":{\"type\":\"number\"}}},"
        "\"maxItems\":3},\"e\":{\"type\":\"integer\"}}}";
    const char *doc = "{\"a\":\"hi\\u0041\",\"b\":[{\"c\":\"x\",\"d\":-1.5e3},{\"c\":true,\"d\":0}],\"e\":42}";
    size_t bl = strlen(base), dl = strlen(doc);
    char buf[512], err[256];
    uint64_t r = 12345;
    int compiled = 0, accepted = 0;
    for (int it = 0; it < 3000; it++) {
        memcpy(buf, base, bl + 1);
        int flips = 1 + (int)(r % 3);
        for (int k = 0; k < flips; k++) {
            r = r * 6364136223846793005ULL + 1442695040888963407ULL;
            buf[(r >> 33) % bl] = (char)(32 + (r >> 20) % 95);
        }
        if (it % 7 == 0) buf[(r >> 40) % bl] = 0; /* truncated */
        json_doc d;
        if (json_parse(&d, buf, strlen(buf), err, sizeof err)) continue;
        struct sched_schema *sc = sched_schema_compile(&d, 0, false, err, sizeof err);
        json_free(&d);
        if (!sc) continue;
        compiled++;
        for (int rep = 0; rep < 4; rep++) {
            struct sched_guide g;
            sched_guide_init_schema(&g, sc);
            for (size_t i = 0; i < dl; i++) {
                r = r * 6364136223846793005ULL + 1442695040888963407ULL;
                uint8_t c = rep == 0 ? (uint8_t)doc[i] : (r >> 40) % 5 == 0 ? (uint8_t)(r >> 48) : (uint8_t)doc[i];
                if (!sched_guide_step(&g, c)) break;
            }
            accepted += sched_guide_done(&g);
        }
        sched_schema_free(sc);
    }
    /* the undamaged document through JSON mode, with random bytes spliced in */
    for (int it = 0; it < 3000; it++) {
        struct sched_guide g;
        sched_guide_init(&g);
        for (size_t i = 0; i < dl; i++) {
            r = r * 6364136223846793005ULL + 1442695040888963407ULL;
            uint8_t c = (r >> 40) % 9 == 0 ? (uint8_t)(r >> 48) : (uint8_t)doc[i];
            if (!sched_guide_step(&g, c)) break;
        }
    }
    printf("  fuzz: %d damaged schemas compiled, %d documents accepted\n", compiled, accepted);
    CHECK(compiled > 0);
}

/* ---- speculative decoding ---- */

static void test_ngram_propose(void)
{
    int32_t d[8];
    const int32_t a[] = {1, 2, 3, 4, 5, 9, 1, 2, 3};
    CHECK(sched_ngram_propose(a, 9, 1, 3, 3, d) == 3 && d[0] == 4 && d[1] == 5 && d[2] == 9);
    /* the latest occurrence of the suffix */
    const int32_t b[] = {1, 2, 7, 1, 2, 8, 1, 2};
    CHECK(sched_ngram_propose(b, 8, 2, 2, 3, d) == 3 && d[0] == 8 && d[1] == 1 && d[2] == 2);
    /* the longest suffix first: [5 1 2] beats the later [1 2] */
    const int32_t c[] = {5, 1, 2, 6, 9, 1, 2, 7, 5, 1, 2};
    CHECK(sched_ngram_propose(c, 11, 1, 3, 3, d) == 3 && d[0] == 6 && d[1] == 9 && d[2] == 1);
    CHECK(sched_ngram_propose(c, 11, 2, 2, 1, d) == 1 && d[0] == 7);
    /* nothing as long as min; fewer tokens than k after the match */
    const int32_t e[] = {3, 4, 5, 6, 3};
    CHECK(sched_ngram_propose(e, 5, 2, 4, 3, d) == 0);
    CHECK(sched_ngram_propose(e, 5, 1, 4, 4, d) == 4 && d[0] == 4 && d[3] == 3);
    CHECK(sched_ngram_propose(e, 1, 1, 4, 4, d) == 0);
}

/* The tokens fake_forward will sample after hist[0..n): a drafter that is
 * always right (every draft accepted) or right only at its first draft. */
static bool half_right;
static int oracle_drafts(void *arg, uint64_t id, const int32_t *tokens, int n, int k, int32_t *draft)
{
    (void)arg, (void)id;
    int32_t h[512];
    memcpy(h, tokens, (size_t)n * sizeof *h);
    for (int i = 0; i < k; i++) {
        h[n + i] = fake_token(h, n + i);
        draft[i] = half_right && i > 0 ? h[n + i] + 1 : h[n + i];
    }
    return k;
}

static sched *mk_spec(kv_pool *p, int seqs, int budget, int max_len, int k, bool always)
{
    struct sched_config c = {.block_size = kv_pool_block_size(p), .max_num_seqs = seqs,
                             .max_num_batched_tokens = budget, .max_model_len = max_len,
                             .spec = {.method = SCHED_SPEC_NGRAM, .num_speculative_tokens = k,
                                      .prompt_lookup_min = 1, .prompt_lookup_max = 3, .always = always}};
    sched *s = sched_create(&c, p, NULL, err, sizeof err);
    CHECKF(s != NULL, "%s", err);
    struct sched_drafter d = {.propose = oracle_drafts};
    if (s) sched_set_drafter(s, &d);
    return s;
}

/* Verification steps as planned: the drafts after the last sampled token,
 * never past max_tokens, a stop id honoured at its token, the accepted
 * drafts counted by position; every output is the one without drafts, in
 * fewer steps; a pool too small for the drafts' blocks plans none. */
static void test_spec_plan(void)
{
    enum { N = 5, PL = 7 };
    int32_t prompts[N][PL], ref[N][32];
    int max_tok[N] = {1, 2, 5, 9, 13}, n_ref[N];
    for (int r = 0; r < N; r++)
        for (int i = 0; i < PL; i++) prompts[r][i] = 3 * r + i + 1;
    int plain_steps = 0;
    for (int r = 0; r < N; r++) {
        kv_pool *p = kv_pool_create(64, 4, false, err, sizeof err);
        sched *s = mk(p, 8, 64, 64, 0.0f);
        struct sched_request rq = req(prompts[r], PL, max_tok[r], SCHED_PRIO_BATCH);
        n_ev = 0;
        submit(s, &rq, 1);
        plain_steps += drain(s, p, 4);
        n_ref[r] = tokens_of(1, ref[r]);
        CHECK(n_ref[r] == max_tok[r]);
        sched_destroy(s);
        kv_pool_destroy(p);
    }
    for (int half = 0; half < 2; half++) {
        half_right = half;
        kv_pool *p = kv_pool_create(64, 4, false, err, sizeof err);
        sched *s = mk_spec(p, 8, 64, 64, 4, true);
        n_ev = 0;
        for (int r = 0; r < N; r++) {
            struct sched_request rq = req(prompts[r], PL, max_tok[r], SCHED_PRIO_BATCH);
            submit(s, &rq, (uint64_t)r + 1);
        }
        /* a stop id inside what the drafts reach: the third token of the last request */
        int32_t stop_id = ref[N - 1][2];
        struct sched_request rs = req(prompts[N - 1], PL, max_tok[N - 1], SCHED_PRIO_BATCH);
        rs.stop_token_ids = &stop_id;
        rs.n_stop_token_ids = 1;
        submit(s, &rs, 99);
        struct step st;
        int steps = 0;
        while (sched_has_work(s) && steps < 200) {
            CHECK(sched_plan_step(s, &st) > 0);
            for (int i = 0; i < st.n_seqs; i++) {
                const struct step_seq *q = &st.seqs[i];
                CHECK(q->n_draft >= 0 && q->n_draft <= 4);
                if (q->n_draft) CHECK(q->query_len == q->n_draft + 1 && q->n_history + q->n_draft == q->context_len);
            }
            fake_forward(&st, 4);
            sched_complete_step(s, &st, collect, NULL);
            CHECKF(kv_debug_check(p, err, sizeof err) == 0, "%s", err);
            steps++;
        }
        for (int r = 0; r < N; r++) {
            int32_t got[64];
            int n = tokens_of((uint64_t)r + 1, got);
            CHECKF(n == max_tok[r] && !memcmp(got, ref[r], sizeof(int32_t) * (size_t)n), "request %d: %d tokens", r, n);
        }
        int32_t got[64];
        int k = 0;
        while (k < 3 && ref[N - 1][k] != stop_id) k++;
        CHECKF(tokens_of(99, got) == k + 1 && !memcmp(got, ref[N - 1], sizeof(int32_t) * (size_t)(k + 1)),
               "the stop id ended the output at token %d", tokens_of(99, got));
        struct sched_stats ss;
        sched_get_stats(s, &ss);
        CHECK(ss.spec_drafts > 0 && ss.spec_accepted_per_pos[0] > 0);
        if (half) CHECKF(ss.spec_accepted_per_pos[1] == 0 && ss.spec_accepted_tokens == ss.spec_accepted_per_pos[0],
                         "half-right drafts: %llu accepted at the second position",
                         (unsigned long long)ss.spec_accepted_per_pos[1]);
        else CHECKF(ss.spec_accepted_tokens == ss.spec_draft_tokens, "right drafts: %llu of %llu accepted",
                    (unsigned long long)ss.spec_accepted_tokens, (unsigned long long)ss.spec_draft_tokens);
        CHECKF(steps < plain_steps, "%d steps with drafts, %d without", steps, plain_steps);
        CHECK(kv_pool_available(p) == 64);
        sched_destroy(s);
        kv_pool_destroy(p);
    }
    half_right = false;

    /* a budget of 16 tokens for eight decodes: the drafts take only what the decodes leave */
    {
        kv_pool *pb = kv_pool_create(64, 4, false, err, sizeof err);
        sched *sb = mk_spec(pb, 8, 16, 64, 4, true);
        n_ev = 0;
        for (int r = 0; r < 8; r++) {
            struct sched_request rq = req(prompts[r % N], 2, 10, SCHED_PRIO_BATCH);
            submit(sb, &rq, (uint64_t)r + 1);
        }
        struct step st;
        CHECK(one_step(sb, &st, 4) == 16); /* the eight prompts */
        for (int k = 0; k < 4 && sched_has_work(sb); k++) {
            struct sched_stats ss;
            sched_get_stats(sb, &ss);
            int n = sched_plan_step(sb, &st), drafts = 0;
            for (int i = 0; i < st.n_seqs; i++) drafts += st.seqs[i].n_draft;
            CHECKF(st.n_seqs == ss.n_running && n <= 16 && drafts == n - st.n_seqs,
                   "step %d: %d of %d decodes, %d tokens", k, st.n_seqs, ss.n_running, n);
            fake_forward(&st, 4);
            sched_complete_step(sb, &st, collect, NULL);
        }
        sched_destroy(sb);
        kv_pool_destroy(pb);
    }

    /* a pool whose blocks the sequences hold all: drafts only as far as their
     * own blocks reach, nobody preempted for them */
    kv_pool *p = kv_pool_create(2, 4, false, err, sizeof err);
    sched *s = mk_spec(p, 8, 64, 8, 4, true);
    n_ev = 0;
    for (int r = 0; r < 2; r++) {
        struct sched_request rq = req(prompts[r], 2, 6, SCHED_PRIO_BATCH);
        submit(s, &rq, (uint64_t)r + 1);
    }
    struct step st;
    CHECK(one_step(s, &st, 4) == 4); /* both prompts: a block each */
    CHECK(sched_plan_step(s, &st) > 0); /* decodes at position 2: a draft at 3 fits the block */
    CHECK(st.n_seqs == 2 && st.seqs[0].n_draft == 1 && st.seqs[1].n_draft == 1);
    struct sched_stats ss;
    sched_get_stats(s, &ss);
    CHECK(ss.preemptions == 0);
    sched_destroy(s);
    kv_pool_destroy(p);
}


/* ---- recurrent state (linear-attention layers) ---------------------------------- */

/* A fake recurrent layer: a slot's state is a hash of every token the
 * sequence has run, so a step that starts from the wrong state (not zeroed,
 * not restored, another sequence's, a stale snapshot) is caught against the
 * hash of its history; the sampled token depends on the state. */
#define REC_SLOTS 32
static uint64_t rec_state[REC_SLOTS];

static uint64_t rec_mix(uint64_t h, int32_t t) { return (h ^ (uint32_t)t) * 0x100000001b3ULL + 0x9e37ULL; }

static void rec_forward(struct step *st, int bs, int n_slots)
{
    fake_forward(st, bs);
    char e[256];
    int tok_seq[512];
    struct model_step_limits lim = {.n_vocab = 100000, .max_tokens = 512, .max_seqs = 64, .max_ctx = 4096,
                                    .block_size = bs, .kv_blocks = 1 << 20, .state_slots = n_slots};
    CHECKF(model_step_check(st, &lim, tok_seq, e, sizeof e) == 0, "%s", e);
    for (int i = 0; i < st->n_seqs; i++) {
        struct step_seq *q = &st->seqs[i];
        int p0 = q->context_len - q->query_len;
        uint64_t h = p0 == 0 ? 0 : q->state_restore ? rec_state[q->state_from] : rec_state[q->state_slot];
        uint64_t want = 0;
        for (int k = 0; k < p0; k++) want = rec_mix(want, q->history[k]);
        CHECKF(h == want, "seq %d starts at %d from a wrong state (restore %d)", i, p0, q->state_restore);
        int sn = 0;
        for (int k = 0; k < q->query_len; k++) {
            h = rec_mix(h, q->history[p0 + k]);
            while (sn < q->n_snaps && q->snap_pos[sn] == p0 + k + 1) rec_state[q->snap_slot[sn++]] = h;
        }
        CHECK(sn == q->n_snaps);
        rec_state[q->state_slot] = h;
        if (q->want_sample) q->out.token = (int32_t)(h % 1000u);
    }
}

static int rec_drain(sched *s, int bs, int n_slots)
{
    struct step st;
    int steps = 0;
    while (sched_has_work(s) && steps < 10000) {
        int n = sched_plan_step(s, &st);
        CHECK(n > 0);
        if (n <= 0) break;
        rec_forward(&st, bs, n_slots);
        sched_complete_step(s, &st, collect, NULL);
        steps++;
    }
    return steps;
}

/* Every state slot is free again: n_seq sequences can take one, one more cannot. */
static void check_state_slots_free(kv_pool *p, int n_seq)
{
    struct kv_seq q[REC_SLOTS + 1];
    for (int i = 0; i <= n_seq; i++) {
        kv_seq_init(&q[i], 77);
        int rc = kv_seq_reserve(p, &q[i], 1);
        CHECKF(i < n_seq ? rc == 0 : rc == KV_ENOSPC, "slot %d: rc %d", i, rc);
    }
    for (int i = 0; i <= n_seq; i++) kv_seq_deinit(p, &q[i]);
}

/* Chunked prefill, prefix hits resumed from snapshots, preemption and abort
 * with recurrent state: every step starts from the state of exactly its
 * sequence's history, the tokens are those of lone uncached runs, and every
 * slot comes back. */
static void test_recurrent_state(void)
{
    enum { N = 6, PL = 30, GEN = 10 };
    int32_t prompts[N][PL];
    for (int r = 0; r < N; r++)
        for (int i = 0; i < PL; i++) prompts[r][i] = r < 3 ? i + 1 : 100 * r + i; /* 0-2 share, 3-5 differ */
    prompts[1][22] = 5; /* shares 22 tokens with prompt 0 */
    prompts[2][9] = 6;  /* shares 9 */
    int32_t alone[N][GEN];
    for (int r = 0; r < N; r++) { /* lone, uncached, one step per token budget */
        kv_pool *p = kv_pool_create(64, 4, false, err, sizeof err);
        CHECK(kv_pool_set_states(p, 4, 0, 1, err, sizeof err) == 0);
        sched *s = mk(p, 4, 64, 64, 0.0f);
        struct sched_request rq = req(prompts[r], PL, GEN, SCHED_PRIO_BATCH);
        n_ev = 0;
        submit(s, &rq, 1);
        rec_drain(s, 4, 4);
        CHECK(tokens_of(1, alone[r]) == GEN);
        sched_destroy(s);
        kv_pool_destroy(p);
    }
    /* cached, chunked (budget 7: chunks cross blocks and snapshot points), one after another */
    kv_pool *p = kv_pool_create(64, 4, true, err, sizeof err);
    CHECK(kv_pool_set_states(p, 4, 27, 2, err, sizeof err) == 0); /* room for every snapshot: no LRU drop */
    sched *s = mk(p, 4, 7, 64, 0.0f);
    for (int r = 0; r < N; r++) {
        struct sched_request rq = req(prompts[r], PL, GEN, SCHED_PRIO_BATCH);
        n_ev = 0;
        submit(s, &rq, 10 + r);
        rec_drain(s, 4, 31);
        int32_t got[GEN * 2];
        CHECKF(tokens_of(10 + r, got) == GEN && !memcmp(got, alone[r], sizeof alone[r]), "request %d differs", r);
        /* hits: prompt 0 again resumes at 28 (its last full block), prompt 1 at 16 (the grid below 22), prompt 2 at 8 */
        int want = r == 0 ? 0 : r == 1 ? 16 : r == 2 ? 8 : 0;
        CHECKF(n_ev > 0 && evs[n_ev - 1].usage.cached_tokens == want, "request %d: cached %d, want %d", r,
               evs[n_ev - 1].usage.cached_tokens, want);
    }
    struct sched_request again = req(prompts[0], PL, GEN, SCHED_PRIO_BATCH);
    n_ev = 0;
    submit(s, &again, 99);
    rec_drain(s, 4, 31);
    int32_t got[GEN * 2];
    CHECK(tokens_of(99, got) == GEN && !memcmp(got, alone[0], sizeof alone[0]));
    CHECK(evs[n_ev - 1].usage.cached_tokens == 28);
    check_state_slots_free(p, 4);
    CHECKF(kv_debug_check(p, err, sizeof err) == 0, "%s", err);
    sched_destroy(s);
    kv_pool_destroy(p);

    /* together in a tight pool (preemption) with an abort */
    p = kv_pool_create(16, 4, true, err, sizeof err);
    CHECK(kv_pool_set_states(p, 4, 8, 2, err, sizeof err) == 0);
    s = mk(p, 4, 16, 64, 0.0f);
    n_ev = 0;
    for (int r = 0; r < N; r++) {
        struct sched_request rq = req(prompts[r], PL, GEN, r % 2 ? SCHED_PRIO_INTERACTIVE : SCHED_PRIO_BATCH);
        submit(s, &rq, (uint64_t)r + 1);
    }
    struct step st;
    for (int k = 0; k < 3; k++) {
        CHECK(sched_plan_step(s, &st) > 0);
        rec_forward(&st, 4, 12);
        sched_complete_step(s, &st, collect, NULL);
    }
    CHECK(sched_abort(s, 6, collect, NULL) == 0);
    rec_drain(s, 4, 12);
    struct sched_stats ss;
    sched_get_stats(s, &ss);
    CHECKF(ss.preemptions > 0, "preemptions %llu", (unsigned long long)ss.preemptions);
    for (int r = 0; r < N - 1; r++) {
        CHECKF(tokens_of((uint64_t)r + 1, got) == GEN && !memcmp(got, alone[r], sizeof alone[r]),
               "request %d differs together", r);
    }
    check_state_slots_free(p, 4);
    CHECKF(kv_debug_check(p, err, sizeof err) == 0, "%s", err);
    sched_destroy(s);
    kv_pool_destroy(p);
}

/* Drafts made after each step (method mtp, the backend's drafter): every
 * sequence that decodes on is listed with its last accepted position, the
 * token after it and blocks for what the drafter writes; drafts made right
 * (by the fake model's own rule) are all accepted, none made means plain
 * decodes, and every output is the one without drafts. */
static void test_spec_made_after_step(void)
{
    enum { N = 4, PL = 5 };
    int32_t prompts[N][PL], ref[N][16];
    int max_tok[N] = {1, 4, 9, 12};
    for (int r = 0; r < N; r++)
        for (int i = 0; i < PL; i++) prompts[r][i] = 7 * r + i + 2;
    for (int r = 0; r < N; r++) {
        kv_pool *p = kv_pool_create(64, 4, false, err, sizeof err);
        sched *s = mk(p, 8, 64, 64, 0.0f);
        struct sched_request rq = req(prompts[r], PL, max_tok[r], SCHED_PRIO_BATCH);
        n_ev = 0;
        submit(s, &rq, 1);
        drain(s, p, 4);
        CHECK(tokens_of(1, ref[r]) == max_tok[r]);
        sched_destroy(s);
        kv_pool_destroy(p);
    }
    for (int make = 0; make < 2; make++) {
        kv_pool *p = kv_pool_create(64, 4, false, err, sizeof err);
        struct sched_config c = {.block_size = 4, .max_num_seqs = 8, .max_num_batched_tokens = 64, .max_model_len = 64,
                                 .spec = {.method = SCHED_SPEC_MTP, .num_speculative_tokens = 3, .always = true}};
        sched *s = sched_create(&c, p, NULL, err, sizeof err);
        CHECKF(s != NULL, "%s", err);
        if (!s) return;
        n_ev = 0;
        for (int r = 0; r < N; r++) {
            struct sched_request rq = req(prompts[r], PL, max_tok[r], SCHED_PRIO_BATCH);
            submit(s, &rq, (uint64_t)r + 1);
        }
        struct step st;
        int steps = 0, listed = 0;
        while (sched_has_work(s) && steps < 100) {
            CHECK(sched_plan_step(s, &st) > 0);
            fake_forward(&st, 4);
            sched_complete_step(s, &st, collect, NULL);
            struct sched_draft_want *w;
            int n = sched_draft_wants(s, &w);
            listed += n;
            for (int i = 0; i < n; i++) {
                CHECK(w[i].seq >= 0 && w[i].seq < st.n_seqs && w[i].k >= 0 && w[i].k <= 3);
                CHECK(w[i].n_blocks * 4 >= w[i].pos + (w[i].k > 1 ? w[i].k : 1) + 1);
                int32_t prev = w[i].token;
                for (int j = 0; j < w[i].k; j++) /* the token at pos + 2 + j, after prev at pos + 1 + j */
                    prev = w[i].drafts[j] = fake_next(prev, w[i].pos + 2 + j);
                w[i].n_made = make ? w[i].k : 0;
            }
            steps++;
        }
        for (int r = 0; r < N; r++) {
            int32_t got[32];
            int n = tokens_of((uint64_t)r + 1, got);
            CHECKF(n == max_tok[r] && !memcmp(got, ref[r], sizeof(int32_t) * (size_t)n), "request %d: %d tokens", r, n);
        }
        struct sched_stats ss;
        sched_get_stats(s, &ss);
        CHECK(listed > 0);
        if (make) CHECKF(ss.spec_drafts > 0 && ss.spec_accepted_tokens == ss.spec_draft_tokens,
                         "%llu of %llu drafts accepted", (unsigned long long)ss.spec_accepted_tokens,
                         (unsigned long long)ss.spec_draft_tokens);
        else CHECK(ss.spec_drafts == 0);
        sched_destroy(s);
        kv_pool_destroy(p);
    }
}

/* The cost rule: a step whose fixed part dominates (a lone decode, a
 * memory-bound step) verifies drafts; a step of many decodes whose tokens
 * cost what a draft does verifies none, but one step in 16 still probes. */
static void test_spec_cost_rule(void)
{
    int32_t prompt[6] = {1, 2, 3, 4, 5, 6};
    for (int busy = 0; busy < 2; busy++) {
        kv_pool *p = kv_pool_create(256, 4, false, err, sizeof err);
        sched *s = mk_spec(p, 16, 256, 128, 3, false);
        if (busy) set_cost(s, 0.0, 1e-3, 1e-3);
        else set_cost(s, 20e-3, 1e-3, 1e-3);
        int n = busy ? 12 : 1;
        n_ev = 0;
        for (int r = 0; r < n; r++) {
            struct sched_request rq = req(prompt, 6, 64, SCHED_PRIO_BATCH);
            submit(s, &rq, (uint64_t)r + 1);
        }
        struct step st;
        int with = 0, steps = 0;
        for (; steps < 40 && sched_has_work(s); steps++) {
            CHECK(sched_plan_step(s, &st) > 0);
            bool d = false;
            for (int i = 0; i < st.n_seqs; i++) d |= st.seqs[i].n_draft > 0;
            with += d;
            fake_forward(&st, 4);
            sched_complete_step(s, &st, collect, NULL);
        }
        if (busy) CHECKF(with <= steps / 16 + 1, "busy: %d of %d steps verified drafts", with, steps);
        else CHECKF(with >= steps - 2, "alone: %d of %d steps verified drafts", with, steps);
        sched_destroy(s);
        kv_pool_destroy(p);
    }
}

int main(void)
{
    RUN(test_step_composition);
    RUN(test_priority);
    RUN(test_min_batch_share);
    RUN(test_interactive_room);
    RUN(test_long_prefill_threshold);
    RUN(test_partial_prefills);
    RUN(test_plan_fuzz);
    RUN(test_time_budget);
    RUN(test_itl_auto);
    RUN(test_first_token_room);
    RUN(test_overloaded);
    RUN(test_cost_calibration);
    RUN(test_calibration_in_loop);
    RUN(test_preemption);
    RUN(test_ngram_propose);
    RUN(test_spec_plan);
    RUN(test_spec_made_after_step);
    RUN(test_spec_cost_rule);
    RUN(test_interactive_takes_slot);
    RUN(test_interactive_never_preempts_interactive);
    RUN(test_no_useless_slot_preemption);
    RUN(test_refusal);
    RUN(test_abort);
    RUN(test_prefix_cache);
    RUN(test_recurrent_state);
    RUN(test_json_guide);
    RUN(test_json_schema_guide);
    RUN(test_regex_guide);
    RUN(test_schema_features);
    RUN(test_guide_mask_exact);
    RUN(test_regex_fuzz);
    RUN(test_guide_fuzz);
    return test_summary();
}

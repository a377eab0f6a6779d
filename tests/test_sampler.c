/* test_sampler.c - model_sample() on tiny hand-made logit vectors. */
#include <math.h>
#include <string.h>

#include "model/model.h"
#include "tests/test.h"

#define NV 8
static double scratch[NV * 4]; /* doubles: the sampler's candidates hold one */

static struct model_sampling params(void)
{
    struct model_sampling s;
    model_sampling_default(&s);
    return s;
}

static int sample(const float *in, const struct model_sampling *s, const int32_t *hist, int np,
                  int nh, uint64_t *rng, struct model_sample_out *out, float *after)
{
    float l[NV];
    memcpy(l, in, sizeof l);
    int rc = model_sample(l, NV, s, hist, np, nh, rng, scratch, out);
    if (after) memcpy(after, l, sizeof l);
    return rc;
}

static const float base[NV] = {1.0f, 3.0f, -2.0f, 3.0f, 0.5f, 2.5f, -1.0f, 0.0f};

static void test_scratch_size(void) { CHECK(model_sample_scratch_bytes(NV) <= sizeof scratch); }

static void test_greedy_ties_lowest_id(void)
{
    struct model_sampling s = params();
    struct model_sample_out o;
    uint64_t rng = model_rng_seed(1), r0 = rng;
    CHECK(sample(base, &s, NULL, 0, 0, &rng, &o, NULL) == 0);
    CHECK(o.token == 1); /* ids 1 and 3 tie at 3.0 */
    CHECK(rng == r0);    /* greedy draws nothing */
    /* logprob under log-softmax of the raw logits */
    double z = 0;
    for (int i = 0; i < NV; i++) z += exp(base[i]);
    CHECKF(fabs(o.logprob - (3.0 - log(z))) < 1e-6, "logprob %f", o.logprob);
}

static void test_top_k_1_is_greedy(void)
{
    struct model_sampling s = params();
    s.temperature = 1.5f;
    s.top_k = 1;
    for (uint64_t seed = 0; seed < 50; seed++) {
        uint64_t rng = model_rng_seed(seed);
        struct model_sample_out o;
        CHECK(sample(base, &s, NULL, 0, 0, &rng, &o, NULL) == 0);
        CHECK(o.token == 1);
    }
}

static void test_top_k_restricts(void)
{
    /* top_k 3 keeps ids 1, 3 (3.0) and 5 (2.5): nothing else may come out */
    struct model_sampling s = params();
    s.temperature = 5.0f;
    s.top_k = 3;
    uint64_t rng = model_rng_seed(7);
    int seen[NV] = {0};
    for (int i = 0; i < 3000; i++) {
        struct model_sample_out o;
        CHECK(sample(base, &s, NULL, 0, 0, &rng, &o, NULL) == 0);
        seen[o.token]++;
    }
    CHECK(seen[1] > 0 && seen[3] > 0 && seen[5] > 0);
    CHECK(seen[0] + seen[2] + seen[4] + seen[6] + seen[7] == 0);
}

static void test_top_p_cut(void)
{
    /* probabilities 0.5, 0.3, 0.15, 0.05 (ids 2, 0, 3, 1) */
    float l[NV];
    for (int i = 0; i < NV; i++) l[i] = -INFINITY;
    l[2] = logf(0.5f), l[0] = logf(0.3f), l[3] = logf(0.15f), l[1] = logf(0.05f);
    struct model_sampling s = params();
    s.temperature = 1.0f;
    s.top_p = 0.75f; /* 0.5 < 0.75 <= 0.8: nucleus {2, 0} */
    uint64_t rng = model_rng_seed(3);
    int seen[NV] = {0};
    for (int i = 0; i < 20000; i++) {
        struct model_sample_out o;
        CHECK(sample(l, &s, NULL, 0, 0, &rng, &o, NULL) == 0);
        seen[o.token]++;
    }
    CHECK(seen[3] == 0 && seen[1] == 0);
    double f2 = seen[2] / 20000.0;
    CHECKF(fabs(f2 - 0.625) < 0.02, "p(2)=%f want 0.625", f2);
    s.top_p = 0.5f; /* exactly the top token's mass: only it */
    for (int i = 0; i < 200; i++) {
        struct model_sample_out o;
        CHECK(sample(l, &s, NULL, 0, 0, &rng, &o, NULL) == 0);
        CHECK(o.token == 2);
    }
}

static void test_min_p_cut(void)
{
    float l[NV];
    for (int i = 0; i < NV; i++) l[i] = -INFINITY;
    l[2] = logf(0.5f), l[0] = logf(0.3f), l[3] = logf(0.15f), l[1] = logf(0.05f);
    struct model_sampling s = params();
    s.temperature = 1.0f;
    s.min_p = 0.2f; /* keeps p >= 0.1: ids 2, 0, 3 */
    uint64_t rng = model_rng_seed(4);
    int seen[NV] = {0};
    for (int i = 0; i < 20000; i++) {
        struct model_sample_out o;
        CHECK(sample(l, &s, NULL, 0, 0, &rng, &o, NULL) == 0);
        seen[o.token]++;
    }
    CHECK(seen[1] == 0);
    CHECK(seen[2] > 0 && seen[0] > 0 && seen[3] > 0);
}

static void test_repetition_penalty(void)
{
    struct model_sampling s = params();
    s.repetition_penalty = 2.0f;
    int32_t hist[] = {1, 2, 2, 5}; /* prompt {1, 2}, generated {2, 5} */
    float after[NV];
    struct model_sample_out o;
    uint64_t rng = 0;
    CHECK(sample(base, &s, hist, 2, 4, &rng, &o, after) == 0);
    float want[NV] = {1.0f, 1.5f, -4.0f, 3.0f, 0.5f, 1.25f, -1.0f, 0.0f};
    CHECK(memcmp(after, want, sizeof want) == 0);
    CHECK(o.token == 3);
}

static void test_presence_frequency(void)
{
    struct model_sampling s = params();
    s.presence_penalty = 0.5f;
    s.frequency_penalty = 0.25f;
    int32_t hist[] = {1, 3, 3, 3, 4}; /* prompt {1}: untouched; generated 3 x3, 4 x1 */
    float after[NV];
    struct model_sample_out o;
    uint64_t rng = 0;
    CHECK(sample(base, &s, hist, 1, 5, &rng, &o, after) == 0);
    float want[NV] = {1.0f, 3.0f, -2.0f, 3.0f - 0.75f - 0.5f, 0.5f - 0.25f - 0.5f, 2.5f, -1.0f, 0.0f};
    CHECK(memcmp(after, want, sizeof want) == 0);
    CHECK(o.token == 1);
}

static void test_top_logprobs(void)
{
    struct model_sampling s = params();
    s.top_logprobs = 3;
    s.repetition_penalty = 2.0f; /* top_logprobs see the penalized logits */
    int32_t hist[] = {3};
    struct model_sample_out o;
    uint64_t rng = 0;
    CHECK(sample(base, &s, hist, 1, 1, &rng, &o, NULL) == 0);
    /* penalized: id3 -> 1.5; order 1 (3.0), 5 (2.5), 3 (1.5) */
    CHECK(o.n_top == 3);
    CHECK(o.top_ids[0] == 1 && o.top_ids[1] == 5 && o.top_ids[2] == 3);
    float pen[NV];
    memcpy(pen, base, sizeof pen);
    pen[3] = 1.5f;
    double z = 0;
    for (int i = 0; i < NV; i++) z += exp(pen[i]);
    CHECK(fabs(o.top_logprobs[0] - (3.0 - log(z))) < 1e-6);
    CHECK(fabs(o.top_logprobs[2] - (1.5 - log(z))) < 1e-6);
    /* temperature does not change reported logprobs */
    s.temperature = 0.3f;
    struct model_sample_out o2;
    rng = model_rng_seed(9);
    CHECK(sample(base, &s, hist, 1, 1, &rng, &o2, NULL) == 0);
    CHECK(memcmp(o.top_logprobs, o2.top_logprobs, 3 * sizeof(float)) == 0);
    s.top_logprobs = MODEL_MAX_TOP_LOGPROBS + 1;
    CHECK(sample(base, &s, hist, 1, 1, &rng, &o2, NULL) == SL_EINVAL);
}

static void test_same_seed_same_sequence(void)
{
    struct model_sampling s = params();
    s.temperature = 1.0f;
    uint64_t a = model_rng_seed(42), b = model_rng_seed(42), c = model_rng_seed(43);
    int same = 1, diff = 0;
    for (int i = 0; i < 1000; i++) {
        struct model_sample_out oa, ob, oc;
        CHECK(sample(base, &s, NULL, 0, 0, &a, &oa, NULL) == 0);
        CHECK(sample(base, &s, NULL, 0, 0, &b, &ob, NULL) == 0);
        CHECK(sample(base, &s, NULL, 0, 0, &c, &oc, NULL) == 0);
        same &= oa.token == ob.token;
        diff += oa.token != oc.token;
    }
    CHECK(same);
    CHECKF(diff > 100, "seeds 42 and 43 differ at %d of 1000 draws", diff);
}

static void test_frequencies(void)
{
    float l[NV];
    for (int i = 0; i < NV; i++) l[i] = -INFINITY;
    l[0] = logf(0.2f), l[4] = logf(0.5f), l[7] = logf(0.3f);
    struct model_sampling s = params();
    s.temperature = 1.0f;
    uint64_t rng = model_rng_seed(2024);
    int seen[NV] = {0}, n = 100000;
    for (int i = 0; i < n; i++) {
        struct model_sample_out o;
        CHECK(sample(l, &s, NULL, 0, 0, &rng, &o, NULL) == 0);
        seen[o.token]++;
    }
    CHECKF(fabs(seen[0] / (double)n - 0.2) < 0.01, "p0 %f", seen[0] / (double)n);
    CHECKF(fabs(seen[4] / (double)n - 0.5) < 0.01, "p4 %f", seen[4] / (double)n);
    CHECKF(fabs(seen[7] / (double)n - 0.3) < 0.01, "p7 %f", seen[7] / (double)n);
    /* temperature 0.5 squares the odds: 0.04 : 0.25 : 0.09 */
    s.temperature = 0.5f;
    memset(seen, 0, sizeof seen);
    for (int i = 0; i < n; i++) {
        struct model_sample_out o;
        CHECK(sample(l, &s, NULL, 0, 0, &rng, &o, NULL) == 0);
        seen[o.token]++;
    }
    double z = 0.04 + 0.25 + 0.09;
    CHECKF(fabs(seen[4] / (double)n - 0.25 / z) < 0.01, "p4 %f", seen[4] / (double)n);
    CHECKF(fabs(seen[0] / (double)n - 0.04 / z) < 0.01, "p0 %f", seen[0] / (double)n);
}

/* logit_bias: added to the raw logits first; the logprob is under the biased
 * distribution; -100 bans, +100 forces; bad ids refused. */
static void test_logit_bias(void)
{
    struct model_sampling s = params();
    struct model_sample_out o;
    float after[NV];
    struct model_logit_bias b[2] = {{.id = 1, .bias = -100.0f}, {.id = 6, .bias = 5.5f}};
    s.logit_bias = b, s.n_logit_bias = 2;
    CHECK(sample(base, &s, NULL, 0, 0, NULL, &o, after) == 0);
    /* 1 banned; 6 goes from -1.0 to 4.5, above 3 (id 3) */
    CHECK(o.token == 6 && after[1] == 3.0f - 100.0f && after[6] == 4.5f && after[3] == 3.0f);
    double z = 0;
    for (int i = 0; i < NV; i++) z += exp((double)after[i] - 4.5);
    CHECKF(fabs(o.logprob - (float)(-log(z))) < 1e-6, "logprob %g", o.logprob);
    s.n_logit_bias = 1; /* only the ban: the tie goes to id 3 */
    CHECK(sample(base, &s, NULL, 0, 0, NULL, &o, NULL) == 0 && o.token == 3);
    /* temperature sampling never draws a banned token */
    struct model_logit_bias ban[6] = {{0, -100}, {1, -100}, {2, -100}, {3, -100}, {4, -100}, {6, -100}};
    s.logit_bias = ban, s.n_logit_bias = 6, s.temperature = 1.5f;
    uint64_t rng = model_rng_seed(9);
    for (int k = 0; k < 200; k++) {
        CHECK(sample(base, &s, NULL, 0, 0, &rng, &o, NULL) == 0);
        CHECKF(o.token == 5 || o.token == 7, "drew %d", o.token);
    }
    struct model_logit_bias bad = {.id = NV, .bias = 1.0f};
    s.logit_bias = &bad, s.n_logit_bias = 1;
    CHECK(sample(base, &s, NULL, 0, 0, NULL, &o, NULL) == SL_EINVAL);
    bad = (struct model_logit_bias){.id = 2, .bias = NAN};
    CHECK(sample(base, &s, NULL, 0, 0, NULL, &o, NULL) == SL_EINVAL);
}

static void test_bad_input(void)
{
    struct model_sampling s = params();
    struct model_sample_out o;
    uint64_t rng = 0;
    int32_t bad[] = {NV};
    CHECK(sample(base, &s, bad, 1, 1, &rng, &o, NULL) == SL_EINVAL);
    s.top_p = 0.0f;
    CHECK(sample(base, &s, NULL, 0, 0, &rng, &o, NULL) == SL_EINVAL);
    s = params();
    s.temperature = -1.0f;
    CHECK(sample(base, &s, NULL, 0, 0, &rng, &o, NULL) == SL_EINVAL);
    s = params();
    float nan_l[NV] = {0, NAN, 0, 0, 0, 0, 0, 0};
    CHECK(sample(nan_l, &s, NULL, 0, 0, &rng, &o, NULL) == SL_EINVAL);
}

/* prompt logprobs: the log-softmax of the raw logits at the token, its rank,
 * and the top ones in order (ties: lower id first), logits untouched */
static void test_logprob_row(void)
{
    float l[NV];
    memcpy(l, base, sizeof l);
    double z = 0;
    for (int i = 0; i < NV; i++) z += exp((double)base[i]);
    struct model_sample_out o;
    model_logprob_row(l, NV, 5, 3, &o);
    CHECK(!memcmp(l, base, sizeof l));
    CHECK(o.token == 5 && fabs(o.logprob - (base[5] - log(z))) < 1e-5);
    CHECK(o.rank == 3); /* 3.0 (ids 1 and 3) above 2.5 */
    CHECK(o.n_top == 3 && o.top_ids[0] == 1 && o.top_ids[1] == 3 && o.top_ids[2] == 5);
    CHECK(fabs(o.top_logprobs[0] - (3.0 - log(z))) < 1e-5 && o.top_logprobs[0] == o.top_logprobs[1]);
    model_logprob_row(l, NV, 2, 0, &o);
    CHECK(o.rank == NV && o.n_top == 0 && fabs(o.logprob - (base[2] - log(z))) < 1e-5);
    model_logprob_row(l, NV, 1, 50, &o);
    CHECK(o.rank == 1 && o.n_top == NV);
    for (int i = 1; i < o.n_top; i++) CHECK(o.top_logprobs[i] <= o.top_logprobs[i - 1]);
}

/* ---- speculative decoding: verification keeps the target distribution ---- */

/* softmax(l / temp) over the top_k largest (0: all) into p */
static void target_probs(const float *l, float temp, int top_k, double *p)
{
    double z = 0.0;
    for (int i = 0; i < NV; i++) {
        int above = 0;
        for (int j = 0; j < NV; j++) above += l[j] > l[i] || (l[j] == l[i] && j < i);
        p[i] = top_k > 0 && above >= top_k ? 0.0 : exp((double)l[i] / temp);
        z += p[i];
    }
    for (int i = 0; i < NV; i++) p[i] /= z;
}

/* Pearson's chi-square of counts against p (cells with p > 0); the 1e-9
 * quantile at 7 degrees of freedom is about 57, so a bound of 80 never flakes
 * while a sampler off by a few percent in any cell fails it by far. */
static double chi2(const int *seen, const double *p, int n)
{
    double x = 0.0;
    for (int i = 0; i < NV; i++) {
        if (p[i] <= 0.0) {
            if (seen[i]) return INFINITY;
            continue;
        }
        double e = p[i] * n;
        x += (seen[i] - e) * (seen[i] - e) / e;
    }
    return x;
}

/* The general form: drafts drawn from q, accepted with min(1, p/q), else
 * the residual: the tokens follow p, and the acceptance is sum min(p, q). */
static void test_spec_accept_distribution(void)
{
    static const float q[NV] = {0.30f, 0.05f, 0.10f, 0.05f, 0.20f, 0.05f, 0.15f, 0.10f};
    struct { float temp; int top_k; } cases[2] = {{1.0f, 0}, {0.7f, 3}};
    for (int c = 0; c < 2; c++) {
        struct model_sampling s = params();
        s.temperature = cases[c].temp;
        s.top_k = cases[c].top_k;
        double p[NV], want_acc = 0.0;
        target_probs(base, s.temperature, s.top_k, p);
        for (int i = 0; i < NV; i++) want_acc += fmin(p[i], (double)q[i]);
        uint64_t rng = model_rng_seed(77 + c), qrng = model_rng_seed(991 + c);
        int seen[NV] = {0}, acc = 0, n = 200000;
        for (int it = 0; it < n; it++) {
            double u = model_rng_uniform(&qrng), cum = 0.0;
            int32_t d = NV - 1;
            for (int i = 0; i < NV; i++)
                if (u < (cum += q[i])) {
                    d = i;
                    break;
                }
            float l[NV];
            memcpy(l, base, sizeof l);
            struct model_sample_out o;
            int r = model_spec_accept(l, NV, &s, NULL, 0, 0, d, q, &rng, scratch, &o);
            CHECK(r == 0 || r == 1);
            CHECK(r == (o.token == d));
            seen[o.token]++;
            acc += r;
        }
        double x = chi2(seen, p, n);
        CHECKF(x < 80.0, "case %d: chi-square %.1f", c, x);
        CHECKF(fabs(acc / (double)n - want_acc) < 0.01, "case %d: acceptance %.4f, want %.4f", c, acc / (double)n,
               want_acc);
    }
}

/* One-hot drafts (model_sample_verify): whatever the draft, the first token
 * follows p, and after an accepted draft the next one follows its row's p;
 * the tokens are those model_sample gives row by row with the same RNG. */
static void test_spec_verify_distribution(void)
{
    struct model_sampling s = params();
    s.temperature = 1.0f;
    double p[NV];
    target_probs(base, 1.0f, 0, p);
    static const float row1[NV] = {0.0f, -1.0f, 2.0f, 0.5f, 1.5f, -3.0f, 1.0f, 0.2f};
    double p1[NV];
    target_probs(row1, 1.0f, 0, p1);
    int32_t drafts[3] = {5, 2, 6}; /* a likely, an unlikely and a middling first draft */
    for (int c = 0; c < 3; c++) {
        int32_t hist[3] = {0, drafts[c], 4}; /* a prompt token, then the drafts */
        uint64_t rng = model_rng_seed(5 + c);
        int seen[NV] = {0}, seen1[NV] = {0}, n = 100000, n1 = 0;
        for (int it = 0; it < n; it++) {
            float l[3 * NV];
            memcpy(l, base, sizeof base);
            memcpy(l + NV, row1, sizeof row1);
            memcpy(l + 2 * NV, base, sizeof base);
            uint64_t before = rng;
            struct model_sample_out o[3];
            int n_out = 0;
            CHECK(model_sample_verify(l, 2, NV, &s, hist, 1, 1, &rng, scratch, o, &n_out) == 0);
            CHECK(n_out >= 1 && n_out <= 3);
            seen[o[0].token]++;
            if (n_out >= 2) seen1[o[1].token]++, n1++;
            /* the same tokens as sampling row by row */
            uint64_t r2 = before;
            for (int j = 0; j < n_out; j++) {
                struct model_sample_out w;
                CHECK(sample(j == 1 ? row1 : base, &s, hist, 1, 1 + j, &r2, &w, NULL) == 0);
                CHECK(w.token == o[j].token && w.logprob == o[j].logprob);
                CHECK(j == n_out - 1 || w.token == hist[1 + j]);
            }
            CHECK(n_out == 3 || o[n_out - 1].token != hist[n_out]);
            CHECK(r2 == rng);
        }
        double x = chi2(seen, p, n), x1 = chi2(seen1, p1, n1);
        CHECKF(x < 80.0 && (n1 < 20000 || x1 < 80.0), "draft %d: chi-square %.1f, after it %.1f (%d)", drafts[c], x, x1, n1);
        CHECKF(fabs(n1 / (double)n - p[drafts[c]]) < 0.01, "draft %d accepted %.4f of the time, p %.4f", drafts[c],
               n1 / (double)n, p[drafts[c]]);
    }
    /* greedy: accepted while the draft is the argmax, then the argmax */
    s = params();
    int32_t hist[3] = {0, 1, 4};
    float l[3 * NV];
    memcpy(l, base, sizeof base);
    memcpy(l + NV, row1, sizeof row1);
    memcpy(l + 2 * NV, base, sizeof base);
    struct model_sample_out o[3];
    int n_out = 0;
    CHECK(model_sample_verify(l, 2, NV, &s, hist, 1, 1, NULL, scratch, o, &n_out) == 0);
    CHECKF(n_out == 2 && o[0].token == 1 && o[1].token == 2, "%d tokens: %d %d", n_out, o[0].token, o[1].token);
}

int main(void)
{
    RUN(test_scratch_size);
    RUN(test_greedy_ties_lowest_id);
    RUN(test_top_k_1_is_greedy);
    RUN(test_top_k_restricts);
    RUN(test_top_p_cut);
    RUN(test_min_p_cut);
    RUN(test_repetition_penalty);
    RUN(test_presence_frequency);
    RUN(test_logit_bias);
    RUN(test_top_logprobs);
    RUN(test_same_seed_same_sequence);
    RUN(test_frequencies);
    RUN(test_bad_input);
    RUN(test_logprob_row);
    RUN(test_spec_accept_distribution);
    RUN(test_spec_verify_distribution);
    return test_summary();
}

/* sampler.c - turning one row of logits into one token (model.h, "sampler").
 *
 * Order of operations, fixed so that results are reproducible:
 *   0. logit_bias, added to the raw logits in place (OpenAI's logit_bias),
 *      and the allow mask (JSON mode): a disallowed id's logit becomes -inf;
 *   1. penalties on the biased logits, in place: repetition (HF: over the
 *      distinct ids of prompt + generated; logit > 0 -> /p, else *p), then
 *      presence and frequency (OpenAI: over generated ids only);
 *   2. log-softmax of those logits -> logprob of the chosen token and the
 *      top_logprobs alternatives (before temperature, as vLLM reports them);
 *   3. temperature 0 -> argmax (lowest id on ties). Otherwise divide by the
 *      temperature, keep the top_k, then the top_p nucleus, then drop what is
 *      below min_p * p_max, and draw from what is left with the request's RNG.
 * Candidates are ordered by (logit desc, id asc), so ties never depend on a
 * sort's stability. Everything runs in the caller's scratch: no allocation.
 */
#include <math.h>
#include <stdlib.h>
#include <string.h>

#include "model.h"

struct cand {
    float logit;
    int32_t id;
    double e; /* step 3: exp(logit - max), computed once per candidate and reused */
};

void model_sampling_default(struct model_sampling *s)
{
    memset(s, 0, sizeof *s);
    s->temperature = 0.0f;
    s->top_p = 1.0f;
    s->top_k = 0;
    s->min_p = 0.0f;
    s->repetition_penalty = 1.0f;
}

/* splitmix64: one 64-bit word of state, good enough statistically for
 * sampling and trivially reproducible. */
static uint64_t rng_next(uint64_t *s)
{
    uint64_t z = (*s += 0x9e3779b97f4a7c15ULL);
    z = (z ^ (z >> 30)) * 0xbf58476d1ce4e5b9ULL;
    z = (z ^ (z >> 27)) * 0x94d049bb133111ebULL;
    return z ^ (z >> 31);
}

uint64_t model_rng_seed(uint64_t seed)
{
    uint64_t s = seed ^ 0x5851f42d4c957f2dULL;
    return rng_next(&s);
}

double model_rng_uniform(uint64_t *s) { return (double)(rng_next(s) >> 11) * 0x1.0p-53; }

size_t model_sample_scratch_bytes(int n_vocab)
{
    /* cand[n_vocab] (two floats' worth each) + int counts[n_vocab] */
    return (size_t)n_vocab * (sizeof(struct cand) + sizeof(int));
}

/* a before b in sampling order: higher logit first, then lower id. */
static int cand_cmp(const void *pa, const void *pb)
{
    const struct cand *a = pa, *b = pb;
    if (a->logit > b->logit) return -1;
    if (a->logit < b->logit) return 1;
    return (a->id > b->id) - (a->id < b->id);
}

static bool cand_before(const struct cand *a, const struct cand *b) { return cand_cmp(a, b) < 0; }

/* Moves the k best candidates (in sampling order) to c[0..k), sorted.
 * Keeps a sorted window of size k while scanning: O(n k) for small k, a full
 * sort otherwise. */
static void top_k_sorted(struct cand *c, int n, int k)
{
    if (k >= n || k > 64) {
        qsort(c, (size_t)n, sizeof *c, cand_cmp);
        return;
    }
    int have = 0;
    for (int i = 0; i < n; i++) {
        struct cand x = c[i];
        if (have == k && !cand_before(&x, &c[k - 1])) continue;
        int j = have < k ? have++ : k - 1;
        while (j > 0 && cand_before(&x, &c[j - 1])) {
            c[j] = c[j - 1];
            j--;
        }
        c[j] = x;
    }
}

/* Steps 0-2: checks the arguments, applies bias, mask and penalties to
 * logits in place, and fills out's top alternatives; *best: the argmax
 * (lowest id on ties), *mx its logit, *lse the log-sum-exp. */
static int prepare(float *logits, int n_vocab, const struct model_sampling *s, const int32_t *history, int n_prompt,
                   int n_history, void *scratch, struct model_sample_out *out, float *mx_out, int32_t *best_out,
                   double *lse_out)
{
    if (!logits || n_vocab <= 0 || !s || !scratch || !out || n_prompt < 0 || n_history < n_prompt ||
        (n_history > 0 && !history))
        return SL_EINVAL;
    if (!(s->temperature >= 0.0f) || !(s->top_p > 0.0f && s->top_p <= 1.0f) ||
        !(s->min_p >= 0.0f && s->min_p <= 1.0f) || !(s->repetition_penalty > 0.0f) ||
        !isfinite(s->presence_penalty) || !isfinite(s->frequency_penalty) ||
        s->top_logprobs < 0 || s->top_logprobs > MODEL_MAX_TOP_LOGPROBS)
        return SL_EINVAL;
    for (int i = 0; i < n_history; i++)
        if (history[i] < 0 || history[i] >= n_vocab) return SL_EINVAL;
    if (s->n_logit_bias < 0 || (s->n_logit_bias > 0 && !s->logit_bias)) return SL_EINVAL;
    for (int i = 0; i < s->n_logit_bias; i++)
        if (s->logit_bias[i].id < 0 || s->logit_bias[i].id >= n_vocab || !isfinite(s->logit_bias[i].bias))
            return SL_EINVAL;

    struct cand *c = scratch;
    int *count = (int *)(c + n_vocab);

    /* 0. logit bias, allow mask */
    for (int i = 0; i < s->n_logit_bias; i++) logits[s->logit_bias[i].id] += s->logit_bias[i].bias;
    if (s->allow)
        for (int i = 0; i < n_vocab; i++)
            if (i >= s->n_allow || !s->allow[i]) logits[i] = -INFINITY;

    /* 1. penalties */
    if (s->repetition_penalty != 1.0f && n_history > 0) {
        memset(count, 0, (size_t)n_vocab * sizeof *count);
        float p = s->repetition_penalty;
        for (int i = 0; i < n_history; i++) {
            int32_t id = history[i];
            if (count[id]) continue;
            count[id] = 1;
            logits[id] = logits[id] > 0.0f ? logits[id] / p : logits[id] * p;
        }
    }
    if ((s->presence_penalty != 0.0f || s->frequency_penalty != 0.0f) && n_history > n_prompt) {
        memset(count, 0, (size_t)n_vocab * sizeof *count);
        for (int i = n_prompt; i < n_history; i++) count[history[i]]++;
        for (int i = n_prompt; i < n_history; i++) {
            int32_t id = history[i];
            if (count[id] <= 0) continue; /* already applied */
            logits[id] -= s->frequency_penalty * (float)count[id] + s->presence_penalty;
            count[id] = 0;
        }
    }

    /* 2. log-softmax of the penalized logits */
    float mx = -INFINITY;
    int32_t best = 0;
    for (int i = 0; i < n_vocab; i++) {
        if (logits[i] > mx) { /* strict: the lowest id wins ties */
            mx = logits[i];
            best = i;
        } else if (isnan(logits[i])) {
            return SL_EINVAL;
        }
    }
    if (!isfinite(mx)) return SL_EINVAL; /* all -inf, or +inf: nothing sensible to sample */
    double sum = 0.0;
    for (int i = 0; i < n_vocab; i++) /* exp(-inf) adds exactly 0: masked ids cost a compare */
        if (logits[i] > -INFINITY) sum += exp((double)logits[i] - (double)mx);
    double lse = (double)mx + log(sum);

    out->n_top = 0;
    if (s->top_logprobs > 0) {
        int k = s->top_logprobs < n_vocab ? s->top_logprobs : n_vocab;
        for (int i = 0; i < n_vocab; i++) c[i] = (struct cand){logits[i], i, 0.0};
        top_k_sorted(c, n_vocab, k);
        for (int i = 0; i < k; i++) {
            out->top_ids[i] = c[i].id;
            out->top_logprobs[i] = (float)((double)c[i].logit - lse);
        }
        out->n_top = k;
    }

    *mx_out = mx;
    *best_out = best;
    *lse_out = lse;
    return SL_OK;
}

/* Whether step 3 draws at all: temperature 0 or top_k 1 take the argmax. */
static bool draws(const struct model_sampling *s) { return s->temperature > 0.0f && s->top_k != 1; }

/* Step 3's candidates (draws(s) only): c[0 .. n) with their weights e
 * (unnormalized probabilities) after temperature, top_k, top_p and min_p.
 * Returns n. */
static int candidates(const float *logits, int n_vocab, const struct model_sampling *s, float mx, struct cand *c)
{
    {
        float inv_t = 1.0f / s->temperature;
        int n = 0;
        float cmx = mx * inv_t;
        for (int i = 0; i < n_vocab; i++)
            if (logits[i] > -INFINITY) {
                float l = logits[i] * inv_t;
                c[n++] = (struct cand){l, i, exp((double)l - cmx)};
            }
        bool sorted = false;
        if (s->top_k > 0 && s->top_k < n) {
            top_k_sorted(c, n, s->top_k);
            n = s->top_k;
            sorted = true;
        }
        if (s->top_p < 1.0f) {
            double z = 0.0;
            for (int i = 0; i < n; i++) z += c[i].e;
            if (!sorted) {
                /* The nucleus is a prefix of the sorted order. Sort only the
                 * candidates above a threshold when they already hold top_p of
                 * the mass (exact: every candidate left out ranks after them). */
                for (double thr = 1e-4;; thr *= 1e-3) {
                    int m = 0;
                    double mass = 0.0;
                    double cut = thr <= 1e-30 ? -1.0 : thr;
                    for (int i = 0; i < n; i++) {
                        double p = c[i].e / z;
                        if (p >= cut) {
                            struct cand t = c[m];
                            c[m] = c[i];
                            c[i] = t;
                            m++;
                            mass += p;
                        }
                    }
                    if (mass >= s->top_p || cut < 0.0) {
                        qsort(c, (size_t)m, sizeof *c, cand_cmp);
                        n = m;
                        break;
                    }
                }
                sorted = true;
            }
            double cum = 0.0;
            int keep = n;
            for (int i = 0; i < n; i++) {
                cum += c[i].e / z;
                if (cum >= s->top_p) {
                    keep = i + 1;
                    break;
                }
            }
            n = keep;
        }
        if (s->min_p > 0.0f) {
            /* p_i >= min_p * p_max  <=>  logit_i >= logit_max + log(min_p) */
            float lim = cmx + logf(s->min_p);
            int m = 0;
            for (int i = 0; i < n; i++)
                if (c[i].logit >= lim) c[m++] = c[i];
            n = m;
        }
        return n;
    }
}

int model_sample(float *logits, int n_vocab, const struct model_sampling *s, const int32_t *history,
                 int n_prompt, int n_history, uint64_t *rng, void *scratch,
                 struct model_sample_out *out)
{
    float mx;
    int32_t best;
    double lse;
    int rc = prepare(logits, n_vocab, s, history, n_prompt, n_history, scratch, out, &mx, &best, &lse);
    if (rc) return rc;
    uint64_t local_rng = 0;
    if (!rng) rng = &local_rng;

    /* 3. choose */
    int32_t tok = best;
    if (draws(s)) {
        struct cand *c = scratch;
        int n = candidates(logits, n_vocab, s, mx, c);
        double z = 0.0;
        for (int i = 0; i < n; i++) z += c[i].e;
        double u = model_rng_uniform(rng) * z, cum = 0.0;
        tok = c[n - 1].id;
        for (int i = 0; i < n; i++) {
            cum += c[i].e;
            if (u < cum) {
                tok = c[i].id;
                break;
            }
        }
    }
    out->token = tok;
    out->logprob = (float)((double)logits[tok] - lse);
    return SL_OK;
}

int model_sample_verify(float *logits, int n_draft, int n_vocab, const struct model_sampling *s,
                        const int32_t *history, int n_prompt, int n_history, uint64_t *rng, void *scratch,
                        struct model_sample_out *out, int *n_out)
{
    *n_out = 0;
    if (!logits || n_draft < 0 || n_vocab <= 0 || !history || !out) return SL_EINVAL;
    for (int i = 0; i <= n_draft; i++) {
        float *row = logits + (size_t)i * n_vocab;
        if (model_sample(row, n_vocab, s, history, n_prompt, n_history + i, rng, scratch, &out[i]) != SL_OK) {
            out[i].token = -1;
            out[i].n_top = 0;
            *n_out = i + 1;
            return SL_OK;
        }
        *n_out = i + 1;
        if (i == n_draft || out[i].token != history[n_history + i]) break;
    }
    return SL_OK;
}

int model_spec_accept(float *logits, int n_vocab, const struct model_sampling *s, const int32_t *history,
                      int n_prompt, int n_history, int32_t d, const float *q, uint64_t *rng, void *scratch,
                      struct model_sample_out *out)
{
    if (d < 0 || d >= n_vocab) return SL_EINVAL;
    if (!q) {
        int rc = model_sample(logits, n_vocab, s, history, n_prompt, n_history, rng, scratch, out);
        return rc ? rc : out->token == d;
    }
    float mx;
    int32_t best;
    double lse;
    int rc = prepare(logits, n_vocab, s, history, n_prompt, n_history, scratch, out, &mx, &best, &lse);
    if (rc) return rc;
    uint64_t local_rng = 0;
    if (!rng) rng = &local_rng;
    struct cand *c = scratch;
    int n;
    double z = 0.0;
    if (draws(s)) {
        n = candidates(logits, n_vocab, s, mx, c);
        for (int i = 0; i < n; i++) z += c[i].e;
    } else { /* greedy: p is one-hot at the argmax */
        c[0] = (struct cand){logits[best], best, 1.0};
        n = 1;
        z = 1.0;
    }
    double pd = 0.0;
    for (int i = 0; i < n; i++)
        if (c[i].id == d) pd = c[i].e / z;
    int32_t tok = -1;
    if (model_rng_uniform(rng) * (double)q[d] < pd) {
        tok = d;
    } else {
        /* the residual max(0, p - q): only the candidates can have mass */
        double r = 0.0;
        for (int i = 0; i < n; i++) {
            double m = c[i].e / z - (double)q[c[i].id];
            c[i].e = m > 0.0 ? m : 0.0;
            r += c[i].e;
        }
        double u = model_rng_uniform(rng) * r, cum = 0.0;
        for (int i = 0; i < n && tok < 0; i++) {
            cum += c[i].e;
            if (c[i].e > 0.0 && u < cum) tok = c[i].id;
        }
        if (tok < 0) /* r == 0 (p == q where p has mass): rounding; the last candidate with mass */
            for (int i = n - 1; i >= 0 && tok < 0; i--)
                if (c[i].e > 0.0) tok = c[i].id;
        if (tok < 0) tok = best;
    }
    out->token = tok;
    out->logprob = (float)((double)logits[tok] - lse);
    return tok == d;
}

void model_logprob_row(const float *logits, int n_vocab, int32_t token, int n_top, struct model_sample_out *out)
{
    float mx = -INFINITY;
    for (int i = 0; i < n_vocab; i++)
        if (logits[i] > mx) mx = logits[i];
    double sum = 0.0;
    float tv = token >= 0 && token < n_vocab ? logits[token] : -INFINITY;
    int above = 0;
    for (int i = 0; i < n_vocab; i++) {
        sum += exp((double)(logits[i] - mx));
        above += logits[i] > tv;
    }
    out->rank = above + 1;
    float lse = mx + (float)log(sum);
    out->token = token;
    out->logprob = token >= 0 && token < n_vocab ? logits[token] - lse : -INFINITY;
    if (n_top > MODEL_MAX_TOP_LOGPROBS) n_top = MODEL_MAX_TOP_LOGPROBS;
    if (n_top > n_vocab) n_top = n_vocab;
    out->n_top = 0;
    /* insertion into a short sorted list: n_top is at most 20; ties keep the lower id first */
    for (int i = 0; i < n_vocab && n_top > 0; i++) {
        float v = logits[i];
        int n = out->n_top;
        if (n == n_top && !(v > out->top_logprobs[n - 1])) continue;
        int j = n < n_top ? n : n - 1;
        while (j > 0 && v > out->top_logprobs[j - 1]) {
            out->top_logprobs[j] = out->top_logprobs[j - 1];
            out->top_ids[j] = out->top_ids[j - 1];
            j--;
        }
        out->top_logprobs[j] = v;
        out->top_ids[j] = i;
        if (n < n_top) out->n_top++;
    }
    for (int i = 0; i < out->n_top; i++) out->top_logprobs[i] -= lse;
}

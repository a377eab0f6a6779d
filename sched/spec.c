/* spec.c - speculative decoding's scheduler side: the n-gram drafter
 * (prompt lookup) and the drafter the scheduler starts with.
 *
 * Verification itself is the backend's (step_seq.n_draft,
 * model_sample_verify); planning which sequences carry drafts is
 * sched_plan.c's, folding the verified tokens in sched_output.c's.
 */
#include <string.h>

#include "sched_internal.h"

int sched_ngram_propose(const int32_t *tokens, int n, int min, int max, int k, int32_t *draft)
{
    if (min < 1 || k < 1) return 0;
    for (int len = max; len >= min; len--) {
        if (len >= n) continue; /* the suffix needs an earlier occurrence */
        const int32_t *suf = tokens + n - len;
        /* the latest occurrence first: the nearest context is the likeliest to repeat */
        for (int j = n - len - 1; j >= 0; j--) {
            if (tokens[j] != suf[0] || memcmp(tokens + j, suf, (size_t)len * sizeof *tokens)) continue;
            int m = n - (j + len); /* >= 1: the occurrence ends before the suffix */
            if (m > k) m = k;
            memcpy(draft, tokens + j + len, (size_t)m * sizeof *draft);
            return m;
        }
    }
    return 0;
}

static int ngram_drafter(void *arg, uint64_t id, const int32_t *tokens, int n, int k, int32_t *draft)
{
    const struct sched_spec_config *c = arg;
    (void)id;
    return sched_ngram_propose(tokens, n, c->prompt_lookup_min, c->prompt_lookup_max, k, draft);
}

void sched_spec_init(sched *s)
{
    memset(&s->drafter, 0, sizeof s->drafter);
    if (s->cfg.spec.method == SCHED_SPEC_NGRAM) s->drafter = (struct sched_drafter){.propose = ngram_drafter, .arg = &s->cfg.spec};
    /* a draft is worth half a token until drafts are measured */
    for (int i = 0; i < SCHED_MAX_SPEC_TOKENS; i++) s->spec_prop[i] = 2.0, s->spec_acc[i] = 1.0;
}

void sched_set_drafter(sched *s, const struct sched_drafter *d)
{
    if (d) s->drafter = *d;
    else memset(&s->drafter, 0, sizeof s->drafter);
}

void sched_spec_verified(sched *s, int n_draft, int n_accepted)
{
    struct sched_stats *t = &s->stats;
    t->spec_drafts++;
    t->spec_draft_tokens += (uint64_t)n_draft;
    t->spec_accepted_tokens += (uint64_t)n_accepted;
    for (int i = 0; i < n_accepted && i < SCHED_MAX_SPEC_TOKENS; i++) t->spec_accepted_per_pos[i]++;
    /* the cost rule's estimates: a memory of ~100 verifications */
    for (int i = 0; i < n_draft && i < SCHED_MAX_SPEC_TOKENS; i++) {
        s->spec_prop[i] = s->spec_prop[i] * SCHED_COST_FORGET + 1.0;
        s->spec_acc[i] = s->spec_acc[i] * SCHED_COST_FORGET + (i < n_accepted);
    }
}

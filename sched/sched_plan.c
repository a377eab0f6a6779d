/* sched_plan.c - planning a step (sched.h: the step order, the time
 * targets, preemption): which decodes, prefill chunks and admissions go into
 * it, within the token budget, the sequence slots, the KV blocks and the
 * time the cost model predicts.
 */
#include <limits.h>
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

#include "sched_internal.h"

static void preempt(sched *s, sched_req *q)
{
    int i = sched_run_index(s, q);
    SL_ASSERT(i >= 0 && !q->in_step);
    sched_run_remove_at(s, i);
    kv_seq_release(s->pool, &q->kv);
    q->n_computed = 0;
    if (s->drafter.release) s->drafter.release(s->drafter.arg, q->id);
    q->n_preempt++;
    s->stats.preemptions++;
    sched_wait_push_front(&s->wait[q->prio], q);
}

/* The running sequence to preempt: the tail-most one not already in this
 * step (lowest priority, most recently admitted). min_prio: only victims of
 * this class or a lower one (a higher number). NULL when none. */
static sched_req *pick_victim(const sched *s, int min_prio)
{
    for (int i = s->n_run - 1; i >= 0; i--) {
        sched_req *v = s->run[i];
        if ((int)v->prio < min_prio) return NULL;
        if (!v->in_step) return v;
    }
    return NULL;
}

/* Makes q's table cover n tokens, preempting from the tail while the pool is
 * dry. Returns false when q itself had to be preempted. */
static bool reserve_running(sched *s, sched_req *q, int n)
{
    while (kv_seq_reserve(s->pool, &q->kv, n) != 0) {
        sched_req *v = pick_victim(s, 0);
        SL_ASSERT(v); /* q itself is a candidate */
        preempt(s, v);
        if (v == q) return false;
    }
    return true;
}

/* ---- planning -------------------------------------------------------------------- */

static bool is_decode(const sched_req *q)
{
    return q->n_tokens > q->n_prompt && q->n_computed == q->n_tokens - 1;
}

static int prompt_left(const sched_req *q) { return q->n_tokens - q->n_computed; }

/* What len prefill tokens from position n0 cost by the cost model, in
 * seconds: each token, the keys it attends to (positions 0 .. its own),
 * and a sample when the chunk ends the prompt. */
static double prefill_cost(const sched *s, int n0, int len, bool sample)
{
    const double *k = s->cost.coef;
    return k[SCHED_COST_PREFILL] * len + k[SCHED_COST_PAIR] * ((double)len * n0 + (double)len * (len + 1) / 2.0) +
           (sample ? k[SCHED_COST_SAMPLE] : 0.0);
}

/* What a decode at position n0 costs: the token, the n0 + 1 keys it reads, its sample. */
static double decode_cost(const sched *s, int n0)
{
    const double *k = s->cost.coef;
    return k[SCHED_COST_DECODE] + k[SCHED_COST_DECODE_KEY] * (n0 + 1.0) + k[SCHED_COST_SAMPLE];
}

/* The step's planned time if one more piece joins it: the fixed part comes with the first. */
static double step_base(const sched *s)
{
    return s->step_time + (s->n_step_seqs == 0 ? s->cost.coef[SCHED_COST_STEP] : 0.0);
}

/* The most prefill tokens from position n0 that cost at most left seconds
 * (a sample counted in). */
static int chunk_fit(const sched *s, int n0, double left)
{
    const double *k = s->cost.coef;
    left -= k[SCHED_COST_SAMPLE];
    if (!(left > 0.0)) return 0;
    double a = k[SCHED_COST_PAIR] / 2.0, b = k[SCHED_COST_PREFILL] + k[SCHED_COST_PAIR] * (n0 + 0.5);
    double x;
    if (a <= 0.0 && b <= 0.0) return INT_MAX - 1;
    if (a <= 0.0) x = left / b;
    else x = (-b + sqrt(b * b + 4.0 * a * left)) / (2.0 * a);
    int len = x >= INT_MAX - 1 ? INT_MAX - 2 : (int)x;
    while (len > 0 && prefill_cost(s, n0, len, true) > left + k[SCHED_COST_SAMPLE]) len--; /* rounding */
    while (len < INT_MAX - 2 && prefill_cost(s, n0, len + 1, true) <= left + k[SCHED_COST_SAMPLE]) len++;
    return len;
}

/* A time cap on prefill in a step: whether it holds, the planned time the
 * step may reach, a token even past it (one), and the granule its cut
 * chunks end the step on. */
struct step_cap {
    bool on;
    double limit;
    bool one;
    int granule;
    bool efficient; /* the class's prefill may take as long as the step before it, even past limit */
};

/* Where c's limit cannot be met anyway (the step's fixed part and its
 * decodes take it already, as on a loaded machine), cutting prefill to a
 * token a step would only make it worse: the fixed part paid again for
 * every token. An efficient cap lets the class's prefill take as long as
 * what the step held before it. */
static void cap_floor(const sched *s, struct step_cap *c)
{
    double b0 = step_base(s);
    if (c->on && c->efficient && c->limit < 2.0 * b0) c->limit = 2.0 * b0;
}

/* A chunk of at most len tokens from n0 in a step that holds T tokens: the
 * longest that fits c's time, at least one when c->one; when the time cut
 * it, moved so that the step ends on the nearest multiple of c->granule
 * tokens, or of a quarter of it below one granule (the cap is a target: it
 * may be passed by half a granule). */
static int capped_len(const sched *s, const struct step_cap *c, int n0, int len, int T)
{
    if (!c->on) return len;
    int fit = chunk_fit(s, n0, c->limit - step_base(s)), g = c->granule;
    if (len <= fit) return len;
    if (fit <= 0) return c->one ? 1 : 0;
    if (g > 1 && T + fit < g) g /= 4;
    int end = g > 1 ? (T + fit + g / 2) / g * g : 0;
    if (end > T) fit = end - T < len ? end - T : len;
    return fit;
}

/* q's next chunk before any time cap: what is left of its prompt, at most
 * avail tokens and long_prefill_token_threshold. */
static int chunk_max(const sched *s, const sched_req *q, int avail)
{
    int len = prompt_left(q), thr = s->cfg.long_prefill_token_threshold;
    if (len > avail) len = avail;
    return thr > 0 && len > thr ? thr : len;
}

/* The partial-prefill limits (max_num_partial_prefills > 1): whether q's
 * prompt is long, and whether a class that already moves npf prompts, nlong
 * of them long, in this step may move one more: 1 yes, 0 not this one (the
 * long limit holds; a shorter one may), -1 none more. */
static bool long_prompt(const sched *s, const sched_req *q)
{
    int thr = s->cfg.long_prefill_token_threshold;
    if (thr <= 0) thr = (int)(s->cfg.max_model_len * 0.04);
    return prompt_left(q) > thr;
}
static int prefill_fits(const sched *s, bool lg, int npf, int nlong)
{
    int n = s->cfg.max_num_partial_prefills;
    if (n <= 1) return 1;
    if (npf >= n) return -1;
    return lg && nlong >= s->cfg.max_long_partial_prefills ? 0 : 1;
}

/* class c's running prompts (not yet decoding), and the long ones among
 * them: what the partial-prefill limits count before anything is admitted */
static void running_prefills(const sched *s, int c, int *npf, int *nlong)
{
    *npf = *nlong = 0;
    for (int i = 0; i < s->n_run; i++)
        if ((int)s->run[i]->prio == c && !is_decode(s->run[i])) ++*npf, *nlong += long_prompt(s, s->run[i]);
}

/* With the partial-prefill limits (max_num_partial_prefills N > 1), the
 * prompts of class c that may move in this step share what is left of the
 * budget (left tokens) evenly, as vLLM's V0 scheduler split it: at most N
 * of them, the running ones and the waiting ones the limits and the free
 * slots let start. Returns a prompt's chunk at most (INT_MAX: no limits). */
static int prefill_slice(const sched *s, int c, int left)
{
    if (s->cfg.max_num_partial_prefills <= 1) return INT_MAX;
    int npf, nlong, slots = s->cfg.max_num_seqs - s->n_run;
    running_prefills(s, c, &npf, &nlong);
    for (const sched_req *q = s->wait[c].head; q && slots > 0; q = q->next) {
        bool lg = long_prompt(s, q);
        int f = prefill_fits(s, lg, npf, nlong);
        if (f < 0) break;
        if (f == 0) continue;
        slots--, npf++, nlong += lg;
    }
    if (npf > s->cfg.max_num_partial_prefills) npf = s->cfg.max_num_partial_prefills;
    return npf > 1 && left > npf ? left / npf : left;
}

/* base with a ban on each bad word whose ids before its last end the output
 * so far (a one-token word: always), as vLLM's NoBadWordsLogitsProcessor. */
static const struct model_sampling *bad_words_sampling(sched_req *q, const struct model_sampling *base)
{
    int nb = base->n_logit_bias;
    if (nb) memcpy(q->bias_bad, base->logit_bias, (size_t)nb * sizeof *q->bias_bad);
    const int32_t *gen = q->tokens + q->n_prompt;
    for (int w = 0, o = 0; w < q->n_bad; o += q->bad_len[w], w++) {
        int L = q->bad_len[w];
        if (L - 1 > q->n_gen) continue;
        if (L > 1 && memcmp(gen + q->n_gen - (L - 1), q->bad + o, (size_t)(L - 1) * sizeof *gen)) continue;
        q->bias_bad[nb++] = (struct model_logit_bias){q->bad[o + L - 1], -1e9f};
    }
    q->sp_bad = *base;
    q->sp_bad.logit_bias = q->bias_bad;
    q->sp_bad.n_logit_bias = nb;
    return &q->sp_bad;
}

/* q's next len tokens into the step from n_computed on; with n_draft > 0
 * (a decode), the last n_draft of them are drafts, already written after
 * q's tokens. */
static void add_to_step(sched *s, sched_req *q, int len, int n_draft, int *T)
{
    int bs = s->cfg.block_size, t0 = *T;
    for (int k = 0; k < len; k++) {
        int p = q->n_computed + k;
        s->tok_ids[t0 + k] = q->tokens[p];
        s->pos[t0 + k] = p;
        s->slots[t0 + k] = kv_seq_slot(&q->kv, p, bs);
    }
    s->step_time = step_base(s);
    struct step_seq *ss = &s->seqs[s->n_step_seqs];
    memset(ss, 0, sizeof *ss);
    ss->query_start = t0;
    ss->query_len = len;
    ss->context_len = q->n_computed + len;
    ss->block_table = q->kv.blocks;
    ss->n_blocks = q->kv.n_blocks;
    ss->want_sample = n_draft > 0 || q->n_computed + len == q->n_tokens;
    ss->sampling = q->n_gen < q->min_tokens ? &q->sp_min : &q->sp;
    if (q->json && q->gate && ss->want_sample) {
        /* the reasoning before the guide starts: allowed_token_ids alone (NULL: any token) */
        q->sp.allow = q->sp_min.allow = q->allowed;
    } else if (q->json && ss->want_sample) {
        const uint8_t *m = sched_guide_mask_ref(&q->guide, s->gvocab, q->gstop, q->n_gstop, q->allow);
        if (q->allowed) { /* allowed_token_ids inside the grammar's mask */
            int nv = model_tok_n_vocab(s->tok);
            if (m != q->allow) memcpy(q->allow, m, (size_t)nv);
            for (int i = 0; i < nv; i++) q->allow[i] &= q->allowed[i];
            m = q->allow;
        }
        q->sp.allow = q->sp_min.allow = m;
    }
    if (q->n_bad && ss->want_sample) ss->sampling = bad_words_sampling(q, ss->sampling);
    if (q->plp && q->n_computed < q->n_prompt) {
        ss->prompt_out = q->plp;
        ss->prompt_top = q->plp_top;
    }
    if (q->kv.has_state) { /* recurrent layers: the slot, a prefix hit's snapshot, the step's snapshots */
        ss->state_slot = q->kv.state;
        ss->state_restore = q->kv.has_restore;
        ss->state_from = q->kv.restore;
        q->kv.has_restore = false;
        kv_seq_plan_snaps(s->pool, &q->kv, q->n_computed, q->n_computed + len, q->n_prompt);
        ss->n_snaps = q->kv.n_snaps;
        ss->snap_pos = q->kv.snap_pos;
        ss->snap_slot = q->kv.snap_slot;
    }
    ss->history = q->tokens;
    ss->n_prompt = q->n_prompt;
    ss->n_history = q->n_computed + len - n_draft;
    ss->rng = &q->rng;
    if (n_draft > 0) {
        ss->n_draft = n_draft;
        ss->spec_out = s->spec_out + (size_t)s->n_step_seqs * (s->cfg.spec.num_speculative_tokens + 1);
    }
    s->step_req[s->n_step_seqs++] = q;
    q->in_step = true;
    *T = t0 + len;
    double *x = s->shape.x;
    x[SCHED_COST_STEP] = 1.0;
    if (is_decode(q)) {
        s->step_time += decode_cost(s, q->n_computed);
        x[SCHED_COST_DECODE] += 1.0;
        x[SCHED_COST_DECODE_KEY] += q->n_computed + 1.0;
        s->stats.decode_tokens++;
        if (n_draft > 0) { /* the drafts cost as prefill tokens after the decode, each with its logits row */
            s->step_time += prefill_cost(s, q->n_computed + 1, n_draft, false) + n_draft * s->cost.coef[SCHED_COST_SAMPLE];
            x[SCHED_COST_PREFILL] += n_draft;
            x[SCHED_COST_PAIR] += (double)n_draft * (q->n_computed + 1) + (double)n_draft * (n_draft + 1) / 2.0;
            x[SCHED_COST_SAMPLE] += n_draft;
        }
    } else {
        s->step_time += prefill_cost(s, q->n_computed, len, ss->want_sample);
        x[SCHED_COST_PREFILL] += len;
        x[SCHED_COST_PAIR] += (double)len * q->n_computed + (double)len * (len + 1) / 2.0;
        s->stats.prompt_tokens_computed += (uint64_t)len;
    }
    if (ss->want_sample) x[SCHED_COST_SAMPLE] += 1.0;
    s->stats.class_tokens[q->prio] += (uint64_t)len;
    if (q->prio == SCHED_PRIO_BATCH) s->step_batch_tokens += len;
}

#define SPEC_PROBE 16

/* The cost rule, once a step: what a token of a plain decode step costs
 * now (the step's fixed part shared by the running decodes, plus a decode's
 * own), in seconds. Also counts the decodes the step will hold, whose
 * tokens the drafts leave in the budget. */
static double spec_token_s(sched *s)
{
    double t = s->cost.coef[SCHED_COST_STEP];
    int n = 0;
    for (int i = 0; i < s->n_run; i++)
        if (is_decode(s->run[i])) t += decode_cost(s, s->run[i]->n_computed), n++;
    s->spec_dec_left = n;
    if (s->cfg.spec.method == SCHED_SPEC_NONE || s->cfg.spec.always) return 0.0;
    return n > 0 ? t / n : t;
}

/* How many drafts q may carry in a step that holds T tokens: none when
 * speculation is off, when q's sampling changes from one position to the
 * next (a guide, bad_words, min_tokens not reached), or past max_tokens,
 * max_model_len and the budget; and by the cost rule, draft i + 1 only while
 * the chance that it is accepted (it and every draft before it, as measured)
 * times what a plain decode step's token costs exceeds what verifying it
 * costs: a token the draft saves is a token a later step need not produce. */
int sched_spec_room(const sched *s, const sched_req *q, int T)
{
    const struct sched_spec_config *c = &s->cfg.spec;
    if (c->method == SCHED_SPEC_NONE || (c->method != SCHED_SPEC_MTP && !s->drafter.propose) || q->json || q->n_bad ||
        q->n_gen < q->min_tokens)
        return 0;
    int k = c->num_speculative_tokens;
    int left[3] = {q->max_tokens - q->n_gen - 1, s->cfg.max_model_len - q->n_tokens - 1,
                   s->cfg.max_num_batched_tokens - T - 1 - s->spec_dec_left};
    for (int i = 0; i < 3; i++)
        if (k > left[i]) k = left[i];
    if (k <= 0) return 0;
    /* one step in SPEC_PROBE drafts regardless, so the cost model keeps
     * measuring what verification costs and the acceptance stays known */
    if (c->always || s->stats.steps % SPEC_PROBE == 0) return k;
    const double *co = s->cost.coef;
    for (int i = 0; i < k; i++) {
        double p = s->spec_acc[i] / s->spec_prop[i];
        double cost = co[SCHED_COST_PREFILL] + co[SCHED_COST_PAIR] * (q->n_computed + 2.0 + i) + co[SCHED_COST_SAMPLE];
        if (!(p * s->spec_tok_s > cost)) return i;
    }
    return k;
}

/* q's decode into the step: its last sampled token, and after it the drafts
 * q may carry (sched_spec_room) that its drafter proposes now (or made
 * after the last step, method mtp) and that the pool has blocks for without
 * preempting anyone. false when q itself had to be preempted for its one
 * token's block. */
static bool add_decode(sched *s, sched_req *q, int *T)
{
    if (s->spec_dec_left > 0) s->spec_dec_left--;
    if (!reserve_running(s, q, q->n_computed + 1)) return false;
    int k = sched_spec_room(s, q, *T);
    if (k > 0 && s->cfg.spec.method == SCHED_SPEC_MTP) {
        if (q->made_at != q->n_tokens) k = 0;
        if (k > q->n_made) k = q->n_made;
        memcpy(q->tokens + q->n_tokens, q->made, (size_t)k * sizeof *q->tokens);
    } else if (k > 0) {
        /* the drafts go after q's tokens (room: k < max_tokens - n_gen) */
        k = s->drafter.propose(s->drafter.arg, q->id, q->tokens, q->n_tokens, k, q->tokens + q->n_tokens);
        if (k < 0) k = 0;
    }
    while (k > 0 && kv_seq_reserve(s->pool, &q->kv, q->n_computed + 1 + k) != 0) k--; /* what its blocks hold */
    if (s->cfg.spec.method == SCHED_SPEC_MTP) {
        /* a backend may draft right after the step from the position it accepts there (up to n_computed + k;
         * cuda/mtp.c): blocks for the drafts past it too, from the free list only (no eviction), so that it
         * need not leave them to an extra pass after the step */
        struct kv_stats ks;
        kv_pool_stats(s->pool, &ks);
        int want = q->n_computed + 1 + k + s->cfg.spec.num_speculative_tokens, bs = kv_pool_block_size(s->pool);
        if (want > s->cfg.max_model_len) want = s->cfg.max_model_len;
        int more = (want + bs - 1) / bs - q->kv.n_blocks;
        if (more > 0 && more <= ks.blocks_free) (void)kv_seq_reserve(s->pool, &q->kv, want);
    }
    add_to_step(s, q, 1 + k, k, T);
    return true;
}

/* Tries to admit the head of a waiting queue with at most avail tokens (and
 * within cap). Returns the tokens planned, 0 when it could not be admitted
 * (out of blocks, or nothing fits the cap). */
static int admit(sched *s, sched_req *q, int avail, const struct step_cap *cap, int *T)
{
    if (q->kv.n_blocks == 0) {
        /* prompt_logprobs need every prompt position computed (vLLM skips the cache read too) */
        int cached = s->prefix_cache && !q->plp ? kv_seq_match_prefix(s->pool, &q->kv, q->tokens, q->n_tokens) : 0;
        q->n_computed = cached;
    }
    /* the chunk after the cached prefix must fit the cap */
    int len = capped_len(s, cap, q->n_computed, chunk_max(s, q, avail), *T);
    while (len <= 0 || kv_seq_reserve(s->pool, &q->kv, q->n_computed + len) != 0) {
        /* an interactive request may push batch work out; nothing else preempts to admit */
        sched_req *v = len > 0 && q->prio == SCHED_PRIO_INTERACTIVE ? pick_victim(s, SCHED_PRIO_BATCH) : NULL;
        if (!v) {
            kv_seq_release(s->pool, &q->kv);
            q->n_computed = 0;
            return 0;
        }
        preempt(s, v);
    }
    sched_wait_unlink(&s->wait[q->prio], q);
    q->admit_seq = ++s->admit_counter;
    if (!q->admitted_once) {
        q->admitted_once = true;
        q->cached_tokens = q->n_computed;
        q->t_admit = sched_now_s();
    }
    sched_run_insert(s, q);
    add_to_step(s, q, len, 0, T);
    return len;
}

/* Puts class c's running prefills into s->order in the order the step
 * serves them: interactive, fewest tokens left first (a chat that arrives
 * beside a long prompt is not held behind its prefill); batch, in admission
 * order. Returns how many. */
static int prefill_order(sched *s, int c)
{
    int n = 0;
    for (int i = 0; i < s->n_run; i++) {
        sched_req *q = s->run[i];
        if ((int)q->prio != c || q->in_step || is_decode(q)) continue;
        int j = n++;
        while (c == SCHED_PRIO_INTERACTIVE && j > 0 && prompt_left(s->order[j - 1]) > prompt_left(q)) {
            s->order[j] = s->order[j - 1];
            j--;
        }
        s->order[j] = q;
    }
    return n;
}

/* What the waiting interactive prompts that could start this step need (by
 * their tokens, within the slots and the partial-prefill limits), at most
 * max: the running interactive prefills leave them that much of the step. */
static int waiting_room(const sched *s, int max)
{
    int room = 0, slots = s->cfg.max_num_seqs - s->n_run, npf, nlong;
    running_prefills(s, SCHED_PRIO_INTERACTIVE, &npf, &nlong);
    for (const sched_req *q = s->wait[SCHED_PRIO_INTERACTIVE].head; q && slots > 0 && room < max; q = q->next) {
        bool lg = long_prompt(s, q);
        int f = prefill_fits(s, lg, npf, nlong);
        if (f < 0) break;
        if (f == 0) continue;
        room += prompt_left(q);
        slots--, npf++, nlong += lg;
    }
    return room < max ? room : max;
}

/* Frees sequence slots for interactive requests that would otherwise wait for
 * one while batch work holds them all: preempts one batch sequence (the
 * tail-most: most recently admitted) per waiting interactive request that this
 * step's budget can still start. Runs before anything is planned, so the
 * victims' slots and decode tokens go to interactive admissions in this same
 * step, and that the partial-prefill limits let start (a slot for one they
 * hold back would only be taken back by batch). Interactive is never
 * preempted here. share: the tokens min_batch_share
 * keeps for batch (batch waits once anything is preempted). Returns how many
 * sequences were preempted. */
static int make_room(sched *s, int budget, int share)
{
    const struct waitq *w = &s->wait[SCHED_PRIO_INTERACTIVE];
    int free_slots = s->cfg.max_num_seqs - s->n_run;
    if (w->n <= free_slots) return 0;
    /* what the step spends before interactive admissions: every decode and the
     * interactive partial prefills (an estimate: a prompt's cached prefix is
     * not known until it is admitted, so its whole length is counted) */
    int used = 0, batch_dec = 0;
    for (int i = 0; i < s->n_run; i++) {
        const sched_req *q = s->run[i];
        if (is_decode(q)) {
            used++;
            if (q->prio == SCHED_PRIO_BATCH) batch_dec++;
        } else if (q->prio == SCHED_PRIO_INTERACTIVE) {
            used += q->n_tokens - q->n_computed;
        }
    }
    int n = 0, npf, nlong;
    running_prefills(s, SCHED_PRIO_INTERACTIVE, &npf, &nlong);
    for (const sched_req *q = w->head; q; q = q->next) {
        /* one the partial-prefill limits hold back would not start: no slot for it */
        bool lg = long_prompt(s, q);
        int f = prefill_fits(s, lg, npf, nlong);
        if (f < 0) break;
        if (f == 0) continue;
        int u = used, bd = batch_dec;
        sched_req *v = NULL;
        if (free_slots == 0) {
            v = pick_victim(s, SCHED_PRIO_BATCH);
            if (!v) break;
            if (is_decode(v)) {
                u--;
                bd--;
            }
        }
        int keep = share > bd ? share - bd : 0;
        if (budget - u - keep <= 0) break; /* q would not start this step: keep the victim running */
        if (v) {
            preempt(s, v);
            n++;
        } else {
            free_slots--;
        }
        used = u + q->n_tokens;
        batch_dec = bd;
        npf++, nlong += lg;
    }
    return n;
}

/* The inter-token target now (seconds; INFINITY: none): as configured, or
 * itl_auto_factor times the predicted step of the interactive decodes alone
 * (one such decode when none runs: the room a chat's step will need). */
static double itl_target(const sched *s)
{
    if (!(s->cfg.itl_auto_factor > 0.0)) return s->cfg.itl_target_s > 0 ? s->cfg.itl_target_s : INFINITY;
    double t = s->cost.coef[SCHED_COST_STEP];
    int n = 0;
    for (int i = 0; i < s->n_run; i++)
        if (s->run[i]->prio == SCHED_PRIO_INTERACTIVE && is_decode(s->run[i]))
            t += decode_cost(s, s->run[i]->n_computed), n++;
    if (n == 0) t += decode_cost(s, 0);
    return s->cfg.itl_auto_factor * t;
}

/* The step's time limit (seconds; INFINITY: none) from the latency targets,
 * and whether batch decodes wait until the interactive prefills are in. */
static double time_limit(sched *s, bool *defer)
{
    bool chat = s->wait[SCHED_PRIO_INTERACTIVE].n > 0, chat_dec = false;
    for (int i = 0; i < s->n_run; i++)
        if (s->run[i]->prio == SCHED_PRIO_INTERACTIVE) {
            chat = true;
            chat_dec |= is_decode(s->run[i]);
        }
    s->seen_interactive |= chat;
    double itl = s->itl_now = itl_target(s), ttft = s->cfg.ttft_target_s;
    /* a chat that arrives during a step waits for it, then needs a step of its own */
    bool expect = s->cfg.expect_interactive || s->seen_interactive;
    double room = ttft > 0 && expect ? (isfinite(itl) && ttft > itl ? ttft - itl : ttft) : INFINITY;
    *defer = chat && isfinite(itl);
    return chat_dec && itl < room ? itl : room;
}

/* Batch decodes under a time limit: in turn, starting with the one that sat
 * out first last time, each while the step stays within limit (or while
 * batch has less than keep of it, or when the step is empty); the others
 * sit this step out and keep their KV. Returns the batch decodes planned. */
static int batch_decodes(sched *s, double limit, double floor, int *T)
{
    int n = 0, k = 0, start = 0, budget = s->cfg.max_num_batched_tokens;
    for (int i = 0; i < s->n_run; i++)
        if (s->run[i]->prio == SCHED_PRIO_BATCH && is_decode(s->run[i]) && !s->run[i]->in_step) s->order[n++] = s->run[i];
    while (start < n && s->order[start]->admit_seq < s->dec_next) start++;
    if (start == n) start = 0;
    uint64_t next = 0;
    for (int j = 0; j < n; j++) {
        sched_req *q = s->order[(start + j) % n];
        if (!q->running || q->in_step || !is_decode(q)) continue; /* preempted for an earlier one's blocks */
        double t = step_base(s) + decode_cost(s, q->n_computed);
        if (*T >= budget || (t > limit && t > floor && *T > 0)) {
            if (!next) next = q->admit_seq;
            s->stats.decodes_sat_out++;
            continue;
        }
        if (!add_decode(s, q, T)) continue;
        k++;
    }
    s->dec_next = next;
    return k;
}

/* The drafts made after the last step (method mtp): each sequence still
 * running keeps what its drafter made. */
static void take_made(sched *s)
{
    for (int w = 0; w < s->n_wants; w++) {
        const struct sched_draft_want *x = &s->wants[w];
        for (int i = 0; i < s->n_run; i++)
            if (s->run[i]->id == x->id) {
                s->run[i]->n_made = x->n_made < 0 ? 0 : x->n_made > x->k ? x->k : x->n_made;
                break;
            }
    }
    s->n_wants = 0;
}

int sched_plan_step(sched *s, struct step *st)
{
    const int budget = s->cfg.max_num_batched_tokens;
    int T = 0;
    take_made(s);
    s->n_step_seqs = 0;
    s->step_time = 0.0;
    s->step_batch_tokens = 0;
    memset(&s->shape, 0, sizeof s->shape);
    for (int i = 0; i < s->n_run; i++) s->run[i]->in_step = false;
    if (s->gvocab) sched_guide_vocab_epoch(s->gvocab); /* the last step's JSON masks are free again */

    /* 0. slots for waiting interactive requests; the victims wait at the front
     * of the batch queue and are not readmitted in this step (that would only
     * take the slot back) */
    int bumped = make_room(s, budget, (int)ceilf(s->cfg.min_batch_share * (float)budget));
    s->spec_tok_s = spec_token_s(s);

    bool defer;
    double limit = time_limit(s, &defer);
    /* batch work waiting (queued or mid-prefill, or decodes the limit may
     * leave out) keeps a share of the budget, and of the time */
    bool batch_waits = s->wait[SCHED_PRIO_BATCH].n > 0;
    for (int i = 0; i < s->n_run && !batch_waits; i++)
        batch_waits = s->run[i]->prio == SCHED_PRIO_BATCH && (!is_decode(s->run[i]) || defer);
    int reserve = batch_waits ? (int)ceilf(s->cfg.min_batch_share * (float)budget) : 0;
    double keep_s = batch_waits && isfinite(limit) ? s->cfg.min_batch_share * limit : 0.0;
    int batch_used = 0;        /* batch tokens in the step before interactive prefill */
    bool first_token = false;  /* the step ends a chat's prompt */

    /* 1. decodes: every class, or only interactive ones while batch decodes wait their turn */
    for (int i = 0; i < s->n_run && T < budget; i++) {
        sched_req *q = s->run[i];
        if (!is_decode(q) || (defer && q->prio == SCHED_PRIO_BATCH)) continue;
        if (!add_decode(s, q, &T)) {
            i--; /* q left the array; the next one moved into slot i */
            continue;
        }
        if (q->prio == SCHED_PRIO_BATCH) batch_used++;
    }

    /* 2./3. per class: partial prefills, then admissions */
    for (int c = 0; c < SCHED_N_PRIO; c++) {
        int keep = c == SCHED_PRIO_INTERACTIVE && reserve > batch_used ? reserve - batch_used : 0;
        /* prefill is never cut below what the step holds before it (where
         * the target cannot be met anyway, beside a chat's decode the batch
         * still gets half the step: the chat's tokens come at most twice as
         * far apart as they would alone), except in a step that holds a
         * chat's first token */
        struct step_cap cap = {.on = isfinite(limit), .limit = limit, .one = true, .granule = s->cfg.step_granule,
                               .efficient = true};
        if (c == SCHED_PRIO_INTERACTIVE) {
            cap.limit -= keep_s;
            cap_floor(s, &cap);
        } else {
            /* a chat's first token comes with this step: batch fills no more
             * than the inter-token target (or the chat's own prompt) */
            if (first_token && isfinite(s->itl_now)) {
                double t = s->step_time > s->itl_now ? s->step_time : s->itl_now;
                if (t < cap.limit) cap.limit = t, cap.on = true;
                cap.efficient = false;
            }
            double floor = s->step_time + keep_s; /* batch's share */
            if (cap.on && floor > cap.limit) cap.limit = floor;
            cap_floor(s, &cap);
            if (defer) batch_used += batch_decodes(s, cap.limit, floor, &T);
            cap.one = T == 0 || (reserve > 0 && batch_used == 0);
        }
        /* running prefills first, leaving room for interactive prompts that
         * wait (up to half the budget, and half the time) */
        int room = c == SCHED_PRIO_INTERACTIVE ? waiting_room(s, budget / 2) : 0;
        struct step_cap rcap = cap;
        if (room > 0 && cap.on) {
            double rt = prefill_cost(s, 0, room, true), half = (cap.limit - step_base(s)) / 2.0;
            rcap.limit -= rt < half ? rt : half;
        }
        int npf = 0, nlong = 0; /* this class's prompts in the step, and the long ones among them */
        const int slice = prefill_slice(s, c, budget - T - keep);
        for (int i = 0, n = prefill_order(s, c); i < n; i++) {
            sched_req *q = s->order[i];
            int avail = budget - T - keep - room;
            if (avail > slice) avail = slice;
            if (avail <= 0) break;
            if (!q->running) continue; /* preempted for an earlier one's blocks */
            bool lg = long_prompt(s, q);
            if (prefill_fits(s, lg, npf, nlong) <= 0) continue;
            int len = capped_len(s, &rcap, q->n_computed, chunk_max(s, q, avail), T);
            if (len <= 0) break;
            if (!reserve_running(s, q, q->n_computed + len)) continue;
            first_token |= c == SCHED_PRIO_INTERACTIVE && len == prompt_left(q);
            add_to_step(s, q, len, 0, &T);
            cap.one = rcap.one = false;
            npf++, nlong += lg;
        }
        /* admissions in queue order; a long prompt the limits hold back
         * keeps its place, and the shorter ones behind it may start */
        for (sched_req *q = s->wait[c].head, *next; q && s->n_run < s->cfg.max_num_seqs &&
                                                     !(c == SCHED_PRIO_BATCH && bumped);
             q = next) {
            int avail = budget - T - keep;
            if (avail <= 0) break;
            if (avail > slice) avail = slice;
            next = q->next;
            bool lg = long_prompt(s, q);
            int f = prefill_fits(s, lg, npf, nlong);
            if (f < 0) break;
            if (f == 0) continue; /* only the long limit holds */
            int len = admit(s, q, avail, &cap, &T);
            if (len == 0) break;
            first_token |= c == SCHED_PRIO_INTERACTIVE && len == prompt_left(q);
            cap.one = false;
            npf++, nlong += lg;
        }
    }

    st->n_tokens = T;
    st->token_ids = s->tok_ids;
    st->positions = s->pos;
    st->slots = s->slots;
    st->n_seqs = s->n_step_seqs;
    st->seqs = s->seqs;
    s->plan_limit = isfinite(limit) ? limit : 0.0;
    if (T > 0) s->stats.steps++;
    return T;
}

void sched_step_timed(sched *s, double seconds)
{
    if (s->shape.x[SCHED_COST_STEP] <= 0.0 || !(seconds > 0.0)) return;
    struct sched_stats *t = &s->stats;
    sched_hist_add(&t->step_planned, s->step_time);
    sched_hist_add(&t->step_measured, seconds);
    t->last_planned_s = s->step_time;
    t->last_measured_s = seconds;
    t->last_limit_s = s->plan_limit;
    sched_cost_observe(&s->cost, &s->shape, seconds);
    memcpy(t->cost, s->cost.coef, sizeof t->cost);
    /* batch tokens a second, the older steps fading over ~10 s */
    double w = exp(-seconds / 10.0);
    s->rate_tok = s->rate_tok * w + s->step_batch_tokens;
    s->rate_s = s->rate_s * w + seconds;
    t->batch_tok_s = s->rate_s > 0 ? s->rate_tok / s->rate_s : 0.0;
    s->shape.x[SCHED_COST_STEP] = 0.0; /* timed once */
}

struct sched_cost *sched_cost_model(sched *s) { return &s->cost; }

double sched_step_plan(const sched *s, struct sched_step_shape *x)
{
    if (x) *x = s->shape;
    return s->step_time;
}


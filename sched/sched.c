/* sched.c - the scheduler's request lifecycle: construction, requests,
 * the waiting queues and the running array, abort, queries and teardown.
 * Planning a step is sched_plan.c; processing its output, sched_output.c.
 *
 * Running sequences live in one array kept sorted by (priority class,
 * admission order), so the tail is always the lowest-priority, most recently
 * admitted sequence: the preemption victim. Waiting requests live in one FIFO
 * list per class. Everything here runs on the engine thread, except
 * sched_req_create, which reads only the immutable configuration.
 */
#include <limits.h>
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

#include "sched_internal.h"

const char *sched_finish_name(enum sched_finish f)
{
    switch (f) {
    case SCHED_FINISH_STOP: return "stop";
    case SCHED_FINISH_LENGTH: return "length";
    case SCHED_FINISH_ABORT: return "abort";
    case SCHED_FINISH_ERROR: return "error";
    default: return "none";
    }
}

/* ---- construction ---------------------------------------------------------------- */

void sched_config_policy_defaults(struct sched_config *c)
{
    c->min_batch_share = 0.1f;
    c->ttft_target_s = SCHED_DEFAULT_TTFT_TARGET_S;
    c->itl_target_s = 0.0;
    c->itl_auto_factor = SCHED_DEFAULT_ITL_AUTO_FACTOR;
    c->long_prefill_token_threshold = 0;
    c->max_num_partial_prefills = 1;
    c->max_long_partial_prefills = 1;
}

sched *sched_create(const struct sched_config *cfg, kv_pool *pool, const model_tok *tok, char *err,
                    size_t errlen)
{
    if (!cfg || !pool) {
        snprintf(err, errlen, "sched_create: no configuration or pool");
        return NULL;
    }
    if (cfg->max_num_seqs < 1 || cfg->max_num_batched_tokens < cfg->max_num_seqs || cfg->max_model_len < 1 ||
        cfg->block_size != kv_pool_block_size(pool) || !(cfg->min_batch_share >= 0.0f && cfg->min_batch_share <= 1.0f) ||
        !(cfg->itl_target_s >= 0.0) || !(cfg->itl_auto_factor >= 0.0) || !(cfg->ttft_target_s >= 0.0) || cfg->step_granule < 0 ||
        !(cfg->prior_token_s >= 0.0) || !(cfg->prior_pair_ratio >= 0.0) ||
        cfg->long_prefill_token_threshold < 0 || cfg->max_num_partial_prefills < 0 ||
        (cfg->max_num_partial_prefills > 1 &&
         (cfg->max_long_partial_prefills < 1 || cfg->max_long_partial_prefills > cfg->max_num_partial_prefills))) {
        snprintf(err, errlen,
                 "bad scheduler limits: max_num_seqs %d (>= 1), max_num_batched_tokens %d (>= max_num_seqs), "
                 "max_model_len %d (>= 1), block_size %d (the pool's is %d), min_batch_share %g (0..1), "
                 "itl_target_s %g and ttft_target_s %g (>= 0), step_granule %d (>= 0), prior_token_s %g and "
                 "prior_pair_ratio %g (>= 0), long_prefill_token_threshold %d (>= 0), max_num_partial_prefills %d "
                 "(>= 0), max_long_partial_prefills %d (1..max_num_partial_prefills)",
                 cfg->max_num_seqs, cfg->max_num_batched_tokens, cfg->max_model_len, cfg->block_size,
                 kv_pool_block_size(pool), (double)cfg->min_batch_share, cfg->itl_target_s, cfg->ttft_target_s,
                 cfg->step_granule, cfg->prior_token_s, cfg->prior_pair_ratio, cfg->long_prefill_token_threshold,
                 cfg->max_num_partial_prefills, cfg->max_long_partial_prefills);
        return NULL;
    }
    const struct sched_spec_config *sc = &cfg->spec;
    if (sc->method != SCHED_SPEC_NONE &&
        (sc->num_speculative_tokens < 1 || sc->num_speculative_tokens > SCHED_MAX_SPEC_TOKENS ||
         (sc->method == SCHED_SPEC_NGRAM &&
          (sc->prompt_lookup_min < 1 || sc->prompt_lookup_max < sc->prompt_lookup_min)))) {
        snprintf(err, errlen,
                 "bad speculative decoding configuration: num_speculative_tokens %d (1..%d), prompt_lookup_min %d "
                 "(>= 1) and prompt_lookup_max %d (>= prompt_lookup_min)",
                 sc->num_speculative_tokens, SCHED_MAX_SPEC_TOKENS, sc->prompt_lookup_min, sc->prompt_lookup_max);
        return NULL;
    }
    sched *s = calloc(1, sizeof *s);
    if (!s) goto fail_oom;
    s->cfg = *cfg;
    s->pool = pool;
    s->tok = tok;
    s->pool_blocks = kv_pool_n_blocks(pool);
    s->prefix_cache = kv_pool_prefix_cache(pool);
    /* no prior given (tests): a millisecond a token */
    sched_cost_init(&s->cost, cfg->prior_token_s > 0 ? cfg->prior_token_s : 1e-3, cfg->prior_pair_ratio);
    memcpy(s->stats.cost, s->cost.coef, sizeof s->stats.cost);
    if (tok) s->n_model_stop = model_tok_stop_ids(tok, &s->model_stop);
    if (tok) s->gvocab = sched_guide_vocab_create(tok); /* NULL (out of memory): JSON mode is refused */
    size_t T = (size_t)cfg->max_num_batched_tokens, S = (size_t)cfg->max_num_seqs;
    s->run = calloc(S, sizeof *s->run);
    s->tok_ids = malloc(T * sizeof *s->tok_ids);
    s->pos = malloc(T * sizeof *s->pos);
    s->slots = malloc(T * sizeof *s->slots);
    s->seqs = calloc(S, sizeof *s->seqs);
    s->step_req = calloc(S, sizeof *s->step_req);
    s->order = calloc(S, sizeof *s->order);
    s->text_cap = 4096;
    s->text = malloc(s->text_cap);
    if (!s->run || !s->tok_ids || !s->pos || !s->slots || !s->seqs || !s->step_req || !s->order || !s->text)
        goto fail_scratch;
    if (sc->method != SCHED_SPEC_NONE &&
        (!(s->spec_out = calloc(S * (size_t)(sc->num_speculative_tokens + 1), sizeof *s->spec_out)) ||
         !(s->wants = calloc(S, sizeof *s->wants))))
        goto fail_scratch;
    sched_spec_init(s);
    return s;

fail_scratch:
    sched_destroy(s);
fail_oom:
    snprintf(err, errlen, "out of memory creating the scheduler");
    return NULL;
}

/* ---- requests ------------------------------------------------------------------- */

void sched_req_release(kv_pool *pool, sched_req *q)
{
    if (!q) return;
    if (pool) kv_seq_deinit(pool, &q->kv);
    free(q->tokens);
    for (int i = 0; i < q->n_stop; i++) free(q->stop[i]);
    free(q->stop);
    free(q->stop_len);
    free(q->stop_ids);
    free(q->bias);
    free(q->bias_min);
    free(q->allow);
    free(q->gstop);
    free(q->gate);
    free(q->gate_win);
    free(q->allowed);
    free(q->bad);
    free(q->bad_len);
    free(q->bias_bad);
    free(q->plp);
    sched_schema_free(q->schema);
    free(q->hold);
    free(q);
}

void sched_req_free(sched_req *q)
{
    if (q) SL_ASSERT(q->kv.n_blocks == 0);
    sched_req_release(NULL, q);
}

uint64_t sched_req_id(const sched_req *q) { return q->id; }

sched_req *sched_req_create(const sched *s, const struct sched_request *r, uint64_t id, char *err,
                            size_t errlen)
{
    const struct sched_config *c = &s->cfg;
    if (!r || !r->prompt || r->n_prompt < 1) {
        snprintf(err, errlen, "the prompt is empty");
        return NULL;
    }
    if (r->max_tokens < 1) {
        snprintf(err, errlen, "max_tokens must be at least 1, got %d", r->max_tokens);
        return NULL;
    }
    if ((long)r->n_prompt + r->max_tokens > c->max_model_len) {
        snprintf(err, errlen,
                 "This model's maximum context length is %d tokens. However, you requested %ld tokens "
                 "(%d in the prompt, %d in the completion). Please reduce the length of the prompt or completion.",
                 c->max_model_len, (long)r->n_prompt + r->max_tokens, r->n_prompt, r->max_tokens);
        return NULL;
    }
    long need_blocks = ((long)r->n_prompt + r->max_tokens + c->block_size - 1) / c->block_size;
    if (need_blocks > s->pool_blocks) {
        snprintf(err, errlen,
                 "the request needs %ld KV blocks (%d prompt + %d completion tokens) but the whole KV cache "
                 "holds %d blocks of %d tokens",
                 need_blocks, r->n_prompt, r->max_tokens, s->pool_blocks, c->block_size);
        return NULL;
    }
    if ((unsigned)r->priority >= SCHED_N_PRIO) {
        snprintf(err, errlen, "bad priority class %d", (int)r->priority);
        return NULL;
    }
    const struct model_sampling *sp = &r->sampling;
    if (!(sp->temperature >= 0.0f) || !(sp->top_p > 0.0f && sp->top_p <= 1.0f) ||
        !(sp->min_p >= 0.0f && sp->min_p <= 1.0f) || !(sp->repetition_penalty > 0.0f) ||
        !isfinite(sp->presence_penalty) || !isfinite(sp->frequency_penalty) || sp->top_logprobs < 0 ||
        sp->top_logprobs > MODEL_MAX_TOP_LOGPROBS || !isfinite(sp->temperature)) {
        snprintf(err, errlen, "sampling parameters out of range");
        return NULL;
    }
    int n_vocab = s->tok ? model_tok_n_vocab(s->tok) : 0;
    for (int i = 0; n_vocab > 0 && i < r->n_prompt; i++)
        if (r->prompt[i] < 0 || r->prompt[i] >= n_vocab) {
            snprintf(err, errlen, "prompt token %d: id %d is not in the vocabulary (0..%d)", i, r->prompt[i],
                     n_vocab - 1);
            return NULL;
        }
    if (sp->n_logit_bias < 0 || sp->n_logit_bias > MODEL_MAX_LOGIT_BIAS || (sp->n_logit_bias && !sp->logit_bias)) {
        snprintf(err, errlen, "logit_bias has more than %d entries", MODEL_MAX_LOGIT_BIAS);
        return NULL;
    }
    for (int i = 0; i < sp->n_logit_bias; i++)
        if (sp->logit_bias[i].id < 0 || (n_vocab > 0 && sp->logit_bias[i].id >= n_vocab) ||
            !isfinite(sp->logit_bias[i].bias)) {
            snprintf(err, errlen, "logit_bias: token id %d is not in the vocabulary (0..%d)", sp->logit_bias[i].id,
                     n_vocab - 1);
            return NULL;
        }
    for (int i = 0; i < r->n_stop; i++)
        if (!r->stop[i] || !r->stop[i][0] || strlen(r->stop[i]) > SCHED_MAX_STOP_LEN) {
            snprintf(err, errlen, "stop strings must be 1 to %d bytes long", SCHED_MAX_STOP_LEN);
            return NULL;
        }

    sched_req *q = calloc(1, sizeof *q);
    if (!q) goto fail_oom;
    q->id = id;
    q->user = r->user;
    q->prio = r->priority;
    q->n_prompt = r->n_prompt;
    q->max_tokens = r->max_tokens;
    q->cap = r->n_prompt + r->max_tokens;
    q->tokens = malloc((size_t)q->cap * sizeof *q->tokens);
    if (!q->tokens) goto fail_req;
    memcpy(q->tokens, r->prompt, (size_t)r->n_prompt * sizeof *q->tokens);
    q->n_tokens = r->n_prompt;
    q->sp = r->sampling;
    q->sp.logit_bias = NULL;
    if (sp->n_logit_bias > 0) {
        q->bias = malloc((size_t)sp->n_logit_bias * sizeof *q->bias);
        if (!q->bias) goto fail_req;
        memcpy(q->bias, sp->logit_bias, (size_t)sp->n_logit_bias * sizeof *q->bias);
        q->sp.logit_bias = q->bias;
    }
    if (r->min_tokens < 0 || r->min_tokens > r->max_tokens) {
        snprintf(err, errlen, "min_tokens must be from 0 to max_tokens (%d), got %d", r->max_tokens, r->min_tokens);
        goto fail_einval;
    }
    q->min_tokens = r->min_tokens;
    if (q->min_tokens > 0) {
        int nb = sp->n_logit_bias, nm = r->ignore_eos ? 0 : s->n_model_stop;
        q->bias_min = malloc((size_t)(nb + nm + r->n_stop_token_ids + 1) * sizeof *q->bias_min);
        if (!q->bias_min) goto fail_req;
        if (nb) memcpy(q->bias_min, sp->logit_bias, (size_t)nb * sizeof *q->bias_min);
        /* -1e9, not -inf: every sampler keeps finite biases; exp() of it is 0 */
        for (int i = 0; i < nm; i++) q->bias_min[nb++] = (struct model_logit_bias){s->model_stop[i], -1e9f};
        for (int i = 0; i < r->n_stop_token_ids; i++)
            q->bias_min[nb++] = (struct model_logit_bias){r->stop_token_ids[i], -1e9f};
        q->sp_min = q->sp;
        q->sp_min.logit_bias = q->bias_min;
        q->sp_min.n_logit_bias = nb;
    }
    if (r->json_object || r->schema) {
        if (!s->tok || n_vocab <= 0 || !s->gvocab) {
            snprintf(err, errlen, "JSON mode needs the model's tokenizer (and the memory to index it)");
            goto fail_einval;
        }
        q->json = true;
        if (r->schema) {
            q->schema = sched_schema_copy(r->schema);
            if (!q->schema) goto fail_req;
            sched_guide_init_schema(&q->guide, q->schema);
        } else {
            sched_guide_init(&q->guide);
        }
        q->allow = malloc((size_t)n_vocab);
        q->gstop = malloc((size_t)(s->n_model_stop + r->n_stop_token_ids + 1) * sizeof *q->gstop);
        if (!q->allow || !q->gstop) goto fail_req;
        for (int i = 0; i < s->n_model_stop; i++) q->gstop[q->n_gstop++] = s->model_stop[i];
        for (int i = 0; i < r->n_stop_token_ids; i++) q->gstop[q->n_gstop++] = r->stop_token_ids[i];
        q->sp.allow = q->sp_min.allow = q->allow;
        q->sp.n_allow = q->sp_min.n_allow = n_vocab;
        if (r->guide_after && r->guide_after[0]) {
            q->gate_len = strlen(r->guide_after);
            if (q->gate_len > SCHED_MAX_STOP_LEN) {
                snprintf(err, errlen, "guide_after is longer than %d bytes", SCHED_MAX_STOP_LEN);
                goto fail_einval;
            }
            q->gate = strdup(r->guide_after);
            q->gate_win = malloc(q->gate_len);
            if (!q->gate || !q->gate_win) goto fail_req;
            q->sp.allow = q->sp_min.allow = NULL; /* free text until the gate */
        }
    }
    q->rng = model_rng_seed(r->sampling.seed);
    q->ignore_eos = r->ignore_eos;
    q->logprobs = r->logprobs || r->sampling.top_logprobs > 0;
    if (r->n_stop > 0) {
        q->stop = calloc((size_t)r->n_stop, sizeof *q->stop);
        q->stop_len = calloc((size_t)r->n_stop, sizeof *q->stop_len);
        if (!q->stop || !q->stop_len) goto fail_req;
        for (int i = 0; i < r->n_stop; i++) {
            q->stop[i] = strdup(r->stop[i]);
            if (!q->stop[i]) goto fail_req;
            q->n_stop = i + 1;
            q->stop_len[i] = strlen(q->stop[i]);
            if (q->stop_len[i] > q->max_stop) q->max_stop = q->stop_len[i];
        }
        q->hold_cap = q->max_stop + 2 * PIECE_CAP;
        q->hold = malloc(q->hold_cap);
        if (!q->hold) goto fail_req;
    }
    if (r->n_stop_token_ids > 0) {
        q->stop_ids = malloc((size_t)r->n_stop_token_ids * sizeof *q->stop_ids);
        if (!q->stop_ids) goto fail_req;
        memcpy(q->stop_ids, r->stop_token_ids, (size_t)r->n_stop_token_ids * sizeof *q->stop_ids);
        q->n_stop_ids = r->n_stop_token_ids;
    }
    if (r->n_allowed_ids > 0) {
        if (n_vocab <= 0) {
            snprintf(err, errlen, "allowed_token_ids needs the model's tokenizer");
            goto fail_einval;
        }
        q->allowed = calloc((size_t)n_vocab, 1);
        if (!q->allowed) goto fail_req;
        for (int i = 0; i < r->n_allowed_ids; i++) {
            if (r->allowed_ids[i] < 0 || r->allowed_ids[i] >= n_vocab) {
                snprintf(err, errlen, "allowed_token_ids: token id %d is not in the vocabulary (0..%d)",
                         r->allowed_ids[i], n_vocab - 1);
                goto fail_einval;
            }
            q->allowed[r->allowed_ids[i]] = 1;
        }
        if (!q->json) {
            q->sp.allow = q->sp_min.allow = q->allowed;
            q->sp.n_allow = q->sp_min.n_allow = n_vocab;
        }
    }
    if (r->n_bad_words > 0) {
        long tot = 0;
        for (int w = 0; w < r->n_bad_words; w++) tot += r->bad_word_lens[w] > 0 ? r->bad_word_lens[w] : 0;
        q->bad = malloc((size_t)(tot ? tot : 1) * sizeof *q->bad);
        q->bad_len = malloc((size_t)r->n_bad_words * sizeof *q->bad_len);
        int nb = (q->sp_min.n_logit_bias > sp->n_logit_bias ? q->sp_min.n_logit_bias : sp->n_logit_bias);
        q->bias_bad = malloc((size_t)(nb + r->n_bad_words + 1) * sizeof *q->bias_bad);
        if (!q->bad || !q->bad_len || !q->bias_bad) goto fail_req;
        long o = 0;
        for (int w = 0; w < r->n_bad_words; w++) {
            int L = r->bad_word_lens[w];
            if (L < 1) continue;
            for (int k = 0; k < L; k++)
                if (r->bad_words[o + k] < 0 || (n_vocab > 0 && r->bad_words[o + k] >= n_vocab)) {
                    snprintf(err, errlen, "bad_words: token id %d is not in the vocabulary", r->bad_words[o + k]);
                    goto fail_einval;
                }
            memcpy(q->bad + o, r->bad_words + o, (size_t)L * sizeof *q->bad);
            q->bad_len[q->n_bad++] = L;
            o += L;
        }
    }
    if (r->prompt_logprobs) {
        if (r->prompt_top_logprobs < 0 || r->prompt_top_logprobs > MODEL_MAX_TOP_LOGPROBS) {
            snprintf(err, errlen, "prompt_logprobs must be from 0 to %d", MODEL_MAX_TOP_LOGPROBS);
            goto fail_einval;
        }
        q->plp = calloc((size_t)r->n_prompt, sizeof *q->plp);
        if (!q->plp) goto fail_req;
        q->plp_top = r->prompt_top_logprobs;
        for (int i = 0; i < r->n_prompt; i++) q->plp[i].token = r->prompt[i];
        q->plp[0].logprob = NAN;
    }
    q->include_stop_str = r->include_stop_str;
    kv_seq_init(&q->kv, r->cache_salt);
    if (s->tok) model_detok_init(&q->detok, s->tok, !r->keep_special_tokens);
    q->t_submit = sched_now_s();
    q->t_first = -1;
    return q;

fail_req:
    sched_req_release(NULL, q);
fail_oom:
    snprintf(err, errlen, "out of memory queueing the request");
    return NULL;
fail_einval:
    sched_req_release(NULL, q);
    return NULL;
}

/* ---- queues ------------------------------------------------------------------- */

static void wait_push_back(struct waitq *w, sched_req *q)
{
    q->next = NULL;
    q->prev = w->tail;
    if (w->tail) w->tail->next = q;
    else w->head = q;
    w->tail = q;
    w->n++;
}

void sched_wait_push_front(struct waitq *w, sched_req *q)
{
    q->prev = NULL;
    q->next = w->head;
    if (w->head) w->head->prev = q;
    else w->tail = q;
    w->head = q;
    w->n++;
}

void sched_wait_unlink(struct waitq *w, sched_req *q)
{
    if (q->prev) q->prev->next = q->next;
    else w->head = q->next;
    if (q->next) q->next->prev = q->prev;
    else w->tail = q->prev;
    q->prev = q->next = NULL;
    w->n--;
}

void sched_add(sched *s, sched_req *q)
{
    wait_push_back(&s->wait[q->prio], q);
}

/* Inserts q at the end of its priority class in the running array. */
void sched_run_insert(sched *s, sched_req *q)
{
    SL_ASSERT(s->n_run < s->cfg.max_num_seqs);
    int i = s->n_run;
    while (i > 0 && s->run[i - 1]->prio > q->prio) i--;
    memmove(s->run + i + 1, s->run + i, (size_t)(s->n_run - i) * sizeof *s->run);
    s->run[i] = q;
    s->n_run++;
    q->running = true;
}

void sched_run_remove_at(sched *s, int i)
{
    s->run[i]->running = false;
    memmove(s->run + i, s->run + i + 1, (size_t)(s->n_run - i - 1) * sizeof *s->run);
    s->n_run--;
}

int sched_run_index(const sched *s, const sched_req *q)
{
    for (int i = s->n_run - 1; i >= 0; i--)
        if (s->run[i] == q) return i;
    return -1;
}

/* Frees q's blocks and sends it back to the front of its class: it is
 * recomputed from scratch later (its prefix usually stays cached). */
int sched_abort(sched *s, uint64_t id, sched_emit_fn emit, void *arg)
{
    for (int i = 0; i < s->n_run; i++)
        if (s->run[i]->id == id) {
            sched_req *q = s->run[i];
            SL_ASSERT(!q->in_step);
            sched_finish_req(s, q, SCHED_FINISH_ABORT, NULL, 0, NULL, emit, arg);
            sched_run_remove_at(s, i);
            sched_req_release(s->pool, q);
            return 0;
        }
    for (int c = 0; c < SCHED_N_PRIO; c++)
        for (sched_req *q = s->wait[c].head; q; q = q->next)
            if (q->id == id) {
                sched_wait_unlink(&s->wait[c], q);
                sched_finish_req(s, q, SCHED_FINISH_ABORT, NULL, 0, NULL, emit, arg);
                sched_req_release(s->pool, q);
                return 0;
            }
    return SL_EINVAL;
}

/* ---- queries --------------------------------------------------------------------- */

bool sched_has_work(const sched *s)
{
    return s->n_run > 0 || s->wait[0].n > 0 || s->wait[1].n > 0;
}

void sched_get_stats(const sched *s, struct sched_stats *st)
{
    *st = s->stats;
    st->n_running = s->n_run;
    st->n_waiting = s->wait[0].n + s->wait[1].n;
}

uint64_t sched_step_req_id(const sched *s, int i)
{
    SL_ASSERT(i >= 0 && i < s->n_step_seqs);
    return s->step_req[i]->id;
}

/* ---- teardown --------------------------------------------------------------------- */

void sched_destroy(sched *s)
{
    if (!s) return;
    sched_guide_vocab_destroy(s->gvocab);
    if (s->run)
        for (int i = 0; i < s->n_run; i++) sched_req_release(s->pool, s->run[i]);
    for (int c = 0; c < SCHED_N_PRIO; c++) {
        sched_req *q = s->wait[c].head;
        while (q) {
            sched_req *n = q->next;
            sched_req_release(s->pool, q);
            q = n;
        }
    }
    free(s->run);
    free(s->tok_ids);
    free(s->pos);
    free(s->slots);
    free(s->seqs);
    free(s->step_req);
    free(s->order);
    free(s->text);
    free(s->spec_out);
    free(s->wants);
    free(s);
}

/* sched.c - the scheduler: request lifecycle, step planning, preemption and
 * the post-step bookkeeping (append, commit, detokenize, stop checks).
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

#include "sched.h"

#define PIECE_CAP 512 /* bytes one token can release (a token decodes to well under 256) */

struct sched_req {
    uint64_t id;
    void *user;
    enum sched_priority prio;
    int32_t *tokens;         /* [cap] prompt then generated ids, owned */
    int n_tokens, cap;       /* cap = n_prompt + max_tokens */
    int n_prompt, max_tokens, n_gen;
    int n_computed;          /* leading tokens whose K/V is in the pool */
    bool running, in_step, finished, admitted_once;
    uint64_t admit_seq;
    struct kv_seq kv;
    struct model_sampling sp;
    uint64_t rng;
    bool ignore_eos, logprobs;
    char **stop;             /* [n_stop] owned NUL-terminated copies */
    size_t *stop_len;
    int n_stop;
    size_t max_stop;
    int32_t *stop_ids;       /* [n_stop_ids] owned */
    struct model_logit_bias *bias; /* [sp.n_logit_bias] owned; sp.logit_bias points here */
    int min_tokens;
    struct model_sampling sp_min;  /* sp while n_gen < min_tokens: stop ids banned through its logit_bias */
    struct model_logit_bias *bias_min; /* owned: bias, then a ban per stop id */
    bool json;                     /* JSON mode: guide decides what may be sampled */
    struct sched_schema *schema;   /* owned copy of the request's schema (schema mode), or NULL */
    struct sched_guide guide;      /* the output so far, as JSON */
    uint8_t *allow;                /* [tokenizer vocab] owned: this step's mask when not a cached one (sp.allow
                                      points at whichever it is) */
    int32_t *gstop;                /* [n_gstop] owned: the ids that may end a complete object */
    char *gate;                    /* owned: the guide waits until the output holds this text (the end
                                      of the reasoning); NULL once it applies */
    size_t gate_len;
    char *gate_win;                /* [gate_len] owned: the output's last gate_len bytes */
    size_t gate_seen;              /* output bytes so far, up to gate_len */
    int n_gstop;
    uint8_t *allowed;              /* [tokenizer vocab] owned: allowed_token_ids as a mask, or NULL */
    bool include_stop_str;
    int32_t *bad;                  /* owned: bad_words' token sequences, concatenated */
    int *bad_len;                  /* [n_bad] owned */
    int n_bad;
    struct model_sampling sp_bad;  /* sp or sp_min with the bad words' bans added for one sample */
    struct model_logit_bias *bias_bad; /* owned: room for bias_min's entries and a ban per bad word */
    struct model_sample_out *plp;  /* [n_prompt] owned: prompt_logprobs, or NULL */
    int plp_top;
    bool plp_sent;
    int n_stop_ids;
    struct model_detok detok;
    char *hold;              /* [hold_cap] text held back: could start a stop string */
    size_t n_hold, hold_cap;
    int cached_tokens, n_preempt;
    double t_submit, t_admit, t_first, t_last; /* t_last: the last token's */
    sched_req *prev, *next;  /* waiting list links */
};

struct waitq {
    sched_req *head, *tail;
    int n;
};

struct sched {
    struct sched_config cfg;
    kv_pool *pool;             /* borrowed */
    const model_tok *tok;      /* borrowed, may be NULL */
    struct sched_guide_vocab *gvocab; /* owned: tok's vocabulary for JSON mode (NULL without tok) */
    int pool_blocks;
    bool prefix_cache;
    const int32_t *model_stop; /* borrowed from tok */
    int n_model_stop;
    struct waitq wait[SCHED_N_PRIO];
    sched_req **run;           /* [max_num_seqs] sorted by (prio, admit_seq) */
    int n_run;
    uint64_t admit_counter;
    /* per-step scratch, allocated once */
    int32_t *tok_ids;          /* [max_num_batched_tokens] */
    int32_t *pos;              /* [max_num_batched_tokens] */
    int64_t *slots;            /* [max_num_batched_tokens] */
    struct step_seq *seqs;     /* [max_num_seqs] */
    sched_req **step_req;      /* [max_num_seqs] */
    sched_req **order;         /* [max_num_seqs] a class's running prefills, in the order served */
    int n_step_seqs;
    double step_time;          /* the step's planned seconds (the cost model) */
    struct sched_step_shape shape; /* the step's shape, for the cost model once it ran */
    int step_batch_tokens;     /* batch tokens in the step */
    double plan_limit;         /* the step's time limit (0: none) */
    double itl_now;            /* the inter-token target this step (INFINITY: none) */
    bool seen_interactive;     /* an interactive request came: steps leave room for the next */
    uint64_t dec_next;         /* batch decodes take turns from this admission on */
    double rate_tok, rate_s;   /* batch tokens and seconds, fading (stats.batch_tok_s) */
    struct sched_cost cost;
    char piece[PIECE_CAP];
    char *text;                /* [text_cap] text released by one token */
    size_t text_cap;
    struct sched_stats stats;
};

static double now_s(void)
{
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return (double)ts.tv_sec + ts.tv_nsec * 1e-9;
}

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
    return s;

fail_scratch:
    sched_destroy(s);
fail_oom:
    snprintf(err, errlen, "out of memory creating the scheduler");
    return NULL;
}

/* ---- requests ------------------------------------------------------------------- */

static void req_free(kv_pool *pool, sched_req *q)
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
    req_free(NULL, q);
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
    q->t_submit = now_s();
    q->t_first = -1;
    return q;

fail_req:
    req_free(NULL, q);
fail_oom:
    snprintf(err, errlen, "out of memory queueing the request");
    return NULL;
fail_einval:
    req_free(NULL, q);
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

static void wait_push_front(struct waitq *w, sched_req *q)
{
    q->prev = NULL;
    q->next = w->head;
    if (w->head) w->head->prev = q;
    else w->tail = q;
    w->head = q;
    w->n++;
}

static void wait_unlink(struct waitq *w, sched_req *q)
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
static void run_insert(sched *s, sched_req *q)
{
    SL_ASSERT(s->n_run < s->cfg.max_num_seqs);
    int i = s->n_run;
    while (i > 0 && s->run[i - 1]->prio > q->prio) i--;
    memmove(s->run + i + 1, s->run + i, (size_t)(s->n_run - i) * sizeof *s->run);
    s->run[i] = q;
    s->n_run++;
    q->running = true;
}

static void run_remove_at(sched *s, int i)
{
    s->run[i]->running = false;
    memmove(s->run + i, s->run + i + 1, (size_t)(s->n_run - i - 1) * sizeof *s->run);
    s->n_run--;
}

static int run_index(const sched *s, const sched_req *q)
{
    for (int i = s->n_run - 1; i >= 0; i--)
        if (s->run[i] == q) return i;
    return -1;
}

/* Frees q's blocks and sends it back to the front of its class: it is
 * recomputed from scratch later (its prefix usually stays cached). */
static void preempt(sched *s, sched_req *q)
{
    int i = run_index(s, q);
    SL_ASSERT(i >= 0 && !q->in_step);
    run_remove_at(s, i);
    kv_seq_release(s->pool, &q->kv);
    q->n_computed = 0;
    q->n_preempt++;
    s->stats.preemptions++;
    wait_push_front(&s->wait[q->prio], q);
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

static void add_to_step(sched *s, sched_req *q, int len, int *T)
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
    ss->want_sample = q->n_computed + len == q->n_tokens;
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
    ss->n_history = q->n_computed + len;
    ss->rng = &q->rng;
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
    wait_unlink(&s->wait[q->prio], q);
    q->admit_seq = ++s->admit_counter;
    if (!q->admitted_once) {
        q->admitted_once = true;
        q->cached_tokens = q->n_computed;
        q->t_admit = now_s();
    }
    run_insert(s, q);
    add_to_step(s, q, len, T);
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
        if (!reserve_running(s, q, q->n_computed + 1)) continue;
        add_to_step(s, q, 1, T);
        k++;
    }
    s->dec_next = next;
    return k;
}

int sched_plan_step(sched *s, struct step *st)
{
    const int budget = s->cfg.max_num_batched_tokens;
    int T = 0;
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
        if (!reserve_running(s, q, q->n_computed + 1)) {
            i--; /* q left the array; the next one moved into slot i */
            continue;
        }
        add_to_step(s, q, 1, &T);
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
            add_to_step(s, q, len, &T);
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

/* ---- after the step --------------------------------------------------------------- */

static void fill_usage(const sched_req *q, struct sched_usage *u)
{
    double now = now_s();
    u->prompt_tokens = q->n_prompt;
    u->cached_tokens = q->cached_tokens;
    u->completion_tokens = q->n_gen;
    u->n_preemptions = q->n_preempt;
    u->queue_s = q->admitted_once ? q->t_admit - q->t_submit : now - q->t_submit;
    u->ttft_s = q->t_first >= 0 ? q->t_first - q->t_submit : -1.0;
    u->total_s = now - q->t_submit;
}

/* Emits q's finish event with text (what was still held back, if anything)
 * and releases its blocks. The caller takes it out of its queue and frees it. */
static void finish(sched *s, sched_req *q, enum sched_finish why, const char *text, size_t len,
                   const char *msg, sched_emit_fn emit, void *arg)
{
    struct sched_event ev;
    memset(&ev, 0, sizeof ev);
    ev.kind = SCHED_EV_FINISH;
    ev.id = q->id;
    ev.user = q->user;
    ev.text = text ? text : "";
    ev.text_len = text ? len : 0;
    ev.finish = why;
    if (msg) snprintf(ev.error, sizeof ev.error, "%s", msg);
    fill_usage(q, &ev.usage);
    if (emit) emit(arg, &ev);
    kv_seq_release(s->pool, &q->kv);
    q->finished = true;
    s->stats.finished++;
}

static bool in_ids(const int32_t *ids, int n, int32_t t)
{
    for (int i = 0; i < n; i++)
        if (ids[i] == t) return true;
    return false;
}

/* Feeds piece through q's stop-string filter. Writes the text that may be
 * released now into s->text (returns its length); *stopped when a stop string
 * matched (the text ends before it and the rest is dropped). */
static size_t stop_filter(sched *s, sched_req *q, const char *piece, size_t n, bool *stopped)
{
    *stopped = false;
    SL_ASSERT(q->n_hold + n <= q->hold_cap);
    memcpy(q->hold + q->n_hold, piece, n);
    q->n_hold += n;
    /* a stop string can only start inside the held text: anything that could
     * begin one was held back */
    long best = -1;
    for (int i = 0; i < q->n_stop; i++) {
        const char *p = memmem(q->hold, q->n_hold, q->stop[i], q->stop_len[i]);
        if (p && (best < 0 || p - q->hold < best)) best = p - q->hold;
    }
    size_t out;
    if (best >= 0) {
        out = (size_t)best;
        if (q->include_stop_str) { /* the first stop string that starts there (as vLLM: in list order) */
            for (int i = 0; i < q->n_stop; i++)
                if (q->n_hold - out >= q->stop_len[i] && !memcmp(q->hold + out, q->stop[i], q->stop_len[i])) {
                    out += q->stop_len[i];
                    break;
                }
        }
        *stopped = true;
    } else {
        size_t h = 0;
        for (int i = 0; i < q->n_stop; i++) {
            size_t k = q->stop_len[i] - 1;
            if (k > q->n_hold) k = q->n_hold;
            for (; k > h; k--)
                if (!memcmp(q->hold + q->n_hold - k, q->stop[i], k)) break;
            if (k > h) h = k;
        }
        out = q->n_hold - h;
    }
    SL_ASSERT(out <= s->text_cap);
    memcpy(s->text, q->hold, out);
    memmove(q->hold, q->hold + out, q->n_hold - out);
    q->n_hold -= out;
    if (*stopped) q->n_hold = 0;
    return out;
}

/* Releases the end of q's text: the detokenizer's incomplete tail and
 * whatever was held for a stop string that never came. */
static size_t flush_text(sched *s, sched_req *q)
{
    size_t n = 0;
    if (q->n_hold) {
        memcpy(s->text, q->hold, q->n_hold);
        n = q->n_hold;
        q->n_hold = 0;
    }
    if (s->tok) n += model_detok_flush(&q->detok, s->text + n, s->text_cap - n);
    return n;
}

static void on_token(sched *s, sched_req *q, const struct model_sample_out *out, double now,
                     sched_emit_fn emit, void *arg)
{
    int32_t t = out->token;
    SL_ASSERT(q->n_tokens < q->cap);
    if (q->n_gen == 0) {
        q->t_first = now;
        sched_hist_add(&s->stats.ttft[q->prio], now - q->t_submit);
    } else {
        sched_hist_add(&s->stats.itl[q->prio], now - q->t_last);
    }
    q->t_last = now;
    q->tokens[q->n_tokens++] = t;
    q->n_gen++;
    if (q->json && q->gate) {
        /* before the gate (the reasoning): watch for it; the bytes after it in the same token start the guide */
        size_t len = 0;
        const char *b = model_tok_bytes(s->tok, t, &len);
        for (size_t i = 0; b && i < len && q->gate; i++) {
            if (q->gate_seen == q->gate_len) memmove(q->gate_win, q->gate_win + 1, q->gate_len - 1), q->gate_seen--;
            q->gate_win[q->gate_seen++] = b[i];
            if (q->gate_seen == q->gate_len && !memcmp(q->gate_win, q->gate, q->gate_len)) {
                free(q->gate);
                q->gate = NULL;
                struct sched_guide g0 = q->guide; /* a token that went on past the gate: keep what the guide takes */
                for (size_t k = i + 1; k < len; k++)
                    if (!sched_guide_step(&q->guide, (uint8_t)b[k])) {
                        q->guide = g0;
                        break;
                    }
            }
        }
    } else if (q->json && !sched_guide_done(&q->guide)) {
        /* the mask allowed t: its bytes continue the object (stop ids have none) */
        size_t len = 0;
        const char *b = model_tok_bytes(s->tok, t, &len);
        for (size_t i = 0; b && i < len; i++) sched_guide_step(&q->guide, (uint8_t)b[i]);
    }

    struct sched_event ev;
    memset(&ev, 0, sizeof ev);
    ev.kind = SCHED_EV_TOKEN;
    ev.id = q->id;
    ev.user = q->user;
    ev.token = t;
    ev.has_logprobs = q->logprobs;
    if (q->logprobs) ev.sample = *out;
    if (q->plp && !q->plp_sent) {
        ev.prompt_lp = q->plp;
        ev.n_prompt_lp = q->n_prompt;
        q->plp_sent = true;
    }
    ev.text = s->text;

    enum sched_finish why = SCHED_FINISH_NONE;
    bool string_stop = false;
    if (in_ids(q->stop_ids, q->n_stop_ids, t) || (!q->ignore_eos && in_ids(s->model_stop, s->n_model_stop, t))) {
        why = SCHED_FINISH_STOP;
    } else if (s->tok) {
        size_t n = model_detok_push(&q->detok, t, s->piece, sizeof s->piece);
        if (q->n_stop == 0) {
            memcpy(s->text, s->piece, n);
            ev.text_len = n;
        } else {
            ev.text_len = stop_filter(s, q, s->piece, n, &string_stop);
            if (string_stop) why = SCHED_FINISH_STOP;
        }
    }
    if (why == SCHED_FINISH_NONE && (q->n_gen >= q->max_tokens || q->n_tokens >= s->cfg.max_model_len))
        why = SCHED_FINISH_LENGTH;
    if (emit) emit(arg, &ev);
    if (why == SCHED_FINISH_NONE) return;
    /* a stop string drops whatever follows it; otherwise release the held tail */
    size_t n = string_stop ? 0 : flush_text(s, q);
    finish(s, q, why, s->text, n, NULL, emit, arg);
}

/* Drops finished requests from the running array and frees them. */
static void sweep(sched *s)
{
    int j = 0;
    for (int i = 0; i < s->n_run; i++) {
        sched_req *q = s->run[i];
        if (q->finished) req_free(s->pool, q);
        else s->run[j++] = q;
    }
    s->n_run = j;
}

void sched_complete_step(sched *s, struct step *st, sched_emit_fn emit, void *arg)
{
    double now = now_s();
    for (int i = 0; i < s->n_step_seqs; i++) {
        sched_req *q = s->step_req[i];
        const struct step_seq *ss = &st->seqs[i];
        q->in_step = false;
        q->n_computed += ss->query_len;
        if (s->prefix_cache) kv_seq_commit(s->pool, &q->kv, q->tokens, q->n_computed);
        if (ss->want_sample && ss->out.token < 0) /* this request alone: the others go on */
            finish(s, q, SCHED_FINISH_ERROR, NULL, 0, "could not sample a token: the logits of this request are not finite",
                   emit, arg);
        else if (ss->want_sample)
            on_token(s, q, &ss->out, now, emit, arg);
    }
    s->n_step_seqs = 0;
    sweep(s);
}

void sched_fail_step(sched *s, struct step *st, const char *msg, sched_emit_fn emit, void *arg)
{
    (void)st;
    for (int i = 0; i < s->n_step_seqs; i++) {
        sched_req *q = s->step_req[i];
        q->in_step = false;
        finish(s, q, SCHED_FINISH_ERROR, NULL, 0, msg, emit, arg);
    }
    s->n_step_seqs = 0;
    sweep(s);
}

int sched_abort(sched *s, uint64_t id, sched_emit_fn emit, void *arg)
{
    for (int i = 0; i < s->n_run; i++)
        if (s->run[i]->id == id) {
            sched_req *q = s->run[i];
            SL_ASSERT(!q->in_step);
            finish(s, q, SCHED_FINISH_ABORT, NULL, 0, NULL, emit, arg);
            run_remove_at(s, i);
            req_free(s->pool, q);
            return 0;
        }
    for (int c = 0; c < SCHED_N_PRIO; c++)
        for (sched_req *q = s->wait[c].head; q; q = q->next)
            if (q->id == id) {
                wait_unlink(&s->wait[c], q);
                finish(s, q, SCHED_FINISH_ABORT, NULL, 0, NULL, emit, arg);
                req_free(s->pool, q);
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
        for (int i = 0; i < s->n_run; i++) req_free(s->pool, s->run[i]);
    for (int c = 0; c < SCHED_N_PRIO; c++) {
        sched_req *q = s->wait[c].head;
        while (q) {
            sched_req *n = q->next;
            req_free(s->pool, q);
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
    free(s);
}

/* sched_internal.h - the scheduler's state, shared by the files of sched/
 * and used only inside it: sched.c (construction, requests, queues, abort,
 * queries, teardown), sched_plan.c (planning a step: preemption, budgets,
 * the time caps) and sched_output.c (processing a step's output: tokens,
 * detokenizing, stop checks, finishing). Engine thread only, as sched.h says.
 */
#ifndef SLUICE_SCHED_INTERNAL_H
#define SLUICE_SCHED_INTERNAL_H

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
    int32_t made[SCHED_MAX_SPEC_TOKENS]; /* drafts made after the last step (method mtp), for position made_at */
    int n_made, made_at;
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
    /* speculative decoding */
    struct sched_drafter drafter;  /* propose NULL: no drafts */
    struct model_sample_out *spec_out; /* [max_num_seqs][num_speculative_tokens + 1] the step's verified tokens */
    double spec_tok_s;         /* the step's plain decode time per token (the cost rule; 0: no rule) */
    int spec_dec_left;         /* decodes not yet in the step: the drafts leave them their tokens */
    struct sched_draft_want *wants; /* [max_num_seqs] drafts to make after the step (method mtp) */
    int n_wants;
    double spec_prop[SCHED_MAX_SPEC_TOKENS], spec_acc[SCHED_MAX_SPEC_TOKENS]; /* drafts that reached position i,
                                  and those accepted there, the older ones fading */
    char piece[PIECE_CAP];
    char *text;                /* [text_cap] text released by one token */
    size_t text_cap;
    struct sched_stats stats;
};

static inline double sched_now_s(void)
{
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return (double)ts.tv_sec + ts.tv_nsec * 1e-9;
}

/* sched.c: a request's memory (its blocks returned to pool when not NULL) */
void sched_req_release(kv_pool *pool, sched_req *q);
/* sched.c: the waiting queues and the running array (kept sorted by class, then admission) */
void sched_wait_push_front(struct waitq *w, sched_req *q);
void sched_wait_unlink(struct waitq *w, sched_req *q);
void sched_run_insert(sched *s, sched_req *q);
void sched_run_remove_at(sched *s, int i);
int sched_run_index(const sched *s, const sched_req *q);
/* sched_output.c: emits q's finish event with text (what was still held
 * back, if anything) and releases its blocks; the caller takes it out of its
 * queue and frees it */
void sched_finish_req(sched *s, sched_req *q, enum sched_finish why, const char *text, size_t len,
                      const char *msg, sched_emit_fn emit, void *arg);

/* spec.c: the drafter the configuration names (ngram's own; none for mtp
 * until sched_set_drafter), and the counters after a verification */
void sched_spec_init(sched *s);
/* sched_plan.c: how many drafts q may carry in a step that holds T tokens */
int sched_spec_room(const sched *s, const sched_req *q, int T);
void sched_spec_verified(sched *s, int n_draft, int n_accepted);

#endif

/* sched.h - request lifecycle and step planning (continuous batching, chunked
 * prefill, priorities, preemption), and the engine that runs the step loop.
 *
 * Two layers:
 *
 *   sched         the scheduler. Single-threaded: the engine thread owns it,
 *                 its requests and the KV pool it plans against. Each step it
 *                 fills a `struct step` (model/backend.h) and, after the
 *                 backend ran it, appends the sampled tokens, detokenizes,
 *                 checks stop conditions and emits events through a callback.
 *   sched_engine  the step loop on its own pthread, with a thread-safe inbox
 *                 (submit/abort) and outboxes (events): one per submitter
 *                 (sched_sink), plus the engine's own. Any thread may call the
 *                 sched_engine_* and sched_sink_* functions.
 *
 * Lifecycle of a request:
 *     waiting -> running (prefilling -> decoding) -> finished (stop, length, abort, error)
 *     running -> preempted (blocks released) -> waiting (front of its class; recomputed)
 *
 * Step order (sched_plan_step): the decodes of every running sequence first
 * (one token each), then per priority class, interactive before batch: the
 * partial prefills of running sequences, then admissions from that class's
 * waiting queue (FIFO; a preempted request goes back to the front).
 * Interactive prefills go fewest prompt tokens left first, and leave the
 * interactive prompts that wait room for their tokens (up to half the
 * budget), so a chat that arrives beside a long prompt's prefill starts in
 * the next step instead of after it. All of it within
 * max_num_batched_tokens tokens and max_num_seqs running sequences; a
 * prompt longer than what is left of the budget is split across steps
 * (chunked prefill). With max_num_partial_prefills N > 1 (vLLM's limits on
 * concurrent partial prefills), at most N prompts of a class move in a step,
 * sharing what is left of the budget evenly, at most
 * max_long_partial_prefills of them long, and a waiting long prompt is
 * passed over (it keeps its place) for the shorter prompts behind it. When
 * batch work waits, min_batch_share of the budget is kept from interactive
 * prefills so batch never starves.
 *
 * Steps are also planned by time (Sarathi-Serve's stall-free batching, with
 * the chunk chosen from latency targets rather than a token count). A cost
 * model (struct sched_cost) predicts a step's time from its shape: a fixed
 * part, prefill tokens, the (query, key) pairs they attend to, decode tokens
 * and the keys they read, and the sequences sampled; it is calibrated online
 * from the step times the engine measures, so one set of targets fits a CPU
 * and an H200. The targets:
 *   - while interactive sequences decode, a step's planned time stays within
 *     the inter-token target: itl_target_s, or itl_auto_factor times the
 *     predicted step of the chats' decodes alone;
 *   - a step that ends a chat's prompt (its first token comes with it)
 *     stays within that target too, or within the prompt's own time when
 *     that is longer: batch gets no more than what is left;
 *   - otherwise (interactive prompts only, or batch alone), where chats may
 *     come (expect_interactive, or once one came), a step stays within
 *     ttft_target_s less the inter-token target, so a chat arriving during it
 *     has its first token within ttft_target_s. Where none can come
 *     (run-batch) steps are planned by the token budget alone.
 * Inside that time, interactive decodes come first, then interactive
 * prefills, then batch decodes (in turn, from where the last step stopped:
 * those that do not fit sit the step out and keep their KV), then batch
 * prefill; batch keeps min_batch_share of the time when it waits. Without
 * interactive work every decode goes first and the step grows back to the
 * token budget (or the TTFT room). Where a target cannot be met anyway (the
 * step's fixed part and its decodes take it already, as on a loaded
 * machine), prefill is not cut below what the step holds before it: a token
 * a step would pay the fixed part again for every token, and beside a
 * chat's decode batch still gets half the step (the chat's tokens come at
 * most twice as far apart as alone). A time-capped chunk is moved to end the
 * step on the nearest multiple of step_granule tokens (the GPU's GEMM tiles
 * and waves). A step always moves by at least one token.
 *
 * Preemption (blocks released, the request requeued at the front of its
 * class, counted in sched_stats.preemptions and its usage.n_preemptions):
 *   - for slots: before the step is planned, while interactive requests wait
 *     and every sequence slot is taken, the most recently admitted running
 *     batch sequence is preempted for each interactive request that the
 *     step's budget can start, and that request is admitted in this same
 *     step. Interactive never preempts interactive; batch never preempts for
 *     a slot; a batch victim is not readmitted in the step that preempted it.
 *   - for KV blocks: the lowest-priority, most recently admitted running
 *     sequence not yet in the step (possibly the one asking). An admission
 *     never preempts for blocks, except that an interactive one may push out
 *     running batch sequences.
 * So batch work may fill every slot: a chat request never waits for one of
 * them to finish.
 *
 * Speculative decoding (sched_config.spec): a decode may carry drafts after
 * its last sampled token, verified in the same step (step_seq.n_draft); the
 * scheduler takes the emitted tokens one by one as a decode takes its one
 * and rolls back the rejected positions. Drafts come from a drafter asked
 * while the step is planned (n-gram) or made after the step before
 * (sched_draft_wants, MTP); a cost rule drafts only where it pays (DESIGN.md,
 * "Scheduling").
 *
 * Every step's positions, slots and block tables follow DESIGN.md: a token at
 * position p lives in slot block_table[p / block_size] * block_size + p % block_size.
 */
#ifndef SLUICE_SCHED_H
#define SLUICE_SCHED_H

#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>

#include "kvpool/kvpool.h"
#include "model/backend.h"
#include "base/json.h"
#include "model/model.h"

/* ---- requests and events ---------------------------------------------------- */

#define SCHED_MAX_STOP_LEN 1024

enum sched_priority { SCHED_PRIO_INTERACTIVE = 0, SCHED_PRIO_BATCH = 1, SCHED_N_PRIO = 2 };

enum sched_finish {
    SCHED_FINISH_NONE = 0,
    SCHED_FINISH_STOP,    /* a stop token id or stop string */
    SCHED_FINISH_LENGTH,  /* max_tokens or max_model_len reached */
    SCHED_FINISH_ABORT,   /* sched_abort / sched_engine_abort */
    SCHED_FINISH_ERROR,   /* the backend failed on a step that held it */
};
/* "stop", "length", "abort", "error" (the OpenAI finish_reason strings). */
const char *sched_finish_name(enum sched_finish f);

/* What a caller submits. Everything pointed to is copied by sched_req_create. */
struct sched_request {
    const int32_t *prompt;          /* [n_prompt] token ids, n_prompt >= 1 */
    int n_prompt;
    struct model_sampling sampling; /* top_logprobs > 0 also attaches alternatives */
    int max_tokens;                 /* >= 1: completion tokens at most */
    int min_tokens;                 /* 0..max_tokens: before this many, the stop token ids (the model's
                                       unless ignore_eos, and stop_token_ids) cannot be sampled (vLLM's
                                       min_tokens; stop strings still apply) */
    bool ignore_eos;                /* do not stop at the model's stop token ids */
    const char *const *stop;        /* [n_stop] stop strings (not included in the text),
                                       1..SCHED_MAX_STOP_LEN bytes each */
    int n_stop;
    const int32_t *stop_token_ids;  /* [n_stop_token_ids] extra stop ids (honoured even with ignore_eos) */
    int n_stop_token_ids;
    bool logprobs;                  /* token events carry the sampled token's logprob */
    enum sched_priority priority;
    bool json_object;               /* JSON mode: the output is one JSON object (sched_guide_*) */
    const struct sched_schema *schema; /* schema mode (implies JSON): borrowed, copied at submit; also a
                                       regex or grammar (sched_schema_from_regex / _grammar) */
    const char *guide_after;        /* with json_object or schema: the guide starts once the output holds
                                       this text (the end of the reasoning, "</think>"), vLLM's behaviour
                                       with a reasoning parser; NULL: from the first token. Copied */
    uint64_t cache_salt;            /* requests with different salts never share KV */
    void *user;                     /* returned in every event; not touched */
    struct sched_sink *sink;        /* the engine's outbox its events go to (sched_sink_create);
                                       NULL: the engine's own (sched_engine_poll/wait) */
    /* vLLM's SamplingParams extensions */
    bool include_stop_str;          /* include_stop_str_in_output: a matched stop string stays in the text */
    bool keep_special_tokens;       /* skip_special_tokens false: special tokens' text is in the output */
    const int32_t *allowed_ids;     /* [n_allowed_ids] allowed_token_ids: only these may be sampled (0: any) */
    int n_allowed_ids;
    const int32_t *bad_words;       /* bad_words as token sequences, concatenated: word w is
                                       bad_word_lens[w] ids; its last id is banned wherever the ids
                                       before it end the output so far (vLLM's NoBadWordsLogitsProcessor) */
    const int *bad_word_lens;       /* [n_bad_words] */
    int n_bad_words;
    bool prompt_logprobs;           /* the first token event carries every prompt token's logprob (the
                                       backend must have has_prompt_logprobs; no prefix cache read) */
    int prompt_top_logprobs;        /* ... and this many alternatives each (0..MODEL_MAX_TOP_LOGPROBS) */
};

struct sched_usage {
    int prompt_tokens;
    int cached_tokens;      /* prompt tokens served by the prefix cache at first admission */
    int completion_tokens;  /* sampled tokens, a stop token included */
    int n_preemptions;
    double queue_s;         /* submit -> first admission */
    double ttft_s;          /* submit -> first token sampled; -1 when none */
    double total_s;         /* submit -> finish */
};

enum sched_event_kind { SCHED_EV_TOKEN, SCHED_EV_FINISH };

/* One output event. text is borrowed: valid during the callback (sched) or
 * until the next poll/wait into the same buffer (engine). */
struct sched_event {
    enum sched_event_kind kind;
    uint64_t id;
    void *user;
    const char *text;         /* newly released text (may be empty: held back for a
                                 possible stop string, or an incomplete UTF-8 tail) */
    size_t text_len;
    size_t text_off;          /* internal: offset into the engine's text arena */
    /* SCHED_EV_TOKEN */
    int32_t token;
    bool has_logprobs;
    struct model_sample_out sample; /* when has_logprobs */
    /* SCHED_EV_FINISH: text is what was still held back, if anything */
    enum sched_finish finish;
    struct sched_usage usage;
    char error[160];          /* SCHED_FINISH_ERROR: why */
    /* the first token event of a prompt_logprobs request: [n_prompt_lp] entries, entry p for prompt
       token p (top_ids: the alternatives); entry 0 has no logprob (NaN). Borrowed like text. */
    const struct model_sample_out *prompt_lp;
    int n_prompt_lp;
    size_t plp_off;           /* internal: offset into the engine's arena */
};

typedef void (*sched_emit_fn)(void *arg, const struct sched_event *ev);

/* ---- the scheduler ------------------------------------------------------------ */

/* Speculative decoding (vLLM's --speculative-config): each step, a decoding
 * sequence may carry up to num_speculative_tokens draft tokens after its
 * last sampled one; the step verifies all of them at once (step_seq.n_draft)
 * and the sequence advances by the accepted drafts plus one. Greedy output
 * is the same with and without drafts, sampled output follows the same
 * distribution (model_sample_verify), and a seeded request gives the same
 * tokens. Sequences under a guide (JSON, schema, regex, grammar), with
 * bad_words or still under min_tokens decode without drafts: their sampling
 * changes from one position to the next. */
enum sched_spec_method { SCHED_SPEC_NONE = 0, SCHED_SPEC_NGRAM, SCHED_SPEC_MTP };
#define SCHED_MAX_SPEC_TOKENS 4
struct sched_spec_config {
    enum sched_spec_method method;
    int num_speculative_tokens;  /* drafts per sequence and step at most, 1..SCHED_MAX_SPEC_TOKENS */
    int prompt_lookup_min;       /* ngram: the shortest suffix of the sequence looked up (>= 1) */
    int prompt_lookup_max;       /* ngram: the longest (>= prompt_lookup_min); longer matches are tried first */
    bool always;                 /* draft whatever the load (tests, benchmarks); false: the cost rule
                                    (sched_plan.c, DESIGN.md "Scheduling") drafts only where the tokens a
                                    draft is expected to save are worth more than verifying it costs */
};

/* Where drafts come from. The scheduler asks for them per decoding sequence
 * each step; the n-gram drafter (spec.c, the default for SCHED_SPEC_NGRAM)
 * looks them up in the sequence itself; an MTP drafter (the model's own
 * next-token layers, run by the backend) keeps a hidden state per sequence.
 * Engine thread only. */
struct sched_drafter {
    /* Up to k tokens that may follow tokens[0 .. n) (the sequence's prompt
     * and output) into draft[]; returns how many (0: none this step). id
     * names the sequence. */
    int (*propose)(void *arg, uint64_t id, const int32_t *tokens, int n, int k, int32_t *draft);
    /* After the step: n_accepted of the sequence's n_draft drafts were
     * accepted (n_draft 0: it decoded one token without drafts). May be NULL. */
    void (*accepted)(void *arg, uint64_t id, int n_draft, int n_accepted);
    /* The sequence finished or was preempted (it is recomputed from its
     * tokens later): drop what is kept for it. May be NULL. */
    void (*release)(void *arg, uint64_t id);
    void *arg;
};
/* The n-gram drafter: prompt lookup over the sequence's own tokens. The
 * longest suffix of tokens[0 .. n), from max down to min tokens, that also
 * occurs earlier (the latest such occurrence) proposes the up to k tokens
 * that followed it. Returns how many were written to draft. */
int sched_ngram_propose(const int32_t *tokens, int n, int min, int max, int k, int32_t *draft);

struct sched_config {
    int block_size;              /* KV tokens per block (the pool's) */
    int max_num_seqs;            /* running sequences at most (>= 1) */
    int max_num_batched_tokens;  /* tokens per step (>= max_num_seqs) */
    int max_model_len;           /* prompt + completion tokens at most */
    float min_batch_share;       /* 0..1: budget share (tokens, and time under a target) kept for batch
                                    work when it waits */
    double itl_target_s;         /* > 0: while interactive sequences decode, a step's planned time at
                                    most this (and a step with a chat's first token); 0: no time cap */
    double itl_auto_factor;      /* > 0: the inter-token target is instead this many times the
                                    predicted time of a step holding only the interactive decodes
                                    (their speed alone), re-read at every step; 0: itl_target_s */
    double ttft_target_s;        /* > itl_target_s: where chats may come, other steps are planned
                                    within ttft_target_s - itl_target_s; 0: no such cap */
    bool expect_interactive;     /* interactive requests may arrive at any time (serve): steps leave
                                    one the TTFT room from the start; false (run-batch): only once one
                                    came */
    int step_granule;            /* > 1: a chunk that a time cap cuts is moved so that the step
                                    holds the nearest multiple of this many tokens, or below that of a
                                    quarter of it (the GPU's GEMM waves) */
    double prior_token_s;        /* the cost model before any measurement: seconds per token (> 0) */
    double prior_pair_ratio;     /* ... and a (query, key) pair's cost in tokens (model_attn_pair_cost) */
    int long_prefill_token_threshold; /* > 0: a prefill moves by at most this many tokens a step (vLLM's
                                    --long-prefill-token-threshold); 0: no such cap */
    int max_num_partial_prefills; /* > 1: at most this many prompts of a class move in a step (vLLM's
                                    --max-num-partial-prefills; 0 or 1: any number, as vLLM at 1) */
    int max_long_partial_prefills; /* with max_num_partial_prefills > 1: at most this many of them long
                                    (>= 1; long: more tokens left than long_prefill_token_threshold, or
                                    than 4% of max_model_len without it); the waiting long prompts are
                                    passed over for the shorter ones behind them */
    struct sched_spec_config spec; /* speculative decoding; method SCHED_SPEC_NONE: off */
};

/* The scheduling policy's defaults, the one place they are set: serve and
 * run-batch start from these and apply their flags on top. Fills the policy
 * fields of c (min_batch_share, the latency targets, the partial-prefill
 * limits); the sizes are left alone (sched_engine_defaults). The targets:
 * to the first token 200 ms on the CPU, under the ~250 ms past which a reply
 * stops feeling immediate, and 50 ms on GPUs (the serving front ends choose
 * it for the device: SCHED_DEFAULT_TTFT_TARGET_GPU_S). On a GPU batch steps
 * of 50 ms less a chat's step still hold a few thousand prefill tokens
 * (H100, 8B: TTFT 216 -> 58 ms beside a batch, and the batch's prefill kept
 * more of its speed, not less); on two CPU cores they would hold a few
 * dozen, each step paying the weights' dequantization again. Between tokens, twice the time a step of the chats
 * alone takes (itl_auto_factor 2): a chat beside a batch streams at least
 * half as fast as it would alone, on any hardware (about 9 ms on an H200
 * for an 8B model, 20 ms on two CPU cores for the default model). Batch
 * work gets the rest of each step: at least half of it while chats stream,
 * and between chats the TTFT room (200 ms less a chat's own step). */
#define SCHED_DEFAULT_TTFT_TARGET_S 0.2
#define SCHED_DEFAULT_TTFT_TARGET_GPU_S 0.05
#define SCHED_DEFAULT_ITL_AUTO_FACTOR 2.0
void sched_config_policy_defaults(struct sched_config *c);

/* ---- cost.c: what a step costs, learned from the steps run ------------------ */

/* A step's shape: what the cost model weighs. */
enum {
    SCHED_COST_STEP,       /* 1 per step: launch, weights read once, host work */
    SCHED_COST_PREFILL,    /* prefill tokens */
    SCHED_COST_PAIR,       /* (query, key) pairs of prefill attention: a chunk of len from n0
                              attends len * n0 + len * (len + 1) / 2 */
    SCHED_COST_DECODE,     /* decode tokens */
    SCHED_COST_DECODE_KEY, /* keys the decode tokens read (their contexts) */
    SCHED_COST_SAMPLE,     /* sequences sampled (a logits row and the sampler each) */
    SCHED_COST_N
};
struct sched_step_shape {
    double x[SCHED_COST_N];
};

/* Seconds per unit of each term, fitted to the measured step times by least
 * squares on relative error (a 10 ms step counts as much as a 2 s one), the
 * older steps decaying by SCHED_COST_FORGET a step (a memory of ~100 steps), and held to a Gaussian
 * prior that never decays: a term the recent steps do not tell apart (decode
 * tokens and sampled sequences go together) stays near the prior instead of
 * drifting. Coefficients are kept >= 0. Engine thread only (or a test). */
#define SCHED_COST_FORGET 0.99
struct sched_cost {
    double coef[SCHED_COST_N];                 /* what planning uses, seconds per unit of each term */
    /* the fit, in cost.c's basis (a decode's cost beyond a prefill token's) */
    double theta[SCHED_COST_N];
    bool theta_ok;
    double prior[SCHED_COST_N], prior_prec[SCHED_COST_N];
    double a[SCHED_COST_N][SCHED_COST_N];      /* decayed normal equations of the measured steps */
    double b[SCHED_COST_N];
    uint64_t n_obs;
};
/* The prior: a token costs token_s (prefill or decode), a pair pair_ratio
 * tokens, a step and a sample nothing, each known only loosely, so the
 * first measured steps decide. */
void sched_cost_init(struct sched_cost *c, double token_s, double pair_ratio);
/* The predicted seconds of a step of shape x. */
double sched_cost_time(const struct sched_cost *c, const struct sched_step_shape *x);
/* Takes a measured step (seconds > 0) into the fit and refits. */
void sched_cost_observe(struct sched_cost *c, const struct sched_step_shape *x, double seconds);

/* Latency histogram with fixed bounds (seconds), Prometheus style. */
#define SCHED_HIST_BUCKETS 19
extern const double sched_hist_bounds[SCHED_HIST_BUCKETS];
struct sched_hist {
    double sum;
    uint64_t count;
    uint64_t le[SCHED_HIST_BUCKETS]; /* cumulative counts per bound */
};
void sched_hist_add(struct sched_hist *h, double v);

typedef struct sched sched;
typedef struct sched_req sched_req;

struct sched_stats {
    int n_waiting, n_running;
    uint64_t steps, finished;
    uint64_t preemptions;            /* for KV blocks and for interactive requests' slots */
    uint64_t prompt_tokens_computed; /* prefill tokens run (recompute included) */
    uint64_t decode_tokens;
    uint64_t class_tokens[SCHED_N_PRIO]; /* prefill + decode tokens run, per class */
    uint64_t decodes_sat_out;        /* batch decodes left out of a step for the time budget */
    /* per class, engine-side (from the step that sampled the token) */
    struct sched_hist ttft[SCHED_N_PRIO];   /* submit -> first token */
    struct sched_hist itl[SCHED_N_PRIO];    /* between a sequence's tokens */
    /* steps timed through sched_step_timed: what the plan predicted, what ran */
    struct sched_hist step_planned, step_measured;
    double last_planned_s, last_measured_s, last_limit_s; /* last_limit_s: the time cap (0: none) */
    double batch_tok_s;              /* batch tokens a second, over the last ~10 s of steps */
    double cost[SCHED_COST_N];       /* the cost model's coefficients (seconds per unit) */
    /* speculative decoding, as vLLM counts it: verifications with drafts, drafts, accepted drafts,
       and accepted drafts by position (position i: the (i+1)-th draft of a verification) */
    uint64_t spec_drafts, spec_draft_tokens, spec_accepted_tokens;
    uint64_t spec_accepted_per_pos[SCHED_MAX_SPEC_TOKENS];
};

/* Creates a scheduler planning against pool (borrowed; the engine thread owns
 * both). tok (borrowed, may be NULL in tests: no text, no stop strings) is
 * used to detokenize and for the model's stop ids. Allocates the per-step
 * scratch once. NULL with a message on bad limits or no memory. */
sched *sched_create(const struct sched_config *cfg, kv_pool *pool, const model_tok *tok, char *err,
                    size_t errlen);
/* Releases every request's blocks (no events) and frees the scheduler. NULL ok. */
void sched_destroy(sched *s);

/* Validates r against s's immutable limits and copies it into a new request
 * (any thread may call this: it reads only the configuration). A request that
 * can never run (empty prompt, prompt + max_tokens over max_model_len or over
 * the whole pool, bad ids) is refused: NULL with a message naming the limit.
 * The caller owns the result until sched_add or sched_req_free. */
sched_req *sched_req_create(const sched *s, const struct sched_request *r, uint64_t id, char *err,
                            size_t errlen);
void sched_req_free(sched_req *q);
uint64_t sched_req_id(const sched_req *q);

/* Queues q (ownership passes to s) at the back of its priority class. */
void sched_add(sched *s, sched_req *q);

/* Aborts request id wherever it is: releases its blocks now and emits its
 * finish event (SCHED_FINISH_ABORT). Returns 0, or SL_EINVAL when unknown
 * (already finished). */
int sched_abort(sched *s, uint64_t id, sched_emit_fn emit, void *arg);

/* Plans the next step into *st (arrays borrowed from s, valid until the next
 * call). Returns the number of tokens planned, 0 when there is nothing to
 * run. Preemptions, for KV blocks and for interactive requests' slots, happen
 * here (counted in stats). */
int sched_plan_step(sched *s, struct step *st);

/* After the backend ran the planned step: advances every sequence, commits
 * computed full blocks to the prefix cache, appends sampled tokens, emits
 * token events, and finishes (and frees) the requests that are done. */
void sched_complete_step(sched *s, struct step *st, sched_emit_fn emit, void *arg);

/* After the planned step ran (and completed) in seconds of wall time: feeds
 * the cost model and the step-time statistics. Not calling it leaves the
 * model at its prior (tests). */
void sched_step_timed(sched *s, double seconds);
/* The cost model (calibrate it directly in tests). Engine thread. */
struct sched_cost *sched_cost_model(sched *s);
/* The last planned step's shape and predicted seconds. */
double sched_step_plan(const sched *s, struct sched_step_shape *x);

/* After the backend failed on the planned step: finishes every request in it
 * with SCHED_FINISH_ERROR and msg. */
void sched_fail_step(sched *s, struct step *st, const char *msg, sched_emit_fn emit, void *arg);

/* Replaces the drafter (copied; ngram has its own). Engine thread, between
 * steps. */
void sched_set_drafter(sched *s, const struct sched_drafter *d);

/* Drafts made after a step (method SCHED_SPEC_MTP: the model's own MTP layer
 * chained from the hidden states that step computed, by the backend). After
 * sched_complete_step, each sequence of that step that goes on decoding is
 * listed with what such a drafter needs; the engine has the drafts made into
 * it, and the sequence carries them in the next step it decodes in (if it is
 * still at that position; the cost rule and the budget may take fewer). The
 * blocks for the positions the drafter writes are reserved without
 * preempting anyone; a sequence that cannot get them is not listed (its
 * next drafts are only likelier to be rejected). */
struct sched_draft_want {
    uint64_t id;                /* the request */
    int seq;                    /* its index in the step just completed */
    int pos;                    /* p: its last accepted position (its KV and hidden state are computed) */
    int32_t token;              /* the token at p + 1: its last sampled one */
    int k;                      /* drafts wanted (0: none, the drafter only takes in p + 1) */
    const int32_t *block_table; /* [n_blocks] borrowed: covers positions 0 .. p + max(k, 1) */
    int n_blocks;
    int32_t *drafts;            /* [k] to fill: the drafts for positions p + 2 .. p + k + 1 */
    int n_made;                 /* to set: how many were made (0 .. k) */
};
/* The wants of the step just completed (*w borrowed until the next
 * sched_plan_step; 0 unless the method is SCHED_SPEC_MTP). Engine thread. */
int sched_draft_wants(sched *s, struct sched_draft_want **w);

bool sched_has_work(const sched *s);
void sched_get_stats(const sched *s, struct sched_stats *st);
/* For tests: the id of the request behind the planned step's i-th sequence. */
uint64_t sched_step_req_id(const sched *s, int i);

/* ---- the engine --------------------------------------------------------------- */

typedef struct sched_engine sched_engine;
typedef struct sched_sink sched_sink;

struct sched_engine_opts {
    struct sched_config sched;   /* block_size 0 = 16; max_num_seqs 0 = 64;
                                    max_num_batched_tokens 0 = 1024; max_model_len 0 = the
                                    model's n_ctx_train capped at 8192 */
    size_t kv_cache_bytes;       /* KV pool budget; 0 = 1 GiB */
    int kv_blocks;               /* > 0: exactly this many blocks (tests) */
    bool enable_prefix_caching;
    const struct sched_drafter *drafter; /* with sched.spec: where drafts come from (copied; its arg must
                                    outlive the engine); NULL: the method's own (ngram) */
    int mamba_block_size;        /* models with recurrent layers: a prefix-cache state snapshot every this
                                    many tokens (a multiple of block_size; vLLM's --mamba-block-size); 0 =
                                    the tokens whose KV takes as many bytes as one snapshot, so snapshots
                                    at most double the cache's bytes per token */
    /* Called on the engine thread after events were posted to the engine's
     * own outbox (e.g. to event_active() a libevent event), with the
     * engine's lock held: it must not block or call the engine. May be NULL. */
    void (*notify)(void *arg);
    void *notify_arg;
};

/* Events handed to the consumer in one batch: poll/wait swap the engine's
 * pending buffer with this one, so nothing is copied or allocated in steady
 * state. init/deinit; events and their text stay valid until the next
 * poll/wait into the same buffer. */
struct sched_evbuf {
    struct sched_event *ev;
    int n, cap;
    char *text;
    size_t tlen, tcap;
};
void sched_evbuf_init(struct sched_evbuf *b);
void sched_evbuf_deinit(struct sched_evbuf *b);

struct sched_engine_stats {
    struct sched_stats sched;
    struct kv_stats kv;
    int max_model_len, block_size, kv_blocks;
    size_t state_bytes;          /* one sequence's recurrent state (0: no recurrent layers) */
    int state_slots, snap_slots; /* running sequences' state slots; prefix-cache snapshot slots */
    int snap_every;              /* tokens between grid snapshots (0: none) */
    size_t spec_state_bytes;     /* the backend's scratch for rolling recurrent state back after drafts
                                    (model_backend.spec_state_bytes) */
};

/* Fills the zero fields of o with the defaults above (m: for n_ctx_train; may
 * be NULL). Call it to size the backend before sched_engine_create. */
void sched_engine_defaults(const model *m, struct sched_engine_opts *o);

/* Creates the pool (sized from kv_cache_bytes through be->ops->kv_block_bytes,
 * allocated through be->ops->kv_alloc), the scheduler, and starts the engine
 * thread. be and its model are borrowed and must outlive the engine; the
 * backend must have been created with max_tokens_per_step >=
 * max_num_batched_tokens, max_seqs_per_step >= max_num_seqs and max_ctx >=
 * max_model_len. The pool must hold at least one max_model_len sequence.
 * NULL with a message on failure; nothing is left running. */
sched_engine *sched_engine_create(model_backend *be, const struct sched_engine_opts *opts, char *err,
                                  size_t errlen);
/* Stops the thread (requests still in flight are dropped without events) and
 * frees everything. NULL ok. */
void sched_engine_destroy(sched_engine *e);

/* The effective configuration (defaults applied). */
const struct sched_config *sched_engine_config(const sched_engine *e);

/* Validates and queues a request; thread-safe. Returns 0 and the request's id
 * in *id, or a negative status with a message (e.g. the prompt does not fit
 * max_model_len) and nothing queued. */
int sched_engine_submit(sched_engine *e, const struct sched_request *r, uint64_t *id, char *err,
                        size_t errlen);
/* Asks the engine to abort request id; its finish event (abort) follows. A
 * request that already finished is ignored. Thread-safe. */
void sched_engine_abort(sched_engine *e, uint64_t id);

/* Moves the pending events of the engine's own outbox (requests submitted
 * without a sink) into *b (whose previous events are discarded). Returns how
 * many; never blocks. Thread-safe. */
int sched_engine_poll(sched_engine *e, struct sched_evbuf *b);
/* Like poll, but waits up to timeout_s (< 0: forever) for at least one event.
 * Returns the number of events (0 on timeout). */
int sched_engine_wait(sched_engine *e, struct sched_evbuf *b, double timeout_s);

/* A sink is one submitter's outbox: the events of the requests submitted
 * with it (sched_request.sink) go there and nowhere else, and only its own
 * notifier is called for them. So each consumer (the chat server's event
 * loop, the Batch API's store thread, run-batch) drains its own events on
 * its own thread and is woken only for them. notify (may be NULL) is called
 * on the engine thread after events were posted to this sink, with the
 * engine's lock held: it must not block or call the engine. NULL when out of
 * memory. Thread-safe. */
sched_sink *sched_sink_create(sched_engine *e, void (*notify)(void *arg), void *arg);
/* Removes the sink: events of its requests still in the engine are dropped
 * from then on (abort them first when their end matters). Call it before
 * sched_engine_destroy. NULL ok. */
void sched_sink_destroy(sched_sink *k);
/* sched_engine_poll / sched_engine_wait for a sink. */
int sched_sink_poll(sched_sink *k, struct sched_evbuf *b);
int sched_sink_wait(sched_sink *k, struct sched_evbuf *b, double timeout_s);
/* A consistent snapshot of the counters, taken after the last step. */
void sched_engine_get_stats(sched_engine *e, struct sched_engine_stats *st);
/* Whether the backend failed for good (a GPU or tensor-parallel rank died):
 * then every request in flight finishes with an error event, submit refuses
 * new ones with SL_EDEVICE, and the caller should stop. The reason goes to
 * msg. Thread-safe. */
bool sched_engine_fatal(sched_engine *e, char *msg, size_t msglen);

/* ---- guide.c: JSON mode ------------------------------------------------------- */

/* A byte-level JSON recognizer (RFC 8259) for constrained generation: the
 * output must be one JSON object. Embedded in a request; copying it forks
 * the state. */
#define SCHED_GUIDE_MAX_DEPTH 32
struct sched_schema; /* a compiled JSON schema (schema.c) */
struct sched_guide_frame {
    int16_t node, idx;
    uint8_t phase;
};
struct sched_guide {
    int state, n, depth, n_ws;
    bool key, done;
    const char *lit;
    uint8_t stack[SCHED_GUIDE_MAX_DEPTH];             /* JSON mode: open objects/arrays */
    const struct sched_schema *schema;                /* schema mode (borrowed), or NULL */
    int lit_first;                                    /* schema mode: literal matching */
    uint64_t cand;
    int dstate, slen;                                 /* schema mode: a pattern's DFA state (-1: none),
                                                         characters of the string so far */
    double num;                                       /* schema mode, bounded numbers: magnitude so far */
    int16_t ndig, nfrac;                              /* ... its integer and fraction digits */
    bool neg;                                         /* ... and sign */
    struct sched_guide_frame frame[SCHED_GUIDE_MAX_DEPTH]; /* schema mode: the nodes being written */
};
/* JSON mode: any one JSON object. */
void sched_guide_init(struct sched_guide *g);
/* Schema mode: one object that s describes (s must outlive g). */
void sched_guide_init_schema(struct sched_guide *g, const struct sched_schema *s);

/* Compiles the JSON schema at value s of d (OpenAI's response_format
 * json_schema.schema; the subset schema.c lists). The root must be an object
 * unless any_root. NULL with the unsupported keyword or the limit named in
 * err. One allocation: copy/free below. */
struct sched_schema *sched_schema_compile(const json_doc *d, int s, bool any_root, char *err, size_t errlen);
struct sched_schema *sched_schema_copy(const struct sched_schema *s);
/* The whole output matches a regular expression (vLLM's structured_outputs
 * regex: anchored at both ends), is one of n strings (choice), or is a
 * sentence of a GBNF grammar without recursive rules (regex.c says which
 * syntax). The output is raw text, not JSON. NULL with the reason in err. */
struct sched_schema *sched_schema_from_regex(const char *re, size_t len, char *err, size_t errlen);
struct sched_schema *sched_schema_from_choice(const char *const *s, const size_t *len, int n, char *err,
                                              size_t errlen);
struct sched_schema *sched_schema_from_grammar(const char *gbnf, size_t len, char *err, size_t errlen);
/* The schema of {} and nothing else (a function without parameters). */
struct sched_schema *sched_schema_empty_object(void);
void sched_schema_free(struct sched_schema *s);
/* The JSON number grammar both recognizers share (internal to sched/): the
 * state after byte c from state st; -1 when c cannot continue the number,
 * -2 when the number ended before c (st must then be complete). integer: no
 * fraction, no exponent. Start from SCHED_NUM_START with the first byte. */
enum { SCHED_NUM_START, SCHED_NUM_MINUS, SCHED_NUM_ZERO, SCHED_NUM_INT, SCHED_NUM_DOT, SCHED_NUM_FRAC,
       SCHED_NUM_E, SCHED_NUM_ESIGN, SCHED_NUM_EXP };
int sched_json_num(int st, uint8_t c, bool integer);
bool sched_json_num_complete(int st);
/* The inside of a JSON string (after its opening quote), shared the same
 * way: the state after byte c from st; -1 when c cannot continue the string,
 * SCHED_STR_END when c is its closing quote. */
enum { SCHED_STR_BODY, SCHED_STR_ESC, SCHED_STR_HEX1, SCHED_STR_HEX2, SCHED_STR_HEX3, SCHED_STR_HEX4, SCHED_STR_END };
int sched_json_str(int st, uint8_t c);
/* schema.c's side of sched_guide_step / the mask (internal to sched/) */
bool sched_schema_step(struct sched_guide *g, uint8_t c);
bool sched_schema_in_string(const struct sched_guide *g);
bool sched_schema_can_stop(const struct sched_guide *g);
/* The mask's fast path (internal to sched/): when g is inside raw text (a
 * regex or grammar) or a string with a pattern or maxLength, a run of plain
 * bytes (*raw: any bytes) is taken iff it walks *next (NULL: no DFA) from
 * *state without a -1 and holds at most *room characters (-1: any). false
 * when g is elsewhere. */
bool sched_schema_plain_run(const struct sched_guide *g, const int16_t (**next)[256], int *state, int *room,
                            bool *raw);
/* A number no other schema copy in this process has (the mask cache's key:
 * a freed copy's address may come back for another request's). */
uint64_t sched_schema_uid(const struct sched_schema *s);
/* Feeds one byte; false (state undefined) when it cannot continue a JSON object. */
bool sched_guide_step(struct sched_guide *g, uint8_t c);
/* Whether the top-level object is complete (nothing may follow). */
bool sched_guide_done(const struct sched_guide *g);
/* Whether the output may end here: done, or a regex/grammar output that is
 * complete and could also go on (the mask then allows the stop ids too). */
bool sched_guide_can_stop(const struct sched_guide *g);
/* A DFA over bytes (regex.c, internal to sched/): next[s][c] is the state
 * after byte c from state s, -1 when c cannot lead to a match; state 0 is
 * the start; every state with a transition can still reach an accepting one. */
struct sched_dfa {
    int n;
    int16_t (*next)[256]; /* [n] */
    uint8_t *accept;      /* [n] */
};
enum { SCHED_RX_FULL, SCHED_RX_SEARCH, SCHED_RX_GBNF }; /* a whole-match regex, a JSON Schema pattern
                                                           (matches anywhere unless ^/$), a grammar */
int sched_regex_build(const char *src, size_t len, int mode, int max_states, struct sched_dfa *out, char *err,
                      size_t errlen);
void sched_dfa_free(struct sched_dfa *d);
/* The tokenizer's vocabulary prepared for masking (bytes, kinds), built once
 * per tokenizer; NULL when out of memory. tok must outlive it. */
struct sched_guide_vocab *sched_guide_vocab_create(const model_tok *tok);
void sched_guide_vocab_destroy(struct sched_guide_vocab *v);
/* allow[t] = 1 for each token t of v whose bytes all continue g (normal
 * tokens only); once g is done, only the stop ids are allowed. allow has
 * model_tok_n_vocab entries. v caches the masks of recent states, so one
 * thread at a time (the engine's). */
void sched_guide_mask(const struct sched_guide *g, struct sched_guide_vocab *v, const int32_t *stop, int n_stop,
                      uint8_t *allow);
/* The same mask without the copy: v's cached mask for g's state when there
 * is one, else computed into own (n_vocab bytes). A cached mask handed out
 * stays unchanged until the next sched_guide_vocab_epoch() (the engine
 * starts one per step), so every row of a step can point into the cache. */
const uint8_t *sched_guide_mask_ref(const struct sched_guide *g, struct sched_guide_vocab *v, const int32_t *stop,
                                    int n_stop, uint8_t *own);
void sched_guide_vocab_epoch(struct sched_guide_vocab *v);

#endif

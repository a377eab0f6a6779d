/* engine.c - the step loop on its own thread: inbox -> sched_plan_step ->
 * backend forward -> sched_complete_step -> outbox.
 *
 * One mutex guards the inbox (new requests, abort ids), the outboxes (pending
 * events) and the stats snapshot. The engine thread owns the scheduler, the
 * KV pool and the backend; it holds the mutex only to swap the inbox out and
 * while it posts a step's events, never during forward(). Consumers take the
 * pending events by swapping buffers (sched_sink_poll/wait), so in steady
 * state nothing is allocated per token: both buffers stay at their high-water
 * mark.
 *
 * Each request's events go to the outbox (sink) of its submitter: at submit
 * its user pointer is wrapped in a route naming the sink, and the events
 * carry the submitter's pointer again. The engine's own sink serves the
 * requests submitted without one (sched_engine_poll/wait).
 */
#include <errno.h>
#include <pthread.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

#include "sched.h"

/* A submitter's outbox (sched.h). */
struct sched_sink {
    sched_engine *e;
    struct sched_evbuf pending;    /* under e->mu */
    bool dropped;                  /* an event was dropped for lack of memory */
    bool posted;                   /* events came in the step being published */
    void (*notify)(void *arg);
    void *notify_arg;
    struct sched_sink *next;       /* e->sinks, under e->mu */
};

/* Where one request's events go: its sink (NULL once the sink is gone: the
 * events are dropped) and the submitter's user pointer. Lives from submit to
 * the request's finish event. */
struct route {
    struct sched_sink *k;
    void *user;
    struct route *prev, *next;     /* e->routes, under e->mu */
};

struct sched_engine {
    model_backend *be;         /* borrowed */
    kv_pool *pool;             /* owned; engine thread */
    sched *s;                  /* owned; engine thread (sched_req_create reads its config) */
    struct sched_config cfg;
    int kv_blocks;
    pthread_t th;
    pthread_mutex_t mu;
    pthread_cond_t work_cv;    /* engine waits: inbox or stop */
    pthread_cond_t ev_cv;      /* consumers wait: events */
    bool stop;
    /* guarded by mu */
    sched_req **in;            /* [n_in] submitted, not yet handed to the scheduler */
    int n_in, cap_in;
    uint64_t *ab;              /* [n_ab] ids to abort */
    int n_ab, cap_ab;
    uint64_t next_id;
    struct sched_sink def;     /* the engine's own sink (requests submitted without one); the
                                  others follow it in its next list */
    struct route *routes;      /* every request submitted and not finished */
    struct model_mtp_req *mtp_req; /* [max_num_seqs] method mtp: the drafts asked after a step; engine thread */
    char fatal[600];           /* non-empty once the backend cannot run another step */
    struct sched_engine_stats stats;
};

static double now_s(void)
{
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return (double)ts.tv_sec + ts.tv_nsec * 1e-9;
}

/* ---- event buffers -------------------------------------------------------------- */

void sched_evbuf_init(struct sched_evbuf *b) { memset(b, 0, sizeof *b); }

void sched_evbuf_deinit(struct sched_evbuf *b)
{
    if (!b) return;
    free(b->ev);
    free(b->text);
    memset(b, 0, sizeof *b);
}

/* Appends a copy of ev (its text into the arena, addressed by offset). */
static int evbuf_push(struct sched_evbuf *b, const struct sched_event *ev)
{
    if (b->n == b->cap) {
        int cap = b->cap ? 2 * b->cap : 256;
        struct sched_event *p = realloc(b->ev, (size_t)cap * sizeof *p);
        if (!p) return SL_ENOMEM;
        b->ev = p;
        b->cap = cap;
    }
    /* prompt logprobs go into the arena too, aligned, after the text */
    size_t plp_bytes = (size_t)ev->n_prompt_lp * sizeof *ev->prompt_lp, align = _Alignof(struct model_sample_out);
    size_t need = ev->text_len + 1 + (plp_bytes ? plp_bytes + align : 0);
    if (b->tlen + need > b->tcap) {
        size_t cap = b->tcap ? 2 * b->tcap : 16384;
        while (cap < b->tlen + need) cap *= 2;
        char *p = realloc(b->text, cap);
        if (!p) return SL_ENOMEM;
        b->text = p;
        b->tcap = cap;
    }
    struct sched_event *d = &b->ev[b->n++];
    *d = *ev;
    d->text_off = b->tlen;
    if (ev->text_len) memcpy(b->text + b->tlen, ev->text, ev->text_len);
    b->tlen += ev->text_len;
    b->text[b->tlen++] = '\0'; /* each event's text is NUL-terminated for convenience */
    d->text = NULL;
    d->prompt_lp = NULL;
    if (plp_bytes) {
        b->tlen = (b->tlen + align - 1) / align * align;
        d->plp_off = b->tlen;
        memcpy(b->text + b->tlen, ev->prompt_lp, plp_bytes);
        b->tlen += plp_bytes;
    }
    return 0;
}

static void route_unlink(sched_engine *e, struct route *r)
{
    if (r->prev) r->prev->next = r->next;
    else e->routes = r->next;
    if (r->next) r->next->prev = r->prev;
}

/* The engine thread's emit callback; called with e->mu held. The event goes
 * to its request's sink with the submitter's user pointer; the route ends
 * with the finish event. */
static void emit_locked(void *arg, const struct sched_event *ev)
{
    struct sched_engine *e = arg;
    struct route *r = ev->user;
    struct sched_event out = *ev;
    out.user = r->user;
    if (r->k) {
        if (evbuf_push(&r->k->pending, &out)) r->k->dropped = true;
        else r->k->posted = true;
    }
    if (ev->kind == SCHED_EV_FINISH) {
        route_unlink(e, r);
        free(r);
    }
}

/* ---- construction --------------------------------------------------------------- */

void sched_engine_defaults(const model *m, struct sched_engine_opts *o)
{
    struct sched_config *c = &o->sched;
    if (c->block_size <= 0) c->block_size = 16;
    if (c->max_num_seqs <= 0) c->max_num_seqs = 64;
    if (c->max_num_batched_tokens <= 0) c->max_num_batched_tokens = 1024;
    if (c->max_num_batched_tokens < c->max_num_seqs) c->max_num_batched_tokens = c->max_num_seqs;
    if (c->max_model_len <= 0) {
        int n = m ? model_get_config(m)->n_ctx_train : 0;
        c->max_model_len = n > 0 && n < 8192 ? n : 8192;
    }
    if (o->kv_cache_bytes == 0 && o->kv_blocks <= 0) o->kv_cache_bytes = (size_t)1 << 30;
}

/* The cost model's prior for model m on backend be: a token's multiply-adds
 * (the layers' projections) at a rate this kind of device surely reaches
 * (50 GFLOP/s on a CPU, 100 TFLOP/s on a GPU), so that the first steps are
 * planned short rather than long; the measured steps replace it within a
 * few steps. */
static void cost_prior(const model_backend *be, struct sched_config *c)
{
    const struct model_config *mc = be->m ? model_get_config(be->m) : NULL;
    bool gpu = be->ops && be->ops->name && !strcmp(be->ops->name, "cuda");
    if (c->prior_token_s <= 0.0 && mc) {
        double q = (double)mc->n_head * mc->head_dim, kv = (double)mc->n_head_kv * mc->head_dim, e = mc->n_embd;
        double flops = 2.0 * mc->n_layer * (e * (q + 2.0 * kv) + q * e + 3.0 * e * mc->n_ff);
        c->prior_token_s = flops / (gpu ? 100e12 : 50e9);
    }
    if (c->prior_pair_ratio <= 0.0 && mc) c->prior_pair_ratio = model_attn_pair_cost(mc);
    /* the GPU's GEMM tiles and waves: a 64K prompt in steps of 640 or 700
     * tokens took 7-17% longer than in steps of 512 on an H200; a CPU does not mind */
    if (c->step_granule == 0 && gpu) c->step_granule = 512;
}

static void *engine_main(void *arg);

/* How the KV budget is shared when the model has recurrent layers. */
struct state_plan {
    size_t bytes;     /* one state slot (0: no recurrent layers) */
    int seq, snap;    /* slots for running sequences; snapshot slots (the grid's are added once the blocks
                         are known) */
    int every;        /* blocks between grid snapshots */
    size_t kv_bytes;  /* what is left of the budget for the blocks and the grid's snapshots, as bytes of
                         blocks */
};

/* A state slot per running sequence comes off the budget first; with the
 * prefix cache, one snapshot per sequence for the end of its prompt, and one
 * per `every` blocks of the pool for the grid: each block is charged its
 * share of a snapshot. */
static int plan_states(model_backend *be, const struct sched_engine_opts *o, size_t block_bytes,
                       struct state_plan *st, char *err, size_t errlen)
{
    const struct model_config *mc = be->m ? model_get_config(be->m) : NULL;
    memset(st, 0, sizeof *st);
    st->kv_bytes = o->kv_cache_bytes;
    if (!mc || model_state_bytes(mc) == 0) return 0;
    st->bytes = be->ops->state_slot_bytes ? be->ops->state_slot_bytes(be) : 0;
    if (st->bytes == 0) {
        snprintf(err, errlen, "the %s backend does not run this model's recurrent (linear-attention) layers",
                 be->ops->name);
        return SL_EUNSUP;
    }
    int bs = o->sched.block_size;
    if (o->mamba_block_size < 0 || o->mamba_block_size % bs) {
        snprintf(err, errlen, "--mamba-block-size %d must be a positive multiple of --block-size %d (or 0: auto)",
                 o->mamba_block_size, bs);
        return SL_EINVAL;
    }
    st->every = o->mamba_block_size > 0 ? o->mamba_block_size / bs
                                        : (int)((st->bytes + block_bytes - 1) / (block_bytes ? block_bytes : 1));
    if (st->every < 1) st->every = 1;
    st->seq = o->sched.max_num_seqs;
    st->snap = o->enable_prefix_caching ? st->seq : 0;
    if (o->kv_blocks > 0) { /* an exact pool (tests): room for the grid of every block */
        if (o->enable_prefix_caching) st->snap += o->kv_blocks / st->every + 1;
        return 0;
    }
    size_t fixed = (size_t)(st->seq + st->snap) * st->bytes;
    if (fixed >= o->kv_cache_bytes) {
        snprintf(err, errlen,
                 "the recurrent state of %d sequences (--max-num-seqs%s, %.3g MiB each) does not fit the KV cache "
                 "budget of %.1f MiB: lower --max-num-seqs or raise --kv-cache-memory / --gpu-memory-utilization",
                 st->seq, o->enable_prefix_caching ? ", and as many prompt-end snapshots" : "",
                 st->bytes / 1048576.0, o->kv_cache_bytes / 1048576.0);
        return SL_EINVAL;
    }
    double per_block = (double)block_bytes + (o->enable_prefix_caching ? (double)st->bytes / st->every : 0.0);
    st->kv_bytes = (size_t)((double)(o->kv_cache_bytes - fixed) / per_block * (double)block_bytes);
    return 0;
}

sched_engine *sched_engine_create(model_backend *be, const struct sched_engine_opts *opts, char *err,
                                  size_t errlen)
{
    if (!be || !opts) {
        snprintf(err, errlen, "sched_engine_create: no backend or options");
        return NULL;
    }
    struct sched_engine_opts o = *opts;
    sched_engine_defaults(be->m, &o);
    const struct model_config *mc = be->m ? model_get_config(be->m) : NULL;
    if (mc && mc->n_ctx_train > 0 && o.sched.max_model_len > mc->n_ctx_train) {
        snprintf(err, errlen, "--max-model-len %d is larger than the model's context length %d",
                 o.sched.max_model_len, mc->n_ctx_train);
        return NULL;
    }
    const struct sched_spec_config *sp = &o.sched.spec;
    if (sp->method == SCHED_SPEC_MTP && mc && model_state_bytes(mc) > 0) {
        snprintf(err, errlen, "--speculative-config: method mtp is not supported for models with linear-attention "
                              "(KDA) layers (no reference models their MTP layer); method ngram is");
        return NULL;
    }
    if (sp->method != SCHED_SPEC_NONE && mc && model_state_bytes(mc) > 0 && !be->state_rollback) {
        /* a rejected draft would leave the recurrent state past the last accepted token */
        snprintf(err, errlen, "--speculative-config: the %s backend does not roll a linear-attention (KDA) layer's "
                              "state back to the last accepted draft, so it cannot verify drafts on this model "
                              "(the cpu and cuda backends do)", be->ops->name);
        return NULL;
    }
    if (sp->method == SCHED_SPEC_MTP && (!mc || mc->n_mtp_layer <= 0)) {
        snprintf(err, errlen, "--speculative-config: method mtp needs a model with MTP layers "
                              "(num_nextn_predict_layers > 0); this one has none (method ngram drafts for any model)");
        return NULL;
    }
    if (sp->method == SCHED_SPEC_MTP && (!be->has_mtp || !be->ops->mtp_draft)) {
        snprintf(err, errlen, "--speculative-config: method mtp: the %s backend %s", be->ops->name,
                 be->ops->mtp_draft ? "was created without the MTP layer (model_backend_opts.mtp)"
                                    : "does not run the MTP layer (method ngram drafts on any backend that verifies)");
        return NULL;
    }
    if (sp->method != SCHED_SPEC_NONE && be->max_draft_tokens < sp->num_speculative_tokens) {
        snprintf(err, errlen, "--speculative-config: the %s backend verifies %d drafts a sequence, not %d "
                              "(speculative decoding runs on the CPU backend)",
                 be->ops->name, be->max_draft_tokens, sp->num_speculative_tokens);
        return NULL;
    }
    struct sched_engine *e = calloc(1, sizeof *e);
    if (!e) {
        snprintf(err, errlen, "out of memory");
        return NULL;
    }
    e->be = be;
    cost_prior(be, &o.sched);
    e->cfg = o.sched;
    e->def.e = e;
    e->def.notify = o.notify;
    e->def.notify_arg = o.notify_arg;
    int bs = o.sched.block_size;
    size_t block_bytes = be->ops->kv_block_bytes(be, bs);
    struct state_plan st;
    if (plan_states(be, &o, block_bytes, &st, err, errlen)) goto fail_e;
    e->kv_blocks = o.kv_blocks > 0 ? o.kv_blocks : kv_blocks_for_bytes(st.kv_bytes, block_bytes);
    if (st.bytes > 0 && o.enable_prefix_caching && o.kv_blocks <= 0) st.snap += e->kv_blocks / st.every;
    if ((long)e->kv_blocks * bs < o.sched.max_model_len) {
        snprintf(err, errlen,
                 "the KV cache (%zu bytes, %zu per block of %d tokens) holds %ld tokens, fewer than "
                 "--max-model-len %d: the largest --max-model-len that fits is %ld (or raise "
                 "--kv-cache-memory / --gpu-memory-utilization)",
                 o.kv_blocks > 0 ? (size_t)o.kv_blocks * block_bytes : st.kv_bytes, block_bytes, bs,
                 (long)e->kv_blocks * bs, o.sched.max_model_len, (long)e->kv_blocks * bs);
        goto fail_e;
    }
    if (be->ops->kv_alloc(be, e->kv_blocks, bs, err, errlen)) goto fail_e;
    e->pool = kv_pool_create(e->kv_blocks, bs, o.enable_prefix_caching, err, errlen);
    if (!e->pool) goto fail_e;
    if (st.bytes > 0 && (be->ops->state_alloc(be, st.seq + st.snap, err, errlen) ||
                         kv_pool_set_states(e->pool, st.seq, st.snap, st.every, err, errlen)))
        goto fail_pool;
    e->s = sched_create(&e->cfg, e->pool, be->m ? model_get_tok(be->m) : NULL, err, errlen);
    if (!e->s) goto fail_pool;
    if (sp->method == SCHED_SPEC_MTP && !(e->mtp_req = calloc((size_t)e->cfg.max_num_seqs, sizeof *e->mtp_req))) {
        snprintf(err, errlen, "out of memory");
        goto fail_sched;
    }
    if (o.drafter && sp->method != SCHED_SPEC_NONE) sched_set_drafter(e->s, o.drafter);
    sched_evbuf_init(&e->def.pending);
    sched_get_stats(e->s, &e->stats.sched); /* the cost model's prior, before the first step */
    e->stats.max_model_len = e->cfg.max_model_len;
    e->stats.block_size = bs;
    e->stats.kv_blocks = e->kv_blocks;
    e->stats.state_bytes = st.bytes;
    e->stats.state_slots = st.seq;
    e->stats.snap_slots = st.snap;
    e->stats.snap_every = st.snap ? st.every * bs : 0;
    e->stats.spec_state_bytes = st.bytes > 0 ? be->spec_state_bytes : 0;
    kv_pool_stats(e->pool, &e->stats.kv);
    if (pthread_mutex_init(&e->mu, NULL)) goto fail_sched;
    if (pthread_cond_init(&e->work_cv, NULL)) goto fail_mu;
    if (pthread_cond_init(&e->ev_cv, NULL)) goto fail_work;
    if (pthread_create(&e->th, NULL, engine_main, e)) {
        snprintf(err, errlen, "cannot start the engine thread");
        goto fail_ev;
    }
    return e;

fail_ev:
    pthread_cond_destroy(&e->ev_cv);
fail_work:
    pthread_cond_destroy(&e->work_cv);
fail_mu:
    pthread_mutex_destroy(&e->mu);
fail_sched:
    free(e->mtp_req);
    sched_destroy(e->s);
fail_pool:
    kv_pool_destroy(e->pool);
fail_e:
    free(e);
    return NULL;
}

const struct sched_config *sched_engine_config(const sched_engine *e) { return &e->cfg; }

/* ---- the step loop ----------------------------------------------------------------- */

/* With e->mu held, after events were posted: the stats snapshot refreshed
 * (a consumer that reads it after a finish event sees the blocks released),
 * waiters woken and the notifier of each sink that got events poked (under
 * the lock, so a sink cannot go away meanwhile); e->mu released. */
static void publish_unlock(sched_engine *e)
{
    sched_get_stats(e->s, &e->stats.sched);
    kv_pool_stats(e->pool, &e->stats.kv);
    bool posted = false;
    for (struct sched_sink *k = &e->def; k; k = k->next) {
        if (!k->posted) continue;
        k->posted = false;
        posted = true;
        if (k->notify) k->notify(k->notify_arg);
    }
    if (posted) pthread_cond_broadcast(&e->ev_cv);
    pthread_mutex_unlock(&e->mu);
}

/* Method mtp: the drafts of the sequences of the step just run, made by the
 * backend's MTP layer from that step's hidden states (so before the next
 * step), outside the lock. A failure leaves those sequences without drafts:
 * the tokens they verify next are the model's either way. */
static void make_drafts(sched_engine *e)
{
    struct sched_draft_want *w;
    int n = sched_draft_wants(e->s, &w);
    if (n <= 0) return;
    for (int i = 0; i < n; i++)
        e->mtp_req[i] = (struct model_mtp_req){.seq = w[i].seq, .pos = w[i].pos, .token = w[i].token, .k = w[i].k,
                                               .block_table = w[i].block_table, .n_blocks = w[i].n_blocks,
                                               .drafts = w[i].drafts};
    char err[256];
    if (e->be->ops->mtp_draft(e->be, e->mtp_req, n, err, sizeof err) == 0)
        for (int i = 0; i < n; i++) w[i].n_made = w[i].k;
}

static void *engine_main(void *arg)
{
    struct sched_engine *e = arg;
    sched_req **in = NULL;
    int n_in = 0, cap_in = 0;
    uint64_t *ab = NULL;
    int n_ab = 0, cap_ab = 0;
    struct step st;
    char err[256];
    bool idle_spin = false;

    for (;;) {
        pthread_mutex_lock(&e->mu);
        while (!e->stop && e->n_in == 0 && e->n_ab == 0 && (!sched_has_work(e->s) || idle_spin)) {
            if (idle_spin) {
                /* work that cannot be planned now (should not happen): poll, don't spin */
                struct timespec ts;
                clock_gettime(CLOCK_REALTIME, &ts);
                ts.tv_nsec += 10 * 1000 * 1000;
                if (ts.tv_nsec >= 1000000000L) ts.tv_sec++, ts.tv_nsec -= 1000000000L;
                pthread_cond_timedwait(&e->work_cv, &e->mu, &ts);
                idle_spin = false;
                continue;
            }
            pthread_cond_wait(&e->work_cv, &e->mu);
        }
        if (e->stop) {
            pthread_mutex_unlock(&e->mu);
            break;
        }
        /* take the inbox by swapping arrays */
        sched_req **ti = in; in = e->in; e->in = ti;
        int tc = cap_in; cap_in = e->cap_in; e->cap_in = tc;
        n_in = e->n_in; e->n_in = 0;
        uint64_t *ta = ab; ab = e->ab; e->ab = ta;
        tc = cap_ab; cap_ab = e->cap_ab; e->cap_ab = tc;
        n_ab = e->n_ab; e->n_ab = 0;
        pthread_mutex_unlock(&e->mu);

        for (int i = 0; i < n_in; i++) sched_add(e->s, in[i]);
        if (n_ab) {
            pthread_mutex_lock(&e->mu);
            for (int i = 0; i < n_ab; i++) sched_abort(e->s, ab[i], emit_locked, e);
            publish_unlock(e);
        }

        double t0 = now_s();
        int n = sched_plan_step(e->s, &st);
        int rc = n > 0 ? e->be->ops->forward(e->be, &st, err, sizeof err) : 0;
        idle_spin = n == 0;

        pthread_mutex_lock(&e->mu);
        if (rc && e->be->fatal && !e->fatal[0]) snprintf(e->fatal, sizeof e->fatal, "%s", e->be->fatal);
        if (n > 0) {
            /* after a fatal error every later step fails at once too, so all
             * requests drain with an error event and no consumer waits forever */
            if (rc) {
                sched_fail_step(e->s, &st, err, emit_locked, e);
            } else {
                sched_complete_step(e->s, &st, emit_locked, e);
                /* the whole step as a chat sees it: planning, forward, sampling, detokenizing (and
                 * below, the MTP drafts it needs) */
                if (!e->mtp_req) sched_step_timed(e->s, now_s() - t0);
            }
        }
        publish_unlock(e);
        if (n > 0 && !rc && e->mtp_req) {
            make_drafts(e);
            sched_step_timed(e->s, now_s() - t0);
        }
    }
    free(in);
    free(ab);
    return NULL;
}

/* ---- inbox ------------------------------------------------------------------------- */

int sched_engine_submit(sched_engine *e, const struct sched_request *r, uint64_t *id, char *err,
                        size_t errlen)
{
    struct route *rt = malloc(sizeof *rt);
    if (!rt) {
        snprintf(err, errlen, "out of memory queueing the request");
        return SL_ENOMEM;
    }
    rt->k = r->sink ? r->sink : &e->def;
    rt->user = r->user;
    struct sched_request routed = *r;
    routed.user = rt;
    uint64_t nid = __atomic_add_fetch(&e->next_id, 1, __ATOMIC_RELAXED);
    sched_req *q = sched_req_create(e->s, &routed, nid, err, errlen);
    if (!q) {
        free(rt);
        return SL_EINVAL;
    }
    pthread_mutex_lock(&e->mu);
    if (e->fatal[0]) {
        snprintf(err, errlen, "%s", e->fatal);
        pthread_mutex_unlock(&e->mu);
        sched_req_free(q);
        free(rt);
        return SL_EDEVICE;
    }
    if (e->n_in == e->cap_in) {
        int cap = e->cap_in ? 2 * e->cap_in : 64;
        sched_req **p = realloc(e->in, (size_t)cap * sizeof *p);
        if (!p) {
            pthread_mutex_unlock(&e->mu);
            sched_req_free(q);
            free(rt);
            snprintf(err, errlen, "out of memory queueing the request");
            return SL_ENOMEM;
        }
        e->in = p;
        e->cap_in = cap;
    }
    e->in[e->n_in++] = q;
    rt->prev = NULL;
    rt->next = e->routes;
    if (e->routes) e->routes->prev = rt;
    e->routes = rt;
    pthread_cond_signal(&e->work_cv);
    pthread_mutex_unlock(&e->mu);
    if (id) *id = nid;
    return 0;
}

void sched_engine_abort(sched_engine *e, uint64_t id)
{
    pthread_mutex_lock(&e->mu);
    if (e->n_ab == e->cap_ab) {
        int cap = e->cap_ab ? 2 * e->cap_ab : 64;
        uint64_t *p = realloc(e->ab, (size_t)cap * sizeof *p);
        if (!p) { /* the request simply runs to its end */
            pthread_mutex_unlock(&e->mu);
            return;
        }
        e->ab = p;
        e->cap_ab = cap;
    }
    e->ab[e->n_ab++] = id;
    pthread_cond_signal(&e->work_cv);
    pthread_mutex_unlock(&e->mu);
}

/* ---- outboxes ---------------------------------------------------------------------- */

sched_sink *sched_sink_create(sched_engine *e, void (*notify)(void *arg), void *arg)
{
    struct sched_sink *k = calloc(1, sizeof *k);
    if (!k) return NULL;
    k->e = e;
    k->notify = notify;
    k->notify_arg = arg;
    sched_evbuf_init(&k->pending);
    pthread_mutex_lock(&e->mu);
    k->next = e->def.next;
    e->def.next = k;
    pthread_mutex_unlock(&e->mu);
    return k;
}

void sched_sink_destroy(sched_sink *k)
{
    if (!k) return;
    sched_engine *e = k->e;
    pthread_mutex_lock(&e->mu);
    for (struct sched_sink **p = &e->def.next; *p; p = &(*p)->next)
        if (*p == k) {
            *p = k->next;
            break;
        }
    for (struct route *r = e->routes; r; r = r->next)
        if (r->k == k) r->k = NULL;
    pthread_mutex_unlock(&e->mu);
    sched_evbuf_deinit(&k->pending);
    free(k);
}

/* With e->mu held: hands k's pending events to b. */
static int take_locked(struct sched_sink *k, struct sched_evbuf *b)
{
    b->n = 0;
    b->tlen = 0;
    struct sched_evbuf t = *b;
    *b = k->pending;
    k->pending = t;
    for (int i = 0; i < b->n; i++) {
        b->ev[i].text = b->text + b->ev[i].text_off;
        if (b->ev[i].n_prompt_lp) b->ev[i].prompt_lp = (const struct model_sample_out *)(b->text + b->ev[i].plp_off);
    }
    return b->n;
}

int sched_sink_poll(sched_sink *k, struct sched_evbuf *b)
{
    pthread_mutex_lock(&k->e->mu);
    int n = take_locked(k, b);
    pthread_mutex_unlock(&k->e->mu);
    return n;
}

int sched_sink_wait(sched_sink *k, struct sched_evbuf *b, double timeout_s)
{
    sched_engine *e = k->e;
    pthread_mutex_lock(&e->mu);
    if (timeout_s < 0) {
        while (k->pending.n == 0) pthread_cond_wait(&e->ev_cv, &e->mu);
    } else {
        struct timespec ts;
        clock_gettime(CLOCK_REALTIME, &ts);
        long long ns = (long long)ts.tv_nsec + (long long)(timeout_s * 1e9);
        ts.tv_sec += (time_t)(ns / 1000000000LL);
        ts.tv_nsec = (long)(ns % 1000000000LL);
        while (k->pending.n == 0)
            if (pthread_cond_timedwait(&e->ev_cv, &e->mu, &ts) == ETIMEDOUT) break;
    }
    int n = take_locked(k, b);
    pthread_mutex_unlock(&e->mu);
    return n;
}

int sched_engine_poll(sched_engine *e, struct sched_evbuf *b) { return sched_sink_poll(&e->def, b); }

int sched_engine_wait(sched_engine *e, struct sched_evbuf *b, double timeout_s)
{
    return sched_sink_wait(&e->def, b, timeout_s);
}

void sched_engine_get_stats(sched_engine *e, struct sched_engine_stats *st)
{
    pthread_mutex_lock(&e->mu);
    *st = e->stats;
    pthread_mutex_unlock(&e->mu);
}

bool sched_engine_fatal(sched_engine *e, char *msg, size_t msglen)
{
    pthread_mutex_lock(&e->mu);
    bool f = e->fatal[0] != 0;
    if (f && msg && msglen) snprintf(msg, msglen, "%s", e->fatal);
    pthread_mutex_unlock(&e->mu);
    return f;
}

/* ---- teardown ---------------------------------------------------------------------- */

void sched_engine_destroy(sched_engine *e)
{
    if (!e) return;
    pthread_mutex_lock(&e->mu);
    e->stop = true;
    pthread_cond_signal(&e->work_cv);
    pthread_mutex_unlock(&e->mu);
    pthread_join(e->th, NULL);
    for (int i = 0; i < e->n_in; i++) sched_req_free(e->in[i]);
    free(e->in);
    free(e->ab);
    sched_destroy(e->s);
    kv_pool_destroy(e->pool);
    free(e->mtp_req);
    for (struct route *r = e->routes, *nx; r; r = nx) { /* requests dropped without their finish */
        nx = r->next;
        free(r);
    }
    sched_evbuf_deinit(&e->def.pending);
    pthread_cond_destroy(&e->ev_cv);
    pthread_cond_destroy(&e->work_cv);
    pthread_mutex_destroy(&e->mu);
    free(e);
}

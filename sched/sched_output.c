/* sched_output.c - processing a step's output: every sequence advanced,
 * computed blocks committed to the prefix cache, sampled tokens appended,
 * detokenized and checked against the stop conditions, events emitted, and
 * the finished requests freed.
 */
#include <limits.h>
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

#include "sched_internal.h"

/* ---- after the step --------------------------------------------------------------- */

static void fill_usage(const sched_req *q, struct sched_usage *u)
{
    double now = sched_now_s();
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
void sched_finish_req(sched *s, sched_req *q, enum sched_finish why, const char *text, size_t len,
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
    if (s->drafter.release) s->drafter.release(s->drafter.arg, q->id);
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
    sched_finish_req(s, q, why, s->text, n, NULL, emit, arg);
}

/* Drops finished requests from the running array and frees them. */
static void sweep(sched *s)
{
    int j = 0;
    for (int i = 0; i < s->n_run; i++) {
        sched_req *q = s->run[i];
        if (q->finished) sched_req_release(s->pool, q);
        else s->run[j++] = q;
    }
    s->n_run = j;
}

/* A verification of q's drafts: the KV of its last sampled token and of the
 * accepted drafts stays (the rejected positions' slots are written again
 * later), and the tokens are taken one by one as a decode takes its one, so
 * a stop string, a stop id or max_tokens ends the output at the exact token
 * and the tokens after it are dropped. */
static void complete_verify(sched *s, sched_req *q, const struct step_seq *ss, double now, sched_emit_fn emit,
                            void *arg)
{
    int n = ss->n_spec_out, a = n - 1;
    SL_ASSERT(n >= 1 && n <= ss->n_draft + 1);
    q->n_computed += 1 + a;
    if (s->prefix_cache) kv_seq_commit(s->pool, &q->kv, q->tokens, q->n_computed);
    sched_spec_verified(s, ss->n_draft, a);
    if (s->drafter.accepted) s->drafter.accepted(s->drafter.arg, q->id, ss->n_draft, a);
    for (int j = 0; j < n && !q->finished; j++) {
        if (ss->spec_out[j].token < 0) {
            sched_finish_req(s, q, SCHED_FINISH_ERROR, NULL, 0,
                             "could not sample a token: the logits of this request are not finite", emit, arg);
            break;
        }
        on_token(s, q, &ss->spec_out[j], now, emit, arg);
    }
}

/* Method mtp: q (index i in the step) goes on decoding; list what its
 * drafts after this step need, its blocks reserved for them. */
static void want_drafts(sched *s, sched_req *q, int i)
{
    int k = sched_spec_room(s, q, 0), p = q->n_computed - 1;
    q->n_made = 0;
    q->made_at = -1;
    while (k > 0 && kv_seq_reserve(s->pool, &q->kv, p + k + 1) != 0) k--;
    if (k == 0 && kv_seq_reserve(s->pool, &q->kv, p + 2) != 0) return;
    struct sched_draft_want *w = &s->wants[s->n_wants++];
    *w = (struct sched_draft_want){.id = q->id, .seq = i, .pos = p, .token = q->tokens[p + 1], .k = k,
                                   .block_table = q->kv.blocks, .n_blocks = q->kv.n_blocks, .drafts = q->made};
    q->made_at = q->n_tokens;
}

int sched_draft_wants(sched *s, struct sched_draft_want **w)
{
    *w = s->wants;
    return s->n_wants;
}

void sched_complete_step(sched *s, struct step *st, sched_emit_fn emit, void *arg)
{
    double now = sched_now_s();
    for (int i = 0; i < s->n_step_seqs; i++) {
        sched_req *q = s->step_req[i];
        const struct step_seq *ss = &st->seqs[i];
        q->in_step = false;
        if (ss->n_draft > 0) {
            complete_verify(s, q, ss, now, emit, arg);
            if (s->cfg.spec.method == SCHED_SPEC_MTP && !q->finished) want_drafts(s, q, i);
            continue;
        }
        if (ss->want_sample && s->drafter.accepted) s->drafter.accepted(s->drafter.arg, q->id, 0, 0);
        q->n_computed += ss->query_len;
        if (s->prefix_cache) kv_seq_commit(s->pool, &q->kv, q->tokens, q->n_computed);
        if (ss->want_sample && ss->out.token < 0) /* this request alone: the others go on */
            sched_finish_req(s, q, SCHED_FINISH_ERROR, NULL, 0, "could not sample a token: the logits of this request are not finite",
                   emit, arg);
        else if (ss->want_sample)
            on_token(s, q, &ss->out, now, emit, arg);
        if (ss->want_sample && s->cfg.spec.method == SCHED_SPEC_MTP && !q->finished) want_drafts(s, q, i);
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
        sched_finish_req(s, q, SCHED_FINISH_ERROR, NULL, 0, msg, emit, arg);
    }
    s->n_step_seqs = 0;
    sweep(s);
}


/* server_batch.c - the OpenAI Files and Batch APIs of `sluice serve`, the
 * store thread, and the feeder that moves batch rows between the store and
 * the engine (DESIGN.md, "Threads" and "Batch jobs"; store/store.h says how
 * the store must be used).
 *
 * Threads and who owns what:
 *
 *   api thread    parses every /v1/files and /v1/batches request. Reads (GET
 *                 of a file, a batch, a listing, a file's content) run right
 *                 there on a *reader* handle: SQLite in WAL mode never makes a
 *                 reader wait for the writer. Every change (file create and
 *                 delete, batch create and cancel) becomes a `struct call`
 *                 queued to the store thread; the api thread answers it when
 *                 the store thread hands it back (reply queue + event_active).
 *                 An upload's file part is moved out of libevent's input
 *                 buffer into a buffer of its own (evbuffer_remove_buffer
 *                 hands over the chunks: the body is never copied a second
 *                 time in memory); the store thread writes it into a file the
 *                 store names and records (store_file_write()).
 *                 Engine events of batch rows never reach it.
 *   store thread  owns the *writer* handle: nothing else writes SQLite. It
 *                 runs the queued calls, renders finished rows and writes
 *                 their results with store_complete_rows() in one transaction
 *                 every FLUSH_S seconds or FLUSH_N results (each waiting
 *                 result owns its strings, so the queue may grow while a
 *                 flush is retried), calls store_tick()
 *                 every second, and feeds the engine: while fewer than
 *                 `low` batch rows are in flight it claims up to `high - in
 *                 flight` pending rows, parses and tokenizes them and submits
 *                 them (api/batch_line.c, as run-batch does) at SCHED_PRIO_BATCH (high = 2 x max_num_seqs: the
 *                 scheduler makes room for chat, see feed(); a 50,000-line batch
 *                 is never in memory). The rows' engine events go to its own
 *                 sink (sched_sink_create), whose notifier wakes this thread:
 *                 it folds them into the rows' results and renders a row
 *                 when its last choice finishes, without the api thread. It
 *                 owns the rows in flight (the `inflight` list): it creates
 *                 them, updates them and frees them.
 *                 A cancelled or expired batch's rows still in the engine are
 *                 aborted with sched_engine_abort().
 *
 * Crash safety comes from the store: a result is committed with its row's
 * state; rows claimed but not committed go back to pending at the next start
 * and run again (greedy requests give the same result).
 *
 * When the store cannot write (a full disk, an I/O error, SQLITE_BUSY past
 * the timeout) results wait in memory and the write is retried every
 * RETRY_S; the feeder claims no new rows while writes fail or while
 * wait_max results wait, so what waits is bounded by wait_max plus the rows
 * in flight, and the engine gets no more batch work. Once a write succeeds
 * the batch goes on where it was; every row is still written exactly once
 * (store_complete_rows() is idempotent). /health and /metrics report it
 * (srv_batch_health_json(), srv_batch_metrics()).
 */
#include <errno.h>
#include <event2/buffer.h>
#include <event2/event.h>
#include <event2/http.h>
#include <event2/keyvalq_struct.h>
#include <fcntl.h>
#include <pthread.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <strings.h>
#include <sys/queue.h>
#include <time.h>
#include <unistd.h>

#include "api/batch_line.h"
#include "openai.h"
#include "server.h"
#include "store/store.h"

#define FLUSH_S 0.1   /* results wait at most this long before they are written */
#define FLUSH_N 64    /* ... or until this many are waiting */
#define TICK_S 1.0    /* store_tick() period */
#define RETRY_S 1.0   /* a failed store write is retried this often */
#define LOG_EVERY_S 30.0 /* a store that keeps failing is reported this often */
#define MAX_PART_HEADERS 16384

/* ---- types ---------------------------------------------------------------------------------- */

enum op { OP_FILE_CREATE, OP_FILE_DELETE, OP_BATCH_CREATE, OP_BATCH_CANCEL };

/* A change asked by the api thread, run by the store thread, answered by
 * the api thread. */
struct call {
    enum op op;
    struct evhttp_request *req;    /* api thread only; NULL once the client went away */
    struct evhttp_connection *con; /* api thread only */
    char *arg[4];                  /* owned: the op's strings (NULL when absent) */
    struct evbuffer *content;      /* owned: OP_FILE_CREATE's file content */
    int rc;                        /* store thread: the store's status */
    char err[512];
    struct json_buf out;           /* store thread: the 200 body */
    struct call *next;
};

/* One batch row in the engine: store thread only. */
struct job {
    int64_t row_id;
    char batch_id[STORE_ID_MAX];
    struct bline l;                /* l.owner: the job */
    struct job *prev, *next;       /* inflight list */
};

/* A rendered result waiting for store_complete_rows(). It owns everything
 * it points to: the queue of them may be reallocated while results wait, so
 * the store_result array handed to the store is built from it at each flush
 * and points into it only for the length of that call. */
struct out {
    int64_t row_id;
    int status;                    /* HTTP status of the response, 0: none */
    const char *code;              /* static error code, NULL: none */
    bool cancelled;                /* stopped by the batch's cancel */
    char *body;                    /* owned JSON text, NULL: none */
    char *msg;                     /* owned error message, NULL: none */
    char rid[40];
};

/* What kept failing: store writes of results, claims, housekeeping. */
enum { FAIL_RESULTS = 1, FAIL_CLAIM = 2, FAIL_TICK = 4 };

struct srv_batch {
    struct server *srv;
    store *w;                      /* writer: store thread only */
    store *r;                      /* reader: api thread only */
    pthread_t thread;
    bool started;
    struct event *reply_ev;        /* store thread -> api thread */

    pthread_mutex_t mu;            /* guards the two queues, stop and events */
    pthread_cond_t cv;
    bool stop;
    bool events;                   /* engine -> store: the sink has events */
    struct call *calls, *calls_tail; /* api -> store */
    struct call *replies, *replies_tail; /* store -> api */

    /* store thread only */
    sched_sink *sink;              /* the rows' engine events, created once the engine is ready */
    struct bline_env env;          /* the rows' engine, sink, tokenizer, names */
    struct sched_evbuf evbuf;
    bool engine_dead;              /* the backend failed for good: nothing more is recorded */
    struct job *inflight;
    int n_inflight, low, high;
    bool pending_hint;             /* pending rows may exist: worth a claim */
    struct out *outs;              /* results waiting to be written [n_res] */
    int n_res, cap_res;
    struct store_result *res;      /* flush scratch [cap_res], rebuilt from outs */
    int wait_max;                  /* no claims while this many results wait */
    double t_first_res;            /* when the oldest waiting result came */
    double t_retry;                /* failing: the next write attempt */
    double t_fail_since, t_fail_log;
    int fail_mask;                 /* FAIL_* */
    uint64_t rng;

    /* read by the api thread (/health, /metrics) */
    atomic_int st_fail_mask;
    atomic_int st_waiting;
    atomic_int st_inflight;        /* n_inflight, for /metrics */
    atomic_ullong st_write_errors;
    char st_error[256];            /* the last store error, under mu */
};

/* ---- small helpers --------------------------------------------------------------------------- */

static int http_status(int rc)
{
    switch (rc) {
    case STORE_ENOTFOUND: return 404;
    case SL_EINVAL: case STORE_ELIMIT: case STORE_ECONFLICT: return 400;
    default: return 500;
    }
}

static void reply_store_error(struct evhttp_request *req, int rc, const char *err)
{
    int code = http_status(rc);
    srv_reply_error(req, code, code == 500 ? "server_error" : "invalid_request_error", NULL, "%s",
                    err && *err ? err : "store error");
}

static void call_free(struct call *c)
{
    if (!c) return;
    for (int i = 0; i < 4; i++) free(c->arg[i]);
    if (c->content) evbuffer_free(c->content);
    json_buf_free(&c->out);
    free(c);
}

static void job_free(struct job *j)
{
    if (!j) return;
    bline_free(&j->l);
    free(j);
}

/* ---- store thread: results ---------------------------------------------------------------- */

static int res_reserve(struct srv_batch *b)
{
    if (b->n_res < b->cap_res) return 0;
    int cap = b->cap_res ? 2 * b->cap_res : 128;
    struct out *o = realloc(b->outs, sizeof *o * (size_t)cap);
    if (!o) return SL_ENOMEM;
    b->outs = o;
    struct store_result *r = realloc(b->res, sizeof *r * (size_t)cap);
    if (!r) return SL_ENOMEM;
    b->res = r;
    b->cap_res = cap;
    return 0;
}

/* Queues a row's result. body and msg: owned JSON text / message, or NULL;
 * code: a static string or NULL. Returns the queued entry (owned by the
 * queue), or NULL when out of memory: the row then stays running and the
 * next start runs it again. */
static struct out *add_result(struct srv_batch *b, int64_t row_id, int status, char *body, const char *code,
                              char *msg)
{
    if (res_reserve(b)) {
        fprintf(stderr, "sluice serve: out of memory queueing a batch result\n");
        free(body);
        free(msg);
        return NULL;
    }
    if (b->n_res == 0) b->t_first_res = srv_now();
    struct out *o = &b->outs[b->n_res++];
    memset(o, 0, sizeof *o);
    o->row_id = row_id;
    o->status = status;
    o->code = code;
    o->body = body;
    o->msg = msg;
    memcpy(o->rid, "req_", 4);
    bline_rand_hex(&b->rng, o->rid + 4, 24);
    atomic_store(&b->st_waiting, b->n_res);
    return o;
}

/* An HTTP error response for a row whose body the server refuses. */
static void add_error_response(struct srv_batch *b, int64_t row_id, const struct api_oai_error *e)
{
    struct json_buf j;
    json_buf_init(&j);
    api_oai_error_json(&j, e);
    if (j.oom) {
        json_buf_free(&j);
        return;
    }
    add_result(b, row_id, e->status, j.p, NULL, NULL);
}

/* Records whether a kind of store write (FAIL_*) failed, for /health and
 * /metrics and the log: the first failure and then one line every
 * LOG_EVERY_S while it lasts, and the recovery. */
static void store_status(struct srv_batch *b, int what, bool failed, const char *err)
{
    double now = srv_now();
    int was = b->fail_mask;
    if (failed) {
        b->fail_mask |= what;
        atomic_fetch_add(&b->st_write_errors, 1);
        pthread_mutex_lock(&b->mu);
        snprintf(b->st_error, sizeof b->st_error, "%s", err);
        pthread_mutex_unlock(&b->mu);
        if (!was) b->t_fail_since = now;
        if (!was || now - b->t_fail_log >= LOG_EVERY_S) {
            fprintf(stderr,
                    "sluice serve: the batch store cannot write (%d results waiting; retried every %.0f s, no new "
                    "batch work meanwhile): %s\n",
                    b->n_res, RETRY_S, err);
            b->t_fail_log = now;
        }
    } else {
        b->fail_mask &= ~what;
        if (was && !b->fail_mask)
            fprintf(stderr, "sluice serve: the batch store writes again (it failed for %.1f s); batch work resumes\n",
                    now - b->t_fail_since);
    }
    atomic_store(&b->st_fail_mask, b->fail_mask);
}

/* Whether the waiting results should be written now. */
static bool flush_due(const struct srv_batch *b, double now)
{
    if (!b->n_res) return false;
    if (b->fail_mask & FAIL_RESULTS) return now >= b->t_retry;
    return b->n_res >= FLUSH_N || now - b->t_first_res >= FLUSH_S;
}

/* Writes the queued results in one transaction. On a store error they are
 * kept, nothing is written, and the write is tried again after RETRY_S. */
static void flush_results(struct srv_batch *b)
{
    if (!b->n_res) return;
    for (int i = 0; i < b->n_res; i++) {
        const struct out *o = &b->outs[i];
        b->res[i] = (struct store_result){
            .row_id = o->row_id, .status_code = o->status, .request_id = o->status ? o->rid : NULL,
            .body = o->body, .error_code = o->code, .error_message = o->msg, .cancelled = o->cancelled,
        };
    }
    char err[512];
    int rc = store_complete_rows(b->w, b->res, b->n_res, err, sizeof err);
    if (rc < 0) {
        b->t_retry = srv_now() + RETRY_S;
        store_status(b, FAIL_RESULTS, true, err);
        return;
    }
    for (int i = 0; i < b->n_res; i++) {
        free(b->outs[i].body);
        free(b->outs[i].msg);
    }
    b->n_res = 0;
    atomic_store(&b->st_waiting, 0);
    store_status(b, FAIL_RESULTS, false, NULL);
}

/* Renders a row the engine finished. */
static void finish_job(struct srv_batch *b, struct job *j)
{
    struct json_buf body;
    int status = bline_reply(&j->l, &b->env, &b->rng, (long)time(NULL), &body);
    if (status == 0) {
        /* only a cancel or an expiry stops a row; an expired row is dropped
         * by the store whatever this says */
        struct out *o = add_result(b, j->row_id, 0, NULL, NULL, NULL);
        if (o) o->cancelled = true;
        json_buf_free(&body);
    } else if (body.oom) { /* the row stays running: the next start runs it again */
        fprintf(stderr, "sluice serve: out of memory rendering a batch result\n");
        json_buf_free(&body);
    } else {
        add_result(b, j->row_id, status, body.p, NULL, NULL);
    }
}

/* ---- store thread: feeding ---------------------------------------------------------------- */

static void inflight_add(struct srv_batch *b, struct job *j)
{
    j->prev = NULL;
    j->next = b->inflight;
    if (b->inflight) b->inflight->prev = j;
    b->inflight = j;
    b->n_inflight++;
    atomic_store(&b->st_inflight, b->n_inflight);
}

static void inflight_remove(struct srv_batch *b, struct job *j)
{
    if (j->prev) j->prev->next = j->next;
    else b->inflight = j->next;
    if (j->next) j->next->prev = j->prev;
    b->n_inflight--;
    atomic_store(&b->st_inflight, b->n_inflight);
}

/* Parses, tokenizes and submits one claimed row; a row the server refuses
 * gets its error response right away. */
static void submit_row(struct srv_batch *b, const struct store_row *row)
{
    struct api_oai_error e;
    struct job *j = calloc(1, sizeof *j);
    if (!j) {
        api_oai_errorf(&e, 500, NULL, "out of memory");
        e.type = "server_error";
        add_error_response(b, row->row_id, &e);
        return;
    }
    j->row_id = row->row_id;
    snprintf(j->batch_id, sizeof j->batch_id, "%s", row->batch_id);
    j->l.owner = j;
    if (bline_start(&j->l, &b->env, row->url, row->body, row->body_len, &e)) {
        add_error_response(b, row->row_id, &e);
        job_free(j);
        return;
    }
    inflight_add(b, j);
}

/* The engine's notifier for the rows' sink (engine thread, its lock held). */
static void on_engine_events(void *arg)
{
    struct srv_batch *b = arg;
    pthread_mutex_lock(&b->mu);
    b->events = true;
    pthread_cond_signal(&b->cv);
    pthread_mutex_unlock(&b->mu);
}

/* Folds the rows' engine events into their results; a row whose last choice
 * finished is rendered and queued to be written. */
static void take_events(struct srv_batch *b)
{
    struct server *s = b->srv;
    if (!b->sink) return;
    int n = sched_sink_poll(b->sink, &b->evbuf);
    /* a backend that died posts every request's failure: those rows are not
     * recorded, they stay running on disk and run again at the next start */
    if (!n || b->engine_dead) return;
    if (sched_engine_fatal(s->eng, NULL, 0)) {
        b->engine_dead = true;
        return;
    }
    for (int i = 0; i < n; i++) {
        const struct sched_event *ev = &b->evbuf.ev[i];
        const struct bline_choice *c = ev->user;
        struct job *j = c->l->owner;
        if (ev->kind == SCHED_EV_FINISH) {
            if (c->i == 0) {
                s->prompt_tokens_total += (uint64_t)ev->usage.prompt_tokens;
                s->cached_tokens_total += (uint64_t)ev->usage.cached_tokens;
            }
            s->generation_tokens_total += (uint64_t)ev->usage.completion_tokens;
            srv_metrics_finish(s, ev, true);
        }
        if (!bline_event(&j->l, &b->env, ev)) continue;
        inflight_remove(b, j);
        finish_job(b, j);
        job_free(j);
    }
}

static void feed(struct srv_batch *b)
{
    struct server *s = b->srv;
    /* draining for shutdown: the rows not claimed stay pending for the next start */
    if (!b->pending_hint || b->engine_dead || atomic_load(&s->state) != SRV_READY || atomic_load(&s->draining))
        return;
    if (!b->sink) {
        b->sink = sched_sink_create(s->eng, on_engine_events, b);
        if (!b->sink) return; /* the next tick tries again */
        b->env = (struct bline_env){.eng = s->eng, .sink = b->sink, .tok = model_get_tok(s->m),
                                    .max_model_len = sched_engine_config(s->eng)->max_model_len,
                                    .model_names = s->model_names, .model_path = s->o.model,
                                    .has_prompt_logprobs = s->be->has_prompt_logprobs,
                                    .backend_name = s->be->ops->name};
    }
    if (!b->high) {
        /* Batch rows may take every sequence slot: the scheduler preempts
         * batch work to give a chat request a slot in the next step. Twice
         * max_num_seqs in flight keeps a queue of rows ready in the engine,
         * so a finished row's slot is refilled in the next step; refill as
         * soon as a row finishes. */
        int seqs = sched_engine_config(s->eng)->max_num_seqs;
        b->high = 2 * seqs;
        b->low = b->high;
        b->wait_max = 4 * b->high > 1024 ? 4 * b->high : 1024;
    }
    /* a store that cannot write results gets no more work to write back */
    if ((b->fail_mask & FAIL_RESULTS) || b->n_res >= b->wait_max) return;
    while (b->pending_hint && b->n_inflight < b->low) {
        int want = b->high - b->n_inflight;
        struct store_row *rows;
        char err[512];
        int n = store_claim_pending(b->w, want, &rows, err, sizeof err);
        store_status(b, FAIL_CLAIM, n < 0, err);
        if (n < 0) {
            b->pending_hint = false; /* the next tick tries again */
            return;
        }
        if (n < want) b->pending_hint = false;
        for (int i = 0; i < n; i++) submit_row(b, &rows[i]);
        store_rows_free(rows, n);
        if (flush_due(b, srv_now())) flush_results(b);
        if ((b->fail_mask & FAIL_RESULTS) || b->n_res >= b->wait_max) return;
    }
}

/* Aborts the rows in flight of batch `only` (or, NULL, of every batch that
 * is no longer in progress: cancelled or expired). Their finish events come
 * back as aborts and their results are written as cancelled (or dropped by
 * the store when the batch expired). */
static void abort_stale(struct srv_batch *b, const char *only)
{
    char last[STORE_ID_MAX] = "";
    bool last_live = true;
    for (struct job *j = b->inflight; j; j = j->next) {
        if (j->l.aborted) continue;
        bool live;
        if (only) {
            live = strcmp(j->batch_id, only) != 0;
        } else if (!strcmp(j->batch_id, last)) {
            live = last_live;
        } else {
            struct store_batch_info info;
            char err[256];
            live = store_batch_get(b->w, j->batch_id, &info, err, sizeof err) != 0 ||
                   info.status == STORE_BATCH_IN_PROGRESS;
            snprintf(last, sizeof last, "%s", j->batch_id);
            last_live = live;
        }
        if (live) continue;
        bline_abort(&j->l, &b->env);
    }
}

/* ---- store thread: calls ------------------------------------------------------------------ */

/* store_file_write()'s writer: the upload's content, drained into fd. */
static int write_content(void *ctx, int fd, char *err, size_t errlen)
{
    struct evbuffer *buf = ctx;
    while (evbuffer_get_length(buf) > 0) {
        int n = evbuffer_write(buf, fd);
        if (n < 0 && errno == EINTR) continue;
        if (n <= 0) {
            snprintf(err, errlen, "cannot store the upload: %s", n < 0 ? strerror(errno) : "short write");
            return SL_EIO;
        }
    }
    return 0;
}

static void run_call(struct srv_batch *b, struct call *c)
{
    char id[STORE_ID_MAX];
    c->err[0] = '\0';
    switch (c->op) {
    case OP_FILE_CREATE:
        c->rc = store_file_write(b->w, write_content, c->content, c->arg[1], c->arg[2], id, c->err, sizeof c->err);
        if (!c->rc) c->rc = store_file_get_json(b->w, id, &c->out, c->err, sizeof c->err);
        break;
    case OP_FILE_DELETE:
        c->rc = store_file_delete(b->w, c->arg[0], &c->out, c->err, sizeof c->err);
        break;
    case OP_BATCH_CREATE:
        c->rc = store_batch_create(b->w, c->arg[0], c->arg[1], c->arg[2], c->arg[3], id, c->err, sizeof c->err);
        if (!c->rc) {
            b->pending_hint = true;
            c->rc = store_batch_get_json(b->w, id, &c->out, c->err, sizeof c->err);
        }
        break;
    case OP_BATCH_CANCEL:
        c->rc = store_batch_cancel(b->w, c->arg[0], c->err, sizeof c->err);
        if (!c->rc) {
            if (atomic_load(&b->srv->state) == SRV_READY) abort_stale(b, c->arg[0]);
            c->rc = store_batch_get_json(b->w, c->arg[0], &c->out, c->err, sizeof c->err);
        }
        break;
    }
}

static void *store_main(void *arg)
{
    struct srv_batch *b = arg;
    double next_tick = srv_now();
    for (;;) {
        pthread_mutex_lock(&b->mu);
        for (;;) {
            double now = srv_now();
            if (b->stop || b->calls || b->events) break;
            double deadline = next_tick;
            if (b->n_res) {
                double due = b->fail_mask & FAIL_RESULTS ? b->t_retry : b->t_first_res + FLUSH_S;
                if (due < deadline) deadline = due;
            }
            if (b->pending_hint && b->high && b->n_inflight < b->low && !(b->fail_mask & FAIL_RESULTS) &&
                b->n_res < b->wait_max)
                deadline = now;
            if (now >= deadline) break;
            struct timespec ts;
            clock_gettime(CLOCK_REALTIME, &ts);
            double wait = deadline - now;
            ts.tv_sec += (time_t)wait;
            ts.tv_nsec += (long)((wait - (double)(time_t)wait) * 1e9);
            if (ts.tv_nsec >= 1000000000L) ts.tv_sec++, ts.tv_nsec -= 1000000000L;
            pthread_cond_timedwait(&b->cv, &b->mu, &ts);
        }
        bool stop = b->stop;
        struct call *calls = b->calls;
        b->calls = b->calls_tail = NULL;
        bool events = b->events;
        b->events = false;
        pthread_mutex_unlock(&b->mu);

        if (events) take_events(b);
        for (struct call *c = calls, *nx; c; c = nx) {
            nx = c->next;
            c->next = NULL;
            run_call(b, c);
            pthread_mutex_lock(&b->mu);
            if (b->replies_tail) b->replies_tail->next = c;
            else b->replies = c;
            b->replies_tail = c;
            pthread_mutex_unlock(&b->mu);
            event_active(b->reply_ev, EV_READ, 0);
        }
        double now = srv_now();
        if (stop) break;
        if (flush_due(b, now)) flush_results(b);
        if (now >= next_tick) {
            char err[512];
            int rc = store_tick(b->w, err, sizeof err);
            store_status(b, FAIL_TICK, rc < 0, err);
            if (rc > 0 && atomic_load(&b->srv->state) == SRV_READY) abort_stale(b, NULL);
            b->pending_hint = true;
            next_tick = now + TICK_S;
        }
        feed(b);
    }
    /* rows still in the engine stay `running` on disk: the next start runs
     * them again; their events are dropped once the sink is gone */
    flush_results(b);
    sched_sink_destroy(b->sink);
    b->sink = NULL;
    sched_evbuf_deinit(&b->evbuf);
    for (struct job *j = b->inflight, *nx; j; j = nx) {
        nx = j->next;
        job_free(j);
    }
    b->inflight = NULL;
    return NULL;
}

/* ---- api thread: replies -------------------------------------------------- */

static void on_call_close(struct evhttp_connection *con, void *arg)
{
    (void)con;
    struct call *c = arg;
    /* a request libevent detached from its dying connection is ours to free
     * (as in server_complete.c's on_client_close) */
    if (c->req && !evhttp_request_get_connection(c->req)) evhttp_request_free(c->req);
    c->req = NULL;
    c->con = NULL;
}

static void on_reply(evutil_socket_t fd, short what, void *arg)
{
    (void)fd;
    (void)what;
    struct srv_batch *b = arg;
    pthread_mutex_lock(&b->mu);
    struct call *c = b->replies;
    b->replies = b->replies_tail = NULL;
    pthread_mutex_unlock(&b->mu);
    for (struct call *nx; c; c = nx) {
        nx = c->next;
        if (c->con) evhttp_connection_set_closecb(c->con, NULL, NULL);
        if (c->req) {
            if (c->rc) reply_store_error(c->req, c->rc, c->err);
            else srv_reply_json(c->req, 200, &c->out);
        }
        call_free(c);
    }
}

/* Hands c to the store thread; the reply comes through on_reply. */
static void post_call(struct srv_batch *b, struct evhttp_request *req, struct call *c)
{
    c->req = req;
    c->con = evhttp_request_get_connection(req);
    if (c->con) evhttp_connection_set_closecb(c->con, on_call_close, c);
    json_buf_init(&c->out);
    pthread_mutex_lock(&b->mu);
    if (b->calls_tail) b->calls_tail->next = c;
    else b->calls = c;
    b->calls_tail = c;
    pthread_cond_signal(&b->cv);
    pthread_mutex_unlock(&b->mu);
}

static struct call *new_call(struct evhttp_request *req, enum op op, const char *a0)
{
    struct call *c = calloc(1, sizeof *c);
    if (c) {
        c->op = op;
        if (a0 && !(c->arg[0] = strdup(a0))) {
            free(c);
            c = NULL;
        }
    }
    if (!c) srv_reply_error(req, 500, "server_error", NULL, "out of memory");
    return c;
}

/* ---- api thread: multipart upload ------------------------------------------------------------ */

static int find(struct evbuffer *in, const char *what, size_t n, size_t from, size_t *at)
{
    struct evbuffer_ptr start;
    if (evbuffer_ptr_set(in, &start, from, EVBUFFER_PTR_SET)) return -1;
    struct evbuffer_ptr p = evbuffer_search(in, what, n, &start);
    if (p.pos < 0) return -1;
    *at = (size_t)p.pos;
    return 0;
}

/* Copies in[from, from+n) into out (n < cap), NUL-terminated. */
static int copy_range(struct evbuffer *in, size_t from, size_t n, char *out, size_t cap)
{
    struct evbuffer_ptr p;
    if (n >= cap || evbuffer_ptr_set(in, &p, from, EVBUFFER_PTR_SET)) return -1;
    if (evbuffer_copyout_from(in, &p, out, n) != (ev_ssize_t)n) return -1;
    out[n] = '\0';
    return 0;
}

/* Moves in[from, from+len) into out, chunks changing hands (the bytes
 * before `from` are dropped). Returns 0, or -1 out of memory. */
static int move_range(struct evbuffer *in, size_t from, size_t len, struct evbuffer *out)
{
    if (evbuffer_drain(in, from)) return -1;
    while (len > 0) { /* evbuffer_remove_buffer() counts in int */
        size_t k = len > (1u << 30) ? 1u << 30 : len;
        if (evbuffer_remove_buffer(in, out, k) != (int)k) return -1;
        len -= k;
    }
    return 0;
}

/* Reads one parameter value of a header (token or quoted string) after
 * `key=` in a `; key=value` list. Returns 0 and the unquoted value in out. */
static int header_param(const char *h, const char *key, char *out, size_t cap)
{
    size_t kl = strlen(key);
    const char *p = strchr(h, ';');
    while (p) {
        p++;
        while (*p == ' ' || *p == '\t') p++;
        if (!strncasecmp(p, key, kl) && p[kl] == '=') {
            p += kl + 1;
            size_t o = 0;
            if (*p == '"') {
                for (p++; *p && *p != '"'; p++) {
                    if (*p == '\\' && p[1]) p++;
                    if (o + 1 < cap) out[o++] = *p;
                }
            } else {
                for (; *p && *p != ';' && *p != ' ' && *p != '\t' && *p != '\r'; p++)
                    if (o + 1 < cap) out[o++] = *p;
            }
            out[o] = '\0';
            return 0;
        }
        /* skip this parameter, quoted values included */
        bool q = false;
        for (; *p && (q || *p != ';'); p++) {
            if (*p == '\\' && q && p[1]) p++;
            else if (*p == '"') q = !q;
        }
        p = *p ? p : NULL;
    }
    return -1;
}

/* POST /v1/files: multipart/form-data with `purpose` and `file`. */
static void handle_file_upload(struct srv_batch *b, struct evhttp_request *req)
{
    struct server *s = b->srv;
    const char *ct = evhttp_find_header(evhttp_request_get_input_headers(req), "Content-Type");
    char boundary[128];
    if (!ct || strncasecmp(ct, "multipart/form-data", 19) || header_param(ct, "boundary", boundary + 4, sizeof boundary - 4) ||
        !boundary[4] || strlen(boundary + 4) > 70) {
        srv_reply_error(req, 400, "invalid_request_error", NULL,
                        "POST /v1/files takes multipart/form-data with a boundary, and the fields 'purpose' and 'file'");
        return;
    }
    memcpy(boundary, "\r\n--", 4); /* the delimiter as it appears between parts */
    size_t dl = strlen(boundary);
    struct evbuffer *in = evhttp_request_get_input_buffer(req);
    char purpose[64] = "", filename[256] = "";
    bool have_file = false;
    size_t fstart = 0, flen = 0; /* the file part's content in `in` */
    const char *bad = NULL;
    size_t pos;
    /* the first delimiter may open the body (no CRLF before it) */
    if (!find(in, boundary + 2, dl - 2, 0, &pos)) pos += dl - 2;
    else bad = "no multipart boundary found in the body";
    while (!bad) {
        char two[3];
        if (copy_range(in, pos, 2, two, sizeof two)) {
            bad = "the multipart body ends without its closing boundary";
            break;
        }
        if (!strcmp(two, "--")) break;
        if (strcmp(two, "\r\n")) {
            bad = "malformed multipart delimiter";
            break;
        }
        pos += 2;
        size_t hend, next;
        if (find(in, "\r\n\r\n", 4, pos, &hend) || hend - pos >= MAX_PART_HEADERS) {
            bad = "malformed multipart part headers";
            break;
        }
        char *hdr = malloc(hend - pos + 3);
        if (!hdr || copy_range(in, pos, hend - pos + 2, hdr, hend - pos + 3)) {
            free(hdr);
            bad = "cannot read multipart part headers";
            break;
        }
        size_t cstart = hend + 4;
        if (find(in, boundary, dl, cstart, &next)) {
            free(hdr);
            bad = "the multipart body ends without its closing boundary";
            break;
        }
        char name[64] = "", fname[256] = "";
        bool has_fname = false;
        for (char *line = hdr, *eol; *line; line = eol + 2) {
            eol = strstr(line, "\r\n");
            if (!eol) break;
            *eol = '\0';
            if (!strncasecmp(line, "Content-Disposition:", 20)) {
                header_param(line, "name", name, sizeof name);
                has_fname = !header_param(line, "filename", fname, sizeof fname);
            }
        }
        free(hdr);
        size_t clen = next - cstart;
        if (!strcmp(name, "purpose")) {
            if (copy_range(in, cstart, clen, purpose, sizeof purpose)) {
                bad = "'purpose' is too long";
                break;
            }
        } else if (!strcmp(name, "file")) {
            if (have_file) {
                bad = "only one 'file' per upload";
                break;
            }
            if ((long)clen > s->o.max_batch_file_bytes) {
                srv_reply_error(req, 413, "invalid_request_error", "file",
                                "file is %zu bytes; a batch input file may be at most %ld bytes", clen,
                                s->o.max_batch_file_bytes);
                return;
            }
            fstart = cstart;
            flen = clen;
            have_file = true;
            snprintf(filename, sizeof filename, "%s", has_fname && fname[0] ? fname : "upload.jsonl");
        }
        pos = next + dl;
    }
    if (!bad && !have_file) bad = "the field 'file' is required";
    if (!bad && !purpose[0]) bad = "the field 'purpose' is required";
    if (!bad && strcmp(purpose, "batch")) bad = "only purpose 'batch' is supported";
    if (bad) {
        const char *param = !have_file ? "file" : strcmp(purpose, "batch") ? "purpose" : NULL;
        srv_reply_error(req, 400, "invalid_request_error", param, "%s", bad);
        return;
    }
    struct call *c = new_call(req, OP_FILE_CREATE, NULL);
    if (!c) return;
    /* the file part's chunks change hands; the rest of the body is dropped */
    if (!(c->arg[1] = strdup(purpose)) || !(c->arg[2] = strdup(filename)) || !(c->content = evbuffer_new()) ||
        move_range(in, fstart, flen, c->content)) {
        srv_reply_error(req, 500, "server_error", NULL, "out of memory");
        call_free(c);
        return;
    }
    post_call(b, req, c);
}

/* ---- api thread: the other routes ------------------------------------------------------------ */

/* after/limit/purpose from the query string. Returns -1 after replying 400. */
static int list_params(struct evhttp_request *req, struct evkeyvalq *q, const char **after, int *limit,
                       const char **purpose)
{
    const struct evhttp_uri *u = evhttp_request_get_evhttp_uri(req);
    const char *query = u ? evhttp_uri_get_query(u) : NULL;
    TAILQ_INIT(q);
    if (query && evhttp_parse_query_str(query, q)) {
        srv_reply_error(req, 400, "invalid_request_error", NULL, "malformed query string");
        return -1;
    }
    *after = evhttp_find_header(q, "after");
    if (*after && !**after) *after = NULL;
    if (purpose) {
        *purpose = evhttp_find_header(q, "purpose");
        if (*purpose && !**purpose) *purpose = NULL;
    }
    const char *l = evhttp_find_header(q, "limit");
    *limit = 0;
    if (l) {
        char *end;
        errno = 0;
        long v = strtol(l, &end, 10);
        if (end == l || *end || errno || v < 1 || v > 10000) {
            srv_reply_error(req, 400, "invalid_request_error", "limit", "'limit' must be an integer from 1 to 10000");
            return -1;
        }
        *limit = (int)v;
    }
    return 0;
}

static void reply_buf(struct evhttp_request *req, int rc, struct json_buf *o, const char *err)
{
    if (rc) reply_store_error(req, rc, err);
    else srv_reply_json(req, 200, o);
    json_buf_free(o);
}

static void handle_file_content(struct srv_batch *b, struct evhttp_request *req, const char *id)
{
    char err[512];
    int fd;
    int64_t size;
    int rc = store_file_open_content(b->r, id, &fd, &size, err, sizeof err);
    if (rc) {
        reply_store_error(req, rc, err);
        return;
    }
    struct evbuffer *out = evbuffer_new();
    if (!out) {
        close(fd);
        srv_reply_error(req, 500, "server_error", NULL, "out of memory");
        return;
    }
    if (evhttp_request_get_command(req) == EVHTTP_REQ_HEAD) { /* a GET's headers, no body */
        char n[24];
        snprintf(n, sizeof n, "%lld", (long long)size);
        evhttp_add_header(evhttp_request_get_output_headers(req), "Content-Length", n);
        close(fd);
    } else if (size == 0) close(fd);
    else if (evbuffer_add_file(out, fd, 0, size)) { /* takes fd */
        evbuffer_free(out);
        srv_reply_error(req, 500, "server_error", NULL, "cannot send the file");
        return;
    }
    evhttp_add_header(evhttp_request_get_output_headers(req), "Content-Type", "application/octet-stream");
    evhttp_send_reply(req, 200, "OK", out);
    evbuffer_free(out);
}

static void handle_batch_create(struct srv_batch *b, struct evhttp_request *req)
{
    size_t len;
    char *body = srv_read_body(req, b->srv->o.max_body_bytes, &len);
    if (!body) return;
    json_doc d = {0};
    char perr[256];
    struct call *c = NULL;
    if (json_parse(&d, body, len, perr, sizeof perr) || !json_is_obj(&d, 0)) {
        srv_reply_error(req, 400, "invalid_request_error", NULL, "request body is not a JSON object");
        goto out;
    }
    static const char *const keys[3] = {"input_file_id", "endpoint", "completion_window"};
    if (!(c = new_call(req, OP_BATCH_CREATE, NULL))) goto out;
    for (int k = 0; k < 3; k++) {
        int i = json_get(&d, 0, keys[k]);
        if (i < 0 || !json_is_str(&d, i)) {
            srv_reply_error(req, 400, "invalid_request_error", keys[k], "'%s' is required and must be a string", keys[k]);
            goto out;
        }
        if (!(c->arg[k] = json_strdup(&d, i, NULL))) {
            srv_reply_error(req, 500, "server_error", NULL, "out of memory");
            goto out;
        }
    }
    int m = json_get(&d, 0, "metadata");
    if (m >= 0 && !json_is_null(&d, m)) {
        if (!json_is_obj(&d, m)) {
            srv_reply_error(req, 400, "invalid_request_error", "metadata", "'metadata' must be an object");
            goto out;
        }
        size_t ml;
        const char *raw = json_raw(&d, m, &ml);
        if (!(c->arg[3] = strndup(raw, ml))) {
            srv_reply_error(req, 500, "server_error", NULL, "out of memory");
            goto out;
        }
    }
    post_call(b, req, c);
    c = NULL;
out:
    call_free(c);
    if (d.tok) json_free(&d);
    free(body);
}

bool srv_batch_route(const char *path)
{
    return (!strncmp(path, "/v1/files", 9) && (!path[9] || path[9] == '/')) ||
           (!strncmp(path, "/v1/batches", 11) && (!path[11] || path[11] == '/'));
}

static void not_allowed(struct evhttp_request *req, const char *path, const char *allow)
{
    evhttp_add_header(evhttp_request_get_output_headers(req), "Allow", allow);
    srv_reply_error(req, 405, "invalid_request_error", NULL, "method not allowed on %s (use %s)", path, allow);
}

void srv_handle_batch_api(struct server *s, struct evhttp_request *req, const char *path)
{
    struct srv_batch *b = s->batch;
    enum evhttp_cmd_type m = evhttp_request_get_command(req);
    bool files = path[4] == 'f';
    const char *rest = path + (files ? 9 : 11); /* "" or "/ID[/...]" */
    char id[STORE_ID_MAX] = "";
    const char *sub = "";
    if (*rest) {
        const char *slash = strchr(rest + 1, '/');
        size_t n = slash ? (size_t)(slash - rest - 1) : strlen(rest + 1);
        if (n == 0 || n >= sizeof id) {
            srv_reply_error(req, 404, "invalid_request_error", NULL, "no such %s: '%.*s'", files ? "file" : "batch",
                            (int)(n > 80 ? 80 : n), rest + 1);
            return;
        }
        memcpy(id, rest + 1, n);
        id[n] = '\0';
        sub = slash ? slash : "";
    }
    char err[512] = "";
    struct json_buf o;
    json_buf_init(&o);
    if (m == EVHTTP_REQ_HEAD) m = EVHTTP_REQ_GET; /* the replies leave a HEAD's body out (srv_reply_json, content) */
    if (!*rest) { /* the collection */
        if (m == EVHTTP_REQ_POST) {
            if (files) handle_file_upload(b, req);
            else handle_batch_create(b, req);
            return;
        }
        if (m != EVHTTP_REQ_GET) {
            not_allowed(req, path, "GET, POST");
            return;
        }
        struct evkeyvalq q;
        const char *after, *purpose = NULL;
        int limit;
        if (list_params(req, &q, &after, &limit, files ? &purpose : NULL)) {
            evhttp_clear_headers(&q);
            return;
        }
        int rc = files ? store_file_list_json(b->r, purpose, after, limit, &o, err, sizeof err)
                       : store_batch_list_json(b->r, after, limit > 100 ? 100 : limit, &o, err, sizeof err);
        reply_buf(req, rc, &o, err);
        evhttp_clear_headers(&q);
        return;
    }
    if (!*sub) { /* one object */
        if (m == EVHTTP_REQ_GET) {
            int rc = files ? store_file_get_json(b->r, id, &o, err, sizeof err)
                           : store_batch_get_json(b->r, id, &o, err, sizeof err);
            reply_buf(req, rc, &o, err);
            return;
        }
        if (files && m == EVHTTP_REQ_DELETE) {
            struct call *c = new_call(req, OP_FILE_DELETE, id);
            if (c) post_call(b, req, c);
            return;
        }
        not_allowed(req, path, files ? "GET, DELETE" : "GET");
        return;
    }
    if (files && !strcmp(sub, "/content")) {
        if (m != EVHTTP_REQ_GET) not_allowed(req, path, "GET");
        else handle_file_content(b, req, id);
        return;
    }
    if (!files && !strcmp(sub, "/cancel")) {
        struct call *c = m == EVHTTP_REQ_POST ? new_call(req, OP_BATCH_CANCEL, id) : NULL;
        if (m != EVHTTP_REQ_POST) not_allowed(req, path, "POST");
        else if (c) post_call(b, req, c);
        return;
    }
    srv_reply_error(req, 404, "invalid_request_error", NULL, "no route %s", path);
}

/* ---- api thread: the store's health ------------------------------------------------------------ */

void srv_batch_health_json(struct server *s, struct json_buf *out)
{
    struct srv_batch *b = s->batch;
    if (!b) return;
    int mask = atomic_load(&b->st_fail_mask);
    if (!mask) return;
    char e[sizeof b->st_error];
    pthread_mutex_lock(&b->mu);
    memcpy(e, b->st_error, sizeof e);
    pthread_mutex_unlock(&b->mu);
    json_buf_addf(out, "{\"status\":\"degraded\",\"batch_store\":{\"status\":\"failing\",\"results_waiting\":%d,"
                       "\"failing\":[",
                  atomic_load(&b->st_waiting));
    static const char *const what[] = {"results", "claims", "housekeeping"};
    for (int i = 0, n = 0; i < 3; i++)
        if (mask & (1 << i)) json_buf_addf(out, "%s\"%s\"", n++ ? "," : "", what[i]);
    json_buf_add(out, "],\"error\":", 10);
    json_buf_add_str(out, e, strlen(e));
    json_buf_add(out, "}}", 2);
}

void srv_batch_metrics(struct server *s, struct evbuffer *o)
{
    struct srv_batch *b = s->batch;
    if (!b) return;
    evbuffer_add_printf(o,
                        "# HELP sluice:batch_store_failing 1 while the batch store cannot write (results wait, "
                        "no new batch work).\n# TYPE sluice:batch_store_failing gauge\nsluice:batch_store_failing %d\n"
                        "# HELP sluice:batch_results_waiting Batch results waiting to be written.\n"
                        "# TYPE sluice:batch_results_waiting gauge\nsluice:batch_results_waiting %d\n"
                        "# HELP sluice:batch_store_write_errors_total Batch store writes that failed.\n"
                        "# TYPE sluice:batch_store_write_errors_total counter\n"
                        "sluice:batch_store_write_errors_total %llu\n",
                        atomic_load(&b->st_fail_mask) ? 1 : 0, atomic_load(&b->st_waiting),
                        (unsigned long long)atomic_load(&b->st_write_errors));
    /* the queue, from the batches table (cheap: no scan of the rows) and the feeder */
    struct store_queue_stats q;
    char err[256];
    if (store_queue_stats(b->r, &q, err, sizeof err)) return;
    evbuffer_add_printf(o, "# HELP sluice:batches Batches by status.\n# TYPE sluice:batches gauge\n");
    for (int i = 0; i < STORE_N_BATCH_STATUS; i++)
        evbuffer_add_printf(o, "sluice:batches{status=\"%s\"} %ld\n", store_batch_status_names[i], q.batches[i]);
    long open = 0, done = 0, failed = 0, running = atomic_load(&b->st_inflight);
    for (int i = 0; i < STORE_N_BATCH_STATUS; i++) {
        done += q.rows_completed[i], failed += q.rows_failed[i];
        if (!strcmp(store_batch_status_names[i], "in_progress") || !strcmp(store_batch_status_names[i], "validating"))
            open += q.rows_total[i] - q.rows_completed[i] - q.rows_failed[i];
    }
    long pending = open - running > 0 ? open - running : 0;
    evbuffer_add_printf(o,
                        "# HELP sluice:batch_requests Batch requests (input lines) by state: pending (queued, not "
                        "yet in the engine), running (in the engine), completed and failed (written).\n"
                        "# TYPE sluice:batch_requests gauge\n"
                        "sluice:batch_requests{state=\"pending\"} %ld\nsluice:batch_requests{state=\"running\"} %ld\n"
                        "sluice:batch_requests{state=\"completed\"} %ld\nsluice:batch_requests{state=\"failed\"} %ld\n",
                        pending, running, done, failed);
}

/* ---- construction and teardown ------------------------------------------------------------------ */

int srv_batch_start(struct server *s, char *err, size_t errlen)
{
    struct srv_batch *b = calloc(1, sizeof *b);
    if (!b) {
        snprintf(err, errlen, "out of memory");
        return SL_ENOMEM;
    }
    b->srv = s;
    b->pending_hint = true; /* recovery may have put rows back to pending */
    sched_evbuf_init(&b->evbuf);
    b->rng = (uint64_t)time(NULL) ^ ((uint64_t)getpid() << 32) ^ (uint64_t)(uintptr_t)b;
    struct store_opts so = {
        .max_file_lines = s->o.max_batch_file_lines,
        .max_file_bytes = s->o.max_batch_file_bytes,
        .allow_short_windows = s->o.allow_short_windows,
    };
    char e[400];
    b->w = store_open(s->o.data_dir, &so, e, sizeof e);
    if (!b->w) {
        snprintf(err, errlen, "cannot open the batch store in %s: %s", s->o.data_dir, e);
        goto fail_free;
    }
    b->r = store_open_reader(s->o.data_dir, e, sizeof e);
    if (!b->r) {
        snprintf(err, errlen, "cannot open the batch store in %s: %s", s->o.data_dir, e);
        goto fail_writer;
    }
    b->reply_ev = event_new(s->base, -1, 0, on_reply, b);
    if (!b->reply_ev) {
        snprintf(err, errlen, "cannot create the store reply event");
        goto fail_reader;
    }
    pthread_mutex_init(&b->mu, NULL);
    pthread_cond_init(&b->cv, NULL);
    if (pthread_create(&b->thread, NULL, store_main, b)) {
        snprintf(err, errlen, "cannot start the store thread");
        goto fail_sync;
    }
    b->started = true;
    s->batch = b;
    return 0;

fail_sync:
    pthread_cond_destroy(&b->cv);
    pthread_mutex_destroy(&b->mu);
    event_free(b->reply_ev);
fail_reader:
    store_close(b->r);
fail_writer:
    store_close(b->w);
fail_free:
    free(b);
    return SL_EIO;
}

void srv_batch_stop(struct server *s)
{
    struct srv_batch *b = s->batch;
    if (!b) return;
    pthread_mutex_lock(&b->mu);
    b->stop = true;
    pthread_cond_signal(&b->cv);
    pthread_mutex_unlock(&b->mu);
    pthread_join(b->thread, NULL);
    /* calls the store thread answered but the loop never sent, and calls it never ran */
    for (struct call *c = b->replies, *nx; c; c = nx) {
        nx = c->next;
        if (c->con) evhttp_connection_set_closecb(c->con, NULL, NULL);
        call_free(c);
    }
    for (struct call *c = b->calls, *nx; c; c = nx) {
        nx = c->next;
        if (c->con) evhttp_connection_set_closecb(c->con, NULL, NULL);
        call_free(c);
    }
    for (int i = 0; i < b->n_res; i++) { /* a last flush that failed: these rows run again at the next start */
        free(b->outs[i].body);
        free(b->outs[i].msg);
    }
    free(b->res);
    free(b->outs);
    event_free(b->reply_ev);
    pthread_cond_destroy(&b->cv);
    pthread_mutex_destroy(&b->mu);
    store_close(b->r);
    store_close(b->w);
    free(b);
    s->batch = NULL;
}

/* batch_line.h - one batch line's life in the engine, shared by the Batch
 * API's store thread (server_batch.c) and `sluice run-batch`
 * (cmd_run_batch.c), so that both answer a line the same way (used inside
 * api/ only):
 *
 *   store_check_line()   the line as batch creation checks it (store.h):
 *                        run-batch per line; the Batch API when the batch
 *                        is created
 *   bline_start()        the body parsed as its endpoint's (a /v1/responses
 *                        body as the chat body it means), the model it names,
 *                        its length, its tokens; its choices submitted at
 *                        batch priority to the submitter's sink
 *   bline_event()        one engine event folded into the line's result
 *   bline_reply()        the finished line's response: the completion (or
 *                        Response object), or an OpenAI error body
 *   store_result_line()  the output file's line (store.h)
 *
 * A line belongs to one thread from bline_start to bline_free: the thread
 * that drains its sink.
 */
#ifndef SLUICE_API_BATCH_LINE_H
#define SLUICE_API_BATCH_LINE_H

#include <stdbool.h>
#include <stdint.h>

#include "base/json.h"
#include "openai.h"
#include "sched/sched.h"

struct bline;

/* One choice of a line (a body with "n" > 1 has several): an engine request.
 * The engine's events carry it as their user pointer. */
struct bline_choice {
    struct bline *l;
    int i;
    uint64_t id;                   /* the engine's */
};

struct bline {
    void *owner;                   /* the submitter's: its row or line */
    bool responses;                /* a /v1/responses line: the reply is a Response object */
    char *resp_echo;               /* owned: what the Response object echoes of the line's request */
    struct api_oai_req req;
    int n_prompt;                  /* prompt tokens */
    int n, n_done;                 /* choices running, finished */
    struct bline_choice *ch;       /* owned [n] */
    struct api_oai_result *res;    /* owned [n] */
    bool aborted;                  /* every choice was asked to stop */
    char *fail;                    /* owned: a later choice could not be submitted (the line's 400) */
};

/* What a line needs of the process that runs it. Borrowed. */
struct bline_env {
    sched_engine *eng;
    sched_sink *sink;              /* the submitter's: the lines' events go there */
    const model_tok *tok;
    int max_model_len;
    const char *const *model_names; /* NULL-terminated: the names a body may give; the first is the one
                                       replies carry */
    const char *model_path;        /* also accepted as the model's name */
    bool has_prompt_logprobs;      /* the backend gives prompt logprobs (prompt_logprobs, echo with logprobs) */
    const char *backend_name;      /* named when it does not */
};

/* 24 random lowercase hex digits (and a NUL) into out, from *state. */
void bline_rand_hex(uint64_t *state, char *out, int n);

/* Starts a line: url names the endpoint ("/v1/chat/completions",
 * "/v1/completions" or "/v1/responses"), body its request body. Returns 0
 * when at least one choice runs (l->fail says when a later one could not be
 * submitted: the others were aborted), or -1 with e, the line's error
 * response (its type set, with /v1/responses' field names for such a line);
 * l is then left for bline_free. l must be zeroed, l->owner may be set. */
int bline_start(struct bline *l, const struct bline_env *env, const char *url, const char *body, size_t len,
                struct api_oai_error *e);

/* Folds one of the line's engine events (ev->user is one of l->ch) into its
 * result. Returns true when it was the line's last finish. */
bool bline_event(struct bline *l, const struct bline_env *env, const struct sched_event *ev);

/* Asks the engine to stop every choice still running (once); their finish
 * events follow. */
void bline_abort(struct bline *l, const struct bline_env *env);

/* The response of a finished line: its body into out (initialized here) and
 * its status: 200 (the completion, or the Response object, with a fresh id
 * made from *rng, created at `created`), 400 (a choice could not be
 * submitted) or 500 (the engine failed) with an OpenAI error body, or 0 when
 * the line was stopped (bline_abort) and has no response. */
int bline_reply(const struct bline *l, const struct bline_env *env, uint64_t *rng, long created,
                struct json_buf *out);

/* An error response's body (api_oai_error_json). */
void bline_error_body(const struct api_oai_error *e, struct json_buf *out);

/* Frees what l owns (not l). */
void bline_free(struct bline *l);

#endif

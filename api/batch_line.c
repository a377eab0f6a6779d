/* batch_line.c - one batch line's life in the engine (batch_line.h). */
#include "api/batch_line.h"

#include <stdio.h>
#include <stdlib.h>
#include <string.h>

void bline_rand_hex(uint64_t *state, char *out, int n)
{
    static const char hex[] = "0123456789abcdef";
    for (int i = 0; i < n; i++) {
        *state += 0x9E3779B97F4A7C15ULL;
        uint64_t z = *state;
        z = (z ^ (z >> 30)) * 0xBF58476D1CE4E5B9ULL;
        z = (z ^ (z >> 27)) * 0x94D049BB133111EBULL;
        out[i] = hex[(z ^ (z >> 31)) & 15];
    }
    out[n] = '\0';
}

/* Submits the line's choices; they share the prompt, so after the first its
 * blocks come from the prefix cache. Returns 0 when the first runs. */
static int submit(struct bline *l, const struct bline_env *env, struct sched_request *sr, struct api_oai_error *e)
{
    int nc = l->req.n > 1 ? l->req.n : 1;
    l->ch = calloc((size_t)nc, sizeof *l->ch);
    l->res = calloc((size_t)nc, sizeof *l->res);
    if (!l->ch || !l->res) {
        api_oai_errorf(e, 500, NULL, "out of memory");
        return -1;
    }
    for (int i = 0; i < nc; i++) {
        l->ch[i] = (struct bline_choice){.l = l, .i = i};
        api_oai_result_init(&l->res[i]);
        api_oai_result_echo(&l->res[i], &l->req, i, env->tok, sr->prompt, sr->n_prompt);
    }
    l->n = nc;
    for (int i = 0; i < nc; i++) {
        char err[256];
        api_oai_choice_sampling(&l->req, i, &sr->sampling);
        sr->user = &l->ch[i];
        if (!sched_engine_submit(env->eng, sr, &l->ch[i].id, err, sizeof err)) continue;
        if (i == 0) {
            api_oai_errorf(e, 400, NULL, "%s", err);
            return -1;
        }
        /* choices 0..i-1 run: they come back as aborts, the line as this error */
        l->fail = strdup(err);
        l->n = i;
        bline_abort(l, env);
        break;
    }
    return 0;
}

int bline_start(struct bline *l, const struct bline_env *env, const char *url, const char *body, size_t len,
                struct api_oai_error *e)
{
    memset(e, 0, sizeof *e);
    json_doc d = {0};
    int32_t *ids = NULL;
    struct json_buf chat; /* a /v1/responses line: its chat body */
    json_buf_init(&chat);
    int rc = -1;
    enum api_oai_endpoint kind = strcmp(url, "/v1/completions") ? API_OAI_CHAT : API_OAI_COMPLETIONS;
    l->responses = !strcmp(url, "/v1/responses");
    if (api_oai_check_utf8(body, len, e)) goto out;
    if (l->responses) { /* the Responses body as the chat body it means */
        if (api_resp_to_chat(body, len, &chat, e)) goto out;
        struct json_buf echo;
        json_buf_init(&echo);
        if (api_resp_echo(body, len, &echo) == 0) l->resp_echo = echo.p;
        else json_buf_free(&echo);
        body = chat.p, len = chat.len;
    }
    char perr[256];
    /* d borrows the text: chat lives until d goes */
    if (json_parse(&d, body, len, perr, sizeof perr) || !json_is_obj(&d, 0)) {
        api_oai_errorf(e, 400, "body", "the request body is not a JSON object");
        goto out;
    }
    if (api_oai_parse_doc(&d, 0, kind, NULL, &l->req, e)) goto out;
    if (l->req.model && !api_oai_model_known(env->model_names, l->req.model) &&
        strcmp(l->req.model, env->model_path)) {
        api_oai_errorf(e, 404, "model", "The model `%s` does not exist.", l->req.model);
        goto out;
    }
    if (l->req.stream) {
        api_oai_errorf(e, 400, "stream", "'stream' is not supported in a batch");
        goto out;
    }
    if (l->req.n_prompts) {
        api_oai_errorf(e, 400, "prompt", "a batch line takes one prompt, not a list: one line per prompt");
        goto out;
    }
    if (api_oai_prepare(&l->req, env->tok, e)) goto out;
    if (api_oai_wants_prompt_logprobs(&l->req) && !env->has_prompt_logprobs) {
        api_oai_errorf(e, 400, l->req.prompt_logprobs >= 0 ? "prompt_logprobs" : "echo",
                       "prompt logprobs are not available on the %s backend yet",
                       env->backend_name ? env->backend_name : "this");
        goto out;
    }
    if (api_oai_check_length(&l->req, -1, env->tok, env->max_model_len, e)) goto out;
    int n = api_oai_tokenize(&l->req, env->tok, &ids, e);
    if (n < 0) goto out;
    struct sched_request sr;
    if (api_oai_to_sched(&l->req, ids, n, env->max_model_len, &sr, e)) goto out;
    sr.priority = SCHED_PRIO_BATCH;
    sr.sink = env->sink;
    if (submit(l, env, &sr, e)) goto out;
    l->n_prompt = n;
    rc = 0;
out:
    if (rc) {
        if (!e->type) e->type = e->status >= 500 ? "server_error" : "invalid_request_error";
        if (l->responses) api_resp_chat_error(e); /* the field the line's body gave */
    }
    free(ids); /* the engine copied the prompt */
    json_free(&d);
    json_buf_free(&chat);
    return rc;
}

bool bline_event(struct bline *l, const struct bline_env *env, const struct sched_event *ev)
{
    const struct bline_choice *c = ev->user;
    api_oai_result_add(&l->res[c->i], &l->req, env->tok, ev);
    return ev->kind == SCHED_EV_FINISH && ++l->n_done == l->n;
}

void bline_abort(struct bline *l, const struct bline_env *env)
{
    if (l->aborted) return;
    l->aborted = true;
    for (int i = 0; i < l->n; i++) sched_engine_abort(env->eng, l->ch[i].id);
}

void bline_error_body(const struct api_oai_error *e, struct json_buf *out) { api_oai_error_json(out, e); }

int bline_reply(const struct bline *l, const struct bline_env *env, uint64_t *rng, long created,
                struct json_buf *out)
{
    json_buf_init(out);
    enum sched_finish worst = SCHED_FINISH_NONE;
    const char *error = "";
    for (int i = 0; i < l->n; i++) {
        if (l->res[i].finish == SCHED_FINISH_ERROR) worst = SCHED_FINISH_ERROR, error = l->res[i].error;
        else if (l->res[i].finish == SCHED_FINISH_ABORT && worst != SCHED_FINISH_ERROR) worst = SCHED_FINISH_ABORT;
    }
    struct api_oai_error e = {0};
    if (l->fail) {
        api_oai_errorf(&e, 400, NULL, "%s", l->fail);
        e.type = "invalid_request_error";
    } else if (worst == SCHED_FINISH_ABORT) {
        return 0;
    } else if (worst == SCHED_FINISH_ERROR) {
        api_oai_errorf(&e, 500, NULL, "the engine failed on this request: %s", error);
        e.type = "server_error";
    } else {
        char hex[25], id[48];
        bline_rand_hex(rng, hex, 24);
        snprintf(id, sizeof id, "%s%s", l->req.kind == API_OAI_CHAT ? "chatcmpl-" : "cmpl-", hex);
        const char *model = env->model_names[0];
        if (!l->responses) {
            api_oai_response_json(out, &l->req, l->res, id, created, model);
        } else { /* the Response object the chat reply means */
            struct json_buf chat;
            json_buf_init(&chat);
            api_oai_response_json(&chat, &l->req, l->res, id, created, model);
            if (chat.oom) out->oom = true;
            else api_resp_from_chat(out, chat.p ? chat.p : "", chat.len, hex, created, model, l->resp_echo);
            json_buf_free(&chat);
        }
        return 200;
    }
    bline_error_body(&e, out);
    return e.status;
}

void bline_free(struct bline *l)
{
    if (!l) return;
    api_oai_req_free(&l->req);
    for (int i = 0; l->res && i < l->n; i++) api_oai_result_free(&l->res[i]);
    free(l->res);
    free(l->ch);
    free(l->fail);
    free(l->resp_echo);
    l->resp_echo = NULL;
    l->res = NULL;
    l->ch = NULL;
    l->fail = NULL;
}

/* server_complete.c - /v1/chat/completions and /v1/completions on the api
 * thread: parse (api/openai.c), tokenize, submit to the engine, then turn
 * engine events into a final reply or server-sent-event chunks.
 *
 * A request with n choices submits n engine requests; the engine's events
 * carry the choice as `user`. The request lives from submit until the finish
 * event of its last choice, so it is never freed while the engine may still
 * name it. A client that hangs up mid-request sets req to NULL and aborts
 * every choice still running; the last finish event frees the request.
 * evhttp reads nothing from a connection between a request and its reply,
 * so a hang-up would only show when a reply is written: an unstreamed
 * request, or a stream still in prefill, would run to its end for nobody.
 * A watcher on the socket (EV_CLOSED where the backend has it, else a peek
 * on EV_READ) sees the client's FIN at once. A FIN alone does not say the
 * client is gone: one that half-closes after sending its request still reads
 * the reply. So a FIN starts a probe: a write the client's kernel answers
 * with a reset when the socket is closed (an interim "100 Continue" before an
 * unstreamed HTTP/1.1 reply, an SSE comment in a stream), then a look for
 * that reset; until one comes the request runs. evhttp reads nothing while
 * a reply is in flight (hold_read): at a half-close's EOF it would drop the
 * connection.
 *
 * When evhttp drops a connection on EOF or a timeout while a request is in
 * our hands, it detaches the request and hands it to us: on_client_close
 * frees it.
 */
#include <errno.h>
#include <event2/buffer.h>
#include <event2/bufferevent.h>
#include <event2/event.h>
#include <event2/http.h>
#include <event2/http_struct.h>
#include <event2/keyvalq_struct.h>
#include <poll.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/socket.h>
#include <time.h>

#include "openai.h"
#include "server.h"

struct srv_req;

/* One choice: an engine request of its own. */
struct choice {
    struct srv_req *q;
    int index;
    uint64_t id;
    bool done;
    /* streamed chat with --reasoning-parser / --tool-call-parser: the text
     * goes through both parsers as it arrives */
    bool parse;
    struct api_reasoning rp;
    struct api_toolcall tp;
    int n_calls;
    bool args_started;            /* a forced tool call's arguments: past their leading whitespace */
};

struct srv_req {
    struct pending base;          /* metrics and bookkeeping */
    struct api_oai_req r;
    struct evhttp_connection *con;
    struct event *hangup;         /* the socket watcher (top of the file); NULL once detached */
    struct event *probe;          /* after the client's FIN: is it gone or half-closed? (top of the file) */
    int n, n_done;                /* choices submitted, finished */
    bool failed;                  /* a choice ended in an engine error */
    bool responses;               /* POST /v1/responses: Response objects and its stream events */
    int seq;                      /* /v1/responses stream: the next event's sequence_number */
    char error[160];
    struct sched_usage usage;     /* the prompt's (first choice), completion tokens summed */
    struct api_oai_result *res;   /* [n] owned: choice i's output so far (non-streamed, and streams that
                                     need the whole text: required tool_choice, /v1/responses) */
    char *resp_echo;              /* owned: /v1/responses, the request's settings the Response echoes */
    struct srv_req *lprev, *lnext; /* server.live */
    bool linked;
    struct choice ch[];           /* [n] */
};

static void live_unlink(struct server *s, struct srv_req *q)
{
    if (!q->linked) return;
    if (q->lprev) q->lprev->lnext = q->lnext;
    else s->live = q->lnext;
    if (q->lnext) q->lnext->lprev = q->lprev;
    q->linked = false;
}

void srv_abort_interactive(struct server *s)
{
    for (struct srv_req *q = s->live; q; q = q->lnext)
        for (int i = 0; i < q->n; i++)
            if (!q->ch[i].done) sched_engine_abort(s->eng, q->ch[i].id);
}

static void reply_oai_error(struct server *s, struct evhttp_request *req, const struct api_oai_error *e)
{
    s->n_requests_err++;
    srv_reply_error(req, e->status, e->type ? e->type : "invalid_request_error", e->param[0] ? e->param : NULL, "%s",
                    e->message);
}

static void make_id(char *out, size_t cap, bool chat)
{
    static uint64_t counter;
    uint64_t x = ((uint64_t)time(NULL) << 20) ^ ++counter ^ ((uint64_t)(uintptr_t)out << 7);
    x ^= x >> 29;
    x *= 0xbf58476d1ce4e5b9ULL;
    snprintf(out, cap, "%s-%016llx%04llx", chat ? "chatcmpl" : "cmpl", (unsigned long long)x,
             (unsigned long long)(counter & 0xffff));
}

/* The client is gone: every choice still running is aborted; their finish
 * events free q. */
static void client_gone(struct srv_req *q)
{
    q->base.req = NULL;
    q->con = NULL;
    for (int i = 0; i < q->n; i++)
        if (!q->ch[i].done) sched_engine_abort(q->base.srv->eng, q->ch[i].id);
}

static void unwatch(struct srv_req *q)
{
    if (q->hangup) event_free(q->hangup);
    q->hangup = NULL;
    if (q->probe) event_free(q->probe);
    q->probe = NULL;
}

/* evhttp closes the connection (a failed write, a timeout). A request it had
 * detached from the connection (EOF or a timeout before our reply ended) is
 * ours to free; one still on the connection it frees itself. */
static void on_client_close(struct evhttp_connection *con, void *arg)
{
    (void)con;
    struct srv_req *q = arg;
    struct evhttp_request *req = q->base.req;
    if (!req) return;
    unwatch(q);
    client_gone(q);
    if (!evhttp_request_get_connection(req)) evhttp_request_free(req);
}

/* The client is gone for good: its connection (and with it the request) is
 * freed and its choices aborted. */
static void drop_client(struct srv_req *q)
{
    struct evhttp_connection *con = q->con;
    unwatch(q);
    evhttp_connection_set_closecb(con, NULL, NULL);
    client_gone(q);
    evhttp_connection_free(con); /* frees the request too; nothing names it any more */
}

static evutil_socket_t client_fd(const struct srv_req *q)
{
    struct bufferevent *bev = q->con ? evhttp_connection_get_bufferevent(q->con) : NULL;
    return bev ? bufferevent_getfd(bev) : -1;
}

/* After a write of ours evhttp reads again, to see a close; a client that
 * half-closed would have its reply dropped at that EOF. The watcher (and
 * the probe) see closes instead: evhttp reads nothing until the reply ends. */
static void hold_read(struct srv_req *q)
{
    if (q->con) bufferevent_disable(evhttp_connection_get_bufferevent(q->con), EV_READ);
}

static void send_chunk(struct srv_req *q, struct evbuffer *out)
{
    evhttp_send_reply_chunk(q->base.req, out);
    hold_read(q);
}

/* The last write of a stream. Unchunked (HTTP/1.0) with nothing left to
 * write, evhttp finishes at once and may free the connection: no hold then. */
static void end_stream(struct srv_req *q)
{
    bool chunked = evhttp_find_header(evhttp_request_get_output_headers(q->base.req), "Transfer-Encoding");
    evhttp_send_reply_end(q->base.req);
    if (chunked) hold_read(q);
}

/* A write a closed socket answers with a reset; harmless to a client that
 * still reads: an SSE comment in a stream, an interim 100 before an
 * unstreamed HTTP/1.1 reply (nothing of the reply is written yet, so it goes
 * straight to the socket). HTTP/1.0 gets none: the reset shows at the reply. */
static void send_probe(struct srv_req *q)
{
    struct evhttp_request *req = q->base.req;
    if (q->base.stream) {
        struct evbuffer *out = evbuffer_new();
        if (!out) return;
        evbuffer_add(out, ":\n\n", 3);
        send_chunk(q, out);
        evbuffer_free(out);
    } else if (req->major == 1 && req->minor >= 1) {
        evutil_socket_t fd = client_fd(q);
        static const char cont[] = "HTTP/1.1 100 Continue\r\n\r\n";
        if (fd >= 0 && send(fd, cont, sizeof cont - 1, MSG_NOSIGNAL | MSG_DONTWAIT) < 0 && errno != EAGAIN)
            drop_client(q);
    }
}

/* The probe's timer: a reset (POLLHUP/POLLERR) means the client closed its
 * socket; otherwise it is half-closed and waiting, and is probed again. */
static void on_probe(evutil_socket_t unused, short what, void *arg)
{
    (void)unused;
    (void)what;
    struct srv_req *q = arg;
    if (!q->base.req) return;
    struct pollfd p = {.fd = client_fd(q), .events = POLLOUT};
    if (p.fd < 0 || (poll(&p, 1, 0) == 1 && (p.revents & (POLLHUP | POLLERR)))) {
        drop_client(q);
        return;
    }
    send_probe(q);
    if (!q->base.req) return;
    struct timeval tv = {1, 0};
    event_add(q->probe, &tv);
}

/* The watcher: EV_CLOSED, or EV_READ with bytes to peek at. Bytes mean the
 * client pipelined its next request (rare): stop watching, evhttp reads them
 * after the reply. No bytes: the client's FIN, and the probe starts. */
static void on_hangup(evutil_socket_t fd, short what, void *arg)
{
    struct srv_req *q = arg;
    if (!q->base.req) return;
    if (!(what & EV_CLOSED)) {
        char c;
        ssize_t r = recv(fd, &c, 1, MSG_PEEK | MSG_DONTWAIT);
        if (r > 0 || (r < 0 && (errno == EAGAIN || errno == EWOULDBLOCK || errno == EINTR))) {
            unwatch(q);
            return;
        }
    }
    unwatch(q);
    hold_read(q);
    q->probe = evtimer_new(q->base.srv->base, on_probe, q);
    if (!q->probe) {
        drop_client(q);
        return;
    }
    send_probe(q);
    if (!q->base.req) return;
    /* a closed client's reset comes back within a round trip */
    struct timeval tv = {0, 200 * 1000};
    event_add(q->probe, &tv);
}

static void watch(struct server *s, struct srv_req *q)
{
    struct bufferevent *bev = q->con ? evhttp_connection_get_bufferevent(q->con) : NULL;
    evutil_socket_t fd = bev ? bufferevent_getfd(bev) : -1;
    if (fd < 0) return;
    bool early = event_base_get_features(s->base) & EV_FEATURE_EARLY_CLOSE;
    q->hangup = event_new(s->base, fd, early ? EV_CLOSED : EV_READ, on_hangup, q);
    if (q->hangup && event_add(q->hangup, NULL)) unwatch(q);
}

static void detach(struct srv_req *q)
{
    unwatch(q);
    if (q->con) evhttp_connection_set_closecb(q->con, NULL, NULL);
    q->con = NULL;
    q->base.req = NULL;
}

static struct srv_req *new_req(int n)
{
    struct srv_req *q = calloc(1, sizeof *q + (size_t)n * sizeof(struct choice));
    if (q) q->res = calloc((size_t)n, sizeof *q->res);
    if (!q || !q->res) {
        free(q);
        return NULL;
    }
    q->n = n;
    for (int i = 0; i < n; i++) {
        q->ch[i].q = q;
        q->ch[i].index = i;
        api_oai_result_init(&q->res[i]);
    }
    return q;
}

static void free_req(struct srv_req *q)
{
    for (int i = 0; i < q->n; i++) {
        if (q->ch[i].parse) api_toolcall_free(&q->ch[i].tp);
        api_oai_result_free(&q->res[i]);
    }
    api_oai_req_free(&q->r);
    free(q->res);
    free(q->resp_echo);
    free(q);
}

/* ---- streaming ---- */

static void send_sse(struct srv_req *q, const struct json_buf *b)
{
    struct evbuffer *out = evbuffer_new();
    if (!out) return;
    evbuffer_add(out, "data: ", 6);
    evbuffer_add(out, b->p, b->len);
    evbuffer_add(out, "\n\n", 2);
    send_chunk(q, out);
    evbuffer_free(out);
}

/* Appends the common head of a chunk object, up to and including "choices":[ */
static void chunk_head(struct json_buf *b, const struct srv_req *q, const char *model)
{
    json_buf_lit(b, "{\"id\":");
    json_buf_add_str(b, q->base.rid, strlen(q->base.rid));
    json_buf_addf(b, ",\"object\":\"%s\",\"created\":%ld,\"model\":",
                  q->base.chat ? "chat.completion.chunk" : "text_completion", q->base.created);
    json_buf_add_str(b, model, strlen(model));
    json_buf_lit(b, ",\"choices\":[");
}

/* One choice delta: text (may be empty), reasoning text and tool-call objects
 * (chat with parsers; may be NULL), logprobs JSON (or NULL), finish reason
 * (or NULL). */
struct delta {
    int index;                    /* the choice */
    const char *text;
    size_t len;
    const struct json_buf *reasoning, *calls;
    const char *lp, *finish;
    bool role;
};

static void send_delta(struct server *s, struct srv_req *q, const struct delta *d)
{
    struct json_buf b;
    json_buf_init(&b);
    chunk_head(&b, q, s->model_name);
    json_buf_addf(&b, "{\"index\":%d,", d->index);
    if (q->base.chat) {
        json_buf_lit(&b, "\"delta\":{");
        bool comma = false;
        if (d->role) {
            json_buf_lit(&b, "\"role\":\"assistant\"");
            comma = true;
        }
        if (d->len || d->role || (!d->finish && !d->reasoning && !d->calls)) {
            if (comma) json_buf_lit(&b, ",");
            json_buf_lit(&b, "\"content\":");
            json_buf_add_str(&b, d->text, d->len);
            comma = true;
        }
        if (d->reasoning && d->reasoning->len) {
            if (comma) json_buf_lit(&b, ",");
            /* "reasoning" as vLLM writes it now; "reasoning_content" for older clients */
            json_buf_lit(&b, "\"reasoning\":");
            json_buf_add_str(&b, d->reasoning->p, d->reasoning->len);
            json_buf_lit(&b, ",\"reasoning_content\":");
            json_buf_add_str(&b, d->reasoning->p, d->reasoning->len);
            comma = true;
        }
        if (d->calls && d->calls->len) {
            if (comma) json_buf_lit(&b, ",");
            json_buf_addf(&b, "\"tool_calls\":[%s]", d->calls->p);
        }
        json_buf_lit(&b, "}");
    } else {
        json_buf_lit(&b, "\"text\":");
        json_buf_add_str(&b, d->text, d->len);
    }
    json_buf_lit(&b, ",\"logprobs\":");
    if (d->lp) json_buf_add(&b, d->lp, strlen(d->lp));
    else json_buf_lit(&b, "null");
    json_buf_lit(&b, ",\"finish_reason\":");
    if (d->finish) json_buf_addf(&b, "\"%s\"", d->finish);
    else json_buf_lit(&b, "null");
    json_buf_lit(&b, "}]}");
    send_sse(q, &b);
    json_buf_free(&b);
}

/* Runs choice c's text through the reasoning then the tool-call parser
 * (flush: the end of the output) and sends what they released as one delta. */
static void send_parsed(struct server *s, struct choice *c, const char *text, size_t len, const char *lp, bool flush)
{
    struct json_buf rs, mid, content, calls;
    json_buf_init(&rs), json_buf_init(&mid), json_buf_init(&content), json_buf_init(&calls);
    api_reasoning_feed(&c->rp, text, len, &rs, &mid);
    if (flush) api_reasoning_flush(&c->rp, &rs, &mid);
    api_toolcall_feed(&c->tp, mid.p ? mid.p : "", mid.len, &content, &calls);
    if (flush) api_toolcall_flush(&c->tp, &content, &calls);
    c->n_calls = c->tp.n_calls;
    if (content.len || rs.len || calls.len || lp) {
        struct delta d = {.index = c->index, .text = content.p ? content.p : "", .len = content.len, .reasoning = &rs,
                          .calls = &calls, .lp = lp};
        send_delta(s, c->q, &d);
    }
    json_buf_free(&rs), json_buf_free(&mid), json_buf_free(&content), json_buf_free(&calls);
}

static void usage_json(struct json_buf *b, const struct server *s, const struct sched_usage *u)
{
    json_buf_addf(b, "{\"prompt_tokens\":%d,\"total_tokens\":%d,\"completion_tokens\":%d", u->prompt_tokens,
                  u->prompt_tokens + u->completion_tokens, u->completion_tokens);
    if (s->o.enable_prompt_tokens_details) json_buf_addf(b, ",\"prompt_tokens_details\":{\"cached_tokens\":%d}", u->cached_tokens);
    json_buf_lit(b, "}");
}

/* The logprobs JSON of one token event, as a stream chunk carries it. */
static char *event_logprobs(const struct srv_req *q, const model_tok *tok, const struct sched_event *ev)
{
    if (!q->r.logprobs || !ev->has_logprobs) return NULL;
    struct api_oai_result one;
    api_oai_result_init(&one);
    api_oai_result_add(&one, &q->r, tok, ev);
    struct json_buf b;
    json_buf_init(&b);
    if (q->base.chat) {
        json_buf_lit(&b, "{\"content\":[");
        if (one.lp.p) json_buf_add(&b, one.lp.p, one.lp.len);
        json_buf_lit(&b, "]}");
    } else {
        json_buf_addf(&b, "{\"tokens\":[%s],\"token_logprobs\":[%s],\"top_logprobs\":[%s],\"text_offset\":[%s]}",
                      one.lp.p ? one.lp.p : "", one.lp_vals.p ? one.lp_vals.p : "",
                      one.lp_top.p ? one.lp_top.p : "", one.lp_off.p ? one.lp_off.p : "");
    }
    api_oai_result_free(&one);
    return b.p;
}

/* /v1/responses streaming: one event ("event:" and "data:" lines). fields:
 * the JSON members after "type" and "sequence_number", without braces. */
static void send_resp_event(struct srv_req *q, const char *type, const struct json_buf *fields)
{
    struct evbuffer *out = evbuffer_new();
    if (!out) return;
    evbuffer_add_printf(out, "event: %s\ndata: {\"type\":\"%s\",\"sequence_number\":%d", type, type, q->seq++);
    if (fields && fields->len) {
        evbuffer_add(out, ",", 1);
        evbuffer_add(out, fields->p, fields->len);
    }
    evbuffer_add(out, "}\n\n", 3);
    send_chunk(q, out);
    evbuffer_free(out);
}

/* Whether a /v1/responses request may call tools: then its text is not
 * streamed as it comes (it may be a call), the items go out at the end. */
static bool resp_tools(const struct srv_req *q) { return q->r.tools || q->r.forced_tool || q->r.forced_list; }

/* The finished Response object, built from the chat reply it was run as. */
static void resp_final(struct server *s, struct srv_req *q, struct json_buf *out)
{
    struct json_buf chat;
    json_buf_init(&chat);
    api_oai_response_json(&chat, &q->r, &q->res[0], q->base.rid, q->base.created, s->model_name);
    api_resp_from_chat(out, chat.p ? chat.p : "", chat.len, q->base.rid, q->base.created, s->model_name, q->resp_echo);
    json_buf_free(&chat);
}

/* The response object as an event member: "response": {...}. */
static void resp_event(struct server *s, struct srv_req *q, const char *type, const char *status)
{
    struct json_buf f;
    json_buf_init(&f);
    const struct api_oai_result *res = &q->res[0];
    json_buf_lit(&f, "\"response\":");
    api_resp_json(&f, q->base.rid, q->base.created, s->model_name, status, res->text.p ? res->text.p : "",
                  res->text.len, &q->usage, res->finish, q->resp_echo);
    send_resp_event(q, type, &f);
    json_buf_free(&f);
}

/* The events around the text: item and part added (start) or done (end). */
static void resp_frame_events(struct srv_req *q, bool start)
{
    const struct api_oai_result *res = &q->res[0];
    const char *st = start ? "in_progress" : "completed";
    struct json_buf f;
    json_buf_init(&f);
    if (!start) {
        json_buf_addf(&f, "\"item_id\":\"msg_%s\",\"output_index\":0,\"content_index\":0,\"text\":", q->base.rid);
        json_buf_add_str(&f, res->text.p ? res->text.p : "", res->text.len);
        send_resp_event(q, "response.output_text.done", &f);
        f.len = 0;
    }
    json_buf_addf(&f, "\"item_id\":\"msg_%s\",\"output_index\":0,\"content_index\":0,\"part\":{\"type\":"
                      "\"output_text\",\"text\":", q->base.rid);
    if (start) json_buf_lit(&f, "\"\"");
    else json_buf_add_str(&f, res->text.p ? res->text.p : "", res->text.len);
    json_buf_lit(&f, ",\"annotations\":[]}");
    struct json_buf item;
    json_buf_init(&item);
    json_buf_addf(&item, "\"output_index\":0,\"item\":{\"type\":\"message\",\"id\":\"msg_%s\",\"status\":\"%s\","
                         "\"role\":\"assistant\",\"content\":[",
                  q->base.rid, st);
    if (!start) {
        json_buf_lit(&item, "{\"type\":\"output_text\",\"text\":");
        json_buf_add_str(&item, res->text.p ? res->text.p : "", res->text.len);
        json_buf_lit(&item, ",\"annotations\":[]}");
    }
    json_buf_lit(&item, "]}");
    if (start) {
        send_resp_event(q, "response.output_item.added", &item);
        send_resp_event(q, "response.content_part.added", &f);
    } else {
        send_resp_event(q, "response.content_part.done", &f);
        send_resp_event(q, "response.output_item.done", &item);
    }
    json_buf_free(&f);
    json_buf_free(&item);
}

/* A named tool_choice: a piece of the forced call's arguments as a delta. */
static void send_arguments(struct server *s, struct choice *c, const char *text, size_t len, const char *lp)
{
    /* the grammar lets JSON start after whitespace; arguments start at the brace, as vLLM's do */
    if (!c->args_started) {
        while (len && strchr(" \t\r\n", *text)) text++, len--;
        if (!len && !lp) return;
        c->args_started = len > 0;
    }
    struct json_buf calls;
    json_buf_init(&calls);
    json_buf_lit(&calls, "{\"index\":0,\"function\":{\"arguments\":");
    json_buf_add_str(&calls, text, len);
    json_buf_lit(&calls, "}}");
    struct delta d = {.index = c->index, .text = "", .calls = &calls, .lp = lp};
    send_delta(s, c->q, &d);
    json_buf_free(&calls);
}

/* Streams one event of choice c. */
static void stream_event(struct server *s, struct choice *c, const struct sched_event *ev)
{
    struct srv_req *q = c->q;
    const model_tok *tok = model_get_tok(s->m);
    if (q->responses) {
        if (resp_tools(q) && ev->finish != SCHED_FINISH_ERROR) return; /* the items go out at the end */
        struct json_buf f;
        json_buf_init(&f);
        if (ev->kind != SCHED_EV_TOKEN && ev->finish == SCHED_FINISH_ERROR) {
            json_buf_lit(&f, "\"code\":\"server_error\",\"message\":");
            json_buf_add_str(&f, ev->error, strlen(ev->error));
            send_resp_event(q, "error", &f);
        } else if (ev->text_len) { /* a token's text, or text a stop check held back until the finish */
            json_buf_addf(&f, "\"item_id\":\"msg_%s\",\"output_index\":0,\"content_index\":0,\"delta\":", q->base.rid);
            json_buf_add_str(&f, ev->text, ev->text_len);
            send_resp_event(q, "response.output_text.delta", &f);
        }
        json_buf_free(&f);
        return;
    }
    if (ev->kind == SCHED_EV_TOKEN) {
        if (q->r.forced_list) return; /* the calls go out whole at the finish */
        char *lp = event_logprobs(q, tok, ev);
        if (q->r.forced_tool) {
            /* a named tool_choice: the text is the call's arguments, streamed as they come */
            if (ev->text_len || lp) send_arguments(s, c, ev->text, ev->text_len, lp);
        } else if (c->parse) {
            send_parsed(s, c, ev->text, ev->text_len, lp, false);
        } else if (ev->text_len || lp) {
            struct delta d = {.index = c->index, .text = ev->text, .len = ev->text_len, .lp = lp};
            send_delta(s, q, &d);
        }
        free(lp);
        return;
    }
    if (ev->finish == SCHED_FINISH_ERROR) {
        struct api_oai_error e = {.status = 500, .type = "server_error"};
        snprintf(e.message, sizeof e.message, "%s", ev->error);
        struct json_buf b;
        json_buf_init(&b);
        api_oai_error_json(&b, &e);
        send_sse(q, &b);
        json_buf_free(&b);
        return;
    }
    if (q->failed) return; /* a sibling failed: its error ended the stream's content */
    if (q->r.forced_list) {
        struct json_buf calls;
        json_buf_init(&calls);
        const struct api_oai_result *res = &q->res[c->index];
        if (api_oai_list_calls(&calls, res->text.p ? res->text.p : "", res->text.len, q->base.rid, c->index, true)) {
            struct delta d = {.index = c->index, .text = "", .calls = &calls};
            send_delta(s, q, &d);
            struct delta fin = {.index = c->index, .text = "", .finish = "tool_calls"};
            send_delta(s, q, &fin);
        } else { /* cut short: what was written, as content */
            struct delta d = {.index = c->index, .text = res->text.p ? res->text.p : "", .len = res->text.len};
            send_delta(s, q, &d);
            struct delta fin = {.index = c->index, .text = "", .finish = sched_finish_name(ev->finish)};
            send_delta(s, q, &fin);
        }
        json_buf_free(&calls);
        return;
    }
    if (q->r.forced_tool) {
        if (ev->text_len) send_arguments(s, c, ev->text, ev->text_len, NULL);
    } else if (c->parse) {
        send_parsed(s, c, ev->text, ev->text_len, NULL, true);
    } else if (ev->text_len) {
        struct delta d = {.index = c->index, .text = ev->text, .len = ev->text_len};
        send_delta(s, q, &d);
    }
    const char *fin = sched_finish_name(ev->finish);
    if ((c->n_calls > 0 || q->r.forced_required) && ev->finish == SCHED_FINISH_STOP) fin = "tool_calls";
    struct delta d = {.index = c->index, .text = "", .finish = fin};
    send_delta(s, q, &d);
}

/* After the last choice: the usage chunk (include_usage) and [DONE]. */
static void stream_end(struct server *s, struct srv_req *q)
{
    if (q->responses) {
        if (!q->failed) {
            struct json_buf r, f;
            json_buf_init(&r), json_buf_init(&f);
            resp_final(s, q, &r);
            if (resp_tools(q)) {
                /* each output item (a message, function calls) whole */
                json_doc d;
                char err[64];
                if (r.p && !json_parse(&d, r.p, r.len, err, sizeof err)) {
                    int out = json_get(&d, 0, "output");
                    for (int k = 0; out >= 0 && k < json_size(&d, out); k++) {
                        size_t n = 0;
                        int it = json_at(&d, out, k);
                        const char *raw = json_raw(&d, it, &n);
                        int ty = json_get(&d, it, "type"), ar = json_get(&d, it, "arguments");
                        f.len = 0;
                        json_buf_addf(&f, "\"output_index\":%d,\"item\":", k);
                        json_buf_add(&f, raw, n);
                        send_resp_event(q, "response.output_item.added", &f);
                        if (ty >= 0 && json_str_eq(&d, ty, "function_call") && ar >= 0) {
                            size_t an = 0;
                            const char *araw = json_raw(&d, ar, &an);
                            int id = json_get(&d, it, "id");
                            size_t in = 0;
                            const char *iraw = id >= 0 ? json_raw(&d, id, &in) : "";
                            struct json_buf a;
                            json_buf_init(&a);
                            json_buf_lit(&a, "\"item_id\":\"");
                            json_buf_add(&a, iraw, in);
                            json_buf_addf(&a, "\",\"output_index\":%d,\"arguments\":\"", k);
                            json_buf_add(&a, araw, an);
                            json_buf_lit(&a, "\"");
                            send_resp_event(q, "response.function_call_arguments.done", &a);
                            json_buf_free(&a);
                        }
                        send_resp_event(q, "response.output_item.done", &f);
                    }
                    json_free(&d);
                }
            } else {
                resp_frame_events(q, false);
            }
            bool cut = q->res[0].finish == SCHED_FINISH_LENGTH || q->res[0].finish == SCHED_FINISH_ABORT;
            f.len = 0;
            json_buf_lit(&f, "\"response\":");
            json_buf_add(&f, r.p ? r.p : "{}", r.p ? r.len : 2);
            send_resp_event(q, cut ? "response.incomplete" : "response.completed", &f);
            json_buf_free(&r), json_buf_free(&f);
        }
        end_stream(q);
        return;
    }
    if (q->base.include_usage && !q->failed) {
        struct json_buf b;
        json_buf_init(&b);
        chunk_head(&b, q, s->model_name);
        json_buf_lit(&b, "],\"usage\":");
        usage_json(&b, s, &q->usage);
        json_buf_lit(&b, "}");
        send_sse(q, &b);
        json_buf_free(&b);
    }
    struct evbuffer *out = evbuffer_new();
    if (out) {
        evbuffer_add(out, "data: [DONE]\n\n", 14);
        send_chunk(q, out);
        evbuffer_free(out);
    }
    end_stream(q);
}

/* ---- events ---- */

/* Once per request, when its last choice finished. */
static void finish_metrics(struct server *s, struct srv_req *q)
{
    /* a request whose client went away was not answered: it is no success */
    if (q->failed || !q->base.req) s->n_requests_err++;
    else s->n_requests_ok++;
    s->prompt_tokens_total += (uint64_t)q->usage.prompt_tokens;
    s->generation_tokens_total += (uint64_t)q->usage.completion_tokens;
    s->cached_tokens_total += (uint64_t)q->usage.cached_tokens;
    srv_hist_add(&s->queue, q->usage.queue_s);
    srv_hist_add(&s->e2e, srv_now() - q->base.t_submit);
}

/* Choice c finished with ev: folds its usage into the request's. */
static void choice_finished(struct server *s, struct choice *c, const struct sched_event *ev)
{
    struct srv_req *q = c->q;
    c->done = true;
    if (q->n_done++ == 0) q->usage.ttft_s = -1;
    /* completions summed; each prompt counted once (its first choice) */
    q->usage.completion_tokens += ev->usage.completion_tokens;
    if (c->index % (q->r.n > 1 ? q->r.n : 1) == 0) {
        q->usage.prompt_tokens += ev->usage.prompt_tokens;
        q->usage.cached_tokens += ev->usage.cached_tokens;
    }
    if (q->usage.ttft_s < 0 || (ev->usage.ttft_s >= 0 && ev->usage.ttft_s < q->usage.ttft_s))
        q->usage.ttft_s = ev->usage.ttft_s;
    if (q->n_done == 1 || ev->usage.queue_s < q->usage.queue_s) q->usage.queue_s = ev->usage.queue_s;
    if (ev->finish == SCHED_FINISH_ERROR && !q->failed) {
        q->failed = true;
        snprintf(q->error, sizeof q->error, "%s", ev->error);
        /* the other choices cannot make the reply whole: stop them */
        for (int i = 0; i < q->n; i++)
            if (!q->ch[i].done) sched_engine_abort(s->eng, q->ch[i].id);
    }
}

void srv_drain_events(struct server *s)
{
    if (!s->sink) return;
    int n = sched_sink_poll(s->sink, &s->evbuf);
    const model_tok *tok = model_get_tok(s->m);
    for (int i = 0; i < n; i++) {
        const struct sched_event *ev = &s->evbuf.ev[i];
        if (!ev->user) continue;
        if (ev->kind == SCHED_EV_FINISH) srv_metrics_finish(s, ev, false); /* batch rows: server_batch.c */
        struct choice *c = ev->user;
        struct srv_req *q = c->q;
        if (q->base.req) {
            /* a streamed "required" tool_choice sends its calls whole at the end: it needs the text too */
            if (!q->base.stream || q->r.forced_list || q->responses) api_oai_result_add(&q->res[c->index], &q->r, tok, ev);
            if (q->base.stream) stream_event(s, c, ev);
        }
        if (ev->kind != SCHED_EV_FINISH) continue;
        choice_finished(s, c, ev);
        if (q->n_done < q->n) continue;
        finish_metrics(s, q);
        if (q->base.req) {
            /* no callback from here on: the last write may end the request
             * (and its connection) before it returns */
            unwatch(q);
            if (q->con) evhttp_connection_set_closecb(q->con, NULL, NULL);
        }
        if (q->base.req && q->base.stream) {
            stream_end(s, q);
        } else if (q->base.req) {
            if (q->failed) {
                srv_reply_error(q->base.req, 500, "server_error", NULL, "%s", q->error);
            } else {
                struct json_buf b;
                json_buf_init(&b);
                if (q->responses) resp_final(s, q, &b);
                else api_oai_response_json(&b, &q->r, q->res, q->base.rid, q->base.created, s->model_name);
                srv_reply_json(q->base.req, 200, &b);
                json_buf_free(&b);
            }
            hold_read(q); /* evhttp_send_reply writes later: the connection is still there */
        }
        q->con = NULL; /* it may be gone already (see end_stream) */
        detach(q);
        live_unlink(s, q);
        s->n_pending--;
        free_req(q);
    }
}

/* ---- the handler ---- */

static void handle(struct server *s, struct evhttp_request *req, char *body, size_t len, bool chat, bool responses,
                   char *resp_echo);

void srv_handle_completions(struct server *s, struct evhttp_request *req, bool chat)
{
    size_t len;
    char *body = srv_read_body(req, s->o.max_body_bytes, &len);
    if (!body) {
        s->n_requests_err++;
        return;
    }
    handle(s, req, body, len, chat, false, NULL);
}

void srv_handle_responses(struct server *s, struct evhttp_request *req)
{
    size_t len;
    char *body = srv_read_body(req, s->o.max_body_bytes, &len);
    if (!body) {
        s->n_requests_err++;
        return;
    }
    struct json_buf chat;
    json_buf_init(&chat);
    struct api_oai_error e = {0};
    struct json_buf echo;
    json_buf_init(&echo);
    int rc = api_oai_check_utf8(body, len, &e);
    if (!rc) rc = api_resp_to_chat(body, len, &chat, &e);
    if (!rc && api_resp_echo(body, len, &echo)) rc = api_oai_errorf(&e, 500, NULL, "out of memory");
    free(body);
    if (rc) {
        json_buf_free(&chat);
        json_buf_free(&echo);
        reply_oai_error(s, req, &e);
        return;
    }
    handle(s, req, chat.p, chat.len, true, true, echo.p); /* takes both buffers */
}

/* Parses body (owned: freed here), submits its choices and answers or starts
 * the stream. responses: the request came through /v1/responses. */
static void handle(struct server *s, struct evhttp_request *req, char *body, size_t len, bool chat, bool responses,
                   char *resp_echo)
{
    struct api_oai_error e = {0};
    json_doc d = {0};
    int32_t *ids = NULL;
    struct srv_req *q = NULL;
    struct api_oai_req r;
    memset(&r, 0, sizeof r);
    bool include_usage = false;
    char perr[256];
    if (api_oai_check_utf8(body, len, &e)) goto fail;
    if (json_parse(&d, body, len, perr, sizeof perr)) {
        api_oai_errorf(&e, 400, NULL, "request body is not valid JSON: %s", perr);
        goto fail;
    }
    if (api_oai_parse_doc(&d, 0, chat ? API_OAI_CHAT : API_OAI_COMPLETIONS, s->model_names, &r, &e)) goto fail;
    if (api_oai_prepare(&r, model_get_tok(s->m), &e)) goto fail;
    if (api_oai_wants_prompt_logprobs(&r) && !s->be->has_prompt_logprobs) {
        api_oai_errorf(&e, 400, r.prompt_logprobs >= 0 ? "prompt_logprobs" : "echo",
                       "prompt logprobs ('prompt_logprobs', or 'echo' with 'logprobs') are not available on the %s "
                       "backend yet", s->be->ops->name);
        goto fail;
    }
    /* what api_oai_parse_doc leaves to the transport: stream_options, priority */
    int so = json_get(&d, 0, "stream_options");
    if (so >= 0 && !json_is_null(&d, so)) {
        int iu = json_get(&d, so, "include_usage");
        if (!json_is_obj(&d, so) || (iu >= 0 && json_bool(&d, iu, &include_usage))) {
            api_oai_errorf(&e, 400, "stream_options", "'stream_options' must be an object with a boolean 'include_usage'");
            goto fail;
        }
        if (!r.stream) {
            api_oai_errorf(&e, 400, "stream_options", "'stream_options' is only allowed when 'stream' is true");
            goto fail;
        }
    }
    enum sched_priority prio = SCHED_PRIO_INTERACTIVE;
    int pr = json_get(&d, 0, "priority");
    if (pr >= 0 && !json_is_null(&d, pr)) {
        int64_t v;
        if (json_i64(&d, pr, &v)) {
            api_oai_errorf(&e, 400, "priority", "'priority' must be an integer");
            goto fail;
        }
        if (v > 0) prio = SCHED_PRIO_BATCH; /* vLLM: lower is sooner; > 0 yields to interactive work */
    }
    q = new_req(api_oai_n_choices(&r));
    if (!q) {
        api_oai_errorf(&e, 500, NULL, "out of memory");
        goto fail;
    }
    q->r = r; /* q owns the parsed request from here */
    memset(&r, 0, sizeof r);
    q->responses = responses;
    q->resp_echo = resp_echo;
    resp_echo = NULL;
    q->base.include_usage = include_usage;
    /* each prompt's choices share it: after the first, its blocks come from the prefix cache */
    int per = q->r.n > 1 ? q->r.n : 1, np = q->r.n_prompts > 0 ? q->r.n_prompts : 1, submitted = 0;
    const model_tok *tok = model_get_tok(s->m);
    int mml = sched_engine_config(s->eng)->max_model_len;
    for (int p = 0; p < np; p++) {
        if (api_oai_check_length(&q->r, q->r.n_prompts ? p : -1, tok, mml, &e)) break;
        int n = q->r.n_prompts ? api_oai_tokenize_prompt(&q->r, p, tok, &ids, &e) : api_oai_tokenize(&q->r, tok, &ids, &e);
        struct sched_request sr;
        if (n < 0 || api_oai_to_sched(&q->r, ids, n, mml, &sr, &e)) break;
        sr.priority = prio;
        sr.sink = s->sink;
        for (int i = 0; i < per; i++) {
            char err[256];
            api_oai_result_echo(&q->res[p * per + i], &q->r, p * per + i, tok, sr.prompt, sr.n_prompt);
            api_oai_choice_sampling(&q->r, i, &sr.sampling);
            sr.user = &q->ch[p * per + i];
            if (sched_engine_submit(s->eng, &sr, &q->ch[p * per + i].id, err, sizeof err)) {
                api_oai_errorf(&e, 400, NULL, "%s", err);
                break;
            }
            submitted++;
        }
        free(ids);
        ids = NULL;
        if (submitted < (p + 1) * per) break;
    }
    if (submitted < q->n) {
        if (submitted == 0) goto fail;
        /* the choices already submitted finish as aborted and free q */
        for (int k = 0; k < submitted; k++) sched_engine_abort(s->eng, q->ch[k].id);
        q->n = submitted;
        q->base.srv = s;
        q->base.t_submit = srv_now();
        s->n_pending++;
        if (responses) api_resp_chat_error(&e);
        reply_oai_error(s, req, &e);
        json_free(&d);
        free(body);
        return;
    }
    free(ids);
    ids = NULL;
    json_free(&d);
    free(body);
    q->base.id = q->ch[0].id;
    q->base.req = req;
    q->base.srv = s;
    q->base.chat = chat;
    q->base.stream = q->r.stream;
    q->base.created = (long)time(NULL);
    q->base.t_submit = srv_now();
    make_id(q->base.rid, sizeof q->base.rid, chat);
    if (responses) { /* resp_<hex>, msg_<hex>: no "chatcmpl-" inside */
        size_t pre = strlen("chatcmpl-");
        memmove(q->base.rid, q->base.rid + pre, strlen(q->base.rid) - pre + 1);
    }
    s->n_pending++;
    q->lnext = s->live;
    if (s->live) s->live->lprev = q;
    s->live = q;
    q->linked = true;
    q->con = evhttp_request_get_connection(req);
    if (q->con) evhttp_connection_set_closecb(q->con, on_client_close, q);
    watch(s, q);
    if (q->base.stream) {
        struct evkeyvalq *h = evhttp_request_get_output_headers(req);
        evhttp_add_header(h, "Content-Type", "text/event-stream");
        evhttp_add_header(h, "Cache-Control", "no-cache");
        evhttp_send_reply_start(req, 200, "OK");
        hold_read(q);
        if (responses) {
            resp_event(s, q, "response.created", "in_progress");
            resp_event(s, q, "response.in_progress", "in_progress");
            if (!resp_tools(q)) resp_frame_events(q, true);
        } else if (chat) {
            int rk, tk;
            api_chat_parsers(&rk, &tk);
            if (!q->r.tools) tk = API_TOOLS_NONE;
            for (int i = 0; i < q->n; i++) {
                struct choice *c = &q->ch[i];
                if (rk || tk) {
                    c->parse = true;
                    api_reasoning_init(&c->rp, rk);
                    api_toolcall_init(&c->tp, tk);
                }
                struct delta dl = {.index = i, .text = "", .role = true};
                send_delta(s, q, &dl);
                if (q->r.forced_tool) {
                    char cid[32];
                    api_oai_forced_call_id(q->base.rid, i, cid);
                    struct json_buf calls;
                    json_buf_init(&calls);
                    json_buf_addf(&calls, "{\"index\":0,\"id\":\"%s\",\"type\":\"function\",\"function\":{\"name\":", cid);
                    json_buf_add_str(&calls, q->r.forced_tool, strlen(q->r.forced_tool));
                    json_buf_lit(&calls, ",\"arguments\":\"\"}}");
                    struct delta dc = {.index = i, .text = "", .calls = &calls};
                    send_delta(s, q, &dc);
                    json_buf_free(&calls);
                }
            }
        } else if (q->r.echo) { /* each choice's text starts with its prompt, as its first chunk */
            for (int i = 0; i < q->n; i++) {
                struct delta de = {.index = i, .text = q->res[i].text.p ? q->res[i].text.p : "", .len = q->res[i].text.len};
                send_delta(s, q, &de);
            }
        }
    }
    return;
fail:
    if (responses) api_resp_chat_error(&e);
    reply_oai_error(s, req, &e);
    free(ids);
    json_free(&d);
    free(body);
    free(resp_echo);
    api_oai_req_free(&r);
    if (q) free_req(q);
}

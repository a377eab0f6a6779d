/* server.c - `sluice serve`: the OpenAI-compatible HTTP server.
 *
 * Wiring: flags (named as vLLM names them) -> libevent evhttp on the api
 * thread -> a loader thread that loads the model, creates the backend and
 * starts the engine -> routes. /health is 503 until the engine runs.
 */
#include <errno.h>
#include <event2/buffer.h>
#include <event2/event.h>
#include <event2/http.h>
#include <event2/keyvalq_struct.h>
#include <event2/thread.h>
#include <math.h>
#include <netdb.h>
#include <netinet/in.h>
#include <pthread.h>
#include <signal.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/resource.h>
#include <sys/socket.h>
#include <time.h>
#include <unistd.h>

#include "api.h"
#include "openai.h"
#include "server.h"

/* ---- model loading (loader thread) ---- */

/* The chat flags (api/chat.c): set by api_cmd_serve, read by the loader thread. */
static struct {
    const char *chat_template, *reasoning_parser, *tool_call_parser;
    bool auto_tool_choice;
} chat_flags;

/* Engine thread -> api thread: safe because the base is made thread-aware. */
static void wake(void *arg)
{
    struct server *s = arg;
    event_active(s->wake_ev, EV_READ, 0);
}

static void *load_main(void *arg)
{
    struct server *s = arg;
    char err[512] = "";
    struct model_load_opts lo = {.progress = true, .tokenizer = s->o.tokenizer, .hf_overrides = s->o.hf_overrides,
                                 .load_format = s->o.load_format, .check_weights = s->o.check_weights};
    s->m = model_load(s->o.model, &lo, err, sizeof err);
    if (!s->m) goto fail;
    if (api_chat_setup(s->m, chat_flags.chat_template, err, sizeof err)) goto fail;
    api_speculative_fit(s->m, "serve", &s->o.sched.spec);
    struct sched_engine_opts eo = {
        .sched = {
            .block_size = (int)s->o.block_size,
            .max_num_seqs = (int)s->o.max_num_seqs,
            .max_num_batched_tokens = (int)s->o.max_num_batched_tokens,
            .max_model_len = (int)s->o.max_model_len,
            .min_batch_share = s->o.sched.min_batch_share,
            .ttft_target_s = s->o.sched.ttft_target_s,
            .itl_target_s = s->o.sched.itl_target_s,
            .itl_auto_factor = s->o.sched.itl_auto_factor,
            .expect_interactive = true, /* a chat may come at any time */
            .long_prefill_token_threshold = (int)s->o.long_prefill_token_threshold,
            .max_num_partial_prefills = (int)s->o.max_num_partial_prefills,
            .max_long_partial_prefills = (int)s->o.max_long_partial_prefills,
            .spec = s->o.sched.spec,
        },
        .enable_prefix_caching = s->o.enable_prefix_caching,
        .mamba_block_size = (int)s->o.mamba_block_size,
    };
    if (s->o.kv_cache_memory) {
        long long kv = api_parse_bytes(s->o.kv_cache_memory);
        eo.kv_cache_bytes = kv > 0 ? (size_t)kv : 0;
        if (kv <= 0) {
            snprintf(err, sizeof err, "invalid --kv-cache-memory '%s' (e.g. 2G, 512M)", s->o.kv_cache_memory);
            goto fail;
        }
    }
    sched_engine_defaults(s->m, &eo);
    struct model_backend_opts bo = {
        .device = s->o.device,
        .n_threads = (int)s->o.threads,
        .max_tokens_per_step = eo.sched.max_num_batched_tokens,
        .max_seqs_per_step = eo.sched.max_num_seqs,
        .max_ctx = eo.sched.max_model_len,
        .tensor_parallel_size = (int)s->o.tensor_parallel_size,
        .kv_cache_dtype = s->o.kv_cache_dtype,
        .enforce_eager = s->o.enforce_eager,
        .max_draft_tokens = s->o.sched.spec.method ? s->o.sched.spec.num_speculative_tokens : 0,
        .mtp = s->o.sched.spec.method == SCHED_SPEC_MTP,
    };
    s->be = model_backend_create(s->m, &bo, err, sizeof err);
    if (!s->be) goto fail;
    if (!s->o.kv_cache_memory && !strcmp(s->be->ops->name, "cuda") &&
        api_gpu_kv_bytes((int)s->o.tensor_parallel_size, s->o.gpu_memory_utilization, "serve", &eo.kv_cache_bytes,
                         err, sizeof err) < 0)
        goto fail;
    s->eng = sched_engine_create(s->be, &eo, err, sizeof err);
    if (!s->eng) goto fail;
    /* the chat requests' own outbox: the Batch API's rows have theirs (server_batch.c) */
    s->sink = sched_sink_create(s->eng, wake, s);
    if (!s->sink) {
        snprintf(err, sizeof err, "out of memory");
        goto fail;
    }
    atomic_store(&s->state, SRV_READY);
    event_active(s->ready_ev, EV_READ, 0);
    return NULL;
fail:
    snprintf(s->load_error, sizeof s->load_error, "%s", err);
    atomic_store(&s->state, SRV_FAILED);
    event_active(s->ready_ev, EV_READ, 0);
    return NULL;
}

/* host as a URL spells it: an IPv6 address in brackets; for the example a
 * client can paste (connect), a wildcard address becomes 127.0.0.1 */
static const char *url_host(const char *host, bool connect, char *buf, size_t len)
{
    if (connect && (!strcmp(host, "0.0.0.0") || !strcmp(host, "::") || !*host)) return "127.0.0.1";
    if (!strchr(host, ':')) return host;
    snprintf(buf, len, "[%s]", host);
    return buf;
}

static void on_ready(evutil_socket_t fd, short what, void *arg)
{
    (void)fd;
    (void)what;
    struct server *s = arg;
    if (atomic_load(&s->state) == SRV_FAILED) {
        fprintf(stderr, "sluice serve: cannot load %s: %s\n", s->o.model, s->load_error);
        event_base_loopbreak(s->base);
        return;
    }
    const struct sched_config *c = sched_engine_config(s->eng);
    char h1[300], h2[300];
    /* the key itself stays out of logs: the example names where it goes */
    fprintf(stderr,
            "sluice serve: %s ready on http://%s:%ld (backend %s, max-model-len %d, max-num-seqs %d, "
            "max-num-batched-tokens %d%s%s%s)\n"
            "try: curl http://%s:%ld/v1/chat/completions -H 'Content-Type: application/json'%s "
            "-d '{\"model\":\"%s\",\"messages\":[{\"role\":\"user\",\"content\":\"Hello!\"}]}'\n",
            s->model_name, url_host(s->o.host, false, h1, sizeof h1), s->o.port, s->be->ops->name, c->max_model_len,
            c->max_num_seqs, c->max_num_batched_tokens, s->o.kv_cache_dtype ? ", kv-cache-dtype " : "",
            s->o.kv_cache_dtype ? s->o.kv_cache_dtype : "",
            s->o.enforce_eager && !strcmp(s->be->ops->name, "cuda") ? ", enforce-eager: no CUDA graphs" : "",
            url_host(s->o.host, true, h2, sizeof h2), s->o.port,
            s->o.api_key && *s->o.api_key ? " -H \"Authorization: Bearer $SLUICE_API_KEY\"" : "", s->model_name);
    if (c->spec.method != SCHED_SPEC_NONE)
        fprintf(stderr, "speculative decoding: %s drafts, up to %d a sequence and step%s\n",
                c->spec.method == SCHED_SPEC_NGRAM ? "n-gram" : "MTP", c->spec.num_speculative_tokens,
                c->spec.method == SCHED_SPEC_NGRAM ? " (prompt lookup)" : "");
    char st[400];
    if (api_state_line(s->eng, st, sizeof st)) fprintf(stderr, "%s\n", st);
    if (s->o.web_ui)
        fprintf(stderr, "web page (chat, batch jobs, status): http://%s:%ld/\n",
                url_host(s->o.host, true, h2, sizeof h2), s->o.port);
}

static void on_wake(evutil_socket_t fd, short what, void *arg)
{
    (void)fd;
    (void)what;
    struct server *s = arg;
    char msg[600];
    /* checked before draining: the failure events of batch requests are not
     * recorded, so their lines stay queued in the store for the next start */
    if (s->eng && sched_engine_fatal(s->eng, msg, sizeof msg)) {
        fprintf(stderr, "sluice serve: %s; stopping (queued batch work resumes at the next start)\n", msg);
        s->fatal = true;
        event_base_loopbreak(s->base);
        return;
    }
    srv_drain_events(arg);
}

/* ---- small routes ---- */

static bool ready_or_503(struct server *s, struct evhttp_request *req)
{
    if (atomic_load(&s->draining)) {
        srv_reply_error(req, 503, "server_error", NULL, "the server is shutting down");
        return false;
    }
    int st = atomic_load(&s->state);
    if (st == SRV_READY) return true;
    srv_reply_error(req, 503, "server_error", NULL, st == SRV_LOADING ? "the model is still loading" : "the model failed to load");
    return false;
}

static void handle_health(struct server *s, struct evhttp_request *req)
{
    if (!ready_or_503(s, req)) return;
    struct json_buf b;
    json_buf_init(&b);
    srv_batch_health_json(s, &b); /* empty while all is well, as vLLM's */
    srv_reply_json(req, 200, &b);
    json_buf_free(&b);
}

/* GET /v1/models (id NULL: the list) or /v1/models/{id} (the one model, or 404). */
static void handle_models(struct server *s, struct evhttp_request *req, const char *id)
{
    if (id && !api_oai_model_known(s->model_names, id)) {
        srv_reply_error(req, 404, "invalid_request_error", "model", "The model `%s` does not exist.", id);
        return;
    }
    struct json_buf b;
    json_buf_init(&b);
    int max_len = s->eng ? sched_engine_config(s->eng)->max_model_len : (int)s->o.max_model_len;
    if (!id) json_buf_lit(&b, "{\"object\":\"list\",\"data\":[");
    for (int i = 0; s->model_names[i]; i++) { /* the list: every served name, as vLLM */
        const char *name = id ? id : s->model_names[i];
        if (i) json_buf_lit(&b, ",");
        json_buf_lit(&b, "{\"id\":");
        json_buf_add_str(&b, name, strlen(name));
        json_buf_addf(&b, ",\"object\":\"model\",\"created\":%ld,\"owned_by\":\"sluice\",\"root\":", (long)time(NULL));
        json_buf_add_str(&b, s->o.model, strlen(s->o.model));
        json_buf_addf(&b, ",\"parent\":null,\"max_model_len\":%d}", max_len);
        if (id) break;
    }
    if (!id) json_buf_lit(&b, "]}");
    srv_reply_json(req, 200, &b);
    json_buf_free(&b);
}

/* Parses the JSON body of a POST; replies with an error and returns -1 when
 * it is missing, too big, not JSON or not an object. */
static int read_json(struct server *s, struct evhttp_request *req, char **body, json_doc *d)
{
    size_t len;
    *body = srv_read_body(req, s->o.max_body_bytes, &len);
    if (!*body) return -1;
    char err[256];
    if (json_parse(d, *body, len, err, sizeof err) || !json_is_obj(d, 0)) {
        if (d->tok) json_free(d);
        srv_reply_error(req, 400, "invalid_request_error", NULL, "request body is not a JSON object: %s",
                        err[0] ? err : "expected {...}");
        free(*body);
        *body = NULL;
        return -1;
    }
    return 0;
}

/* llama.cpp's /apply-template: a chat body in, {"prompt": "..."} out (the
 * text the model would be prompted with, before tokenization). */
static void handle_apply_template(struct server *s, struct evhttp_request *req)
{
    if (!ready_or_503(s, req)) return;
    char *body;
    json_doc d;
    if (read_json(s, req, &body, &d)) return;
    struct api_oai_error e = {0};
    char *prompt = NULL;
    size_t plen = 0;
    if (api_chat_render(&d, 0, &prompt, &plen, &e)) {
        srv_reply_error(req, e.status, e.type ? e.type : "invalid_request_error", e.param[0] ? e.param : NULL, "%s",
                        e.message);
    } else {
        struct json_buf b;
        json_buf_init(&b);
        json_buf_lit(&b, "{\"prompt\":");
        json_buf_add_str(&b, prompt, plen);
        json_buf_lit(&b, "}");
        srv_reply_json(req, 200, &b);
        json_buf_free(&b);
    }
    free(prompt);
    json_free(&d);
    free(body);
}

/* vLLM's /tokenize: {"prompt": "..."} or {"messages": [...]} (rendered with
 * the chat template and a generation prompt), add_special_tokens (true). */
static void handle_tokenize(struct server *s, struct evhttp_request *req)
{
    if (!ready_or_503(s, req)) return;
    char *body;
    json_doc d;
    if (read_json(s, req, &body, &d)) return;
    const model_tok *tok = model_get_tok(s->m);
    bool chat = json_get(&d, 0, "messages") >= 0;
    struct api_oai_req r;
    struct api_oai_error e = {0};
    int32_t *ids = NULL;
    int ja = json_get(&d, 0, "add_special_tokens");
    bool add_special = true;
    if (ja >= 0 && json_bool(&d, ja, &add_special)) {
        srv_reply_error(req, 400, "invalid_request_error", "add_special_tokens", "'add_special_tokens' must be a boolean");
        goto out;
    }
    if (api_oai_parse_doc(&d, 0, chat ? API_OAI_CHAT : API_OAI_COMPLETIONS, s->model_names, &r, &e)) {
        srv_reply_error(req, e.status, e.type ? e.type : "invalid_request_error", e.param[0] ? e.param : NULL, "%s",
                        e.message);
        goto out;
    }
    int n;
    if (r.prompt_text) {
        size_t tl = r.prompt_len;
        bool bos = add_special && !chat;
        n = model_tok_encode(tok, r.prompt_text, tl, bos, true, NULL, 0);
        ids = n > 0 ? malloc(sizeof *ids * (size_t)n) : NULL;
        if (ids) model_tok_encode(tok, r.prompt_text, tl, bos, true, ids, n);
    } else {
        n = r.n_prompt_ids;
        ids = r.prompt_ids;
        r.prompt_ids = NULL;
    }
    struct json_buf b;
    json_buf_init(&b);
    json_buf_addf(&b, "{\"count\":%d,\"max_model_len\":%d,\"tokens\":[", n < 0 ? 0 : n,
                  sched_engine_config(s->eng)->max_model_len);
    for (int i = 0; ids && i < n; i++) json_buf_addf(&b, i ? ",%d" : "%d", ids[i]);
    json_buf_lit(&b, "]}");
    srv_reply_json(req, 200, &b);
    json_buf_free(&b);
    api_oai_req_free(&r);
out:
    free(ids);
    json_free(&d);
    free(body);
}

static void handle_detokenize(struct server *s, struct evhttp_request *req)
{
    if (!ready_or_503(s, req)) return;
    char *body;
    json_doc d;
    if (read_json(s, req, &body, &d)) return;
    const model_tok *tok = model_get_tok(s->m);
    int jt = json_get(&d, 0, "tokens");
    int n = json_is_arr(&d, jt) ? json_size(&d, jt) : -1;
    int32_t *ids = n > 0 ? malloc(sizeof *ids * (size_t)n) : NULL;
    if (n < 0) {
        srv_reply_error(req, 400, "invalid_request_error", "tokens", "detokenize needs \"tokens\" (an array of ids)");
        goto out;
    }
    for (int k = 0, i = jt + 1; k < n; k++, i = json_skip(&d, i)) {
        int64_t v;
        if (json_i64(&d, i, &v) || v < 0 || v >= model_tok_n_vocab(tok)) {
            srv_reply_error(req, 400, "invalid_request_error", "tokens", "tokens[%d] is not a token id of this model", k);
            goto out;
        }
        ids[k] = (int32_t)v;
    }
    long need = model_tok_decode(tok, ids, n, false, NULL, 0);
    char *text = malloc((size_t)(need > 0 ? need : 0) + 1);
    if (!text) goto out;
    model_tok_decode(tok, ids, n, false, text, (size_t)need);
    struct json_buf b;
    json_buf_init(&b);
    json_buf_lit(&b, "{\"prompt\":");
    json_buf_add_str(&b, text, (size_t)need);
    json_buf_lit(&b, "}");
    srv_reply_json(req, 200, &b);
    json_buf_free(&b);
    free(text);
out:
    free(ids);
    json_free(&d);
    free(body);
}

/* ---- routing ---- */

static const struct route { const char *path; bool post, v1; } routes[] = {
    {"/health", false, false}, {"/ping", false, false}, {"/metrics", false, false},
    {"/v1/models", false, true}, {"/tokenize", true, false}, {"/detokenize", true, false},
    {"/v1/chat/completions", true, true}, {"/v1/completions", true, true},
    {"/apply-template", true, false}, {"/v1/responses", true, true}, {"/version", false, false},
};

/* What a route that takes no body accepts anyway (a client sending one by habit). */
#define SMALL_BODY (64L << 10)

long srv_route_body_cap(const struct server *s, const char *method, const char *path, bool *needs_key)
{
    char p[256];
    size_t n = strlen(path);
    if (n >= sizeof p) n = sizeof p - 1;
    memcpy(p, path, n);
    p[n] = '\0';
    while (n > 1 && p[n - 1] == '/') p[--n] = '\0';
    bool post = !strcmp(method, "POST");
    *needs_key = false;
    if (srv_batch_route(p)) {
        *needs_key = true;
        if (post && !strcmp(p, "/v1/files")) return s->o.max_batch_file_bytes + (1L << 20); /* multipart framing */
        return post ? s->o.max_body_bytes : SMALL_BODY;
    }
    if (!strncmp(p, "/v1/models/", 11)) {
        *needs_key = true;
        return SMALL_BODY;
    }
    for (size_t i = 0; i < sizeof routes / sizeof routes[0]; i++)
        if (!strcmp(p, routes[i].path)) {
            *needs_key = routes[i].v1;
            return routes[i].post && post ? s->o.max_body_bytes : SMALL_BODY;
        }
    return SMALL_BODY;
}

static bool cors(struct server *s, struct evhttp_request *req);

static void route(struct evhttp_request *req, void *arg)
{
    struct server *s = arg;
    const char *uri = evhttp_request_get_uri(req);
    char path[256];
    size_t n = strcspn(uri, "?");
    if (n >= sizeof path) n = sizeof path - 1;
    memcpy(path, uri, n);
    path[n] = '\0';
    while (n > 1 && path[n - 1] == '/') path[--n] = '\0';
    srv_conn_request(s, req);
    if (cors(s, req)) return;
    enum evhttp_cmd_type m = evhttp_request_get_command(req);
    /* shutting down: only /health (503, so a balancer moves on) and /metrics answer */
    if (atomic_load(&s->draining) && strcmp(path, "/metrics")) {
        srv_reply_error(req, 503, "server_error", NULL, "the server is shutting down");
        return;
    }
    /* HEAD where GET is: srv_reply_json leaves the body out */
    bool get = m == EVHTTP_REQ_GET || m == EVHTTP_REQ_HEAD, post = m == EVHTTP_REQ_POST;
    if (srv_batch_route(path)) { /* /v1/files..., /v1/batches...: server_batch.c */
        if (!srv_auth_ok(s, req)) srv_reply_error(req, 401, "invalid_request_error", NULL, "invalid or missing API key");
        else srv_handle_batch_api(s, req, path);
        return;
    }
    if (!strncmp(path, "/v1/models/", 11) && path[11]) { /* client.models.retrieve(id) */
        if (!get) {
            evhttp_add_header(evhttp_request_get_output_headers(req), "Allow", "GET, HEAD");
            srv_reply_error(req, 405, "invalid_request_error", NULL, "method not allowed on %s (use GET)", path);
        } else if (!srv_auth_ok(s, req)) {
            srv_reply_error(req, 401, "invalid_request_error", NULL, "invalid or missing API key");
        } else {
            char *id = evhttp_uridecode(path + 11, 0, NULL);
            handle_models(s, req, id ? id : path + 11);
            free(id);
        }
        return;
    }
    if (s->o.web_ui && srv_webui_route(req, path)) return; /* the page at / and its files */
    if (!strncmp(path, "/v1/responses/", 14)) { /* responses.retrieve / cancel / input_items */
        if (!srv_auth_ok(s, req)) srv_reply_error(req, 401, "invalid_request_error", NULL, "invalid or missing API key");
        else
            srv_reply_error(req, 404, "NotFoundError", NULL,
                            "%s: responses are not stored here (store and background are not supported), so none "
                            "can be retrieved or cancelled", path);
        return;
    }
    int r = -1;
    for (size_t i = 0; i < sizeof routes / sizeof routes[0]; i++)
        if (!strcmp(path, routes[i].path)) r = (int)i;
    if (r < 0) {
        srv_reply_error(req, 404, "invalid_request_error", NULL, "no route %s", path);
        return;
    }
    if ((routes[r].post && !post) || (!routes[r].post && !get)) {
        evhttp_add_header(evhttp_request_get_output_headers(req), "Allow", routes[r].post ? "POST" : "GET, HEAD");
        srv_reply_error(req, 405, "invalid_request_error", NULL, "method not allowed on %s (use %s)", path,
                        routes[r].post ? "POST" : "GET");
        return;
    }
    if (routes[r].v1 && !srv_auth_ok(s, req)) {
        srv_reply_error(req, 401, "invalid_request_error", NULL, "invalid or missing API key");
        return;
    }
    if (m == EVHTTP_REQ_HEAD && r == 2) { /* /metrics writes its own reply: no body to leave out there */
        evhttp_add_header(evhttp_request_get_output_headers(req), "Content-Type", "text/plain; version=0.0.4");
        evhttp_send_reply(req, 200, "OK", NULL);
        return;
    }
    switch (r) {
    case 0: case 1: handle_health(s, req); break;
    case 2: srv_handle_metrics(s, req); break;
    case 3: handle_models(s, req, NULL); break;
    case 4: handle_tokenize(s, req); break;
    case 5: handle_detokenize(s, req); break;
    case 6: if (ready_or_503(s, req)) srv_handle_completions(s, req, true); break;
    case 7: if (ready_or_503(s, req)) srv_handle_completions(s, req, false); break;
    case 8: handle_apply_template(s, req); break;
    case 9: if (ready_or_503(s, req)) srv_handle_responses(s, req); break;
    case 10: {
        struct json_buf b;
        json_buf_init(&b);
        json_buf_lit(&b, "{\"version\":\"" SLUICE_VERSION "\"}");
        srv_reply_json(req, 200, &b);
        json_buf_free(&b);
        break;
    }
    }
}

/* While draining (after SIGTERM/SIGINT), every 20 ms: past the deadline the
 * requests still in flight are aborted (each ends with its final event);
 * once none is left, the last replies get a moment to leave, then the loop
 * ends. Batch rows still in the engine then are dropped without a result:
 * they are `running` on disk and run again at the next start. */
static void drain_tick(evutil_socket_t fd, short what, void *arg)
{
    (void)fd, (void)what;
    struct server *s = arg;
    srv_drain_events(s);
    double now = srv_now();
    if (s->n_pending > 0 && now >= s->drain_deadline && !s->drain_cut) {
        fprintf(stderr, "sluice serve: --shutdown-timeout reached: aborting %d request(s) in flight\n", s->n_pending);
        srv_abort_interactive(s);
        s->drain_cut = true;
    }
    /* an abort lands after the step in flight: give the engine a few seconds more at most */
    if (s->n_pending == 0 || now >= s->drain_deadline + 5.0) {
        if (s->drain_done_at == 0) s->drain_done_at = now + 0.2;
        if (now >= s->drain_done_at) {
            event_base_loopbreak(s->base);
            return;
        }
    }
    struct timeval tv = {0, 20 * 1000};
    event_add(s->drain_ev, &tv);
}

static void on_signal(evutil_socket_t sig, short what, void *arg)
{
    (void)what;
    struct server *s = arg;
    if (atomic_load(&s->draining) || atomic_load(&s->state) != SRV_READY || !s->drain_ev) {
        fprintf(stderr, "sluice serve: signal %d, shutting down\n", (int)sig);
        event_base_loopbreak(s->base);
        return;
    }
    fprintf(stderr, "sluice serve: signal %d, shutting down: %d request(s) in flight get %lds to finish (again to stop "
            "now)\n", (int)sig, s->n_pending, s->o.shutdown_timeout);
    atomic_store(&s->draining, true);
    s->drain_deadline = srv_now() + (double)s->o.shutdown_timeout;
    drain_tick(-1, 0, s);
}

/* ---- CORS (vLLM's --allowed-origins/--allowed-methods/--allowed-headers/--allow-credentials,
 * which FastAPI's CORSMiddleware applies) ---- */

/* A flag's list: a JSON array of strings (vLLM's form) or comma-separated
 * words. Returns the count, or -1 with err. */
static int parse_list(const char *flag, const char *v, char ***out, char *err, size_t errlen)
{
    *out = NULL;
    int n = 0, cap = 8;
    char **a = calloc((size_t)cap, sizeof *a);
    if (!a) goto oom;
    while (*v == ' ') v++;
    if (*v == '[') {
        json_doc d;
        char jerr[128];
        if (json_parse(&d, v, strlen(v), jerr, sizeof jerr) || !json_is_arr(&d, 0)) {
            snprintf(err, errlen, "%s must be a JSON list of strings, e.g. '[\"*\"]'", flag);
            free(a);
            return -1;
        }
        for (int k = 0, p = 1; k < json_size(&d, 0); k++, p = json_skip(&d, p)) {
            if (n == cap) {
                char **t = realloc(a, (size_t)(cap *= 2) * sizeof *a);
                if (!t) break;
                a = t;
            }
            if (!json_is_str(&d, p) || !(a[n] = json_strdup(&d, p, NULL))) {
                snprintf(err, errlen, "%s must be a JSON list of strings", flag);
                json_free(&d);
                for (int i = 0; i < n; i++) free(a[i]);
                free(a);
                return -1;
            }
            n++;
        }
        json_free(&d);
    } else {
        for (const char *p = v; *p;) {
            size_t l = strcspn(p, ",");
            const char *w = p;
            p += l + (p[l] == ',');
            while (l && *w == ' ') w++, l--;
            while (l && w[l - 1] == ' ') l--;
            if (!l) continue;
            if (n == cap) {
                char **t = realloc(a, (size_t)(cap *= 2) * sizeof *a);
                if (!t) goto oom;
                a = t;
            }
            if (!(a[n] = strndup(w, l))) goto oom;
            n++;
        }
    }
    *out = a;
    return n;
oom:
    snprintf(err, errlen, "out of memory");
    return -1;
}

static bool in_list(char **a, int n, const char *v, bool fold)
{
    for (int i = 0; i < n; i++)
        if (!strcmp(a[i], "*") || (fold ? !strcasecmp(a[i], v) : !strcmp(a[i], v))) return true;
    return false;
}

static bool list_any(char **a, int n) { return in_list(a, n, "\x01", false); }

/* Adds the CORS headers a request from another origin needs. A preflight
 * (OPTIONS with Access-Control-Request-Method) is answered here: true when
 * the request is done. */
static bool cors(struct server *s, struct evhttp_request *req)
{
    struct evkeyvalq *in = evhttp_request_get_input_headers(req), *out = evhttp_request_get_output_headers(req);
    const char *origin = evhttp_find_header(in, "Origin");
    if (!origin) return false;
    bool any = list_any(s->cors_origins, s->n_cors_origins), ok = in_list(s->cors_origins, s->n_cors_origins, origin, false);
    const char *acrm = evhttp_find_header(in, "Access-Control-Request-Method");
    bool preflight = evhttp_request_get_command(req) == EVHTTP_REQ_OPTIONS && acrm;
    if (preflight) {
        const char *acrh = evhttp_find_header(in, "Access-Control-Request-Headers");
        bool m_ok = in_list(s->cors_methods, s->n_cors_methods, acrm, false), h_ok = true;
        if (acrh && !list_any(s->cors_headers, s->n_cors_headers)) {
            char *dup = strdup(acrh), *save = NULL;
            for (char *w = dup ? strtok_r(dup, ", ", &save) : NULL; w; w = strtok_r(NULL, ", ", &save))
                if (!in_list(s->cors_headers, s->n_cors_headers, w, true) && strcasecmp(w, "accept") &&
                    strcasecmp(w, "accept-language") && strcasecmp(w, "content-language") && strcasecmp(w, "content-type"))
                    h_ok = false;
            free(dup);
        }
        if (ok) evhttp_add_header(out, "Access-Control-Allow-Origin", any && !s->o.allow_credentials ? "*" : origin);
        if (!any || s->o.allow_credentials) evhttp_add_header(out, "Vary", "Origin");
        struct json_buf m;
        json_buf_init(&m);
        if (list_any(s->cors_methods, s->n_cors_methods)) {
            json_buf_lit(&m, "DELETE, GET, HEAD, OPTIONS, PATCH, POST, PUT");
        } else {
            for (int i = 0; i < s->n_cors_methods; i++) json_buf_addf(&m, "%s%s", i ? ", " : "", s->cors_methods[i]);
        }
        if (m.p) evhttp_add_header(out, "Access-Control-Allow-Methods", m.p);
        json_buf_free(&m);
        if (list_any(s->cors_headers, s->n_cors_headers)) {
            if (acrh) evhttp_add_header(out, "Access-Control-Allow-Headers", acrh);
        } else {
            struct json_buf h;
            json_buf_init(&h);
            json_buf_lit(&h, "Accept, Accept-Language, Content-Language, Content-Type");
            for (int i = 0; i < s->n_cors_headers; i++) json_buf_addf(&h, ", %s", s->cors_headers[i]);
            evhttp_add_header(out, "Access-Control-Allow-Headers", h.p);
            json_buf_free(&h);
        }
        if (s->o.allow_credentials) evhttp_add_header(out, "Access-Control-Allow-Credentials", "true");
        evhttp_add_header(out, "Access-Control-Max-Age", "600");
        if (ok && m_ok && h_ok) {
            evhttp_add_header(out, "Content-Type", "text/plain; charset=utf-8");
            struct evbuffer *b = evbuffer_new();
            if (b) evbuffer_add(b, "OK", 2);
            evhttp_send_reply(req, 200, "OK", b);
            if (b) evbuffer_free(b);
        } else {
            const char *why = !ok ? "Disallowed CORS origin" : !m_ok ? "Disallowed CORS method" : "Disallowed CORS headers";
            evhttp_add_header(out, "Content-Type", "text/plain; charset=utf-8");
            struct evbuffer *b = evbuffer_new();
            if (b) evbuffer_add(b, why, strlen(why));
            evhttp_send_reply(req, 400, "Bad Request", b);
            if (b) evbuffer_free(b);
        }
        return true;
    }
    if (!ok) return false;
    bool cookie = evhttp_find_header(in, "Cookie") != NULL;
    evhttp_add_header(out, "Access-Control-Allow-Origin", any && !(s->o.allow_credentials && cookie) ? "*" : origin);
    if (!any || (s->o.allow_credentials && cookie)) evhttp_add_header(out, "Vary", "Origin");
    if (s->o.allow_credentials) evhttp_add_header(out, "Access-Control-Allow-Credentials", "true");
    return false;
}

/* ---- the command ---- */

/* A listening socket on host:port, for evhttp_accept_socket. Made here
 * rather than by evhttp_bind_socket so that a failure says why: libevent's
 * leaves no errno when the address does not resolve. An address that looks
 * numeric is never sent to DNS. Returns the socket, or -1 with the reason in
 * err. */
static evutil_socket_t listen_on(const char *host, long port, char *err, size_t errlen)
{
    struct addrinfo hints = {.ai_socktype = SOCK_STREAM, .ai_flags = AI_PASSIVE | AI_NUMERICSERV | AI_NUMERICHOST};
    struct addrinfo *res = NULL;
    char service[16];
    snprintf(service, sizeof service, "%ld", port);
    int rc = getaddrinfo(host, service, &hints, &res);
    if (rc == EAI_NONAME && *host && strspn(host, "0123456789.") != strlen(host) && !strchr(host, ':')) {
        hints.ai_flags &= ~AI_NUMERICHOST; /* a host name: resolve it */
        rc = getaddrinfo(host, service, &hints, &res);
        if (rc) {
            snprintf(err, errlen, "the host name does not resolve (%s)",
                     rc == EAI_SYSTEM ? strerror(errno) : gai_strerror(rc));
            return -1;
        }
    } else if (rc) {
        snprintf(err, errlen, "not a valid IPv4 or IPv6 address (--host)");
        return -1;
    }
    int fd = -1, e = 0;
    for (struct addrinfo *a = res; a && fd < 0; a = a->ai_next) {
        fd = socket(a->ai_family, a->ai_socktype | SOCK_NONBLOCK | SOCK_CLOEXEC, a->ai_protocol);
        if (fd < 0) {
            e = errno;
            continue;
        }
        int on = 1; /* as evhttp_bind_socket: a restart need not wait out TIME_WAIT */
        setsockopt(fd, SOL_SOCKET, SO_REUSEADDR, &on, sizeof on);
        if (bind(fd, a->ai_addr, a->ai_addrlen) || listen(fd, 128)) {
            e = errno;
            close(fd);
            fd = -1;
        }
    }
    freeaddrinfo(res);
    if (fd < 0)
        snprintf(err, errlen, "%s%s", strerror(e),
                 e == EADDRINUSE      ? " (another process listens on this port: pick another --port)"
                 : e == EADDRNOTAVAIL ? " (--host must be an address of this machine, or 0.0.0.0 for all)"
                 : e == EACCES        ? " (ports below 1024 need privileges)"
                                      : "");
    return fd;
}

static const char USAGE[] =
    "usage: sluice serve [MODEL] [--model MODEL] [flags]\n"
    "  OpenAI-compatible server: /v1/chat/completions, /v1/completions, /v1/responses, /v1/models,\n"
    "  /health, /metrics, /tokenize, /detokenize, /apply-template,\n"
    "  and the Batch API: /v1/files, /v1/batches; a web page at / (--no-web-ui: none).\n"
    "  Flags are named as in vLLM.\n\n";

int api_cmd_serve(int argc, char **argv)
{
    static struct server srv; /* one per process; its address is handed to threads */
    struct server *s = &srv;
    memset(s, 0, sizeof *s);
    pthread_mutex_init(&s->vm_mu, NULL);
    struct server_opts *o = &s->o;
    o->host = "127.0.0.1";
    o->port = 8000;
    o->enable_prefix_caching = true;
    o->web_ui = true;
    /* not given: the model's length, vLLM's sizes for the device, 0.9 */
    o->max_model_len = o->max_num_seqs = o->max_num_batched_tokens = API_FLAG_UNSET;
    o->gpu_memory_utilization = NAN;
    o->block_size = 16;
    o->tensor_parallel_size = 1;
    o->max_body_bytes = 32L << 20;
    struct api_sched_flags sf;
    api_sched_flags_init(&sf);
    o->max_num_partial_prefills = o->max_long_partial_prefills = 1;
    o->data_dir = "./sluice-data";
    o->max_batch_file_lines = 50000;
    o->max_batch_file_bytes = 200L * 1000 * 1000;
    o->max_header_bytes = 64L << 10;
    o->max_header_count = 256;
    o->timeout_keep_alive = 5;
    o->timeout_header = 10;
    o->timeout_read = 30;
    o->timeout_write = 60;
    bool trust_remote_code = false;
    struct api_vllm_flags vf = {.enable_chunked_prefill = true};
    const struct api_flag flags[] = {
        {"--model", API_FLAG_STR, &o->model, "GGUF file or HF checkpoint directory (or positional)", NULL},
        {"--served-model-name", API_FLAG_STRS, &o->served_model_names,
         "names clients use, any of them (default: the path); replies carry the first", NULL},
        {"--tokenizer", API_FLAG_STR, &o->tokenizer, "take the tokenizer from another model", NULL},
        {"--load-format", API_FLAG_STR, &o->load_format, "auto, or dummy: random weights from config.json", NULL},
        {"--check-weights", API_FLAG_BOOL, &o->check_weights,
         "read every weight at load and refuse a NaN or infinity, naming the tensor (off: costs a pass over the weights)",
         NULL},
        {"--host", API_FLAG_STR, &o->host, "address to listen on (127.0.0.1)", NULL},
        {"--port", API_FLAG_INT, &o->port, "port (8000)", NULL},
        {"--api-key", API_FLAG_STR, &o->api_key, "require 'Authorization: Bearer KEY' on /v1/*", NULL},
        {"--web-ui", API_FLAG_BOOL, &o->web_ui, "serve the web page (chat, batch jobs, status) at / (on)",
         "--no-web-ui"},
        {"--api-key", API_FLAG_STR, &o->api_key,
         "require 'Authorization: Bearer KEY' on /v1/* (default: $VLLM_API_KEY, else $SLUICE_API_KEY)", NULL},
        {"--shutdown-timeout", API_FLAG_INT, &o->shutdown_timeout,
         "on SIGTERM/SIGINT, seconds requests in flight may take to finish before they are cut (0)", NULL},
        {"--allowed-origins", API_FLAG_STR, &o->allowed_origins, "CORS: JSON list of origins ('[\"*\"]')", NULL},
        {"--allowed-methods", API_FLAG_STR, &o->allowed_methods, "CORS: JSON list of methods ('[\"*\"]')", NULL},
        {"--allowed-headers", API_FLAG_STR, &o->allowed_headers, "CORS: JSON list of request headers ('[\"*\"]')", NULL},
        {"--allow-credentials", API_FLAG_BOOL, &o->allow_credentials, "CORS: allow credentials (off)", NULL},
        {"--max-model-len", API_FLAG_HUMAN_INT, &o->max_model_len,
         "prompt + completion tokens at most, e.g. 32k (32000) or 32K (32768)", NULL},
        {"--max-num-seqs", API_FLAG_INT, &o->max_num_seqs, "sequences running at once (GPU 256, CPU 64)", NULL},
        {"--max-num-batched-tokens", API_FLAG_HUMAN_INT, &o->max_num_batched_tokens,
         "tokens per engine step, e.g. 8k (GPU 8192, CPU 1024)", NULL},
        {"--enable-prefix-caching", API_FLAG_BOOL, &o->enable_prefix_caching, "reuse KV of repeated prefixes (on)",
         "--no-enable-prefix-caching"},
        {"--enable-prompt-tokens-details", API_FLAG_BOOL, &o->enable_prompt_tokens_details,
         "usage.prompt_tokens_details.cached_tokens", NULL},
        {"--block-size", API_FLAG_INT, &o->block_size, "KV tokens per block (16)", NULL},
        {"--mamba-block-size", API_FLAG_INT, &o->mamba_block_size,
         "linear-attention models: a prefix-cache state snapshot every N tokens, a multiple of --block-size "
         "(0: auto, as many tokens as a snapshot's bytes of KV)", NULL},
        {"--kv-cache-memory", API_FLAG_STR, &o->kv_cache_memory, "KV pool size, e.g. 2G (CPU: 1G; GPU: from --gpu-memory-utilization)", NULL},
        {"--gpu-memory-utilization", API_FLAG_FLOAT, &o->gpu_memory_utilization, "GPU memory fraction (0.9; no effect on the CPU)", NULL},
        {"--tensor-parallel-size", API_FLAG_INT, &o->tensor_parallel_size, "GPUs per model (1)", NULL},
        {"--trust-remote-code", API_FLAG_BOOL, &trust_remote_code, "accepted for vLLM compatibility; no effect", NULL},
        {"--device", API_FLAG_STR, &o->device, "cpu or cuda (default: cuda when available)", NULL},
        {"--threads", API_FLAG_INT, &o->threads, "CPU threads, 0 = all cores", NULL},
        {"--hf-overrides", API_FLAG_STR, &vf.hf_overrides, "JSON applied to the model config (vLLM)", NULL},
        {"--compilation-config", API_FLAG_STR, &vf.compilation_config, "JSON; cudagraph_mode FULL_DECODE_ONLY (what sluice does) or NONE (= --enforce-eager)", NULL},
        {"--speculative-config", API_FLAG_STR, &vf.speculative_config,
         "JSON: {\"method\":\"ngram\",\"num_speculative_tokens\":K,\"prompt_lookup_min\":a,\"prompt_lookup_max\":b} "
         "or {\"method\":\"mtp\",\"num_speculative_tokens\":K} (K 1-4; mtp: CPU, and CUDA on one GPU; models with "
         "KDA layers: ngram on the CPU backend, mtp reported and off; off)", NULL},
        {"--kv-cache-dtype", API_FLAG_STR, &o->kv_cache_dtype, "auto, or fp8 (= fp8_e4m3; GPU): half the KV bytes", NULL},
        {"--dtype", API_FLAG_STR, &vf.dtype, "auto/bfloat16 (others reported and ignored)", NULL},
        {"--swap-space", API_FLAG_STR, &vf.swap_space, "accepted; preemption recomputes instead", NULL},
        {"--seed", API_FLAG_STR, &vf.seed, "accepted; requests carry their own seeds", NULL},
        {"--max-logprobs", API_FLAG_STR, &vf.max_logprobs, "accepted; at most 20 top logprobs", NULL},
        {"--uvicorn-log-level", API_FLAG_STR, &vf.uvicorn_log_level, "accepted; no effect", NULL},
        {"--enforce-eager", API_FLAG_BOOL, &vf.enforce_eager, "no CUDA graphs: decode steps launch kernels one by one (slower)", NULL},
        {"--disable-log-requests", API_FLAG_BOOL, &vf.disable_log_requests, "accepted; requests are not logged", NULL},
        {"--disable-log-stats", API_FLAG_BOOL, &vf.disable_log_stats, "accepted; no effect", NULL},
        {"--disable-uvicorn-access-log", API_FLAG_BOOL, &vf.disable_uvicorn_access_log, "accepted; no effect", NULL},
        {"--max-request-bytes", API_FLAG_INT, &o->max_body_bytes, "largest JSON request body (32 MiB)", NULL},
        API_SCHED_FLAGS(&sf),
        {"--long-prefill-token-threshold", API_FLAG_HUMAN_INT, &o->long_prefill_token_threshold,
         "a prompt moves by at most this many tokens a step (vLLM; 0: no cap)", NULL},
        {"--enable-chunked-prefill", API_FLAG_BOOL, &vf.enable_chunked_prefill, "accepted; prefill is always chunked",
         "--no-enable-chunked-prefill"},
        {"--max-num-partial-prefills", API_FLAG_INT, &o->max_num_partial_prefills,
         "> 1: at most this many prompts of a class move in a step, sharing the budget (vLLM; 1: any number)", NULL},
        {"--max-long-partial-prefills", API_FLAG_INT, &o->max_long_partial_prefills,
         "with the above: at most this many of them long (over --long-prefill-token-threshold, else 4% of "
         "--max-model-len); shorter prompts pass waiting long ones (1)",
         NULL},
        {"--scheduling-policy", API_FLAG_STR, &vf.scheduling_policy,
         "fcfs or priority: requests' priority > 0 yields to the rest either way", NULL},
        {"--data-dir", API_FLAG_STR, &o->data_dir, "batch store: files, batches, results (./sluice-data)", NULL},
        {"--max-batch-file-lines", API_FLAG_INT, &o->max_batch_file_lines, "requests per batch file (50000)", NULL},
        {"--max-batch-file-bytes", API_FLAG_INT, &o->max_batch_file_bytes, "bytes per batch file (200 MB)", NULL},
        /* connection limits (server_conn.c) */
        {"--max-header-bytes", API_FLAG_HUMAN_INT, &o->max_header_bytes,
         "request line and headers at most; more gets 431 (64K)", NULL},
        {"--h11-max-incomplete-event-size", API_FLAG_HUMAN_INT, &o->max_header_bytes, "vLLM's name of --max-header-bytes", NULL},
        {"--h11-max-header-count", API_FLAG_INT, &o->max_header_count, "header fields at most; more gets 431 (256)", NULL},
        {"--max-connections", API_FLAG_INT, &o->max_connections,
         "connections open at once; at the cap the oldest idle one is closed, else 503 (the open-file limit - 64)", NULL},
        {"--timeout-keep-alive", API_FLAG_FLOAT, &o->timeout_keep_alive,
         "seconds a connection may sit with no request before it is closed (5)", NULL},
        {"--timeout-header", API_FLAG_FLOAT, &o->timeout_header, "seconds a request's head may take to arrive (10)", NULL},
        {"--timeout-read", API_FLAG_FLOAT, &o->timeout_read, "seconds a request body may stall (30)", NULL},
        {"--timeout-write", API_FLAG_FLOAT, &o->timeout_write,
         "seconds a reply may wait on a client that does not read it (60)", NULL},
        {"--allow-short-completion-windows", API_FLAG_BOOL, &o->allow_short_windows,
         "tests only: accept completion windows like \"5s\"", NULL},
        {"--chat-template", API_FLAG_STR, &chat_flags.chat_template,
         "Jinja chat template file (or text) instead of the model's own", NULL},
        {"--reasoning-parser", API_FLAG_STR, &chat_flags.reasoning_parser,
         "put thinking into reasoning_content: glm45, glm47, deepseek_r1, qwen3", NULL},
        {"--enable-auto-tool-choice", API_FLAG_BOOL, &chat_flags.auto_tool_choice,
         "let the model call tools (needs --tool-call-parser)", NULL},
        {"--tool-call-parser", API_FLAG_STR, &chat_flags.tool_call_parser,
         "parse tool calls out of the output: glm47 (glm45), hermes", NULL},
        {0},
    };
    char err[512];
    const char *pos[1];
    int flags_rc;
    int np = api_cmd_flags("serve", USAGE, argc, argv, 2, flags, pos, 1, &flags_rc);
    if (np < 0) return flags_rc;
    int rk = api_reasoning_lookup(chat_flags.reasoning_parser), tk = api_toolcall_lookup(chat_flags.tool_call_parser);
    if (rk < 0 || tk < 0) {
        fprintf(stderr, "sluice serve: unknown %s '%s' (known: %s)\n", rk < 0 ? "--reasoning-parser" : "--tool-call-parser",
                rk < 0 ? chat_flags.reasoning_parser : chat_flags.tool_call_parser,
                rk < 0 ? "glm45, glm47, deepseek_r1, qwen3" : "glm47, glm45, hermes");
        return 2;
    }
    if (chat_flags.auto_tool_choice && !tk) {
        fprintf(stderr, "sluice serve: --enable-auto-tool-choice needs --tool-call-parser\n");
        return 2;
    }
    api_chat_set_parsers(rk, chat_flags.auto_tool_choice ? tk : 0);
    if (np == 1) {
        if (o->model && strcmp(o->model, pos[0])) {
            fprintf(stderr, "sluice serve: model given twice ('%s' and --model '%s')\n", pos[0], o->model);
            return 2;
        }
        o->model = pos[0];
    }
    if (!o->model) {
        fprintf(stderr, "sluice serve: no model (sluice serve MODEL, or --model MODEL)\n");
        return 2;
    }
    if (api_vllm_compat(&vf, &o->enforce_eager, &o->sched.spec, err, sizeof err)) {
        fprintf(stderr, "sluice serve: %s\n", err);
        return 2;
    }
    o->hf_overrides = vf.hf_overrides;
    /* each message names the flag, its value and what it may be; a value
     * given as 0 is refused as vLLM refuses it, not read as "the default" */
    if (api_flag_long_range("--port", o->port, 1, 65535, err, sizeof err) ||
        api_flag_long_range("--max-model-len", o->max_model_len, 1, INT_MAX, err, sizeof err) ||
        api_flag_long_range("--max-num-seqs", o->max_num_seqs, 1, INT_MAX, err, sizeof err) ||
        api_flag_long_range("--max-num-batched-tokens", o->max_num_batched_tokens, 1, INT_MAX, err, sizeof err) ||
        api_flag_long_range("--block-size", o->block_size, 1, 1024, err, sizeof err) ||
        api_flag_long_range("--mamba-block-size", o->mamba_block_size, 0, INT_MAX, err, sizeof err) ||
        api_flag_long_range("--tensor-parallel-size", o->tensor_parallel_size, 1, LONG_MAX, err, sizeof err) ||
        api_flag_long_range("--threads", o->threads, 0, INT_MAX, err, sizeof err) ||
        api_flag_double_range("--gpu-memory-utilization", o->gpu_memory_utilization, 0, true, 1, err, sizeof err) ||
        api_flag_long_range("--max-request-bytes", o->max_body_bytes, 1024, LONG_MAX, err, sizeof err) ||
        api_sched_flags_apply(&sf, &o->sched, err, sizeof err) ||
        api_flag_long_range("--long-prefill-token-threshold", o->long_prefill_token_threshold, 0, INT_MAX, err,
                            sizeof err) ||
        api_flag_long_range("--max-batch-file-lines", o->max_batch_file_lines, 1, LONG_MAX, err, sizeof err) ||
        api_flag_long_range("--max-batch-file-bytes", o->max_batch_file_bytes, 1, LONG_MAX, err, sizeof err) ||
        api_flag_long_range("--max-header-bytes", o->max_header_bytes, 256, 64L << 20, err, sizeof err) ||
        api_flag_long_range("--h11-max-header-count", o->max_header_count, 1, 1L << 20, err, sizeof err) ||
        api_flag_long_range("--max-connections", o->max_connections, 0, LONG_MAX, err, sizeof err) ||
        api_flag_double_range("--timeout-keep-alive", o->timeout_keep_alive, 0, true, 1e6, err, sizeof err) ||
        api_flag_double_range("--timeout-header", o->timeout_header, 0, true, 1e6, err, sizeof err) ||
        api_flag_double_range("--timeout-read", o->timeout_read, 0, true, 1e6, err, sizeof err) ||
        api_flag_double_range("--timeout-write", o->timeout_write, 0, true, 1e6, err, sizeof err) ||
        api_partial_prefill_flags(o->max_num_partial_prefills, o->max_long_partial_prefills, err, sizeof err)) {
        fprintf(stderr, "sluice serve: %s\n", err);
        return 2;
    }
    if (api_flag_long_range("--shutdown-timeout", o->shutdown_timeout, 0, 86400, err, sizeof err)) {
        fprintf(stderr, "sluice serve: %s\n", err);
        return 2;
    }
    if (!o->api_key) { /* vLLM reads VLLM_API_KEY; the start-up hint names SLUICE_API_KEY */
        const char *k = getenv("VLLM_API_KEY");
        if (!k || !*k) k = getenv("SLUICE_API_KEY");
        if (k && *k) o->api_key = k;
    }
    if ((s->n_cors_origins = parse_list("--allowed-origins", o->allowed_origins ? o->allowed_origins : "*",
                                        &s->cors_origins, err, sizeof err)) < 0 ||
        (s->n_cors_methods = parse_list("--allowed-methods", o->allowed_methods ? o->allowed_methods : "*",
                                        &s->cors_methods, err, sizeof err)) < 0 ||
        (s->n_cors_headers = parse_list("--allowed-headers", o->allowed_headers ? o->allowed_headers : "*",
                                        &s->cors_headers, err, sizeof err)) < 0) {
        fprintf(stderr, "sluice serve: %s\n", err);
        return 2;
    }
    if (o->kv_cache_memory && api_parse_bytes(o->kv_cache_memory) <= 0) {
        fprintf(stderr, "sluice serve: invalid --kv-cache-memory '%s' (e.g. 2G, 512M)\n", o->kv_cache_memory);
        return 2;
    }
    if (o->max_model_len == API_FLAG_UNSET) o->max_model_len = 0;
    if (o->max_num_seqs == API_FLAG_UNSET) o->max_num_seqs = 0;
    if (o->max_num_batched_tokens == API_FLAG_UNSET) o->max_num_batched_tokens = 0;
    api_engine_defaults(o->device, &o->max_num_seqs, &o->max_num_batched_tokens, &o->sched.ttft_target_s);
    if (o->max_num_batched_tokens < o->max_num_seqs) { /* both given: the defaults bend to a given value */
        fprintf(stderr, "sluice serve: --max-num-batched-tokens %ld is less than --max-num-seqs %ld "
                        "(a step must hold one token of every running sequence)\n",
                o->max_num_batched_tokens, o->max_num_seqs);
        return 2;
    }
    api_gpu_util_note("serve", o->device, o->gpu_memory_utilization, o->kv_cache_memory);
    if (isnan(o->gpu_memory_utilization)) o->gpu_memory_utilization = 0.9;
    if (o->tensor_parallel_size > 1 && (o->device ? strcmp(o->device, "cuda") : !model_cuda_available())) {
        fprintf(stderr, "sluice serve: --tensor-parallel-size %ld needs --device cuda and that many GPUs%s\n",
                o->tensor_parallel_size, model_cuda_available() ? "" : " (this build or host has no GPU)");
        return 2;
    }
    bool kv8;
    if (model_kv_dtype(&(struct model_backend_opts){.kv_cache_dtype = o->kv_cache_dtype}, o->device, &kv8, err,
                       sizeof err)) {
        fprintf(stderr, "sluice serve: %s\n", err);
        return 2;
    }
    if (o->served_model_names.n == 0) {
        o->served_model_names.v[0] = o->model;
        o->served_model_names.n = 1;
    }
    s->model_names = o->served_model_names.v;
    s->model_name = s->model_names[0];
    /* the soft open-file limit up to the hard one (as Go's runtime does):
     * connections are fds; 64 stay for the model, the store and the rest */
    struct rlimit rl;
    if (getrlimit(RLIMIT_NOFILE, &rl) == 0) {
        rlim_t want = rl.rlim_max == RLIM_INFINITY || rl.rlim_max > 65536 ? 65536 : rl.rlim_max;
        if (rl.rlim_cur != RLIM_INFINITY && rl.rlim_cur < want) {
            rl.rlim_cur = want;
            setrlimit(RLIMIT_NOFILE, &rl);
            getrlimit(RLIMIT_NOFILE, &rl);
        }
        long fds = rl.rlim_cur == RLIM_INFINITY ? 65536 : (long)rl.rlim_cur;
        if (o->max_connections == 0) o->max_connections = fds - 64 > 16 ? fds - 64 : 16;
    } else if (o->max_connections == 0) {
        o->max_connections = 1000;
    }
    signal(SIGPIPE, SIG_IGN);
    evthread_use_pthreads();
    s->base = event_base_new();
    s->http = s->base ? evhttp_new(s->base) : NULL;
    if (!s->http) {
        fprintf(stderr, "sluice serve: cannot create the event loop\n");
        return 1;
    }
    evthread_make_base_notifiable(s->base);
    evhttp_set_allowed_methods(s->http, EVHTTP_REQ_GET | EVHTTP_REQ_POST | EVHTTP_REQ_DELETE | EVHTTP_REQ_PUT |
                                            EVHTTP_REQ_HEAD | EVHTTP_REQ_OPTIONS | EVHTTP_REQ_PATCH);
    /* the hard cap libevent enforces (its own 413): one cap for every route in
     * libevent 2.1, so it is sized for uploads (POST /v1/files) and JSON routes
     * check max_body_bytes in their handlers */
    long cap = o->max_batch_file_bytes + (1L << 20);
    evhttp_set_max_body_size(s->http, cap > o->max_body_bytes + 1024 ? cap : o->max_body_bytes + 1024);
    /* a backstop: server_conn.c answers 431 before libevent's own 413 */
    evhttp_set_max_headers_size(s->http, o->max_header_bytes + 4096);
    evhttp_set_gencb(s->http, route, s);
    char hb[300];
    evutil_socket_t lfd = listen_on(o->host, o->port, err, sizeof err);
    struct evhttp_bound_socket *bound = lfd >= 0 ? evhttp_accept_socket_with_handle(s->http, lfd) : NULL;
    if (!bound) {
        if (lfd >= 0) {
            close(lfd);
            snprintf(err, sizeof err, "libevent cannot accept on the socket");
        }
        fprintf(stderr, "sluice serve: cannot listen on %s:%ld: %s\n", url_host(o->host, false, hb, sizeof hb),
                o->port, err);
        return 1;
    }
    if (srv_conns_start(s, bound, err, sizeof err)) {
        fprintf(stderr, "sluice serve: %s\n", err);
        return 1;
    }
    if (srv_batch_start(s, err, sizeof err)) { /* after the bind: a second server must not recover our rows */
        fprintf(stderr, "sluice serve: %s\n", err);
        return 1;
    }
    s->wake_ev = event_new(s->base, -1, 0, on_wake, s);
    s->ready_ev = event_new(s->base, -1, 0, on_ready, s);
    s->drain_ev = evtimer_new(s->base, drain_tick, s);
    struct event *sigint = evsignal_new(s->base, SIGINT, on_signal, s);
    struct event *sigterm = evsignal_new(s->base, SIGTERM, on_signal, s);
    event_add(sigint, NULL);
    event_add(sigterm, NULL);
    sched_evbuf_init(&s->evbuf);
    fprintf(stderr, "sluice serve: listening on http://%s:%ld, loading %s\n", url_host(o->host, false, hb, sizeof hb),
            o->port, o->model);
    pthread_t loader;
    if (pthread_create(&loader, NULL, load_main, s)) {
        fprintf(stderr, "sluice serve: cannot start the loader thread\n");
        return 1;
    }
    pthread_detach(loader);
    event_base_dispatch(s->base);
    int rc = atomic_load(&s->state) == SRV_FAILED ? 1 : 0;
    srv_batch_stop(s); /* before the engine: its rows are still in flight there */
    if (s->fatal) return API_EXIT_NOW; /* the store is closed; the GPUs are left to the process exit */
    /* the connections first: their close callbacks abort what still runs
     * in the engine, whose finish events then free the requests */
    evhttp_free(s->http);
    srv_conns_stop(s);
    if (s->n_pending > 0 && s->eng && atomic_load(&s->state) == SRV_READY) srv_abort_interactive(s);
    for (int i = 0; i < 200 && s->n_pending > 0 && s->eng && atomic_load(&s->state) == SRV_READY; i++) {
        srv_drain_events(s);
        if (s->n_pending > 0) usleep(10 * 1000);
    }
    /* a loader still running owns s->m; only tear down what is complete */
    if (atomic_load(&s->state) == SRV_READY) {
        sched_sink_destroy(s->sink);
        sched_engine_destroy(s->eng);
        model_backend_destroy(s->be);
        model_free(s->m);
    }
    sched_evbuf_deinit(&s->evbuf);
    event_free(sigint);
    event_free(sigterm);
    event_free(s->wake_ev);
    event_free(s->ready_ev);
    if (s->drain_ev) event_free(s->drain_ev);
    event_base_free(s->base);
    return rc;
}

/* server.h - the HTTP server's internals shared by api/server*.c (not a
 * public header: other modules never see it).
 *
 * One libevent event_base runs on the api thread: evhttp parses requests, the
 * handlers validate, render and tokenize, then submit to the engine, which
 * runs on its own thread. The engine posts events and wakes the api thread
 * with event_active(); the api thread drains them and writes stream chunks or
 * final replies. The model loads on a loader thread so /health can answer 503
 * meanwhile. Everything in struct server is touched by the api thread only,
 * except `state` (atomic) and what the loader thread fills before it flips
 * state to READY.
 */
#ifndef SLUICE_API_SERVER_H
#define SLUICE_API_SERVER_H

#include <event2/event.h>
#include <event2/http.h>
#include <pthread.h>
#include <stdatomic.h>
#include <stdbool.h>
#include <stdint.h>

#include "api/api.h"
#include "model/backend.h"
#include "base/json.h"
#include "model/model.h"
#include "sched/sched.h"

enum server_state { SRV_LOADING, SRV_READY, SRV_FAILED };

struct server_opts {
    const char *model;
    struct api_flag_strs served_model_names; /* --served-model-name a [b ...]: clients may use any */
    const char *tokenizer;
    const char *hf_overrides;   /* JSON, applied by the loader */
    const char *load_format;    /* "auto" or "dummy" (random weights from config.json) */
    bool check_weights;         /* --check-weights: model_load refuses non-finite weights */
    const char *host;
    long port;
    const char *api_key;
    long max_model_len;
    long max_num_seqs;
    long max_num_batched_tokens;
    long block_size;
    long mamba_block_size; /* recurrent layers: tokens between prefix-cache state snapshots (0: auto) */
    bool enable_prefix_caching;
    bool enable_prompt_tokens_details;
    double gpu_memory_utilization;
    long tensor_parallel_size;
    const char *kv_cache_memory;
    const char *kv_cache_dtype; /* auto, fp8, fp8_e4m3 (model_kv_dtype) */
    bool enforce_eager;         /* no CUDA graphs (--enforce-eager or cudagraph_mode NONE) */
    const char *device;
    long threads;
    long max_body_bytes;        /* JSON request bodies */
    struct sched_config sched;  /* the policy flags (API_SCHED_FLAGS): min_batch_share, the latency targets */
    long long_prefill_token_threshold; /* sched_config's: a prefill's tokens per step at most (0: any) */
    long max_num_partial_prefills, max_long_partial_prefills; /* sched_config's (1, 1: no limit) */
    const char *data_dir;       /* the batch store (server_batch.c) */
    long max_batch_file_lines, max_batch_file_bytes;
    bool allow_short_windows;   /* test only: completion windows like "3s" */
    bool web_ui;                /* serve the web page at / (webui.c); --no-web-ui turns it off */
    long shutdown_timeout;      /* SIGTERM: seconds in-flight requests may take to finish (vLLM's
                                   --shutdown-timeout; 0: they are cut at once, with a final event) */
    const char *allowed_origins, *allowed_methods, *allowed_headers; /* CORS, vLLM's JSON lists ("*": any) */
    bool allow_credentials;
    /* connection limits (server_conn.c) */
    long max_header_bytes;      /* request line + headers; over it: 431 */
    long max_header_count;      /* header fields; over it: 431 */
    long max_connections;       /* open at once; 0 until api_cmd_serve sets it from the fd limit */
    double timeout_keep_alive;  /* seconds a connection may sit without a request */
    double timeout_header;      /* seconds a request head may take to arrive */
    double timeout_read;        /* seconds a request body may stall */
    double timeout_write;       /* seconds a reply may stall on a client that does not read */
};

/* Histogram with fixed bucket bounds, Prometheus style. */
#define SRV_HIST_BUCKETS 14
struct srv_hist {
    double sum;
    uint64_t count;
    uint64_t le[SRV_HIST_BUCKETS]; /* cumulative counts per bound */
};

/* A histogram over given bounds (vLLM's buckets for its families). */
#define SRV_VHIST_MAX 24
struct srv_vhist {
    double sum;
    uint64_t count;
    uint64_t le[SRV_VHIST_MAX]; /* cumulative counts per bound */
};

/* vLLM's request-level families, over every engine request that finished
 * (chats and batch rows; each choice of n is one): what vLLM's dashboards
 * read. Per class (0 interactive, 1 batch) where sluice splits them.
 * Written by the api thread (chats) and the store thread (batch rows):
 * under struct server's vm_mu. */
enum { SRV_FIN_STOP, SRV_FIN_LENGTH, SRV_FIN_ABORT, SRV_FIN_ERROR, SRV_N_FIN };
struct srv_req_metrics {
    uint64_t finished[2][SRV_N_FIN];
    uint64_t prompt_tokens, gen_tokens;
    struct srv_vhist e2e, queue, prefill, decode, inference, tpot; /* seconds */
    struct srv_vhist prompt_len, gen_len;                          /* tokens */
};
/* One request waiting for engine events. */
struct pending {
    uint64_t id;
    struct evhttp_request *req;      /* NULL once the client went away */
    struct server *srv;
    bool chat, stream, include_usage, logprobs, echo_done;
    int top_logprobs;
    long created;
    char rid[48];                    /* "chatcmpl-..." / "cmpl-..." */
    struct json_buf text;            /* accumulated completion text (non-streamed) */
    struct json_buf lp;              /* accumulated logprobs content entries (non-streamed) */
    double t_submit;
    struct pending *next;            /* hash chain */
};

struct server {
    struct server_opts o;
    struct event_base *base;
    struct evhttp *http;
    struct event *wake_ev;           /* engine -> api thread */
    bool fatal;                      /* the backend failed for good: the loop stopped */
    struct event *ready_ev;          /* loader -> api thread */
    _Atomic int state;
    char load_error[512];
    model *m;
    model_backend *be;
    sched_engine *eng;
    sched_sink *sink;                /* the chat requests' events (the Batch API has its own) */
    const char *model_name;          /* served name: the first of model_names, in every reply */
    const char *const *model_names;  /* NULL-terminated: the names a request may give */
    struct sched_evbuf evbuf;
    struct pending *table[1024];     /* by id, chained */
    int n_pending;
    /* metrics (api thread; the token counters also count batch rows, from the store thread) */
    uint64_t n_requests_ok, n_requests_err;
    _Atomic uint64_t prompt_tokens_total, generation_tokens_total, cached_tokens_total;
    /* time to first token and between tokens come from the engine, per class */
    struct srv_hist e2e, queue; /* queue: submit -> admitted (vLLM's request_queue_time) */
    struct srv_req_metrics vm;       /* vLLM's families (server_metrics.c), under vm_mu */
    pthread_mutex_t vm_mu;
    struct srv_batch *batch;         /* files, batches, store thread (server_batch.c) */
    /* SIGTERM: new requests get 503, in-flight ones finish until drain_deadline, then are cut */
    _Atomic bool draining;           /* read by the store thread's feeder: no new batch rows */
    double drain_deadline, drain_done_at;
    bool drain_cut;
    struct event *drain_ev;
    struct srv_req *live;            /* chat/completions requests in flight (server_complete.c) */
    /* CORS (server.c): parsed from the flags at start */
    char **cors_origins, **cors_methods, **cors_headers;
    int n_cors_origins, n_cors_methods, n_cors_headers;
    struct srv_conns *conns;         /* connection limits (server_conn.c) */
};

/* ---- server_http.c: replies and request helpers ---- */
void srv_reply_json(struct evhttp_request *req, int code, const struct json_buf *body);
/* OpenAI-shaped error: {"error":{"message","type","param","code"}}. */
void srv_reply_error(struct evhttp_request *req, int code, const char *type, const char *param,
                     const char *fmt, ...) __attribute__((format(printf, 5, 6)));
/* Reads the request body into a malloc'ed NUL-terminated buffer; replies 413
 * and returns NULL when it exceeds max. */
char *srv_read_body(struct evhttp_request *req, long max, size_t *len);
bool srv_auth_ok(const struct server *s, struct evhttp_request *req);
/* Whether an Authorization header's value carries the API key (true when no key is set). */
bool srv_auth_header_ok(const struct server *s, const char *value);
double srv_now(void);
void srv_hist_add(struct srv_hist *h, double v);
extern const double srv_hist_bounds[SRV_HIST_BUCKETS];

/* ---- server_metrics.c: GET /metrics ---- */
/* Counts a finished engine request (ev: its finish event) in s->vm. */
void srv_metrics_finish(struct server *s, const struct sched_event *ev, bool batch);
/* Answers GET /metrics. */
void srv_handle_metrics(struct server *s, struct evhttp_request *req);

/* ---- server.c: routes ---- */
/* The largest body a request to method/path may carry, and whether the route
 * needs the API key: what server_conn.c checks before a body is read. */
long srv_route_body_cap(const struct server *s, const char *method, const char *path, bool *needs_key);

/* ---- server_conn.c: connection limits evhttp does not enforce ---- */
struct evhttp_bound_socket;
/* Takes over the accepted connections of s->http (its bevcb) and the
 * listener's accept errors: header and body limits before the body is read,
 * timeouts, the connection cap. Call once the socket is bound. Returns 0, or
 * -1 with a message. */
int srv_conns_start(struct server *s, struct evhttp_bound_socket *bound, char *err, size_t errlen);
/* After evhttp_free: drops what is left. Safe when srv_conns_start never ran. */
void srv_conns_stop(struct server *s);
/* route(): req goes to a handler; its connection is busy until the reply ends. */
void srv_conn_request(struct server *s, struct evhttp_request *req);

/* ---- webui.c: the web page at / (chat, batch jobs, server status) ---- */
/* Serves req when path is one of the page's files (GET/HEAD; other methods
 * get 405) and returns true; false, having done nothing, for any other path.
 * The files are built into the binary. Api thread. */
bool srv_webui_route(struct evhttp_request *req, const char *path);

/* ---- server_complete.c: /v1/chat/completions, /v1/completions ---- */
void srv_handle_completions(struct server *s, struct evhttp_request *req, bool chat);
/* POST /v1/responses (OpenAI's Responses API, translated to chat: api/responses.c). */
void srv_handle_responses(struct server *s, struct evhttp_request *req);
/* Drains the chat requests' engine events into replies (api thread, on wake_ev). */
void srv_drain_events(struct server *s);
/* Aborts every chat/completions request in flight: each ends with its final
 * event (finish_reason "abort", then [DONE] for a stream). */
void srv_abort_interactive(struct server *s);

/* ---- server_batch.c: /v1/files, /v1/batches, the store thread and its feeder ---- */
/* Opens the store under s->o.data_dir (writer for the store thread, reader
 * for the api thread) and starts the store thread. Call on the main thread
 * once s->base exists. Returns 0, or a negative status with a message. */
int srv_batch_start(struct server *s, char *err, size_t errlen);
/* Stops the store thread (buffered results are written first), closes the
 * store. Call after the event loop ended and before the engine is destroyed.
 * Safe when srv_batch_start failed or never ran. */
void srv_batch_stop(struct server *s);
/* true for the paths server_batch.c serves (/v1/files..., /v1/batches...). */
bool srv_batch_route(const char *path);
/* Serves one /v1/files or /v1/batches request (auth already checked). */
void srv_handle_batch_api(struct server *s, struct evhttp_request *req, const char *path);
/* /health's body while the batch store fails to write (appends nothing
 * while it is healthy); api thread. */
void srv_batch_health_json(struct server *s, struct json_buf *out);
/* The batch store's gauges and counters for /metrics; api thread. */
struct evbuffer;
void srv_batch_metrics(struct server *s, struct evbuffer *o);

#endif

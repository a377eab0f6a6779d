/* server_http.c - small HTTP helpers of the server: JSON and error replies,
 * bounded body reading, API-key check, histograms. Api thread only. */
#include <event2/buffer.h>
#include <event2/http.h>
#include <event2/keyvalq_struct.h>
#include <stdarg.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

#include "server.h"

const double srv_hist_bounds[SRV_HIST_BUCKETS] = {0.005, 0.01, 0.025, 0.05, 0.075, 0.1, 0.25,
                                                  0.5,   0.75, 1.0,   2.5,  5.0,   10.0, 30.0};

double srv_now(void)
{
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return (double)ts.tv_sec + ts.tv_nsec * 1e-9;
}

void srv_hist_add(struct srv_hist *h, double v)
{
    h->sum += v;
    h->count++;
    for (int i = 0; i < SRV_HIST_BUCKETS; i++)
        if (v <= srv_hist_bounds[i]) h->le[i]++;
}

static const char *reason(int code)
{
    switch (code) {
    case 200: return "OK";
    case 400: return "Bad Request";
    case 401: return "Unauthorized";
    case 404: return "Not Found";
    case 405: return "Method Not Allowed";
    case 413: return "Payload Too Large";
    case 431: return "Request Header Fields Too Large";
    case 500: return "Internal Server Error";
    case 503: return "Service Unavailable";
    default: return "Error";
    }
}

void srv_reply_json(struct evhttp_request *req, int code, const struct json_buf *body)
{
    struct evbuffer *out = evbuffer_new();
    if (!out) return;
    if (body->oom) evbuffer_add_printf(out, "{\"error\":{\"message\":\"out of memory\",\"type\":\"server_error\"}}");
    else evbuffer_add(out, body->p, body->len);
    struct evkeyvalq *h = evhttp_request_get_output_headers(req);
    evhttp_add_header(h, "Content-Type", "application/json");
    if (evhttp_request_get_command(req) == EVHTTP_REQ_HEAD) {
        /* the length a GET would get; libevent 2.1 would write the body too */
        char n[24];
        snprintf(n, sizeof n, "%zu", evbuffer_get_length(out));
        evhttp_add_header(h, "Content-Length", n);
        evbuffer_drain(out, evbuffer_get_length(out));
    }
    evhttp_send_reply(req, code, reason(code), out);
    evbuffer_free(out);
}

void srv_reply_error(struct evhttp_request *req, int code, const char *type, const char *param, const char *fmt,
                     ...)
{
    char msg[1024];
    va_list ap;
    va_start(ap, fmt);
    vsnprintf(msg, sizeof msg, fmt, ap);
    va_end(ap);
    struct json_buf b;
    json_buf_init(&b);
    json_buf_lit(&b, "{\"error\":{\"message\":");
    json_buf_add_str(&b, msg, strlen(msg));
    json_buf_addf(&b, ",\"type\":\"%s\",\"param\":", type);
    if (param) json_buf_add_str(&b, param, strlen(param));
    else json_buf_lit(&b, "null");
    json_buf_addf(&b, ",\"code\":%d}}", code);
    srv_reply_json(req, code, &b);
    json_buf_free(&b);
}

char *srv_read_body(struct evhttp_request *req, long max, size_t *len)
{
    struct evbuffer *in = evhttp_request_get_input_buffer(req);
    size_t n = evbuffer_get_length(in);
    if ((long)n > max) {
        srv_reply_error(req, 413, "invalid_request_error", NULL, "request body of %zu bytes exceeds the limit of %ld",
                        n, max);
        return NULL;
    }
    char *body = malloc(n + 1);
    if (!body) {
        srv_reply_error(req, 500, "server_error", NULL, "out of memory reading the request body");
        return NULL;
    }
    evbuffer_copyout(in, body, n);
    body[n] = '\0';
    *len = n;
    return body;
}

/* Compares in time independent of where the strings differ. */
static bool const_time_eq(const char *a, size_t na, const char *b, size_t nb)
{
    unsigned char diff = (unsigned char)(na != nb);
    size_t n = na > nb ? na : nb;
    for (size_t i = 0; i < n; i++) {
        unsigned char x = i < na ? (unsigned char)a[i] : 0, y = i < nb ? (unsigned char)b[i] : 0;
        diff |= x ^ y;
    }
    return diff == 0;
}

bool srv_auth_header_ok(const struct server *s, const char *h)
{
    if (!s->o.api_key || !*s->o.api_key) return true;
    if (!h || strncasecmp(h, "Bearer ", 7) != 0) return false;
    const char *tok = h + 7;
    return const_time_eq(tok, strlen(tok), s->o.api_key, strlen(s->o.api_key));
}

bool srv_auth_ok(const struct server *s, struct evhttp_request *req)
{
    return srv_auth_header_ok(s, evhttp_find_header(evhttp_request_get_input_headers(req), "Authorization"));
}

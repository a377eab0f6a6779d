/* server_conn.c - the server's connections: the limits evhttp (libevent
 * 2.1) does not enforce, applied before evhttp parses a request's bytes.
 *
 * evhttp makes each accepted connection's bufferevent through our bevcb, so
 * every connection is known here. A callback on the bufferevent's input
 * buffer sees each byte as it is read, before evhttp parses it; a small
 * parser follows the request framing as evhttp does (head; a Content-Length
 * or chunked body) and refuses, before the body is read:
 *   a head over --max-header-bytes or --h11-max-header-count     431
 *   two differing Content-Lengths, or one that is not a number    400
 *   a body over the route's cap (from Content-Length before any
 *   body byte; a chunked body as it grows)                        413
 *   a body for a route that needs the API key, without it         401
 *   a request on a connection over --max-connections              503
 * The refusal goes straight to the socket, the rest of what the client
 * sends is read and dropped for a moment (so it sees the reply, not a
 * reset), and the connection closes. Requests pipelined behind a refused
 * one are dropped with it.
 *
 * Timeouts: a sweep closes connections with no request in a handler that
 * sat idle past --timeout-keep-alive, took longer than --timeout-header to
 * send a head (slowloris), or stalled a body past --timeout-read. A client
 * that stops reading a reply is cut by the bufferevent's write timeout
 * (--timeout-write).
 *
 * The cap: at --max-connections a new connection evicts the oldest one
 * without a request in a handler (idle first, then one still sending its
 * head); when there is none it gets 503. At the process's fd limit accept()
 * fails: the listener pauses (25 ms, doubling up to 1 s) and an idle
 * connection is evicted; one log line per episode, not one per failure.
 *
 * Closing is a shutdown(): evhttp reads the EOF and frees the connection.
 * We hold a reference on each bufferevent, so it outlives a connection
 * evhttp freed; the sweep sees evhttp's callbacks gone and drops it. The
 * bufferevent owns its socket (BEV_OPT_CLOSE_ON_FREE: evhttp then only
 * shuts it down), so the fd is closed with our reference: its number is not
 * reused while the freed bufferevent's events still name it.
 * Api thread only.
 */
#include <errno.h>
#include <event2/buffer.h>
#include <event2/bufferevent.h>
#include <event2/event.h>
#include <event2/http.h>
#include <event2/listener.h>
#include <stdarg.h>
#include <stddef.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <strings.h>
#include <sys/socket.h>

#include "server.h"

enum phase {
    PH_IDLE,        /* between requests */
    PH_HEAD,        /* request line and headers */
    PH_BODY,        /* Content-Length body: `left` bytes to come */
    PH_CHUNK_SIZE,  /* chunked: a size line */
    PH_CHUNK_DATA,  /* chunked: `left` bytes of a chunk */
    PH_CHUNK_END,   /* chunked: the CRLF after a chunk */
    PH_TRAILER,     /* chunked: trailer lines up to an empty one */
    PH_DISCARD,     /* refused: everything read is dropped */
};

struct conn {
    struct srv_conns *cs;
    struct bufferevent *bev;      /* our reference (bufferevent_incref); evhttp's connection uses it */
    struct conn *prev, *next;     /* cs->first..last, oldest first */
    struct conn *hnext;           /* cs->hash chain, by bev */
    enum phase ph;
    double since, last;           /* when the phase began; when the last byte came */
    char *head;                   /* PH_HEAD: the head so far, malloc'ed [max_header_bytes] */
    size_t head_len, line_len;    /* bytes of the head; of its current line ('\r' not counted) */
    int n_lines;
    int64_t left;                 /* PH_BODY, PH_CHUNK_DATA: bytes to come */
    int64_t req_bytes;            /* bytes of the current request so far */
    int64_t body, cap;            /* chunked: body bytes so far; the route's cap */
    bool size_done;               /* PH_CHUNK_SIZE: past the size's digits */
    int inflight;                 /* requests in a handler (srv_conn_request .. on_done) */
    int queued;                   /* complete requests evhttp has not handed to a handler yet */
    int code;                     /* a refusal: its status, 0 when none */
    char msg[200];
    bool sent;                    /* the refusal is written */
    bool reject;                  /* came in over the cap: 503 */
    bool closing;                 /* shut down: evhttp frees it at the EOF */
    bool in_cb;                   /* inside our own change of the input buffer */
};

#define HASH_SIZE 4096

struct srv_conns {
    struct server *s;
    struct conn *first, *last;
    struct conn *hash[HASH_SIZE];
    long n;                       /* in the list, dead ones included until a sweep */
    struct event *sweep_ev, *resume_ev;
    struct evconnlistener *lev;
    double backoff;               /* the next accept pause, seconds */
    double logged;                /* when the last accept-pause line was written */
    long n_pauses, n_rejected;    /* since then */
};

static const char *status_text(int code)
{
    switch (code) {
    case 400: return "Bad Request";
    case 401: return "Unauthorized";
    case 413: return "Payload Too Large";
    case 431: return "Request Header Fields Too Large";
    default: return "Service Unavailable";
    }
}

/* ---- the list and the hash ---- */

static size_t hslot(const struct bufferevent *bev) { return ((uintptr_t)bev >> 4) % HASH_SIZE; }

static struct conn *find(struct srv_conns *cs, const struct bufferevent *bev)
{
    for (struct conn *c = cs->hash[hslot(bev)]; c; c = c->hnext)
        if (c->bev == bev) return c;
    return NULL;
}

static void unlink_conn(struct conn *c)
{
    struct srv_conns *cs = c->cs;
    if (c->prev) c->prev->next = c->next;
    else cs->first = c->next;
    if (c->next) c->next->prev = c->prev;
    else cs->last = c->prev;
    for (struct conn **p = &cs->hash[hslot(c->bev)]; *p; p = &(*p)->hnext)
        if (*p == c) {
            *p = c->hnext;
            break;
        }
    cs->n--;
    free(c->head);
    bufferevent_decref(c->bev);
    free(c);
}

/* evhttp freed the connection: bufferevent_free cleared its callbacks, and
 * evhttp always has an event callback on a live one. */
static bool dead(const struct conn *c)
{
    bufferevent_event_cb ecb;
    bufferevent_getcb(c->bev, NULL, NULL, &ecb, NULL);
    return ecb == NULL;
}

static void sweep_dead(struct srv_conns *cs)
{
    for (struct conn *c = cs->first, *nx; c; c = nx) {
        nx = c->next;
        if (dead(c)) unlink_conn(c);
    }
}

/* evhttp sees the EOF and frees the connection (with the request it was reading). */
static void shut(struct conn *c)
{
    if (c->closing) return;
    c->closing = true;
    evutil_socket_t fd = bufferevent_getfd(c->bev);
    if (fd >= 0) shutdown(fd, SHUT_RDWR);
    bufferevent_enable(c->bev, EV_READ);
}

/* ---- refusals ---- */

/* Writes the refusal to the socket (nothing of evhttp's is in flight on it)
 * and half-closes; what the client still sends is dropped. */
static void send_refusal(struct conn *c)
{
    struct srv_conns *cs = c->cs;
    struct json_buf b;
    json_buf_init(&b);
    json_buf_lit(&b, "{\"error\":{\"message\":");
    json_buf_add_str(&b, c->msg, strlen(c->msg));
    json_buf_addf(&b, ",\"type\":\"%s\",\"param\":null,\"code\":%d}}",
                  c->code == 503 ? "server_error" : "invalid_request_error", c->code);
    char head[256];
    int hn = snprintf(head, sizeof head,
                      "HTTP/1.1 %d %s\r\nContent-Type: application/json\r\nContent-Length: %zu\r\n%s"
                      "Connection: close\r\n\r\n",
                      c->code, status_text(c->code), b.oom ? 0 : b.len, c->code == 503 ? "Retry-After: 1\r\n" : "");
    evutil_socket_t fd = bufferevent_getfd(c->bev);
    if (fd >= 0) {
        /* small: it fits the socket's empty send buffer */
        if (send(fd, head, (size_t)hn, MSG_NOSIGNAL | MSG_DONTWAIT) == hn && !b.oom)
            (void)!send(fd, b.p, b.len, MSG_NOSIGNAL | MSG_DONTWAIT);
        shutdown(fd, SHUT_WR);
    }
    json_buf_free(&b);
    c->sent = true;
    c->since = srv_now();
    cs->s->n_requests_err++;
}

/* Drops the input from byte `keep` on (what evhttp has not read of this
 * request and anything after it). */
static void drop_tail(struct conn *c, struct evbuffer *in, size_t keep)
{
    size_t len = evbuffer_get_length(in);
    if (keep >= len) return;
    c->in_cb = true;
    if (keep == 0) {
        evbuffer_drain(in, len);
    } else {
        struct evbuffer *tmp = evbuffer_new();
        if (tmp) {
            evbuffer_remove_buffer(in, tmp, keep);
            evbuffer_drain(in, len - keep);
            evbuffer_add_buffer(in, tmp);
            evbuffer_free(tmp);
        }
    }
    c->in_cb = false;
}

/* The current request is refused. `at`: its first byte's place in the
 * input buffer (negative: evhttp read some of it already). */
static void refuse(struct conn *c, struct evbuffer *in, ptrdiff_t at, int code, const char *fmt, ...)
    __attribute__((format(printf, 5, 6)));
static void refuse(struct conn *c, struct evbuffer *in, ptrdiff_t at, int code, const char *fmt, ...)
{
    va_list ap;
    va_start(ap, fmt);
    vsnprintf(c->msg, sizeof c->msg, fmt, ap);
    va_end(ap);
    c->code = code;
    c->ph = PH_DISCARD;
    c->since = srv_now();
    free(c->head);
    c->head = NULL;
    drop_tail(c, in, at > 0 ? (size_t)at : 0);
    /* replies to requests before it go first */
    if (c->inflight == 0 && c->queued == 0) send_refusal(c);
}

/* ---- the parser ---- */

static int hexval(char ch)
{
    return ch >= '0' && ch <= '9' ? ch - '0' : ch >= 'a' && ch <= 'f' ? ch - 'a' + 10 : ch >= 'A' && ch <= 'F' ? ch - 'A' + 10 : -1;
}

static bool method_has_body(const char *m, size_t n)
{
    static const char *const with[] = {"POST", "PUT", "PATCH", "GET", "DELETE", "OPTIONS", "CONNECT"};
    for (size_t i = 0; i < sizeof with / sizeof with[0]; i++)
        if (strlen(with[i]) == n && !memcmp(with[i], m, n)) return true;
    return false;
}

static void trim(const char **p, const char **e)
{
    while (*p < *e && (**p == ' ' || **p == '\t')) (*p)++;
    while (*e > *p && ((*e)[-1] == ' ' || (*e)[-1] == '\t' || (*e)[-1] == '\r')) (*e)--;
}

/* The head is complete (c->head, head_len bytes): decides the request's
 * framing and whether it is refused. Returns the status of a refusal (with
 * its message in msg), else 0. */
static int judge_head(struct conn *c, char *msg, size_t msglen)
{
    struct server *s = c->cs->s;
    const char *h = c->head, *end = h + c->head_len;
    const char *eol = memchr(h, '\n', c->head_len);
    const char *sp1 = memchr(h, ' ', (size_t)(eol - h));
    if (!sp1) { /* evhttp answers a bad request line itself */
        c->ph = PH_IDLE;
        return 0;
    }
    const char *tgt = sp1 + 1, *sp2 = memchr(tgt, ' ', (size_t)(eol - tgt));
    if (!sp2) sp2 = eol;
    char method[16], path[256];
    snprintf(method, sizeof method, "%.*s", (int)(sp1 - h), h);
    size_t pn = strcspn(tgt, "? \r\n");
    if (pn > (size_t)(sp2 - tgt)) pn = (size_t)(sp2 - tgt);
    snprintf(path, sizeof path, "%.*s", (int)pn, tgt);
    bool chunked = false, te_seen = false, have_cl = false, auth = false;
    int64_t cl = 0;
    for (const char *line = eol + 1; line < end;) {
        const char *le = memchr(line, '\n', (size_t)(end - line));
        if (!le) le = end;
        const char *colon = memchr(line, ':', (size_t)(le - line));
        if (colon) {
            const char *v = colon + 1, *ve = le;
            trim(&v, &ve);
            size_t nl = (size_t)(colon - line), vl = (size_t)(ve - v);
            if (nl == 14 && !strncasecmp(line, "Content-Length", 14)) {
                int64_t x = 0;
                bool ok = vl > 0 && vl <= 18;
                for (size_t i = 0; ok && i < vl; i++) {
                    ok = v[i] >= '0' && v[i] <= '9';
                    x = x * 10 + (v[i] - '0');
                }
                if (!ok) {
                    snprintf(msg, msglen, "invalid Content-Length '%.*s'", (int)(vl > 40 ? 40 : vl), v);
                    return 400;
                }
                if (have_cl && x != cl) {
                    snprintf(msg, msglen, "conflicting Content-Length headers (%lld and %lld)", (long long)cl,
                             (long long)x);
                    return 400;
                }
                have_cl = true;
                cl = x;
            } else if (nl == 17 && !strncasecmp(line, "Transfer-Encoding", 17) && !te_seen) {
                te_seen = true; /* evhttp looks at the first one only */
                chunked = vl == 7 && !strncasecmp(v, "chunked", 7);
            } else if (nl == 13 && !strncasecmp(line, "Authorization", 13)) {
                char val[512];
                snprintf(val, sizeof val, "%.*s", (int)(vl > sizeof val - 1 ? sizeof val - 1 : vl), v);
                auth = auth || srv_auth_header_ok(s, val);
            }
        }
        line = le + 1;
    }
    if (!auth && !(s->o.api_key && *s->o.api_key)) auth = true;
    bool needs_key;
    c->cap = srv_route_body_cap(s, method, path, &needs_key);
    bool body = method_has_body(method, (size_t)(sp1 - h)) && (chunked || cl > 0);
    if (c->reject) {
        snprintf(msg, msglen, "the server is at its connection limit (--max-connections %ld); retry",
                 s->o.max_connections);
        return 503;
    }
    if (body && needs_key && !auth) { /* refused before its body is read */
        snprintf(msg, msglen, "invalid or missing API key");
        return 401;
    }
    if (body && !chunked && cl > c->cap) {
        snprintf(msg, msglen, "request body of %lld bytes exceeds the limit of %lld for %s %.80s", (long long)cl,
                 (long long)c->cap, method, path);
        return 413;
    }
    c->body = 0;
    if (!body) c->ph = PH_IDLE;
    else if (chunked) {
        c->ph = PH_CHUNK_SIZE;
        c->left = 0;
        c->size_done = false;
    }
    else {
        c->ph = PH_BODY;
        c->left = cl;
    }
    return 0;
}

/* The current request's last byte came: evhttp hands it to route() next. */
static void request_done(struct conn *c, double now)
{
    c->queued++;
    c->ph = PH_IDLE;
    c->since = now;
    c->req_bytes = 0;
}

/* Follows n new bytes p; `base`: the place of p[0] in the input buffer. */
static void feed(struct conn *c, struct evbuffer *in, const char *p, size_t n, ptrdiff_t base)
{
    struct server *s = c->cs->s;
    double now = srv_now();
    c->last = now;
    for (size_t i = 0; i < n && c->ph != PH_DISCARD;) {
        ptrdiff_t at = base + (ptrdiff_t)i - (ptrdiff_t)c->req_bytes; /* the request's first byte */
        char ch = p[i];
        switch (c->ph) {
        case PH_IDLE:
            c->ph = PH_HEAD;
            c->since = now;
            c->head_len = c->line_len = 0;
            c->n_lines = 0;
            continue;
        case PH_HEAD:
            if (c->head_len >= (size_t)s->o.max_header_bytes) {
                refuse(c, in, at, 431, "the request head exceeds %ld bytes (--max-header-bytes)", s->o.max_header_bytes);
                return;
            }
            if (!c->head && !(c->head = malloc((size_t)s->o.max_header_bytes))) {
                refuse(c, in, at, 503, "out of memory reading the request head");
                return;
            }
            c->head[c->head_len++] = ch;
            c->req_bytes++;
            i++;
            if (ch == '\n') {
                if (c->line_len == 0 && c->n_lines > 0) {
                    char msg[200];
                    int code = judge_head(c, msg, sizeof msg);
                    free(c->head);
                    c->head = NULL;
                    if (code) {
                        refuse(c, in, at, code, "%s", msg);
                        return;
                    }
                    if (c->ph == PH_IDLE) request_done(c, now);
                    else c->since = now;
                } else if (c->line_len > 0 && ++c->n_lines > s->o.max_header_count + 1) {
                    refuse(c, in, at, 431, "more than %ld header fields (--h11-max-header-count)", s->o.max_header_count);
                    return;
                }
                c->line_len = 0;
            } else if (ch != '\r') {
                c->line_len++;
            }
            break;
        case PH_BODY: {
            size_t k = n - i < (uint64_t)c->left ? n - i : (size_t)c->left;
            c->left -= (int64_t)k;
            c->req_bytes += (int64_t)k;
            i += k;
            if (c->left == 0) request_done(c, now);
            break;
        }
        case PH_CHUNK_SIZE: /* hex digits, then anything (evhttp refuses what is not a size) up to LF */
            c->req_bytes++;
            i++;
            if (ch == '\n') {
                c->body += c->left;
                if (c->left > c->cap || c->body > c->cap) {
                    refuse(c, in, at, 413, "chunked request body exceeds the limit of %lld bytes", (long long)c->cap);
                    return;
                }
                c->ph = c->left ? PH_CHUNK_DATA : PH_TRAILER;
                c->line_len = 0;
            } else if (!c->size_done && hexval(ch) >= 0) {
                c->left = c->left > (INT64_MAX >> 4) ? INT64_MAX : c->left * 16 + hexval(ch);
            } else if (ch != '\r') {
                c->size_done = true;
            }
            break;
        case PH_CHUNK_END: /* CRLF after a chunk's data */
            c->req_bytes++;
            i++;
            if (ch == '\n') {
                c->ph = PH_CHUNK_SIZE;
                c->left = 0;
                c->size_done = false;
            }
            break;
        case PH_TRAILER: /* lines up to an empty one */
            c->req_bytes++;
            i++;
            if (ch == '\n') {
                if (c->line_len == 0) request_done(c, now);
                c->line_len = 0;
            } else if (ch != '\r') {
                c->line_len++;
            }
            break;
        case PH_CHUNK_DATA: {
            size_t k = n - i < (uint64_t)c->left ? n - i : (size_t)c->left;
            c->left -= (int64_t)k;
            c->req_bytes += (int64_t)k;
            i += k;
            if (c->left == 0) {
                c->ph = PH_CHUNK_END;
                c->line_len = 0;
            }
            break;
        }
        case PH_DISCARD:
            break;
        }
    }
}

static void on_input(struct evbuffer *in, const struct evbuffer_cb_info *info, void *arg)
{
    struct conn *c = arg;
    if (c->in_cb || info->n_added == 0 || dead(c)) return;
    size_t len = evbuffer_get_length(in);
    if (c->ph == PH_DISCARD) {
        drop_tail(c, in, len - info->n_added);
        return;
    }
    struct evbuffer_ptr pos;
    size_t start = len - info->n_added;
    if (evbuffer_ptr_set(in, &pos, start, EVBUFFER_PTR_SET)) return;
    char tmp[4096];
    for (size_t done = 0; done < info->n_added && c->ph != PH_DISCARD;) {
        if (c->ph == PH_BODY) { /* counted, not copied: an upload's megabytes */
            size_t k = info->n_added - done < (uint64_t)c->left ? info->n_added - done : (size_t)c->left;
            c->left -= (int64_t)k;
            c->req_bytes += (int64_t)k;
            c->last = srv_now();
            if (c->left == 0) request_done(c, c->last);
            done += k;
            evbuffer_ptr_set(in, &pos, k, EVBUFFER_PTR_ADD);
            continue;
        }
        size_t k = info->n_added - done < sizeof tmp ? info->n_added - done : sizeof tmp;
        ev_ssize_t got = evbuffer_copyout_from(in, &pos, tmp, k);
        if (got <= 0) break;
        feed(c, in, tmp, (size_t)got, (ptrdiff_t)(start + done));
        if (c->ph == PH_DISCARD) break;
        done += (size_t)got;
        evbuffer_ptr_set(in, &pos, (size_t)got, EVBUFFER_PTR_ADD);
    }
}

/* ---- requests in handlers ---- */

static void on_done(struct evhttp_request *req, void *arg)
{
    (void)req;
    struct conn *c = arg;
    if (c->inflight > 0) c->inflight--;
    c->since = srv_now();
    if (c->code && !c->sent && c->inflight == 0 && c->queued == 0) send_refusal(c);
}

void srv_conn_request(struct server *s, struct evhttp_request *req)
{
    struct evhttp_connection *con = evhttp_request_get_connection(req);
    struct conn *c = s->conns && con ? find(s->conns, evhttp_connection_get_bufferevent(con)) : NULL;
    if (!c) return;
    if (c->queued > 0) c->queued--;
    c->inflight++;
    evhttp_request_set_on_complete_cb(req, on_done, c);
}

/* ---- accepting ---- */

/* The oldest connection with nothing in a handler, idle ones first. */
static struct conn *evictable(struct srv_conns *cs)
{
    struct conn *head = NULL;
    for (struct conn *c = cs->first; c; c = c->next) {
        if (c->closing || c->inflight || c->queued || dead(c)) continue;
        if (c->ph == PH_IDLE) return c;
        if (c->ph == PH_HEAD && !head) head = c;
    }
    return head;
}

static void note(struct srv_conns *cs, const char *what)
{
    double now = srv_now();
    if (now - cs->logged < 10.0) return;
    fprintf(stderr, "sluice serve: %s (%ld accept pauses, %ld connections refused in the last %.0f s; "
                    "--max-connections %ld)\n",
            what, cs->n_pauses, cs->n_rejected, cs->logged ? now - cs->logged : 0.0, cs->s->o.max_connections);
    cs->logged = now;
    cs->n_pauses = cs->n_rejected = 0;
}

static void pause_accept(struct srv_conns *cs, double seconds)
{
    evconnlistener_disable(cs->lev);
    struct timeval tv = {(long)seconds, (long)((seconds - (long)seconds) * 1e6)};
    evtimer_add(cs->resume_ev, &tv);
}

static struct bufferevent *on_new_conn(struct event_base *base, void *arg)
{
    struct srv_conns *cs = arg;
    struct server *s = cs->s;
    cs->backoff = 0.025; /* accept works again */
    bool reject = false;
    if (cs->n >= s->o.max_connections) {
        sweep_dead(cs);
        if (cs->n >= s->o.max_connections) {
            struct conn *v = evictable(cs);
            if (v) {
                shut(v);
            } else {
                reject = true;
                cs->n_rejected++;
                note(cs, "at the connection limit: new connections get 503");
            }
            /* an evicted connection's fd is freed when evhttp reads its EOF,
             * in the loop's next turn: accept no more in this one */
            pause_accept(cs, 0.002);
        }
    }
    struct conn *c = calloc(1, sizeof *c);
    struct bufferevent *bev = c ? bufferevent_socket_new(base, -1, BEV_OPT_CLOSE_ON_FREE) : NULL;
    if (!bev) {
        free(c);
        return NULL;
    }
    bufferevent_incref(bev);
    c->cs = cs;
    c->bev = bev;
    c->reject = reject;
    c->since = c->last = srv_now();
    if (!evbuffer_add_cb(bufferevent_get_input(bev), on_input, c)) {
        bufferevent_decref(bev);
        bufferevent_free(bev);
        free(c);
        return NULL;
    }
    struct timeval wt = {(long)s->o.timeout_write, (long)((s->o.timeout_write - (long)s->o.timeout_write) * 1e6)};
    bufferevent_set_timeouts(bev, NULL, &wt);
    c->prev = cs->last;
    if (cs->last) cs->last->next = c;
    else cs->first = c;
    cs->last = c;
    size_t h = hslot(bev);
    c->hnext = cs->hash[h];
    cs->hash[h] = c;
    cs->n++;
    return bev;
}

static void on_resume(evutil_socket_t fd, short what, void *arg)
{
    (void)fd;
    (void)what;
    struct srv_conns *cs = arg;
    evconnlistener_enable(cs->lev);
}

/* The listener's callbacks share evhttp's argument: the error callback
 * finds the connections here (one server a process). */
static struct srv_conns *the_conns;

/* accept() failed for a reason that is not the client's: out of fds (or
 * memory). Retrying at once would spin; pause, and make room. */
static void on_accept_error(struct evconnlistener *lev, void *arg)
{
    (void)lev;
    (void)arg;
    struct srv_conns *cs = the_conns;
    int e = EVUTIL_SOCKET_ERROR();
    cs->n_pauses++;
    sweep_dead(cs); /* their fds close with our references */
    struct conn *v = evictable(cs);
    if (v) shut(v);
    char what[160];
    snprintf(what, sizeof what, "accept() failed: %s; pausing new connections%s", strerror(e),
             e == EMFILE || e == ENFILE ? " (at the open-file limit: ulimit -n)" : "");
    note(cs, what);
    pause_accept(cs, cs->backoff);
    cs->backoff = cs->backoff * 2 > 1.0 ? 1.0 : cs->backoff * 2;
}

/* ---- the sweep ---- */

static void on_sweep(evutil_socket_t fd, short what, void *arg)
{
    (void)fd;
    (void)what;
    struct srv_conns *cs = arg;
    const struct server_opts *o = &cs->s->o;
    double now = srv_now();
    for (struct conn *c = cs->first, *nx; c; c = nx) {
        nx = c->next;
        if (dead(c)) {
            unlink_conn(c);
            continue;
        }
        if (c->inflight || c->closing) continue;
        double t = now - c->since;
        bool close = false;
        switch (c->ph) {
        case PH_IDLE: close = !c->queued && t > o->timeout_keep_alive; break;
        case PH_HEAD: close = t > o->timeout_header; break;
        case PH_DISCARD: close = c->sent && (t > 5.0 || now - c->last > 1.0); break;
        default: close = now - c->last > o->timeout_read; break;
        }
        if (close) shut(c);
    }
}

int srv_conns_start(struct server *s, struct evhttp_bound_socket *bound, char *err, size_t errlen)
{
    struct srv_conns *cs = calloc(1, sizeof *cs);
    if (!cs) {
        snprintf(err, errlen, "out of memory");
        return -1;
    }
    cs->s = s;
    cs->backoff = 0.025;
    cs->lev = evhttp_bound_socket_get_listener(bound);
    cs->sweep_ev = event_new(s->base, -1, EV_PERSIST, on_sweep, cs);
    cs->resume_ev = evtimer_new(s->base, on_resume, cs);
    if (!cs->sweep_ev || !cs->resume_ev) {
        if (cs->sweep_ev) event_free(cs->sweep_ev);
        if (cs->resume_ev) event_free(cs->resume_ev);
        free(cs);
        snprintf(err, errlen, "out of memory");
        return -1;
    }
    double shortest = s->o.timeout_keep_alive < s->o.timeout_header ? s->o.timeout_keep_alive : s->o.timeout_header;
    double tick = shortest / 4 < 0.05 ? 0.05 : shortest / 4 > 0.5 ? 0.5 : shortest / 4;
    struct timeval tv = {0, (long)(tick * 1e6)};
    event_add(cs->sweep_ev, &tv);
    evconnlistener_set_error_cb(cs->lev, on_accept_error);
    evhttp_set_bevcb(s->http, on_new_conn, cs);
    s->conns = the_conns = cs;
    return 0;
}

void srv_conns_stop(struct server *s)
{
    struct srv_conns *cs = s->conns;
    if (!cs) return;
    event_free(cs->sweep_ev);
    event_free(cs->resume_ev);
    /* evhttp_free freed the connections; our references remain */
    while (cs->first) unlink_conn(cs->first);
    free(cs);
    s->conns = the_conns = NULL;
}

/* http_client.c - the blocking HTTP/1.1 client declared in http_client.h. */
#include "api/http_client.h"

#include <errno.h>
#include <fcntl.h>
#include <netdb.h>
#include <poll.h>
#include <stdbool.h>
#include <stdlib.h>
#include <string.h>
#include <strings.h>
#include <sys/socket.h>
#include <sys/time.h>
#include <time.h>
#include <unistd.h>

#define CONNECT_TIMEOUT_MS 10000
#define MAX_COLLECT ((size_t)64 << 20)   /* nothing the commands read needs a bigger reply */

struct conn {
    int fd;
    double timeout;
    char buf[16384];
    size_t pos, len;
    bool eof;
};

int hc_parse_url(struct hc_target *t, const char *url, char *err, size_t errlen)
{
    if (!strncmp(url, "https://", 8)) {
        snprintf(err, errlen, "--url %s: https is not supported (put a plain-HTTP address or a local proxy)", url);
        return -1;
    }
    if (strncmp(url, "http://", 7) && strstr(url, "://")) {
        snprintf(err, errlen, "--url '%s': only http:// URLs are supported", url);
        return -1;
    }
    const char *p = !strncmp(url, "http://", 7) ? url + 7 : url;
    const char *slash = strchr(p, '/');
    size_t hlen = slash ? (size_t)(slash - p) : strlen(p);
    char hp[300];
    if (!hlen || hlen >= sizeof hp) {
        snprintf(err, errlen, "--url '%s' has no host", url);
        return -1;
    }
    memcpy(hp, p, hlen);
    hp[hlen] = 0;
    const char *colon = strrchr(hp, ':');
    const char *host = hp, *port = "80";
    if (hp[0] == '[') { /* [v6]:port */
        char *close = strchr(hp, ']');
        if (!close) {
            snprintf(err, errlen, "--url '%s': bad IPv6 address", url);
            return -1;
        }
        *close = 0;
        host = hp + 1;
        if (close[1] == ':') port = close + 2;
    } else if (colon) {
        hp[colon - hp] = 0;
        port = colon + 1;
    }
    char *end;
    long pn = strtol(port, &end, 10);
    if (!*port || *end || pn <= 0 || pn > 65535) {
        snprintf(err, errlen, "--url '%s': bad port '%s'", url, port);
        return -1;
    }
    snprintf(t->host, sizeof t->host, "%.255s", host);
    snprintf(t->port, sizeof t->port, "%ld", pn);
    snprintf(t->prefix, sizeof t->prefix, "%.255s", slash ? slash : "");
    size_t pl = strlen(t->prefix);
    while (pl && t->prefix[pl - 1] == '/') t->prefix[--pl] = 0;
    /* http://host:8000/v1 is what OpenAI clients take; the paths add /v1 */
    if (pl >= 3 && !strcmp(t->prefix + pl - 3, "/v1")) t->prefix[pl - 3] = 0;
    return 0;
}

/* ---- the connection ------------------------------------------------------------------------- */

static int conn_open(struct conn *c, const struct hc_target *t, char *err, size_t errlen)
{
    struct addrinfo hints = {.ai_socktype = SOCK_STREAM, .ai_family = AF_UNSPEC}, *res = NULL;
    int gai = getaddrinfo(t->host, t->port, &hints, &res);
    if (gai) {
        snprintf(err, errlen, "cannot resolve %s: %s", t->host, gai_strerror(gai));
        return -1;
    }
    int last = 0;
    c->fd = -1;
    for (struct addrinfo *ai = res; ai && c->fd < 0; ai = ai->ai_next) {
        int fd = socket(ai->ai_family, ai->ai_socktype | SOCK_CLOEXEC, ai->ai_protocol);
        if (fd < 0) { last = errno; continue; }
        /* connect without blocking so a black-holed address fails in 10 s */
        int fl = fcntl(fd, F_GETFL);
        fcntl(fd, F_SETFL, fl | O_NONBLOCK);
        int rc = connect(fd, ai->ai_addr, ai->ai_addrlen);
        if (rc < 0 && errno == EINPROGRESS) {
            struct pollfd pf = {.fd = fd, .events = POLLOUT};
            rc = poll(&pf, 1, CONNECT_TIMEOUT_MS);
            if (rc == 0) { errno = ETIMEDOUT; rc = -1; }
            else if (rc > 0) {
                int so = 0;
                socklen_t sl = sizeof so;
                getsockopt(fd, SOL_SOCKET, SO_ERROR, &so, &sl);
                if (so) { errno = so; rc = -1; }
                else rc = 0;
            }
        }
        if (rc < 0) {
            last = errno;
            close(fd);
            continue;
        }
        fcntl(fd, F_SETFL, fl);
        struct timeval tv = {.tv_sec = (time_t)c->timeout,
                             .tv_usec = (suseconds_t)((c->timeout - (time_t)c->timeout) * 1e6)};
        setsockopt(fd, SOL_SOCKET, SO_RCVTIMEO, &tv, sizeof tv);
        setsockopt(fd, SOL_SOCKET, SO_SNDTIMEO, &tv, sizeof tv);
        c->fd = fd;
    }
    freeaddrinfo(res);
    if (c->fd < 0) {
        snprintf(err, errlen, "cannot connect to %s:%s: %s (is the server running?)", t->host, t->port,
                 strerror(last));
        return -1;
    }
    c->pos = c->len = 0;
    c->eof = false;
    return 0;
}

static int send_all(int fd, const void *p, size_t n)
{
    const char *q = p;
    while (n) {
        ssize_t w = send(fd, q, n, MSG_NOSIGNAL);
        if (w < 0 && errno == EINTR) continue;
        if (w <= 0) return -1;
        q += w;
        n -= (size_t)w;
    }
    return 0;
}

/* Makes bytes available in c->buf. Returns 0, or -1 with err set (timeout,
 * reset). End of stream sets c->eof and returns 0 with nothing buffered. */
static int conn_fill(struct conn *c, char *err, size_t errlen)
{
    if (c->pos < c->len || c->eof) return 0;
    for (;;) {
        ssize_t n = recv(c->fd, c->buf, sizeof c->buf, 0);
        if (n > 0) {
            c->pos = 0;
            c->len = (size_t)n;
            return 0;
        }
        if (n == 0) {
            c->eof = true;
            return 0;
        }
        if (errno == EINTR) continue;
        if (errno == EAGAIN || errno == EWOULDBLOCK)
            snprintf(err, errlen, "no reply from the server for %.0f s", c->timeout);
        else
            snprintf(err, errlen, "reading the reply: %s", strerror(errno));
        return -1;
    }
}

/* Reads one line (CRLF or LF, stripped) into line. -1 on error or EOF. */
static int conn_line(struct conn *c, char *line, size_t cap, char *err, size_t errlen)
{
    size_t n = 0;
    for (;;) {
        if (conn_fill(c, err, errlen)) return -1;
        if (c->eof) {
            snprintf(err, errlen, "the server closed the connection in the middle of the reply headers");
            return -1;
        }
        char ch = c->buf[c->pos++];
        if (ch == '\n') break;
        if (n + 1 < cap) line[n++] = ch;
    }
    if (n && line[n - 1] == '\r') n--;
    line[n] = 0;
    return 0;
}

/* Passes up to want bytes (SIZE_MAX: until EOF) to sink. Returns 0, 1 when
 * the sink stopped, -1 on error, -2 when the stream ended before want bytes,
 * -3 when the sink could not take them. */
static int conn_body(struct conn *c, size_t want, hc_sink sink, void *ctx, char *err, size_t errlen)
{
    while (want) {
        if (conn_fill(c, err, errlen)) return -1;
        if (c->eof) return want == SIZE_MAX ? 0 : -2;
        size_t n = c->len - c->pos;
        if (want != SIZE_MAX && n > want) n = want;
        int s = sink(ctx, c->buf + c->pos, n);
        c->pos += n;
        if (want != SIZE_MAX) want -= n;
        if (s < 0) {
            snprintf(err, errlen, "cannot write the reply body: %s", strerror(errno));
            return -3;
        }
        if (s) return 1;
    }
    return 0;
}

/* Sends the request head and body. Returns 0, or -1 with err set. */
static int send_request(struct conn *c, const struct hc_target *t, const char *method, const char *path,
                        const struct hc_body *body, char *err, size_t errlen)
{
    struct json_buf h;
    json_buf_init(&h);
    json_buf_addf(&h, "%s %s%s HTTP/1.1\r\nHost: %s:%s\r\nUser-Agent: %s\r\nAccept: */*\r\nConnection: close\r\n",
                  method, t->prefix, path, t->host, t->port, t->agent ? t->agent : "sluice");
    if (t->api_key) json_buf_addf(&h, "Authorization: Bearer %s\r\n", t->api_key);
    if (body) {
        long long len = (long long)body->n + (body->file ? body->file_size : 0) + (long long)body->tail_n;
        json_buf_addf(&h, "Content-Type: %s\r\nContent-Length: %lld\r\n",
                      body->ctype ? body->ctype : "application/json", len);
    } else if (!strcmp(method, "POST") || !strcmp(method, "PUT")) {
        json_buf_lit(&h, "Content-Length: 0\r\n");
    }
    json_buf_lit(&h, "\r\n");
    /* a small body goes in the same send as the head */
    bool inline_body = body && !body->file && !body->tail_n && body->n <= 65536;
    if (inline_body) json_buf_add(&h, body->p, body->n);
    if (h.oom) {
        json_buf_free(&h);
        snprintf(err, errlen, "out of memory");
        return -1;
    }
    int rc = send_all(c->fd, h.p, h.len);
    json_buf_free(&h);
    if (!rc && body && !inline_body) {
        rc = body->n ? send_all(c->fd, body->p, body->n) : 0;
        if (!rc && body->file) {
            char chunk[65536];
            size_t n;
            int64_t left = body->file_size;
            while (!rc && left > 0 && (n = fread(chunk, 1, left < (int64_t)sizeof chunk ? (size_t)left : sizeof chunk,
                                                 body->file)) > 0) {
                rc = send_all(c->fd, chunk, n);
                left -= (int64_t)n;
            }
            if (!rc && left > 0) {
                snprintf(err, errlen, "cannot read the file to send: %s",
                         ferror(body->file) ? strerror(errno) : "it shrank");
                return -1;
            }
        }
        if (!rc && body->tail_n) rc = send_all(c->fd, body->tail, body->tail_n);
    }
    if (rc) snprintf(err, errlen, "sending the request to %s:%s: %s", t->host, t->port, strerror(errno));
    return rc;
}

/* Reads the status line, the headers and the body into sink (see hc_request). */
static int read_reply(struct conn *c, const struct hc_target *t, const char *method, hc_sink sink, void *ctx,
                      int *status, char *err, size_t errlen)
{
    char line[8192];
    if (conn_line(c, line, sizeof line, err, errlen)) {
        if (c->eof)
            snprintf(err, errlen, "the server at %s:%s closed the connection without a reply", t->host, t->port);
        return -1;
    }
    int major, minor, st;
    if (sscanf(line, "HTTP/%d.%d %d", &major, &minor, &st) != 3) {
        snprintf(err, errlen, "not an HTTP reply from %s:%s: '%.60s'", t->host, t->port, line);
        return -1;
    }
    *status = st;
    bool chunked = false;
    long long clen = -1;
    for (;;) {
        if (conn_line(c, line, sizeof line, err, errlen)) return -1;
        if (!line[0]) break;
        if (!strncasecmp(line, "Transfer-Encoding:", 18) && strcasestr(line + 18, "chunked")) chunked = true;
        else if (!strncasecmp(line, "Content-Length:", 15)) clen = atoll(line + 15);
    }
    if (!strcmp(method, "HEAD") || st == 204 || st == 304) return 0;
    if (!chunked) {
        int b = conn_body(c, clen >= 0 ? (size_t)clen : SIZE_MAX, sink, ctx, err, errlen);
        return b == 1 ? 0 : b == -3 ? -1 : b;
    }
    for (;;) {
        if (conn_line(c, line, sizeof line, err, errlen)) return c->eof ? -2 : -1;
        char *end;
        unsigned long long sz = strtoull(line, &end, 16);
        if (end == line) {
            snprintf(err, errlen, "bad chunk size line '%.40s' in the reply", line);
            return -1;
        }
        if (sz == 0) return 0; /* trailers do not matter: the connection closes */
        int b = conn_body(c, (size_t)sz, sink, ctx, err, errlen);
        if (b == 1) return 0;
        if (b) return b == -3 ? -1 : b;
        if (conn_line(c, line, sizeof line, err, errlen)) return c->eof ? -2 : -1;
    }
}

int hc_request(const struct hc_target *t, const char *method, const char *path, const struct hc_body *body,
               hc_sink sink, void *ctx, int *status, char *err, size_t errlen)
{
    *status = 0;
    struct conn *c = malloc(sizeof *c);
    if (!c) {
        snprintf(err, errlen, "out of memory");
        return -1;
    }
    c->timeout = t->timeout;
    if (conn_open(c, t, err, errlen)) {
        free(c);
        return -1;
    }
    int rc;
    if (send_request(c, t, method, path, body, err, errlen)) {
        /* the server may have refused early (a 413): its answer says why */
        char e2[16];
        rc = read_reply(c, t, method, sink, ctx, status, e2, sizeof e2) == 0 && *status ? 0 : -1;
        if (rc) *status = 0;
    } else {
        rc = read_reply(c, t, method, sink, ctx, status, err, errlen);
        if (rc == -2) snprintf(err, errlen, "the server closed the connection before the end of the reply");
    }
    close(c->fd);
    free(c);
    return rc;
}

/* ---- JSON requests and uploads --------------------------------------------------------------- */

int hc_sink_buf(void *ctx, const char *p, size_t n)
{
    struct json_buf *b = ctx;
    if (b->len + n > MAX_COLLECT) return 1;
    json_buf_add(b, p, n);
    return 0;
}

int hc_json(const struct hc_target *t, const char *method, const char *path, const char *json, size_t len,
            struct json_buf *out, char *err, size_t errlen)
{
    json_buf_init(out);
    struct hc_body b = {.p = json, .n = len};
    int st = 0;
    int rc = hc_request(t, method, path, json ? &b : NULL, hc_sink_buf, out, &st, err, errlen);
    return rc ? -1 : st;
}

void hc_error_text(const char *body, size_t len, char *out, size_t cap)
{
    json_doc d;
    char e[64];
    if (len && !json_parse(&d, body, len, e, sizeof e)) {
        int er = json_is_obj(&d, 0) ? json_get(&d, 0, "error") : -1;
        int m = er >= 0 && json_is_obj(&d, er) ? json_get(&d, er, "message") : json_get(&d, 0, "message");
        if (m < 0 && er >= 0 && json_is_str(&d, er)) m = er;
        if (m >= 0 && json_is_str(&d, m)) {
            json_str(&d, m, out, cap);
            json_free(&d);
            return;
        }
        json_free(&d);
    }
    size_t n = len < cap - 1 ? len : cap - 1;
    for (size_t i = 0; i < n; i++) out[i] = body[i] == '\n' || body[i] == '\r' ? ' ' : body[i];
    out[n] = 0;
}

int hc_upload_batch_file(const struct hc_target *t, const char *filename, const char *mem, size_t n, FILE *file,
                         int64_t file_size, char *id, size_t idcap, char *err, size_t errlen)
{
    char boundary[64], head[1024], tail[96], ctype[128], fname[400];
    snprintf(boundary, sizeof boundary, "sluice-%08lx%08lx", (unsigned long)time(NULL), (unsigned long)getpid());
    size_t o = 0;
    for (const char *p = filename; *p && o + 1 < sizeof fname; p++) /* quotes and CR/LF cannot appear in the header */
        fname[o++] = (*p == '"' || *p == '\r' || *p == '\n' || *p == '\\') ? '_' : *p;
    fname[o] = '\0';
    int hn = snprintf(head, sizeof head,
                      "--%s\r\nContent-Disposition: form-data; name=\"purpose\"\r\n\r\nbatch\r\n"
                      "--%s\r\nContent-Disposition: form-data; name=\"file\"; filename=\"%s\"\r\n"
                      "Content-Type: application/jsonl\r\n\r\n",
                      boundary, boundary, fname);
    int tn = snprintf(tail, sizeof tail, "\r\n--%s--\r\n", boundary);
    snprintf(ctype, sizeof ctype, "multipart/form-data; boundary=%s", boundary);
    /* head, content, tail: the content is either in memory or the file */
    struct json_buf pre;
    json_buf_init(&pre);
    json_buf_add(&pre, head, (size_t)hn);
    if (!file) json_buf_add(&pre, mem, n);
    struct hc_body body = {.ctype = ctype, .p = pre.p, .n = pre.len, .file = file, .file_size = file_size,
                           .tail = tail, .tail_n = (size_t)tn};
    struct json_buf out;
    json_buf_init(&out);
    int st = 0, rc = -1;
    if (pre.oom) snprintf(err, errlen, "out of memory");
    else if (!hc_request(t, "POST", "/v1/files", &body, hc_sink_buf, &out, &st, err, errlen)) {
        json_doc d;
        char e[64];
        if (st >= 200 && st <= 299 && out.len && !json_parse(&d, out.p, out.len, e, sizeof e)) {
            int f = json_is_obj(&d, 0) ? json_get(&d, 0, "id") : -1;
            if (f >= 0 && json_is_str(&d, f) && json_str(&d, f, id, idcap) > 0) rc = 0;
            json_free(&d);
        }
        if (rc) {
            char msg[600];
            hc_error_text(out.p ? out.p : "", out.len, msg, sizeof msg);
            snprintf(err, errlen, "the server answered %d: %s", st, msg[0] ? msg : "(no message)");
        }
    }
    json_buf_free(&pre);
    json_buf_free(&out);
    return rc;
}

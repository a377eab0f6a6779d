/* cmd_batch.c - `sluice batch`: the command-line client of the Batch API of a
 * running server (sluice serve, or any OpenAI-compatible one).
 *
 *   sluice batch submit FILE.jsonl [--wait]   upload, create the batch, print its id;
 *                                             --wait: progress on stderr until it
 *                                             ends, then FILE.output.jsonl (and
 *                                             FILE.errors.jsonl) next to the input
 *   sluice batch status ID | list | cancel ID | results ID -o FILE
 *
 * HTTP/1.1 over a plain blocking socket, one request per connection
 * (Connection: close): the client sends one request at a time, so an event
 * loop would buy nothing. Uploads are streamed from the file (never read
 * whole into memory) and downloads streamed to the output file. Runs on the
 * main thread only.
 */
#include <errno.h>
#include <netdb.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <strings.h>
#include <sys/socket.h>
#include <sys/stat.h>
#include <sys/time.h>
#include <time.h>
#include <unistd.h>

#include "api.h"
#include "base/json.h"

#define IO_TIMEOUT_S 300

struct client {
    char host[256], port[8];
    char prefix[256];       /* path before /v1 ("" normally) */
    const char *url;        /* as given, for messages */
    const char *api_key;    /* NULL: none */
};

/* Where a response body goes: a memory buffer or a file. */
struct sink {
    struct json_buf *mem;
    FILE *f;
};

/* ---- URL and connection ------------------------------------------------------------------- */

static int parse_url(struct client *c, const char *url, char *err, size_t errlen)
{
    c->url = url;
    const char *p = url;
    if (!strncmp(p, "http://", 7)) p += 7;
    else if (strstr(p, "://")) {
        snprintf(err, errlen, "only http:// URLs are supported ('%s')", url);
        return -1;
    }
    size_t hl = strcspn(p, ":/");
    if (hl == 0 || hl >= sizeof c->host) {
        snprintf(err, errlen, "no host in URL '%s'", url);
        return -1;
    }
    memcpy(c->host, p, hl);
    c->host[hl] = '\0';
    p += hl;
    snprintf(c->port, sizeof c->port, "80");
    if (*p == ':') {
        size_t pl = strcspn(++p, "/");
        if (pl == 0 || pl >= sizeof c->port || strspn(p, "0123456789") < pl) {
            snprintf(err, errlen, "bad port in URL '%s'", url);
            return -1;
        }
        memcpy(c->port, p, pl);
        c->port[pl] = '\0';
        p += pl;
    }
    snprintf(c->prefix, sizeof c->prefix, "%s", p);
    size_t n = strlen(c->prefix);
    while (n && c->prefix[n - 1] == '/') c->prefix[--n] = '\0';
    if (n >= 3 && !strcmp(c->prefix + n - 3, "/v1")) c->prefix[n - 3] = '\0'; /* an OpenAI base_url */
    return 0;
}

static int dial(const struct client *c, char *err, size_t errlen)
{
    struct addrinfo hints = {.ai_family = AF_UNSPEC, .ai_socktype = SOCK_STREAM}, *ai, *a;
    int rc = getaddrinfo(c->host, c->port, &hints, &ai);
    if (rc) {
        snprintf(err, errlen, "cannot resolve %s: %s", c->host, gai_strerror(rc));
        return -1;
    }
    int fd = -1, e = 0;
    for (a = ai; a; a = a->ai_next) {
        fd = socket(a->ai_family, a->ai_socktype, a->ai_protocol);
        if (fd < 0) continue;
        if (!connect(fd, a->ai_addr, a->ai_addrlen)) break;
        e = errno;
        close(fd);
        fd = -1;
    }
    freeaddrinfo(ai);
    if (fd < 0) {
        snprintf(err, errlen, "cannot connect to %s: %s (is `sluice serve` running there?)", c->url,
                 strerror(e ? e : ECONNREFUSED));
        return -1;
    }
    struct timeval tv = {.tv_sec = IO_TIMEOUT_S};
    setsockopt(fd, SOL_SOCKET, SO_RCVTIMEO, &tv, sizeof tv);
    setsockopt(fd, SOL_SOCKET, SO_SNDTIMEO, &tv, sizeof tv);
    return fd;
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

/* ---- responses ---------------------------------------------------------------------------- */

struct reader {
    int fd;
    char buf[65536];
    size_t pos, len;
};

/* Next byte chunk: fills r->buf when empty. Returns bytes available, 0 at EOF, -1 on error. */
static ssize_t rd_fill(struct reader *r)
{
    if (r->pos < r->len) return (ssize_t)(r->len - r->pos);
    for (;;) {
        ssize_t n = recv(r->fd, r->buf, sizeof r->buf, 0);
        if (n < 0 && errno == EINTR) continue;
        if (n < 0) return -1;
        r->pos = 0;
        r->len = (size_t)n;
        return n;
    }
}

static int rd_line(struct reader *r, char *out, size_t cap)
{
    size_t o = 0;
    for (;;) {
        ssize_t n = rd_fill(r);
        if (n <= 0) return -1;
        char ch = r->buf[r->pos++];
        if (ch == '\n') break;
        if (o + 1 < cap) out[o++] = ch;
    }
    if (o && out[o - 1] == '\r') o--;
    out[o] = '\0';
    return 0;
}

static int sink_put(struct sink *s, const char *p, size_t n)
{
    if (s->mem) {
        json_buf_add(s->mem, p, n);
        return s->mem->oom ? -1 : 0;
    }
    return fwrite(p, 1, n, s->f) == n ? 0 : -1;
}

/* Copies exactly n bytes (n < 0: until EOF) of the body to the sink. */
static int rd_body(struct reader *r, long long n, struct sink *s)
{
    while (n != 0) {
        ssize_t a = rd_fill(r);
        if (a < 0) return -1;
        if (a == 0) return n < 0 ? 0 : -1;
        size_t take = (size_t)a;
        if (n > 0 && (long long)take > n) take = (size_t)n;
        if (sink_put(s, r->buf + r->pos, take)) return -2;
        r->pos += take;
        if (n > 0) n -= (long long)take;
    }
    return 0;
}

/* Reads the status line, headers and body. Returns the HTTP status, or -1
 * with a message. */
static int read_response(int fd, struct sink *s, const struct client *c, char *err, size_t errlen)
{
    struct reader *r = malloc(sizeof *r);
    if (!r) {
        snprintf(err, errlen, "out of memory");
        return -1;
    }
    r->fd = fd;
    r->pos = r->len = 0;
    char line[8192];
    int status = -1;
    if (rd_line(r, line, sizeof line) || sscanf(line, "HTTP/%*d.%*d %d", &status) != 1) {
        snprintf(err, errlen, "no HTTP response from %s (%s)", c->url,
                 errno == EAGAIN ? "timed out" : "connection closed");
        free(r);
        return -1;
    }
    long long clen = -1;
    bool chunked = false;
    for (;;) {
        if (rd_line(r, line, sizeof line)) {
            snprintf(err, errlen, "truncated response headers from %s", c->url);
            free(r);
            return -1;
        }
        if (!line[0]) break;
        if (!strncasecmp(line, "Content-Length:", 15)) clen = atoll(line + 15);
        else if (!strncasecmp(line, "Transfer-Encoding:", 18) && strcasestr(line + 18, "chunked")) chunked = true;
    }
    int rc = 0;
    if (chunked) {
        for (;;) {
            if (rd_line(r, line, sizeof line)) { rc = -1; break; }
            long long n = strtoll(line, NULL, 16);
            if (n <= 0) break;
            if ((rc = rd_body(r, n, s))) break;
            if (rd_line(r, line, sizeof line)) { rc = -1; break; }
        }
    } else {
        rc = rd_body(r, clen, s);
    }
    free(r);
    if (rc) {
        snprintf(err, errlen, rc == -2 ? "cannot write the response body: %s" : "truncated response from %s",
                 rc == -2 ? strerror(errno) : c->url);
        return -1;
    }
    return status;
}

/* ---- requests ------------------------------------------------------------------------------ */

static int send_head(int fd, const struct client *c, const char *method, const char *path, const char *ctype,
                     long long clen)
{
    char h[2048];
    int n = snprintf(h, sizeof h, "%s %s%s HTTP/1.1\r\nHost: %s:%s\r\nConnection: close\r\nAccept: */*\r\n"
                                  "User-Agent: sluice-batch\r\n",
                     method, c->prefix, path, c->host, c->port);
    if (c->api_key) n += snprintf(h + n, sizeof h - (size_t)n, "Authorization: Bearer %s\r\n", c->api_key);
    if (ctype) n += snprintf(h + n, sizeof h - (size_t)n, "Content-Type: %s\r\n", ctype);
    if (clen >= 0) n += snprintf(h + n, sizeof h - (size_t)n, "Content-Length: %lld\r\n", clen);
    n += snprintf(h + n, sizeof h - (size_t)n, "\r\n");
    if (n >= (int)sizeof h) return -1;
    return send_all(fd, h, (size_t)n);
}

/* One request with an optional JSON body; the response body goes to s.
 * Returns the HTTP status or -1 with a message. */
static int request(const struct client *c, const char *method, const char *path, const char *json,
                   struct sink *s, char *err, size_t errlen)
{
    int fd = dial(c, err, errlen);
    if (fd < 0) return -1;
    size_t n = json ? strlen(json) : 0;
    if (send_head(fd, c, method, path, json ? "application/json" : NULL, json ? (long long)n : 0) ||
        (json && send_all(fd, json, n))) {
        snprintf(err, errlen, "cannot send the request to %s: %s", c->url, strerror(errno));
        close(fd);
        return -1;
    }
    int st = read_response(fd, s, c, err, errlen);
    close(fd);
    return st;
}

/* The error message of an OpenAI-shaped error body, or the body itself. */
static void describe_error(int status, const struct json_buf *body, char *err, size_t errlen)
{
    json_doc d;
    char e[64], msg[600] = "";
    if (body->p && !json_parse(&d, body->p, body->len, e, sizeof e)) {
        int er = json_get(&d, 0, "error");
        int m = er >= 0 ? json_get(&d, er, "message") : -1;
        if (m >= 0) json_str(&d, m, msg, sizeof msg);
        json_free(&d);
    }
    if (!msg[0] && body->p) snprintf(msg, sizeof msg, "%.500s", body->p);
    snprintf(err, errlen, "the server answered %d: %s", status, msg[0] ? msg : "(no message)");
}

/* A JSON request whose 2xx response body is parsed into *d (body kept in
 * *buf, which the caller frees with d). Returns 0 or -1 with a message. */
static int call_json(const struct client *c, const char *method, const char *path, const char *json,
                     struct json_buf *buf, json_doc *d, char *err, size_t errlen)
{
    json_buf_init(buf);
    struct sink s = {.mem = buf};
    int st = request(c, method, path, json, &s, err, errlen);
    if (st < 0) goto fail;
    if (st < 200 || st > 299) {
        describe_error(st, buf, err, errlen);
        goto fail;
    }
    char e[128];
    if (!buf->p || json_parse(d, buf->p, buf->len, e, sizeof e) || !json_is_obj(d, 0)) {
        snprintf(err, errlen, "the server's answer is not a JSON object");
        goto fail;
    }
    return 0;
fail:
    json_buf_free(buf);
    return -1;
}

/* Uploads path with purpose=batch as multipart/form-data, streaming the file.
 * Writes the new file id into id_out. */
static int upload(const struct client *c, const char *path, char *id_out, size_t idcap, char *err, size_t errlen)
{
    FILE *f = fopen(path, "rb");
    if (!f) {
        snprintf(err, errlen, "cannot open %s: %s", path, strerror(errno));
        return -1;
    }
    struct stat sb;
    if (fstat(fileno(f), &sb) || !S_ISREG(sb.st_mode)) {
        snprintf(err, errlen, "%s is not a regular file", path);
        fclose(f);
        return -1;
    }
    const char *base = strrchr(path, '/');
    base = base ? base + 1 : path;
    char boundary[64], head[1024], tail[96];
    snprintf(boundary, sizeof boundary, "sluice-%08lx%08lx", (unsigned long)time(NULL), (unsigned long)getpid());
    char fname[400];
    size_t o = 0;
    for (const char *p = base; *p && o + 1 < sizeof fname; p++) /* quotes and CR/LF cannot appear in the header */
        fname[o++] = (*p == '"' || *p == '\r' || *p == '\n' || *p == '\\') ? '_' : *p;
    fname[o] = '\0';
    int hn = snprintf(head, sizeof head,
                      "--%s\r\nContent-Disposition: form-data; name=\"purpose\"\r\n\r\nbatch\r\n"
                      "--%s\r\nContent-Disposition: form-data; name=\"file\"; filename=\"%s\"\r\n"
                      "Content-Type: application/jsonl\r\n\r\n",
                      boundary, boundary, fname);
    int tn = snprintf(tail, sizeof tail, "\r\n--%s--\r\n", boundary);
    char ctype[128];
    snprintf(ctype, sizeof ctype, "multipart/form-data; boundary=%s", boundary);
    int fd = dial(c, err, errlen);
    if (fd < 0) {
        fclose(f);
        return -1;
    }
    int rc = -1;
    struct json_buf buf;
    json_buf_init(&buf);
    if (send_head(fd, c, "POST", "/v1/files", ctype, (long long)hn + sb.st_size + tn) ||
        send_all(fd, head, (size_t)hn))
        goto send_fail;
    char chunk[65536];
    size_t n;
    while ((n = fread(chunk, 1, sizeof chunk, f)) > 0)
        if (send_all(fd, chunk, n)) goto send_fail;
    if (ferror(f)) {
        snprintf(err, errlen, "cannot read %s: %s", path, strerror(errno));
        goto out;
    }
    if (send_all(fd, tail, (size_t)tn)) goto send_fail;
    struct sink s = {.mem = &buf};
    int st = read_response(fd, &s, c, err, errlen);
    if (st < 0) goto out;
    if (st < 200 || st > 299) {
        describe_error(st, &buf, err, errlen);
        goto out;
    }
    json_doc d;
    char e[128];
    if (!buf.p || json_parse(&d, buf.p, buf.len, e, sizeof e)) {
        snprintf(err, errlen, "the server's answer to the upload is not JSON");
        goto out;
    }
    int id = json_get(&d, 0, "id");
    if (id >= 0 && json_str(&d, id, id_out, idcap) > 0) rc = 0;
    else snprintf(err, errlen, "the server's answer to the upload has no file id");
    json_free(&d);
    goto out;
send_fail:
    /* the server may have refused early (413): its answer says why */
    if (read_response(fd, &(struct sink){.mem = &buf}, c, err, errlen) > 299) describe_error(413, &buf, err, errlen);
    else snprintf(err, errlen, "cannot send %s to %s: %s", path, c->url, strerror(errno));
out:
    json_buf_free(&buf);
    close(fd);
    fclose(f);
    return rc;
}

/* Downloads a file's content to out_path (written to a temp name, then renamed). */
static int download(const struct client *c, const char *file_id, const char *out_path, char *err, size_t errlen)
{
    char tmp[4200], path[160];
    snprintf(tmp, sizeof tmp, "%s.part", out_path);
    snprintf(path, sizeof path, "/v1/files/%s/content", file_id);
    FILE *f = fopen(tmp, "wb");
    if (!f) {
        snprintf(err, errlen, "cannot write %.512s: %s", tmp, strerror(errno));
        return -1;
    }
    struct sink s = {.f = f};
    int fd = dial(c, err, errlen);
    int st = -1;
    if (fd >= 0) {
        if (send_head(fd, c, "GET", path, NULL, -1)) snprintf(err, errlen, "cannot send the request: %s", strerror(errno));
        else st = read_response(fd, &s, c, err, errlen);
        close(fd);
    }
    bool bad = fclose(f) != 0 || st < 0;
    if (!bad && (st < 200 || st > 299)) {
        /* the body (an error object) went to the file: read it back for the message */
        struct json_buf b;
        json_buf_init(&b);
        FILE *g = fopen(tmp, "rb");
        char chunk[2048];
        size_t n = g ? fread(chunk, 1, sizeof chunk, g) : 0;
        if (g) fclose(g);
        json_buf_add(&b, chunk, n);
        describe_error(st, &b, err, errlen);
        json_buf_free(&b);
        bad = true;
    }
    if (bad || rename(tmp, out_path)) {
        if (!bad) snprintf(err, errlen, "cannot write %.512s: %s", out_path, strerror(errno));
        unlink(tmp);
        return -1;
    }
    return 0;
}

/* ---- batch objects --------------------------------------------------------------------------- */

struct batch_view {
    char id[128], status[32], output_file_id[128], error_file_id[128];
    long long total, completed, failed, created_at;
    char first_error[300];
};

static void str_field(const json_doc *d, int obj, const char *key, char *out, size_t cap)
{
    int i = json_get(d, obj, key);
    out[0] = '\0';
    if (i >= 0 && json_is_str(d, i)) json_str(d, i, out, cap);
}

static long long int_field(const json_doc *d, int obj, const char *key)
{
    int i = json_get(d, obj, key);
    int64_t v = 0;
    if (i >= 0) json_i64(d, i, &v);
    return (long long)v;
}

static void view_batch(const json_doc *d, int obj, struct batch_view *v)
{
    memset(v, 0, sizeof *v);
    str_field(d, obj, "id", v->id, sizeof v->id);
    str_field(d, obj, "status", v->status, sizeof v->status);
    str_field(d, obj, "output_file_id", v->output_file_id, sizeof v->output_file_id);
    str_field(d, obj, "error_file_id", v->error_file_id, sizeof v->error_file_id);
    v->created_at = int_field(d, obj, "created_at");
    int rc = json_get(d, obj, "request_counts");
    if (rc >= 0 && json_is_obj(d, rc)) {
        v->total = int_field(d, rc, "total");
        v->completed = int_field(d, rc, "completed");
        v->failed = int_field(d, rc, "failed");
    }
    int er = json_get(d, obj, "errors");
    int data = er >= 0 && json_is_obj(d, er) ? json_get(d, er, "data") : -1;
    int first = data >= 0 && json_is_arr(d, data) && json_size(d, data) > 0 ? json_at(d, data, 0) : -1;
    if (first >= 0) {
        char msg[240] = "";
        str_field(d, first, "message", msg, sizeof msg);
        snprintf(v->first_error, sizeof v->first_error, "line %lld: %s", int_field(d, first, "line"), msg);
    }
}

static int get_batch(const struct client *c, const char *id, struct batch_view *v, char *err, size_t errlen)
{
    char path[200];
    snprintf(path, sizeof path, "/v1/batches/%s", id);
    struct json_buf buf;
    json_doc d;
    if (call_json(c, "GET", path, NULL, &buf, &d, err, errlen)) return -1;
    view_batch(&d, 0, v);
    json_free(&d);
    json_buf_free(&buf);
    return 0;
}

static bool terminal(const char *st)
{
    return !strcmp(st, "completed") || !strcmp(st, "failed") || !strcmp(st, "expired") || !strcmp(st, "cancelled");
}

static void print_batch(const struct batch_view *v)
{
    printf("%s  %s  %lld/%lld completed, %lld failed", v->id, v->status, v->completed, v->total, v->failed);
    if (v->output_file_id[0]) printf("  output %s", v->output_file_id);
    if (v->error_file_id[0]) printf("  errors %s", v->error_file_id);
    printf("\n");
    if (v->first_error[0]) printf("  first error: %s\n", v->first_error);
}

static void fmt_secs(double s, char *out, size_t cap)
{
    long t = (long)(s + 0.5);
    if (t >= 3600) snprintf(out, cap, "%ldh%02ldm", t / 3600, t / 60 % 60);
    else if (t >= 60) snprintf(out, cap, "%ldm%02lds", t / 60, t % 60);
    else snprintf(out, cap, "%lds", t);
}

static double now_s(void)
{
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return (double)ts.tv_sec + ts.tv_nsec * 1e-9;
}

/* Polls until the batch ends, drawing a progress bar on stderr. Without a
 * terminal (a log file, CI) a line is written only when the status changes,
 * or the progress did at most every 30 s, not one per poll. */
static int wait_batch(const struct client *c, const char *id, double interval, struct batch_view *v, char *err,
                      size_t errlen)
{
    double t0 = now_s(), t_line = -1;
    long long done0 = -1, done_line = -1;
    char status_line[32] = "";
    bool tty = isatty(2);
    for (;;) {
        if (get_batch(c, id, v, err, errlen)) return -1;
        long long done = v->completed + v->failed;
        if (done0 < 0) done0 = done;
        double el = now_s() - t0;
        char eta[32] = "?", elapsed[32];
        fmt_secs(el, elapsed, sizeof elapsed);
        if (done > done0 && el > 0 && v->total > done) fmt_secs((double)(v->total - done) * el / (double)(done - done0), eta, sizeof eta);
        else if (v->total && v->total == done) snprintf(eta, sizeof eta, "0s");
        int width = 30, fill = v->total ? (int)(width * done / v->total) : 0;
        char bar[64];
        for (int i = 0; i < width; i++) bar[i] = i < fill ? '#' : '.';
        bar[width] = '\0';
        bool changed = strcmp(status_line, v->status) != 0 || terminal(v->status);
        if (!tty && !changed && (done == done_line || now_s() - t_line < 30.0)) {
            usleep((useconds_t)(interval * 1e6));
            continue;
        }
        snprintf(status_line, sizeof status_line, "%s", v->status);
        t_line = now_s(), done_line = done;
        fprintf(stderr, "%s[batch] %-11s [%s] %lld/%lld done (%lld failed)  %s elapsed, ETA %s   %s", tty ? "\r" : "",
                v->status, bar, done, v->total, v->failed, elapsed, eta, tty ? "" : "\n");
        if (terminal(v->status)) {
            if (tty) fputc('\n', stderr);
            return 0;
        }
        usleep((useconds_t)(interval * 1e6));
    }
}

/* FILE.jsonl -> FILE.output.jsonl (kind "output") / FILE.errors.jsonl */
static void sibling(const char *in, const char *kind, char *out, size_t cap)
{
    size_t n = strlen(in);
    if (n > 6 && !strcmp(in + n - 6, ".jsonl")) n -= 6;
    snprintf(out, cap, "%.*s.%s.jsonl", (int)n, in, kind);
}

/* The endpoint of a batch file: the url of its first request line. */
static void guess_endpoint(const char *path, char *out, size_t cap)
{
    snprintf(out, cap, "/v1/chat/completions");
    FILE *f = fopen(path, "rb");
    if (!f) return;
    char *line = NULL;
    size_t lcap = 0;
    ssize_t n;
    while ((n = getline(&line, &lcap, f)) >= 0) {
        json_doc d;
        char e[64];
        if (strspn(line, " \t\r\n") == (size_t)n) continue;
        if (!json_parse(&d, line, (size_t)n, e, sizeof e)) {
            int u = json_is_obj(&d, 0) ? json_get(&d, 0, "url") : -1;
            if (u >= 0 && (json_str_eq(&d, u, "/v1/completions") || json_str_eq(&d, u, "/v1/chat/completions") ||
                           json_str_eq(&d, u, "/v1/responses")))
                json_str(&d, u, out, cap);
            json_free(&d);
        }
        break;
    }
    free(line);
    fclose(f);
}

/* ---- subcommands ------------------------------------------------------------------------------ */

static int cmd_submit(const struct client *c, const char *file, bool wait, const char *endpoint, const char *window,
                      double interval)
{
    char err[1024], file_id[128], ep[64];
    if (upload(c, file, file_id, sizeof file_id, err, sizeof err)) goto fail;
    if (!endpoint) {
        guess_endpoint(file, ep, sizeof ep);
        endpoint = ep;
    }
    struct json_buf req;
    json_buf_init(&req);
    json_buf_lit(&req, "{\"input_file_id\":");
    json_buf_add_str(&req, file_id, strlen(file_id));
    json_buf_lit(&req, ",\"endpoint\":");
    json_buf_add_str(&req, endpoint, strlen(endpoint));
    json_buf_lit(&req, ",\"completion_window\":");
    json_buf_add_str(&req, window, strlen(window));
    json_buf_lit(&req, "}");
    struct json_buf buf;
    json_doc d;
    int rc = req.oom ? -1 : call_json(c, "POST", "/v1/batches", req.p, &buf, &d, err, sizeof err);
    json_buf_free(&req);
    if (rc) goto fail;
    struct batch_view v;
    view_batch(&d, 0, &v);
    json_free(&d);
    json_buf_free(&buf);
    printf("%s\n", v.id);
    fflush(stdout);
    fprintf(stderr, "[batch] %s created from %s (%s, %lld requests, status %s)\n", v.id, file, file_id, v.total,
            v.status);
    if (!wait) return 0;
    if (wait_batch(c, v.id, interval, &v, err, sizeof err)) goto fail;
    char out[4200];
    if (v.output_file_id[0]) {
        sibling(file, "output", out, sizeof out);
        if (download(c, v.output_file_id, out, err, sizeof err)) goto fail;
        fprintf(stderr, "[batch] output: %s\n", out);
    }
    if (v.error_file_id[0]) {
        sibling(file, "errors", out, sizeof out);
        if (download(c, v.error_file_id, out, err, sizeof err)) goto fail;
        fprintf(stderr, "[batch] errors: %s\n", out);
    }
    if (v.first_error[0]) fprintf(stderr, "[batch] %s: %s\n", v.status, v.first_error);
    fprintf(stderr, "[batch] %s %s: %lld completed, %lld failed of %lld\n", v.id, v.status, v.completed, v.failed,
            v.total);
    /* a batch that completed without one successful request did not do its job */
    return strcmp(v.status, "completed") || (v.total > 0 && v.completed == 0) ? 1 : 0;
fail:
    fprintf(stderr, "sluice batch submit: %s\n", err);
    return 1;
}

static int cmd_status(const struct client *c, const char *id, bool raw)
{
    char err[1024], path[200];
    if (raw) {
        snprintf(path, sizeof path, "/v1/batches/%s", id);
        struct json_buf buf;
        json_doc d;
        if (call_json(c, "GET", path, NULL, &buf, &d, err, sizeof err)) goto fail;
        printf("%s\n", buf.p);
        json_free(&d);
        json_buf_free(&buf);
        return 0;
    }
    struct batch_view v;
    if (get_batch(c, id, &v, err, sizeof err)) goto fail;
    print_batch(&v);
    return 0;
fail:
    fprintf(stderr, "sluice batch status: %s\n", err);
    return 1;
}

static int cmd_list(const struct client *c, long limit, const char *after, bool all)
{
    char err[1024], path[400], cursor[128] = "";
    if (after) snprintf(cursor, sizeof cursor, "%s", after);
    for (;;) {
        int n = snprintf(path, sizeof path, "/v1/batches?limit=%ld", limit);
        if (cursor[0]) snprintf(path + n, sizeof path - (size_t)n, "&after=%s", cursor);
        struct json_buf buf;
        json_doc d;
        if (call_json(c, "GET", path, NULL, &buf, &d, err, sizeof err)) {
            fprintf(stderr, "sluice batch list: %s\n", err);
            return 1;
        }
        int data = json_get(&d, 0, "data");
        for (int k = 0, i = data + 1; data >= 0 && k < json_size(&d, data); k++, i = json_skip(&d, i)) {
            struct batch_view v;
            view_batch(&d, i, &v);
            char when[32] = "";
            time_t t = (time_t)v.created_at;
            struct tm tm;
            if (localtime_r(&t, &tm)) strftime(when, sizeof when, "%Y-%m-%d %H:%M:%S", &tm);
            printf("%s  %-11s %lld/%lld completed, %lld failed  created %s\n", v.id, v.status, v.completed, v.total,
                   v.failed, when);
        }
        int hm = json_get(&d, 0, "has_more");
        bool more = false;
        if (hm >= 0) json_bool(&d, hm, &more);
        str_field(&d, 0, "last_id", cursor, sizeof cursor);
        json_free(&d);
        json_buf_free(&buf);
        if (!all || !more || !cursor[0]) {
            if (more && !all) fprintf(stderr, "(more: --after %s, or --all)\n", cursor);
            return 0;
        }
    }
}

static int cmd_cancel(const struct client *c, const char *id)
{
    char err[1024], path[200];
    snprintf(path, sizeof path, "/v1/batches/%s/cancel", id);
    struct json_buf buf;
    json_doc d;
    if (call_json(c, "POST", path, "{}", &buf, &d, err, sizeof err)) {
        fprintf(stderr, "sluice batch cancel: %s\n", err);
        return 1;
    }
    struct batch_view v;
    view_batch(&d, 0, &v);
    json_free(&d);
    json_buf_free(&buf);
    print_batch(&v);
    return 0;
}

static int cmd_results(const struct client *c, const char *id, const char *out, const char *errors_out)
{
    char err[1024];
    struct batch_view v;
    if (get_batch(c, id, &v, err, sizeof err)) goto fail;
    if (!v.output_file_id[0] && !v.error_file_id[0]) {
        snprintf(err, sizeof err, "batch %s has no output yet (status %s, %lld/%lld done)", id, v.status,
                 v.completed + v.failed, v.total);
        goto fail;
    }
    if (v.output_file_id[0]) {
        if (download(c, v.output_file_id, out, err, sizeof err)) goto fail;
        fprintf(stderr, "[batch] %s: %lld results in %s\n", id, v.completed, out);
    } else {
        fprintf(stderr, "[batch] %s has no successful results (status %s)\n", id, v.status);
    }
    if (v.error_file_id[0]) {
        char def[4200];
        if (!errors_out) {
            sibling(out, "errors", def, sizeof def);
            errors_out = def;
        }
        if (download(c, v.error_file_id, errors_out, err, sizeof err)) goto fail;
        fprintf(stderr, "[batch] %s: %lld failed requests in %s\n", id, v.failed, errors_out);
    }
    return 0;
fail:
    fprintf(stderr, "sluice batch results: %s\n", err);
    return 1;
}

static const char USAGE[] =
    "usage: sluice batch COMMAND [flags]\n"
    "  submit FILE.jsonl [--wait]  upload FILE, create a batch, print its id; --wait shows progress,\n"
    "                              then writes FILE.output.jsonl (and FILE.errors.jsonl); exits 1\n"
    "                              unless the batch completed with at least one request done\n"
    "  status ID [--json]          a batch's status and request counts\n"
    "  list [--limit N] [--after ID] [--all]\n"
    "  cancel ID\n"
    "  results ID -o FILE          download the output (and errors next to it)\n\n";

int api_cmd_batch(int argc, char **argv)
{
    const char *url = "http://127.0.0.1:8000", *key = NULL, *out = NULL, *errors_out = NULL, *endpoint = NULL,
               *window = "24h", *after = NULL;
    bool wait = false, raw = false, all = false;
    long limit = 20;
    double interval = 1.0;
    const struct api_flag flags[] = {
        {"--url", API_FLAG_STR, &url, "server base URL (http://127.0.0.1:8000)", NULL},
        {"--api-key", API_FLAG_STR, &key, "API key (default: $SLUICE_API_KEY or $OPENAI_API_KEY)", NULL},
        {"--wait", API_FLAG_BOOL, &wait, "submit: wait for the end, then download the results", NULL},
        {"--endpoint", API_FLAG_STR, &endpoint, "submit: batch endpoint (default: the first line's url)", NULL},
        {"--completion-window", API_FLAG_STR, &window, "submit: completion window (24h)", NULL},
        {"--poll-interval", API_FLAG_FLOAT, &interval, "submit --wait: seconds between polls (1)", NULL},
        {"--output", API_FLAG_STR, &out, "results: output file (-o)", NULL},
        {"--errors", API_FLAG_STR, &errors_out, "results: error file (default: OUTPUT.errors.jsonl)", NULL},
        {"--json", API_FLAG_BOOL, &raw, "status: print the batch object as JSON", NULL},
        {"--limit", API_FLAG_INT, &limit, "list: batches per page (20)", NULL},
        {"--after", API_FLAG_STR, &after, "list: start after this batch id", NULL},
        {"--all", API_FLAG_BOOL, &all, "list: every page", NULL},
        {0},
    };
    if (argc < 3 || argv[2][0] == '-') {
        fputs(USAGE, stderr);
        api_print_flags(flags);
        return argc < 3 ? 2 : (!strcmp(argv[2], "--help") || !strcmp(argv[2], "-h") ? 0 : 2);
    }
    const char *cmd = argv[2];
    char **av = malloc(sizeof *av * (size_t)(argc + 1));
    if (!av) return 1;
    for (int i = 0; i < argc; i++) av[i] = !strcmp(argv[i], "-o") ? "--output" : argv[i];
    av[argc] = NULL;
    char err[512];
    const char *pos[2];
    int flags_rc;
    int np = api_cmd_flags("batch", USAGE, argc, av, 3, flags, pos, 2, &flags_rc);
    free(av);
    if (np < 0) return flags_rc;
    if (!key) key = getenv("SLUICE_API_KEY");
    if (!key) key = getenv("OPENAI_API_KEY");
    struct client c = {.api_key = key && *key ? key : NULL};
    if (parse_url(&c, url, err, sizeof err)) {
        fprintf(stderr, "sluice batch: %s\n", err);
        return 2;
    }
    bool needs_id = !strcmp(cmd, "status") || !strcmp(cmd, "cancel") || !strcmp(cmd, "results");
    if (!strcmp(cmd, "submit")) {
        if (np != 1 || interval <= 0) {
            fprintf(stderr, "sluice batch submit: needs one FILE.jsonl (and --poll-interval > 0)\n");
            return 2;
        }
        return cmd_submit(&c, pos[0], wait, endpoint, window, interval);
    }
    if (needs_id && np != 1) {
        fprintf(stderr, "sluice batch %s: needs one batch id\n", cmd);
        return 2;
    }
    if (needs_id && (strlen(pos[0]) > 100 || strpbrk(pos[0], "/?&# %"))) {
        fprintf(stderr, "sluice batch %s: '%s' is not a batch id\n", cmd, pos[0]);
        return 2;
    }
    if (!strcmp(cmd, "status")) return cmd_status(&c, pos[0], raw);
    if (!strcmp(cmd, "cancel")) return cmd_cancel(&c, pos[0]);
    if (!strcmp(cmd, "results")) {
        if (!out) {
            fprintf(stderr, "sluice batch results: -o FILE is required\n");
            return 2;
        }
        return cmd_results(&c, pos[0], out, errors_out);
    }
    if (!strcmp(cmd, "list")) {
        if (np || limit < 1 || limit > 100 || (after && strpbrk(after, "/?&# %"))) {
            fprintf(stderr, "sluice batch list: takes no arguments; --limit 1..100\n");
            return 2;
        }
        return cmd_list(&c, limit, after, all);
    }
    fprintf(stderr, "sluice batch: unknown command '%s' (submit, status, list, cancel, results)\n", cmd);
    return 2;
}

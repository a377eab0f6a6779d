/* bench_request.c - what `sluice bench` sends: the streamed chat request
 * (timed on the client: TTFT at the first chunk with content, total at
 * [DONE], token counts from the server's usage) and the corpus cut into
 * prompts sized to a token count (by the server's /tokenize, else by the
 * usage of two warm-up requests). See cmd_bench.c.
 */
#include <dirent.h>
#include <errno.h>
#include <fcntl.h>
#include <math.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>
#include <sys/time.h>
#include <time.h>
#include <unistd.h>

#include "api/bench.h"

double bench_now(void)
{
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return (double)ts.tv_sec + ts.tv_nsec * 1e-9;
}

/* POST/GET with a JSON reply collected into out (caller frees). Returns the
 * HTTP status, or -1 on a connection error (err set). */
int bench_http_json(const struct hc_target *t, const char *method, const char *path, const struct json_buf *body,
                    struct json_buf *out, char *err, size_t errlen)
{
    return hc_json(t, method, path, body ? body->p : NULL, body ? body->len : 0, out, err, errlen);
}

/* ---- the streamed chat request ---- */

struct stream_ctx {
    struct run_result *r;
    double t0, last;
    struct json_buf line;
    bool done, got_usage;
    char error[512];
    int status;             /* set by hc_request before the body arrives */
    struct json_buf body;   /* a non-2xx reply's body */
};

static void add_itl(struct run_result *r, double gap)
{
    if (r->n_itl == r->cap_itl) {
        int nc = r->cap_itl ? 2 * r->cap_itl : 64;
        double *p = realloc(r->itl, sizeof *p * (size_t)nc);
        if (!p) return;
        r->itl = p;
        r->cap_itl = nc;
    }
    r->itl[r->n_itl++] = gap;
}

static bool nonempty_str(const json_doc *d, int obj, const char *key)
{
    int v = json_get(d, obj, key);
    size_t n = 0;
    return v >= 0 && json_is_str(d, v) && json_raw(d, v, &n) && n > 0;
}

static int int_field(const json_doc *d, int obj, const char *key)
{
    int v = obj >= 0 ? json_get(d, obj, key) : -1;
    int64_t x;
    return v >= 0 && !json_i64(d, v, &x) ? (int)x : -1;
}

static void sse_event(struct stream_ctx *s, const char *p, size_t n)
{
    double t = bench_now();
    if (n == 6 && !memcmp(p, "[DONE]", 6)) {
        s->done = true;
        s->r->total = t - s->t0;
        return;
    }
    json_doc d;
    char e[128];
    if (json_parse(&d, p, n, e, sizeof e)) {
        if (!s->error[0]) snprintf(s->error, sizeof s->error, "a stream chunk is not JSON (%s): '%.60s'", e, p);
        return;
    }
    if (!json_is_obj(&d, 0)) goto out;
    int er = json_get(&d, 0, "error");
    if (er >= 0 && !json_is_null(&d, er)) {
        char msg[400];
        hc_error_text(p, n, msg, sizeof msg);
        if (!s->error[0]) snprintf(s->error, sizeof s->error, "the server sent an error in the stream: %s", msg);
        goto out;
    }
    int ch = json_get(&d, 0, "choices");
    int c0 = ch >= 0 && json_is_arr(&d, ch) && json_size(&d, ch) > 0 ? json_at(&d, ch, 0) : -1;
    if (c0 >= 0 && json_is_obj(&d, c0)) {
        int delta = json_get(&d, c0, "delta");
        bool content = delta >= 0 && json_is_obj(&d, delta)
                     ? nonempty_str(&d, delta, "content") || nonempty_str(&d, delta, "reasoning_content") ||
                       nonempty_str(&d, delta, "reasoning")
                     : nonempty_str(&d, c0, "text");
        if (content) {
            if (!s->r->n_chunks) s->r->ttft = t - s->t0;
            else add_itl(s->r, t - s->last);
            s->last = t;
            s->r->n_chunks++;
        }
    }
    int u = json_get(&d, 0, "usage");
    if (u >= 0 && json_is_obj(&d, u)) {
        s->got_usage = true;
        s->r->p_tok = int_field(&d, u, "prompt_tokens");
        s->r->c_tok = int_field(&d, u, "completion_tokens");
        int det = json_get(&d, u, "prompt_tokens_details");
        s->r->cached = det >= 0 && json_is_obj(&d, det) ? int_field(&d, det, "cached_tokens") : -1;
    }
out:
    json_free(&d);
}

static int stream_sink(void *ctx, const char *p, size_t n)
{
    struct stream_ctx *s = ctx;
    if (s->status < 200 || s->status > 299) return hc_sink_buf(&s->body, p, n);
    for (size_t i = 0; i < n; i++) {
        const char *nl = memchr(p + i, '\n', n - i);
        if (!nl) {
            json_buf_add(&s->line, p + i, n - i);
            break;
        }
        json_buf_add(&s->line, p + i, (size_t)(nl - (p + i)));
        i = (size_t)(nl - p);
        char *l = s->line.p ? s->line.p : "";
        size_t len = s->line.len;
        if (len && l[len - 1] == '\r') len--;
        if (len >= 5 && !memcmp(l, "data:", 5)) {
            size_t off = l[5] == ' ' ? 6 : 5;
            if (len > off) sse_event(s, l + off, len - off);
        }
        s->line.len = 0;
        if (s->line.p) s->line.p[0] = 0;
        if (s->done) return 1;
    }
    return 0;
}

/* Sends one streamed chat request with user content prompt. Fills r (the
 * caller frees r->itl). Returns 0, or -1 with a message in err: no
 * connection, a non-2xx status, an error in the stream, a stream that ends
 * before [DONE], or no usage. Thread-safe. */
int bench_chat_stream(const struct bench_opts *o, const char *model, const char *prompt, long max_tokens,
                      struct run_result *r, char *err, size_t errlen)
{
    memset(r, 0, sizeof *r);
    r->p_tok = r->c_tok = r->cached = -1;
    struct json_buf b;
    json_buf_init(&b);
    json_buf_lit(&b, "{\"model\":");
    json_buf_add_str(&b, model, strlen(model));
    json_buf_lit(&b, ",\"messages\":[{\"role\":\"user\",\"content\":");
    json_buf_add_str(&b, prompt, strlen(prompt));
    json_buf_addf(&b, "}],\"max_tokens\":%ld,\"temperature\":0,\"stream\":true,"
                  "\"stream_options\":{\"include_usage\":true}%s}", max_tokens, o->ignore_eos ? ",\"ignore_eos\":true" : "");
    if (b.oom) {
        json_buf_free(&b);
        snprintf(err, errlen, "out of memory");
        return -1;
    }
    struct stream_ctx s = {.r = r};
    json_buf_init(&s.line);
    json_buf_init(&s.body);
    s.t0 = bench_now();
    char herr[256] = "";
    struct hc_body body = {.p = b.p, .n = b.len};
    int rc = hc_request(&o->t, "POST", "/v1/chat/completions", &body, stream_sink, &s, &s.status, herr, sizeof herr);
    json_buf_free(&b);
    int ret = -1;
    if (rc == -1 && !s.status) {
        snprintf(err, errlen, "%s", herr);
    } else if (s.status < 200 || s.status > 299) {
        char msg[400];
        hc_error_text(s.body.p ? s.body.p : "", s.body.len, msg, sizeof msg);
        snprintf(err, errlen, "the server replied HTTP %d to /v1/chat/completions%s%s", s.status, msg[0] ? ": " : "",
                 msg);
    } else if (s.error[0]) {
        snprintf(err, errlen, "%s", s.error);
    } else if (!s.done) {
        snprintf(err, errlen, "the stream ended early: no [DONE] after %d content chunks (%s)", r->n_chunks,
                 rc ? herr : "the reply ended without it");
    } else if (!s.got_usage || r->p_tok < 0 || r->c_tok < 0) {
        snprintf(err, errlen, "the stream carried no usage (does the server honor stream_options.include_usage?)");
    } else {
        if (!r->n_chunks) r->ttft = r->total;
        ret = 0;
    }
    json_buf_free(&s.line);
    json_buf_free(&s.body);
    if (ret) {
        free(r->itl);
        r->itl = NULL;
    }
    return ret;
}

/* ---- the corpus and prompt sizing ---- */

static int read_file(const char *path, struct json_buf *out, char *err, size_t errlen)
{
    FILE *f = fopen(path, "rb");
    if (!f) {
        snprintf(err, errlen, "cannot open %.300s: %s", path, strerror(errno));
        return -1;
    }
    char buf[65536];
    size_t n;
    while ((n = fread(buf, 1, sizeof buf, f)) > 0) json_buf_add(out, buf, n);
    int bad = ferror(f);
    fclose(f);
    if (bad || out->oom) {
        snprintf(err, errlen, "cannot read %.300s", path);
        return -1;
    }
    return 0;
}

static int txt_filter(const struct dirent *e)
{
    size_t n = strlen(e->d_name);
    return e->d_name[0] != '.' && n > 4 && !strcmp(e->d_name + n - 4, ".txt");
}

/* Loads path (a file, or every *.txt of a folder in name order) into sz->text. */
int bench_load_corpus(struct sizer *sz, const char *path, char *err, size_t errlen)
{
    struct json_buf b;
    json_buf_init(&b);
    struct stat st;
    if (stat(path, &st)) {
        snprintf(err, errlen, "corpus %.300s: %s", path, strerror(errno));
        return -1;
    }
    if (S_ISDIR(st.st_mode)) {
        struct dirent **list;
        int n = scandir(path, &list, txt_filter, alphasort);
        if (n < 0) {
            snprintf(err, errlen, "corpus %.300s: %s", path, strerror(errno));
            return -1;
        }
        int rc = 0;
        for (int i = 0; i < n; i++) {
            char fp[8192];
            snprintf(fp, sizeof fp, "%.4000s/%.255s", path, list[i]->d_name);
            if (!rc && b.len) json_buf_lit(&b, "\n\n");
            if (!rc) rc = read_file(fp, &b, err, errlen);
            free(list[i]);
        }
        free(list);
        if (rc) {
            json_buf_free(&b);
            return -1;
        }
    } else if (read_file(path, &b, err, errlen)) {
        json_buf_free(&b);
        return -1;
    }
    if (b.len < 1000) {
        snprintf(err, errlen, "corpus %.300s has %zu bytes of text; it needs at least 1000", path, b.len);
        json_buf_free(&b);
        return -1;
    }
    for (size_t i = 0; i < b.len; i++)
        if (!b.p[i]) b.p[i] = ' ';
    sz->text = b.p;
    sz->len = b.len;
    return 0;
}

/* The default corpus: tools/bench/corpus next to the binary's checkout, else
 * under the working directory. */
const char *bench_default_corpus(char *buf, size_t cap)
{
    char exe[4096];
    ssize_t n = readlink("/proc/self/exe", exe, sizeof exe - 1);
    if (n > 0) {
        exe[n] = 0;
        char *sl = strrchr(exe, '/');
        if (sl) {
            *sl = 0;
            snprintf(buf, cap, "%s/../tools/bench/corpus", exe);
            struct stat st;
            if (!stat(buf, &st)) return buf;
        }
    }
    return "tools/bench/corpus";
}

/* A user message: a tag that makes its first tokens unique, an instruction,
 * then nchars bytes of the corpus from offset (snapped to a line start,
 * wrapping around, cut at a UTF-8 boundary). Returns a malloc'ed string. */
char *bench_build_prompt(const struct sizer *sz, const char *tag, size_t offset, size_t nchars)
{
    offset %= sz->len;
    if (offset) {
        const char *nl = memchr(sz->text + offset, '\n', sz->len - offset);
        offset = nl ? (size_t)(nl - sz->text) + 1 : 0;
        if (offset >= sz->len) offset = 0;
    }
    struct json_buf b;
    json_buf_init(&b);
    json_buf_addf(&b, "[%s] Read the following text, then summarize it.\n\n", tag);
    size_t left = nchars;
    while (left) {
        size_t n = sz->len - offset < left ? sz->len - offset : left;
        json_buf_add(&b, sz->text + offset, n);
        left -= n;
        offset = 0;
        if (left) {
            json_buf_lit(&b, "\n\n");
            left = left > 2 ? left - 2 : 0;
        }
    }
    while (b.len && ((unsigned char)b.p[b.len - 1] & 0xC0) == 0x80) b.len--; /* continuation bytes */
    if (b.len && (unsigned char)b.p[b.len - 1] >= 0xC0) b.len--;             /* a lead byte left alone */
    if (b.p) b.p[b.len] = 0;
    if (b.oom) {
        json_buf_free(&b);
        return NULL;
    }
    return b.p;
}

/* Prompt tokens of a chat with this user message, by /tokenize. Returns the
 * count, -1 when the server has no usable /tokenize, -2 on a connection error. */
int bench_tokenize_count(const struct bench_opts *o, struct sizer *sz, const char *model, const char *prompt,
                         char *err, size_t errlen)
{
    struct json_buf b, out;
    json_buf_init(&b);
    json_buf_lit(&b, "{\"model\":");
    json_buf_add_str(&b, model, strlen(model));
    json_buf_lit(&b, ",\"messages\":[{\"role\":\"user\",\"content\":");
    json_buf_add_str(&b, prompt, strlen(prompt));
    json_buf_lit(&b, "}]}");
    int st = bench_http_json(&o->t, "POST", "/tokenize", &b, &out, err, errlen);
    json_buf_free(&b);
    int n = st < 0 ? -2 : -1;
    json_doc d;
    char e[64];
    if (st == 200 && out.len && !json_parse(&d, out.p, out.len, e, sizeof e)) {
        if (json_is_obj(&d, 0)) {
            n = int_field(&d, 0, "count");
            int tk = json_get(&d, 0, "tokens");
            if (n < 0 && tk >= 0 && json_is_arr(&d, tk)) n = json_size(&d, tk);
            int mm = int_field(&d, 0, "max_model_len");
            if (mm > 0) sz->max_model_len = mm;
        }
        json_free(&d);
    } else if (st > 0) {
        snprintf(err, errlen, "/tokenize replied HTTP %d", st);
    }
    json_buf_free(&out);
    return n;
}

/* A prompt of about target tokens (exactly, when /tokenize is there and the
 * text allows it). Returns a malloc'ed prompt and its expected token count in
 * *n_tok (-1 when only estimated), or NULL with err set. */
char *bench_size_prompt(const struct bench_opts *o, struct sizer *sz, const char *model, const char *tag,
                        size_t offset, long target, int *n_tok, char *err, size_t errlen)
{
    *n_tok = -1;
    if (!sz->have_tokenize) {
        double c = (target - sz->a) / sz->b;
        return bench_build_prompt(sz, tag, offset, c < 1 ? 1 : (size_t)c);
    }
    /* secant steps on chars -> tokens, then bisection for the last few tokens */
    size_t lo = 0, hi = 0, c = (size_t)(target * sz->chars_per_tok);
    int n_lo = -1;
    size_t pc = 0;
    int pn = -1;
    if (c < 1) c = 1;
    for (int it = 0; it < 40; it++) {
        char *p = bench_build_prompt(sz, tag, offset, c);
        if (!p) break;
        int n = bench_tokenize_count(o, sz, model, p, err, errlen);
        free(p);
        if (n < 0) return NULL;
        if (n == target) {
            lo = c;
            n_lo = n;
            break;
        }
        if (n < target) {
            if (c > lo || n_lo < 0) { lo = c; n_lo = n; }
        } else if (!hi || c < hi) {
            hi = c;
        }
        if (pn >= 0 && n != pn && c != pc) {
            double slope = ((double)c - (double)pc) / (n - pn);
            if (slope > 0.5 && slope < 50) sz->chars_per_tok = slope;
        }
        pc = c;
        pn = n;
        double next = (double)c + (target - n) * sz->chars_per_tok;
        size_t nc = next < 1 ? 1 : (size_t)next;
        if (hi && (nc <= lo || nc >= hi)) nc = (lo + hi) / 2;
        if (hi && hi - lo <= 1) break;
        if (nc == c) nc = n < target ? c + 1 : (c > 1 ? c - 1 : 1);
        c = nc;
    }
    if (n_lo < 0) { /* even the shortest text is over the target */
        lo = 1;
    }
    *n_tok = n_lo;
    char *p = bench_build_prompt(sz, tag, offset, lo);
    if (!p) snprintf(err, errlen, "out of memory");
    return p;
}

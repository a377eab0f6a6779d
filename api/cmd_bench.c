/* cmd_bench.c - `sluice bench`: the cache-bust / cache-hit benchmark against
 * any OpenAI-compatible server (sluice, vLLM, llama.cpp's server).
 *
 * Every request is a streamed /v1/chat/completions with
 * stream_options.include_usage, sent over its own HTTP/1.1 connection by the
 * small blocking client shared with `sluice batch` (api/http_client.c). Timings are taken on the client: TTFT is the
 * arrival of the first chunk that carries content, total is the arrival of
 * [DONE]; token counts come from the server's usage.
 *
 * Table mode: a short warm-up, --runs cache-bust runs (a long prompt cut from
 * the corpus whose first tokens differ per run), then --runs cache-hit runs
 * (the last bust prompt exactly). Load mode (--concurrency N): N streams at
 * once over --num-prompts distinct prompts whose lengths a fixed seed picks.
 *
 * Prompts are sized with the server's /tokenize (vLLM's shape, rendered from
 * the same messages); without it, from the usage of two warm-up requests.
 *
 * Beside-batch mode (--beside-batch): streamed one-word chats one after
 * another with the engine idle, then the same chats beside a Batch API job
 * of documents (uploaded through /v1/files, started through /v1/batches):
 * the chats' TTFT and time between chunks idle against beside the batch,
 * and the batch's throughput (the engine's token counters in /metrics, the
 * chats' own tokens taken out) alone against with the chats.
 * Everything runs on the main thread except the load mode's N workers, which
 * share nothing but an atomic counter and their own result slots.
 */
#include <dirent.h>
#include <errno.h>
#include <fcntl.h>
#include <math.h>
#include <netdb.h>
#include <poll.h>
#include <pthread.h>
#include <signal.h>
#include <stdatomic.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/socket.h>
#include <sys/stat.h>
#include <sys/time.h>
#include <time.h>
#include <unistd.h>

#include "api.h"
#include "api/http_client.h"
#include "base/json.h"

/* ---- types ---- */

/* One streamed request's outcome. */
struct run_result {
    double ttft, total;        /* seconds from connect to first content / [DONE] */
    int p_tok, c_tok, cached;  /* from usage; cached = -1 when not reported */
    int n_chunks;              /* content-carrying chunks */
    double *itl;               /* owned: gaps between content chunks, seconds */
    int n_itl, cap_itl;
};

struct bench_opts {
    struct hc_target t;
    const char *model;
    long prompt_tokens, max_tokens, runs, concurrency, num_prompts, seed;
    bool ignore_eos;
    bool beside;                 /* --beside-batch mode */
    long batch_lines, chats, chat_max_tokens;
    double window;
    const char *csv, *json, *plot, *corpus;
};

/* The corpus and what is known about sizing prompts against this server. */
struct sizer {
    char *text;             /* owned: the corpus, NUL-terminated */
    size_t len;
    bool have_tokenize;     /* /tokenize answered with a count */
    double a, b;            /* fallback: tokens ~ a + b * chars */
    double chars_per_tok;   /* first guess for the /tokenize search */
    int max_model_len;      /* from /tokenize, 0 when unknown */
};

static double now_s(void)
{
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return (double)ts.tv_sec + ts.tv_nsec * 1e-9;
}

/* POST/GET with a JSON reply collected into out (caller frees). Returns the
 * HTTP status, or -1 on a connection error (err set). */
static int http_json(const struct hc_target *t, const char *method, const char *path, const struct json_buf *body,
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
    double t = now_s();
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
static int chat_stream(const struct bench_opts *o, const char *model, const char *prompt, long max_tokens,
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
    s.t0 = now_s();
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
static int load_corpus(struct sizer *sz, const char *path, char *err, size_t errlen)
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
static const char *default_corpus(char *buf, size_t cap)
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
static char *build_prompt(const struct sizer *sz, const char *tag, size_t offset, size_t nchars)
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
static int tokenize_count(const struct bench_opts *o, struct sizer *sz, const char *model, const char *prompt,
                          char *err, size_t errlen)
{
    struct json_buf b, out;
    json_buf_init(&b);
    json_buf_lit(&b, "{\"model\":");
    json_buf_add_str(&b, model, strlen(model));
    json_buf_lit(&b, ",\"messages\":[{\"role\":\"user\",\"content\":");
    json_buf_add_str(&b, prompt, strlen(prompt));
    json_buf_lit(&b, "}]}");
    int st = http_json(&o->t, "POST", "/tokenize", &b, &out, err, errlen);
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
static char *size_prompt(const struct bench_opts *o, struct sizer *sz, const char *model, const char *tag,
                         size_t offset, long target, int *n_tok, char *err, size_t errlen)
{
    *n_tok = -1;
    if (!sz->have_tokenize) {
        double c = (target - sz->a) / sz->b;
        return build_prompt(sz, tag, offset, c < 1 ? 1 : (size_t)c);
    }
    /* secant steps on chars -> tokens, then bisection for the last few tokens */
    size_t lo = 0, hi = 0, c = (size_t)(target * sz->chars_per_tok);
    int n_lo = -1;
    size_t pc = 0;
    int pn = -1;
    if (c < 1) c = 1;
    for (int it = 0; it < 40; it++) {
        char *p = build_prompt(sz, tag, offset, c);
        if (!p) break;
        int n = tokenize_count(o, sz, model, p, err, errlen);
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
    char *p = build_prompt(sz, tag, offset, lo);
    if (!p) snprintf(err, errlen, "out of memory");
    return p;
}

/* ---- results ---- */

struct row {
    int run;
    const char *cache;       /* "bust", "hit", "load" */
    struct run_result r;
};

static double pp_rate(const struct run_result *r) { return r->ttft > 0 ? r->p_tok / r->ttft : NAN; }
static double tg_rate(const struct run_result *r)
{
    return r->c_tok > 1 && r->total > r->ttft ? (r->c_tok - 1) / (r->total - r->ttft) : NAN;
}
static double e2e_rate(const struct run_result *r) { return r->total > 0 ? r->c_tok / r->total : NAN; }

static void put_num(FILE *f, double v, int prec)
{
    if (isnan(v)) fputs("-", f);
    else if (prec < 0) fprintf(f, v == floor(v) ? "%.0f" : "%.1f", v); /* token counts */
    else fprintf(f, "%.*f", prec, v);
}

/* The values of one table line, in column order. */
static void line_vals(const struct run_result *r, double v[7])
{
    v[0] = pp_rate(r);
    v[1] = tg_rate(r);
    v[2] = e2e_rate(r);
    v[3] = r->ttft;
    v[4] = r->total;
    v[5] = r->p_tok;
    v[6] = r->c_tok;
}

static void avg_vals(const struct row *rows, int n, const char *cache, double v[7])
{
    double sum[7] = {0};
    int cnt[7] = {0};
    for (int i = 0; i < n; i++) {
        if (strcmp(rows[i].cache, cache)) continue;
        double x[7];
        line_vals(&rows[i].r, x);
        for (int k = 0; k < 7; k++)
            if (!isnan(x[k])) { sum[k] += x[k]; cnt[k]++; }
    }
    for (int k = 0; k < 7; k++) v[k] = cnt[k] ? sum[k] / cnt[k] : NAN;
}

static const int col_prec[7] = {1, 1, 1, 3, 3, -1, -1};

static void put_line(FILE *f, char sep, const char *run, const char *cache, const double v[7])
{
    fprintf(f, "%s%c%s", run, sep, cache);
    for (int k = 0; k < 7; k++) {
        fputc(sep, f);
        put_num(f, v[k], col_prec[k]);
    }
    fputc('\n', f);
}

static void print_table(FILE *f, char sep, const struct row *rows, int n)
{
    static const char *cols[] = {"run", "cache", "pp tok/s", "tg tok/s", "e2e tok/s", "TTFT s", "total s", "p_tok", "c_tok"};
    for (int k = 0; k < 9; k++) fprintf(f, "%s%s", k ? (sep == '\t' ? "\t" : ",") : "", cols[k]);
    fputc('\n', f);
    for (int i = 0; i < n; i++) {
        char run[16];
        double v[7];
        snprintf(run, sizeof run, "%d", rows[i].run);
        line_vals(&rows[i].r, v);
        put_line(f, sep, run, rows[i].cache, v);
    }
    static const char *kinds[] = {"bust", "hit"};
    for (int k = 0; k < 2; k++) {
        double v[7];
        avg_vals(rows, n, kinds[k], v);
        if (!isnan(v[4])) put_line(f, sep, "avg", kinds[k], v);
    }
}

/* v with 3 more decimals than the table's column, and at least 7
 * significant digits (a cache hit's TTFT of 1.76 ms keeps 0.001760xyz, so
 * the rates still follow from the seconds) */
static void json_num(struct json_buf *b, const char *key, double v, int prec)
{
    if (isnan(v)) {
        json_buf_addf(b, "\"%s\":null", key);
    } else if (prec < 0 && v == floor(v)) {
        json_buf_addf(b, "\"%s\":%.0f", key, v);
    } else {
        int d = prec < 0 ? 2 : prec + 3;
        if (v != 0 && isfinite(v)) {
            int sig = 6 - (int)floor(log10(fabs(v)));
            if (sig > d) d = sig < 12 ? sig : 12;
        }
        json_buf_addf(b, "\"%s\":%.*f", key, d, v);
    }
}

static void json_vals(struct json_buf *b, const double v[7])
{
    static const char *keys[] = {"pp_tok_s", "tg_tok_s", "e2e_tok_s", "ttft_s", "total_s", "p_tok", "c_tok"};
    for (int k = 0; k < 7; k++) {
        if (k) json_buf_lit(b, ",");
        json_num(b, keys[k], v[k], col_prec[k]);
    }
}

static void json_rows(struct json_buf *b, const struct row *rows, int n)
{
    json_buf_lit(b, "\"rows\":[");
    for (int i = 0; i < n; i++) {
        double v[7];
        line_vals(&rows[i].r, v);
        json_buf_addf(b, "%s{\"run\":%d,\"cache\":\"%s\",", i ? "," : "", rows[i].run, rows[i].cache);
        json_vals(b, v);
        json_buf_addf(b, ",\"cached_tokens\":%d}", rows[i].r.cached);
    }
    json_buf_lit(b, "]");
}

static void json_head(struct json_buf *b, const struct bench_opts *o, const char *model, const struct sizer *sz,
                      const char *mode)
{
    json_buf_addf(b, "{\"mode\":\"%s\",\"url\":", mode);
    char url[600];
    snprintf(url, sizeof url, "http://%s:%s%s", o->t.host, o->t.port, o->t.prefix);
    json_buf_add_str(b, url, strlen(url));
    json_buf_lit(b, ",\"model\":");
    json_buf_add_str(b, model, strlen(model));
    json_buf_addf(b, ",\"prompt_tokens\":%ld,\"max_tokens\":%ld,\"runs\":%ld,\"ignore_eos\":%s,\"sized_with\":\"%s\",",
                  o->prompt_tokens, o->max_tokens, o->runs, o->ignore_eos ? "true" : "false",
                  sz->have_tokenize ? "tokenize" : "usage");
}

static int write_text(const char *path, const char *text, size_t len, char *err, size_t errlen)
{
    FILE *f = fopen(path, "w");
    if (!f || fwrite(text, 1, len, f) != len || fclose(f)) {
        snprintf(err, errlen, "cannot write %s: %s", path, strerror(errno));
        if (f) fclose(f);
        return -1;
    }
    return 0;
}

static bool have_gnuplot(void)
{
    const char *path = getenv("PATH");
    if (!path) path = "/usr/bin:/bin";
    while (*path) {
        const char *e = strchr(path, ':');
        size_t n = e ? (size_t)(e - path) : strlen(path);
        char p[4096];
        snprintf(p, sizeof p, "%.*s/gnuplot", (int)n, path);
        if (n && !access(p, X_OK)) return true;
        path += n + (e ? 1 : 0);
    }
    return false;
}

/* Draws TTFT and tg tok/s per run into a PNG with gnuplot. */
static int plot_png(const char *png, const char *title, const struct row *rows, int n, char *err, size_t errlen)
{
    char dat[] = "/tmp/sluice-bench-XXXXXX";
    int fd = mkstemp(dat);
    FILE *f = fd >= 0 ? fdopen(fd, "w") : NULL;
    if (!f) {
        snprintf(err, errlen, "cannot create a temporary file: %s", strerror(errno));
        if (fd >= 0) close(fd);
        return -1;
    }
    for (int i = 0; i < n; i++) {
        double tg = tg_rate(&rows[i].r);
        fprintf(f, "%d %d %.6f %.6f\n", i + 1, !strcmp(rows[i].cache, "hit") ? 1 : !strcmp(rows[i].cache, "load") ? 2 : 0,
                rows[i].r.ttft, isnan(tg) ? 0.0 : tg);
    }
    fclose(f);
    FILE *g = popen("gnuplot", "w");
    if (!g) {
        unlink(dat);
        snprintf(err, errlen, "cannot run gnuplot: %s", strerror(errno));
        return -1;
    }
    /* one series per cache kind present, so the legend names only those */
    static const char *kind_title[] = {"cache bust", "cache hit", "load"}, *kind_color[] = {"#d95f02", "#1b9e77", "#7570b3"};
    bool present[3] = {false, false, false};
    for (int i = 0; i < n; i++)
        present[!strcmp(rows[i].cache, "hit") ? 1 : !strcmp(rows[i].cache, "load") ? 2 : 0] = true;
    fprintf(g,
            "set terminal pngcairo size 1000,700 noenhanced font ',10'\n"
            "set output '%s'\n"
            "set multiplot layout 2,1 title '%s'\n"
            "set style fill solid 0.8 border -1\nset boxwidth 0.7\nset grid ytics\nset key top right\n"
            "set xrange [0.3:%d.7]\nset xtics %d\nset yrange [0:*]\nset xlabel '%s'\n",
            png, title, n, n > 40 ? n / 20 : 1, present[2] ? "request" : "run");
    for (int panel = 0; panel < 2; panel++) {
        fprintf(g, "set ylabel '%s'\nplot ", panel ? "tg tok/s" : "TTFT (s)");
        bool first = true;
        for (int k = 0; k < 3; k++) {
            if (!present[k]) continue;
            fprintf(g, "%s'%s' using 1:($2==%d?$%d:1/0) with boxes lc rgb '%s' title '%s'", first ? "" : ", ", dat, k,
                    panel ? 4 : 3, kind_color[k], kind_title[k]);
            first = false;
        }
        fputc('\n', g);
    }
    fprintf(g, "unset multiplot\n");
    int st = pclose(g);
    unlink(dat);
    struct stat sb;
    if (st != 0 || stat(png, &sb) || !sb.st_size) {
        snprintf(err, errlen, "gnuplot failed to draw %s (exit status %d)", png, st);
        return -1;
    }
    return 0;
}

/* ---- the two modes ---- */

static uint64_t splitmix(uint64_t *s)
{
    uint64_t z = (*s += 0x9E3779B97F4A7C15ull);
    z = (z ^ (z >> 30)) * 0xBF58476D1CE4E5B9ull;
    z = (z ^ (z >> 27)) * 0x94D049BB133111EBull;
    return z ^ (z >> 31);
}

static int finish_outputs(const struct bench_opts *o, const char *model, const struct sizer *sz, struct json_buf *js,
                          const struct row *rows, int n, char *err, size_t errlen)
{
    if (o->json) {
        json_buf_lit(js, "}\n");
        if (js->oom) {
            snprintf(err, errlen, "out of memory");
            return -1;
        }
        if (write_text(o->json, js->p, js->len, err, errlen)) return -1;
    }
    if (o->plot) {
        char title[400];
        snprintf(title, sizeof title, "sluice bench: %s, %ld prompt tokens, %ld max tokens (%s)", model,
                 o->prompt_tokens, o->max_tokens, o->concurrency ? "load" : "cache bust vs hit");
        for (char *c = title; *c; c++)
            if (*c == '\'' || *c == '\\') *c = ' ';
        if (plot_png(o->plot, title, rows, n, err, errlen)) return -1;
    }
    (void)sz;
    return 0;
}

static int run_table(const struct bench_opts *o, struct sizer *sz, const char *model, char *err, size_t errlen)
{
    int n = (int)(2 * o->runs), rc = -1;
    struct row *rows = calloc((size_t)n, sizeof *rows);
    char *prompt = NULL;
    if (!rows) return -1;
    uint64_t seed = (uint64_t)time(NULL) ^ ((uint64_t)getpid() << 32) ^ (uint64_t)(now_s() * 1e9);
    unsigned nonce = (unsigned)splitmix(&seed);
    for (int i = 0; i < n; i++) {
        bool bust = i < o->runs;
        rows[i].run = i + 1;
        rows[i].cache = bust ? "bust" : "hit";
        int expect = -1;
        if (bust) {
            char tag[64];
            snprintf(tag, sizeof tag, "%08x-%d", nonce, i + 1);
            free(prompt);
            /* each run starts elsewhere in the corpus as well */
            prompt = size_prompt(o, sz, model, tag, sz->len / (size_t)o->runs * (size_t)i, o->prompt_tokens, &expect,
                                 err, errlen);
            if (!prompt) goto out;
        }
        if (chat_stream(o, model, prompt, o->max_tokens, &rows[i].r, err, errlen)) goto out;
        const struct run_result *r = &rows[i].r;
        fprintf(stderr, "run %d (%s): p_tok %d, c_tok %d, cached %d, TTFT %.3f s, total %.3f s\n", i + 1,
                rows[i].cache, r->p_tok, r->c_tok, r->cached, r->ttft, r->total);
        if (expect >= 0 && r->p_tok != expect)
            fprintf(stderr, "note: /tokenize counted %d prompt tokens, the reply's usage says %d\n", expect, r->p_tok);
    }
    print_table(stdout, '\t', rows, n);
    fflush(stdout);
    if (o->csv) {
        FILE *f = fopen(o->csv, "w");
        if (!f) {
            snprintf(err, errlen, "cannot write %s: %s", o->csv, strerror(errno));
            goto out;
        }
        print_table(f, ',', rows, n);
        if (fclose(f)) {
            snprintf(err, errlen, "cannot write %s", o->csv);
            goto out;
        }
    }
    struct json_buf js;
    json_buf_init(&js);
    if (o->json) {
        json_head(&js, o, model, sz, "table");
        json_rows(&js, rows, n);
        json_buf_lit(&js, ",\"averages\":{");
        static const char *kinds[] = {"bust", "hit"};
        for (int k = 0; k < 2; k++) {
            double v[7];
            avg_vals(rows, n, kinds[k], v);
            json_buf_addf(&js, "%s\"%s\":{", k ? "," : "", kinds[k]);
            json_vals(&js, v);
            json_buf_lit(&js, "}");
        }
        json_buf_lit(&js, "}");
    }
    rc = finish_outputs(o, model, sz, &js, rows, n, err, errlen);
    json_buf_free(&js);
out:
    for (int i = 0; i < n; i++) free(rows[i].r.itl);
    free(rows);
    free(prompt);
    return rc;
}

struct load_job {
    const struct bench_opts *o;
    const char *model;
    char **prompts;
    struct row *rows;
    char (*errs)[512];
    int n;
    atomic_int next;
};

static void *load_worker(void *arg)
{
    struct load_job *j = arg;
    for (;;) {
        int i = atomic_fetch_add(&j->next, 1);
        if (i >= j->n) break;
        if (chat_stream(j->o, j->model, j->prompts[i], j->o->max_tokens, &j->rows[i].r, j->errs[i], sizeof j->errs[i]))
            j->rows[i].r.c_tok = -1;
    }
    return NULL;
}

static int cmp_double(const void *a, const void *b)
{
    double x = *(const double *)a, y = *(const double *)b;
    return x < y ? -1 : x > y;
}

/* q-quantile of sorted v[0..n) with linear interpolation (numpy's default). */
static double quantile(const double *v, int n, double q)
{
    if (n <= 0) return NAN;
    double pos = q * (n - 1);
    int i = (int)pos;
    if (i + 1 >= n) return v[n - 1];
    return v[i] + (pos - i) * (v[i + 1] - v[i]);
}

static int run_load(const struct bench_opts *o, struct sizer *sz, const char *model, char *err, size_t errlen)
{
    int n = (int)o->num_prompts, rc = -1;
    struct load_job j = {.o = o, .model = model, .n = n};
    atomic_init(&j.next, 0);
    j.prompts = calloc((size_t)n, sizeof *j.prompts);
    j.rows = calloc((size_t)n, sizeof *j.rows);
    j.errs = calloc((size_t)n, sizeof *j.errs);
    pthread_t *th = calloc((size_t)o->concurrency, sizeof *th);
    double *ttft = calloc((size_t)n, sizeof *ttft), *itl = NULL;
    if (!j.prompts || !j.rows || !j.errs || !th || !ttft) {
        snprintf(err, errlen, "out of memory");
        goto out;
    }
    uint64_t rng = (uint64_t)o->seed;
    unsigned nonce = (unsigned)(time(NULL) ^ getpid());
    long lo = o->prompt_tokens / 2, span = o->prompt_tokens + 1;
    fprintf(stderr, "sizing %d prompts of %ld..%ld tokens (seed %ld)\n", n, lo, lo + span - 1, o->seed);
    for (int i = 0; i < n; i++) {
        long want = lo + (long)(splitmix(&rng) % (uint64_t)span);
        if (want < 16) want = 16;
        char tag[64];
        int expect;
        snprintf(tag, sizeof tag, "load-%08x-%d", nonce, i + 1);
        j.prompts[i] = size_prompt(o, sz, model, tag, sz->len / (size_t)n * (size_t)i, want, &expect, err, errlen);
        if (!j.prompts[i]) goto out;
        j.rows[i].run = i + 1;
        j.rows[i].cache = "load";
    }
    fprintf(stderr, "sending %d requests, %ld at a time\n", n, o->concurrency);
    double t0 = now_s();
    int started = 0;
    for (long k = 0; k < o->concurrency; k++) {
        if (pthread_create(&th[k], NULL, load_worker, &j)) break;
        started++;
    }
    if (!started) {
        snprintf(err, errlen, "cannot start worker threads");
        goto out;
    }
    for (int k = 0; k < started; k++) pthread_join(th[k], NULL);
    double wall = now_s() - t0;

    int ok = 0, failed = 0, n_itl = 0;
    long out_tok = 0, in_tok = 0;
    const char *first_err = NULL;
    for (int i = 0; i < n; i++) {
        if (j.rows[i].r.c_tok < 0) {
            failed++;
            if (!first_err) first_err = j.errs[i];
            continue;
        }
        ttft[ok++] = j.rows[i].r.ttft;
        out_tok += j.rows[i].r.c_tok;
        in_tok += j.rows[i].r.p_tok;
        n_itl += j.rows[i].r.n_itl;
    }
    if (failed) {
        snprintf(err, errlen, "%d of %d requests failed; the first: %s", failed, n, first_err);
        goto out;
    }
    itl = malloc(sizeof *itl * (size_t)(n_itl ? n_itl : 1));
    if (!itl) goto out;
    n_itl = 0;
    for (int i = 0; i < n; i++)
        for (int k = 0; k < j.rows[i].r.n_itl; k++) itl[n_itl++] = j.rows[i].r.itl[k] * 1e3;
    qsort(ttft, (size_t)ok, sizeof *ttft, cmp_double);
    qsort(itl, (size_t)n_itl, sizeof *itl, cmp_double);
    struct { const char *name, *key; double v; int prec; } m[] = {
        {"requests", "requests", n, 0},
        {"concurrency", "concurrency", (double)o->concurrency, 0},
        {"wall s", "wall_s", wall, 3},
        {"req/s", "req_s", n / wall, 3},
        {"output tok/s", "output_tok_s", out_tok / wall, 1},
        {"prompt tok/s", "prompt_tok_s", in_tok / wall, 1},
        {"mean p_tok", "mean_p_tok", (double)in_tok / n, 1},
        {"mean c_tok", "mean_c_tok", (double)out_tok / n, 1},
        {"TTFT p50 s", "ttft_p50_s", quantile(ttft, ok, 0.50), 3},
        {"TTFT p90 s", "ttft_p90_s", quantile(ttft, ok, 0.90), 3},
        {"TTFT p99 s", "ttft_p99_s", quantile(ttft, ok, 0.99), 3},
        {"ITL p50 ms", "itl_p50_ms", quantile(itl, n_itl, 0.50), 2},
        {"ITL p90 ms", "itl_p90_ms", quantile(itl, n_itl, 0.90), 2},
        {"ITL p99 ms", "itl_p99_ms", quantile(itl, n_itl, 0.99), 2},
    };
    int nm = (int)(sizeof m / sizeof m[0]);
    FILE *csv = NULL;
    if (o->csv && !(csv = fopen(o->csv, "w"))) {
        snprintf(err, errlen, "cannot write %s: %s", o->csv, strerror(errno));
        goto out;
    }
    printf("metric\tvalue\n");
    if (csv) fprintf(csv, "metric,value\n");
    for (int k = 0; k < nm; k++) {
        printf("%s\t", m[k].name);
        put_num(stdout, m[k].v, m[k].prec);
        putchar('\n');
        if (csv) {
            fprintf(csv, "%s,", m[k].name);
            put_num(csv, m[k].v, m[k].prec);
            fputc('\n', csv);
        }
    }
    fflush(stdout);
    if (csv && fclose(csv)) {
        snprintf(err, errlen, "cannot write %s", o->csv);
        goto out;
    }
    struct json_buf js;
    json_buf_init(&js);
    if (o->json) {
        json_head(&js, o, model, sz, "load");
        json_buf_addf(&js, "\"seed\":%ld,\"summary\":{", o->seed);
        for (int k = 0; k < nm; k++) {
            if (k) json_buf_lit(&js, ",");
            json_num(&js, m[k].key, m[k].v, m[k].prec);
        }
        json_buf_lit(&js, "},");
        json_rows(&js, j.rows, n);
    }
    rc = finish_outputs(o, model, sz, &js, j.rows, n, err, errlen);
    json_buf_free(&js);
out:
    for (int i = 0; j.prompts && i < n; i++) free(j.prompts[i]);
    for (int i = 0; j.rows && i < n; i++) free(j.rows[i].r.itl);
    free(j.prompts);
    free(j.rows);
    free(j.errs);
    free(th);
    free(ttft);
    free(itl);
    return rc;
}

/* ---- chat beside a batch (--beside-batch) ---- */

/* The engine's token counters from /metrics: prompt tokens computed plus
 * decode tokens (every sluice has these two). -1 on failure. */
static double engine_tokens(const struct hc_target *t, char *err, size_t errlen)
{
    struct json_buf b;
    int st = http_json(t, "GET", "/metrics", NULL, &b, err, errlen);
    double sum = -1;
    if (st == 200 && b.p) {
        static const char *const keys[] = {"sluice:prefill_tokens_computed_total ", "sluice:decode_tokens_total "};
        int found = 0;
        sum = 0;
        for (size_t k = 0; k < 2; k++) {
            const char *p = b.p;
            while ((p = strstr(p, keys[k])) && p != b.p && p[-1] != '\n') p++;
            if (p) {
                sum += atof(p + strlen(keys[k]));
                found++;
            }
        }
        if (found < 2) {
            snprintf(err, errlen, "/metrics has no sluice:prefill_tokens_computed_total / sluice:decode_tokens_total");
            sum = -1;
        }
    } else if (st >= 0) {
        snprintf(err, errlen, "/metrics replied HTTP %d", st);
    }
    json_buf_free(&b);
    return sum;
}

/* POST /v1/files (multipart, purpose batch) then /v1/batches; the batch id
 * goes to id. */
static int start_batch(const struct bench_opts *o, const struct json_buf *jsonl, char *id, size_t idcap, char *err,
                       size_t errlen)
{
    char fid[128] = "", e1[512];
    if (hc_upload_batch_file(&o->t, "bench.jsonl", jsonl->p, jsonl->len, NULL, 0, fid, sizeof fid, e1, sizeof e1)) {
        snprintf(err, errlen, "uploading the batch file: %s", e1);
        return -1;
    }
    struct json_buf body, out;
    json_buf_init(&body);
    json_buf_lit(&body, "{\"input_file_id\":");
    json_buf_add_str(&body, fid, strlen(fid));
    json_buf_lit(&body, ",\"endpoint\":\"/v1/chat/completions\",\"completion_window\":\"24h\"}");
    int st = http_json(&o->t, "POST", "/v1/batches", &body, &out, err, errlen), rc = -1;
    json_buf_free(&body);
    json_doc d;
    char e[64];
    if (st == 200 && out.len && !json_parse(&d, out.p, out.len, e, sizeof e)) {
        int f = json_is_obj(&d, 0) ? json_get(&d, 0, "id") : -1;
        if (f >= 0 && json_is_str(&d, f) && json_str(&d, f, id, idcap) >= 0) rc = 0;
        json_free(&d);
    }
    if (rc && st >= 0) {
        char msg[300];
        hc_error_text(out.p ? out.p : "", out.len, msg, sizeof msg);
        snprintf(err, errlen, "creating the batch: HTTP %d: %s", st, msg);
    }
    json_buf_free(&out);
    return rc;
}

/* The 1-minute load average (the machine may be shared), or NAN. */
static double load_avg(void)
{
    double l = NAN;
    FILE *f = fopen("/proc/loadavg", "r");
    if (f) {
        if (fscanf(f, "%lf", &l) != 1) l = NAN;
        fclose(f);
    }
    return l;
}

/* --chats one-word chats one after another; their TTFTs (ms) go to ttft,
 * their gaps between chunks (ms) to itl (*n_itl of them, cap at most), and
 * the tokens the engine ran for them to *tokens. */
static int chat_series(const struct bench_opts *o, const char *model, double *ttft, double *itl, int cap, int *n_itl,
                       double *tokens, char *err, size_t errlen)
{
    static const char *const words[] = {"Hello", "Hi", "Hey", "Greetings", "Morning", "Howdy", "Thanks", "Bonjour",
                                        "Hola", "Yo"};
    *n_itl = 0;
    *tokens = 0;
    for (long i = 0; i < o->chats; i++) {
        struct run_result r;
        if (chat_stream(o, model, words[i % 10], o->chat_max_tokens, &r, err, errlen)) return -1;
        ttft[i] = r.ttft * 1e3;
        for (int k = 0; k < r.n_itl && *n_itl < cap; k++) itl[(*n_itl)++] = r.itl[k] * 1e3;
        *tokens += r.c_tok + (r.cached >= 0 ? r.p_tok - r.cached : r.p_tok);
        free(r.itl);
    }
    return 0;
}

/* Batch tokens a second over window seconds of the engine's counters. */
static double batch_rate(const struct bench_opts *o, double window, char *err, size_t errlen)
{
    double a = engine_tokens(&o->t, err, errlen), t0 = now_s();
    if (a < 0) return -1;
    struct timespec ts = {(time_t)window, (long)((window - (time_t)window) * 1e9)};
    nanosleep(&ts, NULL);
    double b = engine_tokens(&o->t, err, errlen);
    return b < 0 ? -1 : (b - a) / (now_s() - t0);
}

/* Streamed one-word chats with the engine idle, then a Batch API job of
 * --batch-lines documents of ~--prompt-tokens tokens; once it runs, its
 * throughput alone for --window seconds, the same chats beside it, and its
 * throughput alone again (the batch's own mix drifts: the mean of the two
 * windows is the baseline); the batch is cancelled at the end. */
static int run_beside(const struct bench_opts *o, struct sizer *sz, const char *model, char *err, size_t errlen)
{
    int rc = -1, n = (int)o->chats, cap = n * (int)(o->chat_max_tokens + 1);
    double *tt_idle = calloc((size_t)n, sizeof(double)), *tt_busy = calloc((size_t)n, sizeof(double));
    double *it_idle = calloc((size_t)cap, sizeof(double)), *it_busy = calloc((size_t)cap, sizeof(double));
    struct json_buf jl;
    json_buf_init(&jl);
    char bid[128] = "";
    if (!tt_idle || !tt_busy || !it_idle || !it_busy) {
        snprintf(err, errlen, "out of memory");
        goto out;
    }
    double load0 = load_avg();
    int ni_idle, ni_busy;
    double tok_idle, tok_busy;
    fprintf(stderr, "%ld chats with the engine idle\n", o->chats);
    if (chat_series(o, model, tt_idle, it_idle, cap, &ni_idle, &tok_idle, err, errlen)) goto out;
    /* the documents: one sized by /tokenize, the others cut as long from elsewhere in the corpus */
    int expect;
    char *doc = size_prompt(o, sz, model, "doc-0", 0, o->prompt_tokens, &expect, err, errlen);
    if (!doc) goto out;
    size_t nchars = strlen(doc) > 64 ? strlen(doc) - 64 : strlen(doc);
    free(doc);
    for (long i = 0; i < o->batch_lines; i++) {
        char tag[32];
        snprintf(tag, sizeof tag, "doc-%ld", i);
        char *p = build_prompt(sz, tag, sz->len / (size_t)o->batch_lines * (size_t)i, nchars);
        if (!p) goto out;
        json_buf_addf(&jl, "{\"custom_id\":\"%s\",\"method\":\"POST\",\"url\":\"/v1/chat/completions\",\"body\":{\"model\":", tag);
        json_buf_add_str(&jl, model, strlen(model));
        json_buf_lit(&jl, ",\"messages\":[{\"role\":\"user\",\"content\":");
        json_buf_add_str(&jl, p, strlen(p));
        json_buf_addf(&jl, "}],\"max_tokens\":%ld,\"temperature\":0,\"ignore_eos\":true}}\n", o->max_tokens);
        free(p);
    }
    if (jl.oom) {
        snprintf(err, errlen, "out of memory");
        goto out;
    }
    if (start_batch(o, &jl, bid, sizeof bid, err, errlen)) goto out;
    fprintf(stderr, "batch %s: %ld documents of ~%ld tokens, %ld out each; waiting for it to run\n", bid,
            o->batch_lines, o->prompt_tokens, o->max_tokens);
    for (int k = 0; k < 600; k++) { /* the store feeds the engine: wait until tokens flow */
        double r = batch_rate(o, 1.0, err, errlen);
        if (r < 0) goto out;
        if (r > 0) break;
    }
    double alone1 = batch_rate(o, o->window, err, errlen);
    if (alone1 < 0) goto out;
    fprintf(stderr, "batch alone: %.1f tok/s; %ld chats beside it\n", alone1, o->chats);
    double a = engine_tokens(&o->t, err, errlen), t0 = now_s();
    if (a < 0 || chat_series(o, model, tt_busy, it_busy, cap, &ni_busy, &tok_busy, err, errlen)) goto out;
    double b = engine_tokens(&o->t, err, errlen), span = now_s() - t0;
    if (b < 0) goto out;
    double with = (b - a - tok_busy) / span;
    double alone2 = batch_rate(o, o->window, err, errlen);
    if (alone2 < 0) goto out;
    double load1 = load_avg(), alone = (alone1 + alone2) / 2;
    qsort(tt_idle, (size_t)n, sizeof(double), cmp_double);
    qsort(tt_busy, (size_t)n, sizeof(double), cmp_double);
    qsort(it_idle, (size_t)ni_idle, sizeof(double), cmp_double);
    qsort(it_busy, (size_t)ni_busy, sizeof(double), cmp_double);
    struct { const char *name, *key; double idle, busy; int prec; } m[] = {
        {"chat TTFT p50 ms", "ttft_p50_ms", quantile(tt_idle, n, 0.5), quantile(tt_busy, n, 0.5), 1},
        {"chat TTFT max ms", "ttft_max_ms", tt_idle[n - 1], tt_busy[n - 1], 1},
        {"chat ITL p50 ms", "itl_p50_ms", quantile(it_idle, ni_idle, 0.5), quantile(it_busy, ni_busy, 0.5), 2},
        {"chat ITL p90 ms", "itl_p90_ms", quantile(it_idle, ni_idle, 0.9), quantile(it_busy, ni_busy, 0.9), 2},
        {"chat ITL max ms", "itl_max_ms", ni_idle ? it_idle[ni_idle - 1] : NAN, ni_busy ? it_busy[ni_busy - 1] : NAN, 2},
    };
    printf("metric\tidle\tbeside batch\n");
    for (size_t k = 0; k < sizeof m / sizeof m[0]; k++) {
        printf("%s\t", m[k].name);
        put_num(stdout, m[k].idle, m[k].prec);
        putchar('\t');
        put_num(stdout, m[k].busy, m[k].prec);
        putchar('\n');
    }
    printf("batch tok/s\t%.1f alone (%.1f before, %.1f after)\t%.1f with chats (%.0f%%)\n", alone, alone1, alone2, with,
           alone > 0 ? 100.0 * with / alone : NAN);
    printf("load average\t%.2f at start\t%.2f at end\n", load0, load1);
    fflush(stdout);
    if (o->json) {
        struct json_buf js;
        json_buf_init(&js);
        json_head(&js, o, model, sz, "beside-batch");
        json_buf_addf(&js, "\"batch_lines\":%ld,\"chats\":%ld,\"chat_max_tokens\":%ld,\"window_s\":%g,\"summary\":{",
                      o->batch_lines, o->chats, o->chat_max_tokens, o->window);
        for (size_t k = 0; k < sizeof m / sizeof m[0]; k++) {
            char key[64];
            snprintf(key, sizeof key, "idle_%s", m[k].key);
            json_num(&js, key, m[k].idle, m[k].prec);
            json_buf_lit(&js, ",");
            snprintf(key, sizeof key, "batch_%s", m[k].key);
            json_num(&js, key, m[k].busy, m[k].prec);
            json_buf_lit(&js, ",");
        }
        json_num(&js, "batch_alone_tok_s", alone, 1);
        json_buf_lit(&js, ",");
        json_num(&js, "batch_with_chats_tok_s", with, 1);
        json_buf_lit(&js, ",");
        json_num(&js, "load_start", load0, 2);
        json_buf_lit(&js, ",");
        json_num(&js, "load_end", load1, 2);
        json_buf_lit(&js, "}}\n");
        int w = write_text(o->json, js.p, js.len, err, errlen);
        json_buf_free(&js);
        if (w) goto out;
    }
    rc = 0;
out:
    if (bid[0]) { /* the job is not wanted past the measurement */
        char path[200], e2[256];
        struct json_buf cb;
        snprintf(path, sizeof path, "/v1/batches/%s/cancel", bid);
        http_json(&o->t, "POST", path, NULL, &cb, e2, sizeof e2);
        json_buf_free(&cb);
    }
    json_buf_free(&jl);
    free(tt_idle);
    free(tt_busy);
    free(it_idle);
    free(it_busy);
    return rc;
}

/* The first model /v1/models lists, copied into out. */
static int first_model(const struct hc_target *t, char *out, size_t cap, char *err, size_t errlen)
{
    struct json_buf b;
    int st = http_json(t, "GET", "/v1/models", NULL, &b, err, errlen);
    int rc = -1;
    if (st < 0) goto done;
    if (st < 200 || st > 299) {
        char msg[400];
        hc_error_text(b.p ? b.p : "", b.len, msg, sizeof msg);
        snprintf(err, errlen, "the server replied HTTP %d to /v1/models%s%s", st, msg[0] ? ": " : "", msg);
        goto done;
    }
    json_doc d;
    char e[64];
    if (!b.len || json_parse(&d, b.p, b.len, e, sizeof e)) {
        snprintf(err, errlen, "/v1/models did not reply with JSON; pass --model");
        goto done;
    }
    int data = json_is_obj(&d, 0) ? json_get(&d, 0, "data") : -1;
    int m0 = data >= 0 && json_is_arr(&d, data) && json_size(&d, data) > 0 ? json_at(&d, data, 0) : -1;
    int id = m0 >= 0 && json_is_obj(&d, m0) ? json_get(&d, m0, "id") : -1;
    if (id >= 0 && json_is_str(&d, id) && json_str(&d, id, out, cap) >= 0) rc = 0;
    else snprintf(err, errlen, "/v1/models lists no model; pass --model");
    json_free(&d);
done:
    json_buf_free(&b);
    return rc;
}

/* Warms the server up and learns how to size prompts: /tokenize when the
 * server has it, else a linear fit of two warm-up requests' usage. */
static int warm_up(const struct bench_opts *o, struct sizer *sz, const char *model, char *err, size_t errlen)
{
    char *p = build_prompt(sz, "warm-up", 0, 400);
    if (!p) return -1;
    char terr[256] = "";
    int n = tokenize_count(o, sz, model, p, terr, sizeof terr);
    if (n == -2) {
        snprintf(err, errlen, "%s", terr);
        free(p);
        return -1;
    }
    sz->have_tokenize = n > 0;
    sz->chars_per_tok = 4.0;
    /* the load mode's longest prompt is 1.5 x --prompt-tokens */
    long longest = o->concurrency ? o->prompt_tokens / 2 + o->prompt_tokens : o->prompt_tokens;
    if (sz->have_tokenize && sz->max_model_len && longest + o->max_tokens > sz->max_model_len) {
        snprintf(err, errlen, "a %ld-token prompt + --max-tokens %ld is more than the server's max_model_len %d",
                 longest, o->max_tokens, sz->max_model_len);
        free(p);
        return -1;
    }
    if (!sz->have_tokenize)
        fprintf(stderr, "note: no usable /tokenize on the server (%s); sizing prompts from the warm-up's usage\n",
                terr[0] ? terr : "no token count in the reply");
    long wt = o->max_tokens < 8 ? o->max_tokens : 8;
    struct run_result r;
    int rc = chat_stream(o, model, p, wt, &r, err, errlen);
    free(r.itl);
    free(p);
    if (rc) return -1;
    fprintf(stderr, "warm-up: p_tok %d, c_tok %d, TTFT %.3f s, total %.3f s\n", r.p_tok, r.c_tok, r.ttft, r.total);
    if (!sz->have_tokenize) {
        int p1 = r.p_tok;
        p = build_prompt(sz, "warm-up-2", 0, 4000);
        if (!p) return -1;
        rc = chat_stream(o, model, p, wt, &r, err, errlen);
        free(r.itl);
        free(p);
        if (rc) return -1;
        /* tokens ~ a + b * corpus chars, the header's tokens folded into a */
        sz->b = r.p_tok > p1 ? (double)(r.p_tok - p1) / 3600.0 : 0.25;
        sz->a = p1 - sz->b * 400;
    }
    return 0;
}

int api_cmd_bench(int argc, char **argv)
{
    struct bench_opts o = {
        .t = {.timeout = 600, .agent = "sluice-bench"},
        .prompt_tokens = API_FLAG_UNSET, .max_tokens = API_FLAG_UNSET, .runs = 5, .num_prompts = 0, .seed = 42,
        .ignore_eos = true, .batch_lines = 400, .chats = 20, .chat_max_tokens = 32, .window = 30,
    };
    const char *url = "http://127.0.0.1:8000";
    double timeout = 600;
    const struct api_flag flags[] = {
        {"--url", API_FLAG_STR, &url, "server address (http://127.0.0.1:8000; a trailing /v1 is fine)", NULL},
        {"--model", API_FLAG_STR, &o.model, "model name to send (default: the first of /v1/models)", NULL},
        {"--api-key", API_FLAG_STR, &o.t.api_key, "sent as 'Authorization: Bearer KEY'", NULL},
        {"--prompt-tokens", API_FLAG_INT, &o.prompt_tokens, "prompt length in tokens (14600; --beside-batch: 700)", NULL},
        {"--max-tokens", API_FLAG_INT, &o.max_tokens, "completion tokens per request (256; --beside-batch: 64)", NULL},
        {"--runs", API_FLAG_INT, &o.runs, "cache-bust runs, then as many cache-hit runs (5)", NULL},
        {"--concurrency", API_FLAG_INT, &o.concurrency, "load mode: this many streams at once (0 = table mode)", NULL},
        {"--num-prompts", API_FLAG_INT, &o.num_prompts, "load mode: distinct prompts sent (4 x concurrency)", NULL},
        {"--seed", API_FLAG_INT, &o.seed, "load mode: seed of the prompt lengths (42)", NULL},
        {"--ignore-eos", API_FLAG_BOOL, &o.ignore_eos, "ask for exactly --max-tokens (ignore_eos; on)", "--no-ignore-eos"},
        {"--beside-batch", API_FLAG_BOOL, &o.beside,
         "chat beside a batch: one-word streamed chats idle, then beside a Batch API job of --batch-lines documents "
         "(--prompt-tokens, --max-tokens); chat TTFT/ITL idle vs beside, batch tok/s alone vs with chats", NULL},
        {"--batch-lines", API_FLAG_INT, &o.batch_lines, "--beside-batch: documents in the batch (400)", NULL},
        {"--chats", API_FLAG_INT, &o.chats, "--beside-batch: chats one after another, idle and beside (20)", NULL},
        {"--chat-max-tokens", API_FLAG_INT, &o.chat_max_tokens, "--beside-batch: tokens per chat answer (32)", NULL},
        {"--window", API_FLAG_FLOAT, &o.window, "--beside-batch: seconds the batch runs alone, before and after (30)", NULL},
        {"--corpus", API_FLAG_STR, &o.corpus, "text file or folder of *.txt for prompts (tools/bench/corpus)", NULL},
        {"--timeout", API_FLAG_FLOAT, &timeout, "seconds without a byte from the server before failing (600)", NULL},
        {"--csv", API_FLAG_STR, &o.csv, "also write the table as CSV", NULL},
        {"--json", API_FLAG_STR, &o.json, "also write the results as JSON", NULL},
        {"--plot", API_FLAG_STR, &o.plot, "draw TTFT and tg tok/s per run into a PNG (needs gnuplot)", NULL},
        {0},
    };
    char err[1024];
    int flags_rc;
    int np = api_cmd_flags("bench", "usage: sluice bench --url http://HOST:PORT [--model NAME] [--api-key K] [--prompt-tokens 14600]\n"
                      "                    [--max-tokens 256] [--runs 5] [--concurrency N] [--csv F] [--json F] [--plot F.png]\n\n"
                      "Streams /v1/chat/completions on any OpenAI-compatible server: a warm-up, --runs cache-bust\n"
                      "runs (the first tokens differ per run), then --runs cache-hit runs (the last prompt again).\n"
                      "Prints run, cache, pp tok/s, tg tok/s, e2e tok/s, TTFT s, total s, p_tok, c_tok (tab-separated)\n"
                      "and the averages per cache kind. --concurrency N reports throughput and latency percentiles.\n\n", argc, argv, 2, flags, NULL, 0, &flags_rc);
    if (np < 0) return flags_rc;
    if (o.prompt_tokens == API_FLAG_UNSET) o.prompt_tokens = o.beside ? 700 : 14600;
    if (o.max_tokens == API_FLAG_UNSET) o.max_tokens = o.beside ? 64 : 256;
    if (o.beside && (o.concurrency || o.batch_lines < 1 || o.batch_lines > 100000 || o.chats < 1 || o.chats > 10000 ||
                     o.chat_max_tokens < 1 || o.chat_max_tokens > 4096 || !(o.window > 0 && o.window <= 3600))) {
        fprintf(stderr, "sluice bench: --beside-batch takes no --concurrency; --batch-lines 1..100000, --chats "
                        "1..10000, --chat-max-tokens 1..4096, --window above 0, at most 3600\n");
        return 2;
    }
    if (o.prompt_tokens < 16 || o.max_tokens < 1 || o.runs < 1 || o.runs > 10000 || o.concurrency < 0 ||
        o.concurrency > 4096 || o.num_prompts < 0 || timeout <= 0) {
        fprintf(stderr, "sluice bench: a flag is out of range (--prompt-tokens >= 16, --max-tokens >= 1, "
                        "--runs 1..10000, --concurrency 0..4096, --timeout > 0)\n");
        return 2;
    }
    if (o.concurrency && !o.num_prompts) o.num_prompts = 4 * o.concurrency;
    if (o.num_prompts > 100000) {
        fprintf(stderr, "sluice bench: --num-prompts is at most 100000\n");
        return 2;
    }
    o.t.timeout = timeout;
    if (hc_parse_url(&o.t, url, err, sizeof err)) {
        fprintf(stderr, "sluice bench: %s\n", err);
        return 2;
    }
    if (o.plot && !have_gnuplot()) {
        fprintf(stderr, "sluice bench: --plot needs gnuplot, which is not installed "
                        "(apt-get install gnuplot-nox, or run tools/setup.sh)\n");
        return 2;
    }
    signal(SIGPIPE, SIG_IGN);
    struct sizer sz = {0};
    char cbuf[4200];
    const char *corpus = o.corpus ? o.corpus : default_corpus(cbuf, sizeof cbuf);
    if (load_corpus(&sz, corpus, err, sizeof err)) {
        fprintf(stderr, "sluice bench: %s\n", err);
        return 2;
    }
    char model[512];
    int rc = 1;
    if (o.model) snprintf(model, sizeof model, "%s", o.model);
    else if (first_model(&o.t, model, sizeof model, err, sizeof err)) goto fail;
    fprintf(stderr, "sluice bench: http://%s:%s%s, model %s, %ld prompt tokens, %ld max tokens\n", o.t.host, o.t.port,
            o.t.prefix, model, o.prompt_tokens, o.max_tokens);
    if (warm_up(&o, &sz, model, err, sizeof err)) goto fail;
    if (o.beside ? run_beside(&o, &sz, model, err, sizeof err)
        : o.concurrency ? run_load(&o, &sz, model, err, sizeof err)
                        : run_table(&o, &sz, model, err, sizeof err))
        goto fail;
    free(sz.text);
    return 0;
fail:
    fprintf(stderr, "sluice bench: %s\n", err);
    free(sz.text);
    return rc;
}

/* cmd_batch.c - `sluice batch`: the command-line client of the Batch API of a
 * running server (sluice serve, or any OpenAI-compatible one).
 *
 *   sluice batch submit FILE.jsonl [--wait]   upload, create the batch, print its id;
 *                                             --wait: progress on stderr until it
 *                                             ends, then FILE.output.jsonl (and
 *                                             FILE.errors.jsonl) next to the input
 *   sluice batch status ID | list | cancel ID | results ID -o FILE
 *
 * The HTTP client is api/http_client.c (shared with `sluice bench`): one
 * request per connection; uploads are streamed from the file (never read
 * whole into memory) and downloads streamed to the output file. Runs on the
 * main thread only.
 */
#include <errno.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>
#include <sys/time.h>
#include <time.h>
#include <unistd.h>

#include "api.h"
#include "api/http_client.h"
#include "base/json.h"

#define IO_TIMEOUT_S 300

/* ---- requests ------------------------------------------------------------------------------ */

/* The error message of an OpenAI-shaped error body, or the body itself. */
static void describe_error(int status, const struct json_buf *body, char *err, size_t errlen)
{
    char msg[600];
    hc_error_text(body->p ? body->p : "", body->len, msg, sizeof msg);
    snprintf(err, errlen, "the server answered %d: %s", status, msg[0] ? msg : "(no message)");
}

/* A JSON request whose 2xx response body is parsed into *d (body kept in
 * *buf, which the caller frees with d). Returns 0 or -1 with a message. */
static int call_json(const struct hc_target *c, const char *method, const char *path, const char *json,
                     struct json_buf *buf, json_doc *d, char *err, size_t errlen)
{
    int st = hc_json(c, method, path, json, json ? strlen(json) : 0, buf, err, errlen);
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

/* Uploads path with purpose=batch, streaming the file. Writes the new file
 * id into id_out. */
static int upload(const struct hc_target *c, const char *path, char *id_out, size_t idcap, char *err, size_t errlen)
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
    int rc = hc_upload_batch_file(c, base, NULL, 0, f, (int64_t)sb.st_size, id_out, idcap, err, errlen);
    fclose(f);
    return rc;
}

static int file_sink(void *ctx, const char *p, size_t n)
{
    return fwrite(p, 1, n, ctx) == n ? 0 : -1;
}

/* Downloads a file's content to out_path (written to a temp name, then renamed). */
static int download(const struct hc_target *c, const char *file_id, const char *out_path, char *err, size_t errlen)
{
    char tmp[4200], path[160];
    snprintf(tmp, sizeof tmp, "%s.part", out_path);
    snprintf(path, sizeof path, "/v1/files/%s/content", file_id);
    FILE *f = fopen(tmp, "wb");
    if (!f) {
        snprintf(err, errlen, "cannot write %.512s: %s", tmp, strerror(errno));
        return -1;
    }
    int st = 0;
    int rc = hc_request(c, "GET", path, NULL, file_sink, f, &st, err, errlen);
    bool bad = fclose(f) != 0 || rc != 0;
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

static int get_batch(const struct hc_target *c, const char *id, struct batch_view *v, char *err, size_t errlen)
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
static int wait_batch(const struct hc_target *c, const char *id, double interval, struct batch_view *v, char *err,
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

static int cmd_submit(const struct hc_target *c, const char *file, bool wait, const char *endpoint, const char *window,
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

static int cmd_status(const struct hc_target *c, const char *id, bool raw)
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

static int cmd_list(const struct hc_target *c, long limit, const char *after, bool all)
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

static int cmd_cancel(const struct hc_target *c, const char *id)
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

static int cmd_results(const struct hc_target *c, const char *id, const char *out, const char *errors_out)
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
    struct hc_target c = {.api_key = key && *key ? key : NULL, .agent = "sluice-batch", .timeout = IO_TIMEOUT_S};
    if (hc_parse_url(&c, url, err, sizeof err)) {
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

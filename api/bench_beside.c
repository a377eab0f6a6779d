/* bench_beside.c - `sluice bench --beside-batch`: chats beside a Batch API
 * job (see the mode's description at the top of cmd_bench.c).
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

/* ---- chat beside a batch (--beside-batch) ---- */

/* The engine's token counters from /metrics: prompt tokens computed plus
 * decode tokens (every sluice has these two). -1 on failure. */
static double engine_tokens(const struct hc_target *t, char *err, size_t errlen)
{
    struct json_buf b;
    int st = bench_http_json(t, "GET", "/metrics", NULL, &b, err, errlen);
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
    int st = bench_http_json(&o->t, "POST", "/v1/batches", &body, &out, err, errlen), rc = -1;
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
        if (bench_chat_stream(o, model, words[i % 10], o->chat_max_tokens, &r, err, errlen)) return -1;
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
    double a = engine_tokens(&o->t, err, errlen), t0 = bench_now();
    if (a < 0) return -1;
    struct timespec ts = {(time_t)window, (long)((window - (time_t)window) * 1e9)};
    nanosleep(&ts, NULL);
    double b = engine_tokens(&o->t, err, errlen);
    return b < 0 ? -1 : (b - a) / (bench_now() - t0);
}

/* Streamed one-word chats with the engine idle, then a Batch API job of
 * --batch-lines documents of ~--prompt-tokens tokens; once it runs, its
 * throughput alone for --window seconds, the same chats beside it, and its
 * throughput alone again (the batch's own mix drifts: the mean of the two
 * windows is the baseline); the batch is cancelled at the end. */
int bench_run_beside(const struct bench_opts *o, struct sizer *sz, const char *model, char *err, size_t errlen)
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
    char *doc = bench_size_prompt(o, sz, model, "doc-0", 0, o->prompt_tokens, &expect, err, errlen);
    if (!doc) goto out;
    size_t nchars = strlen(doc) > 64 ? strlen(doc) - 64 : strlen(doc);
    free(doc);
    for (long i = 0; i < o->batch_lines; i++) {
        char tag[32];
        snprintf(tag, sizeof tag, "doc-%ld", i);
        char *p = bench_build_prompt(sz, tag, sz->len / (size_t)o->batch_lines * (size_t)i, nchars);
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
    double a = engine_tokens(&o->t, err, errlen), t0 = bench_now();
    if (a < 0 || chat_series(o, model, tt_busy, it_busy, cap, &ni_busy, &tok_busy, err, errlen)) goto out;
    double b = engine_tokens(&o->t, err, errlen), span = bench_now() - t0;
    if (b < 0) goto out;
    double with = (b - a - tok_busy) / span;
    double alone2 = batch_rate(o, o->window, err, errlen);
    if (alone2 < 0) goto out;
    double load1 = load_avg(), alone = (alone1 + alone2) / 2;
    qsort(tt_idle, (size_t)n, sizeof(double), bench_cmp_double);
    qsort(tt_busy, (size_t)n, sizeof(double), bench_cmp_double);
    qsort(it_idle, (size_t)ni_idle, sizeof(double), bench_cmp_double);
    qsort(it_busy, (size_t)ni_busy, sizeof(double), bench_cmp_double);
    struct { const char *name, *key; double idle, busy; int prec; } m[] = {
        {"chat TTFT p50 ms", "ttft_p50_ms", bench_quantile(tt_idle, n, 0.5), bench_quantile(tt_busy, n, 0.5), 1},
        {"chat TTFT max ms", "ttft_max_ms", tt_idle[n - 1], tt_busy[n - 1], 1},
        {"chat ITL p50 ms", "itl_p50_ms", bench_quantile(it_idle, ni_idle, 0.5), bench_quantile(it_busy, ni_busy, 0.5), 2},
        {"chat ITL p90 ms", "itl_p90_ms", bench_quantile(it_idle, ni_idle, 0.9), bench_quantile(it_busy, ni_busy, 0.9), 2},
        {"chat ITL max ms", "itl_max_ms", ni_idle ? it_idle[ni_idle - 1] : NAN, ni_busy ? it_busy[ni_busy - 1] : NAN, 2},
    };
    printf("metric\tidle\tbeside batch\n");
    for (size_t k = 0; k < sizeof m / sizeof m[0]; k++) {
        printf("%s\t", m[k].name);
        bench_put_num(stdout, m[k].idle, m[k].prec);
        putchar('\t');
        bench_put_num(stdout, m[k].busy, m[k].prec);
        putchar('\n');
    }
    printf("batch tok/s\t%.1f alone (%.1f before, %.1f after)\t%.1f with chats (%.0f%%)\n", alone, alone1, alone2, with,
           alone > 0 ? 100.0 * with / alone : NAN);
    printf("load average\t%.2f at start\t%.2f at end\n", load0, load1);
    fflush(stdout);
    if (o->json) {
        struct json_buf js;
        json_buf_init(&js);
        bench_json_head(&js, o, model, sz, "beside-batch");
        json_buf_addf(&js, "\"batch_lines\":%ld,\"chats\":%ld,\"chat_max_tokens\":%ld,\"window_s\":%g,\"summary\":{",
                      o->batch_lines, o->chats, o->chat_max_tokens, o->window);
        for (size_t k = 0; k < sizeof m / sizeof m[0]; k++) {
            char key[64];
            snprintf(key, sizeof key, "idle_%s", m[k].key);
            bench_json_num(&js, key, m[k].idle, m[k].prec);
            json_buf_lit(&js, ",");
            snprintf(key, sizeof key, "batch_%s", m[k].key);
            bench_json_num(&js, key, m[k].busy, m[k].prec);
            json_buf_lit(&js, ",");
        }
        bench_json_num(&js, "batch_alone_tok_s", alone, 1);
        json_buf_lit(&js, ",");
        bench_json_num(&js, "batch_with_chats_tok_s", with, 1);
        json_buf_lit(&js, ",");
        bench_json_num(&js, "load_start", load0, 2);
        json_buf_lit(&js, ",");
        bench_json_num(&js, "load_end", load1, 2);
        json_buf_lit(&js, "}}\n");
        int w = bench_write_text(o->json, js.p, js.len, err, errlen);
        json_buf_free(&js);
        if (w) goto out;
    }
    rc = 0;
out:
    if (bid[0]) { /* the job is not wanted past the measurement */
        char path[200], e2[256];
        struct json_buf cb;
        snprintf(path, sizeof path, "/v1/batches/%s/cancel", bid);
        bench_http_json(&o->t, "POST", path, NULL, &cb, e2, sizeof e2);
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

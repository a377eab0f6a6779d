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
 *
 * This file: the flags, the table and load modes, the warm-up. The request
 * and the prompts are in bench_request.c, the outputs in bench_report.c, the
 * beside-batch mode in bench_beside.c; what they share is in bench.h.
 */
#include <dirent.h>
#include <errno.h>
#include <fcntl.h>
#include <math.h>
#include <pthread.h>
#include <signal.h>
#include <stdatomic.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>
#include <sys/time.h>
#include <time.h>
#include <unistd.h>

#include "api.h"
#include "api/bench.h"
#include "base/json.h"

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
        if (bench_write_text(o->json, js->p, js->len, err, errlen)) return -1;
    }
    if (o->plot) {
        char title[400];
        snprintf(title, sizeof title, "sluice bench: %s, %ld prompt tokens, %ld max tokens (%s)", model,
                 o->prompt_tokens, o->max_tokens, o->concurrency ? "load" : "cache bust vs hit");
        for (char *c = title; *c; c++)
            if (*c == '\'' || *c == '\\') *c = ' ';
        if (bench_plot_png(o->plot, title, rows, n, err, errlen)) return -1;
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
    uint64_t seed = (uint64_t)time(NULL) ^ ((uint64_t)getpid() << 32) ^ (uint64_t)(bench_now() * 1e9);
    unsigned nonce = (unsigned)splitmix(&seed);
    struct bench_spec sp0, sp1;
    bench_spec_read(&o->t, &sp0);
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
            prompt = bench_size_prompt(o, sz, model, tag, sz->len / (size_t)o->runs * (size_t)i, o->prompt_tokens, &expect,
                                       err, errlen);
            if (!prompt) goto out;
        }
        if (bench_chat_stream(o, model, prompt, o->max_tokens, &rows[i].r, err, errlen)) goto out;
        const struct run_result *r = &rows[i].r;
        fprintf(stderr, "run %d (%s): p_tok %d, c_tok %d, cached %d, TTFT %.3f s, total %.3f s\n", i + 1,
                rows[i].cache, r->p_tok, r->c_tok, r->cached, r->ttft, r->total);
        if (expect >= 0 && r->p_tok != expect)
            fprintf(stderr, "note: /tokenize counted %d prompt tokens, the reply's usage says %d\n", expect, r->p_tok);
    }
    bench_print_table(stdout, '\t', rows, n);
    fflush(stdout);
    bench_spec_read(&o->t, &sp1);
    if (o->csv) {
        FILE *f = fopen(o->csv, "w");
        if (!f) {
            snprintf(err, errlen, "cannot write %s: %s", o->csv, strerror(errno));
            goto out;
        }
        bench_print_table(f, ',', rows, n);
        if (fclose(f)) {
            snprintf(err, errlen, "cannot write %s", o->csv);
            goto out;
        }
    }
    struct json_buf js;
    json_buf_init(&js);
    if (o->json) {
        bench_json_head(&js, o, model, sz, "table");
        bench_json_rows(&js, rows, n);
        json_buf_lit(&js, ",\"averages\":{");
        static const char *kinds[] = {"bust", "hit"};
        for (int k = 0; k < 2; k++) {
            double v[7];
            bench_avg_vals(rows, n, kinds[k], v);
            json_buf_addf(&js, "%s\"%s\":{", k ? "," : "", kinds[k]);
            bench_json_vals(&js, v);
            json_buf_lit(&js, "}");
        }
        json_buf_lit(&js, "}");
    }
    bench_spec_report(&sp0, &sp1, o->json ? &js : NULL);
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
        if (bench_chat_stream(j->o, j->model, j->prompts[i], j->o->max_tokens, &j->rows[i].r, j->errs[i], sizeof j->errs[i]))
            j->rows[i].r.c_tok = -1;
    }
    return NULL;
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
        j.prompts[i] = bench_size_prompt(o, sz, model, tag, sz->len / (size_t)n * (size_t)i, want, &expect, err, errlen);
        if (!j.prompts[i]) goto out;
        j.rows[i].run = i + 1;
        j.rows[i].cache = "load";
    }
    fprintf(stderr, "sending %d requests, %ld at a time\n", n, o->concurrency);
    struct bench_spec sp0, sp1;
    bench_spec_read(&o->t, &sp0);
    double t0 = bench_now();
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
    double wall = bench_now() - t0;
    bench_spec_read(&o->t, &sp1);

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
    qsort(ttft, (size_t)ok, sizeof *ttft, bench_cmp_double);
    qsort(itl, (size_t)n_itl, sizeof *itl, bench_cmp_double);
    struct { const char *name, *key; double v; int prec; } m[] = {
        {"requests", "requests", n, 0},
        {"concurrency", "concurrency", (double)o->concurrency, 0},
        {"wall s", "wall_s", wall, 3},
        {"req/s", "req_s", n / wall, 3},
        {"output tok/s", "output_tok_s", out_tok / wall, 1},
        {"prompt tok/s", "prompt_tok_s", in_tok / wall, 1},
        {"mean p_tok", "mean_p_tok", (double)in_tok / n, 1},
        {"mean c_tok", "mean_c_tok", (double)out_tok / n, 1},
        {"TTFT p50 s", "ttft_p50_s", bench_quantile(ttft, ok, 0.50), 3},
        {"TTFT p90 s", "ttft_p90_s", bench_quantile(ttft, ok, 0.90), 3},
        {"TTFT p99 s", "ttft_p99_s", bench_quantile(ttft, ok, 0.99), 3},
        {"ITL p50 ms", "itl_p50_ms", bench_quantile(itl, n_itl, 0.50), 2},
        {"ITL p90 ms", "itl_p90_ms", bench_quantile(itl, n_itl, 0.90), 2},
        {"ITL p99 ms", "itl_p99_ms", bench_quantile(itl, n_itl, 0.99), 2},
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
        bench_put_num(stdout, m[k].v, m[k].prec);
        putchar('\n');
        if (csv) {
            fprintf(csv, "%s,", m[k].name);
            bench_put_num(csv, m[k].v, m[k].prec);
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
        bench_json_head(&js, o, model, sz, "load");
        json_buf_addf(&js, "\"seed\":%ld,\"summary\":{", o->seed);
        for (int k = 0; k < nm; k++) {
            if (k) json_buf_lit(&js, ",");
            bench_json_num(&js, m[k].key, m[k].v, m[k].prec);
        }
        json_buf_lit(&js, "},");
        bench_json_rows(&js, j.rows, n);
    }
    bench_spec_report(&sp0, &sp1, o->json ? &js : NULL);
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

static int first_model(const struct hc_target *t, char *out, size_t cap, char *err, size_t errlen)
{
    struct json_buf b;
    int st = bench_http_json(t, "GET", "/v1/models", NULL, &b, err, errlen);
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
    char *p = bench_build_prompt(sz, "warm-up", 0, 400);
    if (!p) return -1;
    char terr[256] = "";
    int n = bench_tokenize_count(o, sz, model, p, terr, sizeof terr);
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
    int rc = bench_chat_stream(o, model, p, wt, &r, err, errlen);
    free(r.itl);
    free(p);
    if (rc) return -1;
    fprintf(stderr, "warm-up: p_tok %d, c_tok %d, TTFT %.3f s, total %.3f s\n", r.p_tok, r.c_tok, r.ttft, r.total);
    if (!sz->have_tokenize) {
        int p1 = r.p_tok;
        p = bench_build_prompt(sz, "warm-up-2", 0, 4000);
        if (!p) return -1;
        rc = bench_chat_stream(o, model, p, wt, &r, err, errlen);
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
    if (o.plot && !bench_have_gnuplot()) {
        fprintf(stderr, "sluice bench: --plot needs gnuplot, which is not installed "
                        "(apt-get install gnuplot-nox, or run tools/setup.sh)\n");
        return 2;
    }
    signal(SIGPIPE, SIG_IGN);
    struct sizer sz = {0};
    char cbuf[4200];
    const char *corpus = o.corpus ? o.corpus : bench_default_corpus(cbuf, sizeof cbuf);
    if (bench_load_corpus(&sz, corpus, err, sizeof err)) {
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
    if (o.beside ? bench_run_beside(&o, &sz, model, err, sizeof err)
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

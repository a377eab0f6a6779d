/* bench.h - shared by the files of `sluice bench` (used inside api/ only):
 * cmd_bench.c (flags, table and load modes), bench_request.c (the streamed
 * chat request, the corpus and prompts sized to a token count),
 * bench_report.c (the table, CSV, JSON, plot and statistics) and
 * bench_beside.c (chat beside a batch).
 */
#ifndef SLUICE_API_BENCH_H
#define SLUICE_API_BENCH_H

#include <stdbool.h>
#include <stddef.h>
#include <stdio.h>

#include "api/http_client.h"
#include "base/json.h"

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

/* One row of the table: a run and its cache kind. */
struct row {
    int run;
    const char *cache;       /* "bust", "hit", "load" */
    struct run_result r;
};

/* ---- requests (bench_request.c) ---- */

double bench_now(void);   /* monotonic seconds */
/* POST/GET with a JSON reply collected into out (caller frees). Returns the
 * HTTP status, or -1 on a connection error (err set). */
int bench_http_json(const struct hc_target *t, const char *method, const char *path, const struct json_buf *body,
                    struct json_buf *out, char *err, size_t errlen);
/* Sends one streamed chat request with user content prompt. Fills r (the
 * caller frees r->itl). Returns 0, or -1 with a message in err: no
 * connection, a non-2xx status, an error in the stream, a stream that ends
 * before [DONE], or no usage. Thread-safe. */
int bench_chat_stream(const struct bench_opts *o, const char *model, const char *prompt, long max_tokens,
                      struct run_result *r, char *err, size_t errlen);
/* Loads path (a file, or every *.txt of a folder in name order) into sz->text. */
int bench_load_corpus(struct sizer *sz, const char *path, char *err, size_t errlen);
/* The default corpus: tools/bench/corpus next to the binary's checkout, else
 * under the working directory. */
const char *bench_default_corpus(char *buf, size_t cap);
/* A user message: a tag that makes its first tokens unique, an instruction,
 * then nchars bytes of the corpus from offset (snapped to a line start,
 * wrapping around, cut at a UTF-8 boundary). Returns a malloc'ed string. */
char *bench_build_prompt(const struct sizer *sz, const char *tag, size_t offset, size_t nchars);
/* Prompt tokens of a chat with this user message, by /tokenize. Returns the
 * count, -1 when the server has no usable /tokenize, -2 on a connection error. */
int bench_tokenize_count(const struct bench_opts *o, struct sizer *sz, const char *model, const char *prompt,
                         char *err, size_t errlen);
/* A prompt of about target tokens (exactly, when /tokenize is there and the
 * text allows it). Returns a malloc'ed prompt and its expected token count in
 * *n_tok (-1 when only estimated), or NULL with err set. */
char *bench_size_prompt(const struct bench_opts *o, struct sizer *sz, const char *model, const char *tag,
                        size_t offset, long target, int *n_tok, char *err, size_t errlen);

/* ---- results (bench_report.c) ---- */

void bench_put_num(FILE *f, double v, int prec);   /* "-" for NaN */
/* The averages of the rows of one cache kind (pp, tg, e2e tok/s, TTFT, total, p_tok, c_tok). */
void bench_avg_vals(const struct row *rows, int n, const char *cache, double v[7]);
/* The table (sep '\t') or CSV (sep ','), with the averages per cache kind. */
void bench_print_table(FILE *f, char sep, const struct row *rows, int n);
/* v with 3 more decimals than the table's column, and at least 7
 * significant digits. */
void bench_json_num(struct json_buf *b, const char *key, double v, int prec);
void bench_json_vals(struct json_buf *b, const double v[7]);
void bench_json_rows(struct json_buf *b, const struct row *rows, int n);
/* Opens the JSON results object: the server, the model, the sizes, the mode. */
void bench_json_head(struct json_buf *b, const struct bench_opts *o, const char *model, const struct sizer *sz,
                     const char *mode);
int bench_write_text(const char *path, const char *text, size_t len, char *err, size_t errlen);
bool bench_have_gnuplot(void);
/* Draws TTFT and tg tok/s per run into a PNG with gnuplot. */
int bench_plot_png(const char *png, const char *title, const struct row *rows, int n, char *err, size_t errlen);
int bench_cmp_double(const void *a, const void *b);   /* qsort order of doubles */
/* q-quantile of sorted v[0..n) with linear interpolation (numpy's default). */
double bench_quantile(const double *v, int n, double q);

/* ---- chat beside a batch (bench_beside.c) ---- */

/* Streamed one-word chats with the engine idle, then a Batch API job of
 * --batch-lines documents; the chats' TTFT and time between chunks idle
 * against beside the batch, and the batch's throughput alone against with
 * the chats (--beside-batch). */
/* Speculative decoding's counters on the server (vLLM's vllm:spec_decode_*_total in /metrics; sluice
 * has them under --speculative-config): have is false when the server shows none. */
#define BENCH_SPEC_POS 8
struct bench_spec {
    bool have;
    double drafts, draft_tokens, accepted, per_pos[BENCH_SPEC_POS];
    int n_pos;
};
void bench_spec_read(const struct hc_target *t, struct bench_spec *s);
/* What the counters moved by from before to after: one line on stdout (drafts, the mean accepted length
 * 1 + accepted / drafts, the acceptance per position), and ,"spec_decode":{...} into js when not NULL.
 * Nothing when either snapshot has no counters. */
void bench_spec_report(const struct bench_spec *before, const struct bench_spec *after, struct json_buf *js);
int bench_run_beside(const struct bench_opts *o, struct sizer *sz, const char *model, char *err, size_t errlen);

#endif

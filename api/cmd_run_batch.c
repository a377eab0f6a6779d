/* cmd_run_batch.c - `sluice run-batch`: the offline runner vLLM users know
 * (`vllm run-batch`). Reads OpenAI batch lines (custom_id, method, url, body)
 * for /v1/chat/completions, /v1/completions and /v1/responses, runs them through the engine
 * (batch priority), and writes one output line per input line, in input
 * order, as soon as the lines before it are done.
 *
 * Memory stays bounded whatever the file's length: input is read as the
 * engine has room (4 x --max-num-seqs requests in flight), into a ring of
 * lines that holds at most the in-flight ones plus those done but waiting for
 * an earlier line to be written, so a million-line file of long documents
 * streams through.
 *
 * A line is checked as the Batch API checks lines when a batch is created
 * (store_check_line): one that is not a request (bad JSON, no custom_id,
 * wrong method or url, "stream": true) gets `"response": null, "error":
 * {code, message}`; a request whose body the server would refuse gets
 * `"response": {"status_code": 400, "body": {"error": ...}}`, as in OpenAI's
 * output files. The others still run. From there on a line lives as a
 * Batch API row does (api/batch_line.c), and its output line has the shape
 * of the Batch API's output files (store_result_line). A file in which
 * two requests share a custom_id is refused whole before anything runs, as
 * OpenAI's validation refuses it (the lines are named); stdin is spooled to
 * an unnamed temporary file for that check.
 */
#include <ctype.h>
#include <errno.h>
#include <math.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>
#include <unistd.h>

#include "api.h"
#include "api/batch_line.h"
#include "base/json.h"
#include "model/backend.h"
#include "model/model.h"
#include "openai.h"
#include "sched/sched.h"
#include "store/store.h"

enum line_state { LINE_TODO, LINE_RUNNING, LINE_DONE };

struct line {
    char *text;                  /* the input line, owned until started */
    enum line_state st;
    char *custom_id;             /* owned, NULL when absent */
    struct bline bl;             /* the request in the engine (batch_line.h); bl.owner: the line */
    char *out;                   /* the rendered output line, owned until written */
};

struct batch {
    model *m;
    const model_tok *tok;
    sched_engine *e;
    sched_sink *sink;            /* the lines' engine events */
    const char *served_name, *model_path;
    const char *names[2];        /* the served name: what a body may name, what replies carry */
    struct bline_env env;
    int max_model_len;
    struct line *lines;          /* ring [cap_lines]: line i lives in lines[i % cap_lines] */
    int cap_lines;
    long n_read, next_submit, next_write; /* lines read, submitted, written (next_write <= next_submit <= n_read) */
    FILE *in;
    bool eof;
    char *rbuf;                  /* getline buffer */
    size_t rcap;
    int in_flight, done, failed;
    FILE *out;
    uint64_t rng;
    long created;
    long gen_tokens, prompt_tokens, cached_tokens;
    double t0, last_progress;
    bool quiet, timings;
};

static double now_s(void)
{
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return (double)ts.tv_sec + ts.tv_nsec * 1e-9;
}

/* ---- output lines ------------------------------------------------------------------ */

/* Renders l's output line: its response (status 0: none) and error, JSON
 * text or NULL. */
static void set_out(struct batch *b, struct line *l, int status, const struct json_buf *body, const char *error)
{
    char id[48] = "batch_req_", rid[32] = "req_";
    bline_rand_hex(&b->rng, id + strlen(id), 24);
    bline_rand_hex(&b->rng, rid + strlen(rid), 24);
    struct json_buf o;
    json_buf_init(&o);
    store_result_line(&o, id, l->custom_id, l->custom_id ? strlen(l->custom_id) : 0, status, rid, strlen(rid),
                      body ? body->p : NULL, body ? body->len : 0, error, error ? strlen(error) : 0);
    if (o.oom || !o.p || (body && body->oom)) {
        json_buf_free(&o);
        l->out = strdup("{\"id\":null,\"custom_id\":null,\"response\":null,"
                        "\"error\":{\"code\":\"internal_error\",\"message\":\"out of memory\"}}");
    } else {
        l->out = o.p; /* ownership passes to the line */
    }
    l->st = LINE_DONE;
    b->done++;
}

/* A line that is not a request: no response, an error {code, message}. */
static void line_error(struct batch *b, struct line *l, const char *code, const char *msg)
{
    struct json_buf e;
    json_buf_init(&e);
    store_error_json(&e, code, msg);
    set_out(b, l, 0, NULL, e.oom ? NULL : e.p);
    json_buf_free(&e);
    b->failed++;
}

/* A request's response: status and body. */
static void line_response(struct batch *b, struct line *l, int status, const struct json_buf *body)
{
    if (status < 200 || status > 299) b->failed++;
    set_out(b, l, status, body, NULL);
}

static void line_release(struct line *l)
{
    free(l->text);
    l->text = NULL;
    bline_free(&l->bl);
}

/* ---- submitting -------------------------------------------------------------------- */

/* Checks line l as batch creation would and submits it; on any error
 * renders its output line. */
static void prepare(struct batch *b, struct line *l)
{
    const char *url, *body;
    size_t blen;
    struct store_line_error le;
    if (store_check_line(l->text, strlen(l->text), NULL, &l->custom_id, &url, &body, &blen, &le)) {
        line_error(b, l, le.code, le.message);
    } else {
        struct api_oai_error e;
        l->bl.owner = l;
        if (bline_start(&l->bl, &b->env, url, body, blen, &e)) {
            struct json_buf eb;
            json_buf_init(&eb);
            bline_error_body(&e, &eb);
            line_response(b, l, e.status, &eb);
            json_buf_free(&eb);
        } else {
            l->st = LINE_RUNNING;
            b->in_flight += l->bl.n;
            b->prompt_tokens += l->bl.n_prompt;
        }
    }
    free(l->text);
    l->text = NULL;
    if (l->st == LINE_DONE) line_release(l);
}

static void on_event(struct batch *b, const struct sched_event *ev)
{
    const struct bline_choice *c = ev->user;
    struct line *l = c->l->owner;
    if (ev->kind == SCHED_EV_TOKEN) {
        b->gen_tokens++;
    } else {
        b->in_flight--;
        if (c->i == 0) b->cached_tokens += ev->usage.cached_tokens;
        if (b->timings) {
            const struct sched_usage *u = &ev->usage;
            fprintf(stderr, "\n[timing] custom_id=%s choice=%d prompt=%d cached=%d completion=%d queue=%.3fs ttft=%.3fs "
                            "prefill=%.3fs total=%.3fs preemptions=%d\n",
                    l->custom_id ? l->custom_id : "-", c->i, u->prompt_tokens, u->cached_tokens, u->completion_tokens,
                    u->queue_s, u->ttft_s, u->ttft_s >= 0 ? u->ttft_s - u->queue_s : -1.0, u->total_s, u->n_preemptions);
        }
    }
    if (!bline_event(&l->bl, &b->env, ev)) return;
    struct json_buf body;
    int status = bline_reply(&l->bl, &b->env, &b->rng, b->created, &body);
    if (status == 0) { /* nothing here stops a line but a choice that could not run, whose error wins */
        struct api_oai_error e;
        api_oai_errorf(&e, 500, NULL, "the engine failed on this request: aborted");
        e.type = "server_error";
        json_buf_free(&body);
        json_buf_init(&body);
        bline_error_body(&e, &body);
        status = 500;
    }
    line_response(b, l, status, &body);
    json_buf_free(&body);
    line_release(l);
}

static struct line *slot(struct batch *b, long i) { return &b->lines[i % b->cap_lines]; }

static int write_ready(struct batch *b)
{
    while (b->next_write < b->n_read && slot(b, b->next_write)->st == LINE_DONE) {
        struct line *l = slot(b, b->next_write++);
        if (fputs(l->out, b->out) == EOF || fputc('\n', b->out) == EOF) return -1;
        free(l->out);
        l->out = NULL;
        free(l->custom_id);
        l->custom_id = NULL;
    }
    return fflush(b->out) == 0 ? 0 : -1;
}

static void progress(struct batch *b, bool last)
{
    double t = now_s();
    if (b->quiet || (!last && t - b->last_progress < 1.0)) return;
    b->last_progress = t;
    double el = t - b->t0;
    fprintf(stderr, "\r[run-batch] %d/%ld%s done, %d failed | %.1f gen tok/s | %ld prompt tok (%ld cached) | %.1f s   ",
            b->done, b->n_read, b->eof ? "" : "+", b->failed, el > 0 ? (double)b->gen_tokens / el : 0.0,
            b->prompt_tokens, b->cached_tokens, el);
    if (last) fputc('\n', stderr);
}

/* Reads the next non-blank input line into the ring. Returns 1 when a line
 * was read, 0 at the end of the input or while the ring is full (every slot
 * holds a line not yet written), -1 on a read error or out of memory. */
static int read_line(struct batch *b)
{
    if (b->eof || b->n_read - b->next_write >= b->cap_lines) return 0;
    ssize_t n;
    while ((n = getline(&b->rbuf, &b->rcap, b->in)) >= 0) {
        char *buf = b->rbuf;
        while (n > 0 && (buf[n - 1] == '\n' || buf[n - 1] == '\r')) buf[--n] = '\0';
        bool blank = true;
        for (ssize_t i = 0; i < n && blank; i++) blank = isspace((unsigned char)buf[i]);
        if (blank) continue;
        struct line *l = slot(b, b->n_read);
        memset(l, 0, sizeof *l);
        l->text = strdup(buf);
        if (!l->text) return -1;
        b->n_read++;
        return 1;
    }
    b->eof = true;
    return ferror(b->in) ? -1 : 0;
}

/* ---- duplicate custom_ids ------------------------------------------------------------ */

/* custom_ids must be unique within a batch file (OpenAI's validation refuses
 * the whole file otherwise), so results can be matched to requests. The
 * check reads the file once before anything runs, keeping 16 bytes a line
 * (a hash of the custom_id and the line number); only lines whose hashes
 * collide are read again to compare the ids themselves. */
struct cid_ref {
    uint64_t key; /* FNV-1a of the custom_id; the exact id in the second pass */
    long line;    /* 1-based, blank lines counted, as an editor shows it */
    char *id;     /* second pass only */
};

static uint64_t fnv1a(const char *s, size_t n)
{
    uint64_t h = 1469598103934665603ULL;
    for (size_t i = 0; i < n; i++) h = (h ^ (unsigned char)s[i]) * 1099511628211ULL;
    return h;
}

static int cmp_key(const void *a, const void *b)
{
    const struct cid_ref *x = a, *y = b;
    if (x->key != y->key) return x->key < y->key ? -1 : 1;
    return x->line < y->line ? -1 : x->line > y->line;
}

static int cmp_id(const void *a, const void *b)
{
    const struct cid_ref *x = a, *y = b;
    int c = strcmp(x->id, y->id);
    return c ? c : x->line < y->line ? -1 : x->line > y->line;
}

static int cmp_line(const void *a, const void *b)
{
    const struct cid_ref *x = a, *y = b;
    return x->line < y->line ? -1 : x->line > y->line;
}

/* The custom_id of a line (malloc'ed), NULL when the line has none. */
static char *line_custom_id(char *text, size_t n)
{
    json_doc d;
    char e[64];
    if (json_parse(&d, text, n, e, sizeof e)) {
        if (d.tok) json_free(&d);
        return NULL;
    }
    char *id = NULL;
    int i = json_is_obj(&d, 0) ? json_get(&d, 0, "custom_id") : -1;
    if (i >= 0 && json_is_str(&d, i)) id = json_strdup(&d, i, NULL);
    json_free(&d);
    return id;
}

/* Reads f from its start and reports every custom_id used by more than one
 * line on stderr, with the lines. Returns the number of duplicated ids (0:
 * none), or -1 on a read error or out of memory (errno says which). f is
 * rewound. */
static long find_duplicate_ids(FILE *f, const char *name)
{
    struct cid_ref *refs = NULL;
    size_t n = 0, cap = 0;
    char *buf = NULL;
    size_t bcap = 0;
    long lineno = 0, dups = 0;
    ssize_t len;
    for (int pass = 0; pass < 2; pass++) {
        rewind(f);
        lineno = 0;
        size_t k = 0; /* pass 1: the next candidate (sorted by line) */
        while ((len = getline(&buf, &bcap, f)) >= 0) {
            lineno++;
            if (pass == 1) {
                if (k == n) break;
                if (refs[k].line != lineno) continue;
            }
            char *id = line_custom_id(buf, (size_t)len);
            if (!id) continue; /* not a request: reported when it runs */
            if (pass == 0) {
                if (n == cap) {
                    cap = cap ? 2 * cap : 1024;
                    void *q = realloc(refs, cap * sizeof *refs);
                    if (!q) {
                        free(id);
                        goto fail;
                    }
                    refs = q;
                }
                refs[n++] = (struct cid_ref){.key = fnv1a(id, strlen(id)), .line = lineno};
                free(id);
            } else {
                refs[k++].id = id;
            }
        }
        if (ferror(f)) goto fail;
        if (pass == 1) break;
        /* keep only the lines whose hash another line shares */
        qsort(refs, n, sizeof *refs, cmp_key);
        size_t m = 0;
        for (size_t i = 0; i < n; i++)
            if ((i > 0 && refs[i - 1].key == refs[i].key) || (i + 1 < n && refs[i + 1].key == refs[i].key))
                refs[m++] = refs[i];
        n = m;
        if (!n) break;
        qsort(refs, n, sizeof *refs, cmp_line);
    }
    if (n) qsort(refs, n, sizeof *refs, cmp_id);
    for (size_t i = 0; i < n;) {
        size_t j = i + 1;
        while (j < n && !strcmp(refs[j].id, refs[i].id)) j++;
        if (j - i > 1) {
            if (dups < 20) {
                fprintf(stderr, "sluice run-batch: %s: the custom_id '%.200s' is used on lines", name, refs[i].id);
                for (size_t t = i; t < j && t < i + 10; t++) fprintf(stderr, "%s %ld", t > i ? "," : "", refs[t].line);
                fprintf(stderr, "%s\n", j - i > 10 ? ", ..." : "");
            }
            dups++;
        }
        i = j;
    }
    if (dups > 20) fprintf(stderr, "sluice run-batch: ... and %ld more duplicated custom_ids\n", dups - 20);
    for (size_t i = 0; i < n; i++) free(refs[i].id);
    free(refs);
    free(buf);
    rewind(f);
    return dups;
fail:
    for (size_t i = 0; refs && i < n; i++) free(refs[i].id);
    free(refs);
    free(buf);
    return -1;
}

/* stdin copied into an unnamed temporary file, so it can be read twice. */
static FILE *spool_stdin(void)
{
    FILE *t = tmpfile();
    if (!t) return NULL;
    char chunk[65536];
    size_t k;
    while ((k = fread(chunk, 1, sizeof chunk, stdin)) > 0)
        if (fwrite(chunk, 1, k, t) != k) break;
    if (ferror(stdin) || ferror(t) || fflush(t)) {
        fclose(t);
        return NULL;
    }
    rewind(t);
    return t;
}

static const char USAGE[] =
    "usage: sluice run-batch --model PATH -i INPUT.jsonl -o OUTPUT.jsonl [flags]\n"
    "  Runs an OpenAI batch file (/v1/chat/completions, /v1/completions, /v1/responses lines) through the\n"
    "  continuous-batching engine; writes one output line per input line, in input order.\n"
    "  -i/-o are short for --input/--output; '-' means stdin/stdout.\n\n";

int api_cmd_run_batch(int argc, char **argv)
{
    const char *chat_template = NULL, *model_path = NULL, *in_path = NULL, *out_path = NULL, *served = NULL, *kv_mem = NULL,
               *device = NULL, *load_format = NULL, *tok_path = NULL, *kv_dtype = NULL, *spec_json = NULL;
    /* not given: vLLM's sizes for the device, the model's length, 0.9 */
    long max_num_seqs = API_FLAG_UNSET, max_batched = API_FLAG_UNSET, max_model_len = API_FLAG_UNSET;
    long block_size = 16, mamba_block = 0, threads = 0, tp = 1, long_prefill = 0, partial = 1, long_partial = 1;
    double gpu_util = NAN;
    struct api_sched_flags sf; /* the same scheduler policy as serve's */
    api_sched_flags_init(&sf);
    bool prefix = true, quiet = false, timings = false, eager = false, check_weights = false;
    const struct api_flag flags[] = {
        {"--model", API_FLAG_STR, &model_path, "GGUF file or HF checkpoint directory", NULL},
        {"--tokenizer", API_FLAG_STR, &tok_path, "take the tokenizer from another model", NULL},
        {"--input", API_FLAG_STR, &in_path, "input JSONL file (-i)", NULL},
        {"--output", API_FLAG_STR, &out_path, "output JSONL file (-o)", NULL},
        {"--served-model-name", API_FLAG_STR, &served, "the model name requests use and responses report (--model)", NULL},
        {"--chat-template", API_FLAG_STR, &chat_template, "Jinja chat template file (or text) instead of the model's own", NULL},
        {"--max-num-seqs", API_FLAG_INT, &max_num_seqs, "sequences running at once (GPU 256, CPU 64)", NULL},
        {"--max-num-batched-tokens", API_FLAG_HUMAN_INT, &max_batched, "tokens per step, e.g. 8k (GPU 8192, CPU 1024)", NULL},
        {"--max-model-len", API_FLAG_HUMAN_INT, &max_model_len,
         "prompt + completion tokens at most, e.g. 32k (32000) or 32K (32768); the model's, <= 8192", NULL},
        {"--enable-prefix-caching", API_FLAG_BOOL, &prefix, "reuse the KV of shared prompt prefixes (on)",
         "--no-enable-prefix-caching"},
        {"--block-size", API_FLAG_INT, &block_size, "KV block size in tokens (16)", NULL},
        {"--mamba-block-size", API_FLAG_INT, &mamba_block,
         "linear-attention models: a prefix-cache state snapshot every N tokens (0: auto)", NULL},
        {"--kv-cache-memory", API_FLAG_STR, &kv_mem,
         "KV cache size, bytes with K/M/G suffix (CPU: 2G; GPU: from --gpu-memory-utilization)", NULL},
        {"--gpu-memory-utilization", API_FLAG_FLOAT, &gpu_util, "GPU memory fraction for weights + KV (0.9)", NULL},
        {"--kv-cache-dtype", API_FLAG_STR, &kv_dtype, "auto, or fp8 (= fp8_e4m3; GPU): half the KV bytes", NULL},
        {"--enforce-eager", API_FLAG_BOOL, &eager, "no CUDA graphs: decode steps launch kernels one by one (slower)", NULL},
        {"--speculative-config", API_FLAG_STR, &spec_json,
         "JSON, as serve's: ngram or mtp drafts verified in the batched step (mtp: CPU, or CUDA on one GPU; models "
         "with KDA layers: ngram on the CPU backend, mtp reported and off; off)",
         NULL},
        API_SCHED_FLAGS(&sf),
        {"--long-prefill-token-threshold", API_FLAG_HUMAN_INT, &long_prefill,
         "a prompt moves by at most this many tokens a step (vLLM; 0: no cap)", NULL},
        {"--max-num-partial-prefills", API_FLAG_INT, &partial,
         "> 1: at most this many prompts move in a step, sharing the budget (vLLM; 1: any number)", NULL},
        {"--max-long-partial-prefills", API_FLAG_INT, &long_partial,
         "with the above: at most this many of them long; shorter prompts pass waiting long ones (1)", NULL},
        {"--device", API_FLAG_STR, &device, "cpu or cuda (default: cuda when available)", NULL},
        {"--tensor-parallel-size", API_FLAG_INT, &tp, "GPUs the model is split across (1)", NULL},
        {"--load-format", API_FLAG_STR, &load_format, "auto, or dummy: random weights from a config.json dir", NULL},
        {"--check-weights", API_FLAG_BOOL, &check_weights,
         "read every weight at load and refuse a NaN or infinity, naming the tensor (off: costs a pass over the weights)",
         NULL},
        {"--threads", API_FLAG_INT, &threads, "CPU threads, 0 = all cores", NULL},
        {"--quiet", API_FLAG_BOOL, &quiet, "no progress on stderr", NULL},
        {"--print-timings", API_FLAG_BOOL, &timings, "per request on stderr: queue, time to first token, total", NULL},
        {0},
    };
    /* -i / -o as vLLM spells them */
    char **av = malloc(sizeof *av * (size_t)(argc + 1));
    if (!av) return 1;
    for (int i = 0; i < argc; i++)
        av[i] = !strcmp(argv[i], "-i") ? "--input" : !strcmp(argv[i], "-o") ? "--output" : argv[i];
    av[argc] = NULL;
    char err[512];
    const char *pos[1];
    int flags_rc;
    int np = api_cmd_flags("run-batch", USAGE, argc, av, 2, flags, pos, 1, &flags_rc);
    free(av);
    if (np < 0) return flags_rc;
    if (np == 1 && !model_path) model_path = pos[0];
    if (!model_path || !in_path || !out_path) {
        fprintf(stderr, "sluice run-batch: --model, -i and -o are required (see --help)\n");
        return 2;
    }
    long long kv_bytes = api_parse_bytes(kv_mem ? kv_mem : "2G");
    if (kv_bytes <= 0) {
        fprintf(stderr, "sluice run-batch: invalid --kv-cache-memory '%s' (e.g. 2G, 512M, 1073741824)\n", kv_mem);
        return 2;
    }
    /* each message names the flag, its value and what it may be; a value
     * given as 0 is refused as vLLM refuses it, not read as "the default" */
    struct sched_config policy = {0};
    if (api_flag_long_range("--max-num-seqs", max_num_seqs, 1, 1 << 16, err, sizeof err) ||
        api_flag_long_range("--max-num-batched-tokens", max_batched, 1, 1 << 20, err, sizeof err) ||
        api_flag_long_range("--max-model-len", max_model_len, 1, LONG_MAX, err, sizeof err) ||
        api_flag_long_range("--block-size", block_size, 1, 1024, err, sizeof err) ||
        api_flag_long_range("--mamba-block-size", mamba_block, 0, INT_MAX, err, sizeof err) ||
        api_flag_long_range("--tensor-parallel-size", tp, 1, LONG_MAX, err, sizeof err) ||
        api_flag_long_range("--threads", threads, 0, INT_MAX, err, sizeof err) ||
        api_flag_long_range("--long-prefill-token-threshold", long_prefill, 0, INT_MAX, err, sizeof err) ||
        api_partial_prefill_flags(partial, long_partial, err, sizeof err) ||
        api_sched_flags_apply(&sf, &policy, err, sizeof err) ||
        (spec_json && api_speculative_config(spec_json, "run-batch", &policy.spec, err, sizeof err)) ||
        api_flag_double_range("--gpu-memory-utilization", gpu_util, 0, true, 1, err, sizeof err)) {
        fprintf(stderr, "sluice run-batch: %s\n", err);
        return 2;
    }
    if (max_model_len == API_FLAG_UNSET) max_model_len = 0;
    if (max_num_seqs == API_FLAG_UNSET) max_num_seqs = 0;
    if (max_batched == API_FLAG_UNSET) max_batched = 0;
    api_engine_defaults(device, &max_num_seqs, &max_batched, &policy.ttft_target_s);
    if (max_batched < max_num_seqs) { /* both given: the defaults bend to a given value */
        fprintf(stderr, "sluice run-batch: --max-num-batched-tokens %ld is less than --max-num-seqs %ld "
                        "(a step must hold one token of every running sequence)\n",
                max_batched, max_num_seqs);
        return 2;
    }
    api_gpu_util_note("run-batch", device, gpu_util, kv_mem);
    if (isnan(gpu_util)) gpu_util = 0.9;
    bool kv8;
    if (model_kv_dtype(&(struct model_backend_opts){.kv_cache_dtype = kv_dtype}, device, &kv8, err, sizeof err)) {
        fprintf(stderr, "sluice run-batch: %s\n", err);
        return 2;
    }

    int rc = 1;
    struct batch b;
    memset(&b, 0, sizeof b);
    b.model_path = model_path;
    b.served_name = served ? served : model_path;
    b.quiet = quiet;
    b.timings = timings;
    b.rng = (uint64_t)time(NULL) ^ ((uint64_t)getpid() << 32);
    b.created = (long)time(NULL);
    model_backend *be = NULL;
    b.in = !strcmp(in_path, "-") ? spool_stdin() : fopen(in_path, "r");
    if (!b.in) {
        fprintf(stderr, "sluice run-batch: cannot open %s: %s\n", in_path, strerror(errno));
        return 1;
    }
    /* refused before the model loads or the output is created */
    long dups = find_duplicate_ids(b.in, in_path);
    if (dups != 0) {
        if (dups < 0) fprintf(stderr, "sluice run-batch: cannot read %s: %s\n", in_path, strerror(errno));
        else fprintf(stderr, "sluice run-batch: %s: %ld custom_id%s used more than once; each request's custom_id "
                             "must be unique in a batch, nothing was run\n", in_path, dups, dups > 1 ? "s are" : " is");
        fclose(b.in);
        return 1;
    }
    /* in flight, plus as many done lines waiting behind a slow earlier one */
    int max_in_flight = 4 * (int)max_num_seqs;
    b.cap_lines = 2 * max_in_flight + 64;
    b.lines = calloc((size_t)b.cap_lines, sizeof *b.lines);
    if (!b.lines) {
        fprintf(stderr, "sluice run-batch: out of memory\n");
        goto fail_lines;
    }
    b.out = !strcmp(out_path, "-") ? stdout : fopen(out_path, "w");
    if (!b.out) {
        fprintf(stderr, "sluice run-batch: cannot write %s: %s\n", out_path, strerror(errno));
        goto fail_lines;
    }

    struct model_load_opts lo = {.progress = !quiet, .tokenizer = tok_path, .load_format = load_format,
                                 .check_weights = check_weights};
    b.m = model_load(model_path, &lo, err, sizeof err);
    if (!b.m) goto fail_msg;
    /* chat lines are rendered with the model's own template (or --chat-template) */
    if (api_chat_setup(b.m, chat_template, err, sizeof err)) goto fail_msg;
    b.tok = model_get_tok(b.m);
    struct sched_engine_opts eo;
    memset(&eo, 0, sizeof eo);
    eo.sched.block_size = (int)block_size;
    eo.sched.max_num_seqs = (int)max_num_seqs;
    eo.sched.max_num_batched_tokens = (int)max_batched;
    eo.sched.max_model_len = (int)max_model_len;
    eo.sched.min_batch_share = policy.min_batch_share;
    eo.sched.ttft_target_s = policy.ttft_target_s;
    eo.sched.itl_target_s = policy.itl_target_s;
    eo.sched.itl_auto_factor = policy.itl_auto_factor;
    eo.sched.long_prefill_token_threshold = (int)long_prefill;
    eo.sched.max_num_partial_prefills = (int)partial;
    eo.sched.max_long_partial_prefills = (int)long_partial;
    api_speculative_fit(b.m, "run-batch", &policy.spec);
    eo.sched.spec = policy.spec;
    eo.kv_cache_bytes = (size_t)kv_bytes;
    eo.enable_prefix_caching = prefix;
    eo.mamba_block_size = (int)mamba_block;
    sched_engine_defaults(b.m, &eo);
    struct model_backend_opts bo = {
        .device = device, .n_threads = (int)threads, .max_tokens_per_step = eo.sched.max_num_batched_tokens,
        .max_seqs_per_step = eo.sched.max_num_seqs, .max_ctx = eo.sched.max_model_len,
        .tensor_parallel_size = (int)tp, .kv_cache_dtype = kv_dtype, .enforce_eager = eager,
        .max_draft_tokens = policy.spec.method ? policy.spec.num_speculative_tokens : 0,
        .mtp = policy.spec.method == SCHED_SPEC_MTP,
    };
    be = model_backend_create(b.m, &bo, err, sizeof err);
    if (!be) goto fail_msg;
    /* on the GPU the KV cache takes what --gpu-memory-utilization leaves, as in serve */
    if (!kv_mem && !strcmp(be->ops->name, "cuda") &&
        api_gpu_kv_bytes((int)tp, gpu_util, quiet ? NULL : "run-batch", &eo.kv_cache_bytes, err, sizeof err) < 0)
        goto fail_msg;
    b.e = sched_engine_create(be, &eo, err, sizeof err);
    if (!b.e) goto fail_msg;
    b.sink = sched_sink_create(b.e, NULL, NULL);
    if (!b.sink) {
        snprintf(err, sizeof err, "out of memory");
        goto fail_msg;
    }
    b.names[0] = b.served_name;
    b.env = (struct bline_env){.eng = b.e, .sink = b.sink, .tok = b.tok,
                               .max_model_len = sched_engine_config(b.e)->max_model_len, .model_names = b.names,
                               .model_path = b.model_path, .has_prompt_logprobs = be->has_prompt_logprobs,
                               .backend_name = be->ops->name};
    b.max_model_len = sched_engine_config(b.e)->max_model_len;
    if (!quiet) {
        struct sched_engine_stats st;
        sched_engine_get_stats(b.e, &st);
        fprintf(stderr, "[run-batch] reading %s | KV cache %d blocks x %d tokens%s | max-num-seqs %d, "
                        "max-num-batched-tokens %d, max-model-len %d, prefix caching %s\n",
                in_path, st.kv_blocks, st.block_size, kv8 ? " (fp8)" : "", eo.sched.max_num_seqs,
                eo.sched.max_num_batched_tokens, b.max_model_len, prefix ? "on" : "off");
        char sl[400];
        if (api_state_line(b.e, sl, sizeof sl)) fprintf(stderr, "[run-batch] %s\n", sl);
    }

    struct sched_evbuf evb;
    sched_evbuf_init(&evb);
    b.t0 = now_s();
    for (;;) {
        while (b.in_flight < max_in_flight) {
            if (b.next_submit == b.n_read) {
                int r = read_line(&b);
                if (r < 0) {
                    snprintf(err, sizeof err, "cannot read %s: %s", in_path, ferror(b.in) ? strerror(errno) : "out of memory");
                    sched_evbuf_deinit(&evb);
                    goto fail_msg;
                }
                if (r == 0) break;
            }
            prepare(&b, slot(&b, b.next_submit++));
        }
        if (write_ready(&b)) {
            snprintf(err, sizeof err, "cannot write %s: %s", out_path, strerror(errno));
            sched_evbuf_deinit(&evb);
            goto fail_msg;
        }
        progress(&b, false);
        if (b.in_flight == 0 && b.eof && b.next_submit == b.n_read) break;
        /* a dead GPU: stop rather than answer every remaining line with an error */
        if (sched_engine_fatal(b.e, err, sizeof err)) {
            sched_evbuf_deinit(&evb);
            fprintf(stderr, "\nsluice run-batch: %s; %ld lines written, rerun for the rest\n", err, b.next_write);
            rc = 1;
            goto done;
        }
        if (b.in_flight == 0) continue; /* lines that failed at once: the ring has room again */
        int k = sched_sink_wait(b.sink, &evb, 1.0);
        for (int i = 0; i < k; i++) on_event(&b, &evb.ev[i]);
    }
    sched_evbuf_deinit(&evb);
    progress(&b, true);
    if (!quiet) {
        double el = now_s() - b.t0;
        struct sched_engine_stats st;
        sched_engine_get_stats(b.e, &st);
        fprintf(stderr, "[run-batch] %ld requests (%d failed) in %.2f s: %ld generated tokens (%.1f tok/s), "
                        "%ld prompt tokens (%ld cached), %llu steps, %llu preemptions\n",
                b.n_read, b.failed, el, b.gen_tokens, el > 0 ? (double)b.gen_tokens / el : 0.0, b.prompt_tokens,
                b.cached_tokens, (unsigned long long)st.sched.steps, (unsigned long long)st.sched.preemptions);
    }
    rc = 0;
    goto done;

fail_msg:
    fprintf(stderr, "sluice run-batch: %s\n", err);
    rc = 1;
done:
    sched_sink_destroy(b.sink);
    sched_engine_destroy(b.e);
    model_backend_destroy(be);
    model_free(b.m);
    if (b.out && b.out != stdout) fclose(b.out);
fail_lines:
    for (long i = b.next_write; b.lines && i < b.n_read; i++) {
        struct line *l = slot(&b, i);
        line_release(l);
        free(l->custom_id);
        free(l->out);
    }
    free(b.lines);
    free(b.rbuf);
    if (b.in) fclose(b.in);
    return rc;
}

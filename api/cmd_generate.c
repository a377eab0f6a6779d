/* cmd_generate.c - `sluice generate`: one prompt (or an interactive chat) on
 * one backend, driven directly, one sequence, contiguous KV blocks.
 *
 * The scheduler is not involved: this is the smallest loop that exercises
 * loader, tokenizer, backend, sampler and detokenizer end to end. In --chat
 * mode without --prompt it keeps the conversation's tokens in the KV cache and
 * only prefills what each new turn adds.
 */
#include <math.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

#include "api.h"
#include "model/backend.h"
#include "model/model.h"
#include "openai.h"

#define BLOCK_SIZE 16
#define PREFILL_CHUNK 512

struct gen {
    model *m;
    bool chat;             /* prompts come from the chat template, which writes its own BOS */
    model_backend *be;
    const model_tok *tok;
    int max_ctx;
    int32_t *ids;          /* [max_ctx] tokens in the KV cache, then the one being fed */
    int n_ids;             /* tokens whose K/V are in the cache */
    int32_t *blocks;       /* [max_ctx / BLOCK_SIZE] contiguous: block i is i */
    int32_t *pos;          /* [PREFILL_CHUNK] step scratch */
    int64_t *slots;        /* [PREFILL_CHUNK] */
    struct model_sampling sp;
    uint64_t rng;
    bool ignore_eos;
};

static double now_s(void)
{
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return (double)ts.tv_sec + ts.tv_nsec * 1e-9;
}

/* Feeds ids[g->n_ids .. n) through the backend in chunks; samples after the
 * last one when want_sample. n_prompt: where the current prompt starts in the
 * history, for penalties. Returns 0 or a negative status with err set. */
static int feed(struct gen *g, int n, int n_prompt, bool want_sample, struct model_sample_out *out,
                char *err, size_t errlen)
{
    while (g->n_ids < n) {
        int len = n - g->n_ids;
        if (len > PREFILL_CHUNK) len = PREFILL_CHUNK;
        for (int i = 0; i < len; i++) {
            int p = g->n_ids + i;
            g->pos[i] = p;
            g->slots[i] = (int64_t)g->blocks[p / BLOCK_SIZE] * BLOCK_SIZE + p % BLOCK_SIZE;
        }
        bool last = g->n_ids + len == n;
        struct step_seq seq = {
            .query_start = 0,
            .query_len = len,
            .context_len = g->n_ids + len,
            .block_table = g->blocks,
            .n_blocks = (g->n_ids + len + BLOCK_SIZE - 1) / BLOCK_SIZE,
            .want_sample = last && want_sample,
            .sampling = &g->sp,
            .history = g->ids,
            .n_prompt = n_prompt,
            .n_history = n,
            .rng = &g->rng,
        };
        struct step s = {
            .n_tokens = len,
            .token_ids = g->ids + g->n_ids,
            .positions = g->pos,
            .slots = g->slots,
            .n_seqs = 1,
            .seqs = &seq,
        };
        int rc = g->be->ops->forward(g->be, &s, err, errlen);
        if (rc) return rc;
        g->n_ids += len;
        if (seq.want_sample) *out = seq.out;
    }
    return 0;
}

static bool is_stop(const struct gen *g, int32_t id)
{
    const int32_t *stop;
    int n = model_tok_stop_ids(g->tok, &stop);
    for (int i = 0; i < n; i++)
        if (stop[i] == id) return true;
    return false;
}

/* Prefills prompt ids already placed at g->ids[g->n_ids .. n_total), then
 * generates up to max_tokens, streaming text to stdout. The answer's ids are
 * left at g->ids[n_total .. n_total + *n_answer). Returns 0 or a status. */
static int run_turn(struct gen *g, int n_total, long max_tokens, bool stats, long *n_answer, char *err,
                    size_t errlen)
{
    int n_prompt_new = n_total - g->n_ids;
    int n_prompt = n_total;
    struct model_sample_out out;
    double t0 = now_s();
    int rc = feed(g, n_total, n_prompt, true, &out, err, errlen);
    if (rc) return rc;
    double t1 = now_s();
    struct model_detok dt;
    model_detok_init(&dt, g->tok, true);
    char buf[512];
    long n_gen = 0;
    while (n_gen < max_tokens) {
        int32_t id = out.token;
        if (!g->ignore_eos && is_stop(g, id)) break;
        g->ids[g->n_ids] = id; /* in the history now; its K/V is computed when fed */
        n_gen++;
        size_t k = model_detok_push(&dt, id, buf, sizeof buf);
        fwrite(buf, 1, k, stdout);
        fflush(stdout);
        if (n_gen == max_tokens) break;
        if (g->n_ids + 1 >= g->max_ctx) {
            fprintf(stderr, "\n[context full: %d tokens]\n", g->max_ctx);
            break;
        }
        rc = feed(g, g->n_ids + 1, n_prompt, true, &out, err, errlen);
        if (rc) return rc;
    }
    size_t k = model_detok_flush(&dt, buf, sizeof buf);
    fwrite(buf, 1, k, stdout);
    fflush(stdout);
    double t2 = now_s();
    *n_answer = n_gen;
    if (stats) {
        double pp = t1 - t0, tg = t2 - t1;
        fprintf(stderr, "\nprompt tokens: %d (%.1f tok/s), generated tokens: %ld (%.1f tok/s)\n",
                n_prompt_new, pp > 0 ? n_prompt_new / pp : 0.0, n_gen, tg > 0 && n_gen > 1 ? (n_gen - 1) / tg : 0.0);
    }
    return 0;
}

/* Tokenizes text and appends it after the cached tokens, reusing the longest
 * cached prefix that the new tokenization shares. Returns the new total. */
static int place_prompt(struct gen *g, const char *text, char *err, size_t errlen)
{
    int cap = g->max_ctx;
    int32_t *tmp = malloc(sizeof *tmp * (size_t)cap);
    if (!tmp) {
        snprintf(err, errlen, "out of memory");
        return -1;
    }
    int n = model_tok_encode(g->tok, text, strlen(text), !g->chat, true, tmp, cap);
    if (n < 0 || n >= cap) {
        free(tmp);
        snprintf(err, errlen, n < 0 ? "tokenization failed" : "prompt of %d tokens does not fit the context of %d", n, cap);
        return -1;
    }
    int keep = 0;
    while (keep < g->n_ids && keep < n - 1 && g->ids[keep] == tmp[keep]) keep++;
    /* drop cached tokens past the shared prefix; their KV is simply overwritten */
    g->n_ids = keep;
    memcpy(g->ids, tmp, sizeof *tmp * (size_t)n);
    free(tmp);
    return n;
}

static char *read_line(FILE *f)
{
    size_t cap = 0;
    char *line = NULL;
    ssize_t n = getline(&line, &cap, f);
    if (n < 0) {
        free(line);
        return NULL;
    }
    while (n > 0 && (line[n - 1] == '\n' || line[n - 1] == '\r')) line[--n] = '\0';
    return line;
}

static const char USAGE[] =
    "usage: sluice generate --model PATH [--prompt TEXT] [--chat] [flags]\n"
    "  Generates text on one backend. --chat applies the model's chat template;\n"
    "  --chat without --prompt starts an interactive chat on stdin.\n\n";

int api_cmd_generate(int argc, char **argv)
{
    const char *model_path = NULL, *prompt = NULL, *device = NULL, *load_format = NULL, *system = NULL, *tok_path = NULL;
    bool chat = false, ignore_eos = false, quiet = false;
    const char *chat_template = NULL;
    long max_tokens = 256, seed = -1, top_k = 0, threads = 0, max_model_len = 8192, tp = 1;
    double temperature = 0.8, top_p = 0.95, min_p = 0.0, rep = 1.0, pres = 0.0, freq = 0.0;
    const struct api_flag flags[] = {
        {"--model", API_FLAG_STR, &model_path, "GGUF file or HF checkpoint directory", NULL},
        {"--tokenizer", API_FLAG_STR, &tok_path, "take the tokenizer from another model", NULL},
        {"--prompt", API_FLAG_STR, &prompt, "prompt text (with --chat: the user message)", NULL},
        {"--chat", API_FLAG_BOOL, &chat, "apply the chat format; interactive without --prompt", NULL},
        {"--system", API_FLAG_STR, &system, "system message for --chat", NULL},
        {"--chat-template", API_FLAG_STR, &chat_template, "Jinja chat template file instead of the model's own", NULL},
        {"--max-tokens", API_FLAG_INT, &max_tokens, "tokens to generate per answer (256)", NULL},
        {"--temperature", API_FLAG_FLOAT, &temperature, "0 = greedy (0.8)", NULL},
        {"--top-p", API_FLAG_FLOAT, &top_p, "nucleus sampling (0.95)", NULL},
        {"--top-k", API_FLAG_INT, &top_k, "0 = off (0)", NULL},
        {"--min-p", API_FLAG_FLOAT, &min_p, "0 = off (0)", NULL},
        {"--repetition-penalty", API_FLAG_FLOAT, &rep, "1 = off (1)", NULL},
        {"--presence-penalty", API_FLAG_FLOAT, &pres, "0 = off (0)", NULL},
        {"--frequency-penalty", API_FLAG_FLOAT, &freq, "0 = off (0)", NULL},
        {"--seed", API_FLAG_INT, &seed, "RNG seed; same seed, same output (random)", NULL},
        {"--ignore-eos", API_FLAG_BOOL, &ignore_eos, "do not stop at end-of-sequence tokens", NULL},
        {"--max-model-len", API_FLAG_HUMAN_INT, &max_model_len, "context length to allocate, e.g. 8k or 8K (8192)", NULL},
        {"--device", API_FLAG_STR, &device, "cpu or cuda (default: cuda when available)", NULL},
        {"--tensor-parallel-size", API_FLAG_INT, &tp, "GPUs the model is split across (1)", NULL},
        {"--load-format", API_FLAG_STR, &load_format, "auto, or dummy: random weights from a config.json dir", NULL},
        {"--threads", API_FLAG_INT, &threads, "CPU threads, 0 = all cores", NULL},
        {"--quiet", API_FLAG_BOOL, &quiet, "no statistics line", NULL},
        {0},
    };
    char err[512];
    const char *pos[1];
    int flags_rc;
    int np = api_cmd_flags("generate", USAGE, argc, argv, 2, flags, pos, 1, &flags_rc);
    if (np < 0) return flags_rc;
    if (np == 1 && !model_path) model_path = pos[0];
    if (!model_path) {
        fprintf(stderr, "sluice generate: --model is required (see --help)\n");
        return 2;
    }
    if (!prompt && !chat) {
        fprintf(stderr, "sluice generate: --prompt is required without --chat\n");
        return 2;
    }
    if (api_flag_long_range("--max-tokens", max_tokens, 0, LONG_MAX, err, sizeof err) ||
        api_flag_double_range("--temperature", temperature, 0, false, INFINITY, err, sizeof err) ||
        api_flag_double_range("--top-p", top_p, 0, true, 1, err, sizeof err) ||
        api_flag_double_range("--min-p", min_p, 0, false, 1, err, sizeof err) ||
        api_flag_double_range("--repetition-penalty", rep, 0, true, INFINITY, err, sizeof err) ||
        api_flag_long_range("--max-model-len", max_model_len, 16, LONG_MAX, err, sizeof err) ||
        api_flag_long_range("--tensor-parallel-size", tp, 1, LONG_MAX, err, sizeof err) ||
        api_flag_long_range("--threads", threads, 0, INT_MAX, err, sizeof err)) {
        fprintf(stderr, "sluice generate: %s\n", err);
        return 2;
    }

    int rc = 1;
    struct gen g = {0};
    g.ignore_eos = ignore_eos;
    struct model_load_opts lo = {.progress = true, .tokenizer = tok_path, .load_format = load_format};
    g.m = model_load(model_path, &lo, err, sizeof err);
    if (!g.m) {
        fprintf(stderr, "sluice generate: %s\n", err);
        return 1;
    }
    g.tok = model_get_tok(g.m);
    g.chat = chat;
    if (chat && api_chat_setup(g.m, chat_template, err, sizeof err)) goto fail;
    const struct model_config *cfg = model_get_config(g.m);
    g.max_ctx = (int)max_model_len;
    if (cfg->n_ctx_train > 0 && g.max_ctx > cfg->n_ctx_train) g.max_ctx = cfg->n_ctx_train;
    g.max_ctx = (g.max_ctx + BLOCK_SIZE - 1) / BLOCK_SIZE * BLOCK_SIZE;
    struct model_backend_opts bo = {
        .device = device, .n_threads = (int)threads, .max_tokens_per_step = PREFILL_CHUNK,
        .max_seqs_per_step = 1, .max_ctx = g.max_ctx,
        .tensor_parallel_size = (int)tp,
    };
    g.be = model_backend_create(g.m, &bo, err, sizeof err);
    if (!g.be) goto fail;
    if (g.be->ops->kv_alloc(g.be, g.max_ctx / BLOCK_SIZE, BLOCK_SIZE, err, sizeof err)) goto fail;
    /* recurrent layers: one state slot, slot 0 of every step (zeroed at position 0) */
    if (g.be->ops->state_slot_bytes && g.be->ops->state_slot_bytes(g.be) > 0 &&
        g.be->ops->state_alloc(g.be, 1, err, sizeof err))
        goto fail;
    g.ids = malloc(sizeof *g.ids * (size_t)(g.max_ctx + 1));
    g.blocks = malloc(sizeof *g.blocks * (size_t)(g.max_ctx / BLOCK_SIZE));
    g.pos = malloc(sizeof *g.pos * PREFILL_CHUNK);
    g.slots = malloc(sizeof *g.slots * PREFILL_CHUNK);
    if (!g.ids || !g.blocks || !g.pos || !g.slots) {
        snprintf(err, sizeof err, "out of memory");
        goto fail;
    }
    for (int i = 0; i < g.max_ctx / BLOCK_SIZE; i++) g.blocks[i] = i;
    model_sampling_default(&g.sp);
    g.sp.temperature = (float)temperature;
    g.sp.top_p = (float)top_p;
    g.sp.top_k = (int)top_k;
    g.sp.min_p = (float)min_p;
    g.sp.repetition_penalty = (float)rep;
    g.sp.presence_penalty = (float)pres;
    g.sp.frequency_penalty = (float)freq;
    g.sp.seed = seed >= 0 ? (uint64_t)seed : (uint64_t)time(NULL) ^ ((uint64_t)clock() << 32);
    g.rng = model_rng_seed(g.sp.seed);

    if (!chat) {
        int n = place_prompt(&g, prompt, err, sizeof err);
        long n_ans;
        if (n < 0 || run_turn(&g, n, max_tokens, !quiet, &n_ans, err, sizeof err)) goto fail;
        rc = 0;
        goto done;
    }

    /* chat: the conversation as role/content pairs, re-rendered each turn */
    enum { MAX_TURNS = 512 };
    const char *roles[MAX_TURNS];
    char *contents[MAX_TURNS];
    int n_msg = 0;
    if (system) {
        roles[n_msg] = "system";
        contents[n_msg++] = strdup(system);
    }
    bool interactive = !prompt;
    for (;;) {
        char *user;
        if (interactive) {
            fprintf(stderr, "> ");
            fflush(stderr);
            user = read_line(stdin);
            if (!user) break;
            if (!*user) {
                free(user);
                continue;
            }
        } else {
            user = strdup(prompt);
        }
        if (n_msg + 2 > MAX_TURNS) {
            free(user);
            fprintf(stderr, "[conversation too long]\n");
            break;
        }
        roles[n_msg] = "user";
        contents[n_msg++] = user;
        /* the conversation as a chat request body, rendered by the model's template */
        struct json_buf body;
        json_buf_init(&body);
        json_buf_lit(&body, "{\"messages\":[");
        for (int i = 0; i < n_msg; i++) {
            json_buf_addf(&body, "%s{\"role\":\"%s\",\"content\":", i ? "," : "", roles[i]);
            json_buf_add_str(&body, contents[i], strlen(contents[i]));
            json_buf_lit(&body, "}");
        }
        json_buf_lit(&body, "]}");
        json_doc bd;
        struct api_oai_error e = {0};
        char *text = NULL;
        if (body.oom || json_parse(&bd, body.p, body.len, err, sizeof err)) {
            json_buf_free(&body);
            break;
        }
        int trc = api_chat_render(&bd, 0, &text, NULL, &e);
        json_free(&bd);
        json_buf_free(&body);
        if (trc) {
            fprintf(stderr, "sluice generate: %s\n", e.message);
            break;
        }
        int n = place_prompt(&g, text, err, sizeof err);
        free(text);
        if (n < 0) {
            fprintf(stderr, "sluice generate: %s\n", err);
            break;
        }
        long n_ans;
        if (run_turn(&g, n, max_tokens, !quiet, &n_ans, err, sizeof err)) {
            fprintf(stderr, "sluice generate: %s\n", err);
            break;
        }
        /* the answer as text, for the next turn's render */
        long ans_len = model_tok_decode(g.tok, g.ids + n, (int)n_ans, true, NULL, 0);
        char *ans = ans_len >= 0 ? malloc((size_t)ans_len + 1) : NULL;
        long k = ans ? model_tok_decode(g.tok, g.ids + n, (int)n_ans, true, ans, (size_t)ans_len) : -1;
        if (k < 0 || k > ans_len) {
            free(ans);
            break;
        }
        ans[k] = '\0';
        roles[n_msg] = "assistant";
        contents[n_msg++] = ans;
        fputc('\n', stdout);
        if (!interactive) break;
    }
    for (int i = 0; i < n_msg; i++) free(contents[i]);
    rc = 0;
    goto done;
fail:
    fprintf(stderr, "sluice generate: %s\n", err);
    rc = 1;
done:
    free(g.ids);
    free(g.blocks);
    free(g.pos);
    free(g.slots);
    model_backend_destroy(g.be);
    api_chat_teardown();
    model_free(g.m);
    return rc;
}

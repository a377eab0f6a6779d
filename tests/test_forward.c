/* test_forward.c - the CPU backend against HF transformers goldens, and its
 * batch invariance.
 *
 * For each model whose golden.json is present (made by tests/golden/make_goldens.py):
 *  - every input position's logits (one step holding one 1-token "sequence"
 *    per position over a shared block table) match HF's top-20 logits:
 *    max |ours - ref| / max |ref| <= 1e-4 at each position;
 *  - greedy generation of 64 tokens (chunked prefill, then one token per step)
 *    equals HF's greedy continuation exactly;
 *  - batch invariance, bit for bit: logits from the chunked prefill, from the
 *    one-token decode steps, from all prompts in one multi-sequence step, and
 *    from one all-positions step over prompt + continuation agree.
 * A missing golden is reported and skipped (it counts as neither passed nor failed).
 */
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <omp.h>
#include <sys/stat.h>
#include <time.h>
#include <unistd.h>

#include "model/backend.h"
#include "base/json.h"
#include "tests/test.h"
#include "tests/golden.h"

#define BLOCK 16

static model *g_model;
static model_backend *g_be;
static struct golden g_gold;
static int g_nv;
static const char *g_name;

/* ---- driving the backend ------------------------------------------------------- */

/* KV: every prompt gets its own region of blocks (prompt i: blocks
 * i*REGION ..), so several prompts can be in one step. */
#define REGION 16
static int32_t g_bt[MAXP][REGION];
static struct model_sampling g_greedy;

/* One step with a 1-token sequence per position start..start+n-1 of ids, all
 * sharing prompt slot `pi`'s block table: logits of every position. */
static int all_positions(int pi, const int32_t *ids, int start, int n, float *logits)
{
    int32_t *pos = malloc(n * sizeof *pos);
    int64_t *slots = malloc(n * sizeof *slots);
    struct step_seq *sq = calloc(n, sizeof *sq);
    char err[256];
    for (int t = 0; t < n; t++) {
        int p = start + t;
        pos[t] = p;
        slots[t] = (int64_t)g_bt[pi][p / BLOCK] * BLOCK + p % BLOCK;
        sq[t] = (struct step_seq){.query_start = t, .query_len = 1, .context_len = p + 1,
                                  .block_table = g_bt[pi], .n_blocks = REGION,
                                  .logits_out = logits + (size_t)t * g_nv};
    }
    struct step st = {.n_tokens = n, .token_ids = ids + start, .positions = pos, .slots = slots,
                      .n_seqs = n, .seqs = sq};
    int rc = g_be->ops->forward(g_be, &st, err, sizeof err);
    if (rc) printf("  forward: %s\n", err);
    free(pos);
    free(slots);
    free(sq);
    return rc;
}

/* One sequence, tokens start..start+n-1, logits of the last one; samples
 * greedily (history = ids[0..start+n)). */
static int one_seq(int pi, const int32_t *ids, int start, int n, float *logits, int32_t *tok)
{
    int32_t pos[512];
    int64_t slots[512];
    char err[256];
    if (n > 512) return -1;
    for (int t = 0; t < n; t++) {
        int p = start + t;
        pos[t] = p;
        slots[t] = (int64_t)g_bt[pi][p / BLOCK] * BLOCK + p % BLOCK;
    }
    uint64_t rng = model_rng_seed(0);
    struct step_seq sq = {.query_start = 0, .query_len = n, .context_len = start + n,
                          .block_table = g_bt[pi], .n_blocks = REGION, .want_sample = true,
                          .sampling = &g_greedy, .history = ids, .n_prompt = start + n,
                          .n_history = start + n, .rng = &rng, .logits_out = logits};
    struct step st = {.n_tokens = n, .token_ids = ids + start, .positions = pos, .slots = slots,
                      .n_seqs = 1, .seqs = &sq};
    int rc = g_be->ops->forward(g_be, &st, err, sizeof err);
    if (rc) printf("  forward: %s\n", err);
    *tok = sq.out.token;
    return rc;
}

/* ---- the tests ----------------------------------------------------------------- */

static float *g_pos_logits[MAXP]; /* [n + NGREEDY][n_vocab]: all-positions logits of ids + greedy */

static void test_logits_match_hf(void)
{
    for (int i = 0; i < g_gold.np; i++) {
        struct prompt *p = &g_gold.p[i];
        float *lg = g_pos_logits[i];
        CHECK(all_positions(i, p->ids, 0, p->n, lg) == 0);
        double worst = 0;
        int worst_pos = -1;
        for (int pos = 0; pos < p->n; pos++) {
            double md = 0, mr = 0;
            for (int k = 0; k < TOPK; k++) {
                int id = p->top_ids[pos * TOPK + k];
                float ref = p->top_logits[pos * TOPK + k];
                if (id < 0 || id >= g_nv) {
                    md = INFINITY;
                    break;
                }
                double dd = fabs((double)lg[(size_t)pos * g_nv + id] - ref);
                md = dd > md ? dd : md;
                mr = fabs(ref) > mr ? fabs(ref) : mr;
            }
            double rel = md / (mr > 0 ? mr : 1);
            if (!(rel <= worst)) worst = rel, worst_pos = pos;
        }
        printf("  %s prompt %d (%d ids): worst relative logit error %.3g at position %d\n", g_name,
               i, p->n, worst, worst_pos);
        CHECKF(worst <= 1e-4, "prompt %d: %.3g > 1e-4", i, worst);
    }
}

static void test_greedy_and_invariance(void)
{
    float *lg = malloc((size_t)g_nv * sizeof *lg);
    for (int i = 0; i < g_gold.np; i++) {
        struct prompt *p = &g_gold.p[i];
        int32_t *seq = malloc((size_t)(p->n + NGREEDY) * sizeof *seq);
        memcpy(seq, p->ids, (size_t)p->n * sizeof *seq);
        int32_t tok = -1;
        /* chunked prefill: chunks of 7; each chunk's last logits equal the all-positions step */
        int bits_ok = 1;
        for (int s = 0; s < p->n; s += 7) {
            int n = p->n - s < 7 ? p->n - s : 7;
            CHECK(one_seq(i, seq, s, n, lg, &tok) == 0);
            bits_ok &= memcmp(lg, g_pos_logits[i] + (size_t)(s + n - 1) * g_nv,
                              (size_t)g_nv * sizeof *lg) == 0;
        }
        CHECKF(bits_ok, "prompt %d: chunked prefill logits differ from the one-step logits", i);
        /* decode one token per step; keep the logits for the check below */
        float *dec = malloc((size_t)NGREEDY * g_nv * sizeof *dec);
        memcpy(dec, lg, (size_t)g_nv * sizeof *lg);
        int ngen = 0, first_diff = -1;
        for (int g = 0; g < NGREEDY; g++) {
            seq[p->n + g] = tok;
            ngen++;
            if (first_diff < 0 && g < p->n_greedy && tok != p->ids[p->n + g]) first_diff = g;
            if (g + 1 == NGREEDY) break;
            CHECK(one_seq(i, seq, p->n + g, 1, dec + (size_t)(g + 1) * g_nv, &tok) == 0);
        }
        if (p->n_greedy > 0) {
            CHECKF(first_diff < 0 && p->n_greedy == NGREEDY,
                   "prompt %d: greedy differs from HF at token %d (ours %d, HF %d)", i, first_diff,
                   first_diff >= 0 ? seq[p->n + first_diff] : -1,
                   first_diff >= 0 ? p->ids[p->n + first_diff] : -1);
        }
        /* the same positions in one big step over prompt + continuation */
        int total = p->n + ngen - 1;
        float *big = malloc((size_t)ngen * g_nv * sizeof *big);
        CHECK(all_positions(i, seq, p->n - 1, ngen, big) == 0);
        (void)total;
        CHECKF(memcmp(big, dec, (size_t)ngen * g_nv * sizeof *big) == 0,
               "prompt %d: decode-step logits differ from one-step logits", i);
        free(big);
        free(dec);
        free(seq);
    }
    /* all prompts in one multi-sequence step: last-token logits */
    int T = 0;
    int32_t toks[2048], pos[2048];
    int64_t slots[2048];
    struct step_seq sq[MAXP];
    float *out = malloc((size_t)g_gold.np * g_nv * sizeof *out);
    for (int i = 0; i < g_gold.np; i++) {
        struct prompt *p = &g_gold.p[i];
        sq[i] = (struct step_seq){.query_start = T, .query_len = p->n, .context_len = p->n,
                                  .block_table = g_bt[i], .n_blocks = REGION,
                                  .logits_out = out + (size_t)i * g_nv};
        for (int t = 0; t < p->n; t++, T++) {
            toks[T] = p->ids[t];
            pos[T] = t;
            slots[T] = (int64_t)g_bt[i][t / BLOCK] * BLOCK + t % BLOCK;
        }
    }
    struct step st = {.n_tokens = T, .token_ids = toks, .positions = pos, .slots = slots,
                      .n_seqs = g_gold.np, .seqs = sq};
    char err[256];
    CHECK(g_be->ops->forward(g_be, &st, err, sizeof err) == 0);
    for (int i = 0; i < g_gold.np; i++)
        CHECKF(memcmp(out + (size_t)i * g_nv, g_pos_logits[i] + (size_t)(g_gold.p[i].n - 1) * g_nv,
                      (size_t)g_nv * sizeof *out) == 0,
               "prompt %d: logits in a multi-sequence step differ", i);
    /* sampling with temperature: the last prompt token of every prompt, all in one
     * step, then each alone with the same seed: same tokens and logprobs */
    struct model_sampling hot;
    model_sampling_default(&hot);
    hot.temperature = 0.9f;
    hot.top_p = 0.95f;
    hot.top_logprobs = 5;
    uint64_t rng[MAXP];
    struct model_sample_out together[MAXP];
    T = 0;
    for (int i = 0; i < g_gold.np; i++) {
        struct prompt *p = &g_gold.p[i];
        rng[i] = model_rng_seed(100 + i);
        sq[i] = (struct step_seq){.query_start = T, .query_len = 1, .context_len = p->n,
                                  .block_table = g_bt[i], .n_blocks = REGION, .want_sample = true,
                                  .sampling = &hot, .history = p->ids, .n_prompt = p->n,
                                  .n_history = p->n, .rng = &rng[i]};
        toks[T] = p->ids[p->n - 1];
        pos[T] = p->n - 1;
        slots[T] = (int64_t)g_bt[i][(p->n - 1) / BLOCK] * BLOCK + (p->n - 1) % BLOCK;
        T++;
    }
    st = (struct step){.n_tokens = T, .token_ids = toks, .positions = pos, .slots = slots,
                       .n_seqs = g_gold.np, .seqs = sq};
    CHECK(g_be->ops->forward(g_be, &st, err, sizeof err) == 0);
    for (int i = 0; i < g_gold.np; i++) together[i] = sq[i].out;
    for (int i = 0; i < g_gold.np; i++) {
        rng[i] = model_rng_seed(100 + i);
        struct step one = {.n_tokens = 1, .token_ids = toks + i, .positions = pos + i,
                           .slots = slots + i, .n_seqs = 1, .seqs = &sq[i]};
        sq[i].query_start = 0;
        CHECK(g_be->ops->forward(g_be, &one, err, sizeof err) == 0);
        CHECKF(sq[i].out.token == together[i].token && sq[i].out.logprob == together[i].logprob &&
                   memcmp(sq[i].out.top_logprobs, together[i].top_logprobs,
                          sizeof together[i].top_logprobs) == 0,
               "prompt %d: sampled alone %d, batched %d", i, sq[i].out.token, together[i].token);
    }
    free(out);
    free(lg);
}

static void test_bad_steps_refused(void)
{
    char err[256];
    int32_t tok = 0, pos = 0;
    int64_t slot = 0;
    struct step_seq sq = {.query_start = 0, .query_len = 1, .context_len = 1,
                          .block_table = g_bt[0], .n_blocks = REGION};
    struct step st = {.n_tokens = 1, .token_ids = &tok, .positions = &pos, .slots = &slot,
                      .n_seqs = 1, .seqs = &sq};
    tok = g_nv;
    CHECK(g_be->ops->forward(g_be, &st, err, sizeof err) == SL_EINVAL);
    tok = 0;
    slot = 5; /* not what the block table says */
    CHECK(g_be->ops->forward(g_be, &st, err, sizeof err) == SL_EINVAL);
    slot = 0;
    pos = 3; /* beyond context_len */
    CHECK(g_be->ops->forward(g_be, &st, err, sizeof err) == SL_EINVAL);
    pos = 0;
    int32_t bad_bt[REGION] = {1 << 30};
    sq.block_table = bad_bt;
    CHECK(g_be->ops->forward(g_be, &st, err, sizeof err) == SL_EINVAL);
    sq.block_table = g_bt[0];
    sq.want_sample = true; /* without sampling params */
    CHECK(g_be->ops->forward(g_be, &st, err, sizeof err) == SL_EINVAL);
}

static int setup(const char *model_path)
{
    char err[512];
    struct model_load_opts lo = {0};
    g_model = model_load(model_path, &lo, err, sizeof err);
    if (!g_model) {
        printf("  load %s: %s\n", model_path, err);
        return -1;
    }
    g_nv = model_get_config(g_model)->n_vocab;
    int maxn = 0;
    for (int i = 0; i < g_gold.np; i++)
        if (g_gold.p[i].n + NGREEDY > maxn) maxn = g_gold.p[i].n + NGREEDY;
    struct model_backend_opts bo = {.device = "cpu", .max_tokens_per_step = 1024,
                                    .max_seqs_per_step = maxn, .max_ctx = REGION * BLOCK};
    g_be = model_backend_create(g_model, &bo, err, sizeof err);
    if (!g_be || g_be->ops->kv_alloc(g_be, MAXP * REGION, BLOCK, err, sizeof err) != 0) {
        printf("  backend: %s\n", err);
        return -1;
    }
    for (int i = 0; i < MAXP; i++)
        for (int j = 0; j < REGION; j++) g_bt[i][j] = i * REGION + (REGION - 1 - j); /* not in order */
    for (int i = 0; i < g_gold.np; i++) {
        if (g_gold.p[i].n + NGREEDY > REGION * BLOCK) return -1;
        g_pos_logits[i] = malloc((size_t)(g_gold.p[i].n + NGREEDY) * g_nv * sizeof(float));
    }
    return 0;
}

static void teardown(void)
{
    for (int i = 0; i < MAXP; i++) free(g_pos_logits[i]), g_pos_logits[i] = NULL;
    model_backend_destroy(g_be);
    model_free(g_model);
    g_be = NULL;
    g_model = NULL;
    golden_free(&g_gold);
}

static void test_setup_ok(void) { CHECK(g_be != NULL); }

static void run_model(const char *name, const char *model_path, const char *golden_path)
{
    struct stat st;
    if (stat(golden_path, &st) != 0 || stat(model_path, &st) != 0) {
        printf("note: %s: %s or %s absent, skipped\n", name, golden_path, model_path);
        return;
    }
    g_name = name;
    if (golden_load(golden_path, &g_gold) != 0 || g_gold.np == 0) {
        RUN(test_setup_ok); /* a malformed golden fails */
        golden_free(&g_gold);
        return;
    }
    printf("%s: %d prompts\n", name, g_gold.np);
    if (setup(model_path) != 0) {
        g_be = NULL;
        RUN(test_setup_ok);
        teardown();
        return;
    }
    RUN(test_logits_match_hf);
    RUN(test_greedy_and_invariance);
    RUN(test_bad_steps_refused);
    teardown();
}

/* ---- loader errors ----------------------------------------------------------- */

static int write_file(const char *path, const char *text)
{
    FILE *f = fopen(path, "w");
    if (!f) return -1;
    fputs(text, f);
    return fclose(f);
}

/* A copy of tiny-llama (links to its files) with config.json replaced. */
static int fake_dir(char *dir, size_t cap, const char *config)
{
    char cwd[2048], p[4096], q[4096];
    if (!getcwd(cwd, sizeof cwd)) return -1;
    snprintf(dir, cap, "/tmp/sluice_test_forward_XXXXXX");
    if (!mkdtemp(dir)) return -1;
    const char *files[] = {"model.safetensors", "tokenizer.json", "tokenizer_config.json"};
    for (size_t i = 0; i < sizeof files / sizeof files[0]; i++) {
        snprintf(p, sizeof p, "%s/tests/models/tiny-llama/%s", cwd, files[i]);
        snprintf(q, sizeof q, "%s/%s", dir, files[i]);
        if (symlink(p, q) != 0) return -1;
    }
    snprintf(q, sizeof q, "%s/config.json", dir);
    return write_file(q, config);
}

static void rm_dir(const char *dir)
{
    const char *files[] = {"model.safetensors", "tokenizer.json", "tokenizer_config.json",
                           "config.json"};
    char q[4096];
    for (size_t i = 0; i < sizeof files / sizeof files[0]; i++) {
        snprintf(q, sizeof q, "%s/%s", dir, files[i]);
        unlink(q);
    }
    rmdir(dir);
}

#define TINY_CFG(arch, hidden, extra)                                                          \
    "{\"model_type\": \"" arch "\", \"hidden_size\": " hidden ", \"intermediate_size\": 64, "   \
    "\"num_hidden_layers\": 2, \"num_attention_heads\": 4, \"num_key_value_heads\": 2, "       \
    "\"head_dim\": 8, \"vocab_size\": 49152, \"rms_norm_eps\": 1e-6" extra "}"

static void test_loader_errors(void)
{
    char dir[256], err[512];
    struct model_load_opts lo = {0};
    model *m;
    /* the unmodified config loads */
    CHECK(fake_dir(dir, sizeof dir, TINY_CFG("llama", "32", "")) == 0);
    m = model_load(dir, &lo, err, sizeof err);
    CHECKF(m != NULL, "%s", err);
    if (m) {
        CHECK(model_get_config(m)->rope_type == MODEL_ROPE_NEOX);
        CHECK(!model_get_config(m)->tie_embeddings);
    }
    model_free(m);
    rm_dir(dir);
    /* unsupported architecture: named */
    CHECK(fake_dir(dir, sizeof dir, TINY_CFG("gpt2", "32", "")) == 0);
    m = model_load(dir, &lo, err, sizeof err);
    CHECK(m == NULL && strstr(err, "gpt2") != NULL);
    model_free(m);
    rm_dir(dir);
    /* shape mismatch: the tensor is named */
    CHECK(fake_dir(dir, sizeof dir, TINY_CFG("llama", "48", "")) == 0);
    m = model_load(dir, &lo, err, sizeof err);
    CHECKF(m == NULL && strstr(err, "model.embed_tokens.weight") != NULL, "%s", err);
    model_free(m);
    rm_dir(dir);
    /* qwen2 expects q/k/v biases that this checkpoint lacks: the missing one is named */
    CHECK(fake_dir(dir, sizeof dir, TINY_CFG("qwen2", "32", "")) == 0);
    m = model_load(dir, &lo, err, sizeof err);
    CHECKF(m == NULL && strstr(err, "missing tensor model.layers.0.self_attn.q_proj.bias"), "%s",
           err);
    model_free(m);
    rm_dir(dir);
    /* unsupported rope scaling */
    CHECK(fake_dir(dir, sizeof dir,
                   TINY_CFG("llama", "32", ", \"rope_scaling\": {\"rope_type\": \"yarn\", \"factor\": 4}")) == 0);
    m = model_load(dir, &lo, err, sizeof err);
    CHECKF(m == NULL && strstr(err, "yarn"), "%s", err);
    model_free(m);
    rm_dir(dir);
    /* not a model at all */
    m = model_load("tests/test.h", &lo, err, sizeof err);
    CHECK(m == NULL);
    m = model_load("/nonexistent/model.gguf", &lo, err, sizeof err);
    CHECK(m == NULL);
}

static void test_backend_select(void)
{
    char err[256];
    struct model_backend_opts bo = {.device = "tpu"};
    model *m = model_load("tests/models/tiny-qwen3", NULL, err, sizeof err);
    CHECKF(m != NULL, "%s", err);
    if (!m) return;
    CHECK(model_backend_create(m, &bo, err, sizeof err) == NULL && strstr(err, "tpu"));
    bo.device = "cpu";
    model_backend *b = model_backend_create(m, &bo, err, sizeof err);
    CHECK(b != NULL && strcmp(b->ops->name, "cpu") == 0);
    /* forward before kv_alloc is refused, not a crash */
    int32_t tok = 0, pos = 0;
    int64_t slot = 0;
    int32_t bt[1] = {0};
    struct step_seq sq = {.query_start = 0, .query_len = 1, .context_len = 1, .block_table = bt,
                          .n_blocks = 1};
    struct step st = {.n_tokens = 1, .token_ids = &tok, .positions = &pos, .slots = &slot,
                      .n_seqs = 1, .seqs = &sq};
    if (b) CHECK(b->ops->forward(b, &st, err, sizeof err) == SL_EINVAL);
    model_backend_destroy(b);
    model_free(m);
}

/* Tensor-parallel splits, checked without GPUs: the shapes our users run at
 * 2, 4 and 8 ranks, and the ones that do not split. */
static void test_tp_check(void)
{
    char err[256];
    struct model_config llama8b = {.n_head = 32, .n_head_kv = 8, .n_ff = 14336};
    struct model_config qwen72b = {.n_head = 64, .n_head_kv = 8, .n_ff = 29568};
    struct model_config smollm2 = {.n_head = 9, .n_head_kv = 3, .n_ff = 1536};
    struct model_config tinyq3 = {.n_head = 4, .n_head_kv = 2, .n_ff = 64};
    for (int n = 1; n <= 8; n *= 2) {
        CHECKF(model_tp_check(&llama8b, n, err, sizeof err) == 0, "llama 8B at %d: %s", n, err);
        CHECKF(model_tp_check(&qwen72b, n, err, sizeof err) == 0, "qwen 72B at %d: %s", n, err);
    }
    CHECK(model_tp_check(&llama8b, 16, err, sizeof err) == SL_EUNSUP && strstr(err, "8 KV heads"));
    CHECK(model_tp_check(&llama8b, 3, err, sizeof err) == SL_EUNSUP && strstr(err, "32 attention heads"));
    CHECK(model_tp_check(&smollm2, 1, err, sizeof err) == 0);
    CHECK(model_tp_check(&smollm2, 3, err, sizeof err) == 0);
    CHECK(model_tp_check(&smollm2, 2, err, sizeof err) == SL_EUNSUP && strstr(err, "9 attention heads") &&
          strstr(err, "multiple of 2"));
    CHECK(model_tp_check(&tinyq3, 2, err, sizeof err) == 0);
    CHECK(model_tp_check(&tinyq3, 4, err, sizeof err) == SL_EUNSUP && strstr(err, "2 KV heads"));
    CHECK(model_tp_check(&tinyq3, 8, err, sizeof err) == SL_EUNSUP);
    CHECK(model_tp_check(&tinyq3, 0, err, sizeof err) == SL_EINVAL);
    /* the CPU backend refuses tensor parallelism with a message naming it */
    model *m = model_load("tests/models/tiny-qwen3", NULL, err, sizeof err);
    CHECKF(m != NULL, "%s", err);
    if (!m) return;
    struct model_backend_opts bo = {.device = "cpu", .tensor_parallel_size = 2};
    CHECK(model_backend_create(m, &bo, err, sizeof err) == NULL && strstr(err, "tensor parallelism"));
    model_free(m);
}

/* SLUICE_BENCH=1: prefill 500 tokens then decode 128, one sequence, on the
 * default model; prints tok/s (not a test). */
static double now_s(void)
{
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return ts.tv_sec + ts.tv_nsec * 1e-9;
}

static void bench(const char *path)
{
    enum { NP = 500, NG = 128, NB = (NP + NG) / BLOCK + 1 };
    char err[512];
    model *m = model_load(path, NULL, err, sizeof err);
    if (!m) {
        printf("bench: %s\n", err);
        return;
    }
    struct model_backend_opts bo = {.device = "cpu", .max_tokens_per_step = NP, .max_seqs_per_step = 1};
    double t0 = now_s();
    model_backend *b = model_backend_create(m, &bo, err, sizeof err);
    if (!b || b->ops->kv_alloc(b, NB, BLOCK, err, sizeof err) != 0) {
        printf("bench: %s\n", err);
        model_backend_destroy(b);
        model_free(m);
        return;
    }
    printf("bench: backend created in %.2f s\n", now_s() - t0);
    static int32_t ids[NP + NG], pos[NP + NG], bt[NB];
    static int64_t slots[NP + NG];
    for (int i = 0; i < NB; i++) bt[i] = i;
    for (int i = 0; i < NP + NG; i++) ids[i] = 100 + (i * 7919) % 20000, pos[i] = i, slots[i] = i;
    uint64_t rng = 0;
    struct step_seq sq = {.query_len = NP, .context_len = NP, .block_table = bt, .n_blocks = NB,
                          .want_sample = true, .sampling = &g_greedy, .history = ids,
                          .n_prompt = NP, .n_history = NP, .rng = &rng};
    struct step st = {.n_tokens = NP, .token_ids = ids, .positions = pos, .slots = slots,
                      .n_seqs = 1, .seqs = &sq};
    /* a short warm-up step faults the mapped weights in */
    sq.query_len = sq.context_len = st.n_tokens = 1;
    b->ops->forward(b, &st, err, sizeof err);
    sq.query_len = sq.context_len = st.n_tokens = NP;
    t0 = now_s();
    if (b->ops->forward(b, &st, err, sizeof err) != 0) printf("bench: %s\n", err);
    double tp = now_s() - t0;
    t0 = now_s();
    for (int g = 0; g < NG; g++) {
        int p = NP + g;
        ids[p] = sq.out.token;
        sq.query_start = 0, sq.query_len = 1, sq.context_len = p + 1, sq.n_history = p + 1;
        st = (struct step){.n_tokens = 1, .token_ids = ids + p, .positions = pos + p,
                           .slots = slots + p, .n_seqs = 1, .seqs = &sq};
        if (b->ops->forward(b, &st, err, sizeof err) != 0) printf("bench: %s\n", err);
    }
    double td = now_s() - t0;
    printf("bench: prefill %d tokens %.1f tok/s, decode %d tokens %.1f tok/s (%d threads)\n", NP,
           NP / tp, NG, NG / td, omp_get_num_procs());
    model_backend_destroy(b);
    model_free(m);
}

int main(void)
{
    model_sampling_default(&g_greedy);
    if (getenv("SLUICE_BENCH")) {
        bench(getenv("SLUICE_BENCH_MODEL") ? getenv("SLUICE_BENCH_MODEL")
                                           : "models/SmolLM2-135M-Instruct.Q4_1.gguf");
        return 0;
    }
    const char *gguf = "models/SmolLM2-135M-Instruct.Q4_1.gguf";
    struct stat st;
    const char *alt = getenv("SLUICE_SMOLLM2_GOLDEN"); /* e.g. a golden from another reference */
    if (alt && *alt)
        run_model("smollm2", gguf, alt);
    else if (stat("tests/golden/smollm2/golden.json", &st) == 0)
        run_model("smollm2", gguf, "tests/golden/smollm2/golden.json");
    else
        run_model("smollm2", gguf, "tests/golden/smollm2_golden.json");
    run_model("tiny-llama", "tests/models/tiny-llama", "tests/models/tiny-llama/golden.json");
    run_model("tiny-qwen2", "tests/models/tiny-qwen2", "tests/models/tiny-qwen2/golden.json");
    run_model("tiny-qwen3", "tests/models/tiny-qwen3", "tests/models/tiny-qwen3/golden.json");
    run_model("tiny-qwen3-d128", "tests/models/tiny-qwen3-d128", "tests/models/tiny-qwen3-d128/golden.json");
    struct stat tst;
    if (stat("tests/models/tiny-llama/model.safetensors", &tst) == 0) {
        RUN(test_loader_errors);
        RUN(test_backend_select);
        RUN(test_tp_check);
    } else {
        printf("note: tests/models/tiny-llama absent: loader error tests skipped\n");
    }
    return test_summary();
}

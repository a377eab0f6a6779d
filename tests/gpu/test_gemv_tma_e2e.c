/* test_gemv_tma_e2e.c - one-token decode with the fused GEMVs on
 * cuda_gemv_tma (SLUICE_CUDA_GEMV_TMA=15) against the same backend on
 * gemv.cu's kernels, and against the CPU backend (make gpu-test; needs a
 * GPU; on one below compute capability 9 the path is not taken and the test
 * says so).
 *
 * Two dummy-weight shapes whose widths are multiples of 1024
 * (tests/gpu/configs): a llama (llama3 RoPE) and a qwen3 (q/k norms). One
 * sequence over a block table in reverse order; a prompt prefilled in one
 * step, then teacher-forced decode steps of one token at several contexts.
 * The GEMVs sum in the same order, so every step's logits must be bit for bit
 * those of the kernel path; against the CPU within bf16 tolerance, and the
 * argmax equal to the CPU's unless its top-2 are a near-tie.
 */
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "cuda/kernels.h"
#include "model/backend.h"
#include "tests/test.h"

#define BLOCK 16
#define NBLK 160 /* 2560 tokens */
#define NSTEP 6

static model *g_model;
static model_backend *g_cpu, *g_alt, *g_plain;
static int g_nv;
static int32_t g_bt[NBLK];
static const char *g_name;

static int run(model_backend *be, const int32_t *ids, int start, int len, float *logits)
{
    int32_t *pos = malloc(len * 4);
    int64_t *slots = malloc(len * 8);
    for (int j = 0; j < len; j++) {
        int p = start + j;
        pos[j] = p;
        slots[j] = (int64_t)g_bt[p / BLOCK] * BLOCK + p % BLOCK;
    }
    struct step_seq sq = {.query_start = 0, .query_len = len, .context_len = start + len, .block_table = g_bt,
                          .n_blocks = NBLK, .logits_out = logits};
    struct step st = {.n_tokens = len, .token_ids = ids + start, .positions = pos, .slots = slots, .n_seqs = 1,
                      .seqs = &sq};
    char err[256];
    int rc = be->ops->forward(be, &st, err, sizeof err);
    if (rc) printf("  forward (%s): %s\n", be->ops->name, err);
    free(pos), free(slots);
    return rc;
}

static double rel_inf(const float *a, const float *b, int n)
{
    double d = 0, m = 0;
    for (int i = 0; i < n; i++) {
        if (!(fabs(a[i] - b[i]) <= d)) d = fabs(a[i] - b[i]);
        if (fabs(b[i]) > m) m = fabs(b[i]);
    }
    return m > 0 ? d / m : d;
}

static int argmax(const float *x, int n, float *gap)
{
    int b = 0, s = -1;
    for (int i = 1; i < n; i++)
        if (x[i] > x[b]) s = b, b = i;
        else if (s < 0 || x[i] > x[s]) s = i;
    if (gap) *gap = x[b] - x[s];
    return b;
}

/* prompt of P tokens, then NSTEP decode steps */
static void check_context(int P)
{
    int n = P + NSTEP;
    int32_t *ids = malloc(n * 4);
    uint64_t r = 0x9e3779b97f4a7c15ull ^ (uint64_t)P;
    for (int i = 0; i < n; i++) {
        r = r * 6364136223846793005ull + 1442695040888963407ull;
        ids[i] = (int32_t)((r >> 33) % (uint64_t)g_nv);
    }
    float *lc = malloc((size_t)g_nv * 4), *lm = malloc((size_t)g_nv * 4), *lp = malloc((size_t)g_nv * 4);
    CHECK(run(g_cpu, ids, 0, P, lc) == 0 && run(g_alt, ids, 0, P, lm) == 0 && run(g_plain, ids, 0, P, lp) == 0);
    double worst_k = 0, worst_c = 0;
    int same = 0, ties = 0;
    for (int s = 0; s < NSTEP; s++) {
        int st = P + s;
        if (run(g_cpu, ids, st, 1, lc) || run(g_alt, ids, st, 1, lm) || run(g_plain, ids, st, 1, lp)) {
            CHECK(0);
            break;
        }
        double dk = rel_inf(lm, lp, g_nv), dc = rel_inf(lm, lc, g_nv);
        if (dk > worst_k) worst_k = dk;
        if (dc > worst_c) worst_c = dc;
        same += memcmp(lm, lp, (size_t)g_nv * 4) == 0;
        float gap, mx = 0;
        int ac = argmax(lc, g_nv, &gap), am = argmax(lm, g_nv, NULL);
        for (int i = 0; i < g_nv; i++) mx = fmaxf(mx, fabsf(lc[i]));
        if (am != ac) {
            if (gap <= 0.02f * mx) ties++;
            else CHECKF(am == ac, "%s ctx %d: argmax %d, cpu %d (gap %.3g of %.3g)", g_name, st + 1, am, ac, gap, mx);
        }
    }
    printf("  %s, context %d..%d: %d of %d steps bit-identical to the kernel path (largest difference %.2e), "
           "vs cpu %.2e, %d near-ties\n",
           g_name, P + 1, P + NSTEP, same, NSTEP, worst_k, worst_c, ties);
    CHECKF(same == NSTEP, "%s: %d of %d steps differ from the kernel path", g_name, NSTEP - same, NSTEP);
    CHECKF(worst_c < 3e-2, "%s: gemv_tma vs cpu %.3g", g_name, worst_c);
    free(ids), free(lc), free(lm), free(lp);
}

static void test_one_split(void) { check_context(5); }
static void test_few_splits(void) { check_context(150); }
static void test_many_splits(void) { check_context(1500); }
static void test_block_edge(void) { check_context(BLOCK * 40 - 3); } /* decode crosses a block boundary */

static void run_model(const char *name, const char *cfg)
{
    char err[512];
    g_name = name;
    struct model_load_opts lo = {.tokenizer = "tests/models/tiny-qwen3", .load_format = "dummy"};
    g_model = model_load(cfg, &lo, err, sizeof err);
    if (!g_model) {
        printf("  %s: load: %s\n", name, err);
        t_fail++;
        return;
    }
    g_nv = model_get_config(g_model)->n_vocab;
    struct model_backend_opts bo = {.device = "cpu", .max_tokens_per_step = 2048, .max_seqs_per_step = 8,
                                    .max_ctx = NBLK * BLOCK};
    g_cpu = model_backend_create(g_model, &bo, err, sizeof err);
    bo.device = "cuda";
    setenv("SLUICE_CUDA_GEMV_TMA", "15", 1);
    g_alt = model_backend_create(g_model, &bo, err, sizeof err);
    unsetenv("SLUICE_CUDA_GEMV_TMA");
    g_plain = model_backend_create(g_model, &bo, err, sizeof err);
    if (!g_cpu || !g_alt || !g_plain || g_cpu->ops->kv_alloc(g_cpu, NBLK, BLOCK, err, sizeof err) ||
        g_alt->ops->kv_alloc(g_alt, NBLK, BLOCK, err, sizeof err) ||
        g_plain->ops->kv_alloc(g_plain, NBLK, BLOCK, err, sizeof err)) {
        printf("  %s: backends: %s\n", name, err);
        t_fail++;
    } else {
        for (int j = 0; j < NBLK; j++) g_bt[j] = NBLK - 1 - j;
        printf("%s\n", name);
        RUN(test_one_split);
        RUN(test_few_splits);
        RUN(test_many_splits);
        RUN(test_block_edge);
    }
    model_backend_destroy(g_plain);
    model_backend_destroy(g_alt);
    model_backend_destroy(g_cpu);
    model_free(g_model);
}

int main(void)
{
    if (!model_cuda_available()) {
        printf("no GPU: skipped\n0 passed, 0 failed\n");
        return 0;
    }
    if (!cuda_gemv_tma_ok(1024)) {
        printf("note: cuda_gemv_tma needs compute capability 9: skipped\n0 passed, 0 failed\n");
        return 0;
    }
    run_model("dec-llama", "tests/gpu/configs/dec-llama");
    run_model("dec-qwen3", "tests/gpu/configs/dec-qwen3");
    return test_summary();
}

/* test_moe.c - mixture-of-experts layers (model/moe.c) on the CPU backend.
 *
 * Checkpoints and goldens come from tests/golden/moe/make_moe.py (transformers
 * 5.25 at tiny random configs, f32 on the CPU): qwen3_moe with and without
 * norm_topk_prob, per-expert and fused 3-D expert tensors; glm4_moe with the
 * group-limited sigmoid router, correction bias, scaling and a shared expert;
 * qwen2_moe with its sigmoid-gated shared expert;
 * and qwen3_moe with int4 experts (some left bf16 by `ignore`) against the
 * library's dequantization run densely, and with every linear layer AWQ int4
 * (experts included) against AutoAWQ's dequantization. Per checkpoint: logits at every
 * position within 1e-4 relative of transformers, greedy identical, chunked
 * prefill bit-identical to one step, and a prompt's logits bit-identical alone
 * and beside other prompts (batch invariance). Then the router on hand-made
 * scores, the routing margin the GPU tests explain flips with
 * (model_moe_route_margin, cpu_backend_route_margins), the config errors,
 * and --load-format dummy on an MoE config.
 */
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

#include "model/backend.h"
#include "model/cpu_internal.h"
#include "model/moe.h"
#include "tests/test.h"
#include "tests/golden.h"

#define BLOCK 16
#define REGION 8 /* blocks per sequence */
#define NSEQ 3

static const char *const CKPTS[] = {"tiny-qwen3-moe", "tiny-qwen3-moe-fused", "tiny-glm4-moe", "tiny-qwen3-moe-w4",
                                    "tiny-qwen2-moe", "tiny-qwen3-moe-awq"};

struct seqin {
    const int32_t *ids;
    int start, n;       /* positions start..start+n-1 of ids */
    const int32_t *bt;  /* [REGION] */
    float *logits;      /* [nv]: the last position's */
};

/* One step over several sequences (each its own blocks). */
static int step_multi(model_backend *be, const struct seqin *in, int ns)
{
    int32_t pos[512], ids[512];
    int64_t slots[512];
    struct step_seq sq[NSEQ];
    char err[256];
    int T = 0;
    for (int s = 0; s < ns; s++) {
        sq[s] = (struct step_seq){.query_start = T, .query_len = in[s].n, .context_len = in[s].start + in[s].n,
                                  .block_table = in[s].bt, .n_blocks = REGION, .logits_out = in[s].logits};
        for (int t = 0; t < in[s].n; t++, T++) {
            int p = in[s].start + t;
            pos[T] = p;
            ids[T] = in[s].ids[p];
            slots[T] = (int64_t)in[s].bt[p / BLOCK] * BLOCK + p % BLOCK;
        }
    }
    struct step st = {.n_tokens = T, .token_ids = ids, .positions = pos, .slots = slots, .n_seqs = ns, .seqs = sq};
    int rc = be->ops->forward(be, &st, err, sizeof err);
    if (rc) printf("  forward: %s\n", err);
    return rc;
}

static void run_checkpoint(const char *name)
{
    char dir[256], gpath[300], err[512];
    snprintf(dir, sizeof dir, "tests/models/%s", name);
    snprintf(gpath, sizeof gpath, "%s/golden.json", dir);
    model *m = model_load(dir, NULL, err, sizeof err);
    CHECKF(m != NULL, "%s: %s", name, err);
    if (!m) return;
    const struct model_config *c = model_get_config(m);
    int n_moe = 0;
    for (int l = 0; l < c->n_layer; l++) n_moe += model_layer_kind_of(c, l).ffn == MODEL_FFN_MOE;
    CHECKF(n_moe > 0 && n_moe < c->n_layer, "%s: %d MoE layers of %d (expected some, not all)", name, n_moe,
           c->n_layer);
    struct golden g;
    CHECK(golden_load(gpath, &g) == 0);
    int nv = c->n_vocab;
    model_backend *be = golden_backend(m, 2, REGION * BLOCK, NSEQ * REGION, BLOCK, name);
    if (!be) {
        model_free(m);
        golden_free(&g);
        return;
    }
    int32_t bt[NSEQ][REGION];
    for (int s = 0; s < NSEQ; s++)
        for (int j = 0; j < REGION; j++) bt[s][j] = s * REGION + (REGION - 1 - j);
    struct golden_run r0 = {be, bt[0], REGION, BLOCK, nv};
    double worst = 0;
    for (int i = 0; i < g.np; i++) {
        struct prompt *p = &g.p[i];
        float *all = malloc((size_t)p->n * nv * sizeof *all), *one = malloc((size_t)nv * sizeof *one);
        float *side = malloc((size_t)(NSEQ + 1) * nv * sizeof *side);
        CHECK(golden_step(&r0, p->ids, 0, p->n, true, all) == 0);
        worst = golden_worst(all, p, nv, worst);
        /* chunked prefill (chunks of 5): the last logits are the one-step ones, bit for bit */
        CHECK(golden_chunked(&r0, p->ids, p->n, 5, one) == 0);
        CHECKF(memcmp(one, all + (size_t)(p->n - 1) * nv, (size_t)nv * sizeof *one) == 0,
               "%s prompt %d: chunked prefill logits differ from the one-step logits", name, i);
        /* the prompt alone, then beside the other prompts (which route their
         * tokens to the same experts in the same step): the same bits */
        struct seqin alone = {p->ids, 0, p->n, bt[0], side};
        CHECK(step_multi(be, &alone, 1) == 0);
        struct seqin mix[NSEQ];
        int ns = 0;
        for (int q = 0; q < g.np && ns < NSEQ - 1; q++)
            if (q != i) {
                mix[ns] = (struct seqin){g.p[q].ids, 0, g.p[q].n, bt[ns + 1], side + (size_t)(ns + 1) * nv};
                ns++;
            }
        /* last in the step, in its own blocks (rewritten with the same K/V) */
        float *mine = side + (size_t)(ns + 1) * nv;
        mix[ns++] = (struct seqin){p->ids, 0, p->n, bt[0], mine};
        CHECK(step_multi(be, mix, ns) == 0);
        CHECKF(memcmp(side, mine, (size_t)nv * sizeof *side) == 0,
               "%s prompt %d: logits differ alone and beside %d other prompts", name, i, ns - 1);
        /* greedy decode, one token a step, against transformers' continuation */
        int32_t seq[256];
        int first_diff = golden_greedy(&r0, p, one, seq);
        CHECKF(first_diff < 0, "%s prompt %d: greedy differs from transformers at token %d", name, i, first_diff);
        free(all);
        free(one);
        free(side);
    }
    printf("  %s: worst relative logit error %.3g, greedy %s\n", name, worst,
           t_cur_failed ? "checked (see above)" : "identical");
    CHECKF(worst <= 1e-4, "%s: worst relative logit error %.3g > 1e-4", name, worst);
    model_backend_destroy(be);
    model_free(m);
    golden_free(&g);
}

static void test_checkpoints(void)
{
    for (size_t i = 0; i < sizeof CKPTS / sizeof *CKPTS; i++) run_checkpoint(CKPTS[i]);
}

/* The router on scores made by hand, each expectation worked out from the
 * rule transformers implements. */
static void test_router(void)
{
    float scr[64], wt[8];
    int32_t idx[8];
    /* softmax top-2 of 8, renormalised: experts 5 and 2 */
    struct model_moe_config sm = {.n_expert = 8, .n_expert_used = 2, .router = MODEL_ROUTER_SOFTMAX,
                                  .norm_topk = true, .scale = 1, .n_group = 1, .topk_group = 1};
    float lg[8] = {0.1f, -1, 2.0f, 0, 0.5f, 3.0f, -2, 1.0f};
    model_moe_route(&sm, lg, NULL, idx, wt, scr);
    CHECK(idx[0] == 2 && idx[1] == 5);
    double e2 = exp(2.0), e5 = exp(3.0);
    CHECKF(fabs(wt[0] - e2 / (e2 + e5)) < 1e-6 && fabs(wt[1] - e5 / (e2 + e5)) < 1e-6, "%g %g", wt[0], wt[1]);
    /* without renormalisation the weights are the full softmax's */
    sm.norm_topk = false;
    model_moe_route(&sm, lg, NULL, idx, wt, scr);
    double z = 0;
    for (int i = 0; i < 8; i++) z += exp(lg[i]);
    CHECKF(fabs(wt[1] - e5 / z) < 1e-6, "%g vs %g", wt[1], e5 / z);
    /* sigmoid, 8 experts in 4 groups of 2, best 2 groups, top-2. Choice
     * scores (sigmoid + bias) by group: {0.9, 0.1} {0.6, 0.6} {0.7, 0.45}
     * {0.2, 0.2}: group sums 1.0, 1.2, 1.15, 0.4, so groups 1 and 2 are kept
     * and expert 0 (the best single score) is not chosen; the top-2 inside
     * are 4 (0.7) and then 2 or 3 (0.6 each: the lower index). The bias only
     * chooses: the weights are the sigmoids, renormalised, times 2.5. */
    struct model_moe_config sg = {.n_expert = 8, .n_expert_used = 2, .router = MODEL_ROUTER_SIGMOID,
                                  .norm_topk = true, .scale = 2.5f, .n_group = 4, .topk_group = 2};
    float choice[8] = {0.9f, 0.1f, 0.6f, 0.6f, 0.7f, 0.45f, 0.2f, 0.2f}, bias[8], l2[8];
    for (int i = 0; i < 8; i++) {
        l2[i] = 0.3f * (float)(i - 4); /* sigmoid scores below 0.5..., bias makes up the rest */
        bias[i] = choice[i] - 1.0f / (1.0f + expf(-l2[i]));
    }
    model_moe_route(&sg, l2, bias, idx, wt, scr);
    CHECKF(idx[0] == 2 && idx[1] == 4, "chose %d %d", idx[0], idx[1]);
    double s2 = 1 / (1 + exp(-l2[2])), s4 = 1 / (1 + exp(-l2[4]));
    CHECKF(fabs(wt[0] - 2.5 * s2 / (s2 + s4)) < 1e-5 && fabs(wt[1] - 2.5 * s4 / (s2 + s4)) < 1e-5, "%g %g", wt[0],
           wt[1]);
    /* one group: plain top-k of the choice scores (expert 0 and 4) */
    sg.n_group = sg.topk_group = 1;
    model_moe_route(&sg, l2, bias, idx, wt, scr);
    CHECKF(idx[0] == 0 && idx[1] == 4, "chose %d %d", idx[0], idx[1]);
}

/* model_moe_route_margin: by hand on a softmax router, then on random
 * sigmoid routers with a correction bias, where moving every chosen
 * expert's logit down and every other's up by half the margin keeps the
 * choice and by twice the margin changes it; then the CPU backend's report
 * of it (a dense first layer reports INFINITY). */
static void test_route_margin(void)
{
    float scr[64], wt[8];
    int32_t idx[8], idx2[8];
    struct model_moe_config sm = {.n_expert = 8, .n_expert_used = 2, .router = MODEL_ROUTER_SOFTMAX,
                                  .norm_topk = true, .scale = 1, .n_group = 1, .topk_group = 1};
    float lg[8] = {0.1f, -1, 2.0f, 0, 0.5f, 3.0f, -2, 1.0f};
    float m = model_moe_route_margin(&sm, lg, NULL, scr);
    CHECKF(fabsf(m - 0.5f) < 1e-6f, "softmax margin %g, want 0.5 (experts 2 and 7, half their gap)", m);
    struct model_moe_config sg = {.n_expert = 16, .n_expert_used = 4, .router = MODEL_ROUTER_SIGMOID,
                                  .norm_topk = true, .scale = 1, .n_group = 1, .topk_group = 1};
    uint64_t rng = 7;
    int checked = 0, bad = 0;
    for (int c = 0; c < 300; c++) {
        float l[16], bias[16], mv[16];
        for (int i = 0; i < 16; i++) {
            rng = rng * 6364136223846793005ull + 1442695040888963407ull;
            l[i] = (float)((rng >> 40) % 2000) / 1000.0f - 1.0f;
            bias[i] = (float)((rng >> 20) % 100) / 1000.0f;
        }
        m = model_moe_route_margin(&sg, l, bias, scr);
        if (!(m > 1e-4f && m < 0.1f)) continue; /* where the linearisation holds */
        checked++;
        model_moe_route(&sg, l, bias, idx, wt, scr);
        for (int f = 0; f < 2; f++) {
            float d = f ? 2.0f * m : 0.5f * m;
            for (int i = 0; i < 16; i++) {
                bool ch = false;
                for (int j = 0; j < 4; j++) ch = ch || idx[j] == i;
                mv[i] = l[i] + (ch ? -d : d);
            }
            model_moe_route(&sg, mv, bias, idx2, wt, scr);
            bool same = memcmp(idx, idx2, sizeof(int32_t) * 4) == 0;
            bad += f ? same : !same;
        }
    }
    printf("  route margin: %d random sigmoid routers, %d moved otherwise than their margin says\n", checked, bad);
    CHECKF(checked >= 50 && bad == 0, "%d random routers checked, %d moved otherwise than their margin says",
           checked, bad);
    /* the backend's report: tiny-glm4-moe's first layer is dense */
    char err[256];
    struct model_load_opts lo = {0};
    model *mo = model_load("tests/models/tiny-glm4-moe", &lo, err, sizeof err);
    CHECKF(mo != NULL, "%s", err);
    if (!mo) return;
    const struct model_config *c = model_get_config(mo);
    model_backend *be = golden_backend(mo, 1, REGION * BLOCK, REGION, BLOCK, "tiny-glm4-moe");
    if (be) {
        int32_t ids[5] = {3, 14, 15, 92, 65}, bt[REGION];
        for (int j = 0; j < REGION; j++) bt[j] = j;
        float *lgo = malloc((size_t)c->n_vocab * 4), *mg = malloc((size_t)c->n_layer * 5 * sizeof *mg);
        struct seqin in = {.ids = ids, .start = 0, .n = 5, .bt = bt, .logits = lgo};
        cpu_backend_route_margins(be, mg);
        CHECK(step_multi(be, &in, 1) == 0);
        cpu_backend_route_margins(be, NULL);
        int wrong = 0;
        for (int l = 0; l < c->n_layer; l++)
            for (int t = 0; t < 5; t++) {
                float v = mg[l * 5 + t];
                wrong += model_layer_kind_of(c, l).ffn == MODEL_FFN_MOE ? !(v >= 0 && isfinite(v)) : v != INFINITY;
            }
        CHECKF(wrong == 0, "%d of %d margins wrong (dense layers INFINITY, MoE layers finite)", wrong, c->n_layer * 5);
        free(lgo), free(mg);
        model_backend_destroy(be);
    }
    model_free(mo);
}

/* A config.json edited to carry one bad MoE value is refused naming the key. */
static void test_config_errors(void)
{
    static const struct { const char *from, *to, *says; } cases[] = {
        {"\"num_experts_per_tok\": 4", "\"num_experts_per_tok\": 40", "num_experts_per_tok"},
        {"\"n_group\": 4", "\"n_group\": 3", "n_group"},
        {"\"n_group\": 4", "\"n_group\": \"4\"", "n_group"},
        {"\"first_k_dense_replace\": 1", "\"first_k_dense_replace\": -1", "first_k_dense_replace"},
        /* the weights then disagree with the config: the tensor is named */
        {"\"moe_intermediate_size\": 16", "\"moe_intermediate_size\": 32", "mlp.experts.0.gate_proj.weight has shape"},
        {"\"n_routed_experts\": 16", "\"n_routed_experts\": 20", "model.layers.1.mlp.gate.weight has shape"},
    };
    char tmpl[] = "/tmp/sluice_moe_XXXXXX";
    char *dir = mkdtemp(tmpl);
    CHECK(dir != NULL);
    if (!dir) return;
    size_t len;
    char *src = test_slurp("tests/models/tiny-glm4-moe/config.json", &len);
    CHECK(src != NULL);
    char path[512], err[512], cwd[256];
    CHECK(getcwd(cwd, sizeof cwd) != NULL);
    const char *files[] = {"model.safetensors", "tokenizer_config.json"};
    for (size_t i = 0; i < 2; i++) {
        char from[512], to[512];
        snprintf(from, sizeof from, "%s/tests/models/tiny-glm4-moe/%s", cwd, files[i]);
        snprintf(to, sizeof to, "%s/%s", dir, files[i]);
        CHECK(symlink(from, to) == 0);
    }
    snprintf(path, sizeof path, "%s/tokenizer.json", dir);
    char tokabs[512];
    snprintf(tokabs, sizeof tokabs, "%s/tests/models/quant/ct-w4g32-sym/tokenizer.json", cwd);
    CHECK(symlink(tokabs, path) == 0);
    snprintf(path, sizeof path, "%s/config.json", dir);
    for (size_t i = 0; src && i < sizeof cases / sizeof *cases; i++) {
        const char *at = strstr(src, cases[i].from);
        CHECKF(at != NULL, "config lacks %s", cases[i].from);
        if (!at) continue;
        FILE *f = fopen(path, "w");
        fprintf(f, "%.*s%s%s", (int)(at - src), src, cases[i].to, at + strlen(cases[i].from));
        fclose(f);
        model *m = model_load(dir, NULL, err, sizeof err);
        CHECKF(m == NULL && strstr(err, cases[i].says), "%s -> %s", cases[i].to, m ? "loaded" : err);
        model_free(m);
    }
    free(src);
    const char *names[] = {"config.json", "model.safetensors", "tokenizer_config.json", "tokenizer.json"};
    for (size_t i = 0; i < 4; i++) {
        snprintf(path, sizeof path, "%s/%s", dir, names[i]);
        unlink(path);
    }
    rmdir(dir);
}

/* A compressed-tensors config whose "Linear" target would take the router if
 * it were an nn.Linear: transformers 5 makes it a parameter of its router
 * module, so it stays dense without being listed in ignore. */
static void test_router_not_linear(void)
{
    char tmpl[] = "/tmp/sluice_moe_XXXXXX", cwd[256], path[512], from[600], err[512];
    char *dir = mkdtemp(tmpl);
    CHECK(dir != NULL && getcwd(cwd, sizeof cwd) != NULL);
    if (!dir) return;
    const char *files[] = {"model.safetensors", "tokenizer_config.json", "tokenizer.json"};
    for (size_t i = 0; i < 3; i++) {
        snprintf(from, sizeof from, "%s/tests/models/tiny-qwen3-moe-w4/%s", cwd, files[i]);
        snprintf(path, sizeof path, "%s/%s", dir, files[i]);
        CHECK(symlink(from, path) == 0);
    }
    size_t len;
    char *src = test_slurp("tests/models/tiny-qwen3-moe-w4/config.json", &len);
    const char *t0 = "\"re:.*mlp\\\\.experts\\\\..*\"", *i0 = "\"re:.*mlp\\\\.gate$\"";
    char *t = src ? strstr(src, t0) : NULL, *ig = src ? strstr(src, i0) : NULL;
    CHECKF(t && ig && t < ig, "config.json lacks %s before %s", t0, i0);
    if (t && ig && t < ig) {
        snprintf(path, sizeof path, "%s/config.json", dir);
        FILE *f = fopen(path, "w");
        fprintf(f, "%.*s\"Linear\"%.*s\"re:.*self_attn.*\", \"re:.*layers\\\\.0\\\\..*\"%s", (int)(t - src), src,
                (int)(ig - t - strlen(t0)), t + strlen(t0), ig + strlen(i0));
        fclose(f);
        model *m = model_load(dir, NULL, err, sizeof err);
        CHECKF(m != NULL, "%s", err);
        if (m) {
            const struct model_moe_weights *mw = &model_get_weights(m)->layers[2].moe;
            CHECK(mw->router.dtype == MODEL_DT_BF16 && mw->up[5].dtype == MODEL_DT_QPACK);
        }
        model_free(m);
    }
    free(src);
    const char *names[] = {"config.json", "model.safetensors", "tokenizer_config.json", "tokenizer.json"};
    for (size_t i = 0; i < 4; i++) {
        snprintf(path, sizeof path, "%s/%s", dir, names[i]);
        unlink(path);
    }
    rmdir(dir);
}

/* --load-format dummy builds every expert from the config alone and runs;
 * with a quantization_config, the experts it quantizes are packed (and those
 * it ignores are not). */
static void run_dummy(const char *dir, bool packed)
{
    char err[512];
    struct model_load_opts lo = {.load_format = "dummy"};
    model *m = model_load(dir, &lo, err, sizeof err);
    CHECKF(m != NULL, "%s", err);
    if (!m) return;
    const struct model_config *c = model_get_config(m);
    CHECK(model_layer_kind_of(c, 0).ffn == MODEL_FFN_DENSE && model_layer_kind_of(c, 1).ffn == MODEL_FFN_MOE);
    const struct model_moe_weights *mw = &model_get_weights(m)->layers[1].moe;
    CHECK(mw->gate[0].dtype == MODEL_DT_BF16);
    CHECKF(mw->gate[1].dtype == (packed ? MODEL_DT_QPACK : MODEL_DT_BF16), "%s", model_dtype_name(mw->gate[1].dtype));
    CHECK(!packed || (mw->down[3].dtype == MODEL_DT_QPACK && mw->down[3].quant->bits == 4 &&
                      mw->down[3].quant->group == 16 && mw->router.dtype == MODEL_DT_BF16));
    struct model_backend_opts bo = {.device = "cpu", .n_threads = 1, .max_tokens_per_step = 64, .max_ctx = 64};
    model_backend *be = model_backend_create(m, &bo, err, sizeof err);
    CHECKF(be != NULL, "%s", err);
    if (be && be->ops->kv_alloc(be, REGION, BLOCK, err, sizeof err) == 0) {
        int32_t ids[6] = {1, 2, 3, 4, 5, 6}, bt[REGION];
        for (int j = 0; j < REGION; j++) bt[j] = j;
        float *lg = malloc((size_t)c->n_vocab * sizeof *lg);
        struct seqin in = {ids, 0, 6, bt, lg};
        CHECK(step_multi(be, &in, 1) == 0);
        bool finite = true;
        for (int i = 0; i < c->n_vocab; i++) finite = finite && isfinite(lg[i]);
        CHECK(finite);
        free(lg);
    }
    model_backend_destroy(be);
    model_free(m);
}

static void test_dummy(void)
{
    run_dummy("tests/models/tiny-glm4-moe", false);
    run_dummy("tests/models/tiny-qwen3-moe-w4", true);
}

/* Where the GPU backend exists, it refuses an MoE model naming the layer
 * (until it implements the kind), rather than running it wrong. */
static void test_gpu_refuses(void)
{
    if (!model_cuda_available()) {
        printf("  (no CUDA device: skipped)\n");
        return;
    }
    char err[512] = "";
    model *m = model_load("tests/models/tiny-qwen3-moe", NULL, err, sizeof err);
    CHECKF(m != NULL, "%s", err);
    if (!m) return;
    struct model_backend_opts bo = {.device = "cuda", .max_tokens_per_step = 64, .max_ctx = 64};
    model_backend *be = model_backend_create(m, &bo, err, sizeof err);
    CHECKF(be == NULL && strstr(err, "layer 1 is gqa + moe"), "%s", be ? "created" : err);
    model_backend_destroy(be);
    model_free(m);
}

/* sluice info's plan line. */
static void test_plan_describe(void)
{
    char err[512], buf[512];
    model *m = model_load("tests/models/tiny-glm4-moe", NULL, err, sizeof err);
    CHECKF(m != NULL, "%s", err);
    if (!m) return;
    model_plan_describe(model_get_config(m), buf, sizeof buf);
    CHECKF(strcmp(buf, "0: gqa + dense; 1-2: gqa + moe 16 experts top-4 (+1 shared), sigmoid router by groups") == 0,
           "%s", buf);
    model_free(m);
}

int main(void)
{
    RUN(test_router);
    RUN(test_route_margin);
    RUN(test_checkpoints);
    RUN(test_config_errors);
    RUN(test_router_not_linear);
    RUN(test_dummy);
    RUN(test_plan_describe);
    RUN(test_gpu_refuses);
    return test_summary();
}

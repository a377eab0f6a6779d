/* test_mla.c - multi-head latent attention (model/mla.c, model/cpu_mla.c)
 * against transformers: tests/models/mla/, made by
 * tests/golden/mla/make_mla.py (deepseek_v3 with and without q_lora, with
 * YaRN, without RoPE, at DeepSeek's latent width 512; glm_moe_dsa with its
 * DSA indexer on and, through
 * --hf-overrides' nested index_topk null, off).
 *
 * For each checkpoint and prompt:
 *  - the decode form (absorbed: one 1-token sequence per position, sharing
 *    the prompt's blocks) gives transformers' logits at every position (top
 *    20, <= 1e-4 relative), and so does the prefill form (expanded: the
 *    prompt in one step) at the last position;
 *  - a chunked prefill gives bit-identical logits to the one-step pass;
 *  - greedy decoding, one token a step, is transformers' continuation;
 *  - the cached decode's last logits equal an uncached forward over the
 *    whole sequence (<= 1e-4 relative: the two forms round differently);
 * and: the KV pool's bytes per block follow each layer's kind (latent + rope
 * (+ indexer key), no heads); index_topk null skips the indexer's tensors;
 * the MTP layers' tensors are counted and switched off by an override; a MoE
 * FFN layer is refused naming the layer; positions past the prompt are
 * computed in the absorbed form however many share a step; through the engine,
 * a prefix-cache hit gives the same tokens as a miss, and chunked or preempted
 * runs the same as lone ones; the indexer's top-k margins
 * (cpu_backend_index_margins) are reported where and only where a query
 * chooses, in [0, 2], the same for a position in a prefill and in a decode
 * step.
 */
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>
#include <unistd.h>

#include "base/json.h"
#include "model/backend.h"
#include "model/cpu_internal.h"
#include "model/model.h"
#include "sched/sched.h"
#include "tests/test.h"
#include "tests/golden.h"

#define MDIR "tests/models/mla"
#define BLOCK 16
#define REGION 8 /* blocks per block table: 128 positions */

struct ckpt {
    const char *dir, *golden, *overrides;
};
static const struct ckpt CKPTS[] = {
    {"dsv3-qlora", "golden.json", NULL},
    {"dsv3-noqlora", "golden.json", NULL},
    {"dsv3-yarn", "golden.json", NULL},
    {"dsv3-norope", "golden.json", NULL},
    {"dsv3-c512", "golden.json", NULL},
    {"glm-dsa", "golden.json", NULL},
    {"glm-dsa", "golden_dense.json", "{\"text_config\": {\"index_topk\": null}}"},
};
#define NCK (int)(sizeof CKPTS / sizeof CKPTS[0])

static char err[512];

static model *load(const char *dir, const char *overrides)
{
    char path[256];
    snprintf(path, sizeof path, "%s/%s", MDIR, dir);
    struct model_load_opts lo = {.hf_overrides = overrides};
    model *m = model_load(path, &lo, err, sizeof err);
    CHECKF(m != NULL, "%s: %s", dir, err);
    return m;
}

static double rel_diff(const float *a, const float *b, int n)
{
    double md = 0, mr = 0;
    for (int i = 0; i < n; i++) {
        double d = fabs((double)a[i] - b[i]);
        md = d > md ? d : md;
        mr = fabs(b[i]) > mr ? fabs(b[i]) : mr;
    }
    return md / (mr > 0 ? mr : 1);
}

static void run_checkpoint(const struct ckpt *ck)
{
    char gpath[300];
    snprintf(gpath, sizeof gpath, "%s/%s/%s", MDIR, ck->dir, ck->golden);
    struct stat st;
    if (stat(gpath, &st) != 0) {
        CHECKF(0, "%s: no golden (make_mla.py)", gpath);
        return;
    }
    model *m = load(ck->dir, ck->overrides);
    if (!m) return;
    struct golden g;
    CHECK(golden_load(gpath, &g) == 0);
    int nv = model_get_config(m)->n_vocab;
    model_backend *be = golden_backend(m, 2, REGION * BLOCK, 2 * REGION, BLOCK, ck->dir);
    if (!be) {
        model_free(m);
        golden_free(&g);
        return;
    }
    int32_t bt[REGION], bt2[REGION];
    for (int j = 0; j < REGION; j++) bt[j] = REGION - 1 - j, bt2[j] = REGION + j;
    struct golden_run r1 = {be, bt, REGION, BLOCK, nv}, r2 = {be, bt2, REGION, BLOCK, nv};
    double worst = 0, worst_pf = 0, worst_cache = 0;
    for (int i = 0; i < g.np; i++) {
        struct prompt *p = &g.p[i];
        int total = p->n + p->n_greedy;
        float *all = malloc((size_t)total * nv * sizeof *all), *one = malloc((size_t)nv * sizeof *one),
              *pf = malloc((size_t)nv * sizeof *pf);
        /* decode form at every position */
        CHECK(golden_step(&r1, p->ids, 0, p->n, true, all) == 0);
        worst = golden_worst(all, p, nv, worst);
        /* prefill form, one step */
        CHECK(golden_step(&r1, p->ids, 0, p->n, false, pf) == 0);
        double r = golden_rel_err(pf, p, p->n - 1, nv);
        if (!(r <= worst_pf)) worst_pf = r;
        /* chunked prefill (chunks of 5; a 1-token chunk would be the decode form): the one-step logits, bit for bit */
        CHECK(golden_chunked(&r1, p->ids, p->n, 5, one) == 0);
        CHECKF(memcmp(one, pf, (size_t)nv * sizeof *one) == 0,
               "%s prompt %d: chunked prefill logits differ from the one-step logits", ck->dir, i);
        /* greedy decode, one token a step */
        int32_t seq[256];
        int first_diff = golden_greedy(&r1, p, one, seq);
        CHECKF(first_diff < 0, "%s %s prompt %d: greedy differs from transformers at token %d", ck->dir, ck->golden,
               i, first_diff);
        /* the cached decode's last logits against one uncached forward over the same tokens */
        int len = p->n + p->n_greedy - 1;
        if (len <= REGION * BLOCK) {
            CHECK(golden_step(&r2, seq, 0, len, false, pf) == 0);
            double c = rel_diff(one, pf, nv);
            if (!(c <= worst_cache)) worst_cache = c;
        }
        free(all);
        free(one);
        free(pf);
    }
    printf("  %s%s: worst relative logit error %.3g (decode form), %.3g (prefill form); cached vs uncached %.3g\n",
           ck->dir, ck->overrides ? " index_topk null" : "", worst, worst_pf, worst_cache);
    CHECKF(worst <= 1e-4 && worst_pf <= 1e-4, "%s: relative logit error %.3g / %.3g > 1e-4", ck->dir, worst, worst_pf);
    CHECKF(worst_cache <= 1e-4, "%s: cached decode vs uncached forward %.3g > 1e-4", ck->dir, worst_cache);
    model_backend_destroy(be);
    model_free(m);
    golden_free(&g);
}

static void test_checkpoints(void)
{
    for (int i = 0; i < NCK; i++) run_checkpoint(&CKPTS[i]);
}

/* Bytes per block from the plan: an MLA layer keeps kv_lora_rank + qk_rope_head_dim
 * (+ index_head_dim where it runs an indexer) floats per token. The figures are
 * make_mla.py's: kv_lora 32, rope 8, index_head_dim 16, H 4, nope 16. */
static void test_kv_sizing(void)
{
    const struct { const char *dir, *ov; size_t per_token; } cases[] = {
        {"dsv3-qlora", NULL, 2 * (32 + 8)},
        {"dsv3-norope", NULL, 2 * 32},
        {"glm-dsa", NULL, (32 + 8 + 16) + (32 + 8) + (32 + 8 + 16)}, /* indexer full, shared, full */
        {"glm-dsa", "{\"text_config\": {\"index_topk\": null}}", 3 * (32 + 8)},
    };
    for (size_t i = 0; i < sizeof cases / sizeof *cases; i++) {
        model *m = load(cases[i].dir, cases[i].ov);
        if (!m) continue;
        const struct model_config *c = model_get_config(m);
        struct model_backend_opts bo = {.device = "cpu", .n_threads = 1, .max_tokens_per_step = 16,
                                        .max_seqs_per_step = 4, .max_ctx = 64};
        model_backend *be = model_backend_create(m, &bo, err, sizeof err);
        CHECKF(be != NULL, "%s", err);
        if (be) {
            size_t got = be->ops->kv_block_bytes(be, BLOCK), want = BLOCK * cases[i].per_token * sizeof(float);
            /* GQA with every head's K and V: 2 n_head (nope + rope) per layer and token */
            size_t gqa = BLOCK * (size_t)c->n_layer * 2 * c->n_head * (16 + 8) * sizeof(float);
            printf("  %s%s: %zu bytes per block of %d (GQA with the same heads: %zu, %.1fx)\n", cases[i].dir,
                   cases[i].ov ? " index_topk null" : "", got, BLOCK, gqa, (double)gqa / (double)got);
            CHECKF(got == want, "%s: %zu bytes per block, expected %zu", cases[i].dir, got, want);
            CHECK(model_kv_bytes_per_token(c, 4) == cases[i].per_token * 4);
        }
        model_backend_destroy(be);
        model_free(m);
    }
}

static void test_indexer_off_and_mtp(void)
{
    model *m = load("glm-dsa", NULL);
    if (m) {
        const struct model_weights *w = model_get_weights(m);
        CHECK(model_get_config(m)->mla.index_topk == 6);
        CHECK(w->layers[0].mla.ix_wq_b.data != NULL && w->layers[2].mla.ix_wk.data != NULL);
        CHECK(w->layers[1].mla.ix_wq_b.data == NULL); /* a shared layer has no indexer of its own */
        model_free(m);
    }
    m = load("glm-dsa", "{\"text_config\": {\"index_topk\": null, \"rope_theta\": 10000}}");
    if (m) {
        const struct model_weights *w = model_get_weights(m);
        CHECK(model_get_config(m)->mla.index_topk == 0);
        for (int l = 0; l < 3; l++) CHECK(w->layers[l].mla.ix_wq_b.data == NULL && w->layers[l].mla.ix_weights.data == NULL);
        model_free(m);
    }
    /* MTP: one module after the last layer; switched off by an override */
    m = load("dsv3-qlora", NULL);
    if (m) {
        const struct model_weights *w = model_get_weights(m);
        CHECK(model_get_config(m)->n_mtp_layer == 1);
        CHECKF(w->mtp_tensors > 7 && w->mtp_bytes > 0, "mtp %d tensors, %zu bytes", w->mtp_tensors, w->mtp_bytes);
        model_free(m);
    }
    m = load("dsv3-qlora", "{\"num_nextn_predict_layers\": 0}");
    if (m) {
        CHECK(model_get_weights(m)->mtp_tensors == 0 && model_get_config(m)->n_mtp_layer == 0);
        model_free(m);
    }
    struct model_load_opts lo = {.hf_overrides = "{\"num_nextn_predict_layers\": 2}"};
    m = model_load(MDIR "/dsv3-qlora", &lo, err, sizeof err);
    CHECKF(!m && strstr(err, "num_nextn_predict_layers"), "%s", m ? "loaded" : err);
    model_free(m);
    lo.hf_overrides = "{\"text_config\": {\"index_topk\": \"all\"}}";
    m = model_load(MDIR "/glm-dsa", &lo, err, sizeof err);
    CHECKF(!m && strstr(err, "text_config.index_topk"), "%s", m ? "loaded" : err);
    model_free(m);
}

/* Positions past the prompt take the absorbed form however many share the
 * step (a verify step's tokens, a recompute): the logits at the last of 4
 * generated tokens in one step are the bits of 4 decode steps. */
static void one_seq_step(model_backend *be, const int32_t *bt, const int32_t *ids, int start, int n, int n_prompt,
                         float *logits)
{
    int32_t pos[16];
    int64_t slots[16];
    for (int t = 0; t < n; t++) {
        pos[t] = start + t;
        slots[t] = (int64_t)bt[(start + t) / BLOCK] * BLOCK + (start + t) % BLOCK;
    }
    struct step_seq sq = {.query_start = 0, .query_len = n, .context_len = start + n, .block_table = bt,
                          .n_blocks = REGION, .logits_out = logits, .n_prompt = n_prompt};
    struct step st = {.n_tokens = n, .token_ids = ids + start, .positions = pos, .slots = slots, .n_seqs = 1,
                      .seqs = &sq};
    int rc = be->ops->forward(be, &st, err, sizeof err);
    CHECKF(rc == 0, "forward: %s", err);
}

static void test_generated_positions_one_form(void)
{
    model *m = load("dsv3-qlora", NULL);
    if (!m) return;
    struct model_backend_opts bo = {.device = "cpu", .n_threads = 2, .max_ctx = REGION * BLOCK};
    model_backend *be = model_backend_create(m, &bo, err, sizeof err);
    CHECKF(be != NULL, "%s", err);
    int nv = model_get_config(m)->n_vocab;
    float *a = malloc((size_t)nv * sizeof(float)), *b = malloc((size_t)nv * sizeof(float));
    if (be && a && b && be->ops->kv_alloc(be, 2 * REGION, BLOCK, err, sizeof err) == 0) {
        int32_t ids[12] = {5, 17, 42, 99, 150, 201, 33, 7, 300, 12, 64, 77}, bt[2][REGION];
        for (int i = 0; i < REGION; i++) bt[0][i] = i, bt[1][i] = REGION + i;
        one_seq_step(be, bt[0], ids, 0, 8, 8, a);
        for (int p = 8; p < 12; p++) one_seq_step(be, bt[0], ids, p, 1, 8, a);
        one_seq_step(be, bt[1], ids, 0, 8, 8, b);
        one_seq_step(be, bt[1], ids, 8, 4, 8, b);
        CHECK(memcmp(a, b, (size_t)nv * sizeof(float)) == 0);
    }
    free(a);
    free(b);
    model_backend_destroy(be);
    model_free(m);
}

/* cpu_backend_index_margins on glm-dsa (index_topk 6; layer 1 shares layer
 * 0's choice): INFINITY before position 6 (every key taken) and on the
 * shared layer, finite in [0, 2] (a K-th score minus a lower one, over the
 * largest |score|) from position 6 on; positions 8..11 give the same margins
 * in a 12-token prefill as in 8 + four 1-token decode steps (the index
 * scores do not depend on the step's form), so each value lands at its
 * token and layer. */
static void test_index_margins(void)
{
    model *m = load("glm-dsa", NULL);
    if (!m) return;
    const struct model_config *c = model_get_config(m);
    int L = c->n_layer, nv = c->n_vocab;
    struct model_backend_opts bo = {.device = "cpu", .n_threads = 2, .max_ctx = REGION * BLOCK};
    model_backend *be = model_backend_create(m, &bo, err, sizeof err);
    CHECKF(be != NULL, "%s", err);
    float *lg = malloc((size_t)nv * sizeof(float)), *pf = malloc((size_t)L * 12 * sizeof(float)),
          *dm = malloc((size_t)L * sizeof(float));
    if (be && lg && pf && dm && be->ops->kv_alloc(be, 2 * REGION, BLOCK, err, sizeof err) == 0) {
        int32_t ids[12] = {5, 17, 42, 99, 150, 201, 33, 7, 300, 12, 64, 77}, bt[2][REGION];
        for (int i = 0; i < REGION; i++) bt[0][i] = i, bt[1][i] = REGION + i;
        cpu_backend_index_margins(be, pf);
        one_seq_step(be, bt[0], ids, 0, 12, 12, lg);
        int bad = 0, chosen = 0, differ = 0;
        for (int l = 0; l < L; l++)
            for (int t = 0; t < 12; t++) {
                float v = pf[l * 12 + t];
                bool choice = c->mla.index_full[l] && t >= c->mla.index_topk;
                chosen += choice;
                bad += choice ? !(v >= 0 && v <= 2) : v != INFINITY;
            }
        cpu_backend_index_margins(be, NULL);
        one_seq_step(be, bt[1], ids, 0, 8, 12, lg);
        cpu_backend_index_margins(be, dm);
        for (int p = 8; p < 12; p++) {
            one_seq_step(be, bt[1], ids, p, 1, 12, lg);
            for (int l = 0; l < L; l++) differ += fabsf(dm[l] - pf[l * 12 + p]) > 1e-5f * (fabsf(pf[l * 12 + p]) + 1e-3f);
        }
        cpu_backend_index_margins(be, NULL);
        printf("  index margins: layer 0, positions 6..11:");
        for (int t = 6; t < 12; t++) printf(" %.2e", pf[t]);
        printf("\n");
        CHECKF(chosen == 2 * 6 && bad == 0, "%d of %d margins out of place or range", bad, chosen);
        CHECKF(differ == 0, "%d margins differ between a prefill and decode steps", differ);
    }
    free(lg);
    free(pf);
    free(dm);
    model_backend_destroy(be);
    model_free(m);
}

/* A copy of dsv3-qlora whose config says the second layer's FFN is MoE: the plan makes it the MoE kind,
 * and the checkpoint, which has no experts, is refused naming the missing tensor. */
static void test_moe_layer_without_experts(void)
{
    char dir[] = "/tmp/sluice_mla_XXXXXX", path[300], src[300];
    if (!mkdtemp(dir)) return;
    size_t len;
    char *cfg = test_slurp(MDIR "/dsv3-qlora/config.json", &len);
    CHECK(cfg != NULL);
    char *at = cfg ? strstr(cfg, "\"first_k_dense_replace\": 2") : NULL;
    CHECK(at != NULL);
    if (at) {
        at[strlen("\"first_k_dense_replace\": ")] = '1';
        snprintf(path, sizeof path, "%s/config.json", dir);
        FILE *f = fopen(path, "w");
        fwrite(cfg, 1, len, f);
        fclose(f);
        const char *links[] = {"model.safetensors", "tokenizer.json", "tokenizer_config.json"};
        for (int i = 0; i < 3; i++) {
            snprintf(path, sizeof path, "%s/%s", dir, links[i]);
            char *cwd = getcwd(NULL, 0);
            snprintf(src, sizeof src, "%s/" MDIR "/dsv3-qlora/%s", cwd, links[i]);
            free(cwd);
            CHECK(symlink(src, path) == 0);
        }
        model *m = model_load(dir, NULL, err, sizeof err);
        /* layer 1 is now the MoE kind: its router and experts are looked for, and their absence named */
        CHECKF(!m && strstr(err, "model.layers.1.mlp."), "%s", m ? "loaded" : err);
        model_free(m);
        for (int i = 0; i < 3; i++) {
            snprintf(path, sizeof path, "%s/%s", dir, links[i]);
            unlink(path);
        }
        snprintf(path, sizeof path, "%s/config.json", dir);
        unlink(path);
    }
    rmdir(dir);
    free(cfg);
}

/* ---- through the engine ---------------------------------------------------------- */

#define GEN 16

static sched_engine *engine(model_backend *be, int budget, int kv_blocks, bool cache)
{
    struct sched_engine_opts o;
    memset(&o, 0, sizeof o);
    o.sched.block_size = BLOCK;
    o.sched.max_num_seqs = 8;
    o.sched.max_num_batched_tokens = budget;
    o.sched.max_model_len = 96;
    o.kv_blocks = kv_blocks;
    o.enable_prefix_caching = cache;
    sched_engine *e = sched_engine_create(be, &o, err, sizeof err);
    CHECKF(e != NULL, "%s", err);
    return e;
}

static void run(sched_engine *e, const int32_t *const *prompts, const int *n, int k, struct golden_result *res)
{
    memset(res, 0, sizeof *res * (size_t)k);
    for (int i = 0; i < k; i++) {
        struct sched_request r;
        memset(&r, 0, sizeof r);
        r.prompt = prompts[i];
        r.n_prompt = n[i];
        r.max_tokens = GEN;
        r.priority = SCHED_PRIO_BATCH;
        r.ignore_eos = true;
        r.user = &res[i];
        model_sampling_default(&r.sampling);
        CHECKF(sched_engine_submit(e, &r, NULL, err, sizeof err) == 0, "%s", err);
    }
    golden_collect(e, k);
}

static void test_engine(void)
{
    model *m = load("glm-dsa", NULL);
    if (!m) return;
    struct model_backend_opts bo = {.device = "cpu", .n_threads = 2, .max_tokens_per_step = 256,
                                    .max_seqs_per_step = 16, .max_ctx = 96};
    model_backend *be = model_backend_create(m, &bo, err, sizeof err);
    CHECKF(be != NULL, "%s", err);
    if (!be) {
        model_free(m);
        return;
    }
    /* two prompts sharing 3 blocks, then 10 tokens of their own */
    enum { PRE = 48, NP = 58 };
    static int32_t a[NP], bb[NP], c[6][24];
    for (int i = 0; i < NP; i++) {
        a[i] = (i * 37 + 11) % 345 + 1;
        bb[i] = i < PRE ? a[i] : (i * 91 + 5) % 345 + 1;
    }
    const int32_t *pa[] = {a}, *pb[] = {bb};
    int n1[] = {NP};
    struct golden_result miss, hit, first;
    sched_engine *e = engine(be, 256, 32, false);
    if (e) {
        run(e, pb, n1, 1, &miss);
        sched_engine_destroy(e);
    }
    e = engine(be, 256, 32, true);
    if (e) {
        run(e, pa, n1, 1, &first);
        run(e, pb, n1, 1, &hit);
        CHECKF(hit.cached >= PRE, "cached %d", hit.cached);
        CHECKF(hit.n == GEN && memcmp(hit.tok, miss.tok, sizeof hit.tok) == 0, "a prefix hit differs from a miss");
        sched_engine_destroy(e);
    }
    /* six prompts alone, then together: chunked (a budget of 23 tokens a step) and preempted (6 blocks) */
    const int32_t *pc[6];
    int nc[6];
    struct golden_result solo[6], chunked[6], tight[6];
    for (int k = 0; k < 6; k++) {
        for (int i = 0; i < 24; i++) c[k][i] = (i * (13 + 2 * k) + 7 * k) % 345 + 1;
        pc[k] = c[k];
        nc[k] = 20;
    }
    e = engine(be, 256, 64, false);
    if (e) {
        for (int k = 0; k < 6; k++) run(e, pc + k, nc + k, 1, &solo[k]);
        sched_engine_destroy(e);
    }
    e = engine(be, 23, 64, false);
    if (e) {
        run(e, pc, nc, 6, chunked);
        sched_engine_destroy(e);
    }
    e = engine(be, 256, 6, true);
    if (e) {
        run(e, pc, nc, 6, tight);
        struct sched_engine_stats s;
        sched_engine_get_stats(e, &s);
        printf("  preemptions: %llu\n", (unsigned long long)s.sched.preemptions);
        CHECK(s.sched.preemptions > 0);
        sched_engine_destroy(e);
    }
    for (int k = 0; k < 6; k++) {
        CHECKF(memcmp(chunked[k].tok, solo[k].tok, sizeof solo[k].tok) == 0, "request %d: chunked differs", k);
        CHECKF(memcmp(tight[k].tok, solo[k].tok, sizeof solo[k].tok) == 0, "request %d: preempted differs", k);
    }
    model_backend_destroy(be);
    model_free(m);
}

int main(void)
{
    RUN(test_checkpoints);
    RUN(test_kv_sizing);
    RUN(test_indexer_off_and_mtp);
    RUN(test_generated_positions_one_form);
    RUN(test_index_margins);
    RUN(test_moe_layer_without_experts);
    RUN(test_engine);
    return test_summary();
}

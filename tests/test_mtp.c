/* test_mtp.c - the MTP layer on the CPU backend (model/cpu_backend.c,
 * backend.h's ops->mtp_draft) against transformers' MtpModel:
 * tests/models/mtp/, made by tests/golden/mtp/make_mtp.py (deepseek_v3: MLA +
 * MoE; glm4_moe: GQA with biases, q/k norm and partial RoPE + MoE; the same
 * glm4_moe with an int8 MTP layer, and with int8 decoder layers beside a bf16
 * MTP layer that the config's "Linear" target would claim).
 *
 * For each checkpoint, with blocks of 4 tokens (so steps start and end on and
 * off block boundaries):
 *  - decode: the prompt in one step, then one token a step (the golden
 *    sequence, whose tokens are the main model's greedy ones: each sampled
 *    token is checked); after every step the MTP layer's logits for the next
 *    position (a k = 1 draft) are transformers' (top 8, <= 1e-4 relative),
 *    and at the golden's draft positions its 3 chained drafts are
 *    transformers' tokens with their logits; the chained entries written
 *    past the accepted tokens are rewritten by the next steps (the next
 *    drafts still match);
 *  - a verify-like step: 4 query tokens of which only the first 2 are kept
 *    (the rest wrong tokens), then the draft from the last kept one;
 *  - chunked prefill: each draft position reached by chunks of 5, 3 and 7
 *    tokens, two sequences drafting in one call from one step;
 *  - a prefix hit: a sequence sharing the first blocks of the decoded one,
 *    computed from a block boundary, drafts the same;
 * and: a model with random MTP weights (tests/models/mla/dsv3-qlora) and a
 * dummy-weight one draft tokens of the vocabulary; --hf-overrides
 * '{"num_nextn_predict_layers": 0}' loads nothing of the MTP layer and makes
 * opts.mtp an error, as does a checkpoint whose MTP layer was dropped; the KV
 * block grows by the MTP layer's entry and one hidden state; bad draft
 * requests are refused; the model's own logits are the same bits with the MTP
 * layer on and off; the drafts a backend makes right after a step (the GPU's
 * pass, as CUDA graphs and with enforce_eager) are the eager path's, through
 * prompts and verify steps of two sequences (pass_case).
 *
 * --device=cuda runs it all on the GPU backend (tests/gpu/run.sh
 * check; --tp=N: N GPUs, the MTP layer split as the decoder layers are) with
 * bf16 tolerances: logits within GPU_TOL of the largest, drafts
 * and greedy tokens equal to transformers' where its top-2 margin is clear
 * of twice that (a chain's later drafts only while the earlier ones agree),
 * and a main-model token that differs from the golden's only at a near tie of
 * the GPU's own logits.
 */
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "base/json.h"
#include "model/backend.h"
#include "model/model.h"
#include "tests/test.h"
#include "tests/golden.h"

#define MDIR "tests/models/mtp"
#define BLOCK 4
#define REGION 24 /* blocks per block table: 96 positions */
#define NREG 6
#define MTOP 8
#define MAXL 64
#define KD 3
#define GPU_TOL 3e-2 /* bf16 activations: relative to the top logit's magnitude */

struct mgold {
    int n, n_prompt;
    int32_t ids[MAXL];
    int32_t mtp_ids[MAXL][MTOP]; /* [q] the MTP entry at q's top logits */
    float mtp_lg[MAXL][MTOP];
    int nd;
    struct {
        int pos, token;
        int32_t drafts[KD];
        int32_t ids[KD][MTOP];
        float lg[KD][MTOP];
    } d[8];
};

static char err[512];
static const char *g_device = "cpu"; /* --device=NAME */
static int g_tp = 1;                 /* --tp=N: N GPUs */
static bool on_cpu(void) { return !strcmp(g_device, "cpu"); }
static double tol(void) { return on_cpu() ? 1e-4 : GPU_TOL; }

/* Whether the golden's argmax is clear of its runner-up by more than what
 * the backend's error may move (always on the CPU: exact there). */
static bool clear_margin(const float *ref)
{
    if (on_cpu()) return true;
    double mr = 0;
    for (int k = 0; k < MTOP; k++) mr = fabs(ref[k]) > mr ? fabs(ref[k]) : mr;
    return ref[0] - ref[1] > 2 * GPU_TOL * (mr > 0 ? mr : 1);
}

static int load_golden(const char *dir, struct mgold *g)
{
    char path[300];
    snprintf(path, sizeof path, "%s/%s/golden.json", MDIR, dir);
    memset(g, 0, sizeof *g);
    size_t len;
    char *src = test_slurp(path, &len);
    if (!src) return -1;
    json_doc d;
    int rc = -1;
    if (json_parse(&d, src, len, err, sizeof err) != 0) {
        free(src);
        return -1;
    }
    int64_t np;
    int ids = json_get(&d, 0, "ids"), mtp = json_get(&d, 0, "mtp"), dr = json_get(&d, 0, "drafts");
    if (json_i64(&d, json_get(&d, 0, "n_prompt"), &np) != 0) goto out;
    g->n_prompt = (int)np;
    if ((g->n = read_ints(&d, ids, g->ids, MAXL)) <= 0 || json_size(&d, mtp) != g->n - 1) goto out;
    for (int k = 0, e = mtp + 1; k < g->n - 1; k++, e = json_skip(&d, e))
        if (read_ints(&d, json_get(&d, e, "top_ids"), g->mtp_ids[k + 1], MTOP) != MTOP ||
            read_floats(&d, json_get(&d, e, "top_logits"), g->mtp_lg[k + 1], MTOP) != MTOP)
            goto out;
    g->nd = json_size(&d, dr);
    if (g->nd <= 0 || g->nd > 8) goto out;
    for (int k = 0, e = dr + 1; k < g->nd; k++, e = json_skip(&d, e)) {
        int64_t v;
        if (json_i64(&d, json_get(&d, e, "pos"), &v)) goto out;
        g->d[k].pos = (int)v;
        if (json_i64(&d, json_get(&d, e, "token"), &v)) goto out;
        g->d[k].token = (int)v;
        if (read_ints(&d, json_get(&d, e, "drafts"), g->d[k].drafts, KD) != KD) goto out;
        int ti = json_get(&d, e, "top_ids"), tl = json_get(&d, e, "top_logits");
        for (int i = 0, a = ti + 1, b = tl + 1; i < KD; i++, a = json_skip(&d, a), b = json_skip(&d, b))
            if (read_ints(&d, a, g->d[k].ids[i], MTOP) != MTOP || read_floats(&d, b, g->d[k].lg[i], MTOP) != MTOP)
                goto out;
    }
    rc = 0;
out:
    json_free(&d);
    free(src);
    return rc;
}

/* largest |logit - golden| over the golden's top 8, relative to its largest |logit| */
static double rel_err(const float *lg, const int32_t *ids, const float *ref, int nv)
{
    double md = 0, mr = 0;
    for (int k = 0; k < MTOP; k++) {
        double dd = ids[k] >= 0 && ids[k] < nv ? fabs((double)lg[ids[k]] - ref[k]) : INFINITY;
        md = dd > md ? dd : md;
        mr = fabs(ref[k]) > mr ? fabs(ref[k]) : mr;
    }
    return md / (mr > 0 ? mr : 1);
}

static model *load(const char *path, const char *overrides, const char *format)
{
    struct model_load_opts lo = {.hf_overrides = overrides, .load_format = format};
    model *m = model_load(path, &lo, err, sizeof err);
    CHECKF(m != NULL, "%s: %s", path, err);
    return m;
}

static model_backend *backend(const model *m, bool mtp)
{
    struct model_backend_opts bo = {.device = g_device, .tensor_parallel_size = g_tp, .n_threads = 2, .max_tokens_per_step = 64,
                                    .max_seqs_per_step = 8, .max_ctx = REGION * BLOCK, .mtp = mtp};
    model_backend *be = model_backend_create(m, &bo, err, sizeof err);
    CHECKF(be != NULL, "backend: %s", err);
    if (be && be->ops->kv_alloc(be, NREG * REGION, BLOCK, err, sizeof err) != 0) {
        CHECKF(0, "kv_alloc: %s", err);
        model_backend_destroy(be);
        return NULL;
    }
    return be;
}

/* One chunk of a step: positions start .. start + n - 1 of ids through block table bt. */
struct chunk {
    const int32_t *bt;
    int start, n;
    bool sample;
};

/* One step of nc chunks (the golden's ids as every sequence's history);
 * tok[i] gets chunk i's sampled token (or -1); g_lout, when set, chunk 0's
 * raw logits. */
static float *g_lout;
static int run_step(model_backend *be, const int32_t *ids, const struct chunk *ch, int nc, int32_t *tok)
{
    static int32_t tid[128], pos[128];
    static int64_t slots[128];
    struct step_seq sq[4];
    struct model_sampling greedy;
    model_sampling_default(&greedy);
    uint64_t rng = model_rng_seed(0);
    int T = 0;
    for (int i = 0; i < nc; i++) {
        sq[i] = (struct step_seq){.query_start = T, .query_len = ch[i].n, .context_len = ch[i].start + ch[i].n,
                                  .block_table = ch[i].bt, .n_blocks = REGION, .want_sample = ch[i].sample,
                                  .sampling = &greedy, .history = ids, .n_prompt = ch[i].start + ch[i].n,
                                  .n_history = ch[i].start + ch[i].n, .rng = &rng,
                                  .logits_out = i == 0 ? g_lout : NULL};
        for (int t = 0; t < ch[i].n; t++, T++) {
            int p = ch[i].start + t;
            tid[T] = ids[p];
            pos[T] = p;
            slots[T] = (int64_t)ch[i].bt[p / BLOCK] * BLOCK + p % BLOCK;
        }
    }
    struct step st = {.n_tokens = T, .token_ids = tid, .positions = pos, .slots = slots, .n_seqs = nc, .seqs = sq};
    int rc = be->ops->forward(be, &st, err, sizeof err);
    CHECKF(rc == 0, "forward: %s", err);
    for (int i = 0; i < nc && tok; i++) tok[i] = ch[i].sample && rc == 0 ? sq[i].out.token : -1;
    return rc;
}

/* The golden draft at position p, or NULL. */
static const void *golden_draft(const struct mgold *g, int p, int *k)
{
    for (int i = 0; i < g->nd; i++)
        if (g->d[i].pos == p) {
            *k = i;
            return &g->d[i];
        }
    return NULL;
}

/* Checks request r (k drafts from position p, logits lg[k][nv]) against the
 * golden: a golden draft position's 3 drafts, else the MTP entry of p + 1. */
static void check_draft(const struct mgold *g, const char *what, int p, const int32_t *drafts, int k,
                        const float *lg, int nv, double *worst)
{
    int gi;
    if (golden_draft(g, p, &gi) && k == KD) {
        for (int i = 0; i < KD; i++) {
            double e = rel_err(lg + (size_t)i * nv, g->d[gi].ids[i], g->d[gi].lg[i], nv);
            *worst = e > *worst ? e : *worst;
            CHECKF(e <= tol(), "%s: draft %d from position %d: logits %.2e relative off", what, i, p, e);
            if (drafts[i] != g->d[gi].drafts[i] && !clear_margin(g->d[gi].lg[i])) {
                /* a near tie on the GPU: the chain goes on from another token, nothing after it compares */
                printf("  %s: draft %d from position %d is %d, transformers %d (a near tie): chain not compared on\n",
                       what, i, p, drafts[i], g->d[gi].drafts[i]);
                break;
            }
            CHECKF(drafts[i] == g->d[gi].drafts[i], "%s: draft %d from position %d is %d, transformers %d", what, i, p,
                   drafts[i], g->d[gi].drafts[i]);
        }
        return;
    }
    double e = rel_err(lg, g->mtp_ids[p + 1], g->mtp_lg[p + 1], nv);
    *worst = e > *worst ? e : *worst;
    CHECKF(e <= tol(), "%s: MTP logits at %d: %.2e relative off", what, p + 1, e);
    CHECKF(drafts[0] == g->mtp_ids[p + 1][0] || !clear_margin(g->mtp_lg[p + 1]), "%s: MTP argmax at %d is %d, "
           "transformers %d", what, p + 1, drafts[0], g->mtp_ids[p + 1][0]);
}

/* The main model's greedy token at p + 1 against the golden's: equal, or on
 * the GPU a near tie of its own logits (lout, the step's). */
static void check_main(const struct mgold *g, const char *name, int p, int32_t tok, const float *lout, int nv)
{
    int32_t want = g->ids[p + 1];
    if (tok == want) return;
    bool tie = false;
    if (!on_cpu() && tok >= 0 && tok < nv && want >= 0 && want < nv) {
        double mx = 0;
        for (int v = 0; v < nv; v++) mx = fabs(lout[v]) > mx ? fabs(lout[v]) : mx;
        tie = lout[tok] - lout[want] <= 2 * GPU_TOL * (mx > 0 ? mx : 1);
        printf("  %s: main greedy at %d is %d, transformers %d: logits %.4f vs %.4f, %s\n", name, p + 1, tok, want,
               lout[tok], lout[want], tie ? "a near tie" : "NOT a near tie");
    }
    CHECKF(tie, "%s: main greedy at %d is %d, transformers %d", name, p + 1, tok, want);
}

static void region(int r, int32_t *bt)
{
    for (int i = 0; i < REGION; i++) bt[i] = r * REGION + i;
}

static void run_checkpoint(const char *name)
{
    struct mgold *g = calloc(1, sizeof *g);
    char path[256];
    snprintf(path, sizeof path, "%s/%s", MDIR, name);
    if (load_golden(name, g) != 0) {
        CHECKF(0, "%s: no or bad golden.json (make_mtp.py)", name);
        free(g);
        return;
    }
    model *m = load(path, NULL, NULL);
    model_backend *be = m ? backend(m, true) : NULL;
    if (!be) goto done;
    const struct model_config *c = model_get_config(m);
    int nv = c->n_vocab, L = g->n, P = g->n_prompt;
    CHECK(c->n_mtp_layer == 1 && model_get_weights(m)->mtp_tensors > 10);
    float *lg = malloc((size_t)2 * KD * nv * sizeof(float)), *lout = malloc((size_t)nv * sizeof(float));
    int32_t bt[3][REGION], tok[2], drafts[2][KD];
    double worst = 0;

    /* decode: the prompt, then one token a step, a draft after each */
    region(0, bt[0]);
    struct chunk ch = {bt[0], 0, P, true};
    int32_t vids[MAXL];
    int v0 = P + 4; /* the verify-like step: positions v0 .. v0 + 3 across a block boundary, the last 2 wrong */
    memcpy(vids, g->ids, sizeof vids);
    vids[v0 + 2] = (vids[v0 + 2] + 1) % nv;
    vids[v0 + 3] = (vids[v0 + 3] + 5) % nv;
    for (int p = P - 1; p < L - 1 && lg; p++) {
        if (ch.start == v0) {
            ch.n = 4;
            if (run_step(be, vids, &ch, 1, tok)) break;
            p = v0 + 1;
        } else {
            g_lout = lout;
            int rc = lout ? run_step(be, g->ids, &ch, 1, tok) : -1;
            g_lout = NULL;
            if (rc) break;
            check_main(g, name, p, tok[0], lout, nv);
        }
        int gi, k = golden_draft(g, p, &gi) ? KD : 1;
        struct model_mtp_req rq = {.seq = 0, .pos = p, .token = g->ids[p + 1], .k = k, .block_table = bt[0],
                                   .n_blocks = REGION, .drafts = drafts[0], .logits = lg};
        int rc = be->ops->mtp_draft(be, &rq, 1, err, sizeof err);
        CHECKF(rc == 0, "mtp_draft: %s", err);
        if (rc == 0) check_draft(g, "decode", p, drafts[0], k, lg, nv, &worst);
        ch = (struct chunk){bt[0], p + 1, 1, true};
    }
    printf("  %s decode: %d positions, worst %.2e relative\n", name, L - P, worst);

    /* chunked prefill to each draft position; the last two drafts in one call from one step */
    worst = 0;
    static const int sizes[] = {5, 3, 7};
    for (int i = 0; i < g->nd && lg; i++) {
        int p = g->d[i].pos, two = i == g->nd - 2, s = 0, at = 0;
        region(1 + (two ? 0 : i % 2), bt[1]);
        region(3, bt[2]);
        int32_t *b = bt[1];
        int stop = two ? p - 1 : p + 1; /* the pair's last chunks share one step */
        while (at < stop) {
            int n = sizes[s++ % 3];
            if (at + n > stop) n = stop - at;
            struct chunk c1 = {b, at, n, at + n == p + 1};
            if (run_step(be, g->ids, &c1, 1, tok)) break;
            at += n;
        }
        int nreq = 1;
        struct model_mtp_req rq[2] = {{.seq = 0, .pos = p, .token = g->ids[p + 1], .k = KD, .block_table = b,
                                       .n_blocks = REGION, .drafts = drafts[0], .logits = lg}};
        if (two) {
            int q = g->d[i + 1].pos;
            for (at = 0; at < q - 3;) { /* the other sequence up to q - 3 */
                int n = sizes[s++ % 3];
                if (at + n > q - 3) n = q - 3 - at;
                struct chunk c2 = {bt[2], at, n, false};
                if (run_step(be, g->ids, &c2, 1, tok)) break;
                at += n;
            }
            struct chunk pair[2] = {{b, p - 1, 2, true}, {bt[2], q - 3, 4, true}};
            run_step(be, g->ids, pair, 2, tok);
            rq[1] = (struct model_mtp_req){.seq = 1, .pos = q, .token = g->ids[q + 1], .k = KD, .block_table = bt[2],
                                           .n_blocks = REGION, .drafts = drafts[1], .logits = lg + (size_t)KD * nv};
            nreq = 2;
        }
        int rc = be->ops->mtp_draft(be, rq, nreq, err, sizeof err);
        CHECKF(rc == 0, "mtp_draft: %s", err);
        for (int r = 0; r < nreq && rc == 0; r++)
            check_draft(g, two ? "batched" : "chunked", rq[r].pos, drafts[r], KD, lg + (size_t)r * KD * nv, nv,
                        &worst);
        if (two) break;
    }
    printf("  %s chunked prefill and a batched draft: worst %.2e relative\n", name, worst);

    /* a prefix hit: the decoded sequence's first blocks, then from a block boundary */
    worst = 0;
    {
        int p = g->d[1].pos, hit = (p / BLOCK - 1) * BLOCK; /* full blocks shared */
        region(4, bt[1]);
        memcpy(bt[1], bt[0], (size_t)(hit / BLOCK) * sizeof(int32_t));
        struct chunk c1 = {bt[1], hit, p + 1 - hit, true};
        if (run_step(be, g->ids, &c1, 1, tok) == 0) {
            struct model_mtp_req rq = {.seq = 0, .pos = p, .token = g->ids[p + 1], .k = KD, .block_table = bt[1],
                                       .n_blocks = REGION, .drafts = drafts[0], .logits = lg};
            int rc = be->ops->mtp_draft(be, &rq, 1, err, sizeof err);
            CHECKF(rc == 0, "mtp_draft: %s", err);
            if (rc == 0) check_draft(g, "prefix hit", p, drafts[0], KD, lg, nv, &worst);
        }
        printf("  %s prefix hit at %d, draft from %d: worst %.2e relative\n", name, hit, p, worst);
    }
    free(lg);
    free(lout);
done:
    model_backend_destroy(be);
    model_free(m);
    free(g);
}

static void test_dsv3(void) { run_checkpoint("dsv3"); }
static void test_glm4moe(void) { run_checkpoint("glm4moe"); }

/* int8 MTP projections (the seed checkpoint's MTP is int8): read per tensor as
 * packed weights, exactly what their dequantized values give transformers */
static void test_glm4moe_int8_mtp(void)
{
    model *m = load(MDIR "/glm4moe-w8mtp", NULL, NULL);
    if (m) {
        const struct model_config *c = model_get_config(m);
        const struct model_weights *w = model_get_weights(m);
        const struct model_layer_weights *L = &w->layers[c->n_layer];
        CHECK(w->mtp[0].eh_proj.dtype == MODEL_DT_QPACK && L->wq.dtype == MODEL_DT_QPACK &&
              L->moe.gate[0].dtype == MODEL_DT_QPACK && L->moe.sh_down.dtype == MODEL_DT_QPACK);
        CHECK(L->moe.router.dtype == MODEL_DT_BF16 && w->layers[0].wq.dtype == MODEL_DT_BF16);
        model_free(m);
    }
    run_checkpoint("glm4moe-w8mtp");
}

/* Drafts from a prompt's last position are tokens of the vocabulary. */
static void drafts_in_vocab(const model *m, const char *what)
{
    model_backend *be = backend(m, true);
    if (!be) return;
    int32_t ids[12], bt[REGION], tok, drafts[KD];
    for (int i = 0; i < 12; i++) ids[i] = (i * 37 + 11) % 300 + 1;
    region(0, bt);
    struct chunk ch = {bt, 0, 12, true};
    if (run_step(be, ids, &ch, 1, &tok) == 0) {
        struct model_mtp_req rq = {.seq = 0, .pos = 11, .token = tok, .k = KD, .block_table = bt,
                                   .n_blocks = REGION, .drafts = drafts};
        int rc = be->ops->mtp_draft(be, &rq, 1, err, sizeof err);
        CHECKF(rc == 0, "%s: mtp_draft: %s", what, err);
        for (int i = 0; i < KD && rc == 0; i++)
            CHECKF(drafts[i] >= 0 && drafts[i] < model_get_config(m)->n_vocab, "%s: draft %d", what, drafts[i]);
        printf("  %s: next %d, drafts %d %d %d\n", what, tok, drafts[0], drafts[1], drafts[2]);
    }
    model_backend_destroy(be);
}

/* The seed checkpoint's trap: quantization_config targets every Linear, the
 * decoder layers are int8 and the MTP layer is bf16 without an ignore entry:
 * each MTP weight is what the file holds */
static void test_glm4moe_int8_main_bf16_mtp(void)
{
    model *m = load(MDIR "/glm4moe-w8main", NULL, NULL);
    if (m) {
        const struct model_config *c = model_get_config(m);
        const struct model_weights *w = model_get_weights(m);
        const struct model_layer_weights *L = &w->layers[c->n_layer];
        CHECK(w->layers[0].wq.dtype == MODEL_DT_QPACK && w->layers[1].moe.gate[0].dtype == MODEL_DT_QPACK);
        CHECK(w->mtp[0].eh_proj.dtype == MODEL_DT_BF16 && L->wq.dtype == MODEL_DT_BF16 &&
              L->moe.gate[0].dtype == MODEL_DT_BF16 && L->moe.sh_down.dtype == MODEL_DT_BF16);
        model_free(m);
    }
    run_checkpoint("glm4moe-w8main");
}

static void test_random_and_dummy(void)
{
    model *m = load("tests/models/mla/dsv3-qlora", NULL, NULL);
    if (m) {
        CHECK(model_get_config(m)->n_mtp_layer == 1);
        drafts_in_vocab(m, "dsv3-qlora (random MTP)");
        model_free(m);
    }
    m = load(MDIR "/glm4moe", NULL, "dummy");
    if (m) {
        CHECK(model_get_config(m)->n_mtp_layer == 1 && model_get_weights(m)->mtp != NULL);
        drafts_in_vocab(m, "glm4moe dummy weights");
        model_free(m);
    }
}

static void test_off_and_errors(void)
{
    /* switched off: nothing of the MTP layer is loaded, and asking for it is an error */
    model *m = load(MDIR "/dsv3", "{\"num_nextn_predict_layers\": 0}", NULL);
    if (m) {
        const struct model_weights *w = model_get_weights(m);
        CHECK(model_get_config(m)->n_mtp_layer == 0 && w->mtp == NULL && w->mtp_tensors == 0);
        struct model_backend_opts bo = {.device = g_device, .tensor_parallel_size = g_tp, .n_threads = 1, .max_ctx = 64, .mtp = true};
        model_backend *be = model_backend_create(m, &bo, err, sizeof err);
        CHECKF(!be && strstr(err, "no MTP layers"), "%s", be ? "created" : err);
        model_backend_destroy(be);
        model_free(m);
    }
    /* a glm4_moe checkpoint whose config counts an MTP layer the file does not hold */
    m = load("tests/models/tiny-glm4-moe", NULL, NULL);
    if (m) {
        CHECK(model_get_config(m)->n_mtp_layer == 0);
        struct model_backend_opts bo = {.device = g_device, .tensor_parallel_size = g_tp, .n_threads = 1, .max_ctx = 64, .mtp = true};
        model_backend *be = model_backend_create(m, &bo, err, sizeof err);
        CHECKF(!be && strstr(err, "no MTP layers"), "%s", be ? "created" : err);
        model_backend_destroy(be);
        model_free(m);
    }
    m = load(MDIR "/glm4moe", NULL, NULL);
    if (!m) return;
    const struct model_config *c = model_get_config(m);
    model_backend *on = backend(m, true), *off = backend(m, false);
    if (on && off) {
        /* the block grows by the MTP layer's K and V (each GPU its KV heads) and one hidden state (f32 on the
         * CPU, bf16 on the GPU; whole on every GPU) */
        size_t es = on_cpu() ? 4 : 2;
        size_t a = on->ops->kv_block_bytes(on, BLOCK), b = off->ops->kv_block_bytes(off, BLOCK);
        size_t want = (size_t)BLOCK * 2 * (c->n_head_kv / g_tp) * c->head_dim * es + (size_t)c->n_embd * es + 4;
        CHECKF(a == b + want && model_mtp_kv_bytes_per_block(c, 4) == (size_t)c->n_embd * 4 + 4, "%zu vs %zu + %zu", a,
               b, want);
        int32_t ids[8] = {5, 6, 7, 8, 9, 10, 11, 12}, bt[REGION], tok, d[KD];
        region(0, bt);
        struct model_mtp_req rq = {.seq = 0, .pos = 7, .token = 3, .k = 2, .block_table = bt, .n_blocks = REGION,
                                   .drafts = d};
        CHECK(on->ops->mtp_draft(on, &rq, 1, err, sizeof err) == SL_EINVAL); /* no step yet */
        struct chunk ch = {bt, 0, 8, true};
        if (run_step(on, ids, &ch, 1, &tok) == 0) {
            struct model_mtp_req bad[] = {rq, rq, rq, rq, rq};
            bad[0].seq = 1;
            bad[1].pos = 8;
            bad[2].token = c->n_vocab;
            bad[3].n_blocks = 2; /* positions 8 .. 9 are in block 2 */
            bad[4].drafts = NULL;
            for (int i = 0; i < 5; i++) {
                int rc = on->ops->mtp_draft(on, &bad[i], 1, err, sizeof err);
                CHECKF(rc == SL_EINVAL, "bad request %d: %d %s", i, rc, err);
            }
            CHECK(on->ops->mtp_draft(on, &rq, 1, err, sizeof err) == 0);
        }
        CHECK(off->ops->mtp_draft(off, &rq, 1, err, sizeof err) == SL_EUNSUP && !off->has_mtp && on->has_mtp);
        /* the MTP layer's work leaves the model's own logits alone, bit for bit */
        float *la = malloc((size_t)c->n_vocab * sizeof(float)), *lb = malloc((size_t)c->n_vocab * sizeof(float));
        int32_t seq[12] = {5, 6, 7, 8, 9, 10, 11, 12, 40, 41, 42, 43};
        bool same = la && lb;
        for (int p = 0; p < 12 && same; p += p < 8 ? 8 : 1) {
            int n = p < 8 ? 8 : 1;
            for (int w = 0; w < 2; w++) {
                model_backend *be = w ? off : on;
                int64_t slots[8];
                int32_t pos[8];
                for (int t = 0; t < n; t++)
                    pos[t] = p + t, slots[t] = (int64_t)bt[(p + t) / BLOCK] * BLOCK + (p + t) % BLOCK;
                struct step_seq sq = {.query_start = 0, .query_len = n, .context_len = p + n, .block_table = bt,
                                      .n_blocks = REGION, .logits_out = w ? lb : la};
                struct step st = {.n_tokens = n, .token_ids = seq + p, .positions = pos, .slots = slots, .n_seqs = 1,
                                  .seqs = &sq};
                same = same && be->ops->forward(be, &st, err, sizeof err) == 0;
            }
            same = same && memcmp(la, lb, (size_t)c->n_vocab * sizeof(float)) == 0;
        }
        CHECKF(same, "the model's logits differ with the MTP layer on (%s)", err);
        free(la);
        free(lb);
    }
    model_backend_destroy(on);
    model_backend_destroy(off);
    model_free(m);
}

/* The pass after a step (the GPU backend runs the sub-step and the greedy
 * sequences' drafts on the device right after the step: CUDA graphs, or
 * enqueued one by one with enforce_eager) against the eager path. The same
 * steps run on a backend with graphs and on one without (max_draft_tokens
 * KD): the prompt of two sequences, then verify steps carrying each one's
 * last drafts (the device follows its own verification: some drafts
 * accepted, some not: the first sequence's drafts are the golden's own
 * tokens where it has them), across block boundaries. After each step both are
 * asked for the drafts (no logits: what the device drafted, when the
 * request is what it drafted), and the second again with logits (which
 * takes the eager path): the three agree, but past a near tie of the eager
 * logits (bf16 in another shape). On the CPU it runs alike (no graphs there:
 * equal throughout). */
#define PSEQ 2
static void pass_case(const char *name)
{
    struct mgold *g = calloc(1, sizeof *g);
    char path[256];
    snprintf(path, sizeof path, "%s/%s", MDIR, name);
    if (!g || load_golden(name, g) != 0) {
        CHECKF(0, "%s: no or bad golden.json (make_mtp.py)", name);
        free(g);
        return;
    }
    model *m = load(path, NULL, NULL);
    model_backend *be[2] = {NULL, NULL};
    for (int w = 0; w < 2 && m; w++) {
        struct model_backend_opts bo = {.device = g_device, .tensor_parallel_size = g_tp, .n_threads = 2, .max_tokens_per_step = 64,
                                        .max_seqs_per_step = 8, .max_ctx = REGION * BLOCK, .mtp = true,
                                        .max_draft_tokens = KD, .enforce_eager = w == 1};
        be[w] = model_backend_create(m, &bo, err, sizeof err);
        CHECKF(be[w] != NULL, "backend: %s", err);
        if (be[w] && be[w]->ops->kv_alloc(be[w], NREG * REGION, BLOCK, err, sizeof err) != 0) {
            CHECKF(0, "kv_alloc: %s", err);
            model_backend_destroy(be[w]);
            be[w] = NULL;
        }
    }
    int nv = m ? model_get_config(m)->n_vocab : 0, asked = 0, equal = 0, ties = 0, accepted = 0, steps = 0;
    float *lg = be[0] && be[1] ? malloc((size_t)KD * nv * sizeof(float)) : NULL;
    static int32_t hist[PSEQ][REGION * BLOCK + KD], bt[PSEQ][REGION], tid[64], pos[64];
    static int64_t slots[64];
    int p[PSEQ], plen[PSEQ] = {g->n_prompt, g->n_prompt - 3}; /* p: the last computed position */
    int32_t drafts[3][PSEQ][KD];
    struct model_sampling greedy;
    model_sampling_default(&greedy);
    uint64_t rng = model_rng_seed(0);
    for (int i = 0; i < PSEQ; i++) {
        region(i, bt[i]);
        memcpy(hist[i], g->ids, (size_t)plen[i] * sizeof(int32_t));
        p[i] = -1;
    }
    for (int round = 0; lg && round < 12; round++) {
        /* the step: each sequence's uncomputed tokens (the prompt, or the last sampled token and its drafts) */
        struct step_seq sq[2][PSEQ];
        struct model_sample_out so[2][PSEQ][KD + 1];
        int T = 0, nd[PSEQ], hlen[PSEQ];
        for (int i = 0; i < PSEQ; i++) {
            int a = p[i] + 1, n = round == 0 ? plen[i] : 1 + KD;
            nd[i] = round == 0 ? 0 : KD;
            hlen[i] = a + n - nd[i]; /* the history before the drafts */
            if (round > 0) memcpy(hist[i] + hlen[i], drafts[0][i], KD * sizeof(int32_t));
            if (round > 0 && i == 0 && a + KD < g->n) {
                /* the first sequence follows the golden (the main model's greedy tokens): drafts from it are
                 * accepted, all of them or (odd rounds) all but the last, so the walk stops at each place */
                memcpy(hist[i] + hlen[i], g->ids + a + 1, KD * sizeof(int32_t));
                if (round % 2) hist[i][hlen[i] + KD - 1] = (hist[i][hlen[i] + KD - 1] + 1) % nv;
            }
            for (int w = 0; w < 2; w++)
                sq[w][i] = (struct step_seq){.query_start = T, .query_len = n, .context_len = a + n,
                                             .block_table = bt[i], .n_blocks = REGION, .want_sample = true,
                                             .sampling = &greedy, .history = hist[i], .n_prompt = plen[i],
                                             .n_history = hlen[i], .rng = &rng, .n_draft = nd[i],
                                             .spec_out = so[w][i]};
            for (int t = 0; t < n; t++, T++) {
                tid[T] = hist[i][a + t], pos[T] = a + t;
                slots[T] = (int64_t)bt[i][(a + t) / BLOCK] * BLOCK + (a + t) % BLOCK;
            }
        }
        if (hlen[0] + 2 * KD + 2 > REGION * BLOCK || hlen[1] + 2 * KD + 2 > REGION * BLOCK) break;
        int rc = 0;
        for (int w = 0; w < 2 && !rc; w++) {
            struct step st = {.n_tokens = T, .token_ids = tid, .positions = pos, .slots = slots, .n_seqs = PSEQ,
                              .seqs = sq[w]};
            rc = be[w]->ops->forward(be[w], &st, err, sizeof err);
            CHECKF(rc == 0, "%s forward (%s): %s", name, w ? "eager" : "graphs", err);
        }
        if (rc) break;
        steps++;
        /* each sequence's accepted tokens (the graphs backend's; the other must agree) */
        struct model_mtp_req rq[3][PSEQ];
        bool diverged = false;
        for (int i = 0; i < PSEQ; i++) {
            int n = nd[i] ? sq[0][i].n_spec_out : 1, n1 = nd[i] ? sq[1][i].n_spec_out : 1;
            const struct model_sample_out *e = nd[i] ? so[0][i] : &sq[0][i].out, *e1 = nd[i] ? so[1][i] : &sq[1][i].out;
            for (int j = 0; j < n && j < n1; j++) diverged |= e[j].token != e1[j].token;
            diverged |= n != n1 || e[n - 1].token < 0;
            accepted += n - 1;
            int a = p[i] + 1, last = a + (nd[i] ? 0 : plen[i] - 1) + n - 1; /* the last accepted position */
            for (int j = 0; j < n; j++) hist[i][last - n + 2 + j] = e[j].token;
            p[i] = last;
            for (int w = 0; w < 3; w++)
                rq[w][i] = (struct model_mtp_req){.seq = i, .pos = last, .token = hist[i][last + 1], .k = KD,
                                                  .block_table = bt[i], .n_blocks = REGION, .drafts = drafts[w][i]};
        }
        if (diverged) {
            printf("  %s: the two backends' main tokens differ at round %d (a near tie): stopped there\n", name, round);
            break;
        }
        rc = be[0]->ops->mtp_draft(be[0], rq[0], PSEQ, err, sizeof err);
        if (!rc) rc = be[1]->ops->mtp_draft(be[1], rq[1], PSEQ, err, sizeof err);
        for (int i = 0; i < PSEQ && !rc; i++) { /* one at a time: logits for KD drafts */
            rq[2][i].logits = lg;
            rc = be[1]->ops->mtp_draft(be[1], &rq[2][i], 1, err, sizeof err);
            for (int j = 0; j < KD && !rc; j++) {
                asked++;
                int32_t x = drafts[0][i][j], y = drafts[1][i][j], z = drafts[2][i][j];
                if (x == z && y == z) {
                    equal++;
                    continue;
                }
                const float *l = lg + (size_t)j * nv;
                double mx = 0;
                for (int v = 0; v < nv; v++) mx = fabs(l[v]) > mx ? fabs(l[v]) : mx;
                bool tie = !on_cpu() && x >= 0 && x < nv && y >= 0 && y < nv &&
                           fabs(l[x] - l[z]) <= 2 * GPU_TOL * mx && fabs(l[y] - l[z]) <= 2 * GPU_TOL * mx;
                CHECKF(tie, "%s round %d seq %d draft %d: graphs %d, eager enqueue %d, eager path %d", name, round, i,
                       j, x, y, z);
                ties += tie;
                break; /* the chain goes on from another token: nothing after it compares */
            }
        }
        CHECKF(rc == 0, "%s mtp_draft: %s", name, err);
        if (rc) break;
    }
    printf("  %s pass: %d steps, %d drafts accepted, %d of %d drafts equal on the three paths, %d near ties\n", name,
           steps, accepted, equal, asked, ties);
    CHECK(steps >= 4 && asked > 0);
    free(lg);
    model_backend_destroy(be[0]);
    model_backend_destroy(be[1]);
    model_free(m);
    free(g);
}

static void test_pass_dsv3(void) { pass_case("dsv3"); }
static void test_pass_glm4moe(void) { pass_case("glm4moe"); }

int main(int argc, char **argv)
{
    for (int i = 1; i < argc; i++) {
        if (!strncmp(argv[i], "--device=", 9) && argv[i][9]) {
            g_device = argv[i] + 9;
        } else if (!strncmp(argv[i], "--tp=", 5) && atoi(argv[i] + 5) >= 1) {
            g_tp = atoi(argv[i] + 5);
        } else {
            fprintf(stderr, "usage: %s [--device=cpu|cuda] [--tp=N]\n", argv[0]);
            return 2;
        }
    }
    printf("MTP layer on device %s, %d rank(s)\n", g_device, g_tp);
    RUN(test_dsv3);
    RUN(test_glm4moe);
    RUN(test_glm4moe_int8_mtp);
    RUN(test_glm4moe_int8_main_bf16_mtp);
    RUN(test_random_and_dummy);
    RUN(test_off_and_errors);
    RUN(test_pass_dsv3);
    RUN(test_pass_glm4moe);
    return test_summary();
}

/* test_glm5.c - GLM-5.3-Flash (glm5_next: model/glm5.c, the hyper-connections
 * of model/cpu_hc.c, the k-pool DSA indexer of model/cpu_mla.c) against
 * transformers: tests/models/glm5/glm5-mla, made by
 * tests/golden/glm5/make_glm5.py (Glm5NextForConditionalGeneration at a tiny
 * random config: 3 MLA layers without RoPE, dense + sparse FFNs, 4 streams,
 * the indexer with k-pools of 4 on (golden.json) and, through
 * --hf-overrides' nested index_topk null, off (golden_dense.json)); glm5-hybrid
 * (3 KDA layers and an MLA one with its indexer, a 70-token prompt past one
 * 64-token KDA chunk) and glm5-mixed (the same in the seed's mixed int4 g32 /
 * int8 / bf16 scheme, against transformers on its dequantized weights).
 *
 * For each golden and prompt:
 *  - the decode form (one 1-token sequence per position; with KDA layers the
 *    prompt token by token in one state slot) and the prefill form (the
 *    prompt in one step) give transformers' logits (top 20, <= 1e-4
 *    relative);
 *  - chunked prefills at chunk sizes 3, 5 and 16 give the one-step logits bit
 *    for bit;
 *  - greedy decoding, one token a step, is transformers' continuation;
 *  - the cached decode's last logits equal an uncached forward (<= 1e-4);
 * and: the 4 residual streams after the embedding and after every layer match
 * transformers' (hidden.f32, <= 1e-4 of each layer's largest value); the KV
 * entry per layer follows the plan (latent, plus key and gate scores where a
 * layer runs its own indexer); the checkpoint's layout (model.language_model.
 * prefix, vision tower skipped, MTP counted); the layer-type spellings of
 * every transformers version; a linear_attention layer without its tensors named.
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
#include "tests/test.h"
#include "tests/golden.h"

#define MDIR "tests/models/glm5/glm5-mla"
#define HDIR "tests/models/glm5/glm5-hybrid" /* KDA + MLA layers */
#define QDIR "tests/models/glm5/glm5-mixed"  /* the same in the seed's mixed int4/int8/bf16 scheme */
#define BLOCK 16
#define REGION 8 /* blocks per block table: 128 positions */

static char err[512];

static model *load(const char *dir, const char *overrides)
{
    struct model_load_opts lo = {.hf_overrides = overrides};
    model *m = model_load(dir, &lo, err, sizeof err);
    CHECKF(m != NULL, "%s: %s", dir, err);
    return m;
}

/* One step over positions start..start+n-1 of ids; logits of every position
 * (all: one 1-token sequence per position) or of the last. A model with
 * recurrent layers runs the one sequence from state slot `slot`. */
static int slot;
static int step(model_backend *be, const int32_t *bt, const int32_t *ids, int start, int n, bool all, float *logits,
                int nv)
{
    static int32_t pos[256];
    static int64_t slots[256];
    static struct step_seq sq[256];
    if (n > 256) return -1;
    uint64_t rng = model_rng_seed(0);
    struct model_sampling greedy;
    model_sampling_default(&greedy);
    for (int t = 0; t < n; t++) {
        int p = start + t;
        pos[t] = p;
        slots[t] = (int64_t)bt[p / BLOCK] * BLOCK + p % BLOCK;
        sq[t] = (struct step_seq){.query_start = t, .query_len = 1, .context_len = p + 1, .block_table = bt,
                                  .n_blocks = REGION, .logits_out = logits + (size_t)t * nv};
    }
    if (!all)
        sq[0] = (struct step_seq){.query_start = 0, .query_len = n, .context_len = start + n, .block_table = bt,
                                  .n_blocks = REGION, .logits_out = logits, .want_sample = true, .sampling = &greedy,
                                  .history = ids, .n_prompt = start + n, .n_history = start + n, .rng = &rng,
                                  .state_slot = slot};
    struct step st = {.n_tokens = n, .token_ids = ids + start, .positions = pos, .slots = slots,
                      .n_seqs = all ? n : 1, .seqs = sq};
    int rc = be->ops->forward(be, &st, err, sizeof err);
    if (rc) printf("  forward: %s\n", err);
    return rc;
}

static int argmax(const float *v, int n)
{
    int b = 0;
    for (int i = 1; i < n; i++)
        if (v[i] > v[b]) b = i;
    return b;
}

/* largest |logit - golden| over the golden's top 20 at one position, relative to its largest |logit| */
static double rel_err(const float *lg, const struct prompt *p, int pos, int nv)
{
    double md = 0, mr = 0;
    for (int k = 0; k < TOPK; k++) {
        int id = p->top_ids[pos * TOPK + k];
        float ref = p->top_logits[pos * TOPK + k];
        double dd = id >= 0 && id < nv ? fabs((double)lg[id] - ref) : INFINITY;
        md = dd > md ? dd : md;
        mr = fabs(ref) > mr ? fabs(ref) : mr;
    }
    return md / (mr > 0 ? mr : 1);
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

static model_backend *backend(const model *m)
{
    struct model_backend_opts bo = {.device = "cpu", .n_threads = 2, .max_tokens_per_step = 256,
                                    .max_seqs_per_step = 256, .max_ctx = REGION * BLOCK};
    model_backend *be = model_backend_create(m, &bo, err, sizeof err);
    CHECKF(be != NULL, "%s", err);
    if (be && be->ops->kv_alloc(be, 2 * REGION, BLOCK, err, sizeof err) != 0) {
        CHECKF(0, "kv_alloc: %s", err);
        model_backend_destroy(be);
        return NULL;
    }
    if (be && be->ops->state_slot_bytes && be->ops->state_slot_bytes(be) > 0 &&
        be->ops->state_alloc(be, 2, err, sizeof err) != 0) {
        CHECKF(0, "state_alloc: %s", err);
        model_backend_destroy(be);
        return NULL;
    }
    return be;
}

/* recurrent: the model has KDA layers, whose state advances token by token in
 * one sequence's slot, so the decode form runs the prompt token by token in
 * that slot rather than as many 1-token sequences; the cached decode runs in
 * slot 0, the uncached forward in slot 1. */
static void run_golden(const char *dir, const char *golden, const char *overrides, bool recurrent)
{
    char gpath[300];
    snprintf(gpath, sizeof gpath, "%s/%s", dir, golden);
    model *m = load(dir, overrides);
    if (!m) return;
    struct golden g;
    CHECK(golden_load(gpath, &g) == 0);
    int nv = model_get_config(m)->n_vocab;
    model_backend *be = backend(m);
    if (!be) {
        model_free(m);
        golden_free(&g);
        return;
    }
    int32_t bt[REGION], bt2[REGION];
    for (int j = 0; j < REGION; j++) bt[j] = REGION - 1 - j, bt2[j] = REGION + j;
    double worst = 0, worst_pf = 0, worst_cache = 0;
    for (int i = 0; i < g.np; i++) {
        struct prompt *p = &g.p[i];
        int total = p->n + p->n_greedy;
        float *all = malloc((size_t)total * nv * sizeof *all), *one = malloc((size_t)nv * sizeof *one),
              *pf = malloc((size_t)nv * sizeof *pf);
        slot = 0;
        if (!recurrent) {
            CHECK(step(be, bt, p->ids, 0, p->n, true, all, nv) == 0);
        } else { /* token by token in the one slot: the logits of every position */
            for (int pos = 0; pos < p->n; pos++)
                CHECK(step(be, bt, p->ids, pos, 1, false, all + (size_t)pos * nv, nv) == 0);
        }
        for (int pos = 0; pos < p->n; pos++) {
            double r = rel_err(all + (size_t)pos * nv, p, pos, nv);
            if (!(r <= worst)) worst = r;
        }
        CHECK(step(be, bt, p->ids, 0, p->n, false, pf, nv) == 0);
        double r = rel_err(pf, p, p->n - 1, nv);
        if (!(r <= worst_pf)) worst_pf = r;
        /* chunked prefill: the one-step logits, bit for bit, whatever the chunk */
        static const int sizes[] = {3, 5, 16};
        for (size_t z = 0; z < sizeof sizes / sizeof *sizes; z++) {
            int cs = sizes[z];
            for (int s = 0, n; s < p->n; s += n) {
                n = p->n - s < cs ? p->n - s : cs;
                if (p->n - s - n == 1) n++; /* a last 1-token chunk would be the decode form */
                CHECK(step(be, bt, p->ids, s, n, false, one, nv) == 0);
            }
            CHECKF(memcmp(one, pf, (size_t)nv * sizeof *one) == 0,
                   "%s prompt %d: prefill in chunks of %d differs from the one-step logits", golden, i, cs);
        }
        int32_t seq[256];
        memcpy(seq, p->ids, (size_t)p->n * sizeof *seq);
        int first_diff = -1;
        for (int k = 0; k < p->n_greedy; k++) {
            int tok = argmax(one, nv);
            seq[p->n + k] = tok;
            if (first_diff < 0 && tok != p->ids[p->n + k]) first_diff = k;
            if (k + 1 < p->n_greedy) CHECK(step(be, bt, seq, p->n + k, 1, false, one, nv) == 0);
        }
        CHECKF(first_diff < 0, "%s prompt %d: greedy differs from transformers at token %d", golden, i, first_diff);
        int len = p->n + p->n_greedy - 1;
        if (len <= REGION * BLOCK) {
            slot = 1;
            CHECK(step(be, bt2, seq, 0, len, false, pf, nv) == 0);
            slot = 0;
            double c = rel_diff(one, pf, nv);
            if (!(c <= worst_cache)) worst_cache = c;
        }
        free(all);
        free(one);
        free(pf);
    }
    printf("  %s %s: worst relative logit error %.3g (decode form%s), %.3g (prefill form); cached vs uncached %.3g\n",
           dir + strlen("tests/models/glm5/"), golden, worst, recurrent ? ", token by token" : "", worst_pf,
           worst_cache);
    CHECKF(worst <= 1e-4 && worst_pf <= 1e-4, "%s: relative logit error %.3g / %.3g > 1e-4", golden, worst, worst_pf);
    CHECKF(worst_cache <= 1e-4, "%s: cached decode vs uncached forward %.3g > 1e-4", golden, worst_cache);
    model_backend_destroy(be);
    model_free(m);
    golden_free(&g);
}

static void test_logits_sparse(void) { run_golden(MDIR, "golden.json", NULL, false); }
static void test_logits_dense(void)
{
    run_golden(MDIR, "golden_dense.json", "{\"text_config\": {\"index_topk\": null}}", false);
}
static void test_logits_hybrid(void) { run_golden(HDIR, "golden.json", NULL, true); }

/* The seed's scheme, every family decided per tensor from the file (the
 * config a cross-check: its ignore names transformers' forget_gate path for
 * the file's f_a_proj), against transformers on the dequantized weights. */
static void test_logits_mixed(void)
{
    model *m = load(QDIR, NULL);
    if (m) {
        const struct model_weights *w = model_get_weights(m);
        const struct model_layer_weights *k = &w->layers[0], *a = &w->layers[3];
        CHECK(k->kda.q.dtype == MODEL_DT_QPACK && k->kda.q.quant->bits == 8 && k->kda.b.dtype == MODEL_DT_QPACK);
        CHECK(k->kda.f_a.dtype == MODEL_DT_BF16 && k->kda.f_b.dtype == MODEL_DT_BF16);
        CHECK(a->mla.q_a.dtype == MODEL_DT_QPACK && a->mla.kv_b.dtype == MODEL_DT_QPACK && a->mla.o.quant->bits == 8);
        CHECK(a->mla.ix_wq_b.dtype == MODEL_DT_BF16 && a->moe.router.dtype == MODEL_DT_BF16);
        CHECK(a->moe.gate[0].dtype == MODEL_DT_QPACK && a->moe.gate[0].quant->bits == 4 &&
              a->moe.gate[0].quant->group == 32 && a->moe.sh_up.quant->bits == 8);
        CHECK(w->mtp_tensors > 0);
        model_free(m);
    }
    run_golden(QDIR, "golden.json", NULL, true);
}

/* Every layer's 4 streams against transformers' (forward hooks on its
 * decoder layers), in the prefill form and (without recurrent layers) in the
 * decode form. */
static void hidden_streams(const char *dir, int forms)
{
    size_t len;
    char path[300];
    snprintf(path, sizeof path, "%s/hidden.json", dir);
    char *src = test_slurp(path, &len);
    CHECKF(src != NULL, "%s missing (make_glm5.py)", path);
    if (!src) return;
    json_doc d;
    char jerr[128];
    CHECK(json_parse(&d, src, len, jerr, sizeof jerr) == 0);
    int64_t pi = 0, nl = 0, hc = 0, E = 0;
    json_i64(&d, json_get(&d, 0, "prompt"), &pi);
    json_i64(&d, json_get(&d, 0, "layers"), &nl);
    json_i64(&d, json_get(&d, 0, "hc"), &hc);
    json_i64(&d, json_get(&d, 0, "hidden"), &E);
    int32_t pos[64];
    int np = read_ints(&d, json_get(&d, 0, "positions"), pos, 64);
    json_free(&d);
    free(src);
    size_t hlen;
    snprintf(path, sizeof path, "%s/hidden.f32", dir);
    float *ref = (float *)test_slurp(path, &hlen);
    CHECK(ref && np > 0 && hlen == (size_t)(nl * np * hc * E) * sizeof(float));
    struct golden g;
    model *m = load(dir, NULL);
    snprintf(path, sizeof path, "%s/golden.json", dir);
    if (!ref || !m || golden_load(path, &g) != 0) {
        free(ref);
        model_free(m);
        return;
    }
    const struct model_config *c = model_get_config(m);
    CHECK(nl == c->n_layer + 1 && hc == c->hc.mult && E == c->n_embd);
    model_backend *be = backend(m);
    struct prompt *p = &g.p[pi];
    int32_t bt[REGION];
    for (int j = 0; j < REGION; j++) bt[j] = j;
    size_t per = (size_t)p->n * hc * E;
    float *tr = malloc((size_t)nl * per * sizeof *tr), *lg = malloc((size_t)p->n * c->n_vocab * sizeof *lg);
    slot = 0;
    for (int form = 0; be && form < forms; form++) {
        cpu_backend_trace(be, tr);
        CHECK(step(be, bt, p->ids, 0, p->n, form == 1, lg, c->n_vocab) == 0);
        cpu_backend_trace(be, NULL);
        double worst = 0;
        int worst_l = 0;
        for (int l = 0; l < nl; l++) {
            double md = 0, mr = 0;
            for (int k = 0; k < np; k++) {
                const float *a = tr + l * per + (size_t)pos[k] * hc * E, *b = ref + ((size_t)l * np + k) * hc * E;
                for (int i = 0; i < hc * E; i++) {
                    double dd = fabs((double)a[i] - b[i]);
                    md = dd > md ? dd : md;
                    mr = fabs(b[i]) > mr ? fabs(b[i]) : mr;
                }
            }
            double r = md / (mr > 0 ? mr : 1);
            if (r > worst) worst = r, worst_l = l;
        }
        printf("  %s, %s form: every layer's %lld streams at %d positions, worst relative error %.3g (entry %d)\n",
               dir + strlen("tests/models/glm5/"), form ? "decode" : "prefill", (long long)hc, np, worst, worst_l);
        CHECKF(worst <= 1e-4, "%s form: layer entry %d's streams differ from transformers by %.3g",
               form ? "decode" : "prefill", worst_l, worst);
    }
    free(tr);
    free(lg);
    free(ref);
    model_backend_destroy(be);
    model_free(m);
    golden_free(&g);
}

static void test_hidden_streams(void) { hidden_streams(MDIR, 2); }
static void test_hidden_streams_hybrid(void) { hidden_streams(HDIR, 1); }

/* The checkpoint as the file holds it: text under model.language_model.,
 * the hyper-connection tensors under their checkpoint names, the k-pool
 * indexer's parameters, MTP counted (and switched off by an override), the
 * KV entry of each layer kind. */
static void test_layout(void)
{
    model *m = load(MDIR, NULL);
    if (!m) return;
    const struct model_config *c = model_get_config(m);
    const struct model_weights *w = model_get_weights(m);
    CHECK(c->arch == MODEL_ARCH_GLM5_NEXT && c->n_layer == 3 && c->hc.mult == 4 && c->hc.sinkhorn_iters == 7);
    CHECK(c->mla.qk_rope_head_dim == 0 && c->mla.index_kpool == 4 && c->mla.index_topk == 16);
    CHECK(c->mla.latent_norm_eps == c->norm_eps); /* glm5_next's latent norms use rms_norm_eps */
    CHECK(c->moe.swiglu_limit == 0.5f && c->moe.router == MODEL_ROUTER_SIGMOID && c->moe.n_ff_shared == 32);
    for (int l = 0; l < 3; l++) {
        struct model_layer_kind k = model_layer_kind_of(c, l);
        CHECK(k.mixer == MODEL_MIXER_MLA && k.resid == MODEL_RESID_HC);
        CHECK(k.ffn == (l == 0 ? MODEL_FFN_DENSE : MODEL_FFN_MOE));
        CHECK(w->layers[l].hc_attn.fn.data && w->layers[l].hc_ffn.scale.data);
        CHECKF(strstr(w->layers[l].hc_attn.fn.name, "model.language_model.layers.") != NULL, "%s",
               w->layers[l].hc_attn.fn.name);
    }
    CHECK(w->layers[0].mla.ix_kpool_ape.data && w->layers[2].mla.ix_kpool_gate.data);
    CHECK(w->layers[1].mla.ix_kpool_ape.data == NULL); /* "shared": the previous full layer's choice */
    CHECKF(w->mtp_tensors == 8 && w->mtp_bytes > 0, "mtp: %d tensors", w->mtp_tensors);
    /* latent 32 per token; a layer with its own indexer adds its key and gate scores, 16 each */
    CHECKF(model_kv_bytes_per_token(c, 4) == 4 * ((32 + 32) + 32 + (32 + 32)), "%zu",
           model_kv_bytes_per_token(c, 4));
    model_free(m);
    m = load(MDIR, "{\"text_config\": {\"index_topk\": null, \"index_n_heads\": null, \"index_head_dim\": null, "
                   "\"index_kpool\": null, \"num_nextn_predict_layers\": 0}}");
    if (m) {
        CHECK(model_get_config(m)->mla.index_topk == 0 && model_get_weights(m)->layers[0].mla.ix_wq_b.data == NULL);
        CHECK(model_kv_bytes_per_token(model_get_config(m), 4) == 4 * 3 * 32);
        CHECK(model_get_weights(m)->mtp_tensors == 0);
        model_free(m);
    }
}

/* A copy of the checkpoint whose config has layer_types[1] = ty. */
static char *with_layer_type(const char *ty)
{
    static char dir[64];
    snprintf(dir, sizeof dir, "/tmp/sluice_glm5_XXXXXX");
    if (!mkdtemp(dir)) return NULL;
    size_t len;
    char *src = test_slurp(MDIR "/config.json", &len), path[256], cwd[512];
    if (!src || !getcwd(cwd, sizeof cwd)) return free(src), NULL;
    char *at = strstr(src, "\"layer_types\"");
    char *q = at ? strstr(at, "indexed_attention") : NULL;
    q = q ? strstr(q + 1, "indexed_attention") : NULL; /* the second entry: layer 1 */
    if (!q) return free(src), NULL;
    snprintf(path, sizeof path, "%s/config.json", dir);
    FILE *f = fopen(path, "w");
    fprintf(f, "%.*s%s%s", (int)(q - src), src, ty, q + strlen("indexed_attention"));
    fclose(f);
    free(src);
    const char *links[] = {"model.safetensors", "tokenizer_config.json"};
    for (int i = 0; i < 2; i++) {
        char from[700];
        snprintf(from, sizeof from, "%s/%s/%s", cwd, MDIR, links[i]);
        snprintf(path, sizeof path, "%s/%s", dir, links[i]);
        if (symlink(from, path)) return NULL;
    }
    char from[700];
    snprintf(from, sizeof from, "%s/tests/models/quant/ct-w4g32-sym/tokenizer.json", cwd);
    snprintf(path, sizeof path, "%s/tokenizer.json", dir);
    if (symlink(from, path)) return NULL;
    return dir;
}

static void remove_dir(const char *dir)
{
    const char *names[] = {"config.json", "model.safetensors", "tokenizer_config.json", "tokenizer.json"};
    char path[256];
    for (int i = 0; i < 4; i++) {
        snprintf(path, sizeof path, "%s/%s", dir, names[i]);
        unlink(path);
    }
    rmdir(dir);
}

static void test_layer_types(void)
{
    /* the MLA type's name in every transformers version */
    const char *mla[] = {"full_attention", "deepseek_sparse_attention"};
    for (int i = 0; i < 2; i++) {
        char *dir = with_layer_type(mla[i]);
        CHECK(dir != NULL);
        if (!dir) continue;
        model *m = load(dir, NULL);
        CHECKF(m && model_layer_kind_of(model_get_config(m), 1).mixer == MODEL_MIXER_MLA, "%s", mla[i]);
        model_free(m);
        remove_dir(dir);
    }
    /* a KDA layer where the file holds an MLA layer's tensors: the first missing KDA tensor is named, under
     * the file's own prefix */
    char *dir = with_layer_type("linear_attention");
    CHECK(dir != NULL);
    if (dir) {
        struct model_load_opts lo = {0};
        model *m = model_load(dir, &lo, err, sizeof err);
        CHECK(m == NULL);
        CHECKF(strstr(err, "model.language_model.layers.1.self_attn.q_proj"), "%s", err);
        model_free(m);
        remove_dir(dir);
    }
    dir = with_layer_type("sliding_attention");
    if (dir) {
        struct model_load_opts lo = {0};
        model *m = model_load(dir, &lo, err, sizeof err);
        CHECK(m == NULL);
        CHECKF(strstr(err, "layer_types[1]") && strstr(err, "sliding_attention"), "%s", err);
        model_free(m);
        remove_dir(dir);
    }
}

int main(void)
{
    RUN(test_logits_sparse);
    RUN(test_logits_dense);
    RUN(test_hidden_streams);
    RUN(test_logits_hybrid);
    RUN(test_logits_mixed);
    RUN(test_hidden_streams_hybrid);
    RUN(test_layout);
    RUN(test_layer_types);
    return test_summary();
}

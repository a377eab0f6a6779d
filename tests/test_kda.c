/* test_kda.c - KDA linear attention (model/kda.c, model/cpu_kda.c) against
 * transformers: tests/golden/kda/{lb,nolb}.safetensors, made by
 * tests/golden/kda/make_kda.py (one Glm5NextTextLinearAttention layer with a
 * lower-bounded and a softplus forget gate; separate and fused conv tensors;
 * the forget gate's tensors under self_attn and under self_attn.forget_gate;
 * projections in mixed int4/int8/bf16 formats, decided per tensor).
 *
 *  - a 150-token prompt in one step gives the module's output (its chunked
 *    form) within 1e-4 relative, and its final recurrent state and conv tail;
 *  - four decode steps after it give the module's per-token decode outputs
 *    and state;
 *  - the prompt split into steps at several boundaries (token by token
 *    included) gives the one-step output and state bit for bit, and so do two
 *    sequences sharing a step;
 *  - snapshots taken inside a step equal the state of a run stopped there,
 *    and a run restored from one continues bit for bit;
 *  - the config keys as transformers reads them, and the step check refusing
 *    positions out of order or shared slots.
 */
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "base/json.h"
#include "model/backend.h"
#include "model/cpu_internal.h"
#include "model/kda.h"
#include "model/quant.h"
#include "model/safetensors.h"
#include "tests/test.h"

#define GDIR "tests/golden/kda"
#define PFX "model.layers.0.self_attn"
#define N 150
#define ND 4
#define E 64
#define H 4
#define D 16
#define CH (H * D)
#define KC 4

static char err[512];

/* ---- the golden file as a one-layer model ------------------------------------------ */

struct layer {
    st_set *st;
    struct model_config c;
    struct model_layer_kind kind;
    struct model_layer_weights lw;
    struct model_weights w;
    struct model_quant q[16];
    int nq;
    struct cpu_backend *be;
    struct cpu_kda *kda;
    size_t slot;        /* floats per state slot */
    float *states;      /* [8][slot] */
};

static void st_to_tensor(const struct st_tensor *s, struct model_tensor *t)
{
    memset(t, 0, sizeof *t);
    t->name = s->name;
    t->dtype = s->dtype;
    t->ndim = s->ndim;
    for (int i = 0; i < 4; i++) t->ne[i] = 1;
    for (int i = 0; i < s->ndim && i < 4; i++) t->ne[i] = s->shape[s->ndim - 1 - i];
    t->data = s->data;
    t->nbytes = s->nbytes;
}

static int lk_find(void *ctx, const char *name, struct model_tensor *t)
{
    struct layer *L = ctx;
    const struct st_tensor *s = st_find(L->st, name);
    if (!s) return 1;
    st_to_tensor(s, t);
    return 0;
}

static int lk_get(void *ctx, const char *name, int64_t rows, int64_t cols, bool optional, struct model_tensor *t,
                  char *e, size_t elen)
{
    struct layer *L = ctx;
    char module[256], fname[300];
    size_t n = strlen(name);
    snprintf(module, sizeof module, "%.*s", (int)(n - 7), name); /* drop ".weight" */
    if (L->nq == 16) return SL_ENOMEM;
    int rc = quant_load_weight(L->st, NULL, module, true, rows, cols, t, &L->q[L->nq], fname, sizeof fname, e, elen);
    if (rc < 0) return rc;
    if (rc == 1) {
        memset(t, 0, sizeof *t);
        if (optional) return 0;
        snprintf(e, elen, "missing tensor %s", name);
        return SL_EFORMAT;
    }
    if (t->dtype == MODEL_DT_QPACK) t->quant = &L->q[L->nq++];
    t->name = name;
    return 0;
}

static const float *golden(const struct layer *L, const char *name, int64_t n)
{
    const struct st_tensor *s = st_find(L->st, name);
    CHECKF(s && s->dtype == MODEL_DT_F32 && s->nbytes == (size_t)n * 4, "golden tensor %s", name);
    return s ? s->data : NULL;
}

static bool open_layer(struct layer *L, const char *file, bool lower_bound)
{
    memset(L, 0, sizeof *L);
    char path[256];
    snprintf(path, sizeof path, "%s/%s", GDIR, file);
    L->st = st_open_file(path, err, sizeof err);
    CHECKF(L->st != NULL, "%s: %s", path, err);
    if (!L->st) return false;
    struct model_config *c = &L->c;
    c->n_layer = 1;
    c->n_embd = E;
    c->norm_eps = 1e-5f;
    c->kda = (struct model_kda_config){.n_head = H, .head_dim = D, .conv_kernel = KC,
                                       .has_lower_bound = lower_bound, .lower_bound = -5.0f};
    L->kind = (struct model_layer_kind){MODEL_MIXER_KDA, MODEL_FFN_DENSE, MODEL_RESID_PLAIN};
    c->layer_kind = &L->kind;
    struct kda_lookup lk = {lk_get, lk_find, L};
    int rc = kda_bind_layer(&c->kda, E, PFX, &lk, &L->lw.kda, err, sizeof err);
    CHECKF(rc == 0, "bind %s: %s", file, err);
    if (rc) return false;
    L->w.layers = &L->lw;
    L->be = cpu_kernels_create(2, cpu_kda_max_in(c));
    L->kda = cpu_kda_create(L->be, c, &L->w, 256, err, sizeof err);
    CHECKF(L->kda != NULL, "%s", err);
    L->slot = model_state_bytes(c) / sizeof(float);
    CHECK(L->slot == (size_t)H * D * D + (size_t)(KC - 1) * 3 * CH);
    L->states = calloc(8 * L->slot, sizeof(float));
    return L->kda && L->states;
}

static void close_layer(struct layer *L)
{
    cpu_kda_destroy(L->kda);
    cpu_kernels_destroy(L->be);
    free(L->states);
    st_close(L->st);
}

/* ---- running steps -------------------------------------------------------------- */

struct seqrun {
    int slot, start, n;              /* positions start..start+n-1 of x */
    bool restore;
    int from;
    int n_snaps;
    int32_t snap_pos[4], snap_slot[4];
};

/* One step over the given sequences (inputs rows of x by position); out rows
 * in step order. */
static void run_step(struct layer *L, const float *x, const struct seqrun *r, int ns, float *out)
{
    static float xn[256 * E];
    static int32_t pos[256], ids[256];
    static int64_t slots[256];
    static struct step_seq sq[8];
    static int32_t bt[1] = {0};
    memset(sq, 0, sizeof sq);
    int T = 0;
    for (int i = 0; i < ns; i++) {
        sq[i].query_start = T;
        sq[i].query_len = r[i].n;
        sq[i].context_len = r[i].start + r[i].n;
        sq[i].block_table = bt;
        sq[i].state_slot = r[i].slot;
        sq[i].state_restore = r[i].restore;
        sq[i].state_from = r[i].from;
        sq[i].n_snaps = r[i].n_snaps;
        sq[i].snap_pos = r[i].snap_pos;
        sq[i].snap_slot = r[i].snap_slot;
        for (int t = 0; t < r[i].n; t++, T++) {
            memcpy(xn + (size_t)T * E, x + (size_t)(r[i].start + t) * E, E * sizeof(float));
            pos[T] = r[i].start + t;
            ids[T] = 0;
        }
    }
    struct step s = {.n_tokens = T, .token_ids = ids, .positions = pos, .slots = slots, .n_seqs = ns, .seqs = sq};
    cpu_kda_begin(L->kda, &s, L->states);
    cpu_kda_mixer(L->kda, L->be, &s, 0, xn, out, L->states);
}

/* max |a - b| / max |b| */
static double rel_err(const float *a, const float *b, int64_t n)
{
    double md = 0, mb = 0;
    for (int64_t i = 0; i < n; i++) {
        double d = fabs((double)a[i] - b[i]);
        if (d > md || isnan(d)) md = isnan(d) ? INFINITY : d;
        if (fabs(b[i]) > mb) mb = fabs(b[i]);
    }
    return mb > 0 ? md / mb : md;
}

static float *slot_state(struct layer *L, int slot) { return L->states + (size_t)slot * L->slot; }
static float *slot_tail(struct layer *L, int slot) { return slot_state(L, slot) + (size_t)H * D * D; }

/* ---- tests -------------------------------------------------------------------------- */

static void check_golden(const char *file, bool lb)
{
    struct layer L;
    if (!open_layer(&L, file, lb)) {
        close_layer(&L);
        return;
    }
    const float *x = golden(&L, "x", (int64_t)N * E), *ref = golden(&L, "out", (int64_t)N * E);
    const float *st = golden(&L, "state", (int64_t)H * D * D), *tail = golden(&L, "conv_tail", 3 * 3 * CH);
    const float *dx = golden(&L, "dec_x", ND * E), *dref = golden(&L, "dec_out", ND * E);
    const float *dst = golden(&L, "dec_state", (int64_t)H * D * D);
    if (!x || !ref || !st || !tail || !dx || !dref || !dst) {
        close_layer(&L);
        return;
    }
    static float out[N * E], dout[ND * E];
    struct seqrun one = {.slot = 0, .start = 0, .n = N};
    run_step(&L, x, &one, 1, out);
    double e1 = rel_err(out, ref, (int64_t)N * E), e2 = rel_err(slot_state(&L, 0), st, (int64_t)H * D * D),
           e3 = rel_err(slot_tail(&L, 0), tail, 3 * 3 * CH);
    CHECKF(e1 < 1e-4, "%s: prompt output rel err %.3g", file, e1);
    CHECKF(e2 < 1e-4, "%s: state rel err %.3g", file, e2);
    CHECKF(e3 < 1e-5, "%s: conv tail rel err %.3g", file, e3);
    /* decode: x rows after the prompt are dec_x */
    static float xall[(N + ND) * E];
    memcpy(xall, x, sizeof(float) * N * E);
    memcpy(xall + (size_t)N * E, dx, sizeof(float) * ND * E);
    for (int i = 0; i < ND; i++) {
        struct seqrun d = {.slot = 0, .start = N + i, .n = 1};
        run_step(&L, xall, &d, 1, dout + (size_t)i * E);
    }
    double e4 = rel_err(dout, dref, ND * E), e5 = rel_err(slot_state(&L, 0), dst, (int64_t)H * D * D);
    CHECKF(e4 < 1e-4, "%s: decode output rel err %.3g", file, e4);
    CHECKF(e5 < 1e-4, "%s: decode state rel err %.3g", file, e5);
    printf("  %s: prompt %.2e, state %.2e, decode %.2e, decode state %.2e\n", file, e1, e2, e4, e5);
    close_layer(&L);
}

static void test_golden_lower_bound(void) { check_golden("lb.safetensors", true); }

/* Every projection's format is the file's own, tensor by tensor (the seed
 * checkpoint's bug was code that assumed a module family stayed bf16). */
static void test_golden_mixed_formats(void)
{
    struct layer L;
    if (open_layer(&L, "mixed.safetensors", true)) {
        const struct model_kda_weights *w = &L.lw.kda;
        struct {
            const struct model_tensor *t;
            int bits, group; /* 0: bf16 */
        } want[] = {{&w->q, 4, 32}, {&w->o, 4, 32}, {&w->k, 8, 64}, {&w->f_a, 8, 64}, {&w->b, 8, 64},
                    {&w->f_b, 4, 16}, {&w->g_b, 4, 16}, {&w->v, 0, 0}, {&w->g_a, 0, 0}};
        for (size_t i = 0; i < sizeof want / sizeof *want; i++) {
            const struct model_tensor *t = want[i].t;
            if (want[i].bits == 0)
                CHECKF(t->dtype == MODEL_DT_BF16, "%s: %s", t->name, model_dtype_name(t->dtype));
            else
                CHECKF(t->dtype == MODEL_DT_QPACK && t->quant->bits == want[i].bits &&
                           t->quant->group == want[i].group && t->quant->sym,
                       "%s: %s", t->name, model_dtype_name(t->dtype));
        }
    }
    close_layer(&L);
    check_golden("mixed.safetensors", true);
}
static void test_golden_softplus(void) { check_golden("nolb.safetensors", false); }

/* The prompt in steps of the given lengths into slot `slot`, outputs in out. */
static void run_split(struct layer *L, const float *x, const int *lens, int slot, float *out)
{
    int p = 0;
    for (int i = 0; p < N; i++) {
        int n = lens[i] > 0 ? lens[i] : 1;
        if (n > N - p) n = N - p;
        struct seqrun r = {.slot = slot, .start = p, .n = n};
        run_step(L, x, &r, 1, out + (size_t)p * E);
        p += n;
    }
}

static void test_split_exact(void)
{
    struct layer L;
    if (!open_layer(&L, "lb.safetensors", true)) {
        close_layer(&L);
        return;
    }
    const float *x = golden(&L, "x", (int64_t)N * E);
    static float one[N * E], out[N * E];
    static float st1[H * D * D + 3 * 3 * CH];
    struct seqrun r = {.slot = 0, .start = 0, .n = N};
    run_step(&L, x, &r, 1, one);
    memcpy(st1, slot_state(&L, 0), L.slot * sizeof(float));
    static const int splits[][8] = {
        {64, 64, 22}, {1, 63, 64, 22}, {100, 50}, {3, 2, 1, 144}, {149, 1}, {7, 7, 7, 7, 7, 7, 7, 101},
    };
    for (size_t k = 0; k < sizeof splits / sizeof *splits; k++) {
        memset(slot_state(&L, 1), 0x7f, L.slot * sizeof(float)); /* garbage: the first step must zero it */
        run_split(&L, x, splits[k], 1, out);
        CHECKF(memcmp(out, one, sizeof one) == 0, "split %zu: output differs from one pass", k);
        CHECKF(memcmp(slot_state(&L, 1), st1, L.slot * sizeof(float)) == 0, "split %zu: state differs", k);
    }
    int lens[N];
    for (int i = 0; i < N; i++) lens[i] = 1;
    run_split(&L, x, lens, 2, out);
    CHECK(memcmp(out, one, sizeof one) == 0);
    CHECK(memcmp(slot_state(&L, 2), st1, L.slot * sizeof(float)) == 0);

    /* two sequences in one step: the prompt's first 90 tokens in slot 3 beside
     * its tokens 100..149 continuing slot 4 (first run to 100 alone) */
    static float mix[140 * E];
    struct seqrun a = {.slot = 4, .start = 0, .n = 100};
    run_step(&L, x, &a, 1, out);
    struct seqrun both[2] = {{.slot = 3, .start = 0, .n = 90}, {.slot = 4, .start = 100, .n = 50}};
    run_step(&L, x, both, 2, mix);
    CHECK(memcmp(mix, one, sizeof(float) * 90 * E) == 0);
    CHECK(memcmp(mix + (size_t)90 * E, one + (size_t)100 * E, sizeof(float) * 50 * E) == 0);
    CHECK(memcmp(slot_state(&L, 4), st1, L.slot * sizeof(float)) == 0);
    close_layer(&L);
}

static void test_snapshots(void)
{
    struct layer L;
    if (!open_layer(&L, "nolb.safetensors", false)) {
        close_layer(&L);
        return;
    }
    const float *x = golden(&L, "x", (int64_t)N * E);
    static float one[N * E], out[N * E];
    static float st1[H * D * D + 3 * 3 * CH], at64[H * D * D + 3 * 3 * CH], at130[H * D * D + 3 * 3 * CH];
    /* references: runs stopped at 64 and at 130 */
    struct seqrun r64 = {.slot = 0, .start = 0, .n = 64};
    run_step(&L, x, &r64, 1, out);
    memcpy(at64, slot_state(&L, 0), sizeof at64);
    struct seqrun r130 = {.slot = 0, .start = 0, .n = 130};
    run_step(&L, x, &r130, 1, out);
    memcpy(at130, slot_state(&L, 0), sizeof at130);
    /* the whole prompt in two steps, snapshots at 64 (inside the first: the
     * tail from the step's tokens), at 2 (the tail partly zeros) and at 130
     * (inside the second: the tail partly from the first step) */
    struct seqrun s1 = {.slot = 1, .start = 0, .n = 100, .n_snaps = 2, .snap_pos = {2, 64}, .snap_slot = {5, 2}};
    run_step(&L, x, &s1, 1, one);
    struct seqrun s2 = {.slot = 1, .start = 100, .n = 50, .n_snaps = 1, .snap_pos = {130}, .snap_slot = {3}};
    run_step(&L, x, &s2, 1, one + (size_t)100 * E);
    memcpy(st1, slot_state(&L, 1), sizeof st1);
    CHECK(memcmp(slot_state(&L, 2), at64, sizeof at64) == 0);
    CHECK(memcmp(slot_state(&L, 3), at130, sizeof at130) == 0);
    /* restored from the snapshot at 64 into slot 6 (holding garbage) */
    memset(slot_state(&L, 6), 0x7f, L.slot * sizeof(float));
    struct seqrun rs = {.slot = 6, .start = 64, .n = 86, .restore = true, .from = 2};
    run_step(&L, x, &rs, 1, out + (size_t)64 * E);
    CHECK(memcmp(out + (size_t)64 * E, one + (size_t)64 * E, sizeof(float) * 86 * E) == 0);
    CHECK(memcmp(slot_state(&L, 6), st1, sizeof st1) == 0);
    CHECK(memcmp(slot_state(&L, 2), at64, sizeof at64) == 0); /* the snapshot itself untouched */
    close_layer(&L);
}

static void test_config_keys(void)
{
    struct {
        const char *json;
        int heads, dim, conv;
        bool lb;
        float bound;
        int rc;
    } cases[] = {
        {"{}", 64, 128, 4, true, -5.0f, 0},
        {"{\"linear_num_heads\": 4, \"linear_head_dim\": 16, \"linear_conv_kernel_dim\": 3, "
         "\"linear_lower_bound\": null}", 4, 16, 3, false, 0, 0},
        {"{\"linear_lower_bound\": -3.5}", 64, 128, 4, true, -3.5f, 0},
        {"{\"linear_attn_config\": {\"num_heads\": 8, \"head_dim\": 32, \"short_conv_kernel_size\": 2, "
         "\"gate_lower_bound\": null, \"safe_gate\": false}}", 8, 32, 2, false, 0, 0},
        {"{\"linear_lower_bound\": null, \"linear_attn_config\": {}}", 64, 128, 4, true, -5.0f, 0},
        {"{\"linear_num_heads\": 0}", 0, 0, 0, false, 0, SL_EFORMAT},
        {"{\"linear_lower_bound\": 2}", 0, 0, 0, false, 0, SL_EFORMAT},
    };
    for (size_t i = 0; i < sizeof cases / sizeof *cases; i++) {
        json_doc d;
        CHECK(json_parse(&d, cases[i].json, strlen(cases[i].json), err, sizeof err) == 0);
        struct model_kda_config k;
        int rc = kda_hf_config(&d, 0, &k, err, sizeof err);
        CHECKF(rc == cases[i].rc, "case %zu: rc %d (%s)", i, rc, err);
        if (rc == 0 && cases[i].rc == 0) {
            CHECKF(k.n_head == cases[i].heads && k.head_dim == cases[i].dim && k.conv_kernel == cases[i].conv &&
                       k.has_lower_bound == cases[i].lb && (!k.has_lower_bound || k.lower_bound == cases[i].bound),
                   "case %zu: %d %d %d %d %g", i, k.n_head, k.head_dim, k.conv_kernel, k.has_lower_bound,
                   (double)k.lower_bound);
        }
        if (cases[i].rc != 0) CHECKF(strstr(err, "linear_") != NULL, "case %zu: %s", i, err);
        json_free(&d);
    }
}

static void test_step_check(void)
{
    int32_t ids[3] = {1, 2, 3}, pos[3] = {5, 6, 7}, bt[1] = {0};
    int64_t slots[3] = {5, 6, 7};
    int tok_seq[3];
    struct step_seq sq[2] = {{.query_start = 0, .query_len = 2, .context_len = 7, .block_table = bt, .n_blocks = 1,
                              .state_slot = 1},
                             {.query_start = 2, .query_len = 1, .context_len = 8, .block_table = bt, .n_blocks = 1,
                              .state_slot = 2}};
    struct step s = {.n_tokens = 3, .token_ids = ids, .positions = pos, .slots = slots, .n_seqs = 2, .seqs = sq};
    struct model_step_limits lim = {.n_vocab = 10, .max_tokens = 8, .max_seqs = 4, .max_ctx = 16, .block_size = 16,
                                    .kv_blocks = 1, .state_slots = 4};
    CHECKF(model_step_check(&s, &lim, tok_seq, err, sizeof err) == 0, "%s", err);
    pos[0] = 6, pos[1] = 5; /* out of order: fine for attention, not for a recurrence */
    slots[0] = 6, slots[1] = 5;
    CHECK(model_step_check(&s, &lim, tok_seq, err, sizeof err) == SL_EINVAL && strstr(err, "in order"));
    lim.state_slots = 0;
    CHECK(model_step_check(&s, &lim, tok_seq, err, sizeof err) == 0);
    lim.state_slots = 4;
    pos[0] = 5, pos[1] = 6, slots[0] = 5, slots[1] = 6;
    sq[1].state_slot = 1;
    CHECK(model_step_check(&s, &lim, tok_seq, err, sizeof err) == SL_EINVAL && strstr(err, "share"));
    sq[1].state_slot = 4;
    CHECK(model_step_check(&s, &lim, tok_seq, err, sizeof err) == SL_EINVAL);
    sq[1].state_slot = 2;
    int32_t sp[1] = {5}, ss[1] = {3};
    sq[0].n_snaps = 1, sq[0].snap_pos = sp, sq[0].snap_slot = ss;
    CHECK(model_step_check(&s, &lim, tok_seq, err, sizeof err) == SL_EINVAL); /* at the step's start: nothing new */
    sp[0] = 7;
    CHECKF(model_step_check(&s, &lim, tok_seq, err, sizeof err) == 0, "%s", err);
    ss[0] = 1;
    CHECK(model_step_check(&s, &lim, tok_seq, err, sizeof err) == SL_EINVAL);
}

int main(void)
{
    RUN(test_golden_lower_bound);
    RUN(test_golden_softplus);
    RUN(test_golden_mixed_formats);
    RUN(test_split_exact);
    RUN(test_snapshots);
    RUN(test_config_keys);
    RUN(test_step_check);
    return test_summary();
}

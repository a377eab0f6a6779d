/* test_kda.c - the GPU's KDA kernels (cuda/kda.cu: cuda_kda_begin,
 * cuda_kda_recur) against the CPU reference (model/cpu_kda.c) on one random
 * layer (make gpu-test; needs a GPU).
 *
 * Both sides get the same bf16-valued weights and inputs; the kernels get
 * the projections computed on the host in double (the CPU's own matmuls are
 * f32: the difference is ~1e-7), so what is compared is the kernels' work:
 * the conv and its tail, the norms, the gates, the delta rule, the output
 * norm (the GPU's output is bf16, so the o projection of it, done on the
 * host, is compared at bf16 tolerance) and every state slot (S and tail,
 * f32) after each step. Per case one ok/FAIL line with the max errors
 * (max |gpu - cpu| / max |cpu|).
 *
 * Cases, each with a lower-bounded and a softplus forget gate and at
 * head_dim 16 and 128 (128: S in 64 KB of shared memory):
 *  - one step of several sequences of different lengths: one from position 0,
 *    one resumed from its slot (random state), one restored from another
 *    slot, snapshots mid-step and at the step's last token, and a padding
 *    entry (as a decode graph's);
 *  - then a decode step of 1-token sequences over those slots;
 *  - a prompt in one step and in two (split mid-conv-window) in another slot,
 *    the first with one recurrence block a head, the second with blocks of
 *    fewer value columns (a partial last one): the same states and outputs
 *    bit for bit.
 *  - drafts: a verify step whose sequences end in drafts (one accepting
 *    one of 3, one all 3 with a snapshot among them, one none; beside a
 *    plain prefill), then the replay of the accepted ones (kda.h): the
 *    states and the accepted tokens' outputs are the CPU's walk over the
 *    accepted tokens alone, and bit for bit the GPU's own plain step over
 *    them.
 * The kernels get q|k|v as a high and a low part (a quarter of each value),
 * as the mixer's two-part projection leaves them. And cuda_kda_xsplit: xn
 * itself, then the low part that brings it to the f32 norm.
 * The chunked kernels (cuda/kda_chunk.cu, cuda_kda_chunk) on the same
 * harness, at chunk lengths 1, 5, 16, 32, 64 and the default, value columns
 * split or not: several sequences with snapshots on and off the chunk grid,
 * resumed and restored, and a prefill beside 1-token sequences, against the
 * CPU recurrence and against the GPU recurrence from the same states (bf16
 * outputs; states to 1e-4: the chunked form reorders the sums); decays near 0
 * and 1 side by side; a prompt split on the chunk grid giving one step's bits,
 * split off it, one step's values to f32 rounding; shapes it cannot take
 * refused.
 * And, on the host (no GPU needed), cuda_kda_pack: the step's sequences and
 * snapshots as the kernels read them, padding for a decode graph, a step
 * whose snapshots overflow the buffer refused, a verify step's drafts (nd,
 * their rows of the replay scratch) and one with more than it holds refused.
 */
#include <cuda_runtime.h>
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "cuda/cuda_internal.h"
#include "cuda/kda.h"
#include "cuda/kda_chunk.h"
#include "model/backend.h"
#include "model/cpu_internal.h"
#include "model/model.h"
#include "tests/gpu/gpu_util.h"
#include "tests/test.h"

#define NSLOT 8
#define MAXT 160

struct lay {
    int E, H, D, C, K;
    bool lb;
    struct model_config c;
    struct model_layer_kind kind;
    struct model_layer_weights lw;
    struct model_weights w;
    float *wq, *wk, *wv, *wfa, *wfb, *wb, *wga, *wgb, *wo, *conv, *dtb, *alog, *onorm; /* host, bf16 values */
    struct cpu_backend *be;
    struct cpu_kda *kda;
    size_t slot;           /* floats a slot */
    float *cst;            /* CPU states [NSLOT][slot] */
    float *dst;            /* device states */
    float *dconv, *ddtb, *dA, *donorm;
};

static float *rnd(size_t n, float scale, float bias)
{
    float *p = malloc(n * sizeof *p);
    for (size_t i = 0; i < n; i++) p[i] = fb(bf(bias + scale * frand()));
    return p;
}

static struct model_tensor mat(const char *name, float *data, int64_t rows, int64_t cols)
{
    struct model_tensor t = {0};
    t.name = name;
    t.dtype = MODEL_DT_F32;
    t.ndim = rows ? 2 : 1;
    t.ne[0] = cols, t.ne[1] = rows ? rows : 1, t.ne[2] = 1, t.ne[3] = 1;
    t.data = data;
    t.nbytes = (size_t)(rows ? rows : 1) * cols * 4;
    return t;
}

static void *up(const void *h, size_t n)
{
    void *d = NULL;
    if (cudaMalloc(&d, n ? n : 16) != cudaSuccess) abort();
    if (h) cudaMemcpy(d, h, n, cudaMemcpyHostToDevice);
    return d;
}

/* dt_bias + g_dshift, the sign alternating by channel: decays near 0 and near 1 side by side (0: as drawn) */
static float g_dshift;

static bool lay_open(struct lay *L, int E, int H, int D, bool lb)
{
    memset(L, 0, sizeof *L);
    int C = H * D, K = 4;
    L->E = E, L->H = H, L->D = D, L->C = C, L->K = K, L->lb = lb;
    float se = 1.0f / sqrtf((float)E), sd = 1.0f / sqrtf((float)D), sc = 1.0f / sqrtf((float)C);
    L->wq = rnd((size_t)C * E, se, 0), L->wk = rnd((size_t)C * E, se, 0), L->wv = rnd((size_t)C * E, se, 0);
    L->wfa = rnd((size_t)D * E, se, 0), L->wfb = rnd((size_t)C * D, sd, 0), L->wb = rnd((size_t)H * E, se, 0);
    L->wga = rnd((size_t)D * E, se, 0), L->wgb = rnd((size_t)C * D, sd, 0), L->wo = rnd((size_t)E * C, sc, 0);
    L->conv = rnd((size_t)3 * C * K, 0.5f, 0), L->dtb = rnd((size_t)C, 0.5f, 0), L->alog = rnd((size_t)H, 0.5f, 0);
    L->onorm = rnd((size_t)D, 0.2f, 1.0f);
    for (int c = 0; c < C; c++) L->dtb[c] += c & 1 ? -g_dshift : g_dshift;
    struct model_config *c = &L->c;
    c->n_layer = 1, c->n_embd = E, c->norm_eps = 1e-5f;
    c->kda = (struct model_kda_config){.n_head = H, .head_dim = D, .conv_kernel = K, .has_lower_bound = lb,
                                       .lower_bound = -5.0f};
    L->kind = (struct model_layer_kind){MODEL_MIXER_KDA, MODEL_FFN_DENSE, MODEL_RESID_PLAIN};
    c->layer_kind = &L->kind;
    struct model_kda_weights *kw = &L->lw.kda;
    kw->q = mat("q", L->wq, C, E), kw->k = mat("k", L->wk, C, E), kw->v = mat("v", L->wv, C, E);
    kw->f_a = mat("f_a", L->wfa, D, E), kw->f_b = mat("f_b", L->wfb, C, D), kw->b = mat("b", L->wb, H, E);
    kw->g_a = mat("g_a", L->wga, D, E), kw->g_b = mat("g_b", L->wgb, C, D), kw->o = mat("o", L->wo, E, C);
    for (int i = 0; i < 3; i++) kw->conv[i] = mat("conv", L->conv + (size_t)i * C * K, C, K);
    kw->dt_bias = mat("dt_bias", L->dtb, 0, C), kw->A_log = mat("A_log", L->alog, 0, H);
    kw->o_norm = mat("o_norm", L->onorm, 0, D);
    L->w.layers = &L->lw;
    char err[256];
    L->be = cpu_kernels_create(2, cpu_kda_max_in(c));
    L->kda = L->be ? cpu_kda_create(L->be, c, &L->w, MAXT, err, sizeof err) : NULL;
    CHECKF(L->kda != NULL, "cpu_kda_create: %s", L->be ? err : "no backend");
    if (!L->kda) return false;
    L->slot = model_state_bytes(c) / sizeof(float);
    /* random states in every slot (a resumed sequence reads one), the same on both sides */
    L->cst = malloc((size_t)NSLOT * L->slot * sizeof(float));
    for (size_t i = 0; i < NSLOT * L->slot; i++) L->cst[i] = 0.1f * frand();
    L->dst = up(L->cst, (size_t)NSLOT * L->slot * sizeof(float));
    float *A = malloc((size_t)H * sizeof *A);
    for (int h = 0; h < H; h++) A[h] = expf(L->alog[h]);
    L->dconv = up(L->conv, (size_t)3 * C * K * 4), L->ddtb = up(L->dtb, (size_t)C * 4), L->dA = up(A, (size_t)H * 4);
    L->donorm = up(L->onorm, (size_t)D * 4);
    free(A);
    return true;
}

static void lay_close(struct lay *L)
{
    cpu_kda_destroy(L->kda);
    if (L->be) cpu_kernels_destroy(L->be);
    float *h[] = {L->wq, L->wk, L->wv, L->wfa, L->wfb, L->wb, L->wga, L->wgb, L->wo, L->conv, L->dtb, L->alog,
                  L->onorm, L->cst};
    for (size_t i = 0; i < sizeof h / sizeof *h; i++) free(h[i]);
    cudaFree(L->dst), cudaFree(L->dconv), cudaFree(L->ddtb), cudaFree(L->dA), cudaFree(L->donorm);
}

/* y[t][o] = sum_i x[t][i] W[o][i], in double */
static void hmat(const float *x, const float *W, int T, int in, int out, float *y)
{
    for (int t = 0; t < T; t++)
        for (int o = 0; o < out; o++) {
            double s = 0;
            for (int i = 0; i < in; i++) s += (double)x[(size_t)t * in + i] * W[(size_t)o * in + i];
            y[(size_t)t * out + o] = (float)s;
        }
}

struct sq {
    int slot, start, n;
    bool restore;
    int from, n_snaps;
    int32_t snap_pos[4], snap_slot[4];
    int nd, acc; /* the last nd of its n tokens are drafts, the first acc of them accepted (0: no drafts) */
};

/* max |a - b| / max |b| (NaN: inf) */
static double rel(const float *a, const float *b, size_t n)
{
    double md = 0, mb = 0;
    for (size_t i = 0; i < n; i++) {
        double d = fabs((double)a[i] - b[i]);
        if (isnan(d)) return INFINITY;
        if (d > md) md = d;
        if (fabs(b[i]) > mb) mb = fabs(b[i]);
    }
    return mb > 0 ? md / mb : md;
}

/* The recurrence's value columns a block (cuda_kda_args.cols; 0: the default) */
static int g_cols;
/* >= 0: the GPU runs cuda_kda_chunk with chunks of g_chunk tokens (0: its default) instead of cuda_kda_recur */
static int g_chunk = -1;
/* the CPU side left out (the CPU states stay as they were) */
static bool g_gpu_only;

/* One step of the sequences r[0..ns) (x rows by position, per sequence its
 * own stream xs[i]) on both sides, plus `pad` padding entries on the GPU.
 * A sequence with drafts (nd > 0): the GPU verifies all its n tokens and
 * then replays the accepted ones (cuda_kda_args.replay), the CPU walks its
 * n - nd + acc kept tokens only. gout: the GPU's output after the host o
 * projection, of the tokens the CPU computed, in the CPU's rows [T][E]; cout
 * the CPU's. Returns T (the CPU's tokens). */
static int step(struct lay *L, float *const *xs, const struct sq *r, int ns, int pad, float *gout, float *cout)
{
    int E = L->E, C = L->C, H = L->H, D = L->D, T = 0, Tc = 0, nspec = 0;
    static float xn[MAXT * 256], xc[MAXT * 256];
    static int32_t pos[MAXT], ids[MAXT], bt[1], gmap[MAXT];
    static int64_t slots[MAXT];
    struct step_seq ss[8];
    struct cuda_kda_seq ks[8], rp[8];
    struct cuda_kda_snap sn[32];
    int nsn = 0, nrp = 0;
    memset(ss, 0, sizeof ss);
    for (int i = 0; i < ns; i++) {
        int nc = r[i].n - r[i].nd + r[i].acc; /* the tokens the CPU walks */
        ss[i] = (struct step_seq){.query_start = Tc, .query_len = nc, .context_len = r[i].start + nc,
                                  .block_table = bt, .state_slot = r[i].slot, .state_restore = r[i].restore,
                                  .state_from = r[i].from, .n_snaps = r[i].n_snaps, .snap_pos = r[i].snap_pos,
                                  .snap_slot = r[i].snap_slot};
        int mode = r[i].start == 0 ? CUDA_KDA_ZERO : r[i].restore ? CUDA_KDA_RESTORE : CUDA_KDA_CONTINUE;
        ks[i] = (struct cuda_kda_seq){.t0 = T, .n = r[i].n, .p0 = r[i].start, .slot = r[i].slot, .mode = mode,
                                      .from = r[i].from, .snap0 = nsn, .n_snaps = r[i].n_snaps, .nd = r[i].nd,
                                      .spec0 = nspec};
        if (r[i].nd > 0 && r[i].acc > 0)
            rp[nrp++] = (struct cuda_kda_seq){.t0 = nspec, .n = r[i].acc, .p0 = r[i].start + r[i].n - r[i].nd,
                                              .slot = r[i].slot, .mode = CUDA_KDA_CONTINUE};
        nspec += r[i].nd;
        for (int k = 0; k < r[i].n_snaps; k++) sn[nsn++] = (struct cuda_kda_snap){r[i].snap_pos[k], r[i].snap_slot[k]};
        for (int t = 0; t < r[i].n; t++, T++) {
            memcpy(xn + (size_t)T * E, xs[i] + (size_t)(r[i].start + t) * E, (size_t)E * sizeof(float));
            if (t < nc) {
                memcpy(xc + (size_t)Tc * E, xn + (size_t)T * E, (size_t)E * sizeof(float));
                pos[Tc] = r[i].start + t, ids[Tc] = 0, gmap[Tc++] = T;
            }
        }
    }
    for (int i = ns; i < ns + pad; i++) ks[i] = (struct cuda_kda_seq){.n = 0, .slot = 0};
    /* the CPU */
    struct step s = {.n_tokens = Tc, .token_ids = ids, .positions = pos, .slots = slots, .n_seqs = ns, .seqs = ss};
    if (!g_gpu_only) {
        cpu_kda_begin(L->kda, &s, L->cst);
        cpu_kda_mixer(L->kda, L->be, &s, 0, xc, cout, L->cst);
    }
    /* the GPU, from projections made here */
    float *qkv = malloc((size_t)T * 3 * C * 4), *p = malloc((size_t)T * C * 4), *fa = malloc((size_t)T * D * 4),
          *fg = malloc((size_t)T * C * 4), *gt = malloc((size_t)T * C * 4), *beta = malloc((size_t)T * H * 4);
    const float *W3[3] = {L->wq, L->wk, L->wv};
    for (int pt = 0; pt < 3; pt++) {
        hmat(xn, W3[pt], T, E, C, p);
        for (int t = 0; t < T; t++) memcpy(qkv + (size_t)t * 3 * C + (size_t)pt * C, p + (size_t)t * C, (size_t)C * 4);
    }
    hmat(xn, L->wfa, T, E, D, fa), hmat(fa, L->wfb, T, D, C, fg);
    hmat(xn, L->wga, T, E, D, fa), hmat(fa, L->wgb, T, D, C, gt);
    hmat(xn, L->wb, T, E, H, beta);
    /* q|k|v as the mixer gives them: a high part and a low part the kernels add (a quarter of each value in
     * the low part, so a kernel that dropped or misplaced it is far off) */
    float *lo = malloc((size_t)T * 3 * C * 4);
    for (size_t i = 0; i < (size_t)T * 3 * C; i++) {
        float hi = fb(bf(0.75f * qkv[i]));
        lo[i] = qkv[i] - hi, qkv[i] = hi;
    }
    float *dlo = up(lo, (size_t)T * 3 * C * 4), *do32 = up(NULL, (size_t)T * C * 4);
    free(lo);
    float *dqkv = up(qkv, (size_t)T * 3 * C * 4), *dfg = up(fg, (size_t)T * C * 4), *dgt = up(gt, (size_t)T * C * 4),
          *dbeta = up(beta, (size_t)T * H * 4);
    struct cuda_kda_seq *dks = up(ks, sizeof ks), *drp = up(rp, sizeof rp);
    struct cuda_kda_snap *dsn = up(sn, sizeof sn);
    uint16_t *dout = up(NULL, (size_t)T * C * 2);
    cudaMemset(dout, 0xff, (size_t)T * C * 2); /* NaN: an unwritten element fails */
    /* the replay scratch, NaN where not written */
    float *sq = up(NULL, (size_t)nspec * 3 * C * 4), *sf = up(NULL, (size_t)nspec * C * 4),
          *sb = up(NULL, (size_t)nspec * H * 4);
    cudaMemset(sq, 0xff, (size_t)nspec * 3 * C * 4), cudaMemset(sf, 0xff, (size_t)nspec * C * 4);
    cudaMemset(sb, 0xff, (size_t)nspec * H * 4);
    struct cuda_kda_args a = {.qkv = dqkv, .qkv_lo = dlo, .o32 = do32, .cols = g_cols, .fg = dfg, .beta = dbeta,
                              .gate = dgt, .conv = L->dconv, .dt_bias = L->ddtb,
                              .A = L->dA, .o_norm = L->donorm, .states = L->dst, .slot_floats = L->slot, .off = 0,
                              .seqs = dks, .snaps = dsn, .n_seqs = ns + pad, .H = H, .D = D, .K = L->K,
                              .lower_bound = L->lb, .lb = -5.0f, .eps = L->c.norm_eps, .out = dout,
                              .spec_qkv = nspec ? sq : NULL, .spec_fg = nspec ? sf : NULL,
                              .spec_beta = nspec ? sb : NULL};
    /* the replay, as cuda_kda_rank_rollback launches it */
    struct cuda_kda_args ra = {.qkv = sq, .fg = sf, .beta = sb, .cols = g_cols, .conv = L->dconv, .dt_bias = L->ddtb,
                               .A = L->dA, .states = L->dst, .slot_floats = L->slot, .off = 0, .seqs = drp,
                               .n_seqs = nrp, .H = H, .D = D, .K = L->K, .lower_bound = L->lb, .lb = -5.0f,
                               .eps = L->c.norm_eps, .replay = true};
    cudaError_t e = cuda_kda_begin(L->dst, L->slot, dks, ns + pad, 0);
    float *dwork = g_chunk >= 0 ? up(NULL, (size_t)T * 3 * C * 4) : NULL;
    if (e == cudaSuccess) e = g_chunk >= 0 ? cuda_kda_chunk(&a, g_chunk, dwork, 0) : cuda_kda_recur(&a, 0);
    if (e == cudaSuccess && nrp) e = cuda_kda_recur(&ra, 0);
    if (e == cudaSuccess) e = cudaDeviceSynchronize();
    CHECKF(e == cudaSuccess, "kernels: %s", cudaGetErrorString(e));
    uint16_t *o16 = malloc((size_t)T * C * 2);
    float *gall = malloc((size_t)T * E * 4);
    cudaMemcpy(o16, dout, (size_t)T * C * 2, cudaMemcpyDeviceToHost);
    for (size_t i = 0; i < (size_t)T * C; i++) p[i] = fb(o16[i]);
    hmat(p, L->wo, T, C, E, gall);
    for (int t = 0; t < Tc; t++) memcpy(gout + (size_t)t * E, gall + (size_t)gmap[t] * E, (size_t)E * 4);
    free(qkv), free(p), free(fa), free(fg), free(gt), free(beta), free(o16), free(gall);
    cudaFree(dlo), cudaFree(do32), cudaFree(dqkv), cudaFree(dfg), cudaFree(dgt), cudaFree(dbeta), cudaFree(dks);
    cudaFree(dsn), cudaFree(dout), cudaFree(drp), cudaFree(sq), cudaFree(sf), cudaFree(sb), cudaFree(dwork);
    return Tc;
}

/* the GPU's slots against the CPU's */
static double state_err(struct lay *L)
{
    size_t n = (size_t)NSLOT * L->slot;
    float *g = malloc(n * 4);
    cudaMemcpy(g, L->dst, n * 4, cudaMemcpyDeviceToHost);
    double r = rel(g, L->cst, n);
    free(g);
    return r;
}

#define TOL_OUT 2e-2   /* bf16 output before the o projection */
#define TOL_STATE 1e-3 /* f32 state; the sums' order (f32 here, double on the CPU) moves it ~1e-6 */

static void line(bool ok, const char *what, double eo, double es)
{
    printf("  %s %s: output %.3g, states %.3g\n", ok ? "ok  " : "FAIL", what, eo, es);
    CHECK(ok);
}

static void run_case(int E, int H, int D, bool lb)
{
    struct lay L;
    char what[128];
    if (!lay_open(&L, E, H, D, lb)) return;
    int C = H * D;
    float *xs[4];
    for (int i = 0; i < 4; i++) xs[i] = rnd((size_t)MAXT * E, 1.0f, 0);
    float *go = malloc((size_t)MAXT * E * 4), *co = malloc((size_t)MAXT * E * 4);
    /* several sequences: fresh with snapshots mid-step, resumed, restored, one token; a padding entry */
    struct sq r1[4] = {
        {.slot = 0, .start = 0, .n = 37, .n_snaps = 2, .snap_pos = {5, 20}, .snap_slot = {4, 5}},
        {.slot = 1, .start = 10, .n = 9},
        {.slot = 3, .start = 8, .n = 13, .restore = true, .from = 2, .n_snaps = 1, .snap_pos = {21}, .snap_slot = {6}},
        {.slot = 7, .start = 3, .n = 1},
    };
    int T = step(&L, xs, r1, 4, 1, go, co);
    double eo = rel(go, co, (size_t)T * E), es = state_err(&L);
    snprintf(what, sizeof what, "E %d, %d heads of %d, %s: 4 sequences, restore, snapshots", E, H, D,
             lb ? "lower bound" : "softplus");
    line(eo <= TOL_OUT && es <= TOL_STATE, what, eo, es);
    /* decode: 1-token sequences over those slots and a snapshot's */
    struct sq r2[4] = {{.slot = 0, .start = 37, .n = 1}, {.slot = 3, .start = 21, .n = 1},
                       {.slot = 1, .start = 19, .n = 1, .n_snaps = 1, .snap_pos = {20}, .snap_slot = {2}},
                       {.slot = 7, .start = 5, .n = 1, .restore = true, .from = 4}};
    T = step(&L, xs, r2, 4, 2, go, co);
    eo = rel(go, co, (size_t)T * E), es = state_err(&L);
    snprintf(what, sizeof what, "E %d, %d heads of %d, %s: decode step", E, H, D, lb ? "lower bound" : "softplus");
    line(eo <= TOL_OUT && es <= TOL_STATE, what, eo, es);
    /* a prompt in one step (slot 0, one block a head) and in two (slot 1, split inside the conv window,
     * blocks of split_cols value columns, a partial last one where D allows) */
    int n = 50, cut = 2, split_cols = D > 24 ? 24 : D / 2;
    struct sq one = {.slot = 0, .start = 0, .n = n};
    g_cols = D;
    step(&L, xs + 3, &one, 1, 0, go, co);
    float *g1 = malloc((size_t)n * E * 4);
    memcpy(g1, go, (size_t)n * E * 4);
    struct sq a = {.slot = 1, .start = 0, .n = cut}, b = {.slot = 1, .start = cut, .n = n - cut};
    g_cols = split_cols;
    step(&L, xs + 3, &a, 1, 0, go, co);
    float *g2 = malloc((size_t)n * E * 4);
    memcpy(g2, go, (size_t)cut * E * 4);
    step(&L, xs + 3, &b, 1, 0, go, co);
    memcpy(g2 + (size_t)cut * E, go, (size_t)(n - cut) * E * 4);
    g_cols = 0;
    float *st = malloc(2 * L.slot * 4);
    cudaMemcpy(st, L.dst, 2 * L.slot * 4, cudaMemcpyDeviceToHost);
    bool same = !memcmp(st, st + L.slot, L.slot * 4) && !memcmp(g1, g2, (size_t)n * E * 4);
    eo = rel(g2, g1, (size_t)n * E), es = rel(st + L.slot, st, L.slot);
    snprintf(what, sizeof what,
             "E %d, %d heads of %d, %s: a prompt in 2 steps, blocks of %d columns = 1 step, 1 block, bit for bit", E,
             H, D, lb ? "lower bound" : "softplus", split_cols);
    line(same, what, eo, es);
    (void)C;
    /* drafts: a verify step and the replay of its accepted drafts (slots 0 and 1 continue the prompt, slot 2 an
     * earlier state; slot 5 a plain prefill beside them), against the CPU's walk of the accepted tokens */
    struct sq rs[4] = {
        {.slot = 0, .start = n, .n = 4, .nd = 3, .acc = 1},
        {.slot = 1, .start = n, .n = 5, .nd = 3, .acc = 3, .n_snaps = 1, .snap_pos = {n + 4}, .snap_slot = {6}},
        {.slot = 2, .start = 3, .n = 4, .nd = 3, .acc = 0},
        {.slot = 5, .start = 0, .n = 6, .n_snaps = 1, .snap_pos = {3}, .snap_slot = {7}},
    };
    size_t sbytes = (size_t)NSLOT * L.slot * 4;
    float *save = malloc(sbytes), *csave = malloc(sbytes), *s1 = malloc(sbytes), *s2 = malloc(sbytes);
    float *go1 = malloc((size_t)MAXT * E * 4);
    cudaMemcpy(save, L.dst, sbytes, cudaMemcpyDeviceToHost);
    memcpy(csave, L.cst, sbytes);
    T = step(&L, xs, rs, 4, 1, go, co);
    eo = rel(go, co, (size_t)T * E), es = state_err(&L);
    snprintf(what, sizeof what, "E %d, %d heads of %d, %s: drafts verified, the accepted ones replayed = the CPU", E,
             H, D, lb ? "lower bound" : "softplus");
    line(eo <= TOL_OUT && es <= TOL_STATE, what, eo, es);
    cudaMemcpy(s1, L.dst, sbytes, cudaMemcpyDeviceToHost);
    memcpy(go1, go, (size_t)T * E * 4);
    /* the same sequences without drafts, over their accepted tokens only, from the same states */
    cudaMemcpy(L.dst, save, sbytes, cudaMemcpyHostToDevice);
    memcpy(L.cst, csave, sbytes);
    struct sq plain[4];
    memcpy(plain, rs, sizeof rs);
    for (int i = 0; i < 4; i++) plain[i].n -= plain[i].nd - plain[i].acc, plain[i].nd = plain[i].acc = 0;
    int T2 = step(&L, xs, plain, 4, 1, go, co);
    cudaMemcpy(s2, L.dst, sbytes, cudaMemcpyDeviceToHost);
    same = T2 == T && !memcmp(s1, s2, sbytes) && !memcmp(go1, go, (size_t)T * E * 4);
    eo = rel(go1, go, (size_t)T * E), es = rel(s1, s2, (size_t)NSLOT * L.slot);
    snprintf(what, sizeof what, "E %d, %d heads of %d, %s: drafts replayed = a step of the accepted tokens, bit for bit",
             E, H, D, lb ? "lower bound" : "softplus");
    line(same, what, eo, es);
    free(save), free(csave), free(s1), free(s2), free(go1);
    free(g1), free(g2), free(st), free(go), free(co);
    for (int i = 0; i < 4; i++) free(xs[i]);
    lay_close(&L);
}

/* ---- the chunked form (cuda_kda_chunk) ---------------------------------------------- */

/* The chunked kernels against the CPU recurrence (TOL_OUT, TOL_STATE as the
 * recurrence kernel) and against the GPU recurrence on the same input
 * states: outputs to TOL_OUT (bf16 outputs: a rounding flip is 2^-8 of an
 * element), states to TOL_CHUNK_STATE. The chunked form reorders the sums
 * (within a chunk the decays are exp of differences of cumulative
 * log-gates, not products of per-token factors; the delta rule is a
 * triangular solve): on the CPU the two forms differ by ~1e-6 relative
 * (tests/test_kda.c), and f32 rounding of 64- to 128-term sums gives ~1e-6
 * more. The kernel's products run on the tensor cores in 3xTF32 (each
 * operand hi + lo in tf32, the lo x lo term dropped: ~2^-22 relative a
 * product where f32 has 2^-24, f32 accumulation), so a chunk's state
 * differs from the f32 one by a few 1e-7 of its size, and over a long
 * prompt those independent roundings add as a random walk through a
 * contraction (each token's update I - beta k k^T with |k| = 1, beta < 1,
 * the decays <= 1): ~1e-5 after hundreds of chunks, 1e-4 the bound (the
 * long cases below check it where a decay near 1 keeps every chunk's
 * rounding). */
#define TOL_CHUNK_STATE 1e-4

static float *dev_states(struct lay *L)
{
    size_t n = (size_t)NSLOT * L->slot * 4;
    float *h = malloc(n);
    cudaMemcpy(h, L->dst, n, cudaMemcpyDeviceToHost);
    return h;
}

/* The step r[0..ns) in chunks (GPU and CPU), then from the same GPU states
 * by the GPU recurrence; leaves the GPU states the chunked ones. */
static void chunk_vs(struct lay *L, float *const *xs, const struct sq *r, int ns, int pad, int chunk, const char *what)
{
    size_t n = (size_t)NSLOT * L->slot;
    float *before = dev_states(L), *go = malloc((size_t)MAXT * L->E * 4), *co = malloc((size_t)MAXT * L->E * 4);
    float *ro = malloc((size_t)MAXT * L->E * 4);
    g_chunk = chunk;
    int T = step(L, xs, r, ns, pad, go, co);
    double eo = rel(go, co, (size_t)T * L->E), es = state_err(L);
    float *after = dev_states(L);
    cudaMemcpy(L->dst, before, n * 4, cudaMemcpyHostToDevice);
    g_chunk = -1, g_gpu_only = true;
    step(L, xs, r, ns, pad, ro, co);
    g_gpu_only = false;
    float *rec = dev_states(L);
    double ero = rel(go, ro, (size_t)T * L->E), ers = rel(after, rec, n);
    cudaMemcpy(L->dst, after, n * 4, cudaMemcpyHostToDevice);
    bool ok = eo <= TOL_OUT && es <= TOL_STATE && ero <= TOL_OUT && ers <= TOL_CHUNK_STATE;
    printf("  %s %s, chunk %d: vs CPU output %.3g, states %.3g; vs GPU recurrence output %.3g, states %.3g\n",
           ok ? "ok  " : "FAIL", what, chunk, eo, es, ero, ers);
    CHECK(ok);
    free(before), free(after), free(rec), free(go), free(co), free(ro);
}

static void run_chunk_case(int E, int H, int D, bool lb, int chunk, int cols)
{
    struct lay L;
    char what[160];
    if (!lay_open(&L, E, H, D, lb)) return;
    float *xs[4];
    for (int i = 0; i < 4; i++) xs[i] = rnd((size_t)MAXT * E, 1.0f, 0);
    g_cols = cols;
    snprintf(what, sizeof what, "E %d, %d heads of %d, %s%s, cols %d", E, H, D, lb ? "lower bound" : "softplus",
             g_dshift ? ", decays near 0 and 1" : "", cols);
    /* several sequences: fresh and long (over two chunks) with snapshots off and on the grid, resumed off the
     * grid (random state and tail), restored, one token; padding entries */
    struct sq r1[4] = {
        {.slot = 0, .start = 0, .n = 100, .n_snaps = 3, .snap_pos = {5, 64, 70}, .snap_slot = {4, 5, 2}},
        {.slot = 1, .start = 10, .n = 30},
        {.slot = 3, .start = 8, .n = 13, .restore = true, .from = 6, .n_snaps = 1, .snap_pos = {21}, .snap_slot = {7}},
        {.slot = 6, .start = 3, .n = 1},
    };
    char w1[200];
    snprintf(w1, sizeof w1, "%s: 4 sequences, restore, snapshots", what);
    chunk_vs(&L, xs, r1, 4, 2, chunk, w1);
    /* a mixed step: a prefill beside 1-token sequences (the chunked kernel takes the step whole) */
    struct sq r2[3] = {
        {.slot = 0, .start = 100, .n = 1}, {.slot = 1, .start = 40, .n = 57}, {.slot = 4, .start = 5, .n = 1}};
    snprintf(w1, sizeof w1, "%s: a prefill beside 1-token sequences", what);
    chunk_vs(&L, xs, r2, 3, 0, chunk, w1);
    /* a prompt of 150 in one step (slot 0) and in two (slot 1): split at 64, on the grid of chunk 16 / 32 / 64,
     * the same bits; split at 50, within f32 rounding */
    int n = 150, Lc = chunk ? chunk : cuda_kda_chunk_len(D, cols);
    CHECKF(Lc >= 1, "no chunk length fits at head_dim %d, %d columns", D, cols);
    if (Lc < 1) Lc = 1;
    g_chunk = chunk;
    struct sq one = {.slot = 0, .start = 0, .n = n};
    float *go = malloc((size_t)MAXT * E * 4), *co = malloc((size_t)MAXT * E * 4), *g1 = malloc((size_t)n * E * 4);
    float *g2 = malloc((size_t)n * E * 4), *st = malloc(2 * L.slot * 4);
    step(&L, xs + 3, &one, 1, 0, go, co);
    memcpy(g1, go, (size_t)n * E * 4);
    int cuts[2] = {64 / Lc * Lc, 50};
    for (int k = 0; k < 2; k++) {
        int cut = cuts[k] ? cuts[k] : Lc;
        struct sq a = {.slot = 1, .start = 0, .n = cut}, b = {.slot = 1, .start = cut, .n = n - cut};
        step(&L, xs + 3, &a, 1, 0, go, co);
        memcpy(g2, go, (size_t)cut * E * 4);
        step(&L, xs + 3, &b, 1, 0, go, co);
        memcpy(g2 + (size_t)cut * E, go, (size_t)(n - cut) * E * 4);
        cudaMemcpy(st, L.dst, 2 * L.slot * 4, cudaMemcpyDeviceToHost);
        bool grid = cut % Lc == 0, same = !memcmp(st, st + L.slot, L.slot * 4) && !memcmp(g1, g2, (size_t)n * E * 4);
        double eo = rel(g2, g1, (size_t)n * E), es = rel(st + L.slot, st, L.slot);
        bool ok = grid ? same : eo <= TOL_OUT && es <= TOL_CHUNK_STATE;
        printf("  %s %s, chunk %d: a prompt split at %d%s = one step%s: output %.3g, state %.3g\n",
               ok ? "ok  " : "FAIL", what, chunk, cut, grid ? " (on the grid)" : "", grid ? ", bit for bit" : "", eo,
               es);
        CHECK(ok);
    }
    g_chunk = -1, g_cols = 0;
    free(go), free(co), free(g1), free(g2), free(st);
    for (int i = 0; i < 4; i++) free(xs[i]);
    lay_close(&L);
}

/* A long prompt, ntok tokens in steps of LONG_STEP (the slot carries S from
 * step to step as the chunks do inside one), in chunks of `chunk`: several
 * hundred chunks at small head dims, where the tensor cores' rounding would
 * pile up. On the GPU by the chunked kernels (slot 0, with the CPU's
 * recurrence beside it) and by the recurrence (slot 1): each step's outputs
 * against the CPU's at TOL_OUT, the final states (S and the conv tail)
 * against the CPU's and against the GPU recurrence's at TOL_CHUNK_STATE. */
#define LONG_STEP 128
static void run_chunk_long(int E, int H, int D, bool lb, int chunk, int ntok)
{
    struct lay L;
    if (!lay_open(&L, E, H, D, lb)) return;
    float *x = rnd((size_t)ntok * E, 1.0f, 0), *go = malloc((size_t)MAXT * E * 4), *co = malloc((size_t)MAXT * E * 4);
    float *xs[1] = {x};
    int Lc = chunk ? chunk : cuda_kda_chunk_len(D, 0);
    double eo = 0, ero = 0;
    float *ro = malloc((size_t)MAXT * E * 4);
    for (int t0 = 0; t0 < ntok; t0 += LONG_STEP) {
        int n = ntok - t0 < LONG_STEP ? ntok - t0 : LONG_STEP;
        struct sq c = {.slot = 0, .start = t0, .n = n}, r = {.slot = 1, .start = t0, .n = n};
        g_chunk = chunk;
        int T = step(&L, xs, &c, 1, 0, go, co);
        double e = rel(go, co, (size_t)T * E);
        if (!(e <= eo)) eo = e; /* NaN too */
        g_chunk = -1, g_gpu_only = true;
        step(&L, xs, &r, 1, 0, ro, co);
        g_gpu_only = false;
        e = rel(go, ro, (size_t)T * E);
        if (!(e <= ero)) ero = e;
    }
    float *g = dev_states(&L);
    double es = rel(g, L.cst, L.slot), ers = rel(g, g + L.slot, L.slot);
    bool ok = eo <= TOL_OUT && es <= TOL_CHUNK_STATE && ero <= TOL_OUT && ers <= TOL_CHUNK_STATE;
    printf("  %s E %d, %d heads of %d, %s%s: a %d-token prompt in %d chunks of %d: vs CPU output %.3g, state %.3g; "
           "vs GPU recurrence output %.3g, state %.3g\n",
           ok ? "ok  " : "FAIL", E, H, D, lb ? "lower bound" : "softplus", g_dshift ? ", decays near 0 and 1" : "",
           ntok, (ntok + Lc - 1) / Lc, Lc, eo, es, ero, ers);
    CHECK(ok);
    free(g), free(x), free(go), free(co), free(ro);
    lay_close(&L);
}

static void test_kda_chunk(void)
{
    CHECK(cuda_kda_prepare() == cudaSuccess && cuda_kda_chunk_prepare() == cudaSuccess);
    int L128 = cuda_kda_chunk_len(128, 0);
    printf("  default chunk at head_dim 128: %d tokens\n", L128);
    CHECK(L128 >= 32);
    run_chunk_case(64, 4, 16, true, 0, 0);
    run_chunk_case(64, 4, 16, false, 16, 0);
    run_chunk_case(64, 4, 16, true, 5, 8);
    run_chunk_case(64, 4, 16, true, 1, 0);
    run_chunk_case(96, 3, 32, true, 32, 24);
    run_chunk_case(256, 2, 128, true, 0, 0);
    run_chunk_case(256, 2, 128, false, 64, 32);
    run_chunk_case(256, 2, 128, true, 16, 64);
    run_chunk_case(256, 2, 128, false, 64, 64); /* what the mixer takes at 64 heads on an H100 */
    run_chunk_case(256, 2, 128, true, 32, 128);
    g_dshift = 30.0f;
    run_chunk_case(64, 4, 16, true, 64, 0);
    run_chunk_case(64, 4, 16, false, 64, 0);
    run_chunk_case(256, 2, 128, false, 0, 0);
    run_chunk_long(64, 4, 16, true, 8, 2048);     /* 256 chunks */
    run_chunk_long(64, 4, 16, false, 16, 4096);   /* 256 chunks */
    run_chunk_long(256, 2, 128, false, 0, 2048);  /* the default chunk, 32 of 64 on an H100 */
    g_dshift = 0;
    run_chunk_long(64, 4, 16, true, 8, 2048);
    run_chunk_long(256, 2, 128, true, 0, 2048);
    /* a shape it cannot take is refused, not launched */
    struct cuda_kda_args bad = {.n_seqs = 1, .D = 256, .K = 4, .o32 = (float *)16};
    float *w = (float *)16;
    CHECK(cuda_kda_chunk(&bad, 0, w, 0) == cudaErrorInvalidValue);
    bad.D = 128, bad.K = 4;
    CHECK(cuda_kda_chunk(&bad, CUDA_KDA_CHUNK_MAX + 1, w, 0) == cudaErrorInvalidValue);
    CHECK(cuda_kda_chunk(&bad, 0, NULL, 0) == cudaErrorInvalidValue);
}

/* cuda_kda_xsplit after cuda_add_rmsnorm: the first T rows xn itself, and
 * xn + the low part the f32 norm to ~2^-17 (xn alone: ~2^-9). */
static void test_xsplit(void)
{
    int T = 5, E = 1000;
    float eps = 1e-5f, *x = rnd((size_t)T * E, 1.0f, 0.3f), *w = rnd((size_t)E, 0.5f, 1.0f);
    float *dx = up(x, (size_t)T * E * 4), *dw = up(w, (size_t)E * 4);
    uint16_t *dxn = up(NULL, (size_t)T * E * 2), *dhl = up(NULL, (size_t)2 * T * E * 2);
    cudaError_t e = cuda_add_rmsnorm(dx, NULL, dw, NULL, T, E, eps, dxn, 0);
    if (e == cudaSuccess) e = cuda_kda_xsplit(dx, dw, dxn, T, E, eps, dhl, 0);
    if (e == cudaSuccess) e = cudaDeviceSynchronize();
    CHECKF(e == cudaSuccess, "kernels: %s", cudaGetErrorString(e));
    uint16_t *xn = malloc((size_t)T * E * 2), *hl = malloc((size_t)2 * T * E * 2);
    cudaMemcpy(xn, dxn, (size_t)T * E * 2, cudaMemcpyDeviceToHost);
    cudaMemcpy(hl, dhl, (size_t)2 * T * E * 2, cudaMemcpyDeviceToHost);
    float *y = malloc((size_t)T * E * 4), *hi = malloc((size_t)T * E * 4), *sum = malloc((size_t)T * E * 4);
    for (int t = 0; t < T; t++) {
        double ss = 0;
        for (int i = 0; i < E; i++) ss += (double)x[(size_t)t * E + i] * x[(size_t)t * E + i];
        double r = 1.0 / sqrt(ss / E + eps);
        for (int i = 0; i < E; i++) {
            size_t j = (size_t)t * E + i;
            y[j] = (float)(w[i] * (x[j] * r));
            hi[j] = fb(hl[j]), sum[j] = fb(hl[j]) + fb(hl[(size_t)T * E + j]);
        }
    }
    double eh = rel(hi, y, (size_t)T * E), es = rel(sum, y, (size_t)T * E);
    bool same = !memcmp(xn, hl, (size_t)T * E * 2);
    printf("  %s xsplit: hi = xn %s; hi vs the f32 norm %.3g, hi + lo %.3g\n", same && es <= 3e-5 ? "ok  " : "FAIL",
           same ? "bit for bit" : "DIFFERS", eh, es);
    CHECK(same && es <= 3e-5);
    free(x), free(w), free(xn), free(hl), free(y), free(hi), free(sum);
    cudaFree(dx), cudaFree(dw), cudaFree(dxn), cudaFree(dhl);
}

static void test_kda(void)
{
    CHECK(cuda_kda_prepare() == cudaSuccess);
    run_case(64, 4, 16, true);
    run_case(64, 4, 16, false);
    run_case(96, 3, 32, true);
    run_case(256, 2, 128, true);
    run_case(256, 2, 128, false);
}

/* cuda_kda_pack into a host buffer laid out as the backend lays it */
static void test_pack(void)
{
    struct cuda_backend b;
    memset(&b, 0, sizeof b);
    uint8_t buf[4096];
    b.hin = buf, b.max_seqs = 4;
    b.lay.kda_seqs = 0, b.lay.kda_snaps = 1024, b.lay.max_kda_snaps = 3;
    int32_t sp0[2] = {5, 9}, ss0[2] = {6, 7}, sp1[1] = {12}, ss1[1] = {2}, bt[1] = {0};
    struct step_seq sq[3] = {
        {.query_start = 0, .query_len = 10, .context_len = 10, .block_table = bt, .state_slot = 1, .n_snaps = 2,
         .snap_pos = sp0, .snap_slot = ss0},
        {.query_start = 10, .query_len = 4, .context_len = 12, .block_table = bt, .state_slot = 3,
         .state_restore = true, .state_from = 5, .n_snaps = 1, .snap_pos = sp1, .snap_slot = ss1},
        {.query_start = 14, .query_len = 1, .context_len = 30, .block_table = bt, .state_slot = 0},
    };
    struct step s = {.n_tokens = 15, .n_seqs = 3, .seqs = sq};
    memset(buf, 0x5a, sizeof buf);
    CHECK(cuda_kda_pack(&b, &s, 15));
    const struct cuda_kda_seq *q = (const struct cuda_kda_seq *)buf;
    const struct cuda_kda_snap *n = (const struct cuda_kda_snap *)(buf + 1024);
    CHECK(q[0].t0 == 0 && q[0].n == 10 && q[0].p0 == 0 && q[0].slot == 1 && q[0].mode == CUDA_KDA_ZERO &&
          q[0].snap0 == 0 && q[0].n_snaps == 2);
    CHECK(q[1].t0 == 10 && q[1].n == 4 && q[1].p0 == 8 && q[1].slot == 3 && q[1].mode == CUDA_KDA_RESTORE &&
          q[1].from == 5 && q[1].snap0 == 2 && q[1].n_snaps == 1);
    CHECK(q[2].t0 == 14 && q[2].n == 1 && q[2].p0 == 29 && q[2].slot == 0 && q[2].mode == CUDA_KDA_CONTINUE &&
          q[2].n_snaps == 0);
    CHECK(q[3].n == 0); /* a prefill step launches max_seqs entries: the rest are padding */
    CHECK(n[0].pos == 5 && n[0].slot == 6 && n[1].pos == 9 && n[1].slot == 7 && n[2].pos == 12 && n[2].slot == 2);
    /* a decode step padded to a graph of 4: every entry past the sequences is padding */
    struct step_seq d[2] = {{.query_start = 0, .query_len = 1, .context_len = 1, .block_table = bt, .state_slot = 2},
                            {.query_start = 1, .query_len = 1, .context_len = 7, .block_table = bt, .state_slot = 1}};
    struct step ds = {.n_tokens = 2, .n_seqs = 2, .seqs = d};
    memset(buf, 0x5a, sizeof buf);
    CHECK(cuda_kda_pack(&b, &ds, 4));
    CHECK(q[0].mode == CUDA_KDA_ZERO && q[0].p0 == 0 && q[1].mode == CUDA_KDA_CONTINUE && q[1].p0 == 6);
    CHECK(q[2].n == 0 && q[3].n == 0);
    /* more snapshots than the buffer holds: refused (the step does not fit) */
    b.lay.max_kda_snaps = 2;
    CHECK(!cuda_kda_pack(&b, &s, 15));
    /* a verify step: the drafts of each sequence that has some, their replay rows in sequence order */
    b.lay.max_kda_snaps = 3, b.max_draft = 3;
    struct step_seq v[3] = {
        {.query_start = 0, .query_len = 4, .context_len = 20, .block_table = bt, .state_slot = 2, .want_sample = true,
         .n_draft = 3},
        {.query_start = 4, .query_len = 6, .context_len = 6, .block_table = bt, .state_slot = 0},
        {.query_start = 10, .query_len = 3, .context_len = 9, .block_table = bt, .state_slot = 1, .want_sample = true,
         .n_draft = 2},
    };
    struct step vs = {.n_tokens = 13, .n_seqs = 3, .seqs = v};
    memset(buf, 0x5a, sizeof buf);
    CHECK(cuda_kda_pack(&b, &vs, 13));
    CHECK(q[0].n == 4 && q[0].nd == 3 && q[0].spec0 == 0 && q[0].p0 == 16 && q[0].mode == CUDA_KDA_CONTINUE);
    CHECK(q[1].n == 6 && q[1].nd == 0 && q[1].mode == CUDA_KDA_ZERO);
    CHECK(q[2].n == 3 && q[2].nd == 2 && q[2].spec0 == 3 && q[2].p0 == 6);
    CHECK(q[3].n == 0 && q[3].nd == 0);
    /* more drafts than the replay scratch holds (max_seqs x max_draft): refused */
    b.max_draft = 1;
    CHECK(!cuda_kda_pack(&b, &vs, 13));
}

/* ---- the tensor-core fragments (kda_chunk.h), on the host ------------------------- */

/* f32 -> tf32 as cvt.rna.tf32.f32: 10 mantissa bits, to nearest, ties away from zero (finite x) */
static float tf32(float x)
{
    uint32_t u;
    memcpy(&u, &x, 4);
    u = (u + 0x1000u) & ~0x1fffu;
    memcpy(&x, &u, 4);
    return x;
}

/* One warp's mma.m16n8k8 .tf32 as the PTX ISA's tables define it (groupID = lane >> 2, threadID_in_group =
 * lane % 4): A's a0..a3 rows groupID (a0, a2), groupID + 8 (a1, a3), columns threadID_in_group (a0, a1), + 4
 * (a2, a3); B's b0, b1 rows threadID_in_group, + 4, column groupID; C's c0..c3 rows groupID (c0, c1),
 * groupID + 8 (c2, c3), columns threadID_in_group * 2 + (i & 1). d += a b, the tf32 products exact. */
static void ptx_mma(float d[32][4], float a[32][4], float b[32][2])
{
    float A[16][8], B[8][8];
    for (int l = 0; l < 32; l++) {
        int gid = l >> 2, tig = l % 4;
        for (int i = 0; i < 4; i++) A[gid + (i == 1 || i == 3 ? 8 : 0)][tig + (i >= 2 ? 4 : 0)] = a[l][i];
        for (int i = 0; i < 2; i++) B[tig + (i ? 4 : 0)][gid] = b[l][i];
    }
    for (int l = 0; l < 32; l++) {
        int gid = l >> 2, tig = l % 4;
        for (int i = 0; i < 4; i++) {
            int r = gid + (i >= 2 ? 8 : 0), c = tig * 2 + (i & 1);
            double x = d[l][i];
            for (int k = 0; k < 8; k++) x += (double)A[r][k] * B[k][c];
            d[l][i] = (float)x;
        }
    }
}

/* C = A B ([M][K] x [K][N], row-major) as kda_chunk.cu's kc_mma_block makes it, a warp a 16 x 8 tile, its
 * fragments loaded and stored by cuda_kda_frag_*: 3xTF32 (split: lo hi and hi lo in accumulators of their
 * own, added to hi hi's at the end) or one tf32 product; tri: A(m, k) taken as 0 for k > m */
static void frag_gemm(const float *A, const float *B, float *C, int M, int N, int K, bool split, bool tri)
{
    for (int m0 = 0; m0 < M; m0 += 16)
        for (int n0 = 0; n0 < N; n0 += 8) {
            float acc[32][4] = {{0}}, s1[32][4] = {{0}}, s2[32][4] = {{0}};
            for (int k0 = 0; k0 < K; k0 += 8) {
                float ah[32][4], al[32][4], bh[32][2], bl[32][2];
                for (int l = 0; l < 32; l++) {
                    for (int i = 0; i < 4; i++) {
                        int m = m0 + cuda_kda_frag_arow(l, i), k = k0 + cuda_kda_frag_acol(l, i);
                        float x = m < M && k < K && !(tri && k > m) ? A[(size_t)m * K + k] : 0.0f;
                        ah[l][i] = tf32(x), al[l][i] = tf32(x - ah[l][i]);
                    }
                    for (int i = 0; i < 2; i++) {
                        int k = k0 + cuda_kda_frag_brow(l, i), n = n0 + cuda_kda_frag_bcol(l);
                        float x = k < K && n < N ? B[(size_t)k * N + n] : 0.0f;
                        bh[l][i] = tf32(x), bl[l][i] = tf32(x - bh[l][i]);
                    }
                }
                if (split) ptx_mma(s1, al, bh), ptx_mma(s2, ah, bl);
                ptx_mma(acc, ah, bh);
            }
            for (int l = 0; l < 32; l++)
                for (int i = 0; i < 4; i++) {
                    int m = m0 + cuda_kda_frag_crow(l, i), n = n0 + cuda_kda_frag_ccol(l, i);
                    if (m < M && n < N) C[(size_t)m * N + n] = acc[l][i] + (s1[l][i] + s2[l][i]);
                }
        }
}

/* The kernel's fragment map through an emulated warp against double products, at shapes with partial tiles
 * on every side: 3xTF32 near f32 rounding (~1e-7 of the largest element), one tf32 product ~1e-4 (so the
 * low parts are used), the lower-triangular form (P u) likewise. A map off the PTX tables is O(1) off. */
static void test_frag(void)
{
    int M = 50, N = 36, K = 100;
    float *A = rnd((size_t)M * K, 0.2f, 0), *B = rnd((size_t)K * N, 1.0f, 0);
    for (size_t i = 0; i < (size_t)M * K; i++) A[i] += 1e-3f * frand(); /* beyond tf32: the low parts count */
    for (size_t i = 0; i < (size_t)K * N; i++) B[i] += 1e-3f * frand();
    float *C = malloc((size_t)M * N * 4), *R = malloc((size_t)M * N * 4);
    double e[3];
    for (int v = 0; v < 3; v++) {
        bool split = v != 1, tri = v == 2;
        for (int m = 0; m < M; m++)
            for (int n = 0; n < N; n++) {
                double x = 0;
                for (int k = 0; k < K && !(tri && k > m); k++) x += (double)A[(size_t)m * K + k] * B[(size_t)k * N + n];
                R[(size_t)m * N + n] = (float)x;
            }
        frag_gemm(A, B, C, M, N, K, split, tri);
        e[v] = rel(C, R, (size_t)M * N);
    }
    bool ok = e[0] <= 1e-6 && e[2] <= 1e-6 && e[1] >= 1e-5 && e[1] <= 1e-2;
    printf("  %s fragments: [%d x %d] x [%d x %d] through the emulated warp vs double: 3xTF32 %.3g, "
           "lower-triangular %.3g; one tf32 product %.3g\n",
           ok ? "ok  " : "FAIL", M, K, K, N, e[0], e[2], e[1]);
    CHECK(ok);
    free(A), free(B), free(C), free(R);
}

int main(void)
{
    RUN(test_pack);
    RUN(test_frag);
    int n = 0;
    if (cudaGetDeviceCount(&n) != cudaSuccess || n == 0) {
        printf("no GPU: the kernels skipped\n");
        return test_summary();
    }
    RUN(test_xsplit);
    RUN(test_kda);
    RUN(test_kda_chunk);
    return test_summary();
}

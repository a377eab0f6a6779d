/* test_moe.c - the MoE FFN's kernels (cuda/moe.cu) against the CPU
 * reference on random data (make gpu-test; needs a GPU).
 *
 * Each case is a random MoE layer (router, correction bias, experts, shared
 * experts) and T random bf16 tokens, run through cuda_moe_forward:
 *  - the router's logits against a double-precision dot product (|err| <=
 *    1e-5 of sum |w x|);
 *  - the routing against model_moe_route (model/moe.c, the CPU backend's
 *    router) fed the GPU's own logits: the same experts, in the same order,
 *    weights within 1e-5 (some cases duplicate router rows, so exact ties
 *    must go to the lower expert, as on the CPU);
 *  - the block's output against a double-precision reference that takes the
 *    GPU's routing (each expert's SwiGLU output rounded to bf16, as the
 *    kernel stores it): max error relative to max |ref| within 1e-2;
 *  - batch invariance: three tokens run alone give the bits they got in the
 *    batch;
 *  - the whole layer captured in a CUDA graph gives the eager run's bits.
 * One case has over 8192 token slots, so its batch takes the grouping's
 * multi-block path and the tokens alone the one-block one. A step of at
 * most CUDA_MOE_SMALL_SLOTS token slots (cuda_moe_forward's fused routing
 * + grouping and down + combine) must give the general stages' bits (run
 * one by one on the same inputs); a larger one must be refused by the
 * fused entries; cases sit at the bound and either side of it.
 * Cases: softmax top-k with and without renormalisation, the sigmoid router
 * with correction bias, scaling and group-limited choice, shared experts
 * (plain and qwen2_moe's gated one), an f32 router, the clamped SwiGLU, odd
 * widths (partial tiles), packed experts mixed with bf16 ones (int4 and
 * int8, groups and per-channel, zero points, f16 scales, act-order), and
 * experts all in one packed format (gate and up decoded in one pass), the
 * reference dequantizing with model_qrepack_row.
 */
#include <cuda_runtime.h>
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "cuda/moe.h"
#include "model/backend.h"
#include "model/moe.h"
#include "tests/gpu/gpu_util.h"
#include "tests/test.h"

static uint32_t urand(void)
{
    g_rng ^= g_rng << 13, g_rng ^= g_rng >> 7, g_rng ^= g_rng << 17;
    return (uint32_t)(g_rng >> 32);
}


/* ---- expert matrices ---------------------------------------------------------------- */

/* formats: 0 bf16; 1 int4 g32 sym bf16 scales; 2 int8 per-channel asym; 3 int4 g16 asym f16 scales;
 * 4 int4 g32 act-order asym (the kernels' element-by-element path); 5 int4 g128 sym bf16 scales (GPTQ /
 * compressed-tensors W4A16's usual one); 6 int8 g32 sym f16 scales */
#define NFMT 5 /* the formats a case's experts cycle through */

/* A random packed weight in the device layout (as test_qgemm.c makes them). */
static void make_packed(int fmt, int rows, int cols, struct model_qrepack *p)
{
    int bits = fmt == 2 || fmt == 6 ? 8 : 4, group = fmt == 2 ? 0 : fmt == 3 ? 16 : fmt == 5 ? 128 : 32;
    bool asym = fmt >= 2 && fmt <= 4, f16 = fmt == 3 || fmt == 6, act = fmt == 4;
    memset(p, 0, sizeof *p);
    p->bits = bits, p->rows = rows, p->cols = cols;
    p->group = group ? group : cols;
    p->n_groups = (cols + p->group - 1) / p->group;
    p->row_bytes = ((int64_t)(cols * bits + 7) / 8 + 15) / 16 * 16;
    p->f16 = f16;
    size_t ng = (size_t)rows * p->n_groups;
    p->qw = calloc((size_t)(rows * p->row_bytes), 1);
    p->scales = malloc(ng * 2);
    for (int r = 0; r < rows; r++)
        for (int k = 0; k < cols; k++) {
            uint32_t u = urand() & ((1u << bits) - 1);
            uint8_t *row = p->qw + (size_t)r * p->row_bytes;
            if (bits == 8) {
                row[k] = (uint8_t)u;
            } else {
                int nib = k % 8 / 2 + 4 * (k % 2); /* the device layout's nibble of column k (model.h) */
                row[k / 8 * 4 + nib / 2] |= (uint8_t)(u << (4 * (nib % 2)));
            }
        }
    /* scales 2^-6 .. 2^-3 with random mantissas and signs, as raw bits */
    for (size_t i = 0; i < ng; i++) {
        uint32_t e = 9 + urand() % 4, s = urand() & 1;
        p->scales[i] = f16 ? (uint16_t)(s << 15 | e << 10 | (urand() & 0x3FF))
                           : (uint16_t)(s << 15 | (e + 112) << 7 | (urand() & 0x7F));
    }
    if (asym) {
        p->zeros = malloc(ng);
        for (size_t i = 0; i < ng; i++) p->zeros[i] = (uint8_t)(urand() & ((1u << bits) - 1));
    }
    if (act) {
        p->perm = malloc((size_t)cols * 4);
        for (int k = 0; k < cols; k++) p->perm[k] = k;
        for (int k = cols - 1; k > 0; k--) {
            int j = (int)(urand() % (uint32_t)(k + 1)), t = p->perm[k];
            p->perm[k] = p->perm[j], p->perm[j] = t;
        }
    }
}

static void **g_dev; /* every device allocation of a case, freed after it */
static int g_ndev;
static void *keep(void *d)
{
    g_dev = realloc(g_dev, (size_t)(g_ndev + 1) * sizeof *g_dev);
    g_dev[g_ndev++] = d;
    return d;
}
static void free_dev(void)
{
    for (int i = 0; i < g_ndev; i++) cudaFree(g_dev[i]);
    g_ndev = 0;
}

/* A random [rows][cols] matrix in format fmt: its reference values (f32,
 * [rows][cols]) into ref, its device form into m. */
static void make_mat(int fmt, int rows, int cols, float *ref, struct cuda_moe_mat *m)
{
    memset(m, 0, sizeof *m);
    if (fmt == 0) {
        uint16_t *h = malloc((size_t)rows * cols * 2);
        for (int i = 0; i < rows * cols; i++) h[i] = bf(frand() * 0.5f), ref[i] = fb(h[i]);
        m->w = keep(dup_dev(h, (size_t)rows * cols * 2));
        free(h);
        return;
    }
    struct model_qrepack p;
    make_packed(fmt, rows, cols, &p);
    for (int r = 0; r < rows; r++) model_qrepack_row(&p, r, ref + (size_t)r * cols);
    size_t ng = (size_t)rows * p.n_groups;
    m->qw = keep(dup_dev(p.qw, (size_t)(rows * p.row_bytes)));
    m->scales = keep(dup_dev(p.scales, ng * 2));
    if (p.zeros) m->zeros = keep(dup_dev(p.zeros, ng));
    if (p.perm) {
        int32_t *ip = malloc((size_t)cols * 4);
        for (int k = 0; k < cols; k++) ip[p.perm[k]] = k;
        m->iperm = keep(dup_dev(ip, (size_t)cols * 4));
        free(ip);
    }
    m->bits = p.bits, m->group = p.group, m->n_groups = p.n_groups, m->row_bytes = (int)p.row_bytes;
    m->f16 = p.f16;
    model_qrepack_free(&p);
}

/* ---- the cases ---------------------------------------------------------------------- */

struct mcase {
    const char *name;
    int NE, K, E, F, Fs, T;   /* Fs: the shared experts' width (0: none) */
    bool sigmoid, norm, gated, router_f32, bias, dup;
    int G, TG;
    float scale, limit;
    bool packed;              /* experts cycle through the NFMT formats */
    int fmt[3];               /* else every expert's gate, up and down in these formats (0: bf16) */
};

static double dmax(double a, double b) { return a > b ? a : b; }

static void run_case(const struct mcase *c)
{
    const int NE = c->NE, K = c->K, E = c->E, T = c->T, S = K + (c->Fs > 0), R = NE + (c->gated ? 1 : 0);
    const int Fmax = c->F > c->Fs ? c->F : c->Fs;
    /* router: [R][E], some rows duplicated (exact ties) */
    float *rw = malloc((size_t)R * E * 4), *bias = malloc((size_t)NE * 4);
    uint16_t *rwb = malloc((size_t)R * E * 2);
    for (int i = 0; i < R * E; i++) {
        rw[i] = frand() * (c->sigmoid ? 0.1f : 0.3f);
        if (!c->router_f32) rwb[i] = bf(rw[i]), rw[i] = fb(rwb[i]);
    }
    if (c->dup)
        for (int e = 1; e < NE; e += 5) memcpy(rw + (size_t)e * E, rw + (size_t)(e - 1) * E, (size_t)E * 4),
                                        memcpy(rwb + (size_t)e * E, rwb + (size_t)(e - 1) * E, (size_t)E * 2);
    for (int e = 0; e < NE; e++) bias[e] = frand() * 0.05f;
    /* experts: NE routed + the shared ones */
    struct cuda_moe_expert *hex = calloc((size_t)NE + 1, sizeof *hex);
    float **rg = calloc((size_t)NE + 1, sizeof *rg), **ru = calloc((size_t)NE + 1, sizeof *ru),
          **rd = calloc((size_t)NE + 1, sizeof *rd);
    for (int e = 0; e <= NE; e++) {
        int F = e < NE ? c->F : c->Fs;
        if (!F) continue;
        rg[e] = malloc((size_t)F * E * 4), ru[e] = malloc((size_t)F * E * 4), rd[e] = malloc((size_t)E * F * 4);
        hex[e].F = F;
        make_mat(c->packed ? e % NFMT : c->fmt[0], F, E, rg[e], &hex[e].gate);
        make_mat(c->packed ? (e + 1) % NFMT : c->fmt[1], F, E, ru[e], &hex[e].up);
        make_mat(c->packed ? (e + 2) % NFMT : c->fmt[2], E, F, rd[e], &hex[e].down);
    }
    uint16_t *x = malloc((size_t)T * E * 2);
    for (int i = 0; i < T * E; i++) x[i] = bf(frand());

    struct cuda_moe_args a = {
        .T = T, .E = E, .NE = NE, .K = K, .S = S, .Fmax = Fmax, .sigmoid = c->sigmoid, .norm_topk = c->norm,
        .n_group = c->G, .topk_group = c->TG, .shared_gated = c->gated, .scale = c->scale,
        .swiglu_limit = c->limit, .router_f32 = c->router_f32,
    };
    a.xn = keep(dup_dev(x, (size_t)T * E * 2));
    a.router = keep(c->router_f32 ? dup_dev(rw, (size_t)R * E * 4) : dup_dev(rwb, (size_t)R * E * 2));
    a.bias = c->bias ? keep(dup_dev(bias, (size_t)NE * 4)) : NULL;
    a.ex = keep(dup_dev(hex, ((size_t)NE + 1) * sizeof *hex));
    a.logits = keep(zeroed((size_t)T * (NE + 1) * 4));
    a.idx = keep(zeroed((size_t)T * S * 4));
    a.wt = keep(zeroed((size_t)T * S * 4));
    a.count = keep(zeroed((size_t)(NE + 1) * 4));
    a.start = keep(zeroed((size_t)(NE + 2) * 4));
    a.list = keep(zeroed((size_t)T * S * 4));
    a.act = keep(zeroed((size_t)(NE + 2) * 4));
    a.h = keep(zeroed((size_t)T * S * Fmax * 2));
    a.y = keep(zeroed((size_t)T * S * E * 4));
    a.out = keep(zeroed((size_t)T * E * 2));
    cudaStream_t st;
    cudaStreamCreate(&st);
    cudaError_t ce = cuda_moe_forward(&a, st);
    CHECKF(ce == cudaSuccess, "%s: launch: %s", c->name, cudaGetErrorString(ce));
    ce = cudaStreamSynchronize(st);
    CHECKF(ce == cudaSuccess, "%s: run: %s", c->name, cudaGetErrorString(ce));
    float *lg = malloc((size_t)T * (NE + 1) * 4), *wt = malloc((size_t)T * S * 4);
    int32_t *idx = malloc((size_t)T * S * 4);
    uint16_t *out = malloc((size_t)T * E * 2), *out1 = malloc((size_t)E * 2), *outg = malloc((size_t)T * E * 2);
    cudaMemcpy(lg, a.logits, (size_t)T * (NE + 1) * 4, cudaMemcpyDeviceToHost);
    cudaMemcpy(wt, a.wt, (size_t)T * S * 4, cudaMemcpyDeviceToHost);
    cudaMemcpy(idx, a.idx, (size_t)T * S * 4, cudaMemcpyDeviceToHost);
    cudaMemcpy(out, a.out, (size_t)T * E * 2, cudaMemcpyDeviceToHost);

    /* the other path: a small step (cuda_moe_forward's fused kernels) against the general stages run
     * one by one (the same bits: routing, weights, output); a larger one: the fused entries refuse it */
    const bool small = cuda_moe_small(&a);
    int path_diff = 0;
    if (small) {
        struct cuda_moe_args ap = a;
        ap.out = keep(zeroed((size_t)T * E * 2));
        ce = cuda_moe_route(&ap, st);
        if (ce == cudaSuccess) ce = cuda_moe_group(&ap, st);
        if (ce == cudaSuccess) ce = cuda_moe_experts(&ap, st);
        if (ce == cudaSuccess) ce = cuda_moe_combine(&ap, st);
        if (ce == cudaSuccess) ce = cudaStreamSynchronize(st);
        CHECKF(ce == cudaSuccess, "%s: the general path: %s", c->name, cudaGetErrorString(ce));
        float *wt2 = malloc((size_t)T * S * 4);
        int32_t *idx2 = malloc((size_t)T * S * 4);
        uint16_t *out2 = malloc((size_t)T * E * 2);
        cudaMemcpy(wt2, ap.wt, (size_t)T * S * 4, cudaMemcpyDeviceToHost);
        cudaMemcpy(idx2, ap.idx, (size_t)T * S * 4, cudaMemcpyDeviceToHost);
        cudaMemcpy(out2, ap.out, (size_t)T * E * 2, cudaMemcpyDeviceToHost);
        path_diff = (memcmp(wt2, wt, (size_t)T * S * 4) != 0) + (memcmp(idx2, idx, (size_t)T * S * 4) != 0) +
                    (memcmp(out2, out, (size_t)T * E * 2) != 0);
        free(wt2), free(idx2), free(out2);
    } else {
        path_diff = (cuda_moe_route_group(&a, st) != cudaErrorInvalidValue) +
                    (cuda_moe_down_combine(&a, st) != cudaErrorInvalidValue);
    }
    /* logits */
    double lerr = 0;
    for (int t = 0; t < T; t++)
        for (int e = 0; e < R; e++) {
            double s = 0, m = 0;
            for (int k = 0; k < E; k++) {
                double p = (double)rw[(size_t)e * E + k] * fb(x[(size_t)t * E + k]);
                s += p, m += fabs(p);
            }
            lerr = dmax(lerr, fabs(lg[(size_t)t * (NE + 1) + e] - s) / (m > 0 ? m : 1));
        }
    /* routing: model_moe_route on the GPU's logits */
    struct model_moe_config mc = {.n_expert = NE, .n_expert_used = K, .n_ff_expert = c->F, .n_ff_shared = c->Fs,
                                  .shared_gated = c->gated, .router = c->sigmoid ? MODEL_ROUTER_SIGMOID : MODEL_ROUTER_SOFTMAX,
                                  .norm_topk = c->norm, .scale = c->sigmoid ? c->scale : 1.0f, .n_group = c->G,
                                  .topk_group = c->TG, .swiglu_limit = c->limit};
    int32_t *ridx = malloc((size_t)K * 4);
    float *rwt = malloc((size_t)K * 4), *scr = malloc((size_t)2 * NE * 4);
    int bad_route = 0, ties = 0;
    double werr = 0;
    for (int t = 0; t < T; t++) {
        const float *l = lg + (size_t)t * (NE + 1);
        model_moe_route(&mc, l, c->bias ? bias : NULL, ridx, rwt, scr);
        for (int j = 0; j < K; j++) {
            if (ridx[j] != idx[(size_t)t * S + j]) bad_route++;
            werr = dmax(werr, fabs(rwt[j] - wt[(size_t)t * S + j]) / dmax(fabs(rwt[j]), 1e-3));
            if (c->dup && ridx[j] % 5 <= 1 && ridx[j] / 5 * 5 + 1 < NE) ties++; /* a duplicated pair's member */
        }
        if (S > K) {
            double w = c->gated ? 1.0 / (1.0 + exp(-(double)l[NE])) : 1.0;
            if (idx[(size_t)t * S + K] != NE) bad_route++;
            werr = dmax(werr, fabs(w - wt[(size_t)t * S + K]) / dmax(fabs(w), 1e-3));
        }
    }
    /* the output, from the GPU's routing */
    double oerr = 0, omax = 0;
    double *o = malloc((size_t)E * 8), *hh = malloc((size_t)Fmax * 8);
    for (int t = 0; t < T; t++) {
        const uint16_t *xt = x + (size_t)t * E;
        for (int i = 0; i < E; i++) o[i] = 0;
        for (int j = 0; j < S; j++) {
            int e = idx[(size_t)t * S + j];
            if (e < 0 || e > NE || !hex[e].F) {
                bad_route++;
                continue;
            }
            int F = hex[e].F;
            for (int r = 0; r < F; r++) {
                double g = 0, u = 0;
                for (int k = 0; k < E; k++) {
                    g += (double)rg[e][(size_t)r * E + k] * fb(xt[k]);
                    u += (double)ru[e][(size_t)r * E + k] * fb(xt[k]);
                }
                if (c->limit > 0) {
                    g = g < c->limit ? g : c->limit;
                    u = u < -c->limit ? -c->limit : u > c->limit ? c->limit : u;
                }
                hh[r] = fb(bf((float)(g / (1.0 + exp(-g)) * u)));
            }
            for (int i = 0; i < E; i++) {
                double y = 0;
                for (int r = 0; r < F; r++) y += (double)rd[e][(size_t)i * F + r] * hh[r];
                o[i] += wt[(size_t)t * S + j] * y;
            }
        }
        for (int i = 0; i < E; i++) {
            oerr = dmax(oerr, fabs(fb(out[(size_t)t * E + i]) - o[i]));
            omax = dmax(omax, fabs(o[i]));
        }
    }
    double orel = oerr / (omax > 0 ? omax : 1);
    /* batch invariance: tokens alone */
    int bad_bits = 0;
    int probe[3] = {0, T / 2, T - 1};
    for (int p = 0; p < 3; p++) {
        struct cuda_moe_args b1 = a;
        b1.T = 1;
        b1.xn = a.xn + (size_t)probe[p] * E;
        b1.out = keep(zeroed((size_t)E * 2));
        if (cuda_moe_forward(&b1, st) != cudaSuccess || cudaStreamSynchronize(st) != cudaSuccess) bad_bits++;
        cudaMemcpy(out1, b1.out, (size_t)E * 2, cudaMemcpyDeviceToHost);
        bad_bits += memcmp(out1, out + (size_t)probe[p] * E, (size_t)E * 2) != 0;
    }
    /* inside a graph */
    cudaGraph_t g = NULL;
    cudaGraphExec_t ge = NULL;
    struct cuda_moe_args ag = a;
    ag.out = keep(zeroed((size_t)T * E * 2));
    bool graph_ok = cudaStreamBeginCapture(st, cudaStreamCaptureModeThreadLocal) == cudaSuccess;
    graph_ok &= cuda_moe_forward(&ag, st) == cudaSuccess;
    graph_ok &= cudaStreamEndCapture(st, &g) == cudaSuccess;
    graph_ok &= graph_ok && cudaGraphInstantiate(&ge, g, 0) == cudaSuccess;
    graph_ok &= graph_ok && cudaGraphLaunch(ge, st) == cudaSuccess && cudaStreamSynchronize(st) == cudaSuccess;
    if (graph_ok) cudaMemcpy(outg, ag.out, (size_t)T * E * 2, cudaMemcpyDeviceToHost);
    bool graph_same = graph_ok && memcmp(outg, out, (size_t)T * E * 2) == 0;
    if (ge) cudaGraphExecDestroy(ge);
    if (g) cudaGraphDestroy(g);

    bool ok = lerr <= 1e-5 && bad_route == 0 && werr <= 1e-5 && orel <= 1e-2 && omax > 0 && bad_bits == 0 &&
              graph_same && path_diff == 0;
    printf("%s %-34s T %3d: logits %.1e, routing %d wrong (%d tie members), weights %.1e, output %.2e of %.3g, "
           "alone %s, graph %s, %s path%s\n",
           ok ? "ok  " : "FAIL", c->name, T, lerr, bad_route, ties, werr, orel, omax,
           bad_bits ? "DIFFERS" : "same bits", graph_same ? "same bits" : graph_ok ? "DIFFERS" : "failed",
           small ? "small" : "general", path_diff ? (small ? " DIFFERS from the general one" : " not refused by the "
                                                                                                "fused entries")
                                                  : small ? " = general bits" : "");
    CHECKF(lerr <= 1e-5, "%s: logits %.3g", c->name, lerr);
    CHECKF(bad_route == 0, "%s: %d routing slots differ from model_moe_route", c->name, bad_route);
    CHECKF(werr <= 1e-5, "%s: routing weights %.3g", c->name, werr);
    CHECKF(orel <= 1e-2 && omax > 0, "%s: output %.3g (max |ref| %.3g)", c->name, orel, omax);
    CHECKF(bad_bits == 0, "%s: a token alone differs from the batch", c->name);
    CHECKF(graph_same, "%s: the graph run differs", c->name);
    CHECKF(path_diff == 0, "%s: the %s path: %d differences", c->name, small ? "small" : "general", path_diff);

    cudaStreamDestroy(st);
    free_dev();
    for (int e = 0; e <= NE; e++) free(rg[e]), free(ru[e]), free(rd[e]);
    free(rg), free(ru), free(rd), free(hex), free(rw), free(rwb), free(bias), free(x), free(lg), free(wt), free(idx);
    free(out), free(out1), free(outg), free(ridx), free(rwt), free(scr), free(o), free(hh);
}

static const struct mcase cases[] = {
    /* qwen3_moe: softmax top-k, renormalised */
    {"softmax top-4 of 16, norm", 16, 4, 64, 16, 0, 37, false, true, false, false, false, true, 1, 1, 1, 0, false,
     {0, 0, 0}},
    /* qwen3_moe with norm_topk_prob false, wide: many tokens per expert (several chunks) */
    {"softmax top-8 of 128, no norm", 128, 8, 256, 96, 0, 300, false, false, false, false, false, false, 1, 1, 1, 0,
     false, {0, 0, 0}},
    /* over 8192 token slots: the grouping's multi-block path (the tokens alone take the one-block one) */
    {"softmax top-8 of 64, 1100 tokens", 64, 8, 64, 16, 0, 1100, false, true, false, false, false, false, 1, 1, 1, 0,
     false, {0, 0, 0}},
    /* qwen2_moe: softmax, no norm, a sigmoid-gated shared expert of its own width, an f32 router */
    {"softmax + gated shared, f32 router", 8, 2, 96, 40, 24, 50, false, false, true, true, false, true, 1, 1, 1, 0,
     false, {0, 0, 0}},
    /* glm4_moe / deepseek_v3: sigmoid, correction bias, groups, scaling, a shared expert */
    {"sigmoid groups 4/2, bias, shared", 16, 4, 64, 16, 16, 41, true, true, false, false, true, true, 4, 2, 2.5f, 0,
     false, {0, 0, 0}},
    {"sigmoid groups 8/4, 256 experts", 256, 8, 128, 32, 64, 129, true, true, false, false, true, false, 8, 4, 2.5f,
     0, false, {0, 0, 0}},
    /* glm5_next: one group, the clamped SwiGLU */
    {"sigmoid, clamped swiglu", 32, 8, 96, 48, 48, 33, true, true, false, false, true, false, 1, 1, 2.5f, 0.5f,
     false, {0, 0, 0}},
    /* packed experts mixed with bf16 ones (every format), odd widths */
    {"packed experts (5 formats), shared", 16, 4, 128, 64, 32, 45, true, true, false, false, true, false, 4, 2, 1.0f,
     0, true, {0, 0, 0}},
    {"packed experts, softmax", 10, 3, 96, 48, 0, 70, false, true, false, false, false, false, 1, 1, 1, 0, true,
     {0, 0, 0}},
    /* small steps (T S <= CUDA_MOE_SMALL_SLOTS: routing and grouping in one block, down fused with the
     * combine), against the general path; decode at the Qwen3-30B-A3B router (top-8 of 128) */
    {"small: softmax top-8 of 128", 128, 8, 256, 96, 0, 1, false, true, false, false, false, true, 1, 1, 1, 0,
     false, {0, 0, 0}},
    {"small: sigmoid groups 8/4, shared", 256, 8, 128, 32, 64, 2, true, true, false, false, true, false, 8, 4, 2.5f,
     0, false, {0, 0, 0}},
    {"small: packed experts (5 formats), shared", 16, 4, 128, 64, 32, 8, true, true, false, false, true, false, 4,
     2, 1.0f, 0, true, {0, 0, 0}},
    {"small: gated shared, f32 router", 8, 2, 96, 40, 24, 8, false, false, true, true, false, true, 1, 1, 1, 0,
     false, {0, 0, 0}},
    {"small: clamped swiglu, odd widths", 32, 8, 100, 20, 12, 5, true, true, false, false, true, false, 1, 1, 2.5f,
     0.5f, false, {0, 0, 0}},
    /* the bound: top-8 without shared experts (16 tokens small, 17 not), top-8 with (14, 15), and 33 */
    {"bound: softmax top-8 of 64", 64, 8, 128, 48, 0, 15, false, true, false, false, false, false, 1, 1, 1, 0,
     false, {0, 0, 0}},
    {"bound: softmax top-8 of 64", 64, 8, 128, 48, 0, 16, false, true, false, false, false, false, 1, 1, 1, 0,
     false, {0, 0, 0}},
    {"bound: softmax top-8 of 64", 64, 8, 128, 48, 0, 17, false, true, false, false, false, false, 1, 1, 1, 0,
     false, {0, 0, 0}},
    {"bound: softmax top-8 of 64", 64, 8, 128, 48, 0, 33, false, true, false, false, false, false, 1, 1, 1, 0,
     false, {0, 0, 0}},
    {"bound: sigmoid top-8 + shared", 32, 8, 128, 32, 32, 14, true, true, false, false, true, false, 4, 2, 2.5f, 0,
     false, {5, 5, 5}},
    {"bound: sigmoid top-8 + shared", 32, 8, 128, 32, 32, 15, true, true, false, false, true, false, 4, 2, 2.5f, 0,
     false, {5, 5, 5}},
    /* one format for all of an expert's matrices (gate and up in one pass): int4 g128 (W4A16's), int4 g32
     * sym, int8 per-channel asym, int8 g32 f16 scales, gate and up both int4 with different groups and scale
     * dtypes; small and general steps */
    {"int4 g128 experts", 32, 4, 256, 128, 64, 1, false, true, false, false, false, false, 1, 1, 1, 0, false,
     {5, 5, 5}},
    {"int4 g128 experts", 32, 4, 256, 128, 64, 40, false, true, false, false, false, false, 1, 1, 1, 0, false,
     {5, 5, 5}},
    {"int4 g32 experts", 16, 4, 128, 64, 0, 3, false, true, false, false, false, false, 1, 1, 1, 0, false,
     {1, 1, 1}},
    {"int8 per-channel asym experts", 16, 4, 128, 64, 32, 6, true, true, false, false, true, false, 1, 1, 1, 0,
     false, {2, 2, 2}},
    {"int8 g32 f16 experts", 16, 4, 96, 48, 0, 37, false, true, false, false, false, false, 1, 1, 1, 0, false,
     {6, 6, 6}},
    {"int4 gate g32 bf16, up g16 f16", 16, 4, 128, 64, 0, 4, false, true, false, false, false, false, 1, 1, 1, 0,
     false, {1, 3, 5}},
    {"int4 gate g32 bf16, up g16 f16", 16, 4, 128, 64, 0, 50, false, true, false, false, false, false, 1, 1, 1, 0,
     false, {1, 3, 5}},
    {"int4 odd width", 8, 2, 100, 40, 0, 9, false, true, false, false, false, false, 1, 1, 1, 0, false, {1, 3, 1}},
};

static void test_moe_cases(void)
{
    for (size_t i = 0; i < sizeof cases / sizeof *cases; i++) run_case(&cases[i]);
}

int main(void)
{
    if (!model_cuda_available()) {
        printf("no GPU: skipped\n0 passed, 0 failed\n");
        return 0;
    }
    RUN(test_moe_cases);
    return test_summary();
}

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
 *  - each of that on both expert paths, forced (cuda_tuning.moe_gemm_min_rows):
 *    the SIMT GEMVs and the grouped GEMM on tensor cores (moe_gemm.cu), and
 *    the two outputs against each other (within 1e-2 of max |ref|; they sum
 *    in different orders);
 *  - batch invariance within each path: three tokens run alone give the
 *    bits they got in the batch;
 *  - the whole layer captured in a CUDA graph gives the eager run's bits;
 *  - the router's logits on tensor cores (cuda_moe_router_gemm, bf16 routers)
 *    against the same reference and the SIMT kernel's, and the routing each
 *    gives (tokens routed otherwise only at near ties); cuda_moe_route takes
 *    it (the same bits) from cuda_tuning.moe_router_gemm_min_t tokens (set
 *    to -1 elsewhere, so that tokens alone route from the batch's bits);
 *  - a step of at most CUDA_MOE_SMALL_SLOTS token slots (cuda_moe_forward's
 *    small path: logits + routing + grouping in one launch, gate|up, down +
 *    combine) against the general stages run one by one on the GEMVs (the
 *    same bits: routing, weights, output), the routing's block counter
 *    (count[0]) back at zero after its launches; a larger step must be
 *    refused by the fused entries; cases sit at the
 *    bound and either side of it. The same for the f32 output (outf, a
 *    rank's partial sum), whose bits show an order of additions the bf16
 *    rounding hides; and a layer of streamed kinds (cuda_moe_streamed: one
 *    kind, or routed experts of one and shared ones of another, each in
 *    kernels of its own) against the small kernels for any kind; a step of
 *    one token also in decode's fused forms (the norm in the routing
 *    kernel's prologue, the output added into the residual: cuda_moe_fuses)
 *    against cuda_add_rmsnorm before and after the layer, bit for bit (the
 *    normalized input, the routing, the residual), and refused where they
 *    do not apply. The GEMM path of a small step runs the
 *    general stages (cuda_moe_forward keeps small steps on the GEMVs).
 * The GEMM's row tile follows T K / NE (16, 32, 64 or 128 rows; packed
 * experts on all four).
 * Two cases have over 8192 token slots, so their batch takes the grouping's
 * multi-block path and the tokens alone the one-block one; one has 1024
 * rows an expert (16 GEMM row tiles), one experts of 0, 1 and 200 rows.
 * Small steps also route more tokens than the routing block has warps (with
 * exact ties), and one has a hidden size of 8200 (the logits' threads hold
 * 4 router chunks in registers and read a fifth).
 * Cases: softmax top-k with and without renormalisation, the sigmoid router
 * with correction bias, scaling and group-limited choice, shared experts
 * (plain and qwen2_moe's gated one), an f32 router, the clamped SwiGLU, odd
 * widths (partial tiles; E and F not multiples of 8), packed experts mixed
 * with bf16 ones (int4 g16/g32/g128 and int8 per channel, with and without
 * zero points, f16 scales, act-order), and experts all in one packed format
 * (gate and up decoded in one pass), the reference dequantizing with
 * model_qrepack_row; mixed layers (routed experts of one kind, shared ones
 * of another) at GLM-5.3-Flash's shape (int4 g32 routed, int8 per-channel
 * shared) and a DeepSeek-V2-Lite-like one (int4 g128 routed, bf16 shared),
 * their routed experts sharing a few weight sets (the reference's memory).
 */
#include <cuda_runtime.h>
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "cuda/kernels.h"
#include "cuda/moe.h"
#include "cuda/tuning.h"
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
 * 4 int4 g32 act-order asym (the GEMVs' element-by-element path); 5 int4 g128 sym bf16 scales (GPTQ /
 * compressed-tensors W4A16's usual one); 6 int4 g128 asym; 7 int8 g32 sym f16 scales; 8 int8 per-channel
 * sym bf16 scales (GLM-5.3-Flash's shared expert) */
#define NFMT 7 /* the formats a case's experts cycle through */

/* A random packed weight in the device layout (as test_qgemm.c makes them). */
static void make_packed(int fmt, int rows, int cols, struct model_qrepack *p)
{
    int bits = fmt == 2 || fmt == 7 || fmt == 8 ? 8 : 4,
        group = fmt == 2 || fmt == 8 ? 0 : fmt == 3 ? 16 : fmt == 5 || fmt == 6 ? 128 : 32;
    bool asym = fmt >= 2 && fmt != 5 && fmt != 7 && fmt != 8, f16 = fmt == 3 || fmt == 7, act = fmt == 4;
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
    bool skew;                /* experts 0 .. K-2 biased to take every token (> 128 rows; many experts 0 or 1) */
    int fmt[3];               /* unless packed, every expert's gate, up and down in these formats (0: bf16) */
    bool sown;                /* the shared experts in sfmt's formats instead (a mixed layer) */
    int sfmt[3];
    int distinct;             /* routed experts of weights of their own (0: all; expert e >= distinct shares
                               * e % distinct's: at the real shapes every one would be GBs of reference) */
    int want, want_sh;        /* nonzero: what cuda_moe_streamed must say of the routed and the shared experts */
};

static double dmax(double a, double b) { return a > b ? a : b; }

/* The general stages one by one: what cuda_moe_forward runs for a step
 * that is not small. */
static cudaError_t general_stages(const struct cuda_moe_args *a, cudaStream_t st)
{
    cudaError_t e;
    if ((e = cuda_moe_route(a, st)) != cudaSuccess || (e = cuda_moe_group(a, st)) != cudaSuccess ||
        (e = cuda_moe_experts(a, st)) != cudaSuccess)
        return e;
    return cuda_moe_combine(a, st);
}

/* The layer on path 0 (cuda_moe_forward: the fused kernels for a small
 * step, else the general stages with the GEMVs) or 1 (the general stages
 * with the grouped GEMM; cuda_moe_forward keeps a small step on the GEMVs,
 * so for one the stages are called here). */
static cudaError_t forward_on(const struct cuda_moe_args *a, int path, cudaStream_t st)
{
    return path && cuda_moe_small(a) ? general_stages(a, st) : cuda_moe_forward(a, st);
}

/* The layer on one expert path (forward_on; 0 the GEMVs, 1 the grouped
 * GEMM, forced through cuda_tuning.moe_gemm_min_rows; the SIMT router
 * logits on both): its output into out (NaN where the run failed; lg, wt,
 * idx, when lg is given, the routing), whether three tokens alone give the bits they got in the batch
 * (*alone) and whether the layer captured in a graph does (*graph). h and y
 * are poisoned (NaN) first, so an assignment the path skips shows. */
static void run_path(const struct cuda_moe_args *a, int path, cudaStream_t st, const char *name, uint16_t *out,
                     bool *alone, bool *graph, float *lg, float *wt, int32_t *idx)
{
    const float saved = cuda_tuning.moe_gemm_min_rows, saved_p = cuda_tuning.moe_gemm_min_rows_packed;
    const int saved_r = cuda_tuning.moe_router_gemm_min_t;
    const int T = a->T, E = a->E, S = a->S, NE = a->NE;
    const char *pn = path ? "gemm" : "gemv";
    cuda_tuning.moe_gemm_min_rows = cuda_tuning.moe_gemm_min_rows_packed = path ? 0.0f : -1.0f;
    cuda_tuning.moe_router_gemm_min_t = -1;
    const size_t n = (size_t)T * E * 2;
    cudaMemset(a->h, 0xff, (size_t)T * S * a->Fmax * 2);
    cudaMemset(a->y, 0xff, (size_t)T * S * E * 4);
    struct cuda_moe_args b = *a;
    b.out = keep(poisoned(n));
    cudaError_t ce = forward_on(&b, path, st);
    CHECKF(ce == cudaSuccess, "%s %s: launch: %s", pn, name, cudaGetErrorString(ce));
    if (ce == cudaSuccess) ce = cudaStreamSynchronize(st);
    CHECKF(ce == cudaSuccess, "%s %s: run: %s", pn, name, cudaGetErrorString(ce));
    get(out, b.out, n);
    if (lg) {
        get(lg, a->logits, (size_t)T * (NE + 1) * 4);
        get(wt, a->wt, (size_t)T * S * 4);
        get(idx, a->idx, (size_t)T * S * 4);
    }
    /* batch invariance within the path: tokens alone */
    *alone = ce == cudaSuccess;
    uint16_t *out1 = malloc((size_t)E * 2), *outg = malloc(n);
    const int probe[3] = {0, T / 2, T - 1};
    for (int p = 0; p < 3; p++) {
        struct cuda_moe_args b1 = *a;
        b1.T = 1;
        b1.xn = a->xn + (size_t)probe[p] * E;
        b1.out = keep(poisoned((size_t)E * 2));
        if (forward_on(&b1, path, st) != cudaSuccess || cudaStreamSynchronize(st) != cudaSuccess) *alone = false;
        get(out1, b1.out, (size_t)E * 2);
        if (memcmp(out1, out + (size_t)probe[p] * E, (size_t)E * 2)) *alone = false;
    }
    /* inside a graph */
    cudaGraph_t g = NULL;
    cudaGraphExec_t ge = NULL;
    struct cuda_moe_args ag = *a;
    ag.out = keep(poisoned(n));
    bool gok = cudaStreamBeginCapture(st, cudaStreamCaptureModeThreadLocal) == cudaSuccess;
    gok &= forward_on(&ag, path, st) == cudaSuccess;
    gok &= cudaStreamEndCapture(st, &g) == cudaSuccess;
    gok = gok && cudaGraphInstantiate(&ge, g, 0) == cudaSuccess;
    gok = gok && cudaGraphLaunch(ge, st) == cudaSuccess && cudaStreamSynchronize(st) == cudaSuccess;
    if (gok) get(outg, ag.out, n);
    *graph = gok && memcmp(outg, out, n) == 0;
    if (ge) cudaGraphExecDestroy(ge);
    if (g) cudaGraphDestroy(g);
    free(out1), free(outg);
    cuda_tuning.moe_gemm_min_rows = saved, cuda_tuning.moe_gemm_min_rows_packed = saved_p;
    cuda_tuning.moe_router_gemm_min_t = saved_r;
}

/* Whether cuda_moe_route with cuda_tuning.moe_router_gemm_min_t at a.T
 * (its bound: the router GEMM for a bf16 router, the SIMT kernel for an
 * f32 one) gives the logits want (the bits of rows e < R). */
static bool route_logits_are(const struct cuda_moe_args *a, cudaStream_t st, const float *want, int R)
{
    const int saved = cuda_tuning.moe_router_gemm_min_t;
    cuda_tuning.moe_router_gemm_min_t = a->T;
    cudaError_t ce = cuda_moe_route(a, st);
    if (ce == cudaSuccess) ce = cudaStreamSynchronize(st);
    cuda_tuning.moe_router_gemm_min_t = saved;
    const size_t ld = (size_t)a->NE + 1;
    float *got = malloc((size_t)a->T * ld * 4);
    get(got, a->logits, (size_t)a->T * ld * 4);
    bool same = ce == cudaSuccess;
    for (int t = 0; t < a->T; t++) same = same && !memcmp(got + t * ld, want + t * ld, (size_t)R * 4);
    free(got);
    return same;
}

/* The layer's f32 output (outf, as a rank's partial sum: no bf16 rounding
 * to hide a changed order of additions) into out: by cuda_moe_forward, or
 * (general) the general stages on the GEMVs and the SIMT logits. Whether
 * it ran. */
static bool step_f32(const struct cuda_moe_args *a, bool general, cudaStream_t st, float *out)
{
    const float saved = cuda_tuning.moe_gemm_min_rows, saved_p = cuda_tuning.moe_gemm_min_rows_packed;
    const int saved_r = cuda_tuning.moe_router_gemm_min_t;
    cuda_tuning.moe_gemm_min_rows = cuda_tuning.moe_gemm_min_rows_packed = -1.0f;
    cuda_tuning.moe_router_gemm_min_t = -1;
    struct cuda_moe_args b = *a;
    const size_t n = (size_t)a->T * a->E * 4;
    b.outf = keep(poisoned(n));
    cudaError_t ce = general ? general_stages(&b, st) : cuda_moe_forward(&b, st);
    if (ce == cudaSuccess) ce = cudaStreamSynchronize(st);
    cuda_tuning.moe_gemm_min_rows = saved, cuda_tuning.moe_gemm_min_rows_packed = saved_p;
    cuda_tuning.moe_router_gemm_min_t = saved_r;
    get(out, b.outf, n);
    return ce == cudaSuccess;
}

static const char *stream_name(int k)
{
    return k == CUDA_MOE_STREAM_INT4   ? "int4"
           : k == CUDA_MOE_STREAM_INT8 ? "int8"
           : k == CUDA_MOE_STREAM_BF16 ? "bf16"
                                       : "any";
}

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
    for (int e = 0; e < NE; e++) bias[e] = frand() * 0.05f + (c->skew && e < K - 1 ? 1.0f : 0.0f);
    /* experts: NE routed + the shared ones */
    struct cuda_moe_expert *hex = calloc((size_t)NE + 1, sizeof *hex);
    float **rg = calloc((size_t)NE + 1, sizeof *rg), **ru = calloc((size_t)NE + 1, sizeof *ru),
          **rd = calloc((size_t)NE + 1, sizeof *rd);
    const int nd = c->distinct > 0 && c->distinct < NE ? c->distinct : NE; /* routed experts of their own */
    for (int e = 0; e <= NE; e++) {
        int F = e < NE ? c->F : c->Fs;
        if (!F) continue;
        if (e < NE && e >= nd) {
            const int o = e % nd;
            hex[e] = hex[o], rg[e] = rg[o], ru[e] = ru[o], rd[e] = rd[o];
            continue;
        }
        rg[e] = malloc((size_t)F * E * 4), ru[e] = malloc((size_t)F * E * 4), rd[e] = malloc((size_t)E * F * 4);
        hex[e].F = F;
        const int *f = e == NE && c->sown ? c->sfmt : c->fmt;
        make_mat(c->packed ? e % NFMT : f[0], F, E, rg[e], &hex[e].gate);
        make_mat(c->packed ? (e + 1) % NFMT : f[1], F, E, ru[e], &hex[e].up);
        make_mat(c->packed ? (e + 2) % NFMT : f[2], E, F, rd[e], &hex[e].down);
    }
    uint16_t *x = malloc((size_t)T * E * 2);
    for (int i = 0; i < T * E; i++) x[i] = bf(frand());

    struct cuda_moe_args a = {
        .T = T, .E = E, .NE = NE, .K = K, .S = S, .Fmax = Fmax, .sigmoid = c->sigmoid, .norm_topk = c->norm,
        .n_group = c->G, .topk_group = c->TG, .shared_gated = c->gated, .scale = c->scale,
        .swiglu_limit = c->limit, .router_f32 = c->router_f32,
        .packed = c->packed || c->fmt[0] || c->fmt[1] || c->fmt[2] || (c->sown && (c->sfmt[0] || c->sfmt[1] ||
                                                                                   c->sfmt[2])),
    };
    a.xn = keep(dup_dev(x, (size_t)T * E * 2));
    a.router = keep(c->router_f32 ? dup_dev(rw, (size_t)R * E * 4) : dup_dev(rwb, (size_t)R * E * 2));
    a.bias = c->bias ? keep(dup_dev(bias, (size_t)NE * 4)) : NULL;
    a.ex = keep(dup_dev(hex, ((size_t)NE + 1) * sizeof *hex));
    a.streamed = cuda_moe_streamed(hex, NE, E, &a.streamed_shared); /* as the backend sets them */
    if (c->want)
        CHECKF(a.streamed == c->want && a.streamed_shared == c->want_sh,
               "%s: cuda_moe_streamed says %d and %d, not %d and %d", c->name, a.streamed, a.streamed_shared,
               c->want, c->want_sh);
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
    float *lg = malloc((size_t)T * (NE + 1) * 4), *wt = malloc((size_t)T * S * 4);
    int32_t *idx = malloc((size_t)T * S * 4);
    uint16_t *outp[2];
    bool alone[2], graph[2];
    for (int p = 0; p < 2; p++) {
        outp[p] = malloc((size_t)T * E * 2);
        run_path(&a, p, st, c->name, outp[p], &alone[p], &graph[p], p ? NULL : lg, wt, idx);
    }

    /* a small step (path 0 ran cuda_moe_forward's fused kernels) against the general stages run one by
     * one on the GEMVs and the SIMT logits (the same bits: routing, weights, output); a larger one: the
     * fused entries refuse it */
    const bool small = cuda_moe_small(&a);
    int path_diff = 0;
    if (small) {
        struct cuda_moe_args ap = a;
        ap.out = keep(zeroed((size_t)T * E * 2));
        const float saved = cuda_tuning.moe_gemm_min_rows, saved_p = cuda_tuning.moe_gemm_min_rows_packed;
        const int saved_r = cuda_tuning.moe_router_gemm_min_t;
        cuda_tuning.moe_gemm_min_rows = cuda_tuning.moe_gemm_min_rows_packed = -1.0f;
        cuda_tuning.moe_router_gemm_min_t = -1;
        cudaError_t ce = general_stages(&ap, st);
        if (ce == cudaSuccess) ce = cudaStreamSynchronize(st);
        cuda_tuning.moe_gemm_min_rows = saved, cuda_tuning.moe_gemm_min_rows_packed = saved_p;
        cuda_tuning.moe_router_gemm_min_t = saved_r;
        CHECKF(ce == cudaSuccess, "%s: the general path: %s", c->name, cudaGetErrorString(ce));
        float *wt2 = malloc((size_t)T * S * 4);
        int32_t *idx2 = malloc((size_t)T * S * 4);
        uint16_t *out2 = malloc((size_t)T * E * 2);
        cudaMemcpy(wt2, ap.wt, (size_t)T * S * 4, cudaMemcpyDeviceToHost);
        cudaMemcpy(idx2, ap.idx, (size_t)T * S * 4, cudaMemcpyDeviceToHost);
        cudaMemcpy(out2, ap.out, (size_t)T * E * 2, cudaMemcpyDeviceToHost);
        path_diff = (memcmp(wt2, wt, (size_t)T * S * 4) != 0) + (memcmp(idx2, idx, (size_t)T * S * 4) != 0) +
                    (memcmp(out2, outp[0], (size_t)T * E * 2) != 0);
        /* a layer of one kind (a.streamed), or routed experts of one and shared ones of another (the
         * routed slots and the shared one in kernels of each kind's own): their kernels give the bits of
         * the ones that decode any kind */
        if (a.streamed) {
            struct cuda_moe_args an = a;
            an.streamed = 0;
            an.out = keep(zeroed((size_t)T * E * 2));
            ce = cuda_moe_forward(&an, st);
            if (ce == cudaSuccess) ce = cudaStreamSynchronize(st);
            CHECKF(ce == cudaSuccess, "%s: the small path for any kind: %s", c->name, cudaGetErrorString(ce));
            cudaMemcpy(out2, an.out, (size_t)T * E * 2, cudaMemcpyDeviceToHost);
            const bool same = memcmp(out2, outp[0], (size_t)T * E * 2) == 0;
            CHECKF(same, "%s: the kernels for every kind differ from the %s (shared: %s) ones", c->name,
                   stream_name(a.streamed), stream_name(a.streamed_shared));
            path_diff += !same;
        }
        /* the f32 sums before the bf16 rounding (outf), which hides most last-bit differences (an f32 ulp
         * changes the bf16 result about once in 2^16): the small path against the general stages, and a
         * streamed layer's kernels against the ones for any kind */
        float *f[3];
        const size_t nf = (size_t)T * E;
        for (int i = 0; i < 3; i++) f[i] = malloc(nf * 4);
        struct cuda_moe_args an = a;
        an.streamed = 0;
        bool ran = step_f32(&a, false, st, f[0]) && step_f32(&a, true, st, f[1]);
        if (a.streamed) ran = step_f32(&an, false, st, f[2]) && ran;
        CHECKF(ran, "%s: the f32 (outf) steps failed", c->name);
        int fdiff = 0, fdiff_any = 0;
        for (size_t i = 0; i < nf; i++) {
            fdiff += memcmp(&f[0][i], &f[1][i], 4) != 0;
            fdiff_any += a.streamed && memcmp(&f[0][i], &f[2][i], 4) != 0;
        }
        CHECKF(fdiff == 0, "%s: f32 output: %d of %zu values differ from the general path's", c->name, fdiff, nf);
        CHECKF(fdiff_any == 0, "%s: f32 output: %d of %zu values differ from the kernels for any kind", c->name,
               fdiff_any, nf);
        path_diff += (fdiff != 0) + (fdiff_any != 0) + !ran;
        for (int i = 0; i < 3; i++) free(f[i]);
        /* one token: decode's fused forms against cuda_add_rmsnorm before and after the unfused layer */
        if (T == 1) {
            const bool fuses = cuda_moe_fuses(&a);
            float *xf = malloc((size_t)E * 4), *nw = malloc((size_t)E * 4), *ones = malloc((size_t)E * 4);
            for (int i = 0; i < E; i++) xf[i] = frand() * ldexpf(1.0f, (int)(urand() % 9) - 4), nw[i] = 1 + frand() / 4;
            for (int i = 0; i < E; i++) ones[i] = 1.0f;
            float *dnw = keep(dup_dev(nw, (size_t)E * 4)), *dones = keep(dup_dev(ones, (size_t)E * 4));
            float *r1 = keep(dup_dev(xf, (size_t)E * 4)), *r2 = keep(dup_dev(xf, (size_t)E * 4));
            uint16_t *xn1 = keep(poisoned((size_t)E * 2)), *xn2 = keep(poisoned((size_t)E * 2));
            uint16_t *d1 = keep(poisoned((size_t)E * 2)), *scr = keep(poisoned((size_t)E * 2));
            struct cuda_moe_args au = a, af = a;
            au.xn = xn1, au.out = d1;
            af.xn = xn2, af.out = NULL, af.xf = r2, af.nw = dnw, af.eps = 1e-6f, af.resid = r2;
            cudaError_t e1 = cuda_add_rmsnorm(r1, NULL, dnw, NULL, 1, E, 1e-6f, xn1, st);
            if (e1 == cudaSuccess) e1 = cuda_moe_forward(&au, st);
            if (e1 == cudaSuccess) e1 = cuda_add_rmsnorm(r1, d1, dones, NULL, 1, E, 1e-6f, scr, st);
            if (e1 == cudaSuccess) e1 = cudaStreamSynchronize(st);
            int32_t *i1 = malloc((size_t)S * 4), *i2 = malloc((size_t)S * 4);
            float *w1 = malloc((size_t)S * 4), *w2 = malloc((size_t)S * 4);
            get(i1, a.idx, (size_t)S * 4), get(w1, a.wt, (size_t)S * 4);
            cudaError_t e2 = cuda_moe_forward(&af, st);
            if (e2 == cudaSuccess) e2 = cudaStreamSynchronize(st);
            get(i2, a.idx, (size_t)S * 4), get(w2, a.wt, (size_t)S * 4);
            if (fuses) {
                float *g1 = malloc((size_t)E * 4), *g2 = malloc((size_t)E * 4);
                uint16_t *n1 = malloc((size_t)E * 2), *n2 = malloc((size_t)E * 2);
                get(g1, r1, (size_t)E * 4), get(g2, r2, (size_t)E * 4);
                get(n1, xn1, (size_t)E * 2), get(n2, xn2, (size_t)E * 2);
                const int dn = memcmp(n1, n2, (size_t)E * 2) != 0, dr = memcmp(g1, g2, (size_t)E * 4) != 0;
                const int di = memcmp(i1, i2, (size_t)S * 4) != 0 || memcmp(w1, w2, (size_t)S * 4) != 0;
                const int moved = memcmp(g1, xf, (size_t)E * 4) != 0;
                CHECKF(e1 == cudaSuccess && e2 == cudaSuccess && !dn && !dr && !di && moved,
                       "%s: fused forms: %s / %s; normalized input %s, routing %s, residual %s%s", c->name,
                       cudaGetErrorString(e1), cudaGetErrorString(e2), dn ? "differs" : "same",
                       di ? "differs" : "same", dr ? "differs" : "same", moved ? "" : " (unchanged)");
                path_diff += dn + dr + di + !moved;
                free(g1), free(g2), free(n1), free(n2);
            } else {
                CHECKF(e1 == cudaSuccess && e2 == cudaErrorInvalidValue, "%s: fused forms where they do not apply: %s",
                       c->name, cudaGetErrorString(e2));
            }
            free(xf), free(nw), free(ones), free(i1), free(i2), free(w1), free(w2);
        }
        /* the fused routing's block counter wrapped back to zero after every launch (eager, alone, graph) */
        int32_t c0 = -1;
        cudaMemcpy(&c0, a.count, 4, cudaMemcpyDeviceToHost);
        CHECKF(c0 == 0, "%s: the routing's block counter is %d after the steps, not 0", c->name, (int)c0);
        free(wt2), free(idx2), free(out2);
    } else {
        path_diff = (cuda_moe_route_group(&a, st) != cudaErrorInvalidValue) +
                    (cuda_moe_gate_up_small(&a, st) != cudaErrorInvalidValue) +
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
    /* the router's logits on tensor cores (bf16 routers; an f32 one is
     * refused): against the double-precision dot product and the SIMT
     * logits, and the routing model_moe_route makes of each; a token routed
     * otherwise must have a near tie, an expert chosen by one and one by the
     * other whose choice values (softmax: logits; sigmoid: sigmoid + bias)
     * are within 1e-4 of their sum |w x| (the logits' error bound is 1e-5) */
    double rgerr = 0, rgdiff = 0;
    int rflip = 0, rnear = 0;
    cudaError_t rce = cuda_moe_router_gemm(&a, st);
    if (c->router_f32) {
        CHECKF(rce == cudaErrorInvalidValue, "%s: the router GEMM took an f32 router", c->name);
        CHECKF(route_logits_are(&a, st, lg, R), "%s: route at moe_router_gemm_min_t: not the SIMT logits",
               c->name);
    } else {
        if (rce == cudaSuccess) rce = cudaStreamSynchronize(st);
        CHECKF(rce == cudaSuccess, "%s: router gemm: %s", c->name, cudaGetErrorString(rce));
        float *lg2 = malloc((size_t)T * (NE + 1) * 4), *mabs = malloc((size_t)T * (NE + 1) * 4);
        get(lg2, a.logits, (size_t)T * (NE + 1) * 4);
        for (int t = 0; t < T; t++)
            for (int e = 0; e < R; e++) {
                double sum = 0, m = 0;
                for (int k = 0; k < E; k++) {
                    double p = (double)rw[(size_t)e * E + k] * fb(x[(size_t)t * E + k]);
                    sum += p, m += fabs(p);
                }
                const size_t at = (size_t)t * (NE + 1) + e;
                mabs[at] = (float)m;
                rgerr = dmax(rgerr, fabs(lg2[at] - sum) / (m > 0 ? m : 1));
                rgdiff = dmax(rgdiff, fabs(lg2[at] - lg[at]) / (m > 0 ? m : 1));
            }
        int32_t *ridx2 = malloc((size_t)K * 4);
        for (int t = 0; t < T; t++) {
            const size_t row = (size_t)t * (NE + 1);
            model_moe_route(&mc, lg + row, c->bias ? bias : NULL, ridx, rwt, scr);
            model_moe_route(&mc, lg2 + row, c->bias ? bias : NULL, ridx2, rwt, scr);
            if (!memcmp(ridx, ridx2, (size_t)K * 4)) continue;
            bool near = false;
            for (int i = 0; i < K; i++)
                for (int j = 0; j < K; j++) {
                    const int ea = ridx[i], eb = ridx2[j];
                    bool a_in2 = false, b_in1 = false;
                    for (int q = 0; q < K; q++) a_in2 |= ridx2[q] == ea, b_in1 |= ridx[q] == eb;
                    if (a_in2 || b_in1) continue;
                    double va = lg[row + ea], vb = lg[row + eb];
                    if (c->sigmoid) {
                        va = 1.0 / (1.0 + exp(-va)) + (c->bias ? bias[ea] : 0);
                        vb = 1.0 / (1.0 + exp(-vb)) + (c->bias ? bias[eb] : 0);
                    }
                    if (fabs(va - vb) <= 1e-4 * dmax(mabs[row + ea], mabs[row + eb])) near = true;
                }
            if (near) rnear++;
            else rflip++;
        }
        /* cuda_moe_route takes it from moe_router_gemm_min_t tokens */
        const bool hook = route_logits_are(&a, st, lg2, R);
        printf("%s rgemm %-34s T %4d: logits %.1e, vs the SIMT kernel's %.1e, routing: %d tokens differ (%d at near "
               "ties), route at the bound %s\n",
               rgerr <= 1e-4 && rflip == 0 && hook ? "ok  " : "FAIL", c->name, T, rgerr, rgdiff, rflip + rnear, rnear,
               hook ? "same bits" : "DIFFERS");
        CHECKF(hook, "%s: route at moe_router_gemm_min_t: not the router GEMM's logits", c->name);
        CHECKF(rgerr <= 1e-4, "%s: router gemm logits %.3g", c->name, rgerr);
        CHECKF(rflip == 0, "%s: router gemm: %d tokens routed otherwise without a near tie", c->name, rflip);
        free(lg2), free(mabs), free(ridx2);
    }
    /* the output, from the GPU's routing */
    double oerr[2] = {0, 0}, omax = 0, pdiff = 0;
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
            const size_t at = (size_t)t * E + i;
            for (int p = 0; p < 2; p++) oerr[p] = dmax(oerr[p], fabs(fb(outp[p][at]) - o[i]));
            pdiff = dmax(pdiff, fabs(fb(outp[1][at]) - fb(outp[0][at])));
            if (isnan(fb(outp[0][at])) || isnan(fb(outp[1][at]))) oerr[0] = oerr[1] = INFINITY;
            omax = dmax(omax, fabs(o[i]));
        }
    }
    /* rows per routed expert: the GEMM's tiles see 0, 1, many */
    int *cnt = calloc((size_t)NE + 1, sizeof *cnt), cmin = T, cmax = 0, c1 = 0;
    for (int i = 0; i < T * S; i++) cnt[idx[i] >= 0 && idx[i] <= NE ? idx[i] : NE]++;
    for (int e = 0; e < NE; e++) {
        cmin = cnt[e] < cmin ? cnt[e] : cmin, cmax = cnt[e] > cmax ? cnt[e] : cmax;
        c1 += cnt[e] == 1;
    }
    free(cnt);
    const double den = omax > 0 ? omax : 1;
    for (int p = 0; p < 2; p++) {
        const double orel = oerr[p] / den;
        const bool ok = lerr <= 1e-5 && bad_route == 0 && werr <= 1e-5 && orel <= 1e-2 && omax > 0 && alone[p] &&
                        graph[p] && (p == 0 || pdiff / den <= 1e-2) && (p == 1 || path_diff == 0);
        printf("%s %s %-34s T %4d: logits %.1e, routing %d wrong (%d tie members), weights %.1e, output %.2e of %.3g, "
               "alone %s, graph %s",
               ok ? "ok  " : "FAIL", p ? "gemm" : "gemv", c->name, T, lerr, bad_route, ties, werr, orel, omax,
               alone[p] ? "same bits" : "DIFFERS", graph[p] ? "same bits" : "DIFFERS/failed");
        if (p) printf(", vs gemv %.2e, rows/expert %d..%d (%d with 1)", pdiff / den, cmin, cmax, c1);
        else printf(", %s path (%s%s%s)%s", small ? "small" : "general", stream_name(a.streamed),
                    S > K && a.streamed_shared != a.streamed ? ", shared " : "",
                    S > K && a.streamed_shared != a.streamed ? stream_name(a.streamed_shared) : "",
                    path_diff ? (small ? " DIFFERS from the general one" : " not refused by the fused entries")
                              : small ? " = general bits" : "");
        printf("\n");
        CHECKF(orel <= 1e-2 && omax > 0, "%s %s: output %.3g (max |ref| %.3g)", p ? "gemm" : "gemv", c->name, orel,
               omax);
        CHECKF(alone[p], "%s %s: a token alone differs from the batch", p ? "gemm" : "gemv", c->name);
        CHECKF(graph[p], "%s %s: the graph run differs", p ? "gemm" : "gemv", c->name);
    }
    CHECKF(lerr <= 1e-5, "%s: logits %.3g", c->name, lerr);
    CHECKF(bad_route == 0, "%s: %d routing slots differ from model_moe_route", c->name, bad_route);
    CHECKF(werr <= 1e-5, "%s: routing weights %.3g", c->name, werr);
    CHECKF(pdiff / den <= 1e-2, "%s: gemm vs gemv %.3g", c->name, pdiff / den);
    CHECKF(path_diff == 0, "%s: the %s path: %d differences", c->name, small ? "small" : "general", path_diff);
    free(ridx), free(rwt), free(scr), free(o), free(hh);
    cudaStreamDestroy(st);
    free_dev();
    for (int e = 0; e <= NE; e++)
        if (e < nd || e == NE) free(rg[e]), free(ru[e]), free(rd[e]);
    free(rg), free(ru), free(rd), free(hex), free(rw), free(rwb), free(bias), free(x), free(lg), free(wt), free(idx);
    free(outp[0]), free(outp[1]);
}

static const struct mcase cases[] = {
    /* qwen3_moe: softmax top-k, renormalised */
    {"softmax top-4 of 16, norm", 16, 4, 64, 16, 0, 37, false, true, false, false, false, true, 1, 1, 1, 0, false,
     false, {0, 0, 0}, false, {0, 0, 0}, 0, 0, 0},
    /* qwen3_moe with norm_topk_prob false, wide: many tokens per expert (several chunks) */
    {"softmax top-8 of 128, no norm", 128, 8, 256, 96, 0, 300, false, false, false, false, false, false, 1, 1, 1, 0,
     false, false, {0, 0, 0}, false, {0, 0, 0}, 0, 0, 0},
    /* over 8192 token slots: the grouping's multi-block path (the tokens alone take the one-block one) */
    {"softmax top-8 of 64, 1100 tokens", 64, 8, 64, 16, 0, 1100, false, true, false, false, false, false, 1, 1, 1, 0,
     false, false, {0, 0, 0}, false, {0, 0, 0}, 0, 0, 0},
    /* qwen2_moe: softmax, no norm, a sigmoid-gated shared expert of its own width, an f32 router */
    {"softmax + gated shared, f32 router", 8, 2, 96, 40, 24, 50, false, false, true, true, false, true, 1, 1, 1, 0,
     false, false, {0, 0, 0}, false, {0, 0, 0}, 0, 0, 0},
    /* glm4_moe / deepseek_v3: sigmoid, correction bias, groups, scaling, a shared expert */
    {"sigmoid groups 4/2, bias, shared", 16, 4, 64, 16, 16, 41, true, true, false, false, true, true, 4, 2, 2.5f, 0,
     false, false, {0, 0, 0}, false, {0, 0, 0}, 0, 0, 0},
    {"sigmoid groups 8/4, 256 experts", 256, 8, 128, 32, 64, 129, true, true, false, false, true, false, 8, 4, 2.5f,
     0, false, false, {0, 0, 0}, false, {0, 0, 0}, 0, 0, 0},
    /* glm5_next: one group, the clamped SwiGLU */
    {"sigmoid, clamped swiglu", 32, 8, 96, 48, 48, 33, true, true, false, false, true, false, 1, 1, 2.5f, 0.5f,
     false, false, {0, 0, 0}, false, {0, 0, 0}, 0, 0, 0},
    /* packed experts mixed with bf16 ones (every format), odd widths */
    {"packed experts (7 formats), shared", 16, 4, 128, 64, 32, 45, true, true, false, false, true, false, 4, 2, 1.0f,
     0, true, false, {0, 0, 0}, false, {0, 0, 0}, 0, 0, 0},
    {"packed experts, softmax", 10, 3, 96, 48, 0, 70, false, true, false, false, false, false, 1, 1, 1, 0, true,
     false, {0, 0, 0}, false, {0, 0, 0}, 0, 0, 0},
    /* widths that are not multiples of 8 (element-by-element loads) nor of the GEMM's tiles */
    {"odd widths E 100 F 36, packed", 12, 3, 100, 36, 20, 90, false, true, false, false, false, false, 1, 1, 1, 0,
     true, false, {0, 0, 0}, false, {0, 0, 0}, 0, 0, 0},
    /* T K large: 1024 rows an expert (16 GEMM row tiles), E and F partial tiles */
    {"2048 tokens top-8 of 16", 16, 8, 136, 80, 0, 2048, false, true, false, false, false, false, 1, 1, 1, 0,
     false, false, {0, 0, 0}, false, {0, 0, 0}, 0, 0, 0},
    /* packed experts on 64- and 128-row tiles (the tile height follows T K / NE), a shared expert */
    {"packed experts, 64-row tiles", 8, 2, 96, 40, 0, 600, false, true, false, false, false, false, 1, 1, 1, 0, true,
     false, {0, 0, 0}, false, {0, 0, 0}, 0, 0, 0},
    {"packed experts, 128-row tiles, shared", 8, 2, 136, 72, 24, 1600, true, true, false, false, true, false, 1, 1,
     1.0f, 0, true, false, {0, 0, 0}, false, {0, 0, 0}, 0, 0, 0},
    /* three experts take all 200 tokens, the fourth slot spreads over 125: experts of 0, 1 and > 128 rows */
    {"skewed: 0, 1 and 200 rows, packed", 128, 4, 64, 32, 0, 200, true, true, false, false, true, false, 1, 1, 1.0f,
     0, true, true, {0, 0, 0}, false, {0, 0, 0}, 0, 0, 0},
    /* small steps (T S <= CUDA_MOE_SMALL_SLOTS: logits, routing and grouping in one launch, down fused with
     * the combine), against the general path; decode at the Qwen3-30B-A3B router (top-8 of 128) */
    {"small: softmax top-8 of 128", 128, 8, 256, 96, 0, 1, false, true, false, false, false, true, 1, 1, 1, 0,
     false, false, {0, 0, 0}, false, {0, 0, 0}, 0, 0, 0},
    {"small: sigmoid groups 8/4, shared", 256, 8, 128, 32, 64, 2, true, true, false, false, true, false, 8, 4, 2.5f,
     0, false, false, {0, 0, 0}, false, {0, 0, 0}, 0, 0, 0},
    {"small: packed experts (7 formats), shared", 16, 4, 128, 64, 32, 8, true, true, false, false, true, false, 4,
     2, 1.0f, 0, true, false, {0, 0, 0}, false, {0, 0, 0}, 0, 0, 0},
    {"small: gated shared, f32 router", 8, 2, 96, 40, 24, 8, false, false, true, true, false, true, 1, 1, 1, 0,
     false, false, {0, 0, 0}, false, {0, 0, 0}, 0, 0, 0},
    {"small: clamped swiglu, odd widths", 32, 8, 100, 20, 12, 5, true, true, false, false, true, false, 1, 1, 2.5f,
     0.5f, false, false, {0, 0, 0}, false, {0, 0, 0}, 0, 0, 0},
    /* more tokens than the routing block has warps (a warp routes two in turn), exact ties */
    {"small: top-8 of 128, 12 tokens, ties", 128, 8, 256, 32, 0, 12, false, true, false, false, false, true, 1, 1,
     1, 0, false, false, {0, 0, 0}, false, {0, 0, 0}, 0, 0, 0},
    /* a hidden size past the router chunks a logits thread keeps in registers (8 x 256 x 4 columns) */
    {"small: hidden 8200", 8, 2, 8200, 16, 0, 3, false, true, false, false, false, true, 1, 1, 1, 0, false, false,
     {0, 0, 0}, false, {0, 0, 0}, 0, 0, 0},
    /* the bound: top-8 without shared experts (16 tokens small, 17 not), top-8 with (14, 15), and 33 */
    {"bound: softmax top-8 of 64", 64, 8, 128, 48, 0, 15, false, true, false, false, false, false, 1, 1, 1, 0,
     false, false, {0, 0, 0}, false, {0, 0, 0}, 0, 0, 0},
    {"bound: softmax top-8 of 64", 64, 8, 128, 48, 0, 16, false, true, false, false, false, false, 1, 1, 1, 0,
     false, false, {0, 0, 0}, false, {0, 0, 0}, 0, 0, 0},
    {"bound: softmax top-8 of 64", 64, 8, 128, 48, 0, 17, false, true, false, false, false, false, 1, 1, 1, 0,
     false, false, {0, 0, 0}, false, {0, 0, 0}, 0, 0, 0},
    {"bound: softmax top-8 of 64", 64, 8, 128, 48, 0, 33, false, true, false, false, false, false, 1, 1, 1, 0,
     false, false, {0, 0, 0}, false, {0, 0, 0}, 0, 0, 0},
    {"bound: sigmoid top-8 + shared", 32, 8, 128, 32, 32, 14, true, true, false, false, true, false, 4, 2, 2.5f, 0,
     false, false, {5, 5, 5}, false, {0, 0, 0}, 0, 0, 0},
    {"bound: sigmoid top-8 + shared", 32, 8, 128, 32, 32, 15, true, true, false, false, true, false, 4, 2, 2.5f, 0,
     false, false, {5, 5, 5}, false, {0, 0, 0}, 0, 0, 0},
    /* one format for all of an expert's matrices (gate and up in one pass): int4 g128 (W4A16's), int4 g32
     * sym, int8 per-channel asym, int8 g32 f16 scales, gate and up both int4 with different groups and scale
     * dtypes; small and general steps */
    {"int4 g128 experts", 32, 4, 256, 128, 64, 1, false, true, false, false, false, false, 1, 1, 1, 0, false, false,
     {5, 5, 5}, false, {0, 0, 0}, 0, 0, 0},
    {"int4 g128 experts", 32, 4, 256, 128, 64, 40, false, true, false, false, false, false, 1, 1, 1, 0, false, false,
     {5, 5, 5}, false, {0, 0, 0}, 0, 0, 0},
    {"int4 g32 experts", 16, 4, 128, 64, 0, 3, false, true, false, false, false, false, 1, 1, 1, 0, false, false, {1,
     1, 1}, false, {0, 0, 0}, 0, 0, 0},
    {"int8 per-channel asym experts", 16, 4, 128, 64, 32, 6, true, true, false, false, true, false, 1, 1, 1, 0,
     false, false, {2, 2, 2}, false, {0, 0, 0}, 0, 0, 0},
    {"int8 g32 f16 experts", 16, 4, 96, 48, 0, 37, false, true, false, false, false, false, 1, 1, 1, 0, false, false,
     {7, 7, 7}, false, {0, 0, 0}, 0, 0, 0},
    {"int4 gate g32 bf16, up g16 f16", 16, 4, 128, 64, 0, 4, false, true, false, false, false, false, 1, 1, 1, 0,
     false, false, {1, 3, 5}, false, {0, 0, 0}, 0, 0, 0},
    {"int4 gate g32 bf16, up g16 f16", 16, 4, 128, 64, 0, 50, false, true, false, false, false, false, 1, 1, 1, 0,
     false, false, {1, 3, 5}, false, {0, 0, 0}, 0, 0, 0},
    {"int4 odd width", 8, 2, 100, 40, 0, 9, false, true, false, false, false, false, 1, 1, 1, 0, false, false, {1, 3,
     1}, false, {0, 0, 0}, 0, 0, 0},
    /* the Qwen3-30B-A3B expert shape (hidden 2048, intermediate 768, int4 g128) with fewer experts: one
     * small-path pass covers a warp's rows; 1 token, then 3 (experts of 1, 2 and 3 tokens) */
    {"small: int4 g128 2048 x 768", 16, 8, 2048, 768, 0, 1, false, true, false, false, false, false, 1, 1, 1, 0,
     false, false, {5, 5, 5}, false, {0, 0, 0}, 0, 0, 0},
    {"small: int4 g128 2048 x 768", 16, 8, 2048, 768, 0, 3, false, true, false, false, false, false, 1, 1, 1, 0,
     false, false, {5, 5, 5}, false, {0, 0, 0}, 0, 0, 0},
    /* mixed layers: the routed experts of one kind, the shared expert of another (the small path runs each in
     * kernels of its own kind). GLM-5.3-Flash's MoE layer at its real shape (hidden 4096, intermediate 2048,
     * 288 experts top-8, one shared, sigmoid router with correction bias, scaling 2.5, SwiGLU clamped at
     * 10): int4 g32 routed, int8 per-channel shared; 14 tokens is the small path's bound (9 slots a token),
     * 16 the general path */
#define GLM5(T)                                                                                                      \
    {"glm5: int4 g32 + int8 channel shared", 288, 8, 4096, 2048, 2048, T, true, true, false, false, true, false, 1, \
     1, 2.5f, 10.0f, false, false, {1, 1, 1}, true, {8, 8, 8}, 6, CUDA_MOE_STREAM_INT4, CUDA_MOE_STREAM_INT8}
    GLM5(1), GLM5(2), GLM5(8), GLM5(14), GLM5(16),
    /* a W4A16 export that leaves the shared experts bf16, at a DeepSeek-V2-Lite-like shape (hidden 2048,
     * intermediate 1408, 64 experts top-6, two shared experts: 2816 rows, wider than the routed ones) */
#define DSV2L(T)                                                                                                     \
    {"dsv2-lite: int4 g128 + bf16 shared", 64, 6, 2048, 1408, 2816, T, true, false, false, false, true, false, 1, 1, \
     1.0f, 0, false, false, {5, 5, 5}, true, {0, 0, 0}, 8, CUDA_MOE_STREAM_INT4, CUDA_MOE_STREAM_BF16}
    DSV2L(1), DSV2L(2), DSV2L(8), DSV2L(16),
    /* the other mixes' kernels, small: int8 routed with an int4 shared expert wider than them, bf16 routed
     * with an int8 g32 f16-scaled one; and int8 throughout (the int8 kernels for a layer of one kind) */
    {"mixed: int8 routed + int4 g32 shared", 16, 4, 128, 64, 96, 5, true, true, false, false, true, false, 1, 1,
     2.5f, 0, false, false, {2, 2, 2}, true, {1, 1, 1}, 0, CUDA_MOE_STREAM_INT8, CUDA_MOE_STREAM_INT4},
    {"mixed: bf16 routed + int8 g32 shared", 16, 4, 128, 64, 48, 1, false, true, false, false, false, false, 1, 1,
     1, 0, false, false, {0, 0, 0}, true, {7, 7, 7}, 0, CUDA_MOE_STREAM_BF16, CUDA_MOE_STREAM_INT8},
    {"int8 channel sym throughout", 16, 4, 128, 64, 32, 3, true, true, false, false, true, false, 1, 1, 1, 0, false,
     false, {8, 8, 8}, false, {0, 0, 0}, 0, CUDA_MOE_STREAM_INT8, CUDA_MOE_STREAM_INT8},
#undef GLM5
#undef DSV2L
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

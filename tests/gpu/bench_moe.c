/* bench_moe.c - one MoE layer's kernels (cuda/moe.cu) at the Qwen3-30B-A3B
 * shape (128 experts, top-8, hidden 2048, expert intermediate 768), bf16
 * experts and int4 group-128 ones, or (--glm5) at GLM-5.3-Flash's (288
 * experts, top-8, hidden 4096, intermediate 2048, a shared expert; the
 * sigmoid router with correction bias, scaling 2.5, SwiGLU clamped at 10)
 * with its checkpoint's mix: int4 group-32 routed experts, an int8
 * per-channel shared one (the small path's kernels of each kind), timed with CUDA events (median of 20
 * after warm-up) at 1 .. 16384 tokens a step: the whole layer
 * (cuda_moe_forward) and the bytes of the experts the step chose over its
 * time (the decode floor's measure: only the chosen experts' weights
 * count), eager and as "graph us", a layer's share of 8 layers captured in
 * one CUDA graph (4 sets of experts in turn, as a decode step runs its
 * layers); the path it takes (small: the fused small-step kernels; gemv or
 * gemm: the general stages with the experts on the path the default
 * cuda_tuning.moe_gemm_min_rows picks); the experts stage on each general
 * path forced (the SIMT GEMVs, moe.cu; the grouped GEMM on tensor cores,
 * moe_gemm.cu) with their rates; the router's logits on tensor cores
 * (cuda_moe_router_gemm, "rgemm": compare with route, the logits plus the
 * routing kernel, whose logits are rgemm's from
 * cuda_tuning.moe_router_gemm_min_t tokens, the SIMT kernel's below); then a line each for the stages cuda_moe_forward
 * runs: eager (under "layer us") and, for steps of up to 256 tokens, the stage alone captured NL x GREP times
 * in a graph of its own (under "graph us": where the layer's graph time goes, without launch latency). Eager
 * times include each launch's host latency. Every layer in a graph has its own router and experts (copies), so
 * none is in L2 from the layer before. The
 * experts' FLOPs: 2 T S 3 F E (each of the T S token-expert assignments
 * does gate and up, F x E each, and down, E x F, at 2 FLOPs a multiply-add;
 * S = top-k here, and one more with --glm5's shared expert, of the same
 * width); the bytes: the active routed experts' and the shared expert's.
 * Random router and inputs; every expert's weights in their own
 * allocation, so L2 holds none of them across steps of 8+ experts (--glm5:
 * 4 layers of 288 experts, about 17 GB). Not a test.
 *
 *   build/tests/gpu/bench_moe [--int4 | --glm5] [T ...]   (default T: 1 8 16 32 64 256 2048 16384)
 */
#include <cuda_runtime.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "cuda/moe.h"
#include "cuda/tuning.h"
#include "model/backend.h"
#include "tests/gpu/gpu_util.h"

#define REP 20
#define NL 4   /* layers of experts (their own weights each) the graph timing cycles through */
#define GREP 2 /* times it goes through them in one graph */
#define GRAPH_STAGE_T 256 /* the stages timed one by one in graphs up to this many tokens a step */
/* the shape: Qwen3-30B-A3B's, or --glm5 GLM-5.3-Flash's */
static int NE = 128, TOPK = 8, HID = 2048, FF = 768, FS = 0; /* FS: the shared expert's width (0: none) */
/* how a matrix is stored */
enum { W_BF16, W_INT4, W_INT8 };

static void *dev(const void *h, size_t n)
{
    void *d = NULL;
    if (cudaMalloc(&d, n) != cudaSuccess) {
        fprintf(stderr, "cudaMalloc(%zu) failed\n", n);
        exit(1);
    }
    if (h) cudaMemcpy(d, h, n, cudaMemcpyHostToDevice);
    return d;
}

static int cmpf(const void *a, const void *b)
{
    float x = *(const float *)a, y = *(const float *)b;
    return (x > y) - (x < y);
}

/* The median time (us) of one stage over REP runs after 3 of warm-up, each
 * alone between two events: on an idle stream, so a launch's host latency
 * counts too (inside a decode graph it mostly does not). */
static float time_stage(cudaError_t (*f)(const struct cuda_moe_args *, cudaStream_t), const struct cuda_moe_args *a,
                        cudaStream_t st, cudaEvent_t e0, cudaEvent_t e1)
{
    float t[REP];
    for (int w = 0; w < 3; w++) f(a, st);
    for (int r = 0; r < REP; r++) {
        cudaEventRecord(e0, st);
        f(a, st);
        cudaEventRecord(e1, st);
        cudaEventSynchronize(e1);
        cudaEventElapsedTime(&t[r], e0, e1);
    }
    qsort(t, REP, sizeof *t, cmpf);
    return t[REP / 2] * 1000;
}

/* One stage's time inside a CUDA graph (us a run): NL x GREP runs of f
 * captured in one graph, each on the next layer's experts (dex), the median
 * of REP launches of the graph over the runs in it. Launch latency mostly
 * hidden, as in a decode step's graph; each run keeps the inputs the stages
 * before it left (the routing is the same whatever the experts). -1 where
 * the capture failed. */
static float graph_stage(cudaError_t (*f)(const struct cuda_moe_args *, cudaStream_t), const struct cuda_moe_args *a,
                         struct cuda_moe_expert *const *dex, void *const *routers, cudaStream_t st, cudaEvent_t e0,
                         cudaEvent_t e1)
{
    cudaGraph_t g = NULL;
    cudaGraphExec_t ge = NULL;
    float r = -1.0f;
    bool ok = cudaStreamBeginCapture(st, cudaStreamCaptureModeThreadLocal) == cudaSuccess;
    for (int i = 0; ok && i < NL * GREP; i++) {
        struct cuda_moe_args al = *a;
        al.ex = dex[i % NL], al.router = routers[i % NL];
        ok = f(&al, st) == cudaSuccess;
    }
    ok = cudaStreamEndCapture(st, &g) == cudaSuccess && ok;
    ok = ok && cudaGraphInstantiate(&ge, g, 0) == cudaSuccess;
    if (ok) {
        float t[REP];
        for (int w = 0; w < 3; w++) cudaGraphLaunch(ge, st);
        for (int i = 0; i < REP; i++) {
            cudaEventRecord(e0, st);
            cudaGraphLaunch(ge, st);
            cudaEventRecord(e1, st);
            cudaEventSynchronize(e1);
            cudaEventElapsedTime(&t[i], e0, e1);
        }
        qsort(t, REP, sizeof *t, cmpf);
        r = t[REP / 2] * 1000 / (NL * GREP);
    }
    if (ge) cudaGraphExecDestroy(ge);
    if (g) cudaGraphDestroy(g);
    cudaGetLastError(); /* a failed capture's error is reported as -1, not by the next launch */
    return r;
}

/* A [rows][cols] matrix: bf16 from pool, or int4 symmetric codes of groups of `group` columns, or int8
 * symmetric per-channel ones, and bf16 scales (codes and scales from their pools) */
static void make(int kind, int group, int rows, int cols, const uint16_t *pool, const uint8_t *codes,
                 const uint16_t *scales, struct cuda_moe_mat *m)
{
    memset(m, 0, sizeof *m);
    if (kind == W_BF16) {
        m->w = dev(pool, (size_t)rows * cols * 2);
        return;
    }
    m->bits = kind == W_INT4 ? 4 : 8;
    m->group = kind == W_INT4 ? group : cols;
    m->n_groups = cols / m->group, m->row_bytes = cols * m->bits / 8;
    m->qw = dev(codes, (size_t)rows * m->row_bytes);
    m->scales = dev(scales, (size_t)rows * m->n_groups * 2);
}

/* the bytes of a [rows][cols] matrix as make() stores it */
static double mat_bytes(int kind, int group, int rows, int cols)
{
    if (kind == W_BF16) return 2.0 * rows * cols;
    const int g = kind == W_INT4 ? group : cols;
    return (double)rows * (cols * (kind == W_INT4 ? 4 : 8) / 8 + cols / g * 2);
}

int main(int argc, char **argv)
{
    bool int4 = false, glm5 = false;
    int Ts[16], nT = 0;
    for (int i = 1; i < argc; i++) {
        if (!strcmp(argv[i], "--int4")) int4 = true;
        else if (!strcmp(argv[i], "--glm5")) glm5 = true;
        else if (atoi(argv[i]) > 0 && nT < 16) Ts[nT++] = atoi(argv[i]);
        else {
            fprintf(stderr, "usage: %s [--int4 | --glm5] [T ...]\n", argv[0]);
            return 2;
        }
    }
    /* the routed experts' storage and group, and the shared expert's */
    int rkind = int4 ? W_INT4 : W_BF16, rgroup = 128, skind = W_BF16;
    if (glm5) {
        NE = 288, TOPK = 8, HID = 4096, FF = 2048, FS = 2048;
        rkind = W_INT4, rgroup = 32, skind = W_INT8;
    }
    if (!nT) {
        static const int def[] = {1, 8, 16, 32, 64, 256, 2048, 16384}; /* 16, 32: around the paths' crossover */
        memcpy(Ts, def, sizeof def);
        nT = (int)(sizeof def / sizeof *def);
    }
    if (!model_cuda_available()) {
        printf("no GPU: skipped\n");
        return 0;
    }
    int maxT = 0;
    for (int i = 0; i < nT; i++) maxT = Ts[i] > maxT ? Ts[i] : maxT;
    const int FW = FF > FS ? FF : FS; /* the widest expert (h's row stride) */
    size_t big = (size_t)FW * HID;
    uint16_t *pool = malloc(big * 2), *scales = malloc(big / 8 * 2), *router = malloc((size_t)NE * HID * 2);
    uint8_t *codes = malloc(big);
    float *bias = malloc((size_t)NE * 4);
    for (size_t i = 0; i < big; i++) pool[i] = bf(frand() * 0.05f), codes[i] = (uint8_t)(frand() * 127 + 128);
    for (size_t i = 0; i < big / 8; i++) scales[i] = bf(0.003f * (1.0f + frand() * 0.5f));
    for (size_t i = 0; i < (size_t)NE * HID; i++) router[i] = bf(frand() * 0.1f);
    for (int e = 0; e < NE; e++) bias[e] = frand() * 0.01f;
    struct cuda_moe_expert *hex = calloc(NE + 1, sizeof *hex), *dex[NL];
    for (int l = 0; l < NL; l++) {
        for (int e = 0; e <= NE; e++) {
            const int F = e < NE ? FF : FS, k = e < NE ? rkind : skind;
            if (!F) continue;
            hex[e].F = F;
            make(k, rgroup, F, HID, pool, codes, scales, &hex[e].gate);
            make(k, rgroup, F, HID, pool, codes, scales, &hex[e].up);
            make(k, rgroup, HID, F, pool, codes, scales, &hex[e].down);
        }
        dex[l] = dev(hex, (NE + 1) * sizeof *hex);
    }
    uint16_t *x = malloc((size_t)maxT * HID * 2);
    for (size_t i = 0; i < (size_t)maxT * HID; i++) x[i] = bf(frand());
    const int S = TOPK + (FS > 0);
    struct cuda_moe_args a = {.E = HID, .NE = NE, .K = TOPK, .S = S, .Fmax = FW, .norm_topk = 1, .n_group = 1,
                              .topk_group = 1, .scale = 1.0f};
    a.packed = rkind != W_BF16 || (FS > 0 && skind != W_BF16);
    if (glm5) a.sigmoid = 1, a.scale = 2.5f, a.swiglu_limit = 10.0f, a.bias = dev(bias, (size_t)NE * 4);
    a.xn = dev(x, (size_t)maxT * HID * 2);
    void *routers[NL];
    for (int l = 0; l < NL; l++) routers[l] = dev(router, (size_t)NE * HID * 2);
    a.router = routers[0];
    a.ex = dex[0];
    a.streamed = cuda_moe_streamed(hex, NE, HID, &a.streamed_shared); /* as the backend sets them */
    a.logits = dev(NULL, (size_t)maxT * (NE + 1) * 4);
    a.idx = dev(NULL, (size_t)maxT * S * 4);
    a.wt = dev(NULL, (size_t)maxT * S * 4);
    a.count = dev(NULL, (NE + 1) * 4);
    cudaMemset(a.count, 0, (NE + 1) * 4); /* zero between steps (moe.h) */
    a.start = dev(NULL, (NE + 2) * 4);
    a.list = dev(NULL, (size_t)maxT * S * 4);
    a.act = dev(NULL, (NE + 2) * 4);
    a.h = dev(NULL, (size_t)maxT * S * FW * 2);
    a.y = dev(NULL, (size_t)maxT * S * HID * 4);
    a.out = dev(NULL, (size_t)maxT * HID * 2);
    cudaStream_t st;
    cudaStreamCreate(&st);
    cudaEvent_t e0, e1;
    cudaEventCreate(&e0), cudaEventCreate(&e1);
    /* one routed expert's bytes, the shared expert's */
    const double ebytes = 2 * mat_bytes(rkind, rgroup, FF, HID) + mat_bytes(rkind, rgroup, HID, FF);
    const double sbytes = FS ? 2 * mat_bytes(skind, rgroup, FS, HID) + mat_bytes(skind, rgroup, HID, FS) : 0.0;
    if (glm5)
        printf("MoE layer, GLM-5.3-Flash shape (%d experts top-%d + 1 shared, hidden %d, intermediate %d), int4 g32 "
               "routed experts, int8 per-channel shared (small path kernels: %d routed, %d shared)\n",
               NE, TOPK, HID, FF, a.streamed, a.streamed_shared);
    else
        printf("MoE layer, Qwen3-30B-A3B shape (%d experts top-%d, hidden %d, intermediate %d), %s experts\n", NE,
               TOPK, HID, FF, int4 ? "int4 g128" : "bf16");
    printf("%6s %8s %10s %9s %10s %9s %6s %9s %8s %9s %8s %9s\n", "tokens", "experts", "layer us", "GB/s",
           "graph us", "GB/s", "path", "gemv us", "TFLOP/s", "gemm us", "TFLOP/s", "rgemm us");
    const float min_rows = cuda_tuning.moe_gemm_min_rows, min_rows_p = cuda_tuning.moe_gemm_min_rows_packed;
    for (int i = 0; i < nT; i++) {
        a.T = Ts[i];
        /* the stages cuda_moe_forward runs for this step: the small-step kernels or the general ones (the
         * experts on the GEMVs, gate|up then down, or on the GEMM) */
        typedef cudaError_t (*stage_fn)(const struct cuda_moe_args *, cudaStream_t);
        static const stage_fn small_st[] = {cuda_moe_route_group, cuda_moe_gate_up_small, cuda_moe_down_combine};
        static const char *const small_nm[] = {"logits+route+group", "gate|up", "down+combine"};
        static const stage_fn gemv_st[] = {cuda_moe_route, cuda_moe_group, cuda_moe_gate_up, cuda_moe_down,
                                           cuda_moe_combine};
        static const char *const gemv_nm[] = {"route", "group", "gate|up", "down", "combine"};
        static const stage_fn gemm_st[] = {cuda_moe_route, cuda_moe_group, cuda_moe_gemm, cuda_moe_combine};
        static const char *const gemm_nm[] = {"route", "group", "experts (gemm)", "combine"};
        const bool small = cuda_moe_small(&a), gemm = !small && cuda_moe_gemm_takes(&a);
        const int ns = small ? 3 : gemm ? 4 : 5;
        const stage_fn *sf = small ? small_st : gemm ? gemm_st : gemv_st;
        const char *const *sn = small ? small_nm : gemm ? gemm_nm : gemv_nm;
        float layer = time_stage(cuda_moe_forward, &a, st, e0, e1), med[5], gmed[5], path[2];
        /* NL x GREP layers in one CUDA graph (as a decode step runs them): launch latency mostly hidden,
         * each layer's experts its own (not in L2 from the layer before) */
        const float graph = graph_stage(cuda_moe_forward, &a, dex, routers, st, e0, e1);
        /* each stage alone, eager and (steps of up to GRAPH_STAGE_T tokens) in a graph of its own */
        for (int s = 0; s < ns; s++) {
            med[s] = time_stage(sf[s], &a, st, e0, e1);
            gmed[s] = a.T <= GRAPH_STAGE_T ? graph_stage(sf[s], &a, dex, routers, st, e0, e1) : -1.0f;
        }
        /* the experts stage on each general path forced (on the grouping the stages above left) */
        for (int p = 0; p < 2; p++) {
            cuda_tuning.moe_gemm_min_rows = cuda_tuning.moe_gemm_min_rows_packed = p ? 0.0f : -1.0f;
            path[p] = time_stage(cuda_moe_experts, &a, st, e0, e1);
        }
        cuda_tuning.moe_gemm_min_rows = min_rows, cuda_tuning.moe_gemm_min_rows_packed = min_rows_p;
        const float rg = time_stage(cuda_moe_router_gemm, &a, st, e0, e1);
        const double flop = 2.0 * a.T * S * 3.0 * FF * HID;
        int32_t *act = malloc((size_t)(NE + 2) * 4);
        cudaMemcpy(act, a.act, (size_t)(NE + 2) * 4, cudaMemcpyDeviceToHost);
        /* the step's bytes: its active routed experts' and the shared expert's */
        const int nsh = FS > 0, nact = act[NE + 1];
        const double bytes = (nact - nsh) * ebytes + nsh * sbytes;
        cudaError_t ce = cudaGetLastError();
        free(act);
        printf("%6d %8d %10.1f %9.0f %10.1f %9.0f %6s %9.1f %8.1f %9.1f %8.1f %9.1f%s%s\n", a.T, nact, layer,
               bytes / (layer * 1e3), graph, bytes / (graph * 1e3),
               small ? "small" : gemm ? "gemm" : "gemv", path[0], flop / (path[0] * 1e6), path[1],
               flop / (path[1] * 1e6), rg, ce ? "  error: " : "", ce ? cudaGetErrorString(ce) : "");
        for (int s = 0; s < ns; s++) {
            if (gmed[s] >= 0) printf("%6s %8s %10.1f %9s %10.1f %9s   %s\n", "", "", med[s], "", gmed[s], "", sn[s]);
            else printf("%6s %8s %10.1f %9s %10s %9s   %s\n", "", "", med[s], "", "-", "", sn[s]);
        }
    }
    return 0;
}

/* bench_moe.c - one MoE layer's kernels (cuda/moe.cu) at the Qwen3-30B-A3B
 * shape (128 experts, top-8, hidden 2048, expert intermediate 768), bf16
 * experts and int4 group-128 ones, timed with CUDA events (median of 20
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
 * S = top-k here, no shared expert). Random router and inputs; every
 * expert's weights in their own allocation, so L2 holds none of them
 * across steps of 8+ experts. Not a test.
 *
 *   build/tests/gpu/bench_moe [--int4] [T ...]   (default T: 1 8 16 32 64 256 2048 16384)
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
enum { NE = 128, TOPK = 8, HID = 2048, FF = 768 }; /* the shape */
#define GROUP 128

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

/* A [rows][cols] matrix: bf16 from pool, or int4 g128 symmetric codes and bf16 scales */
static void make(bool int4, int rows, int cols, const uint16_t *pool, const uint8_t *codes, const uint16_t *scales,
                 struct cuda_moe_mat *m)
{
    memset(m, 0, sizeof *m);
    if (!int4) {
        m->w = dev(pool, (size_t)rows * cols * 2);
        return;
    }
    m->bits = 4, m->group = GROUP, m->n_groups = cols / GROUP, m->row_bytes = cols / 2;
    m->qw = dev(codes, (size_t)rows * m->row_bytes);
    m->scales = dev(scales, (size_t)rows * m->n_groups * 2);
}

int main(int argc, char **argv)
{
    bool int4 = false;
    int Ts[16], nT = 0;
    for (int i = 1; i < argc; i++) {
        if (!strcmp(argv[i], "--int4")) int4 = true;
        else if (atoi(argv[i]) > 0 && nT < 16) Ts[nT++] = atoi(argv[i]);
        else {
            fprintf(stderr, "usage: %s [--int4] [T ...]\n", argv[0]);
            return 2;
        }
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
    size_t big = (size_t)FF * HID;
    uint16_t *pool = malloc(big * 2), *scales = malloc(big / GROUP * 2), *router = malloc((size_t)NE * HID * 2);
    uint8_t *codes = malloc(big / 2);
    for (size_t i = 0; i < big; i++) pool[i] = bf(frand() * 0.05f);
    for (size_t i = 0; i < big / 2; i++) codes[i] = (uint8_t)(frand() * 127 + 128);
    for (size_t i = 0; i < big / GROUP; i++) scales[i] = bf(0.003f * (1.0f + frand() * 0.5f));
    for (size_t i = 0; i < (size_t)NE * HID; i++) router[i] = bf(frand() * 0.1f);
    struct cuda_moe_expert *hex = calloc(NE + 1, sizeof *hex), *dex[NL];
    for (int l = 0; l < NL; l++) {
        for (int e = 0; e < NE; e++) {
            hex[e].F = FF;
            make(int4, FF, HID, pool, codes, scales, &hex[e].gate);
            make(int4, FF, HID, pool, codes, scales, &hex[e].up);
            make(int4, HID, FF, pool, codes, scales, &hex[e].down);
        }
        dex[l] = dev(hex, (NE + 1) * sizeof *hex);
    }
    uint16_t *x = malloc((size_t)maxT * HID * 2);
    for (size_t i = 0; i < (size_t)maxT * HID; i++) x[i] = bf(frand());
    const int S = TOPK;
    struct cuda_moe_args a = {.E = HID, .NE = NE, .K = TOPK, .S = S, .Fmax = FF, .packed = int4, .norm_topk = 1,
                              .n_group = 1, .topk_group = 1, .scale = 1.0f};
    a.xn = dev(x, (size_t)maxT * HID * 2);
    void *routers[NL];
    for (int l = 0; l < NL; l++) routers[l] = dev(router, (size_t)NE * HID * 2);
    a.router = routers[0];
    a.ex = dex[0];
    a.streamed = cuda_moe_streamed(hex, NE, HID); /* as the backend sets it: int4 or bf16 throughout */
    a.logits = dev(NULL, (size_t)maxT * (NE + 1) * 4);
    a.idx = dev(NULL, (size_t)maxT * S * 4);
    a.wt = dev(NULL, (size_t)maxT * S * 4);
    a.count = dev(NULL, (NE + 1) * 4);
    cudaMemset(a.count, 0, (NE + 1) * 4); /* zero between steps (moe.h) */
    a.start = dev(NULL, (NE + 2) * 4);
    a.list = dev(NULL, (size_t)maxT * S * 4);
    a.act = dev(NULL, (NE + 2) * 4);
    a.h = dev(NULL, (size_t)maxT * S * FF * 2);
    a.y = dev(NULL, (size_t)maxT * S * HID * 4);
    a.out = dev(NULL, (size_t)maxT * HID * 2);
    cudaStream_t st;
    cudaStreamCreate(&st);
    cudaEvent_t e0, e1;
    cudaEventCreate(&e0), cudaEventCreate(&e1);
    const double ebytes = int4 ? 3.0 * FF * (HID / 2 + HID / GROUP * 2) : 3.0 * FF * HID * 2; /* one expert */
    printf("MoE layer, Qwen3-30B-A3B shape (%d experts top-%d, hidden %d, intermediate %d), %s experts\n", NE, TOPK, HID,
           FF, int4 ? "int4 g128" : "bf16");
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
        int32_t act[NE + 2];
        cudaMemcpy(act, a.act, sizeof act, cudaMemcpyDeviceToHost);
        cudaError_t ce = cudaGetLastError();
        printf("%6d %8d %10.1f %9.0f %10.1f %9.0f %6s %9.1f %8.1f %9.1f %8.1f %9.1f%s%s\n", a.T, act[NE + 1], layer,
               act[NE + 1] * ebytes / (layer * 1e3), graph, act[NE + 1] * ebytes / (graph * 1e3),
               small ? "small" : gemm ? "gemm" : "gemv", path[0], flop / (path[0] * 1e6), path[1],
               flop / (path[1] * 1e6), rg, ce ? "  error: " : "", ce ? cudaGetErrorString(ce) : "");
        for (int s = 0; s < ns; s++) {
            if (gmed[s] >= 0) printf("%6s %8s %10.1f %9s %10.1f %9s   %s\n", "", "", med[s], "", gmed[s], "", sn[s]);
            else printf("%6s %8s %10.1f %9s %10s %9s   %s\n", "", "", med[s], "", "-", "", sn[s]);
        }
    }
    return 0;
}

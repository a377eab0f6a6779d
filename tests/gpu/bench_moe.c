/* bench_moe.c - one MoE layer's kernels (cuda/moe.cu) at the Qwen3-30B-A3B
 * shape (128 experts, top-8, hidden 2048, expert intermediate 768), bf16
 * experts and int4 group-128 ones, timed with CUDA events (median of 20
 * after warm-up) at 1 .. 16384 tokens a step: the whole layer
 * (cuda_moe_forward) and each stage (the experts on the path the default
 * cuda_tuning.moe_gemm_min_rows picks), the experts stage on each path
 * forced (the SIMT GEMVs, moe.cu; the grouped GEMM on tensor cores,
 * moe_gemm.cu) with their rates, and the bytes of the experts the step
 * chose over the layer's time (the decode floor's measure: only the chosen
 * experts' weights count), and the router's logits on tensor cores
 * (cuda_moe_router_gemm, "rgemm": compare with route, which is the SIMT
 * logits plus the routing kernel). The experts' FLOPs: 2 T S 3 F E (each of the T S
 * token-expert assignments does gate and up, F x E each, and down, E x F,
 * at 2 FLOPs a multiply-add; S = top-k here, no shared expert). Random
 * router and inputs; every expert's weights in their own allocation, so L2
 * holds none of them across steps of 8+ experts. Not a test.
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

/* The median time (us) of fn over REP runs after 3 warm-ups. */
static float timed(cudaError_t (*fn)(const struct cuda_moe_args *, cudaStream_t), const struct cuda_moe_args *a,
                   cudaStream_t st, cudaEvent_t e0, cudaEvent_t e1)
{
    float t[REP];
    for (int w = 0; w < 3; w++) fn(a, st);
    for (int r = 0; r < REP; r++) {
        cudaEventRecord(e0, st);
        fn(a, st);
        cudaEventRecord(e1, st);
        cudaEventSynchronize(e1);
        cudaEventElapsedTime(&t[r], e0, e1);
    }
    qsort(t, REP, sizeof *t, cmpf);
    return t[REP / 2] * 1000;
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
    struct cuda_moe_expert *hex = calloc(NE + 1, sizeof *hex);
    for (int e = 0; e < NE; e++) {
        hex[e].F = FF;
        make(int4, FF, HID, pool, codes, scales, &hex[e].gate);
        make(int4, FF, HID, pool, codes, scales, &hex[e].up);
        make(int4, HID, FF, pool, codes, scales, &hex[e].down);
    }
    uint16_t *x = malloc((size_t)maxT * HID * 2);
    for (size_t i = 0; i < (size_t)maxT * HID; i++) x[i] = bf(frand());
    const int S = TOPK;
    struct cuda_moe_args a = {.E = HID, .NE = NE, .K = TOPK, .S = S, .Fmax = FF, .packed = int4, .norm_topk = 1,
                              .n_group = 1, .topk_group = 1, .scale = 1.0f};
    a.xn = dev(x, (size_t)maxT * HID * 2);
    a.router = dev(router, (size_t)NE * HID * 2);
    a.ex = dev(hex, (NE + 1) * sizeof *hex);
    a.logits = dev(NULL, (size_t)maxT * (NE + 1) * 4);
    a.idx = dev(NULL, (size_t)maxT * S * 4);
    a.wt = dev(NULL, (size_t)maxT * S * 4);
    a.count = dev(NULL, (NE + 1) * 4);
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
    printf("%6s %8s %10s %9s %9s %10s %9s %9s %8s %9s %8s %9s %8s %9s\n", "tokens", "experts", "layer us", "route",
           "group", "experts", "combine", "GB/s", "path", "gemv us", "TFLOP/s", "gemm us", "TFLOP/s", "rgemm us");
    const float min_rows = cuda_tuning.moe_gemm_min_rows, min_rows_p = cuda_tuning.moe_gemm_min_rows_packed;
    for (int i = 0; i < nT; i++) {
        a.T = Ts[i];
        cudaError_t (*const stage[5])(const struct cuda_moe_args *, cudaStream_t) = {
            cuda_moe_forward, cuda_moe_route, cuda_moe_group, cuda_moe_experts, cuda_moe_combine};
        float med[5], path[2];
        for (int s = 0; s < 5; s++) med[s] = timed(stage[s], &a, st, e0, e1);
        const int deflt = cuda_moe_gemm_takes(&a);
        for (int p = 0; p < 2; p++) {
            cuda_tuning.moe_gemm_min_rows = cuda_tuning.moe_gemm_min_rows_packed = p ? 0.0f : -1.0f;
            path[p] = timed(cuda_moe_experts, &a, st, e0, e1);
        }
        cuda_tuning.moe_gemm_min_rows = min_rows, cuda_tuning.moe_gemm_min_rows_packed = min_rows_p;
        const float rg = timed(cuda_moe_router_gemm, &a, st, e0, e1);
        const double flop = 2.0 * a.T * S * 3.0 * FF * HID;
        int32_t act[NE + 2];
        cudaMemcpy(act, a.act, sizeof act, cudaMemcpyDeviceToHost);
        cudaError_t ce = cudaGetLastError();
        printf("%6d %8d %10.1f %9.1f %9.1f %10.1f %9.1f %9.0f %8s %9.1f %8.1f %9.1f %8.1f %9.1f%s%s\n", a.T,
               act[NE + 1],
               med[0], med[1], med[2], med[3], med[4], act[NE + 1] * ebytes / (med[0] * 1e3), deflt ? "gemm" : "gemv",
               path[0], flop / (path[0] * 1e6), path[1], flop / (path[1] * 1e6), rg, ce ? "  error: " : "",
               ce ? cudaGetErrorString(ce) : "");
    }
    return 0;
}

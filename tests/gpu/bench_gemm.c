/* bench_gemm.c - the GEMM ceiling a prefill step can reach: the four cuBLAS
 * GEMMs of a Llama-3.1-8B layer at 16384 tokens (qkv, o, gate|up, down, as
 * cuda/step.c calls them), 32 layers back to back, three times, timed
 * together with CUDA events. Once with random bf16 inputs (weights and
 * activations uniform in [-1, 1)) and once with zero activations: a GPU at
 * its power cap runs the same instructions faster on zeros, so an ablation
 * that leaves a GEMM's input stale or zero measures the wrong ceiling. Also
 * one GEMM alone, median of 20 (the short-burst figure).
 * --lt adds a sweep of cuBLASLt's heuristic algorithms: for
 * each GEMM shape in turn, its k-th candidate (the others on candidate 0),
 * on random data under the same sustained load, with each candidate's tile,
 * stages, cluster shape and split-K: whether another algorithm runs faster
 * under the power cap than the one picked for short bursts.
 * --overlap adds the question whether a step split in two
 * halves on two streams would hide the memory-bound kernels under the
 * other half's GEMMs at the power cap: the chain of a layer without
 * attention (RMSNorm, qkv, o, RMSNorm, gate|up, SwiGLU, down) for 32 layers,
 * as one 16384-token stream; as two 8192-token halves one after the other;
 * and as the two halves on two streams at once, the second starting half a
 * layer later.
 * --wg adds the warpgroup GEMMs (gemm_wg.cu, sm_90 only)
 * under the same sustained load, in alternating rounds (--wg-only: only
 * gate|up alone and sustained, below): the four cuBLAS
 * GEMMs with cuda_swiglu after gate|up (what a prefill step runs); the same
 * with gate|up and SwiGLU in one warpgroup kernel; all four on the
 * warpgroup kernels; and the four plain GEMMs on them (against the cuBLAS
 * figure above). --wg-ablate=1|2|3 (benchmarks only, wrong outputs;
 * cuda_tuning.gemm_wg_ablate): the warpgroup GEMM without its epilogue, 1,
 * without the loads after the first stages, 2, or both, 3. Not a test.
 *
 *   build/tests/gpu/bench_gemm [--lt] [--overlap] [--wg | --wg-only] [--wg-ablate=N] */
#include <cublasLt.h>
#include <cublas_v2.h>
#include <cuda_runtime.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "cuda/kernels.h"
#include "cuda/tuning.h"

static int g_wg; /* 1: --wg, 2: --wg-only */

/* n bf16 uniform in [-1, 1) at device p (through a host buffer) */
static void fill(uint16_t *p, size_t n, uint32_t seed)
{
    uint16_t *h = malloc(n * 2);
    uint64_t s = seed * 0x9E3779B97F4A7C15ull + 1;
    for (size_t i = 0; i < n; i++) {
        s = s * 6364136223846793005ull + 1442695040888963407ull;
        union { float f; uint32_t u; } v = {.f = (float)(s >> 40) / 8388608.0f - 1.0f};
        h[i] = (uint16_t)(v.u >> 16);
    }
    cudaMemcpy(p, h, n * 2, cudaMemcpyHostToDevice);
    free(h);
}

static void *dalloc(size_t n)
{
    void *p = NULL;
    if (cudaMalloc(&p, n) != cudaSuccess) {
        fprintf(stderr, "cudaMalloc %zu failed\n", n);
        exit(1);
    }
    return p;
}

enum { NALG = 12 };
struct lt_shape {
    cublasLtMatmulDesc_t op;
    cublasLtMatrixLayout_t a, b, c;
    cublasLtMatmulHeuristicResult_t res[NALG];
    int n;
};

static void lt_setup(cublasLtHandle_t lt, struct lt_shape *s, int T, int in, int out, size_t ws)
{
    cublasOperation_t ta = CUBLAS_OP_T, tb = CUBLAS_OP_N;
    cublasLtMatmulDescCreate(&s->op, CUBLAS_COMPUTE_32F, CUDA_R_32F);
    cublasLtMatmulDescSetAttribute(s->op, CUBLASLT_MATMUL_DESC_TRANSA, &ta, sizeof ta);
    cublasLtMatmulDescSetAttribute(s->op, CUBLASLT_MATMUL_DESC_TRANSB, &tb, sizeof tb);
    cublasLtMatrixLayoutCreate(&s->a, CUDA_R_16BF, in, out, in);
    cublasLtMatrixLayoutCreate(&s->b, CUDA_R_16BF, in, T, in);
    cublasLtMatrixLayoutCreate(&s->c, CUDA_R_16BF, out, T, out);
    cublasLtMatmulPreference_t pref;
    cublasLtMatmulPreferenceCreate(&pref);
    cublasLtMatmulPreferenceSetAttribute(pref, CUBLASLT_MATMUL_PREF_MAX_WORKSPACE_BYTES, &ws, sizeof ws);
    s->n = 0;
    cublasLtMatmulAlgoGetHeuristic(lt, s->op, s->a, s->b, s->c, s->c, pref, NALG, s->res, &s->n);
    cublasLtMatmulPreferenceDestroy(pref);
}

static void lt_describe(const cublasLtMatmulAlgo_t *a, char *buf, size_t n)
{
    int id = 0, tile = 0, stages = 0, splitk = 0;
    uint16_t cluster = 0;
    cublasLtMatmulAlgoConfigGetAttribute(a, CUBLASLT_ALGO_CONFIG_ID, &id, sizeof id, NULL);
    cublasLtMatmulAlgoConfigGetAttribute(a, CUBLASLT_ALGO_CONFIG_TILE_ID, &tile, sizeof tile, NULL);
    cublasLtMatmulAlgoConfigGetAttribute(a, CUBLASLT_ALGO_CONFIG_STAGES_ID, &stages, sizeof stages, NULL);
    cublasLtMatmulAlgoConfigGetAttribute(a, CUBLASLT_ALGO_CONFIG_SPLITK_NUM, &splitk, sizeof splitk, NULL);
    cublasLtMatmulAlgoConfigGetAttribute(a, CUBLASLT_ALGO_CONFIG_CLUSTER_SHAPE_ID, &cluster, sizeof cluster, NULL);
    snprintf(buf, n, "algo %d tile %d stages %d cluster %u splitK %d", id, tile, stages, cluster, splitk);
}

/* the sustained loop of main(), shape i on its candidate k, the others on 0 */
static void lt_sweep(const uint16_t *const *w, const uint16_t *x, uint16_t *y, const int (*g)[2], int T, int L,
                     double flop)
{
    cublasLtHandle_t lt;
    if (cublasLtCreate(&lt) != CUBLAS_STATUS_SUCCESS) return;
    size_t wsz = 64u << 20;
    void *ws = NULL;
    cudaMalloc(&ws, wsz);
    struct lt_shape s[4];
    for (int i = 0; i < 4; i++) lt_setup(lt, &s[i], T, g[i][0], g[i][1], wsz);
    const float one = 1, zero = 0;
    cudaEvent_t e0, e1;
    cudaEventCreate(&e0), cudaEventCreate(&e1);
    for (int i = -1; i < 4; i++)
        for (int k = i < 0 ? 0 : 1; k < (i < 0 ? 1 : s[i].n); k++) {
            float ms = 0;
            cublasStatus_t st = CUBLAS_STATUS_SUCCESS;
            for (int warm = 0; warm < 2; warm++) {
                cudaEventRecord(e0, 0);
                for (int r = 0; r < (warm ? 3 : 1); r++)
                    for (int l = 0; l < L; l++)
                        for (int j = 0; j < 4; j++) {
                            const cublasLtMatmulAlgo_t *al = &s[j].res[j == i ? k : 0].algo;
                            cublasStatus_t e = cublasLtMatmul(lt, s[j].op, &one, w[j], s[j].a, x, s[j].b, &zero, y,
                                                              s[j].c, y, s[j].c, al, ws, wsz, 0);
                            if (e != CUBLAS_STATUS_SUCCESS) st = e;
                        }
                cudaEventRecord(e1, 0);
                cudaEventSynchronize(e1);
                cudaEventElapsedTime(&ms, e0, e1);
            }
            char d[128];
            lt_describe(&s[i < 0 ? 0 : i].res[k].algo, d, sizeof d);
            printf("lt shape %d (%d x %d) candidate %d/%d [%s]: %.1f ms per 32 layers, %.0f TFLOP/s%s\n", i,
                   i < 0 ? 0 : g[i][0], i < 0 ? 0 : g[i][1], k, i < 0 ? s[0].n : s[i].n, i < 0 ? "all first" : d,
                   ms / 3, 3 * L * flop / (ms * 1e-3) / 1e12, st ? " (a launch failed)" : "");
        }
    for (int i = 0; i < 4; i++) {
        char d[128];
        lt_describe(&s[i].res[0].algo, d, sizeof d);
        printf("lt shape %d first candidate: [%s]\n", i, d);
    }
    cudaFree(ws);
    cublasLtDestroy(lt);
}

/* one stream's buffers and cuBLAS handle for the layer chain of T tokens */
struct chain {
    cublasHandle_t h;
    cudaStream_t st;
    float *x;                       /* [T][E] residual */
    uint16_t *xn, *qkv, *att, *gu, *hh, *delta;
    float *nw;
    int T;
};

static void chain_init(struct chain *c, int T, int E, int F, int QKV)
{
    c->T = T;
    cublasCreate(&c->h);
    cudaStreamCreateWithFlags(&c->st, cudaStreamNonBlocking);
    cublasSetStream(c->h, c->st);
    c->x = dalloc((size_t)T * E * 4), c->nw = dalloc((size_t)E * 4);
    c->xn = dalloc((size_t)T * E * 2), c->qkv = dalloc((size_t)T * QKV * 2), c->att = dalloc((size_t)T * E * 2);
    c->gu = dalloc((size_t)T * 2 * F * 2), c->hh = dalloc((size_t)T * F * 2), c->delta = dalloc((size_t)T * E * 2);
    fill(c->xn, (size_t)T * E, 5u), fill(c->att, (size_t)T * E, 6u), fill(c->hh, (size_t)T * F, 7u);
    fill(c->delta, (size_t)T * E, 8u);
    cudaMemset(c->x, 0, (size_t)T * E * 4);
    float *one = malloc((size_t)E * 4);
    for (int i = 0; i < E; i++) one[i] = 1.0f;
    cudaMemcpy(c->nw, one, (size_t)E * 4, cudaMemcpyHostToDevice);
    free(one);
}

/* y = bf16(x W^T) by cuBLAS, as cuda/step.c calls it: W [out][in], x [T][in] */
static void blas_gemm(cublasHandle_t h, const uint16_t *w, const uint16_t *x, uint16_t *y, int T, int in, int out)
{
    const float one = 1, zero = 0;
    cublasGemmEx(h, CUBLAS_OP_T, CUBLAS_OP_N, out, T, in, &one, w, CUDA_R_16BF, in, x, CUDA_R_16BF, in, &zero, y,
                 CUDA_R_16BF, out, CUBLAS_COMPUTE_32F, CUBLAS_GEMM_DEFAULT);
}

static void gemm_on(struct chain *c, const uint16_t *w, const uint16_t *x, uint16_t *y, int in, int out)
{
    blas_gemm(c->h, w, x, y, c->T, in, out);
}

/* half (0: the attention half, 1: the MLP half) of one layer of the chain */
static void chain_half(struct chain *c, uint16_t *const *w, int half, int E, int F, int QKV)
{
    if (half == 0) {
        cuda_add_rmsnorm(c->x, c->delta, c->nw, NULL, c->T, E, 1e-5f, c->xn, c->st);
        gemm_on(c, w[0], c->xn, c->qkv, E, QKV);
        gemm_on(c, w[1], c->att, c->delta, E, E);
    } else {
        cuda_add_rmsnorm(c->x, c->delta, c->nw, NULL, c->T, E, 1e-5f, c->xn, c->st);
        gemm_on(c, w[2], c->xn, c->gu, E, 2 * F);
        cuda_swiglu(c->gu, c->T, F, c->hh, c->st);
        gemm_on(c, w[3], c->hh, c->delta, F, E);
    }
}

/* ms per 32 layers (median of 3 after a warm-up) of: mode 0, chain a
 * alone; 1, a then b on a's stream order (b after a, layer by layer);
 * 2, a and b on their streams at once, b half a layer behind */
static float chain_time(struct chain *a, struct chain *b, uint16_t *const *w, int mode, int L, int E, int F, int QKV)
{
    cudaEvent_t e0, e1, go, *ev = malloc(sizeof *ev * 2 * L);
    cudaEventCreate(&e0), cudaEventCreate(&e1), cudaEventCreate(&go);
    for (int i = 0; i < 2 * L; i++) cudaEventCreateWithFlags(&ev[i], cudaEventDisableTiming);
    float t[4];
    for (int r = 0; r < 4; r++) {
        cudaDeviceSynchronize();
        cudaEventRecord(e0, a->st);
        if (mode == 2) cudaStreamWaitEvent(b->st, e0, 0);
        for (int l = 0; l < L; l++)
            for (int hf = 0; hf < 2; hf++) {
                chain_half(a, w, hf, E, F, QKV);
                if (mode == 1) {
                    chain_half(b, w, hf, E, F, QKV); /* on a's stream (overlap() sets it): after a's half */
                } else if (mode == 2) {
                    /* b's half hf of layer l once a has issued half hf + 1 */
                    cudaEventRecord(ev[2 * l + hf], a->st);
                }
                if (mode == 2 && (l > 0 || hf > 0)) {
                    int k = 2 * l + hf - 1;
                    cudaStreamWaitEvent(b->st, ev[k], 0);
                    chain_half(b, w, k & 1, E, F, QKV);
                }
            }
        if (mode == 2) {
            cudaStreamWaitEvent(b->st, ev[2 * L - 1], 0);
            chain_half(b, w, 1, E, F, QKV);
            cudaEventRecord(go, b->st);
            cudaStreamWaitEvent(a->st, go, 0);
        }
        cudaEventRecord(e1, a->st);
        cudaEventSynchronize(e1);
        cudaEventElapsedTime(&t[r], e0, e1);
    }
    for (int i = 0; i < 2 * L; i++) cudaEventDestroy(ev[i]);
    cudaEventDestroy(e0), cudaEventDestroy(e1), cudaEventDestroy(go), free(ev);
    float x = t[1], y = t[2], z = t[3]; /* the median of the three after the warm-up */
    return x > y ? (y > z ? y : x > z ? z : x) : (x > z ? x : y > z ? z : y);
}

static void overlap(uint16_t *const *w, int T, int E, int F, int QKV, int L)
{
    struct chain full, ha, hb;
    chain_init(&full, T, E, F, QKV), chain_init(&ha, T / 2, E, F, QKV), chain_init(&hb, T / 2, E, F, QKV);
    /* "in turn": b's handle and kernels on a's stream for mode 1 */
    for (int r = 0; r < 2; r++) {
        float one = chain_time(&full, NULL, w, 0, L, E, F, QKV);
        cublasSetStream(hb.h, ha.st), hb.st = ha.st;
        float seq = chain_time(&ha, &hb, w, 1, L, E, F, QKV);
        cudaStreamCreateWithFlags(&hb.st, cudaStreamNonBlocking), cublasSetStream(hb.h, hb.st);
        float two = chain_time(&ha, &hb, w, 2, L, E, F, QKV);
        printf("overlap, layer chain without attention, %d tokens x 32 layers: one stream %.1f ms; two halves in "
               "turn %.1f ms; two halves on two streams %.1f ms\n", T, one, seq, two);
    }
}

/* ms per 32 layers (3 rounds after a warm-up) of mode 0: cuBLAS x 4 +
 * cuda_swiglu; 1: cuBLAS qkv, o, down + cuda_gemm_wg_swiglu; 2: the
 * warpgroup kernels for all four, SwiGLU fused; 3: the four plain GEMMs on
 * the warpgroup kernel */
static float wg_chain(cublasHandle_t h, uint16_t *const *w, const uint16_t *x, uint16_t *y, uint16_t *hb, int mode,
                      int T, int L, const int (*g)[2], int F)
{
    cudaEvent_t e0, e1;
    cudaEventCreate(&e0), cudaEventCreate(&e1);
    float ms = 0;
    int bad = 0;
    for (int warm = 0; warm < 2; warm++) {
        cudaEventRecord(e0, 0);
        for (int r = 0; r < (warm ? 3 : 1); r++)
            for (int l = 0; l < L; l++)
                for (int i = 0; i < 4; i++) {
                    int in = g[i][0], out = g[i][1];
                    if (i == 2 && (mode == 1 || mode == 2)) {
                        bad |= cuda_gemm_wg_swiglu(w[i], x, hb, T, in, F, 0) != cudaSuccess;
                    } else if (mode >= 2) {
                        bad |= cuda_gemm_wg(w[i], x, y, T, in, out, 0) != cudaSuccess;
                    } else {
                        blas_gemm(h, w[i], x, y, T, in, out);
                        if (i == 2) bad |= cuda_swiglu(y, T, F, hb, 0) != cudaSuccess;
                    }
                }
        cudaEventRecord(e1, 0);
        cudaEventSynchronize(e1);
        cudaEventElapsedTime(&ms, e0, e1);
    }
    cudaEventDestroy(e0), cudaEventDestroy(e1);
    return bad ? -1 : ms / 3;
}

/* one gate|up GEMM (in -> 2F): k 0 cuBLAS into y, 1 the plain warpgroup
 * kernel into y, 2 the warpgroup kernel with SwiGLU into hb */
static void gu_launch(cublasHandle_t h, int k, const uint16_t *w, const uint16_t *x, uint16_t *y, uint16_t *hb, int T,
                      int in, int F)
{
    if (k == 0)
        blas_gemm(h, w, x, y, T, in, 2 * F);
    else if (k == 1)
        cuda_gemm_wg(w, x, y, T, in, 2 * F, 0);
    else
        cuda_gemm_wg_swiglu(w, x, hb, T, in, F, 0);
}

static void wg_compare(cublasHandle_t h, uint16_t *const *w, const uint16_t *x, uint16_t *y, int T, int L,
                       const int (*g)[2], double flop)
{
    static const char *const name[] = {"cuBLAS x4 + swiglu kernel", "cuBLAS x3 + wg gate|up+SwiGLU",
                                       "wg x4, SwiGLU fused", "wg x4 plain"};
    int F = g[2][1] / 2;
    cuda_gemm_wg_prepare();
    if (!cuda_gemm_wg_ok(T, g[0][0], g[0][1])) {
        printf("wg: no sm_90 device, skipped\n");
        return;
    }
    uint16_t *hb = dalloc((size_t)T * F * 2);
    for (int round = 0; round < 2 && g_wg != 2; round++)
        for (int mode = 0; mode < 4; mode++) {
            float ms = wg_chain(h, w, x, y, hb, mode, T, L, g, F);
            printf("wg round %d, %s: %.1f ms per 32 layers, %.0f TFLOP/s\n", round, name[mode], ms,
                   L * flop / (ms * 1e-3) / 1e12);
        }
    /* gate|up alone, best of 20, then sustained (64 back to back after as
     * many to warm up, twice): cuBLAS, the plain warpgroup kernel, fused */
    static const char *const gu_name[] = {"cuBLAS", "wg plain", "wg + SwiGLU"};
    const double gu_flop = 2.0 * T * g[2][0] * g[2][1];
    cudaEvent_t e0, e1;
    cudaEventCreate(&e0), cudaEventCreate(&e1);
    for (int k = 0; k < 3; k++) {
        float best = 1e9f;
        for (int r = 0; r < 20; r++) {
            cudaEventRecord(e0, 0);
            gu_launch(h, k, w[2], x, y, hb, T, g[2][0], F);
            cudaEventRecord(e1, 0);
            cudaEventSynchronize(e1);
            float ms = 0;
            cudaEventElapsedTime(&ms, e0, e1);
            best = ms < best ? ms : best;
        }
        printf("wg gate|up alone (%s): best of 20 %.3f ms, %.0f TFLOP/s\n", gu_name[k], best,
               gu_flop / (best * 1e-3) / 1e12);
    }
    for (int k = 0; k < 3; k++)
        for (int r = 0; r < 3; r++) {
            if (r > 0) cudaEventRecord(e0, 0);
            for (int i = 0; i < 64; i++) gu_launch(h, k, w[2], x, y, hb, T, g[2][0], F);
            if (r == 0) continue;
            cudaEventRecord(e1, 0);
            cudaEventSynchronize(e1);
            float ms = 0;
            cudaEventElapsedTime(&ms, e0, e1);
            printf("wg gate|up sustained (%s): %.3f ms each, %.0f TFLOP/s\n", gu_name[k], ms / 64,
                   gu_flop * 64 / (ms * 1e-3) / 1e12);
        }
    cudaEventDestroy(e0), cudaEventDestroy(e1);
    cudaFree(hb);
}

int main(int argc, char **argv)
{
    bool lt = false, ov = false;
    for (int i = 1; i < argc; i++) {
        const char *a = argv[i];
        if (!strcmp(a, "--lt")) lt = true;
        else if (!strcmp(a, "--overlap")) ov = true;
        else if (!strcmp(a, "--wg")) g_wg = 1;
        else if (!strcmp(a, "--wg-only")) g_wg = 2;
        else if (!strncmp(a, "--wg-ablate=", 12) && atoi(a + 12) >= 1 && atoi(a + 12) <= 3)
            cuda_tuning.gemm_wg_ablate = atoi(a + 12);
        else {
            fprintf(stderr, "usage: %s [--lt] [--overlap] [--wg | --wg-only] [--wg-ablate=1|2|3]\n", argv[0]);
            return 2;
        }
    }
    const int T = 16384, E = 4096, F = 14336, QKV = 6144, L = 32;
    struct { int in, out; } g[] = {{E, QKV}, {E, E}, {E, 2 * F}, {F, E}};
    cublasHandle_t h;
    if (cublasCreate(&h) != CUBLAS_STATUS_SUCCESS) {
        printf("no GPU: skipped\n");
        return 0;
    }
    uint16_t *w[4], *x = dalloc((size_t)T * F * 2), *y = dalloc((size_t)T * 2 * F * 2);
    double flop = 0;
    for (int i = 0; i < 4; i++) {
        w[i] = dalloc((size_t)g[i].in * g[i].out * 2);
        fill(w[i], (size_t)g[i].in * g[i].out, 17u * (i + 1));
        flop += 2.0 * T * g[i].in * g[i].out;
    }
    cudaEvent_t e0, e1;
    cudaEventCreate(&e0), cudaEventCreate(&e1);
    for (int data = 0; data < 2 && g_wg != 2; data++) {
        if (data == 0)
            fill(x, (size_t)T * F, 99u);
        else
            cudaMemset(x, 0, (size_t)T * F * 2);
        for (int warm = 0; warm < 2; warm++) {
            cudaEventRecord(e0, 0);
            for (int r = 0; r < (warm ? 3 : 1); r++)
                for (int l = 0; l < L; l++)
                    for (int i = 0; i < 4; i++)
                        blas_gemm(h, w[i], x, y, T, g[i].in, g[i].out);
            cudaEventRecord(e1, 0);
            cudaEventSynchronize(e1);
            float ms = 0;
            cudaEventElapsedTime(&ms, e0, e1);
            if (warm)
                printf("sustained, %s activations: 3 x 32 layers x 4 GEMMs (16384 tokens): %.1f ms per 32 layers, "
                       "%.0f TFLOP/s\n", data ? "zero" : "random", ms / 3, 3 * L * flop / (ms * 1e-3) / 1e12);
        }
        /* the gate|up GEMM alone after a pause: the short-burst figure */
        cudaDeviceSynchronize();
        float t[20];
        for (int r = 0; r < 20; r++) {
            cudaEventRecord(e0, 0);
            blas_gemm(h, w[2], x, y, T, g[2].in, g[2].out);
            cudaEventRecord(e1, 0);
            cudaEventSynchronize(e1);
            cudaEventElapsedTime(&t[r], e0, e1);
        }
        float best = t[0];
        for (int r = 1; r < 20; r++) best = t[r] < best ? t[r] : best;
        printf("gate|up alone, %s activations: best of 20 %.3f ms, %.0f TFLOP/s\n", data ? "zero" : "random", best,
               2.0 * T * g[2].in * g[2].out / (best * 1e-3) / 1e12);
    }
    if (ov) overlap(w, T, E, F, QKV, L);
    if (g_wg) {
        fill(x, (size_t)T * F, 99u);
        int gi[4][2];
        for (int i = 0; i < 4; i++) gi[i][0] = g[i].in, gi[i][1] = g[i].out;
        wg_compare(h, w, x, y, T, L, (const int (*)[2])gi, flop);
    }
    if (lt) {
        fill(x, (size_t)T * F, 99u);
        int gi[4][2];
        for (int i = 0; i < 4; i++) gi[i][0] = g[i].in, gi[i][1] = g[i].out;
        lt_sweep((const uint16_t *const *)w, x, y, (const int (*)[2])gi, T, L, flop);
    }
    cudaError_t e = cudaGetLastError();
    if (e != cudaSuccess) printf("error: %s\n", cudaGetErrorString(e));
    return 0;
}

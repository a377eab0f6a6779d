/* bench_gemm.c - the GEMM ceiling a prefill step can reach: the four cuBLAS
 * GEMMs of a Llama-3.1-8B layer at 16384 tokens (qkv, o, gate|up, down, as
 * cuda_backend.c calls them), 32 layers back to back, three times, timed
 * together with CUDA events. Once with random bf16 inputs (weights and
 * activations uniform in [-1, 1)) and once with zero activations: a GPU at
 * its power cap runs the same instructions faster on zeros, so an ablation
 * that leaves a GEMM's input stale or zero measures the wrong ceiling. Also
 * one GEMM alone, median of 20 (the short-burst figure).
 * SLUICE_BENCH_LT=1 adds a sweep of cuBLASLt's heuristic algorithms: for
 * each GEMM shape in turn, its k-th candidate (the others on candidate 0),
 * on random data under the same sustained load, with each candidate's tile,
 * stages, cluster shape and split-K: whether another algorithm runs faster
 * under the power cap than the one picked for short bursts. Not a test. */
#include <cublasLt.h>
#include <cublas_v2.h>
#include <cuda_runtime.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>

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

int main(void)
{
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
    const float one = 1, zero = 0;
    cudaEvent_t e0, e1;
    cudaEventCreate(&e0), cudaEventCreate(&e1);
    for (int data = 0; data < 2; data++) {
        if (data == 0)
            fill(x, (size_t)T * F, 99u);
        else
            cudaMemset(x, 0, (size_t)T * F * 2);
        for (int warm = 0; warm < 2; warm++) {
            cudaEventRecord(e0, 0);
            for (int r = 0; r < (warm ? 3 : 1); r++)
                for (int l = 0; l < L; l++)
                    for (int i = 0; i < 4; i++)
                        cublasGemmEx(h, CUBLAS_OP_T, CUBLAS_OP_N, g[i].out, T, g[i].in, &one, w[i], CUDA_R_16BF,
                                     g[i].in, x, CUDA_R_16BF, g[i].in, &zero, y, CUDA_R_16BF, g[i].out,
                                     CUBLAS_COMPUTE_32F, CUBLAS_GEMM_DEFAULT);
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
            cublasGemmEx(h, CUBLAS_OP_T, CUBLAS_OP_N, g[2].out, T, g[2].in, &one, w[2], CUDA_R_16BF, g[2].in, x,
                         CUDA_R_16BF, g[2].in, &zero, y, CUDA_R_16BF, g[2].out, CUBLAS_COMPUTE_32F,
                         CUBLAS_GEMM_DEFAULT);
            cudaEventRecord(e1, 0);
            cudaEventSynchronize(e1);
            cudaEventElapsedTime(&t[r], e0, e1);
        }
        float best = t[0];
        for (int r = 1; r < 20; r++) best = t[r] < best ? t[r] : best;
        printf("gate|up alone, %s activations: best of 20 %.3f ms, %.0f TFLOP/s\n", data ? "zero" : "random", best,
               2.0 * T * g[2].in * g[2].out / (best * 1e-3) / 1e12);
    }
    const char *lt = getenv("SLUICE_BENCH_LT");
    if (lt && *lt == '1') {
        fill(x, (size_t)T * F, 99u);
        int gi[4][2];
        for (int i = 0; i < 4; i++) gi[i][0] = g[i].in, gi[i][1] = g[i].out;
        lt_sweep((const uint16_t *const *)w, x, y, (const int (*)[2])gi, T, L, flop);
    }
    cudaError_t e = cudaGetLastError();
    if (e != cudaSuccess) printf("error: %s\n", cudaGetErrorString(e));
    return 0;
}

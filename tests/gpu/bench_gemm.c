/* bench_gemm.c - the GEMM ceiling a prefill step can reach: the four cuBLAS
 * GEMMs of a Llama-3.1-8B layer at 16384 tokens (qkv, o, gate|up, down, as
 * cuda_backend.c calls them), 32 layers back to back, three times, timed
 * together with CUDA events. Once with random bf16 inputs (weights and
 * activations uniform in [-1, 1)) and once with zero activations: a GPU at
 * its power cap runs the same instructions faster on zeros, so an ablation
 * that leaves a GEMM's input stale or zero measures the wrong ceiling. Also
 * one GEMM alone, median of 20 (the short-burst figure). Not a test. */
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
    cudaError_t e = cudaGetLastError();
    if (e != cudaSuccess) printf("error: %s\n", cudaGetErrorString(e));
    return 0;
}

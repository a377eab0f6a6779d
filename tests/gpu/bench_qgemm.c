/* bench_qgemm.c - the packed int4/int8 GEMMs (cuda/qgemm.cu) alone at the
 * Llama-3.1-8B projection shapes: each kernel's time (CUDA events, median
 * of 50 launches after warm-up; weights rotate over copies so that L2 never
 * holds them) and the bytes it reads per second (codes, scales, zero
 * points), beside the bf16 GEMV (cuda_gemv) on the same shape. Then the
 * crossover of the packed kernel (cuda_qgemm up to CUDA_QGEMV_MMA_MAX_T
 * rows) with the dequantize + cuBLAS path (bf16 tiles of ws.deq, each through
 * cublasGemmEx, as cuda_qgemm runs it above that) at 8-64 rows, and the bf16
 * cuBLAS GEMM for scale: the row count where the second wins is where
 * CUDA_QGEMV_MMA_MAX_T belongs. Not a test.
 *
 *   build/tests/gpu/bench_qgemm
 */
#include <cublas_v2.h>
#include <cuda_runtime.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "cuda/kernels.h"
#include "cuda/qgemm.h"

#define REP 50
#define COPIES 6 /* 6 x the largest weight (118 MB at int4) > L2 */

static int cmpf(const void *a, const void *b)
{
    float x = *(const float *)a, y = *(const float *)b;
    return (x > y) - (x < y);
}

static void *dalloc(size_t n, int fill)
{
    void *p;
    if (cudaMalloc(&p, n) != cudaSuccess) {
        printf("cudaMalloc %zu failed\n", n);
        exit(1);
    }
    cudaMemset(p, fill, n);
    return p;
}

static cudaEvent_t e0, e1;

/* median us of one call of f(i) (i: the call's weight copy) */
#define TIME_US(out, stmt)                                                                         \
    do {                                                                                           \
        float t_[REP];                                                                             \
        for (int i = 0; i < 3; i++) { stmt; }                                                      \
        for (int r = 0; r < REP; r++) {                                                            \
            int i = r % COPIES;                                                                    \
            cudaEventRecord(e0, 0);                                                                \
            stmt;                                                                                  \
            cudaEventRecord(e1, 0);                                                                \
            cudaEventSynchronize(e1);                                                              \
            cudaEventElapsedTime(&t_[r], e0, e1);                                                  \
            (void)i;                                                                               \
        }                                                                                          \
        qsort(t_, REP, sizeof(float), cmpf);                                                       \
        out = t_[REP / 2] * 1000;                                                                  \
    } while (0)

int main(void)
{
    int n = 0;
    if (cudaGetDeviceCount(&n) != cudaSuccess || n == 0) {
        printf("no GPU\n");
        return 0;
    }
    cudaEventCreate(&e0), cudaEventCreate(&e1);
    cublasHandle_t blas;
    cublasCreate(&blas);
    static const struct { const char *name; int rows, cols; } shapes[] = {
        {"qkv 6144 x 4096", 6144, 4096},
        {"o 4096 x 4096", 4096, 4096},
        {"gate|up 28672 x 4096", 28672, 4096},
        {"down 4096 x 14336", 4096, 14336},
    };
    static const struct { int bits, group; } fmts[] = {{4, 128}, {8, 0}, {4, 32}};
    static const int Ts[] = {1, 4, 16, 64};
    uint16_t *x = dalloc((size_t)64 * 14336 * 2, 0x3c), *y = dalloc((size_t)64 * 28672 * 4, 0);
    uint16_t *gu = dalloc((size_t)64 * 28672 * 2, 0);
    struct cuda_qgemm_ws ws = {.xperm = dalloc((size_t)64 * 14336 * 2, 0), .xperm_elems = (size_t)64 * 14336};
    ws.deq_bytes = (size_t)64 << 20;
    ws.deq = dalloc(ws.deq_bytes, 0);
    printf("%-24s %-10s %4s %10s %9s   %10s %9s\n", "shape", "format", "T", "packed us", "GB/s", "bf16 us", "GB/s");
    for (size_t si = 0; si < sizeof shapes / sizeof shapes[0]; si++) {
        int R = shapes[si].rows, K = shapes[si].cols;
        size_t wbf = (size_t)R * K * 2;
        uint16_t *wb[COPIES];
        for (int c = 0; c < COPIES; c++) wb[c] = dalloc(wbf, 0x3c);
        for (size_t fi = 0; fi < sizeof fmts / sizeof fmts[0]; fi++) {
            int bits = fmts[fi].bits, group = fmts[fi].group ? fmts[fi].group : K, ng = (K + group - 1) / group;
            int rb = ((K * bits + 7) / 8 + 15) / 16 * 16;
            struct cuda_qmat q[COPIES];
            size_t qbytes = (size_t)R * rb + (size_t)R * ng * 2;
            for (int c = 0; c < COPIES; c++) {
                q[c] = (struct cuda_qmat){.bits = bits, .rows = R, .cols = K, .group = group, .n_groups = ng,
                                          .row_bytes = rb, .f16 = false};
                q[c].qw = dalloc((size_t)R * rb, 0x5a);
                q[c].scales = dalloc((size_t)R * ng * 2, 0x3c);
            }
            char fmt[24];
            snprintf(fmt, sizeof fmt, fmts[fi].group ? "int%d g%d" : "int%d ch", bits, fmts[fi].group);
            for (size_t ti = 0; ti < sizeof Ts / sizeof Ts[0]; ti++) {
                int T = Ts[ti];
                float us = 0, ub = 0;
                TIME_US(us, cuda_qgemm(&q[i], x, y, false, R, T, &ws, blas, 0));
                if (T <= 8) TIME_US(ub, cuda_gemv(wb[i], x, y, false, T, K, R, 0));
                printf("%-24s %-10s %4d %10.1f %9.0f", shapes[si].name, fmt, T, us, qbytes / (us * 1e3));
                if (T <= 8) printf("   %10.1f %9.0f", ub, wbf / (ub * 1e3));
                printf("\n");
                if (si == 2 && T <= CUDA_QGEMM_SWIGLU_MAX_T) {
                    TIME_US(us, cuda_qgemm_swiglu(&q[i], x, gu, y, T, &ws, blas, 0));
                    printf("%-24s %-10s %4d %10.1f %9.0f   (+ SwiGLU as run)\n", shapes[si].name, fmt, T, us,
                           qbytes / (us * 1e3));
                }
            }
            for (int c = 0; c < COPIES; c++) cudaFree((void *)q[c].qw), cudaFree((void *)q[c].scales);
        }
        for (int c = 0; c < COPIES; c++) cudaFree(wb[c]);
        cudaError_t e = cudaGetLastError();
        if (e != cudaSuccess) printf("  error: %s\n", cudaGetErrorString(e));
    }
    /* the crossover: int4 g128 and int8 at the shapes above, 8-64 rows */
    static const int Tx[] = {8, 16, 24, 32, 48, 64};
    printf("\ncrossover (us)           %-10s %4s %10s %10s %10s  faster\n", "format", "T", "packed", "deq+cuBLAS",
           "bf16 GEMM");
    const float one = 1.0f, zero = 0.0f;
    for (size_t si = 0; si < sizeof shapes / sizeof shapes[0]; si++) {
        int R = shapes[si].rows, K = shapes[si].cols;
        uint16_t *wb[COPIES];
        for (int c = 0; c < COPIES; c++) wb[c] = dalloc((size_t)R * K * 2, 0x3c);
        for (size_t fi = 0; fi < 2; fi++) {
            int bits = fmts[fi].bits, group = fmts[fi].group ? fmts[fi].group : K, ng = (K + group - 1) / group;
            int rb = ((K * bits + 7) / 8 + 15) / 16 * 16;
            struct cuda_qmat q[COPIES];
            for (int c = 0; c < COPIES; c++) {
                q[c] = (struct cuda_qmat){.bits = bits, .rows = R, .cols = K, .group = group, .n_groups = ng,
                                          .row_bytes = rb, .f16 = false};
                q[c].qw = dalloc((size_t)R * rb, 0x5a);
                q[c].scales = dalloc((size_t)R * ng * 2, 0x3c);
            }
            char fmt[24];
            snprintf(fmt, sizeof fmt, fmts[fi].group ? "int%d g%d" : "int%d ch", bits, fmts[fi].group);
            int tile = (int)(ws.deq_bytes / ((size_t)K * 2));
            if (tile > R) tile = R;
            for (size_t ti = 0; ti < sizeof Tx / sizeof Tx[0]; ti++) {
                int T = Tx[ti];
                float um = 0, ud = 0, ub = 0;
                TIME_US(um, cuda_qgemm(&q[i], x, y, false, R, T, &ws, blas, 0));
                TIME_US(ud, for (int r0 = 0; r0 < R; r0 += tile) {
                    int nr = R - r0 < tile ? R - r0 : tile;
                    cuda_qdequant(&q[i], r0, nr, ws.deq, 0);
                    cublasGemmEx(blas, CUBLAS_OP_T, CUBLAS_OP_N, nr, T, K, &one, ws.deq, CUDA_R_16BF, K, x,
                                 CUDA_R_16BF, K, &zero, y + r0, CUDA_R_16BF, R, CUBLAS_COMPUTE_32F, CUBLAS_GEMM_DEFAULT);
                });
                TIME_US(ub, cublasGemmEx(blas, CUBLAS_OP_T, CUBLAS_OP_N, R, T, K, &one, wb[i], CUDA_R_16BF, K, x,
                                         CUDA_R_16BF, K, &zero, y, CUDA_R_16BF, R, CUBLAS_COMPUTE_32F,
                                         CUBLAS_GEMM_DEFAULT));
                printf("%-24s %-10s %4d %10.1f %10.1f %10.1f  %s\n", shapes[si].name, fmt, T, um, ud, ub,
                       um <= ud ? "packed" : "deq+cuBLAS");
            }
            for (int c = 0; c < COPIES; c++) cudaFree((void *)q[c].qw), cudaFree((void *)q[c].scales);
        }
        for (int c = 0; c < COPIES; c++) cudaFree(wb[c]);
        cudaError_t e = cudaGetLastError();
        if (e != cudaSuccess) printf("  error: %s\n", cudaGetErrorString(e));
    }
    cudaFree(x), cudaFree(y), cudaFree(gu), cudaFree(ws.xperm), cudaFree(ws.deq);
    cublasDestroy(blas);
    return 0;
}

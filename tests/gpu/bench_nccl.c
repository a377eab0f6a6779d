/* bench_nccl.c - all-reduce latency between the GPUs of this host, at the
 * sizes a tensor-parallel step uses (not a test): one token's f32 residual
 * (E = 4096: 16 KB; 8192: 32 KB), a decode batch's, and a prefill chunk's.
 * Ranks in one thread with ncclGroupStart/End; 64 back-to-back all-reduces
 * (two per layer of a 32-layer model) per timed run, median of 20 runs.
 *
 *   build/tests/gpu/bench_nccl [n_gpus]   (NCCL_NVLS_ENABLE=0 on our hosts)
 */
#include <cuda_runtime.h>
#include <nccl.h>
#include <stdio.h>
#include <stdlib.h>
#include <time.h>

#include "tests/gpu/gpu_util.h"

#define MAXG 8
#define RUNS 20
#define PER 64


#define NCHECK(call)                                                                               \
    do {                                                                                           \
        ncclResult_t r_ = (call);                                                                  \
        if (r_ != ncclSuccess) {                                                                   \
            printf("%s failed: %s (%s:%d)\n", #call, ncclGetErrorString(r_), __FILE__, __LINE__);   \
            return 1;                                                                              \
        }                                                                                          \
    } while (0)

int main(int argc, char **argv)
{
    int n = 0;
    cudaGetDeviceCount(&n);
    if (argc > 1) n = atoi(argv[1]) < n ? atoi(argv[1]) : n;
    if (n < 2) {
        printf("bench_nccl: needs 2 or more GPUs (have %d)\n", n);
        return 0;
    }
    if (n > MAXG) n = MAXG;
    ncclComm_t comm[MAXG];
    cudaStream_t st[MAXG];
    float *buf[MAXG];
    size_t maxe = (size_t)2048 * 8192;
    NCHECK(ncclCommInitAll(comm, n, NULL));
    for (int i = 0; i < n; i++) {
        cudaSetDevice(i);
        cudaStreamCreateWithFlags(&st[i], cudaStreamNonBlocking);
        if (cudaMalloc((void **)&buf[i], maxe * 4) != cudaSuccess) return 1;
        cudaMemset(buf[i], 0, maxe * 4);
    }
    size_t sizes[] = {4096, 8192, 8 * 4096, 64 * 4096, 256 * 4096, 2048 * 4096, 2048 * 8192};
    printf("%d GPUs, f32 all-reduce (sum), %d back to back per run, median of %d runs\n", n, PER, RUNS);
    for (unsigned si = 0; si < sizeof sizes / sizeof *sizes; si++) {
        size_t e = sizes[si];
        double t[RUNS];
        for (int r = -2; r < RUNS; r++) {
            double t0 = now_s();
            for (int k = 0; k < PER; k++) {
                NCHECK(ncclGroupStart());
                for (int i = 0; i < n; i++) NCHECK(ncclAllReduce(buf[i], buf[i], e, ncclFloat, ncclSum, comm[i], st[i]));
                NCHECK(ncclGroupEnd());
            }
            for (int i = 0; i < n; i++) {
                cudaSetDevice(i);
                cudaStreamSynchronize(st[i]);
            }
            if (r >= 0) t[r] = (now_s() - t0) / PER;
        }
        qsort(t, RUNS, sizeof *t, cmp_double);
        double us = t[RUNS / 2] * 1e6, bytes = (double)e * 4;
        printf("%10zu floats (%8.0f KB): %8.1f us per all-reduce, bus bw %.1f GB/s\n", e, bytes / 1024, us,
               bytes * 2.0 * (n - 1) / n / (us * 1e3));
    }
    for (int i = 0; i < n; i++) ncclCommDestroy(comm[i]);
    return 0;
}

/* bench_nccl.c - all-reduce latency between the GPUs of this host, at the
 * sizes a tensor-parallel step uses (not a test): one token's f32 residual
 * (E = 4096: 16 KB; 8192: 32 KB), a decode batch's, and a prefill chunk's.
 * Ranks in one thread with ncclGroupStart/End; 64 back-to-back all-reduces
 * (two per layer of a 32-layer model) per timed run, median of 20 runs.
 * Then the same for the backend's peer all-reduce kernel (cuda_peer_allreduce,
 * bf16 out, two buffers taken in turn) when every pair has peer access.
 *
 *   build/tests/gpu/bench_nccl [n_gpus]   (NCCL_NVLS_ENABLE=0 on our hosts)
 */
#include <cuda_runtime.h>
#include <nccl.h>
#include <stdio.h>
#include <stdlib.h>
#include <time.h>

#include "cuda/kernels.h"
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

static void sync_all(int n, cudaStream_t *st)
{
    for (int i = 0; i < n; i++) {
        cudaSetDevice(i);
        cudaStreamSynchronize(st[i]);
    }
}

/* the median of RUNS times in seconds, in microseconds (sorts t) */
static double median_us(double *t)
{
    qsort(t, RUNS, sizeof *t, cmp_double);
    return t[RUNS / 2] * 1e6;
}

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
            sync_all(n, st);
            if (r >= 0) t[r] = (now_s() - t0) / PER;
        }
        double us = median_us(t), bytes = (double)e * 4;
        printf("%10zu floats (%8.0f KB): %8.1f us per all-reduce, bus bw %.1f GB/s\n", e, bytes / 1024, us,
               bytes * 2.0 * (n - 1) / n / (us * 1e3));
    }
    for (int i = 0; i < n; i++) ncclCommDestroy(comm[i]);

    /* the peer kernel: buf[i] and a second buffer per rank, taken in turn */
    for (int i = 0; i < n; i++)
        for (int j = 0; j < n; j++) {
            int ok = 0;
            if (i != j && (cudaDeviceCanAccessPeer(&ok, i, j) != cudaSuccess || !ok)) {
                printf("no peer access between GPUs %d and %d: the peer kernel is not timed\n", i, j);
                return 0;
            }
        }
    float *buf2[MAXG];
    uint16_t *out[MAXG];
    unsigned *flags[MAXG], *epoch[MAXG];
    int *abort_flag = NULL;
    if (cudaHostAlloc((void **)&abort_flag, sizeof(int), cudaHostAllocMapped | cudaHostAllocPortable) != cudaSuccess)
        return 1;
    *abort_flag = 0;
    size_t fb = (size_t)CUDA_PEER_BLOCKS * CUDA_PEER_MAX * 4;
    for (int i = 0; i < n; i++) {
        cudaSetDevice(i);
        for (int j = 0; j < n; j++) {
            cudaError_t e = j == i ? cudaSuccess : cudaDeviceEnablePeerAccess(j, 0);
            if (e == cudaErrorPeerAccessAlreadyEnabled) /* NCCL's P2P transport turned it on */
                cudaGetLastError();
            else if (e != cudaSuccess) {
                printf("peer access %d -> %d: %s\n", i, j, cudaGetErrorString(e));
                return 1;
            }
        }
        if (cudaMalloc((void **)&buf2[i], maxe * 4) != cudaSuccess || cudaMalloc((void **)&out[i], maxe * 2) ||
            cudaMalloc((void **)&flags[i], fb) || cudaMalloc((void **)&epoch[i], CUDA_PEER_BLOCKS * 4)) {
            printf("out of device memory\n");
            return 1;
        }
        cudaMemset(buf2[i], 0, maxe * 4), cudaMemset(flags[i], 0, fb), cudaMemset(epoch[i], 0, CUDA_PEER_BLOCKS * 4);
        cudaDeviceSynchronize();
    }
    printf("%d GPUs, the peer all-reduce kernel (f32 in, bf16 out), %d back to back per run, median of %d runs\n", n,
           PER, RUNS);
    for (unsigned si = 0; si < sizeof sizes / sizeof *sizes; si++) {
        size_t e = sizes[si];
        double t[RUNS];
        for (int r = -2; r < RUNS; r++) {
            double t0 = now_s();
            for (int k = 0; k < PER; k++)
                for (int i = 0; i < n; i++) {
                    struct cuda_peer_ar a = {.epoch = epoch[i], .abort = abort_flag, .n_ranks = n, .rank = i};
                    for (int j = 0; j < n; j++) a.src[j] = k % 2 ? buf2[j] : buf[j], a.flags[j] = flags[j];
                    cudaSetDevice(i);
                    if (cuda_peer_allreduce(&a, e, out[i], NULL, false, st[i]) != cudaSuccess) {
                        printf("cuda_peer_allreduce failed\n");
                        return 1;
                    }
                }
            sync_all(n, st);
            if (r >= 0) t[r] = (now_s() - t0) / PER;
        }
        double us = median_us(t), bytes = (double)e * 4;
        printf("%10zu floats (%8.0f KB): %8.1f us per all-reduce, %.1f GB/s read from peers per rank\n", e,
               bytes / 1024, us, bytes * (n - 1) / (us * 1e3));
    }
    return 0;
}

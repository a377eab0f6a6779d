/* device.cu - which GPUs this process can use, and a probe kernel that proves
 * code built for their architecture runs. The GPU backend proper is
 * cuda_backend.c and the files beside it (cuda_internal.h). */
#include <stdio.h>

#include "cuda/cuda_check.h"

extern "C" {
#include "model/backend.h"
}

/* Writes i*3+1 to out[i]: if this runs, the fatbinary has code for the card. */
static __global__ void probe_kernel(int *out, int n)
{
    int i = blockIdx.x * blockDim.x + threadIdx.x;
    if (i < n) out[i] = i * 3 + 1;
}

/* Launches the probe on the current device; 0 when it computed the right values. */
static int probe(char *err, size_t errlen)
{
    enum { N = 256 };
    int host[N], *dev = NULL, rc = -1;
    CUDA_CHECK(cudaMalloc(&dev, sizeof host), err, errlen, fail);
    probe_kernel<<<1, N>>>(dev, N);
    CUDA_CHECK(cudaGetLastError(), err, errlen, fail);
    CUDA_CHECK(cudaMemcpy(host, dev, sizeof host, cudaMemcpyDeviceToHost), err, errlen, fail);
    rc = 0;
    for (int i = 0; i < N; i++)
        if (host[i] != i * 3 + 1) {
            snprintf(err, errlen, "probe kernel computed a wrong value at %d", i);
            rc = -1;
            break;
        }
fail:
    cudaFree(dev);
    return rc;
}

extern "C" int model_cuda_describe(char *buf, size_t cap)
{
    int n = 0;
    char err[256];
    cudaError_t e = cudaGetDeviceCount(&n);
    if (e != cudaSuccess || n == 0) {
        snprintf(buf, cap, "no GPU (%s)", e != cudaSuccess ? cudaGetErrorString(e) : "0 devices");
        return 0;
    }
    size_t o = 0;
    for (int d = 0; d < n && o < cap; d++) {
        cudaDeviceProp p;
        if (cudaGetDeviceProperties(&p, d) != cudaSuccess) continue;
        cudaSetDevice(d);
        int ok = probe(err, sizeof err) == 0;
        o += (size_t)snprintf(buf + o, cap - o, "%s%d: %s (sm_%d%d, %.0f GiB)%s%s", d ? "; " : "", d, p.name,
                              p.major, p.minor, p.totalGlobalMem / 1073741824.0, ok ? "" : " probe failed: ",
                              ok ? "" : err);
    }
    return n;
}

extern "C" int model_cuda_mem_info(int device, size_t *free_bytes, size_t *total_bytes)
{
    *free_bytes = *total_bytes = 0;
    int cur = 0;
    if (cudaGetDevice(&cur) != cudaSuccess || cudaSetDevice(device) != cudaSuccess) return -1;
    int rc = cudaMemGetInfo(free_bytes, total_bytes) == cudaSuccess ? 0 : -1;
    cudaSetDevice(cur);
    return rc;
}

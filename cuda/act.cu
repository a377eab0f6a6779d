/* act.cu - SwiGLU over the fused gate|up projection (kernels.h). */
#include "cuda/bf16.cuh"
#include "cuda/kernels.h"

static __global__ void swiglu_kernel(const uint16_t *gu, int T, int F, uint16_t *h)
{
    size_t n = (size_t)T * F;
    for (size_t i = (size_t)blockIdx.x * blockDim.x + threadIdx.x; i < n; i += (size_t)gridDim.x * blockDim.x) {
        size_t t = i / F, j = i % F;
        float g = bf2f(gu[t * 2 * F + j]), u = bf2f(gu[t * 2 * F + F + j]);
        h[i] = f2bf(g / (1.0f + __expf(-g)) * u);
    }
}

extern "C" cudaError_t cuda_swiglu(const uint16_t *gu, int T, int F, uint16_t *h, cudaStream_t st)
{
    size_t n = (size_t)T * F;
    if (!n) return cudaSuccess;
    size_t blocks = (n + 255) / 256;
    if (blocks > 132 * 16) blocks = 132 * 16;
    swiglu_kernel<<<(unsigned)blocks, 256, 0, st>>>(gu, T, F, h);
    return cudaGetLastError();
}

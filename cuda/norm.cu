/* norm.cu - embedding gather and the fused residual add + RMSNorm (kernels.h). */
#include "cuda/bf16.cuh"
#include "cuda/kernels.h"
#include "cuda/norm.cuh"
#include "cuda/pdl.cuh"

static __global__ void embed_kernel(const uint16_t *tab, const int32_t *ids, int E, float *x)
{
    int t = blockIdx.x;
    const uint16_t *row = tab + (size_t)ids[t] * E;
    for (int i = threadIdx.x; i < E; i += blockDim.x) x[(size_t)t * E + i] = bf2f(row[i]);
}

/* One block of rms_threads(E) threads per row (a PDL launch: pdl.cuh); the sum of squares in f32 in
 * norm.cuh's order (the CPU reference sums in double: a ~1e-7 difference). */
static __global__ void add_rmsnorm_kernel(float *x, const uint16_t *delta, const float *w,
                                          const int32_t *rows, int E, float eps, uint16_t *out)
{
    __shared__ float sh[32];
    pdl_trigger();
    pdl_wait();
    int r = blockIdx.x;
    int t = rows ? rows[r] : r;
    float *xr = x + (size_t)t * E;
    const uint16_t *dr = delta ? delta + (size_t)t * E : NULL;
    float ss = 0.0f;
    for (int i = threadIdx.x; i < E; i += blockDim.x) {
        float v = xr[i];
        if (dr) {
            v += bf2f(dr[i]);
            if (!rows) xr[i] = v;
        }
        ss = rms_acc(ss, v);
    }
    ss = block_sum(ss, sh);
    float inv = rms_inv(ss, E, eps);
    uint16_t *o = out + (size_t)r * E;
    for (int i = threadIdx.x; i < E; i += blockDim.x) {
        /* each thread reads back what it wrote itself: no barrier needed */
        float v = xr[i];
        if (dr && rows) v += bf2f(dr[i]);
        o[i] = rms_out(w[i], v, inv);
    }
}

static int threads_for(int n)
{
    int t = 32;
    while (t < n && t < 1024) t *= 2;
    return t;
}

extern "C" cudaError_t cuda_embed(const uint16_t *tab, const int32_t *ids, int T, int E, float *x, cudaStream_t st)
{
    if (T <= 0) return cudaSuccess;
    embed_kernel<<<T, threads_for(E > 1024 ? 1024 : E), 0, st>>>(tab, ids, E, x);
    return cudaGetLastError();
}

extern "C" cudaError_t cuda_add_rmsnorm(float *x, const uint16_t *delta, const float *w, const int32_t *rows,
                                        int T, int E, float eps, uint16_t *out, cudaStream_t st)
{
    if (T <= 0) return cudaSuccess;
    return pdl_launch(add_rmsnorm_kernel, dim3(T), dim3(rms_threads(E)), 0, st, x, delta, w, rows, E, eps, out);
}

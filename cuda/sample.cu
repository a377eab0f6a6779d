/* sample.cu - greedy token and its log-probability on the device (kernels.h).
 * The rest of sampling (penalties, temperature, top-k/p, min-p, top logprobs)
 * runs on the host over the copied-back row with model_sample(), so the RNG
 * stream is the CPU backend's exactly (cuda_backend.c says when). */
#include "cuda/bf16.cuh"
#include "cuda/kernels.h"

static __global__ void argmax_lse_kernel(const float *logits, int V, int32_t *tok, float *logprob)
{
    __shared__ float shv[32];
    __shared__ int shi[32];
    __shared__ float sh[32];
    const float *row = logits + (size_t)blockIdx.x * V;
    float best = -INFINITY;
    int bi = 0x7fffffff;
    bool nan = false;
    for (int i = threadIdx.x; i < V; i += blockDim.x) {
        float v = row[i];
        if (isnan(v)) nan = true;
        if (v > best) best = v, bi = i; /* ascending i per thread: first max kept */
    }
    /* reduce (value desc, id asc) */
    for (int o = 16; o; o >>= 1) {
        float ov = __shfl_xor_sync(0xffffffffu, best, o);
        int oi = __shfl_xor_sync(0xffffffffu, bi, o);
        if (ov > best || (ov == best && oi < bi)) best = ov, bi = oi;
    }
    int lane = threadIdx.x & 31, w = threadIdx.x >> 5, nw = blockDim.x >> 5;
    if (lane == 0) shv[w] = best, shi[w] = bi;
    __syncthreads();
    if (w == 0) {
        best = lane < nw ? shv[lane] : -INFINITY;
        bi = lane < nw ? shi[lane] : 0x7fffffff;
        for (int o = 16; o; o >>= 1) {
            float ov = __shfl_xor_sync(0xffffffffu, best, o);
            int oi = __shfl_xor_sync(0xffffffffu, bi, o);
            if (ov > best || (ov == best && oi < bi)) best = ov, bi = oi;
        }
        if (lane == 0) shv[0] = best, shi[0] = bi;
    }
    __syncthreads();
    float mx = shv[0];
    int am = shi[0];
    float s = 0.0f;
    for (int i = threadIdx.x; i < V; i += blockDim.x) s += __expf(row[i] - mx);
    s = block_sum(s, sh);
    int anynan = __syncthreads_or(nan);
    if (threadIdx.x == 0) {
        bool bad = anynan || !isfinite(mx);
        tok[blockIdx.x] = bad ? -1 : am;
        logprob[blockIdx.x] = bad ? NAN : -logf(s);
    }
}

extern "C" cudaError_t cuda_argmax_lse(const float *logits, int R, int V, int32_t *tok, float *logprob,
                                       cudaStream_t st)
{
    if (R <= 0) return cudaSuccess;
    argmax_lse_kernel<<<R, 1024, 0, st>>>(logits, V, tok, logprob);
    return cudaGetLastError();
}

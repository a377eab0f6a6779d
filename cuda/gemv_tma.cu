/* STATUS: an experiment, bit for bit the warp kernels but measured slower in
 * place (batch-1 decode of the Llama-3.1-8B shape on an H200: 216.0-216.2
 * tok/s with all four GEMVs on it against 223.0-223.4), and removed again in
 * the commit after this one; BENCHMARKS.md, "GPU, tenth round", has the
 * figures.
 *
 * gemv_tma.cu - the one-token decode GEMVs (kernels.h: cuda_gemv_tma) with
 * the weights streamed through shared memory by bulk copies, one block per
 * SM.
 *
 * Why. gemv.cu's warp kernel gives a warp a row and the grid as many warps
 * as rows, so a matrix runs in waves (qkv of the Llama-8B shape: 6144 rows,
 * 1.45 waves) and each wave's tail leaves bandwidth unused: in place the four
 * decode GEMVs lose ~19 us a layer against the bandwidth (BENCHMARKS.md,
 * ninth round). Here block p takes the contiguous rows [p R / G, (p+1) R / G)
 * and streams them without a gap to the end, so every SM keeps its share of
 * copies in flight until its last row.
 *
 * The block: one producer warp and eight consumer warps. The producer
 * requests the block's rows in 2 KB bulk copies into a ring of slots in
 * shared memory (full/empty mbarriers per slot), a group of up to eight
 * units (a row; a gate row and its up row for SwiGLU) at a time, round k of
 * a group holding chunk k of each of its rows side by side. Consumer warp w
 * takes unit w of each group and sums it exactly as the warp kernel does
 * (lane l: 16-byte chunks l, l + 32, ... in K order, then the xor
 * butterfly), so every output is bit for bit cuda_gemv / the fused kernels'.
 *
 * Programmatic dependent launch: the producer starts on the weights before
 * griddepcontrol.wait, but only `MG_EARLY` slots: every load the block issues
 * queues behind its copies in flight, and the prologue's loads of x (the
 * previous kernel's output) must not wait behind a ring of weights (the
 * tenth round's persistent kernel lost to exactly that). The consumers open
 * the rest of the stream once x is in shared memory. Two blocks fit on an
 * SM (shared memory and registers), so the next GEMV's block can start
 * beside this one's.
 *
 * Slots: a consumer waits on a slot's full barrier only once the producer
 * has issued that slot (a shared counter). Copies land out of order and the
 * slot's position was last used by another warp's row, so before that the
 * barrier's one-bit phase parity is ambiguous (BENCHMARKS.md, tenth round).
 *
 * Limits (cuda_gemv_tma_ok): sm_90, one row of x, in a multiple of 1024. */
#include <stdlib.h>

#include "cuda/bf16.cuh"
#include "cuda/kernels.h"
#include "cuda/mbar.cuh"
#include "cuda/norm.cuh"
#include "cuda/pdl.cuh"

#define GT_NW 8                       /* consumer warps */
#define GT_THREADS (32 * (GT_NW + 1)) /* + the producer warp */
#define GT_CB 2048                    /* bytes per slot */
#define GT_CE (GT_CB / 2)             /* bf16 per slot */
#define GT_NS 36                      /* slots by default (SLUICE_GEMV_TMA_SLOTS) */
#define GT_MAXNS 100                  /* slots at most */
#define GT_EARLY 8                    /* slots requested before the predecessor has finished, by default
                                         (SLUICE_GEMV_TMA_EARLY) */
#define GT_SMEM (232448 - 4096)      /* dynamic shared memory at most: sm_90 opt-in less the static */
#define GT_MAXIN 16384                /* longest row: x's space in shared memory */

#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
#define GT_ARCH 1
#endif

struct gt_params {
    const uint16_t *W; /* [out][in], or [2 out][in] for SwiGLU (gate rows, then up rows) */
    const uint16_t *x; /* [in] bf16, or NULL: RMSNorm of xf */
    const float *xf, *nw;
    float eps;
    void *y;
    int in, out;
    int ns, early; /* ring slots; slots requested before griddepcontrol.wait */
};

#ifdef GT_ARCH
static __device__ __forceinline__ void bulk_copy(uint32_t dst, const void *src, uint32_t bytes, uint32_t bar)
{
    asm volatile("cp.async.bulk.shared::cluster.global.mbarrier::complete_tx::bytes [%0], [%1], %2, [%3];\n" ::"r"(dst),
                 "l"(src), "r"(bytes), "r"(bar)
                 : "memory");
}
static __device__ __forceinline__ void bar_consumers(void) { asm volatile("bar.sync 1, 256;\n" ::: "memory"); }
struct sync_consumers {
    __device__ __forceinline__ void operator()() const { bar_consumers(); }
};
#endif

/* EPI: 0 bf16, 1 f32 residual add, 2 SwiGLU (NR = 2 rows a unit) */
template <int EPI>
static __global__ void __launch_bounds__(GT_THREADS, 2) gemv_tma_kernel(const gt_params p)
{
#ifdef GT_ARCH
    constexpr int NR = EPI == 2 ? 2 : 1;
    extern __shared__ __align__(128) uint8_t smem[];
    __shared__ float nsh[32];
    __shared__ uint64_t bars[2 * GT_MAXNS];
    __shared__ unsigned issued, limit;
    uint8_t *ring = smem;
    const int NS = p.ns;
    uint16_t *xv = (uint16_t *)(smem + (size_t)NS * GT_CB); /* [in] bf16 */
    float *xf = (float *)(xv + p.in);                   /* [in] f32: the norm's copy of x */
    const uint32_t full = (uint32_t)__cvta_generic_to_shared(bars), empty = full + 8 * NS;
    const int nch = p.in / GT_CE, lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
    const int u0 = (int)((long long)p.out * blockIdx.x / gridDim.x);
    const int u1 = (int)((long long)p.out * (blockIdx.x + 1) / gridDim.x);
    for (int i = threadIdx.x; i < NS; i += GT_THREADS) mbar_init(full + 8 * i, 1), mbar_init(empty + 8 * i, 1);
    if (threadIdx.x == 0) issued = 0, limit = p.early;
    __syncthreads();
    pdl_trigger();
    if (warp == GT_NW) {
        /* the producer: rounds of up to 8 NR slots, lane i taking slot s + i */
        volatile unsigned *lim = &limit, *iss = &issued;
        unsigned s = 0;
        for (int g0 = u0; g0 < u1; g0 += GT_NW) {
            const int nu = min(GT_NW, u1 - g0), n = nu * NR;
            for (int k = 0; k < nch; k++, s += n) {
                while (s + n > *lim) __nanosleep(32);
                if (lane < n) {
                    const unsigned sl = s + lane;
                    const int ps = (int)(sl % NS), w = lane / NR, r = lane % NR;
                    if (sl >= NS) mbar_wait(empty + 8 * ps, (int)((sl / NS - 1) & 1));
                    const uint16_t *src = p.W + (size_t)(g0 + w + r * p.out) * p.in + (size_t)k * GT_CE;
                    mbar_expect_tx(full + 8 * ps, GT_CB);
                    bulk_copy((uint32_t)__cvta_generic_to_shared(ring + ps * GT_CB), src, GT_CB, full + 8 * ps);
                }
                __syncwarp();
                if (lane == 0) *iss = s + n;
            }
        }
        pdl_wait();
        return;
    }

    /* the consumers: x into shared memory (normalized when NORM), one round trip */
    pdl_wait();
    const bool norm = p.x == NULL;
    if (norm) {
        const int n4 = p.in / 4;
        for (int i0 = threadIdx.x; i0 < n4; i0 += 256 * 4) {
            float4 v[4];
#pragma unroll
            for (int u = 0; u < 4; u++)
                if (i0 + 256 * u < n4) v[u] = __ldcg((const float4 *)p.xf + i0 + 256 * u);
#pragma unroll
            for (int u = 0; u < 4; u++)
                if (i0 + 256 * u < n4) ((float4 *)xf)[i0 + 256 * u] = v[u];
        }
        bar_consumers();
        rms_rows256<1>(xf, p.nw, p.eps, p.in, xv, nsh, sync_consumers{}, ld_plain{});
    } else {
        const int n8 = p.in / 8;
        for (int i0 = threadIdx.x; i0 < n8; i0 += 256 * 8) {
            uint4 v[8];
#pragma unroll
            for (int u = 0; u < 8; u++)
                if (i0 + 256 * u < n8) v[u] = __ldcg((const uint4 *)p.x + i0 + 256 * u);
#pragma unroll
            for (int u = 0; u < 8; u++)
                if (i0 + 256 * u < n8) ((uint4 *)xv)[i0 + 256 * u] = v[u];
        }
        bar_consumers();
    }
    if (threadIdx.x == 0) limit = 0xffffffffu; /* the rest of the stream */

    volatile unsigned *iss = &issued;
    unsigned s = 0;
    for (int g0 = u0; g0 < u1; g0 += GT_NW) {
        const int nu = min(GT_NW, u1 - g0);
        if (warp < nu) {
            float acc[NR];
#pragma unroll
            for (int r = 0; r < NR; r++) acc[r] = 0.0f;
            for (int k = 0; k < nch; k++) {
                const uint4 *x4 = (const uint4 *)xv + k * (GT_CE / 8);
#pragma unroll
                for (int r = 0; r < NR; r++) {
                    const unsigned sl = s + (unsigned)((k * nu + warp) * NR + r);
                    const int ps = (int)(sl % NS);
                    while (*iss <= sl) {
                    }
                    mbar_wait(full + 8 * ps, (int)((sl / NS) & 1));
                    const uint4 *w4 = (const uint4 *)(ring + (size_t)ps * GT_CB);
#pragma unroll
                    for (int u = 0; u < GT_CB / 512; u++) {
                        float wf[8], xq[8];
                        unpack8(w4[u * 32 + lane], wf);
                        unpack8(x4[u * 32 + lane], xq);
#pragma unroll
                        for (int e = 0; e < 8; e++) acc[r] += wf[e] * xq[e];
                    }
                    __syncwarp();
                    if (lane == 0) mbar_arrive(empty + 8 * ps);
                }
            }
#pragma unroll
            for (int r = 0; r < NR; r++) acc[r] = warp_sum(acc[r]);
            if (lane == 0) {
                const int j = g0 + warp;
                if (EPI == 0) ((uint16_t *)p.y)[j] = f2bf(acc[0]);
                if (EPI == 1) ((float *)p.y)[j] += bf2f(f2bf(acc[0])); /* as x += delta of bf16(s) */
                if (EPI == 2) {
                    float g = bf2f(f2bf(acc[0])), u = bf2f(f2bf(acc[NR - 1]));
                    ((uint16_t *)p.y)[j] = f2bf(g / (1.0f + __expf(-g)) * u);
                }
            }
        }
        s += (unsigned)(nch * nu * NR);
    }
#endif
}

static size_t gt_smem(int ns, int in, bool norm) { return (size_t)ns * GT_CB + (size_t)in * (norm ? 6 : 2); }

static int env_int(const char *name, int def, int lo, int hi)
{
    const char *v = getenv(name);
    int n = v && *v ? atoi(v) : def;
    return n < lo ? lo : n > hi ? hi : n;
}

int cuda_gemv_tma_ok(int in)
{
    int dev = 0, cc = 0;
    if (cudaGetDevice(&dev) != cudaSuccess ||
        cudaDeviceGetAttribute(&cc, cudaDevAttrComputeCapabilityMajor, dev) != cudaSuccess)
        return 0;
    return cc >= 9 && in > 0 && in % GT_CE == 0 && in <= GT_MAXIN;
}

cudaError_t cuda_gemv_tma_prepare(void)
{
    int n = GT_SMEM; /* all a block may have, less the static shared memory */
    cudaError_t e = cudaFuncSetAttribute(gemv_tma_kernel<0>, cudaFuncAttributeMaxDynamicSharedMemorySize, n);
    if (e == cudaSuccess) e = cudaFuncSetAttribute(gemv_tma_kernel<1>, cudaFuncAttributeMaxDynamicSharedMemorySize, n);
    if (e == cudaSuccess) e = cudaFuncSetAttribute(gemv_tma_kernel<2>, cudaFuncAttributeMaxDynamicSharedMemorySize, n);
    return e;
}

cudaError_t cuda_gemv_tma(int epi, const uint16_t *W, const uint16_t *x, const float *xf, const float *nw, float eps,
                          void *y, int in, int out, cudaStream_t st)
{
    if (!cuda_gemv_tma_ok(in) || (!x && (!xf || !nw || in > GT_MAXIN / 2)) || epi < 0 || epi > 2)
        return cudaErrorInvalidValue;
    int dev = 0, G = 0;
    cudaError_t e = cudaGetDevice(&dev);
    if (e == cudaSuccess) e = cudaDeviceGetAttribute(&G, cudaDevAttrMultiProcessorCount, dev);
    if (e != cudaSuccess) return e;
    if (G > out) G = out;
    static int ns = -1, early;
    if (ns < 0) {
        ns = env_int("SLUICE_GEMV_TMA_SLOTS", GT_NS, 16, GT_MAXNS);
        early = env_int("SLUICE_GEMV_TMA_EARLY", GT_EARLY, 0, 1 << 20);
    }
    gt_params p = {W, x, xf, nw, eps, y, in, out, ns, early};
    size_t sm = gt_smem(ns, in, x == NULL);
    if (sm > GT_SMEM) return cudaErrorInvalidValue;
    switch (epi) {
    case 0: return pdl_launch(gemv_tma_kernel<0>, dim3(G), dim3(GT_THREADS), sm, st, p);
    case 1: return pdl_launch(gemv_tma_kernel<1>, dim3(G), dim3(GT_THREADS), sm, st, p);
    default: return pdl_launch(gemv_tma_kernel<2>, dim3(G), dim3(GT_THREADS), sm, st, p);
    }
}

/* wgmma.cuh - Hopper's warpgroup MMA, mbarriers and bulk tensor copies
 * (sm_90a only: everything sits under WG_ARCH), shared by the kernels that
 * use them (attn_wg.cu, gemm_wg.cu; internal to cuda/), and the driver's
 * tensor-map encoder for the host side. */
#ifndef SLUICE_CUDA_WGMMA_CUH
#define SLUICE_CUDA_WGMMA_CUH

#include <cuda.h>
#include <cudaTypedefs.h>
#include <stdint.h>

#if defined(__CUDA_ARCH__) && defined(__CUDA_ARCH_FEAT_SM90_ALL)
#define WG_ARCH 1
#endif

#ifdef WG_ARCH
/* a shared-memory matrix descriptor: start address, LBO and SBO in bytes
 * (stored in 16-byte units), the 128-byte swizzle */
static __device__ __forceinline__ uint64_t wg_desc(uint32_t addr, uint32_t lbo, uint32_t sbo)
{
    return (uint64_t)((addr & 0x3FFFF) >> 4) | (uint64_t)((lbo >> 4) & 0x3FFF) << 16 |
           (uint64_t)((sbo >> 4) & 0x3FFF) << 32 | 1ull << 62;
}

/* keeps the compiler from touching accumulators across an async wgmma */
template <int N>
static __device__ __forceinline__ void acc_fence(float (&d)[N])
{
#pragma unroll
    for (int i = 0; i < N; i++) asm volatile("" : "+f"(d[i])::"memory");
}
static __device__ __forceinline__ void wg_fence(void) { asm volatile("wgmma.fence.sync.aligned;\n" ::: "memory"); }
static __device__ __forceinline__ void wg_commit(void)
{
    asm volatile("wgmma.commit_group.sync.aligned;\n" ::: "memory");
}
template <int N>
static __device__ __forceinline__ void wg_wait(void)
{
    asm volatile("wgmma.wait_group.sync.aligned %0;\n" ::"n"(N) : "memory");
}
/* ---- mbarriers (shared memory, CTA scope) ---- */
static __device__ __forceinline__ void mbar_init(uint32_t bar, int count)
{
    asm volatile("mbarrier.init.shared::cta.b64 [%0], %1;\n" ::"r"(bar), "r"(count) : "memory");
}
static __device__ __forceinline__ void mbar_arrive(uint32_t bar)
{
    asm volatile("{\n.reg .b64 st;\nmbarrier.arrive.shared::cta.b64 st, [%0];\n}\n" ::"r"(bar) : "memory");
}
/* arrives once every cp.async this thread issued so far has landed */
static __device__ __forceinline__ void mbar_arrive_cp_async(uint32_t bar)
{
    asm volatile("cp.async.mbarrier.arrive.noinc.shared::cta.b64 [%0];\n" ::"r"(bar) : "memory");
}
/* waits for the completion of the barrier's phase with this parity */
static __device__ __forceinline__ void mbar_wait(uint32_t bar, int parity)
{
    asm volatile("{\n.reg .pred p;\nWAIT_%=:\nmbarrier.try_wait.parity.shared::cta.b64 p, [%0], %1;\n@!p bra WAIT_%=;\n}\n" ::"r"(bar),
                 "r"(parity)
                 : "memory");
}

/* the barrier expects bytes more of transfers, and this arrival */
static __device__ __forceinline__ void mbar_expect_tx(uint32_t bar, uint32_t bytes)
{
    asm volatile("{\n.reg .b64 st;\nmbarrier.arrive.expect_tx.shared::cta.b64 st, [%0], %1;\n}\n" ::"r"(bar), "r"(bytes)
                 : "memory");
}
/* the tensor map's box at (c0, c1, c2) into shared memory at dst (the
 * 128-byte swizzle), counted on the barrier */
static __device__ __forceinline__ void tma_load3(uint32_t dst, const CUtensorMap *m, int c0, int c1, int c2, uint32_t bar)
{
    asm volatile("cp.async.bulk.tensor.3d.shared::cluster.global.tile.mbarrier::complete_tx::bytes [%0], [%1, {%2, %3, "
                 "%4}], [%5];\n" ::"r"(dst),
                 "l"((uint64_t)m), "r"(c0), "r"(c1), "r"(c2), "r"(bar)
                 : "memory");
}

/* the 2-d tensor map's box at (c0, c1) into shared memory at dst, counted
 * on the barrier */
static __device__ __forceinline__ void tma_load2(uint32_t dst, const CUtensorMap *m, int c0, int c1, uint32_t bar)
{
    asm volatile("cp.async.bulk.tensor.2d.shared::cluster.global.tile.mbarrier::complete_tx::bytes [%0], [%1, {%2, %3}], "
                 "[%4];\n" ::"r"(dst),
                 "l"((uint64_t)m), "r"(c0), "r"(c1), "r"(bar)
                 : "memory");
}
#endif

/* whether the current device runs the sm_90a code (compute capability 9.0) */
static inline bool wg_sm90(void)
{
    int dev = 0, major = 0, minor = 0;
    return cudaGetDevice(&dev) == cudaSuccess &&
           cudaDeviceGetAttribute(&major, cudaDevAttrComputeCapabilityMajor, dev) == cudaSuccess &&
           cudaDeviceGetAttribute(&minor, cudaDevAttrComputeCapabilityMinor, dev) == cudaSuccess && major == 9 &&
           minor == 0;
}

/* cuTensorMapEncodeTiled from the driver through the runtime (no -lcuda),
 * looked up once (thread-safe); NULL where the driver lacks it */
static inline PFN_cuTensorMapEncodeTiled_v12000 wg_tm_encoder(void)
{
    static const PFN_cuTensorMapEncodeTiled_v12000 fn = [] {
        cudaDriverEntryPointQueryResult q;
        void *f = NULL;
        if (cudaGetDriverEntryPointByVersion("cuTensorMapEncodeTiled", &f, 12000, cudaEnableDefault, &q) !=
                cudaSuccess ||
            q != cudaDriverEntryPointSuccess)
            f = NULL;
        return (PFN_cuTensorMapEncodeTiled_v12000)f;
    }();
    return fn;
}

#endif

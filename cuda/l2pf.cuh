/* l2pf.cuh - L2 prefetch of the next kernel's weights (sm_90 bulk prefetch;
 * nothing on older GPUs). Internal to cuda/. */
#ifndef SLUICE_CUDA_L2PF_CUH
#define SLUICE_CUDA_L2PF_CUH

#include <stddef.h>

/* Asks L2 for share `part` of `nparts` of [p, p + bytes): fire and forget,
 * one thread, nothing waits for it. p 16-byte aligned. */
static __device__ __forceinline__ void l2_prefetch_share(const void *p, size_t bytes, unsigned part, unsigned nparts)
{
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
    size_t per = ((bytes + nparts - 1) / nparts + 255) & ~(size_t)255, lo = (size_t)part * per;
    if (!p || lo >= bytes) return;
    size_t n = bytes - lo < per ? (bytes - lo) & ~(size_t)15 : per;
    const char *a = (const char *)p + lo;
    while (n) {
        unsigned c = n > 65536 ? 65536u : (unsigned)n;
        asm volatile("cp.async.bulk.prefetch.L2.global [%0], %1;" ::"l"(a), "r"(c) : "memory");
        a += c, n -= c;
    }
#else
    (void)p, (void)bytes, (void)part, (void)nparts;
#endif
}

#endif

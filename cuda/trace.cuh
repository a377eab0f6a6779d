/* trace.cuh - experiment: per-block timestamps of the decode kernels
 * (SLUICE_CUDA_TRACE=N in cuda_backend.c): a kernel given a region writes,
 * per block b (linear id), [b * TR_STRIDE + i] = %globaltimer (ns):
 * i 0 entry, 1 griddepcontrol.wait returned, 2-3 kernel-specific marks,
 * 4 + w warp w done (GEMVs) or the block done (attention, 4). */
#ifndef SLUICE_CUDA_TRACE_CUH
#define SLUICE_CUDA_TRACE_CUH

#define TR_STRIDE 20
static __device__ __forceinline__ unsigned long long tr_now(void)
{
    unsigned long long t;
    asm volatile("mov.u64 %0, %%globaltimer;" : "=l"(t));
    return t;
}
static __device__ __forceinline__ void tr_mark(unsigned long long *tr, int i)
{
    if (tr) tr[((size_t)blockIdx.y * gridDim.x + blockIdx.x) * TR_STRIDE + i] = tr_now();
}

#endif

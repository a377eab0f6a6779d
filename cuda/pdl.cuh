/* pdl.cuh - programmatic dependent launch (sm_90), shared by the decode-path
 * kernels (gemv.cu, norm.cu, attn.cu; internal to cuda/).
 *
 * A kernel launched with the PDL attribute may start while its predecessor in
 * the stream still runs, as soon as every block of the predecessor has
 * called pdl_trigger() (or exited). Until its own pdl_wait() returns it may
 * read only what no earlier kernel of the step writes (weights, the step's
 * uploaded inputs); pdl_wait() returns when the predecessor has completed
 * and its writes are visible. Every thread of every block that works calls
 * pdl_wait() before it exits (the plain decode attention build's idle
 * blocks leave at once; its block (0, 0) always waits), so completion of a
 * kernel still implies completion of everything before it in the stream (a
 * chain of early launches stays ordered). On for sm_90 and later (with
 * several GPUs only beside the peer all-reduce: cuda_backend.c); see gemv.cu
 * for what it gains. The decode attention kernel is launched early
 * too (its first K/V tiles before the wait) but lets nothing start early
 * (attn.cu says why). */
#ifndef SLUICE_CUDA_PDL_CUH
#define SLUICE_CUDA_PDL_CUH

#include <cuda_runtime.h>

static __device__ __forceinline__ void pdl_trigger(void)
{
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
    asm volatile("griddepcontrol.launch_dependents;" ::: "memory");
#endif
}
static __device__ __forceinline__ void pdl_wait(void)
{
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
    asm volatile("griddepcontrol.wait;" ::: "memory");
#endif
}

/* whether launches carry the PDL attribute (gemv.cu's state: sm_90+) */
bool cuda_pdl_on(void);

/* k<<<grid, block, smem, st>>>(args...), with the PDL attribute when on and
 * attr (a kernel launched without it still lets its successor start early
 * when it calls pdl_trigger()) */
template <typename... A, typename... B>
static cudaError_t pdl_launch_as(bool attr, void (*k)(A...), dim3 grid, dim3 block, size_t smem, cudaStream_t st,
                                 B... args)
{
    cudaLaunchAttribute at[1];
    at[0].id = cudaLaunchAttributeProgrammaticStreamSerialization;
    at[0].val.programmaticStreamSerializationAllowed = 1;
    cudaLaunchConfig_t cfg = {};
    cfg.gridDim = grid, cfg.blockDim = block, cfg.dynamicSmemBytes = smem, cfg.stream = st;
    cfg.attrs = at, cfg.numAttrs = attr && cuda_pdl_on() ? 1 : 0;
    cudaError_t e = cudaLaunchKernelEx(&cfg, k, ((A)args)...);
    cudaError_t l = cudaGetLastError(); /* clear what the launch recorded */
    return e != cudaSuccess ? e : l;
}
template <typename... A, typename... B>
static cudaError_t pdl_launch(void (*k)(A...), dim3 grid, dim3 block, size_t smem, cudaStream_t st, B... args)
{
    return pdl_launch_as(true, k, grid, block, smem, st, args...);
}

#endif

/* cuda_check.h - the one checking macro every CUDA, cuBLAS and NCCL call goes
 * through (internal to cuda/). On failure it records a message naming the
 * call, function, file and line into the caller's err/errlen and jumps to the
 * given label, so construction can unwind with goto fail_*. */
#ifndef SLUICE_CUDA_CHECK_H
#define SLUICE_CUDA_CHECK_H

#include <cuda_runtime.h>
#include <stdio.h>

#define CUDA_CHECK(call, err, errlen, label)                                                   \
    do {                                                                                       \
        cudaError_t e_ = (call);                                                               \
        if (e_ != cudaSuccess) {                                                               \
            snprintf((err), (errlen), "%s failed: %s (%s, %s:%d)", #call, cudaGetErrorString(e_), \
                     __func__, __FILE__, __LINE__);                                            \
            goto label;                                                                        \
        }                                                                                      \
    } while (0)

#endif

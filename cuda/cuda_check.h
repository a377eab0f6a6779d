/* cuda_check.h - the one checking macro every CUDA, cuBLAS and NCCL call goes
 * through (internal to cuda/). On failure it records a message naming the
 * call, its API's reason, the function, file and line into the caller's
 * err/errlen and jumps to the given label, so construction can unwind with
 * goto fail_*. */
#ifndef SLUICE_CUDA_CHECK_H
#define SLUICE_CUDA_CHECK_H

#include <cuda_runtime.h>

#ifdef __cplusplus
extern "C" {
#endif
#include "base/base.h"
#ifdef __cplusplus
}
#endif

/* call returns a status of type; anything but ok fails, described by
 * describe(status) (cudaGetErrorString, cublasGetStatusString,
 * ncclGetErrorString); what: the call as written. */
#define CUDA_TRY(call, what, type, ok, describe, err, errlen, label)                                   \
    do {                                                                                             \
        type s_ = (call);                                                                            \
        if (s_ != (ok)) {                                                                            \
            sl_seterr((err), (errlen), "%s failed: %s (%s, %s:%d)", (what), describe(s_), __func__,  \
                      __FILE__, __LINE__);                                                           \
            goto label;                                                                              \
        }                                                                                            \
    } while (0)

#define CUDA_CHECK(call, err, errlen, label) \
    CUDA_TRY(call, #call, cudaError_t, cudaSuccess, cudaGetErrorString, err, errlen, label)

#endif

/* base.h - what every module may include: the status codes, the assertion
 * for broken invariants, and error formatting into a caller's buffer. The
 * JSON reader/writer beside it is base/json.h. base includes no other module.
 */
#ifndef SLUICE_BASE_H
#define SLUICE_BASE_H

#include <stddef.h>

/* Status codes shared across sluice modules: 0 is success. */
enum sl_status {
    SL_OK = 0,
    SL_EINVAL = -1,   /* bad argument or malformed input */
    SL_ENOMEM = -2,   /* out of host or device memory */
    SL_EIO = -3,      /* file could not be read */
    SL_EFORMAT = -4,  /* file is not in the expected format */
    SL_EUNSUP = -5,   /* valid but unsupported (tensor type, architecture) */
    SL_ENOSPC = -6,   /* pool full */
    SL_EDEVICE = -7,  /* CUDA / cuBLAS / NCCL failure */
    SL_ERANGE = -8,   /* output buffer too small / value out of range */
};

/* Aborts with file and line: for broken invariants (bugs), never for input. */
#define SL_ASSERT(x)                                                                     \
    do {                                                                                 \
        if (!(x)) sl_assert_fail(#x, __FILE__, __LINE__);                                \
    } while (0)
void sl_assert_fail(const char *expr, const char *file, int line) __attribute__((noreturn));
/* printf into a caller's error buffer (err may be NULL or errlen 0: nothing is written). */
void sl_seterr(char *err, size_t errlen, const char *fmt, ...) __attribute__((format(printf, 3, 4)));

#endif

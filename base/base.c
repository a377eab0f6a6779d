/* base.c - the assertion handler and error formatting of base.h. */
#include <stdarg.h>
#include <stdio.h>
#include <stdlib.h>

#include "base.h"

void sl_assert_fail(const char *expr, const char *file, int line)
{
    fprintf(stderr, "sluice: assertion failed: %s (%s:%d)\n", expr, file, line);
    fflush(stderr);
    abort();
}

void sl_seterr(char *err, size_t errlen, const char *fmt, ...)
{
    if (!err || !errlen) return;
    va_list ap;
    va_start(ap, fmt);
    vsnprintf(err, errlen, fmt, ap);
    va_end(ap);
}

/* util.c - the small shared pieces of model.h: the assertion handler. */
#include <stdio.h>
#include <stdlib.h>

#include "model.h"

void sl_assert_fail(const char *expr, const char *file, int line)
{
    fprintf(stderr, "sluice: assertion failed: %s (%s:%d)\n", expr, file, line);
    fflush(stderr);
    abort();
}

/* test.h - the smallest test harness that does what we need.
 *
 *   static void test_foo(void) { CHECK(x == 1); CHECKF(y < 2, "y=%d", y); }
 *   int main(void) { RUN(test_foo); return test_summary(); }
 *
 * Each RUN prints "ok   name" or "FAIL name" with the failed checks above it;
 * test_summary() prints "N passed, N failed" (tools/run_tests.sh sums them).
 */
#ifndef SLUICE_TEST_H
#define SLUICE_TEST_H

#include <stdio.h>
#include <stdlib.h>
#include <string.h>

static int t_pass, t_fail, t_cur_failed;

#define CHECK(c)                                                                          \
    do {                                                                                  \
        if (!(c)) {                                                                       \
            fprintf(stdout, "  %s:%d: CHECK(%s) failed\n", __FILE__, __LINE__, #c);      \
            t_cur_failed = 1;                                                             \
        }                                                                                 \
    } while (0)

#define CHECKF(c, ...)                                                                    \
    do {                                                                                  \
        if (!(c)) {                                                                       \
            fprintf(stdout, "  %s:%d: CHECK(%s) failed: ", __FILE__, __LINE__, #c);       \
            fprintf(stdout, __VA_ARGS__);                                                 \
            fputc('\n', stdout);                                                          \
            t_cur_failed = 1;                                                             \
        }                                                                                 \
    } while (0)

/* SLUICE_TEST_ONLY=text: run only the tests whose name contains text (for a
 * slow tool such as compute-sanitizer's racecheck on one kernel's tests) */
static inline int t_skip(const char *name)
{
    const char *only = getenv("SLUICE_TEST_ONLY");
    return only && *only && !strstr(name, only);
}

#define RUN(fn)                                                                           \
    if (t_skip(#fn)) {                                                                    \
    } else                                                                                \
    do {                                                                                  \
        t_cur_failed = 0;                                                                 \
        fn();                                                                             \
        if (t_cur_failed) {                                                               \
            t_fail++;                                                                     \
            printf("FAIL %s\n", #fn);                                                     \
        } else {                                                                          \
            t_pass++;                                                                     \
            printf("ok   %s\n", #fn);                                                     \
        }                                                                                 \
        fflush(stdout);                                                                   \
    } while (0)

static inline int test_summary(void)
{
    printf("%d passed, %d failed\n", t_pass, t_fail);
    return t_fail != 0;
}

/* The whole file at path, NUL-terminated (free() it); its length in *len when
 * len is not NULL. NULL when it cannot be read. */
static inline char *test_slurp(const char *path, size_t *len)
{
    FILE *f = fopen(path, "rb");
    if (!f) return NULL;
    fseek(f, 0, SEEK_END);
    long n = ftell(f);
    fseek(f, 0, SEEK_SET);
    char *b = malloc((size_t)n + 1);
    if (b && fread(b, 1, (size_t)n, f) != (size_t)n) {
        free(b);
        b = NULL;
    }
    fclose(f);
    if (b) {
        b[n] = 0;
        if (len) *len = (size_t)n;
    }
    return b;
}

/* Where the outside-reference data lives (vocab suites, chat templates; see
 * tests/data/README.md), relative to the repository root that tests run in. */
static inline const char *test_data_dir(void)
{
    return "tests/data";
}

#endif

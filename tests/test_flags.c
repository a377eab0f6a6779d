/* test_flags.c - the command-line layer's shared pieces (api/flags.c): flag
 * tables, sizes with suffixes, the engine sizes that depend on where the
 * model runs, and --kv-cache-dtype (model_kv_dtype). */
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "api/api.h"
#include "model/backend.h"
#include "test.h"

static void test_parse_bytes(void)
{
    CHECK(api_parse_bytes("2G") == 2LL << 30);
    CHECK(api_parse_bytes("512M") == 512LL << 20);
    CHECK(api_parse_bytes("64KiB") == 64LL << 10);
    CHECK(api_parse_bytes("1.5G") == 3LL << 29);
    CHECK(api_parse_bytes("1073741824") == 1073741824LL);
    CHECK(api_parse_bytes("") == -1 && api_parse_bytes("G") == -1 && api_parse_bytes("-1G") == -1);
    CHECK(api_parse_bytes("2X") == -1 && api_parse_bytes("2GG") == -1);
}

/* vLLM's GPU sizes on "cuda", ours on "cpu"; given values are kept, and a
 * default bends to a given value instead of contradicting it */
static void test_engine_defaults(void)
{
    long s = 0, b = 0;
    api_engine_defaults("cuda", &s, &b);
    CHECK(s == 256 && b == 8192);
    s = 0, b = 0;
    api_engine_defaults("cpu", &s, &b);
    CHECK(s == 64 && b == 1024);
    s = 32, b = 0;
    api_engine_defaults("cuda", &s, &b);
    CHECK(s == 32 && b == 8192);
    s = 0, b = 128;
    api_engine_defaults("cuda", &s, &b);
    CHECKF(s == 128 && b == 128, "seqs %ld, tokens %ld", s, b);
    s = 2048, b = 0;
    api_engine_defaults("cpu", &s, &b);
    CHECKF(s == 2048 && b == 2048, "seqs %ld, tokens %ld", s, b);
    s = 7, b = 9;
    api_engine_defaults("cuda", &s, &b);
    CHECK(s == 7 && b == 9);
}

static void test_flag_table(void)
{
    long n = 0;
    double x = 0;
    bool on = true;
    const char *str = NULL;
    const struct api_flag flags[] = {
        {"--n", API_FLAG_INT, &n, "", NULL},
        {"--x", API_FLAG_FLOAT, &x, "", NULL},
        {"--on", API_FLAG_BOOL, &on, "", "--no-on"},
        {"--s", API_FLAG_STR, &str, "", NULL},
        {0},
    };
    char *argv[] = {"sluice", "cmd", "--n", "12", "--x=0.5", "--no-on", "--s", "abc", "pos", NULL};
    const char *pos[2];
    char err[256];
    CHECK(api_parse_flags(9, argv, 2, flags, pos, 2, err, sizeof err) == 1);
    CHECK(n == 12 && x == 0.5 && !on && str && !strcmp(str, "abc") && !strcmp(pos[0], "pos"));
    char *bad[] = {"sluice", "cmd", "--nope", NULL};
    CHECK(api_parse_flags(3, bad, 2, flags, pos, 2, err, sizeof err) == -1 && strstr(err, "--nope"));
    char *badv[] = {"sluice", "cmd", "--n", "12x", NULL};
    CHECK(api_parse_flags(4, badv, 2, flags, pos, 2, err, sizeof err) == -1 && strstr(err, "--n"));
}

/* vLLM's --kv-cache-dtype: auto (or none) is the compute dtype; fp8 and
 * fp8_e4m3 are the fp8 cache, on the GPU only; fp8_e5m2 and anything else are
 * refused with a message naming the value */
static void test_kv_cache_dtype(void)
{
    struct {
        const char *dtype, *device;
        int rc;
        bool fp8;
    } cases[] = {
        {NULL, "cpu", 0, false},         {"auto", "cuda", 0, false},       {"fp8", "cuda", 0, true},
        {"fp8_e4m3", "cuda", 0, true},   {"fp8", "cpu", SL_EUNSUP, false}, {"fp8_e5m2", "cuda", SL_EUNSUP, false},
        {"bf8", "cuda", SL_EINVAL, false}, {"", "cuda", SL_EINVAL, false},
    };
    for (size_t i = 0; i < sizeof cases / sizeof cases[0]; i++) {
        struct model_backend_opts o = {.kv_cache_dtype = cases[i].dtype};
        bool fp8 = !cases[i].fp8;
        char err[256] = "";
        int rc = model_kv_dtype(&o, cases[i].device, &fp8, err, sizeof err);
        CHECKF(rc == cases[i].rc && fp8 == cases[i].fp8, "%s on %s: rc %d, fp8 %d (%s)",
               cases[i].dtype ? cases[i].dtype : "(none)", cases[i].device, rc, fp8, err);
        if (rc) CHECKF(strstr(err, cases[i].dtype) != NULL, "message '%s' does not name the value", err);
    }
    bool fp8 = true;
    CHECK(model_kv_dtype(NULL, "cuda", &fp8, NULL, 0) == 0 && !fp8);
}

int main(void)
{
    RUN(test_parse_bytes);
    RUN(test_engine_defaults);
    RUN(test_flag_table);
    RUN(test_kv_cache_dtype);
    return test_summary();
}

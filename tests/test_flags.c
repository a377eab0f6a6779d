/* test_flags.c - the command-line layer's shared pieces (api/flags.c): flag
 * tables, sizes with suffixes, the engine sizes that depend on where the
 * model runs, vLLM's human-readable integers, range messages that name the
 * flag, and --kv-cache-dtype (model_kv_dtype). */
#include <limits.h>
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "api/api.h"
#include "model/backend.h"
#include "sched/sched.h"
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

/* vLLM's human_readable_int: k m g t decimal (with decimals), K M G T
 * binary (without), plain integers as int() reads them, int range only */
static void test_human_int(void)
{
    struct {
        const char *s;
        long want;
    } ok[] = {
        {"4096", 4096},        {"32k", 32000},     {"25.6k", 25600},      {"32K", 32768},   {"1m", 1000000},
        {"1M", 1048576},       {"2g", 2000000000}, {"1G", 1073741824},    {"0.002t", 2000000000},
        {"1.005k", 1005},      {"1.2345k", 1234},  {" 8k ", 8000},        {"-5", -5},       {"+7", 7},
        {"0", 0},              {"2147483647", INT_MAX}, {"-2147483648", INT_MIN}, {"2.147483647g", INT_MAX},
    };
    for (size_t i = 0; i < sizeof ok / sizeof ok[0]; i++) {
        long v = -1;
        char err[256] = "";
        int rc = api_parse_human_int(ok[i].s, &v, err, sizeof err);
        CHECKF(rc == 0 && v == ok[i].want, "'%s': rc %d, %ld (want %ld) %s", ok[i].s, rc, v, ok[i].want, err);
    }
    struct {
        const char *s, *words;
    } bad[] = {
        {"1.5K", "did you mean 1.5k?"},   {"2.0G", "did you mean 2.0g?"}, {"", "expected an integer"},
        {"k", "expected an integer"},     {"1.k", "expected an integer"}, {".5k", "expected an integer"},
        {"1kk", "expected an integer"},   {"1x", "expected an integer"},  {"1.5", "expected an integer"},
        {"-1k", "expected an integer"},   {"1 k", "expected an integer"}, {"2147483648", "out of range"},
        {"-2147483649", "out of range"},  {"3g", "out of range"},         {"2T", "out of range"},
        {"2.147483648g", "out of range"}, {"99999999999999999999999", "out of range"},
    };
    for (size_t i = 0; i < sizeof bad / sizeof bad[0]; i++) {
        long v = 42;
        char err[256] = "";
        int rc = api_parse_human_int(bad[i].s, &v, err, sizeof err);
        CHECKF(rc == -1 && v == 42 && strstr(err, bad[i].words), "'%s': rc %d, %ld, '%s'", bad[i].s, rc, v, err);
    }
    /* through a flag table: the message names the flag and the value */
    long n = API_FLAG_UNSET;
    const struct api_flag flags[] = {{"--max-model-len", API_FLAG_HUMAN_INT, &n, "", NULL}, {0}};
    char *argv[] = {"sluice", "cmd", "--max-model-len=32k", NULL};
    char *badv[] = {"sluice", "cmd", "--max-model-len", "1.5K", NULL};
    const char *pos[1];
    char err[256];
    CHECK(api_parse_flags(3, argv, 2, flags, pos, 1, err, sizeof err) == 0 && n == 32000);
    CHECK(api_parse_flags(4, badv, 2, flags, pos, 1, err, sizeof err) == -1);
    CHECKF(strstr(err, "--max-model-len") && strstr(err, "'1.5K'") && strstr(err, "decimal"), "%s", err);
}

/* range messages name the flag, the value and the range; values left unset
 * (API_FLAG_UNSET, NAN) pass, and no integer flag parses to API_FLAG_UNSET */
static void test_flag_ranges(void)
{
    char err[256] = "";
    CHECK(api_flag_long_range("--port", 8000, 1, 65535, err, sizeof err) == 0);
    CHECK(api_flag_long_range("--port", 99999, 1, 65535, err, sizeof err) == -1);
    CHECKF(!strcmp(err, "--port 99999 is out of range (1..65535)"), "%s", err);
    CHECK(api_flag_long_range("--max-num-seqs", 0, 1, LONG_MAX, err, sizeof err) == -1);
    CHECKF(!strcmp(err, "--max-num-seqs 0 is out of range (at least 1)"), "%s", err);
    CHECK(api_flag_long_range("--max-num-seqs", API_FLAG_UNSET, 1, LONG_MAX, err, sizeof err) == 0);
    CHECK(api_flag_double_range("--gpu-memory-utilization", 1.5, 0, true, 1, err, sizeof err) == -1);
    CHECKF(!strcmp(err, "--gpu-memory-utilization 1.5 is out of range (above 0, at most 1)"), "%s", err);
    CHECK(api_flag_double_range("--gpu-memory-utilization", 0, 0, true, 1, err, sizeof err) == -1);
    CHECK(api_flag_double_range("--gpu-memory-utilization", 1, 0, true, 1, err, sizeof err) == 0);
    CHECK(api_flag_double_range("--gpu-memory-utilization", NAN, 0, true, 1, err, sizeof err) == 0);
    CHECK(api_flag_double_range("--min-p", -0.5, 0, false, 1, err, sizeof err) == -1);
    CHECKF(!strcmp(err, "--min-p -0.5 is out of range (0..1)"), "%s", err);
    CHECK(api_flag_double_range("--temperature", -1, 0, false, INFINITY, err, sizeof err) == -1);
    CHECKF(!strcmp(err, "--temperature -1 is out of range (at least 0)"), "%s", err);
    long n = 5;
    const struct api_flag flags[] = {{"--n", API_FLAG_INT, &n, "", NULL}, {0}};
    char *argv[] = {"sluice", "cmd", "--n", "-9223372036854775808", NULL};
    const char *pos[1];
    CHECK(api_parse_flags(4, argv, 2, flags, pos, 1, err, sizeof err) == -1 && n == 5);
}

/* vLLM's GPU sizes on "cuda", ours on "cpu", and the TTFT target for each;
 * given values are kept, and a default bends to a given value instead of
 * contradicting it */
static void test_engine_defaults(void)
{
    long s = 0, b = 0;
    double t = NAN;
    api_engine_defaults("cuda", &s, &b, &t);
    CHECK(s == 256 && b == 8192);
    CHECKF(t == SCHED_DEFAULT_TTFT_TARGET_GPU_S, "TTFT target %g on a GPU", t);
    s = 0, b = 0, t = NAN;
    api_engine_defaults("cpu", &s, &b, &t);
    CHECK(s == 64 && b == 1024);
    CHECKF(t == SCHED_DEFAULT_TTFT_TARGET_S, "TTFT target %g on the CPU", t);
    t = 0.3; /* given: kept */
    api_engine_defaults("cuda", &s, &b, &t);
    CHECK(t == 0.3);
    s = 32, b = 0;
    api_engine_defaults("cuda", &s, &b, &t);
    CHECK(s == 32 && b == 8192);
    s = 0, b = 128;
    api_engine_defaults("cuda", &s, &b, &t);
    CHECKF(s == 128 && b == 128, "seqs %ld, tokens %ld", s, b);
    s = 2048, b = 0;
    api_engine_defaults("cpu", &s, &b, &t);
    CHECKF(s == 2048 && b == 2048, "seqs %ld, tokens %ld", s, b);
    s = 7, b = 9;
    api_engine_defaults("cuda", &s, &b, &t);
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
    RUN(test_human_int);
    RUN(test_flag_ranges);
    RUN(test_kv_cache_dtype);
    return test_summary();
}

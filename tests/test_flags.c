/* test_flags.c - the command-line layer's shared pieces (api/flags.c): flag
 * tables, sizes with suffixes, and the engine sizes that depend on where the
 * model runs. */
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "api/api.h"
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

int main(void)
{
    RUN(test_parse_bytes);
    RUN(test_engine_defaults);
    RUN(test_flag_table);
    return test_summary();
}

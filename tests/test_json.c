/* test_json.c - the jsmn wrapper: grammar, escapes, surrogate pairs, nested
 * skipping, trailing garbage, numbers, and the string builder. */
#include <math.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "base/json.h"
#include "model/model.h"
#include "tests/test.h"

static int parse(json_doc *d, const char *s)
{
    char err[256];
    return json_parse(d, s, strlen(s), err, sizeof err);
}

static void check_basic(void)
{
    json_doc d;
    const char *s = " {\"a\": 1, \"b\": [true, false, null, \"x\"], \"c\": {\"d\": -2.5e1}} \n";
    CHECK(parse(&d, s) == 0);
    CHECK(json_is_obj(&d, 0) && json_size(&d, 0) == 3);
    int a = json_get(&d, 0, "a"), b = json_get(&d, 0, "b"), c = json_get(&d, 0, "c");
    int64_t iv;
    double dv;
    bool bv;
    CHECK(json_is_num(&d, a) && json_i64(&d, a, &iv) == 0 && iv == 1);
    CHECK(json_is_arr(&d, b) && json_size(&d, b) == 4);
    CHECK(json_bool(&d, json_at(&d, b, 0), &bv) == 0 && bv);
    CHECK(json_bool(&d, json_at(&d, b, 1), &bv) == 0 && !bv);
    CHECK(json_is_null(&d, json_at(&d, b, 2)) && !json_is_num(&d, json_at(&d, b, 2)));
    CHECK(json_str_eq(&d, json_at(&d, b, 3), "x"));
    CHECK(json_at(&d, b, 4) == -1 && json_at(&d, b, -1) == -1 && json_at(&d, a, 0) == -1);
    CHECK(json_f64(&d, json_get(&d, c, "d"), &dv) == 0 && dv == -25.0);
    CHECK(json_get(&d, 0, "zz") == -1 && json_get(&d, b, "a") == -1 && json_get(&d, 0, "d") == -1);
    CHECK(json_bool(&d, a, &bv) == -1 && json_i64(&d, b, &iv) == -1 && json_f64(&d, json_at(&d, b, 3), &dv) == -1);
    CHECK(!json_is_obj(&d, -1) && !json_is_str(&d, 999) && json_size(&d, 999) == 0);
    json_free(&d);
    json_free(&d); /* twice is harmless */

    CHECK(parse(&d, "42") == 0 && json_i64(&d, 0, &iv) == 0 && iv == 42);
    json_free(&d);
    CHECK(parse(&d, " \"s\" ") == 0 && json_str_eq(&d, 0, "s"));
    json_free(&d);
    CHECK(parse(&d, "[]") == 0 && json_size(&d, 0) == 0 && json_at(&d, 0, 0) == -1);
    json_free(&d);
    CHECK(parse(&d, "{}") == 0 && json_get(&d, 0, "") == -1);
    json_free(&d);
}

static void check_escapes(void)
{
    json_doc d;
    char out[128];
    const char *s = "[\"q\\\"b\\\\s\\/b\\bf\\fn\\nr\\rt\\t\", \"\\u00e9\\u20AC\", \"\\ud83d\\ude00\","
                    " \"\\ud83d\", \"\\ude00x\", \"\\ud83d\\u0041\", \"\\u0000z\", \"plain\", \"\"]";
    CHECK(parse(&d, s) == 0);
    CHECK(json_str(&d, json_at(&d, 0, 0), out, sizeof out) == 16);
    CHECK(memcmp(out, "q\"b\\s/b\bf\fn\nr\rt\t", 17) == 0);
    CHECK(json_str(&d, json_at(&d, 0, 1), out, sizeof out) == 5 && strcmp(out, "\xC3\xA9\xE2\x82\xAC") == 0);
    /* a surrogate pair is one 4-byte code point */
    CHECK(json_str(&d, json_at(&d, 0, 2), out, sizeof out) == 4 && strcmp(out, "\xF0\x9F\x98\x80") == 0);
    /* lone surrogates become U+FFFD */
    CHECK(json_str(&d, json_at(&d, 0, 3), out, sizeof out) == 3 && strcmp(out, "\xEF\xBF\xBD") == 0);
    CHECK(json_str(&d, json_at(&d, 0, 4), out, sizeof out) == 4 && strcmp(out, "\xEF\xBF\xBDx") == 0);
    CHECK(json_str(&d, json_at(&d, 0, 5), out, sizeof out) == 4 && strcmp(out, "\xEF\xBF\xBD" "A") == 0);
    /* \u0000 is a real NUL byte: the length says so */
    CHECK(json_str(&d, json_at(&d, 0, 6), out, sizeof out) == 2 && out[0] == '\0' && out[1] == 'z');
    size_t len = 0;
    char *dup = json_strdup(&d, json_at(&d, 0, 6), &len);
    CHECK(dup && len == 2 && dup[1] == 'z');
    free(dup);
    dup = json_strdup(&d, json_at(&d, 0, 8), &len);
    CHECK(dup && len == 0 && dup[0] == '\0');
    free(dup);
    CHECK(json_strdup(&d, 0, &len) == NULL); /* not a string */
    CHECK(json_str(&d, 0, out, sizeof out) == -1);
    /* truncation: the full length comes back, the output is cut and NUL-terminated */
    CHECK(json_str(&d, json_at(&d, 0, 7), out, 3) == 5 && strcmp(out, "pl") == 0);
    CHECK(json_str(&d, json_at(&d, 0, 7), NULL, 0) == 5);
    CHECK(json_str(&d, json_at(&d, 0, 1), out, 2) == 5 && strlen(out) == 1);
    /* equality through escapes */
    CHECK(json_str_eq(&d, json_at(&d, 0, 2), "\xF0\x9F\x98\x80"));
    CHECK(!json_str_eq(&d, json_at(&d, 0, 2), "\xF0\x9F\x98"));
    CHECK(json_str_eq(&d, json_at(&d, 0, 8), "") && !json_str_eq(&d, json_at(&d, 0, 7), "plai"));
    const char *raw;
    raw = json_raw(&d, json_at(&d, 0, 1), &len);
    CHECK(len == 12 && memcmp(raw, "\\u00e9\\u20AC", 12) == 0);
    json_free(&d);

    /* a long escaped key is still found */
    char big[1200], key[600];
    memset(key, 'k', 500);
    key[500] = '\0';
    snprintf(big, sizeof big, "{\"%.*s\\n\": 7}", 500, key);
    key[500] = '\n';
    key[501] = '\0';
    CHECK(parse(&d, big) == 0);
    int64_t iv;
    CHECK(json_i64(&d, json_get(&d, 0, key), &iv) == 0 && iv == 7);
    json_free(&d);
}

static void check_nested_skip(void)
{
    json_doc d;
    const char *s = "{\"a\":{\"b\":[1,{\"c\":[[],{}]},[2,[3]]],\"d\":{\"e\":{}}},\"f\":[{\"g\":1},{\"g\":2}],"
                    "\"h\":\"end\"}";
    CHECK(parse(&d, s) == 0);
    int h = json_get(&d, 0, "h");
    CHECK(json_str_eq(&d, h, "end"));
    CHECK(json_skip(&d, 0) == d.n);
    int a = json_get(&d, 0, "a");
    CHECK(json_skip(&d, a) == json_get(&d, 0, "f") - 1); /* next key */
    int f = json_get(&d, 0, "f");
    int64_t g;
    CHECK(json_i64(&d, json_get(&d, json_at(&d, f, 1), "g"), &g) == 0 && g == 2);
    int b = json_get(&d, a, "b");
    CHECK(json_size(&d, b) == 3 && json_is_arr(&d, json_at(&d, b, 2)) && json_size(&d, json_at(&d, b, 2)) == 2);
    CHECK(json_is_obj(&d, json_get(&d, json_get(&d, a, "d"), "e")));
    json_free(&d);

    /* deep but reasonable nesting works; absurd nesting is refused, not a stack overflow */
    static char deep[200002];
    for (int i = 0; i < 100; i++) deep[i] = '[';
    for (int i = 0; i < 100; i++) deep[100 + i] = ']';
    deep[200] = '\0';
    CHECK(parse(&d, deep) == 0 && json_skip(&d, 0) == 100);
    json_free(&d);
    for (int i = 0; i < 100000; i++) deep[i] = '[';
    for (int i = 0; i < 100000; i++) deep[100000 + i] = ']';
    deep[200000] = '\0';
    CHECK(parse(&d, deep) != 0);
}

static void check_invalid(void)
{
    const char *bad[] = {
        "", "   ", "{", "}", "[1,]", "{\"a\":1,}", "{\"a\"}", "{,}", "[\"a\":1]", "{\"a\":1:2}",
        "{\"a\":1 \"b\":2}", "[1 2]", "tru", "[nul]", "[01]", "[0x10]", "[1.]", "[.5]", "[-]", "[1e]",
        "[inf]", "[NaN]", "[\"a\tb\"]", "[\"a\nb\"]", "{\"a\":[1,2}", "[\"\\x\"]", "[\"\\u12\"]",
        "[\"\\u12g4\"]", "{1:2}", "[true false]", "{\"a\":}", "[,1]", "[1,,2]", "[+1]", "[- 1]", "[\"abc]",
        "'a'", "[True]", "{\"a\" 1}", "[1]x",
    };
    for (size_t i = 0; i < sizeof bad / sizeof bad[0]; i++) {
        json_doc d;
        char err[256] = "";
        int rc = json_parse(&d, bad[i], strlen(bad[i]), err, sizeof err);
        CHECKF(rc == SL_EINVAL && strstr(err, "invalid JSON"), "accepted or no message: '%s' (%s)", bad[i], err);
        CHECK(d.tok == NULL && d.n == 0); /* nothing allocated on error */
    }
    /* trailing garbage after a complete value */
    const char *trail[] = {"{} {}", "{}x", "[1]]", "\"a\" \"b\"", "1 2", "{\"a\":1}}", "null null"};
    for (size_t i = 0; i < sizeof trail / sizeof trail[0]; i++) {
        json_doc d;
        char err[256] = "";
        CHECKF(json_parse(&d, trail[i], strlen(trail[i]), err, sizeof err) == SL_EINVAL && strstr(err, "trailing"),
               "'%s': %s", trail[i], err);
    }
    /* length is honored: the text need not be NUL-terminated */
    json_doc d;
    char err[64];
    CHECK(json_parse(&d, "[1]garbage", 3, err, sizeof err) == 0 && json_size(&d, 0) == 1);
    json_free(&d);
    CHECK(json_parse(&d, "[1]", 2, err, sizeof err) == SL_EINVAL && strstr(err, "truncated"));
}

static void check_numbers(void)
{
    json_doc d;
    const char *s = "[9007199254740993, 9223372036854775807, -9223372036854775808, 9223372036854775808,"
                    " 1.5, 1e3, -0, 2.0E+2, 1e-320, 1e400, -1e400, 0.1, 123456789012345678901234567890,"
                    " 0.000000000000000000000000000000000000000000000000000000000000000000000000000001]";
    CHECK(parse(&d, s) == 0);
    int64_t iv;
    double dv;
    CHECK(json_i64(&d, json_at(&d, 0, 0), &iv) == 0 && iv == 9007199254740993ll); /* beyond 2^53, exact */
    CHECK(json_i64(&d, json_at(&d, 0, 1), &iv) == 0 && iv == INT64_MAX);
    CHECK(json_i64(&d, json_at(&d, 0, 2), &iv) == 0 && iv == INT64_MIN);
    CHECK(json_i64(&d, json_at(&d, 0, 3), &iv) == -1); /* out of range */
    CHECK(json_i64(&d, json_at(&d, 0, 4), &iv) == -1); /* not an integer */
    CHECK(json_f64(&d, json_at(&d, 0, 4), &dv) == 0 && dv == 1.5);
    CHECK(json_i64(&d, json_at(&d, 0, 5), &iv) == 0 && iv == 1000);
    CHECK(json_i64(&d, json_at(&d, 0, 6), &iv) == 0 && iv == 0);
    CHECK(json_i64(&d, json_at(&d, 0, 7), &iv) == 0 && iv == 200);
    CHECK(json_f64(&d, json_at(&d, 0, 8), &dv) == 0 && dv > 0 && dv < 1e-300); /* subnormal */
    CHECK(json_f64(&d, json_at(&d, 0, 9), &dv) == -1 && json_f64(&d, json_at(&d, 0, 10), &dv) == -1);
    CHECK(json_f64(&d, json_at(&d, 0, 11), &dv) == 0 && dv == 0.1);
    CHECK(json_i64(&d, json_at(&d, 0, 12), &iv) == -1);
    CHECK(json_f64(&d, json_at(&d, 0, 12), &dv) == 0 && dv > 1.2e29);
    CHECK(json_f64(&d, json_at(&d, 0, 13), &dv) == 0 && fabs(dv - 1e-78) < 1e-90); /* long literal */
    json_free(&d);
}

static void check_buf(void)
{
    struct json_buf b;
    json_buf_init(&b);
    const char raw[] = "a\"b\\c\nd\re\tf\x01g\x1fh/\xC3\xA9";
    json_buf_add(&b, "{\"k\":", 5);
    json_buf_add_str(&b, raw, sizeof raw - 1);
    json_buf_addf(&b, ",\"n\":%d}", 42);
    CHECK(!b.oom && b.p && strlen(b.p) == b.len);
    CHECK(strstr(b.p, "\\u0001") && strstr(b.p, "\\u001f") && strstr(b.p, "\\\"") && strstr(b.p, "\\n"));
    json_doc d;
    CHECK(parse(&d, b.p) == 0);
    char out[64];
    CHECK(json_str(&d, json_get(&d, 0, "k"), out, sizeof out) == (long)(sizeof raw - 1));
    CHECK(memcmp(out, raw, sizeof raw - 1) == 0);
    int64_t n;
    CHECK(json_i64(&d, json_get(&d, 0, "n"), &n) == 0 && n == 42);
    json_free(&d);
    /* a long formatted append */
    char longs[1000];
    memset(longs, 'x', sizeof longs - 1);
    longs[sizeof longs - 1] = '\0';
    size_t before = b.len;
    json_buf_addf(&b, "%s", longs);
    CHECK(b.len == before + 999 && b.p[b.len] == '\0');
    json_buf_free(&b);
    CHECK(b.p == NULL && b.len == 0);
}

/* The writer always produces valid UTF-8: each byte that does not start a
 * valid sequence becomes U+FFFD; valid sequences pass unchanged. */
static void check_buf_utf8(void)
{
    static const struct { const char *in; const char *out; } cases[] = {
        {"caf\xc3\xa9 \xe6\x9d\xb1 \xf0\x9f\x9a\x80", "\"caf\xc3\xa9 \xe6\x9d\xb1 \xf0\x9f\x9a\x80\""},
        {"a\xff" "b", "\"a\xef\xbf\xbd" "b\""},                 /* invalid byte */
        {"\xc3", "\"\xef\xbf\xbd\""},                        /* truncated sequence */
        {"\xc0\xaf", "\"\xef\xbf\xbd\xef\xbf\xbd\""},       /* overlong '/' */
        {"\xed\xa0\x80", "\"\xef\xbf\xbd\xef\xbf\xbd\xef\xbf\xbd\""}, /* surrogate */
        {"\xf4\x90\x80\x80", "\"\xef\xbf\xbd\xef\xbf\xbd\xef\xbf\xbd\xef\xbf\xbd\""}, /* > U+10FFFF */
        {"x\x01\"", "\"x\\u0001\\\"\""},
    };
    for (size_t i = 0; i < sizeof cases / sizeof cases[0]; i++) {
        struct json_buf b;
        json_buf_init(&b);
        json_buf_add_str(&b, cases[i].in, strlen(cases[i].in));
        CHECKF(b.p && !strcmp(b.p, cases[i].out), "case %zu: got %s", i, b.p ? b.p : "(null)");
        json_buf_free(&b);
    }
}

int main(void)
{
    RUN(check_basic);
    RUN(check_escapes);
    RUN(check_nested_skip);
    RUN(check_invalid);
    RUN(check_numbers);
    RUN(check_buf);
    RUN(check_buf_utf8);
    return test_summary();
}

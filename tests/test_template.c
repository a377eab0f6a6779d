/* test_template.c - the chat template engine against Python jinja2.
 *
 * Golden: every template in tests/data/templates/ rendered on every
 * conversation of tests/golden/templates/conversations.json must equal, byte
 * for byte, what tests/golden/templates/make_golden.py (jinja2 in HF
 * transformers' environment) wrote to expected.json - or fail where jinja2
 * failed. Then: unit cases for the semantics templates lean on, errors that
 * name the construct and line, and a fuzz pass (truncated and mutated
 * templates: no crash, no hang).
 */
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

#include "base/json.h"
#include "model/model.h"
#include "test.h"

#define GOLDEN "tests/golden/templates"

/* Appends the members of the object at i (without braces) to b. */
static void add_members(struct json_buf *b, const json_doc *d, int i)
{
    size_t n;
    const char *raw = json_raw(d, i, &n);
    if (n < 2 || json_size(d, i) == 0) return;
    json_buf_lit(b, ",");
    json_buf_add(b, raw + 1, n - 2);
}

/* The render context make_golden.py builds for a case. */
static void case_ctx(struct json_buf *b, const json_doc *d, int defaults, int c)
{
    size_t n;
    const char *raw;
    json_buf_lit(b, "{\"messages\":");
    raw = json_raw(d, json_get(d, c, "messages"), &n);
    json_buf_add(b, raw, n);
    json_buf_lit(b, ",\"tools\":");
    int t = json_get(d, c, "tools");
    if (t >= 0) {
        raw = json_raw(d, t, &n);
        json_buf_add(b, raw, n);
    } else {
        json_buf_lit(b, "null");
    }
    json_buf_lit(b, ",\"documents\":null,\"add_generation_prompt\":");
    bool agp = false;
    int g = json_get(d, c, "add_generation_prompt");
    if (g >= 0) json_bool(d, g, &agp);
    json_buf_addf(b, "%s", agp ? "true" : "false");
    add_members(b, d, defaults);
    int k = json_get(d, c, "kwargs");
    if (k >= 0) add_members(b, d, k);
    json_buf_lit(b, "}");
}

static void test_golden(void)
{
    size_t clen, elen;
    char *conv = test_slurp(GOLDEN "/conversations.json", &clen);
    char *exp = test_slurp(GOLDEN "/expected.json", &elen);
    CHECK(conv && exp);
    if (!conv || !exp) goto done_files;
    json_doc cd, ed;
    char err[512];
    CHECKF(json_parse(&cd, conv, clen, err, sizeof err) == 0, "%s", err);
    CHECKF(json_parse(&ed, exp, elen, err, sizeof err) == 0, "%s", err);
    int cases = json_get(&cd, 0, "cases"), defaults = json_get(&cd, 0, "defaults");
    int64_t now = 0;
    json_i64(&cd, json_get(&cd, 0, "now"), &now);
    struct model_tmpl_opts opts = {.now = now};
    int total = 0, match = 0, n_out = 0, n_err = 0;
    int nt = json_size(&ed, 0);
    for (int k = 0, p = 1; k < nt; k++, p = json_skip(&ed, p + 1)) {
        char name[256], path[1024];
        json_str(&ed, p, name, sizeof name);
        snprintf(path, sizeof path, "%s/templates/%s", test_data_dir(), name);
        size_t slen;
        char *src = test_slurp(path, &slen);
        CHECKF(src != NULL, "cannot read %s", path);
        if (!src) continue;
        model_tmpl *t = model_tmpl_create(src, slen, err, sizeof err);
        CHECKF(t != NULL, "%s: %s", name, err);
        int exp_obj = p + 1, tmatch = 0, ttotal = 0;
        int nc = json_size(&cd, cases);
        for (int j = 0, c = cases + 1; j < nc; j++, c = json_skip(&cd, c)) {
            char cname[64];
            json_str(&cd, json_get(&cd, c, "name"), cname, sizeof cname);
            int e = json_get(&ed, exp_obj, cname);
            if (e < 0) continue;
            int eo = json_get(&ed, e, "out");
            total++, ttotal++;
            struct json_buf ctx;
            json_buf_init(&ctx);
            case_ctx(&ctx, &cd, defaults, c);
            char *out = NULL;
            size_t olen = 0;
            int rc = t ? model_tmpl_render(t, ctx.p, ctx.len, &opts, &out, &olen, err, sizeof err) : -1;
            if (eo >= 0) {
                size_t xlen;
                char *want = json_strdup(&ed, eo, &xlen);
                bool ok = rc == 0 && want && olen == xlen && !memcmp(out, want, xlen);
                if (ok) match++, tmatch++, n_out++;
                else if (rc) printf("  %s / %s: error: %s\n", name, cname, err);
                else {
                    size_t at = 0;
                    while (at < olen && at < xlen && out[at] == want[at]) at++;
                    printf("  %s / %s: differs at byte %zu of %zu/%zu\n    got:  ...%.80s\n    want: ...%.80s\n", name,
                           cname, at, olen, xlen, out + (at > 20 ? at - 20 : 0), want + (at > 20 ? at - 20 : 0));
                }
                free(want);
            } else {
                /* jinja2 failed on this one (raise_exception, type error): so must we */
                if (rc != 0) match++, tmatch++, n_err++;
                else printf("  %s / %s: rendered, but jinja2 failed\n", name, cname);
            }
            free(out);
            json_buf_free(&ctx);
        }
        printf("  %-55s %2d/%2d\n", name, tmatch, ttotal);
        model_tmpl_destroy(t);
        free(src);
    }
    printf("  golden: %d/%d template x conversation cases match (%d renderings, %d expected errors)\n", match, total,
           n_out, n_err);
    CHECK(total > 300);
    CHECKF(match == total, "%d of %d cases differ", total - match, total);
    json_free(&cd);
    json_free(&ed);
done_files:
    free(conv);
    free(exp);
}

/* Renders src with ctx; returns the output (static buffer) or "ERR: msg". */
static const char *render(const char *src, const char *ctx)
{
    static char buf[4096];
    char err[512];
    model_tmpl *t = model_tmpl_create(src, strlen(src), err, sizeof err);
    if (!t) {
        snprintf(buf, sizeof buf, "ERR: %s", err);
        return buf;
    }
    char *out;
    size_t n;
    struct model_tmpl_opts o = {.now = 1721995200};
    if (model_tmpl_render(t, ctx ? ctx : "{}", strlen(ctx ? ctx : "{}"), &o, &out, &n, err, sizeof err)) {
        snprintf(buf, sizeof buf, "ERR: %s", err);
    } else {
        snprintf(buf, sizeof buf, "%s", out);
        free(out);
    }
    model_tmpl_destroy(t);
    return buf;
}

#define EXPECT(src, ctx, want)                                                                     \
    do {                                                                                           \
        const char *got_ = render(src, ctx);                                                       \
        CHECKF(!strcmp(got_, want), "%s\n    got:  [%s]\n    want: [%s]", src, got_, want);        \
    } while (0)

/* Expected values were checked against jinja2 3.1 with trim_blocks/lstrip_blocks. */
static void test_semantics(void)
{
    EXPECT("a\n  {% if true %}\n  x\n  {% endif %}\nb", NULL, "a\n  x\nb");
    EXPECT("a {%- if true -%} x {%- endif %} b", NULL, "ax b");
    EXPECT("{{ 'x' }}\n{# c #}\ny", NULL, "x\ny");
    EXPECT("{% for i in range(3) %}{{ loop.index }}{{ ',' if not loop.last }}{% endfor %}", NULL, "1,2,3");
    EXPECT("{% for i in [] %}x{% else %}empty{% endfor %}", NULL, "empty");
    EXPECT("{% for i in range(5) %}{% if i == 1 %}{% continue %}{% endif %}{% if i == 3 %}{% break %}{% endif %}{{ i }}{% endfor %}",
           NULL, "02");
    EXPECT("{% set ns = namespace(n=0) %}{% for i in range(4) %}{% set ns.n = ns.n + i %}{% endfor %}{{ ns.n }}", NULL, "6");
    EXPECT("{% set x = 0 %}{% for i in range(3) %}{% set x = x + 1 %}{% endfor %}{{ x }}", NULL, "0");
    EXPECT("{{ [1, 'a', none, true, 2.5, {'k': [1]}] }}", NULL, "[1, 'a', None, True, 2.5, {'k': [1]}]");
    EXPECT("{{ {'a': 'é\"', 'b': [1, 2.0, none]} | tojson }}", NULL, "{\"a\": \"é\\\"\", \"b\": [1, 2.0, null]}");
    EXPECT("{{ {'a': [1, {}], 'b': []} | tojson(indent=2) }}", NULL, "{\n  \"a\": [\n    1,\n    {}\n  ],\n  \"b\": []\n}");
    EXPECT("{{ 'é' | tojson(ensure_ascii=true) }}", NULL, "\"\\u00e9\"");
    EXPECT("{{ '  a b  '.strip() }}|{{ 'a,b,,c'.split(',') }}|{{ 'x y  z'.split() }}", NULL, "a b|['a', 'b', '', 'c']|['x', 'y', 'z']");
    EXPECT("{{ 'héllo'[1:3] }}{{ 'abc'[::-1] }}{{ [1,2,3][-1] }}{{ 'héllo' | length }}", NULL, "élcba35");
    EXPECT("{{ 1e20 }} {{ 0.1 + 0.2 }} {{ 7 // 2 }} {{ -7 // 2 }} {{ 7 / 2 }} {{ 2 ** 10 }} {{ -7 % 3 }}", NULL,
           "1e+20 0.30000000000000004 3 -4 3.5 1024 2");
    EXPECT("{{ x is defined }} {{ x | default('d') }} {{ none is none }} {{ 'a' is string }} {{ {} is mapping }}", NULL,
           "False d True True True");
    EXPECT("{{ [{'a': 1}, {'a': 2}, {'b': 3}] | selectattr('a', 'defined') | map(attribute='a') | join(',') }}", NULL, "1,2");
    EXPECT("{{ [{'a': 1}, {'a': 2}] | selectattr('a', 'equalto', 2) | list }}", NULL, "[{'a': 2}]");
    EXPECT("{% macro m(a, b='B') %}[{{ a }}{{ b }}]{% endmacro %}{{ m(1) }}{{ m(1, b=2) }}", NULL, "[1B][12]");
    EXPECT("{% macro m() %}<{{ caller() }}>{% endmacro %}{% call m() %}in{% endcall %}", NULL, "<in>");
    EXPECT("{% filter upper %}abc{% endfilter %}", NULL, "ABC");
    EXPECT("{% set b %}x{{ 1 }}{% endset %}{{ b }}", NULL, "x1");
    EXPECT("{{ 'a' if false }}|{{ 'a' ~ none ~ 1 }}|{{ 'hello world' | title }}|{{ 'ab' * 2 }}", NULL, "|aNone1|Hello World|abab");
    EXPECT("{{ m.content }}", "{\"m\": {\"content\": \"hi\"}}", "hi");
    EXPECT("{{ m.get('x', 'dflt') }} {{ m.get('y') }} {{ m | items | list }}", "{\"m\": {\"x\": 1}}", "1 None [('x', 1)]");
    EXPECT("{{ strftime_now('%d %b %Y') }}", NULL, "26 Jul 2024");
    EXPECT("{{ 'a\\nb' | indent(2) }}|{{ 'a\\nb' | indent(2, true) }}", NULL, "a\n  b|  a\n  b");
    EXPECT("{% raw %}{{ x }}{% endraw %}", NULL, "{{ x }}");
    EXPECT("{{ raise_exception('boom') }}", NULL, "ERR: boom");
    /* errors name the construct and the line */
    EXPECT("a\n{% include 'x' %}", NULL, "ERR: chat template line 2: unsupported tag 'include'");
    EXPECT("{{ x | frobnicate }}", NULL, "ERR: chat template line 1: unsupported filter 'frobnicate'");
    EXPECT("\n\n{{ x is frob }}", NULL, "ERR: chat template line 3: unsupported test 'frob'");
    EXPECT("{% if x %}", NULL, "ERR: chat template line 1: 'if' block is never closed (missing {% elif %})");
    EXPECT("{{ x.y }}", NULL, "ERR: chat template line 1: 'x' is undefined");
    EXPECT("{{ none.y.z }}", NULL, "ERR: chat template line 1: 'None' has no attribute 'y'");
    EXPECT("{{ 'a' + 1 }}", NULL, "ERR: chat template line 1: can only concatenate str (not \"int\") to str");
    EXPECT("{{ [1] | map(attribute='x') | tojson }}", NULL,
           "ERR: chat template line 1: Object of type generator is not JSON serializable");
    EXPECT("{% for i in range(1000000) %}{% endfor %}", NULL,
           "ERR: chat template line 1: range too big, maximum size for range is 100000");
    EXPECT("{% macro f(n) %}{{ f(n) }}{% endmacro %}{{ f(1) }}", NULL, "ERR: chat template line 1: macro recursion too deep");
    EXPECT("{{ messages }}", "[1]", "ERR: template context must be a JSON object");
}

static uint64_t rng = 88172645463325252ull;
static uint64_t rnd(void)
{
    rng ^= rng << 13;
    rng ^= rng >> 7;
    rng ^= rng << 17;
    return rng;
}

/* Truncated and mutated real templates, rendered on a small conversation:
 * any outcome but a crash or a hang is fine. */
static void test_fuzz(void)
{
    const char *ctx = "{\"messages\":[{\"role\":\"system\",\"content\":\"s\"},{\"role\":\"user\",\"content\":\"u\"},"
                      "{\"role\":\"assistant\",\"content\":\"a\",\"tool_calls\":[{\"type\":\"function\",\"function\":"
                      "{\"name\":\"f\",\"arguments\":{\"x\":1}}}]},{\"role\":\"tool\",\"content\":\"r\"}],"
                      "\"tools\":[{\"type\":\"function\",\"function\":{\"name\":\"f\",\"parameters\":{}}}],"
                      "\"add_generation_prompt\":true,\"bos_token\":\"<s>\",\"eos_token\":\"</s>\"}";
    static const char *const inserts[] = {"{{", "}}", "{%", "%}", "{#", "(", ")", "[", "]", "'", "\"", "|", "-", "\n",
                                          "{% for x in y %}", "{% endfor %}", "{% if", "endif", "\\", ".", ",", "~",
                                          "{% set a = ", "{% macro", " is ", " not ", "**", "{%- raw -%}", "\xff"};
    char path[1024];
    snprintf(path, sizeof path, "%s/templates", test_data_dir());
    static const char *const names[] = {"zai-org-GLM-4.6.jinja", "Qwen-Qwen3-0.6B.jinja", "meta-llama-Llama-3.1-8B-Instruct.jinja",
                                        "openai-gpt-oss-120b.jinja", "moonshotai-Kimi-K2.jinja", "deepseek-ai-DeepSeek-V3.1.jinja",
                                        "mistralai-Mistral-Nemo-Instruct-2407.jinja", "google-gemma-2-2b-it.jinja"};
    int runs = 0, parsed = 0, rendered = 0;
    clock_t t0 = clock();
    for (size_t k = 0; k < sizeof names / sizeof *names; k++) {
        char file[1200];
        snprintf(file, sizeof file, "%s/%s", path, names[k]);
        size_t len;
        char *src = test_slurp(file, &len);
        CHECKF(src != NULL, "cannot read %s", file);
        if (!src) continue;
        char *buf = malloc(len + 64);
        const char *env = getenv("SLUICE_FUZZ_ITERS"); /* a longer run: SLUICE_FUZZ_ITERS=100000 */
        int iters = env && atoi(env) > 0 ? atoi(env) : 300;
        for (int it = 0; it < iters; it++) {
            size_t n;
            if (it < iters / 3) {
                n = (size_t)(rnd() % (len + 1)); /* truncated */
                memcpy(buf, src, n);
            } else {
                memcpy(buf, src, len);
                n = len;
                int muts = 1 + (int)(rnd() % 4);
                for (int m = 0; m < muts; m++) {
                    size_t at = (size_t)(rnd() % (n + 1));
                    int kind = (int)(rnd() % 3);
                    if (kind == 0 && n) buf[at % n] = (char)(rnd() & 0xff);
                    else if (kind == 1 && n > 8) {
                        size_t del = 1 + (size_t)(rnd() % 8);
                        if (at + del > n) at = n - del;
                        memmove(buf + at, buf + at + del, n - at - del);
                        n -= del;
                    } else {
                        const char *ins = inserts[rnd() % (sizeof inserts / sizeof *inserts)];
                        size_t il = strlen(ins);
                        if (n + il > len + 60) continue;
                        memmove(buf + at + il, buf + at, n - at);
                        memcpy(buf + at, ins, il);
                        n += il;
                    }
                }
            }
            char err[256];
            model_tmpl *t = model_tmpl_create(buf, n, err, sizeof err);
            runs++;
            if (!t) {
                CHECKF(err[0] != 0, "parse failed without a message");
                continue;
            }
            parsed++;
            char *out;
            size_t olen;
            struct model_tmpl_opts o = {.now = 1, .max_bytes = (size_t)64 << 20};
            if (model_tmpl_render(t, ctx, strlen(ctx), &o, &out, &olen, err, sizeof err) == 0) {
                rendered++;
                free(out);
            } else {
                CHECKF(err[0] != 0, "render failed without a message");
            }
            model_tmpl_destroy(t);
        }
        free(buf);
        free(src);
    }
    printf("  fuzz: %d templates, %d parsed, %d rendered (%.1f s)\n", runs, parsed, rendered,
           (double)(clock() - t0) / CLOCKS_PER_SEC);
}

int main(void)
{
    RUN(test_golden);
    RUN(test_semantics);
    RUN(test_fuzz);
    return test_summary();
}

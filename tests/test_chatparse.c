/* test_chatparse.c - reasoning and tool-call parsers (api/reasoning.c,
 * api/toolcall.c) on model outputs in the formats the models write: whole,
 * then split at every byte boundary (two pieces) and byte by byte, which must
 * all give the same reasoning, content and tool calls. */
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "api/openai.h"
#include "test.h"

struct out {
    struct json_buf r, c, calls;
};

static void out_init(struct out *o)
{
    json_buf_init(&o->r);
    json_buf_init(&o->c);
    json_buf_init(&o->calls);
}

static void out_free(struct out *o)
{
    json_buf_free(&o->r);
    json_buf_free(&o->c);
    json_buf_free(&o->calls);
}

/* The text of b, with tool-call ids (a hash of the call) replaced by "ID". */
static const char *S(struct json_buf *b)
{
    if (!b->p) return "";
    char *p;
    while ((p = strstr(b->p, "\"id\":\"call_"))) {
        char *q = strchr(p + 11, '"');
        if (!q) break;
        memcpy(p + 6, "ID", 2);
        memmove(p + 8, q, strlen(q) + 1);
        b->len = strlen(b->p);
    }
    return b->p;
}

/* Runs text through reasoning (rk) then tool calls (tk), fed in pieces cut at
 * cuts[0..nc). */
static void run(int rk, int tk, const char *text, const size_t *cuts, int nc, struct out *o)
{
    struct api_reasoning rp;
    struct api_toolcall tp;
    api_reasoning_init(&rp, rk);
    api_toolcall_init(&tp, tk);
    struct json_buf content;
    json_buf_init(&content);
    size_t len = strlen(text), at = 0;
    for (int k = 0; k <= nc; k++) {
        size_t end = k < nc ? cuts[k] : len;
        size_t before = content.len;
        api_reasoning_feed(&rp, text + at, end - at, &o->r, &content);
        api_toolcall_feed(&tp, content.p ? content.p + before : "", content.len - before, &o->c, &o->calls);
        at = end;
    }
    size_t before = content.len;
    api_reasoning_flush(&rp, &o->r, &content);
    api_toolcall_feed(&tp, content.p ? content.p + before : "", content.len - before, &o->c, &o->calls);
    api_toolcall_flush(&tp, &o->c, &o->calls);
    api_toolcall_free(&tp);
    json_buf_free(&content);
}

static void check_case(int rk, int tk, const char *text, const char *want_r, const char *want_c, const char *want_calls)
{
    struct out whole;
    out_init(&whole);
    run(rk, tk, text, NULL, 0, &whole);
    CHECKF(!strcmp(S(&whole.r), want_r), "reasoning [%s] want [%s]", S(&whole.r), want_r);
    CHECKF(!strcmp(S(&whole.c), want_c), "content [%s] want [%s]", S(&whole.c), want_c);
    CHECKF(!strcmp(S(&whole.calls), want_calls), "calls [%s] want [%s]", S(&whole.calls), want_calls);
    size_t len = strlen(text);
    int bad = 0;
    for (size_t cut = 1; cut < len; cut++) {
        struct out o;
        out_init(&o);
        run(rk, tk, text, &cut, 1, &o);
        if (strcmp(S(&o.r), want_r) || strcmp(S(&o.c), want_c) || strcmp(S(&o.calls), want_calls)) {
            if (!bad++) printf("  split at %zu: r=[%s] c=[%s] calls=[%s]\n", cut, S(&o.r), S(&o.c), S(&o.calls));
        }
        out_free(&o);
    }
    size_t *cuts = malloc(len * sizeof *cuts);
    for (size_t i = 0; i + 1 < len; i++) cuts[i] = i + 1;
    struct out o;
    out_init(&o);
    run(rk, tk, text, cuts, len > 1 ? (int)len - 1 : 0, &o);
    if (strcmp(S(&o.r), want_r) || strcmp(S(&o.c), want_c) || strcmp(S(&o.calls), want_calls)) bad++;
    out_free(&o);
    free(cuts);
    CHECKF(bad == 0, "%d splits of [%.40s...] differ from the whole", bad, text);
    out_free(&whole);
}

static void test_reasoning(void)
{
    CHECK(api_reasoning_lookup("glm45") == API_REASONING_GLM45);
    CHECK(api_reasoning_lookup("deepseek_r1") == API_REASONING_DEEPSEEK_R1);
    CHECK(api_reasoning_lookup("qwen3") == API_REASONING_QWEN3);
    CHECK(api_reasoning_lookup("nope") == -1);
    /* R1: the prompt opened <think> */
    check_case(API_REASONING_DEEPSEEK_R1, 0, "Let me think: 2+2=4.\n</think>\n\nThe answer is 4.",
               "Let me think: 2+2=4.\n", "\n\nThe answer is 4.", "");
    check_case(API_REASONING_DEEPSEEK_R1, 0, "<think>hmm</think>ok", "hmm", "ok", "");
    check_case(API_REASONING_DEEPSEEK_R1, 0, "still thinking <b> </thin", "still thinking <b> </thin", "", "");
    /* qwen3 / glm45: <think>...</think> anywhere */
    check_case(API_REASONING_QWEN3, 0, "<think>\nThe user greets.\n</think>\n\nHello! <thinking> is fine", "\nThe user greets.\n",
               "\n\nHello! <thinking> is fine", "");
    check_case(API_REASONING_GLM45, 0, "no thinking at all < <t", "", "no thinking at all < <t", "");
    check_case(API_REASONING_GLM45, 0, "<think></think>Answer: é日本", "", "Answer: é日本", "");
    check_case(API_REASONING_NONE, 0, "<think>x</think>y", "", "<think>x</think>y", "");
}

static void test_toolcalls(void)
{
    CHECK(api_toolcall_lookup("glm47") == API_TOOLS_GLM47);
    CHECK(api_toolcall_lookup("hermes") == API_TOOLS_HERMES);
    CHECK(api_toolcall_lookup("x") == -1);
    /* hermes (Qwen): arguments re-serialized as json.dumps writes them */
    check_case(0, API_TOOLS_HERMES,
               "I'll check.\n<tool_call>\n{\"name\": \"get_weather\", \"arguments\": {\"city\":\"Paris\",\"days\":[1,2],\"u\":\"\\u00e9\"}}\n</tool_call>",
               "", "I'll check.\n",
               "{\"index\":0,\"id\":\"ID\",\"type\":\"function\",\"function\":{\"name\":\"get_weather\","
               "\"arguments\":\"{\\\"city\\\": \\\"Paris\\\", \\\"days\\\": [1, 2], \\\"u\\\": \\\"é\\\"}\"}}");
    /* two calls */
    check_case(0, API_TOOLS_HERMES,
               "<tool_call>{\"name\": \"a\", \"arguments\": {}}</tool_call>\n<tool_call>{\"name\": \"b\", \"arguments\": {\"x\": 1}}</tool_call>",
               "", "\n",
               "{\"index\":0,\"id\":\"ID\",\"type\":\"function\",\"function\":{\"name\":\"a\",\"arguments\":\"{}\"}},"
               "{\"index\":1,\"id\":\"ID\",\"type\":\"function\",\"function\":{\"name\":\"b\",\"arguments\":\"{\\\"x\\\": 1}\"}}");
    /* malformed: plain content */
    check_case(0, API_TOOLS_HERMES, "<tool_call>{not json}</tool_call> tail", "", "<tool_call>{not json}</tool_call> tail", "");
    check_case(0, API_TOOLS_HERMES, "text <tool_call>{\"name\": \"a\"", "", "text <tool_call>{\"name\": \"a\"", "");
    /* GLM 4.5/4.6/4.7 */
    check_case(API_REASONING_GLM45, API_TOOLS_GLM47,
               "<think>Need weather.</think>\n<tool_call>get_weather\n<arg_key>city</arg_key>\n<arg_value>Paris</arg_value>\n"
               "<arg_key>days</arg_key>\n<arg_value>3</arg_value>\n<arg_key>opts</arg_key><arg_value>{\"a\":true}</arg_value>\n</tool_call>",
               "Need weather.", "\n",
               "{\"index\":0,\"id\":\"ID\",\"type\":\"function\",\"function\":{\"name\":\"get_weather\","
               "\"arguments\":\"{\\\"city\\\": \\\"Paris\\\", \\\"days\\\": 3, \\\"opts\\\": {\\\"a\\\": true}}\"}}");
    check_case(0, API_TOOLS_GLM47, "<tool_call>now</tool_call>", "", "",
               "{\"index\":0,\"id\":\"ID\",\"type\":\"function\",\"function\":{\"name\":\"now\",\"arguments\":\"{}\"}}");
    check_case(0, API_TOOLS_GLM47, "<tool_call>f<arg_key>x</arg_key>oops</tool_call>", "",
               "<tool_call>f<arg_key>x</arg_key>oops</tool_call>", "");
}

int main(void)
{
    RUN(test_reasoning);
    RUN(test_toolcalls);
    return test_summary();
}

/* test_openai.c - request validation in api/openai.c, api/chat.c and
 * api/responses.c: NUL characters carried through the chat render and the
 * completion prompt, the template's own variables kept out of
 * chat_template_kwargs, and a 400 naming the field for every wrong type.
 * No model: the chat renders with ChatML (no api_chat_setup). */
#include <string.h>

#include "api/openai.h"
#include "test.h"

/* Parses body for kind; returns the status (200 when it parsed) and leaves
 * the parsed request in *r (freed by the caller) or the error in *e. */
static int parse(const char *body, enum api_oai_endpoint kind, struct api_oai_req *r, struct api_oai_error *e)
{
    memset(e, 0, sizeof *e);
    int rc = api_oai_parse(body, strlen(body), kind, NULL, r, e);
    return rc ? e->status : 200;
}

/* body must be refused with a 400 whose param is param. */
static void expect_400(const char *body, enum api_oai_endpoint kind, const char *param)
{
    struct api_oai_req r;
    struct api_oai_error e;
    int st = parse(body, kind, &r, &e);
    CHECKF(st == 400 && !strcmp(e.param, param), "%s -> %d param '%s' (%s), want 400 '%s'", body, st, e.param,
           e.message, param);
    api_oai_req_free(&r);
}

static void expect_ok(const char *body, enum api_oai_endpoint kind)
{
    struct api_oai_req r;
    struct api_oai_error e;
    int st = parse(body, kind, &r, &e);
    CHECKF(st == 200, "%s -> %d %s", body, st, e.message);
    api_oai_req_free(&r);
}

#define CHAT(extra) "{\"messages\":[{\"role\":\"user\",\"content\":\"hi\"}]" extra "}"

static void test_nul_kept_in_chat(void)
{
    struct api_oai_req r;
    struct api_oai_error e;
    const char *body = "{\"messages\":[{\"role\":\"system\",\"content\":\"sys\\u0000tem\"},"
                       "{\"role\":\"user\",\"content\":[{\"type\":\"text\",\"text\":\"a\\u0000b\"}]},"
                       "{\"role\":\"user\",\"content\":\"second\"}]}";
    CHECK(parse(body, API_OAI_CHAT, &r, &e) == 200);
    static const char want[] = "<|im_start|>system\nsys\0tem<|im_end|>\n<|im_start|>user\na\0b<|im_end|>\n"
                       "<|im_start|>user\nsecond<|im_end|>\n<|im_start|>assistant\n";
    size_t wn = sizeof want - 1;
    CHECKF(r.prompt_text && r.prompt_len == wn && !memcmp(r.prompt_text, want, wn), "len %zu: %s", r.prompt_len,
           r.prompt_text ? r.prompt_text : "(null)");
    CHECK(r.prompt_text && strlen(r.prompt_text) < r.prompt_len); /* the NULs are in it */
    api_oai_req_free(&r);
}

static void test_nul_kept_in_completions(void)
{
    struct api_oai_req r;
    struct api_oai_error e;
    CHECK(parse("{\"prompt\":\"ab\\u0000cd\"}", API_OAI_COMPLETIONS, &r, &e) == 200);
    CHECK(r.prompt_len == 5 && r.prompt_text && !memcmp(r.prompt_text, "ab\0cd", 5));
    api_oai_req_free(&r);
    CHECK(parse("{\"prompt\":[\"x\\u0000\",\"\\u0000\\u0000yz\"]}", API_OAI_COMPLETIONS, &r, &e) == 200);
    CHECK(r.n_prompts == 2 && r.prompt_lens && r.prompt_lens[0] == 2 && r.prompt_lens[1] == 4);
    CHECK(r.n_prompts == 2 && !memcmp(r.prompts[1], "\0\0yz", 4));
    api_oai_req_free(&r);
    /* where a C string is all the engine takes, a NUL is refused, not cut short */
    expect_400("{\"prompt\":\"x\",\"stop\":[\"ok\",\"a\\u0000b\"]}", API_OAI_COMPLETIONS, "stop");
    expect_400(CHAT(",\"model\":\"smol\\u0000x\""), API_OAI_CHAT, "model");
}

static void test_kwargs_cannot_override(void)
{
    static const char *const keys[] = {"messages", "tools", "add_generation_prompt", "documents",
                                       "continue_final_message", "bos_token", "eos_token", "chat_template",
                                       "tokenize", "raise_exception", "namespace", "range", "strftime_now"};
    for (size_t k = 0; k < sizeof keys / sizeof *keys; k++) {
        char body[256], param[64];
        snprintf(body, sizeof body, CHAT(",\"chat_template_kwargs\":{\"x\":1,\"%s\":[]}"), keys[k]);
        snprintf(param, sizeof param, "chat_template_kwargs.%s", keys[k]);
        expect_400(body, API_OAI_CHAT, param);
    }
    /* the template's own switches and new variables stay allowed */
    expect_ok(CHAT(",\"chat_template_kwargs\":{\"enable_thinking\":false,\"custom\":\"v\"}"), API_OAI_CHAT);
    expect_400(CHAT(",\"chat_template_kwargs\":[]"), API_OAI_CHAT, "chat_template_kwargs");
    /* the override that bypassed the non-empty check */
    expect_400("{\"messages\":[{\"role\":\"user\",\"content\":\"x\"}],\"chat_template_kwargs\":{\"messages\":[]}}",
               API_OAI_CHAT, "chat_template_kwargs.messages");
    expect_400(CHAT(",\"chat_template\":\"{{ 'x' }}\""), API_OAI_CHAT, "chat_template");
}

static void test_wrong_types_chat(void)
{
    expect_400(CHAT(",\"user\":5"), API_OAI_CHAT, "user");
    expect_400(CHAT(",\"tool_choice\":5"), API_OAI_CHAT, "tool_choice");
    expect_400(CHAT(",\"tool_choice\":\"sometimes\""), API_OAI_CHAT, "tool_choice");
    expect_400(CHAT(",\"tool_choice\":\"required\""), API_OAI_CHAT, "tool_choice"); /* no tools to choose */
    expect_400(CHAT(",\"echo\":1"), API_OAI_CHAT, "echo");
    expect_400(CHAT(",\"echo\":true"), API_OAI_CHAT, "echo");
    expect_400(CHAT(",\"model\":null"), API_OAI_CHAT, "model");
    expect_400(CHAT(",\"model\":5"), API_OAI_CHAT, "model");
    expect_400("{\"messages\":[{\"role\":\"user\"}]}", API_OAI_CHAT, "messages[0].content");
    expect_400("{\"messages\":[{\"role\":\"user\",\"content\":\"a\"},{\"role\":\"system\",\"content\":null}]}",
               API_OAI_CHAT, "messages[1].content");
    expect_400("{\"messages\":[{\"role\":\"user\",\"content\":\"a\",\"name\":5}]}", API_OAI_CHAT, "messages[0].name");
    expect_400("{\"messages\":[{\"role\":\"tool\",\"content\":\"a\",\"tool_call_id\":[]}]}", API_OAI_CHAT,
               "messages[0].tool_call_id");
    expect_400("{\"messages\":[{\"role\":\"assistant\",\"tool_calls\":{}}]}", API_OAI_CHAT, "messages[0].tool_calls");
    expect_400("{\"messages\":[{\"role\":\"assistant\",\"tool_calls\":[{\"function\":{\"name\":5}}]}]}", API_OAI_CHAT,
               "messages[0].tool_calls");
    expect_400("{\"messages\":[{\"role\":5,\"content\":\"a\"}]}", API_OAI_CHAT, "messages[0].role");
    expect_400(CHAT(",\"tools\":5"), API_OAI_CHAT, "tools");
    expect_400(CHAT(",\"tools\":[{\"type\":\"function\",\"function\":{\"name\":\"f\",\"parameters\":5}}]"),
               API_OAI_CHAT, "tools[0]");
    expect_400(CHAT(",\"tools\":[{\"type\":\"retrieval\"}]"), API_OAI_CHAT, "tools[0]");
    expect_400(CHAT(",\"parallel_tool_calls\":\"yes\""), API_OAI_CHAT, "parallel_tool_calls");
    expect_400(CHAT(",\"metadata\":5"), API_OAI_CHAT, "metadata");
    expect_400(CHAT(",\"store\":\"no\""), API_OAI_CHAT, "store");
    expect_400(CHAT(",\"stream_options\":5"), API_OAI_CHAT, "stream_options");
    expect_400(CHAT(",\"priority\":\"high\""), API_OAI_CHAT, "priority");
    expect_400(CHAT(",\"skip_special_tokens\":0"), API_OAI_CHAT, "skip_special_tokens");
    expect_400(CHAT(",\"reasoning_effort\":1"), API_OAI_CHAT, "reasoning_effort");
    expect_400(CHAT(",\"add_generation_prompt\":\"yes\""), API_OAI_CHAT, "add_generation_prompt");
    expect_400(CHAT(",\"enable_thinking\":1"), API_OAI_CHAT, "enable_thinking");
    /* features a reply could not show it ignored */
    expect_400(CHAT(",\"guided_whitespace_pattern\":\" \""), API_OAI_CHAT, "guided_whitespace_pattern");
    /* structured outputs: what cannot be honoured names its field */
    expect_ok(CHAT(",\"guided_json\":{\"type\":\"object\"},\"guided_decoding_backend\":\"xgrammar\""), API_OAI_CHAT);
    expect_ok(CHAT(",\"structured_outputs\":{\"regex\":\"[a-z]+\",\"disable_fallback\":true}"), API_OAI_CHAT);
    expect_ok("{\"prompt\":\"hi\",\"guided_choice\":[\"a\",\"b\"]}", API_OAI_COMPLETIONS);
    expect_400(CHAT(",\"guided_json\":{\"type\":\"object\",\"properties\":{\"a\":{\"not\":{}}}}"), API_OAI_CHAT,
               "guided_json");
    expect_400(CHAT(",\"guided_json\":\"{nope\""), API_OAI_CHAT, "guided_json");
    expect_400(CHAT(",\"guided_regex\":\"(a\""), API_OAI_CHAT, "guided_regex");
    expect_400(CHAT(",\"guided_choice\":\"a\""), API_OAI_CHAT, "guided_choice");
    expect_400(CHAT(",\"guided_regex\":\"a\",\"guided_grammar\":\"root ::= \\\"a\\\"\""), API_OAI_CHAT,
               "guided_grammar");
    expect_400(CHAT(",\"structured_outputs\":{\"regex\":\"a\",\"choice\":[\"b\"]}"), API_OAI_CHAT,
               "structured_outputs");
    expect_400(CHAT(",\"structured_outputs\":{\"grammar\":\"root ::= \\\"a\\\" root\"}"), API_OAI_CHAT,
               "structured_outputs.grammar");
    expect_400(CHAT(",\"structured_outputs\":{\"structural_tag\":\"{}\"}"), API_OAI_CHAT, "structured_outputs");
    expect_400(CHAT(",\"structured_outputs\":5"), API_OAI_CHAT, "structured_outputs");
    expect_400(CHAT(",\"response_format\":{\"type\":\"json_object\"},\"guided_regex\":\"a\""), API_OAI_CHAT,
               "guided_regex");
    expect_400(CHAT(",\"use_beam_search\":true"), API_OAI_CHAT, "use_beam_search");
    expect_400(CHAT(",\"prompt_logprobs\":21"), API_OAI_CHAT, "prompt_logprobs");
    expect_400(CHAT(",\"prompt_logprobs\":1,\"stream\":true"), API_OAI_CHAT, "prompt_logprobs");
    expect_400(CHAT(",\"allowed_token_ids\":[]"), API_OAI_CHAT, "allowed_token_ids");
    expect_400(CHAT(",\"allowed_token_ids\":[-1]"), API_OAI_CHAT, "allowed_token_ids");
    expect_400(CHAT(",\"bad_words\":[\"\"]"), API_OAI_CHAT, "bad_words");
    expect_400(CHAT(",\"truncate_prompt_tokens\":0"), API_OAI_CHAT, "truncate_prompt_tokens");
    expect_400(CHAT(",\"continue_final_message\":true,\"add_generation_prompt\":true"), API_OAI_CHAT,
               "continue_final_message");
    expect_ok(CHAT(",\"prompt_logprobs\":1,\"include_stop_str_in_output\":true,\"skip_special_tokens\":false,"
                   "\"bad_words\":[\"x\"],\"allowed_token_ids\":[1,2],\"truncate_prompt_tokens\":-1"), API_OAI_CHAT);
    expect_ok(CHAT(",\"use_beam_search\":false,\"prompt_logprobs\":null,\"guided_json\":null"), API_OAI_CHAT);
    /* both names of the token limit are checked, whichever wins */
    expect_400(CHAT(",\"max_completion_tokens\":5,\"max_tokens\":\"x\""), API_OAI_CHAT, "max_tokens");
    expect_400(CHAT(",\"max_completion_tokens\":\"x\",\"max_tokens\":5"), API_OAI_CHAT, "max_completion_tokens");
    /* right types still pass; an assistant turn may carry tool calls alone */
    expect_ok(CHAT(",\"user\":\"u1\",\"echo\":false,\"parallel_tool_calls\":true,\"metadata\":{\"a\":\"b\"},"
                   "\"model\":\"m\",\"tool_choice\":\"none\",\"stream_options\":null,\"priority\":0"),
              API_OAI_CHAT);
    expect_ok("{\"messages\":[{\"role\":\"user\",\"content\":\"a\"},{\"role\":\"assistant\",\"tool_calls\":[{\"id\":"
              "\"c1\",\"type\":\"function\",\"function\":{\"name\":\"f\",\"arguments\":\"{}\"}}]},{\"role\":\"tool\","
              "\"tool_call_id\":\"c1\",\"content\":\"r\"}]}",
              API_OAI_CHAT);
    expect_ok("{\"messages\":[{\"role\":\"user\",\"content\":\"a\"}]}", API_OAI_CHAT); /* no model: allowed */
}

static void test_wrong_types_completions(void)
{
    expect_400("{\"prompt\":\"a\",\"user\":5}", API_OAI_COMPLETIONS, "user");
    expect_400("{\"prompt\":\"a\",\"echo\":1}", API_OAI_COMPLETIONS, "echo");
    expect_400("{\"prompt\":\"a\",\"model\":null}", API_OAI_COMPLETIONS, "model");
    expect_400("{\"prompt\":\"a\",\"max_tokens\":\"4\"}", API_OAI_COMPLETIONS, "max_tokens");
    expect_400("{\"prompt\":\"a\",\"stream\":\"true\"}", API_OAI_COMPLETIONS, "stream");
    expect_400("{\"prompt\":\"a\",\"logprobs\":true}", API_OAI_COMPLETIONS, "logprobs");
    expect_400("{\"prompt\":\"a\",\"add_special_tokens\":\"no\"}", API_OAI_COMPLETIONS, "add_special_tokens");
    expect_400("{\"prompt\":5}", API_OAI_COMPLETIONS, "prompt");
    expect_ok("{\"prompt\":\"a\",\"user\":\"u\",\"echo\":false,\"model\":\"m\"}", API_OAI_COMPLETIONS);
    /* chat-only fields are not looked at on completions (vLLM ignores unknown fields) */
    expect_ok("{\"prompt\":\"a\",\"parallel_tool_calls\":5}", API_OAI_COMPLETIONS);
}

/* A Responses body through api_resp_to_chat then api_oai_parse, as the server runs it. */
static int resp(const char *body, struct api_oai_error *e)
{
    struct json_buf chat;
    json_buf_init(&chat);
    memset(e, 0, sizeof *e);
    int st = 200;
    if (api_resp_to_chat(body, strlen(body), &chat, e)) {
        st = e->status;
    } else {
        struct api_oai_req r;
        if (api_oai_parse(chat.p, chat.len, API_OAI_CHAT, NULL, &r, e)) {
            api_resp_chat_error(e);
            st = e->status;
        }
        api_oai_req_free(&r);
    }
    json_buf_free(&chat);
    return st;
}

static void test_responses_fields(void)
{
    struct api_oai_error e;
    static const struct { const char *body, *param; } bad[] = {
        {"{\"input\":\"hi\",\"text\":5}", "text"},
        {"{\"input\":\"hi\",\"text\":{\"format\":5}}", "text.format"},
        {"{\"input\":\"hi\",\"text\":{\"format\":{\"type\":\"xml\"}}}", "text.format"},
        {"{\"input\":\"hi\",\"text\":{\"format\":{\"type\":\"json_schema\"}}}", "text.format.schema"},
        {"{\"input\":\"hi\",\"tools\":5}", "tools"},
        {"{\"input\":\"hi\",\"tool_choice\":5}", "tool_choice"},
        {"{\"input\":\"hi\",\"user\":5}", "user"},
        {"{\"input\":\"hi\",\"store\":\"no\"}", "store"},
        {"{\"input\":\"hi\",\"metadata\":[]}", "metadata"},
        {"{\"input\":\"hi\",\"truncation\":\"sometimes\"}", "truncation"},
        {"{\"input\":\"hi\",\"background\":true}", "background"},
        {"{\"input\":\"hi\",\"max_output_tokens\":\"x\"}", "max_output_tokens"},
        {"{\"input\":\"hi\",\"max_output_tokens\":0}", "max_output_tokens"},
        {"{\"input\":\"hi\",\"model\":null}", "model"},
        {"{\"input\":\"hi\",\"temperature\":\"hot\"}", "temperature"},
        {"{\"input\":[{\"role\":\"user\",\"content\":5}]}", "input"},
    };
    for (size_t k = 0; k < sizeof bad / sizeof *bad; k++) {
        int st = resp(bad[k].body, &e);
        CHECKF(st == 400 && !strcmp(e.param, bad[k].param), "%s -> %d '%s' (%s), want '%s'", bad[k].body, st,
               e.param, e.message, bad[k].param);
    }
    CHECK(resp("{\"input\":\"hi\",\"text\":{\"format\":{\"type\":\"text\"}},\"store\":false,\"user\":\"u\","
               "\"max_output_tokens\":16,\"truncation\":\"disabled\"}", &e) == 200);
    /* an error found on the chat body names the Responses field, in param and message */
    struct api_oai_error x = {0};
    api_oai_errorf(&x, 400, "max_tokens", "you requested 9 tokens ('max_tokens' too large); max_tokens_x stays");
    api_resp_chat_error(&x);
    CHECKF(!strcmp(x.param, "max_output_tokens") &&
               !strcmp(x.message, "you requested 9 tokens ('max_output_tokens' too large); max_tokens_x stays"),
           "%s / %s", x.param, x.message);
    api_oai_errorf(&x, 400, "messages[2].content", "'messages[2].content' is required");
    api_resp_chat_error(&x);
    CHECK(!strcmp(x.param, "input"));
}

int main(void)
{
    RUN(test_nul_kept_in_chat);
    RUN(test_nul_kept_in_completions);
    RUN(test_kwargs_cannot_override);
    RUN(test_wrong_types_chat);
    RUN(test_wrong_types_completions);
    RUN(test_responses_fields);
    return test_summary();
}

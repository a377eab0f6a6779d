/* openai.c - OpenAI chat/completions bodies: parse + validate, prompt,
 * sched_request, and the response JSON (see openai.h). */
#include <math.h>
#include <stdarg.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

#include "openai.h"

#define ADD_LIT(b, lit) json_buf_add((b), (lit), sizeof(lit) - 1)

/* ---- errors ---------------------------------------------------------------------- */

int api_oai_errorf(struct api_oai_error *e, int status, const char *param, const char *fmt, ...)
{
    e->status = status;
    e->type = status == 404 ? "NotFoundError" : status >= 500 ? "InternalServerError" : "invalid_request_error";
    snprintf(e->param, sizeof e->param, "%s", param ? param : "");
    va_list ap;
    va_start(ap, fmt);
    vsnprintf(e->message, sizeof e->message, fmt, ap);
    va_end(ap);
    return SL_EINVAL;
}

void api_oai_error_json(struct json_buf *b, const struct api_oai_error *e)
{
    json_buf_addf(b, "{\"error\":{\"message\":");
    json_buf_add_str(b, e->message, strlen(e->message));
    json_buf_addf(b, ",\"type\":\"%s\",\"param\":", e->type ? e->type : "invalid_request_error");
    if (e->param[0]) json_buf_add_str(b, e->param, strlen(e->param));
    else ADD_LIT(b, "null");
    json_buf_addf(b, ",\"code\":%d}}", e->status);
}

int api_oai_check_utf8(const char *body, size_t len, struct api_oai_error *e)
{
    const unsigned char *s = (const unsigned char *)body;
    for (size_t i = 0; i < len;) {
        unsigned c = s[i];
        if (c < 0x80) {
            i++;
            continue;
        }
        int k = c >= 0xC2 && c <= 0xDF ? 1 : c >= 0xE0 && c <= 0xEF ? 2 : c >= 0xF0 && c <= 0xF4 ? 3 : -1;
        bool ok = k > 0 && i + (size_t)k < len;
        if (ok) {
            unsigned c1 = s[i + 1];
            /* the second byte's range rules out overlong forms, surrogates and > U+10FFFF */
            unsigned lo = c == 0xE0 ? 0xA0 : c == 0xF0 ? 0x90 : 0x80, hi = c == 0xED ? 0x9F : c == 0xF4 ? 0x8F : 0xBF;
            ok = c1 >= lo && c1 <= hi;
            for (int j = 2; ok && j <= k; j++) ok = (s[i + (size_t)j] & 0xC0) == 0x80;
        }
        if (!ok)
            return api_oai_errorf(e, 400, NULL, "the request body is not valid UTF-8 (byte %zu: 0x%02x)", i, c);
        i += (size_t)k + 1;
    }
    return 0;
}

/* ---- parsing helpers ------------------------------------------------------------- */

/* The value of key in obj, or -1 when absent or null. */
static int opt(const json_doc *d, int obj, const char *key)
{
    int i = json_get(d, obj, key);
    return i < 0 || json_is_null(d, i) ? -1 : i;
}

/* Reads an optional number in [lo, hi] (lo excluded when lo_open). 1 when
 * read, 0 when absent, negative with *e filled when invalid. */
static int num_in(const json_doc *d, int obj, const char *key, double lo, double hi, bool lo_open, double *out,
                  struct api_oai_error *e)
{
    int i = opt(d, obj, key);
    if (i < 0) return 0;
    double v;
    if (!json_is_num(d, i) || json_f64(d, i, &v) || !isfinite(v))
        return api_oai_errorf(e, 400, key, "'%s' must be a number", key);
    if (v < lo || v > hi || (lo_open && v == lo))
        return api_oai_errorf(e, 400, key, "'%s' must be %s %g and at most %g, got %g", key,
                              lo_open ? "greater than" : "at least", lo, hi, v);
    *out = v;
    return 1;
}

static int int_in(const json_doc *d, int obj, const char *key, int64_t lo, int64_t hi, int64_t *out,
                  struct api_oai_error *e)
{
    int i = opt(d, obj, key);
    if (i < 0) return 0;
    int64_t v;
    if (!json_is_num(d, i) || json_i64(d, i, &v))
        return api_oai_errorf(e, 400, key, "'%s' must be an integer", key);
    if (v < lo || v > hi)
        return api_oai_errorf(e, 400, key, "'%s' must be between %lld and %lld, got %lld", key, (long long)lo,
                              (long long)hi, (long long)v);
    *out = v;
    return 1;
}

static int bool_opt(const json_doc *d, int obj, const char *key, bool *out, struct api_oai_error *e)
{
    int i = opt(d, obj, key);
    if (i < 0) return 0;
    if (!json_is_bool(d, i) || json_bool(d, i, out))
        return api_oai_errorf(e, 400, key, "'%s' must be a boolean", key);
    return 1;
}

/* Fields that are read elsewhere (the server, the template) or accepted
 * without effect: their types are still checked, so a client's mistake
 * (user: 5) is a 400 naming the field, as the OpenAI server and vLLM's
 * pydantic models answer, not a 200 that ignored it. */
enum ftype { F_STR, F_BOOL, F_INT, F_NUM, F_OBJ, F_ARR, F_STR_OR_OBJ };
struct fcheck {
    const char *key;
    enum ftype type;
    int kinds; /* 1: chat, 2: completions */
};
static const struct fcheck field_types[] = {
    {"user", F_STR, 3}, {"request_id", F_STR, 3}, {"service_tier", F_STR, 3},
    {"stream_options", F_OBJ, 3}, {"priority", F_INT, 3}, {"metadata", F_OBJ, 1}, {"store", F_BOOL, 1},
    {"skip_special_tokens", F_BOOL, 3}, {"spaces_between_special_tokens", F_BOOL, 3},
    {"include_stop_str_in_output", F_BOOL, 3}, {"add_special_tokens", F_BOOL, 3}, {"use_beam_search", F_BOOL, 3},
    {"return_tokens_as_token_ids", F_BOOL, 3}, {"truncate_prompt_tokens", F_INT, 3}, {"prompt_logprobs", F_INT, 3},
    {"length_penalty", F_NUM, 3}, {"echo", F_BOOL, 1}, {"parallel_tool_calls", F_BOOL, 1},
    {"reasoning_effort", F_STR, 1}, {"include_reasoning", F_BOOL, 1}, {"continue_final_message", F_BOOL, 1},
    {"documents", F_ARR, 1}, {"functions", F_ARR, 1}, {"function_call", F_STR_OR_OBJ, 1}, {"modalities", F_ARR, 1},
    {"audio", F_OBJ, 1}, {"prediction", F_OBJ, 1}, {"web_search_options", F_OBJ, 1},
};

static int check_field_types(const json_doc *d, int obj, enum api_oai_endpoint kind, struct api_oai_error *e)
{
    static const char *const names[] = {"a string", "a boolean", "an integer", "a number", "an object",
                                        "an array", "a string or an object"};
    for (size_t k = 0; k < sizeof field_types / sizeof *field_types; k++) {
        const struct fcheck *f = &field_types[k];
        if (!(f->kinds & (kind == API_OAI_CHAT ? 1 : 2))) continue;
        int i = opt(d, obj, f->key);
        if (i < 0) continue;
        int64_t iv;
        bool ok = f->type == F_STR    ? json_is_str(d, i)
                : f->type == F_BOOL   ? json_is_bool(d, i)
                : f->type == F_INT    ? json_is_num(d, i) && json_i64(d, i, &iv) == 0
                : f->type == F_NUM    ? json_is_num(d, i)
                : f->type == F_OBJ    ? json_is_obj(d, i)
                : f->type == F_ARR    ? json_is_arr(d, i)
                                      : json_is_str(d, i) || json_is_obj(d, i);
        if (!ok) return api_oai_errorf(e, 400, f->key, "'%s' must be %s", f->key, names[f->type]);
    }
    /* vLLM features not built here: a reply that silently ignored them would
     * look like one that honoured them (unconstrained text for guided_json) */
    bool b = false;
    if (kind == API_OAI_CHAT && bool_opt(d, obj, "echo", &b, e) == 1 && b)
        return api_oai_errorf(e, 400, "echo", "'echo' is not supported on chat completions yet");
    if (bool_opt(d, obj, "use_beam_search", &b, e) == 1 && b)
        return api_oai_errorf(e, 400, "use_beam_search", "'use_beam_search' is not supported yet");
    static const char *const unsupported[] = {"guided_whitespace_pattern"};
    for (size_t k = 0; k < sizeof unsupported / sizeof *unsupported; k++)
        if (opt(d, obj, unsupported[k]) >= 0)
            return api_oai_errorf(e, 400, unsupported[k], "'%s' is not supported yet", unsupported[k]);
    return 0;
}

/* tool_choice "required" with several tools: the output is a JSON array of
 * one or more {"name": <a tool>, "parameters": <its arguments>}, guided by
 * the union of the tools' schemas (vLLM's shape for required). */
static int parse_required_list(const json_doc *d, int tools, struct api_oai_req *r, struct api_oai_error *e)
{
    struct json_buf sb;
    json_buf_init(&sb);
    json_buf_lit(&sb, "{\"type\":\"array\",\"minItems\":1,\"items\":{\"anyOf\":[");
    int n = json_size(d, tools);
    for (int k = 0, p = tools + 1; k < n; k++, p = json_skip(d, p)) {
        int fn = json_is_obj(d, p) ? json_get(d, p, "function") : -1;
        int nm = fn >= 0 && json_is_obj(d, fn) ? json_get(d, fn, "name") : -1;
        if (nm < 0 || !json_is_str(d, nm)) {
            json_buf_free(&sb);
            return api_oai_errorf(e, 400, "tools", "every tool needs function.name");
        }
        size_t nl = 0;
        const char *name = json_raw(d, nm, &nl);
        int pa = json_get(d, fn, "parameters"), pr = pa >= 0 && json_is_obj(d, pa) ? json_get(d, pa, "properties") : -1;
        json_buf_addf(&sb, "%s{\"type\":\"object\",\"properties\":{\"name\":{\"const\":", k ? "," : "");
        json_buf_add(&sb, name - 1, nl + 2); /* the raw string, quotes included */
        json_buf_lit(&sb, "},\"parameters\":");
        if (pr < 0 || !json_is_obj(d, pr) || json_size(d, pr) == 0) {
            json_buf_lit(&sb, "{\"type\":\"object\",\"properties\":{},\"additionalProperties\":false}");
        } else {
            size_t pl = 0;
            const char *praw = json_raw(d, pa, &pl);
            json_buf_add(&sb, praw, pl);
        }
        json_buf_lit(&sb, "},\"required\":[\"name\",\"parameters\"]}");
    }
    json_buf_lit(&sb, "]}}");
    json_doc sd;
    char err[256];
    int rc = 0;
    if (sb.oom || json_parse(&sd, sb.p, sb.len, err, sizeof err)) {
        rc = api_oai_errorf(e, 400, "tool_choice", "the tools' parameters do not form a schema");
    } else {
        r->schema = sched_schema_compile(&sd, 0, true, err, sizeof err);
        json_free(&sd);
        if (!r->schema) rc = api_oai_errorf(e, 400, "tool_choice", "tool_choice 'required': %s", err);
        else r->forced_list = true;
    }
    json_buf_free(&sb);
    return rc;
}

/* tool_choice naming a function, or "required" with one tool: the output is
 * that function's arguments, generated under its parameters' schema (a
 * parameterless function: {}), as vLLM does for named tool choice. */
static int parse_forced_tool(const json_doc *d, int tools, int tc, struct api_oai_req *r, struct api_oai_error *e)
{
    int n = tools >= 0 && json_is_arr(d, tools) ? json_size(d, tools) : 0;
    char name[256] = "";
    if (json_is_str(d, tc)) {
        if (!json_str_eq(d, tc, "required")) return 0;
        if (n > 1) return parse_required_list(d, tools, r, e);
        r->forced_required = true;
    } else {
        int fn = json_is_obj(d, tc) ? json_get(d, tc, "function") : -1;
        int nm = fn >= 0 && json_is_obj(d, fn) ? json_get(d, fn, "name") : -1;
        if (nm < 0 || !json_is_str(d, nm) || json_str(d, nm, name, sizeof name) <= 0 ||
            json_str(d, nm, name, sizeof name) >= (long)sizeof name)
            return api_oai_errorf(e, 400, "tool_choice",
                                  "'tool_choice' must be \"none\", \"auto\", \"required\" or {\"type\": \"function\", "
                                  "\"function\": {\"name\": ...}}");
    }
    for (int k = 0, p = tools + 1; k < n; k++, p = json_skip(d, p)) {
        int fn = json_is_obj(d, p) ? json_get(d, p, "function") : -1;
        int nm = fn >= 0 && json_is_obj(d, fn) ? json_get(d, fn, "name") : -1;
        if (nm < 0 || !json_is_str(d, nm) || (name[0] && !json_str_eq(d, nm, name))) continue;
        r->forced_tool = json_strdup(d, nm, NULL);
        if (!r->forced_tool) return api_oai_errorf(e, 500, NULL, "out of memory");
        int pa = json_get(d, fn, "parameters"), pr = pa >= 0 && json_is_obj(d, pa) ? json_get(d, pa, "properties") : -1;
        if (pr < 0 || !json_is_obj(d, pr) || json_size(d, pr) == 0) {
            r->schema = sched_schema_empty_object(); /* no parameters: the arguments are {} */
            return r->schema ? 0 : api_oai_errorf(e, 500, NULL, "out of memory");
        }
        char err[256];
        r->schema = sched_schema_compile(d, pa, false, err, sizeof err);
        if (!r->schema)
            return api_oai_errorf(e, 400, "tool_choice", "the parameters of '%s' cannot guide generation: %s",
                                  r->forced_tool, err);
        return 0;
    }
    return api_oai_errorf(e, 400, "tool_choice", "tool_choice names '%s', which is not in 'tools'", name);
}

/* tool_choice's shape, whether or not tools are given: "none", "auto",
 * "required" or {"type": "function", "function": {"name": ...}}; the last two
 * need tools to choose from (vLLM: "When using `tool_choice`, `tools` must be
 * set"). */
static int check_tool_choice(const json_doc *d, int obj, struct api_oai_error *e)
{
    int tc = opt(d, obj, "tool_choice"), t = opt(d, obj, "tools");
    if (tc < 0) return 0;
    bool named = false;
    if (json_is_str(d, tc)) {
        if (json_str_eq(d, tc, "none") || json_str_eq(d, tc, "auto")) return 0;
        named = json_str_eq(d, tc, "required");
    } else if (json_is_obj(d, tc)) {
        int ty = json_get(d, tc, "type"), fn = json_get(d, tc, "function");
        int nm = fn >= 0 && json_is_obj(d, fn) ? json_get(d, fn, "name") : -1;
        named = (ty < 0 || json_str_eq(d, ty, "function")) && nm >= 0 && json_is_str(d, nm);
    }
    if (!named)
        return api_oai_errorf(e, 400, "tool_choice",
                              "'tool_choice' must be \"none\", \"auto\", \"required\" or {\"type\": \"function\", "
                              "\"function\": {\"name\": ...}}");
    if (t < 0 || !json_is_arr(d, t) || json_size(d, t) == 0)
        return api_oai_errorf(e, 400, "tool_choice", "'tool_choice' %s needs 'tools' to choose from",
                              json_is_str(d, tc) ? "\"required\"" : "naming a function");
    return 0;
}

static int parse_messages(const json_doc *d, int obj, struct api_oai_req *r, struct api_oai_error *e)
{
    /* validation of messages/tools/kwargs and the render: api/chat.c */
    int rc = check_tool_choice(d, obj, e);
    if (rc || (rc = api_chat_check_tools(d, json_get(d, obj, "tools"), e))) return rc;
    int t = opt(d, obj, "tools"), tc = opt(d, obj, "tool_choice");
    r->tools = t >= 0 && json_is_arr(d, t) && json_size(d, t) > 0 && !(tc >= 0 && json_str_eq(d, tc, "none"));
    if (tc >= 0 && r->tools) {
        if ((rc = parse_forced_tool(d, t, tc, r, e))) return rc;
        if (r->forced_tool || r->forced_list) r->tools = false; /* the output is JSON, not a call to parse */
    }
    int rk, tk;
    api_chat_parsers(&rk, &tk);
    if (r->tools && !tk) /* vLLM's words: clients look for them to fall back to tools in the prompt */
        return api_oai_errorf(e, 400, "tool_choice",
                              "\"auto\" tool choice requires --enable-auto-tool-choice and --tool-call-parser to be set");
    return api_chat_render(d, obj, &r->prompt_text, &r->prompt_len, e);
}

static int parse_prompt(const json_doc *d, int obj, struct api_oai_req *r, struct api_oai_error *e)
{
    int p = opt(d, obj, "prompt");
    if (p < 0) return api_oai_errorf(e, 400, "prompt", "'prompt' is required");
    if (json_is_arr(d, p) && json_size(d, p) == 1 && (json_is_str(d, p + 1) || json_is_arr(d, p + 1)))
        p = p + 1; /* ["text"], [[ids]]: one prompt */
    if (json_is_str(d, p)) {
        r->prompt_text = json_strdup(d, p, &r->prompt_len);
        if (!r->prompt_text) return api_oai_errorf(e, 400, "prompt", "'prompt' is not a valid string");
        return 0;
    }
    if (!json_is_arr(d, p) || json_size(d, p) == 0)
        return api_oai_errorf(e, 400, "prompt", "'prompt' must be a string or a non-empty array of token ids");
    if (json_is_arr(d, p + 1)) { /* a list of token-id lists */
        int n = json_size(d, p);
        if (n > API_OAI_MAX_N) return api_oai_errorf(e, 400, "prompt", "at most %d prompts per request", API_OAI_MAX_N);
        r->prompts = calloc((size_t)n, sizeof *r->prompts);
        r->prompt_lens = calloc((size_t)n, sizeof *r->prompt_lens);
        r->id_prompts = calloc((size_t)n, sizeof *r->id_prompts);
        r->id_prompt_lens = calloc((size_t)n, sizeof *r->id_prompt_lens);
        if (!r->prompts || !r->prompt_lens || !r->id_prompts || !r->id_prompt_lens)
            return api_oai_errorf(e, 500, NULL, "out of memory");
        for (int k = 0, q = p + 1; k < n; k++, q = json_skip(d, q)) {
            int m = json_is_arr(d, q) ? json_size(d, q) : 0;
            if (m == 0)
                return api_oai_errorf(e, 400, "prompt", "'prompt[%d]' must be a non-empty array of token ids", k);
            r->n_prompts = k + 1;
            if (!(r->id_prompts[k] = malloc((size_t)m * sizeof **r->id_prompts)))
                return api_oai_errorf(e, 500, NULL, "out of memory");
            for (int j = 0, t = q + 1; j < m; j++, t = json_skip(d, t)) {
                int64_t v;
                if (!json_is_num(d, t) || json_i64(d, t, &v) || v < 0 || v > INT32_MAX)
                    return api_oai_errorf(e, 400, "prompt", "'prompt[%d][%d]' must be a token id", k, j);
                r->id_prompts[k][j] = (int32_t)v;
            }
            r->id_prompt_lens[k] = m;
        }
        return 0;
    }
    if (json_is_str(d, p + 1)) { /* a list of prompts */
        int n = json_size(d, p);
        if (n > API_OAI_MAX_N) return api_oai_errorf(e, 400, "prompt", "at most %d prompts per request", API_OAI_MAX_N);
        r->prompts = calloc((size_t)n, sizeof *r->prompts);
        r->prompt_lens = calloc((size_t)n, sizeof *r->prompt_lens);
        if (!r->prompts || !r->prompt_lens) return api_oai_errorf(e, 500, NULL, "out of memory");
        for (int k = 0, q = p + 1; k < n; k++, q = json_skip(d, q)) {
            if (!json_is_str(d, q) || !(r->prompts[k] = json_strdup(d, q, &r->prompt_lens[k])))
                return api_oai_errorf(e, 400, "prompt", "'prompt' lists must hold only strings");
            r->n_prompts = k + 1;
        }
        return 0;
    }
    int n = json_size(d, p);
    r->prompt_ids = malloc((size_t)n * sizeof *r->prompt_ids);
    if (!r->prompt_ids) return api_oai_errorf(e, 500, NULL, "out of memory");
    for (int k = 0, q = p + 1; k < n; k++, q = json_skip(d, q)) {
        int64_t v;
        if (!json_is_num(d, q) || json_i64(d, q, &v) || v < 0 || v > INT32_MAX)
            return api_oai_errorf(e, 400, "prompt",
                                  "'prompt' must be a string, a list of strings or an array of token ids");
        r->prompt_ids[k] = (int32_t)v;
    }
    r->n_prompt_ids = n;
    return 0;
}

/* logit_bias: {"token id": bias in [-100, 100], ...} (OpenAI's shape). */
static int parse_logit_bias(const json_doc *d, int obj, struct api_oai_req *r, struct api_oai_error *e)
{
    int lb = opt(d, obj, "logit_bias");
    if (lb < 0) return 0;
    if (!json_is_obj(d, lb))
        return api_oai_errorf(e, 400, "logit_bias", "'logit_bias' must be an object mapping token ids to numbers");
    int n = json_size(d, lb);
    if (n > MODEL_MAX_LOGIT_BIAS)
        return api_oai_errorf(e, 400, "logit_bias", "'logit_bias' has more than %d entries", MODEL_MAX_LOGIT_BIAS);
    if (n == 0) return 0;
    r->logit_bias = malloc((size_t)n * sizeof *r->logit_bias);
    if (!r->logit_bias) return api_oai_errorf(e, 500, NULL, "out of memory");
    for (int k = 0, p = lb + 1; k < n; k++, p = json_skip(d, p + 1)) {
        char key[24], *end;
        long klen = json_str(d, p, key, sizeof key);
        long id = klen > 0 ? strtol(key, &end, 10) : -1;
        if (klen <= 0 || klen >= (long)sizeof key || *end || id < 0 || id > INT32_MAX)
            return api_oai_errorf(e, 400, "logit_bias", "'logit_bias' keys must be token ids (\"1234\"), got \"%.20s\"",
                                  klen > 0 ? key : "");
        double v;
        if (!json_is_num(d, p + 1) || json_f64(d, p + 1, &v) || !(v >= -100.0 && v <= 100.0))
            return api_oai_errorf(e, 400, "logit_bias", "'logit_bias' values must be numbers from -100 to 100");
        r->logit_bias[k] = (struct model_logit_bias){.id = (int32_t)id, .bias = (float)v};
    }
    r->sampling.logit_bias = r->logit_bias;
    r->sampling.n_logit_bias = n;
    return 0;
}

/* response_format: {"type": "text"}, {"type": "json_object"} (JSON mode) or
 * {"type": "json_schema", "json_schema": {"schema": ...}} (schema mode). */
static int parse_response_format(const json_doc *d, int obj, struct api_oai_req *r, struct api_oai_error *e)
{
    int rf = opt(d, obj, "response_format");
    if (rf < 0) return 0;
    int ty = json_is_obj(d, rf) ? json_get(d, rf, "type") : -1;
    if (ty < 0 || !json_is_str(d, ty))
        return api_oai_errorf(e, 400, "response_format", "'response_format' must be an object with a 'type'");
    if (json_str_eq(d, ty, "text")) return 0;
    if (r->forced_tool || r->forced_list)
        return api_oai_errorf(e, 400, "response_format",
                              "'response_format' cannot be combined with a named or required tool_choice");
    if (json_str_eq(d, ty, "json_object")) {
        r->json_object = true;
        return 0;
    }
    if (json_str_eq(d, ty, "json_schema")) {
        int js = json_get(d, rf, "json_schema");
        int sc = js >= 0 && json_is_obj(d, js) ? json_get(d, js, "schema") : -1;
        if (sc < 0)
            return api_oai_errorf(e, 400, "response_format", "'response_format.json_schema.schema' is required");
        char err[256];
        r->schema = sched_schema_compile(d, sc, false, err, sizeof err);
        if (!r->schema) return api_oai_errorf(e, 400, "response_format", "'response_format' json_schema: %s", err);
        return 0;
    }
    return api_oai_errorf(e, 400, "response_format",
                          "'response_format' type must be 'text', 'json_object' or 'json_schema'");
}

/* One structured-output constraint of vLLM's (structured_outputs.{json,
 * regex, choice, grammar, json_object} or the older guided_* fields) at
 * value v into r; param names the field for errors. */
static int guide_from(const json_doc *d, int v, const char *kind, const char *param, struct api_oai_req *r,
                      struct api_oai_error *e)
{
    char err[256];
    if (!strcmp(kind, "json_object")) {
        bool on = false;
        if (!json_is_bool(d, v) || json_bool(d, v, &on))
            return api_oai_errorf(e, 400, param, "'%s' must be a boolean", param);
        r->json_object = on;
        return 0;
    }
    if (!strcmp(kind, "json")) {
        /* a schema object, or the schema as a JSON string */
        if (json_is_str(d, v)) {
            size_t n = 0;
            char *text = json_strdup(d, v, &n);
            json_doc sd;
            if (!text) return api_oai_errorf(e, 400, param, "'%s' is not a valid string", param);
            if (json_parse(&sd, text, n, err, sizeof err)) {
                free(text);
                return api_oai_errorf(e, 400, param, "'%s' is not a JSON schema: %s", param, err);
            }
            r->schema = sched_schema_compile(&sd, 0, true, err, sizeof err);
            json_free(&sd);
            free(text);
        } else if (json_is_obj(d, v)) {
            r->schema = sched_schema_compile(d, v, true, err, sizeof err);
        } else {
            return api_oai_errorf(e, 400, param, "'%s' must be a JSON schema (an object or a string)", param);
        }
        return r->schema ? 0 : api_oai_errorf(e, 400, param, "'%s': %s", param, err);
    }
    if (!strcmp(kind, "choice")) {
        int n = json_is_arr(d, v) ? json_size(d, v) : 0;
        if (n < 1 || n > 1024) return api_oai_errorf(e, 400, param, "'%s' must be an array of 1 to 1024 strings", param);
        char **c = calloc((size_t)n, sizeof *c);
        size_t *cl = calloc((size_t)n, sizeof *cl);
        int rc = 0;
        if (!c || !cl) rc = api_oai_errorf(e, 500, NULL, "out of memory");
        for (int k = 0, p = v + 1; !rc && k < n; k++, p = json_skip(d, p))
            if (!json_is_str(d, p) || !(c[k] = json_strdup(d, p, &cl[k])))
                rc = api_oai_errorf(e, 400, param, "'%s' must be an array of strings", param);
        if (!rc) {
            r->schema = sched_schema_from_choice((const char *const *)c, cl, n, err, sizeof err);
            if (!r->schema) rc = api_oai_errorf(e, 400, param, "'%s': %s", param, err);
        }
        for (int k = 0; c && k < n; k++) free(c[k]);
        free(c);
        free(cl);
        return rc;
    }
    /* regex, grammar: a string */
    size_t n = 0;
    char *text = json_is_str(d, v) ? json_strdup(d, v, &n) : NULL;
    if (!text) return api_oai_errorf(e, 400, param, "'%s' must be a string", param);
    r->schema = !strcmp(kind, "regex") ? sched_schema_from_regex(text, n, err, sizeof err)
                                       : sched_schema_from_grammar(text, n, err, sizeof err);
    free(text);
    return r->schema ? 0 : api_oai_errorf(e, 400, param, "'%s': %s", param, err);
}

/* vLLM's structured outputs: "structured_outputs": {"json" | "regex" |
 * "choice" | "grammar" | "json_object": ...} or the older guided_json,
 * guided_regex, guided_choice, guided_grammar (guided_decoding_backend is
 * accepted: one implementation serves them all). One constraint per request. */
static int parse_structured(const json_doc *d, int obj, struct api_oai_req *r, struct api_oai_error *e)
{
    static const char *const kinds[] = {"json", "regex", "choice", "grammar", "json_object"};
    static const char *const guided[] = {"guided_json", "guided_regex", "guided_choice", "guided_grammar", NULL};
    int so = opt(d, obj, "structured_outputs"), found = -1, at = -1;
    char param[64] = "";
    int gb = opt(d, obj, "guided_decoding_backend");
    if (gb >= 0 && !json_is_str(d, gb))
        return api_oai_errorf(e, 400, "guided_decoding_backend", "'guided_decoding_backend' must be a string");
    if (so >= 0) {
        if (!json_is_obj(d, so)) return api_oai_errorf(e, 400, "structured_outputs", "'structured_outputs' must be an object");
        for (int k = 0, p = so + 1, n = json_size(d, so); k < n; k++, p = json_skip(d, p + 1)) {
            int v = p + 1, which = -1;
            char key[48];
            json_str(d, p, key, sizeof key);
            for (int j = 0; j < 5; j++)
                if (json_str_eq(d, p, kinds[j])) which = j;
            if (json_is_null(d, v)) continue;
            bool off = false;
            if (which < 0) {
                /* vLLM's switches that hold here whatever they say: no fallback, no extra properties */
                if ((json_str_eq(d, p, "disable_fallback") || json_str_eq(d, p, "disable_additional_properties")) &&
                    json_is_bool(d, v))
                    continue;
                if ((json_str_eq(d, p, "disable_any_whitespace") && json_is_bool(d, v) && !json_bool(d, v, &off) &&
                     !off) || json_str_eq(d, p, "backend") || json_str_eq(d, p, "_backend"))
                    continue;
                return api_oai_errorf(e, 400, "structured_outputs", "'structured_outputs.%s' is not supported", key);
            }
            if (which == 4 && json_is_bool(d, v) && !json_bool(d, v, &off) && !off) continue; /* json_object: false */
            if (found >= 0)
                return api_oai_errorf(e, 400, "structured_outputs",
                                      "'structured_outputs' takes one of json, regex, choice, grammar, json_object");
            found = which, at = v;
            snprintf(param, sizeof param, "structured_outputs.%s", kinds[which]);
        }
    }
    for (int j = 0; guided[j]; j++) {
        int v = opt(d, obj, guided[j]);
        if (v < 0) continue;
        if (found >= 0)
            return api_oai_errorf(e, 400, guided[j], "'%s' cannot be combined with another structured output",
                                  guided[j]);
        found = j, at = v;
        snprintf(param, sizeof param, "%s", guided[j]);
    }
    if (found < 0) return 0;
    if (r->json_object || r->schema || r->forced_tool || r->forced_list)
        return api_oai_errorf(e, 400, param, "'%s' cannot be combined with response_format or a named or required "
                                             "tool_choice", param);
    return guide_from(d, at, kinds[found], param, r, e);
}

static int parse_stop(const json_doc *d, int obj, struct api_oai_req *r, struct api_oai_error *e)
{
    int s = opt(d, obj, "stop");
    if (s >= 0) {
        int n = json_is_str(d, s) ? 1 : json_is_arr(d, s) ? json_size(d, s) : -1;
        if (n < 0) return api_oai_errorf(e, 400, "stop", "'stop' must be a string or an array of strings");
        if (n > API_OAI_MAX_STOP) return api_oai_errorf(e, 400, "stop", "'stop' has more than %d strings", API_OAI_MAX_STOP);
        for (int k = 0, q = json_is_str(d, s) ? s : s + 1; k < n; k++, q = json_skip(d, q)) {
            size_t len;
            char *str = json_is_str(d, q) ? json_strdup(d, q, &len) : NULL;
            if (!str) return api_oai_errorf(e, 400, "stop", "'stop' must be a string or an array of strings");
            r->stop[r->n_stop++] = str;
            if (len == 0 || len > SCHED_MAX_STOP_LEN)
                return api_oai_errorf(e, 400, "stop", "stop strings must be 1 to %d bytes long", SCHED_MAX_STOP_LEN);
            /* the engine matches stop strings as C strings: a NUL would cut one short and stop early */
            if (strlen(str) != len) return api_oai_errorf(e, 400, "stop", "stop strings may not contain NUL (\\u0000)");
        }
    }
    int t = opt(d, obj, "stop_token_ids");
    if (t >= 0) {
        if (!json_is_arr(d, t)) return api_oai_errorf(e, 400, "stop_token_ids", "'stop_token_ids' must be an array of integers");
        int n = json_size(d, t);
        r->stop_token_ids = malloc((size_t)(n ? n : 1) * sizeof *r->stop_token_ids);
        if (!r->stop_token_ids) return api_oai_errorf(e, 500, NULL, "out of memory");
        for (int k = 0, q = t + 1; k < n; k++, q = json_skip(d, q)) {
            int64_t v;
            if (!json_is_num(d, q) || json_i64(d, q, &v) || v < 0 || v > INT32_MAX)
                return api_oai_errorf(e, 400, "stop_token_ids", "'stop_token_ids' must be an array of token ids");
            r->stop_token_ids[r->n_stop_token_ids++] = (int32_t)v;
        }
    }
    return 0;
}

/* vLLM's SamplingParams extensions: include_stop_str_in_output,
 * skip_special_tokens, spaces_between_special_tokens, allowed_token_ids,
 * bad_words, truncate_prompt_tokens, prompt_logprobs. */
static int parse_vllm_extensions(const json_doc *d, int obj, struct api_oai_req *r, struct api_oai_error *e)
{
    int rc;
    if ((rc = bool_opt(d, obj, "include_stop_str_in_output", &r->include_stop_str, e)) < 0) return rc;
    bool skip = true;
    if ((rc = bool_opt(d, obj, "skip_special_tokens", &skip, e)) < 0) return rc;
    r->keep_special_tokens = !skip;
    /* spaces_between_special_tokens: vLLM's fast-tokenizer detokenizer (every
     * tokenizer.json model) ignores it, and so does this one; checked only */
    bool sbst;
    if ((rc = bool_opt(d, obj, "spaces_between_special_tokens", &sbst, e)) < 0) return rc;
    int a = opt(d, obj, "allowed_token_ids");
    if (a >= 0) {
        int n = json_is_arr(d, a) ? json_size(d, a) : -1;
        if (n <= 0) return api_oai_errorf(e, 400, "allowed_token_ids", "'allowed_token_ids' must be a non-empty array of token ids");
        if (!(r->allowed_ids = malloc((size_t)n * sizeof *r->allowed_ids))) return api_oai_errorf(e, 500, NULL, "out of memory");
        for (int k = 0, q = a + 1; k < n; k++, q = json_skip(d, q)) {
            int64_t v;
            if (!json_is_num(d, q) || json_i64(d, q, &v) || v < 0 || v > INT32_MAX)
                return api_oai_errorf(e, 400, "allowed_token_ids", "'allowed_token_ids' must be an array of token ids");
            r->allowed_ids[r->n_allowed_ids++] = (int32_t)v;
        }
    }
    int bw = opt(d, obj, "bad_words");
    if (bw >= 0) {
        int n = json_is_arr(d, bw) ? json_size(d, bw) : -1;
        if (n < 0) return api_oai_errorf(e, 400, "bad_words", "'bad_words' must be an array of strings");
        if (n > API_OAI_MAX_STOP) return api_oai_errorf(e, 400, "bad_words", "'bad_words' has more than %d strings", API_OAI_MAX_STOP);
        if (n && !(r->bad_words = calloc((size_t)n, sizeof *r->bad_words))) return api_oai_errorf(e, 500, NULL, "out of memory");
        for (int k = 0, q = bw + 1; k < n; k++, q = json_skip(d, q)) {
            size_t len = 0;
            char *w = json_is_str(d, q) ? json_strdup(d, q, &len) : NULL;
            if (!w) return api_oai_errorf(e, 400, "bad_words", "'bad_words' must be an array of strings");
            r->bad_words[r->n_bad_words++] = w;
            if (len == 0 || strlen(w) != len)
                return api_oai_errorf(e, 400, "bad_words", "'bad_words' entries must be non-empty strings without NUL");
        }
    }
    if ((rc = bool_opt(d, obj, "return_tokens_as_token_ids", &r->tokens_as_ids, e)) < 0) return rc;
    r->add_special_tokens = r->kind != API_OAI_CHAT; /* a chat template writes its own BOS */
    if ((rc = bool_opt(d, obj, "add_special_tokens", &r->add_special_tokens, e)) < 0) return rc;
    int64_t iv;
    if ((rc = int_in(d, obj, "truncate_prompt_tokens", -1, INT32_MAX, &iv, e)) < 0) return rc;
    if (rc) {
        if (iv == 0) return api_oai_errorf(e, 400, "truncate_prompt_tokens", "'truncate_prompt_tokens' must be -1 or at least 1");
        r->truncate_prompt_tokens = (long)iv;
    }
    r->prompt_logprobs = -1;
    if ((rc = int_in(d, obj, "prompt_logprobs", -1, MODEL_MAX_TOP_LOGPROBS, &iv, e)) < 0) return rc;
    if (rc) {
        if (r->stream) return api_oai_errorf(e, 400, "prompt_logprobs", "'prompt_logprobs' is not available when 'stream' is true");
        r->prompt_logprobs = iv < 0 ? MODEL_MAX_TOP_LOGPROBS : (int)iv; /* -1: as many as returned at most */
    }
    return 0;
}

bool api_oai_wants_prompt_logprobs(const struct api_oai_req *r)
{
    return r->prompt_logprobs >= 0 || (r->echo && r->logprobs);
}

int api_oai_prepare(struct api_oai_req *r, const model_tok *tok, struct api_oai_error *e)
{
    if (r->n_bad_words == 0) return 0;
    if (!tok) return api_oai_errorf(e, 400, "bad_words", "'bad_words' needs the model's tokenizer");
    size_t cap = 0;
    for (int w = 0; w < r->n_bad_words; w++) cap += 2 * (strlen(r->bad_words[w]) + 2);
    r->bad_ids = malloc(cap * sizeof *r->bad_ids);
    r->bad_lens = malloc((size_t)(unsigned)r->n_bad_words * 2 * sizeof *r->bad_lens);
    char *buf = malloc(cap + 2);
    if (!r->bad_ids || !r->bad_lens || !buf) {
        free(buf);
        return api_oai_errorf(e, 500, NULL, "out of memory");
    }
    size_t o = 0;
    for (int w = 0; w < r->n_bad_words; w++) {
        const char *word = r->bad_words[w];
        while (*word == ' ' || *word == '\t' || *word == '\n') word++;
        int first = -1;
        for (int sp = 0; sp < 2; sp++) { /* the word at the start of the text, then after a space */
            snprintf(buf, cap + 2, "%s%s", sp ? " " : "", word);
            int n = model_tok_encode(tok, buf, strlen(buf), false, false, r->bad_ids + o, (int)(cap - o));
            if (n <= 0 || (size_t)n > cap - o) continue;
            /* with the space: only when it makes a new first token of the same length (vLLM's rule) */
            if (sp && (first < 0 || r->bad_ids[o] == r->bad_ids[first] || n != r->bad_lens[r->n_bad_seqs - 1])) continue;
            if (!sp) first = (int)o;
            r->bad_lens[r->n_bad_seqs++] = n;
            o += (size_t)n;
        }
    }
    free(buf);
    return 0;
}

int api_oai_n_choices(const struct api_oai_req *r)
{
    return (r->n_prompts > 0 ? r->n_prompts : 1) * (r->n > 1 ? r->n : 1);
}

int api_oai_tokenize_prompt(const struct api_oai_req *r, int p, const model_tok *tok, int32_t **ids,
                            struct api_oai_error *e)
{
    struct api_oai_req one = *r; /* borrowed fields only: nothing here is freed */
    one.prompt_text = r->prompts[p];
    one.prompt_len = r->prompt_lens[p];
    one.prompt_ids = NULL, one.n_prompt_ids = 0;
    if (r->id_prompts) one.prompt_ids = r->id_prompts[p], one.n_prompt_ids = r->id_prompt_lens[p];
    return api_oai_tokenize(&one, tok, ids, e);
}

void api_oai_choice_sampling(const struct api_oai_req *r, int i, struct model_sampling *out)
{
    *out = r->sampling;
    if (i > 0) out->seed = r->sampling.seed + (uint64_t)i * 0x9e3779b97f4a7c15ULL;
}

static uint64_t random_seed(void)
{
    static uint64_t counter;
    struct timespec ts;
    clock_gettime(CLOCK_REALTIME, &ts);
    return (uint64_t)ts.tv_nsec ^ ((uint64_t)ts.tv_sec << 30) ^
           (__atomic_add_fetch(&counter, 1, __ATOMIC_RELAXED) * 0x9E3779B97F4A7C15ULL);
}

bool api_oai_model_known(const char *const *names, const char *model)
{
    for (; names && *names; names++)
        if (!strcmp(*names, model)) return true;
    return false;
}

int api_oai_parse_doc(const json_doc *d, int obj, enum api_oai_endpoint kind, const char *const *served,
                      struct api_oai_req *r, struct api_oai_error *e)
{
    memset(r, 0, sizeof *r);
    r->kind = kind;
    r->max_tokens = -1;
    model_sampling_default(&r->sampling);
    r->sampling.temperature = 1.0f; /* the OpenAI default */
    int rc;
    if (obj < 0 || !json_is_obj(d, obj)) {
        rc = api_oai_errorf(e, 400, NULL, "the request body must be a JSON object");
        goto fail;
    }
    /* "model" may be left out (vLLM: the served model), but not given as null or a non-string */
    int mi = json_get(d, obj, "model");
    if (mi >= 0) {
        size_t ml = 0;
        r->model = json_is_str(d, mi) ? json_strdup(d, mi, &ml) : NULL;
        if (!r->model || strlen(r->model) != ml) {
            rc = api_oai_errorf(e, 400, "model", "'model' must be a string%s", r->model ? " without NUL" : "");
            goto fail;
        }
        if (served && !api_oai_model_known(served, r->model)) {
            rc = api_oai_errorf(e, 404, "model", "The model `%s` does not exist.", r->model);
            goto fail;
        }
    }
    if ((rc = check_field_types(d, obj, kind, e))) goto fail;
    rc = kind == API_OAI_CHAT ? parse_messages(d, obj, r, e) : parse_prompt(d, obj, r, e);
    if (rc) goto fail;

    int64_t iv;
    double fv;
    /* chat: max_completion_tokens wins over max_tokens; both are checked */
    if ((rc = int_in(d, obj, "max_tokens", 1, INT32_MAX, &iv, e)) < 0) goto fail;
    if (rc) r->max_tokens = (long)iv;
    if (kind == API_OAI_CHAT && (rc = int_in(d, obj, "max_completion_tokens", 1, INT32_MAX, &iv, e)) < 0) goto fail;
    if (kind == API_OAI_CHAT && rc) r->max_tokens = (long)iv;
    if ((rc = num_in(d, obj, "temperature", 0, 2, false, &fv, e)) < 0) goto fail;
    if (rc) r->sampling.temperature = (float)fv;
    if ((rc = num_in(d, obj, "top_p", 0, 1, true, &fv, e)) < 0) goto fail;
    if (rc) r->sampling.top_p = (float)fv;
    if ((rc = int_in(d, obj, "top_k", -1, INT32_MAX, &iv, e)) < 0) goto fail;
    if (rc) r->sampling.top_k = iv < 0 ? 0 : (int)iv;
    if ((rc = num_in(d, obj, "min_p", 0, 1, false, &fv, e)) < 0) goto fail;
    if (rc) r->sampling.min_p = (float)fv;
    if ((rc = num_in(d, obj, "presence_penalty", -2, 2, false, &fv, e)) < 0) goto fail;
    if (rc) r->sampling.presence_penalty = (float)fv;
    if ((rc = num_in(d, obj, "frequency_penalty", -2, 2, false, &fv, e)) < 0) goto fail;
    if (rc) r->sampling.frequency_penalty = (float)fv;
    if ((rc = num_in(d, obj, "repetition_penalty", 0, 2, true, &fv, e)) < 0) goto fail;
    if (rc) r->sampling.repetition_penalty = (float)fv;
    if ((rc = int_in(d, obj, "seed", INT64_MIN, INT64_MAX, &iv, e)) < 0) goto fail;
    r->seed_given = rc == 1;
    r->sampling.seed = rc ? (uint64_t)iv : random_seed();
    r->n = 1;
    if ((rc = int_in(d, obj, "n", 1, API_OAI_MAX_N, &iv, e)) < 0) goto fail;
    if (rc) r->n = (int)iv;
    if ((rc = int_in(d, obj, "best_of", 1, 1, &iv, e)) < 0) {
        snprintf(e->message, sizeof e->message, "'best_of' must be 1: not supported yet");
        goto fail;
    }
    if ((rc = int_in(d, obj, "min_tokens", 0, INT32_MAX, &iv, e)) < 0) goto fail;
    if (rc) r->min_tokens = iv;
    if ((rc = bool_opt(d, obj, "ignore_eos", &r->ignore_eos, e)) < 0) goto fail;
    if ((rc = bool_opt(d, obj, "stream", &r->stream, e)) < 0) goto fail;
    if (kind == API_OAI_COMPLETIONS) {
        if ((rc = bool_opt(d, obj, "echo", &r->echo, e)) < 0) goto fail;
        if (r->echo && r->stream && opt(d, obj, "logprobs") >= 0) {
            rc = api_oai_errorf(e, 400, "echo", "'echo' with 'stream' and 'logprobs' is not supported yet");
            goto fail;
        }
        int sfx = opt(d, obj, "suffix");
        if (sfx >= 0) {
            rc = api_oai_errorf(e, 400, "suffix", "'suffix' is not supported");
            goto fail;
        }
        if ((rc = int_in(d, obj, "logprobs", 0, MODEL_MAX_TOP_LOGPROBS, &iv, e)) < 0) goto fail;
        if (rc) {
            r->logprobs = true;
            r->top_logprobs = (int)iv;
        }
    } else {
        if ((rc = bool_opt(d, obj, "logprobs", &r->logprobs, e)) < 0) goto fail;
        if ((rc = int_in(d, obj, "top_logprobs", 0, MODEL_MAX_TOP_LOGPROBS, &iv, e)) < 0) goto fail;
        if (rc) {
            if (!r->logprobs && iv > 0) {
                rc = api_oai_errorf(e, 400, "top_logprobs", "'top_logprobs' requires 'logprobs' to be true");
                goto fail;
            }
            r->top_logprobs = (int)iv;
        }
    }
    r->sampling.top_logprobs = r->logprobs ? r->top_logprobs : 0;
    if ((rc = parse_vllm_extensions(d, obj, r, e)) < 0) goto fail;
    if ((rc = parse_stop(d, obj, r, e)) < 0) goto fail;
    if ((rc = parse_logit_bias(d, obj, r, e)) < 0) goto fail;
    if ((rc = parse_response_format(d, obj, r, e)) < 0) goto fail;
    if ((rc = parse_structured(d, obj, r, e)) < 0) goto fail;
    return 0;

fail:
    api_oai_req_free(r);
    return rc < 0 ? rc : SL_EINVAL;
}

int api_oai_parse(const char *body, size_t len, enum api_oai_endpoint kind, const char *const *served,
                  struct api_oai_req *r, struct api_oai_error *e)
{
    memset(r, 0, sizeof *r);
    json_doc d;
    char err[256];
    if (json_parse(&d, body, len, err, sizeof err))
        return api_oai_errorf(e, 400, NULL, "the request body is not valid JSON: %s", err);
    int rc = api_oai_parse_doc(&d, 0, kind, served, r, e);
    json_free(&d);
    return rc;
}

void api_oai_req_free(struct api_oai_req *r)
{
    if (!r) return;
    free(r->model);
    free(r->prompt_text);
    free(r->prompt_ids);
    for (int i = 0; i < r->n_stop; i++) free(r->stop[i]);
    free(r->stop_token_ids);
    free(r->logit_bias);
    sched_schema_free(r->schema);
    free(r->forced_tool);
    for (int i = 0; i < r->n_prompts; i++) free(r->prompts[i]);
    free(r->prompts);
    free(r->prompt_lens);
    free(r->allowed_ids);
    for (int i = 0; i < r->n_bad_words; i++) free(r->bad_words[i]);
    free(r->bad_words);
    free(r->bad_ids);
    free(r->bad_lens);
    for (int i = 0; r->id_prompts && i < r->n_prompts; i++) free(r->id_prompts[i]);
    free(r->id_prompts);
    free(r->id_prompt_lens);
    enum api_oai_endpoint kind = r->kind;
    memset(r, 0, sizeof *r);
    r->kind = kind;
}

/* ---- prompt and sched_request -------------------------------------------------------- */

int api_oai_tokenize(const struct api_oai_req *r, const model_tok *tok, int32_t **ids, struct api_oai_error *e)
{
    *ids = NULL;
    if (r->prompt_ids) {
        int nv = model_tok_n_vocab(tok);
        for (int i = 0; i < r->n_prompt_ids; i++)
            if (r->prompt_ids[i] >= nv)
                return api_oai_errorf(e, 400, "prompt", "token id %d at prompt[%d] is out of vocabulary (size %d)",
                                      r->prompt_ids[i], i, nv);
        *ids = malloc((size_t)r->n_prompt_ids * sizeof **ids);
        if (!*ids) return api_oai_errorf(e, 500, NULL, "out of memory");
        memcpy(*ids, r->prompt_ids, (size_t)r->n_prompt_ids * sizeof **ids);
        return r->n_prompt_ids;
    }
    const char *text = r->prompt_text ? r->prompt_text : "";
    size_t len = r->prompt_text ? r->prompt_len : 0; /* not strlen: the text may hold NULs */
    int cap = (int)(len < 1000000 ? len : 1000000) + 16;
    for (;;) {
        int32_t *buf = malloc((size_t)cap * sizeof *buf);
        if (!buf) return api_oai_errorf(e, 500, NULL, "out of memory");
        /* vLLM's add_special_tokens: false for chat (its template writes the BOS), true for completions */
        int n = model_tok_encode(tok, text, len, r->add_special_tokens, true, buf, cap);
        if (n < 0) {
            free(buf);
            return api_oai_errorf(e, 400, r->kind == API_OAI_CHAT ? "messages" : "prompt", "the prompt could not be tokenized");
        }
        if (n <= cap) {
            if (n == 0) {
                free(buf);
                return api_oai_errorf(e, 400, r->kind == API_OAI_CHAT ? "messages" : "prompt", "the prompt is empty");
            }
            *ids = buf;
            return n;
        }
        free(buf);
        cap = n;
    }
}

int api_oai_check_length(const struct api_oai_req *r, int p, const model_tok *tok, int max_model_len,
                         struct api_oai_error *e)
{
    const char *text = p >= 0 ? r->prompts[p] : r->prompt_text;
    size_t len = !text ? 0 : p >= 0 ? r->prompt_lens[p] : r->prompt_len, mb = (size_t)model_tok_max_bytes(tok);
    if (r->prompt_ids || !text || r->truncate_prompt_tokens || mb == 0 || len <= (size_t)max_model_len * mb) return 0;
    return api_oai_errorf(e, 400, r->kind == API_OAI_CHAT ? "messages" : "prompt",
                          "This model's maximum context length is %d tokens. However, your prompt has at least %zu "
                          "tokens (%zu bytes of text, at most %zu bytes a token). Please reduce the length of the "
                          "prompt.",
                          max_model_len, (len + mb - 1) / mb, len, mb);
}

/* With --reasoning-parser, a structured output starts after the reasoning
 * (vLLM's behaviour): the guide waits for "</think>" unless the rendered
 * prompt already closed it (a template with thinking turned off ends with
 * "<think>\n\n</think>\n\n"). Tool calls forced by tool_choice are
 * guided from the first token, as their output is parsed whole. */
static const char *guide_after(const struct api_oai_req *r)
{
    int rk, tk;
    api_chat_parsers(&rk, &tk);
    if (r->kind != API_OAI_CHAT || rk == API_REASONING_NONE || !(r->json_object || r->schema) || r->forced_tool ||
        r->forced_list)
        return NULL;
    size_t n = r->prompt_text ? r->prompt_len : 0;
    while (n && strchr(" \t\r\n", r->prompt_text[n - 1])) n--;
    if (n >= 8 && !memcmp(r->prompt_text + n - 8, "</think>", 8)) return NULL;
    return "</think>";
}

int api_oai_to_sched(const struct api_oai_req *r, const int32_t *ids, int n_ids, int max_model_len,
                     struct sched_request *out, struct api_oai_error *e)
{
    memset(out, 0, sizeof *out);
    long max_tokens = r->max_tokens;
    if (r->truncate_prompt_tokens) { /* vLLM keeps the prompt's end */
        long k = r->truncate_prompt_tokens < 0 ? max_model_len : r->truncate_prompt_tokens;
        if (k > max_model_len)
            return api_oai_errorf(e, 400, "truncate_prompt_tokens",
                                  "truncate_prompt_tokens value (%ld) is greater than max_model_len (%d). Please, "
                                  "select a smaller truncation size.", k, max_model_len);
        if (n_ids > k) ids += n_ids - k, n_ids = (int)k;
    }
    if (n_ids >= max_model_len)
        return api_oai_errorf(e, 400, r->kind == API_OAI_CHAT ? "messages" : "prompt",
                              "This model's maximum context length is %d tokens. However, your prompt has %d tokens, "
                              "which leaves no room for the completion. Please reduce the length of the prompt.",
                              max_model_len, n_ids);
    if (max_tokens < 0) max_tokens = r->kind == API_OAI_CHAT ? max_model_len - n_ids : 16;
    if (max_tokens > max_model_len - n_ids && r->max_tokens < 0) max_tokens = max_model_len - n_ids;
    if ((long)n_ids + max_tokens > max_model_len)
        return api_oai_errorf(e, 400, "max_tokens",
                              "This model's maximum context length is %d tokens. However, you requested %ld tokens "
                              "(%d in the prompt, %ld in the completion). Please reduce the length of the prompt or "
                              "completion.",
                              max_model_len, (long)n_ids + max_tokens, n_ids, max_tokens);
    if (r->min_tokens > max_tokens)
        return api_oai_errorf(e, 400, "min_tokens", "'min_tokens' (%ld) must be at most 'max_tokens' (%ld)",
                              r->min_tokens, max_tokens);
    out->min_tokens = (int)r->min_tokens;
    out->json_object = r->json_object;
    out->schema = r->schema;
    out->guide_after = guide_after(r);
    out->prompt = ids;
    out->n_prompt = n_ids;
    out->sampling = r->sampling;
    out->max_tokens = (int)max_tokens;
    out->ignore_eos = r->ignore_eos;
    out->stop = (const char *const *)r->stop;
    out->n_stop = r->n_stop;
    out->stop_token_ids = r->stop_token_ids;
    out->n_stop_token_ids = r->n_stop_token_ids;
    out->logprobs = r->logprobs;
    out->priority = SCHED_PRIO_INTERACTIVE;
    out->include_stop_str = r->include_stop_str;
    out->keep_special_tokens = r->keep_special_tokens;
    out->allowed_ids = r->allowed_ids;
    out->n_allowed_ids = r->n_allowed_ids;
    out->bad_words = r->bad_ids;
    out->bad_word_lens = r->bad_lens;
    out->n_bad_words = r->n_bad_seqs;
    out->prompt_logprobs = api_oai_wants_prompt_logprobs(r);
    out->prompt_top_logprobs = r->prompt_logprobs > 0 ? r->prompt_logprobs : 0;
    if (r->echo && r->logprobs && r->top_logprobs > out->prompt_top_logprobs) out->prompt_top_logprobs = r->top_logprobs;
    return 0;
}

/* ---- results ----------------------------------------------------------------------- */

void api_oai_result_init(struct api_oai_result *res)
{
    memset(res, 0, sizeof *res);
    json_buf_init(&res->text);
    json_buf_init(&res->lp);
    json_buf_init(&res->lp_vals);
    json_buf_init(&res->lp_top);
    json_buf_init(&res->lp_off);
    json_buf_init(&res->plp);
}

void api_oai_result_free(struct api_oai_result *res)
{
    if (!res) return;
    json_buf_free(&res->text);
    json_buf_free(&res->lp);
    json_buf_free(&res->lp_vals);
    json_buf_free(&res->lp_top);
    json_buf_free(&res->lp_off);
    json_buf_free(&res->plp);
}

static bool valid_utf8(const unsigned char *s, size_t n)
{
    for (size_t i = 0; i < n;) {
        unsigned char c = s[i];
        int k = c < 0x80 ? 0 : (c & 0xE0) == 0xC0 ? 1 : (c & 0xF0) == 0xE0 ? 2 : (c & 0xF8) == 0xF0 ? 3 : -1;
        if (k < 0 || (k == 1 && c < 0xC2) || i + (size_t)k >= n) return false;
        for (int j = 1; j <= k; j++)
            if ((s[i + j] & 0xC0) != 0x80) return false;
        i += (size_t)k + 1;
    }
    return true;
}

/* A token's text as a JSON string: its bytes when they are valid UTF-8, else
 * "bytes:\xNN..." as vLLM writes partial characters. */
static void add_token_str(struct json_buf *b, const model_tok *tok, int32_t id)
{
    size_t n = 0;
    const char *s = tok ? model_tok_bytes(tok, id, &n) : NULL;
    if (!s) {
        json_buf_addf(b, "\"token_id:%d\"", id);
        return;
    }
    if (valid_utf8((const unsigned char *)s, n)) {
        json_buf_add_str(b, s, n);
        return;
    }
    ADD_LIT(b, "\"bytes:");
    for (size_t i = 0; i < n; i++) json_buf_addf(b, "\\\\x%02x", (unsigned char)s[i]);
    ADD_LIT(b, "\"");
}

static void add_bytes(struct json_buf *b, const model_tok *tok, int32_t id)
{
    size_t n = 0;
    const char *s = tok ? model_tok_bytes(tok, id, &n) : NULL;
    ADD_LIT(b, "[");
    for (size_t i = 0; s && i < n; i++) json_buf_addf(b, "%s%u", i ? "," : "", (unsigned char)s[i]);
    ADD_LIT(b, "]");
}

static double lp_value(float v) { return isfinite(v) ? (double)v : -9999.0; }

void api_oai_result_echo(struct api_oai_result *res, const struct api_oai_req *r, int choice, const model_tok *tok,
                         const int32_t *ids, int n)
{
    if (!r->echo || r->kind != API_OAI_COMPLETIONS) return;
    int p = choice / (r->n > 1 ? r->n : 1);
    const char *text = r->n_prompts > 0 ? r->prompts[p] : r->prompt_text;
    size_t len = r->n_prompts > 0 ? r->prompt_lens[p] : r->prompt_len;
    if (text && !r->truncate_prompt_tokens) {
        json_buf_add(&res->text, text, len);
        return;
    }
    struct model_detok dt; /* token ids (or a truncated prompt): their text, special tokens included */
    model_detok_init(&dt, tok, false);
    char piece[1024];
    for (int i = 0; i < n; i++) {
        size_t k = model_detok_push(&dt, ids[i], piece, sizeof piece);
        json_buf_add(&res->text, piece, k);
    }
    size_t k = model_detok_flush(&dt, piece, sizeof piece);
    json_buf_add(&res->text, piece, k);
}

/* vLLM's Logprob entries for one prompt position: {"<id>": {"logprob",
 * "rank", "decoded_token"}} for the prompt token, then its alternatives. */
static void add_plp_entry(struct json_buf *b, const model_tok *tok, const struct model_sample_out *o)
{
    json_buf_addf(b, "{\"%d\":{\"logprob\":%.6g,\"rank\":%d,\"decoded_token\":", o->token, lp_value(o->logprob),
                  o->rank);
    add_token_str(b, tok, o->token);
    ADD_LIT(b, "}");
    for (int i = 0; i < o->n_top; i++) {
        if (o->top_ids[i] == o->token) continue;
        json_buf_addf(b, ",\"%d\":{\"logprob\":%.6g,\"rank\":%d,\"decoded_token\":", o->top_ids[i],
                      lp_value(o->top_logprobs[i]), i + 1);
        add_token_str(b, tok, o->top_ids[i]);
        ADD_LIT(b, "}");
    }
    ADD_LIT(b, "}");
}

/* The prompt's tokens into the completions logprobs arrays (echo): the
 * first has no logprob (null), as in vLLM and the legacy API. */
static void add_echo_logprobs(struct api_oai_result *res, const struct api_oai_req *r, const model_tok *tok,
                              const struct model_sample_out *plp, int n)
{
    size_t off = 0;
    int keep = r->prompt_logprobs > r->top_logprobs ? r->top_logprobs : -1; /* tops beyond logprobs are dropped */
    for (int p = 0; p < n; p++, res->n_lp++) {
        const struct model_sample_out *o = &plp[p];
        const char *sep = res->n_lp ? "," : "";
        json_buf_add(&res->lp, sep, strlen(sep));
        add_token_str(&res->lp, r->tokens_as_ids ? NULL : tok, o->token);
        json_buf_add(&res->lp_vals, sep, strlen(sep));
        json_buf_add(&res->lp_top, sep, strlen(sep));
        json_buf_addf(&res->lp_off, "%s%zu", sep, off);
        size_t bl = 0;
        if (tok) model_tok_bytes(tok, o->token, &bl);
        off += bl;
        if (p == 0) {
            ADD_LIT(&res->lp_vals, "null");
            ADD_LIT(&res->lp_top, "null");
            continue;
        }
        json_buf_addf(&res->lp_vals, "%.6g", lp_value(o->logprob));
        ADD_LIT(&res->lp_top, "{");
        add_token_str(&res->lp_top, r->tokens_as_ids ? NULL : tok, o->token);
        json_buf_addf(&res->lp_top, ":%.6g", lp_value(o->logprob));
        for (int i = 0; i < o->n_top && (keep < 0 || i < keep); i++) {
            if (o->top_ids[i] == o->token) continue;
            ADD_LIT(&res->lp_top, ",");
            add_token_str(&res->lp_top, r->tokens_as_ids ? NULL : tok, o->top_ids[i]);
            json_buf_addf(&res->lp_top, ":%.6g", lp_value(o->top_logprobs[i]));
        }
        ADD_LIT(&res->lp_top, "}");
    }
}

void api_oai_result_add(struct api_oai_result *res, const struct api_oai_req *r, const model_tok *tok,
                        const struct sched_event *ev)
{
    const model_tok *names = r->tokens_as_ids ? NULL : tok; /* add_token_str without tok: "token_id:N" */
    if (ev->n_prompt_lp > 0 && !res->has_plp) {
        res->has_plp = true;
        if (r->prompt_logprobs >= 0)
            for (int p = 1; p < ev->n_prompt_lp; p++) {
                if (p > 1) ADD_LIT(&res->plp, ",");
                add_plp_entry(&res->plp, names, &ev->prompt_lp[p]);
            }
        if (r->echo && r->logprobs) add_echo_logprobs(res, r, tok, ev->prompt_lp, ev->n_prompt_lp);
    }
    size_t before = res->text.len;
    if (ev->text_len) json_buf_add(&res->text, ev->text, ev->text_len);
    if (ev->kind == SCHED_EV_FINISH) {
        res->done = true;
        res->finish = ev->finish;
        res->usage = ev->usage;
        snprintf(res->error, sizeof res->error, "%s", ev->error);
        return;
    }
    if (!r->logprobs || !ev->has_logprobs) return;
    const struct model_sample_out *o = &ev->sample;
    const char *sep = res->n_lp ? "," : "";
    if (r->kind == API_OAI_CHAT) {
        json_buf_addf(&res->lp, "%s{\"token\":", sep);
        add_token_str(&res->lp, names, o->token);
        json_buf_addf(&res->lp, ",\"logprob\":%.6g,\"bytes\":", lp_value(o->logprob));
        add_bytes(&res->lp, tok, o->token);
        ADD_LIT(&res->lp, ",\"top_logprobs\":[");
        for (int i = 0; i < o->n_top; i++) {
            json_buf_addf(&res->lp, "%s{\"token\":", i ? "," : "");
            add_token_str(&res->lp, names, o->top_ids[i]);
            json_buf_addf(&res->lp, ",\"logprob\":%.6g,\"bytes\":", lp_value(o->top_logprobs[i]));
            add_bytes(&res->lp, tok, o->top_ids[i]);
            ADD_LIT(&res->lp, "}");
        }
        ADD_LIT(&res->lp, "]}");
    } else {
        json_buf_add(&res->lp, sep, strlen(sep));
        add_token_str(&res->lp, names, o->token);
        json_buf_addf(&res->lp_vals, "%s%.6g", sep, lp_value(o->logprob));
        json_buf_addf(&res->lp_off, "%s%zu", sep, before);
        /* the sampled token first, then the top ones without it: up to
         * logprobs + 1 entries, as the legacy API and vLLM give */
        json_buf_add(&res->lp_top, sep, strlen(sep));
        ADD_LIT(&res->lp_top, "{");
        add_token_str(&res->lp_top, names, o->token);
        json_buf_addf(&res->lp_top, ":%.6g", lp_value(o->logprob));
        for (int i = 0; i < o->n_top; i++) {
            if (o->top_ids[i] == o->token) continue;
            ADD_LIT(&res->lp_top, ",");
            add_token_str(&res->lp_top, names, o->top_ids[i]);
            json_buf_addf(&res->lp_top, ":%.6g", lp_value(o->top_logprobs[i]));
        }
        ADD_LIT(&res->lp_top, "}");
    }
    res->n_lp++;
}

static const char *buf_or_empty(const struct json_buf *b) { return b->p ? b->p : ""; }

/* Appends choice i's object {"index":i, message|text, logprobs, finish_reason}. */
void api_oai_forced_call_id(const char *response_id, int choice, char out[32])
{
    uint32_t h = 2166136261u;
    for (const char *p = response_id; *p; p++) h = (h ^ (unsigned char)*p) * 16777619u;
    snprintf(out, 32, "call_%08x%d", h, choice);
}

int api_oai_list_calls(struct json_buf *b, const char *text, size_t len, const char *response_id, int choice,
                       bool with_index)
{
    json_doc d;
    char err[64];
    if (!len || json_parse(&d, text, len, err, sizeof err)) return 0;
    int n = 0;
    if (json_is_arr(&d, 0)) {
        for (int k = 0, p = 1; k < json_size(&d, 0); k++, p = json_skip(&d, p)) {
            int nm = json_is_obj(&d, p) ? json_get(&d, p, "name") : -1, pa = nm >= 0 ? json_get(&d, p, "parameters") : -1;
            if (nm < 0 || pa < 0 || !json_is_str(&d, nm)) continue;
            size_t nl = 0, al = 0;
            const char *name = json_raw(&d, nm, &nl), *args = json_raw(&d, pa, &al);
            char cid[32];
            api_oai_forced_call_id(response_id, choice * 1000 + n, cid);
            if (n) json_buf_lit(b, ",");
            json_buf_lit(b, "{");
            if (with_index) json_buf_addf(b, "\"index\":%d,", n);
            json_buf_addf(b, "\"id\":\"%s\",\"type\":\"function\",\"function\":{\"name\":", cid);
            json_buf_add(b, name - 1, nl + 2);
            json_buf_lit(b, ",\"arguments\":");
            json_buf_add_str(b, args, al);
            json_buf_lit(b, "}}");
            n++;
        }
    }
    json_free(&d);
    return n;
}

static void choice_json(struct json_buf *b, const struct api_oai_req *r, const struct api_oai_result *res, int i,
                        const char *id)
{
    bool chat = r->kind == API_OAI_CHAT, has_calls = false;
    json_buf_addf(b, "{\"index\":%d,", i);
    struct json_buf calls;
    json_buf_init(&calls);
    if (chat && r->forced_list && api_oai_list_calls(&calls, buf_or_empty(&res->text), res->text.len, id, i, false)) {
        json_buf_addf(b, "\"message\":{\"role\":\"assistant\",\"content\":null,\"tool_calls\":[%s]},\"logprobs\":",
                      calls.p);
        if (r->logprobs) json_buf_addf(b, "{\"content\":[%s]}", buf_or_empty(&res->lp));
        else ADD_LIT(b, "null");
        has_calls = true;
    } else if (chat && r->forced_tool) {
        char cid[32];
        api_oai_forced_call_id(id, i, cid);
        /* the grammar lets JSON start and end with whitespace; arguments are the object alone */
        const char *args = buf_or_empty(&res->text);
        size_t alen = res->text.len;
        while (alen && strchr(" \t\r\n", *args)) args++, alen--;
        while (alen && strchr(" \t\r\n", args[alen - 1])) alen--;
        has_calls = r->forced_required;
        json_buf_addf(b, "\"message\":{\"role\":\"assistant\",\"content\":null,\"tool_calls\":[{\"id\":\"%s\","
                         "\"type\":\"function\",\"function\":{\"name\":", cid);
        json_buf_add_str(b, r->forced_tool, strlen(r->forced_tool));
        ADD_LIT(b, ",\"arguments\":");
        json_buf_add_str(b, args, alen);
        ADD_LIT(b, "}}]},\"logprobs\":");
        if (r->logprobs) json_buf_addf(b, "{\"content\":[%s]}", buf_or_empty(&res->lp));
        else ADD_LIT(b, "null");
    } else if (chat) {
        ADD_LIT(b, "\"message\":{\"role\":\"assistant\",\"content\":");
        int rk, tk;
        api_chat_parsers(&rk, &tk);
        if (!r->tools) tk = API_TOOLS_NONE;
        if (rk || tk) {
            /* --reasoning-parser / --tool-call-parser: reasoning_content, content, tool_calls */
            struct json_buf rs, mid, content, calls;
            json_buf_init(&rs), json_buf_init(&mid), json_buf_init(&content), json_buf_init(&calls);
            struct api_reasoning rp;
            struct api_toolcall tp;
            api_reasoning_init(&rp, rk);
            api_reasoning_feed(&rp, buf_or_empty(&res->text), res->text.len, &rs, &mid);
            api_reasoning_flush(&rp, &rs, &mid);
            api_toolcall_init(&tp, tk);
            api_toolcall_feed(&tp, buf_or_empty(&mid), mid.len, &content, &calls);
            api_toolcall_flush(&tp, &content, &calls);
            api_toolcall_free(&tp);
            if (calls.len && !content.len) ADD_LIT(b, "null");
            else json_buf_add_str(b, buf_or_empty(&content), content.len);
            if (rk) {
                /* "reasoning" as vLLM writes it now; "reasoning_content" for older clients */
                for (int k = 0; k < 2; k++) {
                    if (k) ADD_LIT(b, ",\"reasoning_content\":");
                    else ADD_LIT(b, ",\"reasoning\":");
                    if (rs.len) json_buf_add_str(b, rs.p, rs.len);
                    else ADD_LIT(b, "null");
                }
            }
            if (calls.len) json_buf_addf(b, ",\"tool_calls\":[%s]", calls.p);
            has_calls = calls.len > 0;
            json_buf_free(&rs), json_buf_free(&mid), json_buf_free(&content), json_buf_free(&calls);
        } else {
            json_buf_add_str(b, buf_or_empty(&res->text), res->text.len);
        }
        ADD_LIT(b, "},\"logprobs\":");
        if (r->logprobs) json_buf_addf(b, "{\"content\":[%s]}", buf_or_empty(&res->lp));
        else ADD_LIT(b, "null");
    } else {
        ADD_LIT(b, "\"text\":");
        json_buf_add_str(b, buf_or_empty(&res->text), res->text.len);
        if (r->prompt_logprobs >= 0)
            json_buf_addf(b, ",\"prompt_logprobs\":[null%s%s]", res->plp.len ? "," : "", buf_or_empty(&res->plp));
        ADD_LIT(b, ",\"logprobs\":");
        if (r->logprobs)
            json_buf_addf(b, "{\"tokens\":[%s],\"token_logprobs\":[%s],\"top_logprobs\":[%s],\"text_offset\":[%s]}",
                          buf_or_empty(&res->lp), buf_or_empty(&res->lp_vals), buf_or_empty(&res->lp_top),
                          buf_or_empty(&res->lp_off));
        else ADD_LIT(b, "null");
    }
    json_buf_free(&calls);
    json_buf_addf(b, ",\"finish_reason\":\"%s\"}",
                  has_calls && res->finish == SCHED_FINISH_STOP ? "tool_calls" : sched_finish_name(res->finish));
}

void api_oai_response_json(struct json_buf *b, const struct api_oai_req *r, const struct api_oai_result *res,
                           const char *id, long created, const char *model_name)
{
    bool chat = r->kind == API_OAI_CHAT;
    int n = api_oai_n_choices(r), per = r->n > 1 ? r->n : 1;
    ADD_LIT(b, "{\"id\":");
    json_buf_add_str(b, id, strlen(id));
    json_buf_addf(b, ",\"object\":\"%s\",\"created\":%ld,\"model\":", chat ? "chat.completion" : "text_completion",
                  created);
    json_buf_add_str(b, model_name, strlen(model_name));
    ADD_LIT(b, ",\"choices\":[");
    int completion = 0, prompt = 0, cached = 0;
    for (int i = 0; i < n; i++) {
        if (i) ADD_LIT(b, ",");
        choice_json(b, r, &res[i], i, id);
        completion += res[i].usage.completion_tokens;
        if (i % per == 0) prompt += res[i].usage.prompt_tokens, cached += res[i].usage.cached_tokens;
    }
    ADD_LIT(b, "]");
    if (chat && r->prompt_logprobs >= 0) /* vLLM: one list for the chat, beside the choices */
        json_buf_addf(b, ",\"prompt_logprobs\":[null%s%s]", res[0].plp.len ? "," : "", buf_or_empty(&res[0].plp));
    json_buf_addf(b,
                  ",\"usage\":{\"prompt_tokens\":%d,\"completion_tokens\":%d,"
                  "\"total_tokens\":%d,\"prompt_tokens_details\":{\"cached_tokens\":%d}}}",
                  prompt, completion, prompt + completion, cached);
}

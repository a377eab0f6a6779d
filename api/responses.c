/* responses.c - OpenAI's Responses API (POST /v1/responses) on top of chat
 * completions (openai.h): a request body is translated into the chat body
 * it means, and a finished chat result is written back as a Response object.
 * The streaming events are written by server_complete.c with the helpers
 * here.
 *
 * Supported: model, input (a string, or items: messages whose content is a
 * string or input_text/output_text parts, function_call and
 * function_call_output), instructions, max_output_tokens, temperature,
 * top_p, seed, stream, text.format (text, json_object, json_schema), tools
 * (function tools) and tool_choice, metadata/store/user/truncation/reasoning
 * (accepted, no effect: responses are not stored). Refused with a 400 naming
 * the field: previous_response_id, background (responses are not stored, so
 * there would be nothing to retrieve), non-function tools, other input items.
 * The Response object echoes the request's settings (api_resp_echo).
 * The reply is built from the chat reply (api_resp_from_chat): its content
 * becomes a message item, its tool calls function_call items.
 */
#include <stdio.h>
#include <string.h>

#include "openai.h"

static void copy_raw(struct json_buf *o, const json_doc *d, int i)
{
    size_t n = 0;
    const char *p = json_raw(d, i, &n);
    if (json_is_str(d, i)) {
        json_buf_add(o, p - 1, n + 2); /* keep the quotes and the escapes as sent */
    } else {
        json_buf_add(o, p, n);
    }
}

/* One input message's content: a string, or parts -> chat text parts. */
static int add_content(struct json_buf *o, const json_doc *d, int c, struct api_oai_error *e)
{
    if (json_is_str(d, c)) {
        copy_raw(o, d, c);
        return 0;
    }
    if (!json_is_arr(d, c)) return api_oai_errorf(e, 400, "input", "a message's 'content' must be a string or parts");
    json_buf_lit(o, "[");
    for (int k = 0, p = c + 1; k < json_size(d, c); k++, p = json_skip(d, p)) {
        int ty = json_is_obj(d, p) ? json_get(d, p, "type") : -1, tx = ty >= 0 ? json_get(d, p, "text") : -1;
        if (ty < 0 || tx < 0 || !json_is_str(d, tx) ||
            !(json_str_eq(d, ty, "input_text") || json_str_eq(d, ty, "output_text") || json_str_eq(d, ty, "text")))
            return api_oai_errorf(e, 400, "input", "only text content parts (input_text, output_text) are supported");
        json_buf_addf(o, "%s{\"type\":\"text\",\"text\":", k ? "," : "");
        copy_raw(o, d, tx);
        json_buf_lit(o, "}");
    }
    json_buf_lit(o, "]");
    return 0;
}

/* The Responses fields that are not passed on to the chat body as they are
 * (those are checked there, under the same names): each wrong type is a 400
 * naming the field here, before the translation could drop it or give it a
 * chat name. */
static int check_resp_fields(const json_doc *d, struct api_oai_error *e)
{
    static const struct { const char *key; char type; } fields[] = {
        {"text", 'o'}, {"tools", 'a'}, {"metadata", 'o'}, {"store", 'b'}, {"user", 's'}, {"truncation", 's'},
        {"reasoning", 'o'}, {"parallel_tool_calls", 'b'}, {"include", 'a'}, {"max_tool_calls", 'i'},
        {"background", 'b'}, {"service_tier", 's'}, {"prompt_cache_key", 's'}, {"safety_identifier", 's'},
        {"max_output_tokens", 'i'}, {"tool_choice", 'x'},
    };
    for (size_t k = 0; k < sizeof fields / sizeof *fields; k++) {
        int v = json_get(d, 0, fields[k].key);
        if (v < 0 || json_is_null(d, v)) continue;
        int64_t iv = 0;
        const char *want = NULL;
        switch (fields[k].type) {
        case 'o': want = json_is_obj(d, v) ? NULL : "an object"; break;
        case 'a': want = json_is_arr(d, v) ? NULL : "an array"; break;
        case 'b': want = json_is_bool(d, v) ? NULL : "a boolean"; break;
        case 's': want = json_is_str(d, v) ? NULL : "a string"; break;
        case 'i': want = json_is_num(d, v) && json_i64(d, v, &iv) == 0 ? NULL : "an integer"; break;
        case 'x': want = json_is_str(d, v) || json_is_obj(d, v) ? NULL : "a string or an object"; break;
        }
        if (want) return api_oai_errorf(e, 400, fields[k].key, "'%s' must be %s", fields[k].key, want);
        if (!strcmp(fields[k].key, "max_output_tokens") && iv < 1)
            return api_oai_errorf(e, 400, "max_output_tokens", "'max_output_tokens' must be at least 1, got %lld",
                                  (long long)iv);
    }
    int tr = json_get(d, 0, "truncation");
    if (tr >= 0 && json_is_str(d, tr) && !json_str_eq(d, tr, "auto") && !json_str_eq(d, tr, "disabled"))
        return api_oai_errorf(e, 400, "truncation", "'truncation' must be \"auto\" or \"disabled\"");
    int bg = json_get(d, 0, "background");
    bool b = false;
    if (bg >= 0 && json_is_bool(d, bg) && json_bool(d, bg, &b) == 0 && b)
        return api_oai_errorf(e, 400, "background", "'background' is not supported (responses are not stored)");
    int tx = json_get(d, 0, "text"), fm = tx >= 0 && json_is_obj(d, tx) ? json_get(d, tx, "format") : -1;
    if (fm >= 0 && !json_is_null(d, fm)) {
        int ty = json_is_obj(d, fm) ? json_get(d, fm, "type") : -1, sc = ty >= 0 ? json_get(d, fm, "schema") : -1;
        if (!json_str_eq(d, ty, "text") && !json_str_eq(d, ty, "json_object") && !json_str_eq(d, ty, "json_schema"))
            return api_oai_errorf(e, 400, "text.format",
                                  "'text.format' must be an object whose 'type' is \"text\", \"json_object\" or "
                                  "\"json_schema\"");
        if (json_str_eq(d, ty, "json_schema") && (sc < 0 || !json_is_obj(d, sc)))
            return api_oai_errorf(e, 400, "text.format.schema", "'text.format.schema' must be an object (a JSON schema)");
    }
    return 0;
}

void api_resp_chat_error(struct api_oai_error *e)
{
    /* the chat names of what the body gave under Responses names */
    static const char *const names[][2] = {
        {"max_tokens", "max_output_tokens"}, {"response_format", "text.format"}, {"messages", "input"},
    };
    for (size_t k = 0; k < sizeof names / sizeof *names; k++) {
        size_t n = strlen(names[k][0]);
        if (!strncmp(e->param, names[k][0], n) && (e->param[n] == 0 || e->param[n] == '[' || e->param[n] == '.'))
            snprintf(e->param, sizeof e->param, "%s", names[k][1]);
        /* messages[i] is not input[i] (instructions come first): the message keeps its words */
        if (!strcmp(names[k][0], "messages")) continue;
        /* in the message, where it names the field as a word */
        char out[sizeof e->message];
        size_t o = 0;
        for (const char *p = e->message; *p && o + 1 < sizeof out;) {
            bool edge = p == e->message || !(p[-1] == '_' || (p[-1] >= 'a' && p[-1] <= 'z'));
            if (edge && !strncmp(p, names[k][0], n) && p[n] != '_' && !(p[n] >= 'a' && p[n] <= 'z')) {
                o += (size_t)snprintf(out + o, sizeof out - o, "%s", names[k][1]);
                if (o >= sizeof out) o = sizeof out - 1;
                p += n;
            } else {
                out[o++] = *p++;
            }
        }
        out[o] = 0;
        memcpy(e->message, out, o + 1);
    }
}

int api_resp_to_chat(const char *body, size_t len, struct json_buf *chat, struct api_oai_error *e)
{
    json_doc d;
    char perr[256];
    if (json_parse(&d, body, len, perr, sizeof perr))
        return api_oai_errorf(e, 400, NULL, "request body is not valid JSON: %s", perr);
    int rc = 0;
    if (!json_is_obj(&d, 0)) {
        rc = api_oai_errorf(e, 400, NULL, "the request body must be a JSON object");
        goto out;
    }
    static const char *const refused[] = {"previous_response_id", "prompt", NULL};
    for (int i = 0; refused[i]; i++) {
        int v = json_get(&d, 0, refused[i]);
        if (v >= 0 && !json_is_null(&d, v) && !(json_is_arr(&d, v) && json_size(&d, v) == 0)) {
            rc = api_oai_errorf(e, 400, refused[i], "'%s' is not supported on /v1/responses yet%s", refused[i],
                                !strcmp(refused[i], "previous_response_id") ? " (responses are not stored)" : "");
            goto out;
        }
    }
    if ((rc = check_resp_fields(&d, e))) goto out;
    json_buf_lit(chat, "{\"messages\":[");
    bool any = false;
    int ins = json_get(&d, 0, "instructions");
    if (ins >= 0 && !json_is_null(&d, ins)) {
        if (!json_is_str(&d, ins)) {
            rc = api_oai_errorf(e, 400, "instructions", "'instructions' must be a string");
            goto out;
        }
        json_buf_lit(chat, "{\"role\":\"system\",\"content\":");
        copy_raw(chat, &d, ins);
        json_buf_lit(chat, "}");
        any = true;
    }
    int in = json_get(&d, 0, "input");
    if (in < 0 || json_is_null(&d, in)) {
        rc = api_oai_errorf(e, 400, "input", "'input' is required");
        goto out;
    }
    if (json_is_str(&d, in)) {
        json_buf_addf(chat, "%s{\"role\":\"user\",\"content\":", any ? "," : "");
        copy_raw(chat, &d, in);
        json_buf_lit(chat, "}");
    } else if (json_is_arr(&d, in) && json_size(&d, in) > 0) {
        for (int k = 0, p = in + 1; k < json_size(&d, in); k++, p = json_skip(&d, p)) {
            int ty = json_is_obj(&d, p) ? json_get(&d, p, "type") : -1;
            if (ty >= 0 && json_str_eq(&d, ty, "function_call")) {
                int ci = json_get(&d, p, "call_id"), nm = json_get(&d, p, "name"), ar = json_get(&d, p, "arguments");
                if (ci < 0 || nm < 0 || ar < 0 || !json_is_str(&d, ci) || !json_is_str(&d, nm) || !json_is_str(&d, ar)) {
                    rc = api_oai_errorf(e, 400, "input", "input item %d: a function_call needs call_id, name, arguments", k);
                    goto out;
                }
                /* content "", not null: templates without tool support still render the turn */
                json_buf_addf(chat, "%s{\"role\":\"assistant\",\"content\":\"\",\"tool_calls\":[{\"id\":",
                              any || k ? "," : "");
                copy_raw(chat, &d, ci);
                json_buf_lit(chat, ",\"type\":\"function\",\"function\":{\"name\":");
                copy_raw(chat, &d, nm);
                json_buf_lit(chat, ",\"arguments\":");
                copy_raw(chat, &d, ar);
                json_buf_lit(chat, "}}]}");
                continue;
            }
            if (ty >= 0 && json_str_eq(&d, ty, "function_call_output")) {
                int ci = json_get(&d, p, "call_id"), ou = json_get(&d, p, "output");
                if (ci < 0 || ou < 0 || !json_is_str(&d, ci) || !json_is_str(&d, ou)) {
                    rc = api_oai_errorf(e, 400, "input", "input item %d: a function_call_output needs call_id, output", k);
                    goto out;
                }
                json_buf_addf(chat, "%s{\"role\":\"tool\",\"tool_call_id\":", any || k ? "," : "");
                copy_raw(chat, &d, ci);
                json_buf_lit(chat, ",\"content\":");
                copy_raw(chat, &d, ou);
                json_buf_lit(chat, "}");
                continue;
            }
            int role = json_is_obj(&d, p) ? json_get(&d, p, "role") : -1, c = role >= 0 ? json_get(&d, p, "content") : -1;
            if ((ty >= 0 && !json_str_eq(&d, ty, "message")) || role < 0 || !json_is_str(&d, role) || c < 0) {
                rc = api_oai_errorf(e, 400, "input",
                                    "input item %d: only messages, function_call and function_call_output are supported", k);
                goto out;
            }
            json_buf_addf(chat, "%s{\"role\":", any || k ? "," : "");
            bool dev = json_str_eq(&d, role, "developer");
            if (dev) json_buf_lit(chat, "\"system\"");
            else copy_raw(chat, &d, role);
            json_buf_lit(chat, ",\"content\":");
            if ((rc = add_content(chat, &d, c, e))) goto out;
            json_buf_lit(chat, "}");
        }
    } else {
        rc = api_oai_errorf(e, 400, "input", "'input' must be a string or a non-empty array of messages");
        goto out;
    }
    json_buf_lit(chat, "]");
    static const char *const same[] = {"model", "temperature", "top_p", "seed", "stream", "top_logprobs", NULL};
    for (int i = 0; same[i]; i++) {
        int v = json_get(&d, 0, same[i]);
        if (v < 0) continue;
        json_buf_addf(chat, ",\"%s\":", same[i]);
        copy_raw(chat, &d, v);
    }
    int mo = json_get(&d, 0, "max_output_tokens");
    if (mo >= 0) {
        json_buf_lit(chat, ",\"max_tokens\":");
        copy_raw(chat, &d, mo);
    }
    int tl = json_get(&d, 0, "tools");
    if (tl >= 0 && json_is_arr(&d, tl) && json_size(&d, tl) > 0) {
        json_buf_lit(chat, ",\"tools\":[");
        for (int k = 0, p = tl + 1; k < json_size(&d, tl); k++, p = json_skip(&d, p)) {
            int ty = json_is_obj(&d, p) ? json_get(&d, p, "type") : -1, nm = ty >= 0 ? json_get(&d, p, "name") : -1;
            if (ty < 0 || !json_str_eq(&d, ty, "function") || nm < 0 || !json_is_str(&d, nm)) {
                rc = api_oai_errorf(e, 400, "tools", "tool %d: only function tools (type, name, parameters) are supported", k);
                goto out;
            }
            json_buf_addf(chat, "%s{\"type\":\"function\",\"function\":{\"name\":", k ? "," : "");
            copy_raw(chat, &d, nm);
            static const char *const keys[] = {"description", "parameters", NULL};
            for (int i = 0; keys[i]; i++) {
                int v = json_get(&d, p, keys[i]);
                if (v < 0 || json_is_null(&d, v)) continue;
                json_buf_addf(chat, ",\"%s\":", keys[i]);
                copy_raw(chat, &d, v);
            }
            json_buf_lit(chat, "}}");
        }
        json_buf_lit(chat, "]");
    }
    int tc = json_get(&d, 0, "tool_choice");
    if (tc >= 0 && !json_is_null(&d, tc)) {
        json_buf_lit(chat, ",\"tool_choice\":");
        int nm = json_is_obj(&d, tc) ? json_get(&d, tc, "name") : -1;
        if (nm >= 0 && json_is_str(&d, nm)) { /* {"type": "function", "name": X} */
            json_buf_lit(chat, "{\"type\":\"function\",\"function\":{\"name\":");
            copy_raw(chat, &d, nm);
            json_buf_lit(chat, "}}");
        } else {
            copy_raw(chat, &d, tc);
        }
    }
    int tx = json_get(&d, 0, "text"), fm = tx >= 0 && json_is_obj(&d, tx) ? json_get(&d, tx, "format") : -1;
    if (fm >= 0 && json_is_obj(&d, fm)) {
        int ty = json_get(&d, fm, "type"), sc = json_get(&d, fm, "schema");
        if (ty >= 0 && json_str_eq(&d, ty, "json_schema")) {
            json_buf_lit(chat, ",\"response_format\":{\"type\":\"json_schema\",\"json_schema\":{\"schema\":");
            if (sc >= 0) copy_raw(chat, &d, sc);
            else json_buf_lit(chat, "null");
            json_buf_lit(chat, "}}");
        } else if (ty >= 0) {
            json_buf_lit(chat, ",\"response_format\":");
            copy_raw(chat, &d, fm);
        }
    }
    json_buf_lit(chat, "}");
    if (chat->oom) rc = api_oai_errorf(e, 500, NULL, "out of memory");
out:
    json_free(&d);
    return rc;
}

int api_resp_echo(const char *body, size_t len, struct json_buf *out)
{
    json_doc d;
    char perr[64];
    if (json_parse(&d, body, len, perr, sizeof perr) || !json_is_obj(&d, 0)) return SL_EINVAL;
    /* each field as the request gave it (null: absent), else OpenAI's default */
    static const struct { const char *key, *dflt; } f[] = {
        {"instructions", "null"}, {"max_output_tokens", "null"}, {"parallel_tool_calls", "true"},
        {"temperature", "1.0"}, {"tool_choice", "\"auto\""}, {"tools", "[]"}, {"top_p", "1.0"},
        {"text", "{\"format\":{\"type\":\"text\"}}"}, {"metadata", "{}"}, {"truncation", "\"disabled\""},
        {"user", "null"}, {"top_logprobs", "null"}, {"max_tool_calls", "null"}, {"service_tier", "\"auto\""},
    };
    for (size_t k = 0; k < sizeof f / sizeof *f; k++) {
        int v = json_get(&d, 0, f[k].key);
        json_buf_addf(out, "%s\"%s\":", k ? "," : "", f[k].key);
        if (v >= 0 && !json_is_null(&d, v)) copy_raw(out, &d, v);
        else json_buf_add(out, f[k].dflt, strlen(f[k].dflt));
    }
    json_buf_lit(out, ",\"store\":false,\"background\":false,\"previous_response_id\":null");
    json_free(&d);
    return out->oom ? SL_ENOMEM : 0;
}

static const char *const DEFAULT_ECHO = "\"parallel_tool_calls\":true,\"tool_choice\":\"auto\",\"tools\":[]";

void api_resp_json(struct json_buf *b, const char *rid, long created, const char *model, const char *status,
                   const char *text, size_t len, const struct sched_usage *u, enum sched_finish finish,
                   const char *echo)
{
    bool done = !strcmp(status, "completed") || !strcmp(status, "incomplete");
    json_buf_addf(b, "{\"id\":\"resp_%s\",\"object\":\"response\",\"created_at\":%ld,\"status\":\"%s\",\"model\":", rid,
                  created, status);
    json_buf_add_str(b, model, strlen(model));
    json_buf_lit(b, ",\"incomplete_details\":");
    if (!strcmp(status, "incomplete"))
        json_buf_addf(b, "{\"reason\":\"%s\"}", finish == SCHED_FINISH_LENGTH ? "max_output_tokens" : "content_filter");
    else
        json_buf_lit(b, "null");
    json_buf_lit(b, ",\"error\":null,\"output\":[");
    if (done) {
        json_buf_addf(b, "{\"type\":\"message\",\"id\":\"msg_%s\",\"status\":\"%s\",\"role\":\"assistant\",\"content\":"
                         "[{\"type\":\"output_text\",\"text\":",
                      rid, status);
        json_buf_add_str(b, text, len);
        json_buf_lit(b, ",\"annotations\":[]}]}");
    }
    json_buf_addf(b, "],%s,\"usage\":", echo && *echo ? echo : DEFAULT_ECHO);
    if (done && u)
        json_buf_addf(b, "{\"input_tokens\":%d,\"input_tokens_details\":{\"cached_tokens\":%d},\"output_tokens\":%d,"
                         "\"output_tokens_details\":{\"reasoning_tokens\":0},\"total_tokens\":%d}}",
                      u->prompt_tokens, u->cached_tokens, u->completion_tokens, u->prompt_tokens + u->completion_tokens);
    else
        json_buf_lit(b, "null}");
}

void api_resp_from_chat(struct json_buf *b, const char *chat_json, size_t len, const char *rid, long created,
                        const char *model, const char *echo)
{
    json_doc d;
    char err[64];
    if (json_parse(&d, chat_json, len, err, sizeof err) || !json_is_obj(&d, 0)) {
        api_resp_json(b, rid, created, model, "failed", "", 0, NULL, SCHED_FINISH_ERROR, echo);
        return;
    }
    int ch = json_get(&d, 0, "choices"), c0 = ch >= 0 ? json_at(&d, ch, 0) : -1;
    int msg = c0 >= 0 ? json_get(&d, c0, "message") : -1, fin = c0 >= 0 ? json_get(&d, c0, "finish_reason") : -1;
    int content = msg >= 0 ? json_get(&d, msg, "content") : -1, calls = msg >= 0 ? json_get(&d, msg, "tool_calls") : -1;
    int us = json_get(&d, 0, "usage");
    /* cut by max_output_tokens, or aborted (the server shutting down, --shutdown-timeout) */
    bool aborted = fin >= 0 && json_str_eq(&d, fin, "abort"), cut = aborted || (fin >= 0 && json_str_eq(&d, fin, "length"));
    json_buf_addf(b, "{\"id\":\"resp_%s\",\"object\":\"response\",\"created_at\":%ld,\"status\":\"%s\",\"model\":", rid,
                  created, cut ? "incomplete" : "completed");
    json_buf_add_str(b, model, strlen(model));
    json_buf_lit(b, ",\"incomplete_details\":");
    if (cut) json_buf_addf(b, "{\"reason\":\"%s\"}", aborted ? "interrupted" : "max_output_tokens");
    else json_buf_lit(b, "null");
    json_buf_lit(b, ",\"error\":null,\"output\":[");
    bool comma = false;
    if (content >= 0 && json_is_str(&d, content)) {
        json_buf_addf(b, "{\"type\":\"message\",\"id\":\"msg_%s\",\"status\":\"%s\",\"role\":\"assistant\",\"content\":"
                         "[{\"type\":\"output_text\",\"text\":",
                      rid, cut ? "incomplete" : "completed");
        copy_raw(b, &d, content);
        json_buf_lit(b, ",\"annotations\":[]}]}");
        comma = true;
    }
    for (int k = 0; calls >= 0 && json_is_arr(&d, calls) && k < json_size(&d, calls); k++) {
        int tc = json_at(&d, calls, k), id = json_get(&d, tc, "id"), fn = json_get(&d, tc, "function");
        int nm = fn >= 0 ? json_get(&d, fn, "name") : -1, ar = fn >= 0 ? json_get(&d, fn, "arguments") : -1;
        if (id < 0 || nm < 0 || ar < 0) continue;
        json_buf_addf(b, "%s{\"type\":\"function_call\",\"id\":\"fc_%s_%d\",\"call_id\":", comma ? "," : "", rid, k);
        copy_raw(b, &d, id);
        json_buf_lit(b, ",\"name\":");
        copy_raw(b, &d, nm);
        json_buf_lit(b, ",\"arguments\":");
        copy_raw(b, &d, ar);
        json_buf_lit(b, ",\"status\":\"completed\"}");
        comma = true;
    }
    json_buf_addf(b, "],%s,\"usage\":", echo && *echo ? echo : DEFAULT_ECHO);
    int pt = us >= 0 ? json_get(&d, us, "prompt_tokens") : -1, ct = us >= 0 ? json_get(&d, us, "completion_tokens") : -1;
    int pd = us >= 0 ? json_get(&d, us, "prompt_tokens_details") : -1, cc = pd >= 0 ? json_get(&d, pd, "cached_tokens") : -1;
    int64_t p = 0, c = 0, cached = 0;
    if (pt >= 0) json_i64(&d, pt, &p);
    if (ct >= 0) json_i64(&d, ct, &c);
    if (cc >= 0) json_i64(&d, cc, &cached);
    json_buf_addf(b, "{\"input_tokens\":%lld,\"input_tokens_details\":{\"cached_tokens\":%lld},\"output_tokens\":%lld,"
                     "\"output_tokens_details\":{\"reasoning_tokens\":0},\"total_tokens\":%lld}}",
                  (long long)p, (long long)cached, (long long)c, (long long)(p + c));
    json_free(&d);
}

/* chat.c - the chat prompt: a chat request body (messages, tools,
 * chat_template_kwargs, add_generation_prompt) rendered with the model's own
 * chat template (model/template.c), or the --chat-template override, or
 * ChatML when the model ships none. See openai.h.
 *
 * The template is chosen once per process by api_chat_setup (before any
 * thread parses requests) and read-only afterwards, so renders run on any
 * thread. Without setup, ChatML is used.
 */
#include <pthread.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "openai.h"

#define ADD_LIT(b, lit) json_buf_add((b), (lit), sizeof(lit) - 1)

static struct {
    model_tmpl *tmpl;      /* owned; NULL until setup or first ChatML use */
    char *bos, *eos;       /* owned; the tokenizer's BOS/EOS text ("" when none) */
    char source[64];       /* "model", "file", "chatml" */
} chat;

static int reasoning_kind, toolcall_kind;

void api_chat_set_parsers(int rk, int tk)
{
    reasoning_kind = rk > 0 ? rk : 0;
    toolcall_kind = tk > 0 ? tk : 0;
}

void api_chat_parsers(int *rk, int *tk)
{
    *rk = reasoning_kind;
    *tk = toolcall_kind;
}

static pthread_once_t chatml_once = PTHREAD_ONCE_INIT;
static model_tmpl *chatml;

static void chatml_init(void)
{
    char err[256];
    chatml = model_tmpl_create(model_chatml_template, strlen(model_chatml_template), err, sizeof err);
    SL_ASSERT(chatml != NULL);
}

static char *read_file(const char *path, size_t *len)
{
    FILE *f = fopen(path, "rb");
    if (!f) return NULL;
    char *p = NULL;
    if (fseek(f, 0, SEEK_END) == 0) {
        long n = ftell(f);
        if (n >= 0 && fseek(f, 0, SEEK_SET) == 0 && (p = malloc((size_t)n + 1))) {
            if (fread(p, 1, (size_t)n, f) != (size_t)n) {
                free(p);
                p = NULL;
            } else {
                p[n] = 0;
                *len = (size_t)n;
            }
        }
    }
    fclose(f);
    return p;
}

static char *token_text(const model_tok *tok, int32_t id)
{
    if (!tok || id < 0) return strdup("");
    size_t n;
    const char *s = model_tok_bytes(tok, id, &n);
    return s ? strndup(s, n) : strdup("");
}

int api_chat_setup(const model *m, const char *template_arg, char *err, size_t errlen)
{
    char *src = NULL;
    size_t len = 0;
    const char *source = "chatml";
    if (template_arg) {
        src = read_file(template_arg, &len);
        if (src) source = "file";
        else if (strstr(template_arg, "{{") || strstr(template_arg, "{%")) {
            /* vLLM also takes the template itself on the command line */
            src = strdup(template_arg);
            len = src ? strlen(src) : 0;
            source = "argument";
        } else {
            snprintf(err, errlen, "cannot read chat template file '%s'", template_arg);
            return SL_EIO;
        }
    } else if (m && model_chat_template(m)) {
        src = strdup(model_chat_template(m));
        len = src ? strlen(src) : 0;
        source = "model";
    }
    model_tmpl *t = NULL;
    if (src) {
        char e2[400];
        t = model_tmpl_create(src, len, e2, sizeof e2);
        free(src);
        if (!t) {
            snprintf(err, errlen, "the %s chat template does not parse: %s", source, e2);
            return SL_EFORMAT;
        }
    } else if (template_arg || (m && model_chat_template(m))) {
        snprintf(err, errlen, "out of memory");
        return SL_ENOMEM;
    }
    const model_tok *tok = m ? model_get_tok(m) : NULL;
    char *bos = token_text(tok, tok ? model_tok_bos(tok) : -1), *eos = token_text(tok, tok ? model_tok_eos(tok) : -1);
    if (!bos || !eos) {
        free(bos);
        free(eos);
        model_tmpl_destroy(t);
        snprintf(err, errlen, "out of memory");
        return SL_ENOMEM;
    }
    api_chat_teardown();
    chat.tmpl = t;
    chat.bos = bos;
    chat.eos = eos;
    snprintf(chat.source, sizeof chat.source, "%s", source);
    return 0;
}

void api_chat_teardown(void)
{
    model_tmpl_destroy(chat.tmpl);
    free(chat.bos);
    free(chat.eos);
    memset(&chat, 0, sizeof chat);
}

const char *api_chat_source(void) { return chat.source[0] ? chat.source : "chatml"; }

/* Appends the JSON value at i as written (strings with their quotes). */
static void add_raw(struct json_buf *b, const json_doc *d, int i)
{
    size_t n;
    const char *s = json_raw(d, i, &n);
    if (json_is_str(d, i)) ADD_LIT(b, "\"");
    json_buf_add(b, s, n);
    if (json_is_str(d, i)) ADD_LIT(b, "\"");
}

/* A content value as templates expect it: a string stays, an array of text
 * parts becomes their texts joined with newlines (vLLM's "string" content
 * format), null stays null. */
static int add_content(struct json_buf *b, const json_doc *d, int c, int k, struct api_oai_error *e)
{
    char param[64];
    snprintf(param, sizeof param, "messages[%d].content", k);
    if (json_is_str(d, c)) {
        add_raw(b, d, c);
        return 0;
    }
    if (json_is_null(d, c)) { /* an assistant turn of tool calls alone: the templates see "", as in vLLM */
        ADD_LIT(b, "\"\"");
        return 0;
    }
    if (!json_is_arr(d, c)) return api_oai_errorf(e, 400, param, "'%s' must be a string or an array of content parts", param);
    struct json_buf t;
    json_buf_init(&t);
    int n = json_size(d, c);
    for (int j = 0, p = c + 1; j < n; j++, p = json_skip(d, p)) {
        int type = json_is_obj(d, p) ? json_get(d, p, "type") : -1;
        int text = json_is_obj(d, p) ? json_get(d, p, "text") : -1;
        if (type < 0 || !json_str_eq(d, type, "text") || text < 0 || !json_is_str(d, text)) {
            json_buf_free(&t);
            return api_oai_errorf(e, 400, param, "'%s[%d]': only {\"type\": \"text\", \"text\": ...} parts are supported",
                                  param, j);
        }
        size_t len;
        char *s = json_strdup(d, text, &len);
        if (!s) {
            json_buf_free(&t);
            return api_oai_errorf(e, 400, param, "'%s[%d].text' is not a valid string", param, j);
        }
        if (j) ADD_LIT(&t, "\n");
        json_buf_add(&t, s, len);
        free(s);
    }
    json_buf_add_str(b, t.p ? t.p : "", t.len);
    json_buf_free(&t);
    return 0;
}

/* tool_calls with each function.arguments JSON string turned into the object
 * it encodes (as vLLM does: templates iterate arguments|items or tojson them). */
static void add_tool_calls(struct json_buf *b, const json_doc *d, int tc)
{
    if (!json_is_arr(d, tc)) {
        add_raw(b, d, tc);
        return;
    }
    ADD_LIT(b, "[");
    int n = json_size(d, tc);
    for (int j = 0, p = tc + 1; j < n; j++, p = json_skip(d, p)) {
        if (j) ADD_LIT(b, ",");
        if (!json_is_obj(d, p)) {
            add_raw(b, d, p);
            continue;
        }
        ADD_LIT(b, "{");
        int m = json_size(d, p);
        for (int k = 0, q = p + 1; k < m; k++, q = json_skip(d, q + 1)) {
            if (k) ADD_LIT(b, ",");
            add_raw(b, d, q);
            ADD_LIT(b, ":");
            int v = q + 1;
            if (!json_str_eq(d, q, "function") || !json_is_obj(d, v)) {
                add_raw(b, d, v);
                continue;
            }
            ADD_LIT(b, "{");
            int fm = json_size(d, v);
            for (int f = 0, r = v + 1; f < fm; f++, r = json_skip(d, r + 1)) {
                if (f) ADD_LIT(b, ",");
                add_raw(b, d, r);
                ADD_LIT(b, ":");
                char *args = json_str_eq(d, r, "arguments") && json_is_str(d, r + 1) ? json_strdup(d, r + 1, NULL) : NULL;
                json_doc ad;
                char aerr[64];
                if (args && json_parse(&ad, args, strlen(args), aerr, sizeof aerr) == 0) {
                    if (json_is_obj(&ad, 0)) json_buf_add(b, args, strlen(args));
                    else add_raw(b, d, r + 1);
                    json_free(&ad);
                } else {
                    add_raw(b, d, r + 1);
                }
                free(args);
            }
            ADD_LIT(b, "}");
        }
        ADD_LIT(b, "}");
    }
    ADD_LIT(b, "]");
}

/* One message's members other than its content's parts: content is there
 * (a string or parts) unless an assistant turn calls tools or says nothing,
 * as OpenAI requires; name and tool_call_id are strings, tool_calls an
 * array. A user turn without content is a client bug, not an empty turn. */
static int check_message(const json_doc *d, int p, int k, struct api_oai_error *e)
{
    char param[64];
    int role = json_get(d, p, "role"), c = json_get(d, p, "content");
    bool assistant = json_str_eq(d, role, "assistant");
    if (!assistant && (c < 0 || json_is_null(d, c))) {
        char rn[16] = "";
        json_str(d, role, rn, sizeof rn);
        snprintf(param, sizeof param, "messages[%d].content", k);
        return api_oai_errorf(e, 400, param, "'%s' is required for a %s message", param, rn);
    }
    static const char *const strs[] = {"name", "tool_call_id", "reasoning_content", "reasoning"};
    for (size_t j = 0; j < sizeof strs / sizeof *strs; j++) {
        int v = json_get(d, p, strs[j]);
        if (v >= 0 && !json_is_null(d, v) && !json_is_str(d, v)) {
            snprintf(param, sizeof param, "messages[%d].%s", k, strs[j]);
            return api_oai_errorf(e, 400, param, "'%s' must be a string", param);
        }
    }
    int tc = json_get(d, p, "tool_calls");
    if (tc >= 0 && !json_is_null(d, tc)) {
        snprintf(param, sizeof param, "messages[%d].tool_calls", k);
        if (!assistant) return api_oai_errorf(e, 400, param, "'%s' is only allowed on assistant messages", param);
        if (!json_is_arr(d, tc)) return api_oai_errorf(e, 400, param, "'%s' must be an array", param);
        for (int j = 0, q = tc + 1; j < json_size(d, tc); j++, q = json_skip(d, q)) {
            int fn = json_is_obj(d, q) ? json_get(d, q, "function") : -1;
            int nm = fn >= 0 && json_is_obj(d, fn) ? json_get(d, fn, "name") : -1;
            int ar = nm >= 0 ? json_get(d, fn, "arguments") : -1;
            if (nm < 0 || !json_is_str(d, nm) || (ar >= 0 && !json_is_str(d, ar) && !json_is_obj(d, ar)))
                return api_oai_errorf(e, 400, param,
                                      "'%s[%d]' must be {\"type\": \"function\", \"function\": {\"name\": a string, "
                                      "\"arguments\": a JSON string}}", param, j);
        }
    }
    return 0;
}

int api_chat_check_tools(const json_doc *d, int t, struct api_oai_error *e)
{
    if (t < 0 || json_is_null(d, t)) return 0;
    if (!json_is_arr(d, t)) return api_oai_errorf(e, 400, "tools", "'tools' must be an array");
    for (int k = 0, p = t + 1; k < json_size(d, t); k++, p = json_skip(d, p)) {
        /* type may be left out: vLLM defaults it to "function" */
        int ty = json_is_obj(d, p) ? json_get(d, p, "type") : -1, fn = json_is_obj(d, p) ? json_get(d, p, "function") : -1;
        int nm = fn >= 0 && json_is_obj(d, fn) ? json_get(d, fn, "name") : -1;
        int pa = nm >= 0 ? json_get(d, fn, "parameters") : -1, de = nm >= 0 ? json_get(d, fn, "description") : -1;
        if ((ty >= 0 && !json_str_eq(d, ty, "function")) || nm < 0 || !json_is_str(d, nm) ||
            (pa >= 0 && !json_is_null(d, pa) && !json_is_obj(d, pa)) ||
            (de >= 0 && !json_is_null(d, de) && !json_is_str(d, de))) {
            char param[32];
            snprintf(param, sizeof param, "tools[%d]", k);
            return api_oai_errorf(e, 400, param,
                                  "'%s' must be {\"type\": \"function\", \"function\": {\"name\": a string, "
                                  "\"description\": a string, \"parameters\": an object}}", param);
        }
    }
    return 0;
}

/* The names the template's context defines itself (api_chat_context), the
 * template engine's globals, and what vLLM refuses in kwargs (chat_template,
 * tokenize). A kwarg of one of these names would replace it: "messages": []
 * renders a prompt without the messages that were checked to be there,
 * "raise_exception" silences the template's own checks. vLLM drops such keys
 * without a word; refusing says why the render would not be what was asked.
 * enable_thinking is the template's to read, not ours: it stays allowed. */
static int check_kwargs(const json_doc *d, int kw, struct api_oai_error *e)
{
    static const char *const reserved[] = {
        "messages", "tools", "add_generation_prompt", "documents", "continue_final_message", "bos_token",
        "eos_token", "chat_template", "tokenize", "range", "namespace", "dict", "raise_exception", "strftime_now",
    };
    for (int k = 0, p = kw + 1; k < json_size(d, kw); k++, p = json_skip(d, p + 1))
        for (size_t j = 0; j < sizeof reserved / sizeof *reserved; j++) {
            if (!json_str_eq(d, p, reserved[j])) continue;
            char param[64];
            snprintf(param, sizeof param, "chat_template_kwargs.%s", reserved[j]);
            bool top = j < 3;
            return api_oai_errorf(e, 400, param, "'chat_template_kwargs' may not set '%s'%s", reserved[j],
                                  top ? ": it is the request's own parameter (give it at the top level of the body)"
                                      : ": the chat template's own variable");
        }
    return 0;
}

int api_chat_context(const json_doc *d, int obj, struct json_buf *ctx, struct api_oai_error *e)
{
    int m = json_get(d, obj, "messages");
    if (m < 0 || json_is_null(d, m)) return api_oai_errorf(e, 400, "messages", "'messages' is required");
    if (!json_is_arr(d, m) || json_size(d, m) == 0)
        return api_oai_errorf(e, 400, "messages", "'messages' must be a non-empty array");
    static const char *const known[] = {"system", "user", "assistant", "developer", "tool"};
    ADD_LIT(ctx, "{\"messages\":[");
    int n = json_size(d, m);
    for (int k = 0, p = m + 1; k < n; k++, p = json_skip(d, p)) {
        char param[64];
        snprintf(param, sizeof param, "messages[%d].role", k);
        if (!json_is_obj(d, p)) return api_oai_errorf(e, 400, "messages", "'messages[%d]' must be an object", k);
        int role = json_get(d, p, "role");
        bool ok = false;
        for (size_t j = 0; role >= 0 && j < sizeof known / sizeof *known; j++) ok |= json_str_eq(d, role, known[j]);
        if (!ok) return api_oai_errorf(e, 400, param, "'%s' must be one of system, user, assistant, developer, tool", param);
        int rc = check_message(d, p, k, e);
        if (rc) return rc;
        if (k) ADD_LIT(ctx, ",");
        ADD_LIT(ctx, "{");
        int nm = json_size(d, p);
        if (json_get(d, p, "content") < 0) ADD_LIT(ctx, "\"content\":\"\"" ","); /* no content: "" too */
        for (int j = 0, q = p + 1; j < nm; j++, q = json_skip(d, q + 1)) {
            if (j) ADD_LIT(ctx, ",");
            add_raw(ctx, d, q);
            ADD_LIT(ctx, ":");
            if (json_str_eq(d, q, "content")) {
                if ((rc = add_content(ctx, d, q + 1, k, e))) return rc;
            } else if (json_str_eq(d, q, "tool_calls")) {
                add_tool_calls(ctx, d, q + 1);
            } else {
                add_raw(ctx, d, q + 1);
            }
        }
        ADD_LIT(ctx, "}");
    }
    ADD_LIT(ctx, "],\"tools\":");
    int t = json_get(d, obj, "tools");
    if (t >= 0 && !json_is_null(d, t)) {
        int rc = api_chat_check_tools(d, t, e);
        if (rc) return rc;
        add_raw(ctx, d, t);
    } else {
        ADD_LIT(ctx, "null");
    }
    /* vLLM refuses a request's own template unless --trust-request-chat-template:
     * rendering the model's instead would answer a different question */
    int ct = json_get(d, obj, "chat_template");
    if (ct >= 0 && !json_is_null(d, ct))
        return api_oai_errorf(e, 400, "chat_template",
                              "'chat_template' in a request is not accepted: the server renders with the model's "
                              "template or --chat-template");
    bool agp = true, cfm = false;
    int g = json_get(d, obj, "add_generation_prompt"), cf = json_get(d, obj, "continue_final_message");
    if (g >= 0 && !json_is_null(d, g) && json_bool(d, g, &agp))
        return api_oai_errorf(e, 400, "add_generation_prompt", "'add_generation_prompt' must be a boolean");
    if (cf >= 0 && !json_is_null(d, cf) && json_bool(d, cf, &cfm))
        return api_oai_errorf(e, 400, "continue_final_message", "'continue_final_message' must be a boolean");
    if (cfm && g >= 0 && agp) /* vLLM's words */
        return api_oai_errorf(e, 400, "continue_final_message",
                              "Cannot set both `continue_final_message` and `add_generation_prompt` to True.");
    if (cfm) agp = false;
    json_buf_addf(ctx, ",\"documents\":null,\"add_generation_prompt\":%s,\"bos_token\":", agp ? "true" : "false");
    const char *bos = chat.bos ? chat.bos : "", *eos = chat.eos ? chat.eos : "";
    json_buf_add_str(ctx, bos, strlen(bos));
    ADD_LIT(ctx, ",\"eos_token\":");
    json_buf_add_str(ctx, eos, strlen(eos));
    int et = json_get(d, obj, "enable_thinking");
    if (et >= 0 && !json_is_null(d, et)) {
        if (!json_is_bool(d, et)) return api_oai_errorf(e, 400, "enable_thinking", "'enable_thinking' must be a boolean");
        ADD_LIT(ctx, ",\"enable_thinking\":");
        add_raw(ctx, d, et);
    }
    int kw = json_get(d, obj, "chat_template_kwargs");
    if (kw >= 0 && !json_is_null(d, kw)) {
        if (!json_is_obj(d, kw)) return api_oai_errorf(e, 400, "chat_template_kwargs", "'chat_template_kwargs' must be an object");
        int rc = check_kwargs(d, kw, e);
        if (rc) return rc;
        size_t rn;
        const char *raw = json_raw(d, kw, &rn);
        if (json_size(d, kw) > 0 && rn >= 2) {
            ADD_LIT(ctx, ",");
            json_buf_add(ctx, raw + 1, rn - 2);
        }
    }
    ADD_LIT(ctx, "}");
    if (ctx->oom) return api_oai_errorf(e, 500, NULL, "out of memory");
    return 0;
}

/* continue_final_message: the prompt ends with the final message's content
 * (stripped), whatever the template wrote after it, so the model continues
 * that message (transformers' apply_chat_template, which vLLM calls). */
static int continue_final(const json_doc *d, int obj, char *prompt, size_t *n, struct api_oai_error *e)
{
    int cf = json_get(d, obj, "continue_final_message");
    bool on = false;
    if (cf < 0 || json_is_null(d, cf) || json_bool(d, cf, &on) || !on) return 0;
    int m = json_get(d, obj, "messages");
    int last = m + 1;
    for (int k = 1; k < json_size(d, m); k++) last = json_skip(d, last);
    int c = json_get(d, last, "content");
    if (c >= 0 && json_is_arr(d, c)) { /* the last text part */
        int t = -1;
        for (int k = 0, p = c + 1; k < json_size(d, c); k++, p = json_skip(d, p)) {
            int x = json_is_obj(d, p) ? json_get(d, p, "text") : -1;
            if (x >= 0 && json_is_str(d, x)) t = x;
        }
        c = t;
    }
    size_t cl = 0;
    char *content = c >= 0 && json_is_str(d, c) ? json_strdup(d, c, &cl) : NULL;
    if (!content)
        return api_oai_errorf(e, 400, "continue_final_message", "'continue_final_message' needs a final message with text");
    const char *s = content;
    while (cl && strchr(" \t\r\n", *s)) s++, cl--;
    while (cl && strchr(" \t\r\n", s[cl - 1])) cl--;
    const char *hit = NULL;
    for (const char *p = prompt; cl && (p = memmem(p, *n - (size_t)(p - prompt), s, cl)); p++) hit = p;
    free(content);
    if (!cl) return 0;
    if (!hit)
        return api_oai_errorf(e, 400, "continue_final_message",
                              "the chat template does not render the final message's content as it is given");
    *n = (size_t)(hit - prompt) + cl;
    prompt[*n] = '\0';
    return 0;
}

int api_chat_render(const json_doc *d, int obj, char **prompt, size_t *len, struct api_oai_error *e)
{
    *prompt = NULL;
    if (len) *len = 0;
    struct json_buf ctx;
    json_buf_init(&ctx);
    int rc = api_chat_context(d, obj, &ctx, e);
    if (rc) goto done;
    const model_tmpl *t = chat.tmpl;
    if (!t) {
        pthread_once(&chatml_once, chatml_init);
        t = chatml;
    }
    char err[512];
    size_t n;
    rc = model_tmpl_render(t, ctx.p, ctx.len, NULL, prompt, &n, err, sizeof err);
    if (rc) rc = api_oai_errorf(e, rc == SL_ENOMEM ? 500 : 400, "messages", "chat template: %s", err);
    if (!rc) rc = continue_final(d, obj, *prompt, &n, e);
    if (!rc && len) *len = n;
done:
    json_buf_free(&ctx);
    return rc;
}

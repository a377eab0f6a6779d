/* toolcall.c - --tool-call-parser: finds tool calls in generated content and
 * turns them into OpenAI tool_calls, incrementally (see openai.h).
 *
 *   hermes (Qwen, Hermes):  <tool_call>{"name": ..., "arguments": {...}}</tool_call>
 *   glm47 / glm45 (GLM):    <tool_call>NAME<arg_key>K</arg_key><arg_value>V</arg_value>...</tool_call>
 *
 * Text outside the tags is content. A call is emitted when its closing tag
 * arrives, with "arguments" a JSON string written as Python's json.dumps
 * writes it (", " and ": " separators, non-ASCII kept), as vLLM does. A call
 * that does not parse, or is never closed, falls back to plain content.
 */
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "openai.h"

static const char OPEN[] = "<tool_call>", CLOSE[] = "</tool_call>";

int api_toolcall_lookup(const char *name)
{
    if (!name) return API_TOOLS_NONE;
    if (!strcmp(name, "hermes")) return API_TOOLS_HERMES;
    if (!strcmp(name, "glm47") || !strcmp(name, "glm45")) return API_TOOLS_GLM47;
    return -1;
}

void api_toolcall_init(struct api_toolcall *p, int kind)
{
    memset(p, 0, sizeof *p);
    p->kind = kind;
    json_buf_init(&p->pending);
}

void api_toolcall_free(struct api_toolcall *p)
{
    if (!p) return;
    json_buf_free(&p->pending);
}

/* ---- JSON re-serialization in Python's json.dumps style ----------------------- */

static void py_json(struct json_buf *b, const json_doc *d, int i)
{
    if (json_is_obj(d, i) || json_is_arr(d, i)) {
        bool obj = json_is_obj(d, i);
        json_buf_add(b, obj ? "{" : "[", 1);
        int n = json_size(d, i);
        for (int k = 0, p = i + 1; k < n; k++) {
            if (k) json_buf_lit(b, ", ");
            if (obj) {
                py_json(b, d, p);
                json_buf_lit(b, ": ");
                py_json(b, d, p + 1);
                p = json_skip(d, p + 1);
            } else {
                py_json(b, d, p);
                p = json_skip(d, p);
            }
        }
        json_buf_add(b, obj ? "}" : "]", 1);
    } else if (json_is_str(d, i)) {
        size_t n;
        char *s = json_strdup(d, i, &n);
        if (s) json_buf_add_str(b, s, n);
        else json_buf_lit(b, "\"\"");
        free(s);
    } else {
        size_t n;
        const char *raw = json_raw(d, i, &n);
        json_buf_add(b, raw, n);
    }
}

static void emit_call(struct api_toolcall *p, struct json_buf *calls, const char *name, size_t nl, const char *args,
                      size_t al)
{
    /* deterministic id: FNV-1a of the call, and its index */
    uint32_t h = 2166136261u;
    for (size_t i = 0; i < nl; i++) h = (h ^ (unsigned char)name[i]) * 16777619u;
    for (size_t i = 0; i < al; i++) h = (h ^ (unsigned char)args[i]) * 16777619u;
    if (calls->len) json_buf_lit(calls, ",");
    json_buf_addf(calls, "{\"index\":%d,\"id\":\"call_%08x%d\",\"type\":\"function\",\"function\":{\"name\":", p->n_calls,
                  h, p->n_calls);
    json_buf_add_str(calls, name, nl);
    json_buf_lit(calls, ",\"arguments\":");
    json_buf_add_str(calls, args, al);
    json_buf_lit(calls, "}}");
    p->n_calls++;
}

static bool ws(char c) { return c == ' ' || c == '\n' || c == '\r' || c == '\t'; }

static void trim(const char **s, size_t *n)
{
    while (*n && ws(**s)) (*s)++, (*n)--;
    while (*n && ws((*s)[*n - 1])) (*n)--;
}

/* hermes: {"name": ..., "arguments": {...}}; false when it does not parse. */
static bool parse_hermes(struct api_toolcall *p, const char *s, size_t n, struct json_buf *calls)
{
    trim(&s, &n);
    json_doc d;
    char err[64];
    if (json_parse(&d, s, n, err, sizeof err)) return false;
    bool ok = false;
    int name = json_is_obj(&d, 0) ? json_get(&d, 0, "name") : -1;
    int args = json_is_obj(&d, 0) ? json_get(&d, 0, "arguments") : -1;
    if (args < 0 && json_is_obj(&d, 0)) args = json_get(&d, 0, "parameters");
    if (name >= 0 && json_is_str(&d, name)) {
        size_t nl;
        char *nm = json_strdup(&d, name, &nl);
        struct json_buf a;
        json_buf_init(&a);
        if (args < 0) json_buf_lit(&a, "{}");
        else if (json_is_str(&d, args)) {
            /* already a JSON string: keep its text */
            char *t = json_strdup(&d, args, NULL);
            if (t) json_buf_add(&a, t, strlen(t));
            free(t);
        } else py_json(&a, &d, args);
        if (nm && !a.oom) {
            emit_call(p, calls, nm, nl, a.p ? a.p : "", a.len);
            ok = true;
        }
        free(nm);
        json_buf_free(&a);
    }
    json_free(&d);
    return ok;
}

/* glm47: NAME<arg_key>k</arg_key><arg_value>v</arg_value>... */
static bool parse_glm(struct api_toolcall *p, const char *s, size_t n, struct json_buf *calls)
{
    static const char KO[] = "<arg_key>", KC[] = "</arg_key>", VO[] = "<arg_value>", VC[] = "</arg_value>";
    const char *end = s + n;
    const char *first = memmem(s, n, KO, sizeof KO - 1);
    const char *name = s;
    size_t nl = (size_t)((first ? first : end) - s);
    trim(&name, &nl);
    if (!nl || memchr(name, '<', nl) || memchr(name, '{', nl)) return false;
    struct json_buf a;
    json_buf_init(&a);
    json_buf_lit(&a, "{");
    int nargs = 0;
    const char *q = first;
    bool ok = true;
    while (q && q < end) {
        const char *k = q + sizeof KO - 1;
        const char *kc = memmem(k, (size_t)(end - k), KC, sizeof KC - 1);
        if (!kc) { ok = false; break; }
        const char *vo = memmem(kc, (size_t)(end - kc), VO, sizeof VO - 1);
        if (!vo) { ok = false; break; }
        const char *v = vo + sizeof VO - 1;
        const char *vc = memmem(v, (size_t)(end - v), VC, sizeof VC - 1);
        if (!vc) { ok = false; break; }
        const char *key = k;
        size_t kl = (size_t)(kc - k), vl = (size_t)(vc - v);
        trim(&key, &kl);
        if (nargs++) json_buf_lit(&a, ", ");
        json_buf_add_str(&a, key, kl);
        json_buf_lit(&a, ": ");
        /* a value that is JSON (number, bool, null, object, array) stays JSON; else it is a string */
        json_doc d;
        char err[32];
        const char *vt = v;
        size_t vtl = vl;
        trim(&vt, &vtl);
        if (vtl && *vt != '"' && json_parse(&d, vt, vtl, err, sizeof err) == 0) {
            py_json(&a, &d, 0);
            json_free(&d);
        } else {
            json_buf_add_str(&a, v, vl);
        }
        q = memmem(vc, (size_t)(end - vc), KO, sizeof KO - 1);
    }
    json_buf_lit(&a, "}");
    if (ok && !a.oom) emit_call(p, calls, name, nl, a.p, a.len);
    json_buf_free(&a);
    return ok;
}

/* Length of the longest suffix of s[0..n) that is a proper prefix of tag. */
static size_t partial(const char *s, size_t n, const char *tag)
{
    size_t tl = strlen(tag);
    for (size_t k = tl - 1; k > 0; k--)
        if (k <= n && !memcmp(s + n - k, tag, k)) return k;
    return 0;
}

/* Consumes what it can of pending; keeps an unfinished call or a partial tag. */
static void drain(struct api_toolcall *p, bool final, struct json_buf *content, struct json_buf *calls)
{
    const char *s = p->pending.p ? p->pending.p : "";
    size_t n = p->pending.len, i = 0;
    while (i < n) {
        const char *rest = s + i;
        size_t rn = n - i;
        const char *open = memmem(rest, rn, OPEN, sizeof OPEN - 1);
        if (!open) {
            size_t hold = final ? 0 : partial(rest, rn, OPEN);
            json_buf_add(content, rest, rn - hold);
            i += rn - hold;
            break;
        }
        json_buf_add(content, rest, (size_t)(open - rest));
        const char *body = open + sizeof OPEN - 1;
        const char *close = memmem(body, (size_t)(s + n - body), CLOSE, sizeof CLOSE - 1);
        if (!close) {
            if (final) json_buf_add(content, open, (size_t)(s + n - open)); /* never closed: plain text */
            i = final ? n : (size_t)(open - s);
            break;
        }
        bool ok = p->kind == API_TOOLS_HERMES ? parse_hermes(p, body, (size_t)(close - body), calls)
                                              : parse_glm(p, body, (size_t)(close - body), calls);
        if (!ok) json_buf_add(content, open, (size_t)(close - open) + sizeof CLOSE - 1);
        i = (size_t)(close - s) + sizeof CLOSE - 1;
    }
    /* keep the unconsumed tail */
    size_t left = n - i;
    if (left) memmove(p->pending.p, s + i, left);
    p->pending.len = left;
    if (p->pending.p) p->pending.p[left] = 0;
}

void api_toolcall_feed(struct api_toolcall *p, const char *s, size_t n, struct json_buf *content, struct json_buf *calls)
{
    if (p->kind == API_TOOLS_NONE) {
        json_buf_add(content, s, n);
        return;
    }
    json_buf_add(&p->pending, s, n);
    drain(p, false, content, calls);
}

void api_toolcall_flush(struct api_toolcall *p, struct json_buf *content, struct json_buf *calls)
{
    if (p->kind != API_TOOLS_NONE) drain(p, true, content, calls);
}

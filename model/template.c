/* template.c - the chat template engine: a Jinja subset evaluated with the
 * semantics of Python jinja2 in HF transformers' environment (sandboxed,
 * trim_blocks + lstrip_blocks, loop controls, tojson = json.dumps with
 * ensure_ascii=False, raise_exception, strftime_now), so a model's own chat
 * template renders byte for byte as transformers renders it.
 *
 * Values follow Python: str() of a list or dict is its repr, True/False/None
 * print capitalized, floats print as repr, strings are UTF-8 and measured in
 * code points. Undefined follows jinja2's default Undefined: it prints as
 * nothing, iterates as empty, is false, and any attribute, item, call or
 * arithmetic on it fails. Filters that return generators in jinja2 (map,
 * select*, reject*, items, unique, reverse) return a list marked as a
 * generator: always true, no length, not JSON-serializable - as there.
 *
 * The parser is in tmpl_parse.c; what both share is in tmpl_internal.h.
 */
#include <ctype.h>
#include <math.h>
#include <stdarg.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

#include "base/json.h"
#include "model.h"
#include "tmpl_internal.h"

#define RENDER_MEM_LIMIT ((size_t)1 << 30)   /* bytes of values a render may allocate */
#define RENDER_STEP_LIMIT 50000000L          /* evaluation steps: no template loops forever */
#define MAX_RANGE 100000                     /* jinja2's sandbox MAX_RANGE */
#define MAX_CALL_DEPTH 100                   /* macro recursion */

/* ---- arena ---------------------------------------------------------------------------- */

struct tmpl_chunk {
    struct tmpl_chunk *next;
    size_t used, cap;
    _Alignas(16) unsigned char data[];
};

void tmpl_fail(struct tmpl_arena *a, int line, const char *fmt, ...)
{
    char msg[400];
    va_list ap;
    va_start(ap, fmt);
    vsnprintf(msg, sizeof msg, fmt, ap);
    va_end(ap);
    if (a->err && a->errlen) {
        if (line > 0) snprintf(a->err, a->errlen, "chat template line %d: %s", line, msg);
        else snprintf(a->err, a->errlen, "%s", msg);
    }
    longjmp(*a->jb, 1);
}

void *tmpl_alloc(struct tmpl_arena *a, size_t n)
{
    n = (n + 15) & ~(size_t)15;
    if (n == 0) n = 16;
    struct tmpl_chunk *c = a->head;
    if (!c || c->cap - c->used < n) {
        size_t cap = n > 65536 ? n : 65536;
        if (a->limit && a->total + cap > a->limit) tmpl_fail(a, 0, "chat template needs more than %zu MiB of memory", a->limit >> 20);
        c = malloc(sizeof *c + cap);
        if (!c) tmpl_fail(a, 0, "out of memory rendering the chat template");
        c->used = 0;
        c->cap = cap;
        c->next = a->head;
        a->head = c;
        a->total += cap;
    }
    void *p = c->data + c->used;
    c->used += n;
    memset(p, 0, n);
    return p;
}

char *tmpl_strndup(struct tmpl_arena *a, const char *s, size_t n)
{
    char *p = tmpl_alloc(a, n + 1);
    if (n) memcpy(p, s, n);
    p[n] = 0;
    return p;
}

void tmpl_arena_free(struct tmpl_arena *a)
{
    struct tmpl_chunk *c = a->head;
    while (c) {
        struct tmpl_chunk *n = c->next;
        free(c);
        c = n;
    }
    a->head = NULL;
    a->total = 0;
}

/* ---- render state ---------------------------------------------------------------------- */

struct scope {
    struct scope *parent;
    struct tdict vars;
};

struct tmacro {
    const struct tnode *def;   /* N_MACRO or N_CALLBLOCK (a caller) */
    struct scope *closure;
    tval caller;               /* TV_UNDEF when none */
    const char *name;
};

struct tmethod {
    tval self;
    const char *name;
};

struct sb {
    char *p;
    size_t n, cap;
};

struct R {
    struct tmpl_arena *a;
    long steps;
    int depth;
    int64_t now;
    struct scope *root;
};

enum { BI_RANGE, BI_NAMESPACE, BI_DICT, BI_RAISE, BI_STRFTIME, BI_COUNT };
static const char *const bi_names[BI_COUNT] = {"range", "namespace", "dict", "raise_exception", "strftime_now"};

#define FAIL(r, line, ...) tmpl_fail((r)->a, (line), __VA_ARGS__)

static void sb_add(struct R *r, struct sb *b, const char *s, size_t n)
{
    if (!n) return;
    if (b->n + n + 1 > b->cap) {
        size_t nc = b->cap ? b->cap * 2 : 256;
        while (nc < b->n + n + 1) nc *= 2;
        char *p = tmpl_alloc(r->a, nc);
        if (b->n) memcpy(p, b->p, b->n);
        b->p = p;
        b->cap = nc;
    }
    memcpy(b->p + b->n, s, n);
    b->n += n;
    b->p[b->n] = 0;
}

static void sb_puts(struct R *r, struct sb *b, const char *s) { sb_add(r, b, s, strlen(s)); }

static void sb_printf(struct R *r, struct sb *b, const char *fmt, ...) __attribute__((format(printf, 3, 4)));
static void sb_printf(struct R *r, struct sb *b, const char *fmt, ...)
{
    char buf[512];
    va_list ap;
    va_start(ap, fmt);
    int n = vsnprintf(buf, sizeof buf, fmt, ap);
    va_end(ap);
    if (n > 0) sb_add(r, b, buf, (size_t)n < sizeof buf ? (size_t)n : sizeof buf - 1);
}

/* ---- values ----------------------------------------------------------------------------- */

static tval v_undef(const char *hint) { tval v = {.t = TV_UNDEF}; v.u.s.p = hint; v.u.s.n = hint ? strlen(hint) : 0; return v; }
static tval v_none(void) { return (tval){.t = TV_NONE}; }
static tval v_bool(bool b) { return (tval){.t = TV_BOOL, .u.b = b}; }
static tval v_int(int64_t i) { return (tval){.t = TV_INT, .u.i = i}; }
static tval v_float(double f) { return (tval){.t = TV_FLOAT, .u.f = f}; }
static tval v_str(const char *p, size_t n) { tval v = {.t = TV_STR}; v.u.s.p = p; v.u.s.n = n; return v; }
static tval v_sb(struct sb *b) { return v_str(b->p ? b->p : "", b->n); }
static tval v_cstr(const char *s) { return v_str(s, strlen(s)); }

static tval v_list(struct R *r, size_t cap)
{
    tval v = {.t = TV_LIST};
    v.u.l = tmpl_alloc(r->a, sizeof *v.u.l);
    if (cap) {
        v.u.l->v = tmpl_alloc(r->a, cap * sizeof(tval));
        v.u.l->cap = cap;
    }
    return v;
}

static void list_push(struct R *r, struct tlist *l, tval x)
{
    if (l->n == l->cap) {
        size_t nc = l->cap ? l->cap * 2 : 4;
        tval *nv = tmpl_alloc(r->a, nc * sizeof *nv);
        if (l->n) memcpy(nv, l->v, l->n * sizeof *nv);
        l->v = nv;
        l->cap = nc;
    }
    l->v[l->n++] = x;
}

static tval v_dict(struct R *r, int t)
{
    tval v = {.t = (uint8_t)t};
    v.u.d = tmpl_alloc(r->a, sizeof *v.u.d);
    return v;
}

static tval v_tuple2(struct R *r, tval a, tval b)
{
    tval t = v_list(r, 2);
    t.u.l->tuple = true;
    list_push(r, t.u.l, a);
    list_push(r, t.u.l, b);
    return t;
}

/* A list made by a filter that jinja2 implements as a generator. */
static bool is_gen(tval v) { return v.t == TV_LIST && v.u.l->gen; }
static void mark_gen(tval *v) { v->u.l->gen = true; }

static bool v_eq(tval a, tval b);

static bool is_num(tval v) { return v.t == TV_INT || v.t == TV_FLOAT || v.t == TV_BOOL; }
static double num_f(tval v) { return v.t == TV_FLOAT ? v.u.f : v.t == TV_INT ? (double)v.u.i : v.u.b; }
static int64_t num_i(tval v) { return v.t == TV_INT ? v.u.i : v.t == TV_BOOL ? v.u.b : (int64_t)v.u.f; }

static bool key_eq(tval a, const char *s, size_t n) { return a.t == TV_STR && a.u.s.n == n && !memcmp(a.u.s.p, s, n); }

static tval *dict_find(struct tdict *d, tval k)
{
    for (size_t i = 0; i < d->n; i++)
        if (v_eq(d->k[i], k)) return &d->v[i];
    return NULL;
}

static tval *dict_finds(struct tdict *d, const char *s, size_t n)
{
    for (size_t i = 0; i < d->n; i++)
        if (key_eq(d->k[i], s, n)) return &d->v[i];
    return NULL;
}

static void dict_set(struct R *r, struct tdict *d, tval k, tval v)
{
    tval *e = dict_find(d, k);
    if (e) {
        *e = v;
        return;
    }
    if (d->n == d->cap) {
        size_t nc = d->cap ? d->cap * 2 : 8;
        tval *nk = tmpl_alloc(r->a, nc * sizeof *nk), *nv = tmpl_alloc(r->a, nc * sizeof *nv);
        if (d->n) {
            memcpy(nk, d->k, d->n * sizeof *nk);
            memcpy(nv, d->v, d->n * sizeof *nv);
        }
        d->k = nk;
        d->v = nv;
        d->cap = nc;
    }
    d->k[d->n] = k;
    d->v[d->n++] = v;
}

static void dict_sets(struct R *r, struct tdict *d, const char *k, tval v) { dict_set(r, d, v_cstr(k), v); }

static const char *type_name(tval v)
{
    switch (v.t) {
    case TV_UNDEF: return "Undefined";
    case TV_NONE: return "NoneType";
    case TV_BOOL: return "bool";
    case TV_INT: return "int";
    case TV_FLOAT: return "float";
    case TV_STR: return "str";
    case TV_LIST: return is_gen(v) ? "generator" : v.u.l->tuple ? "tuple" : "list";
    case TV_DICT: return "dict";
    case TV_NS: return "Namespace";
    case TV_MACRO: return "Macro";
    case TV_BUILTIN: return "function";
    case TV_METHOD: return "method";
    }
    return "?";
}

static bool truthy(tval v)
{
    switch (v.t) {
    case TV_UNDEF: case TV_NONE: return false;
    case TV_BOOL: return v.u.b;
    case TV_INT: return v.u.i != 0;
    case TV_FLOAT: return v.u.f != 0;
    case TV_STR: return v.u.s.n != 0;
    case TV_LIST: return is_gen(v) || v.u.l->n != 0;
    case TV_DICT: return v.u.d->n != 0;
    default: return true;
    }
}

static bool v_eq(tval a, tval b)
{
    if (is_num(a) && is_num(b)) {
        if (a.t == TV_FLOAT || b.t == TV_FLOAT) return num_f(a) == num_f(b);
        return num_i(a) == num_i(b);
    }
    if (a.t != b.t) return false;
    switch (a.t) {
    case TV_UNDEF: case TV_NONE: return true;
    case TV_STR: return a.u.s.n == b.u.s.n && !memcmp(a.u.s.p, b.u.s.p, a.u.s.n);
    case TV_LIST:
        if (is_gen(a) || is_gen(b)) return a.u.l == b.u.l;
        if (a.u.l->n != b.u.l->n || (a.u.l->tuple != 0) != (b.u.l->tuple != 0)) return false;
        for (size_t i = 0; i < a.u.l->n; i++)
            if (!v_eq(a.u.l->v[i], b.u.l->v[i])) return false;
        return true;
    case TV_DICT:
        if (a.u.d->n != b.u.d->n) return false;
        for (size_t i = 0; i < a.u.d->n; i++) {
            tval *o = dict_find(b.u.d, a.u.d->k[i]);
            if (!o || !v_eq(a.u.d->v[i], *o)) return false;
        }
        return true;
    case TV_NS: return a.u.d == b.u.d;
    case TV_MACRO: return a.u.m == b.u.m;
    case TV_BUILTIN: return a.u.fn == b.u.fn;
    case TV_METHOD: return a.u.meth == b.u.meth;
    default: return false;
    }
}

/* Python's a < b; fails on unorderable types. Returns -1, 0, 1. */
static int v_cmp(struct R *r, int line, tval a, tval b)
{
    if (is_num(a) && is_num(b)) {
        if (a.t == TV_FLOAT || b.t == TV_FLOAT) {
            double x = num_f(a), y = num_f(b);
            return x < y ? -1 : x > y;
        }
        int64_t x = num_i(a), y = num_i(b);
        return x < y ? -1 : x > y;
    }
    if (a.t == TV_STR && b.t == TV_STR) {
        size_t n = a.u.s.n < b.u.s.n ? a.u.s.n : b.u.s.n;
        int c = memcmp(a.u.s.p, b.u.s.p, n);
        if (c) return c < 0 ? -1 : 1;
        return a.u.s.n < b.u.s.n ? -1 : a.u.s.n > b.u.s.n;
    }
    if (a.t == TV_LIST && b.t == TV_LIST && !is_gen(a) && !is_gen(b)) {
        for (size_t i = 0; i < a.u.l->n && i < b.u.l->n; i++) {
            if (v_eq(a.u.l->v[i], b.u.l->v[i])) continue;
            return v_cmp(r, line, a.u.l->v[i], b.u.l->v[i]);
        }
        return a.u.l->n < b.u.l->n ? -1 : a.u.l->n > b.u.l->n;
    }
    FAIL(r, line, "'<' not supported between instances of '%s' and '%s'", type_name(a), type_name(b));
}

/* ---- printing: Python str() and repr() ------------------------------------------------------- */

/* Python's repr(float): the shortest string that round-trips; scientific
 * notation when the exponent is < -4 or >= 16. */
static void fmt_float(double f, char *out, size_t cap)
{
    if (isnan(f)) { snprintf(out, cap, "nan"); return; }
    if (isinf(f)) { snprintf(out, cap, f < 0 ? "-inf" : "inf"); return; }
    char buf[40];
    int prec;
    for (prec = 1; prec <= 17; prec++) {
        snprintf(buf, sizeof buf, "%.*e", prec - 1, f);
        if (strtod(buf, NULL) == f) break;
    }
    /* buf = [-]d.ddde[+-]xx */
    char digits[24];
    int nd = 0, neg = buf[0] == '-';
    const char *p = buf + neg;
    for (; *p && *p != 'e'; p++)
        if (isdigit((unsigned char)*p)) digits[nd++] = *p;
    int exp = atoi(p + 1);
    while (nd > 1 && digits[nd - 1] == '0') nd--;
    digits[nd] = 0;
    char *o = out;
    size_t left = cap;
#define PUT(...) do { int k_ = snprintf(o, left, __VA_ARGS__); if (k_ < 0 || (size_t)k_ >= left) return; o += k_; left -= (size_t)k_; } while (0)
    if (neg) PUT("-");
    if (exp < -4 || exp >= 16) {
        PUT("%c", digits[0]);
        if (nd > 1) PUT(".%s", digits + 1);
        PUT("e%c%02d", exp < 0 ? '-' : '+', exp < 0 ? -exp : exp);
    } else if (exp < 0) {
        PUT("0.");
        for (int k = 0; k < -exp - 1; k++) PUT("0");
        PUT("%s", digits);
    } else {
        for (int k = 0; k <= exp; k++) PUT("%c", k < nd ? digits[k] : '0');
        PUT(".");
        if (nd > exp + 1) PUT("%s", digits + exp + 1);
        else PUT("0");
    }
#undef PUT
}

static void repr_str(struct R *r, struct sb *b, const char *s, size_t n)
{
    bool sq = memchr(s, '\'', n) != NULL, dq = memchr(s, '"', n) != NULL;
    char q = sq && !dq ? '"' : '\'';
    sb_add(r, b, &q, 1);
    for (size_t i = 0; i < n; i++) {
        unsigned char c = (unsigned char)s[i];
        if (c == '\\') sb_puts(r, b, "\\\\");
        else if (c == (unsigned char)q) { sb_puts(r, b, "\\"); sb_add(r, b, &q, 1); }
        else if (c == '\n') sb_puts(r, b, "\\n");
        else if (c == '\r') sb_puts(r, b, "\\r");
        else if (c == '\t') sb_puts(r, b, "\\t");
        else if (c < 0x20 || c == 0x7f) sb_printf(r, b, "\\x%02x", c);
        else sb_add(r, b, (const char *)&s[i], 1);
    }
    sb_add(r, b, &q, 1);
}

static void v_print(struct R *r, int line, struct sb *b, tval v, bool repr);

static void print_list(struct R *r, int line, struct sb *b, struct tlist *l)
{
    sb_puts(r, b, l->tuple ? "(" : "[");
    for (size_t i = 0; i < l->n; i++) {
        if (i) sb_puts(r, b, ", ");
        v_print(r, line, b, l->v[i], true);
    }
    if (l->tuple && l->n == 1) sb_puts(r, b, ",");
    sb_puts(r, b, l->tuple ? ")" : "]");
}

static void print_dict(struct R *r, int line, struct sb *b, struct tdict *d)
{
    sb_puts(r, b, "{");
    for (size_t i = 0; i < d->n; i++) {
        if (i) sb_puts(r, b, ", ");
        v_print(r, line, b, d->k[i], true);
        sb_puts(r, b, ": ");
        v_print(r, line, b, d->v[i], true);
    }
    sb_puts(r, b, "}");
}

static void v_print(struct R *r, int line, struct sb *b, tval v, bool repr)
{
    char buf[64];
    switch (v.t) {
    case TV_UNDEF: if (repr) sb_puts(r, b, "Undefined"); break;
    case TV_NONE: sb_puts(r, b, "None"); break;
    case TV_BOOL: sb_puts(r, b, v.u.b ? "True" : "False"); break;
    case TV_INT: sb_printf(r, b, "%lld", (long long)v.u.i); break;
    case TV_FLOAT: fmt_float(v.u.f, buf, sizeof buf); sb_puts(r, b, buf); break;
    case TV_STR:
        if (repr) repr_str(r, b, v.u.s.p, v.u.s.n);
        else sb_add(r, b, v.u.s.p, v.u.s.n);
        break;
    case TV_LIST:
        if (is_gen(v)) FAIL(r, line, "cannot print a generator (add '| list')");
        print_list(r, line, b, v.u.l);
        break;
    case TV_DICT: print_dict(r, line, b, v.u.d); break;
    case TV_NS: sb_puts(r, b, "<Namespace "); print_dict(r, line, b, v.u.d); sb_puts(r, b, ">"); break;
    case TV_MACRO: sb_printf(r, b, "<Macro '%s'>", v.u.m->name ? v.u.m->name : "caller"); break;
    default: FAIL(r, line, "cannot print a %s", type_name(v));
    }
}

static tval to_str(struct R *r, int line, tval v)
{
    if (v.t == TV_STR) return v;
    struct sb b = {0};
    v_print(r, line, &b, v, false);
    return v_sb(&b);
}

/* ---- JSON in and out --------------------------------------------------------------------------- */

static tval from_json(struct R *r, const json_doc *d, int i, int depth)
{
    if (depth > 200) FAIL(r, 0, "context JSON nested too deeply");
    if (json_is_obj(d, i)) {
        tval o = v_dict(r, TV_DICT);
        int n = json_size(d, i);
        for (int k = 0, p = i + 1; k < n; k++) {
            size_t len;
            char *s = json_strdup(d, p, &len);
            if (!s) FAIL(r, 0, "invalid string in the context JSON");
            tval key = v_str(tmpl_strndup(r->a, s, len), len);
            free(s);
            dict_set(r, o.u.d, key, from_json(r, d, p + 1, depth + 1));
            p = json_skip(d, p + 1);
        }
        return o;
    }
    if (json_is_arr(d, i)) {
        int n = json_size(d, i);
        tval l = v_list(r, (size_t)n);
        for (int k = 0, p = i + 1; k < n; k++, p = json_skip(d, p)) list_push(r, l.u.l, from_json(r, d, p, depth + 1));
        return l;
    }
    if (json_is_str(d, i)) {
        size_t len;
        char *s = json_strdup(d, i, &len);
        if (!s) FAIL(r, 0, "invalid string in the context JSON");
        tval v = v_str(tmpl_strndup(r->a, s, len), len);
        free(s);
        return v;
    }
    if (json_is_null(d, i)) return v_none();
    if (json_is_bool(d, i)) {
        bool b = false;
        json_bool(d, i, &b);
        return v_bool(b);
    }
    size_t len;
    const char *raw = json_raw(d, i, &len);
    int64_t iv;
    if (!memchr(raw, '.', len) && !memchr(raw, 'e', len) && !memchr(raw, 'E', len) && json_i64(d, i, &iv) == 0)
        return v_int(iv);
    double f = 0;
    if (json_f64(d, i, &f)) FAIL(r, 0, "invalid number in the context JSON");
    return v_float(f);
}

struct jopt {
    const char *indent;  /* NULL: none */
    const char *item_sep, *key_sep;
    bool ascii, sort;
};

static uint32_t utf8_dec(const unsigned char *s, size_t n, size_t *adv)
{
    unsigned c = s[0];
    int len = c < 0x80 ? 1 : (c & 0xE0) == 0xC0 ? 2 : (c & 0xF0) == 0xE0 ? 3 : (c & 0xF8) == 0xF0 ? 4 : 1;
    if ((size_t)len > n) len = 1;
    if (len == 1) { *adv = 1; return c; }
    uint32_t v = c & (0x3F >> (len - 1));
    for (int k = 1; k < len; k++) {
        if ((s[k] & 0xC0) != 0x80) { *adv = 1; return c; }
        v = v << 6 | (s[k] & 0x3F);
    }
    *adv = (size_t)len;
    return v;
}

static void json_str_out(struct R *r, struct sb *b, const char *s, size_t n, bool ascii)
{
    sb_puts(r, b, "\"");
    for (size_t i = 0; i < n;) {
        unsigned char c = (unsigned char)s[i];
        if (c == '"') sb_puts(r, b, "\\\"");
        else if (c == '\\') sb_puts(r, b, "\\\\");
        else if (c == '\n') sb_puts(r, b, "\\n");
        else if (c == '\r') sb_puts(r, b, "\\r");
        else if (c == '\t') sb_puts(r, b, "\\t");
        else if (c == '\b') sb_puts(r, b, "\\b");
        else if (c == '\f') sb_puts(r, b, "\\f");
        else if (c < 0x20 || (ascii && c == 0x7f)) sb_printf(r, b, "\\u%04x", c);
        else if (c >= 0x80 && ascii) {
            size_t adv;
            uint32_t cp = utf8_dec((const unsigned char *)s + i, n - i, &adv);
            if (cp >= 0x10000) {
                cp -= 0x10000;
                sb_printf(r, b, "\\u%04x\\u%04x", 0xD800 + (cp >> 10), 0xDC00 + (cp & 0x3FF));
            } else {
                sb_printf(r, b, "\\u%04x", cp);
            }
            i += adv;
            continue;
        } else sb_add(r, b, s + i, 1);
        i++;
    }
    sb_puts(r, b, "\"");
}

static void json_nl(struct R *r, struct sb *b, const struct jopt *o, int level)
{
    sb_puts(r, b, "\n");
    for (int k = 0; k < level; k++) sb_puts(r, b, o->indent);
}

static void to_json(struct R *r, int line, struct sb *b, tval v, const struct jopt *o, int level)
{
    char buf[64];
    if (level > 200) FAIL(r, line, "tojson: value nested too deeply");
    switch (v.t) {
    case TV_NONE: sb_puts(r, b, "null"); return;
    case TV_BOOL: sb_puts(r, b, v.u.b ? "true" : "false"); return;
    case TV_INT: sb_printf(r, b, "%lld", (long long)v.u.i); return;
    case TV_FLOAT:
        if (isnan(v.u.f)) sb_puts(r, b, "NaN");
        else if (isinf(v.u.f)) sb_puts(r, b, v.u.f < 0 ? "-Infinity" : "Infinity");
        else { fmt_float(v.u.f, buf, sizeof buf); sb_puts(r, b, buf); }
        return;
    case TV_STR: json_str_out(r, b, v.u.s.p, v.u.s.n, o->ascii); return;
    case TV_LIST:
        if (is_gen(v)) break;
        if (!v.u.l->n) { sb_puts(r, b, "[]"); return; }
        sb_puts(r, b, "[");
        for (size_t i = 0; i < v.u.l->n; i++) {
            if (i) sb_puts(r, b, o->item_sep);
            if (o->indent) json_nl(r, b, o, level + 1);
            to_json(r, line, b, v.u.l->v[i], o, level + 1);
        }
        if (o->indent) json_nl(r, b, o, level);
        sb_puts(r, b, "]");
        return;
    case TV_DICT: {
        struct tdict *d = v.u.d;
        if (!d->n) { sb_puts(r, b, "{}"); return; }
        size_t *ord = tmpl_alloc(r->a, d->n * sizeof *ord);
        for (size_t i = 0; i < d->n; i++) ord[i] = i;
        if (o->sort) {
            /* insertion sort by key (keys are strings in practice) */
            for (size_t i = 1; i < d->n; i++)
                for (size_t j = i; j > 0 && v_cmp(r, line, d->k[ord[j - 1]], d->k[ord[j]]) > 0; j--) {
                    size_t t = ord[j]; ord[j] = ord[j - 1]; ord[j - 1] = t;
                }
        }
        sb_puts(r, b, "{");
        for (size_t i = 0; i < d->n; i++) {
            tval k = d->k[ord[i]];
            if (i) sb_puts(r, b, o->item_sep);
            if (o->indent) json_nl(r, b, o, level + 1);
            if (k.t == TV_STR) json_str_out(r, b, k.u.s.p, k.u.s.n, o->ascii);
            else if (k.t == TV_INT || k.t == TV_FLOAT) {
                struct sb kb = {0};
                v_print(r, line, &kb, k, false);
                json_str_out(r, b, kb.p, kb.n, o->ascii);
            } else if (k.t == TV_BOOL) sb_puts(r, b, k.u.b ? "\"true\"" : "\"false\"");
            else if (k.t == TV_NONE) sb_puts(r, b, "\"null\"");
            else FAIL(r, line, "tojson: keys must be str, int, float, bool or None, not %s", type_name(k));
            sb_puts(r, b, o->key_sep);
            to_json(r, line, b, d->v[ord[i]], o, level + 1);
        }
        if (o->indent) json_nl(r, b, o, level);
        sb_puts(r, b, "}");
        return;
    }
    default: break;
    }
    FAIL(r, line, "Object of type %s is not JSON serializable", type_name(v));
}

/* ---- scopes ---------------------------------------------------------------------------------- */

static struct scope *scope_new(struct R *r, struct scope *parent)
{
    struct scope *s = tmpl_alloc(r->a, sizeof *s);
    s->parent = parent;
    return s;
}

static tval lookup(struct R *r, struct scope *s, const char *name, size_t n, int line)
{
    (void)line;
    for (; s; s = s->parent) {
        tval *v = dict_finds(&s->vars, name, n);
        if (v) return *v;
    }
    for (int k = 0; k < BI_COUNT; k++)
        if (strlen(bi_names[k]) == n && !memcmp(bi_names[k], name, n)) return (tval){.t = TV_BUILTIN, .u.fn = k};
    char *hint = tmpl_alloc(r->a, n + 32);
    snprintf(hint, n + 32, "'%.*s' is undefined", (int)n, name);
    return v_undef(hint);
}

static void assign(struct R *r, struct scope *s, const char *name, tval v) { dict_sets(r, &s->vars, name, v); }

/* ---- strings (UTF-8, measured in code points like Python) ------------------------------------- */

static size_t cp_len(const char *s, size_t n)
{
    size_t c = 0;
    for (size_t i = 0; i < n; i++) c += ((unsigned char)s[i] & 0xC0) != 0x80;
    return c;
}

/* Byte offset of code point k (k <= cp_len). */
static size_t cp_off(const char *s, size_t n, size_t k)
{
    size_t i = 0;
    while (i < n && k) {
        i++;
        while (i < n && ((unsigned char)s[i] & 0xC0) == 0x80) i++;
        k--;
    }
    return i;
}

static bool py_space(unsigned char c) { return c == ' ' || (c >= 9 && c <= 13) || (c >= 0x1c && c <= 0x1f); }

static bool in_chars(unsigned char c, tval chars)
{
    if (chars.t != TV_STR) return py_space(c);
    return memchr(chars.u.s.p, c, chars.u.s.n) != NULL;
}

static tval str_strip(tval s, tval chars, bool left, bool right)
{
    const char *p = s.u.s.p;
    size_t a = 0, b = s.u.s.n;
    if (left) while (a < b && in_chars((unsigned char)p[a], chars)) a++;
    if (right) while (b > a && in_chars((unsigned char)p[b - 1], chars)) b--;
    return v_str(p + a, b - a);
}

static tval str_case(struct R *r, tval s, int mode) /* 0 lower, 1 upper, 2 capitalize, 3 title */
{
    char *o = tmpl_strndup(r->a, s.u.s.p, s.u.s.n);
    bool start = true;
    for (size_t i = 0; i < s.u.s.n; i++) {
        unsigned char c = (unsigned char)o[i];
        if (mode == 0) o[i] = (char)tolower(c);
        else if (mode == 1) o[i] = (char)toupper(c);
        else if (mode == 2) o[i] = (char)(i == 0 ? toupper(c) : tolower(c));
        else {
            /* jinja2 title: words begin after whitespace, '-', '(', '{', '[', '<' */
            o[i] = (char)(start ? toupper(c) : tolower(c));
            start = c == ' ' || c == '\t' || c == '\n' || c == '\r' || c == '\f' || c == '\v' ||
                    c == '-' || c == '(' || c == '{' || c == '[' || c == '<';
        }
    }
    return v_str(o, s.u.s.n);
}

static tval str_replace(struct R *r, tval s, tval old, tval new, int64_t count)
{
    struct sb b = {0};
    const char *p = s.u.s.p, *end = p + s.u.s.n;
    if (old.u.s.n == 0) {
        /* Python inserts new between every code point (and at both ends) */
        int64_t done = 0;
        size_t i = 0;
        for (;;) {
            if (count < 0 || done < count) { sb_add(r, &b, new.u.s.p, new.u.s.n); done++; }
            if (i >= s.u.s.n) break;
            size_t j = i + 1;
            while (j < s.u.s.n && ((unsigned char)p[j] & 0xC0) == 0x80) j++;
            sb_add(r, &b, p + i, j - i);
            i = j;
        }
        return v_sb(&b);
    }
    int64_t done = 0;
    while (p < end) {
        const char *h = (count >= 0 && done >= count) ? NULL : memmem(p, (size_t)(end - p), old.u.s.p, old.u.s.n);
        if (!h) break;
        sb_add(r, &b, p, (size_t)(h - p));
        sb_add(r, &b, new.u.s.p, new.u.s.n);
        p = h + old.u.s.n;
        done++;
    }
    sb_add(r, &b, p, (size_t)(end - p));
    if (!b.p) return v_str("", 0);
    return v_sb(&b);
}

static tval str_split(struct R *r, tval s, tval sep, int64_t maxsplit)
{
    tval l = v_list(r, 0);
    const char *p = s.u.s.p, *end = p + s.u.s.n;
    if (sep.t != TV_STR) {
        int64_t done = 0;
        while (p < end) {
            while (p < end && py_space((unsigned char)*p)) p++;
            if (p >= end) break;
            if (maxsplit >= 0 && done >= maxsplit) {
                const char *e = end;
                while (e > p && py_space((unsigned char)e[-1])) e--;
                list_push(r, l.u.l, v_str(p, (size_t)(e - p)));
                break;
            }
            const char *q = p;
            while (q < end && !py_space((unsigned char)*q)) q++;
            list_push(r, l.u.l, v_str(p, (size_t)(q - p)));
            done++;
            p = q;
        }
        return l;
    }
    int64_t done = 0;
    for (;;) {
        const char *h = (maxsplit >= 0 && done >= maxsplit) ? NULL : memmem(p, (size_t)(end - p), sep.u.s.p, sep.u.s.n);
        if (!h) break;
        list_push(r, l.u.l, v_str(p, (size_t)(h - p)));
        p = h + sep.u.s.n;
        done++;
    }
    list_push(r, l.u.l, v_str(p, (size_t)(end - p)));
    return l;
}

static tval str_rsplit(struct R *r, tval s, tval sep, int64_t maxsplit)
{
    if (maxsplit < 0 || sep.t != TV_STR) return str_split(r, s, sep, maxsplit);
    tval l = v_list(r, 0);
    const char *st = s.u.s.p, *end = st + s.u.s.n;
    tval parts[64];
    int np = 0;
    while (np < maxsplit && np < 63) {
        const char *h = NULL;
        for (const char *q = end - sep.u.s.n; q >= st; q--)
            if (!memcmp(q, sep.u.s.p, sep.u.s.n)) { h = q; break; }
        if (!h) break;
        parts[np++] = v_str(h + sep.u.s.n, (size_t)(end - h - sep.u.s.n));
        end = h;
    }
    list_push(r, l.u.l, v_str(st, (size_t)(end - st)));
    while (np) list_push(r, l.u.l, parts[--np]);
    return l;
}

static bool str_affix(tval s, tval x, bool prefix)
{
    if (x.t != TV_STR || x.u.s.n > s.u.s.n) return false;
    const char *p = prefix ? s.u.s.p : s.u.s.p + s.u.s.n - x.u.s.n;
    return !memcmp(p, x.u.s.p, x.u.s.n);
}

/* ---- iteration ------------------------------------------------------------------------------ */

/* The items a for loop or a filter iterates over (a new or borrowed list). */
static struct tlist *iter_list(struct R *r, int line, tval v)
{
    switch (v.t) {
    case TV_LIST: return v.u.l;
    case TV_UNDEF: return v_list(r, 0).u.l;
    case TV_DICT: {
        tval l = v_list(r, v.u.d->n);
        for (size_t i = 0; i < v.u.d->n; i++) list_push(r, l.u.l, v.u.d->k[i]);
        return l.u.l;
    }
    case TV_STR: {
        tval l = v_list(r, 0);
        const char *p = v.u.s.p;
        for (size_t i = 0; i < v.u.s.n;) {
            size_t j = i + 1;
            while (j < v.u.s.n && ((unsigned char)p[j] & 0xC0) == 0x80) j++;
            list_push(r, l.u.l, v_str(p + i, j - i));
            i = j;
        }
        return l.u.l;
    }
    default: FAIL(r, line, "'%s' object is not iterable", type_name(v));
    }
}

static int64_t v_len(struct R *r, int line, tval v)
{
    switch (v.t) {
    case TV_UNDEF: return 0;
    case TV_STR: return (int64_t)cp_len(v.u.s.p, v.u.s.n);
    case TV_LIST: if (!is_gen(v)) return (int64_t)v.u.l->n; break;
    case TV_DICT: return (int64_t)v.u.d->n;
    default: break;
    }
    FAIL(r, line, "object of type '%s' has no len()", type_name(v));
}

static bool v_contains(struct R *r, int line, tval hay, tval needle)
{
    switch (hay.t) {
    case TV_STR:
        if (needle.t != TV_STR) FAIL(r, line, "'in <string>' requires string as left operand, not %s", type_name(needle));
        return needle.u.s.n == 0 || memmem(hay.u.s.p, hay.u.s.n, needle.u.s.p, needle.u.s.n);
    case TV_LIST:
        for (size_t i = 0; i < hay.u.l->n; i++)
            if (v_eq(hay.u.l->v[i], needle)) return true;
        return false;
    case TV_DICT: return dict_find(hay.u.d, needle) != NULL;
    case TV_UNDEF: return false;
    default: FAIL(r, line, "argument of type '%s' is not iterable", type_name(hay));
    }
}

/* ---- attribute and item access --------------------------------------------------------------- */

static const char *const str_methods[] = {"strip", "lstrip", "rstrip", "split", "rsplit", "startswith", "endswith",
                                          "replace", "upper", "lower", "title", "capitalize", "find", "rfind",
                                          "count", "join", "format", "isdigit", "isalpha", "isalnum", "isspace",
                                          "islower", "isupper", "splitlines", "index", NULL};
static const char *const dict_methods[] = {"items", "keys", "values", "get", "copy", NULL};
static const char *const list_methods[] = {"index", "count", "copy", NULL};
static const char *const mutators[] = {"append", "extend", "insert", "pop", "remove", "clear", "update",
                                       "setdefault", "popitem", "sort", "reverse", NULL};

static int in_names(const char *const *names, const char *s, size_t n)
{
    for (int k = 0; names[k]; k++)
        if (strlen(names[k]) == n && !memcmp(names[k], s, n)) return 1;
    return 0;
}

static tval method(struct R *r, tval self, const char *name)
{
    tval m = {.t = TV_METHOD};
    m.u.meth = tmpl_alloc(r->a, sizeof *m.u.meth);
    m.u.meth->self = self;
    m.u.meth->name = name;
    return m;
}

static tval undef_attr(struct R *r, tval obj, const char *name, size_t n)
{
    char *hint = tmpl_alloc(r->a, n + 64);
    if (obj.t == TV_NONE) snprintf(hint, n + 64, "'None' has no attribute '%.*s'", (int)n, name);
    else snprintf(hint, n + 64, "'%s object' has no attribute '%.*s'", type_name(obj), (int)n, name);
    return v_undef(hint);
}

static void fail_undef(struct R *r, int line, tval u)
{
    if (u.u.s.n) FAIL(r, line, "%.*s", (int)u.u.s.n, u.u.s.p);
    FAIL(r, line, "undefined value");
}

static tval get_attr(struct R *r, int line, tval obj, const char *name, size_t n)
{
    switch (obj.t) {
    case TV_UNDEF: fail_undef(r, line, obj); break;
    case TV_NS: {
        tval *v = dict_finds(obj.u.d, name, n);
        return v ? *v : undef_attr(r, obj, name, n);
    }
    case TV_DICT: {
        if (in_names(dict_methods, name, n)) return method(r, obj, tmpl_strndup(r->a, name, n));
        if (in_names(mutators, name, n)) return method(r, obj, tmpl_strndup(r->a, name, n));
        tval *v = dict_finds(obj.u.d, name, n);
        return v ? *v : undef_attr(r, obj, name, n);
    }
    case TV_STR:
        if (in_names(str_methods, name, n)) return method(r, obj, tmpl_strndup(r->a, name, n));
        break;
    case TV_LIST:
        if (!is_gen(obj) && (in_names(list_methods, name, n) || in_names(mutators, name, n)))
            return method(r, obj, tmpl_strndup(r->a, name, n));
        break;
    default: break;
    }
    return undef_attr(r, obj, name, n);
}

static tval slice(struct R *r, int line, tval obj, tval *start, tval *stop, tval *step);

static tval get_item(struct R *r, int line, tval obj, tval key)
{
    switch (obj.t) {
    case TV_UNDEF: fail_undef(r, line, obj); break;
    case TV_DICT: {
        tval *v = dict_find(obj.u.d, key);
        if (v) return *v;
        break;
    }
    case TV_LIST:
        if (is_gen(obj)) break;
        if (key.t == TV_INT || key.t == TV_BOOL) {
            int64_t i = num_i(key), n = (int64_t)obj.u.l->n;
            if (i < 0) i += n;
            if (i >= 0 && i < n) return obj.u.l->v[i];
            return v_undef("list index out of range");
        }
        break;
    case TV_STR:
        if (key.t == TV_INT || key.t == TV_BOOL) {
            int64_t i = num_i(key), n = (int64_t)cp_len(obj.u.s.p, obj.u.s.n);
            if (i < 0) i += n;
            if (i >= 0 && i < n) {
                size_t a = cp_off(obj.u.s.p, obj.u.s.n, (size_t)i), b = cp_off(obj.u.s.p, obj.u.s.n, (size_t)i + 1);
                return v_str(obj.u.s.p + a, b - a);
            }
            return v_undef("string index out of range");
        }
        break;
    default: break;
    }
    if (key.t == TV_STR) return get_attr(r, line, obj, key.u.s.p, key.u.s.n);
    if (obj.t == TV_NONE) return v_undef("None has no element");
    return v_undef("no such element");
}

static tval slice(struct R *r, int line, tval obj, tval *start, tval *stop, tval *step)
{
    if (obj.t == TV_UNDEF) fail_undef(r, line, obj);
    if (!(obj.t == TV_STR || (obj.t == TV_LIST && !is_gen(obj)))) return v_undef("object is not subscriptable");
    int64_t n = obj.t == TV_STR ? (int64_t)cp_len(obj.u.s.p, obj.u.s.n) : (int64_t)obj.u.l->n;
    int64_t st = 1;
    if (step && step->t != TV_NONE) {
        if (step->t != TV_INT) FAIL(r, line, "slice indices must be integers or None");
        st = step->u.i;
        if (st == 0) FAIL(r, line, "slice step cannot be zero");
    }
    int64_t a, b;
    int64_t lo = st < 0 ? -1 : 0, hi = st < 0 ? n - 1 : n;
    if (!start || start->t == TV_NONE) a = st < 0 ? hi : lo;
    else {
        if (!(start->t == TV_INT || start->t == TV_BOOL)) FAIL(r, line, "slice indices must be integers or None");
        a = num_i(*start);
        if (a < 0) { a += n; if (a < lo) a = lo; }
        else if (a > hi) a = hi;
    }
    if (!stop || stop->t == TV_NONE) b = st < 0 ? lo : hi;
    else {
        if (!(stop->t == TV_INT || stop->t == TV_BOOL)) FAIL(r, line, "slice indices must be integers or None");
        b = num_i(*stop);
        if (b < 0) { b += n; if (b < lo) b = lo; }
        else if (b > hi) b = hi;
    }
    if (obj.t == TV_STR) {
        if (st == 1) {
            if (b <= a) return v_str("", 0);
            size_t x = cp_off(obj.u.s.p, obj.u.s.n, (size_t)a), y = cp_off(obj.u.s.p, obj.u.s.n, (size_t)b);
            return v_str(obj.u.s.p + x, y - x);
        }
        struct tlist *chars = iter_list(r, line, obj);
        struct sb sbuf = {0};
        for (int64_t i = a; st > 0 ? i < b : i > b; i += st) sb_add(r, &sbuf, chars->v[i].u.s.p, chars->v[i].u.s.n);
        return sbuf.p ? v_sb(&sbuf) : v_str("", 0);
    }
    tval l = v_list(r, 0);
    for (int64_t i = a; st > 0 ? i < b : i > b; i += st) list_push(r, l.u.l, obj.u.l->v[i]);
    l.u.l->tuple = obj.u.l->tuple;
    return l;
}

/* ---- evaluation -------------------------------------------------------------------------------- */

struct args {
    tval *pos;
    int np;
    const char **kn;
    tval *kv;
    int nk;
};

static tval eval(struct R *r, struct scope *s, const struct tnode *n);
static int exec_body(struct R *r, struct scope *s, struct tnode *const *kids, int nk, struct sb *out);

static void eval_args(struct R *r, struct scope *s, const struct tnode *n, struct args *a, tval *first)
{
    int extra = first ? 1 : 0;
    a->np = n->nk + extra;
    a->pos = tmpl_alloc(r->a, (size_t)(a->np + 1) * sizeof *a->pos);
    if (first) a->pos[0] = *first;
    for (int k = 0; k < n->nk; k++) a->pos[k + extra] = eval(r, s, n->kids[k]);
    a->nk = n->nk2;
    a->kn = n->names;
    a->kv = tmpl_alloc(r->a, (size_t)(a->nk + 1) * sizeof *a->kv);
    for (int k = 0; k < n->nk2; k++) a->kv[k] = eval(r, s, n->kids2[k]);
}

/* Argument i (positional, after any implicit operand) or keyword name. */
static tval *arg(struct args *a, int i, const char *name)
{
    if (i >= 0 && i < a->np) return &a->pos[i];
    for (int k = 0; name && k < a->nk; k++)
        if (!strcmp(a->kn[k], name)) return &a->kv[k];
    return NULL;
}


static tval need_str(struct R *r, int line, tval *v, const char *what)
{
    if (!v || v->t != TV_STR) FAIL(r, line, "%s must be a string, not %s", what, v ? type_name(*v) : "nothing");
    return *v;
}

static int64_t need_int(struct R *r, int line, tval *v, const char *what)
{
    if (!v || !(v->t == TV_INT || v->t == TV_BOOL)) FAIL(r, line, "%s must be an integer, not %s", what, v ? type_name(*v) : "nothing");
    return num_i(*v);
}

static tval call_value(struct R *r, int line, tval fn, struct args *a);

/* Python's `fmt % args` for %s %d %i %r %f %%. */
static tval percent_format(struct R *r, int line, tval fmt, tval *vals, int nv)
{
    struct sb b = {0};
    int k = 0;
    const char *p = fmt.u.s.p, *end = p + fmt.u.s.n;
    while (p < end) {
        if (*p != '%') { sb_add(r, &b, p++, 1); continue; }
        p++;
        if (p >= end) FAIL(r, line, "incomplete format");
        char c = *p++;
        if (c == '%') { sb_puts(r, &b, "%"); continue; }
        if (k >= nv) FAIL(r, line, "not enough arguments for format string");
        tval v = vals[k++];
        if (c == 's') v_print(r, line, &b, v, false);
        else if (c == 'r') v_print(r, line, &b, v, true);
        else if (c == 'd' || c == 'i') {
            if (!is_num(v)) FAIL(r, line, "%%d format: a number is required, not %s", type_name(v));
            sb_printf(r, &b, "%lld", (long long)(v.t == TV_FLOAT ? (int64_t)v.u.f : num_i(v)));
        } else if (c == 'f') {
            if (!is_num(v)) FAIL(r, line, "%%f format: a number is required, not %s", type_name(v));
            sb_printf(r, &b, "%f", num_f(v));
        } else FAIL(r, line, "unsupported format character '%c'", c);
    }
    if (k < nv) FAIL(r, line, "not all arguments converted during string formatting");
    return b.p ? v_sb(&b) : v_str("", 0);
}

/* str.format with {} / {0} / {name} fields. */
static tval brace_format(struct R *r, int line, tval fmt, struct args *a)
{
    struct sb b = {0};
    int auto_i = 0;
    const char *p = fmt.u.s.p, *end = p + fmt.u.s.n;
    while (p < end) {
        if (*p == '{' && p + 1 < end && p[1] == '{') { sb_puts(r, &b, "{"); p += 2; continue; }
        if (*p == '}' && p + 1 < end && p[1] == '}') { sb_puts(r, &b, "}"); p += 2; continue; }
        if (*p != '{') { sb_add(r, &b, p++, 1); continue; }
        const char *q = memchr(p, '}', (size_t)(end - p));
        if (!q) FAIL(r, line, "str.format: single '{' encountered");
        size_t fl = (size_t)(q - p - 1);
        const char *f = p + 1;
        tval *v;
        if (!fl) v = arg(a, auto_i++, NULL);
        else if (isdigit((unsigned char)f[0])) v = arg(a, atoi(f), NULL);
        else {
            char name[64];
            snprintf(name, sizeof name, "%.*s", (int)(fl < 63 ? fl : 63), f);
            if (memchr(name, ':', strlen(name)) || memchr(name, '!', strlen(name)) || memchr(name, '.', strlen(name)))
                FAIL(r, line, "str.format: unsupported field '{%s}'", name);
            v = arg(a, -1, name);
        }
        if (!v) FAIL(r, line, "str.format: missing argument for field %d", auto_i);
        v_print(r, line, &b, *v, false);
        p = q + 1;
    }
    return b.p ? v_sb(&b) : v_str("", 0);
}

static tval call_method(struct R *r, int line, struct tmethod *m, struct args *a)
{
    tval self = m->self;
    const char *nm = m->name;
    if (self.t == TV_DICT && !strcmp(nm, "cycle")) {
        /* loop.cycle(a, b, ...) */
        tval *i0 = dict_finds(self.u.d, "index0", 6);
        if (!a->np) FAIL(r, line, "no items for cycling given");
        return a->pos[(i0 ? i0->u.i : 0) % a->np];
    }
    if (in_names(mutators, nm, strlen(nm)) && !(self.t == TV_STR))
        FAIL(r, line, "unsupported construct: '%s.%s()' modifies a value (not allowed in the sandbox)", type_name(self), nm);
    if (self.t == TV_STR) {
        if (!strcmp(nm, "strip") || !strcmp(nm, "lstrip") || !strcmp(nm, "rstrip")) {
            tval *c = arg(a, 0, "chars");
            tval chars = c && c->t != TV_NONE ? need_str(r, line, c, "strip chars") : v_none();
            return str_strip(self, chars, nm[0] != 'r', nm[0] != 'l');
        }
        if (!strcmp(nm, "split") || !strcmp(nm, "rsplit")) {
            tval *sep = arg(a, 0, "sep"), *mx = arg(a, 1, "maxsplit");
            tval sp = sep && sep->t != TV_NONE ? need_str(r, line, sep, "split separator") : v_none();
            if (sp.t == TV_STR && sp.u.s.n == 0) FAIL(r, line, "empty separator");
            int64_t maxs = mx ? need_int(r, line, mx, "maxsplit") : -1;
            return nm[0] == 'r' ? str_rsplit(r, self, sp, maxs) : str_split(r, self, sp, maxs);
        }
        if (!strcmp(nm, "startswith") || !strcmp(nm, "endswith")) {
            tval *x = arg(a, 0, NULL);
            if (!x) FAIL(r, line, "%s() takes at least 1 argument", nm);
            bool pre = nm[0] == 's';
            if (x->t == TV_LIST && x->u.l->tuple) {
                for (size_t i = 0; i < x->u.l->n; i++)
                    if (str_affix(self, need_str(r, line, &x->u.l->v[i], nm), pre)) return v_bool(true);
                return v_bool(false);
            }
            return v_bool(str_affix(self, need_str(r, line, x, nm), pre));
        }
        if (!strcmp(nm, "replace")) {
            tval o = need_str(r, line, arg(a, 0, NULL), "replace() argument 1");
            tval nw = need_str(r, line, arg(a, 1, NULL), "replace() argument 2");
            tval *c = arg(a, 2, "count");
            return str_replace(r, self, o, nw, c ? need_int(r, line, c, "count") : -1);
        }
        if (!strcmp(nm, "upper")) return str_case(r, self, 1);
        if (!strcmp(nm, "lower")) return str_case(r, self, 0);
        if (!strcmp(nm, "capitalize")) return str_case(r, self, 2);
        if (!strcmp(nm, "title")) {
            /* str.title: a letter after a non-letter starts a word */
            char *o = tmpl_strndup(r->a, self.u.s.p, self.u.s.n);
            bool prev_alpha = false;
            for (size_t i = 0; i < self.u.s.n; i++) {
                unsigned char c = (unsigned char)o[i];
                o[i] = (char)(prev_alpha ? tolower(c) : toupper(c));
                prev_alpha = isalpha(c) || c >= 0x80;
            }
            return v_str(o, self.u.s.n);
        }
        if (!strcmp(nm, "find") || !strcmp(nm, "rfind") || !strcmp(nm, "index") || !strcmp(nm, "count")) {
            tval x = need_str(r, line, arg(a, 0, NULL), nm);
            if (!strcmp(nm, "count")) {
                if (!x.u.s.n) return v_int((int64_t)cp_len(self.u.s.p, self.u.s.n) + 1);
                int64_t c = 0;
                const char *p = self.u.s.p, *end = p + self.u.s.n, *h;
                while ((h = memmem(p, (size_t)(end - p), x.u.s.p, x.u.s.n))) { c++; p = h + x.u.s.n; }
                return v_int(c);
            }
            const char *h = NULL;
            if (nm[0] == 'r') {
                for (const char *q = self.u.s.p + self.u.s.n - x.u.s.n; q >= self.u.s.p; q--)
                    if (!memcmp(q, x.u.s.p, x.u.s.n)) { h = q; break; }
            } else {
                h = memmem(self.u.s.p, self.u.s.n, x.u.s.p, x.u.s.n);
            }
            if (!h && nm[0] == 'i') FAIL(r, line, "substring not found");
            return v_int(h ? (int64_t)cp_len(self.u.s.p, (size_t)(h - self.u.s.p)) : -1);
        }
        if (!strcmp(nm, "join")) {
            tval *x = arg(a, 0, NULL);
            if (!x) FAIL(r, line, "join() takes exactly one argument");
            struct tlist *l = iter_list(r, line, *x);
            struct sb b = {0};
            for (size_t i = 0; i < l->n; i++) {
                if (l->v[i].t != TV_STR) FAIL(r, line, "sequence item %zu: expected str instance, %s found", i, type_name(l->v[i]));
                if (i) sb_add(r, &b, self.u.s.p, self.u.s.n);
                sb_add(r, &b, l->v[i].u.s.p, l->v[i].u.s.n);
            }
            return b.p ? v_sb(&b) : v_str("", 0);
        }
        if (!strcmp(nm, "format")) return brace_format(r, line, self, a);
        if (!strcmp(nm, "splitlines")) {
            tval l = v_list(r, 0);
            const char *p = self.u.s.p, *end = p + self.u.s.n;
            while (p < end) {
                const char *q = p;
                while (q < end && *q != '\n' && *q != '\r') q++;
                list_push(r, l.u.l, v_str(p, (size_t)(q - p)));
                if (q < end && *q == '\r' && q + 1 < end && q[1] == '\n') q++;
                p = q + 1;
            }
            return l;
        }
        if (!strncmp(nm, "is", 2)) {
            if (!self.u.s.n) return v_bool(false);
            bool any_cased = false;
            for (size_t i = 0; i < self.u.s.n; i++) {
                unsigned char c = (unsigned char)self.u.s.p[i];
                if (!strcmp(nm, "isdigit") && !isdigit(c)) return v_bool(false);
                if (!strcmp(nm, "isalpha") && !isalpha(c)) return v_bool(false);
                if (!strcmp(nm, "isalnum") && !isalnum(c)) return v_bool(false);
                if (!strcmp(nm, "isspace") && !py_space(c)) return v_bool(false);
                if (!strcmp(nm, "islower") && isupper(c)) return v_bool(false);
                if (!strcmp(nm, "isupper") && islower(c)) return v_bool(false);
                any_cased |= isalpha(c) != 0;
            }
            if (!strcmp(nm, "islower") || !strcmp(nm, "isupper")) return v_bool(any_cased);
            return v_bool(true);
        }
    }
    if (self.t == TV_DICT) {
        struct tdict *d = self.u.d;
        if (!strcmp(nm, "get")) {
            tval *k = arg(a, 0, NULL), *def = arg(a, 1, NULL);
            if (!k) FAIL(r, line, "get expected at least 1 argument");
            tval *v = dict_find(d, *k);
            return v ? *v : def ? *def : v_none();
        }
        if (!strcmp(nm, "copy")) {
            tval o = v_dict(r, TV_DICT);
            for (size_t i = 0; i < d->n; i++) dict_set(r, o.u.d, d->k[i], d->v[i]);
            return o;
        }
        tval l = v_list(r, d->n);
        for (size_t i = 0; i < d->n; i++)
            list_push(r, l.u.l, !strcmp(nm, "keys") ? d->k[i] : !strcmp(nm, "values") ? d->v[i] : v_tuple2(r, d->k[i], d->v[i]));
        return l;
    }
    if (self.t == TV_LIST) {
        struct tlist *l = self.u.l;
        if (!strcmp(nm, "copy")) return slice(r, line, self, NULL, NULL, NULL);
        tval *x = arg(a, 0, NULL);
        if (!x) FAIL(r, line, "%s() takes exactly one argument", nm);
        int64_t c = 0;
        for (size_t i = 0; i < l->n; i++)
            if (v_eq(l->v[i], *x)) {
                if (!strcmp(nm, "index")) return v_int((int64_t)i);
                c++;
            }
        if (!strcmp(nm, "index")) FAIL(r, line, "value is not in list");
        return v_int(c);
    }
    FAIL(r, line, "unsupported method '%s' on %s", nm, type_name(self));
}

static tval call_macro(struct R *r, int line, struct tmacro *m, struct args *a)
{
    const struct tnode *def = m->def;
    if (++r->depth > MAX_CALL_DEPTH) FAIL(r, line, "macro recursion too deep");
    if (a->np > def->nn)
        FAIL(r, line, "macro '%s' takes not more than %d argument(s)", m->name ? m->name : "caller", def->nn);
    struct scope *s = scope_new(r, m->closure);
    for (int k = 0; k < a->nk; k++) {
        bool found = false;
        for (int j = 0; j < def->nn; j++) found |= !strcmp(def->names[j], a->kn[k]);
        if (!found && strcmp(a->kn[k], "caller"))
            FAIL(r, line, "macro '%s' has no argument named '%s'", m->name ? m->name : "caller", a->kn[k]);
    }
    for (int j = 0; j < def->nn; j++) {
        tval *v = j < a->np ? &a->pos[j] : arg(a, -1, def->names[j]);
        tval val;
        if (v) val = *v;
        else if (def->kids2 && def->kids2[j]) val = eval(r, s, def->kids2[j]);
        else {
            char *hint = tmpl_alloc(r->a, strlen(def->names[j]) + 64);
            sprintf(hint, "parameter '%s' was not provided", def->names[j]);
            val = v_undef(hint);
        }
        assign(r, s, def->names[j], val);
    }
    if (m->caller.t != TV_UNDEF) assign(r, s, "caller", m->caller);
    struct sb out = {0};
    exec_body(r, s, def->kids, def->nk, &out);
    r->depth--;
    return out.p ? v_sb(&out) : v_str("", 0);
}

static tval call_builtin(struct R *r, int line, int fn, struct args *a)
{
    switch (fn) {
    case BI_RANGE: {
        if (a->np < 1 || a->np > 3) FAIL(r, line, "range expected 1 to 3 arguments, got %d", a->np);
        int64_t st = 0, en, stp = 1;
        if (a->np == 1) en = need_int(r, line, &a->pos[0], "range() argument");
        else {
            st = need_int(r, line, &a->pos[0], "range() argument");
            en = need_int(r, line, &a->pos[1], "range() argument");
            if (a->np == 3) stp = need_int(r, line, &a->pos[2], "range() argument");
        }
        if (stp == 0) FAIL(r, line, "range() arg 3 must not be zero");
        double cnt = stp > 0 ? ((double)en - st) / stp : ((double)st - en) / -stp;
        if (cnt > MAX_RANGE) FAIL(r, line, "range too big, maximum size for range is %d", MAX_RANGE);
        tval l = v_list(r, 0);
        for (int64_t i = st; stp > 0 ? i < en : i > en; i += stp) list_push(r, l.u.l, v_int(i));
        return l;
    }
    case BI_NAMESPACE:
    case BI_DICT: {
        tval d = v_dict(r, fn == BI_NAMESPACE ? TV_NS : TV_DICT);
        for (int k = 0; k < a->np; k++) {
            if (a->pos[k].t != TV_DICT) FAIL(r, line, "%s() takes keyword arguments or a dict", bi_names[fn]);
            for (size_t i = 0; i < a->pos[k].u.d->n; i++) dict_set(r, d.u.d, a->pos[k].u.d->k[i], a->pos[k].u.d->v[i]);
        }
        for (int k = 0; k < a->nk; k++) dict_sets(r, d.u.d, a->kn[k], a->kv[k]);
        return d;
    }
    case BI_RAISE: {
        tval *m = arg(a, 0, NULL);
        struct sb b = {0};
        if (m) v_print(r, line, &b, *m, false);
        FAIL(r, 0, "%s", b.p ? b.p : "raise_exception() called");
    }
    case BI_STRFTIME: {
        tval f = need_str(r, line, arg(a, 0, NULL), "strftime_now() format");
        struct tm tm;
        time_t t = (time_t)r->now;
        if (r->now) gmtime_r(&t, &tm);
        else {
            t = time(NULL);
            localtime_r(&t, &tm);
        }
        char fmt[256], out[512];
        snprintf(fmt, sizeof fmt, "%.*s", (int)(f.u.s.n < 255 ? f.u.s.n : 255), f.u.s.p);
        size_t n = strftime(out, sizeof out, fmt, &tm);
        return v_str(tmpl_strndup(r->a, out, n), n);
    }
    }
    FAIL(r, line, "bad builtin");
}

static tval call_value(struct R *r, int line, tval fn, struct args *a)
{
    switch (fn.t) {
    case TV_BUILTIN: return call_builtin(r, line, fn.u.fn, a);
    case TV_MACRO: return call_macro(r, line, fn.u.m, a);
    case TV_METHOD: return call_method(r, line, fn.u.meth, a);
    case TV_UNDEF: fail_undef(r, line, fn); break;
    default: break;
    }
    FAIL(r, line, "'%s' object is not callable", type_name(fn));
}

/* Attribute path "a.b.0" as jinja2's make_attrgetter walks it (getitem). */
static tval attr_path(struct R *r, int line, tval obj, tval path)
{
    if (path.t == TV_INT) return get_item(r, line, obj, path);
    if (path.t != TV_STR) FAIL(r, line, "attribute must be a string");
    const char *p = path.u.s.p, *end = p + path.u.s.n;
    while (p <= end) {
        const char *q = memchr(p, '.', (size_t)(end - p));
        if (!q) q = end;
        tval key = v_str(p, (size_t)(q - p));
        bool digits = q > p;
        for (const char *c = p; c < q; c++) digits &= isdigit((unsigned char)*c) != 0;
        if (digits) key = v_int(strtoll(p, NULL, 10));
        obj = get_item(r, line, obj, key);
        p = q + 1;
    }
    return obj;
}

static bool apply_test(struct R *r, int line, const char *name, tval v, struct args *a);
static tval html_escape(struct R *r, int line, tval v);
static tval apply_filter(struct R *r, int line, const char *name, tval v, struct args *a);

static const char *const filter_names[] = {
    "tojson", "trim", "length", "count", "string", "items", "selectattr", "rejectattr", "select", "reject",
    "map", "join", "upper", "lower", "title", "capitalize", "first", "last", "default", "d", "replace",
    "list", "unique", "safe", "int", "float", "round", "abs", "reverse", "sort", "dictsort", "indent",
    "sum", "min", "max", "format", "e", "escape", "attr", "wordcount", "center", "bool", NULL};
static const char *const test_names[] = {
    "defined", "undefined", "none", "string", "mapping", "sequence", "iterable", "number", "integer",
    "float", "boolean", "true", "false", "callable", "equalto", "eq", "ne", "lt", "gt", "le", "ge",
    "lessthan", "greaterthan", "in", "odd", "even", "divisibleby", "sameas", "lower", "upper", "escaped",
    "filter", "test", NULL};

bool tmpl_filter_known(const char *name) { return in_names(filter_names, name, strlen(name)); }
bool tmpl_test_known(const char *name) { return in_names(test_names, name, strlen(name)); }

/* Runs a filter/test given by name with arguments starting at a->pos[from]. */
static struct args sub_args(struct args *a, int from)
{
    struct args s = *a;
    s.pos = a->pos + from;
    s.np = a->np - from > 0 ? a->np - from : 0;
    return s;
}

static tval gen_result(tval l)
{
    mark_gen(&l);
    return l;
}

/* select/reject/selectattr/rejectattr */
static tval filter_select(struct R *r, int line, tval v, struct args *a, bool attr, bool keep)
{
    if (!truthy(v)) return gen_result(v_list(r, 0)); /* jinja2: `if value:` before iterating */
    struct tlist *l = iter_list(r, line, v);
    tval out = v_list(r, 0);
    int from = attr ? 1 : 0;
    tval *an = attr ? arg(a, 0, NULL) : NULL;
    if (attr && !an) FAIL(r, line, "selectattr/rejectattr need an attribute name");
    tval *tn = arg(a, from, NULL);
    if (tn && tn->t != TV_STR) FAIL(r, line, "test name must be a string");
    char tname[64] = "";
    if (tn) snprintf(tname, sizeof tname, "%.*s", (int)(tn->u.s.n < 63 ? tn->u.s.n : 63), tn->u.s.p);
    if (tn && !tmpl_test_known(tname)) FAIL(r, line, "unsupported test '%s'", tname);
    struct args ta = sub_args(a, from + 1);
    ta.nk = 0;
    for (size_t i = 0; i < l->n; i++) {
        tval x = attr ? attr_path(r, line, l->v[i], *an) : l->v[i];
        bool t = tn ? apply_test(r, line, tname, x, &ta) : truthy(x);
        if (t == keep) list_push(r, out.u.l, l->v[i]);
    }
    return gen_result(out);
}

static int case_cmp(struct R *r, int line, tval a, tval b, bool cs)
{
    if (!cs && a.t == TV_STR && b.t == TV_STR) {
        a = str_case(r, a, 0);
        b = str_case(r, b, 0);
    }
    return v_cmp(r, line, a, b);
}

static void stable_sort(struct R *r, int line, tval *keys, tval *vals, size_t n, bool cs, bool rev)
{
    /* insertion sort: stable, lists in templates are short */
    for (size_t i = 1; i < n; i++)
        for (size_t j = i; j > 0; j--) {
            int c = case_cmp(r, line, keys[j - 1], keys[j], cs);
            if (rev ? c >= 0 : c <= 0) break;
            tval t = keys[j]; keys[j] = keys[j - 1]; keys[j - 1] = t;
            t = vals[j]; vals[j] = vals[j - 1]; vals[j - 1] = t;
        }
}

static tval apply_filter(struct R *r, int line, const char *nm, tval v, struct args *a)
{
    if (!strcmp(nm, "safe")) {
        if (v.t != TV_STR) v = to_str(r, line, v);
        v.safe = 1;
        return v;
    }
    if (!strcmp(nm, "string")) return to_str(r, line, v);
    if (!strcmp(nm, "tojson")) {
        tval *ea = arg(a, 0, "ensure_ascii"), *ind = arg(a, 1, "indent"), *sep = arg(a, 2, "separators"),
             *sk = arg(a, 3, "sort_keys");
        struct jopt o = {.ascii = ea && truthy(*ea), .sort = sk && truthy(*sk)};
        if (ind && ind->t != TV_NONE) {
            if (ind->t == TV_STR) o.indent = tmpl_strndup(r->a, ind->u.s.p, ind->u.s.n);
            else {
                int64_t w = need_int(r, line, ind, "tojson indent");
                if (w < 0) w = 0;
                if (w > 64) w = 64;
                char *s = tmpl_alloc(r->a, (size_t)w + 1);
                memset(s, ' ', (size_t)w);
                o.indent = s;
            }
        }
        o.item_sep = o.indent ? "," : ", ";
        o.key_sep = ": ";
        if (sep && sep->t != TV_NONE) {
            if (sep->t != TV_LIST || sep->u.l->n != 2) FAIL(r, line, "tojson separators must be a pair of strings");
            o.item_sep = tmpl_strndup(r->a, need_str(r, line, &sep->u.l->v[0], "separator").u.s.p, sep->u.l->v[0].u.s.n);
            o.key_sep = tmpl_strndup(r->a, need_str(r, line, &sep->u.l->v[1], "separator").u.s.p, sep->u.l->v[1].u.s.n);
        }
        struct sb b = {0};
        to_json(r, line, &b, v, &o, 0);
        return v_sb(&b);
    }
    if (!strcmp(nm, "length") || !strcmp(nm, "count")) return v_int(v_len(r, line, v));
    if (!strcmp(nm, "default") || !strcmp(nm, "d")) {
        tval *def = arg(a, 0, "default_value"), *b = arg(a, 1, "boolean");
        bool use = v.t == TV_UNDEF || (b && truthy(*b) && !truthy(v));
        return use ? (def ? *def : v_str("", 0)) : v;
    }
    if (!strcmp(nm, "trim")) {
        tval s = to_str(r, line, v);
        tval *c = arg(a, 0, "chars");
        return str_strip(s, c && c->t == TV_STR ? *c : v_none(), true, true);
    }
    if (!strcmp(nm, "upper")) return str_case(r, to_str(r, line, v), 1);
    if (!strcmp(nm, "lower")) return str_case(r, to_str(r, line, v), 0);
    if (!strcmp(nm, "capitalize")) return str_case(r, to_str(r, line, v), 2);
    if (!strcmp(nm, "title")) return str_case(r, to_str(r, line, v), 3);
    if (!strcmp(nm, "replace")) {
        tval s = to_str(r, line, v);
        tval o = to_str(r, line, *(arg(a, 0, "old") ? arg(a, 0, "old") : &(tval){.t = TV_UNDEF}));
        tval n2 = to_str(r, line, *(arg(a, 1, "new") ? arg(a, 1, "new") : &(tval){.t = TV_UNDEF}));
        tval *c = arg(a, 2, "count");
        return str_replace(r, s, o, n2, c && c->t != TV_NONE ? need_int(r, line, c, "count") : -1);
    }
    if (!strcmp(nm, "items")) {
        if (v.t == TV_UNDEF) return gen_result(v_list(r, 0));
        if (v.t != TV_DICT) FAIL(r, line, "can only get item pairs from a mapping");
        tval l = v_list(r, v.u.d->n);
        for (size_t i = 0; i < v.u.d->n; i++) list_push(r, l.u.l, v_tuple2(r, v.u.d->k[i], v.u.d->v[i]));
        return gen_result(l);
    }
    if (!strcmp(nm, "dictsort")) {
        if (v.t != TV_DICT) FAIL(r, line, "dictsort: a mapping is required");
        tval *cs = arg(a, 0, "case_sensitive"), *by = arg(a, 1, "by"), *rev = arg(a, 2, "reverse");
        bool byval = by && by->t == TV_STR && key_eq(*by, "value", 5);
        size_t n = v.u.d->n;
        tval *keys = tmpl_alloc(r->a, (n + 1) * sizeof *keys), *vals = tmpl_alloc(r->a, (n + 1) * sizeof *vals);
        for (size_t i = 0; i < n; i++) {
            keys[i] = byval ? v.u.d->v[i] : v.u.d->k[i];
            vals[i] = v_tuple2(r, v.u.d->k[i], v.u.d->v[i]);
        }
        stable_sort(r, line, keys, vals, n, cs && truthy(*cs), rev && truthy(*rev));
        tval l = v_list(r, n);
        for (size_t i = 0; i < n; i++) list_push(r, l.u.l, vals[i]);
        return l;
    }
    if (!strcmp(nm, "selectattr")) return filter_select(r, line, v, a, true, true);
    if (!strcmp(nm, "rejectattr")) return filter_select(r, line, v, a, true, false);
    if (!strcmp(nm, "select")) return filter_select(r, line, v, a, false, true);
    if (!strcmp(nm, "reject")) return filter_select(r, line, v, a, false, false);
    if (!strcmp(nm, "map")) {
        if (!truthy(v)) return gen_result(v_list(r, 0));
        struct tlist *l = iter_list(r, line, v);
        tval out = v_list(r, l->n);
        tval *at = arg(a, -1, "attribute");
        if (at) {
            tval *def = arg(a, -1, "default");
            for (size_t i = 0; i < l->n; i++) {
                tval x = attr_path(r, line, l->v[i], *at);
                if (x.t == TV_UNDEF && def) x = *def;
                list_push(r, out.u.l, x);
            }
        } else {
            tval fname = need_str(r, line, arg(a, 0, NULL), "map filter name");
            char fn[64];
            snprintf(fn, sizeof fn, "%.*s", (int)(fname.u.s.n < 63 ? fname.u.s.n : 63), fname.u.s.p);
            if (!tmpl_filter_known(fn)) FAIL(r, line, "unsupported filter '%s'", fn);
            struct args fa = sub_args(a, 1);
            for (size_t i = 0; i < l->n; i++) list_push(r, out.u.l, apply_filter(r, line, fn, l->v[i], &fa));
        }
        return gen_result(out);
    }
    if (!strcmp(nm, "join")) {
        struct tlist *l = iter_list(r, line, v);
        tval *d = arg(a, 0, "d"), *at = arg(a, 1, "attribute");
        tval sep = d ? to_str(r, line, *d) : v_str("", 0);
        struct sb b = {0};
        for (size_t i = 0; i < l->n; i++) {
            if (i) sb_add(r, &b, sep.u.s.p, sep.u.s.n);
            tval x = at ? attr_path(r, line, l->v[i], *at) : l->v[i];
            v_print(r, line, &b, x, false);
        }
        return b.p ? v_sb(&b) : v_str("", 0);
    }
    if (!strcmp(nm, "first") || !strcmp(nm, "last")) {
        if (v.t == TV_LIST && is_gen(v) && nm[0] == 'l') FAIL(r, line, "'generator' object is not reversible");
        struct tlist *l = iter_list(r, line, v);
        if (!l->n) return v_undef("No first item, sequence was empty.");
        return nm[0] == 'f' ? l->v[0] : l->v[l->n - 1];
    }
    if (!strcmp(nm, "list")) {
        struct tlist *l = iter_list(r, line, v);
        tval out = v_list(r, l->n);
        for (size_t i = 0; i < l->n; i++) list_push(r, out.u.l, l->v[i]);
        return out;
    }
    if (!strcmp(nm, "unique")) {
        struct tlist *l = iter_list(r, line, v);
        tval *cs = arg(a, 0, "case_sensitive"), *at = arg(a, 1, "attribute");
        tval out = v_list(r, 0), seen = v_list(r, 0);
        for (size_t i = 0; i < l->n; i++) {
            tval k = at ? attr_path(r, line, l->v[i], *at) : l->v[i];
            if (k.t == TV_STR && !(cs && truthy(*cs))) k = str_case(r, k, 0);
            if (v_contains(r, line, seen, k)) continue;
            list_push(r, seen.u.l, k);
            list_push(r, out.u.l, l->v[i]);
        }
        return gen_result(out);
    }
    if (!strcmp(nm, "reverse")) {
        if (v.t == TV_STR) {
            tval neg = v_int(-1);
            return slice(r, line, v, NULL, NULL, &neg);
        }
        struct tlist *l = iter_list(r, line, v);
        tval out = v_list(r, l->n);
        for (size_t i = l->n; i > 0; i--) list_push(r, out.u.l, l->v[i - 1]);
        return gen_result(out);
    }
    if (!strcmp(nm, "sort")) {
        struct tlist *l = iter_list(r, line, v);
        tval *rev = arg(a, 0, "reverse"), *cs = arg(a, 1, "case_sensitive"), *at = arg(a, 2, "attribute");
        tval *keys = tmpl_alloc(r->a, (l->n + 1) * sizeof *keys), *vals = tmpl_alloc(r->a, (l->n + 1) * sizeof *vals);
        for (size_t i = 0; i < l->n; i++) {
            keys[i] = at ? attr_path(r, line, l->v[i], *at) : l->v[i];
            vals[i] = l->v[i];
        }
        stable_sort(r, line, keys, vals, l->n, cs && truthy(*cs), rev && truthy(*rev));
        tval out = v_list(r, l->n);
        for (size_t i = 0; i < l->n; i++) list_push(r, out.u.l, vals[i]);
        return out;
    }
    if (!strcmp(nm, "int") || !strcmp(nm, "float") || !strcmp(nm, "bool")) {
        bool isint = nm[0] == 'i';
        if (nm[0] == 'b') return v_bool(truthy(v));
        tval *def = arg(a, 0, "default");
        tval dv = def ? *def : isint ? v_int(0) : v_float(0);
        if (v.t == TV_INT || v.t == TV_BOOL) return isint ? v_int(num_i(v)) : v_float((double)num_i(v));
        if (v.t == TV_FLOAT) return isint ? v_int((int64_t)v.u.f) : v;
        if (v.t == TV_STR) {
            char buf[128];
            tval t = str_strip(v, v_none(), true, true);
            if (t.u.s.n == 0 || t.u.s.n >= sizeof buf) return dv;
            memcpy(buf, t.u.s.p, t.u.s.n);
            buf[t.u.s.n] = 0;
            char *end;
            if (isint) {
                long long x = strtoll(buf, &end, 10);
                if (!*end) return v_int(x);
            }
            double f = strtod(buf, &end);
            if (*end) return dv;
            return isint ? v_int((int64_t)f) : v_float(f);
        }
        return dv;
    }
    if (!strcmp(nm, "abs")) {
        if (v.t == TV_INT || v.t == TV_BOOL) return v_int(llabs((long long)num_i(v)));
        if (v.t == TV_FLOAT) return v_float(fabs(v.u.f));
        FAIL(r, line, "bad operand type for abs(): '%s'", type_name(v));
    }
    if (!strcmp(nm, "round")) {
        tval *pr = arg(a, 0, "precision"), *me = arg(a, 1, "method");
        int64_t p = pr ? need_int(r, line, pr, "round precision") : 0;
        if (!is_num(v)) FAIL(r, line, "round: a number is required, not %s", type_name(v));
        double x = num_f(v), m = pow(10, (double)p);
        const char *method = me && me->t == TV_STR ? me->u.s.p : "common";
        double y = !strncmp(method, "ceil", 4) ? ceil(x * m) / m : !strncmp(method, "floor", 5) ? floor(x * m) / m
                                                                                                 : nearbyint(x * m) / m;
        if (v.t != TV_FLOAT && !strncmp(method, "common", 6)) return v_int((int64_t)y);
        return v_float(y);
    }
    if (!strcmp(nm, "indent")) {
        tval s = to_str(r, line, v);
        tval *w = arg(a, 0, "width"), *fi = arg(a, 1, "first"), *bl = arg(a, 2, "blank");
        tval ind;
        if (w && w->t == TV_STR) ind = *w;
        else {
            int64_t n = w ? need_int(r, line, w, "indent width") : 4;
            if (n < 0) n = 0;
            if (n > 256) n = 256;
            char *sp = tmpl_alloc(r->a, (size_t)n + 1);
            memset(sp, ' ', (size_t)n);
            ind = v_str(sp, (size_t)n);
        }
        struct sb src = {0};
        sb_add(r, &src, s.u.s.p, s.u.s.n);
        sb_puts(r, &src, "\n");
        tval lines = call_method(r, line, method(r, v_sb(&src), "splitlines").u.meth, &(struct args){0});
        struct tlist *L = lines.u.l;
        struct sb b = {0};
        if (fi && truthy(*fi)) sb_add(r, &b, ind.u.s.p, ind.u.s.n);
        for (size_t i = 0; i < L->n; i++) {
            if (i) sb_puts(r, &b, "\n");
            if (i && (L->v[i].u.s.n || (bl && truthy(*bl)))) sb_add(r, &b, ind.u.s.p, ind.u.s.n);
            sb_add(r, &b, L->v[i].u.s.p, L->v[i].u.s.n);
        }
        return b.p ? v_sb(&b) : v_str("", 0);
    }
    if (!strcmp(nm, "sum")) {
        struct tlist *l = iter_list(r, line, v);
        tval *at = arg(a, 0, "attribute"), *st = arg(a, 1, "start");
        tval acc = st ? *st : v_int(0);
        for (size_t i = 0; i < l->n; i++) {
            tval x = at ? attr_path(r, line, l->v[i], *at) : l->v[i];
            if (!is_num(acc) || !is_num(x)) FAIL(r, line, "sum: unsupported operand types");
            acc = acc.t == TV_FLOAT || x.t == TV_FLOAT ? v_float(num_f(acc) + num_f(x)) : v_int(num_i(acc) + num_i(x));
        }
        return acc;
    }
    if (!strcmp(nm, "min") || !strcmp(nm, "max")) {
        struct tlist *l = iter_list(r, line, v);
        tval *cs = arg(a, 0, "case_sensitive"), *at = arg(a, 1, "attribute");
        if (!l->n) return v_undef("No aggregated item, sequence was empty.");
        size_t best = 0;
        for (size_t i = 1; i < l->n; i++) {
            tval x = at ? attr_path(r, line, l->v[i], *at) : l->v[i];
            tval y = at ? attr_path(r, line, l->v[best], *at) : l->v[best];
            int c = case_cmp(r, line, x, y, cs && truthy(*cs));
            if (nm[1] == 'i' ? c < 0 : c > 0) best = i;
        }
        return l->v[best];
    }
    if (!strcmp(nm, "format")) {
        tval s = to_str(r, line, v);
        if (a->nk) FAIL(r, line, "unsupported construct: format filter with keyword arguments");
        return percent_format(r, line, s, a->pos, a->np);
    }
    if (!strcmp(nm, "e") || !strcmp(nm, "escape")) return html_escape(r, line, v);
    if (!strcmp(nm, "attr")) {
        tval n = need_str(r, line, arg(a, 0, "name"), "attr name");
        return get_attr(r, line, v, n.u.s.p, n.u.s.n);
    }
    if (!strcmp(nm, "wordcount")) {
        tval s = to_str(r, line, v);
        int64_t c = 0;
        bool in = false;
        for (size_t i = 0; i < s.u.s.n; i++) {
            unsigned char ch = (unsigned char)s.u.s.p[i];
            bool w = isalnum(ch) || ch == '_' || ch >= 0x80;
            if (w && !in) c++;
            in = w;
        }
        return v_int(c);
    }
    if (!strcmp(nm, "center")) {
        tval s = to_str(r, line, v);
        tval *w = arg(a, 0, "width");
        int64_t width = w ? need_int(r, line, w, "center width") : 80, len = (int64_t)cp_len(s.u.s.p, s.u.s.n);
        if (width > 100000) width = 100000;
        if (width <= len) return s;
        int64_t pad = width - len, left = pad / 2 + (pad & width & 1);
        struct sb b = {0};
        for (int64_t i = 0; i < left; i++) sb_puts(r, &b, " ");
        sb_add(r, &b, s.u.s.p, s.u.s.n);
        for (int64_t i = 0; i < pad - left; i++) sb_puts(r, &b, " ");
        return v_sb(&b);
    }
    FAIL(r, line, "unsupported filter '%s'", nm);
}

static bool apply_test(struct R *r, int line, const char *nm, tval v, struct args *a)
{
    tval *x = arg(a, 0, NULL);
    if (!strcmp(nm, "defined")) return v.t != TV_UNDEF;
    if (!strcmp(nm, "undefined")) return v.t == TV_UNDEF;
    if (!strcmp(nm, "none")) return v.t == TV_NONE;
    if (!strcmp(nm, "string")) return v.t == TV_STR;
    if (!strcmp(nm, "mapping")) return v.t == TV_DICT;
    if (!strcmp(nm, "sequence")) return v.t == TV_STR || v.t == TV_DICT || (v.t == TV_LIST && !is_gen(v));
    if (!strcmp(nm, "iterable")) return v.t == TV_STR || v.t == TV_DICT || v.t == TV_LIST || v.t == TV_UNDEF;
    if (!strcmp(nm, "number")) return is_num(v);
    if (!strcmp(nm, "integer")) return v.t == TV_INT;
    if (!strcmp(nm, "float")) return v.t == TV_FLOAT;
    if (!strcmp(nm, "boolean")) return v.t == TV_BOOL;
    if (!strcmp(nm, "true")) return v.t == TV_BOOL && v.u.b;
    if (!strcmp(nm, "false")) return v.t == TV_BOOL && !v.u.b;
    if (!strcmp(nm, "callable")) return v.t == TV_MACRO || v.t == TV_BUILTIN || v.t == TV_METHOD;
    if (!strcmp(nm, "escaped")) return false;
    if (!strcmp(nm, "lower") || !strcmp(nm, "upper")) {
        if (v.t != TV_STR) return false;
        tval c = str_case(r, v, nm[0] == 'l' ? 0 : 1);
        return v_eq(c, v);
    }
    if (!strcmp(nm, "filter")) return v.t == TV_STR && tmpl_filter_known(tmpl_strndup(r->a, v.u.s.p, v.u.s.n));
    if (!strcmp(nm, "test")) return v.t == TV_STR && tmpl_test_known(tmpl_strndup(r->a, v.u.s.p, v.u.s.n));
    if (!x) FAIL(r, line, "test '%s' needs an argument", nm);
    if (!strcmp(nm, "equalto") || !strcmp(nm, "eq")) return v_eq(v, *x);
    if (!strcmp(nm, "ne")) return !v_eq(v, *x);
    if (!strcmp(nm, "lt") || !strcmp(nm, "lessthan")) return v_cmp(r, line, v, *x) < 0;
    if (!strcmp(nm, "le")) return v_cmp(r, line, v, *x) <= 0;
    if (!strcmp(nm, "gt") || !strcmp(nm, "greaterthan")) return v_cmp(r, line, v, *x) > 0;
    if (!strcmp(nm, "ge")) return v_cmp(r, line, v, *x) >= 0;
    if (!strcmp(nm, "in")) return v_contains(r, line, *x, v);
    if (!strcmp(nm, "sameas")) {
        if (v.t != x->t) return false;
        if (v.t == TV_NONE || v.t == TV_UNDEF) return true;
        if (v.t == TV_BOOL) return v.u.b == x->u.b;
        if (v.t == TV_INT) return v.u.i == x->u.i;
        return v_eq(v, *x) && (v.t != TV_LIST || v.u.l == x->u.l) && (v.t != TV_DICT || v.u.d == x->u.d);
    }
    if (!strcmp(nm, "divisibleby")) {
        int64_t d = need_int(r, line, x, "divisibleby argument");
        if (!d) FAIL(r, line, "integer division or modulo by zero");
        if (!is_num(v)) FAIL(r, line, "divisibleby: a number is required");
        return num_i(v) % d == 0;
    }
    FAIL(r, line, "unsupported test '%s'", nm);
}

static bool test_odd_even(struct R *r, int line, const char *nm, tval v, bool *res)
{
    if (strcmp(nm, "odd") && strcmp(nm, "even")) return false;
    if (!(v.t == TV_INT || v.t == TV_BOOL)) FAIL(r, line, "test '%s' needs an integer, not %s", nm, type_name(v));
    *res = (num_i(v) % 2 != 0) == (nm[0] == 'o');
    return true;
}

static tval html_escape(struct R *r, int line, tval v)
{
    if (v.t == TV_STR && v.safe) return v;
    tval s = to_str(r, line, v);
    struct sb b = {0};
    for (size_t i = 0; i < s.u.s.n; i++) {
        char c = s.u.s.p[i];
        if (c == '&') sb_puts(r, &b, "&amp;");
        else if (c == '<') sb_puts(r, &b, "&lt;");
        else if (c == '>') sb_puts(r, &b, "&gt;");
        else if (c == '"') sb_puts(r, &b, "&#34;");
        else if (c == '\'') sb_puts(r, &b, "&#39;");
        else sb_add(r, &b, &c, 1);
    }
    tval o = b.p ? v_sb(&b) : v_str("", 0);
    o.safe = 1;
    return o;
}

static tval arith(struct R *r, int line, int op, tval a, tval b)
{
    if (a.t == TV_UNDEF) fail_undef(r, line, a);
    if (b.t == TV_UNDEF) fail_undef(r, line, b);
    if (op == OP_ADD) {
        if (a.t == TV_STR && b.t == TV_STR) {
            bool safe = a.safe || b.safe;
            if (safe) {
                /* Markup + str escapes the str (jinja2's markupsafe) */
                a = html_escape(r, line, a);
                b = html_escape(r, line, b);
            }
            char *p = tmpl_alloc(r->a, a.u.s.n + b.u.s.n + 1);
            memcpy(p, a.u.s.p, a.u.s.n);
            memcpy(p + a.u.s.n, b.u.s.p, b.u.s.n);
            tval res = v_str(p, a.u.s.n + b.u.s.n);
            res.safe = safe;
            return res;
        }
        if (a.t == TV_LIST && b.t == TV_LIST && !is_gen(a) && !is_gen(b) && (a.u.l->tuple != 0) == (b.u.l->tuple != 0)) {
            tval l = v_list(r, a.u.l->n + b.u.l->n);
            for (size_t i = 0; i < a.u.l->n; i++) list_push(r, l.u.l, a.u.l->v[i]);
            for (size_t i = 0; i < b.u.l->n; i++) list_push(r, l.u.l, b.u.l->v[i]);
            l.u.l->tuple = a.u.l->tuple;
            return l;
        }
        if (a.t == TV_STR) FAIL(r, line, "can only concatenate str (not \"%s\") to str", type_name(b));
    }
    if (op == OP_MUL && ((a.t == TV_STR && (b.t == TV_INT || b.t == TV_BOOL)) || (b.t == TV_STR && (a.t == TV_INT || a.t == TV_BOOL)))) {
        tval s = a.t == TV_STR ? a : b;
        int64_t n = a.t == TV_STR ? num_i(b) : num_i(a);
        if (n > 0 && s.u.s.n * (uint64_t)n > ((size_t)64 << 20)) FAIL(r, line, "string repetition too large");
        struct sb sbuf = {0};
        for (int64_t i = 0; i < n; i++) sb_add(r, &sbuf, s.u.s.p, s.u.s.n);
        return sbuf.p ? v_sb(&sbuf) : v_str("", 0);
    }
    if (op == OP_MOD && a.t == TV_STR) {
        if (b.t == TV_LIST && b.u.l->tuple) return percent_format(r, line, a, b.u.l->v, (int)b.u.l->n);
        return percent_format(r, line, a, &b, 1);
    }
    if (!is_num(a) || !is_num(b))
        FAIL(r, line, "unsupported operand type(s) for arithmetic: '%s' and '%s'", type_name(a), type_name(b));
    bool fl = a.t == TV_FLOAT || b.t == TV_FLOAT;
    if (op == OP_DIV) {
        if (num_f(b) == 0) FAIL(r, line, "division by zero");
        return v_float(num_f(a) / num_f(b));
    }
    if (fl) {
        double x = num_f(a), y = num_f(b);
        switch (op) {
        case OP_ADD: return v_float(x + y);
        case OP_SUB: return v_float(x - y);
        case OP_MUL: return v_float(x * y);
        case OP_POW: return v_float(pow(x, y));
        case OP_FLOORDIV:
            if (y == 0) FAIL(r, line, "float floor division by zero");
            return v_float(floor(x / y));
        case OP_MOD: {
            if (y == 0) FAIL(r, line, "float modulo");
            double m = fmod(x, y);
            if (m != 0 && ((m < 0) != (y < 0))) m += y;
            return v_float(m);
        }
        }
    }
    int64_t x = num_i(a), y = num_i(b), z;
    switch (op) {
    case OP_ADD: if (__builtin_add_overflow(x, y, &z)) goto ovf; return v_int(z);
    case OP_SUB: if (__builtin_sub_overflow(x, y, &z)) goto ovf; return v_int(z);
    case OP_MUL: if (__builtin_mul_overflow(x, y, &z)) goto ovf; return v_int(z);
    case OP_FLOORDIV:
    case OP_MOD: {
        if (y == 0) FAIL(r, line, "integer division or modulo by zero");
        if (x == INT64_MIN && y == -1) goto ovf;
        int64_t q = x / y, m = x % y;
        if (m != 0 && ((m < 0) != (y < 0))) { q--; m += y; }
        return v_int(op == OP_MOD ? m : q);
    }
    case OP_POW: {
        if (y < 0) return v_float(pow((double)x, (double)y));
        int64_t res = 1;
        for (int64_t i = 0; i < y; i++)
            if (__builtin_mul_overflow(res, x, &res)) goto ovf;
        return v_int(res);
    }
    }
ovf:
    FAIL(r, line, "integer overflow");
}

static tval eval(struct R *r, struct scope *s, const struct tnode *n)
{
    if (++r->steps > RENDER_STEP_LIMIT) FAIL(r, n->line, "chat template takes too long to render");
    switch (n->kind) {
    case N_CONST: return n->v;
    case N_NAME: return lookup(r, s, n->s, n->sn, n->line);
    case N_GETATTR: return get_attr(r, n->line, eval(r, s, n->a), n->s, n->sn);
    case N_GETITEM: {
        tval o = eval(r, s, n->a);
        return get_item(r, n->line, o, eval(r, s, n->b));
    }
    case N_SLICE: {
        tval o = eval(r, s, n->a);
        tval x, y, z;
        if (n->b) x = eval(r, s, n->b);
        if (n->c) y = eval(r, s, n->c);
        if (n->d) z = eval(r, s, n->d);
        return slice(r, n->line, o, n->b ? &x : NULL, n->c ? &y : NULL, n->d ? &z : NULL);
    }
    case N_CALL: {
        tval fn = eval(r, s, n->a);
        struct args a;
        eval_args(r, s, n, &a, NULL);
        return call_value(r, n->line, fn, &a);
    }
    case N_FILTER: {
        tval v = eval(r, s, n->a);
        struct args a;
        eval_args(r, s, n, &a, NULL);
        return apply_filter(r, n->line, n->s, v, &a);
    }
    case N_TEST: {
        tval v = eval(r, s, n->a);
        struct args a;
        eval_args(r, s, n, &a, NULL);
        bool res;
        if (!test_odd_even(r, n->line, n->s, v, &res)) res = apply_test(r, n->line, n->s, v, &a);
        return v_bool(n->op ? !res : res);
    }
    case N_NEG:
    case N_POS: {
        tval v = eval(r, s, n->a);
        if (v.t == TV_UNDEF) fail_undef(r, n->line, v);
        if (!is_num(v)) FAIL(r, n->line, "bad operand type for unary %c: '%s'", n->kind == N_NEG ? '-' : '+', type_name(v));
        if (n->kind == N_POS) return v.t == TV_BOOL ? v_int(v.u.b) : v;
        if (v.t == TV_FLOAT) return v_float(-v.u.f);
        if (num_i(v) == INT64_MIN) FAIL(r, n->line, "integer overflow");
        return v_int(-num_i(v));
    }
    case N_NOT: return v_bool(!truthy(eval(r, s, n->a)));
    case N_AND: {
        tval a = eval(r, s, n->a);
        return truthy(a) ? eval(r, s, n->b) : a;
    }
    case N_OR: {
        tval a = eval(r, s, n->a);
        return truthy(a) ? a : eval(r, s, n->b);
    }
    case N_BIN: {
        tval a = eval(r, s, n->a);
        return arith(r, n->line, n->op, a, eval(r, s, n->b));
    }
    case N_CMP: {
        tval a = eval(r, s, n->a);
        for (int k = 0; k < n->nk; k++) {
            tval b = eval(r, s, n->kids[k]);
            bool ok;
            switch (n->ops[k]) {
            case OP_EQ: ok = v_eq(a, b); break;
            case OP_NE: ok = !v_eq(a, b); break;
            case OP_LT: ok = v_cmp(r, n->line, a, b) < 0; break;
            case OP_LE: ok = v_cmp(r, n->line, a, b) <= 0; break;
            case OP_GT: ok = v_cmp(r, n->line, a, b) > 0; break;
            case OP_GE: ok = v_cmp(r, n->line, a, b) >= 0; break;
            case OP_IN: ok = v_contains(r, n->line, b, a); break;
            default: ok = !v_contains(r, n->line, b, a); break;
            }
            if (!ok) return v_bool(false);
            a = b;
        }
        return v_bool(true);
    }
    case N_CONCAT: {
        struct sb b = {0};
        for (int k = 0; k < n->nk; k++) v_print(r, n->line, &b, eval(r, s, n->kids[k]), false);
        return b.p ? v_sb(&b) : v_str("", 0);
    }
    case N_COND:
        if (truthy(eval(r, s, n->b))) return eval(r, s, n->a);
        return n->c ? eval(r, s, n->c) : v_undef("the conditional expression had no else branch");
    case N_LIST:
    case N_TUPLE: {
        tval l = v_list(r, (size_t)n->nk);
        for (int k = 0; k < n->nk; k++) list_push(r, l.u.l, eval(r, s, n->kids[k]));
        l.u.l->tuple = n->kind == N_TUPLE;
        return l;
    }
    case N_DICT: {
        tval d = v_dict(r, TV_DICT);
        for (int k = 0; k < n->nk; k++) {
            tval key = eval(r, s, n->kids[k]);
            if (key.t == TV_LIST || key.t == TV_DICT || key.t == TV_NS || key.t == TV_UNDEF)
                FAIL(r, n->line, "unhashable type: '%s'", type_name(key));
            dict_set(r, d.u.d, key, eval(r, s, n->kids2[k]));
        }
        return d;
    }
    default: break;
    }
    FAIL(r, n->line, "internal error: not an expression");
}

/* ---- statements ----------------------------------------------------------------------------------- */

enum { CTL_NONE, CTL_BREAK, CTL_CONTINUE };

static void unpack(struct R *r, struct scope *s, int line, const char *const *names, int nn, tval v)
{
    if (nn == 1) {
        assign(r, s, names[0], v);
        return;
    }
    if (v.t == TV_UNDEF) fail_undef(r, line, v);
    struct tlist *l = iter_list(r, line, v);
    if ((int)l->n != nn)
        FAIL(r, line, "cannot unpack %zu values into %d names", l->n, nn);
    for (int k = 0; k < nn; k++) assign(r, s, names[k], l->v[k]);
}

static int exec_for(struct R *r, struct scope *s, const struct tnode *n, struct sb *out)
{
    tval it = eval(r, s, n->a);
    if (it.t == TV_NONE || it.t == TV_INT || it.t == TV_FLOAT || it.t == TV_BOOL)
        FAIL(r, n->line, "'%s' object is not iterable", type_name(it));
    struct tlist *items = iter_list(r, n->line, it);
    /* the filter sees each item before the loop object exists */
    struct tlist *sel = items;
    if (n->b) {
        sel = v_list(r, items->n).u.l;
        for (size_t i = 0; i < items->n; i++) {
            struct scope *fs = scope_new(r, s);
            unpack(r, fs, n->line, n->names, n->nn, items->v[i]);
            if (truthy(eval(r, fs, n->b))) list_push(r, sel, items->v[i]);
        }
    }
    size_t len = sel->n;
    for (size_t i = 0; i < len; i++) {
        struct scope *ls = scope_new(r, s);
        tval loop = v_dict(r, TV_DICT);
        struct tdict *d = loop.u.d;
        dict_sets(r, d, "index", v_int((int64_t)i + 1));
        dict_sets(r, d, "index0", v_int((int64_t)i));
        dict_sets(r, d, "revindex", v_int((int64_t)(len - i)));
        dict_sets(r, d, "revindex0", v_int((int64_t)(len - i - 1)));
        dict_sets(r, d, "first", v_bool(i == 0));
        dict_sets(r, d, "last", v_bool(i + 1 == len));
        dict_sets(r, d, "length", v_int((int64_t)len));
        dict_sets(r, d, "depth", v_int(1));
        dict_sets(r, d, "depth0", v_int(0));
        dict_sets(r, d, "previtem", i ? sel->v[i - 1] : v_undef("there is no previous item"));
        dict_sets(r, d, "nextitem", i + 1 < len ? sel->v[i + 1] : v_undef("there is no next item"));
        dict_sets(r, d, "cycle", method(r, loop, "cycle"));
        loop.t = TV_NS; /* attribute access reads keys; printing it is not supported anyway */
        assign(r, ls, "loop", loop);
        unpack(r, ls, n->line, n->names, n->nn, sel->v[i]);
        int c = exec_body(r, ls, n->kids, n->nk, out);
        if (c == CTL_BREAK) break;
    }
    if (!len && n->nk2) return exec_body(r, s, n->kids2, n->nk2, out);
    return CTL_NONE;
}

/* A macro value for def (N_MACRO, or N_CALLBLOCK: its caller) closing over
 * s, without a caller or a name yet. */
static tval macro_value(struct R *r, struct scope *s, const struct tnode *def)
{
    tval m = {.t = TV_MACRO};
    m.u.m = tmpl_alloc(r->a, sizeof *m.u.m);
    m.u.m->def = def;
    m.u.m->closure = s;
    m.u.m->caller = v_undef(NULL);
    return m;
}

static void exec_set(struct R *r, struct scope *s, const struct tnode *target, tval v)
{
    if (target->kind == N_NAME) {
        assign(r, s, target->s, v);
    } else if (target->kind == N_GETATTR) {
        tval ns = lookup(r, s, target->a->s, strlen(target->a->s), target->line);
        if (ns.t != TV_NS) FAIL(r, target->line, "can't assign attribute '%s' on a %s: only a namespace() can be changed", target->s, type_name(ns));
        dict_sets(r, ns.u.d, target->s, v);
    } else {
        unpack(r, s, target->line, target->names, target->nn, v);
    }
}

static int exec_body(struct R *r, struct scope *s, struct tnode *const *kids, int nk, struct sb *out)
{
    for (int k = 0; k < nk; k++) {
        const struct tnode *n = kids[k];
        if (++r->steps > RENDER_STEP_LIMIT) FAIL(r, n->line, "chat template takes too long to render");
        switch (n->kind) {
        case N_TEXT: sb_add(r, out, n->s, n->sn); break;
        case N_OUT: v_print(r, n->line, out, eval(r, s, n->a), false); break;
        case N_IF: {
            int c = truthy(eval(r, s, n->a)) ? exec_body(r, s, n->kids, n->nk, out) : exec_body(r, s, n->kids2, n->nk2, out);
            if (c) return c;
            break;
        }
        case N_FOR: exec_for(r, s, n, out); break;
        case N_SET: exec_set(r, s, n->a, eval(r, s, n->b)); break;
        case N_SETBLOCK: {
            struct sb b = {0};
            exec_body(r, scope_new(r, s), n->kids, n->nk, &b);
            tval v = b.p ? v_sb(&b) : v_str("", 0);
            if (n->c) {
                /* apply the filter chain with the body as the innermost operand */
                const struct tnode *chain[32];
                int nc = 0;
                for (const struct tnode *f = n->c; f && nc < 32; f = f->a) chain[nc++] = f;
                for (int i = nc - 1; i >= 0; i--) {
                    struct args a;
                    eval_args(r, s, chain[i], &a, NULL);
                    v = apply_filter(r, chain[i]->line, chain[i]->s, v, &a);
                }
            }
            exec_set(r, s, n->a, v);
            break;
        }
        case N_MACRO: {
            tval m = macro_value(r, s, n);
            m.u.m->name = n->s;
            assign(r, s, n->s, m);
            break;
        }
        case N_CALLBLOCK: {
            tval caller = macro_value(r, s, n);
            const struct tnode *call = n->a;
            tval fn = eval(r, s, call->a);
            struct args a;
            eval_args(r, s, call, &a, NULL);
            if (fn.t != TV_MACRO) FAIL(r, n->line, "{%% call %%} needs a macro, not %s", type_name(fn));
            struct tmacro m = *fn.u.m;
            m.caller = caller;
            sb_add(r, out, "", 0);
            tval res = call_macro(r, n->line, &m, &a);
            sb_add(r, out, res.u.s.p, res.u.s.n);
            break;
        }
        case N_FILTERBLOCK: {
            struct sb b = {0};
            exec_body(r, scope_new(r, s), n->kids, n->nk, &b);
            tval v = b.p ? v_sb(&b) : v_str("", 0);
            const struct tnode *chain[32];
            int nc = 0;
            for (const struct tnode *f = n->c; f && nc < 32; f = f->a) chain[nc++] = f;
            for (int i = nc - 1; i >= 0; i--) {
                if (chain[i]->kind != N_FILTER) FAIL(r, n->line, "unsupported construct in a filter block");
                struct args a;
                eval_args(r, s, chain[i], &a, NULL);
                v = apply_filter(r, chain[i]->line, chain[i]->s, v, &a);
            }
            v_print(r, n->line, out, v, false);
            break;
        }
        case N_BREAK: return CTL_BREAK;
        case N_CONTINUE: return CTL_CONTINUE;
        case N_BODY: {
            int c = exec_body(r, s, n->kids, n->nk, out);
            if (c) return c;
            break;
        }
        default: FAIL(r, n->line, "internal error: not a statement");
        }
    }
    return CTL_NONE;
}

/* ---- public API ------------------------------------------------------------------------------------ */

struct model_tmpl {
    struct tmpl_arena a;
    struct tnode *root;
};

model_tmpl *model_tmpl_create(const char *src, size_t len, char *err, size_t errlen)
{
    if (err && errlen) err[0] = 0;
    model_tmpl *volatile t = calloc(1, sizeof *t);
    if (!t) {
        if (err && errlen) snprintf(err, errlen, "out of memory");
        return NULL;
    }
    jmp_buf jb;
    t->a.jb = &jb;
    t->a.err = err;
    t->a.errlen = errlen;
    t->a.limit = (size_t)256 << 20;
    if (setjmp(jb)) goto fail_parse;
    if (!src) tmpl_fail(&t->a, 0, "no chat template");
    t->root = tmpl_parse_src(&t->a, src, len);
    t->a.jb = NULL;
    t->a.err = NULL;
    return t;
fail_parse:
    tmpl_arena_free(&t->a);
    free(t);
    return NULL;
}

void model_tmpl_destroy(model_tmpl *t)
{
    if (!t) return;
    tmpl_arena_free(&t->a);
    free(t);
}

/* The loop object's cycle() is a method on it (see exec_for). */
int model_tmpl_render(const model_tmpl *t, const char *ctx_json, size_t ctx_len, const struct model_tmpl_opts *opts,
                      char **out, size_t *out_len, char *err, size_t errlen)
{
    if (err && errlen) err[0] = 0;
    *out = NULL;
    if (out_len) *out_len = 0;
    struct tmpl_arena a = {.limit = opts && opts->max_bytes ? opts->max_bytes : RENDER_MEM_LIMIT};
    jmp_buf jb;
    a.jb = &jb;
    a.err = err;
    a.errlen = errlen;
    json_doc d = {0};
    volatile int have_doc = 0;
    volatile int rc = SL_EINVAL;
    if (setjmp(jb)) goto fail;
    struct R r = {.a = &a, .now = opts ? opts->now : 0};
    r.root = scope_new(&r, NULL);
    if (ctx_json && ctx_len) {
        char jerr[128];
        if (json_parse(&d, ctx_json, ctx_len, jerr, sizeof jerr)) tmpl_fail(&a, 0, "template context: %s", jerr);
        have_doc = 1;
        if (!json_is_obj(&d, 0)) tmpl_fail(&a, 0, "template context must be a JSON object");
        tval ctx = from_json(&r, &d, 0, 0);
        for (size_t i = 0; i < ctx.u.d->n; i++) dict_set(&r, &r.root->vars, ctx.u.d->k[i], ctx.u.d->v[i]);
        json_free(&d);
        have_doc = 0;
    }
    struct sb o = {0};
    exec_body(&r, r.root, t->root->kids, t->root->nk, &o);
    *out = malloc(o.n + 1);
    if (!*out) {
        rc = SL_ENOMEM;
        if (err && errlen) snprintf(err, errlen, "out of memory");
        goto fail;
    }
    if (o.n) memcpy(*out, o.p, o.n);
    (*out)[o.n] = 0;
    if (out_len) *out_len = o.n;
    tmpl_arena_free(&a);
    return 0;
fail:
    if (have_doc) json_free(&d);
    tmpl_arena_free(&a);
    return rc;
}

const char model_chatml_template[] =
    "{% for message in messages %}"
    "{{ '<|im_start|>' + message['role'] + '\\n' + message['content'] + '<|im_end|>' + '\\n' }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{% endif %}";

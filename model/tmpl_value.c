/* tmpl_value.c - the chat template engine's values, with Python's semantics:
 * the render arena, string builders, lists and dicts, truth, equality and
 * ordering, str()/repr() printing, JSON in (the render context) and out
 * (tojson), scopes, UTF-8 strings measured in code points, iteration, and
 * attribute and item access (jinja2's sandboxed getattr/getitem).
 * What the engine's files share is in tmpl_internal.h.
 */
#include <ctype.h>
#include <math.h>
#include <stdarg.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "tmpl_internal.h"

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

const char *const tv_bi_names[BI_COUNT] = {"range", "namespace", "dict", "raise_exception", "strftime_now"};

void tv_sb_add(struct R *r, struct sb *b, const char *s, size_t n)
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


void tv_sb_printf(struct R *r, struct sb *b, const char *fmt, ...)
{
    char buf[512];
    va_list ap;
    va_start(ap, fmt);
    int n = vsnprintf(buf, sizeof buf, fmt, ap);
    va_end(ap);
    if (n > 0) tv_sb_add(r, b, buf, (size_t)n < sizeof buf ? (size_t)n : sizeof buf - 1);
}

/* ---- values ----------------------------------------------------------------------------- */


tval tv_list(struct R *r, size_t cap)
{
    tval v = {.t = TV_LIST};
    v.u.l = tmpl_alloc(r->a, sizeof *v.u.l);
    if (cap) {
        v.u.l->v = tmpl_alloc(r->a, cap * sizeof(tval));
        v.u.l->cap = cap;
    }
    return v;
}

void tv_list_push(struct R *r, struct tlist *l, tval x)
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

tval tv_dict(struct R *r, int t)
{
    tval v = {.t = (uint8_t)t};
    v.u.d = tmpl_alloc(r->a, sizeof *v.u.d);
    return v;
}

tval tv_tuple2(struct R *r, tval a, tval b)
{
    tval t = tv_list(r, 2);
    t.u.l->tuple = true;
    tv_list_push(r, t.u.l, a);
    tv_list_push(r, t.u.l, b);
    return t;
}

/* A list made by a filter that jinja2 implements as a generator. */


tval *tv_dict_find(struct tdict *d, tval k)
{
    for (size_t i = 0; i < d->n; i++)
        if (tv_eq(d->k[i], k)) return &d->v[i];
    return NULL;
}

tval *tv_dict_finds(struct tdict *d, const char *s, size_t n)
{
    for (size_t i = 0; i < d->n; i++)
        if (key_eq(d->k[i], s, n)) return &d->v[i];
    return NULL;
}

void tv_dict_set(struct R *r, struct tdict *d, tval k, tval v)
{
    tval *e = tv_dict_find(d, k);
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

void tv_dict_sets(struct R *r, struct tdict *d, const char *k, tval v) { tv_dict_set(r, d, v_cstr(k), v); }

const char *tv_type_name(tval v)
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

bool tv_truthy(tval v)
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

bool tv_eq(tval a, tval b)
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
            if (!tv_eq(a.u.l->v[i], b.u.l->v[i])) return false;
        return true;
    case TV_DICT:
        if (a.u.d->n != b.u.d->n) return false;
        for (size_t i = 0; i < a.u.d->n; i++) {
            tval *o = tv_dict_find(b.u.d, a.u.d->k[i]);
            if (!o || !tv_eq(a.u.d->v[i], *o)) return false;
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
int tv_cmp(struct R *r, int line, tval a, tval b)
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
            if (tv_eq(a.u.l->v[i], b.u.l->v[i])) continue;
            return tv_cmp(r, line, a.u.l->v[i], b.u.l->v[i]);
        }
        return a.u.l->n < b.u.l->n ? -1 : a.u.l->n > b.u.l->n;
    }
    FAIL(r, line, "'<' not supported between instances of '%s' and '%s'", tv_type_name(a), tv_type_name(b));
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
    tv_sb_add(r, b, &q, 1);
    for (size_t i = 0; i < n; i++) {
        unsigned char c = (unsigned char)s[i];
        if (c == '\\') sb_puts(r, b, "\\\\");
        else if (c == (unsigned char)q) { sb_puts(r, b, "\\"); tv_sb_add(r, b, &q, 1); }
        else if (c == '\n') sb_puts(r, b, "\\n");
        else if (c == '\r') sb_puts(r, b, "\\r");
        else if (c == '\t') sb_puts(r, b, "\\t");
        else if (c < 0x20 || c == 0x7f) tv_sb_printf(r, b, "\\x%02x", c);
        else tv_sb_add(r, b, (const char *)&s[i], 1);
    }
    tv_sb_add(r, b, &q, 1);
}


static void print_list(struct R *r, int line, struct sb *b, struct tlist *l)
{
    sb_puts(r, b, l->tuple ? "(" : "[");
    for (size_t i = 0; i < l->n; i++) {
        if (i) sb_puts(r, b, ", ");
        tv_print(r, line, b, l->v[i], true);
    }
    if (l->tuple && l->n == 1) sb_puts(r, b, ",");
    sb_puts(r, b, l->tuple ? ")" : "]");
}

static void print_dict(struct R *r, int line, struct sb *b, struct tdict *d)
{
    sb_puts(r, b, "{");
    for (size_t i = 0; i < d->n; i++) {
        if (i) sb_puts(r, b, ", ");
        tv_print(r, line, b, d->k[i], true);
        sb_puts(r, b, ": ");
        tv_print(r, line, b, d->v[i], true);
    }
    sb_puts(r, b, "}");
}

void tv_print(struct R *r, int line, struct sb *b, tval v, bool repr)
{
    char buf[64];
    switch (v.t) {
    case TV_UNDEF: if (repr) sb_puts(r, b, "Undefined"); break;
    case TV_NONE: sb_puts(r, b, "None"); break;
    case TV_BOOL: sb_puts(r, b, v.u.b ? "True" : "False"); break;
    case TV_INT: tv_sb_printf(r, b, "%lld", (long long)v.u.i); break;
    case TV_FLOAT: fmt_float(v.u.f, buf, sizeof buf); sb_puts(r, b, buf); break;
    case TV_STR:
        if (repr) repr_str(r, b, v.u.s.p, v.u.s.n);
        else tv_sb_add(r, b, v.u.s.p, v.u.s.n);
        break;
    case TV_LIST:
        if (is_gen(v)) FAIL(r, line, "cannot print a generator (add '| list')");
        print_list(r, line, b, v.u.l);
        break;
    case TV_DICT: print_dict(r, line, b, v.u.d); break;
    case TV_NS: sb_puts(r, b, "<Namespace "); print_dict(r, line, b, v.u.d); sb_puts(r, b, ">"); break;
    case TV_MACRO: tv_sb_printf(r, b, "<Macro '%s'>", v.u.m->name ? v.u.m->name : "caller"); break;
    default: FAIL(r, line, "cannot print a %s", tv_type_name(v));
    }
}

tval tv_to_str(struct R *r, int line, tval v)
{
    if (v.t == TV_STR) return v;
    struct sb b = {0};
    tv_print(r, line, &b, v, false);
    return v_sb(&b);
}

/* ---- JSON in and out --------------------------------------------------------------------------- */

tval tv_from_json(struct R *r, const json_doc *d, int i, int depth)
{
    if (depth > 200) FAIL(r, 0, "context JSON nested too deeply");
    if (json_is_obj(d, i)) {
        tval o = tv_dict(r, TV_DICT);
        int n = json_size(d, i);
        for (int k = 0, p = i + 1; k < n; k++) {
            size_t len;
            char *s = json_strdup(d, p, &len);
            if (!s) FAIL(r, 0, "invalid string in the context JSON");
            tval key = v_str(tmpl_strndup(r->a, s, len), len);
            free(s);
            tv_dict_set(r, o.u.d, key, tv_from_json(r, d, p + 1, depth + 1));
            p = json_skip(d, p + 1);
        }
        return o;
    }
    if (json_is_arr(d, i)) {
        int n = json_size(d, i);
        tval l = tv_list(r, (size_t)n);
        for (int k = 0, p = i + 1; k < n; k++, p = json_skip(d, p)) tv_list_push(r, l.u.l, tv_from_json(r, d, p, depth + 1));
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
        else if (c < 0x20 || (ascii && c == 0x7f)) tv_sb_printf(r, b, "\\u%04x", c);
        else if (c >= 0x80 && ascii) {
            size_t adv;
            uint32_t cp = utf8_dec((const unsigned char *)s + i, n - i, &adv);
            if (cp >= 0x10000) {
                cp -= 0x10000;
                tv_sb_printf(r, b, "\\u%04x\\u%04x", 0xD800 + (cp >> 10), 0xDC00 + (cp & 0x3FF));
            } else {
                tv_sb_printf(r, b, "\\u%04x", cp);
            }
            i += adv;
            continue;
        } else tv_sb_add(r, b, s + i, 1);
        i++;
    }
    sb_puts(r, b, "\"");
}

static void json_nl(struct R *r, struct sb *b, const struct jopt *o, int level)
{
    sb_puts(r, b, "\n");
    for (int k = 0; k < level; k++) sb_puts(r, b, o->indent);
}

void tv_to_json(struct R *r, int line, struct sb *b, tval v, const struct jopt *o, int level)
{
    char buf[64];
    if (level > 200) FAIL(r, line, "tojson: value nested too deeply");
    switch (v.t) {
    case TV_NONE: sb_puts(r, b, "null"); return;
    case TV_BOOL: sb_puts(r, b, v.u.b ? "true" : "false"); return;
    case TV_INT: tv_sb_printf(r, b, "%lld", (long long)v.u.i); return;
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
            tv_to_json(r, line, b, v.u.l->v[i], o, level + 1);
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
                for (size_t j = i; j > 0 && tv_cmp(r, line, d->k[ord[j - 1]], d->k[ord[j]]) > 0; j--) {
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
                tv_print(r, line, &kb, k, false);
                json_str_out(r, b, kb.p, kb.n, o->ascii);
            } else if (k.t == TV_BOOL) sb_puts(r, b, k.u.b ? "\"true\"" : "\"false\"");
            else if (k.t == TV_NONE) sb_puts(r, b, "\"null\"");
            else FAIL(r, line, "tojson: keys must be str, int, float, bool or None, not %s", tv_type_name(k));
            sb_puts(r, b, o->key_sep);
            tv_to_json(r, line, b, d->v[ord[i]], o, level + 1);
        }
        if (o->indent) json_nl(r, b, o, level);
        sb_puts(r, b, "}");
        return;
    }
    default: break;
    }
    FAIL(r, line, "Object of type %s is not JSON serializable", tv_type_name(v));
}

/* ---- scopes ---------------------------------------------------------------------------------- */

struct scope *tv_scope_new(struct R *r, struct scope *parent)
{
    struct scope *s = tmpl_alloc(r->a, sizeof *s);
    s->parent = parent;
    return s;
}

tval tv_lookup(struct R *r, struct scope *s, const char *name, size_t n, int line)
{
    (void)line;
    for (; s; s = s->parent) {
        tval *v = tv_dict_finds(&s->vars, name, n);
        if (v) return *v;
    }
    for (int k = 0; k < BI_COUNT; k++)
        if (strlen(tv_bi_names[k]) == n && !memcmp(tv_bi_names[k], name, n)) return (tval){.t = TV_BUILTIN, .u.fn = k};
    char *hint = tmpl_alloc(r->a, n + 32);
    snprintf(hint, n + 32, "'%.*s' is undefined", (int)n, name);
    return v_undef(hint);
}

void tv_assign(struct R *r, struct scope *s, const char *name, tval v) { tv_dict_sets(r, &s->vars, name, v); }

/* ---- strings (UTF-8, measured in code points like Python) ------------------------------------- */

size_t tv_cp_len(const char *s, size_t n)
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


static bool in_chars(unsigned char c, tval chars)
{
    if (chars.t != TV_STR) return py_space(c);
    return memchr(chars.u.s.p, c, chars.u.s.n) != NULL;
}

tval tv_str_strip(tval s, tval chars, bool left, bool right)
{
    const char *p = s.u.s.p;
    size_t a = 0, b = s.u.s.n;
    if (left) while (a < b && in_chars((unsigned char)p[a], chars)) a++;
    if (right) while (b > a && in_chars((unsigned char)p[b - 1], chars)) b--;
    return v_str(p + a, b - a);
}

tval tv_str_case(struct R *r, tval s, int mode) /* 0 lower, 1 upper, 2 capitalize, 3 title */
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

tval tv_str_replace(struct R *r, tval s, tval old, tval new, int64_t count)
{
    struct sb b = {0};
    const char *p = s.u.s.p, *end = p + s.u.s.n;
    if (old.u.s.n == 0) {
        /* Python inserts new between every code point (and at both ends) */
        int64_t done = 0;
        size_t i = 0;
        for (;;) {
            if (count < 0 || done < count) { tv_sb_add(r, &b, new.u.s.p, new.u.s.n); done++; }
            if (i >= s.u.s.n) break;
            size_t j = i + 1;
            while (j < s.u.s.n && ((unsigned char)p[j] & 0xC0) == 0x80) j++;
            tv_sb_add(r, &b, p + i, j - i);
            i = j;
        }
        return v_sb(&b);
    }
    int64_t done = 0;
    while (p < end) {
        const char *h = (count >= 0 && done >= count) ? NULL : memmem(p, (size_t)(end - p), old.u.s.p, old.u.s.n);
        if (!h) break;
        tv_sb_add(r, &b, p, (size_t)(h - p));
        tv_sb_add(r, &b, new.u.s.p, new.u.s.n);
        p = h + old.u.s.n;
        done++;
    }
    tv_sb_add(r, &b, p, (size_t)(end - p));
    if (!b.p) return v_str("", 0);
    return v_sb(&b);
}

tval tv_str_split(struct R *r, tval s, tval sep, int64_t maxsplit)
{
    tval l = tv_list(r, 0);
    const char *p = s.u.s.p, *end = p + s.u.s.n;
    if (sep.t != TV_STR) {
        int64_t done = 0;
        while (p < end) {
            while (p < end && py_space((unsigned char)*p)) p++;
            if (p >= end) break;
            if (maxsplit >= 0 && done >= maxsplit) {
                const char *e = end;
                while (e > p && py_space((unsigned char)e[-1])) e--;
                tv_list_push(r, l.u.l, v_str(p, (size_t)(e - p)));
                break;
            }
            const char *q = p;
            while (q < end && !py_space((unsigned char)*q)) q++;
            tv_list_push(r, l.u.l, v_str(p, (size_t)(q - p)));
            done++;
            p = q;
        }
        return l;
    }
    int64_t done = 0;
    for (;;) {
        const char *h = (maxsplit >= 0 && done >= maxsplit) ? NULL : memmem(p, (size_t)(end - p), sep.u.s.p, sep.u.s.n);
        if (!h) break;
        tv_list_push(r, l.u.l, v_str(p, (size_t)(h - p)));
        p = h + sep.u.s.n;
        done++;
    }
    tv_list_push(r, l.u.l, v_str(p, (size_t)(end - p)));
    return l;
}

tval tv_str_rsplit(struct R *r, tval s, tval sep, int64_t maxsplit)
{
    if (maxsplit < 0 || sep.t != TV_STR) return tv_str_split(r, s, sep, maxsplit);
    tval l = tv_list(r, 0);
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
    tv_list_push(r, l.u.l, v_str(st, (size_t)(end - st)));
    while (np) tv_list_push(r, l.u.l, parts[--np]);
    return l;
}

bool tv_str_affix(tval s, tval x, bool prefix)
{
    if (x.t != TV_STR || x.u.s.n > s.u.s.n) return false;
    const char *p = prefix ? s.u.s.p : s.u.s.p + s.u.s.n - x.u.s.n;
    return !memcmp(p, x.u.s.p, x.u.s.n);
}

/* ---- iteration ------------------------------------------------------------------------------ */

/* The items a for loop or a filter iterates over (a new or borrowed list). */
struct tlist *tv_iter_list(struct R *r, int line, tval v)
{
    switch (v.t) {
    case TV_LIST: return v.u.l;
    case TV_UNDEF: return tv_list(r, 0).u.l;
    case TV_DICT: {
        tval l = tv_list(r, v.u.d->n);
        for (size_t i = 0; i < v.u.d->n; i++) tv_list_push(r, l.u.l, v.u.d->k[i]);
        return l.u.l;
    }
    case TV_STR: {
        tval l = tv_list(r, 0);
        const char *p = v.u.s.p;
        for (size_t i = 0; i < v.u.s.n;) {
            size_t j = i + 1;
            while (j < v.u.s.n && ((unsigned char)p[j] & 0xC0) == 0x80) j++;
            tv_list_push(r, l.u.l, v_str(p + i, j - i));
            i = j;
        }
        return l.u.l;
    }
    default: FAIL(r, line, "'%s' object is not iterable", tv_type_name(v));
    }
}

int64_t tv_len(struct R *r, int line, tval v)
{
    switch (v.t) {
    case TV_UNDEF: return 0;
    case TV_STR: return (int64_t)tv_cp_len(v.u.s.p, v.u.s.n);
    case TV_LIST: if (!is_gen(v)) return (int64_t)v.u.l->n; break;
    case TV_DICT: return (int64_t)v.u.d->n;
    default: break;
    }
    FAIL(r, line, "object of type '%s' has no len()", tv_type_name(v));
}

bool tv_contains(struct R *r, int line, tval hay, tval needle)
{
    switch (hay.t) {
    case TV_STR:
        if (needle.t != TV_STR) FAIL(r, line, "'in <string>' requires string as left operand, not %s", tv_type_name(needle));
        return needle.u.s.n == 0 || memmem(hay.u.s.p, hay.u.s.n, needle.u.s.p, needle.u.s.n);
    case TV_LIST:
        for (size_t i = 0; i < hay.u.l->n; i++)
            if (tv_eq(hay.u.l->v[i], needle)) return true;
        return false;
    case TV_DICT: return tv_dict_find(hay.u.d, needle) != NULL;
    case TV_UNDEF: return false;
    default: FAIL(r, line, "argument of type '%s' is not iterable", tv_type_name(hay));
    }
}

/* ---- attribute and item access --------------------------------------------------------------- */

static const char *const str_methods[] = {"strip", "lstrip", "rstrip", "split", "rsplit", "startswith", "endswith",
                                          "replace", "upper", "lower", "title", "capitalize", "find", "rfind",
                                          "count", "join", "format", "isdigit", "isalpha", "isalnum", "isspace",
                                          "islower", "isupper", "splitlines", "index", NULL};
static const char *const dict_methods[] = {"items", "keys", "values", "get", "copy", NULL};
static const char *const list_methods[] = {"index", "count", "copy", NULL};
const char *const tv_mutators[] = {"append", "extend", "insert", "pop", "remove", "clear", "update",
                                       "setdefault", "popitem", "sort", "reverse", NULL};

int tv_in_names(const char *const *names, const char *s, size_t n)
{
    for (int k = 0; names[k]; k++)
        if (strlen(names[k]) == n && !memcmp(names[k], s, n)) return 1;
    return 0;
}

tval tv_method(struct R *r, tval self, const char *name)
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
    else snprintf(hint, n + 64, "'%s object' has no attribute '%.*s'", tv_type_name(obj), (int)n, name);
    return v_undef(hint);
}

void tv_fail_undef(struct R *r, int line, tval u)
{
    if (u.u.s.n) FAIL(r, line, "%.*s", (int)u.u.s.n, u.u.s.p);
    FAIL(r, line, "undefined value");
}

tval tv_get_attr(struct R *r, int line, tval obj, const char *name, size_t n)
{
    switch (obj.t) {
    case TV_UNDEF: tv_fail_undef(r, line, obj); break;
    case TV_NS: {
        tval *v = tv_dict_finds(obj.u.d, name, n);
        return v ? *v : undef_attr(r, obj, name, n);
    }
    case TV_DICT: {
        if (tv_in_names(dict_methods, name, n)) return tv_method(r, obj, tmpl_strndup(r->a, name, n));
        if (tv_in_names(tv_mutators, name, n)) return tv_method(r, obj, tmpl_strndup(r->a, name, n));
        tval *v = tv_dict_finds(obj.u.d, name, n);
        return v ? *v : undef_attr(r, obj, name, n);
    }
    case TV_STR:
        if (tv_in_names(str_methods, name, n)) return tv_method(r, obj, tmpl_strndup(r->a, name, n));
        break;
    case TV_LIST:
        if (!is_gen(obj) && (tv_in_names(list_methods, name, n) || tv_in_names(tv_mutators, name, n)))
            return tv_method(r, obj, tmpl_strndup(r->a, name, n));
        break;
    default: break;
    }
    return undef_attr(r, obj, name, n);
}


tval tv_get_item(struct R *r, int line, tval obj, tval key)
{
    switch (obj.t) {
    case TV_UNDEF: tv_fail_undef(r, line, obj); break;
    case TV_DICT: {
        tval *v = tv_dict_find(obj.u.d, key);
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
            int64_t i = num_i(key), n = (int64_t)tv_cp_len(obj.u.s.p, obj.u.s.n);
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
    if (key.t == TV_STR) return tv_get_attr(r, line, obj, key.u.s.p, key.u.s.n);
    if (obj.t == TV_NONE) return v_undef("None has no element");
    return v_undef("no such element");
}

tval tv_slice(struct R *r, int line, tval obj, tval *start, tval *stop, tval *step)
{
    if (obj.t == TV_UNDEF) tv_fail_undef(r, line, obj);
    if (!(obj.t == TV_STR || (obj.t == TV_LIST && !is_gen(obj)))) return v_undef("object is not subscriptable");
    int64_t n = obj.t == TV_STR ? (int64_t)tv_cp_len(obj.u.s.p, obj.u.s.n) : (int64_t)obj.u.l->n;
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
        struct tlist *chars = tv_iter_list(r, line, obj);
        struct sb sbuf = {0};
        for (int64_t i = a; st > 0 ? i < b : i > b; i += st) tv_sb_add(r, &sbuf, chars->v[i].u.s.p, chars->v[i].u.s.n);
        return sbuf.p ? v_sb(&sbuf) : v_str("", 0);
    }
    tval l = tv_list(r, 0);
    for (int64_t i = a; st > 0 ? i < b : i > b; i += st) tv_list_push(r, l.u.l, obj.u.l->v[i]);
    l.u.l->tuple = obj.u.l->tuple;
    return l;
}

/* ---- arguments --------------------------------------------------------------------------------- */

/* Argument i (positional, after any implicit operand) or keyword name. */
tval *tv_arg(struct args *a, int i, const char *name)
{
    if (i >= 0 && i < a->np) return &a->pos[i];
    for (int k = 0; name && k < a->nk; k++)
        if (!strcmp(a->kn[k], name)) return &a->kv[k];
    return NULL;
}


tval tv_need_str(struct R *r, int line, tval *v, const char *what)
{
    if (!v || v->t != TV_STR) FAIL(r, line, "%s must be a string, not %s", what, v ? tv_type_name(*v) : "nothing");
    return *v;
}

int64_t tv_need_int(struct R *r, int line, tval *v, const char *what)
{
    if (!v || !(v->t == TV_INT || v->t == TV_BOOL)) FAIL(r, line, "%s must be an integer, not %s", what, v ? tv_type_name(*v) : "nothing");
    return num_i(*v);
}

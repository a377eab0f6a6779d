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
 * This file evaluates: expressions, calls, statements and the public API. The
 * parser is in tmpl_parse.c, values (printing, JSON, strings, attribute and
 * item access) in tmpl_value.c, filters, tests and methods in tmpl_filter.c;
 * what they share is in tmpl_internal.h.
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

/* ---- evaluation -------------------------------------------------------------------------------- */

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

static tval call_value(struct R *r, int line, tval fn, struct args *a);

static tval call_macro(struct R *r, int line, struct tmacro *m, struct args *a)
{
    const struct tnode *def = m->def;
    if (++r->depth > MAX_CALL_DEPTH) FAIL(r, line, "macro recursion too deep");
    if (a->np > def->nn)
        FAIL(r, line, "macro '%s' takes not more than %d argument(s)", m->name ? m->name : "caller", def->nn);
    struct scope *s = tv_scope_new(r, m->closure);
    for (int k = 0; k < a->nk; k++) {
        bool found = false;
        for (int j = 0; j < def->nn; j++) found |= !strcmp(def->names[j], a->kn[k]);
        if (!found && strcmp(a->kn[k], "caller"))
            FAIL(r, line, "macro '%s' has no argument named '%s'", m->name ? m->name : "caller", a->kn[k]);
    }
    for (int j = 0; j < def->nn; j++) {
        tval *v = j < a->np ? &a->pos[j] : tv_arg(a, -1, def->names[j]);
        tval val;
        if (v) val = *v;
        else if (def->kids2 && def->kids2[j]) val = eval(r, s, def->kids2[j]);
        else {
            char *hint = tmpl_alloc(r->a, strlen(def->names[j]) + 64);
            sprintf(hint, "parameter '%s' was not provided", def->names[j]);
            val = v_undef(hint);
        }
        tv_assign(r, s, def->names[j], val);
    }
    if (m->caller.t != TV_UNDEF) tv_assign(r, s, "caller", m->caller);
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
        if (a->np == 1) en = tv_need_int(r, line, &a->pos[0], "range() argument");
        else {
            st = tv_need_int(r, line, &a->pos[0], "range() argument");
            en = tv_need_int(r, line, &a->pos[1], "range() argument");
            if (a->np == 3) stp = tv_need_int(r, line, &a->pos[2], "range() argument");
        }
        if (stp == 0) FAIL(r, line, "range() arg 3 must not be zero");
        double cnt = stp > 0 ? ((double)en - st) / stp : ((double)st - en) / -stp;
        if (cnt > MAX_RANGE) FAIL(r, line, "range too big, maximum size for range is %d", MAX_RANGE);
        tval l = tv_list(r, 0);
        for (int64_t i = st; stp > 0 ? i < en : i > en; i += stp) tv_list_push(r, l.u.l, v_int(i));
        return l;
    }
    case BI_NAMESPACE:
    case BI_DICT: {
        tval d = tv_dict(r, fn == BI_NAMESPACE ? TV_NS : TV_DICT);
        for (int k = 0; k < a->np; k++) {
            if (a->pos[k].t != TV_DICT) FAIL(r, line, "%s() takes keyword arguments or a dict", tv_bi_names[fn]);
            for (size_t i = 0; i < a->pos[k].u.d->n; i++) tv_dict_set(r, d.u.d, a->pos[k].u.d->k[i], a->pos[k].u.d->v[i]);
        }
        for (int k = 0; k < a->nk; k++) tv_dict_sets(r, d.u.d, a->kn[k], a->kv[k]);
        return d;
    }
    case BI_RAISE: {
        tval *m = tv_arg(a, 0, NULL);
        struct sb b = {0};
        if (m) tv_print(r, line, &b, *m, false);
        FAIL(r, 0, "%s", b.p ? b.p : "raise_exception() called");
    }
    case BI_STRFTIME: {
        tval f = tv_need_str(r, line, tv_arg(a, 0, NULL), "strftime_now() format");
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
    case TV_METHOD: return tmpl_call_method(r, line, fn.u.meth, a);
    case TV_UNDEF: tv_fail_undef(r, line, fn); break;
    default: break;
    }
    FAIL(r, line, "'%s' object is not callable", tv_type_name(fn));
}

static tval arith(struct R *r, int line, int op, tval a, tval b)
{
    if (a.t == TV_UNDEF) tv_fail_undef(r, line, a);
    if (b.t == TV_UNDEF) tv_fail_undef(r, line, b);
    if (op == OP_ADD) {
        if (a.t == TV_STR && b.t == TV_STR) {
            bool safe = a.safe || b.safe;
            if (safe) {
                /* Markup + str escapes the str (jinja2's markupsafe) */
                a = tmpl_html_escape(r, line, a);
                b = tmpl_html_escape(r, line, b);
            }
            char *p = tmpl_alloc(r->a, a.u.s.n + b.u.s.n + 1);
            memcpy(p, a.u.s.p, a.u.s.n);
            memcpy(p + a.u.s.n, b.u.s.p, b.u.s.n);
            tval res = v_str(p, a.u.s.n + b.u.s.n);
            res.safe = safe;
            return res;
        }
        if (a.t == TV_LIST && b.t == TV_LIST && !is_gen(a) && !is_gen(b) && (a.u.l->tuple != 0) == (b.u.l->tuple != 0)) {
            tval l = tv_list(r, a.u.l->n + b.u.l->n);
            for (size_t i = 0; i < a.u.l->n; i++) tv_list_push(r, l.u.l, a.u.l->v[i]);
            for (size_t i = 0; i < b.u.l->n; i++) tv_list_push(r, l.u.l, b.u.l->v[i]);
            l.u.l->tuple = a.u.l->tuple;
            return l;
        }
        if (a.t == TV_STR) FAIL(r, line, "can only concatenate str (not \"%s\") to str", tv_type_name(b));
    }
    if (op == OP_MUL && ((a.t == TV_STR && (b.t == TV_INT || b.t == TV_BOOL)) || (b.t == TV_STR && (a.t == TV_INT || a.t == TV_BOOL)))) {
        tval s = a.t == TV_STR ? a : b;
        int64_t n = a.t == TV_STR ? num_i(b) : num_i(a);
        if (n > 0 && s.u.s.n * (uint64_t)n > ((size_t)64 << 20)) FAIL(r, line, "string repetition too large");
        struct sb sbuf = {0};
        for (int64_t i = 0; i < n; i++) tv_sb_add(r, &sbuf, s.u.s.p, s.u.s.n);
        return sbuf.p ? v_sb(&sbuf) : v_str("", 0);
    }
    if (op == OP_MOD && a.t == TV_STR) {
        if (b.t == TV_LIST && b.u.l->tuple) return tmpl_percent_format(r, line, a, b.u.l->v, (int)b.u.l->n);
        return tmpl_percent_format(r, line, a, &b, 1);
    }
    if (!is_num(a) || !is_num(b))
        FAIL(r, line, "unsupported operand type(s) for arithmetic: '%s' and '%s'", tv_type_name(a), tv_type_name(b));
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
    case N_NAME: return tv_lookup(r, s, n->s, n->sn, n->line);
    case N_GETATTR: return tv_get_attr(r, n->line, eval(r, s, n->a), n->s, n->sn);
    case N_GETITEM: {
        tval o = eval(r, s, n->a);
        return tv_get_item(r, n->line, o, eval(r, s, n->b));
    }
    case N_SLICE: {
        tval o = eval(r, s, n->a);
        tval x, y, z;
        if (n->b) x = eval(r, s, n->b);
        if (n->c) y = eval(r, s, n->c);
        if (n->d) z = eval(r, s, n->d);
        return tv_slice(r, n->line, o, n->b ? &x : NULL, n->c ? &y : NULL, n->d ? &z : NULL);
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
        return tmpl_apply_filter(r, n->line, n->s, v, &a);
    }
    case N_TEST: {
        tval v = eval(r, s, n->a);
        struct args a;
        eval_args(r, s, n, &a, NULL);
        bool res;
        if (!tmpl_test_odd_even(r, n->line, n->s, v, &res)) res = tmpl_apply_test(r, n->line, n->s, v, &a);
        return v_bool(n->op ? !res : res);
    }
    case N_NEG:
    case N_POS: {
        tval v = eval(r, s, n->a);
        if (v.t == TV_UNDEF) tv_fail_undef(r, n->line, v);
        if (!is_num(v)) FAIL(r, n->line, "bad operand type for unary %c: '%s'", n->kind == N_NEG ? '-' : '+', tv_type_name(v));
        if (n->kind == N_POS) return v.t == TV_BOOL ? v_int(v.u.b) : v;
        if (v.t == TV_FLOAT) return v_float(-v.u.f);
        if (num_i(v) == INT64_MIN) FAIL(r, n->line, "integer overflow");
        return v_int(-num_i(v));
    }
    case N_NOT: return v_bool(!tv_truthy(eval(r, s, n->a)));
    case N_AND: {
        tval a = eval(r, s, n->a);
        return tv_truthy(a) ? eval(r, s, n->b) : a;
    }
    case N_OR: {
        tval a = eval(r, s, n->a);
        return tv_truthy(a) ? a : eval(r, s, n->b);
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
            case OP_EQ: ok = tv_eq(a, b); break;
            case OP_NE: ok = !tv_eq(a, b); break;
            case OP_LT: ok = tv_cmp(r, n->line, a, b) < 0; break;
            case OP_LE: ok = tv_cmp(r, n->line, a, b) <= 0; break;
            case OP_GT: ok = tv_cmp(r, n->line, a, b) > 0; break;
            case OP_GE: ok = tv_cmp(r, n->line, a, b) >= 0; break;
            case OP_IN: ok = tv_contains(r, n->line, b, a); break;
            default: ok = !tv_contains(r, n->line, b, a); break;
            }
            if (!ok) return v_bool(false);
            a = b;
        }
        return v_bool(true);
    }
    case N_CONCAT: {
        struct sb b = {0};
        for (int k = 0; k < n->nk; k++) tv_print(r, n->line, &b, eval(r, s, n->kids[k]), false);
        return b.p ? v_sb(&b) : v_str("", 0);
    }
    case N_COND:
        if (tv_truthy(eval(r, s, n->b))) return eval(r, s, n->a);
        return n->c ? eval(r, s, n->c) : v_undef("the conditional expression had no else branch");
    case N_LIST:
    case N_TUPLE: {
        tval l = tv_list(r, (size_t)n->nk);
        for (int k = 0; k < n->nk; k++) tv_list_push(r, l.u.l, eval(r, s, n->kids[k]));
        l.u.l->tuple = n->kind == N_TUPLE;
        return l;
    }
    case N_DICT: {
        tval d = tv_dict(r, TV_DICT);
        for (int k = 0; k < n->nk; k++) {
            tval key = eval(r, s, n->kids[k]);
            if (key.t == TV_LIST || key.t == TV_DICT || key.t == TV_NS || key.t == TV_UNDEF)
                FAIL(r, n->line, "unhashable type: '%s'", tv_type_name(key));
            tv_dict_set(r, d.u.d, key, eval(r, s, n->kids2[k]));
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
        tv_assign(r, s, names[0], v);
        return;
    }
    if (v.t == TV_UNDEF) tv_fail_undef(r, line, v);
    struct tlist *l = tv_iter_list(r, line, v);
    if ((int)l->n != nn)
        FAIL(r, line, "cannot unpack %zu values into %d names", l->n, nn);
    for (int k = 0; k < nn; k++) tv_assign(r, s, names[k], l->v[k]);
}

static int exec_for(struct R *r, struct scope *s, const struct tnode *n, struct sb *out)
{
    tval it = eval(r, s, n->a);
    if (it.t == TV_NONE || it.t == TV_INT || it.t == TV_FLOAT || it.t == TV_BOOL)
        FAIL(r, n->line, "'%s' object is not iterable", tv_type_name(it));
    struct tlist *items = tv_iter_list(r, n->line, it);
    /* the filter sees each item before the loop object exists */
    struct tlist *sel = items;
    if (n->b) {
        sel = tv_list(r, items->n).u.l;
        for (size_t i = 0; i < items->n; i++) {
            struct scope *fs = tv_scope_new(r, s);
            unpack(r, fs, n->line, n->names, n->nn, items->v[i]);
            if (tv_truthy(eval(r, fs, n->b))) tv_list_push(r, sel, items->v[i]);
        }
    }
    size_t len = sel->n;
    for (size_t i = 0; i < len; i++) {
        struct scope *ls = tv_scope_new(r, s);
        tval loop = tv_dict(r, TV_DICT);
        struct tdict *d = loop.u.d;
        tv_dict_sets(r, d, "index", v_int((int64_t)i + 1));
        tv_dict_sets(r, d, "index0", v_int((int64_t)i));
        tv_dict_sets(r, d, "revindex", v_int((int64_t)(len - i)));
        tv_dict_sets(r, d, "revindex0", v_int((int64_t)(len - i - 1)));
        tv_dict_sets(r, d, "first", v_bool(i == 0));
        tv_dict_sets(r, d, "last", v_bool(i + 1 == len));
        tv_dict_sets(r, d, "length", v_int((int64_t)len));
        tv_dict_sets(r, d, "depth", v_int(1));
        tv_dict_sets(r, d, "depth0", v_int(0));
        tv_dict_sets(r, d, "previtem", i ? sel->v[i - 1] : v_undef("there is no previous item"));
        tv_dict_sets(r, d, "nextitem", i + 1 < len ? sel->v[i + 1] : v_undef("there is no next item"));
        tv_dict_sets(r, d, "cycle", tv_method(r, loop, "cycle"));
        loop.t = TV_NS; /* attribute access reads keys; printing it is not supported anyway */
        tv_assign(r, ls, "loop", loop);
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
        tv_assign(r, s, target->s, v);
    } else if (target->kind == N_GETATTR) {
        tval ns = tv_lookup(r, s, target->a->s, strlen(target->a->s), target->line);
        if (ns.t != TV_NS) FAIL(r, target->line, "can't assign attribute '%s' on a %s: only a namespace() can be changed", target->s, tv_type_name(ns));
        tv_dict_sets(r, ns.u.d, target->s, v);
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
        case N_TEXT: tv_sb_add(r, out, n->s, n->sn); break;
        case N_OUT: tv_print(r, n->line, out, eval(r, s, n->a), false); break;
        case N_IF: {
            int c = tv_truthy(eval(r, s, n->a)) ? exec_body(r, s, n->kids, n->nk, out) : exec_body(r, s, n->kids2, n->nk2, out);
            if (c) return c;
            break;
        }
        case N_FOR: exec_for(r, s, n, out); break;
        case N_SET: exec_set(r, s, n->a, eval(r, s, n->b)); break;
        case N_SETBLOCK: {
            struct sb b = {0};
            exec_body(r, tv_scope_new(r, s), n->kids, n->nk, &b);
            tval v = b.p ? v_sb(&b) : v_str("", 0);
            if (n->c) {
                /* apply the filter chain with the body as the innermost operand */
                const struct tnode *chain[32];
                int nc = 0;
                for (const struct tnode *f = n->c; f && nc < 32; f = f->a) chain[nc++] = f;
                for (int i = nc - 1; i >= 0; i--) {
                    struct args a;
                    eval_args(r, s, chain[i], &a, NULL);
                    v = tmpl_apply_filter(r, chain[i]->line, chain[i]->s, v, &a);
                }
            }
            exec_set(r, s, n->a, v);
            break;
        }
        case N_MACRO: {
            tval m = macro_value(r, s, n);
            m.u.m->name = n->s;
            tv_assign(r, s, n->s, m);
            break;
        }
        case N_CALLBLOCK: {
            tval caller = macro_value(r, s, n);
            const struct tnode *call = n->a;
            tval fn = eval(r, s, call->a);
            struct args a;
            eval_args(r, s, call, &a, NULL);
            if (fn.t != TV_MACRO) FAIL(r, n->line, "{%% call %%} needs a macro, not %s", tv_type_name(fn));
            struct tmacro m = *fn.u.m;
            m.caller = caller;
            tv_sb_add(r, out, "", 0);
            tval res = call_macro(r, n->line, &m, &a);
            tv_sb_add(r, out, res.u.s.p, res.u.s.n);
            break;
        }
        case N_FILTERBLOCK: {
            struct sb b = {0};
            exec_body(r, tv_scope_new(r, s), n->kids, n->nk, &b);
            tval v = b.p ? v_sb(&b) : v_str("", 0);
            const struct tnode *chain[32];
            int nc = 0;
            for (const struct tnode *f = n->c; f && nc < 32; f = f->a) chain[nc++] = f;
            for (int i = nc - 1; i >= 0; i--) {
                if (chain[i]->kind != N_FILTER) FAIL(r, n->line, "unsupported construct in a filter block");
                struct args a;
                eval_args(r, s, chain[i], &a, NULL);
                v = tmpl_apply_filter(r, chain[i]->line, chain[i]->s, v, &a);
            }
            tv_print(r, n->line, out, v, false);
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
    r.root = tv_scope_new(&r, NULL);
    if (ctx_json && ctx_len) {
        char jerr[128];
        if (json_parse(&d, ctx_json, ctx_len, jerr, sizeof jerr)) tmpl_fail(&a, 0, "template context: %s", jerr);
        have_doc = 1;
        if (!json_is_obj(&d, 0)) tmpl_fail(&a, 0, "template context must be a JSON object");
        tval ctx = tv_from_json(&r, &d, 0, 0);
        for (size_t i = 0; i < ctx.u.d->n; i++) tv_dict_set(&r, &r.root->vars, ctx.u.d->k[i], ctx.u.d->v[i]);
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

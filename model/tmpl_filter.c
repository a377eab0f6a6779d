/* tmpl_filter.c - the chat template engine's builtins on values: jinja2's
 * filters and tests (the names the parser accepts), the methods of str, list,
 * dict and loop objects, and Python's % and str.format formatting.
 * What the engine's files share is in tmpl_internal.h.
 */
#include <ctype.h>
#include <math.h>
#include <stdarg.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "tmpl_internal.h"

/* Python's `fmt % args` for %s %d %i %r %f %%. */
tval tmpl_percent_format(struct R *r, int line, tval fmt, tval *vals, int nv)
{
    struct sb b = {0};
    int k = 0;
    const char *p = fmt.u.s.p, *end = p + fmt.u.s.n;
    while (p < end) {
        if (*p != '%') { tv_sb_add(r, &b, p++, 1); continue; }
        p++;
        if (p >= end) FAIL(r, line, "incomplete format");
        char c = *p++;
        if (c == '%') { sb_puts(r, &b, "%"); continue; }
        if (k >= nv) FAIL(r, line, "not enough arguments for format string");
        tval v = vals[k++];
        if (c == 's') tv_print(r, line, &b, v, false);
        else if (c == 'r') tv_print(r, line, &b, v, true);
        else if (c == 'd' || c == 'i') {
            if (!is_num(v)) FAIL(r, line, "%%d format: a number is required, not %s", tv_type_name(v));
            tv_sb_printf(r, &b, "%lld", (long long)(v.t == TV_FLOAT ? (int64_t)v.u.f : num_i(v)));
        } else if (c == 'f') {
            if (!is_num(v)) FAIL(r, line, "%%f format: a number is required, not %s", tv_type_name(v));
            tv_sb_printf(r, &b, "%f", num_f(v));
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
        if (*p != '{') { tv_sb_add(r, &b, p++, 1); continue; }
        const char *q = memchr(p, '}', (size_t)(end - p));
        if (!q) FAIL(r, line, "str.format: single '{' encountered");
        size_t fl = (size_t)(q - p - 1);
        const char *f = p + 1;
        tval *v;
        if (!fl) v = tv_arg(a, auto_i++, NULL);
        else if (isdigit((unsigned char)f[0])) v = tv_arg(a, atoi(f), NULL);
        else {
            char name[64];
            snprintf(name, sizeof name, "%.*s", (int)(fl < 63 ? fl : 63), f);
            if (memchr(name, ':', strlen(name)) || memchr(name, '!', strlen(name)) || memchr(name, '.', strlen(name)))
                FAIL(r, line, "str.format: unsupported field '{%s}'", name);
            v = tv_arg(a, -1, name);
        }
        if (!v) FAIL(r, line, "str.format: missing argument for field %d", auto_i);
        tv_print(r, line, &b, *v, false);
        p = q + 1;
    }
    return b.p ? v_sb(&b) : v_str("", 0);
}

tval tmpl_call_method(struct R *r, int line, struct tmethod *m, struct args *a)
{
    tval self = m->self;
    const char *nm = m->name;
    if (self.t == TV_DICT && !strcmp(nm, "cycle")) {
        /* loop.cycle(a, b, ...) */
        tval *i0 = tv_dict_finds(self.u.d, "index0", 6);
        if (!a->np) FAIL(r, line, "no items for cycling given");
        return a->pos[(i0 ? i0->u.i : 0) % a->np];
    }
    if (tv_in_names(tv_mutators, nm, strlen(nm)) && !(self.t == TV_STR))
        FAIL(r, line, "unsupported construct: '%s.%s()' modifies a value (not allowed in the sandbox)", tv_type_name(self), nm);
    if (self.t == TV_STR) {
        if (!strcmp(nm, "strip") || !strcmp(nm, "lstrip") || !strcmp(nm, "rstrip")) {
            tval *c = tv_arg(a, 0, "chars");
            tval chars = c && c->t != TV_NONE ? tv_need_str(r, line, c, "strip chars") : v_none();
            return tv_str_strip(self, chars, nm[0] != 'r', nm[0] != 'l');
        }
        if (!strcmp(nm, "split") || !strcmp(nm, "rsplit")) {
            tval *sep = tv_arg(a, 0, "sep"), *mx = tv_arg(a, 1, "maxsplit");
            tval sp = sep && sep->t != TV_NONE ? tv_need_str(r, line, sep, "split separator") : v_none();
            if (sp.t == TV_STR && sp.u.s.n == 0) FAIL(r, line, "empty separator");
            int64_t maxs = mx ? tv_need_int(r, line, mx, "maxsplit") : -1;
            return nm[0] == 'r' ? tv_str_rsplit(r, self, sp, maxs) : tv_str_split(r, self, sp, maxs);
        }
        if (!strcmp(nm, "startswith") || !strcmp(nm, "endswith")) {
            tval *x = tv_arg(a, 0, NULL);
            if (!x) FAIL(r, line, "%s() takes at least 1 argument", nm);
            bool pre = nm[0] == 's';
            if (x->t == TV_LIST && x->u.l->tuple) {
                for (size_t i = 0; i < x->u.l->n; i++)
                    if (tv_str_affix(self, tv_need_str(r, line, &x->u.l->v[i], nm), pre)) return v_bool(true);
                return v_bool(false);
            }
            return v_bool(tv_str_affix(self, tv_need_str(r, line, x, nm), pre));
        }
        if (!strcmp(nm, "replace")) {
            tval o = tv_need_str(r, line, tv_arg(a, 0, NULL), "replace() argument 1");
            tval nw = tv_need_str(r, line, tv_arg(a, 1, NULL), "replace() argument 2");
            tval *c = tv_arg(a, 2, "count");
            return tv_str_replace(r, self, o, nw, c ? tv_need_int(r, line, c, "count") : -1);
        }
        if (!strcmp(nm, "upper")) return tv_str_case(r, self, 1);
        if (!strcmp(nm, "lower")) return tv_str_case(r, self, 0);
        if (!strcmp(nm, "capitalize")) return tv_str_case(r, self, 2);
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
            tval x = tv_need_str(r, line, tv_arg(a, 0, NULL), nm);
            if (!strcmp(nm, "count")) {
                if (!x.u.s.n) return v_int((int64_t)tv_cp_len(self.u.s.p, self.u.s.n) + 1);
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
            return v_int(h ? (int64_t)tv_cp_len(self.u.s.p, (size_t)(h - self.u.s.p)) : -1);
        }
        if (!strcmp(nm, "join")) {
            tval *x = tv_arg(a, 0, NULL);
            if (!x) FAIL(r, line, "join() takes exactly one argument");
            struct tlist *l = tv_iter_list(r, line, *x);
            struct sb b = {0};
            for (size_t i = 0; i < l->n; i++) {
                if (l->v[i].t != TV_STR) FAIL(r, line, "sequence item %zu: expected str instance, %s found", i, tv_type_name(l->v[i]));
                if (i) tv_sb_add(r, &b, self.u.s.p, self.u.s.n);
                tv_sb_add(r, &b, l->v[i].u.s.p, l->v[i].u.s.n);
            }
            return b.p ? v_sb(&b) : v_str("", 0);
        }
        if (!strcmp(nm, "format")) return brace_format(r, line, self, a);
        if (!strcmp(nm, "splitlines")) {
            tval l = tv_list(r, 0);
            const char *p = self.u.s.p, *end = p + self.u.s.n;
            while (p < end) {
                const char *q = p;
                while (q < end && *q != '\n' && *q != '\r') q++;
                tv_list_push(r, l.u.l, v_str(p, (size_t)(q - p)));
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
            tval *k = tv_arg(a, 0, NULL), *def = tv_arg(a, 1, NULL);
            if (!k) FAIL(r, line, "get expected at least 1 argument");
            tval *v = tv_dict_find(d, *k);
            return v ? *v : def ? *def : v_none();
        }
        if (!strcmp(nm, "copy")) {
            tval o = tv_dict(r, TV_DICT);
            for (size_t i = 0; i < d->n; i++) tv_dict_set(r, o.u.d, d->k[i], d->v[i]);
            return o;
        }
        tval l = tv_list(r, d->n);
        for (size_t i = 0; i < d->n; i++)
            tv_list_push(r, l.u.l, !strcmp(nm, "keys") ? d->k[i] : !strcmp(nm, "values") ? d->v[i] : tv_tuple2(r, d->k[i], d->v[i]));
        return l;
    }
    if (self.t == TV_LIST) {
        struct tlist *l = self.u.l;
        if (!strcmp(nm, "copy")) return tv_slice(r, line, self, NULL, NULL, NULL);
        tval *x = tv_arg(a, 0, NULL);
        if (!x) FAIL(r, line, "%s() takes exactly one argument", nm);
        int64_t c = 0;
        for (size_t i = 0; i < l->n; i++)
            if (tv_eq(l->v[i], *x)) {
                if (!strcmp(nm, "index")) return v_int((int64_t)i);
                c++;
            }
        if (!strcmp(nm, "index")) FAIL(r, line, "value is not in list");
        return v_int(c);
    }
    FAIL(r, line, "unsupported method '%s' on %s", nm, tv_type_name(self));
}


/* Attribute path "a.b.0" as jinja2's make_attrgetter walks it (getitem). */
static tval attr_path(struct R *r, int line, tval obj, tval path)
{
    if (path.t == TV_INT) return tv_get_item(r, line, obj, path);
    if (path.t != TV_STR) FAIL(r, line, "attribute must be a string");
    const char *p = path.u.s.p, *end = p + path.u.s.n;
    while (p <= end) {
        const char *q = memchr(p, '.', (size_t)(end - p));
        if (!q) q = end;
        tval key = v_str(p, (size_t)(q - p));
        bool digits = q > p;
        for (const char *c = p; c < q; c++) digits &= isdigit((unsigned char)*c) != 0;
        if (digits) key = v_int(strtoll(p, NULL, 10));
        obj = tv_get_item(r, line, obj, key);
        p = q + 1;
    }
    return obj;
}


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

bool tmpl_filter_known(const char *name) { return tv_in_names(filter_names, name, strlen(name)); }
bool tmpl_test_known(const char *name) { return tv_in_names(test_names, name, strlen(name)); }

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
    if (!tv_truthy(v)) return gen_result(tv_list(r, 0)); /* jinja2: `if value:` before iterating */
    struct tlist *l = tv_iter_list(r, line, v);
    tval out = tv_list(r, 0);
    int from = attr ? 1 : 0;
    tval *an = attr ? tv_arg(a, 0, NULL) : NULL;
    if (attr && !an) FAIL(r, line, "selectattr/rejectattr need an attribute name");
    tval *tn = tv_arg(a, from, NULL);
    if (tn && tn->t != TV_STR) FAIL(r, line, "test name must be a string");
    char tname[64] = "";
    if (tn) snprintf(tname, sizeof tname, "%.*s", (int)(tn->u.s.n < 63 ? tn->u.s.n : 63), tn->u.s.p);
    if (tn && !tmpl_test_known(tname)) FAIL(r, line, "unsupported test '%s'", tname);
    struct args ta = sub_args(a, from + 1);
    ta.nk = 0;
    for (size_t i = 0; i < l->n; i++) {
        tval x = attr ? attr_path(r, line, l->v[i], *an) : l->v[i];
        bool t = tn ? tmpl_apply_test(r, line, tname, x, &ta) : tv_truthy(x);
        if (t == keep) tv_list_push(r, out.u.l, l->v[i]);
    }
    return gen_result(out);
}

static int case_cmp(struct R *r, int line, tval a, tval b, bool cs)
{
    if (!cs && a.t == TV_STR && b.t == TV_STR) {
        a = tv_str_case(r, a, 0);
        b = tv_str_case(r, b, 0);
    }
    return tv_cmp(r, line, a, b);
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

tval tmpl_apply_filter(struct R *r, int line, const char *nm, tval v, struct args *a)
{
    if (!strcmp(nm, "safe")) {
        if (v.t != TV_STR) v = tv_to_str(r, line, v);
        v.safe = 1;
        return v;
    }
    if (!strcmp(nm, "string")) return tv_to_str(r, line, v);
    if (!strcmp(nm, "tojson")) {
        tval *ea = tv_arg(a, 0, "ensure_ascii"), *ind = tv_arg(a, 1, "indent"), *sep = tv_arg(a, 2, "separators"),
             *sk = tv_arg(a, 3, "sort_keys");
        struct jopt o = {.ascii = ea && tv_truthy(*ea), .sort = sk && tv_truthy(*sk)};
        if (ind && ind->t != TV_NONE) {
            if (ind->t == TV_STR) o.indent = tmpl_strndup(r->a, ind->u.s.p, ind->u.s.n);
            else {
                int64_t w = tv_need_int(r, line, ind, "tojson indent");
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
            o.item_sep = tmpl_strndup(r->a, tv_need_str(r, line, &sep->u.l->v[0], "separator").u.s.p, sep->u.l->v[0].u.s.n);
            o.key_sep = tmpl_strndup(r->a, tv_need_str(r, line, &sep->u.l->v[1], "separator").u.s.p, sep->u.l->v[1].u.s.n);
        }
        struct sb b = {0};
        tv_to_json(r, line, &b, v, &o, 0);
        return v_sb(&b);
    }
    if (!strcmp(nm, "length") || !strcmp(nm, "count")) return v_int(tv_len(r, line, v));
    if (!strcmp(nm, "default") || !strcmp(nm, "d")) {
        tval *def = tv_arg(a, 0, "default_value"), *b = tv_arg(a, 1, "boolean");
        bool use = v.t == TV_UNDEF || (b && tv_truthy(*b) && !tv_truthy(v));
        return use ? (def ? *def : v_str("", 0)) : v;
    }
    if (!strcmp(nm, "trim")) {
        tval s = tv_to_str(r, line, v);
        tval *c = tv_arg(a, 0, "chars");
        return tv_str_strip(s, c && c->t == TV_STR ? *c : v_none(), true, true);
    }
    if (!strcmp(nm, "upper")) return tv_str_case(r, tv_to_str(r, line, v), 1);
    if (!strcmp(nm, "lower")) return tv_str_case(r, tv_to_str(r, line, v), 0);
    if (!strcmp(nm, "capitalize")) return tv_str_case(r, tv_to_str(r, line, v), 2);
    if (!strcmp(nm, "title")) return tv_str_case(r, tv_to_str(r, line, v), 3);
    if (!strcmp(nm, "replace")) {
        tval s = tv_to_str(r, line, v);
        tval o = tv_to_str(r, line, *(tv_arg(a, 0, "old") ? tv_arg(a, 0, "old") : &(tval){.t = TV_UNDEF}));
        tval n2 = tv_to_str(r, line, *(tv_arg(a, 1, "new") ? tv_arg(a, 1, "new") : &(tval){.t = TV_UNDEF}));
        tval *c = tv_arg(a, 2, "count");
        return tv_str_replace(r, s, o, n2, c && c->t != TV_NONE ? tv_need_int(r, line, c, "count") : -1);
    }
    if (!strcmp(nm, "items")) {
        if (v.t == TV_UNDEF) return gen_result(tv_list(r, 0));
        if (v.t != TV_DICT) FAIL(r, line, "can only get item pairs from a mapping");
        tval l = tv_list(r, v.u.d->n);
        for (size_t i = 0; i < v.u.d->n; i++) tv_list_push(r, l.u.l, tv_tuple2(r, v.u.d->k[i], v.u.d->v[i]));
        return gen_result(l);
    }
    if (!strcmp(nm, "dictsort")) {
        if (v.t != TV_DICT) FAIL(r, line, "dictsort: a mapping is required");
        tval *cs = tv_arg(a, 0, "case_sensitive"), *by = tv_arg(a, 1, "by"), *rev = tv_arg(a, 2, "reverse");
        bool byval = by && by->t == TV_STR && key_eq(*by, "value", 5);
        size_t n = v.u.d->n;
        tval *keys = tmpl_alloc(r->a, (n + 1) * sizeof *keys), *vals = tmpl_alloc(r->a, (n + 1) * sizeof *vals);
        for (size_t i = 0; i < n; i++) {
            keys[i] = byval ? v.u.d->v[i] : v.u.d->k[i];
            vals[i] = tv_tuple2(r, v.u.d->k[i], v.u.d->v[i]);
        }
        stable_sort(r, line, keys, vals, n, cs && tv_truthy(*cs), rev && tv_truthy(*rev));
        tval l = tv_list(r, n);
        for (size_t i = 0; i < n; i++) tv_list_push(r, l.u.l, vals[i]);
        return l;
    }
    if (!strcmp(nm, "selectattr")) return filter_select(r, line, v, a, true, true);
    if (!strcmp(nm, "rejectattr")) return filter_select(r, line, v, a, true, false);
    if (!strcmp(nm, "select")) return filter_select(r, line, v, a, false, true);
    if (!strcmp(nm, "reject")) return filter_select(r, line, v, a, false, false);
    if (!strcmp(nm, "map")) {
        if (!tv_truthy(v)) return gen_result(tv_list(r, 0));
        struct tlist *l = tv_iter_list(r, line, v);
        tval out = tv_list(r, l->n);
        tval *at = tv_arg(a, -1, "attribute");
        if (at) {
            tval *def = tv_arg(a, -1, "default");
            for (size_t i = 0; i < l->n; i++) {
                tval x = attr_path(r, line, l->v[i], *at);
                if (x.t == TV_UNDEF && def) x = *def;
                tv_list_push(r, out.u.l, x);
            }
        } else {
            tval fname = tv_need_str(r, line, tv_arg(a, 0, NULL), "map filter name");
            char fn[64];
            snprintf(fn, sizeof fn, "%.*s", (int)(fname.u.s.n < 63 ? fname.u.s.n : 63), fname.u.s.p);
            if (!tmpl_filter_known(fn)) FAIL(r, line, "unsupported filter '%s'", fn);
            struct args fa = sub_args(a, 1);
            for (size_t i = 0; i < l->n; i++) tv_list_push(r, out.u.l, tmpl_apply_filter(r, line, fn, l->v[i], &fa));
        }
        return gen_result(out);
    }
    if (!strcmp(nm, "join")) {
        struct tlist *l = tv_iter_list(r, line, v);
        tval *d = tv_arg(a, 0, "d"), *at = tv_arg(a, 1, "attribute");
        tval sep = d ? tv_to_str(r, line, *d) : v_str("", 0);
        struct sb b = {0};
        for (size_t i = 0; i < l->n; i++) {
            if (i) tv_sb_add(r, &b, sep.u.s.p, sep.u.s.n);
            tval x = at ? attr_path(r, line, l->v[i], *at) : l->v[i];
            tv_print(r, line, &b, x, false);
        }
        return b.p ? v_sb(&b) : v_str("", 0);
    }
    if (!strcmp(nm, "first") || !strcmp(nm, "last")) {
        if (v.t == TV_LIST && is_gen(v) && nm[0] == 'l') FAIL(r, line, "'generator' object is not reversible");
        struct tlist *l = tv_iter_list(r, line, v);
        if (!l->n) return v_undef("No first item, sequence was empty.");
        return nm[0] == 'f' ? l->v[0] : l->v[l->n - 1];
    }
    if (!strcmp(nm, "list")) {
        struct tlist *l = tv_iter_list(r, line, v);
        tval out = tv_list(r, l->n);
        for (size_t i = 0; i < l->n; i++) tv_list_push(r, out.u.l, l->v[i]);
        return out;
    }
    if (!strcmp(nm, "unique")) {
        struct tlist *l = tv_iter_list(r, line, v);
        tval *cs = tv_arg(a, 0, "case_sensitive"), *at = tv_arg(a, 1, "attribute");
        tval out = tv_list(r, 0), seen = tv_list(r, 0);
        for (size_t i = 0; i < l->n; i++) {
            tval k = at ? attr_path(r, line, l->v[i], *at) : l->v[i];
            if (k.t == TV_STR && !(cs && tv_truthy(*cs))) k = tv_str_case(r, k, 0);
            if (tv_contains(r, line, seen, k)) continue;
            tv_list_push(r, seen.u.l, k);
            tv_list_push(r, out.u.l, l->v[i]);
        }
        return gen_result(out);
    }
    if (!strcmp(nm, "reverse")) {
        if (v.t == TV_STR) {
            tval neg = v_int(-1);
            return tv_slice(r, line, v, NULL, NULL, &neg);
        }
        struct tlist *l = tv_iter_list(r, line, v);
        tval out = tv_list(r, l->n);
        for (size_t i = l->n; i > 0; i--) tv_list_push(r, out.u.l, l->v[i - 1]);
        return gen_result(out);
    }
    if (!strcmp(nm, "sort")) {
        struct tlist *l = tv_iter_list(r, line, v);
        tval *rev = tv_arg(a, 0, "reverse"), *cs = tv_arg(a, 1, "case_sensitive"), *at = tv_arg(a, 2, "attribute");
        tval *keys = tmpl_alloc(r->a, (l->n + 1) * sizeof *keys), *vals = tmpl_alloc(r->a, (l->n + 1) * sizeof *vals);
        for (size_t i = 0; i < l->n; i++) {
            keys[i] = at ? attr_path(r, line, l->v[i], *at) : l->v[i];
            vals[i] = l->v[i];
        }
        stable_sort(r, line, keys, vals, l->n, cs && tv_truthy(*cs), rev && tv_truthy(*rev));
        tval out = tv_list(r, l->n);
        for (size_t i = 0; i < l->n; i++) tv_list_push(r, out.u.l, vals[i]);
        return out;
    }
    if (!strcmp(nm, "int") || !strcmp(nm, "float") || !strcmp(nm, "bool")) {
        bool isint = nm[0] == 'i';
        if (nm[0] == 'b') return v_bool(tv_truthy(v));
        tval *def = tv_arg(a, 0, "default");
        tval dv = def ? *def : isint ? v_int(0) : v_float(0);
        if (v.t == TV_INT || v.t == TV_BOOL) return isint ? v_int(num_i(v)) : v_float((double)num_i(v));
        if (v.t == TV_FLOAT) return isint ? v_int((int64_t)v.u.f) : v;
        if (v.t == TV_STR) {
            char buf[128];
            tval t = tv_str_strip(v, v_none(), true, true);
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
        FAIL(r, line, "bad operand type for abs(): '%s'", tv_type_name(v));
    }
    if (!strcmp(nm, "round")) {
        tval *pr = tv_arg(a, 0, "precision"), *me = tv_arg(a, 1, "method");
        int64_t p = pr ? tv_need_int(r, line, pr, "round precision") : 0;
        if (!is_num(v)) FAIL(r, line, "round: a number is required, not %s", tv_type_name(v));
        double x = num_f(v), m = pow(10, (double)p);
        const char *tv_method = me && me->t == TV_STR ? me->u.s.p : "common";
        double y = !strncmp(tv_method, "ceil", 4) ? ceil(x * m) / m : !strncmp(tv_method, "floor", 5) ? floor(x * m) / m
                                                                                                 : nearbyint(x * m) / m;
        if (v.t != TV_FLOAT && !strncmp(tv_method, "common", 6)) return v_int((int64_t)y);
        return v_float(y);
    }
    if (!strcmp(nm, "indent")) {
        tval s = tv_to_str(r, line, v);
        tval *w = tv_arg(a, 0, "width"), *fi = tv_arg(a, 1, "first"), *bl = tv_arg(a, 2, "blank");
        tval ind;
        if (w && w->t == TV_STR) ind = *w;
        else {
            int64_t n = w ? tv_need_int(r, line, w, "indent width") : 4;
            if (n < 0) n = 0;
            if (n > 256) n = 256;
            char *sp = tmpl_alloc(r->a, (size_t)n + 1);
            memset(sp, ' ', (size_t)n);
            ind = v_str(sp, (size_t)n);
        }
        struct sb src = {0};
        tv_sb_add(r, &src, s.u.s.p, s.u.s.n);
        sb_puts(r, &src, "\n");
        tval lines = tmpl_call_method(r, line, tv_method(r, v_sb(&src), "splitlines").u.meth, &(struct args){0});
        struct tlist *L = lines.u.l;
        struct sb b = {0};
        if (fi && tv_truthy(*fi)) tv_sb_add(r, &b, ind.u.s.p, ind.u.s.n);
        for (size_t i = 0; i < L->n; i++) {
            if (i) sb_puts(r, &b, "\n");
            if (i && (L->v[i].u.s.n || (bl && tv_truthy(*bl)))) tv_sb_add(r, &b, ind.u.s.p, ind.u.s.n);
            tv_sb_add(r, &b, L->v[i].u.s.p, L->v[i].u.s.n);
        }
        return b.p ? v_sb(&b) : v_str("", 0);
    }
    if (!strcmp(nm, "sum")) {
        struct tlist *l = tv_iter_list(r, line, v);
        tval *at = tv_arg(a, 0, "attribute"), *st = tv_arg(a, 1, "start");
        tval acc = st ? *st : v_int(0);
        for (size_t i = 0; i < l->n; i++) {
            tval x = at ? attr_path(r, line, l->v[i], *at) : l->v[i];
            if (!is_num(acc) || !is_num(x)) FAIL(r, line, "sum: unsupported operand types");
            acc = acc.t == TV_FLOAT || x.t == TV_FLOAT ? v_float(num_f(acc) + num_f(x)) : v_int(num_i(acc) + num_i(x));
        }
        return acc;
    }
    if (!strcmp(nm, "min") || !strcmp(nm, "max")) {
        struct tlist *l = tv_iter_list(r, line, v);
        tval *cs = tv_arg(a, 0, "case_sensitive"), *at = tv_arg(a, 1, "attribute");
        if (!l->n) return v_undef("No aggregated item, sequence was empty.");
        size_t best = 0;
        for (size_t i = 1; i < l->n; i++) {
            tval x = at ? attr_path(r, line, l->v[i], *at) : l->v[i];
            tval y = at ? attr_path(r, line, l->v[best], *at) : l->v[best];
            int c = case_cmp(r, line, x, y, cs && tv_truthy(*cs));
            if (nm[1] == 'i' ? c < 0 : c > 0) best = i;
        }
        return l->v[best];
    }
    if (!strcmp(nm, "format")) {
        tval s = tv_to_str(r, line, v);
        if (a->nk) FAIL(r, line, "unsupported construct: format filter with keyword arguments");
        return tmpl_percent_format(r, line, s, a->pos, a->np);
    }
    if (!strcmp(nm, "e") || !strcmp(nm, "escape")) return tmpl_html_escape(r, line, v);
    if (!strcmp(nm, "attr")) {
        tval n = tv_need_str(r, line, tv_arg(a, 0, "name"), "attr name");
        return tv_get_attr(r, line, v, n.u.s.p, n.u.s.n);
    }
    if (!strcmp(nm, "wordcount")) {
        tval s = tv_to_str(r, line, v);
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
        tval s = tv_to_str(r, line, v);
        tval *w = tv_arg(a, 0, "width");
        int64_t width = w ? tv_need_int(r, line, w, "center width") : 80, len = (int64_t)tv_cp_len(s.u.s.p, s.u.s.n);
        if (width > 100000) width = 100000;
        if (width <= len) return s;
        int64_t pad = width - len, left = pad / 2 + (pad & width & 1);
        struct sb b = {0};
        for (int64_t i = 0; i < left; i++) sb_puts(r, &b, " ");
        tv_sb_add(r, &b, s.u.s.p, s.u.s.n);
        for (int64_t i = 0; i < pad - left; i++) sb_puts(r, &b, " ");
        return v_sb(&b);
    }
    FAIL(r, line, "unsupported filter '%s'", nm);
}

bool tmpl_apply_test(struct R *r, int line, const char *nm, tval v, struct args *a)
{
    tval *x = tv_arg(a, 0, NULL);
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
        tval c = tv_str_case(r, v, nm[0] == 'l' ? 0 : 1);
        return tv_eq(c, v);
    }
    if (!strcmp(nm, "filter")) return v.t == TV_STR && tmpl_filter_known(tmpl_strndup(r->a, v.u.s.p, v.u.s.n));
    if (!strcmp(nm, "test")) return v.t == TV_STR && tmpl_test_known(tmpl_strndup(r->a, v.u.s.p, v.u.s.n));
    if (!x) FAIL(r, line, "test '%s' needs an argument", nm);
    if (!strcmp(nm, "equalto") || !strcmp(nm, "eq")) return tv_eq(v, *x);
    if (!strcmp(nm, "ne")) return !tv_eq(v, *x);
    if (!strcmp(nm, "lt") || !strcmp(nm, "lessthan")) return tv_cmp(r, line, v, *x) < 0;
    if (!strcmp(nm, "le")) return tv_cmp(r, line, v, *x) <= 0;
    if (!strcmp(nm, "gt") || !strcmp(nm, "greaterthan")) return tv_cmp(r, line, v, *x) > 0;
    if (!strcmp(nm, "ge")) return tv_cmp(r, line, v, *x) >= 0;
    if (!strcmp(nm, "in")) return tv_contains(r, line, *x, v);
    if (!strcmp(nm, "sameas")) {
        if (v.t != x->t) return false;
        if (v.t == TV_NONE || v.t == TV_UNDEF) return true;
        if (v.t == TV_BOOL) return v.u.b == x->u.b;
        if (v.t == TV_INT) return v.u.i == x->u.i;
        return tv_eq(v, *x) && (v.t != TV_LIST || v.u.l == x->u.l) && (v.t != TV_DICT || v.u.d == x->u.d);
    }
    if (!strcmp(nm, "divisibleby")) {
        int64_t d = tv_need_int(r, line, x, "divisibleby argument");
        if (!d) FAIL(r, line, "integer division or modulo by zero");
        if (!is_num(v)) FAIL(r, line, "divisibleby: a number is required");
        return num_i(v) % d == 0;
    }
    FAIL(r, line, "unsupported test '%s'", nm);
}

bool tmpl_test_odd_even(struct R *r, int line, const char *nm, tval v, bool *res)
{
    if (strcmp(nm, "odd") && strcmp(nm, "even")) return false;
    if (!(v.t == TV_INT || v.t == TV_BOOL)) FAIL(r, line, "test '%s' needs an integer, not %s", nm, tv_type_name(v));
    *res = (num_i(v) % 2 != 0) == (nm[0] == 'o');
    return true;
}

tval tmpl_html_escape(struct R *r, int line, tval v)
{
    if (v.t == TV_STR && v.safe) return v;
    tval s = tv_to_str(r, line, v);
    struct sb b = {0};
    for (size_t i = 0; i < s.u.s.n; i++) {
        char c = s.u.s.p[i];
        if (c == '&') sb_puts(r, &b, "&amp;");
        else if (c == '<') sb_puts(r, &b, "&lt;");
        else if (c == '>') sb_puts(r, &b, "&gt;");
        else if (c == '"') sb_puts(r, &b, "&#34;");
        else if (c == '\'') sb_puts(r, &b, "&#39;");
        else tv_sb_add(r, &b, &c, 1);
    }
    tval o = b.p ? v_sb(&b) : v_str("", 0);
    o.safe = 1;
    return o;
}

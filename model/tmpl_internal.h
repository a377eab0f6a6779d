/* tmpl_internal.h - shared by the chat template engine's files
 * (tmpl_parse.c: lexer + parser; tmpl_value.c: values, printing, JSON,
 * strings, attribute access; tmpl_filter.c: filters, tests, methods;
 * template.c: evaluation, statements, public API).
 * Nothing outside model/template*.c and model/tmpl_*.c includes this.
 *
 * Memory: a template's AST lives in one arena owned by the model_tmpl; a
 * render's values live in a second arena freed when the render ends. Errors
 * unwind with longjmp to the public entry point (tmpl_fail), which is safe
 * because every allocation between the setjmp and the longjmp is in an arena
 * that the entry point frees.
 */
#ifndef SLUICE_TMPL_INTERNAL_H
#define SLUICE_TMPL_INTERNAL_H

#include <setjmp.h>
#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>
#include <string.h>

#include "base/json.h"

/* ---- arena + error unwinding ----------------------------------------------------- */

struct tmpl_chunk;
struct tmpl_arena {
    struct tmpl_chunk *head;
    size_t total, limit;      /* bytes handed out; a render past limit fails */
    jmp_buf *jb;              /* where tmpl_fail jumps */
    char *err;                /* message buffer of the entry point */
    size_t errlen;
};

void *tmpl_alloc(struct tmpl_arena *a, size_t n);          /* zeroed; fails (longjmp) past limit */
char *tmpl_strndup(struct tmpl_arena *a, const char *s, size_t n);
void tmpl_arena_free(struct tmpl_arena *a);
void tmpl_fail(struct tmpl_arena *a, int line, const char *fmt, ...)
    __attribute__((noreturn, format(printf, 3, 4)));

/* ---- values ------------------------------------------------------------------------ */

enum tv_type { TV_UNDEF, TV_NONE, TV_BOOL, TV_INT, TV_FLOAT, TV_STR, TV_LIST, TV_DICT, TV_NS,
               TV_MACRO, TV_BUILTIN, TV_METHOD };

struct tlist;
struct tdict;
struct tnode;
struct tmethod;
struct tmacro;

typedef struct tval {
    uint8_t t;
    uint8_t safe;     /* TV_STR: a jinja2 Markup (from |safe, |e): `+` escapes plain strings into it */
    union {
        bool b;
        int64_t i;
        double f;
        struct { const char *p; size_t n; } s;    /* TV_STR; TV_UNDEF: hint for messages */
        struct tlist *l;
        struct tdict *d;                          /* TV_DICT, TV_NS */
        struct tmacro *m;
        int fn;                                   /* TV_BUILTIN: index */
        struct tmethod *meth;
    } u;
} tval;

struct tlist { tval *v; size_t n, cap; bool tuple; bool gen; /* gen: a jinja2 generator */ };
struct tdict { tval *k, *v; size_t n, cap; };

/* ---- AST --------------------------------------------------------------------------- */

enum tn_kind {
    /* expressions */
    N_CONST, N_NAME, N_GETATTR, N_GETITEM, N_SLICE, N_CALL, N_FILTER, N_TEST, N_NEG, N_POS, N_NOT,
    N_AND, N_OR, N_BIN, N_CMP, N_CONCAT, N_COND, N_LIST, N_TUPLE, N_DICT,
    /* statements */
    N_TEXT, N_OUT, N_IF, N_FOR, N_SET, N_SETBLOCK, N_MACRO, N_CALLBLOCK, N_FILTERBLOCK, N_BREAK,
    N_CONTINUE, N_BODY,
};

/* One node shape for everything; the fields a kind uses are listed in tmpl_parse.c. */
struct tnode {
    int kind, line, op;
    struct tnode *a, *b, *c, *d;
    struct tnode **kids;  int nk;     /* items, body, positional args, compare operands */
    struct tnode **kids2; int nk2;    /* else body, kwarg values, dict values, defaults */
    const char **names;   int nn;     /* kwarg names, for/set targets, macro params */
    int *ops;                         /* N_CMP operators */
    const char *s; size_t sn;         /* text, name */
    tval v;                           /* N_CONST */
};

/* Operators (N_BIN op, N_CMP ops). */
enum { OP_ADD = 1, OP_SUB, OP_MUL, OP_DIV, OP_FLOORDIV, OP_MOD, OP_POW,
       OP_EQ, OP_NE, OP_LT, OP_LE, OP_GT, OP_GE, OP_IN, OP_NOTIN };

/* ---- render state (template.c, tmpl_value.c, tmpl_filter.c) ----------------------- */

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

/* A call's arguments: positional, then keyword names and values. */
struct args {
    tval *pos;
    int np;
    const char **kn;
    tval *kv;
    int nk;
};

/* json.dumps options (tojson). */
struct jopt {
    const char *indent;  /* NULL: none */
    const char *item_sep, *key_sep;
    bool ascii, sort;
};

enum { BI_RANGE, BI_NAMESPACE, BI_DICT, BI_RAISE, BI_STRFTIME, BI_COUNT };
extern const char *const tv_bi_names[BI_COUNT];

#define FAIL(r, line, ...) tmpl_fail((r)->a, (line), __VA_ARGS__)

/* ---- values, printing, JSON, scopes, strings, access (tmpl_value.c) ----------------- */

void tv_sb_add(struct R *r, struct sb *b, const char *s, size_t n);
void tv_sb_printf(struct R *r, struct sb *b, const char *fmt, ...) __attribute__((format(printf, 3, 4)));

static inline void sb_puts(struct R *r, struct sb *b, const char *s) { tv_sb_add(r, b, s, strlen(s)); }
static inline tval v_undef(const char *hint) { tval v = {.t = TV_UNDEF}; v.u.s.p = hint; v.u.s.n = hint ? strlen(hint) : 0; return v; }
static inline tval v_none(void) { return (tval){.t = TV_NONE}; }
static inline tval v_bool(bool b) { return (tval){.t = TV_BOOL, .u.b = b}; }
static inline tval v_int(int64_t i) { return (tval){.t = TV_INT, .u.i = i}; }
static inline tval v_float(double f) { return (tval){.t = TV_FLOAT, .u.f = f}; }
static inline tval v_str(const char *p, size_t n) { tval v = {.t = TV_STR}; v.u.s.p = p; v.u.s.n = n; return v; }
static inline tval v_sb(struct sb *b) { return v_str(b->p ? b->p : "", b->n); }
static inline tval v_cstr(const char *s) { return v_str(s, strlen(s)); }
static inline bool is_gen(tval v) { return v.t == TV_LIST && v.u.l->gen; }
static inline void mark_gen(tval *v) { v->u.l->gen = true; }
static inline bool is_num(tval v) { return v.t == TV_INT || v.t == TV_FLOAT || v.t == TV_BOOL; }
static inline double num_f(tval v) { return v.t == TV_FLOAT ? v.u.f : v.t == TV_INT ? (double)v.u.i : v.u.b; }
static inline int64_t num_i(tval v) { return v.t == TV_INT ? v.u.i : v.t == TV_BOOL ? v.u.b : (int64_t)v.u.f; }
static inline bool key_eq(tval a, const char *s, size_t n) { return a.t == TV_STR && a.u.s.n == n && !memcmp(a.u.s.p, s, n); }
static inline bool py_space(unsigned char c) { return c == ' ' || (c >= 9 && c <= 13) || (c >= 0x1c && c <= 0x1f); }

tval tv_list(struct R *r, size_t cap);
void tv_list_push(struct R *r, struct tlist *l, tval x);
tval tv_dict(struct R *r, int t);                       /* t: TV_DICT or TV_NS */
tval tv_tuple2(struct R *r, tval a, tval b);
tval *tv_dict_find(struct tdict *d, tval k);            /* NULL when absent */
tval *tv_dict_finds(struct tdict *d, const char *s, size_t n);
void tv_dict_set(struct R *r, struct tdict *d, tval k, tval v);
void tv_dict_sets(struct R *r, struct tdict *d, const char *k, tval v);
const char *tv_type_name(tval v);                        /* Python's type name, for messages */
bool tv_truthy(tval v);
bool tv_eq(tval a, tval b);
/* Python's a < b; fails on unorderable types. Returns -1, 0, 1. */
int tv_cmp(struct R *r, int line, tval a, tval b);
/* Python's str() (repr false) or repr() of v, appended to b. */
void tv_print(struct R *r, int line, struct sb *b, tval v, bool repr);
tval tv_to_str(struct R *r, int line, tval v);
tval tv_from_json(struct R *r, const json_doc *d, int i, int depth);
void tv_to_json(struct R *r, int line, struct sb *b, tval v, const struct jopt *o, int level);

struct scope *tv_scope_new(struct R *r, struct scope *parent);
tval tv_lookup(struct R *r, struct scope *s, const char *name, size_t n, int line);
void tv_assign(struct R *r, struct scope *s, const char *name, tval v);

/* Strings are UTF-8, measured in code points like Python. */
size_t tv_cp_len(const char *s, size_t n);
tval tv_str_strip(tval s, tval chars, bool left, bool right);
tval tv_str_case(struct R *r, tval s, int mode);          /* 0 lower, 1 upper, 2 capitalize, 3 title */
tval tv_str_replace(struct R *r, tval s, tval old, tval new, int64_t count);
tval tv_str_split(struct R *r, tval s, tval sep, int64_t maxsplit);
tval tv_str_rsplit(struct R *r, tval s, tval sep, int64_t maxsplit);
bool tv_str_affix(tval s, tval x, bool prefix);            /* startswith / endswith */

/* The items a for loop or a filter iterates over (a new or borrowed list). */
struct tlist *tv_iter_list(struct R *r, int line, tval v);
int64_t tv_len(struct R *r, int line, tval v);
bool tv_contains(struct R *r, int line, tval hay, tval needle);

extern const char *const tv_mutators[];                   /* list/dict methods that change their object */
int tv_in_names(const char *const *names, const char *s, size_t n);
tval tv_method(struct R *r, tval self, const char *name);  /* a bound method value */
void tv_fail_undef(struct R *r, int line, tval u) __attribute__((noreturn));
tval tv_get_attr(struct R *r, int line, tval obj, const char *name, size_t n);
tval tv_get_item(struct R *r, int line, tval obj, tval key);
tval tv_slice(struct R *r, int line, tval obj, tval *start, tval *stop, tval *step);

/* Argument i (positional, after any implicit operand) or keyword name; NULL when absent. */
tval *tv_arg(struct args *a, int i, const char *name);
tval tv_need_str(struct R *r, int line, tval *v, const char *what);
int64_t tv_need_int(struct R *r, int line, tval *v, const char *what);

/* ---- filters, tests, methods, formatting (tmpl_filter.c) --------------------------- */

/* Python's `fmt % args` for %s %d %i %r %f %%. */
tval tmpl_percent_format(struct R *r, int line, tval fmt, tval *vals, int nv);
/* A method of a str, list, dict or loop object (tv_method's value, called). */
tval tmpl_call_method(struct R *r, int line, struct tmethod *m, struct args *a);
tval tmpl_apply_filter(struct R *r, int line, const char *name, tval v, struct args *a);
bool tmpl_apply_test(struct R *r, int line, const char *name, tval v, struct args *a);
/* The odd/even tests, which need no arguments; false when nm is neither. */
bool tmpl_test_odd_even(struct R *r, int line, const char *nm, tval v, bool *res);
tval tmpl_html_escape(struct R *r, int line, tval v);

/* Parses a template into a N_BODY node allocated in a (which must have jb/err
 * set). Fails through tmpl_fail with the line and the construct. */
struct tnode *tmpl_parse_src(struct tmpl_arena *a, const char *src, size_t len);

/* Name tables the parser checks filters and tests against (tmpl_filter.c). */
bool tmpl_filter_known(const char *name);
bool tmpl_test_known(const char *name);

#endif

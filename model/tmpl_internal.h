/* tmpl_internal.h - shared by the chat template engine's files
 * (tmpl_parse.c: lexer + parser; template.c: values, evaluation, public API).
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

/* Parses a template into a N_BODY node allocated in a (which must have jb/err
 * set). Fails through tmpl_fail with the line and the construct. */
struct tnode *tmpl_parse_src(struct tmpl_arena *a, const char *src, size_t len);

/* Name tables the parser checks filters and tests against (template.c). */
bool tmpl_filter_known(const char *name);
bool tmpl_test_known(const char *name);

#endif

/* tmpl_parse.c - the chat template engine's lexer and parser: Jinja source
 * to an AST (tmpl_internal.h), as jinja2 does it with trim_blocks and
 * lstrip_blocks on (the HF transformers environment):
 *
 *   - newlines are normalized to \n and one trailing newline is dropped;
 *   - {%- / -%} (and {{- -}}, {#- -#}) strip all whitespace on that side;
 *   - trim_blocks: the first \n after a block or comment tag is removed;
 *   - lstrip_blocks: spaces and tabs from the start of a line to a block or
 *     comment tag are removed ({%+ turns it off);
 *   - {% raw %}...{% endraw %} is copied verbatim.
 *
 * Node fields by kind: N_TEXT s/sn; N_OUT a; N_IF a=cond kids=body kids2=else;
 * N_FOR names=targets a=iter b=filter kids=body kids2=else; N_SET a=target
 * b=value; N_SETBLOCK a=target kids=body c=filter (operand NULL); N_MACRO
 * s=name names=params kids2=defaults (NULL entries) kids=body; N_CALLBLOCK
 * a=call names/kids2=caller params kids=body; N_FILTERBLOCK c=filter kids=body;
 * expressions: N_CONST v; N_NAME s; N_GETATTR a s; N_GETITEM a b; N_SLICE a
 * b c d (start stop step, NULL when absent); N_CALL a kids (names, kids2 =
 * kwargs); N_FILTER a (NULL: the filter block's body) s kids names kids2;
 * N_TEST a s kids op=negated; N_NEG/N_POS/N_NOT a; N_AND/N_OR a b; N_BIN op
 * a b; N_CMP a kids ops; N_CONCAT kids; N_COND a=then b=cond c=else; N_LIST /
 * N_TUPLE kids; N_DICT kids=keys kids2=values.
 */
#include <ctype.h>
#include <stdarg.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "tmpl_internal.h"

/* ---- tokens -------------------------------------------------------------------------- */

enum tk { TK_TEXT, TK_VBEGIN, TK_VEND, TK_BBEGIN, TK_BEND, TK_NAME, TK_STR, TK_INT, TK_FLOAT, TK_OP, TK_EOF };

struct tok {
    int t, line;
    const char *s;   /* text, name, unescaped string, operator */
    size_t n;
    int64_t i;
    double f;
};

struct P {
    struct tmpl_arena *a;
    const char *src;
    size_t len;
    struct tok *tk;
    int n, cap, i;
    int depth;       /* nesting of expressions and statements (bounded) */
};

#define MAX_DEPTH 200

static void push(struct P *p, int t, int line, const char *s, size_t n)
{
    if (p->n == p->cap) {
        int nc = p->cap ? p->cap * 2 : 256;
        struct tok *t2 = tmpl_alloc(p->a, (size_t)nc * sizeof *t2);
        if (p->n) memcpy(t2, p->tk, (size_t)p->n * sizeof *t2);
        p->tk = t2;
        p->cap = nc;
    }
    struct tok *k = &p->tk[p->n++];
    memset(k, 0, sizeof *k);
    k->t = t;
    k->line = line;
    k->s = s;
    k->n = n;
}

static int is_ws(char c) { return c == ' ' || c == '\t' || c == '\n' || c == '\r' || c == '\f' || c == '\v'; }
static int is_name0(char c) { return isalpha((unsigned char)c) || c == '_'; }
static int is_name1(char c) { return isalnum((unsigned char)c) || c == '_'; }

static int count_nl(const char *s, size_t n)
{
    int c = 0;
    for (size_t i = 0; i < n; i++) c += s[i] == '\n';
    return c;
}

/* Appends one UTF-8 encoded code point. */
static size_t put_utf8(char *o, uint32_t c)
{
    if (c < 0x80) { o[0] = (char)c; return 1; }
    if (c < 0x800) { o[0] = (char)(0xC0 | c >> 6); o[1] = (char)(0x80 | (c & 63)); return 2; }
    if (c < 0x10000) {
        o[0] = (char)(0xE0 | c >> 12); o[1] = (char)(0x80 | (c >> 6 & 63)); o[2] = (char)(0x80 | (c & 63));
        return 3;
    }
    o[0] = (char)(0xF0 | c >> 18); o[1] = (char)(0x80 | (c >> 12 & 63));
    o[2] = (char)(0x80 | (c >> 6 & 63)); o[3] = (char)(0x80 | (c & 63));
    return 4;
}

static int hexval(char c)
{
    if (c >= '0' && c <= '9') return c - '0';
    if (c >= 'a' && c <= 'f') return c - 'a' + 10;
    if (c >= 'A' && c <= 'F') return c - 'A' + 10;
    return -1;
}

/* A string literal body, unescaped the way Python's unicode-escape codec does
 * (jinja2 decodes literals with it); unknown escapes stay as written. */
static void lex_string(struct P *p, size_t *pos, int line)
{
    const char *s = p->src;
    char q = s[*pos];
    size_t i = *pos + 1, start = i;
    while (i < p->len && s[i] != q) {
        if (s[i] == '\\' && i + 1 < p->len) i++;
        i++;
    }
    if (i >= p->len) tmpl_fail(p->a, line, "unterminated string literal");
    size_t n = i - start;
    char *o = tmpl_alloc(p->a, n * 2 + 8);
    size_t w = 0;
    for (size_t k = start; k < i; k++) {
        char c = s[k];
        if (c != '\\') { o[w++] = c; continue; }
        char e = s[++k];
        int digits = 0;
        switch (e) {
        case 'n': o[w++] = '\n'; break;
        case 't': o[w++] = '\t'; break;
        case 'r': o[w++] = '\r'; break;
        case '\\': o[w++] = '\\'; break;
        case '\'': o[w++] = '\''; break;
        case '"': o[w++] = '"'; break;
        case 'a': o[w++] = '\a'; break;
        case 'b': o[w++] = '\b'; break;
        case 'f': o[w++] = '\f'; break;
        case 'v': o[w++] = '\v'; break;
        case '\n': break; /* line continuation */
        case 'x': digits = 2; break;
        case 'u': digits = 4; break;
        case 'U': digits = 8; break;
        default:
            if (e >= '0' && e <= '7') {
                uint32_t v = 0;
                int m = 0;
                while (m < 3 && k < i && s[k] >= '0' && s[k] <= '7') v = v * 8 + (uint32_t)(s[k++] - '0'), m++;
                k--;
                w += put_utf8(o + w, v);
            } else {
                o[w++] = '\\';
                o[w++] = e;
            }
        }
        if (digits) {
            uint32_t v = 0;
            for (int m = 0; m < digits; m++) {
                int h = k + 1 + (size_t)m < i ? hexval(s[k + 1 + m]) : -1;
                if (h < 0) tmpl_fail(p->a, line, "malformed \\%c escape in a string literal", e);
                v = v * 16 + (uint32_t)h;
            }
            if (v > 0x10FFFF) tmpl_fail(p->a, line, "illegal Unicode escape in a string literal");
            k += (size_t)digits;
            w += put_utf8(o + w, v);
        }
    }
    o[w] = 0;
    push(p, TK_STR, line, o, w);
    *pos = i + 1;
}

/* Lexes the inside of a {{ }} or {% %} tag from *pos up to and including
 * its end; kind is '{' or '%'. Returns whether the end consumed a newline last
 * (jinja2's line_starting). */
static int lex_tag(struct P *p, size_t *pos, int *line, char kind)
{
    const char *s = p->src;
    size_t i = *pos;
    int bal = 0;
    char endc = kind == '{' ? '}' : '%';
    int start_line = *line;
    for (;;) {
        while (i < p->len && is_ws(s[i])) *line += s[i++] == '\n';
        if (i >= p->len)
            tmpl_fail(p->a, start_line, "unclosed %s tag", kind == '{' ? "'{{'" : "'{%'");
        if (bal == 0) {
            int minus = s[i] == '-' || s[i] == '+';
            size_t j = i + (size_t)minus;
            if (j + 1 < p->len && s[j] == endc && s[j + 1] == '}') {
                push(p, kind == '{' ? TK_VEND : TK_BEND, *line, NULL, 0);
                i = j + 2;
                int ls = 0;
                if (minus && s[i - 3] == '-') {
                    while (i < p->len && is_ws(s[i])) { ls = s[i] == '\n'; *line += ls; i++; }
                } else if (!minus && kind == '%' && i < p->len && s[i] == '\n') {
                    i++;
                    (*line)++;
                    ls = 1;
                }
                *pos = i;
                return ls;
            }
        }
        char c = s[i];
        if (c == '\'' || c == '"') {
            lex_string(p, &i, *line);
        } else if (isdigit((unsigned char)c)) {
            size_t st = i;
            while (i < p->len && (isdigit((unsigned char)s[i]) || s[i] == '_')) i++;
            int is_float = 0;
            bool after_dot = p->n > 0 && p->tk[p->n - 1].t == TK_OP && p->tk[p->n - 1].s[0] == '.' &&
                             st > 0 && s[st - 1] == '.';
            if (!after_dot && i + 1 < p->len && s[i] == '.' && isdigit((unsigned char)s[i + 1])) {
                is_float = 1;
                i++;
                while (i < p->len && (isdigit((unsigned char)s[i]) || s[i] == '_')) i++;
            }
            if (!after_dot && i < p->len && (s[i] == 'e' || s[i] == 'E')) {
                size_t k = i + 1;
                if (k < p->len && (s[k] == '+' || s[k] == '-')) k++;
                if (k < p->len && isdigit((unsigned char)s[k])) {
                    is_float = 1;
                    i = k;
                    while (i < p->len && isdigit((unsigned char)s[i])) i++;
                }
            }
            char buf[64];
            size_t w = 0;
            for (size_t k = st; k < i && w < sizeof buf - 1; k++)
                if (s[k] != '_') buf[w++] = s[k];
            buf[w] = 0;
            push(p, is_float ? TK_FLOAT : TK_INT, *line, s + st, i - st);
            if (is_float) p->tk[p->n - 1].f = strtod(buf, NULL);
            else {
                char *end;
                unsigned long long v = strtoull(buf, &end, 10);
                if (w > 18 && (v > INT64_MAX || w > 19)) tmpl_fail(p->a, *line, "integer literal too large");
                p->tk[p->n - 1].i = (int64_t)v;
            }
        } else if (is_name0(c)) {
            size_t st = i;
            while (i < p->len && is_name1(s[i])) i++;
            push(p, TK_NAME, *line, s + st, i - st);
        } else {
            static const char *const ops2[] = {"**", "//", "==", "!=", "<=", ">="};
            size_t n = 0;
            for (size_t k = 0; k < sizeof ops2 / sizeof *ops2; k++)
                if (i + 1 < p->len && s[i] == ops2[k][0] && s[i + 1] == ops2[k][1]) n = 2;
            if (!n && strchr("+-*/%~<>=.,:|()[]{}", c) && c) n = 1;
            if (!n) {
                if ((unsigned char)c < 0x20 || (unsigned char)c >= 0x7f)
                    tmpl_fail(p->a, *line, "unexpected character 0x%02x in a tag", (unsigned char)c);
                tmpl_fail(p->a, *line, "unexpected character '%c' in a tag", c);
            }
            if (c == '(' || c == '[' || c == '{') bal++;
            if ((c == ')' || c == ']' || c == '}') && bal > 0) bal--;
            push(p, TK_OP, *line, s + i, n);
            i += n;
        }
    }
}

static bool only_ws(const char *s, size_t n)
{
    for (size_t i = 0; i < n; i++)
        if (!is_ws(s[i])) return false;
    return true;
}

/* Matches {%[-+]? <ws> word <ws> [-+]?%} at s+i; returns the length or 0. */
static size_t match_tag_word(const char *s, size_t len, size_t i, const char *word)
{
    size_t k = i;
    if (k + 2 > len || s[k] != '{' || s[k + 1] != '%') return 0;
    k += 2;
    if (k < len && (s[k] == '-' || s[k] == '+')) k++;
    while (k < len && is_ws(s[k])) k++;
    size_t wl = strlen(word);
    if (k + wl > len || memcmp(s + k, word, wl) || (k + wl < len && is_name1(s[k + wl]))) return 0;
    k += wl;
    while (k < len && is_ws(s[k])) k++;
    if (k < len && (s[k] == '-' || s[k] == '+')) k++;
    if (k + 2 > len || s[k] != '%' || s[k + 1] != '}') return 0;
    return k + 2 - i;
}

static void emit_text(struct P *p, const char *s, size_t n, int line)
{
    if (n) push(p, TK_TEXT, line, s, n);
}

static void lex(struct P *p)
{
    const char *s = p->src;
    size_t pos = 0;
    int line = 1, line_starting = 1;
    while (pos < p->len) {
        size_t q = pos;
        while (q + 1 < p->len && !(s[q] == '{' && (s[q + 1] == '{' || s[q + 1] == '%' || s[q + 1] == '#'))) q++;
        if (q + 1 >= p->len) {
            emit_text(p, s + pos, p->len - pos, line);
            break;
        }
        const char *text = s + pos;
        size_t tn = q - pos;
        int text_line = line;
        line += count_nl(text, tn);
        char kind = s[q + 1];
        char sign = q + 2 < p->len && (s[q + 2] == '-' || s[q + 2] == '+') ? s[q + 2] : 0;
        if (sign == '-') {
            while (tn && is_ws(text[tn - 1])) tn--;
        } else if (sign != '+' && kind != '{') {
            size_t l = tn;
            while (l && text[l - 1] != '\n') l--;
            if ((l > 0 || line_starting) && tn > l && only_ws(text + l, tn - l)) tn = l;
        }
        size_t raw = kind == '%' ? match_tag_word(s, p->len, q, "raw") : 0;
        emit_text(p, text, tn, text_line);
        size_t i = q + 2 + (sign ? 1 : 0);
        if (raw) {
            /* the raw tag itself follows block rules: -%} strips, trim_blocks eats a \n */
            i = q + raw;
            if (s[i - 3] == '-') while (i < p->len && is_ws(s[i])) line += s[i++] == '\n';
            else if (s[i - 3] != '+' && i < p->len && s[i] == '\n') i++, line++;
            size_t e = i;
            size_t m = 0;
            while (e < p->len && !(m = match_tag_word(s, p->len, e, "endraw"))) e++;
            if (!m) tmpl_fail(p->a, line, "missing {%% endraw %%}");
            size_t body_n = e - i;
            if (s[e + 2] == '-') while (body_n && is_ws(s[i + body_n - 1])) body_n--;
            emit_text(p, s + i, body_n, line);
            line += count_nl(s + i, e - i);
            i = e + m;
            line_starting = 0;
            if (s[i - 3] == '-') {
                while (i < p->len && is_ws(s[i])) { line_starting = s[i] == '\n'; line += line_starting; i++; }
            } else if (s[i - 3] != '+' && i < p->len && s[i] == '\n') {
                i++, line++, line_starting = 1;
            }
            pos = i;
            continue;
        }
        if (kind == '#') {
            size_t e = i;
            while (e + 1 < p->len && !(s[e] == '#' && s[e + 1] == '}')) e++;
            if (e + 1 >= p->len) tmpl_fail(p->a, line, "unclosed comment");
            line += count_nl(s + i, e - i);
            char before = e > i ? s[e - 1] : 0;
            size_t k = e + 2;
            line_starting = 0;
            if (before == '-') {
                while (k < p->len && is_ws(s[k])) { line_starting = s[k] == '\n'; line += line_starting; k++; }
            } else if (before != '+' && k < p->len && s[k] == '\n') {
                k++, line++, line_starting = 1;
            }
            pos = k;
            continue;
        }
        push(p, kind == '{' ? TK_VBEGIN : TK_BBEGIN, line, NULL, 0);
        line_starting = lex_tag(p, &i, &line, kind);
        pos = i;
    }
    push(p, TK_EOF, line, NULL, 0);
}

/* ---- parser ------------------------------------------------------------------------- */

static struct tok *cur(struct P *p) { return &p->tk[p->i]; }
static struct tok *peekn(struct P *p, int k) { return &p->tk[p->i + k < p->n ? p->i + k : p->n - 1]; }

static bool is_op(struct tok *t, const char *op)
{
    return t->t == TK_OP && t->n == strlen(op) && !memcmp(t->s, op, t->n);
}

static bool is_name(struct tok *t, const char *name)
{
    return t->t == TK_NAME && t->n == strlen(name) && !memcmp(t->s, name, t->n);
}

static const char *tok_desc(struct P *p, struct tok *t)
{
    switch (t->t) {
    case TK_EOF: return "end of template";
    case TK_BEND: return "end of statement block";
    case TK_VEND: return "end of print statement";
    case TK_TEXT: return "template text";
    case TK_STR: return "string";
    default: break;
    }
    char *b = tmpl_alloc(p->a, 48);
    snprintf(b, 48, "'%.*s'", (int)(t->n > 40 ? 40 : t->n), t->s ? t->s : "");
    return b;
}

static void expect_op(struct P *p, const char *op)
{
    if (!is_op(cur(p), op)) tmpl_fail(p->a, cur(p)->line, "expected '%s', got %s", op, tok_desc(p, cur(p)));
    p->i++;
}

static void expect_bend(struct P *p)
{
    if (cur(p)->t != TK_BEND)
        tmpl_fail(p->a, cur(p)->line, "expected end of statement block, got %s", tok_desc(p, cur(p)));
    p->i++;
}

static const char *expect_name(struct P *p)
{
    struct tok *t = cur(p);
    if (t->t != TK_NAME) tmpl_fail(p->a, t->line, "expected a name, got %s", tok_desc(p, t));
    p->i++;
    return tmpl_strndup(p->a, t->s, t->n);
}

static struct tnode *mk(struct P *p, int kind, int line)
{
    struct tnode *n = tmpl_alloc(p->a, sizeof *n);
    n->kind = kind;
    n->line = line;
    return n;
}

/* A growable node list in the arena. */
struct nl { struct tnode **v; int n, cap; const char **names; };

static void nl_add(struct P *p, struct nl *l, struct tnode *x, const char *name)
{
    if (l->n == l->cap) {
        int nc = l->cap ? l->cap * 2 : 4;
        struct tnode **v = tmpl_alloc(p->a, (size_t)nc * sizeof *v);
        const char **nm = tmpl_alloc(p->a, (size_t)nc * sizeof *nm);
        if (l->n) {
            memcpy(v, l->v, (size_t)l->n * sizeof *v);
            memcpy(nm, l->names, (size_t)l->n * sizeof *nm);
        }
        l->v = v;
        l->names = nm;
        l->cap = nc;
    }
    l->names[l->n] = name;
    l->v[l->n++] = x;
}

static struct tnode *parse_expr(struct P *p, bool condexpr);
static struct tnode *parse_unary(struct P *p, bool with_filter);
static struct tnode *parse_tuple(struct P *p, bool condexpr, bool explicit_parens);

static void enter(struct P *p)
{
    if (++p->depth > MAX_DEPTH) tmpl_fail(p->a, cur(p)->line, "template nested too deeply");
}

/* (args, name=kwargs) after '(' has been seen: fills kids/nk and names/kids2. */
static void parse_args(struct P *p, struct tnode *n)
{
    expect_op(p, "(");
    struct nl pos = {0}, kw = {0};
    while (!is_op(cur(p), ")")) {
        if (pos.n + kw.n) expect_op(p, ",");
        if (is_op(cur(p), ")")) break;
        if (is_op(cur(p), "*") || is_op(cur(p), "**"))
            tmpl_fail(p->a, cur(p)->line, "unsupported construct: *args / **kwargs in a call");
        if (cur(p)->t == TK_NAME && is_op(peekn(p, 1), "=")) {
            const char *name = expect_name(p);
            p->i++;
            nl_add(p, &kw, parse_expr(p, true), name);
        } else {
            if (kw.n) tmpl_fail(p->a, cur(p)->line, "positional argument after keyword argument");
            nl_add(p, &pos, parse_expr(p, true), NULL);
        }
    }
    p->i++;
    n->kids = pos.v;
    n->nk = pos.n;
    n->kids2 = kw.v;
    n->nk2 = kw.n;
    n->names = kw.names;
    n->nn = kw.n;
}

static struct tnode *parse_primary(struct P *p)
{
    struct tok *t = cur(p);
    struct tnode *n;
    switch (t->t) {
    case TK_NAME:
        p->i++;
        n = mk(p, N_CONST, t->line);
        if (is_name(t, "true") || is_name(t, "True")) n->v = (tval){.t = TV_BOOL, .u.b = true};
        else if (is_name(t, "false") || is_name(t, "False")) n->v = (tval){.t = TV_BOOL, .u.b = false};
        else if (is_name(t, "none") || is_name(t, "None")) n->v = (tval){.t = TV_NONE};
        else {
            n->kind = N_NAME;
            n->s = tmpl_strndup(p->a, t->s, t->n);
            n->sn = t->n;
        }
        return n;
    case TK_STR: {
        /* adjacent literals concatenate */
        size_t total = 0;
        int k = p->i;
        while (p->tk[k].t == TK_STR) total += p->tk[k++].n;
        char *s = tmpl_alloc(p->a, total + 1);
        size_t w = 0;
        while (cur(p)->t == TK_STR) {
            memcpy(s + w, cur(p)->s, cur(p)->n);
            w += cur(p)->n;
            p->i++;
        }
        n = mk(p, N_CONST, t->line);
        n->v.t = TV_STR;
        n->v.u.s.p = s;
        n->v.u.s.n = w;
        return n;
    }
    case TK_INT:
        p->i++;
        n = mk(p, N_CONST, t->line);
        n->v = (tval){.t = TV_INT, .u.i = t->i};
        return n;
    case TK_FLOAT:
        p->i++;
        n = mk(p, N_CONST, t->line);
        n->v = (tval){.t = TV_FLOAT, .u.f = t->f};
        return n;
    case TK_OP:
        if (is_op(t, "(")) {
            p->i++;
            n = parse_tuple(p, true, true);
            expect_op(p, ")");
            return n;
        }
        if (is_op(t, "[")) {
            p->i++;
            n = mk(p, N_LIST, t->line);
            struct nl l = {0};
            while (!is_op(cur(p), "]")) {
                if (l.n) expect_op(p, ",");
                if (is_op(cur(p), "]")) break;
                nl_add(p, &l, parse_expr(p, true), NULL);
            }
            p->i++;
            n->kids = l.v;
            n->nk = l.n;
            return n;
        }
        if (is_op(t, "{")) {
            p->i++;
            n = mk(p, N_DICT, t->line);
            struct nl k = {0}, v = {0};
            while (!is_op(cur(p), "}")) {
                if (k.n) expect_op(p, ",");
                if (is_op(cur(p), "}")) break;
                nl_add(p, &k, parse_expr(p, true), NULL);
                expect_op(p, ":");
                nl_add(p, &v, parse_expr(p, true), NULL);
            }
            p->i++;
            n->kids = k.v;
            n->nk = k.n;
            n->kids2 = v.v;
            n->nk2 = v.n;
            return n;
        }
        break;
    default: break;
    }
    tmpl_fail(p->a, t->line, "unexpected %s in an expression", tok_desc(p, t));
}

/* Parses [a], [a:b:c] after '['. */
static struct tnode *parse_subscript(struct P *p, struct tnode *obj)
{
    int line = cur(p)->line;
    expect_op(p, "[");
    struct tnode *parts[3] = {NULL, NULL, NULL};
    int np = 0;
    bool slice = false;
    for (;;) {
        if (!is_op(cur(p), ":") && !is_op(cur(p), "]")) parts[np] = parse_expr(p, true);
        if (is_op(cur(p), ":")) {
            slice = true;
            if (++np > 2) tmpl_fail(p->a, line, "too many ':' in a slice");
            p->i++;
            continue;
        }
        break;
    }
    expect_op(p, "]");
    struct tnode *n;
    if (slice) {
        n = mk(p, N_SLICE, line);
        n->b = parts[0];
        n->c = parts[1];
        n->d = parts[2];
    } else {
        if (!parts[0]) tmpl_fail(p->a, line, "expected an expression in '[]'");
        n = mk(p, N_GETITEM, line);
        n->b = parts[0];
    }
    n->a = obj;
    return n;
}

static struct tnode *parse_postfix(struct P *p, struct tnode *n)
{
    for (;;) {
        struct tok *t = cur(p);
        if (is_op(t, ".")) {
            p->i++;
            struct tok *a = cur(p);
            if (a->t == TK_NAME) {
                struct tnode *g = mk(p, N_GETATTR, a->line);
                g->a = n;
                g->s = tmpl_strndup(p->a, a->s, a->n);
                g->sn = a->n;
                p->i++;
                n = g;
            } else if (a->t == TK_INT) {
                struct tnode *g = mk(p, N_GETITEM, a->line);
                g->a = n;
                g->b = mk(p, N_CONST, a->line);
                g->b->v = (tval){.t = TV_INT, .u.i = a->i};
                p->i++;
                n = g;
            } else {
                tmpl_fail(p->a, a->line, "expected a name after '.', got %s", tok_desc(p, a));
            }
        } else if (is_op(t, "[")) {
            n = parse_subscript(p, n);
        } else if (is_op(t, "(")) {
            struct tnode *c = mk(p, N_CALL, t->line);
            c->a = n;
            parse_args(p, c);
            n = c;
        } else {
            return n;
        }
    }
}

/* name(.name)* for filters and tests. */
static const char *dotted_name(struct P *p)
{
    const char *name = expect_name(p);
    while (is_op(cur(p), ".") && peekn(p, 1)->t == TK_NAME) {
        p->i++;
        const char *more = expect_name(p);
        size_t l = strlen(name) + strlen(more) + 2;
        char *s = tmpl_alloc(p->a, l);
        snprintf(s, l, "%s.%s", name, more);
        name = s;
    }
    return name;
}

static struct tnode *parse_filter(struct P *p, struct tnode *operand)
{
    int line = cur(p)->line;
    const char *name = dotted_name(p);
    if (!tmpl_filter_known(name)) tmpl_fail(p->a, line, "unsupported filter '%s'", name);
    struct tnode *f = mk(p, N_FILTER, line);
    f->a = operand;
    f->s = name;
    f->sn = strlen(name);
    if (is_op(cur(p), "(")) parse_args(p, f);
    return f;
}

static struct tnode *parse_filter_expr(struct P *p, struct tnode *n)
{
    for (;;) {
        struct tok *t = cur(p);
        if (is_op(t, "|")) {
            p->i++;
            n = parse_filter(p, n);
        } else if (is_name(t, "is")) {
            p->i++;
            bool neg = false;
            if (is_name(cur(p), "not")) {
                neg = true;
                p->i++;
            }
            int line = cur(p)->line;
            const char *name = dotted_name(p);
            if (!tmpl_test_known(name)) tmpl_fail(p->a, line, "unsupported test '%s'", name);
            struct tnode *x = mk(p, N_TEST, line);
            x->a = n;
            x->s = name;
            x->sn = strlen(name);
            x->op = neg;
            struct tok *c = cur(p);
            if (is_op(c, "(")) {
                parse_args(p, x);
            } else if ((c->t == TK_NAME || c->t == TK_STR || c->t == TK_INT || c->t == TK_FLOAT ||
                        is_op(c, "(") || is_op(c, "[") || is_op(c, "{")) &&
                       !is_name(c, "else") && !is_name(c, "or") && !is_name(c, "and")) {
                /* `is divisibleby 3`, `is sameas none`: one argument without parentheses */
                struct tnode *arg = parse_postfix(p, parse_primary(p));
                x->kids = tmpl_alloc(p->a, sizeof *x->kids);
                x->kids[0] = arg;
                x->nk = 1;
            }
            n = x;
        } else if (is_op(t, "(")) {
            struct tnode *c = mk(p, N_CALL, t->line);
            c->a = n;
            parse_args(p, c);
            n = c;
        } else {
            return n;
        }
    }
}

static struct tnode *parse_unary(struct P *p, bool with_filter)
{
    enter(p);
    struct tok *t = cur(p);
    struct tnode *n;
    if (is_op(t, "-") || is_op(t, "+")) {
        p->i++;
        n = mk(p, is_op(t, "-") ? N_NEG : N_POS, t->line);
        n->a = parse_unary(p, false);
    } else {
        n = parse_primary(p);
    }
    n = parse_postfix(p, n);
    if (with_filter) n = parse_filter_expr(p, n);
    p->depth--;
    return n;
}

static struct tnode *binop(struct P *p, int op, struct tnode *a, struct tnode *b, int line)
{
    struct tnode *n = mk(p, N_BIN, line);
    n->op = op;
    n->a = a;
    n->b = b;
    return n;
}

static struct tnode *parse_pow(struct P *p)
{
    struct tnode *n = parse_unary(p, true);
    while (is_op(cur(p), "**")) {
        int line = cur(p)->line;
        p->i++;
        n = binop(p, OP_POW, n, parse_unary(p, true), line);
    }
    return n;
}

static struct tnode *parse_math2(struct P *p)
{
    struct tnode *n = parse_pow(p);
    for (;;) {
        struct tok *t = cur(p);
        int op = is_op(t, "*") ? OP_MUL : is_op(t, "/") ? OP_DIV : is_op(t, "//") ? OP_FLOORDIV
               : is_op(t, "%") ? OP_MOD : 0;
        if (!op) return n;
        p->i++;
        n = binop(p, op, n, parse_pow(p), t->line);
    }
}

static struct tnode *parse_concat(struct P *p)
{
    struct tnode *first = parse_math2(p);
    if (!is_op(cur(p), "~")) return first;
    struct tnode *n = mk(p, N_CONCAT, cur(p)->line);
    struct nl l = {0};
    nl_add(p, &l, first, NULL);
    while (is_op(cur(p), "~")) {
        p->i++;
        nl_add(p, &l, parse_math2(p), NULL);
    }
    n->kids = l.v;
    n->nk = l.n;
    return n;
}

static struct tnode *parse_math1(struct P *p)
{
    struct tnode *n = parse_concat(p);
    for (;;) {
        struct tok *t = cur(p);
        int op = is_op(t, "+") ? OP_ADD : is_op(t, "-") ? OP_SUB : 0;
        if (!op) return n;
        p->i++;
        n = binop(p, op, n, parse_concat(p), t->line);
    }
}

static struct tnode *parse_compare(struct P *p)
{
    struct tnode *first = parse_math1(p);
    struct nl l = {0};
    int ops[64];
    for (;;) {
        struct tok *t = cur(p);
        int op = is_op(t, "==") ? OP_EQ : is_op(t, "!=") ? OP_NE : is_op(t, "<") ? OP_LT
               : is_op(t, "<=") ? OP_LE : is_op(t, ">") ? OP_GT : is_op(t, ">=") ? OP_GE
               : is_name(t, "in") ? OP_IN : 0;
        if (!op && is_name(t, "not") && is_name(peekn(p, 1), "in")) {
            op = OP_NOTIN;
            p->i++;
        }
        if (!op) break;
        if (l.n == 64) tmpl_fail(p->a, t->line, "comparison chain too long");
        p->i++;
        ops[l.n] = op;
        nl_add(p, &l, parse_math1(p), NULL);
    }
    if (!l.n) return first;
    struct tnode *n = mk(p, N_CMP, first->line);
    n->a = first;
    n->kids = l.v;
    n->nk = l.n;
    n->ops = tmpl_alloc(p->a, (size_t)l.n * sizeof *n->ops);
    memcpy(n->ops, ops, (size_t)l.n * sizeof *ops);
    return n;
}

static struct tnode *parse_not(struct P *p)
{
    if (is_name(cur(p), "not")) {
        enter(p);
        struct tnode *n = mk(p, N_NOT, cur(p)->line);
        p->i++;
        n->a = parse_not(p);
        p->depth--;
        return n;
    }
    return parse_compare(p);
}

static struct tnode *parse_and(struct P *p)
{
    struct tnode *n = parse_not(p);
    while (is_name(cur(p), "and")) {
        struct tnode *x = mk(p, N_AND, cur(p)->line);
        p->i++;
        x->a = n;
        x->b = parse_not(p);
        n = x;
    }
    return n;
}

static struct tnode *parse_or(struct P *p)
{
    struct tnode *n = parse_and(p);
    while (is_name(cur(p), "or")) {
        struct tnode *x = mk(p, N_OR, cur(p)->line);
        p->i++;
        x->a = n;
        x->b = parse_and(p);
        n = x;
    }
    return n;
}

static struct tnode *parse_expr(struct P *p, bool condexpr)
{
    enter(p);
    struct tnode *n = parse_or(p);
    while (condexpr && is_name(cur(p), "if")) {
        struct tnode *c = mk(p, N_COND, cur(p)->line);
        p->i++;
        c->a = n;
        c->b = parse_or(p);
        if (is_name(cur(p), "else")) {
            p->i++;
            c->c = parse_expr(p, true);
        }
        n = c;
    }
    p->depth--;
    return n;
}

/* a, b, c -> N_TUPLE; a single expression without a comma stays itself
 * (unless parenthesized and empty: "()"). */
static struct tnode *parse_tuple(struct P *p, bool condexpr, bool explicit_parens)
{
    int line = cur(p)->line;
    struct nl l = {0};
    bool comma = false;
    for (;;) {
        if (l.n) {
            if (!is_op(cur(p), ",")) break;
            p->i++;
            comma = true;
        }
        struct tok *t = cur(p);
        if (t->t == TK_BEND || t->t == TK_VEND || is_op(t, ")") || is_name(t, "if") || is_name(t, "in"))
            break;
        nl_add(p, &l, parse_expr(p, condexpr), NULL);
    }
    if (l.n == 1 && !comma) return l.v[0];
    if (!l.n && !explicit_parens) tmpl_fail(p->a, line, "expected an expression, got %s", tok_desc(p, cur(p)));
    struct tnode *n = mk(p, N_TUPLE, line);
    n->kids = l.v;
    n->nk = l.n;
    return n;
}

/* ---- statements ----------------------------------------------------------------------- */

static struct tnode *parse_body(struct P *p, const char *const *stop, int open_line, const char *open_tag);

/* After {% NAME ...: is the current block's first word one of stop? */
static bool at_stop(struct P *p, const char *const *stop)
{
    if (cur(p)->t != TK_BBEGIN || !stop) return false;
    struct tok *t = peekn(p, 1);
    for (int k = 0; stop[k]; k++)
        if (is_name(t, stop[k])) return true;
    return false;
}

/* Consumes {% word %} (the stop tag the body ended on). */
static void end_tag(struct P *p, const char *word)
{
    p->i++; /* BBEGIN */
    if (!is_name(cur(p), word)) tmpl_fail(p->a, cur(p)->line, "expected {%% %s %%}", word);
    p->i++;
    expect_bend(p);
}

/* The rest of a block tag without alternatives: its %} opening, the body
 * into n's kids, the closing {% end %}. */
static void block_body(struct P *p, struct tnode *n, int line, const char *tag, const char *end)
{
    const char *const stop[] = {end, NULL};
    expect_bend(p);
    struct tnode *body = parse_body(p, stop, line, tag);
    n->kids = body->kids;
    n->nk = body->nk;
    end_tag(p, end);
}

static struct tnode *parse_if(struct P *p, int line)
{
    static const char *const stop[] = {"elif", "else", "endif", NULL};
    struct tnode *n = mk(p, N_IF, line);
    n->a = parse_tuple(p, true, false);
    expect_bend(p);
    struct tnode *body = parse_body(p, stop, line, "if");
    n->kids = body->kids;
    n->nk = body->nk;
    p->i++; /* BBEGIN */
    struct tok *t = cur(p);
    p->i++;
    if (is_name(t, "elif")) {
        struct tnode *e = parse_if(p, t->line);
        n->kids2 = tmpl_alloc(p->a, sizeof *n->kids2);
        n->kids2[0] = e;
        n->nk2 = 1;
    } else if (is_name(t, "else")) {
        static const char *const stop2[] = {"endif", NULL};
        expect_bend(p);
        struct tnode *eb = parse_body(p, stop2, line, "if");
        n->kids2 = eb->kids;
        n->nk2 = eb->nk;
        end_tag(p, "endif");
    } else {
        expect_bend(p);
    }
    return n;
}

static void parse_targets(struct P *p, struct tnode *n)
{
    struct nl l = {0};
    bool paren = is_op(cur(p), "(");
    if (paren) p->i++;
    for (;;) {
        nl_add(p, &l, NULL, expect_name(p));
        if (!is_op(cur(p), ",")) break;
        p->i++;
    }
    if (paren) expect_op(p, ")");
    n->names = l.names;
    n->nn = l.n;
}

static struct tnode *parse_for(struct P *p, int line)
{
    static const char *const stop[] = {"else", "endfor", NULL};
    struct tnode *n = mk(p, N_FOR, line);
    parse_targets(p, n);
    if (!is_name(cur(p), "in")) tmpl_fail(p->a, cur(p)->line, "expected 'in' in a for loop");
    p->i++;
    n->a = parse_tuple(p, false, false);
    if (is_name(cur(p), "if")) {
        p->i++;
        n->b = parse_expr(p, true);
    }
    if (is_name(cur(p), "recursive")) tmpl_fail(p->a, line, "unsupported construct: recursive for loop");
    expect_bend(p);
    struct tnode *body = parse_body(p, stop, line, "for");
    n->kids = body->kids;
    n->nk = body->nk;
    if (is_name(peekn(p, 1), "else")) {
        static const char *const stop2[] = {"endfor", NULL};
        end_tag(p, "else");
        struct tnode *eb = parse_body(p, stop2, line, "for");
        n->kids2 = eb->kids;
        n->nk2 = eb->nk;
    }
    end_tag(p, "endfor");
    return n;
}

static struct tnode *parse_set(struct P *p, int line)
{
    struct tnode *target;
    struct tok *t = cur(p);
    if (t->t == TK_NAME && is_op(peekn(p, 1), ".")) {
        target = mk(p, N_GETATTR, t->line);
        target->a = mk(p, N_NAME, t->line);
        target->a->s = expect_name(p);
        p->i++;
        target->s = expect_name(p);
    } else {
        target = mk(p, N_TUPLE, t->line);
        parse_targets(p, target);
        if (target->nn == 1) {
            target->kind = N_NAME;
            target->s = target->names[0];
        }
    }
    if (is_op(cur(p), "=")) {
        p->i++;
        struct tnode *n = mk(p, N_SET, line);
        n->a = target;
        n->b = parse_tuple(p, true, false);
        expect_bend(p);
        return n;
    }
    struct tnode *n = mk(p, N_SETBLOCK, line);
    if (target->kind != N_NAME) tmpl_fail(p->a, line, "a block set needs a single name");
    n->a = target;
    if (is_op(cur(p), "|")) {
        p->i++;
        n->c = parse_filter_expr(p, parse_filter(p, NULL));
    }
    block_body(p, n, line, "set", "endset");
    return n;
}

/* (a, b=default, ...) for macros and call blocks. */
static void parse_params(struct P *p, struct tnode *n)
{
    struct nl l = {0};
    expect_op(p, "(");
    while (!is_op(cur(p), ")")) {
        if (l.n) expect_op(p, ",");
        if (is_op(cur(p), ")")) break;
        const char *name = expect_name(p);
        struct tnode *def = NULL;
        if (is_op(cur(p), "=")) {
            p->i++;
            def = parse_expr(p, true);
        }
        nl_add(p, &l, def, name);
    }
    p->i++;
    n->names = l.names;
    n->nn = l.n;
    n->kids2 = l.v;
    n->nk2 = l.n;
}

static struct tnode *parse_macro(struct P *p, int line)
{
    struct tnode *n = mk(p, N_MACRO, line);
    n->s = expect_name(p);
    n->sn = strlen(n->s);
    parse_params(p, n);
    block_body(p, n, line, "macro", "endmacro");
    return n;
}

static struct tnode *parse_callblock(struct P *p, int line)
{
    struct tnode *n = mk(p, N_CALLBLOCK, line);
    if (is_op(cur(p), "(")) parse_params(p, n);
    n->a = parse_expr(p, true);
    if (n->a->kind != N_CALL) tmpl_fail(p->a, line, "expected a call in {%% call %%}");
    block_body(p, n, line, "call", "endcall");
    return n;
}

static struct tnode *parse_filterblock(struct P *p, int line)
{
    struct tnode *n = mk(p, N_FILTERBLOCK, line);
    n->c = parse_filter_expr(p, parse_filter(p, NULL));
    block_body(p, n, line, "filter", "endfilter");
    return n;
}

static struct tnode *parse_generation(struct P *p, int line)
{
    /* transformers' {% generation %} marks assistant text for masks; it renders its body */
    static const char *const stop[] = {"endgeneration", NULL};
    expect_bend(p);
    struct tnode *body = parse_body(p, stop, line, "generation");
    end_tag(p, "endgeneration");
    return body;
}

static struct tnode *parse_statement(struct P *p)
{
    int line = cur(p)->line;
    p->i++; /* BBEGIN */
    struct tok *t = cur(p);
    if (t->t != TK_NAME) tmpl_fail(p->a, t->line, "expected a tag name, got %s", tok_desc(p, t));
    p->i++;
    enter(p);
    struct tnode *n;
    if (is_name(t, "if")) n = parse_if(p, line);
    else if (is_name(t, "for")) n = parse_for(p, line);
    else if (is_name(t, "set")) n = parse_set(p, line);
    else if (is_name(t, "macro")) n = parse_macro(p, line);
    else if (is_name(t, "call")) n = parse_callblock(p, line);
    else if (is_name(t, "filter")) n = parse_filterblock(p, line);
    else if (is_name(t, "generation")) n = parse_generation(p, line);
    else if (is_name(t, "break") || is_name(t, "continue")) {
        n = mk(p, is_name(t, "break") ? N_BREAK : N_CONTINUE, line);
        expect_bend(p);
    } else {
        char name[48];
        snprintf(name, sizeof name, "%.*s", (int)(t->n > 40 ? 40 : t->n), t->s);
        static const char *const ends[] = {"endif", "endfor", "endset", "endmacro", "endcall", "endfilter",
                                           "elif", "else", "endgeneration", "endraw", NULL};
        for (int k = 0; ends[k]; k++)
            if (!strcmp(name, ends[k])) tmpl_fail(p->a, line, "unexpected {%% %s %%}", name);
        tmpl_fail(p->a, line, "unsupported tag '%s'", name);
    }
    p->depth--;
    return n;
}

/* Parses until a {% stop-word %} (left unconsumed) or, with stop NULL, the end. */
static struct tnode *parse_body(struct P *p, const char *const *stop, int open_line, const char *open_tag)
{
    struct tnode *body = mk(p, N_BODY, cur(p)->line);
    struct nl l = {0};
    for (;;) {
        struct tok *t = cur(p);
        if (t->t == TK_EOF) {
            if (stop) tmpl_fail(p->a, open_line, "'%s' block is never closed (missing {%% %s %%})", open_tag, stop[0]);
            break;
        }
        if (t->t == TK_TEXT) {
            struct tnode *x = mk(p, N_TEXT, t->line);
            x->s = t->s;
            x->sn = t->n;
            nl_add(p, &l, x, NULL);
            p->i++;
        } else if (t->t == TK_VBEGIN) {
            p->i++;
            struct tnode *x = mk(p, N_OUT, t->line);
            x->a = parse_tuple(p, true, false);
            if (cur(p)->t != TK_VEND)
                tmpl_fail(p->a, cur(p)->line, "expected end of print statement, got %s", tok_desc(p, cur(p)));
            p->i++;
            nl_add(p, &l, x, NULL);
        } else if (t->t == TK_BBEGIN) {
            if (at_stop(p, stop)) break;
            nl_add(p, &l, parse_statement(p), NULL);
        } else {
            tmpl_fail(p->a, t->line, "unexpected %s", tok_desc(p, t));
        }
    }
    body->kids = l.v;
    body->nk = l.n;
    return body;
}

struct tnode *tmpl_parse_src(struct tmpl_arena *a, const char *src, size_t len)
{
    struct P p = {.a = a};
    /* jinja2 normalizes \r\n and \r to \n and drops one trailing newline */
    char *s = tmpl_alloc(a, len + 1);
    size_t w = 0;
    for (size_t i = 0; i < len; i++) {
        if (src[i] == '\r') {
            s[w++] = '\n';
            if (i + 1 < len && src[i + 1] == '\n') i++;
        } else {
            s[w++] = src[i];
        }
    }
    if (w && s[w - 1] == '\n') w--;
    s[w] = 0;
    p.src = s;
    p.len = w;
    lex(&p);
    return parse_body(&p, NULL, 1, NULL);
}

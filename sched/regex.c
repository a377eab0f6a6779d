/* regex.c - regular expressions and the regular subset of GBNF compiled to a
 * DFA over bytes (sched.h, "guide"): the string patterns and formats of a
 * JSON schema, structured_outputs regex / choice / grammar.
 *
 * A pattern is parsed into a small tree, the tree into a Thompson NFA whose
 * edges carry a 256-bit byte set, and the NFA into a DFA by subset
 * construction; states that cannot reach an accepting state are pruned, so a
 * DFA state with a live transition always has a way to finish. The mask then
 * walks each candidate token's bytes through a table (256 next states per DFA
 * state) instead of asking pcre2 for a partial match per token: pcre2 would
 * rescan the whole output for each of the vocabulary's tokens at every step.
 *
 * Regex syntax (ECMAScript / Python, as JSON Schema and vLLM users write it):
 * | ( ) (?: ) (?P<n> ) (?<n> ), * + ? {n} {n,} {n,m} (lazy and possessive
 * forms match the same strings), . [...] [^...], \d \w \s \D \W \S, \n \t \r
 * \f \v \0 \xHH \uHHHH and escaped punctuation; ^ and $ only at the ends.
 * Matching is over UTF-8 bytes: '.' and negated classes take any multi-byte
 * UTF-8 character (their non-ASCII exclusions are not honoured); a range of
 * non-ASCII characters in a class is refused. Refused with the construct
 * named: lookaround, backreferences, \b \B, inline flags.
 *
 * Grammars are GBNF (llama.cpp's and xgrammar's EBNF: `name ::= ...`,
 * "literals", [classes], ( ), * + ? {m,n}, '.', # comments, root rule
 * "root"), restricted to the rules that refer to each other without a cycle:
 * such a grammar is a regular language and compiles to the same DFA. A
 * recursive rule is refused naming the rule.
 */
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "sched.h"

#define MAX_AST 32768
#define MAX_SETS 8192
#define MAX_NFA 200000
#define MAX_WORK 20000000L /* NFA states visited while building the DFA: well under a second's work */
#define RX_INF 0x7fffffff

enum { R_SET, R_CAT, R_ALT, R_REP, R_EMPTY };
struct rnode {
    uint8_t kind;
    int a, b;   /* CAT/ALT: children; REP: a */
    int lo, hi; /* REP: bounds (hi RX_INF: unbounded) */
    int set;    /* SET: index into sets */
};

struct rx {
    struct rnode *n;
    int nn;
    uint8_t (*set)[32];
    int nset;
    const char *p, *end; /* the pattern being parsed */
    char *err;
    size_t errlen;
    bool failed;
    /* GBNF */
    const char *src;
    struct rule {
        const char *name;
        int len;
        const char *body; /* after ::= */
        int node;         /* -1: not built; -2: being built */
    } *rules;
    int nrules;
};

static int fail(struct rx *r, const char *fmt, const char *what)
{
    if (!r->failed) snprintf(r->err, r->errlen, fmt, what);
    r->failed = true;
    return -1;
}

static int node(struct rx *r, int kind, int a, int b)
{
    if (r->failed) return -1;
    if (r->nn >= MAX_AST) return fail(r, "%s is too large", "the pattern");
    r->n[r->nn] = (struct rnode){.kind = (uint8_t)kind, .a = a, .b = b, .set = -1};
    return r->nn++;
}

static int new_set(struct rx *r)
{
    if (r->failed) return -1;
    if (r->nset >= MAX_SETS) return fail(r, "%s is too large", "the pattern");
    memset(r->set[r->nset], 0, 32);
    return r->nset++;
}

static void set_add(uint8_t *s, int lo, int hi)
{
    for (int c = lo; c <= hi; c++) s[c >> 3] |= (uint8_t)(1u << (c & 7));
}

static int set_node(struct rx *r, int lo, int hi)
{
    int s = new_set(r), k = node(r, R_SET, -1, -1);
    if (k < 0 || s < 0) return -1;
    set_add(r->set[s], lo, hi);
    r->n[k].set = s;
    return k;
}

static int cat(struct rx *r, int a, int b)
{
    if (a < 0) return b;
    if (b < 0) return a;
    return node(r, R_CAT, a, b);
}

static int alt(struct rx *r, int a, int b)
{
    if (a < 0) return b;
    if (b < 0) return a;
    return node(r, R_ALT, a, b);
}

static int rep(struct rx *r, int a, int lo, int hi)
{
    int k = node(r, R_REP, a, -1);
    if (k < 0) return -1;
    r->n[k].lo = lo, r->n[k].hi = hi;
    return k;
}

/* Any UTF-8 character of two to four bytes (lead byte, then continuations). */
static int multibyte(struct rx *r)
{
    int two = cat(r, set_node(r, 0xC2, 0xDF), set_node(r, 0x80, 0xBF));
    int three = cat(r, set_node(r, 0xE0, 0xEF), rep(r, set_node(r, 0x80, 0xBF), 2, 2));
    int four = cat(r, set_node(r, 0xF0, 0xF4), rep(r, set_node(r, 0x80, 0xBF), 3, 3));
    return alt(r, alt(r, two, three), four);
}

/* The UTF-8 bytes of code point cp as a sequence. */
static int codepoint(struct rx *r, uint32_t cp)
{
    uint8_t b[4];
    int n;
    if (cp < 0x80) b[0] = (uint8_t)cp, n = 1;
    else if (cp < 0x800) b[0] = (uint8_t)(0xC0 | cp >> 6), b[1] = (uint8_t)(0x80 | (cp & 63)), n = 2;
    else if (cp < 0x10000)
        b[0] = (uint8_t)(0xE0 | cp >> 12), b[1] = (uint8_t)(0x80 | (cp >> 6 & 63)), b[2] = (uint8_t)(0x80 | (cp & 63)),
        n = 3;
    else
        b[0] = (uint8_t)(0xF0 | cp >> 18), b[1] = (uint8_t)(0x80 | (cp >> 12 & 63)),
        b[2] = (uint8_t)(0x80 | (cp >> 6 & 63)), b[3] = (uint8_t)(0x80 | (cp & 63)), n = 4;
    int k = -1;
    for (int i = 0; i < n; i++) k = cat(r, k, set_node(r, b[i], b[i]));
    return k;
}

/* Decodes one UTF-8 character at r->p (advancing); invalid bytes are taken one at a time. */
static uint32_t utf8_next(struct rx *r)
{
    const uint8_t *s = (const uint8_t *)r->p;
    size_t left = (size_t)(r->end - r->p);
    uint32_t c = s[0];
    int n = c < 0x80 ? 1 : c >= 0xF0 ? 4 : c >= 0xE0 ? 3 : c >= 0xC0 ? 2 : 1;
    if ((size_t)n > left) n = 1;
    if (n > 1) {
        c &= 0x3Fu >> (n - 1);
        for (int i = 1; i < n; i++) c = c << 6 | (s[i] & 63);
    }
    r->p += n;
    return c;
}

static int hexval(char c)
{
    if (c >= '0' && c <= '9') return c - '0';
    if (c >= 'a' && c <= 'f') return c - 'a' + 10;
    if (c >= 'A' && c <= 'F') return c - 'A' + 10;
    return -1;
}

/* \d \w \s and their negations into an ASCII set; *neg_mb: the negation also
 * takes every multi-byte character. Returns false when e is not one of them. */
static bool class_escape(char e, uint8_t *s, bool *mb)
{
    uint8_t t[32] = {0};
    switch (e | 0x20) {
    case 'd': set_add(t, '0', '9'); break;
    case 'w': set_add(t, '0', '9'), set_add(t, 'a', 'z'), set_add(t, 'A', 'Z'), set_add(t, '_', '_'); break;
    case 's': set_add(t, ' ', ' '), set_add(t, '\t', '\r'); break;
    default: return false;
    }
    bool upper = e >= 'A' && e <= 'Z';
    for (int i = 0; i < 16; i++) s[i] |= upper ? (uint8_t)~t[i] : t[i]; /* ASCII half only */
    if (upper) *mb = true;
    return true;
}

/* One escaped character after '\' (r->p at the letter): its code point, or
 * -1 on error. Class escapes are handled by the callers. */
static long escape_char(struct rx *r)
{
    if (r->p >= r->end) return fail(r, "%s", "the pattern ends with a lone backslash");
    char e = *r->p++;
    switch (e) {
    case 'n': return '\n';
    case 't': return '\t';
    case 'r': return '\r';
    case 'f': return '\f';
    case 'v': return '\v';
    case '0': return 0;
    case 'x':
    case 'u': {
        int n = e == 'x' ? 2 : 4;
        long v = 0;
        for (int i = 0; i < n; i++) {
            int h = r->p < r->end ? hexval(*r->p) : -1;
            if (h < 0) return fail(r, "a bad \\%s escape in the pattern", e == 'x' ? "x" : "u");
            v = v * 16 + h;
            r->p++;
        }
        return v;
    }
    case 'b': case 'B': return fail(r, "%s (word boundaries) is not supported in patterns", "\\b");
    default:
        if (e >= '1' && e <= '9') return fail(r, "%s (backreferences) are not supported in patterns", "\\1");
        if ((e >= 'a' && e <= 'z') || (e >= 'A' && e <= 'Z')) {
            char what[3] = {'\\', e, 0};
            return fail(r, "the escape %s is not supported in patterns", what);
        }
        return (unsigned char)e;
    }
}

/* [...] at r->p (after '['); end: the closing byte (']'). */
static int char_class(struct rx *r)
{
    int s = new_set(r);
    if (s < 0) return -1;
    uint8_t *set = r->set[s];
    bool neg = false, mb = false;
    int extra = -1; /* non-ASCII members, as sequences */
    if (r->p < r->end && *r->p == '^') neg = true, r->p++;
    bool first = true;
    while (r->p < r->end && (*r->p != ']' || first)) {
        first = false;
        long lo;
        if (*r->p == '\\') {
            r->p++;
            if (r->p >= r->end) break;
            if (class_escape(*r->p, set, &mb)) {
                r->p++;
                continue;
            }
            if ((lo = escape_char(r)) < 0) return -1;
        } else if (*r->p == '[' && r->p + 1 < r->end && r->p[1] == ':') {
            return fail(r, "%s (POSIX classes) are not supported in patterns", "[:name:]");
        } else {
            lo = (long)utf8_next(r);
        }
        long hi = lo;
        if (r->p + 1 < r->end && *r->p == '-' && r->p[1] != ']') {
            r->p++;
            if (*r->p == '\\') {
                r->p++;
                if ((hi = escape_char(r)) < 0) return -1;
            } else {
                hi = (long)utf8_next(r);
            }
            if (hi < lo) return fail(r, "%s: a range ends before it starts", "the character class");
        }
        if (hi < 0x80) {
            set_add(set, (int)lo, (int)hi);
        } else {
            if (lo < 0x80) set_add(set, (int)lo, 0x7F), lo = 0x80;
            if (hi - lo > 256) return fail(r, "%s: a range of non-ASCII characters wider than 256 is not supported",
                                           "the character class");
            for (long c = lo; c <= hi; c++) extra = alt(r, extra, codepoint(r, (uint32_t)c));
        }
    }
    if (r->p >= r->end) return fail(r, "%s is not closed", "a character class '['");
    r->p++; /* ] */
    int k = node(r, R_SET, -1, -1);
    if (k < 0) return -1;
    if (neg) {
        for (int i = 0; i < 16; i++) set[i] = (uint8_t)~set[i];
        memset(set + 16, 0, 16);
        mb = !mb;
        extra = -1;
    }
    r->n[k].set = s;
    if (mb) k = alt(r, k, multibyte(r));
    return alt(r, k, extra);
}

static int parse_alt(struct rx *r, int depth);

/* {n}, {n,}, {n,m} at r->p (after '{'); false when it is not a quantifier. */
static bool braces(struct rx *r, int *lo, int *hi)
{
    const char *p = r->p;
    long a = 0, b;
    int nd = 0;
    while (p < r->end && *p >= '0' && *p <= '9' && nd < 7) a = a * 10 + (*p++ - '0'), nd++;
    if (!nd) return false;
    b = a;
    if (p < r->end && *p == ',') {
        p++;
        b = RX_INF;
        int md = 0;
        long m = 0;
        while (p < r->end && *p >= '0' && *p <= '9' && md < 7) m = m * 10 + (*p++ - '0'), md++;
        if (md) b = m;
    }
    if (p >= r->end || *p != '}') return false;
    r->p = p + 1;
    *lo = (int)a, *hi = (int)b;
    return true;
}

static int quantified(struct rx *r, int atom)
{
    while (r->p < r->end && !r->failed) {
        int lo, hi;
        char c = *r->p;
        if (c == '*') lo = 0, hi = RX_INF, r->p++;
        else if (c == '+') lo = 1, hi = RX_INF, r->p++;
        else if (c == '?') lo = 0, hi = 1, r->p++;
        else if (c == '{') {
            r->p++;
            if (!braces(r, &lo, &hi)) {
                r->p--;
                return atom;
            }
            if (hi < lo || lo > 1000 || (hi != RX_INF && hi > 1000))
                return fail(r, "%s must be at most 1000 and in order", "a {m,n} repetition");
        } else break;
        if (r->p < r->end && (*r->p == '?' || *r->p == '+')) r->p++; /* lazy / possessive: same strings */
        atom = rep(r, atom, lo, hi);
    }
    return atom;
}

static int parse_atom(struct rx *r, int depth)
{
    char c = *r->p;
    switch (c) {
    case '(': {
        r->p++;
        if (r->p < r->end && *r->p == '?') {
            r->p++;
            if (r->p < r->end && *r->p == ':') r->p++;
            else if (r->p < r->end && (*r->p == 'P' || *r->p == '<') &&
                     !(r->p[0] == '<' && r->p + 1 < r->end && (r->p[1] == '=' || r->p[1] == '!'))) {
                while (r->p < r->end && *r->p != '>') r->p++;
                if (r->p < r->end) r->p++;
            } else if (r->p < r->end && (*r->p == '=' || *r->p == '!' || *r->p == '<')) {
                return fail(r, "%s (lookaround) is not supported in patterns", "(?=...)");
            } else {
                return fail(r, "%s (inline flags) are not supported in patterns", "(?flags)");
            }
        }
        int k = parse_alt(r, depth + 1);
        if (r->failed) return -1;
        if (r->p >= r->end || *r->p != ')') return fail(r, "%s", "unbalanced parentheses in the pattern");
        r->p++;
        return k < 0 ? node(r, R_EMPTY, -1, -1) : k;
    }
    case '[':
        r->p++;
        return char_class(r);
    case '.': {
        r->p++;
        int k = set_node(r, 0, 0x7F);
        if (k < 0) return -1;
        r->set[r->n[k].set]['\n' >> 3] &= (uint8_t)~(1u << ('\n' & 7));
        return alt(r, k, multibyte(r));
    }
    case '\\': {
        r->p++;
        if (r->p >= r->end) return fail(r, "%s", "the pattern ends with a lone backslash");
        int s = new_set(r);
        if (s < 0) return -1;
        bool mb = false;
        if (class_escape(*r->p, r->set[s], &mb)) {
            r->p++;
            int k = node(r, R_SET, -1, -1);
            if (k < 0) return -1;
            r->n[k].set = s;
            return mb ? alt(r, k, multibyte(r)) : k;
        }
        r->nset--; /* not a class */
        long v = escape_char(r);
        return v < 0 ? -1 : codepoint(r, (uint32_t)v);
    }
    case '*': case '+': case '?':
        return fail(r, "%s", "a quantifier with nothing before it in the pattern");
    case '^': case '$':
        return fail(r, "%s", "'^' and '$' are supported only at the ends of the pattern");
    default:
        return codepoint(r, utf8_next(r));
    }
}

static int parse_seq(struct rx *r, int depth)
{
    int k = -1;
    while (r->p < r->end && *r->p != '|' && *r->p != ')' && !r->failed) {
        int a = parse_atom(r, depth);
        if (a < 0) return -1;
        k = cat(r, k, quantified(r, a));
    }
    return k < 0 ? node(r, R_EMPTY, -1, -1) : k;
}

static int parse_alt(struct rx *r, int depth)
{
    if (depth > 100) return fail(r, "%s", "the pattern nests too deep");
    int k = parse_seq(r, depth);
    while (r->p < r->end && *r->p == '|' && !r->failed) {
        r->p++;
        k = alt(r, k, parse_seq(r, depth));
    }
    return r->failed ? -1 : k;
}

/* ---- GBNF ------------------------------------------------------------------------- */

static void gb_space(struct rx *r, bool newlines)
{
    while (r->p < r->end) {
        if (*r->p == '#') {
            while (r->p < r->end && *r->p != '\n') r->p++;
        } else if (*r->p == ' ' || *r->p == '\t' || *r->p == '\r' || (newlines && *r->p == '\n')) {
            r->p++;
        } else {
            break;
        }
    }
}

static bool name_char(char c)
{
    return (c >= 'a' && c <= 'z') || (c >= 'A' && c <= 'Z') || (c >= '0' && c <= '9') || c == '-' || c == '_';
}

static int gb_alt(struct rx *r, int depth);

static int gb_rule(struct rx *r, const char *name, int len)
{
    for (int i = 0; i < r->nrules; i++) {
        struct rule *u = &r->rules[i];
        if (u->len != len || memcmp(u->name, name, (size_t)len)) continue;
        if (u->node == -2) {
            char nm[64];
            snprintf(nm, sizeof nm, "%.*s", len < 60 ? len : 60, name);
            return fail(r, "the grammar rule '%s' is recursive: only grammars without recursion (a regular "
                           "language) are supported", nm);
        }
        if (u->node >= 0) return u->node;
        u->node = -2;
        const char *save = r->p;
        r->p = u->body;
        int k = gb_alt(r, 0);
        r->p = save;
        if (k < 0) return -1;
        u->node = k;
        return k;
    }
    char nm[64];
    snprintf(nm, sizeof nm, "%.*s", len < 60 ? len : 60, name);
    return fail(r, "the grammar refers to an undefined rule '%s'", nm);
}

static int gb_atom(struct rx *r, int depth)
{
    char c = *r->p;
    if (c == '"') {
        r->p++;
        int k = -1;
        while (r->p < r->end && *r->p != '"' && !r->failed) {
            long v;
            if (*r->p == '\\') {
                r->p++;
                if (r->p >= r->end) break;
                if ((v = escape_char(r)) < 0) return -1;
            } else {
                v = (long)utf8_next(r);
            }
            k = cat(r, k, codepoint(r, (uint32_t)v));
        }
        if (r->p >= r->end) return fail(r, "%s", "a string literal in the grammar is not closed");
        r->p++;
        return k < 0 ? node(r, R_EMPTY, -1, -1) : k;
    }
    if (c == '[') {
        r->p++;
        return char_class(r);
    }
    if (c == '.') {
        r->p++;
        int k = set_node(r, 0, 0x7F);
        return alt(r, k, multibyte(r));
    }
    if (c == '(') {
        r->p++;
        int k = gb_alt(r, depth + 1);
        gb_space(r, true);
        if (r->failed) return -1;
        if (r->p >= r->end || *r->p != ')') return fail(r, "%s", "unbalanced parentheses in the grammar");
        r->p++;
        return k;
    }
    if (name_char(c)) {
        const char *s = r->p;
        while (r->p < r->end && name_char(*r->p)) r->p++;
        return gb_rule(r, s, (int)(r->p - s));
    }
    char what[2] = {c, 0};
    return fail(r, "the grammar has an unexpected '%s'", what);
}

/* A sequence ends at '|', ')', or the end of the line outside parentheses. */
static int gb_seq(struct rx *r, int depth)
{
    int k = -1;
    for (;;) {
        gb_space(r, depth > 0);
        if (r->p >= r->end || *r->p == '|' || *r->p == ')' || *r->p == '\n' || r->failed) break;
        /* the next rule's "name ::=" ends this one */
        const char *q = r->p;
        while (q < r->end && name_char(*q)) q++;
        const char *q2 = q;
        while (q2 < r->end && (*q2 == ' ' || *q2 == '\t')) q2++;
        if (q > r->p && r->end - q2 >= 3 && !memcmp(q2, "::=", 3)) break;
        int a = gb_atom(r, depth);
        if (a < 0) return -1;
        k = cat(r, k, quantified(r, a));
    }
    return k < 0 ? node(r, R_EMPTY, -1, -1) : k;
}

static int gb_alt(struct rx *r, int depth)
{
    if (depth > 100) return fail(r, "%s", "the grammar nests too deep");
    int k = gb_seq(r, depth);
    for (;;) {
        gb_space(r, depth > 0);
        /* a '|' may start the next line */
        const char *q = r->p;
        while (q < r->end && (*q == ' ' || *q == '\t' || *q == '\r' || *q == '\n')) q++;
        if (q < r->end && *q == '|' && !r->failed) {
            r->p = q + 1;
            k = alt(r, k, gb_seq(r, depth));
            continue;
        }
        break;
    }
    return r->failed ? -1 : k;
}

/* Finds the rules ("name ::= body") and builds "root". */
static int gb_parse(struct rx *r)
{
    int cap = 0;
    r->p = r->src;
    for (;;) {
        gb_space(r, true);
        if (r->p >= r->end) break;
        const char *s = r->p;
        while (r->p < r->end && name_char(*r->p)) r->p++;
        int len = (int)(r->p - s);
        gb_space(r, false);
        if (!len || r->end - r->p < 3 || memcmp(r->p, "::=", 3))
            return fail(r, "%s", "the grammar must be rules of the form 'name ::= ...'");
        r->p += 3;
        if (r->nrules == cap) {
            cap = cap ? cap * 2 : 16;
            struct rule *nr = realloc(r->rules, (size_t)cap * sizeof *nr);
            if (!nr) return fail(r, "%s", "out of memory");
            r->rules = nr;
        }
        r->rules[r->nrules++] = (struct rule){.name = s, .len = len, .body = r->p, .node = -1};
        /* skip the body: parse it once to find its end (it is parsed again, for real, from root) */
        int save_nn = r->nn, save_ns = r->nset;
        int depth = 0;
        bool in_str = false;
        while (r->p < r->end) {
            char c = *r->p;
            if (in_str) {
                if (c == '\\') r->p++;
                else if (c == '"') in_str = false;
            } else if (c == '"') in_str = true;
            else if (c == '[') {
                r->p++;
                while (r->p < r->end && *r->p != ']') r->p += *r->p == '\\' ? 2 : 1;
            } else if (c == '#') {
                while (r->p < r->end && *r->p != '\n') r->p++;
                continue;
            } else if (c == '(') depth++;
            else if (c == ')') depth--;
            else if (c == '\n' && depth <= 0) {
                /* the rule goes on when the next line starts with '|' */
                const char *q = r->p + 1;
                while (q < r->end && (*q == ' ' || *q == '\t' || *q == '\r' || *q == '\n')) q++;
                if (q >= r->end || *q != '|') break;
            }
            r->p++;
        }
        r->nn = save_nn, r->nset = save_ns;
    }
    return gb_rule(r, "root", 4);
}

/* ---- NFA and DFA ------------------------------------------------------------------ */

struct nfa {
    int32_t *out1, *out2; /* -1: none */
    int32_t *set;         /* byte set index, or -1 for an epsilon state */
    int n, cap;
    bool oom;
};

static int nstate(struct nfa *f, int set)
{
    if (f->n >= f->cap) {
        if (f->cap >= MAX_NFA) {
            f->oom = true;
            return 0;
        }
        int cap = f->cap ? f->cap * 2 : 1024;
        int32_t *a = realloc(f->out1, (size_t)cap * 4), *b = a ? realloc(f->out2, (size_t)cap * 4) : NULL,
                *c = b ? realloc(f->set, (size_t)cap * 4) : NULL;
        if (a) f->out1 = a;
        if (b) f->out2 = b;
        if (c) f->set = c;
        if (!c) {
            f->oom = true;
            return 0;
        }
        f->cap = cap;
    }
    f->out1[f->n] = f->out2[f->n] = -1;
    f->set[f->n] = set;
    return f->n++;
}

/* Fragment: start state, end state (an epsilon state whose out1 is patched). */
static void build(const struct rx *r, struct nfa *f, int k, int *s, int *e)
{
    if (f->oom) {
        *s = *e = 0;
        return;
    }
    const struct rnode *n = &r->n[k];
    switch (n->kind) {
    case R_EMPTY:
        *s = *e = nstate(f, -1);
        return;
    case R_SET:
        *s = nstate(f, n->set);
        *e = nstate(f, -1);
        if (!f->oom) f->out1[*s] = *e;
        return;
    case R_CAT: {
        int s1, e1, s2, e2;
        build(r, f, n->a, &s1, &e1);
        build(r, f, n->b, &s2, &e2);
        if (f->oom) return;
        f->out1[e1] = s2;
        *s = s1, *e = e2;
        return;
    }
    case R_ALT: {
        int s1, e1, s2, e2;
        build(r, f, n->a, &s1, &e1);
        build(r, f, n->b, &s2, &e2);
        *s = nstate(f, -1);
        *e = nstate(f, -1);
        if (f->oom) return;
        f->out1[*s] = s1, f->out2[*s] = s2;
        f->out1[e1] = *e, f->out1[e2] = *e;
        return;
    }
    case R_REP: {
        int first = nstate(f, -1), last = first;
        for (int i = 0; i < n->lo && !f->oom; i++) {
            int s1, e1;
            build(r, f, n->a, &s1, &e1);
            if (f->oom) break;
            f->out1[last] = s1;
            last = e1;
        }
        if (n->hi == RX_INF) {
            int s1, e1;
            build(r, f, n->a, &s1, &e1);
            int loop = nstate(f, -1), end = nstate(f, -1);
            if (!f->oom) {
                f->out1[last] = loop;
                f->out1[loop] = s1, f->out2[loop] = end;
                f->out1[e1] = loop;
                last = end;
            }
        } else {
            for (int i = n->lo; i < n->hi && !f->oom; i++) {
                int s1, e1;
                build(r, f, n->a, &s1, &e1);
                int end = nstate(f, -1);
                if (f->oom) break;
                f->out1[last] = s1, f->out2[last] = end;
                f->out1[e1] = end;
                last = end;
            }
        }
        *s = first, *e = last;
        return;
    }
    }
}

struct dfa_build {
    const struct nfa *f;
    const uint8_t (*sets)[32];
    int accept;          /* the NFA's final state */
    int32_t *mark;       /* [f->n] closure generation */
    int32_t gen;
    long work;           /* closure steps so far: a pattern that needs too many is refused */
    int32_t *stack;      /* [f->n] */
    /* DFA states as sorted lists of NFA states (SET states and the final one) */
    int32_t **members;
    int *n_members;
    uint64_t *hash;
    int n, cap, max;
    int16_t (*next)[256];
    int *htab; /* open addressing: DFA state + 1 */
    int hcap;
};

static int cmp_i32(const void *a, const void *b)
{
    int32_t x = *(const int32_t *)a, y = *(const int32_t *)b;
    return (x > y) - (x < y);
}

/* The epsilon closure of seeds into out (sorted, SET and final states only); returns its size. */
static int closure(struct dfa_build *d, const int32_t *seeds, int ns, int32_t *out)
{
    const struct nfa *f = d->f;
    int sp = 0, no = 0;
    d->gen++;
    for (int i = 0; i < ns; i++)
        if (d->mark[seeds[i]] != d->gen) d->mark[seeds[i]] = d->gen, d->stack[sp++] = seeds[i];
    while (sp) {
        int s = d->stack[--sp];
        d->work++;
        if (f->set[s] >= 0 || s == d->accept) {
            out[no++] = s;
            if (f->set[s] >= 0) continue;
        }
        int o[2] = {f->out1[s], f->out2[s]};
        for (int j = 0; j < 2; j++)
            if (o[j] >= 0 && d->mark[o[j]] != d->gen) d->mark[o[j]] = d->gen, d->stack[sp++] = o[j];
    }
    qsort(out, (size_t)no, sizeof *out, cmp_i32);
    return no;
}

static uint64_t set_hash(const int32_t *m, int n)
{
    uint64_t h = 1469598103934665603ULL ^ (uint64_t)n;
    for (int i = 0; i < n; i++) h = (h ^ (uint64_t)(uint32_t)m[i]) * 1099511628211ULL;
    return h;
}

/* The DFA state of member list m (n), added when new; -1 when over the cap or out of memory. */
static int dfa_state(struct dfa_build *d, const int32_t *m, int n)
{
    uint64_t h = set_hash(m, n);
    int slot = (int)(h & (uint64_t)(d->hcap - 1));
    while (d->htab[slot]) {
        int s = d->htab[slot] - 1;
        if (d->hash[s] == h && d->n_members[s] == n && !memcmp(d->members[s], m, (size_t)n * 4)) return s;
        slot = (slot + 1) & (d->hcap - 1);
    }
    if (d->n >= d->max) return -1;
    if (d->n == d->cap) {
        int cap = d->cap ? d->cap * 2 : 64;
        int32_t **a = realloc(d->members, (size_t)cap * sizeof *a);
        if (a) d->members = a;
        int *b = a ? realloc(d->n_members, (size_t)cap * sizeof *b) : NULL;
        if (b) d->n_members = b;
        uint64_t *c = b ? realloc(d->hash, (size_t)cap * sizeof *c) : NULL;
        if (c) d->hash = c;
        int16_t(*x)[256] = c ? realloc(d->next, (size_t)cap * sizeof *x) : NULL;
        if (!x) return -1;
        d->next = x;
        d->cap = cap;
    }
    int s = d->n;
    d->members[s] = malloc((size_t)(n ? n : 1) * 4);
    if (!d->members[s]) return -1;
    memcpy(d->members[s], m, (size_t)n * 4);
    d->n_members[s] = n;
    d->hash[s] = h;
    d->n++;
    d->htab[slot] = s + 1;
    return s;
}

int sched_regex_build(const char *src, size_t len, int mode, int max_states, struct sched_dfa *out, char *err,
                      size_t errlen)
{
    memset(out, 0, sizeof *out);
    struct rx r = {.err = err, .errlen = errlen, .p = src, .end = src + len, .src = src};
    struct nfa f = {0};
    struct dfa_build d = {0};
    int rc = SL_EINVAL;
    int32_t *tmp = NULL, *seeds = NULL;
    r.n = malloc(MAX_AST * sizeof *r.n);
    r.set = malloc(MAX_SETS * sizeof *r.set);
    if (!r.n || !r.set) {
        snprintf(err, errlen, "out of memory");
        rc = SL_ENOMEM;
        goto out;
    }
    int root;
    if (mode == SCHED_RX_GBNF) {
        root = gb_parse(&r);
    } else {
        bool head = r.p < r.end && *r.p == '^', tail = false;
        if (head) r.p++;
        /* a trailing unescaped '$' anchors the end */
        if (r.end > r.p && r.end[-1] == '$') {
            int bs = 0;
            for (const char *q = r.end - 2; q >= r.p && *q == '\\'; q--) bs++;
            if (bs % 2 == 0) tail = true, r.end--;
        }
        root = parse_alt(&r, 0);
        if (!r.failed && r.p < r.end) fail(&r, "%s", "unbalanced parentheses in the pattern");
        if (!r.failed && mode == SCHED_RX_SEARCH) {
            /* JSON Schema patterns match anywhere in the string unless anchored */
            if (!head) {
                int any = alt(&r, set_node(&r, 0, 0x7F), multibyte(&r));
                root = cat(&r, rep(&r, any, 0, RX_INF), root);
            }
            if (!tail) {
                int any = alt(&r, set_node(&r, 0, 0x7F), multibyte(&r));
                root = cat(&r, root, rep(&r, any, 0, RX_INF));
            }
        }
    }
    if (r.failed || root < 0) {
        if (!r.failed) snprintf(err, errlen, "the pattern is empty");
        goto out;
    }
    int s0, e0;
    build(&r, &f, root, &s0, &e0);
    if (f.oom) {
        snprintf(err, errlen, "the pattern is too large (its automaton has over %d states)", MAX_NFA);
        goto out;
    }
    d.f = &f, d.sets = (const uint8_t(*)[32])r.set, d.accept = e0, d.max = max_states;
    d.mark = calloc((size_t)f.n, 4);
    d.stack = malloc((size_t)f.n * 4);
    tmp = malloc((size_t)f.n * 4);
    seeds = malloc((size_t)f.n * 4);
    d.hcap = 1;
    while (d.hcap < 4 * max_states) d.hcap *= 2;
    d.htab = calloc((size_t)d.hcap, sizeof *d.htab);
    if (!d.mark || !d.stack || !tmp || !seeds || !d.htab) {
        snprintf(err, errlen, "out of memory");
        rc = SL_ENOMEM;
        goto out;
    }
    /* bytes that every byte set treats alike share one transition: a pattern
     * has a handful of such classes, so a DFA state is built from a few
     * closures instead of 256 */
    uint8_t cls[256] = {0};
    int ncls = 1, rep[256] = {0};
    for (int st = 0; st < r.nset; st++) {
        int map[512], nn = 0;
        for (int k = 0; k < 512; k++) map[k] = -1;
        uint8_t next_cls[256];
        for (int c = 0; c < 256; c++) {
            int key = cls[c] * 2 + (r.set[st][c >> 3] >> (c & 7) & 1);
            if (map[key] < 0) map[key] = nn++;
            next_cls[c] = (uint8_t)map[key];
        }
        memcpy(cls, next_cls, 256);
        ncls = nn;
    }
    for (int c = 255; c >= 0; c--) rep[cls[c]] = c;
    int n0 = closure(&d, &s0, 1, tmp);
    if (dfa_state(&d, tmp, n0) != 0) goto toobig;
    for (int s = 0; s < d.n; s++) {
        int16_t to[256];
        for (int k = 0; k < ncls; k++) {
            int c = rep[k], ns = 0;
            d.work += d.n_members[s];
            for (int i = 0; i < d.n_members[s]; i++) {
                int m = d.members[s][i];
                int st = f.set[m];
                if (st >= 0 && (r.set[st][c >> 3] >> (c & 7) & 1)) seeds[ns++] = f.out1[m];
            }
            if (!ns) {
                to[k] = -1;
                continue;
            }
            int n = closure(&d, seeds, ns, tmp);
            int t = dfa_state(&d, tmp, n);
            if (t < 0 || d.work > MAX_WORK) goto toobig;
            to[k] = (int16_t)t;
        }
        for (int c = 0; c < 256; c++) d.next[s][c] = to[cls[c]];
    }
    /* accepting states, then prune those that cannot reach one */
    size_t nd = (size_t)(unsigned)d.n;
    uint8_t *acc = calloc(nd, 1), *live = calloc(nd, 1);
    if (!acc || !live) {
        free(acc), free(live);
        snprintf(err, errlen, "out of memory");
        rc = SL_ENOMEM;
        goto out;
    }
    for (int s = 0; s < d.n; s++) {
        int *m = d.members[s];
        for (int i = 0; i < d.n_members[s]; i++)
            if (m[i] == e0) acc[s] = live[s] = 1;
    }
    for (bool changed = true; changed;) {
        changed = false;
        for (int s = 0; s < d.n; s++) {
            if (live[s]) continue;
            for (int c = 0; c < 256; c++)
                if (d.next[s][c] >= 0 && live[d.next[s][c]]) {
                    live[s] = 1, changed = true;
                    break;
                }
        }
    }
    if (!live[0]) {
        free(acc), free(live);
        snprintf(err, errlen, "the %s matches no string", mode == SCHED_RX_GBNF ? "grammar" : "pattern");
        goto out;
    }
    for (int s = 0; s < d.n; s++)
        for (int c = 0; c < 256; c++)
            if (d.next[s][c] >= 0 && !live[d.next[s][c]]) d.next[s][c] = -1;
    free(live);
    out->n = d.n;
    out->next = d.next;
    out->accept = acc;
    d.next = NULL;
    rc = 0;
    goto out;
toobig:
    snprintf(err, errlen, "the %s is too complex (its DFA has over %d states)",
             mode == SCHED_RX_GBNF ? "grammar" : "pattern", max_states);
out:
    for (int i = 0; i < d.n; i++) free(d.members[i]);
    free(d.members), free(d.n_members), free(d.hash), free(d.next), free(d.htab);
    free(d.mark), free(d.stack), free(tmp), free(seeds);
    free(f.out1), free(f.out2), free(f.set);
    free(r.n), free(r.set), free(r.rules);
    return rc;
}

void sched_dfa_free(struct sched_dfa *d)
{
    if (!d) return;
    free(d->next);
    free(d->accept);
    memset(d, 0, sizeof *d);
}

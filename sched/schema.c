/* schema.c - JSON-schema-guided generation (sched.h, "guide"): a schema
 * (OpenAI's response_format json_schema, vLLM's structured_outputs json and
 * guided_json) compiled into a small node table, and the byte-level
 * recognizer that follows it, used by sched_guide_step when a guide carries
 * a schema. The same table also holds a regex or grammar guide (one raw node
 * over a DFA, regex.c), so every guide shares one recognizer, one mask and
 * one mask cache.
 *
 * Why by hand: no library with a C ABI fits a plain C build. llguidance's
 * PyPI wheel does export its llg_* C functions, but from a CPython extension
 * module that leaves ~100 Py* symbols undefined (dlopen fails unless
 * libpython is loaded into the server first) and ships no header; xgrammar's
 * wheel is C++ bound to libtvm_ffi; outlines-core's exports only
 * PyInit_outlines_core; none of them is packaged by Debian, and building
 * llguidance's C library needs a Rust toolchain.
 *
 * Supported, as pydantic and the OpenAI SDK write schemas: "type" (one or a
 * list), object ("properties", "required": the properties are written in the
 * schema's order, those not required may be left out; "additionalProperties"
 * false, true or a schema: an object without properties is then a map of
 * string keys to that schema; with properties, only they are written), array
 * ("items", "minItems", "maxItems"), string ("minLength", "maxLength",
 * "pattern" through regex.c, "format" date, time, date-time, uuid, email,
 * ipv4, uri; other formats are annotations and ignored), number and integer
 * ("minimum", "maximum", "exclusiveMinimum", "exclusiveMaximum": every digit
 * is allowed only while a value in range can still be written; no exponent
 * then), boolean, null; "enum" and "const" of any JSON value (written
 * compactly); "$ref" to "#", "#/$defs/..." or any JSON pointer in the
 * document ("$defs", "definitions"), recursion included (nesting stops at
 * SCHED_GUIDE_MAX_DEPTH); "anyOf"/"oneOf" whose alternatives start with
 * different characters (Optional[X] is X or null; an integer alternative
 * beside a number one and enum strings beside a string are merged into
 * them), or tagged objects (each alternative an object whose first property
 * has the same key and one const value of its own, as tool-call schemas
 * are); "allOf" of one schema; {} or true: any JSON value. Anything else
 * ("not", "if", "patternProperties", "prefixItems", "multipleOf",
 * "uniqueItems": true, unions of two untagged objects, ...) is refused at
 * compile time with the keyword named, never silently loosened. Whitespace
 * between tokens is allowed as in JSON mode.
 *
 * The table is one allocation (nodes, properties and literals, union lists,
 * DFA tables, then the bytes of the literals), so a request copies it with
 * one memcpy.
 */
#include <math.h>
#include <stdatomic.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "base/json.h"
#include "sched.h"

#define MAX_NODES 2048
#define MAX_LITS 8192
#define MAX_BYTES 65536
#define MAX_ALTS 2048
#define MAX_ENUM 64
#define MAX_WS 16
#define MAX_DFA 4096       /* DFA states in one schema (512 bytes each) */
#define MAX_DFA_ONE 2048   /* ... in one pattern or grammar */
#define MAX_REFS 256
#define MAX_NUM_DIGITS 17  /* a bounded number's digits, so its value stays exact in a double */

enum { K_OBJECT, K_ARRAY, K_STRING, K_NUMBER, K_INTEGER, K_LITERAL, K_UNION, K_DICT, K_ALT, K_RAW, K_PENDING };
enum { B_LO = 1, B_HI = 2, B_LO_EX = 4, B_HI_EX = 8 };

struct snode {
    uint8_t kind;
    uint8_t bound;        /* number, integer: B_* */
    int16_t first, count; /* object: properties lits [first, first+count); array: first = item node,
                             count = maxItems + 1 (0: no limit); literal: lits [first, first+count);
                             union: lits [first, first+count) = each alternative's tag literal, its
                             .node the alternative (an object whose first property is the tag);
                             dict: first = the values' node; alt: alts [first, first+count) */
    int32_t min, max;     /* array: minItems; string: minLength, maxLength (-1: none) */
    int32_t dfa;          /* string, raw: the start state in the schema's DFA tables; -1: none */
    double lo, hi;        /* number, integer: bounds (see bound) */
    uint8_t fb[32];       /* the bytes a value of this node may start with */
};
struct slit {
    int32_t off; /* into bytes */
    int16_t len;
    int16_t node; /* object properties: the value's node */
    uint8_t req;  /* object properties: required */
};

struct sched_schema {
    size_t bytes;         /* the whole allocation */
    uint64_t uid;         /* sched_schema_uid */
    int n_nodes, n_lits, n_alts, n_dfa, n_bytes;
    struct snode *node;   /* [n_nodes], node 0 is the root */
    struct slit *lit;     /* [n_lits]: property keys and enum literals, JSON-encoded */
    int16_t *alt;         /* [n_alts]: the alternatives of alt nodes */
    int16_t (*dnext)[256]; /* [n_dfa]: DFA transitions (global state numbers) */
    uint8_t *dacc;        /* [n_dfa]: accepting */
    char *byte;           /* [n_bytes] */
};

static _Atomic uint64_t next_uid = 1;

/* ---- compile ---------------------------------------------------------------------- */

struct build {
    struct snode node[MAX_NODES];
    struct slit lit[MAX_LITS];
    int16_t alt[MAX_ALTS];
    char byte[MAX_BYTES];
    int n_nodes, n_lits, n_alts, n_bytes;
    int16_t (*dnext)[256];
    uint8_t *dacc;
    int n_dfa;
    struct { int json, node; } ref[MAX_REFS]; /* compiled $ref targets */
    int n_refs;
    int any;          /* the node of any JSON value, -1 until needed */
    int root;         /* the document's root value ($ref "#") */
    char *err;
    size_t errlen;
};

static int bad(struct build *b, const char *fmt, const char *what)
{
    snprintf(b->err, b->errlen, fmt, what);
    return -1;
}

static int new_node(struct build *b, int kind)
{
    if (b->n_nodes >= MAX_NODES) {
        snprintf(b->err, b->errlen, "the schema has more than %d nodes", MAX_NODES);
        return -1;
    }
    b->node[b->n_nodes] = (struct snode){.kind = (uint8_t)kind, .dfa = -1, .max = -1};
    return b->n_nodes++;
}

static int add_bytes_lit(struct build *b, const char *s, size_t n, int16_t node)
{
    if (b->n_lits >= MAX_LITS || b->n_bytes + (int)n > MAX_BYTES || n > 30000) {
        snprintf(b->err, b->errlen, "the schema is too large (%d literals, %d bytes at most)", MAX_LITS, MAX_BYTES);
        return -1;
    }
    memcpy(b->byte + b->n_bytes, s, n);
    b->lit[b->n_lits++] = (struct slit){.off = b->n_bytes, .len = (int16_t)n, .node = node};
    b->n_bytes += (int)n;
    return 0;
}

/* The compact JSON encoding of value i (strings re-escaped, no whitespace). */
static int encode(const json_doc *d, int i, struct json_buf *o, int depth)
{
    if (depth > 64) return -1;
    if (json_is_str(d, i)) {
        size_t n = 0;
        char *s = json_strdup(d, i, &n);
        if (!s) return -1;
        json_buf_add_str(o, s, n);
        free(s);
    } else if (json_is_obj(d, i) || json_is_arr(d, i)) {
        bool obj = json_is_obj(d, i);
        json_buf_add(o, obj ? "{" : "[", 1);
        for (int k = 0, p = i + 1, n = json_size(d, i); k < n; k++) {
            if (k) json_buf_add(o, ",", 1);
            if (obj) {
                if (encode(d, p, o, depth + 1)) return -1;
                json_buf_add(o, ":", 1);
                p++;
            }
            if (encode(d, p, o, depth + 1)) return -1;
            p = json_skip(d, p);
        }
        json_buf_add(o, obj ? "}" : "]", 1);
    } else {
        size_t n = 0;
        const char *r = json_raw(d, i, &n); /* number, true, false, null */
        json_buf_add(o, r, n);
    }
    return o->oom ? -1 : 0;
}

static int add_lit(struct build *b, const json_doc *d, int i, int16_t node)
{
    struct json_buf o;
    json_buf_init(&o);
    int rc = encode(d, i, &o, 0);
    if (rc) snprintf(b->err, b->errlen, "an enum/const value is too deep or too large");
    else rc = add_bytes_lit(b, o.p, o.len, node);
    json_buf_free(&o);
    return rc;
}

static const char *const IGNORED[] = {"title", "description", "$schema", "$id", "$comment", "examples", "default",
                                      "strict", "required", "format", "discriminator", "deprecated", "readOnly",
                                      "writeOnly", "$defs", "definitions", "contentEncoding", "contentMediaType",
                                      "nullable", NULL};
static const char *const KNOWN[] = {"type", "properties", "items", "enum", "const", "maxItems", "minItems", "anyOf",
                                    "oneOf", "allOf", "$ref", "additionalProperties", "minimum", "maximum",
                                    "exclusiveMinimum", "exclusiveMaximum", "minLength", "maxLength", "pattern",
                                    "uniqueItems", NULL};

static bool in_list(const json_doc *d, int key, const char *const *list)
{
    for (int i = 0; list[i]; i++)
        if (json_str_eq(d, key, list[i])) return true;
    return false;
}

static int compile_node(struct build *b, const json_doc *d, int s, int depth, bool reg);

static void fb_add(uint8_t *fb, int lo, int hi)
{
    for (int c = lo; c <= hi; c++) fb[c >> 3] |= (uint8_t)(1u << (c & 7));
}
static bool fb_has(const uint8_t *fb, int c) { return fb[c >> 3] >> (c & 7) & 1; }

/* Appends a DFA for a pattern / grammar to the tables; its start state, or -1. */
static int add_dfa(struct build *b, const char *src, size_t len, int mode)
{
    struct sched_dfa x;
    char e[200];
    if (sched_regex_build(src, len, mode, MAX_DFA_ONE, &x, e, sizeof e)) {
        snprintf(b->err, b->errlen, "%s", e);
        return -1;
    }
    int base = b->n_dfa;
    if (base + x.n > MAX_DFA) {
        sched_dfa_free(&x);
        snprintf(b->err, b->errlen, "the schema's patterns are too complex (%d DFA states in all at most)", MAX_DFA);
        return -1;
    }
    int16_t(*nx)[256] = realloc(b->dnext, (size_t)(base + x.n) * sizeof *nx);
    uint8_t *acc = nx ? realloc(b->dacc, (size_t)(base + x.n)) : NULL;
    if (nx) b->dnext = nx;
    if (acc) b->dacc = acc;
    if (!acc) {
        sched_dfa_free(&x);
        snprintf(b->err, b->errlen, "out of memory");
        return -1;
    }
    for (int s = 0; s < x.n; s++) {
        for (int c = 0; c < 256; c++) b->dnext[base + s][c] = x.next[s][c] < 0 ? -1 : (int16_t)(x.next[s][c] + base);
        b->dacc[base + s] = x.accept[s];
    }
    b->n_dfa = base + x.n;
    sched_dfa_free(&x);
    return base;
}

/* Regexes of the string formats the guide knows; NULL: an annotation only. */
static const char *format_regex(const json_doc *d, int f)
{
#define DATE "[0-9]{4}-(0[1-9]|1[0-2])-(0[1-9]|[12][0-9]|3[01])"
#define TIME "([01][0-9]|2[0-3]):[0-5][0-9]:[0-5][0-9](\\.[0-9]{1,9})?(Z|[+-]([01][0-9]|2[0-3]):[0-5][0-9])?"
#define OCTET "(25[0-5]|2[0-4][0-9]|1[0-9][0-9]|[1-9]?[0-9])"
    static const struct { const char *name, *re; } F[] = {
        {"date", DATE},
        {"time", TIME},
        {"date-time", DATE "T" TIME},
        {"uuid", "[0-9a-fA-F]{8}-[0-9a-fA-F]{4}-[0-9a-fA-F]{4}-[0-9a-fA-F]{4}-[0-9a-fA-F]{12}"},
        {"email", "[A-Za-z0-9_+-]+(\\.[A-Za-z0-9_+-]+)*@[A-Za-z0-9]([A-Za-z0-9-]*[A-Za-z0-9])?"
                  "(\\.[A-Za-z0-9]([A-Za-z0-9-]*[A-Za-z0-9])?)*\\.[A-Za-z]{2,}"},
        {"ipv4", OCTET "\\." OCTET "\\." OCTET "\\." OCTET},
        {"uri", "[A-Za-z][A-Za-z0-9+.-]*:[^ \\t\\r\\n\"\\\\<>{}|^`]+"},
    };
    for (size_t i = 0; i < sizeof F / sizeof *F; i++)
        if (json_str_eq(d, f, F[i].name)) return F[i].re;
    return NULL;
#undef DATE
#undef TIME
#undef OCTET
}

static int get_num(struct build *b, const json_doc *d, int s, const char *key, double *v, bool *present)
{
    int i = json_get(d, s, key);
    *present = false;
    if (i < 0) return 0;
    if (json_is_bool(d, i)) return 0; /* draft-4 exclusive flags: read by the caller */
    if (!json_is_num(d, i) || json_f64(d, i, v) || !isfinite(*v)) return bad(b, "'%s' must be a number", key);
    *present = true;
    return 0;
}

static int get_count(struct build *b, const json_doc *d, int s, const char *key, int64_t *v)
{
    int i = json_get(d, s, key);
    if (i < 0) return 0;
    if (json_i64(d, i, v) || *v < 0 || *v > 30000)
        return bad(b, "'%s' must be an integer from 0 to 30000", key);
    return 1;
}

static int any_node(struct build *b);

static int compile_number(struct build *b, const json_doc *d, int s, int me)
{
    struct snode *nd = &b->node[me];
    double v;
    bool has;
    if (get_num(b, d, s, "minimum", &v, &has)) return -1;
    if (has) nd->bound |= B_LO, nd->lo = v;
    if (get_num(b, d, s, "maximum", &v, &has)) return -1;
    if (has) nd->bound |= B_HI, nd->hi = v;
    if (get_num(b, d, s, "exclusiveMinimum", &v, &has)) return -1;
    if (has && (!(nd->bound & B_LO) || v >= nd->lo)) nd->bound |= B_LO | B_LO_EX, nd->lo = v;
    if (get_num(b, d, s, "exclusiveMaximum", &v, &has)) return -1;
    if (has && (!(nd->bound & B_HI) || v <= nd->hi)) nd->bound |= B_HI | B_HI_EX, nd->hi = v;
    bool ex = false;
    int e = json_get(d, s, "exclusiveMinimum");
    if (e >= 0 && json_is_bool(d, e) && !json_bool(d, e, &ex) && ex) nd->bound |= B_LO_EX;
    e = json_get(d, s, "exclusiveMaximum");
    if (e >= 0 && json_is_bool(d, e) && !json_bool(d, e, &ex) && ex) nd->bound |= B_HI_EX;
    if ((nd->bound & B_LO) && (nd->bound & B_HI) &&
        (nd->lo > nd->hi || (nd->lo == nd->hi && (nd->bound & (B_LO_EX | B_HI_EX)))))
        return bad(b, "%s: no number lies between the minimum and the maximum", "the schema");
    if (nd->kind == K_INTEGER && (nd->bound & B_LO) && (nd->bound & B_HI)) {
        double lo = (nd->bound & B_LO_EX) ? floor(nd->lo) + 1 : ceil(nd->lo);
        double hi = (nd->bound & B_HI_EX) ? ceil(nd->hi) - 1 : floor(nd->hi);
        if (lo > hi) return bad(b, "%s: no integer lies between the minimum and the maximum", "the schema");
    }
    return me;
}

static int compile_string(struct build *b, const json_doc *d, int s, int me)
{
    int64_t v;
    int rc;
    if ((rc = get_count(b, d, s, "minLength", &v)) < 0) return -1;
    if (rc) b->node[me].min = (int32_t)v;
    if ((rc = get_count(b, d, s, "maxLength", &v)) < 0) return -1;
    if (rc) b->node[me].max = (int32_t)v;
    if (b->node[me].max >= 0 && b->node[me].min > b->node[me].max)
        return bad(b, "%s: minLength is above maxLength", "the schema");
    int pat = json_get(d, s, "pattern"), fm = json_get(d, s, "format");
    const char *re = NULL;
    size_t len = 0;
    char *own = NULL;
    int mode = SCHED_RX_FULL;
    if (pat >= 0) {
        if (!json_is_str(d, pat) || !(own = json_strdup(d, pat, &len))) return bad(b, "%s must be a string", "'pattern'");
        re = own, mode = SCHED_RX_SEARCH;
    } else if (fm >= 0 && json_is_str(d, fm) && (re = format_regex(d, fm))) {
        len = strlen(re);
    }
    if (re) {
        int st = add_dfa(b, re, len, mode);
        free(own);
        if (st < 0) {
            char e[200];
            snprintf(e, sizeof e, "%s", b->err);
            snprintf(b->err, b->errlen, "%s: %s", pat >= 0 ? "'pattern'" : "'format'", e);
            return -1;
        }
        b->node[me].dfa = st;
    }
    return me;
}

static int compile_object(struct build *b, const json_doc *d, int s, int me, int depth)
{
    int pr = json_get(d, s, "properties"), ap = json_get(d, s, "additionalProperties");
    int rq = json_get(d, s, "required");
    bool closed = false;
    if (ap >= 0 && json_is_bool(d, ap)) {
        bool v = true;
        json_bool(d, ap, &v);
        closed = !v;
    } else if (ap >= 0 && !json_is_obj(d, ap)) {
        return bad(b, "%s must be a boolean or a schema", "'additionalProperties'");
    }
    if (pr >= 0 && !json_is_obj(d, pr)) return bad(b, "%s must be an object", "'properties'");
    if (rq >= 0 && !json_is_arr(d, rq)) return bad(b, "%s must be an array of names", "'required'");
    int n = pr >= 0 ? json_size(d, pr) : 0;
    if (n == 0 && !closed) {
        /* a map: any keys, values as additionalProperties says (any value without it) */
        b->node[me].kind = K_DICT;
        int child = ap >= 0 && json_is_obj(d, ap) ? compile_node(b, d, ap, depth + 1, false) : any_node(b);
        if (child < 0) return -1;
        b->node[me].first = (int16_t)child;
        return me;
    }
    /* the keys first, contiguous, then the children (which add literals of their own) */
    int first = b->n_lits;
    for (int k = 0, p = pr + 1; k < n; k++, p = json_skip(d, p + 1)) {
        if (add_lit(b, d, p, -1)) return -1;
        if (rq >= 0)
            for (int j = 0, q = rq + 1; j < json_size(d, rq); j++, q = json_skip(d, q)) {
                size_t kl = 0, ql = 0;
                const char *kr = json_raw(d, p, &kl), *qr = json_raw(d, q, &ql);
                if (json_is_str(d, q) && kl == ql && !memcmp(kr, qr, kl)) b->lit[first + k].req = 1;
            }
    }
    b->node[me].kind = K_OBJECT;
    b->node[me].first = (int16_t)first;
    b->node[me].count = (int16_t)n;
    for (int k = 0, p = pr + 1; k < n; k++, p = json_skip(d, p + 1)) {
        int child = compile_node(b, d, p + 1, depth + 1, false);
        if (child < 0) return -1;
        b->lit[first + k].node = (int16_t)child;
    }
    return me;
}

static int compile_array(struct build *b, const json_doc *d, int s, int me, int depth)
{
    int it = json_get(d, s, "items");
    int64_t mx = 0, lo = 0;
    int hasmx, rc;
    if ((hasmx = get_count(b, d, s, "maxItems", &mx)) < 0) return -1;
    if ((rc = get_count(b, d, s, "minItems", &lo)) < 0) return -1;
    if (hasmx && lo > mx) return bad(b, "%s: minItems is above maxItems", "the schema");
    int u = json_get(d, s, "uniqueItems");
    bool uniq = false;
    if (u >= 0 && (!json_is_bool(d, u) || json_bool(d, u, &uniq) || uniq))
        return bad(b, "the schema keyword '%s' is not supported yet", "uniqueItems");
    if (json_get(d, s, "prefixItems") >= 0) return bad(b, "the schema keyword '%s' is not supported yet", "prefixItems");
    b->node[me].kind = K_ARRAY;
    b->node[me].count = hasmx ? (int16_t)(mx + 1) : 0;
    b->node[me].min = (int32_t)lo;
    int child = it >= 0 ? compile_node(b, d, it, depth + 1, false) : any_node(b);
    if (child < 0) return -1;
    b->node[me].first = (int16_t)child;
    return me;
}

/* The node me as a value of JSON type ty (one of "type"'s names). */
static int compile_typed(struct build *b, const json_doc *d, int s, int ty, int me, int depth)
{
    struct snode *nd = &b->node[me];
    if (json_str_eq(d, ty, "string")) {
        nd->kind = K_STRING;
        return compile_string(b, d, s, me);
    }
    if (json_str_eq(d, ty, "number") || json_str_eq(d, ty, "integer")) {
        nd->kind = json_str_eq(d, ty, "number") ? K_NUMBER : K_INTEGER;
        return compile_number(b, d, s, me);
    }
    if (json_str_eq(d, ty, "boolean") || json_str_eq(d, ty, "null")) {
        bool boolean = json_str_eq(d, ty, "boolean");
        nd->kind = K_LITERAL;
        nd->first = (int16_t)b->n_lits;
        if (boolean ? add_bytes_lit(b, "true", 4, -1) || add_bytes_lit(b, "false", 5, -1)
                    : add_bytes_lit(b, "null", 4, -1))
            return -1;
        b->node[me].count = (int16_t)(b->n_lits - b->node[me].first);
        return me;
    }
    if (json_str_eq(d, ty, "array")) return compile_array(b, d, s, me, depth);
    if (json_str_eq(d, ty, "object")) return compile_object(b, d, s, me, depth);
    char t[32];
    json_str(d, ty, t, sizeof t);
    return bad(b, "the schema type '%s' is not supported", t);
}

/* Any JSON value: a union of a map, an array, a string, a number and the three literals. */
static int any_node(struct build *b)
{
    if (b->any >= 0) return b->any;
    int me = new_node(b, K_ALT), dict = new_node(b, K_DICT), arr = new_node(b, K_ARRAY), str = new_node(b, K_STRING),
        num = new_node(b, K_NUMBER), lit = new_node(b, K_LITERAL);
    if (lit < 0 || b->n_alts + 5 > MAX_ALTS) return bad(b, "%s is too large", "the schema");
    b->any = me;
    b->node[dict].first = (int16_t)me;
    b->node[arr].first = (int16_t)me;
    b->node[lit].first = (int16_t)b->n_lits;
    if (add_bytes_lit(b, "true", 4, -1) || add_bytes_lit(b, "false", 5, -1) || add_bytes_lit(b, "null", 4, -1))
        return -1;
    b->node[lit].count = 3;
    b->node[me].first = (int16_t)b->n_alts;
    b->node[me].count = 5;
    int16_t alts[5] = {(int16_t)dict, (int16_t)arr, (int16_t)str, (int16_t)num, (int16_t)lit};
    memcpy(b->alt + b->n_alts, alts, sizeof alts);
    b->n_alts += 5;
    return me;
}

/* A tagged union of objects (tool-call schemas): alternatives alt[0..n). */
static int make_tagged(struct build *b, int me, const int *alt, int n)
{
    const struct slit *key0 = NULL;
    int first = b->n_lits;
    for (int k = 0; k < n; k++) {
        const struct snode *a = &b->node[alt[k]];
        const struct snode *tag = a->kind == K_OBJECT && a->count > 0 ? &b->node[b->lit[a->first].node] : NULL;
        const struct slit *key = tag ? &b->lit[a->first] : NULL;
        if (!tag || tag->kind != K_LITERAL || tag->count != 1 ||
            (key0 && (key->len != key0->len || memcmp(b->byte + key->off, b->byte + key0->off, (size_t)key->len))))
            return bad(b, "%s", "'anyOf'/'oneOf' alternatives must start differently (a string, a number, an object, "
                                "null, ...) or be tagged objects (each an object whose first property has the same "
                                "key and one const value)");
        key0 = key;
        if (b->n_lits >= MAX_LITS) return bad(b, "%s is too large", "the schema");
        struct slit t = b->lit[tag->first];
        for (int j = first; j < b->n_lits; j++)
            if (b->lit[j].len == t.len && !memcmp(b->byte + b->lit[j].off, b->byte + t.off, (size_t)t.len))
                return bad(b, "%s", "'anyOf' alternatives need distinct tags");
        t.node = (int16_t)alt[k];
        b->lit[b->n_lits++] = t;
    }
    b->node[me].kind = K_UNION;
    b->node[me].first = (int16_t)first;
    b->node[me].count = (int16_t)n;
    return me;
}

/* Node me becomes the union of alternatives alt[0..n) (merged where one contains another). */
static int make_alt(struct build *b, int me, int *alt, int n)
{
    int m = 0, objects = 0, lits = 0;
    bool number = false, string = false;
    /* flatten nested unions that are complete */
    int flat[MAX_ENUM * 4];
    for (int k = 0; k < n; k++) {
        const struct snode *a = &b->node[alt[k]];
        if (a->kind == K_ALT && a->count > 0) {
            for (int j = 0; j < a->count && m < (int)(sizeof flat / sizeof *flat); j++) flat[m++] = b->alt[a->first + j];
        } else if (m < (int)(sizeof flat / sizeof *flat)) {
            flat[m++] = alt[k];
        }
    }
    for (int k = 0; k < m; k++) {
        int kind = b->node[flat[k]].kind;
        if (kind == K_NUMBER && !b->node[flat[k]].bound) number = true;
        if (kind == K_STRING && b->node[flat[k]].dfa < 0 && b->node[flat[k]].min == 0 && b->node[flat[k]].max < 0)
            string = true;
        objects += kind == K_OBJECT;
        lits += kind == K_LITERAL;
    }
    if (objects >= 2 && objects == m) return make_tagged(b, me, flat, m);
    /* enum strings inside a plain string, integers inside a plain number; literals merged into one */
    int keep[MAX_ENUM * 4], nk = 0, lit_node = -1;
    for (int k = 0; k < m; k++) {
        struct snode *a = &b->node[flat[k]];
        if (a->kind == K_INTEGER && number) continue;
        if (a->kind == K_LITERAL) {
            if (lits == 1) {
                keep[nk++] = flat[k];
                continue;
            }
            if (lit_node < 0) {
                if ((lit_node = new_node(b, K_LITERAL)) < 0) return -1;
                b->node[lit_node].first = (int16_t)b->n_lits;
                keep[nk++] = lit_node;
            }
            for (int j = 0; j < a->count; j++) {
                struct slit l = b->lit[a->first + j];
                if (string && b->byte[l.off] == '"') continue;
                if (b->n_lits >= MAX_LITS) return bad(b, "%s is too large", "the schema");
                b->lit[b->n_lits++] = l;
            }
            b->node[lit_node].count = (int16_t)(b->n_lits - b->node[lit_node].first);
            if (b->node[lit_node].count > 64) return bad(b, "%s: at most 64 enum/const values", "'anyOf'");
            continue;
        }
        keep[nk++] = flat[k];
    }
    if (lit_node >= 0 && b->node[lit_node].count == 0) { /* every literal was a string inside a string */
        for (int k = 0; k < nk; k++)
            if (keep[k] == lit_node) keep[k] = keep[--nk];
    }
    if (nk == 1 && b->node[keep[0]].kind != K_PENDING) {
        b->node[me] = b->node[keep[0]]; /* a copy: its lists are shared, not owned */
        return me;
    }
    if (b->n_alts + nk > MAX_ALTS) return bad(b, "%s is too large", "the schema");
    b->node[me].kind = K_ALT;
    b->node[me].first = (int16_t)b->n_alts;
    b->node[me].count = (int16_t)nk;
    for (int k = 0; k < nk; k++) b->alt[b->n_alts++] = (int16_t)keep[k];
    return me;
}

/* The value a "$ref" names: "#", or a JSON pointer "#/a/b" from the document's root. */
static int resolve_ref(struct build *b, const json_doc *d, int r)
{
    char ref[512];
    if (!json_is_str(d, r) || json_str(d, r, ref, sizeof ref) < 0 || ref[0] != '#')
        return bad(b, "%s", "'$ref' must point into this schema ('#', '#/$defs/Name')");
    int at = b->root;
    const char *p = ref + 1;
    while (*p == '/') {
        char seg[256];
        size_t n = 0;
        for (p++; *p && *p != '/' && n + 1 < sizeof seg; p++) {
            if (*p == '~' && (p[1] == '0' || p[1] == '1')) seg[n++] = p[1] == '0' ? '~' : '/', p++;
            else seg[n++] = *p;
        }
        seg[n] = 0;
        int next = -1;
        if (json_is_obj(d, at)) next = json_get(d, at, seg);
        else if (json_is_arr(d, at)) next = json_at(d, at, atoi(seg));
        if (next < 0) {
            snprintf(b->err, b->errlen, "'$ref' '%s' points at nothing in the schema", ref);
            return -1;
        }
        at = next;
    }
    return at;
}

static int compile_node(struct build *b, const json_doc *d, int s, int depth, bool reg)
{
    if (depth >= 64) return bad(b, "%s nests deeper than 64 levels (or its $refs loop)", "the schema");
    if (json_is_bool(d, s)) {
        bool v = false;
        json_bool(d, s, &v);
        if (!v) return bad(b, "%s", "the schema 'false' matches nothing");
        return any_node(b);
    }
    if (!json_is_obj(d, s)) return bad(b, "%s", "every schema must be an object");
    /* every keyword is either understood or harmless to ignore */
    for (int k = 0, p = s + 1, n = json_size(d, s); k < n; k++, p = json_skip(d, p + 1))
        if (!in_list(d, p, KNOWN) && !in_list(d, p, IGNORED)) {
            char key[64];
            json_str(d, p, key, sizeof key);
            snprintf(b->err, b->errlen, "the schema keyword '%s' is not supported yet", key);
            return -1;
        }
    int ref = json_get(d, s, "$ref");
    if (ref >= 0) {
        int t = resolve_ref(b, d, ref);
        if (t < 0) return -1;
        for (int i = 0; i < b->n_refs; i++)
            if (b->ref[i].json == t) return b->ref[i].node;
        return compile_node(b, d, t, depth + 1, true);
    }
    int all = json_get(d, s, "allOf");
    if (all >= 0) {
        if (!json_is_arr(d, all) || json_size(d, all) != 1)
            return bad(b, "%s", "'allOf' is supported with one schema only");
        return compile_node(b, d, all + 1, depth + 1, reg);
    }
    int me = new_node(b, K_PENDING);
    if (me < 0) return -1;
    if (reg) {
        if (b->n_refs >= MAX_REFS) return bad(b, "%s has too many $ref targets", "the schema");
        b->ref[b->n_refs].json = s, b->ref[b->n_refs++].node = me;
    }
    int en = json_get(d, s, "enum"), cn = json_get(d, s, "const"), ty = json_get(d, s, "type");
    int any = json_get(d, s, "anyOf");
    if (any < 0) any = json_get(d, s, "oneOf");
    if (any >= 0) {
        int n = json_is_arr(d, any) ? json_size(d, any) : 0;
        if (n < 1 || n > MAX_ENUM) return bad(b, "'anyOf'/'oneOf' must be an array of 1 to %s schemas", "64");
        int alt[MAX_ENUM];
        for (int k = 0, p = any + 1; k < n; k++, p = json_skip(d, p))
            if ((alt[k] = compile_node(b, d, p, depth + 1, false)) < 0) return -1;
        return make_alt(b, me, alt, n);
    }
    if (en >= 0 || cn >= 0) {
        b->node[me].kind = K_LITERAL;
        b->node[me].first = (int16_t)b->n_lits;
        if (cn >= 0) {
            if (add_lit(b, d, cn, -1)) return -1;
        } else {
            if (!json_is_arr(d, en) || json_size(d, en) < 1 || json_size(d, en) > MAX_ENUM)
                return bad(b, "'enum' must be an array of 1 to %s values", "64");
            for (int k = 0, p = en + 1; k < json_size(d, en); k++, p = json_skip(d, p))
                if (add_lit(b, d, p, -1)) return -1;
        }
        b->node[me].count = (int16_t)(b->n_lits - b->node[me].first);
        return me;
    }
    if (ty >= 0 && json_is_arr(d, ty)) {
        int n = json_size(d, ty);
        if (n < 1 || n > 8) return bad(b, "%s must list 1 to 8 types", "'type'");
        int alt[8];
        for (int k = 0, p = ty + 1; k < n; k++, p = json_skip(d, p)) {
            if (!json_is_str(d, p)) return bad(b, "%s must list type names", "'type'");
            if ((alt[k] = new_node(b, K_PENDING)) < 0 || compile_typed(b, d, s, p, alt[k], depth + 1) < 0) return -1;
        }
        return make_alt(b, me, alt, n);
    }
    if (ty >= 0 && !json_is_str(d, ty)) return bad(b, "%s must be a type name or a list of them", "'type'");
    if (ty >= 0) return compile_typed(b, d, s, ty, me, depth);
    /* no type: what the other keywords imply, else any value */
    if (json_get(d, s, "properties") >= 0 || json_get(d, s, "additionalProperties") >= 0)
        return compile_object(b, d, s, me, depth);
    if (json_get(d, s, "items") >= 0) return compile_array(b, d, s, me, depth);
    int a = any_node(b);
    if (a < 0) return -1;
    b->node[me] = b->node[a];
    return me;
}

/* The first bytes of every node (a fixpoint: unions may refer to each other),
 * then the check that a union's alternatives start differently. */
static int finish(struct build *b)
{
    for (int i = 0; i < b->n_nodes; i++) {
        struct snode *nd = &b->node[i];
        memset(nd->fb, 0, 32);
        switch (nd->kind) {
        case K_OBJECT: case K_DICT: case K_UNION: fb_add(nd->fb, '{', '{'); break;
        case K_ARRAY: fb_add(nd->fb, '[', '['); break;
        case K_STRING: fb_add(nd->fb, '"', '"'); break;
        case K_NUMBER: case K_INTEGER: fb_add(nd->fb, '0', '9'), fb_add(nd->fb, '-', '-'); break;
        case K_LITERAL:
            for (int k = 0; k < nd->count; k++) {
                uint8_t c = (uint8_t)b->byte[b->lit[nd->first + k].off];
                fb_add(nd->fb, c, c);
            }
            break;
        case K_PENDING: return bad(b, "%s", "the schema refers to itself with nothing in between");
        default: break;
        }
    }
    for (bool changed = true; changed;) {
        changed = false;
        for (int i = 0; i < b->n_nodes; i++) {
            struct snode *nd = &b->node[i];
            if (nd->kind != K_ALT) continue;
            for (int k = 0; k < nd->count; k++)
                for (int j = 0; j < 32; j++) {
                    uint8_t v = nd->fb[j] | b->node[b->alt[nd->first + k]].fb[j];
                    if (v != nd->fb[j]) nd->fb[j] = v, changed = true;
                }
        }
    }
    for (int i = 0; i < b->n_nodes; i++) {
        const struct snode *nd = &b->node[i];
        if (nd->kind != K_ALT) continue;
        for (int c = 0; c < 256; c++) {
            int owners = 0;
            for (int k = 0; k < nd->count; k++) owners += fb_has(b->node[b->alt[nd->first + k]].fb, c);
            if (owners > 1) {
                char what[8];
                snprintf(what, sizeof what, c >= 0x20 && c < 0x7f ? "'%c'" : "0x%02x", c);
                snprintf(b->err, b->errlen, "'anyOf'/'oneOf' alternatives that can start with the same character (%s) "
                                            "are not supported, unless they are tagged objects", what);
                return -1;
            }
        }
    }
    return 0;
}

static struct sched_schema *pack(struct build *b)
{
    size_t bytes = sizeof(struct sched_schema) + (size_t)b->n_nodes * sizeof(struct snode) +
                   (size_t)b->n_lits * sizeof(struct slit) + (size_t)b->n_dfa * 256 * sizeof(int16_t) +
                   (size_t)b->n_alts * sizeof(int16_t) + (size_t)b->n_dfa + (size_t)b->n_bytes;
    struct sched_schema *sc = malloc(bytes);
    if (!sc) {
        snprintf(b->err, b->errlen, "out of memory");
        return NULL;
    }
    sc->bytes = bytes;
    sc->uid = atomic_fetch_add(&next_uid, 1);
    sc->n_nodes = b->n_nodes, sc->n_lits = b->n_lits, sc->n_alts = b->n_alts, sc->n_dfa = b->n_dfa;
    sc->n_bytes = b->n_bytes;
    /* lay out: nodes, lits, DFA transitions (aligned: every part before is a multiple of 2), alts, accept, bytes */
    sc->node = (struct snode *)(sc + 1);
    sc->lit = (struct slit *)(sc->node + sc->n_nodes);
    sc->dnext = (int16_t(*)[256])(sc->lit + sc->n_lits);
    sc->alt = (int16_t *)(sc->dnext + sc->n_dfa);
    sc->dacc = (uint8_t *)(sc->alt + sc->n_alts);
    sc->byte = (char *)(sc->dacc + sc->n_dfa);
    memcpy(sc->node, b->node, (size_t)b->n_nodes * sizeof *sc->node);
    memcpy(sc->lit, b->lit, (size_t)b->n_lits * sizeof *sc->lit);
    if (b->n_dfa) {
        memcpy(sc->dnext, b->dnext, (size_t)b->n_dfa * sizeof *sc->dnext);
        memcpy(sc->dacc, b->dacc, (size_t)b->n_dfa);
    }
    memcpy(sc->alt, b->alt, (size_t)b->n_alts * sizeof *sc->alt);
    memcpy(sc->byte, b->byte, (size_t)b->n_bytes);
    return sc;
}

static struct build *build_new(char *err, size_t errlen)
{
    struct build *b = calloc(1, sizeof *b);
    if (!b) {
        snprintf(err, errlen, "out of memory");
        return NULL;
    }
    b->err = err, b->errlen = errlen, b->any = -1;
    return b;
}

static void build_free(struct build *b)
{
    if (!b) return;
    free(b->dnext);
    free(b->dacc);
    free(b);
}

struct sched_schema *sched_schema_compile(const json_doc *d, int s, bool any_root, char *err, size_t errlen)
{
    struct build *b = build_new(err, errlen);
    if (!b) return NULL;
    struct sched_schema *sc = NULL;
    b->root = s;
    if (compile_node(b, d, s, 0, true) != 0) {
        if (b->n_nodes > 0 && strlen(err) == 0) snprintf(err, errlen, "the schema could not be compiled");
        goto out;
    }
    if (finish(b)) goto out;
    if (!any_root && b->node[0].kind != K_OBJECT && b->node[0].kind != K_DICT && b->node[0].kind != K_UNION) {
        snprintf(err, errlen, "the top-level schema must be an object");
        goto out;
    }
    sc = pack(b);
out:
    build_free(b);
    return sc;
}

/* A raw guide over one DFA (the output is the regex's or grammar's text). */
static struct sched_schema *raw_schema(const char *src, size_t len, int mode, char *err, size_t errlen)
{
    struct build *b = build_new(err, errlen);
    if (!b) return NULL;
    struct sched_schema *sc = NULL;
    int me = new_node(b, K_RAW);
    int st = add_dfa(b, src, len, mode);
    if (me == 0 && st >= 0) {
        b->node[0].dfa = st;
        sc = pack(b);
    }
    build_free(b);
    return sc;
}

struct sched_schema *sched_schema_from_regex(const char *re, size_t len, char *err, size_t errlen)
{
    return raw_schema(re, len, SCHED_RX_FULL, err, errlen);
}

struct sched_schema *sched_schema_from_grammar(const char *gbnf, size_t len, char *err, size_t errlen)
{
    return raw_schema(gbnf, len, SCHED_RX_GBNF, err, errlen);
}

struct sched_schema *sched_schema_from_choice(const char *const *s, const size_t *len, int n, char *err,
                                              size_t errlen)
{
    struct json_buf re;
    json_buf_init(&re);
    for (int i = 0; i < n; i++) {
        if (i) json_buf_add(&re, "|", 1);
        json_buf_add(&re, "(?:", 3);
        for (size_t k = 0; k < len[i]; k++) {
            char c = s[i][k];
            if (strchr("\\^$.|?*+()[]{}", c)) json_buf_add(&re, "\\", 1);
            json_buf_add(&re, &c, 1);
        }
        json_buf_add(&re, ")", 1);
    }
    struct sched_schema *sc = NULL;
    if (re.oom) snprintf(err, errlen, "out of memory");
    else sc = raw_schema(re.p ? re.p : "", re.len, SCHED_RX_FULL, err, errlen);
    json_buf_free(&re);
    return sc;
}

struct sched_schema *sched_schema_empty_object(void)
{
    char err[64];
    struct build *b = build_new(err, sizeof err);
    if (!b) return NULL;
    struct sched_schema *sc = NULL;
    if (new_node(b, K_OBJECT) == 0 && !finish(b)) sc = pack(b); /* no properties: exactly {} */
    build_free(b);
    return sc;
}

struct sched_schema *sched_schema_copy(const struct sched_schema *s)
{
    if (!s) return NULL;
    struct sched_schema *c = malloc(s->bytes);
    if (!c) return NULL;
    memcpy(c, s, s->bytes);
    c->uid = atomic_fetch_add(&next_uid, 1);
    c->node = (struct snode *)(c + 1);
    c->lit = (struct slit *)(c->node + c->n_nodes);
    c->dnext = (int16_t(*)[256])(c->lit + c->n_lits);
    c->alt = (int16_t *)(c->dnext + c->n_dfa);
    c->dacc = (uint8_t *)(c->alt + c->n_alts);
    c->byte = (char *)(c->dacc + c->n_dfa);
    return c;
}

void sched_schema_free(struct sched_schema *s) { free(s); }

uint64_t sched_schema_uid(const struct sched_schema *s) { return s ? s->uid : 0; }

/* ---- the recognizer ----------------------------------------------------------------- */

/* frame phases */
enum { P_START, P_KEY, P_COLON, P_VALUE, P_AFTER, P_FIRST, P_BODY, P_OPEN };
/* primitive sub-states in g->state (0 = none) */
enum { X_NONE, X_STRING, X_NUM, X_LIT, X_RAW }; /* X_STRING: sched_json_str's state in n; X_RAW: dstate */

static bool is_ws(uint8_t c) { return c == ' ' || c == '\t' || c == '\n' || c == '\r'; }

static bool push(struct sched_guide *g, int node, int phase)
{
    if (g->depth >= SCHED_GUIDE_MAX_DEPTH) return false;
    g->frame[g->depth++] = (struct sched_guide_frame){.node = (int16_t)node, .phase = (uint8_t)phase, .idx = 0};
    return true;
}

/* The top frame's value is complete: pop it and tell the parent. */
static void complete(struct sched_guide *g)
{
    g->depth--;
    g->state = X_NONE;
    g->num = 0, g->ndig = g->nfrac = 0, g->neg = false, g->slen = 0, g->dstate = 0;
    if (g->depth == 0) g->done = true;
    else g->frame[g->depth - 1].phase = P_AFTER;
}

/* Starts literal matching of lits [first, first + count) at byte 0. */
static void lit_start(struct sched_guide *g, int first, int count)
{
    g->state = X_LIT;
    g->n = 0; /* position */
    g->lit_first = first;
    g->cand = count >= 64 ? ~0ULL : ((1ULL << count) - 1);
}

/* One byte of literal matching; done (set in *full) when a candidate ends here. */
static bool lit_step(struct sched_guide *g, uint8_t c, bool *full)
{
    const struct sched_schema *s = g->schema;
    uint64_t keep = 0;
    *full = false;
    for (uint64_t m = g->cand; m; m &= m - 1) {
        int k = __builtin_ctzll(m);
        const struct slit *l = &s->lit[g->lit_first + k];
        if (g->n < l->len && (uint8_t)s->byte[l->off + g->n] == c) {
            keep |= 1ULL << k;
            if (g->n + 1 == l->len) *full = true;
        }
    }
    if (!keep) return false;
    g->cand = keep;
    g->n++;
    return true;
}

/* Which candidate ended (the one whose length is the position). */
static int lit_which(const struct sched_guide *g)
{
    for (uint64_t m = g->cand; m; m &= m - 1) {
        int k = __builtin_ctzll(m);
        if (g->schema->lit[g->lit_first + k].len == g->n) return k;
    }
    return 0;
}

/* A union's tag literal is complete: the frame becomes the alternative it
 * names, with its first property (the tag) written. */
static void pick(struct sched_guide *g)
{
    struct sched_guide_frame *f = &g->frame[g->depth - 1];
    f->node = g->schema->lit[g->lit_first + lit_which(g)].node;
    g->state = X_NONE;
    f->idx = 0;
    f->phase = P_AFTER;
}

/* Whether the object's properties from k on may all be left out. */
static bool rest_optional(const struct sched_schema *s, const struct snode *nd, int k)
{
    for (; k < nd->count; k++)
        if (s->lit[nd->first + k].req) return false;
    return true;
}

/* Starts a key of object nd: the candidates are the properties from idx up to the first required one. */
static bool key_start(struct sched_guide *g, const struct snode *nd, int idx, uint8_t c)
{
    const struct sched_schema *s = g->schema;
    int n = 0;
    while (idx + n < nd->count && n < 64) {
        n++;
        if (s->lit[nd->first + idx + n - 1].req) break;
    }
    if (!n) return false;
    bool full;
    lit_start(g, nd->first + idx, n);
    return lit_step(g, c, &full);
}

/* ---- bounded numbers ---- */

/* Whether some value in [a, b] (b excluded when b_open) of sign neg lies within nd's bounds. */
static bool meets(const struct snode *nd, bool neg, double a, double b, bool b_open)
{
    double vl = neg ? -b : a, vh = neg ? -a : b;
    bool vl_open = neg && b_open, vh_open = !neg && b_open;
    if (nd->bound & B_LO) {
        if (vh < nd->lo) return false;
        if (vh == nd->lo && (vh_open || (nd->bound & B_LO_EX))) return false;
    }
    if (nd->bound & B_HI) {
        if (vl > nd->hi) return false;
        if (vl == nd->hi && (vl_open || (nd->bound & B_HI_EX))) return false;
    }
    return true;
}

/* Whether the number written so far (g's num, ndig, nfrac, neg; st its
 * sub-state) can still end within nd's bounds. */
static bool num_feasible(const struct sched_guide *g, const struct snode *nd, int st)
{
    bool integer = nd->kind == K_INTEGER;
    switch (st) {
    case SCHED_NUM_MINUS: return meets(nd, true, 0, INFINITY, false);
    case SCHED_NUM_ZERO: return integer ? meets(nd, g->neg, 0, 0, false) : meets(nd, g->neg, 0, 1, true);
    case SCHED_NUM_INT: {
        double p = 1;
        for (int k = 0; g->ndig + k <= MAX_NUM_DIGITS; k++, p *= 10) {
            double a = g->num * p, b = (g->num + 1) * p;
            if (integer ? meets(nd, g->neg, a, b - 1, false) : meets(nd, g->neg, a, b, true)) return true;
        }
        return false;
    }
    case SCHED_NUM_DOT:
    case SCHED_NUM_FRAC: return meets(nd, g->neg, g->num, g->num + pow(10, -g->nfrac), true);
    default: return false; /* no exponent with bounds */
    }
}

static bool num_in_range(const struct sched_guide *g, const struct snode *nd)
{
    return meets(nd, g->neg, g->num, g->num, false);
}

/* Number byte c from sub-state st0 to st (>= 0): tracks the value when nd is bounded. */
static bool num_byte(struct sched_guide *g, const struct snode *nd, int st0, int st, uint8_t c)
{
    if (!nd->bound) return true;
    if (c == '-') g->neg = true;
    else if (c >= '0' && c <= '9') {
        if (st == SCHED_NUM_FRAC) g->num += (c - '0') * pow(10, -(++g->nfrac));
        else if (st == SCHED_NUM_INT || st == SCHED_NUM_ZERO) g->num = g->num * 10 + (c - '0'), g->ndig++;
        else return false; /* exponent digits */
        if (g->ndig + g->nfrac > MAX_NUM_DIGITS) return false;
    } else if (c != '.') {
        return false;
    }
    (void)st0;
    return num_feasible(g, nd, st);
}

/* A value of the top frame's node starts with c (whitespace already skipped). */
static bool value_start(struct sched_guide *g, uint8_t c)
{
    struct sched_guide_frame *f = &g->frame[g->depth - 1];
    const struct sched_schema *s = g->schema;
    const struct snode *nd = &s->node[f->node];
    switch (nd->kind) {
    case K_ALT:
        for (int k = 0; k < nd->count; k++) {
            int a = s->alt[nd->first + k];
            if (fb_has(s->node[a].fb, c)) {
                f->node = (int16_t)a;
                return value_start(g, c);
            }
        }
        return false;
    case K_OBJECT:
    case K_UNION:
    case K_DICT:
        if (c != '{') return false;
        f->phase = nd->kind == K_UNION ? P_KEY : P_OPEN, f->idx = 0;
        return true;
    case K_ARRAY:
        if (c != '[') return false;
        f->phase = P_FIRST;
        return true;
    case K_STRING:
        if (c != '"') return false;
        f->phase = P_BODY;
        g->state = X_STRING, g->key = false;
        g->n = SCHED_STR_BODY;
        g->slen = 0, g->dstate = nd->dfa;
        return true;
    case K_NUMBER:
    case K_INTEGER: {
        int st = sched_json_num(SCHED_NUM_START, c, nd->kind == K_INTEGER);
        if (st < 0) return false;
        g->num = 0, g->ndig = g->nfrac = 0, g->neg = false;
        if (!num_byte(g, nd, SCHED_NUM_START, st, c)) return false;
        f->phase = P_BODY;
        g->state = X_NUM;
        g->n = st;
        return true;
    }
    case K_LITERAL: {
        f->phase = P_BODY;
        lit_start(g, nd->first, nd->count);
        bool full;
        if (!lit_step(g, c, &full)) return false;
        if (full && g->cand == (1ULL << lit_which(g))) complete(g);
        return true;
    }
    }
    return false;
}

void sched_guide_init_schema(struct sched_guide *g, const struct sched_schema *s)
{
    memset(g, 0, sizeof *g);
    g->schema = s;
    push(g, 0, P_START);
    if (s->node[0].kind == K_RAW) {
        g->frame[0].phase = P_BODY;
        g->state = X_RAW;
        g->dstate = s->node[0].dfa;
    }
}

/* A string of node nd without constraints (a plain token may continue it whatever it holds). */
static bool plain_string(const struct sched_guide *g)
{
    const struct snode *nd = &g->schema->node[g->frame[g->depth - 1].node];
    return g->key || nd->kind != K_STRING || (nd->dfa < 0 && nd->max < 0);
}

bool sched_schema_in_string(const struct sched_guide *g)
{
    return g->state == X_STRING && g->n == SCHED_STR_BODY && g->depth > 0 && plain_string(g);
}

static bool lit_may_end(const struct sched_guide *g);

bool sched_schema_plain_run(const struct sched_guide *g, const int16_t (**next)[256], int *state, int *room,
                            bool *raw)
{
    const struct sched_schema *s = g->schema;
    if (g->done || g->depth == 0) return false;
    if (g->state == X_RAW) {
        *next = (const int16_t(*)[256])s->dnext, *state = g->dstate, *room = -1, *raw = true;
        return true;
    }
    if (g->state != X_STRING || g->n != SCHED_STR_BODY || plain_string(g)) return false;
    const struct snode *nd = &s->node[g->frame[g->depth - 1].node];
    *next = nd->dfa >= 0 ? (const int16_t(*)[256])s->dnext : NULL;
    *state = g->dstate;
    *room = nd->max >= 0 ? nd->max - g->slen : -1;
    *raw = false;
    return true;
}

bool sched_schema_can_stop(const struct sched_guide *g)
{
    if (g->done) return true;
    if (g->state == X_RAW) return g->schema->dacc[g->dstate];
    /* a top-level number or literal (guided_json any root) that is complete
     * but could go on ("1" of 1 and 10): nothing after it would end it */
    if (g->depth != 1) return false;
    const struct snode *nd = &g->schema->node[g->frame[0].node];
    if (g->state == X_NUM) return sched_json_num_complete(g->n) && (!nd->bound || num_in_range(g, nd));
    return g->state == X_LIT && g->n > 0 && lit_may_end(g);
}

/* A raw DFA state with no way on: the output is complete. */
static bool dfa_final(const struct sched_schema *s, int st)
{
    if (!s->dacc[st]) return false;
    for (int c = 0; c < 256; c++)
        if (s->dnext[st][c] >= 0) return false;
    return true;
}

/* A literal candidate set in which one literal is complete and others go on:
 * the literal can end here if c does not continue any of them. */
static bool lit_may_end(const struct sched_guide *g)
{
    for (uint64_t m = g->cand; m; m &= m - 1)
        if (g->schema->lit[g->lit_first + __builtin_ctzll(m)].len == g->n) return true;
    return false;
}

bool sched_schema_step(struct sched_guide *g, uint8_t c)
{
    if (g->done || g->depth == 0) return false;
    struct sched_guide_frame *f = &g->frame[g->depth - 1];
    const struct sched_schema *s = g->schema;
    const struct snode *nd = &s->node[f->node];
    /* inside a primitive: strings, numbers, literals (keys too), raw text */
    switch (g->state) {
    case X_RAW: {
        int nx = s->dnext[g->dstate][c];
        if (nx < 0) return false;
        g->dstate = nx;
        if (dfa_final(s, nx)) g->done = true;
        return true;
    }
    case X_STRING: {
        bool plain = plain_string(g);
        if (!plain && g->n == SCHED_STR_BODY) {
            if (c == '"') {
                if (g->slen < nd->min || (nd->dfa >= 0 && !s->dacc[g->dstate])) return false;
                complete(g);
                return true;
            }
            if (c == '\\' && nd->dfa >= 0) return false; /* a pattern matches the bytes as written */
        }
        int st = sched_json_str(g->n, c);
        if (st < 0) return false;
        if (st == SCHED_STR_END) {
            if (g->key) {
                g->state = X_NONE, g->key = false;
                f->phase = P_COLON;
                return true;
            }
            if (g->slen < nd->min) return false;
            complete(g);
            return true;
        }
        if (!plain) {
            if (g->n == SCHED_STR_BODY && (c & 0xC0) != 0x80 && nd->max >= 0 && g->slen >= nd->max) return false;
            if (nd->dfa >= 0) {
                int nx = s->dnext[g->dstate][c];
                if (nx < 0) return false;
                g->dstate = nx;
            }
        }
        if (g->n == SCHED_STR_BODY && (c & 0xC0) != 0x80 && nd->kind == K_STRING && !g->key) g->slen++;
        g->n = st;
        return true;
    }
    case X_NUM: {
        int st = sched_json_num(g->n, c, nd->kind == K_INTEGER);
        if (st == -1) return false;
        if (st >= 0) {
            if (nd->bound) { /* the value so far, restored when c is refused */
                double num = g->num;
                int16_t ndig = g->ndig, nfrac = g->nfrac;
                bool neg = g->neg;
                if (!num_byte(g, nd, g->n, st, c)) {
                    g->num = num, g->ndig = ndig, g->nfrac = nfrac, g->neg = neg;
                    return false;
                }
            }
            g->n = st;
            return true;
        }
        if (!sched_json_num_complete(g->n)) return false;
        if (nd->bound && !num_in_range(g, nd)) return false;
        complete(g); /* c belongs to the parent */
        return sched_schema_step(g, c);
    }
    case X_LIT: {
        bool full;
        struct sched_guide keep;
        bool may_end = lit_may_end(g) && g->n > 0;
        if (may_end) keep = *g;
        if (!lit_step(g, c, &full)) {
            if (!may_end) return false;
            /* one candidate (an enum value such as 1 beside 10) ended before c: c belongs to the parent */
            *g = keep;
            for (uint64_t m = g->cand; m; m &= m - 1) {
                int k = __builtin_ctzll(m);
                if (s->lit[g->lit_first + k].len == g->n) {
                    g->cand = 1ULL << k;
                    break;
                }
            }
            if (f->phase == P_KEY) return false; /* keys end with their quote: never here */
            if (nd->kind == K_UNION) return false;
            complete(g);
            return sched_schema_step(g, c);
        }
        if (full && g->cand == (1ULL << lit_which(g))) { /* the only candidate left is complete */
            g->state = X_NONE;
            if (f->phase == P_KEY) {
                if (nd->kind == K_OBJECT) f->idx = (int16_t)(g->lit_first - nd->first + lit_which(g));
                f->phase = P_COLON; /* a key: the object frame goes on */
            } else if (nd->kind == K_UNION) {
                pick(g);
            } else {
                complete(g);
            }
        }
        return true;
    }
    default:
        break;
    }
    if (is_ws(c)) return ++g->n_ws <= MAX_WS;
    g->n_ws = 0;
    switch (f->phase) {
    case P_START:
        return value_start(g, c);
    case P_OPEN: /* just after '{': a key, or '}' when nothing is required */
        if (c == '}') {
            if (nd->kind == K_OBJECT && !rest_optional(s, nd, 0)) return false;
            complete(g);
            return true;
        }
        /* fall through */
    case P_KEY:
        if (nd->kind == K_DICT) {
            if (c != '"') return false;
            f->phase = P_KEY;
            g->state = X_STRING, g->key = true, g->n = SCHED_STR_BODY;
            return true;
        }
        if (nd->kind == K_UNION) { /* a union's key is the tag's, which every alternative shares */
            bool full;
            lit_start(g, s->node[s->lit[nd->first].node].first, 1);
            f->phase = P_KEY;
            return lit_step(g, c, &full);
        }
        f->phase = P_KEY;
        return key_start(g, nd, f->idx, c);
    case P_COLON:
        if (c != ':') return false;
        f->phase = P_VALUE;
        return true;
    case P_VALUE: {
        if (nd->kind == K_UNION) { /* the tag's value decides the alternative */
            bool full;
            lit_start(g, nd->first, nd->count);
            if (!lit_step(g, c, &full)) return false;
            if (full) pick(g);
            return true;
        }
        int child = nd->kind == K_OBJECT ? s->lit[nd->first + f->idx].node : nd->first;
        return push(g, child, P_START) && value_start(g, c);
    }
    case P_FIRST: /* array: a value or ']' */
        if (c == ']') {
            if (nd->min > 0) return false; /* minItems */
            complete(g);
            return true;
        }
        if (nd->count == 1) return false; /* maxItems 0 */
        f->phase = P_VALUE;
        return sched_schema_step(g, c);
    case P_AFTER:
        if (nd->kind == K_ARRAY) {
            if (c == ',') {
                if (nd->count && f->idx + 2 >= nd->count) return false; /* maxItems reached */
                f->idx++;
                f->phase = P_VALUE;
                return true;
            }
            if (c != ']' || f->idx + 1 < nd->min) return false;
            complete(g);
            return true;
        }
        if (nd->kind == K_DICT) {
            if (c == ',') {
                f->phase = P_KEY;
                return true;
            }
            if (c != '}') return false;
            complete(g);
            return true;
        }
        /* object: another property's key after ',', or '}' once the rest may be left out */
        if (c == ',') {
            if (f->idx + 1 >= nd->count) return false;
            f->idx++;
            f->phase = P_KEY;
            return true;
        }
        if (c != '}' || !rest_optional(s, nd, f->idx + 1)) return false;
        complete(g);
        return true;
    }
    return false;
}

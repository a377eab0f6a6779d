/* schema.c - JSON-schema-guided generation (sched.h, "guide"): a schema
 * (OpenAI's response_format json_schema) compiled into a small node table,
 * and the byte-level recognizer that follows it, used by sched_guide_step
 * when a guide carries a schema.
 *
 * Supported: "type" object (with "properties"; every property is written,
 * in the schema's order, as OpenAI's strict structured outputs require them
 * all), array ("items", "minItems", "maxItems"), string, number, integer,
 * boolean, null; "enum" and "const" of strings, booleans and null; an object
 * with no properties only with "additionalProperties": false (then exactly
 * {}); "anyOf" of tagged objects: every alternative an object whose first
 * property has the same key and a single const/enum value of its own (a
 * tagged union, as tool-call schemas are). Anything else ("$ref", "pattern",
 * a list of types, numbers in an enum, other unions, ...) is refused at
 * compile time with the keyword named, never silently loosened. Whitespace
 * between tokens is allowed as in JSON mode.
 *
 * The table is one allocation (nodes, properties, literals, then the bytes
 * of the literals), so a request copies it with one memcpy.
 */
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "base/json.h"
#include "sched.h"

#define MAX_NODES 256
#define MAX_LITS 512
#define MAX_BYTES 16384
#define MAX_ENUM 64
#define MAX_WS 16

enum { K_OBJECT, K_ARRAY, K_STRING, K_NUMBER, K_INTEGER, K_LITERAL, K_UNION };

struct snode {
    uint8_t kind;
    int16_t first, count; /* object: properties [first, first+count); array: first = item node,
                             count = maxItems + 1 (0: no limit); literal: lits [first, first+count);
                             union: lits [first, first+count) = each alternative's tag literal, its
                             .node the alternative (an object whose first property is the tag) */
    int16_t min;          /* array: minItems */
};
struct slit {
    int32_t off; /* into bytes */
    int16_t len;
    int16_t node; /* object properties: the value's node */
};

struct sched_schema {
    size_t bytes;         /* the whole allocation */
    int n_nodes, n_lits, n_bytes;
    struct snode *node;   /* [n_nodes], node 0 is the root */
    struct slit *lit;     /* [n_lits]: property keys and enum literals, JSON-encoded */
    char *byte;           /* [n_bytes] */
};

/* ---- compile ---------------------------------------------------------------------- */

struct build {
    struct snode node[MAX_NODES];
    struct slit lit[MAX_LITS];
    char byte[MAX_BYTES];
    int n_nodes, n_lits, n_bytes;
    char *err;
    size_t errlen;
};

/* Appends the JSON encoding of value i (string, true/false/null) as a literal. */
static int add_lit(struct build *b, const json_doc *d, int i, int16_t node)
{
    struct json_buf o;
    json_buf_init(&o);
    if (json_is_str(d, i)) {
        size_t n = 0;
        char *s = json_strdup(d, i, &n);
        if (!s) {
            json_buf_free(&o);
            return -1;
        }
        json_buf_add_str(&o, s, n);
        free(s);
    } else if (json_is_bool(d, i)) {
        bool v = false;
        json_bool(d, i, &v);
        json_buf_add(&o, v ? "true" : "false", v ? 4 : 5);
    } else if (json_is_null(d, i)) {
        json_buf_add(&o, "null", 4);
    } else {
        json_buf_free(&o);
        snprintf(b->err, b->errlen, "enum/const values must be strings, booleans or null");
        return -1;
    }
    if (o.oom || b->n_lits >= MAX_LITS || b->n_bytes + (int)o.len > MAX_BYTES || o.len > 30000) {
        json_buf_free(&o);
        snprintf(b->err, b->errlen, "the schema is too large (%d literals, %d bytes at most)", MAX_LITS, MAX_BYTES);
        return -1;
    }
    memcpy(b->byte + b->n_bytes, o.p, o.len);
    b->lit[b->n_lits++] = (struct slit){.off = b->n_bytes, .len = (int16_t)o.len, .node = node};
    b->n_bytes += (int)o.len;
    json_buf_free(&o);
    return 0;
}

static const char *const IGNORED[] = {"title", "description", "$schema", "$id", "examples", "default", "strict",
                                      "additionalProperties", "required", "format", NULL};
static const char *const KNOWN[] = {"type", "properties", "items", "enum", "const", "maxItems", "minItems", "anyOf",
                                    NULL};

static bool in_list(const json_doc *d, int key, const char *const *list)
{
    for (int i = 0; list[i]; i++)
        if (json_str_eq(d, key, list[i])) return true;
    return false;
}

static int compile_node(struct build *b, const json_doc *d, int s, int depth)
{
    if (!json_is_obj(d, s)) {
        snprintf(b->err, b->errlen, "every schema must be an object");
        return -1;
    }
    if (depth >= SCHED_GUIDE_MAX_DEPTH - 1) {
        snprintf(b->err, b->errlen, "the schema nests deeper than %d levels", SCHED_GUIDE_MAX_DEPTH - 2);
        return -1;
    }
    if (b->n_nodes >= MAX_NODES) {
        snprintf(b->err, b->errlen, "the schema has more than %d nodes", MAX_NODES);
        return -1;
    }
    /* every keyword is either understood or harmless to ignore */
    for (int k = 0, p = s + 1, n = json_size(d, s); k < n; k++, p = json_skip(d, p + 1))
        if (!in_list(d, p, KNOWN) && !in_list(d, p, IGNORED)) {
            char key[64];
            json_str(d, p, key, sizeof key);
            snprintf(b->err, b->errlen, "the schema keyword '%s' is not supported yet", key);
            return -1;
        }
    int me = b->n_nodes++;
    struct snode *nd = &b->node[me];
    int en = json_get(d, s, "enum"), cn = json_get(d, s, "const"), ty = json_get(d, s, "type");
    int any = json_get(d, s, "anyOf");
    if (any >= 0) {
        int n = json_is_arr(d, any) ? json_size(d, any) : 0;
        if (n < 1 || n > MAX_ENUM) {
            snprintf(b->err, b->errlen, "'anyOf' must be an array of 1 to %d schemas", MAX_ENUM);
            return -1;
        }
        int alt[MAX_ENUM];
        for (int k = 0, p = any + 1; k < n; k++, p = json_skip(d, p))
            if ((alt[k] = compile_node(b, d, p, depth + 1)) < 0) return -1;
        /* a tagged union: objects whose first property shares the key and has one literal each */
        const struct slit *key0 = NULL;
        int first = b->n_lits;
        for (int k = 0; k < n; k++) {
            const struct snode *a = &b->node[alt[k]];
            const struct snode *tag = a->kind == K_OBJECT && a->count > 0 ? &b->node[b->lit[a->first].node] : NULL;
            const struct slit *key = tag ? &b->lit[a->first] : NULL;
            if (!tag || tag->kind != K_LITERAL || tag->count != 1 ||
                (key0 && (key->len != key0->len || memcmp(b->byte + key->off, b->byte + key0->off, (size_t)key->len)))) {
                snprintf(b->err, b->errlen, "'anyOf' is supported for tagged objects only (each alternative an object "
                                            "whose first property has the same key and one const value)");
                return -1;
            }
            key0 = key;
            if (b->n_lits >= MAX_LITS) {
                snprintf(b->err, b->errlen, "the schema is too large");
                return -1;
            }
            struct slit t = b->lit[tag->first];
            for (int j = first; j < b->n_lits; j++)
                if (b->lit[j].len == t.len && !memcmp(b->byte + b->lit[j].off, b->byte + t.off, (size_t)t.len)) {
                    snprintf(b->err, b->errlen, "'anyOf' alternatives need distinct tags");
                    return -1;
                }
            t.node = (int16_t)alt[k];
            b->lit[b->n_lits++] = t;
        }
        nd = &b->node[me];
        nd->kind = K_UNION;
        nd->first = (int16_t)first;
        nd->count = (int16_t)n;
        return me;
    }
    if (en >= 0 || cn >= 0) {
        nd->kind = K_LITERAL;
        nd->first = (int16_t)b->n_lits;
        if (cn >= 0) {
            if (add_lit(b, d, cn, -1)) return -1;
        } else {
            if (!json_is_arr(d, en) || json_size(d, en) < 1 || json_size(d, en) > MAX_ENUM) {
                snprintf(b->err, b->errlen, "'enum' must be an array of 1 to %d values", MAX_ENUM);
                return -1;
            }
            for (int k = 0, p = en + 1; k < json_size(d, en); k++, p = json_skip(d, p))
                if (add_lit(b, d, p, -1)) return -1;
        }
        nd->count = (int16_t)(b->n_lits - nd->first);
        return me;
    }
    if (ty < 0 || !json_is_str(d, ty)) {
        snprintf(b->err, b->errlen, "each schema needs a 'type' (one string) or an 'enum'/'const'");
        return -1;
    }
    if (json_str_eq(d, ty, "string")) nd->kind = K_STRING;
    else if (json_str_eq(d, ty, "number")) nd->kind = K_NUMBER;
    else if (json_str_eq(d, ty, "integer")) nd->kind = K_INTEGER;
    else if (json_str_eq(d, ty, "boolean") || json_str_eq(d, ty, "null")) {
        nd->kind = K_LITERAL;
        nd->first = (int16_t)b->n_lits;
        static const char *const tf[] = {"true", "false"};
        bool boolean = json_str_eq(d, ty, "boolean");
        for (int k = 0; k < (boolean ? 2 : 1); k++) {
            const char *w = boolean ? tf[k] : "null";
            size_t n = strlen(w);
            memcpy(b->byte + b->n_bytes, w, n);
            b->lit[b->n_lits++] = (struct slit){.off = b->n_bytes, .len = (int16_t)n, .node = -1};
            b->n_bytes += (int)n;
        }
        nd->count = (int16_t)(b->n_lits - nd->first);
    } else if (json_str_eq(d, ty, "array")) {
        int it = json_get(d, s, "items");
        if (it < 0) {
            snprintf(b->err, b->errlen, "an array schema needs 'items'");
            return -1;
        }
        nd->kind = K_ARRAY;
        int mx = json_get(d, s, "maxItems");
        int64_t v = 0;
        if (mx >= 0 && (json_i64(d, mx, &v) || v < 0 || v > 30000)) {
            snprintf(b->err, b->errlen, "'maxItems' must be an integer from 0 to 30000");
            return -1;
        }
        nd->count = mx >= 0 ? (int16_t)(v + 1) : 0;
        int mn = json_get(d, s, "minItems");
        int64_t lo = 0;
        if (mn >= 0 && (json_i64(d, mn, &lo) || lo < 0 || lo > 30000 || (mx >= 0 && lo > v))) {
            snprintf(b->err, b->errlen, "'minItems' must be an integer from 0 to maxItems");
            return -1;
        }
        nd->min = (int16_t)lo;
        int child = compile_node(b, d, it, depth + 1);
        if (child < 0) return -1;
        b->node[me].first = (int16_t)child;
    } else if (json_str_eq(d, ty, "object")) {
        int pr = json_get(d, s, "properties"), ap = json_get(d, s, "additionalProperties");
        bool closed = false;
        if (ap >= 0 && json_is_bool(d, ap)) {
            bool v = true;
            json_bool(d, ap, &v);
            closed = !v;
        }
        if (closed && (pr < 0 || (json_is_obj(d, pr) && json_size(d, pr) == 0))) {
            nd->kind = K_OBJECT; /* exactly {} */
            nd->first = (int16_t)b->n_lits;
            nd->count = 0;
            return me;
        }
        if (pr < 0 || !json_is_obj(d, pr) || json_size(d, pr) == 0) {
            snprintf(b->err, b->errlen, "an object schema needs non-empty 'properties' (free-form objects: use "
                                        "json_object)");
            return -1;
        }
        int n = json_size(d, pr);
        /* the keys first, contiguous, then the children (which add literals of their own) */
        int first = b->n_lits;
        for (int k = 0, p = pr + 1; k < n; k++, p = json_skip(d, p + 1))
            if (add_lit(b, d, p, -1)) return -1;
        nd->kind = K_OBJECT;
        nd->first = (int16_t)first;
        nd->count = (int16_t)n;
        for (int k = 0, p = pr + 1; k < n; k++, p = json_skip(d, p + 1)) {
            int child = compile_node(b, d, p + 1, depth + 1);
            if (child < 0) return -1;
            b->lit[first + k].node = (int16_t)child;
        }
    } else {
        char t[32];
        json_str(d, ty, t, sizeof t);
        snprintf(b->err, b->errlen, "the schema type '%s' is not supported", t);
        return -1;
    }
    return me;
}

struct sched_schema *sched_schema_compile(const json_doc *d, int s, bool any_root, char *err, size_t errlen)
{
    struct build *b = calloc(1, sizeof *b);
    if (!b) {
        snprintf(err, errlen, "out of memory");
        return NULL;
    }
    b->err = err, b->errlen = errlen;
    struct sched_schema *sc = NULL;
    if (compile_node(b, d, s, 0) < 0) goto out;
    if (!any_root && b->node[0].kind != K_OBJECT) {
        snprintf(err, errlen, "the top-level schema must be an object");
        goto out;
    }
    size_t bytes = sizeof *sc + (size_t)b->n_nodes * sizeof(struct snode) + (size_t)b->n_lits * sizeof(struct slit) +
                   (size_t)b->n_bytes;
    sc = malloc(bytes);
    if (!sc) {
        snprintf(err, errlen, "out of memory");
        goto out;
    }
    sc->bytes = bytes;
    sc->n_nodes = b->n_nodes, sc->n_lits = b->n_lits, sc->n_bytes = b->n_bytes;
    sc->node = (struct snode *)(sc + 1);
    sc->lit = (struct slit *)(sc->node + sc->n_nodes);
    sc->byte = (char *)(sc->lit + sc->n_lits);
    memcpy(sc->node, b->node, (size_t)b->n_nodes * sizeof *sc->node);
    memcpy(sc->lit, b->lit, (size_t)b->n_lits * sizeof *sc->lit);
    memcpy(sc->byte, b->byte, (size_t)b->n_bytes);
out:
    free(b);
    return sc;
}

struct sched_schema *sched_schema_empty_object(void)
{
    struct sched_schema *sc = calloc(1, sizeof *sc + sizeof(struct snode));
    if (!sc) return NULL;
    sc->bytes = sizeof *sc + sizeof(struct snode);
    sc->n_nodes = 1;
    sc->node = (struct snode *)(sc + 1);
    sc->lit = (struct slit *)(sc->node + 1);
    sc->byte = (char *)sc->lit;
    sc->node[0] = (struct snode){.kind = K_OBJECT, .first = 0, .count = 0};
    return sc;
}

struct sched_schema *sched_schema_copy(const struct sched_schema *s)
{
    if (!s) return NULL;
    struct sched_schema *c = malloc(s->bytes);
    if (!c) return NULL;
    memcpy(c, s, s->bytes);
    c->node = (struct snode *)(c + 1);
    c->lit = (struct slit *)(c->node + c->n_nodes);
    c->byte = (char *)(c->lit + c->n_lits);
    return c;
}

void sched_schema_free(struct sched_schema *s) { free(s); }

/* ---- the recognizer ----------------------------------------------------------------- */

/* frame phases */
enum { P_START, P_KEY, P_COLON, P_VALUE, P_AFTER, P_FIRST, P_BODY };
/* primitive sub-states in g->state (0 = none) */
enum { X_NONE, X_STRING, X_NUM, X_LIT }; /* X_STRING: sched_json_str's state in n */

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
    for (int k = 0; k < 64; k++) {
        if (!(g->cand >> k & 1)) continue;
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

/* A union's tag literal is complete: the frame becomes the alternative it
 * names, with its first property (the tag) written. */
static void pick(struct sched_guide *g)
{
    struct sched_guide_frame *f = &g->frame[g->depth - 1];
    const struct sched_schema *s = g->schema;
    g->state = X_NONE;
    for (int k = 0; k < 64; k++)
        if ((g->cand >> k & 1) && s->lit[g->lit_first + k].len == g->n) {
            f->node = s->lit[g->lit_first + k].node;
            break;
        }
    f->idx = 0;
    f->phase = P_AFTER;
}

/* A value of node nd starts with c (whitespace already skipped). */
static bool value_start(struct sched_guide *g, uint8_t c)
{
    struct sched_guide_frame *f = &g->frame[g->depth - 1];
    const struct snode *nd = &g->schema->node[f->node];
    switch (nd->kind) {
    case K_OBJECT:
    case K_UNION:
        if (c != '{') return false;
        f->phase = nd->count ? P_KEY : P_AFTER, f->idx = 0; /* no properties: only '}' follows */
        return true;
    case K_ARRAY:
        if (c != '[') return false;
        f->phase = P_FIRST;
        return true;
    case K_STRING:
        if (c != '"') return false;
        f->phase = P_BODY;
        g->state = X_STRING;
        g->n = SCHED_STR_BODY;
        return true;
    case K_NUMBER:
    case K_INTEGER: {
        int st = sched_json_num(SCHED_NUM_START, c, nd->kind == K_INTEGER);
        if (st < 0) return false;
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
        if (full) complete(g);
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
}

bool sched_schema_in_string(const struct sched_guide *g) { return g->state == X_STRING && g->n == SCHED_STR_BODY; }

bool sched_schema_step(struct sched_guide *g, uint8_t c)
{
    if (g->done || g->depth == 0) return false;
    struct sched_guide_frame *f = &g->frame[g->depth - 1];
    const struct sched_schema *s = g->schema;
    const struct snode *nd = &s->node[f->node];
    /* inside a primitive: strings, numbers, literals (keys too) */
    switch (g->state) {
    case X_STRING: {
        int st = sched_json_str(g->n, c);
        if (st < 0) return false;
        if (st == SCHED_STR_END) complete(g);
        else g->n = st;
        return true;
    }
    case X_NUM: {
        int st = sched_json_num(g->n, c, nd->kind == K_INTEGER);
        if (st == -1) return false;
        if (st >= 0) {
            g->n = st;
            return true;
        }
        if (!sched_json_num_complete(g->n)) return false;
        complete(g); /* c belongs to the parent */
        return sched_schema_step(g, c);
    }
    case X_LIT: {
        bool full;
        if (!lit_step(g, c, &full)) return false;
        if (full) {
            g->state = X_NONE;
            if (f->phase == P_KEY) f->phase = P_COLON; /* a key: the object frame goes on */
            else if (nd->kind == K_UNION) pick(g);
            else complete(g);
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
    case P_KEY: { /* the key's first byte (its '"'): match the whole key as a literal */
        bool full;
        /* a union's key is the tag's, which every alternative shares */
        lit_start(g, nd->kind == K_UNION ? s->node[s->lit[nd->first].node].first : nd->first + f->idx, 1);
        return lit_step(g, c, &full);
    }
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
        /* object: the next property's key, or '}' after the last */
        if (f->idx + 1 < nd->count) {
            if (c != ',') return false;
            f->idx++;
            f->phase = P_KEY;
            return true;
        }
        if (c != '}') return false;
        complete(g);
        return true;
    }
    return false;
}

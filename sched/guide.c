/* guide.c - JSON mode for generation (sched.h, "guide"): a byte-level JSON
 * recognizer that says which vocabulary tokens may come next so the output
 * is one JSON object (OpenAI's response_format {"type": "json_object"}).
 *
 * The recognizer follows RFC 8259 byte by byte with a stack of open objects
 * and arrays; a token is allowed when all of its bytes are accepted from the
 * current state. Once the top-level object closes, only the model's stop
 * tokens are allowed. Whitespace between values is capped (GUIDE_MAX_WS bytes
 * in a row) so a model cannot stall in an endless run of newlines.
 */
#include <stddef.h>
#include <stdlib.h>
#include <string.h>

#include "sched.h"

#define GUIDE_MAX_WS 16
#define GUIDE_CACHE 128

enum {
    G_START,        /* before the top-level object: whitespace, then '{' */
    G_VALUE,        /* a value must start */
    G_KEY_OR_END,   /* just after '{': a key or '}' */
    G_KEY,          /* after ',' in an object: a key */
    G_COLON,        /* after a key */
    G_VALUE_OR_END, /* just after '[': a value or ']' */
    G_AFTER,        /* after a value: ',' or the closing bracket of the container */
    G_STRING,       /* inside a string (key or value): sched_json_str's state in n */
    G_NUM,          /* inside a number: sub-state in n */
    G_LIT,          /* inside true/false/null: lit[n] is the next byte */
    G_DONE,         /* the top-level object closed */
};


static bool ws(uint8_t c) { return c == ' ' || c == '\t' || c == '\n' || c == '\r'; }
static bool digit(uint8_t c) { return c >= '0' && c <= '9'; }
static bool hex(uint8_t c) { return digit(c) || (c >= 'a' && c <= 'f') || (c >= 'A' && c <= 'F'); }

int sched_json_str(int st, uint8_t c)
{
    switch (st) {
    case SCHED_STR_BODY:
        if (c == '"') return SCHED_STR_END;
        if (c == '\\') return SCHED_STR_ESC;
        return c >= 0x20 ? SCHED_STR_BODY : -1; /* control characters must be escaped */
    case SCHED_STR_ESC:
        if (c == 'u') return SCHED_STR_HEX1;
        return c && strchr("\"\\/bfnrt", c) ? SCHED_STR_BODY : -1;
    case SCHED_STR_HEX1: case SCHED_STR_HEX2: case SCHED_STR_HEX3:
        return hex(c) ? st + 1 : -1;
    case SCHED_STR_HEX4:
        return hex(c) ? SCHED_STR_BODY : -1;
    default:
        return -1;
    }
}

int sched_json_num(int st, uint8_t c, bool integer)
{
    switch (st) {
    case SCHED_NUM_START:
        return c == '-' ? SCHED_NUM_MINUS : c == '0' ? SCHED_NUM_ZERO : (c >= '1' && c <= '9') ? SCHED_NUM_INT : -1;
    case SCHED_NUM_MINUS: return c == '0' ? SCHED_NUM_ZERO : (c >= '1' && c <= '9') ? SCHED_NUM_INT : -1;
    case SCHED_NUM_INT:
        if (digit(c)) return SCHED_NUM_INT;
        /* fall through */
    case SCHED_NUM_ZERO:
        if (integer) return -2;
        return c == '.' ? SCHED_NUM_DOT : (c == 'e' || c == 'E') ? SCHED_NUM_E : -2;
    case SCHED_NUM_DOT: return digit(c) ? SCHED_NUM_FRAC : -1;
    case SCHED_NUM_FRAC: return digit(c) ? SCHED_NUM_FRAC : (c == 'e' || c == 'E') ? SCHED_NUM_E : -2;
    case SCHED_NUM_E: return (c == '+' || c == '-') ? SCHED_NUM_ESIGN : digit(c) ? SCHED_NUM_EXP : -1;
    case SCHED_NUM_ESIGN: return digit(c) ? SCHED_NUM_EXP : -1;
    case SCHED_NUM_EXP: return digit(c) ? SCHED_NUM_EXP : -2;
    default: return -1;
    }
}

bool sched_json_num_complete(int st)
{
    return st == SCHED_NUM_ZERO || st == SCHED_NUM_INT || st == SCHED_NUM_FRAC || st == SCHED_NUM_EXP;
}

void sched_guide_init(struct sched_guide *g)
{
    memset(g, 0, sizeof *g);
    g->state = G_START;
}

bool sched_guide_done(const struct sched_guide *g) { return g->schema ? g->done : g->state == G_DONE; }

bool sched_guide_can_stop(const struct sched_guide *g)
{
    return g->schema ? sched_schema_can_stop(g) : g->state == G_DONE;
}

/* A value ended: back to the container. */
static void value_end(struct sched_guide *g) { g->state = G_AFTER; }

/* The open object or array closed: done at the outermost, else a value ended. */
static bool pop(struct sched_guide *g)
{
    g->depth--;
    g->state = g->depth == 0 ? G_DONE : G_AFTER;
    return true;
}

static bool push(struct sched_guide *g, uint8_t kind)
{
    if (g->depth >= SCHED_GUIDE_MAX_DEPTH) return false;
    g->stack[g->depth++] = kind;
    return true;
}

static bool start_value(struct sched_guide *g, uint8_t c)
{
    switch (c) {
    case '{': g->state = G_KEY_OR_END; return push(g, '{');
    case '[': g->state = G_VALUE_OR_END; return push(g, '[');
    case '"': g->state = G_STRING, g->key = false, g->n = SCHED_STR_BODY; return true;
    case '-': case '0': g->state = G_NUM, g->n = sched_json_num(SCHED_NUM_START, c, false); return true;
    case 't': g->state = G_LIT, g->lit = "true", g->n = 1; return true;
    case 'f': g->state = G_LIT, g->lit = "false", g->n = 1; return true;
    case 'n': g->state = G_LIT, g->lit = "null", g->n = 1; return true;
    default:
        if (c >= '1' && c <= '9') {
            g->state = G_NUM, g->n = SCHED_NUM_INT;
            return true;
        }
        return false;
    }
}

/* ',' or a closing bracket after a value. */
static bool after(struct sched_guide *g, uint8_t c)
{
    uint8_t top = g->stack[g->depth - 1];
    if (c == ',') {
        g->state = top == '{' ? G_KEY : G_VALUE;
        return true;
    }
    if ((c == '}' && top == '{') || (c == ']' && top == '[')) return pop(g);
    return false;
}

bool sched_guide_step(struct sched_guide *g, uint8_t c)
{
    if (g->schema) return sched_schema_step(g, c);
    bool space = ws(c);
    switch (g->state) {
    case G_STRING: case G_NUM: case G_LIT: break;
    default:
        if (space) {
            if (g->state == G_DONE || ++g->n_ws > GUIDE_MAX_WS) return false;
            return true;
        }
        g->n_ws = 0;
    }
    switch (g->state) {
    case G_START:
        if (c != '{') return false;
        g->state = G_KEY_OR_END;
        return push(g, '{');
    case G_VALUE:
        return start_value(g, c);
    case G_VALUE_OR_END:
        if (c == ']') return pop(g);
        return start_value(g, c);
    case G_KEY_OR_END:
        if (c == '}') return pop(g);
        /* fall through */
    case G_KEY:
        if (c != '"') return false;
        g->state = G_STRING, g->key = true, g->n = SCHED_STR_BODY;
        return true;
    case G_COLON:
        if (c != ':') return false;
        g->state = G_VALUE;
        return true;
    case G_AFTER:
        return after(g, c);
    case G_STRING: {
        int st = sched_json_str(g->n, c);
        if (st < 0) return false;
        if (st != SCHED_STR_END) g->n = st;
        else if (g->key) g->state = G_COLON;
        else value_end(g);
        return true;
    }
    case G_LIT:
        if (c != (uint8_t)g->lit[g->n]) return false;
        if (!g->lit[++g->n]) value_end(g);
        return true;
    case G_NUM: {
        int st = sched_json_num(g->n, c, false);
        if (st == -1 || (st == -2 && !sched_json_num_complete(g->n))) return false;
        if (st >= 0) {
            g->n = st;
            return true;
        }
        /* the number ended at a complete state: c belongs to what follows */
        value_end(g);
        g->n_ws = 0;
        if (space) return ++g->n_ws <= GUIDE_MAX_WS;
        return after(g, c);
    }
    case G_DONE:
    default:
        return false;
    }
}

struct sched_guide_vocab {
    int n;
    const char **b;  /* [n] borrowed from the tokenizer */
    uint32_t *len;   /* [n] */
    uint8_t *flag;   /* [n] V_NORMAL | V_PLAIN */
    uint8_t *first;  /* [n] first byte (contiguous: the scan below reads it for every token) */
    uint16_t *nchar; /* [n] characters (UTF-8 lead bytes): maxLength's count */
    /* masks of recent states: generation revisits the same few (after a
     * value at depth 1, inside a key, ...); round-robin replacement that
     * skips the masks handed out since the last epoch (they are in use) */
    struct {
        struct sched_guide key; /* canonical (see canon) */
        uint64_t hash;          /* of key: most lookups compare this alone */
        uint64_t uid;           /* the schema's sched_schema_uid (its address may be reused) */
        uint64_t epoch;         /* last handed out in this epoch */
        uint8_t *mask;          /* [n] or NULL */
    } cache[GUIDE_CACHE];
    int next;
    uint64_t epoch;
};
enum { V_NORMAL = 1, V_PLAIN = 2 }; /* a normal token; bytes that may sit inside a string as they are */

struct sched_guide_vocab *sched_guide_vocab_create(const model_tok *tok)
{
    struct sched_guide_vocab *v = calloc(1, sizeof *v);
    int n = tok ? model_tok_n_vocab(tok) : 0;
    if (!v || n <= 0) goto fail;
    v->n = n;
    v->b = calloc((size_t)n, sizeof *v->b);
    v->len = calloc((size_t)n, sizeof *v->len);
    v->flag = calloc((size_t)n, 1);
    v->first = calloc((size_t)n, 1);
    v->nchar = calloc((size_t)n, sizeof *v->nchar);
    if (!v->b || !v->len || !v->flag || !v->first || !v->nchar) goto fail;
    for (int t = 0; t < n; t++) {
        size_t len = 0;
        v->b[t] = model_tok_bytes(tok, t, &len);
        if (!v->b[t] || !len || model_tok_attr(tok, t) != MODEL_TOK_NORMAL) continue;
        v->len[t] = (uint32_t)len;
        v->first[t] = (uint8_t)v->b[t][0];
        v->flag[t] = V_NORMAL | V_PLAIN;
        for (size_t i = 0; i < len; i++) {
            uint8_t c = (uint8_t)v->b[t][i];
            if (c == '"' || c == '\\' || c < 0x20) v->flag[t] &= (uint8_t)~V_PLAIN;
            if ((c & 0xC0) != 0x80 && v->nchar[t] < UINT16_MAX) v->nchar[t]++;
        }
    }
    return v;
fail:
    sched_guide_vocab_destroy(v);
    return NULL;
}

void sched_guide_vocab_destroy(struct sched_guide_vocab *v)
{
    if (!v) return;
    for (int i = 0; i < GUIDE_CACHE; i++) free(v->cache[i].mask);
    free(v->b);
    free(v->len);
    free(v->flag);
    free(v->first);
    free(v->nchar);
    free(v);
}

/* g with everything that cannot matter zeroed, so equal states compare equal. */
static struct sched_guide canon(const struct sched_guide *g)
{
    struct sched_guide k;
    memset(&k, 0, sizeof k);
    k.state = g->state, k.n = g->n, k.depth = g->depth, k.n_ws = g->n_ws, k.key = g->key, k.lit = g->lit;
    k.done = g->done, k.schema = g->schema, k.lit_first = g->lit_first, k.cand = g->cand;
    k.dstate = g->dstate, k.slen = g->slen, k.num = g->num, k.ndig = g->ndig, k.nfrac = g->nfrac, k.neg = g->neg;
    if (g->schema) {
        for (int i = 0; i < g->depth; i++) /* member by member: the padding stays zero for memcmp */
            k.frame[i].node = g->frame[i].node, k.frame[i].idx = g->frame[i].idx, k.frame[i].phase = g->frame[i].phase;
    } else {
        memcpy(k.stack, g->stack, (size_t)g->depth);
    }
    return k;
}

/* *d = *s for stepping: the frames in use only (schema mode; none in JSON
 * mode). The scan below copies the state once per candidate token. */
static inline void guide_copy(struct sched_guide *d, const struct sched_guide *s)
{
    memcpy(d, s, offsetof(struct sched_guide, frame));
    if (s->schema) memcpy(d->frame, s->frame, (size_t)s->depth * sizeof *s->frame);
}

static void compute_mask(const struct sched_guide *g, const struct sched_guide_vocab *v, uint8_t *allow)
{
    bool in_string = g->schema ? sched_schema_in_string(g) : g->state == G_STRING && g->n == SCHED_STR_BODY;
    /* most tokens fail on their first byte: decide those from a table; inside
     * a string, plain tokens continue it whatever they hold */
    bool first[256];
    struct sched_guide x, c;
    for (int b = 0; b < 256; b++) {
        guide_copy(&x, g);
        first[b] = sched_guide_step(&x, (uint8_t)b);
    }
    /* raw text, or a string with a pattern or maxLength: plain tokens walk the DFA table directly */
    const int16_t(*dn)[256] = NULL;
    int dst = 0, room = -1;
    bool raw = false, run = g->schema && sched_schema_plain_run(g, &dn, &dst, &room, &raw);
    for (int t = 0; t < v->n; t++) {
        uint8_t f = v->flag[t];
        allow[t] = 0;
        if (!(f & V_NORMAL) || !first[v->first[t]]) continue;
        if (in_string && (f & V_PLAIN)) {
            allow[t] = 1;
            continue;
        }
        if (run && (raw || (f & V_PLAIN))) {
            if (room >= 0 && v->nchar[t] > room) continue;
            int st = dn ? dst : 0;
            const uint8_t *p = (const uint8_t *)v->b[t];
            for (uint32_t i = 0, len = v->len[t]; dn && i < len && st >= 0; i++) st = dn[st][p[i]];
            allow[t] = st >= 0;
            continue;
        }
        guide_copy(&c, g);
        uint32_t i = 0, len = v->len[t];
        while (i < len && sched_guide_step(&c, (uint8_t)v->b[t][i])) i++;
        allow[t] = i == len;
    }
}

/* FNV-1a over the canonical state's bytes (canon zeroes what does not count) */
static uint64_t key_hash(const struct sched_guide *k)
{
    const uint8_t *p = (const uint8_t *)k;
    size_t n = sizeof *k;
    if (!k->schema) n = offsetof(struct sched_guide, frame); /* JSON mode: no frames */
    uint64_t h = 1469598103934665603ULL;
    for (size_t i = 0; i < n; i++) h = (h ^ p[i]) * 1099511628211ULL;
    return h;
}

void sched_guide_vocab_epoch(struct sched_guide_vocab *v) { v->epoch++; }

const uint8_t *sched_guide_mask_ref(const struct sched_guide *g, struct sched_guide_vocab *v, const int32_t *stop,
                                    int n_stop, uint8_t *own)
{
    uint8_t *allow = own;
    if (sched_guide_done(g)) {
        int n = 0;
        memset(allow, 0, (size_t)v->n);
        for (int i = 0; i < n_stop; i++)
            if (stop[i] >= 0 && stop[i] < v->n) allow[stop[i]] = 1, n++;
        /* a tokenizer without stop ids: nothing can end the reply, so nothing is held back
         * (an all-zero mask would fail the whole step) */
        if (!n) memset(allow, 1, (size_t)v->n);
        return own;
    }
    struct sched_guide k = canon(g);
    uint64_t h = key_hash(&k);
    const uint8_t *m = NULL;
    uint64_t uid = sched_schema_uid(g->schema);
    for (int i = 0; i < GUIDE_CACHE && !m; i++)
        if (v->cache[i].mask && v->cache[i].hash == h && v->cache[i].uid == uid &&
            !memcmp(&v->cache[i].key, &k, sizeof k)) {
            v->cache[i].epoch = v->epoch;
            m = v->cache[i].mask;
        }
    if (m && !sched_guide_can_stop(g)) return m;
    if (m) {
        /* a regex or grammar output that may end here or go on: its mask plus the stop ids */
        memcpy(own, m, (size_t)v->n);
        for (int i = 0; i < n_stop; i++)
            if (stop[i] >= 0 && stop[i] < v->n) own[stop[i]] = 1;
        return own;
    }
    compute_mask(g, v, own);
    if (!memchr(own, 1, (size_t)v->n)) {
        /* a dead end (a recursive schema at the nesting limit, a pattern no
         * string of its maxLength matches): end the output rather than fail
         * the step with an all-zero mask */
        int n = 0;
        for (int i = 0; i < n_stop; i++)
            if (stop[i] >= 0 && stop[i] < v->n) own[stop[i]] = 1, n++;
        if (!n) memset(own, 1, (size_t)v->n);
    }
    for (int j = 0; j < GUIDE_CACHE; j++) {
        int slot = (v->next + j) % GUIDE_CACHE;
        if (v->cache[slot].mask && v->cache[slot].epoch == v->epoch) continue; /* handed out: in use */
        if (!v->cache[slot].mask) v->cache[slot].mask = malloc((size_t)v->n);
        if (!v->cache[slot].mask) break;
        v->cache[slot].key = k, v->cache[slot].hash = h, v->cache[slot].uid = uid, v->cache[slot].epoch = 0;
        memcpy(v->cache[slot].mask, own, (size_t)v->n);
        v->next = (slot + 1) % GUIDE_CACHE;
        break;
    }
    if (sched_guide_can_stop(g))
        for (int i = 0; i < n_stop; i++)
            if (stop[i] >= 0 && stop[i] < v->n) own[stop[i]] = 1;
    return own;
}

void sched_guide_mask(const struct sched_guide *g, struct sched_guide_vocab *v, const int32_t *stop, int n_stop,
                      uint8_t *allow)
{
    const uint8_t *m = sched_guide_mask_ref(g, v, stop, n_stop, allow);
    if (m != allow) memcpy(allow, m, (size_t)v->n);
}

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
#include <string.h>

#include "sched.h"

#define GUIDE_MAX_WS 16

enum {
    G_START,        /* before the top-level object: whitespace, then '{' */
    G_VALUE,        /* a value must start */
    G_KEY_OR_END,   /* just after '{': a key or '}' */
    G_KEY,          /* after ',' in an object: a key */
    G_COLON,        /* after a key */
    G_VALUE_OR_END, /* just after '[': a value or ']' */
    G_AFTER,        /* after a value: ',' or the closing bracket of the container */
    G_STRING,       /* inside a string (key or value) */
    G_ESC,          /* after a backslash */
    G_HEX,          /* inside \uXXXX: hex left in n */
    G_NUM,          /* inside a number: sub-state in n */
    G_LIT,          /* inside true/false/null: lit[n] is the next byte */
    G_DONE,         /* the top-level object closed */
};

/* number sub-states */
enum { N_MINUS, N_ZERO, N_INT, N_DOT, N_FRAC, N_E, N_ESIGN, N_EXP };

static bool ws(uint8_t c) { return c == ' ' || c == '\t' || c == '\n' || c == '\r'; }
static bool digit(uint8_t c) { return c >= '0' && c <= '9'; }
static bool hex(uint8_t c) { return digit(c) || (c >= 'a' && c <= 'f') || (c >= 'A' && c <= 'F'); }

void sched_guide_init(struct sched_guide *g)
{
    memset(g, 0, sizeof *g);
    g->state = G_START;
}

bool sched_guide_done(const struct sched_guide *g) { return g->state == G_DONE; }

/* A value ended: back to the container. */
static void value_end(struct sched_guide *g) { g->state = G_AFTER; }

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
    case '"': g->state = G_STRING, g->key = false; return true;
    case '-': g->state = G_NUM, g->n = N_MINUS; return true;
    case '0': g->state = G_NUM, g->n = N_ZERO; return true;
    case 't': g->state = G_LIT, g->lit = "true", g->n = 1; return true;
    case 'f': g->state = G_LIT, g->lit = "false", g->n = 1; return true;
    case 'n': g->state = G_LIT, g->lit = "null", g->n = 1; return true;
    default:
        if (c >= '1' && c <= '9') {
            g->state = G_NUM, g->n = N_INT;
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
    if ((c == '}' && top == '{') || (c == ']' && top == '[')) {
        g->depth--;
        g->state = g->depth == 0 ? G_DONE : G_AFTER;
        return true;
    }
    return false;
}

bool sched_guide_step(struct sched_guide *g, uint8_t c)
{
    bool space = ws(c);
    switch (g->state) {
    case G_STRING: case G_ESC: case G_HEX: case G_NUM: case G_LIT: break;
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
        if (c == ']') {
            g->depth--;
            g->state = g->depth == 0 ? G_DONE : G_AFTER;
            return true;
        }
        return start_value(g, c);
    case G_KEY_OR_END:
        if (c == '}') {
            g->depth--;
            g->state = g->depth == 0 ? G_DONE : G_AFTER;
            return true;
        }
        /* fall through */
    case G_KEY:
        if (c != '"') return false;
        g->state = G_STRING, g->key = true;
        return true;
    case G_COLON:
        if (c != ':') return false;
        g->state = G_VALUE;
        return true;
    case G_AFTER:
        return after(g, c);
    case G_STRING:
        if (c == '"') {
            if (g->key) g->state = G_COLON;
            else value_end(g);
            return true;
        }
        if (c == '\\') {
            g->state = G_ESC;
            return true;
        }
        return c >= 0x20; /* control characters must be escaped */
    case G_ESC:
        if (c == 'u') {
            g->state = G_HEX, g->n = 4;
            return true;
        }
        if (!strchr("\"\\/bfnrt", c) || !c) return false;
        g->state = G_STRING;
        return true;
    case G_HEX:
        if (!hex(c)) return false;
        if (--g->n == 0) g->state = G_STRING;
        return true;
    case G_LIT:
        if (c != (uint8_t)g->lit[g->n]) return false;
        if (!g->lit[++g->n]) value_end(g);
        return true;
    case G_NUM:
        switch (g->n) {
        case N_MINUS:
            if (c == '0') g->n = N_ZERO;
            else if (c >= '1' && c <= '9') g->n = N_INT;
            else return false;
            return true;
        case N_INT:
            if (digit(c)) return true;
            /* fall through */
        case N_ZERO:
            if (c == '.') g->n = N_DOT;
            else if (c == 'e' || c == 'E') g->n = N_E;
            else break;
            return true;
        case N_DOT:
            if (!digit(c)) return false;
            g->n = N_FRAC;
            return true;
        case N_FRAC:
            if (digit(c)) return true;
            if (c == 'e' || c == 'E') {
                g->n = N_E;
                return true;
            }
            break;
        case N_E:
            if (c == '+' || c == '-') g->n = N_ESIGN;
            else if (digit(c)) g->n = N_EXP;
            else return false;
            return true;
        case N_ESIGN:
            if (!digit(c)) return false;
            g->n = N_EXP;
            return true;
        case N_EXP:
            if (digit(c)) return true;
            break;
        default:
            return false;
        }
        /* the number ended at a complete state: c belongs to what follows */
        value_end(g);
        g->n_ws = 0;
        if (space) return ++g->n_ws <= GUIDE_MAX_WS;
        return after(g, c);
    case G_DONE:
    default:
        return false;
    }
}

void sched_guide_mask(const struct sched_guide *g, const model_tok *tok, int n_vocab, const int32_t *stop,
                      int n_stop, uint8_t *allow)
{
    bool done = sched_guide_done(g);
    for (int t = 0; t < n_vocab; t++) {
        allow[t] = 0;
        if (done) continue;
        size_t len = 0;
        const char *b = model_tok_bytes(tok, t, &len);
        if (!b || !len || model_tok_attr(tok, t) != MODEL_TOK_NORMAL) continue;
        struct sched_guide c = *g;
        size_t i = 0;
        while (i < len && sched_guide_step(&c, (uint8_t)b[i])) i++;
        allow[t] = i == len;
    }
    for (int i = 0; done && i < n_stop; i++)
        if (stop[i] >= 0 && stop[i] < n_vocab) allow[stop[i]] = 1;
}

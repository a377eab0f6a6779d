/* json.c - the jsmn wrapper declared in json.h. */
#define JSMN_STRICT
#define JSMN_PARENT_LINKS
#include <jsmn.h>

#include "json.h"

#include <errno.h>
#include <math.h>
#include <stdarg.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "base.h"

static int hex4(const char *s, unsigned *out)
{
    unsigned v = 0;
    for (int j = 0; j < 4; j++) {
        char c = s[j];
        v <<= 4;
        if (c >= '0' && c <= '9') v |= (unsigned)(c - '0');
        else if (c >= 'a' && c <= 'f') v |= (unsigned)(c - 'a' + 10);
        else if (c >= 'A' && c <= 'F') v |= (unsigned)(c - 'A' + 10);
        else return -1;
    }
    *out = v;
    return 0;
}

/* jsmn checks little of the grammar (it accepts "[1 2]", "{\"a\"}", "[1,]",
 * "[01]", "[nul]"), and a wrong structure would make token sizes lie. So the
 * text is first checked against the JSON grammar (RFC 8259) here; jsmn then
 * only has to tokenize text that is known to be valid. */
#define JSON_MAX_DEPTH 512

struct vstate {
    const char *s;
    size_t len, pos;
};

static void vws(struct vstate *v)
{
    while (v->pos < v->len && (v->s[v->pos] == ' ' || v->s[v->pos] == '\t' || v->s[v->pos] == '\n' ||
                               v->s[v->pos] == '\r'))
        v->pos++;
}

static bool vdigits(struct vstate *v)
{
    size_t st = v->pos;
    while (v->pos < v->len && v->s[v->pos] >= '0' && v->s[v->pos] <= '9') v->pos++;
    return v->pos > st;
}

static bool vnumber(struct vstate *v)
{
    if (v->pos < v->len && v->s[v->pos] == '-') v->pos++;
    if (v->pos < v->len && v->s[v->pos] == '0') v->pos++;
    else if (!vdigits(v)) return false;
    if (v->pos < v->len && v->s[v->pos] == '.') {
        v->pos++;
        if (!vdigits(v)) return false;
    }
    if (v->pos < v->len && (v->s[v->pos] == 'e' || v->s[v->pos] == 'E')) {
        v->pos++;
        if (v->pos < v->len && (v->s[v->pos] == '+' || v->s[v->pos] == '-')) v->pos++;
        if (!vdigits(v)) return false;
    }
    return true;
}

static bool vstring(struct vstate *v)
{
    v->pos++; /* opening quote */
    while (v->pos < v->len) {
        unsigned char c = (unsigned char)v->s[v->pos++];
        if (c == '"') return true;
        if (c < 0x20) return false;
        if (c != '\\') continue;
        if (v->pos >= v->len) return false;
        c = (unsigned char)v->s[v->pos++];
        if (c == 'u') {
            unsigned cp;
            if (v->pos + 4 > v->len || hex4(v->s + v->pos, &cp)) return false;
            v->pos += 4;
        } else if (!strchr("\"\\/bfnrt", c) || c == 0) {
            return false;
        }
    }
    return false;
}

static bool vvalue(struct vstate *v, int depth)
{
    vws(v);
    if (v->pos >= v->len || depth > JSON_MAX_DEPTH) return false;
    char c = v->s[v->pos];
    if (c == '{' || c == '[') {
        char close = c == '{' ? '}' : ']';
        v->pos++;
        vws(v);
        if (v->pos < v->len && v->s[v->pos] == close) {
            v->pos++;
            return true;
        }
        for (;;) {
            if (c == '{') {
                vws(v);
                if (v->pos >= v->len || v->s[v->pos] != '"' || !vstring(v)) return false;
                vws(v);
                if (v->pos >= v->len || v->s[v->pos] != ':') return false;
                v->pos++;
            }
            if (!vvalue(v, depth + 1)) return false;
            vws(v);
            if (v->pos >= v->len) return false;
            if (v->s[v->pos] == close) {
                v->pos++;
                return true;
            }
            if (v->s[v->pos] != ',') return false;
            v->pos++;
        }
    }
    if (c == '"') return vstring(v);
    static const char *lits[] = {"true", "false", "null"};
    for (int i = 0; i < 3; i++) {
        size_t n = strlen(lits[i]);
        if (v->len - v->pos >= n && memcmp(v->s + v->pos, lits[i], n) == 0) {
            v->pos += n;
            return true;
        }
    }
    return vnumber(v);
}

/* 0 when src is exactly one JSON value with optional surrounding whitespace. */
static int validate(const char *src, size_t len, size_t *where)
{
    struct vstate v = {src, len, 0};
    bool ok = vvalue(&v, 0);
    if (ok) vws(&v);
    *where = v.pos;
    if (!ok) return -1;
    return v.pos == len ? 0 : -2;
}

int json_parse(json_doc *d, const char *src, size_t len, char *err, size_t errlen)
{
    memset(d, 0, sizeof *d);
    size_t where;
    int vr = validate(src, len, &where);
    if (vr == -2) {
        snprintf(err, errlen, "invalid JSON: trailing data after the value at byte %zu", where);
        return SL_EINVAL;
    }
    if (vr) {
        snprintf(err, errlen, "invalid JSON%s near byte %zu", where >= len ? " (truncated)" : "", where);
        return SL_EINVAL;
    }
    /* A bare primitive at the root: jsmn (strict) wants a delimiter after it. */
    size_t b = 0, e = len;
    while (b < len && strchr(" \t\r\n", src[b])) b++;
    while (e > b && strchr(" \t\r\n", src[e - 1])) e--;
    if (src[b] != '{' && src[b] != '[' && src[b] != '"') {
        if (e > 0x7fffffff) {
            snprintf(err, errlen, "JSON value too long");
            return SL_EINVAL;
        }
        jsmntok_t *t = calloc(1, sizeof *t);
        if (!t) {
            snprintf(err, errlen, "out of memory parsing JSON");
            return SL_ENOMEM;
        }
        t->type = JSMN_PRIMITIVE;
        t->start = (int)b;
        t->end = (int)e;
        t->size = 0;
        d->src = src;
        d->len = len;
        d->tok = t;
        d->n = 1;
        return 0;
    }
    jsmn_parser p;
    jsmn_init(&p);
    int n = jsmn_parse(&p, src, len, NULL, 0);
    if (n < 0 || n == 0) {
        snprintf(err, errlen, "invalid JSON%s near byte %u",
                 n == JSMN_ERROR_PART ? " (truncated)" : "", p.pos);
        return SL_EINVAL;
    }
    jsmntok_t *tok = malloc(sizeof *tok * (size_t)n);
    if (!tok) {
        snprintf(err, errlen, "out of memory parsing JSON (%d tokens)", n);
        return SL_ENOMEM;
    }
    jsmn_init(&p);
    int m = jsmn_parse(&p, src, len, tok, (unsigned)n);
    if (m != n) {
        free(tok);
        snprintf(err, errlen, "invalid JSON near byte %u", p.pos);
        return SL_EINVAL;
    }
    /* jsmn stops after the first complete value when the root is a
     * container, but accepts several top-level values: refuse trailing text. */
    d->src = src;
    d->len = len;
    d->tok = tok;
    d->n = n;
    int end = json_skip(d, 0);
    size_t tail = tok[0].end > 0 ? (size_t)tok[0].end : 0;
    if (tok[0].type == JSMN_STRING && tail < len) tail++; /* closing quote */
    while (tail < len && strchr(" \t\r\n", src[tail])) tail++;
    if (end != n || tail != len) {
        free(tok);
        memset(d, 0, sizeof *d);
        snprintf(err, errlen, "invalid JSON: trailing data after the value");
        return SL_EINVAL;
    }
    return 0;
}

void json_free(json_doc *d)
{
    if (!d) return;
    free(d->tok);
    memset(d, 0, sizeof *d);
}

int json_skip(const json_doc *d, int i)
{
    int remaining = 1;
    while (remaining > 0 && i < d->n) {
        remaining += d->tok[i].size;
        remaining--;
        i++;
    }
    return i;
}

static bool valid(const json_doc *d, int i) { return d && i >= 0 && i < d->n; }

bool json_is_obj(const json_doc *d, int i) { return valid(d, i) && d->tok[i].type == JSMN_OBJECT; }
bool json_is_arr(const json_doc *d, int i) { return valid(d, i) && d->tok[i].type == JSMN_ARRAY; }
bool json_is_str(const json_doc *d, int i) { return valid(d, i) && d->tok[i].type == JSMN_STRING; }

static bool prim_is(const json_doc *d, int i, char c)
{
    return valid(d, i) && d->tok[i].type == JSMN_PRIMITIVE && d->src[d->tok[i].start] == c;
}
bool json_is_null(const json_doc *d, int i) { return prim_is(d, i, 'n'); }
bool json_is_bool(const json_doc *d, int i) { return prim_is(d, i, 't') || prim_is(d, i, 'f'); }
bool json_is_num(const json_doc *d, int i)
{
    return valid(d, i) && d->tok[i].type == JSMN_PRIMITIVE && !json_is_null(d, i) && !json_is_bool(d, i);
}
int json_size(const json_doc *d, int i) { return valid(d, i) ? d->tok[i].size : 0; }

const char *json_raw(const json_doc *d, int i, size_t *len)
{
    if (!valid(d, i)) {
        *len = 0;
        return "";
    }
    *len = (size_t)(d->tok[i].end - d->tok[i].start);
    return d->src + d->tok[i].start;
}

int json_get(const json_doc *d, int obj, const char *key)
{
    if (!json_is_obj(d, obj)) return -1;
    int k = obj + 1;
    for (int m = 0; m < d->tok[obj].size; m++) {
        if (json_str_eq(d, k, key)) return k + 1;
        k = json_skip(d, k + 1);
    }
    return -1;
}

int json_at(const json_doc *d, int arr, int k)
{
    if (!json_is_arr(d, arr) || k < 0 || k >= d->tok[arr].size) return -1;
    int i = arr + 1;
    while (k-- > 0) i = json_skip(d, i);
    return i;
}

static size_t utf8_put(unsigned cp, char *o)
{
    if (cp < 0x80) { o[0] = (char)cp; return 1; }
    if (cp < 0x800) { o[0] = (char)(0xC0 | (cp >> 6)); o[1] = (char)(0x80 | (cp & 0x3F)); return 2; }
    if (cp < 0x10000) {
        o[0] = (char)(0xE0 | (cp >> 12)); o[1] = (char)(0x80 | ((cp >> 6) & 0x3F));
        o[2] = (char)(0x80 | (cp & 0x3F));
        return 3;
    }
    o[0] = (char)(0xF0 | (cp >> 18)); o[1] = (char)(0x80 | ((cp >> 12) & 0x3F));
    o[2] = (char)(0x80 | ((cp >> 6) & 0x3F)); o[3] = (char)(0x80 | (cp & 0x3F));
    return 4;
}


long json_str(const json_doc *d, int i, char *out, size_t cap)
{
    if (!json_is_str(d, i)) return -1;
    size_t n;
    const char *s = json_raw(d, i, &n);
    size_t o = 0;
    char tmp[4];
    for (size_t j = 0; j < n; j++) {
        const char *chunk = s + j;
        size_t clen = 1;
        if (s[j] == '\\') {
            if (++j >= n) return -1;
            char c = s[j];
            chunk = tmp;
            switch (c) {
            case '"': tmp[0] = '"'; break;
            case '\\': tmp[0] = '\\'; break;
            case '/': tmp[0] = '/'; break;
            case 'b': tmp[0] = '\b'; break;
            case 'f': tmp[0] = '\f'; break;
            case 'n': tmp[0] = '\n'; break;
            case 'r': tmp[0] = '\r'; break;
            case 't': tmp[0] = '\t'; break;
            case 'u': {
                unsigned cp;
                if (j + 5 > n || hex4(s + j + 1, &cp)) return -1;
                j += 4;
                if (cp >= 0xD800 && cp < 0xDC00) {
                    unsigned lo;
                    if (j + 7 <= n && s[j + 1] == '\\' && s[j + 2] == 'u' && !hex4(s + j + 3, &lo) &&
                        lo >= 0xDC00 && lo < 0xE000) {
                        cp = 0x10000 + ((cp - 0xD800) << 10) + (lo - 0xDC00);
                        j += 6;
                    } else {
                        cp = 0xFFFD; /* lone high surrogate */
                    }
                } else if (cp >= 0xDC00 && cp < 0xE000) {
                    cp = 0xFFFD;
                }
                clen = utf8_put(cp, tmp);
                break;
            }
            default: return -1;
            }
        }
        for (size_t k = 0; k < clen; k++, o++)
            if (o + 1 < cap) out[o] = chunk[k];
    }
    if (cap > 0) out[o < cap ? o : cap - 1] = '\0';
    return (long)o;
}

bool json_str_eq(const json_doc *d, int i, const char *key)
{
    if (!json_is_str(d, i)) return false;
    size_t n;
    const char *s = json_raw(d, i, &n);
    size_t kl = strlen(key);
    if (!memchr(s, '\\', n)) return n == kl && memcmp(s, key, n) == 0;
    char small[256], *buf = n < sizeof small ? small : malloc(n + 1); /* unescaping never grows */
    if (!buf) return false;
    long m = json_str(d, i, buf, n + 1);
    bool eq = m >= 0 && (size_t)m == kl && memcmp(buf, key, kl) == 0;
    if (buf != small) free(buf);
    return eq;
}

char *json_strdup(const json_doc *d, int i, size_t *len)
{
    if (!json_is_str(d, i)) return NULL;
    size_t n;
    json_raw(d, i, &n);
    char *out = malloc(n + 1); /* unescaping never grows the text */
    if (!out) return NULL;
    long m = json_str(d, i, out, n + 1);
    if (m < 0) {
        free(out);
        return NULL;
    }
    if (len) *len = (size_t)m;
    return out;
}

int json_f64(const json_doc *d, int i, double *out)
{
    if (!json_is_num(d, i)) return -1;
    size_t n;
    const char *s = json_raw(d, i, &n);
    char small[64], *buf = n < sizeof small ? small : malloc(n + 1);
    if (!buf || n == 0) return -1;
    memcpy(buf, s, n);
    buf[n] = '\0';
    char *end;
    errno = 0;
    double v = strtod(buf, &end);
    bool ok = !*end && errno != ERANGE && isfinite(v);
    /* underflow to a subnormal or zero is fine: ERANGE with a tiny result */
    if (!*end && errno == ERANGE && fabs(v) <= 2.3e-308) ok = true;
    if (buf != small) free(buf);
    if (!ok) return -1;
    *out = v;
    return 0;
}

int json_i64(const json_doc *d, int i, int64_t *out)
{
    if (!json_is_num(d, i)) return -1;
    size_t n;
    const char *s = json_raw(d, i, &n);
    if (!memchr(s, '.', n) && !memchr(s, 'e', n) && !memchr(s, 'E', n)) {
        /* a plain integer: exact over the whole int64 range */
        char buf[32];
        if (n == 0 || n >= sizeof buf) return -1;
        memcpy(buf, s, n);
        buf[n] = '\0';
        char *end;
        errno = 0;
        long long v = strtoll(buf, &end, 10);
        if (*end || errno == ERANGE) return -1;
        *out = v;
        return 0;
    }
    /* 1e3 or 2.0: integral values that a double holds exactly */
    double v;
    if (json_f64(d, i, &v)) return -1;
    if (v != floor(v) || fabs(v) > 9007199254740992.0) return -1;
    *out = (int64_t)v;
    return 0;
}

int json_bool(const json_doc *d, int i, bool *out)
{
    if (!json_is_bool(d, i)) return -1;
    *out = d->src[d->tok[i].start] == 't';
    return 0;
}

void json_buf_init(struct json_buf *b) { memset(b, 0, sizeof *b); }

void json_buf_free(struct json_buf *b)
{
    free(b->p);
    memset(b, 0, sizeof *b);
}

static bool reserve(struct json_buf *b, size_t extra)
{
    if (b->oom) return false;
    if (b->len + extra + 1 <= b->cap) return true;
    size_t cap = b->cap ? b->cap : 256;
    while (cap < b->len + extra + 1) cap *= 2;
    char *p = realloc(b->p, cap);
    if (!p) {
        b->oom = true;
        return false;
    }
    b->p = p;
    b->cap = cap;
    return true;
}

void json_buf_add(struct json_buf *b, const char *s, size_t n)
{
    if (!reserve(b, n)) return;
    memcpy(b->p + b->len, s, n);
    b->len += n;
    b->p[b->len] = '\0';
}

void json_buf_addf(struct json_buf *b, const char *fmt, ...)
{
    va_list ap;
    va_start(ap, fmt);
    char small[256];
    int n = vsnprintf(small, sizeof small, fmt, ap);
    va_end(ap);
    if (n < 0) return;
    if ((size_t)n < sizeof small) {
        json_buf_add(b, small, (size_t)n);
        return;
    }
    if (!reserve(b, (size_t)n)) return;
    va_start(ap, fmt);
    vsnprintf(b->p + b->len, (size_t)n + 1, fmt, ap);
    va_end(ap);
    b->len += (size_t)n;
}

/* Length of the valid UTF-8 sequence at s[0..n), or 0 when it is not one
 * (bad lead, missing continuation, overlong form, surrogate, > U+10FFFF). */
static size_t utf8_valid_len(const unsigned char *s, size_t n)
{
    unsigned c = s[0];
    size_t len;
    unsigned min;
    if (c < 0x80) return 1;
    if (c >= 0xC2 && c <= 0xDF) len = 2, min = 0x80;
    else if (c >= 0xE0 && c <= 0xEF) len = 3, min = 0x800;
    else if (c >= 0xF0 && c <= 0xF4) len = 4, min = 0x10000;
    else return 0;
    if (n < len) return 0;
    unsigned cp = c & (0x7F >> len);
    for (size_t k = 1; k < len; k++) {
        if ((s[k] & 0xC0) != 0x80) return 0;
        cp = (cp << 6) | (s[k] & 0x3F);
    }
    if (cp < min || cp > 0x10FFFF || (cp >= 0xD800 && cp < 0xE000)) return 0;
    return len;
}

/* Always valid JSON and valid UTF-8: control characters are escaped and each
 * byte that does not start a valid UTF-8 sequence becomes U+FFFD. */
void json_buf_add_str(struct json_buf *b, const char *s, size_t n)
{
    const unsigned char *u = (const unsigned char *)s;
    json_buf_add(b, "\"", 1);
    size_t run = 0;
    for (size_t j = 0; j < n;) {
        unsigned char c = u[j];
        if (c >= 0x80) {
            size_t len = utf8_valid_len(u + j, n - j);
            if (len) {
                j += len;
                continue;
            }
            json_buf_add(b, s + run, j - run);
            json_buf_add(b, "\xEF\xBF\xBD", 3);
            run = ++j;
            continue;
        }
        if (c >= 0x20 && c != '"' && c != '\\') {
            j++;
            continue;
        }
        json_buf_add(b, s + run, j - run);
        run = ++j;
        switch (c) {
        case '"': json_buf_add(b, "\\\"", 2); break;
        case '\\': json_buf_add(b, "\\\\", 2); break;
        case '\n': json_buf_add(b, "\\n", 2); break;
        case '\r': json_buf_add(b, "\\r", 2); break;
        case '\t': json_buf_add(b, "\\t", 2); break;
        default: json_buf_addf(b, "\\u%04x", c); break;
        }
    }
    json_buf_add(b, s + run, n - run);
    json_buf_add(b, "\"", 1);
}

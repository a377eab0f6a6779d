/* json.h - a parsed JSON document on top of jsmn, for reading (config.json,
 * tokenizer.json, safetensors headers, request bodies).
 *
 * json_parse() tokenizes a buffer that the caller keeps alive; values are
 * addressed by token index. Strings come back unescaped into caller buffers.
 * A json_doc is immutable after parsing; any thread may read it.
 */
#ifndef SLUICE_JSON_H
#define SLUICE_JSON_H

#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>

#define JSMN_PARENT_LINKS /* O(1) closing of containers: tokenizer.json has 49K-key objects */
#define JSMN_HEADER
#include <jsmn.h>

typedef struct json_doc {
    const char *src;   /* borrowed: the text parsed */
    size_t len;
    jsmntok_t *tok;    /* owned */
    int n;             /* tokens used; token 0 is the root */
} json_doc;

/* Parses src[0..len). Returns 0, or a negative sl_status with a message
 * (position of the error) in err. On error nothing is allocated. */
int json_parse(json_doc *d, const char *src, size_t len, char *err, size_t errlen);
void json_free(json_doc *d);

/* Token index just after the value at i (skips nested values). */
int json_skip(const json_doc *d, int i);
/* Value of key in the object at i, or -1. */
int json_get(const json_doc *d, int obj, const char *key);
/* Element k of the array at i, or -1 (O(k)). */
int json_at(const json_doc *d, int arr, int k);

bool json_is_obj(const json_doc *d, int i);
bool json_is_arr(const json_doc *d, int i);
bool json_is_str(const json_doc *d, int i);
bool json_is_null(const json_doc *d, int i);
bool json_is_bool(const json_doc *d, int i);
bool json_is_num(const json_doc *d, int i);
int json_size(const json_doc *d, int i); /* members of an object / elements of an array */

/* Raw token text (for strings: between the quotes, still escaped). */
const char *json_raw(const json_doc *d, int i, size_t *len);
/* true when the string at i, unescaped, equals s. */
bool json_str_eq(const json_doc *d, int i, const char *s);
/* Unescapes the string at i into out (cap bytes, NUL added when it fits).
 * Returns the unescaped length (may exceed cap - 1), or -1 if not a string
 * or the escape sequence is invalid. \uXXXX surrogate pairs become UTF-8. */
long json_str(const json_doc *d, int i, char *out, size_t cap);
/* Unescaped copy in a new malloc'ed NUL-terminated buffer (caller frees), or NULL. */
char *json_strdup(const json_doc *d, int i, size_t *len);

/* Numbers and bools: return 0 and set *out, or -1 if the value is not of that
 * kind (json_i64 also refuses non-integers and out-of-range values). */
int json_f64(const json_doc *d, int i, double *out);
int json_i64(const json_doc *d, int i, int64_t *out);
int json_bool(const json_doc *d, int i, bool *out);

/* Appends s as a JSON string literal (quotes and escapes) to a growing buffer. */
struct json_buf {
    char *p;     /* owned, NUL-terminated */
    size_t len, cap;
    bool oom;    /* set when an append failed; further appends are dropped */
};
void json_buf_init(struct json_buf *b);
void json_buf_free(struct json_buf *b);
void json_buf_add(struct json_buf *b, const char *s, size_t n);
void json_buf_addf(struct json_buf *b, const char *fmt, ...) __attribute__((format(printf, 2, 3)));
void json_buf_add_str(struct json_buf *b, const char *s, size_t n); /* quoted + escaped */
/* Appends a string literal (its length counted by the compiler). */
#define json_buf_lit(b, lit) json_buf_add((b), "" lit, sizeof(lit) - 1)

#endif

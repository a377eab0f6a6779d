/* tok_hf.c - a byte-level BPE model_tok from a Hugging Face directory:
 * tokenizer.json (model BPE, vocab, merges, added_tokens, pre_tokenizer),
 * tokenizer_config.json (bos/eos strings, add_bos_token) and
 * generation_config.json (eos_token_id int or list -> stop ids).
 *
 * Supported pre_tokenizers: ByteLevel (use_regex adds the GPT-2 regex;
 * add_prefix_space is refused), Split with behavior Isolated (Regex or
 * String pattern), Digits, and a Sequence of those. Normalizer: none or NFC
 * (NFC is assumed of the input, not applied). Added tokens' lstrip/rstrip/
 * single_word/normalized flags are not applied.
 */
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "base/json.h"
#include "tok_internal.h"
#include "tokenizer.h"

#define SET_ERR(...) ((void)(err && errlen ? snprintf(err, errlen, __VA_ARGS__) : 0))

/* Reads a whole file into a NUL-terminated malloc'ed buffer; NULL if it
 * cannot be opened (errno kept) or read. */
static char *slurp(const char *dir, const char *name, size_t *len)
{
    char path[4096];
    if ((size_t)snprintf(path, sizeof path, "%s/%s", dir, name) >= sizeof path) return NULL;
    FILE *f = fopen(path, "rb");
    if (!f) return NULL;
    char *buf = NULL;
    if (fseek(f, 0, SEEK_END) != 0) goto out;
    long n = ftell(f);
    if (n < 0 || fseek(f, 0, SEEK_SET) != 0) goto out;
    buf = malloc((size_t)n + 1);
    if (!buf) goto out;
    if (fread(buf, 1, (size_t)n, f) != (size_t)n) {
        free(buf);
        buf = NULL;
        goto out;
    }
    buf[n] = 0;
    *len = (size_t)n;
out:
    fclose(f);
    return buf;
}

/* A value that is either a string or an AddedToken object {"content": ...}. */
static char *token_string(const json_doc *d, int v)
{
    if (json_is_obj(d, v)) v = json_get(d, v, "content");
    return json_is_str(d, v) ? json_strdup(d, v, NULL) : NULL;
}

struct pre_list {
    char *pat[TOK_MAX_REGEX];
    int n;
    bool byte_level;
};

static int pre_add(struct pre_list *p, char *pat, char *err, size_t errlen)
{
    if (!pat) {
        SET_ERR("tokenizer.json: out of memory");
        return SL_ENOMEM;
    }
    if (p->n == TOK_MAX_REGEX) {
        free(pat);
        SET_ERR("tokenizer.json: more than %d pre-tokenizer splits", TOK_MAX_REGEX);
        return SL_EUNSUP;
    }
    p->pat[p->n++] = pat;
    return 0;
}

/* A literal string as a PCRE2 pattern. */
static char *quote_literal(const char *s)
{
    size_t n = strlen(s);
    char *q = malloc(2 * n + 1), *o = q;
    if (!q) return NULL;
    for (; *s; s++) {
        unsigned char c = (unsigned char)*s;
        if (c < 0x80 && !((c >= '0' && c <= '9') || (c >= 'a' && c <= 'z') || (c >= 'A' && c <= 'Z')))
            *o++ = '\\';
        *o++ = (char)c;
    }
    *o = 0;
    return q;
}

static int pre_one(const json_doc *d, int pt, struct pre_list *p, char *err, size_t errlen)
{
    int ty = json_get(d, pt, "type");
    char type[64];
    if (json_str(d, ty, type, sizeof type) < 0) {
        SET_ERR("tokenizer.json: pre_tokenizer without a type");
        return SL_EFORMAT;
    }
    if (strcmp(type, "Sequence") == 0) {
        int arr = json_get(d, pt, "pretokenizers");
        if (!json_is_arr(d, arr)) {
            SET_ERR("tokenizer.json: Sequence pre_tokenizer without pretokenizers");
            return SL_EFORMAT;
        }
        for (int i = arr + 1, k = 0; k < json_size(d, arr); k++, i = json_skip(d, i)) {
            int rc = pre_one(d, i, p, err, errlen);
            if (rc) return rc;
        }
        return 0;
    }
    if (strcmp(type, "ByteLevel") == 0) {
        bool b = false;
        if (json_bool(d, json_get(d, pt, "add_prefix_space"), &b) == 0 && b) {
            SET_ERR("tokenizer.json: ByteLevel add_prefix_space=true is not supported");
            return SL_EUNSUP;
        }
        p->byte_level = true;
        b = true;
        (void)json_bool(d, json_get(d, pt, "use_regex"), &b);
        return b ? pre_add(p, strdup(tok_gpt2_regex), err, errlen) : 0;
    }
    if (strcmp(type, "Digits") == 0) {
        bool ind = false;
        (void)json_bool(d, json_get(d, pt, "individual_digits"), &ind);
        return pre_add(p, strdup(ind ? "\\p{N}" : "\\p{N}+"), err, errlen);
    }
    if (strcmp(type, "Split") == 0) {
        bool inv = false;
        (void)json_bool(d, json_get(d, pt, "invert"), &inv);
        int beh = json_get(d, pt, "behavior");
        if (inv || !json_str_eq(d, beh, "Isolated")) {
            SET_ERR("tokenizer.json: Split pre_tokenizer with behavior other than Isolated (or "
                    "invert) is not supported");
            return SL_EUNSUP;
        }
        int pat = json_get(d, pt, "pattern"), v;
        if ((v = json_get(d, pat, "Regex")) >= 0 && json_is_str(d, v))
            return pre_add(p, json_strdup(d, v, NULL), err, errlen);
        if ((v = json_get(d, pat, "String")) >= 0 && json_is_str(d, v)) {
            char *s = json_strdup(d, v, NULL);
            char *q = s ? quote_literal(s) : NULL;
            free(s);
            return pre_add(p, q, err, errlen);
        }
        SET_ERR("tokenizer.json: Split pre_tokenizer without a Regex or String pattern");
        return SL_EFORMAT;
    }
    SET_ERR("tokenizer.json: unsupported pre_tokenizer type '%s'", type);
    return SL_EUNSUP;
}

/* Member iteration over a JSON object: key at k, value at k + 1. */
#define OBJ_FOREACH(d, obj, k, m) \
    for (int k = (obj) + 1, m = 0; m < json_size(d, obj); m++, k = json_skip(d, k + 1))

static int load_tokenizer_json(const char *dir, model_tok **out, char *err, size_t errlen)
{
    size_t len = 0;
    char *src = slurp(dir, "tokenizer.json", &len);
    json_doc d;
    model_tok *t = NULL;
    struct pre_list pre = {0};
    char *s = NULL;
    int rc;
    if (!src) {
        SET_ERR("tokenizer: cannot read %s/tokenizer.json", dir);
        return SL_EIO;
    }
    if ((rc = json_parse(&d, src, len, err, errlen))) goto fail_src;
    rc = SL_EFORMAT;
    int model = json_get(&d, 0, "model");
    if (!json_is_obj(&d, model)) {
        SET_ERR("tokenizer.json: no model object");
        goto fail_doc;
    }
    int ty = json_get(&d, model, "type");
    if (ty >= 0 && !json_str_eq(&d, ty, "BPE")) {
        char name[32] = "?";
        json_str(&d, ty, name, sizeof name);
        SET_ERR("tokenizer: unsupported tokenizer model '%s' in tokenizer.json: only byte-level BPE "
                "is supported",
                name);
        rc = SL_EUNSUP;
        goto fail_doc;
    }
    int vocab = json_get(&d, model, "vocab"), merges = json_get(&d, model, "merges");
    int added = json_get(&d, 0, "added_tokens");
    if (!json_is_obj(&d, vocab) || json_size(&d, vocab) == 0) {
        SET_ERR("tokenizer.json: model.vocab is missing or empty");
        goto fail_doc;
    }
    if (merges >= 0 && !json_is_arr(&d, merges)) {
        SET_ERR("tokenizer.json: model.merges is not an array");
        goto fail_doc;
    }

    /* n_vocab: one past the largest id of the vocab and the added tokens. */
    int64_t max_id = -1, v;
    OBJ_FOREACH(&d, vocab, k, m) {
        if (!json_is_str(&d, k) || json_i64(&d, k + 1, &v) != 0 || v < 0 || v >= (1 << 24)) {
            SET_ERR("tokenizer.json: vocab entry %d has no valid id", m);
            goto fail_doc;
        }
        if (v > max_id) max_id = v;
    }
    if (json_is_arr(&d, added)) {
        for (int i = added + 1, k = 0; k < json_size(&d, added); k++, i = json_skip(&d, i)) {
            if (json_i64(&d, json_get(&d, i, "id"), &v) != 0 || v < 0 || v >= (1 << 24) ||
                !json_is_str(&d, json_get(&d, i, "content"))) {
                SET_ERR("tokenizer.json: added_tokens[%d] has no valid id or content", k);
                goto fail_doc;
            }
            if (v > max_id) max_id = v;
        }
    }
    if (!(t = tok_alloc((int)max_id + 1, err, errlen))) goto fail_doc;

    size_t cap_s = 256;
    if (!(s = malloc(cap_s))) goto fail_oom;
    OBJ_FOREACH(&d, vocab, k, m) {
        long n = json_str(&d, k, s, cap_s);
        if (n >= 0 && (size_t)n >= cap_s) {
            free(s);
            cap_s = (size_t)n + 1;
            if (!(s = malloc(cap_s))) goto fail_oom;
            n = json_str(&d, k, s, cap_s);
        }
        if (n < 0) {
            SET_ERR("tokenizer.json: vocab entry %d has an invalid string", m);
            goto fail_doc;
        }
        json_i64(&d, k + 1, &v);
        if (t->attr[v] != MODEL_TOK_UNUSED) {
            SET_ERR("tokenizer.json: id %lld appears twice in the vocab", (long long)v);
            goto fail_doc;
        }
        if ((rc = tok_set_token(t, (int32_t)v, s, (size_t)n, MODEL_TOK_NORMAL, err, errlen))) goto fail_doc;
    }
    if (json_is_arr(&d, added)) {
        for (int i = added + 1, k = 0; k < json_size(&d, added); k++, i = json_skip(&d, i)) {
            bool special = false;
            size_t n;
            json_i64(&d, json_get(&d, i, "id"), &v);
            (void)json_bool(&d, json_get(&d, i, "special"), &special);
            char *c = json_strdup(&d, json_get(&d, i, "content"), &n);
            if (!c) goto fail_oom;
            rc = tok_set_token(t, (int32_t)v, c, n, special ? MODEL_TOK_CONTROL : MODEL_TOK_USER_DEFINED, err,
                               errlen);
            free(c);
            if (rc) goto fail_doc;
        }
    }
    if ((rc = tok_index_vocab(t, err, errlen))) goto fail_doc;

    /* merges: "a b" strings or ["a", "b"] pairs */
    if (merges >= 0) {
        for (int i = merges + 1, k = 0; k < json_size(&d, merges); k++, i = json_skip(&d, i)) {
            char *a = NULL, *b = NULL;
            size_t al = 0, bl = 0;
            if (json_is_str(&d, i)) {
                a = json_strdup(&d, i, &al);
                char *sp = a && al > 1 ? memchr(a + 1, ' ', al - 1) : NULL;
                if (sp) {
                    b = sp + 1;
                    bl = al - (size_t)(b - a);
                    al = (size_t)(sp - a);
                }
            } else if (json_is_arr(&d, i) && json_size(&d, i) == 2) {
                a = json_strdup(&d, i + 1, &al);
                char *b2 = json_strdup(&d, i + 2, &bl);
                if (b2 && a) {
                    char *ab = realloc(a, al + bl + 1);
                    if (ab) {
                        a = ab;
                        memcpy(a + al, b2, bl + 1);
                        b = a + al;
                    }
                }
                free(b2);
            }
            if (!b) {
                free(a);
                SET_ERR("tokenizer.json: merges[%d] is not a pair of tokens", k);
                rc = SL_EFORMAT;
                goto fail_doc;
            }
            rc = tok_add_merge(t, a, al, b, bl, err, errlen);
            free(a);
            if (rc) goto fail_doc;
        }
    }
    bool im = false;
    if (json_bool(&d, json_get(&d, model, "ignore_merges"), &im) == 0) t->ignore_merges = im;

    int norm = json_get(&d, 0, "normalizer");
    if (norm >= 0 && !json_is_null(&d, norm)) {
        int nt = json_get(&d, norm, "type");
        bool ok = json_str_eq(&d, nt, "NFC") ||
                  (json_str_eq(&d, nt, "Sequence") && json_size(&d, json_get(&d, norm, "normalizers")) == 0);
        if (!ok) {
            char name[64] = "?";
            json_str(&d, nt, name, sizeof name);
            SET_ERR("tokenizer.json: unsupported normalizer '%s'", name);
            rc = SL_EUNSUP;
            goto fail_doc;
        }
    }
    int pt = json_get(&d, 0, "pre_tokenizer");
    if (pt >= 0 && !json_is_null(&d, pt) && (rc = pre_one(&d, pt, &pre, err, errlen))) goto fail_doc;
    if (!pre.byte_level) {
        SET_ERR("tokenizer: tokenizer.json is not byte-level BPE (no ByteLevel pre_tokenizer)");
        rc = SL_EUNSUP;
        goto fail_doc;
    }
    if ((rc = tok_set_pre_regexes(t, "tokenizer.json", (const char *const *)pre.pat, pre.n, err, errlen)))
        goto fail_doc;

    /* BOS from the post-processor's template (TemplateProcessing single:
     * [{SpecialToken: {id: "<s>"}}, {Sequence: ...}]) unless the config says. */
    int post = json_get(&d, 0, "post_processor");
    if (json_str_eq(&d, json_get(&d, post, "type"), "TemplateProcessing")) {
        int first = json_at(&d, json_get(&d, post, "single"), 0);
        int st = json_get(&d, json_get(&d, first, "SpecialToken"), "id");
        size_t n;
        char *c = json_is_str(&d, st) ? json_strdup(&d, st, &n) : NULL;
        if (c) {
            t->bos = model_tok_find(t, c, n);
            t->add_bos = t->bos >= 0;
            free(c);
        }
    }
    json_free(&d);
    free(src);
    free(s);
    for (int i = 0; i < pre.n; i++) free(pre.pat[i]);
    *out = t;
    return 0;

fail_oom:
    SET_ERR("tokenizer: out of memory reading tokenizer.json");
    rc = SL_ENOMEM;
fail_doc:
    if (!rc) rc = SL_EFORMAT;
    json_free(&d);
fail_src:
    free(src);
    free(s);
    for (int i = 0; i < pre.n; i++) free(pre.pat[i]);
    model_tok_free(t);
    return rc;
}

/* dir/name parsed into d, over its text *src (free both after): 1, 0 where
 * the file is absent (nothing changes), or json_parse's error (< 0). */
static int slurp_json(const char *dir, const char *name, json_doc *d, char **src, char *err, size_t errlen)
{
    size_t len;
    if (!(*src = slurp(dir, name, &len))) return 0;
    int rc = json_parse(d, *src, len, err, errlen);
    if (rc) free(*src);
    return rc ? rc : 1;
}

/* tokenizer_config.json: bos_token / eos_token (strings or AddedToken
 * objects; a name the vocab lacks is ignored) and add_bos_token. Absent
 * file: nothing changes. */
static int load_tokenizer_config(const char *dir, model_tok *t, char *err, size_t errlen)
{
    json_doc d;
    char *src;
    int rc = slurp_json(dir, "tokenizer_config.json", &d, &src, err, errlen);
    if (rc <= 0) return rc;
    rc = 0;
    static const char *const keys[2] = {"bos_token", "eos_token"};
    for (int i = 0; i < 2; i++) {
        int v = json_get(&d, 0, keys[i]);
        if (v < 0 || json_is_null(&d, v)) continue;
        char *c = token_string(&d, v);
        if (!c) {
            SET_ERR("tokenizer_config.json: %s must be a string or an object with a string 'content'", keys[i]);
            rc = SL_EFORMAT;
            goto out;
        }
        int32_t id = model_tok_find(t, c, strlen(c));
        free(c);
        if (id < 0) continue; /* a name the vocab lacks: keep what tokenizer.json said */
        if (i == 0) t->bos = id;
        else t->eos = id;
    }
    bool b;
    int ab = json_get(&d, 0, "add_bos_token");
    if (ab >= 0 && !json_is_null(&d, ab) && json_bool(&d, ab, &b) != 0) {
        /* a default here would silently prompt the model without (or with) its BOS */
        SET_ERR("tokenizer_config.json: add_bos_token must be true or false");
        rc = SL_EFORMAT;
        goto out;
    }
    if (ab >= 0 && !json_is_null(&d, ab)) t->add_bos = b;
out:
    json_free(&d);
    free(src);
    return rc;
}

/* generation_config.json: eos_token_id (int or list) become stop ids; the
 * first is the eos when none is known yet; bos_token_id likewise. */
static int load_generation_config(const char *dir, model_tok *t, char *err, size_t errlen)
{
    json_doc d;
    char *src;
    int rc = slurp_json(dir, "generation_config.json", &d, &src, err, errlen);
    if (rc <= 0) return rc;
    rc = 0;
    int64_t v;
    int bi = json_get(&d, 0, "bos_token_id");
    if (bi >= 0 && !json_is_null(&d, bi) && json_i64(&d, bi, &v) != 0) {
        SET_ERR("generation_config.json: bos_token_id must be an integer");
        json_free(&d);
        free(src);
        return SL_EFORMAT;
    }
    /* an id past the vocabulary is left unused, as before: some checkpoints carry stale ones */
    if (t->bos < 0 && bi >= 0 && !json_is_null(&d, bi) && v >= 0 && v < t->n_vocab) t->bos = (int32_t)v;
    int e = json_get(&d, 0, "eos_token_id");
    int n = json_is_arr(&d, e) ? json_size(&d, e) : (e >= 0 ? 1 : 0);
    for (int k = 0, i = json_is_arr(&d, e) ? e + 1 : e; k < n; k++, i = json_skip(&d, i)) {
        if (json_i64(&d, i, &v) != 0 || v < 0 || v >= t->n_vocab) {
            if (json_is_null(&d, i)) continue;
            SET_ERR("generation_config.json: eos_token_id entry %d is not a token id", k);
            rc = SL_EFORMAT;
            break;
        }
        if (t->eos < 0) t->eos = (int32_t)v;
        if ((rc = tok_add_stop(t, (int32_t)v))) {
            SET_ERR("tokenizer: out of memory");
            break;
        }
    }
    json_free(&d);
    free(src);
    return rc;
}

model_tok *model_tok_from_hf_dir(const char *dir, char *err, size_t errlen)
{
    model_tok *t = NULL;
    if (!dir) {
        SET_ERR("tokenizer: no directory");
        return NULL;
    }
    if (load_tokenizer_json(dir, &t, err, errlen)) return NULL;
    if (load_tokenizer_config(dir, t, err, errlen)) goto fail;
    if (load_generation_config(dir, t, err, errlen)) goto fail;
    if (tok_finish(t, err, errlen)) goto fail;
    return t;
fail:
    model_tok_free(t);
    return NULL;
}

/* tokenizer.c - byte-level BPE: the vocab tables, the pre-tokenizer (PCRE2),
 * the merge loop, decoding, the incremental detokenizer, and construction
 * from GGUF metadata. tok_hf.c builds the same object from tokenizer.json.
 *
 * Encoding follows llama.cpp (llama-vocab.cpp) and HF tokenizers:
 *   1. special/added tokens written literally in the text are split out first
 *      (leftmost, then longest match; control tokens only with parse_special);
 *   2. each remaining span goes through the pre-tokenizer regexes in sequence;
 *      for every regex, each current piece is cut into its matches and the
 *      gaps between them (a regex never sees past its piece);
 *   3. each piece's bytes become byte-level symbols (one per byte) that are
 *      merged by rank, lowest rank first and leftmost first among equals.
 * A model_tok is immutable after construction; each encode call allocates
 * its own scratch (match data, pieces, symbols), so threads may share it.
 */
#define PCRE2_CODE_UNIT_WIDTH 8
#include <pcre2.h>

#include <limits.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "tok_internal.h"
#include "tokenizer.h"

#define SET_ERR(...) ((void)(err && errlen ? snprintf(err, errlen, __VA_ARGS__) : 0))

/* ---- the byte-level alphabet ------------------------------------------------ */

/* GPT-2's bytes_to_unicode(): printable Latin-1 bytes stand for themselves,
 * the other 68 (controls, space, 0x7f-0xa0, 0xad) take 256, 257, ... in order. */
uint32_t tok_byte_to_cp(uint8_t b)
{
    if ((b >= 0x21 && b <= 0x7e) || (b >= 0xa1 && b <= 0xac) || (b >= 0xae)) return b;
    uint32_t n = 0;
    for (int x = 0; x < b; x++)
        if (!((x >= 0x21 && x <= 0x7e) || (x >= 0xa1 && x <= 0xac) || (x >= 0xae))) n++;
    return 256 + n;
}

static int utf8_put(uint32_t cp, char *out)
{
    if (cp < 0x80) { out[0] = (char)cp; return 1; }
    if (cp < 0x800) { out[0] = (char)(0xc0 | (cp >> 6)); out[1] = (char)(0x80 | (cp & 0x3f)); return 2; }
    if (cp < 0x10000) {
        out[0] = (char)(0xe0 | (cp >> 12)); out[1] = (char)(0x80 | ((cp >> 6) & 0x3f));
        out[2] = (char)(0x80 | (cp & 0x3f)); return 3;
    }
    out[0] = (char)(0xf0 | (cp >> 18)); out[1] = (char)(0x80 | ((cp >> 12) & 0x3f));
    out[2] = (char)(0x80 | ((cp >> 6) & 0x3f)); out[3] = (char)(0x80 | (cp & 0x3f));
    return 4;
}

/* Decodes one well-formed UTF-8 sequence at s (n bytes left): its length, or
 * 0 if s does not start a well-formed sequence. */
static int utf8_get(const unsigned char *s, size_t n, uint32_t *cp)
{
    unsigned char c = s[0];
    if (c < 0x80) { *cp = c; return 1; }
    int len; uint32_t v; unsigned char lo = 0x80, hi = 0xbf;
    if (c >= 0xc2 && c <= 0xdf) { len = 2; v = c & 0x1f; }
    else if (c >= 0xe0 && c <= 0xef) {
        len = 3; v = c & 0x0f;
        if (c == 0xe0) lo = 0xa0;
        if (c == 0xed) hi = 0x9f;
    } else if (c >= 0xf0 && c <= 0xf4) {
        len = 4; v = c & 0x07;
        if (c == 0xf0) lo = 0x90;
        if (c == 0xf4) hi = 0x8f;
    } else return 0;
    if ((size_t)len > n) return 0;
    for (int i = 1; i < len; i++) {
        unsigned char x = s[i];
        if (x < (i == 1 ? lo : 0x80) || x > (i == 1 ? hi : 0xbf)) return 0;
        v = (v << 6) | (x & 0x3f);
    }
    *cp = v;
    return len;
}

/* ---- construction helpers (shared with tok_hf.c) ------------------------------ */

static uint64_t fnv1a(const char *s, size_t n)
{
    uint64_t h = 1469598103934665603ull;
    for (size_t i = 0; i < n; i++) h = (h ^ (unsigned char)s[i]) * 1099511628211ull;
    return h;
}

static uint64_t mix64(uint64_t x)
{
    x ^= x >> 33; x *= 0xff51afd7ed558ccdull; x ^= x >> 33; x *= 0xc4ceb9fe1a85ec53ull; x ^= x >> 33;
    return x;
}

model_tok *tok_alloc(int n_vocab, char *err, size_t errlen)
{
    if (n_vocab <= 0 || n_vocab > (1 << 24)) {
        SET_ERR("tokenizer: vocabulary size %d out of range", n_vocab);
        return NULL;
    }
    model_tok *t = calloc(1, sizeof *t);
    if (!t) goto fail_oom;
    t->n_vocab = n_vocab;
    t->bos = t->eos = t->eot = t->eom = t->unk = t->pad = -1;
    t->text_off = calloc((size_t)n_vocab, sizeof *t->text_off);
    t->text_n = calloc((size_t)n_vocab, sizeof *t->text_n);
    t->attr = malloc((size_t)n_vocab);
    t->bytes_off = calloc((size_t)n_vocab, sizeof *t->bytes_off);
    t->bytes_n = calloc((size_t)n_vocab, sizeof *t->bytes_n);
    if (!t->text_off || !t->text_n || !t->attr || !t->bytes_off || !t->bytes_n) goto fail_free;
    memset(t->attr, MODEL_TOK_UNUSED, (size_t)n_vocab);
    for (int i = 0; i < 324; i++) t->cp_byte[i] = -1;
    for (int b = 0; b < 256; b++) {
        t->cp_byte[tok_byte_to_cp((uint8_t)b)] = (int16_t)b;
        char tmp[4];
        int n = utf8_put(tok_byte_to_cp((uint8_t)b), tmp);
        memcpy(t->byte_chr[b], tmp, (size_t)n);
        t->byte_chr_n[b] = (uint8_t)n;
        t->byte_tok[b] = -1;
    }
    return t;
fail_free:
    model_tok_free(t);
fail_oom:
    SET_ERR("tokenizer: out of memory (%d tokens)", n_vocab);
    return NULL;
}

static int arena_add(char **buf, size_t *len, size_t *cap, const char *s, size_t n, uint32_t *off)
{
    if (*len + n > UINT32_MAX) return SL_ERANGE;
    if (*len + n > *cap) {
        size_t nc = *cap ? *cap * 2 : 1 << 16;
        while (nc < *len + n) nc *= 2;
        char *p = realloc(*buf, nc);
        if (!p) return SL_ENOMEM;
        *buf = p;
        *cap = nc;
    }
    if (n) memcpy(*buf + *len, s, n);
    *off = (uint32_t)*len;
    *len += n;
    return 0;
}

int tok_set_token(model_tok *t, int32_t id, const char *text, size_t len, enum model_tok_attr attr,
                  char *err, size_t errlen)
{
    if (id < 0 || id >= t->n_vocab) {
        SET_ERR("tokenizer: token id %d out of range (vocab %d)", (int)id, t->n_vocab);
        return SL_EFORMAT;
    }
    if (len > 65535) {
        SET_ERR("tokenizer: token %d is %zu bytes long", (int)id, len);
        return SL_EFORMAT;
    }
    if (attr < MODEL_TOK_NORMAL || attr > MODEL_TOK_BYTE) attr = MODEL_TOK_NORMAL;
    int rc = arena_add(&t->text, &t->text_len, &t->text_cap, text, len, &t->text_off[id]);
    if (rc) {
        SET_ERR("tokenizer: out of memory storing token texts");
        return rc;
    }
    t->text_n[id] = (uint32_t)len;
    t->attr[id] = (uint8_t)attr;
    return 0;
}

static const char *tok_text(const model_tok *t, int32_t id, size_t *len)
{
    *len = t->text_n[id];
    return t->text + t->text_off[id];
}

static int32_t hash_find(const model_tok *t, const char *s, size_t n)
{
    if (!t->hash) return -1;
    for (uint32_t i = (uint32_t)fnv1a(s, n) & t->hash_mask;; i = (i + 1) & t->hash_mask) {
        int32_t id = t->hash[i];
        if (id < 0) return -1;
        if (t->text_n[id] == n && memcmp(t->text + t->text_off[id], s, n) == 0) return id;
    }
}

int tok_index_vocab(model_tok *t, char *err, size_t errlen)
{
    uint32_t cap = 1024;
    while (cap < (uint32_t)t->n_vocab * 2u) cap *= 2;
    t->hash = malloc(sizeof *t->hash * cap);
    if (!t->hash) goto fail_oom;
    memset(t->hash, 0xff, sizeof *t->hash * cap);
    t->hash_mask = cap - 1;
    for (int32_t id = 0; id < t->n_vocab; id++) {
        size_t n;
        const char *s = tok_text(t, id, &n);
        if (t->attr[id] == MODEL_TOK_UNUSED && n == 0) continue;
        uint32_t i = (uint32_t)fnv1a(s, n) & t->hash_mask;
        for (;; i = (i + 1) & t->hash_mask) {
            int32_t o = t->hash[i];
            if (o < 0) { t->hash[i] = id; break; }
            if (t->text_n[o] == n && memcmp(t->text + t->text_off[o], s, n) == 0) break; /* first id wins */
        }
    }

    /* What each token decodes to: normal tokens map their byte-level
     * characters back to bytes (a character outside the alphabet stays as
     * its UTF-8); control, user-defined and unknown tokens are raw text. */
    size_t cap_b = 0, len_b = 0;
    char *tmp = NULL;
    size_t tmp_cap = 0;
    for (int32_t id = 0; id < t->n_vocab; id++) {
        size_t n;
        const unsigned char *s = (const unsigned char *)tok_text(t, id, &n);
        const char *src = (const char *)s;
        size_t out_n = n;
        if (t->attr[id] == MODEL_TOK_NORMAL) {
            if (tmp_cap < n) {
                char *p = realloc(tmp, n);
                if (!p) { free(tmp); goto fail_oom; }
                tmp = p;
                tmp_cap = n;
            }
            out_n = 0;
            for (size_t i = 0; i < n;) {
                uint32_t cp;
                int l = utf8_get(s + i, n - i, &cp);
                int b = l && cp < 324 ? t->cp_byte[cp] : -1;
                if (b >= 0) tmp[out_n++] = (char)b;
                else {
                    if (!l) l = 1;
                    memcpy(tmp + out_n, s + i, (size_t)l);
                    out_n += (size_t)l;
                }
                i += (size_t)l;
            }
            src = tmp;
        } else if (t->attr[id] == MODEL_TOK_UNUSED || t->attr[id] == MODEL_TOK_BYTE) {
            out_n = 0;
        }
        if (arena_add(&t->bytes, &len_b, &cap_b, src, out_n, &t->bytes_off[id])) {
            free(tmp);
            goto fail_oom;
        }
        t->bytes_n[id] = (uint32_t)out_n;
    }
    free(tmp);
    for (int b = 0; b < 256; b++) t->byte_tok[b] = hash_find(t, t->byte_chr[b], t->byte_chr_n[b]);
    return 0;
fail_oom:
    SET_ERR("tokenizer: out of memory indexing %d tokens", t->n_vocab);
    return SL_ENOMEM;
}

static const struct tok_merge *merge_find(const model_tok *t, int32_t a, int32_t b)
{
    if (!t->merge) return NULL;
    uint64_t key = ((uint64_t)(uint32_t)a << 32) | (uint32_t)b;
    for (uint32_t i = (uint32_t)mix64(key) & t->merge_mask;; i = (i + 1) & t->merge_mask) {
        const struct tok_merge *m = &t->merge[i];
        if (m->key == UINT64_MAX) return NULL;
        if (m->key == key) return m;
    }
}

/* Returns 1 when a slot was taken, 0 for a repeated pair (the first,
 * lowest rank wins). */
static int merge_put(struct tok_merge *tab, uint32_t mask, struct tok_merge e)
{
    for (uint32_t i = (uint32_t)mix64(e.key) & mask;; i = (i + 1) & mask) {
        if (tab[i].key == UINT64_MAX) { tab[i] = e; return 1; }
        if (tab[i].key == e.key) return 0;
    }
}

int tok_add_merge(model_tok *t, const char *a, size_t alen, const char *b, size_t blen, char *err,
                  size_t errlen)
{
    int32_t rank = t->n_merges++;
    int32_t ia = hash_find(t, a, alen), ib = hash_find(t, b, blen);
    if (ia < 0 || ib < 0) {
        SET_ERR("tokenizer: merge %d (\"%.*s\" \"%.*s\") refers to unknown token \"%.*s\"", (int)rank,
                (int)alen, a, (int)blen, b, ia < 0 ? (int)alen : (int)blen, ia < 0 ? a : b);
        return SL_EFORMAT;
    }
    char small[256];
    char *cat = alen + blen <= sizeof small ? small : malloc(alen + blen);
    if (!cat) goto fail_oom;
    memcpy(cat, a, alen);
    memcpy(cat + alen, b, blen);
    int32_t id = hash_find(t, cat, alen + blen);
    if (cat != small) free(cat);
    if (id < 0) return 0;

    /* Grow at half load; the table holds at most one slot per merge. */
    if (!t->merge || (t->merge_used + 1) * 2 > t->merge_mask + 1) {
        uint32_t ncap = t->merge ? (t->merge_mask + 1) * 2 : 1u << 16;
        struct tok_merge *nt = malloc(sizeof *nt * ncap);
        if (!nt) goto fail_oom;
        memset(nt, 0xff, sizeof *nt * ncap);
        if (t->merge)
            for (uint32_t i = 0; i <= t->merge_mask; i++)
                if (t->merge[i].key != UINT64_MAX) merge_put(nt, ncap - 1, t->merge[i]);
        free(t->merge);
        t->merge = nt;
        t->merge_mask = ncap - 1;
    }
    struct tok_merge e = {((uint64_t)(uint32_t)ia << 32) | (uint32_t)ib, rank, id};
    t->merge_used += merge_put(t->merge, t->merge_mask, e);
    return 0;
fail_oom:
    SET_ERR("tokenizer: out of memory adding merges");
    return SL_ENOMEM;
}

/* ---- pre-tokenizers ------------------------------------------------------------ */

/* The regex lists of llama.cpp's pre-tokenizer types (llama-vocab.cpp), which
 * reproduce each family's HF pre_tokenizer. */
#define RE_GPT2 "'s|'t|'re|'ve|'m|'ll|'d| ?\\p{L}+| ?\\p{N}+| ?[^\\s\\p{L}\\p{N}]+|\\s+(?!\\S)"
#define RE_LLAMA3_HEAD "(?:'[sS]|'[tT]|'[rR][eE]|'[vV][eE]|'[mM]|'[lL][lL]|'[dD])|[^\\r\\n\\p{L}\\p{N}]?\\p{L}+|"
#define RE_LLAMA3_TAIL "| ?[^\\s\\p{L}\\p{N}]+[\\r\\n]*|\\s*[\\r\\n]+|\\s+(?!\\S)|\\s+"
#define RE_CJK "[一-龥ࠀ-一가-퟿]+"

const char tok_gpt2_regex[] = RE_GPT2;

struct pre_def {
    const char *names; /* '|'-separated llama.cpp tokenizer.ggml.pre values */
    bool ignore_merges, add_bos;
    const char *re[6];
};

static const struct pre_def k_pre[] = {
    {"gpt-2|mpt|olmo|jais|trillion|phi-2|roberta-bpe|jina-es|jina-de|gigachat|jina-v1-en|jina-v2-es|"
     "jina-v2-de|jina-v2-code",
     false, false, {RE_GPT2}},
    {"llama3|llama-v3|llama-bpe|falcon3|falcon-h1|pixtral|midm-2.0|lfm2", true, true,
     {RE_LLAMA3_HEAD "\\p{N}{1,3}" RE_LLAMA3_TAIL}},
    {"dbrx|smaug-bpe|chatglm-bpe", false, false, {RE_LLAMA3_HEAD "\\p{N}{1,3}" RE_LLAMA3_TAIL}},
    {"qwen2|deepseek-r1-qwen|stablelm2|megrez|hunyuan", false, false,
     {RE_LLAMA3_HEAD "\\p{N}" RE_LLAMA3_TAIL}},
    {"starcoder|refact|command-r|smollm|codeshell|exaone|minerva-7b", false, false, {"\\p{N}", RE_GPT2}},
    {"falcon", false, false, {"[\\p{P}\\$\\+<=>\\^~\\|`]+", RE_GPT2, "[0-9][0-9][0-9]"}},
    {"deepseek-llm", false, false,
     {"[\r\n]",
      "\\s?[A-Za-zµÀ-ÖØ-öø-ƺƼ-ƿǄ-ʓʕ-ʯͰ-ͳͶͷͻ-ͽͿΆΈ-ΊΌΎ-ΡΣ-ϵϷ-ҁҊ-ԯԱ-ՖႠ-ჅᎠ-Ᏽᏸ-ᏽᲐ-ᲺᲽ-Ჿᴀ-ᴫᵫ-ᵷᵹ-ᶚḀ-ἕἘ-Ἕἠ-ὅὈ-Ὅὐ-"
      "ὗὙὛὝὟ-\\x{1F7D}ᾀ-ᾴᾶ-ᾼ\\x{1FBE}ῂ-ῄῆ-ῌῐ-\\x{1FD3}ῖ-\\x{1FDB}ῠ-Ῥῲ-ῴῶ-ῼℂℇℊ-ℓℕℙ-ℝℤ\\x{2126}ℨ\\x{212A}-ℭℯ-ℴℹℼ-ℿⅅ-ⅉⅎↃↄⰀ-ⱻⱾ-ⳤⳫ-ⳮⳲⳳꙀ-ꙭꚀ-ꚛꜢ-ꝯꝱ-ꞇꞋ-ꞎꭰ-ꮿﬀ-ﬆﬓ-"
      "ﬗＡ-Ｚａ-ｚ𐐀-𐑏𐒰-𐓓𐓘-𐓻𐲀-𐲲𐳀-𐳲𑢠-𑣟𞤀-𞥃]+",
      "\\s?[!-/:-~！-／：-～‘-‟　-。]+", "\\s+$", RE_CJK, "\\p{N}+"}},
    {"deepseek-coder", false, false, {"[\r\n]", "\\s?\\p{L}+", "\\s?\\p{P}+", RE_CJK, "\\p{N}"}},
    {"deepseek-v3", false, false,
     {"\\p{N}{1,3}", "[一-龥぀-ゟ゠-ヿ]+",
      "[!\"#$%&'()*+,\\-./:;<=>?@\\[\\\\\\]^_`{|}~][A-Za-z]+|[^\r\n\\p{L}\\p{P}\\p{S}]?[\\p{L}\\p{M}]+|"
      " ?[\\p{P}\\p{S}]+[\r\n]*|\\s*[\r\n]+|\\s+(?!\\S)|\\s+"}},
    {"gpt-4o|llama4", false, false,
     {"[^\\r\\n\\p{L}\\p{N}]?[\\p{Lu}\\p{Lt}\\p{Lm}\\p{Lo}\\p{M}]*[\\p{Ll}\\p{Lm}\\p{Lo}\\p{M}]+"
      "(?i:'s|'t|'re|'ve|'m|'ll|'d)?|[^\\r\\n\\p{L}\\p{N}]?[\\p{Lu}\\p{Lt}\\p{Lm}\\p{Lo}\\p{M}]+"
      "[\\p{Ll}\\p{Lm}\\p{Lo}\\p{M}]*(?i:'s|'t|'re|'ve|'m|'ll|'d)?|\\p{N}{1,3}| ?[^\\s\\p{L}\\p{N}]+[\\r\\n/]*|"
      "\\s*[\\r\\n]+|\\s+(?!\\S)|\\s+"}},
    {"tekken", false, false,
     {"[^\\r\\n\\p{L}\\p{N}]?[\\p{Lu}\\p{Lt}\\p{Lm}\\p{Lo}\\p{M}]*[\\p{Ll}\\p{Lm}\\p{Lo}\\p{M}]+|"
      "[^\\r\\n\\p{L}\\p{N}]?[\\p{Lu}\\p{Lt}\\p{Lm}\\p{Lo}\\p{M}]+[\\p{Ll}\\p{Lm}\\p{Lo}\\p{M}]*|\\p{N}|"
      " ?[^\\s\\p{L}\\p{N}]+[\\r\\n/]*|\\s*[\\r\\n]+|\\s+(?!\\S)|\\s+"}},
    {"default", false, false,
     {"[\\p{P}\\$\\+<=>\\^~\\|]+", RE_GPT2, "\\p{N}+", "[0-9][0-9][0-9]"}},
};

static const struct pre_def *pre_lookup(const char *name)
{
    size_t n = strlen(name);
    for (size_t i = 0; i < sizeof k_pre / sizeof k_pre[0]; i++) {
        for (const char *p = k_pre[i].names; *p;) {
            const char *e = strchr(p, '|');
            size_t l = e ? (size_t)(e - p) : strlen(p);
            if (l == n && memcmp(p, name, n) == 0) return &k_pre[i];
            p += l + (e ? 1 : 0);
        }
    }
    return NULL;
}

int tok_set_pre_regexes(model_tok *t, const char *name, const char *const *pats, int n, char *err,
                        size_t errlen)
{
    if (n < 0 || n > TOK_MAX_REGEX) {
        SET_ERR("tokenizer: %d pre-tokenizer regexes (at most %d)", n, TOK_MAX_REGEX);
        return SL_EUNSUP;
    }
    free(t->pre_name);
    t->pre_name = strdup(name ? name : "");
    if (!t->pre_name) {
        SET_ERR("tokenizer: out of memory");
        return SL_ENOMEM;
    }
    for (int i = 0; i < n; i++) {
        int ec;
        PCRE2_SIZE eo;
        /* MATCH_INVALID_UTF: invalid UTF-8 in the text never matches and so
         * ends up in a gap piece, byte-exact, instead of failing the call. */
        pcre2_code *re = pcre2_compile((PCRE2_SPTR)pats[i], PCRE2_ZERO_TERMINATED,
                                       PCRE2_UTF | PCRE2_UCP | PCRE2_MATCH_INVALID_UTF |
                                           PCRE2_DOLLAR_ENDONLY,
                                       &ec, &eo, NULL);
        if (!re) {
            PCRE2_UCHAR msg[160];
            pcre2_get_error_message(ec, msg, sizeof msg);
            SET_ERR("tokenizer: pre-tokenizer regex %d of '%s' does not compile at offset %zu: %s", i,
                    t->pre_name, (size_t)eo, (const char *)msg);
            return SL_EFORMAT;
        }
        (void)pcre2_jit_compile(re, PCRE2_JIT_COMPLETE); /* interpreter if JIT is unavailable */
        t->re[t->n_re++] = re;
    }
    return 0;
}

int tok_set_pre_name(model_tok *t, const char *name, char *err, size_t errlen)
{
    const struct pre_def *d = pre_lookup(name);
    if (!d) {
        SET_ERR("tokenizer: unknown pre-tokenizer '%s' (tokenizer.ggml.pre)", name);
        return SL_EUNSUP;
    }
    int n = 0;
    while (n < 6 && d->re[n]) n++;
    t->ignore_merges = d->ignore_merges;
    return tok_set_pre_regexes(t, name, d->re, n, err, errlen);
}

int tok_add_stop(model_tok *t, int32_t id)
{
    if (id < 0 || id >= t->n_vocab) return 0;
    for (int i = 0; i < t->n_stop; i++)
        if (t->stop[i] == id) return 0;
    if (t->n_stop == t->cap_stop) {
        int nc = t->cap_stop ? t->cap_stop * 2 : 8;
        int32_t *p = realloc(t->stop, sizeof *p * (size_t)nc);
        if (!p) return SL_ENOMEM;
        t->stop = p;
        t->cap_stop = nc;
    }
    t->stop[t->n_stop++] = id;
    return 0;
}

static int spec_cmp_ctx_len(const model_tok *t, int32_t a, int32_t b)
{
    size_t la, lb;
    const unsigned char *sa = (const unsigned char *)tok_text(t, a, &la);
    const unsigned char *sb = (const unsigned char *)tok_text(t, b, &lb);
    if (sa[0] != sb[0]) return sa[0] < sb[0] ? -1 : 1;
    if (la != lb) return la > lb ? -1 : 1;
    return a < b ? -1 : (a > b);
}

/* Sorts ids with spec_cmp_ctx_len (merge sort: qsort has no context
 * argument in C11, and a global would not be thread-safe). */
static int spec_sort(const model_tok *t, int32_t *a, int n)
{
    int32_t *tmp = malloc(sizeof *tmp * (size_t)(n ? n : 1));
    if (!tmp) return SL_ENOMEM;
    for (int w = 1; w < n; w *= 2) {
        for (int lo = 0; lo < n; lo += 2 * w) {
            int mid = lo + w < n ? lo + w : n, hi = lo + 2 * w < n ? lo + 2 * w : n;
            int i = lo, j = mid, k = lo;
            while (i < mid && j < hi) tmp[k++] = spec_cmp_ctx_len(t, a[i], a[j]) <= 0 ? a[i++] : a[j++];
            while (i < mid) tmp[k++] = a[i++];
            while (j < hi) tmp[k++] = a[j++];
        }
        memcpy(a, tmp, sizeof *a * (size_t)n);
    }
    free(tmp);
    return 0;
}

/* End-of-turn markers that llama.cpp also treats as end of generation when a
 * model marks them as control tokens. */
static const char *const k_eog_texts[] = {
    "<|eot_id|>", "<|im_end|>", "<|end|>", "<end_of_turn>", "<|endoftext|>", "<|eom_id|>",
    "<EOT>", "_<EOT>", "<｜end▁of▁sentence｜>", "<|end_of_text|>",
};

int tok_finish(model_tok *t, char *err, size_t errlen)
{
    int n = 0;
    for (int32_t id = 0; id < t->n_vocab; id++) {
        uint8_t a = t->attr[id];
        if ((a == MODEL_TOK_CONTROL || a == MODEL_TOK_USER_DEFINED || a == MODEL_TOK_UNKNOWN) &&
            t->text_n[id] > 0)
            n++;
    }
    t->spec = malloc(sizeof *t->spec * (size_t)(n ? n : 1));
    if (!t->spec) goto fail_oom;
    t->n_spec = 0;
    for (int32_t id = 0; id < t->n_vocab; id++) {
        uint8_t a = t->attr[id];
        if ((a == MODEL_TOK_CONTROL || a == MODEL_TOK_USER_DEFINED || a == MODEL_TOK_UNKNOWN) &&
            t->text_n[id] > 0)
            t->spec[t->n_spec++] = id;
    }
    if (spec_sort(t, t->spec, t->n_spec)) goto fail_oom;
    t->max_bytes = 4; /* an unknown character as one UNK token */
    for (int32_t id = 0; id < t->n_vocab; id++)
        if (t->bytes_n[id] > (uint32_t)t->max_bytes) t->max_bytes = (int)t->bytes_n[id];
    for (int b = 0, k = 0; b <= 256; b++) {
        while (k < t->n_spec && (unsigned char)t->text[t->text_off[t->spec[k]]] < b) k++;
        t->spec_start[b] = k;
    }

    if (tok_add_stop(t, t->eos) || tok_add_stop(t, t->eot) || tok_add_stop(t, t->eom)) goto fail_oom;
    for (size_t i = 0; i < sizeof k_eog_texts / sizeof k_eog_texts[0]; i++) {
        int32_t id = model_tok_find(t, k_eog_texts[i], strlen(k_eog_texts[i]));
        if (id >= 0 && t->attr[id] == MODEL_TOK_CONTROL && tok_add_stop(t, id)) goto fail_oom;
    }
    if (t->n_re == 0) {
        SET_ERR("tokenizer: no pre-tokenizer set");
        return SL_EINVAL;
    }
    return 0;
fail_oom:
    SET_ERR("tokenizer: out of memory");
    return SL_ENOMEM;
}

/* ---- encoding ---------------------------------------------------------------- */

struct piece { size_t off, len; };

struct bpe_pair { int32_t rank, left, right, lid, rid, merged; };

/* Per-call scratch: nothing here is shared between threads. */
struct enc {
    const model_tok *t;
    int32_t *ids;
    int cap;
    long n;
    pcre2_match_data *md;
    struct piece *pa, *pb;
    size_t na, nb, cap_a, cap_b;
    int32_t *sym_id, *sym_prev, *sym_next;
    size_t cap_sym;
    struct bpe_pair *heap;
    size_t n_heap, cap_heap;
    char *word;               /* byte-level spelling of a piece (ignore_merges) */
    size_t cap_word;
    /* Pieces already BPE'd in this call and their ids (a piece's ids depend
     * on its bytes alone, and a document repeats its words): open
     * addressing over slots, ids in cids from id0. capture: emit() also
     * appends to cids (while a new piece is BPE'd). */
    struct piece_ent { const char *s; uint32_t len, id0, nid; } *pc;
    size_t n_pc, cap_pc;      /* cap_pc: 0 or a power of two */
    int32_t *cids;
    size_t n_cids, cap_cids;
    bool capture, oom;
};

static int emit(struct enc *e, int32_t id)
{
    if (e->n >= INT_MAX) return SL_ERANGE;
    if (e->n < e->cap) e->ids[e->n] = id;
    e->n++;
    if (e->capture) {
        if (e->n_cids == e->cap_cids) {
            size_t nc = e->cap_cids ? 2 * e->cap_cids : 1024;
            int32_t *q = realloc(e->cids, nc * sizeof *q);
            if (!q) return SL_ENOMEM;
            e->cids = q, e->cap_cids = nc;
        }
        e->cids[e->n_cids++] = id;
    }
    return 0;
}

static int grow(void **p, size_t *cap, size_t need, size_t elem)
{
    if (need <= *cap) return 0;
    size_t nc = *cap ? *cap : 64;
    while (nc < need) nc *= 2;
    void *q = realloc(*p, nc * elem);
    if (!q) return SL_ENOMEM;
    *p = q;
    *cap = nc;
    return 0;
}

static int push_piece(struct enc *e, size_t off, size_t len)
{
    if (!len) return 0;
    if (grow((void **)&e->pb, &e->cap_b, e->nb + 1, sizeof *e->pb)) return SL_ENOMEM;
    e->pb[e->nb++] = (struct piece){off, len};
    return 0;
}

static bool pair_less(const struct bpe_pair *a, const struct bpe_pair *b)
{
    return a->rank < b->rank || (a->rank == b->rank && a->left < b->left);
}

static void heap_push(struct enc *e, struct bpe_pair p)
{
    size_t i = e->n_heap++;
    while (i > 0) {
        size_t up = (i - 1) / 2;
        if (!pair_less(&p, &e->heap[up])) break;
        e->heap[i] = e->heap[up];
        i = up;
    }
    e->heap[i] = p;
}

static struct bpe_pair heap_pop(struct enc *e)
{
    struct bpe_pair top = e->heap[0], last = e->heap[--e->n_heap];
    size_t i = 0, n = e->n_heap;
    for (;;) {
        size_t c = 2 * i + 1;
        if (c >= n) break;
        if (c + 1 < n && pair_less(&e->heap[c + 1], &e->heap[c])) c++;
        if (!pair_less(&e->heap[c], &last)) break;
        e->heap[i] = e->heap[c];
        i = c;
    }
    if (n) e->heap[i] = last;
    return top;
}

static void try_pair(struct enc *e, int32_t l, int32_t r)
{
    int32_t a = e->sym_id[l], b = e->sym_id[r];
    if (a < 0 || b < 0) return;
    const struct tok_merge *m = merge_find(e->t, a, b);
    if (m) heap_push(e, (struct bpe_pair){m->rank, l, r, a, b, m->id});
}

/* BPE over the bytes of one piece; emits its ids. */
static int bpe_piece(struct enc *e, const unsigned char *w, size_t n)
{
    const model_tok *t = e->t;
    if (n == 1) return t->byte_tok[w[0]] >= 0 ? emit(e, t->byte_tok[w[0]]) : 0;
    if (n > INT32_MAX / 4) return SL_ERANGE;
    if (t->ignore_merges) {
        if (grow((void **)&e->word, &e->cap_word, 2 * n, 1)) return SL_ENOMEM;
        size_t k = 0;
        for (size_t i = 0; i < n; i++) {
            memcpy(e->word + k, t->byte_chr[w[i]], t->byte_chr_n[w[i]]);
            k += t->byte_chr_n[w[i]];
        }
        int32_t id = hash_find(t, e->word, k);
        if (id >= 0) return emit(e, id);
    }
    size_t ocap = e->cap_sym;
    if (grow((void **)&e->sym_id, &ocap, n, sizeof(int32_t))) return SL_ENOMEM;
    ocap = e->cap_sym;
    if (grow((void **)&e->sym_prev, &ocap, n, sizeof(int32_t))) return SL_ENOMEM;
    ocap = e->cap_sym;
    if (grow((void **)&e->sym_next, &ocap, n, sizeof(int32_t))) return SL_ENOMEM;
    e->cap_sym = ocap;
    /* n - 1 initial pairs, at most two new ones per merge (n - 1 merges). */
    if (grow((void **)&e->heap, &e->cap_heap, 3 * n, sizeof *e->heap)) return SL_ENOMEM;

    for (size_t i = 0; i < n; i++) {
        e->sym_id[i] = t->byte_tok[w[i]];
        e->sym_prev[i] = (int32_t)i - 1;
        e->sym_next[i] = i + 1 < n ? (int32_t)i + 1 : -1;
    }
    e->n_heap = 0;
    for (size_t i = 0; i + 1 < n; i++) try_pair(e, (int32_t)i, (int32_t)i + 1);
    while (e->n_heap) {
        struct bpe_pair p = heap_pop(e);
        /* Stale entries: a side was merged away or changed since the push. */
        if (e->sym_id[p.left] != p.lid || e->sym_next[p.left] != p.right || e->sym_id[p.right] != p.rid)
            continue;
        e->sym_id[p.left] = p.merged;
        e->sym_id[p.right] = -2;
        int32_t nx = e->sym_next[p.right];
        e->sym_next[p.left] = nx;
        if (nx >= 0) e->sym_prev[nx] = p.left;
        if (e->sym_prev[p.left] >= 0) try_pair(e, e->sym_prev[p.left], p.left);
        if (nx >= 0) try_pair(e, p.left, nx);
    }
    /* A byte whose character is missing from the vocab has no token; like
     * llama.cpp, it is dropped (byte-level vocabs have all 256). */
    for (int32_t i = 0; i >= 0; i = e->sym_next[i]) {
        if (e->sym_id[i] >= 0) {
            int rc = emit(e, e->sym_id[i]);
            if (rc) return rc;
        }
    }
    return 0;
}

/* Doubles the piece cache (or makes its first 1024 slots). */
static int pc_grow(struct enc *e)
{
    size_t nc = e->cap_pc ? 2 * e->cap_pc : 1024;
    struct piece_ent *t = calloc(nc, sizeof *t);
    if (!t) return SL_ENOMEM;
    for (size_t i = 0; i < e->cap_pc; i++) {
        if (!e->pc[i].s) continue;
        size_t j = fnv1a(e->pc[i].s, e->pc[i].len) & (nc - 1);
        while (t[j].s) j = (j + 1) & (nc - 1);
        t[j] = e->pc[i];
    }
    free(e->pc);
    e->pc = t, e->cap_pc = nc;
    return 0;
}

/* Emits the ids of piece s[0..n): from the cache when this call has seen
 * the same bytes, else by bpe_piece, remembered. Single bytes go straight
 * to bpe_piece (one lookup). Without memory for the cache it still BPEs. */
static int piece_ids(struct enc *e, const char *s, size_t n)
{
    if (n < 2 || n > UINT32_MAX || e->oom) return bpe_piece(e, (const unsigned char *)s, n);
    if (2 * (e->n_pc + 1) > e->cap_pc && pc_grow(e)) {
        e->oom = true;
        return bpe_piece(e, (const unsigned char *)s, n);
    }
    size_t j = fnv1a(s, n) & (e->cap_pc - 1);
    for (; e->pc[j].s; j = (j + 1) & (e->cap_pc - 1)) {
        struct piece_ent *p = &e->pc[j];
        if (p->len != n || memcmp(p->s, s, n)) continue;
        for (uint32_t i = 0; i < p->nid; i++) {
            int rc = emit(e, e->cids[p->id0 + i]);
            if (rc) return rc;
        }
        return 0;
    }
    size_t id0 = e->n_cids;
    e->capture = true;
    int rc = bpe_piece(e, (const unsigned char *)s, n);
    e->capture = false;
    if (rc || e->n_cids > UINT32_MAX) return rc ? rc : SL_ERANGE;
    e->pc[j] = (struct piece_ent){s, (uint32_t)n, (uint32_t)id0, (uint32_t)(e->n_cids - id0)};
    e->n_pc++;
    return 0;
}

/* Pre-tokenizes text[0..len) (no special tokens in it) and BPEs each piece. */
static int encode_span(struct enc *e, const char *text, size_t len)
{
    const model_tok *t = e->t;
    if (!len) return 0;
    e->nb = 0;
    if (push_piece(e, 0, len)) return SL_ENOMEM;
    for (int r = 0; r < t->n_re; r++) {
        /* the current pieces move to pa; the cut ones go to pb */
        struct piece *sp = e->pa; size_t sc = e->cap_a;
        e->pa = e->pb; e->cap_a = e->cap_b; e->na = e->nb;
        e->pb = sp; e->cap_b = sc; e->nb = 0;
        const pcre2_code *re = t->re[r];
        for (size_t k = 0; k < e->na; k++) {
            struct piece pc = e->pa[k];
            PCRE2_SPTR subj = (PCRE2_SPTR)text + pc.off;
            size_t pos = 0, gap = 0;
            while (pos < pc.len) {
                int rc = pcre2_match(re, subj, pc.len, pos, 0, e->md, NULL);
                if (rc == PCRE2_ERROR_NOMATCH) break;
                if (rc < 0) return SL_ERANGE; /* e.g. a match limit: refuse, never mis-split */
                PCRE2_SIZE *ov = pcre2_get_ovector_pointer(e->md);
                size_t ms = ov[0], me = ov[1];
                if (me <= ms) { /* empty match: step over one character */
                    pos = ms + 1;
                    while (pos < pc.len && (subj[pos] & 0xc0) == 0x80) pos++;
                    continue;
                }
                if (push_piece(e, pc.off + gap, ms - gap) || push_piece(e, pc.off + ms, me - ms))
                    return SL_ENOMEM;
                pos = gap = me;
            }
            if (push_piece(e, pc.off + gap, pc.len - gap)) return SL_ENOMEM;
        }
    }
    for (size_t k = 0; k < e->nb; k++) {
        int rc = piece_ids(e, text + e->pb[k].off, e->pb[k].len);
        if (rc) return rc;
    }
    return 0;
}

int model_tok_encode(const model_tok *t, const char *text, size_t len, bool add_bos,
                     bool parse_special, int32_t *ids, int cap)
{
    if (!t || (!text && len) || cap < 0 || (!ids && cap > 0)) return SL_EINVAL;
    struct enc e = {.t = t, .ids = ids, .cap = cap};
    int rc = 0;
    e.md = pcre2_match_data_create(1, NULL);
    if (!e.md) return SL_ENOMEM;
    if (add_bos && t->add_bos && t->bos >= 0 && (rc = emit(&e, t->bos))) goto out;

    const unsigned char *s = (const unsigned char *)text;
    size_t seg = 0, p = 0;
    while (p < len) {
        int32_t found = -1;
        size_t flen = 0;
        for (int k = t->spec_start[s[p]]; k < t->spec_start[s[p] + 1]; k++) {
            int32_t id = t->spec[k];
            if (!parse_special && t->attr[id] != MODEL_TOK_USER_DEFINED) continue;
            size_t tl = t->text_n[id];
            if (tl <= len - p && memcmp(s + p, t->text + t->text_off[id], tl) == 0) {
                found = id;
                flen = tl;
                break;
            }
        }
        if (found < 0) {
            p++;
            continue;
        }
        if ((rc = encode_span(&e, text + seg, p - seg))) goto out;
        if ((rc = emit(&e, found))) goto out;
        p += flen;
        seg = p;
    }
    rc = encode_span(&e, text + seg, len - seg);
out:
    pcre2_match_data_free(e.md);
    free(e.pa);
    free(e.pb);
    free(e.sym_id);
    free(e.sym_prev);
    free(e.sym_next);
    free(e.heap);
    free(e.word);
    free(e.pc);
    free(e.cids);
    return rc ? rc : (int)e.n;
}

/* ---- decoding ------------------------------------------------------------------ */

long model_tok_decode(const model_tok *t, const int32_t *ids, int n, bool skip_special, char *out,
                      size_t cap)
{
    if (!t || n < 0 || (!ids && n) || (!out && cap)) return SL_EINVAL;
    size_t total = 0;
    for (int i = 0; i < n; i++) {
        int32_t id = ids[i];
        if (id < 0 || id >= t->n_vocab) return SL_EINVAL;
        if (skip_special && t->attr[id] == MODEL_TOK_CONTROL) continue;
        size_t bn = t->bytes_n[id];
        if (total < cap) memcpy(out + total, t->bytes + t->bytes_off[id], bn < cap - total ? bn : cap - total);
        total += bn;
        if (total > LONG_MAX / 2) return SL_ERANGE;
    }
    return (long)total;
}

int model_tok_n_vocab(const model_tok *t) { return t ? t->n_vocab : 0; }
int model_tok_max_bytes(const model_tok *t) { return t ? t->max_bytes : 0; }
int32_t model_tok_bos(const model_tok *t) { return t ? t->bos : -1; }
int32_t model_tok_eos(const model_tok *t) { return t ? t->eos : -1; }

int model_tok_stop_ids(const model_tok *t, const int32_t **ids)
{
    if (!t) {
        if (ids) *ids = NULL;
        return 0;
    }
    if (ids) *ids = t->stop;
    return t->n_stop;
}

enum model_tok_attr model_tok_attr(const model_tok *t, int32_t id)
{
    if (!t || id < 0 || id >= t->n_vocab) return MODEL_TOK_UNUSED;
    return (enum model_tok_attr)t->attr[id];
}

const char *model_tok_bytes(const model_tok *t, int32_t id, size_t *len)
{
    if (!t || id < 0 || id >= t->n_vocab) {
        if (len) *len = 0;
        return "";
    }
    if (len) *len = t->bytes_n[id];
    return t->bytes + t->bytes_off[id];
}

int32_t model_tok_find(const model_tok *t, const char *text, size_t len)
{
    if (!t || (!text && len)) return -1;
    return hash_find(t, text ? text : "", len);
}

/* ---- incremental detokenizer --------------------------------------------------- */

void model_detok_init(struct model_detok *d, const model_tok *tok, bool skip_special)
{
    memset(d, 0, sizeof *d);
    d->tok = tok;
    d->skip_special = skip_special;
}

static void put(char *out, size_t cap, size_t *w, const void *s, size_t n)
{
    if (*w + n > cap) return; /* a whole character or nothing */
    memcpy(out + *w, s, n);
    *w += n;
}

static const char k_fffd[3] = {(char)0xef, (char)0xbf, (char)0xbd};

/* Length of the UTF-8 sequence a lead byte starts, 0 if it is no lead byte. */
static int lead_len(unsigned char c)
{
    if (c < 0x80) return 1;
    if (c >= 0xc2 && c <= 0xdf) return 2;
    if (c >= 0xe0 && c <= 0xef) return 3;
    if (c >= 0xf0 && c <= 0xf4) return 4;
    return 0;
}

/* Whether x may follow the pending bytes p[0..n) (n >= 1). */
static bool cont_ok(const unsigned char *p, int n, unsigned char x)
{
    unsigned char lo = 0x80, hi = 0xbf;
    if (n == 1) {
        if (p[0] == 0xe0) lo = 0xa0;
        if (p[0] == 0xed) hi = 0x9f;
        if (p[0] == 0xf0) lo = 0x90;
        if (p[0] == 0xf4) hi = 0x8f;
    }
    return x >= lo && x <= hi;
}

size_t model_detok_push(struct model_detok *d, int32_t id, char *out, size_t cap)
{
    if (!d || !d->tok || id < 0 || id >= d->tok->n_vocab) return 0;
    const model_tok *t = d->tok;
    if (d->skip_special && t->attr[id] == MODEL_TOK_CONTROL) return 0;
    const unsigned char *b = (const unsigned char *)t->bytes + t->bytes_off[id];
    size_t n = t->bytes_n[id], w = 0;
    for (size_t i = 0; i < n; i++) {
        unsigned char x = b[i];
        if (d->n_pending) {
            if (cont_ok(d->pending, d->n_pending, x)) {
                d->pending[d->n_pending++] = x;
                if (d->n_pending == lead_len(d->pending[0])) {
                    put(out, cap, &w, d->pending, (size_t)d->n_pending);
                    d->n_pending = 0;
                }
                continue;
            }
            /* the pending prefix can never complete: one U+FFFD for it, and
             * x starts afresh */
            put(out, cap, &w, k_fffd, 3);
            d->n_pending = 0;
        }
        int l = lead_len(x);
        if (l == 1) put(out, cap, &w, &x, 1);
        else if (l == 0) put(out, cap, &w, k_fffd, 3);
        else d->pending[d->n_pending++] = x;
    }
    return w;
}

size_t model_detok_flush(struct model_detok *d, char *out, size_t cap)
{
    if (!d || !d->n_pending) return 0;
    size_t w = 0;
    put(out, cap, &w, k_fffd, 3);
    d->n_pending = 0;
    return w;
}

/* ---- construction from GGUF ----------------------------------------------------- */

static bool gstr_eq(struct gguf_str s, const char *z)
{
    return s.len == strlen(z) && memcmp(s.p, z, s.len) == 0;
}

/* A special token id: -1 when absent or past the vocabulary (a stale id is
 * left unused), -2 when the key holds something other than an integer. */
static int32_t gguf_id(const gguf_file *f, const char *key, int n_vocab)
{
    int64_t v;
    if (gguf_get_i64(f, key, &v) != 0) return gguf_find(f, key) >= 0 ? -2 : -1;
    if (v < 0 || v >= n_vocab) return -1;
    return (int32_t)v;
}

/* A key that is there with another type than the one read: a default in its
 * place would tokenize differently from what the file says. */
static bool gguf_mistyped(const gguf_file *f, const char *key, enum gguf_vtype want)
{
    int64_t i = gguf_find(f, key);
    return i >= 0 && gguf_kv_type(f, i) != want;
}

model_tok *model_tok_from_gguf(const gguf_file *f, char *err, size_t errlen)
{
    model_tok *t = NULL;
    struct gguf_str model, pre;
    struct gguf_array toks, types, merges;
    if (!f) {
        SET_ERR("tokenizer: no GGUF file");
        return NULL;
    }
    if (gguf_get_str(f, "tokenizer.ggml.model", &model) != 0) {
        SET_ERR("tokenizer: GGUF has no tokenizer.ggml.model");
        return NULL;
    }
    if (!gstr_eq(model, "gpt2")) {
        const char *kind = gstr_eq(model, "llama")  ? " (SentencePiece)"
                           : gstr_eq(model, "bert") ? " (WordPiece)"
                           : gstr_eq(model, "t5")   ? " (Unigram)"
                                                    : "";
        SET_ERR("tokenizer: unsupported tokenizer model '%.*s'%s: only byte-level BPE ('gpt2') is "
                "supported",
                (int)(model.len > 64 ? 64 : model.len), model.p, kind);
        return NULL;
    }
    if (gguf_get_arr(f, "tokenizer.ggml.tokens", &toks) != 0 || toks.type != GGUF_VT_STRING ||
        toks.n == 0) {
        SET_ERR("tokenizer: GGUF has no tokenizer.ggml.tokens string array");
        return NULL;
    }
    if (toks.n > (1 << 24)) {
        SET_ERR("tokenizer: %llu tokens is too many", (unsigned long long)toks.n);
        return NULL;
    }
    int n_vocab = (int)toks.n;
    bool have_types = gguf_get_arr(f, "tokenizer.ggml.token_type", &types) == 0;
    if (have_types && ((types.type != GGUF_VT_INT32 && types.type != GGUF_VT_UINT32) || types.n != toks.n)) {
        SET_ERR("tokenizer: tokenizer.ggml.token_type is not an int32 array of %d entries", n_vocab);
        return NULL;
    }
    if (gguf_get_arr(f, "tokenizer.ggml.merges", &merges) != 0 || merges.type != GGUF_VT_STRING) {
        SET_ERR("tokenizer: GGUF has no tokenizer.ggml.merges string array");
        return NULL;
    }

    t = tok_alloc(n_vocab, err, errlen);
    if (!t) return NULL;
    for (int i = 0; i < n_vocab; i++) {
        struct gguf_str s = gguf_array_str(f, &toks, (uint64_t)i);
        int32_t ty = MODEL_TOK_NORMAL;
        if (have_types) memcpy(&ty, (const char *)types.data + 4 * (size_t)i, 4);
        if (tok_set_token(t, i, s.p, s.len, (enum model_tok_attr)ty, err, errlen)) goto fail;
    }
    if (tok_index_vocab(t, err, errlen)) goto fail;
    for (uint64_t i = 0; i < merges.n; i++) {
        struct gguf_str m = gguf_array_str(f, &merges, i);
        /* "left right": split at the first space after the first byte (a
         * byte-level token never holds a raw space; the text of ' ' is 'Ġ') */
        const char *sp = m.len > 1 ? memchr(m.p + 1, ' ', m.len - 1) : NULL;
        if (!sp) {
            SET_ERR("tokenizer: merge %llu \"%.*s\" is not two tokens separated by a space",
                    (unsigned long long)i, (int)(m.len > 64 ? 64 : m.len), m.p);
            goto fail;
        }
        size_t al = (size_t)(sp - m.p);
        if (tok_add_merge(t, m.p, al, sp + 1, m.len - al - 1, err, errlen)) goto fail;
    }

    char name[64] = "default";
    if (gguf_mistyped(f, "tokenizer.ggml.pre", GGUF_VT_STRING) ||
        gguf_mistyped(f, "tokenizer.ggml.add_bos_token", GGUF_VT_BOOL)) {
        SET_ERR("tokenizer: GGUF key %s has the wrong type",
                gguf_mistyped(f, "tokenizer.ggml.pre", GGUF_VT_STRING) ? "tokenizer.ggml.pre"
                                                                        : "tokenizer.ggml.add_bos_token");
        goto fail;
    }
    if (gguf_get_str(f, "tokenizer.ggml.pre", &pre) == 0) {
        if (pre.len >= sizeof name) {
            SET_ERR("tokenizer: unknown pre-tokenizer '%.*s...' (tokenizer.ggml.pre)", 48, pre.p);
            goto fail;
        }
        memcpy(name, pre.p, pre.len);
        name[pre.len] = 0;
    }
    if (tok_set_pre_name(t, name, err, errlen)) goto fail;

    static const char *const id_keys[] = {"tokenizer.ggml.bos_token_id", "tokenizer.ggml.eos_token_id",
                                           "tokenizer.ggml.eot_token_id", "tokenizer.ggml.eom_token_id",
                                           "tokenizer.ggml.unknown_token_id", "tokenizer.ggml.padding_token_id"};
    int32_t *ids[] = {&t->bos, &t->eos, &t->eot, &t->eom, &t->unk, &t->pad};
    for (size_t k = 0; k < sizeof id_keys / sizeof *id_keys; k++)
        if ((*ids[k] = gguf_id(f, id_keys[k], n_vocab)) == -2) {
            SET_ERR("tokenizer: GGUF key %s is not an integer", id_keys[k]);
            goto fail;
        }
    int ab;
    t->add_bos = gguf_get_bool(f, "tokenizer.ggml.add_bos_token", &ab) == 0 ? ab != 0
                                                                            : pre_lookup(name)->add_bos;
    if (tok_finish(t, err, errlen)) goto fail;
    return t;
fail:
    model_tok_free(t);
    return NULL;
}

/* ---- teardown -------------------------------------------------------------------- */

void model_tok_free(model_tok *t)
{
    if (!t) return;
    for (int i = 0; i < t->n_re; i++) pcre2_code_free(t->re[i]);
    free(t->pre_name);
    free(t->text);
    free(t->text_off);
    free(t->text_n);
    free(t->attr);
    free(t->bytes);
    free(t->bytes_off);
    free(t->bytes_n);
    free(t->hash);
    free(t->merge);
    free(t->spec);
    free(t->stop);
    free(t);
}

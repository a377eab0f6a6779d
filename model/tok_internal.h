/* tok_internal.h - the tokenizer's insides, shared by its constructors
 * (tokenizer.c: GGUF; tok_hf.c: Hugging Face tokenizer.json). Private to the
 * tokenizer files of model/; everyone else uses model.h and tokenizer.h.
 *
 * A constructor builds a model_tok in this order:
 *   tok_alloc(n_vocab)                    every id starts UNUSED with empty text
 *   tok_set_token(...) for each id        text as in the vocab, attribute
 *   tok_index_vocab()                     text -> id table, decoded bytes
 *   tok_add_merge(...) in rank order      merges refer to vocab texts
 *   tok_set_pre_regexes(...)              the pre-tokenizer (PCRE2 patterns)
 *   set bos/eos/eot/eom/unk, add_bos, extra stop ids
 *   tok_finish()                          special-token index, stop ids
 * Every step returns 0 or a negative sl_status with a message; on failure
 * the caller frees the partial object with model_tok_free().
 */
#ifndef SLUICE_TOK_INTERNAL_H
#define SLUICE_TOK_INTERNAL_H

#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>

#include "model.h"

#define TOK_MAX_REGEX 8

struct tok_merge {       /* one slot of the merge table (open addressing) */
    uint64_t key;        /* (left id << 32) | right id; UINT64_MAX = empty */
    int32_t rank;        /* lower merges first */
    int32_t id;          /* the merged token */
};

struct model_tok {
    int n_vocab;

    /* Token texts as written in the vocab (byte-level alphabet for normal
     * tokens, raw UTF-8 for control/user-defined ones). */
    char *text;              /* arena of all texts */
    size_t text_len, text_cap;
    uint32_t *text_off;      /* [n_vocab] */
    uint32_t *text_n;        /* [n_vocab] */
    uint8_t *attr;           /* [n_vocab] enum model_tok_attr */

    /* What each token decodes to (raw bytes). */
    char *bytes;             /* arena */
    uint32_t *bytes_off;     /* [n_vocab] */
    uint32_t *bytes_n;       /* [n_vocab] */

    /* text -> id, open addressing; -1 = empty slot. */
    int32_t *hash;
    uint32_t hash_mask;

    /* (left id, right id) -> (rank, merged id). */
    struct tok_merge *merge;
    uint32_t merge_mask, merge_used;
    int n_merges;            /* merges seen (the next rank) */

    /* Byte-level alphabet: byte -> its character (UTF-8) and that
     * character's token id (-1 when the vocab lacks it). */
    char byte_chr[256][2];
    uint8_t byte_chr_n[256];
    int32_t byte_tok[256];
    int16_t cp_byte[324];    /* the inverse: code point -> byte, -1 if none */

    /* Pre-tokenizer: regexes applied in sequence (llama.cpp / HF "Isolated"
     * semantics: matches and the gaps between them both become pieces).
     * pcre2_code pointers, typed void * to keep PCRE2 out of this header. */
    char *pre_name;
    int n_re;
    void *re[TOK_MAX_REGEX];
    bool ignore_merges;      /* a whole piece found in the vocab is one token (llama-3) */

    /* Special / added tokens split out of raw text before BPE: ids with
     * attr CONTROL, USER_DEFINED or UNKNOWN, grouped by first byte
     * (spec_start[b] .. spec_start[b+1]) and longest first in a group. */
    int32_t *spec;
    int n_spec;
    int spec_start[257];

    int32_t bos, eos, eot, eom, unk, pad;
    bool add_bos;
    int max_bytes;           /* the most text one token can stand for (model_tok_max_bytes) */
    int32_t *stop;           /* eos, eot, eom, extra ids, end-of-turn control tokens */
    int n_stop, cap_stop;
};

/* GPT-2's bytes_to_unicode: the code point byte b is written as. */
uint32_t tok_byte_to_cp(uint8_t b);

model_tok *tok_alloc(int n_vocab, char *err, size_t errlen);
int tok_set_token(model_tok *t, int32_t id, const char *text, size_t len, enum model_tok_attr attr,
                  char *err, size_t errlen);
int tok_index_vocab(model_tok *t, char *err, size_t errlen);
/* Adds merge (a, b) with the next rank. Unknown a or b -> SL_EFORMAT; a
 * merge whose result is not in the vocab is ignored (it can never yield a
 * token), as is a repeated pair (the first rank wins). */
int tok_add_merge(model_tok *t, const char *a, size_t alen, const char *b, size_t blen, char *err,
                  size_t errlen);
/* Sets the pre-tokenizer from a llama.cpp pre name ("gpt-2", "llama-bpe",
 * "qwen2", "smollm", ...). Unknown name -> SL_EUNSUP naming it. */
int tok_set_pre_name(model_tok *t, const char *name, char *err, size_t errlen);
/* Sets the pre-tokenizer from explicit patterns (n <= TOK_MAX_REGEX). */
int tok_set_pre_regexes(model_tok *t, const char *name, const char *const *pats, int n, char *err,
                        size_t errlen);
int tok_add_stop(model_tok *t, int32_t id);
int tok_finish(model_tok *t, char *err, size_t errlen);

/* The GPT-2 pattern (ByteLevel use_regex=true in HF). */
extern const char tok_gpt2_regex[];

#endif

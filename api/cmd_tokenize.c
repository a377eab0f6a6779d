/* cmd_tokenize.c - `sluice tokenize`: text to ids (a JSON array on stdout),
 * or ids to text (printed exactly, no newline added). */
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "api.h"
#include "base/json.h"
#include "model/model.h"

/* Parses a JSON array of integers into a new malloc'ed array. */
static int parse_ids(const char *text, int32_t **ids, int *n, char *err, size_t errlen)
{
    json_doc d;
    if (json_parse(&d, text, strlen(text), err, errlen)) return -1;
    int rc = -1;
    if (!json_is_arr(&d, 0)) {
        snprintf(err, errlen, "--ids must be a JSON array of token ids");
        goto out;
    }
    *n = json_size(&d, 0);
    *ids = malloc(sizeof **ids * (size_t)(*n > 0 ? *n : 1));
    if (!*ids) goto out;
    for (int k = 0, i = 1; k < *n; k++, i = json_skip(&d, i)) {
        int64_t v;
        if (json_i64(&d, i, &v) || v < 0 || v > INT32_MAX) {
            snprintf(err, errlen, "--ids element %d is not a token id", k);
            free(*ids);
            *ids = NULL;
            goto out;
        }
        (*ids)[k] = (int32_t)v;
    }
    rc = 0;
out:
    json_free(&d);
    return rc;
}

int api_cmd_tokenize(int argc, char **argv)
{
    const char *model_path = NULL, *text = NULL, *ids_json = NULL;
    bool no_special = false, add_bos = true, skip_special = false;
    const struct api_flag flags[] = {
        {"--model", API_FLAG_STR, &model_path, "GGUF file or HF checkpoint directory", NULL},
        {"--text", API_FLAG_STR, &text, "text to encode; prints the ids as a JSON array", NULL},
        {"--ids", API_FLAG_STR, &ids_json, "JSON array of ids to decode; prints the text exactly", NULL},
        {"--add-bos", API_FLAG_BOOL, &add_bos, "add BOS when the model asks for it (default)", "--no-add-bos"},
        {"--no-parse-special", API_FLAG_BOOL, &no_special, "treat special-token text as plain text", NULL},
        {"--skip-special", API_FLAG_BOOL, &skip_special, "decode: drop control tokens", NULL},
        {0},
    };
    char err[512];
    const char *pos[1];
    int flags_rc;
    int np = api_cmd_flags("tokenize", "usage: sluice tokenize --model PATH (--text TEXT | --ids '[1,2,3]')\n\n", argc, argv, 2, flags, pos, 1, &flags_rc);
    if (np < 0) return flags_rc;
    if (np == 1 && !model_path) model_path = pos[0];
    if (!model_path || (!text == !ids_json)) {
        fprintf(stderr, "sluice tokenize: needs --model and exactly one of --text / --ids\n");
        return 2;
    }
    struct model_load_opts lo = {0};
    model *m = model_load(model_path, &lo, err, sizeof err);
    if (!m) {
        fprintf(stderr, "sluice tokenize: %s\n", err);
        return 1;
    }
    const model_tok *tok = model_get_tok(m);
    int rc = 1;
    if (text) {
        size_t len = strlen(text);
        int cap = (int)len + 8;
        int32_t *ids = malloc(sizeof *ids * (size_t)cap);
        int n = ids ? model_tok_encode(tok, text, len, add_bos, !no_special, ids, cap) : SL_ENOMEM;
        if (n < 0 || n > cap) {
            fprintf(stderr, "sluice tokenize: encoding failed (%d)\n", n);
        } else {
            putchar('[');
            for (int i = 0; i < n; i++) printf(i ? ", %d" : "%d", ids[i]);
            puts("]");
            rc = 0;
        }
        free(ids);
    } else {
        int32_t *ids = NULL;
        int n = 0;
        if (parse_ids(ids_json, &ids, &n, err, sizeof err)) {
            fprintf(stderr, "sluice tokenize: %s\n", err);
        } else {
            int bad = -1;
            for (int i = 0; i < n && bad < 0; i++)
                if (ids[i] >= model_tok_n_vocab(tok)) bad = i;
            long need = bad < 0 ? model_tok_decode(tok, ids, n, skip_special, NULL, 0) : -1;
            char *out = need >= 0 ? malloc((size_t)need + 1) : NULL;
            if (bad >= 0) {
                fprintf(stderr, "sluice tokenize: id %d is outside the vocabulary (%d tokens)\n", ids[bad],
                        model_tok_n_vocab(tok));
            } else if (out && model_tok_decode(tok, ids, n, skip_special, out, (size_t)need) == need) {
                fwrite(out, 1, (size_t)need, stdout);
                rc = 0;
            }
            free(out);
        }
        free(ids);
    }
    model_free(m);
    return rc;
}

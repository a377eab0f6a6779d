/* test_loader.c - model files validated at load (model/loader.c,
 * model/tok_hf.c): config values of the wrong type or out of range name
 * their key, a tokenizer larger than the model's vocabulary is refused with
 * both sizes, non-finite weights are found by model_check_weights (and by
 * model_load with check_weights) naming the tensor, and GGUF metadata of the
 * wrong type names the key. Works on copies of tests/models/tiny-llama and
 * the default GGUF in a temporary directory, corrupted here. */
#include <math.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>
#include <unistd.h>

#include "base/json.h"
#include "model/model.h"
#include "test.h"

static const char *const files[] = {"model.safetensors", "tokenizer.json", "tokenizer_config.json", "config.json",
                                    "generation_config.json"};
#define N_FILES (sizeof files / sizeof *files)

static int write_bytes(const char *path, const char *p, size_t n)
{
    FILE *f = fopen(path, "wb");
    if (!f) return -1;
    size_t w = fwrite(p, 1, n, f);
    return fclose(f) == 0 && w == n ? 0 : -1;
}

/* dir: a fresh copy of tiny-llama (real copies: the tests write into them). */
static int copy_tiny(char *dir, size_t cap)
{
    snprintf(dir, cap, "/tmp/sluice_test_loader_XXXXXX");
    if (!mkdtemp(dir)) return -1;
    for (size_t i = 0; i < N_FILES; i++) {
        char p[512], q[512];
        size_t n;
        snprintf(p, sizeof p, "tests/models/tiny-llama/%s", files[i]);
        snprintf(q, sizeof q, "%s/%s", dir, files[i]);
        char *b = test_slurp(p, &n);
        if (!b || write_bytes(q, b, n)) {
            free(b);
            return -1;
        }
        free(b);
    }
    return 0;
}

static void rm_tiny(const char *dir)
{
    for (size_t i = 0; i < N_FILES; i++) {
        char q[512];
        snprintf(q, sizeof q, "%s/%s", dir, files[i]);
        unlink(q);
    }
    rmdir(dir);
}

/* Replaces the first `from` in dir/name with `to`; -1 when it is not there. */
static int edit(const char *dir, const char *name, const char *from, const char *to)
{
    char q[512];
    snprintf(q, sizeof q, "%s/%s", dir, name);
    size_t n;
    char *b = test_slurp(q, &n);
    char *at = b ? strstr(b, from) : NULL;
    if (!at) {
        free(b);
        return -1;
    }
    size_t fl = strlen(from), tl = strlen(to);
    char *o = malloc(n - fl + tl + 1);
    memcpy(o, b, (size_t)(at - b));
    memcpy(o + (at - b), to, tl);
    memcpy(o + (at - b) + tl, at + fl, n - (size_t)(at - b) - fl);
    int rc = write_bytes(q, o, n - fl + tl);
    free(o);
    free(b);
    return rc;
}

/* Loads dir and checks the error mentions every one of the words (NULL-ended). */
static void expect_load_error(const char *dir, bool check, const char *what, const char *const *words)
{
    char err[512] = "";
    struct model_load_opts lo = {.check_weights = check};
    model *m = model_load(dir, &lo, err, sizeof err);
    CHECKF(m == NULL, "%s: loaded", what);
    for (int i = 0; words[i]; i++) CHECKF(strstr(err, words[i]) != NULL, "%s: '%s' not in: %s", what, words[i], err);
    model_free(m);
}

static void test_config_values_named(void)
{
    static const struct { const char *from, *to, *words[3]; } cases[] = {
        {"\"rope_theta\": 500000.0", "\"rope_theta\": \"x\"", {"config.json", "rope_theta"}},
        {"\"rms_norm_eps\": 1e-06", "\"rms_norm_eps\": \"1e-6\"", {"rms_norm_eps", "number"}},
        {"\"rms_norm_eps\": 1e-06", "\"rms_norm_eps\": 0", {"rms_norm_eps"}},
        {"\"tie_word_embeddings\": false", "\"tie_word_embeddings\": \"no\"", {"tie_word_embeddings"}},
        {"\"num_key_value_heads\": 2", "\"num_key_value_heads\": 0", {"num_key_value_heads", "is 0"}},
        {"\"num_key_value_heads\": 2", "\"num_key_value_heads\": 3", {"num_key_value_heads", "divide"}},
        {"\"hidden_size\": 32", "\"hidden_size\": -32", {"hidden_size"}},
        {"\"num_hidden_layers\": 2", "\"num_hidden_layers\": \"2\"", {"num_hidden_layers", "integer"}},
        {"\"max_position_embeddings\": 2048", "\"max_position_embeddings\": 0", {"max_position_embeddings"}},
        {"\"head_dim\": 8", "\"head_dim\": 7", {"head_dim", "even"}},
        {"\"factor\": 8.0", "\"factor\": \"8\"", {"factor"}},
        {"\"rope_parameters\": {", "\"rope_scaling\": 5, \"rope_parameters\": {", {"rope_scaling", "object"}},
        {"\"use_cache\": true", "\"use_cache\": true, \"sliding_window\": \"x\"", {"sliding_window"}},
        {"\"attention_bias\": false", "\"attention_bias\": 0", {"attention_bias"}},
        {"\"hidden_act\": \"silu\"", "\"hidden_act\": 5", {"hidden_act"}},
    };
    char dir[256];
    CHECK(copy_tiny(dir, sizeof dir) == 0);
    char cfg[512];
    snprintf(cfg, sizeof cfg, "%s/config.json", dir);
    size_t n;
    char *orig = test_slurp(cfg, &n);
    CHECK(orig != NULL);
    char err[512];
    struct model_load_opts lo = {0};
    model *m = model_load(dir, &lo, err, sizeof err); /* the copy as it is loads */
    CHECKF(m != NULL, "%s", err);
    model_free(m);
    for (size_t k = 0; orig && k < sizeof cases / sizeof *cases; k++) {
        CHECK(write_bytes(cfg, orig, n) == 0);
        CHECKF(edit(dir, "config.json", cases[k].from, cases[k].to) == 0, "%s", cases[k].from);
        expect_load_error(dir, false, cases[k].to, cases[k].words);
    }
    free(orig);
    rm_tiny(dir);
}

static void test_tokenizer_config_types(void)
{
    char dir[256];
    CHECK(copy_tiny(dir, sizeof dir) == 0);
    CHECK(edit(dir, "tokenizer_config.json", "{", "{\"add_bos_token\": \"yes\", ") == 0);
    expect_load_error(dir, false, "add_bos_token", (const char *const[]){"add_bos_token", NULL});
    rm_tiny(dir);
    CHECK(copy_tiny(dir, sizeof dir) == 0);
    CHECK(edit(dir, "generation_config.json", "{", "{\"bos_token_id\": \"1\", ") == 0);
    expect_load_error(dir, false, "bos_token_id", (const char *const[]){"bos_token_id", NULL});
    rm_tiny(dir);
}

static void test_tokenizer_larger_than_vocab(void)
{
    char dir[256];
    CHECK(copy_tiny(dir, sizeof dir) == 0);
    /* one added token past the 49152 rows of the embedding */
    CHECK(edit(dir, "tokenizer.json", "\"added_tokens\": [",
               "\"added_tokens\": [{\"id\": 49160, \"content\": \"<extra>\", \"single_word\": false, \"lstrip\": "
               "false, \"rstrip\": false, \"normalized\": false, \"special\": true}, ") == 0 ||
          edit(dir, "tokenizer.json", "\"added_tokens\":[",
               "\"added_tokens\":[{\"id\":49160,\"content\":\"<extra>\",\"single_word\":false,\"lstrip\":false,"
               "\"rstrip\":false,\"normalized\":false,\"special\":true},") == 0);
    expect_load_error(dir, false, "tokenizer", (const char *const[]){"49161", "49152", "vocab_size", NULL});
    rm_tiny(dir);
}

/* The byte offset of tensor name's data in a safetensors file, or -1. */
static long st_offset(const char *path, const char *name)
{
    size_t n;
    char *b = test_slurp(path, &n);
    if (!b || n < 8) {
        free(b);
        return -1;
    }
    uint64_t hl;
    memcpy(&hl, b, 8);
    json_doc d;
    char err[64];
    long off = -1;
    if (json_parse(&d, b + 8, (size_t)hl, err, sizeof err) == 0) {
        int t = json_get(&d, 0, name), o = t >= 0 ? json_get(&d, t, "data_offsets") : -1;
        int64_t v;
        if (o >= 0 && json_i64(&d, json_at(&d, o, 0), &v) == 0) off = (long)(8 + hl + (uint64_t)v);
        json_free(&d);
    }
    free(b);
    return off;
}

/* Writes one bf16 value (bits) as element k of tensor name in dir's checkpoint. */
static int poke_bf16(const char *dir, const char *name, long k, uint16_t bits)
{
    char q[512];
    snprintf(q, sizeof q, "%s/model.safetensors", dir);
    long off = st_offset(q, name);
    FILE *f = off >= 0 ? fopen(q, "r+b") : NULL;
    if (!f) return -1;
    int rc = fseek(f, off + 2 * k, SEEK_SET) == 0 && fwrite(&bits, 2, 1, f) == 1 ? 0 : -1;
    return fclose(f) == 0 ? rc : -1;
}

static void test_check_weights(void)
{
    char dir[256], err[512];
    CHECK(copy_tiny(dir, sizeof dir) == 0);
    struct model_load_opts lo = {.check_weights = true};
    model *m = model_load(dir, &lo, err, sizeof err); /* clean weights pass */
    CHECKF(m != NULL, "%s", err);
    if (m) CHECKF(model_check_weights(m, err, sizeof err) == 0, "%s", err);
    model_free(m);
    CHECK(poke_bf16(dir, "model.layers.1.mlp.up_proj.weight", 77, 0x7fc0) == 0); /* NaN */
    lo.check_weights = false;
    m = model_load(dir, &lo, err, sizeof err); /* not asked: the load does not read the weights */
    CHECKF(m != NULL, "%s", err);
    if (m) {
        CHECK(model_check_weights(m, err, sizeof err) == SL_EFORMAT);
        CHECKF(strstr(err, "model.layers.1.mlp.up_proj.weight") && strstr(err, "NaN") && strstr(err, "element 77"),
               "%s", err);
    }
    model_free(m);
    expect_load_error(dir, true, "NaN", (const char *const[]){"model.layers.1.mlp.up_proj.weight", "NaN", NULL});
    CHECK(poke_bf16(dir, "model.layers.1.mlp.up_proj.weight", 77, 0x3f80) == 0); /* 1.0 again */
    CHECK(poke_bf16(dir, "model.norm.weight", 3, 0xff80) == 0);                  /* -inf */
    expect_load_error(dir, true, "inf", (const char *const[]){"model.norm.weight", "infinity", NULL});
    rm_tiny(dir);
}

/* Changes the value type of GGUF metadata key (a same-size type, so the
 * layout stays valid) in a copy of the default model. */
static int gguf_retype(const char *src, const char *dst, const char *key, uint32_t from, uint32_t to)
{
    size_t n;
    char *b = test_slurp(src, &n);
    if (!b) return -1;
    size_t kl = strlen(key);
    int rc = -1;
    for (size_t i = 8; i + 8 + kl + 4 <= n && i < (16u << 20); i++) {
        uint64_t len;
        memcpy(&len, b + i, 8);
        if (len != kl || memcmp(b + i + 8, key, kl)) continue;
        uint32_t t;
        memcpy(&t, b + i + 8 + kl, 4);
        if (t != from) break;
        memcpy(b + i + 8 + kl, &to, 4);
        rc = write_bytes(dst, b, n);
        break;
    }
    free(b);
    return rc;
}

static void test_gguf_metadata_types(void)
{
    const char *model_path = "models/SmolLM2-135M-Instruct.Q4_1.gguf";
    if (access(model_path, R_OK) != 0) {
        printf("  (no default model: skipped)\n");
        return;
    }
    char dst[] = "/tmp/sluice_test_loader_gguf_XXXXXX";
    int fd = mkstemp(dst);
    CHECK(fd >= 0);
    if (fd < 0) return;
    close(fd);
    enum { U8 = 0, U32 = 4, I32 = 5, F32 = 6, BOOL = 7 };
    CHECK(gguf_retype(model_path, dst, "llama.rope.freq_base", F32, I32) == 0);
    expect_load_error(dst, false, "freq_base", (const char *const[]){"llama.rope.freq_base", "floating", NULL});
    CHECK(gguf_retype(model_path, dst, "llama.block_count", U32, F32) == 0);
    expect_load_error(dst, false, "block_count", (const char *const[]){"llama.block_count", "integer", NULL});
    CHECK(gguf_retype(model_path, dst, "llama.attention.head_count_kv", U32, F32) == 0);
    expect_load_error(dst, false, "head_count_kv", (const char *const[]){"llama.attention.head_count_kv", NULL});
    /* the tokenizer's metadata too: no silent "no BOS" or default pre-tokenizer */
    CHECK(gguf_retype(model_path, dst, "tokenizer.ggml.bos_token_id", U32, F32) == 0);
    expect_load_error(dst, false, "bos_token_id", (const char *const[]){"tokenizer.ggml.bos_token_id", NULL});
    CHECK(gguf_retype(model_path, dst, "tokenizer.ggml.add_bos_token", BOOL, U8) == 0);
    expect_load_error(dst, false, "add_bos_token", (const char *const[]){"tokenizer.ggml.add_bos_token", NULL});
    unlink(dst);
}

int main(void)
{
    RUN(test_config_values_named);
    RUN(test_tokenizer_config_types);
    RUN(test_tokenizer_larger_than_vocab);
    RUN(test_check_weights);
    RUN(test_gguf_metadata_types);
    return test_summary();
}

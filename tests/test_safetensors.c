/* test_safetensors.c - the safetensors reader on files written here: single
 * file, directory, sharded with an index, and malformed headers, offsets,
 * dtypes and shards, which must fail with a message naming the problem. */
#include <fcntl.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>
#include <unistd.h>

#include "model/model.h"
#include "model/safetensors.h"
#include "tests/test.h"

static char tmpdir[256];
static char made[64][512]; /* files to remove at the end */
static int n_made;

static void path_of(char *out, size_t cap, const char *name) { snprintf(out, cap, "%s/%s", tmpdir, name); }

static void remember(const char *path)
{
    for (int i = 0; i < n_made; i++)
        if (strcmp(made[i], path) == 0) return;
    if (n_made < 64) snprintf(made[n_made++], sizeof made[0], "%s", path);
}

static void write_raw(const char *name, const void *p, size_t n)
{
    char path[512];
    path_of(path, sizeof path, name);
    if (strchr(name, '/')) {
        char d[512];
        snprintf(d, sizeof d, "%s", path);
        *strrchr(d, '/') = '\0';
        mkdir(d, 0755);
    }
    unlink(path); /* a fresh inode: rewriting by truncation makes ext4 flush on close */
    FILE *fp = fopen(path, "wb");
    if (!fp) return;
    if (n) fwrite(p, 1, n, fp);
    fclose(fp);
    remember(path);
}

/* Writes an 8-byte length, the header (padded with spaces to 8) and data. */
static void write_st(const char *name, const char *header, const void *data, size_t n)
{
    size_t hl = strlen(header), padded = (hl + 7) / 8 * 8;
    size_t total = 8 + padded + n;
    uint8_t *b = malloc(total);
    uint64_t L = padded;
    memcpy(b, &L, 8);
    memcpy(b + 8, header, hl);
    memset(b + 8 + hl, ' ', padded - hl);
    if (n) memcpy(b + 8 + padded, data, n);
    write_raw(name, b, total);
    free(b);
}

static st_set *open_name(const char *name, char *err, size_t errlen)
{
    char path[512];
    path_of(path, sizeof path, name);
    return st_open_file(path, err, errlen);
}

static st_set *open_sub(const char *sub, char *err, size_t errlen)
{
    char path[512];
    path_of(path, sizeof path, sub);
    return st_open_dir(path, err, errlen);
}

/* The bytes of the good file: a F32 [2,3], b F16 [4], c BF16 [2,2], d F32 [], e F32 [0,5]. */
static uint8_t good_data[24 + 8 + 8 + 4 + 4];
static const char *good_header =
    "{\"__metadata__\":{\"format\":\"pt\"},"
    "\"a\":{\"dtype\":\"F32\",\"shape\":[2,3],\"data_offsets\":[0,24]},"
    "\"b\":{\"dtype\":\"F16\",\"shape\":[4],\"data_offsets\":[24,32]},"
    "\"c\":{\"data_offsets\":[32,40],\"shape\":[2,2],\"dtype\":\"BF16\"},"
    "\"d\":{\"dtype\":\"F32\",\"shape\":[],\"data_offsets\":[40,44]},"
    "\"e\":{\"dtype\":\"F32\",\"shape\":[0,5],\"data_offsets\":[44,44]},"
    "\"model.layers.0.self_attn.q_proj.weight\\u0021\":{\"dtype\":\"F32\",\"shape\":[1],\"data_offsets\":[44,48]}}";

static void fill_good(void)
{
    float a[6] = {1, -2, 3.5f, 0, 1e-3f, -7};
    uint16_t b[4] = {0x3C00, 0xC000, 0x0001, 0x7C00}; /* 1, -2, 2^-24, inf */
    uint16_t c[4] = {0x3F80, 0xBF80, 0x4049, 0x0000}; /* 1, -1, 3.140625, 0 */
    float d = 42;
    memcpy(good_data, a, 24);
    memcpy(good_data + 24, b, 8);
    memcpy(good_data + 32, c, 8);
    memcpy(good_data + 40, &d, 4);
}

static void check_single(void)
{
    fill_good();
    write_st("good.safetensors", good_header, good_data, sizeof good_data);
    char err[512];
    st_set *s = open_name("good.safetensors", err, sizeof err);
    CHECKF(s != NULL, "%s", err);
    if (!s) return;
    CHECK(st_n_tensors(s) == 6);
    const struct st_tensor *a = st_find(s, "a"), *b = st_find(s, "b"), *c = st_find(s, "c");
    const struct st_tensor *d = st_find(s, "d"), *e = st_find(s, "e");
    CHECK(a && a->dtype == MODEL_DT_F32 && a->ndim == 2 && a->shape[0] == 2 && a->shape[1] == 3 && a->nbytes == 24);
    CHECK(b && b->dtype == MODEL_DT_F16 && b->ndim == 1 && b->shape[0] == 4 && b->nbytes == 8);
    CHECK(c && c->dtype == MODEL_DT_BF16 && c->ndim == 2 && c->nbytes == 8);
    CHECK(d && d->ndim == 0 && d->nbytes == 4);
    CHECK(e && e->ndim == 2 && e->shape[0] == 0 && e->nbytes == 0);
    CHECK(st_find(s, "model.layers.0.self_attn.q_proj.weight!") != NULL); /* escaped name */
    CHECK(st_find(s, "__metadata__") == NULL && st_find(s, "z") == NULL && st_find(s, "") == NULL);
    CHECK(st_tensor_at(s, -1) == NULL && st_tensor_at(s, 6) == NULL && st_tensor_at(s, 0) != NULL);
    if (a && b && c && d) {
        CHECK(memcmp(a->data, good_data, 24) == 0);
        CHECK(memcmp(d->data, good_data + 40, 4) == 0);
        struct model_tensor t = {.name = b->name, .dtype = b->dtype, .ndim = 1, .ne = {4, 1, 1, 1},
                                 .data = b->data, .nbytes = b->nbytes};
        float x[4];
        model_tensor_to_f32(&t, 0, 4, x);
        CHECK(x[0] == 1.0f && x[1] == -2.0f && x[2] == 0x1p-24f && x[3] > 3e38f);
        t.dtype = c->dtype;
        t.data = c->data;
        model_tensor_to_f32(&t, 0, 4, x);
        CHECK(x[0] == 1.0f && x[1] == -1.0f && x[2] == 3.140625f && x[3] == 0.0f);
    }
    st_close(s);
    /* the same file through st_open_dir */
    write_st("single/model.safetensors", good_header, good_data, sizeof good_data);
    s = open_sub("single", err, sizeof err);
    CHECKF(s != NULL && st_n_tensors(s) == 6, "%s", err);
    st_close(s);
    st_close(NULL);
}

static void check_sharded(void)
{
    float x[8] = {1, 2, 3, 4, 5, 6, 7, 8};
    write_st("sharded/model-00001-of-00002.safetensors",
             "{\"w1\":{\"dtype\":\"F32\",\"shape\":[2,2],\"data_offsets\":[0,16]},"
             "\"w2\":{\"dtype\":\"F32\",\"shape\":[1],\"data_offsets\":[16,20]}}",
             x, 20);
    write_st("sharded/model-00002-of-00002.safetensors",
             "{\"__metadata__\":{},\"w3\":{\"dtype\":\"F32\",\"shape\":[3],\"data_offsets\":[0,12]}}", x + 5, 12);
    const char *idx = "{\"metadata\":{\"total_size\":32},\"weight_map\":{"
                      "\"w1\":\"model-00001-of-00002.safetensors\","
                      "\"w3\":\"model-00002-of-00002.safetensors\","
                      "\"w2\":\"model-00001-of-00002.safetensors\"}}";
    write_raw("sharded/model.safetensors.index.json", idx, strlen(idx));
    char err[512];
    st_set *s = open_sub("sharded", err, sizeof err);
    CHECKF(s != NULL, "%s", err);
    if (!s) return;
    CHECK(st_n_tensors(s) == 3);
    const struct st_tensor *w1 = st_find(s, "w1"), *w3 = st_find(s, "w3");
    CHECK(w1 && w1->shape[0] == 2 && w1->shape[1] == 2 && memcmp(w1->data, x, 16) == 0);
    CHECK(w3 && w3->shape[0] == 3 && memcmp(w3->data, x + 5, 12) == 0);
    st_close(s);

    /* a listed shard that is missing */
    const char *idx2 = "{\"weight_map\":{\"w1\":\"model-00001-of-00002.safetensors\","
                       "\"w9\":\"model-00003-of-00003.safetensors\"}}";
    write_raw("sharded/model.safetensors.index.json", idx2, strlen(idx2));
    s = open_sub("sharded", err, sizeof err);
    CHECKF(s == NULL && strstr(err, "model-00003-of-00003.safetensors"), "%s", err);
    /* a tensor listed in the wrong shard */
    const char *idx3 = "{\"weight_map\":{\"w1\":\"model-00002-of-00002.safetensors\","
                       "\"w3\":\"model-00002-of-00002.safetensors\"}}";
    write_raw("sharded/model.safetensors.index.json", idx3, strlen(idx3));
    s = open_sub("sharded", err, sizeof err);
    CHECKF(s == NULL && strstr(err, "'w1' is not in shard model-00002"), "%s", err);
    /* path escapes, no weight_map, bad JSON */
    const char *idx4 = "{\"weight_map\":{\"w1\":\"../../etc/passwd\"}}";
    write_raw("sharded/model.safetensors.index.json", idx4, strlen(idx4));
    s = open_sub("sharded", err, sizeof err);
    CHECKF(s == NULL && strstr(err, "invalid shard file name"), "%s", err);
    const char *idx5 = "{\"metadata\":{}}";
    write_raw("sharded/model.safetensors.index.json", idx5, strlen(idx5));
    s = open_sub("sharded", err, sizeof err);
    CHECKF(s == NULL && strstr(err, "weight_map"), "%s", err);
    const char *idx6 = "{\"weight_map\":{\"w1\":";
    write_raw("sharded/model.safetensors.index.json", idx6, strlen(idx6));
    s = open_sub("sharded", err, sizeof err);
    CHECKF(s == NULL && strstr(err, "invalid JSON"), "%s", err);
    /* the same tensor in two shards */
    write_st("sharded/model-00002-of-00002.safetensors",
             "{\"w1\":{\"dtype\":\"F32\",\"shape\":[3],\"data_offsets\":[0,12]}}", x, 12);
    const char *idx7 = "{\"weight_map\":{\"w1\":\"model-00001-of-00002.safetensors\","
                       "\"w2\":\"model-00002-of-00002.safetensors\"}}";
    write_raw("sharded/model.safetensors.index.json", idx7, strlen(idx7));
    s = open_sub("sharded", err, sizeof err);
    CHECKF(s == NULL && strstr(err, "'w1' appears twice"), "%s", err);
    /* nothing to open */
    mkdir(tmpdir, 0755);
    char empty[512];
    path_of(empty, sizeof empty, "emptydir");
    mkdir(empty, 0755);
    s = st_open_dir(empty, err, sizeof err);
    CHECKF(s == NULL && strstr(err, "neither"), "%s", err);
    rmdir(empty);
}

/* Writes header + 64 bytes of data and expects failure naming want. */
static void expect_bad(const char *header, size_t data_len, const char *want, int line)
{
    static uint8_t data[256];
    write_st("bad.safetensors", header, data, data_len);
    char err[512] = "";
    st_set *s = open_name("bad.safetensors", err, sizeof err);
    CHECKF(s == NULL, "line %d: opened", line);
    CHECKF(err[0] && strstr(err, want), "line %d: message '%s' lacks '%s'", line, err, want);
    st_close(s);
}
#define BAD(h, n, want) expect_bad(h, n, want, __LINE__)

static void check_malformed(void)
{
    char err[512];
    uint8_t raw[64] = {0};
    write_raw("tiny.safetensors", raw, 5);
    st_set *s = open_name("tiny.safetensors", err, sizeof err);
    CHECKF(s == NULL && strstr(err, "too small"), "%s", err);
    uint64_t L = 1000; /* header longer than the file */
    memcpy(raw, &L, 8);
    memcpy(raw + 8, "{}", 2);
    write_raw("long.safetensors", raw, 10);
    s = open_name("long.safetensors", err, sizeof err);
    CHECKF(s == NULL && strstr(err, "header length 1000"), "%s", err);
    L = UINT64_MAX;
    memcpy(raw, &L, 8);
    write_raw("long.safetensors", raw, 10);
    s = open_name("long.safetensors", err, sizeof err);
    CHECKF(s == NULL && strstr(err, "header length"), "%s", err);
    s = open_name("does-not-exist.safetensors", err, sizeof err);
    CHECKF(s == NULL && strstr(err, "cannot open"), "%s", err);

    /* an empty header object is a valid, empty file */
    write_st("empty.safetensors", "{}", NULL, 0);
    s = open_name("empty.safetensors", err, sizeof err);
    CHECKF(s != NULL && st_n_tensors(s) == 0, "%s", err);
    st_close(s);

    BAD("{\"a\":", 0, "invalid JSON");
    BAD("[1,2]", 0, "not a JSON object");
    BAD("{} {}", 0, "trailing");
    BAD("{\"a\":{\"dtype\":\"F32\",\"shape\":[1],\"data_offsets\":[0,4]}}x", 4, "JSON");
    BAD("{\"a\":5}", 0, "'a': entry is not an object");
    BAD("{\"a\":{\"shape\":[1],\"data_offsets\":[0,4]}}", 4, "'a': needs");
    BAD("{\"a\":{\"dtype\":\"F32\",\"shape\":1,\"data_offsets\":[0,4]}}", 4, "'a': needs");
    BAD("{\"a\":{\"dtype\":\"F32\",\"shape\":[1],\"data_offsets\":[0,4,8]}}", 8, "'a': needs");
    BAD("{\"a\":{\"dtype\":\"F32\",\"shape\":[1],\"data_offsets\":[0,8]}}", 4, "extend past");
    BAD("{\"a\":{\"dtype\":\"F32\",\"shape\":[1],\"data_offsets\":[8,4]}}", 16, "begin <= end");
    BAD("{\"a\":{\"dtype\":\"F32\",\"shape\":[1],\"data_offsets\":[-4,0]}}", 16, "begin <= end");
    BAD("{\"a\":{\"dtype\":\"F32\",\"shape\":[1],\"data_offsets\":[0,1e300]}}", 16, "data_offsets");
    BAD("{\"a\":{\"dtype\":\"F32\",\"shape\":[1],\"data_offsets\":[0,\"4\"]}}", 16, "data_offsets");
    BAD("{\"a\":{\"dtype\":\"F32\",\"shape\":[3],\"data_offsets\":[0,8]}}", 16, "hold 8 bytes");
    BAD("{\"a\":{\"dtype\":\"F16\",\"shape\":[2,3],\"data_offsets\":[0,8]}}", 16, "6 elements of F16");
    BAD("{\"a\":{\"dtype\":\"F32\",\"shape\":[-1],\"data_offsets\":[0,4]}}", 16, "shape[0]");
    BAD("{\"a\":{\"dtype\":\"F32\",\"shape\":[1.5],\"data_offsets\":[0,4]}}", 16, "shape[0]");
    BAD("{\"a\":{\"dtype\":\"F32\",\"shape\":[1099511627776,1099511627776,1099511627776],"
        "\"data_offsets\":[0,4]}}", 16, "overflows");
    BAD("{\"a\":{\"dtype\":\"F32\",\"shape\":[4611686018427387904],\"data_offsets\":[0,4]}}", 16, "'a': shape");
    BAD("{\"a\":{\"dtype\":\"F32\",\"shape\":[1,1,1,1,1,1,1,1,1],\"data_offsets\":[0,4]}}", 16, "9 dimensions");
    BAD("{\"ids\":{\"dtype\":\"U64\",\"shape\":[1],\"data_offsets\":[0,8]}}", 16,
        "tensor 'ids' has unsupported dtype U64");
    BAD("{\"q\":{\"dtype\":\"F8_E4M3\",\"shape\":[1],\"data_offsets\":[0,1]}}", 16, "'q' has unsupported dtype F8_E4M3");
    BAD("{\"a\":{\"dtype\":\"F32\",\"shape\":[2],\"data_offsets\":[0,8]},"
        "\"b\":{\"dtype\":\"F32\",\"shape\":[2],\"data_offsets\":[4,12]}}", 16, "overlap");
    BAD("{\"a\":{\"dtype\":\"F32\",\"shape\":[1],\"data_offsets\":[0,4]},"
        "\"a\":{\"dtype\":\"F32\",\"shape\":[1],\"data_offsets\":[4,8]}}", 16, "'a' appears twice");
    BAD("{\"a\\u0000b\":{\"dtype\":\"F32\",\"shape\":[1],\"data_offsets\":[0,4]}}", 16, "invalid name");
}

static uint64_t rng_state = 0x243F6A8885A308D3ull;
static uint64_t rnd(void)
{
    rng_state ^= rng_state << 13;
    rng_state ^= rng_state >> 7;
    rng_state ^= rng_state << 17;
    return rng_state;
}

/* Every truncation and many random byte changes of the good file. */
static void check_fuzz(void)
{
    fill_good();
    size_t hl = strlen(good_header), padded = (hl + 7) / 8 * 8, n = 8 + padded + sizeof good_data;
    uint8_t *b = malloc(n), *m = malloc(n);
    uint64_t L = padded;
    memcpy(b, &L, 8);
    memcpy(b + 8, good_header, hl);
    memset(b + 8 + hl, ' ', padded - hl);
    memcpy(b + 8 + padded, good_data, sizeof good_data);
    char err[512];
    int ok = 0, fail = 0, nomsg = 0;
    for (size_t len = 0; len < n; len++) {
        write_raw("fuzz.safetensors", b, len);
        err[0] = '\0';
        st_set *s = open_name("fuzz.safetensors", err, sizeof err);
        if (s) ok++;
        else if (err[0]) fail++;
        else nomsg++;
        st_close(s);
    }
    CHECKF(ok == 0 && nomsg == 0, "truncations: %d opened, %d without message", ok, nomsg);
    for (int it = 0; it < 3000; it++) {
        memcpy(m, b, n);
        int k = 1 + (int)(rnd() % 4);
        for (int j = 0; j < k; j++) m[rnd() % (8 + hl)] = "{}[]\",:0123456789-eE. \\uxF"[rnd() % 26];
        write_raw("fuzz.safetensors", m, n);
        err[0] = '\0';
        st_set *s = open_name("fuzz.safetensors", err, sizeof err);
        if (s) {
            for (int i = 0; i < st_n_tensors(s); i++) {
                const struct st_tensor *t = st_tensor_at(s, i);
                volatile uint8_t sink = 0;
                for (size_t q = 0; q < t->nbytes; q++) sink ^= ((const uint8_t *)t->data)[q];
                (void)sink;
            }
            ok++;
        } else if (err[0]) {
            fail++;
        } else {
            nomsg++;
        }
        st_close(s);
    }
    CHECKF(nomsg == 0 && fail > 1000, "flips: %d opened, %d failed, %d without message", ok, fail, nomsg);
    free(b);
    free(m);
}

int main(void)
{
    snprintf(tmpdir, sizeof tmpdir, "/tmp/sluice_test_st_XXXXXX");
    if (!mkdtemp(tmpdir)) {
        perror("mkdtemp");
        return 1;
    }
    RUN(check_single);
    RUN(check_sharded);
    RUN(check_malformed);
    RUN(check_fuzz);
    for (int i = 0; i < n_made; i++) unlink(made[i]);
    char d[512];
    const char *subs[] = {"single", "sharded"};
    for (int i = 0; i < 2; i++) {
        path_of(d, sizeof d, subs[i]);
        rmdir(d);
    }
    rmdir(tmpdir);
    return test_summary();
}

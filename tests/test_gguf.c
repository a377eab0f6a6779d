/* test_gguf.c - the GGUF reader and the dequantizers against gguf-py.
 *
 * tests/golden/gguf/golden.txt was written by make_golden.py (next to it)
 * with gguf.GGUFReader and gguf.quants.dequantize: metadata, tensor infos and
 * dequantized values of a synthetic file (every value and tensor type), the
 * default model and two vocab GGUFs. Dequantized values must match bit for
 * bit: ggml/gguf-py define each value as f16->f32 conversions and one f32
 * multiply (and one add for Q4_1), each rounded once, which we do too.
 *
 * Then robustness: truncation at many lengths, random byte corruption with a
 * fixed seed, and hand-crafted hostile headers must all fail cleanly with a
 * message (or succeed when the corruption is benign), never crash or hang.
 */
#include <errno.h>
#include <fcntl.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>
#include <unistd.h>

#include "model/gguf.h"
#include "model/model.h"
#include "tests/test.h"

#define GOLDEN_DIR "tests/golden/gguf"
#define MODEL_PATH "models/SmolLM2-135M-Instruct.Q4_1.gguf"

static char tmpdir[256];

static void make_tmpdir(void)
{
    snprintf(tmpdir, sizeof tmpdir, "/tmp/sluice_test_gguf_XXXXXX");
    if (!mkdtemp(tmpdir)) {
        perror("mkdtemp");
        exit(1);
    }
}

static void tmp_path(char *out, size_t cap, const char *name) { snprintf(out, cap, "%s/%s", tmpdir, name); }

static int write_file(const char *path, const void *p, size_t n)
{
    unlink(path); /* a fresh inode: rewriting by truncation makes ext4 flush on close */
    FILE *fp = fopen(path, "wb");
    if (!fp) return -1;
    size_t w = n ? fwrite(p, 1, n, fp) : 0;
    return fclose(fp) == 0 && w == n ? 0 : -1;
}

static uint8_t *read_file(const char *path, size_t *n)
{
    FILE *fp = fopen(path, "rb");
    if (!fp) return NULL;
    fseek(fp, 0, SEEK_END);
    long sz = ftell(fp);
    fseek(fp, 0, SEEK_SET);
    uint8_t *b = malloc(sz > 0 ? (size_t)sz : 1);
    if (b && fread(b, 1, (size_t)sz, fp) != (size_t)sz) {
        free(b);
        b = NULL;
    }
    fclose(fp);
    *n = (size_t)sz;
    return b;
}

static int hexval(char c)
{
    if (c >= '0' && c <= '9') return c - '0';
    if (c >= 'a' && c <= 'f') return c - 'a' + 10;
    return -1;
}

/* Compares a (len, hex-prefix) golden string with s. */
static int str_matches(struct gguf_str s, unsigned long long len, const char *hex)
{
    if (!s.p && s.len) return 0;
    if (s.len != len) return 0;
    if (strcmp(hex, "-") == 0) return len == 0;
    size_t nh = strlen(hex) / 2;
    if (nh > s.len) return 0;
    for (size_t i = 0; i < nh; i++) {
        int v = hexval(hex[2 * i]) * 16 + hexval(hex[2 * i + 1]);
        if ((uint8_t)s.p[i] != v) return 0;
    }
    return 1;
}

static int to_dtype(uint32_t type, enum model_dtype *dt)
{
    switch (type) {
    case GGUF_T_F32: *dt = MODEL_DT_F32; return 0;
    case GGUF_T_F16: *dt = MODEL_DT_F16; return 0;
    case GGUF_T_BF16: *dt = MODEL_DT_BF16; return 0;
    case GGUF_T_Q8_0: *dt = MODEL_DT_Q8_0; return 0;
    case GGUF_T_Q4_0: *dt = MODEL_DT_Q4_0; return 0;
    case GGUF_T_Q4_1: *dt = MODEL_DT_Q4_1; return 0;
    }
    return -1;
}

static struct model_tensor view(const struct gguf_tensor *g)
{
    struct model_tensor t = {0};
    t.name = g->name.p;
    to_dtype(g->type, &t.dtype);
    t.ndim = (int)g->ndim;
    for (int d = 0; d < 4; d++) t.ne[d] = g->ne[d];
    t.data = g->data;
    t.nbytes = (size_t)g->nbytes;
    return t;
}

/* Checks one scalar element of type vt at p against the golden text v. */
static int scalar_matches(enum gguf_vtype vt, const uint8_t *p, const char *v)
{
    char buf[64];
    switch (vt) {
    case GGUF_VT_UINT8: snprintf(buf, sizeof buf, "%u", p[0]); break;
    case GGUF_VT_INT8: snprintf(buf, sizeof buf, "%d", (int8_t)p[0]); break;
    case GGUF_VT_BOOL: snprintf(buf, sizeof buf, "%d", p[0] != 0); break;
    case GGUF_VT_UINT16: { uint16_t x; memcpy(&x, p, 2); snprintf(buf, sizeof buf, "%u", x); break; }
    case GGUF_VT_INT16: { int16_t x; memcpy(&x, p, 2); snprintf(buf, sizeof buf, "%d", x); break; }
    case GGUF_VT_UINT32: { uint32_t x; memcpy(&x, p, 4); snprintf(buf, sizeof buf, "%u", x); break; }
    case GGUF_VT_INT32: { int32_t x; memcpy(&x, p, 4); snprintf(buf, sizeof buf, "%d", x); break; }
    case GGUF_VT_FLOAT32: { uint32_t x; memcpy(&x, p, 4); snprintf(buf, sizeof buf, "%08x", x); break; }
    case GGUF_VT_UINT64: { uint64_t x; memcpy(&x, p, 8); snprintf(buf, sizeof buf, "%llu", (unsigned long long)x); break; }
    case GGUF_VT_INT64: { int64_t x; memcpy(&x, p, 8); snprintf(buf, sizeof buf, "%lld", (long long)x); break; }
    case GGUF_VT_FLOAT64: { uint64_t x; memcpy(&x, p, 8); snprintf(buf, sizeof buf, "%016llx", (unsigned long long)x); break; }
    default: return 0;
    }
    return strcmp(buf, v) == 0;
}

static size_t vt_size(enum gguf_vtype vt)
{
    switch (vt) {
    case GGUF_VT_UINT8: case GGUF_VT_INT8: case GGUF_VT_BOOL: return 1;
    case GGUF_VT_UINT16: case GGUF_VT_INT16: return 2;
    case GGUF_VT_UINT32: case GGUF_VT_INT32: case GGUF_VT_FLOAT32: return 4;
    default: return 8;
    }
}

/* A golden scalar KV through the typed getters. */
static void check_kv(const gguf_file *f, const char *key, int vt, char *rest)
{
    int64_t i = gguf_find(f, key);
    CHECKF(i >= 0, "key %s missing", key);
    if (i < 0) return;
    struct gguf_str k = gguf_kv_key(f, i);
    CHECK(k.len == strlen(key) && memcmp(k.p, key, k.len) == 0);
    CHECKF((int)gguf_kv_type(f, i) == vt, "key %s type %d, golden %d", key, gguf_kv_type(f, i), vt);
    int64_t iv;
    double dv;
    int bv;
    struct gguf_str sv;
    switch (vt) {
    case GGUF_VT_STRING: {
        unsigned long long len = strtoull(strtok(rest, " "), NULL, 10);
        char *hex = strtok(NULL, " ");
        CHECK(gguf_get_str(f, key, &sv) == 0);
        CHECKF(str_matches(sv, len, hex), "string %s differs", key);
        CHECK(gguf_get_i64(f, key, &iv) == -1);
        break;
    }
    case GGUF_VT_FLOAT32: case GGUF_VT_FLOAT64: {
        CHECK(gguf_get_f64(f, key, &dv) == 0);
        uint8_t raw[8];
        if (vt == GGUF_VT_FLOAT32) {
            float x = (float)dv;
            memcpy(raw, &x, 4);
        } else {
            memcpy(raw, &dv, 8);
        }
        CHECKF(scalar_matches((enum gguf_vtype)vt, raw, rest), "float %s differs (golden %s)", key, rest);
        CHECK(gguf_get_i64(f, key, &iv) == -1); /* floats do not convert to integers */
        break;
    }
    case GGUF_VT_BOOL:
        CHECK(gguf_get_bool(f, key, &bv) == 0 && bv == atoi(rest));
        CHECK(gguf_get_i64(f, key, &iv) == -1); /* bool/int conversion is refused */
        break;
    default: { /* integers */
        char *end;
        errno = 0;
        long long want = strtoll(rest, &end, 10);
        CHECK(gguf_get_f64(f, key, &dv) == -1);
        CHECK(gguf_get_bool(f, key, &bv) == -1);
        if (errno == ERANGE) { /* a u64 above INT64_MAX does not fit */
            CHECKF(gguf_get_i64(f, key, &iv) == -1, "%s: out of range u64 converted", key);
        } else {
            CHECKF(gguf_get_i64(f, key, &iv) == 0 && iv == want, "int %s = %lld, golden %s", key, (long long)iv,
                   rest);
        }
    }
    }
}

static void check_golden_file(void)
{
    char path[512];
    snprintf(path, sizeof path, "%s/golden.txt", GOLDEN_DIR);
    FILE *fp = fopen(path, "r");
    CHECKF(fp != NULL, "cannot open %s", path);
    if (!fp) return;
    static char line[16384];
    gguf_file *f = NULL;
    char err[512];
    int n_files = 0, n_kv = 0, n_el = 0, n_tensors = 0, n_vals = 0;
    struct gguf_array cur_arr = {0};
    char cur_arr_key[256] = "";
    while (fgets(line, sizeof line, fp)) {
        line[strcspn(line, "\n")] = '\0';
        char *sp = strchr(line, ' ');
        if (!sp) continue;
        *sp = '\0';
        char *rest = sp + 1;
        const char *tag = line;
        if (strcmp(tag, "file") == 0) {
            gguf_close(f);
            f = NULL;
            char *where = strtok(rest, " "), *name = strtok(NULL, " ");
            if (strcmp(where, "model") == 0) snprintf(path, sizeof path, "models/%s", name);
            else if (strcmp(where, "vocab") == 0) snprintf(path, sizeof path, "%s/%s", TEST_VOCAB_DIR, name);
            else snprintf(path, sizeof path, "%s/%s", GOLDEN_DIR, name);
            f = gguf_open(path, err, sizeof err);
            CHECKF(f != NULL, "%s", err);
            n_files++;
            continue;
        }
        if (!f) continue;
        if (strcmp(tag, "version") == 0) {
            CHECK(gguf_version(f) == (uint32_t)atoi(rest));
        } else if (strcmp(tag, "alignment") == 0) {
            CHECK(gguf_alignment(f) == (uint32_t)atoi(rest));
        } else if (strcmp(tag, "n_kv") == 0) {
            CHECKF(gguf_n_kv(f) == atoll(rest), "n_kv %lld golden %s", (long long)gguf_n_kv(f), rest);
        } else if (strcmp(tag, "n_tensors") == 0) {
            CHECK(gguf_n_tensors(f) == atoll(rest));
        } else if (strcmp(tag, "kv") == 0) {
            char *key = strtok(rest, " ");
            int vt = atoi(strtok(NULL, " "));
            char *val = strtok(NULL, "");
            check_kv(f, key, vt, val);
            n_kv++;
        } else if (strcmp(tag, "arr") == 0) {
            char *key = strtok(rest, " ");
            int et = atoi(strtok(NULL, " "));
            unsigned long long n = strtoull(strtok(NULL, " "), NULL, 10);
            snprintf(cur_arr_key, sizeof cur_arr_key, "%s", key);
            memset(&cur_arr, 0, sizeof cur_arr);
            CHECKF(gguf_get_arr(f, key, &cur_arr) == 0, "array %s missing", key);
            CHECK(gguf_kv_type(f, gguf_find(f, key)) == GGUF_VT_ARRAY);
            CHECKF((int)cur_arr.type == et && cur_arr.n == n, "array %s: type %d n %llu, golden %d %llu", key,
                   cur_arr.type, (unsigned long long)cur_arr.n, et, n);
            int64_t iv;
            CHECK(gguf_get_i64(f, key, &iv) == -1);
            n_kv++;
        } else if (strcmp(tag, "el") == 0) {
            char *key = strtok(rest, " ");
            unsigned long long idx = strtoull(strtok(NULL, " "), NULL, 10);
            char *val = strtok(NULL, "");
            CHECK(strcmp(key, cur_arr_key) == 0);
            if (idx >= cur_arr.n) {
                CHECKF(0, "array %s index %llu out of range", key, idx);
                continue;
            }
            if (cur_arr.type == GGUF_VT_STRING) {
                struct gguf_str s = gguf_array_str(f, &cur_arr, idx);
                unsigned long long len = strtoull(strtok(val, " "), NULL, 10);
                char *hex = strtok(NULL, " ");
                CHECKF(str_matches(s, len, hex), "%s[%llu] differs", key, idx);
            } else {
                const uint8_t *p = (const uint8_t *)cur_arr.data + idx * vt_size(cur_arr.type);
                CHECKF(scalar_matches(cur_arr.type, p, val), "%s[%llu] differs (golden %s)", key, idx, val);
            }
            n_el++;
        } else if (strcmp(tag, "tensor") == 0) {
            char *name = strtok(rest, " ");
            const struct gguf_tensor *t = gguf_find_tensor(f, name);
            CHECKF(t != NULL, "tensor %s missing", name);
            if (!t) continue;
            CHECK(strcmp(t->name.p, name) == 0 && t->name.len == strlen(name));
            CHECK(t->type == (uint32_t)atoi(strtok(NULL, " ")));
            CHECK(t->ndim == (uint32_t)atoi(strtok(NULL, " ")));
            for (int d = 0; d < 4; d++) CHECK(t->ne[d] == atoll(strtok(NULL, " ")));
            CHECK(t->offset == strtoull(strtok(NULL, " "), NULL, 10));
            CHECK(t->nbytes == strtoull(strtok(NULL, " "), NULL, 10));
            CHECK(((uintptr_t)t->data % gguf_alignment(f)) == 0);
            n_tensors++;
        } else if (strcmp(tag, "vals") == 0) {
            char *name = strtok(rest, " ");
            long long first = atoll(strtok(NULL, " ")), count = atoll(strtok(NULL, " "));
            const struct gguf_tensor *g = gguf_find_tensor(f, name);
            if (!g || count <= 0 || count > 64) {
                CHECK(0);
                continue;
            }
            struct model_tensor t = view(g);
            float out[64];
            model_tensor_to_f32(&t, first, count, out);
            int bad = 0;
            for (long long i = 0; i < count; i++) {
                uint32_t want = (uint32_t)strtoul(strtok(NULL, " "), NULL, 16), got;
                memcpy(&got, &out[i], 4);
                if (got != want && bad++ < 3)
                    CHECKF(0, "%s[%lld] = %08x, gguf-py %08x", name, first + i, got, want);
            }
            n_vals++;
        }
    }
    gguf_close(f);
    fclose(fp);
    CHECKF(n_files == 4 && n_kv > 90 && n_el > 90 && n_tensors == 14 && n_vals >= 40,
           "golden coverage: %d files %d kv %d el %d tensors %d vals", n_files, n_kv, n_el, n_tensors, n_vals);
}

/* The default model: the shapes the loader will rely on, and string array lookups. */
static void check_model_file(void)
{
    char err[512];
    gguf_file *f = gguf_open(MODEL_PATH, err, sizeof err);
    CHECKF(f != NULL, "%s", err);
    if (!f) return;
    struct gguf_array a;
    CHECK(gguf_get_arr(f, "tokenizer.ggml.tokens", &a) == 0 && a.type == GGUF_VT_STRING && a.n == 49152);
    struct gguf_str s = gguf_array_str(f, &a, 0);
    CHECK(s.len == 13 && memcmp(s.p, "<|endoftext|>", 13) == 0);
    s = gguf_array_str(f, &a, a.n); /* out of range */
    CHECK(s.p == NULL && s.len == 0);
    int64_t n_embd = 0;
    CHECK(gguf_get_i64(f, "llama.embedding_length", &n_embd) == 0 && n_embd == 576);
    const struct gguf_tensor *te = gguf_find_tensor(f, "token_embd.weight");
    CHECK(te && te->type == GGUF_T_Q8_0 && te->ne[0] == 576 && te->ne[1] == 49152);
    CHECK(gguf_find_tensor(f, "no.such.tensor") == NULL);
    CHECK(gguf_tensor_at(f, -1) == NULL && gguf_tensor_at(f, gguf_n_tensors(f)) == NULL);
    /* tensor data stays inside the file and every tensor converts end to end */
    uint64_t total = 0;
    for (int64_t i = 0; i < gguf_n_tensors(f); i++) {
        const struct gguf_tensor *t = gguf_tensor_at(f, i);
        CHECK(gguf_find_tensor(f, t->name.p) == t);
        CHECK(t->nbytes == gguf_type_nbytes(t->type, t->ne[0] * t->ne[1] * t->ne[2] * t->ne[3]));
        total += t->nbytes;
    }
    CHECK(total > 80000000ull && total < 100000000ull);
    /* a partial block at the end of a conversion */
    struct model_tensor v = view(gguf_find_tensor(f, "blk.0.attn_q.weight"));
    float full[64], part[40];
    model_tensor_to_f32(&v, 64, 64, full);
    model_tensor_to_f32(&v, 64, 40, part);
    CHECK(memcmp(full, part, sizeof part) == 0);
    CHECK(model_tensor_nelem(&v) == 576 * 576);
    gguf_close(f);
}

static void check_synthetic_conversions(void)
{
    char err[512];
    gguf_file *f = gguf_open(GOLDEN_DIR "/synthetic.gguf", err, sizeof err);
    CHECKF(f != NULL, "%s", err);
    if (!f) return;
    int64_t iv;
    double dv;
    int bv;
    struct gguf_str sv;
    struct gguf_array av;
    CHECK(gguf_get_i64(f, "t.u8", &iv) == 0 && iv == 200);
    CHECK(gguf_get_i64(f, "t.u64small", &iv) == 0 && iv == 12345678901234ll);
    CHECK(gguf_get_i64(f, "t.u64", &iv) == -1);
    CHECK(gguf_get_i64(f, "t.f32", &iv) == -1);
    CHECK(gguf_get_f64(f, "t.i32", &dv) == -1);
    CHECK(gguf_get_f64(f, "t.f32", &dv) == 0 && (float)dv == 0.1f);
    CHECK(gguf_get_bool(f, "t.u8", &bv) == -1);
    CHECK(gguf_get_bool(f, "t.bool", &bv) == 0 && bv == 1);
    CHECK(gguf_get_i64(f, "t.bool", &iv) == -1);
    CHECK(gguf_get_str(f, "t.u8", &sv) == -1);
    CHECK(gguf_get_arr(f, "t.str", &av) == -1);
    CHECK(gguf_get_i64(f, "nope", &iv) == -1 && gguf_find(f, "nope") == -1);
    CHECK(gguf_find(f, "t.u") == -1 && gguf_find(f, "") == -1);
    CHECK(gguf_kv_key(f, -1).p == NULL && gguf_kv_key(f, gguf_n_kv(f)).p == NULL);
    CHECK(gguf_alignment(f) == 64);
    CHECK(strcmp(gguf_type_name(GGUF_T_Q4_1), "Q4_1") == 0 && strcmp(gguf_type_name(12), "Q4_K") == 0);
    CHECK(strcmp(gguf_type_name(1000), "unknown") == 0);
    CHECK(gguf_type_nbytes(GGUF_T_Q8_0, 64) == 68 && gguf_type_nbytes(GGUF_T_Q8_0, 33) == 0);
    CHECK(gguf_type_nbytes(GGUF_T_Q4_0, 32) == 18 && gguf_type_nbytes(GGUF_T_Q4_1, 32) == 20);
    CHECK(gguf_type_nbytes(GGUF_T_BF16, 3) == 6 && gguf_type_nbytes(12, 256) == 0);
    CHECK(gguf_type_nbytes(GGUF_T_F32, INT64_MAX) == 0);
    /* whole-tensor conversion equals the sum of its pieces, for every type */
    for (int64_t i = 0; i < gguf_n_tensors(f); i++) {
        struct model_tensor t = view(gguf_tensor_at(f, i));
        int64_t n = model_tensor_nelem(&t);
        float *all = malloc(sizeof(float) * (size_t)n), piece[32];
        model_tensor_to_f32(&t, 0, n, all);
        for (int64_t j = 0; j < n; j += 32) {
            model_tensor_to_f32(&t, j, n - j < 32 ? n - j : 32, piece);
            CHECK(memcmp(piece, all + j, sizeof(float) * (size_t)(n - j < 32 ? n - j : 32)) == 0);
        }
        free(all);
    }
    CHECK(strcmp(model_dtype_name(MODEL_DT_BF16), "BF16") == 0 &&
          strcmp(model_dtype_name(MODEL_DT_Q4_0), "Q4_0") == 0);
    gguf_close(f);
}

/* ---- hostile files ------------------------------------------------------------ */

struct buf {
    uint8_t *p;
    size_t n, cap;
};

static void put(struct buf *b, const void *p, size_t n)
{
    if (b->n + n > b->cap) {
        b->cap = (b->n + n) * 2 + 64;
        b->p = realloc(b->p, b->cap);
    }
    memcpy(b->p + b->n, p, n);
    b->n += n;
}
static void put32(struct buf *b, uint32_t v) { put(b, &v, 4); }
static void put64(struct buf *b, uint64_t v) { put(b, &v, 8); }
static void putstr(struct buf *b, const char *s)
{
    put64(b, strlen(s));
    put(b, s, strlen(s));
}
static void header(struct buf *b, uint32_t version, uint64_t n_tensors, uint64_t n_kv)
{
    b->n = 0;
    put(b, "GGUF", 4);
    put32(b, version);
    put64(b, n_tensors);
    put64(b, n_kv);
}
static void kv_u32(struct buf *b, const char *k, uint32_t v)
{
    putstr(b, k);
    put32(b, GGUF_VT_UINT32);
    put32(b, v);
}
/* One tensor info: ndim dims from ne, type, offset. */
static void tinfo(struct buf *b, const char *name, uint32_t ndim, const uint64_t *ne, uint32_t type, uint64_t off)
{
    putstr(b, name);
    put32(b, ndim);
    for (uint32_t d = 0; d < ndim; d++) put64(b, ne[d]);
    put32(b, type);
    put64(b, off);
}
static void pad(struct buf *b, size_t align, size_t extra)
{
    while (b->n % align) put(b, "", 1);
    for (size_t i = 0; i < extra; i++) put(b, "\x01", 1);
}

/* Opens b's bytes; expect ok, or failure with a message containing want. */
static gguf_file *try_open(const struct buf *b, const char *want, int line)
{
    char path[512], err[512] = "";
    tmp_path(path, sizeof path, "crafted.gguf");
    write_file(path, b->p, b->n);
    gguf_file *f = gguf_open(path, err, sizeof err);
    if (want) {
        CHECKF(f == NULL, "line %d: expected failure '%s'", line, want);
        CHECKF(err[0] != '\0' && strstr(err, want) != NULL, "line %d: message '%s' lacks '%s'", line, err, want);
        gguf_close(f);
        return NULL;
    }
    CHECKF(f != NULL, "line %d: %s", line, err);
    return f;
}
#define EXPECT_FAIL(b, want) try_open(b, want, __LINE__)
#define EXPECT_OK(b) try_open(b, NULL, __LINE__)

static void check_crafted(void)
{
    struct buf b = {0};
    const uint64_t big = 1ull << 63, huge = UINT64_MAX;
    gguf_file *f;

    header(&b, 3, 0, 0); /* the smallest valid file */
    f = EXPECT_OK(&b);
    CHECK(f && gguf_n_kv(f) == 0 && gguf_n_tensors(f) == 0 && gguf_alignment(f) == 32);
    gguf_close(f);
    header(&b, 2, 0, 0);
    f = EXPECT_OK(&b);
    CHECK(f && gguf_version(f) == 2);
    gguf_close(f);
    header(&b, 1, 0, 0);
    EXPECT_FAIL(&b, "v1");
    header(&b, 4, 0, 0);
    EXPECT_FAIL(&b, "version 4");
    header(&b, 0x03000000, 0, 0);
    EXPECT_FAIL(&b, "big-endian");
    header(&b, 3, 0, 0);
    memcpy(b.p, "GGML", 4);
    EXPECT_FAIL(&b, "not a GGUF");
    b.n = 0;
    EXPECT_FAIL(&b, "too small");
    header(&b, 3, 0, 0);
    b.n = 23;
    EXPECT_FAIL(&b, "too small");

    header(&b, 3, 0, big);
    EXPECT_FAIL(&b, "metadata entries");
    header(&b, 3, 0, huge);
    EXPECT_FAIL(&b, "metadata entries");
    header(&b, 3, big, 0);
    EXPECT_FAIL(&b, "tensors cannot fit");
    header(&b, 3, 1, 1); /* counts that fit the bound but run out of bytes */
    pad(&b, 1, 40);
    EXPECT_FAIL(&b, "GGUF");

    /* string lengths */
    header(&b, 3, 0, 1);
    put64(&b, 1000);
    put(&b, "abcdefghijklmnopq", 17);
    EXPECT_FAIL(&b, "length 1000");
    header(&b, 3, 0, 1);
    put64(&b, huge);
    put(&b, "abcdefghijklmnopq", 17);
    EXPECT_FAIL(&b, "length");
    header(&b, 3, 0, 1);
    putstr(&b, "k");
    put32(&b, GGUF_VT_STRING);
    put64(&b, huge - 3);
    put(&b, "xyz", 3);
    EXPECT_FAIL(&b, "length");

    /* value types */
    header(&b, 3, 0, 1);
    putstr(&b, "k");
    put32(&b, 99);
    put32(&b, 0);
    EXPECT_FAIL(&b, "unknown value type 99");
    header(&b, 3, 0, 1);
    putstr(&b, "k");
    put32(&b, GGUF_VT_UINT64);
    put32(&b, 0); /* 4 of 8 bytes */
    EXPECT_FAIL(&b, "truncated");
    header(&b, 3, 0, 1);
    putstr(&b, "k");
    put32(&b, GGUF_VT_ARRAY);
    put32(&b, GGUF_VT_ARRAY);
    put64(&b, 1);
    put32(&b, GGUF_VT_UINT8);
    put64(&b, 1);
    put(&b, "x", 1);
    EXPECT_FAIL(&b, "nested array");
    header(&b, 3, 0, 1);
    putstr(&b, "k");
    put32(&b, GGUF_VT_ARRAY);
    put32(&b, 13);
    put64(&b, 1);
    put64(&b, 0);
    EXPECT_FAIL(&b, "unknown element type 13");
    header(&b, 3, 0, 1);
    putstr(&b, "k");
    put32(&b, GGUF_VT_ARRAY);
    put32(&b, GGUF_VT_UINT64);
    put64(&b, 1ull << 61); /* n * 8 overflows */
    put64(&b, 0);
    EXPECT_FAIL(&b, "does not fit");
    header(&b, 3, 0, 1);
    putstr(&b, "k");
    put32(&b, GGUF_VT_ARRAY);
    put32(&b, GGUF_VT_STRING);
    put64(&b, big);
    put64(&b, 0);
    EXPECT_FAIL(&b, "claims");
    header(&b, 3, 0, 1); /* string array whose second string runs out */
    putstr(&b, "k");
    put32(&b, GGUF_VT_ARRAY);
    put32(&b, GGUF_VT_STRING);
    put64(&b, 2);
    putstr(&b, "ok");
    put64(&b, 50);
    put(&b, "short", 5);
    EXPECT_FAIL(&b, "length 50");
    header(&b, 3, 0, 2); /* empty arrays and strings are fine */
    putstr(&b, "e");
    put32(&b, GGUF_VT_ARRAY);
    put32(&b, GGUF_VT_STRING);
    put64(&b, 0);
    putstr(&b, "");
    put32(&b, GGUF_VT_STRING);
    put64(&b, 0);
    f = EXPECT_OK(&b);
    if (f) {
        struct gguf_array a;
        struct gguf_str s;
        CHECK(gguf_get_arr(f, "e", &a) == 0 && a.n == 0 && a.type == GGUF_VT_STRING);
        CHECK(gguf_array_str(f, &a, 0).p == NULL);
        CHECK(gguf_get_str(f, "", &s) == 0 && s.len == 0);
    }
    gguf_close(f);
    header(&b, 3, 0, 2);
    kv_u32(&b, "dup", 1);
    kv_u32(&b, "dup", 2);
    EXPECT_FAIL(&b, "duplicate key 'dup'");

    /* alignment */
    header(&b, 3, 0, 1);
    kv_u32(&b, "general.alignment", 0);
    EXPECT_FAIL(&b, "alignment 0");
    header(&b, 3, 0, 1);
    kv_u32(&b, "general.alignment", 48);
    EXPECT_FAIL(&b, "power of two");
    header(&b, 3, 0, 1);
    putstr(&b, "general.alignment");
    put32(&b, GGUF_VT_UINT64);
    put64(&b, 64);
    EXPECT_FAIL(&b, "expected uint32");

    /* tensor infos */
    uint64_t ne[5] = {64, 2, 1, 1, 1};
    header(&b, 3, 1, 0);
    tinfo(&b, "t", 2, ne, GGUF_T_F32, 0);
    pad(&b, 32, 512);
    f = EXPECT_OK(&b);
    if (f) {
        const struct gguf_tensor *t = gguf_tensor_at(f, 0);
        CHECK(t->nbytes == 512 && t->offset == 0 && t->ndim == 2 && t->ne[2] == 1 && t->ne[3] == 1);
        CHECK((const uint8_t *)t->data == (const uint8_t *)t->data - 0 && ((uintptr_t)t->data % 32) == 0);
        struct model_tensor v = view(t);
        float x[4];
        model_tensor_to_f32(&v, 124, 4, x);
        uint32_t bits;
        memcpy(&bits, &x[3], 4);
        CHECK(bits == 0x01010101u);
    }
    gguf_close(f);
    header(&b, 3, 1, 0);
    tinfo(&b, "t", 2, ne, GGUF_T_F32, 0);
    pad(&b, 32, 511); /* one byte short */
    EXPECT_FAIL(&b, "extends past the end");
    header(&b, 3, 1, 0);
    tinfo(&b, "t", 2, ne, GGUF_T_F32, 4096);
    pad(&b, 32, 512);
    EXPECT_FAIL(&b, "'t' data (offset 4096");
    header(&b, 3, 1, 0);
    tinfo(&b, "t", 2, ne, GGUF_T_F32, UINT64_MAX - 31);
    pad(&b, 32, 512);
    EXPECT_FAIL(&b, "extends past the end");
    header(&b, 3, 1, 0);
    tinfo(&b, "t", 2, ne, GGUF_T_F32, 4);
    pad(&b, 32, 512);
    EXPECT_FAIL(&b, "not a multiple of the alignment");
    header(&b, 3, 1, 0);
    tinfo(&b, "t5", 5, ne, GGUF_T_F32, 0);
    pad(&b, 32, 512);
    EXPECT_FAIL(&b, "'t5' has 5 dimensions");
    header(&b, 3, 1, 0);
    tinfo(&b, "weird", 2, ne, 99, 0);
    pad(&b, 32, 512);
    EXPECT_FAIL(&b, "type unknown (99) for tensor 'weird'");
    header(&b, 3, 1, 0);
    tinfo(&b, "blk.3.ffn_down.weight", 2, ne, 12, 0);
    pad(&b, 32, 512);
    EXPECT_FAIL(&b, "Q4_K (12) for tensor 'blk.3.ffn_down.weight'");
    uint64_t ov[4] = {1ull << 32, 1ull << 32, 1, 1};
    header(&b, 3, 1, 0);
    tinfo(&b, "ov", 2, ov, GGUF_T_F32, 0);
    pad(&b, 32, 64);
    EXPECT_FAIL(&b, "element count overflows");
    uint64_t ov2[4] = {1ull << 31, 1ull << 31, 1, 1}; /* 2^62 elements: the byte size overflows */
    header(&b, 3, 1, 0);
    tinfo(&b, "ov2", 2, ov2, GGUF_T_F32, 0);
    pad(&b, 32, 64);
    EXPECT_FAIL(&b, "byte size overflows");
    uint64_t ov3[4] = {1ull << 30, 1ull << 30, 1, 1}; /* fits, but not in the file */
    header(&b, 3, 1, 0);
    tinfo(&b, "ov3", 2, ov3, GGUF_T_F16, 0);
    pad(&b, 32, 64);
    EXPECT_FAIL(&b, "extends past the end");
    uint64_t neg[4] = {big, 1, 1, 1};
    header(&b, 3, 1, 0);
    tinfo(&b, "neg", 1, neg, GGUF_T_F32, 0);
    pad(&b, 32, 64);
    EXPECT_FAIL(&b, "negative");
    uint64_t odd[4] = {48, 2, 1, 1};
    header(&b, 3, 1, 0);
    tinfo(&b, "odd", 2, odd, GGUF_T_Q8_0, 0);
    pad(&b, 32, 128);
    EXPECT_FAIL(&b, "not a multiple of the block size 32");
    header(&b, 3, 2, 0);
    tinfo(&b, "same", 1, ne, GGUF_T_F32, 0);
    tinfo(&b, "same", 1, ne, GGUF_T_F32, 256);
    pad(&b, 32, 512);
    EXPECT_FAIL(&b, "duplicate tensor 'same'");
    uint64_t zero[4] = {0, 4, 1, 1};
    header(&b, 3, 1, 0); /* an empty tensor is fine, but its offset must still be in the file */
    tinfo(&b, "empty", 2, zero, GGUF_T_Q4_0, 0);
    EXPECT_FAIL(&b, "extends past the end");
    pad(&b, 32, 0);
    f = EXPECT_OK(&b);
    CHECK(f && gguf_tensor_at(f, 0)->nbytes == 0);
    gguf_close(f);
    header(&b, 3, 1, 1); /* custom alignment moves the data section */
    kv_u32(&b, "general.alignment", 256);
    tinfo(&b, "t", 1, ne, GGUF_T_F32, 0);
    pad(&b, 256, 256);
    f = EXPECT_OK(&b);
    if (f) CHECK(gguf_alignment(f) == 256 && ((const uint8_t *)gguf_tensor_at(f, 0)->data)[0] == 1);
    gguf_close(f);

    char err[256] = "";
    CHECK(gguf_open("/nonexistent/x.gguf", err, sizeof err) == NULL && strstr(err, "cannot open"));
    CHECK(gguf_open(tmpdir, err, sizeof err) == NULL && strstr(err, "not a regular file"));
    CHECK(gguf_open("/nonexistent/x.gguf", NULL, 0) == NULL); /* no buffer: no crash */
    gguf_close(NULL);
    free(b.p);
}

/* Touches everything an opened (possibly corrupted) file hands out. */
static uint64_t exercise(const gguf_file *f)
{
    uint64_t h = 0;
    for (int64_t i = 0; i < gguf_n_kv(f); i++) {
        struct gguf_str k = gguf_kv_key(f, i);
        char key[512];
        if (k.len >= sizeof key || memchr(k.p, '\0', k.len)) continue;
        memcpy(key, k.p, k.len);
        key[k.len] = '\0';
        struct gguf_array a;
        struct gguf_str s;
        int64_t iv;
        if (gguf_get_arr(f, key, &a) == 0) {
            for (uint64_t j = 0; j < a.n; j++) {
                if (a.type == GGUF_VT_STRING) {
                    s = gguf_array_str(f, &a, j);
                    if (s.len) h += (uint8_t)s.p[s.len - 1];
                } else {
                    h += ((const uint8_t *)a.data)[j * vt_size(a.type) + vt_size(a.type) - 1];
                }
            }
        } else if (gguf_get_str(f, key, &s) == 0 && s.len) {
            h += (uint8_t)s.p[s.len - 1];
        } else if (gguf_get_i64(f, key, &iv) == 0) {
            h += (uint64_t)iv;
        }
    }
    for (int64_t i = 0; i < gguf_n_tensors(f); i++) {
        struct model_tensor t = view(gguf_tensor_at(f, i));
        int64_t n = model_tensor_nelem(&t);
        if (n > 0 && n <= 1 << 16) {
            float *x = malloc(sizeof(float) * (size_t)n);
            model_tensor_to_f32(&t, 0, n, x);
            uint32_t bits;
            memcpy(&bits, &x[n - 1], 4);
            h += bits;
            free(x);
        }
    }
    return h;
}

static uint64_t rng_state = 0x9E3779B97F4A7C15ull;
static uint64_t rnd(void)
{
    rng_state ^= rng_state << 13;
    rng_state ^= rng_state >> 7;
    rng_state ^= rng_state << 17;
    return rng_state;
}

/* Truncates src at every length up to dense_upto, then with a stride. */
static void fuzz_truncate(const char *src, size_t dense_upto, size_t stride, int *n_ok, int *n_fail)
{
    size_t n;
    uint8_t *b = read_file(src, &n);
    CHECKF(b != NULL, "cannot read %s", src);
    if (!b) return;
    char path[512], err[512];
    tmp_path(path, sizeof path, "trunc.gguf");
    write_file(path, b, n);
    int bad_msg = 0;
    /* Shrink one file from its full length down, so no bytes are rewritten. */
    for (size_t len = n; len-- > 0;) {
        if (len > dense_upto && len % stride != 0 && len != n - 1) continue;
        if (truncate(path, (off_t)len) != 0) break;
        err[0] = '\0';
        gguf_file *f = gguf_open(path, err, sizeof err);
        if (f) {
            exercise(f);
            gguf_close(f);
            (*n_ok)++;
        } else {
            if (!err[0] && bad_msg++ < 3) CHECKF(0, "truncated at %zu: no message", len);
            (*n_fail)++;
        }
    }
    free(b);
}

/* Flips bytes at random positions (a fixed seed), half of them in the header. */
static void fuzz_flip(const char *src, int iters, size_t hot, int *n_ok, int *n_fail)
{
    size_t n;
    uint8_t *b = read_file(src, &n);
    CHECKF(b != NULL, "cannot read %s", src);
    if (!b) return;
    char path[512], err[512];
    tmp_path(path, sizeof path, "flip.gguf");
    write_file(path, b, n);
    int fd = open(path, O_RDWR);
    int bad_msg = 0;
    for (int it = 0; it < iters; it++) {
        size_t pos[8];
        int k = 1 + (int)(rnd() % 8);
        for (int j = 0; j < k; j++) {
            pos[j] = (rnd() & 1) ? rnd() % (hot < n ? hot : n) : rnd() % n;
            uint8_t v;
            switch (rnd() % 4) {
            case 0: v = (uint8_t)(b[pos[j]] ^ (1u << (rnd() % 8))); break;
            case 1: v = 0xFF; break;
            case 2: v = 0; break;
            default: v = (uint8_t)rnd(); break;
            }
            if (pwrite(fd, &v, 1, (off_t)pos[j]) != 1) break;
        }
        err[0] = '\0';
        gguf_file *f = gguf_open(path, err, sizeof err);
        if (f) {
            exercise(f);
            gguf_close(f);
            (*n_ok)++;
        } else {
            if (!err[0] && bad_msg++ < 3) CHECKF(0, "flip iteration %d: no message", it);
            (*n_fail)++;
        }
        for (int j = 0; j < k; j++)
            if (pwrite(fd, &b[pos[j]], 1, (off_t)pos[j]) != 1) break;
    }
    close(fd);
    free(b);
}

static void check_fuzz(void)
{
    char vocab[512];
    snprintf(vocab, sizeof vocab, "%s/ggml-vocab-bert-bge.gguf", TEST_VOCAB_DIR);
    int ok = 0, fail = 0;
    fuzz_truncate(vocab, 4096, 211, &ok, &fail);
    CHECKF(fail > 4000 && ok == 0, "vocab truncation: %d ok %d failed", ok, fail);
    int ok2 = 0, fail2 = 0;
    fuzz_truncate(GOLDEN_DIR "/synthetic.gguf", 1u << 20, 1, &ok2, &fail2);
    /* only cutting the padding after the last tensor's data is benign */
    CHECKF(fail2 > 4000 && ok2 > 0 && ok2 < 64, "synthetic truncation: %d ok %d failed", ok2, fail2);
    int ok3 = 0, fail3 = 0;
    fuzz_flip(vocab, 5000, 4096, &ok3, &fail3);
    fuzz_flip(GOLDEN_DIR "/synthetic.gguf", 30000, 2048, &ok3, &fail3);
    CHECKF(ok3 > 100 && fail3 > 100, "flips: %d ok %d failed", ok3, fail3);
    printf("  fuzz: truncations %d failed cleanly; flips %d opened, %d failed cleanly\n", fail + fail2, ok3,
           fail3);
}

/* A v2 copy of the synthetic file reads the same; a v1 copy is refused. */
static void check_versions(void)
{
    size_t n;
    uint8_t *b = read_file(GOLDEN_DIR "/synthetic.gguf", &n);
    CHECK(b != NULL);
    if (!b) return;
    char path[512], err[512];
    tmp_path(path, sizeof path, "v2.gguf");
    b[4] = 2;
    write_file(path, b, n);
    gguf_file *f = gguf_open(path, err, sizeof err);
    CHECKF(f != NULL, "%s", err);
    if (f) {
        CHECK(gguf_version(f) == 2 && gguf_n_tensors(f) == 8 && gguf_n_kv(f) == 28);
        gguf_close(f);
    }
    b[4] = 1;
    write_file(path, b, n);
    f = gguf_open(path, err, sizeof err);
    CHECK(f == NULL && strstr(err, "GGUF v1 is not supported"));
    free(b);
}

static void cleanup(void)
{
    const char *names[] = {"crafted.gguf", "trunc.gguf", "flip.gguf", "v2.gguf"};
    char path[512];
    for (size_t i = 0; i < sizeof names / sizeof names[0]; i++) {
        tmp_path(path, sizeof path, names[i]);
        unlink(path);
    }
    rmdir(tmpdir);
}

int main(void)
{
    make_tmpdir();
    RUN(check_golden_file);
    RUN(check_model_file);
    RUN(check_synthetic_conversions);
    RUN(check_versions);
    RUN(check_crafted);
    RUN(check_fuzz);
    cleanup();
    return test_summary();
}

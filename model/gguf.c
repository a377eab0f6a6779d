/* gguf.c - the GGUF v2/v3 reader declared in gguf.h.
 *
 * The file is mapped read-only and parsed once by gguf_open(): every count,
 * length and offset read from the file is checked against what is left of
 * the file before it is used (checked arithmetic only), so a truncated or
 * corrupt file is refused with a message and never read out of bounds.
 * Keys and tensor names are indexed in hash tables; string arrays are indexed
 * into (pointer, length) tables so gguf_array_str() is O(1).
 *
 * Layout (little-endian):
 *   "GGUF" u32 version  u64 n_tensors  u64 n_kv
 *   n_kv x { str key, u32 vtype, value }        str = u64 len + bytes
 *   n_tensors x { str name, u32 ndim, u64 ne[ndim], u32 type, u64 offset }
 *   padding to general.alignment (default 32), then the data section.
 */
#include "gguf.h"

#include <errno.h>
#include <fcntl.h>
#include <stdarg.h>
#include <stdbool.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <unistd.h>

#include "model.h"

#define GGUF_DEFAULT_ALIGNMENT 32
#define GGUF_MAX_DIMS 4

struct kv {
    struct gguf_str key;
    enum gguf_vtype type;
    const uint8_t *val;   /* the value's bytes in the mapping (scalars, string length prefix) */
    struct gguf_str str;  /* GGUF_VT_STRING */
    struct gguf_array arr;/* GGUF_VT_ARRAY; for string arrays arr.data is an owned struct gguf_str[n] */
};

struct gguf_file {
    uint8_t *map;          /* the whole file, PROT_READ */
    uint64_t size;
    uint32_t version;
    uint32_t alignment;
    int64_t n_kv;
    struct kv *kv;         /* [n_kv], owned */
    int64_t n_tensors;
    struct gguf_tensor *tensors; /* [n_tensors], owned; names point into names */
    char *names;           /* NUL-terminated copies of the tensor names, owned */
    int64_t *kv_hash;      /* open addressing: index into kv or -1; [kv_hcap] */
    uint64_t kv_hcap;
    int64_t *t_hash;       /* same for tensors; [t_hcap] */
    uint64_t t_hcap;
    uint64_t data_start;   /* file offset of the data section */
};

/* ---- helpers ------------------------------------------------------------- */


static uint64_t hash_bytes(const void *p, uint64_t n)
{
    const uint8_t *b = p;
    uint64_t h = 1469598103934665603ull;
    for (uint64_t i = 0; i < n; i++) {
        h ^= b[i];
        h *= 1099511628211ull;
    }
    return h;
}

static uint64_t hash_cap(uint64_t n)
{
    uint64_t cap = 16;
    while (cap < 2 * n) cap *= 2;
    return cap;
}

static bool str_eq(struct gguf_str s, const char *p, uint64_t n)
{
    return s.len == n && memcmp(s.p, p, n) == 0;
}

static const struct {
    const char *name;
    uint32_t blck;   /* elements per block; 0 = unknown/unsupported layout */
    uint32_t bytes;  /* bytes per block */
    bool supported;
} ttypes[] = {
    [0] = {"F32", 1, 4, true},     [1] = {"F16", 1, 2, true},
    [2] = {"Q4_0", 32, 18, true},  [3] = {"Q4_1", 32, 20, true},
    [4] = {"Q4_2", 0, 0, false},   [5] = {"Q4_3", 0, 0, false},
    [6] = {"Q5_0", 0, 0, false},   [7] = {"Q5_1", 0, 0, false},
    [8] = {"Q8_0", 32, 34, true},  [9] = {"Q8_1", 0, 0, false},
    [10] = {"Q2_K", 0, 0, false},  [11] = {"Q3_K", 0, 0, false},
    [12] = {"Q4_K", 0, 0, false},  [13] = {"Q5_K", 0, 0, false},
    [14] = {"Q6_K", 0, 0, false},  [15] = {"Q8_K", 0, 0, false},
    [16] = {"IQ2_XXS", 0, 0, false}, [17] = {"IQ2_XS", 0, 0, false},
    [18] = {"IQ3_XXS", 0, 0, false}, [19] = {"IQ1_S", 0, 0, false},
    [20] = {"IQ4_NL", 0, 0, false},  [21] = {"IQ3_S", 0, 0, false},
    [22] = {"IQ2_S", 0, 0, false},   [23] = {"IQ4_XS", 0, 0, false},
    [24] = {"I8", 0, 0, false},      [25] = {"I16", 0, 0, false},
    [26] = {"I32", 0, 0, false},     [27] = {"I64", 0, 0, false},
    [28] = {"F64", 0, 0, false},     [29] = {"IQ1_M", 0, 0, false},
    [30] = {"BF16", 1, 2, true},     [31] = {"Q4_0_4_4", 0, 0, false},
    [32] = {"Q4_0_4_8", 0, 0, false}, [33] = {"Q4_0_8_8", 0, 0, false},
    [34] = {"TQ1_0", 0, 0, false},   [35] = {"TQ2_0", 0, 0, false},
    [36] = {"IQ4_NL_4_4", 0, 0, false}, [37] = {"IQ4_NL_4_8", 0, 0, false},
    [38] = {"IQ4_NL_8_8", 0, 0, false}, [39] = {"MXFP4", 0, 0, false},
};
#define N_TTYPES (sizeof ttypes / sizeof ttypes[0])

static bool ttype_supported(uint32_t type) { return type < N_TTYPES && ttypes[type].supported; }

const char *gguf_type_name(uint32_t type)
{
    return type < N_TTYPES && ttypes[type].name ? ttypes[type].name : "unknown";
}

uint64_t gguf_type_nbytes(uint32_t type, int64_t n)
{
    if (!ttype_supported(type) || n < 0) return 0;
    uint64_t blck = ttypes[type].blck, un = (uint64_t)n;
    if (un % blck) return 0;
    uint64_t out;
    if (__builtin_mul_overflow(un / blck, (uint64_t)ttypes[type].bytes, &out)) return 0;
    return out;
}

/* Size in bytes of one scalar of a metadata value type; 0 for string/array/unknown. */
static uint64_t vtype_size(uint32_t t)
{
    switch (t) {
    case GGUF_VT_UINT8: case GGUF_VT_INT8: case GGUF_VT_BOOL: return 1;
    case GGUF_VT_UINT16: case GGUF_VT_INT16: return 2;
    case GGUF_VT_UINT32: case GGUF_VT_INT32: case GGUF_VT_FLOAT32: return 4;
    case GGUF_VT_UINT64: case GGUF_VT_INT64: case GGUF_VT_FLOAT64: return 8;
    default: return 0;
    }
}

static const char *vtype_name(uint32_t t)
{
    static const char *names[] = {"uint8", "int8", "uint16", "int16", "uint32", "int32", "float32",
                                  "bool", "string", "array", "uint64", "int64", "float64"};
    return t < sizeof names / sizeof names[0] ? names[t] : "unknown";
}

/* ---- the bounded reader ----------------------------------------------------- */

struct rd {
    const uint8_t *b;
    uint64_t size, pos;
    char *err;
    size_t errlen;
};

static uint64_t left(const struct rd *r) { return r->size - r->pos; }

static int need(struct rd *r, uint64_t n, const char *what)
{
    if (n > left(r)) {
        sl_seterr(r->err, r->errlen, "truncated GGUF: %s at byte %llu needs %llu bytes, %llu left", what,
               (unsigned long long)r->pos, (unsigned long long)n, (unsigned long long)left(r));
        return SL_EFORMAT;
    }
    return 0;
}

static int rd_u32(struct rd *r, uint32_t *out, const char *what)
{
    if (need(r, 4, what)) return SL_EFORMAT;
    memcpy(out, r->b + r->pos, 4);
    r->pos += 4;
    return 0;
}

static int rd_u64(struct rd *r, uint64_t *out, const char *what)
{
    if (need(r, 8, what)) return SL_EFORMAT;
    memcpy(out, r->b + r->pos, 8);
    r->pos += 8;
    return 0;
}

static int rd_str(struct rd *r, struct gguf_str *out, const char *what)
{
    uint64_t len;
    if (rd_u64(r, &len, what)) return SL_EFORMAT;
    if (len > left(r)) {
        sl_seterr(r->err, r->errlen, "corrupt GGUF: %s at byte %llu has length %llu but only %llu bytes are left",
               what, (unsigned long long)(r->pos - 8), (unsigned long long)len,
               (unsigned long long)left(r));
        return SL_EFORMAT;
    }
    out->p = (const char *)r->b + r->pos;
    out->len = len;
    r->pos += len;
    return 0;
}

/* ---- parsing ------------------------------------------------------------------ */

static int read_kv(struct rd *r, struct kv *kv, int64_t idx)
{
    char what[64];
    snprintf(what, sizeof what, "key %lld", (long long)idx);
    if (rd_str(r, &kv->key, what)) return SL_EFORMAT;
    uint32_t t;
    if (rd_u32(r, &t, "metadata value type")) return SL_EFORMAT;
    int klen = kv->key.len > 200 ? 200 : (int)kv->key.len;
    if (t > GGUF_VT_FLOAT64) {
        sl_seterr(r->err, r->errlen, "corrupt GGUF: key '%.*s' has unknown value type %u", klen, kv->key.p, t);
        return SL_EFORMAT;
    }
    kv->type = (enum gguf_vtype)t;
    kv->val = r->b + r->pos;
    if (t == GGUF_VT_STRING) return rd_str(r, &kv->str, "string value");
    if (t != GGUF_VT_ARRAY) {
        uint64_t sz = vtype_size(t);
        if (need(r, sz, "metadata value")) return SL_EFORMAT;
        r->pos += sz;
        return 0;
    }
    uint32_t et;
    uint64_t n;
    if (rd_u32(r, &et, "array element type") || rd_u64(r, &n, "array length")) return SL_EFORMAT;
    if (et == GGUF_VT_ARRAY) {
        sl_seterr(r->err, r->errlen, "unsupported GGUF: key '%.*s' is a nested array", klen, kv->key.p);
        return SL_EUNSUP;
    }
    if (et > GGUF_VT_FLOAT64) {
        sl_seterr(r->err, r->errlen, "corrupt GGUF: array '%.*s' has unknown element type %u", klen, kv->key.p, et);
        return SL_EFORMAT;
    }
    kv->arr.type = (enum gguf_vtype)et;
    kv->arr.n = n;
    if (et != GGUF_VT_STRING) {
        uint64_t sz;
        if (__builtin_mul_overflow(n, vtype_size(et), &sz) || sz > left(r)) {
            sl_seterr(r->err, r->errlen,
                   "corrupt GGUF: array '%.*s' of %llu %s values does not fit in the %llu bytes left", klen,
                   kv->key.p, (unsigned long long)n, vtype_name(et), (unsigned long long)left(r));
            return SL_EFORMAT;
        }
        kv->arr.data = r->b + r->pos;
        r->pos += sz;
        return 0;
    }
    /* Every string takes at least its 8-byte length: bound n before allocating. */
    if (n > left(r) / 8) {
        sl_seterr(r->err, r->errlen, "corrupt GGUF: string array '%.*s' claims %llu entries, more than fit in %llu bytes",
               klen, kv->key.p, (unsigned long long)n, (unsigned long long)left(r));
        return SL_EFORMAT;
    }
    struct gguf_str *idx_tab = malloc(sizeof *idx_tab * (n ? n : 1));
    if (!idx_tab) {
        sl_seterr(r->err, r->errlen, "out of memory indexing string array '%.*s' (%llu entries)", klen, kv->key.p,
               (unsigned long long)n);
        return SL_ENOMEM;
    }
    kv->arr.data = idx_tab; /* owned from here: freed with the kv table */
    for (uint64_t i = 0; i < n; i++)
        if (rd_str(r, &idx_tab[i], "array string")) return SL_EFORMAT;
    return 0;
}

static int read_tensor_info(struct rd *r, struct gguf_tensor *t, int64_t idx)
{
    char what[64];
    snprintf(what, sizeof what, "name of tensor %lld", (long long)idx);
    if (rd_str(r, &t->name, what)) return SL_EFORMAT;
    int nlen = t->name.len > 200 ? 200 : (int)t->name.len;
    if (rd_u32(r, &t->ndim, "tensor ndim")) return SL_EFORMAT;
    if (t->ndim > GGUF_MAX_DIMS) {
        sl_seterr(r->err, r->errlen, "corrupt GGUF: tensor '%.*s' has %u dimensions (at most %d)", nlen, t->name.p,
               t->ndim, GGUF_MAX_DIMS);
        return SL_EFORMAT;
    }
    for (int d = 0; d < GGUF_MAX_DIMS; d++) t->ne[d] = 1;
    for (uint32_t d = 0; d < t->ndim; d++) {
        uint64_t v;
        if (rd_u64(r, &v, "tensor dimension")) return SL_EFORMAT;
        if (v > (uint64_t)INT64_MAX) {
            sl_seterr(r->err, r->errlen, "corrupt GGUF: tensor '%.*s' dimension %u is negative", nlen, t->name.p, d);
            return SL_EFORMAT;
        }
        t->ne[d] = (int64_t)v;
    }
    if (rd_u32(r, &t->type, "tensor type") || rd_u64(r, &t->offset, "tensor offset")) return SL_EFORMAT;
    if (!ttype_supported(t->type)) {
        sl_seterr(r->err, r->errlen, "unsupported tensor type %s (%u) for tensor '%.*s' (supported: F32, F16, BF16, "
               "Q8_0, Q4_0, Q4_1)", gguf_type_name(t->type), t->type, nlen, t->name.p);
        return SL_EUNSUP;
    }
    int64_t nel = 1;
    for (int d = 0; d < GGUF_MAX_DIMS; d++) {
        if (__builtin_mul_overflow(nel, t->ne[d], &nel)) {
            sl_seterr(r->err, r->errlen, "corrupt GGUF: tensor '%.*s' element count overflows", nlen, t->name.p);
            return SL_EFORMAT;
        }
    }
    uint32_t blck = ttypes[t->type].blck;
    if (t->ne[0] % blck) {
        sl_seterr(r->err, r->errlen, "corrupt GGUF: tensor '%.*s' of type %s has ne[0]=%lld, not a multiple of the "
               "block size %u", nlen, t->name.p, gguf_type_name(t->type), (long long)t->ne[0], blck);
        return SL_EFORMAT;
    }
    t->nbytes = gguf_type_nbytes(t->type, nel);
    if (nel > 0 && t->nbytes == 0) {
        sl_seterr(r->err, r->errlen, "corrupt GGUF: tensor '%.*s' byte size overflows", nlen, t->name.p);
        return SL_EFORMAT;
    }
    return 0;
}

static int build_kv_hash(gguf_file *f, char *err, size_t errlen)
{
    f->kv_hcap = hash_cap((uint64_t)f->n_kv);
    f->kv_hash = malloc(sizeof *f->kv_hash * f->kv_hcap);
    if (!f->kv_hash) {
        sl_seterr(err, errlen, "out of memory indexing %lld GGUF keys", (long long)f->n_kv);
        return SL_ENOMEM;
    }
    for (uint64_t i = 0; i < f->kv_hcap; i++) f->kv_hash[i] = -1;
    for (int64_t i = 0; i < f->n_kv; i++) {
        struct gguf_str k = f->kv[i].key;
        uint64_t h = hash_bytes(k.p, k.len) & (f->kv_hcap - 1);
        while (f->kv_hash[h] >= 0) {
            if (str_eq(f->kv[f->kv_hash[h]].key, k.p, k.len)) {
                sl_seterr(err, errlen, "corrupt GGUF: duplicate key '%.*s'", k.len > 200 ? 200 : (int)k.len, k.p);
                return SL_EFORMAT;
            }
            h = (h + 1) & (f->kv_hcap - 1);
        }
        f->kv_hash[h] = i;
    }
    return 0;
}

static int build_tensor_hash(gguf_file *f, char *err, size_t errlen)
{
    f->t_hcap = hash_cap((uint64_t)f->n_tensors);
    f->t_hash = malloc(sizeof *f->t_hash * f->t_hcap);
    if (!f->t_hash) {
        sl_seterr(err, errlen, "out of memory indexing %lld GGUF tensors", (long long)f->n_tensors);
        return SL_ENOMEM;
    }
    for (uint64_t i = 0; i < f->t_hcap; i++) f->t_hash[i] = -1;
    for (int64_t i = 0; i < f->n_tensors; i++) {
        struct gguf_str k = f->tensors[i].name;
        uint64_t h = hash_bytes(k.p, k.len) & (f->t_hcap - 1);
        while (f->t_hash[h] >= 0) {
            if (str_eq(f->tensors[f->t_hash[h]].name, k.p, k.len)) {
                sl_seterr(err, errlen, "corrupt GGUF: duplicate tensor '%.*s'", k.len > 200 ? 200 : (int)k.len, k.p);
                return SL_EFORMAT;
            }
            h = (h + 1) & (f->t_hcap - 1);
        }
        f->t_hash[h] = i;
    }
    return 0;
}

/* Reads general.alignment when present: it must be a u32 power of two. */
static int read_alignment(gguf_file *f, char *err, size_t errlen)
{
    f->alignment = GGUF_DEFAULT_ALIGNMENT;
    int64_t i = gguf_find(f, "general.alignment");
    if (i < 0) return 0;
    uint32_t a;
    if (f->kv[i].type != GGUF_VT_UINT32) {
        sl_seterr(err, errlen, "corrupt GGUF: general.alignment has type %s, expected uint32",
               vtype_name(f->kv[i].type));
        return SL_EFORMAT;
    }
    memcpy(&a, f->kv[i].val, 4);
    if (a == 0 || (a & (a - 1))) {
        sl_seterr(err, errlen, "corrupt GGUF: general.alignment %u is not a power of two", a);
        return SL_EFORMAT;
    }
    f->alignment = a;
    return 0;
}

static int parse(gguf_file *f, char *err, size_t errlen)
{
    struct rd r = {.b = f->map, .size = f->size, .pos = 0, .err = err, .errlen = errlen};
    uint32_t magic, version;
    if (rd_u32(&r, &magic, "magic")) return SL_EFORMAT;
    if (memcmp(f->map, "GGUF", 4) != 0) {
        sl_seterr(err, errlen, "not a GGUF file (magic %02x %02x %02x %02x)", f->map[0], f->map[1], f->map[2],
               f->map[3]);
        return SL_EFORMAT;
    }
    if (rd_u32(&r, &version, "version")) return SL_EFORMAT;
    if (version == 1) {
        sl_seterr(err, errlen, "GGUF v1 is not supported (only v2 and v3): convert the file with a newer llama.cpp");
        return SL_EUNSUP;
    }
    if (version != 2 && version != 3) {
        if ((version & 0xFFFF) == 0 && (version >> 16) != 0)
            sl_seterr(err, errlen, "big-endian GGUF files are not supported (version field 0x%08x)", version);
        else
            sl_seterr(err, errlen, "unsupported GGUF version %u (only v2 and v3)", version);
        return SL_EUNSUP;
    }
    f->version = version;
    uint64_t n_tensors, n_kv;
    if (rd_u64(&r, &n_tensors, "tensor count") || rd_u64(&r, &n_kv, "metadata count")) return SL_EFORMAT;
    /* A KV takes at least 8 (key length) + 4 (type) + 1 bytes, a tensor info
     * at least 8 + 4 + 4 + 8: bound both counts by the file before allocating. */
    if (n_kv > left(&r) / 13) {
        sl_seterr(err, errlen, "corrupt GGUF: %llu metadata entries cannot fit in a %llu-byte file",
               (unsigned long long)n_kv, (unsigned long long)f->size);
        return SL_EFORMAT;
    }
    if (n_tensors > left(&r) / 24) {
        sl_seterr(err, errlen, "corrupt GGUF: %llu tensors cannot fit in a %llu-byte file",
               (unsigned long long)n_tensors, (unsigned long long)f->size);
        return SL_EFORMAT;
    }
    f->kv = calloc(n_kv ? n_kv : 1, sizeof *f->kv);
    f->tensors = calloc(n_tensors ? n_tensors : 1, sizeof *f->tensors);
    if (!f->kv || !f->tensors) {
        sl_seterr(err, errlen, "out of memory reading GGUF header (%llu keys, %llu tensors)",
               (unsigned long long)n_kv, (unsigned long long)n_tensors);
        return SL_ENOMEM;
    }
    int rc;
    for (uint64_t i = 0; i < n_kv; i++) {
        f->n_kv = (int64_t)i + 1; /* counts entries that may own memory */
        if ((rc = read_kv(&r, &f->kv[i], (int64_t)i))) return rc;
    }
    f->n_kv = (int64_t)n_kv;
    if ((rc = build_kv_hash(f, err, errlen))) return rc;
    if ((rc = read_alignment(f, err, errlen))) return rc;

    uint64_t names_len = 0;
    for (uint64_t i = 0; i < n_tensors; i++) {
        if ((rc = read_tensor_info(&r, &f->tensors[i], (int64_t)i))) return rc;
        names_len += f->tensors[i].name.len + 1; /* each name lies inside the file: no overflow */
    }
    f->n_tensors = (int64_t)n_tensors;

    /* The data section starts at the next multiple of the alignment. A file
     * without tensors may end before that padding. */
    uint64_t a = f->alignment, ds = r.pos;
    if (ds % a) ds += a - ds % a;
    f->data_start = ds;
    for (int64_t i = 0; i < f->n_tensors; i++) {
        struct gguf_tensor *t = &f->tensors[i];
        int nlen = t->name.len > 200 ? 200 : (int)t->name.len;
        uint64_t start, end;
        if (t->offset % a) {
            sl_seterr(err, errlen, "corrupt GGUF: tensor '%.*s' offset %llu is not a multiple of the alignment %u",
                   nlen, t->name.p, (unsigned long long)t->offset, f->alignment);
            return SL_EFORMAT;
        }
        if (__builtin_add_overflow(ds, t->offset, &start) || __builtin_add_overflow(start, t->nbytes, &end) ||
            end > f->size) {
            sl_seterr(err, errlen, "corrupt GGUF: tensor '%.*s' data (offset %llu, %llu bytes) extends past the end "
                   "of the %llu-byte file", nlen, t->name.p, (unsigned long long)t->offset,
                   (unsigned long long)t->nbytes, (unsigned long long)f->size);
            return SL_EFORMAT;
        }
        t->data = f->map + start;
    }

    /* NUL-terminated copies of the names, so callers can hand them out as C strings. */
    f->names = malloc(names_len ? names_len : 1);
    if (!f->names) {
        sl_seterr(err, errlen, "out of memory copying tensor names");
        return SL_ENOMEM;
    }
    char *p = f->names;
    for (int64_t i = 0; i < f->n_tensors; i++) {
        struct gguf_tensor *t = &f->tensors[i];
        if (memchr(t->name.p, '\0', t->name.len)) {
            sl_seterr(err, errlen, "corrupt GGUF: tensor %lld has a NUL byte in its name", (long long)i);
            return SL_EFORMAT;
        }
        memcpy(p, t->name.p, t->name.len);
        p[t->name.len] = '\0';
        t->name.p = p;
        p += t->name.len + 1;
    }
    return build_tensor_hash(f, err, errlen);
}

/* ---- construction -------------------------------------------------------------- */

gguf_file *gguf_open(const char *path, char *err, size_t errlen)
{
    if (err && errlen) err[0] = '\0';
    gguf_file *f = calloc(1, sizeof *f);
    if (!f) {
        sl_seterr(err, errlen, "out of memory opening %s", path);
        return NULL;
    }
    int fd = open(path, O_RDONLY | O_CLOEXEC);
    if (fd < 0) {
        sl_seterr(err, errlen, "cannot open %s: %s", path, strerror(errno));
        goto fail_free;
    }
    struct stat st;
    if (fstat(fd, &st) != 0) {
        sl_seterr(err, errlen, "cannot stat %s: %s", path, strerror(errno));
        goto fail_close;
    }
    if (!S_ISREG(st.st_mode)) {
        sl_seterr(err, errlen, "%s is not a regular file", path);
        goto fail_close;
    }
    if (st.st_size < 24) {
        sl_seterr(err, errlen, "%s: too small to be a GGUF file (%lld bytes)", path, (long long)st.st_size);
        goto fail_close;
    }
    f->size = (uint64_t)st.st_size;
    void *m = mmap(NULL, f->size, PROT_READ, MAP_PRIVATE, fd, 0);
    if (m == MAP_FAILED) {
        sl_seterr(err, errlen, "cannot mmap %s: %s", path, strerror(errno));
        goto fail_close;
    }
    f->map = m;
    close(fd);
    char msg[512];
    msg[0] = '\0';
    if (parse(f, msg, sizeof msg) != 0) {
        sl_seterr(err, errlen, "%s: %s", path, msg[0] ? msg : "invalid GGUF file");
        gguf_close(f);
        return NULL;
    }
    return f;

fail_close:
    close(fd);
fail_free:
    free(f);
    return NULL;
}

/* ---- metadata --------------------------------------------------------------------- */

uint32_t gguf_version(const gguf_file *f) { return f->version; }
uint32_t gguf_alignment(const gguf_file *f) { return f->alignment; }
int64_t gguf_n_kv(const gguf_file *f) { return f->n_kv; }

int64_t gguf_find(const gguf_file *f, const char *key)
{
    if (!f || !key || !f->kv_hash) return -1;
    uint64_t n = strlen(key);
    uint64_t h = hash_bytes(key, n) & (f->kv_hcap - 1);
    while (f->kv_hash[h] >= 0) {
        if (str_eq(f->kv[f->kv_hash[h]].key, key, n)) return f->kv_hash[h];
        h = (h + 1) & (f->kv_hcap - 1);
    }
    return -1;
}

struct gguf_str gguf_kv_key(const gguf_file *f, int64_t i)
{
    if (i < 0 || i >= f->n_kv) return (struct gguf_str){NULL, 0};
    return f->kv[i].key;
}

enum gguf_vtype gguf_kv_type(const gguf_file *f, int64_t i)
{
    if (i < 0 || i >= f->n_kv) return (enum gguf_vtype)-1;
    return f->kv[i].type;
}

/* Reads a scalar integer of type t at p: signed into *s or unsigned into *u. */
static bool read_int(enum gguf_vtype t, const uint8_t *p, int64_t *s, uint64_t *u, bool *is_signed)
{
    *is_signed = true;
    switch (t) {
    case GGUF_VT_UINT8: { uint8_t v; memcpy(&v, p, 1); *u = v; *is_signed = false; return true; }
    case GGUF_VT_UINT16: { uint16_t v; memcpy(&v, p, 2); *u = v; *is_signed = false; return true; }
    case GGUF_VT_UINT32: { uint32_t v; memcpy(&v, p, 4); *u = v; *is_signed = false; return true; }
    case GGUF_VT_UINT64: { uint64_t v; memcpy(&v, p, 8); *u = v; *is_signed = false; return true; }
    case GGUF_VT_INT8: { int8_t v; memcpy(&v, p, 1); *s = v; return true; }
    case GGUF_VT_INT16: { int16_t v; memcpy(&v, p, 2); *s = v; return true; }
    case GGUF_VT_INT32: { int32_t v; memcpy(&v, p, 4); *s = v; return true; }
    case GGUF_VT_INT64: { int64_t v; memcpy(&v, p, 8); *s = v; return true; }
    default: return false;
    }
}

int gguf_get_i64(const gguf_file *f, const char *key, int64_t *out)
{
    int64_t i = gguf_find(f, key);
    if (i < 0) return -1;
    int64_t s = 0;
    uint64_t u = 0;
    bool is_signed;
    if (!read_int(f->kv[i].type, f->kv[i].val, &s, &u, &is_signed)) return -1;
    if (!is_signed) {
        if (u > (uint64_t)INT64_MAX) return -1;
        s = (int64_t)u;
    }
    *out = s;
    return 0;
}

int gguf_get_f64(const gguf_file *f, const char *key, double *out)
{
    int64_t i = gguf_find(f, key);
    if (i < 0) return -1;
    if (f->kv[i].type == GGUF_VT_FLOAT32) {
        float v;
        memcpy(&v, f->kv[i].val, 4);
        *out = v;
        return 0;
    }
    if (f->kv[i].type == GGUF_VT_FLOAT64) {
        memcpy(out, f->kv[i].val, 8);
        return 0;
    }
    return -1;
}

int gguf_get_bool(const gguf_file *f, const char *key, int *out)
{
    int64_t i = gguf_find(f, key);
    if (i < 0 || f->kv[i].type != GGUF_VT_BOOL) return -1;
    *out = f->kv[i].val[0] != 0;
    return 0;
}

int gguf_get_str(const gguf_file *f, const char *key, struct gguf_str *out)
{
    int64_t i = gguf_find(f, key);
    if (i < 0 || f->kv[i].type != GGUF_VT_STRING) return -1;
    *out = f->kv[i].str;
    return 0;
}

int gguf_get_arr(const gguf_file *f, const char *key, struct gguf_array *out)
{
    int64_t i = gguf_find(f, key);
    if (i < 0 || f->kv[i].type != GGUF_VT_ARRAY) return -1;
    *out = f->kv[i].arr;
    return 0;
}

struct gguf_str gguf_array_str(const gguf_file *f, const struct gguf_array *a, uint64_t i)
{
    (void)f;
    if (!a || a->type != GGUF_VT_STRING || i >= a->n) return (struct gguf_str){NULL, 0};
    return ((const struct gguf_str *)a->data)[i];
}

/* ---- tensors ------------------------------------------------------------------------- */

int64_t gguf_n_tensors(const gguf_file *f) { return f->n_tensors; }

const struct gguf_tensor *gguf_tensor_at(const gguf_file *f, int64_t i)
{
    if (i < 0 || i >= f->n_tensors) return NULL;
    return &f->tensors[i];
}

const struct gguf_tensor *gguf_find_tensor(const gguf_file *f, const char *name)
{
    if (!f || !name || !f->t_hash) return NULL;
    uint64_t n = strlen(name);
    uint64_t h = hash_bytes(name, n) & (f->t_hcap - 1);
    while (f->t_hash[h] >= 0) {
        if (str_eq(f->tensors[f->t_hash[h]].name, name, n)) return &f->tensors[f->t_hash[h]];
        h = (h + 1) & (f->t_hcap - 1);
    }
    return NULL;
}

/* ---- teardown ------------------------------------------------------------------------- */

void gguf_close(gguf_file *f)
{
    if (!f) return;
    if (f->kv) {
        for (int64_t i = 0; i < f->n_kv; i++)
            if (f->kv[i].type == GGUF_VT_ARRAY && f->kv[i].arr.type == GGUF_VT_STRING)
                free((void *)f->kv[i].arr.data);
    }
    free(f->kv);
    free(f->tensors);
    free(f->names);
    free(f->kv_hash);
    free(f->t_hash);
    if (f->map) munmap(f->map, f->size);
    free(f);
}

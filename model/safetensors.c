/* safetensors.c - the safetensors reader declared in safetensors.h.
 *
 * A .safetensors file is an 8-byte little-endian header length N, N bytes of
 * JSON ({"name": {"dtype", "shape", "data_offsets": [begin, end]}, ...,
 * "__metadata__": {...}}), then the data section; offsets are relative to the
 * data section. Every file is mapped read-only; every offset and size from
 * the JSON is checked against the mapping with checked arithmetic before a
 * pointer is formed. A sharded checkpoint lists its shards in
 * model.safetensors.index.json ({"weight_map": {"name": "shard file"}}).
 *
 * Tensor data is only as aligned as the header length makes it (usually 8
 * bytes): read it with memcpy or model_tensor_to_f32().
 */
#include "safetensors.h"

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

#include "base/json.h"

struct st_file {
    uint8_t *map;   /* the whole file, PROT_READ; NULL for an empty mapping */
    size_t size;
    char *path;     /* owned */
};

struct st_set {
    struct st_file *files; /* [n_files], owned */
    int n_files, cap_files;
    struct st_tensor *t;   /* [n], owned; names owned */
    int *file_of;          /* [n]: index into files */
    int n, cap;
    int *hash;             /* open addressing over t by name: index or -1; [hcap] */
    size_t hcap;
};

/* ---- helpers ------------------------------------------------------------- */


static uint64_t hash_str(const char *s)
{
    uint64_t h = 1469598103934665603ull;
    for (; *s; s++) {
        h ^= (uint8_t)*s;
        h *= 1099511628211ull;
    }
    return h;
}

static char *path_join(const char *dir, const char *name)
{
    size_t a = strlen(dir), b = strlen(name);
    char *p = malloc(a + b + 2);
    if (!p) return NULL;
    memcpy(p, dir, a);
    p[a] = '/';
    memcpy(p + a + 1, name, b + 1);
    return p;
}

static const struct {
    const char *name;
    int size;                /* bytes per element */
    int supported;
    enum model_dtype dt;
} dtypes[] = {
    {"F32", 4, 1, MODEL_DT_F32}, {"F16", 2, 1, MODEL_DT_F16}, {"BF16", 2, 1, MODEL_DT_BF16},
    /* the integer parts of quantized weights (packed values, zero points, act-order indexes, shapes) */
    {"I8", 1, 1, MODEL_DT_I8}, {"I32", 4, 1, MODEL_DT_I32}, {"I64", 8, 1, MODEL_DT_I64},
};

/* ---- construction --------------------------------------------------------- */

/* Maps path and appends it to s->files. Returns its index or a negative status. */
static int map_file(st_set *s, const char *path, char *err, size_t errlen)
{
    if (s->n_files == s->cap_files) {
        int cap = s->cap_files ? s->cap_files * 2 : 4;
        struct st_file *f = realloc(s->files, sizeof *f * (size_t)cap);
        if (!f) {
            sl_seterr(err, errlen, "out of memory opening %s", path);
            return SL_ENOMEM;
        }
        s->files = f;
        s->cap_files = cap;
    }
    struct st_file *f = &s->files[s->n_files];
    memset(f, 0, sizeof *f);
    f->path = strdup(path);
    if (!f->path) {
        sl_seterr(err, errlen, "out of memory opening %s", path);
        return SL_ENOMEM;
    }
    int rc = SL_EIO;
    int fd = open(path, O_RDONLY | O_CLOEXEC);
    if (fd < 0) {
        sl_seterr(err, errlen, "cannot open %s: %s", path, strerror(errno));
        goto fail_path;
    }
    struct stat st;
    if (fstat(fd, &st) != 0 || !S_ISREG(st.st_mode)) {
        sl_seterr(err, errlen, "%s is not a regular file", path);
        goto fail_close;
    }
    f->size = (size_t)st.st_size;
    if (f->size < 8) {
        sl_seterr(err, errlen, "%s: too small to be a safetensors file (%zu bytes)", path, f->size);
        rc = SL_EFORMAT;
        goto fail_close;
    }
    void *m = mmap(NULL, f->size, PROT_READ, MAP_PRIVATE, fd, 0);
    if (m == MAP_FAILED) {
        sl_seterr(err, errlen, "cannot mmap %s: %s", path, strerror(errno));
        goto fail_close;
    }
    f->map = m;
    close(fd);
    return s->n_files++;

fail_close:
    close(fd);
fail_path:
    free(f->path);
    f->path = NULL;
    return rc;
}

static int push_tensor(st_set *s, char *err, size_t errlen)
{
    if (s->n < s->cap) return 0;
    int cap = s->cap ? s->cap * 2 : 64;
    struct st_tensor *t = realloc(s->t, sizeof *t * (size_t)cap);
    if (t) s->t = t;
    int *fo = realloc(s->file_of, sizeof *fo * (size_t)cap);
    if (fo) s->file_of = fo;
    if (!t || !fo) {
        sl_seterr(err, errlen, "out of memory reading safetensors headers");
        return SL_ENOMEM;
    }
    s->cap = cap;
    return 0;
}

/* Reads one tensor entry (the object at token v, named name) of file fi. */
static int read_entry(st_set *s, int fi, const json_doc *d, int v, char *name, uint64_t data_len, char *err,
                      size_t errlen)
{
    const char *path = s->files[fi].path;
    if (!json_is_obj(d, v)) {
        sl_seterr(err, errlen, "%s: tensor '%s': entry is not an object", path, name);
        return SL_EFORMAT;
    }
    int jdt = json_get(d, v, "dtype"), jshape = json_get(d, v, "shape"), joff = json_get(d, v, "data_offsets");
    if (!json_is_str(d, jdt) || !json_is_arr(d, jshape) || !json_is_arr(d, joff) || json_size(d, joff) != 2) {
        sl_seterr(err, errlen, "%s: tensor '%s': needs \"dtype\" (string), \"shape\" (array) and \"data_offsets\" "
               "([begin, end])", path, name);
        return SL_EFORMAT;
    }
    char dts[32];
    long dl = json_str(d, jdt, dts, sizeof dts);
    int k = -1;
    for (size_t j = 0; dl >= 0 && (size_t)dl < sizeof dts && j < sizeof dtypes / sizeof dtypes[0]; j++)
        if (strcmp(dts, dtypes[j].name) == 0) k = (int)j;
    if (k < 0) {
        sl_seterr(err, errlen, "%s: tensor '%s' has unsupported dtype %s (supported: F32, F16, BF16, I8, I32, I64)", path, name,
               dl >= 0 && (size_t)dl < sizeof dts ? dts : "(invalid)");
        return SL_EUNSUP;
    }
    int ndim = json_size(d, jshape);
    if (ndim > 8) {
        sl_seterr(err, errlen, "%s: tensor '%s' has %d dimensions (at most 8)", path, name, ndim);
        return SL_EFORMAT;
    }
    struct st_tensor t = {0};
    t.dtype = dtypes[k].dt;
    t.ndim = ndim;
    uint64_t nel = 1;
    for (int i = 0; i < ndim; i++) {
        int64_t dim;
        if (json_i64(d, json_at(d, jshape, i), &dim) || dim < 0) {
            sl_seterr(err, errlen, "%s: tensor '%s': shape[%d] is not a non-negative integer", path, name, i);
            return SL_EFORMAT;
        }
        t.shape[i] = dim;
        if (__builtin_mul_overflow(nel, (uint64_t)dim, &nel)) {
            sl_seterr(err, errlen, "%s: tensor '%s': element count overflows", path, name);
            return SL_EFORMAT;
        }
    }
    int64_t begin, end;
    if (json_i64(d, json_at(d, joff, 0), &begin) || json_i64(d, json_at(d, joff, 1), &end) || begin < 0 ||
        end < begin) {
        sl_seterr(err, errlen, "%s: tensor '%s': data_offsets must be integers with 0 <= begin <= end", path, name);
        return SL_EFORMAT;
    }
    if ((uint64_t)end > data_len) {
        sl_seterr(err, errlen, "%s: tensor '%s': data_offsets [%lld, %lld] extend past the %llu-byte data section",
               path, name, (long long)begin, (long long)end, (unsigned long long)data_len);
        return SL_EFORMAT;
    }
    uint64_t want;
    if (__builtin_mul_overflow(nel, (uint64_t)dtypes[k].size, &want) || want != (uint64_t)(end - begin)) {
        sl_seterr(err, errlen, "%s: tensor '%s': shape needs %llu elements of %s but data_offsets hold %lld bytes",
               path, name, (unsigned long long)nel, dtypes[k].name, (long long)(end - begin));
        return SL_EFORMAT;
    }
    int rc = push_tensor(s, err, errlen);
    if (rc) return rc;
    t.name = name; /* owned by the set from here */
    t.nbytes = (size_t)(end - begin);
    /* the header's own offset: recorded for the overlap check, made a pointer later */
    t.data = (const void *)(uintptr_t)begin;
    s->file_of[s->n] = fi;
    s->t[s->n++] = t;
    return 0;
}

static int cmp_begin(const void *a, const void *b)
{
    const struct st_tensor *x = *(const struct st_tensor *const *)a, *y = *(const struct st_tensor *const *)b;
    uintptr_t p = (uintptr_t)x->data, q = (uintptr_t)y->data;
    return p < q ? -1 : p > q;
}

/* Parses the header of file fi and appends its tensors. */
static int read_header(st_set *s, int fi, char *err, size_t errlen)
{
    struct st_file *f = &s->files[fi];
    uint64_t n;
    memcpy(&n, f->map, 8);
    if (n > f->size - 8) {
        sl_seterr(err, errlen, "%s: header length %llu is larger than the %zu-byte file", f->path,
               (unsigned long long)n, f->size);
        return SL_EFORMAT;
    }
    json_doc d;
    char jerr[256];
    int rc = json_parse(&d, (const char *)f->map + 8, (size_t)n, jerr, sizeof jerr);
    if (rc) {
        sl_seterr(err, errlen, "%s: header: %s", f->path, jerr);
        return rc == SL_ENOMEM ? rc : SL_EFORMAT;
    }
    if (!json_is_obj(&d, 0)) {
        sl_seterr(err, errlen, "%s: not a safetensors file (the header is not a JSON object)", f->path);
        json_free(&d);
        return SL_EFORMAT;
    }
    uint64_t data_len = f->size - 8 - n;
    int first = s->n;
    int key = 1;
    for (int m = 0; m < json_size(&d, 0); m++, key = json_skip(&d, key + 1)) {
        if (json_str_eq(&d, key, "__metadata__")) continue;
        size_t nl;
        char *name = json_strdup(&d, key, &nl);
        if (!name || nl != strlen(name)) {
            sl_seterr(err, errlen, "%s: tensor %d has an invalid name", f->path, m);
            free(name);
            rc = SL_EFORMAT;
            goto fail;
        }
        if ((rc = read_entry(s, fi, &d, key + 1, name, data_len, err, errlen))) {
            free(name);
            goto fail;
        }
    }
    /* Tensors may not share bytes. */
    int cnt = s->n - first;
    if (cnt > 1) {
        struct st_tensor **ord = malloc(sizeof *ord * (size_t)cnt);
        if (!ord) {
            sl_seterr(err, errlen, "out of memory checking %s", f->path);
            rc = SL_ENOMEM;
            goto fail;
        }
        for (int i = 0; i < cnt; i++) ord[i] = &s->t[first + i];
        qsort(ord, (size_t)cnt, sizeof *ord, cmp_begin);
        for (int i = 1; i < cnt; i++) {
            uint64_t prev_end = (uint64_t)(uintptr_t)ord[i - 1]->data + ord[i - 1]->nbytes;
            if (ord[i]->nbytes && ord[i - 1]->nbytes && (uint64_t)(uintptr_t)ord[i]->data < prev_end) {
                sl_seterr(err, errlen, "%s: tensors '%s' and '%s' overlap", f->path, ord[i - 1]->name, ord[i]->name);
                free(ord);
                rc = SL_EFORMAT;
                goto fail;
            }
        }
        free(ord);
    }
    for (int i = first; i < s->n; i++) s->t[i].data = f->map + 8 + n + (uintptr_t)s->t[i].data;
    json_free(&d);
    return 0;

fail:
    /* entries of this file still hold offsets, not pointers: drop them */
    for (int i = first; i < s->n; i++) free((char *)s->t[i].name);
    s->n = first;
    json_free(&d);
    return rc;
}

static int build_hash(st_set *s, char *err, size_t errlen)
{
    s->hcap = 16;
    while (s->hcap < 2 * (size_t)s->n) s->hcap *= 2;
    s->hash = malloc(sizeof *s->hash * s->hcap);
    if (!s->hash) {
        sl_seterr(err, errlen, "out of memory indexing %d tensors", s->n);
        return SL_ENOMEM;
    }
    for (size_t i = 0; i < s->hcap; i++) s->hash[i] = -1;
    for (int i = 0; i < s->n; i++) {
        size_t h = hash_str(s->t[i].name) & (s->hcap - 1);
        while (s->hash[h] >= 0) {
            if (strcmp(s->t[s->hash[h]].name, s->t[i].name) == 0) {
                sl_seterr(err, errlen, "tensor '%s' appears twice (%s and %s)", s->t[i].name,
                       s->files[s->file_of[s->hash[h]]].path, s->files[s->file_of[i]].path);
                return SL_EFORMAT;
            }
            h = (h + 1) & (s->hcap - 1);
        }
        s->hash[h] = i;
    }
    return 0;
}

static int add_file(st_set *s, const char *path, char *err, size_t errlen)
{
    int fi = map_file(s, path, err, errlen);
    if (fi < 0) return fi;
    return read_header(s, fi, err, errlen);
}

st_set *st_open_file(const char *path, char *err, size_t errlen)
{
    if (err && errlen) err[0] = '\0';
    st_set *s = calloc(1, sizeof *s);
    if (!s) {
        sl_seterr(err, errlen, "out of memory opening %s", path);
        return NULL;
    }
    if (add_file(s, path, err, errlen) || build_hash(s, err, errlen)) {
        st_close(s);
        return NULL;
    }
    return s;
}

static char *slurp(const char *path, size_t *len, char *err, size_t errlen)
{
    FILE *fp = fopen(path, "rb");
    if (!fp) {
        sl_seterr(err, errlen, "cannot open %s: %s", path, strerror(errno));
        return NULL;
    }
    char *buf = NULL;
    long sz;
    if (fseek(fp, 0, SEEK_END) != 0 || (sz = ftell(fp)) < 0 || fseek(fp, 0, SEEK_SET) != 0) {
        sl_seterr(err, errlen, "cannot read %s", path);
        goto out;
    }
    buf = malloc((size_t)sz + 1);
    if (!buf) {
        sl_seterr(err, errlen, "out of memory reading %s (%ld bytes)", path, sz);
        goto out;
    }
    if (fread(buf, 1, (size_t)sz, fp) != (size_t)sz) {
        sl_seterr(err, errlen, "cannot read %s", path);
        free(buf);
        buf = NULL;
        goto out;
    }
    buf[sz] = '\0';
    *len = (size_t)sz;
out:
    fclose(fp);
    return buf;
}

/* Opens every shard named in the index at ipath and checks that each listed
 * tensor is in the shard the index names. */
static int open_index(st_set *s, const char *dir, const char *ipath, char *err, size_t errlen)
{
    size_t len;
    char *text = slurp(ipath, &len, err, errlen);
    if (!text) return SL_EIO;
    json_doc d;
    char jerr[256];
    int rc = json_parse(&d, text, len, jerr, sizeof jerr);
    if (rc) {
        sl_seterr(err, errlen, "%s: %s", ipath, jerr);
        free(text);
        return rc == SL_ENOMEM ? rc : SL_EFORMAT;
    }
    int *shard_of = NULL; /* per weight_map entry: index of its shard in shards */
    char **shards = NULL;
    int n_shards = 0;
    int wm = json_get(&d, 0, "weight_map");
    int n_w = json_size(&d, wm);
    if (!json_is_obj(&d, wm)) {
        sl_seterr(err, errlen, "%s: no \"weight_map\" object", ipath);
        rc = SL_EFORMAT;
        goto out;
    }
    shard_of = calloc((size_t)n_w + 1, sizeof *shard_of);
    shards = calloc((size_t)n_w + 1, sizeof *shards);
    if (!shard_of || !shards) {
        sl_seterr(err, errlen, "out of memory reading %s", ipath);
        rc = SL_ENOMEM;
        goto out;
    }
    int key = wm + 1;
    for (int m = 0; m < n_w; m++, key = json_skip(&d, key + 1)) {
        char *fname = json_strdup(&d, key + 1, &len);
        if (!fname || len != strlen(fname) || len == 0 || strchr(fname, '/') || strcmp(fname, "..") == 0) {
            char nm[128];
            json_str(&d, key, nm, sizeof nm);
            sl_seterr(err, errlen, "%s: tensor '%s' maps to an invalid shard file name", ipath, nm);
            free(fname);
            rc = SL_EFORMAT;
            goto out;
        }
        int j = 0;
        while (j < n_shards && strcmp(shards[j], fname) != 0) j++;
        if (j == n_shards) shards[n_shards++] = fname;
        else free(fname);
        shard_of[m] = j;
    }
    /* shards are mapped in order into an empty set: shard j is file j */
    for (int j = 0; j < n_shards; j++) {
        char *p = path_join(dir, shards[j]);
        if (!p) {
            sl_seterr(err, errlen, "out of memory");
            rc = SL_ENOMEM;
        } else {
            rc = add_file(s, p, err, errlen);
            free(p);
        }
        if (rc) goto out;
    }
    if ((rc = build_hash(s, err, errlen))) goto out;
    key = wm + 1;
    for (int m = 0; m < n_w; m++, key = json_skip(&d, key + 1)) {
        char *name = json_strdup(&d, key, NULL);
        if (!name) {
            sl_seterr(err, errlen, "%s: weight_map entry %d has an invalid name", ipath, m);
            rc = SL_EFORMAT;
            goto out;
        }
        const struct st_tensor *t = st_find(s, name);
        if (!t || s->file_of[t - s->t] != shard_of[m]) {
            sl_seterr(err, errlen, "%s: tensor '%s' is not in shard %s", ipath, name, shards[shard_of[m]]);
            free(name);
            rc = SL_EFORMAT;
            goto out;
        }
        free(name);
    }
    rc = 0;
out:
    if (shards)
        for (int j = 0; j < n_shards; j++) free(shards[j]);
    free(shards);
    free(shard_of);
    json_free(&d);
    free(text);
    return rc;
}

st_set *st_open_dir(const char *dir, char *err, size_t errlen)
{
    if (err && errlen) err[0] = '\0';
    st_set *s = calloc(1, sizeof *s);
    char *ipath = path_join(dir, "model.safetensors.index.json");
    char *spath = path_join(dir, "model.safetensors");
    if (!s || !ipath || !spath) {
        sl_seterr(err, errlen, "out of memory opening %s", dir);
        goto fail;
    }
    if (access(ipath, F_OK) == 0) {
        if (open_index(s, dir, ipath, err, errlen)) goto fail;
    } else if (access(spath, F_OK) == 0) {
        if (add_file(s, spath, err, errlen) || build_hash(s, err, errlen)) goto fail;
    } else {
        sl_seterr(err, errlen, "%s: neither model.safetensors nor model.safetensors.index.json found", dir);
        goto fail;
    }
    free(ipath);
    free(spath);
    return s;

fail:
    free(ipath);
    free(spath);
    st_close(s);
    return NULL;
}

/* ---- queries ----------------------------------------------------------------- */

int st_n_tensors(const st_set *s) { return s->n; }

const struct st_tensor *st_tensor_at(const st_set *s, int i)
{
    if (i < 0 || i >= s->n) return NULL;
    return &s->t[i];
}

const struct st_tensor *st_find(const st_set *s, const char *name)
{
    if (!s || !name || !s->hash) return NULL;
    size_t h = hash_str(name) & (s->hcap - 1);
    while (s->hash[h] >= 0) {
        if (strcmp(s->t[s->hash[h]].name, name) == 0) return &s->t[s->hash[h]];
        h = (h + 1) & (s->hcap - 1);
    }
    return NULL;
}

/* ---- teardown ------------------------------------------------------------------ */

void st_close(st_set *s)
{
    if (!s) return;
    for (int i = 0; i < s->n; i++) free((char *)s->t[i].name);
    for (int i = 0; i < s->n_files; i++) {
        if (s->files[i].map) munmap(s->files[i].map, s->files[i].size);
        free(s->files[i].path);
    }
    free(s->files);
    free(s->t);
    free(s->file_of);
    free(s->hash);
    free(s);
}

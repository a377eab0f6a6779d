/* gguf.h - read-only access to a GGUF v2/v3 file.
 *
 * The file is mapped with mmap; every pointer handed out (strings, arrays,
 * tensor data) is borrowed from that mapping and lives until gguf_close().
 * Strings in GGUF are not NUL-terminated: they come back as (pointer, length).
 * A gguf_file is immutable after gguf_open(), so any thread may read it.
 *
 * Internal to model/: other modules reach models through model/model.h.
 */
#ifndef SLUICE_GGUF_H
#define SLUICE_GGUF_H

#include <stddef.h>
#include <stdint.h>

enum gguf_vtype {
    GGUF_VT_UINT8 = 0, GGUF_VT_INT8 = 1, GGUF_VT_UINT16 = 2, GGUF_VT_INT16 = 3,
    GGUF_VT_UINT32 = 4, GGUF_VT_INT32 = 5, GGUF_VT_FLOAT32 = 6, GGUF_VT_BOOL = 7,
    GGUF_VT_STRING = 8, GGUF_VT_ARRAY = 9, GGUF_VT_UINT64 = 10, GGUF_VT_INT64 = 11,
    GGUF_VT_FLOAT64 = 12,
};

/* ggml tensor type numbers as stored in the file. */
enum gguf_ttype {
    GGUF_T_F32 = 0, GGUF_T_F16 = 1, GGUF_T_Q4_0 = 2, GGUF_T_Q4_1 = 3,
    GGUF_T_Q8_0 = 8, GGUF_T_BF16 = 30,
};

typedef struct gguf_file gguf_file;

struct gguf_str {
    const char *p; /* not NUL-terminated, borrowed from the mapping */
    uint64_t len;
};

struct gguf_array {
    enum gguf_vtype type; /* element type; never GGUF_VT_ARRAY (nested arrays are refused) */
    uint64_t n;
    const void *data;     /* for scalar element types: n packed little-endian values
                             (not aligned: read with memcpy); for GGUF_VT_STRING:
                             an internal index, use gguf_array_str() */
};

struct gguf_tensor {
    struct gguf_str name; /* exception: a NUL-terminated copy owned by the gguf_file
                             (name.p[name.len] == '\0'), so it can be used as a C string */
    uint32_t type;        /* enum gguf_ttype value (only the supported ones pass gguf_open) */
    uint32_t ndim;
    int64_t ne[4];        /* ne[0] is the innermost (contiguous) dimension; unused dims are 1 */
    uint64_t offset;      /* relative to the data section */
    const void *data;     /* borrowed from the mapping */
    uint64_t nbytes;
};

/* Opens and validates path. Every length, count, offset and tensor extent is
 * checked against the file size; an unsupported tensor type is refused with a
 * message naming the tensor. Returns NULL with a message in err on failure. */
gguf_file *gguf_open(const char *path, char *err, size_t errlen);
void gguf_close(gguf_file *f);

uint32_t gguf_version(const gguf_file *f);
uint32_t gguf_alignment(const gguf_file *f);

/* Metadata. gguf_find() returns the key's index or -1. */
int64_t gguf_n_kv(const gguf_file *f);
int64_t gguf_find(const gguf_file *f, const char *key);
struct gguf_str gguf_kv_key(const gguf_file *f, int64_t i);
enum gguf_vtype gguf_kv_type(const gguf_file *f, int64_t i);

/* Typed getters by key: return 0 and set *out, or -1 if the key is missing or
 * its type does not convert (integers convert among themselves when the value
 * fits; floats among themselves; bool to/from integers is refused). */
int gguf_get_i64(const gguf_file *f, const char *key, int64_t *out);
int gguf_get_f64(const gguf_file *f, const char *key, double *out);
int gguf_get_bool(const gguf_file *f, const char *key, int *out);
int gguf_get_str(const gguf_file *f, const char *key, struct gguf_str *out);
int gguf_get_arr(const gguf_file *f, const char *key, struct gguf_array *out);
/* Element i of a string array (i < a->n). O(1) after the first call on that
 * array: gguf_open() indexes string arrays. */
struct gguf_str gguf_array_str(const gguf_file *f, const struct gguf_array *a, uint64_t i);

/* Tensors. */
int64_t gguf_n_tensors(const gguf_file *f);
const struct gguf_tensor *gguf_tensor_at(const gguf_file *f, int64_t i);
const struct gguf_tensor *gguf_find_tensor(const gguf_file *f, const char *name);

/* Bytes for n elements of a tensor type (n must be a multiple of the block
 * size), or 0 for an unknown type. */
uint64_t gguf_type_nbytes(uint32_t type, int64_t n);
const char *gguf_type_name(uint32_t type);

#endif

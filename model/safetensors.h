/* safetensors.h - read-only access to safetensors checkpoints, single file or
 * sharded (model.safetensors.index.json), by mmap.
 *
 * Tensor data pointers are borrowed from the mappings and live until
 * st_close(). Immutable after opening: any thread may read.
 * Internal to model/.
 */
#ifndef SLUICE_SAFETENSORS_H
#define SLUICE_SAFETENSORS_H

#include <stddef.h>
#include <stdint.h>

#include "model.h"

typedef struct st_set st_set;

struct st_tensor {
    const char *name;      /* NUL-terminated, owned by the set */
    enum model_dtype dtype;/* F32, F16, BF16, I8, I32 or I64 (others are refused at open, naming the tensor) */
    int ndim;
    int64_t shape[8];      /* safetensors order: shape[ndim-1] is contiguous */
    const void *data;      /* borrowed from the mapping */
    size_t nbytes;
};

/* Opens dir/model.safetensors, or every shard listed in
 * dir/model.safetensors.index.json. Validates header JSON, dtypes, offsets
 * against file sizes and shape * dtype size == byte length. NULL with a
 * message on failure. */
st_set *st_open_dir(const char *dir, char *err, size_t errlen);
/* Opens one .safetensors file. */
st_set *st_open_file(const char *path, char *err, size_t errlen);
void st_close(st_set *s);

int st_n_tensors(const st_set *s);
const struct st_tensor *st_tensor_at(const st_set *s, int i);
const struct st_tensor *st_find(const st_set *s, const char *name); /* NULL if absent */

#endif

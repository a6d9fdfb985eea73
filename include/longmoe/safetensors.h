/* safetensors: the one reader and the one writer for tensor files.
 *
 * Format: u64 little-endian header length N, N bytes of JSON header, then the
 * data. The header maps each tensor name to {"dtype", "shape", "data_offsets"}
 * (offsets relative to the data start) plus an optional "__metadata__" object
 * of string values. The reader is strict: the header length must fit the file,
 * the JSON must be valid, every dtype known, every shape x dtype size equal to
 * its byte range, ranges may not overlap, and together they must cover the
 * data exactly (no gaps, no trailing bytes). Every violation is an
 * LM_ERR_FORMAT naming the file and the tensor. */
#ifndef LONGMOE_SAFETENSORS_H
#define LONGMOE_SAFETENSORS_H

#include <stddef.h>
#include <stdint.h>

#include "longmoe/core.h"

#ifdef __cplusplus
extern "C" {
#endif

#define LM_ST_MAX_DIMS 8

typedef struct {
    const char *name;
    lm_dtype dtype;
    int ndim;
    int64_t shape[LM_ST_MAX_DIMS];
    int64_t numel;
    const void *data; /* points into the loaded file; may be unaligned */
    size_t nbytes;
} lm_st_tensor;

typedef struct lm_safetensors lm_safetensors;

lm_status lm_safetensors_open(const char *path, lm_safetensors **out);
/* Parse an in-memory file image (the bytes are copied). `what` names it in errors. */
lm_status lm_safetensors_parse(const void *bytes, size_t size, const char *what,
                               lm_safetensors **out);
void lm_safetensors_close(lm_safetensors *st);

int lm_safetensors_count(const lm_safetensors *st);
const lm_st_tensor *lm_safetensors_at(const lm_safetensors *st, int i);
const lm_st_tensor *lm_safetensors_find(const lm_safetensors *st, const char *name);
/* The checksum every file of lm_st_writer_save carries in its __metadata__
 * under this key: 16 lower-case hex digits of lm_checksum64 of the data
 * section (the bytes after the header). Every reader verifies it when
 * present (LM_ERR_FORMAT "checksum mismatch" naming both values); a file
 * without it (another writer, older checkpoints) is accepted as it is. */
#define LM_ST_CHECKSUM_KEY "longmoe.checksum"
/* FNV-1a over the 64-bit little-endian words of bytes[0..n), then the tail
 * bytes one at a time, then the length: h = (h ^ x) * 0x100000001b3 from h =
 * 0xcbf29ce484222325 (docs/RELIABILITY.md has a Python version). */
uint64_t lm_checksum64(const void *bytes, size_t n);

/* Value of a "__metadata__" entry, or NULL. */
const char *lm_safetensors_metadata(const lm_safetensors *st, const char *key);

/* Read tensor `name` converted to float32 into a new malloc'd buffer.
 * Accepts F32, BF16, F16 and F64. When `expect_ndim` >= 0 the tensor must have
 * that many dimensions. Missing tensors and wrong dtypes are LM_ERR_FORMAT
 * errors naming the tensor. `shape` (may be NULL) receives the dimensions. */
lm_status lm_safetensors_read_f32(const lm_safetensors *st, const char *name, int expect_ndim,
                                  float **out, int64_t shape[LM_ST_MAX_DIMS]);

/* ---- writer ---- */
typedef struct lm_st_writer lm_st_writer;

lm_st_writer *lm_st_writer_new(void);
/* Register a tensor; `data` is not copied and must live until save. Returns
 * LM_ERR_ARG for duplicate or empty names or bad shapes. `data` may be NULL
 * for a tensor whose bytes are streamed (lm_st_writer_begin); save refuses it. */
lm_status lm_st_writer_add(lm_st_writer *w, const char *name, lm_dtype dtype, int ndim,
                           const int64_t *shape, const void *data);
lm_status lm_st_writer_set_metadata(lm_st_writer *w, const char *key, const char *value);
/* Write atomically: a temporary file beside `path`, fsync, rename, fsync of
 * the directory. On any failure the temporary file is removed and an existing
 * file at `path` is left untouched. */
lm_status lm_st_writer_save(const lm_st_writer *w, const char *path);
void lm_st_writer_free(lm_st_writer *w);

/* The same file written piece by piece, for data that is never whole in
 * memory (a checkpoint whose tensors arrive from other ranks one at a time):
 * lm_st_writer_begin writes the header of w's tensors (their data is not
 * read; w may be freed after) to a temporary file beside `path`; then
 * lm_st_stream_write appends the data section's bytes, the tensors' in their
 * order, in pieces of any size; lm_st_stream_commit checks that exactly the
 * header's bytes came, puts the checksum of the data section into the header
 * (it has a fixed width), then fsync and rename as lm_st_writer_save does:
 * the same bytes as lm_st_writer_save of the same tensors. A failure of
 * lm_st_stream_write leaves the stream to lm_st_stream_abort, which removes
 * the temporary file; commit and abort free the stream. */
typedef struct lm_st_stream lm_st_stream;
lm_status lm_st_writer_begin(const lm_st_writer *w, const char *path, lm_st_stream **out);
lm_status lm_st_stream_write(lm_st_stream *s, const void *bytes, size_t n);
lm_status lm_st_stream_commit(lm_st_stream *s);
void lm_st_stream_abort(lm_st_stream *s);

/* Write a whole file atomically (used by every writer of the project). */
lm_status lm_write_file_atomic(const char *path, const void *const *parts, const size_t *sizes,
                               int nparts);

#ifdef __cplusplus
}
#endif
#endif

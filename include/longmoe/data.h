/* Data sources: streams of training sequences that are pure functions of a
 * batch index, so that a run resumes exactly from a position (one integer)
 * and data-parallel ranks read disjoint data by offsetting the index.
 *
 * A source fills seq [B, T+1] (inputs seq[:, :T], targets seq[:, 1:]) and,
 * optionally, answer [B, T]: 1 where the target is determined by the context
 * (the positions a task's accuracy is measured on; all 0 for plain text).
 * Built-in tasks (include/longmoe/tasks.h) and token shards are sources; a
 * mix draws each batch from one of several sources by weight. */
#ifndef LONGMOE_DATA_H
#define LONGMOE_DATA_H

#include <stdint.h>

#include "longmoe/core.h"

#ifdef __cplusplus
extern "C" {
#endif

typedef struct lm_data_source lm_data_source;
struct lm_data_source {
    char name[64];
    int vocab_size;  /* every token is < vocab_size */
    /* Fill batch `index` (>= 0). Must be deterministic in (source, index, B, T). */
    lm_status (*batch)(lm_data_source *self, int64_t index, int B, int T, int32_t *seq, uint8_t *answer);
    void (*destroy)(lm_data_source *self);
    void *state;
    /* Optional (NULL: lm_data_rows fills the whole batch and copies): rows
     * r0 .. r0+n-1 of batch `index` of B rows alone, seq [n, T+1], answer [n, T]
     * (may be NULL), the same values as those rows of batch(), generating or
     * reading nothing else. */
    lm_status (*rows)(lm_data_source *self, int64_t index, int B, int T, int r0, int n, int32_t *seq,
                      uint8_t *answer);
};

/* Open a source by its spec: a built-in task name ("copy", ...; see
 * lm_task_from_name), "shards:DIR" (the train shards of DIR) or
 * "shards-val:DIR" (its val shards; include/longmoe/shards.h, rank 0 of 1,
 * vocab_size from the shard headers). `seed` separates training from
 * validation streams. */
lm_status lm_data_open(const char *spec, uint64_t seed, lm_data_source **out);
void lm_data_close(lm_data_source *src);

/* Rows r0 .. r0+n-1 of batch `index` of B rows (0 <= r0, 1 <= n, r0 + n <= B):
 * seq [n, T+1] and answer [n, T] (may be NULL) hold exactly what those rows of
 * the whole batch hold. A data-parallel rank reads its own rows this way, not
 * the whole micro-batch: the built-in tasks and the shards make or read those
 * rows alone (the rows method); another source fills the whole batch into a
 * temporary and copies. */
lm_status lm_data_rows(lm_data_source *src, int64_t index, int B, int T, int r0, int n, int32_t *seq,
                       uint8_t *answer);

/* The fingerprint of one file of a data source: its name within the data's
 * directory, its size and lm_checksum64 (include/longmoe/safetensors.h) of
 * its whole contents. */
typedef struct {
    char name[64];
    int64_t bytes;
    uint64_t checksum;
} lm_data_file;

/* The files the data `spec` reads, each fingerprinted (one pass over each
 * file's bytes): for "shards:DIR" its train and val shards (the training
 * stream and its validation stream), for "shards-val:DIR" its val shards, in
 * order. A built-in task reads no file: *n = 0 and *files = NULL (the spec
 * itself identifies its data). *files is malloc'd (free()). A resumed run
 * compares these with the ones its checkpoint recorded (docs/training.md). */
lm_status lm_data_fingerprint(const char *spec, lm_data_file **files, int *n);

#define LM_DATA_MAX_MIX 8

/* A weighted mix of sources: batch i comes from source j with probability
 * weights[j] / sum(weights), chosen by a hash of (seed, i). */
typedef struct {
    int n;
    lm_data_source *sources[LM_DATA_MAX_MIX];
    double weights[LM_DATA_MAX_MIX];
    uint64_t seed;
} lm_data_mix;

lm_status lm_data_mix_batch(const lm_data_mix *mix, int64_t index, int B, int T, int32_t *seq, uint8_t *answer);
/* Rows r0 .. r0+n-1 of lm_data_mix_batch's batch (the same source, lm_data_rows). */
lm_status lm_data_mix_rows(const lm_data_mix *mix, int64_t index, int B, int T, int r0, int n, int32_t *seq,
                           uint8_t *answer);

#ifdef __cplusplus
}
#endif
#endif

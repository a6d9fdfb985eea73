/* Token shards in llm.c's format, the one reader and the one writer, and the
 * data source that reads windows of them in a seeded shuffle (docs/data.md).
 *
 * A shard file: a header of 256 little-endian int32 values, then the tokens.
 *   header[0]  magic: 20240520 when tokens are uint16, 20240801 when uint32
 *   header[1]  version: 1
 *   header[2]  number of tokens N (the file is 1024 + N * 2 or 4 bytes)
 *   header[3]  the vocabulary size the tokens were written for; 0 when not
 *              recorded (llm.c leaves it 0); longmoe writes it
 *   the rest   0
 * A prepared directory holds val_000000.bin, val_000001.bin, ... and
 * train_000000.bin, ... (numbered from 0 without gaps) and tokenizer.json. */
#ifndef LONGMOE_SHARDS_H
#define LONGMOE_SHARDS_H

#include <stddef.h>
#include <stdint.h>
#include <string.h>

#include "longmoe/core.h"
#include "longmoe/data.h"
#include "longmoe/tokenizer.h"

#ifdef __cplusplus
extern "C" {
#endif

#define LM_SHARD_MAGIC_U16 20240520
#define LM_SHARD_MAGIC_U32 20240801
#define LM_SHARD_VERSION 1
#define LM_SHARD_HEADER_INTS 256
#define LM_SHARD_HEADER_BYTES (LM_SHARD_HEADER_INTS * 4)
#define LM_SHARD_U16_MAX_VOCAB 65536 /* larger vocabularies are written as uint32 */

/* Write n tokens (each in [0, vocab_size)) atomically; uint16 when
 * vocab_size <= 65536, else uint32. n <= INT32_MAX. */
lm_status lm_shard_write(const char *path, const int32_t *tokens, int64_t n, int vocab_size);

/* An open shard: its file mapped read-only (the pages are read on demand and
 * shared with the page cache). */
typedef struct {
    char path[1024];
    int token_bytes;       /* 2 or 4 */
    int64_t n_tokens;
    int header_vocab;      /* header[3], 0 when not recorded */
    int max_token;         /* the largest token (-1 when empty) */
    const uint8_t *tokens; /* n_tokens * token_bytes bytes */
    void *map;
    size_t map_size;
} lm_shard;

/* Open and validate a shard: header size, magic, version, token count
 * against the file size, and every token < vocab_size. vocab_size 0 means
 * the header's vocabulary (tokens below 2^31 - 1 when it is 0 too, so that the
 * implied vocabulary, the largest token + 1, is an int). A header vocabulary
 * larger than a given vocab_size is an error. Errors are LM_ERR_FORMAT (or
 * LM_ERR_IO) naming the file and the problem. */
lm_status lm_shard_open(const char *path, int vocab_size, lm_shard *out);
void lm_shard_close(lm_shard *s);

static inline int32_t lm_shard_token(const lm_shard *s, int64_t i) {
    if (s->token_bytes == 2) {
        uint16_t v;
        memcpy(&v, s->tokens + 2 * i, 2);
        return v;
    }
    uint32_t v;
    memcpy(&v, s->tokens + 4 * i, 4);
    return (int32_t)v;
}

/* ---- the data source ---- */

/* Open the `split` ("train" or "val") shards of `dir` as a data source
 * (include/longmoe/data.h). Batch i of rank r among n_ranks holds the
 * samples k = (i * n_ranks + r) * B + j, j < B. With W windows of T + 1
 * tokens (window w of a shard starts at token w * T; windows do not cross
 * shards), sample k is window perm_e(k mod W) of epoch e = k / W, where
 * perm_e is a seeded bijection of [0, W) (a Feistel network with cycle
 * walking), different in every epoch. So a batch is a pure function of
 * (seed, i, B, T): a run resumes from i alone, every window is read once per
 * epoch, and ranks read disjoint windows. The source's vocab_size is
 * vocab_size when given, else the headers' (all must agree), else the
 * largest token + 1. */
lm_status lm_data_open_shards(const char *dir, const char *split, int vocab_size, uint64_t seed, int rank,
                              int n_ranks, lm_data_source **out);

/* The window (shard number, first token) of sample k for length T; for tests
 * and tools. Same arguments as the batches use. */
lm_status lm_shards_window(const lm_data_source *src, int64_t sample, int T, int *shard, int64_t *start);

/* The bijection perm_e of [0, n) used above: perm(x) for x < n. */
uint64_t lm_shuffle_index(uint64_t x, uint64_t n, uint64_t seed, uint64_t epoch);

/* ---- preparing a directory ---- */
typedef struct {
    int64_t bytes, tokens, val_tokens, train_tokens;
    int val_shards, train_shards;
    double seconds;
} lm_prepare_stats;

/* Tokenize each input file as one document (the end-of-text id, then its
 * tokens), concatenate them, put the first ceil(val_fraction * total) tokens
 * in val shards and the rest in train shards of at most shard_tokens each,
 * and copy the tokenizer to dir/tokenizer.json. `dir` is created when
 * missing; one that already holds shards is refused. All tokens are held in
 * memory (4 bytes each) while preparing. */
lm_status lm_shards_prepare(const char *const *inputs, int n_inputs, const lm_tokenizer *tok, const char *dir,
                            int64_t shard_tokens, double val_fraction, lm_prepare_stats *stats);

#ifdef __cplusplus
}
#endif
#endif

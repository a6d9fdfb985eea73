/* Byte-level BPE tokenizer: training, encoding, decoding, and the one reader
 * and one writer of its file (the Hugging Face `tokenizers` JSON format).
 *
 * Ids: 0..255 are the 256 bytes (id b is byte b), 256 + k is the result of
 * merge k, and the last id is the special token "<|endoftext|>" that separates
 * documents. Every byte sequence encodes and decodes back to itself (invalid
 * UTF-8 and NUL included): the alphabet is bytes, not characters.
 *
 * Encoding (identical to what `tokenizers.Tokenizer.from_file` does with the
 * saved file, see docs/data.md):
 *   1. the input is cut at each literal "<|endoftext|>", which becomes the
 *      special id;
 *   2. each piece is pre-tokenized into chunks (lm_pretokenize_next): a chunk
 *      is an optional leading space followed by a run of letters (ASCII
 *      letters and every byte >= 0x80), digits or other symbols, or a run of
 *      whitespace (of which the last character is left to the next chunk when
 *      a non-space follows); a run holds at most LM_PRETOKENIZE_MAX_RUN
 *      characters (UTF-8 characters for letters), the rest starts a new chunk;
 *   3. within each chunk, the adjacent pair with the lowest merge rank is
 *      merged (the leftmost when a rank occurs twice) until no pair has a
 *      merge.
 * Training counts chunks over the input texts and learns merges greedily: the
 * most frequent adjacent pair (ties: smaller left id, then smaller right id),
 * never a pair whose concatenation is already a token. */
#ifndef LONGMOE_TOKENIZER_H
#define LONGMOE_TOKENIZER_H

#include <stddef.h>
#include <stdint.h>

#include "longmoe/core.h"

#ifdef __cplusplus
extern "C" {
#endif

#define LM_TOKENIZER_EOT "<|endoftext|>"
#define LM_TOKENIZER_MIN_VOCAB 257        /* 256 bytes + the end-of-text token */
#define LM_TOKENIZER_MAX_VOCAB (1 << 22)
#define LM_PRETOKENIZE_MAX_RUN 32         /* characters per run in a chunk */

typedef struct lm_tokenizer lm_tokenizer;

/* Learn merges from `n_texts` texts until the vocabulary has `vocab_size`
 * entries or no pair occurs at least `min_frequency` (>= 1) times; then the
 * vocabulary is smaller (lm_tokenizer_vocab_size tells). Deterministic. */
lm_status lm_tokenizer_train(const void *const *texts, const size_t *lengths, int n_texts, int vocab_size,
                             int64_t min_frequency, lm_tokenizer **out);
void lm_tokenizer_free(lm_tokenizer *tok);

int lm_tokenizer_vocab_size(const lm_tokenizer *tok);
int lm_tokenizer_eot_id(const lm_tokenizer *tok); /* the last id */
/* The bytes of token `id` (not NUL-terminated); NULL when id is out of range. */
const uint8_t *lm_tokenizer_token(const lm_tokenizer *tok, int id, size_t *len);

/* The parts (left, right ids) of merge k, which makes id 256 + k; LM_ERR_ARG
 * when k is out of range. */
lm_status lm_tokenizer_merge(const lm_tokenizer *tok, int k, int32_t *left, int32_t *right);

/* Encode `len` bytes into a new malloc'd array of ids (*ids may be NULL when
 * *n_ids is 0). */
lm_status lm_tokenizer_encode(const lm_tokenizer *tok, const void *bytes, size_t len, int32_t **ids,
                              size_t *n_ids);
/* Decode ids into a new malloc'd byte array (NUL-terminated for
 * convenience; *len excludes the NUL). Out-of-range ids are LM_ERR_ARG. */
lm_status lm_tokenizer_decode(const lm_tokenizer *tok, const int32_t *ids, size_t n_ids, char **bytes,
                              size_t *len);

/* The end (exclusive) of the pre-tokenizer chunk that starts at s[i], i < n. */
size_t lm_pretokenize_next(const uint8_t *s, size_t n, size_t i);

/* ---- the file: Hugging Face tokenizers JSON (model BPE, byte-level) ---- */
/* The JSON text (malloc'd, NUL-terminated). */
lm_status lm_tokenizer_to_json(const lm_tokenizer *tok, char **json, size_t *len);
/* Write atomically. */
lm_status lm_tokenizer_save(const lm_tokenizer *tok, const char *path);
/* Strict reader: the file must declare exactly the pre-tokenizer, decoder and
 * model options the writer writes, ids 0..255 must be the bytes in order,
 * merge k must produce id 256 + k from tokens that exist before it, and the
 * last id must be the end-of-text token. Violations are LM_ERR_FORMAT naming
 * `what` and the offending entry. */
lm_status lm_tokenizer_parse(const char *json, size_t len, const char *what, lm_tokenizer **out);
lm_status lm_tokenizer_load(const char *path, lm_tokenizer **out);

#ifdef __cplusplus
}
#endif
#endif

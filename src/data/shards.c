/* Token shards: reader, writer, the shuffled window source and directory
 * preparation (include/longmoe/shards.h, docs/data.md). */
#include "longmoe/shards.h"

#include <dirent.h>
#include <errno.h>
#include <fcntl.h>
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <unistd.h>

#include "check.h"
#include "files.h"

#include "longmoe/safetensors.h"

/* ---- writer ---- */

lm_status lm_shard_write(const char *path, const int32_t *tokens, int64_t n, int vocab_size) {
    if (n < 0 || n > INT32_MAX)
        return lm_error(LM_ERR_ARG, "%s: %lld tokens; a shard holds 0 to %d", path, (long long)n, INT32_MAX);
    if (vocab_size < 1) return lm_error(LM_ERR_ARG, "%s: vocabulary size %d must be >= 1", path, vocab_size);
    for (int64_t i = 0; i < n; i++)
        if (tokens[i] < 0 || tokens[i] >= vocab_size)
            return lm_error(LM_ERR_ARG, "%s: token %d at position %lld is outside [0, %d)", path, (int)tokens[i],
                            (long long)i, vocab_size);
    int32_t header[LM_SHARD_HEADER_INTS] = {0};
    int wide = vocab_size > LM_SHARD_U16_MAX_VOCAB;
    header[0] = wide ? LM_SHARD_MAGIC_U32 : LM_SHARD_MAGIC_U16;
    header[1] = LM_SHARD_VERSION;
    header[2] = (int32_t)n;
    header[3] = vocab_size;
    size_t tb = wide ? 4 : 2, nbytes = (size_t)n * tb;
    uint8_t *body = malloc(nbytes ? nbytes : 1);
    if (!body) return lm_error(LM_ERR_MEMORY, "%s: out of memory for %lld tokens", path, (long long)n);
    for (int64_t i = 0; i < n; i++) {
        if (wide) {
            uint32_t v = (uint32_t)tokens[i];
            memcpy(body + 4 * i, &v, 4);
        } else {
            uint16_t v = (uint16_t)tokens[i];
            memcpy(body + 2 * i, &v, 2);
        }
    }
    const void *parts[2] = {header, body};
    size_t sizes[2] = {sizeof header, nbytes};
    lm_status s = lm_write_file_atomic(path, parts, sizes, 2);
    free(body);
    return s;
}

/* ---- reader ---- */

void lm_shard_close(lm_shard *s) {
    if (s->map) munmap(s->map, s->map_size);
    memset(s, 0, sizeof *s);
}

lm_status lm_shard_open(const char *path, int vocab_size, lm_shard *out) {
    memset(out, 0, sizeof *out);
    snprintf(out->path, sizeof out->path, "%s", path);
    if (vocab_size < 0) return lm_error(LM_ERR_ARG, "%s: vocabulary size %d must be >= 0", path, vocab_size);
    int fd;
    int64_t file_size;
    TRY(lm_open_regular(path, &fd, &file_size));
    size_t size = (size_t)file_size;
    if (size < LM_SHARD_HEADER_BYTES) {
        close(fd);
        return lm_error(LM_ERR_FORMAT, "%s: %zu bytes, shorter than the %d-byte shard header", path, size,
                        LM_SHARD_HEADER_BYTES);
    }
    void *map = mmap(NULL, size, PROT_READ, MAP_PRIVATE, fd, 0);
    close(fd);
    if (map == MAP_FAILED) return lm_error(LM_ERR_IO, "cannot map shard '%s': %s", path, strerror(errno));
    out->map = map;
    out->map_size = size;
    int32_t h[LM_SHARD_HEADER_INTS];
    memcpy(h, map, sizeof h);
    lm_status s = LM_OK;
    if (h[0] != LM_SHARD_MAGIC_U16 && h[0] != LM_SHARD_MAGIC_U32) {
        s = lm_error(LM_ERR_FORMAT, "%s: magic %d is not a token shard's (%d: uint16 tokens, %d: uint32 tokens)", path,
                     h[0], LM_SHARD_MAGIC_U16, LM_SHARD_MAGIC_U32);
        goto fail;
    }
    if (h[1] != LM_SHARD_VERSION) {
        s = lm_error(LM_ERR_FORMAT, "%s: version %d; this reader knows version %d", path, h[1], LM_SHARD_VERSION);
        goto fail;
    }
    out->token_bytes = h[0] == LM_SHARD_MAGIC_U16 ? 2 : 4;
    if (h[2] < 0) {
        s = lm_error(LM_ERR_FORMAT, "%s: the header's token count %d is negative", path, h[2]);
        goto fail;
    }
    out->n_tokens = h[2];
    size_t want = LM_SHARD_HEADER_BYTES + (size_t)out->n_tokens * (size_t)out->token_bytes;
    if (size != want) {
        s = lm_error(LM_ERR_FORMAT,
                     "%s: the header says %lld tokens of %d bytes (a file of %zu bytes) but the file has %zu bytes%s",
                     path, (long long)out->n_tokens, out->token_bytes, want, size,
                     size < want ? " (truncated?)" : " (trailing bytes)");
        goto fail;
    }
    out->header_vocab = h[3];
    if (h[3] < 0 || (out->token_bytes == 2 && h[3] > LM_SHARD_U16_MAX_VOCAB)) {
        s = lm_error(LM_ERR_FORMAT, "%s: header vocabulary %d is impossible for %s tokens", path, h[3],
                     out->token_bytes == 2 ? "uint16" : "uint32");
        goto fail;
    }
    for (int i = 4; i < LM_SHARD_HEADER_INTS; i++)
        if (h[i] != 0) {
            s = lm_error(LM_ERR_FORMAT, "%s: header[%d] is %d; the reserved header fields must be 0", path, i, h[i]);
            goto fail;
        }
    if (vocab_size > 0 && h[3] > vocab_size) {
        s = lm_error(LM_ERR_FORMAT, "%s: written for a vocabulary of %d tokens, larger than the %d expected", path,
                     h[3], vocab_size);
        goto fail;
    }
    out->tokens = (const uint8_t *)map + LM_SHARD_HEADER_BYTES;
    /* every token in range: the bound is the given vocabulary, else the header's,
     * else one that leaves the implied vocabulary (largest token + 1) an int */
    int64_t bound = vocab_size > 0 ? vocab_size : h[3] > 0 ? h[3] : INT32_MAX;
    int64_t max = -1;
    if (out->token_bytes == 2) {
        const uint16_t *t = (const uint16_t *)(const void *)out->tokens;
        for (int64_t i = 0; i < out->n_tokens; i++)
            if (t[i] > max) max = t[i];
    } else {
        const uint32_t *t = (const uint32_t *)(const void *)out->tokens;
        for (int64_t i = 0; i < out->n_tokens; i++)
            if (t[i] > max) max = t[i];
    }
    if (max >= bound) {
        int64_t at = 0;
        while (lm_shard_token(out, at) >= 0 && lm_shard_token(out, at) < bound) at++;
        s = lm_error(LM_ERR_FORMAT, "%s: token %lld at position %lld is outside the vocabulary [0, %lld) %s", path,
                     (long long)(uint32_t)lm_shard_token(out, at), (long long)at, (long long)bound,
                     vocab_size > 0 ? "expected" : h[3] > 0 ? "the header records" : "an int32 vocabulary allows");
        goto fail;
    }
    out->max_token = (int)max;
    return LM_OK;
fail:
    lm_shard_close(out);
    return s;
}

/* ---- the seeded shuffle ---- */


/* A 4-round Feistel network on 2h-bit numbers (a bijection of [0, 4^h)),
 * applied until the value falls below n again (cycle walking keeps it a
 * bijection of [0, n)). The round keys depend on seed and epoch. */
uint64_t lm_shuffle_index(uint64_t x, uint64_t n, uint64_t seed, uint64_t epoch) {
    if (n <= 1) return 0;
    int bits = 64 - __builtin_clzll(n - 1);
    int h = (bits + 1) / 2;
    uint64_t mask = (1ull << h) - 1, key[4];
    for (int r = 0; r < 4; r++) key[r] = lm_mix64(seed ^ lm_mix64(epoch * 4 + (uint64_t)r + 0x9e3779b97f4a7c15ull));
    do {
        uint64_t left = x >> h, right = x & mask;
        for (int r = 0; r < 4; r++) {
            uint64_t next = left ^ (lm_mix64(right ^ key[r]) & mask);
            left = right;
            right = next;
        }
        x = left << h | right;
    } while (x >= n);
    return x;
}

/* ---- the data source ---- */

typedef struct {
    int n_shards;
    lm_shard *shards;
    uint64_t seed;
    int rank, n_ranks;
} shard_state;

static int64_t windows_of(const lm_shard *s, int T) { return s->n_tokens > T ? (s->n_tokens - 1) / T : 0; }

static lm_status locate(const shard_state *st, const char *name, int64_t sample, int T, int *shard, int64_t *start) {
    int64_t W = 0;
    for (int i = 0; i < st->n_shards; i++) W += windows_of(&st->shards[i], T);
    if (W == 0)
        return lm_error(LM_ERR_ARG, "%s: no shard holds a window of T + 1 = %d tokens (the longest has %lld)", name,
                        T + 1, (long long)st->shards[0].n_tokens);
    /* sample -> (epoch, position) -> window of the epoch's permutation */
    int64_t w = (int64_t)lm_shuffle_index((uint64_t)(sample % W), (uint64_t)W, st->seed, (uint64_t)(sample / W));
    for (int i = 0; i < st->n_shards; i++) {
        int64_t k = windows_of(&st->shards[i], T);
        if (w < k) {
            *shard = i;
            *start = w * T;
            return LM_OK;
        }
        w -= k;
    }
    return lm_error(LM_ERR_ARG, "%s: window out of range (internal error)", name);
}

/* Rows r0 .. r0+n-1 of batch `index` of B rows: seq (n, T+1), answer (n, T) */
static lm_status shards_rows(lm_data_source *self, int64_t index, int B, int T, int r0, int n, int32_t *seq,
                             uint8_t *answer) {
    const shard_state *st = self->state;
    if (B < 1 || T < 1 || index < 0)
        return lm_error(LM_ERR_ARG, "%s: batch %lld of B=%d, T=%d: need index >= 0, B >= 1, T >= 1", self->name,
                        (long long)index, B, T);
    for (int i = 0; i < n; i++) {
        int64_t sample = (index * st->n_ranks + st->rank) * B + r0 + i, start;
        int shard;
        lm_status s = locate(st, self->name, sample, T, &shard, &start);
        if (s) return s;
        const lm_shard *sh = &st->shards[shard];
        int32_t *dst = seq + (size_t)i * (size_t)(T + 1);
        for (int t = 0; t <= T; t++) dst[t] = lm_shard_token(sh, start + t);
    }
    if (answer) memset(answer, 0, (size_t)n * (size_t)T);
    return LM_OK;
}

static lm_status shards_batch(lm_data_source *self, int64_t index, int B, int T, int32_t *seq, uint8_t *answer) {
    /* seq is (B, T+1), answer (B, T) */
    return shards_rows(self, index, B, T, 0, B, seq, answer);
}

static void shards_destroy(lm_data_source *self) {
    shard_state *st = self->state;
    if (!st) return;
    for (int i = 0; i < st->n_shards; i++) lm_shard_close(&st->shards[i]);
    free(st->shards);
    free(st);
    self->state = NULL;
}

lm_status lm_shards_window(const lm_data_source *src, int64_t sample, int T, int *shard, int64_t *start) {
    if (src->batch != shards_batch) return lm_error(LM_ERR_ARG, "%s is not a shard source", src->name);
    if (T < 1 || sample < 0) return lm_error(LM_ERR_ARG, "window of sample %lld, T=%d: need sample >= 0, T >= 1",
                                             (long long)sample, T);
    return locate(src->state, src->name, sample, T, shard, start);
}

/* The shard files of a split: split_000000.bin ... numbered without gaps. */
/* The marker of a directory being prepared: written before the first shard,
 * removed after the last file, so a `data prepare` killed midway leaves a
 * directory that no reader takes for complete. */
#define PREPARING_MARK "PREPARING"

static int being_prepared(const char *dir) {
    char path[4200];
    snprintf(path, sizeof path, "%s/" PREPARING_MARK, dir);
    struct stat sb;
    return lstat(path, &sb) == 0;
}

static lm_status list_split(const char *dir, const char *split, char ***paths, int *n) {
    *paths = NULL;
    *n = 0;
    DIR *d = opendir(dir);
    if (!d) return lm_error(LM_ERR_IO, "cannot open shard directory '%s': %s", dir, strerror(errno));
    size_t sl = strlen(split);
    int cap = 0, count = 0, max_index = -1;
    int *index = NULL;
    struct dirent *e;
    lm_status s = LM_OK;
    while ((e = readdir(d))) {
        const char *nm = e->d_name;
        if (strncmp(nm, split, sl) || nm[sl] != '_' || strlen(nm) != sl + 11 || strcmp(nm + sl + 7, ".bin")) continue;
        int k = 0, ok = 1;
        for (int i = 0; i < 6; i++) {
            char c = nm[sl + 1 + i];
            ok &= c >= '0' && c <= '9';
            k = k * 10 + (c - '0');
        }
        if (!ok) continue;
        if (count == cap) {
            cap = cap ? 2 * cap : 16;
            int *q = realloc(index, (size_t)cap * sizeof *q);
            if (!q) {
                s = lm_error(LM_ERR_MEMORY, "out of memory listing '%s'", dir);
                break;
            }
            index = q;
        }
        index[count++] = k;
        if (k > max_index) max_index = k;
    }
    closedir(d);
    if (!s && count == 0)
        s = lm_error(LM_ERR_ARG, "%s: no %s shards (%s_000000.bin, ...); run `longmoe data prepare`", dir, split,
                     split);
    if (!s && max_index != count - 1)
        s = lm_error(LM_ERR_FORMAT, "%s: %d %s shards but numbers up to %06d: a shard is missing", dir, count, split,
                     max_index);
    char **p = s ? NULL : calloc((size_t)count, sizeof *p);
    if (!s && !p) s = lm_error(LM_ERR_MEMORY, "out of memory listing '%s'", dir);
    for (int i = 0; !s && i < count; i++) {
        size_t len = strlen(dir) + sl + 16;
        p[i] = malloc(len);
        if (!p[i]) {
            s = lm_error(LM_ERR_MEMORY, "out of memory listing '%s'", dir);
            break;
        }
        snprintf(p[i], len, "%s/%s_%06d.bin", dir, split, i);
    }
    free(index);
    if (s) {
        for (int i = 0; p && i < count; i++) free(p[i]);
        free(p);
        return s;
    }
    *paths = p;
    *n = count;
    return LM_OK;
}

lm_status lm_data_open_shards(const char *dir, const char *split, int vocab_size, uint64_t seed, int rank,
                              int n_ranks, lm_data_source **out) {
    *out = NULL;
    if (strcmp(split, "train") && strcmp(split, "val"))
        return lm_error(LM_ERR_ARG, "shard split '%s' must be \"train\" or \"val\"", split);
    if (n_ranks < 1 || rank < 0 || rank >= n_ranks)
        return lm_error(LM_ERR_ARG, "rank %d of %d ranks: need 0 <= rank < n_ranks", rank, n_ranks);
    if (vocab_size < 0) return lm_error(LM_ERR_ARG, "vocabulary size %d must be >= 0", vocab_size);
    if (being_prepared(dir))
        return lm_error(LM_ERR_FORMAT, "'%s' is incomplete: a `data prepare` into it did not finish (%s/" PREPARING_MARK
                        " exists); run the same data prepare again", dir, dir);
    char **paths;
    int n;
    lm_status s = list_split(dir, split, &paths, &n);
    if (s) return s;
    lm_data_source *src = calloc(1, sizeof *src);
    shard_state *st = calloc(1, sizeof *st);
    lm_shard *shards = calloc((size_t)n, sizeof *shards);
    if (!src || !st || !shards) {
        s = lm_error(LM_ERR_MEMORY, "out of memory opening shards of '%s'", dir);
        goto fail;
    }
    st->shards = shards;
    st->seed = seed;
    st->rank = rank;
    st->n_ranks = n_ranks;
    src->state = st;
    src->batch = shards_batch;
    src->rows = shards_rows;
    src->destroy = shards_destroy;
    snprintf(src->name, sizeof src->name, "shards:%s", dir);
    int header_vocab = 0, max_token = -1, first_with_vocab = -1;
    for (int i = 0; i < n; i++) {
        if ((s = lm_shard_open(paths[i], vocab_size, &shards[i]))) goto fail;
        st->n_shards = i + 1;
        int hv = shards[i].header_vocab;
        if (hv > 0 && header_vocab > 0 && hv != header_vocab) {
            s = lm_error(LM_ERR_FORMAT, "%s: written for a vocabulary of %d tokens but %s for %d: mixed tokenizers?",
                         paths[i], hv, paths[first_with_vocab], header_vocab);
            goto fail;
        }
        if (hv > 0 && header_vocab == 0) header_vocab = hv, first_with_vocab = i;
        if (shards[i].max_token > max_token) max_token = shards[i].max_token;
    }
    /* tokens above a recorded vocabulary were refused shard by shard, except
     * in shards that record none */
    if (!vocab_size && header_vocab && max_token >= header_vocab) {
        s = lm_error(LM_ERR_FORMAT, "%s: a shard without a recorded vocabulary holds token %d, outside the %d of %s",
                     dir, max_token, header_vocab, paths[first_with_vocab]);
        goto fail;
    }
    src->vocab_size = vocab_size ? vocab_size : header_vocab ? header_vocab : max_token + 1;
    if (src->vocab_size < 1) src->vocab_size = 1;
    for (int i = 0; i < n; i++) free(paths[i]);
    free(paths);
    *out = src;
    return LM_OK;
fail:
    for (int i = 0; i < n; i++) free(paths[i]);
    free(paths);
    if (src && src->state) shards_destroy(src);
    else {
        free(st);
        free(shards);
    }
    free(src);
    return s;
}

/* ---- preparing a directory ---- */

static lm_status write_split(const char *dir, const char *split, const int32_t *tokens, int64_t n,
                             int64_t shard_tokens, int vocab, int *n_shards) {
    *n_shards = 0;
    char path[4200];
    for (int64_t off = 0; off < n; off += shard_tokens) {
        int64_t k = n - off < shard_tokens ? n - off : shard_tokens;
        snprintf(path, sizeof path, "%s/%s_%06d.bin", dir, split, *n_shards);
        lm_status s = lm_shard_write(path, tokens + off, k, vocab);
        if (s) return s;
        ++*n_shards;
    }
    return LM_OK;
}

lm_status lm_shards_prepare(const char *const *inputs, int n_inputs, const lm_tokenizer *tok, const char *dir,
                            int64_t shard_tokens, double val_fraction, lm_prepare_stats *stats) {
    memset(stats, 0, sizeof *stats);
    double t0 = lm_time_seconds();
    if (n_inputs < 1) return lm_error(LM_ERR_ARG, "no input files to prepare");
    if (shard_tokens < 2 || shard_tokens > INT32_MAX)
        return lm_error(LM_ERR_ARG, "tokens per shard %lld must lie in [2, %d]", (long long)shard_tokens, INT32_MAX);
    if (!(val_fraction >= 0 && val_fraction < 1))
        return lm_error(LM_ERR_ARG, "validation fraction %g must lie in [0, 1)", val_fraction);
    if (strlen(dir) > 4000) return lm_error(LM_ERR_ARG, "directory name too long (%zu bytes)", strlen(dir));
    if (mkdir(dir, 0755) != 0 && errno != EEXIST)
        return lm_error(LM_ERR_IO, "cannot create directory '%s': %s", dir, strerror(errno));
    static const char *const splits[2] = {"train", "val"};
    char mark[4200];
    snprintf(mark, sizeof mark, "%s/" PREPARING_MARK, dir);
    if (being_prepared(dir)) {
        /* an interrupted preparation: its shards are partial; start again */
        for (int i = 0; i < 2; i++) {
            char **p;
            int n;
            if (list_split(dir, splits[i], &p, &n) == LM_OK) {
                for (int k = 0; k < n; k++) {
                    unlink(p[k]);
                    free(p[k]);
                }
                free(p);
            }
        }
    }
    for (int i = 0; i < 2; i++) {
        char **p;
        int n;
        lm_status s = list_split(dir, splits[i], &p, &n);
        if (s == LM_ERR_IO) return s;
        if (!s) {
            for (int k = 0; k < n; k++) free(p[k]);
            free(p);
        }
        if (s != LM_ERR_ARG)
            return lm_error(LM_ERR_ARG, "%s already holds %s shards; remove them or choose another directory", dir,
                            splits[i]);
    }
    lm_clear_error();
    TRY(lm_write_file_atomic(mark, (const void *const[]){"data prepare in progress\n"}, (const size_t[]){25}, 1));
    /* every file is one document: the end-of-text id, then its tokens */
    int32_t *all = NULL;
    size_t n_all = 0, cap = 0;
    lm_status s = LM_OK;
    for (int f = 0; f < n_inputs && !s; f++) {
        char *text;
        size_t len;
        int32_t *ids;
        size_t n_ids;
        if ((s = lm_read_file(inputs[f], 0, &text, &len))) break;
        s = lm_tokenizer_encode(tok, text, len, &ids, &n_ids);
        free(text);
        if (s) break;
        stats->bytes += (int64_t)len;
        if (n_all + n_ids + 1 > cap) {
            size_t c = cap ? cap : 1 << 16;
            while (c < n_all + n_ids + 1) c *= 2;
            int32_t *q = realloc(all, c * sizeof *q);
            if (!q) {
                free(ids);
                s = lm_error(LM_ERR_MEMORY, "out of memory holding %zu tokens", n_all + n_ids + 1);
                break;
            }
            all = q;
            cap = c;
        }
        all[n_all++] = lm_tokenizer_eot_id(tok);
        if (n_ids) memcpy(all + n_all, ids, n_ids * sizeof *ids);
        n_all += n_ids;
        free(ids);
    }
    int64_t n_val = (int64_t)ceil(val_fraction * (double)n_all);
    if (n_val > (int64_t)n_all) n_val = (int64_t)n_all;
    if (!s && (int64_t)n_all - n_val < 2)
        s = lm_error(LM_ERR_ARG, "the inputs give %zu tokens, %lld of them for validation: too few to train on", n_all,
                     (long long)n_val);
    int V = lm_tokenizer_vocab_size(tok);
    if (!s) s = write_split(dir, "val", all, n_val, shard_tokens, V, &stats->val_shards);
    if (!s) s = write_split(dir, "train", all + n_val, (int64_t)n_all - n_val, shard_tokens, V, &stats->train_shards);
    if (!s) {
        char path[4200];
        snprintf(path, sizeof path, "%s/tokenizer.json", dir);
        s = lm_tokenizer_save(tok, path);
    }
    /* complete: the marker goes last (and durably) */
    if (!s && unlink(mark) != 0) s = lm_error(LM_ERR_IO, "cannot remove '%s': %s", mark, strerror(errno));
    if (!s) {
        int dfd = open(dir, O_RDONLY);
        if (dfd >= 0) {
            fsync(dfd);
            close(dfd);
        }
    }
    free(all);
    stats->tokens = (int64_t)n_all;
    stats->val_tokens = n_val;
    stats->train_tokens = (int64_t)n_all - n_val;
    stats->seconds = lm_time_seconds() - t0;
    return s;
}

/* ---- fingerprints (include/longmoe/data.h) ---- */

static lm_status fingerprint_file(const char *path, lm_data_file *f) {
    const char *base = strrchr(path, '/');
    snprintf(f->name, sizeof f->name, "%s", base ? base + 1 : path);
    int fd;
    int64_t size;
    TRY(lm_open_regular(path, &fd, &size));
    f->bytes = size;
    if (size == 0) {
        close(fd);
        f->checksum = lm_checksum64("", 0);
        return LM_OK;
    }
    void *map = mmap(NULL, (size_t)size, PROT_READ, MAP_PRIVATE, fd, 0);
    int err = errno;
    close(fd);
    if (map == MAP_FAILED) return lm_error(LM_ERR_IO, "cannot map '%s': %s", path, strerror(err));
    f->checksum = lm_checksum64(map, (size_t)size);
    munmap(map, (size_t)size);
    return LM_OK;
}

/* Append the fingerprints of the `split` shards of dir to *files (*n of them, room *cap). */
static lm_status fingerprint_split(const char *dir, const char *split, lm_data_file **files, int *n, int *cap) {
    char **paths;
    int count;
    TRY(list_split(dir, split, &paths, &count));
    lm_status s = LM_OK;
    if (*n + count > *cap) {
        int want = *n + count;
        lm_data_file *q = realloc(*files, (size_t)want * sizeof *q);
        if (!q) s = lm_error(LM_ERR_MEMORY, "out of memory fingerprinting '%s'", dir);
        else *files = q, *cap = want;
    }
    for (int i = 0; i < count && !s; i++) {
        s = fingerprint_file(paths[i], &(*files)[*n]);
        if (!s) (*n)++;
    }
    for (int i = 0; i < count; i++) free(paths[i]);
    free(paths);
    return s;
}

lm_status lm_data_fingerprint(const char *spec, lm_data_file **files, int *n) {
    *files = NULL;
    *n = 0;
    int cap = 0;
    lm_status s = LM_OK;
    if (!strncmp(spec, "shards:", 7)) {
        s = fingerprint_split(spec + 7, "train", files, n, &cap);
        if (!s) s = fingerprint_split(spec + 7, "val", files, n, &cap);
    } else if (!strncmp(spec, "shards-val:", 11)) {
        s = fingerprint_split(spec + 11, "val", files, n, &cap);
    }
    if (s) {
        free(*files);
        *files = NULL;
        *n = 0;
    }
    return s;
}

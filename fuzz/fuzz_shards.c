/* libFuzzer harness of the token-shard reader (lm_shard_open) and the shard
 * data source: the fuzz input is written as train_000000.bin of a directory
 * ($TMPDIR, else /dev/shm, else /tmp). Either the shard opens and every token
 * lies within its bounds, and the source's batches stay in bounds and below
 * its vocabulary, or the open fails with a message; never a crash. */
#define _POSIX_C_SOURCE 200809L
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>
#include <unistd.h>

#include "longmoe/shards.h"

static char dir[256], path[300];

static void cleanup(void) {
    unlink(path);
    rmdir(dir);
}

int LLVMFuzzerInitialize(int *argc, char ***argv) {
    const char *tmp = getenv("TMPDIR");
    struct stat sb;
    if (!tmp || !*tmp) tmp = stat("/dev/shm", &sb) == 0 ? "/dev/shm" : "/tmp";
    snprintf(dir, sizeof dir, "%s/longmoe-fuzz-shards-XXXXXX", tmp);
    if (!mkdtemp(dir)) abort();
    snprintf(path, sizeof path, "%s/train_000000.bin", dir);
    atexit(cleanup);
    return 0;
}

int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size) {
    FILE *f = fopen(path, "wb");
    if (!f || fwrite(data, 1, size, f) != size) abort();
    fclose(f);
    const int vocabs[2] = {0, 300};
    for (int v = 0; v < 2; v++) {
        lm_shard s;
        memset(&s, 0, sizeof s);
        if (lm_shard_open(path, vocabs[v], &s) != LM_OK) continue;
        if (s.token_bytes != 2 && s.token_bytes != 4) abort();
        if ((size_t)LM_SHARD_HEADER_BYTES + (size_t)s.n_tokens * (size_t)s.token_bytes != size) abort();
        int32_t max = -1;
        for (int64_t i = 0; i < s.n_tokens; i++) {
            int32_t t = lm_shard_token(&s, i);
            /* the bound: the given vocabulary, else the header's (shards.h) */
            if (t < 0 || (vocabs[v] && t >= vocabs[v]) || (!vocabs[v] && s.header_vocab && t >= s.header_vocab))
                abort();
            max = t > max ? t : max;
        }
        if (max != s.max_token) abort();
        lm_shard_close(&s);
    }
    /* the directory as a data source: a few batches of short windows */
    lm_data_source *src = NULL;
    if (lm_data_open_shards(dir, "train", 0, 7, 0, 1, &src) == LM_OK) {
        int32_t seq[2 * 5];
        for (int64_t i = 0; i < 3; i++) {
            memset(seq, 0xff, sizeof seq);
            if (src->batch(src, i * 1000003, 2, 4, seq, NULL) != LM_OK) continue;
            for (int j = 0; j < 2 * 5; j++)
                if (seq[j] < 0 || seq[j] >= src->vocab_size) abort();
        }
        lm_data_close(src);
    }
    return 0;
}

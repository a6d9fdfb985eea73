/* Tokenizer and shard loader speed: BPE training, encoding, decoding, and
 * batches from shards. Input: the files given as arguments (concatenated),
 * else 8 MB of generated pseudo-English. Prints a markdown table. */
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>
#include <unistd.h>

#include "files.h"
#include "longmoe/shards.h"
#include "longmoe/tokenizer.h"

static char *generated_text(size_t n, size_t *len) {
    static const char *const words[] = {"the", "of", "and", "to", "in", "is", "that", "for", "it", "as", "with",
                                        "was", "on", "be", "at", "by", "this", "had", "not", "are", "but", "from",
                                        "model", "expert", "attention", "gate", "state", "token", "layer", "train",
                                        "context", "length", "memory", "kernel", "chunk", "router", "loss", "data"};
    const int nw = (int)(sizeof words / sizeof words[0]);
    lm_rng r;
    lm_rng_seed(&r, 1);
    char *t = malloc(n + 64);
    size_t o = 0;
    while (o < n) {
        double u = lm_rng_uniform(&r);
        const char *w = words[(int)(u * u * nw)];
        size_t k = strlen(w);
        memcpy(t + o, w, k);
        o += k;
        uint64_t x = lm_rng_u64(&r) % 30;
        if (x == 0) o += (size_t)sprintf(t + o, ".\n");
        else if (x == 1) o += (size_t)sprintf(t + o, " %d ", (int)(lm_rng_u64(&r) % 10000));
        else t[o++] = ' ';
    }
    *len = o;
    return t;
}

int main(int argc, char **argv) {
    size_t len = 0;
    char *text = NULL;
    const char *what = "8 MB generated text";
    if (argc > 1) {
        for (int i = 1; i < argc; i++) {
            char *b;
            size_t n;
            if (lm_read_file(argv[i], 0, &b, &n)) {
                fprintf(stderr, "%s\n", lm_last_error());
                return 1;
            }
            text = realloc(text, len + n + 1);
            memcpy(text + len, b, n);
            len += n;
            free(b);
        }
        what = "the given files";
    } else {
        text = generated_text(8u << 20, &len);
    }
    const int vocab = 8192;
    const void *texts[1] = {text};
    lm_tokenizer *tok;
    double t0 = lm_time_seconds();
    if (lm_tokenizer_train(texts, &len, 1, vocab, 2, &tok)) {
        fprintf(stderr, "%s\n", lm_last_error());
        return 1;
    }
    double t_train = lm_time_seconds() - t0;
    int32_t *ids;
    size_t n_ids;
    t0 = lm_time_seconds();
    lm_tokenizer_encode(tok, text, len, &ids, &n_ids);
    double t_enc = lm_time_seconds() - t0;
    char *back;
    size_t blen;
    t0 = lm_time_seconds();
    lm_tokenizer_decode(tok, ids, n_ids, &back, &blen);
    double t_dec = lm_time_seconds() - t0;
    int ok = blen == len && !memcmp(back, text, len);

    /* shards: one directory, batches of 8 x 1024 */
    char dir[] = "/tmp/longmoe-bench-tokenizer-XXXXXX";
    double t_batch = 0;
    int B = 8, T = 1024, n_batches = 200;
    if (mkdtemp(dir)) {
        char path[256];
        snprintf(path, sizeof path, "%s/train_000000.bin", dir);
        lm_data_source *src;
        if (!lm_shard_write(path, ids, (int64_t)n_ids, lm_tokenizer_vocab_size(tok)) &&
            !lm_data_open_shards(dir, "train", 0, 1, 0, 1, &src)) {
            int32_t *seq = malloc((size_t)B * (T + 1) * sizeof *seq);
            t0 = lm_time_seconds();
            for (int i = 0; i < n_batches; i++) src->batch(src, i, B, T, seq, NULL);
            t_batch = (lm_time_seconds() - t0) / n_batches;
            free(seq);
            lm_data_close(src);
        }
        unlink(path);
        rmdir(dir);
    }
    double mb = (double)len / 1e6;
    printf("tokenizer on %s: %.1f MB, vocab %d, %.2f bytes/token, round trip %s\n\n", what, mb,
           lm_tokenizer_vocab_size(tok), (double)len / (double)n_ids, ok ? "exact" : "BROKEN");
    printf("| step | seconds | throughput |\n|---|---|---|\n");
    printf("| train BPE to vocab %d | %.2f | %.1f MB/s |\n", vocab, t_train, mb / t_train);
    printf("| encode | %.3f | %.1f MB/s |\n", t_enc, mb / t_enc);
    printf("| decode | %.3f | %.1f MB/s |\n", t_dec, mb / t_dec);
    if (t_batch > 0)
        printf("| shard batch %d x %d (uint16, mmap) | %.6f | %.1f M tokens/s |\n", B, T, t_batch,
               (double)B * (T + 1) / t_batch / 1e6);
    free(ids);
    free(back);
    free(text);
    lm_tokenizer_free(tok);
    return ok ? 0 : 1;
}

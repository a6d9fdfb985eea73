/* Token shards: the writer and the strict reader (uint16 and uint32), the
 * seeded shuffle, and the data source: batches are pure functions of the
 * index, an epoch reads every window once, ranks read disjoint windows;
 * `longmoe data prepare` writes what the tokenizer encodes. */
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>
#include <unistd.h>

#include "longmoe/shards.h"
#include "longmoe/tokenizer.h"
#include "test.h"

static char tmpdir[256];

static const char *tmp_path(const char *name) { return test_path(tmpdir, name); }

static void write_raw(const char *path, const int32_t *header, const void *body, size_t nbody) {
    FILE *f = fopen(path, "wb");
    CHECK(f != NULL, "cannot write %s", path);
    if (!f) return;
    if (header) fwrite(header, 4, LM_SHARD_HEADER_INTS, f);
    if (nbody) fwrite(body, 1, nbody, f);
    fclose(f);
}

static long file_size(const char *path) {
    struct stat sb;
    return stat(path, &sb) == 0 ? (long)sb.st_size : -1;
}

static void test_write_read_roundtrip_uint16_and_uint32(void) {
    lm_rng r;
    lm_rng_seed(&r, 1);
    const int vocabs[2] = {50257, 100000};
    for (int v = 0; v < 2; v++) {
        int64_t n = 3001;
        int32_t *tok = malloc((size_t)n * sizeof *tok);
        for (int64_t i = 0; i < n; i++) tok[i] = (int32_t)(lm_rng_u64(&r) % (uint64_t)vocabs[v]);
        tok[7] = vocabs[v] - 1; /* the largest id survives */
        const char *path = tmp_path(v ? "u32.bin" : "u16.bin");
        CHECK(lm_shard_write(path, tok, n, vocabs[v]) == LM_OK, "%s", lm_last_error());
        int tb = v ? 4 : 2;
        CHECK(file_size(path) == 1024 + n * tb, "file of %ld bytes, want %lld", file_size(path),
              (long long)(1024 + n * tb));
        /* the header as llm.c's reader sees it */
        int32_t h[LM_SHARD_HEADER_INTS];
        FILE *f = fopen(path, "rb");
        CHECK(f && fread(h, 4, LM_SHARD_HEADER_INTS, f) == LM_SHARD_HEADER_INTS, "cannot read header");
        if (f) fclose(f);
        CHECK(h[0] == (v ? 20240801 : 20240520) && h[1] == 1 && h[2] == n && h[3] == vocabs[v],
              "header %d %d %d %d", h[0], h[1], h[2], h[3]);
        lm_shard s;
        CHECK(lm_shard_open(path, vocabs[v], &s) == LM_OK, "%s", lm_last_error());
        CHECK(s.token_bytes == tb && s.n_tokens == n && s.header_vocab == vocabs[v], "opened %d bytes, %lld tokens",
              s.token_bytes, (long long)s.n_tokens);
        int same = 1;
        for (int64_t i = 0; i < n && s.tokens; i++) same &= lm_shard_token(&s, i) == tok[i];
        CHECK(same, "tokens differ after the round trip (vocab %d)", vocabs[v]);
        CHECK(s.max_token == vocabs[v] - 1, "max token %d", s.max_token);
        lm_shard_close(&s);
        /* the writer refuses tokens outside the vocabulary */
        tok[100] = vocabs[v];
        CHECK(lm_shard_write(tmp_path("x.bin"), tok, n, vocabs[v]) == LM_ERR_ARG &&
                  strstr(lm_last_error(), "position 100"),
              "an out-of-range token was written: %s", lm_last_error());
        free(tok);
    }
    /* an empty shard is valid */
    lm_shard s;
    CHECK(lm_shard_write(tmp_path("empty.bin"), NULL, 0, 300) == LM_OK, "%s", lm_last_error());
    CHECK(lm_shard_open(tmp_path("empty.bin"), 300, &s) == LM_OK && s.n_tokens == 0, "%s", lm_last_error());
    lm_shard_close(&s);
}

static void test_bad_shards_are_rejected_naming_file_and_problem(void) {
    uint16_t body[64];
    for (int i = 0; i < 64; i++) body[i] = (uint16_t)(i * 7);
    struct {
        const char *name;
        int32_t h0, h1, h2, h3, h_extra;
        size_t nbody;
        int vocab;
        const char *want;
    } cases[] = {
        {"magic.bin", 12345, 1, 64, 500, 0, 128, 0, "magic 12345"},
        {"version.bin", LM_SHARD_MAGIC_U16, 2, 64, 500, 0, 128, 0, "version 2"},
        {"count_long.bin", LM_SHARD_MAGIC_U16, 1, 65, 500, 0, 128, 0, "truncated"},
        {"count_short.bin", LM_SHARD_MAGIC_U16, 1, 63, 500, 0, 128, 0, "trailing bytes"},
        {"count_neg.bin", LM_SHARD_MAGIC_U16, 1, -1, 500, 0, 128, 0, "negative"},
        {"u32_size.bin", LM_SHARD_MAGIC_U32, 1, 64, 500, 0, 128, 0, "64 tokens of 4 bytes"},
        {"reserved.bin", LM_SHARD_MAGIC_U16, 1, 64, 500, 9, 128, 0, "header[10] is 9"},
        {"range.bin", LM_SHARD_MAGIC_U16, 1, 64, 0, 0, 128, 300, "token 301 at position 43"},
        {"range_hdr.bin", LM_SHARD_MAGIC_U16, 1, 64, 400, 0, 128, 0, "token 406 at position 58"},
        {"vocab_big.bin", LM_SHARD_MAGIC_U16, 1, 64, 500, 0, 128, 450, "vocabulary of 500 tokens"},
        {"vocab_u16.bin", LM_SHARD_MAGIC_U16, 1, 64, 70000, 0, 128, 0, "impossible for uint16"},
    };
    for (size_t c = 0; c < sizeof cases / sizeof cases[0]; c++) {
        int32_t h[LM_SHARD_HEADER_INTS] = {0};
        h[0] = cases[c].h0;
        h[1] = cases[c].h1;
        h[2] = cases[c].h2;
        h[3] = cases[c].h3;
        h[10] = cases[c].h_extra;
        const char *path = tmp_path(cases[c].name);
        write_raw(path, h, body, cases[c].nbody);
        lm_shard s;
        lm_status st = lm_shard_open(path, cases[c].vocab, &s);
        const char *e = lm_last_error();
        CHECK(st == LM_ERR_FORMAT, "%s accepted", cases[c].name);
        CHECK(strstr(e, cases[c].name) && strstr(e, cases[c].want), "%s: message '%s' lacks '%s' or the file name",
              cases[c].name, e, cases[c].want);
        CHECK(s.map == NULL, "%s: a refused shard stays mapped", cases[c].name);
    }
    /* shorter than a header; missing */
    write_raw(tmp_path("short.bin"), NULL, body, 100);
    lm_shard s;
    CHECK(lm_shard_open(tmp_path("short.bin"), 0, &s) == LM_ERR_FORMAT && strstr(lm_last_error(), "short.bin") &&
              strstr(lm_last_error(), "shorter than the 1024-byte"),
          "short file: %s", lm_last_error());
    CHECK(lm_shard_open(tmp_path("none.bin"), 0, &s) == LM_ERR_IO && strstr(lm_last_error(), "none.bin"),
          "missing file: %s", lm_last_error());
    /* a uint32 token beyond int32 */
    int32_t h[LM_SHARD_HEADER_INTS] = {LM_SHARD_MAGIC_U32, 1, 2};
    uint32_t big[2] = {5, 0x90000000u};
    write_raw(tmp_path("huge.bin"), h, big, sizeof big);
    CHECK(lm_shard_open(tmp_path("huge.bin"), 0, &s) == LM_ERR_FORMAT && strstr(lm_last_error(), "position 1"),
          "a token >= 2^31 accepted: %s", lm_last_error());
    /* 2^31 - 1 fits the file but not the vocabulary it implies (2^31 tokens) */
    uint32_t top[2] = {7, 0x7fffffffu};
    write_raw(tmp_path("top.bin"), h, top, sizeof top);
    CHECK(lm_shard_open(tmp_path("top.bin"), 0, &s) == LM_ERR_FORMAT && strstr(lm_last_error(), "token 2147483647"),
          "token 2^31-1 accepted: %s", lm_last_error());
}

static void test_shuffle_is_a_bijection_per_epoch(void) {
    const uint64_t sizes[] = {1, 2, 3, 17, 1000, 4097};
    for (size_t k = 0; k < sizeof sizes / sizeof sizes[0]; k++) {
        uint64_t n = sizes[k];
        uint8_t *hit = calloc(n, 1);
        int ok = 1, moved = 0;
        for (uint64_t x = 0; x < n; x++) {
            uint64_t y = lm_shuffle_index(x, n, 42, 3);
            ok &= y < n && !hit[y];
            if (y < n) hit[y] = 1;
            moved += y != x;
        }
        CHECK(ok, "n=%llu: not a permutation", (unsigned long long)n);
        CHECK(n < 17 || moved > (int)n / 2, "n=%llu: only %d of the indexes moved", (unsigned long long)n, moved);
        free(hit);
    }
    /* epochs and seeds give different orders */
    int diff_epoch = 0, diff_seed = 0;
    for (uint64_t x = 0; x < 1000; x++) {
        diff_epoch += lm_shuffle_index(x, 1000, 42, 0) != lm_shuffle_index(x, 1000, 42, 1);
        diff_seed += lm_shuffle_index(x, 1000, 42, 0) != lm_shuffle_index(x, 1000, 43, 0);
    }
    CHECK(diff_epoch > 900 && diff_seed > 900, "orders barely change: %d (epoch), %d (seed) of 1000", diff_epoch,
          diff_seed);
}

/* A directory of three train shards whose token at global position p is p
 * (vocab 100000: uint32), so a window's first token names it. */
static const char *make_position_dir(const char *name, int64_t sizes[3]) {
    const char *dir = tmp_path(name);
    mkdir(dir, 0755);
    int64_t p = 0;
    char path[600];
    for (int i = 0; i < 3; i++) {
        int32_t *t = malloc((size_t)sizes[i] * sizeof *t);
        for (int64_t k = 0; k < sizes[i]; k++) t[k] = (int32_t)p++;
        snprintf(path, sizeof path, "%s/train_%06d.bin", dir, i);
        CHECK(lm_shard_write(path, t, sizes[i], 100000) == LM_OK, "%s", lm_last_error());
        free(t);
    }
    /* a val split of one small uint32 shard */
    int32_t v[50];
    for (int k = 0; k < 50; k++) v[k] = 99000 + k;
    snprintf(path, sizeof path, "%s/val_000000.bin", dir);
    CHECK(lm_shard_write(path, v, 50, 100000) == LM_OK, "%s", lm_last_error());
    return dir;
}

static void test_batches_are_pure_functions_of_the_index(void) {
    int64_t sizes[3] = {1000, 357, 2048};
    const char *dir = make_position_dir("pos", sizes);
    lm_data_source *a = NULL, *b = NULL;
    CHECK(lm_data_open_shards(dir, "train", 0, 7, 0, 1, &a) == LM_OK, "%s", lm_last_error());
    CHECK(lm_data_open_shards(dir, "train", 0, 7, 0, 1, &b) == LM_OK, "%s", lm_last_error());
    if (!a || !b) return;
    CHECK(a->vocab_size == 100000, "vocab_size %d from the headers", a->vocab_size);
    const int B = 4, T = 31;
    int32_t s1[4 * 32], s2[4 * 32], s3[4 * 32];
    uint8_t ans[4 * 31];
    memset(ans, 7, sizeof ans);
    CHECK(a->batch(a, 5, B, T, s1, ans) == LM_OK, "%s", lm_last_error());
    CHECK(a->batch(a, 9, B, T, s3, NULL) == LM_OK, "%s", lm_last_error());
    CHECK(b->batch(b, 5, B, T, s2, NULL) == LM_OK, "%s", lm_last_error());
    CHECK(!memcmp(s1, s2, sizeof s1), "batch 5 differs between two opens (after reading batch 9)");
    CHECK(memcmp(s1, s3, sizeof s1), "batches 5 and 9 are equal");
    int zeros = 1;
    for (int i = 0; i < B * T; i++) zeros &= ans[i] == 0;
    CHECK(zeros, "plain text has no answer positions");
    /* each row is T+1 consecutive tokens of one shard, starting at a multiple of T */
    int ok = 1;
    int64_t base[3] = {0, sizes[0], sizes[0] + sizes[1]};
    for (int j = 0; j < B; j++) {
        int shard;
        int64_t start;
        CHECK(lm_shards_window(a, 5 * B + j, T, &shard, &start) == LM_OK, "%s", lm_last_error());
        ok &= start % T == 0 && start + T < sizes[shard];
        for (int t = 0; t <= T; t++) ok &= s1[j * (T + 1) + t] == base[shard] + start + t;
    }
    CHECK(ok, "rows are not the windows lm_shards_window names");
    /* another seed, another order */
    lm_data_source *c = NULL;
    CHECK(lm_data_open_shards(dir, "train", 0, 8, 0, 1, &c) == LM_OK, "%s", lm_last_error());
    if (c) {
        c->batch(c, 5, B, T, s3, NULL);
        CHECK(memcmp(s1, s3, sizeof s1), "seeds 7 and 8 give the same batch");
    }
    /* a window longer than any shard */
    CHECK(a->batch(a, 0, 1, 5000, s1, NULL) == LM_ERR_ARG && strstr(lm_last_error(), "T + 1 = 5001"),
          "T beyond every shard: %s", lm_last_error());
    lm_data_close(a);
    lm_data_close(b);
    lm_data_close(c);
}

static void test_an_epoch_reads_every_window_once(void) {
    int64_t sizes[3] = {1000, 357, 2048};
    const char *dir = make_position_dir("epoch", sizes);
    lm_data_source *src = NULL;
    CHECK(lm_data_open_shards(dir, "train", 0, 3, 0, 1, &src) == LM_OK, "%s", lm_last_error());
    if (!src) return;
    const int T = 16, B = 5;
    /* windows: floor((n - 1) / T) per shard */
    int64_t W = (999 / T) + (356 / T) + (2047 / T);
    int64_t total = 3405;
    uint8_t *seen = calloc((size_t)total, 1);
    int32_t *seq = malloc((size_t)B * (T + 1) * sizeof *seq);
    int64_t n_batches = (W + B - 1) / B, visited = 0;
    int dup = 0;
    for (int64_t i = 0; i < n_batches; i++) {
        CHECK(src->batch(src, i, B, T, seq, NULL) == LM_OK, "%s", lm_last_error());
        for (int j = 0; j < B && i * B + j < W; j++) {
            int32_t first = seq[j * (T + 1)];
            dup += seen[first];
            seen[first] = 1;
            visited++;
        }
    }
    CHECK(dup == 0 && visited == W, "%d windows read twice in an epoch of %lld", dup, (long long)W);
    /* the next epoch is another order of the same windows */
    int same_order = 0;
    for (int64_t k = 0; k < W; k++) {
        int s0, s1;
        int64_t a0, a1;
        lm_shards_window(src, k, T, &s0, &a0);
        lm_shards_window(src, W + k, T, &s1, &a1);
        same_order += s0 == s1 && a0 == a1;
    }
    CHECK(same_order < W / 4, "epoch 2 repeats epoch 1's order at %d of %lld samples", same_order, (long long)W);
    free(seen);
    free(seq);
    lm_data_close(src);
}

static void test_ranks_read_disjoint_windows(void) {
    int64_t sizes[3] = {1000, 357, 2048};
    const char *dir = make_position_dir("ranks", sizes);
    const int R = 3, B = 2, T = 8;
    int64_t W = 999 / T + 356 / T + 2047 / T;
    int64_t n_batches = W / (R * B); /* whole global batches of the first epoch */
    int *owner = malloc(3405 * sizeof *owner);
    for (int i = 0; i < 3405; i++) owner[i] = -1;
    int32_t seq[2 * 9];
    int clash = 0;
    int64_t got = 0;
    for (int r = 0; r < R; r++) {
        lm_data_source *src = NULL;
        CHECK(lm_data_open_shards(dir, "train", 0, 11, r, R, &src) == LM_OK, "%s", lm_last_error());
        if (!src) return;
        for (int64_t i = 0; i < n_batches; i++) {
            src->batch(src, i, B, T, seq, NULL);
            for (int j = 0; j < B; j++) {
                int32_t first = seq[j * (T + 1)];
                clash += owner[first] >= 0;
                owner[first] = r;
                got++;
            }
        }
        lm_data_close(src);
    }
    CHECK(clash == 0, "%d windows read by two ranks (or twice) in one epoch", clash);
    CHECK(got == n_batches * R * B, "read %lld windows", (long long)got);
    /* rank r of R reads what one rank reads at global batch i * R + r */
    lm_data_source *one = NULL, *r1 = NULL;
    lm_data_open_shards(dir, "train", 0, 11, 0, 1, &one);
    lm_data_open_shards(dir, "train", 0, 11, 1, R, &r1);
    if (one && r1) {
        int32_t a[2 * 9], b[2 * 9];
        one->batch(one, 4 * R + 1, B, T, a, NULL);
        r1->batch(r1, 4, B, T, b, NULL);
        CHECK(!memcmp(a, b, sizeof a), "rank 1's batch 4 is not global batch 4 * R + 1");
    }
    lm_data_close(one);
    lm_data_close(r1);
    lm_data_source *bad = NULL;
    CHECK(lm_data_open_shards(dir, "train", 0, 1, 3, 3, &bad) == LM_ERR_ARG, "rank 3 of 3 accepted");
    free(owner);
}

/* lm_data_rows: a data-parallel rank's rows of a batch alone are those rows of the whole batch,
 * for the shards, every built-in task (with their answer positions), a mix, and a source without
 * the rows method (the whole batch, copied); a range outside the batch is refused by name. */
static lm_status whole_only_batch(lm_data_source *self, int64_t index, int B, int T, int32_t *seq, uint8_t *answer) {
    (void)self;
    for (int b = 0; b < B; b++)
        for (int t = 0; t <= T; t++) seq[(size_t)b * (T + 1) + t] = (int32_t)(index * 1000003 + b * 1009 + t);
    if (answer)
        for (int i = 0; i < B * T; i++) answer[i] = (uint8_t)(i % 3 == 0);
    return LM_OK;
}

static void check_rows(lm_data_source *src, const lm_data_mix *mix, int64_t index, int B, int T, const char *what) {
    int32_t *all = malloc((size_t)B * (T + 1) * sizeof *all), *part = malloc((size_t)B * (T + 1) * sizeof *part);
    uint8_t *ans = malloc((size_t)B * T), *pans = malloc((size_t)B * T);
    lm_status st = mix ? lm_data_mix_batch(mix, index, B, T, all, ans) : src->batch(src, index, B, T, all, ans);
    CHECK(st == LM_OK, "%s: %s", what, lm_last_error());
    int bad = 0, nonzero = 0;
    for (int r0 = 0; r0 < B && !st; r0++)
        for (int n = 1; r0 + n <= B; n++) {
            memset(part, 0x5a, (size_t)B * (T + 1) * sizeof *part);
            memset(pans, 0x5a, (size_t)B * T);
            st = mix ? lm_data_mix_rows(mix, index, B, T, r0, n, part, pans)
                     : lm_data_rows(src, index, B, T, r0, n, part, pans);
            CHECK(st == LM_OK, "%s rows [%d, %d): %s", what, r0, r0 + n, lm_last_error());
            bad += memcmp(part, all + (size_t)r0 * (T + 1), (size_t)n * (T + 1) * sizeof *part) != 0;
            bad += memcmp(pans, ans + (size_t)r0 * T, (size_t)n * T) != 0;
        }
    for (int i = 0; i < B * T; i++) nonzero += ans[i] != 0;
    CHECK(!bad, "%s: %d row ranges differ from the whole batch's rows", what, bad);
    printf("    %s: batch %lld of %d x %d, every row range equal (%d answer positions)\n", what, (long long)index, B,
           T, nonzero);
    free(all);
    free(part);
    free(ans);
    free(pans);
}

static void test_a_ranks_rows_are_those_of_the_whole_batch(void) {
    int64_t sizes[3] = {1000, 357, 2048};
    const char *dir = make_position_dir("rows", sizes);
    lm_data_source *sh = NULL;
    CHECK(lm_data_open_shards(dir, "train", 0, 7, 1, 3, &sh) == LM_OK, "%s", lm_last_error());
    if (sh) check_rows(sh, NULL, 5, 6, 31, "shards (rank 1 of 3)");
    const char *tasks[] = {"copy", "mqar", "passkey"};
    lm_data_source *tk[3] = {NULL, NULL, NULL};
    for (int i = 0; i < 3; i++) {
        CHECK(lm_data_open(tasks[i], 11, &tk[i]) == LM_OK, "%s: %s", tasks[i], lm_last_error());
        if (tk[i]) check_rows(tk[i], NULL, 3, 5, 64, tasks[i]);
    }
    /* a mix: each batch's source by its index, its rows as that source's */
    lm_data_mix mix;
    memset(&mix, 0, sizeof mix);
    mix.n = 2;
    mix.sources[0] = tk[0];
    mix.sources[1] = tk[1];
    mix.weights[0] = 1;
    mix.weights[1] = 2;
    mix.seed = 5;
    if (tk[0] && tk[1])
        for (int64_t i = 0; i < 4; i++) check_rows(NULL, &mix, i, 4, 48, "mix of copy and mqar");
    /* a source without the rows method: the whole batch, copied */
    lm_data_source whole;
    memset(&whole, 0, sizeof whole);
    snprintf(whole.name, sizeof whole.name, "whole-only");
    whole.vocab_size = 1 << 30;
    whole.batch = whole_only_batch;
    check_rows(&whole, NULL, 2, 5, 9, "a source without rows");
    /* ranges outside the batch */
    int32_t seq[64];
    const int r0s[4] = {-1, 3, 0, 2}, ns[4] = {1, 2, 0, 1}, Bs[4] = {4, 4, 4, 2};
    for (int k = 0; k < 4 && sh; k++)
        CHECK(lm_data_rows(sh, 0, Bs[k], 3, r0s[k], ns[k], seq, NULL) == LM_ERR_ARG && strstr(lm_last_error(), "rows ["),
              "rows [%d, %d) of %d accepted: %s", r0s[k], r0s[k] + ns[k], Bs[k], lm_last_error());
    lm_data_close(sh);
    for (int i = 0; i < 3; i++) lm_data_close(tk[i]);
}

static void test_directory_errors_are_clear(void) {
    lm_data_source *src = NULL;
    CHECK(lm_data_open_shards(tmp_path("nowhere"), "train", 0, 1, 0, 1, &src) == LM_ERR_IO &&
              strstr(lm_last_error(), "nowhere"),
          "missing directory: %s", lm_last_error());
    const char *dir = tmp_path("gaps");
    mkdir(dir, 0755);
    CHECK(lm_data_open_shards(dir, "train", 0, 1, 0, 1, &src) == LM_ERR_ARG && strstr(lm_last_error(), "no train shards"),
          "empty directory: %s", lm_last_error());
    int32_t t[100];
    for (int i = 0; i < 100; i++) t[i] = i;
    char p[600];
    snprintf(p, sizeof p, "%s/train_000000.bin", dir);
    lm_shard_write(p, t, 100, 200);
    snprintf(p, sizeof p, "%s/train_000002.bin", dir);
    lm_shard_write(p, t, 100, 200);
    CHECK(lm_data_open_shards(dir, "train", 0, 1, 0, 1, &src) == LM_ERR_FORMAT && strstr(lm_last_error(), "missing"),
          "a gap in the numbering: %s", lm_last_error());
    snprintf(p, sizeof p, "%s/train_000001.bin", dir);
    lm_shard_write(p, t, 100, 300);
    CHECK(lm_data_open_shards(dir, "train", 0, 1, 0, 1, &src) == LM_ERR_FORMAT &&
              strstr(lm_last_error(), "train_000001.bin") && strstr(lm_last_error(), "mixed tokenizers"),
          "mixed vocabularies: %s", lm_last_error());
    CHECK(lm_data_open_shards(dir, "train", 250, 1, 0, 1, &src) == LM_ERR_FORMAT &&
              strstr(lm_last_error(), "train_000001.bin") && strstr(lm_last_error(), "larger than the 250"),
          "a shard for a larger vocabulary: %s", lm_last_error());
    CHECK(lm_data_open_shards(dir, "test", 0, 1, 0, 1, &src) == LM_ERR_ARG, "split 'test' accepted");
    /* the same directory through lm_data_open with the vocabulary a model gives */
    snprintf(p, sizeof p, "%s/train_000001.bin", dir);
    lm_shard_write(p, t, 100, 200);
    char spec[600];
    snprintf(spec, sizeof spec, "shards:%s", dir);
    CHECK(lm_data_open(spec, 5, &src) == LM_OK && src->vocab_size == 200, "%s: %s", spec, lm_last_error());
    lm_data_close(src);
    snprintf(spec, sizeof spec, "shards-val:%s", dir);
    CHECK(lm_data_open(spec, 5, &src) == LM_ERR_ARG && strstr(lm_last_error(), "no val shards"), "%s",
          lm_last_error());
}

static void test_prepare_writes_what_the_tokenizer_encodes(void) {
    /* two documents; a tokenizer trained on them */
    lm_rng r;
    lm_rng_seed(&r, 21);
    static const char *const w[] = {"alpha ", "beta ", "gamma\n", "delta, ", "42 ", "\xc3\xa9t\xc3\xa9 ", "\t"};
    char *doc[2];
    size_t len[2];
    for (int d = 0; d < 2; d++) {
        doc[d] = malloc(40000);
        len[d] = 0;
        while (len[d] < 30000) {
            const char *x = w[lm_rng_u64(&r) % 7];
            memcpy(doc[d] + len[d], x, strlen(x));
            len[d] += strlen(x);
        }
        char name[16];
        snprintf(name, sizeof name, "doc%d.txt", d);
        write_raw(tmp_path(name), NULL, doc[d], len[d]);
    }
    const void *texts[2] = {doc[0], doc[1]};
    lm_tokenizer *tok = NULL;
    CHECK(lm_tokenizer_train(texts, len, 2, 300, 2, &tok) == LM_OK, "%s", lm_last_error());
    if (!tok) return;
    CHECK(lm_tokenizer_save(tok, tmp_path("tok.json")) == LM_OK, "%s", lm_last_error());
    const int V = lm_tokenizer_vocab_size(tok);
    CHECK(V > 270, "the tokenizer learned only %d merges", V - 257);
    char cmd[2048];
    snprintf(cmd, sizeof cmd, "%s data prepare --input %s %s --tokenizer %s --out %s --shard-tokens 2000 "
             "--val-fraction 0.1 > %s",
             LONGMOE_CLI, tmp_path("doc0.txt"), tmp_path("doc1.txt"), tmp_path("tok.json"), tmp_path("prep"),
             tmp_path("prep.out"));
    CHECK(system(cmd) == 0, "data prepare failed");
    /* val then train shards, concatenated, decode to EOT doc0 EOT doc1 */
    int32_t *all = malloc(200000 * sizeof *all);
    int64_t n = 0;
    int n_val = 0, n_train = 0;
    for (int split = 0; split < 2; split++) {
        for (int i = 0;; i++) {
            char p[600];
            snprintf(p, sizeof p, "%s/%s_%06d.bin", tmp_path("prep"), split ? "train" : "val", i);
            if (access(p, F_OK) != 0) break;
            lm_shard s;
            CHECK(lm_shard_open(p, V, &s) == LM_OK, "%s", lm_last_error());
            CHECK(s.token_bytes == 2 && s.n_tokens <= 2000 && s.header_vocab == V, "%s: %d-byte tokens, %lld", p,
                  s.token_bytes, (long long)s.n_tokens);
            for (int64_t k = 0; k < s.n_tokens && n < 200000; k++) all[n++] = lm_shard_token(&s, k);
            lm_shard_close(&s);
            if (split) n_train++;
            else n_val++;
        }
    }
    CHECK(n_val >= 1 && n_train >= 2, "%d val and %d train shards", n_val, n_train);
    char *back;
    size_t blen;
    CHECK(lm_tokenizer_decode(tok, all, (size_t)n, &back, &blen) == LM_OK, "%s", lm_last_error());
    size_t want_len = 13 + len[0] + 13 + len[1];
    char *want = malloc(want_len);
    memcpy(want, LM_TOKENIZER_EOT, 13);
    memcpy(want + 13, doc[0], len[0]);
    memcpy(want + 13 + len[0], LM_TOKENIZER_EOT, 13);
    memcpy(want + 26 + len[0], doc[1], len[1]);
    CHECK(blen == want_len && !memcmp(back, want, want_len), "the shards do not decode to the documents");
    free(back);
    free(want);
    /* the directory's tokenizer is the one given; the source reads it as shards:DIR */
    lm_tokenizer *copy = NULL;
    CHECK(lm_tokenizer_load(tmp_path("prep/tokenizer.json"), &copy) == LM_OK, "%s", lm_last_error());
    lm_tokenizer_free(copy);
    char spec[600];
    lm_data_source *src = NULL;
    snprintf(spec, sizeof spec, "shards-val:%s", tmp_path("prep"));
    CHECK(lm_data_open(spec, 1, &src) == LM_OK && src->vocab_size == V, "%s", lm_last_error());
    lm_data_close(src);
    /* a second prepare into the same directory is refused */
    strcat(cmd, " 2> /dev/null");
    CHECK(system(cmd) != 0, "data prepare overwrote existing shards");
    free(all);
    free(doc[0]);
    free(doc[1]);
    lm_tokenizer_free(tok);
}

int main(void) {
    if (test_make_tmpdir(tmpdir, sizeof tmpdir, "shards")) return 1;
    RUN(test_write_read_roundtrip_uint16_and_uint32);
    RUN(test_bad_shards_are_rejected_naming_file_and_problem);
    RUN(test_shuffle_is_a_bijection_per_epoch);
    RUN(test_batches_are_pure_functions_of_the_index);
    RUN(test_an_epoch_reads_every_window_once);
    RUN(test_ranks_read_disjoint_windows);
    RUN(test_a_ranks_rows_are_those_of_the_whole_batch);
    RUN(test_directory_errors_are_clear);
    RUN(test_prepare_writes_what_the_tokenizer_encodes);
    test_remove_tree(tmpdir);
    return test_summary();
}

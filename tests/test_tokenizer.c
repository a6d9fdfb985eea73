/* Byte-level BPE tokenizer: lossless on any bytes, deterministic training,
 * the encoder equals a naive BPE reference, one strict reader and one writer
 * of the Hugging Face JSON file, and (when Python's `tokenizers` is
 * installed) the same ids as tokenizers.Tokenizer.from_file. */
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

#include "longmoe/tokenizer.h"
#include "test.h"

static char tmpdir[256];

static const char *tmp_path(const char *name) { return test_path(tmpdir, name); }

/* Pseudo-English: words from a fixed list, spaces, punctuation, digits, newlines. */
static char *make_text(uint64_t seed, size_t n, size_t *len) {
    static const char *const words[] = {"the", "of", "and", "to", "in", "is", "that", "for", "it", "as", "with",
                                        "was", "on", "be", "at", "by", "this", "had", "not", "are", "but", "from",
                                        "or", "have", "an", "they", "which", "one", "you", "were", "her", "all",
                                        "she", "there", "would", "their", "we", "him", "been", "has", "when", "who",
                                        "will", "more", "no", "if", "out", "so", "said", "what", "up", "its",
                                        "about", "into", "than", "them", "can", "only", "other", "new", "some",
                                        "could", "time", "these", "two", "may", "then", "do", "first", "any",
                                        "my", "now", "such", "like", "our", "over", "man", "me", "even", "most",
                                        "made", "after", "also", "did", "many", "before", "must", "through",
                                        "back", "years", "where", "much", "your", "way", "well", "down", "should",
                                        "because", "each", "just", "those", "people", "Mr", "how", "too",
                                        "little", "state", "good", "very", "make", "world", "still", "own",
                                        "see", "men", "work", "long", "get", "here", "between", "both", "life",
                                        "being", "under", "never", "day", "same", "another", "know", "while",
                                        "last", "might", "us", "great", "old", "year", "off", "come", "since",
                                        "against", "go", "came", "right", "used", "take", "three", "caf\xc3\xa9",
                                        "na\xc3\xafve", "\xe4\xb8\xad\xe6\x96\x87"};
    const int nw = (int)(sizeof words / sizeof words[0]);
    lm_rng r;
    lm_rng_seed(&r, seed);
    char *t = malloc(n + 64);
    size_t o = 0;
    while (o < n) {
        /* Zipf-like: low indexes are frequent */
        double u = lm_rng_uniform(&r);
        int w = (int)(u * u * u * nw);
        size_t k = strlen(words[w]);
        memcpy(t + o, words[w], k);
        o += k;
        uint64_t x = lm_rng_u64(&r) % 40;
        if (x == 0) t[o++] = '.', t[o++] = '\n';
        else if (x == 1) t[o++] = ',', t[o++] = ' ';
        else if (x == 2) o += (size_t)sprintf(t + o, " %d ", (int)(lm_rng_u64(&r) % 2000));
        else t[o++] = ' ';
    }
    t[o] = 0;
    *len = o;
    return t;
}

static lm_tokenizer *train_on(uint64_t seed, size_t n, int vocab) {
    size_t len;
    char *text = make_text(seed, n, &len);
    const void *texts[1] = {text};
    lm_tokenizer *tok = NULL;
    lm_status s = lm_tokenizer_train(texts, &len, 1, vocab, 2, &tok);
    CHECK(s == LM_OK, "training failed: %s", lm_last_error());
    free(text);
    return tok;
}

static void fill_random_bytes(lm_rng *r, uint8_t *b, size_t n) {
    for (size_t i = 0; i < n; i++) {
        uint64_t x = lm_rng_u64(r);
        /* a mix of uniform bytes, ASCII text bytes, spaces and NULs */
        switch (x % 4) {
        case 0: b[i] = (uint8_t)(x >> 8); break;
        case 1: b[i] = (uint8_t)('a' + (x >> 8) % 26); break;
        case 2: b[i] = " \t\n\r\x0b\x0c"[(x >> 8) % 6]; break;
        default: b[i] = (uint8_t)((x >> 8) % 3 == 0 ? 0 : 0x80 + (x >> 16) % 128); break;
        }
    }
}

static void test_roundtrip_on_random_bytes(void) {
    lm_tokenizer *tok = train_on(1, 60000, 600);
    if (!tok) return;
    lm_rng r;
    lm_rng_seed(&r, 11);
    int V = lm_tokenizer_vocab_size(tok);
    for (int trial = 0; trial < 60; trial++) {
        size_t n = (size_t)(lm_rng_u64(&r) % 3000);
        uint8_t *b = malloc(n + 32);
        fill_random_bytes(&r, b, n);
        /* sometimes an end-of-text marker, whole or cut */
        if (trial % 3 == 0 && n > 40) memcpy(b + n / 2, LM_TOKENIZER_EOT, trial % 2 ? 13 : 9);
        int32_t *ids;
        size_t n_ids;
        char *back;
        size_t blen;
        CHECK(lm_tokenizer_encode(tok, b, n, &ids, &n_ids) == LM_OK, "%s", lm_last_error());
        int in_range = 1;
        for (size_t i = 0; i < n_ids; i++) in_range &= ids[i] >= 0 && ids[i] < V;
        CHECK(in_range, "trial %d: an id outside [0, %d)", trial, V);
        CHECK(lm_tokenizer_decode(tok, ids, n_ids, &back, &blen) == LM_OK, "%s", lm_last_error());
        CHECK(blen == n && !memcmp(back, b, n), "trial %d: %zu bytes decode to %zu different bytes", trial, n, blen);
        free(ids);
        free(back);
        free(b);
    }
    /* every single byte value, and the empty input */
    uint8_t all[256];
    for (int i = 0; i < 256; i++) all[i] = (uint8_t)(255 - i);
    int32_t *ids;
    size_t n_ids, blen;
    char *back;
    CHECK(lm_tokenizer_encode(tok, all, 256, &ids, &n_ids) == LM_OK, "%s", lm_last_error());
    CHECK(lm_tokenizer_decode(tok, ids, n_ids, &back, &blen) == LM_OK && blen == 256 && !memcmp(back, all, 256),
          "the 256 byte values do not round-trip");
    free(ids);
    free(back);
    CHECK(lm_tokenizer_encode(tok, "", 0, &ids, &n_ids) == LM_OK && n_ids == 0, "empty input gives %zu ids", n_ids);
    free(ids);
    int32_t bad[2] = {5, V};
    CHECK(lm_tokenizer_decode(tok, bad, 2, &back, &blen) == LM_ERR_ARG && strstr(lm_last_error(), "id"),
          "an id past the vocabulary must be refused: %s", lm_last_error());
    lm_tokenizer_free(tok);
}

/* Chunks of "s" as '|'-joined text. */
static void chunks_of(const char *s, char *out) {
    size_t n = strlen(s), i = 0, o = 0;
    while (i < n) {
        size_t j = lm_pretokenize_next((const uint8_t *)s, n, i);
        if (o) out[o++] = '|';
        memcpy(out + o, s + i, j - i);
        o += j - i;
        i = j;
    }
    out[o] = 0;
}

static void test_pretokenizer_splits_like_its_regex(void) {
    static const char *const cases[][2] = {
        {"Hello world", "Hello| world"},
        {"Hello  world", "Hello| | world"},
        {"a   b", "a|  | b"},
        {"x\n\ny", "x|\n|\n|y"},
        {"x\n\n y", "x|\n\n| y"},
        {"end.  ", "end|.|  "},
        {"price: 1234$!", "price|:| 1234|$!"},
        {" caf\xc3\xa9s 12", " caf\xc3\xa9s| 12"},
        {"\ttab", "\t|tab"},
        {"a\t b", "a|\t| b"},
        {"don't", "don|'|t"},
        {"  ", "  "},
        {"x ", "x| "},
    };
    for (size_t c = 0; c < sizeof cases / sizeof cases[0]; c++) {
        char got[128];
        chunks_of(cases[c][0], got);
        CHECK(!strcmp(got, cases[c][1]), "'%s' splits into '%s', want '%s'", cases[c][0], got, cases[c][1]);
    }
    /* runs stop at 32 characters (UTF-8 characters for letters) */
    char in[256], want[300], got[300];
    memset(in, 'a', 70);
    in[70] = 0;
    snprintf(want, sizeof want, "%.32s|%.32s|%.6s", in, in, in);
    chunks_of(in, got);
    CHECK(!strcmp(got, want), "70 letters split into '%s'", got);
    memset(in, ' ', 40);
    snprintf(in + 40, 3, "x");
    snprintf(want, sizeof want, "%.32s|%.7s| x", in, in);
    chunks_of(in, got);
    CHECK(!strcmp(got, want), "40 spaces and x split into '%s'", got);
    for (int i = 0; i < 40; i++) memcpy(in + 3 * i, "\xe4\xb8\xad", 3);
    in[120] = 0;
    snprintf(want, sizeof want, "%.96s|%.24s", in, in);
    chunks_of(in, got);
    CHECK(!strcmp(got, want), "40 CJK characters: chunks of %zu and %zu bytes", strcspn(got, "|"),
          strlen(got) - strcspn(got, "|") - 1);
    /* the chunks tile any input: contiguous, non-empty, within bounds, at
     * most 1 + 4 * 32 bytes */
    lm_rng r;
    lm_rng_seed(&r, 5);
    uint8_t b[500];
    int ok = 1;
    for (int t = 0; t < 50; t++) {
        fill_random_bytes(&r, b, sizeof b);
        for (size_t i = 0; i < sizeof b;) {
            size_t j = lm_pretokenize_next(b, sizeof b, i);
            ok &= j > i && j <= sizeof b && j - i <= 1 + 4 * LM_PRETOKENIZE_MAX_RUN;
            i = j > i ? j : sizeof b;
        }
    }
    CHECK(ok, "a chunk was empty or ran past the input");
}

/* The definition of BPE encoding: per chunk, merge the lowest-rank adjacent
 * pair (the leftmost of equal ranks) until none has a merge. O(n^2). */
static size_t reference_encode(const lm_tokenizer *tok, const uint8_t *s, size_t n, int32_t *out) {
    int M = lm_tokenizer_vocab_size(tok) - 257;
    int32_t *ml = malloc(((size_t)M + 1) * sizeof *ml), *mr = malloc(((size_t)M + 1) * sizeof *mr);
    for (int k = 0; k < M; k++) lm_tokenizer_merge(tok, k, &ml[k], &mr[k]);
    size_t o = 0;
    for (size_t i = 0; i < n;) {
        size_t j = lm_pretokenize_next(s, n, i), m = j - i;
        int32_t *sym = out + o;
        for (size_t q = 0; q < m; q++) sym[q] = s[i + q];
        for (;;) {
            int best = -1;
            size_t at = 0;
            for (size_t q = 0; q + 1 < m; q++)
                for (int k = 0; k < M; k++)
                    if (ml[k] == sym[q] && mr[k] == sym[q + 1] && (best < 0 || k < best)) best = k, at = q;
            if (best < 0) break;
            sym[at] = 256 + best;
            memmove(sym + at + 1, sym + at + 2, (m - at - 2) * sizeof *sym);
            m--;
        }
        o += m;
        i = j;
    }
    free(ml);
    free(mr);
    return o;
}

static void test_encoder_equals_reference_bpe(void) {
    lm_tokenizer *tok = train_on(2, 30000, 400);
    if (!tok) return;
    size_t len;
    char *text = make_text(77, 4000, &len); /* unseen text of the same kind */
    int32_t *ids, *ref = malloc(len * sizeof *ref);
    size_t n_ids;
    CHECK(lm_tokenizer_encode(tok, text, len, &ids, &n_ids) == LM_OK, "%s", lm_last_error());
    size_t n_ref = reference_encode(tok, (const uint8_t *)text, len, ref);
    CHECK(n_ids == n_ref && !memcmp(ids, ref, n_ref * sizeof *ref), "encoder gives %zu ids, reference %zu (or differ)",
          n_ids, n_ref);
    /* a long chunk (one word of 2000 letters) through the heap path */
    lm_rng r;
    lm_rng_seed(&r, 9);
    char *word = malloc(2001);
    /* letters and 3-byte characters: chunks of 32 characters, up to 96 bytes (past the cache) */
    for (int i = 0; i < 2000;) {
        if (lm_rng_u64(&r) % 3 == 0 && i + 3 <= 2000) {
            memcpy(word + i, "\xe4\xb8\xad", 3);
            i += 3;
        } else {
            word[i++] = "theandofin"[lm_rng_u64(&r) % 10];
        }
    }
    free(ids);
    CHECK(lm_tokenizer_encode(tok, word, 2000, &ids, &n_ids) == LM_OK, "%s", lm_last_error());
    n_ref = reference_encode(tok, (const uint8_t *)word, 2000, ref);
    CHECK(n_ids == n_ref && !memcmp(ids, ref, n_ref * sizeof *ref), "long chunk: %zu ids vs reference %zu", n_ids,
          n_ref);
    free(word);
    free(ids);
    free(ref);
    free(text);
    lm_tokenizer_free(tok);
}

static void test_training_is_deterministic(void) {
    lm_tokenizer *a = train_on(3, 40000, 500), *b = train_on(3, 40000, 500), *c = train_on(4, 40000, 500);
    if (!a || !b || !c) return;
    char *ja, *jb, *jc;
    size_t la, lb, lc;
    lm_tokenizer_to_json(a, &ja, &la);
    lm_tokenizer_to_json(b, &jb, &lb);
    lm_tokenizer_to_json(c, &jc, &lc);
    CHECK(la == lb && !memcmp(ja, jb, la), "two trainings on the same text differ");
    CHECK(la != lc || memcmp(ja, jc, la), "trainings on different texts are identical");
    free(ja);
    free(jb);
    free(jc);
    lm_tokenizer_free(a);
    lm_tokenizer_free(b);
    lm_tokenizer_free(c);
}

static void test_merges_follow_pair_frequency_and_compress(void) {
    size_t len;
    char *text = make_text(6, 50000, &len);
    const void *texts[1] = {text};
    lm_tokenizer *tok = NULL;
    CHECK(lm_tokenizer_train(texts, &len, 1, 600, 2, &tok) == LM_OK, "%s", lm_last_error());
    if (!tok) return;
    /* the first merge is the most frequent byte pair inside chunks (ties: smaller ids) */
    static int64_t count[256][256];
    memset(count, 0, sizeof count);
    const uint8_t *s = (const uint8_t *)text;
    for (size_t i = 0; i < len;) {
        size_t j = lm_pretokenize_next(s, len, i);
        for (size_t q = i; q + 1 < j; q++) count[s[q]][s[q + 1]]++;
        i = j;
    }
    int ba = 0, bb = 0;
    for (int x = 0; x < 256; x++)
        for (int y = 0; y < 256; y++)
            if (count[x][y] > count[ba][bb]) ba = x, bb = y;
    int32_t l, r;
    CHECK(lm_tokenizer_merge(tok, 0, &l, &r) == LM_OK && l == ba && r == bb,
          "first merge (%d, %d), most frequent pair (%d, %d) x%lld", l, r, ba, bb, (long long)count[ba][bb]);
    /* merges shorten the text: bytes per token well above 1 */
    int32_t *ids;
    size_t n_ids;
    CHECK(lm_tokenizer_encode(tok, text, len, &ids, &n_ids) == LM_OK, "%s", lm_last_error());
    double bpt = (double)len / (double)n_ids;
    CHECK(bpt > 3.0, "%.2f bytes per token after 343 merges (want > 3)", bpt);
    CHECK(lm_tokenizer_vocab_size(tok) == 600, "vocab %d, asked 600", lm_tokenizer_vocab_size(tok));
    /* a tiny text runs out of pairs: the vocabulary stops short of the request */
    lm_tokenizer *small = NULL;
    const char *tiny = "abab abab";
    size_t tl = strlen(tiny);
    const void *tt[1] = {tiny};
    CHECK(lm_tokenizer_train(tt, &tl, 1, 1000, 2, &small) == LM_OK, "%s", lm_last_error());
    CHECK(small && lm_tokenizer_vocab_size(small) < 1000 && lm_tokenizer_vocab_size(small) > 257,
          "tiny text: vocab %d", small ? lm_tokenizer_vocab_size(small) : -1);
    lm_tokenizer_free(small);
    CHECK(lm_tokenizer_train(tt, &tl, 1, 256, 2, &small) == LM_ERR_ARG && !small, "vocab 256 (no end-of-text) accepted");
    free(ids);
    free(text);
    lm_tokenizer_free(tok);
}

static void test_end_of_text_is_one_token(void) {
    lm_tokenizer *tok = train_on(7, 20000, 300);
    if (!tok) return;
    const char *s = "one<|endoftext|>two<|endoftext|><|endoftext";
    int32_t *ids;
    size_t n_ids, blen;
    char *back;
    CHECK(lm_tokenizer_encode(tok, s, strlen(s), &ids, &n_ids) == LM_OK, "%s", lm_last_error());
    int eot = lm_tokenizer_eot_id(tok), n_eot = 0;
    for (size_t i = 0; i < n_ids; i++) n_eot += ids[i] == eot;
    CHECK(n_eot == 2, "%d end-of-text ids, want 2 (the third marker is cut)", n_eot);
    CHECK(lm_tokenizer_decode(tok, ids, n_ids, &back, &blen) == LM_OK && blen == strlen(s) && !strcmp(back, s),
          "markers do not round-trip");
    free(ids);
    free(back);
    lm_tokenizer_free(tok);
}

static void test_file_roundtrip_one_reader_one_writer(void) {
    lm_tokenizer *tok = train_on(8, 30000, 700);
    if (!tok) return;
    CHECK(lm_tokenizer_save(tok, tmp_path("tok.json")) == LM_OK, "%s", lm_last_error());
    lm_tokenizer *back = NULL;
    CHECK(lm_tokenizer_load(tmp_path("tok.json"), &back) == LM_OK, "%s", lm_last_error());
    if (!back) return;
    char *j1, *j2;
    size_t l1, l2;
    lm_tokenizer_to_json(tok, &j1, &l1);
    lm_tokenizer_to_json(back, &j2, &l2);
    CHECK(l1 == l2 && !memcmp(j1, j2, l1), "load(save(t)) writes a different file");
    size_t len;
    char *text = make_text(99, 5000, &len);
    int32_t *a, *b;
    size_t na, nb;
    lm_tokenizer_encode(tok, text, len, &a, &na);
    lm_tokenizer_encode(back, text, len, &b, &nb);
    CHECK(na == nb && !memcmp(a, b, na * sizeof *a), "the loaded tokenizer encodes differently");
    free(a);
    free(b);
    free(text);
    free(j1);
    free(j2);
    lm_tokenizer_free(back);
    lm_tokenizer_free(tok);
}

/* The JSON with the first occurrence of `from` replaced by `to`. */
static char *replaced(const char *json, const char *from, const char *to) {
    const char *p = strstr(json, from);
    if (!p) return NULL;
    size_t a = (size_t)(p - json), lf = strlen(from), lt = strlen(to), n = strlen(json);
    char *out = malloc(n - lf + lt + 1);
    memcpy(out, json, a);
    memcpy(out + a, to, lt);
    memcpy(out + a + lt, p + lf, n - a - lf + 1);
    return out;
}

static void test_malformed_files_are_rejected(void) {
    lm_tokenizer *tok = train_on(9, 20000, 300);
    if (!tok) return;
    char *json;
    size_t len;
    lm_tokenizer_to_json(tok, &json, &len);
    /* the first two merges as written, to swap them */
    const char *m = strstr(json, "\"merges\": [\n");
    char first[64] = {0}, second[64] = {0};
    if (m) {
        m = strchr(m, '\n') + 1;
        const char *e1 = strchr(m, '\n');
        const char *e2 = strchr(e1 + 1, '\n');
        memcpy(first, m, (size_t)(e1 - m));
        memcpy(second, e1 + 1, (size_t)(e2 - e1 - 1));
    }
    char swapped[160];
    snprintf(swapped, sizeof swapped, "%s\n%s", first, second);
    char swapped_to[160];
    snprintf(swapped_to, sizeof swapped_to, "%s\n%s", second, first);
    static const char *const cases[][3] = {
        {"\"type\": \"BPE\"", "\"type\": \"WordPiece\"", "model.type must be \"BPE\""},
        {"\"use_regex\": false}\n  ]}", "\"use_regex\": true}\n  ]}", "use_regex must be false"},
        {"0-9]{1,32}|", "0-9]{1,33}|", "Split pattern"},
        {"\"normalizer\": null", "\"normalizer\": {\"type\": \"NFC\"}", "normalizer must be null"},
        {"\"padding\": null", "\"padding\": null, \"extra\": 1", "unexpected key \"extra\""},
        {"\"dropout\": null", "\"dropout\": 0.1", "dropout must be null"},
        {"\"byte_fallback\": false", "\"byte_fallback\": true", "byte_fallback must be false"},
        {"\"\xc4\x80\": 0,", "\"\xc4\x80\": 1,", "id 1 is given to both"},
        {"\"\xc4\x80\": 0,", "\"\xc4\x80\": 0.5,", "must be an integer id"},
        {"\"\xc4\x80\": 0,", "\"\xc4\x80\": 300,", "must be an integer id in [0, 300)"},
        {"\"\xc4\x80\": 0,", "\"not-a-byte\": 0,", "id 0 must be the byte-level character of byte 0x00"},
        {"\"<|endoftext|>\": 299", "\"<|endoftext|>x\": 299", "the last id 299 must be <|endoftext|>"},
        {"{\"id\": 299", "{\"id\": 298", "added_tokens[0].id must be 299"},
        {"\"special\": true", "\"special\": false", "special must be true"},
        {"\"merges\": [\n", "\"merges\": [\n      \"a b\",\n", "model.merges has 44 entries but the vocabulary"},
        {"\"version\": \"1.0\"", "\"version\": \"2.0\"", "version must be \"1.0\""},
        {"\"model\": {", "\"modle\": {", "unexpected key \"modle\""},
    };
    for (size_t c = 0; c < sizeof cases / sizeof cases[0]; c++) {
        char *bad = replaced(json, cases[c][0], cases[c][1]);
        CHECK(bad != NULL, "case %zu: '%s' not found in the JSON", c, cases[c][0]);
        if (!bad) continue;
        lm_tokenizer *t = NULL;
        lm_status s = lm_tokenizer_parse(bad, strlen(bad), "bad.json", &t);
        const char *e = lm_last_error();
        CHECK(s == LM_ERR_FORMAT && t == NULL, "case %zu (%s) accepted", c, cases[c][2]);
        CHECK(strstr(e, "bad.json") && strstr(e, cases[c][2]), "case %zu: message '%s' lacks '%s' or the file name",
              c, e, cases[c][2]);
        lm_tokenizer_free(t);
        free(bad);
    }
    /* merge order matters: merge 0 produces id 256, merge 1 id 257 */
    char *bad = replaced(json, swapped, swapped_to);
    CHECK(bad != NULL, "could not swap the first two merges");
    if (bad) {
        lm_tokenizer *t = NULL;
        CHECK(lm_tokenizer_parse(bad, strlen(bad), "bad.json", &t) == LM_ERR_FORMAT &&
                  strstr(lm_last_error(), "merges[0]"),
              "swapped merges accepted or message unclear: %s", lm_last_error());
        free(bad);
    }
    /* truncated files at many points: refused, never a crash */
    int refused = 1;
    for (size_t cut = 0; cut < len; cut += len / 97 + 1) {
        lm_tokenizer *t = NULL;
        lm_status s = lm_tokenizer_parse(json, cut, "cut.json", &t);
        refused &= s == LM_ERR_FORMAT && strstr(lm_last_error(), "cut.json") != NULL;
        lm_tokenizer_free(t);
    }
    CHECK(refused, "a truncated file was accepted (or its message lacks the file name)");
    /* random byte flips: accepted only if the result is still a valid tokenizer */
    lm_rng r;
    lm_rng_seed(&r, 12);
    int n_ok = 0, consistent = 1;
    char *copy = malloc(len + 1);
    for (int t = 0; t < 200; t++) {
        memcpy(copy, json, len + 1);
        for (int f = 0; f < 1 + t % 3; f++) copy[lm_rng_u64(&r) % len] = (char)(lm_rng_u64(&r) & 0xff);
        lm_tokenizer *x = NULL;
        if (lm_tokenizer_parse(copy, len, "fuzz.json", &x) == LM_OK) {
            n_ok++;
            int32_t *ids;
            size_t n, bl;
            char *back;
            const char *probe = "the quick brown fox 123";
            consistent &= lm_tokenizer_encode(x, probe, strlen(probe), &ids, &n) == LM_OK &&
                           lm_tokenizer_decode(x, ids, n, &back, &bl) == LM_OK && bl == strlen(probe) &&
                           !memcmp(back, probe, bl);
            free(ids);
            free(back);
        }
        lm_tokenizer_free(x);
    }
    CHECK(consistent, "a fuzzed file was accepted but does not round-trip");
    CHECK(n_ok < 200, "all 200 fuzzed files were accepted");
    free(copy);
    lm_tokenizer *t = NULL;
    CHECK(lm_tokenizer_load(tmp_path("missing.json"), &t) == LM_ERR_IO && strstr(lm_last_error(), "missing.json"),
          "a missing file: %s", lm_last_error());
    free(json);
    lm_tokenizer_free(tok);
}

static void write_file(const char *path, const void *p, size_t n) {
    FILE *f = fopen(path, "wb");
    CHECK(f != NULL, "cannot write %s", path);
    if (!f) return;
    fwrite(p, 1, n, f);
    fclose(f);
}

/* Random valid UTF-8: ASCII of every class, NUL, controls, Latin, CJK,
 * emoji, Unicode spaces (which are not whitespace to the pre-tokenizer),
 * end-of-text markers. */
static size_t random_unicode(lm_rng *r, char *out, size_t n_pieces) {
    static const char *const pieces[] = {"a", "Z", "the", " the", "ing", " ", "  ", "\t", "\n", "\x0b", "\x0c", "\r",
                                         "\r\n", "1", "42", "2024", ".", "!", "\"", "\\", "'s", "<|endoftext|>",
                                         "<|end", "\x7f", "\x1f", "\xc3\xa9", "\xe4\xb8\xad", "\xf0\x9f\x98\x80",
                                         "\xc2\xa0", "\xe2\x80\xa8", "\xe3\x80\x80", "\xc2\x85", "\xcc\x81",
                                         /* runs longer than the 32-character limit */
                                         "abcdefghijklmnopqrstuvwxyzabcdefghijklmn",
                                         "                                        ",
                                         "\xe4\xb8\xad\xe6\x96\x87\xe4\xb8\xad\xe6\x96\x87\xe4\xb8\xad\xe6\x96\x87"
                                         "\xe4\xb8\xad\xe6\x96\x87\xe4\xb8\xad\xe6\x96\x87\xe4\xb8\xad\xe6\x96\x87",
                                         "........................................",
                                         "1234567890123456789012345678901234567890"};
    const size_t np = sizeof pieces / sizeof pieces[0];
    size_t o = 0;
    for (size_t i = 0; i < n_pieces; i++) {
        uint64_t x = lm_rng_u64(r);
        if (x % 50 == 0) {
            out[o++] = 0; /* NUL is valid UTF-8 */
            continue;
        }
        const char *p = pieces[(x >> 8) % np];
        size_t k = strlen(p);
        memcpy(out + o, p, k);
        o += k;
    }
    return o;
}

static void test_python_tokenizers_gives_the_same_ids(void) {
    if (system("python3 -c 'import tokenizers' > /dev/null 2>&1") != 0) SKIP("python tokenizers not installed");
    lm_tokenizer *tok = train_on(10, 200000, 2000);
    if (!tok) return;
    CHECK(lm_tokenizer_save(tok, tmp_path("interop.json")) == LM_OK, "%s", lm_last_error());
    char cmd[8192];
    /* the script beside this file (ctest runs in the source root; this also works elsewhere) */
    char script[1024];
    snprintf(script, sizeof script, "%s", __FILE__);
    char *slash = strrchr(script, '/');
    if (slash) snprintf(slash + 1, sizeof script - (size_t)(slash + 1 - script), "interop/check_tokenizer.py");
    else snprintf(script, sizeof script, "interop/check_tokenizer.py");
    if (access(script, R_OK) != 0) snprintf(script, sizeof script, "tests/interop/check_tokenizer.py");
    int o = snprintf(cmd, sizeof cmd, "python3 %s %s", script, tmp_path("interop.json"));
    lm_rng r;
    lm_rng_seed(&r, 13);
    char *text = malloc(41 * 4000 + 100000);
    for (int t = 0; t < 12; t++) {
        size_t n;
        if (t < 10) {
            n = random_unicode(&r, text, (size_t)(lm_rng_u64(&r) % 4000));
        } else {
            char *e = make_text(200 + (uint64_t)t, 50000, &n);
            memcpy(text, e, n);
            free(e);
        }
        char tn[32], in[32];
        snprintf(tn, sizeof tn, "text%d.txt", t);
        snprintf(in, sizeof in, "text%d.ids", t);
        write_file(tmp_path(tn), text, n);
        int32_t *ids;
        size_t n_ids;
        CHECK(lm_tokenizer_encode(tok, text, n, &ids, &n_ids) == LM_OK, "%s", lm_last_error());
        FILE *f = fopen(tmp_path(in), "w");
        for (size_t i = 0; f && i < n_ids; i++) fprintf(f, "%d\n", (int)ids[i]);
        if (f) fclose(f);
        free(ids);
        o += snprintf(cmd + o, sizeof cmd - (size_t)o, " %s %s", tmp_path(tn), tmp_path(in));
    }
    free(text);
    int rc = system(cmd);
    CHECK(rc == 0, "tokenizers.Tokenizer.from_file gives different ids (exit %d; see above)", rc);
    lm_tokenizer_free(tok);
}

static void test_cli_train_encode_decode(void) {
    size_t len;
    char *text = make_text(14, 20000, &len);
    write_file(tmp_path("corpus.txt"), text, len);
    char cmd[2048];
    snprintf(cmd, sizeof cmd, "%s tokenizer train --input %s --vocab 400 --out %s > %s", LONGMOE_CLI,
             tmp_path("corpus.txt"), tmp_path("cli.json"), tmp_path("train.out"));
    CHECK(system(cmd) == 0, "tokenizer train failed");
    snprintf(cmd, sizeof cmd, "%s tokenizer encode --tokenizer %s --input %s > %s && %s tokenizer decode --tokenizer %s "
             "--input %s > %s && cmp -s %s %s",
             LONGMOE_CLI, tmp_path("cli.json"), tmp_path("corpus.txt"), tmp_path("ids.txt"), LONGMOE_CLI,
             tmp_path("cli.json"), tmp_path("ids.txt"), tmp_path("back.txt"), tmp_path("corpus.txt"),
             tmp_path("back.txt"));
    CHECK(system(cmd) == 0, "CLI encode | decode does not give the corpus back");
    snprintf(cmd, sizeof cmd, "%s tokenizer train --input %s --vocab 10 --out %s 2> /dev/null", LONGMOE_CLI,
             tmp_path("corpus.txt"), tmp_path("x.json"));
    CHECK(system(cmd) != 0, "vocab 10 accepted by the CLI");
    free(text);
}

int main(void) {
    if (test_make_tmpdir(tmpdir, sizeof tmpdir, "tokenizer")) return 1;
    RUN(test_roundtrip_on_random_bytes);
    RUN(test_pretokenizer_splits_like_its_regex);
    RUN(test_encoder_equals_reference_bpe);
    RUN(test_training_is_deterministic);
    RUN(test_merges_follow_pair_frequency_and_compress);
    RUN(test_end_of_text_is_one_token);
    RUN(test_file_roundtrip_one_reader_one_writer);
    RUN(test_malformed_files_are_rejected);
    RUN(test_python_tokenizers_gives_the_same_ids);
    RUN(test_cli_train_encode_decode);
    test_remove_tree(tmpdir);
    return test_summary();
}

/* Built-in synthetic tasks (include/longmoe/tasks.h, formats in docs/eval.md). */
#include "longmoe/tasks.h"

#include <math.h>
#include <string.h>

#include "longmoe/core.h"

/* An independent stream per (seed, batch, row): mixing the three through splitmix. */
static void row_rng(lm_rng *r, uint64_t seed, int64_t batch, int row) {
    lm_rng_seed(r, seed ^ (0x9e3779b97f4a7c15ull * (uint64_t)(batch + 1)) ^ ((uint64_t)row << 40));
}

/* Seeds of the other tasks' rows differ from copy's, so one seed gives unrelated tasks. */
#define MQAR_SALT 0x6d71617200000001ull
#define PASSKEY_SALT 0x706b657900000002ull
#define VCOPY_SALT 0x76636f7000000003ull
#define MIX_SALT 0x6d69780000000004ull

static void copy_row(lm_rng *r, int T, int32_t *seq, uint8_t *answer) {
    int n = 0;
    char payload[16];
    while (n < T + 1) {
        int len = 4 + (int)(lm_rng_u64(r) % 13);
        for (int i = 0; i < len; i++) payload[i] = (char)('a' + lm_rng_u64(r) % 26);
        /* first copy, separator, second copy, newline */
        for (int i = 0; i < len && n < T + 1; i++) seq[n++] = payload[i];
        if (n < T + 1) seq[n++] = '|';
        for (int i = 0; i < len && n < T + 1; i++) {
            if (answer && n >= 1) answer[n - 1] = 1;
            seq[n++] = payload[i];
        }
        if (n < T + 1) {
            if (answer && n >= 1) answer[n - 1] = 1;
            seq[n++] = '\n';
        }
    }
}

/* ---- a row being written: T + 1 tokens, truncated at the end ---- */

typedef struct {
    int32_t *seq;   /* [cap] */
    uint8_t *answer; /* [cap - 1] or NULL */
    int n, cap;
} row_writer;

static void put(row_writer *w, int byte, int is_answer) {
    if (w->n >= w->cap) return;
    /* input n-1 predicts token n: its target is determined */
    if (is_answer && w->answer && w->n >= 1) w->answer[w->n - 1] = 1;
    w->seq[w->n++] = byte;
}

static void put_text(row_writer *w, const char *s, int is_answer) {
    for (; *s; s++) put(w, (unsigned char)*s, is_answer);
}

static int full(const row_writer *w) { return w->n >= w->cap; }

/* Filler sentences: lowercase, each < 40 bytes, no digits, none of ':?[]=|'. */
static const char *const filler_sentences[] = {
    "the river runs past the old mill. ",
    "a cat sleeps in the warm sun. ",
    "rain fell on the quiet town. ",
    "the road goes on over the hill. ",
    "birds sing at the break of day. ",
    "the market opens early on monday. ",
    "snow covers the fields in winter. ",
    "a boat drifts along the calm lake. ",
};
#define N_FILLER ((int)(sizeof filler_sentences / sizeof filler_sentences[0]))

static const char *pick_sentence(lm_rng *r) { return filler_sentences[lm_rng_u64(r) % N_FILLER]; }

/* Write `g` filler bytes: whole sentences, the last one cut. `first` (may be
 * NULL) is the stream's next sentence, already drawn. */
static void filler(lm_rng *r, row_writer *w, int64_t g, const char *first) {
    const char *s = first ? first : pick_sentence(r);
    for (int64_t k = 0; k < g && !full(w);) {
        for (const char *c = s; *c && k < g; c++, k++) put(w, (unsigned char)*c, 0);
        if (k < g) s = pick_sentence(r);
    }
}

/* ---- MQAR ---- */

#define MQAR_KEY_SPACE (26 * 26 * 26)

/* One block: p pairs "kkk:dd ", g filler bytes, q queries "kkk?dd" of distinct
 * keys of the block joined by ' ' and ended by '\n'. 7 (p + q) + g bytes. */
static void mqar_block(lm_rng *r, row_writer *w, int p, int q, int64_t g) {
    static const int max = LM_MQAR_MAX_PAIRS;
    uint16_t keys[LM_MQAR_MAX_PAIRS], order[LM_MQAR_MAX_PAIRS];
    uint8_t values[LM_MQAR_MAX_PAIRS];
    uint64_t used[(MQAR_KEY_SPACE + 63) / 64];
    if (p > max) p = max;
    if (q > p) q = p;
    memset(used, 0, sizeof used);
    /* distinct keys by rejection (p is at most 47% of the key space: a few draws a key) */
    for (int i = 0; i < p; i++) {
        uint16_t k;
        do k = (uint16_t)(lm_rng_u64(r) % MQAR_KEY_SPACE);
        while (used[k >> 6] >> (k & 63) & 1);
        used[k >> 6] |= 1ull << (k & 63);
        keys[i] = k;
        values[i] = (uint8_t)(lm_rng_u64(r) % 100);
        order[i] = (uint16_t)i;
    }
    for (int i = 0; i < p && !full(w); i++) {
        put(w, 'a' + keys[i] / 676, 0);
        put(w, 'a' + keys[i] / 26 % 26, 0);
        put(w, 'a' + keys[i] % 26, 0);
        put(w, ':', 0);
        put(w, '0' + values[i] / 10, 0);
        put(w, '0' + values[i] % 10, 0);
        put(w, ' ', 0);
    }
    filler(r, w, g, NULL);
    /* queries: the first q of a random permutation of the pairs */
    for (int i = 0; i < q && !full(w); i++) {
        int j = i + (int)(lm_rng_u64(r) % (uint64_t)(p - i));
        uint16_t t = order[i];
        order[i] = order[j];
        order[j] = t;
        int k = keys[order[i]], v = values[order[i]];
        put(w, 'a' + k / 676, 0);
        put(w, 'a' + k / 26 % 26, 0);
        put(w, 'a' + k % 26, 0);
        put(w, '?', 0);
        put(w, '0' + v / 10, 1);
        put(w, '0' + v % 10, 1);
        put(w, i + 1 < q ? ' ' : '\n', 0);
    }
}

static void mqar_row(lm_rng *r, row_writer *w, int T) {
    int P = T / 32 < 1 ? 1 : (T / 32 > 128 ? 128 : T / 32);
    int64_t G = T / 8;
    while (!full(w)) {
        int p = 1 + (int)(lm_rng_u64(r) % (uint64_t)P);
        int64_t g = (int64_t)(lm_rng_u64(r) % (uint64_t)(G + 1));
        mqar_block(r, w, p, p, g);
    }
}

/* ---- passkey ---- */

static void passkey_row(lm_rng *r, row_writer *w, double depth) {
    char digits[6];
    for (int i = 0; i < 5; i++) digits[i] = (char)('0' + lm_rng_u64(r) % 10);
    digits[5] = 0;
    int64_t F = (int64_t)w->cap - LM_PASSKEY_NEEDLE_BYTES - LM_PASSKEY_QUESTION_BYTES;
    const char *next = NULL;
    if (F >= 0) {
        /* the needle goes at the last sentence boundary at or before depth * F */
        int64_t target = llround(depth * (double)F), pos = 0;
        for (;;) {
            next = pick_sentence(r);
            int64_t len = (int64_t)strlen(next);
            if (pos + len > target) break;
            put_text(w, next, 0);
            pos += len;
        }
        put_text(w, "the pass key is ", 0);
        put_text(w, digits, 0);
        put_text(w, ". ", 0);
        filler(r, w, F - pos, next);
    } else {
        /* too short for filler: the first T + 1 bytes of needle and question */
        put_text(w, "the pass key is ", 0);
        put_text(w, digits, 0);
        put_text(w, ". ", 0);
    }
    put_text(w, "what is the pass key? ", 0);
    put_text(w, digits, 1);
}

/* ---- variable-distance copy ---- */

static void vcopy_row(lm_rng *r, row_writer *w, int T) {
    int64_t G = T / 2 - 20 > 0 ? T / 2 - 20 : 0;
    char payload[17];
    while (!full(w)) {
        int len = 4 + (int)(lm_rng_u64(r) % 13);
        for (int i = 0; i < len; i++) payload[i] = (char)('a' + lm_rng_u64(r) % 26);
        payload[len] = 0;
        int64_t g = (int64_t)(lm_rng_u64(r) % (uint64_t)(G + 1));
        put(w, '[', 0);
        put_text(w, payload, 0);
        put(w, ']', 0);
        filler(r, w, g, NULL);
        put(w, '=', 0);
        put_text(w, payload, 1);
        put(w, '\n', 1);
    }
}

/* ---- batches ---- */

static void task_row(lm_task_kind kind, uint64_t seed, int64_t batch_index, int b, int T, int32_t *seq,
                     uint8_t *answer) {
    row_writer w = {seq, answer, 0, T + 1};
    lm_rng r;
    if (kind == LM_TASK_MIX) {
        /* the row's task, then the row from the same stream */
        row_rng(&r, seed ^ MIX_SALT, batch_index, b);
        kind = (lm_task_kind)(lm_rng_u64(&r) % 4);
    } else {
        uint64_t salt = kind == LM_TASK_MQAR ? MQAR_SALT
                        : kind == LM_TASK_PASSKEY ? PASSKEY_SALT
                        : kind == LM_TASK_VCOPY ? VCOPY_SALT : 0;
        row_rng(&r, seed ^ salt, batch_index, b);
    }
    switch (kind) {
    case LM_TASK_MQAR: mqar_row(&r, &w, T); break;
    case LM_TASK_PASSKEY: passkey_row(&r, &w, lm_rng_uniform(&r)); break;
    case LM_TASK_VCOPY: vcopy_row(&r, &w, T); break;
    case LM_TASK_COPY:
    default: copy_row(&r, T, seq, answer); break;
    }
}

void lm_task_rows(lm_task_kind kind, uint64_t seed, int64_t batch_index, int r0, int n, int T, int32_t *seq,
                  uint8_t *answer) {
    if (answer) memset(answer, 0, (size_t)n * T);
    for (int i = 0; i < n; i++)
        task_row(kind, seed, batch_index, r0 + i, T, seq + (size_t)i * (T + 1), answer ? answer + (size_t)i * T : NULL);
}

void lm_task_batch(lm_task_kind kind, uint64_t seed, int64_t batch_index, int B, int T, int32_t *seq,
                   uint8_t *answer) {
    lm_task_rows(kind, seed, batch_index, 0, B, T, seq, answer);
}

lm_status lm_task_mqar_batch(uint64_t seed, int64_t batch_index, int B, int T, int n_pairs, int n_queries,
                             int32_t *seq, uint8_t *answer) {
    if (B < 1 || T < 1) return lm_error(LM_ERR_ARG, "mqar: batch %d x length %d must be positive", B, T);
    if (n_queries < 1 || n_queries > LM_MQAR_MAX_PAIRS)
        return lm_error(LM_ERR_ARG, "mqar: queries must lie in [1, %d], got %d", LM_MQAR_MAX_PAIRS, n_queries);
    if (n_pairs < 0 || n_pairs > LM_MQAR_MAX_PAIRS)
        return lm_error(LM_ERR_ARG, "mqar: pairs must lie in [0, %d] (0: as many as fit), got %d", LM_MQAR_MAX_PAIRS,
                        n_pairs);
    int64_t p = n_pairs;
    if (p == 0) {
        p = (int64_t)(T + 1) / 7 - n_queries;
        if (p > LM_MQAR_MAX_PAIRS) p = LM_MQAR_MAX_PAIRS;
    }
    if (p < n_queries)
        return lm_error(LM_ERR_ARG, "mqar: %d queries need at least as many pairs, got %lld (length %d holds %d "
                        "items of 7 bytes)", n_queries, (long long)p, T, (T + 1) / 7);
    int64_t g = (int64_t)T + 1 - 7 * (p + n_queries);
    if (g < 0)
        return lm_error(LM_ERR_ARG, "mqar: %lld pairs and %d queries take %lld bytes, more than length %d + 1",
                        (long long)p, n_queries, (long long)(7 * (p + n_queries)), T);
    if (answer) memset(answer, 0, (size_t)B * T);
    for (int b = 0; b < B; b++) {
        row_writer w = {seq + (size_t)b * (T + 1), answer ? answer + (size_t)b * T : NULL, 0, T + 1};
        lm_rng r;
        row_rng(&r, seed ^ MQAR_SALT ^ 0x65766131ull, batch_index, b);
        mqar_block(&r, &w, (int)p, n_queries, g);
    }
    return LM_OK;
}

lm_status lm_task_passkey_batch(uint64_t seed, int64_t batch_index, int B, int T, double depth, int32_t *seq,
                                uint8_t *answer) {
    if (B < 1 || T < 1) return lm_error(LM_ERR_ARG, "passkey: batch %d x length %d must be positive", B, T);
    if (!(depth >= 0 && depth <= 1)) return lm_error(LM_ERR_ARG, "passkey: depth must lie in [0, 1], got %g", depth);
    if (answer) memset(answer, 0, (size_t)B * T);
    for (int b = 0; b < B; b++) {
        row_writer w = {seq + (size_t)b * (T + 1), answer ? answer + (size_t)b * T : NULL, 0, T + 1};
        lm_rng r;
        row_rng(&r, seed ^ PASSKEY_SALT ^ 0x65766131ull, batch_index, b);
        passkey_row(&r, &w, depth);
    }
    return LM_OK;
}

static const char *const task_names[LM_TASK_COUNT] = {"copy", "mqar", "passkey", "vcopy", "mix"};

int lm_task_from_name(const char *name, lm_task_kind *out) {
    for (int k = 0; k < LM_TASK_COUNT; k++)
        if (name && !strcmp(name, task_names[k])) {
            *out = (lm_task_kind)k;
            return 0;
        }
    return -1;
}

const char *lm_task_name(lm_task_kind kind) {
    return kind >= 0 && kind < LM_TASK_COUNT ? task_names[kind] : "?";
}

const char *lm_task_names(void) { return "copy, mqar, passkey, vcopy, mix"; }

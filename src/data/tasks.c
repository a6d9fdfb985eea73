/* Built-in synthetic tasks (include/longmoe/tasks.h). */
#include "longmoe/tasks.h"

#include <string.h>

#include "longmoe/core.h"

/* An independent stream per (seed, batch, row): mixing the three through splitmix. */
static void row_rng(lm_rng *r, uint64_t seed, int64_t batch, int row) {
    lm_rng_seed(r, seed ^ (0x9e3779b97f4a7c15ull * (uint64_t)(batch + 1)) ^ ((uint64_t)row << 40));
}

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

void lm_task_batch(lm_task_kind kind, uint64_t seed, int64_t batch_index, int B, int T, int32_t *seq,
                   uint8_t *answer) {
    if (answer) memset(answer, 0, (size_t)B * T);
    for (int b = 0; b < B; b++) {
        lm_rng r;
        row_rng(&r, seed, batch_index, b);
        switch (kind) {
        case LM_TASK_COPY:
        default: copy_row(&r, T, seq + (size_t)b * (T + 1), answer ? answer + (size_t)b * T : NULL); break;
        }
    }
}

int lm_task_from_name(const char *name, lm_task_kind *out) {
    if (!strcmp(name, "copy")) {
        *out = LM_TASK_COPY;
        return 0;
    }
    return -1;
}

const char *lm_task_name(lm_task_kind kind) { return kind == LM_TASK_COPY ? "copy" : "?"; }

/* Data sources: the task adapter and the weighted mix (include/longmoe/data.h). */
#include "longmoe/data.h"

#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "check.h"
#include "longmoe/shards.h"
#include "longmoe/tasks.h"

typedef struct {
    lm_task_kind kind;
    uint64_t seed;
} task_state;

static lm_status task_batch(lm_data_source *self, int64_t index, int B, int T, int32_t *seq, uint8_t *answer) {
    const task_state *s = self->state;
    lm_task_batch(s->kind, s->seed, index, B, T, seq, answer);
    return LM_OK;
}

static lm_status task_rows(lm_data_source *self, int64_t index, int B, int T, int r0, int n, int32_t *seq,
                           uint8_t *answer) {
    const task_state *s = self->state;
    (void)B; /* a task's row depends on (seed, index, row) alone */
    lm_task_rows(s->kind, s->seed, index, r0, n, T, seq, answer);
    return LM_OK;
}

static void task_destroy(lm_data_source *self) { free(self->state); }

lm_status lm_data_open(const char *spec, uint64_t seed, lm_data_source **out) {
    *out = NULL;
    lm_task_kind kind;
    if (lm_task_from_name(spec, &kind) == 0) {
        lm_data_source *src = calloc(1, sizeof *src);
        task_state *st = calloc(1, sizeof *st);
        if (!src || !st) {
            free(src);
            free(st);
            return lm_error(LM_ERR_MEMORY, "out of memory opening data '%s'", spec);
        }
        snprintf(src->name, sizeof src->name, "%s", spec);
        src->vocab_size = 256;
        st->kind = kind;
        st->seed = seed;
        src->state = st;
        src->batch = task_batch;
        src->rows = task_rows;
        src->destroy = task_destroy;
        *out = src;
        return LM_OK;
    }
    /* token shards (include/longmoe/shards.h): the vocabulary comes from the
     * shard headers; rank 0 of 1 */
    if (!strncmp(spec, "shards:", 7)) return lm_data_open_shards(spec + 7, "train", 0, seed, 0, 1, out);
    if (!strncmp(spec, "shards-val:", 11)) return lm_data_open_shards(spec + 11, "val", 0, seed, 0, 1, out);
    return lm_error(LM_ERR_ARG, "unknown data '%s' (a built-in task: %s; or shards:DIR, shards-val:DIR)", spec,
                    lm_task_names());
}

void lm_data_close(lm_data_source *src) {
    if (!src) return;
    if (src->destroy) src->destroy(src);
    free(src);
}

lm_status lm_data_rows(lm_data_source *src, int64_t index, int B, int T, int r0, int n, int32_t *seq,
                       uint8_t *answer) {
    if (!src || !seq) return lm_error(LM_ERR_ARG, "data rows: the source and seq are required");
    if (index < 0 || T < 1 || n < 1 || r0 < 0 || r0 > B - n)
        return lm_error(LM_ERR_ARG, "%s: rows [%d, %d) of batch %lld of %d rows x T=%d: need 0 <= r0, 1 <= n, "
                        "r0 + n <= B, T >= 1, index >= 0", src->name, r0, r0 + n, (long long)index, B, T);
    if (src->rows) return src->rows(src, index, B, T, r0, n, seq, answer);
    const size_t w = (size_t)T + 1;
    int32_t *all = malloc((size_t)B * w * sizeof(int32_t));
    uint8_t *ans = answer ? malloc((size_t)B * (size_t)T) : NULL;
    lm_status s = !all || (answer && !ans)
                      ? lm_error(LM_ERR_MEMORY, "out of memory (a batch of %d x %d tokens of %s)", B, T, src->name)
                      : src->batch(src, index, B, T, all, ans);
    if (!s) {
        memcpy(seq, all + (size_t)r0 * w, (size_t)n * w * sizeof(int32_t));
        if (answer) memcpy(answer, ans + (size_t)r0 * T, (size_t)n * (size_t)T);
    }
    free(all);
    free(ans);
    return s;
}

/* The source of batch `index` of the mix. */
static lm_status mix_pick(const lm_data_mix *mix, int64_t index, lm_data_source **src) {
    if (mix->n < 1) return lm_error(LM_ERR_ARG, "empty data mix");
    double total = 0;
    for (int j = 0; j < mix->n; j++) total += mix->weights[j];
    int pick = 0;
    if (mix->n > 1) {
        lm_rng r;
        lm_rng_seed(&r, mix->seed ^ (0xd1b54a32d192ed03ull * (uint64_t)(index + 1)));
        double u = lm_rng_uniform(&r) * total, acc = 0;
        for (pick = 0; pick < mix->n - 1; pick++) {
            acc += mix->weights[pick];
            if (u < acc) break;
        }
    }
    *src = mix->sources[pick];
    return LM_OK;
}

lm_status lm_data_mix_batch(const lm_data_mix *mix, int64_t index, int B, int T, int32_t *seq, uint8_t *answer) {
    lm_data_source *src = NULL;
    TRY(mix_pick(mix, index, &src));
    return src->batch(src, index, B, T, seq, answer);
}

lm_status lm_data_mix_rows(const lm_data_mix *mix, int64_t index, int B, int T, int r0, int n, int32_t *seq,
                           uint8_t *answer) {
    lm_data_source *src = NULL;
    TRY(mix_pick(mix, index, &src));
    return lm_data_rows(src, index, B, T, r0, n, seq, answer);
}

/* Data sources: the task adapter and the weighted mix (include/longmoe/data.h). */
#include "longmoe/data.h"

#include <stdio.h>
#include <stdlib.h>
#include <string.h>

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

lm_status lm_data_mix_batch(const lm_data_mix *mix, int64_t index, int B, int T, int32_t *seq, uint8_t *answer) {
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
    return mix->sources[pick]->batch(mix->sources[pick], index, B, T, seq, answer);
}

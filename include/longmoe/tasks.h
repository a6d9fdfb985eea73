/* Built-in synthetic tasks: deterministic by (seed, batch index), at any
 * length, over byte tokens (vocab 256). They are training data that needs no
 * download and evaluations with an exact answer.
 *
 *   copy: segments "<payload>|<payload>\n" with a random lowercase payload of
 *         4..16 letters, repeated to fill the sequence. The payload's first
 *         copy is unpredictable; its second copy is fully determined by the
 *         context: those positions are the task's "answer" positions. */
#ifndef LONGMOE_TASKS_H
#define LONGMOE_TASKS_H

#include <stdint.h>

#ifdef __cplusplus
extern "C" {
#endif

typedef enum { LM_TASK_COPY = 0 } lm_task_kind;

/* seq [B, T+1] tokens; inputs are seq[:, :T] and targets seq[:, 1:]. answer
 * [B, T] (may be NULL) is 1 where target t is determined by the context. The
 * batch is a pure function of (seed, batch_index). */
void lm_task_batch(lm_task_kind kind, uint64_t seed, int64_t batch_index, int B, int T, int32_t *seq,
                   uint8_t *answer);
int lm_task_from_name(const char *name, lm_task_kind *out); /* 0 on success */
const char *lm_task_name(lm_task_kind kind);

#ifdef __cplusplus
}
#endif
#endif

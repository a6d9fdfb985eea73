/* Built-in synthetic tasks: deterministic by (seed, batch index), at any
 * length, over byte tokens (vocab 256). They are training data that needs no
 * download and evaluations with an exact answer (docs/eval.md gives the
 * formats byte by byte).
 *
 *   copy:    segments "<payload>|<payload>\n" with a random lowercase payload
 *            of 4..16 letters, repeated to fill the sequence. The payload's
 *            first copy is unpredictable; its second copy and the newline are
 *            fully determined by the context: those are the "answer" positions.
 *   mqar:    multi-query associative recall. Blocks of n pairs "kkk:dd " (a
 *            3-letter key, distinct within the block, and a 2-digit value),
 *            a gap of filler text, then n queries "kkk?dd" (every key of the
 *            block once, in random order; separated by ' ', the last followed
 *            by '\n'). Answers: the two value digits of each query.
 *   passkey: filler sentences with the needle "the pass key is ddddd. " at a
 *            chosen relative depth, ending in "what is the pass key? ddddd"
 *            (the last digit is the sequence's last token). Answers: the five
 *            digits after the question.
 *   vcopy:   variable-distance copy. Blocks "[<payload>]<gap>=<payload>\n"
 *            with a lowercase payload of 4..16 letters and a filler gap of
 *            random length up to about T/2. Answers: the repeated payload
 *            and the newline.
 *   mix:     each row is one of copy, mqar, passkey, vcopy (uniformly, by row).
 *
 * Filler text is a stream of short lowercase sentences ending in ". ", chosen
 * at random from a fixed list; it holds no digit and none of ':?[]=|'. */
#ifndef LONGMOE_TASKS_H
#define LONGMOE_TASKS_H

#include <stdint.h>

#include "longmoe/core.h"

#ifdef __cplusplus
extern "C" {
#endif

typedef enum {
    LM_TASK_COPY = 0,
    LM_TASK_MQAR,
    LM_TASK_PASSKEY,
    LM_TASK_VCOPY,
    LM_TASK_MIX,
    LM_TASK_COUNT
} lm_task_kind;

/* seq [B, T+1] tokens; inputs are seq[:, :T] and targets seq[:, 1:]. answer
 * [B, T] (may be NULL) is 1 where target t (= seq[:, t+1]) is determined by
 * the context. The batch is a pure function of (kind, seed, batch_index, B, T)
 * and row b does not depend on B. T >= 1. Default parameters:
 *   mqar:    per block n uniform in [1, P], P = clamp(T/32, 1, 128); gap
 *            uniform in [0, T/8].
 *   passkey: one needle per row at a depth uniform in [0, 1].
 *   vcopy:   gap uniform in [0, max(0, T/2 - 20)]. */
void lm_task_batch(lm_task_kind kind, uint64_t seed, int64_t batch_index, int B, int T, int32_t *seq,
                   uint8_t *answer);
/* Rows r0 .. r0+n-1 of that batch alone (any B > r0 + n - 1 gives the same
 * rows): seq [n, T+1], answer [n, T] (may be NULL). */
void lm_task_rows(lm_task_kind kind, uint64_t seed, int64_t batch_index, int r0, int n, int T, int32_t *seq,
                  uint8_t *answer);

/* Largest number of MQAR pairs of one block (keys must stay distinct). */
#define LM_MQAR_MAX_PAIRS 8192
/* Bytes of the passkey row's needle and question (both with their digits). */
#define LM_PASSKEY_NEEDLE_BYTES 23
#define LM_PASSKEY_QUESTION_BYTES 27

/* MQAR for evaluation: each row is exactly one block ending at seq[:, T]:
 * n_pairs pairs, a filler gap of T + 1 - 7 (n_pairs + n_queries) bytes, then
 * n_queries queries of distinct keys of the block. n_pairs = 0 asks for as
 * many pairs as fit (at most LM_MQAR_MAX_PAIRS; the rest is gap). Needs
 * 1 <= n_queries <= n_pairs <= LM_MQAR_MAX_PAIRS and 7 (n_pairs + n_queries)
 * <= T + 1. */
lm_status lm_task_mqar_batch(uint64_t seed, int64_t batch_index, int B, int T, int n_pairs, int n_queries,
                             int32_t *seq, uint8_t *answer);

/* Passkey for evaluation with the needle at `depth` in [0, 1]: with F = T + 1
 * - 50 filler bytes, the needle starts at the last sentence boundary at or
 * before round(depth * F) (so it lies at most one sentence, < 40 bytes, before
 * that point). When T + 1 < 50 the row is the first T + 1 bytes of needle and
 * question (no filler). */
lm_status lm_task_passkey_batch(uint64_t seed, int64_t batch_index, int B, int T, double depth, int32_t *seq,
                                uint8_t *answer);

int lm_task_from_name(const char *name, lm_task_kind *out); /* 0 on success */
const char *lm_task_name(lm_task_kind kind);
/* The known names, comma-separated ("copy, mqar, ..."), for messages. */
const char *lm_task_names(void);

#ifdef __cplusplus
}
#endif
#endif

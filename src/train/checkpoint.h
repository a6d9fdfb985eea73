/* Files and directories of a run (internal to src/train). */
#ifndef LONGMOE_CHECKPOINT_H
#define LONGMOE_CHECKPOINT_H

#include <stddef.h>
#include <stdint.h>

#include "longmoe/core.h"

lm_status lm_write_text_atomic(const char *path, const char *text);
lm_status lm_ensure_dir(const char *dir); /* mkdir -p */
/* Create run_dir/checkpoint-<step>.tmp (removing a torn one); its path goes to tmp_dir. */
lm_status lm_checkpoint_begin(const char *run_dir, int64_t step, char *tmp_dir, size_t n);
/* Remove a temporary checkpoint directory after a failed write. */
void lm_checkpoint_abort(const char *tmp_dir);
/* Rename it to checkpoint-<step>, point `latest` at it, keep the newest `keep`. */
lm_status lm_checkpoint_commit(const char *run_dir, int64_t step, const char *tmp_dir, int keep);
/* The directory `latest` names (moving back the copy a crash inside
 * lm_checkpoint_commit may have left as <name>.old). */
lm_status lm_checkpoint_latest(const char *run_dir, char *dir, size_t n);

#endif

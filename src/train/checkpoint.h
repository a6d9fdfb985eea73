/* Files and directories of a run (internal to src/train). */
#ifndef LONGMOE_CHECKPOINT_H
#define LONGMOE_CHECKPOINT_H

#include <stddef.h>
#include <stdint.h>

#include "longmoe/config.h"
#include "longmoe/core.h"
#include "longmoe/model.h"
#include "longmoe/safetensors.h"

lm_status lm_write_text_atomic(const char *path, const char *text);
/* A checkpoint's model files into `dir`: model.safetensors (every parameter by
 * name, from the host parameters; refused while a tensor is cut to a rank's
 * experts) and config.json. */
lm_status lm_checkpoint_write_model(lm_model *m, const lm_config *cfg, const char *dir);
/* The same model.safetensors tensor by tensor (the one header of both): the
 * header of every parameter of m by name, in table order; the caller writes
 * each tensor's numel F32 values in that order (lm_st_stream_write, from
 * wherever they are: a checkpoint under expert parallelism receives the cut
 * tensors from their owners) and commits, or aborts. */
lm_status lm_checkpoint_model_begin(lm_model *m, const char *dir, lm_st_stream **out);
/* config.json of a checkpoint. */
lm_status lm_checkpoint_write_config(const lm_config *cfg, const char *dir);
/* Add every MoE layer's balancing state to a trainer-state writer:
 * layers.<l>.moe.bias, .halfwidth, .last_load, .interval_load. */
lm_status lm_checkpoint_add_balance(lm_st_writer *w, lm_model *m);
/* trainer.safetensors streamed: optim.muon_state (muon_floats F32) and
 * optim.adam_state (adam_floats), which the caller writes in that order, then
 * the balancing state of lm_checkpoint_add_balance, which
 * lm_checkpoint_trainer_finish writes before it commits (it aborts the stream
 * on a failure). */
lm_status lm_checkpoint_trainer_begin(lm_model *m, size_t muon_floats, size_t adam_floats, const char *dir,
                                      lm_st_stream **out);
lm_status lm_checkpoint_trainer_finish(lm_st_stream *st, lm_model *m);
lm_status lm_ensure_dir(const char *dir); /* mkdir -p */
/* Create run_dir/checkpoint-<step>.tmp (removing a torn one); its path goes to tmp_dir. */
lm_status lm_checkpoint_begin(const char *run_dir, int64_t step, char *tmp_dir, size_t n);
/* Remove a temporary checkpoint directory after a failed write. */
void lm_checkpoint_abort(const char *tmp_dir);
/* Rename it to checkpoint-<step>, point `latest` at it, keep the newest `keep`. */
lm_status lm_checkpoint_commit(const char *run_dir, int64_t step, const char *tmp_dir, int keep);
/* Hold run_dir/lock (an fcntl write lock, released when the process ends or
 * lm_run_unlock closes *fd): a second trainer on the same directory is
 * refused with a message naming the process that holds it. */
lm_status lm_run_lock(const char *run_dir, int *fd);
void lm_run_unlock(int fd);
/* LM_OK when run_dir holds no run (no latest, metrics.jsonl, config.json or
 * checkpoint-*); else LM_ERR_ARG naming what is there: a fresh run never
 * touches an existing one. */
lm_status lm_run_check_fresh(const char *run_dir);
/* Remove the checkpoints of run_dir older than `step` beyond the newest
 * keep - 1 of them (real directories only; links are never followed). */
lm_status lm_checkpoint_prune(const char *run_dir, int64_t step, int keep);
/* The directory `latest` names (moving back the copy a crash inside
 * lm_checkpoint_commit may have left as <name>.old). */
lm_status lm_checkpoint_latest(const char *run_dir, char *dir, size_t n);

#endif

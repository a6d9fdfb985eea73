/* The optimizer on a backend's memory (docs/optim.md, "On a backend").
 *
 * The same update rules as optim.h's lm_optimizer (AdamW, Muon with Newton–
 * Schulz per head / per expert, decoupled weight decay), the same gradient
 * clipping and QK-Clip, run by the backend's optimizer ops (backend.h) on
 * parameters, gradients and state that live in the backend's memory: on the
 * GPU nothing crosses to the host inside a step except the global gradient
 * norm (one small download). On the CPU backend every result is bit-identical
 * to lm_optimizer_step / lm_grad_clip / lm_qk_clip.
 *
 * The lm_param descriptors are the CPU optimizer's, with data and grad
 * pointing into backend memory (lm_model_backend_params gives them for a
 * model). The state has the CPU optimizer's layout (lm_param_state_floats per
 * parameter, in order; AdamW's m before its v), so a checkpoint's
 * optim.muon_state / optim.adam_state tensors move between the two unchanged.
 *
 * All memory (state, Newton–Schulz scratch, the norm's partial sums) is
 * allocated at creation from the backend; a step allocates nothing. */
#ifndef LONGMOE_OPTIM_DEVICE_H
#define LONGMOE_OPTIM_DEVICE_H

#include <stddef.h>
#include <stdint.h>

#include "longmoe/backend.h"
#include "longmoe/core.h"
#include "longmoe/optim.h"

#ifdef __cplusplus
extern "C" {
#endif

typedef struct lm_device_optimizer lm_device_optimizer;

/* Check the config and every descriptor (lm_param_check), copy the descriptors,
 * allocate the zeroed state and the scratch on `be` (NULL: the CPU); step = 0. */
lm_status lm_optimizer_create_on(lm_backend *be, const lm_optim_config *cfg, const lm_param *params, int n_params,
                                 lm_device_optimizer **out);
void lm_device_optimizer_free(lm_device_optimizer *o);

/* One update of every parameter with learning rate lr (grads are read, not
 * cleared); increments the step first, as lm_optimizer_step. Enqueued on the
 * backend; returns without waiting for the GPU. */
lm_status lm_device_optimizer_step(lm_device_optimizer *o, float lr);

/* Point the optimizer at other memory of the same parameter layout (a model
 * planned for a new stage): every descriptor must match the one given at
 * creation in shape, kind, blocks, optimizer and decay; the state stays. */
lm_status lm_device_optimizer_rebind(lm_device_optimizer *o, const lm_param *params, int n_params);

int64_t lm_device_optimizer_steps(const lm_device_optimizer *o);
/* Floats of state: lm_optim_state_floats of the descriptors. */
size_t lm_device_optimizer_state_floats(const lm_device_optimizer *o);
/* The state to the host (host[n], n == state floats) and the step count. */
lm_status lm_device_optimizer_download_state(lm_device_optimizer *o, float *host, size_t n, int64_t *step);
/* The state from the host (a checkpoint's tensor) and the step count. */
lm_status lm_device_optimizer_upload_state(lm_device_optimizer *o, const float *host, size_t n, int64_t step);

/* ---- gradients on a backend ---- */

/* Bytes of backend memory lm_grad_clip_on needs as `work` for n_params tensors. */
size_t lm_grad_norm_work_bytes(int n_params);
/* The global L2 norm of the gradients (backend memory): one sum of squares per
 * tensor (the backend's sum_squares op) into `work`, downloaded, added in
 * order in double. On the CPU exactly lm_grad_global_norm. */
lm_status lm_grad_global_norm_on(lm_backend *be, const lm_param *params, int n_params, void *work,
                                 double *norm_out);
/* lm_grad_clip on backend gradients: *norm_out = the norm before clipping;
 * when max_norm > 0 and norm > max_norm every gradient is scaled by
 * (float)(max_norm / norm). A non-finite norm leaves the gradients untouched
 * and returns LM_ERR_NUMERIC (the caller skips the step). */
lm_status lm_grad_clip_on(lm_backend *be, lm_param *params, int n_params, float max_norm, void *work,
                          double *norm_out);

/* ---- QK-Clip on a backend ---- */

/* lm_qk_clip_mla / lm_qk_clip_gqa with w_* in backend memory (s_max, scale_out
 * on the host): the same rows scaled by the same factors through the backend's
 * scale_exact op. On the CPU bit-identical to the host functions. */
lm_status lm_qk_clip_mla_on(lm_backend *be, float *w_uq, float *w_uk, int n_heads, int head_dim_qk, int rope_dims,
                            int q_lora, int kv_lora, const float *s_max, float tau, float *scale_out, int *n_clipped);
lm_status lm_qk_clip_gqa_on(lm_backend *be, float *w_q, float *w_k, int n_heads, int n_kv_heads, int head_dim_qk,
                            int d_model, const float *s_max, float tau, float *scale_out, int *n_clipped);

#ifdef __cplusplus
}
#endif
#endif

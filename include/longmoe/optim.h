/* Optimizers and learning-rate schedules for training (docs/optim.md; SPEC §6).
 *
 *   AdamW  — decoupled weight decay, bias correction, fp32 state (m, v).
 *   Muon   — for 2-D weight matrices: Nesterov momentum, 5 quintic Newton–Schulz
 *            iterations on the normalised momentum, update scaled by
 *            0.2*sqrt(max(rows, cols)) so its RMS matches AdamW's, decoupled weight
 *            decay; orthogonalised per row block (per head for Q/K/V projections,
 *            per expert for stacked expert weights).
 *   QK-Clip — after a step, heads whose largest attention logit exceeded tau have
 *            their query and key rows scaled by sqrt(tau / S_max) each.
 *   Gradient clipping by global norm, learning-rate schedules (cosine, WSD).
 *
 * Memory is planned up front: the trainer describes its parameters as an array of
 * lm_param, asks lm_optim_state_floats() and lm_optim_scratch_floats() how many
 * floats the optimizer state and the Newton–Schulz scratch need, carves both out
 * of its own allocations and hands them to lm_optimizer_init(). Nothing is
 * allocated inside a step.
 *
 * Determinism: every reduction runs in a fixed order (fixed blocks, summed in
 * order), and OpenMP threads only ever own disjoint outputs, so the same inputs
 * give bit-identical outputs for any number of threads. */
#ifndef LONGMOE_OPTIM_H
#define LONGMOE_OPTIM_H

#include <stddef.h>
#include <stdint.h>

#include "longmoe/core.h"

#ifdef __cplusplus
extern "C" {
#endif

/* ---------------------------------------------------------------------------
 * Parameter description
 * ------------------------------------------------------------------------- */

/* What a tensor is; decides the default optimizer and weight decay. */
typedef enum {
    LM_PARAM_MATRIX = 0, /* a hidden 2-D weight (projections, expert FFNs, router): Muon */
    LM_PARAM_EMBEDDING,  /* token embedding or LM head: AdamW (rows = vocab) */
    LM_PARAM_NORM,       /* RMSNorm weights: AdamW, no weight decay */
    LM_PARAM_VECTOR,     /* biases, gate parameters, pseudo-queries, A_log, ...: AdamW */
    LM_PARAM_SCALAR,     /* a single number: AdamW */
    LM_PARAM_KIND_COUNT
} lm_param_kind;

/* Which update rule a tensor gets. AUTO lets lm_param_optimizer() decide. */
typedef enum { LM_OPT_AUTO = 0, LM_OPT_ADAMW, LM_OPT_MUON } lm_optimizer_kind;

typedef struct {
    const char *name;  /* for error messages (may be NULL) */
    float *data;       /* [rows, cols] row-major, or [rows] when ndim == 1 */
    float *grad;       /* same shape as data */
    int ndim;          /* 0 (scalar), 1 (vector of `rows`) or 2 ([rows, cols]) */
    int64_t rows;      /* first dim; 1 for a scalar */
    int64_t cols;      /* second dim; 1 for vectors and scalars */
    int n_blocks;      /* Muon orthogonalises `n_blocks` equal row slices separately:
                        * the heads of a Q/K/V projection [H*head_dim, d_in] (n_blocks = H,
                        * each head's [head_dim, d_in] slice), or the experts of a stacked
                        * expert weight [E*out, in]. 0 or 1: the whole matrix. */
    lm_param_kind kind;
    lm_optimizer_kind optimizer; /* LM_OPT_AUTO (default), or forced by the trainer */
    int weight_decay;            /* 1: apply the config's decoupled weight decay */
} lm_param;

/* Descriptors with the defaults of lm_param_optimizer / lm_param_default_weight_decay. */
lm_param lm_param_matrix(const char *name, float *data, float *grad, int64_t rows, int64_t cols,
                         lm_param_kind kind);
lm_param lm_param_vector(const char *name, float *data, float *grad, int64_t n,
                         lm_param_kind kind);

/* The split rule (docs/optim.md): Muon for LM_PARAM_MATRIX tensors with ndim 2,
 * rows >= 2 and cols >= 2 (per block); AdamW for everything else. A forced
 * p->optimizer wins (lm_param_check rejects Muon on a tensor that is not 2-D). */
lm_optimizer_kind lm_param_optimizer(const lm_param *p);
/* Default decay: matrices and embeddings decay; norms, vectors and scalars do not. */
int lm_param_default_weight_decay(lm_param_kind kind);

int64_t lm_param_numel(const lm_param *p);
/* Shape, pointers, kind and block split valid? (message names the parameter) */
lm_status lm_param_check(const lm_param *p);

/* ---------------------------------------------------------------------------
 * Optimizer
 * ------------------------------------------------------------------------- */

typedef struct {
    float weight_decay;   /* decoupled, multiplied by lr (default 0.1, SPEC §6) */
    /* AdamW */
    float adam_beta1;     /* 0.9 */
    float adam_beta2;     /* 0.95 */
    float adam_eps;       /* 1e-8 */
    /* Muon */
    float muon_momentum;  /* 0.95 */
    int muon_nesterov;    /* 1 */
    int muon_ns_steps;    /* 5 */
    float muon_rms_scale; /* 0.2: update = 0.2 * sqrt(max(rows, cols)) * NS(momentum) */
    float muon_ns_eps;    /* 1e-7: NS input is M / (||M||_F + eps) */
    int muon_ns_fp32;     /* backends with a faster product format (CUDA: TF32): 1 runs the
                           * Newton–Schulz products in full fp32 instead (checks); 0 (default)
                           * the backend's choice. The CPU always computes in fp32. */
} lm_optim_config;

lm_optim_config lm_optim_config_default(void);
lm_status lm_optim_config_check(const lm_optim_config *cfg);

/* Floats of optimizer state one parameter needs: 2*numel (AdamW m, v) or numel
 * (Muon momentum). The state of parameter i starts at the sum of the sizes of
 * parameters 0..i-1; AdamW's m comes before its v. */
size_t lm_param_state_floats(const lm_param *p);
size_t lm_optim_state_floats(const lm_param *params, int n_params);
/* Floats of Newton–Schulz scratch: the largest lm_muon_scratch_floats over the Muon
 * parameters (2*m*n + 2*m*m per block, m = min, n = max of the block's dims, times
 * the blocks that can run at once); 0 when no parameter uses Muon. */
size_t lm_optim_scratch_floats(const lm_param *params, int n_params);

typedef struct {
    lm_optim_config cfg;
    lm_param *params;      /* borrowed, n_params entries */
    int n_params;
    float *state;          /* borrowed, lm_optim_state_floats() floats */
    float *scratch;        /* borrowed, lm_optim_scratch_floats() floats */
    size_t scratch_floats; /* its size as given to lm_optimizer_init */
    int64_t step;          /* steps taken; AdamW's bias correction uses step after increment */
} lm_optimizer;

/* Validate everything, zero the state, set step = 0. `state_floats` and
 * `scratch_floats` are the sizes of the buffers given (must be at least the
 * planned sizes). To resume, overwrite opt->state and opt->step afterwards. */
lm_status lm_optimizer_init(lm_optimizer *opt, const lm_optim_config *cfg, lm_param *params,
                            int n_params, float *state, size_t state_floats, float *scratch,
                            size_t scratch_floats);

/* One update of every parameter from its gradient with learning rate `lr`
 * (grads are read, not cleared). Increments opt->step first. */
lm_status lm_optimizer_step(lm_optimizer *opt, float lr);

/* ---- the update rules on raw arrays (used by lm_optimizer_step; for tests) ---- */

/* AdamW on n elements at step t >= 1 (after increment):
 *   m = b1 m + (1-b1) g;  v = b2 v + (1-b2) g^2
 *   w -= lr * ( (m / (1-b1^t)) / (sqrt(v / (1-b2^t)) + eps) + wd * w ) */
void lm_adamw_update(float *w, const float *g, float *m, float *v, int64_t n, float lr,
                     float beta1, float beta2, float eps, float wd, int64_t t);

/* Muon on a [rows, cols] matrix split into n_blocks row slices:
 *   buf = mu buf + g;  u = g + mu buf (Nesterov) or u = buf
 *   O = NS5(u_block) per block;  w -= lr * (0.2 sqrt(max(rb, cols)) O + wd w)
 * where rb = rows / n_blocks. `scratch` holds `scratch_floats` floats, at least
 * lm_newton_schulz_scratch_floats(rb, cols); with room for k such areas, up to k
 * blocks run at once on OpenMP threads (lm_muon_scratch_floats gives room for one per
 * thread). The result is the same, bit for bit, for any k and thread count. */
lm_status lm_muon_update(float *w, const float *g, float *momentum, int64_t rows, int64_t cols,
                         int n_blocks, float lr, float wd, const lm_optim_config *cfg,
                         float *scratch, size_t scratch_floats);
/* Floats of scratch for lm_muon_update on [rows, cols] in n_blocks blocks: one
 * Newton–Schulz area per block that can run at once (min(n_blocks, OpenMP threads)). */
size_t lm_muon_scratch_floats(int64_t rows, int64_t cols, int n_blocks);

/* Floats of scratch lm_newton_schulz needs for a [rows, cols] input. */
size_t lm_newton_schulz_scratch_floats(int64_t rows, int64_t cols);
/* out[rows, cols] = the quintic Newton–Schulz approximation of the orthogonal
 * factor U V^T of g = U S V^T: X = g / (||g||_F + eps), transposed when rows > cols,
 * then `steps` times  A = X X^T;  X = a X + (b A + c A A) X  with
 * (a, b, c) = (3.4445, -4.7750, 2.0315). out may alias g. */
lm_status lm_newton_schulz(float *out, const float *g, int64_t rows, int64_t cols, int steps,
                           float eps, float *scratch);

/* ---------------------------------------------------------------------------
 * Gradients: global norm, clipping, accumulation
 * ------------------------------------------------------------------------- */

/* sum x[i]^2 in double over LM_SUM_SQUARES_BLOCKS fixed blocks, each summed in
 * order, then the block sums in order: the same bits for any thread count.
 * Block b holds elements [b bs, min(n, (b + 1) bs)), bs = ceil(n / blocks). */
#define LM_SUM_SQUARES_BLOCKS 64
double lm_sum_squares(const float *x, int64_t n);
/* One block's running sum: s + x[0]^2 + ... + x[n-1]^2, added in order (a block
 * split over several holders is summed by continuing from the earlier part's s;
 * owner-only expert state rebuilds lm_sum_squares bit for bit with it). */
double lm_sum_squares_run(double s, const float *x, int64_t n);

/* Global L2 norm of all gradients, accumulated in double in a fixed order:
 * sqrt of the sum over parameters, in order, of lm_sum_squares(grad). */
double lm_grad_global_norm(const lm_param *params, int n_params);

/* Measure the global norm (written to *norm_out, before clipping) and, when
 * max_norm > 0 and norm > max_norm, scale every gradient by max_norm / norm.
 * max_norm == 0 only measures. A non-finite norm leaves the gradients untouched
 * and returns LM_ERR_NUMERIC (the trainer skips the step). */
lm_status lm_grad_clip(lm_param *params, int n_params, float max_norm, double *norm_out);

/* Gradient accumulation: zero all grads before the micro-batches (backward
 * passes accumulate +=), then scale by 1/n_micro to average them. */
void lm_grads_zero(lm_param *params, int n_params);
void lm_grads_scale(lm_param *params, int n_params, float s);

/* ---------------------------------------------------------------------------
 * QK-Clip (Kimi K2)
 * ------------------------------------------------------------------------- */

/* One attention head's query and key weight rows (row-major, each range
 * contiguous). With eta = tau / S_max [K2]:
 *   q_rows      [q_nrows, q_cols]       scaled by sqrt(eta) (by eta when k_rows is NULL)
 *   k_rows      [k_nrows, k_cols]       scaled by sqrt(eta); NULL when the key head is
 *                                       shared by several query heads (GQA groups)
 *   q_rope_rows [q_rope_nrows, q_cols]  rows of q whose key is shared by all heads (the
 *                                       rotary part of MLA with rope_dims > 0): scaled by
 *                                       eta; may be NULL
 * so every q.k logit of the head scales by eta. Which rows these are for the
 * layer of include/longmoe/mla.h: lm_qk_clip_mla / lm_qk_clip_gqa, docs/optim.md. */
typedef struct {
    float *q_rows;
    int64_t q_nrows, q_cols;
    float *k_rows;
    int64_t k_nrows, k_cols;
    float *q_rope_rows;
    int64_t q_rope_nrows;
} lm_qk_clip_head;

/* For each head h with s_max[h] > tau (s_max: the largest pre-softmax logit,
 * attention scale included, seen in the step's forward over the whole batch),
 * scale the head's rows as above with eta = tau / s_max[h]. Heads with
 * s_max <= tau are not touched. Each scaled weight is the exact product with the
 * double factor, rounded once. scale_out[h] (may be NULL) receives eta (1 when
 * untouched); *n_clipped (may be NULL) the number of heads clipped. tau must be
 * finite and > 0; a non-finite s_max is LM_ERR_NUMERIC, checked before any
 * weight changes. */
lm_status lm_qk_clip(const lm_qk_clip_head *heads, int n_heads, const float *s_max, float tau,
                     float *scale_out, int *n_clipped);

/* The MLA layer (include/longmoe/mla.h), Dk = head_dim_qk, r = rope_dims,
 * Dn = Dk - r: W_uq [H*Dk, q_lora], W_uk [H*Dn, kv_lora]. Head h's rows:
 *   W_uq rows [h*Dk, h*Dk+Dn)      (no-position part)  x sqrt(eta)
 *   W_uq rows [h*Dk+Dn, (h+1)*Dk)  (rotary part)        x eta   (only when r > 0)
 *   W_uk rows [h*Dn, (h+1)*Dn)                          x sqrt(eta)
 * The shared rotary key W_kr, W_dq, W_dkv and the norms are never touched.
 * NoPE (r = 0, the default) is the plain sqrt/sqrt split. */
lm_status lm_qk_clip_mla(float *w_uq, float *w_uk, int n_heads, int head_dim_qk, int rope_dims,
                         int q_lora, int kv_lora, const float *s_max, float tau, float *scale_out,
                         int *n_clipped);

/* The GQA layer: W_q [H*Dk, d_model], W_k [Hkv*Dk, d_model]. With Hkv == H,
 * query head h's rows [h*Dk, (h+1)*Dk) of W_q and of W_k each x sqrt(eta); with
 * shared key heads (Hkv < H) only the query head's rows of W_q, x eta, so one
 * query head's clip does not change its group's other heads. */
lm_status lm_qk_clip_gqa(float *w_q, float *w_k, int n_heads, int n_kv_heads, int head_dim_qk,
                         int d_model, const float *s_max, float tau, float *scale_out,
                         int *n_clipped);

/* ---------------------------------------------------------------------------
 * Learning-rate schedules (pure functions of the 0-based step)
 * ------------------------------------------------------------------------- */

typedef enum { LM_LR_COSINE = 0, LM_LR_WSD, LM_LR_CONSTANT } lm_lr_schedule_kind;

typedef struct {
    lm_lr_schedule_kind kind;
    float peak_lr;       /* > 0 */
    float warmup_frac;   /* fraction of total steps of linear warmup, [0, 1) (0.01) */
    float min_lr_ratio;  /* final lr = min_lr_ratio * peak_lr, [0, 1] (0.1) */
    float decay_frac;    /* WSD: fraction of total steps of linear decay (0.2) */
} lm_lr_schedule;

lm_lr_schedule lm_lr_schedule_default(float peak_lr); /* cosine, 1% warmup, min 0.1 */
lm_status lm_lr_schedule_check(const lm_lr_schedule *s);
const char *lm_lr_schedule_name(lm_lr_schedule_kind k); /* "cosine", "wsd", "constant" */
int lm_lr_schedule_from_name(const char *name, lm_lr_schedule_kind *out); /* 0 on success */

/* Number of warmup steps: ceil(warmup_frac * total_steps). */
int64_t lm_lr_warmup_steps(int64_t total_steps, float warmup_frac);

/* Linear warmup lr = peak*(step+1)/W for step < W, then cosine from peak (at
 * step W) to min_ratio*peak (at step total-1); steps >= total stay at the minimum. */
float lm_lr_cosine(int64_t step, int64_t total_steps, float peak_lr, float warmup_frac,
                   float min_lr_ratio);
/* Warmup-stable-decay: warmup as above, peak until step total - D (D =
 * ceil(decay_frac*total)), then linear decay reaching min_ratio*peak at total-1. */
float lm_lr_wsd(int64_t step, int64_t total_steps, float peak_lr, float warmup_frac,
                float decay_frac, float min_lr_ratio);
/* The schedule's lr at `step` (constant: warmup then peak). */
float lm_lr_at(const lm_lr_schedule *s, int64_t step, int64_t total_steps);

#ifdef __cplusplus
}
#endif
#endif

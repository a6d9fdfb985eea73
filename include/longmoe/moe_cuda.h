/* The MoE layer on the GPU: the mirror of lm_moe_forward / lm_moe_backward
 * (include/longmoe/moe.h; docs/moe.md, "MoE on the GPU"), and the device side
 * of the quantile balancer's histogram (include/longmoe/balance.h).
 *
 * Conventions of lm_cuda_context.h: device pointers only, bf16 tensors are
 * uint16_t bit patterns, backward ACCUMULATES into fp32 gradients, nothing is
 * allocated inside these calls; only the forward with a cuBLAS kind of
 * expert products synchronises with the host, once (row counts, below).
 *
 * Precision: the router (W_r x, sigmoid, top-k, weights p, its gradient) and
 * the latent RMSNorm (statistics and weight) are fp32 and read the fp32 master
 * parameters; every other product reads the bf16 copy of the parameters and
 * bf16 activations, accumulating in fp32. The expert intermediates (a, u, h,
 * out and their gradients) are stored in bf16; the combination, the latent
 * sum z, y, dx and the parameter gradients are fp32.
 *
 * Grouped layout: the m*k (token, slot) pairs are sorted by expert (stable:
 * token order within an expert) and each expert's rows are padded to a
 * multiple of LM_MOE_CUDA_ROW_TILE, so a row tile of the grouped products
 * never straddles two experts. padded_offsets[j] .. padded_offsets[j+1]-1 are
 * expert j's rows; the first offsets[j+1]-offsets[j] of them are real, the rest
 * are zero rows (order[row] = -1). With the WMMA kind the row counts stay on
 * the device: the grouped products run over a grid sized for rows_max and
 * each tile looks up its expert. With the cuBLAS kinds the forward copies the
 * counts to the host (one synchronisation of the stream) and each expert's
 * product covers its real rows only (experts without rows are skipped; the
 * products leave the padding rows of the bf16 intermediates unwritten, the
 * elementwise kernels may compute on them, and nothing from a padding row
 * reaches y, dx or a gradient). Dropless at any load (one expert may receive
 * all m*k rows). */
#ifndef LONGMOE_MOE_CUDA_H
#define LONGMOE_MOE_CUDA_H

#include <stddef.h>
#include <stdint.h>

#include "longmoe/comm.h"
#include "longmoe/core.h"
#include "longmoe/cuda_context.h"
#include "longmoe/moe.h"

#ifdef __cplusplus
extern "C" {
#endif

/* Rows of one tile of the grouped products; each expert's rows are padded to it. */
#define LM_MOE_CUDA_ROW_TILE 128

/* bf16 copy of the parameters, same layout as lm_moe_params. router and
 * lat_norm are not read (the fp32 masters are) and may be NULL. */
typedef struct {
    uint16_t *router;
    uint16_t *gate, *up, *down;
    uint16_t *lat_down, *lat_norm, *lat_up;
    uint16_t *shared_gate, *shared_up, *shared_down;
} lm_moe_params_bf16;

/* Activations of the forward (device), saved for the backward. P = rows_max. */
typedef struct {
    int64_t m_max, m;       /* capacity in tokens; tokens of the last forward */
    int64_t rows_max;       /* P: grouped rows incl. padding, >= m k + n (TILE - 1) */
    float *s;               /* [m, n] fp32 router scores sigmoid(W_r x) */
    int32_t *topk;          /* [m, k] chosen experts, by decreasing s + b */
    float *weights;         /* [m, k] fp32 p (route scale included) */
    int32_t *offsets;       /* [n + 1] unpadded: expert j has offsets[j+1]-offsets[j] rows */
    int32_t *padded_offsets;/* [n + 1] expert j owns grouped rows padded_offsets[j].. */
    int32_t *order;         /* [P] grouped row -> slot i*k + t, -1 on padding rows */
    int32_t *slot_row;      /* [m k] slot -> grouped (padded) row */
    int32_t *block_counts;  /* [ceil(m k / 256), n] per-block expert counts of the sort */
    const uint16_t *x_bf16; /* [m, d] bf16 x (input of lat_down and the shared experts) that the
                               last forward read: the caller's copy, or x_own */
    uint16_t *x_own;        /* [m, d] x rounded to bf16 by the forward when the caller gave none */
    uint16_t *x_lat;        /* [m, d_lat] bf16 W_down_lat x (LatentMoE only) */
    uint16_t *xg;           /* [P, d_e] bf16 expert inputs, grouped */
    uint16_t *ga, *gu;      /* [P, f] bf16 gate / up pre-activations */
    uint16_t *gh;           /* [P, f] bf16 hidden act(a, u) */
    uint16_t *gout;         /* [P, d_e] bf16 expert outputs */
    float *z;               /* [m, d_e] fp32 sum_t p_it E(x) (LatentMoE only) */
    float *rstd;            /* [m] fp32 1/rms(z) (LatentMoE only) */
    uint16_t *zn;           /* [m, d_lat] bf16 RMSNorm(z) (LatentMoE only) */
    uint16_t *sa, *su;      /* [n_shared, m, f_s] bf16 shared experts' a, u */
    uint16_t *sh;           /* [n_shared, m, f_s] bf16 shared experts' h */
    void **blas_ptrs;       /* [2][3 max(n, P / 128)] device operand pointers of the grouped cuBLAS
                               products: the stream's set, then the side stream's */
    /* Set by the forward: the expert-product kind it ran (lm_moe_gemm_kind;
     * the backward uses the same), and for the cuBLAS kinds a host copy of
     * offsets and padded_offsets (one device-to-host copy and stream
     * synchronisation a forward). */
    int gemm_kind;
    int32_t host_offsets[LM_MOE_MAX_EXPERTS + 1];
    int32_t host_padded[LM_MOE_MAX_EXPERTS + 1];
} lm_cuda_moe_acts;

/* Scratch of the backward (device). */
typedef struct {
    int64_t m_max, rows_max;
    uint16_t *dy_bf16;      /* [m, d] */
    float *dzn, *dz;        /* [m, d_lat] (LatentMoE only) */
    float *norm_partial;    /* [ceil(m / 256), d_lat] per-block lat_norm gradient partials */
    uint16_t *dgout;        /* [P, d_e] bf16 p dz, grouped */
    float *dp;              /* [m k] dL/dp, then dL/dr of the chosen experts */
    uint16_t *dh;           /* [P, f] bf16 */
    uint16_t *da, *du;      /* [P, f] */
    uint16_t *dxg;          /* [P, d_e] bf16 */
    uint16_t *dw_bf16;      /* [n, f, d_e] bf16 expert weight gradient of one grouped cuBLAS
                               product, then added into the fp32 gradient */
    /* dcat [m, 2 n_s f_s + d_lat] bf16: the input gradients of the products that take x (or its
     * latent), side by side, so that dx takes one product: per shared expert its gate's and up's, then
     * the latent one (LatentMoE only; without it the slots are summed straight into dx). wcat
     * [2 n_s f_s + d_lat, d] bf16: the matching weights stacked (shared gate, up per expert, then
     * lat_down), copied from the bf16 parameters in each backward. */
    uint16_t *dcat, *wcat;
    float *dr;              /* [m, n] router logit gradient */
    uint16_t *dsh;          /* [m, f_s] bf16 */
} lm_cuda_moe_scratch;

/* How the expert products (and, with cuBLAS, the latent and shared-expert
 * products) run:
 *   BATCHED: cublasGemmBatchedEx: the products over the grouped rows one
 *            call with an entry a 128-row tile (lm_cuda_moe_set_batched_tiles),
 *            the weight gradients one call per distinct padded row count:
 *            the experts whose padded rows (multiples of
 *            LM_MOE_CUDA_ROW_TILE) are equally many run as one batch over
 *            their padded rows, whose inputs are zero, so the padding rows
 *            of every intermediate are zero too and the weight gradients'
 *            contractions may run over them; fp32 weight gradients
 *            accumulate in place (the default);
 *   GROUPED: cublasGemmGroupedBatchedEx, one group per expert with rows;
 *   LOOP:    one cublasGemmEx per expert with rows;
 *   WMMA:    the project's own grouped kernel (src/cuda/moe/moe_gemm.cu);
 *   WGMMA:   the project's Hopper kernel (src/cuda/moe/moe_wgmma.cu: TMA and
 *            wgmma) for the products over the grouped rows (forward, and the
 *            input gradients through transposed weights), over the padded
 *            rows as BATCHED (zero padding rows); the weight gradients and
 *            the dense products as BATCHED.
 * Operands bf16, accumulation fp32 in all four. The cuBLAS kinds need the
 * per-expert row counts on the host: the forward copies them once (one
 * stream synchronisation) and the backward reuses them. */
typedef enum {
    LM_MOE_GEMM_GROUPED = 0,
    LM_MOE_GEMM_LOOP = 1,
    LM_MOE_GEMM_WMMA = 2,
    LM_MOE_GEMM_BATCHED = 3,
    LM_MOE_GEMM_WGMMA = 4
} lm_moe_gemm_kind;
#define LM_MOE_GEMM_KINDS 5

/* The kind the next forward uses (its backward follows the forward). Until
 * set, the environment variable LONGMOE_MOE_GEMM=batched|grouped|loop|wmma|wgmma
 * (read once), else BATCHED. An unknown value in the environment makes this (and
 * so every forward) return LM_ERR_ARG naming it, until a kind is set. */
lm_status lm_cuda_moe_gemm(lm_moe_gemm_kind *kind);
lm_status lm_cuda_moe_set_gemm(lm_moe_gemm_kind kind);
const char *lm_cuda_moe_gemm_name(lm_moe_gemm_kind kind);
/* The wgmma kind's tile: 128 x 256 (tile_n 256, the default) or 128 x 128
 * (128); until set, LONGMOE_MOE_WGMMA_TILE=128x128 selects the second
 * (read once). Anything else is LM_ERR_ARG. */
lm_status lm_cuda_moe_set_wgmma_tile(int tile_n);
/* The batched kind's entries in the products over the grouped rows (the
 * forward's and the input gradients'): 1, one a 128-row tile of the grouped
 * rows, all in one call (the default); 0, one an expert, the experts with
 * the same padded row count in one call. Until set, LONGMOE_MOE_BATCHED=experts
 * selects 0 (read once). The weight gradients run per expert either way.
 * Anything but 0 or 1 is LM_ERR_ARG. */
lm_status lm_cuda_moe_set_batched_tiles(int tiles);
int lm_cuda_moe_batched_tiles(void);
/* How the rows move between tokens and the grouped layout: 0, by grouped row
 * (the gather, the weighted combination, the LatentMoE RMSNorm and their
 * backwards as separate kernels); 1, by token where the width is a multiple
 * of 8 up to 1024 (a token's row read once for its k slots; the combination
 * with the norm, and the norm's backward with its weight-gradient partials,
 * one kernel each; the default). Until set, LONGMOE_MOE_ROWS=by-row selects 0
 * (read once). Anything but 0 or 1 is LM_ERR_ARG. */
lm_status lm_cuda_moe_set_by_token(int by_token);
int lm_cuda_moe_by_token(void);
/* Whether the layer uses the context's side stream (the batched kind, without
 * expert parallelism, on a context with one): 1 (the default), the forward
 * runs the products that need x's bf16 copy alone (latent down-projection,
 * the shared experts' gate and up) there beside the router and the routing,
 * and the backward its weight gradients (routed and shared experts, latent
 * projections, router) beside the input gradients and the rest of the
 * layer's backward; the stream waits for the side before the gather and at
 * the backward's end. 0, everything on the context's stream. The same
 * products on the same inputs either way: the same bits. Until set,
 * LONGMOE_MOE_SIDE=inline selects 0 (read once). Anything but 0 or 1 is
 * LM_ERR_ARG. */
lm_status lm_cuda_moe_set_side_stream(int side);
int lm_cuda_moe_side_stream(void);
/* "batched", "grouped", "loop", "wmma", "wgmma" -> kind; -1 for anything else */
int lm_cuda_moe_gemm_parse(const char *name);
/* Grouped calls this process's cuBLAS refused (CUBLAS_STATUS_NOT_SUPPORTED):
 * each then ran per expert (as LOOP), with one message on stderr. */
long lm_cuda_moe_grouped_refused(void);

/* Bytes of the one device block holding the activations (resp. the backward
 * scratch) for up to m_max tokens; 0 when cfg or m_max is invalid
 * (m_max in [1, 2^31 / top_k] and the padded rows must fit an int32). */
size_t lm_cuda_moe_acts_bytes(const lm_moe_config *cfg, int64_t m_max);
size_t lm_cuda_moe_scratch_bytes(const lm_moe_config *cfg, int64_t m_max);
/* Carve the buffers out of a caller-allocated device block of at least that
 * many bytes (256-byte aligned). */
lm_status lm_cuda_moe_acts_carve(lm_cuda_moe_acts *acts, const lm_moe_config *cfg, int64_t m_max,
                                 void *block, size_t bytes);
lm_status lm_cuda_moe_scratch_carve(lm_cuda_moe_scratch *scratch, const lm_moe_config *cfg,
                                    int64_t m_max, void *block, size_t bytes);

/* Forward: y[m,d] fp32 from x[m,d] fp32 with the balancing bias b[n] (device,
 * NULL: zero). Routing, grouping and all the backward needs go to acts
 * (m <= acts->m_max). params_f32: router and lat_norm are read; params_bf16:
 * every other weight. x_bf16 [m,d] (may be NULL): x already rounded to bf16
 * (round to nearest even, as lm_cuda_f32_to_bf16), which the latent
 * down-projection and the shared experts read instead of a conversion of
 * their own into acts->x_own; the backward reads it too, so it must hold the
 * same values until the backward of this forward. Not read without LatentMoE
 * and shared experts (the routed experts gather x itself). */
lm_status lm_cuda_moe_forward(const lm_cuda_context *ctx, float *y, const float *x, const uint16_t *x_bf16,
                              const float *bias, const lm_moe_config *cfg, const lm_moe_params *params_f32,
                              const lm_moe_params_bf16 *params_bf16, lm_cuda_moe_acts *acts, int64_t m);

/* Backward of the last forward (same x, params, acts; the bf16 x that forward
 * read, acts->x_bf16). WRITES dx[m,d] (may be NULL; its old values are not
 * read) and ACCUMULATES (+=) into every non-NULL pointer of grads (fp32, the
 * lm_moe_params layout). The routing is held fixed; the router gradient flows
 * through p and dscores_extra [m,n] (may be NULL), as in lm_moe_backward.
 * dy_bf16 (may be NULL): dy in bf16 (the bits lm_cuda_f32_to_bf16 gives),
 * read by the products instead of a copy the backward would make.
 * expert_grads_set 1: the routed experts' weight gradients (grads' gate, up,
 * down) are WRITTEN instead (their old values, whatever they hold, are not
 * read; experts without rows get zeros): the first backward after a zeroing
 * need not zero them nor read them (lm_model does so). */
lm_status lm_cuda_moe_backward(const lm_cuda_context *ctx, float *dx, const lm_moe_params *grads,
                               const float *dy, const uint16_t *dy_bf16, const float *x, const float *dscores_extra,
                               const lm_moe_config *cfg, const lm_moe_params *params_f32,
                               const lm_moe_params_bf16 *params_bf16, const lm_cuda_moe_acts *acts,
                               lm_cuda_moe_scratch *scratch, int expert_grads_set);

/* Expert parallelism on GPU ranks (docs/scaleout.md, "Expert parallelism on
 * GPU ranks"): the mirror of include/longmoe/moe_ep.h. R ranks of a device
 * communicator (NCCL, or the staged engine over a CUDA backend: buffers in
 * device memory, on the context's stream) split the n routed experts: rank r
 * owns experts [r n / R, (r+1) n / R). Each rank routes and groups its own
 * tokens as lm_cuda_moe_forward does; the per-expert row counts go to the
 * owners over the handle's host handle (lm_comm_host); each owner's padded
 * range of the grouped bf16 rows goes to it by one lm_comm_all_to_allv; the
 * owner orders what it received by local expert, then source rank, then the
 * source's order (the global token order of one process when the ranks hold
 * consecutive token blocks), pads each expert's rows to the row tile and runs
 * its experts with the layer's own grouped products; the outputs return by
 * the reverse exchange to the very grouped rows they came from, where the
 * combination sums each token's slots in slot order. The backward mirrors it;
 * the owners' expert weight gradients stay on them. Everything else (router,
 * balancing bias, LatentMoE projections and norm, shared experts) is
 * replicated and runs on each rank's tokens.
 *
 * The handle keeps the owner's rows between a forward and its backward in
 * device buffers of its own, sized by lm_cuda_moe_ep_reserve or grown when a
 * forward receives more rows than they hold (cudaMalloc then: the only
 * allocation in these calls; reserve the dropless worst case, R m k rows, to
 * keep it out of a step). One handle per MoE layer. A rank's rows for its own
 * experts never travel: they are read and written in place. */
typedef struct lm_cuda_moe_ep lm_cuda_moe_ep;

/* A handle over comm's ranks (comm must outlive it) for layers of cfg on
 * ctx's device. n_experts not divisible by the number of ranks is LM_ERR_ARG. */
lm_status lm_cuda_moe_ep_create(const lm_cuda_context *ctx, lm_comm *comm, const lm_moe_config *cfg,
                                lm_cuda_moe_ep **out);
void lm_cuda_moe_ep_free(lm_cuda_moe_ep *ep);
/* The experts this rank owns: [first, first + count). */
int lm_cuda_moe_ep_first_expert(const lm_cuda_moe_ep *ep);
int lm_cuda_moe_ep_local_experts(const lm_cuda_moe_ep *ep);
/* Rows (real, not padding) this rank's experts received in the last forward. */
int64_t lm_cuda_moe_ep_rows_received(const lm_cuda_moe_ep *ep);
/* Size the owner's buffers now for `rows` rows received by its experts from
 * every source together, 1/R of them (rounded down) its own: its own rows
 * never enter the received layout, which is sized for the rest (every
 * other source's blocks padded to the tile); the local layout for all. */
lm_status lm_cuda_moe_ep_reserve(lm_cuda_moe_ep *ep, int64_t rows);
/* Its buffers are in two parts: the owner's activations, kept from a forward
 * to its backward, and the buffers a call uses only while it runs (the rows
 * as received and as sent back, the owner's backward scratch). Handles whose
 * calls never overlap (a model's MoE layers, on one stream) may share the
 * second part: lm_cuda_moe_ep_share makes ep use with's (ep's own is freed;
 * the same expert shapes and context; each grows it on need). */
lm_status lm_cuda_moe_ep_share(lm_cuda_moe_ep *ep, lm_cuda_moe_ep *with);
/* Device bytes the handle holds now: its own part (shared_part 0: the
 * activations and tables) or the shareable part (1, counted by each sharer). */
size_t lm_cuda_moe_ep_bytes(const lm_cuda_moe_ep *ep, int shared_part);
/* The same for a handle of cfg over R ranks after lm_cuda_moe_ep_reserve(rows)
 * (no GPU needed: the memory plan); 0 when cfg is invalid or n_experts is not
 * divisible by R. */
size_t lm_cuda_moe_ep_plan_bytes(const lm_moe_config *cfg, int R, int64_t rows, int shared_part);

/* lm_cuda_moe_forward / lm_cuda_moe_backward with the routed experts on
 * their owners: params_bf16's gate, up, down (and grads') point at this
 * rank's slice [count, ...] of the expert tensors; everything else is whole.
 * x, y, dx, dy are this rank's m tokens (m may be 0: the rank still takes
 * part). The backward's gradients are this rank's contributions (the
 * replicated parts are summed over the ranks by the caller, as in data
 * parallelism); the expert gradients are complete for the rows every rank
 * sent; every gradient is added to (there is no expert_grads_set here).
 * Collective over ep's ranks, in the same order on each. */
lm_status lm_cuda_moe_forward_ep(const lm_cuda_context *ctx, float *y, const float *x, const uint16_t *x_bf16,
                                 const float *bias, const lm_moe_config *cfg, const lm_moe_params *params_f32,
                                 const lm_moe_params_bf16 *params_bf16, lm_cuda_moe_acts *acts, int64_t m,
                                 lm_cuda_moe_ep *ep);
lm_status lm_cuda_moe_backward_ep(const lm_cuda_context *ctx, float *dx, const lm_moe_params *grads,
                                  const float *dy, const uint16_t *dy_bf16, const float *x,
                                  const float *dscores_extra,
                                  const lm_moe_config *cfg, const lm_moe_params *params_f32,
                                  const lm_moe_params_bf16 *params_bf16, const lm_cuda_moe_acts *acts,
                                  lm_cuda_moe_scratch *scratch, lm_cuda_moe_ep *ep);

/* Quantile balancing, the per-micro-batch pass of lm_balance_observe on the
 * device: for each token i, alpha_i = the (k+1)-th largest s_i + b (-inf when
 * k == n), and for each expert j, r_ij = alpha_i - s_ij falls into bin
 *   x = ((alpha_i - s_ij) - lo_j) * (1 / width_j),
 *   K3 (zoom = 0):  x < 0 -> 0, x >= B -> B-1, else floor(x);
 *   zoom (zoom = 1): x < 0 -> 0, x >= B-2 -> B-1, else 1 + floor(x),
 * with fp32 arithmetic rounded exactly as on the CPU, so the integer counts
 * [n, bins] (ACCUMULATED) equal lm_balance_observe's. lo, width: [n] device,
 * from lm_balance_bin_geometry. scores [m,n], bias [n] (NULL: zero). */
lm_status lm_cuda_balance_histogram(const lm_cuda_context *ctx, int32_t *counts, const float *scores,
                                    const float *bias, const float *lo, const float *width, int64_t m,
                                    int n, int k, int bins, int zoom);
/* Tokens a block of that pass: 8, 16 (the default), 32, 64 or 128; the
 * counts are the same whatever the setting (a tuning knob; anything else
 * LM_ERR_ARG). */
lm_status lm_cuda_balance_set_hist_tokens(int tokens);

/* Tokens per expert of a routing topk [m,k]: load[j] += #{(i,t): topk = j}. */
lm_status lm_cuda_expert_load(const lm_cuda_context *ctx, int32_t *load, const int32_t *topk, int64_t m,
                              int n, int k);

#ifdef __cplusplus
}
#endif
#endif

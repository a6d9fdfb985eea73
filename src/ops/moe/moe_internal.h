/* Pieces of the CPU MoE layer shared with its expert-parallel exchange
 * (src/ops/moe/moe.c, src/comm/moe_ep.c). Not part of the public API. */
#ifndef LONGMOE_MOE_INTERNAL_H
#define LONGMOE_MOE_INTERNAL_H

#include <stdint.h>

#include "longmoe/moe.h"
#include "longmoe/moe_ep.h"

/* One GLU expert on `rows` rows: a = x Wg^T, u = x Wu^T, h = act(a, u),
 * out = h Wd^T. x [rows, din]; a, u, h [rows, f]; out [rows, dout]. */
void lm_moe_glu_forward(float *out, float *a, float *u, float *h, const float *x, const float *wg,
                        const float *wu, const float *wd, int64_t rows, int din, int f, int dout,
                        lm_expert_act act);
/* Its backward: dx (+=, may be NULL), dwg, dwu, dwd (+=, may be NULL);
 * dh, da, du are scratch [rows, f]. */
void lm_moe_glu_backward(float *dx, float *dwg, float *dwu, float *dwd, float *dh, float *da, float *du,
                         const float *dout, const float *x, const float *a, const float *u, const float *h,
                         const float *wg, const float *wu, const float *wd, int64_t rows, int din, int f,
                         int dim_out, lm_expert_act act);

/* The routed experts of one forward under expert parallelism: sends the
 * grouped rows acts->xg (offsets by global expert) to their owners, runs the
 * owned experts with p->gate/up/down (this rank's slice), and receives the
 * outputs into acts->gout at the same grouped rows. Collective. */
lm_status lm_moe_ep_experts_forward(lm_moe_ep *ep, lm_moe_acts *acts, const lm_moe_config *cfg,
                                    const lm_moe_params *p);
/* Its backward: sends acts->dgout to the owners, accumulates the owned
 * experts' weight gradients into g->gate/up/down (this rank's slice, NULL
 * parts skipped) and receives the input gradients into acts->dxg
 * (overwritten). Collective. */
lm_status lm_moe_ep_experts_backward(lm_moe_ep *ep, lm_moe_acts *acts, const lm_moe_config *cfg,
                                     const lm_moe_params *p, lm_moe_params *g);

#endif

/* Expert parallelism for the CPU MoE layer (docs/scaleout.md; SPEC §9).
 *
 * R ranks of a communicator split the n routed experts: rank r owns experts
 * [r n / R, (r+1) n / R) (n must be divisible by R) and holds only their
 * gate, up and down weights. The router, its top-k, the balancing bias, the
 * LatentMoE projections and the shared experts are replicated. Each rank
 * routes its own tokens; the (token, slot) rows, grouped by expert, go to
 * their owners by one all-to-all (the per-expert row counts are exchanged
 * first), each owner runs its experts as one dense product over the rows it
 * received (ordered by source rank, then the source's token order: with
 * ranks holding consecutive token blocks this is the global token order of
 * one process), and the outputs return by the reverse all-to-all to the same
 * grouped rows, where the layer combines them in slot order as on one
 * process. The backward mirrors it: the output gradients go to the owners,
 * the expert weight gradients stay there, the input gradients come back.
 *
 * Every call of lm_moe_forward_ep / lm_moe_backward_ep is collective over the
 * handle's ranks (a rank with no tokens still calls). One lm_moe_ep per MoE
 * layer: it keeps the owner's activations of the last forward for the
 * backward. */
#ifndef LONGMOE_MOE_EP_H
#define LONGMOE_MOE_EP_H

#include <stdint.h>

#include "longmoe/comm.h"
#include "longmoe/core.h"
#include "longmoe/moe.h"

#ifdef __cplusplus
extern "C" {
#endif

typedef struct lm_moe_ep lm_moe_ep;

/* A handle over the ranks of comm (which must outlive it) for layers of
 * config cfg. n_experts not divisible by the number of ranks is LM_ERR_ARG. */
lm_status lm_moe_ep_create(lm_comm *comm, const lm_moe_config *cfg, lm_moe_ep **out);
void lm_moe_ep_free(lm_moe_ep *ep);

/* The experts this rank owns: [first, first + count). */
int lm_moe_ep_first_expert(const lm_moe_ep *ep);
int lm_moe_ep_local_experts(const lm_moe_ep *ep);

/* Rows this rank's experts received in the last forward (all sources). */
int64_t lm_moe_ep_rows_received(const lm_moe_ep *ep);

/* The bytes of the owner's buffers a handle of cfg over R ranks holds once a
 * forward received `rows` rows (the memory plan); 0 when cfg is invalid or
 * n_experts is not divisible by R. */
size_t lm_moe_ep_plan_bytes(const lm_moe_config *cfg, int R, int64_t rows);

/* The ranks agree on a failure (a one-integer sum): returns `mine` when it
 * is an error, an LM_ERR_NUMERIC error naming another rank when only another
 * rank failed, else LM_OK. Collective. lm_moe_forward_ep calls it after the
 * routing, before the exchange. */
lm_status lm_moe_ep_agree(lm_moe_ep *ep, lm_status mine);
/* The same over any host-memory handle (a device engine's lm_comm_host). */
lm_status lm_moe_ep_agree_on(lm_comm *comm, lm_status mine);

/* The layer of lm_moe_forward / lm_moe_backward with the routed experts
 * spread over the ranks. p->gate, p->up, p->down (and g's) point at this
 * rank's slice [count, ...] of the expert tensors; everything else is whole.
 * x, y, dx, dy are this rank's m tokens. The backward's gradients are this
 * rank's contributions (the replicated parts are summed over ranks by the
 * caller, as in data parallelism); the expert gradients are complete for the
 * rows all ranks sent. dx is written, as in lm_moe_backward. ep == NULL is
 * the one-process layer. */
lm_status lm_moe_forward_ep(float *y, const float *x, const float *b, const lm_moe_config *cfg,
                            const lm_moe_params *p, lm_moe_acts *acts, int64_t m, lm_moe_ep *ep);
lm_status lm_moe_backward_ep(float *dx, lm_moe_params *g, const float *dy, const float *x,
                             const float *dscores_extra, const lm_moe_config *cfg, const lm_moe_params *p,
                             lm_moe_acts *acts, lm_moe_ep *ep);

#ifdef __cplusplus
}
#endif
#endif

/* Sizing a parallel layout (`longmoe plan --layout`; docs/scaleout.md).
 *
 * A layout DP,EP,CP,PP[,TP] puts DP x CP x PP x TP GPUs to work: TP ranks
 * split every matrix, CP ranks split each sequence, PP stages split the
 * layers, DP replicas split the batch, and EP (a divisor of DP x CP) splits
 * the routed experts among the data-parallel ranks. Ranks are numbered TP
 * fastest, then CP, then DP, then PP, so a group of `size` ranks `stride`
 * apart stays inside a node of G GPUs when stride x size <= G (NVLink) and
 * crosses nodes otherwise (InfiniBand).
 *
 * Everything is an estimate from the formulas in docs/scaleout.md, per GPU
 * and per optimizer step, for the busiest pipeline stage. */
#ifndef LONGMOE_LAYOUT_PLAN_H
#define LONGMOE_LAYOUT_PLAN_H

#include <stdint.h>

#include "longmoe/config.h"

#ifdef __cplusplus
extern "C" {
#endif

#define LM_LAYOUT_MAX_STAGES 256

typedef struct {
    int dp, ep, cp, pp, tp;
} lm_layout;

typedef struct {
    int gpus_per_node;        /* G (8) */
    double nvlink_bytes_per_s; /* per GPU, within a node (900e9) */
    double ib_bytes_per_s;     /* per GPU, across nodes (400 Gb/s = 50e9) */
    double peak_flops;         /* dense bf16 per GPU (989e12, H200) */
    double mfu;                /* fraction of peak the compute reaches (0.4) */
} lm_cluster;

typedef enum {
    LM_COLL_GRAD_REDUCE_SCATTER = 0, /* fp32 gradients, ZeRO-1: dense over DPxCP, experts over DPxCP/EP */
    LM_COLL_PARAM_ALL_GATHER,        /* updated bf16 weights back from the optimizer shards */
    LM_COLL_EP_ALL_TO_ALL,           /* tokens to experts and back, forward and backward */
    LM_COLL_QB_HISTOGRAM,            /* one n x B int32 all-reduce per MoE layer */
    LM_COLL_CP_KDA_STATE,            /* KDA segment maps gathered, forward and backward */
    LM_COLL_CP_MLA_LATENT,           /* MLA latents gathered, forward; their gradients, backward */
    LM_COLL_PP_ATTNRES,              /* Block AttnRes sources (and gradients) across a stage boundary */
    LM_COLL_TP_ALL_REDUCE,           /* activations of the split matrices */
    LM_COLL_COUNT
} lm_collective;

const char *lm_collective_name(lm_collective c);

typedef struct {
    lm_layout layout;
    int n_gpus;
    int64_t seq_len, global_tokens;
    int micro_batches;          /* sequences per DP replica per step (pipeline micro-batches) */
    int64_t tokens_per_gpu;     /* of one micro-batch: seq_len / (CP x TP) */
    int busiest_stage;
    /* stages: first layer and layer count; sources crossing the boundary after stage s */
    int stage_first_layer[LM_LAYOUT_MAX_STAGES], stage_layers[LM_LAYOUT_MAX_STAGES];
    int boundary_sources[LM_LAYOUT_MAX_STAGES];
    /* memory per GPU (bytes), busiest stage */
    double dense_params, expert_params; /* parameters held by one GPU */
    double weight_bytes, grad_bytes, optimizer_bytes, activation_bytes, total_bytes;
    /* compute */
    double flops_per_gpu, compute_s, bubble_fraction;
    /* collectives: bytes one GPU sends per step, the group, its link, its time */
    double coll_bytes[LM_COLL_COUNT];
    int coll_group[LM_COLL_COUNT];
    int coll_crosses_nodes[LM_COLL_COUNT];
    double coll_s[LM_COLL_COUNT];
    double step_s; /* compute with the bubble, gradient traffic hidden under it, + the rest */
} lm_layout_plan;

/* Defaults: 8 GPUs a node, NVLink 900 GB/s, IB 400 Gb/s, 989 TFLOP/s, MFU 0.4. */
lm_cluster lm_cluster_default(void);

/* Parse "DP,EP,CP,PP" or "DP,EP,CP,PP,TP" (TP default 1). */
lm_status lm_layout_parse(const char *text, lm_layout *out);

/* Size `layout` for `c` at sequences of seq_len tokens and global_tokens per
 * optimizer step (a multiple of DP x seq_len). */
lm_status lm_layout_plan_compute(const lm_config *c, const lm_layout *layout, const lm_cluster *cluster,
                                 int64_t seq_len, int64_t global_tokens, lm_layout_plan *out);

#ifdef __cplusplus
}
#endif
#endif

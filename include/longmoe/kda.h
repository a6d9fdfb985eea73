/* Kimi Delta Attention (KDA): linear attention with a per-channel decay gate
 * and the delta rule (docs/kda.md; SPEC §2).
 *
 * Shapes (row-major, fp32): B sequences, T tokens, H heads, key dim K, value dim V.
 *   q, k, z  [B,T,H,K]   queries, keys, raw gate input (used as given: any
 *                        normalisation of q and k happens in the layer)
 *   v        [B,T,H,V]
 *   beta     [B,T,H]     delta-rule step sizes in [0, 1] (a sigmoid; in fp32 it
 *                        reaches 0 and 1 exactly, so the closed interval)
 *   A_log    [H]         gate scale exponent A_h (initialised to 0)
 *   dt_bias  [H*K]       gate bias per head and key channel
 *   h0, ht   [B,H,K,V]   initial / final recurrent state (optional)
 *   o        [B,T,H,V]
 *
 * Gate per head h and key channel d (fp32):
 *   bounded:  g = g_min * sigmoid(exp(A_h) * (z + dt_bias)),  g in [g_min, 0]
 *             (0 only where the fp32 sigmoid underflows, exp(A_h)(z+dt_bias) < ~-104)
 *   softplus: g = -exp(A_h) * softplus(z + dt_bias), clamped below at -1e4 (where
 *             e^g is already 0 in fp32; docs/kda.md)
 * Recurrence: S_t = Diag(e^{g_t}) S_{t-1};  S_t += beta_t k_t (v_t - S_t^T k_t)^T;
 *             o_t = scale * S_t^T q_t.
 *
 * The chunked form processes chunks of C = 16, 32 or 64 tokens split into
 * sub-chunks of 16. With the bounded gate every intra-chunk product, the
 * diagonal sub-chunk included, is a small matrix product on exponent-factored
 * operands; with the softplus gate the diagonal sub-chunk is computed per
 * position pair (the fallback). */
#ifndef LONGMOE_KDA_H
#define LONGMOE_KDA_H

#include <stddef.h>

#include "longmoe/core.h"

#ifdef __cplusplus
extern "C" {
#endif

typedef enum { LM_KDA_GATE_BOUNDED = 0, LM_KDA_GATE_SOFTPLUS = 1 } lm_kda_gate;

/* How the diagonal sub-chunk of the chunked form is computed. */
typedef enum {
    LM_KDA_DIAG_AUTO = 0,     /* factored when the gate is bounded and safe, else pairwise */
    LM_KDA_DIAG_FACTORED = 1, /* one small matrix product on exponent-factored operands */
    LM_KDA_DIAG_PAIRWISE = 2  /* e^{G_i - G_j} per position pair (the fallback) */
} lm_kda_diag;

#define LM_KDA_SUBCHUNK 16
#define LM_KDA_G_MIN_DEFAULT (-5.0f)
/* Lowest g_min for which the factored diagonal path is exact in fp32/bf16 range. */
#define LM_KDA_G_MIN_FAST_LIMIT (-5.0f)

typedef struct {
    int B, T, H, K, V;
    lm_kda_gate gate;
    float g_min;      /* bounded gate's lower bound, in [-5, 0) (checked) */
    float scale;      /* output scale; 0 means K^-1/2 */
    int chunk;        /* 16, 32 or 64 (chunked form only) */
    lm_kda_diag diag; /* LM_KDA_DIAG_AUTO unless testing a path */
    /* Caller-planned scratch (NULL: the operator allocates its own per call).
     * Used when workspace_bytes >= lm_kda_workspace_bytes(cfg) (which covers
     * the forward too); otherwise the operator allocates. */
    void *workspace;
    size_t workspace_bytes;
    /* A backend that can keep the training forward's intermediates for the
     * backward (the GPU's; backend.h kda_kept_bytes): the forward fills this
     * buffer and the backward on the same inputs reads it instead of
     * recomputing them (NULL: it recomputes). The CPU operator ignores it. */
    void *kept;
    size_t kept_bytes;
    /* Where the GPU's backward writes dz: its rows (tokens) dz_ld elements
     * apart (>= H*K), a column block of a wider operand whose other columns
     * are not written; 0: dense (H*K). The CPU operator takes 0 or H*K only. */
    int64_t dz_ld;
} lm_kda_config;

typedef struct {
    const float *q, *k, *v, *z, *beta, *A_log, *dt_bias;
    const float *h0; /* NULL: zero initial state */
} lm_kda_inputs;

/* Gradients; each pointer has its input's shape. The backward ACCUMULATES
 * (+=) into them, llm.c style: callers zero them first. dh0 may be NULL. */
typedef struct {
    float *dq, *dk, *dv, *dz, *dbeta, *dA_log, *ddt_bias, *dh0;
} lm_kda_grads;

/* A config with the defaults (bounded gate, g_min -5, chunk 64, auto path). */
lm_kda_config lm_kda_config_default(int B, int T, int H, int K, int V);

/* Validate shapes, chunk size, g_min, that A_log, dt_bias are finite and
 * that every beta lies in [0, 1] (one pass over beta; a non-finite one is
 * LM_ERR_NUMERIC, a finite one outside LM_ERR_ARG, each naming the element).
 * Every forward and backward entry point checks this. */
lm_status lm_kda_check(const lm_kda_config *cfg, const lm_kda_inputs *in);

/* The diagonal path the chunked form takes for this config. */
lm_kda_diag lm_kda_diag_path(const lm_kda_config *cfg);

/* Whether e^{+-span} for span = |g_min| * (LM_KDA_SUBCHUNK - 1) stays finite and
 * normal in `format` (F32, BF16 or F16): the condition of the factored path. */
int lm_kda_factored_safe(float g_min, lm_dtype format);

/* The gate alone: g [B,T,H,K] from z, A_log, dt_bias. */
lm_status lm_kda_gate_forward(const lm_kda_config *cfg, const float *z, const float *A_log,
                              const float *dt_bias, float *g);

/* Recurrent form (the definition; used for decode). ht may be NULL. */
lm_status lm_kda_recurrent_forward(const lm_kda_config *cfg, const lm_kda_inputs *in, float *o,
                                   float *ht);

/* Chunked form (training). ht may be NULL. */
lm_status lm_kda_chunk_forward(const lm_kda_config *cfg, const lm_kda_inputs *in, float *o,
                               float *ht);

/* Bytes lm_kda_chunk_backward allocates internally for this config (the
 * per-chunk incoming states of the pairs in flight and per-thread scratch);
 * 0 for an invalid config. The forward needs per-thread scratch only. */
size_t lm_kda_workspace_bytes(const lm_kda_config *cfg);

/* Backward of the chunked form given do [B,T,H,V] and dht [B,H,K,V] (NULL:
 * zero). Recomputes what it needs from the inputs. */
lm_status lm_kda_chunk_backward(const lm_kda_config *cfg, const lm_kda_inputs *in,
                                const float *d_o, const float *dht, lm_kda_grads *grads);

#ifdef __cplusplus
}
#endif
#endif

/* Kimi Delta Attention on NVIDIA Hopper (sm_90a): chunked forward and
 * backward, and the one-token decode step (docs/cuda.md; SPEC §2).
 *
 * Precision: q, k, v, z, o and the per-token gradients dq, dk, dv, dz are
 * bf16 (stored as uint16_t bit patterns); beta, A_log, dt_bias, the gate g,
 * its cumulative sums, the recurrent state (h0, ht, the decode state), the
 * triangular inverse and every accumulator are fp32. Products run on tensor
 * cores with bf16 operands and fp32 accumulation.
 *
 * Shapes (row-major, device memory): as in longmoe/kda.h.
 *   q, k, z  [B,T,H,K] bf16     v, o [B,T,H,V] bf16     beta [B,T,H] fp32
 *   A_log    [H] fp32           dt_bias [H*K] fp32
 *   h0, ht   [B,H,K,V] fp32 (optional, NULL: zero initial state / not written)
 * Supported: K = V = 32, 64 or 128, chunk 64 (cfg->chunk 0 or 64), any T >= 1,
 * both gates. The diagonal sub-chunk is factored (tensor cores) when the gate
 * is bounded with g_min >= LM_KDA_G_MIN_FAST_LIMIT, pairwise otherwise, as
 * lm_kda_diag_path() decides for the CPU operator.
 *
 * Errors: bad arguments return LM_ERR_ARG, a failed device allocation
 * LM_ERR_MEMORY, any other CUDA runtime error LM_ERR_IO (the message names
 * the CUDA error). `stream` is a cudaStream_t (NULL: the default stream). */
#ifndef LONGMOE_KDA_CUDA_H
#define LONGMOE_KDA_CUDA_H

#include <stddef.h>
#include <stdint.h>

#include "longmoe/core.h"
#include "longmoe/kda.h"

#ifdef __cplusplus
extern "C" {
#endif

/* Device inputs of the chunked form and of the decode step. */
typedef struct {
    const uint16_t *q, *k, *v, *z; /* bf16 */
    const float *beta, *A_log, *dt_bias;
    const float *h0; /* NULL: zero initial state */
} lm_kda_cuda_inputs;

/* Device gradients. dq, dk, dv, dz and dbeta are WRITTEN (=), one value per
 * token; dA_log and ddt_bias are ACCUMULATED (+=): each chunk's terms go to
 * the workspace and one kernel adds their sum over chunks and sequences, in a
 * fixed order (in double), so they are bit-identical from run to run; dh0
 * (may be NULL) is written. */
typedef struct {
    uint16_t *dq, *dk, *dv, *dz; /* bf16 */
    float *dbeta, *dA_log, *ddt_bias, *dh0;
} lm_kda_cuda_grads;

/* Validate a config for the CUDA kernels (shape, chunk, K = V in {32,64,128}). */
lm_status lm_kda_cuda_check(const lm_kda_config *cfg);

/* Bytes of device workspace the forward (for_backward = 0) or the backward
 * (for_backward = 1) needs; the caller allocates it (cudaMalloc) once. The
 * forward's count includes the residue arrays of the precise state path
 * (used when ht is asked for); a backward-sized workspace serves both. */
size_t lm_kda_cuda_workspace_bytes(const lm_kda_config *cfg, int for_backward);

/* Chunked forward: o [B,T,H,V] bf16, ht [B,H,K,V] fp32 (NULL: not written).
 * Asking for ht selects the precise state path: U and Kd carry their bf16
 * rounding residues and the state update runs as three bf16 products, so ht
 * matches the fp32 recurrence to about 1e-5 instead of 1e-3 (docs/cuda.md,
 * Precision); it costs a little more forward time and, in the forward-only
 * workspace, two more [B,H,N,64,K] bf16 arrays.
 * Given a workspace of at least lm_kda_cuda_workspace_bytes(cfg, 1) bytes
 * (training), it also keeps there what the backward needs (the triangular
 * inverse, the chunk states, V'), so that a backward on the same inputs and
 * workspace can skip its recomputation (forward_saved = 1 below).
 * q, k, v, z, o, the workspace (and, for the backward, d_o, dq, dk, dv, dz)
 * must be 16-byte aligned, as cudaMalloc's pointers are: the kernels move
 * them in 16-byte pieces (misaligned pointers are refused with LM_ERR_ARG).
 * B*H must be at most 65535. */
lm_status lm_kda_cuda_chunk_forward(const lm_kda_config *cfg, const lm_kda_cuda_inputs *in,
                                    uint16_t *o, float *ht, void *workspace,
                                    size_t workspace_bytes, void *stream);

/* Chunked backward given d_o [B,T,H,V] bf16 and dht [B,H,K,V] fp32 (NULL:
 * zero). forward_saved = 0: recompute the forward intermediates in the
 * workspace first; 1: the workspace still holds them from the last
 * lm_kda_cuda_chunk_forward on the same cfg, inputs and (backward-sized)
 * workspace, which saves about a forward's time. */
lm_status lm_kda_cuda_chunk_backward(const lm_kda_config *cfg, const lm_kda_cuda_inputs *in,
                                     const uint16_t *d_o, const float *dht,
                                     const lm_kda_cuda_grads *grads, void *workspace,
                                     size_t workspace_bytes, int forward_saved, void *stream);

/* Bytes of the forward's intermediates that a training backward reads (the
 * chunk operands, the triangular inverse, the chunk states, V'): the leading
 * part of a backward-sized workspace. */
size_t lm_kda_cuda_kept_bytes(const lm_kda_config *cfg);

/* The training forward and the backward with the forward's intermediates in a
 * buffer of their own, `kept` (at least lm_kda_cuda_kept_bytes), and the rest
 * of a backward-sized workspace in `scratch` (at least
 * lm_kda_cuda_workspace_bytes(cfg, 1) - lm_kda_cuda_kept_bytes(cfg)): the
 * forward fills kept, the backward reads it and recomputes nothing; between
 * the two, scratch may serve other operators (a model keeps one such buffer a
 * layer). The same bits as the one-workspace calls with forward_saved = 1;
 * alignment as above. */
lm_status lm_kda_cuda_chunk_forward_kept(const lm_kda_config *cfg, const lm_kda_cuda_inputs *in, uint16_t *o,
                                         float *ht, void *kept, size_t kept_bytes, void *scratch,
                                         size_t scratch_bytes, void *stream);
lm_status lm_kda_cuda_chunk_backward_kept(const lm_kda_config *cfg, const lm_kda_cuda_inputs *in,
                                          const uint16_t *d_o, const float *dht, const lm_kda_cuda_grads *grads,
                                          const void *kept, size_t kept_bytes, void *scratch,
                                          size_t scratch_bytes, void *stream);

/* One decode token (cfg->T is ignored): q, k, z [B,H,K] bf16, v [B,H,V] bf16,
 * beta [B,H] fp32; state [B,H,K,V] fp32 is read and updated in place by the
 * recurrence of SPEC §2; o [B,H,V] bf16. in->h0 is ignored. */
lm_status lm_kda_cuda_decode_step(const lm_kda_config *cfg, const lm_kda_cuda_inputs *in,
                                  float *state, uint16_t *o, void *stream);

/* The state map's step across context-parallel segments (the mirror of
 * lm_kda_state_map_apply / _apply_transposed, longmoe/kda_state_map.h), device
 * fp32 arrays: per pair out = P S + Q, or P^T S + Q (transposed), with P
 * [K,K] and Q, S, out [K,V]; S NULL: zero. out must not overlap S. Each
 * element is one fixed-order dot product: the result depends only on the
 * inputs. n_pairs at most 65535. */
lm_status lm_kda_cuda_state_apply(int n_pairs, int K, int V, const float *P, const float *Q, const float *S,
                                  float *out, int transposed, void *stream);

/* ---- host convenience wrappers (fp32 host arrays, as longmoe/kda.h) ----
 * They round q, k, v, z and d_o to bf16, allocate device memory, run the
 * kernels on the default stream, copy back and free. For tests and
 * `longmoe op kda --device cuda`; not for training loops. */

/* o [B,T,H,V] (written), ht [B,H,K,V] (written; may be NULL). */
lm_status lm_kda_cuda_forward_host(const lm_kda_config *cfg, const lm_kda_inputs *in, float *o,
                                   float *ht);

/* Gradients ACCUMULATE (+=) into the host arrays, like lm_kda_chunk_backward;
 * dht and grads->dh0 may be NULL. */
lm_status lm_kda_cuda_backward_host(const lm_kda_config *cfg, const lm_kda_inputs *in,
                                    const float *d_o, const float *dht, lm_kda_grads *grads);

/* One token per sequence (in->q etc. are [B,1,H,*]); state [B,H,K,V] is
 * updated in place; o [B,H,V] is written. */
lm_status lm_kda_cuda_decode_host(const lm_kda_config *cfg, const lm_kda_inputs *in,
                                  float *state, float *o);

#ifdef __cplusplus
}
#endif
#endif

/* The state every CUDA operator of the model shares: one stream, one
 * cuBLASLt handle, one cuBLAS handle and their workspaces (docs/cuda.md), and
 * a side stream. Operators take a `const lm_cuda_context *` first and enqueue
 * their kernels on its stream (one that also uses the side stream makes the
 * stream wait for it before returning, so the stream orders every operator's
 * work); none of them synchronises or allocates, unless its header says so.
 *
 * Conventions of the CUDA operators (src/cuda/<op>, headers <op>_cuda.h):
 * - device pointers only; bf16 tensors are uint16_t bit patterns (as in
 *   kda_cuda.h), everything else fp32 unless named otherwise;
 * - matrix products take bf16 operands and accumulate in fp32;
 * - backward functions ACCUMULATE (+=) into fp32 gradients, as on the CPU;
 *   gradients reduced over tokens (norm weights, per-channel vectors) are
 *   summed in a fixed order (no atomics), so results are bit-identical from
 *   run to run on the same GPU;
 * - errors come back as lm_status with a message naming the argument or the
 *   CUDA error (LM_CUDA_TRY in src/cuda/cuda_check.h). */
#ifndef LONGMOE_CUDA_CONTEXT_H
#define LONGMOE_CUDA_CONTEXT_H

#include <stddef.h>

#include "longmoe/core.h"

#ifdef __cplusplus
extern "C" {
#endif

typedef struct {
    void *stream;          /* cudaStream_t */
    void *cublaslt;        /* cublasLtHandle_t */
    void *lt_workspace;    /* cuBLASLt workspace (device) */
    size_t lt_workspace_bytes;
    int device;            /* CUDA device ordinal */
    int sm_count;          /* multiprocessors of that device */
    void *cublas;          /* cublasHandle_t, bound to stream, with its own workspace */
    void *blas_workspace;  /* cuBLAS workspace (device) */
    size_t blas_workspace_bytes;
    void *host_pinned;     /* small pinned host buffer for counts read back (MoE row counts) */
    size_t host_pinned_bytes;
    /* A second stream for products that may run beside the stream's other work (the MoE
     * layer's weight gradients and some forward products, docs/moe.md), with its own cuBLAS
     * handle and workspace and two events (fork: the side waits for the stream; join: the
     * stream waits for the side). NULL where not created: the operators then run everything on
     * `stream`. */
    void *side_stream;     /* cudaStream_t */
    void *side_cublas;     /* cublasHandle_t, bound to side_stream */
    void *side_blas_workspace;
    void *side_fork, *side_join; /* cudaEvent_t, without timing */
} lm_cuda_context;

/* Create a stream, a cuBLASLt handle and a 32 MiB cuBLASLt workspace, a
 * cuBLAS handle on that stream with its own 32 MiB workspace, a 16 KiB
 * pinned host buffer, and the side stream with its cuBLAS handle, 32 MiB
 * workspace and events, on the current device. LM_ERR_IO (with the CUDA error) when no GPU can be used;
 * whatever was made before the failure is freed again. */
lm_status lm_cuda_context_create(lm_cuda_context *ctx);
void lm_cuda_context_destroy(lm_cuda_context *ctx);
/* Wait for the context's stream; report an error a kernel left behind. */
lm_status lm_cuda_context_sync(const lm_cuda_context *ctx);

/* A second stream and the events that order it against a context's stream
 * (the trainer's gradient sums overlapped with the backward, docs/scaleout.md):
 * a non-blocking stream; an event without timing; lm_cuda_stream_wait makes
 * `waiter` wait (on the device, the host returns at once) for the work enqueued
 * on `stream` so far, by recording `event` there. Destroying a stream waits for
 * it first. */
lm_status lm_cuda_stream_create(void **stream);
void lm_cuda_stream_destroy(void *stream);
lm_status lm_cuda_event_create(void **event);
void lm_cuda_event_destroy(void *event);
lm_status lm_cuda_stream_wait(void *waiter, void *stream, void *event);

/* Host <-> device helpers for tests and tools: they synchronise the whole
 * device before returning, so kernels then enqueued on a context stream see
 * the data (and downloads see every kernel enqueued before). */
lm_status lm_cuda_alloc(void **ptr, size_t bytes);   /* zeroed */
void lm_cuda_free(void *ptr);
lm_status lm_cuda_upload(void *dst, const void *src, size_t bytes);
lm_status lm_cuda_download(void *dst, const void *src, size_t bytes);
/* Upload fp32 host values as bf16 (round to nearest even), and back. */
lm_status lm_cuda_upload_bf16(uint16_t *dst, const float *src, size_t n);
lm_status lm_cuda_download_bf16(float *dst, const uint16_t *src, size_t n);

#ifdef __cplusplus
}
#endif
#endif

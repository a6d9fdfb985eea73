/* The shared CUDA context (include/longmoe/cuda_context.h). */
#include <stdlib.h>
#include <string.h>

#include <cublasLt.h>
#include <cublas_v2.h>
#include <cuda_runtime.h>

#include "check.h"
#include "cuda/cuda_check.h"
#include "longmoe/cuda_context.h"

#define LT_WORKSPACE_BYTES ((size_t)32 << 20)
#define BLAS_WORKSPACE_BYTES ((size_t)32 << 20)
#define HOST_PINNED_BYTES ((size_t)16 << 10)

#define LT_TRY(call)                                                                                      \
    do {                                                                                                  \
        cublasStatus_t s_ = (call);                                                                       \
        if (s_ != CUBLAS_STATUS_SUCCESS)                                                                  \
            return lm_error(LM_ERR_IO, "%s:%d: cuBLAS error %d (%s)", __FILE__, __LINE__, (int)s_, #call); \
    } while (0)

/* A non-blocking stream with a cuBLAS handle bound to it and the handle's own workspace. */
static lm_status blas_stream(void **stream, void **cublas, void **workspace) {
    cudaStream_t s;
    LM_CUDA_TRY(cudaStreamCreateWithFlags(&s, cudaStreamNonBlocking));
    *stream = s;
    cublasHandle_t b;
    LT_TRY(cublasCreate(&b));
    *cublas = b;
    LT_TRY(cublasSetStream(b, s));
    LM_CUDA_TRY(cudaMalloc(workspace, BLAS_WORKSPACE_BYTES));
    LT_TRY(cublasSetWorkspace(b, *workspace, BLAS_WORKSPACE_BYTES));
    return LM_OK;
}

static lm_status context_create(lm_cuda_context *ctx) {
    LM_CUDA_TRY(cudaGetDevice(&ctx->device));
    LM_CUDA_TRY(cudaDeviceGetAttribute(&ctx->sm_count, cudaDevAttrMultiProcessorCount, ctx->device));
    TRY(blas_stream(&ctx->stream, &ctx->cublas, &ctx->blas_workspace));
    ctx->blas_workspace_bytes = BLAS_WORKSPACE_BYTES;
    cublasLtHandle_t h;
    LT_TRY(cublasLtCreate(&h));
    ctx->cublaslt = h;
    LM_CUDA_TRY(cudaMalloc(&ctx->lt_workspace, LT_WORKSPACE_BYTES));
    ctx->lt_workspace_bytes = LT_WORKSPACE_BYTES;
    LM_CUDA_TRY(cudaMallocHost(&ctx->host_pinned, HOST_PINNED_BYTES));
    ctx->host_pinned_bytes = HOST_PINNED_BYTES;
    TRY(blas_stream(&ctx->side_stream, &ctx->side_cublas, &ctx->side_blas_workspace));
    TRY(lm_cuda_event_create(&ctx->side_fork));
    TRY(lm_cuda_event_create(&ctx->side_join));
    return LM_OK;
}

extern "C" lm_status lm_cuda_context_create(lm_cuda_context *ctx) {
    if (!ctx) return lm_error(LM_ERR_ARG, "cuda context: NULL");
    memset(ctx, 0, sizeof *ctx);
    lm_status st = context_create(ctx);
    if (st != LM_OK) lm_cuda_context_destroy(ctx); /* what was made is freed; the error stays the last one */
    return st;
}

extern "C" void lm_cuda_context_destroy(lm_cuda_context *ctx) {
    if (!ctx) return;
    if (ctx->stream) cudaStreamSynchronize((cudaStream_t)ctx->stream);
    if (ctx->side_stream) cudaStreamSynchronize((cudaStream_t)ctx->side_stream);
    if (ctx->side_cublas) cublasDestroy((cublasHandle_t)ctx->side_cublas);
    if (ctx->side_blas_workspace) cudaFree(ctx->side_blas_workspace);
    if (ctx->side_fork) cudaEventDestroy((cudaEvent_t)ctx->side_fork);
    if (ctx->side_join) cudaEventDestroy((cudaEvent_t)ctx->side_join);
    if (ctx->side_stream) cudaStreamDestroy((cudaStream_t)ctx->side_stream);
    if (ctx->lt_workspace) cudaFree(ctx->lt_workspace);
    if (ctx->cublaslt) cublasLtDestroy((cublasLtHandle_t)ctx->cublaslt);
    if (ctx->cublas) cublasDestroy((cublasHandle_t)ctx->cublas);
    if (ctx->blas_workspace) cudaFree(ctx->blas_workspace);
    if (ctx->host_pinned) cudaFreeHost(ctx->host_pinned);
    if (ctx->stream) cudaStreamDestroy((cudaStream_t)ctx->stream);
    memset(ctx, 0, sizeof *ctx);
}

extern "C" lm_status lm_cuda_context_sync(const lm_cuda_context *ctx) {
    LM_CUDA_TRY(cudaStreamSynchronize((cudaStream_t)ctx->stream));
    LM_CUDA_TRY(cudaGetLastError());
    return LM_OK;
}

extern "C" lm_status lm_cuda_stream_create(void **stream) {
    *stream = NULL;
    cudaStream_t s;
    LM_CUDA_TRY(cudaStreamCreateWithFlags(&s, cudaStreamNonBlocking));
    *stream = s;
    return LM_OK;
}

extern "C" void lm_cuda_stream_destroy(void *stream) {
    if (!stream) return;
    cudaStreamSynchronize((cudaStream_t)stream);
    cudaStreamDestroy((cudaStream_t)stream);
}

extern "C" lm_status lm_cuda_event_create(void **event) {
    *event = NULL;
    cudaEvent_t e;
    LM_CUDA_TRY(cudaEventCreateWithFlags(&e, cudaEventDisableTiming));
    *event = e;
    return LM_OK;
}

extern "C" void lm_cuda_event_destroy(void *event) {
    if (event) cudaEventDestroy((cudaEvent_t)event);
}

extern "C" lm_status lm_cuda_stream_wait(void *waiter, void *stream, void *event) {
    /* the wait takes the event's latest record, made just before: one event serves every call */
    LM_CUDA_TRY(cudaEventRecord((cudaEvent_t)event, (cudaStream_t)stream));
    LM_CUDA_TRY(cudaStreamWaitEvent((cudaStream_t)waiter, (cudaEvent_t)event, 0));
    return LM_OK;
}

extern "C" lm_status lm_cuda_alloc(void **ptr, size_t bytes) {
    *ptr = NULL;
    if (bytes == 0) bytes = 16;
    LM_CUDA_TRY(cudaMalloc(ptr, bytes));
    LM_CUDA_TRY(cudaMemset(*ptr, 0, bytes));
    /* the context's stream does not wait for the legacy default stream */
    LM_CUDA_TRY(cudaDeviceSynchronize());
    return LM_OK;
}

extern "C" void lm_cuda_free(void *ptr) {
    if (ptr) cudaFree(ptr);
}

extern "C" lm_status lm_cuda_upload(void *dst, const void *src, size_t bytes) {
    LM_CUDA_TRY(cudaMemcpy(dst, src, bytes, cudaMemcpyHostToDevice));
    /* a pageable copy may return before its DMA lands; the context's stream does not wait for it */
    LM_CUDA_TRY(cudaDeviceSynchronize());
    return LM_OK;
}

extern "C" lm_status lm_cuda_download(void *dst, const void *src, size_t bytes) {
    LM_CUDA_TRY(cudaDeviceSynchronize());
    LM_CUDA_TRY(cudaMemcpy(dst, src, bytes, cudaMemcpyDeviceToHost));
    return LM_OK;
}

extern "C" lm_status lm_cuda_upload_bf16(uint16_t *dst, const float *src, size_t n) {
    uint16_t *h = (uint16_t *)malloc((n ? n : 1) * sizeof(uint16_t));
    if (!h) return lm_error(LM_ERR_MEMORY, "upload_bf16: out of host memory for %zu values", n);
    for (size_t i = 0; i < n; i++) h[i] = lm_f32_to_bf16(src[i]);
    cudaError_t e = cudaMemcpy(dst, h, n * sizeof(uint16_t), cudaMemcpyHostToDevice);
    if (e == cudaSuccess) e = cudaDeviceSynchronize();
    free(h);
    LM_CUDA_TRY(e);
    return LM_OK;
}

extern "C" lm_status lm_cuda_download_bf16(float *dst, const uint16_t *src, size_t n) {
    uint16_t *h = (uint16_t *)malloc((n ? n : 1) * sizeof(uint16_t));
    if (!h) return lm_error(LM_ERR_MEMORY, "download_bf16: out of host memory for %zu values", n);
    cudaError_t e = cudaDeviceSynchronize();
    if (e == cudaSuccess) e = cudaMemcpy(h, src, n * sizeof(uint16_t), cudaMemcpyDeviceToHost);
    if (e == cudaSuccess)
        for (size_t i = 0; i < n; i++) dst[i] = lm_bf16_to_f32(h[i]);
    free(h);
    LM_CUDA_TRY(e);
    return LM_OK;
}

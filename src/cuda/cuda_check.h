/* CUDA error checks in the spirit of llm.c.
 *
 * cudaCheck(call): for tests, benches and tools, where there is nothing to
 * unwind: prints file, line, the CUDA error and a hint, then exits.
 * LM_CUDA_TRY(call): for library code: returns an lm_status (LM_ERR_MEMORY for
 * an allocation failure, LM_ERR_IO for any other CUDA error) with the same
 * message, recorded through lm_error(). */
#ifndef LONGMOE_CUDA_CHECK_H
#define LONGMOE_CUDA_CHECK_H

#include <stdio.h>
#include <stdlib.h>

#include <cuda_runtime_api.h>

#include "longmoe/core.h"

static inline const char *lm_cuda_hint(cudaError_t e) {
    switch (e) {
    case cudaErrorMemoryAllocation: return "out of device memory: reduce B or T";
    case cudaErrorNoDevice: return "no CUDA device visible: run on the GPU machine";
    case cudaErrorInsufficientDriver: return "the driver is older than the CUDA runtime";
    case cudaErrorNoKernelImageForDevice:
        return "no kernel image for this GPU: the kernels are built for sm_90a (Hopper)";
    case cudaErrorInvalidValue: return "an argument is out of range (shared memory size?)";
    case cudaErrorIllegalAddress: return "a kernel read or wrote outside its buffers";
    default: return "see the CUDA error above";
    }
}

static inline void lm_cuda_check_at(cudaError_t e, const char *file, int line) {
    if (e != cudaSuccess) {
        fprintf(stderr, "[CUDA ERROR] %s:%d: %s (%s); hint: %s\n", file, line,
                cudaGetErrorName(e), cudaGetErrorString(e), lm_cuda_hint(e));
        exit(EXIT_FAILURE);
    }
}
#define cudaCheck(call) lm_cuda_check_at((call), __FILE__, __LINE__)

#define LM_CUDA_TRY(call)                                                                     \
    do {                                                                                      \
        cudaError_t e_ = (call);                                                              \
        if (e_ != cudaSuccess)                                                                \
            return lm_error(e_ == cudaErrorMemoryAllocation ? LM_ERR_MEMORY : LM_ERR_IO,       \
                            "%s:%d: CUDA error %s (%s); hint: %s", __FILE__, __LINE__,        \
                            cudaGetErrorName(e_), cudaGetErrorString(e_), lm_cuda_hint(e_)); \
    } while (0)

#endif

/* The products' profile (lm_cuda_matmul_profile, include/longmoe/linear_cuda.h;
 * src/cuda/linear/matmul_profile.h): while it is on, each product is bracketed by two CUDA events
 * on its stream and its shape kept; print sums them by shape. A benchmark's tool: events made and
 * recorded around every product lengthen the step a little. */
#include <stdint.h>
#include <stdio.h>
#include <string.h>

#include <algorithm>
#include <mutex>
#include <vector>

#include "cuda/cuda_check.h"
#include "cuda/linear/matmul_profile.h"
#include "longmoe/linear_cuda.h"

typedef struct {
    lm_cuda_prof_shape shape;
    cudaEvent_t e0, e1;
} prof_record;
static std::mutex prof_mutex;
static std::vector<prof_record> prof_records;
/* set between steps by the thread that runs the benchmark; read by the threads that launch products */
static int prof_on = 0, prof_failed = 0;

extern "C" void lm_cuda_matmul_profile(int on) {
    std::lock_guard<std::mutex> lock(prof_mutex);
    prof_on = on;
}

cudaEvent_t lm_cuda_prof_begin(cudaStream_t stream) {
    cudaEvent_t e0 = NULL;
    if (!prof_on) return NULL;
    if (cudaEventCreate(&e0) != cudaSuccess || cudaEventRecord(e0, stream) != cudaSuccess) {
        (void)cudaGetLastError(); /* not left for the next launch's check */
        prof_failed = 1;
        if (e0) cudaEventDestroy(e0);
        return NULL;
    }
    return e0;
}

void lm_cuda_prof_end(cudaStream_t stream, cudaEvent_t e0, const lm_cuda_prof_shape *shape) {
    if (!e0) return;
    prof_record r = {*shape, e0, NULL};
    if (cudaEventCreate(&r.e1) != cudaSuccess || cudaEventRecord(r.e1, stream) != cudaSuccess) {
        (void)cudaGetLastError();
        prof_failed = 1;
        cudaEventDestroy(e0);
        if (r.e1) cudaEventDestroy(r.e1);
        return;
    }
    std::lock_guard<std::mutex> lock(prof_mutex);
    prof_records.push_back(r);
}

static int same_shape(const lm_cuda_prof_shape *a, const lm_cuda_prof_shape *b) {
    return !strcmp(a->kind, b->kind) && a->m == b->m && a->n == b->n && a->k == b->k && a->ta == b->ta &&
           a->tb == b->tb && a->d_bf16 == b->d_bf16 && a->beta == b->beta;
}

extern "C" lm_status lm_cuda_matmul_profile_print(void *file, int steps) {
    FILE *f = (FILE *)file;
    std::lock_guard<std::mutex> lock(prof_mutex);
    lm_status st = LM_OK;
    if (!f) st = lm_error(LM_ERR_ARG, "lm_cuda_matmul_profile_print: file is NULL");
    if (steps < 1) steps = 1;
    if (!st && cudaDeviceSynchronize() != cudaSuccess) st = lm_error(LM_ERR_IO, "matmul profile: the device failed");
    /* one row a shape: the records' sums */
    typedef struct {
        lm_cuda_prof_shape key;
        long calls;
        double batch, ms, flop;
    } row;
    std::vector<row> rows;
    double total_ms = 0, total_flop = 0;
    for (const prof_record &r : prof_records) {
        float ms = 0;
        if (!st && cudaEventElapsedTime(&ms, r.e0, r.e1) != cudaSuccess)
            st = lm_error(LM_ERR_IO, "matmul profile: an event could not be read");
        cudaEventDestroy(r.e0);
        cudaEventDestroy(r.e1);
        size_t i = 0;
        while (i < rows.size() && !same_shape(&rows[i].key, &r.shape)) i++;
        if (i == rows.size()) rows.push_back(row{r.shape, 0, 0.0, 0.0, 0.0});
        const double flop = 2.0 * (double)r.shape.m * (double)r.shape.n * (double)r.shape.k * (double)r.shape.batch;
        rows[i].calls++;
        rows[i].batch += (double)r.shape.batch;
        rows[i].ms += ms;
        rows[i].flop += flop;
        total_ms += ms;
        total_flop += flop;
    }
    prof_records.clear();
    if (!st && prof_failed) st = lm_error(LM_ERR_IO, "matmul profile: an event could not be made");
    prof_failed = 0;
    if (st) return st;
    std::sort(rows.begin(), rows.end(), [](const row &a, const row &b) { return a.ms > b.ms; });
    fprintf(f, "products by shape (cuBLAS's column-major m n k and operations; a step, over %d):\n", steps);
    fprintf(f, "  %-7s %7s %7s %7s  %-2s %4s %4s  %6s %7s %9s %9s %7s\n", "kind", "m", "n", "k", "op", "beta", "D",
            "calls", "batch", "ms", "us/call", "TFLOP/s");
    for (const row &r : rows)
        fprintf(f, "  %-7s %7llu %7llu %7llu  %c%c %4g %4s  %6.1f %7.1f %9.3f %9.1f %7.1f\n", r.key.kind,
                (unsigned long long)r.key.m, (unsigned long long)r.key.n, (unsigned long long)r.key.k,
                r.key.ta ? 'T' : 'N', r.key.tb ? 'T' : 'N', (double)r.key.beta, r.key.d_bf16 ? "bf16" : "fp32",
                (double)r.calls / steps, r.batch / (double)r.calls, r.ms / steps, 1e3 * r.ms / (double)r.calls,
                r.ms > 0 ? r.flop / (r.ms * 1e-3) / 1e12 : 0.0);
    fprintf(f, "  total: %.3f ms a step, %.1f TFLOP/s\n", total_ms / steps,
            total_ms > 0 ? total_flop / (total_ms * 1e-3) / 1e12 : 0.0);
    return LM_OK;
}

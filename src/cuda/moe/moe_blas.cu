/* The MoE products through cuBLAS (src/cuda/moe/moe_internal.cuh), and the
 * selector of how the expert products run (include/longmoe/moe_cuda.h).
 *
 * Row-major to cuBLAS (column-major). Our products are row-major
 * C[M,N] = A B with ldc; read column-major, that array is C^T [N x M] with
 * leading dimension ldc, and C^T = B^T A^T. So every call passes m = N,
 * n = M, k = K, cuBLAS's first operand is our b and its second our a, and
 * the transposes follow from how each array reads column-major:
 *   NT: b holds W[N,K] row-major (B(kk,c) = b[c ldb + kk]): column-major it
 *       is K x N = B, so op T gives B^T. a holds A[M,K] row-major: column-major
 *       K x M = A^T, op N.             -> cublas(T, N, N, M, K, b, ldb, a, lda)
 *   NN: b holds B[K,N] row-major (b[kk ldb + c]): column-major N x K = B^T,
 *       op N. a as in NT, op N.        -> cublas(N, N, N, M, K, b, ldb, a, lda)
 *   TN: b as in NN, op N. a holds A^T, i.e. [K,M] row-major (a[kk lda + i]):
 *       column-major M x K = A, op T gives A^T.
 *                                      -> cublas(N, T, N, M, K, b, ldb, a, lda)
 * Each leading dimension is the row length of the row-major array, which is
 * the column-major row count cuBLAS asks for.
 *
 * Grouped products, expert j with cnt_j = offsets[j+1] - offsets[j] real rows
 * starting at grouped row r_j = padded_offsets[j]:
 *   NT, NN (rows):    M = cnt_j, a + r_j lda, b + j b_group_stride, c + r_j ldc;
 *   TN (weights):     K = cnt_j, a + r_j lda, b + r_j ldb, c + j c_group_stride.
 * Experts with cnt_j = 0 are left out (a weight gradient then receives
 * nothing, which is right since those products accumulate). */
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include <cublas_v2.h>

#include "cuda/common/switch_setting.cuh"
#include "cuda/cuda_check.h"
#include "cuda/linear/matmul_profile.h"
#include "check.h"
#include "cuda/moe/moe_internal.cuh"
#include "longmoe/moe_cuda.h"

#define BLAS_TRY(call)                                                                                    \
    do {                                                                                                  \
        cublasStatus_t s_ = (call);                                                                       \
        if (s_ != CUBLAS_STATUS_SUCCESS)                                                                  \
            return lm_error(LM_ERR_IO, "%s:%d: cuBLAS error %d (%s)", __FILE__, __LINE__, (int)s_, #call); \
    } while (0)

/* BLAS_TRY with the product timed while the products' profile is on (matmul_profile.h): cuBLAS's
 * m n k and operations, `count` products of one call */
#define BLAS_PROF(kind, opa, opb, m, n, k, count, d_bf16, beta, call)                                    \
    do {                                                                                                  \
        cudaEvent_t e0_ = lm_cuda_prof_begin((cudaStream_t)ctx->stream);                                 \
        cublasStatus_t s_ = (call);                                                                       \
        if (s_ != CUBLAS_STATUS_SUCCESS) {                                                                \
            if (e0_) cudaEventDestroy(e0_);                                                               \
            return lm_error(LM_ERR_IO, "%s:%d: cuBLAS error %d (%s)", __FILE__, __LINE__, (int)s_, #call); \
        }                                                                                                 \
        if (e0_) {                                                                                        \
            const lm_cuda_prof_shape sh_ = {kind, (uint64_t)(m), (uint64_t)(n), (uint64_t)(k),            \
                                            (uint64_t)(count), (opa) == CUBLAS_OP_T, (opb) == CUBLAS_OP_T, \
                                            (d_bf16), (beta)};                                            \
            lm_cuda_prof_end((cudaStream_t)ctx->stream, e0_, &sh_);                                      \
        }                                                                                                 \
    } while (0)

/* ---- the selector ---- */

static int selected_kind = -1;     /* -1: not read yet */
static char bad_env[64];           /* an unknown LONGMOE_MOE_GEMM value, kept for the error */

extern "C" int lm_cuda_moe_gemm_parse(const char *name) {
    if (!name) return -1;
    if (!strcmp(name, "batched")) return LM_MOE_GEMM_BATCHED;
    if (!strcmp(name, "grouped")) return LM_MOE_GEMM_GROUPED;
    if (!strcmp(name, "loop")) return LM_MOE_GEMM_LOOP;
    if (!strcmp(name, "wmma")) return LM_MOE_GEMM_WMMA;
    if (!strcmp(name, "wgmma")) return LM_MOE_GEMM_WGMMA;
    return -1;
}

extern "C" const char *lm_cuda_moe_gemm_name(lm_moe_gemm_kind kind) {
    switch (kind) {
    case LM_MOE_GEMM_GROUPED: return "grouped";
    case LM_MOE_GEMM_LOOP: return "loop";
    case LM_MOE_GEMM_WMMA: return "wmma";
    case LM_MOE_GEMM_BATCHED: return "batched";
    case LM_MOE_GEMM_WGMMA: return "wgmma";
    }
    return "unknown";
}

extern "C" lm_status lm_cuda_moe_gemm(lm_moe_gemm_kind *kind) {
    if (selected_kind < 0) {
        const char *env = getenv("LONGMOE_MOE_GEMM");
        int k = LM_MOE_GEMM_BATCHED;
        if (env && *env) {
            k = lm_cuda_moe_gemm_parse(env);
            if (k < 0) snprintf(bad_env, sizeof bad_env, "%s", env);
        }
        selected_kind = k < 0 ? -2 : k;
    }
    if (selected_kind == -2)
        return lm_error(LM_ERR_ARG, "LONGMOE_MOE_GEMM=%s: expected batched, grouped, loop, wmma or wgmma", bad_env);
    if (kind) *kind = (lm_moe_gemm_kind)selected_kind;
    return LM_OK;
}

extern "C" lm_status lm_cuda_moe_set_gemm(lm_moe_gemm_kind kind) {
    if (kind != LM_MOE_GEMM_GROUPED && kind != LM_MOE_GEMM_LOOP && kind != LM_MOE_GEMM_WMMA &&
        kind != LM_MOE_GEMM_BATCHED && kind != LM_MOE_GEMM_WGMMA)
        return lm_error(LM_ERR_ARG,
                        "moe gemm kind %d: expected grouped (0), loop (1), wmma (2), batched (3) or wgmma (4)",
                        (int)kind);
    selected_kind = kind;
    return LM_OK;
}

/* The batched kind's rows-mode entries: 1 one entry a 128-row tile of the
 * grouped rows (one call, the default), 0 one entry an expert (grouped by
 * padded row count) (LONGMOE_MOE_BATCHED=experts|tiles). */
static switch_setting batched_tiles = {-1, "LONGMOE_MOE_BATCHED", "moe batched entries", {"experts", "tiles"}, 1};

extern "C" lm_status lm_cuda_moe_set_batched_tiles(int tiles) { return switch_set(&batched_tiles, tiles); }
extern "C" int lm_cuda_moe_batched_tiles(void) { return switch_get(&batched_tiles); }

/* How rows move between tokens and the grouped layout: 0 by grouped row, 1 by
 * token (the default) (LONGMOE_MOE_ROWS=by-row|by-token). */
static switch_setting by_token = {-1, "LONGMOE_MOE_ROWS", "moe rows", {"by-row", "by-token"}, 1};

extern "C" lm_status lm_cuda_moe_set_by_token(int v) { return switch_set(&by_token, v); }
extern "C" int lm_cuda_moe_by_token(void) { return switch_get(&by_token); }

/* Whether the layer runs part of its work (weight gradients, the forward's
 * products of x alone) on the context's side stream: 0 no, 1 yes (the
 * default) (LONGMOE_MOE_SIDE=inline|side). */
static switch_setting side_stream = {-1, "LONGMOE_MOE_SIDE", "moe side stream", {"inline", "side"}, 1};

extern "C" lm_status lm_cuda_moe_set_side_stream(int v) { return switch_set(&side_stream, v); }
extern "C" int lm_cuda_moe_side_stream(void) { return switch_get(&side_stream); }

static long grouped_refused; /* grouped calls cuBLAS refused (NOT_SUPPORTED), run per expert */

extern "C" long lm_cuda_moe_grouped_refused(void) { return grouped_refused; }

/* ---- row counts on the host ---- */

lm_status lm_moe_blas_fetch_counts(const lm_cuda_context *ctx, lm_cuda_moe_acts *acts, int n) {
    size_t bytes = (size_t)(n + 1) * sizeof(int32_t);
    if (!ctx->host_pinned || 2 * bytes > ctx->host_pinned_bytes)
        return lm_error(LM_ERR_ARG, "moe cuda: the context's pinned buffer cannot hold %d experts' offsets", n);
    cudaStream_t st = (cudaStream_t)ctx->stream;
    int32_t *h = (int32_t *)ctx->host_pinned;
    LM_CUDA_TRY(cudaMemcpyAsync(h, acts->offsets, bytes, cudaMemcpyDeviceToHost, st));
    LM_CUDA_TRY(cudaMemcpyAsync(h + n + 1, acts->padded_offsets, bytes, cudaMemcpyDeviceToHost, st));
    LM_CUDA_TRY(cudaStreamSynchronize(st));
    memcpy(acts->host_offsets, h, bytes);
    memcpy(acts->host_padded, h + n + 1, bytes);
    return LM_OK;
}

/* ---- dense ---- */

static void ops_of(lm_gemm_layout layout, cublasOperation_t *op_b, cublasOperation_t *op_a) {
    *op_b = layout == LM_GEMM_NT ? CUBLAS_OP_T : CUBLAS_OP_N;
    *op_a = layout == LM_GEMM_TN ? CUBLAS_OP_T : CUBLAS_OP_N;
}

static lm_status check_int(int64_t v, const char *what) {
    if (v < 0 || v > INT32_MAX) return lm_error(LM_ERR_ARG, "moe cublas: %s = %lld outside int", what, (long long)v);
    return LM_OK;
}

/* the sizes and leading dimensions cuBLAS takes as int */
static lm_status check_dims(const lm_gemm_bf16_args *g) {
    TRY(check_int(g->M, "M"));
    TRY(check_int(g->N, "N"));
    TRY(check_int(g->K, "K"));
    TRY(check_int(g->lda, "lda"));
    TRY(check_int(g->ldb, "ldb"));
    return check_int(g->ldc, "ldc");
}

lm_status lm_moe_blas_dense(const lm_cuda_context *ctx, const lm_gemm_bf16_args *g) {
    if (g->M <= 0 || g->N <= 0) return LM_OK;
    if ((g->c == NULL) == (g->cb == NULL)) return lm_error(LM_ERR_ARG, "moe cublas: exactly one of c, cb");
    TRY(check_dims(g));
    cublasOperation_t op_b, op_a;
    ops_of(g->layout, &op_b, &op_a);
    float alpha = 1.0f, beta = g->accumulate ? 1.0f : 0.0f;
    void *c = g->c ? (void *)g->c : (void *)g->cb;
    cudaDataType_t ct = g->c ? CUDA_R_32F : CUDA_R_16BF;
    /* k = 0 (an expert's empty contraction) gives C = beta C in cuBLAS */
    BLAS_PROF("dense", op_b, op_a, g->N, g->M, g->K, 1, ct == CUDA_R_16BF, beta,
              cublasGemmEx((cublasHandle_t)ctx->cublas, op_b, op_a, (int)g->N, (int)g->M, (int)g->K, &alpha, g->b,
                           CUDA_R_16BF, (int)g->ldb, g->a, CUDA_R_16BF, (int)g->lda, &beta, c, ct, (int)g->ldc,
                           CUBLAS_COMPUTE_32F, CUBLAS_GEMM_DEFAULT));
    return LM_OK;
}

/* fp32 product (the router): CUDA_R_32F operands, CUBLAS_COMPUTE_32F (no
 * TF32), the same mapping of layouts. */
lm_status lm_moe_blas_f32(const lm_cuda_context *ctx, lm_gemm_layout layout, const float *a, int64_t lda,
                          const float *b, int64_t ldb, float *c, int64_t ldc, int accumulate, int64_t M, int64_t N,
                          int64_t K) {
    if (M <= 0 || N <= 0) return LM_OK;
    TRY(check_int(M, "M"));
    TRY(check_int(N, "N"));
    TRY(check_int(K, "K"));
    TRY(check_int(lda, "lda"));
    TRY(check_int(ldb, "ldb"));
    TRY(check_int(ldc, "ldc"));
    cublasOperation_t op_b, op_a;
    ops_of(layout, &op_b, &op_a);
    float alpha = 1.0f, beta = accumulate ? 1.0f : 0.0f;
    BLAS_PROF("f32", op_b, op_a, N, M, K, 1, 0, beta,
              cublasGemmEx((cublasHandle_t)ctx->cublas, op_b, op_a, (int)N, (int)M, (int)K, &alpha, b, CUDA_R_32F,
                           (int)ldb, a, CUDA_R_32F, (int)lda, &beta, c, CUDA_R_32F, (int)ldc, CUBLAS_COMPUTE_32F,
                           CUBLAS_GEMM_DEFAULT));
    return LM_OK;
}

/* ---- grouped ---- */

/* The device pointer arrays of one grouped call, one block: for expert j with
 * rows, at its rank q among the experts with rows (ascending j, as the host
 * numbers the groups), pa = a + r_j a_row, pb = b + r_j b_row + j b_group,
 * pc = c + r_j c_row + j c_group (bytes). */
__global__ void build_pointers_kernel(const void **pa, const void **pb, void **pc, const int32_t *offsets,
                                      const int32_t *padded, int n, const char *a, int64_t a_row, const char *b,
                                      int64_t b_row, int64_t b_group, char *c, int64_t c_row, int64_t c_group) {
    __shared__ int32_t has_rows[LM_MOE_MAX_EXPERTS];
    for (int j = threadIdx.x; j < n; j += blockDim.x) has_rows[j] = offsets[j + 1] > offsets[j];
    __syncthreads();
    for (int j = threadIdx.x; j < n; j += blockDim.x) {
        if (!has_rows[j]) continue;
        int q = 0;
        for (int i = 0; i < j; i++) q += has_rows[i];
        int64_t r = padded[j];
        pa[q] = a + r * a_row;
        pb[q] = b + r * b_row + (int64_t)j * b_group;
        pc[q] = c + r * c_row + (int64_t)j * c_group;
    }
}

/* c[j c_stride + r ldc + col] += tmp[j M N + r N + col] for the experts j with rows */
__global__ void add_weight_grads_kernel(float *c, const bf16 *tmp, const int32_t *offsets, int groups, int64_t M,
                                        int64_t N, int64_t ldc, int64_t c_stride) {
    int64_t q = (int64_t)blockIdx.x * blockDim.x + threadIdx.x;
    int64_t per = M * N;
    if (q >= (int64_t)groups * per) return;
    int64_t j = q / per, rem = q % per, r = rem / N, col = rem % N;
    if (offsets[j + 1] == offsets[j]) return;
    c[j * c_stride + r * ldc + col] += __bfloat162float(tmp[q]);
}

/* One product per expert with rows: over its real rows, or (padded, the
 * batched kind's fallback) over its padded rows as the batched calls do. */
static lm_status grouped_loop(const lm_cuda_context *ctx, const lm_gemm_bf16_args *g, const lm_cuda_moe_acts *acts,
                              bool padded) {
    const bool weight = g->layout == LM_GEMM_TN;
    for (int j = 0; j < g->groups; j++) {
        int64_t cnt = acts->host_offsets[j + 1] - acts->host_offsets[j], r = acts->host_padded[j];
        if (cnt <= 0) continue;
        if (padded) cnt = acts->host_padded[j + 1] - r;
        lm_gemm_bf16_args s = *g;
        s.group_offsets = NULL;
        s.a = g->a + r * g->lda;
        if (weight) {
            s.b = g->b + r * g->ldb;
            if (s.c) s.c += j * g->c_group_stride;
            if (s.cb) s.cb += j * g->c_group_stride;
            s.K = cnt;
        } else {
            s.b = g->b + j * g->b_group_stride;
            if (s.c) s.c += r * g->ldc;
            if (s.cb) s.cb += r * g->ldc;
            s.M = cnt;
        }
        TRY(lm_moe_blas_dense(ctx, &s));
    }
    return LM_OK;
}

lm_status lm_moe_zero_weight_groups(cudaStream_t st, const lm_gemm_bf16_args *g, const int32_t *host_offsets) {
    const int64_t cs = g->c ? 4 : 2;
    char *c = g->c ? (char *)g->c : (char *)g->cb;
    if (!host_offsets && g->ldc == g->N && g->c_group_stride == g->M * g->N) {
        LM_CUDA_TRY(cudaMemsetAsync(c, 0, (size_t)(g->groups * g->M * g->N * cs), st));
        return LM_OK;
    }
    for (int j = 0; j < g->groups; j++)
        if (!host_offsets || host_offsets[j + 1] == host_offsets[j])
            LM_CUDA_TRY(cudaMemset2DAsync(c + j * g->c_group_stride * cs, (size_t)(g->ldc * cs), 0,
                                          (size_t)(g->N * cs), (size_t)g->M, st));
    return LM_OK;
}

/* ---- batched by padded size ---- */

/* The experts of one call in batch order, passed by value (no host buffer
 * that a later call could overwrite before the copy). */
typedef struct {
    uint16_t expert[LM_MOE_MAX_EXPERTS];
} batch_order;

/* Operand pointers of batch entry q (expert j = order.expert[q], first
 * grouped row r_j = padded[j]): pa = a + r_j a_row, pb = b + r_j b_row +
 * j b_group, pc = c + r_j c_row + j c_group (bytes). */
__global__ void batch_pointers_kernel(const void **pa, const void **pb, void **pc, batch_order order, int count,
                                      const int32_t *padded, const char *a, int64_t a_row, const char *b,
                                      int64_t b_row, int64_t b_group, char *c, int64_t c_row, int64_t c_group) {
    for (int q = threadIdx.x; q < count; q += blockDim.x) {
        int j = order.expert[q];
        int64_t r = padded[j];
        pa[q] = a + r * a_row;
        pb[q] = b + r * b_row + (int64_t)j * b_group;
        pc[q] = c + r * c_row + (int64_t)j * c_group;
    }
}

/* Operand pointers of the rows-mode batch entry q, the grouped rows
 * [q T, q T + T) (T = LM_MOE_CUDA_ROW_TILE): its expert j is the last with
 * padded[j] <= q T (experts without rows own no tile), pa = a + q T a_row,
 * pb = b + j b_group, pc = c + q T c_row (bytes). */
__global__ void tile_pointers_kernel(const void **pa, const void **pb, void **pc, int tiles, const int32_t *padded,
                                     int n, const char *a, int64_t a_row, const char *b, int64_t b_group, char *c,
                                     int64_t c_row) {
    for (int q = blockIdx.x * blockDim.x + threadIdx.x; q < tiles; q += gridDim.x * blockDim.x) {
        const int64_t r = (int64_t)q * LM_MOE_CUDA_ROW_TILE;
        pa[q] = a + r * a_row;
        pb[q] = b + (int64_t)group_of_row(padded, n, r) * b_group;
        pc[q] = c + r * c_row;
    }
}

/* Experts with rows, ordered by padded row count, then index. */
static int by_padded_rows(const lm_cuda_moe_acts *acts, int n, uint16_t *order, int32_t *rows) {
    int q = 0;
    for (int j = 0; j < n; j++) {
        if (acts->host_offsets[j + 1] - acts->host_offsets[j] <= 0) continue;
        int32_t p = acts->host_padded[j + 1] - acts->host_padded[j];
        int at = q++;
        while (at > 0 && rows[at - 1] > p) { /* insertion: few distinct sizes, nearly sorted */
            rows[at] = rows[at - 1];
            order[at] = order[at - 1];
            at--;
        }
        rows[at] = p;
        order[at] = (uint16_t)j;
    }
    return q;
}

/* One cublasGemmBatchedEx per distinct padded row count. Rows mode (NT, NN):
 * M = the padded rows; weight mode (TN): the contraction runs over them.
 * Either way the padding rows of the row operands must be zero, which the
 * batched kind keeps (see moe_cuda.h). */
static lm_status batched(const lm_cuda_context *ctx, const lm_gemm_bf16_args *g, const lm_cuda_moe_acts *acts) {
    const bool weight = g->layout == LM_GEMM_TN;
    const int n = g->groups;
    cudaStream_t st = (cudaStream_t)ctx->stream;
    void **ptrs = acts->blas_ptrs;
    const int64_t cap = lm_moe_blas_ptr_capacity(n, acts->rows_max);
    const void **pa = (const void **)ptrs, **pb = (const void **)(ptrs + cap);
    void **pc = ptrs + 2 * cap;
    const int64_t cs = g->c ? 4 : 2;
    char *c = g->c ? (char *)g->c : (char *)g->cb;
    const int64_t a_row = g->lda * 2;
    const int64_t b_row = weight ? g->ldb * 2 : 0, b_group = weight ? 0 : g->b_group_stride * 2;
    const int64_t c_row = weight ? 0 : g->ldc * cs, c_group = weight ? g->c_group_stride * cs : 0;
    cublasOperation_t op_b, op_a;
    ops_of(g->layout, &op_b, &op_a);
    const float alpha = 1.0f, beta = g->accumulate ? 1.0f : 0.0f;
    const cudaDataType_t ct = g->c ? CUDA_R_32F : CUDA_R_16BF;
    if (!weight && lm_cuda_moe_batched_tiles()) {
        /* every 128-row tile of the grouped rows one entry of one call: the
         * padding rows are zero, as the per-expert entries cover them too */
        const int tiles = acts->host_padded[n] / LM_MOE_CUDA_ROW_TILE;
        if (tiles == 0) return LM_OK;
        tile_pointers_kernel<<<(tiles + 255) / 256, 256, 0, st>>>(pa, pb, pc, tiles, acts->padded_offsets, n,
                                                                  (const char *)g->a, a_row, (const char *)g->b,
                                                                  b_group, c, c_row);
        LM_CUDA_TRY(cudaGetLastError());
        BLAS_PROF("batched", op_b, op_a, g->N, LM_MOE_CUDA_ROW_TILE, g->K, tiles, ct == CUDA_R_16BF, beta,
                  cublasGemmBatchedEx((cublasHandle_t)ctx->cublas, op_b, op_a, (int)g->N, LM_MOE_CUDA_ROW_TILE,
                                      (int)g->K, &alpha, (const void *const *)pb, CUDA_R_16BF, (int)g->ldb,
                                      (const void *const *)pa, CUDA_R_16BF, (int)g->lda, &beta, (void *const *)pc,
                                      ct, (int)g->ldc, tiles, CUBLAS_COMPUTE_32F, CUBLAS_GEMM_DEFAULT));
        return LM_OK;
    }
    batch_order order;
    int32_t rows[LM_MOE_MAX_EXPERTS];
    int count = by_padded_rows(acts, n, order.expert, rows);
    if (count == 0) return LM_OK;
    batch_pointers_kernel<<<1, 256, 0, st>>>(pa, pb, pc, order, count, acts->padded_offsets, (const char *)g->a,
                                             a_row, (const char *)g->b, b_row, b_group, c, c_row, c_group);
    LM_CUDA_TRY(cudaGetLastError());
    for (int q0 = 0; q0 < count;) {
        int q1 = q0 + 1;
        while (q1 < count && rows[q1] == rows[q0]) q1++;
        int p = rows[q0];
        int mm = (int)g->N, nn = weight ? (int)g->M : p, kk = weight ? p : (int)g->K;
        /* cuBLAS's A array is our b, its B array our a (see the top of the file) */
        BLAS_PROF("batched", op_b, op_a, mm, nn, kk, q1 - q0, ct == CUDA_R_16BF, beta,
                  cublasGemmBatchedEx((cublasHandle_t)ctx->cublas, op_b, op_a, mm, nn, kk, &alpha,
                                      (const void *const *)(pb + q0), CUDA_R_16BF, (int)g->ldb,
                                      (const void *const *)(pa + q0), CUDA_R_16BF, (int)g->lda, &beta,
                                      (void *const *)(pc + q0), ct, (int)g->ldc, q1 - q0, CUBLAS_COMPUTE_32F,
                                      CUBLAS_GEMM_DEFAULT));
        q0 = q1;
    }
    return LM_OK;
}

lm_status lm_moe_blas_grouped(const lm_cuda_context *ctx, int kind, const lm_gemm_bf16_args *g,
                              const lm_cuda_moe_acts *acts, bf16 *dw_tmp) {
    const bool weight = g->layout == LM_GEMM_TN;
    const int n = g->groups;
    if ((g->c == NULL) == (g->cb == NULL)) return lm_error(LM_ERR_ARG, "moe cublas: exactly one of c, cb");
    if (n < 1 || n > LM_MOE_MAX_EXPERTS) return lm_error(LM_ERR_ARG, "moe cublas: %d groups", n);
    if ((weight ? g->M : g->K) <= 0 || g->N <= 0) return LM_OK;
    /* weight gradients set, not added to: the batched kind writes the experts with rows with beta 0
     * and zeroes the others after; the other kinds zero them all first and add */
    const bool set = weight && !g->accumulate;
    if (set && kind != LM_MOE_GEMM_BATCHED) {
        TRY(lm_moe_zero_weight_groups((cudaStream_t)ctx->stream, g, NULL));
        lm_gemm_bf16_args add = *g;
        add.accumulate = 1;
        return lm_moe_blas_grouped(ctx, kind, &add, acts, dw_tmp);
    }
    /* cuBLAS groups one type for C: fp32 outputs go per expert, except the
     * weight gradients, which go through the bf16 scratch when there is one */
    const bool via_tmp = weight && g->c && dw_tmp;
    if (kind != LM_MOE_GEMM_GROUPED && kind != LM_MOE_GEMM_LOOP && kind != LM_MOE_GEMM_BATCHED)
        return lm_error(LM_ERR_ARG, "moe cublas: gemm kind %d", kind);
    if (kind == LM_MOE_GEMM_BATCHED) {
        /* fp32 C is fine here; the alignment is that of the fp32 or bf16 C itself */
        const int64_t cb = g->c ? 4 : 2;
        const uintptr_t base = (uintptr_t)g->a | (uintptr_t)g->b | (uintptr_t)(g->c ? (void *)g->c : (void *)g->cb);
        const bool ok = base % 16 == 0 && (g->lda * 2) % 16 == 0 && (g->ldb * 2) % 16 == 0 &&
                        (g->ldc * cb) % 16 == 0 && (weight || (g->b_group_stride * 2) % 16 == 0) &&
                        (!weight || (g->c_group_stride * cb) % 16 == 0);
        TRY(check_dims(g));
        TRY(ok ? batched(ctx, g, acts) : grouped_loop(ctx, g, acts, true));
        return set ? lm_moe_zero_weight_groups((cudaStream_t)ctx->stream, g, acts->host_offsets) : LM_OK;
    }
    /* The grouped call cannot see the alignment of the pointers it reads from
     * device memory; they are kept 16-byte aligned: the bases and the per-expert
     * strides (row starts are multiples of 128 rows, so those always are).
     * Anything else runs per expert, where cuBLAS sees each pointer. */
    const int64_t cbytes = g->c && !via_tmp ? 4 : 2;
    const uintptr_t bases = (uintptr_t)g->a | (uintptr_t)g->b |
                            (uintptr_t)(via_tmp ? (void *)dw_tmp : g->c ? (void *)g->c : (void *)g->cb);
    const bool aligned = bases % 16 == 0 && (weight || (g->b_group_stride * 2) % 16 == 0) &&
                         (!weight || (via_tmp ? g->M * g->N * 2 : g->c_group_stride * cbytes) % 16 == 0);
    if (kind == LM_MOE_GEMM_LOOP || (g->c && !via_tmp) || !aligned) return grouped_loop(ctx, g, acts, false);

    TRY(check_dims(g));
    /* host arrays, one entry a group (cuBLAS reads them during the call) */
    cublasOperation_t ta[LM_MOE_MAX_EXPERTS], tb[LM_MOE_MAX_EXPERTS];
    int mm[LM_MOE_MAX_EXPERTS], nn[LM_MOE_MAX_EXPERTS], kk[LM_MOE_MAX_EXPERTS];
    int la[LM_MOE_MAX_EXPERTS], lb[LM_MOE_MAX_EXPERTS], lc[LM_MOE_MAX_EXPERTS], size[LM_MOE_MAX_EXPERTS];
    float alpha[LM_MOE_MAX_EXPERTS], beta[LM_MOE_MAX_EXPERTS];
    cublasOperation_t op_b, op_a;
    ops_of(g->layout, &op_b, &op_a);
    const int64_t ldc = via_tmp ? g->N : g->ldc;
    int q = 0;
    for (int j = 0; j < n; j++) {
        int64_t cnt = acts->host_offsets[j + 1] - acts->host_offsets[j];
        if (cnt <= 0) continue;
        ta[q] = op_b;
        tb[q] = op_a;
        mm[q] = (int)g->N;
        nn[q] = (int)(weight ? g->M : cnt);
        kk[q] = (int)(weight ? cnt : g->K);
        la[q] = (int)g->ldb;
        lb[q] = (int)g->lda;
        lc[q] = (int)ldc;
        size[q] = 1;
        alpha[q] = 1.0f;
        beta[q] = g->accumulate && !via_tmp ? 1.0f : 0.0f;
        q++;
    }
    if (q == 0) return LM_OK;

    cudaStream_t st = (cudaStream_t)ctx->stream;
    void **ptrs = acts->blas_ptrs;
    const int64_t cap = lm_moe_blas_ptr_capacity(n, acts->rows_max);
    const void **pa = (const void **)ptrs, **pb = (const void **)(ptrs + cap);
    void **pc = ptrs + 2 * cap;
    char *c = via_tmp ? (char *)dw_tmp : g->c ? (char *)g->c : (char *)g->cb;
    const int64_t cs = (g->c && !via_tmp) ? 4 : 2;
    const int64_t a_row = g->lda * 2;
    const int64_t b_row = weight ? g->ldb * 2 : 0, b_group = weight ? 0 : g->b_group_stride * 2;
    const int64_t c_row = weight ? 0 : g->ldc * cs;
    const int64_t c_group = weight ? (via_tmp ? g->M * g->N : g->c_group_stride) * cs : 0;
    build_pointers_kernel<<<1, 256, 0, st>>>(pa, pb, pc, acts->offsets, acts->padded_offsets, n,
                                             (const char *)g->a, a_row, (const char *)g->b, b_row, b_group, c,
                                             c_row, c_group);
    LM_CUDA_TRY(cudaGetLastError());
    /* cuBLAS's A array is our b, its B array our a (see the top of the file) */
    cublasStatus_t bs = cublasGemmGroupedBatchedEx((cublasHandle_t)ctx->cublas, ta, tb, mm, nn, kk, alpha,
                                                   (const void *const *)pb, CUDA_R_16BF, la,
                                                   (const void *const *)pa, CUDA_R_16BF, lb, beta,
                                                   (void *const *)pc, CUDA_R_16BF, lc, q, size, CUBLAS_COMPUTE_32F);
    if (bs == CUBLAS_STATUS_NOT_SUPPORTED) {
        /* this cuBLAS refuses the call: run per expert, counted and said once */
        if (grouped_refused++ == 0)
            fprintf(stderr, "moe: cublasGemmGroupedBatchedEx is not supported here (status %d): the grouped "
                            "kind runs its expert products per expert\n", (int)bs);
        return grouped_loop(ctx, g, acts, false);
    }
    BLAS_TRY(bs);
    if (via_tmp) {
        int64_t total = (int64_t)n * g->M * g->N;
        add_weight_grads_kernel<<<(unsigned)((total + 255) / 256), 256, 0, st>>>(
            g->c, dw_tmp, acts->offsets, n, g->M, g->N, g->ldc, g->c_group_stride);
        LM_CUDA_TRY(cudaGetLastError());
    }
    return LM_OK;
}

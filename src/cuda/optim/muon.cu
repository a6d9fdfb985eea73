/* Muon on the GPU (src/cuda/optim/optim_internal.h; docs/optim.md, "On a
 * backend"): src/train/optim.c's lm_muon_update with every row block (head,
 * expert) of a parameter orthogonalised at once.
 *
 *   1. momentum: buf = mu buf + g; u = g + mu buf (Nesterov) or buf, written
 *      per block into X [m, n] (m = min, n = max of the block's dims; the
 *      block transposed when it has more rows than columns, as on the CPU)
 *   2. X /= ||X||_F + eps per block (sum of squares in double, fixed tree)
 *   3. steps x: A = X X^T; B = b A + c A A; X' = a X + B X — three strided-
 *      batched cuBLASLt products over the blocks per iteration
 *   4. w -= lr * (0.2 sqrt(max(rb, cols)) O + wd w)
 *
 * Precision: the products take fp32 operands from fp32 memory with TF32
 * tensor-core multiplies (10-bit mantissa) and fp32 accumulation
 * (CUBLAS_COMPUTE_32F_FAST_TF32); cfg->muon_ns_fp32 = 1 selects full fp32
 * products (CUBLAS_COMPUTE_32F), as does a shape for which cuBLASLt offers no
 * TF32 kernel. TF32 rather than bf16: the operands stay in
 * fp32 memory (no conversion pass, no second copy of X, A and B), the
 * rounding of each operand is 8x finer than bf16's, and Newton–Schulz is a
 * small share of a training step. Everything outside the products (momentum,
 * norms, the update) is IEEE fp32 / double as on the CPU.
 *
 * Scratch: X, Y [nb blocks of m*n], A, B [nb of m*m], each block's slice
 * padded to 64 floats (256-byte aligned operands for cuBLASLt), then nb
 * floats of 1/(||X||+eps). */
#include <math.h>
#include <stdint.h>
#include <string.h>

#include <cublasLt.h>
#include <cuda_runtime.h>

#include "cuda/cuda_check.h"
#include "cuda/optim/optim_internal.h"

/* Quintic Newton–Schulz coefficients, the CPU's (src/train/optim.c). */
#define NS_A 3.4445f
#define NS_B (-4.7750f)
#define NS_C 2.0315f

#define MU_THREADS 256
#define NORM_THREADS 1024

static size_t pad64(size_t x) { return (x + 63) & ~(size_t)63; }
static cudaStream_t stream_of(const lm_cuda_context *ctx) { return (cudaStream_t)ctx->stream; }

typedef struct {
    int64_t rb, cols, m, n;
    int nb, tr;
    size_t sX, sA; /* floats per block of X/Y and of A/B */
} muon_shape;

static muon_shape shape_of(int64_t rows, int64_t cols, int n_blocks) {
    muon_shape s;
    s.nb = n_blocks < 1 ? 1 : n_blocks;
    s.rb = rows / s.nb;
    s.cols = cols;
    s.tr = s.rb > cols;
    s.m = s.tr ? cols : s.rb;
    s.n = s.tr ? s.rb : cols;
    s.sX = pad64((size_t)(s.m * s.n));
    s.sA = pad64((size_t)(s.m * s.m));
    return s;
}

size_t lm_cuda_muon_scratch_bytes(int64_t rows, int64_t cols, int n_blocks) {
    if (rows < 1 || cols < 1) return 0;
    muon_shape s = shape_of(rows, cols, n_blocks);
    return (2 * (size_t)s.nb * s.sX + 2 * (size_t)s.nb * s.sA + pad64((size_t)s.nb)) * sizeof(float);
}

static unsigned grid_for(const lm_cuda_context *ctx, size_t n) {
    size_t want = (n + MU_THREADS - 1) / MU_THREADS;
    size_t cap = (size_t)(ctx->sm_count > 0 ? ctx->sm_count : 132) * 8;
    if (want > cap) want = cap;
    return (unsigned)(want ? want : 1);
}

/* ---- kernels ---- */

/* momentum and the Newton–Schulz input of every block */
__global__ static void muon_prep_kernel(const float *g, float *mom, float *X, int64_t rb, int64_t cols, int nb,
                                        int64_t n, size_t sX, int tr, float mu, int nesterov) {
    const size_t per = (size_t)rb * cols, total = per * nb;
    for (size_t i = (size_t)blockIdx.x * blockDim.x + threadIdx.x; i < total; i += (size_t)gridDim.x * blockDim.x) {
        size_t b = i / per, e = i % per;
        int64_t r = (int64_t)(e / cols), c = (int64_t)(e % cols);
        float gi = g[i];
        float buf = __fadd_rn(__fmul_rn(mu, mom[i]), gi);
        mom[i] = buf;
        float u = nesterov ? __fadd_rn(gi, __fmul_rn(mu, buf)) : buf;
        X[b * sX + (size_t)(tr ? c * n + r : r * n + c)] = u;
    }
}

/* inv[b] = 1 / (||X_b||_F + eps): the squares summed in double, each thread
 * in ascending index, then a fixed tree */
__global__ static void muon_norm_kernel(const float *X, size_t count, size_t sX, float eps, float *inv) {
    __shared__ double sh[NORM_THREADS];
    const float *x = X + (size_t)blockIdx.x * sX;
    double s = 0.0;
    for (size_t i = threadIdx.x; i < count; i += NORM_THREADS) {
        double v = (double)x[i];
        s += v * v;
    }
    sh[threadIdx.x] = s;
    __syncthreads();
    for (int k = NORM_THREADS / 2; k > 0; k >>= 1) {
        if ((int)threadIdx.x < k) sh[threadIdx.x] += sh[threadIdx.x + k];
        __syncthreads();
    }
    if (threadIdx.x == 0) inv[blockIdx.x] = (float)(1.0 / (sqrt(sh[0]) + (double)eps));
}

__global__ static void muon_normalise_kernel(float *X, size_t count, size_t sX, int nb, const float *inv) {
    const size_t total = count * nb;
    for (size_t i = (size_t)blockIdx.x * blockDim.x + threadIdx.x; i < total; i += (size_t)gridDim.x * blockDim.x) {
        size_t b = i / count, e = i % count;
        X[b * sX + e] = __fmul_rn(X[b * sX + e], inv[b]);
    }
}

/* w -= lr * (scale * O + wd * w) */
__global__ static void muon_apply_kernel(float *w, const float *O, int64_t rb, int64_t cols, int nb, int64_t n,
                                         size_t sX, int tr, float lr, float scale, float wd) {
    const size_t per = (size_t)rb * cols, total = per * nb;
    for (size_t i = (size_t)blockIdx.x * blockDim.x + threadIdx.x; i < total; i += (size_t)gridDim.x * blockDim.x) {
        size_t b = i / per, e = i % per;
        int64_t r = (int64_t)(e / cols), c = (int64_t)(e % cols);
        float o = O[b * sX + (size_t)(tr ? c * n + r : r * n + c)];
        float wi = w[i];
        w[i] = __fadd_rn(wi, -__fmul_rn(lr, __fadd_rn(__fmul_rn(scale, o), __fmul_rn(wd, wi))));
    }
}

/* ---- strided-batched products ---- */

/* One column-major product D = alpha op(A) op(B) + beta C over `batch`
 * matrices, its descriptors and algorithm chosen once and run many times. */
typedef struct {
    cublasLtMatmulDesc_t op;
    cublasLtMatrixLayout_t la, lb, lc;
    cublasLtMatmulAlgo_t algo;
    float alpha, beta;
} lt_batched;

static void lt_batched_free(lt_batched *p) {
    if (p->lc) cublasLtMatrixLayoutDestroy(p->lc);
    if (p->lb) cublasLtMatrixLayoutDestroy(p->lb);
    if (p->la) cublasLtMatrixLayoutDestroy(p->la);
    if (p->op) cublasLtMatmulDescDestroy(p->op);
    p->op = NULL;
    p->la = p->lb = p->lc = NULL;
}

static lm_status lt_fail(cublasStatus_t s, const char *what) {
    return lm_error(LM_ERR_IO, "cuBLASLt %s failed in the Newton-Schulz products: status %d", what, (int)s);
}

/* stored [rows, cols] column-major with leading dimension ld, batch of `batch` at `stride` floats */
static cublasStatus_t make_layout(cublasLtMatrixLayout_t *l, uint64_t rows, uint64_t cols, int64_t ld, int batch,
                                  int64_t stride) {
    cublasStatus_t s = cublasLtMatrixLayoutCreate(l, CUDA_R_32F, rows, cols, ld);
    if (s == CUBLAS_STATUS_SUCCESS)
        s = cublasLtMatrixLayoutSetAttribute(*l, CUBLASLT_MATRIX_LAYOUT_BATCH_COUNT, &batch, sizeof batch);
    if (s == CUBLAS_STATUS_SUCCESS)
        s = cublasLtMatrixLayoutSetAttribute(*l, CUBLASLT_MATRIX_LAYOUT_STRIDED_BATCH_OFFSET, &stride, sizeof stride);
    return s;
}

/* D [M, N] = alpha op(A) op(B) + beta C with op(A) [M, K], op(B) [K, N]; A is
 * stored [M, K] (N) or [K, M] (T), likewise B; C and D share a layout. */
static lm_status lt_batched_plan(const lm_cuda_context *ctx, lt_batched *p, cublasComputeType_t compute,
                                 cublasOperation_t ta, cublasOperation_t tb, uint64_t M, uint64_t N, uint64_t K,
                                 int64_t lda, int64_t sa, int64_t ldb, int64_t sb, int64_t ldc, int64_t sc,
                                 int batch, float alpha, float beta) {
    memset(p, 0, sizeof *p);
    p->alpha = alpha;
    p->beta = beta;
    cublasLtMatmulPreference_t pref = NULL;
    cublasLtMatmulHeuristicResult_t best;
    int found = 0;
    uint64_t ws = ctx->lt_workspace_bytes;
    cublasStatus_t s = cublasLtMatmulDescCreate(&p->op, compute, CUDA_R_32F);
    const char *what = "MatmulDescCreate";
    if (s == CUBLAS_STATUS_SUCCESS) {
        what = "set TRANSA";
        s = cublasLtMatmulDescSetAttribute(p->op, CUBLASLT_MATMUL_DESC_TRANSA, &ta, sizeof ta);
    }
    if (s == CUBLAS_STATUS_SUCCESS) {
        what = "set TRANSB";
        s = cublasLtMatmulDescSetAttribute(p->op, CUBLASLT_MATMUL_DESC_TRANSB, &tb, sizeof tb);
    }
    if (s == CUBLAS_STATUS_SUCCESS) {
        what = "layout A";
        s = ta == CUBLAS_OP_N ? make_layout(&p->la, M, K, lda, batch, sa) : make_layout(&p->la, K, M, lda, batch, sa);
    }
    if (s == CUBLAS_STATUS_SUCCESS) {
        what = "layout B";
        s = tb == CUBLAS_OP_N ? make_layout(&p->lb, K, N, ldb, batch, sb) : make_layout(&p->lb, N, K, ldb, batch, sb);
    }
    if (s == CUBLAS_STATUS_SUCCESS) {
        what = "layout C/D";
        s = make_layout(&p->lc, M, N, ldc, batch, sc);
    }
    if (s == CUBLAS_STATUS_SUCCESS) {
        what = "PreferenceCreate";
        s = cublasLtMatmulPreferenceCreate(&pref);
    }
    if (s == CUBLAS_STATUS_SUCCESS) {
        what = "set workspace";
        s = cublasLtMatmulPreferenceSetAttribute(pref, CUBLASLT_MATMUL_PREF_MAX_WORKSPACE_BYTES, &ws, sizeof ws);
    }
    if (s == CUBLAS_STATUS_SUCCESS) {
        what = "AlgoGetHeuristic";
        s = cublasLtMatmulAlgoGetHeuristic((cublasLtHandle_t)ctx->cublaslt, p->op, p->la, p->lb, p->lc, p->lc, pref,
                                           1, &best, &found);
    }
    if (pref) cublasLtMatmulPreferenceDestroy(pref);
    if ((s != CUBLAS_STATUS_SUCCESS || found < 1) && compute == CUBLAS_COMPUTE_32F_FAST_TF32) {
        /* no TF32 kernel for this shape: the full-fp32 product (only more precise) */
        lt_batched_free(p);
        return lt_batched_plan(ctx, p, CUBLAS_COMPUTE_32F, ta, tb, M, N, K, lda, sa, ldb, sb, ldc, sc, batch, alpha,
                               beta);
    }
    if (s != CUBLAS_STATUS_SUCCESS) {
        lt_batched_free(p);
        return lt_fail(s, what);
    }
    if (found < 1) {
        lt_batched_free(p);
        return lm_error(LM_ERR_IO, "cuBLASLt: no algorithm for the Newton-Schulz product M=%llu N=%llu K=%llu x%d",
                        (unsigned long long)M, (unsigned long long)N, (unsigned long long)K, batch);
    }
    p->algo = best.algo;
    return LM_OK;
}

static lm_status lt_batched_run(const lm_cuda_context *ctx, const lt_batched *p, const float *A, const float *B,
                                const float *C, float *D) {
    cublasStatus_t s = cublasLtMatmul((cublasLtHandle_t)ctx->cublaslt, p->op, &p->alpha, A, p->la, B, p->lb,
                                      &p->beta, C, p->lc, D, p->lc, &p->algo, ctx->lt_workspace,
                                      ctx->lt_workspace_bytes, stream_of(ctx));
    return s == CUBLAS_STATUS_SUCCESS ? LM_OK : lt_fail(s, "Matmul");
}

/* ---- the update ---- */

lm_status lm_cuda_muon_update(const lm_cuda_context *ctx, float *w, const float *g, float *momentum,
                                         int64_t rows, int64_t cols, int n_blocks, float lr, float wd,
                                         const lm_optim_config *cfg, void *scratch, size_t scratch_bytes) {
    if (!ctx || !w || !g || !momentum || !scratch || !cfg)
        return lm_error(LM_ERR_ARG, "muon: w, g, momentum, scratch and cfg must not be NULL");
    if (n_blocks < 1) n_blocks = 1;
    if (rows < 1 || cols < 1 || rows % n_blocks != 0)
        return lm_error(LM_ERR_ARG, "muon: shape [%lld, %lld] with %d blocks is invalid", (long long)rows,
                        (long long)cols, n_blocks);
    size_t need = lm_cuda_muon_scratch_bytes(rows, cols, n_blocks);
    if (scratch_bytes < need)
        return lm_error(LM_ERR_ARG, "muon: scratch has %zu bytes, [%lld, %lld] in %d blocks needs %zu", scratch_bytes,
                        (long long)rows, (long long)cols, n_blocks, need);
    muon_shape s = shape_of(rows, cols, n_blocks);
    float *X = (float *)scratch, *Y = X + (size_t)s.nb * s.sX, *A = Y + (size_t)s.nb * s.sX,
          *Bm = A + (size_t)s.nb * s.sA, *inv = Bm + (size_t)s.nb * s.sA;
    const size_t total = (size_t)rows * cols, count = (size_t)(s.m * s.n);
    cudaStream_t st = stream_of(ctx);

    muon_prep_kernel<<<grid_for(ctx, total), MU_THREADS, 0, st>>>(g, momentum, X, s.rb, cols, s.nb, s.n, s.sX, s.tr,
                                                                 cfg->muon_momentum, cfg->muon_nesterov);
    LM_CUDA_TRY(cudaGetLastError());
    muon_norm_kernel<<<s.nb, NORM_THREADS, 0, st>>>(X, count, s.sX, cfg->muon_ns_eps, inv);
    LM_CUDA_TRY(cudaGetLastError());
    muon_normalise_kernel<<<grid_for(ctx, count * s.nb), MU_THREADS, 0, st>>>(X, count, s.sX, s.nb, inv);
    LM_CUDA_TRY(cudaGetLastError());

    /* Row-major X [m, n] is column-major Xc = X^T [n, m] (ld n); row-major
     * A, B [m, m] are their transposes column-major (ld m). In column-major:
     *   A^T = (X X^T)^T = Xc^T Xc                      (T, N; M = N = m, K = n)
     *   B^T = (c A A + b A)^T = c A^T A^T + b A^T      (N, N; M = N = K = m)
     *   X'^T = (a X + B X)^T = Xc B^T + a Xc           (N, N; M = n, N = K = m) */
    cublasComputeType_t compute = cfg->muon_ns_fp32 ? CUBLAS_COMPUTE_32F : CUBLAS_COMPUTE_32F_FAST_TF32;
    const uint64_t m = (uint64_t)s.m, n = (uint64_t)s.n;
    const int64_t sX = (int64_t)s.sX, sA = (int64_t)s.sA;
    lt_batched p1, p2, p3;
    lm_status r = lt_batched_plan(ctx, &p1, compute, CUBLAS_OP_T, CUBLAS_OP_N, m, m, n, (int64_t)n, sX, (int64_t)n,
                                  sX, (int64_t)m, sA, s.nb, 1.0f, 0.0f);
    if (r) return r;
    r = lt_batched_plan(ctx, &p2, compute, CUBLAS_OP_N, CUBLAS_OP_N, m, m, m, (int64_t)m, sA, (int64_t)m, sA,
                        (int64_t)m, sA, s.nb, NS_C, NS_B);
    if (r) {
        lt_batched_free(&p1);
        return r;
    }
    r = lt_batched_plan(ctx, &p3, compute, CUBLAS_OP_N, CUBLAS_OP_N, n, m, m, (int64_t)n, sX, (int64_t)m, sA,
                        (int64_t)n, sX, s.nb, 1.0f, NS_A);
    if (r) {
        lt_batched_free(&p1);
        lt_batched_free(&p2);
        return r;
    }
    for (int it = 0; it < cfg->muon_ns_steps && !r; it++) {
        r = lt_batched_run(ctx, &p1, X, X, A, A);
        if (!r) r = lt_batched_run(ctx, &p2, A, A, A, Bm);
        if (!r) r = lt_batched_run(ctx, &p3, X, Bm, X, Y);
        float *t = X;
        X = Y;
        Y = t;
    }
    lt_batched_free(&p1);
    lt_batched_free(&p2);
    lt_batched_free(&p3);
    if (r) return r;

    /* update RMS matched to AdamW: 0.2 * sqrt(max(rows, cols)) of the block, as on the CPU */
    float scale = (float)((double)cfg->muon_rms_scale * sqrt((double)(s.rb > cols ? s.rb : cols)));
    muon_apply_kernel<<<grid_for(ctx, total), MU_THREADS, 0, st>>>(w, X, s.rb, cols, s.nb, s.n, s.sX, s.tr, lr,
                                                                  scale, wd);
    LM_CUDA_TRY(cudaGetLastError());
    return LM_OK;
}

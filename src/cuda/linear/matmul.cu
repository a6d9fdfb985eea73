/* Matrix products through cuBLASLt (include/longmoe/linear_cuda.h).
 *
 * The model's tensors are row-major; cuBLAS is column-major. A row-major
 * [r, c] matrix with row stride c is the column-major [c, r] matrix with
 * leading dimension c, i.e. its transpose. So each row-major product
 * Y = X . W^T is computed as the column-major product Y^T = W . X^T:
 *   forward   out^T[oc,n]    = (W as [ic,oc])^T  . inp^T[ic,n]       (A: T, B: N)
 *   dinp      dinp^T[ic,n]   = W^T[ic,oc]        . dout^T[oc,n]      (A: N, B: N)
 *   dweight   dweight^T[ic,oc] = inp^T[ic,n]     . (dout^T[oc,n])^T  (A: N, B: T)
 * Operands bf16, C/D fp32 (or bf16 for lm_cuda_matmul_forward_bf16), compute
 * CUBLAS_COMPUTE_32F. cuBLAS gives the same bits on every run on the same GPU
 * and toolkit; the algorithm is the heuristic's first choice for the shape,
 * the operands' alignment and the context's workspace. */
#include <stdint.h>

#include <cublasLt.h>
#include <cuda_runtime.h>

#include "cuda/cuda_check.h"
#include "cuda/linear/matmul_profile.h"
#include "longmoe/linear_cuda.h"

/* The largest power of two (up to 256) that divides the address: cuBLASLt
 * assumes 256-byte aligned operands unless told otherwise. */
static uint32_t address_alignment(const void *p) {
    uintptr_t a = (uintptr_t)p;
    uint32_t al = 256;
    while (al > 1 && (a % al) != 0) al >>= 1;
    return al;
}

typedef struct {
    cublasOperation_t trans_a, trans_b;
    uint64_t m, n, k;          /* D is m x n (column-major); op(A) m x k, op(B) k x n */
    const void *a, *b;
    int64_t lda, ldb;
    void *d;                   /* also C */
    int64_t ldd;
    cudaDataType_t d_type;     /* CUDA_R_32F or CUDA_R_16BF */
    float beta;                /* 0: D = A.B; 1: D += A.B */
} lt_product;

static lm_status lt_status(cublasStatus_t s, const char *what) {
    return lm_error(LM_ERR_IO, "cuBLASLt %s failed: status %d", what, (int)s);
}

/* One product on the context's stream. Descriptors are created and freed
 * around the call (a few microseconds of host time). */
static lm_status lt_run(const lm_cuda_context *ctx, const lt_product *p) {
    cublasLtHandle_t h = (cublasLtHandle_t)ctx->cublaslt;
    cublasLtMatmulDesc_t op = NULL;
    cublasLtMatrixLayout_t la = NULL, lb = NULL, ld = NULL;
    cublasLtMatmulPreference_t pref = NULL;
    lm_status st = LM_OK;
    cublasStatus_t s;
    const float alpha = 1.0f, beta = p->beta;
    /* stored shapes: A is (m x k) or, transposed, (k x m); likewise B */
    uint64_t a_rows = p->trans_a == CUBLAS_OP_N ? p->m : p->k, a_cols = p->trans_a == CUBLAS_OP_N ? p->k : p->m;
    uint64_t b_rows = p->trans_b == CUBLAS_OP_N ? p->k : p->n, b_cols = p->trans_b == CUBLAS_OP_N ? p->n : p->k;
    uint64_t ws = ctx->lt_workspace_bytes;
    uint32_t al_a = address_alignment(p->a), al_b = address_alignment(p->b), al_d = address_alignment(p->d);
    cublasLtMatmulHeuristicResult_t best;
    int found = 0;
    cudaEvent_t e0 = NULL; /* the profile's first event, while it is on */

#define LT_STEP(call, what)                       \
    do {                                          \
        s = (call);                               \
        if (s != CUBLAS_STATUS_SUCCESS) {         \
            st = lt_status(s, what);              \
            goto done;                            \
        }                                         \
    } while (0)
    LT_STEP(cublasLtMatmulDescCreate(&op, CUBLAS_COMPUTE_32F, CUDA_R_32F), "MatmulDescCreate");
    LT_STEP(cublasLtMatmulDescSetAttribute(op, CUBLASLT_MATMUL_DESC_TRANSA, &p->trans_a, sizeof p->trans_a),
            "set TRANSA");
    LT_STEP(cublasLtMatmulDescSetAttribute(op, CUBLASLT_MATMUL_DESC_TRANSB, &p->trans_b, sizeof p->trans_b),
            "set TRANSB");
    LT_STEP(cublasLtMatrixLayoutCreate(&la, CUDA_R_16BF, a_rows, a_cols, p->lda), "layout A");
    LT_STEP(cublasLtMatrixLayoutCreate(&lb, CUDA_R_16BF, b_rows, b_cols, p->ldb), "layout B");
    LT_STEP(cublasLtMatrixLayoutCreate(&ld, p->d_type, p->m, p->n, p->ldd), "layout C/D");
    LT_STEP(cublasLtMatmulPreferenceCreate(&pref), "PreferenceCreate");
    LT_STEP(cublasLtMatmulPreferenceSetAttribute(pref, CUBLASLT_MATMUL_PREF_MAX_WORKSPACE_BYTES, &ws, sizeof ws),
            "set workspace");
    LT_STEP(cublasLtMatmulPreferenceSetAttribute(pref, CUBLASLT_MATMUL_PREF_MIN_ALIGNMENT_A_BYTES, &al_a,
                                                 sizeof al_a), "set alignment A");
    LT_STEP(cublasLtMatmulPreferenceSetAttribute(pref, CUBLASLT_MATMUL_PREF_MIN_ALIGNMENT_B_BYTES, &al_b,
                                                 sizeof al_b), "set alignment B");
    LT_STEP(cublasLtMatmulPreferenceSetAttribute(pref, CUBLASLT_MATMUL_PREF_MIN_ALIGNMENT_C_BYTES, &al_d,
                                                 sizeof al_d), "set alignment C");
    LT_STEP(cublasLtMatmulPreferenceSetAttribute(pref, CUBLASLT_MATMUL_PREF_MIN_ALIGNMENT_D_BYTES, &al_d,
                                                 sizeof al_d), "set alignment D");
    LT_STEP(cublasLtMatmulAlgoGetHeuristic(h, op, la, lb, ld, ld, pref, 1, &best, &found), "AlgoGetHeuristic");
    if (found < 1) {
        st = lm_error(LM_ERR_IO, "cuBLASLt: no algorithm for the product m=%llu n=%llu k=%llu",
                      (unsigned long long)p->m, (unsigned long long)p->n, (unsigned long long)p->k);
        goto done;
    }
    e0 = lm_cuda_prof_begin((cudaStream_t)ctx->stream);
    LT_STEP(cublasLtMatmul(h, op, &alpha, p->a, la, p->b, lb, &beta, p->d, ld, p->d, ld, &best.algo,
                           ctx->lt_workspace, ctx->lt_workspace_bytes, (cudaStream_t)ctx->stream),
            "Matmul");
    if (e0) {
        const lm_cuda_prof_shape shape = {"lt", p->m, p->n, p->k, 1, p->trans_a == CUBLAS_OP_T,
                                          p->trans_b == CUBLAS_OP_T, p->d_type == CUDA_R_16BF, p->beta};
        lm_cuda_prof_end((cudaStream_t)ctx->stream, e0, &shape); /* it keeps or frees e0 */
        e0 = NULL;
    }
#undef LT_STEP
done:
    if (e0) cudaEventDestroy(e0); /* the product failed */
    if (pref) cublasLtMatmulPreferenceDestroy(pref);
    if (ld) cublasLtMatrixLayoutDestroy(ld);
    if (lb) cublasLtMatrixLayoutDestroy(lb);
    if (la) cublasLtMatrixLayoutDestroy(la);
    if (op) cublasLtMatmulDescDestroy(op);
    return st;
}

static lm_status check_product(const lm_cuda_context *ctx, const void *out, const void *inp, const void *weight,
                               int64_t n, int ic, int oc, const char *fn) {
    if (!ctx || !ctx->cublaslt) return lm_error(LM_ERR_ARG, "%s: ctx is NULL or has no cuBLASLt handle", fn);
    if (n < 0) return lm_error(LM_ERR_ARG, "%s: n = %lld is negative", fn, (long long)n);
    if (ic < 1) return lm_error(LM_ERR_ARG, "%s: ic = %d must be >= 1", fn, ic);
    if (oc < 1) return lm_error(LM_ERR_ARG, "%s: oc = %d must be >= 1", fn, oc);
    if (n > 0 && (!out || !inp || !weight)) return lm_error(LM_ERR_ARG, "%s: out, inp or weight is NULL", fn);
    return LM_OK;
}

static lm_status forward(const lm_cuda_context *ctx, void *out, cudaDataType_t out_type, const uint16_t *inp,
                         const uint16_t *weight, int64_t n, int ic, int oc, int accumulate) {
    // inp is (n,ic), weight is (oc,ic), out is (n,oc)
    /* trans_a, trans_b; m, n, k; a, b; lda, ldb; d, ldd; d_type, beta */
    const lt_product p = {CUBLAS_OP_T, CUBLAS_OP_N, (uint64_t)oc, (uint64_t)n, (uint64_t)ic, weight, inp,
                          ic, ic, out, oc, out_type, accumulate ? 1.0f : 0.0f};
    return lt_run(ctx, &p);
}

extern "C" lm_status lm_cuda_matmul_forward(const lm_cuda_context *ctx, float *out, const uint16_t *inp,
                                            const uint16_t *weight, int64_t n, int ic, int oc, int accumulate) {
    lm_status st = check_product(ctx, out, inp, weight, n, ic, oc, "lm_cuda_matmul_forward");
    if (st || n == 0) return st;
    return forward(ctx, out, CUDA_R_32F, inp, weight, n, ic, oc, accumulate);
}

extern "C" lm_status lm_cuda_matmul_forward_bf16(const lm_cuda_context *ctx, uint16_t *out, const uint16_t *inp,
                                                 const uint16_t *weight, int64_t n, int ic, int oc) {
    lm_status st = check_product(ctx, out, inp, weight, n, ic, oc, "lm_cuda_matmul_forward_bf16");
    if (st || n == 0) return st;
    return forward(ctx, out, CUDA_R_16BF, inp, weight, n, ic, oc, 0);
}

static lm_status backward(const lm_cuda_context *ctx, float *dinp, float *dweight, const uint16_t *dout,
                          int64_t ld_dout, const uint16_t *inp, const uint16_t *weight, int64_t n, int ic, int oc,
                          float dinp_beta, const char *fn) {
    // dout is (n,oc) with rows ld_dout apart; dinp (n,ic) = or += dout . weight; dweight (oc,ic) += dout^T . inp
    lm_status st = check_product(ctx, dout, inp, weight, n, ic, oc, fn);
    if (st || n == 0) return st;
    /* trans_a, trans_b; m, n, k; a, b; lda, ldb; d, ldd; d_type, beta */
    if (dinp) {
        const lt_product p = {CUBLAS_OP_N, CUBLAS_OP_N, (uint64_t)ic, (uint64_t)n, (uint64_t)oc, weight, dout,
                              ic, ld_dout, dinp, ic, CUDA_R_32F, dinp_beta};
        if ((st = lt_run(ctx, &p))) return st;
    }
    if (dweight) {
        const lt_product p = {CUBLAS_OP_N, CUBLAS_OP_T, (uint64_t)ic, (uint64_t)oc, (uint64_t)n, inp, dout,
                              ic, ld_dout, dweight, ic, CUDA_R_32F, 1.0f};
        if ((st = lt_run(ctx, &p))) return st;
    }
    return LM_OK;
}

extern "C" lm_status lm_cuda_matmul_backward(const lm_cuda_context *ctx, float *dinp, float *dweight,
                                             const uint16_t *dout, const uint16_t *inp, const uint16_t *weight,
                                             int64_t n, int ic, int oc) {
    return backward(ctx, dinp, dweight, dout, oc, inp, weight, n, ic, oc, 1.0f, "lm_cuda_matmul_backward");
}

extern "C" lm_status lm_cuda_matmul_backward_set(const lm_cuda_context *ctx, float *dinp, float *dweight,
                                                 const uint16_t *dout, const uint16_t *inp, const uint16_t *weight,
                                                 int64_t n, int ic, int oc) {
    return backward(ctx, dinp, dweight, dout, oc, inp, weight, n, ic, oc, 0.0f, "lm_cuda_matmul_backward_set");
}

extern "C" lm_status lm_cuda_matmul_backward_ld(const lm_cuda_context *ctx, float *dinp, float *dweight,
                                                const uint16_t *dout, int64_t ld_dout, const uint16_t *inp,
                                                const uint16_t *weight, int64_t n, int ic, int oc, int set) {
    const char *fn = "lm_cuda_matmul_backward_ld";
    if (ld_dout < oc || ld_dout % 8)
        return lm_error(LM_ERR_ARG, "%s: ld_dout = %lld must be >= oc = %d and a multiple of 8", fn,
                        (long long)ld_dout, oc);
    return backward(ctx, dinp, dweight, dout, ld_dout, inp, weight, n, ic, oc, set ? 0.0f : 1.0f, fn);
}

/* The MoE layer on the GPU: planning of the device buffers, the expert
 * activations and the latent RMSNorm, forward and backward
 * (include/longmoe/moe_cuda.h; the CPU mirror is src/ops/moe/moe.c). */
#include <math.h>
#include <stdint.h>
#include <string.h>

#include "cuda/cuda_check.h"
#include "cuda/moe/moe_internal.cuh"
#include "check.h"
#include "longmoe/moe.h"
#include "longmoe/linear_cuda.h"
#include "longmoe/moe_cuda.h"

#define ALIGN_BYTES 256
/* tokens per block of the lat_norm gradient's partial sums */
/* tokens a block of the latent norm's weight-gradient partials: the fused
 * kernel's (NORM_CHUNK) and the separate one's (NORM_CHUNK_ROW) */
#define NORM_CHUNK 64
#define NORM_CHUNK_ROW 256

static unsigned blocks_for(int64_t count, int threads) { return (unsigned)((count + threads - 1) / threads); }

static int expert_width(const lm_moe_config *c) { return c->d_latent > 0 ? c->d_latent : c->d; }

static int64_t rows_capacity(const lm_moe_config *c, int64_t m_max) {
    int64_t mk = m_max * c->top_k;
    return (mk + LM_MOE_CUDA_ROW_TILE - 1) / LM_MOE_CUDA_ROW_TILE * LM_MOE_CUDA_ROW_TILE +
           (int64_t)c->n_experts * LM_MOE_CUDA_ROW_TILE;
}

static lm_status check_capacity(const lm_moe_config *c, int64_t m_max) {
    lm_status st = lm_moe_check(c);
    if (st) return st;
    if (m_max < 1 || m_max * c->top_k > INT32_MAX)
        return lm_error(LM_ERR_ARG, "moe cuda: m_max must lie in [1, 2^31 / top_k], got %lld", (long long)m_max);
    int64_t rows = rows_capacity(c, m_max);
    if (rows > INT32_MAX || rows / LM_MOE_CUDA_ROW_TILE > 65535 || (m_max + 63) / 64 > 65535)
        return lm_error(LM_ERR_ARG, "moe cuda: m_max = %lld gives %lld grouped rows, more than the grid holds",
                        (long long)m_max, (long long)rows);
    return LM_OK;
}

/* The buffer tables: pointer, bytes. One place defines the layout. */
typedef struct { void **ptr; size_t bytes; } buffer_entry;

static size_t layout_buffers(buffer_entry *t, size_t count, char *base) {
    size_t off = 0;
    for (size_t i = 0; i < count; i++) {
        if (base) *t[i].ptr = t[i].bytes ? base + off : NULL;
        off += (t[i].bytes + ALIGN_BYTES - 1) / ALIGN_BYTES * ALIGN_BYTES;
    }
    return off;
}

static size_t acts_layout(lm_cuda_moe_acts *a, const lm_moe_config *c, int64_t m_max, char *base) {
    size_t m = (size_t)m_max, n = (size_t)c->n_experts, k = (size_t)c->top_k, f = (size_t)c->d_ff;
    size_t d = (size_t)c->d, de = (size_t)expert_width(c), dl = (size_t)c->d_latent;
    size_t ns = (size_t)c->n_shared, fs = (size_t)c->d_ff_shared, mk = m * k;
    size_t P = (size_t)rows_capacity(c, m_max), nblk = (mk + LM_MOE_SORT_BLOCK - 1) / LM_MOE_SORT_BLOCK;
    buffer_entry t[] = {
        {(void **)&a->s, m * n * 4},          {(void **)&a->topk, mk * 4},
        {(void **)&a->weights, mk * 4},       {(void **)&a->offsets, (n + 1) * 4},
        {(void **)&a->padded_offsets, (n + 1) * 4}, {(void **)&a->order, P * 4},
        {(void **)&a->slot_row, mk * 4},      {(void **)&a->block_counts, nblk * n * 4},
        {(void **)&a->x_own, (dl || ns) ? m * d * 2 : 0}, {(void **)&a->x_lat, m * dl * 2},
        {(void **)&a->xg, P * de * 2},        {(void **)&a->ga, P * f * 2},
        {(void **)&a->gu, P * f * 2},         {(void **)&a->gh, P * f * 2},
        {(void **)&a->gout, P * de * 2},      {(void **)&a->z, dl ? m * de * 4 : 0},
        {(void **)&a->rstd, dl ? m * 4 : 0},  {(void **)&a->zn, m * dl * 2},
        {(void **)&a->sa, ns * m * fs * 2},   {(void **)&a->su, ns * m * fs * 2},
        {(void **)&a->sh, ns * m * fs * 2},
        /* two sets of three arrays: the stream's and the side stream's */
        {(void **)&a->blas_ptrs, 2 * 3 * (size_t)lm_moe_blas_ptr_capacity((int64_t)n, (int64_t)P) * sizeof(void *)},
    };
    return layout_buffers(t, sizeof t / sizeof t[0], base);
}

static size_t scratch_layout(lm_cuda_moe_scratch *s, const lm_moe_config *c, int64_t m_max, char *base) {
    size_t m = (size_t)m_max, n = (size_t)c->n_experts, k = (size_t)c->top_k, f = (size_t)c->d_ff;
    size_t d = (size_t)c->d, de = (size_t)expert_width(c), dl = (size_t)c->d_latent;
    size_t ns = (size_t)c->n_shared, fs = (size_t)c->d_ff_shared, mk = m * k;
    size_t P = (size_t)rows_capacity(c, m_max), nchunk = (m + NORM_CHUNK - 1) / NORM_CHUNK;
    const size_t kc = 2 * ns * fs + dl; /* dcat's columns */
    buffer_entry t[] = {
        {(void **)&s->dy_bf16, (dl || ns) ? m * d * 2 : 0},
        {(void **)&s->dzn, m * dl * 4},           {(void **)&s->dz, m * dl * 4},
        {(void **)&s->norm_partial, nchunk * dl * 4},
        {(void **)&s->dgout, P * de * 2},         {(void **)&s->dp, mk * 4},
        {(void **)&s->dh, P * f * 2},             {(void **)&s->da, P * f * 2},
        {(void **)&s->du, P * f * 2},             {(void **)&s->dxg, P * de * 2},
        {(void **)&s->dw_bf16, n * f * de * 2},
        {(void **)&s->dcat, m * kc * 2},          {(void **)&s->wcat, kc * d * 2},
        {(void **)&s->dr, m * n * 4},             {(void **)&s->dsh, ns ? m * fs * 2 : 0},
    };
    return layout_buffers(t, sizeof t / sizeof t[0], base);
}

extern "C" size_t lm_cuda_moe_acts_bytes(const lm_moe_config *cfg, int64_t m_max) {
    if (!cfg || check_capacity(cfg, m_max)) return 0;
    lm_cuda_moe_acts a;
    return acts_layout(&a, cfg, m_max, NULL);
}

extern "C" size_t lm_cuda_moe_scratch_bytes(const lm_moe_config *cfg, int64_t m_max) {
    if (!cfg || check_capacity(cfg, m_max)) return 0;
    lm_cuda_moe_scratch s;
    return scratch_layout(&s, cfg, m_max, NULL);
}

/* The block checks both carvings make (after check_capacity) before laying it out. */
static lm_status check_block(const void *block, size_t bytes, size_t need, const char *what) {
    if (!block || ((uintptr_t)block % ALIGN_BYTES))
        return lm_error(LM_ERR_ARG, "moe cuda: %s block must be a %d-byte aligned device pointer", what, ALIGN_BYTES);
    if (bytes < need) return lm_error(LM_ERR_ARG, "moe cuda: %s block of %zu bytes, need %zu", what, bytes, need);
    return LM_OK;
}

extern "C" lm_status lm_cuda_moe_acts_carve(lm_cuda_moe_acts *acts, const lm_moe_config *cfg, int64_t m_max,
                                            void *block, size_t bytes) {
    if (!acts || !cfg) return lm_error(LM_ERR_ARG, "moe cuda: acts and cfg must not be NULL");
    memset(acts, 0, sizeof *acts);
    lm_status st = check_capacity(cfg, m_max);
    if (!st) st = check_block(block, bytes, acts_layout(acts, cfg, m_max, NULL), "acts");
    if (st) return st;
    acts_layout(acts, cfg, m_max, (char *)block);
    acts->m_max = m_max;
    acts->rows_max = rows_capacity(cfg, m_max);
    return LM_OK;
}

extern "C" lm_status lm_cuda_moe_scratch_carve(lm_cuda_moe_scratch *scratch, const lm_moe_config *cfg,
                                               int64_t m_max, void *block, size_t bytes) {
    if (!scratch || !cfg) return lm_error(LM_ERR_ARG, "moe cuda: scratch and cfg must not be NULL");
    memset(scratch, 0, sizeof *scratch);
    lm_status st = check_capacity(cfg, m_max);
    if (!st) st = check_block(block, bytes, scratch_layout(scratch, cfg, m_max, NULL), "scratch");
    if (st) return st;
    scratch_layout(scratch, cfg, m_max, (char *)block);
    scratch->m_max = m_max;
    scratch->rows_max = rows_capacity(cfg, m_max);
    return LM_OK;
}

/* ---- elementwise kernels ---- */

__device__ __forceinline__ float sigmoid_dev(float x) {
    if (x >= 0.0f) return 1.0f / (1.0f + expf(-x));
    float e = expf(x);
    return e / (1.0f + e);
}

/* h = act(a, u) (lm_expert_act_forward). u / 25 is taken as u * 0.04f: under
 * --use_fast_math a division is a reciprocal on the special-function units,
 * which with the two tanh and the exponential set the forward's pace. */
__device__ __forceinline__ float act_forward(int act, float a, float u) {
    if (act == LM_EXPERT_SITU_GLU) return 4.0f * tanhf(0.25f * a) * sigmoid_dev(a) * 25.0f * tanhf(u * 0.04f);
    return a * sigmoid_dev(a) * u;
}

/* dh/da, dh/du (lm_expert_act_backward) */
__device__ __forceinline__ void act_backward(int act, float a, float u, float *ga, float *gu) {
    float sg = sigmoid_dev(a);
    if (act == LM_EXPERT_SITU_GLU) {
        float ta = tanhf(0.25f * a), tu = tanhf(u * 0.04f);
        float fa = 4.0f * ta * sg, g = 25.0f * tu;
        *ga = ((1.0f - ta * ta) * sg + fa * (1.0f - sg)) * g;
        *gu = fa * (1.0f - tu * tu);
        return;
    }
    *ga = u * sg * (1.0f + a * (1.0f - sg));
    *gu = a * sg;
}

/* Rows r < min(rows, *row_limit) (row_limit may be NULL) of width f. */
__global__ void glu_forward_kernel(bf16 *h, const bf16 *a, const bf16 *u, const int32_t *row_limit, int64_t rows,
                                   int f, int act) {
    int64_t q = (int64_t)blockIdx.x * blockDim.x + threadIdx.x;
    if (q >= rows * f || (row_limit && q / f >= (int64_t)*row_limit)) return;
    h[q] = __float2bfloat16_rn(act_forward(act, __bfloat162float(a[q]), __bfloat162float(u[q])));
}

/* da, du: rows ldo elements apart (f: dense) */
__global__ void glu_backward_kernel(bf16 *da, bf16 *du, const bf16 *dh, const bf16 *a, const bf16 *u,
                                    const int32_t *row_limit, int64_t rows, int f, int act, int64_t ldo) {
    int64_t q = (int64_t)blockIdx.x * blockDim.x + threadIdx.x;
    if (q >= rows * f || (row_limit && q / f >= (int64_t)*row_limit)) return;
    float ga, gu, g = __bfloat162float(dh[q]);
    act_backward(act, __bfloat162float(a[q]), __bfloat162float(u[q]), &ga, &gu);
    const int64_t o = q / f * ldo + q % f;
    da[o] = __float2bfloat16_rn(g * ga);
    du[o] = __float2bfloat16_rn(g * gu);
}

/* The same, 8 elements (16 bytes) a thread: f % 8 == 0, 16-byte aligned rows. */
__global__ void glu_forward_vec_kernel(uint4 *h, const uint4 *a, const uint4 *u, const int32_t *row_limit,
                                       int64_t rows, int f8, int act) {
    int64_t q = (int64_t)blockIdx.x * blockDim.x + threadIdx.x;
    if (q >= rows * f8 || (row_limit && q / f8 >= (int64_t)*row_limit)) return;
    uint4 av = a[q], uv = u[q], hv;
    const bf16 *ap = (const bf16 *)&av, *up = (const bf16 *)&uv;
    bf16 *hp = (bf16 *)&hv;
#pragma unroll
    for (int e = 0; e < 8; e++)
        hp[e] = __float2bfloat16_rn(act_forward(act, __bfloat162float(ap[e]), __bfloat162float(up[e])));
    h[q] = hv;
}

__global__ void glu_backward_vec_kernel(uint4 *da, uint4 *du, const uint4 *dh, const uint4 *a, const uint4 *u,
                                        const int32_t *row_limit, int64_t rows, int f8, int act, int64_t ldo8) {
    int64_t q = (int64_t)blockIdx.x * blockDim.x + threadIdx.x;
    if (q >= rows * f8 || (row_limit && q / f8 >= (int64_t)*row_limit)) return;
    uint4 av = a[q], uv = u[q], gv = dh[q], dav, duv;
    const bf16 *ap = (const bf16 *)&av, *up = (const bf16 *)&uv, *gp = (const bf16 *)&gv;
    bf16 *dap = (bf16 *)&dav, *dup = (bf16 *)&duv;
#pragma unroll
    for (int e = 0; e < 8; e++) {
        float ga, gu, g = __bfloat162float(gp[e]);
        act_backward(act, __bfloat162float(ap[e]), __bfloat162float(up[e]), &ga, &gu);
        dap[e] = __float2bfloat16_rn(g * ga);
        dup[e] = __float2bfloat16_rn(g * gu);
    }
    const int64_t o = q / f8 * ldo8 + q % f8;
    da[o] = dav;
    du[o] = duv;
}

static bool aligned16(const void *p) { return (uintptr_t)p % 16 == 0; }

/* The fused latent-norm kernels' chunks of 8 a lane for d_lat
 * (lm_moe_token_chunks), or 0 where they do not run (rows by grouped row, or
 * a pointer not 16-byte aligned): the separate kernels then run. */
static int norm_chunks(int dl, const void *p, const void *q, const void *r, const void *w) {
    if (!lm_cuda_moe_by_token() || !aligned16(p) || !aligned16(q) || !aligned16(r) || !aligned16(w)) return 0;
    return lm_moe_token_chunks(dl);
}

/* h = act(a, u) on rows [0, min(rows, *row_limit)) of width f */
static lm_status glu_forward(cudaStream_t st, void *h, const void *a, const void *u, const int32_t *row_limit,
                             int64_t rows, int f, int act) {
    if (f % 8 == 0 && aligned16(h) && aligned16(a) && aligned16(u))
        glu_forward_vec_kernel<<<blocks_for(rows * (f / 8), 256), 256, 0, st>>>(
            (uint4 *)h, (const uint4 *)a, (const uint4 *)u, row_limit, rows, f / 8, act);
    else
        glu_forward_kernel<<<blocks_for(rows * f, 256), 256, 0, st>>>((bf16 *)h, (const bf16 *)a, (const bf16 *)u,
                                                                     row_limit, rows, f, act);
    LM_CUDA_TRY(cudaGetLastError());
    return LM_OK;
}

/* da, du written with rows ldo (>= f) elements apart: f dense, more for column blocks of dcat */
static lm_status glu_backward(cudaStream_t st, void *da, void *du, const void *dh, const void *a, const void *u,
                              const int32_t *row_limit, int64_t rows, int f, int act, int64_t ldo) {
    if (f % 8 == 0 && ldo % 8 == 0 && aligned16(da) && aligned16(du) && aligned16(dh) && aligned16(a) &&
        aligned16(u))
        glu_backward_vec_kernel<<<blocks_for(rows * (f / 8), 256), 256, 0, st>>>(
            (uint4 *)da, (uint4 *)du, (const uint4 *)dh, (const uint4 *)a, (const uint4 *)u, row_limit, rows, f / 8,
            act, ldo / 8);
    else
        glu_backward_kernel<<<blocks_for(rows * f, 256), 256, 0, st>>>((bf16 *)da, (bf16 *)du, (const bf16 *)dh,
                                                                      (const bf16 *)a, (const bf16 *)u, row_limit,
                                                                      rows, f, act, ldo);
    LM_CUDA_TRY(cudaGetLastError());
    return LM_OK;
}

/* RMSNorm of the latent sum, one warp a token: rstd = 1/sqrt(mean z^2 + eps),
 * zn = z rstd w (bf16: the operand of W_up_lat). */
__global__ void rmsnorm_forward_kernel(bf16 *zn, float *rstd, const float *z, const float *w, int64_t m, int dl,
                                       float eps) {
    int64_t i = (int64_t)blockIdx.x * (blockDim.x / 32) + threadIdx.x / 32;
    int lane = threadIdx.x % 32;
    if (i >= m) return;
    const float *zi = z + i * dl;
    float ss = 0.0f;
    for (int e = lane; e < dl; e += 32) ss += zi[e] * zi[e];
    for (int off = 16; off > 0; off >>= 1) ss += __shfl_xor_sync(0xffffffffu, ss, off);
    float s = 1.0f / sqrtf(ss / (float)dl + eps);
    if (lane == 0) rstd[i] = s;
    for (int e = lane; e < dl; e += 32) zn[i * dl + e] = __float2bfloat16_rn(zi[e] * s * w[e]);
}

/* dz = s w g - z s^3 / d sum_j w_j g_j z_j (lm_rmsnorm_backward), one warp a token. */
__global__ void rmsnorm_backward_kernel(float *dz, const float *g, const float *z, const float *w,
                                        const float *rstd, int64_t m, int dl) {
    int64_t i = (int64_t)blockIdx.x * (blockDim.x / 32) + threadIdx.x / 32;
    int lane = threadIdx.x % 32;
    if (i >= m) return;
    const float *zi = z + i * dl, *gi = g + i * dl;
    float dot = 0.0f;
    for (int e = lane; e < dl; e += 32) dot += gi[e] * w[e] * zi[e];
    for (int off = 16; off > 0; off >>= 1) dot += __shfl_xor_sync(0xffffffffu, dot, off);
    float s = rstd[i], c = dot * s * s * s / (float)dl;
    for (int e = lane; e < dl; e += 32) dz[i * dl + e] = s * gi[e] * w[e] - c * zi[e];
}

/* lat_norm gradient, sum over tokens of g z rstd: per-chunk partials ... */
__global__ void norm_weight_partial_kernel(float *partial, const float *g, const float *z, const float *rstd,
                                           int64_t m, int dl) {
    int e = blockIdx.x * blockDim.x + threadIdx.x;
    if (e >= dl) return;
    int64_t i0 = (int64_t)blockIdx.y * NORM_CHUNK_ROW, i1 = i0 + NORM_CHUNK_ROW < m ? i0 + NORM_CHUNK_ROW : m;
    float acc = 0.0f;
    for (int64_t i = i0; i < i1; i++) acc += g[i * dl + e] * z[i * dl + e] * rstd[i];
    partial[(int64_t)blockIdx.y * dl + e] = acc;
}

/* The latent sum and its RMSNorm in one pass (LatentMoE, d_lat % 8 == 0 and
 * d_lat <= 32 * 8 * MAXC), one warp a token: z_i = sum_t p_it gout[slot_row(i,t)]
 * (lm_moe_combine_chunk, as the by-row combination: the same z),
 * written for the backward, then rstd = 1/sqrt(mean z^2 + eps) and zn = z rstd w
 * from the registers: z is not read back. Lane l holds the 8-element chunks
 * l, l + 32, ... of the row. */
template <int MAXC>
__global__ void __launch_bounds__(256) combine_norm_kernel(float *z, bf16 *zn, float *rstd, const bf16 *gout,
                                                           const float *weights, const int32_t *slot_row,
                                                           const float *w, int64_t m, int k, int dl, float eps) {
    const int64_t i = (int64_t)blockIdx.x * 8 + threadIdx.x / 32;
    const int lane = threadIdx.x % 32, w8 = dl / 8;
    if (i >= m) return;
    float v[MAXC][8];
    float ss = 0.0f;
#pragma unroll
    for (int c = 0; c < MAXC; c++) {
        const int e8 = lane + 32 * c;
        if (e8 >= w8) continue;
        lm_moe_combine_chunk(v[c], gout, weights, slot_row, i, k, dl, e8);
        float4 *o = (float4 *)(z + i * dl) + 2 * e8;
        o[0] = make_float4(v[c][0], v[c][1], v[c][2], v[c][3]);
        o[1] = make_float4(v[c][4], v[c][5], v[c][6], v[c][7]);
#pragma unroll
        for (int e = 0; e < 8; e++) ss += v[c][e] * v[c][e];
    }
    for (int off = 16; off > 0; off >>= 1) ss += __shfl_xor_sync(0xffffffffu, ss, off);
    const float s = 1.0f / sqrtf(ss / (float)dl + eps);
    if (lane == 0) rstd[i] = s;
#pragma unroll
    for (int c = 0; c < MAXC; c++) {
        const int e8 = lane + 32 * c;
        if (e8 >= w8) continue;
        const float4 wl = ((const float4 *)w)[2 * e8], wh = ((const float4 *)w)[2 * e8 + 1];
        const float wv[8] = {wl.x, wl.y, wl.z, wl.w, wh.x, wh.y, wh.z, wh.w};
        uint4 out;
        __nv_bfloat162 *op = (__nv_bfloat162 *)&out;
#pragma unroll
        for (int e = 0; e < 4; e++)
            op[e] = __floats2bfloat162_rn(v[c][2 * e] * s * wv[2 * e], v[c][2 * e + 1] * s * wv[2 * e + 1]);
        ((uint4 *)(zn + i * dl))[e8] = out;
    }
}

/* The RMSNorm's backward and its weight's gradient partials in one pass (the
 * same conditions): a block takes NORM_CHUNK consecutive tokens, its warp w the
 * tokens w, w + 8, ...; per token dz = s w g - z s^3 / d sum_j w_j g_j z_j
 * (rmsnorm_backward_kernel's formula), and every lane adds g z s of its columns
 * over its tokens; the block sums its warps in order into partial[block]
 * (norm_weight_final_kernel then sums the blocks in order: no atomics). g and z
 * are read once, where the separate kernels read them twice. */
template <int MAXC>
__global__ void __launch_bounds__(256) norm_backward_fused_kernel(float *dz, float *partial, const float *g,
                                                                  const float *z, const float *w, const float *rstd,
                                                                  int64_t m, int dl) {
    __shared__ float red[8][32 * 8 * MAXC];
    const int warp = threadIdx.x / 32, lane = threadIdx.x % 32, w8 = dl / 8;
    const int64_t i0 = (int64_t)blockIdx.x * NORM_CHUNK;
    float wv[MAXC][8], acc[MAXC][8];
#pragma unroll
    for (int c = 0; c < MAXC; c++) {
        const int e8 = lane + 32 * c;
#pragma unroll
        for (int e = 0; e < 8; e++) wv[c][e] = acc[c][e] = 0.0f;
        if (e8 < w8) {
            const float4 wl = ((const float4 *)w)[2 * e8], wh = ((const float4 *)w)[2 * e8 + 1];
            wv[c][0] = wl.x, wv[c][1] = wl.y, wv[c][2] = wl.z, wv[c][3] = wl.w;
            wv[c][4] = wh.x, wv[c][5] = wh.y, wv[c][6] = wh.z, wv[c][7] = wh.w;
        }
    }
    for (int j = warp; j < NORM_CHUNK; j += 8) {
        const int64_t i = i0 + j;
        if (i >= m) break;
        float gv[MAXC][8], zv[MAXC][8];
        float dot = 0.0f;
#pragma unroll
        for (int c = 0; c < MAXC; c++) {
            const int e8 = lane + 32 * c;
#pragma unroll
            for (int e = 0; e < 8; e++) gv[c][e] = zv[c][e] = 0.0f;
            if (e8 >= w8) continue;
            const float4 *gp = (const float4 *)(g + i * dl) + 2 * e8, *zp = (const float4 *)(z + i * dl) + 2 * e8;
            const float4 g0 = gp[0], g1 = gp[1], z0 = zp[0], z1 = zp[1];
            gv[c][0] = g0.x, gv[c][1] = g0.y, gv[c][2] = g0.z, gv[c][3] = g0.w;
            gv[c][4] = g1.x, gv[c][5] = g1.y, gv[c][6] = g1.z, gv[c][7] = g1.w;
            zv[c][0] = z0.x, zv[c][1] = z0.y, zv[c][2] = z0.z, zv[c][3] = z0.w;
            zv[c][4] = z1.x, zv[c][5] = z1.y, zv[c][6] = z1.z, zv[c][7] = z1.w;
#pragma unroll
            for (int e = 0; e < 8; e++) dot += gv[c][e] * wv[c][e] * zv[c][e];
        }
        for (int off = 16; off > 0; off >>= 1) dot += __shfl_xor_sync(0xffffffffu, dot, off);
        const float s = rstd[i], cc = dot * s * s * s / (float)dl;
#pragma unroll
        for (int c = 0; c < MAXC; c++) {
            const int e8 = lane + 32 * c;
            if (e8 >= w8) continue;
            float o[8];
#pragma unroll
            for (int e = 0; e < 8; e++) {
                o[e] = s * gv[c][e] * wv[c][e] - cc * zv[c][e];
                acc[c][e] += gv[c][e] * zv[c][e] * s;
            }
            float4 *op = (float4 *)(dz + i * dl) + 2 * e8;
            op[0] = make_float4(o[0], o[1], o[2], o[3]);
            op[1] = make_float4(o[4], o[5], o[6], o[7]);
        }
    }
#pragma unroll
    for (int c = 0; c < MAXC; c++) {
        const int e8 = lane + 32 * c;
        if (e8 >= w8) continue;
#pragma unroll
        for (int e = 0; e < 8; e++) red[warp][8 * e8 + e] = acc[c][e];
    }
    __syncthreads();
    for (int col = threadIdx.x; col < dl; col += 256) {
        float t = 0.0f;
        for (int q = 0; q < 8; q++) t += red[q][col];
        partial[(int64_t)blockIdx.x * dl + col] = t;
    }
}

/* ... then summed in chunk order */
__global__ void norm_weight_final_kernel(float *dw, const float *partial, int64_t nchunk, int dl) {
    int e = blockIdx.x * blockDim.x + threadIdx.x;
    if (e >= dl) return;
    float acc = 0.0f;
    for (int64_t b = 0; b < nchunk; b++) acc += partial[b * dl + e];
    dw[e] += acc;
}

/* ---- the layer ---- */

typedef lm_moe_runner runner;

/* A dense product: fp32 c or bf16 cb (exactly one), += with accumulate. */
static lm_status gemm(const runner *r, lm_gemm_layout layout, const void *a, int64_t lda, const void *b,
                      int64_t ldb, float *c, void *cb, int64_t ldc, int accumulate, int64_t M, int64_t N,
                      int64_t K) {
    lm_gemm_bf16_args g;
    memset(&g, 0, sizeof g);
    g.layout = layout;
    g.a = (const bf16 *)a;
    g.lda = lda;
    g.b = (const bf16 *)b;
    g.ldb = ldb;
    g.c = c;
    g.cb = (bf16 *)cb;
    g.ldc = ldc;
    g.accumulate = accumulate;
    g.M = M;
    g.N = N;
    g.K = K;
    if (r->kind == LM_MOE_GEMM_WMMA) return lm_moe_gemm_bf16(r->st, &g);
    return lm_moe_blas_dense(r->ctx, &g);
}

/* The grouped products: rows mode (NT, NN) over the grouped rows with
 * expert j's weight at b + j b_stride, or weight mode (TN) with expert j's
 * gradient at c + j c_stride. WMMA runs over all rows_max rows (padding
 * included); the cuBLAS kinds over each expert's real rows. */
static lm_status gemm_grouped(const runner *r, lm_gemm_layout layout, const void *a, int64_t lda, const void *b,
                              int64_t ldb, int64_t b_stride, float *c, void *cb, int64_t ldc, int64_t c_stride,
                              int accumulate, int64_t M, int64_t N, int64_t K) {
    lm_gemm_bf16_args g;
    memset(&g, 0, sizeof g);
    g.layout = layout;
    g.a = (const bf16 *)a;
    g.lda = lda;
    g.b = (const bf16 *)b;
    g.ldb = ldb;
    g.b_group_stride = b_stride;
    g.c = c;
    g.cb = (bf16 *)cb;
    g.ldc = ldc;
    g.c_group_stride = c_stride;
    g.accumulate = accumulate;
    g.M = M;
    g.N = N;
    g.K = K;
    g.group_offsets = r->acts->padded_offsets;
    g.groups = r->n;
    if (r->kind == LM_MOE_GEMM_WMMA && layout == LM_GEMM_TN && !accumulate) {
        /* set: zeroed, then added to (experts without rows included) */
        TRY(lm_moe_zero_weight_groups(r->st, &g, NULL));
        g.accumulate = 1;
    }
    if (r->kind == LM_MOE_GEMM_WMMA) return lm_moe_gemm_bf16(r->st, &g);
    if (r->kind == LM_MOE_GEMM_WGMMA) {
        /* rows mode on the Hopper kernel (NN through W^T in the backward's
         * scratch); weight gradients and anything it does not take: batched */
        if (lm_moe_wgmma_takes(&g) && (layout == LM_GEMM_NT || r->dw_tmp)) return lm_moe_wgmma_grouped(r->st, &g, r->dw_tmp);
        return lm_moe_blas_grouped(r->ctx, LM_MOE_GEMM_BATCHED, &g, r->acts, r->dw_tmp);
    }
    return lm_moe_blas_grouped(r->ctx, r->kind, &g, r->acts, r->dw_tmp);
}

/* The router's fp32 products: the own fp32 kernel with WMMA, cuBLAS otherwise. */
static lm_status gemm_f32(const runner *r, lm_gemm_layout layout, const float *a, int64_t lda, const float *b,
                          int64_t ldb, float *c, int64_t ldc, int accumulate, int64_t M, int64_t N, int64_t K) {
    if (r->kind == LM_MOE_GEMM_WMMA) return lm_moe_gemm_f32(r->st, layout, a, lda, b, ldb, c, ldc, accumulate, M, N, K);
    return lm_moe_blas_f32(r->ctx, layout, a, lda, b, ldb, c, ldc, accumulate, M, N, K);
}

/* The routed experts' products over grouped rows (rows a->xg .. a->gout,
 * r->n experts at a->padded_offsets, P = a->rows_max): a = x W_gate^T,
 * u = x W_up^T, h = act(a, u), out = h W_down^T. The EP owners run it on
 * their view of the rows they received (moe_ep.cu). */
lm_status lm_moe_experts_forward(const lm_moe_runner *r, const lm_moe_config *c, const lm_moe_params_bf16 *pb,
                                 lm_cuda_moe_acts *a) {
    const int f = c->d_ff, de = expert_width(c);
    const int64_t P = a->rows_max;
    const int32_t *rows_used = a->padded_offsets + r->n;
    TRY(gemm_grouped(r, LM_GEMM_NT, a->xg, de, pb->gate, de, (int64_t)f * de, NULL, a->ga, f, 0, 0, P, f, de));
    TRY(gemm_grouped(r, LM_GEMM_NT, a->xg, de, pb->up, de, (int64_t)f * de, NULL, a->gu, f, 0, 0, P, f, de));
    TRY(glu_forward(r->st, a->gh, a->ga, a->gu, rows_used, P, f, (int)c->act));
    TRY(gemm_grouped(r, LM_GEMM_NT, a->gh, f, pb->down, f, (int64_t)de * f, NULL, a->gout, de, 0, 0, P, de, f));
    return LM_OK;
}

/* Whether a layer call runs part of its work on the context's side stream (lm_cuda_moe_side_stream). */
static int side_usable(const lm_cuda_context *ctx, int kind, const lm_cuda_moe_ep *ep) {
    return !ep && kind == LM_MOE_GEMM_BATCHED && ctx->side_stream && lm_cuda_moe_side_stream();
}

/* With r->side, the side stream waits for the work enqueued on the stream so far (fork), or the
 * stream for the side stream's (join). */
static lm_status side_wait(const lm_moe_runner *r) {
    return r->side ? lm_cuda_stream_wait(r->ctx->side_stream, r->ctx->stream, r->ctx->side_fork) : LM_OK;
}
static lm_status side_join(const lm_moe_runner *r) {
    return r->side ? lm_cuda_stream_wait(r->ctx->stream, r->ctx->side_stream, r->ctx->side_join) : LM_OK;
}

/* The runner on the context's side stream: its cuBLAS handle and workspace, and the acts' second
 * set of pointer arrays (the stream's own set is in use at the same time); side, sctx and sacts are
 * filled. Without r->side: r itself. Work on it waits for the stream only after a side_wait. */
static const lm_moe_runner *side_runner(const lm_moe_runner *r, lm_moe_runner *side, lm_cuda_context *sctx,
                                        lm_cuda_moe_acts *sacts) {
    if (!r->side) return r;
    *sctx = *r->ctx;
    sctx->stream = r->ctx->side_stream;
    sctx->cublas = r->ctx->side_cublas;
    sctx->blas_workspace = r->ctx->side_blas_workspace;
    *sacts = *r->acts;
    sacts->blas_ptrs = r->acts->blas_ptrs + 3 * lm_moe_blas_ptr_capacity(r->n, r->acts->rows_max);
    *side = *r;
    side->ctx = sctx;
    side->st = (cudaStream_t)sctx->stream;
    side->acts = sacts;
    return side;
}

/* Their backward from e->dgout: dh = dout W_down, dW_down += dout^T h, da/du,
 * dxg = da W_gate + du W_up (the second product adds onto the bf16 first),
 * dW_gate, dW_up (with r->dw_set the three weight gradients = instead of +=).
 * With r->side the three weight gradients run on the context's side
 * stream, each after the side waits for what it reads (dgout, then da and du);
 * they write nothing else, so the stream goes on with the input gradients and
 * the rest of the layer's backward, and the caller joins them. */
lm_status lm_moe_experts_backward(const lm_moe_runner *r, const lm_moe_config *c, const lm_moe_params_bf16 *pb,
                                  const lm_moe_params *g, const lm_cuda_moe_acts *a, const lm_moe_expert_grads *e) {
    const int f = c->d_ff, de = expert_width(c);
    const int64_t P = a->rows_max;
    const int32_t *rows_used = a->padded_offsets + r->n;
    const int add = !r->dw_set;
    /* w runs the weight gradients: r itself, or on the side stream (after dgout) */
    lm_moe_runner side;
    lm_cuda_context sctx;
    lm_cuda_moe_acts sacts;
    const lm_moe_runner *w = side_runner(r, &side, &sctx, &sacts);
    TRY(side_wait(r)); /* dgout */
    if (g->down)
        TRY(gemm_grouped(w, LM_GEMM_TN, e->dgout, de, a->gh, f, 0, g->down, NULL, f, (int64_t)de * f, add, de, f, 0));
    TRY(gemm_grouped(r, LM_GEMM_NN, e->dgout, de, pb->down, f, (int64_t)de * f, NULL, e->dh, f, 0, 0, P, f, de));
    TRY(glu_backward(r->st, e->da, e->du, e->dh, a->ga, a->gu, rows_used, P, f, (int)c->act, f));
    TRY(side_wait(r)); /* da, du */
    if (g->gate)
        TRY(gemm_grouped(w, LM_GEMM_TN, e->da, f, a->xg, de, 0, g->gate, NULL, de, (int64_t)f * de, add, f, de, 0));
    if (g->up)
        TRY(gemm_grouped(w, LM_GEMM_TN, e->du, f, a->xg, de, 0, g->up, NULL, de, (int64_t)f * de, add, f, de, 0));
    TRY(gemm_grouped(r, LM_GEMM_NN, e->da, f, pb->gate, de, (int64_t)f * de, NULL, e->dxg, de, 0, 0, P, de, f));
    TRY(gemm_grouped(r, LM_GEMM_NN, e->du, f, pb->up, de, (int64_t)f * de, NULL, e->dxg, de, 0, 1, P, de, f));
    return LM_OK;
}

static lm_status check_params(const lm_moe_config *c, const lm_moe_params *pf, const lm_moe_params_bf16 *pb) {
    if (!pf || !pb) return lm_error(LM_ERR_ARG, "moe cuda: params_f32 and params_bf16 must not be NULL");
    if (!pf->router) return lm_error(LM_ERR_ARG, "moe cuda: params_f32->router is NULL");
    if (!pb->gate || !pb->up || !pb->down) return lm_error(LM_ERR_ARG, "moe cuda: params_bf16 gate/up/down NULL");
    if (c->d_latent > 0 && (!pb->lat_down || !pb->lat_up || !pf->lat_norm))
        return lm_error(LM_ERR_ARG, "moe cuda: LatentMoE needs params_bf16 lat_down, lat_up and params_f32 lat_norm");
    if (c->n_shared > 0 && (!pb->shared_gate || !pb->shared_up || !pb->shared_down))
        return lm_error(LM_ERR_ARG, "moe cuda: params_bf16 shared_gate/up/down NULL with %d shared experts",
                        c->n_shared);
    return LM_OK;
}

/* The layer; ep != NULL: the routed experts on their owners (a rank with no
 * tokens still takes part in the exchanges). */
static lm_status forward_impl(const lm_cuda_context *ctx, float *y, const float *x, const uint16_t *x_bf16,
                              const float *bias, const lm_moe_config *c, const lm_moe_params *pf,
                              const lm_moe_params_bf16 *pb, lm_cuda_moe_acts *a, int64_t m, lm_cuda_moe_ep *ep) {
    // x, y are (m,d) fp32; bias (n); everything the backward needs goes to acts
    if (!ctx || !c || !a) return lm_error(LM_ERR_ARG, "moe cuda forward: ctx, cfg and acts must not be NULL");
    TRY(lm_moe_check(c));
    TRY(check_params(c, pf, pb));
    if (m < 0 || m > a->m_max)
        return lm_error(LM_ERR_ARG, "moe cuda forward: m = %lld outside [0, m_max = %lld]", (long long)m,
                        (long long)a->m_max);
    if (m > 0 && (!y || !x)) return lm_error(LM_ERR_ARG, "moe cuda forward: y and x must not be NULL");
    lm_moe_gemm_kind kind;
    TRY(lm_cuda_moe_gemm(&kind));
    a->m = m;
    a->gemm_kind = (int)kind;
    if (m == 0 && !ep) return LM_OK;
    if (kind != LM_MOE_GEMM_WMMA && !ctx->cublas)
        return lm_error(LM_ERR_ARG, "moe cuda forward: the context has no cuBLAS handle");
    cudaStream_t st = (cudaStream_t)ctx->stream;
    runner R = {ctx, st, (int)kind, a, c->n_experts, NULL, 0, 0};
    if (m == 0) {
        /* no rows to send; the owner's part still runs */
        memset(a->host_offsets, 0, sizeof a->host_offsets);
        memset(a->host_padded, 0, sizeof a->host_padded);
        return lm_moe_ep_experts_forward_cuda(&R, c, pb, a, ep);
    }
    const runner *r = &R;
    int n = c->n_experts, k = c->top_k, d = c->d, de = expert_width(c), dl = c->d_latent;
    int ns = c->n_shared, fs = c->d_ff_shared;

    /* the bf16 x of lat_down and the shared experts: the caller's, else x rounded into x_own */
    a->x_bf16 = NULL;
    if (a->x_own && x_bf16) {
        a->x_bf16 = x_bf16;
    } else if (a->x_own) {
        TRY(lm_cuda_f32_to_bf16(ctx, a->x_own, x, (size_t)(m * d)));
        a->x_bf16 = a->x_own;
    }
    /* With the side stream (batched kind, no EP), the products that need x's bf16 copy alone (the
     * latent down-projection; the shared experts' gate and up with their GLU) run there while the
     * stream forms the router's fp32 logits, the routing and the host's row counts (the host then
     * waits for the stream alone); the stream waits for them before the gather. */
    R.side = a->x_bf16 && side_usable(ctx, kind, ep);
    lm_moe_runner side;
    lm_cuda_context sctx;
    lm_cuda_moe_acts sacts;
    const runner *w = side_runner(r, &side, &sctx, &sacts); /* r itself without the side stream */
    TRY(side_wait(r)); /* x's bf16 copy */
    if (dl > 0) TRY(gemm(w, LM_GEMM_NT, a->x_bf16, d, pb->lat_down, d, NULL, a->x_lat, dl, 0, m, dl, d));
    for (int e = 0; e < ns; e++) {
        size_t wo = (size_t)e * fs * d, ao = (size_t)e * m * fs;
        TRY(gemm(w, LM_GEMM_NT, a->x_bf16, d, pb->shared_gate + wo, d, NULL, a->sa + ao, fs, 0, m, fs, d));
        TRY(gemm(w, LM_GEMM_NT, a->x_bf16, d, pb->shared_up + wo, d, NULL, a->su + ao, fs, 0, m, fs, d));
        TRY(glu_forward(w->st, (bf16 *)a->sh + ao, (const bf16 *)a->sa + ao, (const bf16 *)a->su + ao, NULL, m, fs,
                        (int)c->act));
    }
    /* router in fp32: logits W_r x into s, then sigmoid, top-k, p and the grouping */
    TRY(gemm_f32(r, LM_GEMM_NT, x, d, pf->router, d, a->s, n, 0, m, n, d));
    TRY(lm_moe_route(st, a, bias, m, n, k, c->route_scale));
    /* the cuBLAS kinds size each expert's product on the host, and expert
     * parallelism each exchange */
    if (kind != LM_MOE_GEMM_WMMA || ep) TRY(lm_moe_blas_fetch_counts(ctx, a, n));
    TRY(side_join(r));

    /* expert inputs, grouped: x or (LatentMoE) W_down_lat x */
    if (dl > 0) {
        TRY(lm_moe_gather(st, (bf16 *)a->xg, NULL, (const bf16 *)a->x_lat, a, n, k, de));
    } else {
        TRY(lm_moe_gather(st, (bf16 *)a->xg, x, NULL, a, n, k, de));
    }
    /* the routed experts, here or (expert parallelism) on their owners */
    if (ep) TRY(lm_moe_ep_experts_forward_cuda(r, c, pb, a, ep));
    else TRY(lm_moe_experts_forward(r, c, pb, a));

    /* z_i = sum_t p_it E(x_i); y = z, or W_up_lat RMSNorm(z) */
    if (dl > 0) {
        const int mc = norm_chunks(dl, a->z, a->zn, a->gout, pf->lat_norm);
        if (mc == 1)
            combine_norm_kernel<1><<<blocks_for(m, 8), 256, 0, st>>>(a->z, (bf16 *)a->zn, a->rstd, (const bf16 *)a->gout,
                                                                   a->weights, a->slot_row, pf->lat_norm, m, k, dl,
                                                                   c->norm_eps);
        else if (mc == 2)
            combine_norm_kernel<2><<<blocks_for(m, 8), 256, 0, st>>>(a->z, (bf16 *)a->zn, a->rstd, (const bf16 *)a->gout,
                                                                   a->weights, a->slot_row, pf->lat_norm, m, k, dl,
                                                                   c->norm_eps);
        else if (mc == 4)
            combine_norm_kernel<4><<<blocks_for(m, 8), 256, 0, st>>>(a->z, (bf16 *)a->zn, a->rstd, (const bf16 *)a->gout,
                                                                   a->weights, a->slot_row, pf->lat_norm, m, k, dl,
                                                                   c->norm_eps);
        if (mc == 0) {
            TRY(lm_moe_combine(st, a->z, a, m, k, de));
            rmsnorm_forward_kernel<<<blocks_for(m, 8), 256, 0, st>>>((bf16 *)a->zn, a->rstd, a->z, pf->lat_norm, m, dl,
                                                                    c->norm_eps);
        }
        LM_CUDA_TRY(cudaGetLastError());
        TRY(gemm(r, LM_GEMM_NT, a->zn, dl, pb->lat_up, dl, y, NULL, d, 0, m, d, dl));
    } else {
        TRY(lm_moe_combine(st, y, a, m, k, de));
    }

    /* the shared experts' outputs, added to every token (their GLU ran above) */
    for (int e = 0; e < ns; e++) {
        size_t wo = (size_t)e * fs * d, ao = (size_t)e * m * fs;
        TRY(gemm(r, LM_GEMM_NT, a->sh + ao, fs, pb->shared_down + wo, fs, y, NULL, d, 1, m, d, fs));
    }
    return LM_OK;
}

extern "C" lm_status lm_cuda_moe_forward(const lm_cuda_context *ctx, float *y, const float *x,
                                         const uint16_t *x_bf16, const float *bias, const lm_moe_config *c,
                                         const lm_moe_params *pf, const lm_moe_params_bf16 *pb, lm_cuda_moe_acts *a,
                                         int64_t m) {
    return forward_impl(ctx, y, x, x_bf16, bias, c, pf, pb, a, m, NULL);
}

extern "C" lm_status lm_cuda_moe_forward_ep(const lm_cuda_context *ctx, float *y, const float *x,
                                            const uint16_t *x_bf16, const float *bias, const lm_moe_config *c,
                                            const lm_moe_params *pf, const lm_moe_params_bf16 *pb,
                                            lm_cuda_moe_acts *a, int64_t m, lm_cuda_moe_ep *ep) {
    if (!ep) return lm_error(LM_ERR_ARG, "moe cuda forward_ep: ep is NULL");
    TRY(lm_moe_ep_check_config(ep, c));
    return forward_impl(ctx, y, x, x_bf16, bias, c, pf, pb, a, m, ep);
}

static lm_status backward_impl(const lm_cuda_context *ctx, float *dx, const lm_moe_params *g, const float *dy,
                               const uint16_t *dy_given, const float *x, const float *dscores_extra, const lm_moe_config *c,
                               const lm_moe_params *pf, const lm_moe_params_bf16 *pb, const lm_cuda_moe_acts *a,
                               lm_cuda_moe_scratch *s, lm_cuda_moe_ep *ep, int dw_set) {
    // dy, x, dx are (m,d) fp32; dscores_extra (m,n); grads fp32 with the parameters' shapes
    if (!ctx || !c || !a || !s || !g)
        return lm_error(LM_ERR_ARG, "moe cuda backward: ctx, grads, cfg, acts and scratch must not be NULL");
    TRY(lm_moe_check(c));
    TRY(check_params(c, pf, pb));
    int64_t m = a->m;
    if (s->m_max < m || s->rows_max < a->rows_max)
        return lm_error(LM_ERR_ARG, "moe cuda backward: scratch planned for %lld tokens, the forward had %lld",
                        (long long)s->m_max, (long long)m);
    if (m == 0 && !ep) {
        /* no rows: set expert gradients are zero */
        float *dw[3] = {g->gate, g->up, g->down};
        for (int i = 0; i < 3; i++)
            if (dw_set && dw[i])
                LM_CUDA_TRY(cudaMemsetAsync(dw[i], 0, lm_moe_expert_tensor_floats(c) * sizeof(float),
                                            (cudaStream_t)ctx->stream));
        return LM_OK;
    }
    if (m > 0 && (!dy || !x)) return lm_error(LM_ERR_ARG, "moe cuda backward: dy and x must not be NULL");
    if (a->gemm_kind != LM_MOE_GEMM_WMMA && a->gemm_kind != LM_MOE_GEMM_GROUPED && a->gemm_kind != LM_MOE_GEMM_LOOP &&
        a->gemm_kind != LM_MOE_GEMM_BATCHED && a->gemm_kind != LM_MOE_GEMM_WGMMA)
        return lm_error(LM_ERR_ARG, "moe cuda backward: acts hold no forward (gemm kind %d)", a->gemm_kind);
    if (a->gemm_kind != LM_MOE_GEMM_WMMA && !ctx->cublas)
        return lm_error(LM_ERR_ARG, "moe cuda backward: the context has no cuBLAS handle");
    cudaStream_t st = (cudaStream_t)ctx->stream;
    /* the kind and (cuBLAS) host row counts of the forward */
    /* the weight gradients on the side stream (batched kind, no EP): joined at the end */
    const int wside = m > 0 && side_usable(ctx, a->gemm_kind, ep);
    runner R = {ctx, st, a->gemm_kind, a, c->n_experts, (bf16 *)s->dw_bf16, dw_set, wside};
    if (m == 0) return lm_moe_ep_experts_backward_cuda(&R, c, pb, g, a, s, ep);
    const runner *r = &R;
    int n = c->n_experts, k = c->top_k, d = c->d, de = expert_width(c), dl = c->d_latent;
    int ns = c->n_shared, fs = c->d_ff_shared;

    /* dy in bf16 for the products: the caller's copy, else converted into the scratch */
    const void *dy_bf16 = s->dy_bf16;
    if (dy_bf16 && dy_given) dy_bf16 = dy_given;
    else if (dy_bf16) TRY(lm_cuda_f32_to_bf16(ctx, (uint16_t *)s->dy_bf16, dy, (size_t)(m * d)));
    /* w runs the layer's weight gradients: r, or with wside the side stream, which waits for the
     * stream at each point where they need what the stream wrote (here: dy's bf16 copy) */
    lm_moe_runner side;
    lm_cuda_context sctx;
    lm_cuda_moe_acts sacts;
    const runner *w = side_runner(r, &side, &sctx, &sacts);
    TRY(side_wait(r)); /* dy's bf16 copy */
    /* The input gradients of the products that take x (the shared experts' gate and up, the latent
     * down-projection) go side by side into dcat [m, kc], their weights into wcat [kc, d], and dx
     * takes one product with K = kc below instead of one per weight, each of which would read and
     * write dx's fp32 rows. */
    const int64_t kc = 2 * (int64_t)ns * fs + dl;
    bf16 *wcat = (bf16 *)s->wcat, *dxe = (bf16 *)s->dcat + 2 * (size_t)ns * fs; /* dxe: the latent columns */
    /* shared experts */
    for (int e = 0; e < ns; e++) {
        size_t wo = (size_t)e * fs * d, ao = (size_t)e * m * fs;
        bf16 *dsa = (bf16 *)s->dcat + (size_t)e * 2 * fs, *dsu = dsa + fs;
        TRY(gemm(r, LM_GEMM_NN, dy_bf16, d, pb->shared_down + wo, fs, NULL, s->dsh, fs, 0, m, fs, d));
        if (g->shared_down)
            TRY(gemm(w, LM_GEMM_TN, dy_bf16, d, a->sh + ao, fs, g->shared_down + wo, NULL, fs, 1, d, fs, m));
        TRY(glu_backward(st, dsa, dsu, s->dsh, (const bf16 *)a->sa + ao, (const bf16 *)a->su + ao, NULL, m, fs,
                         (int)c->act, kc));
        if (dx) {
            const size_t wb = (size_t)fs * d * sizeof(bf16);
            LM_CUDA_TRY(cudaMemcpyAsync(wcat + (size_t)e * 2 * fs * d, pb->shared_gate + wo, wb,
                                        cudaMemcpyDeviceToDevice, st));
            LM_CUDA_TRY(cudaMemcpyAsync(wcat + ((size_t)e * 2 + 1) * fs * d, pb->shared_up + wo, wb,
                                        cudaMemcpyDeviceToDevice, st));
        }
        TRY(side_wait(r)); /* dsa, dsu */
        if (g->shared_gate)
            TRY(gemm(w, LM_GEMM_TN, dsa, kc, a->x_bf16, d, g->shared_gate + wo, NULL, d, 1, fs, d, m));
        if (g->shared_up)
            TRY(gemm(w, LM_GEMM_TN, dsu, kc, a->x_bf16, d, g->shared_up + wo, NULL, d, 1, fs, d, m));
    }

    /* gradient of z */
    const float *dz = dy;
    if (dl > 0) {
        TRY(gemm(r, LM_GEMM_NN, dy_bf16, d, pb->lat_up, dl, s->dzn, NULL, dl, 0, m, dl, d));
        if (g->lat_up) TRY(gemm(w, LM_GEMM_TN, dy_bf16, d, a->zn, dl, g->lat_up, NULL, dl, 1, d, dl, m));
        const int mc = norm_chunks(dl, s->dz, s->dzn, a->z, pf->lat_norm);
        const int64_t chunk = mc ? NORM_CHUNK : NORM_CHUNK_ROW, nchunk = (m + chunk - 1) / chunk;
        if (mc == 1)
            norm_backward_fused_kernel<1><<<(unsigned)nchunk, 256, 0, st>>>(s->dz, s->norm_partial, s->dzn, a->z,
                                                                           pf->lat_norm, a->rstd, m, dl);
        else if (mc == 2)
            norm_backward_fused_kernel<2><<<(unsigned)nchunk, 256, 0, st>>>(s->dz, s->norm_partial, s->dzn, a->z,
                                                                           pf->lat_norm, a->rstd, m, dl);
        else if (mc == 4)
            norm_backward_fused_kernel<4><<<(unsigned)nchunk, 256, 0, st>>>(s->dz, s->norm_partial, s->dzn, a->z,
                                                                           pf->lat_norm, a->rstd, m, dl);
        if (mc == 0) {
            rmsnorm_backward_kernel<<<blocks_for(m, 8), 256, 0, st>>>(s->dz, s->dzn, a->z, pf->lat_norm, a->rstd, m, dl);
            LM_CUDA_TRY(cudaGetLastError());
            if (g->lat_norm) {
                if (nchunk > 65535) return lm_error(LM_ERR_ARG, "moe cuda backward: %lld tokens", (long long)m);
                dim3 grid(blocks_for(dl, 128), (unsigned)nchunk);
                norm_weight_partial_kernel<<<grid, 128, 0, st>>>(s->norm_partial, s->dzn, a->z, a->rstd, m, dl);
            }
        }
        LM_CUDA_TRY(cudaGetLastError());
        if (g->lat_norm) {
            norm_weight_final_kernel<<<blocks_for(dl, 128), 128, 0, st>>>(g->lat_norm, s->norm_partial, nchunk, dl);
            LM_CUDA_TRY(cudaGetLastError());
        }
        dz = s->dz;
    }

    /* per grouped row: d out = p dz_i, and dp = <dz_i, E(x_i)> */
    TRY(lm_moe_combine_backward(st, (bf16 *)s->dgout, s->dp, dz, a, n, k, de));
    /* on the side stream the router's weight gradient runs here, beside the experts: its dr needs
     * only dp (the same kernels as below, earlier: the same bits) */
    if (wside) {
        TRY(lm_moe_router_grad(st, s->dr, s->dp, dscores_extra, a, m, n, k, c->route_scale));
        TRY(side_wait(r));
        if (g->router) TRY(gemm_f32(w, LM_GEMM_TN, s->dr, n, x, d, g->router, d, 1, n, d, m));
    }
    /* the routed experts, here or (expert parallelism) on their owners */
    if (ep) {
        TRY(lm_moe_ep_experts_backward_cuda(r, c, pb, g, a, s, ep));
    } else {
        lm_moe_expert_grads eg = {(bf16 *)s->dgout, (bf16 *)s->dh, (bf16 *)s->da, (bf16 *)s->du, (bf16 *)s->dxg};
        TRY(lm_moe_experts_backward(r, c, pb, g, a, &eg));
    }

    /* grouped input gradients back to tokens (slot order: deterministic) */
    if (dl > 0) {
        TRY(lm_moe_scatter(st, NULL, dxe, (const bf16 *)s->dxg, a, m, k, de, kc));
        if (dx)
            LM_CUDA_TRY(cudaMemcpyAsync(wcat + (size_t)2 * ns * fs * d, pb->lat_down, (size_t)dl * d * sizeof(bf16),
                                        cudaMemcpyDeviceToDevice, st));
        TRY(side_wait(r)); /* dxe */
        if (g->lat_down)
            TRY(gemm(w, LM_GEMM_TN, dxe, kc, a->x_bf16, d, g->lat_down, NULL, d, 1, dl, d, m));
    }
    /* dx is written: the first of its terms sets it (no zeroing pass, no read of its old rows) */
    if (dx && kc > 0) TRY(gemm(r, LM_GEMM_NN, s->dcat, kc, wcat, d, dx, NULL, d, 0, m, d, kc));
    else if (dx) LM_CUDA_TRY(cudaMemsetAsync(dx, 0, (size_t)m * d * sizeof(float), st));
    if (dl == 0 && dx) TRY(lm_moe_scatter(st, dx, NULL, (const bf16 *)s->dxg, a, m, k, de, de));

    /* router in fp32: dr over all n logits (zero off the chosen set without
     * dscores_extra), dx += dr W_r (without dscores_extra over the k chosen
     * rows of W_r only, not a product over all n), dW_r += dr^T x */
    if (!wside) TRY(lm_moe_router_grad(st, s->dr, s->dp, dscores_extra, a, m, n, k, c->route_scale));
    if (dx && dscores_extra) TRY(gemm_f32(r, LM_GEMM_NN, s->dr, n, pf->router, d, dx, d, 1, m, d, n));
    else if (dx) TRY(lm_moe_router_dx_sparse(st, dx, s->dr, pf->router, a, m, n, k, d));
    if (g->router && !wside) TRY(gemm_f32(r, LM_GEMM_TN, s->dr, n, x, d, g->router, d, 1, n, d, m));
    /* the stream waits for the weight gradients of the side stream */
    TRY(side_join(r));
    return LM_OK;
}

extern "C" lm_status lm_cuda_moe_backward(const lm_cuda_context *ctx, float *dx, const lm_moe_params *g,
                                          const float *dy, const uint16_t *dy_bf16, const float *x, const float *dscores_extra,
                                          const lm_moe_config *c, const lm_moe_params *pf,
                                          const lm_moe_params_bf16 *pb, const lm_cuda_moe_acts *a,
                                          lm_cuda_moe_scratch *s, int expert_grads_set) {
    return backward_impl(ctx, dx, g, dy, dy_bf16, x, dscores_extra, c, pf, pb, a, s, NULL, expert_grads_set);
}

extern "C" lm_status lm_cuda_moe_backward_ep(const lm_cuda_context *ctx, float *dx, const lm_moe_params *g,
                                             const float *dy, const uint16_t *dy_bf16, const float *x, const float *dscores_extra,
                                             const lm_moe_config *c, const lm_moe_params *pf,
                                             const lm_moe_params_bf16 *pb, const lm_cuda_moe_acts *a,
                                             lm_cuda_moe_scratch *s, lm_cuda_moe_ep *ep) {
    if (!ep) return lm_error(LM_ERR_ARG, "moe cuda backward_ep: ep is NULL");
    TRY(lm_moe_ep_check_config(ep, c));
    return backward_impl(ctx, dx, g, dy, dy_bf16, x, dscores_extra, c, pf, pb, a, s, ep, 0);
}

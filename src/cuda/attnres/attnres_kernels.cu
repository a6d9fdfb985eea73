/* AttnRes kernels (include/longmoe/attnres_cuda.h, docs/attnres.md).
 *
 * Every kernel is memory-bound and works on token rows: a row group of
 * `tpr` threads (a multiple of 32: whole warps) owns one token row of d
 * floats, VEC (1 or 4) consecutive floats a thread per step; a block of 256
 * threads holds 256 / tpr row groups (several rows when d is small).
 *
 * Forward of one AttnRes layer with Ns sources (one kernel, one pass over
 * DRAM): pass 1 reads each source row once and reduces its dot product with
 * u = w (.) g (and, for the partial sum, its sum of squares); one thread per
 * row forms the scores s_i = r_i (u . v_i), the softmax in fp32 and lse;
 * pass 2 forms h = sum_i a_i v_i, re-reading the row's sources while they are
 * in L1/L2 (a row's Ns sources are Ns * 4 KiB at d = 1024).
 *
 * Backward likewise: pass 1 reduces da_i = dh . v_i, one thread forms
 * ds_i = a_i (da_i - sum_j a_j da_j), pass 2 updates every dv_i and the
 * per-channel q = sum ds_i r_i v_i of its block's fixed token range; a
 * second kernel adds the blocks' q in block order (no float atomics). */
#include <math.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include <cuda_runtime.h>

#include "cuda/attnres/attnres_internal.cuh"
#include "cuda/common/cp_async.cuh"
#include "cuda/cuda_check.h"
#include "cuda/linear/linear_common.cuh"
#include "longmoe/attnres_cuda.h"

#define THREADS 256
#define WARPS (THREADS / 32)
/* opt-in shared memory limit of sm_90 (227 KiB) */
#define MAX_SHARED_BYTES (227 * 1024)
/* tokens a block of forward_norm_kernel walks: a multiple of its rows a round (THREADS / tpr <= 8) */
#define FORWARD_TOKEN_BLOCK 8

__device__ __forceinline__ float warp_sum(float x) {
    /* butterfly: every lane ends with the same sum, in a fixed order */
    for (int o = 16; o > 0; o >>= 1) x += __shfl_xor_sync(0xffffffffu, x, o);
    return x;
}

template <int VEC> struct vec;
template <> struct vec<1> {
    static __device__ __forceinline__ void load(float (&x)[1], const float *p) { x[0] = *p; }
    static __device__ __forceinline__ void store(float *p, const float (&x)[1]) { *p = x[0]; }
    static __device__ __forceinline__ void store_bf16(uint16_t *p, const float (&x)[1]) { *p = lin_f32_to_bf16(x[0]); }
};
template <> struct vec<4> {
    /* 4 bf16 (lin_f32_to_bf16: the bits of the model's to_lp) in one 8-byte store */
    static __device__ __forceinline__ void store_bf16(uint16_t *p, const float (&x)[4]) {
        uint2 r;
        r.x = (uint32_t)lin_f32_to_bf16(x[0]) | ((uint32_t)lin_f32_to_bf16(x[1]) << 16);
        r.y = (uint32_t)lin_f32_to_bf16(x[2]) | ((uint32_t)lin_f32_to_bf16(x[3]) << 16);
        *reinterpret_cast<uint2 *>(p) = r;
    }
    static __device__ __forceinline__ void load(float (&x)[4], const float *p) {
        const float4 t = *reinterpret_cast<const float4 *>(p);
        x[0] = t.x;
        x[1] = t.y;
        x[2] = t.z;
        x[3] = t.w;
    }
    static __device__ __forceinline__ void store(float *p, const float (&x)[4]) {
        *reinterpret_cast<float4 *>(p) = make_float4(x[0], x[1], x[2], x[3]);
    }
};

/* ---- rows: dst = src or dst += src, then 1/rms of the new rows ---- */

template <int VEC>
__global__ void __launch_bounds__(THREADS, 4)
accumulate_rows_kernel(float *dst, const float *src, float *rstd, int assign, int64_t n, int d, float eps, int tpr,
                       unsigned long long *first_nonfinite) {
    // dst, src are (n,d); rstd is (n); shared: one float per warp. first_nonfinite (may be
    // NULL) = min(itself, the flat index of src's first non-finite element): each thread
    // offers the first it meets (its columns in order), the exponent bits tested
    __shared__ float red[WARPS];
    const int rows = THREADS / tpr, group = threadIdx.x / tpr, lane_g = threadIdx.x % tpr;
    const int64_t t = (int64_t)blockIdx.x * rows + group;
    const bool active = t < n;
    float ss = 0.0f;
    if (active) {
        float *dr = dst + (size_t)t * d;
        const float *sr = src + (size_t)t * d;
        unsigned long long bad = ~0ull;
        for (int c = lane_g * VEC; c < d; c += tpr * VEC) {
            float x[VEC], y[VEC];
            vec<VEC>::load(y, sr + c);
            if (first_nonfinite && bad == ~0ull) {
#pragma unroll
                for (int j = VEC - 1; j >= 0; j--)
                    if ((__float_as_uint(y[j]) & 0x7f800000u) == 0x7f800000u)
                        bad = (unsigned long long)t * (unsigned long long)d + (unsigned long long)(c + j);
            }
            if (assign) {
#pragma unroll
                for (int j = 0; j < VEC; j++) x[j] = y[j];
            } else {
                vec<VEC>::load(x, dr + c);
#pragma unroll
                for (int j = 0; j < VEC; j++) x[j] += y[j];
            }
#pragma unroll
            for (int j = 0; j < VEC; j++) ss += x[j] * x[j];
            vec<VEC>::store(dr + c, x);
        }
        if (bad != ~0ull) atomicMin(first_nonfinite, bad);
    }
    if (!rstd) return; /* uniform over the grid */
    ss = warp_sum(ss);
    if ((threadIdx.x & 31) == 0) red[threadIdx.x >> 5] = ss;
    __syncthreads();
    if (active && lane_g == 0) {
        const int wpg = tpr >> 5;
        float tot = 0.0f;
        for (int k = 0; k < wpg; k++) tot += red[group * wpg + k];
        /* rms = sqrt(mean(x^2) + eps), the RMSNorm of linear.h */
        rstd[t] = 1.0f / sqrtf(tot / (float)d + eps);
    }
}

/* One row's closed sources' 1/rms hist_rstd[i n + t] (i < C) into rs, loaded by
 * the row group's threads together before the row's first barrier (so the one
 * thread that forms the weights does not wait for them one after another). */
__device__ __forceinline__ void prefetch_rstd(const attnres_sources &src, float *rs, int C, int64_t t, int64_t n,
                                              int lane_g, int tpr) {
    for (int i = lane_g; i < C; i += tpr) rs[i] = src.hist_rstd[(size_t)i * n + t];
}

/* Source i's logit s_i = r_i (u . v_i) from the row group's partial sums r0
 * [wpg][Ns+1] and the closed sources' 1/rms rs; for the partial source (i >=
 * C) r is formed here from its sum of squares and returned in *r_part. */
__device__ __forceinline__ float source_logit(const float *r0, const float *rs, int wpg, int C, int Ns, int i, int d,
                                              float eps, float *r_part) {
    float dot = 0.0f;
    for (int k = 0; k < wpg; k++) dot += r0[k * (Ns + 1) + i];
    float r;
    if (i < C) {
        r = rs[i];
    } else {
        float ss = 0.0f;
        for (int k = 0; k < wpg; k++) ss += r0[k * (Ns + 1) + Ns];
        r = 1.0f / sqrtf(ss / (float)d + eps);
        *r_part = r;
    }
    return r * dot;
}

/* One row's source weights, from its row group's partial sums r0 [wpg][Ns+1]
 * (the dots u . v_i, then the new partial source's sum of squares) and its
 * closed sources' 1/rms rs [C] (prefetch_rstd): the logits s_i = r_i (u . v_i)
 * (the partial source's r is computed here and saved), their softmax in fp32
 * into coef, and lse. */
__device__ __forceinline__ void source_weights(const attnres_sources &src, const float *r0, const float *rs, int wpg,
                                               int C, int Ns, int64_t t, int d, float eps, float *lrow, float *coef,
                                               float *lse) {
    float m = -INFINITY;
    for (int i = 0; i < Ns; i++) {
        float r_part;
        const float s = source_logit(r0, rs, wpg, C, Ns, i, d, eps, &r_part);
        if (i >= C) src.P_rstd[t] = r_part;
        lrow[i] = s;
        coef[i] = s;
        m = fmaxf(m, s);
    }
    float Z = 0.0f;
    for (int i = 0; i < Ns; i++) Z += expf(coef[i] - m);
    for (int i = 0; i < Ns; i++) coef[i] = expf(coef[i] - m) / Z;
    lse[t] = m + logf(Z);
}

/* ---- forward of one AttnRes layer ---- */

template <int VEC>
__global__ void __launch_bounds__(THREADS)
forward_kernel(attnres_sources src, float *P_save, const float *w, const float *g, float *logits, float *lse,
               float *h, int from_saved, int64_t n, int d, float eps, int tpr) {
    // sources are (n,d) rows; logits is (n,Ns); lse is (n); h is (n,d)
    // shared: red [WARPS][Ns+1] (dots, then P's sum of squares), coef [rows][Ns], rs [rows][Ns]
    extern __shared__ float smem[];
    const int C = src.C, Ns = C + src.has_partial;
    const int rows = THREADS / tpr, group = threadIdx.x / tpr, lane_g = threadIdx.x % tpr;
    const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31, wpg = tpr >> 5;
    float *red = smem, *coef = smem + WARPS * (Ns + 1) + group * Ns;
    float *rs = smem + WARPS * (Ns + 1) + rows * Ns + group * Ns;
    const int64_t t = (int64_t)blockIdx.x * rows + group;
    const bool active = t < n;
    const size_t nd = (size_t)n * d, row = active ? (size_t)t * d : 0;

    if (!from_saved) {
        if (active) prefetch_rstd(src, rs, C, t, n, lane_g, tpr);
        /* pass 1: u . v_i for every source (u = w (.) g, SPEC §5), and sum P^2 */
        for (int i = 0; i < Ns; i++) {
            const bool is_P = i == C;
            const float *v = is_P ? src.P + row : src.hist + (size_t)i * nd + row;
            float dot = 0.0f, ss = 0.0f;
            if (active) {
                for (int c = lane_g * VEC; c < d; c += tpr * VEC) {
                    float x[VEC], wv[VEC], gv[VEC];
                    vec<VEC>::load(x, v + c);
                    vec<VEC>::load(wv, w + c);
                    vec<VEC>::load(gv, g + c);
#pragma unroll
                    for (int j = 0; j < VEC; j++) {
                        dot += (wv[j] * gv[j]) * x[j];
                        ss += x[j] * x[j];
                    }
                    if (is_P && P_save) vec<VEC>::store(P_save + row + c, x);
                }
            }
            dot = warp_sum(dot);
            if (is_P) ss = warp_sum(ss);
            if (lane == 0) {
                red[warp * (Ns + 1) + i] = dot;
                if (is_P) red[warp * (Ns + 1) + Ns] = ss;
            }
        }
        __syncthreads();
    }
    if (active && lane_g == 0) {
        float *lrow = logits + (size_t)t * Ns;
        if (from_saved) {
            /* a_i = exp(s_i - lse): the weights the forward used */
            const float m = lse[t];
            for (int i = 0; i < Ns; i++) coef[i] = expf(lrow[i] - m);
        } else {
            source_weights(src, red + (size_t)group * wpg * (Ns + 1), rs, wpg, C, Ns, t, d, eps, lrow, coef, lse);
        }
    }
    __syncthreads();
    if (!active) return;
    /* pass 2: h = sum_i a_i v_i (values are not normalised) */
    for (int c = lane_g * VEC; c < d; c += tpr * VEC) {
        float acc[VEC];
#pragma unroll
        for (int j = 0; j < VEC; j++) acc[j] = 0.0f;
        for (int i = 0; i < Ns; i++) {
            const float *v = i == C ? src.P + row : src.hist + (size_t)i * nd + row;
            float x[VEC];
            vec<VEC>::load(x, v + c);
            const float a = coef[i];
#pragma unroll
            for (int j = 0; j < VEC; j++) acc[j] += a * x[j];
        }
        vec<VEC>::store(h + row + c, acc);
    }
}

/* A row's Ns sources, VEC floats at column c, into registers (zeros where the
 * thread has no columns: !mine); the partial sum's also copied to P_save
 * (may be NULL) in the same pass. */
template <int VEC, int MAXS>
__device__ __forceinline__ void load_sources(float (&x)[MAXS][VEC], const attnres_sources &src, float *P_save,
                                             int C, int Ns, size_t nd, size_t row, int c, bool mine) {
#pragma unroll
    for (int i = 0; i < MAXS; i++) {
        if (i >= Ns) break;
        if (mine) {
            const float *v = i == C ? src.P + row : src.hist + (size_t)i * nd + row;
            vec<VEC>::load(x[i], v + c);
            if (i == C && P_save) vec<VEC>::store(P_save + row + c, x[i]);
        } else {
#pragma unroll
            for (int j = 0; j < VEC; j++) x[i][j] = 0.0f;
        }
    }
}

/* Pass 1 of a row held in registers: u . v_i for every source (u = w (.) g,
 * SPEC §5) and, for the partial sum, sum P^2, reduced over the warp into
 * red [WARPS][Ns+1]. */
template <int VEC, int MAXS>
__device__ __forceinline__ void source_dots(const float (&x)[MAXS][VEC], const float (&wv)[VEC],
                                            const float (&gv)[VEC], int C, int Ns, float *red, int warp, int lane) {
#pragma unroll
    for (int i = 0; i < MAXS; i++) {
        if (i >= Ns) break;
        const bool is_P = i == C;
        float dot = 0.0f, ss = 0.0f;
#pragma unroll
        for (int j = 0; j < VEC; j++) {
            dot += (wv[j] * gv[j]) * x[i][j];
            ss += x[i][j] * x[i][j];
        }
        dot = warp_sum(dot);
        if (is_P) ss = warp_sum(ss);
        if (lane == 0) {
            red[warp * (Ns + 1) + i] = dot;
            if (is_P) red[warp * (Ns + 1) + Ns] = ss;
        }
    }
}

/* The same forward (from_saved = 0) when a row group holds its row in one
 * step (d <= tpr * VEC) and there are at most MAXS sources: all of a row's
 * sources are loaded at once into registers (MAXS x VEC floats a thread, every
 * load in flight together), reduced, and reused for h = sum_i a_i v_i: one
 * read of each source from DRAM and no second pass. The arithmetic is the
 * forward_kernel's, in the same order (the same bits). */
template <int VEC, int MAXS>
__global__ void __launch_bounds__(THREADS)
forward_regs_kernel(attnres_sources src, float *P_save, const float *w, const float *g, float *logits, float *lse,
                    float *h, int64_t n, int d, float eps, int tpr) {
    extern __shared__ float smem[];
    const int C = src.C, Ns = C + src.has_partial;
    const int rows = THREADS / tpr, group = threadIdx.x / tpr, lane_g = threadIdx.x % tpr;
    const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31, wpg = tpr >> 5;
    float *red = smem, *coef = smem + WARPS * (Ns + 1) + group * Ns;
    float *rs = smem + WARPS * (Ns + 1) + rows * Ns + group * Ns;
    const int64_t t = (int64_t)blockIdx.x * rows + group;
    const int c = lane_g * VEC;
    const bool active = t < n, mine = active && c < d;
    const size_t nd = (size_t)n * d, row = active ? (size_t)t * d : 0;

    if (active) prefetch_rstd(src, rs, C, t, n, lane_g, tpr);
    float x[MAXS][VEC], wv[VEC], gv[VEC];
    load_sources<VEC, MAXS>(x, src, P_save, C, Ns, nd, row, c, mine);
    if (mine) {
        vec<VEC>::load(wv, w + c);
        vec<VEC>::load(gv, g + c);
    } else {
#pragma unroll
        for (int j = 0; j < VEC; j++) wv[j] = gv[j] = 0.0f;
    }
    source_dots<VEC, MAXS>(x, wv, gv, C, Ns, red, warp, lane);
    __syncthreads();
    if (active && lane_g == 0) {
        float *lrow = logits + (size_t)t * Ns;
        source_weights(src, red + (size_t)group * wpg * (Ns + 1), rs, wpg, C, Ns, t, d, eps, lrow, coef, lse);
    }
    __syncthreads();
    if (!mine) return;
    /* pass 2 from the registers: h = sum_i a_i v_i (values are not normalised) */
    float acc[VEC];
#pragma unroll
    for (int j = 0; j < VEC; j++) acc[j] = 0.0f;
#pragma unroll
    for (int i = 0; i < MAXS; i++) {
        if (i >= Ns) break;
        const float a = coef[i];
#pragma unroll
        for (int j = 0; j < VEC; j++) acc[j] += a * x[i][j];
    }
    vec<VEC>::store(h + row + c, acc);
}

/* d floats of a parameter row at p + c, 16-byte loads where p allows them
 * (p + c has p's alignment: c is a multiple of 4); else one at a time. */
template <int VEC>
__device__ __forceinline__ void load_param(float (&x)[VEC], const float *p, int c) {
    if (VEC == 4 && ((uintptr_t)p & 15) == 0) {
        vec<VEC>::load(x, p + c);
    } else {
#pragma unroll
        for (int j = 0; j < VEC; j++) x[j] = p[c + j];
    }
}

/* One source's dv term added to o: o + (a y + k1 u - k2 x), rounded in this
 * fixed order on every path, so a term added later (the deferred backward)
 * gives the bits of the same term added at once. */
__device__ __forceinline__ float dv_term(float o, float a, float y, float k1, float u, float k2, float x) {
    float t = __fmul_rn(k1, u);
    t = __fmaf_rn(a, y, t);
    t = __fmaf_rn(-k2, x, t);
    return __fadd_rn(o, t);
}

/* Slot b of the k-th position of df.apply, highest first (the order of
 * add_deferred); k < popcount(apply). */
__device__ __forceinline__ int deferred_slot(uint64_t apply, int k) {
    for (;; k--) {
        const int b = 63 - __clzll((long long)apply);
        if (k == 0) return b;
        apply &= ~(1ull << b);
    }
}

/* The deferred terms of closed sources i0 .. i0 + count - 1 (count <= NS) for
 * token t (VEC channels at c of their rows, values x), added to o: position by
 * position, each dh row read once, the positions of df.apply highest first
 * (the order in which their sublayers would have added them). The first
 * n_stage positions' dh rows (this thread's VEC columns) and coefficients may
 * come staged in shared memory, dd [n_stage][THREADS VEC] and cc
 * [n_stage][cc_stride] (from source 0): the same terms, the same bits. */
template <int VEC, int NS>
__device__ __forceinline__ void add_deferred(float (&o)[NS][VEC], const attnres_deferred &df,
                                             const float (&x)[NS][VEC], int i0, int count, int64_t t, size_t row,
                                             int c, int64_t n, int d, const float *dd = nullptr,
                                             const float *cc = nullptr, int cc_stride = 0, int n_stage = 0) {
    const size_t nd = (size_t)n * d, TV = (size_t)THREADS * VEC;
    int k = 0;
    for (uint64_t m = df.apply; m; k++) {
        const int b = 63 - __clzll((long long)m); /* position b + 1, slot b */
        m &= ~(1ull << b);
        const bool staged = k < n_stage;
        const float *cf = (staged ? cc + (size_t)k * cc_stride : df.coef + ((size_t)b * n + t) * 3 * df.cmax) + 3 * i0;
        float y[VEC], wv[VEC], gv[VEC];
        vec<VEC>::load(y, staged ? dd + (size_t)k * TV : df.dh + (size_t)b * nd + row + c);
        load_param<VEC>(wv, df.w + (size_t)(b + 1) * d, c);
        load_param<VEC>(gv, df.g + (size_t)(b + 1) * d, c);
#pragma unroll
        for (int i = 0; i < NS; i++) {
            if (i >= count) break;
#pragma unroll
            for (int j = 0; j < VEC; j++)
                o[i][j] = dv_term(o[i][j], cf[3 * i], y[j], cf[3 * i + 1], wv[j] * gv[j], cf[3 * i + 2], x[i][j]);
        }
    }
}

/* ---- the sublayer's input and its RMSNorm in one pass (docs/attnres.md) ----
 * The forward_regs_kernel's rows (or, from_saved, the weights exp(s_i - lse)
 * of the saved scores), then h's 1/rms and the normalised row
 * xn = (h r) (.) nw into xn (fp32, may be NULL) and xn_bf16 (may be NULL),
 * r into nrstd; h itself is not written.
 *
 * A block walks tb tokens, `rows` at a time, and a round's loads are in flight
 * before it needs them: at the start of a round each thread copies the next
 * round's source rows (its own VEC columns: no barrier guards them) and the
 * closed sources' 1/rms with cp.async into the other copy of shared memory, and
 * the saved scores come a round ahead in registers. The arithmetic is the same
 * as with the rows loaded directly (the same bits). */
/* A row's sources (this thread's own VEC columns of each) into sx [Ns][THREADS VEC], by cp.async. */
template <int VEC, int MAXS>
__device__ __forceinline__ void copy_source_rows(const attnres_sources &src, float *sx, int C, int Ns, size_t nd,
                                                 size_t row, int c) {
    static_assert(VEC == 4, "16-byte copies");
#pragma unroll
    for (int i = 0; i < MAXS; i++) {
        if (i >= Ns) break;
        const float *v = i == C ? src.P + row : src.hist + (size_t)i * nd + row;
        lm_cp_async16(sx + (size_t)i * THREADS * VEC, v + c);
    }
}

template <int VEC, int MAXS>
__device__ __forceinline__ void forward_norm_issue(const attnres_sources &src, float *sx, float *rs, int from_saved,
                                                   int C, int Ns, int64_t t, int64_t t1, int64_t n, int d, int c,
                                                   int lane_g, int tpr) {
    if (t < t1) {
        const size_t nd = (size_t)n * d, row = (size_t)t * d;
        if (c < d) copy_source_rows<VEC, MAXS>(src, sx, C, Ns, nd, row, c);
        if (!from_saved)
            for (int i = lane_g; i < C; i += tpr) lm_cp_async4(rs + i, src.hist_rstd + (size_t)i * n + t);
    }
    lm_cp_async_commit();
}

template <int VEC, int MAXS>
__global__ void __launch_bounds__(THREADS)
forward_norm_kernel(attnres_sources src, float *P_save, const float *w, const float *g, float *logits, float *lse,
                    int from_saved, const float *nw, float *xn, uint16_t *xn_bf16, float *nrstd, int64_t n, int d,
                    float eps, float neps, int tpr, int tb) {
    // shared (attnres_forward_norm_shared): sx [2][Ns][THREADS VEC] (by round parity), red
    // [WARPS][Ns+1], rs [2][rows][Ns] (by round parity), red2 [2][WARPS] (by round parity)
    extern __shared__ __align__(16) float smem[];
    const int C = src.C, Ns = C + src.has_partial;
    const int rows = THREADS / tpr, group = threadIdx.x / tpr, lane_g = threadIdx.x % tpr;
    const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31, wpg = tpr >> 5;
    const size_t TV = (size_t)THREADS * VEC;
    float *sx_all = smem + threadIdx.x * VEC, *red = smem + 2 * (size_t)Ns * TV;
    float *rs_all = red + WARPS * (Ns + 1), *red2_all = rs_all + 2 * rows * Ns;
    const int c = lane_g * VEC;
    const int64_t t0 = (int64_t)blockIdx.x * tb, t1 = t0 + tb < n ? t0 + tb : n;

    forward_norm_issue<VEC, MAXS>(src, sx_all, rs_all + group * Ns, from_saved, C, Ns, t0 + group, t1, n, d, c,
                                  lane_g, tpr);
    float wv[VEC], gv[VEC], wn[VEC];
#pragma unroll
    for (int j = 0; j < VEC; j++) wv[j] = gv[j] = 0.0f, wn[j] = 1.0f;
    if (c < d) {
        if (!from_saved) {
            load_param<VEC>(wv, w, c);
            load_param<VEC>(gv, g, c);
        }
        if (nw) load_param<VEC>(wn, nw, c);
    }
    /* from_saved: the round's saved scores, a round ahead in registers */
    float lt_next = 0.0f, s_next = 0.0f;
    if (from_saved && t0 + group < t1) {
        lt_next = lse[t0 + group];
        if (lane < Ns) s_next = logits[(size_t)(t0 + group) * Ns + lane];
    }

    int parity = 0;
    for (int64_t base = t0; base < t1; base += rows, parity ^= 1) {
        /* red is read between the round's two barriers, so a thread a round ahead writes it only
         * after every reader is done; rs, red2 and sx alternate by round (rs is read before the
         * round's second barrier, which a thread issuing the next round's copy has passed; red2
         * after it, and a writer two rounds ahead has passed the next round's second barrier) */
        const int64_t t = base + group;
        const bool active = t < t1, mine = active && c < d;
        const size_t row = active ? (size_t)t * d : 0;
        const float *sx = sx_all + (size_t)parity * Ns * TV;
        const float *rs = rs_all + (parity * rows + group) * Ns;
        float *red2 = red2_all + parity * WARPS;
        forward_norm_issue<VEC, MAXS>(src, sx_all + (size_t)(parity ^ 1) * Ns * TV,
                                      rs_all + ((parity ^ 1) * rows + group) * Ns, from_saved, C, Ns,
                                      base + rows + group, t1, n, d, c, lane_g, tpr);
        const float lt = lt_next, s_saved = s_next;
        if (from_saved && base + rows + group < t1) {
            const int64_t tn = base + rows + group;
            lt_next = lse[tn];
            if (lane < Ns) s_next = logits[(size_t)tn * Ns + lane];
        }
        lm_cp_async_wait<1>(); /* this round's inputs (the next round's may still fly) */
        float x[MAXS][VEC];
#pragma unroll
        for (int i = 0; i < MAXS; i++) {
            if (i >= Ns) break;
            if (mine) {
                vec<VEC>::load(x[i], sx + (size_t)i * TV);
                if (i == C && P_save && !from_saved) vec<VEC>::store(P_save + row + c, x[i]);
            } else {
#pragma unroll
                for (int j = 0; j < VEC; j++) x[i][j] = 0.0f;
            }
        }
        if (!from_saved) {
            source_dots<VEC, MAXS>(x, wv, gv, C, Ns, red, warp, lane);
            __syncthreads(); /* also publishes this round's rs, waited for above by the threads that copied it */
        }
        /* each warp of the row forms the weights with its lanes in parallel, lane i < Ns source i's
         * (source_weights' arithmetic for it: the same partial sums in the same order, so the
         * logits and lse its row group's first warp writes are the ones every warp used), then
         * hands them to every lane: no barrier before h, and one source's sums a lane instead of
         * all of them in every thread. active is uniform over a row group's whole warps. */
        float wt[MAXS];
#pragma unroll
        for (int i = 0; i < MAXS; i++) wt[i] = 0.0f;
        if (active) {
            float *lrow = logits + (size_t)t * Ns;
            float own = 0.0f; /* lane i < Ns: source i's weight */
            if (from_saved) {
                if (lane < Ns) own = expf(s_saved - lt);
            } else {
                const float *r0 = red + (size_t)group * wpg * (Ns + 1);
                float s = -INFINITY;
                if (lane < Ns) {
                    float r_part;
                    s = source_logit(r0, rs, wpg, C, Ns, lane, d, eps, &r_part);
                    if (lane_g == lane) { /* the row group's first warp */
                        if (lane >= C) src.P_rstd[t] = r_part;
                        lrow[lane] = s;
                    }
                }
                float m = s; /* max over the lanes: exact in any order */
                for (int o = 16; o > 0; o >>= 1) m = fmaxf(m, __shfl_xor_sync(0xffffffffu, m, o));
                const float e = lane < Ns ? expf(s - m) : 0.0f;
                float Z = 0.0f; /* in source order, as source_weights */
#pragma unroll
                for (int i = 0; i < MAXS; i++) {
                    if (i >= Ns) break;
                    Z += __shfl_sync(0xffffffffu, e, i);
                }
                own = e / Z;
                if (lane_g == 0) lse[t] = m + logf(Z);
            }
#pragma unroll
            for (int i = 0; i < MAXS; i++) {
                if (i >= Ns) break;
                wt[i] = __shfl_sync(0xffffffffu, own, i);
            }
        }
        float acc[VEC];
#pragma unroll
        for (int j = 0; j < VEC; j++) acc[j] = 0.0f;
        if (mine) {
#pragma unroll
            for (int i = 0; i < MAXS; i++) {
                if (i >= Ns) break;
#pragma unroll
                for (int j = 0; j < VEC; j++) acc[j] += wt[i] * x[i][j];
            }
        }
        /* the norm: 1/rms of h over the row group's warps, in order */
        float ss = 0.0f;
#pragma unroll
        for (int j = 0; j < VEC; j++) ss += acc[j] * acc[j];
        ss = warp_sum(ss);
        if (lane == 0) red2[warp] = ss;
        __syncthreads();
        if (!mine) continue;
        float tot = 0.0f;
        for (int k = 0; k < wpg; k++) tot += red2[group * wpg + k];
        const float r = 1.0f / sqrtf(tot / (float)d + neps);
        if (lane_g == 0) nrstd[t] = r;
#pragma unroll
        for (int j = 0; j < VEC; j++) acc[j] = acc[j] * r * wn[j];
        if (xn) vec<VEC>::store(xn + row + c, acc);
        if (xn_bf16) vec<VEC>::store_bf16(xn_bf16 + row + c, acc);
    }
    lm_cp_async_wait<0>();
}

/* ---- backward of one AttnRes layer ---- */

/* One row's saved logits s_i, the sources' 1/rms r_i and lse into pre
 * [2 Ns + 1], loaded by the row group's threads together during pass 1 (so the
 * one thread that forms the coefficients does not wait for them one after
 * another). */
__device__ __forceinline__ void prefetch_backward(const attnres_sources &src, const float *logits, const float *lse,
                                                  float *pre, int C, int Ns, int64_t t, int64_t n, int lane_g,
                                                  int tpr) {
    for (int i = lane_g; i < 2 * Ns + 1; i += tpr) {
        float v;
        if (i < Ns) {
            v = logits[(size_t)t * Ns + i];
        } else if (i < 2 * Ns) {
            const int k = i - Ns;
            v = k < C ? src.hist_rstd[(size_t)k * n + t] : src.P_rstd[t];
        } else {
            v = lse[t];
        }
        pre[i] = v;
    }
}

/* Softmax backward of one row from its row group's partial dots r0 [wpg][Ns]
 * (da_i = dh . v_i) and pre (prefetch_backward): ds_i = a_i (da_i - sum_j a_j
 * da_j); then the coefficients of dv_i = a_i dh + k1_i u - k2_i v_i
 * (docs/attnres.md) into coef [Ns][3]. */
__device__ __forceinline__ void backward_coefficients(const float *r0, const float *pre, int wpg, int Ns, int d,
                                                      float *coef) {
    const float *lrow = pre, *rr = pre + Ns;
    const float l_t = pre[2 * Ns];
    float c0 = 0.0f;
    for (int i = 0; i < Ns; i++) {
        float da = 0.0f;
        for (int k = 0; k < wpg; k++) da += r0[k * Ns + i];
        const float a = expf(lrow[i] - l_t);
        coef[3 * i] = a;
        coef[3 * i + 1] = da;
        c0 += a * da;
    }
    for (int i = 0; i < Ns; i++) {
        const float a = coef[3 * i], da = coef[3 * i + 1], s = lrow[i];
        const float r = rr[i];
        const float ds = a * (da - c0);
        coef[3 * i + 1] = ds * r;
        coef[3 * i + 2] = ds * r * r * s / (float)d;
    }
}

template <int VEC>
__global__ void __launch_bounds__(THREADS)
backward_kernel(attnres_sources src, float *dhist, float *dP, int assign, const float *w, const float *g,
                const float *logits, const float *lse, const float *dh, float *qpart, uint16_t *lp_out, int lp_src,
                attnres_deferred df, int64_t n, int d, int tpr, int tb) {
    // sources, dhist rows, dP, dh are (n,d); logits is (n,Ns); lse is (n); qpart is (gridDim.x, d); tb tokens a block
    // lp_out (n,d) bf16: source lp_src's updated dv rounded (may be NULL)
    // shared: red [WARPS][Ns], coef [rows][Ns][3], pre [rows][2Ns+1], q [rows][d] (when qpart)
    extern __shared__ float smem[];
    const int C = src.C, Ns = C + src.has_partial;
    const int rows = THREADS / tpr, group = threadIdx.x / tpr, lane_g = threadIdx.x % tpr;
    const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31, wpg = tpr >> 5;
    float *red = smem, *coef = smem + WARPS * Ns + group * Ns * 3;
    float *pre = smem + WARPS * Ns + rows * Ns * 3 + group * (2 * Ns + 1);
    float *q_all = smem + WARPS * Ns + rows * Ns * 3 + rows * (2 * Ns + 1), *q = q_all + (size_t)group * d;
    const size_t nd = (size_t)n * d;
    const int64_t t0 = (int64_t)blockIdx.x * tb;
    const int64_t t1 = t0 + tb < n ? t0 + tb : n;
    if (qpart)
        for (int c = threadIdx.x; c < rows * d; c += THREADS) q_all[c] = 0.0f;

    /* the block's fixed token range, `rows` tokens a round (uniform over the block) */
    for (int64_t base = t0; base < t1; base += rows) {
        const int64_t t = base + group;
        const bool active = t < t1;
        const size_t row = active ? (size_t)t * d : 0;
        /* pre is read only between this round's barriers, and the last
         * round's reader passed its second barrier before anyone gets here */
        if (active) prefetch_backward(src, logits, lse, pre, C, Ns, t, n, lane_g, tpr);
        /* pass 1: da_i = dh . v_i */
        for (int i = 0; i < Ns; i++) {
            const float *v = i == C ? src.P + row : src.hist + (size_t)i * nd + row;
            float dot = 0.0f;
            if (active) {
                for (int c = lane_g * VEC; c < d; c += tpr * VEC) {
                    float x[VEC], y[VEC];
                    vec<VEC>::load(x, v + c);
                    vec<VEC>::load(y, dh + row + c);
#pragma unroll
                    for (int j = 0; j < VEC; j++) dot += y[j] * x[j];
                }
            }
            dot = warp_sum(dot);
            if (lane == 0) red[warp * Ns + i] = dot;
        }
        __syncthreads();
        if (active && lane_g == 0) backward_coefficients(red + (size_t)group * wpg * Ns, pre, wpg, Ns, d, coef);
        __syncthreads();
        /* pass 2 (no barrier needed after it: the next round writes red only
         * after this round's second barrier and coef only after its own first) */
        if (active) {
            for (int c = lane_g * VEC; c < d; c += tpr * VEC) {
                float y[VEC], u[VEC], wv[VEC], gv[VEC];
                vec<VEC>::load(y, dh + row + c);
                vec<VEC>::load(wv, w + c);
                vec<VEC>::load(gv, g + c);
#pragma unroll
                for (int j = 0; j < VEC; j++) u[j] = wv[j] * gv[j];
                for (int i = 0; i < Ns; i++) {
                    const bool is_P = i == C;
                    const float *v = is_P ? src.P + row : src.hist + (size_t)i * nd + row;
                    float *dv = is_P ? dP + row : dhist + (size_t)i * nd + row;
                    const float a = coef[3 * i], k1 = coef[3 * i + 1], k2 = coef[3 * i + 2];
                    float x[VEC], o[VEC];
                    vec<VEC>::load(x, v + c);
                    if (assign && !is_P) {
#pragma unroll
                        for (int j = 0; j < VEC; j++) o[j] = 0.0f;
                    } else {
                        vec<VEC>::load(o, dv + c);
                    }
                    if (!is_P && df.apply)
                        add_deferred<VEC, 1>(reinterpret_cast<float(&)[1][VEC]>(o), df,
                                             reinterpret_cast<const float(&)[1][VEC]>(x), i, 1, t, row, c, n, d);
#pragma unroll
                    for (int j = 0; j < VEC; j++) o[j] = dv_term(o[j], a, y[j], k1, u[j], k2, x[j]);
                    vec<VEC>::store(dv + c, o);
                    if (lp_out && i == lp_src) vec<VEC>::store_bf16(lp_out + row + c, o);
                    /* q += ds_i xhat_i = k1_i v_i, while the row is loaded */
                    if (qpart) {
#pragma unroll
                        for (int j = 0; j < VEC; j++) q[c + j] += k1 * x[j];
                    }
                }
            }
        }
    }
    if (!qpart) return; /* uniform over the grid */
    __syncthreads();
    /* this block's partial sum of q: its row groups in order */
    for (int c = threadIdx.x; c < d; c += THREADS) {
        float s = 0.0f;
        for (int k = 0; k < rows; k++) s += q_all[(size_t)k * d + c];
        qpart[(size_t)blockIdx.x * d + c] = s;
    }
}

/* The backward of the sublayer's input and its RMSNorm in one kernel, from
 * dxn, the norm's output gradient, with h = sum_i a_i v_i formed again from
 * the saved scores (a_i = exp(s_i - lse), the coefficients' own a_i) in
 * registers: with g = nw (.) dxn, D = g . h and r the saved 1/rms,
 *   dh = r g - (r^3 D / d) h,   da_i = dh . v_i = r (g . v_i) - (r^3 D / d) (h . v_i),
 * so one pass reduces g . v_i, h . v_i and D together; the second forms dh
 * and updates every dv_i as backward_kernel does. The norm weight's gradient
 * sum_t dxn (.) h r goes, like q, through per-block partials npart (launch_param_grads). Rows held
 * in registers: d <= tpr * VEC, Ns <= MAXS.
 *
 * The block walks its tokens `rows` at a time, and the loads of a round are in
 * flight before it needs them (cp.async into shared memory; each thread copies
 * and reads only its own VEC columns, so no barrier guards them): the next
 * round's source rows, dxn and saved scalars (pre) while this round computes,
 * and this round's gradient rows to update (o) while its first pass reduces.
 * The arithmetic is the same as with the rows loaded directly (the same bits). */
template <int VEC, int MAXS>
__device__ __forceinline__ void backward_norm_issue(const attnres_sources &src, const float *dxn, const float *logits,
                                                    const float *lse, float *sx, float *pre, int C, int Ns,
                                                    int64_t t, int64_t t1, int64_t n, int d, int c, int lane_g,
                                                    int tpr, const attnres_deferred &df, int n_stage) {
    if (t < t1) {
        const size_t nd = (size_t)n * d, row = (size_t)t * d;
        if (c < d) {
            copy_source_rows<VEC, MAXS>(src, sx, C, Ns, nd, row, c);
            lm_cp_async16(sx + (size_t)Ns * THREADS * VEC, dxn + row + c);
        }
        /* prefetch_backward's values, asynchronously */
        for (int i = lane_g; i < 2 * Ns + 1; i += tpr) {
            const float *p;
            if (i < Ns) p = logits + (size_t)t * Ns + i;
            else if (i < 2 * Ns) p = i - Ns < C ? src.hist_rstd + (size_t)(i - Ns) * n + t : src.P_rstd + t;
            else p = lse + t;
            lm_cp_async4(pre + i, p);
        }
        /* the staged deferred positions' coefficients after them (add_deferred's cc) */
        const int R = 2 * Ns + 1, nc = 3 * C;
        for (int i = lane_g; i < n_stage * nc; i += tpr) {
            const int k = i / nc, b = deferred_slot(df.apply, k);
            lm_cp_async4(pre + R + i, df.coef + ((size_t)b * n + t) * 3 * df.cmax + (i - k * nc));
        }
    }
    lm_cp_async_commit();
}

template <int VEC, int MAXS, int DEFER>
__global__ void __launch_bounds__(THREADS, MAXS <= 4 && !DEFER ? 3 : 2)
backward_norm_kernel(attnres_sources src, float *dhist, float *dP, int assign, const float *w, const float *g,
                     const float *logits, const float *lse, const float *dxn, const float *nw, const float *nrstd,
                     float *qpart, float *npart, uint16_t *lp_out, int lp_src, attnres_deferred df, int64_t n, int d,
                     int tpr, int tb, int n_stage) {
    // shared (attnres_backward_norm_shared): sx [2][Ns+1][THREADS VEC] (by round parity: the
    // sources' rows, then dxn's), so [n_o][THREADS VEC] (the rows updated in place), dd
    // [n_stage][THREADS VEC] (DEFER 2: the first n_stage deferred positions' dh rows), red
    // [2][WARPS][2Ns+1] (by round parity), pre [3][rows][2Ns+1 + 3 C n_stage] (by round mod 3:
    // the saved scalars, then the staged positions' coefficients), q [rows][d], nq [rows][d]
    extern __shared__ __align__(16) float smem[];
    if (DEFER != 2) n_stage = 0;
    const int C = src.C, Ns = C + src.has_partial, R = 2 * Ns + 1, PR = R + 3 * C * n_stage;
    const int rows = THREADS / tpr, group = threadIdx.x / tpr, lane_g = threadIdx.x % tpr;
    const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31, wpg = tpr >> 5;
    /* the rows updated in place: the partial sum's when deferring, else every source's */
    const int n_o = assign ? src.has_partial : DEFER == 1 ? src.has_partial : Ns, o0 = n_o == Ns ? 0 : C;
    const size_t TV = (size_t)THREADS * VEC;
    float *sx_all = smem, *so = sx_all + 2 * (size_t)(Ns + 1) * TV + threadIdx.x * VEC;
    float *dd = sx_all + (2 * (size_t)(Ns + 1) + n_o) * TV + threadIdx.x * VEC;
    float *red_all = sx_all + (2 * (size_t)(Ns + 1) + n_o + n_stage) * TV, *pre_all = red_all + 2 * WARPS * R;
    float *q_all = pre_all + 3 * rows * PR, *nq_all = q_all + (size_t)rows * d;
    const size_t nd = (size_t)n * d;
    const int c = lane_g * VEC;
    const int64_t t0 = (int64_t)blockIdx.x * tb;
    const int64_t t1 = t0 + tb < n ? t0 + tb : n;
    float u[VEC], wn[VEC], qacc[VEC], nacc[VEC];
#pragma unroll
    for (int j = 0; j < VEC; j++) u[j] = wn[j] = qacc[j] = nacc[j] = 0.0f;
    /* the first round's inputs */
    backward_norm_issue<VEC, MAXS>(src, dxn, logits, lse, sx_all + threadIdx.x * VEC, pre_all + group * PR, C, Ns,
                                   t0 + group, t1, n, d, c, lane_g, tpr, df, n_stage);
    if (c < d) {
        float wv[VEC], gv[VEC];
        load_param<VEC>(wv, w, c);
        load_param<VEC>(gv, g, c);
#pragma unroll
        for (int j = 0; j < VEC; j++) u[j] = wv[j] * gv[j];
        if (nw) {
            load_param<VEC>(wn, nw, c);
        } else {
#pragma unroll
            for (int j = 0; j < VEC; j++) wn[j] = 1.0f;
        }
    }
    /* the round's saved scalars, loaded a round ahead into registers */
    float lt_next = 0.0f, r_next = 0.0f, s_next = 0.0f;
    if (t0 + group < t1) {
        const int64_t t = t0 + group;
        lt_next = lse[t];
        r_next = nrstd[t];
        if (lane < Ns) s_next = logits[(size_t)t * Ns + lane];
    }

    int parity = 0, slot = 0;
    for (int64_t base = t0; base < t1; base += rows, parity ^= 1, slot = slot == 2 ? 0 : slot + 1) {
        /* red alternates between rounds: a thread a round ahead writes the other copy, and one two
         * rounds ahead has passed the round between's barrier, which every reader of this round's
         * copy reached only after reading it. pre has three copies: a thread copies the next
         * round's at the start of this one, after the last barrier, which every reader of that
         * copy's last round (two rounds back) had passed after reading it. */
        float *red = red_all + parity * WARPS * R, *pre = pre_all + (slot * rows + group) * PR;
        const float *sx = sx_all + (size_t)parity * (Ns + 1) * TV + threadIdx.x * VEC;
        const int64_t t = base + group;
        const bool active = t < t1, mine = active && c < d;
        const size_t row = active ? (size_t)t * d : 0;
        /* this round's rows to update (their last round's reads of so were this thread's own) */
        if (mine) {
            for (int k = 0; k < n_o; k++) {
                const int i = o0 + k;
                lm_cp_async16(so + (size_t)k * TV, (i == C ? dP : dhist + (size_t)i * nd) + row + c);
            }
            /* and the staged deferred positions' dh rows (this thread's own, read by it last round) */
            uint64_t m = df.apply;
            for (int k = 0; k < n_stage; k++) {
                const int b = 63 - __clzll((long long)m);
                m &= ~(1ull << b);
                lm_cp_async16(dd + (size_t)k * TV, df.dh + (size_t)b * nd + row + c);
            }
        }
        lm_cp_async_commit();
        /* the next round's inputs, into the other copy of sx (read by this thread last round) */
        {
            const int nslot = slot == 2 ? 0 : slot + 1;
            backward_norm_issue<VEC, MAXS>(src, dxn, logits, lse, sx_all + (size_t)(parity ^ 1) * (Ns + 1) * TV +
                                               threadIdx.x * VEC,
                                           pre_all + (nslot * rows + group) * PR, C, Ns, base + rows + group, t1,
                                           n, d, c, lane_g, tpr, df, n_stage);
        }
        const float lt = lt_next, r = r_next, s_own = s_next;
        if (base + rows + group < t1) {
            const int64_t tn = base + rows + group;
            lt_next = lse[tn];
            r_next = nrstd[tn];
            if (lane < Ns) s_next = logits[(size_t)tn * Ns + lane];
        }
        lm_cp_async_wait<2>(); /* this round's inputs (the group before the two just issued) */
        float x[MAXS][VEC], a[MAXS], h[VEC], gq[VEC], dx[VEC];
        /* a_i = exp(s_i - lse): lane i < Ns forms source i's, every lane gets them all (active is
         * uniform over a row group's whole warps) */
        const float a_own = active && lane < Ns ? expf(s_own - lt) : 0.0f;
#pragma unroll
        for (int i = 0; i < MAXS; i++) {
            a[i] = 0.0f;
            if (i >= Ns) continue;
            a[i] = __shfl_sync(0xffffffffu, a_own, i);
            if (mine) {
                vec<VEC>::load(x[i], sx + (size_t)i * TV);
            } else {
#pragma unroll
                for (int j = 0; j < VEC; j++) x[i][j] = 0.0f;
            }
        }
        if (mine) {
            vec<VEC>::load(dx, sx + (size_t)Ns * TV);
        } else {
#pragma unroll
            for (int j = 0; j < VEC; j++) dx[j] = 0.0f;
        }
#pragma unroll
        for (int j = 0; j < VEC; j++) {
            h[j] = 0.0f;
            gq[j] = wn[j] * dx[j];
        }
#pragma unroll
        for (int i = 0; i < MAXS; i++) {
            if (i >= Ns) break;
#pragma unroll
            for (int j = 0; j < VEC; j++) h[j] += a[i] * x[i][j];
        }
        /* pass 1: g . v_i, h . v_i and D = g . h */
#pragma unroll
        for (int i = 0; i < MAXS; i++) {
            if (i >= Ns) break;
            float pg = 0.0f, ph = 0.0f;
#pragma unroll
            for (int j = 0; j < VEC; j++) {
                pg += gq[j] * x[i][j];
                ph += h[j] * x[i][j];
            }
            pg = warp_sum(pg);
            ph = warp_sum(ph);
            if (lane == 0) {
                red[warp * R + i] = pg;
                red[warp * R + Ns + i] = ph;
            }
        }
        {
            float pd = 0.0f;
#pragma unroll
            for (int j = 0; j < VEC; j++) pd += gq[j] * h[j];
            pd = warp_sum(pd);
            if (lane == 0) red[warp * R + 2 * Ns] = pd;
        }
        __syncthreads(); /* also publishes this round's pre, waited for above by the threads that copied it */
        if (!active) continue; /* uniform over the row group's warps */
        /* the row's coefficients (backward_coefficients' arithmetic on da_i), formed in every warp:
         * lane l < 2 Ns + 1 sums the row group's partials of sum l over its warps in order (the
         * sums every thread formed one after another before), da_i on lane i, then every lane
         * takes them: no second barrier */
        const float *r0 = red + (size_t)group * wpg * R, *lrow = pre, *rr = pre + Ns;
        float part = 0.0f;
        if (lane < R)
            for (int k = 0; k < wpg; k++) part += r0[k * R + lane];
        const float D = __shfl_sync(0xffffffffu, part, 2 * Ns);
        const float c2 = r * r * r * D / (float)d;
        const float ph_own = __shfl_sync(0xffffffffu, part, (lane + Ns) & 31); /* h . v_i on lane i < Ns */
        /* a b - c d rounded in one order (the deferring instantiation forms the same bits) */
        const float da_own = __fmaf_rn(r, part, -__fmul_rn(c2, ph_own));
        float k1[MAXS], k2[MAXS], c0 = 0.0f;
#pragma unroll
        for (int i = 0; i < MAXS; i++) {
            k1[i] = k2[i] = 0.0f;
            if (i >= Ns) continue;
            k1[i] = __shfl_sync(0xffffffffu, da_own, i); /* da_i */
            c0 += a[i] * k1[i];
        }
        if (!mine) continue;
#pragma unroll
        for (int i = 0; i < MAXS; i++) {
            if (i >= Ns) break;
            const float ds = a[i] * (k1[i] - c0), rs = rr[i];
            k1[i] = ds * rs;
            k2[i] = ds * rs * rs * lrow[i] / (float)d;
        }
        float y[VEC];
#pragma unroll
        for (int j = 0; j < VEC; j++) {
            y[j] = __fmaf_rn(r, gq[j], -__fmul_rn(c2, h[j]));
            nacc[j] += dx[j] * (h[j] * r);
        }
        /* deferred: the closed sources' terms stay as dh and their coefficients, which the
         * block's first sublayer adds (add_deferred); only the partial sum's dv is written */
        const bool defer = DEFER == 1 && df.slot >= 0;
        if (defer) {
            vec<VEC>::store(df.dh + (size_t)df.slot * nd + row + c, y);
            if (lane_g == 0) {
                float *cf = df.coef + ((size_t)df.slot * n + t) * 3 * df.cmax;
#pragma unroll
                for (int i = 0; i < MAXS; i++) {
                    if (i >= C) break;
                    cf[3 * i] = a[i];
                    cf[3 * i + 1] = k1[i];
                    cf[3 * i + 2] = k2[i];
                }
            }
        }
        lm_cp_async_wait<1>(); /* this round's rows to update (the next round's inputs may still fly) */
        /* the deferred terms into every closed source's row, held in registers (add_deferred) */
        constexpr int NOD = DEFER == 2 ? MAXS : 1;
        float od[NOD][VEC];
        if constexpr (DEFER == 2) {
            if (df.apply && !assign) {
#pragma unroll
                for (int i = 0; i < MAXS; i++) {
                    if (i >= C) break;
                    vec<VEC>::load(od[i], so + (size_t)i * TV);
                }
                add_deferred<VEC, MAXS>(od, df, x, 0, C, t, row, c, n, d, dd, pre + R, 3 * C, n_stage);
            }
        }
#pragma unroll
        for (int i = 0; i < MAXS; i++) {
            if (i >= Ns) break;
            const bool is_P = i == C;
            if (defer && !is_P) {
#pragma unroll
                for (int j = 0; j < VEC; j++) qacc[j] += k1[i] * x[i][j];
                continue;
            }
            float *dv = is_P ? dP + row : dhist + (size_t)i * nd + row;
            float o[VEC];
            if (DEFER == 2 && !is_P && df.apply && !assign) {
#pragma unroll
                for (int j = 0; j < VEC; j++) o[j] = od[NOD > 1 ? i : 0][j];
            } else if (assign && !is_P) {
#pragma unroll
                for (int j = 0; j < VEC; j++) o[j] = 0.0f;
            } else {
                vec<VEC>::load(o, so + (size_t)(i - o0) * TV);
            }
#pragma unroll
            for (int j = 0; j < VEC; j++) o[j] = dv_term(o[j], a[i], y[j], k1[i], u[j], k2[i], x[i][j]);
            vec<VEC>::store(dv + c, o);
            if (lp_out && i == lp_src) vec<VEC>::store_bf16(lp_out + row + c, o);
#pragma unroll
            for (int j = 0; j < VEC; j++) qacc[j] += k1[i] * x[i][j];
        }
    }
    lm_cp_async_wait<0>();
    /* this block's partial sums of q and of the norm weight's gradient: its row groups in order */
    if (c < d) {
#pragma unroll
        for (int j = 0; j < VEC; j++) {
            q_all[(size_t)group * d + c + j] = qacc[j];
            nq_all[(size_t)group * d + c + j] = nacc[j];
        }
    }
    __syncthreads();
    for (int cc = threadIdx.x; cc < d; cc += THREADS) {
        float sq = 0.0f, sn = 0.0f;
        for (int k = 0; k < rows; k++) {
            sq += q_all[(size_t)k * d + cc];
            sn += nq_all[(size_t)k * d + cc];
        }
        if (qpart) qpart[(size_t)blockIdx.x * d + cc] = sq;
        npart[(size_t)blockIdx.x * d + cc] = sn;
    }
}

/* The backward_norm_kernel's shared memory in bytes (its layout above). */
static size_t attnres_backward_norm_shared(int C, int has_partial, int assign, int defer_mode, int rows, int d,
                                           int n_stage) {
    const int Ns = C + has_partial, R = 2 * Ns + 1, PR = R + 3 * C * n_stage;
    const int n_o = assign || defer_mode == 1 ? has_partial : Ns;
    return ((2 * (size_t)(Ns + 1) + n_o + n_stage) * THREADS * 4 + 2 * WARPS * R + 3 * rows * PR +
            2 * (size_t)rows * d) *
           sizeof(float);
}

/* The parameter gradients from the backward blocks' partials (part [n_tb, d]:
 * one row a backward block), in two kernels and a fixed order: q[c] = the
 * sum over segments of `seg` rows, in order, of each segment's sum, which is
 * the sum of 8 strided chains (row ty, ty + 8, ... of the segment: warp ty),
 * then the 8 in order. Many blocks read the partials at once (the sums of one
 * block a 32-channel strip took a few warps a multiprocessor: latency-bound). */

/* Stage 1: block (x, y) sums segment y of part (blockIdx.z: part0 or part1)
 * for channels 32 x .. 32 x + 31 and writes the sum over the segment's first
 * row: each segment's rows of those channels are the block's alone. */
__global__ void __launch_bounds__(THREADS)
param_grad_segments_kernel(float *part0, float *part1, int64_t n_tb, int64_t seg, int d) {
    float *part = blockIdx.z ? part1 : part0;
    __shared__ float red[WARPS][33];
    const int tx = threadIdx.x & 31, ty = threadIdx.x >> 5;
    const int c = blockIdx.x * 32 + tx;
    const int64_t b0 = (int64_t)blockIdx.y * seg, b1 = b0 + seg < n_tb ? b0 + seg : n_tb;
    float s = 0.0f;
    if (c < d)
        for (int64_t b = b0 + ty; b < b1; b += WARPS) s += part[(size_t)b * d + c];
    red[ty][tx] = s;
    __syncthreads();
    if (ty == 0 && c < d) {
        float q = 0.0f;
        for (int k = 0; k < WARPS; k++) q += red[k][tx];
        part[(size_t)b0 * d + c] = q;
    }
}

/* Stage 2: q = the segments' sums in order; from part0 dw += g (.) q (g NULL:
 * dw += q) and dg += w (.) q; from part1 (may be NULL) dw1 += its q. */
__global__ void param_grad_apply_kernel(const float *part0, const float *part1, int64_t n_seg, int64_t seg, int d,
                                        const float *w, const float *g, float *dw, float *dg, float *dw1) {
    const int c = blockIdx.x * blockDim.x + threadIdx.x;
    if (c >= d) return;
    if (part0) {
        float q = 0.0f;
        for (int64_t k = 0; k < n_seg; k++) q += part0[(size_t)(k * seg) * d + c];
        if (dw) dw[c] += g ? g[c] * q : q;
        if (dg) dg[c] += w[c] * q;
    }
    if (part1) {
        float q = 0.0f;
        for (int64_t k = 0; k < n_seg; k++) q += part1[(size_t)(k * seg) * d + c];
        dw1[c] += q;
    }
}

__global__ void add_kernel(float *dst, const float *src, size_t count) {
    for (size_t i = (size_t)blockIdx.x * blockDim.x + threadIdx.x; i < count; i += (size_t)gridDim.x * blockDim.x)
        dst[i] += src[i];
}

__global__ void add4_kernel(float4 *dst, const float4 *src, size_t count4) {
    for (size_t i = (size_t)blockIdx.x * blockDim.x + threadIdx.x; i < count4;
         i += (size_t)gridDim.x * blockDim.x) {
        float4 a = dst[i];
        const float4 b = src[i];
        a.x += b.x;
        a.y += b.y;
        a.z += b.z;
        a.w += b.w;
        dst[i] = a;
    }
}

/* ---- launchers ---- */

static bool aligned16(const void *p) { return ((uintptr_t)p & 15) == 0; }

static unsigned grid_of(int64_t items, int per_block) { return (unsigned)((items + per_block - 1) / per_block); }

/* The parameter gradients from the partials (param_grad_segments_kernel, then
 * param_grad_apply_kernel): qpart (may be NULL) into dw, dg with w, g; npart
 * (may be NULL) into dnw. Segments of 128 rows (16 a warp), more where the
 * grid's y would pass 65535. The partials are overwritten. */
static lm_status launch_param_grads(cudaStream_t stream, float *qpart, const float *w, const float *g, float *dw,
                                    float *dg, float *npart, float *dnw, int64_t n_tb, int d) {
    if (!qpart && !npart) return LM_OK;
    int64_t seg = 16 * WARPS;
    while ((n_tb + seg - 1) / seg > 65535) seg *= 2;
    const int64_t n_seg = (n_tb + seg - 1) / seg;
    float *p0 = qpart ? qpart : npart, *p1 = qpart ? npart : NULL;
    const dim3 grid(grid_of(d, 32), (unsigned)n_seg, p1 ? 2u : 1u);
    param_grad_segments_kernel<<<grid, THREADS, 0, stream>>>(p0, p1, n_tb, seg, d);
    LM_CUDA_TRY(cudaGetLastError());
    param_grad_apply_kernel<<<grid_of(d, 128), 128, 0, stream>>>(qpart, npart, n_seg, seg, d, w, g, dw, dg, dnw);
    LM_CUDA_TRY(cudaGetLastError());
    return LM_OK;
}

/* *df, or none: no slot, nothing to add */
static attnres_deferred deferred_or_none(const attnres_deferred *df) {
    if (df) return *df;
    attnres_deferred none;
    memset(&none, 0, sizeof none);
    none.slot = -1;
    return none;
}

/* VEC = 4 when d allows it and every row pointer is 16-byte aligned */
static int pick_vec(int d, const void *const *ptrs, int count) {
    if (d % 4) return 1;
    for (int i = 0; i < count; i++)
        if (ptrs[i] && !aligned16(ptrs[i])) return 1;
    return 4;
}

/* threads a row: a power of two from 32 to 256, the first >= d / VEC */
static int threads_per_row(int d, int vec) {
    const int chunks = d / vec;
    int tpr = 32;
    while (tpr < chunks && tpr < THREADS) tpr *= 2;
    return tpr;
}

static lm_status allow_shared(const void *kernel, size_t bytes) {
    if (bytes > MAX_SHARED_BYTES)
        return lm_error(LM_ERR_ARG, "attnres cuda: %zu bytes of shared memory needed (too many sources or too "
                        "wide a model; at most %d)", bytes, MAX_SHARED_BYTES);
    if (bytes > 48 * 1024)
        LM_CUDA_TRY(cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, (int)bytes));
    return LM_OK;
}

/* allow_shared for a kernel that stages its rows in shared memory: also the carveout that holds
 * the most blocks */
static lm_status allow_staged_shared(const void *kernel, size_t bytes) {
    lm_status s = allow_shared(kernel, bytes);
    if (s) return s;
    LM_CUDA_TRY(cudaFuncSetAttribute(kernel, cudaFuncAttributePreferredSharedMemoryCarveout,
                                     (int)cudaSharedmemCarveoutMaxShared));
    return LM_OK;
}

/* LONGMOE_ATTNRES=generic: the two-pass forward only (the register forward
 * gives the same bits; tests and benchmarks compare the two) */
static bool regs_allowed(void) {
    const char *e = getenv("LONGMOE_ATTNRES");
    if (!e || !*e) return true;
    if (!strcmp(e, "generic")) return false;
    static int warned = 0;
    if (!warned) fprintf(stderr, "longmoe: LONGMOE_ATTNRES=%s ignored: use generic (or leave it unset)\n", e);
    warned = 1;
    return true;
}

/* The most deferred positions whose dh rows the block's first sublayer
 * stages in shared memory (the rest it reads directly): all of them, or
 * LONGMOE_ATTNRES_DEFER_STAGE = 0 .. 64 (the same bits either way; tests
 * and benchmarks compare). */
static int deferred_stage_cap(void) {
    const char *e = getenv("LONGMOE_ATTNRES_DEFER_STAGE");
    if (!e || !*e) return 64;
    char *end;
    const long v = strtol(e, &end, 10);
    if (!*end && v >= 0 && v <= 64) return (int)v;
    static int warned = 0;
    if (!warned) fprintf(stderr, "longmoe: LONGMOE_ATTNRES_DEFER_STAGE=%s ignored: use 0 to 64\n", e);
    warned = 1;
    return 64;
}

/* Tokens a backward block (one partial sum of q each): 8, or
 * LONGMOE_ATTNRES_TOKEN_BLOCK = 8, 16, 32 or 64 (each at least
 * LM_CUDA_ATTNRES_TOKEN_BLOCK, which sizes qpart). 32 left the last of about
 * 1.5 waves half empty at 32768 tokens (bench/RESULTS.md, fourteenth session). */
static int backward_token_block(void) {
    const char *e = getenv("LONGMOE_ATTNRES_TOKEN_BLOCK");
    if (!e || !*e) return 8;
    const int v = atoi(e);
    if ((v == 8 || v == 16 || v == 32 || v == 64) && v >= LM_CUDA_ATTNRES_TOKEN_BLOCK) return v;
    static int warned = 0;
    if (!warned) fprintf(stderr, "longmoe: LONGMOE_ATTNRES_TOKEN_BLOCK=%s ignored: use 8, 16, 32 or 64\n", e);
    warned = 1;
    return 8;
}

lm_status attnres_launch_accumulate_rows(cudaStream_t stream, float *dst, const float *src, float *rstd,
                                         int assign, int64_t n, int d, float eps, unsigned long long *first_nonfinite) {
    const void *ptrs[2] = {dst, src};
    const int VEC = pick_vec(d, ptrs, 2), tpr = threads_per_row(d, VEC);
    const unsigned grid = grid_of(n, THREADS / tpr);
    if (VEC == 4)
        accumulate_rows_kernel<4><<<grid, THREADS, 0, stream>>>(dst, src, rstd, assign, n, d, eps, tpr,
                                                                first_nonfinite);
    else
        accumulate_rows_kernel<1><<<grid, THREADS, 0, stream>>>(dst, src, rstd, assign, n, d, eps, tpr,
                                                                first_nonfinite);
    LM_CUDA_TRY(cudaGetLastError());
    return LM_OK;
}

lm_status attnres_launch_add(cudaStream_t stream, float *dst, const float *src, size_t count) {
    const size_t max_blocks = 8192;
    if (count % 4 == 0 && aligned16(dst) && aligned16(src)) {
        size_t blocks = (count / 4 + THREADS - 1) / THREADS;
        if (blocks > max_blocks) blocks = max_blocks;
        if (blocks == 0) return LM_OK;
        add4_kernel<<<(unsigned)blocks, THREADS, 0, stream>>>((float4 *)dst, (const float4 *)src, count / 4);
    } else {
        size_t blocks = (count + THREADS - 1) / THREADS;
        if (blocks > max_blocks) blocks = max_blocks;
        if (blocks == 0) return LM_OK;
        add_kernel<<<(unsigned)blocks, THREADS, 0, stream>>>(dst, src, count);
    }
    LM_CUDA_TRY(cudaGetLastError());
    return LM_OK;
}

lm_status attnres_launch_forward(cudaStream_t stream, const attnres_sources *src, float *P_save, const float *w,
                                 const float *g, float *logits, float *lse, float *h, int from_saved, int64_t n,
                                 int d, float eps) {
    const void *ptrs[6] = {src->hist, src->P, P_save, w, g, h};
    const int VEC = pick_vec(d, ptrs, 6), tpr = threads_per_row(d, VEC), rows = THREADS / tpr;
    const int Ns = src->C + src->has_partial;
    const size_t shared = (size_t)(WARPS * (Ns + 1) + 2 * rows * Ns) * sizeof(float);
    const unsigned grid = grid_of(n, rows);
    lm_status s;
    if (!from_saved && d <= tpr * VEC && Ns <= 16 && regs_allowed()) {
#define AR_REGS(V, M)                                                                                                \
    do {                                                                                                             \
        if ((s = allow_shared((const void *)forward_regs_kernel<V, M>, shared))) return s;                           \
        forward_regs_kernel<V, M><<<grid, THREADS, shared, stream>>>(*src, P_save, w, g, logits, lse, h, n, d, eps, \
                                                                     tpr);                                           \
    } while (0)
        if (VEC == 4) {
            if (Ns <= 4) AR_REGS(4, 4);
            else if (Ns <= 8) AR_REGS(4, 8);
            else AR_REGS(4, 16);
        } else {
            if (Ns <= 4) AR_REGS(1, 4);
            else if (Ns <= 8) AR_REGS(1, 8);
            else AR_REGS(1, 16);
        }
#undef AR_REGS
        LM_CUDA_TRY(cudaGetLastError());
        return LM_OK;
    }
    if (VEC == 4) {
        if ((s = allow_shared((const void *)forward_kernel<4>, shared))) return s;
        forward_kernel<4><<<grid, THREADS, shared, stream>>>(*src, P_save, w, g, logits, lse, h, from_saved, n, d,
                                                             eps, tpr);
    } else {
        if ((s = allow_shared((const void *)forward_kernel<1>, shared))) return s;
        forward_kernel<1><<<grid, THREADS, shared, stream>>>(*src, P_save, w, g, logits, lse, h, from_saved, n, d,
                                                             eps, tpr);
    }
    LM_CUDA_TRY(cudaGetLastError());
    return LM_OK;
}

lm_status attnres_launch_backward(cudaStream_t stream, const attnres_sources *src, float *dhist, float *dP,
                                  int assign, const float *w, const float *g, const float *logits,
                                  const float *lse, const float *dh, float *qpart, float *dw, float *dg,
                                  uint16_t *lp_out, int lp_src, const attnres_deferred *df, int64_t n, int d) {
    if (df && df->slot >= 0)
        return lm_error(LM_ERR_ARG, "attnres cuda backward: only the input's backward with its norm defers");
    const attnres_deferred dfv = deferred_or_none(df);
    const void *ptrs[9] = {src->hist, src->P, dhist, dP, w, g, dh, lp_out, dfv.dh};
    const int Ns_all = src->C + src->has_partial;
    if (lp_out && (lp_src < 0 || lp_src >= Ns_all))
        return lm_error(LM_ERR_ARG, "attnres cuda backward: bf16 copy of source %d of %d", lp_src, Ns_all);
    /* 8-byte bf16 stores of 4 floats: lp_out 16-byte aligned keeps every row's start aligned (d % 4 == 0) */
    const int VEC = pick_vec(d, ptrs, 9), tpr = threads_per_row(d, VEC), rows = THREADS / tpr;
    const int Ns = src->C + src->has_partial;
    const int want_q = dw || dg;
    float *qp = want_q ? qpart : NULL;
    const size_t shared =
        (size_t)(WARPS * Ns + rows * Ns * 3 + rows * (2 * Ns + 1) + (want_q ? rows * d : 0)) * sizeof(float);
    const int tb = backward_token_block();
    const int64_t n_tb = (n + tb - 1) / tb;
    lm_status s;
    if (VEC == 4) {
        if ((s = allow_shared((const void *)backward_kernel<4>, shared))) return s;
        backward_kernel<4><<<(unsigned)n_tb, THREADS, shared, stream>>>(*src, dhist, dP, assign, w, g, logits, lse,
                                                                        dh, qp, lp_out, lp_src, dfv, n, d, tpr, tb);
    } else {
        if ((s = allow_shared((const void *)backward_kernel<1>, shared))) return s;
        backward_kernel<1><<<(unsigned)n_tb, THREADS, shared, stream>>>(*src, dhist, dP, assign, w, g, logits, lse,
                                                                        dh, qp, lp_out, lp_src, dfv, n, d, tpr, tb);
    }
    LM_CUDA_TRY(cudaGetLastError());
    return want_q ? launch_param_grads(stream, qpart, w, g, dw, dg, NULL, NULL, n_tb, d) : LM_OK;
}

int attnres_norm_fusable(int d, int max_sources) { return d > 0 && d % 4 == 0 && d <= THREADS * 4 && max_sources <= 8; }

lm_status attnres_launch_forward_norm(cudaStream_t stream, const attnres_sources *src, float *P_save, const float *w,
                                      const float *g, float *logits, float *lse, int from_saved, const float *nw,
                                      float *xn, uint16_t *xn_bf16, float *nrstd, int64_t n, int d, float eps,
                                      float neps) {
    const int Ns = src->C + src->has_partial;
    if (!attnres_norm_fusable(d, Ns))
        return lm_error(LM_ERR_ARG, "attnres cuda: the input with its norm needs d %% 4 == 0, d <= %d and at most 8 "
                        "sources (d %d, %d sources)", THREADS * 4, d, Ns);
    const void *ptrs[4] = {src->hist, src->P, P_save, xn};
    if (pick_vec(d, ptrs, 4) != 4 || ((uintptr_t)xn_bf16 & 7))
        return lm_error(LM_ERR_ARG, "attnres cuda: the input with its norm needs 16-byte aligned rows");
    const int tpr = threads_per_row(d, 4), rows = THREADS / tpr;
    /* the kernel's shared memory (its layout there) */
    const size_t shared = (2 * (size_t)Ns * THREADS * 4 + WARPS * (Ns + 1) + 2 * rows * Ns + 2 * WARPS) * sizeof(float);
    const unsigned grid = grid_of(n, FORWARD_TOKEN_BLOCK);
    lm_status s;
#define AR_NORM(M)                                                                                                \
    do {                                                                                                          \
        if ((s = allow_staged_shared((const void *)forward_norm_kernel<4, M>, shared))) return s;                 \
        forward_norm_kernel<4, M><<<grid, THREADS, shared, stream>>>(*src, P_save, w, g, logits, lse, from_saved, \
                                                                    nw, xn, xn_bf16, nrstd, n, d, eps, neps, tpr, \
                                                                    FORWARD_TOKEN_BLOCK);                         \
    } while (0)
    if (Ns <= 4) AR_NORM(4);
    else AR_NORM(8);
#undef AR_NORM
    LM_CUDA_TRY(cudaGetLastError());
    return LM_OK;
}

lm_status attnres_launch_backward_norm(cudaStream_t stream, const attnres_sources *src, float *dhist, float *dP,
                                       const float *w, const float *g, const float *logits, const float *lse,
                                       const float *dxn, const float *nw, const float *nrstd, float *qpart,
                                       float *npart, float *dw, float *dg, float *dnw, uint16_t *lp_out, int lp_src,
                                       const attnres_deferred *df, int64_t n, int d) {
    const int Ns = src->C + src->has_partial;
    if (!attnres_norm_fusable(d, Ns))
        return lm_error(LM_ERR_ARG, "attnres cuda: the input's backward with its norm needs d %% 4 == 0, d <= %d and "
                        "at most 8 sources (d %d, %d sources)", THREADS * 4, d, Ns);
    if (lp_out && (lp_src < 0 || lp_src >= Ns))
        return lm_error(LM_ERR_ARG, "attnres cuda backward: bf16 copy of source %d of %d", lp_src, Ns);
    const attnres_deferred dfv = deferred_or_none(df);
    if (dfv.slot >= 0 && dfv.apply)
        return lm_error(LM_ERR_ARG, "attnres cuda backward: a sublayer either defers its terms or adds the deferred ones");
    if (dfv.slot >= 0 && lp_out && lp_src < src->C)
        return lm_error(LM_ERR_ARG, "attnres cuda backward: the bf16 copy of a deferred source (%d)", lp_src);
    const void *ptrs[6] = {src->hist, src->P, dhist, dP, dxn, dfv.dh};
    if (pick_vec(d, ptrs, 6) != 4 || ((uintptr_t)lp_out & 7))
        return lm_error(LM_ERR_ARG, "attnres cuda: the input's backward with its norm needs 16-byte aligned rows");
    const int tpr = threads_per_row(d, 4), rows = THREADS / tpr;
    /* the deferred backward's kernels apart (1: defers, 2: adds the deferred terms): the
     * direct one keeps its registers */
    const int mode = dfv.slot >= 0 ? 1 : dfv.apply ? 2 : 0;
    /* the block's first sublayer stages as many deferred positions' dh rows as shared memory holds */
    const int stage_cap = deferred_stage_cap();
    int n_stage = mode == 2 ? __builtin_popcountll(dfv.apply) : 0;
    if (n_stage > stage_cap) n_stage = stage_cap;
    while (n_stage > 0 && attnres_backward_norm_shared(src->C, src->has_partial, 0, mode, rows, d, n_stage) >
                              (size_t)MAX_SHARED_BYTES)
        n_stage--;
    const size_t shared = attnres_backward_norm_shared(src->C, src->has_partial, 0, mode, rows, d, n_stage);
    const int tb = backward_token_block();
    const int64_t n_tb = (n + tb - 1) / tb;
    const int want_q = dw || dg;
    lm_status s;
#define AR_NORM_B(M, D)                                                                                           \
    do {                                                                                                          \
        if ((s = allow_staged_shared((const void *)backward_norm_kernel<4, M, D>, shared))) return s;             \
        backward_norm_kernel<4, M, D><<<(unsigned)n_tb, THREADS, shared, stream>>>(                               \
            *src, dhist, dP, 0, w, g, logits, lse, dxn, nw, nrstd, want_q ? qpart : NULL, npart, lp_out, lp_src, \
            dfv, n, d, tpr, tb, n_stage);                                                                         \
    } while (0)
    if (Ns <= 4) {
        if (mode == 1) AR_NORM_B(4, 1);
        else if (mode == 2) AR_NORM_B(4, 2);
        else AR_NORM_B(4, 0);
    } else {
        if (mode == 1) AR_NORM_B(8, 1);
        else if (mode == 2) AR_NORM_B(8, 2);
        else AR_NORM_B(8, 0);
    }
#undef AR_NORM_B
    LM_CUDA_TRY(cudaGetLastError());
    return launch_param_grads(stream, want_q ? qpart : NULL, w, g, dw, dg, dnw ? npart : NULL, dnw, n_tb, d);
}

/* Routing of the MoE layer on the GPU: the fp32 top-k, the stable counting
 * sort by expert into the padded grouped layout, gathering and combining the
 * expert rows, and the router's gradient (include/longmoe/moe_cuda.h). */
#include <stdint.h>

#include "cuda/cuda_check.h"
#include "cuda/moe/moe_internal.cuh"
#include "longmoe/moe.h"
#include "longmoe/moe_cuda.h"

static unsigned blocks_for(int64_t count, int threads) { return (unsigned)((count + threads - 1) / threads); }

__device__ __forceinline__ float sigmoid_f32(float x) {
    if (x >= 0.0f) return 1.0f / (1.0f + expf(-x));
    float e = expf(x);
    return e / (1.0f + e);
}

/* One token a thread: s = sigmoid(r) in place, T = the k largest s + b (ties
 * to the lower index, decreasing), p = scale s_T / sum_T s (lm_router_select). */
__global__ void router_topk_kernel(float *s, int32_t *topk, float *weights, const float *bias, int64_t m, int n,
                                   int k, float route_scale) {
    int64_t i = (int64_t)blockIdx.x * blockDim.x + threadIdx.x;
    if (i >= m) return;
    float *si = s + i * n;
    float val[LM_MOE_MAX_TOPK];
    int32_t idx[LM_MOE_MAX_TOPK];
    int have = 0;
    for (int j = 0; j < n; j++) {
        float sj = sigmoid_f32(si[j]);
        si[j] = sj;
        float v = __fadd_rn(sj, bias ? bias[j] : 0.0f);
        if (have == k && !(v > val[k - 1])) continue;
        /* insertion after every kept value >= v: equal values keep index order */
        int pos = have < k ? have : k - 1;
        while (pos > 0 && val[pos - 1] < v) {
            val[pos] = val[pos - 1];
            idx[pos] = idx[pos - 1];
            pos--;
        }
        val[pos] = v;
        idx[pos] = j;
        if (have < k) have++;
    }
    float sum = 0.0f;
    for (int t = 0; t < k; t++) sum += si[idx[t]];
    float inv = sum > 0.0f ? route_scale / sum : 0.0f;
    for (int t = 0; t < k; t++) {
        topk[i * k + t] = idx[t];
        weights[i * k + t] = si[idx[t]] * inv;
    }
}

/* The same selection with one warp a token (n <= 32 EPL): lane l holds experts
 * l, l + 32, ...; k rounds each take the largest remaining s + b, ties to the
 * lower index, which is the order the insertion above produces; the sum of the
 * chosen s runs in that order on lane 0, so the bits equal the thread kernel's
 * (a NaN ranks below every number here; the thread kernel's NaN order differs,
 * and such a step fails the non-finite check anyway). */
template <int EPL>
__global__ void router_topk_warp_kernel(float *s, int32_t *topk, float *weights, const float *bias, int64_t m, int n,
                                        int k, float route_scale) {
    const int lane = threadIdx.x & 31;
    const int64_t i = (int64_t)blockIdx.x * (blockDim.x >> 5) + (threadIdx.x >> 5);
    if (i >= m) return;
    float *si = s + i * n;
    float sv[EPL], v[EPL];
    unsigned live = 0; /* bit e: expert e * 32 + lane exists and is not chosen yet */
#pragma unroll
    for (int e = 0; e < EPL; e++) {
        const int j = e * 32 + lane;
        sv[e] = 0.0f;
        v[e] = 0.0f;
        if (j < n) {
            float sj = sigmoid_f32(si[j]);
            si[j] = sj;
            sv[e] = sj;
            float vj = __fadd_rn(sj, bias ? bias[j] : 0.0f);
            v[e] = vj;
            live |= 1u << e;
        }
    }
    float chosen_s = 0.0f, sum = 0.0f;
    int chosen_j = 0;
    for (int t = 0; t < k; t++) {
        /* this lane's best: (live, not NaN, larger v, lower j) */
        int bj = -1, bnan = 1;
        float bv = 0.0f, bs = 0.0f;
#pragma unroll
        for (int e = 0; e < EPL; e++) {
            if (!(live >> e & 1u)) continue;
            const int nan = v[e] != v[e];
            if (bj < 0 || (bnan && !nan) || (!bnan && !nan && v[e] > bv)) {
                bj = e * 32 + lane;
                bv = v[e];
                bs = sv[e];
                bnan = nan;
            }
        }
#pragma unroll
        for (int off = 16; off > 0; off >>= 1) {
            const int oj = __shfl_xor_sync(0xffffffffu, bj, off), onan = __shfl_xor_sync(0xffffffffu, bnan, off);
            const float ov = __shfl_xor_sync(0xffffffffu, bv, off), os = __shfl_xor_sync(0xffffffffu, bs, off);
            bool take;
            if (oj < 0) take = false;
            else if (bj < 0) take = true;
            else if (bnan != onan) take = bnan;
            else if (!bnan && ov != bv) take = ov > bv;
            else take = oj < bj;
            if (take) {
                bj = oj;
                bv = ov;
                bs = os;
                bnan = onan;
            }
        }
        if ((bj & 31) == lane) live &= ~(1u << (bj >> 5));
        if (lane == t) {
            chosen_j = bj;
            chosen_s = bs;
        }
        if (lane == 0) sum += bs;
    }
    sum = __shfl_sync(0xffffffffu, sum, 0);
    const float inv = sum > 0.0f ? route_scale / sum : 0.0f;
    if (lane < k) {
        topk[i * k + lane] = chosen_j;
        weights[i * k + lane] = chosen_s * inv;
    }
}

/* Counting sort, pass 1: expert counts of each block of SORT_BLOCK slots. */
__global__ void sort_count_kernel(int32_t *block_counts, const int32_t *topk, int64_t mk, int n) {
    extern __shared__ int32_t hist[];
    for (int j = threadIdx.x; j < n; j += blockDim.x) hist[j] = 0;
    __syncthreads();
    int64_t g = (int64_t)blockIdx.x * LM_MOE_SORT_BLOCK + threadIdx.x;
    if (g < mk) atomicAdd(&hist[topk[g]], 1);
    __syncthreads();
    for (int j = threadIdx.x; j < n; j += blockDim.x) block_counts[(int64_t)blockIdx.x * n + j] = hist[j];
}

/* Pass 2 (one block): expert totals, unpadded and padded offsets, and each
 * block's first grouped row per expert (replacing its count). The threads
 * form G = blockDim / n groups (at least one); group g sums and then walks
 * its own range of the count blocks for each expert, so the walk is G times
 * shorter than one thread per expert. Integer sums: the same values whatever
 * the grouping. Shared memory: (G + 1) n ints. */
__global__ void sort_scan_kernel(int32_t *block_counts, int32_t *offsets, int32_t *padded_offsets, int nblocks,
                                 int n) {
    extern __shared__ int32_t sm[];
    const int G = (int)blockDim.x >= n ? (int)blockDim.x / n : 1;
    int32_t *tot = sm, *part = sm + n; /* part[g * n + j] */
    const int grp = (int)threadIdx.x / n < G ? (int)threadIdx.x / n : -1;
    const int j0 = G > 1 ? (int)threadIdx.x % n : (int)threadIdx.x, jstep = G > 1 ? n : (int)blockDim.x;
    const int b0 = grp < 0 ? 0 : (int)((int64_t)nblocks * grp / G), b1 = grp < 0 ? 0 : (int)((int64_t)nblocks * (grp + 1) / G);
    if (grp >= 0)
        for (int j = j0; j < n; j += jstep) {
            int32_t sum = 0;
            for (int b = b0; b < b1; b++) sum += block_counts[(int64_t)b * n + j];
            part[grp * n + j] = sum;
        }
    __syncthreads();
    for (int j = threadIdx.x; j < n; j += blockDim.x) {
        int32_t sum = 0;
        for (int g = 0; g < G; g++) sum += part[g * n + j];
        tot[j] = sum;
    }
    __syncthreads();
    if (threadIdx.x == 0) {
        int32_t o = 0, po = 0;
        for (int j = 0; j < n; j++) {
            offsets[j] = o;
            padded_offsets[j] = po;
            o += tot[j];
            po += (tot[j] + LM_MOE_CUDA_ROW_TILE - 1) / LM_MOE_CUDA_ROW_TILE * LM_MOE_CUDA_ROW_TILE;
        }
        offsets[n] = o;
        padded_offsets[n] = po;
    }
    __syncthreads();
    if (grp >= 0)
        for (int j = j0; j < n; j += jstep) {
            int32_t row = padded_offsets[j];
            for (int g = 0; g < grp; g++) row += part[g * n + j];
            for (int b = b0; b < b1; b++) {
                int32_t c = block_counts[(int64_t)b * n + j];
                block_counts[(int64_t)b * n + j] = row;
                row += c;
            }
        }
}

/* Pass 3: each slot's row = its block's first row for the expert + the
 * number of earlier slots of the block with the same expert (stable). */
__global__ void sort_place_kernel(int32_t *order, int32_t *slot_row, const int32_t *block_counts,
                                  const int32_t *topk, int64_t mk, int n) {
    __shared__ int32_t e[LM_MOE_SORT_BLOCK];
    int64_t g = (int64_t)blockIdx.x * LM_MOE_SORT_BLOCK + threadIdx.x;
    e[threadIdx.x] = g < mk ? topk[g] : -1;
    __syncthreads();
    if (g >= mk) return;
    int32_t mine = e[threadIdx.x], rank = 0;
    for (int q = 0; q < (int)threadIdx.x; q++) rank += e[q] == mine;
    int32_t row = block_counts[(int64_t)blockIdx.x * n + mine] + rank;
    order[row] = (int32_t)g;
    slot_row[g] = row;
}

lm_status lm_moe_route(cudaStream_t st, lm_cuda_moe_acts *a, const float *bias, int64_t m, int n, int k,
                       float route_scale) {
    int64_t mk = m * k;
    /* one warp a token up to 512 experts (k <= 16 < 32 lanes); beyond, one thread a token */
    const int warps = 8;
    if (n <= 128)
        router_topk_warp_kernel<4><<<blocks_for(m, warps), warps * 32, 0, st>>>(a->s, a->topk, a->weights, bias, m, n,
                                                                               k, route_scale);
    else if (n <= 256)
        router_topk_warp_kernel<8><<<blocks_for(m, warps), warps * 32, 0, st>>>(a->s, a->topk, a->weights, bias, m, n,
                                                                               k, route_scale);
    else if (n <= 512)
        router_topk_warp_kernel<16><<<blocks_for(m, warps), warps * 32, 0, st>>>(a->s, a->topk, a->weights, bias, m,
                                                                                n, k, route_scale);
    else
        router_topk_kernel<<<blocks_for(m, 128), 128, 0, st>>>(a->s, a->topk, a->weights, bias, m, n, k, route_scale);
    LM_CUDA_TRY(cudaGetLastError());
    int nblocks = (int)((mk + LM_MOE_SORT_BLOCK - 1) / LM_MOE_SORT_BLOCK);
    size_t hist_bytes = (size_t)n * sizeof(int32_t);
    sort_count_kernel<<<nblocks, LM_MOE_SORT_BLOCK, hist_bytes, st>>>(a->block_counts, a->topk, mk, n);
    LM_CUDA_TRY(cudaGetLastError());
    const int scan_groups = n <= 1024 ? 1024 / n : 1;
    sort_scan_kernel<<<1, 1024, (size_t)(scan_groups + 1) * hist_bytes, st>>>(a->block_counts, a->offsets,
                                                                              a->padded_offsets, nblocks, n);
    LM_CUDA_TRY(cudaGetLastError());
    /* padding rows of the grouped layout hold slot -1 */
    LM_CUDA_TRY(cudaMemsetAsync(a->order, 0xff, (size_t)a->rows_max * sizeof(int32_t), st));
    sort_place_kernel<<<nblocks, LM_MOE_SORT_BLOCK, 0, st>>>(a->order, a->slot_row, a->block_counts, a->topk, mk, n);
    LM_CUDA_TRY(cudaGetLastError());
    return LM_OK;
}

/* Grouped expert inputs: row r < padded_offsets[n] copies token order[r] / k
 * of src (fp32 or bf16), padding rows are zero. One warp a row. */
template <typename T>
__global__ void gather_rows_kernel(bf16 *xg, const T *src, const int32_t *order, const int32_t *padded_offsets,
                                   int64_t rows_max, int n, int k, int width) {
    int64_t r = (int64_t)blockIdx.x * (blockDim.x / 32) + threadIdx.x / 32;
    int lane = threadIdx.x % 32;
    if (r >= rows_max || r >= padded_offsets[n]) return;
    int32_t g = order[r];
    bf16 *dst = xg + r * width;
    if (g < 0) {
        for (int e = lane; e < width; e += 32) dst[e] = __float2bfloat16_rn(0.0f);
        return;
    }
    const T *row = src + (int64_t)(g / k) * width;
    for (int e = lane; e < width; e += 32) {
        if constexpr (sizeof(T) == 4) dst[e] = __float2bfloat16_rn((float)row[e]);
        else dst[e] = row[e];
    }
}

/* The same, 8 elements a lane (width % 8 == 0, 16-byte aligned rows). */
template <typename T>
__global__ void gather_rows_vec_kernel(bf16 *xg, const T *src, const int32_t *order, const int32_t *padded_offsets,
                                       int64_t rows_max, int n, int k, int width) {
    int64_t r = (int64_t)blockIdx.x * (blockDim.x / 32) + threadIdx.x / 32;
    int lane = threadIdx.x % 32;
    if (r >= rows_max || r >= padded_offsets[n]) return;
    int32_t g = order[r];
    uint4 *dst = (uint4 *)(xg + r * width);
    const int w8 = width / 8;
    if (g < 0) {
        for (int e = lane; e < w8; e += 32) dst[e] = make_uint4(0, 0, 0, 0);
        return;
    }
    const T *row = src + (int64_t)(g / k) * width;
    for (int e = lane; e < w8; e += 32) {
        if constexpr (sizeof(T) == 4) {
            float4 lo = ((const float4 *)row)[2 * e], hi = ((const float4 *)row)[2 * e + 1];
            uint4 v;
            __nv_bfloat162 *vp = (__nv_bfloat162 *)&v;
            vp[0] = __floats2bfloat162_rn(lo.x, lo.y);
            vp[1] = __floats2bfloat162_rn(lo.z, lo.w);
            vp[2] = __floats2bfloat162_rn(hi.x, hi.y);
            vp[3] = __floats2bfloat162_rn(hi.z, hi.w);
            dst[e] = v;
        } else {
            dst[e] = ((const uint4 *)row)[e];
        }
    }
}

/* The same by token, one warp a token (width % 8 == 0, width <= 32 * 8 * MAXC,
 * 16-byte aligned rows): the token's row is read once into registers (lane l:
 * chunks l, l + 32, ...) and written to each of its k slots' rows; the padding
 * rows are zero_padding_rows_kernel's. The same bits as by row (a copy, or the
 * same rounding to bf16). */
template <typename T, int MAXC>
__global__ void __launch_bounds__(256) gather_token_kernel(bf16 *__restrict__ xg, const T *__restrict__ src,
                                                           const int32_t *__restrict__ slot_row, int64_t m, int k,
                                                           int width) {
    const int64_t i = (int64_t)blockIdx.x * 8 + threadIdx.x / 32;
    const int lane = threadIdx.x % 32, w8 = width / 8;
    if (i >= m) return;
    uint4 v[MAXC];
    const T *row = src + i * width;
#pragma unroll
    for (int c = 0; c < MAXC; c++) {
        const int e = lane + 32 * c;
        v[c] = make_uint4(0, 0, 0, 0);
        if (e >= w8) continue;
        if constexpr (sizeof(T) == 4) {
            const float4 lo = ((const float4 *)row)[2 * e], hi = ((const float4 *)row)[2 * e + 1];
            __nv_bfloat162 *vp = (__nv_bfloat162 *)&v[c];
            vp[0] = __floats2bfloat162_rn(lo.x, lo.y);
            vp[1] = __floats2bfloat162_rn(lo.z, lo.w);
            vp[2] = __floats2bfloat162_rn(hi.x, hi.y);
            vp[3] = __floats2bfloat162_rn(hi.z, hi.w);
        } else {
            v[c] = ((const uint4 *)row)[e];
        }
    }
    for (int t = 0; t < k; t++) {
        uint4 *dst = (uint4 *)(xg + (int64_t)slot_row[i * k + t] * width);
#pragma unroll
        for (int c = 0; c < MAXC; c++) {
            const int e = lane + 32 * c;
            if (e < w8) dst[e] = v[c];
        }
    }
}

/* The padding rows of the grouped layout (expert j's rows past its real ones,
 * up to its padded end) set to zero, w16 16-byte units a row: one block an
 * expert. */
__global__ void zero_padding_rows_kernel(uint4 *rows, const int32_t *offsets, const int32_t *padded_offsets,
                                         int w16) {
    const int j = blockIdx.x;
    const int64_t r0 = padded_offsets[j] + (offsets[j + 1] - offsets[j]), r1 = padded_offsets[j + 1];
    const int64_t count = (r1 - r0) * w16;
    for (int64_t q = threadIdx.x; q < count; q += blockDim.x) rows[r0 * w16 + q] = make_uint4(0, 0, 0, 0);
}

static bool vec_ok(int width, const void *p, const void *q) {
    return width % 8 == 0 && (uintptr_t)p % 16 == 0 && (uintptr_t)q % 16 == 0;
}

template <typename T>
static lm_status gather_by_token(cudaStream_t st, bf16 *xg, const T *src, const lm_cuda_moe_acts *a, int n, int k,
                                 int width, int chunks) {
    const unsigned grid = blocks_for(a->m, 8);
    if (chunks == 1) gather_token_kernel<T, 1><<<grid, 256, 0, st>>>(xg, src, a->slot_row, a->m, k, width);
    else if (chunks == 2) gather_token_kernel<T, 2><<<grid, 256, 0, st>>>(xg, src, a->slot_row, a->m, k, width);
    else gather_token_kernel<T, 4><<<grid, 256, 0, st>>>(xg, src, a->slot_row, a->m, k, width);
    LM_CUDA_TRY(cudaGetLastError());
    zero_padding_rows_kernel<<<n, 256, 0, st>>>((uint4 *)xg, a->offsets, a->padded_offsets, width / 8);
    LM_CUDA_TRY(cudaGetLastError());
    return LM_OK;
}

lm_status lm_moe_gather(cudaStream_t st, bf16 *xg, const float *src_f32, const bf16 *src_bf16,
                        const lm_cuda_moe_acts *a, int n, int k, int width) {
    const int chunks = lm_moe_token_chunks(width);
    if (chunks && a->m > 0 && lm_cuda_moe_by_token() && vec_ok(width, xg, src_bf16 ? (const void *)src_bf16 : (const void *)src_f32))
        return src_bf16 ? gather_by_token(st, xg, src_bf16, a, n, k, width, chunks)
                        : gather_by_token(st, xg, src_f32, a, n, k, width, chunks);
    unsigned grid = blocks_for(a->rows_max, 8);
    if (vec_ok(width, xg, src_bf16 ? (const void *)src_bf16 : (const void *)src_f32)) {
        if (src_bf16)
            gather_rows_vec_kernel<bf16><<<grid, 256, 0, st>>>(xg, src_bf16, a->order, a->padded_offsets, a->rows_max,
                                                               n, k, width);
        else
            gather_rows_vec_kernel<float><<<grid, 256, 0, st>>>(xg, src_f32, a->order, a->padded_offsets,
                                                                a->rows_max, n, k, width);
        LM_CUDA_TRY(cudaGetLastError());
        return LM_OK;
    }
    if (src_bf16)
        gather_rows_kernel<bf16><<<grid, 256, 0, st>>>(xg, src_bf16, a->order, a->padded_offsets, a->rows_max, n, k, width);
    else
        gather_rows_kernel<float><<<grid, 256, 0, st>>>(xg, src_f32, a->order, a->padded_offsets, a->rows_max, n, k, width);
    LM_CUDA_TRY(cudaGetLastError());
    return LM_OK;
}

/* z_i = sum_t p_it gout[slot_row(i,t)], in slot order. out[m, width] fp32. */
__global__ void combine_kernel(float *out, const bf16 *gout, const float *weights, const int32_t *slot_row,
                               int64_t m, int k, int width) {
    int64_t q = (int64_t)blockIdx.x * blockDim.x + threadIdx.x;
    if (q >= m * width) return;
    int64_t i = q / width;
    int e = (int)(q % width);
    float z = 0.0f;
    for (int t = 0; t < k; t++)
        z += weights[i * k + t] * __bfloat162float(gout[(int64_t)slot_row[i * k + t] * width + e]);
    out[q] = z;
}

/* The same, 8 elements a thread, the same order of the sum. */
__global__ void combine_vec_kernel(float *out, const bf16 *gout, const float *weights, const int32_t *slot_row,
                                   int64_t m, int k, int width) {
    int64_t q = (int64_t)blockIdx.x * blockDim.x + threadIdx.x;
    const int w8 = width / 8;
    if (q >= m * w8) return;
    int64_t i = q / w8;
    int e8 = (int)(q % w8);
    float z[8];
    lm_moe_combine_chunk(z, gout, weights, slot_row, i, k, width, e8);
    float4 *o = (float4 *)(out + i * width) + 2 * e8;
    o[0] = make_float4(z[0], z[1], z[2], z[3]);
    o[1] = make_float4(z[4], z[5], z[6], z[7]);
}

lm_status lm_moe_combine(cudaStream_t st, float *out, const lm_cuda_moe_acts *a, int64_t m, int k, int width) {
    if (vec_ok(width, out, a->gout)) {
        combine_vec_kernel<<<blocks_for(m * (width / 8), 256), 256, 0, st>>>(out, (const bf16 *)a->gout, a->weights,
                                                                            a->slot_row, m, k, width);
        LM_CUDA_TRY(cudaGetLastError());
        return LM_OK;
    }
    combine_kernel<<<blocks_for(m * width, 256), 256, 0, st>>>(out, (const bf16 *)a->gout, a->weights, a->slot_row, m, k, width);
    LM_CUDA_TRY(cudaGetLastError());
    return LM_OK;
}

/* One 8-element chunk of a slot's combination backward: dst = p dz (bf16),
 * and dz . gout of the chunk returned (in one fixed expression). */
__device__ __forceinline__ float slot_backward_chunk(uint4 *dst, const uint4 gv, const float4 lo, const float4 hi,
                                                     const float w) {
    const bf16 *gp = (const bf16 *)&gv;
    uint4 v;
    __nv_bfloat162 *vp = (__nv_bfloat162 *)&v;
    vp[0] = __floats2bfloat162_rn(w * lo.x, w * lo.y);
    vp[1] = __floats2bfloat162_rn(w * lo.z, w * lo.w);
    vp[2] = __floats2bfloat162_rn(w * hi.x, w * hi.y);
    vp[3] = __floats2bfloat162_rn(w * hi.z, w * hi.w);
    *dst = v;
    return lo.x * __bfloat162float(gp[0]) + lo.y * __bfloat162float(gp[1]) + lo.z * __bfloat162float(gp[2]) +
           lo.w * __bfloat162float(gp[3]) + hi.x * __bfloat162float(gp[4]) + hi.y * __bfloat162float(gp[5]) +
           hi.z * __bfloat162float(gp[6]) + hi.w * __bfloat162float(gp[7]);
}

/* Backward of the combination, one warp a grouped row: dgout = p dz_i (bf16,
 * zero on padding rows), dp_slot = <dz_i, gout_row> (fp32, fixed warp order). */
__global__ void combine_backward_kernel(bf16 *dgout, float *dp, const float *dz, const bf16 *gout,
                                        const float *weights, const int32_t *order, const int32_t *padded_offsets,
                                        int64_t rows_max, int n, int k, int width) {
    int64_t r = (int64_t)blockIdx.x * (blockDim.x / 32) + threadIdx.x / 32;
    int lane = threadIdx.x % 32;
    if (r >= rows_max || r >= padded_offsets[n]) return;
    int32_t g = order[r];
    bf16 *dst = dgout + r * width;
    if (g < 0) {
        for (int e = lane; e < width; e += 32) dst[e] = __float2bfloat16_rn(0.0f);
        return;
    }
    const float *dzi = dz + (int64_t)(g / k) * width;
    const bf16 *go = gout + r * width;
    float w = weights[g], dot = 0.0f;
    for (int e = lane; e < width; e += 32) {
        dst[e] = __float2bfloat16_rn(w * dzi[e]);
        dot += dzi[e] * __bfloat162float(go[e]);
    }
    for (int off = 16; off > 0; off >>= 1) dot += __shfl_xor_sync(0xffffffffu, dot, off);
    if (lane == 0) dp[g] = dot;
}

/* The same, 8 elements a lane. */
__global__ void combine_backward_vec_kernel(bf16 *dgout, float *dp, const float *dz, const bf16 *gout,
                                            const float *weights, const int32_t *order,
                                            const int32_t *padded_offsets, int64_t rows_max, int n, int k,
                                            int width) {
    int64_t r = (int64_t)blockIdx.x * (blockDim.x / 32) + threadIdx.x / 32;
    int lane = threadIdx.x % 32;
    if (r >= rows_max || r >= padded_offsets[n]) return;
    int32_t g = order[r];
    uint4 *dst = (uint4 *)(dgout + r * width);
    const int w8 = width / 8;
    if (g < 0) {
        for (int e = lane; e < w8; e += 32) dst[e] = make_uint4(0, 0, 0, 0);
        return;
    }
    const float4 *dzi = (const float4 *)(dz + (int64_t)(g / k) * width);
    const uint4 *go = (const uint4 *)(gout + r * width);
    float w = weights[g], dot = 0.0f;
    for (int e = lane; e < w8; e += 32) dot += slot_backward_chunk(dst + e, go[e], dzi[2 * e], dzi[2 * e + 1], w);
    for (int off = 16; off > 0; off >>= 1) dot += __shfl_xor_sync(0xffffffffu, dot, off);
    if (lane == 0) dp[g] = dot;
}

/* The same by token, one warp a token (width % 8 == 0, width <= 32 * 8 * MAXC):
 * the token's dz row is read once into registers (lane l: chunks l, l + 32,
 * ...), then each of its k slots' rows is written and its dot formed as
 * combine_backward_vec_kernel does (the same chunks, order and expression), so
 * dz is not fetched again for every slot. The padding rows are
 * zero_padding_rows_kernel's. */
template <int MAXC>
__global__ void __launch_bounds__(256)
    combine_backward_token_kernel(bf16 *__restrict__ dgout, float *__restrict__ dp, const float *__restrict__ dz,
                                  const bf16 *__restrict__ gout, const float *__restrict__ weights,
                                  const int32_t *__restrict__ slot_row, int64_t m, int k, int width) {
    const int64_t i = (int64_t)blockIdx.x * 8 + threadIdx.x / 32;
    const int lane = threadIdx.x % 32, w8 = width / 8;
    if (i >= m) return;
    float4 lo[MAXC], hi[MAXC];
#pragma unroll
    for (int c = 0; c < MAXC; c++) {
        const int e8 = lane + 32 * c;
        lo[c] = hi[c] = make_float4(0.0f, 0.0f, 0.0f, 0.0f);
        if (e8 < w8) {
            const float4 *dzi = (const float4 *)(dz + i * width);
            lo[c] = dzi[2 * e8];
            hi[c] = dzi[2 * e8 + 1];
        }
    }
    for (int t = 0; t < k; t++) {
        const int64_t slot = i * k + t;
        const int64_t r = slot_row[slot];
        const float w = weights[slot];
        const uint4 *go = (const uint4 *)(gout + r * width);
        uint4 *dst = (uint4 *)(dgout + r * width);
        float dot = 0.0f;
#pragma unroll
        for (int c = 0; c < MAXC; c++) {
            const int e8 = lane + 32 * c;
            if (e8 >= w8) continue;
            dot += slot_backward_chunk(dst + e8, go[e8], lo[c], hi[c], w);
        }
        for (int off = 16; off > 0; off >>= 1) dot += __shfl_xor_sync(0xffffffffu, dot, off);
        if (lane == 0) dp[slot] = dot;
    }
}

lm_status lm_moe_combine_backward(cudaStream_t st, bf16 *dgout, float *dp, const float *dz,
                                  const lm_cuda_moe_acts *a, int n, int k, int width) {
    const int per_lane = lm_moe_token_chunks(width);
    if (vec_ok(width, dgout, dz) && (uintptr_t)a->gout % 16 == 0 && per_lane > 0 && a->m > 0 && lm_cuda_moe_by_token()) {
        const unsigned grid = blocks_for(a->m, 8);
        if (per_lane <= 1)
            combine_backward_token_kernel<1><<<grid, 256, 0, st>>>(dgout, dp, dz, (const bf16 *)a->gout, a->weights,
                                                                  a->slot_row, a->m, k, width);
        else if (per_lane <= 2)
            combine_backward_token_kernel<2><<<grid, 256, 0, st>>>(dgout, dp, dz, (const bf16 *)a->gout, a->weights,
                                                                  a->slot_row, a->m, k, width);
        else
            combine_backward_token_kernel<4><<<grid, 256, 0, st>>>(dgout, dp, dz, (const bf16 *)a->gout, a->weights,
                                                                  a->slot_row, a->m, k, width);
        LM_CUDA_TRY(cudaGetLastError());
        zero_padding_rows_kernel<<<n, 256, 0, st>>>((uint4 *)dgout, a->offsets, a->padded_offsets, width / 8);
        LM_CUDA_TRY(cudaGetLastError());
        return LM_OK;
    }
    if (vec_ok(width, dgout, dz) && (uintptr_t)a->gout % 16 == 0) {
        combine_backward_vec_kernel<<<blocks_for(a->rows_max, 8), 256, 0, st>>>(
            dgout, dp, dz, (const bf16 *)a->gout, a->weights, a->order, a->padded_offsets, a->rows_max, n, k, width);
        LM_CUDA_TRY(cudaGetLastError());
        return LM_OK;
    }
    combine_backward_kernel<<<blocks_for(a->rows_max, 8), 256, 0, st>>>(dgout, dp, dz, (const bf16 *)a->gout, a->weights, a->order,
                                                                       a->padded_offsets, a->rows_max, n, k, width);
    LM_CUDA_TRY(cudaGetLastError());
    return LM_OK;
}

/* Grouped input gradients back to tokens, in slot order: v_i = sum_t dxg[row(i,t)];
 * into dx_f32 (+=) or dx_bf16 (store), rows ld elements apart. */
__global__ void scatter_kernel(float *dx_f32, bf16 *dx_bf16, const bf16 *dxg, const int32_t *slot_row, int64_t m,
                               int k, int width, int64_t ld) {
    int64_t q = (int64_t)blockIdx.x * blockDim.x + threadIdx.x;
    if (q >= m * width) return;
    int64_t i = q / width;
    int e = (int)(q % width);
    float v = 0.0f;
    for (int t = 0; t < k; t++) v += __bfloat162float(dxg[(int64_t)slot_row[i * k + t] * width + e]);
    if (dx_bf16) dx_bf16[i * ld + e] = __float2bfloat16_rn(v);
    else dx_f32[i * ld + e] += v;
}

/* The same, 8 elements a thread, the same order of the sum. */
__global__ void scatter_vec_kernel(float *dx_f32, bf16 *dx_bf16, const bf16 *dxg, const int32_t *slot_row,
                                   int64_t m, int k, int width, int64_t ld) {
    int64_t q = (int64_t)blockIdx.x * blockDim.x + threadIdx.x;
    const int w8 = width / 8;
    if (q >= m * w8) return;
    int64_t i = q / w8;
    int e8 = (int)(q % w8);
    float v[8] = {0.0f, 0.0f, 0.0f, 0.0f, 0.0f, 0.0f, 0.0f, 0.0f};
    for (int t = 0; t < k; t++) {
        uint4 g = ((const uint4 *)(dxg + (int64_t)slot_row[i * k + t] * width))[e8];
        const bf16 *gp = (const bf16 *)&g;
#pragma unroll
        for (int e = 0; e < 8; e++) v[e] += __bfloat162float(gp[e]);
    }
    if (dx_bf16) {
        uint4 o;
        __nv_bfloat162 *op = (__nv_bfloat162 *)&o;
        for (int e = 0; e < 4; e++) op[e] = __floats2bfloat162_rn(v[2 * e], v[2 * e + 1]);
        ((uint4 *)(dx_bf16 + i * ld))[e8] = o;
    } else {
        float4 *o = (float4 *)(dx_f32 + i * ld) + 2 * e8;
        float4 lo = o[0], hi = o[1];
        lo.x += v[0], lo.y += v[1], lo.z += v[2], lo.w += v[3];
        hi.x += v[4], hi.y += v[5], hi.z += v[6], hi.w += v[7];
        o[0] = lo;
        o[1] = hi;
    }
}

lm_status lm_moe_scatter(cudaStream_t st, float *dx_f32, bf16 *dx_bf16, const bf16 *dxg, const lm_cuda_moe_acts *a,
                         int64_t m, int k, int width, int64_t ld) {
    if (ld % 8 == 0 && vec_ok(width, dxg, dx_bf16 ? (const void *)dx_bf16 : (const void *)dx_f32)) {
        scatter_vec_kernel<<<blocks_for(m * (width / 8), 256), 256, 0, st>>>(dx_f32, dx_bf16, dxg, a->slot_row, m, k,
                                                                            width, ld);
        LM_CUDA_TRY(cudaGetLastError());
        return LM_OK;
    }
    scatter_kernel<<<blocks_for(m * width, 256), 256, 0, st>>>(dx_f32, dx_bf16, dxg, a->slot_row, m, k, width, ld);
    LM_CUDA_TRY(cudaGetLastError());
    return LM_OK;
}

/* Router gradient, dense part: dr = extra s (1 - s), or 0. */
__global__ void router_dense_grad_kernel(float *dr, const float *extra, const float *s, int64_t mn) {
    int64_t q = (int64_t)blockIdx.x * blockDim.x + threadIdx.x;
    if (q >= mn) return;
    dr[q] = extra ? extra[q] * s[q] * (1.0f - s[q]) : 0.0f;
}

/* Chosen experts, one token a thread: p_t = c s_t / S, so
 * ds_t = (c dp_t - sum_u dp_u p_u) / S and dr_t += ds_t s_t (1 - s_t). */
__global__ void router_chosen_grad_kernel(float *dr, const float *dp, const float *s, const int32_t *topk,
                                          const float *weights, int64_t m, int n, int k, float route_scale) {
    int64_t i = (int64_t)blockIdx.x * blockDim.x + threadIdx.x;
    if (i >= m) return;
    const float *si = s + i * n;
    const int32_t *ti = topk + i * k;
    float sum = 0.0f, dot = 0.0f;
    for (int t = 0; t < k; t++) {
        sum += si[ti[t]];
        dot += dp[i * k + t] * weights[i * k + t];
    }
    for (int t = 0; t < k; t++) {
        float sv = si[ti[t]];
        float ds = sum > 0.0f ? (route_scale * dp[i * k + t] - dot) / sum : 0.0f;
        dr[i * n + ti[t]] += ds * sv * (1.0f - sv);
    }
}

lm_status lm_moe_router_grad(cudaStream_t st, float *dr, const float *dp, const float *extra,
                             const lm_cuda_moe_acts *a, int64_t m, int n, int k, float route_scale) {
    router_dense_grad_kernel<<<blocks_for(m * n, 256), 256, 0, st>>>(dr, extra, a->s, m * n);
    LM_CUDA_TRY(cudaGetLastError());
    router_chosen_grad_kernel<<<blocks_for(m, 128), 128, 0, st>>>(dr, dp, a->s, a->topk, a->weights, m, n, k,
                                                                 route_scale);
    LM_CUDA_TRY(cudaGetLastError());
    return LM_OK;
}

/* dx[i] += sum_t dr[i, e_t] W_r[e_t] over the token's chosen experts e_t in
 * slot order (dr is zero elsewhere when no dense score gradient was added):
 * one block a token, each thread its channels, fp32, a fixed order. */
__global__ void router_dx_sparse_kernel(float *dx, const float *dr, const float *router, const int32_t *topk,
                                        int64_t m, int n, int k, int d) {
    __shared__ int32_t e[LM_MOE_MAX_TOPK];
    __shared__ float g[LM_MOE_MAX_TOPK];
    const int64_t i = blockIdx.x;
    if (i >= m) return;
    if (threadIdx.x < k) {
        int32_t j = topk[i * k + threadIdx.x];
        e[threadIdx.x] = j;
        g[threadIdx.x] = dr[i * n + j];
    }
    __syncthreads();
    float *xi = dx + i * d;
    for (int c = threadIdx.x; c < d; c += blockDim.x) {
        float acc = 0.0f;
        for (int t = 0; t < k; t++) acc = fmaf(g[t], router[(int64_t)e[t] * d + c], acc);
        xi[c] += acc;
    }
}

/* The same sums by tiles of RDX_TOKENS tokens x RDX_COLS columns: a block
 * first stages those columns of all n rows of W_r, and its tokens' chosen
 * experts and their dr, in shared memory (every load independent, one
 * barrier); then a warp takes four tokens at a time, a lane two columns,
 * with only shared-memory reads between its dx loads and stores. W_r crosses
 * L2 once a tile instead of k rows of d a token (the one-block-a-token
 * kernel's 1 GB at k3-mini's 32768 tokens). The sum over the slots runs in
 * slot order with the same fmaf, so the bits are that kernel's, which stays
 * for the shapes this one does not take (d not a multiple of 64, more than
 * 48 KiB of shared memory, unaligned rows). Measured on the H200 at k3-mini's
 * MoE layer (bench/RESULTS.md, fifteenth session): the layer's
 * forward+backward 6.48 -> 6.25 ms (one run each). */
#define RDX_TOKENS 128
#define RDX_COLS 64
__global__ void __launch_bounds__(256) router_dx_tiled_kernel(float *__restrict__ dx, const float *__restrict__ dr,
                                                              const float *__restrict__ router,
                                                              const int32_t *__restrict__ topk, int64_t m, int n,
                                                              int k, int d) {
    extern __shared__ float smem[];
    float *ws = smem;                                      /* [n][RDX_COLS] */
    int32_t *es = (int32_t *)(ws + (size_t)n * RDX_COLS); /* [RDX_TOKENS][k] */
    float *gs = (float *)(es + RDX_TOKENS * k);            /* [RDX_TOKENS][k] */
    const int c0 = blockIdx.y * RDX_COLS;
    const int64_t i0 = (int64_t)blockIdx.x * RDX_TOKENS;
    const int tokens = m - i0 < RDX_TOKENS ? (int)(m - i0) : RDX_TOKENS;
    for (int q = threadIdx.x; q < n * (RDX_COLS / 4); q += blockDim.x) {
        const int j = q / (RDX_COLS / 4), c4 = q % (RDX_COLS / 4);
        ((float4 *)ws)[q] = *(const float4 *)(router + (int64_t)j * d + c0 + 4 * c4);
    }
    for (int q = threadIdx.x; q < tokens * k; q += blockDim.x) {
        const int32_t e = topk[i0 * k + q];
        es[q] = e;
        gs[q] = dr[(i0 + q / k) * n + e];
    }
    __syncthreads();
    const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31, warps = blockDim.x >> 5;
    for (int t0 = 4 * warp; t0 < tokens; t0 += 4 * warps) {
        float2 v[4], acc[4];
#pragma unroll
        for (int u = 0; u < 4; u++) {
            acc[u] = make_float2(0.0f, 0.0f);
            if (t0 + u < tokens) v[u] = ((const float2 *)(dx + (i0 + t0 + u) * d + c0))[lane];
        }
#pragma unroll
        for (int u = 0; u < 4; u++) {
            if (t0 + u >= tokens) break;
            for (int s2 = 0; s2 < k; s2++) {
                const int q = (t0 + u) * k + s2;
                const float g = gs[q];
                const float2 w = ((const float2 *)(ws + es[q] * RDX_COLS))[lane];
                acc[u].x = fmaf(g, w.x, acc[u].x);
                acc[u].y = fmaf(g, w.y, acc[u].y);
            }
        }
#pragma unroll
        for (int u = 0; u < 4; u++)
            if (t0 + u < tokens)
                ((float2 *)(dx + (i0 + t0 + u) * d + c0))[lane] = make_float2(v[u].x + acc[u].x, v[u].y + acc[u].y);
    }
}

lm_status lm_moe_router_dx_sparse(cudaStream_t st, float *dx, const float *dr, const float *router,
                                  const lm_cuda_moe_acts *a, int64_t m, int n, int k, int d) {
    if (m <= 0) return LM_OK;
    if (m > INT32_MAX) return lm_error(LM_ERR_ARG, "moe router dx: %lld tokens", (long long)m);
    const size_t smem = (size_t)n * RDX_COLS * sizeof(float) + 2 * (size_t)RDX_TOKENS * k * 4;
    if (d % RDX_COLS == 0 && smem <= 48 * 1024 && (uintptr_t)dx % 16 == 0 && (uintptr_t)router % 16 == 0) {
        dim3 grid((unsigned)((m + RDX_TOKENS - 1) / RDX_TOKENS), (unsigned)(d / RDX_COLS));
        router_dx_tiled_kernel<<<grid, 256, smem, st>>>(dx, dr, router, a->topk, m, n, k, d);
    } else {
        int threads = d >= 256 ? 256 : ((d + 31) / 32) * 32;
        router_dx_sparse_kernel<<<(unsigned)m, threads, 0, st>>>(dx, dr, router, a->topk, m, n, k, d);
    }
    LM_CUDA_TRY(cudaGetLastError());
    return LM_OK;
}

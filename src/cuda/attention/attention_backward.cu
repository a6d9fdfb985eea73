// Causal flash attention backward (include/longmoe/attention_cuda.h), three
// kernels, none with atomics (deterministic):
//
// 1. attention_delta_kernel: D_i = sum_d dO[i,d] O[i,d] (fp32), one warp a row.
// 2. attention_dkdv_kernel: one block per (batch, key/value head, tile of
//    16 * DKV_WARPS keys); each warp owns 16 keys and keeps their dk and dv in
//    fp32 registers while the block walks, in a fixed order, every query head
//    of the group and every query tile from the diagonal to the end:
//      S^T = K Q^T,  P^T = exp2(S^T scale log2 e - lse log2 e)  (recomputed),
//      dP^T = V dO^T,  dS^T = P^T (dP^T - D),  dV += P^T dO,  dK += dS^T Q.
// 3. attention_dq_kernel: one block per (batch, query head, tile of
//    16 * DQ_WARPS rows); each warp owns 16 rows and walks the key tiles up to
//    its diagonal:  S = Q K^T, P, dP = dO V^T, dS = P (dP - D), dQ += dS K.
// dq and dk are scaled by `scale` at the end (s = scale q.k). Q, dO (pass 2)
// and K, V (pass 3) are double-buffered in shared memory by cp.async.
#include <math.h>
#include <stdint.h>

#include "attention_common.cuh"

namespace lmattn {

// D_i for every (b, t, h): one warp per row, a fixed shuffle tree.
template <int DV>
__global__ void attention_delta_kernel(Params p) {
    const long long row = (long long)blockIdx.x * (blockDim.x / 32) + (threadIdx.x >> 5);
    const int lane = threadIdx.x & 31;
    const long long rows = (long long)p.B * p.T * p.H;
    if (row >= rows) return;
    const uint16_t *o = p.o + row * DV, *d_o = p.d_o + row * DV;
    float sum = 0.f;
    for (int d = lane; d < DV; d += 32) sum += bf16_to_float(o[d]) * bf16_to_float(d_o[d]);
#pragma unroll
    for (int w = 16; w >= 1; w >>= 1) sum += __shfl_xor_sync(0xffffffffu, sum, w);
    if (lane == 0) {
        // row = (b * T + t) * H + h  ->  delta[(b * H + h) * T + t]
        const int h = (int)(row % p.H);
        const long long bt = row / p.H;
        const int t = (int)(bt % p.T);
        const long long b = bt / p.T;
        p.delta[(b * p.H + h) * p.T + t] = sum;
    }
}

template <int DK, int DV>
__global__ void __launch_bounds__(DKV_WARPS * 32)
    attention_dkdv_kernel(Params p) {
    constexpr int NT = DKV_WARPS * 32;
    constexpr int BC = DKV_WARPS * WARP_ROWS;  // keys per block
    constexpr int BR = dkv_query_tile(DK, DV); // query rows per tile
    constexpr int LDK = smem_ld(DK), LDV = smem_ld(DV);
    extern __shared__ __align__(16) unsigned char smem_raw[];
    uint16_t *sK = reinterpret_cast<uint16_t *>(smem_raw);  // [BC][LDK]
    uint16_t *sV = sK + BC * LDK;                           // [BC][LDV]
    uint16_t *sQ = sV + BC * LDV;                           // [2][BR][LDK]
    uint16_t *sO = sQ + 2 * BR * LDK;                       // [2][BR][LDV] (dO)
    float *sL = reinterpret_cast<float *>(sO + 2 * BR * LDV);  // [2][BR] lse * log2(e)
    float *sD = sL + 2 * BR;                                    // [2][BR] D

    const int tid = threadIdx.x, warp = tid >> 5, lane = tid & 31;
    const int g = lane >> 2, c = lane & 3;
    const int T = p.T, H = p.H, Hkv = p.Hkv, group = p.group, Tk = p.Tk, qoff = p.qoff;
    const int bkv = blockIdx.x, b = bkv / Hkv, hk = bkv % Hkv;
    const int k0 = (gridDim.y - 1 - blockIdx.y) * BC;  // the longest walks first
    const int kw0 = k0 + warp * WARP_ROWS;               // this warp's first key
    const int key_lo = kw0 + g, key_hi = kw0 + g + 8;

    const long long q_stride = (long long)H * DK, o_stride = (long long)H * DV;
    const long long k_stride = (long long)Hkv * DK, v_stride = (long long)Hkv * DV;
    load_rows_async<DK>(sK, p.k + ((long long)b * Tk * Hkv + hk) * DK, k_stride, k0, BC, Tk, tid, NT);
    load_rows_async<DV>(sV, p.v + ((long long)b * Tk * Hkv + hk) * DV, v_stride, k0, BC, Tk, tid, NT);

    const int nq = (T + BR - 1) / BR;
    // the first query tile reaching key k0 (query t sees keys <= qoff + t)
    const int qt_first = (k0 > qoff ? k0 - qoff : 0) / BR;
    const int per_head = nq - qt_first;
    const int iters = group * per_head;      // (query head of the group, query tile)

    // stage the query tile of iteration `it` into buffer `buf`
    auto stage = [&](int it, int buf) {
        const int h = hk * group + it / per_head;
        const int q0 = (qt_first + it % per_head) * BR;
        load_rows_async<DK>(sQ + buf * BR * LDK, p.q + ((long long)b * T * H + h) * DK, q_stride,
                            q0, BR, T, tid, NT);
        load_rows_async<DV>(sO + buf * BR * LDV, p.d_o + ((long long)b * T * H + h) * DV,
                            o_stride, q0, BR, T, tid, NT);
        const float *lse = p.lse_in + ((long long)b * H + h) * T;
        const float *dl = p.delta + ((long long)b * H + h) * T;
        for (int r = tid; r < BR; r += NT) {
            const int t = q0 + r;
            sL[buf * BR + r] = t < T ? lse[t] * LOG2E : 0.f;
            sD[buf * BR + r] = t < T ? dl[t] : 0.f;
        }
    };
    stage(0, 0);
    cp_async_commit();

    float dk[DK / 8][4], dv[DV / 8][4];
#pragma unroll
    for (int j = 0; j < DK / 8; j++) dk[j][0] = dk[j][1] = dk[j][2] = dk[j][3] = 0.f;
#pragma unroll
    for (int j = 0; j < DV / 8; j++) dv[j][0] = dv[j][1] = dv[j][2] = dv[j][3] = 0.f;
    const float sl2 = p.scale_log2;

    for (int it = 0; it < iters; it++) {
        const int buf = it & 1;
        const int q0 = (qt_first + it % per_head) * BR;
        if (it + 1 < iters) {
            stage(it + 1, buf ^ 1);
            cp_async_commit();
            cp_async_wait<1>();
        } else {
            cp_async_wait<0>();
        }
        __syncthreads();
        const uint16_t *tQ = sQ + buf * BR * LDK, *tO = sO + buf * BR * LDV;
        const float *tL = sL + buf * BR, *tD = sD + buf * BR;
        // a warp whose keys all lie right of this tile's rows (or past Tk) has nothing here
        if (kw0 <= qoff + q0 + BR - 1 && kw0 < Tk) {
            // S^T = K Q^T and dP^T = V dO^T: 16 keys x BR queries
            float s[BR / 8][4], dp[BR / 8][4];
#pragma unroll
            for (int j = 0; j < BR / 8; j++) {
                s[j][0] = s[j][1] = s[j][2] = s[j][3] = 0.f;
                dp[j][0] = dp[j][1] = dp[j][2] = dp[j][3] = 0.f;
            }
#pragma unroll
            for (int kk = 0; kk < DK / 16; kk++) {
                uint32_t a[4];
                ldmatrix_x4(a, sK + a_frag_offset(lane, warp * WARP_ROWS, kk * 16, LDK));
#pragma unroll
                for (int np = 0; np < BR / 16; np++) {
                    uint32_t bf[4];
                    ldmatrix_x4(bf, tQ + bt_frag_offset(lane, np * 16, kk * 16, LDK));
                    mma_bf16(s[2 * np], a, bf[0], bf[1]);
                    mma_bf16(s[2 * np + 1], a, bf[2], bf[3]);
                }
            }
#pragma unroll
            for (int kk = 0; kk < DV / 16; kk++) {
                uint32_t a[4];
                ldmatrix_x4(a, sV + a_frag_offset(lane, warp * WARP_ROWS, kk * 16, LDV));
#pragma unroll
                for (int np = 0; np < BR / 16; np++) {
                    uint32_t bf[4];
                    ldmatrix_x4(bf, tO + bt_frag_offset(lane, np * 16, kk * 16, LDV));
                    mma_bf16(dp[2 * np], a, bf[0], bf[1]);
                    mma_bf16(dp[2 * np + 1], a, bf[2], bf[3]);
                }
            }
            // P^T (zero where query < key or query >= T) and dS^T = P^T (dP^T - D)
#pragma unroll
            for (int j = 0; j < BR / 8; j++) {
#pragma unroll
                for (int e = 0; e < 4; e++) {
                    const int col = j * 8 + 2 * c + (e & 1);
                    const int query = q0 + col;
                    const int key = e < 2 ? key_lo : key_hi;
                    const float pr = (qoff + query >= key && query < T) ? exp2f(s[j][e] * sl2 - tL[col]) : 0.f;
                    s[j][e] = pr;
                    dp[j][e] = pr * (dp[j][e] - tD[col]);
                }
            }
            // dV += P^T dO and dK += dS^T Q (k = the tile's queries)
#pragma unroll
            for (int kk = 0; kk < BR / 16; kk++) {
                uint32_t a[4];
                a[0] = pack_bf16(s[2 * kk][0], s[2 * kk][1]);
                a[1] = pack_bf16(s[2 * kk][2], s[2 * kk][3]);
                a[2] = pack_bf16(s[2 * kk + 1][0], s[2 * kk + 1][1]);
                a[3] = pack_bf16(s[2 * kk + 1][2], s[2 * kk + 1][3]);
#pragma unroll
                for (int np = 0; np < DV / 16; np++) {
                    uint32_t bf[4];
                    ldmatrix_x4_trans(bf, tO + b_frag_offset(lane, kk * 16, np * 16, LDV));
                    mma_bf16(dv[2 * np], a, bf[0], bf[1]);
                    mma_bf16(dv[2 * np + 1], a, bf[2], bf[3]);
                }
                a[0] = pack_bf16(dp[2 * kk][0], dp[2 * kk][1]);
                a[1] = pack_bf16(dp[2 * kk][2], dp[2 * kk][3]);
                a[2] = pack_bf16(dp[2 * kk + 1][0], dp[2 * kk + 1][1]);
                a[3] = pack_bf16(dp[2 * kk + 1][2], dp[2 * kk + 1][3]);
#pragma unroll
                for (int np = 0; np < DK / 16; np++) {
                    uint32_t bf[4];
                    ldmatrix_x4_trans(bf, tQ + b_frag_offset(lane, kk * 16, np * 16, LDK));
                    mma_bf16(dk[2 * np], a, bf[0], bf[1]);
                    mma_bf16(dk[2 * np + 1], a, bf[2], bf[3]);
                }
            }
        }
        __syncthreads();  // the next iteration's loads overwrite this buffer
    }

    const float scale = p.scale;
#pragma unroll
    for (int j = 0; j < DK / 8; j++) {
        const int col = j * 8 + 2 * c;
        if (key_lo < Tk)
            *reinterpret_cast<uint32_t *>(p.dk + (((long long)b * Tk + key_lo) * Hkv + hk) * DK + col) =
                pack_bf16(dk[j][0] * scale, dk[j][1] * scale);
        if (key_hi < Tk)
            *reinterpret_cast<uint32_t *>(p.dk + (((long long)b * Tk + key_hi) * Hkv + hk) * DK + col) =
                pack_bf16(dk[j][2] * scale, dk[j][3] * scale);
    }
#pragma unroll
    for (int j = 0; j < DV / 8; j++) {
        const int col = j * 8 + 2 * c;
        if (key_lo < Tk)
            *reinterpret_cast<uint32_t *>(p.dv + (((long long)b * Tk + key_lo) * Hkv + hk) * DV + col) =
                pack_bf16(dv[j][0], dv[j][1]);
        if (key_hi < Tk)
            *reinterpret_cast<uint32_t *>(p.dv + (((long long)b * Tk + key_hi) * Hkv + hk) * DV + col) =
                pack_bf16(dv[j][2], dv[j][3]);
    }
}

template <int DK, int DV>
__global__ void __launch_bounds__(DQ_WARPS * 32)
    attention_dq_kernel(Params p) {
    constexpr int NT = DQ_WARPS * 32;
    constexpr int BR = DQ_WARPS * WARP_ROWS, BC = KEY_TILE;
    constexpr int LDK = smem_ld(DK), LDV = smem_ld(DV);
    extern __shared__ __align__(16) unsigned char smem_raw[];
    uint16_t *sQ = reinterpret_cast<uint16_t *>(smem_raw);  // [BR][LDK]
    uint16_t *sO = sQ + BR * LDK;                           // [BR][LDV] (dO)
    uint16_t *sK = sO + BR * LDV;                           // [2][BC][LDK]
    uint16_t *sV = sK + 2 * BC * LDK;                       // [2][BC][LDV]

    const int tid = threadIdx.x, warp = tid >> 5, lane = tid & 31;
    const int g = lane >> 2, c = lane & 3;
    const int T = p.T, H = p.H, Hkv = p.Hkv, Tk = p.Tk, qoff = p.qoff;
    const int bh = blockIdx.x, b = bh / H, h = bh % H, hk = h / p.group;
    const int q0 = (gridDim.y - 1 - blockIdx.y) * BR;  // the longest walks first
    const int qw0 = q0 + warp * WARP_ROWS;
    const int row_lo = qw0 + g, row_hi = qw0 + g + 8;

    const long long k_stride = (long long)Hkv * DK, v_stride = (long long)Hkv * DV;
    const uint16_t *kg = p.k + ((long long)b * Tk * Hkv + hk) * DK;
    const uint16_t *vg = p.v + ((long long)b * Tk * Hkv + hk) * DV;
    load_rows_async<DK>(sQ, p.q + ((long long)b * T * H + h) * DK, (long long)H * DK, q0, BR, T, tid, NT);
    load_rows_async<DV>(sO, p.d_o + ((long long)b * T * H + h) * DV, (long long)H * DV, q0, BR, T, tid, NT);
    load_rows_async<DK>(sK, kg, k_stride, 0, BC, Tk, tid, NT);
    load_rows_async<DV>(sV, vg, v_stride, 0, BC, Tk, tid, NT);
    cp_async_commit();

    // this thread's two rows: lse in base 2 and D
    const float *lse = p.lse_in + ((long long)b * H + h) * T;
    const float *dl = p.delta + ((long long)b * H + h) * T;
    const float lse_lo = row_lo < T ? lse[row_lo] * LOG2E : 0.f;
    const float lse_hi = row_hi < T ? lse[row_hi] * LOG2E : 0.f;
    const float d_lo = row_lo < T ? dl[row_lo] : 0.f, d_hi = row_hi < T ? dl[row_hi] : 0.f;

    float dq[DK / 8][4];
#pragma unroll
    for (int j = 0; j < DK / 8; j++) dq[j][0] = dq[j][1] = dq[j][2] = dq[j][3] = 0.f;
    const float sl2 = p.scale_log2;
    const int kv_end = min(Tk, qoff + q0 + BR);
    const int ntiles = (kv_end + BC - 1) / BC;

    for (int n = 0; n < ntiles; n++) {
        const int k0 = n * BC;
        if (n + 1 < ntiles) {
            const int nb = (n + 1) & 1;
            load_rows_async<DK>(sK + nb * BC * LDK, kg, k_stride, k0 + BC, BC, Tk, tid, NT);
            load_rows_async<DV>(sV + nb * BC * LDV, vg, v_stride, k0 + BC, BC, Tk, tid, NT);
            cp_async_commit();
            cp_async_wait<1>();
        } else {
            cp_async_wait<0>();
        }
        __syncthreads();
        const uint16_t *tK = sK + (n & 1) * BC * LDK, *tV = sV + (n & 1) * BC * LDV;
        if (k0 <= qoff + qw0 + WARP_ROWS - 1 && qw0 < T) {
            // S = Q K^T and dP = dO V^T: 16 rows x BC keys
            float s[BC / 8][4], dp[BC / 8][4];
#pragma unroll
            for (int j = 0; j < BC / 8; j++) {
                s[j][0] = s[j][1] = s[j][2] = s[j][3] = 0.f;
                dp[j][0] = dp[j][1] = dp[j][2] = dp[j][3] = 0.f;
            }
#pragma unroll
            for (int kk = 0; kk < DK / 16; kk++) {
                uint32_t a[4];
                ldmatrix_x4(a, sQ + a_frag_offset(lane, warp * WARP_ROWS, kk * 16, LDK));
#pragma unroll
                for (int np = 0; np < BC / 16; np++) {
                    uint32_t bf[4];
                    ldmatrix_x4(bf, tK + bt_frag_offset(lane, np * 16, kk * 16, LDK));
                    mma_bf16(s[2 * np], a, bf[0], bf[1]);
                    mma_bf16(s[2 * np + 1], a, bf[2], bf[3]);
                }
            }
#pragma unroll
            for (int kk = 0; kk < DV / 16; kk++) {
                uint32_t a[4];
                ldmatrix_x4(a, sO + a_frag_offset(lane, warp * WARP_ROWS, kk * 16, LDV));
#pragma unroll
                for (int np = 0; np < BC / 16; np++) {
                    uint32_t bf[4];
                    ldmatrix_x4(bf, tV + bt_frag_offset(lane, np * 16, kk * 16, LDV));
                    mma_bf16(dp[2 * np], a, bf[0], bf[1]);
                    mma_bf16(dp[2 * np + 1], a, bf[2], bf[3]);
                }
            }
            // P (zero where key > qoff + row or key >= Tk) and dS = P (dP - D)
#pragma unroll
            for (int j = 0; j < BC / 8; j++) {
#pragma unroll
                for (int e = 0; e < 4; e++) {
                    const int key = k0 + j * 8 + 2 * c + (e & 1);
                    const int row = e < 2 ? row_lo : row_hi;
                    const float l2 = e < 2 ? lse_lo : lse_hi, dd = e < 2 ? d_lo : d_hi;
                    const float pr = (key <= qoff + row && key < Tk) ? exp2f(s[j][e] * sl2 - l2) : 0.f;
                    dp[j][e] = pr * (dp[j][e] - dd);
                }
            }
            // dQ += dS K (k = the tile's keys)
#pragma unroll
            for (int kk = 0; kk < BC / 16; kk++) {
                uint32_t a[4];
                a[0] = pack_bf16(dp[2 * kk][0], dp[2 * kk][1]);
                a[1] = pack_bf16(dp[2 * kk][2], dp[2 * kk][3]);
                a[2] = pack_bf16(dp[2 * kk + 1][0], dp[2 * kk + 1][1]);
                a[3] = pack_bf16(dp[2 * kk + 1][2], dp[2 * kk + 1][3]);
#pragma unroll
                for (int np = 0; np < DK / 16; np++) {
                    uint32_t bf[4];
                    ldmatrix_x4_trans(bf, tK + b_frag_offset(lane, kk * 16, np * 16, LDK));
                    mma_bf16(dq[2 * np], a, bf[0], bf[1]);
                    mma_bf16(dq[2 * np + 1], a, bf[2], bf[3]);
                }
            }
        }
        __syncthreads();  // the next iteration's loads overwrite this buffer
    }

    const float scale = p.scale;
#pragma unroll
    for (int j = 0; j < DK / 8; j++) {
        const int col = j * 8 + 2 * c;
        if (row_lo < T)
            *reinterpret_cast<uint32_t *>(p.dq + (((long long)b * T + row_lo) * H + h) * DK + col) =
                pack_bf16(dq[j][0] * scale, dq[j][1] * scale);
        if (row_hi < T)
            *reinterpret_cast<uint32_t *>(p.dq + (((long long)b * T + row_hi) * H + h) * DK + col) =
                pack_bf16(dq[j][2] * scale, dq[j][3] * scale);
    }
}

template <int DK, int DV>
size_t dkdv_smem_bytes() {
    const int BC = DKV_WARPS * WARP_ROWS, BR = dkv_query_tile(DK, DV);
    return (size_t)2 * (BC * smem_ld(DK) + BC * smem_ld(DV) + 2 * BR * smem_ld(DK) +
                        2 * BR * smem_ld(DV)) +
           (size_t)4 * 4 * BR;
}

template <int DK, int DV>
size_t dq_smem_bytes() {
    const int BR = DQ_WARPS * WARP_ROWS, BC = KEY_TILE;
    return (size_t)2 * (BR * smem_ld(DK) + BR * smem_ld(DV) + 2 * BC * smem_ld(DK) +
                        2 * BC * smem_ld(DV));
}

template <int DK, int DV>
cudaError_t launch_backward(const Params &p, cudaStream_t stream) {
    const long long rows = (long long)p.B * p.T * p.H;
    const int rows_per_block = 8;
    attention_delta_kernel<DV><<<(unsigned)((rows + rows_per_block - 1) / rows_per_block),
                                 rows_per_block * 32, 0, stream>>>(p);
    cudaError_t e = cudaGetLastError();
    if (e != cudaSuccess) return e;

    const size_t smem_kv = dkdv_smem_bytes<DK, DV>();
    e = cudaFuncSetAttribute(attention_dkdv_kernel<DK, DV>,
                             cudaFuncAttributeMaxDynamicSharedMemorySize, (int)smem_kv);
    if (e != cudaSuccess) return e;
    const int BC = DKV_WARPS * WARP_ROWS;
    dim3 grid_kv((unsigned)(p.B * p.Hkv), (unsigned)((p.Tk + BC - 1) / BC));
    attention_dkdv_kernel<DK, DV><<<grid_kv, DKV_WARPS * 32, smem_kv, stream>>>(p);
    e = cudaGetLastError();
    if (e != cudaSuccess) return e;

    const size_t smem_q = dq_smem_bytes<DK, DV>();
    e = cudaFuncSetAttribute(attention_dq_kernel<DK, DV>,
                             cudaFuncAttributeMaxDynamicSharedMemorySize, (int)smem_q);
    if (e != cudaSuccess) return e;
    const int BR = DQ_WARPS * WARP_ROWS;
    dim3 grid_q((unsigned)(p.B * p.H), (unsigned)((p.T + BR - 1) / BR));
    attention_dq_kernel<DK, DV><<<grid_q, DQ_WARPS * 32, smem_q, stream>>>(p);
    return cudaGetLastError();
}

cudaError_t backward_dispatch(const Params &p, int Dk, int Dv, cudaStream_t stream) {
#define LM_ATTN_BWD_CASE(A, B) \
    if (Dk == A && Dv == B) return launch_backward<A, B>(p, stream);
    LM_ATTN_BWD_CASE(32, 32) LM_ATTN_BWD_CASE(32, 64) LM_ATTN_BWD_CASE(32, 128)
    LM_ATTN_BWD_CASE(64, 32) LM_ATTN_BWD_CASE(64, 64) LM_ATTN_BWD_CASE(64, 128)
    LM_ATTN_BWD_CASE(128, 32) LM_ATTN_BWD_CASE(128, 64) LM_ATTN_BWD_CASE(128, 128)
#undef LM_ATTN_BWD_CASE
    return cudaErrorInvalidValue;
}

}  // namespace lmattn

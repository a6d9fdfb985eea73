// Causal flash attention forward (include/longmoe/attention_cuda.h).
//
// One block per (batch, query head, tile of 16 * FWD_WARPS query rows); each
// warp owns 16 rows. The block walks the key tiles of KEY_TILE keys from 0 up
// to its diagonal, K and V double-buffered in shared memory by cp.async. Per
// tile and warp: S = Q K^T (mma.sync, Q fragments held in registers), the causal
// mask where the tile crosses the diagonal or the end of the sequence, the
// online softmax in base 2 (running max m and sum l per row, fp32), and
// O += P V with P packed to bf16. At the end o = O / l and lse = (m + log2 l) ln 2.
#include <math.h>
#include <stdint.h>

#include "attention_common.cuh"

namespace lmattn {

template <int DK, int DV>
__global__ void __launch_bounds__(FWD_WARPS * 32)
    attention_forward_kernel(Params p) {
    constexpr int NT = FWD_WARPS * 32;
    constexpr int BR = FWD_WARPS * WARP_ROWS, BC = KEY_TILE;
    constexpr int LDK = smem_ld(DK), LDV = smem_ld(DV);
    extern __shared__ __align__(16) unsigned char smem_raw[];
    uint16_t *sQ = reinterpret_cast<uint16_t *>(smem_raw);  // [BR][LDK]
    uint16_t *sK = sQ + BR * LDK;                           // [2][BC][LDK]
    uint16_t *sV = sK + 2 * BC * LDK;                       // [2][BC][LDV]
    __shared__ float s_block_max[FWD_WARPS];

    const int tid = threadIdx.x, warp = tid >> 5, lane = tid & 31;
    const int g = lane >> 2, c = lane & 3;
    const int T = p.T, H = p.H, Hkv = p.Hkv, Tk = p.Tk, qoff = p.qoff;
    const int bh = blockIdx.x, b = bh / H, h = bh % H, hk = h / p.group;
    // the last query tiles (the most key tiles) are scheduled first
    const int q0 = (gridDim.y - 1 - blockIdx.y) * BR;
    const int qw0 = q0 + warp * WARP_ROWS;  // this warp's first row
    const int row_lo = qw0 + g, row_hi = qw0 + g + 8;

    const uint16_t *qg = p.q + ((long long)b * T * H + h) * DK;
    const uint16_t *kg = p.k + ((long long)b * Tk * Hkv + hk) * DK;
    const uint16_t *vg = p.v + ((long long)b * Tk * Hkv + hk) * DV;
    const long long q_stride = (long long)H * DK, k_stride = (long long)Hkv * DK,
                    v_stride = (long long)Hkv * DV;

    const int kv_end = min(Tk, qoff + q0 + BR);  // keys this block can see
    const int ntiles = (kv_end + BC - 1) / BC;

    load_rows_async<DK>(sQ, qg, q_stride, q0, BR, T, tid, NT);
    load_rows_async<DK>(sK, kg, k_stride, 0, BC, Tk, tid, NT);
    load_rows_async<DV>(sV, vg, v_stride, 0, BC, Tk, tid, NT);
    cp_async_commit();

    uint32_t qf[DK / 16][4];
    float acc[DV / 8][4];
#pragma unroll
    for (int j = 0; j < DV / 8; j++) acc[j][0] = acc[j][1] = acc[j][2] = acc[j][3] = 0.f;
    float m_lo = -INFINITY, m_hi = -INFINITY;  // running max of the base-2 scores
    float l_lo = 0.f, l_hi = 0.f;              // running sums (this thread's columns)
    const float sl2 = p.scale_log2;

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
        if (n == 0) {
#pragma unroll
            for (int kk = 0; kk < DK / 16; kk++)
                ldmatrix_x4(qf[kk], sQ + a_frag_offset(lane, warp * WARP_ROWS, kk * 16, LDK));
        }
        const uint16_t *tK = sK + (n & 1) * BC * LDK;
        const uint16_t *tV = sV + (n & 1) * BC * LDV;
        // a warp whose rows all lie left of this tile (or past T) has nothing here
        if (k0 <= qoff + qw0 + WARP_ROWS - 1 && qw0 < T) {
            float s[BC / 8][4];
#pragma unroll
            for (int j = 0; j < BC / 8; j++) s[j][0] = s[j][1] = s[j][2] = s[j][3] = 0.f;
#pragma unroll
            for (int kk = 0; kk < DK / 16; kk++) {
#pragma unroll
                for (int np = 0; np < BC / 16; np++) {
                    uint32_t bf[4];
                    ldmatrix_x4(bf, tK + bt_frag_offset(lane, np * 16, kk * 16, LDK));
                    mma_bf16(s[2 * np], qf[kk], bf[0], bf[1]);
                    mma_bf16(s[2 * np + 1], qf[kk], bf[2], bf[3]);
                }
            }
            // scores in base 2; the causal mask (key > qoff + row) and keys >= Tk
            const bool edge = (k0 + BC - 1 > qoff + qw0) || (k0 + BC > Tk);
            float mx_lo = -INFINITY, mx_hi = -INFINITY;
#pragma unroll
            for (int j = 0; j < BC / 8; j++) {
#pragma unroll
                for (int e = 0; e < 4; e++) {
                    float x = s[j][e] * sl2;
                    if (edge) {
                        const int key = k0 + j * 8 + 2 * c + (e & 1);
                        const int row = e < 2 ? row_lo : row_hi;
                        if (key > qoff + row || key >= Tk) x = -INFINITY;
                    }
                    s[j][e] = x;
                }
                mx_lo = fmaxf(mx_lo, fmaxf(s[j][0], s[j][1]));
                mx_hi = fmaxf(mx_hi, fmaxf(s[j][2], s[j][3]));
            }
            // the four threads of a row (lanes 4g .. 4g+3) share its maximum
            mx_lo = fmaxf(mx_lo, __shfl_xor_sync(0xffffffffu, mx_lo, 1));
            mx_lo = fmaxf(mx_lo, __shfl_xor_sync(0xffffffffu, mx_lo, 2));
            mx_hi = fmaxf(mx_hi, __shfl_xor_sync(0xffffffffu, mx_hi, 1));
            mx_hi = fmaxf(mx_hi, __shfl_xor_sync(0xffffffffu, mx_hi, 2));
            const float mn_lo = fmaxf(m_lo, mx_lo), mn_hi = fmaxf(m_hi, mx_hi);
            // a row with no visible key yet keeps m = -inf: use 0 as its offset
            const float off_lo = mn_lo == -INFINITY ? 0.f : mn_lo;
            const float off_hi = mn_hi == -INFINITY ? 0.f : mn_hi;
            const float alpha_lo = exp2f(m_lo - off_lo), alpha_hi = exp2f(m_hi - off_hi);
            m_lo = mn_lo;
            m_hi = mn_hi;
            float sum_lo = 0.f, sum_hi = 0.f;
#pragma unroll
            for (int j = 0; j < BC / 8; j++) {
                s[j][0] = exp2f(s[j][0] - off_lo);
                s[j][1] = exp2f(s[j][1] - off_lo);
                s[j][2] = exp2f(s[j][2] - off_hi);
                s[j][3] = exp2f(s[j][3] - off_hi);
                sum_lo += s[j][0] + s[j][1];
                sum_hi += s[j][2] + s[j][3];
            }
            l_lo = l_lo * alpha_lo + sum_lo;
            l_hi = l_hi * alpha_hi + sum_hi;
#pragma unroll
            for (int j = 0; j < DV / 8; j++) {
                acc[j][0] *= alpha_lo;
                acc[j][1] *= alpha_lo;
                acc[j][2] *= alpha_hi;
                acc[j][3] *= alpha_hi;
            }
            // O += P V: P's accumulator pairs are the A operand (see attention_common.cuh)
#pragma unroll
            for (int kk = 0; kk < BC / 16; kk++) {
                uint32_t a[4];
                a[0] = pack_bf16(s[2 * kk][0], s[2 * kk][1]);
                a[1] = pack_bf16(s[2 * kk][2], s[2 * kk][3]);
                a[2] = pack_bf16(s[2 * kk + 1][0], s[2 * kk + 1][1]);
                a[3] = pack_bf16(s[2 * kk + 1][2], s[2 * kk + 1][3]);
#pragma unroll
                for (int np = 0; np < DV / 16; np++) {
                    uint32_t bf[4];
                    ldmatrix_x4_trans(bf, tV + b_frag_offset(lane, kk * 16, np * 16, LDV));
                    mma_bf16(acc[2 * np], a, bf[0], bf[1]);
                    mma_bf16(acc[2 * np + 1], a, bf[2], bf[3]);
                }
            }
        }
        __syncthreads();  // the next iteration's loads overwrite this buffer
    }

    // the row sums over the four threads of a row
    l_lo += __shfl_xor_sync(0xffffffffu, l_lo, 1);
    l_lo += __shfl_xor_sync(0xffffffffu, l_lo, 2);
    l_hi += __shfl_xor_sync(0xffffffffu, l_hi, 1);
    l_hi += __shfl_xor_sync(0xffffffffu, l_hi, 2);
    const float inv_lo = l_lo > 0.f ? 1.f / l_lo : 0.f, inv_hi = l_hi > 0.f ? 1.f / l_hi : 0.f;
#pragma unroll
    for (int j = 0; j < DV / 8; j++) {
        const int col = j * 8 + 2 * c;
        if (row_lo < T)
            *reinterpret_cast<uint32_t *>(p.o_out + ((long long)(b * (long long)T + row_lo) * H + h) * DV + col) =
                pack_bf16(acc[j][0] * inv_lo, acc[j][1] * inv_lo);
        if (row_hi < T)
            *reinterpret_cast<uint32_t *>(p.o_out + ((long long)(b * (long long)T + row_hi) * H + h) * DV + col) =
                pack_bf16(acc[j][2] * inv_hi, acc[j][3] * inv_hi);
    }
    if (p.lse && c == 0) {
        float *lse_bh = p.lse + ((long long)b * H + h) * T;
        if (row_lo < T) lse_bh[row_lo] = (m_lo + log2f(l_lo)) * LN2;
        if (row_hi < T) lse_bh[row_hi] = (m_hi + log2f(l_hi)) * LN2;
    }
    if (p.head_max) {
        // the largest scaled score of the block's rows < T: m / log2(e)
        float mx = fmaxf(row_lo < T ? m_lo : -INFINITY, row_hi < T ? m_hi : -INFINITY) * LN2;
#pragma unroll
        for (int w = 16; w >= 1; w >>= 1) mx = fmaxf(mx, __shfl_xor_sync(0xffffffffu, mx, w));
        if (lane == 0) s_block_max[warp] = mx;
        __syncthreads();
        if (tid == 0) {
            float bm = s_block_max[0];
            for (int w = 1; w < FWD_WARPS; w++) bm = fmaxf(bm, s_block_max[w]);
            if (bm > -INFINITY) atomic_max_float(p.head_max + h, bm);
        }
    }
}

__global__ void fill_kernel(float *x, int n, float value) {
    const int i = blockIdx.x * blockDim.x + threadIdx.x;
    if (i < n) x[i] = value;
}

template <int DK, int DV>
size_t forward_smem_bytes() {
    const int BR = FWD_WARPS * WARP_ROWS, BC = KEY_TILE;
    return (size_t)2 * (BR * smem_ld(DK) + 2 * BC * smem_ld(DK) + 2 * BC * smem_ld(DV));
}

template <int DK, int DV>
cudaError_t launch_forward(const Params &p, cudaStream_t stream) {
    const size_t smem = forward_smem_bytes<DK, DV>();
    cudaError_t e = cudaFuncSetAttribute(attention_forward_kernel<DK, DV>,
                                         cudaFuncAttributeMaxDynamicSharedMemorySize, (int)smem);
    if (e != cudaSuccess) return e;
    const int BR = FWD_WARPS * WARP_ROWS;
    dim3 grid((unsigned)(p.B * p.H), (unsigned)((p.T + BR - 1) / BR));
    attention_forward_kernel<DK, DV><<<grid, FWD_WARPS * 32, smem, stream>>>(p);
    return cudaGetLastError();
}

cudaError_t forward_dispatch(const Params &p, int Dk, int Dv, cudaStream_t stream) {
    if (p.head_max) {
        fill_kernel<<<(p.H + 255) / 256, 256, 0, stream>>>(p.head_max, p.H, -INFINITY);
        cudaError_t e = cudaGetLastError();
        if (e != cudaSuccess) return e;
    }
#define LM_ATTN_FWD_CASE(A, B) \
    if (Dk == A && Dv == B) return launch_forward<A, B>(p, stream);
    LM_ATTN_FWD_CASE(32, 32) LM_ATTN_FWD_CASE(32, 64) LM_ATTN_FWD_CASE(32, 128)
    LM_ATTN_FWD_CASE(64, 32) LM_ATTN_FWD_CASE(64, 64) LM_ATTN_FWD_CASE(64, 128)
    LM_ATTN_FWD_CASE(128, 32) LM_ATTN_FWD_CASE(128, 64) LM_ATTN_FWD_CASE(128, 128)
#undef LM_ATTN_FWD_CASE
    return cudaErrorInvalidValue;
}

}  // namespace lmattn

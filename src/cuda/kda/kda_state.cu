// The sequential (inter-chunk) KDA kernels on Hopper: the forward state
// recurrence with the output, and the reverse recurrence of its gradient.
// One block per (value tile of VT columns, sequence*head); the value columns
// of the state are independent, so VT splits the sequential work across SMs.
// The next chunk's operands (w, qg, kd, aqk, the U or dO tile, e^{G_C}) are
// copied to shared memory with cp.async while the current chunk computes
// (two stages). SPEC §2 "Chunked form"; docs/cuda.md.
#include "kda_common.cuh"

namespace lmkda {

// Copy rows x cols bf16 (cols a multiple of 8) from global (row stride gs)
// into shared memory (row stride ld); rows >= nvalid become zeros.
template <int NT>
__device__ __forceinline__ void async_tile(bf16 *dst, int ld, const bf16 *src, size_t gs,
                                           int rows, int cols, int nvalid) {
    const int vpr = cols / 8;
    for (int idx = threadIdx.x; idx < rows * vpr; idx += NT) {
        int r = idx / vpr, c = (idx % vpr) * 8;
        bool ok = r < nvalid;
        cp_async16(dst + r * ld + c, src + (ok ? (size_t)r * gs + c : 0), ok);
    }
}
template <int NT> __device__ __forceinline__ void async_f32(float *dst, const float *src, int n) {
    for (int idx = threadIdx.x; idx < n / 4; idx += NT) cp_async16(dst + 4 * idx, src + 4 * idx, true);
}

// Shared-memory plan of both state kernels (element counts per buffer).
template <int D, int VT> struct StatePlan {
    static constexpr int LD = D + 8, LDA = CH + 8, LDS = VT + 4, LDB = VT + 8;
    static constexpr size_t S = (size_t)D * LDS * 4, Sb = (size_t)D * LDB * 2;
    static constexpr size_t Vn = (size_t)CH * LDS * 4, Vnb = (size_t)CH * LDB * 2;
    // one stage: three [64][LD] operands, aqk [64][LDA], one [64][LDB] tile, e^{G_C}
    static constexpr size_t stage = (size_t)3 * CH * LD * 2 + (size_t)CH * LDA * 2 +
                                    (size_t)CH * LDB * 2 + (size_t)D * 4;
    static constexpr size_t total = S + Sb + Vn + Vnb + 2 * stage;
};

template <int D, int VT> struct StageView {
    bf16 *a, *b, *c, *aqk, *tile;
    float *ge;
    __device__ StageView(unsigned char *base) {
        using P = StatePlan<D, VT>;
        a = reinterpret_cast<bf16 *>(base);
        b = a + CH * P::LD;
        c = b + CH * P::LD;
        aqk = c + CH * P::LD;
        tile = aqk + CH * P::LDA;
        ge = reinterpret_cast<float *>(tile + CH * P::LDB);
    }
};

// Forward: V' = U - W S; O = scale (Qg S + Aqk V'); S = e^{G_C} S + Kd^T V'.
// SAVE: also store S at each chunk start (h) and V' (vn) for the backward.
template <int D, int VT, int NW, bool SAVE>
__global__ void __launch_bounds__(NW * 32, 1) kda_fwd_state_kernel(Params p) {
    // S [D][VT] fp32 in shared memory; w, qg, kd, u [c][64][D]; aqk [c][64][64]
    using P = StatePlan<D, VT>;
    constexpr int NT = NW * 32, TJ = VT / 16, TPW = 4 * TJ / NW;
    constexpr int LD = P::LD, LDA = P::LDA, LDS = P::LDS, LDB = P::LDB;
    extern __shared__ __align__(128) unsigned char smem[];
    float *sS = reinterpret_cast<float *>(smem);
    bf16 *sSb = reinterpret_cast<bf16 *>(smem + P::S);
    float *sVn = reinterpret_cast<float *>(smem + P::S + P::Sb);
    bf16 *sVnb = reinterpret_cast<bf16 *>(smem + P::S + P::Sb + P::Vn);
    unsigned char *stage0 = smem + P::S + P::Sb + P::Vn + P::Vnb;
    const int v0 = blockIdx.x * VT, bh = blockIdx.y, b = bh / p.H, h = bh % p.H;
    const int tid = threadIdx.x, warp = tid >> 5;
    const size_t rs = (size_t)p.H * D;

    auto issue = [&](int n) {
        StageView<D, VT> st(stage0 + (n & 1) * P::stage);
        const size_t c = (size_t)bh * p.N + n;
        async_tile<NT>(st.a, LD, p.w + c * CH * D, D, CH, D, CH);
        async_tile<NT>(st.b, LD, p.qg + c * CH * D, D, CH, D, CH);
        async_tile<NT>(st.c, LD, p.kd + c * CH * D, D, CH, D, CH);
        async_tile<NT>(st.aqk, LDA, p.aqk + c * CH * CH, CH, CH, CH, CH);
        async_tile<NT>(st.tile, LDB, p.u + c * CH * D + v0, D, CH, VT, CH);
        async_f32<NT>(st.ge, p.gexp + c * D, D);
        cp_async_commit();
    };
    issue(0);
    for (int idx = tid; idx < D * VT; idx += NT) {
        int d = idx / VT, j = idx % VT;
        sS[d * LDS + j] = p.h0 ? p.h0[((size_t)bh * D + d) * D + v0 + j] : 0.f;
    }
    for (int n = 0; n < p.N; n++) {
        const size_t c = (size_t)bh * p.N + n;
        const int t0 = n * CH, nvalid = min(CH, p.T - t0);
        if (n + 1 < p.N) {
            issue(n + 1);
            cp_async_wait<1>();
        } else {
            cp_async_wait<0>();
        }
        __syncthreads(); // chunk n's stage has landed; S is up to date
        StageView<D, VT> st(stage0 + (n & 1) * P::stage);
        for (int idx = tid; idx < D * VT; idx += NT) {
            int d = idx / VT, j = idx % VT;
            bf16 sb = __float2bfloat16(sS[d * LDS + j]);
            sSb[d * LDB + j] = sb;
            if (SAVE) p.h[c * D * D + (size_t)d * D + v0 + j] = sb;
        }
        __syncthreads();

        // W S into staging; Qg S kept in registers
        FragC accO[TPW];
#pragma unroll
        for (int q = 0; q < TPW; q++) {
            int tv = warp + NW * q, i0 = (tv / TJ) * 16, j0 = (tv % TJ) * 16;
            FragC accW;
            wmma::fill_fragment(accW, 0.f);
            mma_tile<RM, RM>(accW, st.a + i0 * LD, LD, sSb + j0, LDB, D / 16);
            wmma::store_matrix_sync(sVn + i0 * LDS + j0, accW, LDS, wmma::mem_row_major);
            wmma::fill_fragment(accO[q], 0.f);
            mma_tile<RM, RM>(accO[q], st.b + i0 * LD, LD, sSb + j0, LDB, D / 16);
        }
        __syncthreads();

        // V' = U - W S (values not yet explained by the state); S = e^{G_C} S
        for (int idx = tid; idx < CH * VT; idx += NT) {
            int i = idx / VT, j = idx % VT;
            bf16 vb = __float2bfloat16(__bfloat162float(st.tile[i * LDB + j]) - sVn[i * LDS + j]);
            sVnb[i * LDB + j] = vb;
            if (SAVE) p.vn[c * CH * D + (size_t)i * D + v0 + j] = vb;
        }
        for (int idx = tid; idx < D * VT; idx += NT) {
            int d = idx / VT, j = idx % VT;
            sS[d * LDS + j] *= st.ge[d];
        }
        __syncthreads();

        // O = scale (Qg S + Aqk V')
#pragma unroll
        for (int q = 0; q < TPW; q++) {
            int tv = warp + NW * q, i0 = (tv / TJ) * 16, j0 = (tv % TJ) * 16;
            mma_tile<RM, RM>(accO[q], st.aqk + i0 * LDA, LDA, sVnb + j0, LDB, CH / 16);
            if (p.o) {
                wmma::store_matrix_sync(sVn + i0 * LDS + j0, accO[q], LDS, wmma::mem_row_major);
                __syncwarp();
                bf16 *dst = p.o + ((size_t)b * p.T + t0 + i0) * rs + (size_t)h * D + v0 + j0;
                store_tile_bf16(dst, rs, sVn + i0 * LDS + j0, LDS, nvalid - i0, p.scale);
            }
        }
        // S += (K e^{G_C - G})^T V'
        for (int ts = warp; ts < (D / 16) * TJ; ts += NW) {
            int d0 = (ts / TJ) * 16, j0 = (ts % TJ) * 16;
            FragC accS;
            wmma::load_matrix_sync(accS, sS + d0 * LDS + j0, LDS, wmma::mem_row_major);
            mma_tile<CM, RM>(accS, st.c + d0, LD, sVnb + j0, LDB, CH / 16);
            wmma::store_matrix_sync(sS + d0 * LDS + j0, accS, LDS, wmma::mem_row_major);
        }
        __syncthreads(); // stage n & 1 is free for chunk n + 2
    }
    if (p.ht)
        for (int idx = tid; idx < D * VT; idx += NT) {
            int d = idx / VT, j = idx % VT;
            p.ht[((size_t)bh * D + d) * D + v0 + j] = sS[d * LDS + j];
        }
}

// Backward, chunks in reverse. With dS the gradient of the chunk's outgoing
// state and dO the output gradient:
//   dV' = Kd dS + scale Aqk^T dO
//   dS_in = e^{G_C} dS + scale Qg^T dO - W^T dV'
// Stores dS per chunk (dh), dV' (dvn) and the gradient of h0.
template <int D, int VT, int NW>
__global__ void __launch_bounds__(NW * 32, 1) kda_bwd_state_kernel(Params p) {
    // dS [D][VT] fp32 in shared memory; d_o [B,T,H,D]
    using P = StatePlan<D, VT>;
    constexpr int NT = NW * 32, TJ = VT / 16, TPW = 4 * TJ / NW;
    constexpr int LD = P::LD, LDA = P::LDA, LDS = P::LDS, LDB = P::LDB;
    extern __shared__ __align__(128) unsigned char smem[];
    float *sdS = reinterpret_cast<float *>(smem);
    bf16 *sdSb = reinterpret_cast<bf16 *>(smem + P::S);
    float *sdVn = reinterpret_cast<float *>(smem + P::S + P::Sb);
    bf16 *sdVnb = reinterpret_cast<bf16 *>(smem + P::S + P::Sb + P::Vn);
    unsigned char *stage0 = smem + P::S + P::Sb + P::Vn + P::Vnb;
    const int v0 = blockIdx.x * VT, bh = blockIdx.y, b = bh / p.H, h = bh % p.H;
    const int tid = threadIdx.x, warp = tid >> 5;
    const size_t rs = (size_t)p.H * D;

    auto issue = [&](int n) {
        StageView<D, VT> st(stage0 + (n & 1) * P::stage);
        const size_t c = (size_t)bh * p.N + n;
        const int t0 = n * CH, nvalid = min(CH, p.T - t0);
        async_tile<NT>(st.a, LD, p.w + c * CH * D, D, CH, D, CH);
        async_tile<NT>(st.b, LD, p.qg + c * CH * D, D, CH, D, CH);
        async_tile<NT>(st.c, LD, p.kd + c * CH * D, D, CH, D, CH);
        async_tile<NT>(st.aqk, LDA, p.aqk + c * CH * CH, CH, CH, CH, CH);
        async_tile<NT>(st.tile, LDB, p.d_o + ((size_t)b * p.T + t0) * rs + (size_t)h * D + v0, rs,
                       CH, VT, nvalid);
        async_f32<NT>(st.ge, p.gexp + c * D, D);
        cp_async_commit();
    };
    issue(p.N - 1);
    for (int idx = tid; idx < D * VT; idx += NT) {
        int d = idx / VT, j = idx % VT;
        sdS[d * LDS + j] = p.dht ? p.dht[((size_t)bh * D + d) * D + v0 + j] : 0.f;
    }
    for (int n = p.N - 1; n >= 0; n--) {
        const size_t c = (size_t)bh * p.N + n;
        if (n > 0) {
            issue(n - 1);
            cp_async_wait<1>();
        } else {
            cp_async_wait<0>();
        }
        __syncthreads();
        StageView<D, VT> st(stage0 + (n & 1) * P::stage);
        for (int idx = tid; idx < D * VT; idx += NT) {
            int d = idx / VT, j = idx % VT;
            bf16 sb = __float2bfloat16(sdS[d * LDS + j]);
            sdSb[d * LDB + j] = sb;
            p.dh[c * D * D + (size_t)d * D + v0 + j] = sb;
        }
        __syncthreads();

        // dV' = Kd dS + scale Aqk^T dO
#pragma unroll
        for (int q = 0; q < TPW; q++) {
            int tv = warp + NW * q, i0 = (tv / TJ) * 16, j0 = (tv % TJ) * 16;
            FragC acc, acc2;
            wmma::fill_fragment(acc, 0.f);
            mma_tile<RM, RM>(acc, st.c + i0 * LD, LD, sdSb + j0, LDB, D / 16);
            wmma::fill_fragment(acc2, 0.f);
            mma_tile<CM, RM>(acc2, st.aqk + i0, LDA, st.tile + j0, LDB, CH / 16);
#pragma unroll
            for (int e = 0; e < acc.num_elements; e++) acc.x[e] += p.scale * acc2.x[e];
            wmma::store_matrix_sync(sdVn + i0 * LDS + j0, acc, LDS, wmma::mem_row_major);
        }
        __syncthreads();
        for (int idx = tid; idx < CH * VT; idx += NT) {
            int i = idx / VT, j = idx % VT;
            bf16 vb = __float2bfloat16(sdVn[i * LDS + j]);
            sdVnb[i * LDB + j] = vb;
            p.dvn[c * CH * D + (size_t)i * D + v0 + j] = vb;
        }
        for (int idx = tid; idx < D * VT; idx += NT) {
            int d = idx / VT, j = idx % VT;
            sdS[d * LDS + j] *= st.ge[d];
        }
        __syncthreads();

        // dS_in = e^{G_C} dS + scale Qg^T dO - W^T dV'
        for (int ts = warp; ts < (D / 16) * TJ; ts += NW) {
            int d0 = (ts / TJ) * 16, j0 = (ts % TJ) * 16;
            FragC acc, accQ, accW;
            wmma::load_matrix_sync(acc, sdS + d0 * LDS + j0, LDS, wmma::mem_row_major);
            wmma::fill_fragment(accQ, 0.f);
            mma_tile<CM, RM>(accQ, st.b + d0, LD, st.tile + j0, LDB, CH / 16);
            wmma::fill_fragment(accW, 0.f);
            mma_tile<CM, RM>(accW, st.a + d0, LD, sdVnb + j0, LDB, CH / 16);
#pragma unroll
            for (int e = 0; e < acc.num_elements; e++)
                acc.x[e] += p.scale * accQ.x[e] - accW.x[e];
            wmma::store_matrix_sync(sdS + d0 * LDS + j0, acc, LDS, wmma::mem_row_major);
        }
        __syncthreads();
    }
    if (p.dh0)
        for (int idx = tid; idx < D * VT; idx += NT) {
            int d = idx / VT, j = idx % VT;
            p.dh0[((size_t)bh * D + d) * D + v0 + j] = sdS[d * LDS + j];
        }
}

// Value-tile width: the narrowest of 16, 32, 64 whose blocks still fit in one
// wave on the device (one block per SM: the two stages fill shared memory);
// 64 when even that needs several waves. Narrow tiles shorten each chunk's
// step on the sequential path when there are few sequences and heads.
int state_tile_width(int BH, int D) {
    int dev = 0, sms = 132;
    if (cudaGetDevice(&dev) == cudaSuccess)
        cudaDeviceGetAttribute(&sms, cudaDevAttrMultiProcessorCount, dev);
    for (int vt = 16; vt <= 64 && vt <= D; vt *= 2)
        if ((long long)BH * (D / vt) <= sms) return vt;
    return 64;
}

template <int D, int VT>
static cudaError_t launch_state(const Params &p, bool backward, bool save, cudaStream_t s) {
    constexpr int NW = VT == 64 ? 8 : 4;
    dim3 grid(D / VT, p.B * p.H);
    size_t sm = StatePlan<D, VT>::total;
    if (backward) return launch_with_smem(kda_bwd_state_kernel<D, VT, NW>, grid, NW * 32, sm, s, p);
    if (save)
        return launch_with_smem(kda_fwd_state_kernel<D, VT, NW, true>, grid, NW * 32, sm, s, p);
    return launch_with_smem(kda_fwd_state_kernel<D, VT, NW, false>, grid, NW * 32, sm, s, p);
}

static cudaError_t launch_state_any(const Params &p, int D, bool backward, bool save,
                                    cudaStream_t s) {
    int vt = state_tile_width(p.B * p.H, D);
    if (D == 128) {
        if (vt == 16) return launch_state<128, 16>(p, backward, save, s);
        if (vt == 32) return launch_state<128, 32>(p, backward, save, s);
        return launch_state<128, 64>(p, backward, save, s);
    }
    if (vt == 16) return launch_state<64, 16>(p, backward, save, s);
    if (vt == 32) return launch_state<64, 32>(p, backward, save, s);
    return launch_state<64, 64>(p, backward, save, s);
}

cudaError_t launch_fwd_state(const Params &p, int D, bool save, cudaStream_t s) {
    return launch_state_any(p, D, false, save, s);
}

cudaError_t launch_bwd_state(const Params &p, int D, cudaStream_t s) {
    return launch_state_any(p, D, true, false, s);
}

} // namespace lmkda

// The sequential (inter-chunk) KDA kernels on Hopper: the forward state
// recurrence with the output, and the reverse recurrence of its gradient.
// One block per (value tile of VT columns, sequence*head); the value columns
// of the state are independent, so VT splits the sequential work across SMs.
// Two kinds: column kernels for VT = 64, 128 (a warp holds all channels of 16
// value columns) and row kernels for VT = 16, 32 (several warps share 16
// value columns, splitting the chunk's rows for the products over channels
// and the channels for the update). The next chunk's operands (w, qg, kd,
// aqk, the U or dO tile, e^{G_C}) are copied to shared memory with cp.async
// while the current chunk computes (two stages). SPEC §2 "Chunked form";
// docs/cuda.md.
#include <stdio.h>
#include <stdlib.h>

#include "kda_common.cuh"

namespace lmkda {

// Copy a ROWS x COLS bf16 tile (COLS a multiple of 8) from global (row stride
// GS elements) into shared memory (row stride LDS) with 16-byte cp.async.
// Every extent is a compile-time constant, so each thread keeps one column and
// its rows step by a constant: the addresses are computed once and the copies
// take immediate offsets (threads beyond the tile's vectors idle).
template <int NT, int ROWS, int COLS, int LDS, int GS>
__device__ __forceinline__ void async_tile(bf16 *dst, const bf16 *src) {
    constexpr int VPR = COLS / 8, RSTEP = NT / VPR, K = (ROWS + RSTEP - 1) / RSTEP;
    static_assert(NT % VPR == 0, "async_tile: thread layout");
    const int r = threadIdx.x / VPR, col = (threadIdx.x % VPR) * 8;
    const unsigned s = smem_addr(dst + r * LDS + col);
    const bf16 *g = src + (size_t)r * GS + col;
#pragma unroll
    for (int k = 0; k < K; k++)
        if (ROWS % RSTEP == 0 || r + k * RSTEP < ROWS)
            asm volatile("cp.async.cg.shared.global [%0], [%1], 16;\n" ::"r"(
                             s + k * RSTEP * LDS * 2),
                         "l"(g + (size_t)k * RSTEP * GS));
}
// The same with a run-time global row stride; rows >= nvalid become zeros.
// TOFF: the threads' numbering starts at thread TOFF (mod NT), so that a copy
// of fewer vectors than threads can be left to the block's last warps.
template <int NT, int ROWS, int COLS, int LDS, int TOFF = 0>
__device__ __forceinline__ void async_tile_rows(bf16 *dst, const bf16 *src, size_t gs, int nvalid) {
    constexpr int VPR = COLS / 8, RSTEP = NT / VPR, K = (ROWS + RSTEP - 1) / RSTEP;
    static_assert(NT % VPR == 0, "async_tile_rows: thread layout");
    const unsigned ti = TOFF == 0 ? threadIdx.x : (threadIdx.x + TOFF) % NT;
    const int r = ti / VPR, col = (ti % VPR) * 8;
    const unsigned s = smem_addr(dst + r * LDS + col);
    const bf16 *g = src + (size_t)r * gs + col;
    const size_t gstep = (size_t)RSTEP * gs;
#pragma unroll
    for (int k = 0; k < K; k++) {
        if (ROWS % RSTEP != 0 && r + k * RSTEP >= ROWS) continue;
        const bool ok = r + k * RSTEP < nvalid;
        asm volatile("cp.async.cg.shared.global [%0], [%1], 16, %2;\n" ::"r"(
                         s + k * RSTEP * LDS * 2),
                     "l"(ok ? g + k * gstep : src), "r"(ok ? 16 : 0));
    }
}

// Shared-memory layout of a stage, common to both kinds of state kernel:
// w, qg, kd [64][LD], aqk [64][LDA], the U or dO tile [64][LDB], e^{G_C}; the
// precise forward (PREC) adds w_lo [64][LD] and the u_lo tile [64][LDB].
template <int D, int VT, bool PREC = false> struct StageLayout {
    static constexpr int LD = wld<D>(), LDA = ALD, LDB = VT + 8; // the workspace's rows
    static constexpr size_t stage = (size_t)3 * CH * LD * 2 + (size_t)CH * LDA * 2 +
                                    (size_t)CH * LDB * 2 + (size_t)D * 4 +
                                    (PREC ? (size_t)CH * LD * 2 + (size_t)CH * LDB * 2 : 0);
    // a bf16 state [D][LDB] and a chunk tile [64][LDB]
    static constexpr size_t sh = (size_t)D * LDB * 2, sv = (size_t)CH * LDB * 2;
    // the stages' two mbarriers, the last 16 bytes of every plan's shared memory
    static constexpr size_t bars = 16;
    // bytes of a stage that the bulk-copy unit brings: w, qg, kd, aqk, e^{G_C}
    static constexpr unsigned bulk_bytes = 3u * CH * LD * 2 + (unsigned)CH * LDA * 2 + D * 4;
};

// Column kernels (VT = 64 and 128): one warp per 16 value columns holds all D
// channels of its rows of S^T in registers (JG = VT/16 warps: 4 or 8).
// Shared memory: two stages, the output staging (h or dh [D][LDB], V' or dV'
// [64][LDB], O [64][LDB]); the precise forward (PREC) has no h or V' staging
// (it does not save them) but kd_lo [64][LD], one buffer (loaded at the
// chunk's start, used at its end).
template <int D, int VT, bool PREC = false> struct ColPlan : StageLayout<D, VT, PREC> {
    using L = StageLayout<D, VT, PREC>;
    static constexpr int JG = VT / 16, NW = JG;
    static constexpr size_t total =
        2 * L::stage + (PREC ? L::sv + (size_t)CH * L::LD * 2 : L::sh + 2 * L::sv) + L::bars;
};

// Row kernels (VT = 16 and 32): the block's VT value columns form JG = VT/16
// groups (the 16 rows of an mma A operand of the transposed state), and DS
// warps share a group (8 for VT = 16, 4 for VT = 32; at most D/16: 2 for
// D = 32, which runs the row kernels only). For the
// products over channels (S^T W^T, S^T Qg^T, dS^T Kd^T) they split the
// chunk's 64 rows, RW = 64/DS each, and read the group's whole bf16 state from
// shared memory; for the state update they split the D channels, DW = D/DS
// each, which they hold in registers. Shared memory: two stages, O [64][LDB]
// (forward), the bf16 state [D][LDB] (also the staging of h or dh) and V' or
// dV' [64][LDB] (each warp's rows for the others, also the staging of vn or
// dvn); PREC adds kd_lo [64][LD] and the residues of the state and of V'.
template <int D, int VT, bool PREC = false> struct RowPlan : StageLayout<D, VT, PREC> {
    using L = StageLayout<D, VT, PREC>;
    static_assert(VT == 16 || VT == 32, "row kernels: VT 16 or 32");
    static constexpr int JG = VT / 16, want = VT == 16 ? 8 : 4;
    static constexpr int DS = want < D / 16 ? want : D / 16; // DW >= 16: pairs of channel tiles
    static constexpr int NW = JG * DS, RW = CH / DS, NRT = RW / 8, DW = D / DS, NDT = DW / 8;
    // D = 32: DS = 2 warps a group (RW = 32 rows, DW = 16 channels each)
    static_assert(DS * DW == D && DW % 16 == 0 && DS * RW == CH && RW % 8 == 0,
                  "row kernels: whole channel tile pairs and row tiles a warp");
    static constexpr size_t total = 2 * L::stage + 2 * L::sv + L::sh +
                                    (PREC ? (size_t)CH * L::LD * 2 + L::sh + L::sv : 0) + L::bars;
};

template <int D, int VT> struct StageView {
    bf16 *a, *b, *c, *aqk, *tile, *a_lo, *tile_lo;
    float *ge;
    __device__ StageView(unsigned char *base) {
        using P = StageLayout<D, VT>;
        a = reinterpret_cast<bf16 *>(base);
        b = a + CH * P::LD;
        c = b + CH * P::LD;
        aqk = c + CH * P::LD;
        tile = aqk + CH * P::LDA;
        ge = reinterpret_cast<float *>(tile + CH * P::LDB);
        a_lo = reinterpret_cast<bf16 *>(ge + D); // PREC only: w_lo, then the u_lo tile
        tile_lo = a_lo + CH * P::LD;
    }
};

// Copy ROWS staged rows of VT bf16 (row stride LDB) to global rows (stride
// gs), rows < nvalid; each thread keeps one 16-byte column.
template <int VT, int NT, int ROWS, int LDB, int TOFF = 0>
__device__ __forceinline__ void store_rows(bf16 *dst, size_t gs, const bf16 *src, int nvalid) {
    constexpr int VPR = VT / 8, RSTEP = NT / VPR, K = (ROWS + RSTEP - 1) / RSTEP;
    static_assert(NT % VPR == 0, "store_rows: thread layout");
    const unsigned ti = TOFF == 0 ? threadIdx.x : (threadIdx.x + TOFF) % NT;
    const int r = ti / VPR, col = (ti % VPR) * 8;
    const bf16 *s = src + r * LDB + col;
    bf16 *g = dst + (size_t)r * gs + col;
#pragma unroll
    for (int k = 0; k < K; k++)
        if (r + k * RSTEP < nvalid && (ROWS % RSTEP == 0 || r + k * RSTEP < ROWS))
            *reinterpret_cast<uint4 *>(g + (size_t)k * RSTEP * gs) =
                *reinterpret_cast<const uint4 *>(s + k * RSTEP * LDB);
}

// Transposed C tiles <-> shared memory. A warp's C tiles of a transposed
// product cover its group's 16 value columns (j) and 8 chunk rows or channels
// (i) each; stored transposed, [i][j] with row stride LDB, they are what the
// other warps load as A fragments (ldmatrix.trans). NT8 tiles from row i0.
template <int NT8, int LDB>
__device__ __forceinline__ void store_ct(bf16 *base, int i0, int jg, int lane, const float (*c)[4],
                                         float scale = 1.f) {
    const int lm = lane >> 3, lr = lane & 7;
#pragma unroll
    for (int t = 0; t + 1 < NT8; t += 2) {
        unsigned a[4];
        a[0] = pack_bf16x2(scale * c[t][0], scale * c[t][1]);
        a[1] = pack_bf16x2(scale * c[t][2], scale * c[t][3]);
        a[2] = pack_bf16x2(scale * c[t + 1][0], scale * c[t + 1][1]);
        a[3] = pack_bf16x2(scale * c[t + 1][2], scale * c[t + 1][3]);
        stsm_x4_t(base + (i0 + 8 * t + (lm >> 1) * 8 + lr) * LDB + jg * 16 + (lm & 1) * 8, a);
    }
    if (NT8 & 1) {
        const int t = NT8 - 1;
        stsm_x2_t(base + (i0 + 8 * t + lr) * LDB + jg * 16 + (lm & 1) * 8,
                  pack_bf16x2(scale * c[t][0], scale * c[t][1]),
                  pack_bf16x2(scale * c[t][2], scale * c[t][3]));
    }
}
// The same for the bf16 residues x - bf16(x) of the tiles (the precise path).
template <int NT8, int LDB>
__device__ __forceinline__ void store_ct_lo(bf16 *base, int i0, int jg, int lane,
                                            const float (*c)[4]) {
    float r[NT8][4];
#pragma unroll
    for (int t = 0; t < NT8; t++)
#pragma unroll
        for (int e = 0; e < 4; e++) r[t][e] = bf16_residue(c[t][e]);
    store_ct<NT8, LDB>(base, i0, jg, lane, r);
}
// The A fragment (16 j x 16 i, i from i0) of a transposed tile stored by store_ct.
template <int LDB>
__device__ __forceinline__ void load_at(unsigned a[4], const bf16 *base, int i0, int jg, int lane) {
    const int lm = lane >> 3, lr = lane & 7;
    ldsm_x4_t(a, base + (i0 + (lm >> 1) * 8 + lr) * LDB + jg * 16 + (lm & 1) * 8);
}
// B fragments of NT8 n-tiles (rows n0 .. n0 + 8 NT8 - 1 of a row-major [n][k]
// tile, row stride LD), k from k0: b[t][0..1].
template <int NT8, int LD>
__device__ __forceinline__ void load_b_rows(unsigned (*b)[2], const bf16 *base, int n0, int k0,
                                            int lane) {
    const int lm = lane >> 3, lr = lane & 7;
#pragma unroll
    for (int t = 0; t + 1 < NT8; t += 2) {
        unsigned r[4];
        ldsm_x4(r, base + (n0 + 8 * t + (lm >> 1) * 8 + lr) * LD + k0 + (lm & 1) * 8);
        b[t][0] = r[0];
        b[t][1] = r[1];
        b[t + 1][0] = r[2];
        b[t + 1][1] = r[3];
    }
    if (NT8 & 1) ldsm_x2(b[NT8 - 1], base + (n0 + 8 * (NT8 - 1) + lr) * LD + k0 + (lm & 1) * 8);
}

// Pieces common to the column and row kernels.

// The parts of chunk c's stage that are whole tiles in the workspace (w, qg,
// kd and aqk have the stage's padded rows; e^{G_C}): five bulk copies issued
// by thread 0, counted by the stage's barrier.
template <int D, int VT>
__device__ __forceinline__ void stage_bulk(const StageView<D, VT> &st, const Params &p, size_t c,
                                           unsigned long long *bar) {
    using L = StageLayout<D, VT>;
    constexpr unsigned TB = CH * L::LD * 2, AB = CH * L::LDA * 2;
    if (threadIdx.x == 0) {
        mbar_expect_tx(bar, L::bulk_bytes);
        bulk_g2s(st.a, p.w + c * CH * L::LD, TB, bar);
        bulk_g2s(st.b, p.qg + c * CH * L::LD, TB, bar);
        bulk_g2s(st.c, p.kd + c * CH * L::LD, TB, bar);
        bulk_g2s(st.aqk, p.aqk + c * CH * L::LDA, AB, bar);
        bulk_g2s(st.ge, p.gexp + c * D, D * 4, bar);
    }
}
// The stages' two mbarriers, in the last bytes of plan P's shared memory,
// initialised before any copy is issued (a block barrier follows).
template <typename P> __device__ __forceinline__ unsigned long long *stage_bars(unsigned char *smem) {
    unsigned long long *bars = reinterpret_cast<unsigned long long *>(smem + P::total - P::bars);
    if (threadIdx.x == 0) {
        mbar_init(&bars[0]);
        mbar_init(&bars[1]);
        mbar_init_fence();
    }
    __syncthreads();
    return bars;
}
// The start of forward chunk n (0 .. N-1): PREC copies chunk n's kd_lo into
// its one buffer, the next chunk's stage is issued, then chunk n's stage is
// awaited (its cp.async group, issued a chunk earlier, and its bulk copies,
// the (n/2)-th use of barrier n & 1) and the block meets. `issue(m)` issues
// chunk m's stage (one cp.async group and the bulk copies).
template <int NT, int D, bool PREC, typename Issue>
__device__ __forceinline__ void fwd_chunk_begin(int n, int N, Issue &issue,
                                                unsigned long long *bars, bf16 *sKdl,
                                                const bf16 *kd_lo) {
    if (PREC) { // used by the update at the chunk's end (its buffer is free)
        async_tile<NT, CH, D, wld<D>(), D>(sKdl, kd_lo);
        cp_async_commit();
    }
    if (n + 1 < N) {
        issue(n + 1);
        cp_async_wait<PREC ? 2 : 1>();
    } else {
        cp_async_wait<PREC ? 1 : 0>();
    }
    mbar_wait(&bars[n & 1], (n >> 1) & 1);
    __syncthreads();
}
// The forward's stage of chunk c: w, qg, kd, aqk and e^{G_C} by the bulk-copy
// unit (barrier `bar`), the U tile (PREC: and w_lo, the u_lo tile) as one
// cp.async group.
template <int NT, int D, int VT, bool PREC>
__device__ __forceinline__ void fwd_stage_copy(const StageView<D, VT> &st, const Params &p,
                                               size_t c, int v0, unsigned long long *bar) {
    constexpr int LDB = VT + 8;
    stage_bulk<D, VT>(st, p, c, bar);
    async_tile<NT, CH, VT, LDB, D>(st.tile, p.u + c * CH * D + v0);
    if (PREC) {
        constexpr int LD = StageLayout<D, VT>::LD;
        async_tile<NT, CH, D, LD, D>(st.a_lo, p.w_lo + c * CH * D);
        async_tile<NT, CH, VT, LDB, D>(st.tile_lo, p.u_lo + c * CH * D + v0);
    }
    cp_async_commit();
}
// The backward's stage of chunk n (index c): w, qg, kd, aqk and e^{G_C} by the
// bulk-copy unit (barrier `bar`), the dO tile (rows past T zero) as one
// cp.async group.
template <int NT, int D, int VT, int TOFF = 0>
__device__ __forceinline__ void bwd_stage_copy(const StageView<D, VT> &st, const Params &p,
                                               size_t c, int n, int b, int h, int v0, size_t rs,
                                               unsigned long long *bar) {
    constexpr int LDB = VT + 8;
    const int t0 = n * CH, nvalid = min(CH, p.T - t0);
    stage_bulk<D, VT>(st, p, c, bar);
    async_tile_rows<NT, CH, VT, LDB, TOFF>(
        st.tile, p.d_o + ((size_t)b * p.T + t0) * rs + (size_t)h * D + v0, rs, nvalid);
    cp_async_commit();
}
// A warp's state tiles (S^T C tiles: value columns jr, jr + 8; channels from
// d0) into an fp32 [D][D] state of sequence*head bh.
// ... and from the initial state h0 (GRAD = false) or the final state's
// gradient dht (GRAD = true), zeros without one.
template <int D, int NDT, bool GRAD>
__device__ __forceinline__ void state_load(float (*S)[4], const Params &p, int bh, int v0, int jr,
                                           int d0, int ic) {
#pragma unroll
    for (int t = 0; t < NDT; t++)
#pragma unroll
        for (int e = 0; e < 4; e++) {
            int j = jr + (e >> 1) * 8, d = d0 + 8 * t + ic + (e & 1);
            const float *x = GRAD ? p.dht : p.h0;
            S[t][e] = x ? x[((size_t)bh * D + d) * D + v0 + j] : 0.f;
        }
}
template <int D, int NDT>
__device__ __forceinline__ void state_store(const float (*S)[4], float *x, int bh, int v0, int jr,
                                            int d0, int ic) {
#pragma unroll
    for (int t = 0; t < NDT; t++)
#pragma unroll
        for (int e = 0; e < 4; e++) {
            int j = jr + (e >> 1) * 8, d = d0 + 8 * t + ic + (e & 1);
            x[((size_t)bh * D + d) * D + v0 + j] = S[t][e];
        }
}
// V'^T = U^T - S^T W^T on NT8 row tiles from chunk row i0 (pv holds S^T W^T;
// PREC: U = u + u_lo).
template <int NT8, int LDB, bool PREC, typename SV>
__device__ __forceinline__ void vprime(float (*pv)[4], const SV &st, int i0, int jr, int ic) {
#pragma unroll
    for (int t = 0; t < NT8; t++)
#pragma unroll
        for (int e = 0; e < 4; e++) {
            int i = i0 + 8 * t + ic + (e & 1), j = jr + (e >> 1) * 8;
            float u = __bfloat162float(st.tile[i * LDB + j]);
            if (PREC) u += __bfloat162float(st.tile_lo[i * LDB + j]);
            pv[t][e] = u - pv[t][e];
        }
}
// O^T += V'^T Aqk^T on NT8 row tiles from chunk row i0 (Aqk is lower triangular).
template <int NT8, int LDA>
__device__ __forceinline__ void o_aqk(float (*o)[4], const unsigned (*aV)[4], const bf16 *aqk,
                                      int i0, int lm, int lr) {
#pragma unroll
    for (int t = 0; t < NT8; t++) {
        const int nt = i0 / 8 + t;
#pragma unroll
        for (int s = 0; s < 4; s++) {
            if (16 * s > 8 * nt + 7) continue;
            unsigned bb[2];
            ldsm_x2(bb, aqk + (8 * nt + lr) * LDA + 16 * s + (lm & 1) * 8);
            mma16816(o[t], aV[s], bb[0], bb[1]);
        }
    }
}
// S^T <- S^T Diag(e^{G_C}) + V'^T Kd on the warp's channels from d0; PREC
// adds lo(V') hi(Kd) + hi(V') lo(Kd) once kd_lo has landed (the next stage
// may still be in flight: `more`).
template <int NDT, int LD, bool PREC>
__device__ __forceinline__ void fwd_update(float (*S)[4], const unsigned (*aV)[4],
                                           const unsigned (*aL)[4], const bf16 *kd,
                                           const bf16 *kd_lo, const float *ge, int d0, int ic,
                                           int lm, int lr, bool more) {
    if (PREC) {
        if (more)
            cp_async_wait<1>();
        else
            cp_async_wait<0>();
        __syncthreads();
    }
#pragma unroll
    for (int t = 0; t < NDT; t++) {
        const float g0 = ge[d0 + 8 * t + ic], g1 = ge[d0 + 8 * t + ic + 1];
        S[t][0] *= g0;
        S[t][1] *= g1;
        S[t][2] *= g0;
        S[t][3] *= g1;
    }
#pragma unroll
    for (int s = 0; s < 4; s++)
#pragma unroll
        for (int tp = 0; tp < NDT / 2; tp++) {
            unsigned bk[4];
            const int off = (16 * s + (lm & 1) * 8 + lr) * LD + d0 + 16 * tp + (lm >> 1) * 8;
            ldsm_x4_t(bk, kd + off);
            if (PREC) {
                unsigned bl[4];
                ldsm_x4_t(bl, kd_lo + off);
                const unsigned *al = aL[PREC ? s : 0];
                mma16816(S[2 * tp], al, bk[0], bk[1]);
                mma16816(S[2 * tp + 1], al, bk[2], bk[3]);
                mma16816(S[2 * tp], aV[s], bl[0], bl[1]);
                mma16816(S[2 * tp + 1], aV[s], bl[2], bl[3]);
            }
            mma16816(S[2 * tp], aV[s], bk[0], bk[1]);
            mma16816(S[2 * tp + 1], aV[s], bk[2], bk[3]);
        }
}
// dS^T <- dS^T Diag(e^{G_C}) + scale dO^T Qg - dV'^T W on the warp's channels
// from d0, two channel tiles at a time.
template <int NDT, int LD>
__device__ __forceinline__ void bwd_update(float (*dS)[4], const unsigned (*aO)[4],
                                           const unsigned (*aV)[4], const bf16 *qg,
                                           const bf16 *w, const float *ge, float scale, int d0,
                                           int ic, int lm, int lr) {
#pragma unroll
    for (int tp = 0; tp < NDT / 2; tp++) {
        float qa[2][4] = {{0.f, 0.f, 0.f, 0.f}, {0.f, 0.f, 0.f, 0.f}};
        float wa[2][4] = {{0.f, 0.f, 0.f, 0.f}, {0.f, 0.f, 0.f, 0.f}};
#pragma unroll
        for (int s = 0; s < 4; s++) {
            const int off = (16 * s + (lm & 1) * 8 + lr) * LD + d0 + 16 * tp + (lm >> 1) * 8;
            unsigned bq[4], bw[4];
            ldsm_x4_t(bq, qg + off);
            ldsm_x4_t(bw, w + off);
            mma16816(qa[0], aO[s], bq[0], bq[1]);
            mma16816(qa[1], aO[s], bq[2], bq[3]);
            mma16816(wa[0], aV[s], bw[0], bw[1]);
            mma16816(wa[1], aV[s], bw[2], bw[3]);
        }
#pragma unroll
        for (int u = 0; u < 2; u++) {
            const int t = 2 * tp + u;
            const float g0 = ge[d0 + 8 * t + ic], g1 = ge[d0 + 8 * t + ic + 1];
            dS[t][0] = dS[t][0] * g0 + scale * qa[u][0] - wa[u][0];
            dS[t][1] = dS[t][1] * g1 + scale * qa[u][1] - wa[u][1];
            dS[t][2] = dS[t][2] * g0 + scale * qa[u][2] - wa[u][2];
            dS[t][3] = dS[t][3] * g1 + scale * qa[u][3] - wa[u][3];
        }
    }
}

// The forward's staged outputs of a chunk: V' (SAVE) and O (rows < nvalid).
template <int D, int VT, int NT, bool SAVE>
__device__ __forceinline__ void fwd_chunk_stores(const Params &p, const bf16 *sV, const bf16 *sO,
                                                 size_t c, int v0, int b, int h, int t0,
                                                 int nvalid, size_t rs) {
    constexpr int LDB = VT + 8;
    if (SAVE) store_rows<VT, NT, CH, LDB>(p.vn + c * CH * D + v0, D, sV, CH);
    if (p.o)
        store_rows<VT, NT, CH, LDB>(p.o + ((size_t)b * p.T + t0) * rs + (size_t)h * D + v0, rs,
                                    sO, nvalid);
}
// The column forward. The state lives in registers, transposed: warp jg
// holds S^T rows jg*16 .. +15 (value columns of the tile) and all D channels
// as D/8 C tiles of mma.m16n8k16, in fp32. Every product is written
// transposed so that S^T (and V'^T) are A operands taken straight from those
// tiles:
//   V'^T = U^T - S^T W^T,  O^T = scale (S^T Qg^T + V'^T Aqk^T),
//   S^T <- S^T Diag(e^{G_C}) + V'^T Kd.
// SAVE: also store S at each chunk start (h) and V' (vn) for the backward.
// PREC (the final state is asked for; no SAVE): every operand of the two
// products that carry the state in two bf16 parts, x = hi(x) + lo(x) with
// lo(x) = bf16(x - hi(x)), and each product as three (hi hi + lo hi + hi lo):
// S^T W^T with W = w + w_lo, then V'^T Kd with Kd = kd + kd_lo; U = u + u_lo.
// O keeps the bf16 operands (a bf16 output). docs/cuda.md Precision.
template <int D, int VT, bool SAVE, bool PREC>
__global__ void __launch_bounds__(ColPlan<D, VT>::NW * 32, 1) kda_fwd_state_kernel(Params p) {
    using P = ColPlan<D, VT, PREC>;
    constexpr int NT = P::NW * 32, JG = P::JG, DW = D, NDT = DW / 8, NIT = 8;
    constexpr int LD = P::LD, LDA = P::LDA, LDB = P::LDB;
    extern __shared__ __align__(128) unsigned char smem[];
    static_assert(!(SAVE && PREC), "the precise pass does not save h and V'");
    unsigned char *stage0 = smem;
    bf16 *sH = reinterpret_cast<bf16 *>(smem + 2 * P::stage); // SAVE: [D][LDB]
    bf16 *sV = sH + D * LDB;                                    // SAVE: [64][LDB]
    bf16 *sO = PREC ? sH : sV + CH * LDB;                       // [64][LDB]
    bf16 *sKdl = sO + CH * LDB;                                 // PREC: [64][LD] kd_lo
    const int v0 = blockIdx.x * VT, bh = blockIdx.y, b = bh / p.H, h = bh % p.H;
    const int tid = threadIdx.x, warp = tid >> 5, lane = tid & 31;
    const int jg = warp % JG, ds = warp / JG; // ds = 0
    const int jr = jg * 16 + (lane >> 2), ic = (lane & 3) * 2, d0w = ds * DW;
    const int lm = lane >> 3, lr = lane & 7; // ldmatrix: matrix and row of this lane's address
    const size_t rs = (size_t)p.H * D;

    unsigned long long *bars = stage_bars<P>(smem);
    auto issue = [&](int n) {
        fwd_stage_copy<NT, D, VT, PREC>(StageView<D, VT>(stage0 + (n & 1) * P::stage), p,
                                        (size_t)bh * p.N + n, v0, &bars[n & 1]);
    };
    issue(0);
    float S[NDT][4];
    state_load<D, NDT, false>(S, p, bh, v0, jr, d0w, ic);
    for (int n = 0; n < p.N; n++) {
        const size_t c = (size_t)bh * p.N + n;
        const int t0 = n * CH, nvalid = min(CH, p.T - t0);
        // afterwards chunk n's stage is in and the staging buffers are free
        fwd_chunk_begin<NT, D, PREC>(n, p.N, issue, bars, sKdl, p.kd_lo + c * CH * D);
        StageView<D, VT> st(stage0 + (n & 1) * P::stage);
        if (SAVE) { // S (as S^T C tiles) into sH [d][j], transposed by stmatrix
#pragma unroll
            for (int s = 0; s < DW / 16; s++) {
                unsigned a[4];
                c_to_a(a, S[2 * s], S[2 * s + 1]);
                stsm_x4_t(sH + (d0w + 16 * s + (lm >> 1) * 8 + lr) * LDB + jg * 16 + (lm & 1) * 8, a);
            }
        }

        // S^T W^T and S^T Qg^T over this warp's channels (k), all 64 rows (n)
        float pv[8][4], po[8][4];
#pragma unroll
        for (int nt = 0; nt < 8; nt++)
#pragma unroll
            for (int e = 0; e < 4; e++) pv[nt][e] = po[nt][e] = 0.f;
#pragma unroll
        for (int s = 0; s < DW / 16; s++) {
            unsigned a[4], al[4];
            c_to_a(a, S[2 * s], S[2 * s + 1]);
            if (PREC) {
                float r0[4], r1[4];
#pragma unroll
                for (int e = 0; e < 4; e++) {
                    r0[e] = bf16_residue(S[2 * s][e]);
                    r1[e] = bf16_residue(S[2 * s + 1][e]);
                }
                c_to_a(al, r0, r1);
            }
#pragma unroll
            for (int np = 0; np < 4; np++) {
                const int off = (16 * np + (lm >> 1) * 8 + lr) * LD + d0w + 16 * s + (lm & 1) * 8;
                unsigned bw[4], bq[4];
                ldsm_x4(bw, st.a + off);
                ldsm_x4(bq, st.b + off);
                if (PREC) { // lo(S) hi(W) + hi(S) lo(W)
                    unsigned bl[4];
                    ldsm_x4(bl, st.a_lo + off);
                    mma16816(pv[2 * np], al, bw[0], bw[1]);
                    mma16816(pv[2 * np + 1], al, bw[2], bw[3]);
                    mma16816(pv[2 * np], a, bl[0], bl[1]);
                    mma16816(pv[2 * np + 1], a, bl[2], bl[3]);
                }
                mma16816(pv[2 * np], a, bw[0], bw[1]);
                mma16816(pv[2 * np + 1], a, bw[2], bw[3]);
                mma16816(po[2 * np], a, bq[0], bq[1]);
                mma16816(po[2 * np + 1], a, bq[2], bq[3]);
            }
        }
        float oa[NIT][4];
#pragma unroll
        for (int it = 0; it < NIT; it++)
#pragma unroll
            for (int e = 0; e < 4; e++) oa[it][e] = po[it][e];
        // V'^T = U^T - S^T W^T, rounded to bf16 once: the A fragments below and vn
        vprime<8, LDB, PREC>(pv, st, 0, jr, ic);
        unsigned aV[4][4], aL[PREC ? 4 : 1][4];
#pragma unroll
        for (int s = 0; s < 4; s++) c_to_a(aV[s], pv[2 * s], pv[2 * s + 1]);
        if (PREC) {
#pragma unroll
            for (int s = 0; s < 4; s++) {
                float r0[4], r1[4];
#pragma unroll
                for (int e = 0; e < 4; e++) {
                    r0[e] = bf16_residue(pv[2 * s][e]);
                    r1[e] = bf16_residue(pv[2 * s + 1][e]);
                }
                c_to_a(aL[PREC ? s : 0], r0, r1);
            }
        }
        if (SAVE) { // V', transposed
#pragma unroll
            for (int s = 0; s < 4; s++)
                stsm_x4_t(sV + (16 * s + (lm >> 1) * 8 + lr) * LDB + jg * 16 + (lm & 1) * 8, aV[s]);
        }
        o_aqk<8, LDA>(oa, aV, st.aqk, 0, lm, lr); // O^T += V'^T Aqk^T
#pragma unroll
        for (int it = 0; it < NIT; it += 2) { // O, two row tiles at a time, transposed
            const int nt = it;
            unsigned a[4];
            a[0] = pack_bf16x2(p.scale * oa[it][0], p.scale * oa[it][1]);
            a[1] = pack_bf16x2(p.scale * oa[it][2], p.scale * oa[it][3]);
            a[2] = pack_bf16x2(p.scale * oa[it + 1][0], p.scale * oa[it + 1][1]);
            a[3] = pack_bf16x2(p.scale * oa[it + 1][2], p.scale * oa[it + 1][3]);
            stsm_x4_t(sO + (8 * nt + (lm >> 1) * 8 + lr) * LDB + jg * 16 + (lm & 1) * 8, a);
        }
        // S^T <- S^T Diag(e^{G_C}) + V'^T Kd on this warp's channels
        fwd_update<NDT, LD, PREC>(S, aV, aL, st.c, sKdl, st.ge, d0w, ic, lm, lr, n + 1 < p.N);
        __syncthreads(); // staging complete; stage n & 1 is free for chunk n + 2
        if (SAVE) store_rows<VT, NT, D, LDB>(p.h + c * D * D + v0, D, sH, D);
        fwd_chunk_stores<D, VT, NT, SAVE>(p, sV, sO, c, v0, b, h, t0, nvalid, rs);
    }
    if (p.ht) state_store<D, NDT>(S, p.ht, bh, v0, jr, d0w, ic);
}

// Backward, chunks in reverse. With dS the gradient of the chunk's outgoing
// state and dO the output gradient:
//   dV' = Kd dS + scale Aqk^T dO
//   dS_in = e^{G_C} dS + scale Qg^T dO - W^T dV'
// Stores dS per chunk (dh), dV' (dvn) and the gradient of h0. Register layout
// and transposed products as the forward:
//   dV'^T = dS^T Kd^T + scale dO^T Aqk,
//   dS^T <- dS^T Diag(e^{G_C}) + scale dO^T Qg - dV'^T W.
template <int D, int VT>
__global__ void __launch_bounds__(ColPlan<D, VT>::NW * 32, 1) kda_bwd_state_kernel(Params p) {
    using P = ColPlan<D, VT>;
    constexpr int NT = P::NW * 32, JG = P::JG, DW = D, NDT = DW / 8;
    constexpr int LD = P::LD, LDA = P::LDA, LDB = P::LDB;
    extern __shared__ __align__(128) unsigned char smem[];
    unsigned char *stage0 = smem;
    bf16 *sH = reinterpret_cast<bf16 *>(smem + 2 * P::stage);
    bf16 *sV = sH + D * LDB;
    const int v0 = blockIdx.x * VT, bh = blockIdx.y, b = bh / p.H, h = bh % p.H;
    const int tid = threadIdx.x, warp = tid >> 5, lane = tid & 31;
    const int jg = warp % JG, ds = warp / JG; // ds = 0
    const int jr = jg * 16 + (lane >> 2), ic = (lane & 3) * 2, d0w = ds * DW;
    const int lm = lane >> 3, lr = lane & 7;
    const size_t rs = (size_t)p.H * D;

    unsigned long long *bars = stage_bars<P>(smem);
    auto issue = [&](int n) {
        bwd_stage_copy<NT, D, VT>(StageView<D, VT>(stage0 + (n & 1) * P::stage), p,
                                  (size_t)bh * p.N + n, n, b, h, v0, rs, &bars[n & 1]);
    };
    issue(p.N - 1);
    float dS[NDT][4];
    state_load<D, NDT, true>(dS, p, bh, v0, jr, d0w, ic);
    for (int n = p.N - 1; n >= 0; n--) {
        const size_t c = (size_t)bh * p.N + n;
        if (n > 0) {
            issue(n - 1);
            cp_async_wait<1>();
        } else {
            cp_async_wait<0>();
        }
        mbar_wait(&bars[n & 1], ((p.N - 1 - n) >> 1) & 1); // stage n's bulk copies
        __syncthreads();
        StageView<D, VT> st(stage0 + (n & 1) * P::stage);
#pragma unroll
        for (int s = 0; s < DW / 16; s++) { // dS into sH [d][j], transposed by stmatrix
            unsigned a[4];
            c_to_a(a, dS[2 * s], dS[2 * s + 1]);
            stsm_x4_t(sH + (d0w + 16 * s + (lm >> 1) * 8 + lr) * LDB + jg * 16 + (lm & 1) * 8, a);
        }
        // dO^T as A fragments (k = the chunk's rows), from the [64][VT] tile
        unsigned aO[4][4];
#pragma unroll
        for (int s = 0; s < 4; s++)
            ldsm_x4_t(aO[s], st.tile + (16 * s + (lm >> 1) * 8 + lr) * LDB + jg * 16 + (lm & 1) * 8);

        // dS^T Kd^T over this warp's channels, plus scale dO^T Aqk on its row tiles
        float pv[8][4];
#pragma unroll
        for (int nt = 0; nt < 8; nt++)
#pragma unroll
            for (int e = 0; e < 4; e++) pv[nt][e] = 0.f;
#pragma unroll
        for (int s = 0; s < DW / 16; s++) {
            unsigned a[4];
            c_to_a(a, dS[2 * s], dS[2 * s + 1]);
#pragma unroll
            for (int np = 0; np < 4; np++) {
                unsigned bk[4];
                ldsm_x4(bk, st.c + (16 * np + (lm >> 1) * 8 + lr) * LD + d0w + 16 * s + (lm & 1) * 8);
                mma16816(pv[2 * np], a, bk[0], bk[1]);
                mma16816(pv[2 * np + 1], a, bk[2], bk[3]);
            }
        }
#pragma unroll
        for (int nt = 0; nt < 8; nt += 2) { // pairs of row tiles: they share the nonzero k-steps
            float qa[2][4] = {{0.f, 0.f, 0.f, 0.f}, {0.f, 0.f, 0.f, 0.f}};
#pragma unroll
            for (int s = 0; s < 4; s++) {
                if (16 * s + 15 < 8 * nt) continue; // Aqk(i', i) = 0 for i' < i
                unsigned bb[4];
                ldsm_x4_t(bb, st.aqk + (16 * s + (lm & 1) * 8 + lr) * LDA + 8 * nt + (lm >> 1) * 8);
                mma16816(qa[0], aO[s], bb[0], bb[1]);
                mma16816(qa[1], aO[s], bb[2], bb[3]);
            }
#pragma unroll
            for (int e = 0; e < 4; e++) {
                pv[nt][e] += p.scale * qa[0][e];
                pv[nt + 1][e] += p.scale * qa[1][e];
            }
        }
        unsigned aV[4][4];
#pragma unroll
        for (int s = 0; s < 4; s++) c_to_a(aV[s], pv[2 * s], pv[2 * s + 1]);
#pragma unroll
        for (int s = 0; s < 4; s++) // dV', transposed
            stsm_x4_t(sV + (16 * s + (lm >> 1) * 8 + lr) * LDB + jg * 16 + (lm & 1) * 8, aV[s]);
        // dS^T <- dS^T Diag(e^{G_C}) + scale dO^T Qg - dV'^T W
        bwd_update<NDT, LD>(dS, aO, aV, st.b, st.a, st.ge, p.scale, d0w, ic, lm, lr);
        __syncthreads(); // staging complete; stage n & 1 is free for chunk n - 2
        store_rows<VT, NT, D, LDB>(p.dh + c * D * D + v0, D, sH, D);
        store_rows<VT, NT, CH, LDB>(p.dvn + c * CH * D + v0, D, sV, CH);
    }
    if (p.dh0) state_store<D, NDT>(dS, p.dh0, bh, v0, jr, d0w, ic);
}

// The row forward (VT = 16, 32): products as the column forward, warps as
// RowPlan. Warp (jg, ds) holds S^T rows jg*16 .. +15 and channels ds*DW ..
// +DW-1 in registers. Per chunk: the bf16 state is in shared memory (sH,
// written at the end of the previous chunk); each warp computes V' and O for
// its RW rows over all channels, writes its rows of V' to sV, and after a
// barrier takes all of V' as A fragments for the update of its channels. The
// sums over channels stay inside one warp's mma chain (deterministic). SAVE
// and PREC as the column forward; with PREC the residues of S and V' travel
// through shared memory beside them.
template <int D, int VT, bool SAVE, bool PREC>
__global__ void __launch_bounds__(RowPlan<D, VT, PREC>::NW * 32, 1)
    kda_fwd_state_rows_kernel(Params p) {
    using P = RowPlan<D, VT, PREC>;
    constexpr int NT = P::NW * 32, JG = P::JG, DW = P::DW, NDT = P::NDT;
    constexpr int RW = P::RW, NRT = P::NRT;
    constexpr int LD = P::LD, LDA = P::LDA, LDB = P::LDB;
    extern __shared__ __align__(128) unsigned char smem[];
    static_assert(!(SAVE && PREC), "the precise pass does not save h and V'");
    unsigned char *stage0 = smem;
    bf16 *sO = reinterpret_cast<bf16 *>(smem + 2 * P::stage); // [64][LDB]
    bf16 *sH = sO + CH * LDB;                                   // [D][LDB]
    bf16 *sV = sH + D * LDB;                                    // [64][LDB]
    bf16 *sKdl = sV + CH * LDB;                                 // PREC: [64][LD] kd_lo
    bf16 *sHl = sKdl + CH * LD;                                 // PREC: [D][LDB]
    bf16 *sVl = sHl + D * LDB;                                  // PREC: [64][LDB]
    const int v0 = blockIdx.x * VT, bh = blockIdx.y, b = bh / p.H, h = bh % p.H;
    const int tid = threadIdx.x, warp = tid >> 5, lane = tid & 31;
    const int jg = warp % JG, ds = warp / JG;
    const int jr = jg * 16 + (lane >> 2), ic = (lane & 3) * 2, d0w = ds * DW, i0 = ds * RW;
    const int lm = lane >> 3, lr = lane & 7; // ldmatrix: matrix and row of this lane's address
    const size_t rs = (size_t)p.H * D;

    unsigned long long *bars = stage_bars<P>(smem);
    auto issue = [&](int n) {
        fwd_stage_copy<NT, D, VT, PREC>(StageView<D, VT>(stage0 + (n & 1) * P::stage), p,
                                        (size_t)bh * p.N + n, v0, &bars[n & 1]);
    };
    issue(0);
    float S[NDT][4];
    state_load<D, NDT, false>(S, p, bh, v0, jr, d0w, ic);
    store_ct<NDT, LDB>(sH, d0w, jg, lane, S); // for every warp's products, and h of chunk 0
    if (PREC) store_ct_lo<NDT, LDB>(sHl, d0w, jg, lane, S);
    for (int n = 0; n < p.N; n++) {
        const size_t c = (size_t)bh * p.N + n;
        const int t0 = n * CH, nvalid = min(CH, p.T - t0);
        // afterwards chunk n's stage and the state S_n in sH are in
        fwd_chunk_begin<NT, D, PREC>(n, p.N, issue, bars, sKdl, p.kd_lo + c * CH * D);
        StageView<D, VT> st(stage0 + (n & 1) * P::stage);
        if (SAVE) store_rows<VT, NT, D, LDB>(p.h + c * D * D + v0, D, sH, D);

        // S^T W^T and S^T Qg^T over all channels (k), for this warp's rows (n)
        float pv[NRT][4], po[NRT][4];
#pragma unroll
        for (int t = 0; t < NRT; t++)
#pragma unroll
            for (int e = 0; e < 4; e++) pv[t][e] = po[t][e] = 0.f;
#pragma unroll
        for (int s = 0; s < D / 16; s++) {
            unsigned a[4], al[4];
            load_at<LDB>(a, sH, 16 * s, jg, lane);
            if (PREC) load_at<LDB>(al, sHl, 16 * s, jg, lane);
            unsigned bw[NRT][2], bq[NRT][2];
            load_b_rows<NRT, LD>(bw, st.a, i0, 16 * s, lane);
            load_b_rows<NRT, LD>(bq, st.b, i0, 16 * s, lane);
            if (PREC) { // lo(S) hi(W) + hi(S) lo(W)
                unsigned bl[NRT][2];
                load_b_rows<NRT, LD>(bl, st.a_lo, i0, 16 * s, lane);
#pragma unroll
                for (int t = 0; t < NRT; t++) {
                    mma16816(pv[t], al, bw[t][0], bw[t][1]);
                    mma16816(pv[t], a, bl[t][0], bl[t][1]);
                }
            }
#pragma unroll
            for (int t = 0; t < NRT; t++) {
                mma16816(pv[t], a, bw[t][0], bw[t][1]);
                mma16816(po[t], a, bq[t][0], bq[t][1]);
            }
        }
        // V'^T = U^T - S^T W^T on this warp's rows, rounded to bf16 once (A fragments and vn)
        vprime<NRT, LDB, PREC>(pv, st, i0, jr, ic);
        // V'^T as A fragments over all 64 rows (k): each warp's rows through sV
        // (and its residues through sVl)
        unsigned aV[4][4], aL[PREC ? 4 : 1][4];
        store_ct<NRT, LDB>(sV, i0, jg, lane, pv);
        if (PREC) store_ct_lo<NRT, LDB>(sVl, i0, jg, lane, pv);
        __syncthreads(); // every warp's rows of V' are in, and every read of sH is done
#pragma unroll
        for (int s = 0; s < 4; s++) {
            load_at<LDB>(aV[s], sV, 16 * s, jg, lane);
            if (PREC) load_at<LDB>(aL[PREC ? s : 0], sVl, 16 * s, jg, lane);
        }
        o_aqk<NRT, LDA>(po, aV, st.aqk, i0, lm, lr); // O^T += V'^T Aqk^T, this warp's rows
        store_ct<NRT, LDB>(sO, i0, jg, lane, po, p.scale);
        // S^T <- S^T Diag(e^{G_C}) + V'^T Kd on this warp's channels
        fwd_update<NDT, LD, PREC>(S, aV, aL, st.c, sKdl, st.ge, d0w, ic, lm, lr, n + 1 < p.N);
        // S_{n+1} for the next chunk (every read of sH was before the V' barrier)
        store_ct<NDT, LDB>(sH, d0w, jg, lane, S);
        if (PREC) store_ct_lo<NDT, LDB>(sHl, d0w, jg, lane, S);
        __syncthreads(); // staging complete; stage n & 1 is free for chunk n + 2
        fwd_chunk_stores<D, VT, NT, SAVE>(p, sV, sO, c, v0, b, h, t0, nvalid, rs);
    }
    if (p.ht) state_store<D, NDT>(S, p.ht, bh, v0, jr, d0w, ic);
}

// Backward, chunks in reverse. With dS the gradient of the chunk's outgoing
// state and dO the output gradient:
//   dV' = Kd dS + scale Aqk^T dO
//   dS_in = e^{G_C} dS + scale Qg^T dO - W^T dV'
// Stores dS per chunk (dh), dV' (dvn) and the gradient of h0. Register layout,
// warps and transposed products as the row forward:
//   dV'^T = dS^T Kd^T + scale dO^T Aqk   (each warp its rows, dS from sH),
//   dS^T <- dS^T Diag(e^{G_C}) + scale dO^T Qg - dV'^T W   (each warp its channels).
template <int D, int VT>
__global__ void __launch_bounds__(RowPlan<D, VT>::NW * 32, 1)
    kda_bwd_state_rows_kernel(Params p) {
    using P = RowPlan<D, VT>;
    constexpr int NT = P::NW * 32, JG = P::JG, DW = P::DW, NDT = P::NDT;
    constexpr int RW = P::RW, NRT = P::NRT;
    constexpr int LD = P::LD, LDA = P::LDA, LDB = P::LDB;
    extern __shared__ __align__(128) unsigned char smem[];
    unsigned char *stage0 = smem;
    bf16 *sH = reinterpret_cast<bf16 *>(smem + 2 * P::stage + P::sv); // the forward's layout
    bf16 *sV = sH + D * LDB;
    const int v0 = blockIdx.x * VT, bh = blockIdx.y, b = bh / p.H, h = bh % p.H;
    const int tid = threadIdx.x, warp = tid >> 5, lane = tid & 31;
    const int jg = warp % JG, ds = warp / JG;
    const int jr = jg * 16 + (lane >> 2), ic = (lane & 3) * 2, d0w = ds * DW, i0 = ds * RW;
    const int lm = lane >> 3, lr = lane & 7;
    const size_t rs = (size_t)p.H * D;

    unsigned long long *bars = stage_bars<P>(smem);
    auto issue = [&](int n) {
        bwd_stage_copy<NT, D, VT, NT / 2>(StageView<D, VT>(stage0 + (n & 1) * P::stage), p,
                                  (size_t)bh * p.N + n, n, b, h, v0, rs, &bars[n & 1]);
    };
    issue(p.N - 1);
    float dS[NDT][4];
    state_load<D, NDT, true>(dS, p, bh, v0, jr, d0w, ic);
    store_ct<NDT, LDB>(sH, d0w, jg, lane, dS);
    for (int n = p.N - 1; n >= 0; n--) {
        const size_t c = (size_t)bh * p.N + n;
        if (n > 0) {
            issue(n - 1);
            cp_async_wait<1>();
        } else {
            cp_async_wait<0>();
        }
        mbar_wait(&bars[n & 1], ((p.N - 1 - n) >> 1) & 1); // stage n's bulk copies
        __syncthreads(); // chunk n's stage and dS (bf16, sH) are in
        StageView<D, VT> st(stage0 + (n & 1) * P::stage);
        store_rows<VT, NT, D, LDB>(p.dh + c * D * D + v0, D, sH, D);
        // dO^T as A fragments (k = the chunk's rows), from the [64][VT] tile
        unsigned aO[4][4];
#pragma unroll
        for (int s = 0; s < 4; s++) load_at<LDB>(aO[s], st.tile, 16 * s, jg, lane);

        // dS^T Kd^T over all channels, plus scale dO^T Aqk, on this warp's rows
        float pv[NRT][4], qa[NRT][4];
#pragma unroll
        for (int t = 0; t < NRT; t++)
#pragma unroll
            for (int e = 0; e < 4; e++) pv[t][e] = qa[t][e] = 0.f;
#pragma unroll
        for (int s = 0; s < D / 16; s++) {
            unsigned a[4], bk[NRT][2];
            load_at<LDB>(a, sH, 16 * s, jg, lane);
            load_b_rows<NRT, LD>(bk, st.c, i0, 16 * s, lane);
#pragma unroll
            for (int t = 0; t < NRT; t++) mma16816(pv[t], a, bk[t][0], bk[t][1]);
        }
#pragma unroll
        for (int s = 0; s < 4; s++) {
            if (16 * s + 15 < i0) continue; // Aqk(i', i) = 0 for i' < i
#pragma unroll
            for (int t = 0; t + 1 < NRT; t += 2) {
                unsigned bb[4];
                ldsm_x4_t(bb, st.aqk + (16 * s + (lm & 1) * 8 + lr) * LDA + i0 + 8 * t + (lm >> 1) * 8);
                mma16816(qa[t], aO[s], bb[0], bb[1]);
                mma16816(qa[t + 1], aO[s], bb[2], bb[3]);
            }
            if (NRT & 1) {
                unsigned bb[2];
                ldsm_x2_t(bb, st.aqk + (16 * s + (lm & 1) * 8 + lr) * LDA + i0 + 8 * (NRT - 1));
                mma16816(qa[NRT - 1], aO[s], bb[0], bb[1]);
            }
        }
#pragma unroll
        for (int t = 0; t < NRT; t++)
#pragma unroll
            for (int e = 0; e < 4; e++) pv[t][e] += p.scale * qa[t][e];
        store_ct<NRT, LDB>(sV, i0, jg, lane, pv);
        __syncthreads(); // every warp's rows of dV' are in; every read of sH is done
        unsigned aV[4][4];
#pragma unroll
        for (int s = 0; s < 4; s++) load_at<LDB>(aV[s], sV, 16 * s, jg, lane);
        // dS^T <- dS^T Diag(e^{G_C}) + scale dO^T Qg - dV'^T W
        bwd_update<NDT, LD>(dS, aO, aV, st.b, st.a, st.ge, p.scale, d0w, ic, lm, lr);
        store_ct<NDT, LDB>(sH, d0w, jg, lane, dS); // dS of chunk n - 1
        __syncthreads(); // staging complete; stage n & 1 is free for chunk n - 2
        store_rows<VT, NT, CH, LDB, NT / 2>(p.dvn + c * CH * D + v0, D, sV, CH);
    }
    if (p.dh0) state_store<D, NDT>(dS, p.dh0, bh, v0, jr, d0w, ic);
}

// Value-tile width: the narrowest of 16, 32, 64 and 128 (at most D) whose
// blocks still fit in one wave on the device (one block per SM: the two stages
// fill shared memory); D when even that needs several waves. Narrow tiles
// shorten each chunk's step on the sequential path when there are few
// sequences and heads; wide ones read each chunk's operands fewer times.
// The precise forward (larger stages) runs 16 or 64 only: the narrowest of
// those that fits one wave, else 64 (16 for D = 32, which has no 64).
int state_tile_width(int BH, int D, bool precise) {
    int dev = 0, sms = 132;
    if (cudaGetDevice(&dev) == cudaSuccess)
        cudaDeviceGetAttribute(&sms, cudaDevAttrMultiProcessorCount, dev);
    for (int vt = 16; vt <= D; vt *= 2) {
        if (precise && vt != 16 && vt != 64) continue;
        if ((long long)BH * (D / vt) <= sms) return vt;
    }
    if (precise) return D >= 64 ? 64 : 16;
    return D;
}

// The H200's (and H100's) limit of dynamic shared memory for one block.
constexpr size_t SMEM_OPTIN = 227 * 1024;

template <int D, int VT>
static cudaError_t launch_state(const Params &p, bool backward, bool save, bool precise,
                                cudaStream_t s) {
    dim3 grid(D / VT, p.B * p.H);
    if constexpr (VT <= 32) { // row kernels
        using R = RowPlan<D, VT>;
        static_assert(R::total <= SMEM_OPTIN, "state kernels: shared memory");
        constexpr int NT = R::NW * 32;
        if (backward)
            return launch_with_smem(kda_bwd_state_rows_kernel<D, VT>, grid, NT, R::total, s, p);
        if (precise) { // never with save: the API runs a separate saving pass
            if constexpr (VT == 16) {
                using RP = RowPlan<D, VT, true>;
                static_assert(RP::total <= SMEM_OPTIN, "precise state: smem");
                if (save) return cudaErrorInvalidValue;
                return launch_with_smem(kda_fwd_state_rows_kernel<D, VT, false, true>, grid,
                                        RP::NW * 32, RP::total, s, p);
            } else {
                return cudaErrorInvalidValue; // state_tile_width never picks it
            }
        }
        if (save)
            return launch_with_smem(kda_fwd_state_rows_kernel<D, VT, true, false>, grid, NT,
                                    R::total, s, p);
        return launch_with_smem(kda_fwd_state_rows_kernel<D, VT, false, false>, grid, NT,
                                R::total, s, p);
    } else { // column kernels
        using C = ColPlan<D, VT>;
        static_assert(C::total <= SMEM_OPTIN, "state kernels: shared memory");
        constexpr int NT = C::NW * 32;
        if (backward)
            return launch_with_smem(kda_bwd_state_kernel<D, VT>, grid, NT, C::total, s, p);
        if (precise) {
            if constexpr (VT == 64) {
                static_assert(ColPlan<D, VT, true>::total <= SMEM_OPTIN, "precise state: smem");
                if (save) return cudaErrorInvalidValue;
                return launch_with_smem(kda_fwd_state_kernel<D, VT, false, true>, grid, NT,
                                        ColPlan<D, VT, true>::total, s, p);
            } else {
                return cudaErrorInvalidValue; // state_tile_width never picks it
            }
        }
        if (save)
            return launch_with_smem(kda_fwd_state_kernel<D, VT, true, false>, grid, NT, C::total,
                                    s, p);
        return launch_with_smem(kda_fwd_state_kernel<D, VT, false, false>, grid, NT, C::total, s,
                                p);
    }
}

// LONGMOE_KDA_STATE_VT=16|32|64|128 (at most D) forces the width: for tests
// and tuning (the precise forward takes 32 as 16 and 128 as 64). Any other
// value is reported once and ignored.
static int state_tile_override(int D) {
    const char *e = getenv("LONGMOE_KDA_STATE_VT");
    if (!e || !*e) return 0;
    int v = atoi(e);
    if ((v == 16 || v == 32 || v == 64 || v == 128) && v <= D) return v;
    static bool warned = false;
    if (!warned)
        fprintf(stderr, "longmoe: LONGMOE_KDA_STATE_VT=%s ignored: use 16, 32, 64 or 128, at most "
                        "the head dimension %d\n", e, D);
    warned = true;
    return 0;
}

static cudaError_t launch_state_any(const Params &p, int D, bool backward, bool save,
                                    bool precise, cudaStream_t s) {
    int vt = state_tile_override(D);
    if (vt && precise) vt = vt <= 32 ? 16 : 64;
    if (!vt) vt = state_tile_width(p.B * p.H, D, precise);
    if (D == 128) {
        if (vt == 16) return launch_state<128, 16>(p, backward, save, precise, s);
        if (vt == 32) return launch_state<128, 32>(p, backward, save, precise, s);
        if (vt == 64) return launch_state<128, 64>(p, backward, save, precise, s);
        return launch_state<128, 128>(p, backward, save, precise, s);
    }
    if (D == 64) {
        if (vt == 16) return launch_state<64, 16>(p, backward, save, precise, s);
        if (vt == 32) return launch_state<64, 32>(p, backward, save, precise, s);
        return launch_state<64, 64>(p, backward, save, precise, s);
    }
    if (D == 32) { // row kernels only: two channel slices of 16 (RowPlan)
        if (vt == 16) return launch_state<32, 16>(p, backward, save, precise, s);
        return launch_state<32, 32>(p, backward, save, precise, s);
    }
    return cudaErrorInvalidValue; // lm_kda_cuda_check refuses other head dimensions
}

cudaError_t launch_fwd_state(const Params &p, int D, bool save, bool precise, cudaStream_t s) {
    return launch_state_any(p, D, false, save, precise, s);
}

cudaError_t launch_bwd_state(const Params &p, int D, cudaStream_t s) {
    return launch_state_any(p, D, true, false, false, s);
}

} // namespace lmkda

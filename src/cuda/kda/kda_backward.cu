// KDA backward on Hopper: the intra-chunk gradient (dq, dk, dv, dbeta, dz, dA_log, ddt_bias),
// in three launches so that each kernel fits two blocks per SM (docs/cuda.md).
// Forward equations in SPEC §2 "Chunked form".
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "kda_common.cuh"

namespace lmkda {

// Threads of the triangular kernel (8 warps, two blocks per SM); the per-column
// kernel runs bwd_col_threads(D) (kda_common.cuh): 256, or 128 for D = 32.
constexpr int BWD_NT = 256;

// Copy `rows` rows of COLS elements of T from global memory (row stride
// gstride elements) to shared memory (row stride ld) with cp.async, rows >=
// nvalid zero-filled. 16-byte copies; the caller commits and waits.
template <int COLS, int NT, typename T>
__device__ __forceinline__ void cp_rows(T *dst, int ld, const T *src, size_t gstride, int rows,
                                        int nvalid) {
    constexpr int EPV = 16 / (int)sizeof(T), VPR = COLS / EPV;
    for (int idx = threadIdx.x; idx < rows * VPR; idx += NT) {
        int r = idx / VPR, c = (idx % VPR) * EPV;
        bool ok = r < nvalid;
        cp_async16(dst + r * ld + c, ok ? src + (size_t)r * gstride + c : src, ok);
    }
}

// A warp's 16x16 fp32 tile, staged at `st` (row stride 20), read back by lane:
// row lane/2, columns 8*(lane%2) .. +7.
__device__ __forceinline__ void tile_row8(const float *st, float x[8]) {
    int lane = threadIdx.x & 31, r = lane >> 1, c0 = (lane & 1) * 8;
#pragma unroll
    for (int e = 0; e < 8; e++) x[e] = st[r * 20 + c0 + e];
}
__device__ __forceinline__ uint4 pack_bf16x8(const float x[8]) {
    __align__(16) bf16 t[8];
#pragma unroll
    for (int e = 0; e < 8; e++) t[e] = __float2bfloat16(x[e]);
    return *reinterpret_cast<uint4 *>(t);
}

// mma_tile<RM, CM> with its k-loop unrolled by four only: the same products in the
// same order, fewer operand loads in flight (kernel A's dM tiles, held across the
// dv product, spilled registers at D = 128 with the loop fully unrolled).
__device__ __forceinline__ void mma_tile_rc4(FragC &c, const bf16 *A, int lda, const bf16 *B,
                                             int ldb, int ksteps) {
    wmma::fragment<wmma::matrix_a, 16, 16, 16, bf16, RM> a;
    wmma::fragment<wmma::matrix_b, 16, 16, 16, bf16, CM> b;
#pragma unroll 4
    for (int kk = 0; kk < ksteps; kk++) {
        ld_s(a, A + 16 * kk, lda);
        ld_s(b, B + 16 * kk, ldb);
        wmma::mma_sync(c, a, b, c);
    }
}

// ---- kernel A: the triangular gradients ----
// Shared memory: five regions of RSZ bytes, V' (bf16, read by dAqk) then M (bf16),
// per-warp staging, beta.
template <int D> __host__ __device__ constexpr size_t bwd_region() {
    return (size_t)CH * (D + 8) * 2 > (size_t)CH * (CH + 4) * 4 ? (size_t)CH * (D + 8) * 2
                                                                 : (size_t)CH * (CH + 4) * 4;
}
template <int D> __host__ __device__ constexpr size_t bwd_tri_vm() {
    return (size_t)CH * (D + 8) * 2 > (size_t)CH * (CH + 8) * 2 ? (size_t)CH * (D + 8) * 2
                                                                 : (size_t)CH * (CH + 8) * 2;
}
template <int D> __host__ __device__ constexpr size_t bwd_tri_smem() {
    return 5 * bwd_region<D>() + bwd_tri_vm<D>() + (size_t)(BWD_NT / 32) * 16 * 20 * 4 +
           (size_t)CH * 4;
}

// One block per (chunk, sequence*head). From the chunk state h and dV':
// dW = -dV' S^T, dAqk = Lower(dO' V'^T), dM = dW (k e^G)^T + dV' v^T,
// dv = M^T dV', the dbeta term of M = X Diag(beta), and dAkk = -StrictLower(X^T dX X^T).
// Writes dv, and dW, M, dAqk, dAkk, the dbeta term into the
// workspace for kernel B.
template <int D>
__global__ void __launch_bounds__(BWD_NT, 2) kda_bwd_tri_kernel(Params p) {
    // d_o, v, z, k [B,T,H,D]; h [c][D][D]; vn, dvn [c][64][D]; X [c][64][64]
    constexpr int NT = BWD_NT, LD = D + 8, LDA = CH + 4, LDM = CH + 8, TD = D / 16;
    constexpr size_t RSZ = bwd_region<D>();
    extern __shared__ __align__(128) unsigned char smem[];
    // Regions: R0-R1 h [D][LD] -> R0 k e^G (bf16) -> dM (fp32), R1 v (bf16) ->
    // T1 (fp32); R2 dO' -> dW; R3 dV' (read by three products: staged once);
    // R4 X; after R4, V' (read by dAqk), then M in its place.
    bf16 *sH = reinterpret_cast<bf16 *>(smem);
    bf16 *sKgp = reinterpret_cast<bf16 *>(smem);
    float *sdM = reinterpret_cast<float *>(smem);
    bf16 *sV = reinterpret_cast<bf16 *>(smem + RSZ);
    float *sT1 = reinterpret_cast<float *>(smem + RSZ);
    bf16 *sdO = reinterpret_cast<bf16 *>(smem + 2 * RSZ);
    bf16 *sdW = sdO;
    bf16 *sdVn = reinterpret_cast<bf16 *>(smem + 3 * RSZ);
    float *sX = reinterpret_cast<float *>(smem + 4 * RSZ);
    bf16 *sVn = reinterpret_cast<bf16 *>(smem + 5 * RSZ);      // [64][LD] V'
    bf16 *sMb = sVn;                                            // [64][LDM] M, once V' is dead
    float *sWarp = reinterpret_cast<float *>(smem + 5 * RSZ + bwd_tri_vm<D>()); // [8][16][20]
    float *sBeta = sWarp + (NT / 32) * 16 * 20;                // [64]

    const int n = blockIdx.x, bh = blockIdx.y, b = bh / p.H, h = bh % p.H;
    const int t0 = n * CH, nvalid = min(CH, p.T - t0);
    const size_t c = (size_t)bh * p.N + n;
    const size_t rs = (size_t)p.H * D;
    const size_t base = ((size_t)b * p.T + t0) * rs + (size_t)h * D;
    const int tid = threadIdx.x, warp = tid >> 5, lane = tid & 31;
    float *st = sWarp + warp * 16 * 20;
    const int lr = lane >> 1, lc = (lane & 1) * 8; // this lane's row and columns of a staged tile

    // ---- load (cp.async): dO and V' for dAqk first, then h, dV', X, which
    // land while dAqk is computed; beta ----
    cp_rows<D, NT>(sdO, LD, p.d_o + base, rs, CH, nvalid);
    cp_rows<D, NT>(sVn, LD, p.vn + c * CH * D, D, CH, CH);
    cp_async_commit();
    cp_rows<D, NT>(sH, LD, p.h + c * D * D, D, D, D);
    cp_rows<D, NT>(sdVn, LD, p.dvn + c * CH * D, D, CH, CH);
    cp_rows<CH, NT>(sX, LDA, p.X + c * CH * CH, CH, CH, CH);
    cp_async_commit();
    // z, k and v are read later (k e^G, then v): ask for their rows in L2 now
    if (tid < 3 * CH && tid % CH < nvalid) {
        const bf16 *src = tid < CH ? p.z : tid < 2 * CH ? p.k : p.v;
        prefetch_l2_bulk(src + base + (size_t)(tid % CH) * rs, D * sizeof(bf16));
    }
    if (tid < CH) sBeta[tid] = tid < nvalid ? p.beta[((size_t)b * p.T + t0 + tid) * p.H + h] : 0.f;
    cp_async_wait<1>(); // dO and V' have landed
    __syncthreads();
    // dO' = scale dO (eight channels a thread, 16-byte accesses)
    for (int idx = tid; idx < CH * D / 8; idx += NT) {
        int r = idx / (D / 8), d = (idx % (D / 8)) * 8;
        float x[8];
        ld8(sdO + r * LD + d, x);
#pragma unroll
        for (int e = 0; e < 8; e++) x[e] *= p.scale;
        st8(sdO + r * LD + d, x);
    }
    __syncthreads();

    // dAqk = Lower(dO' V'^T): the strictly lower part in bf16 for kernel B, the
    // diagonal (e^0 = 1, applied exactly there) in fp32; tiles above it are zero.
    bf16 *dAqkg = p.dAqkb + c * CH * CH;
    for (int tt = warp; tt < 16; tt += NT / 32) {
        int i0 = (tt / 4) * 16, j0 = (tt % 4) * 16;
        float x[8];
        if (j0 <= i0) {
            FragC acc;
            wmma::fill_fragment(acc, 0.f);
            mma_tile<RM, CM>(acc, sdO + i0 * LD, LD, sVn + j0 * LD, LD, D / 16);
            st_s(st, acc, 20);
            __syncwarp();
            tile_row8(st, x);
            __syncwarp();
            const int i = i0 + lr;
#pragma unroll
            for (int e = 0; e < 8; e++) {
                const int j = j0 + lc + e;
                if (j == i) p.dAqkDiag[c * CH + i] = x[e];
                x[e] = j < i ? x[e] : 0.f;
            }
        } else {
#pragma unroll
            for (int e = 0; e < 8; e++) x[e] = 0.f;
        }
        *reinterpret_cast<uint4 *>(dAqkg + (i0 + lr) * CH + j0 + lc) = pack_bf16x8(x);
    }
    // z and k of this thread's rows and channels for k e^G below (RP rows, eight
    // channels each): in flight in registers during M and dW
    constexpr int CG = D / 8, P = NT / CG, RP = CH / P;
    static_assert(P * CG == NT && RP * P == CH, "k e^G: thread layout");
    const int d0 = (tid % CG) * 8, pt = tid / CG;
    uint4 zraw[RP], kraw[RP];
#pragma unroll
    for (int i = 0; i < RP; i++) {
        const int r = pt * RP + i;
        if (r < nvalid) {
            zraw[i] = *reinterpret_cast<const uint4 *>(p.z + base + r * rs + d0);
            kraw[i] = *reinterpret_cast<const uint4 *>(p.k + base + r * rs + d0);
        } else {
            zraw[i] = kraw[i] = make_uint4(0u, 0u, 0u, 0u);
        }
    }
    cp_async_wait<0>(); // h, dV', X have landed
    __syncthreads(); // dO' and V' are dead: R2 takes dW, M replaces V'
    // M = X Diag(beta) (bf16, kept for kernel B too)
    bf16 *Mg = p.Mb + c * CH * CH;
    for (int idx = tid; idx < CH * CH / 8; idx += NT) {
        int i = idx / (CH / 8), j0 = (idx % (CH / 8)) * 8;
        float x[8];
#pragma unroll
        for (int e = 0; e < 8; e++) x[e] = sX[i * LDA + j0 + e] * sBeta[j0 + e];
        st8(sMb + i * LDM + j0, x);
        st8(Mg + i * CH + j0, x);
    }

    // dW = -dV' S^T (bf16: kernel A's operand and kernel B's input)
    bf16 *dWg = p.dWb + c * CH * D;
    for (int tt = warp; tt < 4 * TD; tt += NT / 32) {
        int i0 = (tt / TD) * 16, j0 = (tt % TD) * 16;
        FragC acc;
        wmma::fill_fragment(acc, 0.f);
        mma_tile<RM, CM>(acc, sdVn + i0 * LD, LD, sH + j0 * LD, LD, D / 16);
        st_s(st, acc, 20);
        __syncwarp();
        float x[8];
        tile_row8(st, x);
        __syncwarp();
#pragma unroll
        for (int e = 0; e < 8; e++) x[e] = -x[e];
        uint4 v8 = pack_bf16x8(x);
        *reinterpret_cast<uint4 *>(sdW + (i0 + lr) * LD + j0 + lc) = v8;
        *reinterpret_cast<uint4 *>(dWg + (size_t)(i0 + lr) * D + j0 + lc) = v8;
    }
    __syncthreads(); // h is dead: R1 takes v (loaded while k e^G is computed), R0 k e^G
    cp_rows<D, NT>(sV, LD, p.v + base, rs, CH, nvalid);
    cp_async_commit();

    // k e^G with G = cumsum(g): eight channels and RP rows a thread (16-byte
    // loads of z and k), the gate, a prefix within the thread's rows, then
    // the part sums before it added in order
    {
        const float a_exp = __expf(p.A_log[h]);
        float z8[RP][8], k8[RP][8], acc[8], bias[8];
#pragma unroll
        for (int e = 0; e < 8; e++) bias[e] = p.dt_bias[h * D + d0 + e];
#pragma unroll
        for (int i = 0; i < RP; i++) {
            ld8(reinterpret_cast<const bf16 *>(&zraw[i]), z8[i]);
            ld8(reinterpret_cast<const bf16 *>(&kraw[i]), k8[i]);
        }
#pragma unroll
        for (int e = 0; e < 8; e++) acc[e] = 0.f;
#pragma unroll
        for (int i = 0; i < RP; i++) {
            const int r = pt * RP + i;
#pragma unroll
            for (int e = 0; e < 8; e++) { // padded rows: g = 0 keeps G constant past T
                float g = r < nvalid ? kda_gate(z8[i][e], a_exp, bias[e], p.bounded, p.g_min) : 0.f;
                acc[e] += g;
                z8[i][e] = acc[e]; // G within the part
            }
        }
        float *sPart = sWarp; // [P][D] part sums (staging is idle here)
        static_assert(P * D <= (NT / 32) * 16 * 20, "k e^G: part sums fit the staging tiles");
        *reinterpret_cast<float4 *>(sPart + pt * D + d0) =
            make_float4(acc[0], acc[1], acc[2], acc[3]);
        *reinterpret_cast<float4 *>(sPart + pt * D + d0 + 4) =
            make_float4(acc[4], acc[5], acc[6], acc[7]);
        __syncthreads();
        float pre[8];
#pragma unroll
        for (int e = 0; e < 8; e++) pre[e] = 0.f;
        for (int q = 0; q < pt; q++) {
            float x[8];
            ldf8(sPart + q * D + d0, x);
#pragma unroll
            for (int e = 0; e < 8; e++) pre[e] += x[e];
        }
#pragma unroll
        for (int i = 0; i < RP; i++) {
            const int r = pt * RP + i;
#pragma unroll
            for (int e = 0; e < 8; e++)
                k8[i][e] = r < nvalid ? k8[i][e] * __expf(pre[e] + z8[i][e]) : 0.f;
            st8(sKgp + r * LD + d0, k8[i]);
        }
    }
    cp_async_wait<0>(); // v has landed
    __syncthreads();

    // dM = dW (k e^G)^T + dV' v^T (W = M k e^G, U = M v): two 16x16 tiles per
    // warp, held in registers until k e^G and v are dead (dM replaces them)
    static_assert(16 == 2 * (NT / 32), "dM: two tiles per warp");
    FragC accM[2];
#pragma unroll
    for (int k = 0; k < 2; k++) {
        int tt = warp + k * (NT / 32), i0 = (tt / 4) * 16, j0 = (tt % 4) * 16;
        wmma::fill_fragment(accM[k], 0.f);
        mma_tile_rc4(accM[k], sdW + i0 * LD, LD, sKgp + j0 * LD, LD, D / 16);
        mma_tile_rc4(accM[k], sdVn + i0 * LD, LD, sV + j0 * LD, LD, D / 16);
    }
    // dv = M^T dV'
    for (int tt = warp; tt < 4 * TD; tt += NT / 32) {
        int i0 = (tt / TD) * 16, j0 = (tt % TD) * 16;
        FragC acc;
        wmma::fill_fragment(acc, 0.f);
        mma_tile<CM, RM>(acc, sMb + i0, LDM, sdVn + j0, LD, CH / 16);
        st_s(st, acc, 20);
        __syncwarp();
        float x[8];
        tile_row8(st, x);
        __syncwarp();
        if (i0 + lr < nvalid)
            *reinterpret_cast<uint4 *>(p.dv + base + (size_t)(i0 + lr) * rs + j0 + lc) =
                pack_bf16x8(x);
    }
    __syncthreads(); // k e^G and v are dead: R0 takes dM
#pragma unroll
    for (int k = 0; k < 2; k++) {
        int tt = warp + k * (NT / 32), i0 = (tt / 4) * 16, j0 = (tt % 4) * 16;
        st_s(sdM + i0 * LDA + j0, accM[k], LDA);
    }
    __syncthreads();
    // M = X Diag(beta): dbeta_j = sum_i dM_ij X_ij; dX = dM Diag(beta) in place
    // (four threads a column, a quarter of the rows each; the parts added in order)
    float *sPart = sWarp; // [4][64] (the staging tiles are idle here)
    {
        static_assert(NT == 4 * CH, "dbeta: four threads a column");
        const int j = tid % CH, q = tid / CH;
        float acc = 0.f;
#pragma unroll 4
        for (int i = q * (CH / 4); i < (q + 1) * (CH / 4); i++) {
            float dm = sdM[i * LDA + j];
            acc += dm * sX[i * LDA + j];
            sdM[i * LDA + j] = dm * sBeta[j];
        }
        sPart[q * CH + j] = acc;
    }
    __syncthreads();
    if (tid < CH)
        p.dbeta_part[c * (1 + bwd_col_blocks(D)) * CH + tid] =
            ((sPart[tid] + sPart[CH + tid]) + sPart[2 * CH + tid]) + sPart[3 * CH + tid];

    // X = (I + Akk)^{-1}: dAkk = -X^T dX X^T, strictly lower, tf32 tensor
    // cores; X is lower triangular, so T1 = X^T dX needs k >= i and T1 X^T
    // needs k <= j: the known-zero k-steps are skipped.
    for (int tt = warp; tt < 16; tt += NT / 32) {
        int i0 = (tt / 4) * 16, j0 = (tt % 4) * 16;
        FragC8 acc;
        wmma::fill_fragment(acc, 0.f);
        mma_tile_tf32<CM, RM>(acc, sX + i0, LDA, sdM + j0, LDA, i0 / 8, CH / 8);
        st_s(sT1 + i0 * LDA + j0, acc, LDA);
    }
    __syncthreads();
    bf16 *dAkkg = p.dAkkb + c * CH * CH;
    for (int tt = warp; tt < 16; tt += NT / 32) {
        int i0 = (tt / 4) * 16, j0 = (tt % 4) * 16;
        const int i = i0 + lr;
        float x[8];
        if (j0 <= i0) {
            FragC8 acc;
            wmma::fill_fragment(acc, 0.f);
            mma_tile_tf32<RM, CM>(acc, sT1 + i0 * LDA, LDA, sX + j0 * LDA, LDA, 0, (j0 + 16) / 8);
            st_s(st, acc, 20);
            __syncwarp();
            tile_row8(st, x);
            __syncwarp();
#pragma unroll
            for (int e = 0; e < 8; e++) x[e] = j0 + lc + e < i ? -x[e] : 0.f;
        } else {
#pragma unroll
            for (int e = 0; e < 8; e++) x[e] = 0.f;
        }
        // one bf16 rounding, read by both sides of kernel B (its column side folds
        // beta_i into its key operand instead of reading a rounded beta_i dAkk)
        *reinterpret_cast<uint4 *>(dAkkg + i * CH + j0 + lc) = pack_bf16x8(x);
    }
}

// ---- kernel B: the per-column gradients ----
// Columns of the per-column kernel's block: DC = bwd_col_width(D) (D = 128 runs
// as two column halves of 64, D = 32 as one block of 32), with 4 threads a
// column: thread t owns column t % DC of rows t / DC + RSTEP i.
constexpr int COL_RSTEP = 4;
static_assert(bwd_col_threads(64) / bwd_col_width(64) == COL_RSTEP &&
                  bwd_col_threads(32) / bwd_col_width(32) == COL_RSTEP,
              "kernel B: four row groups");
// Phase 4 (the sub-chunk loop) keeps in dO's place the sub-chunk's blocks of dAqk
// and dAkk: row blocks [2][16][CH+8], column blocks [2][64][SUB+8] ...
__host__ __device__ constexpr size_t bwd_col_tiles_bytes() {
    return (size_t)2 * SUB * (CH + 8) * 2 + (size_t)2 * CH * (SUB + 8) * 2;
}
// ... and, from the end of those blocks on (the rest of dO's place and the
// region after it), the score operands with their low bf16 parts: the key
// operand (rows 0 .. n0+15) and the two query-side operands (rows n0 .. 63),
// hi and lo each, by row index: [key | q] hi and lo in 80 rows each (q shifted
// by 16 rows), beta k hi and lo in 64 rows each: 2 (2 CH + SUB) rows of DC + 8.
template <int D> __host__ __device__ constexpr size_t bwd_col_ops_bytes() {
    return (size_t)2 * (2 * CH + SUB) * (bwd_col_width(D) + 8) * 2;
}
template <int D> __host__ __device__ constexpr size_t bwd_col_do_bytes() {
    constexpr int DC = bwd_col_width(D);
    // V', then dO' [64][D+8]; then M [64][CH+8] and the block's dW columns [64][DC+8]
    return (size_t)CH * (D + 8) * 2 > (size_t)CH * (CH + 8) * 2 + (size_t)CH * (DC + 8) * 2
               ? (size_t)CH * (D + 8) * 2
               : (size_t)CH * (CH + 8) * 2 + (size_t)CH * (DC + 8) * 2;
}
template <int D> __host__ __device__ constexpr size_t bwd_col_state_bytes() {
    constexpr int DC = bwd_col_width(D);
    // h and dh rows of the block's columns [DC][D+8] each; then (phase 4) what
    // the operands need past dO's place
    return (size_t)2 * DC * (D + 8) * 2 >
                   bwd_col_tiles_bytes() + bwd_col_ops_bytes<D>() - bwd_col_do_bytes<D>()
               ? (size_t)2 * DC * (D + 8) * 2
               : bwd_col_tiles_bytes() + bwd_col_ops_bytes<D>() - bwd_col_do_bytes<D>();
}
template <int D> __host__ __device__ constexpr size_t bwd_col_smem() {
    constexpr int DC = bwd_col_width(D);
    return (size_t)CH * DC * 4                // G
           + (size_t)CH * (DC + 4) * 4        // product staging
           + (size_t)2 * CH * (DC + 8) * 2    // q, k
           + bwd_col_do_bytes<D>()            // dO'; then M and dW; then dAqk, dAkk blocks
           + bwd_col_state_bytes<D>()         // h, dh -> sub-chunk operands
           + (size_t)(2 * CH + DC + COL_RSTEP * DC + CH * (DC / 32)) * 4 // small
           + (size_t)2 * (CH / SUB) * SUB * SUB * 2; // diagonal blocks (per-pair loop)
}

// x <- x shifted left by S entries, the first S moved to the end (registers:
// every index is a compile-time constant).
template <int S, int N> __device__ __forceinline__ void rotate_left(float (&x)[N]) {
    float t[S];
#pragma unroll
    for (int i = 0; i < S; i++) t[i] = x[i];
#pragma unroll
    for (int i = 0; i < N - S; i++) x[i] = x[i + S];
#pragma unroll
    for (int i = 0; i < S; i++) x[N - S + i] = t[i];
}

// Over the thread's rows r = r0 + RSTEP i (of column d; unrolled, no rotation):
// x[i] += P[r] e^{G[r]} and dG[i] += P[r] e^{G[r]} op[r], with P the staged
// product [64][LDS], G [64][DC] and op the staged q or k [64][LDC].
template <int RSTEP, int LDS, int LDC, int DC, int RPT>
__device__ __forceinline__ void add_staged_rows(float (&x)[RPT], float (&dG)[RPT],
                                                const float *sStage, const float *sG,
                                                const bf16 *op, int r0, int d) {
#pragma unroll
    for (int i = 0; i < RPT; i++) {
        int r = r0 + RSTEP * i;
        float val = sStage[r * LDS + d] * __expf(sG[r * DC + d]);
        x[i] += val;
        dG[i] += val * __bfloat162float(op[r * LDC + d]);
    }
}

// c += A(16 x 16 ksteps) B(16 ksteps x 16) for a run-time ksteps <= 4; A from
// global memory (layout LA, leading dimension lda), B row-major. Unrolled to
// four predicated steps, so that every A load is issued before the first product.
template <typename LA>
__device__ __forceinline__ void mma_tile_upto4(FragC &c, const bf16 *A, int lda, const bf16 *B,
                                               int ldb, int ksteps) {
    wmma::fragment<wmma::matrix_a, 16, 16, 16, bf16, LA> a[4];
    wmma::fragment<wmma::matrix_b, 16, 16, 16, bf16, RM> b;
#pragma unroll
    for (int kk = 0; kk < 4; kk++)
        if (kk < ksteps)
            ld_s(a[kk], std::is_same<LA, RM>::value ? A + 16 * kk
                                                                      : A + (size_t)16 * kk * lda,
                                   lda);
#pragma unroll
    for (int kk = 0; kk < 4; kk++)
        if (kk < ksteps) {
            ld_s(b, B + (size_t)16 * kk * ldb, ldb);
            wmma::mma_sync(c, a[kk], b, c);
        }
}

// c[0] += A0 B and c[1] += A1 B (16 x 16 ksteps times 16 ksteps x 16), layouts and
// offsets as mma_tile; the two products interleaved, each in mma_tile's k order.
template <typename LA, typename LB>
__device__ __forceinline__ void mma_pair_same_b(FragC (&c)[2], const bf16 *A0, const bf16 *A1,
                                                int lda, const bf16 *B, int ldb, int ksteps) {
    wmma::fragment<wmma::matrix_a, 16, 16, 16, bf16, LA> a0, a1;
    wmma::fragment<wmma::matrix_b, 16, 16, 16, bf16, LB> b;
    for (int kk = 0; kk < ksteps; kk++) {
        const size_t ao = std::is_same<LA, RM>::value ? 16 * kk : (size_t)16 * kk * lda;
        const size_t bo = std::is_same<LB, RM>::value ? (size_t)16 * kk * ldb : 16 * kk;
        ld_s(a0, A0 + ao, lda);
        ld_s(a1, A1 + ao, lda);
        ld_s(b, B + bo, ldb);
        wmma::mma_sync(c[0], a0, b, c[0]);
        wmma::mma_sync(c[1], a1, b, c[1]);
    }
}

// c[0] += A0 (B0 + L0) and c[1] += A1 (B1 + L1) (16 x 16 ksteps times 16 ksteps x 16,
// ksteps <= 4 at run time), the low parts L taken in k-steps lo_begin .. lo_end - 1
// only; A of layout LA from shared memory (leading dimension lda), B and L
// row-major (ldb); SAME_B: B0 = B1 and L0 = L1, loaded once. The two products
// interleaved; each k-step's A fragments serve its high and its low part.
template <typename LA, bool SAME_B>
__device__ __forceinline__ void mma_pair_hilo_upto4(FragC (&c)[2], const bf16 *A0, const bf16 *A1,
                                                    int lda, const bf16 *B0, const bf16 *B1,
                                                    const bf16 *L0, const bf16 *L1, int ldb,
                                                    int ksteps, int lo_begin, int lo_end) {
    wmma::fragment<wmma::matrix_a, 16, 16, 16, bf16, LA> a0, a1;
    wmma::fragment<wmma::matrix_b, 16, 16, 16, bf16, RM> b0, b1;
#pragma unroll
    for (int kk = 0; kk < 4; kk++)
        if (kk < ksteps) {
            const size_t ao = std::is_same<LA, RM>::value ? 16 * kk : (size_t)16 * kk * lda;
            const size_t bo = (size_t)16 * kk * ldb;
            ld_s(a0, A0 + ao, lda);
            ld_s(a1, A1 + ao, lda);
            ld_s(b0, B0 + bo, ldb);
            if (!SAME_B) ld_s(b1, B1 + bo, ldb);
            wmma::mma_sync(c[0], a0, b0, c[0]);
            wmma::mma_sync(c[1], a1, SAME_B ? b0 : b1, c[1]);
            if (kk >= lo_begin && kk < lo_end) {
                ld_s(b0, L0 + bo, ldb);
                if (!SAME_B) ld_s(b1, L1 + bo, ldb);
                wmma::mma_sync(c[0], a0, b0, c[0]);
                wmma::mma_sync(c[1], a1, SAME_B ? b0 : b1, c[1]);
            }
        }
}

// One block per (chunk, sequence*head, DC columns of k). Each thread owns one
// column of RPT rows and accumulates dq, dk and dG there in registers:
// - state terms: dKd = V' dS^T (-> dk, dG, dG_C), dQg = dO' S^T (-> dq, dG),
//   d(k e^G) = M^T dW (-> dk, dG), the decay e^{G_C} sum_v dS S (-> dG_C);
// - the sub-chunk gradients through Aqk and Akk (dAqk, dAkk from kernel A);
// - dg = reverse cumsum of dG (+ dG_C), then the gate: dz, dA_log, ddt_bias.
template <int D, bool FACTORED>
__global__ void __launch_bounds__(bwd_col_threads(D), 2) kda_bwd_col_kernel(Params p) {
    // q, k, z, d_o [B,T,H,D]; h, dh [c][D][D]; vn [c][64][D]; dW [c][64][D];
    // M, dAqk, dAkk [c][64][64]; this block: columns cb*DC .. +DC-1
    constexpr int DC = bwd_col_width(D), NT = bwd_col_threads(D);
    constexpr int LD = D + 8, LDC = DC + 8, LDS = DC + 4, TDC = DC / 16;
    constexpr int RSTEP = COL_RSTEP, RPT = CH / RSTEP, IPB = SUB / RSTEP;
    static_assert(NT == RSTEP * DC && DC % 32 == 0, "kernel B: four threads a column, whole warps");
    static_assert(NT >= CH + CH / 4, "kernel B: beta and the diagonal of dAqk, one copy a thread");
    extern __shared__ __align__(128) unsigned char smem[];
    float *sG = reinterpret_cast<float *>(smem);              // [64][DC]
    float *sStage = sG + CH * DC;                             // [64][LDS]
    bf16 *sQ = reinterpret_cast<bf16 *>(sStage + CH * LDS);   // [64][LDC]
    bf16 *sK = sQ + CH * LDC;                                 // [64][LDC]
    bf16 *sdO = sK + CH * LDC;                                // [64][LD] V', then dO'
    bf16 *sVn = sdO;
    // phase 4, in dO's place: the sub-chunk's row blocks of dAqk and dAkk
    // [16][LAR] and column blocks of dAqk and dAkk [64][LAC]
    constexpr int LAR = CH + 8, LAC = SUB + 8;
    static_assert((size_t)2 * SUB * LAR * 2 + (size_t)2 * CH * LAC * 2 == bwd_col_tiles_bytes() &&
                      bwd_col_tiles_bytes() <= bwd_col_do_bytes<D>() &&
                      bwd_col_tiles_bytes() % 32 == 0,
                  "the blocks of dAqk, dAkk fit dO's place; the operands after them aligned");
    static_assert(bwd_col_ops_bytes<D>() ==
                          (size_t)2 * (2 * CH + SUB) * LDC * 2 &&
                      bwd_col_tiles_bytes() + bwd_col_ops_bytes<D>() <=
                          bwd_col_do_bytes<D>() + bwd_col_state_bytes<D>() &&
                      (size_t)CH * LDC * 2 <= bwd_col_state_bytes<D>(),
                  "the score operands fit from the blocks' end on; z's reload fits");
    bf16 *sAqR = sdO, *sAkR = sAqR + SUB * LAR, *sAqC = sAkR + SUB * LAR, *sAkC = sAqC + CH * LAC;
    bf16 *sM = sdO, *sdW = sM + CH * (CH + 8); // M [64][CH+8], dW [64][LDC], once dO' is dead
    // phase 4: the score operands with their low parts, from the dA blocks' end on.
    // Rows by their index in the chunk: the key operand uses rows 0 .. n0 + 15 (at
    // most), the query side rows n0 .. 63, so a key array and a query-side array
    // shifted by 16 rows share 80 rows: [key hi | q hi], [key lo | q lo], then beta k
    // hi and lo (64 rows each), 288 rows in all
    bf16 *sKbOp = sAkC + CH * LAC, *sQaOp = sKbOp + SUB * LDC;
    bf16 *sKbLo = sKbOp + (CH + SUB) * LDC, *sQaLo = sKbLo + SUB * LDC;
    bf16 *sKaOp = sKbLo + (CH + SUB) * LDC, *sKaLo = sKaOp + CH * LDC;
    unsigned char *RS = reinterpret_cast<unsigned char *>(sdO) + bwd_col_do_bytes<D>();
    // phase 1: h and dh rows of the block's columns
    bf16 *sHs = reinterpret_cast<bf16 *>(RS), *sDh = sHs + DC * LD;
    float *sBeta = reinterpret_cast<float *>(RS + bwd_col_state_bytes<D>()); // [64]
    float *sdAqkDiag = sBeta + CH;                            // [64]
    float *sdGC = sdAqkDiag + CH;                             // [DC] gradient of G_C
    float *sGcPart = sdGC + DC;                               // [RSTEP][DC]
    float *sBetaPart = sGcPart + RSTEP * DC;                  // [64][DC/32]
    // softplus: the 16x16 diagonal blocks of dAqk, dAkk [2][4][16][16],
    // read element by element by the per-pair loop (the factored path reads none)
    bf16 *sDiag = reinterpret_cast<bf16 *>(sBetaPart + CH * (DC / 32));

    // the column blocks of a chunk are launched one after another, so that the
    // chunk's shared operands (V', dO, M, dAqk, dAkk) are read from memory once
    // and found in L2 by the other blocks
    const int cb = blockIdx.x % (D / DC), n = blockIdx.x / (D / DC);
    const int bh = blockIdx.y, b = bh / p.H, h = bh % p.H;
    const int t0 = n * CH, nvalid = min(CH, p.T - t0);
    const size_t c = (size_t)bh * p.N + n;
    const size_t rs = (size_t)p.H * D;
    const size_t base = ((size_t)b * p.T + t0) * rs + (size_t)h * D;
    const size_t cbase = base + (size_t)cb * DC; // the block's first column
    const size_t zbase = ((size_t)b * p.T + t0) * p.dz_ld + (size_t)h * D + (size_t)cb * DC; // dz's (its stride)
    const int tid = threadIdx.x, warp = tid >> 5, lane = tid & 31;
    const bf16 *Mg = p.Mb + c * CH * CH, *dWg = p.dWb + c * CH * D + cb * DC;
    const bf16 *dAqkg = p.dAqkb + c * CH * CH, *dAkkg = p.dAkkb + c * CH * CH;

    // ---- load (cp.async): h and dh rows of the columns, q, k, z of the
    // columns, V' (all columns; dO replaces it after dKd); beta, the diagonal
    // of dAqk ----
    bf16 *sZ = reinterpret_cast<bf16 *>(sStage); // z staged in the (still free) staging buffer
    // the thread's column is the same in every row below (NT is a multiple of DC);
    // the gate's parameters are read first, their latency hidden by the copies
    static_assert(NT % DC == 0, "one column a thread");
    const float A_log = p.A_log[h], bias = p.dt_bias[h * D + cb * DC + tid % DC];
    static_assert(NT % (DC / 8) == 0, "the gate: eight fixed columns a thread");
    float bias8[8]; // dt_bias of the thread's eight columns in the gate phase
#pragma unroll
    for (int e = 0; e < 8; e++) bias8[e] = p.dt_bias[h * D + cb * DC + (tid % (DC / 8)) * 8 + e];
    // What the later phases read from global memory (written by the triangular
    // kernel, mostly no longer in L2): ask for it now, so that those reads find it in L2.
    if (tid == 0) {
        prefetch_l2_bulk(Mg, CH * CH * sizeof(bf16));
        prefetch_l2_bulk(p.dWb + c * CH * D, CH * D * sizeof(bf16));
        prefetch_l2_bulk(dAqkg, CH * CH * sizeof(bf16));
        prefetch_l2_bulk(dAkkg, CH * CH * sizeof(bf16));
    }
    if (tid < nvalid) prefetch_l2_bulk(p.d_o + base + tid * rs, D * sizeof(bf16));
    cp_rows<D, NT>(sHs, LD, p.h + c * D * D + (size_t)cb * DC * D, D, DC, DC);
    cp_rows<D, NT>(sDh, LD, p.dh + c * D * D + (size_t)cb * DC * D, D, DC, DC);
    cp_rows<DC, NT>(sQ, LDC, p.q + cbase, rs, CH, nvalid);
    cp_rows<DC, NT>(sK, LDC, p.k + cbase, rs, CH, nvalid);
    cp_rows<DC, NT>(sZ, LDC, p.z + cbase, rs, CH, nvalid);
    cp_rows<D, NT>(sVn, LD, p.vn + c * CH * D, D, CH, CH);
    if (!FACTORED) {
        for (int idx = tid; idx < 2 * CH * 2; idx += NT) { // 16-byte halves of block rows
            const int mat = idx / (CH * 2), r = (idx / 2) % CH, half = idx % 2, blk = r / SUB;
            const bf16 *src = mat == 0 ? dAqkg : dAkkg;
            cp_async16(sDiag + ((mat * (CH / SUB) + blk) * SUB + r % SUB) * SUB + half * 8,
                       src + (size_t)r * CH + blk * SUB + half * 8, true);
        }
    }
    // beta (rows past T: zeros) and the diagonal of dAqk in the same group
    if (tid < CH)
        cp_async4(sBeta + tid, p.beta + ((size_t)b * p.T + t0 + min(tid, nvalid - 1)) * p.H + h,
                  tid < nvalid);
    else if (tid < CH + CH / 4)
        cp_async16(sdAqkDiag + 4 * (tid - CH), p.dAqkDiag + c * CH + 4 * (tid - CH), true);
    cp_async_commit();
    for (int d = tid; d < DC; d += NT) sdGC[d] = 0.f;
    cp_async_wait<0>();
    __syncthreads();
    const float a_exp = __expf(A_log); // A_log has long landed
    // eight consecutive columns a thread (16-byte reads), their gates independent
#pragma unroll 1
    for (int idx = tid; idx < CH * (DC / 8); idx += NT) {
        const int r = idx / (DC / 8), d8 = (idx % (DC / 8)) * 8;
        float zz[8], g[8];
        ld8(sZ + r * LDC + d8, zz);
#pragma unroll
        for (int e = 0; e < 8; e++) // padded rows: g = 0 keeps G constant past T
            g[e] = r < nvalid ? kda_gate(zz[e], a_exp, bias8[e], p.bounded, p.g_min) : 0.f;
        *reinterpret_cast<float4 *>(sG + r * DC + d8) = make_float4(g[0], g[1], g[2], g[3]);
        *reinterpret_cast<float4 *>(sG + r * DC + d8 + 4) = make_float4(g[4], g[5], g[6], g[7]);
    }
    __syncthreads();
    for (int d = tid; d < DC; d += NT) {
        float acc = 0.f;
        for (int r = 0; r < CH; r++) {
            acc += sG[r * DC + d];
            sG[r * DC + d] = acc;
        }
    }
    __syncthreads();

    const int d = tid % DC, r0 = tid / DC;
    float dq[RPT], dk[RPT], dG[RPT];
#pragma unroll
    for (int i = 0; i < RPT; i++) dq[i] = dk[i] = dG[i] = 0.f;

    // ---- phase 1: products with the chunk's state h and its gradient dh ----
    // dKd = V' dS^T with Kd = k e^{G_C - G}: dk, dG, and dG_C
    static_assert(4 * TDC == 2 * (NT / 32), "the state terms: two tiles a warp");
    // bounded: a tile at a time; softplus: a pair of tiles a warp (each measured the
    // faster for its variant)
    if (FACTORED) {
        for (int tt = warp; tt < 4 * TDC; tt += NT / 32) {
            int i0 = (tt / TDC) * 16, j0 = (tt % TDC) * 16;
            FragC acc;
            wmma::fill_fragment(acc, 0.f);
            mma_tile<RM, CM>(acc, sVn + i0 * LD, LD, sDh + j0 * LD, LD, D / 16);
            st_s(sStage + i0 * LDS + j0, acc, LDS);
        }
    } else { // rows i0 and i0 + 32 of the warp's column tile: two tiles, one B fragment a k-step
        const int i0 = (warp / TDC) * 16, j0 = (warp % TDC) * 16;
        FragC acc[2];
        wmma::fill_fragment(acc[0], 0.f);
        wmma::fill_fragment(acc[1], 0.f);
        mma_pair_same_b<RM, CM>(acc, sVn + i0 * LD, sVn + (i0 + CH / 2) * LD, LD, sDh + j0 * LD,
                                LD, D / 16);
        st_s(sStage + i0 * LDS + j0, acc[0], LDS);
        st_s(sStage + (i0 + CH / 2) * LDS + j0, acc[1], LDS);
    }
    __syncthreads(); // V' is dead: dO replaces it while dKd is consumed
    cp_rows<D, NT>(sdO, LD, p.d_o + base, rs, CH, nvalid);
    cp_async_commit();
    {
        float gc = 0.f;
        const float gC = sG[(CH - 1) * DC + d];
#pragma unroll
        for (int i = 0; i < RPT; i++) {
            int r = r0 + RSTEP * i;
            float val = sStage[r * LDS + d] * __expf(gC - sG[r * DC + d]);
            dk[i] += val;
            float t = val * __bfloat162float(sK[r * LDC + d]);
            dG[i] -= t;
            gc += t;
        }
        sGcPart[r0 * DC + d] = gc; // summed in a fixed order below: deterministic
    }
    cp_async_wait<0>(); // dO has landed
    __syncthreads();
    for (int dd = tid; dd < DC; dd += NT) {
        float acc = 0.f;
        for (int k = 0; k < RSTEP; k++) acc += sGcPart[k * DC + dd];
        sdGC[dd] += acc;
    }
    for (int idx = tid; idx < CH * D / 8; idx += NT) { // dO' = scale dO, 8 per thread
        const int r = idx / (D / 8), dd = (idx % (D / 8)) * 8;
        float x[8];
        ld8(sdO + r * LD + dd, x);
#pragma unroll
        for (int e = 0; e < 8; e++) x[e] *= p.scale;
        st8(sdO + r * LD + dd, x);
    }
    __syncthreads();
    // dQg = dO' S^T: dq += dQg e^G, dG += dQg q e^G
    // bounded: a tile at a time; softplus: a pair of tiles a warp (each measured the
    // faster for its variant)
    if (FACTORED) {
        for (int tt = warp; tt < 4 * TDC; tt += NT / 32) {
            int i0 = (tt / TDC) * 16, j0 = (tt % TDC) * 16;
            FragC acc;
            wmma::fill_fragment(acc, 0.f);
            mma_tile<RM, CM>(acc, sdO + i0 * LD, LD, sHs + j0 * LD, LD, D / 16);
            st_s(sStage + i0 * LDS + j0, acc, LDS);
        }
    } else { // rows i0 and i0 + 32 of the warp's column tile: two tiles, one B fragment a k-step
        const int i0 = (warp / TDC) * 16, j0 = (warp % TDC) * 16;
        FragC acc[2];
        wmma::fill_fragment(acc[0], 0.f);
        wmma::fill_fragment(acc[1], 0.f);
        mma_pair_same_b<RM, CM>(acc, sdO + i0 * LD, sdO + (i0 + CH / 2) * LD, LD, sHs + j0 * LD,
                                LD, D / 16);
        st_s(sStage + i0 * LDS + j0, acc[0], LDS);
        st_s(sStage + (i0 + CH / 2) * LDS + j0, acc[1], LDS);
    }
    __syncthreads(); // dO' is dead: M and the block's dW columns take its place
    cp_rows<CH, NT>(sM, CH + 8, Mg, CH, CH, CH);
    cp_rows<DC, NT>(sdW, LDC, dWg, D, CH, CH);
    cp_async_commit();
    add_staged_rows<RSTEP, LDS, LDC, DC>(dq, dG, sStage, sG, sQ, r0, d);
    cp_async_wait<0>(); // M and dW have landed
    __syncthreads();
    // W = M (k e^G): d(k e^G) = M^T dW; dk += d(k e^G) e^G, dG += d(k e^G) k e^G
    for (int tt = warp; tt < 4 * TDC; tt += NT / 32) {
        int i0 = (tt / TDC) * 16, j0 = (tt % TDC) * 16;
        FragC acc;
        wmma::fill_fragment(acc, 0.f);
        mma_tile<CM, RM>(acc, sM + i0, CH + 8, sdW + j0, LDC, CH / 16);
        st_s(sStage + i0 * LDS + j0, acc, LDS);
    }
    // decay of the state: dG_C += e^{G_C} sum_v dS[d,v] S[d,v] (four threads per
    // row, D/4 consecutive values each, 16-byte reads)
    {
        static_assert(NT == 4 * DC, "decay: four threads per row");
        const int dd = tid / 4, v0 = (tid % 4) * (D / 4);
        float acc = 0.f;
#pragma unroll
        for (int v = v0; v < v0 + D / 4; v += 8) {
            float x[8], y[8];
            ld8(sDh + dd * LD + v, x);
            ld8(sHs + dd * LD + v, y);
#pragma unroll
            for (int e = 0; e < 8; e++) acc += x[e] * y[e];
        }
        acc += __shfl_xor_sync(0xffffffffu, acc, 1);
        acc += __shfl_xor_sync(0xffffffffu, acc, 2);
        if (tid % 4 == 0) sdGC[dd] += __expf(sG[(CH - 1) * DC + dd]) * acc;
    }
    __syncthreads(); // h and dh are dead: the region takes the sub-chunk operands
    add_staged_rows<RSTEP, LDS, LDC, DC>(dk, dG, sStage, sG, sK, r0, d);
    __syncthreads();

    // ---- phase 4: gradients through Aqk = Lower(q e^G (k e^-G)^T) and
    // Akk = StrictLower(Diag(beta) k e^G (k e^-G)^T), by sub-chunks.
    // Query side of block p anchored at its first row n0 (as the forward);
    // key side anchored at its last row m (exponents <= 0 off the diagonal).
    // The loop is not unrolled (the kernel's code size matters: see docs/cuda.md);
    // the rows of sub-chunk pb are the first IPB entries of dq, dk, dG, which
    // rotate by IPB after each sub-chunk (back in place after the last).
    // the sub-chunk's blocks of dAqk, dAkk (written by the
    // triangular kernel) into shared memory, in flight while operands are built
    auto issue_tiles = [&](int pb) {
        const int n0 = pb * SUB;
        if (FACTORED) {
            // Each loop runs over a fixed (matrix, row, 16-byte piece) range, so that its
            // indices come from shifts, and skips the pieces outside the blocks (in the
            // softplus variant this form measured slower: it keeps the one below).
            // row blocks: pb + 1 tiles
            for (int idx = tid; idx < 2 * SUB * (CH / 8); idx += NT) {
                const int mat = idx / (SUB * (CH / 8)), r = (idx / (CH / 8)) % SUB;
                const int cc = (idx % (CH / 8)) * 8;
                if (cc < (pb + 1) * SUB)
                    cp_async16((mat ? sAkR : sAqR) + r * LAR + cc,
                               (mat ? dAkkg : dAqkg) + (size_t)(n0 + r) * CH + cc, true);
            }
            for (int idx = tid; idx < 2 * CH * 2; idx += NT) { // column blocks: rows n0..63
                const int mat = idx / (2 * CH), r = (idx / 2) % CH, cc = (idx % 2) * 8;
                if (r < CH - n0)
                    cp_async16((mat ? sAkC : sAqC) + r * LAC + cc,
                               (mat ? dAkkg : dAqkg) + (size_t)(n0 + r) * CH + n0 + cc, true);
            }
        } else {
            const int nr = SUB * 2 * (pb + 1); // 16-byte pieces of a row block (pb + 1 blocks)
            for (int idx = tid; idx < 2 * nr; idx += NT) {
                const int mat = idx / nr, q = idx % nr, r = q / (2 * (pb + 1));
                const int cc = (q % (2 * (pb + 1))) * 8;
                cp_async16((mat ? sAkR : sAqR) + r * LAR + cc,
                           (mat ? dAkkg : dAqkg) + (size_t)(n0 + r) * CH + cc, true);
            }
            const int ncol = 2 * (CH - n0); // 16-byte pieces of a column block (rows n0..63)
            for (int idx = tid; idx < 2 * ncol; idx += NT) {
                const int mat = idx / ncol, q = idx % ncol, r = q / 2, cc = (q % 2) * 8;
                cp_async16((mat ? sAkC : sAqC) + r * LAC + cc,
                           (mat ? dAkkg : dAqkg) + (size_t)(n0 + r) * CH + n0 + cc, true);
            }
        }
        cp_async_commit();
    };
    // Low parts (x = hi + lo, each bf16: about 16 bits). A pair i > j of Aqk or Akk
    // enters dG_i (row side, through the key operand k_j e^{G_n0 - G_j}) and dG_j
    // (column side, through q_i or beta_i k_i times e^{G_i - G_m}) with opposite
    // signs, and the reverse cumsum of dG cancels them for every t <= j; with
    // the operands in plain bf16 the two sides round apart and the residue stays
    // in dg (and adds up coherently in dA_log, ddt_bias). With hi + lo both sides
    // carry the pair to about 2^-16. dA is rounded once (dAqk, dAkk in bf16) and
    // read by both sides. gate_split = 0 (LONGMOE_KDA_GATE_SPLIT=0) keeps low
    // parts for the factored diagonal block only, for timing (docs/cuda.md).
    const bool split = p.gate_split != 0;
    issue_tiles(0);
#pragma unroll 1
    for (int pb = 0; pb < CH / SUB; pb++) {
        const int n0 = pb * SUB, m = n0 + SUB - 1;
        const int kb_rows = FACTORED ? n0 + SUB : n0; // key operand: rows 0 .. kb_rows - 1
        const int qa_from = FACTORED ? n0 : n0 + SUB; // query-side operands: rows qa_from .. 63
        // the rows with a low part: key operand rows kb_lo .. kb_rows - 1, query-side
        // rows qa_from .. qa_lo_end - 1 (whole k-steps of the products below)
        const int kb_lo = split ? 0 : FACTORED ? n0 : kb_rows;
        const int qa_lo_end = split ? CH : FACTORED ? m + 1 : qa_from;
        // eight consecutive columns a thread, 16-byte accesses
        constexpr int VPR = DC / 8;
        for (int idx = tid; idx < kb_rows * VPR; idx += NT) {
            const int j = idx / VPR, dd = (idx % VPR) * 8;
            float x[8], ga[8], gj[8];
            ld8(sK + j * LDC + dd, x);
            ldf8(sG + n0 * DC + dd, ga);
            ldf8(sG + j * DC + dd, gj);
#pragma unroll
            for (int e = 0; e < 8; e++) x[e] *= __expf(ga[e] - gj[e]);
            st8(sKbOp + j * LDC + dd, x);
            if (j >= kb_lo) {
#pragma unroll
                for (int e = 0; e < 8; e++) x[e] -= __bfloat162float(__float2bfloat16(x[e]));
                st8(sKbLo + j * LDC + dd, x);
            }
        }
        for (int idx = qa_from * VPR + tid; idx < CH * VPR; idx += NT) {
            const int i = idx / VPR, dd = (idx % VPR) * 8;
            float xq[8], xk[8], gi[8], gm[8];
            ld8(sQ + i * LDC + dd, xq);
            ld8(sK + i * LDC + dd, xk);
            ldf8(sG + i * DC + dd, gi);
            ldf8(sG + m * DC + dd, gm);
            const float bi = sBeta[i]; // Akk = Diag(beta) ...: beta_i folded into the operand
#pragma unroll
            for (int e = 0; e < 8; e++) {
                const float ex = __expf(gi[e] - gm[e]);
                xq[e] *= ex;
                xk[e] = xk[e] * ex * bi;
            }
            st8(sQaOp + i * LDC + dd, xq);
            st8(sKaOp + i * LDC + dd, xk);
            if (i < qa_lo_end) {
#pragma unroll
                for (int e = 0; e < 8; e++) {
                    xq[e] -= __bfloat162float(__float2bfloat16(xq[e]));
                    xk[e] -= __bfloat162float(__float2bfloat16(xk[e]));
                }
                st8(sQaLo + i * LDC + dd, xq);
                st8(sKaLo + i * LDC + dd, xk);
            }
        }
        cp_async_wait<0>(); // the sub-chunk's blocks of dAqk, dAkk
        __syncthreads();
        const int nq = FACTORED ? pb + 1 : pb;      // key blocks t <= p (query side)
        const int s0 = FACTORED ? pb : pb + 1;      // query blocks s >= p (key side)
        // a warp a pair of tiles with the same k-steps: (dAqk, dAkk) rows times the key
        // operand (one B fragment for both), or (dAqk, dAkk) columns times the
        // query-side q and beta k; the two products interleaved, each k-step's low
        // part right after its high part (the same A fragments)
        static_assert(NT / 32 == 2 * TDC, "one pair of tiles a warp");
        {
            const int pair = warp / TDC, j0 = (warp % TDC) * 16;
            FragC acc[2];
            wmma::fill_fragment(acc[0], 0.f);
            wmma::fill_fragment(acc[1], 0.f);
            if (pair == 0) {
                mma_pair_hilo_upto4<RM, true>(acc, sAqR, sAkR, LAR, sKbOp + j0, sKbOp + j0,
                                              sKbLo + j0, sKbLo + j0, LDC, nq, kb_lo / SUB, nq);
            } else {
                const int ao = (s0 - pb) * SUB * LAC, bo = s0 * SUB * LDC + j0;
                mma_pair_hilo_upto4<CM, false>(acc, sAqC + ao, sAkC + ao, LAC, sQaOp + bo,
                                               sKaOp + bo, sQaLo + bo, sKaLo + bo, LDC,
                                               CH / SUB - s0, 0, (qa_lo_end - qa_from) / SUB);
            }
            st_s(sStage + 2 * pair * SUB * LDS + j0, acc[0], LDS);
            st_s(sStage + (2 * pair + 1) * SUB * LDS + j0, acc[1], LDS);
        }
        __syncthreads();
        if (pb + 1 < CH / SUB) issue_tiles(pb + 1); // the tiles' buffer is free again
        float part[IPB]; // the dbeta term of each row, this thread's column
#pragma unroll
        for (int i = 0; i < IPB; i++) {
            const int r = n0 + r0 + RSTEP * i, rl = r - n0;
            const float Gr = sG[r * DC + d];
            float rq = sStage[rl * LDS + d] * __expf(Gr - sG[n0 * DC + d]);
            float rk = sStage[(SUB + rl) * LDS + d] * __expf(Gr - sG[n0 * DC + d]);
            float cq = sStage[(2 * SUB + rl) * LDS + d] * __expf(sG[m * DC + d] - Gr);
            float ck = sStage[(3 * SUB + rl) * LDS + d] * __expf(sG[m * DC + d] - Gr);
            if (!FACTORED) {
                // Softplus fallback: the diagonal block per position pair, its
                // dAqk, dAkk, Diag(beta) dAkk entries from the staged blocks
                const bf16 *bq = sDiag + pb * SUB * SUB, *bk = bq + CH / SUB * SUB * SUB;
                for (int jj = 0; jj < SUB; jj++) {
                    const int j = n0 + jj;
                    if (j < r) {
                        float e = __expf(Gr - sG[j * DC + d]);
                        float kj = __bfloat162float(sK[j * LDC + d]) * e;
                        rq += __bfloat162float(bq[rl * SUB + jj]) * kj;
                        rk += __bfloat162float(bk[rl * SUB + jj]) * kj;
                    }
                    if (j > r) {
                        float e = __expf(sG[j * DC + d] - Gr);
                        cq += __bfloat162float(bq[jj * SUB + rl]) *
                              __bfloat162float(sQ[j * LDC + d]) * e;
                        ck += __bfloat162float(bk[jj * SUB + rl]) * sBeta[j] *
                              __bfloat162float(sK[j * LDC + d]) * e;
                    }
                }
            }
            const float qv = __bfloat162float(sQ[r * LDC + d]);
            const float kv = __bfloat162float(sK[r * LDC + d]);
            const float br = sBeta[r];
            const float dii = sdAqkDiag[r];
            dq[i] += rq + dii * kv;
            dG[i] += qv * rq;
            dk[i] += br * rk + cq + ck + dii * qv;
            dG[i] += br * kv * rk - kv * (cq + ck);
            part[i] = kv * rk;
        }
        { // the dbeta terms of the warp's IPB = 4 rows, summed over its 32 columns:
          // halve the rows held per lane twice, then a 3-step butterfly (6 shuffles)
            static_assert(IPB == 4, "four rows a thread per sub-chunk");
            const bool hi16 = lane & 16, hi8 = lane & 8;
            float k0 = hi16 ? part[2] : part[0], k1 = hi16 ? part[3] : part[1];
            k0 += __shfl_xor_sync(0xffffffffu, hi16 ? part[0] : part[2], 16);
            k1 += __shfl_xor_sync(0xffffffffu, hi16 ? part[1] : part[3], 16);
            float k = hi8 ? k1 : k0;
            k += __shfl_xor_sync(0xffffffffu, hi8 ? k0 : k1, 8);
            k += __shfl_xor_sync(0xffffffffu, k, 4);
            k += __shfl_xor_sync(0xffffffffu, k, 2);
            k += __shfl_xor_sync(0xffffffffu, k, 1);
            if ((lane & 7) == 0) { // lane 8 i holds row i
                const int r = n0 + r0 + RSTEP * (lane >> 3);
                sBetaPart[r * (DC / 32) + d / 32] = k;
            }
        }
        rotate_left<IPB, RPT>(dq);
        rotate_left<IPB, RPT>(dk);
        rotate_left<IPB, RPT>(dG);
        // no barrier here: the next sub-chunk writes only the operand region (read by
        // the products above, before the last barrier) until its own first barrier,
        // which every thread reaches after its reads of sStage
    }
    __syncthreads(); // every row's dbeta part and every read of sStage are done

    if (tid < CH) {
        float acc = 0.f;
        for (int w = 0; w < DC / 32; w++) acc += sBetaPart[tid * (DC / 32) + w];
        p.dbeta_part[(c * (1 + D / DC) + 1 + cb) * CH + tid] = acc; // D / DC: bwd_col_blocks
    }
    // ---- G = cumsum(g): dg_t = dG_C + sum_{i >= t} dG_i; then the gate ----
    // z again, for the gate's derivative: into the (now free) operand region,
    // in flight during the sums below
    bf16 *sZ2 = reinterpret_cast<bf16 *>(RS);
    cp_rows<DC, NT>(sZ2, LDC, p.z + cbase, rs, CH, nvalid);
    cp_async_commit();
#pragma unroll
    for (int i = 0; i < RPT; i++) sStage[(r0 + RSTEP * i) * LDS + d] = dG[i];
    __syncthreads();
    for (int dd = tid; dd < DC; dd += NT) {
        float acc = sdGC[dd];
        for (int r = CH - 1; r >= 0; r--) {
            acc += sStage[r * LDS + dd];
            sStage[r * LDS + dd] = acc;
        }
    }
#pragma unroll
    for (int i = 0; i < RPT; i++) {
        int r = r0 + RSTEP * i;
        if (r < nvalid) {
            p.dq[cbase + r * rs + d] = __float2bfloat16(dq[i]);
            p.dk[cbase + r * rs + d] = __float2bfloat16(dk[i]);
        }
    }
    cp_async_wait<0>(); // z has landed
    __syncthreads();
    float dbias = 0.f, dA = 0.f;
#pragma unroll 1
    for (int i = 0; i < RPT; i++) {
        int r = r0 + RSTEP * i;
        if (r < nvalid) {
            float dg = sStage[r * LDS + d];
            float gz, gA;
            kda_gate_grad(__bfloat162float(sZ2[r * LDC + d]), a_exp, bias, p.bounded, p.g_min,
                          &gz, &gA);
            float dzv = dg * gz;
            p.dz[zbase + r * p.dz_ld + d] = __float2bfloat16(dzv);
            dbias += dzv;
            dA += dg * gA;
        }
    }
    // the chunk's terms of ddt_bias and dA_log, summed over chunks by kda_bwd_gate_param_kernel
    p.ddt_part[(c * BWD_GATE_ROW_GROUPS + r0) * D + cb * DC + d] = dbias;
#pragma unroll
    for (int off = 16; off > 0; off >>= 1) dA += __shfl_xor_sync(0xffffffffu, dA, off);
    if (lane == 0) p.dA_part[(c * (D / DC) + cb) * (NT / 32) + warp] = dA;
    static_assert((D / DC) * (NT / 32) == bwd_gate_dA_terms(D) && D / DC == bwd_col_blocks(D),
                  "the workspace plan's gate partials (kda_common.cuh) match kernel B");
}
static_assert(COL_RSTEP == BWD_GATE_ROW_GROUPS,
              "the workspace plan's gate partials (kda_common.cuh) match kernel B");

// ddt_bias and dA_log += the sums of kernel B's per-chunk terms, in a fixed
// order (deterministic, unlike float atomics), accumulated in double. Grid
// (D/32 + 1, H), block (32, GATE_SLICES): blocks x < D/32 own 32 columns of
// ddt_bias of head h, block x = D/32 owns dA_log[h]. Each of the GATE_SLICES
// thread rows sums every GATE_SLICES-th term; the slices are then added by a
// fixed tree.
constexpr int GATE_SLICES = 32;
template <int D> __global__ void __launch_bounds__(32 * GATE_SLICES) kda_bwd_gate_param_kernel(Params p) {
    // ddt_part [B*H*N][4][D]; dA_part [B*H*N][bwd_gate_dA_terms(D) = D/8]
    __shared__ double part[GATE_SLICES][32];
    const int h = blockIdx.y, x = threadIdx.x, y = threadIdx.y;
    const bool is_dA = blockIdx.x == D / 32;
    // terms per (b, h): a contiguous run of `run` values (stride `step`) for each b
    const size_t run = is_dA ? (size_t)p.N * bwd_gate_dA_terms(D) : (size_t)p.N * BWD_GATE_ROW_GROUPS;
    const size_t m = (size_t)p.B * run;
    double acc = 0.0;
    if (is_dA) {
        // one value per term: the 32 lanes and the slices split the terms
        for (size_t j = (size_t)y * 32 + x; j < m; j += 32 * GATE_SLICES) {
            const size_t b = j / run, i = j % run;
            acc += (double)p.dA_part[(b * p.H + h) * run + i];
        }
    } else {
        const int col = blockIdx.x * 32 + x;
        for (size_t j = y; j < m; j += GATE_SLICES) {
            const size_t b = j / run, i = j % run;
            acc += (double)p.ddt_part[((b * p.H + h) * run + i) * D + col];
        }
    }
    part[y][x] = acc;
    __syncthreads();
    for (int half = GATE_SLICES / 2; half > 0; half >>= 1) {
        if (y < half) part[y][x] += part[y + half][x];
        __syncthreads();
    }
    if (y != 0) return;
    if (is_dA) {
        // the 32 lanes' sums, by a fixed tree
        double v = part[0][x];
#pragma unroll
        for (int off = 16; off > 0; off >>= 1) v += __shfl_xor_sync(0xffffffffu, v, off);
        if (x == 0) p.dA_log[h] += (float)v;
    } else {
        p.ddt_bias[(size_t)h * D + blockIdx.x * 32 + x] += (float)part[0][x];
    }
}

// dbeta = the kernel-A term + the kernel-B term of each column block, added
// in this order (deterministic). One thread per (b, t, h).
template <int D> __global__ void kda_bwd_dbeta_kernel(Params p) {
    // dbeta [B,T,H]; dbeta_part [c][1 + bwd_col_blocks(D)][64]
    const size_t idx = (size_t)blockIdx.x * blockDim.x + threadIdx.x;
    if (idx >= (size_t)p.B * p.T * p.H) return;
    const int h = (int)(idx % p.H);
    const size_t bt = idx / p.H;
    const int t = (int)(bt % p.T), b = (int)(bt / p.T);
    const size_t c = ((size_t)b * p.H + h) * p.N + t / CH;
    constexpr int NB = bwd_col_blocks(D);
    const float *part = p.dbeta_part + c * (1 + NB) * CH + t % CH;
    float acc = part[0];
#pragma unroll
    for (int k = 1; k <= NB; k++) acc += part[k * CH];
    p.dbeta[idx] = acc;
}

// Two blocks per SM: 228 KB of shared memory per SM, 1 KB of it reserved per block.
static_assert(bwd_tri_smem<128>() + 1024 <= 228 * 1024 / 2, "kernel A: two blocks per SM");
static_assert(bwd_col_smem<128>() + 1024 <= 228 * 1024 / 2, "kernel B: two blocks per SM");
static_assert(bwd_col_smem<64>() + 1024 <= 228 * 1024 / 2, "kernel B (D 64): two blocks per SM");
static_assert(bwd_tri_smem<32>() + 1024 <= 228 * 1024 / 2, "kernel A (D 32): two blocks per SM");
static_assert(bwd_col_smem<32>() + 1024 <= 228 * 1024 / 2, "kernel B (D 32): two blocks per SM");

// Launch with the largest shared-memory carveout, so that two blocks fit.
template <typename Kern>
static cudaError_t launch_two_per_sm(Kern kern, dim3 grid, int threads, size_t smem,
                                     cudaStream_t s, const Params &p) {
    cudaError_t e = cudaFuncSetAttribute(kern, cudaFuncAttributePreferredSharedMemoryCarveout,
                                         (int)cudaSharedmemCarveoutMaxShared);
    if (e != cudaSuccess) return e;
    return launch_with_smem(kern, grid, threads, smem, s, p);
}

template <int D>
static cudaError_t launch_bwd_intra_d(const Params &p, bool factored, cudaStream_t s) {
    cudaError_t e = launch_two_per_sm(kda_bwd_tri_kernel<D>, dim3(p.N, p.B * p.H), BWD_NT,
                                      bwd_tri_smem<D>(), s, p);
    if (e != cudaSuccess) return e;
    dim3 grid(p.N * bwd_col_blocks(D), p.B * p.H); // a chunk's column blocks adjacent
    constexpr int NTB = bwd_col_threads(D);
    e = factored ? launch_two_per_sm(kda_bwd_col_kernel<D, true>, grid, NTB, bwd_col_smem<D>(), s, p)
                 : launch_two_per_sm(kda_bwd_col_kernel<D, false>, grid, NTB, bwd_col_smem<D>(), s,
                                     p);
    if (e != cudaSuccess) return e;
    const size_t ntok = (size_t)p.B * p.T * p.H;
    kda_bwd_dbeta_kernel<D><<<(unsigned)((ntok + 255) / 256), 256, 0, s>>>(p);
    e = cudaGetLastError();
    if (e != cudaSuccess) return e;
    kda_bwd_gate_param_kernel<D><<<dim3(D / 32 + 1, p.H), dim3(32, GATE_SLICES), 0, s>>>(p);
    return cudaGetLastError();
}

// LONGMOE_KDA_GATE_SPLIT=0 gives the per-column kernel's low operand parts to the
// factored diagonal blocks only (the earlier kernels' extent; dAkk keeps its one
// rounding): for timing the split against no split in one build. Unset or 1: every
// block. Any other value is reported once and ignored.
static int gate_split_setting() {
    const char *e = getenv("LONGMOE_KDA_GATE_SPLIT");
    if (!e || !*e || !strcmp(e, "1")) return 1;
    if (!strcmp(e, "0")) return 0;
    static bool warned = false;
    if (!warned)
        fprintf(stderr, "longmoe: LONGMOE_KDA_GATE_SPLIT=%s ignored: use 0 or 1\n", e);
    warned = true;
    return 1;
}

cudaError_t launch_bwd_intra(const Params &p0, int D, bool factored, cudaStream_t s) {
    Params p = p0;
    p.gate_split = gate_split_setting();
    if (D == 128) return launch_bwd_intra_d<128>(p, factored, s);
    if (D == 64) return launch_bwd_intra_d<64>(p, factored, s);
    if (D == 32) return launch_bwd_intra_d<32>(p, factored, s);
    return cudaErrorInvalidValue; // lm_kda_cuda_check refuses other head dimensions
}

} // namespace lmkda

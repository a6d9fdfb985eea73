// KDA backward on Hopper: the intra-chunk gradient kernel (dq, dk, dv, dbeta, dz, dA_log, ddt_bias).
// Derivation in docs/cuda.md; forward equations in SPEC §2 "Chunked form".
#include "kda_common.cuh"

namespace lmkda {

// Threads of the intra-chunk gradient kernel (16 warps: two per scheduler
// were too few to hide the latency of one block per SM).
constexpr int BWD_NT = 512;

// Shared memory of the intra-chunk gradient kernel, in bytes: persistent
// buffers, then six regions of RSZ bytes and one of [64][72] bf16, reused
// across phases (see the region comments in the kernel).
template <int D> __host__ __device__ constexpr size_t bwd_region() {
    return (size_t)CH * (D + 8) * 2 > (size_t)CH * (CH + 4) * 4 ? (size_t)CH * (D + 8) * 2
                                                                 : (size_t)CH * (CH + 4) * 4;
}
template <int D> __host__ __device__ constexpr size_t bwd_intra_smem() {
    return (size_t)CH * D * 4 + (size_t)CH * (D + 4) * 4 + (size_t)2 * CH * (D + 8) * 2 +
           (size_t)(3 * CH + D) * 4 + 6 * bwd_region<D>() + (size_t)CH * (CH + 8) * 2 +
           (size_t)3 * SUB * (D + 8) * 2;
}

// One block per (chunk, sequence*head). Each thread owns column d = tid % D
// of rows r0 + RSTEP*i and accumulates dq, dk and dG there in registers.
template <int D, bool FACTORED>
__global__ void __launch_bounds__(BWD_NT, 1) kda_bwd_intra_kernel(Params p) {
    // q, k, v, z, d_o [B,T,H,D]; h, dh [c][D][D]; vn, dvn [c][64][D]; X [c][64][64]
    constexpr int NT = BWD_NT, LD = D + 8, LDA = CH + 4, LDM = CH + 8, LDS = D + 4;
    constexpr int RSTEP = NT / D, RPT = CH / RSTEP, IPB = SUB / RSTEP, TD = D / 16;
    extern __shared__ __align__(128) unsigned char smem[];
    float *sG = reinterpret_cast<float *>(smem);          // [64][D]
    float *sStage = sG + CH * D;                          // [64][LDS]
    bf16 *sQ = reinterpret_cast<bf16 *>(sStage + CH * LDS); // [64][LD]
    bf16 *sK = sQ + CH * LD;
    float *sBeta = reinterpret_cast<float *>(sK + CH * LD); // [64]
    float *sdBeta = sBeta + CH;                             // [64]
    float *sdGC = sdBeta + CH;                              // [D] gradient of G_C
    float *sdAqkDiag = sdGC + D;                            // [64] diagonal of dAqk
    unsigned char *R = reinterpret_cast<unsigned char *>(sdAqkDiag + CH);
    constexpr size_t RSZ = bwd_region<D>();
    // Regions (phase 1-2 use / phase 3-4 reuse):
    bf16 *sdO = reinterpret_cast<bf16 *>(R);               // R0: dO' -> dM -> key operand
    float *sdM = reinterpret_cast<float *>(R);
    bf16 *sKbOp = reinterpret_cast<bf16 *>(R);
    bf16 *sV = reinterpret_cast<bf16 *>(R + RSZ);          // R1: v -> dAkk (fp32)
    float *sdAkk = reinterpret_cast<float *>(R + RSZ);
    bf16 *sdW = reinterpret_cast<bf16 *>(R + 2 * RSZ);     // R2: dW -> query operand
    bf16 *sQaOp = sdW;
    bf16 *sKgp = reinterpret_cast<bf16 *>(R + 3 * RSZ);    // R3: k e^G -> dAkk, beta dAkk (bf16)
    bf16 *sdAkkb = sKgp, *sdAkkBb = sKgp + CH * CH;
    float *sX = reinterpret_cast<float *>(R + 4 * RSZ);    // R4: X -> key-side k operand
    bf16 *sKaOp = reinterpret_cast<bf16 *>(R + 4 * RSZ);
    bf16 *sMb = reinterpret_cast<bf16 *>(R + 5 * RSZ);     // R5: M (bf16) -> dAqk (bf16)
    bf16 *sdAqkb = sMb;
    float *sdAqk = reinterpret_cast<float *>(R + 5 * RSZ + (size_t)CH * LDM * 2); // R6: dAqk -> T1
    float *sT1 = sdAqk;
    // low bf16 parts of the diagonal block's operands (factored path): [16][LD] each
    bf16 *sKbLo = reinterpret_cast<bf16 *>(R + 6 * RSZ + (size_t)CH * LDM * 2);
    bf16 *sQaLo = sKbLo + SUB * LD, *sKaLo = sQaLo + SUB * LD;
    // partial sums, summed in a fixed order (no float atomics: the same
    // inputs give the same bits): dG_C by row group in phase 1 (in the
    // low-part buffers, idle until phase 4) and dbeta by warp in phase 4 (in R1)
    float *sGcPart = reinterpret_cast<float *>(sKbLo);          // [RSTEP][D]
    float *sBetaPart = reinterpret_cast<float *>(R + RSZ);      // [64][D/32]

    const int n = blockIdx.x, bh = blockIdx.y, b = bh / p.H, h = bh % p.H;
    const int t0 = n * CH, nvalid = min(CH, p.T - t0);
    const size_t c = (size_t)bh * p.N + n;
    const size_t rs = (size_t)p.H * D;
    const size_t base = ((size_t)b * p.T + t0) * rs + (size_t)h * D;
    const int tid = threadIdx.x, warp = tid >> 5, lane = tid & 31;
    const bf16 *hc = p.h + c * D * D, *dhc = p.dh + c * D * D;
    const bf16 *vnc = p.vn + c * CH * D, *dvnc = p.dvn + c * CH * D;

    // ---- load: q, k, v, dO' = scale dO, g -> G, beta, X ----
    load_rows<D, NT>(sQ, LD, p.q + base, rs, CH, nvalid);
    load_rows<D, NT>(sK, LD, p.k + base, rs, CH, nvalid);
    load_rows<D, NT>(sV, LD, p.v + base, rs, CH, nvalid);
    load_rows<D, NT>(sdO, LD, p.d_o + base, rs, CH, nvalid);
    bf16 *sZ = reinterpret_cast<bf16 *>(sStage); // z staged in the (still free) staging buffer
    load_rows<D, NT>(sZ, LD, p.z + base, rs, CH, nvalid);
    for (int idx = tid; idx < CH * CH / 4; idx += NT) {
        float4 x4 = reinterpret_cast<const float4 *>(p.X + c * CH * CH)[idx];
        int i = (4 * idx) / CH, j = (4 * idx) % CH;
        *reinterpret_cast<float4 *>(sX + i * LDA + j) = x4;
    }
    __syncthreads();
    const float a_exp = __expf(p.A_log[h]);
    for (int idx = tid; idx < CH * D; idx += NT) {
        int r = idx / D, d = idx % D;
        float g = 0.f;
        if (r < nvalid)
            g = kda_gate(__bfloat162float(sZ[r * LD + d]), a_exp, p.dt_bias[h * D + d], p.bounded,
                         p.g_min);
        sG[idx] = g;
        sdO[r * LD + d] = __float2bfloat16(p.scale * __bfloat162float(sdO[r * LD + d]));
    }
    if (tid < CH) {
        sBeta[tid] = tid < nvalid ? p.beta[((size_t)b * p.T + t0 + tid) * p.H + h] : 0.f;
        sdBeta[tid] = 0.f;
    }
    for (int d = tid; d < D; d += NT) sdGC[d] = 0.f;
    // The state products read h and dh [D][D] from shared memory: rows < 64
    // in R2, rows >= 64 in R6 (both free until phase 1 writes dW and dAqk).
    // dh first; h replaces it after dKd.
    bf16 *sH0 = sdW, *sH1 = reinterpret_cast<bf16 *>(sdAqk);
    auto stage_state = [&](const bf16 *src) {
        for (int idx = tid; idx < D * (D / 8); idx += NT) {
            int r = idx / (D / 8), cc = (idx % (D / 8)) * 8;
            bf16 *dst = r < CH ? sH0 + r * LD + cc : sH1 + (r - CH) * LD + cc;
            cp_async16(dst, src + (size_t)r * D + cc, true);
        }
        cp_async_commit();
    };
    // B operand for output columns j0..j0+15: rows j0.. of the staged matrix
    auto state_rows = [&](int j0) { return j0 < CH ? sH0 + j0 * LD : sH1 + (j0 - CH) * LD; };
    stage_state(dhc);
    __syncthreads();
    for (int d = tid; d < D; d += NT) {
        float acc = 0.f;
        for (int r = 0; r < CH; r++) {
            acc += sG[r * D + d];
            sG[r * D + d] = acc;
        }
    }
    __syncthreads();
    for (int idx = tid; idx < CH * CH; idx += NT) {
        int i = idx / CH, j = idx % CH;
        sMb[i * LDM + j] = __float2bfloat16(sX[i * LDA + j] * sBeta[j]);
    }
    for (int idx = tid; idx < CH * D; idx += NT) {
        int r = idx / D, d = idx % D;
        sKgp[r * LD + d] = __float2bfloat16(__bfloat162float(sK[r * LD + d]) * __expf(sG[idx]));
    }
    cp_async_wait<0>(); // dh has landed
    __syncthreads();

    const int d = tid % D, r0 = tid / D;
    float dq[RPT], dk[RPT], dG[RPT];
#pragma unroll
    for (int i = 0; i < RPT; i++) dq[i] = dk[i] = dG[i] = 0.f;

    // ---- phase 1: products with the chunk's state h and its gradient dh ----
    // dKd = V' dS^T with Kd = k e^{G_C - G}: dk, dG, and dG_C
    for (int tt = warp; tt < 4 * TD; tt += NT / 32) {
        int i0 = (tt / TD) * 16, j0 = (tt % TD) * 16;
        FragC acc;
        wmma::fill_fragment(acc, 0.f);
        mma_tile<RM, CM>(acc, vnc + i0 * D, D, state_rows(j0), LD, D / 16);
        wmma::store_matrix_sync(sStage + i0 * LDS + j0, acc, LDS, wmma::mem_row_major);
    }
    __syncthreads();
    stage_state(hc); // h replaces dh while dKd is consumed
    {
        float gc = 0.f;
#pragma unroll
        for (int i = 0; i < RPT; i++) {
            int r = r0 + RSTEP * i;
            float val = sStage[r * LDS + d] * __expf(sG[(CH - 1) * D + d] - sG[r * D + d]);
            dk[i] += val;
            float t = val * __bfloat162float(sK[r * LD + d]);
            dG[i] -= t;
            gc += t;
        }
        sGcPart[r0 * D + d] = gc; // summed in a fixed order below: deterministic
    }
    cp_async_wait<0>();
    __syncthreads();
    for (int dd = tid; dd < D; dd += NT) {
        float acc = 0.f;
        for (int k = 0; k < RSTEP; k++) acc += sGcPart[k * D + dd];
        sdGC[dd] += acc;
    }
    // dQg = dO' S^T: dq += dQg e^G, dG += dQg q e^G
    for (int tt = warp; tt < 4 * TD; tt += NT / 32) {
        int i0 = (tt / TD) * 16, j0 = (tt % TD) * 16;
        FragC acc;
        wmma::fill_fragment(acc, 0.f);
        mma_tile<RM, CM>(acc, sdO + i0 * LD, LD, state_rows(j0), LD, D / 16);
        wmma::store_matrix_sync(sStage + i0 * LDS + j0, acc, LDS, wmma::mem_row_major);
    }
    __syncthreads();
#pragma unroll
    for (int i = 0; i < RPT; i++) {
        int r = r0 + RSTEP * i;
        float val = sStage[r * LDS + d] * __expf(sG[r * D + d]);
        dq[i] += val;
        dG[i] += val * __bfloat162float(sQ[r * LD + d]);
    }
    __syncthreads();
    // dW = -dV' S^T (bf16 operand for phase 2)
    for (int tt = warp; tt < 4 * TD; tt += NT / 32) {
        int i0 = (tt / TD) * 16, j0 = (tt % TD) * 16;
        FragC acc;
        wmma::fill_fragment(acc, 0.f);
        mma_tile<RM, CM>(acc, dvnc + i0 * D, D, state_rows(j0), LD, D / 16);
        wmma::store_matrix_sync(sStage + i0 * LDS + j0, acc, LDS, wmma::mem_row_major);
    }
    __syncthreads(); // h is dead: R2 takes dW, R6 takes dAqk
    for (int idx = tid; idx < CH * D; idx += NT) {
        int r = idx / D, dd = idx % D;
        sdW[r * LD + dd] = __float2bfloat16(-sStage[r * LDS + dd]);
    }
    // dAqk = Lower(dO' V'^T) (tiles above the diagonal are never read)
    for (int tt = warp; tt < 16; tt += NT / 32) {
        int i0 = (tt / 4) * 16, j0 = (tt % 4) * 16;
        if (j0 > i0) continue;
        FragC acc;
        wmma::fill_fragment(acc, 0.f);
        mma_tile<RM, CM>(acc, sdO + i0 * LD, LD, vnc + (size_t)j0 * D, D, D / 16);
        wmma::store_matrix_sync(sdAqk + i0 * LDA + j0, acc, LDA, wmma::mem_row_major);
    }
    __syncthreads();
    // decay of the state: dG_C += e^{G_C} sum_v dS[d,v] S[d,v] (a warp per row)
    for (int dd = warp; dd < D; dd += NT / 32) {
        float acc = 0.f;
        for (int v = lane; v < D; v += 32)
            acc += __bfloat162float(dhc[(size_t)dd * D + v]) * __bfloat162float(hc[(size_t)dd * D + v]);
#pragma unroll
        for (int off = 16; off > 0; off >>= 1) acc += __shfl_xor_sync(0xffffffffu, acc, off);
        if (lane == 0) sdGC[dd] += __expf(sG[(CH - 1) * D + dd]) * acc;
    }

    // ---- phase 2: W = M (k e^G), U = M v ----
    // dM = dW (k e^G)^T + dV' v^T into R0 (dO' no longer needed)
    for (int tt = warp; tt < 16; tt += NT / 32) {
        int i0 = (tt / 4) * 16, j0 = (tt % 4) * 16;
        FragC acc;
        wmma::fill_fragment(acc, 0.f);
        mma_tile<RM, CM>(acc, sdW + i0 * LD, LD, sKgp + j0 * LD, LD, D / 16);
        mma_tile<RM, CM>(acc, dvnc + i0 * D, D, sV + j0 * LD, LD, D / 16);
        wmma::store_matrix_sync(sdM + i0 * LDA + j0, acc, LDA, wmma::mem_row_major);
    }
    // d(k e^G) = M^T dW
    for (int tt = warp; tt < 4 * TD; tt += NT / 32) {
        int i0 = (tt / TD) * 16, j0 = (tt % TD) * 16;
        FragC acc;
        wmma::fill_fragment(acc, 0.f);
        mma_tile<CM, RM>(acc, sMb + i0, LDM, sdW + j0, LD, CH / 16);
        wmma::store_matrix_sync(sStage + i0 * LDS + j0, acc, LDS, wmma::mem_row_major);
    }
    __syncthreads();
#pragma unroll
    for (int i = 0; i < RPT; i++) {
        int r = r0 + RSTEP * i;
        float val = sStage[r * LDS + d] * __expf(sG[r * D + d]);
        dk[i] += val;
        dG[i] += val * __bfloat162float(sK[r * LD + d]);
    }
    __syncthreads();
    // dv = M^T dV'
    for (int tt = warp; tt < 4 * TD; tt += NT / 32) {
        int i0 = (tt / TD) * 16, j0 = (tt % TD) * 16;
        FragC acc;
        wmma::fill_fragment(acc, 0.f);
        mma_tile<CM, RM>(acc, sMb + i0, LDM, dvnc + j0, D, CH / 16);
        wmma::store_matrix_sync(sStage + i0 * LDS + j0, acc, LDS, wmma::mem_row_major);
    }
    __syncthreads();
#pragma unroll
    for (int i = 0; i < RPT; i++) {
        int r = r0 + RSTEP * i;
        if (r < nvalid) p.dv[base + r * rs + d] = __float2bfloat16(sStage[r * LDS + d]);
    }
    // dAqk to bf16 (R5; M is dead), strictly lower triangle selected; the
    // diagonal (e^{G_i-G_i} = 1) stays fp32 and is applied exactly in phase 4,
    // where its dG terms q_i dA_ii k_i - k_i dA_ii q_i cancel exactly.
    for (int idx = tid; idx < CH * CH; idx += NT) {
        int i = idx / CH, j = idx % CH;
        sdAqkb[i * LDM + j] = __float2bfloat16(j < i ? sdAqk[i * LDA + j] : 0.f);
        if (i == j) sdAqkDiag[i] = sdAqk[i * LDA + i];
    }
    // M = X Diag(beta): dbeta_j += sum_i dM_ij X_ij; dX = dM Diag(beta) in place
    if (tid < CH) {
        int j = tid;
        float acc = 0.f;
        for (int i = 0; i < CH; i++) {
            float dm = sdM[i * LDA + j];
            acc += dm * sX[i * LDA + j];
            sdM[i * LDA + j] = dm * sBeta[j];
        }
        sdBeta[j] += acc;
    }
    __syncthreads();

    // ---- phase 3: X = (I + Akk)^{-1}: dAkk = -X^T dX X^T, strictly lower ----
    // tf32 tensor cores; X is lower triangular, so T1 = X^T dX needs k >= i
    // and T1 X^T needs k <= j: the known-zero k-steps are skipped.
    for (int tt = warp; tt < 16; tt += NT / 32) {
        int i0 = (tt / 4) * 16, j0 = (tt % 4) * 16;
        FragC8 acc;
        wmma::fill_fragment(acc, 0.f);
        mma_tile_tf32<CM, RM>(acc, sX + i0, LDA, sdM + j0, LDA, i0 / 8, CH / 8);
        wmma::store_matrix_sync(sT1 + i0 * LDA + j0, acc, LDA, wmma::mem_row_major);
    }
    __syncthreads();
    for (int tt = warp; tt < 16; tt += NT / 32) {
        int i0 = (tt / 4) * 16, j0 = (tt % 4) * 16;
        if (j0 > i0) continue;
        FragC8 acc;
        wmma::fill_fragment(acc, 0.f);
        mma_tile_tf32<RM, CM>(acc, sT1 + i0 * LDA, LDA, sX + j0 * LDA, LDA, 0, (j0 + 16) / 8);
        wmma::store_matrix_sync(sdAkk + i0 * LDA + j0, acc, LDA, wmma::mem_row_major);
    }
    __syncthreads();
    for (int idx = tid; idx < CH * CH; idx += NT) {
        int i = idx / CH, j = idx % CH;
        float v = j < i ? -sdAkk[i * LDA + j] : 0.f;
        sdAkkb[idx] = __float2bfloat16(v);
        sdAkkBb[idx] = __float2bfloat16(sBeta[i] * v);
    }
    __syncthreads();

    // ---- phase 4: gradients through Aqk = Lower(q e^G (k e^-G)^T) and
    // Akk = StrictLower(Diag(beta) k e^G (k e^-G)^T), by sub-chunks.
    // Query side of block p anchored at its first row n0 (as the forward);
    // key side anchored at its last row m (exponents <= 0 off the diagonal).
#pragma unroll
    for (int pb = 0; pb < CH / SUB; pb++) {
        const int n0 = pb * SUB, m = n0 + SUB - 1;
        const int kb_rows = FACTORED ? n0 + SUB : n0;
        const int qa_from = FACTORED ? n0 : n0 + SUB;
        // Diagonal-block rows (factored path) keep a second, low bf16 part
        // (x = hi + lo): near-diagonal pairs enter dG_i and dG_j with opposite
        // signs, and the reverse cumsum cancels them; hi + lo makes both sides
        // round alike to about 2^-16, as the pairwise path does in fp32.
        for (int idx = tid; idx < kb_rows * D; idx += NT) {
            int j = idx / D, dd = idx % D;
            float x = __bfloat162float(sK[j * LD + dd]) * __expf(sG[n0 * D + dd] - sG[j * D + dd]);
            bf16 hi = __float2bfloat16(x);
            sKbOp[j * LD + dd] = hi;
            if (FACTORED && j >= n0)
                sKbLo[(j - n0) * LD + dd] = __float2bfloat16(x - __bfloat162float(hi));
        }
        for (int idx = qa_from * D + tid; idx < CH * D; idx += NT) {
            int i = idx / D, dd = idx % D;
            float e = __expf(sG[i * D + dd] - sG[m * D + dd]);
            float xq = __bfloat162float(sQ[i * LD + dd]) * e;
            float xk = __bfloat162float(sK[i * LD + dd]) * e;
            bf16 hq = __float2bfloat16(xq), hk = __float2bfloat16(xk);
            sQaOp[i * LD + dd] = hq;
            sKaOp[i * LD + dd] = hk;
            if (FACTORED && i <= m) {
                sQaLo[(i - n0) * LD + dd] = __float2bfloat16(xq - __bfloat162float(hq));
                sKaLo[(i - n0) * LD + dd] = __float2bfloat16(xk - __bfloat162float(hk));
            }
        }
        __syncthreads();
        const int nq = FACTORED ? pb + 1 : pb;      // key blocks t <= p (query side)
        const int s0 = FACTORED ? pb : pb + 1;      // query blocks s >= p (key side)
        for (int tt = warp; tt < 4 * TD; tt += NT / 32) {
            int o = tt / TD, j0 = (tt % TD) * 16;
            FragC acc;
            wmma::fill_fragment(acc, 0.f);
            if (o == 0)
                mma_tile<RM, RM>(acc, sdAqkb + n0 * LDM, LDM, sKbOp + j0, LD, nq);
            else if (o == 1)
                mma_tile<RM, RM>(acc, sdAkkb + n0 * CH, CH, sKbOp + j0, LD, nq);
            else if (o == 2)
                mma_tile<CM, RM>(acc, sdAqkb + s0 * SUB * LDM + n0, LDM,
                                 sQaOp + s0 * SUB * LD + j0, LD, CH / SUB - s0);
            else
                mma_tile<CM, RM>(acc, sdAkkBb + s0 * SUB * CH + n0, CH,
                                 sKaOp + s0 * SUB * LD + j0, LD, CH / SUB - s0);
            if (FACTORED) { // the diagonal block's low parts
                if (o == 0)
                    mma_tile<RM, RM>(acc, sdAqkb + n0 * LDM + n0, LDM, sKbLo + j0, LD, 1);
                else if (o == 1)
                    mma_tile<RM, RM>(acc, sdAkkb + n0 * CH + n0, CH, sKbLo + j0, LD, 1);
                else if (o == 2)
                    mma_tile<CM, RM>(acc, sdAqkb + n0 * LDM + n0, LDM, sQaLo + j0, LD, 1);
                else
                    mma_tile<CM, RM>(acc, sdAkkBb + n0 * CH + n0, CH, sKaLo + j0, LD, 1);
            }
            wmma::store_matrix_sync(sStage + o * SUB * LDS + j0, acc, LDS, wmma::mem_row_major);
        }
        __syncthreads();
#pragma unroll
        for (int i = 0; i < RPT; i++) {
            if (i / IPB != pb) continue;
            const int r = r0 + RSTEP * i, rl = r - n0;
            const float Gr = sG[r * D + d];
            float rq = sStage[rl * LDS + d] * __expf(Gr - sG[n0 * D + d]);
            float rk = sStage[(SUB + rl) * LDS + d] * __expf(Gr - sG[n0 * D + d]);
            float cq = sStage[(2 * SUB + rl) * LDS + d] * __expf(sG[m * D + d] - Gr);
            float ck = sStage[(3 * SUB + rl) * LDS + d] * __expf(sG[m * D + d] - Gr);
            if (!FACTORED) {
                // Softplus fallback: the diagonal block per position pair
                for (int jj = 0; jj < SUB; jj++) {
                    const int j = n0 + jj;
                    if (j < r) {
                        float e = __expf(Gr - sG[j * D + d]);
                        float kj = __bfloat162float(sK[j * LD + d]) * e;
                        rq += __bfloat162float(sdAqkb[r * LDM + j]) * kj;
                        rk += __bfloat162float(sdAkkb[r * CH + j]) * kj;
                    }
                    if (j > r) {
                        float e = __expf(sG[j * D + d] - Gr);
                        cq += __bfloat162float(sdAqkb[j * LDM + r]) *
                              __bfloat162float(sQ[j * LD + d]) * e;
                        ck += __bfloat162float(sdAkkBb[j * CH + r]) *
                              __bfloat162float(sK[j * LD + d]) * e;
                    }
                }
            }
            const float qv = __bfloat162float(sQ[r * LD + d]);
            const float kv = __bfloat162float(sK[r * LD + d]);
            const float br = sBeta[r];
            const float dii = sdAqkDiag[r];
            dq[i] += rq + dii * kv;
            dG[i] += qv * rq;
            dk[i] += br * rk + cq + ck + dii * qv;
            dG[i] += br * kv * rk - kv * (cq + ck);
            // one row per warp and iteration: reduce dbeta over the warp's columns
            float part = kv * rk;
#pragma unroll
            for (int off = 16; off > 0; off >>= 1) part += __shfl_xor_sync(0xffffffffu, part, off);
            if (lane == 0) sBetaPart[r * (D / 32) + d / 32] = part;
        }
        __syncthreads();
    }

    if (tid < CH) {
        float acc = 0.f;
        for (int w = 0; w < D / 32; w++) acc += sBetaPart[tid * (D / 32) + w];
        sdBeta[tid] += acc;
    }
    // ---- G = cumsum(g): dg_t = dG_C + sum_{i >= t} dG_i; then the gate ----
#pragma unroll
    for (int i = 0; i < RPT; i++) sStage[(r0 + RSTEP * i) * LDS + d] = dG[i];
    __syncthreads();
    for (int dd = tid; dd < D; dd += NT) {
        float acc = sdGC[dd];
        for (int r = CH - 1; r >= 0; r--) {
            acc += sStage[r * LDS + dd];
            sStage[r * LDS + dd] = acc;
        }
    }
    __syncthreads();
    float dbias = 0.f, dA = 0.f;
    const float bias = p.dt_bias[h * D + d];
#pragma unroll
    for (int i = 0; i < RPT; i++) {
        int r = r0 + RSTEP * i;
        if (r < nvalid) {
            float dg = sStage[r * LDS + d];
            float gz, gA;
            kda_gate_grad(__bfloat162float(p.z[base + r * rs + d]), a_exp, bias, p.bounded,
                          p.g_min, &gz, &gA);
            float dzv = dg * gz;
            p.dz[base + r * rs + d] = __float2bfloat16(dzv);
            p.dq[base + r * rs + d] = __float2bfloat16(dq[i]);
            p.dk[base + r * rs + d] = __float2bfloat16(dk[i]);
            dbias += dzv;
            dA += dg * gA;
        }
    }
    atomicAdd(&p.ddt_bias[h * D + d], dbias);
#pragma unroll
    for (int off = 16; off > 0; off >>= 1) dA += __shfl_xor_sync(0xffffffffu, dA, off);
    if (lane == 0) atomicAdd(&p.dA_log[h], dA);
    if (tid < nvalid) p.dbeta[((size_t)b * p.T + t0 + tid) * p.H + h] = sdBeta[tid];
}

cudaError_t launch_bwd_intra(const Params &p, int D, bool factored, cudaStream_t s) {
    dim3 grid(p.N, p.B * p.H);
    if (D == 128)
        return factored ? launch_with_smem(kda_bwd_intra_kernel<128, true>, grid, BWD_NT,
                                           bwd_intra_smem<128>(), s, p)
                        : launch_with_smem(kda_bwd_intra_kernel<128, false>, grid, BWD_NT,
                                           bwd_intra_smem<128>(), s, p);
    return factored ? launch_with_smem(kda_bwd_intra_kernel<64, true>, grid, BWD_NT,
                                       bwd_intra_smem<64>(), s, p)
                    : launch_with_smem(kda_bwd_intra_kernel<64, false>, grid, BWD_NT,
                                       bwd_intra_smem<64>(), s, p);
}

} // namespace lmkda

// KDA forward on Hopper: the intra-chunk kernel (gate, cumulative sums,
// sub-chunk products, triangular inverse, W and U) and the one-token decode
// step. The inter-chunk state kernels are in kda_state.cu.
// SPEC §2 "Chunked form"; docs/cuda.md has the data flow.
#include "kda_common.cuh"

namespace lmkda {

// Shared memory of the intra-chunk kernel, in bytes: regions reused across
// phases so that two blocks fit on an SM (108.75 KB for D = 128, 73.75 KB for
// D = 64, 63.75 KB for D = 32). q is read
// from global memory (twice: qg, then the query side of its sub-chunk).
// PREC adds the residues of M and k e^G (one block per SM then).
template <int D, bool PREC> constexpr size_t fwd_intra_smem() {
    return (size_t)CH * (D > CH + 4 ? D : CH + 4) * 4 // G; then X
           + (size_t)2 * CH * (D + 8) * 2     // k, then v; key operand
           + (size_t)2 * SUB * (D + 8) * 2    // query-side operands
           + (size_t)2 * CH * (CH + 4) * 4    // Aqk, Akk; then M (bf16) + staging
           + (size_t)CH * 4                   // beta
           + (PREC ? (size_t)CH * (CH + 8) * 2 + (size_t)CH * (D + 8) * 2 : 0); // M, k e^G residues
}

// c[u] += A(16 x 16 ksteps) B(16 ksteps x 16), B's tile u at B + 16 u: N neighbouring
// output tiles of the same rows, both operands row-major; one A fragment load a k-step.
template <int N>
__device__ __forceinline__ void mma_tiles_rr(FragC (&c)[N], const bf16 *A, int lda, const bf16 *B,
                                             int ldb, int ksteps) {
    FragAr a;
    FragBr b[N];
    for (int kk = 0; kk < ksteps; kk++) {
        ld_s(a, A + 16 * kk, lda);
#pragma unroll
        for (int u = 0; u < N; u++) ld_s(b[u], B + (size_t)16 * kk * ldb + 16 * u, ldb);
#pragma unroll
        for (int u = 0; u < N; u++) wmma::mma_sync(c[u], a, b[u], c[u]);
    }
}

// One block per (chunk, sequence*head). Writes qg = q e^G, kd = k e^{G_C-G},
// gexp = e^{G_C}, aqk = Lower(Aqk), w = M (k e^G), u = M v and, for the
// backward, X = (I + Akk)^{-1}. PREC (the final state is asked for): each of
// Kd, W and U also as its bf16 rounding residue (kd_lo, w_lo, u_lo), with
// M = Mh + Ml and k e^G = Kh + Kl in two bf16 parts: W = Mh Kh + Ml Kh + Mh Kl,
// U = Mh v + Ml v (v is a bf16 input). docs/cuda.md Precision.
// Threads of the intra kernel: 256 for the bounded gate's fast path (128 registers
// a thread at two blocks per SM), 512 otherwise (the per-pair loop wants them).
template <bool FACTORED, bool PREC> __host__ __device__ constexpr int fwd_intra_threads() {
    return FACTORED && !PREC ? 256 : 512;
}
template <int D, bool FACTORED, bool PREC>
__global__ void __launch_bounds__(fwd_intra_threads<FACTORED, PREC>(), PREC ? 1 : 2)
    kda_fwd_intra_kernel(Params p, int save_x) {
    // q, k, v, z are [B,T,H,D]; beta [B,T,H]; this block owns chunk n of (b, h)
    constexpr int NT = fwd_intra_threads<FACTORED, PREC>(), LD = D + 8, LDA = CH + 4, LDM = CH + 8;
    extern __shared__ __align__(128) unsigned char smem[];
    constexpr int GREG = CH * (D > LDA ? D : LDA);    // floats: G [64][D], then X [64][LDA]
    float *sG = reinterpret_cast<float *>(smem);
    float *sX = sG;                                   // once G is done
    bf16 *sK = reinterpret_cast<bf16 *>(sG + GREG);   // [64][LD]
    bf16 *sV = sK;                                    // [64][LD], once k is done
    bf16 *sKb = sK + CH * LD;  // key operand [64][LD]
    bf16 *sQa = sKb + CH * LD; // [16][LD]
    bf16 *sKa = sQa + SUB * LD;
    float *sAqk = reinterpret_cast<float *>(sKa + SUB * LD); // [64][LDA]
    float *sAkk = sAqk + CH * LDA;
    bf16 *sMb = reinterpret_cast<bf16 *>(sAqk);              // [64][LDM], after the inverse
    // W and U: a warp takes TPW neighbouring tiles a step (two at 256 threads, where
    // the staging space sized for 512 threads holds both)
    constexpr int TPW = NT == 256 ? 2 : 1;
    float *sStage = reinterpret_cast<float *>(sMb + CH * LDM); // NT/32 warps x TPW x [16][20]
    float *sBeta = sAkk + CH * LDA;
    bf16 *sMl = reinterpret_cast<bf16 *>(sBeta + CH); // PREC: [64][LDM] M's residue
    bf16 *sKgl = sMl + CH * LDM;                        // PREC: [64][LD] k e^G's residue
    static_assert((size_t)CH * LDM * 2 + (size_t)(NT / 32) * TPW * 16 * 20 * 4 <=
                      (size_t)2 * CH * LDA * 4,
                  "M and the staging tiles fit in the Aqk, Akk region");

    const int n = blockIdx.x, bh = blockIdx.y, b = bh / p.H, h = bh % p.H;
    const int t0 = n * CH, nvalid = min(CH, p.T - t0);
    const size_t c = (size_t)bh * p.N + n;
    const size_t rs = (size_t)p.H * D;
    const size_t base = ((size_t)b * p.T + t0) * rs + (size_t)h * D;
    const int tid = threadIdx.x, warp = tid >> 5;

    // k and z in flight together (cp.async, rows past T zero-filled); q and v,
    // read later from global memory, asked for in L2 meanwhile
    constexpr int V8 = D / 8;
    for (int idx = tid; idx < CH * V8; idx += NT) {
        const int r = idx / V8, d = (idx % V8) * 8;
        const bool ok = r < nvalid;
        const size_t off = ok ? base + (size_t)r * rs + d : 0;
        cp_async16(sK + r * LD + d, p.k + off, ok);
        cp_async16(sKb + r * LD + d, p.z + off, ok); // z, staged in the key buffer
    }
    cp_async_commit();
    if (tid < 2 * CH && tid % CH < nvalid)
        prefetch_l2_bulk((tid < CH ? p.q : p.v) + base + (size_t)(tid % CH) * rs, D * sizeof(bf16));
    if (tid < CH) sBeta[tid] = tid < nvalid ? p.beta[((size_t)b * p.T + t0 + tid) * p.H + h] : 0.f;
    const float a_exp = __expf(p.A_log[h]);
    // Elementwise phases: eight consecutive channels a thread (16-byte accesses);
    // a thread's channels are the same in every row (NT is a multiple of V8)
    static_assert(NT % V8 == 0, "elementwise phases: fixed channels a thread");
    float bias8[8];
#pragma unroll
    for (int e = 0; e < 8; e++) bias8[e] = p.dt_bias[h * D + (tid % V8) * 8 + e];
    cp_async_wait<0>();
    __syncthreads();
    for (int idx = tid; idx < CH * V8; idx += NT) {
        int r = idx / V8, d = (idx % V8) * 8;
        float zz[8], g[8];
        ld8(sKb + r * LD + d, zz);
#pragma unroll
        for (int e = 0; e < 8; e++) // padded rows: g = 0 keeps G constant past T
            g[e] = r < nvalid ? kda_gate(zz[e], a_exp, bias8[e], p.bounded, p.g_min) : 0.f;
        *reinterpret_cast<float4 *>(sG + r * D + d) = make_float4(g[0], g[1], g[2], g[3]);
        *reinterpret_cast<float4 *>(sG + r * D + d + 4) = make_float4(g[4], g[5], g[6], g[7]);
    }
    __syncthreads();

    // G_i = sum_{t <= i in chunk} g_t, fp32
    for (int d = tid; d < D; d += NT) {
        float acc = 0.f;
        for (int r = 0; r < CH; r++) {
            acc += sG[r * D + d];
            sG[r * D + d] = acc;
        }
    }
    __syncthreads();

    // Inter-chunk operands: qg = q e^G, kd = k e^{G_C - G}, gexp = e^{G_C}
    const float *GC = sG + (CH - 1) * D;
    for (int idx = tid; idx < CH * V8; idx += NT) {
        int r = idx / V8, d = (idx % V8) * 8;
        float G[8], gc[8], q[8], k[8], xq[8], xk[8];
        ldf8(sG + r * D + d, G);
        ldf8(GC + d, gc);
        ld8(sK + r * LD + d, k);
        if (r < nvalid) ld8(p.q + base + r * rs + d, q);
#pragma unroll
        for (int e = 0; e < 8; e++) {
            if (r >= nvalid) q[e] = 0.f;
            xq[e] = q[e] * __expf(G[e]);
            xk[e] = k[e] * __expf(gc[e] - G[e]);
        }
        st8(p.qg + (c * CH + r) * wld<D>() + d, xq);
        st8(p.kd + (c * CH + r) * wld<D>() + d, xk);
        if (PREC) {
#pragma unroll
            for (int e = 0; e < 8; e++) xk[e] = bf16_residue(xk[e]);
            st8(p.kd_lo + c * CH * D + r * D + d, xk);
        }
    }
    for (int d = tid; d < D; d += NT) p.gexp[c * D + d] = __expf(GC[d]);

    // Aqk and Akk by sub-chunks of 16 rows anchored at the sub-chunk's first
    // row n0 (a row <= i: causal): (x_i e^{G_i-G_n0}) . (k_j e^{G_n0-G_j}).
    // Off-diagonal blocks: both exponents <= 0. Diagonal block (factored,
    // bounded gate only): e^{G_n0-G_j} <= e^{15|g_min|}, finite in bf16/fp32.
    // Key rows [0, rows) anchored at row a, into dst [rows][LD]
    auto build_keys = [&](bf16 *dst, int rows, int a) {
        for (int idx = tid; idx < rows * V8; idx += NT) {
            int j = idx / V8, d = (idx % V8) * 8;
            float k[8], ga[8], gj[8];
            ld8(sK + j * LD + d, k);
            ldf8(sG + a * D + d, ga);
            ldf8(sG + j * D + d, gj);
#pragma unroll
            for (int e = 0; e < 8; e++) k[e] *= __expf(ga[e] - gj[e]);
            st8(dst + j * LD + d, k);
        }
    };
    // Query-side rows of sub-chunk s (q and k), anchored at its first row
    auto build_queries = [&](bf16 *dq, bf16 *dk, int s) {
        const int n0 = s * SUB;
        for (int idx = tid; idx < SUB * V8; idx += NT) {
            int i = idx / V8, d = (idx % V8) * 8;
            float gi[8], ga[8], q[8], k[8];
            ldf8(sG + (n0 + i) * D + d, gi);
            ldf8(sG + n0 * D + d, ga);
            ld8(sK + (n0 + i) * LD + d, k);
            if (n0 + i < nvalid) ld8(p.q + base + (n0 + i) * rs + d, q);
#pragma unroll
            for (int e = 0; e < 8; e++) {
                float x = __expf(gi[e] - ga[e]);
                if (n0 + i >= nvalid) q[e] = 0.f;
                q[e] *= x;
                k[e] *= x;
            }
            st8(dq + i * LD + d, q);
            st8(dk + i * LD + d, k);
        }
    };
    int s_first = 0;
    if (FACTORED) {
        // Sub-chunks 0 and 1 in one round: their key operands (16 and 32 rows) and
        // sub-chunk 0's query side share the key buffer; sub-chunk 0's k side goes
        // to rows 32..47 of Aqk, which only sub-chunk 2 writes
        bf16 *sKb0 = sKb, *sKb1 = sKb + SUB * LD, *sQa0 = sKb + 3 * SUB * LD;
        bf16 *sKa0 = reinterpret_cast<bf16 *>(sAqk + 2 * SUB * LDA);
        static_assert((size_t)SUB * LD * 2 <= (size_t)SUB * LDA * 4, "k side of sub-chunk 0");
        build_keys(sKb0, SUB, 0);
        build_keys(sKb1, 2 * SUB, SUB);
        build_queries(sQa0, sKa0, 0);
        build_queries(sQa, sKa, 1);
        __syncthreads();
        if (warp < 6) { // (mat, sub-chunk, key block): 0-1 sub-chunk 0, 2-5 sub-chunk 1
            const int mat = warp < 2 ? warp : (warp - 2) / 2, s = warp < 2 ? 0 : 1;
            const int t = warp < 2 ? 0 : (warp - 2) % 2;
            const bf16 *qa = s ? (mat ? sKa : sQa) : (mat ? sKa0 : sQa0);
            const bf16 *kb = (s ? sKb1 : sKb0) + t * SUB * LD;
            FragC acc;
            wmma::fill_fragment(acc, 0.f);
            mma_tile<RM, CM>(acc, qa, LD, kb, LD, D / 16);
            st_s((mat ? sAkk : sAqk) + s * SUB * LDA + t * SUB, acc, LDA);
        }
        __syncthreads();
        s_first = 2;
    }
    for (int s = s_first; s < CH / SUB; s++) {
        const int n0 = s * SUB;
        build_keys(sKb, FACTORED ? n0 + SUB : n0, n0);
        build_queries(sQa, sKa, s);
        __syncthreads();
        const int nt = FACTORED ? s + 1 : s; // key sub-chunks on tensor cores
        for (int tt = warp; tt < 2 * nt; tt += NT / 32) {
            int mat = tt / nt, t = tt % nt;
            FragC acc;
            wmma::fill_fragment(acc, 0.f);
            mma_tile<RM, CM>(acc, mat ? sKa : sQa, LD, sKb + t * SUB * LD, LD, D / 16);
            st_s((mat ? sAkk : sAqk) + n0 * LDA + t * SUB, acc, LDA);
        }
        if (!FACTORED && tid < SUB * SUB) {
            // Softplus fallback: the diagonal block per position pair, e^{G_i-G_j} <= 1
            int i = tid / SUB, j = tid % SUB;
            float aq = 0.f, ak = 0.f;
            if (j <= i) {
                for (int d = 0; d < D; d += 8) {
                    float gi[8], gj[8], kj[8], ki[8], q[8];
                    ldf8(sG + (n0 + i) * D + d, gi);
                    ldf8(sG + (n0 + j) * D + d, gj);
                    ld8(sK + (n0 + j) * LD + d, kj);
                    ld8(sK + (n0 + i) * LD + d, ki);
                    if (n0 + i < nvalid) ld8(p.q + base + (n0 + i) * rs + d, q);
#pragma unroll
                    for (int e = 0; e < 8; e++) {
                        float x = kj[e] * __expf(gi[e] - gj[e]);
                        aq += (n0 + i < nvalid ? q[e] : 0.f) * x;
                        ak += ki[e] * x;
                    }
                }
            }
            sAqk[(n0 + i) * LDA + n0 + j] = aq;
            sAkk[(n0 + i) * LDA + n0 + j] = ak;
        }
        __syncthreads();
    }

    // k e^G into the key operand buffer (W's operand); G and k are done after this
    for (int idx = tid; idx < CH * V8; idx += NT) {
        int r = idx / V8, d = (idx % V8) * 8;
        float k[8], G[8];
        ld8(sK + r * LD + d, k);
        ldf8(sG + r * D + d, G);
#pragma unroll
        for (int e = 0; e < 8; e++) k[e] *= __expf(G[e]);
        st8(sKb + r * LD + d, k);
        if (PREC) {
#pragma unroll
            for (int e = 0; e < 8; e++) k[e] = bf16_residue(k[e]);
            st8(sKgl + r * LD + d, k);
        }
    }
    __syncthreads();
    // v into k's place, in flight until the products W, U
    for (int idx = tid; idx < CH * V8; idx += NT) {
        const int r = idx / V8, d = (idx % V8) * 8;
        const bool ok = r < nvalid;
        cp_async16(sV + r * LD + d, p.v + (ok ? base + (size_t)r * rs + d : 0), ok);
    }
    cp_async_commit();

    // Masks are selections (never a product with a possibly huge value):
    // Aqk lower with diagonal; Akk strictly lower, rows times beta_i.
    for (int idx = tid; idx < CH * CH / 8; idx += NT) {
        int i = idx / (CH / 8), j0 = (idx % (CH / 8)) * 8;
        float aq[8];
#pragma unroll
        for (int e = 0; e < 8; e++) {
            int j = j0 + e;
            aq[e] = j <= i ? sAqk[i * LDA + j] : 0.f;
            sAkk[i * LDA + j] = j < i ? sBeta[i] * sAkk[i * LDA + j] : 0.f;
            if (j / SUB > i / SUB) sX[i * LDA + j] = 0.f;
        }
        st8(p.aqk + (c * CH + i) * ALD + j0, aq);
    }
    __syncthreads();

    // X = (I + Akk)^{-1}: the four diagonal 16x16 blocks by forward
    // substitution, one column per thread (columns are independent).
    if (tid < CH) {
        const int o0 = (tid / SUB) * SUB, col = tid % SUB;
        float x[SUB];
#pragma unroll
        for (int i = 0; i < SUB; i++) {
            float acc = i == col ? 1.f : 0.f;
#pragma unroll
            for (int j = 0; j < i; j++) acc -= sAkk[(o0 + i) * LDA + o0 + j] * x[j];
            x[i] = acc;
        }
#pragma unroll
        for (int i = 0; i < SUB; i++) sX[(o0 + i) * LDA + o0 + col] = x[i];
    }
    __syncthreads();
    // Off-diagonal blocks on tensor cores, each product in three tf32 parts
    // (about fp32 accuracy), by halves: (1) X_10 = -X_11 (A_10 X_00) and
    // X_32 = -X_33 (A_32 X_22), a warp each; (2) P = A_[23][01] X_[01][01],
    // four tiles; (3) X_[23][01] = -X_[23][23] P, four tiles. A is Akk
    // (strictly lower, rows times beta); P and the first step's products go
    // to the Aqk region (Aqk is already in global memory) at their own
    // block positions, so that each product's operands are plain block ranges.
    static_assert(CH == 4 * SUB, "the inverse by halves: four diagonal blocks");
    float *sP = sAqk;
    if (warp < 2) {
        const int o = warp * 2 * SUB; // the diagonal 32 x 32 block of this warp
        FragC8 y;
        wmma::fill_fragment(y, 0.f);
        mma_tile_tf32<RM, RM, true>(y, sAkk + (o + SUB) * LDA, LDA, sX + o, LDA, o / 8, o / 8 + 2);
        st_s(sP + (o + SUB) * LDA + o, y, LDA);
        __syncwarp();
        FragC8 x;
        wmma::fill_fragment(x, 0.f);
        mma_tile_tf32<RM, RM, true>(x, sX + (o + SUB) * LDA, LDA, sP + o, LDA, o / 8 + 2, o / 8 + 4);
#pragma unroll
        for (int e = 0; e < x.num_elements; e++) x.x[e] = -x.x[e];
        st_s(sX + (o + SUB) * LDA + o, x, LDA);
    }
    __syncthreads();
    if (warp < 4) { // P_st, s in {2, 3}, t in {0, 1}: k over the nonzero rows of X_[01],t
        const int s = 2 + warp / 2, t = warp % 2;
        FragC8 y;
        wmma::fill_fragment(y, 0.f);
        mma_tile_tf32<RM, RM, true>(y, sAkk + s * SUB * LDA, LDA, sX + t * SUB, LDA, 2 * t, 4);
        st_s(sP + s * SUB * LDA + t * SUB, y, LDA);
    }
    __syncthreads();
    if (warp < 4) { // X_st = -sum_{r=2}^{s} X_sr P_rt
        const int s = 2 + warp / 2, t = warp % 2;
        FragC8 x;
        wmma::fill_fragment(x, 0.f);
        mma_tile_tf32<RM, RM, true>(x, sX + s * SUB * LDA, LDA, sP + t * SUB, LDA, 4, 2 * s + 2);
#pragma unroll
        for (int e = 0; e < x.num_elements; e++) x.x[e] = -x.x[e];
        st_s(sX + s * SUB * LDA + t * SUB, x, LDA);
    }
    __syncthreads();

    // M = X Diag(beta) in bf16 (into the Aqk, Akk region: both are done)
    for (int idx = tid; idx < CH * CH / 4; idx += NT) {
        int i = idx / (CH / 4), j0 = (idx % (CH / 4)) * 4;
        float4 x = *reinterpret_cast<const float4 *>(sX + i * LDA + j0);
        sMb[i * LDM + j0] = __float2bfloat16(x.x * sBeta[j0]);
        sMb[i * LDM + j0 + 1] = __float2bfloat16(x.y * sBeta[j0 + 1]);
        sMb[i * LDM + j0 + 2] = __float2bfloat16(x.z * sBeta[j0 + 2]);
        sMb[i * LDM + j0 + 3] = __float2bfloat16(x.w * sBeta[j0 + 3]);
        if (PREC) {
            sMl[i * LDM + j0] = __float2bfloat16(bf16_residue(x.x * sBeta[j0]));
            sMl[i * LDM + j0 + 1] = __float2bfloat16(bf16_residue(x.y * sBeta[j0 + 1]));
            sMl[i * LDM + j0 + 2] = __float2bfloat16(bf16_residue(x.z * sBeta[j0 + 2]));
            sMl[i * LDM + j0 + 3] = __float2bfloat16(bf16_residue(x.w * sBeta[j0 + 3]));
        }
        if (save_x) *reinterpret_cast<float4 *>(p.X + c * CH * CH + i * CH + j0) = x;
    }
    cp_async_wait<0>(); // v has landed
    __syncthreads();

    // W = M (K e^G), U = M V on tensor cores (64 x D each)
    constexpr int TPM = (CH / 16) * (D / 16);
    float *st = sStage + warp * TPW * 16 * 20;
    static_assert(TPM % TPW == 0 && (D / 16) % TPW == 0, "a warp's tiles share their rows");
    for (int tt = warp * TPW; tt < 2 * TPM; tt += (NT / 32) * TPW) {
        int mat = tt / TPM, t = tt % TPM, i0 = (t / (D / 16)) * 16, j0 = (t % (D / 16)) * 16;
        const bf16 *rhs = (mat ? sV : sKb) + j0;
        FragC acc[TPW];
#pragma unroll
        for (int u = 0; u < TPW; u++) wmma::fill_fragment(acc[u], 0.f);
        if (PREC) { // the small terms first (TPW = 1 here)
            if (!mat) mma_tile<RM, RM>(acc[0], sMb + i0 * LDM, LDM, sKgl + j0, LD, CH / 16);
            mma_tile<RM, RM>(acc[0], sMl + i0 * LDM, LDM, rhs, LD, CH / 16);
        }
        mma_tiles_rr<TPW>(acc, sMb + i0 * LDM, LDM, rhs, LD, CH / 16);
#pragma unroll
        for (int u = 0; u < TPW; u++) st_s(st + u * 16 * 20, acc[u], 20);
        __syncwarp();
#pragma unroll
        for (int u = 0; u < TPW; u++) {
            const size_t off = (c * CH + i0) * D + j0 + 16 * u;         // u and the residues
            const size_t offw = (c * CH + i0) * wld<D>() + j0 + 16 * u; // w (padded rows)
            bf16 *dst = mat ? p.u + off : p.w + offw;
            const size_t gs = mat ? (size_t)D : (size_t)wld<D>();
            if (PREC)
                store_tile_split(dst, gs, (mat ? p.u_lo : p.w_lo) + off, D, st, 20);
            else
                store_tile_bf16(dst, gs, st + u * 16 * 20, 20, CH, 1.f);
        }
        __syncwarp();
    }
}


// One decode token: one block per (sequence, head), one thread per value
// column. S = e^g S; S += beta k (v - S^T k)^T; o = scale S^T q (SPEC §2).
template <int D> __global__ void kda_decode_kernel(Params p, float *state) {
    // q, k, z [B,H,D]; v, o [B,H,D]; beta [B,H]; state [B,H,D,D] fp32
    __shared__ float sq[D], sk[D], sa[D];
    const int bh = blockIdx.x, h = bh % p.H, v = threadIdx.x;
    const size_t base = (size_t)bh * D;
    const float a_exp = __expf(p.A_log[h]);
    for (int d = threadIdx.x; d < D; d += blockDim.x) {
        sq[d] = __bfloat162float(p.q[base + d]);
        sk[d] = __bfloat162float(p.k[base + d]);
        sa[d] = __expf(kda_gate(__bfloat162float(p.z[base + d]), a_exp, p.dt_bias[h * D + d],
                                p.bounded, p.g_min));
    }
    __syncthreads();
    float *S = state + (size_t)bh * D * D;
    float kv = 0.f;
    for (int d = 0; d < D; d++) kv += sa[d] * S[d * D + v] * sk[d];
    const float delta = p.beta[bh] * (__bfloat162float(p.v[base + v]) - kv);
    float o = 0.f;
    for (int d = 0; d < D; d++) {
        float s = sa[d] * S[d * D + v] + sk[d] * delta;
        S[d * D + v] = s;
        o += s * sq[d];
    }
    p.o[base + v] = __float2bfloat16(p.scale * o);
}

cudaError_t launch_fwd_intra(const Params &p, int D, bool factored, bool save_x, bool precise,
                             cudaStream_t s) {
    dim3 grid(p.N, p.B * p.H);
    int sx = save_x ? 1 : 0;
#define LM_INTRA(DD, FF)                                                                    \
    {                                                                                       \
        auto kern = precise ? kda_fwd_intra_kernel<DD, FF, true>                            \
                            : kda_fwd_intra_kernel<DD, FF, false>;                          \
        size_t sm = precise ? fwd_intra_smem<DD, true>() : fwd_intra_smem<DD, false>();     \
        cudaError_t e = cudaFuncSetAttribute(kern, cudaFuncAttributeMaxDynamicSharedMemorySize, \
                                             (int)sm);                                      \
        if (e != cudaSuccess) return e;                                                     \
        kern<<<grid, precise ? fwd_intra_threads<FF, true>() : fwd_intra_threads<FF, false>(), \
               sm, s>>>(p, sx);                                                             \
        return cudaGetLastError();                                                          \
    }
    if (D == 128) {
        if (factored) LM_INTRA(128, true) else LM_INTRA(128, false)
    } else if (D == 64) {
        if (factored) LM_INTRA(64, true) else LM_INTRA(64, false)
    } else if (D == 32) {
        if (factored) LM_INTRA(32, true) else LM_INTRA(32, false)
    }
#undef LM_INTRA
    return cudaErrorInvalidValue; // lm_kda_cuda_check refuses other head dimensions
}

cudaError_t launch_decode(const Params &p, int D, float *state, cudaStream_t s) {
    if (D == 128)
        kda_decode_kernel<128><<<p.B * p.H, 128, 0, s>>>(p, state);
    else if (D == 64)
        kda_decode_kernel<64><<<p.B * p.H, 64, 0, s>>>(p, state);
    else if (D == 32)
        kda_decode_kernel<32><<<p.B * p.H, 32, 0, s>>>(p, state);
    else
        return cudaErrorInvalidValue; // lm_kda_cuda_check refuses other head dimensions
    return cudaGetLastError();
}

} // namespace lmkda

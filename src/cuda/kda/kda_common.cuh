// Shared pieces of the KDA CUDA kernels (docs/cuda.md): parameters, the gate,
// tile loads and the tensor-core tile product (wmma: HMMA in SASS).
#ifndef LONGMOE_KDA_COMMON_CUH
#define LONGMOE_KDA_COMMON_CUH

#include <cuda_bf16.h>
#include <cuda_runtime.h>
#include <mma.h>

#include <type_traits>

namespace lmkda {

using bf16 = __nv_bfloat16;
using namespace nvcuda;

constexpr int CH = 64;  // chunk length
constexpr int SUB = 16; // sub-chunk length (one tensor-core tile)
// Head dimensions (K = V = D) the kernels are built for.
__host__ __device__ constexpr bool kda_dim_supported(int D) {
    return D == 32 || D == 64 || D == 128;
}
// Backward kernel B (the per-column gradients) works on column blocks of
// bwd_col_width(D) channels: 64 (D = 128 runs as two blocks), or all of D = 32;
// 4 threads a column (4 row groups), so 256 threads a block at width 64 and
// 128 at width 32.
__host__ __device__ constexpr int bwd_col_width(int D) { return D < 64 ? D : 64; }
__host__ __device__ constexpr int bwd_col_blocks(int D) { return D / bwd_col_width(D); }
__host__ __device__ constexpr int bwd_col_threads(int D) { return 4 * bwd_col_width(D); }
// Kernel B's partial sums of the gate parameters per chunk: ddt_bias one per
// column and row group, dA_log one per warp of each column block (D/8 in all);
// kda_backward.cu checks these.
constexpr int BWD_GATE_ROW_GROUPS = 4;
__host__ __device__ constexpr int bwd_gate_dA_terms(int D) {
    return bwd_col_blocks(D) * (bwd_col_threads(D) / 32);
}
// Row strides of the workspace tiles w, qg, kd (D + 8) and aqk (64 + 8): the
// state kernels' shared-memory layout (rows padded against bank conflicts).
// Measured on the H200, the forward intra kernel that writes them and the
// state kernels that copy them run 9-12% faster with these rows than with
// rows of D and 64 (bench/RESULTS.md, v25).
template <int D> __host__ __device__ constexpr int wld() { return D + 8; }
constexpr int ALD = CH + 8;

// Everything the kernels read. Per-chunk workspace tensors are indexed by
// c = (b*H + h)*N + n, the chunk's rows first (padded to 64 rows with zeros).
struct Params {
    int B, T, H, N;
    int bounded;   // 1: bounded gate, 0: softplus
    float g_min;   // bounded gate's lower bound
    float scale;   // output scale
    int gate_split; // backward: every score block's operands hi + lo (1), or the diagonal's only (0)
    // inputs
    const bf16 *q, *k, *v, *z;
    const float *beta, *A_log, *dt_bias, *h0;
    // outputs of the forward
    bf16 *o;
    float *ht;
    // workspace, forward
    bf16 *w, *u, *qg, *kd, *aqk; // [c][64][D+8], [c][64][D], [c][64][D+8], [c][64][D+8], [c][64][72]
    float *gexp;                 // [c][D]     e^{G_C}
    // workspace, forward with the final state (precise state, docs/cuda.md
    // Precision): the bf16 rounding residues of W, U and Kd, so that w + w_lo
    // etc. carry them to about 16 mantissa bits; NULL otherwise
    bf16 *w_lo, *u_lo, *kd_lo;   // [c][64][D]
    // workspace, backward
    float *X;          // [c][64][64] (I + Akk)^{-1}
    bf16 *h, *vn;      // [c][D][D] state at chunk start, [c][64][D] V'
    bf16 *dh, *dvn;    // [c][D][D] gradient of the state at chunk end, [c][64][D] dV'
    // workspace, between the two backward intra-chunk kernels
    bf16 *dWb;                   // [c][64][D]  dW = -dV' S^T
    bf16 *Mb, *dAqkb;            // [c][64][64] M = X Diag(beta); dAqk, strictly lower
    bf16 *dAkkb;                 // [c][64][64] dAkk (strictly lower)
    float *dAqkDiag;             // [c][64]     diagonal of dAqk
    float *dbeta_part;           // [c][1 + bwd_col_blocks(D)][64] dbeta terms, summed in a fixed order
    // the gate parameters' per-chunk terms, summed over chunks in a fixed order
    float *ddt_part;             // [c][4][D]      one per column and row group of kernel B
    float *dA_part;              // [c][D/8]       one per warp of kernel B (bwd_gate_dA_terms)
    // backward inputs and outputs
    const bf16 *d_o;
    const float *dht;
    bf16 *dq, *dk, *dv, *dz;
    size_t dz_ld;                // dz's row (token) stride in elements: H D, or the caller's (lm_kda_config)
    float *dbeta, *dA_log, *ddt_bias, *dh0;
};

// Gate of SPEC §2 for one (token, head, channel), fp32.
__device__ __forceinline__ float kda_gate(float z, float a_exp, float bias, int bounded,
                                          float g_min) {
    float x = z + bias;
    if (bounded) return g_min / (1.f + __expf(-a_exp * x));
    float sp = x > 20.f ? x : log1pf(__expf(x));
    return -a_exp * sp;
}

// d g / d z and d g / d A_log of the gate above.
__device__ __forceinline__ void kda_gate_grad(float z, float a_exp, float bias, int bounded,
                                              float g_min, float *dg_dz, float *dg_dA) {
    float x = z + bias;
    if (bounded) {
        // sigma(y) sigma(-y) = e^{-|y|} / (1 + e^{-|y|})^2: no 1 - sigma cancellation
        float e = __expf(-fabsf(a_exp * x)), s = 1.f / (1.f + e);
        float d = g_min * e * s * s * a_exp;
        *dg_dz = d;
        *dg_dA = d * x;
    } else {
        float s = 1.f / (1.f + __expf(-x));
        float sp = x > 20.f ? x : log1pf(__expf(x));
        *dg_dz = -a_exp * s;
        *dg_dA = -a_exp * sp;
    }
}

// wmma fragments loaded from and stored to shared memory with the state
// space written in the PTX (every operand tile of these kernels is in shared
// memory). wmma::load_matrix_sync on a pointer that the compiler cannot prove
// to be shared compiles to generic loads (LD) plus transposes (MOVM).
__device__ __forceinline__ unsigned smem_u32(const void *p) {
    return static_cast<unsigned>(__cvta_generic_to_shared(p));
}
#define LM_WMMA_LD4(FRAG, T, PTX)                                                          \
    __device__ __forceinline__ void ld_s(FRAG &f, const T *p, unsigned ld) {              \
        int *r = reinterpret_cast<int *>(&f);                                              \
        asm volatile(PTX " {%0,%1,%2,%3}, [%4], %5;\n"                                     \
                     : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3])                      \
                     : "r"(smem_u32(p)), "r"(ld)                                           \
                     : "memory");                                                          \
    }
using FragAr = wmma::fragment<wmma::matrix_a, 16, 16, 16, bf16, wmma::row_major>;
using FragAc = wmma::fragment<wmma::matrix_a, 16, 16, 16, bf16, wmma::col_major>;
using FragBr = wmma::fragment<wmma::matrix_b, 16, 16, 16, bf16, wmma::row_major>;
using FragBc = wmma::fragment<wmma::matrix_b, 16, 16, 16, bf16, wmma::col_major>;
using Frag8Ar = wmma::fragment<wmma::matrix_a, 16, 16, 8, wmma::precision::tf32, wmma::row_major>;
using Frag8Ac = wmma::fragment<wmma::matrix_a, 16, 16, 8, wmma::precision::tf32, wmma::col_major>;
using Frag8Br = wmma::fragment<wmma::matrix_b, 16, 16, 8, wmma::precision::tf32, wmma::row_major>;
using Frag8Bc = wmma::fragment<wmma::matrix_b, 16, 16, 8, wmma::precision::tf32, wmma::col_major>;
LM_WMMA_LD4(FragAr, bf16, "wmma.load.a.sync.aligned.row.m16n16k16.shared.bf16")
LM_WMMA_LD4(FragAc, bf16, "wmma.load.a.sync.aligned.col.m16n16k16.shared.bf16")
LM_WMMA_LD4(FragBr, bf16, "wmma.load.b.sync.aligned.row.m16n16k16.shared.bf16")
LM_WMMA_LD4(FragBc, bf16, "wmma.load.b.sync.aligned.col.m16n16k16.shared.bf16")
LM_WMMA_LD4(Frag8Ar, float, "wmma.load.a.sync.aligned.row.m16n16k8.shared.tf32")
LM_WMMA_LD4(Frag8Ac, float, "wmma.load.a.sync.aligned.col.m16n16k8.shared.tf32")
LM_WMMA_LD4(Frag8Br, float, "wmma.load.b.sync.aligned.row.m16n16k8.shared.tf32")
LM_WMMA_LD4(Frag8Bc, float, "wmma.load.b.sync.aligned.col.m16n16k8.shared.tf32")
#undef LM_WMMA_LD4
// An fp32 accumulator tile (16x16, of the k16 or the tf32 k8 shape) to shared
// memory, row-major with row stride ld.
template <int K>
__device__ __forceinline__ void st_s(float *p,
                                     const wmma::fragment<wmma::accumulator, 16, 16, K, float> &f,
                                     unsigned ld) {
    static_assert(K == 16 || K == 8, "m16n16k16 or m16n16k8");
    if (K == 16)
        asm volatile("wmma.store.d.sync.aligned.row.m16n16k16.shared.f32 [%0], "
                     "{%1,%2,%3,%4,%5,%6,%7,%8}, %9;\n" ::"r"(smem_u32(p)),
                     "f"(f.x[0]), "f"(f.x[1]), "f"(f.x[2]), "f"(f.x[3]), "f"(f.x[4]), "f"(f.x[5]),
                     "f"(f.x[6]), "f"(f.x[7]), "r"(ld)
                     : "memory");
    else
        asm volatile("wmma.store.d.sync.aligned.row.m16n16k8.shared.f32 [%0], "
                     "{%1,%2,%3,%4,%5,%6,%7,%8}, %9;\n" ::"r"(smem_u32(p)),
                     "f"(f.x[0]), "f"(f.x[1]), "f"(f.x[2]), "f"(f.x[3]), "f"(f.x[4]), "f"(f.x[5]),
                     "f"(f.x[6]), "f"(f.x[7]), "r"(ld)
                     : "memory");
}

// c += A(16 x 16*ksteps) * B(16*ksteps x 16) on tensor cores, bf16 operands.
// A points at the tile's first row: row-major A(i,k) = A[i*lda + k]; col-major
// A(i,k) = A[k*lda + i]. B likewise at the tile's first column: row-major
// B(k,j) = B[k*ldb + j]; col-major B(k,j) = B[j*ldb + k].
template <typename LA, typename LB>
__device__ __forceinline__ void mma_tile(wmma::fragment<wmma::accumulator, 16, 16, 16, float> &c,
                                         const bf16 *A, int lda, const bf16 *B, int ldb,
                                         int ksteps) {
    wmma::fragment<wmma::matrix_a, 16, 16, 16, bf16, LA> a;
    wmma::fragment<wmma::matrix_b, 16, 16, 16, bf16, LB> b;
    for (int kk = 0; kk < ksteps; kk++) {
        const bf16 *pa = std::is_same<LA, wmma::row_major>::value ? A + 16 * kk
                                                                  : A + (size_t)16 * kk * lda;
        const bf16 *pb = std::is_same<LB, wmma::row_major>::value ? B + (size_t)16 * kk * ldb
                                                                  : B + 16 * kk;
        ld_s(a, pa, lda);
        ld_s(b, pb, ldb);
        wmma::mma_sync(c, a, b, c);
    }
}

using FragC = wmma::fragment<wmma::accumulator, 16, 16, 16, float>;
using FragC8 = wmma::fragment<wmma::accumulator, 16, 16, 8, float>;

// c += A(16 x 8*ksteps) * B(8*ksteps x 16) on tensor cores in tf32 (fp32
// operands rounded to 10 mantissa bits), for the fp32 triangular algebra.
// Layout conventions as mma_tile; kfirst skips leading k-steps known zero.
// SPLIT: each operand as x = hi + lo in tf32 and the product taken as
// hi hi + hi lo + lo hi, about fp32 accuracy.
template <typename LA, typename LB, bool SPLIT = false>
__device__ __forceinline__ void mma_tile_tf32(FragC8 &c, const float *A, int lda, const float *B,
                                              int ldb, int kfirst, int kend) {
    wmma::fragment<wmma::matrix_a, 16, 16, 8, wmma::precision::tf32, LA> a, al;
    wmma::fragment<wmma::matrix_b, 16, 16, 8, wmma::precision::tf32, LB> b, bl;
    for (int kk = kfirst; kk < kend; kk++) {
        const float *pa = std::is_same<LA, wmma::row_major>::value ? A + 8 * kk
                                                                   : A + (size_t)8 * kk * lda;
        const float *pb = std::is_same<LB, wmma::row_major>::value ? B + (size_t)8 * kk * ldb
                                                                   : B + 8 * kk;
        ld_s(a, pa, lda);
        ld_s(b, pb, ldb);
#pragma unroll
        for (int e = 0; e < a.num_elements; e++) {
            const float x = a.x[e], hi = wmma::__float_to_tf32(x);
            a.x[e] = hi;
            if (SPLIT) al.x[e] = wmma::__float_to_tf32(x - hi);
        }
#pragma unroll
        for (int e = 0; e < b.num_elements; e++) {
            const float x = b.x[e], hi = wmma::__float_to_tf32(x);
            b.x[e] = hi;
            if (SPLIT) bl.x[e] = wmma::__float_to_tf32(x - hi);
        }
        if (SPLIT) {
            wmma::mma_sync(c, al, b, c);
            wmma::mma_sync(c, a, bl, c);
        }
        wmma::mma_sync(c, a, b, c);
    }
}
using RM = wmma::row_major;
using CM = wmma::col_major;

// A warp writes a 16x16 fp32 tile staged at `st` (row stride ld) as bf16 into
// global rows (row stride gstride), rows >= nvalid skipped, times `mul`.
__device__ __forceinline__ void store_tile_bf16(bf16 *dst, size_t gstride, const float *st,
                                                int ld, int nvalid, float mul) {
    int lane = threadIdx.x & 31, r = lane >> 1, c0 = (lane & 1) * 8;
    if (r >= nvalid) return;
    __align__(16) bf16 tmp[8];
#pragma unroll
    for (int i = 0; i < 8; i++) tmp[i] = __float2bfloat16(st[r * ld + c0 + i] * mul);
    *reinterpret_cast<uint4 *>(dst + (size_t)r * gstride + c0) = *reinterpret_cast<uint4 *>(tmp);
}

// The same for a tile that carries its bf16 rounding residue: hi = bf16(x)
// into `dst` (row stride gstride), lo = bf16(x - hi) into `dst_lo` (row stride
// lstride; all rows).
__device__ __forceinline__ void store_tile_split(bf16 *dst, size_t gstride, bf16 *dst_lo,
                                                 size_t lstride, const float *st, int ld) {
    int lane = threadIdx.x & 31, r = lane >> 1, c0 = (lane & 1) * 8;
    __align__(16) bf16 hi[8], lo[8];
#pragma unroll
    for (int i = 0; i < 8; i++) {
        float x = st[r * ld + c0 + i];
        hi[i] = __float2bfloat16(x);
        lo[i] = __float2bfloat16(x - __bfloat162float(hi[i]));
    }
    *reinterpret_cast<uint4 *>(dst + (size_t)r * gstride + c0) = *reinterpret_cast<uint4 *>(hi);
    *reinterpret_cast<uint4 *>(dst_lo + (size_t)r * lstride + c0) = *reinterpret_cast<uint4 *>(lo);
}
// Eight consecutive bf16 (16-byte aligned, shared or global) to floats and back;
// eight floats (16-byte aligned) from shared memory.
__device__ __forceinline__ void ld8(const bf16 *src, float x[8]) {
    uint4 u = *reinterpret_cast<const uint4 *>(src);
    const __nv_bfloat162 *h2 = reinterpret_cast<const __nv_bfloat162 *>(&u);
#pragma unroll
    for (int e = 0; e < 4; e++) {
        float2 f = __bfloat1622float2(h2[e]);
        x[2 * e] = f.x;
        x[2 * e + 1] = f.y;
    }
}
__device__ __forceinline__ void st8(bf16 *dst, const float x[8]) {
    uint4 u;
    unsigned *w = reinterpret_cast<unsigned *>(&u);
#pragma unroll
    for (int e = 0; e < 4; e++) {
        __nv_bfloat162 v = __floats2bfloat162_rn(x[2 * e], x[2 * e + 1]);
        w[e] = *reinterpret_cast<unsigned *>(&v);
    }
    *reinterpret_cast<uint4 *>(dst) = u;
}
__device__ __forceinline__ void ldf8(const float *src, float x[8]) {
    float4 a = *reinterpret_cast<const float4 *>(src), b = *reinterpret_cast<const float4 *>(src + 4);
    x[0] = a.x, x[1] = a.y, x[2] = a.z, x[3] = a.w, x[4] = b.x, x[5] = b.y, x[6] = b.z, x[7] = b.w;
}

// Raw tensor-core fragments (PTX mma.sync m16n8k16, bf16 in, fp32 out) for
// kernels that keep operands in registers. Layouts (lane = thread % 32):
// A 16x16: {a0,a1}=(r, c..c+1), a2..a3 row r+8, a4..a5 col c+8, a6..a7 both,
// with r = lane/4, c = 2*(lane%4); B 16x8: b0..b1 = (k = c..c+1, n = r),
// b2..b3 = k + 8; C 16x8: c0..c1 = (r, c..c+1), c2..c3 = (r + 8, c..c+1).
// So the C tiles of two neighbouring 8-column blocks, rounded to bf16, are
// the A fragment of the 16 columns they cover (no data movement).
__device__ __forceinline__ unsigned smem_addr(const void *p) {
    return static_cast<unsigned>(__cvta_generic_to_shared(p));
}
// Four 8x8 bf16 matrices from shared memory: lane l gives the address of row
// l % 8 of matrix l / 8; r[m] then holds (row lane/4, cols 2*(lane%4)..+1) of
// matrix m, or with .trans (rows 2*(lane%4)..+1, col lane/4).
__device__ __forceinline__ void ldsm_x4(unsigned r[4], const bf16 *p) {
    asm volatile("ldmatrix.sync.aligned.m8n8.x4.shared.b16 {%0,%1,%2,%3}, [%4];\n"
                 : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3])
                 : "r"(smem_addr(p)));
}
__device__ __forceinline__ void ldsm_x4_t(unsigned r[4], const bf16 *p) {
    asm volatile("ldmatrix.sync.aligned.m8n8.x4.trans.shared.b16 {%0,%1,%2,%3}, [%4];\n"
                 : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3])
                 : "r"(smem_addr(p)));
}
// Four 8x8 bf16 matrices to shared memory, transposed (sm_90 stmatrix): r[m]
// holds (row lane/4, cols 2*(lane%4)..+1) of matrix m, as an A fragment or two
// packed C tiles do; lane l gives the address of row l % 8 of the stored
// (transposed) matrix l / 8, i.e. of column l % 8 of the fragment's matrix.
__device__ __forceinline__ void stsm_x4_t(bf16 *p, const unsigned r[4]) {
    asm volatile("stmatrix.sync.aligned.m8n8.x4.trans.shared.b16 [%0], {%1,%2,%3,%4};\n" ::"r"(
                     smem_addr(p)),
                 "r"(r[0]), "r"(r[1]), "r"(r[2]), "r"(r[3])
                 : "memory");
}
// Two matrices, transposed, to shared memory: lanes 0..15 give the addresses.
__device__ __forceinline__ void stsm_x2_t(bf16 *p, unsigned r0, unsigned r1) {
    asm volatile("stmatrix.sync.aligned.m8n8.x2.trans.shared.b16 [%0], {%1,%2};\n" ::"r"(
                     smem_addr(p)),
                 "r"(r0), "r"(r1)
                 : "memory");
}
__device__ __forceinline__ void ldsm_x2_t(unsigned r[2], const bf16 *p) {
    asm volatile("ldmatrix.sync.aligned.m8n8.x2.trans.shared.b16 {%0,%1}, [%2];\n"
                 : "=r"(r[0]), "=r"(r[1])
                 : "r"(smem_addr(p)));
}
// Two matrices: lanes 0..15 give the addresses (the others' are ignored).
__device__ __forceinline__ void ldsm_x2(unsigned r[2], const bf16 *p) {
    asm volatile("ldmatrix.sync.aligned.m8n8.x2.shared.b16 {%0,%1}, [%2];\n"
                 : "=r"(r[0]), "=r"(r[1])
                 : "r"(smem_addr(p)));
}
// c += a * b (16x16 times 16x8).
__device__ __forceinline__ void mma16816(float c[4], const unsigned a[4], unsigned b0,
                                         unsigned b1) {
    asm("mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32 "
                 "{%0,%1,%2,%3}, {%4,%5,%6,%7}, {%8,%9}, {%0,%1,%2,%3};\n"
                 : "+f"(c[0]), "+f"(c[1]), "+f"(c[2]), "+f"(c[3])
                 : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b0), "r"(b1));
}
// Two floats rounded to bf16 (nearest even), `lo` in the low half.
__device__ __forceinline__ unsigned pack_bf16x2(float lo, float hi) {
    __nv_bfloat162 v = __floats2bfloat162_rn(lo, hi);
    return *reinterpret_cast<unsigned *>(&v);
}
// The bf16 rounding residue of x: x - bf16(x) (exact in fp32), itself rounded
// to bf16 when used as an operand: hi + lo carries x to about 16 bits.
__device__ __forceinline__ float bf16_residue(float x) {
    return x - __bfloat162float(__float2bfloat16(x));
}
// The A fragment of the 16 columns covered by C tiles c0 (columns 0..7) and c1 (8..15).
__device__ __forceinline__ void c_to_a(unsigned a[4], const float c0[4], const float c1[4]) {
    a[0] = pack_bf16x2(c0[0], c0[1]);
    a[1] = pack_bf16x2(c0[2], c0[3]);
    a[2] = pack_bf16x2(c1[0], c1[1]);
    a[3] = pack_bf16x2(c1[2], c1[3]);
}

// 16-byte asynchronous copies global -> shared (sm_80+), completed by groups.
__device__ __forceinline__ void cp_async16(void *smem, const void *gmem, bool valid) {
    unsigned s = static_cast<unsigned>(__cvta_generic_to_shared(smem));
    int n = valid ? 16 : 0; // 0: fill the 16 bytes with zeros
    asm volatile("cp.async.cg.shared.global [%0], [%1], 16, %2;\n" ::"r"(s), "l"(gmem), "r"(n));
}
// The same for 4 bytes (cp.async.ca: the only form for sizes below 16).
__device__ __forceinline__ void cp_async4(void *smem, const void *gmem, bool valid) {
    unsigned s = static_cast<unsigned>(__cvta_generic_to_shared(smem));
    int n = valid ? 4 : 0;
    asm volatile("cp.async.ca.shared.global [%0], [%1], 4, %2;\n" ::"r"(s), "l"(gmem), "r"(n));
}
__device__ __forceinline__ void cp_async_commit() { asm volatile("cp.async.commit_group;\n"); }
template <int N> __device__ __forceinline__ void cp_async_wait() {
    asm volatile("cp.async.wait_group %0;\n" ::"n"(N));
}

// Ask the bulk-copy unit to bring a contiguous range into L2 (sm_90; bytes and
// address multiples of 16): a hint, with no registers and nothing to wait for.
__device__ __forceinline__ void prefetch_l2_bulk(const void *gmem, unsigned bytes) {
    asm volatile("cp.async.bulk.prefetch.L2.global [%0], %1;\n" ::"l"(gmem), "r"(bytes)
                 : "memory");
}

// mbarriers (sm_90) for the bulk-copy unit: a barrier counts one arrival (the
// thread that issues the copies, announcing their bytes) and the bytes landed.
__device__ __forceinline__ void mbar_init(unsigned long long *bar) {
    asm volatile("mbarrier.init.shared::cta.b64 [%0], 1;\n" ::"r"(smem_addr(bar)) : "memory");
}
// Make initialised barriers visible to the bulk-copy unit (a block barrier follows).
__device__ __forceinline__ void mbar_init_fence() {
    asm volatile("fence.mbarrier_init.release.cluster;\n" ::: "memory");
}
// Arrive once and expect `bytes` more of bulk copies in the current phase.
__device__ __forceinline__ void mbar_expect_tx(unsigned long long *bar, unsigned bytes) {
    asm volatile("mbarrier.arrive.expect_tx.shared::cta.b64 _, [%0], %1;\n" ::"r"(smem_addr(bar)),
                 "r"(bytes)
                 : "memory");
}
// Wait until the barrier's phase of the given parity has completed.
__device__ __forceinline__ void mbar_wait(unsigned long long *bar, unsigned parity) {
    const unsigned a = smem_addr(bar);
    unsigned done = 0;
    while (!done)
        asm volatile("{\n .reg .pred p;\n"
                     " mbarrier.try_wait.parity.shared::cta.b64 p, [%1], %2;\n"
                     " selp.u32 %0, 1, 0, p;\n}\n"
                     : "=r"(done)
                     : "r"(a), "r"(parity)
                     : "memory");
}
// `bytes` (a multiple of 16, both addresses 16-byte aligned) from global to
// shared memory by the bulk-copy unit, counted by the barrier `bar`.
__device__ __forceinline__ void bulk_g2s(void *dst, const void *src, unsigned bytes,
                                         unsigned long long *bar) {
    asm volatile("cp.async.bulk.shared::cluster.global.mbarrier::complete_tx::bytes"
                 " [%0], [%1], %2, [%3];\n" ::"r"(smem_addr(dst)),
                 "l"(src), "r"(bytes), "r"(smem_addr(bar))
                 : "memory");
}

// Raise a kernel's dynamic shared-memory limit, then launch it with (p).
template <typename Kern>
static cudaError_t launch_with_smem(Kern kern, dim3 grid, dim3 block, size_t smem,
                                    cudaStream_t s, const Params &p) {
    cudaError_t e =
        cudaFuncSetAttribute(kern, cudaFuncAttributeMaxDynamicSharedMemorySize, (int)smem);
    if (e != cudaSuccess) return e;
    kern<<<grid, block, smem, s>>>(p);
    return cudaGetLastError();
}

// Launchers (kda_forward.cu, kda_state.cu, kda_backward.cu). They return the launch error.
// precise: write / use the residues u_lo and kd_lo (p.u_lo, p.kd_lo set).
cudaError_t launch_fwd_intra(const Params &p, int D, bool factored, bool save_x, bool precise,
                             cudaStream_t s);
cudaError_t launch_fwd_state(const Params &p, int D, bool save, bool precise, cudaStream_t s);
cudaError_t launch_decode(const Params &p, int D, float *state, cudaStream_t s);
cudaError_t launch_bwd_state(const Params &p, int D, cudaStream_t s);
// The intra-chunk gradient: three launches (kda_backward.cu).
cudaError_t launch_bwd_intra(const Params &p, int D, bool factored, cudaStream_t s);

} // namespace lmkda

#endif

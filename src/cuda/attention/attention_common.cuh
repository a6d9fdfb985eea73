// Shared pieces of the flash attention kernels (attention_forward.cu,
// attention_backward.cu): the launch parameters, tile sizes, and the warp-level
// tensor-core primitives (ldmatrix, mma.sync m16n8k16 bf16 with fp32
// accumulation, cp.async).
//
// Fragment layout of mma.m16n8k16 (PTX ISA), with g = lane / 4, c = lane % 4:
//   A (16x16 bf16): a0 = (row g, cols 2c,2c+1), a1 = (row g+8, same cols),
//                   a2 = (row g, cols 2c+8,+9),  a3 = (row g+8, cols 2c+8,+9)
//   B (16x8 bf16):  b0 = (k rows 2c,2c+1, col g), b1 = (k rows 2c+8,+9, col g)
//   C (16x8 fp32):  c0,c1 = (row g, cols 2c,2c+1), c2,c3 = (row g+8, same cols)
// so an accumulator pair of 8-column blocks (16 rows x 16 cols) is, packed to
// bf16, exactly the A operand of the next product (P of S = QK^T feeds P V).
#ifndef LONGMOE_ATTENTION_COMMON_CUH
#define LONGMOE_ATTENTION_COMMON_CUH

#include <cuda_bf16.h>
#include <stdint.h>

namespace lmattn {

// Keys per tile in the forward and the dq pass; query rows per warp.
constexpr int KEY_TILE = 64;
constexpr int WARP_ROWS = 16;
// Warps per block: forward (query rows per block = 16 * FWD_WARPS), dq pass,
// dk/dv pass (keys per block = 16 * DKV_WARPS).
constexpr int FWD_WARPS = 8;
constexpr int DQ_WARPS = 4;
constexpr int DKV_WARPS = 4;
constexpr float LOG2E = 1.4426950408889634f;
constexpr float LN2 = 0.6931471805599453f;

// Shared-memory row stride (bf16 elements) of a tile with D columns: 8 extra
// elements (16 bytes) shift consecutive rows by an odd number of 16-byte
// units, so the 8 row addresses of one ldmatrix hit 8 different bank groups.
__host__ __device__ constexpr int smem_ld(int D) { return D + 8; }

// Query rows per tile in the dk/dv pass: 32 when the two head dims together
// exceed 128 (keeps the 16x(rows) score and dP fragments plus the dk and dv
// accumulators within the register file), else 64.
__host__ __device__ constexpr int dkv_query_tile(int DK, int DV) { return DK + DV > 128 ? 32 : 64; }

struct Params {
    const uint16_t *q, *k, *v, *o, *d_o;  // bf16 inputs
    uint16_t *o_out, *dq, *dk, *dv;        // bf16 outputs
    float *lse;                            // [B,H,T]
    const float *lse_in;                   // [B,H,T] (backward)
    float *delta;                          // [B,H,T] D_i = rowsum(dO * O) (backward)
    float *head_max;                       // [H] or NULL (forward)
    int B, T, H, Hkv, group;               // group = H / Hkv
    int Tk;                                // key/value rows per sequence (qoff + T)
    int qoff;                              // position of query 0 (query i sees keys <= qoff + i)
    float scale;                           // score scale
    float scale_log2;                      // scale * log2(e): scores in base 2
};

__device__ __forceinline__ uint32_t smem_addr(const void *p) {
    return (uint32_t)__cvta_generic_to_shared(p);
}

// 16 bytes global -> shared, asynchronously; src_bytes = 0 writes zeros.
__device__ __forceinline__ void cp_async16(void *dst, const void *src, int src_bytes) {
    asm volatile("cp.async.cg.shared.global [%0], [%1], 16, %2;\n" ::"r"(smem_addr(dst)),
                 "l"(src), "r"(src_bytes));
}
__device__ __forceinline__ void cp_async_commit() { asm volatile("cp.async.commit_group;\n" ::); }
template <int N>
__device__ __forceinline__ void cp_async_wait() {
    asm volatile("cp.async.wait_group %0;\n" ::"n"(N));
}

__device__ __forceinline__ void ldmatrix_x4(uint32_t r[4], const void *p) {
    asm volatile("ldmatrix.sync.aligned.m8n8.x4.shared.b16 {%0,%1,%2,%3}, [%4];\n"
                 : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3])
                 : "r"(smem_addr(p)));
}
__device__ __forceinline__ void ldmatrix_x4_trans(uint32_t r[4], const void *p) {
    asm volatile("ldmatrix.sync.aligned.m8n8.x4.trans.shared.b16 {%0,%1,%2,%3}, [%4];\n"
                 : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3])
                 : "r"(smem_addr(p)));
}

// c += a * b (16x8x16, bf16 operands, fp32 accumulators)
__device__ __forceinline__ void mma_bf16(float c[4], const uint32_t a[4], uint32_t b0, uint32_t b1) {
    asm volatile(
        "mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32 {%0,%1,%2,%3}, {%4,%5,%6,%7}, "
        "{%8,%9}, {%0,%1,%2,%3};\n"
        : "+f"(c[0]), "+f"(c[1]), "+f"(c[2]), "+f"(c[3])
        : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b0), "r"(b1));
}

// Two floats as a bf16 pair (round to nearest even); lo in the low half.
__device__ __forceinline__ uint32_t pack_bf16(float lo, float hi) {
    __nv_bfloat162 h = __floats2bfloat162_rn(lo, hi);
    return *reinterpret_cast<uint32_t *>(&h);
}
__device__ __forceinline__ float bf16_to_float(uint16_t x) {
    return __uint_as_float((uint32_t)x << 16);
}

// ldmatrix lane addresses (element offsets into a row-major tile with row stride ld):
// A operand, the 16x16 block at (row0, col0).
__device__ __forceinline__ int a_frag_offset(int lane, int row0, int col0, int ld) {
    return (row0 + (lane & 15)) * ld + col0 + (lane >> 4) * 8;
}
// B operand from a tile stored [n][k] (non-transposed ldmatrix): the 16 n x 16 k
// block at (n0, k0); r0,r1 = b0,b1 of columns n0..n0+7, r2,r3 of n0+8..n0+15.
__device__ __forceinline__ int bt_frag_offset(int lane, int n0, int k0, int ld) {
    return (n0 + (lane & 7) + ((lane >> 4) << 3)) * ld + k0 + ((lane >> 3) & 1) * 8;
}
// B operand from a tile stored [k][n] (transposed ldmatrix): the 16 k x 16 n
// block at (k0, n0); same register order as bt_frag_offset.
__device__ __forceinline__ int b_frag_offset(int lane, int k0, int n0, int ld) {
    return (k0 + (lane & 7) + ((lane >> 3) & 1) * 8) * ld + n0 + (lane >> 4) * 8;
}

// Rows row0 .. row0+nrows-1 of a [T, stride] bf16 tensor (D columns read from
// `g`, the row-0 pointer of this head) into shared memory; rows >= T are
// zero-filled (they meet zero probabilities in the products, and 0 * garbage
// could be NaN). nt threads, thread tid.
template <int D>
__device__ __forceinline__ void load_rows_async(uint16_t *s, const uint16_t *g, long long stride,
                                                int row0, int nrows, int T, int tid, int nt) {
    constexpr int CHUNKS = D / 8;  // 16-byte chunks per row
    constexpr int LD = smem_ld(D);
    for (int i = tid; i < nrows * CHUNKS; i += nt) {
        const int r = i / CHUNKS, c = (i % CHUNKS) * 8;
        const int t = row0 + r;
        const uint16_t *src = g + (long long)(t < T ? t : T - 1) * stride + c;
        cp_async16(s + r * LD + c, src, t < T ? 16 : 0);
    }
}

// Exact float maximum through integer atomics (order-free, so deterministic):
// a non-negative float orders like its int bits, a negative one inversely to
// its unsigned bits. *addr must start at -inf. (-0 becomes +0 first.)
__device__ __forceinline__ void atomic_max_float(float *addr, float v) {
    if (v == 0.f) v = 0.f;
    if (v >= 0.f)
        atomicMax(reinterpret_cast<int *>(addr), __float_as_int(v));
    else
        atomicMin(reinterpret_cast<unsigned int *>(addr), __float_as_uint(v));
}

}  // namespace lmattn

#endif

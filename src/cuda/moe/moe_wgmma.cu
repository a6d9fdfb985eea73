/* The grouped expert products on Hopper's tensor cores (wgmma), the kind
 * LM_MOE_GEMM_WGMMA (include/longmoe/moe_cuda.h).
 *
 * Rows mode only (NT and NN, src/cuda/moe/moe_internal.cuh): C[P, N] (+)=
 * A[P, K] B_j with the weight of the expert j that owns each tile of 128
 * grouped rows (LM_MOE_CUDA_ROW_TILE: a tile never straddles two experts).
 * NT reads B_j as W_j[N, K] (K contiguous, as A): both operands are K-major,
 * the layout wgmma reads from shared memory without a transpose. NN (B_j =
 * W_j[K, N]) first writes every W_j^T into a scratch buffer (n K N bf16, a
 * few tens of microseconds) and then runs as NT. The weight gradients (TN)
 * stay with cuBLAS (moe.cu sends them to the batched kind).
 *
 * One block of 256 threads (two warpgroups) computes a 128 x 128 tile of C:
 * the tile of A (128 rows x 64 of K) and of B (128 of N x 64 of K) come by
 * the tensor memory accelerator (TMA) into shared memory swizzled by 128
 * bytes, three stages deep, counted by an mbarrier per stage; each warpgroup
 * multiplies its 64 rows by the 128 columns with wgmma m64n128k16 (fp32
 * accumulators in registers). Two blocks share a multiprocessor, so one's
 * epilogue overlaps the other's products. The grid runs over every tile of
 * rows_max rows; a tile at or past padded_offsets[n] returns at once, so the
 * row counts stay on the device. The N tiles of one row tile are neighbours
 * in launch order: A is read from memory about once, the weights from L2.
 *
 * Numerics: bf16 operands, fp32 accumulation in the order of K (each output
 * written by one thread: deterministic, the same bits from run to run); the
 * output rounded once to bf16 (or stored fp32), with accumulate the fp32
 * sum of the old value and the product. Padding rows (zero in A) give zero
 * rows in C, as the batched kind's do. */
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include <cuda.h>
#include <cudaTypedefs.h>

#include "check.h"
#include "cuda/common/switch_setting.cuh"
#include "cuda/cuda_check.h"
#include "cuda/moe/moe_internal.cuh"
#include "longmoe/moe_cuda.h"

namespace {

constexpr int TILE_M = 128, TILE_K = 64, THREADS = 256;

/* The two tile shapes (LONGMOE_MOE_WGMMA_TILE): 128 x 128 in three stages,
 * two blocks a multiprocessor; 128 x 256 in four stages, one block. */
template <int TILE_N, int STAGES> struct shape {
    static constexpr int stage_a = TILE_M * TILE_K, stage_b = TILE_N * TILE_K; /* bf16 elements */
    static constexpr unsigned stage_bytes = (unsigned)(stage_a + stage_b) * 2u;
    static constexpr size_t smem_bytes = 1024 + (size_t)STAGES * stage_bytes + 64;
};

static_assert(TILE_M == LM_MOE_CUDA_ROW_TILE, "a row tile must be one expert's");

__device__ __forceinline__ unsigned shared_u32(const void *p) {
    return (unsigned)__cvta_generic_to_shared(p);
}

__device__ __forceinline__ void bar_init(uint64_t *bar) {
    asm volatile("mbarrier.init.shared::cta.b64 [%0], 1;\n" ::"r"(shared_u32(bar)) : "memory");
}

__device__ __forceinline__ void bar_arrive_bytes(uint64_t *bar, unsigned bytes) {
    asm volatile("mbarrier.arrive.expect_tx.shared::cta.b64 _, [%0], %1;\n" ::"r"(shared_u32(bar)), "r"(bytes)
                 : "memory");
}

__device__ __forceinline__ void bar_wait_parity(uint64_t *bar, unsigned parity) {
    const unsigned a = shared_u32(bar);
    unsigned ready = 0;
    do {
        asm volatile("{\n .reg .pred q;\n"
                     " mbarrier.try_wait.parity.shared::cta.b64 q, [%1], %2;\n"
                     " selp.u32 %0, 1, 0, q;\n}\n"
                     : "=r"(ready)
                     : "r"(a), "r"(parity)
                     : "memory");
    } while (!ready);
}

/* one box of a 2-D (x = K, y = row) or 3-D (x = K, y = N, z = expert) tensor map */
__device__ __forceinline__ void tma_load_2d(void *dst, const CUtensorMap *map, int x, int y, uint64_t *bar) {
    asm volatile("cp.async.bulk.tensor.2d.shared::cluster.global.mbarrier::complete_tx::bytes"
                 " [%0], [%1, {%2, %3}], [%4];\n" ::"r"(shared_u32(dst)),
                 "l"((uint64_t)map), "r"(x), "r"(y), "r"(shared_u32(bar))
                 : "memory");
}

__device__ __forceinline__ void tma_load_3d(void *dst, const CUtensorMap *map, int x, int y, int z, uint64_t *bar) {
    asm volatile("cp.async.bulk.tensor.3d.shared::cluster.global.mbarrier::complete_tx::bytes"
                 " [%0], [%1, {%2, %3, %4}], [%5];\n" ::"r"(shared_u32(dst)),
                 "l"((uint64_t)map), "r"(x), "r"(y), "r"(z), "r"(shared_u32(bar))
                 : "memory");
}

/* Shared-memory matrix descriptor of a K-major tile whose rows are 128 bytes
 * (64 bf16), swizzled by 128 bytes as TMA writes it: 8-row groups 1024 bytes
 * apart (the stride), the leading offset unused with this swizzle. The start
 * moves by 32 bytes for each k16 step inside the row. */
__device__ __forceinline__ uint64_t smem_desc(const void *p) {
    const uint64_t addr = shared_u32(p);
    return ((addr & 0x3FFFFull) >> 4) | (1ull << 16) | ((uint64_t)(1024 >> 4) << 32) | (1ull << 62);
}

__device__ __forceinline__ void wgmma_fence() { asm volatile("wgmma.fence.sync.aligned;\n" ::: "memory"); }
__device__ __forceinline__ void wgmma_commit() { asm volatile("wgmma.commit_group.sync.aligned;\n" ::: "memory"); }
__device__ __forceinline__ void wgmma_wait_all() { asm volatile("wgmma.wait_group.sync.aligned 0;\n" ::: "memory"); }
__device__ __forceinline__ void wgmma_wait_one() { asm volatile("wgmma.wait_group.sync.aligned 1;\n" ::: "memory"); }

/* D[64 x N] += A[64 x 16] B[16 x N]^T, both from shared memory, K-major */
__device__ __forceinline__ void wgmma_m64n128k16(float (&d)[64], uint64_t desc_a, uint64_t desc_b) {
    asm volatile("{\n.reg .pred p;\nsetp.ne.b32 p, %66, 0;\n"
                 "wgmma.mma_async.sync.aligned.m64n128k16.f32.bf16.bf16 {"
                 "%0, %1, %2, %3, %4, %5, %6, %7, %8, %9, %10, %11, %12, %13, %14, %15, "
                 "%16, %17, %18, %19, %20, %21, %22, %23, %24, %25, %26, %27, %28, %29, %30, %31, "
                 "%32, %33, %34, %35, %36, %37, %38, %39, %40, %41, %42, %43, %44, %45, %46, %47, "
                 "%48, %49, %50, %51, %52, %53, %54, %55, %56, %57, %58, %59, %60, %61, %62, %63"
                 "}, %64, %65, p, 1, 1, 0, 0;\n}\n"
                 :
                   "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3]), "+f"(d[4]), "+f"(d[5]), "+f"(d[6]), "+f"(d[7]),
                   "+f"(d[8]), "+f"(d[9]), "+f"(d[10]), "+f"(d[11]), "+f"(d[12]), "+f"(d[13]), "+f"(d[14]), "+f"(d[15]),
                   "+f"(d[16]), "+f"(d[17]), "+f"(d[18]), "+f"(d[19]), "+f"(d[20]), "+f"(d[21]), "+f"(d[22]), "+f"(d[23]),
                   "+f"(d[24]), "+f"(d[25]), "+f"(d[26]), "+f"(d[27]), "+f"(d[28]), "+f"(d[29]), "+f"(d[30]), "+f"(d[31]),
                   "+f"(d[32]), "+f"(d[33]), "+f"(d[34]), "+f"(d[35]), "+f"(d[36]), "+f"(d[37]), "+f"(d[38]), "+f"(d[39]),
                   "+f"(d[40]), "+f"(d[41]), "+f"(d[42]), "+f"(d[43]), "+f"(d[44]), "+f"(d[45]), "+f"(d[46]), "+f"(d[47]),
                   "+f"(d[48]), "+f"(d[49]), "+f"(d[50]), "+f"(d[51]), "+f"(d[52]), "+f"(d[53]), "+f"(d[54]), "+f"(d[55]),
                   "+f"(d[56]), "+f"(d[57]), "+f"(d[58]), "+f"(d[59]), "+f"(d[60]), "+f"(d[61]), "+f"(d[62]), "+f"(d[63])
                 : "l"(desc_a), "l"(desc_b), "r"(1));
}

__device__ __forceinline__ void wgmma_m64n256k16(float (&d)[128], uint64_t desc_a, uint64_t desc_b) {
    asm volatile("{\n.reg .pred p;\nsetp.ne.b32 p, %130, 0;\n"
                 "wgmma.mma_async.sync.aligned.m64n256k16.f32.bf16.bf16 {"
                 "%0, %1, %2, %3, %4, %5, %6, %7, %8, %9, %10, %11, %12, %13, %14, %15, "
                 "%16, %17, %18, %19, %20, %21, %22, %23, %24, %25, %26, %27, %28, %29, %30, %31, "
                 "%32, %33, %34, %35, %36, %37, %38, %39, %40, %41, %42, %43, %44, %45, %46, %47, "
                 "%48, %49, %50, %51, %52, %53, %54, %55, %56, %57, %58, %59, %60, %61, %62, %63, "
                 "%64, %65, %66, %67, %68, %69, %70, %71, %72, %73, %74, %75, %76, %77, %78, %79, "
                 "%80, %81, %82, %83, %84, %85, %86, %87, %88, %89, %90, %91, %92, %93, %94, %95, "
                 "%96, %97, %98, %99, %100, %101, %102, %103, %104, %105, %106, %107, %108, %109, %110, %111, "
                 "%112, %113, %114, %115, %116, %117, %118, %119, %120, %121, %122, %123, %124, %125, %126, %127"
                 "}, %128, %129, p, 1, 1, 0, 0;\n}\n"
                 :
                   "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3]), "+f"(d[4]), "+f"(d[5]), "+f"(d[6]), "+f"(d[7]),
                   "+f"(d[8]), "+f"(d[9]), "+f"(d[10]), "+f"(d[11]), "+f"(d[12]), "+f"(d[13]), "+f"(d[14]), "+f"(d[15]),
                   "+f"(d[16]), "+f"(d[17]), "+f"(d[18]), "+f"(d[19]), "+f"(d[20]), "+f"(d[21]), "+f"(d[22]), "+f"(d[23]),
                   "+f"(d[24]), "+f"(d[25]), "+f"(d[26]), "+f"(d[27]), "+f"(d[28]), "+f"(d[29]), "+f"(d[30]), "+f"(d[31]),
                   "+f"(d[32]), "+f"(d[33]), "+f"(d[34]), "+f"(d[35]), "+f"(d[36]), "+f"(d[37]), "+f"(d[38]), "+f"(d[39]),
                   "+f"(d[40]), "+f"(d[41]), "+f"(d[42]), "+f"(d[43]), "+f"(d[44]), "+f"(d[45]), "+f"(d[46]), "+f"(d[47]),
                   "+f"(d[48]), "+f"(d[49]), "+f"(d[50]), "+f"(d[51]), "+f"(d[52]), "+f"(d[53]), "+f"(d[54]), "+f"(d[55]),
                   "+f"(d[56]), "+f"(d[57]), "+f"(d[58]), "+f"(d[59]), "+f"(d[60]), "+f"(d[61]), "+f"(d[62]), "+f"(d[63]),
                   "+f"(d[64]), "+f"(d[65]), "+f"(d[66]), "+f"(d[67]), "+f"(d[68]), "+f"(d[69]), "+f"(d[70]), "+f"(d[71]),
                   "+f"(d[72]), "+f"(d[73]), "+f"(d[74]), "+f"(d[75]), "+f"(d[76]), "+f"(d[77]), "+f"(d[78]), "+f"(d[79]),
                   "+f"(d[80]), "+f"(d[81]), "+f"(d[82]), "+f"(d[83]), "+f"(d[84]), "+f"(d[85]), "+f"(d[86]), "+f"(d[87]),
                   "+f"(d[88]), "+f"(d[89]), "+f"(d[90]), "+f"(d[91]), "+f"(d[92]), "+f"(d[93]), "+f"(d[94]), "+f"(d[95]),
                   "+f"(d[96]), "+f"(d[97]), "+f"(d[98]), "+f"(d[99]), "+f"(d[100]), "+f"(d[101]), "+f"(d[102]), "+f"(d[103]),
                   "+f"(d[104]), "+f"(d[105]), "+f"(d[106]), "+f"(d[107]), "+f"(d[108]), "+f"(d[109]), "+f"(d[110]), "+f"(d[111]),
                   "+f"(d[112]), "+f"(d[113]), "+f"(d[114]), "+f"(d[115]), "+f"(d[116]), "+f"(d[117]), "+f"(d[118]), "+f"(d[119]),
                   "+f"(d[120]), "+f"(d[121]), "+f"(d[122]), "+f"(d[123]), "+f"(d[124]), "+f"(d[125]), "+f"(d[126]), "+f"(d[127])
                 : "l"(desc_a), "l"(desc_b), "r"(1));
}

struct tile_args {
    float *c;
    bf16 *cb;
    int64_t ldc;
    int accumulate;
    int N, K;
    const int32_t *padded; /* [groups + 1] */
    int groups;
};

template <int TILE_N, int STAGES, int MIN_BLOCKS>
__global__ void __launch_bounds__(THREADS, MIN_BLOCKS)
grouped_nt_kernel(const __grid_constant__ CUtensorMap map_a, const __grid_constant__ CUtensorMap map_b,
                  tile_args p) {
    typedef shape<TILE_N, STAGES> S;
    constexpr int STAGE_A = S::stage_a, STAGE_B = S::stage_b;
    constexpr unsigned STAGE_BYTES = S::stage_bytes;
    const int row0 = blockIdx.y * TILE_M;
    const int total = p.padded[p.groups];
    if (row0 >= total) return;
    /* the expert owning the tile: the largest j with padded[j] <= row0 */
    const int expert = group_of_row(p.padded, p.groups, row0), col0 = blockIdx.x * TILE_N;

    extern __shared__ unsigned char smem_raw[];
    unsigned char *base = (unsigned char *)(((uintptr_t)smem_raw + 1023) & ~(uintptr_t)1023);
    bf16 *sa = (bf16 *)base;
    bf16 *sb = sa + STAGES * STAGE_A;
    uint64_t *full = (uint64_t *)(sb + STAGES * STAGE_B);

    const int tid = threadIdx.x, wg = tid >> 7;
    const int kblocks = (p.K + TILE_K - 1) / TILE_K;
    if (tid == 0) {
        for (int s = 0; s < STAGES; s++) bar_init(&full[s]);
        asm volatile("fence.mbarrier_init.release.cluster;\n" ::: "memory");
    }
    __syncthreads();
    if (tid == 0) {
        for (int s = 0; s < STAGES && s < kblocks; s++) {
            bar_arrive_bytes(&full[s], STAGE_BYTES);
            tma_load_2d(sa + s * STAGE_A, &map_a, s * TILE_K, row0, &full[s]);
            tma_load_3d(sb + s * STAGE_B, &map_b, s * TILE_K, col0, expert, &full[s]);
        }
    }

    float d[TILE_N / 2];
#pragma unroll
    for (int i = 0; i < TILE_N / 2; i++) d[i] = 0.0f;

    /* k-block kb's products are issued, then those of kb - 1 waited for, and
     * its stage refilled with k-block kb - 1 + STAGES: the tensor cores
     * always hold one block's products while the stage turns over */
    for (int kb = 0; kb < kblocks; kb++) {
        const int s = kb % STAGES;
        bar_wait_parity(&full[s], (unsigned)(kb / STAGES) & 1u);
        const bf16 *ta = sa + s * STAGE_A + wg * 64 * TILE_K;
        const bf16 *tb = sb + s * STAGE_B;
        wgmma_fence();
#pragma unroll
        for (int kk = 0; kk < TILE_K / 16; kk++) {
            if constexpr (TILE_N == 256) wgmma_m64n256k16(d, smem_desc(ta + kk * 16), smem_desc(tb + kk * 16));
            else wgmma_m64n128k16(d, smem_desc(ta + kk * 16), smem_desc(tb + kk * 16));
        }
        wgmma_commit();
        wgmma_wait_one();
        __syncthreads(); /* both warpgroups are done with the stage of kb - 1 */
        const int refill = kb - 1 + STAGES;
        if (tid == 0 && kb >= 1 && refill < kblocks) {
            const int sp = (kb - 1) % STAGES;
            bar_arrive_bytes(&full[sp], STAGE_BYTES);
            tma_load_2d(sa + sp * STAGE_A, &map_a, refill * TILE_K, row0, &full[sp]);
            tma_load_3d(sb + sp * STAGE_B, &map_b, refill * TILE_K, col0, expert, &full[sp]);
        }
    }
    wgmma_wait_all();

    /* accumulator layout of m64nNk16: thread t of the warpgroup holds, for
     * each 8 columns i, rows 16 w + t/4 (+8) of warp w = t/32 and columns
     * 8 i + 2 (t % 4) (+1) */
    const int t = tid & 127, warp = t >> 5, lane = t & 31;
    const int64_t r_top = (int64_t)row0 + wg * 64 + warp * 16 + (lane >> 2);
#pragma unroll
    for (int i = 0; i < TILE_N / 8; i++) {
        const int col = col0 + 8 * i + 2 * (lane & 3);
        if (col >= p.N) continue; /* N is even: col + 1 < N as well */
#pragma unroll
        for (int h = 0; h < 2; h++) {
            const int64_t row = r_top + 8 * h;
            float v0 = d[4 * i + 2 * h], v1 = d[4 * i + 2 * h + 1];
            if (p.cb) {
                __nv_bfloat162 *dst = (__nv_bfloat162 *)(p.cb + row * p.ldc + col);
                if (p.accumulate) {
                    const float2 old = __bfloat1622float2(*dst);
                    v0 += old.x;
                    v1 += old.y;
                }
                *dst = __floats2bfloat162_rn(v0, v1);
            } else {
                float2 *dst = (float2 *)(p.c + row * p.ldc + col);
                if (p.accumulate) {
                    const float2 old = *dst;
                    v0 += old.x;
                    v1 += old.y;
                }
                *dst = make_float2(v0, v1);
            }
        }
    }
}

/* out[j][c][r] = in[j][r][c]: rows x cols of each expert (ld, group stride in) to cols x rows, packed */
__global__ void transpose_groups_kernel(bf16 *out, const bf16 *in, int64_t ld, int64_t group_stride, int rows,
                                        int cols) {
    __shared__ bf16 tile[32][33];
    const int j = blockIdx.z;
    const int r0 = blockIdx.y * 32, c0 = blockIdx.x * 32;
    const bf16 *src = in + (int64_t)j * group_stride;
    bf16 *dst = out + (int64_t)j * rows * cols;
    for (int y = threadIdx.y; y < 32; y += blockDim.y) {
        const int r = r0 + y, c = c0 + threadIdx.x;
        if (r < rows && c < cols) tile[y][threadIdx.x] = src[(int64_t)r * ld + c];
    }
    __syncthreads();
    for (int y = threadIdx.y; y < 32; y += blockDim.y) {
        const int c = c0 + y, r = r0 + threadIdx.x;
        if (r < rows && c < cols) dst[(int64_t)c * rows + r] = tile[threadIdx.x][y];
    }
}

PFN_cuTensorMapEncodeTiled_v12000 encode_fn;

lm_status get_encoder(void) {
    if (encode_fn) return LM_OK;
    void *fn = NULL;
    cudaDriverEntryPointQueryResult q;
    LM_CUDA_TRY(cudaGetDriverEntryPointByVersion("cuTensorMapEncodeTiled", &fn, 12000, cudaEnableDefault, &q));
    if (q != cudaDriverEntryPointSuccess || !fn)
        return lm_error(LM_ERR_IO, "moe wgmma: the driver has no cuTensorMapEncodeTiled");
    encode_fn = (PFN_cuTensorMapEncodeTiled_v12000)fn;
    return LM_OK;
}

/* a tensor map of bf16 with dims[0] contiguous, boxes of box[] elements, swizzled by 128 bytes */
lm_status make_map(CUtensorMap *map, const void *ptr, int rank, const uint64_t *dims, const uint64_t *strides_bytes,
                   const uint32_t *box) {
    cuuint64_t gd[3], gs[2];
    cuuint32_t bx[3], es[3] = {1, 1, 1};
    for (int i = 0; i < rank; i++) {
        gd[i] = dims[i];
        bx[i] = box[i];
    }
    for (int i = 0; i < rank - 1; i++) gs[i] = strides_bytes[i];
    CUresult r = encode_fn(map, CU_TENSOR_MAP_DATA_TYPE_BFLOAT16, (cuuint32_t)rank, (void *)ptr, gd, gs, bx, es,
                           CU_TENSOR_MAP_INTERLEAVE_NONE, CU_TENSOR_MAP_SWIZZLE_128B,
                           CU_TENSOR_MAP_L2_PROMOTION_L2_256B, CU_TENSOR_MAP_FLOAT_OOB_FILL_NONE);
    if (r != CUDA_SUCCESS) return lm_error(LM_ERR_IO, "moe wgmma: cuTensorMapEncodeTiled failed (%d)", (int)r);
    return LM_OK;
}

bool aligned16(const void *p) { return ((uintptr_t)p & 15u) == 0; }

/* one kernel instance: its shared-memory limit raised once (a flag per
 * instance: the instances share one function type), then launched */
template <int TILE_N, int STAGES, int MIN_BLOCKS>
lm_status launch(dim3 grid, cudaStream_t st, const CUtensorMap &map_a, const CUtensorMap &map_b,
                 const tile_args &p) {
    static bool raised;
    const size_t smem = shape<TILE_N, STAGES>::smem_bytes;
    if (!raised) {
        LM_CUDA_TRY(cudaFuncSetAttribute(grouped_nt_kernel<TILE_N, STAGES, MIN_BLOCKS>,
                                         cudaFuncAttributeMaxDynamicSharedMemorySize, (int)smem));
        raised = true;
    }
    grouped_nt_kernel<TILE_N, STAGES, MIN_BLOCKS><<<grid, THREADS, smem, st>>>(map_a, map_b, p);
    LM_CUDA_TRY(cudaGetLastError());
    return LM_OK;
}

/* the output tile's columns: 0 for 256 (the default), 1 for 128 (LONGMOE_MOE_WGMMA_TILE) */
switch_setting tile_128 = {-1, "LONGMOE_MOE_WGMMA_TILE", "moe wgmma tile", {"128x256", "128x128"}, 0};

} // namespace

extern "C" lm_status lm_cuda_moe_set_wgmma_tile(int tile_n) {
    if (tile_n != 128 && tile_n != 256)
        return lm_error(LM_ERR_ARG, "moe wgmma: tile of %d columns (expected 128 or 256)", tile_n);
    return switch_set(&tile_128, tile_n == 128);
}

int lm_moe_wgmma_tile_n(void) { return switch_get(&tile_128) ? 128 : 256; }

bool lm_moe_wgmma_takes(const lm_gemm_bf16_args *g) {
    if (g->layout == LM_GEMM_TN || !g->group_offsets) return false;
    const void *c = g->c ? (const void *)g->c : (const void *)g->cb;
    const bool c_pairs = g->c ? ((uintptr_t)c & 7u) == 0 : ((uintptr_t)c & 3u) == 0;
    /* TMA: 16-byte aligned bases and row strides; the epilogue stores pairs of columns */
    return g->M > 0 && g->N > 0 && g->K > 0 && g->N % 8 == 0 && g->K % 8 == 0 && g->ldc % 2 == 0 && c_pairs &&
           aligned16(g->a) && aligned16(g->b) && (g->lda * 2) % 16 == 0 && (g->ldb * 2) % 16 == 0 &&
           (g->b_group_stride * 2) % 16 == 0 && g->groups >= 1 && g->N <= INT32_MAX && g->K <= INT32_MAX &&
           g->M / TILE_M <= 65535;
}

lm_status lm_moe_wgmma_grouped(cudaStream_t st, const lm_gemm_bf16_args *g, bf16 *wt_tmp) {
    if (!lm_moe_wgmma_takes(g)) return lm_error(LM_ERR_ARG, "moe wgmma: a product this kernel does not take");
    if ((g->c == NULL) == (g->cb == NULL)) return lm_error(LM_ERR_ARG, "moe wgmma: exactly one of c, cb");
    TRY(get_encoder());
    const bf16 *w = g->b;
    int64_t w_ld = g->ldb, w_group = g->b_group_stride;
    if (g->layout == LM_GEMM_NN) {
        /* W_j[K, N] -> W_j^T[N, K], packed */
        if (!wt_tmp) return lm_error(LM_ERR_ARG, "moe wgmma: NN needs the transpose scratch");
        dim3 grid((unsigned)((g->N + 31) / 32), (unsigned)((g->K + 31) / 32), (unsigned)g->groups);
        transpose_groups_kernel<<<grid, dim3(32, 8), 0, st>>>(wt_tmp, g->b, g->ldb, g->b_group_stride, (int)g->K,
                                                             (int)g->N);
        LM_CUDA_TRY(cudaGetLastError());
        w = wt_tmp;
        w_ld = g->K;
        w_group = g->N * g->K;
        if ((w_group * 2) % 16 != 0 || (w_ld * 2) % 16 != 0)
            return lm_error(LM_ERR_ARG, "moe wgmma: transposed weights not 16-byte aligned");
    }
    const int tile_n = lm_moe_wgmma_tile_n();
    CUtensorMap map_a, map_b;
    {
        const uint64_t dims[2] = {(uint64_t)g->K, (uint64_t)g->M};
        const uint64_t strides[1] = {(uint64_t)g->lda * 2};
        const uint32_t box[2] = {TILE_K, TILE_M};
        TRY(make_map(&map_a, g->a, 2, dims, strides, box));
    }
    {
        const uint64_t dims[3] = {(uint64_t)g->K, (uint64_t)g->N, (uint64_t)g->groups};
        const uint64_t strides[2] = {(uint64_t)w_ld * 2, (uint64_t)w_group * 2};
        const uint32_t box[3] = {TILE_K, (uint32_t)tile_n, 1};
        TRY(make_map(&map_b, w, 3, dims, strides, box));
    }
    tile_args p;
    p.c = g->c;
    p.cb = g->cb;
    p.ldc = g->ldc;
    p.accumulate = g->accumulate;
    p.N = (int)g->N;
    p.K = (int)g->K;
    p.padded = g->group_offsets;
    p.groups = g->groups;
    dim3 grid((unsigned)((g->N + tile_n - 1) / tile_n), (unsigned)((g->M + TILE_M - 1) / TILE_M));
    if (tile_n == 256) TRY((launch<256, 4, 1>(grid, st, map_a, map_b, p)));
    else TRY((launch<128, 3, 2>(grid, st, map_a, map_b, p)));
    return LM_OK;
}

/* Asynchronous copies global -> shared memory (sm_80 and later), completed by
 * groups: a thread issues copies, closes them into a group with
 * lm_cp_async_commit, and lm_cp_async_wait<N> waits until at most its N most
 * recent groups are still in flight. The copied values are visible to the
 * issuing thread after the wait, to the rest of the block after a barrier. */
#ifndef LONGMOE_CUDA_CP_ASYNC_CUH
#define LONGMOE_CUDA_CP_ASYNC_CUH

/* 16 bytes (both addresses 16-byte aligned), bypassing L1 */
__device__ __forceinline__ void lm_cp_async16(void *smem, const void *gmem) {
    const unsigned s = static_cast<unsigned>(__cvta_generic_to_shared(smem));
    asm volatile("cp.async.cg.shared.global [%0], [%1], 16;\n" ::"r"(s), "l"(gmem) : "memory");
}
/* 4 bytes (cp.async.ca: the only form below 16 bytes) */
__device__ __forceinline__ void lm_cp_async4(void *smem, const void *gmem) {
    const unsigned s = static_cast<unsigned>(__cvta_generic_to_shared(smem));
    asm volatile("cp.async.ca.shared.global [%0], [%1], 4;\n" ::"r"(s), "l"(gmem) : "memory");
}
__device__ __forceinline__ void lm_cp_async_commit() { asm volatile("cp.async.commit_group;\n" ::: "memory"); }
template <int N> __device__ __forceinline__ void lm_cp_async_wait() {
    asm volatile("cp.async.wait_group %0;\n" ::"n"(N) : "memory");
}

#endif

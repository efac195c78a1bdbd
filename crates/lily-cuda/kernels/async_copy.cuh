// 16-byte copies from global into shared memory that run while the issuing thread goes on
// (cp.async through L2), grouped and waited for per thread; a barrier must follow before other
// threads read what they wrote. Shared by mma.cuh's users and moe_decode.cu (which cannot include
// mma.cuh beside gemv_tc.cuh).
#pragma once
#include <stdint.h>

// The shared-window (32-bit) address of a pointer into shared memory.
__device__ __forceinline__ uint32_t smem_addr(const void* p) { return (uint32_t)__cvta_generic_to_shared(p); }

// 16 bytes global -> shared (`dst` a shared-window address); only the first `src_bytes` (0..16) are
// read, the rest is zero-filled.
__device__ __forceinline__ void cp_async16z(uint32_t dst, const void* src, int src_bytes) {
    asm volatile("cp.async.cg.shared.global [%0], [%1], 16, %2;" ::"r"(dst), "l"(src), "r"(src_bytes) : "memory");
}
__device__ __forceinline__ void cp_async_commit_group() { asm volatile("cp.async.commit_group;" ::: "memory"); }
template <int N>
__device__ __forceinline__ void cp_async_wait_group() {
    asm volatile("cp.async.wait_group %0;" ::"n"(N) : "memory");
}

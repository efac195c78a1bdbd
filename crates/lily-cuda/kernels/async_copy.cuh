// Copies from global into shared memory that run while the issuing threads go on: 16 bytes a thread
// (cp.async through L2), grouped and waited for per thread; a barrier must follow before other
// threads read what they wrote.
#pragma once
#include <stdint.h>

__device__ __forceinline__ void cp_async16(void* dst, const void* src) {
    asm volatile("cp.async.cg.shared.global [%0], [%1], 16;" ::"r"((uint32_t)__cvta_generic_to_shared(dst)), "l"(src) : "memory");
}
// This thread's copies so far, as one group; then wait for all of its groups.
__device__ __forceinline__ void cp_async_commit() { asm volatile("cp.async.commit_group;" ::: "memory"); }
__device__ __forceinline__ void cp_async_wait_all() { asm volatile("cp.async.wait_group 0;" ::: "memory"); }

// Shared memory: its 32-bit addresses, copies from global into it that run while the issuing thread
// goes on (cp.async), grouped and waited for per thread (a barrier must follow before other threads
// read what they wrote), and vector loads from it; and the thread-block cluster barrier. The one
// definition for every kernel file (mma.cuh includes it; moe_decode.cu, affine_gemv.cu, gemm.cu,
// gemm_wgmma.cu and gdn.cu directly).
#pragma once
#include <stdint.h>

// The shared-window (32-bit) address of a pointer into shared memory.
__device__ __forceinline__ uint32_t smem_addr(const void* p) { return (uint32_t)__cvta_generic_to_shared(p); }

// 16 bytes global -> shared (`dst` a shared-window address); only the first `src_bytes` (0..16) are
// read, the rest is zero-filled.
__device__ __forceinline__ void cp_async16z(uint32_t dst, const void* src, int src_bytes) {
    asm volatile("cp.async.cg.shared.global [%0], [%1], 16, %2;" ::"r"(dst), "l"(src), "r"(src_bytes) : "memory");
}
// 16 bytes global -> shared, all of them (no zero-fill operand).
__device__ __forceinline__ void cp_async16_all(uint32_t dst, const void* src) {
    asm volatile("cp.async.cg.shared.global [%0], [%1], 16;" ::"r"(dst), "l"(src) : "memory");
}
// 16 bytes global -> shared through L2, or 16 zeros (nothing read) when !ok.
__device__ __forceinline__ void cp_async16(uint32_t dst, const void* src, bool ok) { cp_async16z(dst, src, ok ? 16 : 0); }
// 4 bytes global -> shared (through L1), or 4 zeros (nothing read) when !ok.
__device__ __forceinline__ void cp_async4(uint32_t dst, const void* src, bool ok) {
    asm volatile("cp.async.ca.shared.global [%0], [%1], 4, %2;" ::"r"(dst), "l"(src), "r"(ok ? 4 : 0) : "memory");
}
__device__ __forceinline__ void cp_async_commit_group() { asm volatile("cp.async.commit_group;" ::: "memory"); }
// Waits until at most N of this thread's committed groups are still in flight.
template <int N>
__device__ __forceinline__ void cp_async_wait_group() {
    asm volatile("cp.async.wait_group %0;" ::"n"(N) : "memory");
}

// Vector loads from shared memory (a shared-window address).
__device__ __forceinline__ uint2 lds64(uint32_t a) {
    uint2 v;
    asm volatile("ld.shared.v2.u32 {%0, %1}, [%2];" : "=r"(v.x), "=r"(v.y) : "r"(a));
    return v;
}
__device__ __forceinline__ uint4 lds128(uint32_t a) {
    uint4 v;
    asm volatile("ld.shared.v4.u32 {%0, %1, %2, %3}, [%4];" : "=r"(v.x), "=r"(v.y), "=r"(v.z), "=r"(v.w) : "r"(a));
    return v;
}

// Thread-block clusters: every thread of every block of the cluster arrives (release: its earlier
// memory operations, shared and global, are visible to the cluster after the wait) and waits.
__device__ __forceinline__ void cluster_arrive() { asm volatile("barrier.cluster.arrive.release.aligned;" ::: "memory"); }
// Arrive without ordering memory (no fence): for a barrier that only keeps shared memory alive until
// the cluster's other blocks have read it (their reads complete before they arrive).
__device__ __forceinline__ void cluster_arrive_relaxed() { asm volatile("barrier.cluster.arrive.relaxed.aligned;" ::: "memory"); }
__device__ __forceinline__ void cluster_wait() { asm volatile("barrier.cluster.wait.acquire.aligned;" ::: "memory"); }

// The address in cluster block `rank`'s shared memory of the local shared-memory address `a`
// (distributed shared memory), and a float stored there.
__device__ __forceinline__ uint32_t cluster_addr(uint32_t a, int rank) {
    uint32_t remote;
    asm volatile("mapa.shared::cluster.u32 %0, %1, %2;" : "=r"(remote) : "r"(a), "r"(rank));
    return remote;
}
__device__ __forceinline__ void cluster_store(uint32_t remote, float v) { asm volatile("st.shared::cluster.f32 [%0], %1;" ::"r"(remote), "f"(v) : "memory"); }

// The sum, in rank order, of the float at shared-memory place `v` of cluster blocks rank0 .. rank0 +
// n - 1 (distributed shared memory, read after a cluster barrier that made them visible).
__device__ __forceinline__ float cluster_sum(const float* v, int rank0, int n) {
    const uint32_t local = smem_addr(v);
    float sum = 0.0f;
    for (int t = 0; t < n; ++t) {
        float x;
        asm volatile("ld.shared::cluster.f32 %0, [%1];" : "=f"(x) : "r"(cluster_addr(local, rank0 + t)) : "memory");
        sum += x;
    }
    return sum;
}

// Shared memory: its 32-bit addresses, copies from global into it that run while the issuing thread
// goes on (cp.async), grouped and waited for per thread (a barrier must follow before other threads
// read what they wrote), and vector loads from it; and for thread-block clusters: the cluster barrier,
// mbarriers, and bulk copies (the TMA's cp.async.bulk) multicast into the shared memory of several
// blocks of a cluster, counted on each destination's mbarrier. The one definition for every kernel file
// (mma.cuh includes it; moe_decode.cu, affine_gemv.cu, gemm.cu, gemm_wgmma.cu and gdn.cu directly).
#pragma once
#include <stdint.h>

// The shared-window (32-bit) address of a pointer into shared memory.
__device__ __forceinline__ uint32_t smem_addr(const void* p) { return (uint32_t)__cvta_generic_to_shared(p); }

// 16 bytes global -> shared (`dst` a shared-window address); only the first `src_bytes` (0..16) are
// read, the rest is zero-filled.
__device__ __forceinline__ void cp_async16z(uint32_t dst, const void* src, int src_bytes) {
    asm volatile("cp.async.cg.shared.global [%0], [%1], 16, %2;" ::"r"(dst), "l"(src), "r"(src_bytes) : "memory");
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

// Thread-block clusters. Every thread of every block of the cluster arrives (release: its earlier
// memory operations, shared and global, are visible to the cluster after the wait) and waits.
__device__ __forceinline__ void cluster_arrive() { asm volatile("barrier.cluster.arrive.release.aligned;" ::: "memory"); }
__device__ __forceinline__ void cluster_wait() { asm volatile("barrier.cluster.wait.acquire.aligned;" ::: "memory"); }
__device__ __forceinline__ void cluster_sync() { cluster_arrive(); cluster_wait(); }
__device__ __forceinline__ uint32_t cluster_rank() {
    uint32_t r;
    asm volatile("mov.u32 %0, %%cluster_ctarank;" : "=r"(r));
    return r;
}
__device__ __forceinline__ uint32_t cluster_size() {
    uint32_t r;
    asm volatile("mov.u32 %0, %%cluster_nctarank;" : "=r"(r));
    return r;
}

// mbarriers (8 bytes of shared memory, a shared-window address). Init with the arrivals a phase needs;
// then fence_mbarrier_init and a cluster barrier before another block's copies may signal it.
__device__ __forceinline__ void mbar_init(uint32_t bar, uint32_t arrivals) {
    asm volatile("mbarrier.init.shared::cta.b64 [%0], %1;" ::"r"(bar), "r"(arrivals) : "memory");
}
__device__ __forceinline__ void fence_mbarrier_init() { asm volatile("fence.mbarrier_init.release.cluster;" ::: "memory"); }
// One arrival that also adds `bytes` to the phase's expected transaction count (the copies that
// complete it may land before or after: the count may go below zero meanwhile).
__device__ __forceinline__ void mbar_arrive_expect_tx(uint32_t bar, uint32_t bytes) {
    asm volatile("mbarrier.arrive.expect_tx.shared::cta.b64 _, [%0], %1;" ::"r"(bar), "r"(bytes) : "memory");
}
// Waits until the phase of the given parity (0 for the first phase, then alternating) has completed.
__device__ __forceinline__ void mbar_wait(uint32_t bar, uint32_t parity) {
    asm volatile(
        "{\n"
        ".reg .pred done;\n"
        "WAIT_%=:\n"
        "mbarrier.try_wait.parity.shared::cta.b64 done, [%0], %1;\n"
        "@!done bra WAIT_%=;\n"
        "}\n" ::"r"(bar), "r"(parity) : "memory");
}
// `bytes` (a multiple of 16; both addresses 16-byte aligned) from global into the shared memory of every
// block of the cluster in `mask`, at the same offset `dst` in each, each destination's mbarrier at `bar`
// counting the bytes that land there.
__device__ __forceinline__ void bulk_copy_multicast(uint32_t dst, const void* src, uint32_t bytes, uint32_t bar, uint16_t mask) {
    asm volatile(
        "cp.async.bulk.shared::cluster.global.mbarrier::complete_tx::bytes.multicast::cluster [%0], [%1], %2, [%3], %4;"
        ::"r"(dst), "l"(src), "r"(bytes), "r"(bar), "h"(mask) : "memory");
}
// Asks L2 to fetch `bytes` (a multiple of 16, 16-byte aligned) from global memory, nothing returned
// (the TMA's bulk prefetch): a later copy of them finds them in L2.
__device__ __forceinline__ void bulk_prefetch_l2(const void* src, uint32_t bytes) {
    asm volatile("cp.async.bulk.prefetch.L2.global [%0], %1;" ::"l"(src), "r"(bytes) : "memory");
}

// Shared-memory barriers (mbarrier, sm_80+; the parity waits, the transaction counts, the cluster
// arrivals and the TMA copies that complete on them sm_90) for pipelines whose producer and
// consumer threads are different warps: a barrier completes a phase when its expected count of arrivals
// has come in, and a thread waits for the phase of a given parity to complete. Used by gemm_wgmma.cu's
// warp-specialised tiles (a ring of stages, each with a "full" barrier the producer's copies complete and
// an "empty" one the consumers arrive on once their MMAs have read it).
//
// Parity: a fresh barrier is in phase 0; waiting on parity 1 returns at once (it names the phase before,
// taken as complete), waiting on parity 0 blocks until phase 0 completes. A ring's producer therefore
// waits on its empty barriers with the parity of its pass over the ring flipped, its consumers on the
// full ones with the parity itself.
#pragma once
#include <stdint.h>

// Initialises the barrier at shared address `bar` (8-byte aligned) to expect `count` arrivals a phase.
// One thread initialises; a block barrier must follow before any thread uses it.
__device__ __forceinline__ void mbar_init(uint32_t bar, uint32_t count) {
    asm volatile("mbarrier.init.shared::cta.b64 [%0], %1;" ::"r"(bar), "r"(count) : "memory");
}

// One arrival (release: this thread's earlier memory operations are visible to a thread whose wait sees
// the phase complete).
__device__ __forceinline__ void mbar_arrive(uint32_t bar) {
    asm volatile("mbarrier.arrive.release.cta.shared::cta.b64 _, [%0];" ::"r"(bar) : "memory");
}

// An arrival made when every cp.async this thread has issued so far has landed (the count is not raised
// for it: the barrier's expected count includes these arrivals).
__device__ __forceinline__ void mbar_arrive_on_copies(uint32_t bar) {
    asm volatile("cp.async.mbarrier.arrive.noinc.shared::cta.b64 [%0];" ::"r"(bar) : "memory");
}

// One arrival that also expects `bytes` more of asynchronous (bulk / tensor) copies to complete on the
// barrier this phase.
__device__ __forceinline__ void mbar_arrive_expect_tx(uint32_t bar, uint32_t bytes) {
    asm volatile("mbarrier.arrive.expect_tx.release.cta.shared::cta.b64 _, [%0], %1;" ::"r"(bar), "r"(bytes) : "memory");
}

// One arrival on the barrier at the same shared-memory place `bar` of cluster block `rank`, with the
// default semantics (release at CTA scope). Not `.release.cluster`: that compiles to MEMBAR.ALL.GPU
// (with ERRBAR and CGAERRBAR), which waits for every memory operation the warp has in flight — the
// scale loads prefetched for the next group, the last tile's output stores — at every arrival. The
// reads the arrival announces (a stage's codes by ordinary loads whose values are already used, its X
// by MMAs already waited for) are complete when it is made.
__device__ __forceinline__ void mbar_arrive_cluster(uint32_t bar, uint32_t rank) {
    uint32_t remote;
    asm volatile("mapa.shared::cluster.u32 %0, %1, %2;" : "=r"(remote) : "r"(bar), "r"(rank));
    asm volatile("mbarrier.arrive.shared::cluster.b64 _, [%0];" ::"r"(remote) : "memory");
}

// Makes barrier initialisations visible to the cluster's other blocks (a cluster barrier follows).
__device__ __forceinline__ void mbar_init_fence_cluster() { asm volatile("fence.mbarrier_init.release.cluster;" ::: "memory"); }

// A tensor-memory-access (TMA) descriptor (CUtensorMap's layout: 128 bytes, 64-byte aligned), encoded on
// the host and passed in a __grid_constant__ kernel parameter.
struct alignas(64) TmaDesc {
    unsigned long long opaque[16];
};

// A 2-D tile of the tensor `desc` at (inner coordinate c0, outer c1) into shared memory at `dst` of
// every cluster block in `mask`, each block's barrier at `bar` (the same shared-memory places in each)
// counting its bytes as they land (TMA multicast; rows or columns past the tensor are zeros).
__device__ __forceinline__ void tma_load_2d_multicast(uint32_t dst, const TmaDesc* desc, int c0, int c1, uint32_t bar, uint16_t mask) {
    asm volatile(
        "cp.async.bulk.tensor.2d.shared::cluster.global.mbarrier::complete_tx::bytes.multicast::cluster [%0], [%1, {%2, %3}], [%4], %5;" ::"r"(dst),
        "l"(desc), "r"(c0), "r"(c1), "r"(bar), "h"(mask)
        : "memory");
}

// Whether the phase of parity `parity` has completed (acquire), after a bounded wait in hardware.
__device__ __forceinline__ bool mbar_try_wait(uint32_t bar, uint32_t parity) {
    uint32_t done;
    asm volatile(
        "{\n.reg .pred p;\n"
        "mbarrier.try_wait.parity.acquire.cta.shared::cta.b64 p, [%1], %2;\n"
        "selp.u32 %0, 1, 0, p;\n}\n"
        : "=r"(done)
        : "r"(bar), "r"(parity)
        : "memory");
    return done != 0;
}

// Waits until the phase of parity `parity` has completed.
__device__ __forceinline__ void mbar_wait(uint32_t bar, uint32_t parity) {
    while (!mbar_try_wait(bar, parity)) {
    }
}

// Warpgroup register reallocation (sm_90a): a warpgroup that needs few registers gives them back, one
// that needs many takes them (counts multiples of 8 in 24..256; every warp of the warpgroup executes it).
template <int N>
__device__ __forceinline__ void regs_release() {
    asm volatile("setmaxnreg.dec.sync.aligned.u32 %0;\n" ::"n"(N));
}
template <int N>
__device__ __forceinline__ void regs_claim() {
    asm volatile("setmaxnreg.inc.sync.aligned.u32 %0;\n" ::"n"(N));
}

// A barrier of `threads` threads (a multiple of 32) on the named barrier `id` (1..15; 0 is
// __syncthreads'): each of them arrives and waits for the others.
__device__ __forceinline__ void named_barrier_sync(int id, int threads) {
    asm volatile("bar.sync %0, %1;" ::"r"(id), "r"(threads) : "memory");
}

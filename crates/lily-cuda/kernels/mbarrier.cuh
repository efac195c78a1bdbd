// Shared-memory barriers (mbarrier, sm_80+; the parity waits sm_90) for pipelines whose producer and
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

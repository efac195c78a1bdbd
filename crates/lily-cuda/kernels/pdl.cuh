// Programmatic dependent launch (sm_90), shared by every kernel the model launches: a kernel
// launched with the programmatic-serialization attribute (ops::launch does so when the device has
// it on) may start while its predecessor on the stream still runs, so each one must
//   1. call pdl_wait() before it reads anything a predecessor wrote, or writes anything a
//      predecessor may still read (weights, never written, may be read before), in every block,
//      before any early return (a grid whose blocks all skipped it could complete before its own
//      predecessor, and its successor's wait would no longer cover that one);
//   2. call pdl_launch_dependents() once it no longer needs its SMs to itself: here right after the
//      wait, so the next kernel's blocks are placed, and run up to their own wait, while this one works.
// Reading a predecessor's output: use plain or ld.global.cg loads, not __ldg (ld.global.nc promises
// data read-only for the kernel's whole life, which a kernel started early is not; the GEMVs read
// stale expert indices that way, docs/PERF.md 2026-12-02). Weights, never written, may use it.
// Without the attribute both are no-ops.
#pragma once

__device__ __forceinline__ void pdl_wait() { asm volatile("griddepcontrol.wait;" ::: "memory"); }
__device__ __forceinline__ void pdl_launch_dependents() { asm volatile("griddepcontrol.launch_dependents;" ::: "memory"); }
// Both, at the top of a kernel that reads its inputs at once.
__device__ __forceinline__ void pdl_enter() {
    pdl_wait();
    pdl_launch_dependents();
}

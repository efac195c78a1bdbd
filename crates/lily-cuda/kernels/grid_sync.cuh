// Dependencies between the blocks of one persistent kernel (all of its blocks resident at once),
// through counters in global memory that only grow: each launch adds one per block per counter, so a
// counter needs no reset between launches (it must start at zero and be used by one launch shape).
// Shared by moe_decode.cu (one grid barrier) and gemv_chain.cu (a counter per op of a chain).
//   grid_arrive(ctr): the block's writes so far are published (every thread's, through the barrier
//     and thread 0's fence) and it counts itself in; returns the count its generation ends at.
//   grid_wait(ctr, target): the block waits until the counter reaches target, then reads what the
//     counted blocks wrote (thread 0's acquire, then the block barrier).
#pragma once

// Thread 0's return value only (the others get 0). Ends with the block synchronised.
__device__ __forceinline__ unsigned long long grid_arrive(unsigned long long* ctr) {
    __syncthreads();
    unsigned long long target = 0;
    if (threadIdx.x == 0) {
        __threadfence();
        const unsigned long long n = gridDim.x;
        target = (atomicAdd(ctr, 1ull) / n + 1) * n;
    }
    return target;
}

// `target` as thread 0 got it from grid_arrive (the other threads' value is unused).
__device__ __forceinline__ void grid_wait(const unsigned long long* ctr, unsigned long long target) {
    if (threadIdx.x == 0) {
        unsigned long long v;
        long long spins = 0;
        do {
            asm volatile("ld.acquire.gpu.global.u64 %0, [%1];" : "=l"(v) : "l"(ctr) : "memory");
            // A block that never arrives (the grid not resident, a fault elsewhere) ends the launch
            // with an error after some seconds instead of hanging the GPU.
            if (++spins > (1ll << 27)) __trap();
        } while (v < target);
        __threadfence();
    }
    __syncthreads();
}

// Every block arrives, then waits for all of them.
__device__ __forceinline__ void grid_barrier(unsigned long long* ctr) { grid_wait(ctr, grid_arrive(ctr)); }

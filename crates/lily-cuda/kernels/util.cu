// Small helpers for tests and benchmarks.
//   spin_ns: one thread busy-waits `ns` nanoseconds of the GPU's global timer. A benchmark enqueues it
//   first so the host can queue many timed launches while the GPU is busy; the launches then run back to
//   back and the CUDA events around them measure the GPU, not the host's launch rate.
//   fill_f32: y[i] = v for i < n (poisoning outputs with NaN from inside a stream or a graph).

#include <stdint.h>

__device__ __forceinline__ unsigned long long global_ns() {
    unsigned long long t;
    asm volatile("mov.u64 %0, %%globaltimer;" : "=l"(t));
    return t;
}

extern "C" __global__ void spin_ns(unsigned long long ns) {
    if (threadIdx.x == 0 && blockIdx.x == 0) {
        const unsigned long long t0 = global_ns();
        while (global_ns() - t0 < ns) {
        }
    }
}

extern "C" __global__ void fill_f32(float* y, unsigned long long n, float v) {
    for (unsigned long long i = blockIdx.x * (unsigned long long)blockDim.x + threadIdx.x; i < n;
         i += (unsigned long long)gridDim.x * blockDim.x)
        y[i] = v;
}

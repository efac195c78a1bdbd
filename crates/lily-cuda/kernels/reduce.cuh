// Block-wide reductions shared by the kernel files (a warp's shuffle butterfly, then the warps'
// partials through shared memory); every thread gets the result.
#pragma once

// The sum of v over the block (up to 32 warps). Uses 32 floats of its own shared memory: a second
// call needs a barrier between (block_sum_reusable ends with one).
__device__ __forceinline__ float block_sum(float v) {
    __shared__ float part[32];
#pragma unroll
    for (int o = 16; o > 0; o >>= 1) v += __shfl_xor_sync(0xffffffffu, v, o);
    const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5, nw = (blockDim.x + 31) >> 5;
    if (lane == 0) part[warp] = v;
    __syncthreads();
    v = lane < nw ? part[lane] : 0.0f;
#pragma unroll
    for (int o = 16; o > 0; o >>= 1) v += __shfl_xor_sync(0xffffffffu, v, o);
    return v;
}
__device__ __forceinline__ float block_sum_reusable(float v) {
    v = block_sum(v);
    __syncthreads();
    return v;
}

// The largest v over a block of NW warps. `red`: NW floats of shared memory, read by every thread
// after the call's barrier (the caller's next barrier frees it).
template <int NW>
__device__ __forceinline__ float block_max(float v, float* red) {
#pragma unroll
    for (int o = 16; o > 0; o >>= 1) v = fmaxf(v, __shfl_xor_sync(0xffffffffu, v, o));
    const int tid = threadIdx.x;
    if ((tid & 31) == 0) red[tid >> 5] = v;
    __syncthreads();
    v = red[0];
#pragma unroll
    for (int w = 1; w < NW; ++w) v = fmaxf(v, red[w]);
    return v;
}

// block_max over however many warps the block has (up to 32; `red`: 32 floats of shared memory).
__device__ __forceinline__ float block_max_any(float v, float* red) {
#pragma unroll
    for (int o = 16; o > 0; o >>= 1) v = fmaxf(v, __shfl_xor_sync(0xffffffffu, v, o));
    const int tid = threadIdx.x, nw = (blockDim.x + 31) >> 5;
    if ((tid & 31) == 0) red[tid >> 5] = v;
    __syncthreads();
    v = red[0];
    for (int w = 1; w < nw; ++w) v = fmaxf(v, red[w]);
    return v;
}

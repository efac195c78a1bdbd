// What the decode GEMV kernels share (affine_gemv.cu: the FFMA kernels; affine_gemv_tc.cu: the
// tensor-core ones): the one parameter struct every entry point takes (its Rust mirror is
// `GemvParams` in ops/affine_gemv.rs), weight and activation loads, and how an output row is written.
#pragma once
#include <stdint.h>
#include "bf16.cuh"

struct GemvParams {
    const uint4* w;           // [count, rows, chunks]
    const uint16_t* scales;   // [count, rows, groups] (bf16 bits); unused for dense
    const uint16_t* biases;
    const uint4* w2;          // SwiGLU: the up projection, same shape as w
    const uint16_t* scales2;
    const uint16_t* biases2;
    const uint32_t* idx;      // [slots] matrix per slot, or null: `matrix` for every slot
    const float* x;           // [1 or slots, cols]
    float* y;                 // [slots, rows]
    long long x_stride;       // floats between consecutive slots' inputs; 0 = shared x
    int rows;
    int cols;
    int count;
    int group_shift;          // log2(group size); unused for dense
    int matrix;
    int pad_;
    // Fusions (all off when zero/null; see "Fusions" at the top):
    const float* norm_w;      // [cols] or null: the product uses RMSNorm(x) * norm_w (a shared x only)
    float norm_eps;
    int accumulate;           // y[r] += result instead of y[r] = result (the residual stream)
    uint32_t* counter;        // router entries: finished blocks (0 between launches; the last resets it)
    uint32_t* route_idx;      // router entries: [route_k] chosen experts, best first
    float* route_w;           // router entries: [route_k] their weights
    int route_e;              // router entries: the first route_e rows of y are the experts' logits
    int route_k;
    int route_renorm;
    int pad2_;
    const float* mix_w;       // mix entries: [mix_k] the weights of slots 0..mix_k-1
    const float* gate_logit;  // mix entries: slot mix_k (if mix_shared) is weighted by sigmoid(*gate_logit)
    int mix_k;
    int mix_shared;
    const float* sel_logits;  // select entries: [route_e] the router's logits; each block selects (see affine_gemv_tc.cu)
};


__device__ __forceinline__ uint4 ld_stream(const uint4* p) {
    uint4 v;
    asm("ld.global.nc.L1::no_allocate.v4.u32 {%0, %1, %2, %3}, [%4];"
        : "=r"(v.x), "=r"(v.y), "=r"(v.z), "=r"(v.w)
        : "l"(p));
    return v;
}

__device__ __forceinline__ float silu_f(float g) { return g / (1.0f + expf(-g)); }

// Writes one output row: the fused scale, the SwiGLU, the residual add; NaN for a bad matrix index.
template <bool SWIGLU>
__device__ __forceinline__ void put_row(const GemvParams& p, float* y, int r, float a0, float a1, float inv, bool bad) {
    float out = SWIGLU ? silu_f(a0 * inv) * (a1 * inv) : a0 * inv;
    // The residual is read from L2 (ld.global.cg), as every activation here (see stage_x).
    if (p.accumulate) out = __ldcg(y + r) + out;
    y[r] = bad ? __int_as_float(0x7fc00000) : out;
}

// The per-vector arithmetic of an RMSNorm over f32 rows, as one float or a float4 (rmsnorm.cu, and the
// MoE combine fused with the next norm in moe_dispatch.cu): the same expressions in both, so the two
// give the same bits for the same launch shape.
#pragma once

template <int V>
struct RmsVec;
template <>
struct RmsVec<1> {
    using T = float;
    static __device__ __forceinline__ float sq(T a) { return a * a; }
    static __device__ __forceinline__ T add(T a, T b) { return a + b; }
    static __device__ __forceinline__ T norm(T h, float inv, T w) { return h * inv * w; }
};
template <>
struct RmsVec<4> {
    using T = float4;
    static __device__ __forceinline__ float sq(T a) { return (a.x * a.x + a.y * a.y) + (a.z * a.z + a.w * a.w); }
    static __device__ __forceinline__ T add(T a, T b) { return make_float4(a.x + b.x, a.y + b.y, a.z + b.z, a.w + b.w); }
    static __device__ __forceinline__ T norm(T h, float inv, T w) {
        return make_float4(h.x * inv * w.x, h.y * inv * w.y, h.z * inv * w.z, h.w * inv * w.w);
    }
};

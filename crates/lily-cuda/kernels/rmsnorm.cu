// RMSNorm over rows of n f32, with the residual add optionally fused:
//   h = x (+ residual);  residual_out = h (if given);  y = h * (1 / sqrt(mean(h^2) + eps)) * w
// The weight is already folded (Qwen's zero-centred (1+w) is added at load). One block per row.
// residual_out may alias residual (the usual in-place residual stream) and y may alias x: each element is
// read and written by the same thread, and the second pass re-reads h from residual_out when it exists.
// Entry points: rmsnorm_f32 (scalar), rmsnorm_f32_v4 (float4; n % 4 == 0 and 16-byte aligned pointers).

#include <stdint.h>
#include "pdl.cuh"
#include "reduce.cuh"

struct RmsNormParams {
    const float* x;         // [rows, n]
    const float* residual;  // [rows, n] or null
    float* residual_out;    // [rows, n] or null
    const float* w;         // [n]
    float* y;               // [rows, n]
    int rows;
    int n;
    float eps;
    int pad_;
};

template <int V>
struct Vec;
template <>
struct Vec<1> {
    using T = float;
    static __device__ __forceinline__ float sq(T a) { return a * a; }
    static __device__ __forceinline__ T add(T a, T b) { return a + b; }
    static __device__ __forceinline__ T norm(T h, float inv, T w) { return h * inv * w; }
};
template <>
struct Vec<4> {
    using T = float4;
    static __device__ __forceinline__ float sq(T a) { return (a.x * a.x + a.y * a.y) + (a.z * a.z + a.w * a.w); }
    static __device__ __forceinline__ T add(T a, T b) { return make_float4(a.x + b.x, a.y + b.y, a.z + b.z, a.w + b.w); }
    static __device__ __forceinline__ T norm(T h, float inv, T w) {
        return make_float4(h.x * inv * w.x, h.y * inv * w.y, h.z * inv * w.z, h.w * inv * w.w);
    }
};

template <int V>
__device__ __forceinline__ void rmsnorm(const RmsNormParams& p) {
    using T = typename Vec<V>::T;
    const int row = blockIdx.x;
    const int nv = p.n / V;
    const long long off = (long long)row * nv;
    const T* x = reinterpret_cast<const T*>(p.x) + off;
    const T* res = p.residual ? reinterpret_cast<const T*>(p.residual) + off : nullptr;
    T* rout = p.residual_out ? reinterpret_cast<T*>(p.residual_out) + off : nullptr;
    const T* w = reinterpret_cast<const T*>(p.w);
    T* y = reinterpret_cast<T*>(p.y) + off;

    float ss = 0.0f;
    for (int j = threadIdx.x; j < nv; j += blockDim.x) {
        T h = x[j];
        if (res) h = Vec<V>::add(h, res[j]);
        if (rout) rout[j] = h;
        ss += Vec<V>::sq(h);
    }
    ss = block_sum(ss);
    const float inv = 1.0f / sqrtf(ss / (float)p.n + p.eps);
    for (int j = threadIdx.x; j < nv; j += blockDim.x) {
        T h;
        if (rout) {
            h = rout[j];
        } else {
            h = x[j];
            if (res) h = Vec<V>::add(h, res[j]);
        }
        y[j] = Vec<V>::norm(h, inv, w[j]);
    }
}

extern "C" __global__ void __launch_bounds__(1024) rmsnorm_f32(const RmsNormParams p) { pdl_enter(); rmsnorm<1>(p); }
extern "C" __global__ void __launch_bounds__(1024) rmsnorm_f32_v4(const RmsNormParams p) { pdl_enter(); rmsnorm<4>(p); }

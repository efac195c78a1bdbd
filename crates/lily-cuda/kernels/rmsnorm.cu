// RMSNorm over rows of n f32, with the residual add optionally fused:
//   h = x (+ residual);  residual_out = h (if given);  y = h * (1 / sqrt(mean(h^2) + eps)) * w
// The weight is already folded (Qwen's zero-centred (1+w) is added at load). One block per row.
// residual_out may alias residual (the usual in-place residual stream) and y may alias x: each element is
// read and written by the same thread, and the second pass re-reads h from residual_out when it exists.
// Entry points: rmsnorm_f32 (scalar), rmsnorm_f32_v4 (float4; n % 4 == 0 and 16-byte aligned pointers).

#include <stdint.h>
#include "pdl.cuh"
#include "reduce.cuh"
#include "rms_vec.cuh"

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
__device__ __forceinline__ void rmsnorm(const RmsNormParams& p) {
    using T = typename RmsVec<V>::T;
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
        if (res) h = RmsVec<V>::add(h, res[j]);
        if (rout) rout[j] = h;
        ss += RmsVec<V>::sq(h);
    }
    ss = block_sum(ss);
    const float inv = 1.0f / sqrtf(ss / (float)p.n + p.eps);
    for (int j = threadIdx.x; j < nv; j += blockDim.x) {
        T h;
        if (rout) {
            h = rout[j];
        } else {
            h = x[j];
            if (res) h = RmsVec<V>::add(h, res[j]);
        }
        y[j] = RmsVec<V>::norm(h, inv, w[j]);
    }
}

extern "C" __global__ void __launch_bounds__(1024) rmsnorm_f32(const RmsNormParams p) { pdl_enter(); rmsnorm<1>(p); }
extern "C" __global__ void __launch_bounds__(1024) rmsnorm_f32_v4(const RmsNormParams p) { pdl_enter(); rmsnorm<4>(p); }

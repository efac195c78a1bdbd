// RMSNorm over rows of n f32, with the residual add optionally fused:
//   h = x (+ residual);  residual_out = h (if given);  y = h * (1 / sqrt(mean(h^2) + eps)) * w
// The weight is already folded (Qwen's zero-centred (1+w) is added at load). One block per row.
// residual_out may alias residual (the usual in-place residual stream) and y may alias x: each element is
// read and written by the same thread, and the second pass re-reads h from residual_out when it exists.
// Entry points: rmsnorm_f32 (scalar), rmsnorm_f32_v4 (float4; n % 4 == 0 and 16-byte aligned pointers),
// rmsnorm_f32_v4_stage (rmsnorm_f32_v4 that also writes y as the next GEMM's staged x in the half
// numerics, stage_half.cuh: the row in shared memory, its largest |y| setting its scale, 16-byte chunks
// of the f16 plane into `plane`, 2^e into `scales`; n % 64 == 0, n floats of dynamic shared memory):
// the same bits as the norm followed by gemm_wgmma_stage_half*; rmsnorm_f32_v4_stage2: also the folded
// (exact) numerics' staging of y (two bf16 planes and the group sums, stage_exact_row_out), the same bits
// as gemm_wgmma_stage.

#include <stdint.h>
#include "pdl.cuh"
#include "reduce.cuh"
#include "rms_vec.cuh"
#include "stage_half.cuh"

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
    uint4* plane;           // _stage: [rows, n / 8] 16-byte chunks of the staged f16 plane
    float* scales;          // _stage: [rows] the rows' 2^e
    uint4* hi2;             // _stage2: [rows, n / 8] 16-byte chunks of the folded staging's hi plane
    uint4* lo2;             // _stage2: its lo plane
    float* sums2;           // _stage2: [rows, n / 64] its group sums
};

template <int V, bool STAGE = false, bool EXACT = false>
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
    extern __shared__ __align__(16) float srow[];  // STAGE: the row of y [n], stage_smem_index's layout
    float m = 0.0f;                                // STAGE: this thread's largest |y|
    for (int j = threadIdx.x; j < nv; j += blockDim.x) {
        T h;
        if (rout) {
            h = rout[j];
        } else {
            h = x[j];
            if (res) h = RmsVec<V>::add(h, res[j]);
        }
        const T v = RmsVec<V>::norm(h, inv, w[j]);
        y[j] = v;
        if constexpr (STAGE) {
            *reinterpret_cast<float4*>(srow + stage_smem_index(4 * j)) = v;
            m = fmaxf(m, fmaxf(fmaxf(fabsf(v.x), fabsf(v.y)), fmaxf(fabsf(v.z), fabsf(v.w))));
        }
    }
    if constexpr (STAGE) {
        static_assert(V == 4, "the staged form is the float4 one");
        __shared__ float red[32];
        m = block_max_any(m, red);  // its barrier also publishes srow
        stage_half_row_out(srow, m, p.n, p.plane + (long long)row * (p.n >> 3), p.scales + row, blockDim.x);
        if constexpr (EXACT)
            stage_exact_row_out(srow, p.n, p.hi2 + (long long)row * (p.n >> 3), p.lo2 + (long long)row * (p.n >> 3), p.sums2 + (long long)row * (p.n >> 6),
                                blockDim.x);
    }
}

extern "C" __global__ void __launch_bounds__(1024) rmsnorm_f32(const RmsNormParams p) { pdl_enter(); rmsnorm<1>(p); }
extern "C" __global__ void __launch_bounds__(1024) rmsnorm_f32_v4(const RmsNormParams p) { pdl_enter(); rmsnorm<4>(p); }
extern "C" __global__ void __launch_bounds__(1024) rmsnorm_f32_v4_stage(const RmsNormParams p) { pdl_enter(); rmsnorm<4, true>(p); }
extern "C" __global__ void __launch_bounds__(1024) rmsnorm_f32_v4_stage2(const RmsNormParams p) { pdl_enter(); rmsnorm<4, true, true>(p); }

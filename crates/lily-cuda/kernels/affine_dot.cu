// One weight row against many token rows: y[t · y_stride] = Σ_k x[t, k] · w(k), w row `row` of an
// affine matrix (4- or 8-bit codes, LSB first in u32 words, bf16 scale and bias per group: w = s·q + b in
// f32) or of a dense bf16 one. The prefill's shared-expert gate logit ([1, H] for every token of a
// chunk), which as row E of the router's GEMM cost a third row tile for one row.
// One warp per token: lane l takes k = 4l + 128i (four at a time: x 16-byte aligned, k a multiple of 4
// in a group), then a warp sum; f32 throughout.
// Entry point: affine_row_dot (grid ceil(t / 8), 256 threads).

#include <stdint.h>
#include "pdl.cuh"
#include "bf16.cuh"

struct AffineRowDotParams {
    const float* x;         // [t, cols]
    const uint32_t* packed; // affine: [rows, cols · bits / 32] (the whole matrix; row `row` is used)
    const uint16_t* scales; // affine: [rows, cols / group] bf16
    const uint16_t* biases;
    const uint16_t* dense;  // dense: [rows, cols] bf16 (packed null)
    float* y;               // y[t · y_stride]
    int t;
    int cols;
    int row;
    int bits;               // 4 or 8 (affine)
    int group_shift;        // log2(group)
    int y_stride;
};

extern "C" __global__ void __launch_bounds__(256) affine_row_dot(const AffineRowDotParams p) {
    pdl_enter();
    const int lane = threadIdx.x & 31;
    const int tok = blockIdx.x * 8 + (threadIdx.x >> 5);
    if (tok >= p.t) return;
    const float* xr = p.x + (long long)tok * p.cols;
    const long long wr = (long long)p.row * p.cols;  // the row's first element
    float acc = 0.0f;
    for (int k = 4 * lane; k < p.cols; k += 128) {
        const float4 xv = *reinterpret_cast<const float4*>(xr + k);
        float w[4];
        if (p.packed) {
            const long long g = (wr + k) >> p.group_shift;
            const float s = bf16_to_f32(p.scales[g]), b = bf16_to_f32(p.biases[g]);
            const long long bit = (wr + k) * p.bits;  // four codes in one word (bits · 4 ≤ 32, k % 4 == 0)
            const uint32_t word = p.packed[bit >> 5] >> (bit & 31);
            const uint32_t mask = (1u << p.bits) - 1u;
#pragma unroll
            for (int j = 0; j < 4; ++j) w[j] = s * (float)((word >> (j * p.bits)) & mask) + b;
        } else {
#pragma unroll
            for (int j = 0; j < 4; ++j) w[j] = bf16_to_f32(p.dense[wr + k + j]);
        }
        acc += xv.x * w[0] + xv.y * w[1] + xv.z * w[2] + xv.w * w[3];
    }
#pragma unroll
    for (int o = 16; o > 0; o >>= 1) acc += __shfl_xor_sync(0xffffffffu, acc, o);
    if (lane == 0) p.y[(long long)tok * p.y_stride] = acc;
}

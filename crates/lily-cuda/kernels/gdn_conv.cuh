// The prompt conv's per-warp pieces, shared by gdn.cu (gdn_conv_qk_warp_k*, a pass of its own) and
// gdn_chunked.cu (the bf16 prep that convolves the q, k and v rows it stages, gdn_chunk_prep_tc1_bf_conv):
// a lane's 4 channels of one conv head (the head's width ≤ 128, a multiple of 4) read 16 bytes at a
// time from xin = concat(conv_state, x), the causal depthwise conv of K ≤ KM taps, SiLU, and the q and
// k rows' L2 norm summed over the warp by shuffles. The same operations in the same order in both
// kernels, so the fused prep's inputs are the separate conv's outputs bit for bit.
#pragma once

__device__ __forceinline__ float silu_f(float x) { return x / (1.0f + expf(-x)); }

// 16 bytes of xin row r at channel ch: the conv state's row r ([K-1, C]) for r < hist, else x's row
// r - hist (rows x_stride floats apart). Read through L2 (the predecessor under PDL wrote x).
__device__ __forceinline__ float4 conv_input4(const float* conv_state, const float* x, long long x_stride, long long C, int r, int hist, long long ch) {
    return r < hist ? __ldcg(reinterpret_cast<const float4*>(conv_state + (long long)r * C + ch))
                    : __ldcg(reinterpret_cast<const float4*>(x + (long long)(r - hist) * x_stride + ch));
}

// The taps of channels ch .. ch + 3 (conv_w [C, K]: each channel's K taps contiguous); zeros past K
// or for a lane past the head's width.
template <int KM>
__device__ __forceinline__ void conv_taps4(float (&w)[4][KM], const float* conv_w, long long ch, int K, bool live) {
#pragma unroll
    for (int c = 0; c < 4; ++c)
#pragma unroll
        for (int j = 0; j < KM; ++j) w[c][j] = (live && j < K) ? conv_w[(ch + c) * K + j] : 0.0f;
}

// One token's 4 channels: Σ_j w[j]·xw[j] over the K input rows xw[0 .. K-1] ending at the token (tap
// K-1 multiplies the token's own row), SiLU (zeros for a lane past the width), then for a q or k head
// (`norm`, warp-uniform) y / √(Σ y² + 1e-6) · qscale with the sum over the warp's 32 lanes. Every lane
// of the warp must call it.
template <int KM>
__device__ __forceinline__ float4 conv_row4(const float (&w)[4][KM], const float4* xw, int K, bool live, bool norm, float qscale) {
    float4 acc = make_float4(0.0f, 0.0f, 0.0f, 0.0f);
#pragma unroll
    for (int j = 0; j < KM; ++j) {
        if (j < K) {
            acc.x += w[0][j] * xw[j].x;
            acc.y += w[1][j] * xw[j].y;
            acc.z += w[2][j] * xw[j].z;
            acc.w += w[3][j] * xw[j].w;
        }
    }
    float4 y = live ? make_float4(silu_f(acc.x), silu_f(acc.y), silu_f(acc.z), silu_f(acc.w)) : make_float4(0.0f, 0.0f, 0.0f, 0.0f);
    if (norm) {
        float ss = y.x * y.x + y.y * y.y + y.z * y.z + y.w * y.w;
#pragma unroll
        for (int o = 16; o > 0; o >>= 1) ss += __shfl_xor_sync(0xffffffffu, ss, o);
        const float s = (1.0f / sqrtf(ss + 1e-6f)) * qscale;
        y.x *= s;
        y.y *= s;
        y.z *= s;
        y.w *= s;
    }
    return y;
}

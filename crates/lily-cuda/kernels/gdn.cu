// Gated DeltaNet (Qwen3.5/3.6 `linear_attn`) for decode, f32 activations and f32 state, the same maths
// and layouts as lily_cpu::gdn (causal_conv1d_silu, gates, normalize_qk, delta_rule_recurrent,
// gated_rmsnorm). T tokens are processed sequentially inside each kernel (decode: T = 1).
// Layouts: qkv [T, C] with C = 2·Hk·Dk + Hv·Dv ordered q | k | v (head-major); state [Hv, Dk, Dv]
// (S[h][i_k][j_v], HF order); value head j reads key head j / (Hv/Hk) (repeat_interleave).
//
// Entry points:
//   gdn_conv_qk: causal depthwise conv (K taps) + SiLU, conv state [K-1, C] updated in place, then
//     q ← l2norm(q)/√Dk and k ← l2norm(k) per head; and the gates beta = sigmoid(b),
//     g = -exp(A_log)·softplus(a + dt_bias). Grid 2·Hk + Hv blocks: one per q head, k head, v head
//     (the v blocks also write the gates of their head). Each channel belongs to one thread for the
//     whole call, so the in-place conv state update needs no synchronisation. x must not alias out.
//   gdn_conv_qk_tiled + gdn_conv_finish: the same for a prompt chunk (T ≥ 16), parallel over tokens:
//     grid (ceil(T/16), 2·Hk + Hv), one block per (tile of 16 tokens, head), one thread per channel
//     (the K taps in registers, the tile's K-1+16 inputs in a sliding window, the q/k norms of the 16
//     tokens reduced together); it reads the old conv state and leaves it. gdn_conv_finish then writes
//     the new conv state (the last K-1 rows of x: T ≥ K-1) and the gates, grid-stride (with g null,
//     the state alone: after gdn_chunked.cu's prep that convolves its own inputs).
//   gdn_conv_qk_warp_k{4,8}: gdn_conv_qk_tiled's work with one warp per (head, 16 tokens), 4 channels
//     a lane, for heads of ≤ 128 channels in multiples of 4 (the prompt path's stream of x; then
//     gdn_conv_finish as above); its per-lane pieces are gdn_conv.cuh's. x, a and b may be column
//     ranges of one wider row (x_stride, ab_stride).
//   gdn_recurrent_r{NR}: the delta rule. Per value head j and token: S *= exp(g); kv = Sᵀk;
//     δ = β(v − kv); S += k⊗δ; o = Sᵀq. Block = (slice of Dv columns, value head); each warp owns 8
//     consecutive columns (32-byte sectors of a state row) and spreads Dk over 4 row groups, lane =
//     rg·8 + col, rows d = rg + 4i (i < NR): the state stays in registers for all T tokens and is read
//     once and written once. Sums over Dk: in-lane, then two xor-shuffles. NR·4 ≥ Dk.
//   gdn_gated_norm: y = w ⊙ x·rsqrt(mean(x²) + eps) ⊙ silu(z) per (token, value head) row of Dv,
//     one warp per row (y may alias x).
//   gdn_gated_norm_stage: the same y for a prompt chunk, written only as the output projection's
//     staged x (the half numerics of gemm_wgmma.cu, stage_half.cuh): one 8-warp block per token, a
//     warp taking heads w, w + 8, ... (gdn_gated_norm's row each; _d128_h4: Dv 128 and Hv 32, all of a
//     warp's loads issued at once), the token's Hv·Dv outputs (a multiple of 64) in shared memory, its
//     largest |y| setting its scale, 16-byte chunks of the f16 plane. The same bits as gdn_gated_norm
//     followed by the GEMM's stager.
//   gdn_step_r{NR}: one decode token through all of the above in one launch (the same maths and
//     order of operations): S blocks per value head j, each with Dv/S of its state columns (8 per
//     warp), which convolve the key head's q and k channels and their own v channels, compute the
//     gates, run the rule with the state in registers and write the gated norm of their outputs.
//     The blocks of a key head's Hv/Hk value heads form one thread-block cluster: the norm's sum of
//     squares is exchanged between a head's S blocks through distributed shared memory, and the
//     shared q/k conv state is shifted by the cluster's first block once every block has read it
//     (both after one cluster barrier; a second one keeps each block's shared memory alive until
//     the others have read it). The v channels are each one block's own.

#include <stdint.h>
#include "async_copy.cuh"
#include "pdl.cuh"
#include "reduce.cuh"
#include "gdn_step.cuh"
#include "gdn_conv.cuh"
#include "stage_half.cuh"


struct GdnConvQkParams {
    const float* x;        // [T, C] pre-conv projections, rows x_stride apart
    const float* conv_w;   // [C, K] (tap K-1 multiplies the current token)
    float* conv_state;     // [K-1, C], in place
    float* out;            // [T, C]
    const float* a;        // [T, Hv], rows ab_stride apart
    const float* b;        // [T, Hv], rows ab_stride apart
    const float* a_log;    // [Hv]
    const float* dt_bias;  // [Hv]
    float* g;              // [T, Hv]
    float* beta;           // [T, Hv]
    int t_len;
    int hk;
    int hv;
    int dk;
    int dv;
    int k;
    long long x_stride;    // floats between rows of x (C when x is its own buffer)
    long long ab_stride;   // floats between rows of a and of b (Hv when they are their own)
};

struct GdnRecurrentParams {
    const float* qkv;   // [T, C] after gdn_conv_qk
    const float* g;     // [T, Hv]
    const float* beta;  // [T, Hv]
    float* state;       // [Hv, Dk, Dv], in place
    float* out;         // [T, Hv, Dv]
    int t_len;
    int hk;
    int hv;
    int dk;
    int dv;
    int pad_;
};

struct GdnStepParams {
    const float* x;        // [C] the token's q | k | v projections (before the conv)
    const float* conv_w;   // [C, K]
    float* conv_state;     // [K-1, C], in place
    const float* a;        // [Hv]
    const float* b;        // [Hv]
    const float* a_log;    // [Hv]
    const float* dt_bias;  // [Hv]
    float* state;          // [Hv, Dk, Dv], in place
    const float* z;        // [Hv·Dv] the output gate's projection
    const float* norm_w;   // [Dv]
    float* y;              // [Hv·Dv] the gated norm of the rule's output
    int hk;
    int hv;
    int dk;
    int dv;
    int k;
    float eps;
    int slices;            // blocks per value head (each Dv/slices columns); Hv/Hk · slices ≤ 8
    int pad_;
};

struct GdnGatedNormParams {
    const float* x;  // [rows, Dv], rows = T·Hv
    const float* z;  // [T, Hv·Dv], token rows z_stride apart
    const float* w;  // [Dv]
    float* y;        // [rows, Dv]
    int rows;
    int dv;
    float eps;
    int hv;
    long long z_stride;  // floats between tokens of z (Hv·Dv when z is its own buffer)
};

// gdn_gated_norm_stage's: the norm's inputs as above (y unused), the staged output.
struct GdnGatedNormStageParams {
    GdnGatedNormParams n;
    uint16_t* plane;  // [T, Hv·Dv] f16, permuted within each group of 64
    float* scales;    // [T] 2^e
};

// One (token, value head) row's sum of squares over a warp (lane-strided, then the xor tree) and one
// output: gdn_gated_norm's and gdn_gated_norm_stage's, the same operations in the same order.
__device__ __forceinline__ float gated_norm_inv(const float* x, int dv, float eps, int lane) {
    float ss = 0.0f;
    for (int i = lane; i < dv; i += 32) ss += x[i] * x[i];
#pragma unroll
    for (int o = 16; o > 0; o >>= 1) ss += __shfl_xor_sync(0xffffffffu, ss, o);
    return 1.0f / sqrtf(ss / (float)dv + eps);
}
__device__ __forceinline__ float gated_norm_out(float w, float x, float inv, float z) { return w * (x * inv) * silu_f(z); }

// The channels of conv head `h` (q heads 0..Hk-1, k heads Hk..2Hk-1, then the Hv v heads): its first
// channel, its width, whether it is L2-normed (q and k) and the q heads' extra 1/√Dk.
struct ConvHead {
    int base, width;
    bool norm;
    float qscale;
};
__device__ __forceinline__ ConvHead conv_head(const GdnConvQkParams& p, int h) {
    if (h < 2 * p.hk) return {h * p.dk, p.dk, true, h < p.hk ? 1.0f / sqrtf((float)p.dk) : 1.0f};
    return {2 * p.hk * p.dk + (h - 2 * p.hk) * p.dv, p.dv, false, 1.0f};
}

extern "C" __global__ void __launch_bounds__(1024) gdn_conv_qk(const GdnConvQkParams p) { pdl_enter();
    const int kd = p.hk * p.dk;
    const long long C = 2LL * kd + (long long)p.hv * p.dv;
    const int K = p.k, hist = p.k - 1;
    const int blk = blockIdx.x;
    const ConvHead hc = conv_head(p, blk);
    const int base = hc.base, width = hc.width;
    const bool norm = hc.norm;
    const float qscale = hc.qscale;
    const int vhead = blk < 2 * p.hk ? -1 : blk - 2 * p.hk;

    for (int t = 0; t < p.t_len; ++t) {
        float ss = 0.0f;
        for (int c = threadIdx.x; c < width; c += blockDim.x) {
            const long long ch = base + c;
            float acc = 0.0f;
            for (int j = 0; j < K; ++j) {
                const int r = t + j;  // row of xin = concat(conv_state, x)
                const float xv = r < hist ? p.conv_state[r * C + ch] : p.x[(long long)(r - hist) * p.x_stride + ch];
                acc += p.conv_w[ch * K + j] * xv;
            }
            const float y = silu_f(acc);
            p.out[t * C + ch] = y;
            ss += y * y;
        }
        if (norm) {  // block-uniform
            ss = block_sum_reusable(ss);
            const float s = (1.0f / sqrtf(ss + 1e-6f)) * qscale;
            for (int c = threadIdx.x; c < width; c += blockDim.x) p.out[t * C + base + c] *= s;
        }
    }

    // New conv state row r = xin[T + r]. Each channel is owned by one thread, and the forward order reads
    // old row T + r (> r) before it is overwritten.
    for (int c = threadIdx.x; c < width; c += blockDim.x) {
        const long long ch = base + c;
        for (int r = 0; r < hist; ++r) {
            const int src = p.t_len + r;
            const float v = src < hist ? p.conv_state[src * C + ch] : p.x[(long long)(src - hist) * p.x_stride + ch];
            p.conv_state[r * C + ch] = v;
        }
    }

    if (vhead >= 0) {
        const int j = vhead;
        const float neg_a = -expf(p.a_log[j]);
        const float bias = p.dt_bias[j];
        for (int t = threadIdx.x; t < p.t_len; t += blockDim.x) {
            const long long i = (long long)t * p.hv + j, in = (long long)t * p.ab_stride + j;
            p.g[i] = neg_a * gdn_softplus(p.a[in] + bias);
            p.beta[i] = gdn_beta(p.b[in]);
        }
    }
}

#define CONV_TT 16    // tokens per block of gdn_conv_qk_tiled (= ops::gdn::CONV_TILE)
#define CONV_MAXK 8   // most conv taps (= ops::gdn::MAX_CONV_TAPS)

extern "C" __global__ void __launch_bounds__(256) gdn_conv_qk_tiled(const GdnConvQkParams p) { pdl_enter();
    __shared__ float part[CONV_TT][8];
    const int kd = p.hk * p.dk;
    const long long C = 2LL * kd + (long long)p.hv * p.dv;
    const int K = p.k, hist = p.k - 1;
    const int blk = blockIdx.y;
    const ConvHead hc = conv_head(p, blk);
    const int base = hc.base, width = hc.width;
    const bool norm = hc.norm;
    const float qscale = hc.qscale;
    const int t0 = blockIdx.x * CONV_TT;
    const int nt = min(CONV_TT, p.t_len - t0);
    const int c = threadIdx.x;
    const bool live = c < width;
    const long long ch = base + (live ? c : 0);

    float w[CONV_MAXK];
#pragma unroll
    for (int j = 0; j < CONV_MAXK; ++j) w[j] = (live && j < K) ? p.conv_w[ch * K + j] : 0.0f;
    // xin rows t0 .. t0 + nt + K - 2 (xin = concat(conv_state, x)).
    float xw[CONV_TT + CONV_MAXK - 1];
#pragma unroll
    for (int i = 0; i < CONV_TT + CONV_MAXK - 1; ++i) {
        const int r = t0 + i;
        float v = 0.0f;
        if (live && i < nt + K - 1) v = r < hist ? p.conv_state[(long long)r * C + ch] : p.x[(long long)(r - hist) * p.x_stride + ch];
        xw[i] = v;
    }
    float y[CONV_TT];
#pragma unroll
    for (int i = 0; i < CONV_TT; ++i) {
        float acc = 0.0f;
#pragma unroll
        for (int j = 0; j < CONV_MAXK; ++j)
            if (j < K) acc += w[j] * xw[i + j];
        y[i] = (live && i < nt) ? silu_f(acc) : 0.0f;
    }
    if (norm) {  // block-uniform
        const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5, nw = (blockDim.x + 31) >> 5;
#pragma unroll
        for (int i = 0; i < CONV_TT; ++i) {
            float ss = y[i] * y[i];
#pragma unroll
            for (int o = 16; o > 0; o >>= 1) ss += __shfl_xor_sync(0xffffffffu, ss, o);
            if (lane == 0) part[i][warp] = ss;
        }
        __syncthreads();
#pragma unroll
        for (int i = 0; i < CONV_TT; ++i) {
            float ss = 0.0f;
            for (int k = 0; k < nw; ++k) ss += part[i][k];
            y[i] *= (1.0f / sqrtf(ss + 1e-6f)) * qscale;
        }
    }
    if (live) {
#pragma unroll
        for (int i = 0; i < CONV_TT; ++i)
            if (i < nt) p.out[(long long)(t0 + i) * C + ch] = y[i];
    }
}

// gdn_conv_qk_tiled's job with one warp per (head, tile of CW_TT tokens): lane l owns channels
// 4l..4l+3 of the head (16-byte loads and stores; the head's width ≤ 128 and a multiple of 4, x's rows
// and C multiples of 4 floats), the tile's K-1+CW_TT input rows all loaded before any is used (the
// loads of a warp in flight at once: the kernel is a stream of x in and out), and each token's q/k norm
// summed over the warp by shuffles (no block barrier). Warps w, w+1, .. of a block take the heads of one
// token tile in order, so a block reads whole runs of a row. KM: the most taps (K ≤ KM).
#define CW_TT 16
template <int KM>
__device__ __forceinline__ void conv_qk_warp(const GdnConvQkParams& p) {
    const int kd = p.hk * p.dk;
    const long long C = 2LL * kd + (long long)p.hv * p.dv;
    const int K = p.k, hist = p.k - 1;
    const int heads = 2 * p.hk + p.hv;
    const int lane = threadIdx.x & 31;
    const long long w_id = (long long)blockIdx.x * (blockDim.x >> 5) + (threadIdx.x >> 5);
    const int head = (int)(w_id % heads);
    const int t0 = (int)(w_id / heads) * CW_TT;
    if (t0 >= p.t_len) return;  // whole warps; no block barrier in this kernel
    const ConvHead hc = conv_head(p, head);
    const int base = hc.base, width = hc.width;
    const bool norm = hc.norm;
    const float qscale = hc.qscale;
    const int nt = min(CW_TT, p.t_len - t0);
    const bool live = 4 * lane < width;
    const long long ch = base + (live ? 4 * lane : 0);

    // xin rows t0 .. t0 + nt + K - 2 (xin = concat(conv_state, x)), 4 channels each.
    float4 xw[CW_TT + KM - 1];
#pragma unroll
    for (int i = 0; i < CW_TT + KM - 1; ++i)
        xw[i] = (live && i < nt + K - 1) ? conv_input4(p.conv_state, p.x, p.x_stride, C, t0 + i, hist, ch) : make_float4(0.0f, 0.0f, 0.0f, 0.0f);
    float w[4][KM];
    conv_taps4<KM>(w, p.conv_w, ch, K, live);

#pragma unroll
    for (int i = 0; i < CW_TT; ++i) {
        const float4 y = conv_row4<KM>(w, &xw[i], K, live, norm, qscale);
        if (live && i < nt) *reinterpret_cast<float4*>(p.out + (long long)(t0 + i) * C + ch) = y;
    }
}

extern "C" __global__ void __launch_bounds__(128) gdn_conv_qk_warp_k4(const GdnConvQkParams p) { pdl_enter(); conv_qk_warp<4>(p); }
extern "C" __global__ void __launch_bounds__(128) gdn_conv_qk_warp_k8(const GdnConvQkParams p) { pdl_enter(); conv_qk_warp<8>(p); }

extern "C" __global__ void __launch_bounds__(256) gdn_conv_finish(const GdnConvQkParams p) { pdl_enter();
    const int kd = p.hk * p.dk;
    const long long C = 2LL * kd + (long long)p.hv * p.dv;
    const int hist = p.k - 1;
    const long long n_state = (long long)hist * C, n_gate = p.g ? (long long)p.t_len * p.hv : 0;  // no g: the state alone
    const long long n = n_state > n_gate ? n_state : n_gate;
    for (long long i = blockIdx.x * (long long)blockDim.x + threadIdx.x; i < n; i += (long long)gridDim.x * blockDim.x) {
        if (i < n_state) {  // new state row r = xin[T + r] = x[T - hist + r] (T ≥ hist)
            const long long r = i / C, ch = i - r * C;
            p.conv_state[i] = p.x[(p.t_len - hist + r) * p.x_stride + ch];
        }
        if (i < n_gate) {
            const int j = (int)(i % p.hv);
            const long long in = (i / p.hv) * p.ab_stride + j;
            const float neg_a = -expf(p.a_log[j]);
            p.g[i] = neg_a * gdn_softplus(p.a[in] + p.dt_bias[j]);
            p.beta[i] = gdn_beta(p.b[in]);
        }
    }
}

template <int NR>
__device__ __forceinline__ void gdn_recurrent(const GdnRecurrentParams& p) {
    constexpr int CW = 8, RG = 4;
    __shared__ float sq[NR * RG], sk[NR * RG];
    const int j = blockIdx.y;
    const int kh = j / (p.hv / p.hk);
    const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31;
    const int rg = lane >> 3;
    const int col = (blockIdx.x * (blockDim.x >> 5) + warp) * CW + (lane & (CW - 1));
    const bool active = col < p.dv;
    const int dk = p.dk, dv = p.dv;
    const long long kd = (long long)p.hk * dk;
    const long long C = 2 * kd + (long long)p.hv * dv;
    float* S = p.state + (long long)j * dk * dv;

    float s[NR];
#pragma unroll
    for (int i = 0; i < NR; ++i) {
        const int d = rg + RG * i;
        s[i] = (active && d < dk) ? S[(long long)d * dv + col] : 0.0f;
    }

    for (int t = 0; t < p.t_len; ++t) {
        const float* row = p.qkv + t * C;
        __syncthreads();  // the previous token's reads of sq/sk are done
        for (int d = threadIdx.x; d < NR * RG; d += blockDim.x) {
            const bool in = d < dk;
            sq[d] = in ? row[kh * dk + d] : 0.0f;
            sk[d] = in ? row[kd + kh * dk + d] : 0.0f;
        }
        __syncthreads();
        const float decay = expf(p.g[t * p.hv + j]);
        const float bt = p.beta[t * p.hv + j];
        const float v = active ? row[2 * kd + (long long)j * dv + col] : 0.0f;

        float kv = 0.0f;
#pragma unroll
        for (int i = 0; i < NR; ++i) kv += sk[rg + RG * i] * s[i];
        kv += __shfl_xor_sync(0xffffffffu, kv, 8);
        kv += __shfl_xor_sync(0xffffffffu, kv, 16);
        const float delta = bt * (v - decay * kv);

        float o = 0.0f;
#pragma unroll
        for (int i = 0; i < NR; ++i) {
            s[i] = decay * s[i] + sk[rg + RG * i] * delta;
            o += sq[rg + RG * i] * s[i];
        }
        o += __shfl_xor_sync(0xffffffffu, o, 8);
        o += __shfl_xor_sync(0xffffffffu, o, 16);
        if (active && rg == 0) p.out[((long long)t * p.hv + j) * dv + col] = o;
    }

#pragma unroll
    for (int i = 0; i < NR; ++i) {
        const int d = rg + RG * i;
        if (active && d < dk) S[(long long)d * dv + col] = s[i];
    }
}

extern "C" __global__ void __launch_bounds__(256) gdn_recurrent_r2(const GdnRecurrentParams p) { pdl_enter(); gdn_recurrent<2>(p); }
extern "C" __global__ void __launch_bounds__(256) gdn_recurrent_r4(const GdnRecurrentParams p) { pdl_enter(); gdn_recurrent<4>(p); }
extern "C" __global__ void __launch_bounds__(256) gdn_recurrent_r8(const GdnRecurrentParams p) { pdl_enter(); gdn_recurrent<8>(p); }
extern "C" __global__ void __launch_bounds__(256) gdn_recurrent_r16(const GdnRecurrentParams p) { pdl_enter(); gdn_recurrent<16>(p); }
extern "C" __global__ void __launch_bounds__(256) gdn_recurrent_r32(const GdnRecurrentParams p) { pdl_enter(); gdn_recurrent<32>(p); }
extern "C" __global__ void __launch_bounds__(256) gdn_recurrent_r64(const GdnRecurrentParams p) { pdl_enter(); gdn_recurrent<64>(p); }

extern "C" __global__ void __launch_bounds__(1024) gdn_gated_norm(const GdnGatedNormParams p) { pdl_enter();
    const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31;
    const long long r = (long long)blockIdx.x * (blockDim.x >> 5) + warp;
    if (r >= p.rows) return;  // whole warps only; no block barrier below
    const float* x = p.x + r * p.dv;
    const float* z = p.z + (r / p.hv) * p.z_stride + (r % p.hv) * p.dv;
    float* y = p.y + r * p.dv;
    const float inv = gated_norm_inv(x, p.dv, p.eps, lane);
    for (int i = lane; i < p.dv; i += 32) y[i] = gated_norm_out(p.w[i], x[i], inv, z[i]);
}

// One token of gdn_gated_norm_stage: its outputs into ys (stage_smem_index's layout); returns this
// thread's largest |y|. REGS (NJ = Dv/32 values a lane, HPW = Hv/8 heads a warp): every load of the
// warp's heads issued at once into registers, then each head's sums and outputs; else a head at a time.
// Either way each head's sum runs over the lanes' x[lane + 32j] in j order, then the xor tree: the
// separate norm's order (gated_norm_inv), so the outputs are its bits.
template <int NJ, int HPW>
__device__ __forceinline__ float gated_norm_token(const GdnGatedNormParams& p, long long t, float* ys, int warp, int lane) {
    float m = 0.0f;
    if constexpr (NJ > 0) {
        float xv[HPW][NJ], zv[HPW][NJ], wv[NJ];
#pragma unroll
        for (int a = 0; a < HPW; ++a) {
            const int h = warp + 8 * a;
            const float* x = p.x + (t * p.hv + h) * p.dv;
            const float* z = p.z + t * p.z_stride + (long long)h * p.dv;
#pragma unroll
            for (int j = 0; j < NJ; ++j) {
                xv[a][j] = x[lane + 32 * j];
                zv[a][j] = z[lane + 32 * j];
            }
        }
#pragma unroll
        for (int j = 0; j < NJ; ++j) wv[j] = p.w[lane + 32 * j];
#pragma unroll
        for (int a = 0; a < HPW; ++a) {
            float ss = 0.0f;
#pragma unroll
            for (int j = 0; j < NJ; ++j) ss += xv[a][j] * xv[a][j];
#pragma unroll
            for (int o = 16; o > 0; o >>= 1) ss += __shfl_xor_sync(0xffffffffu, ss, o);
            const float inv = 1.0f / sqrtf(ss / (float)p.dv + p.eps);
            const int h = warp + 8 * a;
#pragma unroll
            for (int j = 0; j < NJ; ++j) {
                const float y = gated_norm_out(wv[j], xv[a][j], inv, zv[a][j]);
                ys[stage_smem_index(h * p.dv + lane + 32 * j)] = y;
                m = fmaxf(m, fabsf(y));
            }
        }
    } else {
        for (int h = warp; h < p.hv; h += 8) {
            const float* x = p.x + (t * p.hv + h) * p.dv;
            const float* z = p.z + t * p.z_stride + (long long)h * p.dv;
            const float inv = gated_norm_inv(x, p.dv, p.eps, lane);
            for (int i = lane; i < p.dv; i += 32) {
                const float y = gated_norm_out(p.w[i], x[i], inv, z[i]);
                ys[stage_smem_index(h * p.dv + i)] = y;
                m = fmaxf(m, fabsf(y));
            }
        }
    }
    return m;
}

template <int NJ, int HPW>
__device__ __forceinline__ void gated_norm_stage(const GdnGatedNormStageParams& q) {
    extern __shared__ float ys[];  // [Hv·Dv]: the token's outputs, stage_smem_index's layout
    __shared__ float red[8];
    const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31;
    const long long t = blockIdx.x;
    const int vd = q.n.hv * q.n.dv;
    // The token's largest |y| (block_max's barrier also publishes ys).
    const float m = block_max<8>(gated_norm_token<NJ, HPW>(q.n, t, ys, warp, lane), red);
    stage_half_row_out(ys, m, vd, reinterpret_cast<uint4*>(q.plane + t * vd), q.scales + t, 256);
}
// 256 threads; _d128_h4: Dv = 128 and Hv = 32 (the 35B model: every load of a warp's 4 heads at once).
extern "C" __global__ void __launch_bounds__(256) gdn_gated_norm_stage(const GdnGatedNormStageParams q) { pdl_enter(); gated_norm_stage<0, 0>(q); }
extern "C" __global__ void __launch_bounds__(256) gdn_gated_norm_stage_d128_h4(const GdnGatedNormStageParams q) { pdl_enter(); gated_norm_stage<4, 4>(q); }

template <int NR>
__device__ __forceinline__ void gdn_step(const GdnStepParams& p) {
    extern __shared__ float step_smem[];  // q [Dk] | k [Dk] | v [Dv/S] after the conv
    __shared__ float ss_part;            // this block's sum of squares of its outputs (read by the head's blocks)
    constexpr int RG = 4;
    const int S = p.slices;
    const int j = blockIdx.x / S, slice = blockIdx.x % S;
    const int ratio = p.hv / p.hk, kh = j / ratio;
    const int dk = p.dk, dv = p.dv, K = p.k, hist = p.k - 1;
    const int cols = dv / S, c0 = slice * cols;  // this block's state columns
    const long long kd = (long long)p.hk * dk;
    const long long C = 2 * kd + (long long)p.hv * dv;
    float* sq = step_smem;
    float* sk = step_smem + dk;
    float* sv = step_smem + 2 * dk;
    float s[NR];  // the block's state columns (the rule's layout, below)

    // Conv + SiLU of the key head's q and k channels, from the old conv state (shifted at the end).
    float ssq = 0.0f, ssk = 0.0f;
    for (int c = threadIdx.x; c < 2 * dk; c += blockDim.x) {
        const long long ch = c < dk ? kh * dk + c : kd + kh * dk + (c - dk);
        float acc = 0.0f;
        for (int i = 0; i < K; ++i) {
            const float xv = i < hist ? p.conv_state[i * C + ch] : p.x[ch];
            acc += p.conv_w[ch * K + i] * xv;
        }
        const float y = silu_f(acc);
        if (c < dk) {
            sq[c] = y;
            ssq += y * y;
        } else {
            sk[c - dk] = y;
            ssk += y * y;
        }
    }
    // This block's v channels are its own: convolve and shift their state now.
    for (int c = threadIdx.x; c < cols; c += blockDim.x) {
        const long long ch = 2 * kd + (long long)j * dv + c0 + c;
        float acc = 0.0f;
        for (int i = 0; i < K; ++i) {
            const float xv = i < hist ? p.conv_state[i * C + ch] : p.x[ch];
            acc += p.conv_w[ch * K + i] * xv;
        }
        for (int r = 0; r < hist; ++r) p.conv_state[r * C + ch] = r + 1 < hist ? p.conv_state[(r + 1) * C + ch] : p.x[ch];
        sv[c] = silu_f(acc);
    }

    // q <- l2norm(q)/sqrt(Dk), k <- l2norm(k) (block_sum_reusable ends with a barrier: sq, sk, sv are written).
    ssq = block_sum_reusable(ssq);
    ssk = block_sum_reusable(ssk);
    const float qs = (1.0f / sqrtf(ssq + 1e-6f)) * (1.0f / sqrtf((float)dk));
    const float ks = 1.0f / sqrtf(ssk + 1e-6f);
    for (int c = threadIdx.x; c < 2 * dk; c += blockDim.x) step_smem[c] *= c < dk ? qs : ks;
    __syncthreads();

    // The gates of head j.
    const float decay = expf(-expf(p.a_log[j]) * gdn_softplus(p.a[j] + p.dt_bias[j]));
    const float bt = gdn_beta(p.b[j]);

    // The rule, as gdn_recurrent (T = 1): warp w owns columns c0 + 8w .. +7, lane = rg·8 + column.
    const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31;
    const int rg = lane >> 3;
    const int lc = warp * 8 + (lane & 7);  // column within the block
    const int col = c0 + lc;
    const bool active = lc < cols;
    float* St = p.state + (long long)j * dk * dv;
    gdn_step_state<RG>(s, St, rg, col, active, dk, dv);
    const float v = active ? sv[lc] : 0.0f;
    const float o = gdn_step_rule<RG>(s, sq, sk, v, decay, bt, rg, dk);
#pragma unroll
    for (int i = 0; i < NR; ++i) {
        const int d = rg + RG * i;
        if (active && d < dk) St[(long long)d * dv + col] = s[i];
    }

    // Gated RMSNorm over the head's Dv outputs: this block's part of the sum of squares, then the
    // head's S parts (in slice order, in every block alike) through distributed shared memory.
    const bool owner = active && rg == 0;
    const float part = block_sum_reusable(owner ? o * o : 0.0f);
    if (threadIdx.x == 0) ss_part = part;
    cluster_arrive();  // ss_part written; this block is done reading the q/k conv state
    cluster_wait();
    const int rank0 = (j % ratio) * S;  // the head's first block in the cluster
    const float oss = cluster_sum(&ss_part, rank0, S);
    const float inv = 1.0f / sqrtf(oss / (float)dv + p.eps);
    if (owner) {
        const long long i = (long long)j * dv + col;
        p.y[i] = p.norm_w[col] * (o * inv) * silu_f(p.z[i]);
    }

    // Every block of the cluster has read the q/k conv state: the cluster's first block shifts it.
    if (j % ratio == 0 && slice == 0) {
        for (int c = threadIdx.x; c < 2 * dk; c += blockDim.x) {
            const long long ch = c < dk ? kh * dk + c : kd + kh * dk + (c - dk);
            for (int r = 0; r < hist; ++r) p.conv_state[r * C + ch] = r + 1 < hist ? p.conv_state[(r + 1) * C + ch] : p.x[ch];
        }
    }
    // No block leaves while another may still read its ss_part.
    cluster_arrive();
    cluster_wait();
}

// The same step with its loads batched (gdn_step_b_r*, the default where it fits). ncu (2026-12-06, graph node,
// H100) found gdn_step's chain in its loads and fences: the conv's inputs a loop of dependent loads
// a channel, the gates, z and the norm weight each a round trip after the one before, the cluster
// barrier's release (a GPU-scope MEMBAR) waiting for the state's stores, the q/k conv state shifted
// by one block after that barrier (whose acquire had emptied L1) as a chain of load-then-store, and
// every block of the cluster waiting for it. Here:
//   - before the PDL wait (nothing a predecessor writes): the block's conv weights and conv state
//     rows into shared memory (cp.async), the state columns into registers, A_log, dt_bias and the
//     norm weight;
//   - after it, one batch: the block's x channels (cp.async), a, b and z;
//   - the conv from shared memory; the v channels' conv state shifted at once from it (stores only);
//   - the state and y stored after the cluster's exchange, and the q/k conv state shifted there
//     from shared memory by every block of the cluster (a 1/(blocks) share each);
//   - the last cluster barrier (shared memory's lifetime only) arrives relaxed: no fence.
// The same maths in the same order as gdn_step. Shared memory: the block's n = 2·Dk + Dv/S channels
// (q | k | its v) as Y [n] (after the conv) | W [n, K] | H [K-1, n] | X [n]. WIDE (gdn_step_b_r*): those
// copies 16 bytes each where the shapes allow (K = 4: a channel's taps one chunk; runs of channels in
// multiples of 4), else, and in gdn_step_bn_r* (the first form, for A/B runs), 4 bytes each (the
// twenty-fourth session's source view: the 4-byte copies and their index divisions, 28% of the step's
// stall samples).
template <int NR, bool WIDE>
__device__ __forceinline__ void gdn_step_batched(const GdnStepParams& p) {
    extern __shared__ __align__(16) float step_smem[];  // 16-byte aligned for the wide copies
    __shared__ float ss_part;
    constexpr int RG = 4;
    const int S = p.slices;
    const int j = blockIdx.x / S, slice = blockIdx.x % S;
    const int ratio = p.hv / p.hk, kh = j / ratio;
    const int dk = p.dk, dv = p.dv, K = p.k, hist = p.k - 1;
    const int cols = dv / S, c0 = slice * cols;
    const int n = 2 * dk + cols;
    const long long kd = (long long)p.hk * dk;
    const long long C = 2 * kd + (long long)p.hv * dv;
    const int tid = threadIdx.x, bd = blockDim.x;
    float* Y = step_smem;  // sq = Y, sk = Y + dk, sv = Y + 2·dk
    float* W = Y + n;
    float* H = W + n * K;
    float* X = H + hist * n;
    // Channel i of the block's list: q, k of key head kh, then its own v columns of value head j.
    auto chan = [&](int i) -> long long {
        return i < dk ? kh * dk + i : i < 2 * dk ? kd + kh * dk + (i - dk) : 2 * kd + (long long)j * dv + c0 + (i - 2 * dk);
    };
    const int warp = tid >> 5, lane = tid & 31;
    const int rg = lane >> 3;
    const int lc = warp * 8 + (lane & 7);
    const int col = c0 + lc;
    const bool active = lc < cols, owner = active && rg == 0;
    float* St = p.state + (long long)j * dk * dv;
    float s[NR];

    // 16-byte copies where every run of channels and every row starts on 16 bytes (the model's shapes:
    // K = 4, so a channel's taps are one chunk; q, k and the v columns in runs of multiples of 4), else 4.
    const bool wide = WIDE && K == 4 && dk % 4 == 0 && cols % 4 == 0 && dv % 4 == 0 && (reinterpret_cast<uintptr_t>(p.x) & 15) == 0 &&
                      (reinterpret_cast<uintptr_t>(p.conv_w) & 15) == 0 && (reinterpret_cast<uintptr_t>(p.conv_state) & 15) == 0;

    // Before the PDL wait: what no predecessor writes.
    if (wide) {
        for (int i = tid; i < n; i += bd) cp_async16(smem_addr(W + 4 * i), p.conv_w + chan(i) * 4, true);
        for (int t = 0; t < hist; ++t)
            for (int i = 4 * tid; i < n; i += 4 * bd) cp_async16(smem_addr(H + t * n + i), p.conv_state + t * C + chan(i), true);
    } else {
        for (int e = tid; e < n * K; e += bd) cp_async4(smem_addr(W + e), p.conv_w + chan(e / K) * K + e % K, true);
        for (int e = tid; e < hist * n; e += bd) cp_async4(smem_addr(H + e), p.conv_state + (e / n) * C + chan(e % n), true);
    }
    gdn_step_state<RG>(s, St, rg, col, active, dk, dv);
    const float a_log = p.a_log[j], dt_bias = p.dt_bias[j];
    const float nw = owner ? p.norm_w[col] : 0.0f;
    pdl_wait();
    pdl_launch_dependents();
    if (wide) {
        for (int i = 4 * tid; i < n; i += 4 * bd) cp_async16(smem_addr(X + i), p.x + chan(i), true);
    } else {
        for (int i = tid; i < n; i += bd) cp_async4(smem_addr(X + i), p.x + chan(i), true);
    }
    cp_async_commit_group();
    const float ga = p.a[j] + dt_bias, bv = p.b[j];
    const float zv = owner ? p.z[(long long)j * dv + col] : 0.0f;
    cp_async_wait_group<0>();
    __syncthreads();

    // Conv + SiLU of every channel; the v channels' conv state shifted now (the block's own).
    float ssq = 0.0f, ssk = 0.0f;
    for (int i = tid; i < n; i += bd) {
        float acc = 0.0f;
        for (int t = 0; t < K; ++t) acc += W[i * K + t] * (t < hist ? H[t * n + i] : X[i]);
        const float y = silu_f(acc);
        Y[i] = y;
        if (i < dk) ssq += y * y;
        else if (i < 2 * dk) ssk += y * y;
        else {
            const long long ch = chan(i);
            for (int r = 0; r < hist; ++r) p.conv_state[r * C + ch] = r + 1 < hist ? H[(r + 1) * n + i] : X[i];
        }
    }
    // q <- l2norm(q)/sqrt(Dk), k <- l2norm(k) (the second sum ends with a barrier: Y is written).
    ssq = block_sum_reusable(ssq);
    ssk = block_sum_reusable(ssk);
    const float qs = (1.0f / sqrtf(ssq + 1e-6f)) * (1.0f / sqrtf((float)dk));
    const float ks = 1.0f / sqrtf(ssk + 1e-6f);
    for (int i = tid; i < 2 * dk; i += bd) Y[i] *= i < dk ? qs : ks;
    __syncthreads();

    // The gates of head j.
    const float decay = expf(-expf(a_log) * gdn_softplus(ga));
    const float bt = gdn_beta(bv);

    // The rule (gdn_step's layout); the state is stored after the exchange below.
    const float v = active ? Y[2 * dk + lc] : 0.0f;
    const float o = gdn_step_rule<RG>(s, Y, Y + dk, v, decay, bt, rg, dk);

    // Gated RMSNorm over the head's Dv outputs: the head's S parts through distributed shared memory.
    const float part = block_sum_reusable(owner ? o * o : 0.0f);
    if (tid == 0) ss_part = part;
    cluster_arrive();  // ss_part written; every block has read the q/k conv state (its copies waited for)
    cluster_wait();
    const int rank0 = (j % ratio) * S;  // the head's first block in the cluster
    const float oss = cluster_sum(&ss_part, rank0, S);
    const float inv = 1.0f / sqrtf(oss / (float)dv + p.eps);
    if (owner) p.y[(long long)j * dv + col] = nw * (o * inv) * silu_f(zv);
#pragma unroll
    for (int i = 0; i < NR; ++i) {
        const int d = rg + RG * i;
        if (active && d < dk) St[(long long)d * dv + col] = s[i];
    }
    // The q/k conv state shifted, channels spread over the cluster's blocks (from shared memory).
    const int cs = ratio * S, crank = rank0 + slice;
    for (int i = crank + cs * tid; i < 2 * dk; i += cs * bd) {
        const long long ch = chan(i);
        for (int r = 0; r < hist; ++r) p.conv_state[r * C + ch] = r + 1 < hist ? H[(r + 1) * n + i] : X[i];
    }
    // No block leaves while another may still read its ss_part (already read by this block: no fence).
    cluster_arrive_relaxed();
    cluster_wait();
}

#define GDN_STEP_ENTRIES(NR)                                                                                                        \
    extern "C" __global__ void __launch_bounds__(512, 1) gdn_step_r##NR(const GdnStepParams p) { pdl_enter(); gdn_step<NR>(p); }      \
    extern "C" __global__ void __launch_bounds__(256, 1) gdn_step_b_r##NR(const GdnStepParams p) { gdn_step_batched<NR, true>(p); } \
    extern "C" __global__ void __launch_bounds__(256, 1) gdn_step_bn_r##NR(const GdnStepParams p) { gdn_step_batched<NR, false>(p); }
GDN_STEP_ENTRIES(2)
GDN_STEP_ENTRIES(4)
GDN_STEP_ENTRIES(8)
GDN_STEP_ENTRIES(16)
GDN_STEP_ENTRIES(32)
GDN_STEP_ENTRIES(64)

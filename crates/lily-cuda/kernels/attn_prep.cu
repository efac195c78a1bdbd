// Per-token preparation of gated full attention, the part of lily_cpu::attention::forward between the
// projections and the softmax: for T tokens at positions pos0..pos0+T,
//   q    = RMSNorm(query part of qg) · q_norm, then partial NeoX RoPE  -> q_out [T, nh, hd]
//   gate = gate part of qg (when gated)                                 -> gate_out [T, nh, hd]
//   k    = RMSNorm(k) · k_norm, then partial NeoX RoPE                  -> k_cache row pos0+t (bf16)
//   v                                                                   -> v_cache at position pos0+t (bf16)
// qg is [T, nh, hd·(1+gated)] with each head's row [query(hd) | gate(hd)]; k, v are [T, kvh, hd]. The
// caches hold bf16 (rounded to nearest even): K [capacity, kvh, hd] (position-major, as
// lily_cpu::attention::KvCache), V in transposed tiles of 32 positions, [kvh, capacity/32, hd, 32]
// (kv_layout.cuh; capacity a multiple of 32).
// RoPE rotates pairs (i, i + rot/2), i < rot/2, by angle (pos0+t)·theta^(-2i/rot); the angle, its cos and
// sin are computed in f64 and cast to f32, as the CPU does. Products are rounded separately (no FMA
// contraction) so each rotated element is computed exactly as lily_cpu::attention::rope does.
//
//   attn_prep:     grid (T, nh + kvh), one block per (token, head) row of hd elements, one thread per
//                  element (decode and short chunks: the most blocks at once).
//   attn_prep_chunk: grid (T, ⌈(nh + kvh) / 8⌉) for prompt chunks: a block per (token, 8 heads), a warp
//                  per head row, the RoPE table once a block (18× fewer f64 angles than attn_prep).
//   kv_copy_rows:  dst[r·dst_pitch + i] = src[r·src_pitch + i] for i < len (bf16 elements): growing or
//                  cutting a tiled V cache to another capacity (a row is a KV head's tiles).

#include <stdint.h>
#include <cuda_bf16.h>
#include "pdl.cuh"
#include "bf16.cuh"
#include "reduce.cuh"
#include "kv_layout.cuh"

struct AttnPrepParams {
    const float* qg;      // [T, nh, hd·(1+gated)]
    const float* k;       // [T, kvh, hd]
    const float* v;       // [T, kvh, hd]
    const float* q_norm;  // [hd]
    const float* k_norm;  // [hd]
    float* q_out;         // [T, nh, hd]
    float* gate_out;      // [T, nh, hd], or null when not gated
    uint16_t* k_cache;    // [capacity, kvh, hd] bf16
    uint16_t* v_cache;    // [kvh, capacity/32, hd, 32] bf16 (kv_layout.cuh)
    double theta;
    int t;
    int nh;
    int kvh;
    int hd;
    int rot;
    int pos0;
    int gated;
    float eps;
    const int* pos_dev;   // when not null, pos0 is read from here (CUDA-graph decode: the position lives on the device)
    int capacity;         // positions the caches hold
    int pad_;
};

struct KvCopyParams {
    const uint16_t* src;
    uint16_t* dst;
    long long src_pitch;  // elements
    long long dst_pitch;
    long long rows;
    long long len;
};


#define PREP_MAX_HD 1024

// RoPE pair i's (cos, sin) at position `pos`: the angle pos·theta^(-2i/rot), its cos and sin in f64,
// cast to f32, as lily_cpu::attention::rope computes them.
__device__ __forceinline__ void rope_cs(double theta, int rot, int i, int pos, float& c, float& s) {
    const double inv_freq = pow(theta, -(double)(2 * i) / (double)rot);
    const double ang = (double)pos * inv_freq;
    double sd, cd;
    sincos(ang, &sd, &cd);
    c = (float)cd;
    s = (float)sd;
}

// Element d < rot of a rotated row from the pair (a, b) = (row[i], row[i + rot/2]):
// h[i] = a·cos − b·sin, h[i + rot/2] = b·cos + a·sin, each product rounded (no contraction).
__device__ __forceinline__ float rope_rotate(bool first_half, float a, float b, float c, float s) {
    return first_half ? __fsub_rn(__fmul_rn(a, c), __fmul_rn(b, s)) : __fadd_rn(__fmul_rn(b, c), __fmul_rn(a, s));
}

extern "C" __global__ void __launch_bounds__(PREP_MAX_HD) attn_prep(const AttnPrepParams p) {
    __shared__ float row[PREP_MAX_HD];
    const int t = blockIdx.x;
    const int head = blockIdx.y;
    const int d = threadIdx.x;
    const int hd = p.hd;
    const int pos0 = p.pos_dev ? *p.pos_dev : p.pos0;  // the host's (uploaded before a decode step)
    const bool is_q = head < p.nh;
    const bool live = d < hd;
    // This element's RoPE (cos, sin) depend on the position alone: computed (f64) before the PDL wait.
    const int half = p.rot / 2;
    float rc = 1.0f, rs = 0.0f;
    if (live && d < p.rot) rope_cs(p.theta, p.rot, d < half ? d : d - half, pos0 + t, rc, rs);
    pdl_enter();

    const float* src;
    const float* w;
    float* dst = nullptr;      // q
    uint16_t* kdst = nullptr;  // k cache row
    if (is_q) {
        const long long per_head = p.gated ? 2LL * hd : (long long)hd;
        src = p.qg + ((long long)t * p.nh + head) * per_head;
        w = p.q_norm;
        dst = p.q_out + ((long long)t * p.nh + head) * hd;
        if (p.gated && live) p.gate_out[((long long)t * p.nh + head) * hd + d] = src[hd + d];
    } else {
        const int kv = head - p.nh;
        const long long in_off = ((long long)t * p.kvh + kv) * hd;
        const long long cache_off = ((long long)(pos0 + t) * p.kvh + kv) * hd;
        src = p.k + in_off;
        w = p.k_norm;
        kdst = p.k_cache + cache_off;
        if (live) p.v_cache[vt_index(kv, d, pos0 + t, hd, p.capacity)] = (uint16_t)bf16_bits(p.v[in_off + d]);
    }

    // RMSNorm: y = x · (1 / sqrt(mean(x²) + eps)) · w, rounded as (x · inv) · w like the CPU.
    const float x = live ? src[d] : 0.0f;
    const float ss = block_sum(x * x);
    const float inv = 1.0f / sqrtf(ss / (float)hd + p.eps);
    const float y = live ? __fmul_rn(__fmul_rn(x, inv), w[d]) : 0.0f;
    if (live) row[d] = y;
    __syncthreads();
    if (!live) return;

    float out = y;
    if (d < p.rot) {
        const int i = d < half ? d : d - half;
        out = rope_rotate(d < half, row[i], row[i + half], rc, rs);
    }
    if (is_q) {
        dst[d] = out;
    } else {
        kdst[d] = (uint16_t)bf16_bits(out);
    }
}

// Blocks (token, group of PREP_WARPS heads), a warp per head row of hd elements: (1) the row staged
// in the warp's shared row (the gate half copied out, V appended to its cache), its RMSNorm summed by
// shuffles and applied; (2) the token's rot/2 RoPE (cos, sin) pairs, once a block (f64, cast to f32,
// as the CPU does), after the rows' loads are in flight; one barrier; (3) the rotation from the row.
#define PREP_WARPS 8
extern "C" __global__ void __launch_bounds__(PREP_WARPS * 32) attn_prep_chunk(const AttnPrepParams p) { pdl_enter();
    extern __shared__ float prep_smem[];  // cos [rot/2] | sin [rot/2] | PREP_WARPS rows of hd
    const int t = blockIdx.x;
    const int hd = p.hd, half = p.rot / 2;
    const int pos0 = p.pos_dev ? *p.pos_dev : p.pos0;
    const int pos = pos0 + t;
    float* cs = prep_smem;
    float* sn = prep_smem + half;
    const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31;
    float* row = prep_smem + 2 * half + warp * hd;
    const int head = blockIdx.y * PREP_WARPS + warp;
    const bool has = head < p.nh + p.kvh;  // warp-uniform; every warp reaches the barrier below
    const bool is_q = head < p.nh;
    if (has) {
        const float* src;
        const float* w;
        if (is_q) {
            const long long per_head = p.gated ? 2LL * hd : (long long)hd;
            src = p.qg + ((long long)t * p.nh + head) * per_head;
            w = p.q_norm;
            if (p.gated) {
                float* g = p.gate_out + ((long long)t * p.nh + head) * hd;
                for (int d = lane; d < hd; d += 32) g[d] = src[hd + d];
            }
        } else {
            const int kv = head - p.nh;
            const long long in_off = ((long long)t * p.kvh + kv) * hd;
            src = p.k + in_off;
            w = p.k_norm;
            for (int d = lane; d < hd; d += 32) p.v_cache[vt_index(kv, d, pos, hd, p.capacity)] = (uint16_t)bf16_bits(p.v[in_off + d]);
        }
        // RMSNorm: y = x · (1 / sqrt(mean(x²) + eps)) · w, rounded as (x · inv) · w like the CPU. The sum
        // of squares in attn_prep's order, bit for bit (a chunk's q and k equal its tokens' decode
        // steps'): a xor tree over each run of 32 elements, then one over the runs' sums (lane r holds
        // run r's, the other lanes zero).
        const int runs = (hd + 31) >> 5;
        float part = 0.0f;
        for (int r = 0; r < runs; ++r) {
            const int d = 32 * r + lane;
            const float x = d < hd ? src[d] : 0.0f;
            if (d < hd) row[d] = x;
            float v = x * x;
#pragma unroll
            for (int o = 16; o > 0; o >>= 1) v += __shfl_xor_sync(0xffffffffu, v, o);
            if (lane == r) part = v;
        }
        float ss = part;
#pragma unroll
        for (int o = 16; o > 0; o >>= 1) ss += __shfl_xor_sync(0xffffffffu, ss, o);
        const float inv = 1.0f / sqrtf(ss / (float)hd + p.eps);
        __syncwarp();
        for (int d = lane; d < hd; d += 32) row[d] = __fmul_rn(__fmul_rn(row[d], inv), w[d]);
    }
    for (int i = threadIdx.x; i < half; i += blockDim.x) rope_cs(p.theta, p.rot, i, pos, cs[i], sn[i]);
    __syncthreads();  // the table, and each warp's row
    if (!has) return;
    float* dst = is_q ? p.q_out + ((long long)t * p.nh + head) * hd : nullptr;
    uint16_t* kdst = is_q ? nullptr : p.k_cache + ((long long)pos * p.kvh + (head - p.nh)) * hd;
    for (int d = lane; d < hd; d += 32) {
        float out = row[d];
        if (d < p.rot) {
            const int i = d < half ? d : d - half;
            out = rope_rotate(d < half, row[i], row[i + half], cs[i], sn[i]);
        }
        if (is_q) {
            dst[d] = out;
        } else {
            kdst[d] = (uint16_t)bf16_bits(out);
        }
    }
}

extern "C" __global__ void __launch_bounds__(256) kv_copy_rows(const KvCopyParams p) { pdl_enter();
    const long long total = p.rows * p.len;
    for (long long i = blockIdx.x * (long long)blockDim.x + threadIdx.x; i < total; i += (long long)gridDim.x * blockDim.x) {
        const long long r = i / p.len, c = i - r * p.len;
        p.dst[r * p.dst_pitch + c] = p.src[r * p.src_pitch + c];
    }
}

// Decode attention (T_new = 1) over an f32 KV cache, the same maths as lily_cpu::attention::forward after
// RoPE: query head h reads KV head h / (nh/kvh); scores = (q·k)·scale over positions 0..n (the new token
// already appended), softmax in f32, o = Σ p·v. Layouts: q [nh, hd]; K and V caches [pos, kvh, hd]
// (position-major, as lily_cpu::attention::KvCache); out [nh, hd].
//
// Split-KV (flash-decoding), two launches:
//   attn_decode_split_d{HD}: grid (splits, kvh, ceil(G/8)), 4 warps. Block (s, kv, z) handles positions
//     [s·chunk, min(n, (s+1)·chunk)) of KV head kv for query heads kv·G + 8z .. +8 of its group (G = nh/kvh),
//     so each K/V row is read once for (up to 8 of) the group's heads. Warp w takes positions begin+w,
//     begin+w+4, ...; a lane holds HD/32 dims of each query and of each head's accumulator in registers
//     (float4 when HD/32 is a multiple of 4), the next row is loaded while the current one is used, and the
//     online softmax (running max m, sum l, acc) runs per warp. The 4 warps merge through shared memory and
//     the block writes one partial (m, l, acc[HD]) per (head, split) to the scratch.
//   attn_decode_combine: grid nh, HD threads: o = Σ_s e^(m_s−M)·acc_s / Σ_s e^(m_s−M)·l_s.
// Every split is non-empty (the host picks chunk and splits so), so every partial max is finite.

#include <stdint.h>

struct AttnDecodeParams {
    const float* q;   // [nh, hd]
    const float* k;   // [n, kvh, hd]
    const float* v;   // [n, kvh, hd]
    float* part_ml;   // [nh, splits, 2]  (m, l)
    float* part_acc;  // [nh, splits, hd]
    float* out;       // [nh, hd]
    const int* n_dev; // when not null, n is read from here and chunk/splits follow from it (CUDA-graph decode)
    int n;
    int nh;
    int kvh;
    int hd;
    int chunk;
    int splits;
    float scale;
    int pad_;
};

#define ATTN_WARPS 4
#define ATTN_MAXG 8
#define ATTN_MIN_CHUNK 32   // = ops::attention::MIN_CHUNK
#define ATTN_MAX_SPLITS 256 // = ops::attention::MAX_SPLITS

// n, chunk and splits of this call: the host's, or (n from the device) the same rule as
// ops::attention::splits_for, so every split is non-empty.
struct AttnSplit {
    int n, chunk, splits;
};
__device__ __forceinline__ AttnSplit attn_split_of(const AttnDecodeParams& p) {
    if (!p.n_dev) return AttnSplit{p.n, p.chunk, p.splits};
    const int n = *p.n_dev;
    const int target = max(1, min((n + ATTN_MIN_CHUNK - 1) / ATTN_MIN_CHUNK, ATTN_MAX_SPLITS));
    const int chunk = max(1, (n + target - 1) / target);
    return AttnSplit{n, chunk, max(1, (n + chunk - 1) / chunk)};
}

// Dim held in slot i of a lane (the same map for q, K, V and the accumulator).
template <int NPL>
__device__ __forceinline__ int attn_dim(int i, int lane) {
    if constexpr (NPL % 4 == 0) {
        return (i / 4) * 128 + lane * 4 + (i % 4);
    } else {
        return i * 32 + lane;
    }
}

template <int NPL>
__device__ __forceinline__ void attn_load(const float* __restrict__ row, int lane, float (&r)[NPL]) {
    if constexpr (NPL % 4 == 0) {
#pragma unroll
        for (int j = 0; j < NPL / 4; ++j) {
            const float4 x = __ldg(reinterpret_cast<const float4*>(row + j * 128 + lane * 4));
            r[4 * j] = x.x;
            r[4 * j + 1] = x.y;
            r[4 * j + 2] = x.z;
            r[4 * j + 3] = x.w;
        }
    } else {
#pragma unroll
        for (int i = 0; i < NPL; ++i) r[i] = __ldg(row + i * 32 + lane);
    }
}

template <int NPL>
__device__ __forceinline__ void attn_split(const AttnDecodeParams& p) {
    constexpr int HD = NPL * 32;
    __shared__ float red_acc[ATTN_WARPS][ATTN_MAXG][HD];
    __shared__ float red_m[ATTN_WARPS][ATTN_MAXG], red_l[ATTN_WARPS][ATTN_MAXG];
    const AttnSplit sp = attn_split_of(p);
    const int s = blockIdx.x, kv = blockIdx.y;
    if (s >= sp.splits) return;  // device n: the grid covers the most splits
    const int group = p.nh / p.kvh;
    const int g0 = blockIdx.z * ATTN_MAXG;
    const int ng = min(ATTN_MAXG, group - g0);
    const int h0 = kv * group + g0;
    const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31;
    const int begin = s * sp.chunk, end = min(sp.n, begin + sp.chunk);
    const long long stride = (long long)p.kvh * HD;
    const float* kb = p.k + (long long)kv * HD;
    const float* vb = p.v + (long long)kv * HD;

    float q[ATTN_MAXG][NPL], acc[ATTN_MAXG][NPL], m[ATTN_MAXG], l[ATTN_MAXG];
#pragma unroll
    for (int g = 0; g < ATTN_MAXG; ++g) {
        if (g < ng) {
            attn_load<NPL>(p.q + (long long)(h0 + g) * HD, lane, q[g]);
        } else {
#pragma unroll
            for (int i = 0; i < NPL; ++i) q[g][i] = 0.0f;
        }
        m[g] = -INFINITY;
        l[g] = 0.0f;
#pragma unroll
        for (int i = 0; i < NPL; ++i) acc[g][i] = 0.0f;
    }

    int pos = begin + warp;
    float kc[NPL], vc[NPL];
#pragma unroll
    for (int i = 0; i < NPL; ++i) kc[i] = vc[i] = 0.0f;
    if (pos < end) {
        attn_load<NPL>(kb + pos * stride, lane, kc);
        attn_load<NPL>(vb + pos * stride, lane, vc);
    }
    for (; pos < end; pos += ATTN_WARPS) {
        float kn[NPL], vn[NPL];
        const int nxt = pos + ATTN_WARPS;
        if (nxt < end) {
            attn_load<NPL>(kb + nxt * stride, lane, kn);
            attn_load<NPL>(vb + nxt * stride, lane, vn);
        } else {
#pragma unroll
            for (int i = 0; i < NPL; ++i) kn[i] = vn[i] = 0.0f;
        }
        float sc[ATTN_MAXG];
#pragma unroll
        for (int g = 0; g < ATTN_MAXG; ++g) {
            float d = 0.0f;
#pragma unroll
            for (int i = 0; i < NPL; ++i) d += q[g][i] * kc[i];
            sc[g] = d;
        }
#pragma unroll
        for (int o = 16; o > 0; o >>= 1) {
#pragma unroll
            for (int g = 0; g < ATTN_MAXG; ++g)
                if (g < ng) sc[g] += __shfl_xor_sync(0xffffffffu, sc[g], o);
        }
#pragma unroll
        for (int g = 0; g < ATTN_MAXG; ++g) {
            if (g < ng) {
                const float x = sc[g] * p.scale;
                const float mn = fmaxf(m[g], x);
                const float c = expf(m[g] - mn);  // m = -inf at the first position: c = 0
                const float e = expf(x - mn);
                l[g] = l[g] * c + e;
#pragma unroll
                for (int i = 0; i < NPL; ++i) acc[g][i] = acc[g][i] * c + e * vc[i];
                m[g] = mn;
            }
        }
#pragma unroll
        for (int i = 0; i < NPL; ++i) {
            kc[i] = kn[i];
            vc[i] = vn[i];
        }
    }

    // Merge the warps (a warp with no position has m = -inf, l = 0, acc = 0).
    if (lane == 0) {
#pragma unroll
        for (int g = 0; g < ATTN_MAXG; ++g) {
            red_m[warp][g] = m[g];
            red_l[warp][g] = l[g];
        }
    }
#pragma unroll
    for (int g = 0; g < ATTN_MAXG; ++g) {
        if (g < ng) {
#pragma unroll
            for (int i = 0; i < NPL; ++i) red_acc[warp][g][attn_dim<NPL>(i, lane)] = acc[g][i];
        }
    }
    __syncthreads();
    for (int e = threadIdx.x; e < ng * HD; e += blockDim.x) {
        const int g = e / HD, d = e % HD;
        float M = -INFINITY;
#pragma unroll
        for (int w = 0; w < ATTN_WARPS; ++w) M = fmaxf(M, red_m[w][g]);
        float L = 0.0f, a = 0.0f;
#pragma unroll
        for (int w = 0; w < ATTN_WARPS; ++w) {
            const float mw = red_m[w][g];
            const float f = mw == -INFINITY ? 0.0f : expf(mw - M);
            L += f * red_l[w][g];
            a += f * red_acc[w][g][d];
        }
        const long long idx = (long long)(h0 + g) * sp.splits + s;
        p.part_acc[idx * HD + d] = a;
        if (d == 0) {
            p.part_ml[2 * idx] = M;
            p.part_ml[2 * idx + 1] = L;
        }
    }
}

extern "C" __global__ void __launch_bounds__(128) attn_decode_split_d32(const AttnDecodeParams p) { attn_split<1>(p); }
extern "C" __global__ void __launch_bounds__(128) attn_decode_split_d64(const AttnDecodeParams p) { attn_split<2>(p); }
extern "C" __global__ void __launch_bounds__(128) attn_decode_split_d128(const AttnDecodeParams p) { attn_split<4>(p); }
extern "C" __global__ void __launch_bounds__(128) attn_decode_split_d256(const AttnDecodeParams p) { attn_split<8>(p); }

extern "C" __global__ void __launch_bounds__(256) attn_decode_combine(const AttnDecodeParams p) {
    const int h = blockIdx.x;
    const int splits = attn_split_of(p).splits;
    const float* ml = p.part_ml + (long long)h * splits * 2;
    const float* acc = p.part_acc + (long long)h * splits * p.hd;
    float M = -INFINITY;
    for (int s = 0; s < splits; ++s) M = fmaxf(M, ml[2 * s]);
    for (int d = threadIdx.x; d < p.hd; d += blockDim.x) {
        float L = 0.0f, a = 0.0f;
        for (int s = 0; s < splits; ++s) {
            const float f = expf(ml[2 * s] - M);
            L += f * ml[2 * s + 1];
            a += f * acc[(long long)s * p.hd + d];
        }
        p.out[(long long)h * p.hd + d] = a / L;
    }
}

// Decode attention (T_new = 1) over the bf16 KV cache, the maths of lily_cpu::attention::forward after
// RoPE: query head h reads KV head h / (nh/kvh); scores = (q·k)·scale over positions 0..n (the new
// token already appended), softmax in f32, o = Σ p·v, then (gated) o ← o · sigmoid(gate).
// Layouts: q, gate, out [nh, hd] f32; the K cache [cap, kvh, hd] bf16 (position-major); the V cache
// bf16 in tiles of 32 positions, each transposed ([kvh, cap/32, hd, 32]: kv_layout.cuh), so both
// operands of the two products load as tensor-core fragments without a transpose, and a stage's V is
// one contiguous 16 KB read.
//
// Split-KV (flash-decoding), two launches:
//   attn_decode_d{HD}: grid (max_splits, kvh, ceil(G/8)), NW warps. Block (s, kv, z) takes stages of 32
//     positions [s·per·32, ...) of KV head kv for query heads kv·G + 8z .. +8 (G = nh/kvh), through a
//     cp.async ring of NS stages in shared memory (K [32][hd], Vᵀ [hd][32]; positions ≥ n zero-filled):
//     NS = 2, or 3 in attn_decode_d{128,256}_s3 (two stages in flight: more bytes in flight per SM at
//     long contexts, where the kernel streams the cache).
//     Tensor cores, near-f32: q is split into bf16 hi + lo, which fill the 16 rows of the MMA's A
//     (rows 0-7 hi of the 8 heads, rows 8-15 lo), so S = Q·Kᵀ comes out as row g + row g+8 of one
//     m16n8k16 product; p = e^(s-m) is split the same way and O += V·p runs as two MMAs (hi, lo) with the
//     accumulator Oᵀ [dims × heads] (M = 16 dims, N = 8 heads). K and V are exact bf16; so the only
//     rounding beyond f32's is what the split leaves (below 2^-16 relative). Every warp computes S for
//     the stage's 32 positions (cheap on tensor cores) and the online softmax, and owns HD/NW dims of O.
//     Position map: lane (g, t) of an S tile i holds positions 8t + 2i + {0,1}, which is the order a
//     16-byte load of Vᵀ (8 positions) needs for the second product.
//     The block writes one partial (m, l, acc[HD]) per (head, split).
//   attn_decode_combine: grid (nh, ceil(HD/64)), 256 threads: o = Σ_s e^(m_s−M)·acc_s / Σ_s e^(m_s−M)·l_s,
//     then the gate.
// Splits (the host's ops::attention::splits_for, or on the device when n is read there): stages =
// ceil(n/32), per = ceil(stages / min(stages, max_splits)), splits = ceil(stages / per); every split is
// non-empty, so every partial max is finite.

#include "mma.cuh"
#include "pdl.cuh"
#include "reduce.cuh"
#include "kv_layout.cuh"

struct AttnDecodeParams {
    const float* q;        // [nh, hd]
    const uint16_t* k;     // [cap, kvh, hd] bf16
    const uint16_t* vt;    // bf16 in tiles of 32 positions, [kvh, cap/32, hd, 32] (kv_layout.cuh)
    const float* gate;     // [nh, hd], or null
    float* part_ml;        // [nh, max_splits, 2]  (m, l)
    float* part_acc;       // [nh, max_splits, hd]
    float* out;            // [nh, hd]
    const int* n_dev;      // when not null, n is read from here (CUDA-graph decode)
    int n;
    int nh;
    int kvh;
    int cap;
    int max_splits;
    float scale;
    int hd;
    int pad_;
};

#define AD_STAGE 32  // positions per pipeline stage (= ops::attention::STAGE; one V tile, KV_TILE)
static_assert(AD_STAGE == KV_TILE, "a stage is one V tile of the cache");

struct AdSplit {
    int n, stages, per, splits;
};
__device__ __forceinline__ AdSplit ad_split(const AttnDecodeParams& p) {
    const int n = p.n_dev ? *p.n_dev : p.n;
    const int stages = (n + AD_STAGE - 1) / AD_STAGE;
    const int want = max(1, min(stages, p.max_splits));
    const int per = (stages + want - 1) / want;
    return AdSplit{n, stages, per, (stages + per - 1) / per};
}

template <int HD, int NW, int NS>
__device__ __forceinline__ void attn_decode(const AttnDecodeParams& p) {
    constexpr int MTW = HD / 16 / NW;  // m-tiles (16 dims) of O per warp
    static_assert(MTW >= 1 && MTW * NW * 16 == HD, "dims split over warps");
    constexpr int KP = HD * 2 + (((HD / 2) % 32) == 0 ? 64 : 0);  // K row pitch in shared memory (bytes)
    constexpr int VP = AD_STAGE * 2;                             // Vᵀ row pitch (bytes)
    constexpr int KSTAGE = AD_STAGE * KP, VSTAGE = HD * VP;
    constexpr int THREADS = NW * 32;
    extern __shared__ __align__(16) unsigned char smem[];
    const uint32_t sbase = smem_addr(smem);

    const AdSplit sp = ad_split(p);
    const int s = blockIdx.x;
    if (s >= sp.splits) {  // n from the device: the grid covers max_splits
        pdl_enter();  // every block waits (pdl.cuh)
        return;
    }
    const int kv = blockIdx.y;
    const int group = p.nh / p.kvh;
    const int g0 = blockIdx.z * 8;
    const int ng = min(8, group - g0);
    const int h0 = kv * group + g0;
    const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31, g = lane >> 2, t = lane & 3;
    const int st_begin = s * sp.per, st_end = min(sp.stages, st_begin + sp.per);
    const int n = sp.n;

    auto issue = [&](int st, int buf) {
        const int base = st * AD_STAGE;
        const uint32_t ks = sbase + buf * (KSTAGE + VSTAGE), vs = ks + KSTAGE;
        constexpr int KCH = HD / 8;  // 16-byte chunks per K row
        for (int c = threadIdx.x; c < AD_STAGE * KCH; c += THREADS) {
            const int r = c / KCH, ch = c % KCH;
            const int pos = base + r;
            const bool ok = pos < n;
            const uint16_t* src = ok ? p.k + ((long long)pos * p.kvh + kv) * HD + ch * 8 : p.k;
            cp_async16z(ks + r * KP + ch * 16, src, ok ? 16 : 0);
        }
        // The stage's V tile [HD][32] is one contiguous run in the cache (kv_layout.cuh): chunk c of it
        // (dim c / 4, positions 8(c % 4) ..) to the same place in shared memory.
        const uint16_t* vtile = p.vt + vt_index(kv, 0, base, HD, p.cap);
        for (int c = threadIdx.x; c < HD * 4; c += THREADS) {
            const int d = c >> 2, ch = c & 3;
            const int valid = min(max(n - (base + ch * 8), 0), 8);
            cp_async16z(vs + d * VP + ch * 16, valid > 0 ? vtile + 8 * c : p.vt, valid * 2);
        }
    };

    float m = -INFINITY, l = 0.0f;
    float o[MTW][4];
#pragma unroll
    for (int i = 0; i < MTW; ++i) o[i][0] = o[i][1] = o[i][2] = o[i][3] = 0.0f;

    // The ring: NS - 1 stages in flight while one is computed. buf is this stage's buffer; the one
    // refilled now is the previous stage's (its reads ended at the barrier closing that stage).
    auto prev = [](int b) { return NS == 2 ? b ^ 1 : (b == 0 ? NS - 1 : b - 1); };
    auto next = [](int b) { return NS == 2 ? b ^ 1 : (b + 1 == NS ? 0 : b + 1); };
    auto prologue = [&]() {
        issue(st_begin, 0);  // every split has a stage
        cp_async_commit_group();
#pragma unroll
        for (int i = 1; i < NS - 1; ++i) {
            if (st_begin + i < st_end) issue(st_begin + i, i);
            cp_async_commit_group();
        }
    };
    // The prologue's stages are copied before the PDL wait (pdl.cuh) when none of them holds the
    // newest position, the one this kernel's predecessor (the attention prep) appends: every other
    // position was written by earlier steps. (n is the host's, uploaded before the step.)
    const bool early = min(st_begin + NS - 2, st_end - 1) < sp.stages - 1;
    if (early) prologue();
    pdl_enter();

    // q fragments: lane (g, t) holds head g's dims 32u + 8t .. +8 as hi/lo bf16 (k-steps 2u and 2u+1).
    uint32_t qa[HD / 32][2][4];
    {
        const bool live = g < ng;
        const float* qr = p.q + (long long)(h0 + (live ? g : 0)) * HD;
#pragma unroll
        for (int u = 0; u < HD / 32; ++u) {
            float4 x0 = make_float4(0.f, 0.f, 0.f, 0.f), x1 = x0;
            if (live) {
                // q is the predecessor's output: L2 loads, not the non-coherent path (pdl.cuh).
                x0 = __ldcg(reinterpret_cast<const float4*>(qr + 32 * u + 8 * t));
                x1 = __ldcg(reinterpret_cast<const float4*>(qr + 32 * u + 8 * t + 4));
            }
            split_bf16(x0.x, x0.y, qa[u][0][0], qa[u][0][1]);
            split_bf16(x0.z, x0.w, qa[u][0][2], qa[u][0][3]);
            split_bf16(x1.x, x1.y, qa[u][1][0], qa[u][1][1]);
            split_bf16(x1.z, x1.w, qa[u][1][2], qa[u][1][3]);
        }
    }

    if (!early) prologue();
    int buf = 0;
    for (int st = st_begin; st < st_end; ++st) {
        if (st + NS - 1 < st_end) issue(st + NS - 1, prev(buf));
        cp_async_commit_group();
        cp_async_wait_group<NS - 1>();
        __syncthreads();
        const uint32_t ks = sbase + buf * (KSTAGE + VSTAGE), vs = ks + KSTAGE;
        const int base = st * AD_STAGE;

        // S: 4 tiles of 8 positions. Tile i, column n = lane g's K row 8(g/2) + (g%2) + 2i.
        float sc[4][4];
#pragma unroll
        for (int i = 0; i < 4; ++i) sc[i][0] = sc[i][1] = sc[i][2] = sc[i][3] = 0.0f;
        const int krow0 = 8 * (g >> 1) + (g & 1);
#pragma unroll
        for (int u = 0; u < HD / 32; ++u) {
#pragma unroll
            for (int i = 0; i < 4; ++i) {
                const uint4 kb = lds128(ks + (krow0 + 2 * i) * KP + u * 64 + t * 16);
                mma_bf16(sc[i], qa[u][0][0], qa[u][0][1], qa[u][0][2], qa[u][0][3], kb.x, kb.y);
                mma_bf16(sc[i], qa[u][1][0], qa[u][1][1], qa[u][1][2], qa[u][1][3], kb.z, kb.w);
            }
        }
        // Lane (g, t): head g, positions base + 8t + 2i + e; rows g (hi) and g + 8 (lo) add up.
        float x[4][2];
        float mx = -INFINITY;
#pragma unroll
        for (int i = 0; i < 4; ++i) {
#pragma unroll
            for (int e = 0; e < 2; ++e) {
                const int pos = base + 8 * t + 2 * i + e;
                const float v = (sc[i][e] + sc[i][2 + e]) * p.scale;
                x[i][e] = pos < n ? v : -INFINITY;
                mx = fmaxf(mx, x[i][e]);
            }
        }
        mx = fmaxf(mx, __shfl_xor_sync(0xffffffffu, mx, 1));
        mx = fmaxf(mx, __shfl_xor_sync(0xffffffffu, mx, 2));
        const float mn = fmaxf(m, mx);  // finite: every stage holds a position < n
        const float alpha = expf(m - mn);  // m = -inf at the first stage: 0
        float pr[4][2];
        float psum = 0.0f;
#pragma unroll
        for (int i = 0; i < 4; ++i)
#pragma unroll
            for (int e = 0; e < 2; ++e) {
                pr[i][e] = expf(x[i][e] - mn);
                psum += pr[i][e];
            }
        l = l * alpha + psum;
        m = mn;
        // p as the second product's B (k = positions, col = head g), hi and lo: k-step ks covers tiles 2ks, 2ks+1.
        uint32_t ph[2][2], pl[2][2];
#pragma unroll
        for (int k2 = 0; k2 < 2; ++k2) {
            split_bf16(pr[2 * k2][0], pr[2 * k2][1], ph[k2][0], pl[k2][0]);
            split_bf16(pr[2 * k2 + 1][0], pr[2 * k2 + 1][1], ph[k2][1], pl[k2][1]);
        }
        // Oᵀ columns are heads 2t, 2t+1: their rescale factors live in lanes 8t and 8t + 4.
        const float a0 = __shfl_sync(0xffffffffu, alpha, 8 * t), a1 = __shfl_sync(0xffffffffu, alpha, 8 * t + 4);
#pragma unroll
        for (int mt = 0; mt < MTW; ++mt) {
            o[mt][0] *= a0;
            o[mt][1] *= a1;
            o[mt][2] *= a0;
            o[mt][3] *= a1;
            const int d0 = (warp * MTW + mt) * 16;
            const uint4 va = lds128(vs + (d0 + g) * VP + t * 16);      // dim d0+g, positions 8t..8t+7
            const uint4 vb = lds128(vs + (d0 + g + 8) * VP + t * 16);  // dim d0+g+8
            mma_bf16(o[mt], va.x, vb.x, va.y, vb.y, ph[0][0], ph[0][1]);
            mma_bf16(o[mt], va.x, vb.x, va.y, vb.y, pl[0][0], pl[0][1]);
            mma_bf16(o[mt], va.z, vb.z, va.w, vb.w, ph[1][0], ph[1][1]);
            mma_bf16(o[mt], va.z, vb.z, va.w, vb.w, pl[1][0], pl[1][1]);
        }
        __syncthreads();  // this buffer is refilled next iteration
        buf = next(buf);
    }
    cp_async_wait_group<0>();

    l += __shfl_xor_sync(0xffffffffu, l, 1);
    l += __shfl_xor_sync(0xffffffffu, l, 2);
    if (warp == 0 && t == 0 && g < ng) {
        const long long idx = (long long)(h0 + g) * p.max_splits + s;
        p.part_ml[2 * idx] = m;
        p.part_ml[2 * idx + 1] = l;
    }
#pragma unroll
    for (int mt = 0; mt < MTW; ++mt) {
        const int d = (warp * MTW + mt) * 16 + g;
#pragma unroll
        for (int e = 0; e < 2; ++e) {
            const int hh = 2 * t + e;
            if (hh < ng) {
                float* acc = p.part_acc + ((long long)(h0 + hh) * p.max_splits + s) * HD;
                acc[d] = o[mt][e];
                acc[d + 8] = o[mt][2 + e];
            }
        }
    }
}

#define AD_ENTRY(name, HD, NW, NS)                                                                            \
    extern "C" __global__ void __launch_bounds__(NW * 32) name(const AttnDecodeParams p) { /* waits inside */ \
        attn_decode<HD, NW, NS>(p);                                                                           \
    }
AD_ENTRY(attn_decode_d32, 32, 2, 2)
AD_ENTRY(attn_decode_d64, 64, 4, 2)
AD_ENTRY(attn_decode_d128, 128, 4, 2)
AD_ENTRY(attn_decode_d256, 256, 4, 2)
// Three-stage rings (two stages in flight), opt-in: ops::attention::Ring.
AD_ENTRY(attn_decode_d128_s3, 128, 4, 3)
AD_ENTRY(attn_decode_d256_s3, 256, 4, 3)

// Block (h, dims 64y..64y+64), 256 threads: the split weights e^(m_s−M) once in shared memory, then
// 4 groups of 64 threads sum over splits s ≡ group (mod 4) for one dim each.
extern "C" __global__ void __launch_bounds__(256) attn_decode_combine(const AttnDecodeParams p) { pdl_enter();
    __shared__ float wsh[256];  // >= MAX_SPLITS
    __shared__ float red[4][64];
    __shared__ float wred[8];
    const int h = blockIdx.x, hd = p.hd, tid = threadIdx.x, lane = tid & 31, warp = tid >> 5;
    const int splits = ad_split(p).splits;
    const float* ml = p.part_ml + (long long)h * p.max_splits * 2;
    const float* acc = p.part_acc + (long long)h * p.max_splits * hd;
    const float ms = tid < splits ? ml[2 * tid] : -INFINITY;
    float M = block_max<8>(ms, wred);
    const float f = tid < splits ? expf(ms - M) : 0.0f;
    wsh[tid] = f;
    float L = tid < splits ? f * ml[2 * tid + 1] : 0.0f;
#pragma unroll
    for (int o = 16; o > 0; o >>= 1) L += __shfl_xor_sync(0xffffffffu, L, o);
    __syncthreads();  // wred[] read above before it is rewritten
    if (lane == 0) wred[warp] = L;
    __syncthreads();
    L = 0.0f;
#pragma unroll
    for (int w = 0; w < 8; ++w) L += wred[w];
    const int d = blockIdx.y * 64 + (tid & 63), grp = tid >> 6;
    float a = 0.0f;
    if (d < hd) {
#pragma unroll 4
        for (int s = grp; s < splits; s += 4) a += wsh[s] * acc[(long long)s * hd + d];
    }
    red[grp][tid & 63] = a;
    __syncthreads();
    if (grp == 0 && d < hd) {
        float y = ((red[0][tid] + red[1][tid]) + (red[2][tid] + red[3][tid])) / L;
        if (p.gate) {
            const float gt = p.gate[(long long)h * hd + d];
            y = y * (1.0f / (1.0f + expf(-gt)));
        }
        p.out[(long long)h * hd + d] = y;
    }
}

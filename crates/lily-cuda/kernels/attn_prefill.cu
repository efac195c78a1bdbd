// Causal prefill attention over an f32 KV cache (flash-attention style, f32 SIMT), the softmax part of
// lily_cpu::attention::forward for T new tokens at positions pos0..pos0+T whose K/V are already in the
// cache: query (t, h) attends to positions 0..=pos0+t of KV head h / G (G = nh / kvh), scores
// (q·k)·scale, softmax in f32, o = Σ p·v; with a gate, o ← o · sigmoid(gate).
// Layouts: q, gate, out [T, nh, hd]; K and V caches [capacity, kvh, hd] (position-major).
//
// attn_prefill_d{HD}: one block of 256 threads (8 warps) per (tile of 64 query rows, KV head), where the
// rows of KV head kv are the T·G pairs (token t, head kv·G + g) in the order r = t·G + g, so a tile holds
// 64/G tokens × all G heads of the group and every K/V tile brought into shared memory serves all of them.
// Blocks run heaviest tile (latest tokens) first. Per block: the Q tile [64, HD] is loaded once; then for
// each KV tile of 64 positions 0..kv_end (kv_end = pos0 + last token of the tile + 1):
//   1. S = Q·Kᵀ·scale (warp tile 32×16, thread tile 4 rows × 4 positions, float4 along hd), masked to
//      −inf where position > the row's query position, stored to shared memory;
//   2. online softmax: warp w owns rows 8w..8w+8 (running max m, per-lane partial sums l), P = e^(S−m)
//      written back in place, the accumulator rows rescaled;
//   3. O += P·V: a lane holds 8 rows × HD/32 dims of O in registers (the dim map of kernels/attention.cu).
// K and V tiles are fetched with cp.async, zero-filled past kv_end: the next K tile streams in during the
// softmax and P·V, the next V tile during Q·Kᵀ. Position 0 is never masked, so each row's running max is
// finite from the first tile on. Rows past T·G (a partial last tile) compute on q = 0 and are not stored.
// Shared memory: Q [64][HD+4], K [64][HD+4], V [64][HD], S [64][68] floats (211 KiB at HD 256: the
// wrapper's configure() raises the dynamic shared memory limit).

#include <stdint.h>

struct AttnPrefillParams {
    const float* q;     // [T, nh, hd]
    const float* k;     // [capacity, kvh, hd]
    const float* v;     // [capacity, kvh, hd]
    const float* gate;  // [T, nh, hd] or null
    float* out;         // [T, nh, hd]
    int t;
    int nh;
    int kvh;
    int pos0;
    int ntiles;  // ceil(T·G / 64)
    float scale;
};

#define PF_BR 64
#define PF_BK 64
#define PF_THREADS 256
#define PF_SST (PF_BK + 4)

__device__ __forceinline__ void pf_cp_async16(float* dst, const float* src, bool ok) {
    const unsigned s = (unsigned)__cvta_generic_to_shared(dst);
    const int n = ok ? 16 : 0;  // 0: nothing is read, the 16 bytes are zero-filled
    asm volatile("cp.async.cg.shared.global [%0], [%1], 16, %2;\n" ::"r"(s), "l"(src), "r"(n) : "memory");
}
__device__ __forceinline__ void pf_commit() { asm volatile("cp.async.commit_group;\n" ::: "memory"); }
template <int N>
__device__ __forceinline__ void pf_wait() {
    asm volatile("cp.async.wait_group %0;\n" ::"n"(N) : "memory");
}

// Rows [j·BK, j·BK + BK) of one KV head's cache into dst[BK][st]; positions ≥ kv_end become zeros.
template <int HD>
__device__ __forceinline__ void pf_load_kv(float* dst, int st, const float* base, long long stride, int j, int kv_end) {
    constexpr int C4 = HD / 4;
    for (int c = threadIdx.x; c < PF_BK * C4; c += PF_THREADS) {
        const int r = c / C4, c4 = c % C4;
        const int pos = j * PF_BK + r;
        const bool ok = pos < kv_end;
        pf_cp_async16(dst + r * st + c4 * 4, ok ? base + (long long)pos * stride + c4 * 4 : base, ok);
    }
}

__device__ __forceinline__ float pf_comp(const float4& v, int i) { return i == 0 ? v.x : i == 1 ? v.y : i == 2 ? v.z : v.w; }

template <int HD>
__device__ __forceinline__ void attn_prefill(const AttnPrefillParams& p) {
    constexpr int NPL = HD / 32;
    constexpr int QST = HD + 4, KST = HD + 4, VST = HD;
    static_assert(PF_BK == 64 && PF_BR == 64 && PF_THREADS == 256, "the thread maps below assume these");
    extern __shared__ __align__(16) float smem[];
    float* Qs = smem;
    float* Ks = Qs + PF_BR * QST;
    float* Vs = Ks + PF_BK * KST;
    float* Ss = Vs + PF_BK * VST;

    const int kv = blockIdx.x % p.kvh;
    const int tile = p.ntiles - 1 - (int)(blockIdx.x / p.kvh);  // heaviest first
    const int G = p.nh / p.kvh;
    const int nrows = p.t * G;
    const int r0 = tile * PF_BR;
    const int rend = min(nrows, r0 + PF_BR);
    const int kv_end = p.pos0 + (rend - 1) / G + 1;
    const int ntile_kv = (kv_end + PF_BK - 1) / PF_BK;
    const long long stride = (long long)p.kvh * HD;
    const float* kbase = p.k + (long long)kv * HD;
    const float* vbase = p.v + (long long)kv * HD;

    // Q tile (group 1), K tile 0 (group 2), V tile 0 (group 3).
    for (int c = threadIdx.x; c < PF_BR * (HD / 4); c += PF_THREADS) {
        const int r = c / (HD / 4), c4 = c % (HD / 4);
        const int gr = r0 + r;
        const bool ok = gr < nrows;
        const float* src = p.q;
        if (ok) src = p.q + ((long long)(gr / G) * p.nh + kv * G + gr % G) * HD + c4 * 4;
        pf_cp_async16(Qs + r * QST + c4 * 4, src, ok);
    }
    pf_commit();
    pf_load_kv<HD>(Ks, KST, kbase, stride, 0, kv_end);
    pf_commit();
    pf_load_kv<HD>(Vs, VST, vbase, stride, 0, kv_end);
    pf_commit();

    const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31;
    // Q·Kᵀ map: warp (wr, wc) of a 2×4 grid, lane (lr, lc) of 8×4; rows wr·32 + lr + 8i, columns wc·16 + lc + 4j.
    const int wr = warp >> 2, wc = warp & 3, lr = lane & 7, lc = lane >> 3;
    int qpos[4];
#pragma unroll
    for (int i = 0; i < 4; ++i) {
        const int gr = r0 + wr * 32 + lr + 8 * i;
        qpos[i] = gr < nrows ? p.pos0 + gr / G : kv_end - 1;
    }
    // Softmax and P·V map: warp w owns rows 8w..8w+8.
    float m[8], l[8], acc[8][NPL];
#pragma unroll
    for (int rr = 0; rr < 8; ++rr) {
        m[rr] = -INFINITY;
        l[rr] = 0.0f;
#pragma unroll
        for (int i = 0; i < NPL; ++i) acc[rr][i] = 0.0f;
    }

    for (int j = 0; j < ntile_kv; ++j) {
        pf_wait<1>();  // everything but the latest group (V_j): Q and K_j are here
        __syncthreads();

        // 1. S = Q·Kᵀ · scale, masked.
        float s[4][4];
#pragma unroll
        for (int i = 0; i < 4; ++i)
#pragma unroll
            for (int jj = 0; jj < 4; ++jj) s[i][jj] = 0.0f;
        const float* qrow = Qs + (wr * 32 + lr) * QST;
        const float* krow = Ks + (wc * 16 + lc) * KST;
#pragma unroll 2
        for (int k = 0; k < HD; k += 4) {
            float4 a[4], b[4];
#pragma unroll
            for (int i = 0; i < 4; ++i) a[i] = *reinterpret_cast<const float4*>(qrow + 8 * i * QST + k);
#pragma unroll
            for (int jj = 0; jj < 4; ++jj) b[jj] = *reinterpret_cast<const float4*>(krow + 4 * jj * KST + k);
#pragma unroll
            for (int i = 0; i < 4; ++i) {
#pragma unroll
                for (int jj = 0; jj < 4; ++jj) {
                    float x = s[i][jj];
                    x = fmaf(a[i].x, b[jj].x, x);
                    x = fmaf(a[i].y, b[jj].y, x);
                    x = fmaf(a[i].z, b[jj].z, x);
                    x = fmaf(a[i].w, b[jj].w, x);
                    s[i][jj] = x;
                }
            }
        }
        const int kv0 = j * PF_BK;
#pragma unroll
        for (int i = 0; i < 4; ++i) {
#pragma unroll
            for (int jj = 0; jj < 4; ++jj) {
                const int c = wc * 16 + lc + 4 * jj;
                Ss[(wr * 32 + lr + 8 * i) * PF_SST + c] = kv0 + c > qpos[i] ? -INFINITY : s[i][jj] * p.scale;
            }
        }
        __syncthreads();  // S complete; K_j no longer read
        if (j + 1 < ntile_kv) pf_load_kv<HD>(Ks, KST, kbase, stride, j + 1, kv_end);
        pf_commit();

        // 2. Online softmax over this warp's rows.
#pragma unroll
        for (int rr = 0; rr < 8; ++rr) {
            float* srow = Ss + (warp * 8 + rr) * PF_SST;
            const float x0 = srow[lane], x1 = srow[lane + 32];
            float mx = fmaxf(x0, x1);
#pragma unroll
            for (int o = 16; o > 0; o >>= 1) mx = fmaxf(mx, __shfl_xor_sync(0xffffffffu, mx, o));
            const float mn = fmaxf(m[rr], mx);  // finite: position 0 is in tile 0 and never masked
            const float c = expf(m[rr] - mn);   // m = −inf at the first tile: c = 0
            const float p0 = expf(x0 - mn), p1 = expf(x1 - mn);
            srow[lane] = p0;
            srow[lane + 32] = p1;
            l[rr] = l[rr] * c + (p0 + p1);
            m[rr] = mn;
#pragma unroll
            for (int i = 0; i < NPL; ++i) acc[rr][i] *= c;
        }
        pf_wait<1>();  // everything but K_{j+1}: V_j is here
        __syncthreads();

        // 3. O += P·V.
        const float* prow = Ss + warp * 8 * PF_SST;
#pragma unroll 1
        for (int k = 0; k < PF_BK; k += 4) {
            float4 pr[8];
#pragma unroll
            for (int rr = 0; rr < 8; ++rr) pr[rr] = *reinterpret_cast<const float4*>(prow + rr * PF_SST + k);
#pragma unroll
            for (int kk = 0; kk < 4; ++kk) {
                const float* vrow = Vs + (k + kk) * VST;
                float vv[NPL];
                if constexpr (NPL % 4 == 0) {
#pragma unroll
                    for (int q4 = 0; q4 < NPL / 4; ++q4) {
                        const float4 x = *reinterpret_cast<const float4*>(vrow + q4 * 128 + lane * 4);
                        vv[4 * q4] = x.x;
                        vv[4 * q4 + 1] = x.y;
                        vv[4 * q4 + 2] = x.z;
                        vv[4 * q4 + 3] = x.w;
                    }
                } else {
#pragma unroll
                    for (int i = 0; i < NPL; ++i) vv[i] = vrow[i * 32 + lane];
                }
#pragma unroll
                for (int rr = 0; rr < 8; ++rr) {
                    const float pk = pf_comp(pr[rr], kk);
#pragma unroll
                    for (int i = 0; i < NPL; ++i) acc[rr][i] = fmaf(pk, vv[i], acc[rr][i]);
                }
            }
        }
        __syncthreads();  // P and V_j no longer read
        if (j + 1 < ntile_kv) pf_load_kv<HD>(Vs, VST, vbase, stride, j + 1, kv_end);
        pf_commit();
    }
    pf_wait<0>();

    // o = acc / l (· sigmoid(gate)), this warp's valid rows.
#pragma unroll
    for (int rr = 0; rr < 8; ++rr) {
        float L = l[rr];
#pragma unroll
        for (int o = 16; o > 0; o >>= 1) L += __shfl_xor_sync(0xffffffffu, L, o);
        const int gr = r0 + warp * 8 + rr;
        if (gr >= nrows) continue;
        const long long off = ((long long)(gr / G) * p.nh + kv * G + gr % G) * HD;
        if constexpr (NPL % 4 == 0) {
#pragma unroll
            for (int q4 = 0; q4 < NPL / 4; ++q4) {
                const int d = q4 * 128 + lane * 4;
                float4 o = make_float4(acc[rr][4 * q4] / L, acc[rr][4 * q4 + 1] / L, acc[rr][4 * q4 + 2] / L,
                                       acc[rr][4 * q4 + 3] / L);
                if (p.gate) {
                    const float4 g = *reinterpret_cast<const float4*>(p.gate + off + d);
                    o.x = o.x * (1.0f / (1.0f + expf(-g.x)));
                    o.y = o.y * (1.0f / (1.0f + expf(-g.y)));
                    o.z = o.z * (1.0f / (1.0f + expf(-g.z)));
                    o.w = o.w * (1.0f / (1.0f + expf(-g.w)));
                }
                *reinterpret_cast<float4*>(p.out + off + d) = o;
            }
        } else {
#pragma unroll
            for (int i = 0; i < NPL; ++i) {
                const int d = i * 32 + lane;
                float o = acc[rr][i] / L;
                if (p.gate) o = o * (1.0f / (1.0f + expf(-p.gate[off + d])));
                p.out[off + d] = o;
            }
        }
    }
}

extern "C" __global__ void __launch_bounds__(PF_THREADS, 1) attn_prefill_d32(const AttnPrefillParams p) { attn_prefill<32>(p); }
extern "C" __global__ void __launch_bounds__(PF_THREADS, 1) attn_prefill_d64(const AttnPrefillParams p) { attn_prefill<64>(p); }
extern "C" __global__ void __launch_bounds__(PF_THREADS, 1) attn_prefill_d128(const AttnPrefillParams p) { attn_prefill<128>(p); }
extern "C" __global__ void __launch_bounds__(PF_THREADS, 1) attn_prefill_d256(const AttnPrefillParams p) { attn_prefill<256>(p); }

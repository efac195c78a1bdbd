// MoE dispatch and combine on the device, around the grouped expert GEMM (nothing comes back to the host).
//
// Plan: from the router's choice idx [T, k] (n = T*k slots, flat i = t*k + j) build
//   offsets [E+1]  (expert e owns sorted slots offsets[e] .. offsets[e+1]),
//   rows    [n]    (the token each sorted slot reads),
//   slot_of [n]    (the sorted slot of flat slot i: rows[slot_of[i]] == i / k).
// The order is stable: within an expert's range the slots ascend in i (token, then j), so the plan
// is deterministic. Three launches, all sharing MoePlanParams:
//   moe_plan_rank    one block per CHUNK slots: for each slot, its rank among the earlier slots of the
//                    chunk with the same expert (warp __match_any_sync + per-warp counts in shared
//                    memory, processed in rounds of 256 slots) -> slot_of[i] (temporarily); the chunk's
//                    per-expert counts -> hist[b][e].
//   moe_plan_scan    one block, one thread per expert: hist[b][e] -> exclusive prefix over the chunks
//                    b (in place), then an exclusive scan over the experts -> offsets.
//   moe_plan_scatter one thread per slot: slot = offsets[e] + hist[b][e] + rank; rows, slot_of.
// Entries of idx that are >= E take no slot (slot_of = 0xFFFFFFFF; then offsets[E] < n).
//
// Combine: out[t, :] = sum over the k terms of token t, in ascending expert id (ties by j), of
// w[t,j] * y[slot(t,j), :], then + sigmoid(gate_logit[t]) * shared[t, :], each product and sum rounded
// separately in f32 (no FMA), starting from 0: the order and rounding of lily_cpu::moe::forward; with
// `accumulate` the result is then added to out (the residual stream: x += moe(x) as the CPU does). The
// sigmoid is 1 / (1 + expf(-x)) with glibc's expf (the x86-64 FMA build, as Rust's f32::exp calls it)
// ported op for op in double precision; checked equal to glibc 2.36's on all 2^32 inputs.
// Entry points moe_combine_f32 (scalar) and moe_combine_f32_v4 (float4; h % 4 == 0, 16-byte aligned);
// moe_combine_bf16 and moe_combine_bf16_v4 read the expert outputs y as bf16 (each widened to f32
// exactly, then the same sums; the v4 form reads 8-byte groups: y 8-byte aligned).
// Combine with the next RMSNorm (a prompt chunk's MoE block, then the next layer's input norm or the
// final norm): moe_combine_norm_{f32, bf16}{, _v4}, one block a token of ceil(h / V / 32) warps (at most
// 32; rmsnorm.cu's launch), each thread its vectors c = tid, tid + blockDim, ...: out[t] += the sum as
// above (accumulate), then normed[t] = out[t] · (1 / sqrt(mean(out[t]²) + eps)) · norm_w, the squares
// summed and the product formed as rmsnorm.cu's kernel does for the same launch: bit for bit the
// combine into a buffer followed by rmsnorm's residual add and norm. moe_combine_norm_{f32,
// bf16}_v4_stage: the normed rows written only as the next GEMM's staged x (the half numerics,
// stage_half.cuh: the row in shared memory, its largest |value| setting its scale, 16-byte chunks of
// the f16 plane into `normed`, the scales into `scales`): the same bits as the norm then the stager.

#include <stdint.h>
#include "pdl.cuh"
#include "bf16.cuh"
#include "reduce.cuh"
#include "rms_vec.cuh"
#include "stage_half.cuh"

constexpr int PLAN_THREADS = 256;
constexpr int PLAN_WARPS = PLAN_THREADS / 32;
constexpr int CHUNK = 1024;  // slots per moe_plan_rank block (a multiple of PLAN_THREADS)
constexpr int MAX_E = 512;   // one moe_plan_scan thread per expert
constexpr int MAX_K = 32;
constexpr uint32_t NO_SLOT = 0xFFFFFFFFu;

struct MoePlanParams {
    const uint32_t* idx;  // [n]
    uint32_t* hist;       // [nb, e] scratch
    uint32_t* offsets;    // [e + 1]
    uint32_t* rows;       // [n]
    uint32_t* slot_of;    // [n]
    int n;                // T * k
    int e;
    int k;
    int nb;  // ceil(n / CHUNK)
};

extern "C" __global__ void __launch_bounds__(PLAN_THREADS) moe_plan_rank(const MoePlanParams p) { pdl_enter();
    __shared__ uint32_t wc[PLAN_WARPS][MAX_E];  // this round's count per warp and expert (0 between rounds)
    __shared__ uint32_t run[MAX_E];             // this chunk's count per expert so far
    const int tid = threadIdx.x, lane = tid & 31, warp = tid >> 5;
    const uint32_t ne = (uint32_t)p.e;
    for (int i = tid; i < PLAN_WARPS * MAX_E; i += PLAN_THREADS) (&wc[0][0])[i] = 0;
    for (int i = tid; i < MAX_E; i += PLAN_THREADS) run[i] = 0;
    __syncthreads();

    const int base = blockIdx.x * CHUNK;
    const uint32_t lanes_below = (1u << lane) - 1u;
    for (int r = 0; r < CHUNK && base + r < p.n; r += PLAN_THREADS) {  // uniform over the block
        const int i = base + r + tid;
        const bool in = i < p.n;
        const uint32_t e = in ? p.idx[i] : NO_SLOT;
        const bool ok = e < ne;
        const uint32_t peers = __match_any_sync(0xffffffffu, ok ? e : NO_SLOT);
        const uint32_t before = peers & lanes_below;
        const bool leader = ok && before == 0;
        if (leader) wc[warp][e] = __popc(peers);
        __syncthreads();
        uint32_t pre = 0, tot = 0;
        if (ok) {
            for (int w = 0; w < PLAN_WARPS; w++) {
                const uint32_t c = wc[w][e];
                if (w < warp) pre += c;
                tot += c;
            }
            p.slot_of[i] = run[e] + pre + __popc(before);
        } else if (in) {
            p.slot_of[i] = NO_SLOT;
        }
        __syncthreads();
        if (leader) {
            wc[warp][e] = 0;
            if (pre == 0) run[e] += tot;  // the first warp holding e adds the round's total
        }
        __syncthreads();
    }
    for (int e = tid; e < p.e; e += PLAN_THREADS) p.hist[(long long)blockIdx.x * p.e + e] = run[e];
}

extern "C" __global__ void __launch_bounds__(MAX_E) moe_plan_scan(const MoePlanParams p) { pdl_enter();
    __shared__ uint32_t warp_tot[MAX_E / 32];
    const int tid = threadIdx.x, lane = tid & 31, warp = tid >> 5;
    uint32_t acc = 0;
    if (tid < p.e) {
        for (int b0 = 0; b0 < p.nb; b0 += 8) {
            uint32_t v[8];
#pragma unroll
            for (int u = 0; u < 8; u++) v[u] = b0 + u < p.nb ? p.hist[(long long)(b0 + u) * p.e + tid] : 0u;
#pragma unroll
            for (int u = 0; u < 8; u++) {
                if (b0 + u < p.nb) {
                    p.hist[(long long)(b0 + u) * p.e + tid] = acc;
                    acc += v[u];
                }
            }
        }
    }
    // Exclusive scan of acc over the threads (experts).
    uint32_t x = acc;
#pragma unroll
    for (int o = 1; o < 32; o <<= 1) {
        const uint32_t y = __shfl_up_sync(0xffffffffu, x, o);
        if (lane >= o) x += y;
    }
    if (lane == 31) warp_tot[warp] = x;
    __syncthreads();
    uint32_t off = 0;
    for (int w = 0; w < warp; w++) off += warp_tot[w];
    const uint32_t excl = off + x - acc;
    if (tid < p.e) p.offsets[tid] = excl;
    if (tid == p.e - 1) p.offsets[p.e] = excl + acc;
}

extern "C" __global__ void __launch_bounds__(PLAN_THREADS) moe_plan_scatter(const MoePlanParams p) { pdl_enter();
    const int i = blockIdx.x * PLAN_THREADS + threadIdx.x;
    if (i >= p.n) return;
    const uint32_t e = p.idx[i];
    if (e >= (uint32_t)p.e) return;  // slot_of[i] is already NO_SLOT
    const int b = i / CHUNK;
    const uint32_t slot = p.offsets[e] + p.hist[(long long)b * p.e + e] + p.slot_of[i];
    if (slot >= (uint32_t)p.n) {  // cannot happen for a consistent plan; never write out of bounds
        p.slot_of[i] = NO_SLOT;
        return;
    }
    p.rows[slot] = (uint32_t)(i / p.k);
    p.slot_of[i] = slot;
}

// ---------------------------------------------------------------------------------------------------
// Combine

struct MoeCombineParams {
    const void* y;            // [n, h], sorted-slot order: f32, or bf16 bits (moe_combine_bf16*)
    const uint32_t* idx;      // [t, k] expert ids (the summation order)
    const uint32_t* slot_of;  // [t, k] or null (identity: slot t*k + j)
    const float* w;           // [t, k]
    const float* shared;      // [t, h] or null
    const float* gate_logit;  // [t] (with shared), gate_stride floats apart
    float* out;               // [t, h]
    int t;
    int k;
    int h;
    int n;  // t * k
    int accumulate;  // out += the sum (out is the residual stream), else out = the sum
    int gate_stride; // between tokens' gate logits (1, or E + 1 in the rows of a router fused with the gate)
    // moe_combine_norm* only: out is the residual stream (out += the sum), then normed = RMSNorm(out)·norm_w.
    const float* norm_w;  // [h]
    float* normed;        // [t, h] (the _stage kernels: the f16 plane's bits [t, h])
    float eps;
    int pad_;
    float* scales;        // the _stage kernels: [t] 2^e
};

// glibc's expf (sysdeps/ieee754/flt-32/e_expf.c, the FMA build), every double op rounded as there.
__constant__ uint64_t EXP2F_TAB[32] = {
    0x3ff0000000000000ull, 0x3fefd9b0d3158574ull, 0x3fefb5586cf9890full, 0x3fef9301d0125b51ull,
    0x3fef72b83c7d517bull, 0x3fef54873168b9aaull, 0x3fef387a6e756238ull, 0x3fef1e9df51fdee1ull,
    0x3fef06fe0a31b715ull, 0x3feef1a7373aa9cbull, 0x3feedea64c123422ull, 0x3feece086061892dull,
    0x3feebfdad5362a27ull, 0x3feeb42b569d4f82ull, 0x3feeab07dd485429ull, 0x3feea47eb03a5585ull,
    0x3feea09e667f3bcdull, 0x3fee9f75e8ec5f74ull, 0x3feea11473eb0187ull, 0x3feea589994cce13ull,
    0x3feeace5422aa0dbull, 0x3feeb737b0cdc5e5ull, 0x3feec49182a3f090ull, 0x3feed503b23e255dull,
    0x3feee89f995ad3adull, 0x3feeff76f2fb5e47ull, 0x3fef199bdd85529cull, 0x3fef3720dcef9069ull,
    0x3fef5818dcfba487ull, 0x3fef7c97337b9b5full, 0x3fefa4afa2a490daull, 0x3fefd0765b6e4540ull,
};

__device__ __forceinline__ float glibc_expf(float x) {
    const uint32_t ux = __float_as_uint(x);
    const uint32_t abstop = (ux >> 20) & 0x7ff;
    if (abstop >= (__float_as_uint(88.0f) >> 20)) {
        if (ux == 0xff800000u) return 0.0f;       // -inf
        if (abstop >= 0x7f8u) return x + x;       // +inf, nan
        if (x > 0x1.62e42ep6f) return __int_as_float(0x7f800000);  // overflow
        if (x < -0x1.9fe368p6f) return 0.0f;      // underflow
    }
    const double N = 32.0;
    const double inv_ln2_n = 0x1.71547652b82fep+0 * N;
    const double shift = 0x1.8p+52;
    const double c0 = 0x1.c6af84b912394p-5 / N / N / N, c1 = 0x1.ebfce50fac4f3p-3 / N / N,
                 c2 = 0x1.62e42ff0c52d6p-1 / N;
    const double xd = (double)x;
    double kd = __fma_rn(inv_ln2_n, xd, shift);
    const uint64_t ki = (uint64_t)__double_as_longlong(kd);
    kd = __dsub_rn(kd, shift);
    const double r = __fma_rn(inv_ln2_n, xd, -kd);
    const uint64_t t = EXP2F_TAB[ki % 32] + (ki << (52 - 5));
    const double s = __longlong_as_double((long long)t);
    const double z = __fma_rn(c0, r, c1);
    const double r2 = __dmul_rn(r, r);
    double y = __fma_rn(c2, r, 1.0);
    y = __fma_rn(z, r2, y);
    y = __dmul_rn(y, s);
    return __double2float_rn(y);
}

// lily_cpu::norm::sigmoid: 1 / (1 + exp(-x)) in f32.
__device__ __forceinline__ float cpu_sigmoid(float x) { return __fdiv_rn(1.0f, __fadd_rn(1.0f, glibc_expf(-x))); }

template <int V>
struct CVec;
template <>
struct CVec<1> {
    using T = float;
    static __device__ __forceinline__ T zero() { return 0.0f; }
    static __device__ __forceinline__ T nan() { return __int_as_float(0x7fc00000); }
    static __device__ __forceinline__ T madd(T acc, float a, T v) { return __fadd_rn(acc, __fmul_rn(a, v)); }
    static __device__ __forceinline__ T load_bf16(const void* y, long long i) { return bf16_to_f32(reinterpret_cast<const uint16_t*>(y)[i]); }
};
template <>
struct CVec<4> {
    using T = float4;
    static __device__ __forceinline__ T zero() { return make_float4(0.0f, 0.0f, 0.0f, 0.0f); }
    static __device__ __forceinline__ T nan() {
        const float q = __int_as_float(0x7fc00000);
        return make_float4(q, q, q, q);
    }
    static __device__ __forceinline__ T madd(T acc, float a, T v) {
        return make_float4(__fadd_rn(acc.x, __fmul_rn(a, v.x)), __fadd_rn(acc.y, __fmul_rn(a, v.y)),
                           __fadd_rn(acc.z, __fmul_rn(a, v.z)), __fadd_rn(acc.w, __fmul_rn(a, v.w)));
    }
    // Four bf16 (8 bytes) at vector index i.
    static __device__ __forceinline__ T load_bf16(const void* y, long long i) {
        const uint2 b = reinterpret_cast<const uint2*>(y)[i];
        return make_float4(__uint_as_float(b.x << 16), __uint_as_float(b.x & 0xFFFF0000u), __uint_as_float(b.y << 16), __uint_as_float(b.y & 0xFFFF0000u));
    }
};

constexpr int COMBINE_THREADS = 128;

// The k terms of token tok in the summation order (ascending expert id, ties by j): their slots and
// routing weights into ord_slot and ord_w (shared memory; the block's threads 0 .. k - 1 write them, a
// barrier follows). Read through L2 (ld.global.cg), as everywhere a kernel may start under PDL.
__device__ __forceinline__ void combine_order(const MoeCombineParams& p, int tok, uint32_t* key, uint32_t* ord_slot, float* ord_w) {
    const int k = p.k;
    const long long base = (long long)tok * k;
    if (threadIdx.x < k) key[threadIdx.x] = __ldcg(p.idx + base + threadIdx.x);
    __syncthreads();
    if (threadIdx.x < k) {
        const int j = threadIdx.x;
        const uint32_t kj = key[j];
        int rank = 0;
        for (int q = 0; q < k; q++) rank += (key[q] < kj || (key[q] == kj && q < j)) ? 1 : 0;
        ord_slot[rank] = p.slot_of ? __ldcg(p.slot_of + base + j) : (uint32_t)(base + j);
        ord_w[rank] = __ldcg(p.w + base + j);
    }
    __syncthreads();
}

// Vector c of token tok's sum: the k terms in order (a slot past n contributes NaN), then the shared
// expert's gated term.
template <int V, bool YB16>
__device__ __forceinline__ typename CVec<V>::T combine_sum(const MoeCombineParams& p, const uint32_t* ord_slot, const float* ord_w, float gate,
                                                           int tok, int c, int nv) {
    using T = typename CVec<V>::T;
    T acc = CVec<V>::zero();
    for (int r = 0; r < p.k; r++) {
        const uint32_t s = ord_slot[r];
        const long long at = (long long)s * nv + c;
        const T v = s >= (uint32_t)p.n ? CVec<V>::nan() : YB16 ? CVec<V>::load_bf16(p.y, at) : reinterpret_cast<const T*>(p.y)[at];
        acc = CVec<V>::madd(acc, ord_w[r], v);
    }
    if (p.shared) acc = CVec<V>::madd(acc, gate, reinterpret_cast<const T*>(p.shared)[(long long)tok * nv + c]);
    return acc;
}

// Grid (t, ceil(h / V / COMBINE_THREADS)): block (tok, c) writes vector columns c*128 .. c*128+127 of token tok.
// Under PDL the order of the terms, their weights and the residual's old value are read before the
// wait (each written two or more launches back: complete once this kernel may start); y, shared and
// the gate logit after it (the shared expert's gate may be the launch just before).
template <int V, bool YB16>
__device__ __forceinline__ void moe_combine(const MoeCombineParams& p) {
    using T = typename CVec<V>::T;
    __shared__ uint32_t key[MAX_K];
    __shared__ uint32_t ord_slot[MAX_K];
    __shared__ float ord_w[MAX_K];
    const int tok = blockIdx.x;
    combine_order(p, tok, key, ord_slot, ord_w);

    const int nv = p.h / V;
    const int c = blockIdx.y * COMBINE_THREADS + threadIdx.x;
    T* o = reinterpret_cast<T*>(p.out) + (long long)tok * nv + c;
    // x read from L2 (ld.global.cg), as the GEMVs read activations (affine_gemv.cu, stage_x).
    const T x_old = p.accumulate && c < nv ? __ldcg(o) : CVec<V>::zero();
    pdl_wait();
    pdl_launch_dependents();
    if (c >= nv) return;
    const float gate = p.shared ? cpu_sigmoid(__ldcg(p.gate_logit + (long long)tok * p.gate_stride)) : 0.0f;
    T acc = combine_sum<V, YB16>(p, ord_slot, ord_w, gate, tok, c, nv);
    // x + 1*sum: the residual add, rounded once.
    if (p.accumulate) acc = CVec<V>::madd(x_old, 1.0f, acc);
    *o = acc;
}

// One token a block (blockIdx.x), vectors c = tid + i·blockDim (see the header).
template <int V, bool YB16, bool STAGE = false>
__device__ __forceinline__ void moe_combine_norm(const MoeCombineParams& p) {
    using T = typename CVec<V>::T;
    __shared__ uint32_t key[MAX_K];
    __shared__ uint32_t ord_slot[MAX_K];
    __shared__ float ord_w[MAX_K];
    const int tok = blockIdx.x;
    combine_order(p, tok, key, ord_slot, ord_w);
    const int nv = p.h / V;
    T* o = reinterpret_cast<T*>(p.out) + (long long)tok * nv;
    pdl_wait();
    pdl_launch_dependents();
    const float gate = p.shared ? cpu_sigmoid(__ldcg(p.gate_logit + (long long)tok * p.gate_stride)) : 0.0f;
    float ss = 0.0f;
    for (int c = threadIdx.x; c < nv; c += blockDim.x) {
        const T acc = combine_sum<V, YB16>(p, ord_slot, ord_w, gate, tok, c, nv);
        const T h = CVec<V>::madd(__ldcg(o + c), 1.0f, acc);  // x + the MoE output, rounded once
        o[c] = h;
        ss += RmsVec<V>::sq(h);
    }
    ss = block_sum(ss);
    const float inv = 1.0f / sqrtf(ss / (float)p.h + p.eps);
    const T* w = reinterpret_cast<const T*>(p.norm_w);
    if constexpr (!STAGE) {
        T* y = reinterpret_cast<T*>(p.normed) + (long long)tok * nv;
        for (int c = threadIdx.x; c < nv; c += blockDim.x) y[c] = RmsVec<V>::norm(o[c], inv, w[c]);
    } else {
        static_assert(V == 4, "the staged form is the float4 one");
        extern __shared__ float srow[];  // [h], stage_smem_index's layout
        __shared__ float red[32];
        float m = 0.0f;
        for (int c = threadIdx.x; c < nv; c += blockDim.x) {
            const float4 v = RmsVec<4>::norm(o[c], inv, w[c]);
            *reinterpret_cast<float4*>(srow + stage_smem_index(4 * c)) = v;
            m = fmaxf(m, fmaxf(fmaxf(fabsf(v.x), fabsf(v.y)), fmaxf(fabsf(v.z), fabsf(v.w))));
        }
        m = block_max_any(m, red);  // its barrier also publishes srow
        stage_half_row_out(srow, m, p.h, reinterpret_cast<uint4*>(p.normed) + (long long)tok * (p.h >> 3), p.scales + tok, blockDim.x);
    }
}

extern "C" __global__ void __launch_bounds__(1024) moe_combine_norm_f32(const MoeCombineParams p) { moe_combine_norm<1, false>(p); }
extern "C" __global__ void __launch_bounds__(1024) moe_combine_norm_f32_v4(const MoeCombineParams p) { moe_combine_norm<4, false>(p); }
extern "C" __global__ void __launch_bounds__(1024) moe_combine_norm_bf16(const MoeCombineParams p) { moe_combine_norm<1, true>(p); }
extern "C" __global__ void __launch_bounds__(1024) moe_combine_norm_bf16_v4(const MoeCombineParams p) { moe_combine_norm<4, true>(p); }
extern "C" __global__ void __launch_bounds__(1024) moe_combine_norm_f32_v4_stage(const MoeCombineParams p) { moe_combine_norm<4, false, true>(p); }
extern "C" __global__ void __launch_bounds__(1024) moe_combine_norm_bf16_v4_stage(const MoeCombineParams p) { moe_combine_norm<4, true, true>(p); }

extern "C" __global__ void __launch_bounds__(COMBINE_THREADS) moe_combine_f32(const MoeCombineParams p) { moe_combine<1, false>(p); }
extern "C" __global__ void __launch_bounds__(COMBINE_THREADS) moe_combine_f32_v4(const MoeCombineParams p) { moe_combine<4, false>(p); }
extern "C" __global__ void __launch_bounds__(COMBINE_THREADS) moe_combine_bf16(const MoeCombineParams p) { moe_combine<1, true>(p); }
extern "C" __global__ void __launch_bounds__(COMBINE_THREADS) moe_combine_bf16_v4(const MoeCombineParams p) { moe_combine<4, true>(p); }

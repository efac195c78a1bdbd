// Token choice on the device: the same token as lily_sampler::pick_on_cpu (= Sampler::sample), for one
// row of f32 logits, writing only the chosen id. The CPU's arithmetic is reproduced operation for
// operation: the edits (repetition / presence-frequency penalties, bias) with the same f32 operands, the
// weights exp((l - m) / T) with ops::exp_f32's polynomial (explicit _rn intrinsics, so nothing is fused
// into an FMA), and every f64 sum that decides the token in the CPU's order:
//   - the draw (ops::draw_weights): per 1024-token block, eight lanes summing every eighth weight, then
//     the lanes in order, then the block's tail; the block sums in order; the walk in the chosen block
//     (an integer prefix sum when its weights span <= 18 binades, which makes every partial f64 sum
//     exact; else the sequential chain);
//   - top-p without top-k (ops::nucleus_mask): bucket masses are exact (a bucket's weights share one
//     exponent, so any order sums them exactly; here as integers), their total is the CPU's sequential
//     chain from the top bucket down; inside the edge bucket the walk in rank order is either exact
//     (integers: the chosen cut is then found by a weighted radix select, no sort) or, when it cannot be
//     (top_p > ~0.9995 with a deep edge), a sort and the sequential chain;
//   - top-k: the k best by (logit desc, id asc) by radix select, sorted, the sums in rank / id order.
// Sequential chains run in one thread over values staged in order; everything else is parallel.
//
// One call = a few kernels on one stream, no host round trip: sample_prep (copy + edits + max/argmax;
// greedy ends here), then for top-k sample_topk_pass ×2 and sample_topk_gather, else
// [sample_nucleus_hist, sample_nucleus_cut when top_p < 1] and sample_draw. Each multi-block kernel
// finishes in its last block (ticket after a __threadfence). Between calls the ticket, the list counter
// and the histogram are zero (the scratch starts zeroed; each kernel restores what it used).

#include <stdint.h>
#include "pdl.cuh"

typedef unsigned long long u64;
typedef unsigned int u32;

#define NT 1024                // threads per block, every kernel
#define PREP_TILE 2048         // tokens per block in every kernel but sample_draw (2 per thread)
#define DRAW_BLOCK 1024        // ops::draw_weights' block
#define HIST_BINS 2048         // histogram bins (weight buckets: 0x7F0 + 1 used; radix digits: 11 bits)
#define SORT_SMEM 4096         // sorts up to this size run in shared memory, larger ones in `sortbuf`
#define MAX_DRAW_BLOCKS 512    // vocab <= 2^19
#define FULL 0xffffffffu

enum { MODE_GREEDY = 0, MODE_FULL = 1, MODE_TOPK = 2 };

// The state one call passes from kernel to kernel (in the scratch; must fit in 64 words).
struct SampleState {
    double target;  // top-p: top_p × the total (f64 chain over the bucket masses)
    double a0;      // top-p: the chain's value above the edge bucket
    u64 t_int;      // top-p, exact path: mantissa units the edge bucket must contribute
    u64 cut;        // top-p: rank key of the last kept token of the edge bucket
    float m;        // the largest logit (NaN ignored)
    u32 am;         // the argmax (lowest id among the largest)
    u32 ticket;     // last-block ticket: 0 between kernels
    u32 count;      // list length (append counter): 0 between calls
    u32 done;       // 1: out[0] is written (greedy, or no finite largest logit)
    u32 edge;       // top-p: the edge bucket
    u32 fast;       // top-p: the edge walk is exact in integers
    u32 k_eff;      // top-k: min(k, tokens above -inf)
    u32 krem;       // top-k: rank still to find inside the key prefix (1-based)
    u32 key;        // top-k: key bits fixed so far; after pass 2 the k-th key
    u32 ties;       // top-k: tokens with the k-th key
    u32 pad_;
};

// Must match `SampleParams` in src/ops/sample.rs.
struct SampleParams {
    const float* logits;  // [>= vocab]
    const u32* edits;     // [nb_prep + 1] offsets into the edits, then 4 words per edit; null: none
    u32* out;             // [1]
    float* x;             // [vocab] edited logits
    SampleState* st;
    u64* hist;            // [HIST_BINS]
    float* bmax;          // [nb_prep]
    u32* bidx;            // [nb_prep]
    double* bsum;         // [nb_draw]
    u64* list;            // [vocab] candidate rank keys
    u32* wts;             // [vocab] candidate weights in mantissa units
    u64* sortbuf;         // [pow2 >= vocab]
    double* aux;          // [vocab]
    double u;             // the draw in [0, 1)
    int vocab;
    int nb_prep;
    int nb_draw;
    int n_edits;
    int mode;
    int pass;             // sample_topk_pass: 1 or 2
    u32 top_k;
    float temperature;
    float top_p;
    float min_p;
    const u32* mask;      // [ceil(vocab / 32)] allowed tokens (bit id % 32 of word id / 32), or null
};

// ---------------------------------------------------------------------------------------------------
// The CPU's scalar math, bit for bit

// ops::exp_f32 (Cephes' expf polynomial): constants as the bits of Rust's f32 literals.
__device__ __forceinline__ float exp_f32(float x) {
    const float LOG2E = __uint_as_float(0x3FB8AA3Bu);
    const float LN2_HI = __uint_as_float(0x3F318000u);
    const float LN2_LO = __uint_as_float(0xB95E8083u);
    const float ROUND = __uint_as_float(0x4B400000u);  // 1.5 * 2^23
    float xc = x;  // f32::clamp(-87, 88): NaN passes
    if (xc < -87.0f) xc = -87.0f;
    if (xc > 88.0f) xc = 88.0f;
    const float t = __fadd_rn(__fmul_rn(xc, LOG2E), ROUND);
    const float n = __fsub_rn(t, ROUND);
    const int ni = (int)(__float_as_uint(t) - __float_as_uint(ROUND));
    const float r = __fsub_rn(__fsub_rn(xc, __fmul_rn(n, LN2_HI)), __fmul_rn(n, LN2_LO));
    float p = __uint_as_float(0x39506967u);
    p = __fadd_rn(__fmul_rn(p, r), __uint_as_float(0x3AB743CEu));
    p = __fadd_rn(__fmul_rn(p, r), __uint_as_float(0x3C088908u));
    p = __fadd_rn(__fmul_rn(p, r), __uint_as_float(0x3D2AA9C1u));
    p = __fadd_rn(__fmul_rn(p, r), __uint_as_float(0x3E2AAAAAu));
    p = __fadd_rn(__fmul_rn(p, r), 0.5f);
    const float y = __fadd_rn(__fadd_rn(__fmul_rn(__fmul_rn(p, r), r), r), 1.0f);
    const float scale = __uint_as_float((u32)(ni + 127) << 23);
    return x >= -87.0f ? __fmul_rn(y, scale) : 0.0f;
}

// ops::weight: exp((l - m) / t).
__device__ __forceinline__ float weight(float l, float m, float t) { return exp_f32(__fdiv_rn(__fsub_rn(l, m), t)); }

// One LogitEdit: repetition penalty, then presence/frequency, then bias (ops::apply_*).
__device__ __forceinline__ float apply_edit(float l, u32 rep_bits, u32 sub_bits, u32 bias_bits) {
    const float rep = __uint_as_float(rep_bits);
    if (rep != 1.0f) l = l > 0.0f ? __fdiv_rn(l, rep) : __fmul_rn(l, rep);
    l = __fsub_rn(l, __uint_as_float(sub_bits));
    return __fadd_rn(l, __uint_as_float(bias_bits));
}

// ops::nucleus_mask's weight buckets (exponent and top 4 mantissa bits); weights are <= 1, so at most
// 0x7F0 (clamped to the histogram for safety only).
__device__ __forceinline__ u32 bucket_of(float w) { return min(__float_as_uint(w) >> 19, (u32)HIST_BINS - 1); }
// A weight in units of its bucket's quantum 2^(qexp(bucket)): the mantissa with its implicit bit.
__device__ __forceinline__ u32 unit_of(float w) {
    const u32 b = __float_as_uint(w);
    return (b >> 23) ? ((b & 0x7fffffu) | 0x800000u) : (b & 0x7fffffu);
}
__device__ __forceinline__ int qexp_of(u32 bucket) { return (int)max(bucket >> 4, 1u) - 150; }
// 2^e as a double (e in [-1022, 1023]).
__device__ __forceinline__ double pow2(int e) { return __longlong_as_double((long long)(e + 1023) << 52); }

// Rank order (logit descending, then id ascending; ±0 equal) as an ascending 64-bit key.
__device__ __forceinline__ u32 desc_key(float l) {
    u32 u = __float_as_uint(l);
    if ((u << 1) == 0) u = 0;
    const u32 asc = (u & 0x80000000u) ? ~u : (u | 0x80000000u);
    return ~asc;
}
__device__ __forceinline__ float key_logit(u32 d) {
    const u32 asc = ~d;
    return __uint_as_float((asc & 0x80000000u) ? (asc & 0x7fffffffu) : ~asc);
}
__device__ __forceinline__ u64 rank_key(float l, u32 id) { return ((u64)desc_key(l) << 32) | id; }

__device__ __forceinline__ float neg_inf() { return __uint_as_float(0xff800000u); }

// ops::argmax's order: larger value, then lower id; NaN never wins.
__device__ __forceinline__ bool better(float v, u32 i, float bv, u32 bi) { return v > bv || (v == bv && i < bi); }

__device__ __forceinline__ u32 pow2_ceil(u32 n) {
    u32 p = 1;
    while (p < n) p <<= 1;
    return p;
}

// ---------------------------------------------------------------------------------------------------
// Block primitives (blockDim.x == NT, 32 warps). Each ends with __syncthreads() so it can be reused.

__device__ __forceinline__ u32 lane_id() { return threadIdx.x & 31; }
__device__ __forceinline__ u32 warp_id() { return threadIdx.x >> 5; }

__device__ u64 block_sum_u64(u64 v) {
    __shared__ u64 s[32];
#pragma unroll
    for (int o = 16; o > 0; o >>= 1) v += __shfl_xor_sync(FULL, v, o);
    if (lane_id() == 0) s[warp_id()] = v;
    __syncthreads();
    v = s[lane_id()];
#pragma unroll
    for (int o = 16; o > 0; o >>= 1) v += __shfl_xor_sync(FULL, v, o);
    __syncthreads();
    return v;
}

__device__ u32 block_min_u32(u32 v) {
    __shared__ u32 s[32];
#pragma unroll
    for (int o = 16; o > 0; o >>= 1) v = min(v, __shfl_xor_sync(FULL, v, o));
    if (lane_id() == 0) s[warp_id()] = v;
    __syncthreads();
    v = s[lane_id()];
#pragma unroll
    for (int o = 16; o > 0; o >>= 1) v = min(v, __shfl_xor_sync(FULL, v, o));
    __syncthreads();
    return v;
}

__device__ u32 block_max_u32(u32 v) {
    __shared__ u32 s[32];
#pragma unroll
    for (int o = 16; o > 0; o >>= 1) v = max(v, __shfl_xor_sync(FULL, v, o));
    if (lane_id() == 0) s[warp_id()] = v;
    __syncthreads();
    v = s[lane_id()];
#pragma unroll
    for (int o = 16; o > 0; o >>= 1) v = max(v, __shfl_xor_sync(FULL, v, o));
    __syncthreads();
    return v;
}

// Exclusive prefix sum over the block in thread order; *total gets the sum of all.
__device__ u64 block_excl_scan_u64(u64 v, u64* total) {
    __shared__ u64 s[32];
    u64 x = v;
#pragma unroll
    for (int o = 1; o < 32; o <<= 1) {
        const u64 y = __shfl_up_sync(FULL, x, o);
        if (lane_id() >= (u32)o) x += y;
    }
    if (lane_id() == 31) s[warp_id()] = x;
    __syncthreads();
    if (warp_id() == 0) {
        u64 t = s[lane_id()];
#pragma unroll
        for (int o = 1; o < 32; o <<= 1) {
            const u64 y = __shfl_up_sync(FULL, t, o);
            if (lane_id() >= (u32)o) t += y;
        }
        s[lane_id()] = t;
    }
    __syncthreads();
    const u64 res = (warp_id() ? s[warp_id() - 1] : 0) + x - v;
    *total = s[31];
    __syncthreads();
    return res;
}

__device__ void block_argmax(float& v, u32& i) {
    __shared__ float sv[32];
    __shared__ u32 si[32];
#pragma unroll
    for (int o = 16; o > 0; o >>= 1) {
        const float ov = __shfl_xor_sync(FULL, v, o);
        const u32 oi = __shfl_xor_sync(FULL, i, o);
        if (better(ov, oi, v, i)) {
            v = ov;
            i = oi;
        }
    }
    if (lane_id() == 0) {
        sv[warp_id()] = v;
        si[warp_id()] = i;
    }
    __syncthreads();
    v = sv[lane_id()];
    i = si[lane_id()];
#pragma unroll
    for (int o = 16; o > 0; o >>= 1) {
        const float ov = __shfl_xor_sync(FULL, v, o);
        const u32 oi = __shfl_xor_sync(FULL, i, o);
        if (better(ov, oi, v, i)) {
            v = ov;
            i = oi;
        }
    }
    __syncthreads();
}

// True in the one block that finishes last (every block must call it, with all its threads). Its
// global writes, and those of every other block, are then visible to it (read them with __ldcg).
__device__ bool last_block(SampleState* st) {
    __shared__ u32 s_last;
    __threadfence();
    __syncthreads();
    if (threadIdx.x == 0) s_last = atomicAdd(&st->ticket, 1u) == gridDim.x - 1;
    __syncthreads();
    if (!s_last) return false;
    __threadfence();
    if (threadIdx.x == 0) st->ticket = 0;
    return true;
}

// Appends (key, wt) to the list where `pred` (every lane of the warp must call).
__device__ __forceinline__ void append(SampleState* st, u64* list, u32* wts, bool pred, u64 key, u32 wt) {
    const u32 mask = __ballot_sync(FULL, pred);
    if (mask == 0) return;
    const u32 lane = lane_id();
    const int leader = __ffs(mask) - 1;
    u32 base = 0;
    if (lane == (u32)leader) base = atomicAdd(&st->count, (u32)__popc(mask));
    base = __shfl_sync(FULL, base, leader);
    if (pred) {
        const u32 pos = base + __popc(mask & ((1u << lane) - 1u));
        list[pos] = key;
        if (wts) wts[pos] = wt;
    }
}

// Ascending bitonic sort of a[0..n), n a power of two, by the whole block (a in shared or global memory).
__device__ void block_sort(u64* a, u32 n) {
    for (u32 k = 2; k <= n; k <<= 1) {
        for (u32 j = k >> 1; j > 0; j >>= 1) {
            for (u32 t = threadIdx.x; t < n / 2; t += NT) {
                const u32 i = 2 * t - (t & (j - 1));
                const u32 l = i + j;
                const u64 x = a[i], y = a[l];
                if ((x > y) == ((i & k) == 0)) {
                    a[i] = y;
                    a[l] = x;
                }
            }
            __syncthreads();
        }
    }
}

// One thread: a[i] = init + a[0] + ... + a[i], summed left to right in f64 (round to nearest each
// step, as the CPU's loops). Returns the last sum (init when n == 0).
__device__ double seq_prefix(double* a, u32 n, double init) {
    double s = init;
    u32 i = 0;
    for (; i + 4 <= n; i += 4) {
        const double v0 = a[i], v1 = a[i + 1], v2 = a[i + 2], v3 = a[i + 3];
        s = __dadd_rn(s, v0);
        a[i] = s;
        s = __dadd_rn(s, v1);
        a[i + 1] = s;
        s = __dadd_rn(s, v2);
        a[i + 2] = s;
        s = __dadd_rn(s, v3);
        a[i + 3] = s;
    }
    for (; i < n; ++i) {
        s = __dadd_rn(s, a[i]);
        a[i] = s;
    }
    return s;
}

struct Sel {
    u32 key;
    u64 below;
};

// Over the list entries (by_id: those whose high word is fkey, keyed by their low word with weight 1;
// else all, keyed by the high word with weight wts[i] < 2^24): the smallest key K with
// sum(weight, key <= K) >= T, and below = sum(weight, key < K). Needs 1 <= T <= the total and
// n <= 2^19. Radix narrowing in 11-bit digits from the keys' min..max (usually 1-2 passes). `bins`:
// shared, 2 × HIST_BINS words (each bin's weight as two 32-bit sums of 12-bit halves, so that only
// 32-bit shared atomics are used).
__device__ Sel block_select(const u64* list, const u32* wts, u32 n, bool by_id, u32 fkey, u64 T, u32* bins) {
    __shared__ u32 s_j;
    __shared__ u64 s_below;
    u32 lo = 0xffffffffu, hi = 0;
    for (u32 i = threadIdx.x; i < n; i += NT) {
        const u64 e = __ldcg(list + i);
        const u32 h = (u32)(e >> 32);
        if (by_id && h != fkey) continue;
        const u32 k = by_id ? (u32)e : h;
        lo = min(lo, k);
        hi = max(hi, k);
    }
    lo = block_min_u32(lo);
    hi = block_max_u32(hi);
    u64 below = 0;
    while (lo < hi) {
        const u32 d = hi - lo;
        int shift = 0;
        while ((d >> shift) >= HIST_BINS) ++shift;
        for (u32 b = threadIdx.x; b < 2 * HIST_BINS; b += NT) bins[b] = 0;
        if (threadIdx.x == 0) {
            s_j = d >> shift;
            s_below = 0;
        }
        __syncthreads();
        for (u32 i = threadIdx.x; i < n; i += NT) {
            const u64 e = __ldcg(list + i);
            const u32 h = (u32)(e >> 32);
            if (by_id && h != fkey) continue;
            const u32 k = by_id ? (u32)e : h;
            if (k >= lo && k <= hi) {
                const u32 bin = (k - lo) >> shift;
                const u32 w = by_id ? 1u : __ldcg(wts + i);
                atomicAdd(&bins[bin], w & 0xfffu);
                if (w >> 12) atomicAdd(&bins[HIST_BINS + bin], w >> 12);
            }
        }
        __syncthreads();
        const u32 b0 = 2 * threadIdx.x, b1 = b0 + 1;
        const u64 c0 = ((u64)bins[HIST_BINS + b0] << 12) + bins[b0];
        const u64 c1 = ((u64)bins[HIST_BINS + b1] << 12) + bins[b1];
        u64 tot;
        const u64 ex = block_excl_scan_u64(c0 + c1, &tot);
        const u64 need = T - below;
        if (ex < need && ex + c0 >= need) {
            s_j = 2 * threadIdx.x;
            s_below = ex;
        } else if (ex + c0 < need && ex + c0 + c1 >= need) {
            s_j = 2 * threadIdx.x + 1;
            s_below = ex + c0;
        }
        __syncthreads();
        const u32 j = s_j;
        below += s_below;
        const u32 nlo = lo + (j << shift);
        const u64 top = (u64)nlo + ((1ull << shift) - 1);
        hi = top < (u64)hi ? (u32)top : hi;
        lo = nlo;
        __syncthreads();
    }
    return {lo, below};
}

// ---------------------------------------------------------------------------------------------------
// Top-k: three radix passes over the 32-bit rank key of the logit (bits 31-21, 20-10, 9-0), counting
// tokens above -inf (NaN never); then the ties at the k-th key go by id.

// In the last block of a pass: read the pass's histogram, zero it, pick the digit holding the
// krem-th key and narrow.
__device__ void topk_digit(const SampleParams& p, int pass, bool done) {
    SampleState* st = p.st;
    const u32 t = threadIdx.x;
    const u64 c0 = __ldcg(p.hist + 2 * t), c1 = __ldcg(p.hist + 2 * t + 1);
    __syncthreads();
    p.hist[2 * t] = 0;
    p.hist[2 * t + 1] = 0;
    if (done) return;
    u64 krem;
    if (pass == 0) {
        const u64 valid = block_sum_u64(c0 + c1);
        krem = min((u64)p.top_k, valid);
        if (t == 0) st->k_eff = (u32)krem;
    } else {
        krem = st->krem;
    }
    u64 tot;
    const u64 ex = block_excl_scan_u64(c0 + c1, &tot);
    u32 d = 0xffffffffu;
    u64 below = 0, cnt = 0;
    if (ex < krem && ex + c0 >= krem) {
        d = 2 * t;
        below = ex;
        cnt = c0;
    } else if (ex + c0 < krem && ex + c0 + c1 >= krem) {
        d = 2 * t + 1;
        below = ex + c0;
        cnt = c1;
    }
    if (d != 0xffffffffu) {
        const int shift = pass == 0 ? 21 : (pass == 1 ? 10 : 0);
        st->key = (pass == 0 ? 0u : st->key) | (d << shift);
        st->krem = (u32)(krem - below);
        if (pass == 2) st->ties = (u32)cnt;
    }
}

// The last block of sample_topk_gather: the list holds every token with key <= the k-th key.
__device__ void topk_finish(const SampleParams& p, u64* s_big) {
    __shared__ u32 s_n;
    __shared__ double s_target;
    SampleState* st = p.st;
    const u32 tid = threadIdx.x;
    const u32 C = __ldcg(&st->count);
    const u32 L = st->key, r = st->krem, ties = st->ties, keff = st->k_eff;
    const float m = st->m, t = p.temperature;
    // Ties at the k-th key: the r lowest ids.
    u32 idth = 0xffffffffu;
    if (ties > r) idth = block_select(p.list, nullptr, C, true, L, r, reinterpret_cast<u32*>(s_big)).key;
    const u32 cap = pow2_ceil(keff);
    u64* buf = cap <= SORT_SMEM ? s_big : p.sortbuf;
    if (tid == 0) s_n = 0;
    __syncthreads();
    for (u32 i = tid; i < C; i += NT) {
        const u64 e = __ldcg(p.list + i);
        if ((u32)(e >> 32) < L || (u32)e <= idth) {
            const u32 pos = atomicAdd(&s_n, 1u);
            if (pos < cap) buf[pos] = e;
        }
    }
    __syncthreads();
    const u32 kk = min(s_n, cap);
    const u32 P2 = pow2_ceil(kk);
    for (u32 i = kk + tid; i < P2; i += NT) buf[i] = ~0ull;
    __syncthreads();
    block_sort(buf, P2);  // rank order
    u32 keep = kk;
    if (p.top_p < 1.0f) {
        for (u32 j = tid; j < kk; j += NT) p.aux[j] = (double)weight(key_logit((u32)(buf[j] >> 32)), m, t);
        __syncthreads();
        if (tid == 0) s_target = __dmul_rn((double)p.top_p, seq_prefix(p.aux, kk, 0.0));
        __syncthreads();
        // keep = the first j >= 1 whose mass ranked above reaches the target (else all).
        const double target = s_target;
        u32 j = kk;
        for (u32 i = tid + 1; i < kk; i += NT) {
            if (p.aux[i - 1] >= target) {
                j = i;
                break;
            }
        }
        keep = block_min_u32(j);
    }
    if (p.min_p > 0.0f) {
        u32 j = keep;
        for (u32 i = tid; i < keep; i += NT) {
            if (weight(key_logit((u32)(buf[i] >> 32)), m, t) < p.min_p) {
                j = i;
                break;
            }
        }
        j = block_min_u32(j);
        keep = min(keep, max(j, 1u));
    }
    // The kept tokens by id, each with its weight's bits.
    for (u32 i = tid; i < P2; i += NT) {
        const u64 e = buf[i];
        buf[i] = i < keep ? (((u64)(u32)e << 32) | __float_as_uint(weight(key_logit((u32)(e >> 32)), m, t))) : ~0ull;
    }
    __syncthreads();
    const u32 P3 = pow2_ceil(keep);
    block_sort(buf, P3);
    for (u32 i = tid; i < keep; i += NT) p.aux[i] = (double)__uint_as_float((u32)buf[i]);
    __syncthreads();
    if (tid == 0) s_target = __dmul_rn(p.u, seq_prefix(p.aux, keep, 0.0));
    __syncthreads();
    const double target = s_target;
    u32 c = keep - 1;  // rounding fallback: the last kept token
    for (u32 i = tid; i < keep; i += NT) {
        if (target < p.aux[i]) {
            c = min(c, i);
            break;
        }
    }
    c = block_min_u32(c);
    if (tid == 0) p.out[0] = (u32)(buf[c] >> 32);
}

// ---------------------------------------------------------------------------------------------------
// Top-p over the whole vocabulary

// The last block of sample_nucleus_hist: the chain over the bucket masses from the top bucket down,
// the edge bucket, and whether the walk inside it is exact in integers.
__device__ void nucleus_edge(const SampleParams& p, double* s_mass, u32* s_bk) {
    __shared__ double s_target;
    SampleState* st = p.st;
    const u32 tid = threadIdx.x;
    // Non-empty buckets in descending order (bucket 0, zero weights, never counts).
    const u32 b0 = HIST_BINS - 1 - 2 * tid, b1 = b0 - 1;
    const u64 S0 = __ldcg(p.hist + b0), S1 = b1 >= 1 ? __ldcg(p.hist + b1) : 0;
    u64 cnt64;
    u32 pos = (u32)block_excl_scan_u64((S0 != 0) + (S1 != 0), &cnt64);
    const u32 cnt = (u32)cnt64;
    if (S0) {
        s_mass[pos] = __dmul_rn((double)S0, pow2(qexp_of(b0)));
        s_bk[pos++] = b0;
    }
    if (S1) {
        s_mass[pos] = __dmul_rn((double)S1, pow2(qexp_of(b1)));
        s_bk[pos] = b1;
    }
    __syncthreads();
    if (tid == 0) s_target = __dmul_rn((double)p.top_p, seq_prefix(s_mass, cnt, 0.0));
    __syncthreads();
    const double target = s_target;
    // The edge: the first bucket whose running total reaches the target.
    u32 j = cnt;
    for (u32 i = tid; i < cnt; i += NT) {
        if (s_mass[i] >= target) {
            j = i;
            break;
        }
    }
    j = block_min_u32(j);
    if (tid == 0) {
        if (j >= cnt) j = cnt ? cnt - 1 : 0;  // unreachable: the total reaches the target
        const u32 edge = cnt ? s_bk[j] : 0x7f0u;
        const double a0 = j > 0 ? s_mass[j - 1] : 0.0;
        const u64 S = __ldcg(p.hist + edge);
        // The chain above the edge is a multiple of the edge's quantum q; the walk inside it adds
        // multiples of q, so it is exact while a0 / q + S < 2^53.
        const double inv_q = pow2(-qexp_of(edge));
        const double ia = __dmul_rn(a0, inv_q);
        const bool fast = ia < 9007199254740992.0 && (u64)ia + S < (1ull << 53);
        u64 tint = 0;
        if (fast) {
            const double need = ceil(__dsub_rn(__dmul_rn(target, inv_q), ia));  // exact (< 2^53)
            tint = need < 1.0 ? 1ull : (u64)need;
        }
        st->edge = edge;
        st->a0 = a0;
        st->target = target;
        st->fast = fast;
        st->t_int = tint;
    }
}

// The last block of sample_nucleus_cut: the list holds the edge bucket's tokens (rank key, units).
__device__ void nucleus_finish(const SampleParams& p, u64* s_big) {
    SampleState* st = p.st;
    const u32 tid = threadIdx.x;
    const u32 C = __ldcg(&st->count);
    const float m = st->m, t = p.temperature;
    u64 cut;
    if (st->fast) {
        // Exact: the first token in rank order at which a0 + q·(units so far) >= target.
        const u64 T = st->t_int;
        const Sel s = block_select(p.list, p.wts, C, false, 0, T, reinterpret_cast<u32*>(s_big));
        const u32 L = s.key;
        const u64 mu = unit_of(weight(key_logit(L), m, t));  // every token at this logit has it
        u32 n_at = 0, id_at = 0;
        for (u32 i = tid; i < C; i += NT) {
            const u64 e = __ldcg(p.list + i);
            if ((u32)(e >> 32) == L) {
                ++n_at;
                id_at = max(id_at, (u32)e);
            }
        }
        n_at = (u32)block_sum_u64(n_at);
        id_at = block_max_u32(id_at);
        const u64 r = (T - s.below + mu - 1) / mu;  // tokens needed at this logit, lowest ids first
        u32 id = id_at;
        if (n_at > 1) id = block_select(p.list, nullptr, C, true, L, r, reinterpret_cast<u32*>(s_big)).key;
        cut = ((u64)L << 32) | id;
    } else {
        // The CPU's walk: sort by rank, then the f64 chain from a0.
        const u32 P2 = pow2_ceil(C);
        u64* buf = P2 <= SORT_SMEM ? s_big : p.sortbuf;
        for (u32 i = tid; i < P2; i += NT) buf[i] = i < C ? __ldcg(p.list + i) : ~0ull;
        __syncthreads();
        block_sort(buf, P2);
        for (u32 i = tid; i < C; i += NT) p.aux[i] = (double)weight(key_logit((u32)(buf[i] >> 32)), m, t);
        __syncthreads();
        if (tid == 0) seq_prefix(p.aux, C, st->a0);
        __syncthreads();
        const double target = st->target;
        u32 j = C ? C - 1 : 0;
        for (u32 i = tid; i < C; i += NT) {
            if (p.aux[i] >= target) {
                j = min(j, i);
                break;
            }
        }
        j = block_min_u32(j);
        cut = buf[j];
    }
    if (tid == 0) st->cut = cut;
}

// ---------------------------------------------------------------------------------------------------
// The draw

// The final weight of token i (FULL mode): the weight, zero if cut by the nucleus or by min-p.
__device__ __forceinline__ float final_weight(const SampleParams& p, float m, u32 edge, u64 cut, u32 i) {
    const float l = p.x[i];
    float w = weight(l, m, p.temperature);
    if (p.top_p < 1.0f) {
        const u32 b = bucket_of(w);
        if (b < edge || (b == edge && rank_key(l, i) > cut)) w = 0.0f;
    }
    if (w < p.min_p) w = 0.0f;
    return w;
}

// The last block of sample_draw: the chain over the block sums, the block, the walk inside it.
__device__ void draw_finish(const SampleParams& p, float m, u32 edge, u64 cut, double* s_bs, double* s_pre,
                            double* s_q, u32* s_j) {
    __shared__ double s_target, s_rest;
    __shared__ u32 s_chosen;
    const u32 tid = threadIdx.x;
    const u32 nb = p.nb_draw, n = p.vocab;
    for (u32 b = tid; b < nb; b += NT) {
        const double v = __ldcg(p.bsum + b);
        s_bs[b] = v;
        s_pre[b] = v;
    }
    __syncthreads();
    if (tid == 0) s_target = __dmul_rn(p.u, seq_prefix(s_pre, nb, 0.0));
    __syncthreads();
    const double target = s_target;
    u32 c = nb;
    for (u32 b = tid; b < nb; b += NT) {
        if (target < s_pre[b]) {
            c = b;
            break;
        }
    }
    c = block_min_u32(c);
    if (tid == 0) {
        u32 chosen;
        double cum;
        if (c < nb) {
            chosen = c;
            cum = c ? s_pre[c - 1] : 0.0;
        } else {
            chosen = nb - 1;
            cum = s_pre[nb - 1];
        }
        while (chosen > 0 && s_bs[chosen] <= 0.0) --chosen;
        s_chosen = chosen;
        s_rest = __dsub_rn(target, cum);
    }
    __syncthreads();
    const u32 base = s_chosen * DRAW_BLOCK;
    const u32 len = min((u32)DRAW_BLOCK, n - base);
    const float w = tid < len ? final_weight(p, m, edge, cut, base + tid) : 0.0f;
    const double rest = s_rest;
    // The walk adds the positive weights in id order. When their exponents span at most 18 binades,
    // every partial sum is an integer multiple (< 2^52) of the smallest one's quantum, so the f64 chain
    // is exact and equals an integer prefix sum: done in parallel. Otherwise the chain, in one thread.
    const u32 wb = __float_as_uint(w), we = wb >> 23;
    const u32 emin = block_min_u32(w > 0.0f ? we : 0xffffffffu);
    const u32 emax = block_max_u32(w > 0.0f ? we : 0u);
    const u32 last = block_max_u32(w > 0.0f ? tid : 0u);  // the CPU's fallback: the last positive
    if (emax != 0 && emin >= 1 && emax - emin <= 18) {
        const u64 units = w > 0.0f ? (u64)((wb & 0x7fffffu) | 0x800000u) << (we - emin) : 0;
        u64 tot;
        const u64 before = block_excl_scan_u64(units, &tot);
        const double c = __dmul_rn((double)(before + units), pow2((int)emin - 150));
        const u32 k = block_min_u32(w > 0.0f && rest < c ? tid : 0xffffffffu);
        if (tid == 0) p.out[0] = base + (k != 0xffffffffu ? k : last);
        return;
    }
    u64 cnt64;
    const u32 pos = (u32)block_excl_scan_u64(w > 0.0f, &cnt64);
    const u32 cnt = (u32)cnt64;
    if (w > 0.0f) {
        s_q[pos] = (double)w;
        s_j[pos] = tid;
    }
    __syncthreads();
    if (tid == 0) seq_prefix(s_q, cnt, 0.0);
    __syncthreads();
    u32 k = cnt;
    for (u32 i = tid; i < cnt; i += NT) {
        if (rest < s_q[i]) {
            k = i;
            break;
        }
    }
    k = block_min_u32(k);
    if (tid == 0) p.out[0] = base + (cnt == 0 ? 0u : s_j[k < cnt ? k : cnt - 1]);
}

// ---------------------------------------------------------------------------------------------------
// Kernels

// Copy + edits + per-block argmax (+ top-k pass 0 histogram); the last block finds the max/argmax and
// writes out[0] when greedy or when no logit is finite-largest.
extern "C" __global__ void __launch_bounds__(NT) sample_prep(const SampleParams p) { pdl_enter();
    __shared__ float s_x[PREP_TILE];
    __shared__ u32 s_h[HIST_BINS];
    const u32 tid = threadIdx.x, n = p.vocab;
    const u32 start = blockIdx.x * PREP_TILE;
    const bool topk = p.mode == MODE_TOPK;
    float v[2];
#pragma unroll
    for (int e = 0; e < 2; ++e) {
        const u32 i = start + e * NT + tid;
        v[e] = i < n ? __ldg(p.logits + i) : 0.0f;
    }
    if (p.edits) {
#pragma unroll
        for (int e = 0; e < 2; ++e) s_x[e * NT + tid] = v[e];
        __syncthreads();
        const u32 lo = __ldg(p.edits + blockIdx.x), hi = __ldg(p.edits + blockIdx.x + 1);
        const u32* ed = p.edits + p.nb_prep + 1;
        for (u32 k = lo + tid; k < hi && k < (u32)p.n_edits; k += NT) {
            const u32 id = __ldg(ed + 4 * k);
            const u32 j = id - start;
            if (j < PREP_TILE && id < n)
                s_x[j] = apply_edit(s_x[j], __ldg(ed + 4 * k + 1), __ldg(ed + 4 * k + 2), __ldg(ed + 4 * k + 3));
        }
        __syncthreads();
#pragma unroll
        for (int e = 0; e < 2; ++e) v[e] = s_x[e * NT + tid];
    }
    if (p.mask) {
        // Constrained decoding: after the edits, every token the mask does not allow is -inf
        // (ops::apply_token_mask). The mask comes from the host this step: read from L2.
#pragma unroll
        for (int e = 0; e < 2; ++e) {
            const u32 i = start + e * NT + tid;
            if (i < n && !((__ldcg(p.mask + (i >> 5)) >> (i & 31)) & 1u)) v[e] = neg_inf();
        }
    }
    if (topk) {
        for (u32 b = tid; b < HIST_BINS; b += NT) s_h[b] = 0;
        __syncthreads();
    }
    float bv = neg_inf();
    u32 bi = 0xffffffffu;
#pragma unroll
    for (int e = 0; e < 2; ++e) {
        const u32 i = start + e * NT + tid;
        if (i < n) {
            const float l = v[e];
            if (p.mode != MODE_GREEDY) p.x[i] = l;
            if (better(l, i, bv, bi)) {
                bv = l;
                bi = i;
            }
            if (topk && l > neg_inf()) atomicAdd(&s_h[desc_key(l) >> 21], 1u);
        }
    }
    block_argmax(bv, bi);
    if (tid == 0) {
        p.bmax[blockIdx.x] = bv;
        p.bidx[blockIdx.x] = bi;
    }
    if (topk) {
        __syncthreads();
        for (u32 b = tid; b < HIST_BINS; b += NT)
            if (s_h[b]) atomicAdd(p.hist + b, (u64)s_h[b]);
    }
    if (!last_block(p.st)) return;
    float gv = neg_inf();
    u32 gi = 0xffffffffu;
    for (u32 b = tid; b < (u32)p.nb_prep; b += NT) {
        const float ov = __ldcg(p.bmax + b);
        const u32 oi = __ldcg(p.bidx + b);
        if (better(ov, oi, gv, gi)) {
            gv = ov;
            gi = oi;
        }
    }
    block_argmax(gv, gi);
    const u32 am = gi == 0xffffffffu ? 0u : gi;
    const bool done = p.mode == MODE_GREEDY || !isfinite(gv);
    if (tid == 0) {
        p.st->m = gv;
        p.st->am = am;
        p.st->done = done;
        if (done) p.out[0] = am;
    }
    if (topk) topk_digit(p, 0, done);
}

// Top-k passes 1 and 2: histogram of the next digit among tokens matching the key prefix.
extern "C" __global__ void __launch_bounds__(NT) sample_topk_pass(const SampleParams p) { pdl_enter();
    __shared__ u32 s_h[HIST_BINS];
    const u32 tid = threadIdx.x, n = p.vocab;
    const bool done = p.st->done;
    const int pass = p.pass;
    const u32 pshift = pass == 1 ? 21 : 10, shift = pass == 1 ? 10 : 0, mask = pass == 1 ? 0x7ffu : 0x3ffu;
    const u32 key = p.st->key;
    for (u32 b = tid; b < HIST_BINS; b += NT) s_h[b] = 0;
    __syncthreads();
    if (!done) {
#pragma unroll
        for (int e = 0; e < 2; ++e) {
            const u32 i = blockIdx.x * PREP_TILE + e * NT + tid;
            if (i < n) {
                const float l = p.x[i];
                if (l > neg_inf()) {
                    const u32 d = desc_key(l);
                    if ((d >> pshift) == (key >> pshift)) atomicAdd(&s_h[(d >> shift) & mask], 1u);
                }
            }
        }
    }
    __syncthreads();
    for (u32 b = tid; b < HIST_BINS; b += NT)
        if (s_h[b]) atomicAdd(p.hist + b, (u64)s_h[b]);
    if (!last_block(p.st)) return;
    topk_digit(p, pass, done);
}

// Top-k: gathers every token whose key is <= the k-th; the last block chooses.
// (One block per SM: no spills; the grid is at most 256 blocks.)
extern "C" __global__ void __launch_bounds__(NT, 1) sample_topk_gather(const SampleParams p) { pdl_enter();
    __shared__ u64 s_big[SORT_SMEM];
    const u32 tid = threadIdx.x, n = p.vocab;
    const bool done = p.st->done;
    const u32 key = p.st->key;
#pragma unroll
    for (int e = 0; e < 2; ++e) {
        const u32 i = blockIdx.x * PREP_TILE + e * NT + tid;
        bool pred = false;
        u64 rk = 0;
        if (!done && i < n) {
            const float l = p.x[i];
            if (l > neg_inf()) {
                const u32 d = desc_key(l);
                pred = d <= key;
                rk = ((u64)d << 32) | i;
            }
        }
        append(p.st, p.list, nullptr, pred, rk, 0);
    }
    if (!last_block(p.st)) return;
    if (!done) topk_finish(p, s_big);
    __syncthreads();
    if (tid == 0) p.st->count = 0;
}

// Top-p: the weight histogram (mantissa units per bucket); the last block finds the edge bucket.
extern "C" __global__ void __launch_bounds__(NT) sample_nucleus_hist(const SampleParams p) { pdl_enter();
    // Per bucket, the sums of the units' low and high 12 bits (32-bit shared atomics only; each sum of
    // a block's 2048 tokens stays below 2^23).
    __shared__ u64 s_h[HIST_BINS];
    __shared__ u32 s_bk[HIST_BINS];
    u32* s_lo = reinterpret_cast<u32*>(s_h);
    u32* s_hi = s_bk;
    const u32 tid = threadIdx.x, n = p.vocab;
    const bool done = p.st->done;
    const float m = p.st->m, t = p.temperature;
    for (u32 b = tid; b < HIST_BINS; b += NT) {
        s_lo[b] = 0;
        s_hi[b] = 0;
    }
    __syncthreads();
    if (!done) {
#pragma unroll
        for (int e = 0; e < 2; ++e) {
            const u32 i = blockIdx.x * PREP_TILE + e * NT + tid;
            if (i < n) {
                const float w = weight(p.x[i], m, t);
                const u32 b = bucket_of(w);
                if (b != 0) {
                    const u32 unit = unit_of(w);
                    atomicAdd(&s_lo[b], unit & 0xfffu);
                    atomicAdd(&s_hi[b], unit >> 12);
                }
            }
        }
    }
    __syncthreads();
    for (u32 b = tid; b < HIST_BINS; b += NT) {
        const u64 S = ((u64)s_hi[b] << 12) + s_lo[b];
        if (S) atomicAdd(p.hist + b, S);
    }
    if (!last_block(p.st)) return;
    if (!done) nucleus_edge(p, reinterpret_cast<double*>(s_h), s_bk);
    __syncthreads();
    p.hist[2 * tid] = 0;
    p.hist[2 * tid + 1] = 0;
}

// Top-p: gathers the edge bucket's tokens; the last block finds the last one kept.
// (One block per SM: 40 registers without spills; the grid is at most 256 blocks.)
extern "C" __global__ void __launch_bounds__(NT, 1) sample_nucleus_cut(const SampleParams p) { pdl_enter();
    __shared__ u64 s_big[SORT_SMEM];
    const u32 tid = threadIdx.x, n = p.vocab;
    const bool done = p.st->done;
    const float m = p.st->m, t = p.temperature;
    const u32 edge = p.st->edge;
#pragma unroll
    for (int e = 0; e < 2; ++e) {
        const u32 i = blockIdx.x * PREP_TILE + e * NT + tid;
        bool pred = false;
        u64 rk = 0;
        u32 wt = 0;
        if (!done && i < n) {
            const float l = p.x[i];
            const float w = weight(l, m, t);
            if (bucket_of(w) == edge) {
                pred = true;
                rk = rank_key(l, i);
                wt = unit_of(w);
            }
        }
        append(p.st, p.list, p.wts, pred, rk, wt);
    }
    if (!last_block(p.st)) return;
    if (!done) nucleus_finish(p, s_big);
    __syncthreads();
    if (tid == 0) p.st->count = 0;
}

// The draw over the whole vocabulary: per 1024-token block the CPU's eight-lane f64 sum of the final
// weights; the last block walks.
extern "C" __global__ void __launch_bounds__(NT) sample_draw(const SampleParams p) { pdl_enter();
    __shared__ float s_w[DRAW_BLOCK];
    __shared__ double s_acc[8];
    __shared__ double s_bs[MAX_DRAW_BLOCKS], s_pre[MAX_DRAW_BLOCKS];
    __shared__ double s_q[DRAW_BLOCK];
    __shared__ u32 s_j[DRAW_BLOCK];
    const u32 tid = threadIdx.x, n = p.vocab;
    const bool done = p.st->done;
    const float m = p.st->m;
    const bool nucleus = p.top_p < 1.0f;
    const u32 edge = nucleus ? p.st->edge : 0;
    const u64 cut = nucleus ? p.st->cut : 0;
    const u32 base = blockIdx.x * DRAW_BLOCK;
    const u32 len = min((u32)DRAW_BLOCK, n - base);
    s_w[tid] = (!done && tid < len) ? final_weight(p, m, edge, cut, base + tid) : 0.0f;
    __syncthreads();
    if (tid < 8) {
        // ops::sum_f64: lane j sums elements 8c + j of the block's whole chunks of eight, in order.
        double a = 0.0;
        const u32 chunks = len / 8;
#pragma unroll 8
        for (u32 c = 0; c < chunks; ++c) a = __dadd_rn(a, (double)s_w[8 * c + tid]);
        s_acc[tid] = a;
    }
    __syncthreads();
    if (tid == 0) {
        double s = s_acc[0];
        for (int j = 1; j < 8; ++j) s = __dadd_rn(s, s_acc[j]);
        double rest = 0.0;
        for (u32 r = len / 8 * 8; r < len; ++r) rest = __dadd_rn(rest, (double)s_w[r]);
        p.bsum[blockIdx.x] = __dadd_rn(s, rest);
    }
    if (!last_block(p.st)) return;
    if (!done) draw_finish(p, m, edge, cut, s_bs, s_pre, s_q, s_j);
}

// After a masked pick (one block): ops::masked_choice. When every allowed logit was -inf or NaN the
// chain may have chosen a token the mask does not allow; then the lowest allowed id (the lowest set
// bit of the first non-zero word), if it is inside the vocabulary, replaces it.
extern "C" __global__ void __launch_bounds__(NT) sample_mask_fix(const SampleParams p) { pdl_enter();
    const u32 tok = __ldcg(p.out);
    const u32 words = ((u32)p.vocab + 31u) >> 5;
    if ((tok >> 5) < words && ((__ldcg(p.mask + (tok >> 5)) >> (tok & 31)) & 1u)) return;  // whole block
    u32 lo = 0xffffffffu;
    for (u32 w = threadIdx.x; w < words; w += NT) {
        const u32 bits = __ldcg(p.mask + w);
        if (bits) {
            lo = min(lo, w * 32u + (u32)(__ffs(bits) - 1));
            break;  // later words of this thread only hold larger ids
        }
    }
    lo = block_min_u32(lo);
    if (threadIdx.x == 0 && lo < (u32)p.vocab) p.out[0] = lo;
}

// The tensor-core form of a 4-bit (group 64) product with one f32 vector, shared by the decode GEMVs
// (affine_gemv_tc.cu) and the fused MoE decode (moe_decode.cu): how a lane turns codes into mma
// operands, how x is staged as three bf16 planes, the mmas of one 128-column round and each group's
// affine map. The maths (from affine_gemv_tc.cu's design notes):
// The product, per warp: mma.m16n8k16 (bf16 in, f32 accumulate) with W's 16 rows as A and x as B.
//   A: a code q becomes the bf16 16 + q exactly: one LOP3 puts two codes (nibbles p and p+4 of a word,
//      16 bits apart) at mantissa bits 3..6 of the two halves of a bf16x2. Lane (g = lane/4, t = lane%4)
//      loads 16 bytes (32 codes) of row g and of row g+8: chunk t of each 128-column "round". The order
//      in which the 32 codes enter the k slots of the 8 mmas of a round is free, as long as x is staged
//      in the same order: word m, pairs (0,4),(1,5) feed mma 2m, pairs (2,6),(3,7) mma 2m+1.
//   B: x is split x = hi + mid + lo (three bf16, each the rounded remainder of the ones before: 24
//      significant bits, as exact as f32; with two, 16 bits, the GEMV tests' 1e-5 failed at 2.1e-5),
//      and each mma's 8 columns carry, for the round's two groups G0 = 2r (chunks 0,1) and G1 = 2r+1
//      (chunks 2,3): columns 0, 1, 2 = hi, mid, lo restricted to G0, columns 4, 5, 6 the same on G1,
//      columns 3 and 7 zero. After a round's 8 mmas lane t holds, for rows g and g+8, columns 2t and
//      2t+1: lanes 0 and 1 parts of sum (16 + q) x over G0, lanes 2 and 3 over G1. Each applies its
//      group's affine map in f32 (s * sum q x + b * X = s * A + (b - 16 s) * X, the X term on lanes 0
//      and 2 only, X = the group's sum of the staged x), and the 4 lanes' sums are the row's.
//      Precision: x exact to f32; the sums' error is the tensor cores' f32 accumulation (not rounded to
//      nearest), up to 2.9e-5 of the largest output on the tests' shapes, where the FFMA kernels stay
//      under 2e-6 — far inside what bf16 activations would cost (~4e-3), which the numerics bar allows.
// x staging (shared memory): per round, 12 "planes" of 64 bytes (part x chunk t), 80 bytes apart to
// spread the banks of the 12 lanes that read B (g % 4 < 3 and t/2 == g/4; the others feed zeros); a
// plane holds its chunk's 32 values in mma order (n0 n4 n1 n5 n2 n6 n3 n7 for each word), so a lane's B
// for mmas 2m and 2m+1 is one 16-byte load.
#pragma once
#include <stdint.h>
#include <cuda_bf16.h>
#include "gemv.cuh"

constexpr int TC_WARPS = 8;
constexpr int TC_PLANE = 80;          // bytes between planes (64 used)
constexpr int TC_ROUND = 12 * TC_PLANE; // staged bytes per 128 columns

// Two codes (nibbles pi and pi+4 of w) as the bf16x2 (16 + q_pi, 16 + q_{pi+4}), exactly: a shift and
// one LOP3 (s & 0x00780078) | k with k = 0x41804180 held in a register (given two immediates, the
// compiler splits it into two LOP3s). Centring the codes (a bf16x2 subtraction of 24 more) made the
// sums smaller and the tests' errors 4.3e-6 instead of 2.9e-5, but cost 32 registers a thread, and the
// GEMVs in the decode graph, latency-bound, lost more to the lower occupancy (docs/PERF.md).
template <int PI>
__device__ __forceinline__ uint32_t code_pair(uint32_t w, uint32_t k) {
    const uint32_t s = PI == 0 ? (w << 3) : (w >> (4 * PI - 3));
    uint32_t d;
    asm("lop3.b32 %0, %1, %2, %3, 0xEA;" : "=r"(d) : "r"(s), "n"(0x00780078), "r"(k));
    return d;
}
// A constant in a register the compiler cannot fold back into an immediate.
__device__ __forceinline__ uint32_t opaque(uint32_t v) {
    uint32_t k;
    asm volatile("mov.b32 %0, %1;" : "=r"(k) : "r"(v));
    return k;
}

__device__ __forceinline__ void mma_bf16(float (&c)[4], uint32_t a0, uint32_t a1, uint32_t a2, uint32_t a3, uint32_t b0, uint32_t b1) {
    asm("mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32 {%0, %1, %2, %3}, {%4, %5, %6, %7}, {%8, %9}, {%0, %1, %2, %3};"
        : "+f"(c[0]), "+f"(c[1]), "+f"(c[2]), "+f"(c[3])
        : "r"(a0), "r"(a1), "r"(a2), "r"(a3), "r"(b0), "r"(b1));
}

// One round's loads of one matrix for one lane: chunk t of rows g and g+8, and the scale and bias of
// group 2r + t/2 of both rows (bf16 bits).
struct TcLoad {
    uint4 w0, w1;
    uint32_t s0, b0, s1, b1;
};

// The lane's pointers into one matrix for one row tile.
struct TcRows {
    const uint4* w0;      // row g, chunk t of round 0
    const uint16_t* s0;   // row g, group (t & 1) of round 0
    const uint16_t* b0;
    long long wstep;      // uint4s from row g to row g+8
    long long gstep;      // groups from row g to row g+8
    bool v0, v1;          // rows g, g+8 exist

    // Lane (g, t)'s pointers for row `row` (and row + 8) of a matrix whose row 0 is `mrow` rows into
    // w, scales and biases; rows at or past `live_rows`, or all with `live` false, load zeros.
    __device__ __forceinline__ static TcRows at(const uint4* w, const uint16_t* sc, const uint16_t* bi, long long mrow, int row,
                                                bool live, int live_rows, int nch, int groups, int t) {
        TcRows R;
        R.w0 = w + (mrow + row) * nch + t;
        R.s0 = sc + (mrow + row) * groups + (t >> 1);
        R.b0 = bi + (mrow + row) * groups + (t >> 1);
        R.wstep = 8ll * nch;
        R.gstep = 8ll * groups;
        R.v0 = live && row < live_rows;
        R.v1 = live && row + 8 < live_rows;
        return R;
    }

    __device__ __forceinline__ void load(TcLoad& L, int r) const {
        const uint4 z = make_uint4(0, 0, 0, 0);
        L.w0 = v0 ? ld_stream(w0 + 4 * r) : z;
        L.w1 = v1 ? ld_stream(w0 + wstep + 4 * r) : z;
        L.s0 = v0 ? __ldg(s0 + 2 * r) : 0u;
        L.b0 = v0 ? __ldg(b0 + 2 * r) : 0u;
        L.s1 = v1 ? __ldg(s0 + gstep + 2 * r) : 0u;
        L.b1 = v1 ? __ldg(b0 + gstep + 2 * r) : 0u;
    }
};

// The 8 mmas of one round for one matrix: c = sum (16 + q) x per (row, column), from zero. CHAINS = 2:
// mmas 2m and 2m+1 accumulate apart and are added at the end (half the dependent latency of a round,
// the same products summed in another order).
template <int CHAINS = 1>
__device__ __forceinline__ void tc_mmas(float (&c)[4], const TcLoad& L, const uint4 (&xb)[4], uint32_t k16) {
    static_assert(CHAINS == 1 || CHAINS == 2, "one or two accumulator chains");
    float d[4] = {0.0f, 0.0f, 0.0f, 0.0f};
    float (&c2)[4] = CHAINS == 2 ? d : c;
    c[0] = c[1] = c[2] = c[3] = 0.0f;
    const uint32_t a[4] = {L.w0.x, L.w0.y, L.w0.z, L.w0.w};
    const uint32_t b[4] = {L.w1.x, L.w1.y, L.w1.z, L.w1.w};
#pragma unroll
    for (int m = 0; m < 4; ++m) {
        mma_bf16(c, code_pair<0>(a[m], k16), code_pair<0>(b[m], k16), code_pair<1>(a[m], k16), code_pair<1>(b[m], k16), xb[m].x, xb[m].y);
        mma_bf16(c2, code_pair<2>(a[m], k16), code_pair<2>(b[m], k16), code_pair<3>(a[m], k16), code_pair<3>(b[m], k16), xb[m].z, xb[m].w);
    }
    if (CHAINS == 2) {
#pragma unroll
        for (int i = 0; i < 4; ++i) c[i] += d[i];
    }
}

// The lanes that read x planes for B (g % 4 < 3 and t/2 == g/4; the others feed zeros), and the
// lane's plane in a staging.
__device__ __forceinline__ bool tc_breal(int g, int t) { return (g & 3) < 3 && (t >> 1) == (g >> 2); }
__device__ __forceinline__ const uint4* tc_xlane(const unsigned char* xs, int g, int t) {
    return reinterpret_cast<const uint4*>(xs + ((g & 3) * 4 + t) * TC_PLANE);
}

// A lane's B operand of round r (xb) from its plane, and the X it adds to its group's affine map (the
// group's sum of the staged values on lanes 0 and 2, else 0).
__device__ __forceinline__ float tc_round_b(uint4 (&xb)[4], const uint4* xlane, const float* Xs, int r, bool breal, int t) {
#pragma unroll
    for (int m = 0; m < 4; ++m) xb[m] = breal ? xlane[r * (TC_ROUND / 16) + m] : make_uint4(0, 0, 0, 0);
    return (t & 1) ? 0.0f : Xs[2 * r + (t >> 1)];
}

// A lane's loads of round r from a 16-row tile staged in shared memory (moe_decode.cu, gemv_chain.cu):
// 16 weight rows `rs` bytes apart, then 16 scale rows and 16 bias rows `ss` bytes apart.
__device__ __forceinline__ TcLoad tc_load_staged(const unsigned char* base, int rs, int ss, int r, int g, int t) {
    const unsigned char* sc = base + 16 * rs + (2 * r + (t >> 1)) * 2;
    TcLoad W;
    W.w0 = *reinterpret_cast<const uint4*>(base + g * rs + (4 * r + t) * 16);
    W.w1 = *reinterpret_cast<const uint4*>(base + (g + 8) * rs + (4 * r + t) * 16);
    W.s0 = *reinterpret_cast<const uint16_t*>(sc + g * ss);
    W.s1 = *reinterpret_cast<const uint16_t*>(sc + (g + 8) * ss);
    W.b0 = *reinterpret_cast<const uint16_t*>(sc + 16 * ss + g * ss);
    W.b1 = *reinterpret_cast<const uint16_t*>(sc + 16 * ss + (g + 8) * ss);
    return W;
}

// The 4 lanes of a row group hold the parts of each round's two groups: their sum is the warp's part
// of rows g (a0) and g + 8 (a1).
__device__ __forceinline__ void tc_lane_sum(float& a0, float& a1) {
#pragma unroll
    for (int o = 1; o <= 2; o <<= 1) {
        a0 += __shfl_xor_sync(0xffffffffu, a0, o);
        a1 += __shfl_xor_sync(0xffffffffu, a1, o);
    }
}

// acc += the lane's part of its group's contribution (X: the group's sum of x on lanes 0 and 2, else 0).
__device__ __forceinline__ void tc_affine(float& acc0, float& acc1, const float (&c)[4], const TcLoad& L, float X) {
    const float s0 = bf16_to_f32((uint16_t)L.s0), b0 = bf16_to_f32((uint16_t)L.b0);
    const float s1 = bf16_to_f32((uint16_t)L.s1), b1 = bf16_to_f32((uint16_t)L.b1);
    acc0 = fmaf(s0, c[0] + c[1], fmaf(fmaf(-16.0f, s0, b0), X, acc0));
    acc1 = fmaf(s1, c[2] + c[3], fmaf(fmaf(-16.0f, s1, b1), X, acc1));
}

// Word j of a staged vector (values 8j..8j+7, v; zeros where !act): its three bf16 parts into the
// planes, and its group's sum of the staged values into Xs (the 8 words of a group are 8 consecutive
// lanes, every lane of the warp calling alike).
__device__ __forceinline__ void tc_stage_word(const float (&v)[8], int j, bool act, unsigned char* xs, float* Xs) {
    uint32_t hi[8], mid[8], lo[8];
    float sum = 0.0f;
#pragma unroll
    for (int i = 0; i < 8; ++i) {
        hi[i] = bf16_bits(v[i]);
        const float h = __uint_as_float(hi[i] << 16);
        mid[i] = bf16_bits(v[i] - h);
        const float md = __uint_as_float(mid[i] << 16);
        lo[i] = bf16_bits((v[i] - h) - md);
        sum += (h + md) + __uint_as_float(lo[i] << 16);
    }
    // The group of 64 values is 8 consecutive words: 8 consecutive threads.
    sum += __shfl_xor_sync(0xffffffffu, sum, 1);
    sum += __shfl_xor_sync(0xffffffffu, sum, 2);
    sum += __shfl_xor_sync(0xffffffffu, sum, 4);
    if (act) {
        const int r = j >> 4, t = (j >> 2) & 3, m = j & 3;
        // mma order within the word: n0 n4 n1 n5 n2 n6 n3 n7 (low half first)
        const uint4 H = make_uint4(hi[0] | hi[4] << 16, hi[1] | hi[5] << 16, hi[2] | hi[6] << 16, hi[3] | hi[7] << 16);
        const uint4 M = make_uint4(mid[0] | mid[4] << 16, mid[1] | mid[5] << 16, mid[2] | mid[6] << 16, mid[3] | mid[7] << 16);
        const uint4 L = make_uint4(lo[0] | lo[4] << 16, lo[1] | lo[5] << 16, lo[2] | lo[6] << 16, lo[3] | lo[7] << 16);
        unsigned char* d = xs + r * TC_ROUND + t * TC_PLANE + m * 16;  // plane part * 4 + t
        *reinterpret_cast<uint4*>(d) = H;
        *reinterpret_cast<uint4*>(d + 4 * TC_PLANE) = M;
        *reinterpret_cast<uint4*>(d + 8 * TC_PLANE) = L;
        if ((j & 7) == 0) Xs[j >> 3] = sum;
    }
}

// x (optionally x * norm_w), word by word (8 values a thread), into a staging by `word(v, j, act)`;
// returns 1/rms(x) with the norm, else 1. Ends with the block synchronised.
// MAXW: the most warps of the calling block.
// NORM_LDG: the norm weight read through the read-only path (global memory); false: plain loads (a
// norm weight staged in shared memory, gemv_chain.cu).
template <int MAXW, class Word, bool NORM_LDG = true>
__device__ __forceinline__ float stage_words(const float* norm_w, float norm_eps, const float* x, int cols, Word word) {
    __shared__ float ss_part[MAXW];
    const bool norm = norm_w != nullptr;
    const int nw = cols >> 3;  // words of 8 values
    float ss = 0.0f;
    for (int base = 0; base < nw; base += blockDim.x) {
        const int j = base + threadIdx.x;
        const bool act = j < nw;
        float v[8] = {0, 0, 0, 0, 0, 0, 0, 0};
        if (act) {
            const float4 a = __ldcg(reinterpret_cast<const float4*>(x) + 2 * j);
            const float4 b = __ldcg(reinterpret_cast<const float4*>(x) + 2 * j + 1);
            v[0] = a.x; v[1] = a.y; v[2] = a.z; v[3] = a.w; v[4] = b.x; v[5] = b.y; v[6] = b.z; v[7] = b.w;
            if (norm) {
                const float4* nw = reinterpret_cast<const float4*>(norm_w) + 2 * j;
                const float4 ga = NORM_LDG ? __ldg(nw) : nw[0];
                const float4 gb = NORM_LDG ? __ldg(nw + 1) : nw[1];
                const float g[8] = {ga.x, ga.y, ga.z, ga.w, gb.x, gb.y, gb.z, gb.w};
#pragma unroll
                for (int i = 0; i < 8; ++i) {
                    ss = fmaf(v[i], v[i], ss);
                    v[i] *= g[i];
                }
            }
        }
        word(v, j, act);
    }
    if (norm) {
#pragma unroll
        for (int o = 16; o > 0; o >>= 1) ss += __shfl_xor_sync(0xffffffffu, ss, o);
        if ((threadIdx.x & 31) == 0) ss_part[threadIdx.x >> 5] = ss;
    }
    __syncthreads();
    if (!norm) return 1.0f;
    float tot = 0.0f;
    for (int w = 0; w < (int)(blockDim.x >> 5); ++w) tot += ss_part[w];
    return 1.0f / sqrtf(tot / (float)cols + norm_eps);
}

// x (optionally x * norm_w) -> the planes and the group sums Xs; returns 1/rms(x) with the norm, else 1.
// Ends with the block synchronised.
template <int MAXW = TC_WARPS>
__device__ __forceinline__ float tc_stage(const float* norm_w, float norm_eps, const float* x, unsigned char* xs, float* Xs, int cols) {
    return stage_words<MAXW>(norm_w, norm_eps, x, cols, [&](const float (&v)[8], int j, bool act) { tc_stage_word(v, j, act, xs, Xs); });
}
// The same for a GEMV's parameters (its fused norm, if any).
__device__ __forceinline__ float tc_stage(const GemvParams& p, const float* x, unsigned char* xs, float* Xs, int cols) {
    return tc_stage<TC_WARPS>(p.norm_w, p.norm_eps, x, xs, Xs, cols);
}

// ---------------------------------------------------------------------------------------------------
// The integer form (affine_gemv_tc.cu's I8 kernels): mma.m16n8k32 with the 4-bit codes as unsigned
// bytes (A) and x as signed bytes (B), summed exactly in int32.
//   A: lane (g, t) holds the same 16 bytes (32 codes) of rows g and g+8 a round as above; word m of
//      its chunk gives mma m its four registers: the even nibbles (w & 0x0F0F0F0F, codes 0, 2, 4, 6 of the
//      word as bytes) of row g and g+8, then the odd ones ((w >> 4) & 0x0F0F0F0F). Three instructions
//      for eight codes, where the bf16 form needs eight, and 512 weights an mma instead of 256.
//   B: each group of 64 staged values v (x, or x * norm_w) is scaled by 127 / max|v| and written as
//      three signed-byte planes, v = σ (x1 + x2/254 + x3/254²) with σ = max|v| / 127 and every x_p in
//      [-127, 127] (x2, x3: the previous plane's rounding remainder, times 254): v to ~1.2e-7 of the
//      group's largest |v|. Columns as above: 0, 1, 2 = planes 1, 2, 3 of the round's group G0 (lanes
//      t = 0, 1), 4, 5, 6 the same of G1 (t = 2, 3), 3 and 7 zero.
//   C: lane t holds, for rows g and g+8, columns 2t and 2t+1 summed over the round's 4 mmas: lanes 0
//      and 2 planes 1 and 2 of their group, lanes 1 and 3 plane 3. Each lane weights its two by
//      (σ, σ/254) or (σ/254², 0), applies the row's group scale (W = s·q + b: s·Σ q v + b·Σ v, the X
//      term on lanes 0 and 2) in f32, and the 4 lanes' sums are the row's. The int32 sums are exact
//      (at most 4 · 32 · 15 · 127 < 2^24, so exact in f32 too): the error is x's representation and
//      the f32 sums.
// Staging (shared memory) per round: 12 segments (plane p, chunk t) of 32 bytes, 48 bytes apart (the
// 12 lanes that read B fetch 16 bytes each in two wavefronts, the least for 192 bytes); a segment
// holds, for each word m of its chunk, the plane's even columns then its odd ones (4 bytes each).
constexpr int I8_SEG = 48;
constexpr int I8_ROUND = 12 * I8_SEG;  // staged bytes per 128 columns

__device__ __forceinline__ void mma_u8s8(int (&c)[4], uint32_t a0, uint32_t a1, uint32_t a2, uint32_t a3, uint32_t b0, uint32_t b1) {
    asm("mma.sync.aligned.m16n8k32.row.col.s32.u8.s8.s32 {%0, %1, %2, %3}, {%4, %5, %6, %7}, {%8, %9}, {%0, %1, %2, %3};"
        : "+r"(c[0]), "+r"(c[1]), "+r"(c[2]), "+r"(c[3])
        : "r"(a0), "r"(a1), "r"(a2), "r"(a3), "r"(b0), "r"(b1));
}

// The 4 mmas of one round for one matrix: c = Σ q x_p per (row, column), exactly, from zero.
__device__ __forceinline__ void i8_mmas(int (&c)[4], const TcLoad& L, const uint4 (&xb)[2]) {
    c[0] = c[1] = c[2] = c[3] = 0;
    const uint32_t a[4] = {L.w0.x, L.w0.y, L.w0.z, L.w0.w};
    const uint32_t b[4] = {L.w1.x, L.w1.y, L.w1.z, L.w1.w};
    const uint32_t xv[8] = {xb[0].x, xb[0].y, xb[0].z, xb[0].w, xb[1].x, xb[1].y, xb[1].z, xb[1].w};
#pragma unroll
    for (int m = 0; m < 4; ++m)
        mma_u8s8(c, a[m] & 0x0F0F0F0Fu, b[m] & 0x0F0F0F0Fu, (a[m] >> 4) & 0x0F0F0F0Fu, (b[m] >> 4) & 0x0F0F0F0Fu, xv[2 * m], xv[2 * m + 1]);
}

// The lane's segment of a staging (the lanes that feed zeros get one too; they do not read it).
__device__ __forceinline__ const uint4* i8_xlane(const unsigned char* xs, int g, int t) {
    return reinterpret_cast<const uint4*>(xs + ((g & 3) * 4 + t) * I8_SEG);
}

// A lane's B operand of round r, its two plane weights (k0, k1) and the X it adds (its group's sum of
// the staged values on lanes 0 and 2, else 0). `sig`: each group's σ.
__device__ __forceinline__ float i8_round_b(uint4 (&xb)[2], const uint4* xlane, const float* Xs, const float* sig, int r, bool breal, int t,
                                            float& k0, float& k1) {
    xb[0] = breal ? xlane[r * (I8_ROUND / 16)] : make_uint4(0, 0, 0, 0);
    xb[1] = breal ? xlane[r * (I8_ROUND / 16) + 1] : make_uint4(0, 0, 0, 0);
    const int gi = 2 * r + (t >> 1);
    const float sg = sig[gi];
    constexpr float INV = 1.0f / 254.0f;
    k0 = (t & 1) ? sg * (INV * INV) : sg;
    k1 = (t & 1) ? 0.0f : sg * INV;
    return (t & 1) ? 0.0f : Xs[gi];
}

// acc += the lane's part of its group's contribution.
__device__ __forceinline__ void i8_affine(float& acc0, float& acc1, const int (&c)[4], const TcLoad& L, float k0, float k1, float X) {
    const float s0 = bf16_to_f32((uint16_t)L.s0), b0 = bf16_to_f32((uint16_t)L.b0);
    const float s1 = bf16_to_f32((uint16_t)L.s1), b1 = bf16_to_f32((uint16_t)L.b1);
    const float p0 = fmaf((float)c[0], k0, (float)c[1] * k1);
    const float p1 = fmaf((float)c[2], k0, (float)c[3] * k1);
    acc0 = fmaf(s0, p0, fmaf(b0, X, acc0));
    acc1 = fmaf(s1, p1, fmaf(b1, X, acc1));
}

// Word j of a staged vector (values 8j..8j+7, v; zeros where !act): its group's σ and sum (into sig
// and Xs; the 8 words of a group are 8 consecutive lanes, every lane of the warp calling alike) and
// its three byte planes. Rounding to an integer by adding 1.5·2^23 (the integer lands in the low
// mantissa bits: its low byte is the two's-complement byte), every step rounded as written.
__device__ __forceinline__ void i8_stage_word(const float (&v)[8], int j, bool act, unsigned char* xs, float* Xs, float* sig) {
    constexpr float M = 12582912.0f;  // 1.5 · 2^23
    float a = 0.0f, sum = 0.0f;
#pragma unroll
    for (int i = 0; i < 8; ++i) {
        a = fmaxf(a, fabsf(v[i]));
        sum += v[i];
    }
#pragma unroll
    for (int o = 1; o <= 4; o <<= 1) {
        a = fmaxf(a, __shfl_xor_sync(0xffffffffu, a, o));
        sum += __shfl_xor_sync(0xffffffffu, sum, o);
    }
    const float inv = a > 0.0f ? 127.0f / a : 0.0f;
    uint32_t q[3][8];
#pragma unroll
    for (int i = 0; i < 8; ++i) {
        const float y = __fmul_rn(v[i], inv);
        const float t1 = __fadd_rn(y, M);
        const float r1 = __fmul_rn(__fsub_rn(y, __fsub_rn(t1, M)), 254.0f);
        const float t2 = __fadd_rn(r1, M);
        const float r2 = __fmul_rn(__fsub_rn(r1, __fsub_rn(t2, M)), 254.0f);
        const float t3 = __fadd_rn(r2, M);
        q[0][i] = __float_as_uint(t1);
        q[1][i] = __float_as_uint(t2);
        q[2][i] = __float_as_uint(t3);
    }
    if (act) {
        const int r = j >> 4, t = (j >> 2) & 3, m = j & 3;
#pragma unroll
        for (int pl = 0; pl < 3; ++pl) {
            // Even columns (0, 2, 4, 6), then odd ones: the low byte of each.
            const uint32_t ev = __byte_perm(__byte_perm(q[pl][0], q[pl][2], 0x0040), __byte_perm(q[pl][4], q[pl][6], 0x0040), 0x5410);
            const uint32_t od = __byte_perm(__byte_perm(q[pl][1], q[pl][3], 0x0040), __byte_perm(q[pl][5], q[pl][7], 0x0040), 0x5410);
            *reinterpret_cast<uint2*>(xs + r * I8_ROUND + (pl * 4 + t) * I8_SEG + m * 8) = make_uint2(ev, od);
        }
        if ((j & 7) == 0) {
            Xs[j >> 3] = sum;
            sig[j >> 3] = a * (1.0f / 127.0f);
        }
    }
}

// x (optionally x * norm_w) -> the byte planes, the group sums Xs and scales sig; as tc_stage.
template <int MAXW = TC_WARPS>
__device__ __forceinline__ float i8_stage(const float* norm_w, float norm_eps, const float* x, unsigned char* xs, float* Xs, float* sig, int cols) {
    return stage_words<MAXW>(norm_w, norm_eps, x, cols, [&](const float (&v)[8], int j, bool act) { i8_stage_word(v, j, act, xs, Xs, sig); });
}
// The same for a GEMV's parameters (its fused norm, if any).
__device__ __forceinline__ float i8_stage(const GemvParams& p, const float* x, unsigned char* xs, float* Xs, float* sig, int cols) {
    return i8_stage<TC_WARPS>(p.norm_w, p.norm_eps, x, xs, Xs, sig, cols);
}

// acc += round r of a 16-row tile staged in shared memory (tc_load_staged's layout) times the staged
// x (byte planes at the lane's segment xlane, group sums Xs, scales sig): gemv_chain.cu, gdn_in_step.cu.
__device__ __forceinline__ void i8_round_staged(float& acc0, float& acc1, const unsigned char* base, int rs, int ss, int r, int g, int t,
                                                const uint4* xlane, const float* Xs, const float* sig, bool breal) {
    const TcLoad W = tc_load_staged(base, rs, ss, r, g, t);
    uint4 xb[2];
    float k0, k1;
    const float X = i8_round_b(xb, xlane, Xs, sig, r, breal, t, k0, k1);
    int c[4];
    i8_mmas(c, W, xb);
    i8_affine(acc0, acc1, c, W, k0, k1, X);
}

// Prefill GEMM on Hopper's warpgroup MMA (wgmma) for MLX affine 4-bit weights in groups of 64, the
// model's format (and the 8-bit router's, below): Y[t, rows] = X[t, cols] · W[m]ᵀ, the fused SwiGLU form Y = silu(X·Gᵀ) ⊙ (X·Uᵀ), and the
// grouped (MoE) forms of gemm.cu, in three numerics:
//   half (the model's default): x one f16 plane, each row scaled by its power of two 2^-e (the stager
//     picks e so the row's largest |x| lands in [2^14, 2^15)); each weight formed in f16 as
//     f16(s)·q + f16(b) by one fused multiply-add; the MMAs sum in f32 across all of K (no per-group
//     fold) and the epilogue multiplies by 2^e.
//   exact / bf16x (gemm.cu's): the codes go to the tensor cores exactly (centred, q - 8), each group's
//     scale and bias apply in f32 (y = Σ_g s·Σ c·x + b'·Σ x, b' = b + 8s, the X sums of the unrounded x),
//     x as one bf16 plane (bf16x) or two (exact: hi = bf16(x), lo = bf16(x - hi)).
//
// Roles: the weights are wgmma's A (64 weight rows a warpgroup, from registers: each thread turns its own
// packed codes into 16-bit pairs), the tokens its B (BT = 64 or 128 tokens, K-major in shared memory, the
// 128-byte swizzle), D[weight row, token] in f32 registers (wgmma.cuh has the fragments).
//
// x is staged first, one pass over X (gemm_wgmma_stage: a warp per (row, group), the bf16 planes and the
// f32 sums of the unrounded x per group, [x_rows, cols / 64]; gemm_wgmma_stage_half: a warp per row, the
// f16 plane and the row's 2^e, [x_rows]): planes [x_rows, cols] whose columns are permuted within each
// group of 64 into the order in which a thread's A registers hold the codes. The permutation: a thread
// of quad index q = lane % 4 holds, for each of its two rows, words 2q and 2q+1 of the row's group
// (codes 16q .. 16q+15, eight a word, LSB first); one LOP3 makes nibbles j and j+4 of a word a 16-bit
// pair (bf16 128 + code, or f16 1024 + code), one HSUB2 centres it (exact). At k-step s (0..3) of the
// group, a0 (k 2q, 2q+1 of the step) is nibbles (s, s+4) of word 2q and a2 (k 2q+8, 2q+9) nibbles
// (s, s+4) of word 2q+1, so position kk of step s is code
//   kk = 2q + e      ->  m = 16q + s + 4e
//   kk = 8 + 2q + e  ->  m = 16q + 8 + s + 4e      (e = 0, 1)
// and the stagers write x[m] at column 16s + kk of the group (stage_column, stage_half.cuh).
//
// Block: WGS warpgroups (2, or 4 for the 256-row half tiles) of 64 weight rows each × BT tokens (SwiGLU:
// half the rows as outputs, gate rows 16i..16i+7 and up rows 16i+8..16i+15 of output rows 8i..8i+7, so
// one thread holds gate and up of the same output). K advances one group a step through a ring filled
// by cp.async from every thread (the X planes with the swizzle, the codes, the X sums when folded).
// Folded numerics (STAGES deep): each step a warpgroup issues 4·PLANES wgmmas into a per-group
// accumulator (the first overwrites it), waits, and folds it: acc += s·accg + b'·xsum. Half (NS deep):
// each step issues its 4 wgmmas into the accumulators and leaves them in flight (wgmma_wait<1>) while
// the next group is refilled and dequantised into a second register set.
// Grouped: the expert tiles of grouped.cuh; with a gather, slot i reads staged row rows[i] (a row >= x_rows
// gives a NaN output row).
//
// 8-bit codes (the MoE router, 257 rows of 2048 in the 35B model), plain form only: a thread holds the
// same codes 16q .. 16q + 15 of its rows' group as in the 4-bit layout, as 16 bytes (words x, y, z, w:
// code 16q + 4i + b is byte b of word i), so the staged x (and its permutation) is the 4-bit kernels'
// own; one PRMT makes bytes (s, s + 4) of a word pair the 16-bit pair of step s (half: f16 1024 + q;
// folded: bf16 q - 128 exactly, code_pair8, with b' = b + 128s).
//
// Warp-specialised persistent tiles (half numerics, 4-bit, 128 tokens; wg_tile_ws below): a producer
// warpgroup fills the ring, two consumer warpgroups dequantise and multiply, one block an SM walks the
// tiles; the same sums as wg_tile's half tiles, bit for bit (the _fs forms' SiLU aside).
//
// Entry points: gemm_wgmma_{plain, swiglu, grouped, grouped_swiglu}_n{64, 128}_{p1, p2, h128, h256}
// (p: folded with 1 or 2 planes; h: half, 128 or 256 weight rows), gemm_wgmma_plain_n{64, 128}_{h128, p1, p2}_q8
// (8-bit codes), gemm_wgmma_grouped_n{128, 64}_h128_o16 (bf16 outputs as 16-byte rows, store_tile16_rows;
// _o16s one output a store), gemm_wgmma_{form}_ws{128, 256, 4} (warp-specialised: 128 or 256 weight rows
// on two consumer warpgroups, or 256 on four), _ws128t{256, 160} (two-part tiles; grouped _o16, _o16s as
// above; grouped_swiglu _fs: store_tile's FAST_SILU epilogue), _ss256 (shared-memory A), _mc256 (cluster
// pairs); dynamic shared
// memory: see smem_bytes in ops/gemm_wgmma.rs. Launch bounds: n128_p* one
// block an SM (up to 255 registers), n64_p* two, n128_h128* two, n64_h128 three (ptxas serialises its
// MMAs for registers at that bound; the same tile at two blocks measured even, docs/PERF.md 2026-12-05;
// n64_h128_q8 takes two), *_h256 (512 threads) one.

#include <stdint.h>
#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include "pdl.cuh"
#include "grouped.cuh"
#include "wgmma.cuh"
#include "async_copy.cuh"
#include "bf16.cuh"
#include "mbarrier.cuh"
#include "reduce.cuh"
#include "stage_half.cuh"

struct WgStageParams {
    const float* x;      // [rows, cols]
    uint16_t* hi;        // [rows, cols] bf16, permuted within groups
    uint16_t* lo;        // [rows, cols] bf16 (x - hi), or null for one plane
    float* sums;         // [rows, cols / 64]
    long long rows;
    int cols;
};

struct WgParams {
    const uint32_t* w;         // gate (or only) matrix: packed codes [count, rows, cols / 8]
    const uint16_t* scales;    // bf16 bits [count, rows, cols / 64]
    const uint16_t* biases;
    const uint32_t* w2;        // SwiGLU up matrix (same shape)
    const uint16_t* scales2;
    const uint16_t* biases2;
    const uint16_t* xh;        // staged x: hi plane [x_rows, cols]
    const uint16_t* xl;        // lo plane (PLANES = 2)
    const float* xsum;         // [x_rows, cols / 64]
    void* y;                   // [t, rows] f32, or bf16 bits (the _o16 kernels)
    const uint32_t* offsets;   // grouped: [count + 1]
    const uint32_t* gather;    // grouped: [t] source rows, or null
    long long x_rows;
    int t;                     // tokens, or slots
    int rows;                  // output features
    int cols;                  // K, a multiple of 64
    int count;                 // grouped: experts
    int matrix;                // plain: which matrix of the stack
    int splits;                // split-K tiles (SPLITK): blocks a tile, each summing a range of K's groups
    float* part;               // SPLITK: the splits' partial tiles [splits, t, rows]
    uint32_t* tile_count;      // SPLITK: a tile's finished splits [token tiles × row tiles], zero between calls
};

constexpr int GROUP = 64;    // K a step
constexpr int STAGES = 4;    // the folded numerics' ring (the half numerics' depth is a variant's NS)
enum : int { NUM_BF16X = 1, NUM_EXACT = 2, NUM_HALF = 3 };

// Nibbles s and s + 4 of w minus 8, as an exact bf16 pair (nibble s in the low half): under the bits of
// 128.0 (ulp 1) a nibble makes 128 + code; 136 is subtracted.
__device__ __forceinline__ uint32_t code_pair(uint32_t w, int s) {
    uint32_t v = ((w >> (4 * s)) & 0x000F000Fu) | 0x43004300u;
    const uint32_t k136 = 0x43084308u;
    __nv_bfloat162 d = __hsub2(*reinterpret_cast<const __nv_bfloat162*>(&v), *reinterpret_cast<const __nv_bfloat162*>(&k136));
    return *reinterpret_cast<uint32_t*>(&d);
}

// Byte s of w0 and byte s of w1 (8-bit codes q, q') minus 128, as an exact bf16 pair (w0's in the low
// half): the low 7 bits go under the bits of 128.0 (ulp 1: 128 + (q & 127)), from which 256 is
// subtracted, or 128 where bit 7 is set (bf16 256.0 is 128.0's bits with bit 7 set): q - 128 in [-128,
// 127], exact in bf16 (at most 8 significant bits), as is the subtraction.
__device__ __forceinline__ uint32_t code_pair8(uint32_t w0, uint32_t w1, int s) {
    const uint32_t b = __byte_perm(w0, w1, (uint32_t)s | ((uint32_t)(s + 4) << 8)) & 0x00FF00FFu;
    const uint32_t v = (b & 0x007F007Fu) | 0x43004300u;
    const uint32_t sub = (b & 0x00800080u) ^ 0x43804380u;
    __nv_bfloat162 d = __hsub2(*reinterpret_cast<const __nv_bfloat162*>(&v), *reinterpret_cast<const __nv_bfloat162*>(&sub));
    return *reinterpret_cast<uint32_t*>(&d);
}

// A pair of codes under the bits of 1024.0 (ulp 1: the halves are 1024 + q, 1024 + q') as the f16 pair
// (s·q + b, s·q' + b): 1024 is subtracted (exact), one fused multiply-add rounds the weight once.
__device__ __forceinline__ uint32_t half_weight_of(uint32_t v, __half2 scale, __half2 bias) {
    const uint32_t k1024 = 0x64006400u;
    const __half2 c = __hsub2(*reinterpret_cast<const __half2*>(&v), *reinterpret_cast<const __half2*>(&k1024));
    const __half2 d = __hfma2(c, scale, bias);
    return *reinterpret_cast<const uint32_t*>(&d);
}
// 8-bit codes: byte s of w0 and byte s of w1 (w0's in the low half), gathered by one PRMT into bytes 0
// and 2 (1024 + q is exact for q < 1024).
__device__ __forceinline__ uint32_t half_weight_pair8(uint32_t w0, uint32_t w1, int s, __half2 scale, __half2 bias) {
    return half_weight_of((__byte_perm(w0, w1, (uint32_t)s | ((uint32_t)(s + 4) << 8)) & 0x00FF00FFu) | 0x64006400u, scale, bias);
}

// The four f16 weight pairs of one word of 4-bit codes: pair s (0..3) holds nibbles s and s + 4 (nibble
// s in the low half) as (s·q + b) in f16, the value half_weight_of gives ((w >> 4s) & 0x000F000F |
// 1024's bits), in 13 instructions instead of 19: one LOP3 puts a nibble under the bits of 1024 in
// place (1024 + q, or 1024 + 16q for the nibbles of bits 4-7 of each half, which one HFMA2 by 1/16
// less 64 turns into q exactly), one shift serves pairs 2 and 3.
__device__ __forceinline__ uint32_t lop3_and_or(uint32_t a, uint32_t mask, uint32_t bits) {
    uint32_t d;
    asm("lop3.b32 %0, %1, %2, %3, 0xEA;" : "=r"(d) : "r"(a), "r"(mask), "r"(bits));  // (a & mask) | bits
    return d;
}
__device__ __forceinline__ void half_weights4(uint32_t w, __half2 scale, __half2 bias, uint32_t& p0, uint32_t& p1, uint32_t& p2, uint32_t& p3) {
    const uint32_t w8 = w >> 8;
    const uint32_t v0 = lop3_and_or(w, 0x000F000Fu, 0x64006400u);
    const uint32_t v1 = lop3_and_or(w, 0x00F000F0u, 0x64006400u);
    const uint32_t v2 = lop3_and_or(w8, 0x000F000Fu, 0x64006400u);
    const uint32_t v3 = lop3_and_or(w8, 0x00F000F0u, 0x64006400u);
    const __half2 k1024 = __float2half2_rn(1024.0f), k16th = __float2half2_rn(0.0625f), k64 = __float2half2_rn(-64.0f);
    const __half2 c0 = __hsub2(*reinterpret_cast<const __half2*>(&v0), k1024);
    const __half2 c1 = __hfma2(*reinterpret_cast<const __half2*>(&v1), k16th, k64);
    const __half2 c2 = __hsub2(*reinterpret_cast<const __half2*>(&v2), k1024);
    const __half2 c3 = __hfma2(*reinterpret_cast<const __half2*>(&v3), k16th, k64);
    const __half2 d0 = __hfma2(c0, scale, bias), d1 = __hfma2(c1, scale, bias), d2 = __hfma2(c2, scale, bias), d3 = __hfma2(c3, scale, bias);
    p0 = *reinterpret_cast<const uint32_t*>(&d0);
    p1 = *reinterpret_cast<const uint32_t*>(&d1);
    p2 = *reinterpret_cast<const uint32_t*>(&d2);
    p3 = *reinterpret_cast<const uint32_t*>(&d3);
}

// The 4-bit weights of one thread for one group of one m64 tile, as its A fragments for the 4 k-steps:
// rows r0 and r0 + 8 of the stage's codes at `codes` (32 bytes a row), words 2q and 2q + 1 of each
// (see the header), in f16 by the rows' scales and biases.
__device__ __forceinline__ void half_tile_weights(uint32_t codes, int r0, int q, __half2 hs0, __half2 hb0, __half2 hs1, __half2 hb1,
                                                  uint32_t (&a)[4][4]) {
    const uint2 wa = lds64(codes + r0 * 32 + q * 8);
    const uint2 wb = lds64(codes + (r0 + 8) * 32 + q * 8);
    half_weights4(wa.x, hs0, hb0, a[0][0], a[1][0], a[2][0], a[3][0]);
    half_weights4(wb.x, hs1, hb1, a[0][1], a[1][1], a[2][1], a[3][1]);
    half_weights4(wa.y, hs0, hb0, a[0][2], a[1][2], a[2][2], a[3][2]);
    half_weights4(wb.y, hs1, hb1, a[0][3], a[1][3], a[2][3], a[3][3]);
}

// A thread's two rows' scales and biases of one group (bf16 bits: scale, bias of row r0, then of r0 + 8)
// as f16 pairs.
__device__ __forceinline__ void half_scales(const uint16_t (&n)[4], __half2& hs0, __half2& hb0, __half2& hs1, __half2& hb1) {
    hs0 = __float2half2_rn(bf16_to_f32(n[0]));
    hb0 = __float2half2_rn(bf16_to_f32(n[1]));
    hs1 = __float2half2_rn(bf16_to_f32(n[2]));
    hb1 = __float2half2_rn(bf16_to_f32(n[3]));
}

// One output element: y[i] = v, in f32, or (OUT16) as the bits of bf16(v), rounded to nearest even.
template <bool OUT16>
__device__ __forceinline__ void put_out(void* y, long long i, float v) {
    if constexpr (OUT16) reinterpret_cast<uint16_t*>(y)[i] = (uint16_t)bf16_bits(v);
    else reinterpret_cast<float*>(y)[i] = v;
}

// The epilogue of a tile: a thread's accumulators (MT m64 tiles of BT tokens: rows o0[m] and o1[m],
// tokens 8j + 2q + e) times their slot's scale(tok), written to y[slot, row] for the slots in
// [m_begin, m_end) and the rows that exist (SwiGLU: silu(gate) · up to output o0[m]); NaN where
// nan_row(tok) (a gathered row past x). OUT16: y holds bf16 (the f32 value rounded once). FAST_SILU:
// silu(g) · u as g · u / (1 + e^-g) with the fast exponential and division (__expf, __fdividef: a few
// ulp, where the IEEE forms' ~20 instructions an output were the epilogue's largest part).
template <int MT, int BT, bool SWIGLU, bool OUT16 = false, bool FAST_SILU = false, typename Scale, typename NanRow>
__device__ __forceinline__ void store_tile(const float (&acc)[MT][BT / 2], void* y, int rows, int m_begin, int m_end, int q, const int (&o0)[MT],
                                           const int (&o1)[MT], const bool (&ok0)[MT], const bool (&ok1)[MT], Scale scale, NanRow nan_row) {
#pragma unroll
    for (int m = 0; m < MT; ++m) {
#pragma unroll
        for (int j = 0; j < BT / 8; ++j) {
#pragma unroll
            for (int e = 0; e < 2; ++e) {
                const int tok = 8 * j + 2 * q + e;
                const int slot = m_begin + tok;
                if (slot >= m_end) continue;
                const long long yrow = (long long)slot * rows;
                const bool bad = nan_row(tok);
                const float k = scale(tok);
                const float v0 = acc[m][4 * j + e] * k, v1 = acc[m][4 * j + 2 + e] * k;
                if (SWIGLU && FAST_SILU) {
                    if (ok0[m]) put_out<OUT16>(y, yrow + o0[m], bad ? __int_as_float(0x7fc00000) : __fdividef(v0 * v1, 1.0f + __expf(-v0)));
                } else if (SWIGLU) {
                    if (ok0[m]) put_out<OUT16>(y, yrow + o0[m], bad ? __int_as_float(0x7fc00000) : v0 / (1.0f + expf(-v0)) * v1);
                } else {
                    if (ok0[m]) put_out<OUT16>(y, yrow + o0[m], bad ? __int_as_float(0x7fc00000) : v0);
                    if (ok1[m]) put_out<OUT16>(y, yrow + o1[m], bad ? __int_as_float(0x7fc00000) : v1);
                }
            }
        }
    }
}

// store_tile's bf16 form without SwiGLU for a tile whose weight rows all exist, with rows a multiple of
// 8 and y 16-byte aligned (the caller checks; store_tile otherwise): a warp's 16 rows (o0[m] − g ..
// + 15) of 16 slots at a time go through `buf` (512 bytes of the warp's own shared memory) by one
// transposing stmatrix, and leave as 16-byte stores of 8 consecutive outputs of one slot — 32 bytes a
// slot a warp in two stores, where store_tile writes 2 bytes a store. The same values (each v = acc ·
// scale(tok), rounded once to bf16), the same slots (those before m_end).
// buf: 32 rows of 16 bytes, row 2·t + h holding slot t's outputs 8h .. 8h + 7, its halves swapped where
// bit 2 of t is set (the eight rows one matrix writes then fall in distinct banks, as do the rows one
// quarter-warp reads back).
template <int MT, int BT, typename Scale, typename NanRow>
__device__ __forceinline__ void store_tile16_rows(const float (&acc)[MT][BT / 2], void* y, int rows, int m_begin, int m_end, int lane,
                                                  const int (&o0)[MT], uint32_t buf, Scale scale, NanRow nan_row) {
    static_assert(BT % 16 == 0, "slots in pairs of 8-column fragments");
    const int g = lane >> 2, q = lane & 3;
    auto at = [&](int t, int h) { return buf + 16u * (uint32_t)(2 * t + (h ^ ((t >> 2) & 1))); };
    const int wi = lane >> 3;  // stmatrix: lane 8i + c addresses column c of matrix i = (pair half i >> 1, output half i & 1)
    const uint32_t waddr = at(8 * (wi >> 1) + (lane & 7), wi & 1);
    const int rt = lane >> 1, rh = lane & 1;  // read back: slot rt of the 16, outputs 8·rh ..
    const uint32_t raddr = at(rt, rh);
    uint16_t* y16 = reinterpret_cast<uint16_t*>(y);
#pragma unroll
    for (int m = 0; m < MT; ++m) {
        const long long col = o0[m] - g + 8 * rh;
#pragma unroll
        for (int jp = 0; jp < BT / 16; ++jp) {
            uint32_t r[4];
#pragma unroll
            for (int i = 0; i < 4; ++i) {
                const int j = 2 * jp + (i >> 1), h = i & 1;
                uint32_t bits[2];
#pragma unroll
                for (int e = 0; e < 2; ++e) {
                    const int tok = 8 * j + 2 * q + e;
                    const float v = acc[m][4 * j + 2 * h + e] * scale(tok);
                    bits[e] = bf16_bits(nan_row(tok) ? __int_as_float(0x7fc00000) : v);
                }
                r[i] = bits[0] | (bits[1] << 16);
            }
            __syncwarp();  // the previous round's reads of buf are done
            stmatrix_x4_trans(waddr, r[0], r[1], r[2], r[3]);
            __syncwarp();
            const uint4 out = lds128(raddr);
            const int slot = m_begin + 16 * jp + rt;
            if (slot < m_end) *reinterpret_cast<uint4*>(y16 + (long long)slot * rows + col) = out;
        }
    }
}

// A persistent tile's slot `slot` (of those before m_end) in the epilogue: the 2^e of its staged row
// (half numerics), NaN for a gathered row past x, 0 past the tile's slots.
template <bool GROUPED>
__device__ __forceinline__ float slot_scale(const WgParams& p, int slot, int m_end) {
    if (slot >= m_end) return 0.0f;
    const long long src = (GROUPED && p.gather) ? (long long)p.gather[slot] : (long long)slot;
    return src < p.x_rows ? p.xsum[src] : __int_as_float(0x7fc00000);
}

// A compile-time flag passed to a generic lambda (decltype(f)::value).
template <bool B>
struct Flag {
    static constexpr bool value = B;
};

// D[64 × N] += A · B for N = 32, 64 or 128 (f16, A from registers).
template <int N>
__device__ __forceinline__ void wgmma_rs_n(float (&d)[N / 2], const uint32_t (&a)[4], uint64_t b_desc) {
    if constexpr (N == 32) wgmma_m64n32k16_rs<true>(d, a, b_desc, 1);
    else if constexpr (N == 64) wgmma_m64n64k16_rs<true>(d, a, b_desc, 1);
    else wgmma_m64n128k16_rs<true>(d, a, b_desc, 1);
}

// The half tiles' main loop: step(kt, a) for the groups kt < nk, the weights of consecutive groups in
// alternate register sets (a group's are written while the MMAs of the one before still read theirs).
template <int MT, typename Step>
__device__ __forceinline__ void steps_in_two_sets(int nk, Step& step) {
    uint32_t a0[MT][4][4], a1[MT][4][4];
    int kt = 0;
#pragma unroll 1
    for (; kt + 1 < nk; kt += 2) {
        step(kt, a0);
        step(kt + 1, a1);
    }
    if (kt < nk) step(kt, a0);
}


// One warp per (row, group): lane l takes x[2l], x[2l + 1] of the group.
extern "C" __global__ void __launch_bounds__(256) gemm_wgmma_stage(const WgStageParams p) {
    pdl_enter();
    const int groups = p.cols >> 6;
    const long long gi = (long long)blockIdx.x * 8 + (threadIdx.x >> 5);
    if (gi >= p.rows * groups) return;
    const int lane = threadIdx.x & 31;
    const long long row = gi / groups;
    const int g = (int)(gi - row * groups);
    const long long base = row * p.cols + g * GROUP;
    const float2 v = *reinterpret_cast<const float2*>(p.x + base + 2 * lane);
    const float xs[2] = {v.x, v.y};
#pragma unroll
    for (int e = 0; e < 2; ++e) {
        const __nv_bfloat16 h = __float2bfloat16_rn(xs[e]);
        const long long at = base + stage_column(2 * lane + e);
        p.hi[at] = __bfloat16_as_ushort(h);
        if (p.lo) p.lo[at] = __bfloat16_as_ushort(__float2bfloat16_rn(xs[e] - __bfloat162float(h)));
    }
    float s = v.x + v.y;
#pragma unroll
    for (int o = 16; o > 0; o >>= 1) s += __shfl_xor_sync(0xffffffffu, s, o);
    if (lane == 0) p.sums[row * groups + g] = s;
}

// Half numerics (stage_half.cuh): the row's largest |x| sets its scale 2^e; x·2^-e is rounded to f16 into
// `hi` (permuted as above) and 2^e goes to sums[row] for the GEMM's epilogue. A NaN or infinity in x
// reaches the plane (and so the output) as itself. Two stagers, the same bits:
//   gemm_wgmma_stage_half: one warp per row, 2-byte stores at the permuted columns (the first form;
//     LILY_STAGE=warp, A/B runs);
//   gemm_wgmma_stage_half_{rows, wrows}: one block a row (64–256 threads) or, for rows of up to 1,024
//     columns, one warp a row; x read once as float4 into shared memory (cols floats a row), the row's
//     max, then 16-byte stores of whole staged chunks.
extern "C" __global__ void __launch_bounds__(256) gemm_wgmma_stage_half(const WgStageParams p) {
    pdl_enter();
    const long long row = (long long)blockIdx.x * 8 + (threadIdx.x >> 5);
    if (row >= p.rows) return;
    const int lane = threadIdx.x & 31;
    const float* xr = p.x + row * p.cols;
    float m = 0.0f;
    for (int c = 2 * lane; c < p.cols; c += 64) {
        const float2 v = *reinterpret_cast<const float2*>(xr + c);
        m = fmaxf(m, fmaxf(fabsf(v.x), fabsf(v.y)));
    }
#pragma unroll
    for (int o = 16; o > 0; o >>= 1) m = fmaxf(m, __shfl_xor_sync(0xffffffffu, m, o));
    const int e = stage_half_exponent(m);
    const float down = stage_pow2(-e), up = stage_pow2(e);
    uint16_t* out = p.hi + row * p.cols;
    for (int c = 2 * lane; c < p.cols; c += 64) {
        const float2 v = *reinterpret_cast<const float2*>(xr + c);
        const int g0 = c & ~63, k = c & 63;
        out[g0 + stage_column(k)] = __half_as_ushort(__float2half_rn(v.x * down));
        out[g0 + stage_column(k + 1)] = __half_as_ushort(__float2half_rn(v.y * down));
    }
    if (lane == 0) p.sums[row] = up;
}

// The row-held stager: WARP, one warp a row of up to 1,024 columns (8 rows a block); else one block a
// row (64–256 threads). Rows in shared memory (dynamic: cols floats a row), stage_smem_index's layout.
template <bool WARP>
__device__ __forceinline__ void stage_half_held(const WgStageParams& p) {
    extern __shared__ float4 stage_rows[];
    __shared__ float red[8];
    const int tid = threadIdx.x, lane = tid & 31;
    const int part = WARP ? lane : tid, parts = WARP ? 32 : blockDim.x;
    const long long row = WARP ? (long long)blockIdx.x * 8 + (tid >> 5) : blockIdx.x;
    if (WARP && row >= p.rows) return;  // whole warps; no block barrier below in this form
    float* xs = reinterpret_cast<float*>(stage_rows) + (WARP ? (tid >> 5) * p.cols : 0);
    const float4* xr = reinterpret_cast<const float4*>(p.x + row * p.cols);
    const int n4 = p.cols >> 2;
    float m = 0.0f;
    for (int i = part; i < n4; i += parts) {
        const float4 v = xr[i];
        *reinterpret_cast<float4*>(xs + stage_smem_index(4 * i)) = v;
        m = fmaxf(m, fmaxf(fmaxf(fabsf(v.x), fabsf(v.y)), fmaxf(fabsf(v.z), fabsf(v.w))));
    }
    if (WARP) {
#pragma unroll
        for (int o = 16; o > 0; o >>= 1) m = fmaxf(m, __shfl_xor_sync(0xffffffffu, m, o));
        __syncwarp();
    } else {
        // The barrier inside block_max also makes the row in shared memory visible to every thread.
        switch (blockDim.x >> 5) {
            case 2: m = block_max<2>(m, red); break;
            case 4: m = block_max<4>(m, red); break;
            default: m = block_max<8>(m, red); break;
        }
    }
    const int e = stage_half_exponent(m);
    const float down = stage_pow2(-e);
    uint4* out = reinterpret_cast<uint4*>(p.hi + row * p.cols);
    for (int i = part; i < (p.cols >> 3); i += parts) out[i] = stage_half_chunk(xs, i >> 3, i & 7, down);
    if (part == 0) p.sums[row] = stage_pow2(e);
}
extern "C" __global__ void __launch_bounds__(256) gemm_wgmma_stage_half_rows(const WgStageParams p) { pdl_enter(); stage_half_held<false>(p); }
extern "C" __global__ void __launch_bounds__(256) gemm_wgmma_stage_half_wrows(const WgStageParams p) { pdl_enter(); stage_half_held<true>(p); }

// The block's tile: which matrix and slots (tokens) it takes, or none. Grouped, blockIdx.x is the
// weight-row tile and blockIdx.y the token tile, so the blocks of one token tile (all its row tiles)
// are consecutive in launch order: the tile's x comes from DRAM once and its row tiles read it from
// L2. (Token tiles first, the plain GEMMs' order, made each row tile a pass over every expert's x: at
// a 4K chunk the down projection's 34 MB of staged x came from DRAM once a row tile; measured 16.2 →
// 12.9 ms for moe.down at 4K on an H100, docs/PERF.md.)
template <int BT, int NT, bool GROUPED>
__device__ __forceinline__ bool tile_slots(const WgParams& p, int& matrix, int& m_begin, int& m_end) {
    if (GROUPED) return find_group_tile<NT>(p.offsets, p.t, p.count, BT, blockIdx.y, matrix, m_begin, m_end);
    matrix = p.matrix;
    m_begin = blockIdx.x * BT;
    m_end = min(m_begin + BT, p.t);
    return true;
}

// BT tokens × 64·WGS·MT weight rows (WGS warpgroups of 64·MT rows, MT m64 tiles each) in numerics NUM:
// NUM_EXACT / NUM_BF16X fold each group (MT = 1, a ring of NS = STAGES); NUM_HALF accumulates across
// groups in the MMA (a ring of NS stages, see the header).
// The end of a split-K tile (plain form): once its block has written its partial tile, the last of the
// tile's p.splits blocks to finish (a counter a tile, reset by that block for the next call) sums the
// partial tiles in split order — the same sums whichever block finishes last — into y[slot, row] for the
// tile's slots [m_begin, m_end) and rows [row0, row0 + BWO) below p.rows. The partials are read through
// L2 (other SMs wrote them); the fences order each block's writes before its arrival and the last
// block's reads after the arrivals it counted.
template <int BWO, int NT>
__device__ __forceinline__ void splitk_finish(const WgParams& p, int m_begin, int m_end, int row0) {
    __shared__ int is_last;
    __threadfence();
    __syncthreads();
    if (threadIdx.x == 0) {
        uint32_t* cnt = p.tile_count + (long long)blockIdx.y * gridDim.x + blockIdx.x;
        is_last = atomicAdd(cnt, 1u) == (uint32_t)p.splits - 1;
        if (is_last) *cnt = 0u;  // every split has arrived: the next call starts from zero
    }
    __syncthreads();
    if (!is_last) return;
    __threadfence();
    const long long plane = (long long)p.t * p.rows;
    const int live = min(BWO, p.rows - row0);
    float* y = reinterpret_cast<float*>(p.y);
    for (int i = threadIdx.x; i < (m_end - m_begin) * BWO; i += NT) {
        const int slot = m_begin + i / BWO, r = i % BWO;
        if (r >= live) continue;
        const long long o = (long long)slot * p.rows + row0 + r;
        float v = __ldcg(p.part + o);
        for (int s = 1; s < p.splits; ++s) v += __ldcg(p.part + s * plane + o);
        y[o] = v;
    }
}

// SPLITK (the plain form): blockIdx.z takes groups [z·G/S, (z+1)·G/S) of K's G groups (S = p.splits), writes
// its partial tile (the same epilogue into p.part's plane z) and the tile's last block sums them
// (splitk_finish): for GEMMs of too few tiles to fill the GPU (short prompts), whose blocks otherwise
// each walk all of K alone. S = 1 is the tile without the split.
template <int BT, int MT, int NUM, int NS, int WGS, bool SWIGLU, bool GROUPED, int BITS = 4, bool OUT16 = false, bool ROWS16 = false,
          bool LATE_SCALES = false, bool SPLITK = false>
__device__ __forceinline__ void wg_tile(const WgParams& p) {
    constexpr int NT = 128 * WGS;               // threads
    constexpr bool HALF = NUM == NUM_HALF;
    constexpr int PLANES = NUM == NUM_EXACT ? 2 : 1;
    constexpr int NSTAGE = NS;
    constexpr int BWT = 64 * WGS * MT;          // weight rows a block
    constexpr int XPLANE = BT * 128;            // bytes of one X plane a stage (BT rows of 64 16-bit values)
    constexpr int XB = PLANES * XPLANE;
    constexpr int WROW = 8 * BITS;              // bytes of codes a weight row a group (32 or 64)
    constexpr int WCH = WROW / 16;              // their 16-byte chunks (2 or 4)
    constexpr int WSH = BITS == 8 ? 2 : 1;      // log2(WCH)
    constexpr int WLD = MT * WCH / 2;           // chunks a thread loads a group (NT threads, BWT·WCH chunks)
    constexpr int WB = BWT * WROW;              // the codes: BWT rows of WROW bytes
    constexpr int SB = HALF ? 0 : BT * 4;       // the X sums (folded numerics)
    constexpr int STAGE = (XB + WB + SB + 1023) / 1024 * 1024;
    constexpr int XPASS = NT / 8;               // X rows a pass (8 chunks a row)
    constexpr int RPT = BT / XPASS;             // X rows a thread loads
    constexpr int ND = BT / 2;                  // accumulators a thread an m64 tile: 64 × BT / 128
    constexpr int BW_OUT = SWIGLU ? BWT / 2 : BWT;
    static_assert(HALF || (MT == 1 && NS == STAGES && WGS == 2), "the folded numerics take one m64 tile a warpgroup, STAGES deep, two warpgroups");
    static_assert(RPT >= 1 && BT <= NT, "every X row has a loader and every slot a sum thread");
    static_assert(NS >= 3, "the half ring needs a stage in use, one in flight and one filling");
    static_assert(BITS == 4 || (BITS == 8 && !SWIGLU && !GROUPED), "8-bit codes: the plain form");
    static_assert(!OUT16 || (HALF && GROUPED && !SWIGLU && BITS == 4), "bf16 outputs: the grouped 4-bit half form without SwiGLU");
    static_assert(!ROWS16 || (OUT16 && STAGE >= NT / 32 * 512), "16-byte output rows: bf16 outputs, a ring stage holding every warp's 512 bytes");
    static_assert(!SPLITK || (!SWIGLU && !GROUPED && !OUT16), "split K: the plain form");

    extern __shared__ __align__(16) unsigned char smem_raw[];
    __shared__ unsigned char bad[BT];           // gathered slot past x: a NaN output row
    __shared__ float tscale[HALF ? BT : 1];     // half: the slot's 2^e (the stager's per-row scale)
    const uint32_t base = (smem_addr(smem_raw) + 1023u) & ~1023u;

    const int tid = threadIdx.x, lane = tid & 31;
    const int wg = tid >> 7, warp = (tid >> 5) & 3;
    const int g = lane >> 2, q = lane & 3;
    const int rows = p.rows, cols = p.cols, groups = cols >> 6;
    // This block's groups of K: [k0, k0 + nk) (all of them without the split).
    const int k0 = SPLITK ? (int)((long long)blockIdx.z * groups / p.splits) : 0;
    const int nk = SPLITK ? (int)((long long)(blockIdx.z + 1) * groups / p.splits) - k0 : groups;

    int matrix, m_begin, m_end;
    if (!tile_slots<BT, NT, GROUPED>(p, matrix, m_begin, m_end)) return;
    const int n_tile = GROUPED ? blockIdx.x : blockIdx.y;

    // Tile row r -> (from the up matrix, output row).
    auto out_row = [&](int r) { return SWIGLU ? n_tile * BW_OUT + (r >> 4) * 8 + (r & 7) : n_tile * BW_OUT + r; };
    auto is_up = [](int r) { return SWIGLU && ((r >> 3) & 1) != 0; };

    // ---- Loaders, with 32-bit source offsets (group kt adds kt steps). X: rows tid / 8 + XPASS j, chunk
    // tid % 8 (of 16 bytes) of each plane; a row past the tile reads row 0 with a zero-fill (no bytes read).
    const int xc = tid & 7;
    uint32_t xoff[RPT];
    bool x_ok[RPT];
#pragma unroll
    for (int j = 0; j < RPT; ++j) {
        const int r = (tid >> 3) + XPASS * j;
        const int slot = m_begin + r;
        uint32_t off = 0;
        x_ok[j] = false;
        bool nan_row = false;
        long long src = 0;
        if (slot < m_end) {
            src = slot;
            if (GROUPED && p.gather) src = p.gather[slot];
            if (src < p.x_rows) {
                off = (uint32_t)(src * cols);
                x_ok[j] = true;
            } else {
                nan_row = true;
            }
        }
        if (xc == 0) {
            bad[r] = nan_row;
            if constexpr (HALF) tscale[r] = x_ok[j] ? p.xsum[src] : 0.0f;
        }
        xoff[j] = off + xc * 8 + k0 * GROUP;
    }
    // Codes: tile row tid / WCH + (NT / WCH) j, 16-byte chunk tid % WCH (row 0 of the stack, zero-filled,
    // past the rows).
    const int wh = tid & (WCH - 1);
    uint32_t wchunk[WLD];  // in 16-byte chunks of the stack (below 2^32: checked by the wrapper)
    bool w_ok[WLD], w_up[WLD];
#pragma unroll
    for (int j = 0; j < WLD; ++j) {
        const int wr = (tid >> WSH) + (NT / WCH) * j;
        const int w_out = out_row(wr);
        w_ok[j] = w_out < rows;
        w_up[j] = is_up(wr);
        wchunk[j] = (uint32_t)(((long long)matrix * rows + (w_ok[j] ? w_out : 0)) * (BITS == 8 ? cols / 16 : cols / 32)) + wh + k0 * WCH;
    }
    // X sums (folded numerics): slot tid (tid < BT).
    const float* ssrc = p.xsum;
    bool s_ok = false;
    if (!HALF && tid < BT) {
        const int slot = m_begin + tid;
        if (slot < m_end) {
            long long src = slot;
            if (GROUPED && p.gather) src = p.gather[slot];
            if (src < p.x_rows) {
                s_ok = true;
                ssrc = p.xsum + src * groups + k0;
            }
        }
    }
    // This thread's shared-memory destination in stage 0 (row tid / 8; XPASS rows further keep the same
    // swizzle: XPASS is a multiple of 8).
    const uint32_t xdst = base + (tid >> 3) * 128 + ((xc ^ ((tid >> 3) & 7)) << 4);
    const uint32_t wdst = base + XB + (tid >> WSH) * WROW + wh * 16;
    const uint32_t sdst = base + XB + WB + tid * 4;

    auto load = [&](int kt) {
        const uint32_t so = (kt % NSTAGE) * STAGE;
#pragma unroll
        for (int pl = 0; pl < PLANES; ++pl) {
#pragma unroll
            for (int j = 0; j < RPT; ++j)
                cp_async16(xdst + so + pl * XPLANE + j * XPASS * 128, (pl ? p.xl : p.xh) + xoff[j] + kt * GROUP, x_ok[j]);
        }
#pragma unroll
        for (int j = 0; j < WLD; ++j)
            cp_async16(wdst + so + j * (NT / WCH) * WROW, reinterpret_cast<const uint4*>(w_up[j] ? p.w2 : p.w) + wchunk[j] + kt * WCH, w_ok[j]);
        if (!HALF && tid < BT) {
            cp_async4(sdst + so, ssrc, s_ok);
            if (s_ok) ssrc += 1;
        }
    };

    // ---- This thread's weight rows: tile rows r0[m] and r0[m] + 8 of each m64 tile (SwiGLU: r0 a gate
    // row, r0 + 8 the up row of the same output), and the index of their first group's scale and bias
    // (group kt adds kt; below 2^32: checked by the wrapper).
    int r0[MT], o0[MT], o1[MT];
    bool ok0[MT], ok1[MT];
    uint32_t gi0[MT], gi1[MT];
#pragma unroll
    for (int m = 0; m < MT; ++m) {
        r0[m] = 64 * (MT * wg + m) + 16 * warp + g;
        o0[m] = out_row(r0[m]), o1[m] = out_row(r0[m] + 8);
        ok0[m] = o0[m] < rows, ok1[m] = o1[m] < rows;
        gi0[m] = (uint32_t)(((long long)matrix * rows + (ok0[m] ? o0[m] : 0)) * groups) + k0;
        gi1[m] = (uint32_t)(((long long)matrix * rows + (ok1[m] ? o1[m] : 0)) * groups) + k0;
    }
    const uint16_t* sc1p = SWIGLU ? p.scales2 : p.scales;
    const uint16_t* bi1p = SWIGLU ? p.biases2 : p.biases;

    // The X tile descriptor of stage 0 (a stage or k-step further: its byte offset / 16 added to the
    // start-address field, which cannot carry: shared addresses are below 2^18).
    const uint64_t d0 = wgmma_desc_sw128(base);

    float acc[MT][ND];
#pragma unroll
    for (int m = 0; m < MT; ++m)
#pragma unroll
        for (int i = 0; i < ND; ++i) acc[m][i] = 0.0f;

    if constexpr (HALF) {
        // Prefetch distance NS - 2: the stage a load refills was last read by the MMAs of the group
        // before the previous one, which every warpgroup has waited for (wgmma_wait<1> below, then the
        // barrier) by the time the load is issued.
        constexpr int D = NS - 2;
#pragma unroll
        for (int s = 0; s < D; ++s) {
            if (s < nk) load(s);
            cp_async_commit_group();
        }
        // This group's scales and biases as bf16 bits, fetched a group ahead (zero past the rows).
        uint16_t nxt[MT][4];
        auto fetch = [&](int kt) {
#pragma unroll
            for (int m = 0; m < MT; ++m) {
                nxt[m][0] = ok0[m] ? __ldg(p.scales + gi0[m] + kt) : (uint16_t)0;
                nxt[m][1] = ok0[m] ? __ldg(p.biases + gi0[m] + kt) : (uint16_t)0;
                nxt[m][2] = ok1[m] ? __ldg(sc1p + gi1[m] + kt) : (uint16_t)0;
                nxt[m][3] = ok1[m] ? __ldg(bi1p + gi1[m] + kt) : (uint16_t)0;
            }
        };
        fetch(0);
        // One group: refill, dequantise into `a` (whose last MMAs, two groups back, have completed),
        // issue its 4·MT MMAs, and leave them in flight.
        auto step = [&](int kt, uint32_t (&a)[MT][4][4]) {
            cp_async_wait_group<D - 1>();
            fence_proxy_async();
            __syncthreads();
            if (kt + D < nk) load(kt + D);
            cp_async_commit_group();
            const uint32_t so = (kt % NSTAGE) * STAGE;
            __half2 hs0[MT], hb0[MT], hs1[MT], hb1[MT];
#pragma unroll
            for (int m = 0; m < MT; ++m) half_scales(nxt[m], hs0[m], hb0[m], hs1[m], hb1[m]);
            if (kt + 1 < nk) fetch(kt + 1);
#pragma unroll
            for (int m = 0; m < MT; ++m) {
                if constexpr (BITS == 8) {
                    // Codes 16q .. 16q + 15 of the group: bytes of words x, y (k 2q, 2q+1 at step s: codes
                    // 16q + s, 16q + s + 4) and z, w (k 2q+8, 2q+9: codes 16q + 8 + s, 16q + 12 + s).
                    const uint4 wa = lds128(base + so + XB + r0[m] * WROW + q * 16);
                    const uint4 wb = lds128(base + so + XB + (r0[m] + 8) * WROW + q * 16);
#pragma unroll
                    for (int s = 0; s < 4; ++s) {
                        a[m][s][0] = half_weight_pair8(wa.x, wa.y, s, hs0[m], hb0[m]);
                        a[m][s][1] = half_weight_pair8(wb.x, wb.y, s, hs1[m], hb1[m]);
                        a[m][s][2] = half_weight_pair8(wa.z, wa.w, s, hs0[m], hb0[m]);
                        a[m][s][3] = half_weight_pair8(wb.z, wb.w, s, hs1[m], hb1[m]);
                    }
                } else {
                    // (The two-warpgroup tiles keep their own dequantisation, as measured; the
                    // warp-specialised tiles' half_tile_weights gives the same weights in fewer
                    // instructions, untimed here.)
                    const uint2 wa = lds64(base + so + XB + r0[m] * 32 + q * 8);
                    const uint2 wb = lds64(base + so + XB + (r0[m] + 8) * 32 + q * 8);
#pragma unroll
                    for (int s = 0; s < 4; ++s) {
                        a[m][s][0] = half_weight_of(((wa.x >> (4 * s)) & 0x000F000Fu) | 0x64006400u, hs0[m], hb0[m]);
                        a[m][s][1] = half_weight_of(((wb.x >> (4 * s)) & 0x000F000Fu) | 0x64006400u, hs1[m], hb1[m]);
                        a[m][s][2] = half_weight_of(((wa.y >> (4 * s)) & 0x000F000Fu) | 0x64006400u, hs0[m], hb0[m]);
                        a[m][s][3] = half_weight_of(((wb.y >> (4 * s)) & 0x000F000Fu) | 0x64006400u, hs1[m], hb1[m]);
                    }
                }
            }
            const uint64_t dst = d0 + (uint64_t)(so >> 4);
            wgmma_fence();
#pragma unroll
            for (int s = 0; s < 4; ++s) {
#pragma unroll
                for (int m = 0; m < MT; ++m) {
                    if constexpr (BT == 128) wgmma_m64n128k16_rs<true>(acc[m], a[m][s], dst + (uint64_t)((32 * s) >> 4), 1);
                    else if constexpr (BT == 32) wgmma_m64n32k16_rs<true>(acc[m], a[m][s], dst + (uint64_t)((32 * s) >> 4), 1);
                    else wgmma_m64n64k16_rs<true>(acc[m], a[m][s], dst + (uint64_t)((32 * s) >> 4), 1);
                }
            }
            wgmma_commit();
            wgmma_wait<1>();
        };
        steps_in_two_sets<MT>(nk, step);
        wgmma_wait<0>();
#pragma unroll
        for (int m = 0; m < MT; ++m) wgmma_pin(acc[m]);
    } else {
        float accg[ND];
#pragma unroll
        for (int i = 0; i < ND; ++i) accg[i] = 0.0f;
#pragma unroll
        for (int s = 0; s < STAGES - 1; ++s) {
            if (s < nk) load(s);
            cp_async_commit_group();
        }
        // The group's scales and biases as bf16 bits (zero past the matrix's rows), fetched a group
        // ahead so that their round trip overlaps the step before (LATE_SCALES: in their own step,
        // the first form, where the fold waited on them; the same values either way).
        uint16_t sb[4];
        auto fetch_sb = [&](int kt) {
            sb[0] = ok0[0] ? __ldg(p.scales + gi0[0] + kt) : (uint16_t)0;
            sb[1] = ok1[0] ? __ldg(sc1p + gi1[0] + kt) : (uint16_t)0;
            sb[2] = ok0[0] ? __ldg(p.biases + gi0[0] + kt) : (uint16_t)0;
            sb[3] = ok1[0] ? __ldg(bi1p + gi1[0] + kt) : (uint16_t)0;
        };
        if (!LATE_SCALES) fetch_sb(0);
        for (int kt = 0; kt < nk; ++kt) {
            cp_async_wait_group<STAGES - 2>();
            fence_proxy_async();
            __syncthreads();
            if (kt + STAGES - 1 < nk) load(kt + STAGES - 1);
            cp_async_commit_group();

            const uint32_t st = base + (kt % STAGES) * STAGE;
            // This group's scales and biases in f32, the centred codes' bias (b + centre·s; zero past
            // the rows, where the bits are zero).
            if (LATE_SCALES) fetch_sb(kt);
            const float s0 = bf16_to_f32(sb[0]), s1 = bf16_to_f32(sb[1]);
            constexpr float CENTRE = BITS == 8 ? 128.0f : 8.0f;
            const float b0 = fmaf(CENTRE, s0, bf16_to_f32(sb[2]));
            const float b1 = fmaf(CENTRE, s1, bf16_to_f32(sb[3]));
            if (!LATE_SCALES && kt + 1 < nk) fetch_sb(kt + 1);
            uint32_t a[4][4];
            if constexpr (BITS == 8) {
                // The 16 codes as in the half 8-bit path (words x, y: k 2q, 2q+1 of step s; z, w: k 2q+8, 2q+9).
                const uint4 wa = lds128(st + XB + r0[0] * WROW + q * 16);
                const uint4 wb = lds128(st + XB + (r0[0] + 8) * WROW + q * 16);
#pragma unroll
                for (int s = 0; s < 4; ++s) {
                    a[s][0] = code_pair8(wa.x, wa.y, s);
                    a[s][1] = code_pair8(wb.x, wb.y, s);
                    a[s][2] = code_pair8(wa.z, wa.w, s);
                    a[s][3] = code_pair8(wb.z, wb.w, s);
                }
            } else {
                const uint2 wa = lds64(st + XB + r0[0] * 32 + q * 8);
                const uint2 wb = lds64(st + XB + (r0[0] + 8) * 32 + q * 8);
#pragma unroll
                for (int s = 0; s < 4; ++s) {
                    a[s][0] = code_pair(wa.x, s);
                    a[s][1] = code_pair(wb.x, s);
                    a[s][2] = code_pair(wa.y, s);
                    a[s][3] = code_pair(wb.y, s);
                }
            }
            const uint64_t dst = d0 + (uint64_t)(((kt % STAGES) * STAGE) >> 4);  // this stage's X descriptor
            wgmma_fence();
#pragma unroll
            for (int s = 0; s < 4; ++s) {
#pragma unroll
                for (int pl = 0; pl < PLANES; ++pl) {
                    const uint64_t d = dst + (uint64_t)((pl * XPLANE + 32 * s) >> 4);
                    if constexpr (BT == 128) wgmma_m64n128k16_rs(accg, a[s], d, (s | pl) != 0);
                    else wgmma_m64n64k16_rs(accg, a[s], d, (s | pl) != 0);
                }
            }
            wgmma_commit();
            wgmma_wait<0>();
            wgmma_pin(accg);
            // Fold: tokens 8j + 2q + e.
            const uint32_t sums = st + XB + WB;
#pragma unroll
            for (int j = 0; j < BT / 8; ++j) {
                const uint2 xv = lds64(sums + (8 * j + 2 * q) * 4);
                const float x0 = __uint_as_float(xv.x), x1 = __uint_as_float(xv.y);
                acc[0][4 * j + 0] = fmaf(s0, accg[4 * j + 0], fmaf(b0, x0, acc[0][4 * j + 0]));
                acc[0][4 * j + 1] = fmaf(s0, accg[4 * j + 1], fmaf(b0, x1, acc[0][4 * j + 1]));
                acc[0][4 * j + 2] = fmaf(s1, accg[4 * j + 2], fmaf(b1, x0, acc[0][4 * j + 2]));
                acc[0][4 * j + 3] = fmaf(s1, accg[4 * j + 3], fmaf(b1, x1, acc[0][4 * j + 3]));
            }
        }
    }
    cp_async_wait_group<0>();

    if constexpr (ROWS16) {
        // Through the ring's stage of group nk: its last reader, group nk − NS, completed in every
        // warpgroup before the last step's barrier, and no copy is in flight (each warp 512 bytes of it).
        if ((rows & 7) == 0 && (n_tile + 1) * BW_OUT <= rows && (reinterpret_cast<uintptr_t>(p.y) & 15) == 0) {
            store_tile16_rows<MT, BT>(acc, p.y, rows, m_begin, m_end, lane, o0, base + (nk % NSTAGE) * STAGE + (tid >> 5) * 512,
                                      [&](int tok) { return tscale[tok]; }, [&](int tok) { return bad[tok] != 0; });
            return;
        }
    }
    if constexpr (SPLITK) {
        store_tile<MT, BT, false>(acc, p.part + (long long)blockIdx.z * p.t * rows, rows, m_begin, m_end, q, o0, o1, ok0, ok1,
                                  [&](int tok) { return HALF ? tscale[tok] : 1.0f; }, [&](int tok) { return bad[tok] != 0; });
        splitk_finish<BW_OUT, NT>(p, m_begin, m_end, n_tile * BW_OUT);
        return;
    }
    store_tile<MT, BT, SWIGLU, OUT16>(acc, p.y, rows, m_begin, m_end, q, o0, o1, ok0, ok1, [&](int tok) { return HALF ? tscale[tok] : 1.0f; },
                               [&](int tok) { return bad[tok] != 0; });
}

// The copies of one tile into a persistent tile's ring (128 loading threads, 128 X rows of 8 chunks,
// 2·WLD·64 code rows of 2 chunks): thread tid copies X rows tid / 8 + 16j (chunk tid % 8; a slot past
// the tile or a gathered row past x zero-filled) and code rows tid / 2 + 64j (chunk tid % 2; rows past
// the matrix zero-filled; SwiGLU: the up rows from w2).
template <int XRPT, int WLD>
struct RingTile {
    uint32_t xoff[XRPT], wchunk[WLD];
    uint32_t x_ok, w_ok, w_up;

    template <bool SWIGLU, bool GROUPED, int BW_OUT>
    __device__ __forceinline__ void set(const WgParams& p, int tid, int matrix, int m_begin, int m_end, int n_tile) {
        const int xc = tid & 7, wh = tid & 1;
        uint32_t xm = 0;
#pragma unroll
        for (int j = 0; j < XRPT; ++j) {
            const int slot = m_begin + (tid >> 3) + 16 * j;
            long long src = 0;
            bool ok = false;
            if (slot < m_end) {
                src = (GROUPED && p.gather) ? (long long)p.gather[slot] : (long long)slot;
                ok = src < p.x_rows;
            }
            xoff[j] = (uint32_t)((ok ? src : 0) * p.cols) + xc * 8;
            xm |= (uint32_t)ok << j;
        }
        uint32_t wm = 0, um = 0;
#pragma unroll
        for (int j = 0; j < WLD; ++j) {
            const int wr = (tid >> 1) + 64 * j;
            const int o = SWIGLU ? n_tile * BW_OUT + (wr >> 4) * 8 + (wr & 7) : n_tile * BW_OUT + wr;
            const bool ok = o < p.rows;
            wm |= (uint32_t)ok << j;
            um |= (uint32_t)(SWIGLU && ((wr >> 3) & 1)) << j;
            wchunk[j] = (uint32_t)(((long long)matrix * p.rows + (ok ? o : 0)) * (p.cols / 32)) + wh;
        }
        x_ok = xm, w_ok = wm, w_up = um;
    }

    // Group kt's copies, into the stage whose X and code parts this thread writes at xdst and wdst.
    // With all = false only the first 128 X rows (a two-part tile of at most 128 slots: its second
    // part's MMAs do not run).
    __device__ __forceinline__ void copy(const WgParams& p, uint32_t xdst, uint32_t wdst, int kt, bool all = true) const {
#pragma unroll
        for (int j = 0; j < XRPT; ++j)
            if (j < 8 || all) cp_async16(xdst + j * 16 * 128, p.xh + xoff[j] + kt * GROUP, (x_ok >> j) & 1);
        copy_codes(p, wdst, kt);
    }
    // Group kt's codes only (the X rows come another way: the cluster pairs' TMA).
    __device__ __forceinline__ void copy_codes(const WgParams& p, uint32_t wdst, int kt) const {
#pragma unroll
        for (int j = 0; j < WLD; ++j)
            cp_async16(wdst + j * 64 * 32, reinterpret_cast<const uint4*>(((w_up >> j) & 1) ? p.w2 : p.w) + wchunk[j] + kt * 2, (w_ok >> j) & 1);
    }
};

// ---- The warp-specialised, persistent tiles (half numerics, 4-bit codes, BT = 128 tokens).
// 1 + CWG warpgroups a block, one block an SM, each block walking tiles blockIdx.x, + gridDim.x, ...:
// the first (the producer, its registers given back) fills a ring of NS stages (X and codes, the layout
// of wg_tile's stages) with cp.async and marks each stage full on an mbarrier once its copies have
// landed; the others (CWG = 2 or 4 consumers, 64·MT weight rows each) wait for a stage, dequantise
// their codes from it, issue their MMAs, and mark the stage before it empty once those have completed
// (wgmma_wait<1>; with four consumers, one register set each: the stage itself after wgmma_wait<0>). No
// block-wide barrier in the main loop; the producer runs on into the next tile while the consumers write
// the last one out. Grouped: token tiles as find_group_tile's, from a prefix over experts computed once
// a block (group_tile_prefix); a tile index is (token tile, row tile) with row tiles fastest (grouped) or
// token tiles fastest (plain), the launch orders of wg_tile.
//
// N2 > 0: tiles of 128 + N2 tokens, a first part of 128 and a second of N2 (32, 64 or 128; MT = 1, two
// consumer warpgroups): each weight a consumer dequantises feeds the MMAs of both parts, so an expert
// of up to 128 + N2 slots is one tile, its weights dequantised once (with N2 = 128 the dequantisation
// and its issue slots a FLOP also halve); the second part's copies (N2 = 32, 64: and MMAs) run only
// where the tile has more than 128 slots (a grouped tile ends at its expert's last slot). With N2 = 128
// the MMAs always run: a second main loop without them made ptxas serialise every MMA of the tile
// (C7515; ncu put a third of the warps' stall samples on the waits it inserts). OUT16: the outputs in bf16
// (store_tile's), the grouped form without SwiGLU.
//
// CL = 2 (N2 = 128, the plain forms): cluster pairs. The two blocks of a cluster take the same token
// tile and adjacent row tiles (2j, 2j + 1; the row tiles must be even), so each stage's 256 X rows are
// the same for both: block r's producer copies rows 128r .. 128r + 127 with one TMA copy (the staged
// plane's descriptor `xmap`, 128-byte swizzle: the cp.async layout) multicast into both blocks, and its
// own codes by cp.async. Each X tile leaves L2 once for two row tiles: half the L2 traffic a FLOP of
// CL = 1, whose tiles are bound by re-reading X (PERF.md 2026-12-06, fifteenth session). A stage is
// full once its codes (128 arrivals) and both halves' bytes (one expect_tx) have landed, and free once
// the consumers of both blocks have released it (each consumer warp arrives on both blocks' empty
// barriers), so neither producer overwrites what the other block still reads.

template <int MT, int NS, bool SWIGLU, bool GROUPED, int CWG = 2, int N2 = 0, bool OUT16 = false, int CL = 1, bool ROWS16 = false,
          bool FAST_SILU = false>
__device__ __forceinline__ void wg_tile_ws(const WgParams& p, const TmaDesc* xmap = nullptr) {
    constexpr int BH = 128;                      // tokens of the first part (an MMA's N)
    constexpr int BT = BH + N2;                  // tokens a tile
    constexpr int THREADS = 128 * (CWG + 1);     // the producer warpgroup and CWG consumer warpgroups
    constexpr int BWT = 64 * CWG * MT;           // weight rows a tile
    constexpr int XB = BT * 128;                 // X bytes a stage: BT rows of 64 f16
    constexpr int WB = BWT * 32;                 // codes a stage: BWT rows of 64 4-bit codes
    constexpr int STAGE = (XB + WB + 1023) / 1024 * 1024;
    constexpr int ND = BH / 2;                   // accumulators a thread an m64 tile of one half
    constexpr int BW_OUT = SWIGLU ? BWT / 2 : BWT;
    constexpr int XRPT = BT / 16;                // X rows a producer thread loads (128 threads, 8 chunks a row)
    constexpr int WLD = BWT * 2 / 128;           // 16-byte code chunks a producer thread loads (2 a row)
    // The consumers take what the producer gives back (setmaxnreg moves registers within the block's
    // launch allocation: ptxas allocates 168 a thread at 384 threads, 96 at 640): 128 · (168 − 40) =
    // 256 · (232 − 168), and 128 · (96 − 32) = 512 · (112 − 96) (at 104 ptxas serialises the MMAs).
    // Four consumer warpgroups hold one register set of weights each, each group's MMAs completed
    // before the next is dequantised (the other warpgroups' MMAs keep the tensor cores busy
    // meanwhile); two keep two sets in flight.
    constexpr bool SINGLE = CWG > 2;
    // The two-part tiles' producer holds more X rows' offsets: 56 = 168 − 2 · (224 − 168).
    constexpr int PRODUCER_REGS = CWG > 2 ? 32 : (N2 > 0 ? 56 : 40), CONSUMER_REGS = CWG > 2 ? 112 : (N2 > 0 ? 224 : 232);
    static_assert(CWG == 2 || (CWG == 4 && MT == 1), "two consumer warpgroups, or four of one m64 tile each");
    static_assert(N2 == 0 || ((N2 == 32 || N2 == 64 || N2 == 128) && MT == 1 && CWG == 2), "two-part tiles: two consumer warpgroups of one m64 tile");
    static_assert(!OUT16 || (GROUPED && !SWIGLU), "bf16 outputs: the grouped form without SwiGLU");
    static_assert(!ROWS16 || (OUT16 && CWG == 2), "16-byte output rows: bf16 outputs, two consumer warpgroups");
    static_assert(CL == 1 || (CL == 2 && N2 == 128 && !GROUPED), "cluster pairs: the plain 256-token tiles"); 

    extern __shared__ __align__(16) unsigned char smem_raw[];
    __shared__ __align__(8) uint64_t bars[2 * NS];   // full[s], then empty[s]
    __shared__ int tprefix[GROUPED ? 2 * THREADS + 1 : 1];
    __shared__ float tsc[2][BT];                 // the tile's slots' 2^e (NaN: a gathered row past x), by tile parity
    __shared__ __align__(16) unsigned char obuf[ROWS16 ? 8 * 512 : 16];  // ROWS16: each consumer warp's output rows
    const uint32_t base = (smem_addr(smem_raw) + 1023u) & ~1023u;
    const uint32_t full0 = smem_addr(bars), empty0 = full0 + 8 * NS;

    const int tid = threadIdx.x;
    const int rows = p.rows, cols = p.cols, nk = cols >> 6;
    if (tid == 0) {
        for (int s = 0; s < NS; ++s) {
            // Every producer thread, once its copies have landed (and with CL = 2 the expect_tx).
            mbar_init(full0 + 8 * s, CL == 2 ? 129 : 128);
            mbar_init(empty0 + 8 * s, 4 * CWG * CL);  // every consumer warp (of both blocks), once its MMAs have read the stage
        }
        if constexpr (CL == 2) mbar_init_fence_cluster();
    }
    int m_tiles;
    if constexpr (GROUPED) m_tiles = group_tile_prefix<THREADS>(p.offsets, p.t, p.count, BT, tprefix);
    else m_tiles = (p.t + BT - 1) / BT;
    __syncthreads();
    uint32_t rank = 0;  // the block's rank in its cluster pair
    if constexpr (CL == 2) {
        asm volatile("mov.u32 %0, %%cluster_ctarank;" : "=r"(rank));
        cluster_arrive();  // both blocks' barriers initialised before either copies or arrives into the other
        cluster_wait();
    }
    const int row_tiles = (rows + BW_OUT - 1) / BW_OUT;
    const int n_tiles = m_tiles * (row_tiles / CL);  // CL = 2: tile pairs (the wrapper asks for even row tiles)

    // Tile i: (matrix, slots [m_begin, m_end), row tile).
    auto tile_of = [&](int i, int& matrix, int& m_begin, int& m_end, int& n_tile) {
        if constexpr (GROUPED) {
            const int mt = i / row_tiles;
            n_tile = i - mt * row_tiles;
            group_tile_at(tprefix, p.offsets, p.t, p.count, BT, mt, matrix, m_begin, m_end);
        } else {
            const int mt = i % m_tiles;
            n_tile = CL == 2 ? (i / m_tiles) * 2 + (int)rank : i / m_tiles;
            matrix = p.matrix;
            m_begin = mt * BT;
            m_end = min(m_begin + BT, p.t);
        }
    };
    // Tile row r -> output row (SwiGLU: gate rows 16i..16i+7, up rows 16i+8..16i+15 of outputs 8i..8i+7).
    auto out_row = [&](int n_tile, int r) { return SWIGLU ? n_tile * BW_OUT + (r >> 4) * 8 + (r & 7) : n_tile * BW_OUT + r; };

    if (tid < 128) {
        // ---- Producer.
        regs_release<PRODUCER_REGS>();
        const int xc = tid & 7, wh = tid & 1;
        const uint32_t xdst = base + (tid >> 3) * 128 + ((xc ^ ((tid >> 3) & 7)) << 4);
        const uint32_t wdst = base + XB + (tid >> 1) * 32 + wh * 16;
        int s = 0;
        uint32_t ph = 0;
        for (int i = blockIdx.x / CL; i < n_tiles; i += gridDim.x / CL) {
            int matrix, m_begin, m_end, n_tile;
            tile_of(i, matrix, m_begin, m_end, n_tile);
            RingTile<XRPT, WLD> rt;
            rt.template set<SWIGLU, GROUPED, BW_OUT>(p, tid, matrix, m_begin, m_end, n_tile);
            const bool two = N2 > 0 && m_end - m_begin > BH;
#pragma unroll 1
            for (int kt = 0; kt < nk; ++kt) {
                mbar_wait(empty0 + 8 * s, ph ^ 1);
                const uint32_t so = s * STAGE;
                if constexpr (CL == 2) {
                    // This block's half of the X rows into both blocks (both halves' bytes expected here).
                    if (tid == 0) {
                        mbar_arrive_expect_tx(full0 + 8 * s, 2 * BH * 128);
                        tma_load_2d_multicast(base + so + rank * (BH * 128), xmap, kt * GROUP, m_begin + (int)rank * BH, full0 + 8 * s, 0x3);
                    }
                    rt.copy_codes(p, wdst + so, kt);
                } else {
                    rt.copy(p, xdst + so, wdst + so, kt, N2 == 0 || two);
                }
                mbar_arrive_on_copies(full0 + 8 * s);
                if (++s == NS) {
                    s = 0;
                    ph ^= 1;
                }
            }
        }
        asm volatile("cp.async.wait_all;" ::: "memory");
        if constexpr (CL == 2) {
            cluster_arrive();  // no block leaves while the other may still copy or arrive into it
            cluster_wait();
        }
        return;
    }

    // ---- Consumers: warpgroup wc (0 .. CWG − 1) takes tile rows 64·MT·wc .. + 64·MT.
    regs_claim<CONSUMER_REGS>();
    const int ct = tid - 128, lane = tid & 31;
    const int wc = ct >> 7, warp = (ct >> 5) & 3;
    const int g = lane >> 2, q = lane & 3;
    const int groups = nk;
    const uint16_t* sc1p = SWIGLU ? p.scales2 : p.scales;
    const uint16_t* bi1p = SWIGLU ? p.biases2 : p.biases;
    const uint64_t d0 = wgmma_desc_sw128(base);
    int s = 0;
    uint32_t ph = 0;
    int parity = 0;
    // A consumer warp has read stage st (CL = 2: in both blocks' empty barriers).
    auto release = [&](int st) {
        if constexpr (CL == 2) {
            mbar_arrive_cluster(empty0 + 8 * st, 0);
            mbar_arrive_cluster(empty0 + 8 * st, 1);
        } else {
            mbar_arrive(empty0 + 8 * st);
        }
    };
#pragma unroll 1
    for (int i = blockIdx.x / CL; i < n_tiles; i += gridDim.x / CL, parity ^= 1) {
        int matrix, m_begin, m_end, n_tile;
        tile_of(i, matrix, m_begin, m_end, n_tile);
        // The slots' scales (2^e of the staged row; NaN for a gathered row past x), by the first
        // consumer warpgroup; the consumers' barrier also keeps a warpgroup two tiles ahead from
        // overwriting what the other still reads.
        if (ct < BT) tsc[parity][ct] = slot_scale<GROUPED>(p, m_begin + ct, m_end);
        named_barrier_sync(1, 128 * CWG);
        const bool two = N2 > 0 && m_end - m_begin > BH;  // the second part's MMAs run
        // ROWS16: the tile's outputs as 16-byte rows where its weight rows all exist (else one at a time).
        const bool rows16 = ROWS16 && (rows & 7) == 0 && (n_tile + 1) * BW_OUT <= rows && (reinterpret_cast<uintptr_t>(p.y) & 15) == 0;

        int r0[MT], o0[MT], o1[MT];
        bool ok0[MT], ok1[MT];
        uint32_t gi0[MT], gi1[MT];  // the rows' first scale (group kt adds kt; below 2^32: checked by the wrapper)
#pragma unroll
        for (int m = 0; m < MT; ++m) {
            r0[m] = 64 * (MT * wc + m) + 16 * warp + g;
            o0[m] = out_row(n_tile, r0[m]), o1[m] = out_row(n_tile, r0[m] + 8);
            ok0[m] = o0[m] < rows, ok1[m] = o1[m] < rows;
            // Rows past the matrix read row 0's scales (their outputs are not written).
            gi0[m] = (uint32_t)(((long long)matrix * rows + (ok0[m] ? o0[m] : 0)) * groups);
            gi1[m] = (uint32_t)(((long long)matrix * rows + (ok1[m] ? o1[m] : 0)) * groups);
        }
        uint16_t nxt[MT][4];
        auto fetch = [&](int kt) {
#pragma unroll
            for (int m = 0; m < MT; ++m) {
                nxt[m][0] = __ldg(p.scales + gi0[m] + kt);
                nxt[m][1] = __ldg(p.biases + gi0[m] + kt);
                nxt[m][2] = __ldg(sc1p + gi1[m] + kt);
                nxt[m][3] = __ldg(bi1p + gi1[m] + kt);
            }
        };
        fetch(0);
        int prev = -1;
        // The tile's main loop and stores; BOTH: the second part's MMAs and stores too (a compile-time
        // flag, so that no branch sits between a group's MMAs: ptxas fences each MMA of a conditional
        // sequence). Each form declares its own accumulators: with the two main loops sharing them,
        // ptxas serialised every MMA of the two-part tiles (C7515).
        auto run_tile = [&](auto both) {
            constexpr bool BOTH = decltype(both)::value;
            float acc[MT][ND];                   // the first part [m64 tile][fragment]
            float acc2[1][BOTH ? N2 / 2 : 1];    // the second part's
#pragma unroll
            for (int m = 0; m < MT; ++m)
#pragma unroll
                for (int e = 0; e < ND; ++e) acc[m][e] = 0.0f;
            if constexpr (BOTH) {
#pragma unroll
                for (int e = 0; e < N2 / 2; ++e) acc2[0][e] = 0.0f;
            }
            auto step = [&](int kt, uint32_t (&a)[MT][4][4]) {
                mbar_wait(full0 + 8 * s, ph);
                fence_proxy_async();
                const uint32_t so = s * STAGE;
                __half2 hs0[MT], hb0[MT], hs1[MT], hb1[MT];
#pragma unroll
                for (int m = 0; m < MT; ++m) half_scales(nxt[m], hs0[m], hb0[m], hs1[m], hb1[m]);
                if (kt + 1 < nk) fetch(kt + 1);
#pragma unroll
                for (int m = 0; m < MT; ++m) half_tile_weights(base + so + XB, r0[m], q, hs0[m], hb0[m], hs1[m], hb1[m], a[m]);
                const uint64_t dst = d0 + (uint64_t)(so >> 4);
                wgmma_fence();
#pragma unroll
                for (int k = 0; k < 4; ++k) {
#pragma unroll
                    for (int m = 0; m < MT; ++m) wgmma_m64n128k16_rs<true>(acc[m], a[m][k], dst + (uint64_t)((32 * k) >> 4), 1);
                    // The second part's X rows start BH rows (BH · 128 bytes, whole swizzle atoms) on.
                    // (N2 made value-dependent on `both`, so that the call is instantiated only where it runs.)
                    if constexpr (BOTH) wgmma_rs_n<decltype(both)::value * N2>(acc2[0], a[0][k], dst + (uint64_t)((BH * 128 + 32 * k) >> 4));
                }
                wgmma_commit();
                if constexpr (SINGLE) {
                    wgmma_wait<0>();
                    if (lane == 0) release(s);  // this stage has been read
                } else {
                    wgmma_wait<1>();
                    // The stage before this one has been read by this warp's MMAs.
                    if (prev >= 0 && lane == 0) release(prev);
                    prev = s;
                }
                if (++s == NS) {
                    s = 0;
                    ph ^= 1;
                }
            };
            if constexpr (SINGLE) {
                uint32_t a0[MT][4][4];
#pragma unroll 1
                for (int kt = 0; kt < nk; ++kt) step(kt, a0);
            } else {
                steps_in_two_sets<MT>(nk, step);
                wgmma_wait<0>();
                if (lane == 0) release(prev);
            }
#pragma unroll
            for (int m = 0; m < MT; ++m) wgmma_pin(acc[m]);
            if constexpr (BOTH) wgmma_pin(acc2[0]);
            if constexpr (ROWS16) {
                if (rows16) {
                    const uint32_t buf = smem_addr(obuf) + (ct >> 5) * 512;
                    store_tile16_rows<MT, BH>(acc, p.y, rows, m_begin, m_end, lane, o0, buf, [&](int tok) { return tsc[parity][tok]; },
                                              [](int) { return false; });
                    if constexpr (BOTH) {
                        if (two)
                            store_tile16_rows<1, N2>(acc2, p.y, rows, m_begin + BH, m_end, lane, o0, buf,
                                                     [&](int tok) { return tsc[parity][BH + tok]; }, [](int) { return false; });
                    }
                    return;
                }
            }
            store_tile<MT, BH, SWIGLU, OUT16, FAST_SILU>(acc, p.y, rows, m_begin, m_end, q, o0, o1, ok0, ok1, [&](int tok) { return tsc[parity][tok]; },
                                                         [](int) { return false; });
            if constexpr (BOTH) {
                if (two)
                    store_tile<1, N2, SWIGLU, OUT16, FAST_SILU>(acc2, p.y, rows, m_begin + BH, m_end, q, o0, o1, ok0, ok1,
                                                     [&](int tok) { return tsc[parity][BH + tok]; }, [](int) { return false; });
            }
        };
        // N2 = 128: both parts' MMAs always (see the header: C7515 at this tile's register count).
        if constexpr (N2 == 128) run_tile(Flag<true>{});
        else if constexpr (N2 > 0) {
            if (two) run_tile(Flag<true>{});
            else run_tile(Flag<false>{});
        } else run_tile(Flag<false>{});
    }
    if constexpr (CL == 2) {
        cluster_arrive();
        cluster_wait();
    }
}

// ---- The shared-memory-A tiles (half numerics, 4-bit codes, 256 weight rows × 128 tokens; wg_tile_ss).
// Three warpgroups, one block an SM walking the tiles in wg_tile_ws's order. Warpgroup 0 loads and
// transforms: it copies each group's X rows and codes into a ring of NX stages (cp.async, running
// NX - 1 groups ahead, across tiles), and once a group's codes have landed it dequantises them once
// into f16 weights in shared memory (a ring of NA slots) in the wgmma K-major, 128-byte-swizzled layout
// — chunk c = 2s + h of a row holds the pairs s (half_weights4) of its words h, h + 2, h + 4, h + 6, which
// are the staged X's columns 8c .. 8c + 7 (see the header's permutation), so A and X meet in the same
// order — then marks the slot ready. Warpgroups 1 and 2 take 128 weight rows each (two m64 tiles, 128
// accumulators a thread, no weights in registers): per group they wait for the slot, issue 8 MMAs
// with both operands from shared memory, and once the MMAs of the group before have completed
// (wgmma_wait<1>) mark that group's X stage and weight slot free. Against the register-A tiles: each
// weight is dequantised once for 128 tokens by one warpgroup beside the MMAs of the group before, and
// each X tile serves 256 weight rows (half the X traffic a FLOP of wg_tile_ws<1>). The weights and the
// sums are wg_tile's (the same f16 weights, the same MMA order over K): bit for bit its outputs.
template <int NX, int NA, bool SWIGLU, bool GROUPED>
__device__ __forceinline__ void wg_tile_ss(const WgParams& p) {
    constexpr int BT = 128, THREADS = 384, BWT = 256;
    constexpr int XB = BT * 128;           // X bytes a stage: BT rows of 64 f16
    constexpr int XSTAGE = XB + BWT * 32;  // and the codes: BWT rows of 64 4-bit codes
    constexpr int ASLOT = BWT * 128;       // the dequantised weights: BWT rows of 64 f16
    constexpr int ND = BT / 2;             // accumulators a thread an m64 tile
    constexpr int BW_OUT = SWIGLU ? BWT / 2 : BWT;
    constexpr int XRPT = BT / 16;          // X rows a loader thread copies (128 threads, 8 chunks a row)
    constexpr int WLD = BWT * 2 / 128;     // 16-byte code chunks a loader thread copies (2 a row)
    static_assert(XSTAGE % 1024 == 0 && ASLOT % 1024 == 0 && NA >= 2 && NX >= 3, "1024-byte aligned stages; two slots at least");

    extern __shared__ __align__(16) unsigned char smem_raw[];
    __shared__ __align__(8) uint64_t bars[NX + 2 * NA];  // xfree[NX], ready[NA], afree[NA]
    __shared__ int tprefix[GROUPED ? 2 * THREADS + 1 : 1];
    __shared__ float tsc[2][BT];                         // the tile's slots' 2^e (NaN: a gathered row past x), by tile parity
    const uint32_t base = (smem_addr(smem_raw) + 1023u) & ~1023u;
    const uint32_t abase = base + NX * XSTAGE;
    const uint32_t xfree0 = smem_addr(bars), ready0 = xfree0 + 8 * NX, afree0 = ready0 + 8 * NA;

    const int tid = threadIdx.x;
    const int rows = p.rows, cols = p.cols, nk = cols >> 6;
    if (tid == 0) {
        for (int s = 0; s < NX; ++s) mbar_init(xfree0 + 8 * s, 8);  // every consumer warp, its MMAs done
        for (int s = 0; s < NA; ++s) {
            mbar_init(ready0 + 8 * s, 128);  // every loader thread, its rows written
            mbar_init(afree0 + 8 * s, 8);
        }
    }
    int m_tiles;
    if constexpr (GROUPED) m_tiles = group_tile_prefix<THREADS>(p.offsets, p.t, p.count, BT, tprefix);
    else m_tiles = (p.t + BT - 1) / BT;
    __syncthreads();
    const int row_tiles = (rows + BW_OUT - 1) / BW_OUT;
    const int n_tiles = m_tiles * row_tiles;
    auto tile_of = [&](int i, int& matrix, int& m_begin, int& m_end, int& n_tile) {
        if constexpr (GROUPED) {
            const int mt = i / row_tiles;
            n_tile = i - mt * row_tiles;
            group_tile_at(tprefix, p.offsets, p.t, p.count, BT, mt, matrix, m_begin, m_end);
        } else {
            const int mt = i % m_tiles;
            n_tile = i / m_tiles;
            matrix = p.matrix;
            m_begin = mt * BT;
            m_end = min(m_begin + BT, p.t);
        }
    };
    auto out_row = [&](int n_tile, int r) { return SWIGLU ? n_tile * BW_OUT + (r >> 4) * 8 + (r & 7) : n_tile * BW_OUT + r; };
    auto is_up = [](int r) { return SWIGLU && ((r >> 3) & 1) != 0; };

    if (tid < 128) {
        // ---- Loader and transformer. The copy cursor (tile ci, group ckt) runs NX - 1 groups ahead of
        // the transform (global group index G over this block's tiles).
        const int xc = tid & 7, wh = tid & 1;
        const uint32_t xdst = base + (tid >> 3) * 128 + ((xc ^ ((tid >> 3) & 7)) << 4);
        const uint32_t wdst = base + XB + (tid >> 1) * 32 + wh * 16;
        int ci = blockIdx.x, ckt = 0, cG = 0;
        RingTile<XRPT, WLD> rt;
        auto copy_tile = [&](int i) {
            int matrix, m_begin, m_end, n_tile;
            tile_of(i, matrix, m_begin, m_end, n_tile);
            rt.template set<SWIGLU, GROUPED, BW_OUT>(p, tid, matrix, m_begin, m_end, n_tile);
        };
        if (ci < n_tiles) copy_tile(ci);
        // Copies group cG into stage cG % NX once the consumers have freed it (its group NX before);
        // one commit group a call, empty past the last tile.
        auto copy_next = [&]() {
            if (ci < n_tiles) {
                const int st = cG % NX;
                mbar_wait(xfree0 + 8 * st, ((cG / NX) & 1) ^ 1);
                const uint32_t so = st * XSTAGE;
                rt.copy(p, xdst + so, wdst + so, ckt);
                if (++ckt == nk) {
                    ckt = 0;
                    ci += gridDim.x;
                    if (ci < n_tiles) copy_tile(ci);
                }
            }
            cp_async_commit_group();
            ++cG;
        };
#pragma unroll 1
        for (int j = 0; j < NX - 1; ++j) copy_next();

        int G = 0;
#pragma unroll 1
        for (int i = blockIdx.x; i < n_tiles; i += gridDim.x) {
            int matrix, m_begin, m_end, n_tile;
            tile_of(i, matrix, m_begin, m_end, n_tile);
            // This thread dequantises tile rows tid and tid + 128.
            uint32_t gi[2];
            const uint16_t* sp[2];
            const uint16_t* bp[2];
#pragma unroll
            for (int h = 0; h < 2; ++h) {
                const int r = tid + 128 * h;
                const int o = out_row(n_tile, r);
                gi[h] = (uint32_t)(((long long)matrix * rows + (o < rows ? o : 0)) * nk);  // past the rows: row 0's (not written out)
                sp[h] = is_up(r) ? p.scales2 : p.scales;
                bp[h] = is_up(r) ? p.biases2 : p.biases;
            }
            uint16_t nxt[2][2];
            auto fetch = [&](int kt) {
#pragma unroll
                for (int h = 0; h < 2; ++h) {
                    nxt[h][0] = __ldg(sp[h] + gi[h] + kt);
                    nxt[h][1] = __ldg(bp[h] + gi[h] + kt);
                }
            };
            fetch(0);
#pragma unroll 1
            for (int kt = 0; kt < nk; ++kt, ++G) {
                cp_async_wait_group<NX - 2>();  // group G's copies (this thread's) have landed
                named_barrier_sync(2, 128);      // everyone's; and group G - 1's codes are no longer read
                const int xs = G % NX, as = G % NA;
                __half2 hs[2], hb[2];
#pragma unroll
                for (int h = 0; h < 2; ++h) {
                    hs[h] = __float2half2_rn(bf16_to_f32(nxt[h][0]));
                    hb[h] = __float2half2_rn(bf16_to_f32(nxt[h][1]));
                }
                if (kt + 1 < nk) fetch(kt + 1);
                mbar_wait(afree0 + 8 * as, ((G / NA) & 1) ^ 1);
#pragma unroll
                for (int h = 0; h < 2; ++h) {
                    const int r = tid + 128 * h;
                    const uint32_t src = base + xs * XSTAGE + XB + r * 32;
                    const uint4 c0 = lds128(src), c1 = lds128(src + 16);
                    const uint32_t wd[8] = {c0.x, c0.y, c0.z, c0.w, c1.x, c1.y, c1.z, c1.w};
                    uint32_t pr[8][4];
#pragma unroll
                    for (int j = 0; j < 8; ++j) half_weights4(wd[j], hs[h], hb[h], pr[j][0], pr[j][1], pr[j][2], pr[j][3]);
                    const uint32_t dst = abase + as * ASLOT + r * 128;
#pragma unroll
                    for (int c = 0; c < 8; ++c) {
                        const int st = c >> 1, hh = c & 1;
                        asm volatile("st.shared.v4.b32 [%0], {%1, %2, %3, %4};" ::"r"(dst + ((c ^ (r & 7)) << 4)), "r"(pr[hh][st]), "r"(pr[hh + 2][st]),
                                     "r"(pr[hh + 4][st]), "r"(pr[hh + 6][st])
                                     : "memory");
                    }
                }
                fence_proxy_async();
                mbar_arrive(ready0 + 8 * as);
                copy_next();  // group G + NX - 1, into the stage of group G - 1
            }
        }
        asm volatile("cp.async.wait_all;" ::: "memory");
        return;
    }

    // ---- Consumers: warpgroup wc (0, 1) takes tile rows 128·wc .. + 128 (m64 tiles 2wc, 2wc + 1).
    const int ct = tid - 128, lane = tid & 31;
    const int wc = ct >> 7, warp = (ct >> 5) & 3;
    const int g = lane >> 2, q = lane & 3;
    const uint64_t dx0 = wgmma_desc_sw128(base), da0 = wgmma_desc_sw128(abase + wc * 128 * 128);
    int G = 0, parity = 0;
#pragma unroll 1
    for (int i = blockIdx.x; i < n_tiles; i += gridDim.x, parity ^= 1) {
        int matrix, m_begin, m_end, n_tile;
        tile_of(i, matrix, m_begin, m_end, n_tile);
        if (ct < BT) tsc[parity][ct] = slot_scale<GROUPED>(p, m_begin + ct, m_end);
        named_barrier_sync(1, 256);
        int o0[2], o1[2];
        bool ok0[2], ok1[2];
#pragma unroll
        for (int m = 0; m < 2; ++m) {
            const int r0 = 128 * wc + 64 * m + 16 * warp + g;
            o0[m] = out_row(n_tile, r0), o1[m] = out_row(n_tile, r0 + 8);
            ok0[m] = o0[m] < rows, ok1[m] = o1[m] < rows;
        }
        float acc[2][ND];
#pragma unroll
        for (int m = 0; m < 2; ++m)
#pragma unroll
            for (int e = 0; e < ND; ++e) acc[m][e] = 0.0f;
#pragma unroll 1
        for (int kt = 0; kt < nk; ++kt, ++G) {
            const int xs = G % NX, as = G % NA;
            mbar_wait(ready0 + 8 * as, (G / NA) & 1);
            fence_proxy_async();
            const uint64_t dx = dx0 + (uint64_t)((xs * XSTAGE) >> 4), da = da0 + (uint64_t)((as * ASLOT) >> 4);
            wgmma_fence();
#pragma unroll
            for (int k = 0; k < 4; ++k)
#pragma unroll
                for (int m = 0; m < 2; ++m) wgmma_m64n128k16_ss_f16(acc[m], da + (uint64_t)((m * 64 * 128 + 32 * k) >> 4), dx + (uint64_t)((32 * k) >> 4), 1);
            wgmma_commit();
            wgmma_wait<1>();
            if (kt > 0 && lane == 0) {  // the group before: its MMAs have read their stage and slot
                mbar_arrive(xfree0 + 8 * ((G - 1) % NX));
                mbar_arrive(afree0 + 8 * ((G - 1) % NA));
            }
        }
        wgmma_wait<0>();
        if (lane == 0) {
            mbar_arrive(xfree0 + 8 * ((G - 1) % NX));
            mbar_arrive(afree0 + 8 * ((G - 1) % NA));
        }
#pragma unroll
        for (int m = 0; m < 2; ++m) wgmma_pin(acc[m]);
        store_tile<2, BT, SWIGLU>(acc, p.y, rows, m_begin, m_end, q, o0, o1, ok0, ok1, [&](int tok) { return tsc[parity][tok]; },
                                  [](int) { return false; });
    }
}

#define SS_ENTRY(name, SWIGLU, GROUPED)                                                               \
    extern "C" __global__ void __launch_bounds__(384, 1) name(const WgParams p) {                     \
        pdl_enter();                                                                                   \
        wg_tile_ss<5, 2, SWIGLU, GROUPED>(p);                                                          \
    }
SS_ENTRY(gemm_wgmma_plain_ss256, false, false)
SS_ENTRY(gemm_wgmma_swiglu_ss256, true, false)
SS_ENTRY(gemm_wgmma_grouped_ss256, false, true)
SS_ENTRY(gemm_wgmma_grouped_swiglu_ss256, true, true)

#define WS_ENTRY_T(name, MT, NS, SWIGLU, GROUPED, CWG, N2, OUT16) WS_ENTRY_R(name, MT, NS, SWIGLU, GROUPED, CWG, N2, OUT16, false)
#define WS_ENTRY_R(name, MT, NS, SWIGLU, GROUPED, CWG, N2, OUT16, ROWS16)                             \
    extern "C" __global__ void __launch_bounds__(128 * (CWG + 1), 1) name(const WgParams p) {          \
        pdl_enter();                                                                                   \
        wg_tile_ws<MT, NS, SWIGLU, GROUPED, CWG, N2, OUT16, 1, ROWS16>(p);                             \
    }
#define WS_ENTRY(name, MT, NS, SWIGLU, GROUPED, CWG) WS_ENTRY_T(name, MT, NS, SWIGLU, GROUPED, CWG, 0, false)
// _ws4: 256 weight rows as four consumer warpgroups of 64 (half the X traffic a FLOP of _ws128);
// _ws128t256: 128 weight rows × 256 tokens (stages of 36 KB: 6 fit); _ws128t160: × 160 tokens (24 KB: 9).
#define WS_FORM(prefix, SWIGLU, GROUPED)                      \
    WS_ENTRY(prefix##_ws128, 1, 10, SWIGLU, GROUPED, 2)       \
    WS_ENTRY(prefix##_ws256, 2, 8, SWIGLU, GROUPED, 2)        \
    WS_ENTRY(prefix##_ws4, 1, 8, SWIGLU, GROUPED, 4)          \
    WS_ENTRY_T(prefix##_ws128t256, 1, 6, SWIGLU, GROUPED, 2, 128, false) \
    WS_ENTRY_T(prefix##_ws128t160, 1, 9, SWIGLU, GROUPED, 2, 32, false)
WS_FORM(gemm_wgmma_plain, false, false)
WS_FORM(gemm_wgmma_swiglu, true, false)
WS_FORM(gemm_wgmma_grouped, false, true)
WS_FORM(gemm_wgmma_grouped_swiglu, true, true)
// bf16 outputs (the MoE down projection) on the 256- and 160-token tiles: 16-byte rows through shared
// memory (store_tile16_rows), and (_o16s) one output a store (store_tile; A/B runs).
WS_ENTRY_R(gemm_wgmma_grouped_ws128t256_o16, 1, 6, false, true, 2, 128, true, true)
WS_ENTRY_R(gemm_wgmma_grouped_ws128t160_o16, 1, 9, false, true, 2, 32, true, true)
WS_ENTRY_R(gemm_wgmma_grouped_ws128t256_o16s, 1, 6, false, true, 2, 128, true, false)
WS_ENTRY_R(gemm_wgmma_grouped_ws128t160_o16s, 1, 9, false, true, 2, 32, true, false)
// The grouped SwiGLU (the MoE gate/up) on the two-part tiles with store_tile's FAST_SILU epilogue.
#define WS_ENTRY_FS(name, NS, N2)                                                                     \
    extern "C" __global__ void __launch_bounds__(384, 1) name(const WgParams p) {                     \
        pdl_enter();                                                                                   \
        wg_tile_ws<1, NS, true, true, 2, N2, false, 1, false, true>(p);                                \
    }
WS_ENTRY_FS(gemm_wgmma_grouped_swiglu_ws128t256_fs, 6, 128)
WS_ENTRY_FS(gemm_wgmma_grouped_swiglu_ws128t160_fs, 9, 32)

// The cluster pairs of 256-token tiles (plain forms): the staged plane's TMA descriptor beside the
// parameters, in one __grid_constant__ parameter (a descriptor must sit in parameter, constant or global
// memory, 64-byte aligned).
struct WgTmaParams {
    TmaDesc xmap;  // the staged x plane: [x_rows, cols] f16, boxes of 64 columns × 128 rows, 128-byte swizzle
    WgParams p;
};
#define MC_ENTRY(name, SWIGLU)                                                                        \
    extern "C" __global__ void __launch_bounds__(384, 1) name(const __grid_constant__ WgTmaParams q) { \
        pdl_enter();                                                                                   \
        wg_tile_ws<1, 6, SWIGLU, false, 2, 128, false, 2>(q.p, &q.xmap);                               \
    }
MC_ENTRY(gemm_wgmma_plain_mc256, false)
MC_ENTRY(gemm_wgmma_swiglu_mc256, true)

#define WG_ENTRY_W(name, BT, MT, NUM, NS, WGS, SWIGLU, GROUPED, MINB)                                 \
    extern "C" __global__ void __launch_bounds__(128 * WGS, MINB) name(const WgParams p) {               \
        pdl_enter();                                                                                   \
        wg_tile<BT, MT, NUM, NS, WGS, SWIGLU, GROUPED>(p);                                             \
    }
#define WG_ENTRY(name, BT, MT, NUM, NS, SWIGLU, GROUPED, MINB) WG_ENTRY_W(name, BT, MT, NUM, NS, 2, SWIGLU, GROUPED, MINB)
#define WG_FORM(prefix, SWIGLU, GROUPED)                                      \
    WG_ENTRY(prefix##_n128_p1, 128, 1, NUM_BF16X, STAGES, SWIGLU, GROUPED, 1)     \
    WG_ENTRY(prefix##_n128_p2, 128, 1, NUM_EXACT, STAGES, SWIGLU, GROUPED, 1)     \
    WG_ENTRY(prefix##_n64_p1, 64, 1, NUM_BF16X, STAGES, SWIGLU, GROUPED, 2)       \
    WG_ENTRY(prefix##_n64_p2, 64, 1, NUM_EXACT, STAGES, SWIGLU, GROUPED, 2)       \
    WG_ENTRY(prefix##_n128_h128, 128, 1, NUM_HALF, 5, SWIGLU, GROUPED, 2)         \
    WG_ENTRY(prefix##_n64_h128, 64, 1, NUM_HALF, 4, SWIGLU, GROUPED, 3)           \
    WG_ENTRY_W(prefix##_n128_h256, 128, 1, NUM_HALF, 6, 4, SWIGLU, GROUPED, 1)    \
    WG_ENTRY_W(prefix##_n64_h256, 64, 1, NUM_HALF, 6, 4, SWIGLU, GROUPED, 1)

WG_FORM(gemm_wgmma_plain, false, false)
WG_FORM(gemm_wgmma_swiglu, true, false)
WG_FORM(gemm_wgmma_grouped, false, true)
WG_FORM(gemm_wgmma_grouped_swiglu, true, true)

// 8-bit codes (the MoE router's format), half numerics, 128 weight rows, the plain form.
// The ring is one stage shallower than the 4-bit tiles' (a stage holds twice the codes) so that the
// same blocks fit an SM.
#define WG_ENTRY8(name, BT, NS, GROUPED, MINB)                                                       \
    extern "C" __global__ void __launch_bounds__(256, MINB) name(const WgParams p) {                  \
        pdl_enter();                                                                                   \
        wg_tile<BT, 1, NUM_HALF, NS, 2, false, GROUPED, 8>(p);                                         \
    }
WG_ENTRY8(gemm_wgmma_plain_n128_h128_q8, 128, 4, false, 2)
WG_ENTRY8(gemm_wgmma_plain_n64_h128_q8, 64, 4, false, 2)
// The folded numerics (exact: two bf16 planes of x; bf16x: one) with the codes centred exactly in
// bf16 (code_pair8), the plain form: the router's own numerics on the tensor cores.
#define WG_ENTRY8F(name, BT, NUM, MINB)                                                              \
    extern "C" __global__ void __launch_bounds__(256, MINB) name(const WgParams p) {                  \
        pdl_enter();                                                                                   \
        wg_tile<BT, 1, NUM, STAGES, 2, false, false, 8>(p);                                            \
    }
WG_ENTRY8F(gemm_wgmma_plain_n128_p1_q8, 128, NUM_BF16X, 1)
WG_ENTRY8F(gemm_wgmma_plain_n128_p2_q8, 128, NUM_EXACT, 1)
WG_ENTRY8F(gemm_wgmma_plain_n64_p1_q8, 64, NUM_BF16X, 2)
WG_ENTRY8F(gemm_wgmma_plain_n64_p2_q8, 64, NUM_EXACT, 2)
// The router's tile with each group's scales and biases loaded in its own step (the form before the
// twenty-seventh session; still the router's by default: the form above, a group ahead, is opt-in with
// LILY_ROUTER_FOLD=ahead until it has run on a GPU).
extern "C" __global__ void __launch_bounds__(256, 2) gemm_wgmma_plain_n64_p2_q8_late(const WgParams p) {
    pdl_enter();
    wg_tile<64, 1, NUM_EXACT, STAGES, 2, false, false, 8, false, false, true>(p);
}

// Split K (wg_tile's SPLITK) for the plain form's 64-token tiles: the half 4-bit tile (two blocks an SM:
// at three ptxas serialises its MMAs), the folded exact 4-bit one and the router's folded 8-bit one.
#define WG_ENTRY_SK(name, NUM, NS, BITS, MINB)                                                        \
    extern "C" __global__ void __launch_bounds__(256, MINB) name(const WgParams p) {                  \
        pdl_enter();                                                                                   \
        wg_tile<64, 1, NUM, NS, 2, false, false, BITS, false, false, false, true>(p);                  \
    }
WG_ENTRY_SK(gemm_wgmma_plain_n64_h128_sk, NUM_HALF, 4, 4, 2)
WG_ENTRY_SK(gemm_wgmma_plain_n64_p2_sk, NUM_EXACT, STAGES, 4, 2)
WG_ENTRY_SK(gemm_wgmma_plain_n64_p2_q8_sk, NUM_EXACT, STAGES, 8, 2)

// bf16 outputs (the MoE down projection's per-slot rows, which the combine reads back): the grouped
// 4-bit half form on the 128- and 64-token tiles of 128 weight rows (variants n128_h128, n64_h128),
// written as 16-byte rows through shared memory (store_tile16_rows), and (_o16s) one output a store
// (store_tile; A/B runs).
#define WG_ENTRY16(name, BT, NS, MINB, ROWS16)                                                       \
    extern "C" __global__ void __launch_bounds__(256, MINB) name(const WgParams p) {                  \
        pdl_enter();                                                                                   \
        wg_tile<BT, 1, NUM_HALF, NS, 2, false, true, 4, true, ROWS16>(p);                              \
    }
WG_ENTRY16(gemm_wgmma_grouped_n128_h128_o16, 128, 5, 2, true)
WG_ENTRY16(gemm_wgmma_grouped_n64_h128_o16, 64, 4, 3, true)
WG_ENTRY16(gemm_wgmma_grouped_n128_h128_o16s, 128, 5, 2, false)
WG_ENTRY16(gemm_wgmma_grouped_n64_h128_o16s, 64, 4, 3, false)

// 32-token grouped half tiles (the MoE GEMMs at a few slots an expert: short prompts, where the 64-token
// tiles multiply mostly zero-filled rows): stages of 8 KB, a ring of 8 (6 groups in flight where the
// 64-token tiles keep 2), three blocks an SM; the plain grouped, SwiGLU and bf16-output forms.
WG_ENTRY(gemm_wgmma_grouped_n32_h128, 32, 1, NUM_HALF, 8, false, true, 3)
WG_ENTRY(gemm_wgmma_grouped_swiglu_n32_h128, 32, 1, NUM_HALF, 8, true, true, 3)
WG_ENTRY16(gemm_wgmma_grouped_n32_h128_o16, 32, 8, 3, true)
WG_ENTRY16(gemm_wgmma_grouped_n32_h128_o16s, 32, 8, 3, false)

// Tensor-core and copy helpers shared by the attention kernels (attention.cu, attn_prefill.cu) and
// the chunked delta rule (gdn_chunked.cu): bf16 packing (round to nearest even, and the hi/lo split
// of an f32 into two bf16), the m16n8k16 bf16 and f16 MMAs with f32 accumulation, the m16n8k8 tf32 MMA and
// its 3xTF32 product, ldmatrix, and shared loads by 32-bit address; with async_copy.cuh (16-byte cp.async
// with zero-fill, the shared-window address of a pointer).
//
// m16n8k16 fragments (PTX ISA, "mma.m16n8k16" with .bf16), g = lane / 4, t = lane % 4:
//   A (16×16, row): a0 = (row g, k 2t..2t+1), a1 = (row g+8, k 2t..), a2 = (row g, k 2t+8..), a3 = (row g+8, k 2t+8..)
//   B (16×8, col):  b0 = (k 2t..2t+1, col g), b1 = (k 2t+8.., col g)
//   C (16×8, f32):  c0, c1 = (row g, cols 2t, 2t+1), c2, c3 = (row g+8, cols 2t, 2t+1)
// Each register holds two bf16, the lower k (or column) in the low half.
#pragma once
#include <stdint.h>
#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include "async_copy.cuh"
#include "bf16.cuh"

__device__ __forceinline__ float bf16_val(float x) { return __bfloat162float(__float2bfloat16_rn(x)); }
// Two floats as one register of bf16 (a in the low half).
__device__ __forceinline__ uint32_t pack_bf16(float a, float b) { return bf16_bits(a) | (bf16_bits(b) << 16); }
// The bf16 parts of x = hi + lo + (a remainder below 2^-16 |x|): hi = bf16(x), lo = bf16(x - hi).
__device__ __forceinline__ void split_bf16(float a, float b, uint32_t& hi, uint32_t& lo) {
    const float ha = bf16_val(a), hb = bf16_val(b);
    hi = pack_bf16(ha, hb);
    lo = pack_bf16(a - ha, b - hb);
}

__device__ __forceinline__ void mma_bf16(float (&c)[4], uint32_t a0, uint32_t a1, uint32_t a2, uint32_t a3, uint32_t b0, uint32_t b1) {
    asm volatile(
        "mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32 {%0, %1, %2, %3}, {%4, %5, %6, %7}, {%8, %9}, {%0, %1, %2, %3};"
        : "+f"(c[0]), "+f"(c[1]), "+f"(c[2]), "+f"(c[3])
        : "r"(a0), "r"(a1), "r"(a2), "r"(a3), "r"(b0), "r"(b1));
}

// Two floats as one register of f16 (a in the low half), each rounded to nearest even.
__device__ __forceinline__ uint32_t pack_f16(float a, float b) {
    const __half2 h = __floats2half2_rn(a, b);
    return *reinterpret_cast<const uint32_t*>(&h);
}
// m16n8k16 with f16 operands (the fragments as bf16's above), f32 accumulation.
__device__ __forceinline__ void mma_f16(float (&c)[4], uint32_t a0, uint32_t a1, uint32_t a2, uint32_t a3, uint32_t b0, uint32_t b1) {
    asm volatile(
        "mma.sync.aligned.m16n8k16.row.col.f32.f16.f16.f32 {%0, %1, %2, %3}, {%4, %5, %6, %7}, {%8, %9}, {%0, %1, %2, %3};"
        : "+f"(c[0]), "+f"(c[1]), "+f"(c[2]), "+f"(c[3])
        : "r"(a0), "r"(a1), "r"(a2), "r"(a3), "r"(b0), "r"(b1));
}

// m16n8k8 with tf32 operands (PTX ISA "mma.m16n8k8" with .tf32), g = lane / 4, t = lane % 4:
//   A (16×8, row): a0 = (row g, k t), a1 = (row g+8, k t), a2 = (row g, k t+4), a3 = (row g+8, k t+4)
//   B (8×8, col):  b0 = (k t, col g), b1 = (k t+4, col g);  C as for m16n8k16.
// tf32 keeps 10 mantissa bits; x = hi + lo + (a remainder below 2^-21 |x|) with hi = tf32(x),
// lo = tf32(x − hi), and a·b ≈ a_hi·b_hi + a_hi·b_lo + a_lo·b_hi (the "3xTF32" product) is good to
// about f32 rounding.

// tf32(x), rounded to nearest with ties away from zero, as cvt.rna.tf32.f32 — which sm_90 emulates in
// ~4 instructions (an infinity test, a predicated add, a mask); this is the add and the mask, the same
// bits for every finite x below the largest tf32 (the operands here are activations and states).
__device__ __forceinline__ uint32_t tf32_bits(float x) {
    return (__float_as_uint(x) + 0x1000u) & 0xffffe000u;
}
__device__ __forceinline__ void split_tf32(float x, uint32_t& hi, uint32_t& lo) {
    hi = tf32_bits(x);
    lo = tf32_bits(x - __uint_as_float(hi));
}
__device__ __forceinline__ void mma_tf32(float (&c)[4], uint32_t a0, uint32_t a1, uint32_t a2, uint32_t a3, uint32_t b0, uint32_t b1) {
    asm("mma.sync.aligned.m16n8k8.row.col.f32.tf32.tf32.f32 {%0, %1, %2, %3}, {%4, %5, %6, %7}, {%8, %9}, {%0, %1, %2, %3};"
        : "+f"(c[0]), "+f"(c[1]), "+f"(c[2]), "+f"(c[3])
        : "r"(a0), "r"(a1), "r"(a2), "r"(a3), "r"(b0), "r"(b1));
}
// x as its (hi, lo) tf32 pair.
__device__ __forceinline__ uint2 split_tf32(float x) {
    uint2 r;
    split_tf32(x, r.x, r.y);
    return r;
}
// The split A fragment of one m16n8k8 product (4 registers), as hi and lo.
struct Tf32A { uint32_t hi[4], lo[4]; };
__device__ __forceinline__ Tf32A split_a(float a0, float a1, float a2, float a3) {
    Tf32A f;
    split_tf32(a0, f.hi[0], f.lo[0]);
    split_tf32(a1, f.hi[1], f.lo[1]);
    split_tf32(a2, f.hi[2], f.lo[2]);
    split_tf32(a3, f.hi[3], f.lo[3]);
    return f;
}
// c += a·b in 3xTF32, B's b0, b1 as (hi, lo) pairs (split_tf32, or one 8-byte shared load each): the
// two small terms into `small`, the large one into `big` (two accumulators, so that consecutive
// products do not all wait on one; the same array for both is allowed).
__device__ __forceinline__ void mma_3xtf32(float (&big)[4], float (&small)[4], const Tf32A& a, uint2 b0, uint2 b1) {
    mma_tf32(small, a.lo[0], a.lo[1], a.lo[2], a.lo[3], b0.x, b1.x);
    mma_tf32(small, a.hi[0], a.hi[1], a.hi[2], a.hi[3], b0.y, b1.y);
    mma_tf32(big, a.hi[0], a.hi[1], a.hi[2], a.hi[3], b0.x, b1.x);
}
// NT = 3: mma_3xtf32; NT = 1: the large term alone (1xTF32: both operands rounded to tf32's 10
// mantissa bits, the product accumulated in f32; a third of the MMAs, and `small` untouched).
template <int NT>
__device__ __forceinline__ void mma_xtf32(float (&big)[4], float (&small)[4], const Tf32A& a, uint2 b0, uint2 b1) {
    static_assert(NT == 1 || NT == 3, "3xTF32 or 1xTF32");
    if constexpr (NT == 3) {
        mma_3xtf32(big, small, a, b0, b1);
    } else {
        mma_tf32(big, a.hi[0], a.hi[1], a.hi[2], a.hi[3], b0.x, b1.x);
    }
}
// Two f32 as their (hi, lo) tf32 pairs, for a 16-byte shared store.
__device__ __forceinline__ uint4 split_pair(float a, float b) {
    const uint2 x = split_tf32(a), y = split_tf32(b);
    return make_uint4(x.x, x.y, y.x, y.y);
}

__device__ __forceinline__ void ldmatrix_x4(uint32_t addr, uint32_t& r0, uint32_t& r1, uint32_t& r2, uint32_t& r3) {
    asm volatile("ldmatrix.sync.aligned.m8n8.x4.shared.b16 {%0, %1, %2, %3}, [%4];"
                 : "=r"(r0), "=r"(r1), "=r"(r2), "=r"(r3)
                 : "r"(addr));
}

// ldmatrix_x4 with each 8×8 matrix transposed: lane (g, t) gets elements (2t, g) and (2t + 1, g) of
// matrix i (rows as addressed) in register i — a fragment of the transpose of a row-major b16 tile.
__device__ __forceinline__ void ldmatrix_x4_trans(uint32_t addr, uint32_t& r0, uint32_t& r1, uint32_t& r2, uint32_t& r3) {
    asm volatile("ldmatrix.sync.aligned.m8n8.x4.trans.shared.b16 {%0, %1, %2, %3}, [%4];"
                 : "=r"(r0), "=r"(r1), "=r"(r2), "=r"(r3)
                 : "r"(addr));
}

// The split A fragment of one m16n8k8 tf32 product from a row-major f32 tile in shared memory by one
// ldmatrix.x4: `addr` is this lane's row address (lane l: row l%8 + 8·(l/8 % 2), columns 4·(l/16)..
// of the k-step; 16-byte aligned). The same registers as split_a of the four 32-bit loads.
__device__ __forceinline__ Tf32A ldsm_a(uint32_t addr) {
    uint32_t r0, r1, r2, r3;
    ldmatrix_x4(addr, r0, r1, r2, r3);
    return split_a(__uint_as_float(r0), __uint_as_float(r1), __uint_as_float(r2), __uint_as_float(r3));
}

__device__ __forceinline__ void sts128(uint32_t addr, uint4 v) {
    asm volatile("st.shared.v4.u32 [%0], {%1, %2, %3, %4};" ::"r"(addr), "r"(v.x), "r"(v.y), "r"(v.z), "r"(v.w) : "memory");
}


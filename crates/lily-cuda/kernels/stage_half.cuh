// The half numerics' staged x (gemm_wgmma.cu's header describes the layout): each row of x scaled by
// its power of two 2^-e and rounded to f16, its columns permuted within each group of 64 into the order
// the register-A tiles hold the codes. The pieces every writer of that layout shares: the permutation,
// the row's exponent, one 16-byte chunk of staged columns from the row's f32 values, and a row's writing;
// and the folded (exact) numerics' two bf16 planes and group sums of a row held the same way.
#pragma once
#include <stdint.h>
#include <cuda_fp16.h>
#include <cuda_bf16.h>

// The staged column (within its group) of element m of the group.
__device__ __forceinline__ int stage_column(int m) {
    const int q = m >> 4, rem = m & 15, half = rem >> 3, e = (rem >> 2) & 1, s = rem & 3;
    return 16 * s + 8 * half + 2 * q + e;
}

// The row's exponent e from its largest |x| (NaNs skipped by fmaxf): the largest scaled value lands in
// [2^14, 2^15), well inside f16's range; clamped to ±110 so that 2^e and 2^-e are normal f32; 0 for a
// row of zeros or one whose largest |x| is infinite.
__device__ __forceinline__ int stage_half_exponent(float m) {
    return (m > 0.0f && m <= 3.4e38f) ? min(max(ilogbf(m) - 14, -110), 110) : 0;
}
__device__ __forceinline__ float stage_pow2(int e) { return __int_as_float((127 + e) << 23); }

// A row held in shared memory for chunking: element k at stage_smem_index(k), element m of group g
// XOR-ed within the group by bits 2 and 4 chosen by g mod 4 (float4 runs of 4 elements stay whole),
// so that a warp's chunk reads below — 4 groups × 8 chunks, each read at the same offsets of its
// group — fall on 32 banks instead of 8.
__device__ __forceinline__ int stage_smem_index(int k) {
    const int g = k >> 6;
    return k ^ (((g & 1) << 2) | ((g & 2) << 3));
}

// The elements of staged columns 8c .. 8c + 7 (c < 8) of group g of a row held at `row`
// (stage_smem_index's layout): column 16s + 8h + 2q + e' holds element 16q + 8h + 4e' + s
// (stage_column's inverse), for s = c / 2, h = c % 2; word q of the chunk is (a[q], b[q]) (e' = 0, 1).
__device__ __forceinline__ void stage_chunk_values(const float* row, int g, int c, float (&a)[4], float (&b)[4]) {
    const int s = c >> 1, h = c & 1, sw = ((g & 1) << 2) | ((g & 2) << 3);
    const float* gp = row + 64 * g;
#pragma unroll
    for (int q = 0; q < 4; ++q) {
        a[q] = gp[(16 * q + 8 * h + s) ^ sw];
        b[q] = gp[(16 * q + 8 * h + 4 + s) ^ sw];
    }
}

// Chunk c of group g of the f16 plane: the chunk's values each times `down` (2^-e) rounded to f16.
__device__ __forceinline__ uint4 stage_half_chunk(const float* row, int g, int c, float down) {
    float a[4], b[4];
    stage_chunk_values(row, g, c, a, b);
    uint32_t w[4];
#pragma unroll
    for (int q = 0; q < 4; ++q)
        w[q] = (uint32_t)__half_as_ushort(__float2half_rn(a[q] * down)) | ((uint32_t)__half_as_ushort(__float2half_rn(b[q] * down)) << 16);
    return make_uint4(w[0], w[1], w[2], w[3]);
}

// The end of a kernel that stages one row a block: the row's n values held at `row` (stage_smem_index's
// layout, published by the barrier that found `row_max`, their largest |value|) scaled by 2^-e and
// written as the f16 plane's n / 8 16-byte chunks at `plane`, 2^e at `*scale`; `threads`: the block's
// (a constant where the kernel's block size is one).
__device__ __forceinline__ void stage_half_row_out(const float* row, float row_max, int n, uint4* plane, float* scale, int threads) {
    const int e = stage_half_exponent(row_max);
    const float down = stage_pow2(-e);
    for (int i = threadIdx.x; i < (n >> 3); i += threads) plane[i] = stage_half_chunk(row, i >> 3, i & 7, down);
    if (threadIdx.x == 0) *scale = stage_pow2(e);
}

// The folded (exact) numerics' staging of the same row, as gemm_wgmma_stage writes it (gemm_wgmma.cu):
// the bf16 planes hi = bf16(x), lo = bf16(x − hi) at the same permuted columns (unscaled), and each
// group's f32 sum of the unrounded x, added as that stager adds it (lane l: x[2l] + x[2l + 1], then the
// xor butterfly 16, 8, 4, 2, 1), so the bits are its own. Chunk c of group g of both planes:
__device__ __forceinline__ void stage_exact_chunk(const float* row, int g, int c, uint4& hi, uint4& lo) {
    float a[4], b[4];
    stage_chunk_values(row, g, c, a, b);
    uint32_t wh[4], wl[4];
#pragma unroll
    for (int q = 0; q < 4; ++q) {
        const __nv_bfloat16 ah = __float2bfloat16_rn(a[q]), bh = __float2bfloat16_rn(b[q]);
        wh[q] = (uint32_t)__bfloat16_as_ushort(ah) | ((uint32_t)__bfloat16_as_ushort(bh) << 16);
        wl[q] = (uint32_t)__bfloat16_as_ushort(__float2bfloat16_rn(a[q] - __bfloat162float(ah))) |
                ((uint32_t)__bfloat16_as_ushort(__float2bfloat16_rn(b[q] - __bfloat162float(bh))) << 16);
    }
    hi = make_uint4(wh[0], wh[1], wh[2], wh[3]);
    lo = make_uint4(wl[0], wl[1], wl[2], wl[3]);
}

// stage_half_row_out's folded counterpart: the row held at `row` (published by a block barrier) as the
// hi and lo planes' n / 8 16-byte chunks and the n / 64 group sums. `threads`: the block's, whole warps.
__device__ __forceinline__ void stage_exact_row_out(const float* row, int n, uint4* hi, uint4* lo, float* sums, int threads) {
    for (int i = threadIdx.x; i < (n >> 3); i += threads) {
        uint4 h, l;
        stage_exact_chunk(row, i >> 3, i & 7, h, l);
        hi[i] = h;
        lo[i] = l;
    }
    const int lane = threadIdx.x & 31;
    for (int g = threadIdx.x >> 5; g < (n >> 6); g += threads >> 5) {
        const int sw = ((g & 1) << 2) | ((g & 2) << 3);
        const float* gp = row + 64 * g;
        float s = gp[(2 * lane) ^ sw] + gp[(2 * lane + 1) ^ sw];
#pragma unroll
        for (int o = 16; o > 0; o >>= 1) s += __shfl_xor_sync(0xffffffffu, s, o);
        if (lane == 0) sums[g] = s;
    }
}

// Prefill GEMM on Hopper's warpgroup MMA (wgmma) for MLX affine 4-bit weights in groups of 64, the
// model's format: Y[t, rows] = X[t, cols] · W[m]ᵀ, the fused SwiGLU form Y = silu(X·Gᵀ) ⊙ (X·Uᵀ), and the
// grouped (MoE) forms of gemm.cu, with gemm.cu's exact and bf16x numerics: the codes go to the tensor
// cores exactly (centred, q - 8), each group's scale and bias apply in f32 (y = Σ_g s·Σ c·x + b'·Σ x,
// b' = b + 8s, the X sums of the unrounded x), and x goes in as one bf16 plane (bf16x) or two (exact:
// hi = bf16(x), lo = bf16(x - hi)); products exact, sums in f32.
//
// Roles: the weights are wgmma's A (64 weight rows a warpgroup, from registers: each thread turns its own
// packed codes into bf16 pairs), the tokens its B (BT = 64 or 128 tokens, K-major in shared memory, the
// 128-byte swizzle), D[weight row, token] in f32 registers (wgmma.cuh has the fragments).
//
// x is staged first by gemm_wgmma_stage, one pass over X: bf16 planes [x_rows, cols] whose columns are
// permuted within each group of 64 into the order in which a thread's A registers hold the codes, and the
// f32 sums of the unrounded x per group, [x_rows, cols / 64]. The permutation: a thread of quad index
// q = lane % 4 holds, for each of its two rows, words 2q and 2q+1 of the row's group (codes 16q .. 16q+15,
// eight a word, LSB first); one LOP3 makes nibbles j and j+4 of a word a bf16 pair 128 + code, one HSUB2
// centres it. At k-step s (0..3) of the group, a0 (k 2q, 2q+1 of the step) is nibbles (s, s+4) of word
// 2q and a2 (k 2q+8, 2q+9) nibbles (s, s+4) of word 2q+1, so position kk of step s is code
//   kk = 2q + e      ->  m = 16q + s + 4e
//   kk = 8 + 2q + e  ->  m = 16q + 8 + s + 4e      (e = 0, 1)
// and the stager writes x[m] at column 16s + kk of the group (stage_column below).
//
// Block: 256 threads, two warpgroups, 128 weight rows × BT tokens (SwiGLU: 64 outputs, gate rows 16i..16i+7
// and up rows 16i+8..16i+15 of output rows 8i..8i+7, so one thread holds gate and up of the same output).
// K advances one group a step through a STAGES-deep ring filled by cp.async from every thread (the X
// planes with the swizzle, the codes, the X sums). Each step a warpgroup issues 4·PLANES wgmmas into a
// per-group accumulator (the first overwrites it), waits, and folds it: acc += s·accg + b'·xsum.
// Grouped: the expert tiles of grouped.cuh; with a gather, slot i reads staged row rows[i] (a row >= x_rows
// gives a NaN output row).
//
// Entry points: gemm_wgmma_{plain, swiglu, grouped, grouped_swiglu}_n{64, 128}_p{1, 2}; dynamic shared
// memory STAGES · stage bytes + 1024 (alignment): see smem_bytes in ops/gemm_wgmma.rs. Launch bounds:
// n128 one block an SM (up to 255 registers: 2 × 64 accumulators), n64 two.

#include <stdint.h>
#include <cuda_bf16.h>
#include "pdl.cuh"
#include "grouped.cuh"
#include "wgmma.cuh"

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
    float* y;                  // [t, rows]
    const uint32_t* offsets;   // grouped: [count + 1]
    const uint32_t* gather;    // grouped: [t] source rows, or null
    long long x_rows;
    int t;                     // tokens, or slots
    int rows;                  // output features
    int cols;                  // K, a multiple of 64
    int count;                 // grouped: experts
    int matrix;                // plain: which matrix of the stack
};

constexpr int THREADS = 256;
constexpr int BW = 128;      // weight rows a block
constexpr int GROUP = 64;    // K a step
constexpr int STAGES = 4;

__device__ __forceinline__ uint32_t smem_u32(const void* p) { return (uint32_t)__cvta_generic_to_shared(p); }
__device__ __forceinline__ float bf16_bits_to_f32(uint16_t h) { return __uint_as_float(((uint32_t)h) << 16); }

__device__ __forceinline__ void cp_async16(uint32_t dst, const void* src, bool ok) {
    asm volatile("cp.async.cg.shared.global [%0], [%1], 16, %2;\n" ::"r"(dst), "l"(src), "r"(ok ? 16 : 0) : "memory");
}
__device__ __forceinline__ void cp_async4(uint32_t dst, const void* src, bool ok) {
    asm volatile("cp.async.ca.shared.global [%0], [%1], 4, %2;\n" ::"r"(dst), "l"(src), "r"(ok ? 4 : 0) : "memory");
}
__device__ __forceinline__ void cp_async_commit() { asm volatile("cp.async.commit_group;\n" ::: "memory"); }
template <int N>
__device__ __forceinline__ void cp_async_wait() {
    asm volatile("cp.async.wait_group %0;\n" ::"n"(N) : "memory");
}
__device__ __forceinline__ uint2 lds64(uint32_t a) {
    uint2 v;
    asm volatile("ld.shared.v2.u32 {%0, %1}, [%2];\n" : "=r"(v.x), "=r"(v.y) : "r"(a));
    return v;
}

// Nibbles s and s + 4 of w minus 8, as an exact bf16 pair (nibble s in the low half): under the bits of
// 128.0 (ulp 1) a nibble makes 128 + code; 136 is subtracted.
__device__ __forceinline__ uint32_t code_pair(uint32_t w, int s) {
    uint32_t v = ((w >> (4 * s)) & 0x000F000Fu) | 0x43004300u;
    const uint32_t k136 = 0x43084308u;
    __nv_bfloat162 d = __hsub2(*reinterpret_cast<const __nv_bfloat162*>(&v), *reinterpret_cast<const __nv_bfloat162*>(&k136));
    return *reinterpret_cast<uint32_t*>(&d);
}

// The staged column (within its group) of code m of the group: see the header.
__device__ __forceinline__ int stage_column(int m) {
    const int q = m >> 4, rem = m & 15, half = rem >> 3, e = (rem >> 2) & 1, s = rem & 3;
    return 16 * s + 8 * half + 2 * q + e;
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

template <int BT, int PLANES, bool SWIGLU, bool GROUPED>
__device__ __forceinline__ void wg_tile(const WgParams& p) {
    constexpr int XPLANE = BT * 128;            // bytes of one X plane a stage (BT rows of 64 bf16)
    constexpr int XB = PLANES * XPLANE;
    constexpr int WB = BW * 32;                 // the codes: 128 rows of 32 bytes
    constexpr int SB = BT * 4;                  // the X sums
    constexpr int STAGE = (XB + WB + SB + 1023) / 1024 * 1024;
    constexpr int RPT = BT / 32;                // X rows a thread loads (32 rows of 8 chunks per pass)
    constexpr int ND = BT / 2;                  // accumulators a thread: 64 × BT / 128
    constexpr int BW_OUT = SWIGLU ? BW / 2 : BW;

    extern __shared__ __align__(16) unsigned char smem_raw[];
    __shared__ unsigned char bad[BT];           // gathered slot past x: a NaN output row
    const uint32_t base = (smem_u32(smem_raw) + 1023u) & ~1023u;

    const int tid = threadIdx.x, lane = tid & 31;
    const int wg = tid >> 7, warp = (tid >> 5) & 3;
    const int g = lane >> 2, q = lane & 3;
    const int rows = p.rows, cols = p.cols, groups = cols >> 6;

    int matrix, m_begin, m_end;
    if (GROUPED) {
        if (!find_group_tile<THREADS>(p.offsets, p.t, p.count, BT, matrix, m_begin, m_end)) return;
    } else {
        matrix = p.matrix;
        m_begin = blockIdx.x * BT;
        m_end = min(m_begin + BT, p.t);
    }
    const int n_tile = blockIdx.y;

    // Tile row r -> (from the up matrix, output row).
    auto out_row = [&](int r) { return SWIGLU ? n_tile * BW_OUT + (r >> 4) * 8 + (r & 7) : n_tile * BW_OUT + r; };
    auto is_up = [](int r) { return SWIGLU && ((r >> 3) & 1) != 0; };

    // ---- Loaders, each with running source pointers (load() is called once per group, in order). X:
    // rows tid / 8 + 32 j, chunk tid % 8 (of 16 bytes) of each plane; a row past the tile reads row 0
    // with a zero-fill (no bytes read).
    const int xc = tid & 7;
    const uint16_t* xp[PLANES][RPT];
    bool x_ok[RPT];
#pragma unroll
    for (int j = 0; j < RPT; ++j) {
        const int r = (tid >> 3) + 32 * j;
        const int slot = m_begin + r;
        uint32_t off = 0;
        x_ok[j] = false;
        bool nan_row = false;
        if (slot < m_end) {
            long long src = slot;
            if (GROUPED && p.gather) src = p.gather[slot];
            if (src < p.x_rows) {
                off = (uint32_t)(src * cols);
                x_ok[j] = true;
            } else {
                nan_row = true;
            }
        }
        if (xc == 0) bad[r] = nan_row;
        xp[0][j] = p.xh + off + xc * 8;
        if constexpr (PLANES == 2) xp[1][j] = p.xl + off + xc * 8;
    }
    // Codes: tile row tid / 2, 16-byte half tid % 2 (row 0 of the stack, zero-filled, past the rows).
    const int wr = tid >> 1, wh = tid & 1;
    const int w_out = out_row(wr);
    const bool w_ok = w_out < rows;
    const uint32_t* wsrc = (is_up(wr) ? p.w2 : p.w) + (size_t)((long long)matrix * rows + (w_ok ? w_out : 0)) * (cols / 8) + wh * 4;
    // X sums: slot tid (tid < BT).
    const float* ssrc = p.xsum;
    bool s_ok = false;
    if (tid < BT) {
        const int slot = m_begin + tid;
        if (slot < m_end) {
            long long src = slot;
            if (GROUPED && p.gather) src = p.gather[slot];
            if (src < p.x_rows) {
                s_ok = true;
                ssrc = p.xsum + src * groups;
            }
        }
    }
    // This thread's shared-memory destinations in stage 0.
    uint32_t xdst[RPT];
#pragma unroll
    for (int j = 0; j < RPT; ++j) {
        const int r = (tid >> 3) + 32 * j;
        xdst[j] = base + r * 128 + ((xc ^ (r & 7)) << 4);
    }
    const uint32_t wdst = base + XB + wr * 32 + wh * 16;
    const uint32_t sdst = base + XB + WB + tid * 4;

    auto load = [&](int kt) {
        const uint32_t so = (kt % STAGES) * STAGE;
#pragma unroll
        for (int pl = 0; pl < PLANES; ++pl) {
#pragma unroll
            for (int j = 0; j < RPT; ++j) {
                cp_async16(xdst[j] + so + pl * XPLANE, xp[pl][j], x_ok[j]);
                xp[pl][j] += GROUP;
            }
        }
        cp_async16(wdst + so, wsrc, w_ok);
        wsrc += 8;
        if (tid < BT) {
            cp_async4(sdst + so, ssrc, s_ok);
            if (s_ok) ssrc += 1;
        }
    };

    // ---- This thread's two weight rows (tile rows r0 and r0 + 8) and their scales.
    const int r0 = 64 * wg + 16 * warp + g, r1 = r0 + 8;
    const int o0 = out_row(r0), o1 = out_row(r1);
    const bool ok0 = o0 < rows, ok1 = o1 < rows;
    const size_t g0 = (size_t)((long long)matrix * rows + (ok0 ? o0 : 0)) * groups;
    const size_t g1 = (size_t)((long long)matrix * rows + (ok1 ? o1 : 0)) * groups;
    // Their scales and biases, advanced a group a step by the main loop.
    const uint16_t* sc0 = (is_up(r0) ? p.scales2 : p.scales) + g0;
    const uint16_t* bi0 = (is_up(r0) ? p.biases2 : p.biases) + g0;
    const uint16_t* sc1 = (is_up(r1) ? p.scales2 : p.scales) + g1;
    const uint16_t* bi1 = (is_up(r1) ? p.biases2 : p.biases) + g1;

    // The X tile descriptor of stage 0 (a stage or k-step further: its byte offset / 16 added to the
    // start-address field, which cannot carry: shared addresses are below 2^18).
    const uint64_t d0 = wgmma_desc_sw128(base);

    float acc[ND], accg[ND];
#pragma unroll
    for (int i = 0; i < ND; ++i) acc[i] = accg[i] = 0.0f;

    const int nk = groups;
#pragma unroll
    for (int s = 0; s < STAGES - 1; ++s) {
        if (s < nk) load(s);
        cp_async_commit();
    }
    for (int kt = 0; kt < nk; ++kt) {
        cp_async_wait<STAGES - 2>();
        fence_proxy_async();
        __syncthreads();
        if (kt + STAGES - 1 < nk) load(kt + STAGES - 1);
        cp_async_commit();

        const uint32_t st = base + (kt % STAGES) * STAGE;
        // This group's scales and biases (f32; zero past the matrix's rows), the centred codes' bias.
        const float s0 = ok0 ? bf16_bits_to_f32(__ldg(sc0)) : 0.0f;
        const float s1 = ok1 ? bf16_bits_to_f32(__ldg(sc1)) : 0.0f;
        const float b0 = ok0 ? fmaf(8.0f, s0, bf16_bits_to_f32(__ldg(bi0))) : 0.0f;
        const float b1 = ok1 ? fmaf(8.0f, s1, bf16_bits_to_f32(__ldg(bi1))) : 0.0f;
        ++sc0, ++sc1, ++bi0, ++bi1;
        const uint2 wa = lds64(st + XB + r0 * 32 + q * 8);
        const uint2 wb = lds64(st + XB + r1 * 32 + q * 8);
        uint32_t a[4][4];
#pragma unroll
        for (int s = 0; s < 4; ++s) {
            a[s][0] = code_pair(wa.x, s);
            a[s][1] = code_pair(wb.x, s);
            a[s][2] = code_pair(wa.y, s);
            a[s][3] = code_pair(wb.y, s);
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
            acc[4 * j + 0] = fmaf(s0, accg[4 * j + 0], fmaf(b0, x0, acc[4 * j + 0]));
            acc[4 * j + 1] = fmaf(s0, accg[4 * j + 1], fmaf(b0, x1, acc[4 * j + 1]));
            acc[4 * j + 2] = fmaf(s1, accg[4 * j + 2], fmaf(b1, x0, acc[4 * j + 2]));
            acc[4 * j + 3] = fmaf(s1, accg[4 * j + 3], fmaf(b1, x1, acc[4 * j + 3]));
        }
    }
    cp_async_wait<0>();

    // ---- Epilogue: rows o0 (and o1), tokens 8j + 2q + e.
#pragma unroll
    for (int j = 0; j < BT / 8; ++j) {
#pragma unroll
        for (int e = 0; e < 2; ++e) {
            const int tok = 8 * j + 2 * q + e;
            const int slot = m_begin + tok;
            if (slot >= m_end) continue;
            float* yrow = p.y + (long long)slot * rows;
            const bool nan_row = bad[tok];
            if (SWIGLU) {
                const float gv = acc[4 * j + e], uv = acc[4 * j + 2 + e];
                if (ok0) yrow[o0] = nan_row ? __int_as_float(0x7fc00000) : gv / (1.0f + expf(-gv)) * uv;
            } else {
                if (ok0) yrow[o0] = nan_row ? __int_as_float(0x7fc00000) : acc[4 * j + e];
                if (ok1) yrow[o1] = nan_row ? __int_as_float(0x7fc00000) : acc[4 * j + 2 + e];
            }
        }
    }
}

#define WG_ENTRY(name, BT, PLANES, SWIGLU, GROUPED, MINB)                                              \
    extern "C" __global__ void __launch_bounds__(THREADS, MINB) name(const WgParams p) {                 \
        pdl_enter();                                                                                   \
        wg_tile<BT, PLANES, SWIGLU, GROUPED>(p);                                                       \
    }
#define WG_FORM(prefix, SWIGLU, GROUPED)                               \
    WG_ENTRY(prefix##_n128_p1, 128, 1, SWIGLU, GROUPED, 1)             \
    WG_ENTRY(prefix##_n128_p2, 128, 2, SWIGLU, GROUPED, 1)             \
    WG_ENTRY(prefix##_n64_p1, 64, 1, SWIGLU, GROUPED, 2)               \
    WG_ENTRY(prefix##_n64_p2, 64, 2, SWIGLU, GROUPED, 2)

WG_FORM(gemm_wgmma_plain, false, false)
WG_FORM(gemm_wgmma_swiglu, true, false)
WG_FORM(gemm_wgmma_grouped, false, true)
WG_FORM(gemm_wgmma_grouped_swiglu, true, true)

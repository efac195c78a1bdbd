// Prefill GEMM, Y[t, rows] = X[t, cols] · W[m]ᵀ, on tensor cores (mma.sync m16n8k16 bf16 -> f32), for
// MLX affine 4/8-bit weights (group 32/64/128) and dense bf16 weights; f32 activations in and out.
// Also the fused SwiGLU form Y = silu(X·Gᵀ) ⊙ (X·Uᵀ), and the grouped (MoE prefill) forms in which
// sorted "slots" belong to experts by a device array of offsets, optionally gathering X rows.
//
// Three numerics, chosen at compile time (the _bf16x, _exact and _fast entry points):
// (For 4-bit group-64 weights in exact and bf16x the model runs gemm_wgmma.cu, the same numerics on wgmma.)
// - bf16x: X rounded to bf16 (nearest even) and the weights exact, as the
//   exact kernels below take them (integer codes, the affine map per group in f32, the X sums of the
//   unrounded x); one MMA per k-step. What is lost is the rounding of x alone (2^-9 relative).
// - exact (the default of the Rust wrappers and of the model): nearly f32. X is split into two bf16 planes, hi = bf16(x)
//   and lo = bf16(x - hi) (x - hi is exact in f32), and every k-step runs two MMAs, W·hi and W·lo, into
//   the same f32 accumulator; what is left of x is below 2^-16 |x| (~2^-18 typically). Affine weights go
//   to the tensor cores as their integer codes, centred: c = q - 2^(bits-1) (-8..7 or -128..127, exact
//   in bf16), and the affine map is applied per group in f32:
//   y = Σ_g ( s[n,g] · Σ_{i∈g} c[n,i]·x[i] + b'[n,g] · Σ_{i∈g} x[i] ),  b' = b + 2^(bits-1)·s
//   (b' in f32: exact unless s < 2^-15 |b|). Centring halves the size of the code products next to the
//   weights', so the partial sums, and the part of x the split loses, count half as much. The codes'
//   products go to a per-group accumulator that is folded into the running sum at the end of the group
//   (acc += s · acc_g, one FMA per element), and b' · xsum is added per 32 or 64 columns, where xsum is
//   the f32 sum of the unrounded x over those columns (computed while the X tile is staged). Dense bf16
//   weights are exact already; only X is split.
// - fast: X is rounded to bf16 (nearest even) when staged; each weight is dequantised in f32 as
//   scale*q + bias (s*q is exact in f32, so this is one rounding, the value lily-cpu computes) and rounded
//   to bf16 (nearest even); one MMA per k-step. Relative error of order 1e-3.
// In both, products are exact and accumulated in f32 by the tensor cores.
//
// Weight layout (see lily_model::weights::Storage): packed u32 [count, rows, cols*bits/32], LSB-first
// codes; scales, biases bf16 [count, rows, cols/group]; dense bf16 [count, rows, cols]. A row is read in
// 16-byte chunks of E = 128/bits weights (32, 16 or 8); a chunk never straddles a group (group >= 32),
// nor does a k-step of 16.
//
// Tiling: a block of 256 threads (8 warps) computes BM tokens × 128 weight rows ("W tile rows"), with a
// K step of BK = 64. Per K step every thread starts loading its share of the next W tile (1, 2 or 4
// chunks for 4-bit, 8-bit, bf16) and X tile (f32): the fast kernels into registers, the exact ones by
// cp.async into a raw staging area in shared memory (dense W straight into its tile buffer), which keeps
// their registers for the second accumulator set. After the tensor-core work on the current shared-memory
// buffer each thread converts its own share into the other buffer (double buffering, one __syncthreads
// per step). Both tiles are stored K-contiguous with a row pitch of 72 bf16 (144 bytes), which makes
// ldmatrix and the 16-byte stores conflict-free. Warps are WM (tokens) × 8/WM (rows); each warp owns a
// 32 × (128·WM/8) tile of the output (MT = 2 m16 tiles × NT n8 tiles). The exact affine kernels also
// stage, per buffer, (scale, bias') of each W tile row for the tile's two 32-column halves and the X
// row sums of those halves. x, the packed weights and the scales are indexed with 32 bits (the host
// checks the sizes).
// SwiGLU: the 128 W tile rows hold 64 output rows of gate and up interleaved by 8 (n8 tile j is gate
// for even j, up for odd j, both covering output rows (j/2)*8 ..), so a warp holds gate and up of the
// same outputs in matching accumulator registers.
//
// Grouped: E = count experts, offsets[E+1] (device), slots offsets[e]..offsets[e+1] use expert e. The
// grid's x covers the worst case ceil(n/BM) + E M-tiles; each block reads the offsets, computes the
// prefix of per-expert tile counts (a block-wide scan, E <= 512), finds its (expert, tile) and exits if
// it has none. With a gather array, slot i reads X row rows[i] (a row >= x_rows gives NaN outputs).
//
// Entry points: {gemm, swiglu_gemm, grouped_gemm, grouped_swiglu_gemm}_{q4, q8, bf16}_{m64, m32}_{exact,
// bf16x, fast} (BM = 64 tokens with 2×4 warps, or 32 tokens with 1×8 warps). Dynamic shared memory: fast
// 2 * (BM + 128) * 72 * 2 bytes (55296 for m64, 46080 for m32); exact 2 * ((2 BM + 128) * 72 * 2 +
// 128 * 16 + BM * 8) + 256 * 32 + BM * 256 bytes (103424 for m64, 76288 for m32); bf16x as exact with
// one X plane (2 * (BM + 128) * 72 * 2 + ...: 85 KB for m64).
// __launch_bounds__(256, 2): at most 128 registers (ptxas: 74-128, no spills), so two blocks fit on an SM.

#include <stdint.h>
#include <cuda_bf16.h>
#include "pdl.cuh"
#include "grouped.cuh"
#include "async_copy.cuh"
#include "bf16.cuh"

struct GemmParams {
    const uint4* w;            // gate (or only) matrix: packed words or bf16
    const uint16_t* scales;    // bf16 bits; unused for dense
    const uint16_t* biases;
    const uint4* w2;           // SwiGLU up matrix (same shape and format)
    const uint16_t* scales2;
    const uint16_t* biases2;
    const float* x;            // [x_rows, cols]
    float* y;                  // [t, rows]
    const uint32_t* offsets;   // grouped: [count + 1]
    const uint32_t* gather;    // grouped: [t] source rows, or null (slot i reads row i)
    long long x_rows;          // rows of x (bounds of the gather)
    int t;                     // tokens, or slots n
    int rows;                  // output features (rows of W)
    int cols;                  // K
    int count;                 // matrices in the stack (experts)
    int matrix;                // plain forms: which matrix of the stack
    int group_shift;           // log2(group size); unused for dense
};

enum { MODE_Q4 = 0, MODE_Q8 = 1, MODE_BF16 = 2 };
template <int MODE> struct Fmt;
template <> struct Fmt<MODE_Q4> { static constexpr int BITS = 4; };
template <> struct Fmt<MODE_Q8> { static constexpr int BITS = 8; };
template <> struct Fmt<MODE_BF16> { static constexpr int BITS = 16; };

constexpr int THREADS = 256;
constexpr int BN = 128;   // W tile rows per block
constexpr int BK = 64;    // K per step
constexpr int LDS = 72;   // smem row pitch in bf16 elements (144 bytes)

// Two floats -> bf16x2 (round to nearest even), a in the low half.
__device__ __forceinline__ uint32_t pack_bf16(float a, float b) {
    __nv_bfloat162 v = __floats2bfloat162_rn(a, b);
    return *reinterpret_cast<uint32_t*>(&v);
}

// Byte j of v (a value 0..255) as an exact float: the bits 0x4B0000qq are 2^23 + q.
__device__ __forceinline__ float byte_f(uint32_t v, int j) {
    return __uint_as_float(__byte_perm(v, 0x4B000000u, 0x7440u | j)) - 8388608.0f;
}

// Byte j of v (a value 0..255) minus 128, as an exact float.
__device__ __forceinline__ float byte_centred(uint32_t v, int j) {
    return __uint_as_float(__byte_perm(v, 0x4B000000u, 0x7440u | j)) - 8388736.0f;
}

// Codes 2j and 2j+1 of a 4-bit word w (its nibbles 2j and 2j+1; u = w >> 4), minus 8, as an exact bf16
// pair, the even code in the low half: byte j of w and byte j of u go to bytes 0 and 2, their low
// nibbles under the bf16 bits 0x4300 (128.0, whose ulp is 1) make 128 + code, and 136 is subtracted
// (exact: -8..7).
__device__ __forceinline__ uint32_t q4_pair_centred(uint32_t w, uint32_t u, int j) {
    const uint32_t r = __byte_perm(w, u, (uint32_t)(j | (j << 4) | ((4 + j) << 8) | ((4 + j) << 12)));
    uint32_t v = (r & 0x000F000Fu) | 0x43004300u;
    const uint32_t k136 = 0x43084308u;  // 136.0, 136.0
    __nv_bfloat162 d = __hsub2(*reinterpret_cast<const __nv_bfloat162*>(&v), *reinterpret_cast<const __nv_bfloat162*>(&k136));
    return *reinterpret_cast<uint32_t*>(&d);
}

// Two floats split into bf16 pairs hi = bf16(x) and lo = bf16(x - hi) (x - hi is exact in f32), the first
// float in the low halves.
__device__ __forceinline__ void split_pair(float a, float b, uint32_t& hi, uint32_t& lo) {
    hi = pack_bf16(a, b);
    lo = pack_bf16(a - __uint_as_float(hi << 16), b - __uint_as_float(hi & 0xFFFF0000u));
}

__device__ __forceinline__ void ldmatrix_x4(uint32_t (&r)[4], uint32_t addr) {
    asm volatile("ldmatrix.sync.aligned.m8n8.x4.shared.b16 {%0, %1, %2, %3}, [%4];\n"
                 : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3])
                 : "r"(addr));
}

__device__ __forceinline__ void mma_bf16(float (&c)[4], const uint32_t (&a)[4], uint32_t b0, uint32_t b1) {
    asm volatile(
        "mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32 {%0, %1, %2, %3}, {%4, %5, %6, %7}, {%8, %9}, "
        "{%0, %1, %2, %3};\n"
        : "+f"(c[0]), "+f"(c[1]), "+f"(c[2]), "+f"(c[3])
        : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b0), "r"(b1));
}

__device__ __forceinline__ float silu_f(float g) { return g / (1.0f + expf(-g)); }

enum { NUM_FAST = 0, NUM_EXACT = 1, NUM_BF16X = 2 };

template <int MODE, int BM, int WM, bool SWIGLU, bool GROUPED, int NUM>
__device__ __forceinline__ void gemm_tile(const GemmParams& p) {
    constexpr int BITS = Fmt<MODE>::BITS;
    constexpr bool AFFINE = MODE != MODE_BF16;
    constexpr bool EXACT = NUM != NUM_FAST;  // exact weights: staged raw by cp.async
    constexpr bool FOLD = EXACT && AFFINE;  // integer codes, per-group accumulators
    constexpr int PLANES = NUM == NUM_EXACT ? 2 : 1;   // X planes: hi (and lo)
    constexpr int E = 128 / BITS;          // weights per 16-byte chunk
    constexpr int CPR = BK / E;            // chunks per W tile row per K step: 2, 4, 8
    constexpr int WCH = BN * CPR / THREADS;  // W chunks per thread: 1, 2, 4
    constexpr int XCH = BM * (BK / 4) / THREADS;  // X float4s per thread: 4 (BM 64) or 2 (BM 32)
    constexpr int WN = 8 / WM;             // warps along the W tile rows
    constexpr int WTM = BM / WM;           // tokens per warp: 32
    constexpr int WTN = BN / WN;           // W tile rows per warp: 32 or 16
    constexpr int MT = WTM / 16;
    constexpr int NT = WTN / 8;
    constexpr int BN_OUT = SWIGLU ? BN / 2 : BN;
    constexpr uint32_t XPLANE_BYTES = BM * LDS * 2;
    static_assert(WTM == 32 && MT == 2, "warp tile is 32 tokens");
    static_assert(NT % 2 == 0, "B fragments are loaded two n8 tiles at a time");
    static_assert(WCH >= 1 && XCH >= 1, "tile split");
    static_assert(E <= 32 && 32 % E == 0, "a chunk lies in one 32-column half of the tile");
    static_assert(!FOLD || WCH <= 2, "wraw holds two chunks per thread");

    extern __shared__ __align__(16) unsigned char smem_raw[];
    __nv_bfloat16* xs = reinterpret_cast<__nv_bfloat16*>(smem_raw);  // [2][PLANES][BM][LDS]
    __nv_bfloat16* ws = xs + 2 * PLANES * BM * LDS;                    // [2][BN][LDS]
    // FOLD only: (scale, bias) per buffer, W tile row and 32-column half, and the X row sums per buffer,
    // tile row and half (.x: columns 0..31 of the tile, .y: 32..63).
    float2* sbs = reinterpret_cast<float2*>(ws + 2 * BN * LDS);  // [2][BN][2]
    float2* xsums = sbs + 2 * BN * 2;                              // [2][BM]
    // EXACT only: the raw packed W chunks of the next step (affine; dense goes straight to ws) and the
    // raw f32 X tile, copied by cp.async (no registers held), each thread's own chunks.
    uint4* wraw = reinterpret_cast<uint4*>(xsums + 2 * BM);        // [2 * THREADS]
    float4* xraw = reinterpret_cast<float4*>(wraw + 2 * THREADS);  // [BM][BK / 4]

    const int tid = threadIdx.x, lane = tid & 31, warp = tid >> 5;
    const int wm = warp / WN, wn = warp % WN;
    const int g = lane >> 2, q = lane & 3;  // accumulator row (token) and column pair of this lane
    const int rows = p.rows, cols = p.cols;

    int matrix, m_begin, m_end;
    if (GROUPED) {
        if (!find_group_tile<THREADS>(p.offsets, p.t, p.count, BM, blockIdx.x, matrix, m_begin, m_end)) return;
    } else {
        matrix = p.matrix;
        m_begin = blockIdx.x * BM;
        m_end = min(m_begin + BM, p.t);
    }
    const int n_tile = blockIdx.y;

    // ---- W loader: this thread's chunks (fixed W tile row and part per chunk, K advances): the index of
    // the row's first 16-byte chunk in the stack, and of its first scale and bias (both below 2^32,
    // checked by the host).
    const int groups = AFFINE ? (cols >> p.group_shift) : 0;
    const int row_chunks = cols / E;  // 16-byte chunks per W row
    uint32_t widx[WCH];
    uint32_t sidx[WCH];
    bool wrow_ok[WCH];
    auto w_row = [](int i) { return (threadIdx.x + i * THREADS) / CPR; };   // W tile row of chunk i
    auto w_part = [](int i) { return (threadIdx.x + i * THREADS) % CPR; };  // its part of the row
    auto w_second = [&](int i) { return SWIGLU && ((w_row(i) >> 3) & 1) != 0; };  // from the up matrix
#pragma unroll
    for (int i = 0; i < WCH; ++i) {
        const int r = w_row(i);
        const int out_row = SWIGLU ? n_tile * BN_OUT + (r >> 4) * 8 + (r & 7) : n_tile * BN_OUT + r;
        wrow_ok[i] = out_row < rows;
        const long long grow = (long long)matrix * rows + (wrow_ok[i] ? out_row : 0);
        widx[i] = (uint32_t)(grow * row_chunks);
        sidx[i] = (uint32_t)(grow * groups);
    }
    uint4 wreg[WCH];           // fast only: the next step's W chunks
    float sreg[WCH], breg[WCH];  // fast affine: their scale and bias

    // ---- FOLD: this thread's (scale, bias) of W tile row tid / 2 for the 32-column half tid % 2.
    const int sb_row = tid >> 1, sb_half = tid & 1;
    bool sb_ok = false;
    uint32_t sb_idx = 0;
    bool sb_second = false;
    float sb_s = 0.0f, sb_b = 0.0f;
    if constexpr (FOLD) {
        sb_second = SWIGLU && ((sb_row >> 3) & 1) != 0;
        const int out_row = SWIGLU ? n_tile * BN_OUT + (sb_row >> 4) * 8 + (sb_row & 7) : n_tile * BN_OUT + sb_row;
        sb_ok = out_row < rows;
        sb_idx = (uint32_t)(((long long)matrix * rows + (sb_ok ? out_row : 0)) * groups);
    }

    // ---- X loader: this thread's float4s (fixed tile row and column, K advances): the element offset
    // of the row's float4 in x (below 2^32 - 2, checked by the host), or X_ZERO past the tile's rows,
    // or X_NAN for a gathered row out of range.
    constexpr uint32_t X_ZERO = 0xFFFFFFFFu, X_NAN = 0xFFFFFFFEu;
    const int xc4 = tid & 15;  // float4 column of every X chunk of this thread
    uint32_t xoff[XCH];
#pragma unroll
    for (int i = 0; i < XCH; ++i) {
        const int r = (tid + i * THREADS) >> 4;
        const int slot = m_begin + r;
        xoff[i] = X_ZERO;
        if (slot < m_end) {
            long long src = slot;
            if (GROUPED && p.gather) src = __ldg(p.gather + slot);
            xoff[i] = src < p.x_rows ? (uint32_t)(src * cols + xc4 * 4) : X_NAN;
        }
    }
    float4 xreg[XCH];  // fast only: the next step's X chunks

    // Starts loading the K step at k0 (into registers, or for the exact kernels by cp.async into wraw and
    // xraw, or for dense weights straight into W buffer buf).
    auto load = [&](int k0, int buf) {
#pragma unroll
        for (int i = 0; i < WCH; ++i) {
            const int k = k0 + w_part(i) * E;
            const bool ok = wrow_ok[i] && k < cols;
            const uint4* src = (w_second(i) ? p.w2 : p.w) + (widx[i] + (ok ? (uint32_t)(k / E) : 0u));
            if constexpr (EXACT) {
                void* dst = MODE == MODE_BF16 ? static_cast<void*>(ws + (buf * BN + w_row(i)) * LDS + w_part(i) * E)
                                              : static_cast<void*>(wraw + tid + i * THREADS);
                cp_async16(smem_addr(dst), src, ok);
            } else {
                wreg[i] = ok ? __ldg(src) : make_uint4(0, 0, 0, 0);
            }
            if constexpr (AFFINE && !EXACT) {
                const uint32_t j = sidx[i] + (uint32_t)(k >> p.group_shift);
                sreg[i] = ok ? bf16_to_f32(__ldg((w_second(i) ? p.scales2 : p.scales) + j)) : 0.0f;
                breg[i] = ok ? bf16_to_f32(__ldg((w_second(i) ? p.biases2 : p.biases) + j)) : 0.0f;
            }
        }
        if constexpr (FOLD) {
            // Zero scale and bias past the matrix's rows or cols (folded too: they multiply zeros).
            const int k = k0 + sb_half * 32;
            const bool ok = sb_ok && k < cols;
            const uint32_t j = sb_idx + (uint32_t)(k >> p.group_shift);
            sb_s = ok ? bf16_to_f32(__ldg((sb_second ? p.scales2 : p.scales) + j)) : 0.0f;
            sb_b = ok ? bf16_to_f32(__ldg((sb_second ? p.biases2 : p.biases) + j)) : 0.0f;
            sb_b = fmaf((float)(1 << (BITS - 1)), sb_s, sb_b);  // the bias of the centred codes
        }
        const bool kin = k0 + xc4 * 4 < cols;
        if constexpr (EXACT) {
            // store() fills the zero and NaN chunks itself.
#pragma unroll
            for (int i = 0; i < XCH; ++i)
                if (xoff[i] < X_NAN && kin) cp_async16(smem_addr(xraw + tid + i * THREADS), p.x + (xoff[i] + (uint32_t)k0), true);
            cp_async_commit_group();
        } else {
#pragma unroll
            for (int i = 0; i < XCH; ++i) {
                if (xoff[i] < X_NAN && kin) {
                    xreg[i] = __ldg(reinterpret_cast<const float4*>(p.x + (xoff[i] + (uint32_t)k0)));
                } else if (xoff[i] == X_NAN) {
                    xreg[i] = make_float4(__int_as_float(0x7fc00000), 0.0f, 0.0f, 0.0f);
                } else {
                    xreg[i] = make_float4(0.0f, 0.0f, 0.0f, 0.0f);
                }
            }
        }
    };

    // Converts the loaded K step at k0 into buffer buf.
    auto store = [&](int buf, int k0) {
        __nv_bfloat16* wsb = ws + buf * BN * LDS;
        __nv_bfloat16* xsb = xs + buf * PLANES * BM * LDS;
        if constexpr (EXACT) cp_async_wait_group<0>();
#pragma unroll
        for (int i = 0; i < WCH; ++i) {
            uint4* dst = reinterpret_cast<uint4*>(wsb + w_row(i) * LDS + w_part(i) * E);
            if constexpr (EXACT) {
                if constexpr (AFFINE) {
                    // The codes minus 2^(bits-1), exact in bf16.
                    const uint4 v = wraw[tid + i * THREADS];
                    const uint32_t wv[4] = {v.x, v.y, v.z, v.w};
                    if constexpr (MODE == MODE_Q8) {
                        uint32_t o[8];
#pragma unroll
                        for (int k = 0; k < 4; ++k) {
                            o[2 * k] = pack_bf16(byte_centred(wv[k], 0), byte_centred(wv[k], 1));
                            o[2 * k + 1] = pack_bf16(byte_centred(wv[k], 2), byte_centred(wv[k], 3));
                        }
                        dst[0] = make_uint4(o[0], o[1], o[2], o[3]);
                        dst[1] = make_uint4(o[4], o[5], o[6], o[7]);
                    } else {
                        uint32_t o[16];
#pragma unroll
                        for (int k = 0; k < 4; ++k) {
                            const uint32_t u = wv[k] >> 4;
#pragma unroll
                            for (int j = 0; j < 4; ++j) o[4 * k + j] = q4_pair_centred(wv[k], u, j);
                        }
#pragma unroll
                        for (int c = 0; c < 4; ++c) dst[c] = make_uint4(o[4 * c], o[4 * c + 1], o[4 * c + 2], o[4 * c + 3]);
                    }
                }
                // Dense: already in place (cp.async into buffer buf).
            } else if constexpr (MODE == MODE_BF16) {
                dst[0] = wreg[i];
            } else if constexpr (MODE == MODE_Q8) {
                // Word k holds codes 4k..4k+3 (byte j = code 4k+j).
                const uint4 v = wreg[i];
                const uint32_t wv[4] = {v.x, v.y, v.z, v.w};
                const float s = sreg[i], b = breg[i];
                uint32_t o[8];
#pragma unroll
                for (int k = 0; k < 4; ++k) {
                    o[2 * k] = pack_bf16(fmaf(s, byte_f(wv[k], 0), b), fmaf(s, byte_f(wv[k], 1), b));
                    o[2 * k + 1] = pack_bf16(fmaf(s, byte_f(wv[k], 2), b), fmaf(s, byte_f(wv[k], 3), b));
                }
                dst[0] = make_uint4(o[0], o[1], o[2], o[3]);
                dst[1] = make_uint4(o[4], o[5], o[6], o[7]);
            } else {
                // Word k holds codes 8k..8k+7: lo = bytes of codes 8k, 8k+2, 8k+4, 8k+6; hi the odd ones.
                const uint4 v = wreg[i];
                const uint32_t wv[4] = {v.x, v.y, v.z, v.w};
                const float s = sreg[i], b = breg[i];
                uint32_t o[16];
#pragma unroll
                for (int k = 0; k < 4; ++k) {
                    const uint32_t lo = wv[k] & 0x0F0F0F0Fu;
                    const uint32_t hi = (wv[k] >> 4) & 0x0F0F0F0Fu;
#pragma unroll
                    for (int j = 0; j < 4; ++j)
                        o[4 * k + j] = pack_bf16(fmaf(s, byte_f(lo, j), b), fmaf(s, byte_f(hi, j), b));
                }
#pragma unroll
                for (int c = 0; c < 4; ++c) dst[c] = make_uint4(o[4 * c], o[4 * c + 1], o[4 * c + 2], o[4 * c + 3]);
            }
        }
        if constexpr (FOLD) sbs[(buf * BN + sb_row) * 2 + sb_half] = make_float2(sb_s, sb_b);
        const bool kin = k0 + xc4 * 4 < cols;
#pragma unroll
        for (int i = 0; i < XCH; ++i) {
            const int idx = tid + i * THREADS;
            const int r = idx >> 4, c4 = idx & 15;
            if constexpr (EXACT) {
                float4 v = make_float4(0.0f, 0.0f, 0.0f, 0.0f);
                if (xoff[i] < X_NAN && kin) {
                    v = xraw[idx];
                } else if (xoff[i] == X_NAN) {
                    v.x = __int_as_float(0x7fc00000);
                }
                if constexpr (PLANES == 2) {
                    uint32_t h01, l01, h23, l23;
                    split_pair(v.x, v.y, h01, l01);
                    split_pair(v.z, v.w, h23, l23);
                    *reinterpret_cast<uint2*>(xsb + r * LDS + c4 * 4) = make_uint2(h01, h23);
                    *reinterpret_cast<uint2*>(xsb + BM * LDS + r * LDS + c4 * 4) = make_uint2(l01, l23);
                } else {
                    *reinterpret_cast<uint2*>(xsb + r * LDS + c4 * 4) = make_uint2(pack_bf16(v.x, v.y), pack_bf16(v.z, v.w));
                }
                if constexpr (FOLD) {
                    // Sum of the unrounded x over this 32-column half: the 8 lanes (c4 & 7) = 0..7 of
                    // the same row, adjacent in the warp.
                    float s = (v.x + v.y) + (v.z + v.w);
                    s += __shfl_xor_sync(0xffffffffu, s, 1);
                    s += __shfl_xor_sync(0xffffffffu, s, 2);
                    s += __shfl_xor_sync(0xffffffffu, s, 4);
                    if ((c4 & 7) == 0) reinterpret_cast<float*>(xsums + buf * BM + r)[c4 >> 3] = s;
                }
            } else {
                const float4 v = xreg[i];
                *reinterpret_cast<uint2*>(xsb + r * LDS + c4 * 4) = make_uint2(pack_bf16(v.x, v.y), pack_bf16(v.z, v.w));
            }
        }
    };

    // acc: the output; accg (FOLD only): the current group's Σ q·x.
    float acc[MT][NT][4], accg[MT][NT][4];
#pragma unroll
    for (int a = 0; a < MT; ++a)
#pragma unroll
        for (int b = 0; b < NT; ++b)
#pragma unroll
            for (int c = 0; c < 4; ++c) acc[a][b][c] = accg[a][b][c] = 0.0f;

    // FOLD: folds this buffer's group partials into acc. h is the 32-column half whose (scale, bias)
    // and X sums apply (group 32), else 0 with the sums of both halves (group 64 or 128, constant over
    // the tile); scale_now: the group ends here (acc += s · accg, accg = 0); the bias term b · xsum is
    // added every time (for group 128 once per tile, the group's bias times the tile's X sums).
    const bool g32 = FOLD && p.group_shift == 5;
    const int gmask = FOLD ? (1 << p.group_shift) - 1 : 0;
    auto fold = [&](int buf, int h, bool scale_now) {
        const float2* sbb = sbs + buf * BN * 2;
        const float2* xsb = xsums + buf * BM;
        float xsum[MT][2];
#pragma unroll
        for (int mt = 0; mt < MT; ++mt)
#pragma unroll
            for (int hh = 0; hh < 2; ++hh) {
                const float2 v = xsb[wm * WTM + mt * 16 + g + hh * 8];
                xsum[mt][hh] = g32 ? (h ? v.y : v.x) : v.x + v.y;
            }
#pragma unroll
        for (int nt = 0; nt < NT; ++nt)
#pragma unroll
            for (int e = 0; e < 2; ++e) {
                const float2 sb = sbb[(wn * WTN + nt * 8 + 2 * q + e) * 2 + h];
#pragma unroll
                for (int mt = 0; mt < MT; ++mt)
#pragma unroll
                    for (int hh = 0; hh < 2; ++hh) {
                        float& a = acc[mt][nt][2 * hh + e];
                        float& c = accg[mt][nt][2 * hh + e];
                        if (scale_now) {
                            a = fmaf(sb.x, c, a);
                            c = 0.0f;
                        }
                        a = fmaf(sb.y, xsum[mt][hh], a);
                    }
            }
    };

    // ldmatrix row addresses (bytes, within one buffer): A rows lane&15, k + (lane>>4)*8; B rows
    // (lane&7) + (lane>>4)*8, k + ((lane>>3)&1)*8.
    const uint32_t xs_base = smem_addr(xs);
    const uint32_t ws_base = smem_addr(ws);
    const uint32_t a_off = (uint32_t)(((wm * WTM + (lane & 15)) * LDS + (lane >> 4) * 8) * 2);
    const uint32_t b_off = (uint32_t)(((wn * WTN + (lane & 7) + (lane >> 4) * 8) * LDS + ((lane >> 3) & 1) * 8) * 2);

    const int nk = (cols + BK - 1) / BK;
    load(0, 0);
    store(0, 0);
    __syncthreads();
    for (int kt = 0; kt < nk; ++kt) {
        const int buf = kt & 1;
        if (kt + 1 < nk) load((kt + 1) * BK, buf ^ 1);
        const uint32_t xa = xs_base + buf * (PLANES * XPLANE_BYTES) + a_off;
        const uint32_t wb = ws_base + buf * (BN * LDS * 2) + b_off;
#pragma unroll
        for (int ks = 0; ks < BK / 16; ++ks) {
            uint32_t bfr[NT / 2][4];
#pragma unroll
            for (int np = 0; np < NT / 2; ++np) ldmatrix_x4(bfr[np], wb + (np * 16 * LDS + ks * 16) * 2);
#pragma unroll
            for (int pl = 0; pl < PLANES; ++pl) {
                uint32_t af[MT][4];
#pragma unroll
                for (int mt = 0; mt < MT; ++mt) ldmatrix_x4(af[mt], xa + pl * XPLANE_BYTES + (mt * 16 * LDS + ks * 16) * 2);
#pragma unroll
                for (int mt = 0; mt < MT; ++mt)
#pragma unroll
                    for (int nt = 0; nt < NT; ++nt)
                        mma_bf16(FOLD ? accg[mt][nt] : acc[mt][nt], af[mt], bfr[nt >> 1][(nt & 1) * 2],
                                 bfr[nt >> 1][(nt & 1) * 2 + 1]);
            }
            if constexpr (FOLD) {
                // Group ends after this k-step of 16 every group/16 steps; halves end after steps 1, 3.
                if (ks == 1 && g32) fold(buf, 0, true);
                if (ks == 3) fold(buf, g32 ? 1 : 0, (((kt + 1) * BK) & gmask) == 0);
            }
        }
        if (kt + 1 < nk) store(buf ^ 1, (kt + 1) * BK);
        __syncthreads();
    }

    // ---- Epilogue: c0, c1 at (token g, cols 2q, 2q+1), c2, c3 at token g + 8.
#pragma unroll
    for (int mt = 0; mt < MT; ++mt) {
#pragma unroll
        for (int h = 0; h < 2; ++h) {
            const int slot = m_begin + wm * WTM + mt * 16 + g + h * 8;
            if (slot >= m_end) continue;
            float* yrow = p.y + (long long)slot * rows;
            if (SWIGLU) {
#pragma unroll
                for (int pr = 0; pr < NT / 2; ++pr) {
                    const int n = n_tile * BN_OUT + (wn * NT / 2 + pr) * 8 + 2 * q;
#pragma unroll
                    for (int e = 0; e < 2; ++e) {
                        const float gv = acc[mt][2 * pr][2 * h + e], uv = acc[mt][2 * pr + 1][2 * h + e];
                        if (n + e < rows) yrow[n + e] = silu_f(gv) * uv;
                    }
                }
            } else {
#pragma unroll
                for (int nt = 0; nt < NT; ++nt) {
                    const int n = n_tile * BN_OUT + wn * WTN + nt * 8 + 2 * q;
#pragma unroll
                    for (int e = 0; e < 2; ++e)
                        if (n + e < rows) yrow[n + e] = acc[mt][nt][2 * h + e];
                }
            }
        }
    }
}

#define GEMM_ENTRY(name, MODE, BM, WM, SWIGLU, GROUPED, NUM)                            \
    extern "C" __global__ void __launch_bounds__(THREADS, 2) name(const GemmParams p) { pdl_enter(); \
        gemm_tile<MODE, BM, WM, SWIGLU, GROUPED, NUM>(p);                          \
    }

#define GEMM_FORMATS(prefix, SWIGLU, GROUPED, NUM, suffix)                          \
    GEMM_ENTRY(prefix##_q4_m64_##suffix, MODE_Q4, 64, 2, SWIGLU, GROUPED, NUM)     \
    GEMM_ENTRY(prefix##_q4_m32_##suffix, MODE_Q4, 32, 1, SWIGLU, GROUPED, NUM)     \
    GEMM_ENTRY(prefix##_q8_m64_##suffix, MODE_Q8, 64, 2, SWIGLU, GROUPED, NUM)     \
    GEMM_ENTRY(prefix##_q8_m32_##suffix, MODE_Q8, 32, 1, SWIGLU, GROUPED, NUM)     \
    GEMM_ENTRY(prefix##_bf16_m64_##suffix, MODE_BF16, 64, 2, SWIGLU, GROUPED, NUM) \
    GEMM_ENTRY(prefix##_bf16_m32_##suffix, MODE_BF16, 32, 1, SWIGLU, GROUPED, NUM)

#define GEMM_FAMILY(prefix, SWIGLU, GROUPED)                \
    GEMM_FORMATS(prefix, SWIGLU, GROUPED, NUM_EXACT, exact)     \
    GEMM_FORMATS(prefix, SWIGLU, GROUPED, NUM_BF16X, bf16x)     \
    GEMM_FORMATS(prefix, SWIGLU, GROUPED, NUM_FAST, fast)

GEMM_FAMILY(gemm, false, false)
GEMM_FAMILY(swiglu_gemm, true, false)
GEMM_FAMILY(grouped_gemm, false, true)
GEMM_FAMILY(grouped_swiglu_gemm, true, true)

// Prefill GEMM, Y[t, rows] = X[t, cols] · W[m]ᵀ, on tensor cores (mma.sync m16n8k16 bf16 -> f32), for
// MLX affine 4/8-bit weights (group 32/64/128) and dense bf16 weights; f32 activations in and out.
// Also the fused SwiGLU form Y = silu(X·Gᵀ) ⊙ (X·Uᵀ), and the grouped (MoE prefill) forms in which
// sorted "slots" belong to experts by a device array of offsets, optionally gathering X rows.
//
// Numerics: X is rounded to bf16 (round to nearest even) when staged into shared memory; each weight is
// dequantised in f32 as scale*q + bias (s*q is exact in f32, so this is one rounding, the same value
// lily-cpu computes) and rounded to bf16 (nearest even); products are exact and accumulated in f32 by
// the tensor cores.
//
// Weight layout (see lily_model::weights::Storage): packed u32 [count, rows, cols*bits/32], LSB-first
// codes; scales, biases bf16 [count, rows, cols/group]; dense bf16 [count, rows, cols]. A row is read in
// 16-byte chunks of E = 128/bits weights (32, 16 or 8); a chunk never straddles a group (group >= 32).
//
// Tiling: a block of 256 threads (8 warps) computes BM tokens × 128 weight rows ("W tile rows"), with a
// K step of BK = 64. Per K step every thread loads its share of the W tile (1, 2 or 4 chunks for
// 4-bit, 8-bit, bf16) and of the X tile (f32) into registers; after the tensor-core work on the current
// shared-memory buffer it dequantises/rounds them into the other buffer (double buffering, one
// __syncthreads per step). Both tiles are stored K-contiguous with a row pitch of 72 bf16 (144 bytes),
// which makes ldmatrix and the 16-byte stores conflict-free. Warps are WM (tokens) × 8/WM (rows); each
// warp owns a 32 × (128·WM/8) tile of the output (MT = 2 m16 tiles × NT n8 tiles).
// SwiGLU: the 128 W tile rows hold 64 output rows of gate and up interleaved by 8 (n8 tile j is gate
// for even j, up for odd j, both covering output rows (j/2)*8 ..), so a warp holds gate and up of the
// same outputs in matching accumulator registers.
//
// Grouped: E = count experts, offsets[E+1] (device), slots offsets[e]..offsets[e+1] use expert e. The
// grid's x covers the worst case ceil(n/BM) + E M-tiles; each block reads the offsets, computes the
// prefix of per-expert tile counts (a block-wide scan, E <= 512), finds its (expert, tile) and exits if
// it has none. With a gather array, slot i reads X row rows[i] (a row >= x_rows gives NaN outputs).
//
// Entry points: {gemm, swiglu_gemm, grouped_gemm, grouped_swiglu_gemm}_{q4, q8, bf16}_{m64, m32}
// (BM = 64 tokens with 2×4 warps, or 32 tokens with 1×8 warps). Dynamic shared memory:
// 2 * (BM + 128) * 72 * 2 bytes (55296 for m64, 46080 for m32). __launch_bounds__(256, 2): at most
// 128 registers (ptxas: 95-128, no spills), so two blocks fit on an SM.

#include <stdint.h>
#include <cuda_bf16.h>

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

__device__ __forceinline__ float bf16_bits_to_f32(uint16_t h) { return __uint_as_float(((uint32_t)h) << 16); }

// Two floats -> bf16x2 (round to nearest even), a in the low half.
__device__ __forceinline__ uint32_t pack_bf16(float a, float b) {
    __nv_bfloat162 v = __floats2bfloat162_rn(a, b);
    return *reinterpret_cast<uint32_t*>(&v);
}

// Byte j of v (a value 0..255) as an exact float: the bits 0x4B0000qq are 2^23 + q.
__device__ __forceinline__ float byte_f(uint32_t v, int j) {
    return __uint_as_float(__byte_perm(v, 0x4B000000u, 0x7440u | j)) - 8388608.0f;
}

__device__ __forceinline__ uint32_t smem_u32(const void* p) { return (uint32_t)__cvta_generic_to_shared(p); }

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

// Which (expert, first slot, end slot) this block handles in the grouped forms; false if none.
// All threads must call it (it synchronises).
__device__ __forceinline__ bool find_group_tile(const GemmParams& p, int bm, int& expert, int& m_begin, int& m_end) {
    __shared__ int warp_tot[THREADS / 32];
    __shared__ int found[3];
    const int tid = threadIdx.x, lane = tid & 31, warp = tid >> 5;
    const int E = p.count;
    const unsigned n = (unsigned)p.t;
    // Thread tid covers experts 2*tid and 2*tid + 1 (E <= 512 = 2 * THREADS).
    int first[2], cnt[2], tiles[2];
#pragma unroll
    for (int k = 0; k < 2; ++k) {
        const int e = 2 * tid + k;
        first[k] = 0;
        cnt[k] = 0;
        if (e < E) {
            const unsigned a = min(__ldg(p.offsets + e), n);
            const unsigned b = min(__ldg(p.offsets + e + 1), n);
            first[k] = (int)a;
            cnt[k] = b > a ? (int)(b - a) : 0;
        }
        tiles[k] = (cnt[k] + bm - 1) / bm;
    }
    const int local = tiles[0] + tiles[1];
    int incl = local;
#pragma unroll
    for (int o = 1; o < 32; o <<= 1) {
        const int v = __shfl_up_sync(0xffffffffu, incl, o);
        if (lane >= o) incl += v;
    }
    if (lane == 31) warp_tot[warp] = incl;
    if (tid == 0) found[0] = -1;
    __syncthreads();
    int before = 0;
    for (int w = 0; w < warp; ++w) before += warp_tot[w];
    const int start = before + incl - local;  // tiles before expert 2*tid
    const int mt = blockIdx.x;
    if (mt >= start && mt < start + local) {
        const int k = mt < start + tiles[0] ? 0 : 1;
        const int j = mt - start - (k ? tiles[0] : 0);
        found[0] = 2 * tid + k;
        found[1] = first[k] + j * bm;
        found[2] = first[k] + cnt[k];
    }
    __syncthreads();
    expert = found[0];
    m_begin = found[1];
    m_end = min(found[2], m_begin + bm);
    return expert >= 0;
}

template <int MODE, int BM, int WM, bool SWIGLU, bool GROUPED>
__device__ __forceinline__ void gemm_tile(const GemmParams& p) {
    constexpr int BITS = Fmt<MODE>::BITS;
    constexpr bool AFFINE = MODE != MODE_BF16;
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
    static_assert(WTM == 32 && MT == 2, "warp tile is 32 tokens");
    static_assert(NT % 2 == 0, "B fragments are loaded two n8 tiles at a time");
    static_assert(WCH >= 1 && XCH >= 1, "tile split");

    extern __shared__ __align__(16) unsigned char smem_raw[];
    __nv_bfloat16* xs = reinterpret_cast<__nv_bfloat16*>(smem_raw);  // [2][BM][LDS]
    __nv_bfloat16* ws = xs + 2 * BM * LDS;                             // [2][BN][LDS]

    const int tid = threadIdx.x, lane = tid & 31, warp = tid >> 5;
    const int wm = warp / WN, wn = warp % WN;
    const int rows = p.rows, cols = p.cols;

    int matrix, m_begin, m_end;
    if (GROUPED) {
        if (!find_group_tile(p, BM, matrix, m_begin, m_end)) return;
    } else {
        matrix = p.matrix;
        m_begin = blockIdx.x * BM;
        m_end = min(m_begin + BM, p.t);
    }
    const int n_tile = blockIdx.y;

    // ---- W loader: this thread's chunks (fixed W tile row and part per chunk, K advances).
    const int groups = AFFINE ? (cols >> p.group_shift) : 0;
    const long long row_chunks = cols / E;  // 16-byte chunks per W row
    const uint4* wptr[WCH];
    const uint16_t* sptr[WCH];
    const uint16_t* bptr[WCH];
    bool wrow_ok[WCH];
    int wpart[WCH], wrow[WCH];
#pragma unroll
    for (int i = 0; i < WCH; ++i) {
        const int c = tid + i * THREADS;
        const int r = c / CPR;
        wrow[i] = r;
        wpart[i] = c % CPR;
        int out_row;
        bool second = false;
        if (SWIGLU) {
            const int j = r >> 3;
            second = (j & 1) != 0;
            out_row = n_tile * BN_OUT + (j >> 1) * 8 + (r & 7);
        } else {
            out_row = n_tile * BN_OUT + r;
        }
        wrow_ok[i] = out_row < rows;
        const long long grow = (long long)matrix * rows + (wrow_ok[i] ? out_row : 0);
        wptr[i] = (second ? p.w2 : p.w) + grow * row_chunks;
        if (AFFINE) {
            sptr[i] = (second ? p.scales2 : p.scales) + grow * groups;
            bptr[i] = (second ? p.biases2 : p.biases) + grow * groups;
        } else {
            sptr[i] = bptr[i] = nullptr;
        }
    }
    uint4 wreg[WCH];
    float sreg[WCH], breg[WCH];

    // ---- X loader: this thread's float4s (fixed tile row and column, K advances).
    const float* xptr[XCH];
    int xstate[XCH];  // 1 = load, 0 = zero (past the tile's rows), 2 = NaN (gather out of range)
#pragma unroll
    for (int i = 0; i < XCH; ++i) {
        const int idx = tid + i * THREADS;
        const int r = idx >> 4, c4 = idx & 15;
        const int slot = m_begin + r;
        xptr[i] = p.x;
        xstate[i] = 0;
        if (slot < m_end) {
            long long src = slot;
            if (GROUPED && p.gather) src = __ldg(p.gather + slot);
            if (src < p.x_rows) {
                xptr[i] = p.x + src * cols + c4 * 4;
                xstate[i] = 1;
            } else {
                xstate[i] = 2;
            }
        }
    }
    float4 xreg[XCH];

    auto load = [&](int k0) {
#pragma unroll
        for (int i = 0; i < WCH; ++i) {
            const int k = k0 + wpart[i] * E;
            const bool ok = wrow_ok[i] && k < cols;
            wreg[i] = ok ? __ldg(wptr[i] + k / E) : make_uint4(0, 0, 0, 0);
            if (AFFINE) {
                sreg[i] = ok ? bf16_bits_to_f32(__ldg(sptr[i] + (k >> p.group_shift))) : 0.0f;
                breg[i] = ok ? bf16_bits_to_f32(__ldg(bptr[i] + (k >> p.group_shift))) : 0.0f;
            }
        }
#pragma unroll
        for (int i = 0; i < XCH; ++i) {
            const int k = k0 + ((tid + i * THREADS) & 15) * 4;
            if (xstate[i] == 1 && k < cols) {
                xreg[i] = __ldg(reinterpret_cast<const float4*>(xptr[i] + k0));
            } else if (xstate[i] == 2) {
                xreg[i] = make_float4(__int_as_float(0x7fc00000), 0.0f, 0.0f, 0.0f);
            } else {
                xreg[i] = make_float4(0.0f, 0.0f, 0.0f, 0.0f);
            }
        }
    };

    auto store = [&](int buf) {
        __nv_bfloat16* wsb = ws + buf * BN * LDS;
        __nv_bfloat16* xsb = xs + buf * BM * LDS;
#pragma unroll
        for (int i = 0; i < WCH; ++i) {
            uint4* dst = reinterpret_cast<uint4*>(wsb + wrow[i] * LDS + wpart[i] * E);
            const uint4 v = wreg[i];
            if (MODE == MODE_BF16) {
                dst[0] = v;
            } else if (MODE == MODE_Q8) {
                // Word k holds codes 4k..4k+3 (byte j = code 4k+j).
                const float s = sreg[i], b = breg[i];
                const uint32_t wv[4] = {v.x, v.y, v.z, v.w};
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
                const float s = sreg[i], b = breg[i];
                const uint32_t wv[4] = {v.x, v.y, v.z, v.w};
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
                for (int q = 0; q < 4; ++q) dst[q] = make_uint4(o[4 * q], o[4 * q + 1], o[4 * q + 2], o[4 * q + 3]);
            }
        }
#pragma unroll
        for (int i = 0; i < XCH; ++i) {
            const int idx = tid + i * THREADS;
            const int r = idx >> 4, c4 = idx & 15;
            const float4 v = xreg[i];
            *reinterpret_cast<uint2*>(xsb + r * LDS + c4 * 4) = make_uint2(pack_bf16(v.x, v.y), pack_bf16(v.z, v.w));
        }
    };

    float acc[MT][NT][4];
#pragma unroll
    for (int a = 0; a < MT; ++a)
#pragma unroll
        for (int b = 0; b < NT; ++b)
#pragma unroll
            for (int c = 0; c < 4; ++c) acc[a][b][c] = 0.0f;

    // ldmatrix row addresses (bytes, within one buffer): A rows lane&15, k + (lane>>4)*8; B rows
    // (lane&7) + (lane>>4)*8, k + ((lane>>3)&1)*8.
    const uint32_t xs_base = smem_u32(xs);
    const uint32_t ws_base = smem_u32(ws);
    const uint32_t a_off = (uint32_t)(((wm * WTM + (lane & 15)) * LDS + (lane >> 4) * 8) * 2);
    const uint32_t b_off = (uint32_t)(((wn * WTN + (lane & 7) + (lane >> 4) * 8) * LDS + ((lane >> 3) & 1) * 8) * 2);

    const int nk = (cols + BK - 1) / BK;
    load(0);
    store(0);
    __syncthreads();
    for (int kt = 0; kt < nk; ++kt) {
        const int buf = kt & 1;
        if (kt + 1 < nk) load((kt + 1) * BK);
        const uint32_t xa = xs_base + buf * (BM * LDS * 2) + a_off;
        const uint32_t wb = ws_base + buf * (BN * LDS * 2) + b_off;
#pragma unroll
        for (int ks = 0; ks < BK / 16; ++ks) {
            uint32_t af[MT][4];
#pragma unroll
            for (int mt = 0; mt < MT; ++mt) ldmatrix_x4(af[mt], xa + (mt * 16 * LDS + ks * 16) * 2);
            uint32_t bfr[NT / 2][4];
#pragma unroll
            for (int np = 0; np < NT / 2; ++np) ldmatrix_x4(bfr[np], wb + (np * 16 * LDS + ks * 16) * 2);
#pragma unroll
            for (int mt = 0; mt < MT; ++mt)
#pragma unroll
                for (int nt = 0; nt < NT; ++nt)
                    mma_bf16(acc[mt][nt], af[mt], bfr[nt >> 1][(nt & 1) * 2], bfr[nt >> 1][(nt & 1) * 2 + 1]);
        }
        if (kt + 1 < nk) store(buf ^ 1);
        __syncthreads();
    }

    // ---- Epilogue: c0, c1 at (token g, cols 2q, 2q+1), c2, c3 at token g + 8 (g = lane/4, q = lane%4).
    const int g = lane >> 2, q = lane & 3;
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

#define GEMM_ENTRY(name, MODE, BM, WM, SWIGLU, GROUPED)                                   \
    extern "C" __global__ void __launch_bounds__(THREADS, 2) name(const GemmParams p) { \
        gemm_tile<MODE, BM, WM, SWIGLU, GROUPED>(p);                                 \
    }

#define GEMM_FAMILY(prefix, SWIGLU, GROUPED)                                 \
    GEMM_ENTRY(prefix##_q4_m64, MODE_Q4, 64, 2, SWIGLU, GROUPED)           \
    GEMM_ENTRY(prefix##_q4_m32, MODE_Q4, 32, 1, SWIGLU, GROUPED)           \
    GEMM_ENTRY(prefix##_q8_m64, MODE_Q8, 64, 2, SWIGLU, GROUPED)           \
    GEMM_ENTRY(prefix##_q8_m32, MODE_Q8, 32, 1, SWIGLU, GROUPED)           \
    GEMM_ENTRY(prefix##_bf16_m64, MODE_BF16, 64, 2, SWIGLU, GROUPED)       \
    GEMM_ENTRY(prefix##_bf16_m32, MODE_BF16, 32, 1, SWIGLU, GROUPED)

GEMM_FAMILY(gemm, false, false)
GEMM_FAMILY(swiglu_gemm, true, false)
GEMM_FAMILY(grouped_gemm, false, true)
GEMM_FAMILY(grouped_swiglu_gemm, true, true)

// Decode GEMV on the tensor cores: y = W x for one token, W 4-bit affine with groups of 64 (the
// checkpoints' format), f32 x and y; also the SwiGLU form y = silu(W_gate x) * (W_up x). The same
// GemvParams, slots, fusions (RMSNorm of x in the staging, the residual add) and PDL protocol as the
// FFMA kernels of affine_gemv.cu, which keep every other format and shape.
//
// Why: the FFMA kernels spend ~3.9 instructions per weight (SASS of affine_gemv_q4_t32_u2r4: one PRMT
// and one FFMA per weight, plus address, scale and loop work), and an SM issues 128 thread-instructions
// a clock while the bandwidth asks for ~33 weights a clock: issue-bound at ~16 weights/clock/SM
// (lm_head at 56% of bandwidth, docs/PERF.md). Here a weight costs ~1 instruction (a shift and a LOP3
// per two codes, one mma per 256 weights of a warp).
//
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
// x staging (shared memory, once per block): per round, 12 "planes" of 64 bytes (part x chunk t), 80
// bytes apart to spread the banks of the 12 lanes that read B (g % 4 < 3 and t/2 == g/4; the others feed
// zeros); a plane holds its chunk's 32 values in mma order (n0 n4 n1 n5 n2 n6 n3 n7 for each word), so
// a lane's B for mmas 2m and 2m+1 is one 16-byte load.
// Work split: a block of 8 warps takes RT = 8/KS tiles of 16 rows; the KS warps of a tile split its
// rounds (split-K, summed through shared memory in a fixed order: deterministic). Blocks stride over
// row tiles (x staged once per block). Each warp keeps the next round's loads in flight while it
// computes the current one; the first round's are issued before the PDL wait. (Issuing all of a
// warp's rounds at once, tried, needed ~110 registers a thread and lost in the decode graph.)

#include <stdint.h>
#include <cuda_bf16.h>
#include "pdl.cuh"
#include "gemv.cuh"
#include "gemv_tc.cuh"
#include "bulk.cuh"

template <int KS, bool SWIGLU>
__device__ __forceinline__ void gemv_tc(const GemvParams& p) {
    constexpr int RT = TC_WARPS / KS;  // row tiles per block
    constexpr int NW = SWIGLU ? 2 : 1;
    extern __shared__ __align__(16) unsigned char tc_smem[];
    const int rows = p.rows, cols = p.cols;
    const int nch = cols >> 5;          // 16-byte chunks per row
    const int groups = cols >> 6;
    const int nr = cols >> 7;           // rounds
    unsigned char* xs = tc_smem;
    float* Xs = reinterpret_cast<float*>(tc_smem + nr * TC_ROUND);
    float* red = Xs + groups;           // [TC_WARPS][NW][16] split-K partials

    const int slot = blockIdx.y;
    if (p.idx) pdl_wait();  // the indices come from the router, a predecessor
    const uint32_t mat = p.idx ? __ldcg(p.idx + slot) : (uint32_t)p.matrix;  // L2: see affine_gemv.cu
    const bool bad = mat >= (uint32_t)p.count;
    const int live_rows = bad ? 0 : rows;
    const float* x = p.x + (long long)slot * p.x_stride;
    float* y = p.y + (long long)slot * rows;

    const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
    const int g = lane >> 2, t = lane & 3;
    const int ks = warp % KS, rt = warp / KS;
    const int nrk = nr / KS;  // rounds per warp
    const int r0 = ks * nrk, r1 = r0 + nrk;
    const long long mrow = (long long)mat * rows;

    // B operand: column g is part g % 4 of group g / 4 (part 3: zero); 12 lanes read x planes.
    const bool breal = (g & 3) < 3 && (t >> 1) == (g >> 2);
    const uint4* xlane = reinterpret_cast<const uint4*>(xs + ((g & 3) * 4 + t) * TC_PLANE);

    auto rows_of = [&](int tile, int mm) {
        const uint4* w = mm == 0 ? p.w : p.w2;
        const uint16_t* sc = mm == 0 ? p.scales : p.scales2;
        const uint16_t* bi = mm == 0 ? p.biases : p.biases2;
        return TcRows::at(w, sc, bi, mrow, tile * 16 + g, true, live_rows, nch, groups, t);
    };

    const int tiles = (rows + 15) >> 4;
    const int tile0 = blockIdx.x * RT + rt;
    TcRows R[NW];
    TcLoad A[NW], B[NW];
#pragma unroll
    for (int mm = 0; mm < NW; ++mm) {
        R[mm] = rows_of(tile0, mm);
        R[mm].load(A[mm], r0);  // weights may be read before the wait
    }
    pdl_enter();
    const float inv = tc_stage(p, x, xs, Xs, cols);
    const uint32_t k16 = opaque(0x41804180u);  // the bf16x2 (16, 16)

    // One round: B from the planes, the 8 mmas and the affine map per matrix.
    auto round = [&](int r, const TcLoad (&L)[NW], float (&acc)[NW][2]) {
        uint4 xb[4];
#pragma unroll
        for (int m = 0; m < 4; ++m) xb[m] = breal ? xlane[r * (TC_ROUND / 16) + m] : make_uint4(0, 0, 0, 0);
        const float X = (t & 1) ? 0.0f : Xs[2 * r + (t >> 1)];
#pragma unroll
        for (int mm = 0; mm < NW; ++mm) {
            float c[4];
            tc_mmas(c, L[mm], xb, k16);
            tc_affine(acc[mm][0], acc[mm][1], c, L[mm], X);
        }
    };

    bool first = true;
    for (int tb = blockIdx.x * RT; tb < tiles; tb += gridDim.x * RT) {
        const int tile = tb + rt;
        if (!first) {
#pragma unroll
            for (int mm = 0; mm < NW; ++mm) {
                R[mm] = rows_of(tile, mm);
                R[mm].load(A[mm], r0);
            }
        }
        first = false;
        float acc[NW][2];
#pragma unroll
        for (int mm = 0; mm < NW; ++mm) acc[mm][0] = acc[mm][1] = 0.0f;
        for (int r = r0; r < r1; r += 2) {
            const bool has1 = r + 1 < r1;
            if (has1) {
#pragma unroll
                for (int mm = 0; mm < NW; ++mm) R[mm].load(B[mm], r + 1);
            }
            round(r, A, acc);
            if (has1) {
                if (r + 2 < r1) {
#pragma unroll
                    for (int mm = 0; mm < NW; ++mm) R[mm].load(A[mm], r + 2);
                }
                round(r + 1, B, acc);
            }
        }
        // The 4 lanes of a row group hold the parts of each round's two groups: their sum is the
        // warp's part of rows g and g+8.
#pragma unroll
        for (int mm = 0; mm < NW; ++mm) {
#pragma unroll
            for (int o = 1; o <= 2; o <<= 1) {
                acc[mm][0] += __shfl_xor_sync(0xffffffffu, acc[mm][0], o);
                acc[mm][1] += __shfl_xor_sync(0xffffffffu, acc[mm][1], o);
            }
        }
        if (KS == 1) {
            if (t == 0) {
                const int row = tile * 16 + g;
                if (row < rows) put_row<SWIGLU>(p, y, row, acc[0][0], acc[NW - 1][0], inv, bad);
                if (row + 8 < rows) put_row<SWIGLU>(p, y, row + 8, acc[0][1], acc[NW - 1][1], inv, bad);
            }
        } else {
            if (t == 0) {
#pragma unroll
                for (int mm = 0; mm < NW; ++mm) {
                    red[(warp * NW + mm) * 16 + g] = acc[mm][0];
                    red[(warp * NW + mm) * 16 + g + 8] = acc[mm][1];
                }
            }
            __syncthreads();
            if (ks == 0 && lane < 16) {
                float s[NW];
#pragma unroll
                for (int mm = 0; mm < NW; ++mm) {
                    s[mm] = 0.0f;
#pragma unroll
                    for (int k = 0; k < KS; ++k) s[mm] += red[((warp + k) * NW + mm) * 16 + lane];
                }
                const int row = tile * 16 + lane;
                if (row < rows) put_row<SWIGLU>(p, y, row, s[0], s[NW - 1], inv, bad);
            }
            __syncthreads();
        }
    }
}

// The MoE down projection with the combine fused, on the tensor cores ("mix"): one token, ns = mix_k
// (+1 with mix_shared) slots, slot s using matrix idx[s] and its own input x[s·cols ..]:
//   y[r] (+)= Σ_s c_s (W[idx[s]] x_s)[r],  c_s = mix_w[s] (s < mix_k), sigmoid(*gate_logit) (s = mix_k).
// One block per 16-row tile: the slots' inputs are staged as one vector of ns·cols (slot s's round r
// is round s·nr + r of it), the ns·nr (slot, round) units are dealt to the 8 warps (unit u to warp
// u % 8), and each warp loads all of its units at once (UMAX at most) before computing any, so a
// warp waits for one round trip, not one per unit (the down projection's rows are short: 4 rounds).
// Each unit's part is scaled by c_s as it is added; the warps' sums are added in warp order in shared
// memory (deterministic). A bad index makes the rows NaN. Replaces the down GEMV and the combine
// kernel (two dependent launches) with one.
template <int UMAX>
__device__ __forceinline__ void mix_tc(const GemvParams& p) {
    extern __shared__ __align__(16) unsigned char tc_smem[];
    __shared__ uint32_t mats[32];
    __shared__ float coef[32];
    __shared__ float red[TC_WARPS][16];
    const int rows = p.rows, cols = p.cols;
    const int nch = cols >> 5, groups = cols >> 6, nr = cols >> 7;
    const int ns = p.mix_k + (p.mix_shared ? 1 : 0);
    const int units = ns * nr;
    unsigned char* xs = tc_smem;
    float* Xs = reinterpret_cast<float*>(tc_smem + units * TC_ROUND);

    pdl_wait();  // the indices and weights come from the router, the inputs from the gate/up GEMV
    pdl_launch_dependents();
    if (threadIdx.x < ns) {
        const int k = threadIdx.x;
        mats[k] = __ldcg(p.idx + k);  // L2: see affine_gemv.cu
        coef[k] = k < p.mix_k ? __ldcg(p.mix_w + k) : 1.0f / (1.0f + expf(-__ldcg(p.gate_logit)));
    }
    __syncthreads();
    bool bad = false;
    for (int k = 0; k < ns; ++k) bad |= mats[k] >= (uint32_t)p.count;

    const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
    const int g = lane >> 2, t = lane & 3;
    const bool breal = (g & 3) < 3 && (t >> 1) == (g >> 2);
    const uint4* xlane = reinterpret_cast<const uint4*>(xs + ((g & 3) * 4 + t) * TC_PLANE);
    const int tiles = (rows + 15) >> 4;
    const uint32_t k16 = opaque(0x41804180u);

    auto load_units = [&](TcLoad (&L)[UMAX], int tile) {
        const int row = tile * 16 + g;
#pragma unroll
        for (int i = 0; i < UMAX; ++i) {
            const int u = warp + TC_WARPS * i;
            if (u < units) {
                const int sl = u / nr, r = u - sl * nr;
                const uint32_t m = mats[sl];
                const bool ok = m < (uint32_t)p.count;  // a bad index loads nothing
                const TcRows R = TcRows::at(p.w, p.scales, p.biases, (long long)(ok ? m : 0) * rows, row, ok, rows, nch, groups, t);
                R.load(L[i], r);
            }
        }
    };

    TcLoad L[UMAX];
    bool staged = false;
    for (int tile = blockIdx.x; tile < tiles; tile += gridDim.x) {
        load_units(L, tile);
        if (!staged) tc_stage(p, p.x, xs, Xs, ns * cols);  // no norm: ends synchronised
        staged = true;
        float acc0 = 0.0f, acc1 = 0.0f;
#pragma unroll
        for (int i = 0; i < UMAX; ++i) {
            const int u = warp + TC_WARPS * i;
            if (u < units) {
                uint4 xb[4];
#pragma unroll
                for (int m = 0; m < 4; ++m) xb[m] = breal ? xlane[u * (TC_ROUND / 16) + m] : make_uint4(0, 0, 0, 0);
                const float X = (t & 1) ? 0.0f : Xs[2 * u + (t >> 1)];
                float c[4];
                tc_mmas(c, L[i], xb, k16);
                float a0 = 0.0f, a1 = 0.0f;
                tc_affine(a0, a1, c, L[i], X);
                const float cs = coef[u / nr];
                acc0 = fmaf(cs, a0, acc0);
                acc1 = fmaf(cs, a1, acc1);
            }
        }
#pragma unroll
        for (int o = 1; o <= 2; o <<= 1) {
            acc0 += __shfl_xor_sync(0xffffffffu, acc0, o);
            acc1 += __shfl_xor_sync(0xffffffffu, acc1, o);
        }
        if (t == 0) {
            red[warp][g] = acc0;
            red[warp][g + 8] = acc1;
        }
        __syncthreads();
        if (warp == 0 && lane < 16) {
            float sum = 0.0f;
#pragma unroll
            for (int w = 0; w < TC_WARPS; ++w) sum += red[w][lane];
            const int row = tile * 16 + lane;
            if (row < rows) {
                if (p.accumulate) sum = __ldcg(p.y + row) + sum;  // from L2: see put_row
                p.y[row] = bad ? __int_as_float(0x7fc00000) : sum;
            }
        }
        __syncthreads();
    }
}

#define MIX_TC_ENTRY(name, UMAX) \
    extern "C" __global__ void __launch_bounds__(TC_WARPS * 32) name(const GemvParams p) { mix_tc<UMAX>(p); }

MIX_TC_ENTRY(affine_mix_tc_q4_u2, 2)
MIX_TC_ENTRY(affine_mix_tc_q4_u5, 5)
MIX_TC_ENTRY(affine_mix_tc_q4_u8, 8)

#define GEMV_TC_ENTRY(name, KS, SW) \
    extern "C" __global__ void __launch_bounds__(TC_WARPS * 32) name(const GemvParams p) { gemv_tc<KS, SW>(p); }

GEMV_TC_ENTRY(affine_gemv_tc_q4_k1, 1, false)
GEMV_TC_ENTRY(affine_gemv_tc_q4_k2, 2, false)
GEMV_TC_ENTRY(affine_gemv_tc_q4_k4, 4, false)
GEMV_TC_ENTRY(affine_gemv_tc_q4_k8, 8, false)
GEMV_TC_ENTRY(affine_swiglu_tc_q4_k1, 1, true)
GEMV_TC_ENTRY(affine_swiglu_tc_q4_k2, 2, true)
GEMV_TC_ENTRY(affine_swiglu_tc_q4_k4, 4, true)
GEMV_TC_ENTRY(affine_swiglu_tc_q4_k8, 8, true)

// ---------------------------------------------------------------------------------------------------
// The bulk-staged form ("bulk"): the same product, K split, roundings and order of sums as gemv_tc
// (its outputs are bit-identical to gemv_tc<KS>'s for the same KS), but a block first has ALL of its
// weights — whole 16-row tiles with their scales and biases — copied into shared memory, and issues
// those copies BEFORE its PDL wait whenever it knows the matrix then: for one matrix (p.idx null), and
// for indices marked settled (p.idx_settled: written by a kernel at least two launches back, which the
// predecessor waited for before letting this kernel start, so they are in memory; the MoE down
// projection after the gate/up GEMV). The block's weights then stream in while its predecessor still
// runs, and after the wait only x's staging, the products from shared memory and the write remain.
// Why: every per-round GEMV above is a chain of dependent HBM round trips after its wait (a round's
// loads are issued one round ahead); docs/PERF.md (2026-12-03) measured 5-11 µs a decode GEMV for
// 0.6-14 MB, 0.7-1.5 TB/s, with the weights hot in L2 saving only 0.5-1.2 µs.
// How the copies are made (COPY): 0, every thread's 16-byte cp.async; 1, the copy engine, one
// cp.async.bulk per row; 2, the copy engine, one per tile's weights, scales and biases (rows unpadded).
// Work split: the grid's x covers units = slots x row tiles, `per` = ceil(units / gridDim.x) consecutive
// units a block (the host sizes the grid so every block has at least one, at most BK_MAX_UNITS, and
// all of them fit on the GPU at once). Warp w takes split ks = w % KS of units rt, rt + RT, ...
// (rt = w / KS), rounds [ks * nr/KS, (ks+1) * nr/KS) in order, as gemv_tc does; the KS partials of a row
// are summed in split order through shared memory.
// Shared memory: per unit and matrix, 16 weight rows of cols/2 (+ BK_WPAD) bytes (the pad puts rows g
// and g+1, read in one quarter-warp phase, 16 banks apart), then 16 scale rows and 16 bias rows of
// 2 * groups (+ BK_SPAD) bytes; then the split partials [per][KS][NW][16] floats; then x staged as in
// gemv_tc, once (shared x) or once per slot the block's units span (per-slot x). Rows past `rows` in a
// last tile are not copied (their products are computed on stale bytes and never written). Shapes:
// cols a multiple of 512 (scale rows of whole 16-byte words). A bad index copies matrix 0's rows and
// writes NaN.
constexpr int BK_WPAD = 64;
constexpr int BK_SPAD = 16;
constexpr int BK_MAX_UNITS = 32;

template <int KS, bool SWIGLU, int COPY>
__device__ __forceinline__ void gemv_bulk(const GemvParams& p) {
    constexpr int RT = TC_WARPS / KS;
    constexpr int NW = SWIGLU ? 2 : 1;
    constexpr bool PAD = COPY != 2;
    extern __shared__ __align__(16) unsigned char tc_smem[];
    __shared__ __align__(8) uint64_t bar;
    __shared__ uint32_t mats[BK_MAX_UNITS];
    const int rows = p.rows, cols = p.cols;
    const int nch = cols >> 5, groups = cols >> 6, nr = cols >> 7;
    const int tiles = (rows + 15) >> 4;
    const int units = tiles * p.slots;
    const int per = (units + (int)gridDim.x - 1) / (int)gridDim.x;
    const int u0 = blockIdx.x * per;
    const int nu = max(0, min(per, units - u0));
    const int rs = (cols >> 1) + (PAD ? BK_WPAD : 0);  // bytes per staged weight row
    const int ss = 2 * groups + (PAD ? BK_SPAD : 0);    // bytes per staged scale (bias) row
    const int mbytes = 16 * rs + 32 * ss;               // one matrix of one unit
    float* red = reinterpret_cast<float*>(tc_smem + per * NW * mbytes);
    const int xbytes = (nr * TC_ROUND + 4 * groups + 15) & ~15;
    unsigned char* xst = tc_smem + per * NW * mbytes + per * KS * NW * 64;
    const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
    const int g = lane >> 2, t = lane & 3;

    if (COPY != 0 && threadIdx.x == 0) mbar_init(&bar, 1);
    if (p.idx && !p.idx_settled) pdl_wait();  // the indices come from the predecessor
    if (threadIdx.x < nu) {
        const int slot = (u0 + threadIdx.x) / tiles;
        mats[threadIdx.x] = p.idx ? __ldcg(p.idx + slot) : (uint32_t)p.matrix;  // L2: see affine_gemv.cu
    }
    __syncthreads();
    // Unit i, matrix mm: the first valid rows of its tile from the stack.
    auto src_rows = [&](int i, int mm, int& valid, long long& grow) {
        const int tile = (u0 + i) % tiles;
        valid = min(16, rows - tile * 16);
        const uint32_t m = mats[i] < (uint32_t)p.count ? mats[i] : 0u;
        grow = (long long)m * rows + tile * 16;
    };
    if (COPY == 0) {
        // Every thread: row r of the weights by warp (r = warp, warp + 8, ...), 16 bytes a lane; then the
        // scale and bias rows, 16 bytes a thread.
        const int gq = groups >> 3;  // 16-byte words per scale row
        for (int i = 0; i < nu; ++i) {
#pragma unroll
            for (int mm = 0; mm < NW; ++mm) {
                int valid;
                long long grow;
                src_rows(i, mm, valid, grow);
                unsigned char* dst = tc_smem + (i * NW + mm) * mbytes;
                const uint4* w = (mm == 0 ? p.w : p.w2) + grow * nch;
                for (int r = warp; r < valid; r += TC_WARPS)
                    for (int j = lane; j < nch; j += 32) cp_async16(dst + r * rs + j * 16, w + (long long)r * nch + j);
                const uint4* sc = reinterpret_cast<const uint4*>((mm == 0 ? p.scales : p.scales2) + grow * groups);
                const uint4* bi = reinterpret_cast<const uint4*>((mm == 0 ? p.biases : p.biases2) + grow * groups);
                for (int e = threadIdx.x; e < 2 * valid * gq; e += TC_WARPS * 32) {
                    const int which = e / (valid * gq), rem = e - which * valid * gq;
                    const int r = rem / gq, j = rem - r * gq;
                    cp_async16(dst + 16 * rs + which * 16 * ss + r * ss + j * 16, (which ? bi : sc) + (long long)r * gq + j);
                }
            }
        }
        cp_async_commit();
    } else if (warp == 0) {
        if (lane == 0) {
            uint32_t bytes = 0;
            for (int i = 0; i < nu; ++i) {
                const int tile = (u0 + i) % tiles;
                bytes += (uint32_t)(min(16, rows - tile * 16) * NW * ((cols >> 1) + 4 * groups));
            }
            mbar_arrive_expect(&bar, bytes);
        }
        __syncwarp();
        if (COPY == 1) {
            // Copy c: unit c / (NW * 48), matrix (c / 48) % NW, then 16 weight rows, 16 scale rows, 16 bias rows.
            for (int c = lane; c < nu * NW * 48; c += 32) {
                const int i = c / (NW * 48), mm = (c / 48) % NW, k = c % 48, kind = k >> 4, r = k & 15;
                int valid;
                long long grow;
                src_rows(i, mm, valid, grow);
                if (r >= valid) continue;
                unsigned char* dst = tc_smem + (i * NW + mm) * mbytes;
                if (kind == 0) {
                    bulk_to_smem(dst + r * rs, (mm == 0 ? p.w : p.w2) + (grow + r) * nch, (uint32_t)(cols >> 1), &bar);
                } else {
                    const uint16_t* src = kind == 1 ? (mm == 0 ? p.scales : p.scales2) : (mm == 0 ? p.biases : p.biases2);
                    bulk_to_smem(dst + 16 * rs + (kind - 1) * 16 * ss + r * ss, src + (grow + r) * groups, (uint32_t)(2 * groups), &bar);
                }
            }
        } else {
            // Copy c: unit c / (NW * 3), matrix (c / 3) % NW, then the tile's weights, scales, biases.
            for (int c = lane; c < nu * NW * 3; c += 32) {
                const int i = c / (NW * 3), mm = (c / 3) % NW, kind = c % 3;
                int valid;
                long long grow;
                src_rows(i, mm, valid, grow);
                unsigned char* dst = tc_smem + (i * NW + mm) * mbytes;
                if (kind == 0) {
                    bulk_to_smem(dst, (mm == 0 ? p.w : p.w2) + grow * nch, (uint32_t)(valid * (cols >> 1)), &bar);
                } else {
                    const uint16_t* src = kind == 1 ? (mm == 0 ? p.scales : p.scales2) : (mm == 0 ? p.biases : p.biases2);
                    bulk_to_smem(dst + 16 * rs + (kind - 1) * 16 * ss, src + grow * groups, (uint32_t)(valid * 2 * groups), &bar);
                }
            }
        }
    }
    pdl_enter();

    // x, once or per spanned slot (the norm only with a shared x: one staging).
    const int s_first = nu > 0 ? u0 / tiles : 0;
    const int nx = p.x_stride ? (nu > 0 ? (u0 + nu - 1) / tiles - s_first + 1 : 0) : 1;
    float inv = 1.0f;
    for (int s = 0; s < nx; ++s) {
        unsigned char* xs = xst + s * xbytes;
        inv = tc_stage(p, p.x + (long long)(s_first + s) * p.x_stride, xs, reinterpret_cast<float*>(xs + nr * TC_ROUND), cols);
    }
    if (COPY == 0) {
        cp_async_wait_all();
        __syncthreads();
    } else {
        mbar_wait(&bar, 0);
    }

    const int ks = warp % KS, rt = warp / KS;
    const int nrk = nr / KS;
    const int r0 = ks * nrk, r1 = r0 + nrk;
    const bool breal = (g & 3) < 3 && (t >> 1) == (g >> 2);
    const uint32_t k16 = opaque(0x41804180u);
    for (int i = rt; i < nu; i += RT) {
        const int slot = (u0 + i) / tiles, tile = (u0 + i) % tiles;
        const unsigned char* xs = xst + (p.x_stride ? slot - s_first : 0) * xbytes;
        const uint4* xlane = reinterpret_cast<const uint4*>(xs + ((g & 3) * 4 + t) * TC_PLANE);
        const float* Xs = reinterpret_cast<const float*>(xs + nr * TC_ROUND);
        float acc[NW][2];
#pragma unroll
        for (int mm = 0; mm < NW; ++mm) acc[mm][0] = acc[mm][1] = 0.0f;
        for (int r = r0; r < r1; ++r) {
            uint4 xb[4];
#pragma unroll
            for (int m = 0; m < 4; ++m) xb[m] = breal ? xlane[r * (TC_ROUND / 16) + m] : make_uint4(0, 0, 0, 0);
            const float X = (t & 1) ? 0.0f : Xs[2 * r + (t >> 1)];
#pragma unroll
            for (int mm = 0; mm < NW; ++mm) {
                const unsigned char* base = tc_smem + (i * NW + mm) * mbytes;
                const unsigned char* sc = base + 16 * rs + (2 * r + (t >> 1)) * 2;
                TcLoad L;
                L.w0 = *reinterpret_cast<const uint4*>(base + g * rs + (4 * r + t) * 16);
                L.w1 = *reinterpret_cast<const uint4*>(base + (g + 8) * rs + (4 * r + t) * 16);
                L.s0 = *reinterpret_cast<const uint16_t*>(sc + g * ss);
                L.s1 = *reinterpret_cast<const uint16_t*>(sc + (g + 8) * ss);
                L.b0 = *reinterpret_cast<const uint16_t*>(sc + 16 * ss + g * ss);
                L.b1 = *reinterpret_cast<const uint16_t*>(sc + 16 * ss + (g + 8) * ss);
                float c[4];
                tc_mmas(c, L, xb, k16);
                tc_affine(acc[mm][0], acc[mm][1], c, L, X);
            }
        }
#pragma unroll
        for (int mm = 0; mm < NW; ++mm) {
#pragma unroll
            for (int o = 1; o <= 2; o <<= 1) {
                acc[mm][0] += __shfl_xor_sync(0xffffffffu, acc[mm][0], o);
                acc[mm][1] += __shfl_xor_sync(0xffffffffu, acc[mm][1], o);
            }
        }
        if (t == 0) {
            if (KS == 1) {
                const bool bad = mats[i] >= (uint32_t)p.count;
                float* y = p.y + (long long)slot * rows;
                const int row = tile * 16 + g;
                if (row < rows) put_row<SWIGLU>(p, y, row, acc[0][0], acc[NW - 1][0], inv, bad);
                if (row + 8 < rows) put_row<SWIGLU>(p, y, row + 8, acc[0][1], acc[NW - 1][1], inv, bad);
            } else {
#pragma unroll
                for (int mm = 0; mm < NW; ++mm) {
                    red[((i * KS + ks) * NW + mm) * 16 + g] = acc[mm][0];
                    red[((i * KS + ks) * NW + mm) * 16 + g + 8] = acc[mm][1];
                }
            }
        }
    }
    if (KS > 1) {
        __syncthreads();
        for (int e = threadIdx.x; e < nu * 16; e += blockDim.x) {
            const int i = e >> 4, lr = e & 15;
            const int slot = (u0 + i) / tiles, tile = (u0 + i) % tiles;
            const int row = tile * 16 + lr;
            if (row >= rows) continue;
            float s[NW];
#pragma unroll
            for (int mm = 0; mm < NW; ++mm) {
                s[mm] = 0.0f;
#pragma unroll
                for (int k = 0; k < KS; ++k) s[mm] += red[((i * KS + k) * NW + mm) * 16 + lr];
            }
            put_row<SWIGLU>(p, p.y + (long long)slot * rows, row, s[0], s[NW - 1], inv, mats[i] >= (uint32_t)p.count);
        }
    }
}

#define GEMV_BULK_ENTRY(name, KS, SW, C) \
    extern "C" __global__ void __launch_bounds__(TC_WARPS * 32) name(const GemvParams p) { gemv_bulk<KS, SW, C>(p); }
#define GEMV_BULK_COPIES(C)                                      \
    GEMV_BULK_ENTRY(affine_gemv_bulk_q4_k1_c##C, 1, false, C)    \
    GEMV_BULK_ENTRY(affine_gemv_bulk_q4_k2_c##C, 2, false, C)    \
    GEMV_BULK_ENTRY(affine_gemv_bulk_q4_k4_c##C, 4, false, C)    \
    GEMV_BULK_ENTRY(affine_gemv_bulk_q4_k8_c##C, 8, false, C)    \
    GEMV_BULK_ENTRY(affine_swiglu_bulk_q4_k1_c##C, 1, true, C)   \
    GEMV_BULK_ENTRY(affine_swiglu_bulk_q4_k2_c##C, 2, true, C)   \
    GEMV_BULK_ENTRY(affine_swiglu_bulk_q4_k4_c##C, 4, true, C)   \
    GEMV_BULK_ENTRY(affine_swiglu_bulk_q4_k8_c##C, 8, true, C)

GEMV_BULK_COPIES(0)
GEMV_BULK_COPIES(1)
GEMV_BULK_COPIES(2)

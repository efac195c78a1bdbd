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
// computes the current one (DEPTH 2: the next two); the first round's (two) are issued before the
// PDL wait. (Issuing all of a warp's rounds at once, tried, needed ~110 registers a thread and lost
// in the decode graph.)

#include <stdint.h>
#include <cuda_bf16.h>
#include "pdl.cuh"
#include "gemv.cuh"
#include "gemv_tc.cuh"
#include "route.cuh"

// SEL: the MoE gate/up with the router's selection inside each block (affine_swiglu_i8_q4_k*_sel).
// Slots 0..route_k-1 take the route_k best of the route_e logits at sel_logits, best first, ranked
// after the PDL wait (the router is the launch just before) by warp 0 of each block (route_row, the
// same picks as moe_route) while the other warps wait at a barrier; slot route_k (the shared expert)
// takes `matrix`, known before the wait (its first round is loaded then). Block (0, 0) also writes
// the picks and their weights to route_idx and route_w for the down projection and the combine after
// it. Replaces the selection kernel (a launch, and the hop between it and the gate/up). Measured
// (PERF.md, seventeenth session) and not kept: the whole block ranking (route_block), slower; the
// down projection ranking again before its own PDL wait, no faster.
template <int KS, bool SWIGLU, bool I8, int DEPTH, bool SEL = false>
__device__ __forceinline__ void gemv_tc(const GemvParams& p) {
    static_assert(DEPTH == 1 || DEPTH == 2, "rounds in flight ahead of the one computed");
    static_assert(!SEL || (SWIGLU && I8 && DEPTH == 1), "the selection in the integer SwiGLU");
    constexpr int RT = TC_WARPS / KS;  // row tiles per block
    constexpr int NW = SWIGLU ? 2 : 1;
    constexpr int ROUND_BYTES = I8 ? I8_ROUND : TC_ROUND;
    extern __shared__ __align__(16) unsigned char tc_smem[];
    const int rows = p.rows, cols = p.cols;
    const int nch = cols >> 5;          // 16-byte chunks per row
    const int groups = cols >> 6;
    const int nr = cols >> 7;           // rounds
    unsigned char* xs = tc_smem;
    float* Xs = reinterpret_cast<float*>(tc_smem + nr * ROUND_BYTES);
    float* sig = Xs + groups;           // I8: each group's σ
    float* red = Xs + (I8 ? 2 : 1) * groups;  // [TC_WARPS][NW][16] split-K partials

    const int slot = blockIdx.y;
    uint32_t mat;
    if constexpr (SEL) {
        mat = (uint32_t)p.matrix;
        if (slot < p.route_k) {  // block-uniform
            __shared__ float sel_s[256];
            __shared__ uint32_t sel_idx[32];
            __shared__ float sel_w[32];
            pdl_wait();  // the logits come from the launch just before
            const bool writer = blockIdx.x == 0 && slot == 0;
            if (threadIdx.x < 32) {
                if (writer) route_row<8, true>(p.sel_logits, p.route_e, p.route_k, p.route_renorm, sel_s, sel_idx, sel_w);
                else route_row<8, false>(p.sel_logits, p.route_e, p.route_k, p.route_renorm, sel_s, sel_idx, sel_w);
            }
            __syncthreads();
            mat = sel_idx[slot];
            if (writer && threadIdx.x < p.route_k) {
                p.route_idx[threadIdx.x] = sel_idx[threadIdx.x];
                p.route_w[threadIdx.x] = sel_w[threadIdx.x];
            }
        }
    } else {
        if (p.idx) pdl_wait();  // the indices come from the router, a predecessor
        mat = p.idx ? __ldcg(p.idx + slot) : (uint32_t)p.matrix;  // L2: see affine_gemv.cu
    }
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
    const bool breal = tc_breal(g, t);
    const uint4* xlane = I8 ? i8_xlane(xs, g, t) : tc_xlane(xs, g, t);

    auto rows_of = [&](int tile, int mm) {
        const uint4* w = mm == 0 ? p.w : p.w2;
        const uint16_t* sc = mm == 0 ? p.scales : p.scales2;
        const uint16_t* bi = mm == 0 ? p.biases : p.biases2;
        return TcRows::at(w, sc, bi, mrow, tile * 16 + g, true, live_rows, nch, groups, t);
    };

    const int tiles = (rows + 15) >> 4;
    const int tile0 = blockIdx.x * RT + rt;
    TcRows R[NW];
    TcLoad A[NW], B[NW], C[NW];  // C: DEPTH 2 only
#pragma unroll
    for (int mm = 0; mm < NW; ++mm) {
        R[mm] = rows_of(tile0, mm);
        R[mm].load(A[mm], r0);  // weights may be read before the wait
        if (DEPTH == 2 && r0 + 1 < r1) R[mm].load(B[mm], r0 + 1);
    }
    pdl_enter();
    const float inv = I8 ? i8_stage(p, x, xs, Xs, sig, cols) : tc_stage(p, x, xs, Xs, cols);
    uint32_t k16 = 0u;  // the bf16 form's bf16x2 (16, 16)
    if constexpr (!I8) k16 = opaque(0x41804180u);

    // One round: B from the planes, the 8 mmas and the affine map per matrix.
    auto round = [&](int r, const TcLoad (&L)[NW], float (&acc)[NW][2]) {
        if constexpr (I8) {
            uint4 xb[2];
            float k0, k1;
            const float X = i8_round_b(xb, xlane, Xs, sig, r, breal, t, k0, k1);
#pragma unroll
            for (int mm = 0; mm < NW; ++mm) {
                int c[4];
                i8_mmas(c, L[mm], xb);
                i8_affine(acc[mm][0], acc[mm][1], c, L[mm], k0, k1, X);
            }
        } else {
            uint4 xb[4];
            const float X = tc_round_b(xb, xlane, Xs, r, breal, t);
#pragma unroll
            for (int mm = 0; mm < NW; ++mm) {
                float c[4];
                tc_mmas(c, L[mm], xb, k16);
                tc_affine(acc[mm][0], acc[mm][1], c, L[mm], X);
            }
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
                if (DEPTH == 2 && r0 + 1 < r1) R[mm].load(B[mm], r0 + 1);
            }
        }
        first = false;
        float acc[NW][2];
#pragma unroll
        for (int mm = 0; mm < NW; ++mm) acc[mm][0] = acc[mm][1] = 0.0f;
        if constexpr (DEPTH == 1) {
            // One round in flight: A holds round r; B takes r + 1 while r is computed, then A r + 2.
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
        } else {
            // Two rounds in flight: at the top A holds round r and B r + 1; C takes r + 2 while r is
            // computed, then the buffer just used takes the round two ahead of the next one computed.
            for (int r = r0; r < r1; r += 3) {
                if (r + 2 < r1) {
#pragma unroll
                    for (int mm = 0; mm < NW; ++mm) R[mm].load(C[mm], r + 2);
                }
                round(r, A, acc);
                if (r + 1 < r1) {
                    if (r + 3 < r1) {
#pragma unroll
                        for (int mm = 0; mm < NW; ++mm) R[mm].load(A[mm], r + 3);
                    }
                    round(r + 1, B, acc);
                }
                if (r + 2 < r1) {
                    if (r + 4 < r1) {
#pragma unroll
                        for (int mm = 0; mm < NW; ++mm) R[mm].load(B[mm], r + 4);
                    }
                    round(r + 2, C, acc);
                }
            }
        }
#pragma unroll
        for (int mm = 0; mm < NW; ++mm) tc_lane_sum(acc[mm][0], acc[mm][1]);
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
    const bool breal = tc_breal(g, t);
    const uint4* xlane = tc_xlane(xs, g, t);
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
                const float X = tc_round_b(xb, xlane, Xs, u, breal, t);
                float c[4];
                tc_mmas(c, L[i], xb, k16);
                float a0 = 0.0f, a1 = 0.0f;
                tc_affine(a0, a1, c, L[i], X);
                const float cs = coef[u / nr];
                acc0 = fmaf(cs, a0, acc0);
                acc1 = fmaf(cs, a1, acc1);
            }
        }
        tc_lane_sum(acc0, acc1);
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

#define GEMV_TC_ENTRY(name, KS, SW, I8, DEPTH) \
    extern "C" __global__ void __launch_bounds__(TC_WARPS * 32) name(const GemvParams p) { gemv_tc<KS, SW, I8, DEPTH>(p); }
#define GEMV_SEL_ENTRY(name, KS) \
    extern "C" __global__ void __launch_bounds__(TC_WARPS * 32) name(const GemvParams p) { gemv_tc<KS, true, true, 1, true>(p); }

GEMV_TC_ENTRY(affine_gemv_tc_q4_k1, 1, false, false, 1)
GEMV_TC_ENTRY(affine_gemv_tc_q4_k2, 2, false, false, 1)
GEMV_TC_ENTRY(affine_gemv_tc_q4_k4, 4, false, false, 1)
GEMV_TC_ENTRY(affine_gemv_tc_q4_k8, 8, false, false, 1)
GEMV_TC_ENTRY(affine_swiglu_tc_q4_k1, 1, true, false, 1)
GEMV_TC_ENTRY(affine_swiglu_tc_q4_k2, 2, true, false, 1)
GEMV_TC_ENTRY(affine_swiglu_tc_q4_k4, 4, true, false, 1)
GEMV_TC_ENTRY(affine_swiglu_tc_q4_k8, 8, true, false, 1)
// The integer form (gemv_tc.cuh): x as three byte planes, int8 mmas.
GEMV_TC_ENTRY(affine_gemv_i8_q4_k1, 1, false, true, 1)
GEMV_TC_ENTRY(affine_gemv_i8_q4_k2, 2, false, true, 1)
GEMV_TC_ENTRY(affine_gemv_i8_q4_k4, 4, false, true, 1)
GEMV_TC_ENTRY(affine_gemv_i8_q4_k8, 8, false, true, 1)
GEMV_TC_ENTRY(affine_swiglu_i8_q4_k1, 1, true, true, 1)
GEMV_TC_ENTRY(affine_swiglu_i8_q4_k2, 2, true, true, 1)
GEMV_TC_ENTRY(affine_swiglu_i8_q4_k4, 4, true, true, 1)
GEMV_TC_ENTRY(affine_swiglu_i8_q4_k8, 8, true, true, 1)
// The MoE gate/up with the selection (SEL above).
GEMV_SEL_ENTRY(affine_swiglu_i8_q4_k1_sel, 1)
GEMV_SEL_ENTRY(affine_swiglu_i8_q4_k2_sel, 2)
GEMV_SEL_ENTRY(affine_swiglu_i8_q4_k4_sel, 4)
GEMV_SEL_ENTRY(affine_swiglu_i8_q4_k8_sel, 8)
// Two rounds in flight (the bf16 form, one matrix; opt-in, LILY_GEMV_DEPTH=2): twice the weight bytes
// in flight a warp for 12 more registers a thread.
GEMV_TC_ENTRY(affine_gemv_tc_q4_k1_d2, 1, false, false, 2)
GEMV_TC_ENTRY(affine_gemv_tc_q4_k2_d2, 2, false, false, 2)
GEMV_TC_ENTRY(affine_gemv_tc_q4_k4_d2, 4, false, false, 2)
GEMV_TC_ENTRY(affine_gemv_tc_q4_k8_d2, 8, false, false, 2)

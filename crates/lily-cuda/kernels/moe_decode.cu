// The MoE block of one decode token after its router, as one persistent kernel: what the selection,
// the gate/up GEMV, the down GEMV and the combine did in four dependent launches,
//   chosen, w = the top k of softmax(logits[0..E))            (route.cuh's values and picks, bit for bit)
//   n       = RMSNorm(x) * norm_w
//   act_s   = silu(G_s n) * (U_s n)      for the k chosen experts and the shared expert (matrix E)
//   x      += sum_{s<k} w_s * (D_s act_s) + sigmoid(logits[E]) * (D_E act_E)
// on 4-bit group-64 stacks of E + 1 matrices (the shared expert last), with the tensor-core product of
// gemv_tc.cuh (outputs within the GEMVs' tolerance; the slots are summed in slot order where the
// separate combine sums in expert order: they differ by rounding).
// Why: the four launches were ~21 µs of a ~50 µs layer in the decode graph (docs/PERF.md, 2026-12-03),
// each a chain of its own wait, staging, loads and write; here the selection, the copies and the
// products run back to back in every block, and one grid-wide barrier hands the SwiGLU outputs to
// the down projection. Measured (docs/PERF.md, 2026-12-04): ~17.5 µs a launch, even with the four
// kernels in the 4K graph so far; opt-in (LILY_MOE_DECODE=1) until it is faster.
// Phases, each block (grid = at most one block an SM, all resident at once; the host checks):
//   1. copies of its gate/up units whose matrix is known before the wait (the shared expert's);
//      the PDL wait (the logits are the predecessor's; x was written before it);
//   2. the selection (route.cuh's route_block, every block alike) into shared memory; copies of
//      its other gate/up units (cp.async into shared memory); x staged with the norm; once the copies
//      landed, its first down tile's weights into registers (held across the barrier); the SwiGLU
//      units -> act (global, [k+1, I]);
//   3. the grid barrier (a 64-bit counter that only grows: each launch adds gridDim.x, and a block
//      waits for the end of its generation), then launch_dependents (every block is resident now, so
//      the next kernel cannot take an SM one of ours still needs);
//   4. act staged (all slots as one vector), the down tiles: each (slot, round) unit of a 16-row
//      output tile dealt to the 16 warps, scaled by its slot's weight as it is added, the warps' sums in
//      warp order (deterministic), the residual added, x written.
// Units of phase 2: (slot, 16-row tile of I) dealt round-robin (block b: b, b + G, ...), at most
// ceil(units / G) a block; in shared memory (sized by the host for that many) per unit: gate then up,
// each 16 weight rows of H/2 + MD_WPAD bytes and 16 scale and 16 bias rows of H/32 + MD_SPAD bytes
// (the pads spread a quarter-warp's rows over the banks). Shapes: H and I multiples of 512,
// E <= MD_MAX_E, 1 <= k <= 32, (k + 1) * I/128 <= 16 * UMAX, (k + 1) * I <= 8 * MD_STAGE_WORDS * 512.
// Products in two chains of 4 mmas a round (tc_mmas<2>): the latency of each phase's chain halved.
#include <stdint.h>
#include <cuda_bf16.h>
#include "pdl.cuh"
#include "gemv.cuh"
#include "gemv_tc.cuh"
#include "async_copy.cuh"
#include "route.cuh"
#include "grid_sync.cuh"

struct MoeDecodeParams {
    const uint4* gw;          // gate [E + 1, I, H/32] 16-byte chunks
    const uint16_t* gs;       // [E + 1, I, H/64] bf16 bits
    const uint16_t* gb;
    const uint4* uw;          // up, as gate
    const uint16_t* us;
    const uint16_t* ub;
    const uint4* dw;          // down [E + 1, H, I/32]
    const uint16_t* ds;       // [E + 1, H, I/64]
    const uint16_t* db;
    const float* logits;      // [E + 1]: the router's, the shared expert's gate logit last
    const float* norm_w;      // [H]
    float* x;                 // [H] the residual stream (read, then += the block's output)
    float* act;               // [k + 1, I] scratch
    unsigned long long* barrier;  // the grid barrier's counter (this call site's alone)
    uint32_t* idx_out;        // [k] or null: the chosen experts (block 0 writes them)
    float* w_out;             // [k] or null: their weights
    unsigned long long* trace;  // [grid][MD_TRACE] or null: each block's %globaltimer at its phases (benchmarks)
    float eps;
    int h;
    int inter;
    int e;
    int k;
    int renorm;
};

constexpr int MD_WARPS = 16;
constexpr int MD_KS = 8;     // phase 2 splits each unit's rounds over 8 warps; the warps' halves take alternate units
constexpr int MD_WPAD = 64;
constexpr int MD_SPAD = 16;
constexpr int MD_MAX_E = 256; // experts the selection ranks
constexpr int MD_TRACE = 10; // phase stamps a block writes when tracing

__device__ __forceinline__ void md_stamp(const unsigned long long* trace_base, int i) {
    if (trace_base != nullptr && threadIdx.x == 0) {
        unsigned long long t;
        asm volatile("mov.u64 %0, %%globaltimer;" : "=l"(t));
        const_cast<unsigned long long*>(trace_base)[blockIdx.x * MD_TRACE + i] = t;
    }
}

// act (n values, n a multiple of 64, at most MD_STAGE_WORDS words of 8 a thread) -> the planes and
// group sums, as tc_stage without a norm, but with every thread's loads issued before any is used (one
// L2 round trip, not one per pass). Ends synchronised.
constexpr int MD_STAGE_WORDS = 4;
__device__ __forceinline__ void md_stage_act(const float* act, int n, unsigned char* xs, float* Xs) {
    const int nw = n >> 3;
    float4 va[MD_STAGE_WORDS], vb[MD_STAGE_WORDS];
#pragma unroll
    for (int w = 0; w < MD_STAGE_WORDS; ++w) {
        const int j = w * blockDim.x + threadIdx.x;
        if (j < nw) {
            va[w] = __ldcg(reinterpret_cast<const float4*>(act) + 2 * j);
            vb[w] = __ldcg(reinterpret_cast<const float4*>(act) + 2 * j + 1);
        }
    }
#pragma unroll
    for (int w = 0; w < MD_STAGE_WORDS; ++w) {
        const int j = w * blockDim.x + threadIdx.x;
        if (w * (int)blockDim.x >= nw) break;  // the whole block alike
        const bool on = j < nw;
        const float v[8] = {on ? va[w].x : 0.0f, on ? va[w].y : 0.0f, on ? va[w].z : 0.0f, on ? va[w].w : 0.0f,
                            on ? vb[w].x : 0.0f, on ? vb[w].y : 0.0f, on ? vb[w].z : 0.0f, on ? vb[w].w : 0.0f};
        tc_stage_word(v, j, on, xs, Xs);
    }
    __syncthreads();
}

template <int UMAX>
__device__ __forceinline__ void moe_decode(const MoeDecodeParams& p) {
    extern __shared__ __align__(16) unsigned char md_smem[];
    __shared__ __align__(16) float route_s[MD_MAX_E];
    __shared__ uint32_t sidx[33];
    __shared__ float sw[33];
    __shared__ float red3[MD_WARPS][16];
    __shared__ float route_red[MD_WARPS + 1];
    const int H = p.h, I = p.inter, ns = p.k + 1;
    const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
    const int g = lane >> 2, t = lane & 3;
    const int G = gridDim.x, b = blockIdx.x;
    // Phase 2's geometry: H columns (gate/up rows are I of them per matrix).
    const int nchH = H >> 5, grpH = H >> 6, nrH = H >> 7;
    const int tilesI = I >> 4;
    const int units = ns * tilesI;
    const int nu = b < units ? (units - 1 - b) / G + 1 : 0;  // this block's units: b, b + G, ...
    const int umax = (units + G - 1) / G;                     // the most any block has
    const int rs = (H >> 1) + MD_WPAD, ss = 2 * grpH + MD_SPAD;
    const int mbytes = 16 * rs + 32 * ss;  // one matrix of one unit
    float* red = reinterpret_cast<float*>(md_smem + umax * 2 * mbytes);  // [unit][MD_KS][2][16]
    unsigned char* xst = md_smem + umax * 2 * mbytes + umax * MD_KS * 2 * 64;
    // Phase 4's geometry: I columns, all slots as one vector staged over the (free) unit region.
    const int nchI = I >> 5, grpI = I >> 6, nrI = I >> 7;
    const int units3 = ns * nrI;  // (slot, round) units of one output tile
    const int tilesH = (H + 15) >> 4;

    // Unit i of this block: slot and tile.
    auto unit_slot = [&](int i) { return (b + i * G) / tilesI; };
    auto unit_tile = [&](int i) { return (b + i * G) % tilesI; };
    // Copies of unit i's gate and up tiles (matrix m) into shared memory, 16 bytes a thread.
    auto copy_unit = [&](int i, uint32_t m) {
        const long long grow = (long long)m * I + unit_tile(i) * 16;
        const int gq = grpH >> 3;
#pragma unroll
        for (int mm = 0; mm < 2; ++mm) {
            unsigned char* dst = md_smem + (i * 2 + mm) * mbytes;
            const uint4* w = (mm == 0 ? p.gw : p.uw) + grow * nchH;
            for (int r = warp; r < 16; r += MD_WARPS)
                for (int j = lane; j < nchH; j += 32) cp_async16(smem_addr(dst + r * rs + j * 16), w + (long long)r * nchH + j, true);
            const uint4* sc = reinterpret_cast<const uint4*>((mm == 0 ? p.gs : p.us) + grow * grpH);
            const uint4* bi = reinterpret_cast<const uint4*>((mm == 0 ? p.gb : p.ub) + grow * grpH);
            for (int e2 = threadIdx.x; e2 < 32 * gq; e2 += MD_WARPS * 32) {
                const int which = e2 / (16 * gq), rem = e2 - which * 16 * gq;
                const int r = rem / gq, j = rem - r * gq;
                cp_async16(smem_addr(dst + 16 * rs + which * 16 * ss + r * ss + j * 16), (which ? bi : sc) + (long long)r * gq + j, true);
            }
        }
    };

    // 1. The shared expert's units (matrix E) before the wait.
    md_stamp(p.trace, 0);
    for (int i = 0; i < nu; ++i)
        if (unit_slot(i) == ns - 1) copy_unit(i, (uint32_t)p.e);
    cp_async_commit_group();
    pdl_wait();
    md_stamp(p.trace, 1);

    // 2. The selection (every block alike), then the routed units' copies.
    route_block<MD_MAX_E, MD_WARPS>(p.logits, p.e, p.k, p.renorm, route_s, route_red, sidx, sw);
    if (threadIdx.x == 0) {
        sidx[p.k] = (uint32_t)p.e;
        sw[p.k] = 1.0f / (1.0f + expf(-__ldcg(p.logits + p.e)));
    }
    __syncthreads();
    md_stamp(p.trace, 2);
    if (b == 0 && p.idx_out && threadIdx.x < p.k) {
        p.idx_out[threadIdx.x] = sidx[threadIdx.x];
        p.w_out[threadIdx.x] = sw[threadIdx.x];
    }
    for (int i = 0; i < nu; ++i)
        if (unit_slot(i) < ns - 1) copy_unit(i, sidx[unit_slot(i)]);
    cp_async_commit_group();

    // The first down tile's weights (tile b), unit u = warp + 8j: slot u / nrI, round u % nrI.
    TcLoad L[UMAX];
    auto load_down = [&](int tile) {
        const int row = tile * 16 + g;
#pragma unroll
        for (int j = 0; j < UMAX; ++j) {
            const int u = warp + MD_WARPS * j;
            if (u < units3) {
                const int sl = u / nrI, r = u - sl * nrI;
                const TcRows R = TcRows::at(p.dw, p.ds, p.db, (long long)sidx[sl] * H, row, true, H, nchI, grpI, t);
                R.load(L[j], r);
            }
        }
    };
    md_stamp(p.trace, 3);

    const float inv = tc_stage<MD_WARPS>(p.norm_w, p.eps, p.x, xst, reinterpret_cast<float*>(xst + nrH * TC_ROUND), H);
    md_stamp(p.trace, 4);
    cp_async_wait_group<0>();
    __syncthreads();
    md_stamp(p.trace, 5);
    // The down weights now, so that they stream in during the SwiGLU and the barrier, not ahead of
    // the gate/up copies; and the residual of this block's first output tile (x rows that only this
    // block writes, after the barrier).
    if (b < tilesH) load_down(b);
    const float x_res = (warp == 0 && lane < 16 && b < tilesH) ? __ldcg(p.x + b * 16 + lane) : 0.0f;

    // The SwiGLU units: warp w takes rounds w % 8, w % 8 + 8, ... of units w / 8, w / 8 + 2, ...; the 8
    // partials of a row are summed in split order.
    {
        constexpr int KS = MD_KS, UG = MD_WARPS / MD_KS;
        const int kr = warp % KS, ug = warp / KS;
        const bool breal = tc_breal(g, t);
        const uint4* xlane = tc_xlane(xst, g, t);
        const float* Xs = reinterpret_cast<const float*>(xst + nrH * TC_ROUND);
        const uint32_t k16 = opaque(0x41804180u);
        for (int i = ug; i < nu; i += UG) {
            float acc[2][2] = {{0.0f, 0.0f}, {0.0f, 0.0f}};
            for (int r = kr; r < nrH; r += KS) {
                uint4 xb[4];
                const float X = tc_round_b(xb, xlane, Xs, r, breal, t);
#pragma unroll
                for (int mm = 0; mm < 2; ++mm) {
                    const TcLoad W = tc_load_staged(md_smem + (i * 2 + mm) * mbytes, rs, ss, r, g, t);
                    float c[4];
                    tc_mmas<2>(c, W, xb, k16);
                    tc_affine(acc[mm][0], acc[mm][1], c, W, X);
                }
            }
#pragma unroll
            for (int mm = 0; mm < 2; ++mm) {
                tc_lane_sum(acc[mm][0], acc[mm][1]);
                if (t == 0) {
                    red[((i * KS + kr) * 2 + mm) * 16 + g] = acc[mm][0];
                    red[((i * KS + kr) * 2 + mm) * 16 + g + 8] = acc[mm][1];
                }
            }
        }
        __syncthreads();
        for (int e2 = threadIdx.x; e2 < nu * 16; e2 += blockDim.x) {
            const int i = e2 >> 4, lr = e2 & 15;
            float s0 = 0.0f, s1 = 0.0f;
#pragma unroll
            for (int k = 0; k < KS; ++k) {
                s0 += red[((i * KS + k) * 2 + 0) * 16 + lr];
                s1 += red[((i * KS + k) * 2 + 1) * 16 + lr];
            }
            p.act[(long long)unit_slot(i) * I + unit_tile(i) * 16 + lr] = silu_f(s0 * inv) * (s1 * inv);
        }
    }

    // 3. Every block's act written: the barrier, then the next kernel may be placed.
    md_stamp(p.trace, 6);
    grid_barrier(p.barrier);
    md_stamp(p.trace, 7);
    pdl_launch_dependents();

    // 4. act staged over the unit region, then the down tiles with the combine and the residual.
    unsigned char* ast = md_smem;
    float* As = reinterpret_cast<float*>(md_smem + units3 * TC_ROUND);
    md_stage_act(p.act, ns * I, ast, As);  // ends synchronised
    md_stamp(p.trace, 8);
    const bool breal = tc_breal(g, t);
    const uint4* alane = tc_xlane(ast, g, t);
    const uint32_t k16 = opaque(0x41804180u);
    for (int tile = b; tile < tilesH; tile += G) {
        if (tile != b) load_down(tile);
        float acc0 = 0.0f, acc1 = 0.0f;
#pragma unroll
        for (int j = 0; j < UMAX; ++j) {
            const int u = warp + MD_WARPS * j;
            if (u < units3) {
                uint4 xb[4];
                const float X = tc_round_b(xb, alane, As, u, breal, t);
                float c[4];
                tc_mmas<2>(c, L[j], xb, k16);
                float a0 = 0.0f, a1 = 0.0f;
                tc_affine(a0, a1, c, L[j], X);
                const float cs = sw[u / nrI];
                acc0 = fmaf(cs, a0, acc0);
                acc1 = fmaf(cs, a1, acc1);
            }
        }
        tc_lane_sum(acc0, acc1);
        if (t == 0) {
            red3[warp][g] = acc0;
            red3[warp][g + 8] = acc1;
        }
        __syncthreads();
        if (warp == 0 && lane < 16) {
            float sum = 0.0f;
#pragma unroll
            for (int w = 0; w < MD_WARPS; ++w) sum += red3[w][lane];
            const int row = tile * 16 + lane;
            if (row < H) p.x[row] = (tile == b ? x_res : __ldcg(p.x + row)) + sum;
        }
        __syncthreads();
    }
    md_stamp(p.trace, 9);
}

#define MOE_DECODE_ENTRY(name, UMAX) \
    extern "C" __global__ void __launch_bounds__(MD_WARPS * 32) name(const MoeDecodeParams p) { moe_decode<UMAX>(p); }

MOE_DECODE_ENTRY(moe_decode_u1, 1)
MOE_DECODE_ENTRY(moe_decode_u3, 3)
MOE_DECODE_ENTRY(moe_decode_u6, 6)

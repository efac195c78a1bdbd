// Decode GEMV, y[r] = sum_c W[r, c] * x[c], on MLX affine-quantised weights (4 or 8 bits, group 32/64/128)
// or dense bf16 weights, with f32 activations in and out.
//
// Weight layout (as the checkpoint stores it; see lily_model::weights::Storage):
//   packed  u32 [count, rows, cols*bits/32], element j of a row in word j*bits/32, LSB first;
//   scales, biases bf16 [count, rows, cols/group];  w = scale * q + bias.
// A row is read in 16-byte "chunks" (E = 128/bits weights: 32 for 4-bit, 16 for 8-bit, 8 for bf16);
// a chunk never straddles a group, since group >= 32 >= E. TPR lanes (4..32) share a row; lane t takes
// chunks t, t+TPR, ... so one warp instruction reads TPR*16 contiguous bytes, and ends with a shuffle
// reduction. A warp holds 32/TPR rows.
//
// The group-sum trick: sum_j (s*q_j + b) * x_j = s * sum_j q_j x_j + b * sum_j x_j. The block copies x
// into shared memory once, transposed so that lanes reading consecutive chunks hit consecutive 16-byte
// words (no bank conflicts), and precomputes the per-chunk sums X_c = sum of x over the chunk.
//
// Turning a code into a float costs instructions, and at 4.3 TB/s a 4-bit GEMV must retire ~7.6e12
// weights/s, close to what the SMs can issue, so the 4-bit path is counted carefully:
//  - "fast" (default): codes are spread to bytes q<<3 (one shift + one AND per 4 codes), then one PRMT
//    per code makes the float 0x3F(q<<3)0000 = 0.5 + q/32 exactly, and one FFMA accumulates
//    A = sum (0.5 + q/32) x. Then sum q x = 32 A - 16 X: ~2.9 instructions per weight in SASS with the
//    per-chunk overhead. The cancellation costs a few bits of the f32 sum (still ~1e-7 relative), far
//    below the bf16 scales' own precision.
//  - "exact" (register kernel only): PRMT builds 2^23 + q, an FADD removes 2^23, an FFMA accumulates q x.
// Measured on the H200 (docs/PERF.md) both decodes, in both kernels below, top out at ~16 weights per
// clock per SM (lm_head at ~56% of 4.3 TB/s), whether 4 or 8 KB per warp are in flight. That matches one
// PRMT per weight if PRMT issues at 16 lanes/clock/SM: the suspected limit, not yet confirmed with ncu's
// pipe utilisation. A PRMT-free decode (f16x2 magic-number LOP3, then conversion) is the next thing to try.
//
// Two kernels share chunk_dot():
//  - gemv() "register": each lane loads U chunks of NR consecutive rows (U*NR = 8 loads of 16 bytes; 4 for
//    SwiGLU) into registers, then computes; x comes from shared memory once per chunk for all NR rows.
//    Entry points (t = TPR lanes per row; the host picks the smallest TPR >= chunks per row, capped at 32):
//      affine_gemv_{q4,q4x,q8}_*, dense_gemv_bf16_*:  _t4_u1r8 _t8_u1r8 _t16_u1r8 _t32_u1r8 _t32_u2r4
//      _t32_u4r2 _t32_u8r1;  affine_swiglu_{q4,q8}_*, dense_swiglu_bf16_*: the same with U*NR = 4.
//  - gemv_async() "pipelined": the same split, but weights and scale/bias words stream through a 4-stage
//    cp.async ring in shared memory (see below). Entry points affine_gemv_async_{q4,q8}_*,
//    dense_gemv_async_bf16_*, affine_swiglu_async_{q4,q8}_*, dense_swiglu_async_bf16_*, each
//    _t4_u1r4 _t8_u1r4 _t16_u1r4 _t32_u1r4 _t32_u2r2 _t32_u4r1.
// The SwiGLU kernels compute y = silu(W_gate x) * (W_up x) for two matrices of one shape (MoE gate+up,
// shared expert).
// Programmatic dependent launch (pdl.cuh): the first weight loads are issued before the wait, x is
// read after it (the MoE forms wait before reading the router's indices).
// Every kernel takes one GemvParams. blockIdx.y is the "slot": with idx, slot k uses matrix idx[k] of the
// stack (MoE decode, no host round trip) and writes y[k*rows ...]; x is shared (x_stride 0) or per slot.
// An index >= count writes NaN (a routing bug must not look like a plausible number).
// Grid: (min(ceil(rows / rows_per_block), resident blocks / slots), slots); blocks stride over rows, so the
// x copy is paid once per block. Dynamic shared memory: cols*4 + chunks*4 bytes (+ the ring for async).

#include <stdint.h>
#include "pdl.cuh"
#include "route.cuh"
#include "gemv.cuh"
#include "async_copy.cuh"

// The router entries select among up to 32 * ROUTE_NPER experts.
constexpr int ROUTE_NPER = 16;

// 0.5 + q/32 from byte j of a word whose bytes are q << 3: the float 0x3F(q<<3)0000 has exponent 126
// and mantissa q/16.
__device__ __forceinline__ float q4f(uint32_t v, int j) {
    return __uint_as_float(__byte_perm(v, 0x3F000000u, 0x7044u | (j << 8)));
}
// q from byte j (a value 0..255): 2^23 + q, minus 2^23.
__device__ __forceinline__ float qexact(uint32_t v, int j) {
    return __uint_as_float(__byte_perm(v, 0x4B000000u, 0x7440u | j)) - 8388608.0f;
}

enum { MODE_Q4 = 0, MODE_Q4X = 1, MODE_Q8 = 2, MODE_BF16 = 3 };

template <int MODE> struct Fmt;
template <> struct Fmt<MODE_Q4> { static constexpr int E = 32; };
template <> struct Fmt<MODE_Q4X> { static constexpr int E = 32; };
template <> struct Fmt<MODE_Q8> { static constexpr int E = 16; };
template <> struct Fmt<MODE_BF16> { static constexpr int E = 8; };

// The contribution of one chunk: sum over its E weights of w * x. xr holds the chunk's x (F float4s),
// xsum its sum.
template <int MODE>
__device__ __forceinline__ float chunk_dot(uint4 w, float s, float b, const float4 (&xr)[Fmt<MODE>::E / 4], float xsum) {
    const uint32_t ws[4] = {w.x, w.y, w.z, w.w};
    float a[4];
    if (MODE == MODE_Q4 || MODE == MODE_Q4X) {
#pragma unroll
        for (int k = 0; k < 4; ++k) {  // word k: weights 8k..8k+7, x float4s 2k and 2k+1
            const float4 xa = xr[2 * k];
            const float4 xb = xr[2 * k + 1];
            float e0, e1, e2, e3, o0, o1, o2, o3;  // even codes 0,2,4,6 and odd codes 1,3,5,7 of the word
            if (MODE == MODE_Q4) {
                const uint32_t ev = (ws[k] << 3) & 0x78787878u;
                const uint32_t od = (ws[k] >> 1) & 0x78787878u;
                e0 = q4f(ev, 0); e1 = q4f(ev, 1); e2 = q4f(ev, 2); e3 = q4f(ev, 3);
                o0 = q4f(od, 0); o1 = q4f(od, 1); o2 = q4f(od, 2); o3 = q4f(od, 3);
            } else {
                const uint32_t lo = ws[k] & 0x0F0F0F0Fu;
                const uint32_t hi = (ws[k] >> 4) & 0x0F0F0F0Fu;
                e0 = qexact(lo, 0); e1 = qexact(lo, 1); e2 = qexact(lo, 2); e3 = qexact(lo, 3);
                o0 = qexact(hi, 0); o1 = qexact(hi, 1); o2 = qexact(hi, 2); o3 = qexact(hi, 3);
            }
            float t = e0 * xa.x;
            t = fmaf(o0, xa.y, t);
            t = fmaf(e1, xa.z, t);
            t = fmaf(o1, xa.w, t);
            t = fmaf(e2, xb.x, t);
            t = fmaf(o2, xb.y, t);
            t = fmaf(e3, xb.z, t);
            t = fmaf(o3, xb.w, t);
            a[k] = t;
        }
        const float A = (a[0] + a[1]) + (a[2] + a[3]);
        if (MODE == MODE_Q4) {
            // A = X/2 + (sum q x)/32  =>  s * sum q x + b * X = 32 s A + (b - 16 s) X
            return fmaf(32.0f * s, A, fmaf(-16.0f, s, b) * xsum);
        } else {
            return fmaf(s, A, b * xsum);
        }
    } else if (MODE == MODE_Q8) {
#pragma unroll
        for (int k = 0; k < 4; ++k) {  // word k: weights 4k..4k+3 = x float4 k
            const float4 xa = xr[k];
            float t = qexact(ws[k], 0) * xa.x;
            t = fmaf(qexact(ws[k], 1), xa.y, t);
            t = fmaf(qexact(ws[k], 2), xa.z, t);
            t = fmaf(qexact(ws[k], 3), xa.w, t);
            a[k] = t;
        }
        const float A = (a[0] + a[1]) + (a[2] + a[3]);
        return fmaf(s, A, b * xsum);
    } else {  // bf16: word k holds weights 2k (low half) and 2k+1
#pragma unroll
        for (int k = 0; k < 2; ++k) {
            const float4 xa = xr[k];
            const uint32_t u = ws[2 * k], v = ws[2 * k + 1];
            float t = __uint_as_float(u << 16) * xa.x;
            t = fmaf(__uint_as_float(u & 0xFFFF0000u), xa.y, t);
            t = fmaf(__uint_as_float(v << 16), xa.z, t);
            t = fmaf(__uint_as_float(v & 0xFFFF0000u), xa.w, t);
            a[k] = t;
        }
        return a[0] + a[1];
    }
}

constexpr int STAGE_V4 = 4;  // x float4s each thread loads at once in stage_x

// Activations (x, the router's indices and weights) are read from L2 (ld.global.cg), never through
// the non-coherent path (__ldg, ld.global.nc), which promises data that is read-only for the whole
// kernel: under programmatic dependent launch the kernel starts before its inputs are written.
// Measured: with __ldg the fused decode read the previous layer's expert indices under PDL (ppl 12.31
// for 11.19 on tiny-a) and matched the CPU without PDL, or with the indexed GEMVs launched without it.
// (Whether a stale non-coherent cache line or a load scheduled ahead of the wait did it is not
// settled: no SASS disassembler on the build machine.)
// x -> shared memory, transposed: element j = chunk c, offset e lands in float4 (e/4)*nch + c, so lanes
// reading consecutive chunks read consecutive 16-byte words; then (affine) the per-chunk sums of x.
// With p.norm_w the staged values are x * norm_w and the function returns 1 / rms(x), which the caller
// applies to its dot products (RMSNorm(x) . w = inv * ((x * norm_w) . w)); otherwise it returns 1.
// Ends with the block synchronised.
template <int MODE>
__device__ __forceinline__ float stage_x(const GemvParams& p, const float* x, float* xs, int cols, int nch) {
    constexpr int E = Fmt<MODE>::E;
    constexpr int F = E / 4;
    constexpr bool AFFINE = MODE != MODE_BF16;
    __shared__ float ss_part[32];
    const float4* xs4 = reinterpret_cast<const float4*>(xs);
    float* csum = xs + cols;
    const bool norm = p.norm_w != nullptr;
    float ss = 0.0f;
    const bool v4 = ((reinterpret_cast<uintptr_t>(x) | reinterpret_cast<uintptr_t>(p.norm_w)) & 15) == 0 && (cols & 3) == 0;
    if (v4) {
        // 16-byte loads, STAGE_V4 per thread issued before any is used (the staging is a chain of L2
        // latencies otherwise); four consecutive elements share a chunk, so they land as one float4.
        const float4* x4 = reinterpret_cast<const float4*>(x);
        const float4* w4 = reinterpret_cast<const float4*>(p.norm_w);
        float4* xw = reinterpret_cast<float4*>(xs);
        const int n4 = cols >> 2;
        for (int j0 = threadIdx.x; j0 < n4; j0 += STAGE_V4 * blockDim.x) {
            float4 v[STAGE_V4], g[STAGE_V4];
#pragma unroll
            for (int u = 0; u < STAGE_V4; ++u) {
                const int j = j0 + u * blockDim.x;
                if (j < n4) {
                    v[u] = __ldcg(x4 + j);
                    if (norm) g[u] = __ldg(w4 + j);
                }
            }
#pragma unroll
            for (int u = 0; u < STAGE_V4; ++u) {
                const int j = j0 + u * blockDim.x;
                if (j < n4) {
                    float4 a = v[u];
                    if (norm) {
                        ss = fmaf(a.x, a.x, ss);
                        ss = fmaf(a.y, a.y, ss);
                        ss = fmaf(a.z, a.z, ss);
                        ss = fmaf(a.w, a.w, ss);
                        a = make_float4(a.x * g[u].x, a.y * g[u].y, a.z * g[u].z, a.w * g[u].w);
                    }
                    const int c = (4 * j) / E, e = (4 * j) % E;
                    xw[(e >> 2) * nch + c] = a;
                }
            }
        }
    } else {
        for (int j = threadIdx.x; j < cols; j += blockDim.x) {
            const int c = j / E, e = j % E;
            float v = __ldcg(x + j);
            if (norm) {
                ss = fmaf(v, v, ss);
                v *= __ldg(p.norm_w + j);
            }
            xs[((e >> 2) * nch + c) * 4 + (e & 3)] = v;
        }
    }
    if (norm) {
#pragma unroll
        for (int o = 16; o > 0; o >>= 1) ss += __shfl_xor_sync(0xffffffffu, ss, o);
        if ((threadIdx.x & 31) == 0) ss_part[threadIdx.x >> 5] = ss;
    }
    __syncthreads();
    if (AFFINE) {
        for (int c = threadIdx.x; c < nch; c += blockDim.x) {
            float sum = 0.0f;
#pragma unroll
            for (int i = 0; i < F; ++i) {
                const float4 v = xs4[i * nch + c];
                sum += (v.x + v.y) + (v.z + v.w);
            }
            csum[c] = sum;
        }
        __syncthreads();
    }
    if (!norm) return 1.0f;
    float t = 0.0f;
    for (int w = 0; w < (int)(blockDim.x >> 5); ++w) t += ss_part[w];
    return 1.0f / sqrtf(t / (float)cols + p.norm_eps);
}

// One batch of loads: U chunks (c0, c0+TPR, ...) of NR consecutive rows, of NW matrices (2 for SwiGLU).
template <int MODE, int TPR, int U, int NR, int NW>
struct Batch {
    uint4 w[NW][NR][U];
    float s[NW][NR][U], b[NW][NR][U];

    __device__ __forceinline__ void load(const GemvParams& p, long long mrow, int rb, int rows, int nch, int groups, int c0) {
        constexpr int E = Fmt<MODE>::E;
        constexpr bool AFFINE = MODE != MODE_BF16;
#pragma unroll
        for (int rr = 0; rr < NR; ++rr) {
            const bool rv = rb + rr < rows;
            const long long row = mrow + rb + rr;
#pragma unroll
            for (int u = 0; u < U; ++u) {
                const int c = c0 + u * TPR;
                const bool ok = rv && c < nch;
                const int g = (c * E) >> p.group_shift;
#pragma unroll
                for (int m = 0; m < NW; ++m) {
                    const uint4* wp = m == 0 ? p.w : p.w2;
                    w[m][rr][u] = ok ? ld_stream(wp + row * nch + c) : make_uint4(0, 0, 0, 0);
                    if (AFFINE) {
                        const uint16_t* sp = m == 0 ? p.scales : p.scales2;
                        const uint16_t* bp = m == 0 ? p.biases : p.biases2;
                        s[m][rr][u] = ok ? bf16_to_f32(__ldg(sp + row * groups + g)) : 0.0f;
                        b[m][rr][u] = ok ? bf16_to_f32(__ldg(bp + row * groups + g)) : 0.0f;
                    } else {
                        s[m][rr][u] = b[m][rr][u] = 0.0f;
                    }
                }
            }
        }
    }

    // acc[m][rr] += the batch's chunks of row rr of matrix m. x comes from shared memory once per
    // chunk and serves all NR rows.
    __device__ __forceinline__ void compute(const float4* xs4, const float* csum, int nch, int c0, float (&acc)[NW][NR]) const {
        constexpr int F = Fmt<MODE>::E / 4;
        constexpr bool AFFINE = MODE != MODE_BF16;
#pragma unroll
        for (int u = 0; u < U; ++u) {
            const int c = c0 + u * TPR;
            if (c < nch) {
                float4 xr[F];
#pragma unroll
                for (int i = 0; i < F; ++i) xr[i] = xs4[i * nch + c];
                const float xsum = AFFINE ? csum[c] : 0.0f;
#pragma unroll
                for (int rr = 0; rr < NR; ++rr)
#pragma unroll
                    for (int m = 0; m < NW; ++m) acc[m][rr] += chunk_dot<MODE>(w[m][rr][u], s[m][rr][u], b[m][rr][u], xr, xsum);
            }
        }
    }
};

// TPR lanes per row; each lane keeps U chunks of NR consecutive rows (U*NR 16-byte loads) in flight.
// A warp covers 32/TPR row groups of NR rows; a block of 8 warps covers 8*(32/TPR)*NR rows per step.
template <int MODE, int TPR, int U, int NR, bool SWIGLU, bool ROUTE = false>
__device__ __forceinline__ void gemv(const GemvParams& p) {
    constexpr int E = Fmt<MODE>::E;  // weights per 16-byte chunk
    constexpr int F = E / 4;         // x float4s per chunk
    constexpr int RPW = 32 / TPR;    // row groups per warp
    constexpr int NW = SWIGLU ? 2 : 1;
    constexpr bool AFFINE = MODE != MODE_BF16;
    extern __shared__ float4 xs4[];
    float* xs = reinterpret_cast<float*>(xs4);
    const int rows = p.rows, cols = p.cols;
    const int nch = cols / E;
    const float* csum = xs + cols;

    const int slot = blockIdx.y;
    if (p.idx) pdl_wait();  // the indices come from the router, a predecessor
    const uint32_t m = p.idx ? __ldcg(p.idx + slot) : (uint32_t)p.matrix;  // L2: see stage_x
    const bool bad = m >= (uint32_t)p.count;
    const float* x = p.x + (long long)slot * p.x_stride;

    const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
    const int tl = lane % TPR, sub = lane / TPR;
    const int rows_per_block = (blockDim.x >> 5) * RPW * NR;
    const int my_rows = (warp * RPW + sub) * NR;  // this row group's offset inside the block's tile
    const int groups = AFFINE ? (cols >> p.group_shift) : 0;
    const long long mrow = (long long)m * rows;
    const int live_rows = bad ? 0 : rows;  // a bad index loads nothing
    float* y = p.y + (long long)slot * rows;

    // Issue the first batch of weight loads before staging x, so the two latencies overlap.
    Batch<MODE, TPR, U, NR, NW> bt;
    int r0 = blockIdx.x * rows_per_block;
    bt.load(p, mrow, r0 + my_rows, live_rows, nch, groups, tl);
    // Weights never change: their first loads may overlap the predecessor's tail; x may not.
    pdl_enter();

    const float inv = stage_x<MODE>(p, x, xs, cols, nch);

    bool prefetched = true;
    for (; r0 < rows; r0 += gridDim.x * rows_per_block) {
        const int rb = r0 + my_rows;
        float acc[NW][NR];
#pragma unroll
        for (int k = 0; k < NW; ++k)
#pragma unroll
            for (int rr = 0; rr < NR; ++rr) acc[k][rr] = 0.0f;
        for (int c0 = tl; c0 < nch || c0 == tl; c0 += U * TPR) {
            if (!prefetched) bt.load(p, mrow, rb, live_rows, nch, groups, c0);
            prefetched = false;
            bt.compute(xs4, csum, nch, c0, acc);
        }
#pragma unroll
        for (int rr = 0; rr < NR; ++rr) {
#pragma unroll
            for (int o = TPR / 2; o > 0; o >>= 1) {
                acc[0][rr] += __shfl_xor_sync(0xffffffffu, acc[0][rr], o);
                if (SWIGLU) acc[NW - 1][rr] += __shfl_xor_sync(0xffffffffu, acc[NW - 1][rr], o);
            }
        }
#pragma unroll
        for (int rr = 0; rr < NR; ++rr) {
            const int r = rb + rr;
            if (rr % TPR == tl && r < rows) put_row<SWIGLU>(p, y, r, acc[0][rr], acc[NW - 1][rr], inv, bad);
        }
    }
    if constexpr (ROUTE) {
        // The router: the last block to finish selects the experts from the logits every block wrote.
        __shared__ __align__(16) float route_s[32 * ROUTE_NPER];
        __shared__ int last;
        __threadfence();
        __syncthreads();
        if (threadIdx.x == 0) last = atomicAdd(p.counter, 1u) == gridDim.x * gridDim.y - 1;
        __syncthreads();
        if (last) {
            __threadfence();
            if (warp == 0) route_row<ROUTE_NPER>(p.y, p.route_e, p.route_k, p.route_renorm, route_s, p.route_idx, p.route_w);
            if (threadIdx.x == 0) *p.counter = 0u;
        }
    }
}

// ---------------------------------------------------------------------------------------------------
// The pipelined ("async") GEMV: the same work split as gemv() above, but each lane streams its weight
// chunks (16-byte cp.async) and scale/bias words (4-byte cp.async) into its own slots of a shared-memory
// ring S stages deep, so S-1 steps of loads are in flight while the warp computes on the oldest one.
// In the register version a warp either waits for its loads or computes; here both overlap, and the
// bytes in flight (up to ~96 KB per SM) do not cost registers. One block per SM (the ring is ~192 KB).
// A lane only ever reads the slots it filled itself, so no barrier is needed beyond the per-thread
// cp.async.wait_group. Out-of-range rows/chunks are zero-filled (src-size 0), contributing nothing.
// Scales/biases: the 4-byte word holding the wanted bf16 is copied (its index rounded down to even);
// weights::Uploader pads those arrays so the word never passes the allocation's end.

// Bytes of one lane-stage entry in the ring: a 16-byte weight chunk plus two 4-byte scale/bias words,
// stored as [entry][lane] planes so a warp's 32 lanes touch consecutive words (no bank conflicts).
constexpr int RING_ENTRY_BYTES = 32 * (16 + 8);

template <int MODE, int TPR, int U, int NR, bool SWIGLU, int WARPS, int S>
__device__ __forceinline__ void gemv_async(const GemvParams& p) {
    constexpr int E = Fmt<MODE>::E;
    constexpr int F = E / 4;
    constexpr int RPW = 32 / TPR;
    constexpr int NW = SWIGLU ? 2 : 1;
    constexpr int NE = NW * NR * U;  // entries per lane per stage
    constexpr bool AFFINE = MODE != MODE_BF16;
    extern __shared__ float4 xs4[];
    float* xs = reinterpret_cast<float*>(xs4);
    const int rows = p.rows, cols = p.cols;
    const int nch = cols / E;
    float* csum = xs + cols;
    const int x_bytes = ((cols + nch) * 4 + 15) & ~15;

    const int slot = blockIdx.y;
    if (p.idx) pdl_wait();  // the indices come from the router, a predecessor
    const uint32_t m = p.idx ? __ldcg(p.idx + slot) : (uint32_t)p.matrix;  // L2: see stage_x
    const bool bad = m >= (uint32_t)p.count;
    const float* x = p.x + (long long)slot * p.x_stride;

    const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
    const int tl = lane % TPR, sub = lane / TPR;
    const int rows_per_block = WARPS * RPW * NR;
    const int my_rows = (warp * RPW + sub) * NR;
    const int groups = AFFINE ? (cols >> p.group_shift) : 0;
    const long long mrow = (long long)m * rows;
    const int live_rows = bad ? 0 : rows;
    float* y = p.y + (long long)slot * rows;

    // This warp's ring: S stages of NE entries; each entry a plane of 32 x 16-byte chunks followed by
    // a plane of 32 x (scale word, bias word).
    const uint32_t ring = (uint32_t)__cvta_generic_to_shared(xs4) + x_bytes + warp * S * NE * RING_ENTRY_BYTES;

    const int stride = gridDim.x * rows_per_block;
    const int nk = blockIdx.x * rows_per_block < rows ? (rows - blockIdx.x * rows_per_block + stride - 1) / stride : 0;
    const int nb = (nch + U * TPR - 1) / (U * TPR);  // chunk batches per row group
    const int nsteps = nk * nb;

    auto issue = [&](int j) {
        const int k = j / nb, b = j - k * nb;
        const int rb = blockIdx.x * rows_per_block + k * stride + my_rows;
        const int c0 = tl + b * U * TPR;
        const uint32_t st = ring + (j % S) * NE * RING_ENTRY_BYTES;
#pragma unroll
        for (int mm = 0; mm < NW; ++mm)
#pragma unroll
            for (int rr = 0; rr < NR; ++rr)
#pragma unroll
                for (int u = 0; u < U; ++u) {
                    const int e = (mm * NR + rr) * U + u;
                    const int c = c0 + u * TPR;
                    const int r = rb + rr;
                    const bool ok = r < live_rows && c < nch;
                    const long long row = mrow + r;
                    const uint4* wp = mm == 0 ? p.w : p.w2;
                    const uint32_t ent = st + e * RING_ENTRY_BYTES;
                    cp_async16(ent + lane * 16, ok ? (const void*)(wp + row * nch + c) : (const void*)wp, ok);
                    if (AFFINE) {
                        const uint16_t* sp = mm == 0 ? p.scales : p.scales2;
                        const uint16_t* bp = mm == 0 ? p.biases : p.biases2;
                        const long long gi = (row * groups + ((c * E) >> p.group_shift)) & ~1ll;
                        cp_async4(ent + 512 + lane * 8, ok ? (const void*)(sp + gi) : (const void*)sp, ok);
                        cp_async4(ent + 512 + lane * 8 + 4, ok ? (const void*)(bp + gi) : (const void*)bp, ok);
                    }
                }
    };

    // Prologue: S-1 steps in flight before x is even staged (weights never change: they may overlap
    // the predecessor's tail; x may not).
#pragma unroll
    for (int j = 0; j < S - 1; ++j) {
        if (j < nsteps) issue(j);
        cp_async_commit_group();
    }
    pdl_enter();

    const float inv = stage_x<MODE>(p, x, xs, cols, nch);

    float acc[NW][NR];
    for (int j = 0; j < nsteps; ++j) {
        cp_async_wait_group<S - 2>();  // this thread's copies of step j have landed
        if (j + S - 1 < nsteps) issue(j + S - 1);  // refills the slot consumed in step j-1
        cp_async_commit_group();

        const int k = j / nb, b = j - k * nb;
        const int rb = blockIdx.x * rows_per_block + k * stride + my_rows;
        const int c0 = tl + b * U * TPR;
        if (b == 0) {
#pragma unroll
            for (int mm = 0; mm < NW; ++mm)
#pragma unroll
                for (int rr = 0; rr < NR; ++rr) acc[mm][rr] = 0.0f;
        }
        const uint32_t st = ring + (j % S) * NE * RING_ENTRY_BYTES;
#pragma unroll
        for (int u = 0; u < U; ++u) {
            const int c = c0 + u * TPR;
            if (c < nch) {
                float4 xr[F];
#pragma unroll
                for (int i = 0; i < F; ++i) xr[i] = xs4[i * nch + c];
                const float xsum = AFFINE ? csum[c] : 0.0f;
#pragma unroll
                for (int rr = 0; rr < NR; ++rr) {
                    // Which half of the copied word is ours: the parity of the group index.
                    const bool hi = AFFINE && (((mrow + rb + rr) * groups + ((c * E) >> p.group_shift)) & 1);
#pragma unroll
                    for (int mm = 0; mm < NW; ++mm) {
                        const int e = (mm * NR + rr) * U + u;
                        const uint32_t ent = st + e * RING_ENTRY_BYTES;
                        uint4 w;
                        asm volatile("ld.shared.v4.u32 {%0, %1, %2, %3}, [%4];"
                                     : "=r"(w.x), "=r"(w.y), "=r"(w.z), "=r"(w.w)
                                     : "r"(ent + lane * 16)
                                     : "memory");
                        float sc = 0.0f, bi = 0.0f;
                        if (AFFINE) {
                            uint32_t sw, bw;
                            asm volatile("ld.shared.v2.u32 {%0, %1}, [%2];" : "=r"(sw), "=r"(bw) : "r"(ent + 512 + lane * 8) : "memory");
                            sc = __uint_as_float(hi ? (sw & 0xFFFF0000u) : (sw << 16));
                            bi = __uint_as_float(hi ? (bw & 0xFFFF0000u) : (bw << 16));
                        }
                        acc[mm][rr] += chunk_dot<MODE>(w, sc, bi, xr, xsum);
                    }
                }
            }
        }
        if (b == nb - 1) {
#pragma unroll
            for (int rr = 0; rr < NR; ++rr) {
#pragma unroll
                for (int o = TPR / 2; o > 0; o >>= 1) {
                    acc[0][rr] += __shfl_xor_sync(0xffffffffu, acc[0][rr], o);
                    if (SWIGLU) acc[NW - 1][rr] += __shfl_xor_sync(0xffffffffu, acc[NW - 1][rr], o);
                }
            }
#pragma unroll
            for (int rr = 0; rr < NR; ++rr) {
                const int r = rb + rr;
                if (rr % TPR == tl && r < rows) put_row<SWIGLU>(p, y, r, acc[0][rr], acc[NW - 1][rr], inv, bad);
            }
        }
    }
    cp_async_wait_group<0>();
}

// ---------------------------------------------------------------------------------------------------
// The MoE down projection with the combine fused ("mix"): for one token, over ns = mix_k (+1 with
// mix_shared) slots, slot k using matrix idx[k] of the stack and its own input x[k*cols ..],
//   y[r] (+)= sum_k c_k * (W[idx[k]] x_k)[r],   c_k = mix_w[k] (k < mix_k), sigmoid(*gate_logit) (k = mix_k),
// summed in slot order with f32 FMAs (deterministic; the unfused combine adds in ascending expert id
// without FMAs, so the two differ by rounding only). With accumulate, y is the residual stream.
// Each lane loads its chunk of one row for every slot before computing (ns loads in flight); every
// slot's x is staged in shared memory (ns * stride floats, stride = cols + nch rounded up to 4).
// Rows (of at most TPR chunks per batch) as in gemv(); NR = 1. A bad index makes its rows NaN.
template <int MODE, int TPR, int MAXS>
__device__ __forceinline__ void gemv_mix(const GemvParams& p) {
    constexpr int E = Fmt<MODE>::E;
    constexpr int F = E / 4;
    constexpr int RPW = 32 / TPR;
    constexpr bool AFFINE = MODE != MODE_BF16;
    extern __shared__ float4 xs4[];
    float* xs = reinterpret_cast<float*>(xs4);
    __shared__ uint32_t mats[MAXS];
    __shared__ float coef[MAXS];
    const int rows = p.rows, cols = p.cols;
    const int nch = cols / E;
    const int ns = p.mix_k + (p.mix_shared ? 1 : 0);
    const int stride = (cols + nch + 3) & ~3;

    pdl_wait();  // the indices and weights come from the router, the inputs from the gate/up GEMV
    pdl_launch_dependents();
    if (threadIdx.x < ns) {
        const int k = threadIdx.x;
        mats[k] = __ldcg(p.idx + k);  // L2, not L1: see stage_x
        coef[k] = k < p.mix_k ? __ldcg(p.mix_w + k) : 1.0f / (1.0f + expf(-__ldcg(p.gate_logit)));
    }
    __syncthreads();

    const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
    const int tl = lane % TPR, sub = lane / TPR;
    const int rows_per_block = (blockDim.x >> 5) * RPW;
    const int groups = AFFINE ? (cols >> p.group_shift) : 0;
    bool bad = false;
    for (int k = 0; k < ns; ++k) bad |= mats[k] >= (uint32_t)p.count;

    int r0 = blockIdx.x * rows_per_block;
    Batch<MODE, TPR, 1, 1, 1> bt[MAXS];
    auto load_all = [&](int rb, int c0) {
#pragma unroll
        for (int k = 0; k < MAXS; ++k) {
            if (k < ns) {
                const uint32_t m = mats[k];
                const bool ok = m < (uint32_t)p.count;
                bt[k].load(p, (long long)(ok ? m : 0) * rows, rb, ok ? rows : 0, nch, groups, c0);
            }
        }
    };
    load_all(r0 + warp * RPW + sub, tl);

    // Every slot's x (staged plain: no norm here), then the chunk sums.
    if ((reinterpret_cast<uintptr_t>(p.x) & 15) == 0 && (cols & 3) == 0) {
        const int n4 = cols >> 2;
        const float4* x4 = reinterpret_cast<const float4*>(p.x);
        for (int j0 = threadIdx.x; j0 < ns * n4; j0 += STAGE_V4 * blockDim.x) {
            float4 v[STAGE_V4];
#pragma unroll
            for (int u = 0; u < STAGE_V4; ++u) {
                const int j = j0 + u * blockDim.x;
                if (j < ns * n4) v[u] = __ldcg(x4 + j);  // x_stride == cols: slot k's x follows slot k-1's
            }
#pragma unroll
            for (int u = 0; u < STAGE_V4; ++u) {
                const int j = j0 + u * blockDim.x;
                if (j < ns * n4) {
                    const int k = j / n4, jj = 4 * (j - k * n4);
                    const int c = jj / E, e = jj % E;
                    reinterpret_cast<float4*>(xs + k * stride)[(e >> 2) * nch + c] = v[u];
                }
            }
        }
    } else {
        for (int j = threadIdx.x; j < ns * cols; j += blockDim.x) {
            const int k = j / cols, jj = j - k * cols;
            const int c = jj / E, e = jj % E;
            xs[k * stride + ((e >> 2) * nch + c) * 4 + (e & 3)] = __ldcg(p.x + (long long)k * p.x_stride + jj);
        }
    }
    __syncthreads();
    if (AFFINE) {
        for (int j = threadIdx.x; j < ns * nch; j += blockDim.x) {
            const int k = j / nch, c = j - k * nch;
            const float4* x4 = reinterpret_cast<const float4*>(xs + k * stride);
            float sum = 0.0f;
#pragma unroll
            for (int i = 0; i < F; ++i) {
                const float4 v = x4[i * nch + c];
                sum += (v.x + v.y) + (v.z + v.w);
            }
            xs[k * stride + cols + c] = sum;
        }
        __syncthreads();
    }

    bool prefetched = true;
    for (; r0 < rows; r0 += gridDim.x * rows_per_block) {
        const int r = r0 + warp * RPW + sub;
        float acc[MAXS][1][1];
#pragma unroll
        for (int k = 0; k < MAXS; ++k) acc[k][0][0] = 0.0f;
        for (int c0 = tl; c0 < nch || c0 == tl; c0 += TPR) {
            if (!prefetched) load_all(r, c0);
            prefetched = false;
#pragma unroll
            for (int k = 0; k < MAXS; ++k) {
                if (k < ns) {
                    const float4* x4 = reinterpret_cast<const float4*>(xs + k * stride);
                    bt[k].compute(x4, xs + k * stride + cols, nch, c0, acc[k]);
                }
            }
        }
        float out = 0.0f;
#pragma unroll
        for (int k = 0; k < MAXS; ++k) {
            if (k < ns) {
                float a = acc[k][0][0];
#pragma unroll
                for (int o = TPR / 2; o > 0; o >>= 1) a += __shfl_xor_sync(0xffffffffu, a, o);
                out = fmaf(coef[k], a, out);
            }
        }
        if (tl == 0 && r < rows) {
            if (p.accumulate) out = __ldcg(p.y + r) + out;  // from L2: see put_row
            p.y[r] = bad ? __int_as_float(0x7fc00000) : out;
        }
    }
}

#define GEMV_ASYNC_ENTRY(name, MODE, TPR, U, NR, SW, WARPS, S)                                  \
    extern "C" __global__ void __launch_bounds__(WARPS * 32, 1) name(const GemvParams p) { \
        gemv_async<MODE, TPR, U, NR, SW, WARPS, S>(p);                                        \
    }

// Plain: 16 warps, 4 stages of U*NR = 4 entries (~192 KB of ring). SwiGLU: 8 warps, 4 stages of 2x4.
#define GEMV_ASYNC_FAMILY(prefix, MODE, SW, WARPS)                         \
    GEMV_ASYNC_ENTRY(prefix##_t4_u1r4, MODE, 4, 1, 4, SW, WARPS, 4)         \
    GEMV_ASYNC_ENTRY(prefix##_t8_u1r4, MODE, 8, 1, 4, SW, WARPS, 4)         \
    GEMV_ASYNC_ENTRY(prefix##_t16_u1r4, MODE, 16, 1, 4, SW, WARPS, 4)       \
    GEMV_ASYNC_ENTRY(prefix##_t32_u1r4, MODE, 32, 1, 4, SW, WARPS, 4)       \
    GEMV_ASYNC_ENTRY(prefix##_t32_u2r2, MODE, 32, 2, 2, SW, WARPS, 4)       \
    GEMV_ASYNC_ENTRY(prefix##_t32_u4r1, MODE, 32, 4, 1, SW, WARPS, 4)

GEMV_ASYNC_FAMILY(affine_gemv_async_q4, MODE_Q4, false, 16)
GEMV_ASYNC_FAMILY(affine_gemv_async_q8, MODE_Q8, false, 16)
GEMV_ASYNC_FAMILY(dense_gemv_async_bf16, MODE_BF16, false, 16)
GEMV_ASYNC_FAMILY(affine_swiglu_async_q4, MODE_Q4, true, 8)
GEMV_ASYNC_FAMILY(affine_swiglu_async_q8, MODE_Q8, true, 8)
GEMV_ASYNC_FAMILY(dense_swiglu_async_bf16, MODE_BF16, true, 8)

#define GEMV_ENTRY(name, MODE, TPR, U, NR, SW)                                     \
    extern "C" __global__ void __launch_bounds__(256) name(const GemvParams p) { \
        gemv<MODE, TPR, U, NR, SW>(p);                                             \
    }

// Plain GEMV: U*NR = 8 loads in flight per lane. TPR < 32 only serves rows of at most TPR chunks.
#define GEMV_FAMILY(prefix, MODE)                       \
    GEMV_ENTRY(prefix##_t4_u1r8, MODE, 4, 1, 8, false)   \
    GEMV_ENTRY(prefix##_t8_u1r8, MODE, 8, 1, 8, false)   \
    GEMV_ENTRY(prefix##_t16_u1r8, MODE, 16, 1, 8, false) \
    GEMV_ENTRY(prefix##_t32_u1r8, MODE, 32, 1, 8, false) \
    GEMV_ENTRY(prefix##_t32_u2r4, MODE, 32, 2, 4, false) \
    GEMV_ENTRY(prefix##_t32_u4r2, MODE, 32, 4, 2, false) \
    GEMV_ENTRY(prefix##_t32_u8r1, MODE, 32, 8, 1, false)

// SwiGLU (two matrices): U*NR = 4.
#define SWIGLU_FAMILY(prefix, MODE)                    \
    GEMV_ENTRY(prefix##_t4_u1r4, MODE, 4, 1, 4, true)   \
    GEMV_ENTRY(prefix##_t8_u1r4, MODE, 8, 1, 4, true)   \
    GEMV_ENTRY(prefix##_t16_u1r4, MODE, 16, 1, 4, true) \
    GEMV_ENTRY(prefix##_t32_u1r4, MODE, 32, 1, 4, true) \
    GEMV_ENTRY(prefix##_t32_u2r2, MODE, 32, 2, 2, true) \
    GEMV_ENTRY(prefix##_t32_u4r1, MODE, 32, 4, 1, true)

GEMV_FAMILY(affine_gemv_q4, MODE_Q4)
GEMV_FAMILY(affine_gemv_q4x, MODE_Q4X)
GEMV_FAMILY(affine_gemv_q8, MODE_Q8)
GEMV_FAMILY(dense_gemv_bf16, MODE_BF16)
SWIGLU_FAMILY(affine_swiglu_q4, MODE_Q4)
SWIGLU_FAMILY(affine_swiglu_q8, MODE_Q8)
SWIGLU_FAMILY(dense_swiglu_bf16, MODE_BF16)

// The router with its selection fused (register kernel, every variant): affine_gemv_route_{q4,q8}_*,
// dense_gemv_route_bf16_*.
#define ROUTE_ENTRY(name, MODE, TPR, U, NR)                                        \
    extern "C" __global__ void __launch_bounds__(256) name(const GemvParams p) { \
        gemv<MODE, TPR, U, NR, false, true>(p);                                    \
    }
#define ROUTE_FAMILY(prefix, MODE)                   \
    ROUTE_ENTRY(prefix##_t4_u1r8, MODE, 4, 1, 8)     \
    ROUTE_ENTRY(prefix##_t8_u1r8, MODE, 8, 1, 8)     \
    ROUTE_ENTRY(prefix##_t16_u1r8, MODE, 16, 1, 8)   \
    ROUTE_ENTRY(prefix##_t32_u1r8, MODE, 32, 1, 8)   \
    ROUTE_ENTRY(prefix##_t32_u2r4, MODE, 32, 2, 4)   \
    ROUTE_ENTRY(prefix##_t32_u4r2, MODE, 32, 4, 2)   \
    ROUTE_ENTRY(prefix##_t32_u8r1, MODE, 32, 8, 1)
ROUTE_FAMILY(affine_gemv_route_q4, MODE_Q4)
ROUTE_FAMILY(affine_gemv_route_q8, MODE_Q8)
ROUTE_FAMILY(dense_gemv_route_bf16, MODE_BF16)

// Down projection + combine, up to MIX_SLOTS slots: affine_mix_{q4,q8}_t{4,8,16,32}, dense_mix_bf16_t*.
constexpr int MIX_SLOTS = 16;
#define MIX_ENTRY(name, MODE, TPR)                                                 \
    extern "C" __global__ void __launch_bounds__(256) name(const GemvParams p) { \
        gemv_mix<MODE, TPR, MIX_SLOTS>(p);                                         \
    }
#define MIX_FAMILY(prefix, MODE)      \
    MIX_ENTRY(prefix##_t4, MODE, 4)   \
    MIX_ENTRY(prefix##_t8, MODE, 8)   \
    MIX_ENTRY(prefix##_t16, MODE, 16) \
    MIX_ENTRY(prefix##_t32, MODE, 32)
MIX_FAMILY(affine_mix_q4, MODE_Q4)
MIX_FAMILY(affine_mix_q8, MODE_Q8)
MIX_FAMILY(dense_mix_bf16, MODE_BF16)

// A chain of decode GEMVs as one persistent kernel: the study of an op boundary for the persistent
// decode step (issue #10), and its first building block.
//   y_i = W_i · (RMSNorm(x_i) · norm_w_i)        i = 0 .. n-1, each op naming its x and y (x_{i+1} may
//                                                be y_i: the chain's dependencies are exactly those)
// on 4-bit group-64 matrices, with the tensor-core product of gemv_tc.cuh (gemv_tc.cuh's maths and
// tolerance). One block an SM, all resident at once (the host checks). Op i's 16-row tiles are dealt
// round-robin (block b: tiles b, b + G, ...); op i waits only for every block to have finished op
// i - 1 (a counter per op, grid_sync.cuh), not for a kernel boundary.
// PREFETCH: each block copies op i + 1's tiles of weights, scales and biases and its norm weight into
// shared memory (the other of two buffers, cp.async) before it waits for op i's input, so they stream
// in while the chain's dependent work runs; without it the copies start after the wait, as in a
// separate kernel. I8: the integer form of the product (below).
// Per op and block: [copies of op i + 1] → wait for op i - 1's blocks → op i's copies landed → x_i
// (L2) staged with the norm → its tiles: warp w takes each tile's rounds w, w + 16, ...; one barrier;
// the 16 warps' partial rows summed in warp order (deterministic) → y_i written → arrive on op i's
// counter.
// Shapes: rows a multiple of 16, cols a multiple of 512 (a tile's scale rows in 16-byte copies).
// Measured (docs/PERF.md, 2026-12-06, H100; gpu_ops bench_gemv_chain): ~5–5.5 µs an op of 4.7 MB in
// every form, against 5.9 for the same ops as separate kernels in a PDL graph: the boundary (wake and
// arrival, ~1.5 µs) costs about what a kernel boundary does, and the op's own chain in one SM (x from
// L2 and its staging, the products) is most of the rest.
#include <stdint.h>
#include <cuda_bf16.h>
#include "gemv.cuh"
#include "gemv_tc.cuh"
#include "async_copy.cuh"
#include "grid_sync.cuh"

// One op; its Rust mirror is `ChainOp` in ops/gemv_chain.rs.
struct ChainOp {
    const uint4* w;           // matrix [rows, cols/32] 16-byte chunks
    const uint16_t* s;        // [rows, cols/64] bf16 bits
    const uint16_t* b;
    const float* norm_w;      // [cols]
    const float* x;           // [cols]
    float* y;                 // [rows]
    int rows;
    int cols;
};

struct ChainParams {
    const ChainOp* ops;       // [n] in global memory
    unsigned long long* counters;  // [n] finished blocks of each op (grid_sync.cuh)
    int n;
    float eps;
    int buf_bytes;            // one of the two tile buffers (dynamic shared memory: both, then the staged x)
    int sums_off;             // bytes from the start of shared memory to the staged x's group sums
    unsigned long long* trace;  // [n][grid][CH_TRACE] or null: each block's %globaltimer at its phases (benchmarks)
};

constexpr int CH_WARPS = 16;
constexpr int CH_TRACE = 6;    // stamps a block writes an op when tracing: copies issued, waited, copies landed, x staged, products written, arrived

__device__ __forceinline__ void ch_stamp(unsigned long long* trace, int op, int i) {
    if (trace != nullptr && threadIdx.x == 0) {
        unsigned long long t;
        asm volatile("mov.u64 %0, %%globaltimer;" : "=l"(t));
        trace[((long long)op * gridDim.x + blockIdx.x) * CH_TRACE + i] = t;
    }
}
constexpr int CH_WPAD = 64;    // bytes after each weight row (spreads a quarter-warp's rows over the banks)
constexpr int CH_SPAD = 16;    // the same after each scale and bias row
constexpr int CH_MAX_TILES = 8; // tiles of one op a block (the host checks)
constexpr int CH_MAX_GROUPS = 128; // groups of 64 in an op's x (cols <= 8192; the host checks)

// Bytes of one 16-row tile in shared memory: 16 weight rows, then 16 scale and 16 bias rows.
__device__ __forceinline__ int ch_row_bytes(int cols) { return (cols >> 1) + CH_WPAD; }
__device__ __forceinline__ int ch_srow_bytes(int cols) { return (cols >> 5) + CH_SPAD; }
__device__ __forceinline__ int ch_tile_bytes(int cols) { return 16 * ch_row_bytes(cols) + 32 * ch_srow_bytes(cols); }

// This block's tiles of op o into `dst`, then the op's norm weight (cols floats), 16 bytes a thread a
// copy (not committed). Returns nothing; the layout is ch_tile_bytes(cols) a tile, the norm after the
// block's tiles.
__device__ __forceinline__ void ch_copy_tiles(const ChainOp& o, unsigned char* dst) {
    const int tiles = o.rows >> 4, G = gridDim.x;
    const int nch = o.cols >> 5, grp = o.cols >> 6, gq = grp >> 3;  // 16-byte chunks of a row, of a scale row
    const int rs = ch_row_bytes(o.cols), ss = ch_srow_bytes(o.cols), tb = ch_tile_bytes(o.cols);
    int i = 0;
    for (int tile = blockIdx.x; tile < tiles; tile += G, ++i) {
        unsigned char* d = dst + i * tb;
        const long long row0 = (long long)tile * 16;
        const uint4* w = o.w + row0 * nch;
        for (int e = threadIdx.x; e < 16 * nch; e += blockDim.x) {
            const int r = e / nch, j = e - r * nch;
            cp_async16(smem_addr(d + r * rs + j * 16), w + (long long)r * nch + j, true);
        }
        const uint4* sc = reinterpret_cast<const uint4*>(o.s + row0 * grp);
        const uint4* bi = reinterpret_cast<const uint4*>(o.b + row0 * grp);
        for (int e = threadIdx.x; e < 32 * gq; e += blockDim.x) {
            const int which = e / (16 * gq), rem = e - which * 16 * gq;
            const int r = rem / gq, j = rem - r * gq;
            cp_async16(smem_addr(d + 16 * rs + which * 16 * ss + r * ss + j * 16), (which ? bi : sc) + (long long)r * gq + j, true);
        }
    }
    unsigned char* nd = dst + i * tb;
    for (int e = threadIdx.x; e < (o.cols >> 2); e += blockDim.x) cp_async16(smem_addr(nd + e * 16), o.norm_w + 4 * e, true);
}

// x * norm (norm in shared memory) -> the staging of the product's form (I8: byte planes, group
// sums and scales; else the bf16 planes and group sums); returns 1/rms(x). Ends synchronised.
template <bool I8>
__device__ __forceinline__ float ch_stage(const float* x, const float* norm, float eps, int cols, unsigned char* xs, float* Xs, float* sig) {
    auto word = [&](const float (&v)[8], int j, bool act) {
        if (I8) i8_stage_word(v, j, act, xs, Xs, sig); else tc_stage_word(v, j, act, xs, Xs);
    };
    return stage_words<CH_WARPS, decltype(word), false>(norm, eps, x, cols, word);
}

// I8: the integer form of the product (gemv_tc.cuh: byte planes of x, u8 × s8 mmas; fewer instructions
// a weight), else the bf16 form. (Also measured and removed, docs/PERF.md 2026-12-06: the op table in
// shared memory, the warps' partial rows summed by a shuffle tree — neither moved an op's time.)
template <bool PREFETCH, bool I8>
__device__ __forceinline__ void gemv_chain(const ChainParams& p) {
    extern __shared__ __align__(16) unsigned char ch_smem[];
    __shared__ float red[CH_MAX_TILES][CH_WARPS][16];
    unsigned char* xst = ch_smem + 2 * p.buf_bytes;                     // the staged x
    float* Xs = reinterpret_cast<float*>(ch_smem + p.sums_off);       // its group sums, then (I8) scales
    float* sig = Xs + CH_MAX_GROUPS;
    const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
    const int g = lane >> 2, t = lane & 3;
    const int G = gridDim.x;
    const bool breal = tc_breal(g, t);
    const uint4* xlane = I8 ? i8_xlane(xst, g, t) : tc_xlane(xst, g, t);
    const uint32_t k16 = opaque(0x41804180u);
    unsigned long long target = 0;  // thread 0: the count that ends the previous op's generation

    if (PREFETCH) {
        ch_copy_tiles(p.ops[0], ch_smem);
        cp_async_commit_group();
    }
    for (int i = 0; i < p.n; ++i) {
        const ChainOp o = p.ops[i];
        unsigned char* wb = ch_smem + (PREFETCH ? (i & 1) * p.buf_bytes : 0);
        if (PREFETCH) {
            // The next op's tiles go to the buffer op i - 1 used (every warp is done with it: the
            // block synchronised after that op's products).
            if (i + 1 < p.n) ch_copy_tiles(p.ops[i + 1], ch_smem + ((i + 1) & 1) * p.buf_bytes);
            cp_async_commit_group();  // possibly empty: one group an op either way
        }
        ch_stamp(p.trace, i, 0);
        if (i > 0) grid_wait(p.counters + (i - 1), target);
        ch_stamp(p.trace, i, 1);
        if (!PREFETCH) {
            ch_copy_tiles(o, wb);
            cp_async_commit_group();
        }
        const int tiles = o.rows >> 4, mine = blockIdx.x < tiles ? (tiles - 1 - blockIdx.x) / G + 1 : 0;
        const int nr = o.cols >> 7, rs = ch_row_bytes(o.cols), ss = ch_srow_bytes(o.cols), tb = ch_tile_bytes(o.cols);
        if (PREFETCH) cp_async_wait_group<1>(); else cp_async_wait_group<0>();
        __syncthreads();
        ch_stamp(p.trace, i, 2);
        const float inv = ch_stage<I8>(o.x, reinterpret_cast<const float*>(wb + mine * tb), p.eps, o.cols, xst, Xs, sig);  // ends synchronised
        ch_stamp(p.trace, i, 3);

        // The products: every tile's partial rows, one barrier, then the warps' parts summed in order.
        for (int ti = 0; ti < mine; ++ti) {
            const unsigned char* base = wb + ti * tb;
            float acc0 = 0.0f, acc1 = 0.0f;
            for (int r = warp; r < nr; r += CH_WARPS) {
                if (I8) {
                    i8_round_staged(acc0, acc1, base, rs, ss, r, g, t, xlane, Xs, sig, breal);
                } else {
                    const TcLoad W = tc_load_staged(base, rs, ss, r, g, t);
                    uint4 xb[4];
                    const float X = tc_round_b(xb, xlane, Xs, r, breal, t);
                    float c[4];
                    tc_mmas<2>(c, W, xb, k16);
                    tc_affine(acc0, acc1, c, W, X);
                }
            }
            tc_lane_sum(acc0, acc1);
            if (t == 0) {
                red[ti][warp][g] = acc0;
                red[ti][warp][g + 8] = acc1;
            }
        }
        __syncthreads();
        if (threadIdx.x < 16 * mine) {
            const int ti = threadIdx.x >> 4, lr = threadIdx.x & 15;
            float sum = 0.0f;
#pragma unroll
            for (int w = 0; w < CH_WARPS; ++w) sum += red[ti][w][lr];
            o.y[(blockIdx.x + ti * G) * 16 + lr] = sum * inv;
        }
        ch_stamp(p.trace, i, 4);
        const unsigned long long tg = grid_arrive(p.counters + i);
        if (threadIdx.x == 0) target = tg;
        ch_stamp(p.trace, i, 5);
    }
}

#define CHAIN_ENTRY(name, PREFETCH, I8) \
    extern "C" __global__ void __launch_bounds__(CH_WARPS * 32) name(const ChainParams p) { gemv_chain<PREFETCH, I8>(p); }
CHAIN_ENTRY(gemv_chain_prefetch, true, false)
CHAIN_ENTRY(gemv_chain_after, false, false)
CHAIN_ENTRY(gemv_chain_prefetch_i8, true, true)

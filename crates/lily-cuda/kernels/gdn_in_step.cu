// One decode token through a Gated DeltaNet layer's input projection and recurrent step in one
// launch (issue #10: fewer global phases a layer). Where the decode graph ran
//   in_proj:  [q | k | v | z | b | a] = W_in · (RMSNorm(x) · w_in)      (affine_gemv_tc.cu, every SM)
//   step:     conv + SiLU, q/k L2 norms, gates, delta rule, gated RMSNorm (gdn.cu gdn_step_b_*)
// as two launches with the projections' round trip through L2 between them, here each block of the
// step computes the projection rows it needs itself, from its own copy of x:
//   - the blocks of a key head form one thread-block cluster (CS = Hv/Hk · S blocks, S per value
//     head, as gdn_step); cluster rank cr = (j mod Hv/Hk)·S + slice;
//   - block cr computes Dk/CS of the key head's q rows and as many of its k rows, the Dv/S v rows and
//     z rows of its own state columns, and its value head's b and a rows: 16-row tiles of the fused
//     in_proj matrix, one a warp (the ab tile holds rows b_j and a_j at places 0 and 8);
//   - the tiles' weights, scales and biases are copied into shared memory before the PDL wait (they do
//     not depend on any predecessor), with the conv weights, the block's conv state rows and its state
//     columns, so that they stream in while the previous kernel runs;
//   - after the wait: x staged with the norm as gemv_tc.cuh's integer form (byte planes), the tiles'
//     products (i8 mmas, every round from shared memory), the conv of the block's own channels (their
//     conv state shifted at once: every channel belongs to one block), then each block's q and k
//     outputs and their partial sums of squares pushed into every block of the cluster (distributed
//     shared memory), one cluster barrier, the norms summed in rank order, the rule (gdn_step.cuh),
//     the norm's partial sums pushed to the value head's S blocks, a second barrier, y and the state.
// A cluster barrier arrived at the start and waited before the first push guarantees every block of
// the cluster runs before another writes into its shared memory; no block touches another's shared
// memory after the last barrier, so none needs to wait for the others to leave.
// The same maths as the two kernels; the projection's rows are summed in one chain of rounds (the
// GEMV splits a row's rounds over KS warps), and the q/k sums of squares by block then rank, so the
// bits differ from the two-launch path by f32 rounding.
#include <stdint.h>
#include <cuda_bf16.h>
#include "pdl.cuh"
#include "reduce.cuh"
#include "async_copy.cuh"
#include "gemv.cuh"
#include "gemv_tc.cuh"
#include "gdn_step.cuh"

// Its Rust mirror is `GdnInStepParams` in ops/gdn_in_step.rs.
struct GdnInStepParams {
    const uint4* w;          // fused in_proj [R, H/32] 16-byte chunks; rows q [Hk·Dk] | k [Hk·Dk] | v [Hv·Dv] | z [Hv·Dv] | b [Hv] | a [Hv]
    const uint16_t* scales;  // [R, H/64] bf16 bits
    const uint16_t* biases;
    const float* x;          // [H] the residual stream
    const float* in_norm;    // [H] the layer's input RMSNorm weight
    const float* conv_w;     // [C, K]
    float* conv_state;       // [K-1, C], in place
    const float* a_log;      // [Hv]
    const float* dt_bias;    // [Hv]
    float* state;            // [Hv, Dk, Dv], in place
    const float* norm_w;     // [Dv] the gated norm's weight
    float* y;                // [Hv·Dv] the gated norm of the rule's output
    int hidden;              // H: a multiple of 512
    int hk;
    int hv;
    int dk;
    int dv;
    int k;
    int slices;              // S: blocks per value head (each Dv/S state columns)
    float in_eps;
    float eps;
    int pad_;
};

constexpr int IS_WARPS = 8;
constexpr int IS_WPAD = 64;  // bytes after each staged weight row (gemv_chain.cu's padding)
constexpr int IS_SPAD = 16;  // the same after each scale and bias row

// Bytes of one staged 16-row tile: 16 weight rows, then 16 scale and 16 bias rows (tc_load_staged's layout).
__device__ __forceinline__ int is_row_bytes(int cols) { return (cols >> 1) + IS_WPAD; }
__device__ __forceinline__ int is_srow_bytes(int cols) { return (cols >> 5) + IS_SPAD; }
__device__ __forceinline__ int is_tile_bytes(int cols) { return 16 * is_row_bytes(cols) + 32 * is_srow_bytes(cols); }

// The block's shapes and where its pieces live.
struct IsBlock {
    int cs, cr;          // cluster size and this block's rank
    int j, slice, kh;    // value head, its slice, key head
    int qr, cols, n;     // q (and k) rows of the block, state columns, conv channels (2·qr + cols)
    int qt, vt, tiles;   // tiles of q (and of k), of v (and of z); all of them with the ab tile
    int c0;              // first state column
    long long kd, C;     // Hk·Dk, conv channels of the layer
};

__device__ __forceinline__ IsBlock is_block(const GdnInStepParams& p) {
    IsBlock b;
    const int S = p.slices, ratio = p.hv / p.hk;
    b.cs = ratio * S;
    b.cr = blockIdx.x % b.cs;
    b.j = blockIdx.x / S;
    b.slice = blockIdx.x % S;
    b.kh = b.j / ratio;
    b.qr = p.dk / b.cs;
    b.cols = p.dv / S;
    b.n = 2 * b.qr + b.cols;
    b.qt = (b.qr + 15) >> 4;
    b.vt = (b.cols + 15) >> 4;
    b.tiles = 2 * b.qt + 2 * b.vt + 1;
    b.c0 = b.slice * b.cols;
    b.kd = (long long)p.hk * p.dk;
    b.C = 2 * b.kd + (long long)p.hv * p.dv;
    return b;
}

// The layer's conv channel (= in_proj row) of the block's channel i: its q rows, its k rows, then the
// v rows of its state columns.
__device__ __forceinline__ long long is_chan(const GdnInStepParams& p, const IsBlock& b, int i) {
    const long long head = (long long)b.kh * p.dk + (long long)b.cr * b.qr;
    return i < b.qr ? head + i : i < 2 * b.qr ? b.kd + head + (i - b.qr) : 2 * b.kd + (long long)b.j * p.dv + b.c0 + (i - 2 * b.qr);
}

// Tile i of the block: in_proj row of its place r (0..15), whether place r is one of the block's
// rows, and where its output goes in P (q [qr] | k [qr] | v [cols] | z [cols] | b | a).
struct IsTile {
    long long row0;  // in_proj row of place 0
    long long step8; // rows from place 0 to place 8 (8, or a_j − b_j for the ab tile)
    int live;        // places 0..live-1 hold rows (the ab tile: 0 and 8)
    bool ab;
    int p0;          // P index of place 0
};

__device__ __forceinline__ IsTile is_tile(const GdnInStepParams& p, const IsBlock& b, int i) {
    IsTile t;
    t.ab = false;
    t.step8 = 8;
    if (i < 2 * b.qt + b.vt) {  // the block's q, k or v rows: its conv channels p0 .. (P holds them in order)
        const bool q = i < b.qt, k = !q && i < 2 * b.qt;
        const int r = 16 * (q ? i : k ? i - b.qt : i - 2 * b.qt);  // row within the segment
        t.p0 = (q ? 0 : k ? b.qr : 2 * b.qr) + r;
        t.row0 = is_chan(p, b, t.p0);
        t.live = min(16, (q || k ? b.qr : b.cols) - r);
    } else if (i < 2 * b.qt + 2 * b.vt) {  // z rows of the same columns
        const int r = 16 * (i - 2 * b.qt - b.vt);
        t.row0 = b.C + (long long)b.j * p.dv + b.c0 + r;
        t.live = min(16, b.cols - r);
        t.p0 = 2 * b.qr + b.cols + r;
    } else {  // b_j at place 0, a_j at place 8
        const long long vd = (long long)p.hv * p.dv;
        t.ab = true;
        t.row0 = b.C + vd + b.j;
        t.step8 = (long long)p.hv;
        t.live = 0;
        t.p0 = 2 * b.qr + 2 * b.cols;
    }
    return t;
}
__device__ __forceinline__ bool is_live(const IsTile& t, int place) { return t.ab ? (place == 0 || place == 8) : place < t.live; }
__device__ __forceinline__ long long is_src_row(const IsTile& t, int place) { return place < 8 ? t.row0 + place : t.row0 + t.step8 + (place - 8); }

// Shared memory (dynamic, in this order; the host's `smem_bytes` mirrors it): the tiles
// [tiles · is_tile_bytes(H)] | x's byte planes [H/128 · I8_ROUND] | Xs, sig [H/64 each] | the state
// columns ST [Dk, cols] | conv weights CW [n, K] | conv state rows CH [K-1, n] | P [2·qr + 2·cols + 2] |
// Y [n] | QK [2·Dk] (the key head's q then k after the conv, pushed by every block) | SS [2·CS] (their
// partial sums of squares by rank) | SP [S] (the value head's norm partials by slice).
// AHEAD: the copies issued before the PDL wait (the point of the kernel); false: after it, as a
// kernel without PDL would (the A/B that says whether the copies overlap the previous kernel).
template <int NR, bool AHEAD>
__device__ __forceinline__ void gdn_in_step(const GdnInStepParams& p) {
    extern __shared__ __align__(16) unsigned char is_smem[];
    constexpr int RG = 4;
    const IsBlock b = is_block(p);
    const int H = p.hidden, dk = p.dk, dv = p.dv, K = p.k, hist = p.k - 1;
    const int nch = H >> 5, groups = H >> 6, gq = groups >> 3, nr = H >> 7;
    const int rs = is_row_bytes(H), ss = is_srow_bytes(H), tb = is_tile_bytes(H);
    const int tid = threadIdx.x, bd = blockDim.x;
    unsigned char* WT = is_smem;
    unsigned char* xs = WT + b.tiles * tb;
    float* Xs = reinterpret_cast<float*>(xs + nr * I8_ROUND);
    float* sig = Xs + groups;
    float* ST = sig + groups;
    float* CW = ST + dk * b.cols;
    float* CH = CW + b.n * K;
    float* P = CH + hist * b.n;
    float* Y = P + 2 * b.qr + 2 * b.cols + 2;
    float* QK = Y + b.n;
    float* SS = QK + 2 * dk;
    float* SP = SS + 2 * b.cs;
    auto chan = [&](int i) { return is_chan(p, b, i); };

    // Every block of the cluster is running before any writes into another's shared memory: arrive
    // now, wait before the first push.
    cluster_arrive_relaxed();
    if (!AHEAD) {
        pdl_wait();
        pdl_launch_dependents();
    }

    // Before the PDL wait: what no predecessor writes. The tiles (16 bytes a copy), the state columns,
    // the conv weights and the conv state rows of the block's channels.
    for (int i = 0; i < b.tiles; ++i) {
        const IsTile T = is_tile(p, b, i);
        unsigned char* d = WT + i * tb;
        for (int e = tid; e < 16 * nch; e += bd) {
            const int r = e / nch, c = e - r * nch;
            if (is_live(T, r)) cp_async16(smem_addr(d + r * rs + c * 16), p.w + is_src_row(T, r) * nch + c, true);
        }
        for (int e = tid; e < 32 * gq; e += bd) {
            const int which = e / (16 * gq), rem = e - which * 16 * gq;
            const int r = rem / gq, c = rem - r * gq;
            const uint16_t* src = (which ? p.biases : p.scales) + is_src_row(T, r) * groups;
            if (is_live(T, r)) cp_async16(smem_addr(d + 16 * rs + which * 16 * ss + r * ss + c * 16), reinterpret_cast<const uint4*>(src) + c, true);
        }
    }
    const float* St = p.state + (long long)b.j * dk * dv;
    const int c4 = b.cols >> 2;
    for (int e = tid; e < dk * c4; e += bd) {
        const int d = e / c4, c = e - d * c4;
        cp_async16(smem_addr(ST + d * b.cols + 4 * c), St + (long long)d * dv + b.c0 + 4 * c, true);
    }
    for (int e = tid; e < b.n * K; e += bd) cp_async4(smem_addr(CW + e), p.conv_w + chan(e / K) * K + e % K, true);
    for (int e = tid; e < hist * b.n; e += bd) cp_async4(smem_addr(CH + e), p.conv_state + (e / b.n) * b.C + chan(e % b.n), true);
    cp_async_commit_group();
    const float a_log = p.a_log[b.j], dt_bias = p.dt_bias[b.j];
    // The rule's lanes (gdn_step's layout: warp w < cols/8 owns columns c0 + 8w .. +7, lane = rg·8 + column).
    const int warp = tid >> 5, lane = tid & 31, g = lane >> 2, t = lane & 3;
    const int rg = lane >> 3;
    const int lc = warp * 8 + (lane & 7);
    const bool active = lc < b.cols, owner = active && rg == 0;
    const float nw = owner ? p.norm_w[b.c0 + lc] : 0.0f;

    if (AHEAD) {
        pdl_wait();
        pdl_launch_dependents();
    }
    // x · w_in into byte planes (gemv_tc.cuh's integer form); 1/rms(x). Ends synchronised.
    const float inv = i8_stage<IS_WARPS>(p.in_norm, p.in_eps, p.x, xs, Xs, sig, H);
    cp_async_wait_group<0>();
    __syncthreads();

    // The tiles' products: warp w takes tiles w, w + 8, ..; every round from shared memory.
    {
        const bool breal = tc_breal(g, t);
        const uint4* xlane = i8_xlane(xs, g, t);
        for (int i = warp; i < b.tiles; i += IS_WARPS) {
            const unsigned char* base = WT + i * tb;
            float acc0 = 0.0f, acc1 = 0.0f;
#pragma unroll 4
            for (int r = 0; r < nr; ++r) i8_round_staged(acc0, acc1, base, rs, ss, r, g, t, xlane, Xs, sig, breal);
            tc_lane_sum(acc0, acc1);
            const IsTile T = is_tile(p, b, i);
            if (t == 0) {
                if (is_live(T, g)) P[T.p0 + (T.ab ? 0 : g)] = acc0 * inv;
                if (is_live(T, g + 8)) P[T.p0 + (T.ab ? 1 : g + 8)] = acc1 * inv;
            }
        }
    }
    __syncthreads();

    // Conv + SiLU of the block's channels; their conv state shifted now (every channel is one
    // block's). Partial sums of squares of its q and k outputs.
    float ssq = 0.0f, ssk = 0.0f;
    for (int i = tid; i < b.n; i += bd) {
        float acc = 0.0f;
        for (int s = 0; s < K; ++s) acc += CW[i * K + s] * (s < hist ? CH[s * b.n + i] : P[i]);
        const float yv = silu_f(acc);
        Y[i] = yv;
        if (i < b.qr) ssq += yv * yv;
        else if (i < 2 * b.qr) ssk += yv * yv;
        const long long ch = chan(i);
        for (int r = 0; r < hist; ++r) p.conv_state[r * b.C + ch] = r + 1 < hist ? CH[(r + 1) * b.n + i] : P[i];
    }
    ssq = block_sum_reusable(ssq);
    ssk = block_sum_reusable(ssk);  // ends with a barrier: Y is written

    // Push the block's q and k outputs and its two partial sums into every block of the cluster.
    cluster_wait();
    {
        const int per = 2 * b.qr;
        for (int e = tid; e < per * b.cs; e += bd) {
            const int peer = e / per, i = e - peer * per;
            const int dst = i < b.qr ? b.cr * b.qr + i : dk + b.cr * b.qr + (i - b.qr);
            cluster_store(cluster_addr(smem_addr(QK + dst), peer), Y[i]);
        }
        if (tid < b.cs) {
            cluster_store(cluster_addr(smem_addr(SS + b.cr), tid), ssq);
            cluster_store(cluster_addr(smem_addr(SS + b.cs + b.cr), tid), ssk);
        }
    }
    cluster_arrive();  // release: the pushes are visible to the cluster after its wait
    cluster_wait();

    // q <- l2norm(q)/sqrt(Dk), k <- l2norm(k), the sums in rank order.
    float tq = 0.0f, tk = 0.0f;
    for (int r = 0; r < b.cs; ++r) {
        tq += SS[r];
        tk += SS[b.cs + r];
    }
    const float qs = (1.0f / sqrtf(tq + 1e-6f)) * (1.0f / sqrtf((float)dk));
    const float ks = 1.0f / sqrtf(tk + 1e-6f);
    for (int i = tid; i < 2 * dk; i += bd) QK[i] *= i < dk ? qs : ks;

    // The gates of head j.
    const float decay = expf(-expf(a_log) * gdn_softplus(P[2 * b.qr + 2 * b.cols + 1] + dt_bias));
    const float bt = gdn_beta(P[2 * b.qr + 2 * b.cols]);
    __syncthreads();

    // The rule, the state columns from shared memory.
    float s[NR];
#pragma unroll
    for (int i = 0; i < NR; ++i) {
        const int d = rg + RG * i;
        s[i] = (active && d < dk) ? ST[d * b.cols + lc] : 0.0f;
    }
    const float v = active ? Y[2 * b.qr + lc] : 0.0f;
    const float o = gdn_step_rule<RG>(s, QK, QK + dk, v, decay, bt, rg, dk);

    // Gated RMSNorm over the head's Dv outputs: the partial sums pushed to the head's S blocks.
    const float part = block_sum_reusable(owner ? o * o : 0.0f);
    const int rank0 = (b.j % (p.hv / p.hk)) * p.slices;
    if (tid < p.slices) cluster_store(cluster_addr(smem_addr(SP + b.slice), rank0 + tid), part);
    cluster_arrive();
    cluster_wait();
    float oss = 0.0f;
    for (int r = 0; r < p.slices; ++r) oss += SP[r];
    const float rinv = 1.0f / sqrtf(oss / (float)dv + p.eps);
    if (owner) {
        const int col = b.c0 + lc;
        const float zv = P[2 * b.qr + b.cols + lc];
        p.y[(long long)b.j * dv + col] = nw * (o * rinv) * silu_f(zv);
    }
#pragma unroll
    for (int i = 0; i < NR; ++i) {
        const int d = rg + RG * i;
        if (active && d < dk) p.state[(long long)b.j * dk * dv + (long long)d * dv + b.c0 + lc] = s[i];
    }
}

// At most 128 registers a thread (the bound's 2 blocks): one block an SM by its shared memory, but
// room beside a block of the kernel before it (the MoE down projection's 108 registers × 256 threads)
// so that the copies before the PDL wait can start while that kernel runs (158 registers unbounded;
// none spilled at 127).
#define GDN_IN_STEP_ENTRY(NR)                                                                                                               \
    extern "C" __global__ void __launch_bounds__(IS_WARPS * 32, 2) gdn_in_step_r##NR(const GdnInStepParams p) { gdn_in_step<NR, true>(p); } \
    extern "C" __global__ void __launch_bounds__(IS_WARPS * 32, 2) gdn_in_step_after_r##NR(const GdnInStepParams p) { gdn_in_step<NR, false>(p); }
GDN_IN_STEP_ENTRY(8)
GDN_IN_STEP_ENTRY(16)
GDN_IN_STEP_ENTRY(32)

// Causal prefill attention on the tensor cores (flash-attention 2 style, mma.sync m16n8k16 bf16 with
// f32 accumulation), the softmax part of lily_cpu::attention::forward for T new tokens at positions
// pos0..pos0+T whose K/V are already in the bf16 cache: query (t, h) attends to positions 0..=pos0+t of
// KV head h / G (G = nh / kvh), scores (q·k)·scale, softmax in f32, o = Σ p·v; with a gate,
// o ← o · sigmoid(gate). q and p enter the tensor cores as bf16 (K and V are bf16 already); scores,
// the softmax and the output accumulate in f32.
// Layouts: q, gate, out [T, nh, hd] f32; K cache [cap, kvh, hd] bf16; V cache bf16 in transposed tiles
// of 32 positions, [kvh, cap/32, hd, 32] (kv_layout.cuh, as kernels/attention.cu).
//
// attn_prefill_d{HD}: one block of 4 warps per (tile of 64 query rows, KV head), where the rows of KV
// head kv are the T·G pairs (token t, head kv·G + g) in the order r = t·G + g, so a tile holds 64/G
// tokens × the group's heads and every K/V tile brought into shared memory serves all of them. Blocks
// run the heaviest tiles (latest tokens) first. The Q tile [64][HD] is converted to bf16 into shared
// memory once; K [32][HD] and Vᵀ [HD][32] tiles stream through a 2-stage cp.async ring (positions past
// the tile's last query position zero-filled, so cache rows beyond pos0+T are never read). Warp w owns
// rows 16w..16w+16: per KV tile, S = Q·Kᵀ (4 n-tiles × HD/16 k-steps; A and B by ldmatrix), the
// causal mask and the online softmax in registers (two rows per lane), P re-packed from the S
// accumulators as the A fragments of O += P·V (B from Vᵀ by ldmatrix), O [16 × HD] in registers.
// Shared-memory rows are padded by 16 bytes (ldmatrix conflict-free).
//
// attn_prefill_wg_d{128,256}: the same rows on Hopper's warpgroup MMA (wgmma), one block of two warpgroups
// per (tile of 128 rows, KV head), warpgroup w owning rows 64w..64w+63. Q [128][HD] (bf16), K [64][HD]
// and Vᵀ [HD][64] tiles sit in shared memory in wgmma's K-major 128-byte swizzle (wgmma.cuh): a head row
// of HD values is HD/64 "atoms" of 128 bytes, atom a of every row of a tile stored together (rows of 128
// bytes, the 16-byte chunk c of row r at chunk c ^ (r % 8)); a Vᵀ row is one atom (64 positions). Per
// KV tile of 64 positions a warpgroup computes S = Q·Kᵀ (HD/16 m64n64k16, both operands from shared
// memory), the masked online softmax on S in registers (the same two rows a lane as the mma.sync form:
// wgmma's accumulator is mma.sync's m16n8 layout stacked), then O += P·V (4 k-steps × HD/128
// m64n128k16, P from registers as the A fragments, O [64 × HD] f32 in registers: 128 a thread at 256).
// Exponentials in base 2 with the scale's log2(e) folded into the scores. K/V tiles double-buffered by
// cp.async from all 256 threads, the next tile's copy in flight during this tile's MMAs.
// attn_prefill_wgo_d{128,256}: the same with each tile's softmax overlapped with the previous tile's
// P·V on the tensor cores (see attn_prefill_wg's OVERLAP).

#include "mma.cuh"
#include "pdl.cuh"
#include "wgmma.cuh"
#include "kv_layout.cuh"

struct AttnPrefillParams {
    const float* q;      // [T, nh, hd]
    const uint16_t* k;   // [cap, kvh, hd] bf16
    const uint16_t* vt;  // [kvh, cap/32, hd, 32] bf16 (kv_layout.cuh)
    const float* gate;   // [T, nh, hd] or null
    float* out;          // [T, nh, hd]
    int t;
    int nh;
    int kvh;
    int pos0;
    int ntiles;  // ceil(T·G / 64)
    int cap;
    float scale;
    int pad_;
};

// Shared by both forms. The offset of row gr (token gr / G, head kv·G + gr % G) in q, gate and out.
template <int HD>
__device__ __forceinline__ long long pf_row_off(const AttnPrefillParams& p, int gr, int G, int kv) {
    return ((long long)(gr / G) * p.nh + kv * G + gr % G) * HD;
}

// The block's Q tile (ROWS rows from r0) as bf16, chunk ch (8 values) of row r stored at dst(r, ch);
// rows past the last (token, head) pair are zeros.
template <int HD, int ROWS, int THREADS, typename Dst>
__device__ __forceinline__ void pf_stage_q(const AttnPrefillParams& p, int r0, int nrows, int G, int kv, Dst dst) {
    for (int c = threadIdx.x; c < ROWS * (HD / 8); c += THREADS) {
        const int r = c / (HD / 8), ch = c % (HD / 8);
        const int gr = r0 + r;
        uint4 w = make_uint4(0, 0, 0, 0);
        if (gr < nrows) {
            const float* src = p.q + pf_row_off<HD>(p, gr, G, kv) + ch * 8;
            const float4 a = __ldg(reinterpret_cast<const float4*>(src));
            const float4 b = __ldg(reinterpret_cast<const float4*>(src + 4));
            w = make_uint4(pack_bf16(a.x, a.y), pack_bf16(a.z, a.w), pack_bf16(b.x, b.y), pack_bf16(b.z, b.w));
        }
        sts128(dst(r, ch), w);
    }
}

// out[off + d .. + 1] = (y0, y1), times sigmoid(gate) there when the attention is gated.
__device__ __forceinline__ void pf_store_pair(const AttnPrefillParams& p, long long off, int d, float y0, float y1) {
    if (p.gate) {
        const float2 gt = *reinterpret_cast<const float2*>(p.gate + off + d);
        y0 = y0 * (1.0f / (1.0f + expf(-gt.x)));
        y1 = y1 * (1.0f / (1.0f + expf(-gt.y)));
    }
    *reinterpret_cast<float2*>(p.out + off + d) = make_float2(y0, y1);
}

#define PF_BR 64  // query rows per block (= ops::attn_prefill::ROWS_PER_BLOCK)
#define PF_BK 32  // positions per KV tile (= ops::attn_prefill::KV_TILE)
static_assert(PF_BK == KV_TILE, "a tile is one V tile of the cache");
#define PF_THREADS 128

template <int HD>
struct PfLayout {
    static constexpr int QP = HD * 2 + 16;    // Q row pitch (bytes)
    static constexpr int KP = HD * 2 + 16;    // K row pitch
    static constexpr int VP = PF_BK * 2 + 16; // Vᵀ row pitch
    static constexpr int Q_BYTES = PF_BR * QP;
    static constexpr int K_BYTES = PF_BK * KP;
    static constexpr int V_BYTES = HD * VP;
    static constexpr int STAGE = K_BYTES + V_BYTES;
    static constexpr int TOTAL = Q_BYTES + 2 * STAGE;  // = ops::attn_prefill::smem_bytes
};

template <int HD>
__device__ __forceinline__ void attn_prefill(const AttnPrefillParams& p) {
    using L = PfLayout<HD>;
    constexpr int NT = HD / 8;  // n-tiles of O
    extern __shared__ __align__(16) unsigned char smem[];
    const uint32_t qs = smem_addr(smem);
    const uint32_t stage0 = qs + L::Q_BYTES;

    const int kv = blockIdx.x % p.kvh;
    const int tile = p.ntiles - 1 - (int)(blockIdx.x / p.kvh);  // heaviest first
    const int G = p.nh / p.kvh;
    const int nrows = p.t * G;
    const int r0 = tile * PF_BR;
    const int rend = min(nrows, r0 + PF_BR);
    const int kv_end = p.pos0 + (rend - 1) / G + 1;
    const int ntile_kv = (kv_end + PF_BK - 1) / PF_BK;

    auto issue = [&](int j, int buf) {
        const uint32_t ks = stage0 + buf * L::STAGE, vs = ks + L::K_BYTES;
        const int base = j * PF_BK;
        constexpr int KCH = HD / 8;
        for (int c = threadIdx.x; c < PF_BK * KCH; c += PF_THREADS) {
            const int r = c / KCH, ch = c % KCH;
            const int pos = base + r;
            const bool ok = pos < kv_end;
            const uint16_t* src = ok ? p.k + ((long long)pos * p.kvh + kv) * HD + ch * 8 : p.k;
            cp_async16z(ks + r * L::KP + ch * 16, src, ok ? 16 : 0);
        }
        // The tile's Vᵀ [HD][32] is one contiguous run of the cache (kv_layout.cuh): chunk c is dim c / 4,
        // positions 8(c % 4) ..
        const uint16_t* vtile = p.vt + vt_index(kv, 0, base, HD, p.cap);
        for (int c = threadIdx.x; c < HD * (PF_BK / 8); c += PF_THREADS) {
            const int d = c / (PF_BK / 8), ch = c % (PF_BK / 8);
            const int valid = min(max(kv_end - (base + ch * 8), 0), 8);
            cp_async16z(vs + d * L::VP + ch * 16, valid > 0 ? vtile + 8 * c : p.vt, valid * 2);
        }
    };
    issue(0, 0);
    cp_async_commit_group();

    // Q tile -> bf16 in shared memory.
    pf_stage_q<HD, PF_BR, PF_THREADS>(p, r0, nrows, G, kv, [&](int r, int ch) { return qs + r * L::QP + ch * 16; });

    const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31, g = lane >> 2, t = lane & 3;
    // This lane's two rows (g and g + 8 of the warp's 16) and their query positions.
    int qpos[2];
#pragma unroll
    for (int h = 0; h < 2; ++h) {
        const int gr = r0 + warp * 16 + g + 8 * h;
        qpos[h] = gr < nrows ? p.pos0 + gr / G : kv_end - 1;
    }
    float m[2] = {-INFINITY, -INFINITY}, l[2] = {0.0f, 0.0f};
    float o[NT][4];
#pragma unroll
    for (int i = 0; i < NT; ++i) o[i][0] = o[i][1] = o[i][2] = o[i][3] = 0.0f;

    // ldmatrix addresses: A (Q rows 16w + lane%16, k half lane/16); B from K (position (mi/2)·8 + lane%8,
    // dim half mi%2) and from Vᵀ (dim (mi/2)·8 + lane%8, position half mi%2), mi = lane / 8.
    const uint32_t qa_addr = qs + (warp * 16 + (lane & 15)) * L::QP + (lane >> 4) * 16;
    const int mi = lane >> 3;
    const int kb_row = (mi >> 1) * 8 + (lane & 7), kb_half = mi & 1;

    int buf = 0;
    for (int j = 0; j < ntile_kv; ++j) {
        if (j + 1 < ntile_kv) issue(j + 1, buf ^ 1);
        cp_async_commit_group();
        cp_async_wait_group<1>();
        __syncthreads();
        const uint32_t ks = stage0 + buf * L::STAGE, vs = ks + L::K_BYTES;

        // S = Q·Kᵀ: 4 n-tiles of 8 positions.
        float s[4][4];
#pragma unroll
        for (int i = 0; i < 4; ++i) s[i][0] = s[i][1] = s[i][2] = s[i][3] = 0.0f;
#pragma unroll
        for (int kk = 0; kk < HD / 16; ++kk) {
            uint32_t a0, a1, a2, a3;
            ldmatrix_x4(qa_addr + kk * 32, a0, a1, a2, a3);
#pragma unroll
            for (int np = 0; np < 2; ++np) {  // n-tiles 2np, 2np+1
                uint32_t b0, b1, b2, b3;
                ldmatrix_x4(ks + (np * 16 + kb_row) * L::KP + kk * 32 + kb_half * 16, b0, b1, b2, b3);
                // matrices: (pos 0-7, k lo), (pos 0-7, k hi), (pos 8-15, k lo), (pos 8-15, k hi)
                mma_bf16(s[2 * np], a0, a1, a2, a3, b0, b1);
                mma_bf16(s[2 * np + 1], a0, a1, a2, a3, b2, b3);
            }
        }
        // Scale, mask, online softmax (rows g: s[.][0..1], g+8: s[.][2..3]).
        const int base = j * PF_BK;
        float alpha[2];
#pragma unroll
        for (int h = 0; h < 2; ++h) {
            float mx = -INFINITY;
#pragma unroll
            for (int i = 0; i < 4; ++i)
#pragma unroll
                for (int e = 0; e < 2; ++e) {
                    const int pos = base + 8 * i + 2 * t + e;
                    const float v = pos > qpos[h] ? -INFINITY : s[i][2 * h + e] * p.scale;
                    s[i][2 * h + e] = v;
                    mx = fmaxf(mx, v);
                }
            mx = fmaxf(mx, __shfl_xor_sync(0xffffffffu, mx, 1));
            mx = fmaxf(mx, __shfl_xor_sync(0xffffffffu, mx, 2));
            const float mn = fmaxf(m[h], mx);  // finite: position 0 is in tile 0 and never masked
            alpha[h] = expf(m[h] - mn);
            float ps = 0.0f;
#pragma unroll
            for (int i = 0; i < 4; ++i)
#pragma unroll
                for (int e = 0; e < 2; ++e) {
                    const float pv = expf(s[i][2 * h + e] - mn);
                    s[i][2 * h + e] = pv;
                    ps += pv;
                }
            l[h] = l[h] * alpha[h] + ps;
            m[h] = mn;
        }
#pragma unroll
        for (int i = 0; i < NT; ++i) {
            o[i][0] *= alpha[0];
            o[i][1] *= alpha[0];
            o[i][2] *= alpha[1];
            o[i][3] *= alpha[1];
        }
        // O += P·V: k-step ks covers positions 16ks..16ks+16 (S n-tiles 2ks, 2ks+1).
#pragma unroll
        for (int ks2 = 0; ks2 < 2; ++ks2) {
            const uint32_t pa0 = pack_bf16(s[2 * ks2][0], s[2 * ks2][1]);
            const uint32_t pa1 = pack_bf16(s[2 * ks2][2], s[2 * ks2][3]);
            const uint32_t pa2 = pack_bf16(s[2 * ks2 + 1][0], s[2 * ks2 + 1][1]);
            const uint32_t pa3 = pack_bf16(s[2 * ks2 + 1][2], s[2 * ks2 + 1][3]);
#pragma unroll
            for (int dp = 0; dp < NT / 2; ++dp) {  // dim tiles 2dp, 2dp+1
                uint32_t b0, b1, b2, b3;
                ldmatrix_x4(vs + (dp * 16 + kb_row) * L::VP + ks2 * 32 + kb_half * 16, b0, b1, b2, b3);
                // matrices: (dims 0-7, pos lo), (dims 0-7, pos hi), (dims 8-15, pos lo), (dims 8-15, pos hi)
                mma_bf16(o[2 * dp], pa0, pa1, pa2, pa3, b0, b1);
                mma_bf16(o[2 * dp + 1], pa0, pa1, pa2, pa3, b2, b3);
            }
        }
        __syncthreads();  // this buffer is refilled next iteration
        buf ^= 1;
    }
    cp_async_wait_group<0>();

    // o = acc / l (· sigmoid(gate)) for this lane's valid rows.
#pragma unroll
    for (int h = 0; h < 2; ++h) {
        float L2 = l[h];
        L2 += __shfl_xor_sync(0xffffffffu, L2, 1);
        L2 += __shfl_xor_sync(0xffffffffu, L2, 2);
        const int gr = r0 + warp * 16 + g + 8 * h;
        if (gr >= nrows) continue;
        const long long off = pf_row_off<HD>(p, gr, G, kv);
        const float inv = 1.0f / L2;
#pragma unroll
        for (int i = 0; i < NT; ++i) pf_store_pair(p, off, 8 * i + 2 * t, o[i][2 * h] * inv, o[i][2 * h + 1] * inv);
    }
}

extern "C" __global__ void __launch_bounds__(PF_THREADS, 2) attn_prefill_d32(const AttnPrefillParams p) { pdl_enter(); attn_prefill<32>(p); }
extern "C" __global__ void __launch_bounds__(PF_THREADS, 2) attn_prefill_d64(const AttnPrefillParams p) { pdl_enter(); attn_prefill<64>(p); }
extern "C" __global__ void __launch_bounds__(PF_THREADS, 2) attn_prefill_d128(const AttnPrefillParams p) { pdl_enter(); attn_prefill<128>(p); }
extern "C" __global__ void __launch_bounds__(PF_THREADS, 2) attn_prefill_d256(const AttnPrefillParams p) { pdl_enter(); attn_prefill<256>(p); }

// ---- The wgmma form (see the header).

#define WG_BR 128      // query rows per block (= ops::attn_prefill::WG_ROWS_PER_BLOCK)
#define WG_BK 64       // positions per KV tile
static_assert(WG_BK % KV_TILE == 0, "a tile is whole V tiles of the cache");
#define WG_THREADS 256

template <int HD>
struct WgLayout {
    static constexpr int Q_ATOM = WG_BR * 128;         // one 64-column atom of the Q tile
    static constexpr int Q_BYTES = (HD / 64) * Q_ATOM;
    static constexpr int K_ATOM = WG_BK * 128;
    static constexpr int K_BYTES = (HD / 64) * K_ATOM;
    static constexpr int V_BYTES = HD * 128;           // HD rows of WG_BK positions
    static constexpr int STAGE = K_BYTES + V_BYTES;
    static constexpr int TOTAL = Q_BYTES + 2 * STAGE + 1024;  // + alignment (= ops::attn_prefill::wg_smem_bytes)
};

// Byte offset of 16-byte chunk `ch` (of HD / 8) of row `r` in a tile of `atom`-byte atoms.
__device__ __forceinline__ uint32_t sw128_at(int r, int ch, int atom) {
    return (uint32_t)((ch >> 3) * atom + r * 128 + (((ch & 7) ^ (r & 7)) << 4));
}

// OVERLAP = false: per KV tile j, S_j = Q·K_jᵀ, wait, softmax, O += P_j·V_j, wait (the two warpgroups
// overlap each other's softmax with their MMAs). OVERLAP = true (FlashAttention-3's intra-warpgroup
// pipelining): S_j = Q·K_jᵀ and O += P_{j-1}·V_{j-1} are issued together, and the softmax of S_j runs
// on the CUDA cores while the P·V product is on the tensor cores; O's rescale by tile j's max waits
// for it. The V tiles then lag the K tiles by one: the copy issued at tile j brings K_{j+1} and V_j.
template <int HD, bool OVERLAP>
__device__ __forceinline__ void attn_prefill_wg(const AttnPrefillParams& p) {
    using L = WgLayout<HD>;
    constexpr int NH2 = HD / 128;  // m64n128 halves of O
    static_assert(HD % 128 == 0, "the wgmma form takes head dims of 128 and 256");
    extern __shared__ __align__(16) unsigned char smem[];
    const uint32_t qs = (smem_addr(smem) + 1023u) & ~1023u;  // every atom 1024-byte aligned
    const uint32_t stage0 = qs + L::Q_BYTES;

    const int tid = threadIdx.x, lane = tid & 31, wg = tid >> 7, warp = (tid >> 5) & 3;
    const int g = lane >> 2, q4 = lane & 3;
    const int kv = blockIdx.x % p.kvh;
    const int tile = p.ntiles - 1 - (int)(blockIdx.x / p.kvh);  // heaviest first
    const int G = p.nh / p.kvh;
    const int nrows = p.t * G;
    const int r0 = tile * WG_BR;
    const int rend = min(nrows, r0 + WG_BR);
    const int kv_end = p.pos0 + (rend - 1) / G + 1;
    const int ntile_kv = (kv_end + WG_BK - 1) / WG_BK;
    const int qpos_min = p.pos0 + r0 / G;  // tiles wholly at or before it need no mask

    // K [64][HD] of tile j into stage `buf`: chunk ch of position row r -> atom ch / 8. Vᵀ [HD][64]: chunk
    // ch (8 positions) of dim d. Positions at or past kv_end are zero-filled (never read: the cache may
    // hold anything there).
    // Thread tid copies K rows tid / KCH + KPASS·i (chunk tid % KCH) and Vᵀ rows tid / 8 + 32·i (chunk
    // tid % 8): one base pointer each, strided (fewer live registers than a pointer a copy).
    constexpr int KCH = HD / 8, KPASS = WG_THREADS / KCH;
    const int kr = tid / KCH, kch = tid % KCH, vd = tid >> 3, vch = tid & 7;
    const uint16_t* kbase = p.k + ((long long)kr * p.kvh + kv) * HD + kch * 8;
    const long long kstride = (long long)KPASS * p.kvh * HD, kstep = (long long)WG_BK * p.kvh * HD;
    // Vᵀ chunk (dim vd + 32i, positions 64j + 8·vch ..) of KV tile j: in the cache's tile 2j + vch / 4
    // (kv_layout.cuh), dim row vd + 32i, 8·(vch % 4) in; consecutive j are 64·HD values apart and
    // consecutive i 32·KV_TILE.
    const uint16_t* vbase = p.vt + vt_index(kv, vd, 8 * vch, HD, p.cap);
    const long long vstride = 32LL * KV_TILE;
    auto issue_k = [&](int j, int buf) {
        const uint32_t ks = stage0 + buf * L::STAGE;
        const uint16_t* src = kbase + j * kstep;
#pragma unroll
        for (int i = 0; i < WG_BK / KPASS; ++i) {
            const int r = kr + KPASS * i;
            const bool ok = j * WG_BK + r < kv_end;
            cp_async16z(ks + sw128_at(r, kch, L::K_ATOM), ok ? src + i * kstride : p.k, ok ? 16 : 0);
        }
    };
    auto issue_v = [&](int j, int buf) {
        const uint32_t vs = stage0 + buf * L::STAGE + L::K_BYTES;
        const int valid = min(max(kv_end - (j * WG_BK + vch * 8), 0), 8);
        const uint16_t* src = vbase + (long long)j * WG_BK * HD;
#pragma unroll
        for (int i = 0; i < HD / 32; ++i) cp_async16z(vs + sw128_at(vd + 32 * i, vch, 0), valid > 0 ? src + i * vstride : p.vt, valid * 2);
    };
    issue_k(0, 0);
    if (!OVERLAP) issue_v(0, 0);
    cp_async_commit_group();

    // Q tile -> bf16, then visible to wgmma.
    pf_stage_q<HD, WG_BR, WG_THREADS>(p, r0, nrows, G, kv, [&](int r, int ch) { return qs + sw128_at(r, ch, L::Q_ATOM); });
    fence_proxy_async();

    // This lane's two rows (g and g + 8 of its warp's 16, in its warpgroup's 64) and their positions.
    int qpos[2];
#pragma unroll
    for (int h = 0; h < 2; ++h) {
        const int gr = r0 + 64 * wg + 16 * warp + g + 8 * h;
        qpos[h] = gr < nrows ? p.pos0 + gr / G : kv_end - 1;
    }
    const float sl2 = p.scale * 1.4426950408889634f;  // scores in base-2 units
    float m[2] = {-INFINITY, -INFINITY}, l[2] = {0.0f, 0.0f};
    float o[NH2][64];
#pragma unroll
    for (int hh = 0; hh < NH2; ++hh)
#pragma unroll
        for (int i = 0; i < 64; ++i) o[hh][i] = 0.0f;
    // This warpgroup's Q rows: atom a at qs + a·Q_ATOM + wg·64 rows.
    const uint64_t qdesc = wgmma_desc_sw128(qs + wg * 64 * 128);

    // S = Q·K_bufᵀ [64 × 64], issued (not waited for): k-step kk is 32·(kk % 4) bytes into atom kk / 4.
    auto issue_qk = [&](float (&s)[32], int buf) {
        const uint64_t kdesc = wgmma_desc_sw128(stage0 + buf * L::STAGE);
#pragma unroll
        for (int kk = 0; kk < HD / 16; ++kk) {
            const uint64_t ad = qdesc + (uint64_t)(((kk >> 2) * L::Q_ATOM + (kk & 3) * 32) >> 4);
            const uint64_t bd = kdesc + (uint64_t)(((kk >> 2) * L::K_ATOM + (kk & 3) * 32) >> 4);
            wgmma_m64n64k16_ss(s, ad, bd, kk > 0);
        }
        wgmma_commit();
    };
    // O += P·V_buf, issued: k-step k2 covers positions 16·k2.. (S columns 8·(2k2) .. 8·(2k2+1)+7), 32·k2
    // bytes into each Vᵀ row; half hh is Vᵀ rows 128·hh.. (16 KB further).
    auto issue_pv = [&](const uint32_t (&pa)[4][4], int buf) {
        const uint64_t vdesc = wgmma_desc_sw128(stage0 + buf * L::STAGE + L::K_BYTES);
#pragma unroll
        for (int k2 = 0; k2 < 4; ++k2)
#pragma unroll
            for (int hh = 0; hh < NH2; ++hh)
                wgmma_m64n128k16_rs(o[hh], pa[k2], vdesc + (uint64_t)((hh * 128 * 128 + k2 * 32) >> 4), 1);
        wgmma_commit();
    };
    // Scale (base 2), mask, online softmax of tile j's S in place (row g in s[4i + e], row g + 8 in
    // s[4i + 2 + e], column 8i + 2·q4 + e, i = 0..7); returns O's rescale factors.
    auto softmax = [&](float (&s)[32], int j, float (&alpha)[2]) {
        const int pbase = j * WG_BK;
        const bool mask = pbase + WG_BK - 1 > qpos_min;
#pragma unroll
        for (int h = 0; h < 2; ++h) {
            float mx = -INFINITY;
#pragma unroll
            for (int i = 0; i < 8; ++i)
#pragma unroll
                for (int e = 0; e < 2; ++e) {
                    float v = s[4 * i + 2 * h + e] * sl2;
                    if (mask && pbase + 8 * i + 2 * q4 + e > qpos[h]) v = -INFINITY;
                    s[4 * i + 2 * h + e] = v;
                    mx = fmaxf(mx, v);
                }
            mx = fmaxf(mx, __shfl_xor_sync(0xffffffffu, mx, 1));
            mx = fmaxf(mx, __shfl_xor_sync(0xffffffffu, mx, 2));
            const float mn = fmaxf(m[h], mx);  // finite: position 0 is in tile 0 and never masked
            alpha[h] = exp2f(m[h] - mn);
            float ps = 0.0f;
#pragma unroll
            for (int i = 0; i < 8; ++i)
#pragma unroll
                for (int e = 0; e < 2; ++e) {
                    const float pv = exp2f(s[4 * i + 2 * h + e] - mn);
                    s[4 * i + 2 * h + e] = pv;
                    ps += pv;
                }
            l[h] = l[h] * alpha[h] + ps;
            m[h] = mn;
        }
    };
    auto rescale = [&](const float (&alpha)[2]) {
#pragma unroll
        for (int hh = 0; hh < NH2; ++hh)
#pragma unroll
            for (int i = 0; i < 16; ++i) {
                o[hh][4 * i] *= alpha[0];
                o[hh][4 * i + 1] *= alpha[0];
                o[hh][4 * i + 2] *= alpha[1];
                o[hh][4 * i + 3] *= alpha[1];
            }
    };
    // P as the A fragments of the P·V k-steps (wgmma.cuh's register layout), settled with O before the
    // fence that precedes the MMAs reading them (else ptxas injects one per MMA).
    auto pack_p = [&](const float (&s)[32], uint32_t (&pa)[4][4]) {
#pragma unroll
        for (int k2 = 0; k2 < 4; ++k2) {
            pa[k2][0] = pack_bf16(s[8 * k2], s[8 * k2 + 1]);
            pa[k2][1] = pack_bf16(s[8 * k2 + 2], s[8 * k2 + 3]);
            pa[k2][2] = pack_bf16(s[8 * k2 + 4], s[8 * k2 + 5]);
            pa[k2][3] = pack_bf16(s[8 * k2 + 6], s[8 * k2 + 7]);
        }
#pragma unroll
        for (int hh = 0; hh < NH2; ++hh) wgmma_pin(o[hh]);
#pragma unroll
        for (int k2 = 0; k2 < 4; ++k2)
#pragma unroll
            for (int i = 0; i < 4; ++i) asm volatile("" : "+r"(pa[k2][i])::"memory");
    };
    // Tile j's copies in place for every thread, and every warpgroup past the MMAs that read the
    // buffers the next copies refill.
    auto arrive = [&]() {
        cp_async_wait_group<0>();
        fence_proxy_async();
        __syncthreads();
    };

    float s[32];
    uint32_t pa[4][4];
    float alpha[2];
    if constexpr (!OVERLAP) {
#pragma unroll 1
        for (int j = 0; j < ntile_kv; ++j) {
            arrive();
            if (j + 1 < ntile_kv) {
                issue_k(j + 1, (j + 1) & 1);
                issue_v(j + 1, (j + 1) & 1);
            }
            cp_async_commit_group();
            wgmma_fence();
            issue_qk(s, j & 1);
            wgmma_wait<0>();
            wgmma_pin(s);
            softmax(s, j, alpha);
            rescale(alpha);
            pack_p(s, pa);
            wgmma_fence();
            issue_pv(pa, j & 1);
            wgmma_wait<0>();
#pragma unroll
            for (int hh = 0; hh < NH2; ++hh) wgmma_pin(o[hh]);
        }
    } else {
        // Tile 0: its S and P (O is zero: no rescale). The copy group of tile j brings K_{j+1}, V_j.
        arrive();
        if (1 < ntile_kv) issue_k(1, 1);
        issue_v(0, 0);
        cp_async_commit_group();
        wgmma_fence();
        issue_qk(s, 0);
        wgmma_wait<0>();
        wgmma_pin(s);
        softmax(s, 0, alpha);
        pack_p(s, pa);
#pragma unroll 1
        for (int j = 1; j < ntile_kv; ++j) {
            arrive();  // K_j and V_{j-1} landed; K_{j-1} (QK of tile j-1) and V_{j-2} (P·V of tile j-2) free
            if (j + 1 < ntile_kv) issue_k(j + 1, (j + 1) & 1);
            issue_v(j, j & 1);
            cp_async_commit_group();
            wgmma_fence();
            issue_qk(s, j & 1);
            issue_pv(pa, (j - 1) & 1);
            wgmma_wait<1>();  // S_j done; the P·V of tile j-1 may still run
            wgmma_pin(s);
            softmax(s, j, alpha);
            wgmma_wait<0>();
#pragma unroll
            for (int hh = 0; hh < NH2; ++hh) wgmma_pin(o[hh]);
            rescale(alpha);
            pack_p(s, pa);
        }
        arrive();  // V of the last tile
        wgmma_fence();
        issue_pv(pa, (ntile_kv - 1) & 1);
        wgmma_wait<0>();
#pragma unroll
        for (int hh = 0; hh < NH2; ++hh) wgmma_pin(o[hh]);
    }
    cp_async_wait_group<0>();

    // o = acc / l (· sigmoid(gate)) for this lane's valid rows: dims 128·hh + 8i + 2·q4 + e.
#pragma unroll
    for (int h = 0; h < 2; ++h) {
        float L2 = l[h];
        L2 += __shfl_xor_sync(0xffffffffu, L2, 1);
        L2 += __shfl_xor_sync(0xffffffffu, L2, 2);
        const int gr = r0 + 64 * wg + 16 * warp + g + 8 * h;
        if (gr >= nrows) continue;
        const long long off = pf_row_off<HD>(p, gr, G, kv);
        const float inv = 1.0f / L2;
#pragma unroll
        for (int hh = 0; hh < NH2; ++hh)
#pragma unroll
            for (int i = 0; i < 16; ++i)
                pf_store_pair(p, off, 128 * hh + 8 * i + 2 * q4, o[hh][4 * i + 2 * h] * inv, o[hh][4 * i + 2 * h + 1] * inv);
    }
}

extern "C" __global__ void __launch_bounds__(WG_THREADS, 1) attn_prefill_wg_d128(const AttnPrefillParams p) { pdl_enter(); attn_prefill_wg<128, false>(p); }
extern "C" __global__ void __launch_bounds__(WG_THREADS, 1) attn_prefill_wg_d256(const AttnPrefillParams p) { pdl_enter(); attn_prefill_wg<256, false>(p); }
extern "C" __global__ void __launch_bounds__(WG_THREADS, 1) attn_prefill_wgo_d128(const AttnPrefillParams p) { pdl_enter(); attn_prefill_wg<128, true>(p); }
extern "C" __global__ void __launch_bounds__(WG_THREADS, 1) attn_prefill_wgo_d256(const AttnPrefillParams p) { pdl_enter(); attn_prefill_wg<256, true>(p); }

// Gated DeltaNet delta rule for prefill, chunk by chunk (the WY / UT form of HF
// `torch_chunk_gated_delta_rule` and fla-org's `chunk_gated_delta_rule`), f32 state and sums: on CUDA
// cores, or on the tensor cores with tf32 products (1xTF32, the default: operands rounded to tf32; or
// 3xTF32, f32 to rounding). Same inputs, state and output as gdn_recurrent_* in gdn.cu and
// lily_cpu::gdn, the same numbers to f32 rounding (1xTF32: to ~5e-4 of the largest output).
// Layouts: qkv [T, C] after gdn_conv_qk, C = 2·Hk·Dk + Hv·Dv ordered q | k | v (head-major, q already
// l2-normed and scaled by 1/√Dk, k l2-normed); g, beta [T, Hv]; state [Hv, Dk, Dv] (S[h][i_k][j_v]);
// out [T, Hv, Dv]; value head j reads key head j / (Hv/Hk). Dk, Dv ≤ 128 (any value: slices are
// zero-padded).
//
// Per value head and chunk of n ≤ 64 tokens (local indices i, j), Γ_i = Σ_{s≤i} g_s:
//   A = strictly_lower(β_i (k_i·k_j) e^{Γ_i−Γ_j}),  X = (I + A)⁻¹ (forward substitution),
//   W = X (β e^Γ ⊙ K),  U = X (β ⊙ V),  P = lower_incl_diag((q_i·k_j) e^{Γ_i−Γ_j});
// then, sequentially over chunks, with S the state before the chunk:
//   V' = U − W S;  O = (e^Γ ⊙ Q) S + P V';  S ← e^{Γ_{n−1}} S + (e^{Γ_{n−1}−Γ} ⊙ K)ᵀ V'.
// Γ is summed in f64 so that e^{Γ_i−Γ_j} keeps its digits when Γ is large (strong decay); every
// exponent is ≤ 0 where it is used, so nothing overflows.
//
// Entry points:
//   gdn_chunk_prep: grid (chunks, Hv), 256 threads, 36 KB static shared memory, 3 blocks per SM. One
//     block per (chunk, value head): writes W, U, P and the decay vectors (e^Γ, e^{Γ_last−Γ}) to the
//     scratch. All chunks at once.
//   gdn_chunk_state_t{TW}: grid (⌈Dv/TW⌉, Hv), 16·TW threads (TW = 16: 256 threads, 2 blocks per SM;
//     TW = 32: 512 threads, 1 block per SM). One block per (value head, tile of TW state columns): the
//     state tile S [Dk, TW] stays in shared memory for all chunks; per chunk it forms V', writes O and
//     updates S. Columns of S never mix, so the tiles are independent. The global loads of the next
//     piece of work are in flight (registers) while the current one is computed.
// Scratch, per (chunk c, value head j), block b = c·Hv + j, NC = ⌈T/64⌉ chunks:
//   W [NC·Hv, 64, Dk] | U [NC·Hv, 64, Dv] | P [NC·Hv, 64, 64] | E [NC·Hv, 2, 64]
// (rows ≥ n of the last chunk are written as zeros and never read). The tensor-core prep and pass
// (gdn_chunk_prep_tc*, gdn_chunk_state_tc*) and the bf16 pair (gdn_chunk_prep_tc1_bf with
// gdn_chunk_state_bf*, whose scratch holds W, Q̃, K̃ and P in bf16) are described where they are defined.
#include <stdint.h>
#include "pdl.cuh"
#include "gdn_step.cuh"
#include "gdn_conv.cuh"
#include "stage_half.cuh"

#define GDC_CH 64    // tokens per chunk
#define GDC_MAXD 128 // largest Dk and Dv

struct GdnChunkPrepParams {
    const float* qkv;   // [T, C]
    const float* g;     // [T, Hv]
    const float* beta;  // [T, Hv]
    float* w;           // [NC·Hv, 64, Dk]
    float* u;           // [NC·Hv, 64, Dv]
    float* p;           // [NC·Hv, 64, 64]
    float* e;           // [NC·Hv, 2, 64]: e^{Γ_i}, then e^{Γ_{n-1}−Γ_i} (zeros for i ≥ n)
    uint32_t* qt;       // bf16 outputs only: e^Γ ⊙ Q [NC·Hv, 64, Dk] (bf16 pairs)
    uint32_t* kt;       // bf16 outputs only: e^{Γ_{n-1}−Γ} ⊙ K [NC·Hv, 64, Dk]
    // The prep that convolves its own inputs (gdn_chunk_prep_tc1_bf_conv) reads these instead of qkv,
    // g and beta (null for the others): the projections before the conv, the taps, the conv state
    // (read only: gdn_conv_finish advances it after the prep) and the gate inputs.
    const float* x;           // [T, C] before the conv, rows x_stride apart
    const float* conv_w;      // [C, K]
    const float* conv_state;  // [K-1, C]
    const float* a;           // [T, Hv], rows ab_stride apart
    const float* b;           // [T, Hv], rows ab_stride apart
    const float* a_log;       // [Hv]
    const float* dt_bias;     // [Hv]
    int t_len;
    int hk;
    int hv;
    int dk;
    int dv;
    int k;                    // conv taps (≤ GDC_CONV_KM; the fused prep only)
    long long x_stride;
    long long ab_stride;
};

struct GdnChunkStateParams {
    const float* qkv;  // [T, C]
    const float* w;    // scratch, as written by gdn_chunk_prep
    const float* u;
    const float* p;
    const float* e;
    float* state;  // [Hv, Dk, Dv], in place
    float* out;    // [T, Hv, Dv]
    const uint32_t* qt;  // the bf16 pass only: e^Γ ⊙ Q, e^{Γ_{n-1}−Γ} ⊙ K as written by gdn_chunk_prep_tc1_bf
    const uint32_t* kt;
    int t_len;
    int hk;
    int hv;
    int dk;
    int dv;
    int pad_;
};

extern "C" __global__ void __launch_bounds__(256, 3) gdn_chunk_prep(const GdnChunkPrepParams p) { pdl_enter();
    constexpr int KS = 33;  // row stride of the staged K and Q slices [64][32] (conflict-free columns)
    constexpr int XS = 72;  // row stride of X [64][64] (≡ 8 mod 32: see the two loops that read it)
    constexpr int AS = 65;  // row stride of A [64][64]
    __shared__ double gam[GDC_CH];                     // Γ_i (f64)
    __shared__ float bet[GDC_CH];                      // β_i (0 past n)
    __shared__ float egs[GDC_CH];                      // e^{Γ_i}
    __shared__ __align__(16) float buf[GDC_CH * XS];   // K|Q slices [64][KS] each, then X [64][XS]
    __shared__ __align__(16) float abuf[GDC_CH * AS];  // A [64][AS], then the right-hand side R [64][32]

    const int tid = threadIdx.x;
    const int chunk = blockIdx.x, j = blockIdx.y;
    const int t0 = chunk * GDC_CH;
    const int n = min(GDC_CH, p.t_len - t0);
    const int kh = j / (p.hv / p.hk);
    const int dk = p.dk, dv = p.dv;
    const long long kd = (long long)p.hk * dk;
    const long long C = 2 * kd + (long long)p.hv * dv;
    const long long blk = (long long)chunk * p.hv + j;
    const float* qkv = p.qkv + (long long)t0 * C;  // row r of the chunk at qkv + r·C

    // 1. Gates: β, Γ (f64 prefix sum), e^Γ and e^{Γ_last−Γ}.
    if (tid < GDC_CH) bet[tid] = tid < n ? p.beta[(long long)(t0 + tid) * p.hv + j] : 0.0f;
    if (tid == 0) {
        double acc = 0.0;
        for (int i = 0; i < GDC_CH; ++i) {
            if (i < n) acc += (double)p.g[(long long)(t0 + i) * p.hv + j];
            gam[i] = acc;
        }
    }
    __syncthreads();
    if (tid < GDC_CH) {
        const bool in = tid < n;
        const float eg = in ? expf((float)gam[tid]) : 0.0f;
        const float ek = in ? expf((float)(gam[n - 1] - gam[tid])) : 0.0f;
        egs[tid] = eg;
        p.e[blk * 2 * GDC_CH + tid] = eg;
        p.e[blk * 2 * GDC_CH + GDC_CH + tid] = ek;
    }

    // 2. K Kᵀ and Q Kᵀ over Dk slices of 32: thread (ti, tj) owns rows ti + 16a and columns tj + 16b
    //    (a, b < 4) of both 64×64 products.
    {
        float* ks = buf;
        float* qs = buf + GDC_CH * KS;
        const int ti = tid >> 4, tj = tid & 15;
        float kk[4][4], qk[4][4];
#pragma unroll
        for (int a = 0; a < 4; ++a)
#pragma unroll
            for (int b = 0; b < 4; ++b) kk[a][b] = qk[a][b] = 0.0f;
        for (int s = 0; s < dk; s += 32) {
            __syncthreads();  // the previous slice's reads are done
            for (int idx = tid; idx < GDC_CH * 32; idx += 256) {
                const int r = idx >> 5, d = idx & 31;
                float kv = 0.0f, qv = 0.0f;
                if (r < n && s + d < dk) {
                    const float* q = qkv + (long long)r * C + (long long)kh * dk + s + d;
                    qv = q[0];
                    kv = q[kd];
                }
                ks[r * KS + d] = kv;
                qs[r * KS + d] = qv;
            }
            __syncthreads();
#pragma unroll 4
            for (int d = 0; d < 32; ++d) {
                float kr[4], qr[4], kc[4];
#pragma unroll
                for (int a = 0; a < 4; ++a) {
                    kr[a] = ks[(ti + 16 * a) * KS + d];
                    qr[a] = qs[(ti + 16 * a) * KS + d];
                    kc[a] = ks[(tj + 16 * a) * KS + d];
                }
#pragma unroll
                for (int a = 0; a < 4; ++a)
#pragma unroll
                    for (int b = 0; b < 4; ++b) {
                        kk[a][b] = fmaf(kr[a], kc[b], kk[a][b]);
                        qk[a][b] = fmaf(qr[a], kc[b], qk[a][b]);
                    }
            }
        }
        // A (shared memory) and P (scratch), decayed; zero outside the triangles and past n.
        float* pp = p.p + blk * GDC_CH * GDC_CH;
#pragma unroll
        for (int a = 0; a < 4; ++a)
#pragma unroll
            for (int b = 0; b < 4; ++b) {
                const int r = ti + 16 * a, c = tj + 16 * b;
                float av = 0.0f, pv = 0.0f;
                if (r < n && c <= r) {
                    const float dec = expf((float)(gam[r] - gam[c]));
                    pv = qk[a][b] * dec;
                    if (c < r) av = kk[a][b] * (bet[r] * dec);
                }
                abuf[r * AS + c] = av;
                pp[r * GDC_CH + c] = pv;
            }
    }
    __syncthreads();  // A complete; the K/Q slices are no longer read

    // 3. X = (I + A)⁻¹, row by row: X_i = e_i − Σ_{j<i} A_ij X_j. Thread (col, part) sums the terms
    //    j ≡ part (mod 4) of column col; the four parts of a column are adjacent lanes. X[j][col] for the
    //    8 columns × 4 parts of a warp hits 32 distinct banks with XS ≡ 8 (mod 32).
    float* X = buf;
    {
        const int col = tid >> 2, part = tid & 3;
        if (part == 0) X[col] = col == 0 ? 1.0f : 0.0f;
        __syncthreads();
        for (int i = 1; i < GDC_CH; ++i) {
            float sum = 0.0f;
            if (i < n)
                for (int jj = part; jj < i; jj += 4) sum = fmaf(abuf[i * AS + jj], X[jj * XS + col], sum);
            sum += __shfl_xor_sync(0xffffffffu, sum, 1);
            sum += __shfl_xor_sync(0xffffffffu, sum, 2);
            if (part == 0) X[i * XS + col] = (i == col ? 1.0f : 0.0f) - sum;
            __syncthreads();
        }
    }

    // 4. W = X (β e^Γ ⊙ K) and U = X (β ⊙ V), by column slices of 32 of the right-hand side R [64][32]
    //    (staged in abuf: A is no longer read). Warp w owns rows 8w..8w+7: lane owns rows r0 and r0 + 4
    //    and 4 columns; X is lower triangular, so the sum stops at row 8w + 7 (and at n).
    {
        float* R = abuf;
        const int warp = tid >> 5, lane = tid & 31;
        const int r0 = 8 * warp + (lane >> 3), r1 = r0 + 4, c4 = 4 * (lane & 7);
        const int jend = min(8 * warp + 8, n);
        for (int pass = 0; pass < 2; ++pass) {
            const int width = pass == 0 ? dk : dv;
            const long long src = pass == 0 ? kd + (long long)kh * dk : 2 * kd + (long long)j * dv;
            float* dst = pass == 0 ? p.w + blk * GDC_CH * dk : p.u + blk * GDC_CH * dv;
            for (int s = 0; s < width; s += 32) {
                __syncthreads();  // the previous slice's reads are done
                for (int idx = tid; idx < GDC_CH * 32; idx += 256) {
                    const int r = idx >> 5, d = idx & 31;
                    float x = 0.0f;
                    if (r < n && s + d < width) {
                        const float scale = pass == 0 ? bet[r] * egs[r] : bet[r];
                        x = qkv[(long long)r * C + src + s + d] * scale;
                    }
                    R[r * 32 + d] = x;
                }
                __syncthreads();
                float acc0[4] = {0.0f, 0.0f, 0.0f, 0.0f}, acc1[4] = {0.0f, 0.0f, 0.0f, 0.0f};
                for (int jj = 0; jj < jend; ++jj) {
                    const float4 rv = *reinterpret_cast<const float4*>(&R[jj * 32 + c4]);
                    const float x0 = X[r0 * XS + jj], x1 = X[r1 * XS + jj];
                    acc0[0] = fmaf(x0, rv.x, acc0[0]);
                    acc0[1] = fmaf(x0, rv.y, acc0[1]);
                    acc0[2] = fmaf(x0, rv.z, acc0[2]);
                    acc0[3] = fmaf(x0, rv.w, acc0[3]);
                    acc1[0] = fmaf(x1, rv.x, acc1[0]);
                    acc1[1] = fmaf(x1, rv.y, acc1[1]);
                    acc1[2] = fmaf(x1, rv.z, acc1[2]);
                    acc1[3] = fmaf(x1, rv.w, acc1[3]);
                }
#pragma unroll
                for (int b = 0; b < 4; ++b) {
                    const int col = s + c4 + b;
                    if (col < width) {
                        dst[(long long)r0 * width + col] = acc0[b];
                        dst[(long long)r1 * width + col] = acc1[b];
                    }
                }
            }
        }
    }
}

// The sequential pass over chunks for one (value head, tile of TW state columns); 16·TW threads.
// Each chunk is processed as a sequence of "pieces", each 4096 floats staged in shared memory (stg):
//   A_s (s < ⌈Dk/32⌉): W and e^Γ⊙Q, columns 32s..32s+31 ([2][64][KS]); accumulate W S and (e^Γ⊙Q) S;
//                      after the last one, V' = U − W S into vp;
//   P:                 the intra-chunk attention [64][PS]; O = (e^Γ⊙Q) S + P V' is written out;
//   D_s (s < ⌈Dk/64⌉): e^{Γ_last−Γ}⊙K, columns 64s..64s+63 ([64][PS]); S rows 64s.. ← e^{Γ_last} S + Kᵀ V'.
// The global loads of the next piece (of the next chunk after the last D) are issued into registers
// before the current piece is computed, so their latency hides behind the arithmetic.
// A_s, P: thread (row, cg) owns token row `row` and tile columns 4cg..4cg+3; D_s: thread (dd, cg)
// owns state row 64s + dd and the same 4 columns.
template <int TW>
__device__ __forceinline__ void gdn_chunk_state(const GdnChunkStateParams& p) {
    constexpr int NT = 16 * TW;   // threads
    constexpr int CG = TW / 4;    // column groups of 4 (float4)
    constexpr int RPW = 32 / CG;  // token rows per warp
    constexpr int KS = 33;        // row stride of the staged W and Q slices [64][32]
    constexpr int PS = 65;        // row stride of the staged P and K slices [64][64]
    constexpr int PIECE = 2 * GDC_CH * 32;  // floats per piece (= GDC_CH * GDC_CH)
    constexpr int PER = PIECE / NT;         // of which each thread loads
    static_assert(PIECE % NT == 0 && 2 * KS >= PS, "piece layout");
    __shared__ __align__(16) float ss[GDC_MAXD * TW];    // S [Dk rounded up to 32][TW]
    __shared__ __align__(16) float vp[GDC_CH * TW];      // V' [64][TW]
    __shared__ __align__(16) float stg[2 * GDC_CH * KS];  // the current piece
    __shared__ float egs[GDC_CH], eks[GDC_CH];            // e^{Γ_i}, e^{Γ_last−Γ_i} of the chunk

    const int tid = threadIdx.x;
    const int j = blockIdx.y, c0 = blockIdx.x * TW;
    const int kh = j / (p.hv / p.hk);
    const int dk = p.dk, dv = p.dv, dk_ = p.dk;
    const int dk32 = (dk + 31) & ~31;
    const int na = dk32 / 32, nd = (dk32 + 63) / 64, npieces = na + 1 + nd;
    const long long kd = (long long)p.hk * dk;
    const long long C_ = 2 * kd + (long long)p.hv * dv;
    const long long qoff = (long long)kh * dk, koff = kd + (long long)kh * dk;
    float* S = p.state + (long long)j * dk * dv;
    const int row = tid / CG, c4 = 4 * (tid % CG);
    const int warp = tid >> 5;
    const int nc = (p.t_len + GDC_CH - 1) / GDC_CH;

    // Piece layouts, element k (< PER) of thread tid, idx = tid + k·NT:
    //   A (W|Q [2][64][32]): half = k / (PER/2), row ra + k%(PER/2)·(NT/32), column da (ra = tid/32, da = tid%32);
    //   P, D ([64][64]):     row rp + k·(NT/64), column dp (rp = tid/64, dp = tid%64).
    // Every per-k offset is then a compile-time constant times a runtime stride.
    constexpr int HALF = PER / 2, RSA = NT / 32, RSP = NT / 64;
    const int ra = tid >> 5, da = tid & 31, rp = tid >> 6, dp = tid & 63;
    float pre[PER];                    // the next piece
    float upre[4];                     // U[row, tile columns c4..c4+3] of the next chunk
    float epre0 = 0.0f, epre1 = 0.0f;  // its e^Γ, e^{Γ_last−Γ} (threads < 64)

    // Issue the loads of piece `pc` of chunk `chunk` (and, for piece 0, the chunk's U and decays).
    auto load = [&](int chunk, int pc) {
        // Hide C and Dk from loop-invariant code motion: otherwise the compiler keeps every per-k offset
        // of every piece kind live across the chunk loop (hundreds of registers).
        long long C = C_;
        int dk = dk_;
#ifdef __CUDA_ARCH__
        asm volatile("" : "+l"(C), "+r"(dk));
#endif
        const int t0 = chunk * GDC_CH;
        const int n = min(GDC_CH, p.t_len - t0);
        const long long blk = (long long)chunk * p.hv + j;
        if (pc == 0) {
            const float* u = p.u + (blk * GDC_CH + row) * dv + c0 + c4;
#pragma unroll
            for (int b = 0; b < 4; ++b) upre[b] = (row < n && c0 + c4 + b < dv) ? u[b] : 0.0f;
            if (tid < GDC_CH) {
                epre0 = p.e[blk * 2 * GDC_CH + tid];
                epre1 = p.e[blk * 2 * GDC_CH + GDC_CH + tid];
            }
        }
        if (pc < na) {
            const int s = 32 * pc;
            const bool col_in = s + da < dk;
            const float* w = p.w + (blk * GDC_CH + ra) * dk + s + da;
            const float* q = p.qkv + (long long)(t0 + ra) * C + qoff + s + da;
#pragma unroll
            for (int k = 0; k < HALF; ++k) {
                const bool in = col_in && ra + k * RSA < n;
                pre[k] = in ? w[(long long)(k * RSA) * dk] : 0.0f;
                pre[HALF + k] = in ? q[(long long)(k * RSA) * C] : 0.0f;
            }
        } else if (pc == na) {
            const float* pp = p.p + blk * GDC_CH * GDC_CH + tid;
#pragma unroll
            for (int k = 0; k < PER; ++k) {
                const int r = rp + k * RSP;
                pre[k] = (r < n && dp <= r) ? pp[k * NT] : 0.0f;
            }
        } else {
            const int s = 64 * (pc - na - 1);
            const bool col_in = s + dp < dk;
            const float* kp = p.qkv + (long long)(t0 + rp) * C + koff + s + dp;
#pragma unroll
            for (int k = 0; k < PER; ++k)
                pre[k] = (col_in && rp + k * RSP < n) ? kp[(long long)(k * RSP) * C] : 0.0f;
        }
    };

    for (int idx = tid; idx < dk32 * TW; idx += NT) {
        const int d = idx / TW, c = idx % TW;
        ss[idx] = (d < dk && c0 + c < dv) ? S[(long long)d * dv + c0 + c] : 0.0f;
    }
    if (nc > 0) load(0, 0);

    for (int chunk = 0; chunk < nc; ++chunk) {
        const int t0 = chunk * GDC_CH;
        const int n = min(GDC_CH, p.t_len - t0);
        __syncthreads();  // the previous chunk is done with egs/eks
        if (tid < GDC_CH) {
            egs[tid] = epre0;
            eks[tid] = epre1;
        }
        const float4 ucur = make_float4(upre[0], upre[1], upre[2], upre[3]);
        float av[4] = {0.0f, 0.0f, 0.0f, 0.0f}, ao[4] = {0.0f, 0.0f, 0.0f, 0.0f};

        for (int pc = 0; pc < npieces; ++pc) {
            __syncthreads();  // stg is no longer read; egs/eks are visible
            // Stage the piece: Q scaled by e^Γ, K by e^{Γ_last−Γ} (0 past n, as the loaded values).
            if (pc < na) {
#pragma unroll
                for (int k = 0; k < HALF; ++k) {
                    const int r = ra + k * RSA;
                    stg[r * KS + da] = pre[k];
                    stg[GDC_CH * KS + r * KS + da] = pre[HALF + k] * egs[r];
                }
            } else {
                const bool scale = pc > na;
#pragma unroll
                for (int k = 0; k < PER; ++k) {
                    const int r = rp + k * RSP;
                    stg[r * PS + dp] = scale ? pre[k] * eks[r] : pre[k];
                }
            }
            __syncthreads();
            if (pc + 1 < npieces) {
                load(chunk, pc + 1);
            } else if (chunk + 1 < nc) {
                load(chunk + 1, 0);
            }

            if (pc < na) {
                // A: av += (W S)[row, tile], ao += (e^Γ⊙Q) S [row, tile] over this slice of Dk.
                const int s = 32 * pc;
                const float* ws = stg;
                const float* qs = stg + GDC_CH * KS;
#pragma unroll 8
                for (int d = 0; d < 32; ++d) {
                    const float4 sv = *reinterpret_cast<const float4*>(&ss[(s + d) * TW + c4]);
                    const float wr = ws[row * KS + d], qr = qs[row * KS + d];
                    av[0] = fmaf(wr, sv.x, av[0]);
                    av[1] = fmaf(wr, sv.y, av[1]);
                    av[2] = fmaf(wr, sv.z, av[2]);
                    av[3] = fmaf(wr, sv.w, av[3]);
                    ao[0] = fmaf(qr, sv.x, ao[0]);
                    ao[1] = fmaf(qr, sv.y, ao[1]);
                    ao[2] = fmaf(qr, sv.z, ao[2]);
                    ao[3] = fmaf(qr, sv.w, ao[3]);
                }
                if (pc == na - 1) {
                    // B: V' = U − W S (zero past n and past Dv: U and W S are zero there).
                    const float4 v = row < n ? make_float4(ucur.x - av[0], ucur.y - av[1], ucur.z - av[2], ucur.w - av[3])
                                             : make_float4(0.0f, 0.0f, 0.0f, 0.0f);
                    *reinterpret_cast<float4*>(&vp[row * TW + c4]) = v;
                }
            } else if (pc == na) {
                // C: O = ao + P V' (P lower triangular: the sum stops at the warp's last row).
                const int jend = min(n, (warp + 1) * RPW);
                for (int jj = 0; jj < jend; ++jj) {
                    const float pr = stg[row * PS + jj];
                    const float4 v = *reinterpret_cast<const float4*>(&vp[jj * TW + c4]);
                    ao[0] = fmaf(pr, v.x, ao[0]);
                    ao[1] = fmaf(pr, v.y, ao[1]);
                    ao[2] = fmaf(pr, v.z, ao[2]);
                    ao[3] = fmaf(pr, v.w, ao[3]);
                }
                if (row < n) {
                    float* o = p.out + ((long long)(t0 + row) * p.hv + j) * dv;
#pragma unroll
                    for (int b = 0; b < 4; ++b)
                        if (c0 + c4 + b < dv) o[c0 + c4 + b] = ao[b];
                }
            } else {
                // D: S ← e^{Γ_last} S + (e^{Γ_last−Γ}⊙K)ᵀ V' on state rows s..s+63.
                const int s = 64 * (pc - na - 1), dd = tid / CG;
                const float elast = egs[n - 1];
                if (s + dd < dk32) {
                    float4* sp = reinterpret_cast<float4*>(&ss[(s + dd) * TW + c4]);
                    float4 a = *sp;
                    a.x *= elast;
                    a.y *= elast;
                    a.z *= elast;
                    a.w *= elast;
                    for (int r = 0; r < n; ++r) {
                        const float kr = stg[r * PS + dd];
                        const float4 v = *reinterpret_cast<const float4*>(&vp[r * TW + c4]);
                        a.x = fmaf(kr, v.x, a.x);
                        a.y = fmaf(kr, v.y, a.y);
                        a.z = fmaf(kr, v.z, a.z);
                        a.w = fmaf(kr, v.w, a.w);
                    }
                    *sp = a;
                }
            }
        }
    }

    __syncthreads();
    for (int idx = tid; idx < dk * TW; idx += NT) {
        const int d = idx / TW, c = idx % TW;
        if (c0 + c < dv) S[(long long)d * dv + c0 + c] = ss[idx];
    }
}

extern "C" __global__ void __launch_bounds__(256, 2) gdn_chunk_state_t16(const GdnChunkStateParams p) { pdl_enter();
    gdn_chunk_state<16>(p);
}
extern "C" __global__ void __launch_bounds__(512, 1) gdn_chunk_state_t32(const GdnChunkStateParams p) { pdl_enter();
    gdn_chunk_state<32>(p);
}

// ---------------------------------------------------------------------------------------------------
// The tensor-core kernels: mma.m16n8k8 with tf32 operands in the 3xTF32 form (each product as
// hi·hi + hi·lo + lo·hi of tf32 parts, good to about f32 rounding, accumulated in f32). Same inputs,
// outputs and formulas as the FFMA kernels above; Dk a multiple of 16 (≤ 128), Dv a multiple of 8.
// Shared-memory row strides (floats) keep the fragment reads conflict-free: W, Q 132 (≡ 4 mod 32:
// rows g, columns t), K 136 (≡ 8: read transposed, rows t, columns g), P 68.

#include "mma.cuh"

#define GDC_TW 32      // state columns per block
#define GDC_WS 132     // W, Q row stride
#define GDC_KS 136     // K row stride
#define GDC_PS 68      // P row stride

// ---------------------------------------------------------------------------------------------------
// gdn_chunk_prep_tc: gdn_chunk_prep with its two products on the tensor cores (mma.m16n8k8, 3xTF32):
// the same W, U, P and decays, to f32 rounding. Dk a multiple of 16 (≤ 128), Dv a multiple of 8.
// grid (chunks, Hv), 256 threads (8 warps), GDC_PREP_SMEM bytes of dynamic shared memory (2 blocks
// per SM). Per (chunk, value head):
//   1. gates as gdn_chunk_prep, the chunk's g loaded by 64 threads at once;
//   2. K Kᵀ and Q Kᵀ, lower-triangle m16n8 tiles only (20 of 32 each): warps 0–3 K Kᵀ, 4–7 Q Kᵀ; warp
//      a (mod 4) takes m-tiles {a/2, 3 − a/2} and of each the n-tiles ≡ a (mod 2), 5 tiles a warp. The
//      k index of an mma runs over Dk columns in pairs (lane t reads columns 2t, 2t+1 as one float2:
//      the sum does not depend on how k is ordered), conflict-free with row stride 136;
//   3. X = (I + A)⁻¹ by 16×16 blocks: the diagonal blocks by forward substitution with warp barriers
//      (a column's four threads are lanes of one warp, and columns do not mix), then the blocks below
//      them by distance from the diagonal (measured 21% faster a prep than the 63-row-step solve,
//      docs/PERF.md fourteenth session); V's copy in flight meanwhile;
//   4. W = X (β e^Γ ⊙ K) and U = X (β ⊙ V), as (X diag(β e^Γ)) K and (X diag(β)) V: warps 0–3 W, 4–7 U,
//      warp a (mod 4) the n-tiles 4a..4a+3 of every m-tile (X is lower triangular: m-tile i needs
//      tokens < 16(i+1)).
#define GDC_RS 136  // K, Q / V row stride
#define GDC_AS 65   // A row stride
#define GDC_XS 72   // X row stride
#define GDC_PREP_SMEM (8 * GDC_CH + 4 * (2 * GDC_CH * GDC_RS + GDC_CH * GDC_AS + GDC_CH * GDC_XS + 4 * GDC_CH))

// Column col of X = (I + A)⁻¹ (A strictly lower triangular, [64][AS]; X [64][XS]) on the rows of col's
// diagonal 16×16 block, r0 .. r0 + 15 (r0 = col rounded down to 16): X[r0][col] = δ, then row by row
// X[i][col] = δ − Σ_{r0 ≤ jj < i} A[i][jj] X[jj][col]. The column's four threads (part = 0..3 of the
// sum's terms) are lanes of one warp, and columns do not mix, so a warp barrier orders its rows. Rows
// past n (A is zero there) are the identity's.
__device__ __forceinline__ void forward_rows(const float* sA, float* sX, int col, int part, int r0, int n) {
    if (part == 0) sX[r0 * GDC_XS + col] = r0 == col ? 1.0f : 0.0f;
    __syncwarp();
    for (int i = r0 + 1; i < r0 + 16; ++i) {
        float sum = 0.0f;
        // X is lower triangular: X[jj][col] = 0 for jj < col, so the terms start at col's row of 4.
        if (i < n)
            for (int jj = (col & ~3) + part; jj < i; jj += 4) sum = fmaf(sA[i * GDC_AS + jj], sX[jj * GDC_XS + col], sum);
        sum += __shfl_xor_sync(0xffffffffu, sum, 1);
        sum += __shfl_xor_sync(0xffffffffu, sum, 2);
        if (part == 0) sX[i * GDC_XS + col] = (i == col ? 1.0f : 0.0f) - sum;
        __syncwarp();
    }
}

// The fused prep's conv (CONV): warp w convolves chunk rows 8w .. 8w + 7 of one conv head's channels,
// lane l channels 4l .. 4l + 3 (the staging's columns), from a window of xin rows held in registers:
// gdn_conv.cuh's pieces, so the staged rows are gdn_conv_qk_warp's outputs bit for bit.
#define GDC_CONV_KM 4                          // most taps the fused prep takes
#define GDC_CONV_WIN (8 + GDC_CONV_KM - 1)     // xin rows a warp's 8 tokens read

// The warp's window: xin rows t0 + 8w .. t0 + 8w + 7 + K - 1 at channel ch (zeros past the rows < n).
__device__ __forceinline__ void conv_window(const GdnChunkPrepParams& p, float4 (&xw)[GDC_CONV_WIN], long long ch, bool live, int t0, int n, int warp) {
    const long long C = 2LL * p.hk * p.dk + (long long)p.hv * p.dv;
    const int rows = min(max(n - 8 * warp, 0), 8);  // the warp's rows inside the chunk
#pragma unroll
    for (int i = 0; i < GDC_CONV_WIN; ++i)
        xw[i] = (live && i < rows + p.k - 1) ? conv_input4(p.conv_state, p.x, p.x_stride, C, t0 + 8 * warp + i, p.k - 1, ch)
                                             : make_float4(0.0f, 0.0f, 0.0f, 0.0f);
}

// The warp's 8 rows into dst [64][GDC_RS] at column 4·lane (zeros for rows ≥ n, as the copies' zero fill).
__device__ __forceinline__ void conv_rows(const float4 (&xw)[GDC_CONV_WIN], const float (&w)[4][GDC_CONV_KM], float* dst, int K, bool live, bool norm,
                                          float qscale, int n, int warp, int lane) {
#pragma unroll
    for (int i = 0; i < 8; ++i) {
        const int r = 8 * warp + i;
        const float4 y = conv_row4<GDC_CONV_KM>(w, &xw[i], K, live, norm, qscale);
        if (live) *reinterpret_cast<float4*>(&dst[r * GDC_RS + 4 * lane]) = r < n ? y : make_float4(0.0f, 0.0f, 0.0f, 0.0f);
    }
}

// The 8 rows of one conv head (first channel `base`, `width` channels) convolved into dst.
__device__ __forceinline__ void conv_stage(const GdnChunkPrepParams& p, float* dst, long long base, int width, bool norm, float qscale, int t0, int n,
                                           int warp, int lane) {
    const bool live = 4 * lane < width;
    const long long ch = base + (live ? 4 * lane : 0);
    float4 xw[GDC_CONV_WIN];
    float w[4][GDC_CONV_KM];
    conv_window(p, xw, ch, live, t0, n, warp);
    conv_taps4<GDC_CONV_KM>(w, p.conv_w, ch, p.k, live);
    conv_rows(xw, w, dst, p.k, live, norm, qscale, n, warp, lane);
}

// X's blocks below the diagonal (step 3 of the prep, after forward_rows) on the tensor cores, 3xTF32
// (each product good to ~2^-21, f32 sums; whatever NT the prep's other products take): at distance
// d = 1, 2, 3, warp w < 2(4 − d) takes the pair (c, b) = (w / 2, w / 2 + d) and X's columns
// 16c + 8(w % 2) .. + 7 of it: Y = A[b rows][16c .. 16b) · X[16c .. 16b)[those columns] (2d k-steps of
// 8), stored in the upper block (c, b) of sX as the scalar form stores it; then, after a warp barrier
// (the same warp wrote those Y columns), X_bc = −X_bb · Y (2 k-steps; X_bb's upper triangle holds
// forward_rows' zeros). One block barrier a distance instead of two. Fragments as mma.cuh's m16n8k8:
// A (g, t), (g + 8, t), (g, t + 4), (g + 8, t + 4); B (t, g), (t + 4, g); C (g, 2t), (g, 2t + 1),
// (g + 8, 2t), (g + 8, 2t + 1).
__device__ __forceinline__ void solve_blocks_mma(const float* sA, float* sX, int warp, int g, int t4) {
#pragma unroll
    for (int d = 1; d < 4; ++d) {
        __syncthreads();  // the diagonal blocks, and the blocks of distances below d, are written
        if (warp < 2 * (4 - d)) {
            const int cb = warp >> 1, bb = cb + d, half = 8 * (warp & 1), nc = 16 * cb + half;
            float big[4] = {0.0f, 0.0f, 0.0f, 0.0f}, small[4] = {0.0f, 0.0f, 0.0f, 0.0f};
            const float* ar = sA + (16 * bb + g) * GDC_AS;
#pragma unroll
            for (int kk = 0; kk < 2 * d; ++kk) {
                const int k = 16 * cb + 8 * kk;
                const Tf32A af = split_a(ar[k + t4], ar[8 * GDC_AS + k + t4], ar[k + t4 + 4], ar[8 * GDC_AS + k + t4 + 4]);
                const float* xb = sX + (k + t4) * GDC_XS + nc + g;
                mma_3xtf32(big, small, af, split_tf32(xb[0]), split_tf32(xb[4 * GDC_XS]));
            }
            float* const yu = sX + (16 * cb + g) * GDC_XS + 16 * bb + half + 2 * t4;
            yu[0] = big[0] + small[0];
            yu[1] = big[1] + small[1];
            yu[8 * GDC_XS] = big[2] + small[2];
            yu[8 * GDC_XS + 1] = big[3] + small[3];
            __syncwarp();
            float xbig[4] = {0.0f, 0.0f, 0.0f, 0.0f}, xsmall[4] = {0.0f, 0.0f, 0.0f, 0.0f};
            const float* xr = sX + (16 * bb + g) * GDC_XS + 16 * bb;
            const float* yc = sX + 16 * cb * GDC_XS + 16 * bb + half + g;
#pragma unroll
            for (int k = 0; k < 16; k += 8) {
                const Tf32A af = split_a(xr[k + t4], xr[8 * GDC_XS + k + t4], xr[k + t4 + 4], xr[8 * GDC_XS + k + t4 + 4]);
                mma_3xtf32(xbig, xsmall, af, split_tf32(yc[(k + t4) * GDC_XS]), split_tf32(yc[(k + t4 + 4) * GDC_XS]));
            }
            float* const xo = sX + (16 * bb + g) * GDC_XS + nc + 2 * t4;
            xo[0] = -(xbig[0] + xsmall[0]);
            xo[1] = -(xbig[1] + xsmall[1]);
            xo[8 * GDC_XS] = -(xbig[2] + xsmall[2]);
            xo[8 * GDC_XS + 1] = -(xbig[3] + xsmall[3]);
        }
    }
}

// The tensor-core preps' shared steps (chunk_prep_tc, chunk_prep_h16).
// 1. Gates: warp 0 loads the chunk's g, two a lane (lane l: positions 2l, 2l + 1), and scans them in
//    f64 across the warp (five shuffle steps) into Γ; warp 1 loads β (0 past n). CONV: g and β from
//    the gate inputs, as gdn_conv_finish computes them. No barrier: the caller's publishes them.
template <bool CONV>
__device__ __forceinline__ void chunk_gates(const GdnChunkPrepParams& p, double* gam, float* bet, int t0, int n, int j, int warp, int lane) {
    if (warp == 0) {
        const int i0 = 2 * lane;
        // CONV: g = −exp(A_log)·softplus(a + dt_bias), as gdn_conv_finish writes it.
        const float neg_a = CONV ? -expf(p.a_log[j]) : 0.0f;
        const auto gate = [&](int t) { return CONV ? neg_a * gdn_softplus(p.a[(long long)t * p.ab_stride + j] + p.dt_bias[j]) : p.g[(long long)t * p.hv + j]; };
        const double g0 = i0 < n ? (double)gate(t0 + i0) : 0.0;
        const double g1 = i0 + 1 < n ? (double)gate(t0 + i0 + 1) : 0.0;
        double incl = g0 + g1;
#pragma unroll
        for (int o = 1; o < 32; o <<= 1) {
            const double v = __shfl_up_sync(0xffffffffu, incl, o);
            if (lane >= o) incl += v;
        }
        double excl = __shfl_up_sync(0xffffffffu, incl, 1);
        if (lane == 0) excl = 0.0;
        gam[i0] = excl + g0;
        gam[i0 + 1] = incl;
    } else if (warp == 1) {
        for (int i = lane; i < GDC_CH; i += 32)
            bet[i] = i >= n ? 0.0f : CONV ? gdn_beta(p.b[(long long)(t0 + i) * p.ab_stride + j]) : p.beta[(long long)(t0 + i) * p.hv + j];
    }
}

// The decays from Γ and β (after a barrier): e^Γ, β e^Γ and e^{Γ_last−Γ} (0 past n) into shared memory,
// e^Γ and e^{Γ_last−Γ} into the scratch's E.
__device__ __forceinline__ void chunk_decays(const GdnChunkPrepParams& p, const double* gam, const float* bet, float* egs, float* sbe, float* eks, int n, long long blk, int tid) {
    if (tid < GDC_CH) {
        const bool in = tid < n;
        const float eg = in ? expf((float)gam[tid]) : 0.0f;
        const float ek = in ? expf((float)(gam[n - 1] - gam[tid])) : 0.0f;
        egs[tid] = eg;
        sbe[tid] = bet[tid] * eg;
        eks[tid] = ek;
        p.e[blk * 2 * GDC_CH + tid] = eg;
        p.e[blk * 2 * GDC_CH + GDC_CH + tid] = ek;
    }
}

// 2. One m16n8 tile of K Kᵀ (qk false) or Q Kᵀ (qk true), `prod` its C fragment (rows r0, r0 + 8;
//    columns c, c + 1), decayed: A = β_r (k_r·k_c) e^{Γ_r−Γ_c} strictly below the diagonal into sA, P =
//    (q_r·k_c) e^{Γ_r−Γ_c} on and below it into the scratch (bf16 with BF, else f32); 0 elsewhere and
//    past n.
template <bool BF>
__device__ __forceinline__ void store_decayed(const GdnChunkPrepParams& p, float* sA, const double* gam, const float* bet, const float (&prod)[4], bool qk,
                                              int r0, int c, int n, long long blk) {
    float* const pp = p.p + blk * GDC_CH * GDC_CH;
#pragma unroll
    for (int hr = 0; hr < 2; ++hr) {
        const int r = r0 + 8 * hr;
        float v[2];
#pragma unroll
        for (int e = 0; e < 2; ++e) {
            const int cj = c + e;
            float out = 0.0f;
            if (r < n && cj <= r) {
                const float dec = expf((float)(gam[r] - gam[cj]));
                if (qk) out = prod[2 * hr + e] * dec;
                else if (cj < r) out = prod[2 * hr + e] * (bet[r] * dec);
            }
            v[e] = out;
        }
        if (qk && BF) reinterpret_cast<uint32_t*>(p.p)[(blk * GDC_CH * GDC_CH + r * GDC_CH + c) / 2] = pack_bf16(v[0], v[1]);
        else if (qk) *reinterpret_cast<float2*>(&pp[r * GDC_CH + c]) = make_float2(v[0], v[1]);
        else {
            sA[r * GDC_AS + c] = v[0];
            sA[r * GDC_AS + c + 1] = v[1];
        }
    }
}

// P's tiles above m-tile mi's diagonal in this warp's n-tiles (ni ≡ h mod 2), rows r0 and r0 + 8: zeros
// (never read; written so the scratch holds P).
template <bool BF>
__device__ __forceinline__ void zero_p_upper(const GdnChunkPrepParams& p, int mi, int h, int r0, int t4, long long blk) {
    for (int ni = 2 * mi + 2 + h; ni < 8; ni += 2) {
        const int c = 8 * ni + 2 * t4;
        if (BF) {
            uint32_t* const pb = reinterpret_cast<uint32_t*>(p.p) + (blk * GDC_CH * GDC_CH) / 2;
            pb[(r0 * GDC_CH + c) / 2] = 0u;
            pb[((r0 + 8) * GDC_CH + c) / 2] = 0u;
        } else {
            float* const pp = p.p + blk * GDC_CH * GDC_CH;
            *reinterpret_cast<float2*>(&pp[r0 * GDC_CH + c]) = make_float2(0.0f, 0.0f);
            *reinterpret_cast<float2*>(&pp[(r0 + 8) * GDC_CH + c]) = make_float2(0.0f, 0.0f);
        }
    }
}

// MS: X's blocks below the diagonal by solve_blocks_mma instead of the scalar loops.
template <int NT, bool BF, bool CONV = false, bool MS = false>
__device__ __forceinline__ void chunk_prep_tc(const GdnChunkPrepParams& p) {
    extern __shared__ __align__(16) float sm[];
    double* const gam = reinterpret_cast<double*>(sm);           // Γ_i (f64)
    float* const sK = sm + 2 * GDC_CH;                            // K [64][RS]
    float* const sQ = sK + GDC_CH * GDC_RS;                       // Q, then V [64][RS]
    float* const sA = sQ + GDC_CH * GDC_RS;                       // A [64][AS]
    float* const sX = sA + GDC_CH * GDC_AS;                       // X [64][XS]
    float* const bet = sX + GDC_CH * GDC_XS;                      // β_i (0 past n)
    float* const egs = bet + GDC_CH;                              // e^{Γ_i}
    float* const sbe = egs + GDC_CH;                              // β_i e^{Γ_i}
    float* const eks = sbe + GDC_CH;                              // e^{Γ_last−Γ_i} (BF)

    const int tid = threadIdx.x, lane = tid & 31, warp = tid >> 5;
    const int g = lane >> 2, t4 = lane & 3;
    const int chunk = blockIdx.x, j = blockIdx.y;
    const int t0 = chunk * GDC_CH;
    const int n = min(GDC_CH, p.t_len - t0);
    const int kh = j / (p.hv / p.hk);
    const int dk = p.dk, dv = p.dv;
    const long long kd = (long long)p.hk * dk;
    const long long C = 2 * kd + (long long)p.hv * dv;
    const long long blk = (long long)chunk * p.hv + j;
    const float* qkv = p.qkv + (long long)t0 * C;  // row r of the chunk at qkv + r·C

    // K and Q of the chunk (zero past n). The staging loops give thread tid the 16-byte piece tid % 32
    // of rows tid / 32 + 8i (a row of ≤ 128 floats is ≤ 32 pieces): no division by the row length.
    const int pc4 = 4 * (lane), pr8 = warp;
    if (CONV) {  // convolved here: q (with 1/√Dk) and k of the key head, each row L2-normed
        conv_stage(p, sQ, (long long)kh * dk, dk, true, 1.0f / sqrtf((float)dk), t0, n, warp, lane);
        conv_stage(p, sK, kd + (long long)kh * dk, dk, true, 1.0f, t0, n, warp, lane);
    } else if (pc4 < dk) {
        const int c = pc4;
#pragma unroll 4
        for (int r = pr8; r < GDC_CH; r += 8) {
            const bool in = r < n;
            const float* q = in ? qkv + (long long)r * C + (long long)kh * dk + c : p.qkv;
            cp_async16z(smem_addr(sQ + r * GDC_RS + c), q, in ? 16 : 0);
            cp_async16z(smem_addr(sK + r * GDC_RS + c), in ? q + kd : p.qkv, in ? 16 : 0);
        }
    }
    cp_async_commit_group();

    // 1. Gates: β, Γ (f64 prefix sum), e^Γ and e^{Γ_last−Γ}, while the copies land.
    chunk_gates<CONV>(p, gam, bet, t0, n, j, warp, lane);
    __syncthreads();
    chunk_decays(p, gam, bet, egs, sbe, eks, n, blk, tid);
    cp_async_wait_group<0>();
    __syncthreads();

    // BF: the bf16 pass's Q̃ = e^Γ ⊙ Q and K̃ = e^{Γ_last−Γ} ⊙ K of this value head, [64][Dk] bf16 (zeros
    // past n: the decays and the staged rows are zero there).
    if (BF) {
        uint2* const qt = reinterpret_cast<uint2*>(p.qt) + blk * GDC_CH * dk / 4;
        uint2* const kt = reinterpret_cast<uint2*>(p.kt) + blk * GDC_CH * dk / 4;
        if (pc4 < dk) {
            const int c = pc4;
#pragma unroll 4
            for (int r = pr8; r < GDC_CH; r += 8) {
                const float4 q = *reinterpret_cast<const float4*>(&sQ[r * GDC_RS + c]);
                const float4 k = *reinterpret_cast<const float4*>(&sK[r * GDC_RS + c]);
                const float eq = egs[r], ek = eks[r];
                const int idx = (r * dk + c) / 4;
                qt[idx] = make_uint2(pack_bf16(q.x * eq, q.y * eq), pack_bf16(q.z * eq, q.w * eq));
                kt[idx] = make_uint2(pack_bf16(k.x * ek, k.y * ek), pack_bf16(k.z * ek, k.w * ek));
            }
        }
    }

    // 2. K Kᵀ (warps 0–3) and Q Kᵀ (4–7), decayed into A (shared) and P (scratch).
    {
        const bool qk = warp >= 4;
        const float* M = qk ? sQ : sK;
        const int a = warp & 3, h = a & 1;
#pragma unroll
        for (int pm = 0; pm < 2; ++pm) {
            const int mi = pm == 0 ? a >> 1 : 3 - (a >> 1);
            const int nt = mi + 1;  // n-tiles ni = h, h + 2, … ≤ 2mi + 1
            float big[4][4], small[4][4];
#pragma unroll
            for (int x = 0; x < 4; ++x)
#pragma unroll
                for (int e = 0; e < 4; ++e) big[x][e] = small[x][e] = 0.0f;
            const int r0 = 16 * mi + g;
            for (int k = 0; k < dk; k += 8) {
                const float2 x0 = *reinterpret_cast<const float2*>(&M[r0 * GDC_RS + k + 2 * t4]);
                const float2 x1 = *reinterpret_cast<const float2*>(&M[(r0 + 8) * GDC_RS + k + 2 * t4]);
                const Tf32A af = split_a(x0.x, x1.x, x0.y, x1.y);
#pragma unroll
                for (int x = 0; x < 4; ++x) {
                    if (x < nt) {
                        const int col = 8 * (h + 2 * x) + g;
                        const float2 y = *reinterpret_cast<const float2*>(&sK[col * GDC_RS + k + 2 * t4]);
                        mma_xtf32<NT>(big[x], small[x], af, split_tf32(y.x), split_tf32(y.y));
                    }
                }
            }
#pragma unroll
            for (int x = 0; x < 4; ++x) {
                if (x >= nt) continue;
                const float prod[4] = {big[x][0] + small[x][0], big[x][1] + small[x][1], big[x][2] + small[x][2], big[x][3] + small[x][3]};
                store_decayed<BF>(p, sA, gam, bet, prod, qk, r0, 8 * (h + 2 * x) + 2 * t4, n, blk);
            }
            if (qk) zero_p_upper<BF>(p, mi, h, r0, t4, blk);
        }
    }
    __syncthreads();  // A complete; Q is no longer read

    // V of the chunk into Q's buffer (zero past n), in flight during the solve. CONV: the window of x
    // in flight (registers), convolved after the solve.
    const bool vlive = 4 * lane < dv;
    const long long vch = 2 * kd + (long long)j * dv + (vlive ? 4 * lane : 0);
    float4 xv[GDC_CONV_WIN];
    float wv[4][GDC_CONV_KM];
    if (CONV) {
        conv_window(p, xv, vch, vlive, t0, n, warp);
        conv_taps4<GDC_CONV_KM>(wv, p.conv_w, vch, p.k, vlive);
    } else if (pc4 < dv) {
        const int c = pc4;
#pragma unroll 4
        for (int r = pr8; r < GDC_CH; r += 8) {
            const bool in = r < n;
            const float* v = in ? qkv + (long long)r * C + 2 * kd + (long long)j * dv + c : p.qkv;
            cp_async16z(smem_addr(sQ + r * GDC_RS + c), v, in ? 16 : 0);
        }
    }
    cp_async_commit_group();

    {
        // 3. X = (I + A)⁻¹ by 16×16 blocks (T = I + A, blocks T_bc; X_bc likewise): the diagonal
        //    X_bb = T_bb⁻¹, the four at once, by forward substitution (15 row steps: the 63 of a
        //    row-by-row solve were the prep's longest chain); then by distance d = b − c = 1, 2, 3:
        //    Y = Σ_{k=c}^{b−1} T_bk X_kc and X_bc = −X_bb Y. Y is kept in the upper block (c, b) of sX,
        //    which nothing reads: step 4 reads X's blocks on and below the diagonal only. f32 sums
        //    throughout (the row-by-row solve's maths, summed in another order); MS: the blocks below
        //    the diagonal on the tensor cores (solve_blocks_mma, the same maths in 3xTF32).
        forward_rows(sA, sX, tid >> 2, tid & 3, (tid >> 2) & ~15, n);
        if constexpr (MS) {
            solve_blocks_mma(sA, sX, warp, g, t4);
        } else {
            const int r = (tid >> 4) & 15, c = tid & 15;  // this thread's element of a 16×16 block
#pragma unroll 1
            for (int d = 1; d < 4; ++d) {
                __syncthreads();  // the blocks of distances below d are written
                for (int cb = 0; cb + d < 4; ++cb) {
                    const int bb = cb + d;
                    // Y[r][c] = Σ_{m = 16cb}^{16bb − 1} A[16bb + r][m] X[m][16cb + c] (rows past n: A is 0 there).
                    float y = 0.0f;
                    const float* arow = sA + (16 * bb + r) * GDC_AS;
                    for (int m = 16 * cb; m < 16 * bb; ++m) y = fmaf(arow[m], sX[m * GDC_XS + 16 * cb + c], y);
                    sX[(16 * cb + r) * GDC_XS + 16 * bb + c] = y;
                }
                __syncthreads();  // Y visible
                for (int cb = 0; cb + d < 4; ++cb) {
                    const int bb = cb + d;
                    // X[16bb + r][16cb + c] = −Σ_{m ≤ r} X_bb[r][m] Y[m][c].
                    float x = 0.0f;
                    const float* xrow = sX + (16 * bb + r) * GDC_XS + 16 * bb;
                    for (int m = 0; m <= r; ++m) x = fmaf(xrow[m], sX[(16 * cb + m) * GDC_XS + 16 * bb + c], x);
                    sX[(16 * bb + r) * GDC_XS + 16 * cb + c] = -x;
                }
            }
        }
    }
    if (CONV) conv_rows(xv, wv, sQ, p.k, vlive, false, 1.0f, n, warp, lane);
    cp_async_wait_group<0>();
    __syncthreads();  // V visible

    // 4. W = X (β e^Γ ⊙ K) (warps 0–3), U = X (β ⊙ V) (warps 4–7).
    {
        const bool is_u = warp >= 4;
        const float* R = is_u ? sQ : sK;
        const float* sc = is_u ? bet : sbe;
        const int width = is_u ? dv : dk;
        float* dst = is_u ? p.u + blk * GDC_CH * dv : p.w + blk * GDC_CH * dk;
        const int nb = 4 * (warp & 3);  // n-tiles nb..nb+3
        const int ntw = min(4, width / 8 - nb);
        if (ntw > 0) {
            for (int mi = 0; mi < 4; ++mi) {
                float big[4][4], small[4][4];
#pragma unroll
                for (int x = 0; x < 4; ++x)
#pragma unroll
                    for (int e = 0; e < 4; ++e) big[x][e] = small[x][e] = 0.0f;
                const int r0 = 16 * mi + g;
                for (int k = 0; k < 16 * (mi + 1); k += 8) {
                    // X (s ⊙ R) = (X diag(s)) R: the row scale of R goes on A's columns.
                    const float* xa = sX + r0 * GDC_XS + k + t4;
                    const float s0 = sc[k + t4], s1 = sc[k + t4 + 4];
                    const Tf32A af = split_a(xa[0] * s0, xa[8 * GDC_XS] * s0, xa[4] * s1, xa[8 * GDC_XS + 4] * s1);
#pragma unroll
                    for (int x = 0; x < 4; ++x) {
                        if (x < ntw) {
                            const float* rb = R + (k + t4) * GDC_RS + 8 * (nb + x) + g;
                            mma_xtf32<NT>(big[x], small[x], af, split_tf32(rb[0]), split_tf32(rb[4 * GDC_RS]));
                        }
                    }
                }
#pragma unroll
                for (int x = 0; x < 4; ++x) {
                    if (x >= ntw) continue;
                    const int c = 8 * (nb + x) + 2 * t4;
                    if (BF && !is_u) {  // W in bf16 (the pass's A operand); U stays f32
                        uint32_t* const wb = reinterpret_cast<uint32_t*>(p.w) + blk * GDC_CH * dk / 2;
                        wb[(r0 * dk + c) / 2] = pack_bf16(big[x][0] + small[x][0], big[x][1] + small[x][1]);
                        wb[((r0 + 8) * dk + c) / 2] = pack_bf16(big[x][2] + small[x][2], big[x][3] + small[x][3]);
                        continue;
                    }
                    *reinterpret_cast<float2*>(&dst[(long long)r0 * width + c]) =
                        make_float2(big[x][0] + small[x][0], big[x][1] + small[x][1]);
                    *reinterpret_cast<float2*>(&dst[(long long)(r0 + 8) * width + c]) =
                        make_float2(big[x][2] + small[x][2], big[x][3] + small[x][3]);
                }
            }
        }
    }
}

// The entry points: the products in 3xTF32 (to f32 rounding), or in 1xTF32 ("_tc1": each operand
// rounded to tf32, a third of the MMAs; the default since the sixth session; LILY_GDN_CHUNK=tf32x3
// keeps 3xTF32, see ops/gdn_chunked.rs).
extern "C" __global__ void __launch_bounds__(256, 2) gdn_chunk_prep_tc(const GdnChunkPrepParams p) { pdl_enter(); chunk_prep_tc<3, false>(p); }
extern "C" __global__ void __launch_bounds__(256, 2) gdn_chunk_prep_tc1(const GdnChunkPrepParams p) { pdl_enter(); chunk_prep_tc<1, false>(p); }
// The 1xTF32 prep for the bf16 pass (gdn_chunk_state_bf*): the same products, its outputs W and P in
// bf16, U and the decays in f32, and Q̃, K̃ (the decayed Q and K of the value head) in bf16.
extern "C" __global__ void __launch_bounds__(256, 2) gdn_chunk_prep_tc1_bf(const GdnChunkPrepParams p) { pdl_enter(); chunk_prep_tc<1, true>(p); }
// The same with the causal conv, SiLU, q/k norms and gates computed from the projections as it stages
// them (the CONV fields of GdnChunkPrepParams; K ≤ 4 taps, Dk and Dv ≤ 128): gdn_conv_qk_warp's and
// gdn_conv_finish's maths in their order, so its outputs are the unfused pair's bit for bit; the conv
// state is left to gdn_conv_finish (state only), launched after it.
extern "C" __global__ void __launch_bounds__(256, 2) gdn_chunk_prep_tc1_bf_conv(const GdnChunkPrepParams p) { pdl_enter(); chunk_prep_tc<1, true, true>(p); }
// The off-diagonal blocks of (I + A)⁻¹ on the tensor cores (solve_blocks_mma), opt-in
// (LILY_GDN_SOLVE=mma, ops/gdn_chunked.rs): the bf16 pair's prep, and the 3xTF32 prep (its f32-exact
// counterpart, which the tests hold to the definition at f32 tolerances).
extern "C" __global__ void __launch_bounds__(256, 2) gdn_chunk_prep_tc1_bf_ms(const GdnChunkPrepParams p) { pdl_enter(); chunk_prep_tc<1, true, false, true>(p); }
extern "C" __global__ void __launch_bounds__(256, 2) gdn_chunk_prep_tc_ms(const GdnChunkPrepParams p) { pdl_enter(); chunk_prep_tc<3, false, false, true>(p); }

// ---------------------------------------------------------------------------------------------------
// gdn_chunk_prep_h16_bf: the bf16 pair's prep — the outputs and layout of gdn_chunk_prep_tc1_bf — on
// f16 operands (opt-in, LILY_GDN_PREP=f16; docs/notes/gdn-prefill-peers.md). q, k and v are staged in
// shared memory as f16 (11 significant bits, as tf32's: tools/gdn_chunked_numerics.py puts the rule's
// error at the 1xTF32 prep's to three digits, where bf16 operands would add ~60%), so K, Q / V take
// 17 KB each instead of 35 and the block 71 KB instead of 104: three blocks an SM instead of two. K Kᵀ,
// Q Kᵀ, W and U run on mma.m16n8k16 f16 → f32 (half the MMAs of m16n8k8 tf32); the solve is the MS
// prep's (forward_rows, solve_blocks_mma). q and k are L2-normed (|x| ≤ 1); v and X are not bounded,
// so V is staged times 2^-ev and X diag(s) enters the products times 2^-ex (ev, ex from the chunk's
// largest |v| and |X| by stage_half_exponent: the largest scaled value in [2^14, 2^15), far inside
// f16's range), and W, U are multiplied back by 2^ex, 2^(ex+ev) in f32 (exact: powers of two).
// Per (chunk, value head), 256 threads (8 warps):
//   1. q and k rows into f16 (warp w rows w + 8i, lane l columns 4l..4l+3; zeros past n), two batches
//      of four rows in flight; the gates as chunk_prep_tc's; Q̃ and K̃ in bf16 from the f16 rows;
//   2. K Kᵀ (warps 0–3) and Q Kᵀ (4–7) on the same lower tiles as chunk_prep_tc (32-bit fragment loads
//      at row stride 136 halves: banks 4g + t), decayed into A and P;
//   3. v's rows loaded into registers (in flight during the solve), the solve, then one block barrier
//      for the two maxima, V into Q's buffer in f16;
//   4. W (warps 0–3) and U (4–7): A = X diag(s)·2^-ex packed to f16 from sX, B by ldmatrix.x4.trans
//      from the row-major K or V (two n-tiles a load).
#define GDC_HRS 136  // K, Q / V f16 row stride (272 bytes)
#define GDC_PREP_H16_SMEM (8 * GDC_CH + 2 * 2 * GDC_CH * GDC_HRS + 4 * (GDC_CH * GDC_AS + GDC_CH * GDC_XS + 4 * GDC_CH + 16))

__device__ __forceinline__ uint32_t lds32(const uint16_t* p) { return *reinterpret_cast<const uint32_t*>(p); }

// The four f16 at src (8 bytes) as floats.
__device__ __forceinline__ float4 load_f16x4(const uint16_t* src) {
    const uint2 h = *reinterpret_cast<const uint2*>(src);
    const float2 a = __half22float2(*reinterpret_cast<const __half2*>(&h.x)), b = __half22float2(*reinterpret_cast<const __half2*>(&h.y));
    return make_float4(a.x, a.y, b.x, b.y);
}

// Four floats as f16 at dst (8 bytes), each times `scale`.
__device__ __forceinline__ void store_f16x4(uint16_t* dst, float4 v, float scale) {
    *reinterpret_cast<uint2*>(dst) = make_uint2(pack_f16(v.x * scale, v.y * scale), pack_f16(v.z * scale, v.w * scale));
}

__device__ __forceinline__ void chunk_prep_h16(const GdnChunkPrepParams& p) {
    extern __shared__ __align__(16) float sm[];
    double* const gam = reinterpret_cast<double*>(sm);                     // Γ_i (f64)
    uint16_t* const sK = reinterpret_cast<uint16_t*>(sm + 2 * GDC_CH);     // K [64][HRS] f16
    uint16_t* const sQ = sK + GDC_CH * GDC_HRS;                            // Q, then V·2^-ev [64][HRS] f16
    float* const sA = reinterpret_cast<float*>(sQ + GDC_CH * GDC_HRS);     // A [64][AS]
    float* const sX = sA + GDC_CH * GDC_AS;                                // X [64][XS]
    float* const bet = sX + GDC_CH * GDC_XS;                               // β_i (0 past n)
    float* const egs = bet + GDC_CH;                                       // e^{Γ_i}
    float* const sbe = egs + GDC_CH;                                       // β_i e^{Γ_i}
    float* const eks = sbe + GDC_CH;                                       // e^{Γ_last−Γ_i}
    float* const red = eks + GDC_CH;                                       // [8][2] the warps' maxima

    const int tid = threadIdx.x, lane = tid & 31, warp = tid >> 5;
    const int g = lane >> 2, t4 = lane & 3;
    const int chunk = blockIdx.x, j = blockIdx.y;
    const int t0 = chunk * GDC_CH;
    const int n = min(GDC_CH, p.t_len - t0);
    const int kh = j / (p.hv / p.hk);
    const int dk = p.dk, dv = p.dv;
    const long long kd = (long long)p.hk * dk;
    const long long C = 2 * kd + (long long)p.hv * dv;
    const long long blk = (long long)chunk * p.hv + j;
    const float* qkv = p.qkv + (long long)t0 * C;  // row r of the chunk at qkv + r·C
    const float4 zero4 = make_float4(0.0f, 0.0f, 0.0f, 0.0f);

    // 1. q and k of the chunk into f16 (zeros past n).
    const bool klive = 4 * lane < dk;
#pragma unroll
    for (int b = 0; b < 2; ++b) {
        float4 vq[4], vk[4];
#pragma unroll
        for (int i = 0; i < 4; ++i) {
            const int r = warp + 8 * (4 * b + i);
            const bool in = klive && r < n;
            const float* q = qkv + (long long)r * C + (long long)kh * dk + 4 * lane;
            vq[i] = in ? *reinterpret_cast<const float4*>(q) : zero4;
            vk[i] = in ? *reinterpret_cast<const float4*>(q + kd) : zero4;
        }
#pragma unroll
        for (int i = 0; i < 4; ++i) {
            const int r = warp + 8 * (4 * b + i);
            if (klive) {
                store_f16x4(sQ + r * GDC_HRS + 4 * lane, vq[i], 1.0f);
                store_f16x4(sK + r * GDC_HRS + 4 * lane, vk[i], 1.0f);
            }
        }
    }
    // The gates and decays, as chunk_prep_tc.
    chunk_gates<false>(p, gam, bet, t0, n, j, warp, lane);
    __syncthreads();
    chunk_decays(p, gam, bet, egs, sbe, eks, n, blk, tid);
    __syncthreads();  // the decays and the f16 rows

    // Q̃ = e^Γ ⊙ Q and K̃ = e^{Γ_last−Γ} ⊙ K in bf16, [64][Dk], from the f16 rows (zeros past n).
    if (klive) {
        uint2* const qt = reinterpret_cast<uint2*>(p.qt) + blk * GDC_CH * dk / 4;
        uint2* const kt = reinterpret_cast<uint2*>(p.kt) + blk * GDC_CH * dk / 4;
#pragma unroll 4
        for (int r = warp; r < GDC_CH; r += 8) {
            const float4 q = load_f16x4(sQ + r * GDC_HRS + 4 * lane), k = load_f16x4(sK + r * GDC_HRS + 4 * lane);
            const float eq = egs[r], ek = eks[r];
            const int idx = (r * dk + 4 * lane) / 4;
            qt[idx] = make_uint2(pack_bf16(q.x * eq, q.y * eq), pack_bf16(q.z * eq, q.w * eq));
            kt[idx] = make_uint2(pack_bf16(k.x * ek, k.y * ek), pack_bf16(k.z * ek, k.w * ek));
        }
    }

    // 2. K Kᵀ (warps 0–3) and Q Kᵀ (4–7), decayed into A (shared) and P (scratch, bf16).
    {
        const bool qk = warp >= 4;
        const uint16_t* M = qk ? sQ : sK;
        const int a = warp & 3, h = a & 1;
#pragma unroll
        for (int pm = 0; pm < 2; ++pm) {
            const int mi = pm == 0 ? a >> 1 : 3 - (a >> 1);
            const int nt = mi + 1;  // n-tiles ni = h, h + 2, … ≤ 2mi + 1
            float acc[4][4];
#pragma unroll
            for (int x = 0; x < 4; ++x)
#pragma unroll
                for (int e = 0; e < 4; ++e) acc[x][e] = 0.0f;
            const int r0 = 16 * mi + g;
            for (int k = 0; k < dk; k += 16) {
                const uint16_t* ar = M + r0 * GDC_HRS + k + 2 * t4;
                const uint32_t a0 = lds32(ar), a1 = lds32(ar + 8 * GDC_HRS), a2 = lds32(ar + 8), a3 = lds32(ar + 8 * GDC_HRS + 8);
#pragma unroll
                for (int x = 0; x < 4; ++x) {
                    if (x < nt) {
                        const uint16_t* br = sK + (8 * (h + 2 * x) + g) * GDC_HRS + k + 2 * t4;
                        mma_f16(acc[x], a0, a1, a2, a3, lds32(br), lds32(br + 8));
                    }
                }
            }
#pragma unroll
            for (int x = 0; x < 4; ++x)
                if (x < nt) store_decayed<true>(p, sA, gam, bet, acc[x], qk, r0, 8 * (h + 2 * x) + 2 * t4, n, blk);
            if (qk) zero_p_upper<true>(p, mi, h, r0, t4, blk);
        }
    }
    __syncthreads();  // A complete; Q is no longer read

    // 3. v's rows in flight (registers) during the solve.
    const bool vlive = 4 * lane < dv;
    float4 vr[8];
#pragma unroll
    for (int i = 0; i < 8; ++i) {
        const int r = warp + 8 * i;
        vr[i] = vlive && r < n ? *reinterpret_cast<const float4*>(qkv + (long long)r * C + 2 * kd + (long long)j * dv + 4 * lane) : zero4;
    }
    forward_rows(sA, sX, tid >> 2, tid & 3, (tid >> 2) & ~15, n);
    solve_blocks_mma(sA, sX, warp, g, t4);
    __syncthreads();  // X complete
    // The largest |v| of the chunk and |X| on and below the diagonal (the blocks above hold the solve's Y).
    float vmax = 0.0f, xmax = 0.0f;
#pragma unroll
    for (int i = 0; i < 8; ++i) vmax = fmaxf(vmax, fmaxf(fmaxf(fabsf(vr[i].x), fabsf(vr[i].y)), fmaxf(fabsf(vr[i].z), fabsf(vr[i].w))));
    for (int e = tid; e < GDC_CH * GDC_CH; e += 256) {
        const int r = e >> 6, c = e & 63;
        if (c <= r) xmax = fmaxf(xmax, fabsf(sX[r * GDC_XS + c]));
    }
#pragma unroll
    for (int o = 16; o > 0; o >>= 1) {
        vmax = fmaxf(vmax, __shfl_xor_sync(0xffffffffu, vmax, o));
        xmax = fmaxf(xmax, __shfl_xor_sync(0xffffffffu, xmax, o));
    }
    if (lane == 0) {
        red[2 * warp] = vmax;
        red[2 * warp + 1] = xmax;
    }
    __syncthreads();
#pragma unroll
    for (int w = 0; w < 8; ++w) {
        vmax = fmaxf(vmax, red[2 * w]);
        xmax = fmaxf(xmax, red[2 * w + 1]);
    }
    const int ev = stage_half_exponent(vmax), ex = stage_half_exponent(xmax);
    if (vlive) {
        const float down = stage_pow2(-ev);
#pragma unroll
        for (int i = 0; i < 8; ++i) store_f16x4(sQ + (warp + 8 * i) * GDC_HRS + 4 * lane, vr[i], down);
    }
    __syncthreads();  // V visible

    // 4. W = X (β e^Γ ⊙ K) (warps 0–3), U = X (β ⊙ V) (warps 4–7), as (X diag(s)·2^-ex) R.
    {
        const bool is_u = warp >= 4;
        const uint16_t* R = is_u ? sQ : sK;
        const float* sc = is_u ? bet : sbe;
        const int width = is_u ? dv : dk;
        const float xdown = stage_pow2(-ex), up = stage_pow2(is_u ? ex + ev : ex);
        const int nb = 4 * (warp & 3);  // n-tiles nb..nb+3
        const int ntw = min(4, width / 8 - nb);
        // This lane's row address for ldmatrix.x4.trans: matrix lane/8 = (tokens +8 if odd, n-tile +1 if ≥ 2).
        const int lm = lane >> 3, lr = lane & 7;
        if (ntw > 0) {
            for (int mi = 0; mi < 4; ++mi) {
                float acc[4][4];
#pragma unroll
                for (int x = 0; x < 4; ++x)
#pragma unroll
                    for (int e = 0; e < 4; ++e) acc[x][e] = 0.0f;
                const int r0 = 16 * mi + g;
                for (int k = 0; k < 16 * (mi + 1); k += 16) {
                    const float* xa = sX + r0 * GDC_XS + k + 2 * t4;
                    const float s0 = sc[k + 2 * t4] * xdown, s1 = sc[k + 2 * t4 + 1] * xdown;
                    const float s2 = sc[k + 2 * t4 + 8] * xdown, s3 = sc[k + 2 * t4 + 9] * xdown;
                    const uint32_t a0 = pack_f16(xa[0] * s0, xa[1] * s1);
                    const uint32_t a1 = pack_f16(xa[8 * GDC_XS] * s0, xa[8 * GDC_XS + 1] * s1);
                    const uint32_t a2 = pack_f16(xa[8] * s2, xa[9] * s3);
                    const uint32_t a3 = pack_f16(xa[8 * GDC_XS + 8] * s2, xa[8 * GDC_XS + 9] * s3);
#pragma unroll
                    for (int xp = 0; xp < 2; ++xp) {
                        if (2 * xp < ntw) {
                            uint32_t b0, b1, b2, b3;
                            ldmatrix_x4_trans(smem_addr(R + (k + 8 * (lm & 1) + lr) * GDC_HRS + 8 * (nb + 2 * xp + (lm >> 1))), b0, b1, b2, b3);
                            mma_f16(acc[2 * xp], a0, a1, a2, a3, b0, b1);
                            if (2 * xp + 1 < ntw) mma_f16(acc[2 * xp + 1], a0, a1, a2, a3, b2, b3);
                        }
                    }
                }
#pragma unroll
                for (int x = 0; x < 4; ++x) {
                    if (x >= ntw) continue;
                    const int c = 8 * (nb + x) + 2 * t4;
                    if (!is_u) {  // W in bf16 (the pass's A operand)
                        uint32_t* const wb = reinterpret_cast<uint32_t*>(p.w) + blk * GDC_CH * dk / 2;
                        wb[(r0 * dk + c) / 2] = pack_bf16(acc[x][0] * up, acc[x][1] * up);
                        wb[((r0 + 8) * dk + c) / 2] = pack_bf16(acc[x][2] * up, acc[x][3] * up);
                    } else {  // U in f32
                        float* const u = p.u + blk * GDC_CH * dv;
                        *reinterpret_cast<float2*>(&u[(long long)r0 * dv + c]) = make_float2(acc[x][0] * up, acc[x][1] * up);
                        *reinterpret_cast<float2*>(&u[(long long)(r0 + 8) * dv + c]) = make_float2(acc[x][2] * up, acc[x][3] * up);
                    }
                }
            }
        }
    }
}
extern "C" __global__ void __launch_bounds__(256, 3) gdn_chunk_prep_h16_bf(const GdnChunkPrepParams p) { pdl_enter(); chunk_prep_h16(p); }

// ---------------------------------------------------------------------------------------------------
// gdn_chunk_state_tc: the sequential pass on the tensor cores. grid (⌈Dv/32⌉, Hv), 512 threads (16
// warps), 1 block per SM, GDC_TC_SMEM bytes of dynamic shared memory (223 KB). One block per (value
// head, 32 state columns). Warps 0–7 ("state warps") compute V' = U − W S and then S ← e^{Γ_last} S +
// (e^{Γ_last−Γ} ⊙ K)ᵀ V'; warps 8–15 ("output warps") compute O = e^Γ ⊙ (Q S) and then O += P V', at
// the same time as the state update. In step 1 warp w (mod 8) takes token rows 16(w/2).. and columns
// 16(w%2).. (two n8 tiles); in the update state warp w holds state rows 16w.. and all 32 columns in
// its accumulators. S and V' are written to shared memory once, as (hi, lo) tf32 pairs (8 bytes an
// element, row stride 36 pairs: a fragment load is one 8-byte load a lane, conflict-free); the A
// operands are split where they are loaded. Copies (cp.async, 16 bytes, zero-filled past the chunk):
// W, Q and the decays (two buffers) of chunk c+1 once step 1 of chunk c is done with W and Q; P and K
// (two buffers each) at the start of chunk c−1; U into the state warps' registers with W.
//
// gdn_chunk_state_tc1_ldsmb (the default since the fourteenth session): the 1xTF32 pass with its
// shared loads by ldmatrix. The A fragments of steps 1 and 2 (W or Q, and P: row-major [token][k]) are
// one ldmatrix.x4 a k-step instead of four 32-bit shared loads (a 32-bit element is a pair of b16, so
// matrix i's lane (g, t4) gets word t4 of row g: a0..a3 exactly; row strides of 528 and 272 bytes keep
// the eight rows of each matrix on distinct banks). S and V' are kept as single tf32 words (1xTF32
// reads only the high part of the pairs) and transposed, S^T [32 columns][128, stride 132] and V'^T
// [32][64, stride 68], so that their B fragments are ldmatrix rows as well: b0, b1 of n-tile x at
// k-step k are words k + t4 and k + 4 + t4 of row 8x + g, one ldmatrix.x4 for two n-tiles (four 32-bit
// loads before). Step 1's shared instructions a k-step 8 → 2, step 2's likewise, step 3's B 8 → 2 (its
// A, K read transposed, stays four loads); the writes of V' and S become 32-bit stores (transposed).
// 29 KB less shared memory. The same values in the same registers: the same bits as _tc1. Why: ncu
// (H100, T = 4096) put a third of _tc1's stall samples on shared loads, MIO throttle first among the
// stall reasons; measured on an H200 (docs/PERF.md, fourteenth session) 351 → 295 µs a layer. The A
// fragments alone by ldmatrix gained nothing (352 µs: the same shared wavefronts in fewer instructions).
#define GDC_S2 36  // row stride of S and V' in (hi, lo) pairs
#define GDC_ST 132 // S^T row stride (words; ≡ 4 mod 32: ldmatrix rows on distinct banks)
#define GDC_VT 68  // V'^T row stride
#define GDC_TC_SMEM (4 * (2 * GDC_CH * GDC_WS + 2 * GDC_CH * GDC_KS + 2 * GDC_CH * GDC_PS + 4 * GDC_CH) + 8 * (GDC_MAXD + GDC_CH) * GDC_S2)

// A state warp's rows of the state tile as C fragments (rows ms + g and ms + g + 8, columns
// c0 + 8x + 2t4 and + 1, x < NX), from and to the state S [Dk, Dv] in global memory: zero (and not
// stored) where !in or past Dv. Both tensor-core passes.
template <int NX>
__device__ __forceinline__ void load_state_rows(float (&sacc)[NX][4], const float* S, int ms, int g, int t4, int c0, int dv, bool in) {
#pragma unroll
    for (int x = 0; x < NX; ++x) {
        const int col = c0 + 8 * x + 2 * t4;
        const bool ok = in && col < dv;
        sacc[x][0] = ok ? S[(long long)(ms + g) * dv + col] : 0.0f;
        sacc[x][1] = ok ? S[(long long)(ms + g) * dv + col + 1] : 0.0f;
        sacc[x][2] = ok ? S[(long long)(ms + g + 8) * dv + col] : 0.0f;
        sacc[x][3] = ok ? S[(long long)(ms + g + 8) * dv + col + 1] : 0.0f;
    }
}
template <int NX>
__device__ __forceinline__ void store_state_rows(const float (&sacc)[NX][4], float* S, int ms, int g, int t4, int c0, int dv) {
#pragma unroll
    for (int x = 0; x < NX; ++x) {
        const int col = c0 + 8 * x + 2 * t4;
        if (col >= dv) continue;
        *reinterpret_cast<float2*>(&S[(long long)(ms + g) * dv + col]) = make_float2(sacc[x][0], sacc[x][1]);
        *reinterpret_cast<float2*>(&S[(long long)(ms + g + 8) * dv + col]) = make_float2(sacc[x][2], sacc[x][3]);
    }
}

// TB: c0 += a·b0 and c1 += a·b1 in 1xTF32 for two n-tiles whose B fragments (tf32 words, transposed:
// rows = columns of B) one ldmatrix.x4 loads from `addr` (this lane's row address, see b_row below).
__device__ __forceinline__ void mma_two_ntiles_ldsm(float (&c0)[4], float (&c1)[4], const Tf32A& a, uint32_t addr) {
    uint32_t b00, b01, b10, b11;
    ldmatrix_x4(addr, b00, b01, b10, b11);
    mma_tf32(c0, a.hi[0], a.hi[1], a.hi[2], a.hi[3], b00, b01);
    mma_tf32(c1, a.hi[0], a.hi[1], a.hi[2], a.hi[3], b10, b11);
}

template <int NT, bool TB>
__device__ __forceinline__ void chunk_state_tc(const GdnChunkStateParams& p) {
    static_assert(!TB || NT == 1, "the transposed single-word S and V' are the 1xTF32 ldmatrix form's");
    extern __shared__ __align__(16) float sm[];
    float* const sW = sm;                            // [64][WS]
    float* const sQ = sW + GDC_CH * GDC_WS;          // [64][WS]
    float* const sK = sQ + GDC_CH * GDC_WS;          // [2][64][KS]
    float* const sP = sK + 2 * GDC_CH * GDC_KS;      // [2][64][PS]
    float* const sE = sP + 2 * GDC_CH * GDC_PS;      // [2][e^Γ 64 | e^{Γ_last−Γ} 64]
    uint2* const sS = reinterpret_cast<uint2*>(sE + 4 * GDC_CH);  // S [128][S2] (hi, lo)
    uint2* const sV = sS + GDC_MAXD * GDC_S2;                     // V' [64][S2] (hi, lo)
    uint32_t* const sST = reinterpret_cast<uint32_t*>(sE + 4 * GDC_CH);  // TB: S^T [32][ST] tf32 words
    uint32_t* const sVT = sST + GDC_TW * GDC_ST;                          // TB: V'^T [32][VT]

    const int tid = threadIdx.x, lane = tid & 31, warp = tid >> 5;
    const int g = lane >> 2, t4 = lane & 3;
    const bool out_warp = warp >= 8;
    const int w8 = warp & 7;
    const int j = blockIdx.y, c0 = blockIdx.x * GDC_TW;
    const int kh = j / (p.hv / p.hk);
    const int dk = p.dk, dv = p.dv;
    const long long kd = (long long)p.hk * dk;
    const long long C = 2 * kd + (long long)p.hv * dv;
    const long long qoff = (long long)kh * dk, koff = kd + (long long)kh * dk;
    const int nc = (p.t_len + GDC_CH - 1) / GDC_CH;
    const int piece = 4 * (tid & 31), prow = tid >> 5;  // W, Q, K copies: row prow + 16i, floats piece..
    const bool piece_in = piece < dk;

    // Step 1 tile: token rows r0 = 16mi + g, r1 = r0 + 8; columns cb + 8x + 2t4 (+1), x < 2.
    const int mi = w8 >> 1, cb = 16 * (w8 & 1);
    const int r0 = 16 * mi + g, r1 = r0 + 8;
    float upre[2][4];  // state warps: U of the next chunk at their step-1 elements

    auto issue_a = [&](int chunk) {
        const int t0 = chunk * GDC_CH, n = min(GDC_CH, p.t_len - t0);
        const long long blk = (long long)chunk * p.hv + j;
        if (piece_in) {
#pragma unroll
            for (int i = 0; i < 4; ++i) {
                const int r = prow + 16 * i;
                cp_async16z(smem_addr(sW + r * GDC_WS + piece), p.w + (blk * GDC_CH + r) * dk + piece, 16);
                const bool in = r < n;
                const float* q = in ? p.qkv + (long long)(t0 + r) * C + qoff + piece : p.qkv;
                cp_async16z(smem_addr(sQ + r * GDC_WS + piece), q, in ? 16 : 0);
            }
        }
        if (tid < 2 * GDC_CH / 4)
            cp_async16z(smem_addr(sE + (chunk & 1) * 2 * GDC_CH + 4 * tid), p.e + blk * 2 * GDC_CH + 4 * tid, 16);
        if (!out_warp) {
#pragma unroll
            for (int x = 0; x < 2; ++x) {
                const int col = c0 + cb + 8 * x + 2 * t4;
                const bool in = col < dv;
                const float* u = p.u + blk * GDC_CH * dv + col;
                upre[x][0] = in ? u[(long long)r0 * dv] : 0.0f;
                upre[x][1] = in ? u[(long long)r0 * dv + 1] : 0.0f;
                upre[x][2] = in ? u[(long long)r1 * dv] : 0.0f;
                upre[x][3] = in ? u[(long long)r1 * dv + 1] : 0.0f;
            }
        }
    };
    auto issue_b = [&](int chunk) {
        const int t0 = chunk * GDC_CH, n = min(GDC_CH, p.t_len - t0);
        const long long blk = (long long)chunk * p.hv + j;
        float* const kb = sK + (chunk & 1) * GDC_CH * GDC_KS;
        float* const pb = sP + (chunk & 1) * GDC_CH * GDC_PS;
        if (piece_in) {
#pragma unroll
            for (int i = 0; i < 4; ++i) {
                const int r = prow + 16 * i;
                const bool in = r < n;
                const float* k = in ? p.qkv + (long long)(t0 + r) * C + koff + piece : p.qkv;
                cp_async16z(smem_addr(kb + r * GDC_KS + piece), k, in ? 16 : 0);
            }
        }
        const int pr = tid >> 4, pc = 4 * (tid & 15);
#pragma unroll
        for (int i = 0; i < 2; ++i) {
            const int r = pr + 32 * i;
            cp_async16z(smem_addr(pb + r * GDC_PS + pc), p.p + (blk * GDC_CH + r) * GDC_CH + pc, 16);
        }
    };

    // The state tile (zero past Dk and Dv): split into sS; state warp w keeps rows 16w.. in registers.
    float* const S = p.state + (long long)j * dk * dv;
    for (int idx = tid; idx < GDC_MAXD * GDC_TW / 2; idx += 512) {
        const int d = idx / (GDC_TW / 2), c = 2 * (idx % (GDC_TW / 2));
        const bool in = d < dk && c0 + c < dv;
        const float a = in ? S[(long long)d * dv + c0 + c] : 0.0f;
        const float b = in ? S[(long long)d * dv + c0 + c + 1] : 0.0f;
        if (TB) {
            sST[c * GDC_ST + d] = tf32_bits(a);
            sST[(c + 1) * GDC_ST + d] = tf32_bits(b);
        } else {
            *reinterpret_cast<uint4*>(&sS[d * GDC_S2 + c]) = split_pair(a, b);
        }
    }
    // TB: lane l's ldmatrix row of B fragments: row (8·(l/16) + l%8) of a pair of n-tiles, words
    // 4·(l/8 % 2).. of the k-step (matrices: b0 and b1 of the first n-tile, then of the second).
    const int b_row = (lane & 7) + 8 * (lane >> 4), b_word = 4 * ((lane >> 3) & 1);
    const int ms = 16 * w8;        // state warps: state rows ms + g, ms + g + 8
    const bool ms_in = ms < dk;
    float sacc[4][4];              // ... columns 8x + 2t4 (+1), x < 4
    load_state_rows(sacc, S, ms, g, t4, c0, dv, !out_warp && ms_in);
    if (nc > 0) {
        issue_a(0);
        cp_async_commit_group();
        issue_b(0);
        cp_async_commit_group();
    }

    for (int chunk = 0; chunk < nc; ++chunk) {
        const int t0 = chunk * GDC_CH, n = min(GDC_CH, p.t_len - t0);
        const float* E = sE + (chunk & 1) * 2 * GDC_CH;
        cp_async_wait_group<0>();
        __syncthreads();  // this chunk's copies and S are visible; V' is free
        if (chunk + 1 < nc) issue_b(chunk + 1);
        cp_async_commit_group();

        // 1. (W or Q) S over Dk, for two n8 tiles.
        float big[2][4], small[2][4];
#pragma unroll
        for (int x = 0; x < 2; ++x)
#pragma unroll
            for (int e = 0; e < 4; ++e) big[x][e] = small[x][e] = 0.0f;
        {
            const float* a = (out_warp ? sQ : sW) + r0 * GDC_WS + t4;
            // TB: lane l addresses row 16mi + l%8 + 8·(l/8 % 2), words 4·(l/16).. of the k-step.
            const uint32_t a_lds = smem_addr((out_warp ? sQ : sW) + (16 * mi + (lane & 7) + 8 * ((lane >> 3) & 1)) * GDC_WS + 4 * (lane >> 4));
            const uint2* b = sS + t4 * GDC_S2 + cb + g;
            const uint32_t b_lds = smem_addr(sST + (cb + b_row) * GDC_ST + b_word);
#pragma unroll 4
            for (int k = 0; k < dk; k += 8) {
                const Tf32A af = TB ? ldsm_a(a_lds + 4 * k) : split_a(a[k], a[k + 8 * GDC_WS], a[k + 4], a[k + 8 * GDC_WS + 4]);
                if (TB) {
                    mma_two_ntiles_ldsm(big[0], big[1], af, b_lds + 4 * k);
                } else {
#pragma unroll
                    for (int x = 0; x < 2; ++x)
                        mma_xtf32<NT>(big[x], small[x], af, b[k * GDC_S2 + 8 * x], b[(k + 4) * GDC_S2 + 8 * x]);
                }
            }
        }
        float o[2][4];
        if (out_warp) {
            const float eg0 = E[r0], eg1 = E[r1];
#pragma unroll
            for (int x = 0; x < 2; ++x) {
                o[x][0] = (big[x][0] + small[x][0]) * eg0;
                o[x][1] = (big[x][1] + small[x][1]) * eg0;
                o[x][2] = (big[x][2] + small[x][2]) * eg1;
                o[x][3] = (big[x][3] + small[x][3]) * eg1;
            }
        } else {
            // V' = U − W S (zero past n: U and W are zero there), stored split.
#pragma unroll
            for (int x = 0; x < 2; ++x) {
                const int col = cb + 8 * x + 2 * t4;
                if (TB) {
                    sVT[col * GDC_VT + r0] = tf32_bits(upre[x][0] - (big[x][0] + small[x][0]));
                    sVT[(col + 1) * GDC_VT + r0] = tf32_bits(upre[x][1] - (big[x][1] + small[x][1]));
                    sVT[col * GDC_VT + r1] = tf32_bits(upre[x][2] - (big[x][2] + small[x][2]));
                    sVT[(col + 1) * GDC_VT + r1] = tf32_bits(upre[x][3] - (big[x][3] + small[x][3]));
                } else {
                    *reinterpret_cast<uint4*>(&sV[r0 * GDC_S2 + col]) =
                        split_pair(upre[x][0] - (big[x][0] + small[x][0]), upre[x][1] - (big[x][1] + small[x][1]));
                    *reinterpret_cast<uint4*>(&sV[r1 * GDC_S2 + col]) =
                        split_pair(upre[x][2] - (big[x][2] + small[x][2]), upre[x][3] - (big[x][3] + small[x][3]));
                }
            }
        }
        __syncthreads();  // V' visible; W, Q free; S read
        if (chunk + 1 < nc) issue_a(chunk + 1);
        cp_async_commit_group();

        if (out_warp) {
            // 2. O += P V' over the tokens up to the tile's last row, then written out.
            const float* P = sP + (chunk & 1) * GDC_CH * GDC_PS + r0 * GDC_PS + t4;
            const uint32_t p_lds = smem_addr(sP + (chunk & 1) * GDC_CH * GDC_PS + (16 * mi + (lane & 7) + 8 * ((lane >> 3) & 1)) * GDC_PS + 4 * (lane >> 4));
            const uint2* b = sV + t4 * GDC_S2 + cb + g;
            const uint32_t v_lds = smem_addr(sVT + (cb + b_row) * GDC_VT + b_word);
            float os[2][4];
#pragma unroll
            for (int x = 0; x < 2; ++x)
#pragma unroll
                for (int e = 0; e < 4; ++e) os[x][e] = 0.0f;
            for (int k = 0; k < 16 * (mi + 1); k += 8) {
                const Tf32A af = TB ? ldsm_a(p_lds + 4 * k) : split_a(P[k], P[k + 8 * GDC_PS], P[k + 4], P[k + 8 * GDC_PS + 4]);
                if (TB) {
                    mma_two_ntiles_ldsm(o[0], o[1], af, v_lds + 4 * k);
                } else {
#pragma unroll
                    for (int x = 0; x < 2; ++x) mma_xtf32<NT>(o[x], os[x], af, b[k * GDC_S2 + 8 * x], b[(k + 4) * GDC_S2 + 8 * x]);
                }
            }
#pragma unroll
            for (int x = 0; x < 2; ++x) {
                const int col = c0 + cb + 8 * x + 2 * t4;
                if (col >= dv) continue;
                if (r0 < n)
                    *reinterpret_cast<float2*>(&p.out[((long long)(t0 + r0) * p.hv + j) * dv + col]) =
                        make_float2(o[x][0] + os[x][0], o[x][1] + os[x][1]);
                if (r1 < n)
                    *reinterpret_cast<float2*>(&p.out[((long long)(t0 + r1) * p.hv + j) * dv + col]) =
                        make_float2(o[x][2] + os[x][2], o[x][3] + os[x][3]);
            }
        } else if (ms_in) {
            // 3. S ← e^{Γ_last} S + (e^{Γ_last−Γ} ⊙ K)ᵀ V'; A read transposed from K [64][KS].
            const float elast = E[n - 1];
            const float* K = sK + (chunk & 1) * GDC_CH * GDC_KS + t4 * GDC_KS + ms + g;
            const float* ek = E + GDC_CH + t4;
            const uint2* b = sV + t4 * GDC_S2 + g;
            const uint32_t v_lds = smem_addr(sVT + b_row * GDC_VT + b_word);  // n-tiles 2h, 2h + 1: + 16h rows
            // ΔS in fresh accumulators, then S = e^{Γ_last} S + ΔS in f32 FMAs: the tensor cores' adds do
            // not round to nearest, and S would pass through them (and their bias) at every chunk.
            float ds[4][4];
#pragma unroll
            for (int x = 0; x < 4; ++x)
#pragma unroll
                for (int e = 0; e < 4; ++e) ds[x][e] = 0.0f;
            for (int k = 0; k < n; k += 8) {
                const float e0 = ek[k], e1 = ek[k + 4];
                const float* ka = K + k * GDC_KS;
                const Tf32A af = split_a(ka[0] * e0, ka[8] * e0, ka[4 * GDC_KS] * e1, ka[4 * GDC_KS + 8] * e1);
                if (TB) {
#pragma unroll
                    for (int h = 0; h < 2; ++h) mma_two_ntiles_ldsm(ds[2 * h], ds[2 * h + 1], af, v_lds + 4 * (16 * h * GDC_VT + k));
                } else {
#pragma unroll
                    for (int x = 0; x < 4; ++x) mma_xtf32<NT>(ds[x], ds[x], af, b[k * GDC_S2 + 8 * x], b[(k + 4) * GDC_S2 + 8 * x]);
                }
            }
#pragma unroll
            for (int x = 0; x < 4; ++x) {
#pragma unroll
                for (int e = 0; e < 4; ++e) sacc[x][e] = fmaf(sacc[x][e], elast, ds[x][e]);
                const int col = 8 * x + 2 * t4;
                if (TB) {
                    sST[col * GDC_ST + ms + g] = tf32_bits(sacc[x][0]);
                    sST[(col + 1) * GDC_ST + ms + g] = tf32_bits(sacc[x][1]);
                    sST[col * GDC_ST + ms + g + 8] = tf32_bits(sacc[x][2]);
                    sST[(col + 1) * GDC_ST + ms + g + 8] = tf32_bits(sacc[x][3]);
                } else {
                    *reinterpret_cast<uint4*>(&sS[(ms + g) * GDC_S2 + col]) = split_pair(sacc[x][0], sacc[x][1]);
                    *reinterpret_cast<uint4*>(&sS[(ms + g + 8) * GDC_S2 + col]) = split_pair(sacc[x][2], sacc[x][3]);
                }
            }
        }
    }

    // The final state tile.
    if (!out_warp && ms_in) store_state_rows(sacc, S, ms, g, t4, c0, dv);
}

extern "C" __global__ void __launch_bounds__(512, 1) gdn_chunk_state_tc(const GdnChunkStateParams p) { pdl_enter(); chunk_state_tc<3, false>(p); }
extern "C" __global__ void __launch_bounds__(512, 1) gdn_chunk_state_tc1(const GdnChunkStateParams p) { pdl_enter(); chunk_state_tc<1, false>(p); }
extern "C" __global__ void __launch_bounds__(512, 1) gdn_chunk_state_tc1_ldsmb(const GdnChunkStateParams p) { pdl_enter(); chunk_state_tc<1, true>(p); }

// ---------------------------------------------------------------------------------------------------
// gdn_chunk_state_bf{32,32s3,32s3l}: the sequential pass with bf16 operands (as fla-org's chunk kernels
// and every peer run this rule): mma.m16n8k16 bf16 × bf16 → f32, the state carried in f32 registers
// and its bf16 copy S^T the products' B operand. Reads what gdn_chunk_prep_tc1_bf writes: W, Q̃ = e^Γ ⊙ Q,
// K̃ = e^{Γ_last−Γ} ⊙ K and P in bf16; U and the decays in f32. Per chunk (S the state before it):
//   V' = U − W S (f32, kept as bf16 V'^T);  O = Q̃ S + P V';  S ← e^{Γ_last} S + K̃ᵀ V' (f32 FMAs).
// grid (⌈Dv/32⌉, Hv), 512 threads (16 warps), 1 block per SM, GDC_BF_SMEM(32, NSTG) bytes of dynamic
// shared memory. Warps 0–7 (state warps) compute V' (warp w: tokens 16(w/2).., columns (w%2)·BV/2..)
// and then the update (state rows 16w.., all BV columns); warps 8–15 (output warps) compute Q̃ S on the
// same tiles as V', then P V'. Every fragment is one ldmatrix.x4 (K̃ᵀ's by the transposing form). A
// chunk's operands are one stage of an NSTG-deep ring (16-byte cp.async, issued NSTG − 1 chunks ahead),
// so the copies have NSTG − 1 whole chunks to land: issued by every thread after a chunk's first barrier
// (bf32, NSTG = 2; bf32s3, NSTG = 3), or by the output warps alone at the end of their chunk (bf32s3l:
// off the state warps' chain, which then runs barrier → V' → barrier → update → barrier only). A
// 64-column form (BV = 64, each chunk's operands read from L2 half as often) measured 18% slower
// than bf32 (docs/PERF.md, twenty-first session) and was removed: the pass is not bound by L2. Row
// strides: 136 bf16 (272 bytes) for W, Q̃, K̃ and S^T, 72 (144 bytes) for P and V'^T — ldmatrix's eight
// rows on distinct banks; U BV + 8 floats. W S and Q̃ S alternate their k-steps between two sets of
// accumulators (two dependent chains of Dk/32 MMAs), summed at the end.
// Numerics (docs/PERF.md, twenty-first session): in a float64 emulation of these roundings the output
// is 2.3e-3–3.8e-3 (rms, relative) from the exact rule at T = 1000–2048, where rounding q, k, v to bf16
// and running the f32 recurrence (MLX-LM's bf16 run) puts it 2.7e-3–3.1e-3.
#define GDC_BRS 136  // W, Q̃, K̃, S^T row stride (bf16)
#define GDC_BPS 72   // P, V'^T row stride (bf16)
#define GDC_BF_STAGE(BV) (2 * 3 * GDC_CH * GDC_BRS + 2 * GDC_CH * GDC_BPS + 4 * GDC_CH * ((BV) + 8) + 4 * 2 * GDC_CH)
#define GDC_BF_SMEM(BV, NSTG) ((NSTG) * GDC_BF_STAGE(BV) + 2 * (BV) * GDC_BRS + 2 * (BV) * GDC_BPS)

// c[2q], c[2q + 1] += A · B for NP pairs of n8 tiles: A's fragment a0..a3 (one k16 step), pair q's
// B fragments (b0, b1 of both tiles) by one ldmatrix.x4 from b_addr + q·b_step.
template <int NP>
__device__ __forceinline__ void mma_ntile_pairs(float (&c)[2 * NP][4], uint32_t a0, uint32_t a1, uint32_t a2, uint32_t a3,
                                                uint32_t b_addr, uint32_t b_step) {
#pragma unroll
    for (int q = 0; q < NP; ++q) {
        uint32_t b0, b1, b2, b3;
        ldmatrix_x4(b_addr + q * b_step, b0, b1, b2, b3);
        mma_bf16(c[2 * q], a0, a1, a2, a3, b0, b1);
        mma_bf16(c[2 * q + 1], a0, a1, a2, a3, b2, b3);
    }
}

template <int BV, int NSTG, bool LATE>
__device__ __forceinline__ void chunk_state_bf(const GdnChunkStateParams& p) {
    static_assert(!LATE || NSTG >= 3, "copies issued at a chunk's end need a stage more to stay a chunk ahead");
    constexpr int NTW = BV / 16;   // n8 tiles of a V' / O tile (BV/2 columns)
    constexpr int NTK = BV / 8;    // n8 tiles of a state-update tile (BV columns)
    constexpr int US = BV + 8;     // U row stride (floats)
    extern __shared__ __align__(16) unsigned char smb[];
    uint16_t* const sST = reinterpret_cast<uint16_t*>(smb + NSTG * GDC_BF_STAGE(BV));  // S^T [BV][BRS]
    uint16_t* const sVT = sST + BV * GDC_BRS;                                             // V'^T [BV][BPS]
    // Stage s: W | Q̃ | K̃ [64][BRS] bf16, P [64][BPS] bf16, U [64][US] f32, E [2][64] f32.
    auto stage_w = [&](int s) { return reinterpret_cast<uint16_t*>(smb + s * GDC_BF_STAGE(BV)); };
    auto stage_p = [&](int s) { return stage_w(s) + 3 * GDC_CH * GDC_BRS; };
    auto stage_u = [&](int s) { return reinterpret_cast<float*>(stage_p(s) + GDC_CH * GDC_BPS); };
    auto stage_e = [&](int s) { return stage_u(s) + GDC_CH * US; };

    const int tid = threadIdx.x, lane = tid & 31, warp = tid >> 5;
    const int g = lane >> 2, t4 = lane & 3;
    const bool out_warp = warp >= 8;
    const int w8 = warp & 7;
    const int j = blockIdx.y, c0 = blockIdx.x * BV;
    const int dk = p.dk, dv = p.dv;
    const int nc = (p.t_len + GDC_CH - 1) / GDC_CH;

    // The copies of chunk c into stage c % NSTG (rows past the chunk are zeros in the scratch), by NCP
    // threads (ct = this thread's index among them): a [Dk] bf16 row is ≤ 16 pieces of 16 bytes, thread
    // ct takes piece ct % 16 of rows ct / 16 + (NCP / 16)·i; P's rows are 8 pieces, U's BV / 4.
    constexpr int NCP = LATE ? 256 : 512;
    auto issue = [&](int chunk, int ct) {
        if (chunk >= nc) return;
        const int s = chunk % NSTG;
        const long long blk = (long long)chunk * p.hv + j;
        uint16_t* const sw = stage_w(s);
        const int pc = 8 * (ct & 15), pr = ct >> 4;
        if (pc < dk) {
            const uint16_t* srcs[3] = {reinterpret_cast<const uint16_t*>(p.w), reinterpret_cast<const uint16_t*>(p.qt),
                                       reinterpret_cast<const uint16_t*>(p.kt)};
#pragma unroll
            for (int m = 0; m < 3; ++m) {
                const uint16_t* src = srcs[m] + (blk * GDC_CH + pr) * dk + pc;
                const uint32_t dst = smem_addr(sw + (m * GDC_CH + pr) * GDC_BRS + pc);
#pragma unroll
                for (int i = 0; i < GDC_CH / (NCP / 16); ++i)
                    cp_async16_all(dst + 2 * i * (NCP / 16) * GDC_BRS, src + (long long)i * (NCP / 16) * dk);
            }
        }
        {
            const int c = 8 * (ct & 7), r0 = ct >> 3;
            const uint16_t* src = reinterpret_cast<const uint16_t*>(p.p) + (blk * GDC_CH + r0) * GDC_CH + c;
            const uint32_t dst = smem_addr(stage_p(s) + r0 * GDC_BPS + c);
#pragma unroll
            for (int i = 0; i < GDC_CH / (NCP / 8); ++i) cp_async16_all(dst + 2 * i * (NCP / 8) * GDC_BPS, src + i * (NCP / 8) * GDC_CH);
        }
        {
            constexpr int up = BV / 4;  // pieces of a U row
            const int c = 4 * (ct % up), r0 = ct / up;
            const bool in = c0 + c < dv;
            const float* src = in ? p.u + (blk * GDC_CH + r0) * dv + c0 + c : p.u;
            const uint32_t dst = smem_addr(stage_u(s) + r0 * US + c);
#pragma unroll
            for (int i = 0; i < GDC_CH / (NCP / up); ++i)
                cp_async16z(dst + 4 * i * (NCP / up) * US, in ? src + (long long)i * (NCP / up) * dv : p.u, in ? 16 : 0);
        }
        if (ct < 2 * GDC_CH / 4) cp_async16z(smem_addr(stage_e(s) + 4 * ct), p.e + blk * 2 * GDC_CH + 4 * ct, 16);
    };

    // The state tile: S^T in bf16 (zero past Dv), and the state warps' f32 rows in registers.
    float* const S = p.state + (long long)j * dk * dv;
    for (int idx = tid; idx < BV * dk; idx += 512) {
        const int d = idx / BV, c = idx - d * BV;
        const bool in = c0 + c < dv;
        sST[c * GDC_BRS + d] = (uint16_t)bf16_bits(in ? S[(long long)d * dv + c0 + c] : 0.0f);
    }
    const int ms = 16 * w8;  // state warps: state rows ms + g, ms + g + 8
    const bool ms_in = ms < dk;
    float sacc[NTK][4];
    load_state_rows(sacc, S, ms, g, t4, c0, dv, !out_warp && ms_in);
    const bool copier = !LATE || out_warp;
    const int ct = LATE ? tid - 256 : tid;
#pragma unroll
    for (int s = 0; s < NSTG - 1; ++s) {
        if (copier) issue(s, ct);
        cp_async_commit_group();
    }

    // Lane offsets of the ldmatrix row addresses (bf16 elements): an A tile [16 rows][16 k] row-major
    // (matrices a0..a3: rows +8·(i%2), k +8·(i/2)); two n-tiles of B from a [n][k] tile (b0, b1 of the
    // first n-tile, then of the second: n +8·(i/2), k +8·(i%2)); K̃ᵀ's A from K̃ [k][m] by the
    // transposing form (storage rows k +8·(i/2), columns m +8·(i%2)).
    const int a_r = (lane & 7) + 8 * ((lane >> 3) & 1), a_k = 8 * (lane >> 4);
    const int b_n = (lane & 7) + 8 * (lane >> 4), b_k = 8 * ((lane >> 3) & 1);
    const int mi = w8 >> 1, cb = (w8 & 1) * (BV / 2);
    const int r0 = 16 * mi + g, r1 = r0 + 8;
    const uint32_t st_b = smem_addr(sST + (cb + b_n) * GDC_BRS + b_k);   // S^T as B, the tile's columns
    const uint32_t vt_b = smem_addr(sVT + (cb + b_n) * GDC_BPS + b_k);   // V'^T as B (output warps)
    const uint32_t vt_all = smem_addr(sVT + b_n * GDC_BPS + b_k);        // V'^T as B, all columns

    for (int chunk = 0; chunk < nc; ++chunk) {
        const int t0 = chunk * GDC_CH, n = min(GDC_CH, p.t_len - t0);
        const int s = chunk % NSTG;
        cp_async_wait_group<NSTG - 2>();
        __syncthreads();  // chunk's stage landed for every thread; the previous chunk is done with S^T, V'^T
        if (!LATE) {
            issue(chunk + NSTG - 1, ct);
            cp_async_commit_group();
        }

        // 1. (W or Q̃) S for this warp's 16 tokens × BV/2 columns, the k-steps alternating between two
        //    sets of accumulators (two dependent chains of Dk/32 MMAs instead of one of Dk/16), summed.
        float acc[NTW][4], acc2[NTW][4];
#pragma unroll
        for (int x = 0; x < NTW; ++x)
#pragma unroll
            for (int e = 0; e < 4; ++e) acc[x][e] = acc2[x][e] = 0.0f;
        {
            const uint32_t a_addr = smem_addr(stage_w(s) + ((out_warp ? GDC_CH : 0) + 16 * mi + a_r) * GDC_BRS + a_k);
            auto kstep = [&](int k, float (&c)[NTW][4]) {
                uint32_t a0, a1, a2, a3;
                ldmatrix_x4(a_addr + 2 * k, a0, a1, a2, a3);
                mma_ntile_pairs<NTW / 2>(c, a0, a1, a2, a3, st_b + 2 * k, 2 * 16 * GDC_BRS);
            };
#pragma unroll
            for (int k = 0; k < GDC_MAXD; k += 32) {  // unrolled, the steps past Dk predicated off
                if (k < dk) kstep(k, acc);
                if (k + 16 < dk) kstep(k + 16, acc2);
            }
#pragma unroll
            for (int x = 0; x < NTW; ++x)
#pragma unroll
                for (int e = 0; e < 4; ++e) acc[x][e] += acc2[x][e];
        }
        if (!out_warp) {
            // V' = U − W S, as bf16 into V'^T [column][token].
            const float* su = stage_u(s);
#pragma unroll
            for (int x = 0; x < NTW; ++x) {
                const int col = cb + 8 * x + 2 * t4;
                const float2 u0 = *reinterpret_cast<const float2*>(&su[r0 * US + col]);
                const float2 u1 = *reinterpret_cast<const float2*>(&su[r1 * US + col]);
                sVT[col * GDC_BPS + r0] = (uint16_t)bf16_bits(u0.x - acc[x][0]);
                sVT[(col + 1) * GDC_BPS + r0] = (uint16_t)bf16_bits(u0.y - acc[x][1]);
                sVT[col * GDC_BPS + r1] = (uint16_t)bf16_bits(u1.x - acc[x][2]);
                sVT[(col + 1) * GDC_BPS + r1] = (uint16_t)bf16_bits(u1.y - acc[x][3]);
            }
        }
        __syncthreads();  // V'^T complete; S^T read by every warp

        if (out_warp) {
            // 2. O = Q̃ S + P V' over the tokens up to the tile's last row, then written out.
            const uint32_t p_addr = smem_addr(stage_p(s) + (16 * mi + a_r) * GDC_BPS + a_k);
#pragma unroll
            for (int k = 0; k < GDC_CH; k += 16) {
                if (k > 16 * mi) break;
                uint32_t a0, a1, a2, a3;
                ldmatrix_x4(p_addr + 2 * k, a0, a1, a2, a3);
                mma_ntile_pairs<NTW / 2>(acc, a0, a1, a2, a3, vt_b + 2 * k, 2 * 16 * GDC_BPS);
            }
#pragma unroll
            for (int x = 0; x < NTW; ++x) {
                const int col = c0 + cb + 8 * x + 2 * t4;
                if (col >= dv) continue;
                if (r0 < n) *reinterpret_cast<float2*>(&p.out[((long long)(t0 + r0) * p.hv + j) * dv + col]) = make_float2(acc[x][0], acc[x][1]);
                if (r1 < n) *reinterpret_cast<float2*>(&p.out[((long long)(t0 + r1) * p.hv + j) * dv + col]) = make_float2(acc[x][2], acc[x][3]);
            }
            if (LATE) {  // its stage was freed at this chunk's first barrier
                issue(chunk + NSTG - 1, ct);
                cp_async_commit_group();
            }
        } else if (ms_in) {
            // 3. S ← e^{Γ_last} S + K̃ᵀ V' (ΔS in fresh accumulators, added in f32), then S^T in bf16.
            const float elast = stage_e(s)[n - 1];
            const uint32_t k_addr = smem_addr(stage_w(s) + (2 * GDC_CH + (lane & 7) + 8 * (lane >> 4)) * GDC_BRS + ms + 8 * ((lane >> 3) & 1));
            float ds[NTK][4];
#pragma unroll
            for (int x = 0; x < NTK; ++x)
#pragma unroll
                for (int e = 0; e < 4; ++e) ds[x][e] = 0.0f;
#pragma unroll
            for (int k = 0; k < GDC_CH; k += 16) {  // tokens past n: K̃ and V' are zero there
                if (k >= n) break;
                uint32_t a0, a1, a2, a3;
                ldmatrix_x4_trans(k_addr + 2 * k * GDC_BRS, a0, a1, a2, a3);
                mma_ntile_pairs<NTK / 2>(ds, a0, a1, a2, a3, vt_all + 2 * k, 2 * 16 * GDC_BPS);
            }
#pragma unroll
            for (int x = 0; x < NTK; ++x) {
#pragma unroll
                for (int e = 0; e < 4; ++e) sacc[x][e] = fmaf(sacc[x][e], elast, ds[x][e]);
                const int col = 8 * x + 2 * t4;
                sST[col * GDC_BRS + ms + g] = (uint16_t)bf16_bits(sacc[x][0]);
                sST[(col + 1) * GDC_BRS + ms + g] = (uint16_t)bf16_bits(sacc[x][1]);
                sST[col * GDC_BRS + ms + g + 8] = (uint16_t)bf16_bits(sacc[x][2]);
                sST[(col + 1) * GDC_BRS + ms + g + 8] = (uint16_t)bf16_bits(sacc[x][3]);
            }
        }
    }
    cp_async_wait_group<0>();

    // The final state tile.
    if (!out_warp && ms_in) store_state_rows(sacc, S, ms, g, t4, c0, dv);
}

extern "C" __global__ void __launch_bounds__(512, 1) gdn_chunk_state_bf32(const GdnChunkStateParams p) { pdl_enter(); chunk_state_bf<32, 2, false>(p); }
extern "C" __global__ void __launch_bounds__(512, 1) gdn_chunk_state_bf32s3(const GdnChunkStateParams p) { pdl_enter(); chunk_state_bf<32, 3, false>(p); }
extern "C" __global__ void __launch_bounds__(512, 1) gdn_chunk_state_bf32s3l(const GdnChunkStateParams p) { pdl_enter(); chunk_state_bf<32, 3, true>(p); }

// The MoE router's selection for one token, by one warp (route_row): shared by moe_route.cu (a warp
// per token) and the router GEMV of affine_gemv.cu (its last block selects right after the logits are
// written); and by a whole block (route_block: moe_decode.cu, every block selecting alike).
// The same maths as lily_cpu::moe::route, bit for bit, in its two forms:
//   renormalised (the model's norm_topk_prob): the k largest logits (f32 total order, ties to the lower
//     index), best first; m = the largest; ex_r = exp(l_r - m) of the k picks alone; weight_r = ex_r /
//     (ex_0 + ex_1 + ... added in pick order). The softmax's denominator cancels, so no other
//     exponential and no sum over all experts is needed.
//   plain: m = max(row);  ex_i = exp(row_i - m);  sum = ex_0 + ex_1 + ... (f32, in index order);
//     p_i = ex_i / sum; the k largest p, ties to the lower index, best first; weight = p.
// To match the CPU where values tie after rounding, the exps are computed as the CPU does: in double
// rounded to f32 (the correctly rounded expf, as glibc's within 0.502 ulp), sums in the CPU's order,
// IEEE division (no fast math). Picks compare route_key(value): an unsigned key in the order of Rust's
// f32::total_cmp (0 marks a taken or absent slot).
// route_row: lane l holds the values l + 32j (j < NPER) in registers; the plain sum is read back in
// order from `s` (e floats of shared memory owned by this warp), so every lane adds the same sequence.
// Top-k: k rounds of (in-lane best key, warp argmax on (key desc, index asc) by redux.sync); the winner's
// slot is marked taken and lane r keeps the round-r pick. Requires 1 <= k <= min(e, 32), e <= 32*NPER.
// The logits are read with ld.global.cg (L2, not L1): in the fused GEMV other blocks of the same grid
// wrote them.
#pragma once
#include <stdint.h>
#include "reduce.cuh"

// An unsigned key of x in f32::total_cmp's order (-NaN < -inf < ... < -0 < +0 < ... < +inf < +NaN).
__device__ __forceinline__ uint32_t route_key(float x) {
    const uint32_t b = __float_as_uint(x);
    return (b & 0x80000000u) ? ~b : (b | 0x80000000u);
}
__device__ __forceinline__ float route_unkey(uint32_t k) {
    return __uint_as_float((k & 0x80000000u) ? (k & 0x7FFFFFFFu) : ~k);
}

// The renormalised weight of pick `lane` (lane < k) of a warp whose lane r holds pick r's logit l
// (best first, so lane 0's is the largest): e^(l - m) over the k picks' sum, added in pick order.
// Every lane of the warp calls it; lanes >= k get 0.
__device__ __forceinline__ float route_renorm_weight(float l, int k) {
    const int lane = threadIdx.x & 31;
    const float m = __shfl_sync(0xffffffffu, l, 0);
    const float ex = lane < k ? (float)exp((double)(l - m)) : 0.0f;
    float total = 0.0f;
    for (int r = 0; r < k; r++) total = total + __shfl_sync(0xffffffffu, ex, r);
    return lane < k ? ex / total : 0.0f;
}

// s[0] + s[1] + ... + s[e-1] in index order (the CPU's), 32 values loaded ahead of their adds where s
// is 16-byte aligned. Every lane that calls it gets the same sum.
__device__ __forceinline__ float route_sum(const float* s, int e) {
    float sum = 0.0f;
    int i = 0;
    if ((reinterpret_cast<uintptr_t>(s) & 15) == 0) {
        for (; i + 32 <= e; i += 32) {
            float4 q[8];
#pragma unroll
            for (int j = 0; j < 8; ++j) q[j] = reinterpret_cast<const float4*>(s)[(i >> 2) + j];
#pragma unroll
            for (int j = 0; j < 8; ++j) {
                sum = sum + q[j].x;
                sum = sum + q[j].y;
                sum = sum + q[j].z;
                sum = sum + q[j].w;
            }
        }
    }
    for (; i < e; i++) sum = sum + s[i];
    return sum;
}

// WEIGHTS false: the picks only (w_out then holds the renormalised form's logits, not its weights).
template <int NPER, bool WEIGHTS = true>
__device__ __forceinline__ void route_row(const float* row, int e, int k, int renorm, float* s, uint32_t* idx_out, float* w_out) {
    const int lane = threadIdx.x & 31;
    float v[NPER];
    uint32_t key[NPER];
#pragma unroll
    for (int j = 0; j < NPER; j++) {
        const int i = lane + 32 * j;
        v[j] = i < e ? __ldcg(row + i) : -INFINITY;
    }
    if (renorm) {
#pragma unroll
        for (int j = 0; j < NPER; j++) key[j] = lane + 32 * j < e ? route_key(v[j]) : 0u;
    } else {
        float m = -INFINITY;
#pragma unroll
        for (int j = 0; j < NPER; j++) m = fmaxf(m, v[j]);
#pragma unroll
        for (int o = 16; o > 0; o >>= 1) m = fmaxf(m, __shfl_xor_sync(0xffffffffu, m, o));
#pragma unroll
        for (int j = 0; j < NPER; j++) {
            const int i = lane + 32 * j;
            v[j] = (float)exp((double)(v[j] - m));
            if (i < e) s[i] = v[j];
        }
        __syncwarp();
        const float sum = route_sum(s, e);
#pragma unroll
        for (int j = 0; j < NPER; j++) key[j] = lane + 32 * j < e ? route_key(v[j] / sum) : 0u;
    }

    uint32_t mine_key = 0u;
    int mine_i = 0;
    for (int r = 0; r < k; r++) {
        uint32_t bk = 0u;
        int bi = 0x7fffffff;
#pragma unroll
        for (int j = 0; j < NPER; j++) {
            if (key[j] > bk) {  // slots ascend in index, so '>' keeps the lower index on ties
                bk = key[j];
                bi = lane + 32 * j;
            }
        }
        // The warp's best: the largest key, then the lowest index among the lanes holding it.
        const uint32_t best = __reduce_max_sync(0xffffffffu, bk);
        bi = (int)__reduce_min_sync(0xffffffffu, bk == best ? (uint32_t)bi : 0x7fffffffu);
        if ((bi & 31) == lane) {
            const int slot = bi >> 5;
#pragma unroll
            for (int j = 0; j < NPER; j++)
                if (j == slot) key[j] = 0u;
        }
        if (lane == r) {
            mine_key = best;
            mine_i = bi;
        }
    }

    float out = route_unkey(mine_key);  // the pick's logit (renormalised) or p (plain)
    if (WEIGHTS && renorm) out = route_renorm_weight(out, k);
    if (lane < k) {
        idx_out[lane] = (uint32_t)mine_i;
        w_out[lane] = out;
    }
}

// route_row's selection by a whole block of NWARPS warps (32·NWARPS >= e; every thread calls it; ends
// synchronised with idx_out/w_out written): one value and its key a thread (the logit; plain: the
// exp, then p after warp 0's sum in route_row's index order), then the candidates (key at least a
// lower bound on the k-th largest, from the warps' largest keys) each rank themselves among the
// candidates (key descending, ties to the lower index): the ranks below k are the picks, best first.
// The same values, picks and weights as route_row, without its k dependent rounds. `s`: e floats of
// shared memory; `red`: NWARPS + 1 floats. Needs e <= MAXE.
template <int MAXE, int NWARPS>
__device__ __forceinline__ void route_block(const float* row, int e, int k, int renorm, float* s, float* red, uint32_t* idx_out, float* w_out) {
    __shared__ int cand_i[MAXE];
    __shared__ int cand_n[1];
    __shared__ uint32_t cand_bound[1];
    __shared__ uint32_t wkey[NWARPS];
    uint32_t* cand_k = reinterpret_cast<uint32_t*>(s);  // the plain exps are summed (and read no more) first
    const int tid = threadIdx.x, lane = tid & 31, warp = tid >> 5;
    const float l = tid < e ? __ldcg(row + tid) : -INFINITY;
    float val = l;  // what a pick's weight comes from: the logit, or (plain) p
    if (!renorm) {
        const float m = block_max<NWARPS>(l, red);
        const float ex = tid < e ? (float)exp((double)(l - m)) : 0.0f;
        if (tid < e) s[tid] = ex;
        __syncthreads();
        if (warp == 0) {
            const float sum = route_sum(s, e);
            if (lane == 0) red[NWARPS] = sum;
        }
        __syncthreads();
        val = ex / red[NWARPS];
    }
    const uint32_t key = tid < e ? route_key(val) : 0u;
    // A lower bound on the k-th largest key: with at least k warps holding experts, the smallest of
    // their k largest warp maxima (k distinct experts reach it); else none. Only the candidates
    // (key >= bound) can be picked, and only they can outrank one another.
    const uint32_t wmax = __reduce_max_sync(0xffffffffu, key);
    const int ew = (e + 31) >> 5;  // warps holding experts
    if (lane == 0 && warp < ew) wkey[warp] = wmax;
    if (tid == 0) cand_n[0] = 0;
    __syncthreads();
    if (warp == 0) {
        // The k-th largest of the ew maxima (ties counted with their multiplicity): lane w counts the
        // maxima above its own; the smallest maximum with fewer than k above it.
        uint32_t mine = 0xFFFFFFFFu;
        if (lane < ew) {
            int above = 0;
            for (int v = 0; v < ew; ++v) above += wkey[v] > wkey[lane] ? 1 : 0;
            if (above < k) mine = wkey[lane];
        }
        mine = __reduce_min_sync(0xffffffffu, mine);
        if (lane == 0) cand_bound[0] = ew >= k ? mine : 0u;
    }
    __syncthreads();
    const uint32_t bound = cand_bound[0];
    const bool cand = tid < e && key >= bound;
    if (cand) {
        const int c = atomicAdd(cand_n, 1);
        cand_k[c] = key;
        cand_i[c] = tid;
    }
    __syncthreads();
    if (cand) {
        // Rank among the candidates: the keys above this one, and those equal at a lower index.
        const int nc = cand_n[0];
        int rank = 0;
        for (int c = 0; c < nc; ++c) {
            const uint32_t q = cand_k[c];
            rank += (q > key || (q == key && cand_i[c] < tid)) ? 1 : 0;
        }
        if (rank < k) {
            idx_out[rank] = (uint32_t)tid;
            w_out[rank] = val;
        }
    }
    __syncthreads();
    if (renorm && warp == 0) {
        const float w = route_renorm_weight(lane < k ? w_out[lane] : 0.0f, k);
        __syncwarp();
        if (lane < k) w_out[lane] = w;
    }
    __syncthreads();
}

// The MoE router's selection for one token, by one warp (route_row): shared by moe_route.cu (a warp
// per token) and the router GEMV of affine_gemv.cu (its last block selects right after the logits are
// written); and by a whole block (route_block: moe_decode.cu, every block selecting alike).
// The same maths as lily_cpu::moe::route:
//   m = max(row);  ex_i = exp(row_i - m);  sum = ex_0 + ex_1 + ... (f32, in index order);  p_i = ex_i / sum;
//   the k largest p, ties to the lower index, sorted best first; weight = p (or p / (sum of the k chosen p,
//   added in that order) when renormalising).
// To pick the same experts as the CPU even where distinct logits give equal probabilities (ties after
// rounding, underflow to 0 with large-magnitude logits), the p are computed as the CPU does: exp in
// double rounded to f32 (the correctly rounded expf, as glibc's within 0.502 ulp), the sum added
// sequentially in index order, IEEE division (no fast math).
// Lane l holds the logits l + 32j (j < NPER) in registers; the sum is read back in order from `s`
// (e floats of shared memory owned by this warp), so every lane adds the same sequence. Top-k: k rounds
// of (in-lane best, warp argmax on (p desc, index asc) by redux.sync); the winner's slot is marked taken
// (-1; p is never negative) and lane r keeps the round-r pick. Requires 1 <= k <= min(e, 32), e <= 32*NPER.
// The logits are read with ld.global.cg (L2, not L1): in the fused GEMV other blocks of the same grid
// wrote them.
#pragma once
#include <stdint.h>
#include "reduce.cuh"

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

template <int NPER>
__device__ __forceinline__ void route_row(const float* row, int e, int k, int renorm, float* s, uint32_t* idx_out, float* w_out) {
    const int lane = threadIdx.x & 31;
    float v[NPER];
    float m = -INFINITY;
#pragma unroll
    for (int j = 0; j < NPER; j++) {
        const int i = lane + 32 * j;
        v[j] = i < e ? __ldcg(row + i) : -INFINITY;
        m = fmaxf(m, v[j]);
    }
#pragma unroll
    for (int o = 16; o > 0; o >>= 1) m = fmaxf(m, __shfl_xor_sync(0xffffffffu, m, o));

#pragma unroll
    for (int j = 0; j < NPER; j++) {
        const int i = lane + 32 * j;
        const float d = v[j] - m;
        v[j] = (float)exp((double)d);
        if (i < e) s[i] = v[j];
    }
    __syncwarp();
    const float sum = route_sum(s, e);

#pragma unroll
    for (int j = 0; j < NPER; j++) {
        const int i2 = lane + 32 * j;
        v[j] = i2 < e ? v[j] / sum : -1.0f;
    }

    float mine_p = 0.0f;
    int mine_i = 0;
    for (int r = 0; r < k; r++) {
        float bp = -1.0f;
        int bi = 0x7fffffff;
#pragma unroll
        for (int j = 0; j < NPER; j++) {
            if (v[j] > bp) {  // slots ascend in index, so '>' keeps the lower index on ties
                bp = v[j];
                bi = lane + 32 * j;
            }
        }
        // The warp's best: the largest p (a non-negative float's bits order as its value; taken and
        // absent slots, -1, map below every p), then the lowest index among the lanes holding it —
        // two redux.sync where a butterfly took five rounds of two shuffles.
        const uint32_t key = bp >= 0.0f ? __float_as_uint(bp) + 1u : 0u;
        const uint32_t best = __reduce_max_sync(0xffffffffu, key);
        bi = (int)__reduce_min_sync(0xffffffffu, key == best ? (uint32_t)bi : 0x7fffffffu);
        bp = best == 0u ? -1.0f : __uint_as_float(best - 1u);
        if ((bi & 31) == lane) {
            const int slot = bi >> 5;
#pragma unroll
            for (int j = 0; j < NPER; j++)
                if (j == slot) v[j] = -1.0f;
        }
        if (lane == r) {
            mine_p = bp;
            mine_i = bi;
        }
    }

    float out = mine_p;
    if (renorm) {
        float total = 0.0f;
        for (int r = 0; r < k; r++) total = total + __shfl_sync(0xffffffffu, mine_p, r);
        out = mine_p / total;
    }
    if (lane < k) {
        idx_out[lane] = (uint32_t)mine_i;
        w_out[lane] = out;
    }
}

// route_row's selection by a whole block of NWARPS warps (32·NWARPS >= e; every thread calls it; ends
// synchronised with idx_out/w_out written): one logit, one exp and one p a thread, the sum by warp 0 in
// route_row's index order (route_sum), then the candidates (p at least a lower bound on the k-th
// largest, from the warps' maxima) each rank themselves among the candidates (p descending, ties to the
// lower index): the ranks below k are the picks, best first. The same values, picks and weights as
// route_row (renormalised over the picks added in pick order), without its k dependent rounds. `s`: e
// floats of shared memory; `red`: NWARPS + 1 floats (the warps' maxima, then the sum). Needs e <= MAXE.
template <int MAXE, int NWARPS>
__device__ __forceinline__ void route_block(const float* row, int e, int k, int renorm, float* s, float* red, uint32_t* idx_out, float* w_out) {
    __shared__ int cand_i[MAXE];
    __shared__ int cand_n[1];
    __shared__ float cand_bound[1];
    float* cand_p = s;  // the exps are summed (and read no more) before the candidates are written
    const int tid = threadIdx.x, lane = tid & 31, warp = tid >> 5;
    const float l = tid < e ? __ldcg(row + tid) : -INFINITY;
    const float m = block_max<NWARPS>(l, red);
    const float ex = tid < e ? (float)exp((double)(l - m)) : 0.0f;
    if (tid < e) s[tid] = ex;
    __syncthreads();
    if (warp == 0) {
        const float sum = route_sum(s, e);
        if (lane == 0) red[NWARPS] = sum;
    }
    __syncthreads();
    const float pv = tid < e ? ex / red[NWARPS] : -1.0f;
    // A lower bound on the k-th largest p: with at least k warps holding experts, the smallest of
    // their k largest warp maxima (k distinct experts reach it); else none. Only the candidates
    // (p >= bound) can be picked, and only they can outrank one another.
    float wmax = pv;
#pragma unroll
    for (int o = 16; o > 0; o >>= 1) wmax = fmaxf(wmax, __shfl_xor_sync(0xffffffffu, wmax, o));
    const int ew = (e + 31) >> 5;  // warps holding experts
    __syncthreads();               // red[] (the max) is read above by every thread
    if (lane == 0 && warp < ew) red[warp] = wmax;
    if (tid == 0) cand_n[0] = 0;
    __syncthreads();
    if (warp == 0) {
        // The k-th largest of the ew maxima (ties counted with their multiplicity): lane w counts the
        // maxima above its own; the smallest maximum with fewer than k above it.
        float mine = INFINITY;
        if (lane < ew) {
            int above = 0;
            for (int v = 0; v < ew; ++v) above += red[v] > red[lane] ? 1 : 0;
            if (above < k) mine = red[lane];
        }
#pragma unroll
        for (int o = 16; o > 0; o >>= 1) mine = fminf(mine, __shfl_xor_sync(0xffffffffu, mine, o));
        if (lane == 0) cand_bound[0] = ew >= k ? mine : -1.0f;
    }
    __syncthreads();
    const float bound = cand_bound[0];
    if (tid < e && pv >= bound) {
        const int c = atomicAdd(cand_n, 1);
        cand_p[c] = pv;
        cand_i[c] = tid;
    }
    __syncthreads();
    if (tid < e && pv >= bound) {
        // Rank among the candidates: the p above this one, and those equal at a lower index.
        const int nc = cand_n[0];
        int rank = 0;
        for (int c = 0; c < nc; ++c) {
            const float q = cand_p[c];
            rank += (q > pv || (q == pv && cand_i[c] < tid)) ? 1 : 0;
        }
        if (rank < k) {
            idx_out[rank] = (uint32_t)tid;
            w_out[rank] = pv;
        }
    }
    __syncthreads();
    if (renorm && warp == 0) {
        // The picks' sum in pick order, as route_row adds them.
        float total = 0.0f;
        for (int r = 0; r < k; r++) total = total + w_out[r];
        const float mine = lane < k ? w_out[lane] / total : 0.0f;
        __syncwarp();
        if (lane < k) w_out[lane] = mine;
    }
    __syncthreads();
}

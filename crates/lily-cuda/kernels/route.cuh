// The MoE router's selection for one token, by one warp: shared by moe_route.cu (a warp per token)
// and the router GEMV of affine_gemv.cu (its last block selects right after the logits are written).
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
    float sum = 0.0f;
    int i = 0;
    if ((e & 3) == 0 && (reinterpret_cast<uintptr_t>(s) & 15) == 0) {
        const float4* s4 = reinterpret_cast<const float4*>(s);
        for (; i < e; i += 4) {
            const float4 q = s4[i >> 2];
            sum = sum + q.x;
            sum = sum + q.y;
            sum = sum + q.z;
            sum = sum + q.w;
        }
    }
    for (; i < e; i++) sum = sum + s[i];

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

// MoE router selection, the same maths as lily_cpu::moe::route: per token (row of E f32 logits),
//   m = max(row);  ex_i = exp(row_i - m);  sum = ex_0 + ex_1 + ... (f32, in index order);  p_i = ex_i / sum;
//   the k largest p, ties to the lower index, sorted best first; weight = p (or p / (sum of the k chosen p,
//   added in that order) when renormalising).
// To pick the same experts as the CPU even where distinct logits give equal probabilities (ties after
// rounding, underflow to 0 with large-magnitude logits), the kernel ranks the f32 p computed as the CPU
// does: exp in double rounded to f32 (the correctly rounded expf, as glibc's within 0.502 ulp), the sum
// added sequentially in index order, IEEE division (no fast math).
//
// Entry points moe_route_e{32,64,128,256,512}: one warp per token, 4 warps per block; lane l holds the
// logits l + 32j (j < E_MAX/32) in registers. The sum is read back in order from the warp's slice of
// shared memory (every lane adds the same sequence, so every lane holds it). Top-k: k rounds of
// (in-lane best, xor-butterfly warp argmax on (p desc, index asc)); the winner's slot is marked taken
// (-1; p is never negative) and lane r keeps the round-r pick. Requires 1 <= k <= min(E, 32), E <= E_MAX.

#include <stdint.h>
#include "pdl.cuh"

struct MoeRouteParams {
    const float* logits;  // [T, E]
    uint32_t* idx;        // [T, k]
    float* w;             // [T, k]
    int t;
    int e;
    int k;
    int renorm;
};

constexpr int WARPS = 4;

// a better than b: larger p, then lower index.
__device__ __forceinline__ bool better(float pa, int ia, float pb, int ib) {
    return pa > pb || (pa == pb && ia < ib);
}

template <int NPER>
__device__ __forceinline__ void moe_route(const MoeRouteParams& p) {
    __shared__ __align__(16) float sm[WARPS][NPER * 32];
    const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
    const int tok = blockIdx.x * WARPS + warp;
    if (tok >= p.t) return;  // whole warp
    const int e = p.e, k = p.k;
    const float* row = p.logits + (long long)tok * e;

    float v[NPER];
    float m = -INFINITY;
#pragma unroll
    for (int j = 0; j < NPER; j++) {
        const int i = lane + 32 * j;
        v[j] = i < e ? row[i] : -INFINITY;
        m = fmaxf(m, v[j]);
    }
#pragma unroll
    for (int o = 16; o > 0; o >>= 1) m = fmaxf(m, __shfl_xor_sync(0xffffffffu, m, o));

    float* s = sm[warp];
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
    if ((e & 3) == 0) {
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
#pragma unroll
        for (int o = 16; o > 0; o >>= 1) {
            const float op = __shfl_xor_sync(0xffffffffu, bp, o);
            const int oi = __shfl_xor_sync(0xffffffffu, bi, o);
            if (better(op, oi, bp, bi)) {
                bp = op;
                bi = oi;
            }
        }
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
    if (p.renorm) {
        float total = 0.0f;
        for (int r = 0; r < k; r++) total = total + __shfl_sync(0xffffffffu, mine_p, r);
        out = mine_p / total;
    }
    if (lane < k) {
        p.idx[(long long)tok * k + lane] = (uint32_t)mine_i;
        p.w[(long long)tok * k + lane] = out;
    }
}

extern "C" __global__ void __launch_bounds__(32 * WARPS) moe_route_e32(const MoeRouteParams p) { pdl_enter(); moe_route<1>(p); }
extern "C" __global__ void __launch_bounds__(32 * WARPS) moe_route_e64(const MoeRouteParams p) { pdl_enter(); moe_route<2>(p); }
extern "C" __global__ void __launch_bounds__(32 * WARPS) moe_route_e128(const MoeRouteParams p) { pdl_enter(); moe_route<4>(p); }
extern "C" __global__ void __launch_bounds__(32 * WARPS) moe_route_e256(const MoeRouteParams p) { pdl_enter(); moe_route<8>(p); }
extern "C" __global__ void __launch_bounds__(32 * WARPS) moe_route_e512(const MoeRouteParams p) { pdl_enter(); moe_route<16>(p); }

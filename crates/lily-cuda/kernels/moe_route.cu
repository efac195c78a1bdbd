// MoE router selection for T tokens, one warp per token (the maths and its CPU-exactness: route.cuh).
// Entry points moe_route_e{32,64,128,256,512}: 4 warps per block; e <= E_MAX, 1 <= k <= min(E, 32).

#include <stdint.h>
#include "pdl.cuh"
#include "route.cuh"

struct MoeRouteParams {
    const float* logits;  // [T, E], rows `stride` floats apart
    uint32_t* idx;        // [T, k]
    float* w;             // [T, k]
    int t;
    int e;
    int k;
    int renorm;
    int stride;           // ≥ E (E + 1: the router's rows carry the shared expert's gate logit last)
    int pad_;
};

constexpr int WARPS = 4;

template <int NPER>
__device__ __forceinline__ void moe_route(const MoeRouteParams& p) {
    __shared__ __align__(16) float sm[WARPS][NPER * 32];
    const int warp = threadIdx.x >> 5;
    const int tok = blockIdx.x * WARPS + warp;
    if (tok >= p.t) return;  // whole warp
    route_row<NPER>(p.logits + (long long)tok * p.stride, p.e, p.k, p.renorm, sm[warp], p.idx + (long long)tok * p.k, p.w + (long long)tok * p.k);
}

extern "C" __global__ void __launch_bounds__(32 * WARPS) moe_route_e32(const MoeRouteParams p) { pdl_enter(); moe_route<1>(p); }
extern "C" __global__ void __launch_bounds__(32 * WARPS) moe_route_e64(const MoeRouteParams p) { pdl_enter(); moe_route<2>(p); }
extern "C" __global__ void __launch_bounds__(32 * WARPS) moe_route_e128(const MoeRouteParams p) { pdl_enter(); moe_route<4>(p); }
extern "C" __global__ void __launch_bounds__(32 * WARPS) moe_route_e256(const MoeRouteParams p) { pdl_enter(); moe_route<8>(p); }
extern "C" __global__ void __launch_bounds__(32 * WARPS) moe_route_e512(const MoeRouteParams p) { pdl_enter(); moe_route<16>(p); }

// The decode step's pieces shared by gdn.cu (gdn_step_*) and gdn_in_step.cu: the gates' activations
// and one token of the delta rule on a lane's rows of one state column (the layout: warp w owns 8
// consecutive columns, lane = rg·8 + column, rows d = rg + RG·i, i < NR).
#pragma once

// The gates' activations, as lily_cpu::gdn computes them: softplus(x) (x = a + dt_bias; past 20, x
// itself), so g = −exp(A_log)·softplus(x), and beta = sigmoid(b).
__device__ __forceinline__ float gdn_softplus(float x) { return x > 20.0f ? x : log1pf(expf(x)); }
__device__ __forceinline__ float gdn_beta(float b) { return 1.0f / (1.0f + expf(-b)); }

// Rows rg, rg + RG, ... of state column `col` of one value head (St [Dk, Dv]) into a lane's s (zeros
// past Dk or for an inactive lane): the rule's layout in gdn_step.
template <int RG, int NR>
__device__ __forceinline__ void gdn_step_state(float (&s)[NR], const float* St, int rg, int col, bool active, int dk, int dv) {
#pragma unroll
    for (int i = 0; i < NR; ++i) {
        const int d = rg + RG * i;
        s[i] = (active && d < dk) ? St[(long long)d * dv + col] : 0.0f;
    }
}

// One token of the rule on a lane's state column rows (gdn_step's layout; q and k normalised, in
// shared memory): kv = Sᵀk, δ = β(v − decay·kv), S ← decay·S + k⊗δ, returns o = Sᵀq (the column's,
// summed over the 4 row groups of the lane's 8-lane column set).
template <int RG, int NR>
__device__ __forceinline__ float gdn_step_rule(float (&s)[NR], const float* sq, const float* sk, float v, float decay, float bt, int rg, int dk) {
    float kv = 0.0f;
#pragma unroll
    for (int i = 0; i < NR; ++i) {
        const int d = rg + RG * i;
        kv += (d < dk ? sk[d] : 0.0f) * s[i];
    }
    kv += __shfl_xor_sync(0xffffffffu, kv, 8);
    kv += __shfl_xor_sync(0xffffffffu, kv, 16);
    const float delta = bt * (v - decay * kv);
    float o = 0.0f;
#pragma unroll
    for (int i = 0; i < NR; ++i) {
        const int d = rg + RG * i;
        const float kd_ = d < dk ? sk[d] : 0.0f, qd = d < dk ? sq[d] : 0.0f;
        s[i] = decay * s[i] + kd_ * delta;
        o += qd * s[i];
    }
    o += __shfl_xor_sync(0xffffffffu, o, 8);
    o += __shfl_xor_sync(0xffffffffu, o, 16);
    return o;
}


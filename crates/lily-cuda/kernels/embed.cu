// Embedding lookup: out[t, :] = dequantised row ids[t] of the table, in f32. The token ids live on the
// device (the sampler writes them there), so no host round trip. An id >= rows gives a row of NaN.
// The affine dequant is scale * q + bias computed as a rounded product then a rounded sum (no FMA), the
// same arithmetic as the CPU reference (lily_cpu::linear::dequantize_row), so results are bit-identical.
// Entry points: embed_affine (4 or 8 bits, any group), embed_bf16 (dense table). One block per token.

#include <stdint.h>
#include "pdl.cuh"
#include "bf16.cuh"

struct EmbedParams {
    const uint32_t* packed;   // affine: [rows, cols*bits/32]; bf16: the table as [rows, cols/2] words
    const uint16_t* scales;   // [rows, cols/group] bf16 bits (affine only)
    const uint16_t* biases;
    const uint32_t* ids;      // [tokens]
    float* out;               // [tokens, cols]
    int tokens;
    int rows;
    int cols;
    int bits;                 // 4 or 8 (affine)
    int group_shift;          // log2(group size) (affine)
    int vec;                  // 1: out is 16-byte aligned (then cols % 4 == 0 holds): float4 stores
};

extern "C" __global__ void __launch_bounds__(256) embed_affine(const EmbedParams p) { pdl_enter();
    const int t = blockIdx.x;
    const uint32_t id = p.ids[t];
    float* o = p.out + (long long)t * p.cols;
    if (id >= (uint32_t)p.rows) {
        for (int j = threadIdx.x; j < p.cols; j += blockDim.x) o[j] = __int_as_float(0x7fc00000);
        return;
    }
    const int bits = p.bits, per_word = 32 / bits;
    const uint32_t mask = (1u << bits) - 1u;
    const int wpr = p.cols / per_word, groups = p.cols >> p.group_shift;
    const uint32_t* w = p.packed + (long long)id * wpr;
    const uint16_t* s = p.scales + (long long)id * groups;
    const uint16_t* b = p.biases + (long long)id * groups;
    for (int k = threadIdx.x; k < wpr; k += blockDim.x) {
        uint32_t v = w[k];
        const int j0 = k * per_word;
        const int g = j0 >> p.group_shift;
        const float sc = bf16_to_f32(s[g]), bi = bf16_to_f32(b[g]);
        if (p.vec) {  // 4 or 8 outputs per word: whole float4s
            for (int e = 0; e < per_word; e += 4) {
                float4 q;
                q.x = __fadd_rn(__fmul_rn(sc, (float)(v & mask)), bi); v >>= bits;
                q.y = __fadd_rn(__fmul_rn(sc, (float)(v & mask)), bi); v >>= bits;
                q.z = __fadd_rn(__fmul_rn(sc, (float)(v & mask)), bi); v >>= bits;
                q.w = __fadd_rn(__fmul_rn(sc, (float)(v & mask)), bi); v >>= bits;
                *reinterpret_cast<float4*>(o + j0 + e) = q;
            }
        } else {
            for (int e = 0; e < per_word; ++e) {
                o[j0 + e] = __fadd_rn(__fmul_rn(sc, (float)(v & mask)), bi);
                v >>= bits;
            }
        }
    }
}

extern "C" __global__ void __launch_bounds__(256) embed_bf16(const EmbedParams p) { pdl_enter();
    const int t = blockIdx.x;
    const uint32_t id = p.ids[t];
    float* o = p.out + (long long)t * p.cols;
    if (id >= (uint32_t)p.rows) {
        for (int j = threadIdx.x; j < p.cols; j += blockDim.x) o[j] = __int_as_float(0x7fc00000);
        return;
    }
    const uint16_t* row = reinterpret_cast<const uint16_t*>(p.packed) + (long long)id * p.cols;
    for (int j = threadIdx.x; j < p.cols; j += blockDim.x) o[j] = bf16_to_f32(row[j]);
}

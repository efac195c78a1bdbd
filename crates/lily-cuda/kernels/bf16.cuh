// bf16 conversions shared by the kernel files: a bf16 (its 16 bits, in the low half of the argument)
// to f32, exactly; f32 to the bits of its bf16, rounded to nearest even.
#pragma once
#include <stdint.h>
#include <cuda_bf16.h>

__device__ __forceinline__ float bf16_to_f32(uint32_t h) { return __uint_as_float(h << 16); }
__device__ __forceinline__ uint32_t bf16_bits(float x) { return (uint32_t)__bfloat16_as_ushort(__float2bfloat16_rn(x)); }

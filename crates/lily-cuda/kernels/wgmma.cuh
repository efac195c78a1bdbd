// Hopper warpgroup MMA (wgmma, sm_90a) helpers: the fences and groups that order it, the shared-memory
// matrix descriptor for a K-major 16-bit tile in the 128-byte swizzle, and the m64nNk16 bf16/f16 -> f32
// forms with A from registers, and m64n64k16 bf16 and m64n128k16 f16 with A from shared memory too. Used by gemm_wgmma.cu
// and attn_prefill.cu.
//
// A warpgroup is 4 consecutive warps (128 threads); every wgmma instruction is issued by all of them.
// Fragments, g = lane / 4, q = lane % 4, warp w of the warpgroup (PTX ISA, "wgmma" register fragments):
//   A (64×16, registers): warp w holds rows 16w..16w+15 as mma.m16n8k16's A: a0 = (row g, k 2q..2q+1),
//     a1 = (row g+8, k 2q..), a2 = (row g, k 2q+8..), a3 = (row g+8, k 2q+8..); the lower k in the low half.
//   D (64×N f32): d[4j + e] = (row 16w + g, col 8j + 2q + e), d[4j + 2 + e] = (row 16w + g + 8, same col).
//   A (64×16, shared memory, the SS form): laid out as B below with 64 rows.
//   B (16×N, shared memory, K-major: N rows of K): rows of 128 bytes (64 elements) in groups of 8 rows
//     (1024 bytes, the stride-dimension offset), the 16-byte chunk c of row r stored at chunk c ^ (r % 8)
//     (the 128-byte swizzle; the tile 1024-byte aligned). The k-step s of a 64-wide tile starts 32·s
//     bytes into it.
// Ordering: wgmma_fence() before the first wgmma that reads registers written by ordinary instructions
// (the A fragments, an accumulator the thread touched); shared memory written by ordinary stores or
// cp.async must be followed by fence_proxy_async() (by the writing threads) and a barrier before a
// wgmma reads it; wgmma_commit() closes a group, wgmma_wait<N>() waits until at most N are pending, after
// which the accumulators may be read (pin them with wgmma_pin so the compiler keeps them in place).
#pragma once
#include <stdint.h>

__device__ __forceinline__ void wgmma_fence() { asm volatile("wgmma.fence.sync.aligned;\n" ::: "memory"); }
__device__ __forceinline__ void wgmma_commit() { asm volatile("wgmma.commit_group.sync.aligned;\n" ::: "memory"); }
template <int N>
__device__ __forceinline__ void wgmma_wait() {
    asm volatile("wgmma.wait_group.sync.aligned %0;\n" ::"n"(N) : "memory");
}
__device__ __forceinline__ void fence_proxy_async() { asm volatile("fence.proxy.async.shared::cta;\n" ::: "memory"); }

// Keeps an accumulator array where it is across the asynchronous MMA (no copies, no reordering).
template <int N>
__device__ __forceinline__ void wgmma_pin(float (&d)[N]) {
#pragma unroll
    for (int i = 0; i < N; ++i) asm volatile("" : "+f"(d[i])::"memory");
}

// Descriptor of a K-major 16-bit tile at shared address `saddr` (1024-byte aligned, plus 32·s for k-step
// s): start address >> 4 (bits 0-13), leading-dimension offset 16 bytes (unused with this swizzle), stride
// offset 1024 bytes (8 rows of 128), swizzle mode 1 = 128 bytes (bits 62-63).
__device__ __forceinline__ uint64_t wgmma_desc_sw128(uint32_t saddr) {
    return (uint64_t)((saddr & 0x3FFFFu) >> 4) | ((uint64_t)(16 >> 4) << 16) | ((uint64_t)(1024 >> 4) << 32) | (1ull << 62);
}

// The accumulator operands and their placeholders, 16, 32 and 64 registers.
#define WG_D16(d)                                                                                                   \
    "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3]), "+f"(d[4]), "+f"(d[5]), "+f"(d[6]), "+f"(d[7]), "+f"(d[8]),     \
        "+f"(d[9]), "+f"(d[10]), "+f"(d[11]), "+f"(d[12]), "+f"(d[13]), "+f"(d[14]), "+f"(d[15])
#define WG_D32(d)                                                                                                   \
    "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3]), "+f"(d[4]), "+f"(d[5]), "+f"(d[6]), "+f"(d[7]), "+f"(d[8]),     \
        "+f"(d[9]), "+f"(d[10]), "+f"(d[11]), "+f"(d[12]), "+f"(d[13]), "+f"(d[14]), "+f"(d[15]), "+f"(d[16]),      \
        "+f"(d[17]), "+f"(d[18]), "+f"(d[19]), "+f"(d[20]), "+f"(d[21]), "+f"(d[22]), "+f"(d[23]), "+f"(d[24]),     \
        "+f"(d[25]), "+f"(d[26]), "+f"(d[27]), "+f"(d[28]), "+f"(d[29]), "+f"(d[30]), "+f"(d[31])
#define WG_D64(d)                                                                                                   \
    WG_D32(d), "+f"(d[32]), "+f"(d[33]), "+f"(d[34]), "+f"(d[35]), "+f"(d[36]), "+f"(d[37]), "+f"(d[38]),           \
        "+f"(d[39]), "+f"(d[40]), "+f"(d[41]), "+f"(d[42]), "+f"(d[43]), "+f"(d[44]), "+f"(d[45]), "+f"(d[46]),     \
        "+f"(d[47]), "+f"(d[48]), "+f"(d[49]), "+f"(d[50]), "+f"(d[51]), "+f"(d[52]), "+f"(d[53]), "+f"(d[54]),     \
        "+f"(d[55]), "+f"(d[56]), "+f"(d[57]), "+f"(d[58]), "+f"(d[59]), "+f"(d[60]), "+f"(d[61]), "+f"(d[62]),     \
        "+f"(d[63])
#define WG_R16 "%0, %1, %2, %3, %4, %5, %6, %7, %8, %9, %10, %11, %12, %13, %14, %15"
#define WG_R32                                                                                                     \
    "%0, %1, %2, %3, %4, %5, %6, %7, %8, %9, %10, %11, %12, %13, %14, %15, "                                       \
    "%16, %17, %18, %19, %20, %21, %22, %23, %24, %25, %26, %27, %28, %29, %30, %31"
#define WG_R64                                                                                                     \
    WG_R32 ", %32, %33, %34, %35, %36, %37, %38, %39, %40, %41, %42, %43, %44, %45, %46, %47, "                    \
           "%48, %49, %50, %51, %52, %53, %54, %55, %56, %57, %58, %59, %60, %61, %62, %63"

#define WG_RS_ASM(shape, type, rlist, A, DESC, ACC)                                                             \
    "{\n.reg .pred p;\nsetp.ne.b32 p, " ACC ", 0;\n"                                                               \
    "wgmma.mma_async.sync.aligned." shape ".f32." type "." type " {" rlist "}, {" A "}, " DESC ", p, 1, 1, 0;\n}\n"
#define WG_RS_STMT(shape, type, dlist, rlist, A, DESC, ACC)                                                     \
    asm volatile(WG_RS_ASM(shape, type, rlist, A, DESC, ACC)                                                   \
                 : dlist(d)                                                                                    \
                 : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "l"(b_desc), "r"(accumulate))
// D[64 x N] (+)= A[64 x 16] · B[16 x N] with nd = N / 2 accumulators a thread: A from registers (the
// m16n8k16 A layout per warp), B by descriptor (K-major), D in f32; accumulate = 0 overwrites D. A and B
// in bf16, or in f16 (F16). A, DESC, ACC: the operand numbers after the nd accumulators.
#define WG_RS_FN(name, shape, nd, dlist, rlist, A, DESC, ACC)                                                   \
    template <bool F16 = false>                                                                                \
    __device__ __forceinline__ void name(float(&d)[nd], const uint32_t(&a)[4], uint64_t b_desc, int accumulate) { \
        if constexpr (F16)                                                                                     \
            WG_RS_STMT(shape, "f16", dlist, rlist, A, DESC, ACC);                                              \
        else                                                                                                   \
            WG_RS_STMT(shape, "bf16", dlist, rlist, A, DESC, ACC);                                             \
    }

// wgmma_m64n32k16_rs<F16>(d[16], a, b_desc, accumulate), wgmma_m64n64k16_rs<F16>(d[32], ...) and
// wgmma_m64n128k16_rs<F16>(d[64], ...).
WG_RS_FN(wgmma_m64n32k16_rs, "m64n32k16", 16, WG_D16, WG_R16, "%16, %17, %18, %19", "%20", "%21")
WG_RS_FN(wgmma_m64n64k16_rs, "m64n64k16", 32, WG_D32, WG_R32, "%32, %33, %34, %35", "%36", "%37")
WG_RS_FN(wgmma_m64n128k16_rs, "m64n128k16", 64, WG_D64, WG_R64, "%64, %65, %66, %67", "%68", "%69")

// D[64 x 128] (+)= A[64 x 16] · B[16 x 128], f16, both operands by descriptor (K-major, as B above).
__device__ __forceinline__ void wgmma_m64n128k16_ss_f16(float (&d)[64], uint64_t a_desc, uint64_t b_desc, int accumulate) {
    asm volatile("{\n.reg .pred p;\nsetp.ne.b32 p, %66, 0;\n"
                 "wgmma.mma_async.sync.aligned.m64n128k16.f32.f16.f16 {" WG_R64 "}, %64, %65, p, 1, 1, 0, 0;\n}\n"
                 : WG_D64(d)
                 : "l"(a_desc), "l"(b_desc), "r"(accumulate));
}

// D[64 x 64] (+)= A[64 x 16] · B[16 x 64], bf16, both operands by descriptor (K-major, as B above).
__device__ __forceinline__ void wgmma_m64n64k16_ss(float (&d)[32], uint64_t a_desc, uint64_t b_desc, int accumulate) {
    asm volatile("{\n.reg .pred p;\nsetp.ne.b32 p, %34, 0;\n"
                 "wgmma.mma_async.sync.aligned.m64n64k16.f32.bf16.bf16 {" WG_R32 "}, %32, %33, p, 1, 1, 0, 0;\n}\n"
                 : WG_D32(d)
                 : "l"(a_desc), "l"(b_desc), "r"(accumulate));
}

// Four 8×8 b16 matrices from D fragments into shared memory, each transposed: register i of lane
// (g, q) holds elements (g, 2q) (low half) and (g, 2q + 1) of matrix i, and lane 8i + c names the
// address of the 16 bytes that receive column c of matrix i (its elements (0..7, c) in row order).
// For the epilogues that write rows of D's columns (a token's consecutive outputs) 16 bytes at a time.
__device__ __forceinline__ void stmatrix_x4_trans(uint32_t addr, uint32_t r0, uint32_t r1, uint32_t r2, uint32_t r3) {
    asm volatile("stmatrix.sync.aligned.m8n8.x4.trans.shared.b16 [%0], {%1, %2, %3, %4};" ::"r"(addr), "r"(r0), "r"(r1), "r"(r2), "r"(r3)
                 : "memory");
}

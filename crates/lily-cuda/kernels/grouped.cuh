// The grouped (MoE prefill) GEMMs' work split, shared by gemm.cu and gemm_wgmma.cu: E experts, a device
// array offsets[E + 1] (slots offsets[e] .. offsets[e + 1] use expert e, clamped to n); one grid
// dimension covers the worst case ceil(n / bm) + E token tiles, and the block with token-tile index mt
// finds its (expert, tile) from a block-wide scan of the per-expert tile counts, or exits.
#pragma once
#include <stdint.h>

// Which (expert, first slot, end slot) the block of token-tile index mt handles; false if none. THREADS
// threads (the block), E <= 2 * THREADS. All threads must call it (it synchronises).
template <int THREADS>
__device__ __forceinline__ bool find_group_tile(const uint32_t* offsets, int n_slots, int E, int bm, int mt, int& expert, int& m_begin, int& m_end) {
    __shared__ int warp_tot[THREADS / 32];
    __shared__ int found[3];
    const int tid = threadIdx.x, lane = tid & 31, warp = tid >> 5;
    const unsigned n = (unsigned)n_slots;
    // Thread tid covers experts 2*tid and 2*tid + 1.
    int first[2], cnt[2], tiles[2];
#pragma unroll
    for (int k = 0; k < 2; ++k) {
        const int e = 2 * tid + k;
        first[k] = 0;
        cnt[k] = 0;
        if (e < E) {
            const unsigned a = min(offsets[e], n);
            const unsigned b = min(offsets[e + 1], n);
            first[k] = (int)a;
            cnt[k] = b > a ? (int)(b - a) : 0;
        }
        tiles[k] = (cnt[k] + bm - 1) / bm;
    }
    const int local = tiles[0] + tiles[1];
    int incl = local;
#pragma unroll
    for (int o = 1; o < 32; o <<= 1) {
        const int v = __shfl_up_sync(0xffffffffu, incl, o);
        if (lane >= o) incl += v;
    }
    if (lane == 31) warp_tot[warp] = incl;
    if (tid == 0) found[0] = -1;
    __syncthreads();
    int before = 0;
    for (int w = 0; w < warp; ++w) before += warp_tot[w];
    const int start = before + incl - local;  // tiles before expert 2*tid
    if (mt >= start && mt < start + local) {
        const bool k = mt >= start + tiles[0];  // the second expert of this thread
        const int j = mt - start - (k ? tiles[0] : 0);
        const int f = k ? first[1] : first[0];
        found[0] = 2 * tid + (k ? 1 : 0);
        found[1] = f + j * bm;
        found[2] = f + (k ? cnt[1] : cnt[0]);
    }
    __syncthreads();
    expert = found[0];
    m_begin = found[1];
    m_end = min(found[2], m_begin + bm);
    return expert >= 0;
}

// The persistent kernels' form: the token tiles' prefix over experts, once a block. prefix[e] = token
// tiles of experts before e (prefix[E] = all of them), E <= 2 * THREADS, `prefix` in shared memory of
// E + 1 ints. All threads must call it (it synchronises); returns prefix[E].
template <int THREADS>
__device__ __forceinline__ int group_tile_prefix(const uint32_t* offsets, int n_slots, int E, int bm, int* prefix) {
    __shared__ int warp_tot[THREADS / 32];
    const int tid = threadIdx.x, lane = tid & 31, warp = tid >> 5;
    const unsigned n = (unsigned)n_slots;
    int tiles[2];
#pragma unroll
    for (int k = 0; k < 2; ++k) {
        const int e = 2 * tid + k;
        tiles[k] = 0;
        if (e < E) {
            const unsigned a = min(offsets[e], n), b = min(offsets[e + 1], n);
            tiles[k] = b > a ? (int)((b - a + bm - 1) / bm) : 0;
        }
    }
    const int local = tiles[0] + tiles[1];
    int incl = local;
#pragma unroll
    for (int o = 1; o < 32; o <<= 1) {
        const int v = __shfl_up_sync(0xffffffffu, incl, o);
        if (lane >= o) incl += v;
    }
    if (lane == 31) warp_tot[warp] = incl;
    __syncthreads();
    int before = 0;
    for (int w = 0; w < warp; ++w) before += warp_tot[w];
    const int start = before + incl - local;
    if (2 * tid < E) prefix[2 * tid] = start;
    if (2 * tid + 1 < E) prefix[2 * tid + 1] = start + tiles[0];
    if (tid == THREADS - 1) prefix[E] = before + incl;
    __syncthreads();
    return prefix[E];
}

// Token tile mt (< prefix[E]) of group_tile_prefix's split: its expert (the last e with prefix[e] <= mt,
// by bisection) and slots [m_begin, m_end).
__device__ __forceinline__ void group_tile_at(const int* prefix, const uint32_t* offsets, int n_slots, int E, int bm, int mt, int& expert,
                                              int& m_begin, int& m_end) {
    int lo = 0, hi = E;  // prefix[lo] <= mt < prefix[hi]
    while (hi - lo > 1) {
        const int mid = (lo + hi) >> 1;
        if (prefix[mid] <= mt) lo = mid;
        else hi = mid;
    }
    const int first = (int)min(offsets[lo], (unsigned)n_slots);
    const int end = (int)min(offsets[lo + 1], (unsigned)n_slots);
    expert = lo;
    m_begin = first + (mt - prefix[lo]) * bm;
    m_end = min(end, m_begin + bm);
}

// The grouped (MoE prefill) GEMMs' work split, shared by gemm.cu and gemm_wgmma.cu: E experts, a device
// array offsets[E + 1] (slots offsets[e] .. offsets[e + 1] use expert e, clamped to n); one grid
// dimension covers the worst case ceil(n / bm) + E token tiles, and the block with token-tile index mt
// finds its (expert, tile) from a block-wide scan of the per-expert tile counts, or exits.
#pragma once
#include <stdint.h>

// The block-wide scan both forms share: thread tid covers experts 2·tid and 2·tid + 1 (their first
// slots, slot counts and token tiles of bm), and gets the tiles of the experts before 2·tid; returns
// the tiles of all experts. E <= 2 * THREADS; all threads must call it (it synchronises once, and
// `warp_tot` may be reused after a second barrier).
template <int THREADS>
__device__ __forceinline__ int expert_tile_scan(const uint32_t* offsets, int n_slots, int E, int bm, int (&first)[2], int (&cnt)[2],
                                                int (&tiles)[2], int& start, int* warp_tot) {
    const int tid = threadIdx.x, lane = tid & 31, warp = tid >> 5;
    const unsigned n = (unsigned)n_slots;
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
    __syncthreads();
    int before = 0, total = 0;
    for (int w = 0; w < THREADS / 32; ++w) {
        if (w < warp) before += warp_tot[w];
        total += warp_tot[w];
    }
    start = before + incl - local;
    return total;
}

// Which (expert, first slot, end slot) the block of token-tile index mt handles; false if none. THREADS
// threads (the block), E <= 2 * THREADS. All threads must call it (it synchronises).
template <int THREADS>
__device__ __forceinline__ bool find_group_tile(const uint32_t* offsets, int n_slots, int E, int bm, int mt, int& expert, int& m_begin, int& m_end) {
    __shared__ int warp_tot[THREADS / 32];
    __shared__ int found[3];
    const int tid = threadIdx.x;
    if (tid == 0) found[0] = -1;
    int first[2], cnt[2], tiles[2], start;
    expert_tile_scan<THREADS>(offsets, n_slots, E, bm, first, cnt, tiles, start, warp_tot);
    const int local = tiles[0] + tiles[1];
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
    const int tid = threadIdx.x;
    int first[2], cnt[2], tiles[2], start;
    const int total = expert_tile_scan<THREADS>(offsets, n_slots, E, bm, first, cnt, tiles, start, warp_tot);
    if (2 * tid < E) prefix[2 * tid] = start;
    if (2 * tid + 1 < E) prefix[2 * tid + 1] = start + tiles[0];
    if (tid == 0) prefix[E] = total;
    __syncthreads();
    return total;
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

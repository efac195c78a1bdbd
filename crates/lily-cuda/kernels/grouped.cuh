// The grouped (MoE prefill) GEMMs' work split, shared by gemm.cu and gemm_wgmma.cu: E experts, a device
// array offsets[E + 1] (slots offsets[e] .. offsets[e + 1] use expert e, clamped to n); the grid's x
// covers the worst case ceil(n / bm) + E token tiles, and block x finds its (expert, tile) from a
// block-wide scan of the per-expert tile counts, or exits.
#pragma once
#include <stdint.h>

// A mixed split (split != 0) covers each expert with tiles of two sizes in two launches, so that no
// expert leaves most of a big tile empty: with big = 2·bm_small, expert e of c slots takes
// n_big = c / big + (c % big > big / 2) tiles of `big` slots (split 1, bm = big: slots [first,
// first + min(c, n_big·big))), and what is left, at most big / 2 slots, one tile of bm = big / 2
// (split 2). split 0: every expert in tiles of bm.
// The slots of expert e under split `split`: (first slot, count) from its (first, c), tiles of bm.
__device__ __forceinline__ void split_range(int split, int bm, int& first, int& cnt) {
    if (split == 0) return;
    const int big = split == 1 ? bm : 2 * bm;
    const int n_big = cnt / big + (cnt % big > big / 2 ? 1 : 0);
    const int covered = min(cnt, n_big * big);
    if (split == 1) {
        cnt = covered;
    } else {
        first += covered;
        cnt -= covered;
    }
}

// Which (expert, first slot, end slot) block blockIdx.x handles; false if none. THREADS threads (the
// block), E <= 2 * THREADS. All threads must call it (it synchronises). `split`: see split_range.
template <int THREADS>
__device__ __forceinline__ bool find_group_tile(const uint32_t* offsets, int n_slots, int E, int bm, int& expert, int& m_begin, int& m_end,
                                                int split = 0) {
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
            split_range(split, bm, first[k], cnt[k]);
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
    const int mt = blockIdx.x;
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

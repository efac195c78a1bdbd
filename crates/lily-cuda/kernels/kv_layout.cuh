// The bf16 KV cache's layouts, shared by everything that writes or reads it (attn_prep.cu appends,
// attention.cu and attn_prefill.cu read):
//   K [cap, kvh, hd]: position-major (a position's row of a KV head is hd contiguous values).
//   V in tiles of KV_TILE positions, [kvh, cap / KV_TILE, hd, KV_TILE]: for each KV head, tile after
//     tile, and within a tile the transpose [hd][KV_TILE] (each dim's KV_TILE positions contiguous), so
//     that the second product's operand loads as tensor-core fragments without a transpose and a tile
//     of positions is one contiguous run of KV_TILE·hd values (a decode stage is one 16 KB read at
//     hd = 256, where the untiled transpose [kvh, hd, cap] scattered it as hd runs of 64 bytes).
// cap is a multiple of KV_TILE (the callers check).
#pragma once

#define KV_TILE 32

// Element offset of V (kv head kv, dim d, position pos) in a cache of cap positions of head dim hd.
__device__ __forceinline__ long long vt_index(int kv, int d, int pos, int hd, int cap) {
    return ((long long)kv * cap + (pos & ~(KV_TILE - 1))) * hd + (long long)d * KV_TILE + (pos & (KV_TILE - 1));
}

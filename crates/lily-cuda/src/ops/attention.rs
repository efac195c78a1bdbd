//! Decode attention over an f32 KV cache (`kernels/attention.cu`), the maths of
//! `lily_cpu::attention::forward` after RoPE for one new token: query head h reads KV head h / (nh/kvh),
//! `scores = (q·k)/√hd` over positions `0..n` (the new token already appended), softmax in f32,
//! `o = Σ p·v`.
//!
//! Layouts: q [nh, hd] (already normed and rotated); K and V caches [pos, kvh, hd] (position-major, as
//! `lily_cpu::attention::KvCache`); out [nh, hd]. Split-KV (flash-decoding): one block per
//! (slice of positions, KV head) for all (up to 8 of) the group's query heads, so each K/V row is read
//! once per group; then a combine launch merges the per-split partials (m, l, acc) kept in `scratch`
//! ([`scratch_len`] elements).

use cudarc::driver::{DevicePtr, DevicePtrMut, DeviceRepr, LaunchConfig};

use super::{addr, addr_mut, launch, Scalar};
use crate::{CudaError, Device, Result};

/// Must match `struct AttnDecodeParams` in `kernels/attention.cu`.
#[repr(C)]
#[derive(Clone, Copy, Debug, Default)]
struct AttnDecodeParams {
    q: u64,
    k: u64,
    v: u64,
    part_ml: u64,
    part_acc: u64,
    out: u64,
    n_dev: u64,
    n: i32,
    nh: i32,
    kvh: i32,
    hd: i32,
    chunk: i32,
    splits: i32,
    scale: f32,
    pad: i32,
}
// SAFETY: plain old data with the kernel's layout.
unsafe impl DeviceRepr for AttnDecodeParams {}

pub(crate) const KERNELS: &[&str] = &[
    "attn_decode_split_d32",
    "attn_decode_split_d64",
    "attn_decode_split_d128",
    "attn_decode_split_d256",
    "attn_decode_combine",
];

/// The most KV splits of one call (bounds the scratch).
pub const MAX_SPLITS: usize = 256;
/// The fewest positions per split (8 per warp) before the split count is capped.
pub const MIN_CHUNK: usize = 32;
/// Query heads per block (a larger group takes several blocks per KV slice).
const MAX_GROUP_PER_BLOCK: usize = 8;
const WARPS: u32 = 4;

/// (splits, positions per split) for a cache of `n` positions: every split is non-empty.
pub fn splits_for(n: usize) -> (usize, usize) {
    let target = n.div_ceil(MIN_CHUNK).clamp(1, MAX_SPLITS);
    let chunk = n.div_ceil(target).max(1);
    (n.div_ceil(chunk).max(1), chunk)
}

/// Elements of f32 scratch [`decode`] needs for `nh` query heads of `hd` (any n).
pub fn scratch_len(nh: usize, hd: usize) -> usize {
    nh * MAX_SPLITS * (hd + 2)
}

/// `out[h] = Σ_p softmax_p(q[h]·k[p, h/(nh/kvh)] / √hd) · v[p, h/(nh/kvh)]` over positions `0..n` of the
/// caches. q, out: [nh, hd]; k_cache, v_cache: [≥ n, kvh, hd]; scratch: ≥ [`scratch_len`]`(nh, hd)`.
/// hd ∈ {32, 64, 128, 256}; nh a multiple of kvh; n ≥ 1. `out` must not alias the inputs.
/// n may be read on the device instead ([`Scalar::Device`], bounded by `max`: the caches must hold `max`
/// rows); the grid then covers [`MAX_SPLITS`] splits, and those past the device n's split count exit at once.
#[allow(clippy::too_many_arguments)]
#[allow(clippy::manual_is_multiple_of)]
pub fn decode<Q, K, V, O, S>(
    dev: &Device,
    q: &Q,
    k_cache: &K,
    v_cache: &V,
    n: Scalar<'_>,
    nh: usize,
    kvh: usize,
    hd: usize,
    out: &mut O,
    scratch: &mut S,
) -> Result<()>
where
    Q: DevicePtr<f32>,
    K: DevicePtr<f32>,
    V: DevicePtr<f32>,
    O: DevicePtrMut<f32>,
    S: DevicePtrMut<f32>,
{
    let (n, n_dev) = n.split(dev, "attention decode n")?;
    let name = match hd {
        32 => "attn_decode_split_d32",
        64 => "attn_decode_split_d64",
        128 => "attn_decode_split_d128",
        256 => "attn_decode_split_d256",
        _ => return Err(CudaError::Shape(format!("attention decode: head dim {hd} (32, 64, 128 or 256)"))),
    };
    if n == 0 || nh == 0 || kvh == 0 || nh % kvh != 0 || n.checked_mul(kvh * hd).is_none_or(|c| c > i32::MAX as usize) {
        return Err(CudaError::Shape(format!("attention decode: n {n}, nh {nh}, kvh {kvh}, hd {hd}")));
    }
    let (splits, chunk) = splits_for(n);
    let cache = n * kvh * hd;
    let s = addr_mut(dev, scratch, scratch_len(nh, hd), "attention decode scratch")?;
    let p = AttnDecodeParams {
        q: addr(dev, q, nh * hd, "attention decode q")?,
        k: addr(dev, k_cache, cache, "attention decode k_cache")?,
        v: addr(dev, v_cache, cache, "attention decode v_cache")?,
        part_ml: s,
        part_acc: s + (nh * MAX_SPLITS * 2 * 4) as u64,
        out: addr_mut(dev, out, nh * hd, "attention decode out")?,
        n_dev,
        n: n as i32,
        nh: nh as i32,
        kvh: kvh as i32,
        hd: hd as i32,
        chunk: chunk as i32,
        splits: splits as i32,
        scale: 1.0 / (hd as f32).sqrt(),
        pad: 0,
    };
    if hd >= 128 && [p.q, p.k, p.v].iter().any(|a| a % 16 != 0) {
        return Err(CudaError::Shape("attention decode: q/k/v not 16-byte aligned".into()));
    }
    let group = nh / kvh;
    let cfg = LaunchConfig {
        grid_dim: (if n_dev != 0 { MAX_SPLITS } else { splits } as u32, kvh as u32, group.div_ceil(MAX_GROUP_PER_BLOCK) as u32),
        block_dim: (32 * WARPS, 1, 1),
        shared_mem_bytes: 0,
    };
    launch(dev, name, cfg, &p)?;
    let cfg = LaunchConfig { grid_dim: (nh as u32, 1, 1), block_dim: (hd.min(256) as u32, 1, 1), shared_mem_bytes: 0 };
    launch(dev, "attn_decode_combine", cfg, &p)
}

//! Decode attention over the bf16 KV cache (`kernels/attention.cu`), the maths of
//! `lily_cpu::attention::forward` after RoPE for one new token: query head h reads KV head h / (nh/kvh),
//! `scores = (q·k)/√hd` over positions `0..n` (the new token already appended), softmax in f32,
//! `o = Σ p·v`, and with a gate `o ← o · sigmoid(gate)`.
//!
//! Layouts: q, gate, out [nh, hd] f32 (q already normed and rotated); the K cache [cap, kvh, hd] bf16
//! (position-major), the V cache bf16 in transposed tiles of 32 positions (`attn_prep::v_index`). Split-KV
//! (flash-decoding) on the tensor cores with q and p split into bf16 hi + lo (products near f32; only
//! the cache's own bf16 rounding remains): one block per (slice of positions, KV head) for all (up to 8
//! of) the group's query heads, so each K/V row is read once per group; then a combine launch merges
//! the per-split partials (m, l, acc) kept in `scratch` ([`scratch_len`] elements) and applies the gate.

use cudarc::driver::sys::CUfunction_attribute;
use cudarc::driver::{DevicePtr, DevicePtrMut, DeviceRepr, LaunchConfig};
use half::bf16;

use super::{addr, addr_mut, launch, Scalar};
use crate::{CudaError, Device, Result};

/// Must match `struct AttnDecodeParams` in `kernels/attention.cu`.
#[repr(C)]
#[derive(Clone, Copy, Debug, Default)]
struct AttnDecodeParams {
    q: u64,
    k: u64,
    vt: u64,
    gate: u64,
    part_ml: u64,
    part_acc: u64,
    out: u64,
    n_dev: u64,
    n: i32,
    nh: i32,
    kvh: i32,
    cap: i32,
    max_splits: i32,
    scale: f32,
    hd: i32,
    pad: i32,
}
// SAFETY: plain old data with the kernel's layout.
unsafe impl DeviceRepr for AttnDecodeParams {}

/// (head dim, warps, kernel).
const VARIANTS: [(usize, u32, &str); 4] =
    [(32, 2, "attn_decode_d32"), (64, 4, "attn_decode_d64"), (128, 4, "attn_decode_d128"), (256, 4, "attn_decode_d256")];

/// (head dim, warps, kernel) with a three-stage ring.
const VARIANTS_S3: [(usize, u32, &str); 2] = [(128, 4, "attn_decode_d128_s3"), (256, 4, "attn_decode_d256_s3")];

pub(crate) const KERNELS: &[&str] = &[
    "attn_decode_d32",
    "attn_decode_d64",
    "attn_decode_d128",
    "attn_decode_d256",
    "attn_decode_d128_s3",
    "attn_decode_d256_s3",
    "attn_decode_combine",
];

/// The depth of the decode kernel's cp.async ring (stages of [`STAGE`] positions).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Ring {
    /// Three stages where the head dim has them (128, 256: measured faster from 32K, even at 4K,
    /// docs/PERF.md 2026-12-05 tenth session), else two; `LILY_ATTN_STAGES=2` (read once) keeps two.
    Auto,
    /// Two stages: one in flight while one is computed (every head dim).
    Two,
    /// Three stages: two in flight (head dims 128 and 256).
    Three,
}

impl Ring {
    fn resolve(self, hd: usize) -> Ring {
        static THREE: std::sync::OnceLock<bool> = std::sync::OnceLock::new();
        match self {
            Ring::Auto if *THREE.get_or_init(|| std::env::var("LILY_ATTN_STAGES").map_or(true, |v| v != "2")) && VARIANTS_S3.iter().any(|v| v.0 == hd) => Ring::Three,
            Ring::Auto => Ring::Two,
            r => r,
        }
    }
    const fn stages(self) -> usize {
        if matches!(self, Ring::Three) { 3 } else { 2 }
    }
}

/// The most KV splits of one call (bounds the scratch).
pub const MAX_SPLITS: usize = 256;
/// Positions per pipeline stage; a split covers whole stages.
pub const STAGE: usize = 32;
const _: () = assert!(STAGE == super::attn_prep::V_TILE); // a stage is one tile of the V cache
/// Query heads per block (a larger group takes several blocks per KV slice).
const MAX_GROUP_PER_BLOCK: usize = 8;

/// Dynamic shared memory of the head-dim-`hd` kernel with `ring`'s depth: a stage holds K [32][hd] (rows
/// padded) and Vᵀ [hd][32].
pub fn smem_bytes(hd: usize, ring: Ring) -> usize {
    let kp = 2 * hd + if (hd / 2).is_multiple_of(32) { 64 } else { 0 };
    ring.stages() * (STAGE * kp + hd * 2 * STAGE)
}

pub(crate) fn configure(dev: &Device) -> Result<()> {
    let two = VARIANTS.iter().map(|&(hd, _, name)| (smem_bytes(hd, Ring::Two), name));
    let three = VARIANTS_S3.iter().map(|&(hd, _, name)| (smem_bytes(hd, Ring::Three), name));
    for (need, name) in two.chain(three) {
        dev.function(name)?.set_attribute(CUfunction_attribute::CU_FUNC_ATTRIBUTE_MAX_DYNAMIC_SHARED_SIZE_BYTES, need as i32)?;
    }
    Ok(())
}

/// (splits, stages per split) for `n` positions with at most `max_splits`: every split is non-empty
/// (the kernel's rule when it reads n on the device).
pub fn splits_for(n: usize, max_splits: usize) -> (usize, usize) {
    let stages = n.div_ceil(STAGE);
    let want = stages.min(max_splits).max(1);
    let per = stages.div_ceil(want).max(1);
    (stages.div_ceil(per).max(1), per)
}

/// The split cap for `kvh` KV heads and `z` head blocks each: about two blocks per SM
/// (`LILY_ATTN_BLOCKS_PER_SM`, 1..=3, read once, for A/B benchmarks).
pub fn max_splits(dev: &Device, kvh: usize, z: usize) -> usize {
    static PER_SM: std::sync::OnceLock<usize> = std::sync::OnceLock::new();
    let per_sm = *PER_SM.get_or_init(|| {
        std::env::var("LILY_ATTN_BLOCKS_PER_SM").ok().and_then(|v| v.parse().ok()).filter(|v| (1..=3).contains(v)).unwrap_or(2)
    });
    (per_sm * dev.sm_count() as usize / (kvh * z).max(1)).clamp(1, MAX_SPLITS)
}

/// Elements of f32 scratch [`decode`] needs for `nh` query heads of `hd` (any n).
pub fn scratch_len(nh: usize, hd: usize) -> usize {
    nh * MAX_SPLITS * (hd + 2)
}

/// `out[h] = Σ_p softmax_p(q[h]·k[p, h/(nh/kvh)] / √hd) · v[p, h/(nh/kvh)]` over positions `0..n` of the
/// caches, times `sigmoid(gate[h])` elementwise when `gate` is given. q, gate, out: [nh, hd];
/// k_cache: [cap, kvh, hd] bf16; v_cache: bf16 at `attn_prep::v_index`; scratch: ≥ [`scratch_len`]`(nh, hd)`.
/// hd ∈ {32, 64, 128, 256}; nh a multiple of kvh; 1 ≤ n ≤ cap; cap a multiple of 32. `out` must not
/// alias the inputs. n may be read on the device instead ([`Scalar::Device`], bounded by `max` ≤ cap);
/// the grid then covers the split cap, and blocks past the device n's split count exit at once.
/// `ring` picks the pipeline depth ([`Ring::Auto`]: the default); [`Ring::Three`] refuses head dims
/// other than 128 and 256.
#[allow(clippy::too_many_arguments)]
pub fn decode<Q, K, V, G, O, S>(
    dev: &Device,
    ring: Ring,
    q: &Q,
    k_cache: &K,
    v_cache: &V,
    cap: usize,
    n: Scalar<'_>,
    nh: usize,
    kvh: usize,
    hd: usize,
    gate: Option<&G>,
    out: &mut O,
    scratch: &mut S,
) -> Result<()>
where
    Q: DevicePtr<f32>,
    K: DevicePtr<bf16>,
    V: DevicePtr<bf16>,
    G: DevicePtr<f32>,
    O: DevicePtrMut<f32>,
    S: DevicePtrMut<f32>,
{
    let (n, n_dev) = n.split(dev, "attention decode n")?;
    let ring = ring.resolve(hd);
    let variants: &[(usize, u32, &str)] = if ring == Ring::Three { &VARIANTS_S3 } else { &VARIANTS };
    let Some(&(_, warps, name)) = variants.iter().find(|v| v.0 == hd) else {
        return Err(CudaError::Shape(format!(
            "attention decode: head dim {hd} ({})",
            if ring == Ring::Three { "the three-stage ring takes 128 or 256" } else { "32, 64, 128 or 256" }
        )));
    };
    if n == 0 || n > cap || !cap.is_multiple_of(STAGE) || nh == 0 || kvh == 0 || !nh.is_multiple_of(kvh) || cap.checked_mul(kvh * hd).is_none_or(|c| c > i32::MAX as usize) {
        return Err(CudaError::Shape(format!("attention decode: n {n}, cap {cap}, nh {nh}, kvh {kvh}, hd {hd}")));
    }
    let z = (nh / kvh).div_ceil(MAX_GROUP_PER_BLOCK);
    let max_splits = max_splits(dev, kvh, z);
    let (splits, _) = splits_for(n, max_splits);
    let cache = cap * kvh * hd;
    let s = addr_mut(dev, scratch, scratch_len(nh, hd), "attention decode scratch")?;
    let p = AttnDecodeParams {
        q: addr(dev, q, nh * hd, "attention decode q")?,
        k: addr(dev, k_cache, cache, "attention decode k_cache")?,
        vt: addr(dev, v_cache, cache, "attention decode v_cache")?,
        gate: match gate {
            Some(g) => addr(dev, g, nh * hd, "attention decode gate")?,
            None => 0,
        },
        part_ml: s,
        part_acc: s + (nh * MAX_SPLITS * 2 * 4) as u64,
        out: addr_mut(dev, out, nh * hd, "attention decode out")?,
        n_dev,
        n: n as i32,
        nh: nh as i32,
        kvh: kvh as i32,
        cap: cap as i32,
        max_splits: max_splits as i32,
        scale: 1.0 / (hd as f32).sqrt(),
        hd: hd as i32,
        pad: 0,
    };
    if [p.q, p.k, p.vt].iter().any(|a| a % 16 != 0) {
        return Err(CudaError::Shape("attention decode: q and the caches must be 16-byte aligned".into()));
    }
    let cfg = LaunchConfig {
        grid_dim: (if n_dev != 0 { max_splits } else { splits } as u32, kvh as u32, z as u32),
        block_dim: (32 * warps, 1, 1),
        shared_mem_bytes: smem_bytes(hd, ring) as u32,
    };
    launch(dev, name, cfg, &p)?;
    let cfg = LaunchConfig { grid_dim: (nh as u32, hd.div_ceil(64) as u32, 1), block_dim: (256, 1, 1), shared_mem_bytes: 0 };
    launch(dev, "attn_decode_combine", cfg, &p)
}

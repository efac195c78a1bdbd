//! Per-token preparation of gated full attention (`kernels/attn_prep.cu`): the part of
//! `lily_cpu::attention::forward` between the q/k/v projections and the softmax, for T tokens at
//! positions `pos0..pos0+T` (T = 1 in decode): per-head RMSNorm of q and k with the folded weights,
//! partial NeoX RoPE on the first `rot` dims (angles computed in f64 from `pos0` in the kernel, as
//! `lily_cpu::attention::rope`; no table), the gate split out of q_proj's output, and K/V appended to the
//! caches. Also [`copy_rows`], which moves a cache to another capacity.
//!
//! Layouts: `qg` [T, nh, hd·(1+gated)] (each head's row `[query(hd) | gate(hd)]` when gated), `k`, `v`
//! [T, kvh, hd]; `q_out`, `gate_out` [T, nh, hd]. The KV cache is bf16 (rounded to nearest even):
//! K [capacity, kvh, hd] (position-major, as `lily_cpu::attention::KvCache`), V in transposed tiles of
//! [`V_TILE`] positions, [kvh, capacity / V_TILE, hd, V_TILE] ([`v_index`]; `kernels/kv_layout.cuh`), so
//! that decode and prefill attention (`ops::attention`, `ops::attn_prefill`) load both as tensor-core
//! fragments without a transpose, and a tile of positions is one contiguous read.

use cudarc::driver::{DevicePtr, DevicePtrMut, DeviceRepr, LaunchConfig};
use half::bf16;

use super::{addr, addr_mut, launch, Scalar};
use crate::{CudaError, Device, Result};

/// The shape of one full-attention layer (from `lily_model::ModelConfig`: num_attention_heads,
/// num_key_value_heads, head_dim, rotary_dim, rope_theta, rms_norm_eps, attn_output_gate).
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct AttnDims {
    /// Query heads.
    pub nh: usize,
    /// KV heads (nh is a multiple).
    pub kvh: usize,
    /// Head dim.
    pub hd: usize,
    /// Rotated dims (even, ≤ hd): pairs (i, i + rot/2).
    pub rot: usize,
    pub theta: f64,
    pub eps: f32,
    /// q_proj's rows hold `[query | gate]` per head.
    pub gated: bool,
}

/// Must match `struct AttnPrepParams` in `kernels/attn_prep.cu`.
#[repr(C)]
#[derive(Clone, Copy, Debug, Default)]
struct AttnPrepParams {
    qg: u64,
    k: u64,
    v: u64,
    q_norm: u64,
    k_norm: u64,
    q_out: u64,
    gate_out: u64,
    k_cache: u64,
    v_cache: u64,
    theta: f64,
    t: i32,
    nh: i32,
    kvh: i32,
    hd: i32,
    rot: i32,
    pos0: i32,
    gated: i32,
    eps: f32,
    pos_dev: u64,
    capacity: i32,
    pad: i32,
}
// SAFETY: plain old data with the kernel's layout.
unsafe impl DeviceRepr for AttnPrepParams {}

/// Must match `struct KvCopyParams` in `kernels/attn_prep.cu`.
#[repr(C)]
#[derive(Clone, Copy, Debug, Default)]
struct KvCopyParams {
    src: u64,
    dst: u64,
    src_pitch: i64,
    dst_pitch: i64,
    rows: i64,
    len: i64,
}
// SAFETY: plain old data with the kernel's layout.
unsafe impl DeviceRepr for KvCopyParams {}

pub(crate) const KERNELS: &[&str] = &["attn_prep", "attn_prep_chunk", "kv_copy_rows"];

/// Tokens from which [`prep`] runs the per-token kernel (`attn_prep_chunk`: 1.43 against 2.16 ms for a
/// 4K prompt on an H200) instead of the per-(token, head) one (decode: ~2 µs a launch faster; docs/PERF.md,
/// 2026-12-03 sixth session).
pub const CHUNK_MIN_TOKENS: usize = 16;

/// Positions in a tile of the V cache (`KV_TILE` in `kernels/kv_layout.cuh`); capacities are multiples of it.
pub const V_TILE: usize = 32;

/// Where V (KV head `kv`, dim `d`, position `pos`) lives in a V cache of `cap` positions (a multiple
/// of [`V_TILE`]) and head dim `hd`: tile `pos / V_TILE` of head `kv`, row `d`, column `pos % V_TILE`.
pub fn v_index(kv: usize, d: usize, pos: usize, hd: usize, cap: usize) -> usize {
    (kv * cap + pos / V_TILE * V_TILE) * hd + d * V_TILE + pos % V_TILE
}

/// Largest head dim of [`prep`] (8 rows of it in a block's shared memory, within the 48 KB default).
pub const MAX_HEAD_DIM: usize = 1024;

/// For T tokens at positions `pos0..pos0+t`, from the projections `qg` [T, nh·hd·(1+gated)], `k` and `v`
/// [T, kvh·hd]: writes `q_out` [T, nh, hd] (RMSNorm·q_norm, then RoPE), `gate_out` [T, nh, hd] (the gate
/// halves of `qg`; required iff `dims.gated`), and positions `pos0..pos0+t` of `k_cache` [capacity, kvh,
/// hd] (RMSNorm·k_norm, then RoPE) and `v_cache` (v as is, at [`v_index`]), both bf16 with capacity
/// ≥ pos0+t a multiple of [`V_TILE`]; their other positions are untouched. `q_norm`, `k_norm`: [hd], the folded
/// weights. hd ≤ [`MAX_HEAD_DIM`], rot even and ≤ hd. The position may be read on the device instead
/// ([`Scalar::Device`], bounded by `max`: the capacity must then be at least `max + t`).
#[allow(clippy::too_many_arguments)]
pub fn prep<QG, K, V, QN, KN, QO, GO, KC, VC>(
    dev: &Device,
    qg: &QG,
    k: &K,
    v: &V,
    q_norm: &QN,
    k_norm: &KN,
    dims: AttnDims,
    pos0: Scalar<'_>,
    t: usize,
    q_out: &mut QO,
    gate_out: Option<&mut GO>,
    k_cache: &mut KC,
    v_cache: &mut VC,
    capacity: usize,
) -> Result<()>
where
    QG: DevicePtr<f32>,
    K: DevicePtr<f32>,
    V: DevicePtr<f32>,
    QN: DevicePtr<f32>,
    KN: DevicePtr<f32>,
    QO: DevicePtrMut<f32>,
    GO: DevicePtrMut<f32>,
    KC: DevicePtrMut<bf16>,
    VC: DevicePtrMut<bf16>,
{
    let (pos0, pos_dev) = pos0.split(dev, "attention prep position")?;
    let AttnDims {
        nh,
        kvh,
        hd,
        rot,
        theta,
        eps,
        gated,
    } = dims;
    let bad = |why: &str| {
        Err(CudaError::Shape(format!(
            "attention prep: {why} (nh {nh}, kvh {kvh}, hd {hd}, rot {rot}, gated {gated}, pos0 {pos0}, t {t})"
        )))
    };
    if t == 0 || nh == 0 || kvh == 0 || hd == 0 {
        return bad("empty shape");
    }
    if hd > MAX_HEAD_DIM || rot > hd || rot % 2 != 0 {
        return bad("head dim must be ≤ 1024, rot even and ≤ hd");
    }
    if nh + kvh > 65535 || t > i32::MAX as usize {
        return bad("too many heads or tokens for one launch");
    }
    if gated != gate_out.is_some() {
        return bad("gate_out must be given exactly when gated");
    }
    let end = pos0.checked_add(t).filter(|e| *e <= i32::MAX as usize);
    let Some(end) = end else {
        return bad("positions overflow i32");
    };
    if end > capacity || !capacity.is_multiple_of(V_TILE) || capacity.checked_mul(kvh * hd).is_none_or(|c| c > i32::MAX as usize) {
        return bad(&format!("the caches' capacity {capacity} (a multiple of {V_TILE}, at least pos0 + t)"));
    }
    if !(theta.is_finite() && theta > 0.0 && eps.is_finite()) {
        return bad("theta must be finite and > 0, eps finite");
    }
    let per_head = if gated { 2 * hd } else { hd };
    let gate_addr = match gate_out {
        Some(g) => addr_mut(dev, g, t * nh * hd, "attention prep gate_out")?,
        None => 0,
    };
    let p = AttnPrepParams {
        qg: addr(dev, qg, t * nh * per_head, "attention prep qg")?,
        k: addr(dev, k, t * kvh * hd, "attention prep k")?,
        v: addr(dev, v, t * kvh * hd, "attention prep v")?,
        q_norm: addr(dev, q_norm, hd, "attention prep q_norm")?,
        k_norm: addr(dev, k_norm, hd, "attention prep k_norm")?,
        q_out: addr_mut(dev, q_out, t * nh * hd, "attention prep q_out")?,
        gate_out: gate_addr,
        k_cache: addr_mut(dev, k_cache, capacity * kvh * hd, "attention prep k_cache (capacity)")?,
        v_cache: addr_mut(dev, v_cache, capacity * kvh * hd, "attention prep v_cache (capacity)")?,
        theta,
        t: t as i32,
        nh: nh as i32,
        kvh: kvh as i32,
        hd: hd as i32,
        rot: rot as i32,
        pos0: pos0 as i32,
        gated: gated as i32,
        eps,
        pos_dev,
        capacity: capacity as i32,
        pad: 0,
    };
    if t < CHUNK_MIN_TOKENS {
        // Decode and short chunks: a block per (token, head), the most blocks at once.
        let cfg = LaunchConfig {
            grid_dim: (t as u32, (nh + kvh) as u32, 1),
            block_dim: (hd.div_ceil(32) as u32 * 32, 1, 1),
            shared_mem_bytes: 0,
        };
        return launch(dev, "attn_prep", cfg, &p);
    }
    // Prompt chunks: a block per (token, 8 heads) (PREP_WARPS in the kernel), the RoPE table once a block.
    const WARPS: usize = 8;
    let cfg = LaunchConfig {
        grid_dim: (t as u32, (nh + kvh).div_ceil(WARPS) as u32, 1),
        block_dim: (32 * WARPS as u32, 1, 1),
        shared_mem_bytes: (4 * (2 * (rot / 2) + WARPS * hd)) as u32,
    };
    launch(dev, "attn_prep_chunk", cfg, &p)
}

/// Copies the first `len` elements of each of `rows` rows: `dst[r·dst_pitch + i] = src[r·src_pitch + i]`
/// (a V cache moved to another capacity: rows = kvh, pitches capacity·hd, len the held positions'
/// tiles, [`v_tiles_len`]).
pub fn copy_rows<S: DevicePtr<bf16>, D: DevicePtrMut<bf16>>(
    dev: &Device,
    src: &S,
    src_pitch: usize,
    dst: &mut D,
    dst_pitch: usize,
    rows: usize,
    len: usize,
) -> Result<()> {
    if rows == 0 || len == 0 {
        return Ok(());
    }
    if len > src_pitch || len > dst_pitch {
        return Err(CudaError::Shape(format!("copy_rows: len {len} beyond a pitch ({src_pitch}, {dst_pitch})")));
    }
    let p = KvCopyParams {
        src: addr(dev, src, (rows - 1) * src_pitch + len, "copy_rows src")?,
        dst: addr_mut(dev, dst, (rows - 1) * dst_pitch + len, "copy_rows dst")?,
        src_pitch: src_pitch as i64,
        dst_pitch: dst_pitch as i64,
        rows: rows as i64,
        len: len as i64,
    };
    let blocks = (rows * len).div_ceil(256).min(dev.sm_count() as usize * 8) as u32;
    let cfg = LaunchConfig { grid_dim: (blocks, 1, 1), block_dim: (256, 1, 1), shared_mem_bytes: 0 };
    launch(dev, "kv_copy_rows", cfg, &p)
}

/// Elements of one KV head's V tiles that hold positions `0..held`: whole tiles ([`copy_rows`]'s `len`
/// when a V cache moves to another capacity).
pub fn v_tiles_len(held: usize, hd: usize) -> usize {
    held.div_ceil(V_TILE) * V_TILE * hd
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Every (head, dim, position) has its own place in the cache, and a tile of V_TILE positions of
    /// one head is one contiguous run of V_TILE·hd values, each dim's positions adjacent in it.
    #[test]
    fn v_index_is_a_tiled_transpose() {
        for (kvh, hd, cap) in [(2usize, 256usize, 128usize), (3, 40, 64), (1, 8, 32)] {
            let mut seen = vec![false; kvh * hd * cap];
            for kv in 0..kvh {
                for pos in 0..cap {
                    for d in 0..hd {
                        let i = v_index(kv, d, pos, hd, cap);
                        assert!(!seen[i], "({kv}, {d}, {pos}) shares index {i}");
                        seen[i] = true;
                        let tile_start = (kv * cap + pos / V_TILE * V_TILE) * hd;
                        assert!((tile_start..tile_start + V_TILE * hd).contains(&i));
                        if pos % V_TILE > 0 {
                            assert_eq!(i, v_index(kv, d, pos - 1, hd, cap) + 1, "positions of a dim adjacent");
                        }
                    }
                }
            }
            assert!(seen.iter().all(|&s| s));
            // A head's held positions are a prefix of its tiles: the copy length when the cache moves.
            let held = cap - 5;
            let last = (0..hd).map(|d| v_index(0, d, held - 1, hd, cap)).max().unwrap();
            assert!(last < v_tiles_len(held, hd) && v_tiles_len(held, hd) <= cap * hd);
        }
    }
}

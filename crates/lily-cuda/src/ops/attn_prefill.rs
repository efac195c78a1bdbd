//! Causal prefill attention over the bf16 KV cache (`kernels/attn_prefill.cu`): the softmax part of
//! `lily_cpu::attention::forward` for T new tokens at positions `pos0..pos0+T` whose K/V are already
//! in the cache (written by `ops::attn_prep::prep`). Query (t, h) attends to positions `0..=pos0+t` of KV
//! head h / (nh/kvh), scores `(q·k)/√hd`, softmax in f32, `o = Σ p·v`, and with a gate
//! `o ← o · sigmoid(gate)` (fused).
//!
//! Flash-attention 2 style on the tensor cores (mma.sync, bf16 q and p, f32 accumulation and softmax):
//! one block of 4 warps per (tile of 64 (token, head) rows of one GQA group, KV head), so each K/V
//! tile of 32 positions is loaded into shared memory once for all the group's heads and 64/G tokens;
//! online softmax; no split over the KV length. The head-dim-256 variant needs 106 KiB of dynamic
//! shared memory ([`configure`] raises the limit at device open); two blocks fit an SM.
//!
//! A second form on Hopper's warpgroup MMA ([`Kernel::Wgmma`], head dims 128 and 256): one block of two
//! warpgroups per tile of 128 rows, K/V tiles of 64 positions in wgmma's swizzled layout, S = Q·Kᵀ with
//! both operands from shared memory and O += P·V with P from registers (193 KiB of shared memory at
//! head dim 256, one block an SM); [`Kernel::WgmmaOverlap`] is the same with each tile's softmax
//! overlapped with the previous tile's P·V, and what [`Kernel::Auto`] takes at those head dims (one
//! H200: 1.7× the mma.sync form's speed over a 128K prompt; `LILY_ATTN_WGMMA=0|1` for A/B runs).

use cudarc::driver::sys::CUfunction_attribute;
use cudarc::driver::{DevicePtr, DevicePtrMut, DeviceRepr, LaunchConfig};

use super::{addr, addr_mut, launch};
use crate::{CudaError, Device, Result};

/// Must match `struct AttnPrefillParams` in `kernels/attn_prefill.cu`.
#[repr(C)]
#[derive(Clone, Copy, Debug, Default)]
struct AttnPrefillParams {
    q: u64,
    k: u64,
    vt: u64,
    gate: u64,
    out: u64,
    t: i32,
    nh: i32,
    kvh: i32,
    pos0: i32,
    ntiles: i32,
    cap: i32,
    scale: f32,
    pad: i32,
}
// SAFETY: plain old data with the kernel's layout.
unsafe impl DeviceRepr for AttnPrefillParams {}

/// (head dim, kernel) for each supported head dim.
const VARIANTS: [(usize, &str); 4] = [
    (32, "attn_prefill_d32"),
    (64, "attn_prefill_d64"),
    (128, "attn_prefill_d128"),
    (256, "attn_prefill_d256"),
];

/// (head dim, kernel) of the wgmma forms: MMAs and softmax in turn, and overlapped.
const WG_VARIANTS: [(usize, &str); 2] = [(128, "attn_prefill_wg_d128"), (256, "attn_prefill_wg_d256")];
const WGO_VARIANTS: [(usize, &str); 2] = [(128, "attn_prefill_wgo_d128"), (256, "attn_prefill_wgo_d256")];

pub(crate) const KERNELS: &[&str] = &[
    "attn_prefill_d32",
    "attn_prefill_d64",
    "attn_prefill_d128",
    "attn_prefill_d256",
    "attn_prefill_wg_d128",
    "attn_prefill_wg_d256",
    "attn_prefill_wgo_d128",
    "attn_prefill_wgo_d256",
];

/// Which kernel form runs the attention.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Kernel {
    /// [`Kernel::WgmmaOverlap`] where the head dim has the wgmma forms (128, 256), else [`Kernel::Mma`];
    /// `LILY_ATTN_WGMMA` (read once, for A/B runs) picks another: `0` mma.sync, `1` wgmma, `2` overlapped.
    Auto,
    /// mma.sync m16n8k16, 64 rows a block (every head dim).
    Mma,
    /// wgmma, 128 rows a block (head dims 128 and 256): per KV tile S = Q·Kᵀ, softmax, O += P·V in turn.
    Wgmma,
    /// As [`Kernel::Wgmma`], with each tile's softmax overlapped with the previous tile's P·V
    /// (FlashAttention-3's intra-warpgroup pipelining).
    WgmmaOverlap,
}

impl Kernel {
    fn resolve(self, hd: usize) -> Kernel {
        match self {
            Kernel::Auto if WG_VARIANTS.iter().any(|(d, _)| *d == hd) => auto_form(),
            Kernel::Auto => Kernel::Mma,
            k => k,
        }
    }
}

/// The form [`Kernel::Auto`] takes where the head dim has the wgmma forms: the overlapped one (measured
/// fastest at every length, docs/PERF.md 2026-12-05 tenth session), or what `LILY_ATTN_WGMMA` asks for.
fn auto_form() -> Kernel {
    static FORM: std::sync::OnceLock<Kernel> = std::sync::OnceLock::new();
    *FORM.get_or_init(|| match std::env::var("LILY_ATTN_WGMMA").as_deref() {
        Ok("0") => Kernel::Mma,
        Ok("1") => Kernel::Wgmma,
        _ => Kernel::WgmmaOverlap,
    })
}

/// Query rows ((token, head) pairs of one GQA group) per block.
pub const ROWS_PER_BLOCK: usize = 64;
/// KV positions per shared-memory tile.
pub const KV_TILE: usize = 32;
const THREADS: u32 = 128;

/// Dynamic shared memory of the head-dim-`hd` kernel (bf16, rows padded by 16 bytes): Q [64][hd] and two
/// stages of K [32][hd] and Vᵀ [hd][32].
pub fn smem_bytes(hd: usize) -> usize {
    let row = 2 * hd + 16;
    ROWS_PER_BLOCK * row + 2 * (KV_TILE * row + hd * (2 * KV_TILE + 16))
}

/// Query rows per block of the wgmma form (two warpgroups of 64).
pub const WG_ROWS_PER_BLOCK: usize = 128;
/// KV positions per tile of the wgmma form.
pub const WG_KV_TILE: usize = 64;
const WG_THREADS: u32 = 256;

/// Dynamic shared memory of the wgmma form at head dim `hd`: Q [128][hd] and two stages of K [64][hd]
/// and Vᵀ [hd][64], bf16 without padding (the swizzle spreads the banks), plus 1 KiB to align the tiles
/// to 1024 bytes.
pub fn wg_smem_bytes(hd: usize) -> usize {
    2 * hd * WG_ROWS_PER_BLOCK + 2 * (2 * 2 * hd * WG_KV_TILE) + 1024
}

/// One-time function attributes (called by `Device::open`): lets each variant use the dynamic shared
/// memory it needs (above the default 48 KiB). A variant that does not fit this GPU is left as is;
/// [`prefill`] then refuses it.
pub(crate) fn configure(dev: &Device) -> Result<()> {
    let all = VARIANTS.iter().map(|&(hd, n)| (smem_bytes(hd), n));
    let wg = WG_VARIANTS.iter().chain(&WGO_VARIANTS).map(|&(hd, n)| (wg_smem_bytes(hd), n));
    for (need, name) in all.chain(wg) {
        if need <= dev.max_smem_optin() as usize {
            dev.function(name)?.set_attribute(
                CUfunction_attribute::CU_FUNC_ATTRIBUTE_MAX_DYNAMIC_SHARED_SIZE_BYTES,
                need as i32,
            )?;
        }
    }
    Ok(())
}

/// Causal attention of the T = `t` queries `q` [T, nh, hd] (positions `pos0..pos0+t`, normed and
/// rotated, their K/V already in the caches) over cache positions `0..pos0+t`: `out` [T, nh, hd], with
/// `out[t, h] = Σ_{p ≤ pos0+t} softmax_p(q[t, h]·k[p, h/(nh/kvh)] / √hd) · v[p, h/(nh/kvh)]`, times
/// `sigmoid(gate[t, h])` elementwise when `gate` [T, nh, hd] is given. Caches (bf16): K [cap, kvh, hd],
/// V at `attn_prep::v_index`, cap ≥ pos0+t a multiple of 32; positions past pos0+t are never read. hd ∈ {32, 64,
/// 128, 256}; nh a multiple of kvh; all buffers 16-byte aligned (any `CudaSlice`, or a view at a multiple
/// of 4 elements). `kernel` picks the form ([`Kernel::Auto`]: the default); the wgmma forms refuse head
/// dims other than 128 and 256.
#[allow(clippy::too_many_arguments)]
pub fn prefill<Q, K, V, G, O>(
    dev: &Device,
    kernel: Kernel,
    q: &Q,
    k_cache: &K,
    v_cache: &V,
    cap: usize,
    gate: Option<&G>,
    nh: usize,
    kvh: usize,
    hd: usize,
    pos0: usize,
    t: usize,
    out: &mut O,
) -> Result<()>
where
    Q: DevicePtr<f32>,
    K: DevicePtr<half::bf16>,
    V: DevicePtr<half::bf16>,
    G: DevicePtr<f32>,
    O: DevicePtrMut<f32>,
{
    let bad = |why: &str| {
        Err(CudaError::Shape(format!(
            "attention prefill: {why} (nh {nh}, kvh {kvh}, hd {hd}, pos0 {pos0}, t {t})"
        )))
    };
    let kernel = kernel.resolve(hd);
    let wg = kernel != Kernel::Mma;
    let (variants, rows_per_block, threads, smem): (&[(usize, &str)], _, _, _) = match kernel {
        Kernel::Wgmma => (&WG_VARIANTS, WG_ROWS_PER_BLOCK, WG_THREADS, wg_smem_bytes(hd)),
        Kernel::WgmmaOverlap => (&WGO_VARIANTS, WG_ROWS_PER_BLOCK, WG_THREADS, wg_smem_bytes(hd)),
        _ => (&VARIANTS, ROWS_PER_BLOCK, THREADS, smem_bytes(hd)),
    };
    let Some(&(_, name)) = variants.iter().find(|(d, _)| *d == hd) else {
        return bad(if wg { "the wgmma form takes head dims 128 and 256" } else { "head dim must be 32, 64, 128 or 256" });
    };
    if t == 0 || nh == 0 || kvh == 0 || !nh.is_multiple_of(kvh) {
        return bad("t, nh, kvh must be > 0 and nh a multiple of kvh");
    }
    let group = nh / kvh;
    let rows = t.checked_mul(group).filter(|r| *r <= i32::MAX as usize);
    let end = pos0.checked_add(t).filter(|e| *e <= i32::MAX as usize);
    let (Some(rows), Some(end)) = (rows, end) else {
        return bad("too many tokens or positions");
    };
    if end > cap || !cap.is_multiple_of(KV_TILE) || cap.checked_mul(kvh * hd).is_none_or(|c| c > i32::MAX as usize) {
        return bad(&format!("cache capacity {cap} (a multiple of {KV_TILE}, at least pos0 + t)"));
    }
    let ntiles = rows.div_ceil(rows_per_block);
    if ntiles
        .checked_mul(kvh)
        .is_none_or(|b| b > i32::MAX as usize)
    {
        return bad("too many blocks");
    }
    if smem > dev.max_smem_optin() as usize {
        return bad(&format!(
            "needs {smem} B of shared memory, this GPU allows {}",
            dev.max_smem_optin()
        ));
    }
    let n = t * nh * hd;
    let cache = cap * kvh * hd;
    let p = AttnPrefillParams {
        q: addr(dev, q, n, "attention prefill q")?,
        k: addr(dev, k_cache, cache, "attention prefill k_cache")?,
        vt: addr(dev, v_cache, cache, "attention prefill v_cache")?,
        gate: match gate {
            Some(g) => addr(dev, g, n, "attention prefill gate")?,
            None => 0,
        },
        out: addr_mut(dev, out, n, "attention prefill out")?,
        t: t as i32,
        nh: nh as i32,
        kvh: kvh as i32,
        pos0: pos0 as i32,
        ntiles: ntiles as i32,
        cap: cap as i32,
        scale: 1.0 / (hd as f32).sqrt(),
        pad: 0,
    };
    if [p.q, p.k, p.vt, p.gate, p.out].iter().any(|a| a % 16 != 0) {
        return bad("q, caches, gate and out must be 16-byte aligned");
    }
    let cfg = LaunchConfig {
        grid_dim: ((ntiles * kvh) as u32, 1, 1),
        block_dim: (threads, 1, 1),
        shared_mem_bytes: smem as u32,
    };
    launch(dev, name, cfg, &p)
}

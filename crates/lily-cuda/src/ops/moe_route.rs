//! The MoE router's selection (`kernels/moe_route.cu`), matching `lily_cpu::moe::route` bit for bit:
//! per token, the top k of the softmax (f32) over all E router logits (ties to the lower index, best
//! first). Renormalised (`norm_topk_prob`, the model's case) the softmax's denominator cancels: the k
//! largest logits, each weighted e^(l − m) over the sum of the k chosen (k exponentials, not E).
//! Plain: the probabilities computed as the CPU computes them (sum in index order, IEEE division), so
//! equal probabilities from distinct logits pick the same experts as the CPU.

use cudarc::driver::{DevicePtr, DevicePtrMut, DeviceRepr, LaunchConfig};

use super::{addr, addr_mut, launch};
use crate::{CudaError, Device, Result};

/// The most experts per token row.
pub const MAX_E: usize = 512;
/// The most experts chosen per token.
pub const MAX_K: usize = 32;

/// Must match `struct MoeRouteParams` in `kernels/moe_route.cu`.
#[repr(C)]
#[derive(Clone, Copy, Debug, Default)]
struct MoeRouteParams {
    logits: u64,
    idx: u64,
    w: u64,
    t: i32,
    e: i32,
    k: i32,
    renorm: i32,
    stride: i32,
    pad: i32,
}
// SAFETY: plain old data with the kernel's layout.
unsafe impl DeviceRepr for MoeRouteParams {}

pub(crate) const KERNELS: &[&str] = &["moe_route_e32", "moe_route_e64", "moe_route_e128", "moe_route_e256", "moe_route_e512"];

/// Warps (tokens) per block; must match `WARPS` in the kernel.
const WARPS: usize = 4;

/// For each of `t` tokens: `logits` [t, e] f32 → the chosen experts `idx_out` [t, k] (best first) and
/// their weights `w_out` [t, k]. Needs 1 ≤ k ≤ min(e, [`MAX_K`]) and e ≤ [`MAX_E`]; t = 0 does nothing.
#[allow(clippy::too_many_arguments)]
pub fn route<L: DevicePtr<f32>, I: DevicePtrMut<u32>, W: DevicePtrMut<f32>>(
    dev: &Device,
    logits: &L,
    t: usize,
    e: usize,
    k: usize,
    renormalise: bool,
    idx_out: &mut I,
    w_out: &mut W,
) -> Result<()> {
    route_strided(dev, logits, e, t, e, k, renormalise, idx_out, w_out)
}

/// [`route`] on logit rows `stride` floats apart (≥ e): the first e of each row are the router's (a
/// router fused with the shared expert's gate writes rows of e + 1).
#[allow(clippy::too_many_arguments)]
pub fn route_strided<L: DevicePtr<f32>, I: DevicePtrMut<u32>, W: DevicePtrMut<f32>>(
    dev: &Device,
    logits: &L,
    stride: usize,
    t: usize,
    e: usize,
    k: usize,
    renormalise: bool,
    idx_out: &mut I,
    w_out: &mut W,
) -> Result<()> {
    if e == 0 || e > MAX_E || k == 0 || k > e || k > MAX_K || stride < e || t.saturating_mul(stride) > i32::MAX as usize {
        return Err(CudaError::Shape(format!("moe route: T = {t}, E = {e}, k = {k}, rows {stride} apart (E ≤ {MAX_E}, 1 ≤ k ≤ min(E, {MAX_K}), stride ≥ E)")));
    }
    if t == 0 {
        return Ok(());
    }
    let p = MoeRouteParams {
        logits: addr(dev, logits, (t - 1) * stride + e, "moe route logits")?,
        idx: addr_mut(dev, idx_out, t * k, "moe route indices")?,
        w: addr_mut(dev, w_out, t * k, "moe route weights")?,
        t: t as i32,
        e: e as i32,
        k: k as i32,
        renorm: renormalise as i32,
        stride: stride as i32,
        pad: 0,
    };
    let name = match e {
        0..=32 => "moe_route_e32",
        33..=64 => "moe_route_e64",
        65..=128 => "moe_route_e128",
        129..=256 => "moe_route_e256",
        _ => "moe_route_e512",
    };
    let cfg = LaunchConfig {
        grid_dim: (t.div_ceil(WARPS) as u32, 1, 1),
        block_dim: (32 * WARPS as u32, 1, 1),
        shared_mem_bytes: 0,
    };
    launch(dev, name, cfg, &p)
}

//! MoE dispatch and combine on the device (`kernels/moe_dispatch.cu`), around the grouped expert GEMM,
//! with no host round trip: [`plan`] turns the router's choice `idx` [T, k] into per-expert slot ranges
//! (`offsets`), the token of each sorted slot (`rows`) and the sorted slot of each (token, j)
//! (`slot_of`); [`combine`] sums the expert outputs back per token with the routing weights, plus the
//! sigmoid-gated shared expert, in the order and rounding of `lily_cpu::moe::forward` (bit-identical
//! to it given the same expert outputs, which [`combine_with`] also takes in bf16); [`combine_norm`]
//! adds that into the residual stream and applies the next RMSNorm in the same kernel.

use cudarc::driver::{CudaSlice, DevicePtr, DevicePtrMut, DeviceRepr, LaunchConfig};

use super::{addr, addr_mut, launch};
use crate::{CudaError, Device, Result};

/// The most experts (one scan thread per expert).
pub const MAX_E: usize = 512;
/// The most experts per token.
pub const MAX_K: usize = 32;
/// Slots per ranking block; must match `CHUNK` in the kernel.
const CHUNK: usize = 1024;
/// Threads per plan block; must match `PLAN_THREADS` in the kernel.
const PLAN_THREADS: usize = 256;
/// Threads per combine block; must match `COMBINE_THREADS` in the kernel.
const COMBINE_THREADS: usize = 128;

/// Must match `struct MoePlanParams` in `kernels/moe_dispatch.cu`.
#[repr(C)]
#[derive(Clone, Copy, Debug, Default)]
struct MoePlanParams {
    idx: u64,
    hist: u64,
    offsets: u64,
    rows: u64,
    slot_of: u64,
    n: i32,
    e: i32,
    k: i32,
    nb: i32,
}
// SAFETY: plain old data with the kernel's layout.
unsafe impl DeviceRepr for MoePlanParams {}

/// Must match `struct MoeCombineParams` in `kernels/moe_dispatch.cu`.
#[repr(C)]
#[derive(Clone, Copy, Debug, Default)]
struct MoeCombineParams {
    y: u64,
    idx: u64,
    slot_of: u64,
    w: u64,
    shared: u64,
    gate_logit: u64,
    out: u64,
    t: i32,
    k: i32,
    h: i32,
    n: i32,
    accumulate: i32,
    gate_stride: i32,
    norm_w: u64,
    normed: u64,
    eps: f32,
    pad_: i32,
    scales: u64,
}
// SAFETY: plain old data with the kernel's layout.
unsafe impl DeviceRepr for MoeCombineParams {}

pub(crate) const KERNELS: &[&str] =
    &["moe_plan_rank", "moe_plan_scan", "moe_plan_scatter", "moe_combine_f32", "moe_combine_f32_v4", "moe_combine_bf16", "moe_combine_bf16_v4", NORM_KERNELS[0], NORM_KERNELS[1], NORM_KERNELS[2], NORM_KERNELS[3], NORM_STAGE_KERNELS[0], NORM_STAGE_KERNELS[1]];
/// The combine fused with the next RMSNorm: (f32, bf16 y) × (scalar, float4).
const NORM_KERNELS: [&str; 4] = ["moe_combine_norm_f32", "moe_combine_norm_f32_v4", "moe_combine_norm_bf16", "moe_combine_norm_bf16_v4"];
/// The same writing the normed rows as the next GEMM's staged x: (f32, bf16 y), float4.
const NORM_STAGE_KERNELS: [&str; 2] = ["moe_combine_norm_f32_v4_stage", "moe_combine_norm_bf16_v4_stage"];

/// The u32 scratch [`plan`] needs for `t` tokens, `k` experts each, of `e`: one count per expert
/// for each block of 1024 slots, `ceil(t·k / 1024) · e` (at least `e`).
pub fn plan_scratch_len(t: usize, k: usize, e: usize) -> usize {
    (t * k).div_ceil(CHUNK).max(1) * e
}

fn check_sizes(what: &str, t: usize, k: usize, e: usize) -> Result<()> {
    if k == 0 || k > MAX_K || e == 0 || e > MAX_E || k > e || t.saturating_mul(k) > i32::MAX as usize {
        return Err(CudaError::Shape(format!("{what}: T = {t}, E = {e}, k = {k} (E ≤ {MAX_E}, 1 ≤ k ≤ min(E, {MAX_K}))")));
    }
    Ok(())
}

/// The dispatch plan for the router's choice `idx` [t, k] (expert ids < e; distinct per token, as the
/// router gives them), on the device, three launches, no synchronisation:
/// - `offsets` [e + 1]: sorted slots `offsets[x] .. offsets[x+1]` belong to expert x; `offsets[0] = 0`,
///   `offsets[e] = t·k`;
/// - `rows` [t·k]: the token each sorted slot reads;
/// - `slot_of` [t·k]: the sorted slot of (token, j), i.e. `rows[slot_of[t·k + j]] == t`, inside
///   expert `idx[t·k + j]`'s range.
///
/// Within an expert's range the slots ascend in (token, j), so the plan is deterministic.
/// `scratch` holds at least [`plan_scratch_len`]`(t, k, e)` u32. An id ≥ e (which the router never
/// writes) gets no slot: its `slot_of` is `u32::MAX` and `offsets[e]` falls short of t·k. With t = 0
/// only `offsets` is written (all zeros).
#[allow(clippy::too_many_arguments)]
pub fn plan<I, S, O, R, L>(
    dev: &Device,
    idx: &I,
    t: usize,
    k: usize,
    e: usize,
    scratch: &mut S,
    offsets: &mut O,
    rows: &mut R,
    slot_of: &mut L,
) -> Result<()>
where
    I: DevicePtr<u32>,
    S: DevicePtrMut<u32>,
    O: DevicePtrMut<u32>,
    R: DevicePtrMut<u32>,
    L: DevicePtrMut<u32>,
{
    check_sizes("moe plan", t, k, e)?;
    let n = t * k;
    let nb = n.div_ceil(CHUNK);
    let p = MoePlanParams {
        idx: addr(dev, idx, n, "moe plan idx")?,
        hist: addr_mut(dev, scratch, plan_scratch_len(t, k, e), "moe plan scratch")?,
        offsets: addr_mut(dev, offsets, e + 1, "moe plan offsets")?,
        rows: addr_mut(dev, rows, n, "moe plan rows")?,
        slot_of: addr_mut(dev, slot_of, n, "moe plan slot_of")?,
        n: n as i32,
        e: e as i32,
        k: k as i32,
        nb: nb as i32,
    };
    let blocks =
        |b: usize, threads: usize| LaunchConfig { grid_dim: (b as u32, 1, 1), block_dim: (threads as u32, 1, 1), shared_mem_bytes: 0 };
    if nb > 0 {
        launch(dev, "moe_plan_rank", blocks(nb, PLAN_THREADS), &p)?;
    }
    launch(dev, "moe_plan_scan", blocks(1, MAX_E), &p)?;
    if n > 0 {
        launch(dev, "moe_plan_scatter", blocks(n.div_ceil(PLAN_THREADS), PLAN_THREADS), &p)?;
    }
    Ok(())
}

/// `out[t, :] = Σ_j w[t, j] · y[slot(t, j), :]  (+ sigmoid(gate_logit[t]) · shared[t, :])`.
///
/// - `y` [t·k, h]: the expert outputs in sorted-slot order, f32 or (with [`combine_with`]) bf16 bits,
///   each widened to f32 exactly before the same sums;
/// - `idx` [t, k]: the router's expert ids, which fix the summation order: the k terms of a token
///   are added in ascending expert id (ties by j), then the shared term, each product and sum rounded
///   in f32 (no FMA), starting from 0, as `lily_cpu::moe::forward` accumulates; the sigmoid is
///   `lily_cpu::norm::sigmoid` with glibc's `expf` ported exactly;
/// - `slot_of` [t, k] from [`plan`], or None for the identity (slot t·k + j: the decode path, where
///   the indexed GEMV writes slot j of token t there); a slot ≥ t·k (an id [`plan`] gave no slot)
///   contributes NaN;
/// - `w` [t, k]: the routing weights;
/// - `shared`: the shared expert's output [t, h] and its gate logit [t], or None;
/// - `out` [t, h].
///
/// Needs 1 ≤ k ≤ [`MAX_K`]; t = 0 or h = 0 does nothing.
#[allow(clippy::too_many_arguments)]
pub fn combine<Y, I, L, W, S, G, O>(
    dev: &Device,
    y: &Y,
    idx: &I,
    slot_of: Option<&L>,
    w: &W,
    shared: Option<(&S, &G)>,
    t: usize,
    k: usize,
    h: usize,
    out: &mut O,
) -> Result<()>
where
    Y: DevicePtr<f32>,
    I: DevicePtr<u32>,
    L: DevicePtr<u32>,
    W: DevicePtr<f32>,
    S: DevicePtr<f32>,
    G: DevicePtr<f32>,
    O: DevicePtrMut<f32>,
{
    combine_with(dev, y, idx, slot_of, w, shared, 1, t, k, h, out, false)
}

/// [`combine`], adding the sum into `out` when `accumulate` (out is the residual stream), with the
/// shared expert's gate logits `gate_stride` floats apart (≥ 1: the last column of a router fused with
/// the shared gate, rows of E + 1).
#[allow(clippy::too_many_arguments)]
pub fn combine_with<E, Y, I, L, W, S, G, O>(
    dev: &Device,
    y: &Y,
    idx: &I,
    slot_of: Option<&L>,
    w: &W,
    shared: Option<(&S, &G)>,
    gate_stride: usize,
    t: usize,
    k: usize,
    h: usize,
    out: &mut O,
    accumulate: bool,
) -> Result<()>
where
    E: super::Act,
    Y: DevicePtr<E>,
    I: DevicePtr<u32>,
    L: DevicePtr<u32>,
    W: DevicePtr<f32>,
    S: DevicePtr<f32>,
    G: DevicePtr<f32>,
    O: DevicePtrMut<f32>,
{
    let Some(p) = combine_params(dev, y, idx, slot_of, w, shared, gate_stride, t, k, h, out, accumulate)? else { return Ok(()) };
    // The vector forms read 4 elements of y at once: 16 (f32) or 8 (bf16) bytes, aligned.
    let aligned = p.y.is_multiple_of(if E::BF16 { 8 } else { 16 }) && [p.shared, p.out].iter().all(|a| a.is_multiple_of(16));
    let (name, nv) = match (h.is_multiple_of(4) && aligned, E::BF16) {
        (true, false) => ("moe_combine_f32_v4", h / 4),
        (false, false) => ("moe_combine_f32", h),
        (true, true) => ("moe_combine_bf16_v4", h / 4),
        (false, true) => ("moe_combine_bf16", h),
    };
    let cfg = LaunchConfig {
        grid_dim: (t as u32, nv.div_ceil(COMBINE_THREADS) as u32, 1),
        block_dim: (COMBINE_THREADS as u32, 1, 1),
        shared_mem_bytes: 0,
    };
    launch(dev, name, cfg, &p)
}

/// Where [`combine_norm`] writes the normed rows.
pub enum NormOut<'a> {
    /// f32 rows [t, h].
    Rows(&'a mut CudaSlice<f32>),
    /// Only as the next GEMM's staged x (from `gemm_wgmma::prestage_half` for that GEMM: [t, h] in the
    /// half numerics, the same bits as staging the f32 rows); needs [`combine_stage_fits`] and 16-byte
    /// aligned x, norm weight and shared rows.
    Staged(&'a super::gemm_wgmma::HalfStage),
}

/// [`combine_with`] into the residual stream `x` [t, h] (`x += the sum`), then
/// `normed = RMSNorm(x) · norm_w` (`norm_w` [h], the next layer's input norm or the final norm, with
/// `eps`) into `out`: a prompt chunk's combine and the residual add and norm after it in one kernel, bit
/// for bit the combine into a buffer followed by [`super::rmsnorm::add_rms_norm`] (the same sums and
/// products, and the same launch shape for the norm's reduction).
#[allow(clippy::too_many_arguments)]
pub fn combine_norm<E, Y, I, L, W, S, G, X, N>(
    dev: &Device,
    y: &Y,
    idx: &I,
    slot_of: Option<&L>,
    w: &W,
    shared: Option<(&S, &G)>,
    gate_stride: usize,
    t: usize,
    k: usize,
    h: usize,
    x: &mut X,
    norm_w: &N,
    eps: f32,
    out: NormOut<'_>,
) -> Result<()>
where
    E: super::Act,
    Y: DevicePtr<E>,
    I: DevicePtr<u32>,
    L: DevicePtr<u32>,
    W: DevicePtr<f32>,
    S: DevicePtr<f32>,
    G: DevicePtr<f32>,
    X: DevicePtrMut<f32>,
    N: DevicePtr<f32>,
{
    let (normed, scales) = match out {
        NormOut::Rows(r) => (addr_mut(dev, r, t * h, "moe combine normed")?, None),
        NormOut::Staged(st) => {
            if !combine_stage_fits(h) || st.rows != t || st.cols != h {
                return Err(CudaError::Shape(format!("moe combine_norm: {t} rows of {h} into a staging of {} × {}", st.rows, st.cols)));
            }
            (st.plane, Some(st.scales))
        }
    };
    let norm_w = addr(dev, norm_w, h, "moe combine norm weight")?;
    let Some(mut p) = combine_params(dev, y, idx, slot_of, w, shared, gate_stride, t, k, h, x, true)? else { return Ok(()) };
    (p.norm_w, p.normed, p.eps) = (norm_w, normed, eps);
    let aligned = p.y.is_multiple_of(if E::BF16 { 8 } else { 16 }) && [p.shared, p.out, p.norm_w, p.normed].iter().all(|a| a.is_multiple_of(16));
    let vec = h.is_multiple_of(4) && aligned;
    if let Some(sc) = scales {
        if !vec {
            return Err(CudaError::Shape("moe combine_norm into a staging: x, the norm weight, the shared rows and the plane must be 16-byte aligned".into()));
        }
        p.scales = sc;
        let threads = (h / 4).div_ceil(32).clamp(1, 32) as u32 * 32;
        let cfg = LaunchConfig { grid_dim: (t as u32, 1, 1), block_dim: (threads, 1, 1), shared_mem_bytes: 4 * h as u32 };
        return launch(dev, NORM_STAGE_KERNELS[E::BF16 as usize], cfg, &p);
    }
    let name = NORM_KERNELS[2 * E::BF16 as usize + vec as usize];
    // rmsnorm.cu's launch: one block a row, ceil(vectors / 32) warps, at most 32.
    let per = if vec { h / 4 } else { h };
    let threads = per.div_ceil(32).clamp(1, 32) as u32 * 32;
    let cfg = LaunchConfig { grid_dim: (t as u32, 1, 1), block_dim: (threads, 1, 1), shared_mem_bytes: 0 };
    launch(dev, name, cfg, &p)
}

/// Whether [`combine_norm`] takes rows of `h` into a staging ([`NormOut::Staged`]): a multiple of 64
/// whose f32 row fits 48 KiB of shared memory.
pub fn combine_stage_fits(h: usize) -> bool {
    h > 0 && h.is_multiple_of(64) && 4 * h <= 48 * 1024
}

/// The checked parameters of a combine (`None`: nothing to do, t = 0 or h = 0).
#[allow(clippy::too_many_arguments)]
fn combine_params<E, Y, I, L, W, S, G, O>(
    dev: &Device,
    y: &Y,
    idx: &I,
    slot_of: Option<&L>,
    w: &W,
    shared: Option<(&S, &G)>,
    gate_stride: usize,
    t: usize,
    k: usize,
    h: usize,
    out: &mut O,
    accumulate: bool,
) -> Result<Option<MoeCombineParams>>
where
    E: super::Act,
    Y: DevicePtr<E>,
    I: DevicePtr<u32>,
    L: DevicePtr<u32>,
    W: DevicePtr<f32>,
    S: DevicePtr<f32>,
    G: DevicePtr<f32>,
    O: DevicePtrMut<f32>,
{
    let n = t.saturating_mul(k);
    if k == 0 || k > MAX_K || n > i32::MAX as usize || h > 65535 * COMBINE_THREADS || gate_stride == 0 || t.saturating_mul(gate_stride) > i32::MAX as usize {
        return Err(CudaError::Shape(format!(
            "moe combine: T = {t}, k = {k}, H = {h}, gate logits {gate_stride} apart (1 ≤ k ≤ {MAX_K}, T·k < 2^31, H ≤ {}, stride ≥ 1)",
            65535 * COMBINE_THREADS
        )));
    }
    if t == 0 || h == 0 {
        return Ok(None);
    }
    let mut p = MoeCombineParams {
        y: addr(dev, y, n * h, "moe combine y")?,
        idx: addr(dev, idx, n, "moe combine idx")?,
        w: addr(dev, w, n, "moe combine w")?,
        out: addr_mut(dev, out, t * h, "moe combine out")?,
        t: t as i32,
        k: k as i32,
        h: h as i32,
        n: n as i32,
        accumulate: accumulate as i32,
        gate_stride: gate_stride as i32,
        ..Default::default()
    };
    if let Some(s) = slot_of {
        p.slot_of = addr(dev, s, n, "moe combine slot_of")?;
    }
    if let Some((s, g)) = shared {
        p.shared = addr(dev, s, t * h, "moe combine shared")?;
        p.gate_logit = addr(dev, g, (t - 1) * gate_stride + 1, "moe combine gate_logit")?;
    }
    Ok(Some(p))
}

//! RMSNorm of f32 rows (`kernels/rmsnorm.cu`): `y = h / sqrt(mean(h²) + eps) · w` with `h = x` or,
//! fused, `h = x + residual` written back into the residual stream. `w` is the folded weight (Qwen's
//! `1 + w` already added at load), as in `lily_cpu::norm::rms_norm`. The fused form may also write y as
//! the next GEMM's staged x in the half numerics, and the folded exact numerics' staging beside it
//! ([`add_rms_norm`] with a [`Staging`]).

use cudarc::driver::{DevicePtr, DevicePtrMut, DeviceRepr, LaunchConfig};

use super::{addr, addr_mut, launch};
use crate::{CudaError, Device, Result};

/// Must match `struct RmsNormParams` in `kernels/rmsnorm.cu`.
#[repr(C)]
#[derive(Clone, Copy, Debug, Default)]
struct RmsNormParams {
    x: u64,
    residual: u64,
    residual_out: u64,
    w: u64,
    y: u64,
    rows: i32,
    n: i32,
    eps: f32,
    pad: i32,
    plane: u64,
    scales: u64,
    hi2: u64,
    lo2: u64,
    sums2: u64,
}
// SAFETY: plain old data with the kernel's layout.
unsafe impl DeviceRepr for RmsNormParams {}

pub(crate) const KERNELS: &[&str] = &["rmsnorm_f32", "rmsnorm_f32_v4", "rmsnorm_f32_v4_stage", "rmsnorm_f32_v4_stage2"];

/// The next GEMMs' staged copies of y that [`add_rms_norm`] writes beside y: the half numerics' and,
/// where given, the folded exact numerics' (the MoE router's) of the same rows.
#[derive(Clone, Copy, Debug)]
pub struct Staging<'a> {
    pub half: &'a super::gemm_wgmma::HalfStage,
    pub exact: Option<&'a super::gemm_wgmma::ExactStage>,
}

/// The most columns [`add_rms_norm`] stages (the row in 48 KiB of shared memory).
const STAGE_MAX_COLS: usize = 12 * 1024;

/// Whether [`add_rms_norm`] stages rows of `n` columns: a multiple of 64, at most 12 Ki.
pub fn stage_fits(n: usize) -> bool {
    n > 0 && n.is_multiple_of(super::gemm_wgmma::GROUP) && n <= STAGE_MAX_COLS
}

/// `y[r] = rms_norm(x[r]) · w` for each of the `rows` rows of `w.len()` elements.
pub fn rms_norm<X: DevicePtr<f32>, W: DevicePtr<f32>, Y: DevicePtrMut<f32>>(
    dev: &Device,
    x: &X,
    w: &W,
    eps: f32,
    rows: usize,
    y: &mut Y,
) -> Result<()> {
    let n = w.len();
    let p = RmsNormParams {
        x: addr(dev, x, rows * n, "rms_norm x")?,
        w: addr(dev, w, n, "rms_norm w")?,
        y: addr_mut(dev, y, rows * n, "rms_norm y")?,
        ..Default::default()
    };
    run(dev, p, rows, n, eps)
}

/// Fused residual add: `residual += x`, then `y = rms_norm(residual) · w` (rows of `w.len()`). With
/// `stage`, y is also written as the next GEMM's staged x in the half numerics (`gemm_wgmma::
/// prestage_half` of y, `rows` × `w.len()`) and, with `stage.exact`, in the folded exact numerics
/// (`gemm_wgmma::prestage_half_exact`): the same bits as the norm followed by the GEMMs' own stagings
/// of y, which the GEMMs then reuse (`Opts::reuse_x`); rows of [`stage_fits`] columns, 16-byte
/// aligned buffers.
#[allow(clippy::too_many_arguments)]
pub fn add_rms_norm<X: DevicePtr<f32>, R: DevicePtrMut<f32>, W: DevicePtr<f32>, Y: DevicePtrMut<f32>>(
    dev: &Device,
    x: &X,
    residual: &mut R,
    w: &W,
    eps: f32,
    rows: usize,
    y: &mut Y,
    stage: Option<Staging<'_>>,
) -> Result<()> {
    let n = w.len();
    let r = addr_mut(dev, residual, rows * n, "add_rms_norm residual")?;
    let p = RmsNormParams {
        x: addr(dev, x, rows * n, "add_rms_norm x")?,
        residual: r,
        residual_out: r,
        w: addr(dev, w, n, "add_rms_norm w")?,
        y: addr_mut(dev, y, rows * n, "add_rms_norm y")?,
        ..Default::default()
    };
    let Some(Staging { half: st, exact }) = stage else { return run(dev, p, rows, n, eps) };
    let exact_shape = exact.map(|e| (e.rows, e.cols));
    if !stage_fits(n) || rows == 0 || rows > i32::MAX as usize || (st.rows, st.cols) != (rows, n) || exact_shape.is_some_and(|s| s != (rows, n)) {
        return Err(CudaError::Shape(format!(
            "add_rms_norm: {rows} rows of {n} into a staging of {} × {} (folded: {exact_shape:?})",
            st.rows, st.cols
        )));
    }
    let (hi2, lo2, sums2) = exact.map_or((0, 0, 0), |e| (e.hi, e.lo, e.sums));
    let p = RmsNormParams { rows: rows as i32, n: n as i32, eps, plane: st.plane, scales: st.scales, hi2, lo2, sums2, ..p };
    if [p.x, p.residual, p.w, p.y, p.plane].iter().any(|a| a % 16 != 0) {
        return Err(CudaError::Shape("add_rms_norm into a staging: buffers must be 16-byte aligned".into()));
    }
    let threads = (n / 4).div_ceil(32).clamp(1, 32) as u32 * 32;
    let cfg = LaunchConfig { grid_dim: (rows as u32, 1, 1), block_dim: (threads, 1, 1), shared_mem_bytes: 4 * n as u32 };
    launch(dev, if exact.is_some() { "rmsnorm_f32_v4_stage2" } else { "rmsnorm_f32_v4_stage" }, cfg, &p)
}

fn run(dev: &Device, mut p: RmsNormParams, rows: usize, n: usize, eps: f32) -> Result<()> {
    if n == 0 || n > i32::MAX as usize || rows == 0 || rows > i32::MAX as usize {
        return Err(CudaError::Shape(format!("rms_norm: {rows} rows of {n}")));
    }
    p.rows = rows as i32;
    p.n = n as i32;
    p.eps = eps;
    let aligned = [p.x, p.residual, p.residual_out, p.w, p.y].iter().all(|a| a % 16 == 0);
    let vec = n.is_multiple_of(4) && aligned;
    let (name, per) = if vec { ("rmsnorm_f32_v4", n / 4) } else { ("rmsnorm_f32", n) };
    let threads = per.div_ceil(32).clamp(1, 32) as u32 * 32;
    let cfg = LaunchConfig { grid_dim: (rows as u32, 1, 1), block_dim: (threads, 1, 1), shared_mem_bytes: 0 };
    launch(dev, name, cfg, &p)
}

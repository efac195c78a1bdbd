//! One weight row against many token rows (`kernels/affine_dot.cu`): `y[t · stride] = x[t, :] · W[row, :]`
//! for a 4/8-bit affine or dense bf16 matrix, in f32 — the prefill's shared-expert gate logit for every
//! token of a chunk, which as an extra row of the router's GEMM cost a whole row tile.

use cudarc::driver::{DevicePtr, DevicePtrMut, DeviceRepr, LaunchConfig};

use super::{addr, addr_mut, launch};
use crate::weights::{DeviceMatrix, DeviceStorage};
use crate::{CudaError, Device, Result};

pub(crate) const KERNELS: &[&str] = &["affine_row_dot"];

/// Must match `struct AffineRowDotParams` in `kernels/affine_dot.cu`.
#[repr(C)]
#[derive(Clone, Copy, Debug, Default)]
struct AffineRowDotParams {
    x: u64,
    packed: u64,
    scales: u64,
    biases: u64,
    dense: u64,
    y: u64,
    t: i32,
    cols: i32,
    row: i32,
    bits: i32,
    group_shift: i32,
    y_stride: i32,
}
// SAFETY: plain old data with the kernel's layout.
unsafe impl DeviceRepr for AffineRowDotParams {}

/// `y[i · y_stride] = Σ_k x[i, k] · W₀[row, k]` for the `t` rows of `x` (`[t, cols]`, 16-byte aligned),
/// W₀ the first matrix of `w` (affine weights dequantised as `s·q + b` in f32); f32 sums. Needs cols a
/// multiple of 4 (and of nothing more: groups of 32, 64 or 128).
pub fn row_dot<X: DevicePtr<f32>, Y: DevicePtrMut<f32>>(dev: &Device, w: &DeviceMatrix, row: usize, x: &X, t: usize, y: &mut Y, y_stride: usize) -> Result<()> {
    let cols = w.cols;
    if row >= w.rows || cols == 0 || !cols.is_multiple_of(4) || cols > i32::MAX as usize || t > i32::MAX as usize || y_stride == 0 || y_stride > i32::MAX as usize {
        return Err(CudaError::Shape(format!("row dot: row {row} of [{}, {cols}], {t} tokens, y stride {y_stride}", w.rows)));
    }
    let s = dev.stream();
    let mut p = AffineRowDotParams { t: t as i32, cols: cols as i32, row: row as i32, y_stride: y_stride as i32, ..Default::default() };
    match &w.storage {
        DeviceStorage::Affine { params, packed, scales, biases } => {
            if !matches!(params.bits, 4 | 8) || !params.group_size.is_power_of_two() || params.group_size < 4 || !cols.is_multiple_of(params.group_size) {
                return Err(CudaError::Shape(format!("row dot: {}-bit codes in groups of {}", params.bits, params.group_size)));
            }
            p.packed = packed.device_ptr(s).0;
            p.scales = scales.device_ptr(s).0;
            p.biases = biases.device_ptr(s).0;
            p.bits = params.bits as i32;
            p.group_shift = params.group_size.trailing_zeros() as i32;
        }
        DeviceStorage::Dense { data } => p.dense = data.device_ptr(s).0,
    }
    if t == 0 {
        return Ok(());
    }
    p.x = addr(dev, x, t * cols, "row dot x")?;
    if !p.x.is_multiple_of(16) {
        return Err(CudaError::Shape("row dot: x must be 16-byte aligned".into()));
    }
    p.y = addr_mut(dev, y, (t - 1) * y_stride + 1, "row dot y")?;
    let cfg = LaunchConfig { grid_dim: (t.div_ceil(8) as u32, 1, 1), block_dim: (256, 1, 1), shared_mem_bytes: 0 };
    launch(dev, "affine_row_dot", cfg, &p)
}

//! Embedding lookup (`kernels/embed.cu`): `out[t] = row ids[t]` of a (4/8-bit affine or bf16) table,
//! dequantised to f32 exactly as `lily_cpu::linear::embed_row` does (bit-identical). Ids are a device
//! array; an id `>= rows` gives a NaN row.

use cudarc::driver::{DevicePtr, DevicePtrMut, DeviceRepr, LaunchConfig};

use super::{addr, addr_mut, launch};
use crate::weights::{DeviceMatrix, DeviceStorage};
use crate::{CudaError, Device, Result};

/// Must match `struct EmbedParams` in `kernels/embed.cu`.
#[repr(C)]
#[derive(Clone, Copy, Debug, Default)]
struct EmbedParams {
    packed: u64,
    scales: u64,
    biases: u64,
    ids: u64,
    out: u64,
    tokens: i32,
    rows: i32,
    cols: i32,
    bits: i32,
    group_shift: i32,
    vec: i32,
}
// SAFETY: plain old data with the kernel's layout.
unsafe impl DeviceRepr for EmbedParams {}

pub(crate) const KERNELS: &[&str] = &["embed_affine", "embed_bf16"];

/// `out[t*cols ..][..cols] = table[ids[t]]` for every id (`tokens = ids.len()`).
pub fn embed<I: DevicePtr<u32>, Y: DevicePtrMut<f32>>(dev: &Device, table: &DeviceMatrix, ids: &I, out: &mut Y) -> Result<()> {
    let tokens = ids.len();
    if table.count != 1 {
        return Err(CudaError::Shape(format!("embed: a stack of {} tables", table.count)));
    }
    if tokens == 0 || tokens > i32::MAX as usize || table.rows > i32::MAX as usize {
        return Err(CudaError::Shape(format!("embed: {tokens} tokens, {} rows", table.rows)));
    }
    let s = dev.stream();
    let mut p = EmbedParams {
        ids: addr(dev, ids, tokens, "embed ids")?,
        out: addr_mut(dev, out, tokens * table.cols, "embed out")?,
        tokens: tokens as i32,
        rows: table.rows as i32,
        cols: table.cols as i32,
        ..Default::default()
    };
    let name = match &table.storage {
        DeviceStorage::Affine { params, packed, scales, biases } => {
            p.packed = packed.device_ptr(s).0;
            p.scales = scales.device_ptr(s).0;
            p.biases = biases.device_ptr(s).0;
            p.bits = params.bits as i32;
            p.group_shift = params.group_size.trailing_zeros() as i32;
            // Rows start 16-byte aligned when the base is (cols is a multiple of 32 for affine tables).
            p.vec = p.out.is_multiple_of(16) as i32;
            "embed_affine"
        }
        DeviceStorage::Dense { data } => {
            p.packed = data.device_ptr(s).0;
            "embed_bf16"
        }
    };
    let cfg = LaunchConfig { grid_dim: (tokens as u32, 1, 1), block_dim: (256, 1, 1), shared_mem_bytes: 0 };
    launch(dev, name, cfg, &p)
}

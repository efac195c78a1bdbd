//! Decode GEMV (`kernels/affine_gemv.cu`): `y = W x` for one token, on 4/8-bit affine or dense bf16
//! weights, f32 activations in and out.
//!
//! Which matrix of a stack is used is a [`Select`]: one matrix `m` (like
//! `lily_cpu::linear::matmul(w, m, ..)`), or one matrix per slot from a device array of indices (MoE
//! decode: the router writes the indices, the GEMV reads them, no host round trip). With indices,
//! slot `k` computes `y[k*rows .. (k+1)*rows] = W[idx[k]] · x_k`, where `x_k` is the one shared `x`
//! (`x_per_slot = false`, gate/up projections) or `x[k*cols ..]` (`true`, the down projection).
//! An index `>= count` yields NaN rows.

use cudarc::driver::sys::CUfunction_attribute;
use cudarc::driver::{DevicePtr, DevicePtrMut, DeviceRepr, LaunchConfig};

use super::{addr, addr_mut, launch};
use crate::weights::{DeviceMatrix, DeviceStorage};
use crate::{CudaError, Device, Result};

/// Must match `struct GemvParams` in `kernels/affine_gemv.cu`.
#[repr(C)]
#[derive(Clone, Copy, Debug, Default)]
struct GemvParams {
    w: u64,
    scales: u64,
    biases: u64,
    w2: u64,
    scales2: u64,
    biases2: u64,
    idx: u64,
    x: u64,
    y: u64,
    x_stride: i64,
    rows: i32,
    cols: i32,
    count: i32,
    group_shift: i32,
    matrix: i32,
    pad: i32,
}
// SAFETY: plain old data with the kernel's layout.
unsafe impl DeviceRepr for GemvParams {}

const THREADS: u32 = 256;

// Kernel names by family. Plain GEMV variants (TPR lanes per row, U chunks of NR rows in flight per
// lane, U*NR = 8): t4/t8/t16 with U=1, NR=8 (rows of at most TPR chunks), then t32 with (U, NR) =
// (1, 8), (2, 4), (4, 2), (8, 1). SwiGLU: the same with U*NR = 4 and no (8, 1).
macro_rules! gemv_names {
    ($p:literal) => {
        [
            concat!($p, "_t4_u1r8"),
            concat!($p, "_t8_u1r8"),
            concat!($p, "_t16_u1r8"),
            concat!($p, "_t32_u1r8"),
            concat!($p, "_t32_u2r4"),
            concat!($p, "_t32_u4r2"),
            concat!($p, "_t32_u8r1"),
        ]
    };
}
macro_rules! swiglu_names {
    ($p:literal) => {
        [
            concat!($p, "_t4_u1r4"),
            concat!($p, "_t8_u1r4"),
            concat!($p, "_t16_u1r4"),
            concat!($p, "_t32_u1r4"),
            concat!($p, "_t32_u2r2"),
            concat!($p, "_t32_u4r1"),
            concat!($p, "_t32_u4r1"),
        ]
    };
}
const Q4: [&str; 7] = gemv_names!("affine_gemv_q4");
const Q4X: [&str; 7] = gemv_names!("affine_gemv_q4x");
const Q8: [&str; 7] = gemv_names!("affine_gemv_q8");
const BF16: [&str; 7] = gemv_names!("dense_gemv_bf16");
const SW_Q4: [&str; 7] = swiglu_names!("affine_swiglu_q4");
const SW_Q8: [&str; 7] = swiglu_names!("affine_swiglu_q8");
const SW_BF16: [&str; 7] = swiglu_names!("dense_swiglu_bf16");
const FAMILIES: [&[&str; 7]; 7] = [&Q4, &Q4X, &Q8, &BF16, &SW_Q4, &SW_Q8, &SW_BF16];

// The pipelined (cp.async) kernels: t4/t8/t16 with (U, NR) = (1, 4), then t32 with (1, 4), (2, 2), (4, 1).
macro_rules! async_names {
    ($p:literal) => {
        [
            concat!($p, "_t4_u1r4"),
            concat!($p, "_t8_u1r4"),
            concat!($p, "_t16_u1r4"),
            concat!($p, "_t32_u1r4"),
            concat!($p, "_t32_u2r2"),
            concat!($p, "_t32_u4r1"),
        ]
    };
}
const A_Q4: [&str; 6] = async_names!("affine_gemv_async_q4");
const A_Q8: [&str; 6] = async_names!("affine_gemv_async_q8");
const A_BF16: [&str; 6] = async_names!("dense_gemv_async_bf16");
const A_SW_Q4: [&str; 6] = async_names!("affine_swiglu_async_q4");
const A_SW_Q8: [&str; 6] = async_names!("affine_swiglu_async_q8");
const A_SW_BF16: [&str; 6] = async_names!("dense_swiglu_async_bf16");
const ASYNC_FAMILIES: [&[&str; 6]; 6] = [&A_Q4, &A_Q8, &A_BF16, &A_SW_Q4, &A_SW_Q8, &A_SW_BF16];
/// Warps per block, pipeline stages and ring bytes per lane-entry of the async kernels (as in the .cu).
const ASYNC_STAGES: usize = 4;
const RING_ENTRY_BYTES: usize = 32 * (16 + 8);

pub(crate) const KERNELS: &[&str] = &[
    Q4[0], Q4[1], Q4[2], Q4[3], Q4[4], Q4[5], Q4[6], Q4X[0], Q4X[1], Q4X[2], Q4X[3], Q4X[4], Q4X[5], Q4X[6], Q8[0], Q8[1], Q8[2],
    Q8[3], Q8[4], Q8[5], Q8[6], BF16[0], BF16[1], BF16[2], BF16[3], BF16[4], BF16[5], BF16[6], SW_Q4[0], SW_Q4[1], SW_Q4[2],
    SW_Q4[3], SW_Q4[4], SW_Q4[5], SW_Q8[0], SW_Q8[1], SW_Q8[2], SW_Q8[3], SW_Q8[4], SW_Q8[5], SW_BF16[0], SW_BF16[1],
    SW_BF16[2], SW_BF16[3], SW_BF16[4], SW_BF16[5], A_Q4[0], A_Q4[1], A_Q4[2], A_Q4[3], A_Q4[4], A_Q4[5], A_Q8[0], A_Q8[1],
    A_Q8[2], A_Q8[3], A_Q8[4], A_Q8[5], A_BF16[0], A_BF16[1], A_BF16[2], A_BF16[3], A_BF16[4], A_BF16[5], A_SW_Q4[0],
    A_SW_Q4[1], A_SW_Q4[2], A_SW_Q4[3], A_SW_Q4[4], A_SW_Q4[5], A_SW_Q8[0], A_SW_Q8[1], A_SW_Q8[2], A_SW_Q8[3], A_SW_Q8[4],
    A_SW_Q8[5], A_SW_BF16[0], A_SW_BF16[1], A_SW_BF16[2], A_SW_BF16[3], A_SW_BF16[4], A_SW_BF16[5],
];

/// Lets every GEMV use up to the device's opt-in shared memory (x is staged there: 4 bytes per column).
pub(crate) fn configure(dev: &Device) -> Result<()> {
    for name in FAMILIES.iter().flat_map(|f| f.iter()).chain(ASYNC_FAMILIES.iter().flat_map(|f| f.iter())) {
        {
            dev.function(name)?.set_attribute(
                CUfunction_attribute::CU_FUNC_ATTRIBUTE_MAX_DYNAMIC_SHARED_SIZE_BYTES,
                dev.max_smem_optin() as i32,
            )?;
        }
    }
    Ok(())
}

/// Which matrix (or matrices) of a stack a GEMV uses.
#[derive(Clone, Copy, Debug)]
pub struct Select {
    idx: u64,
    slots: usize,
    matrix: usize,
}

impl Select {
    /// Matrix `m` of the stack, one slot.
    pub fn matrix(m: usize) -> Self {
        Select { idx: 0, slots: 1, matrix: m }
    }
    /// One slot per element of `idx` (a device array of matrix indices, e.g. the router's top-k).
    pub fn indexed<I: DevicePtr<u32>>(dev: &Device, idx: &I) -> Self {
        let (p, _g) = idx.device_ptr(dev.stream());
        Select { idx: p, slots: idx.len(), matrix: 0 }
    }
    pub fn slots(&self) -> usize {
        self.slots
    }
}

/// How 4-bit codes become floats (see the top of `kernels/affine_gemv.cu`).
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub enum Q4Decode {
    /// `1 + q/16` by byte permutation, 2.5 instructions per weight (the default).
    #[default]
    Fast,
    /// `2^23 + q - 2^23`, 3.4 instructions per weight (a reference for tests and benchmarks).
    Exact,
}

/// `y = W x` for the selected matrix (or one per slot). x: `cols` floats (or `slots * cols` with
/// `x_per_slot`), y: `slots * rows` floats.
pub fn gemv<X: DevicePtr<f32>, Y: DevicePtrMut<f32>>(
    dev: &Device,
    w: &DeviceMatrix,
    sel: Select,
    x: &X,
    x_per_slot: bool,
    y: &mut Y,
) -> Result<()> {
    gemv_with(dev, w, sel, x, x_per_slot, y, Q4Decode::Fast)
}

/// [`gemv`] with a choice of 4-bit decode.
pub fn gemv_with<X: DevicePtr<f32>, Y: DevicePtrMut<f32>>(
    dev: &Device,
    w: &DeviceMatrix,
    sel: Select,
    x: &X,
    x_per_slot: bool,
    y: &mut Y,
    decode: Q4Decode,
) -> Result<()> {
    gemv_tuned(dev, w, sel, x, x_per_slot, y, decode, 0)
}

/// [`gemv_with`] with a forced kernel (benchmarks and tests). 0 = automatic (the pipelined kernel
/// for rows of at least 4 chunks per lane when its shared memory fits, else the register one). Register kernel: 8 = its automatic choice,
/// 1..=4 = (U, NR) = (1, 8), (2, 4), (4, 2), (8, 1) chunks × rows in flight per lane (rows of more
/// than 16 chunks). Pipelined kernel: 5..=7 = (U, NR) = (1, 4), (2, 2), (4, 1) per pipeline stage.
/// The 4-bit `Exact` decode exists only in the register kernel.
#[doc(hidden)]
#[allow(clippy::too_many_arguments)]
pub fn gemv_tuned<X: DevicePtr<f32>, Y: DevicePtrMut<f32>>(
    dev: &Device,
    w: &DeviceMatrix,
    sel: Select,
    x: &X,
    x_per_slot: bool,
    y: &mut Y,
    decode: Q4Decode,
    variant: u32,
) -> Result<()> {
    let (fam, afam) = match (w.bits(), decode) {
        (4, Q4Decode::Fast) => (&Q4, Some(&A_Q4)),
        (4, Q4Decode::Exact) => (&Q4X, None),
        (8, _) => (&Q8, Some(&A_Q8)),
        (16, _) => (&BF16, Some(&A_BF16)),
        (b, _) => return Err(CudaError::Shape(format!("no GEMV for {b}-bit weights"))),
    };
    run(dev, fam, afam, w, None, sel, x, x_per_slot, y, variant)
}

/// `y = silu(W_gate x) * (W_up x)` (SwiGLU; `gate` and `up` of one shape and format), per slot as in
/// [`gemv`].
pub fn swiglu<X: DevicePtr<f32>, Y: DevicePtrMut<f32>>(
    dev: &Device,
    gate: &DeviceMatrix,
    up: &DeviceMatrix,
    sel: Select,
    x: &X,
    x_per_slot: bool,
    y: &mut Y,
) -> Result<()> {
    swiglu_tuned(dev, gate, up, sel, x, x_per_slot, y, 0)
}

/// [`swiglu`] with a forced kernel: 0 = automatic; register kernel 8 = automatic, 1..=3 = (U, NR) =
/// (1, 4), (2, 2), (4, 1); pipelined kernel 5..=7 = (1, 4), (2, 2), (4, 1).
#[doc(hidden)]
#[allow(clippy::too_many_arguments)]
pub fn swiglu_tuned<X: DevicePtr<f32>, Y: DevicePtrMut<f32>>(
    dev: &Device,
    gate: &DeviceMatrix,
    up: &DeviceMatrix,
    sel: Select,
    x: &X,
    x_per_slot: bool,
    y: &mut Y,
    variant: u32,
) -> Result<()> {
    let same = gate.count == up.count
        && gate.rows == up.rows
        && gate.cols == up.cols
        && gate.bits() == up.bits()
        && gate.group_size() == up.group_size();
    if !same {
        return Err(CudaError::Shape(format!(
            "swiglu: gate [{}, {}, {}] {}-bit/{:?} and up [{}, {}, {}] {}-bit/{:?} differ",
            gate.count,
            gate.rows,
            gate.cols,
            gate.bits(),
            gate.group_size(),
            up.count,
            up.rows,
            up.cols,
            up.bits(),
            up.group_size()
        )));
    }
    let (fam, afam) = match gate.bits() {
        4 => (&SW_Q4, &A_SW_Q4),
        8 => (&SW_Q8, &A_SW_Q8),
        16 => (&SW_BF16, &A_SW_BF16),
        b => return Err(CudaError::Shape(format!("no SwiGLU GEMV for {b}-bit weights"))),
    };
    run(dev, fam, Some(afam), gate, Some(up), sel, x, x_per_slot, y, variant)
}

/// Pointers of one matrix stack: (weights, scales, biases, group shift).
fn parts(dev: &Device, w: &DeviceMatrix) -> (u64, u64, u64, i32) {
    let s = dev.stream();
    match &w.storage {
        DeviceStorage::Affine { params, packed, scales, biases } => (
            packed.device_ptr(s).0,
            scales.device_ptr(s).0,
            biases.device_ptr(s).0,
            params.group_size.trailing_zeros() as i32,
        ),
        DeviceStorage::Dense { data } => (data.device_ptr(s).0, 0, 0, 0),
    }
}

#[allow(clippy::too_many_arguments)]
fn run<X: DevicePtr<f32>, Y: DevicePtrMut<f32>>(
    dev: &Device,
    fam: &[&'static str; 7],
    afam: Option<&[&'static str; 6]>,
    w: &DeviceMatrix,
    w2: Option<&DeviceMatrix>,
    sel: Select,
    x: &X,
    x_per_slot: bool,
    y: &mut Y,
    forced: u32,
) -> Result<()> {
    let (rows, cols, slots) = (w.rows, w.cols, sel.slots);
    let per_chunk = 128 / w.bits() as usize; // weights per 16-byte chunk
    if cols == 0 || cols % per_chunk != 0 {
        return Err(CudaError::Shape(format!("gemv: cols {cols} is not a positive multiple of {per_chunk}")));
    }
    if let DeviceStorage::Affine { params, .. } = &w.storage {
        if !params.group_size.is_power_of_two() || cols % params.group_size != 0 {
            return Err(CudaError::Shape(format!("gemv: group size {} does not divide cols {cols}", params.group_size)));
        }
    }
    if slots == 0 || slots > 65535 {
        return Err(CudaError::Shape(format!("gemv: {slots} slots (1..=65535)")));
    }
    if sel.idx == 0 && sel.matrix >= w.count {
        return Err(CudaError::Shape(format!("gemv: matrix {} of a stack of {}", sel.matrix, w.count)));
    }
    if rows == 0 || w.count * rows > i32::MAX as usize * 8 || rows > i32::MAX as usize {
        return Err(CudaError::Shape(format!("gemv: {rows} rows")));
    }
    let nch = cols / per_chunk;
    let swiglu = w2.is_some();
    let affine = w.bits() != 16;
    // Lanes per row: the smallest of 4, 8, 16, 32 covering the row's chunks (rows of up to 16 chunks
    // share a warp); then how many chunks (U) of how many consecutive rows (NR) each lane keeps in flight.
    let (t_i, tpr) = match nch {
        0..=4 => (0, 4),
        5..=8 => (1, 8),
        9..=16 => (2, 16),
        _ => (3, 32),
    };
    let per_lane = nch.div_ceil(32);
    let x_bytes = (cols + if affine { nch } else { 0 }) * 4;
    // The pipelined kernel: 16 warps (8 for SwiGLU) × 4 stages × 4 (SwiGLU 8) ring entries of 768 bytes.
    let (a_warps, a_entries) = if swiglu { (8usize, 8usize) } else { (16, 4) };
    let a_smem = (cols + nch) * 4;
    let a_smem = a_smem.div_ceil(16) * 16 + a_warps * ASYNC_STAGES * a_entries * RING_ENTRY_BYTES;
    let async_fits = afam.is_some() && a_smem <= dev.max_smem_optin() as usize;
    // Automatic choice, from the H200 table in docs/PERF.md: the pipelined kernel wins on long rows
    // (>= 4 chunks per lane: 2048x8192 11.8 vs 13.2 us, 2048x4096 7.7 vs 8.4 us) and ties elsewhere;
    // the register kernel wins on SwiGLU (8.8 vs 10.2 us) and on 8192x2048 (8.6 vs 9.3 us).
    let use_async = match forced {
        0 => async_fits && !swiglu && per_lane >= 4,
        5..=7 => {
            if !async_fits {
                return Err(CudaError::Shape(format!("gemv: no pipelined kernel for this shape ({a_smem} bytes of shared memory)")));
            }
            true
        }
        _ => false,
    };
    let (name, threads, rows_per_block, smem) = if use_async {
        // (U, NR) per stage: t<32 → (1, 4); t32 → by chunks per lane, or forced.
        let v = if t_i < 3 {
            0
        } else {
            match forced {
                5..=7 => forced as usize - 5,
                _ => match per_lane {
                    1 => 0,
                    2..=3 => 1,
                    _ => 2,
                },
            }
        };
        let nr = [4usize, 2, 1][v];
        let name = afam.unwrap()[if t_i < 3 { t_i } else { 3 + v }];
        (name, (a_warps * 32) as u32, a_warps * (32 / tpr) * nr, a_smem as u32)
    } else {
        // Register kernel: U*NR = 8 loads per lane (SwiGLU 4).
        let v = if t_i < 3 {
            t_i
        } else {
            let auto = match (swiglu, per_lane) {
                (false, 8..) => 6,
                (false, 4..=7) => 5,
                (false, 2..=3) => 4,
                (true, 4..) => 5,
                (true, 2..=3) => 4,
                _ => 3,
            };
            match forced {
                1..=3 => 2 + forced as usize,
                4 if !swiglu => 6,
                _ => auto,
            }
        };
        let nr = match (v, swiglu) {
            (0..=3, false) => 8,
            (0..=3, true) => 4,
            (4, false) => 4,
            (4, true) | (5, false) => 2,
            _ => 1,
        };
        if x_bytes > dev.max_smem_optin() as usize {
            return Err(CudaError::Shape(format!("gemv: cols {cols} needs {x_bytes} bytes of shared memory (max {})", dev.max_smem_optin())));
        }
        (fam[v], THREADS, (THREADS as usize / 32) * (32 / tpr) * nr, x_bytes as u32)
    };

    let x_need = if x_per_slot { slots * cols } else { cols };
    let (w_p, s_p, b_p, group_shift) = parts(dev, w);
    let (w2_p, s2_p, b2_p) = match w2 {
        Some(u) => {
            let (a, b, c, _) = parts(dev, u);
            (a, b, c)
        }
        None => (0, 0, 0),
    };
    let params = GemvParams {
        w: w_p,
        scales: s_p,
        biases: b_p,
        w2: w2_p,
        scales2: s2_p,
        biases2: b2_p,
        idx: sel.idx,
        x: addr(dev, x, x_need, "gemv x")?,
        y: addr_mut(dev, y, slots * rows, "gemv y")?,
        x_stride: if x_per_slot { cols as i64 } else { 0 },
        rows: rows as i32,
        cols: cols as i32,
        count: w.count as i32,
        group_shift,
        matrix: sel.matrix as i32,
        pad: 0,
    };
    let want = rows.div_ceil(rows_per_block);
    // At most the blocks that fit at once (blocks then stride over rows, paying the x copy once each;
    // one block per row tile measured 15-40% slower).
    let cap = (dev.resident_blocks(name, threads, smem)? as usize / slots).max(1);
    let cfg = LaunchConfig { grid_dim: (want.min(cap) as u32, slots as u32, 1), block_dim: (threads, 1, 1), shared_mem_bytes: smem };
    launch(dev, name, cfg, &params)
}

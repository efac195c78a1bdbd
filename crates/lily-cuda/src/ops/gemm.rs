//! Prefill GEMM (`kernels/gemm.cu`): `Y[t, rows] = X[t, cols] · W[m]ᵀ` for many tokens at once, on
//! 4/8-bit affine or dense bf16 weights, with the tensor cores; f32 activations in and out, row-major.
//! Also the fused SwiGLU first half of the MLP, and the grouped (MoE prefill) forms where sorted slots
//! belong to experts through a device array of offsets (no host round trip).
//!
//! Numerics (all four forms): each X element is rounded to bf16 (nearest even) when staged; each
//! weight is dequantised in f32 as `scale * q + bias` (one rounding, the value `lily-cpu` computes) and
//! rounded to bf16 (nearest even); dense weights are bf16 already. Products of the bf16 values are
//! accumulated in f32 (`mma.sync m16n8k16 .bf16 -> .f32`). So the result is the f32-accumulated product
//! of the bf16-rounded operands; against `lily_cpu::linear::matmul` (f32 x and weights) expect a
//! relative difference of order 1e-3 (bf16 has an 8-bit significand).
//!
//! Shapes: `cols` a positive multiple of 32 and of the group size; any `rows >= 1`; any `t` (or `n`)
//! `>= 0` (0 does nothing); tails are masked, nothing outside `Y[..t, ..rows]` is written.

use cudarc::driver::sys::CUfunction_attribute;
use cudarc::driver::{CudaSlice, DevicePtr, DevicePtrMut, DeviceRepr, LaunchConfig};

use super::{addr, addr_mut, launch};
use crate::weights::{DeviceMatrix, DeviceStorage};
use crate::{CudaError, Device, Result};

/// Must match `struct GemmParams` in `kernels/gemm.cu`.
#[repr(C)]
#[derive(Clone, Copy, Debug, Default)]
struct GemmParams {
    w: u64,
    scales: u64,
    biases: u64,
    w2: u64,
    scales2: u64,
    biases2: u64,
    x: u64,
    y: u64,
    offsets: u64,
    gather: u64,
    x_rows: i64,
    t: i32,
    rows: i32,
    cols: i32,
    count: i32,
    matrix: i32,
    group_shift: i32,
}
// SAFETY: plain old data with the kernel's layout.
unsafe impl DeviceRepr for GemmParams {}

/// Tokens (M) per block of a kernel variant. `Auto` lets the wrapper choose.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub enum Tile {
    /// 64 tokens per block when there are enough blocks to fill the GPU, else 32 (grouped: 32 when
    /// experts average fewer than 48 slots).
    #[default]
    Auto,
    /// 64 tokens × 128 weight rows per block (2 × 4 warps of 32 × 32).
    M64,
    /// 32 tokens × 128 weight rows per block (1 × 8 warps of 32 × 16).
    M32,
}

const THREADS: u32 = 256;
/// W tile rows per block (the SwiGLU forms use 64 output rows of gate and 64 of up).
const BN: usize = 128;
/// Shared-memory row pitch in bf16 elements, as in the `.cu` (64 + 8 padding).
const LDS: usize = 72;

/// Dynamic shared memory of a variant with `bm` tokens per block: two buffers of X and W tiles.
const fn smem_bytes(bm: usize) -> usize {
    2 * (bm + BN) * LDS * 2
}

// Kernel names by form; index = format (q4, q8, bf16) * 2 + tile (m64, m32).
macro_rules! family {
    ($p:literal) => {
        [
            concat!($p, "_q4_m64"),
            concat!($p, "_q4_m32"),
            concat!($p, "_q8_m64"),
            concat!($p, "_q8_m32"),
            concat!($p, "_bf16_m64"),
            concat!($p, "_bf16_m32"),
        ]
    };
}
const GEMM: [&str; 6] = family!("gemm");
const SWIGLU: [&str; 6] = family!("swiglu_gemm");
const GROUPED: [&str; 6] = family!("grouped_gemm");
const GROUPED_SWIGLU: [&str; 6] = family!("grouped_swiglu_gemm");
const FAMILIES: [&[&str; 6]; 4] = [&GEMM, &SWIGLU, &GROUPED, &GROUPED_SWIGLU];

pub(crate) const KERNELS: &[&str] = &[
    GEMM[0],
    GEMM[1],
    GEMM[2],
    GEMM[3],
    GEMM[4],
    GEMM[5],
    SWIGLU[0],
    SWIGLU[1],
    SWIGLU[2],
    SWIGLU[3],
    SWIGLU[4],
    SWIGLU[5],
    GROUPED[0],
    GROUPED[1],
    GROUPED[2],
    GROUPED[3],
    GROUPED[4],
    GROUPED[5],
    GROUPED_SWIGLU[0],
    GROUPED_SWIGLU[1],
    GROUPED_SWIGLU[2],
    GROUPED_SWIGLU[3],
    GROUPED_SWIGLU[4],
    GROUPED_SWIGLU[5],
];

/// Most experts the grouped forms take (each block scans the offsets with 256 threads × 2).
pub const MAX_EXPERTS: usize = 512;

/// One-time function attributes (called by `Device::open`): the m64 variants use 55 296 bytes of
/// dynamic shared memory, over the 48 KB default.
pub(crate) fn configure(dev: &Device) -> Result<()> {
    for fam in FAMILIES {
        for (i, name) in fam.iter().enumerate() {
            let bm = if i % 2 == 0 { 64 } else { 32 };
            dev.function(name)?
                .set_attribute(CUfunction_attribute::CU_FUNC_ATTRIBUTE_MAX_DYNAMIC_SHARED_SIZE_BYTES, smem_bytes(bm) as i32)?;
        }
    }
    Ok(())
}

/// `Y[t, rows] = X[t, cols] · W[m]ᵀ` (matrix `m` of the stack; like `lily_cpu::linear::matmul(w, m, ..)`).
/// x: `[t, cols]` f32 (16-byte aligned), y: `[t, rows]` f32. See the module doc for the numerics.
pub fn gemm<X: DevicePtr<f32>, Y: DevicePtrMut<f32>>(dev: &Device, w: &DeviceMatrix, m: usize, x: &X, t: usize, y: &mut Y) -> Result<()> {
    gemm_tiled(dev, w, m, x, t, y, Tile::Auto)
}

/// [`gemm`] with a chosen tile (benchmarks and tests).
#[doc(hidden)]
pub fn gemm_tiled<X: DevicePtr<f32>, Y: DevicePtrMut<f32>>(
    dev: &Device,
    w: &DeviceMatrix,
    m: usize,
    x: &X,
    t: usize,
    y: &mut Y,
    tile: Tile,
) -> Result<()> {
    run(dev, w, None, Group::Plain(m), x, t, y, tile)
}

/// `Y[t, rows] = silu(X · G[m]ᵀ) ⊙ (X · U[m]ᵀ)`: the first half of the SwiGLU MLP, `gate` and `up` of one
/// shape and format. x: `[t, cols]`, y: `[t, rows]`.
pub fn swiglu_gemm<X: DevicePtr<f32>, Y: DevicePtrMut<f32>>(
    dev: &Device,
    gate: &DeviceMatrix,
    up: &DeviceMatrix,
    m: usize,
    x: &X,
    t: usize,
    y: &mut Y,
) -> Result<()> {
    swiglu_gemm_tiled(dev, gate, up, m, x, t, y, Tile::Auto)
}

/// [`swiglu_gemm`] with a chosen tile.
#[doc(hidden)]
#[allow(clippy::too_many_arguments)]
pub fn swiglu_gemm_tiled<X: DevicePtr<f32>, Y: DevicePtrMut<f32>>(
    dev: &Device,
    gate: &DeviceMatrix,
    up: &DeviceMatrix,
    m: usize,
    x: &X,
    t: usize,
    y: &mut Y,
    tile: Tile,
) -> Result<()> {
    run(dev, gate, Some(up), Group::Plain(m), x, t, y, tile)
}

/// Grouped GEMM (MoE prefill). `n` sorted slots; `offsets` is a device array of `E + 1` u32
/// (`E = w.count <= 512`), non-decreasing, `offsets[0] = 0`, `offsets[E] = n`: slots
/// `offsets[e] .. offsets[e+1]` belong to expert `e`. For every slot `i`:
/// `Y[i, :] = W[e(i)] · X[r(i), :]`, where `r(i) = rows[i]` (a device array of `n` source-row indices
/// into x) when `rows` is given, else `i`. y: `[n, w.rows]`; x: `[≥ max r + 1, cols]` (without `rows`,
/// `[n, cols]`).
///
/// The per-expert counts stay on the device: the grid covers the worst case and each block finds its
/// expert from `offsets`. Offsets are clamped to `n`; a slot no expert covers is not written; a source
/// row past the end of x gives a NaN output row.
pub fn grouped_gemm<O: DevicePtr<u32>, X: DevicePtr<f32>, Y: DevicePtrMut<f32>>(
    dev: &Device,
    w: &DeviceMatrix,
    offsets: &O,
    rows: Option<&CudaSlice<u32>>,
    x: &X,
    n: usize,
    y: &mut Y,
) -> Result<()> {
    grouped_gemm_tiled(dev, w, offsets, rows, x, n, y, Tile::Auto)
}

/// [`grouped_gemm`] with a chosen tile.
#[doc(hidden)]
#[allow(clippy::too_many_arguments)]
pub fn grouped_gemm_tiled<O: DevicePtr<u32>, X: DevicePtr<f32>, Y: DevicePtrMut<f32>>(
    dev: &Device,
    w: &DeviceMatrix,
    offsets: &O,
    rows: Option<&CudaSlice<u32>>,
    x: &X,
    n: usize,
    y: &mut Y,
    tile: Tile,
) -> Result<()> {
    let g = group(dev, w, w.count, offsets, rows, n)?;
    run(dev, w, None, g, x, n, y, tile)
}

/// [`grouped_gemm`] over the first `experts` matrices of the stack only (`offsets` has `experts + 1`
/// entries): a stack that carries more matrices after the routed experts (the shared expert).
#[allow(clippy::too_many_arguments)]
pub fn grouped_gemm_over<O: DevicePtr<u32>, X: DevicePtr<f32>, Y: DevicePtrMut<f32>>(
    dev: &Device,
    w: &DeviceMatrix,
    experts: usize,
    offsets: &O,
    rows: Option<&CudaSlice<u32>>,
    x: &X,
    n: usize,
    y: &mut Y,
) -> Result<()> {
    let g = group(dev, w, experts, offsets, rows, n)?;
    run(dev, w, None, g, x, n, y, Tile::Auto)
}

/// [`grouped_swiglu_gemm`] over the first `experts` matrices of the stacks only.
#[allow(clippy::too_many_arguments)]
pub fn grouped_swiglu_gemm_over<O: DevicePtr<u32>, X: DevicePtr<f32>, Y: DevicePtrMut<f32>>(
    dev: &Device,
    gate: &DeviceMatrix,
    up: &DeviceMatrix,
    experts: usize,
    offsets: &O,
    rows: Option<&CudaSlice<u32>>,
    x: &X,
    n: usize,
    y: &mut Y,
) -> Result<()> {
    let g = group(dev, gate, experts, offsets, rows, n)?;
    run(dev, gate, Some(up), g, x, n, y, Tile::Auto)
}

/// [`grouped_gemm`] with the fused SwiGLU of [`swiglu_gemm`]:
/// `Y[i, :] = silu(G[e(i)] · X[r(i), :]) ⊙ (U[e(i)] · X[r(i), :])`.
#[allow(clippy::too_many_arguments)]
pub fn grouped_swiglu_gemm<O: DevicePtr<u32>, X: DevicePtr<f32>, Y: DevicePtrMut<f32>>(
    dev: &Device,
    gate: &DeviceMatrix,
    up: &DeviceMatrix,
    offsets: &O,
    rows: Option<&CudaSlice<u32>>,
    x: &X,
    n: usize,
    y: &mut Y,
) -> Result<()> {
    grouped_swiglu_gemm_tiled(dev, gate, up, offsets, rows, x, n, y, Tile::Auto)
}

/// [`grouped_swiglu_gemm`] with a chosen tile.
#[doc(hidden)]
#[allow(clippy::too_many_arguments)]
pub fn grouped_swiglu_gemm_tiled<O: DevicePtr<u32>, X: DevicePtr<f32>, Y: DevicePtrMut<f32>>(
    dev: &Device,
    gate: &DeviceMatrix,
    up: &DeviceMatrix,
    offsets: &O,
    rows: Option<&CudaSlice<u32>>,
    x: &X,
    n: usize,
    y: &mut Y,
    tile: Tile,
) -> Result<()> {
    let g = group(dev, gate, gate.count, offsets, rows, n)?;
    run(dev, gate, Some(up), g, x, n, y, tile)
}

/// Which rows of X and which matrix each output row uses.
#[derive(Clone, Copy, Debug)]
enum Group {
    /// Matrix `m` for every token; token `i` reads X row `i`.
    Plain(usize),
    /// Experts by device offsets (address), with an optional device gather array (address or 0).
    Grouped { offsets: u64, gather: u64, e: usize },
}

fn group<O: DevicePtr<u32>>(dev: &Device, w: &DeviceMatrix, e: usize, offsets: &O, rows: Option<&CudaSlice<u32>>, n: usize) -> Result<Group> {
    if e == 0 || e > MAX_EXPERTS || e > w.count {
        return Err(CudaError::Shape(format!("grouped gemm: {e} experts (1..={MAX_EXPERTS})")));
    }
    let offsets = addr(dev, offsets, e + 1, "grouped gemm offsets")?;
    let gather = match rows {
        Some(r) => addr(dev, r, n, "grouped gemm rows")?,
        None => 0,
    };
    Ok(Group::Grouped { offsets, gather, e })
}

/// (packed or dense data, scales, biases, log2 group) addresses.
fn parts(dev: &Device, w: &DeviceMatrix) -> (u64, u64, u64, i32) {
    let s = dev.stream();
    match &w.storage {
        DeviceStorage::Affine { params, packed, scales, biases } => {
            (packed.device_ptr(s).0, scales.device_ptr(s).0, biases.device_ptr(s).0, params.group_size.trailing_zeros() as i32)
        }
        DeviceStorage::Dense { data } => (data.device_ptr(s).0, 0, 0, 0),
    }
}

fn describe(w: &DeviceMatrix) -> String {
    format!("[{}, {}, {}] {}-bit/{:?}", w.count, w.rows, w.cols, w.bits(), w.group_size())
}

#[allow(clippy::too_many_arguments)]
fn run<X: DevicePtr<f32>, Y: DevicePtrMut<f32>>(
    dev: &Device,
    w: &DeviceMatrix,
    w2: Option<&DeviceMatrix>,
    grp: Group,
    x: &X,
    t: usize,
    y: &mut Y,
    tile: Tile,
) -> Result<()> {
    let (rows, cols) = (w.rows, w.cols);
    let what = if w2.is_some() { "swiglu gemm" } else { "gemm" };
    if let Some(u) = w2 {
        let same = u.count == w.count && u.rows == rows && u.cols == cols && u.bits() == w.bits() && u.group_size() == w.group_size();
        if !same {
            return Err(CudaError::Shape(format!("{what}: gate {} and up {} differ", describe(w), describe(u))));
        }
    }
    let fmt = match w.bits() {
        4 => 0,
        8 => 1,
        16 => 2,
        b => return Err(CudaError::Shape(format!("{what}: no kernel for {b}-bit weights"))),
    };
    if cols == 0 || cols % 32 != 0 || cols > i32::MAX as usize {
        return Err(CudaError::Shape(format!("{what}: cols {cols} is not a positive multiple of 32")));
    }
    if let Some(gs) = w.group_size() {
        if !matches!(gs, 32 | 64 | 128) || cols % gs != 0 {
            return Err(CudaError::Shape(format!("{what}: group size {gs} does not divide cols {cols} (32/64/128)")));
        }
    }
    if rows == 0 || rows > i32::MAX as usize || w.count == 0 || t > i32::MAX as usize {
        return Err(CudaError::Shape(format!("{what}: {} with {t} tokens", describe(w))));
    }
    let out_rows_per_block = if w2.is_some() { BN / 2 } else { BN };
    let n_tiles = rows.div_ceil(out_rows_per_block);
    if n_tiles > 65535 {
        return Err(CudaError::Shape(format!("{what}: {rows} rows need {n_tiles} > 65535 row tiles")));
    }
    // x rows: t (plain, or grouped without gather), else whatever x holds (bounds of the gather).
    let (matrix, offsets, gather) = match grp {
        Group::Plain(m) => {
            if m >= w.count {
                return Err(CudaError::Shape(format!("{what}: matrix {m} of a stack of {}", w.count)));
            }
            (m, 0, 0)
        }
        Group::Grouped { offsets, gather, .. } => (0, offsets, gather),
    };
    let x_rows = if gather != 0 { x.len() / cols } else { t };
    if gather != 0 && t > 0 && x_rows == 0 {
        return Err(CudaError::Shape(format!("grouped {what}: x holds {} floats, less than one row of {cols}", x.len())));
    }
    let x_p = addr(dev, x, x_rows * cols, &format!("{what} x"))?;
    if x_p % 16 != 0 {
        return Err(CudaError::Shape(format!("{what}: x must be 16-byte aligned")));
    }
    let y_p = addr_mut(dev, y, t * rows, &format!("{what} y"))?;
    if t == 0 {
        return Ok(());
    }

    let grouped = matches!(grp, Group::Grouped { .. });
    // Matrices the kernel routes over: the experts of a grouped call, else the whole stack.
    let experts = match grp {
        Group::Grouped { e, .. } => e,
        Group::Plain(_) => w.count,
    };
    let tile = match tile {
        Tile::Auto if grouped => {
            if t / experts >= 48 {
                Tile::M64
            } else {
                Tile::M32
            }
        }
        Tile::Auto => {
            if t.div_ceil(64) * n_tiles >= 2 * dev.sm_count() as usize {
                Tile::M64
            } else {
                Tile::M32
            }
        }
        other => other,
    };
    let bm = if tile == Tile::M64 { 64 } else { 32 };
    let fam = match (w2.is_some(), grouped) {
        (false, false) => &GEMM,
        (true, false) => &SWIGLU,
        (false, true) => &GROUPED,
        (true, true) => &GROUPED_SWIGLU,
    };
    let name = fam[fmt * 2 + if bm == 64 { 0 } else { 1 }];
    // Worst case of the grouped forms: sum over experts of ceil(count_e / bm) <= ceil(n / bm) + E.
    let m_tiles = t.div_ceil(bm) + if grouped { experts } else { 0 };
    if m_tiles > i32::MAX as usize {
        return Err(CudaError::Shape(format!("{what}: {t} tokens")));
    }

    let (w_p, s_p, b_p, group_shift) = parts(dev, w);
    let (w2_p, s2_p, b2_p) = match w2 {
        Some(u) => {
            let (a, b, c, _) = parts(dev, u);
            (a, b, c)
        }
        None => (0, 0, 0),
    };
    let params = GemmParams {
        w: w_p,
        scales: s_p,
        biases: b_p,
        w2: w2_p,
        scales2: s2_p,
        biases2: b2_p,
        x: x_p,
        y: y_p,
        offsets,
        gather,
        x_rows: x_rows as i64,
        t: t as i32,
        rows: rows as i32,
        cols: cols as i32,
        count: experts as i32,
        matrix: matrix as i32,
        group_shift,
    };
    let cfg =
        LaunchConfig { grid_dim: (m_tiles as u32, n_tiles as u32, 1), block_dim: (THREADS, 1, 1), shared_mem_bytes: smem_bytes(bm) as u32 };
    launch(dev, name, cfg, &params)
}

//! The Hopper (wgmma) prefill GEMM (`kernels/gemm_wgmma.cu`) for 4-bit group-64 weights: the kernels
//! behind [`super::gemm`]'s `Tile::Wg64` / `Tile::Wg128` (what `Tile::Auto` picks for that format in the
//! `Exact` and `Bf16x` precisions, with the same numerics as gemm.cu's kernels). This module launches
//! them: one pass stages x (bf16 planes in the kernel's column order, and the f32 sums per group) into
//! a device buffer the [`Device`] keeps, then the GEMM runs on it. Shapes and pointers are checked by
//! `gemm::run` before it comes here.

use cudarc::driver::sys::CUfunction_attribute;
use cudarc::driver::{DevicePtr, DeviceRepr, LaunchConfig};

use super::launch;
use crate::{CudaError, Device, Result};

/// Must match `struct WgStageParams` in `kernels/gemm_wgmma.cu`.
#[repr(C)]
#[derive(Clone, Copy, Debug, Default)]
struct StageParams {
    x: u64,
    hi: u64,
    lo: u64,
    sums: u64,
    rows: i64,
    cols: i32,
}
// SAFETY: plain old data with the kernel's layout.
unsafe impl DeviceRepr for StageParams {}

/// Must match `struct WgParams` in `kernels/gemm_wgmma.cu`.
#[repr(C)]
#[derive(Clone, Copy, Debug, Default)]
struct WgParams {
    w: u64,
    scales: u64,
    biases: u64,
    w2: u64,
    scales2: u64,
    biases2: u64,
    xh: u64,
    xl: u64,
    xsum: u64,
    y: u64,
    offsets: u64,
    gather: u64,
    x_rows: i64,
    t: i32,
    rows: i32,
    cols: i32,
    count: i32,
    matrix: i32,
}
// SAFETY: plain old data with the kernel's layout.
unsafe impl DeviceRepr for WgParams {}

const THREADS: usize = 256;
/// Weight rows a block (SwiGLU: 64 outputs of gate and up).
pub(crate) const BW: usize = 128;
const STAGES: usize = 4;
/// K a step: the group size this kernel takes.
pub(crate) const GROUP: usize = 64;

// Index = form (plain, swiglu, grouped, grouped swiglu) * 4 + tile (n128, n64) * 2 + planes - 1.
const NAMES: [&str; 16] = [
    "gemm_wgmma_plain_n128_p1",
    "gemm_wgmma_plain_n128_p2",
    "gemm_wgmma_plain_n64_p1",
    "gemm_wgmma_plain_n64_p2",
    "gemm_wgmma_swiglu_n128_p1",
    "gemm_wgmma_swiglu_n128_p2",
    "gemm_wgmma_swiglu_n64_p1",
    "gemm_wgmma_swiglu_n64_p2",
    "gemm_wgmma_grouped_n128_p1",
    "gemm_wgmma_grouped_n128_p2",
    "gemm_wgmma_grouped_n64_p1",
    "gemm_wgmma_grouped_n64_p2",
    "gemm_wgmma_grouped_swiglu_n128_p1",
    "gemm_wgmma_grouped_swiglu_n128_p2",
    "gemm_wgmma_grouped_swiglu_n64_p1",
    "gemm_wgmma_grouped_swiglu_n64_p2",
];
const STAGE_KERNEL: &str = "gemm_wgmma_stage";

const fn all_kernels() -> [&'static str; 17] {
    let mut out = [""; 17];
    let mut i = 0;
    while i < 16 {
        out[i] = NAMES[i];
        i += 1;
    }
    out[16] = STAGE_KERNEL;
    out
}
const ALL: [&str; 17] = all_kernels();
pub(crate) const KERNELS: &[&str] = &ALL;

/// (tokens a block, x planes) of variant `i`.
const fn variant(i: usize) -> (usize, usize) {
    (if (i / 2).is_multiple_of(2) { 128 } else { 64 }, i % 2 + 1)
}

/// Dynamic shared memory: STAGES stages of (planes × bt rows of 128 bytes, the codes of 128 rows × 32
/// bytes, bt X sums), each rounded to 1024 bytes, plus 1024 for aligning the ring.
const fn smem_bytes(bt: usize, planes: usize) -> usize {
    let stage = (planes * bt * 128 + BW * 32 + bt * 4).div_ceil(1024) * 1024;
    STAGES * stage + 1024
}

pub(crate) fn configure(dev: &Device) -> Result<()> {
    for (i, name) in NAMES.iter().enumerate() {
        let (bt, planes) = variant(i);
        dev.function(name)?
            .set_attribute(CUfunction_attribute::CU_FUNC_ATTRIBUTE_MAX_DYNAMIC_SHARED_SIZE_BYTES, smem_bytes(bt, planes) as i32)?;
    }
    Ok(())
}

/// One GEMM call, as `gemm::run` has checked it (addresses of live buffers of the sizes named).
#[derive(Clone, Copy, Debug)]
pub(crate) struct Call {
    /// (packed codes, scales, biases) of the gate (or only) matrix stack and of the up stack (or zeros).
    pub w: (u64, u64, u64),
    pub w2: (u64, u64, u64),
    /// f32 `[x_rows, cols]`.
    pub x: u64,
    pub x_rows: usize,
    /// f32 `[t, rows]`.
    pub y: u64,
    pub t: usize,
    pub rows: usize,
    pub cols: usize,
    /// Plain forms: the matrix of the stack.
    pub matrix: usize,
    /// Grouped forms: (offsets address, gather address or 0, experts).
    pub grouped: Option<(u64, u64, usize)>,
}

/// Bytes of staged x for `x_rows` rows of `cols` (a multiple of 64) in `planes` planes: the planes
/// (each rounded to 256 bytes) and the f32 sums per group.
pub(crate) fn stage_bytes(x_rows: usize, cols: usize, planes: usize) -> usize {
    planes * (x_rows * cols * 2).next_multiple_of(256) + x_rows * (cols / GROUP) * 4
}

/// The device's staging buffer and the x it holds: (x address, rows, columns, planes) of the last
/// staging, `None` when the buffer is new.
#[derive(Default)]
pub(crate) struct Stage {
    buf: Option<cudarc::driver::CudaSlice<u8>>,
    holds: Option<(u64, usize, usize, usize)>,
}

/// Makes the device's staging buffer at least `bytes` (grown in 16 MiB steps; the old one is freed in
/// stream order) and returns its address. The model reserves its largest need at load, so that the
/// memory it reports includes it and a prefill allocates nothing.
pub(crate) fn reserve(dev: &Device, bytes: usize) -> Result<u64> {
    let mut stage = dev.gemm_stage.lock().map_err(|_| CudaError::Driver("gemm stage buffer lock poisoned".into()))?;
    reserve_in(dev, &mut stage, bytes)
}

fn reserve_in(dev: &Device, stage: &mut Stage, bytes: usize) -> Result<u64> {
    if stage.buf.as_ref().is_none_or(|b| b.len() < bytes) {
        stage.buf = Some(dev.zeros::<u8>(bytes.max(1).next_multiple_of(16 << 20))?);
        stage.holds = None;
    }
    Ok(stage.buf.as_ref().map(|b| b.device_ptr(dev.stream()).0).unwrap_or(0))
}

/// Marks the staging buffer as holding no x (a GEMM call that stages nothing ran since).
pub(crate) fn forget_staged(dev: &Device) -> Result<()> {
    let mut stage = dev.gemm_stage.lock().map_err(|_| CudaError::Driver("gemm stage buffer lock poisoned".into()))?;
    stage.holds = None;
    Ok(())
}

/// Runs `c` with `bt` (64 or 128) tokens a block and x as `planes` (1: bf16x, 2: exact) bf16 planes.
/// `reuse_x`: the caller promises x has not been written since the previous call that staged it;
/// when the buffer still holds that staging (same x, shape and planes), it is not staged again.
pub(crate) fn run(dev: &Device, c: &Call, bt: usize, planes: usize, reuse_x: bool) -> Result<()> {
    debug_assert!(c.cols.is_multiple_of(GROUP) && c.t > 0 && matches!(bt, 64 | 128) && matches!(planes, 1 | 2));
    let groups = c.cols / GROUP;
    let plane_bytes = (c.x_rows * c.cols * 2).next_multiple_of(256);
    let key = (c.x, c.x_rows, c.cols, planes);
    let (base, staged) = {
        let mut stage = dev.gemm_stage.lock().map_err(|_| CudaError::Driver("gemm stage buffer lock poisoned".into()))?;
        let base = reserve_in(dev, &mut stage, stage_bytes(c.x_rows, c.cols, planes))?;
        let staged = reuse_x && stage.holds == Some(key);
        if !staged {
            stage.holds = None; // until the staging below has been launched
        }
        (base, staged)
    };
    let (hi, lo, sums) = (base, if planes == 2 { base + plane_bytes as u64 } else { 0 }, base + (planes * plane_bytes) as u64);

    if !staged {
        let sp = StageParams { x: c.x, hi, lo, sums, rows: c.x_rows as i64, cols: c.cols as i32 };
        let warps = c.x_rows * groups;
        let cfg =
            LaunchConfig { grid_dim: (warps.div_ceil(THREADS / 32) as u32, 1, 1), block_dim: (THREADS as u32, 1, 1), shared_mem_bytes: 0 };
        launch(dev, STAGE_KERNEL, cfg, &sp)?;
        dev.gemm_stage.lock().map_err(|_| CudaError::Driver("gemm stage buffer lock poisoned".into()))?.holds = Some(key);
    }

    let swiglu = c.w2.0 != 0;
    let form = match (swiglu, c.grouped.is_some()) {
        (false, false) => 0,
        (true, false) => 1,
        (false, true) => 2,
        (true, true) => 3,
    };
    let idx = form * 4 + if bt == 128 { 0 } else { 2 } + planes - 1;
    debug_assert_eq!(variant(idx), (bt, planes));
    let out_per_block = if swiglu { BW / 2 } else { BW };
    let (offsets, gather, experts) = c.grouped.unwrap_or((0, 0, 0));
    let m_tiles = c.t.div_ceil(bt) + experts;
    let p = WgParams {
        w: c.w.0,
        scales: c.w.1,
        biases: c.w.2,
        w2: c.w2.0,
        scales2: c.w2.1,
        biases2: c.w2.2,
        xh: hi,
        xl: lo,
        xsum: sums,
        y: c.y,
        offsets,
        gather,
        x_rows: c.x_rows as i64,
        t: c.t as i32,
        rows: c.rows as i32,
        cols: c.cols as i32,
        count: experts as i32,
        matrix: c.matrix as i32,
    };
    let cfg = LaunchConfig {
        grid_dim: (m_tiles as u32, c.rows.div_ceil(out_per_block) as u32, 1),
        block_dim: (THREADS as u32, 1, 1),
        shared_mem_bytes: smem_bytes(bt, planes) as u32,
    };
    launch(dev, NAMES[idx], cfg, &p)
}

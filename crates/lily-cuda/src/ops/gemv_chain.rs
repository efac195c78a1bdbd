//! A chain of decode GEMVs, `y_i = W_i · (RMSNorm(x_i) · norm_w_i)`, as one persistent kernel
//! (`kernels/gemv_chain.cu`): each op waits on a counter of the previous op's finished blocks instead
//! of a kernel boundary, and with [`Form::Ahead`] each block copies the next op's weights into shared
//! memory while the current op runs (and [`Form::AheadLight`] arrives without a fence). The study of an op boundary for the persistent decode step
//! (issue #10; `gpu_ops.rs` times it against the same chain as separate kernels in a PDL graph) and
//! the first building block of that step. 4-bit group-64 matrices only.

use std::marker::PhantomData;

use cudarc::driver::{CudaSlice, DevicePtr, DeviceRepr, LaunchConfig};

use super::affine_gemv::parts;
use super::affine_gemv_tc::ROUND_BYTES;
use super::{addr, launch};
use crate::weights::{DeviceMatrix, DeviceStorage};
use crate::{CudaError, Device, Result};

/// Must match `struct ChainOp` in `kernels/gemv_chain.cu`.
#[repr(C)]
#[derive(Clone, Copy, Debug, Default)]
struct ChainOp {
    w: u64,
    s: u64,
    b: u64,
    norm_w: u64,
    x: u64,
    y: u64,
    rows: i32,
    cols: i32,
}
// SAFETY: plain old data with the kernel's layout.
unsafe impl DeviceRepr for ChainOp {}

/// Must match `struct ChainParams` in `kernels/gemv_chain.cu`.
#[repr(C)]
#[derive(Clone, Copy, Debug, Default)]
struct ChainParams {
    ops: u64,
    counters: u64,
    n: i32,
    eps: f32,
    buf_bytes: i32,
    sums_off: i32,
    trace: u64,
}
// SAFETY: plain old data with the kernel's layout.
unsafe impl DeviceRepr for ChainParams {}

pub(crate) const KERNELS: &[&str] = &["gemv_chain_prefetch", "gemv_chain_after", "gemv_chain_prefetch_i8"];

/// Threads per block (`CH_WARPS` warps).
const THREADS: u32 = 512;
/// Pads after each weight row and each scale or bias row of a staged tile (`CH_WPAD`, `CH_SPAD`).
const WPAD: usize = 64;
const SPAD: usize = 16;

/// Phase stamps a block writes an op when traced (`CH_TRACE`).
pub const TRACE_STAMPS: usize = 6;

/// The kernel's forms: when a block copies an op's weights (and norm weight) into shared memory, and
/// the product's form (docs/PERF.md, sixteenth session, measures each).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Form {
    /// Copies while the previous op runs (before waiting for its output); the bf16 product.
    Ahead,
    /// Copies after the previous op's output is ready, as a separate kernel would; the bf16 product.
    After,
    /// `Ahead` with the integer form of the product (byte planes of x, u8 × s8 mmas).
    AheadI8,
}
/// Every form, in the order of [`KERNELS`].
pub const FORMS: [Form; 3] = [Form::Ahead, Form::After, Form::AheadI8];
/// The most tiles of one op a block takes (`CH_MAX_TILES`).
const MAX_TILES: usize = 8;
/// The most columns of an op (`CH_MAX_GROUPS` groups of 64).
const MAX_COLS: usize = 8192;

/// Lets the kernels use the device's opt-in shared memory.
pub(crate) fn configure(dev: &Device) -> Result<()> {
    super::allow_optin_smem(dev, KERNELS)
}

/// One op of a chain: matrix `matrix` of the stack `w`, the norm weight, and the indices of its input
/// and output among the chain's buffers.
#[derive(Clone, Copy)]
pub struct Link<'a> {
    pub w: &'a DeviceMatrix,
    pub matrix: usize,
    pub norm_w: &'a CudaSlice<f32>,
    pub x: usize,
    pub y: usize,
}

/// A chain uploaded and sized for one launch shape: its op table on the device, the counters (one per
/// op, zero at first; the kernel leaves each a multiple of the grid), the launch geometry. It holds
/// the addresses of the matrices and buffers it was made from, so it borrows them.
pub struct Chain<'a> {
    _uses: PhantomData<(&'a DeviceMatrix, &'a [CudaSlice<f32>])>,
    ops: CudaSlice<ChainOp>,
    counters: CudaSlice<u64>,
    eps: f32,
    grid: u32,
    buf_bytes: usize,
    sums_off: usize,
    smem: usize,
}

fn tile_bytes(cols: usize) -> usize {
    16 * (cols / 2 + WPAD) + 32 * (cols / 32 + SPAD)
}

impl<'a> Chain<'a> {
    /// Checks and uploads the chain: every matrix 4-bit group 64 with rows a multiple of 16 and cols
    /// of 512; each op's x of `cols` floats and y of `rows` floats among `bufs`, y not its own x.
    /// The kernel writes the y buffers through this shared borrow (device memory; read them back once
    /// the launches are done).
    pub fn new(dev: &Device, links: &[Link<'a>], bufs: &'a [CudaSlice<f32>], eps: f32) -> Result<Chain<'a>> {
        if links.is_empty() {
            return Err(CudaError::Shape("gemv_chain: no ops".into()));
        }
        let grid = dev.sm_count() as usize;
        let mut ops = Vec::with_capacity(links.len());
        let (mut buf_bytes, mut max_cols) = (0usize, 0usize);
        for (i, l) in links.iter().enumerate() {
            let w = l.w;
            let ok = matches!(&w.storage, DeviceStorage::Affine { params, .. } if super::affine_gemv_tc::fits(params.bits, params.group_size, w.cols));
            if !ok || w.rows % 16 != 0 || w.cols % 512 != 0 || w.cols > MAX_COLS || l.matrix >= w.count {
                return Err(CudaError::Shape(format!(
                    "gemv_chain op {i}: a 4-bit group-64 matrix with rows a multiple of 16 and cols of 512, at most {MAX_COLS} (matrix {} of {} [{}x{}])",
                    l.matrix, w.count, w.rows, w.cols
                )));
            }
            if l.x >= bufs.len() || l.y >= bufs.len() || l.x == l.y {
                return Err(CudaError::Shape(format!("gemv_chain op {i}: buffers x {} and y {} of {}", l.x, l.y, bufs.len())));
            }
            let (pw, ps, pb, _) = parts(dev, w);
            let m = l.matrix as u64;
            let (r, c) = (w.rows as u64, w.cols as u64);
            ops.push(ChainOp {
                w: pw + m * r * c / 2,
                s: ps + m * r * (c / 64) * 2,
                b: pb + m * r * (c / 64) * 2,
                norm_w: addr(dev, l.norm_w, w.cols, "gemv_chain norm")?,
                x: addr(dev, &bufs[l.x], w.cols, "gemv_chain x")?,
                y: addr(dev, &bufs[l.y], w.rows, "gemv_chain y")?,
                rows: w.rows as i32,
                cols: w.cols as i32,
            });
            let tiles = (w.rows / 16).div_ceil(grid);
            if tiles > MAX_TILES {
                return Err(CudaError::Shape(format!("gemv_chain op {i}: {tiles} tiles of 16 rows a block, at most {MAX_TILES}")));
            }
            buf_bytes = buf_bytes.max(tiles * tile_bytes(w.cols) + 4 * w.cols);
            max_cols = max_cols.max(w.cols);
        }
        let buf_bytes = buf_bytes.next_multiple_of(16);
        let sums_off = 2 * buf_bytes + (max_cols / 128) * ROUND_BYTES;
        // Then the group sums and (the integer form) the groups' scales, CH_MAX_GROUPS each.
        let smem = sums_off + 8 * (MAX_COLS / 64);
        // Every block must be resident at once (each op waits for all of them); a block whose shared
        // memory does not fit an SM counts none.
        for name in KERNELS {
            if dev.resident_blocks(name, THREADS, smem as u32)? < grid as u32 {
                return Err(CudaError::Shape(format!("gemv_chain: {grid} blocks of {smem} bytes are not all resident")));
            }
        }
        Ok(Chain { _uses: PhantomData, ops: dev.upload(&ops)?, counters: dev.zeros::<u64>(links.len())?, eps, grid: grid as u32, buf_bytes, sums_off, smem })
    }

    /// Runs every op in order (one launch).
    pub fn run(&mut self, dev: &Device, form: Form) -> Result<()> {
        self.run_traced(dev, form, None)
    }

    /// Blocks of a launch (a trace holds ops × `grid()` × [`TRACE_STAMPS`] stamps).
    pub fn grid(&self) -> usize {
        self.grid as usize
    }

    /// [`Chain::run`], each block writing its phase stamps (`%globaltimer`, ns) for each op into `trace`
    /// ([op][block][stamp]): next copies issued, waited, copies landed, x staged, products written, arrived.
    pub fn run_traced(&mut self, dev: &Device, form: Form, trace: Option<&mut CudaSlice<u64>>) -> Result<()> {
        let trace = match trace {
            Some(t) => super::addr_mut(dev, t, self.ops.len() * self.grid as usize * TRACE_STAMPS, "gemv_chain trace")?,
            None => 0,
        };
        let s = dev.stream();
        let p = ChainParams {
            ops: self.ops.device_ptr(s).0,
            counters: self.counters.device_ptr(s).0,
            n: self.ops.len() as i32,
            eps: self.eps,
            buf_bytes: self.buf_bytes as i32,
            sums_off: self.sums_off as i32,
            trace,
        };
        let name = KERNELS[FORMS.iter().position(|&f| f == form).expect("every form has a kernel")];
        let cfg = LaunchConfig { grid_dim: (self.grid, 1, 1), block_dim: (THREADS, 1, 1), shared_mem_bytes: self.smem as u32 };
        launch(dev, name, cfg, &p)
    }
}

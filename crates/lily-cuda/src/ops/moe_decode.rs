//! The MoE block of one decode token after its router, as one persistent kernel
//! (`kernels/moe_decode.cu`): the top-k selection, the SwiGLU of the k chosen experts and the shared
//! expert, their down projections, the weighted sum and the residual add, with one grid-wide barrier
//! between the SwiGLU and the down projections. The full-size model's layout only: 4-bit group-64
//! gate/up/down stacks of E + 1 matrices (the shared expert last) and router logits of E + 1 (the
//! shared expert's gate logit last). [`plan`] says whether a shape fits; the model keeps the separate
//! kernels otherwise.

use cudarc::driver::{CudaSlice, DevicePtr, DevicePtrMut, DeviceRepr, LaunchConfig};

use super::affine_gemv::parts;
use super::affine_gemv_tc::ROUND_BYTES;
use super::{addr, addr_mut, launch};
use crate::weights::{DeviceMatrix, DeviceStorage};
use crate::{CudaError, Device, Result};

/// Must match `struct MoeDecodeParams` in `kernels/moe_decode.cu`.
#[repr(C)]
#[derive(Clone, Copy, Debug, Default)]
struct MoeDecodeParams {
    gw: u64,
    gs: u64,
    gb: u64,
    uw: u64,
    us: u64,
    ub: u64,
    dw: u64,
    ds: u64,
    db: u64,
    logits: u64,
    norm_w: u64,
    x: u64,
    act: u64,
    barrier: u64,
    idx_out: u64,
    w_out: u64,
    trace: u64,
    eps: f32,
    h: i32,
    inter: i32,
    e: i32,
    k: i32,
    renorm: i32,
}
// SAFETY: plain old data with the kernel's layout.
unsafe impl DeviceRepr for MoeDecodeParams {}

/// By the most (slot, round) units of an output tile a warp holds in registers.
const KERNELS_U: [(&str, usize); 3] = [("moe_decode_u1", 1), ("moe_decode_u3", 3), ("moe_decode_u6", 6)];
pub(crate) const KERNELS: &[&str] = &[KERNELS_U[0].0, KERNELS_U[1].0, KERNELS_U[2].0];

/// Threads per block (`MD_WARPS` warps).
const THREADS: u32 = 512;
/// Staging pads, as in the .cu (`MD_WPAD`, `MD_SPAD`); a round's staged bytes are the GEMVs'.
const WPAD: usize = 64;
const SPAD: usize = 16;
/// Words of 8 act values a thread stages (`MD_STAGE_WORDS`).
const STAGE_WORDS: usize = 4;
/// The most experts the selection ranks (`MD_MAX_E`) and chooses.
pub const MAX_E: usize = 256;
pub const MAX_K: usize = 32;
/// Shared memory a block may take (one block an SM; what is left lets the next kernel's blocks in).
const SMEM_MAX: usize = 180 * 1024;

/// Lets the kernels use the device's opt-in shared memory.
pub(crate) fn configure(dev: &Device) -> Result<()> {
    super::allow_optin_smem(dev, KERNELS)
}

/// A launch that fits: kernel, grid, dynamic shared memory.
#[derive(Clone, Copy, Debug)]
pub struct Plan {
    name: &'static str,
    grid: u32,
    smem: u32,
}

/// 4-bit group 64 with whole rounds of columns: the tensor-core GEMVs' format ([`super::affine_gemv_tc::fits`]).
fn affine_q4g64(m: &DeviceMatrix) -> bool {
    matches!(&m.storage, DeviceStorage::Affine { params, .. } if super::affine_gemv_tc::fits(params.bits, params.group_size, m.cols))
}

/// Whether the fused kernel takes these stacks (gate/up `[E + 1, I, H]`, down `[E + 1, H, I]`) with
/// `e` routed experts, `k` chosen: 4-bit group 64, H and I multiples of 512, E ≤ [`MAX_E`], k ≤ 32,
/// the units fitting one block an SM. None otherwise (the separate kernels then run).
pub fn plan(dev: &Device, gate: &DeviceMatrix, up: &DeviceMatrix, down: &DeviceMatrix, e: usize, k: usize) -> Result<Option<Plan>> {
    let (i, h) = (gate.rows, gate.cols);
    let shapes_ok = up.rows == i && up.cols == h && down.rows == h && down.cols == i && [gate.count, up.count, down.count].iter().all(|&c| c == e + 1);
    if !shapes_ok || ![gate, up, down].iter().all(|m| affine_q4g64(m)) || h % 512 != 0 || i % 512 != 0 || e == 0 || e > MAX_E || k == 0 || k > MAX_K.min(e) {
        return Ok(None);
    }
    let ns = k + 1;
    // act is staged at most STAGE_WORDS words of 8 values a thread (`MD_STAGE_WORDS`).
    if ns * i > 8 * STAGE_WORDS * THREADS as usize {
        return Ok(None);
    }
    let units3 = ns * (i / 128);
    let Some(&(name, _)) = KERNELS_U.iter().find(|&&(_, u)| u * 16 >= units3) else { return Ok(None) };
    let grid = dev.sm_count() as usize;
    let umax = (ns * (i / 16)).div_ceil(grid);
    let mbytes = 16 * (h / 2 + WPAD) + 32 * (h / 32 + SPAD);
    let x_bytes = (h / 128) * ROUND_BYTES + 4 * (h / 64);
    let act_bytes = units3 * ROUND_BYTES + 4 * (ns * i / 64);
    let smem = (umax * 2 * mbytes + umax * 8 * 2 * 64 + x_bytes).max(act_bytes);
    if smem > SMEM_MAX.min(dev.max_smem_optin() as usize - 4096) {
        return Ok(None);
    }
    // Every block must be resident at once (the barrier waits for all of them).
    if dev.resident_blocks(name, THREADS, smem as u32)? < grid as u32 {
        return Ok(None);
    }
    Ok(Some(Plan { name, grid: grid as u32, smem: smem as u32 }))
}

/// Where the chosen experts and their weights go (tests): `k` each.
pub struct Chosen<'a> {
    pub idx: &'a mut CudaSlice<u32>,
    pub w: &'a mut CudaSlice<f32>,
}

/// Phase stamps a block writes into a trace buffer (`MD_TRACE`): its start, after the PDL wait, after
/// the selection, after its copies are issued, after x is staged, after the copies landed, after the
/// SwiGLU, after the barrier, after act is staged, at its end.
pub const TRACE_STAMPS: usize = 10;

impl Plan {
    /// Blocks of the launch (a trace buffer holds `grid() * TRACE_STAMPS` stamps).
    pub fn grid(&self) -> usize {
        self.grid as usize
    }
}

/// `x += MoE(RMSNorm(x) · norm_w)` for one token, given the router's `logits` (E + 1 floats: the
/// shared expert's gate logit last) — see the module doc. `act`: scratch of (k + 1) · I floats;
/// `barrier`: one counter, zero before its first launch and used by no other launch shape (the kernel
/// leaves it a multiple of the grid). `plan` from [`plan`] for these stacks. `chosen` and `trace`
/// (tests, benchmarks): the picks, and each block's phase stamps ([`TRACE_STAMPS`]).
#[allow(clippy::too_many_arguments)]
pub fn run<L, N, X, A>(
    dev: &Device,
    plan: &Plan,
    gate: &DeviceMatrix,
    up: &DeviceMatrix,
    down: &DeviceMatrix,
    logits: &L,
    norm_w: &N,
    eps: f32,
    e: usize,
    k: usize,
    renorm: bool,
    x: &mut X,
    act: &mut A,
    barrier: &mut CudaSlice<u64>,
    chosen: Option<Chosen<'_>>,
    trace: Option<&mut CudaSlice<u64>>,
) -> Result<()>
where
    L: DevicePtr<f32>,
    N: DevicePtr<f32>,
    X: DevicePtrMut<f32>,
    A: DevicePtrMut<f32>,
{
    let (i, h) = (gate.rows, gate.cols);
    if ![gate, up, down].iter().all(|m| affine_q4g64(m)) {
        return Err(CudaError::Shape("moe_decode: the stacks must be 4-bit, group 64".into()));
    }
    let (gw, gs, gb, _) = parts(dev, gate);
    let (uw, us, ub, _) = parts(dev, up);
    let (dw, ds, db, _) = parts(dev, down);
    let (idx_out, w_out) = match chosen {
        Some(c) => (addr_mut(dev, c.idx, k, "moe_decode idx")?, addr_mut(dev, c.w, k, "moe_decode weights")?),
        None => (0, 0),
    };
    let trace = match trace {
        Some(t) => addr_mut(dev, t, plan.grid as usize * TRACE_STAMPS, "moe_decode trace")?,
        None => 0,
    };
    let p = MoeDecodeParams {
        gw,
        gs,
        gb,
        uw,
        us,
        ub,
        dw,
        ds,
        db,
        logits: addr(dev, logits, e + 1, "moe_decode logits")?,
        norm_w: addr(dev, norm_w, h, "moe_decode norm")?,
        x: addr_mut(dev, x, h, "moe_decode x")?,
        act: addr_mut(dev, act, (k + 1) * i, "moe_decode act")?,
        barrier: addr_mut(dev, barrier, 1, "moe_decode barrier")?,
        idx_out,
        w_out,
        trace,
        eps,
        h: h as i32,
        inter: i as i32,
        e: e as i32,
        k: k as i32,
        renorm: renorm as i32,
    };
    // x, norm_w and act are read as float4s.
    if !(p.x | p.norm_w | p.act).is_multiple_of(16) {
        return Err(CudaError::Shape("moe_decode: x, the norm weight and act must be 16-byte aligned".into()));
    }
    let cfg = LaunchConfig { grid_dim: (plan.grid, 1, 1), block_dim: (THREADS, 1, 1), shared_mem_bytes: plan.smem };
    launch(dev, plan.name, cfg, &p)
}

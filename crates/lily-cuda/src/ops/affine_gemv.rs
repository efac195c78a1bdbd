//! Decode GEMV (`kernels/affine_gemv.cu`): `y = W x` for one token, on 4/8-bit affine or dense bf16
//! weights, f32 activations in and out.
//!
//! Which matrix of a stack is used is a [`Select`]: one matrix `m` (like
//! `lily_cpu::linear::matmul(w, m, ..)`), or one matrix per slot from a device array of indices (MoE
//! decode: the router writes the indices, the GEMV reads them, no host round trip). With indices,
//! slot `k` computes `y[k*rows .. (k+1)*rows] = W[idx[k]] · x_k`, where `x_k` is the one shared `x`
//! (`x_per_slot = false`, gate/up projections) or `x[k*cols ..]` (`true`, the down projection).
//! An index `>= count` yields NaN rows.

use cudarc::driver::{CudaSlice, DevicePtr, DevicePtrMut, DeviceRepr, LaunchConfig};

use super::{addr, addr_mut, affine_gemv_tc, launch};
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
    norm_w: u64,
    norm_eps: f32,
    accumulate: i32,
    counter: u64,
    route_idx: u64,
    route_w: u64,
    route_e: i32,
    route_k: i32,
    route_renorm: i32,
    pad2: i32,
    mix_w: u64,
    gate_logit: u64,
    mix_k: i32,
    mix_shared: i32,
    sel_logits: u64,
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
// The router with its selection fused: the register kernel's variants.
const R_Q4: [&str; 7] = gemv_names!("affine_gemv_route_q4");
const R_Q8: [&str; 7] = gemv_names!("affine_gemv_route_q8");
const R_BF16: [&str; 7] = gemv_names!("dense_gemv_route_bf16");
// Down projection + combine, by lanes per row (4, 8, 16, 32).
const M_Q4: [&str; 4] = ["affine_mix_q4_t4", "affine_mix_q4_t8", "affine_mix_q4_t16", "affine_mix_q4_t32"];
const M_Q8: [&str; 4] = ["affine_mix_q8_t4", "affine_mix_q8_t8", "affine_mix_q8_t16", "affine_mix_q8_t32"];
const M_BF16: [&str; 4] = ["dense_mix_bf16_t4", "dense_mix_bf16_t8", "dense_mix_bf16_t16", "dense_mix_bf16_t32"];
/// A bound on the static shared memory of every kernel here (the router's 2 KB selection buffer,
/// the norm's partial sums, the mix kernel's slot tables).
const STATIC_SMEM: usize = 4096;
/// Most slots the mix kernels take (`MIX_SLOTS` in the .cu).
pub const MIX_SLOTS: usize = 16;
/// Most experts the router kernels select among (32 · `ROUTE_NPER` in the .cu).
pub const ROUTE_MAX_EXPERTS: usize = 512;

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
    A_SW_Q8[5], A_SW_BF16[0], A_SW_BF16[1], A_SW_BF16[2], A_SW_BF16[3], A_SW_BF16[4], A_SW_BF16[5], R_Q4[0], R_Q4[1], R_Q4[2],
    R_Q4[3], R_Q4[4], R_Q4[5], R_Q4[6], R_Q8[0], R_Q8[1], R_Q8[2], R_Q8[3], R_Q8[4], R_Q8[5], R_Q8[6], R_BF16[0], R_BF16[1],
    R_BF16[2], R_BF16[3], R_BF16[4], R_BF16[5], R_BF16[6], M_Q4[0], M_Q4[1], M_Q4[2], M_Q4[3], M_Q8[0], M_Q8[1], M_Q8[2], M_Q8[3],
    M_BF16[0], M_BF16[1], M_BF16[2], M_BF16[3],
];

/// Lets every GEMV use up to the device's opt-in shared memory (x is staged there: 4 bytes per column).
pub(crate) fn configure(dev: &Device) -> Result<()> {
    let route = [&R_Q4, &R_Q8, &R_BF16];
    let mix = [&M_Q4, &M_Q8, &M_BF16];
    super::allow_optin_smem(
        dev,
        FAMILIES
            .iter()
            .flat_map(|f| f.iter())
            .chain(ASYNC_FAMILIES.iter().flat_map(|f| f.iter()))
            .chain(route.iter().flat_map(|f| f.iter()))
            .chain(mix.iter().flat_map(|f| f.iter())),
    )
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

/// What a decode GEMV fuses around its product (all off by default): the RMSNorm of its input (the
/// norm that would otherwise be a kernel of its own before it) and the residual add after it.
#[derive(Clone, Copy, Debug, Default)]
pub struct Fuse {
    /// (address, length, eps) of the norm's weight.
    norm: Option<(u64, usize, f32)>,
    accumulate: bool,
}

impl Fuse {
    /// Nothing fused.
    pub fn none() -> Self {
        Fuse::default()
    }
    /// The product uses `RMSNorm(x) · w` (`w`: `cols` floats, the folded norm weight), computed in the
    /// kernel's x staging as `lily_cpu::norm::rms_norm` does; a shared x only.
    pub fn rms_norm<W: DevicePtr<f32>>(dev: &Device, w: &W, eps: f32) -> Self {
        let (p, _g) = w.device_ptr(dev.stream());
        Fuse { norm: Some((p, w.len(), eps)), accumulate: false }
    }
    /// `y += result` instead of `y = result` (y is read first: the residual stream).
    pub fn accumulate(mut self) -> Self {
        self.accumulate = true;
        self
    }
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

/// [`gemv_with`] with a forced kernel (benchmarks and tests). 0 = automatic (4-bit weights in groups
/// of 64 with the fast decode: the tensor-core kernel, `affine_gemv_tc`, unless `LILY_GEMV=ffma`;
/// otherwise the pipelined kernel for rows of at least 4 chunks per lane when its shared memory fits,
/// else the register one). Tensor cores, bf16 form (`LILY_GEMV=bf16` for the automatic choice): 9..=12 =
/// a K split of 1, 2, 4, 8; their integer form (the automatic choice's default): 13..=16 = the same
/// splits; two rounds of weights in flight a warp (`LILY_GEMV=bf16 LILY_GEMV_DEPTH=2`): 17..=20 = the
/// same splits. Register kernel: 8 = its automatic choice,
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
    let (fam, afam) = gemv_family(w.bits(), decode)?;
    run(dev, fam, afam, w, None, sel, x, x_per_slot, y, variant, Fuse::none(), None)
}

type Families = (&'static [&'static str; 7], Option<&'static [&'static str; 6]>);

/// The register and pipelined kernel families of a plain GEMV.
fn gemv_family(bits: u32, decode: Q4Decode) -> Result<Families> {
    Ok(match (bits, decode) {
        (4, Q4Decode::Fast) => (&Q4, Some(&A_Q4)),
        (4, Q4Decode::Exact) => (&Q4X, None),
        (8, _) => (&Q8, Some(&A_Q8)),
        (16, _) => (&BF16, Some(&A_BF16)),
        (b, _) => return Err(CudaError::Shape(format!("no GEMV for {b}-bit weights"))),
    })
}

/// The register and pipelined kernel families of a SwiGLU GEMV, once gate and up are checked alike.
fn swiglu_family(gate: &DeviceMatrix, up: &DeviceMatrix) -> Result<Families> {
    check_pair(gate, up)?;
    Ok(match gate.bits() {
        4 => (&SW_Q4, Some(&A_SW_Q4)),
        8 => (&SW_Q8, Some(&A_SW_Q8)),
        16 => (&SW_BF16, Some(&A_SW_BF16)),
        b => return Err(CudaError::Shape(format!("no SwiGLU GEMV for {b}-bit weights"))),
    })
}

/// [`gemv`] with fusions (see [`Fuse`]).
pub fn gemv_fused<X: DevicePtr<f32>, Y: DevicePtrMut<f32>>(
    dev: &Device,
    w: &DeviceMatrix,
    sel: Select,
    x: &X,
    x_per_slot: bool,
    y: &mut Y,
    fuse: Fuse,
) -> Result<()> {
    gemv_fused_tuned(dev, w, sel, x, x_per_slot, y, fuse, 0)
}

/// [`gemv_fused`] with a forced kernel (as [`gemv_tuned`]; tests).
#[doc(hidden)]
#[allow(clippy::too_many_arguments)]
pub fn gemv_fused_tuned<X: DevicePtr<f32>, Y: DevicePtrMut<f32>>(
    dev: &Device,
    w: &DeviceMatrix,
    sel: Select,
    x: &X,
    x_per_slot: bool,
    y: &mut Y,
    fuse: Fuse,
    variant: u32,
) -> Result<()> {
    let (fam, afam) = gemv_family(w.bits(), Q4Decode::Fast)?;
    run(dev, fam, afam, w, None, sel, x, x_per_slot, y, variant, fuse, None)
}

/// A top-k selection inside a GEMV: where it ranks and where the picks and weights go.
struct RouteOut {
    by: RankedBy,
    idx: u64,
    w: u64,
    e: usize,
    k: usize,
    renorm: bool,
}

/// Who ranks the logits of a [`RouteOut`].
enum RankedBy {
    /// The last block of the router's own grid to finish (`router_route`): the counter of finished
    /// blocks.
    LastBlock { counter: u64 },
    /// Every block of the gate/up GEMV, from the router's logits (`swiglu_select`).
    EachBlock { logits: u64 },
}

/// The MoE router for one token with its selection fused: `logits = W x` (with [`Fuse`], typically
/// the post-attention RMSNorm), then the last block of the grid picks the `k` best of the first `e`
/// logits exactly as `moe_route::route` does (softmax in f32, ties to the lower index, best first;
/// weights renormalised over the k when `renorm`) into `idx` and `wts`. Rows past `e` (the shared
/// expert's gate logit) are computed but not ranked. `counter`: one u32 that is 0 (the kernel leaves
/// it 0).
#[allow(clippy::too_many_arguments)]
pub fn router_route<X, Y, I, W>(
    dev: &Device,
    w: &DeviceMatrix,
    x: &X,
    fuse: Fuse,
    logits: &mut Y,
    e: usize,
    k: usize,
    renorm: bool,
    counter: &mut CudaSlice<u32>,
    idx: &mut I,
    wts: &mut W,
) -> Result<()>
where
    X: DevicePtr<f32>,
    Y: DevicePtrMut<f32>,
    I: DevicePtrMut<u32>,
    W: DevicePtrMut<f32>,
{
    if e == 0 || e > w.rows || e > ROUTE_MAX_EXPERTS || k == 0 || k > e.min(32) {
        return Err(CudaError::Shape(format!(
            "router: {e} experts of {} rows, k = {k} (1 ≤ k ≤ min(E, 32), E ≤ {ROUTE_MAX_EXPERTS})",
            w.rows
        )));
    }
    let fam = match w.bits() {
        4 => &R_Q4,
        8 => &R_Q8,
        16 => &R_BF16,
        b => return Err(CudaError::Shape(format!("no router GEMV for {b}-bit weights"))),
    };
    let route = RouteOut {
        by: RankedBy::LastBlock { counter: addr_mut(dev, counter, 1, "router counter")? },
        idx: addr_mut(dev, idx, k, "router idx")?,
        w: addr_mut(dev, wts, k, "router weights")?,
        e,
        k,
        renorm,
    };
    run(dev, fam, None, w, None, Select::matrix(0), x, false, logits, 0, fuse, Some(route))
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

/// [`swiglu`] with a forced kernel: 0 = automatic; tensor cores 9..=12, integer form 13..=16 (as [`gemv_tuned`]); register kernel 8 = automatic, 1..=3 = (U, NR) =
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
    swiglu_fused_tuned(dev, gate, up, sel, x, x_per_slot, y, Fuse::none(), variant)
}

/// [`swiglu`] with fusions (see [`Fuse`]).
#[allow(clippy::too_many_arguments)]
pub fn swiglu_fused<X: DevicePtr<f32>, Y: DevicePtrMut<f32>>(
    dev: &Device,
    gate: &DeviceMatrix,
    up: &DeviceMatrix,
    sel: Select,
    x: &X,
    x_per_slot: bool,
    y: &mut Y,
    fuse: Fuse,
) -> Result<()> {
    swiglu_fused_tuned(dev, gate, up, sel, x, x_per_slot, y, fuse, 0)
}

/// [`swiglu_fused`] with a forced kernel (as [`swiglu_tuned`]; tests).
#[doc(hidden)]
#[allow(clippy::too_many_arguments)]
pub fn swiglu_fused_tuned<X: DevicePtr<f32>, Y: DevicePtrMut<f32>>(
    dev: &Device,
    gate: &DeviceMatrix,
    up: &DeviceMatrix,
    sel: Select,
    x: &X,
    x_per_slot: bool,
    y: &mut Y,
    fuse: Fuse,
    variant: u32,
) -> Result<()> {
    let (fam, afam) = swiglu_family(gate, up)?;
    run(dev, fam, afam, gate, Some(up), sel, x, x_per_slot, y, variant, fuse, None)
}

/// The largest expert count [`swiglu_select`] ranks (a block of 256 threads, one logit each).
pub const SELECT_MAX_EXPERTS: usize = 256;

/// Whether [`swiglu_select`] takes these experts (gate/up stacks) and a top-`k` of `e`: the integer
/// tensor-core SwiGLU applies to their format and is the automatic choice, `e` ≤ 256, 1 ≤ `k` ≤ 32.
pub fn select_fits(gate: &DeviceMatrix, up: &DeviceMatrix, e: usize, k: usize) -> bool {
    check_pair(gate, up).is_ok()
        && gate.bits() == 4
        && affine_gemv_tc::fits(4, gate.group_size().unwrap_or(0), gate.cols)
        && affine_gemv_tc::enabled()
        && affine_gemv_tc::int8_auto()
        && e >= 1
        && e <= SELECT_MAX_EXPERTS.min(gate.count)
        && k >= 1
        && k <= e.min(32)
}

/// The MoE gate/up of one token with the router's selection fused: each block ranks the first `e`
/// of `logits` exactly as `moe_route::route` does (ties to the lower index, best first; weights
/// renormalised over the k when `renorm`), and `y` gets `k + 1` rows of `silu(G x) * (U x)`: slots
/// 0..k the picks, best first, slot k the stack's matrix `shared` (the shared expert). `idx` and
/// `wts` get the picks and their weights (for the down projection and the combine after it). With
/// [`Fuse`], typically the post-attention RMSNorm. Needs [`select_fits`].
#[allow(clippy::too_many_arguments)]
pub fn swiglu_select<L, X, I, W, Y>(
    dev: &Device,
    gate: &DeviceMatrix,
    up: &DeviceMatrix,
    logits: &L,
    e: usize,
    k: usize,
    renorm: bool,
    shared: usize,
    x: &X,
    fuse: Fuse,
    idx: &mut I,
    wts: &mut W,
    y: &mut Y,
) -> Result<()>
where
    L: DevicePtr<f32>,
    X: DevicePtr<f32>,
    I: DevicePtrMut<u32>,
    W: DevicePtrMut<f32>,
    Y: DevicePtrMut<f32>,
{
    if !select_fits(gate, up, e, k) {
        return Err(CudaError::Shape(format!(
            "swiglu_select: {e} experts, k = {k}, [{}, {}, {}] {}-bit weights (the integer tensor-core SwiGLU, E ≤ {SELECT_MAX_EXPERTS}, 1 ≤ k ≤ min(E, 32))",
            gate.count,
            gate.rows,
            gate.cols,
            gate.bits()
        )));
    }
    let (fam, afam) = swiglu_family(gate, up)?;
    let route = RouteOut {
        by: RankedBy::EachBlock { logits: addr(dev, logits, e, "swiglu_select logits")? },
        idx: addr_mut(dev, idx, k, "swiglu_select idx")?,
        w: addr_mut(dev, wts, k, "swiglu_select weights")?,
        e,
        k,
        renorm,
    };
    let sel = Select { idx: 0, slots: k + 1, matrix: shared };
    run(dev, fam, afam, gate, Some(up), sel, x, false, y, 0, fuse, Some(route))
}

/// The MoE down projection with the combine fused, for one token: over `ns` slots (`k` routed, plus
/// the shared expert as slot `k` when `gate_logit` is given), slot `j` using matrix `idx[j]` and input
/// `x[j·cols ..]`,
///   `y (+)= Σ_j c_j · W[idx[j]] x_j`,  `c_j = route_w[j]` (j < k), `sigmoid(gate_logit[0])` (j = k),
/// summed in slot order (the unfused `moe_dispatch::combine` sums in ascending expert id: the two
/// differ by rounding). With `accumulate`, y is the residual stream. An index past the stack makes
/// the output NaN.
#[allow(clippy::too_many_arguments)]
pub fn down_mix<I, X, R, G, Y>(
    dev: &Device,
    w: &DeviceMatrix,
    idx: &I,
    x: &X,
    route_w: &R,
    gate_logit: Option<&G>,
    k: usize,
    accumulate: bool,
    y: &mut Y,
) -> Result<()>
where
    I: DevicePtr<u32>,
    X: DevicePtr<f32>,
    R: DevicePtr<f32>,
    G: DevicePtr<f32>,
    Y: DevicePtrMut<f32>,
{
    down_mix_with(dev, w, idx, x, route_w, gate_logit, k, accumulate, y, true)
}

/// [`down_mix`], with `tensor_cores = false` keeping the FFMA kernel where the tensor-core one
/// (`affine_mix_tc_q4_*`: 4-bit, group 64, rows of whole 128-column rounds, at most 64 (slot, round)
/// units) would be taken (tests and A/B runs; `LILY_GEMV=ffma` does the same).
#[doc(hidden)]
#[allow(clippy::too_many_arguments)]
pub fn down_mix_with<I, X, R, G, Y>(
    dev: &Device,
    w: &DeviceMatrix,
    idx: &I,
    x: &X,
    route_w: &R,
    gate_logit: Option<&G>,
    k: usize,
    accumulate: bool,
    y: &mut Y,
    tensor_cores: bool,
) -> Result<()>
where
    I: DevicePtr<u32>,
    X: DevicePtr<f32>,
    R: DevicePtr<f32>,
    G: DevicePtr<f32>,
    Y: DevicePtrMut<f32>,
{
    let ns = k + gate_logit.is_some() as usize;
    if k == 0 || ns > MIX_SLOTS {
        return Err(CudaError::Shape(format!("down_mix: {ns} slots (1..={MIX_SLOTS}, k ≥ 1)")));
    }
    let (rows, cols) = (w.rows, w.cols);
    let per_chunk = 128 / w.bits() as usize;
    if cols == 0 || cols % per_chunk != 0 || rows == 0 || rows > i32::MAX as usize {
        return Err(CudaError::Shape(format!("down_mix: [{rows} x {cols}] ({per_chunk} weights per chunk)")));
    }
    if let DeviceStorage::Affine { params, .. } = &w.storage {
        if !params.group_size.is_power_of_two() || cols % params.group_size != 0 {
            return Err(CudaError::Shape(format!("down_mix: group size {} does not divide cols {cols}", params.group_size)));
        }
    }
    let fam = match w.bits() {
        4 => &M_Q4,
        8 => &M_Q8,
        16 => &M_BF16,
        b => return Err(CudaError::Shape(format!("no down_mix for {b}-bit weights"))),
    };
    let nch = cols / per_chunk;
    let (t_i, tpr) = match nch {
        0..=4 => (0, 4),
        5..=8 => (1, 8),
        9..=16 => (2, 16),
        _ => (3, 32),
    };
    let stride = (cols + nch).div_ceil(4) * 4;
    let smem = ns * stride * 4;
    if smem > dev.max_smem_optin() as usize - STATIC_SMEM {
        return Err(CudaError::Shape(format!("down_mix: {ns} inputs of {cols} need {smem} bytes of shared memory")));
    }
    let (w_p, s_p, b_p, group_shift) = parts(dev, w);
    let mut params = GemvParams {
        w: w_p,
        scales: s_p,
        biases: b_p,
        idx: addr(dev, idx, ns, "down_mix idx")?,
        x: addr(dev, x, ns * cols, "down_mix x")?,
        y: addr_mut(dev, y, rows, "down_mix y")?,
        x_stride: cols as i64,
        rows: rows as i32,
        cols: cols as i32,
        count: w.count as i32,
        group_shift,
        accumulate: accumulate as i32,
        mix_w: addr(dev, route_w, k, "down_mix weights")?,
        mix_k: k as i32,
        ..Default::default()
    };
    if let Some(g) = gate_logit {
        params.gate_logit = addr(dev, g, 1, "down_mix gate logit")?;
        params.mix_shared = 1;
    }
    let tc = tensor_cores && affine_gemv_tc::enabled() && affine_gemv_tc::fits(w.bits(), w.group_size().unwrap_or(0), cols) && params.x.is_multiple_of(16);
    if let Some((name, grid, smem)) = if tc { affine_gemv_tc::plan_mix(dev, rows, cols, ns)? } else { None } {
        let cfg = LaunchConfig { grid_dim: (grid, 1, 1), block_dim: (affine_gemv_tc::THREADS, 1, 1), shared_mem_bytes: smem };
        return launch(dev, name, cfg, &params);
    }
    let name = fam[t_i];
    let rows_per_block = (THREADS as usize / 32) * (32 / tpr);
    let cap = (dev.resident_blocks(name, THREADS, smem as u32)? as usize).max(1);
    let cfg = LaunchConfig {
        grid_dim: (rows.div_ceil(rows_per_block).min(cap) as u32, 1, 1),
        block_dim: (THREADS, 1, 1),
        shared_mem_bytes: smem as u32,
    };
    launch(dev, name, cfg, &params)
}

fn check_pair(gate: &DeviceMatrix, up: &DeviceMatrix) -> Result<()> {
    let same = gate.count == up.count
        && gate.rows == up.rows
        && gate.cols == up.cols
        && gate.bits() == up.bits()
        && gate.group_size() == up.group_size();
    if same {
        return Ok(());
    }
    Err(CudaError::Shape(format!(
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
    )))
}

/// Pointers of one matrix stack: (weights, scales, biases, group shift).
pub(crate) fn parts(dev: &Device, w: &DeviceMatrix) -> (u64, u64, u64, i32) {
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
    fuse: Fuse,
    route: Option<RouteOut>,
) -> Result<()> {
    let (rows, cols, slots) = (w.rows, w.cols, sel.slots);
    if let Some((_, len, _)) = fuse.norm {
        if x_per_slot || len < cols {
            return Err(CudaError::Shape(format!("gemv: a fused norm needs a shared x and {cols} weights (has {len})")));
        }
    }
    if fuse.accumulate && slots != 1 {
        return Err(CudaError::Shape(format!("gemv: accumulating into y takes one slot ({slots} given)")));
    }
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
    // (Less the kernels' static shared memory: the norm's partial sums, the router's selection.)
    let optin = dev.max_smem_optin() as usize - STATIC_SMEM;
    let async_fits = afam.is_some() && a_smem <= optin;
    // Automatic choice, from the H200 table in docs/PERF.md: the pipelined kernel wins on long rows
    // (>= 4 chunks per lane: 2048x8192 11.8 vs 13.2 us, 2048x4096 7.7 vs 8.4 us) and ties elsewhere;
    // the register kernel wins on SwiGLU (8.8 vs 10.2 us) and on 8192x2048 (8.6 vs 9.3 us).
    // The tensor-core kernels (affine_gemv_tc.cu) take 4-bit, group-64 weights with the fast decode,
    // unless a variant 1..=8 forces an FFMA kernel: automatically (0) unless `LILY_GEMV=ffma`, or
    // forced with the K split 9..=12 = 1, 2, 4, 8 (the bf16 form, `LILY_GEMV=bf16`); the integer form
    // (the default), forced: 13..=16;
    // two rounds in flight (`LILY_GEMV_DEPTH=2`, the bf16 form of one matrix), forced: 17..=20.
    let group = w.group_size().unwrap_or(0);
    let select = matches!(route, Some(RouteOut { by: RankedBy::EachBlock { .. }, .. }));
    let tc_ok = (route.is_none() || select) && (*fam == Q4 || *fam == SW_Q4) && affine_gemv_tc::fits(w.bits(), group, cols);
    if select && !(swiglu && tc_ok && forced == 0) {
        return Err(CudaError::Shape("gemv: the selection runs in the integer tensor-core SwiGLU only".into()));
    }
    let tc = match forced {
        0 if select => Some(affine_gemv_tc::Form { ks: 0, int8: true, deep: false, select: true }),
        0 if tc_ok && affine_gemv_tc::enabled() && affine_gemv_tc::preferred(rows, cols, slots) => {
            let int8 = affine_gemv_tc::int8_auto();
            Some(affine_gemv_tc::Form { ks: 0, int8, deep: !int8 && !swiglu && affine_gemv_tc::depth2_auto(), select: false })
        }
        9..=20 if tc_ok => affine_gemv_tc::Form::forced(forced),
        9..=20 => return Err(CudaError::Shape(format!("gemv: no tensor-core kernel for {}-bit weights, group {group}, cols {cols}", w.bits()))),
        _ => None,
    };
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
        if x_bytes > optin {
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
    let mut params = GemvParams {
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
        norm_w: fuse.norm.map_or(0, |n| n.0),
        norm_eps: fuse.norm.map_or(0.0, |n| n.2),
        accumulate: fuse.accumulate as i32,
        ..Default::default()
    };
    if let Some(r) = &route {
        match r.by {
            RankedBy::LastBlock { counter } => params.counter = counter,
            RankedBy::EachBlock { logits } => params.sel_logits = logits,
        }
        params.route_idx = r.idx;
        params.route_w = r.w;
        params.route_e = r.e as i32;
        params.route_k = r.k as i32;
        params.route_renorm = r.renorm as i32;
    }
    if fuse.accumulate && params.x == params.y {
        return Err(CudaError::Shape("gemv: accumulating into its own input".into()));
    }
    // x (and the norm weight) are read as float4s by the tensor-core kernels.
    if let Some(form) = tc.filter(|_| (params.x | params.norm_w).is_multiple_of(16)) {
        let (name, grid, smem) = affine_gemv_tc::plan(dev, rows, cols, slots, swiglu, form)?;
        let cfg = LaunchConfig { grid_dim: (grid, slots as u32, 1), block_dim: (affine_gemv_tc::THREADS, 1, 1), shared_mem_bytes: smem };
        return launch(dev, name, cfg, &params);
    }
    if select {
        return Err(CudaError::Shape("gemv: the selection's x and norm weight must be 16-byte aligned".into()));
    }
    let want = rows.div_ceil(rows_per_block);
    // At most the blocks that fit at once (blocks then stride over rows, paying the x copy once each;
    // one block per row tile measured 15-40% slower).
    let cap = (dev.resident_blocks(name, threads, smem)? as usize / slots).max(1);
    let cfg = LaunchConfig { grid_dim: (want.min(cap) as u32, slots as u32, 1), block_dim: (threads, 1, 1), shared_mem_bytes: smem };
    launch(dev, name, cfg, &params)
}

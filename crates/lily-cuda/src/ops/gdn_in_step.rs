//! One decode token through a Gated DeltaNet layer's input projection and recurrent step in one launch
//! (`kernels/gdn_in_step.cu`): the work of [`super::affine_gemv::gemv_fused`] over the layer's fused
//! in_proj (RMSNorm of the residual stream folded into its staging) followed by [`super::gdn::decode_step`],
//! without the projections' round trip through memory and the kernel boundary between them. Each block
//! of the step computes the projection rows it needs (its share of the key head's q and k, the v and z
//! rows of its state columns, its head's b and a), with the tiles' weights copied into shared memory
//! before the PDL wait; the blocks of a key head (one cluster) exchange their q and k through
//! distributed shared memory. 4-bit group-64 in_proj only (the checkpoints' format).
//!
//! Opt-in (`LILY_GDN_STEP=in`) and measured slower than the two kernels it replaces: 34.8 µs a layer in
//! the 4K decode graph against 18.1 on an H100 (docs/PERF.md, twenty-third session; ncu: one 8-warp
//! block an SM, each warp a long dependent chain — one tile's whole K a warp — at ~7 cycles an
//! instruction).

use cudarc::driver::{DevicePtr, DevicePtrMut, DeviceRepr, LaunchConfig};

use super::affine_gemv::parts;
use super::affine_gemv_tc;
use super::gdn::{step_fits, step_slices, GdnDims};
use super::{addr, addr_mut};
use crate::weights::{DeviceMatrix, DeviceStorage};
use crate::{CudaError, Device, Result};

/// Must match `struct GdnInStepParams` in `kernels/gdn_in_step.cu`.
#[repr(C)]
#[derive(Clone, Copy, Debug, Default)]
struct GdnInStepParams {
    w: u64,
    scales: u64,
    biases: u64,
    x: u64,
    in_norm: u64,
    conv_w: u64,
    conv_state: u64,
    a_log: u64,
    dt_bias: u64,
    state: u64,
    norm_w: u64,
    y: u64,
    hidden: i32,
    hk: i32,
    hv: i32,
    dk: i32,
    dv: i32,
    k: i32,
    slices: i32,
    in_eps: f32,
    eps: f32,
    pad: i32,
}
// SAFETY: plain old data with the kernel's layout.
unsafe impl DeviceRepr for GdnInStepParams {}

/// (rows per lane, kernel with the copies before the PDL wait, the same after it): the rule's rows of a
/// state column a lane holds (4 lanes a column).
const KERNELS_BY_NR: [(usize, &str, &str); 3] =
    [(8, "gdn_in_step_r8", "gdn_in_step_after_r8"), (16, "gdn_in_step_r16", "gdn_in_step_after_r16"), (32, "gdn_in_step_r32", "gdn_in_step_after_r32")];
pub(crate) const KERNELS: &[&str] =
    &[KERNELS_BY_NR[0].1, KERNELS_BY_NR[1].1, KERNELS_BY_NR[2].1, KERNELS_BY_NR[0].2, KERNELS_BY_NR[1].2, KERNELS_BY_NR[2].2];

/// When a block copies its tiles, state and conv inputs into shared memory.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub enum Copies {
    /// Before the PDL wait: they stream in while the previous kernel runs (the default).
    #[default]
    Ahead,
    /// After it, as a kernel without PDL would (A/B: `LILY_GDN_STEP=in_after`).
    After,
}

impl Copies {
    pub const ALL: [Copies; 2] = [Copies::Ahead, Copies::After];
}

/// Threads per block (`IS_WARPS` warps).
const THREADS: usize = 256;
/// Pads after each staged weight row and each scale or bias row (`IS_WPAD`, `IS_SPAD`).
const WPAD: usize = 64;
const SPAD: usize = 16;
/// A bound on the kernel's static shared memory (block_sum's and the staging's partials: 160 bytes
/// by ptxas), which the opt-in limit also covers.
const STATIC_SMEM: usize = 512;
/// Staged bytes of x per 128 columns (gemv_tc.cuh's `I8_ROUND`).
const ROUND_BYTES_I8: usize = 576;

/// Lets the kernels use the device's opt-in shared memory.
pub(crate) fn configure(dev: &Device) -> Result<()> {
    super::allow_optin_smem(dev, KERNELS)
}

/// How one launch splits the layer: S blocks per value head, CS = Hv/Hk · S blocks a cluster (a key
/// head), each with Dk/CS q rows (and k rows) and Dv/S state columns.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
struct Split {
    slices: usize,
    cluster: usize,
    qr: usize,
    cols: usize,
}

impl Split {
    fn of(dims: &GdnDims) -> Split {
        let slices = step_slices(dims);
        let cluster = dims.num_v_heads / dims.num_k_heads.max(1) * slices;
        Split { slices, cluster, qr: dims.head_k_dim / cluster.max(1), cols: dims.head_v_dim / slices }
    }
    /// 16-row tiles a block computes: q, k, v, z and the b/a tile.
    fn tiles(&self) -> usize {
        2 * self.qr.div_ceil(16) + 2 * self.cols.div_ceil(16) + 1
    }
    /// The block's conv channels (its q, k and v).
    fn channels(&self) -> usize {
        2 * self.qr + self.cols
    }
}

/// Dynamic shared memory of a launch (the kernel's layout: tiles, x's byte planes, Xs and σ, then the
/// floats ST [Dk, cols] | CW [n, K] | CH [K-1, n] | P | Y [n] | QK [2·Dk] | SS [2·CS] | SP [S]).
fn smem_bytes(dims: &GdnDims, hidden: usize) -> usize {
    let s = Split::of(dims);
    let tile = 16 * (hidden / 2 + WPAD) + 32 * (hidden / 32 + SPAD);
    let (n, k) = (s.channels(), dims.conv_kernel);
    let floats = dims.head_k_dim * s.cols + n * k + (k - 1) * n + (2 * s.qr + 2 * s.cols + 2) + n + 2 * dims.head_k_dim + 2 * s.cluster + s.slices;
    s.tiles() * tile + hidden / 128 * ROUND_BYTES_I8 + 2 * (hidden / 64) * 4 + 4 * floats
}

/// Whether [`decode_in_step`] takes this layer: the step's shapes ([`step_fits`]) with Dk ≤ 128 and a
/// multiple of the cluster's blocks, each block's state columns a multiple of 8 (its warps) and at
/// most 64; `w_in` one 4-bit group-64 matrix of C + Hv·Dv + 2·Hv rows (the fused in_proj) and `hidden`
/// columns, a multiple of 512; the shared memory within the device's opt-in limit.
pub fn fits(dev: &Device, dims: &GdnDims, w_in: &DeviceMatrix) -> bool {
    let s = Split::of(dims);
    let affine = matches!(&w_in.storage, DeviceStorage::Affine { params, .. } if affine_gemv_tc::fits(params.bits, params.group_size, w_in.cols));
    let rows = dims.conv_dim() + dims.value_dim() + 2 * dims.num_v_heads;
    step_fits(dims)
        && affine
        && w_in.count == 1
        && w_in.rows == rows
        && w_in.cols.is_multiple_of(512)
        && dims.head_k_dim <= 128
        && s.qr > 0
        && dims.head_k_dim.is_multiple_of(s.cluster)
        && s.cols.is_multiple_of(8)
        && s.cols <= 64
        && smem_bytes(dims, w_in.cols) + STATIC_SMEM <= dev.max_smem_optin() as usize
}

/// One decode token of a GDN layer from the residual stream x [H]: the fused in_proj `w_in` on
/// RMSNorm(x)·`in_norm` (eps `in_eps`), then the step as [`super::gdn::decode_step`] (conv state
/// [K-1, C] and state [Hv, Dk, Dv] updated in place; y [Hv·Dv] the gated norm with weight `norm_w`
/// and eps `eps`). Needs [`fits`]; launched as clusters of a key head's blocks; `copies` places the
/// copies into shared memory before or after the PDL wait ([`Copies`]).
#[allow(clippy::too_many_arguments)]
pub fn decode_in_step<X, IN, W, CS, AL, DB, S, NW, Y>(
    dev: &Device,
    dims: &GdnDims,
    w_in: &DeviceMatrix,
    x: &X,
    in_norm: &IN,
    in_eps: f32,
    conv_w: &W,
    conv_state: &mut CS,
    a_log: &AL,
    dt_bias: &DB,
    state: &mut S,
    norm_w: &NW,
    eps: f32,
    y: &mut Y,
    copies: Copies,
) -> Result<()>
where
    X: DevicePtr<f32>,
    IN: DevicePtr<f32>,
    W: DevicePtr<f32>,
    CS: DevicePtrMut<f32>,
    AL: DevicePtr<f32>,
    DB: DevicePtr<f32>,
    S: DevicePtrMut<f32>,
    NW: DevicePtr<f32>,
    Y: DevicePtrMut<f32>,
{
    if !fits(dev, dims, w_in) {
        return Err(CudaError::Shape(format!(
            "gdn in_step: unsupported layer {dims:?} with in_proj {}x[{}x{}] (see gdn_in_step::fits)",
            w_in.count, w_in.rows, w_in.cols
        )));
    }
    let s = Split::of(dims);
    let (h, c, hv, k, vd) = (w_in.cols, dims.conv_dim(), dims.num_v_heads, dims.conv_kernel, dims.value_dim());
    let (pw, ps, pb, _) = parts(dev, w_in);
    let p = GdnInStepParams {
        w: pw,
        scales: ps,
        biases: pb,
        x: addr(dev, x, h, "gdn in_step x")?,
        in_norm: addr(dev, in_norm, h, "gdn in_step in_norm")?,
        conv_w: addr(dev, conv_w, c * k, "gdn in_step conv_w")?,
        conv_state: addr_mut(dev, conv_state, dims.conv_state_len(), "gdn in_step conv_state")?,
        a_log: addr(dev, a_log, hv, "gdn in_step a_log")?,
        dt_bias: addr(dev, dt_bias, hv, "gdn in_step dt_bias")?,
        state: addr_mut(dev, state, dims.state_len(), "gdn in_step state")?,
        norm_w: addr(dev, norm_w, dims.head_v_dim, "gdn in_step norm_w")?,
        y: addr_mut(dev, y, vd, "gdn in_step y")?,
        hidden: h as i32,
        hk: dims.num_k_heads as i32,
        hv: hv as i32,
        dk: dims.head_k_dim as i32,
        dv: dims.head_v_dim as i32,
        k: k as i32,
        slices: s.slices as i32,
        in_eps,
        eps,
        pad: 0,
    };
    let &(_, ahead, after) = KERNELS_BY_NR.iter().find(|(nr, ..)| 4 * nr >= dims.head_k_dim).expect("Dk ≤ 128 checked");
    let name = if copies == Copies::Ahead { ahead } else { after };
    let cfg = LaunchConfig {
        grid_dim: ((hv * s.slices) as u32, 1, 1),
        block_dim: (THREADS as u32, 1, 1),
        shared_mem_bytes: smem_bytes(dims, h) as u32,
    };
    super::launch_cluster(dev, name, cfg, s.cluster as u32, &p)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn dims(hk: usize, hv: usize, dk: usize, dv: usize) -> GdnDims {
        GdnDims { num_k_heads: hk, num_v_heads: hv, head_k_dim: dk, head_v_dim: dv, conv_kernel: 4 }
    }

    /// The full-size layer: clusters of 8 blocks (4 a value head), 16 q rows and 32 columns a block,
    /// 7 tiles, and its shared memory (what the kernel's layout adds up to) under an H100's 227 KiB.
    #[test]
    fn full_size_split_and_shared_memory() {
        let d = dims(16, 32, 128, 128);
        let s = Split::of(&d);
        assert_eq!(s, Split { slices: 4, cluster: 8, qr: 16, cols: 32 });
        assert_eq!(s.tiles(), 7);
        let bytes = smem_bytes(&d, 2048);
        assert!(bytes <= 227 * 1024, "{bytes}");
        // 7 tiles of 16 rows × (1024 + 64) bytes + 32 scale/bias rows × 80, x's planes, then the floats.
        assert_eq!(bytes, 7 * (16 * 1088 + 32 * 80) + 16 * 576 + 256 + 4 * (128 * 32 + 64 * 4 + 3 * 64 + 98 + 64 + 256 + 16 + 4));
    }
}

//! The gated delta rule for prefill, chunk by chunk (`kernels/gdn_chunked.cu`): the same inputs, state
//! and output as [`super::gdn::delta_rule_recurrent`] and the same numbers to f32 rounding, computed
//! with the WY / UT form of `lily_cpu::gdn::delta_rule_chunked` (HF `torch_chunk_gated_delta_rule`,
//! fla-org's `chunk_gated_delta_rule`) so that T tokens cost two well-parallel launches instead of T
//! sequential steps. f32 throughout (CUDA cores, no tensor cores).
//!
//! Two launches: `gdn_chunk_prep`, one block per (chunk of [`CHUNK`] tokens, value head), builds each
//! chunk's W, U, intra-chunk attention P and decay vectors in `scratch`; then `gdn_chunk_state_t{16,32}`,
//! one block per (value head, tile of 16 or 32 state columns), carries the state tile through the
//! chunks in shared memory and writes the output. Dk, Dv ≤ [`MAX_D`].

use cudarc::driver::{DevicePtr, DevicePtrMut, DeviceRepr, LaunchConfig};

use super::{addr, addr_mut, launch};
use crate::{CudaError, Device, Result};

pub use lily_model::GdnDims;

/// Tokens per chunk (as HF, FLA and `lily_cpu::gdn::CHUNK`).
pub const CHUNK: usize = 64;

/// The largest key and value head dims the kernels take (the state tile is [128, TW] in shared memory).
pub const MAX_D: usize = 128;

/// Must match `struct GdnChunkPrepParams` in `kernels/gdn_chunked.cu`.
#[repr(C)]
#[derive(Clone, Copy, Debug, Default)]
struct GdnChunkPrepParams {
    qkv: u64,
    g: u64,
    beta: u64,
    w: u64,
    u: u64,
    p: u64,
    e: u64,
    t_len: i32,
    hk: i32,
    hv: i32,
    dk: i32,
    dv: i32,
    pad: i32,
}
// SAFETY: plain old data with the kernel's layout.
unsafe impl DeviceRepr for GdnChunkPrepParams {}

/// Must match `struct GdnChunkStateParams` in `kernels/gdn_chunked.cu`.
#[repr(C)]
#[derive(Clone, Copy, Debug, Default)]
struct GdnChunkStateParams {
    qkv: u64,
    w: u64,
    u: u64,
    p: u64,
    e: u64,
    state: u64,
    out: u64,
    t_len: i32,
    hk: i32,
    hv: i32,
    dk: i32,
    dv: i32,
    pad: i32,
}
// SAFETY: plain old data with the kernel's layout.
unsafe impl DeviceRepr for GdnChunkStateParams {}

pub(crate) const KERNELS: &[&str] = &["gdn_chunk_prep", "gdn_chunk_state_t16", "gdn_chunk_state_t32"];

/// The f32 elements of `scratch` that [`delta_rule_chunked`] needs for `t_len` tokens: per chunk and
/// value head, W [64, Dk], U [64, Dv], P [64, 64] and two decay vectors [64]
/// (⌈T/64⌉·Hv·64·(Dk + Dv + 66); 42.2 M floats, 169 MB, for T = 4096 on the 35B shape).
pub fn scratch_len(dims: &GdnDims, t_len: usize) -> usize {
    t_len.div_ceil(CHUNK) * dims.num_v_heads * CHUNK * (dims.head_k_dim + dims.head_v_dim + CHUNK + 2)
}

/// The gated delta rule on T tokens by chunks of [`CHUNK`] tokens, from `state` [Hv, Dk, Dv] (updated in
/// place): the same inputs, state and output as [`super::gdn::delta_rule_recurrent`]. qkv: [T, C] (after
/// `gdn::conv_qk`); g, beta: [T, Hv]; out: [T, Hv, Dv] (must not alias qkv); `scratch` is device memory
/// of at least [`scratch_len`]`(dims, t_len)` f32 (contents on entry do not matter). Dk, Dv ≤ [`MAX_D`].
#[allow(clippy::too_many_arguments)]
pub fn delta_rule_chunked<Q, G, BE, S, O, SC>(
    dev: &Device,
    dims: &GdnDims,
    t_len: usize,
    qkv: &Q,
    g: &G,
    beta: &BE,
    state: &mut S,
    out: &mut O,
    scratch: &mut SC,
) -> Result<()>
where
    Q: DevicePtr<f32>,
    G: DevicePtr<f32>,
    BE: DevicePtr<f32>,
    S: DevicePtrMut<f32>,
    O: DevicePtrMut<f32>,
    SC: DevicePtrMut<f32>,
{
    // 32-column tiles read each chunk's W, Q, K and P from L2 half as often as 16-column ones; 16 only
    // when 32 would leave more than half of the SMs idle (small models).
    let blocks32 = dims.num_v_heads * dims.head_v_dim.div_ceil(32);
    let tile = if 2 * blocks32 >= dev.sm_count() as usize { 32 } else { 16 };
    delta_rule_chunked_with(dev, dims, t_len, qkv, g, beta, state, out, scratch, tile)
}

/// [`delta_rule_chunked`] with a chosen state tile width of the sequential kernel (16 or 32 columns,
/// 256 or 512 threads per block): the same numbers either way.
#[allow(clippy::too_many_arguments)]
pub fn delta_rule_chunked_with<Q, G, BE, S, O, SC>(
    dev: &Device,
    dims: &GdnDims,
    t_len: usize,
    qkv: &Q,
    g: &G,
    beta: &BE,
    state: &mut S,
    out: &mut O,
    scratch: &mut SC,
    tile: usize,
) -> Result<()>
where
    Q: DevicePtr<f32>,
    G: DevicePtr<f32>,
    BE: DevicePtr<f32>,
    S: DevicePtrMut<f32>,
    O: DevicePtrMut<f32>,
    SC: DevicePtrMut<f32>,
{
    let ok = dims.is_valid()
        && dims.head_k_dim <= MAX_D
        && dims.head_v_dim <= MAX_D
        && dims.num_v_heads <= u16::MAX as usize
        && t_len <= i32::MAX as usize;
    if !ok {
        return Err(CudaError::Shape(format!(
            "gdn chunked: unsupported dims {dims:?} (T = {t_len}; Dk, Dv ≤ {MAX_D}, Hv a multiple of Hk)"
        )));
    }
    let name = match tile {
        16 => "gdn_chunk_state_t16",
        32 => "gdn_chunk_state_t32",
        _ => return Err(CudaError::Shape(format!("gdn chunked: state tile of {tile} columns (16 or 32)"))),
    };
    if t_len == 0 {
        return Ok(());
    }
    let (hv, dk, dv) = (dims.num_v_heads, dims.head_k_dim, dims.head_v_dim);
    let blocks = t_len.div_ceil(CHUNK) * hv; // (chunk, value head) pairs
    let qkv = addr(dev, qkv, t_len * dims.conv_dim(), "gdn chunked qkv")?;
    let g = addr(dev, g, t_len * hv, "gdn chunked g")?;
    let beta = addr(dev, beta, t_len * hv, "gdn chunked beta")?;
    let state = addr_mut(dev, state, dims.state_len(), "gdn chunked state")?;
    let out = addr_mut(dev, out, t_len * dims.value_dim(), "gdn chunked out")?;
    let base = addr_mut(dev, scratch, scratch_len(dims, t_len), "gdn chunked scratch")?;
    // Scratch: W [blocks, 64, Dk] | U [blocks, 64, Dv] | P [blocks, 64, 64] | E [blocks, 2, 64].
    let f32s = std::mem::size_of::<f32>() as u64;
    let w = base;
    let u = w + (blocks * CHUNK * dk) as u64 * f32s;
    let p = u + (blocks * CHUNK * dv) as u64 * f32s;
    let e = p + (blocks * CHUNK * CHUNK) as u64 * f32s;
    let (t_len_i, hk, hv_i, dk_i, dv_i) = (t_len as i32, dims.num_k_heads as i32, hv as i32, dk as i32, dv as i32);

    let prep =
        GdnChunkPrepParams { qkv, g, beta, w, u, p, e, t_len: t_len_i, hk, hv: hv_i, dk: dk_i, dv: dv_i, pad: 0 };
    let cfg = LaunchConfig {
        grid_dim: (t_len.div_ceil(CHUNK) as u32, hv as u32, 1),
        block_dim: (256, 1, 1),
        shared_mem_bytes: 0,
    };
    launch(dev, "gdn_chunk_prep", cfg, &prep)?;

    let run =
        GdnChunkStateParams { qkv, w, u, p, e, state, out, t_len: t_len_i, hk, hv: hv_i, dk: dk_i, dv: dv_i, pad: 0 };
    let cfg = LaunchConfig {
        grid_dim: (dv.div_ceil(tile) as u32, hv as u32, 1),
        block_dim: (16 * tile as u32, 1, 1),
        shared_mem_bytes: 0,
    };
    launch(dev, name, cfg, &run)
}

//! The gated delta rule for prefill, chunk by chunk (`kernels/gdn_chunked.cu`): the same inputs, state
//! and output as [`super::gdn::delta_rule_recurrent`] and the same numbers to f32 rounding, computed
//! with the WY / UT form of `lily_cpu::gdn::delta_rule_chunked` (HF `torch_chunk_gated_delta_rule`,
//! fla-org's `chunk_gated_delta_rule`) so that T tokens cost two well-parallel launches instead of T
//! sequential steps. f32 state and sums throughout: f32 on CUDA cores, or on the tensor cores with
//! tf32 products (1xTF32: operands rounded to tf32; or 3xTF32, f32 to rounding).
//!
//! Two launches: the prep, one block per (chunk of [`CHUNK`] tokens, value head), builds each chunk's
//! W, U, intra-chunk attention P and decay vectors in `scratch` ([`PrepKernel`]: `gdn_chunk_prep` on
//! FFMA, or `gdn_chunk_prep_tc` with its products on the tensor cores); then the sequential pass, one
//! block per (value head, tile of state columns), carries the state tile through the chunks and writes
//! the output ([`StateKernel`]: `gdn_chunk_state_t{16,32}` on FFMA with 16 or 32 columns, or
//! `gdn_chunk_state_tc` on the tensor cores with 32; `_tc1` the same in 1xTF32, `_tc1_ldsmb` that with
//! its shared loads by ldmatrix). The tensor-core kernels (mma.sync m16n8k8) need Dk a multiple of 16
//! and Dv of 8, and are the default where the shape allows; the FFMA ones take any Dk, Dv ≤ [`MAX_D`].
//! The default is the bf16 pair ([`PrepKernel::Bf16`] with [`StateKernel::Bf16x32S3`]): the pass on
//! bf16 operands (m16n8k16, f32 sums and state) from a prep that writes W, P and the decayed Q and K in
//! bf16 — fla-org's numerics; `LILY_GDN_CHUNK=bf32` and `=bf32s3l` take the other bf16 passes (the same
//! bits). For A/B runs: `=ldsmb` the 1xTF32 prep with the ldmatrix pass, `=tc1` that pass without
//! ldmatrix (the same bits), `=tf32x3` the 3xTF32 pair and `=ffma` the FFMA kernels.
//! [`delta_rule_conv`] (opt-in, `LILY_GDN_CONV=fused`) runs the bf16 pair with a prep that convolves
//! its own inputs (the conv, SiLU, q/k norms and gates of `gdn::conv_qk_with`, the same bits).
//! `LILY_GDN_SOLVE=mma` (opt-in) gives the bf16 pair the prep whose (I + A)⁻¹ takes its blocks below
//! the diagonal on the tensor cores ([`PrepKernel::Bf16Ms`]); `LILY_GDN_PREP=f16` (opt-in) that prep on
//! f16 operands ([`PrepKernel::F16`]).

use cudarc::driver::sys::CUfunction_attribute;
use cudarc::driver::{DevicePtr, DevicePtrMut, DeviceRepr, LaunchConfig};

use super::gdn::{conv_source, ConvInputs, ConvSource};
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
    qt: u64,
    kt: u64,
    x: u64,
    conv_w: u64,
    conv_state: u64,
    a: u64,
    b: u64,
    a_log: u64,
    dt_bias: u64,
    t_len: i32,
    hk: i32,
    hv: i32,
    dk: i32,
    dv: i32,
    k: i32,
    x_stride: i64,
    ab_stride: i64,
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
    qt: u64,
    kt: u64,
    t_len: i32,
    hk: i32,
    hv: i32,
    dk: i32,
    dv: i32,
    pad: i32,
}
// SAFETY: plain old data with the kernel's layout.
unsafe impl DeviceRepr for GdnChunkStateParams {}

pub(crate) const KERNELS: &[&str] = &[
    "gdn_chunk_prep",
    "gdn_chunk_prep_tc",
    "gdn_chunk_prep_tc1",
    "gdn_chunk_prep_tc1_bf",
    "gdn_chunk_prep_tc1_bf_conv",
    "gdn_chunk_prep_tc1_bf_ms",
    "gdn_chunk_prep_tc_ms",
    "gdn_chunk_prep_h16_bf",
    "gdn_chunk_state_t16",
    "gdn_chunk_state_t32",
    "gdn_chunk_state_tc",
    "gdn_chunk_state_tc1",
    "gdn_chunk_state_tc1_ldsmb",
    "gdn_chunk_state_bf32",
    "gdn_chunk_state_bf32s3",
    "gdn_chunk_state_bf32s3l",
];

/// `GDC_PREP_SMEM` in `kernels/gdn_chunked.cu`: Γ [64] f64, then K, Q/V [64, 136], A [64, 65], X [64, 72]
/// and four vectors [64], f32.
const PREP_TC_SMEM: usize = 8 * 64 + 4 * (2 * 64 * 136 + 64 * 65 + 64 * 72 + 4 * 64);

/// `GDC_PREP_H16_SMEM`: Γ [64] f64, K and Q/V [64, 136] f16, then A [64, 65], X [64, 72], four vectors
/// [64] and the warps' maxima [16], f32.
const PREP_H16_SMEM: usize = 8 * 64 + 2 * 2 * 64 * 136 + 4 * (64 * 65 + 64 * 72 + 4 * 64 + 16);

/// `GDC_TC_SMEM` in `kernels/gdn_chunked.cu`: W, Q [64, 132], K [2, 64, 136], P [2, 64, 68], the decays
/// [2, 2, 64] f32, then S [128, 36] and V' [64, 36] as (hi, lo) tf32 pairs.
const TC_SMEM: usize = 4 * (2 * 64 * 132 + 2 * 64 * 136 + 2 * 64 * 68 + 4 * 64) + 8 * (128 + 64) * 36;

/// `GDC_BF_SMEM(BV, NSTG)` in `kernels/gdn_chunked.cu`: NSTG stages of W, Q̃, K̃ [64, 136] and P [64, 72]
/// bf16, U [64, BV + 8] and the decays [2, 64] f32; then S^T [BV, 136] and V'^T [BV, 72] bf16.
const fn bf_smem(bv: usize, nstg: usize) -> usize {
    nstg * (2 * 3 * 64 * 136 + 2 * 64 * 72 + 4 * 64 * (bv + 8) + 4 * 2 * 64) + 2 * bv * 136 + 2 * bv * 72
}

/// A bf16 pass's launch shape from its template arguments: BV state columns a block, NSTG stages.
const fn bf_launch(name: &'static str, bv: usize, nstg: usize) -> (&'static str, usize, u32, u32) {
    (name, bv, 512, bf_smem(bv, nstg) as u32)
}

pub(crate) fn configure(dev: &Device) -> Result<()> {
    for name in ["gdn_chunk_state_tc", "gdn_chunk_state_tc1", "gdn_chunk_state_tc1_ldsmb"] {
        dev.function(name)?.set_attribute(CUfunction_attribute::CU_FUNC_ATTRIBUTE_MAX_DYNAMIC_SHARED_SIZE_BYTES, TC_SMEM as i32)?;
    }
    for kernel in [StateKernel::Bf16x32, StateKernel::Bf16x32S3, StateKernel::Bf16x32S3L] {
        let (name, _, _, smem) = kernel.launch_shape();
        dev.function(name)?.set_attribute(CUfunction_attribute::CU_FUNC_ATTRIBUTE_MAX_DYNAMIC_SHARED_SIZE_BYTES, smem as i32)?;
    }
    for name in ["gdn_chunk_prep_tc", "gdn_chunk_prep_tc1", "gdn_chunk_prep_tc1_bf", "gdn_chunk_prep_tc1_bf_conv", "gdn_chunk_prep_tc1_bf_ms", "gdn_chunk_prep_tc_ms"] {
        dev.function(name)?.set_attribute(CUfunction_attribute::CU_FUNC_ATTRIBUTE_MAX_DYNAMIC_SHARED_SIZE_BYTES, PREP_TC_SMEM as i32)?;
    }
    dev.function("gdn_chunk_prep_h16_bf")?.set_attribute(CUfunction_attribute::CU_FUNC_ATTRIBUTE_MAX_DYNAMIC_SHARED_SIZE_BYTES, PREP_H16_SMEM as i32)?;
    Ok(())
}

/// The kernel of the per-chunk prep.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum PrepKernel {
    /// FFMA, any shape.
    Ffma,
    /// K Kᵀ, Q Kᵀ and the W, U products on the tensor cores in 3xTF32; Dk a multiple of 16, Dv of 8.
    Tensor,
    /// The same in 1xTF32 (operands rounded to tf32, f32 sums; a third of the MMAs).
    Tensor1,
    /// [`PrepKernel::Tensor1`] writing for the bf16 passes: W, P and the decayed Q and K in bf16, U and
    /// the decays in f32. Only with a `StateKernel::Bf16*` pass.
    Bf16,
    /// [`PrepKernel::Bf16`] with the blocks of (I + A)⁻¹ below the diagonal on the tensor cores
    /// (3xTF32 m16n8k8: one block barrier a distance, no scalar loops), opt-in (`LILY_GDN_SOLVE=mma`).
    Bf16Ms,
    /// [`PrepKernel::Tensor`] with that solve: its f32-exact counterpart, for the tests.
    TensorMs,
    /// The outputs of [`PrepKernel::Bf16Ms`] from f16 operands (q, k, v staged in f16; K Kᵀ, Q Kᵀ, W and
    /// U on m16n8k16 f16; v and X scaled by powers of two into f16's range): 71 KB of shared memory, three
    /// blocks an SM; opt-in (`LILY_GDN_PREP=f16`). Dk, Dv multiples of 16 and 8.
    F16,
}

impl PrepKernel {
    /// Whether this kernel takes the shape.
    pub fn supports(self, dims: &GdnDims) -> bool {
        match self {
            PrepKernel::Ffma => true,
            PrepKernel::Tensor | PrepKernel::Tensor1 | PrepKernel::Bf16 | PrepKernel::Bf16Ms | PrepKernel::TensorMs | PrepKernel::F16 => tensor_shape(dims),
        }
    }

    /// Whether this prep rounds its products' operands to tf32.
    pub fn rounds_to_tf32(self) -> bool {
        matches!(self, PrepKernel::Tensor1 | PrepKernel::Bf16 | PrepKernel::Bf16Ms)
    }

    /// Whether this prep writes for the bf16 passes (and only they read it).
    pub fn writes_bf16(self) -> bool {
        matches!(self, PrepKernel::Bf16 | PrepKernel::Bf16Ms | PrepKernel::F16)
    }
}

fn tensor_shape(dims: &GdnDims) -> bool {
    dims.head_k_dim.is_multiple_of(16) && dims.head_v_dim.is_multiple_of(8)
}

/// The kernel of the sequential pass over chunks.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum StateKernel {
    /// FFMA, 16 state columns a block (256 threads, 2 blocks per SM).
    Ffma16,
    /// FFMA, 32 state columns a block (512 threads).
    Ffma32,
    /// The tensor cores in 3xTF32, 32 state columns a block (the state update and the output by
    /// different warps at once); Dk a multiple of 16, Dv of 8.
    Tensor,
    /// The same in 1xTF32.
    Tensor1,
    /// [`StateKernel::Tensor1`] with its shared loads by ldmatrix: the A fragments of W, Q and P, and
    /// the B fragments of S and V' (kept as single tf32 words, transposed). The same bits; 16% faster
    /// (docs/PERF.md, fourteenth session).
    Tensor1Ldsmb,
    /// bf16 operands (m16n8k16), f32 sums and state, 32 state columns a block, the chunk's operands
    /// in a two-stage ring; after [`PrepKernel::Bf16`] only.
    Bf16x32,
    /// [`StateKernel::Bf16x32`] with a three-stage ring (the copies two chunks ahead). The same bits.
    Bf16x32S3,
    /// [`StateKernel::Bf16x32S3`] with the copies issued by the output warps alone, at the end of their
    /// chunk (off the state warps' chain). The same bits.
    Bf16x32S3L,
}

impl StateKernel {
    /// Whether this kernel takes the shape.
    pub fn supports(self, dims: &GdnDims) -> bool {
        match self {
            StateKernel::Ffma16 | StateKernel::Ffma32 => true,
            _ => tensor_shape(dims),
        }
    }

    /// Whether this pass rounds its operands to tf32 (1xTF32: 10 mantissa bits kept, f32 sums).
    pub fn rounds_to_tf32(self) -> bool {
        matches!(self, StateKernel::Tensor1 | StateKernel::Tensor1Ldsmb)
    }

    /// Whether this pass multiplies bf16 operands (8 significant bits; f32 sums and state).
    pub fn rounds_to_bf16(self) -> bool {
        matches!(self, StateKernel::Bf16x32 | StateKernel::Bf16x32S3 | StateKernel::Bf16x32S3L)
    }

    /// (kernel, state columns a block, threads, dynamic shared memory bytes).
    fn launch_shape(self) -> (&'static str, usize, u32, u32) {
        match self {
            StateKernel::Ffma16 => ("gdn_chunk_state_t16", 16, 256, 0),
            StateKernel::Ffma32 => ("gdn_chunk_state_t32", 32, 512, 0),
            StateKernel::Tensor => ("gdn_chunk_state_tc", 32, 512, TC_SMEM as u32),
            StateKernel::Tensor1 => ("gdn_chunk_state_tc1", 32, 512, TC_SMEM as u32),
            StateKernel::Tensor1Ldsmb => ("gdn_chunk_state_tc1_ldsmb", 32, 512, TC_SMEM as u32),
            // (name, BV, NSTG) as the kernel's template arguments in gdn_chunked.cu.
            StateKernel::Bf16x32 => bf_launch("gdn_chunk_state_bf32", 32, 2),
            StateKernel::Bf16x32S3 => bf_launch("gdn_chunk_state_bf32s3", 32, 3),
            StateKernel::Bf16x32S3L => bf_launch("gdn_chunk_state_bf32s3l", 32, 3),
        }
    }
}

/// `LILY_GDN_CHUNK` (read once, for A/B runs): `ffma` keeps the FFMA kernels, `tf32x3` takes the
/// 3xTF32 tensor-core ones, `tc1` the 1xTF32 pass without ldmatrix ([`StateKernel::Tensor1`]), `ldsmb`
/// the 1xTF32 prep with the ldmatrix pass ([`StateKernel::Tensor1Ldsmb`], the default until the
/// twenty-second session), `bf32` / `bf32s3l` the other bf16 passes; otherwise (the default) the bf16
/// prep and the three-stage bf16 pass ([`StateKernel::Bf16x32S3`]) where the shape allows (docs/PERF.md,
/// 2026-12-06 and 2026-12-07: prep + pass ~20% faster a layer than `ldsmb`, within MLX-LM's own bf16
/// distance of the exact rule).
fn chunk_env() -> &'static str {
    static V: std::sync::OnceLock<String> = std::sync::OnceLock::new();
    V.get_or_init(|| std::env::var("LILY_GDN_CHUNK").unwrap_or_default())
}

/// The bf16 pair's prep (read once; opt-in until they have run on a GPU: docs/PERF.md, twenty-eighth
/// session): [`PrepKernel::F16`] with `LILY_GDN_PREP=f16`, [`PrepKernel::Bf16Ms`] with
/// `LILY_GDN_SOLVE=mma`, else [`PrepKernel::Bf16`].
fn bf16_prep() -> PrepKernel {
    static V: std::sync::OnceLock<PrepKernel> = std::sync::OnceLock::new();
    *V.get_or_init(|| {
        if std::env::var("LILY_GDN_PREP").is_ok_and(|v| v == "f16") {
            PrepKernel::F16
        } else if std::env::var("LILY_GDN_SOLVE").is_ok_and(|v| v == "mma") {
            PrepKernel::Bf16Ms
        } else {
            PrepKernel::Bf16
        }
    })
}

/// The kernels [`delta_rule_chunked`] runs for this shape on this device.
pub fn default_kernels(dev: &Device, dims: &GdnDims) -> (PrepKernel, StateKernel) {
    if chunk_env() != "ffma" && tensor_shape(dims) {
        return match chunk_env() {
            "tf32x3" => (PrepKernel::Tensor, StateKernel::Tensor),
            "tc1" => (PrepKernel::Tensor1, StateKernel::Tensor1),
            "bf32" => (bf16_prep(), StateKernel::Bf16x32),
            "bf32s3" => (bf16_prep(), StateKernel::Bf16x32S3),
            "bf32s3l" => (bf16_prep(), StateKernel::Bf16x32S3L),
            "ldsmb" => (PrepKernel::Tensor1, StateKernel::Tensor1Ldsmb),
            _ => (bf16_prep(), StateKernel::Bf16x32S3),
        };
    }
    // 32-column tiles read each chunk's W, Q, K and P from L2 half as often as 16-column ones; 16 only
    // when 32 would leave more than half of the SMs idle (small models).
    let blocks32 = dims.num_v_heads * dims.head_v_dim.div_ceil(32);
    let state = if 2 * blocks32 >= dev.sm_count() as usize { StateKernel::Ffma32 } else { StateKernel::Ffma16 };
    (PrepKernel::Ffma, state)
}

/// The f32 elements of `scratch` that [`delta_rule_chunked`] needs for `t_len` tokens, whichever kernels
/// run: per chunk and value head, W [64, Dk], U [64, Dv], P [64, 64] and two decay vectors [64] in f32
/// (⌈T/64⌉·Hv·64·(Dk + Dv + 66); 42.2 M floats, 169 MB, for T = 4096 on the 35B shape); for the bf16
/// pair W, Q̃, K̃ [64, Dk] and P in bf16, U and the decays in f32 (⌈T/64⌉·Hv·64·(3Dk/2 + Dv + 34): 185
/// MB at that shape).
pub fn scratch_len(dims: &GdnDims, t_len: usize) -> usize {
    let bytes = scratch_layout(dims, t_len, false).bytes.max(scratch_layout(dims, t_len, true).bytes);
    bytes.div_ceil(4) as usize
}

/// Where the scratch's arrays lie (byte offsets from its start) and the bytes they take.
#[derive(Clone, Copy, Debug)]
struct ScratchLayout {
    w: u64,
    qt: u64,
    kt: u64,
    p: u64,
    u: u64,
    e: u64,
    bytes: u64,
}

/// The scratch for `t_len` tokens: per chunk and value head (a block of 64 rows), W [64, Dk] | U [64, Dv]
/// | P [64, 64] | E [2, 64] in f32; or, as the prep writes it for the bf16 passes (`bf16`), W | Q̃ | K̃
/// [64, Dk] | P in bf16, then U and E in f32 — each array 16-byte aligned where Dk is a multiple of 16,
/// as the tensor-core kernels need. The arrays not in a layout are at 0.
fn scratch_layout(dims: &GdnDims, t_len: usize, bf16: bool) -> ScratchLayout {
    let rows = (t_len.div_ceil(CHUNK) * dims.num_v_heads * CHUNK) as u64;
    let (dk, dv, ch) = (dims.head_k_dim as u64, dims.head_v_dim as u64, CHUNK as u64);
    let mut at = 0u64;
    let mut take = |bytes: u64| {
        at += bytes;
        at - bytes
    };
    if bf16 {
        let (w, qt, kt, p) = (take(rows * dk * 2), take(rows * dk * 2), take(rows * dk * 2), take(rows * ch * 2));
        let (u, e) = (take(rows * dv * 4), take(rows * 2 * 4));
        ScratchLayout { w, qt, kt, p, u, e, bytes: take(0) }
    } else {
        let (w, u, p, e) = (take(rows * dk * 4), take(rows * dv * 4), take(rows * ch * 4), take(rows * 2 * 4));
        ScratchLayout { w, qt: 0, kt: 0, p, u, e, bytes: take(0) }
    }
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
    let (prep, pass) = default_kernels(dev, dims);
    delta_rule_chunked_with(dev, dims, t_len, qkv, g, beta, state, out, scratch, prep, pass)
}

/// [`delta_rule_chunked`] with chosen kernels: the two FFMA tile widths give the same numbers; the
/// tensor-core kernels agree with the FFMA ones to f32 rounding.
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
    prep_kernel: PrepKernel,
    kernel: StateKernel,
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
    if !kernel.supports(dims) || !prep_kernel.supports(dims) {
        return Err(CudaError::Shape(format!(
            "gdn chunked: the tensor-core kernels need Dk a multiple of 16 and Dv of 8 (got {dims:?})"
        )));
    }
    if prep_kernel.writes_bf16() != kernel.rounds_to_bf16() {
        return Err(CudaError::Shape(format!(
            "gdn chunked: the bf16 passes read only the bf16 prep's scratch, and it only them (got {prep_kernel:?} \
             with {kernel:?})"
        )));
    }
    if t_len == 0 {
        return Ok(());
    }
    let hv = dims.num_v_heads;
    let inputs = Inputs::Convolved {
        qkv: addr(dev, qkv, t_len * dims.conv_dim(), "gdn chunked qkv")?,
        g: addr(dev, g, t_len * hv, "gdn chunked g")?,
        beta: addr(dev, beta, t_len * hv, "gdn chunked beta")?,
    };
    let state = addr_mut(dev, state, dims.state_len(), "gdn chunked state")?;
    let out = addr_mut(dev, out, t_len * dims.value_dim(), "gdn chunked out")?;
    let scratch = addr_mut(dev, scratch, scratch_len(dims, t_len), "gdn chunked scratch")?;
    run(dev, dims, t_len, inputs, state, out, scratch, prep_kernel, kernel)
}

/// `LILY_GDN_CONV` (read once, opt-in): `fused` has the bf16 pair's prep convolve its own inputs where
/// [`conv_fits`] ([`delta_rule_conv`]); otherwise the conv is a pass of its own before the prep
/// (`gdn::conv_qk_with`, then [`delta_rule_chunked`]). The fused prep measured slower (docs/PERF.md,
/// twenty-third session: its conv on the prep's critical path at two blocks an SM costs more than
/// the separate pass's round trip).
fn conv_env() -> &'static str {
    static V: std::sync::OnceLock<String> = std::sync::OnceLock::new();
    V.get_or_init(|| std::env::var("LILY_GDN_CONV").unwrap_or_default())
}

/// The bf16 pass [`delta_rule_conv`] runs for this shape, where the default kernels are the bf16 pair
/// and `LILY_GDN_CONV=fused`; None where the conv stays a pass of its own.
pub fn fused_conv_pass(dev: &Device, dims: &GdnDims) -> Option<StateKernel> {
    match default_kernels(dev, dims) {
        (PrepKernel::Bf16, pass) if conv_env() == "fused" => Some(pass),
        _ => None,
    }
}

/// The most conv taps the fused prep takes (`GDC_CONV_KM` in `kernels/gdn_chunked.cu`).
pub const MAX_FUSED_CONV_TAPS: usize = 4;

/// Whether [`delta_rule_conv`] takes this shape: the tensor-core shapes (Dk a multiple of 16, Dv of 8,
/// both ≤ [`MAX_D`]: a lane's 4 channels of a head of ≤ 128), 1..=[`MAX_FUSED_CONV_TAPS`] taps, x's rows
/// a multiple of 4 floats apart (16-byte loads) and at least K − 1 tokens (the new conv state is x's
/// last K − 1 rows).
pub fn conv_fits(dims: &GdnDims, t_len: usize, ins: &ConvInputs) -> bool {
    let k = dims.conv_kernel;
    dims.is_valid()
        && tensor_shape(dims)
        && dims.head_k_dim <= MAX_D
        && dims.head_v_dim <= MAX_D
        && (1..=MAX_FUSED_CONV_TAPS).contains(&k)
        && ins.x_stride >= dims.conv_dim()
        && ins.x_stride.is_multiple_of(4)
        && ins.ab_stride >= dims.num_v_heads
        && t_len >= k - 1
        && ins.x_stride.saturating_mul(t_len.max(1)) <= i32::MAX as usize
}

/// The conv and the gated delta rule of T prompt tokens in one prep and one pass: the projections x
/// (before the conv: q | k | v, T rows `ins.x_stride` floats apart) and the gate inputs a, b (T rows
/// `ins.ab_stride` apart) go straight to the bf16 pair's prep, which convolves, applies SiLU and the q/k
/// norms and forms the gates as it stages each chunk (`gdn_chunk_prep_tc1_bf_conv`); `pass` (a bf16
/// pass) follows, then `gdn_conv_finish` advances `conv_state`. The same outputs, recurrent state and
/// conv state as [`super::gdn::conv_qk_with`] and [`delta_rule_chunked_with`] on ([`PrepKernel::Bf16`],
/// `pass`), bit for bit, without the conv's [T, C] output written and read back (2 × 134 MB a layer
/// at T = 4096 on the 35B shape). Refused (Shape) where [`conv_fits`] is false or `pass` is not bf16.
#[allow(clippy::too_many_arguments)]
pub fn delta_rule_conv<X, W, CS, A, B, AL, DB, S, O, SC>(
    dev: &Device,
    dims: &GdnDims,
    t_len: usize,
    x: &X,
    conv_w: &W,
    conv_state: &mut CS,
    a: &A,
    b: &B,
    a_log: &AL,
    dt_bias: &DB,
    ins: ConvInputs,
    state: &mut S,
    out: &mut O,
    scratch: &mut SC,
    pass: StateKernel,
) -> Result<()>
where
    X: DevicePtr<f32>,
    W: DevicePtr<f32>,
    CS: DevicePtrMut<f32>,
    A: DevicePtr<f32>,
    B: DevicePtr<f32>,
    AL: DevicePtr<f32>,
    DB: DevicePtr<f32>,
    S: DevicePtrMut<f32>,
    O: DevicePtrMut<f32>,
    SC: DevicePtrMut<f32>,
{
    if !conv_fits(dims, t_len, &ins) || !pass.rounds_to_bf16() || dims.num_v_heads > u16::MAX as usize {
        return Err(CudaError::Shape(format!(
            "gdn chunked conv: unsupported {dims:?} with T = {t_len}, row strides {} and {}, pass {pass:?} (a bf16 pass, \
             Dk a multiple of 16 and Dv of 8, both ≤ {MAX_D}, ≤ {MAX_FUSED_CONV_TAPS} taps, x's stride a multiple of 4, T ≥ K − 1)",
            ins.x_stride, ins.ab_stride
        )));
    }
    if t_len == 0 {
        return Ok(());
    }
    let conv = conv_source(dev, dims, t_len, x, conv_w, conv_state, a, b, a_log, dt_bias, &ins, "gdn chunked conv")?;
    if !(conv.x.is_multiple_of(16) && conv.conv_state.is_multiple_of(16)) {
        return Err(CudaError::Shape("gdn chunked conv: x and the conv state must start 16-byte aligned".into()));
    }
    let state = addr_mut(dev, state, dims.state_len(), "gdn chunked state")?;
    let out = addr_mut(dev, out, t_len * dims.value_dim(), "gdn chunked out")?;
    let scratch = addr_mut(dev, scratch, scratch_len(dims, t_len), "gdn chunked scratch")?;
    run(dev, dims, t_len, Inputs::Projected(conv), state, out, scratch, PrepKernel::Bf16, pass)?;
    // The prep read the old conv state (the first chunk's K − 1 rows before it); now x's last K − 1 rows.
    super::gdn::conv_state_advance(dev, dims, t_len, &conv)
}

/// What the prep reads, as device addresses.
#[derive(Clone, Copy)]
enum Inputs {
    /// The conv's outputs: qkv [T, C], g and beta [T, Hv].
    Convolved { qkv: u64, g: u64, beta: u64 },
    /// The projections before the conv and the conv's and gates' parameters (the fused prep).
    Projected(ConvSource),
}

/// The prep and the pass on checked shapes and buffers (t_len > 0).
#[allow(clippy::too_many_arguments)]
fn run(dev: &Device, dims: &GdnDims, t_len: usize, inputs: Inputs, state: u64, out: u64, base: u64, prep_kernel: PrepKernel, kernel: StateKernel) -> Result<()> {
    let (name, tile, threads, smem) = kernel.launch_shape();
    let (hv, dk, dv) = (dims.num_v_heads, dims.head_k_dim, dims.head_v_dim);
    let at = scratch_layout(dims, t_len, prep_kernel.writes_bf16());
    let (w, u, p, e) = (base + at.w, base + at.u, base + at.p, base + at.e);
    let (qt, kt) = if prep_kernel.writes_bf16() { (base + at.qt, base + at.kt) } else { (0, 0) };
    let (t_len_i, hk, hv_i, dk_i, dv_i) = (t_len as i32, dims.num_k_heads as i32, hv as i32, dk as i32, dv as i32);

    let base_params = GdnChunkPrepParams { w, u, p, e, qt, kt, t_len: t_len_i, hk, hv: hv_i, dk: dk_i, dv: dv_i, ..Default::default() };
    let (prep, qkv) = match inputs {
        Inputs::Convolved { qkv, g, beta } => (GdnChunkPrepParams { qkv, g, beta, ..base_params }, qkv),
        Inputs::Projected(c) => {
            let prep = GdnChunkPrepParams {
                x: c.x,
                conv_w: c.conv_w,
                conv_state: c.conv_state,
                a: c.a,
                b: c.b,
                a_log: c.a_log,
                dt_bias: c.dt_bias,
                k: dims.conv_kernel as i32,
                x_stride: c.x_stride as i64,
                ab_stride: c.ab_stride as i64,
                ..base_params
            };
            (prep, 0) // the bf16 passes read the prep's Q̃, K̃, not qkv
        }
    };
    let (prep_name, prep_smem) = match (prep_kernel, inputs) {
        (PrepKernel::Bf16, Inputs::Projected(_)) => ("gdn_chunk_prep_tc1_bf_conv", PREP_TC_SMEM as u32),
        (_, Inputs::Projected(_)) => return Err(CudaError::Shape(format!("gdn chunked: no {prep_kernel:?} prep convolves its inputs"))),
        (PrepKernel::Ffma, _) => ("gdn_chunk_prep", 0),
        (PrepKernel::Tensor, _) => ("gdn_chunk_prep_tc", PREP_TC_SMEM as u32),
        (PrepKernel::Tensor1, _) => ("gdn_chunk_prep_tc1", PREP_TC_SMEM as u32),
        (PrepKernel::Bf16, _) => ("gdn_chunk_prep_tc1_bf", PREP_TC_SMEM as u32),
        (PrepKernel::Bf16Ms, _) => ("gdn_chunk_prep_tc1_bf_ms", PREP_TC_SMEM as u32),
        (PrepKernel::TensorMs, _) => ("gdn_chunk_prep_tc_ms", PREP_TC_SMEM as u32),
        (PrepKernel::F16, _) => ("gdn_chunk_prep_h16_bf", PREP_H16_SMEM as u32),
    };
    let cfg = LaunchConfig {
        grid_dim: (t_len.div_ceil(CHUNK) as u32, hv as u32, 1),
        block_dim: (256, 1, 1),
        shared_mem_bytes: prep_smem,
    };
    launch(dev, prep_name, cfg, &prep)?;

    let run = GdnChunkStateParams { qkv, w, u, p, e, state, out, qt, kt, t_len: t_len_i, hk, hv: hv_i, dk: dk_i, dv: dv_i, pad: 0 };
    let cfg = LaunchConfig {
        grid_dim: (dv.div_ceil(tile) as u32, hv as u32, 1),
        block_dim: (threads, 1, 1),
        shared_mem_bytes: smem,
    };
    launch(dev, name, cfg, &run)
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Every tensor-core pass and prep fits the 227 KB of shared memory a block may have on sm_90.
    #[test]
    fn shared_memory_fits_a_block() {
        const MAX: usize = 232_448;
        for k in [StateKernel::Tensor, StateKernel::Tensor1, StateKernel::Tensor1Ldsmb, StateKernel::Bf16x32, StateKernel::Bf16x32S3, StateKernel::Bf16x32S3L] {
            let (name, tile, threads, smem) = k.launch_shape();
            assert!(smem as usize <= MAX, "{name}: {smem} bytes");
            assert!(tile == 32 && threads == 512, "{name}: the tensor-core passes take 32 columns with 512 threads");
        }
    }

    /// The layouts' arrays follow one another without overlap, 16-byte aligned where Dk is a multiple
    /// of 16, and fit in `scratch_len`; the 35B shape at T = 4096 as PERF.md gives it (169 and 185 MB).
    #[test]
    fn scratch_layouts_fit() {
        let real = GdnDims { num_k_heads: 16, num_v_heads: 32, head_k_dim: 128, head_v_dim: 128, conv_kernel: 4 };
        let tiny = GdnDims { num_k_heads: 1, num_v_heads: 3, head_k_dim: 48, head_v_dim: 80, conv_kernel: 4 };
        let odd = GdnDims { num_k_heads: 1, num_v_heads: 1, head_k_dim: 7, head_v_dim: 5, conv_kernel: 4 };
        for (d, t) in [(real, 4096), (real, 1), (tiny, 1000), (odd, 65)] {
            for bf16 in [false, true] {
                let l = scratch_layout(&d, t, bf16);
                let order: Vec<u64> = if bf16 { vec![l.w, l.qt, l.kt, l.p, l.u, l.e, l.bytes] } else { vec![l.w, l.u, l.p, l.e, l.bytes] };
                assert!(order.windows(2).all(|x| x[0] < x[1]), "{d:?} T {t} bf16 {bf16}: {l:?}");
                if d.head_k_dim % 16 == 0 {
                    assert!(order.iter().all(|a| a % 16 == 0), "{d:?} T {t} bf16 {bf16}: {l:?}");
                }
                assert!(l.bytes <= 4 * scratch_len(&d, t) as u64);
            }
        }
        assert_eq!(scratch_layout(&real, 4096, false).bytes, 168_820_736);
        assert_eq!(scratch_layout(&real, 4096, true).bytes, 185_597_952);
    }

    // Two tensor-core preps a block per SM; three f16 ones (each block also holds 1 KB for the system).
    const _: () = assert!(PREP_TC_SMEM <= 232_448 / 2);
    const _: () = assert!(3 * (PREP_H16_SMEM + 1024) <= 233_472);
}

//! Gated DeltaNet decode kernels (`kernels/gdn.cu`), f32 activations and f32 state, matching
//! `lily_cpu::gdn` (same layouts): [`conv_qk`] (causal conv + SiLU + q/k L2 norm + gates, one launch),
//! [`delta_rule_recurrent`] (the state kept in registers for all T tokens) and [`gated_rmsnorm`].
//! All three take T tokens and process them in order inside the kernel. One decode token takes
//! [`decode_step`] instead where the shape allows ([`step_fits`]): all three in one launch.
//!
//! Layouts: qkv [T, C] with C = 2·Hk·Dk + Hv·Dv ordered q | k | v, head-major; conv state [K-1, C];
//! recurrent state [Hv, Dk, Dv] (HF order S[h][i_k][j_v]); value head j reads key head j / (Hv/Hk).
//! The projections may be column ranges of one fused projection's rows ([`conv_qk_with`]'s and
//! [`gated_rmsnorm_with`]'s strides: the prefill's one GEMM over [qkv | z | b | a]).

use cudarc::driver::{DevicePtr, DevicePtrMut, DeviceRepr, LaunchConfig};

use super::{addr, addr_mut, launch};
use crate::{CudaError, Device, Result};

pub use lily_model::GdnDims;

fn check(dims: &GdnDims, t_len: usize) -> Result<()> {
    let ok = dims.is_valid()
        && dims.head_k_dim <= MAX_DK
        && dims.conv_dim() * t_len.max(dims.conv_kernel) <= i32::MAX as usize
        && dims.state_len() <= i32::MAX as usize
        && 2 * dims.num_k_heads + dims.num_v_heads <= i32::MAX as usize;
    if ok {
        Ok(())
    } else {
        Err(CudaError::Shape(format!("gdn: unsupported dims {dims:?} (T = {t_len}; Dk ≤ {MAX_DK})")))
    }
}

/// The largest key head dim of the recurrent kernels (4 row groups × 64 rows per lane).
pub const MAX_DK: usize = 256;

/// Must match `struct GdnConvQkParams` in `kernels/gdn.cu`.
#[repr(C)]
#[derive(Clone, Copy, Debug, Default)]
struct GdnConvQkParams {
    x: u64,
    conv_w: u64,
    conv_state: u64,
    out: u64,
    a: u64,
    b: u64,
    a_log: u64,
    dt_bias: u64,
    g: u64,
    beta: u64,
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
unsafe impl DeviceRepr for GdnConvQkParams {}

/// Must match `struct GdnRecurrentParams` in `kernels/gdn.cu`.
#[repr(C)]
#[derive(Clone, Copy, Debug, Default)]
struct GdnRecurrentParams {
    qkv: u64,
    g: u64,
    beta: u64,
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
unsafe impl DeviceRepr for GdnRecurrentParams {}

/// Must match `struct GdnStepParams` in `kernels/gdn.cu`.
#[repr(C)]
#[derive(Clone, Copy, Debug, Default)]
struct GdnStepParams {
    x: u64,
    conv_w: u64,
    conv_state: u64,
    a: u64,
    b: u64,
    a_log: u64,
    dt_bias: u64,
    state: u64,
    z: u64,
    norm_w: u64,
    y: u64,
    hk: i32,
    hv: i32,
    dk: i32,
    dv: i32,
    k: i32,
    eps: f32,
    slices: i32,
    pad: i32,
}
// SAFETY: plain old data with the kernel's layout.
unsafe impl DeviceRepr for GdnStepParams {}

/// Blocks per value head of [`decode_step`]: the most (1, 2, 4, 8) that keeps a cluster of Hv/Hk heads
/// within 8 blocks and each block a whole number of 8-column warps (`LILY_GDN_SLICES` caps it, read
/// once; 1 is one block per head, for A/B benchmarks).
pub(crate) fn step_slices(dims: &GdnDims) -> usize {
    static CAP: std::sync::OnceLock<usize> = std::sync::OnceLock::new();
    let cap = *CAP.get_or_init(|| std::env::var("LILY_GDN_SLICES").ok().and_then(|v| v.parse().ok()).unwrap_or(8));
    let ratio = dims.num_v_heads / dims.num_k_heads;
    [8usize, 4, 2, 1].into_iter().find(|&s| s <= cap && ratio * s <= 8 && dims.head_v_dim.is_multiple_of(8 * s)).unwrap_or(1)
}

/// Must match `struct GdnGatedNormParams` in `kernels/gdn.cu`.
#[repr(C)]
#[derive(Clone, Copy, Debug, Default)]
struct GdnGatedNormParams {
    x: u64,
    z: u64,
    w: u64,
    y: u64,
    rows: i32,
    dv: i32,
    eps: f32,
    hv: i32,
    z_stride: i64,
}
// SAFETY: plain old data with the kernel's layout.
unsafe impl DeviceRepr for GdnGatedNormParams {}

/// (rows per lane, kernel) of the recurrent kernels, smallest first.
const RECURRENT: &[(usize, &str)] = &[
    (2, "gdn_recurrent_r2"),
    (4, "gdn_recurrent_r4"),
    (8, "gdn_recurrent_r8"),
    (16, "gdn_recurrent_r16"),
    (32, "gdn_recurrent_r32"),
    (64, "gdn_recurrent_r64"),
];

/// (rows per lane, kernel) of the one-token step kernels, as [`RECURRENT`].
const STEP: &[(usize, &str)] = &[
    (2, "gdn_step_r2"),
    (4, "gdn_step_r4"),
    (8, "gdn_step_r8"),
    (16, "gdn_step_r16"),
    (32, "gdn_step_r32"),
    (64, "gdn_step_r64"),
];
/// The same with the loads batched ([`StepLoads::Batched`], the default).
const STEP_BATCHED: &[(usize, &str)] = &[
    (2, "gdn_step_b_r2"),
    (4, "gdn_step_b_r4"),
    (8, "gdn_step_b_r8"),
    (16, "gdn_step_b_r16"),
    (32, "gdn_step_b_r32"),
    (64, "gdn_step_b_r64"),
];
/// The batched form with its copies 4 bytes each ([`StepLoads::BatchedNarrow`]).
const STEP_BATCHED_NARROW: &[(usize, &str)] = &[
    (2, "gdn_step_bn_r2"),
    (4, "gdn_step_bn_r4"),
    (8, "gdn_step_bn_r8"),
    (16, "gdn_step_bn_r16"),
    (32, "gdn_step_bn_r32"),
    (64, "gdn_step_bn_r64"),
];
/// The most threads a block of the batched forms (their launch bound) and the dynamic shared memory
/// they may ask for without opting in; shapes past either take [`StepLoads::WhenNeeded`].
const BATCHED_THREADS: usize = 256;
const BATCHED_SMEM: usize = 48 * 1024;

/// How [`decode_step`] issues its loads and stores (kernels/gdn.cu, `gdn_step_batched`).
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub enum StepLoads {
    /// Each load where it is first needed (the conv's a channel at a time, the gates after the
    /// norms, the state after them, z and the norm weight after the cluster's exchange), the state
    /// stored before the exchange. The form for blocks past the batched one's limits.
    WhenNeeded,
    /// Conv weights, conv state and the state columns loaded before the PDL wait, the token's inputs
    /// in one batch after it, the stores after the cluster's exchange, the q/k conv state shifted by
    /// every block of the cluster, the last cluster barrier without a fence (2026-12-06, seventeenth
    /// session: the step's marginal 10.5 → 8.0 µs a layer at 4K on an H100); the conv weights, conv
    /// state and x copied 16 bytes at a time where the shapes allow (K = 4, channel runs in fours).
    #[default]
    Batched,
    /// `Batched` with every copy 4 bytes (its first form, for A/B runs).
    BatchedNarrow,
}

impl StepLoads {
    /// Every form, for tests and A/B runs.
    pub const ALL: [StepLoads; 3] = [StepLoads::WhenNeeded, StepLoads::Batched, StepLoads::BatchedNarrow];
}

/// Whether [`decode_step`] runs these dims in the batched form ([`StepLoads::Batched`]) rather than
/// the first one: blocks of at most 256 threads, and 48 KiB of shared memory.
pub fn step_batched_fits(dims: &GdnDims) -> bool {
    step_fits(dims) && batched_takes(dims, dims.head_v_dim / step_slices(dims))
}

/// Whether blocks of `cols` state columns (4·cols threads) fit the batched form's limits.
fn batched_takes(dims: &GdnDims, cols: usize) -> bool {
    4 * cols <= BATCHED_THREADS && batched_smem(dims, cols) <= BATCHED_SMEM
}

/// Bytes of dynamic shared memory of the batched forms: the block's n = 2·Dk + Dv/S channels as
/// Y [n] | W [n, K] | H [K-1, n] | X [n] floats.
fn batched_smem(dims: &GdnDims, cols: usize) -> usize {
    4 * (2 * dims.head_k_dim + cols) * (2 * dims.conv_kernel + 1)
}

pub(crate) const KERNELS: &[&str] = &[
    "gdn_step_r2",
    "gdn_step_r4",
    "gdn_step_r8",
    "gdn_step_r16",
    "gdn_step_r32",
    "gdn_step_r64",
    "gdn_step_b_r2",
    "gdn_step_b_r4",
    "gdn_step_b_r8",
    "gdn_step_b_r16",
    "gdn_step_b_r32",
    "gdn_step_b_r64",
    "gdn_step_bn_r2",
    "gdn_step_bn_r4",
    "gdn_step_bn_r8",
    "gdn_step_bn_r16",
    "gdn_step_bn_r32",
    "gdn_step_bn_r64",
    "gdn_conv_qk",
    "gdn_conv_qk_tiled",
    "gdn_conv_qk_warp_k4",
    "gdn_conv_qk_warp_k8",
    "gdn_conv_finish",
    "gdn_recurrent_r2",
    "gdn_recurrent_r4",
    "gdn_recurrent_r8",
    "gdn_recurrent_r16",
    "gdn_recurrent_r32",
    "gdn_recurrent_r64",
    "gdn_gated_norm",
    "gdn_gated_norm_stage",
    "gdn_gated_norm_stage_d128_h4",
];

/// Tokens per block of the tiled conv (prompt chunks of at least this many tokens use it).
pub const CONV_TILE: usize = 16;
/// The most conv taps the tiled conv takes.
pub const MAX_CONV_TAPS: usize = 8;

/// Default warps per block of the recurrent kernel (8 state columns per warp).
pub const RECURRENT_WARPS: u32 = 2;

/// Steps 1-3 of the layer on T tokens, one launch: `out = silu(causal_conv(x))` with the conv state
/// `conv_state` [K-1, C] updated in place (to the last K-1 rows of concat(conv_state, x)); then
/// q ← l2norm(q)/√Dk and k ← l2norm(k) per head in `out`; and `g = -exp(a_log)·softplus(a + dt_bias)`,
/// `beta = sigmoid(b)`. x, out: [T, C]; conv_w: [C, K]; a, b, g, beta: [T, Hv]; a_log, dt_bias: [Hv].
/// `x` must not alias `out`.
#[allow(clippy::too_many_arguments)]
pub fn conv_qk<X, W, CS, A, B, AL, DB, O, G, BE>(
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
    out: &mut O,
    g: &mut G,
    beta: &mut BE,
) -> Result<()>
where
    X: DevicePtr<f32>,
    W: DevicePtr<f32>,
    CS: DevicePtrMut<f32>,
    A: DevicePtr<f32>,
    B: DevicePtr<f32>,
    AL: DevicePtr<f32>,
    DB: DevicePtr<f32>,
    O: DevicePtrMut<f32>,
    G: DevicePtrMut<f32>,
    BE: DevicePtrMut<f32>,
{
    let ins = ConvInputs { x_stride: dims.conv_dim(), ab_stride: dims.num_v_heads, kernel: ConvKernel::Auto };
    conv_qk_with(dev, dims, t_len, x, conv_w, conv_state, a, b, a_log, dt_bias, out, g, beta, ins)
}

/// Which kernel of a prompt chunk's conv [`conv_qk_with`] runs (`Auto` is what [`conv_qk`] does; the
/// others for tests that hold every kernel to the CPU on one shape).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum ConvKernel {
    /// The per-warp kernel where the shape and the alignment allow it (T ≥ 16), else the tiled one
    /// (T ≥ 16), else the per-token one.
    Auto,
    /// The tiled kernel where T ≥ 16, else the per-token one.
    Tiled,
    /// The per-token kernel.
    PerToken,
}

/// Where [`conv_qk_with`] finds its inputs: x's rows `x_stride` floats apart and a's and b's
/// `ab_stride` apart (x, z, b and a can be column ranges of one fused projection's output rows, as
/// one GEMM over the concatenated weights writes them), and the kernel to run.
#[derive(Clone, Copy, Debug)]
pub struct ConvInputs {
    pub x_stride: usize,
    pub ab_stride: usize,
    pub kernel: ConvKernel,
}

/// [`conv_qk`] on strided inputs (see [`ConvInputs`]): x holds T rows of C floats `x_stride` apart
/// (≥ C), a and b T rows of Hv `ab_stride` apart (≥ Hv); out, g and beta stay contiguous.
#[allow(clippy::too_many_arguments)]
pub fn conv_qk_with<X, W, CS, A, B, AL, DB, O, G, BE>(
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
    out: &mut O,
    g: &mut G,
    beta: &mut BE,
    ins: ConvInputs,
) -> Result<()>
where
    X: DevicePtr<f32>,
    W: DevicePtr<f32>,
    CS: DevicePtrMut<f32>,
    A: DevicePtr<f32>,
    B: DevicePtr<f32>,
    AL: DevicePtr<f32>,
    DB: DevicePtr<f32>,
    O: DevicePtrMut<f32>,
    G: DevicePtrMut<f32>,
    BE: DevicePtrMut<f32>,
{
    check(dims, t_len)?;
    let (c, hv, k) = (dims.conv_dim(), dims.num_v_heads, dims.conv_kernel);
    if ins.x_stride < c || ins.ab_stride < hv || ins.x_stride.saturating_mul(t_len.max(1)) > i32::MAX as usize {
        return Err(CudaError::Shape(format!("gdn conv_qk: row strides {} (x, C = {c}) and {} (a, b, Hv = {hv})", ins.x_stride, ins.ab_stride)));
    }
    if t_len == 0 {
        return Ok(());
    }
    let src = conv_source(dev, dims, t_len, x, conv_w, conv_state, a, b, a_log, dt_bias, &ins, "gdn conv_qk")?;
    let p = GdnConvQkParams {
        out: addr_mut(dev, out, t_len * c, "gdn conv_qk out")?,
        g: addr_mut(dev, g, t_len * hv, "gdn conv_qk g")?,
        beta: addr_mut(dev, beta, t_len * hv, "gdn conv_qk beta")?,
        ..src.params(dims, t_len)
    };
    let width = dims.head_k_dim.max(dims.head_v_dim);
    let threads = (width.div_ceil(32) * 32).clamp(32, 256) as u32;
    let heads = 2 * dims.num_k_heads + hv;
    let tiled = t_len >= CONV_TILE && k <= MAX_CONV_TAPS && width <= 256 && ins.kernel != ConvKernel::PerToken;
    if tiled {
        // A prompt chunk: parallel over tokens, then the state and the gates. The per-warp kernel
        // moves x in 16-byte pieces: every head's first channel and every row 4-float aligned.
        let aligned = dims.head_k_dim.is_multiple_of(4) && dims.head_v_dim.is_multiple_of(4) && ins.x_stride.is_multiple_of(4) && p.x.is_multiple_of(16) && p.out.is_multiple_of(16) && p.conv_state.is_multiple_of(16);
        if ins.kernel == ConvKernel::Auto && width <= 128 && aligned {
            const WARPS: usize = 4;
            let warps = t_len.div_ceil(CONV_TILE) * heads;
            let name = if k <= 4 { "gdn_conv_qk_warp_k4" } else { "gdn_conv_qk_warp_k8" };
            let cfg = LaunchConfig { grid_dim: (warps.div_ceil(WARPS) as u32, 1, 1), block_dim: (32 * WARPS as u32, 1, 1), shared_mem_bytes: 0 };
            launch(dev, name, cfg, &p)?;
        } else {
            let cfg = LaunchConfig { grid_dim: (t_len.div_ceil(CONV_TILE) as u32, heads as u32, 1), block_dim: (threads, 1, 1), shared_mem_bytes: 0 };
            launch(dev, "gdn_conv_qk_tiled", cfg, &p)?;
        }
        let n = ((k - 1) * c).max(t_len * hv);
        let cfg = LaunchConfig { grid_dim: (n.div_ceil(256).min(dev.sm_count() as usize * 8) as u32, 1, 1), block_dim: (256, 1, 1), shared_mem_bytes: 0 };
        return launch(dev, "gdn_conv_finish", cfg, &p);
    }
    let cfg = LaunchConfig { grid_dim: (heads as u32, 1, 1), block_dim: (threads, 1, 1), shared_mem_bytes: 0 };
    launch(dev, "gdn_conv_qk", cfg, &p)
}

/// A conv's inputs as device addresses, each checked against the T rows it spans: the projections x
/// (T rows `x_stride` floats apart), the taps [C, K], the conv state [K-1, C], the gate inputs a and b
/// (T rows `ab_stride` apart) and the gates' parameters [Hv]. [`conv_qk_with`] and
/// `gdn_chunked::delta_rule_conv` (whose prep convolves its own inputs) read them.
#[derive(Clone, Copy, Debug)]
pub(crate) struct ConvSource {
    pub x: u64,
    pub conv_w: u64,
    pub conv_state: u64,
    pub a: u64,
    pub b: u64,
    pub a_log: u64,
    pub dt_bias: u64,
    pub x_stride: usize,
    pub ab_stride: usize,
}

impl ConvSource {
    /// `gdn_conv_*`'s parameters with these inputs (no outputs or gates: the caller adds those).
    fn params(&self, dims: &GdnDims, t_len: usize) -> GdnConvQkParams {
        GdnConvQkParams {
            x: self.x,
            conv_w: self.conv_w,
            conv_state: self.conv_state,
            a: self.a,
            b: self.b,
            a_log: self.a_log,
            dt_bias: self.dt_bias,
            t_len: t_len as i32,
            hk: dims.num_k_heads as i32,
            hv: dims.num_v_heads as i32,
            dk: dims.head_k_dim as i32,
            dv: dims.head_v_dim as i32,
            k: dims.conv_kernel as i32,
            x_stride: self.x_stride as i64,
            ab_stride: self.ab_stride as i64,
            ..Default::default()
        }
    }
}

/// The addresses of a conv's inputs for T ≥ 1 tokens (`what` names the caller in errors); the strides
/// are the caller's to have checked.
#[allow(clippy::too_many_arguments)]
pub(crate) fn conv_source<X, W, CS, A, B, AL, DB>(
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
    ins: &ConvInputs,
    what: &str,
) -> Result<ConvSource>
where
    X: DevicePtr<f32>,
    W: DevicePtr<f32>,
    CS: DevicePtrMut<f32>,
    A: DevicePtr<f32>,
    B: DevicePtr<f32>,
    AL: DevicePtr<f32>,
    DB: DevicePtr<f32>,
{
    let (c, hv) = (dims.conv_dim(), dims.num_v_heads);
    // Elements a strided operand of T rows spans.
    let span = |stride: usize, width: usize| (t_len - 1) * stride + width;
    Ok(ConvSource {
        x: addr(dev, x, span(ins.x_stride, c), &format!("{what} x"))?,
        conv_w: addr(dev, conv_w, c * dims.conv_kernel, &format!("{what} conv_w"))?,
        conv_state: addr_mut(dev, conv_state, dims.conv_state_len(), &format!("{what} conv_state"))?,
        a: addr(dev, a, span(ins.ab_stride, hv), &format!("{what} a"))?,
        b: addr(dev, b, span(ins.ab_stride, hv), &format!("{what} b"))?,
        a_log: addr(dev, a_log, hv, &format!("{what} a_log"))?,
        dt_bias: addr(dev, dt_bias, hv, &format!("{what} dt_bias"))?,
        x_stride: ins.x_stride,
        ab_stride: ins.ab_stride,
    })
}

/// The conv state's advance alone (`gdn_conv_finish` without the gates): conv_state [K-1, C] ← x's
/// last K − 1 rows (T ≥ K − 1), after a kernel that read the old state (the prep of
/// `gdn_chunked::delta_rule_conv`).
pub(crate) fn conv_state_advance(dev: &Device, dims: &GdnDims, t_len: usize, src: &ConvSource) -> Result<()> {
    let (c, k) = (dims.conv_dim(), dims.conv_kernel);
    if t_len + 1 < k || src.x_stride < c {
        return Err(CudaError::Shape(format!("gdn conv state: {t_len} tokens for {k} taps, x's stride {} for C = {c}", src.x_stride)));
    }
    let p = GdnConvQkParams { a: 0, b: 0, a_log: 0, dt_bias: 0, ..src.params(dims, t_len) };
    let n = ((k - 1) * c).max(1);
    let cfg = LaunchConfig { grid_dim: (n.div_ceil(256).min(dev.sm_count() as usize * 8) as u32, 1, 1), block_dim: (256, 1, 1), shared_mem_bytes: 0 };
    launch(dev, "gdn_conv_finish", cfg, &p)
}

/// The gated delta rule on T tokens, in order, from `state` [Hv, Dk, Dv] (updated in place):
/// per value head j and token t, S ← exp(g)·S; kv = Sᵀk; δ = β(v − kv); S ← S + k⊗δ; o = Sᵀq.
/// qkv: [T, C] (after [`conv_qk`]); g, beta: [T, Hv]; out: [T, Hv, Dv] (must not alias qkv).
#[allow(clippy::too_many_arguments)]
pub fn delta_rule_recurrent<Q, G, BE, S, O>(
    dev: &Device,
    dims: &GdnDims,
    t_len: usize,
    qkv: &Q,
    g: &G,
    beta: &BE,
    state: &mut S,
    out: &mut O,
) -> Result<()>
where
    Q: DevicePtr<f32>,
    G: DevicePtr<f32>,
    BE: DevicePtr<f32>,
    S: DevicePtrMut<f32>,
    O: DevicePtrMut<f32>,
{
    delta_rule_recurrent_with(dev, dims, t_len, qkv, g, beta, state, out, RECURRENT_WARPS)
}

/// [`delta_rule_recurrent`] with a chosen number of warps per block (1..=8; 8 state columns each).
#[allow(clippy::too_many_arguments)]
pub fn delta_rule_recurrent_with<Q, G, BE, S, O>(
    dev: &Device,
    dims: &GdnDims,
    t_len: usize,
    qkv: &Q,
    g: &G,
    beta: &BE,
    state: &mut S,
    out: &mut O,
    warps: u32,
) -> Result<()>
where
    Q: DevicePtr<f32>,
    G: DevicePtr<f32>,
    BE: DevicePtr<f32>,
    S: DevicePtrMut<f32>,
    O: DevicePtrMut<f32>,
{
    check(dims, t_len)?;
    if !(1..=8).contains(&warps) {
        return Err(CudaError::Shape(format!("gdn recurrent: {warps} warps per block (1..=8)")));
    }
    if t_len == 0 {
        return Ok(());
    }
    let (hv, dv) = (dims.num_v_heads, dims.head_v_dim);
    let p = GdnRecurrentParams {
        qkv: addr(dev, qkv, t_len * dims.conv_dim(), "gdn recurrent qkv")?,
        g: addr(dev, g, t_len * hv, "gdn recurrent g")?,
        beta: addr(dev, beta, t_len * hv, "gdn recurrent beta")?,
        state: addr_mut(dev, state, dims.state_len(), "gdn recurrent state")?,
        out: addr_mut(dev, out, t_len * dims.value_dim(), "gdn recurrent out")?,
        t_len: t_len as i32,
        hk: dims.num_k_heads as i32,
        hv: hv as i32,
        dk: dims.head_k_dim as i32,
        dv: dv as i32,
        pad: 0,
    };
    let &(_, name) = RECURRENT.iter().find(|(nr, _)| 4 * nr >= dims.head_k_dim).expect("Dk ≤ MAX_DK checked");
    let cols = 8 * warps as usize;
    let cfg = LaunchConfig {
        grid_dim: (dv.div_ceil(cols) as u32, hv as u32, 1),
        block_dim: (32 * warps, 1, 1),
        shared_mem_bytes: 0,
    };
    launch(dev, name, cfg, &p)
}

/// Gated RMSNorm per (token, value head) row of Dv: y = w ⊙ x·rsqrt(mean(x²) + eps) ⊙ silu(z), with a
/// plain weight w [Dv]. x (the rule's output), z, y: [T, Hv·Dv]; y may alias x.
#[allow(clippy::too_many_arguments)]
pub fn gated_rmsnorm<X, Z, W, Y>(
    dev: &Device,
    dims: &GdnDims,
    t_len: usize,
    x: &X,
    z: &Z,
    w: &W,
    eps: f32,
    y: &mut Y,
) -> Result<()>
where
    X: DevicePtr<f32>,
    Z: DevicePtr<f32>,
    W: DevicePtr<f32>,
    Y: DevicePtrMut<f32>,
{
    gated_rmsnorm_with(dev, dims, t_len, x, z, dims.value_dim(), w, eps, y)
}

/// [`gated_rmsnorm`] with z's token rows `z_stride` floats apart (≥ Hv·Dv: z a column range of a
/// fused projection's output).
#[allow(clippy::too_many_arguments)]
pub fn gated_rmsnorm_with<X, Z, W, Y>(
    dev: &Device,
    dims: &GdnDims,
    t_len: usize,
    x: &X,
    z: &Z,
    z_stride: usize,
    w: &W,
    eps: f32,
    y: &mut Y,
) -> Result<()>
where
    X: DevicePtr<f32>,
    Z: DevicePtr<f32>,
    W: DevicePtr<f32>,
    Y: DevicePtrMut<f32>,
{
    let (hv, dv, vd) = (dims.num_v_heads, dims.head_v_dim, dims.value_dim());
    let rows = t_len * hv;
    if dv == 0 || hv == 0 || rows * dv > i32::MAX as usize || z_stride < vd || z_stride.saturating_mul(t_len) > i32::MAX as usize {
        return Err(CudaError::Shape(format!("gdn gated_rmsnorm: {rows} rows of {dv}, z rows {z_stride} apart")));
    }
    if rows == 0 {
        return Ok(());
    }
    let p = GdnGatedNormParams {
        x: addr(dev, x, rows * dv, "gdn gated_rmsnorm x")?,
        z: addr(dev, z, (t_len - 1) * z_stride + vd, "gdn gated_rmsnorm z")?,
        w: addr(dev, w, dv, "gdn gated_rmsnorm w")?,
        y: addr_mut(dev, y, rows * dv, "gdn gated_rmsnorm y")?,
        rows: rows as i32,
        dv: dv as i32,
        eps,
        hv: hv as i32,
        z_stride: z_stride as i64,
    };
    let warps = 4usize;
    let cfg = LaunchConfig {
        grid_dim: (rows.div_ceil(warps) as u32, 1, 1),
        block_dim: (32 * warps as u32, 1, 1),
        shared_mem_bytes: 0,
    };
    launch(dev, "gdn_gated_norm", cfg, &p)
}

/// Must match `struct GdnGatedNormStageParams` in `kernels/gdn.cu`.
#[repr(C)]
#[derive(Clone, Copy, Debug, Default)]
struct GdnGatedNormStageParams {
    n: GdnGatedNormParams,
    plane: u64,
    scales: u64,
}
// SAFETY: plain old data with the kernel's layout.
unsafe impl DeviceRepr for GdnGatedNormStageParams {}

/// Whether [`gated_rmsnorm_staged`] takes these dims: Hv·Dv a multiple of 64 whose f32 outputs of a
/// token fit 48 KiB of shared memory.
pub fn gated_norm_stage_fits(dims: &GdnDims) -> bool {
    let vd = dims.value_dim();
    vd > 0 && vd.is_multiple_of(64) && 4 * vd <= 48 * 1024
}

/// [`gated_rmsnorm_with`] for `t_len` tokens written only as a GEMM's staged x (`st`, from
/// `gemm_wgmma::prestage_half` for the output projection: [t_len, Hv·Dv] in the half numerics, the
/// same bits as the GEMM staging [`gated_rmsnorm_with`]'s output). Needs [`gated_norm_stage_fits`].
#[allow(clippy::too_many_arguments)]
pub fn gated_rmsnorm_staged<X, Z, W>(dev: &Device, dims: &GdnDims, t_len: usize, x: &X, z: &Z, z_stride: usize, w: &W, eps: f32, st: &super::gemm_wgmma::HalfStage) -> Result<()>
where
    X: DevicePtr<f32>,
    Z: DevicePtr<f32>,
    W: DevicePtr<f32>,
{
    let (hv, dv, vd) = (dims.num_v_heads, dims.head_v_dim, dims.value_dim());
    let rows = t_len * hv;
    if !gated_norm_stage_fits(dims) || st.rows != t_len || st.cols != vd || t_len == 0 || t_len > u32::MAX as usize / 2 {
        return Err(CudaError::Shape(format!("gdn gated_rmsnorm_staged: {t_len} tokens of {hv}×{dv} into a staging of {} × {}", st.rows, st.cols)));
    }
    if rows * dv > i32::MAX as usize || z_stride < vd || z_stride.saturating_mul(t_len) > i32::MAX as usize {
        return Err(CudaError::Shape(format!("gdn gated_rmsnorm_staged: {rows} rows of {dv}, z rows {z_stride} apart")));
    }
    let p = GdnGatedNormStageParams {
        n: GdnGatedNormParams {
            x: addr(dev, x, rows * dv, "gdn gated_rmsnorm_staged x")?,
            z: addr(dev, z, (t_len - 1) * z_stride + vd, "gdn gated_rmsnorm_staged z")?,
            w: addr(dev, w, dv, "gdn gated_rmsnorm_staged w")?,
            y: 0,
            rows: rows as i32,
            dv: dv as i32,
            eps,
            hv: hv as i32,
            z_stride: z_stride as i64,
        },
        plane: st.plane,
        scales: st.scales,
    };
    // 8 warps a token; Dv 128 and Hv 32 (the 35B model) with a warp's 4 heads' loads at once.
    let name = if dv == 128 && hv == 32 { "gdn_gated_norm_stage_d128_h4" } else { "gdn_gated_norm_stage" };
    let cfg = LaunchConfig { grid_dim: (t_len as u32, 1, 1), block_dim: (256, 1, 1), shared_mem_bytes: 4 * vd as u32 };
    launch(dev, name, cfg, &p)
}

/// Whether [`decode_step`] takes these dims: Dv a multiple of 8 up to 128 (one block of Dv/8 warps per
/// value head), at most 8 value heads per key head (one thread-block cluster), the checks of the
/// other kernels.
pub fn step_fits(dims: &GdnDims) -> bool {
    let (hk, hv, dv) = (dims.num_k_heads, dims.num_v_heads, dims.head_v_dim);
    check(dims, 1).is_ok() && dv % 8 == 0 && dv <= 128 && hk > 0 && hv % hk == 0 && hv / hk <= 8
}

/// One decode token through the whole recurrent part of a GDN layer in one launch: [`conv_qk`]
/// (x: the token's [C] projections; the conv state shifted in place), [`delta_rule_recurrent`] (state
/// [Hv, Dk, Dv] in place) and [`gated_rmsnorm`] with z [Hv·Dv] and the weight w [Dv] into y [Hv·Dv].
/// The same maths in the same order as the three; g and beta are not written out. Needs
/// [`step_fits`]; launched as clusters of the Hv/Hk value heads of a key head, each head over up to
/// 8 / (Hv/Hk) blocks. `loads`: how it issues its loads and stores ([`StepLoads`]; the batched
/// forms take blocks of up to 256 threads and 48 KiB of shared memory, larger ones the first form).
#[allow(clippy::too_many_arguments)]
pub fn decode_step<X, W, CS, A, B, AL, DB, S, Z, NW, Y>(
    dev: &Device,
    dims: &GdnDims,
    x: &X,
    conv_w: &W,
    conv_state: &mut CS,
    a: &A,
    b: &B,
    a_log: &AL,
    dt_bias: &DB,
    state: &mut S,
    z: &Z,
    norm_w: &NW,
    eps: f32,
    y: &mut Y,
    loads: StepLoads,
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
    Z: DevicePtr<f32>,
    NW: DevicePtr<f32>,
    Y: DevicePtrMut<f32>,
{
    if !step_fits(dims) {
        return Err(CudaError::Shape(format!("gdn step: unsupported dims {dims:?} (Dv a multiple of 8 up to 128, Hv/Hk ≤ 8)")));
    }
    let (c, hv, k, vd) = (dims.conv_dim(), dims.num_v_heads, dims.conv_kernel, dims.value_dim());
    let slices = step_slices(dims);
    let p = GdnStepParams {
        x: addr(dev, x, c, "gdn step x")?,
        conv_w: addr(dev, conv_w, c * k, "gdn step conv_w")?,
        conv_state: addr_mut(dev, conv_state, dims.conv_state_len(), "gdn step conv_state")?,
        a: addr(dev, a, hv, "gdn step a")?,
        b: addr(dev, b, hv, "gdn step b")?,
        a_log: addr(dev, a_log, hv, "gdn step a_log")?,
        dt_bias: addr(dev, dt_bias, hv, "gdn step dt_bias")?,
        state: addr_mut(dev, state, dims.state_len(), "gdn step state")?,
        z: addr(dev, z, vd, "gdn step z")?,
        norm_w: addr(dev, norm_w, dims.head_v_dim, "gdn step norm_w")?,
        y: addr_mut(dev, y, vd, "gdn step y")?,
        hk: dims.num_k_heads as i32,
        hv: hv as i32,
        dk: dims.head_k_dim as i32,
        dv: dims.head_v_dim as i32,
        k: k as i32,
        eps,
        slices: slices as i32,
        pad: 0,
    };
    let cols = dims.head_v_dim / slices;
    let (table, smem) = match loads {
        StepLoads::Batched if batched_takes(dims, cols) => (STEP_BATCHED, batched_smem(dims, cols)),
        StepLoads::BatchedNarrow if batched_takes(dims, cols) => (STEP_BATCHED_NARROW, batched_smem(dims, cols)),
        _ => (STEP, 4 * (2 * dims.head_k_dim + cols)),
    };
    let &(_, name) = table.iter().find(|(nr, _)| 4 * nr >= dims.head_k_dim).expect("Dk ≤ MAX_DK checked");
    let smem = smem as u32;
    let cfg = LaunchConfig { grid_dim: (hv as u32 * slices as u32, 1, 1), block_dim: (4 * cols as u32, 1, 1), shared_mem_bytes: smem };
    super::launch_cluster(dev, name, cfg, ((hv / dims.num_k_heads) * slices) as u32, &p)
}

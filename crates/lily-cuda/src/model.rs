//! The whole model on one GPU: [`CudaModel`] implements `lily_model::Backend` with the same forward
//! pass as `lily_cpu::model` (`qwen36-architecture.md` §2), every op on the device:
//!
//! ```text
//! x = embed(ids)                                          [T, H]
//! for each layer l:
//!     h = RMSNorm(x (+= previous MLP output), input_norm)  (fused residual add)
//!     m = GDN_l(h) | GatedAttention_l(h)                   [T, H]
//!     h = RMSNorm(x += m, post_norm)
//!     y = MoE_l(h)  (router → top-k → experts → weighted sum + sigmoid-gated shared expert)
//! logits = RMSNorm(x += y, final_norm) · lm_headᵀ         [T, V] (or the last row only)
//! ```
//!
//! One token (decode) runs GEMVs (the experts as indexed GEMVs over the router's device-side choice)
//! with the norms and residual adds fused into them: each RMSNorm is computed by the GEMVs that
//! read it, as they stage x; the mixer's output projection and the MoE's down projection (which also
//! does the weighted sum and the shared gate) add into x; the router selects its top-k itself;
//! more (prefill) run tensor-core GEMMs, and the MoE dispatches the T·k (token, expert) slots on the
//! device (histogram, scan, scatter) into grouped GEMMs. Nothing in a forward call waits for the
//! device until the logits (or, with [`Backend::forward_pick`], the chosen token id) are read back.
//!
//! Memory: weights are uploaded once; [`Activations`] holds every scratch buffer, allocated once at
//! load for chunks of up to `max_chunk` tokens (longer calls are split); a [`CudaState`] holds the
//! GDN conv and recurrent states and the bf16 KV caches (K position-major, V in transposed tiles of
//! 32 positions; see `ops::attn_prep`). The engine sizes a session's caches once per
//! request, before its prefill, for the prompt plus the most tokens it may generate
//! ([`Backend::reserve`]), so a decode step allocates nothing; without a reserve they grow in steps
//! of [`KV_STEP`] positions as tokens arrive. A clone (a prefix-cache snapshot) keeps only the
//! positions held, rounded up to a step.

use std::path::PathBuf;
use std::sync::Arc;
use std::time::Instant;

use cudarc::driver::{CudaSlice, DevicePtr, DevicePtrMut};
use half::bf16;
use lily_model::weights::{DenseMlpWeights, Mixer, Mlp};
use lily_model::{Backend, BackendError, DevicePick, GdnDims, LayerKind, Logits, MaskFill, ModelConfig, ModelWeights};

use crate::ops::affine_gemv::{self, Select};
use crate::ops::{attention, attn_prefill, attn_prep, embed, gdn, gdn_chunked, gdn_in_step, gemm, gemm_wgmma, moe_decode, moe_dispatch, moe_route, rmsnorm, sample, Scalar};
use crate::weights::{DeviceMatrix, Uploader};
use crate::{CudaError, Device, Result};

mod ledger;
pub use ledger::{DecodeLedger, KnockOuts, PrefillLedger};

/// KV caches are sized in multiples of this many positions (whole tiles of the V cache).
pub const KV_STEP: usize = 4096;
const _: () = assert!(KV_STEP.is_multiple_of(attn_prep::V_TILE));
/// GDN chunks of at least this many tokens use the chunked delta rule; shorter ones step.
const GDN_CHUNKED_MIN_TOKENS: usize = 64;
/// Chunks of at most this many tokens (a grammar's forced run, a tiny turn) run as that many decode
/// steps (the replayed graph, ~2.3 ms each at 4K on the H200) instead of the prompt kernels, whose
/// eager launches cost more at a handful of tokens (structured decoding with forced runs measured
/// 59% of free decoding before this; docs/PERF.md 2026-12-02).
const STEP_TOKENS: usize = 4;
/// Rows of logits computed per GEMM when every position's logits are asked for.
const LOGIT_ROWS: usize = 128;

/// Tokens one prefill pass runs at once unless told otherwise (`lily_engine::DEFAULT_MAX_CHUNK` names
/// the same value for the CLI).
pub const DEFAULT_MAX_CHUNK: usize = 8192;

/// How to open the model on the GPU.
#[derive(Clone, Debug)]
pub struct CudaOptions {
    pub ordinal: usize,
    /// Load `<dir>/<stem>.sm_90a.cubin` in place of the embedded kernels where present.
    pub kernel_dir: Option<PathBuf>,
    /// The most tokens one forward pass runs at once (longer calls are split).
    pub max_chunk: usize,
}

impl Default for CudaOptions {
    fn default() -> Self {
        CudaOptions { ordinal: 0, kernel_dir: None, max_chunk: DEFAULT_MAX_CHUNK }
    }
}

/// What loading cost, for the start-up report.
#[derive(Clone, Debug)]
pub struct LoadReport {
    pub device: String,
    pub weight_bytes: usize,
    /// Scratch of a forward pass of `max_chunk` tokens, the wgmma GEMMs' staged x included.
    pub activation_bytes: usize,
    pub upload_seconds: f64,
    /// Bytes of one session's state per token of context (KV caches), and its fixed part (GDN states).
    pub state_bytes_per_token: usize,
    pub state_bytes_fixed: usize,
}

struct Swiglu {
    gate: DeviceMatrix, // [I, H]
    up: DeviceMatrix,   // [I, H]
    down: DeviceMatrix, // [H, I]
}

struct GdnLayer {
    qkv: DeviceMatrix, // [C, H], C = 2·Hk·Dk + Hv·Dv
    z: DeviceMatrix,   // [Hv·Dv, H]
    b: DeviceMatrix,   // [Hv, H]
    a: DeviceMatrix,   // [Hv, H]
    conv_w: CudaSlice<f32>,  // [C, K]
    a_log: CudaSlice<f32>,   // [Hv]
    dt_bias: CudaSlice<f32>, // [Hv]
    norm: CudaSlice<f32>,    // [Dv]
    out: DeviceMatrix,       // [H, Hv·Dv]
    /// Decode: the four input projections as one matrix [C + Hv·Dv + 2·Hv, H] = [qkv | z | b | a]
    /// (one GEMV instead of four), when they share a storage format.
    in_fused: Option<DeviceMatrix>,
}

struct AttnLayer {
    q: DeviceMatrix, // [nh·hd·(1+gate), H]
    k: DeviceMatrix, // [kvh·hd, H]
    v: DeviceMatrix, // [kvh·hd, H]
    o: DeviceMatrix, // [H, nh·hd]
    q_norm: CudaSlice<f32>, // [hd]
    k_norm: CudaSlice<f32>, // [hd]
    /// Decode: [q | k | v] as one matrix, when they share a storage format.
    qkv_fused: Option<DeviceMatrix>,
}

#[allow(clippy::large_enum_variant)] // one a layer, built once at load: the size difference costs nothing
enum DevMixer {
    Gdn(GdnLayer),
    Attn(AttnLayer),
}

#[allow(clippy::large_enum_variant)] // one a layer, built once at load: the size difference costs nothing
enum DevMlp {
    Moe {
        router: DeviceMatrix, // [E, H]
        /// Decode: the router with the shared expert's gate as row E ([E + 1, H]), when they share a format.
        router_plus: Option<DeviceMatrix>,
        experts: Swiglu, // E (or E + 1, see Shared::InStack) × ...
        shared: Shared,
    },
    Dense(Swiglu),
}

/// Where the shared expert lives.
#[allow(clippy::large_enum_variant)] // one a layer, built once at load: the size difference costs nothing
enum Shared {
    None,
    /// Its own matrices, and its gate [1, H].
    Separate { mlp: Swiglu, gate: DeviceMatrix },
    /// Matrix E of the expert stacks (same shape and format as the experts), so one decode token runs
    /// the k routed experts and the shared one as k + 1 slots of one indexed GEMV; its gate [1, H].
    InStack { gate: DeviceMatrix },
}

struct DevLayer {
    input_norm: CudaSlice<f32>,
    post_norm: CudaSlice<f32>,
    mixer: DevMixer,
    mlp: DevMlp,
}

/// Every scratch buffer of a forward pass, sized for `max_chunk` tokens (T below).
struct Activations {
    ids: CudaSlice<u32>,    // [T]
    step_pos: CudaSlice<i32>, // decode: [pos, pos + 1] (read by the captured graph)
    x: CudaSlice<f32>,      // [T, H] residual stream
    normed: CudaSlice<f32>, // [T, H]
    /// A prompt chunk's a.normed was written only as the next GEMM's staged x (by the MoE combine,
    /// `gemm_wgmma::prestage_half`): its first GEMM takes it with `x_staged_only` ([`normed_opts`]).
    normed_staged: bool,
    mix: CudaSlice<f32>,    // [T, H] mixer output
    mlp: CudaSlice<f32>,    // [T, H] MLP output
    // Gated DeltaNet
    in_proj: CudaSlice<f32>, // [T, C + Hv·Dv + 2·Hv]: qkv, z, b, a (see gdn_mixer for the layout)
    qkv: CudaSlice<f32>,     // [T, C] after the conv
    g: CudaSlice<f32>,       // [T, Hv]
    beta: CudaSlice<f32>,    // [T, Hv]
    rule: CudaSlice<f32>,    // [T, Hv·Dv]
    normed_rule: CudaSlice<f32>, // [T, Hv·Dv]
    proj1: CudaSlice<f32>,       // attention decode: [nh·hd·(1+gate) + 2·kvh·hd]
    gdn_scratch: CudaSlice<f32>, // the chunked rule's per-chunk matrices
    // Attention
    qg: CudaSlice<f32>,     // [T, nh·hd·(1+gate)]
    k: CudaSlice<f32>,      // [T, kvh·hd]
    v: CudaSlice<f32>,      // [T, kvh·hd]
    q: CudaSlice<f32>,      // [T, nh, hd]
    gate: CudaSlice<f32>,   // [T, nh, hd]
    att: CudaSlice<f32>,    // [T, nh, hd]
    att_scratch: CudaSlice<f32>,
    // MoE
    router: CudaSlice<f32>,  // [T, E] or [T, E + 1] (the shared expert's gate logit last)
    idx: CudaSlice<u32>,     // [T, k]
    idx1: CudaSlice<u32>,    // decode: [k + 1], the router's k then E (the shared expert in the stack)
    route_w: CudaSlice<f32>, // [T, k]
    counts: CudaSlice<u32>,  // the dispatch plan's scratch
    offsets: CudaSlice<u32>, // [E + 1]
    rows: CudaSlice<u32>,    // [T·k]
    slot_of: CudaSlice<u32>, // [T·k]
    act: CudaSlice<f32>,     // [T·k, I] (or [T, I] for a dense MLP)
    expert_out: CudaSlice<f32>, // [T·k, H]
    shared_act: CudaSlice<f32>, // [T, Is]
    shared_out: CudaSlice<f32>, // [T, H]
    shared_gate: CudaSlice<f32>, // [T]
    // Output
    logits: CudaSlice<f32>, // [LOGIT_ROWS, V]
    pick_scratch: CudaSlice<f32>,
    pick_edits: sample::EditBuffer,
    pick_out: CudaSlice<u32>, // [1]
    route_counter: CudaSlice<u32>, // [1] the fused router's finished blocks (0 between launches)
    moe_barrier: CudaSlice<u64>,   // [1] the fused MoE decode's grid barrier (grows by its grid each launch)
    pick_mask: CudaSlice<u32>,     // [V/32] constrained decoding: the allowed tokens of this pick
    pick_mask_host: Vec<u32>,      // where the host writes it
}

/// What [`CudaModel::counts`] reports.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct Counts {
    /// KV cache allocations: one per attention layer for a new state and for each growth (a clone's
    /// copies are not counted).
    pub kv_allocations: u64,
    /// Captures of the decode-step graph (one per new set of state buffers).
    pub graph_captures: u64,
}

/// One session on the GPU.
pub struct CudaState {
    pos: usize,
    layers: Vec<DevLayerState>,
    dev: Arc<Device>,
    /// The KV cache's shape: KV heads and head dim.
    kv: KvShape,
}

/// KV heads and head dim of a model's caches.
#[derive(Clone, Copy, Debug)]
struct KvShape {
    heads: usize,
    hd: usize,
}

impl KvShape {
    /// Values of a position's row of the K cache (all KV heads).
    fn row(self) -> usize {
        self.heads * self.hd
    }
}

impl Clone for CudaState {
    /// A copy of what the state holds: each KV cache cut to the positions held, rounded up to
    /// [`KV_STEP`], so a snapshot of a session reserved for a long context stays small (a resumed
    /// copy grows again at its request's reserve, before any decode step).
    fn clone(&self) -> Self {
        let keep = self.pos.div_ceil(KV_STEP).max(1) * KV_STEP;
        let layers = self
            .layers
            .iter()
            .map(|l| match l {
                DevLayerState::Attn { k, v, cap } if keep < *cap => {
                    // Allocation failure here means the GPU is out of memory: there is no way on.
                    let (k, v) = resize_kv(&self.dev, k, v, *cap, keep, self.pos, self.kv).expect("copying a state on the GPU");
                    DevLayerState::Attn { k, v, cap: keep }
                }
                other => other.clone(),
            })
            .collect();
        CudaState { pos: self.pos, layers, dev: Arc::clone(&self.dev), kv: self.kv }
    }
}

#[derive(Clone)]
enum DevLayerState {
    /// conv: [K-1, C]; ssm: [Hv, Dk, Dv].
    Gdn { conv: CudaSlice<f32>, ssm: CudaSlice<f32> },
    /// bf16 caches, k: [cap, kvh, hd], v: [kvh, cap / V_TILE, hd, V_TILE] (tiles of `attn_prep::V_TILE`
    /// positions, `attn_prep::v_index`); positions 0..pos are valid.
    Attn { k: CudaSlice<bf16>, v: CudaSlice<bf16>, cap: usize },
}

/// Caches of capacity `cap` holding `pos` positions, copied into new zeroed ones of capacity `to`.
/// Both capacities are multiples of `attn_prep::V_TILE`: V moves as whole tiles, a KV head at a time.
fn resize_kv(dev: &Device, k: &CudaSlice<bf16>, v: &CudaSlice<bf16>, cap: usize, to: usize, pos: usize, kv: KvShape) -> Result<(CudaSlice<bf16>, CudaSlice<bf16>)> {
    let row = kv.row();
    let mut nk = dev.zeros::<bf16>(to * row)?;
    let mut nv = dev.zeros::<bf16>(to * row)?;
    let keep = pos.min(to).min(cap);
    if keep > 0 {
        dev.stream().memcpy_dtod(&k.slice(0..keep * row), &mut nk.slice_mut(0..keep * row))?;
        attn_prep::copy_rows(dev, v, cap * kv.hd, &mut nv, to * kv.hd, kv.heads, attn_prep::v_tiles_len(keep, kv.hd))?;
    }
    Ok((nk, nv))
}

/// The model on one GPU.
pub struct CudaModel {
    dev: Arc<Device>,
    cfg: ModelConfig,
    embed: DeviceMatrix,
    /// None when tied to the embedding.
    lm_head: Option<DeviceMatrix>,
    final_norm: CudaSlice<f32>,
    layers: Vec<DevLayer>,
    act: Activations,
    max_chunk: usize,
    report: LoadReport,
    /// Decode steps replay one captured CUDA graph (off: every kernel is launched one by one).
    graphs: bool,
    /// The decode graph's kernels are captured with programmatic dependent launch (each may be placed
    /// while its predecessor finishes; `kernels/pdl.cuh`). `LILY_NO_PDL=1` turns it off at load.
    pdl: bool,
    /// Decode fusions left off (bits `UNFUSE_*`; `LILY_FUSE` turns them on).
    unfused: u32,
    /// The captured decode step and the state buffers it was captured against.
    decode_graph: Option<(Vec<u64>, StepGraph)>,
    /// KV cache allocations and decode-graph captures so far (tests check a decode step makes none).
    counts: std::cell::Cell<Counts>,
}

/// A captured decode step. The graph only names device buffers that live as long as the model (the
/// activations, the weights) or as the state whose buffer addresses key it; it is replayed on the one
/// stream of the model's device, from the thread that owns the model.
struct StepGraph(cudarc::driver::CudaGraph);
// SAFETY: a CUgraphExec may be launched from any thread as long as launches are not concurrent; the
// model (and so the graph) is used by one thread at a time (`&mut self`).
unsafe impl Send for StepGraph {}

fn dev_err(e: CudaError) -> BackendError {
    BackendError::Device(e.to_string())
}

impl CudaModel {
    /// Opens the GPU and uploads `w`. `progress(done, total)` is called with bytes uploaded.
    pub fn load(w: &ModelWeights, opts: &CudaOptions, progress: &mut dyn FnMut(u64, u64)) -> Result<Self> {
        let dev = Arc::new(Device::open_with_kernel_dir(opts.ordinal, opts.kernel_dir.as_deref())?);
        Self::load_on(dev, w, opts.max_chunk, progress)
    }

    /// Uploads `w` to an open device.
    pub fn load_on(dev: Arc<Device>, w: &ModelWeights, max_chunk: usize, progress: &mut dyn FnMut(u64, u64)) -> Result<Self> {
        let cfg = w.config.clone();
        let max_chunk = max_chunk.max(1);
        let d = GdnDims::from_config(&cfg);
        if cfg.layer_types.contains(&LayerKind::LinearAttention) && !d.is_valid() {
            return Err(CudaError::Shape(format!("GDN sizes {d:?} are not valid")));
        }
        let total: u64 = count_bytes(w);
        progress(0, total);
        let done = std::cell::Cell::new(0u64);
        let extra = std::cell::Cell::new(0u64);
        let progress = std::cell::RefCell::new(progress);
        let t0 = Instant::now();
        let mut up = Uploader::new(&dev)?;
        let count = |dm: &DeviceMatrix| {
            done.set(done.get() + dm.bytes_per_matrix() as u64 * dm.count as u64);
            (progress.borrow_mut())(done.get().min(total), total);
        };
        let mut mat = |m: &lily_model::weights::Matrix, up: &mut Uploader| -> Result<DeviceMatrix> {
            let dm = up.upload_matrix(m)?;
            count(&dm);
            Ok(dm)
        };
        // Decode-only fused copies (one GEMV where the layer would run several): counted apart.
        let fused = |parts: &[&lily_model::weights::Matrix], up: &mut Uploader| -> Result<Option<DeviceMatrix>> {
            if !Uploader::can_concat(parts, true) {
                return Ok(None);
            }
            let dm = up.upload_concat(parts, true)?;
            extra.set(extra.get() + dm.bytes_per_matrix() as u64);
            Ok(Some(dm))
        };
        let vec = |v: &[f32]| -> Result<CudaSlice<f32>> { dev.upload(if v.is_empty() { &[0.0f32][..] } else { v }) };
        let swiglu = |m: &DenseMlpWeights, up: &mut Uploader, mat: &mut dyn FnMut(&lily_model::weights::Matrix, &mut Uploader) -> Result<DeviceMatrix>| -> Result<Swiglu> {
            Ok(Swiglu { gate: mat(&m.gate_proj, up)?, up: mat(&m.up_proj, up)?, down: mat(&m.down_proj, up)? })
        };

        let embed = mat(&w.embed, &mut up)?;
        let mut layers = Vec::with_capacity(w.layers.len());
        for l in &w.layers {
            let mixer = match &l.mixer {
                Mixer::Linear(g) => DevMixer::Gdn(GdnLayer {
                    qkv: mat(&g.in_proj_qkv, &mut up)?,
                    z: mat(&g.in_proj_z, &mut up)?,
                    b: mat(&g.in_proj_b, &mut up)?,
                    a: mat(&g.in_proj_a, &mut up)?,
                    conv_w: vec(&g.conv1d)?,
                    a_log: vec(&g.a_log)?,
                    dt_bias: vec(&g.dt_bias)?,
                    norm: vec(&g.norm)?,
                    out: mat(&g.out_proj, &mut up)?,
                    in_fused: fused(&[&g.in_proj_qkv, &g.in_proj_z, &g.in_proj_b, &g.in_proj_a], &mut up)?,
                }),
                Mixer::Full(a) => DevMixer::Attn(AttnLayer {
                    q: mat(&a.q_proj, &mut up)?,
                    k: mat(&a.k_proj, &mut up)?,
                    v: mat(&a.v_proj, &mut up)?,
                    o: mat(&a.o_proj, &mut up)?,
                    q_norm: vec(&a.q_norm)?,
                    k_norm: vec(&a.k_norm)?,
                    qkv_fused: fused(&[&a.q_proj, &a.k_proj, &a.v_proj], &mut up)?,
                }),
            };
            let mlp = match &l.mlp {
                Mlp::Moe(m) => {
                    let router = mat(&m.router, &mut up)?;
                    let router_plus = match &m.shared_gate {
                        Some(g) => fused(&[&m.router, g], &mut up)?,
                        None => None,
                    };
                    let (experts, shared) = match (&m.shared, &m.shared_gate) {
                        (Some(s), Some(g)) => {
                            let stacks = [(&m.gate_proj, &s.gate_proj), (&m.up_proj, &s.up_proj), (&m.down_proj, &s.down_proj)];
                            if stacks.iter().all(|(e, s)| Uploader::can_concat(&[e, s], false)) {
                                let mut st = |e, s| -> Result<DeviceMatrix> {
                                    let dm = up.upload_concat(&[e, s], false)?;
                                    count(&dm);
                                    Ok(dm)
                                };
                                let ex = Swiglu {
                                    gate: st(&m.gate_proj, &s.gate_proj)?,
                                    up: st(&m.up_proj, &s.up_proj)?,
                                    down: st(&m.down_proj, &s.down_proj)?,
                                };
                                (ex, Shared::InStack { gate: mat(g, &mut up)? })
                            } else {
                                let ex = Swiglu { gate: mat(&m.gate_proj, &mut up)?, up: mat(&m.up_proj, &mut up)?, down: mat(&m.down_proj, &mut up)? };
                                (ex, Shared::Separate { mlp: swiglu(s, &mut up, &mut mat)?, gate: mat(g, &mut up)? })
                            }
                        }
                        (None, None) => (
                            Swiglu { gate: mat(&m.gate_proj, &mut up)?, up: mat(&m.up_proj, &mut up)?, down: mat(&m.down_proj, &mut up)? },
                            Shared::None,
                        ),
                        _ => return Err(CudaError::Shape("a shared expert needs both its MLP and its gate".into())),
                    };
                    DevMlp::Moe { router, router_plus, experts, shared }
                }
                Mlp::Dense(m) => DevMlp::Dense(swiglu(m, &mut up, &mut mat)?),
            };
            layers.push(DevLayer { input_norm: vec(&l.input_norm)?, post_norm: vec(&l.post_norm)?, mixer, mlp });
        }
        let lm_head = if cfg.tie_word_embeddings { None } else { Some(mat(w.lm_head(), &mut up)?) };
        let final_norm = vec(&w.final_norm)?;
        up.finish()?;
        dev.synchronize()?;
        let upload_seconds = t0.elapsed().as_secs_f64();

        let weight_bytes = (done.get() + extra.get()) as usize;
        let (act, mut activation_bytes) = Activations::new(&dev, &cfg, max_chunk)?;
        // The wgmma GEMMs' staged x for the widest input of a chunk: [T, H] (the input projections,
        // the experts' gate/up, lm_head when scoring), the output projections' inputs, and the routed
        // experts' down input [T·k, I].
        let t = max_chunk;
        let inputs = [
            (t, cfg.hidden_size),
            (t, cfg.linear_num_value_heads * cfg.linear_value_head_dim),
            (t, cfg.num_attention_heads * cfg.head_dim),
            (t, cfg.shared_expert_intermediate_size),
            (t, cfg.intermediate_size),
            (t * cfg.num_experts_per_tok.max(1), cfg.moe_intermediate_size),
        ];
        // Two buffers (gemm_wgmma::Stage): the half numerics' (one plane) and the folded numerics' (two).
        let stage = |planes| {
            inputs
                .iter()
                .filter(|(_, c)| *c > 0 && c.is_multiple_of(gemm_wgmma::GROUP))
                .map(|&(r, c)| gemm_wgmma::stage_bytes(r, c, planes))
                .max()
                .unwrap_or(0)
        };
        let (half, folded) = (stage(1), stage(2));
        if folded > 0 {
            activation_bytes += gemm_wgmma::reserve(&dev, half, folded)?;
        }
        let kv_per_token = cfg.layer_types.iter().filter(|k| **k == LayerKind::FullAttention).count()
            * 2
            * cfg.num_key_value_heads
            * cfg.head_dim
            * KV_BYTES as usize;
        let fixed = cfg.layer_types.iter().filter(|k| **k == LayerKind::LinearAttention).count() * (d.conv_state_len() + d.state_len()) * 4;
        let report = LoadReport {
            device: dev.info().name.clone(),
            weight_bytes,
            activation_bytes,
            upload_seconds,
            state_bytes_per_token: kv_per_token,
            state_bytes_fixed: fixed,
        };
        let graphs = std::env::var_os("LILY_NO_GRAPHS").is_none();
        let pdl = std::env::var_os("LILY_NO_PDL").is_none();
        let unfused = unfused_from_env();
        Ok(CudaModel { dev, cfg, embed, lm_head, final_norm, layers, act, max_chunk, report, graphs, pdl, unfused, decode_graph: None, counts: Default::default() })
    }

    pub fn report(&self) -> &LoadReport {
        &self.report
    }
    pub fn device(&self) -> &Arc<Device> {
        &self.dev
    }
    pub fn max_chunk(&self) -> usize {
        self.max_chunk
    }
    /// Decode steps as one replayed CUDA graph (the default; `LILY_NO_GRAPHS=1` turns it off at load)
    /// or launched kernel by kernel.
    pub fn set_graphs(&mut self, on: bool) {
        self.graphs = on;
        self.decode_graph = None;
    }
    /// Programmatic dependent launch inside the decode graph (the default; `LILY_NO_PDL=1` turns it
    /// off at load); a change recaptures.
    pub fn set_pdl(&mut self, on: bool) {
        self.pdl = on;
        self.decode_graph = None;
    }
    /// The fused MoE decode kernel (`ops::moe_decode`) where the shapes fit it (off by default;
    /// `LILY_MOE_DECODE=1` turns it on at load); a change recaptures.
    pub fn set_fused_moe(&mut self, on: bool) {
        self.unfused = if on { self.unfused & !UNFUSE_MOE } else { self.unfused | UNFUSE_MOE };
        self.decode_graph = None;
    }

    /// KV cache allocations (a session's first, and each growth) and decode-graph captures so far.
    pub fn counts(&self) -> Counts {
        self.counts.get()
    }
    fn count(&self, f: impl FnOnce(&mut Counts)) {
        let mut c = self.counts.get();
        f(&mut c);
        self.counts.set(c);
    }

    fn kv_shape(&self) -> KvShape {
        KvShape { heads: self.cfg.num_key_value_heads, hd: self.cfg.head_dim }
    }

    /// A fresh state; its KV caches start with room for `reserve` positions.
    pub fn new_state_with(&self, reserve: usize) -> Result<CudaState> {
        let d = GdnDims::from_config(&self.cfg);
        let kv = self.kv_shape();
        let kv_row = kv.row();
        let cap = reserve.div_ceil(KV_STEP).max(1) * KV_STEP;
        let mut layers = Vec::with_capacity(self.cfg.num_hidden_layers);
        for k in &self.cfg.layer_types {
            layers.push(match k {
                LayerKind::LinearAttention => DevLayerState::Gdn {
                    conv: self.dev.zeros(d.conv_state_len().max(1))?,
                    ssm: self.dev.zeros(d.state_len())?,
                },
                LayerKind::FullAttention => {
                    self.count(|c| c.kv_allocations += 1);
                    DevLayerState::Attn { k: self.dev.zeros(cap * kv_row)?, v: self.dev.zeros(cap * kv_row)?, cap }
                }
            });
        }
        Ok(CudaState { pos: 0, layers, dev: Arc::clone(&self.dev), kv })
    }

    /// Makes every KV cache of `s` hold at least `need` positions (copying what it holds).
    fn grow_kv(&self, s: &mut CudaState, need: usize) -> Result<()> {
        let kv = self.kv_shape();
        let pos = s.pos;
        for l in &mut s.layers {
            if let DevLayerState::Attn { k, v, cap } = l {
                if *cap >= need {
                    continue;
                }
                let new_cap = need.div_ceil(KV_STEP) * KV_STEP;
                self.count(|c| c.kv_allocations += 1);
                let (nk, nv) = resize_kv(&self.dev, k, v, *cap, new_cap, pos, kv)?;
                *k = nk;
                *v = nv;
                *cap = new_cap;
            }
        }
        Ok(())
    }

    fn check(&self, state: &CudaState, tokens: &[u32]) -> Result<(), BackendError> {
        if state.layers.len() != self.cfg.num_hidden_layers {
            return Err(BackendError::BadState(format!("{} layers, model has {}", state.layers.len(), self.cfg.num_hidden_layers)));
        }
        if let Some(&id) = tokens.iter().find(|&&id| id as usize >= self.cfg.vocab_size) {
            return Err(BackendError::InvalidToken { id, vocab: self.cfg.vocab_size });
        }
        Ok(())
    }

    /// Runs one chunk (≤ max_chunk tokens) through every layer and the final norm; the normed rows
    /// are left in `act.normed`. One token replays the captured decode graph (captured first when the
    /// state's buffers are not the ones it was captured against).
    fn run_chunk(&mut self, state: &mut CudaState, tokens: &[u32]) -> Result<()> {
        let t = tokens.len();
        debug_assert!(t >= 1 && t <= self.max_chunk);
        self.grow_kv(state, state.pos + t)?;
        self.dev.upload_into(tokens, &mut self.act.ids)?;
        if t == 1 && self.graphs {
            let pos = i32::try_from(state.pos).map_err(|_| CudaError::Shape("position beyond i32".into()))?;
            self.dev.upload_into(&[pos, pos + 1], &mut self.act.step_pos)?;
            let key = state_key(&self.dev, state);
            if self.decode_graph.as_ref().map(|g| &g.0) != Some(&key) {
                self.decode_graph = None;
                self.count(|c| c.graph_captures += 1);
                let graph = self.capture_step(state)?;
                self.decode_graph = Some((key, StepGraph(graph)));
            }
            self.decode_graph.as_ref().expect("captured above").1 .0.launch()?;
        } else {
            self.layers_pass(state, t, false)?;
        }
        state.pos += t;
        Ok(())
    }

    /// The decode step's kernels (one token at `act.step_pos`) captured as a graph, with programmatic
    /// dependent launch when the model uses it.
    fn capture_step(&mut self, state: &mut CudaState) -> Result<cudarc::driver::CudaGraph> {
        let stream = self.dev.stream().clone();
        stream.begin_capture(cudarc::driver::sys::CUstreamCaptureMode::CU_STREAM_CAPTURE_MODE_THREAD_LOCAL)?;
        self.dev.set_pdl(self.pdl);
        let recorded = self.layers_pass(state, 1, true);
        self.dev.set_pdl(false);
        let graph = stream.end_capture(cudarc::driver::sys::CUgraphInstantiate_flags(0));
        recorded?;
        graph?.ok_or_else(|| CudaError::Driver("capturing the decode step gave no graph".into()))
    }

    /// Every kernel of one chunk (ids already on the device): embedding, layers, final norm. With
    /// `device_pos` (one token), attention reads its position from `act.step_pos`, so the launches can
    /// be captured once and replayed at every position.
    fn layers_pass(&mut self, state: &mut CudaState, t: usize, device_pos: bool) -> Result<()> {
        let CudaModel { dev, cfg, embed: table, final_norm, layers, act: a, unfused, .. } = self;
        let dev: &Device = dev;
        let eps = cfg.rms_norm_eps;
        let pos0 = state.pos;
        let h = cfg.hidden_size as u64;
        let tt = t as u64;
        dev.set_layer(-1);
        dev.mark("embed", tt * (table.bytes_per_matrix() / table.rows) as u64 + 4 * tt * h, 0)?;
        embed::embed(dev, table, &a.ids.slice(0..t), &mut a.x)?; // x: [T, H]
        // One token (decode): no norm kernels. Each block's first GEMV normalises x itself as it
        // stages it (Fuse::rms_norm), and each block's last GEMV adds its output into x (the residual
        // stream) — so the decode step is x += mixer(RMSNorm(x)); x += moe(RMSNorm(x)), as below.
        let decode = t == 1;
        // A prompt chunk's MoE combine may do the residual add and the next norm itself (then a.normed
        // already holds the next layer's normed input, or the final norm's output).
        let mut normed_next = false;
        for (li, (l, ls)) in layers.iter().zip(state.layers.iter_mut()).enumerate() {
            dev.set_layer(li as i32);
            // h = RMSNorm(x += previous MLP output)
            let in_norm = if decode {
                Some(affine_gemv::Fuse::rms_norm(dev, &l.input_norm, eps))
            } else {
                if li == 0 {
                    dev.mark("norm", 8 * tt * h, 0)?;
                    rmsnorm::rms_norm(dev, &a.x, &l.input_norm, eps, t, &mut a.normed)?;
                } else if !normed_next {
                    dev.mark("norm", 16 * tt * h, 0)?;
                    rmsnorm::add_rms_norm(dev, &a.mlp, &mut a.x, &l.input_norm, eps, t, &mut a.normed, None)?;
                }
                None
            };
            normed_next = false;
            match (&l.mixer, ls) {
                (DevMixer::Gdn(g), DevLayerState::Gdn { conv, ssm }) => gdn_mixer(dev, cfg, g, a, t, in_norm, &l.input_norm, conv, ssm)?,
                (DevMixer::Attn(at), DevLayerState::Attn { k, v, cap }) => {
                    let at_pos = if device_pos { AtPos::Device { cap: *cap } } else { AtPos::Host(pos0) };
                    attn_mixer(dev, cfg, at, a, t, in_norm, at_pos, k, v, *cap)?
                }
                _ => return Err(CudaError::Shape(format!("layer {li}: state kind does not match the layer"))),
            }
            if decode {
                let post = affine_gemv::Fuse::rms_norm(dev, &l.post_norm, eps);
                match &l.mlp {
                    DevMlp::Moe { router, router_plus, experts, shared } => {
                        moe_decode(dev, cfg, &l.post_norm, post, router, router_plus.as_ref(), experts, shared, a, *unfused)?
                    }
                    DevMlp::Dense(m) => {
                        mark_swiglu(dev, "mlp.gate_up", &m.gate, 1, 1)?;
                        affine_gemv::swiglu_fused(dev, &m.gate, &m.up, Select::matrix(0), &a.x, false, &mut a.act, post)?;
                        mark_linear(dev, "mlp.down", &m.down, 1)?;
                        affine_gemv::gemv_fused(dev, &m.down, Select::matrix(0), &a.act, false, &mut a.x, affine_gemv::Fuse::none().accumulate())?;
                    }
                }
                continue;
            }
            // The post-mixer norm also writes its rows as the MoE's half-numerics GEMMs' staged x where they
            // take it, and the router's folded staging beside it where the router takes that.
            let post = post_norm_stage();
            let post_stage = t > 1
                && post != PostNormStage::Neither
                && rmsnorm::stage_fits(h as usize)
                && matches!(&l.mlp, DevMlp::Moe { experts, .. } if gemm::takes_prestaged_half(&experts.gate, prefill_opts()));
            let router_stage = post_stage
                && post == PostNormStage::HalfAndRouter
                && matches!(&l.mlp, DevMlp::Moe { router, router_plus, shared, .. }
                    if gemm::takes_prestaged_exact(router_matrix(router, router_plus.as_ref(), shared), prefill_opts()));
            dev.mark("norm", (16 + if router_stage { 6 } else if post_stage { 2 } else { 0 }) * tt * h, 0)?;
            let (half, exact) = match (post_stage, router_stage) {
                (true, true) => {
                    let (hs, es) = gemm_wgmma::prestage_half_exact(dev, &a.normed, t, h as usize)?;
                    (Some(hs), Some(es))
                }
                (true, false) => (Some(gemm_wgmma::prestage_half(dev, &a.normed, t, h as usize)?), None),
                _ => (None, None),
            };
            let staging = half.as_ref().map(|half| rmsnorm::Staging { half, exact: exact.as_ref() });
            rmsnorm::add_rms_norm(dev, &a.mix, &mut a.x, &l.post_norm, eps, t, &mut a.normed, staging)?;
            match &l.mlp {
                DevMlp::Moe { router, router_plus, experts, shared } => {
                    // The norm after this block: the next layer's input norm, or the final norm.
                    let next_norm = layers.get(li + 1).map_or(&*final_norm, |n| &n.input_norm);
                    let then_norm = moe_norm_fused().then_some((next_norm, eps));
                    // The combine writes the next layer's first GEMM's staged x itself where it can.
                    let stage = then_norm.is_some()
                        && t > 1
                        && moe_combine_stages()
                        && moe_dispatch::combine_stage_fits(h as usize)
                        && layers.get(li + 1).is_some_and(|n| takes_staged_normed(&n.mixer));
                    moe(dev, cfg, router, router_plus.as_ref(), experts, shared, a, t, post_stage, then_norm, stage)?;
                    normed_next = then_norm.is_some();
                    a.normed_staged = stage;
                }
                DevMlp::Dense(m) => {
                    mark_swiglu(dev, "mlp.gate_up", &m.gate, 1, t)?;
                    swiglu_linear(dev, &m.gate, &m.up, &a.normed, t, &mut a.act)?;
                    mark_linear(dev, "mlp.down", &m.down, t)?;
                    linear(dev, &m.down, &a.act, t, &mut a.mlp)?;
                }
            }
        }
        dev.set_layer(-1);
        if decode {
            dev.mark("norm", 12 * h, 0)?;
            return rmsnorm::rms_norm(dev, &a.x, final_norm, eps, 1, &mut a.normed);
        }
        if normed_next {
            return Ok(());
        }
        dev.mark("norm", 16 * tt * h, 0)?;
        rmsnorm::add_rms_norm(dev, &a.mlp, &mut a.x, final_norm, eps, t, &mut a.normed, None)
    }

    /// Logits of normed rows `r0..r1` of the last chunk into `act.logits` ([r1-r0, V]).
    fn logits_rows(&mut self, r0: usize, r1: usize) -> Result<()> {
        let h = self.cfg.hidden_size;
        let head = self.lm_head.as_ref().unwrap_or(&self.embed);
        let x = self.act.normed.slice(r0 * h..r1 * h);
        mark_linear(&self.dev, "lm_head", head, r1 - r0)?;
        // Exact whatever the prefill precision: several rows of logits are a score's (every position's
        // log-probabilities, off the serving path), and they match what one row's GEMV gives.
        linear_with(&self.dev, head, &x, r1 - r0, &mut self.act.logits, gemm::Opts::default())
    }

    fn forward_impl(&mut self, state: &mut CudaState, tokens: &[u32], want: Logits) -> Result<Vec<f32>> {
        let v = self.cfg.vocab_size;
        let n_chunks = tokens.len().div_ceil(self.max_chunk);
        let mut out = Vec::new();
        for (ci, chunk) in tokens.chunks(self.max_chunk).enumerate() {
            if chunk.len() <= STEP_TOKENS {
                // A few tokens (a grammar's forced run): decode steps, each the replayed graph.
                for (i, &tok) in chunk.iter().enumerate() {
                    self.run_chunk(state, &[tok])?;
                    let last = ci + 1 == n_chunks && i + 1 == chunk.len();
                    if matches!(want, Logits::All) || (last && matches!(want, Logits::Last)) {
                        self.logits_rows(0, 1)?;
                        let row = self.dev.download(&self.act.logits.slice(0..v))?;
                        if matches!(want, Logits::All) {
                            out.extend(row);
                        } else {
                            out = row;
                        }
                    }
                }
                continue;
            }
            self.run_chunk(state, chunk)?;
            let t = chunk.len();
            match want {
                Logits::None => {}
                Logits::Last if ci + 1 == n_chunks => {
                    self.logits_rows(t - 1, t)?;
                    out = self.dev.download(&self.act.logits.slice(0..v))?;
                }
                Logits::Last => {}
                Logits::All => {
                    let mut r0 = 0;
                    while r0 < t {
                        let r1 = (r0 + LOGIT_ROWS).min(t);
                        self.logits_rows(r0, r1)?;
                        out.extend(self.dev.download(&self.act.logits.slice(0..(r1 - r0) * v))?);
                        r0 = r1;
                    }
                }
            }
        }
        Ok(out)
    }

    /// Runs `tokens` (at least one) in chunks of `max_chunk`; a chunk of at most [`STEP_TOKENS`] runs
    /// as that many decode steps. Returns the row of `act.normed` that holds the last token.
    fn run_tokens(&mut self, state: &mut CudaState, tokens: &[u32]) -> Result<usize> {
        let mut row = 0;
        for chunk in tokens.chunks(self.max_chunk) {
            if chunk.len() <= STEP_TOKENS {
                for &tok in chunk {
                    self.run_chunk(state, &[tok])?;
                }
                row = 0;
            } else {
                self.run_chunk(state, chunk)?;
                row = chunk.len() - 1;
            }
        }
        Ok(row)
    }

    fn pick_impl(&mut self, state: &mut CudaState, tokens: &[u32], pick: &DevicePick) -> Result<u32> {
        let r = self.run_tokens(state, tokens)?;
        self.logits_rows(r, r + 1)?;
        let a = &mut self.act;
        self.dev.mark("pick", 4 * self.cfg.vocab_size as u64, 0)?;
        sample::pick(&self.dev, &a.logits, pick, &mut a.pick_edits, &mut a.pick_scratch, &mut a.pick_out)?;
        let id = self.dev.download(&a.pick_out)?;
        Ok(id[0])
    }

    /// [`Self::pick_impl`] under a token mask: the forward pass and the logits are queued, then the
    /// host fills the mask while the device runs them, then it is uploaded and the pick applies it.
    fn pick_masked_impl(&mut self, state: &mut CudaState, tokens: &[u32], pick: &DevicePick, fill: &mut MaskFill<'_>) -> Result<u32, BackendError> {
        let r = self.run_tokens(state, tokens).map_err(dev_err)?;
        self.logits_rows(r, r + 1).map_err(dev_err)?;
        let words = pick.vocab.div_ceil(32);
        if words > self.act.pick_mask_host.len() {
            return Err(BackendError::BadState(format!("a mask over {} tokens for a vocabulary of {}", pick.vocab, self.cfg.vocab_size)));
        }
        let a = &mut self.act;
        fill(&mut a.pick_mask_host[..words])?;
        self.dev.upload_into(&a.pick_mask_host[..words], &mut a.pick_mask.slice_mut(0..words)).map_err(dev_err)?;
        self.dev.mark("pick", 4 * self.cfg.vocab_size as u64, 0).map_err(dev_err)?;
        sample::pick_masked(&self.dev, &a.logits, pick, Some(&a.pick_mask), &mut a.pick_edits, &mut a.pick_scratch, &mut a.pick_out).map_err(dev_err)?;
        let id = self.dev.download(&a.pick_out).map_err(dev_err)?;
        Ok(id[0])
    }
}

/// y = x·Wᵀ for T rows: a GEMV for one token, a GEMM for more.
fn linear<X: DevicePtr<f32>, Y: DevicePtrMut<f32>>(dev: &Device, w: &DeviceMatrix, x: &X, t: usize, y: &mut Y) -> Result<()> {
    linear_with(dev, w, x, t, y, prefill_opts())
}

/// [`linear`] on the x of the previous GEMM call, unwritten since (its staged copy is reused).
fn linear_reuse<X: DevicePtr<f32>, Y: DevicePtrMut<f32>>(dev: &Device, w: &DeviceMatrix, x: &X, t: usize, y: &mut Y) -> Result<()> {
    linear_with(dev, w, x, t, y, reuse_x())
}

fn linear_with<X: DevicePtr<f32>, Y: DevicePtrMut<f32>>(dev: &Device, w: &DeviceMatrix, x: &X, t: usize, y: &mut Y, o: gemm::Opts) -> Result<()> {
    if t == 1 {
        affine_gemv::gemv(dev, w, Select::matrix(0), x, false, y)
    } else {
        gemm::gemm_with(dev, w, 0, x, t, y, o)
    }
}

/// y = silu(x·Gᵀ) ⊙ (x·Uᵀ) for T rows.
fn swiglu_linear<X: DevicePtr<f32>, Y: DevicePtrMut<f32>>(dev: &Device, g: &DeviceMatrix, u: &DeviceMatrix, x: &X, t: usize, y: &mut Y) -> Result<()> {
    if t == 1 {
        affine_gemv::swiglu(dev, g, u, Select::matrix(0), x, false, y)
    } else {
        gemm::swiglu_gemm_with(dev, g, u, 0, x, t, y, prefill_opts())
    }
}

/// Gated DeltaNet on a.normed [T, H] → a.mix [T, H]; advances the conv and recurrent states.
/// Decode (`dec` = the input norm, one token): on RMSNorm(a.x) instead, normalised inside the input
/// projection (`in_norm_w`: the norm's weight), and the output projection adds into a.x.
#[allow(clippy::too_many_arguments)]
fn gdn_mixer(
    dev: &Device,
    cfg: &ModelConfig,
    g: &GdnLayer,
    a: &mut Activations,
    t: usize,
    dec: Option<affine_gemv::Fuse>,
    in_norm_w: &CudaSlice<f32>,
    conv: &mut CudaSlice<f32>,
    ssm: &mut CudaSlice<f32>,
) -> Result<()> {
    let norm_in = gdn_gated_rule(dev, cfg, g, a, t, dec, in_norm_w, conv, ssm)?; // a.normed_rule [T, Hv·Dv], or a.rule
    if let Some(NormIn { z_at, z_stride }) = norm_in {
        // A prompt chunk: the gated norm of a.rule [T, Hv, Dv] with z, then the output projection;
        // where the projection stages x in the half numerics, the norm writes that staging itself.
        let d = GdnDims::from_config(cfg);
        let z = a.in_proj.slice(z_at..);
        let o = prefill_opts();
        let n = (t * d.value_dim()) as u64;
        if t > 1 && gdn_norm_stages() && gemm::takes_prestaged_half(&g.out, o) && gdn::gated_norm_stage_fits(&d) {
            dev.mark("gdn.norm", 10 * n, 0)?; // rule output and z in, f16 out
            let st = gemm_wgmma::prestage_half(dev, &a.normed_rule, t, d.value_dim())?;
            gdn::gated_rmsnorm_staged(dev, &d, t, &a.rule, &z, z_stride, &g.norm, cfg.rms_norm_eps, &st)?;
            mark_linear(dev, "gdn.out_proj", &g.out, t)?;
            return gemm::gemm_with(dev, &g.out, 0, &a.normed_rule, t, &mut a.mix, gemm::Opts { x_staged_only: true, ..o }); // [T, H]
        }
        dev.mark("gdn.norm", 12 * n, 0)?;
        gdn::gated_rmsnorm_with(dev, &d, t, &a.rule, &z, z_stride, &g.norm, cfg.rms_norm_eps, &mut a.normed_rule)?;
    }
    mark_linear(dev, "gdn.out_proj", &g.out, t)?;
    if dec.is_some() {
        return affine_gemv::gemv_fused(dev, &g.out, Select::matrix(0), &a.normed_rule, false, &mut a.x, affine_gemv::Fuse::none().accumulate()); // x += [H]
    }
    linear(dev, &g.out, &a.normed_rule, t, &mut a.mix) // [T, H]
}

/// Where a prompt chunk's gated norm finds z: a.in_proj from float `z_at`, token rows `z_stride` apart.
struct NormIn {
    z_at: usize,
    z_stride: usize,
}

/// [`gdn_mixer`] up to its output projection: the input projection, conv, gates, rule and gated norm
/// into a.normed_rule [T, Hv·Dv] — or, for a prompt chunk (no `dec`), up to the rule's output a.rule
/// [T, Hv, Dv], returning where z is for the caller's gated norm.
#[allow(clippy::too_many_arguments)]
fn gdn_gated_rule(
    dev: &Device,
    cfg: &ModelConfig,
    g: &GdnLayer,
    a: &mut Activations,
    t: usize,
    dec: Option<affine_gemv::Fuse>,
    in_norm_w: &CudaSlice<f32>,
    conv: &mut CudaSlice<f32>,
    ssm: &mut CudaSlice<f32>,
) -> Result<Option<NormIn>> {
    let d = GdnDims::from_config(cfg);
    // One token, opted in (`LILY_GDN_STEP=in`) and where the layer fits it: the input projection and
    // the step in one launch (`ops::gdn_in_step`).
    let in_step = match gdn_step_form() {
        GdnStepForm::InStep => Some(gdn_in_step::Copies::Ahead),
        GdnStepForm::InStepAfter => Some(gdn_in_step::Copies::After),
        _ => None,
    };
    if let (Some(_), 1, Some(fw), Some(copies)) = (dec, t, g.in_fused.as_ref(), in_step) {
        if gdn_in_step::fits(dev, &d, fw) {
            let (c, vd, hv) = (d.conv_dim() as u64, d.value_dim() as u64, d.num_v_heads as u64);
            let (dk, dv, kk, h) = (d.head_k_dim as u64, d.head_v_dim as u64, d.conv_kernel as u64, cfg.hidden_size as u64);
            let state_bytes = 8 * hv * dk * dv; // read and written
            let flops = 2 * fw.rows as u64 * h + 6 * hv * dk * dv;
            dev.mark("gdn.in_step", fw.bytes_per_matrix() as u64 + state_bytes + 4 * (h + 2 * (kk - 1) * c + kk * c + vd), flops)?;
            gdn_in_step::decode_in_step(dev, &d, fw, &a.x, in_norm_w, cfg.rms_norm_eps, &g.conv_w, conv, &g.a_log, &g.dt_bias, ssm, &g.norm, cfg.rms_norm_eps, &mut a.normed_rule, copies)?;
            return Ok(None);
        }
    }
    let (c, vd, hv) = (d.conv_dim(), d.value_dim(), d.num_v_heads);
    // The projections qkv [T, C] (= q | k | v), z [T, Hv·Dv], b and a [T, Hv], all in a.in_proj: one
    // product over the layer's fused weights (a GEMM, or one token's GEMV) writes them as column
    // ranges of rows of W = C + Hv·Dv + 2·Hv floats; without fused weights four products write four
    // blocks of T rows each. `off`: where qkv, z, b and a start; `xs`, `zs`, `abs`: their row strides.
    let fused = g.in_fused.as_ref();
    let (off, xs, zs, abs) = match fused {
        Some(_) => ([0, c, c + vd, c + vd + hv], c + vd + 2 * hv, c + vd + 2 * hv, c + vd + 2 * hv),
        None => ([0, t * c, t * (c + vd), t * (c + vd + hv)], c, vd, hv),
    };
    match (dec, fused) {
        (Some(f), Some(fw)) => {
            mark_linear(dev, "gdn.in_proj", fw, 1)?;
            affine_gemv::gemv_fused(dev, fw, Select::matrix(0), &a.x, false, &mut a.in_proj, f)?; // [qkv | z | b | a]
        }
        (Some(f), None) => {
            for (w, o) in [(&g.qkv, off[0]), (&g.z, off[1]), (&g.b, off[2]), (&g.a, off[3])] {
                mark_linear(dev, "gdn.in_proj", w, 1)?;
                affine_gemv::gemv_fused(dev, w, Select::matrix(0), &a.x, false, &mut a.in_proj.slice_mut(o..), f)?;
            }
        }
        (None, Some(fw)) => {
            mark_linear(dev, "gdn.in_proj", fw, t)?;
            let o = normed_opts(a);
            linear_with(dev, fw, &a.normed, t, &mut a.in_proj, o)?; // [T, qkv | z | b | a]
        }
        (None, None) => {
            for (i, w) in [&g.qkv, &g.z, &g.b, &g.a].into_iter().enumerate() {
                mark_linear(dev, "gdn.in_proj", w, t)?;
                // The last three read the same a.normed: its staged copy is reused.
                let o = if i == 0 { normed_opts(a) } else { reuse_x() };
                linear_with(dev, w, &a.normed, t, &mut a.in_proj.slice_mut(off[i]..), o)?;
            }
        }
    }
    let p = &a.in_proj;
    let (x, z, b, av) = (p.slice(off[0]..), p.slice(off[1]..), p.slice(off[2]..), p.slice(off[3]..));
    let (tt, c64, vd64, hv64) = (t as u64, c as u64, vd as u64, hv as u64);
    let kk = d.conv_kernel as u64;
    let (dk64, dv64) = (d.head_k_dim as u64, d.head_v_dim as u64);
    let state_bytes = 8 * hv64 * dk64 * dv64; // read and written
    if dec.is_some() && t == 1 && gdn_step_form() != GdnStepForm::Off && gdn::step_fits(&d) {
        // One token: conv, gates, rule and gated norm in one launch.
        dev.mark("gdn.step", state_bytes + 4 * (3 * c64 + 2 * (kk - 1) * c64 + kk * c64 + 3 * vd64 + 2 * hv64), 6 * hv64 * dk64 * dv64)?;
        gdn::decode_step(dev, &d, &x, &g.conv_w, conv, &av, &b, &g.a_log, &g.dt_bias, ssm, &z, &g.norm, cfg.rms_norm_eps, &mut a.normed_rule, gdn_step_loads())?;
        return Ok(None);
    }
    let ins = gdn::ConvInputs { x_stride: xs, ab_stride: abs, kernel: gdn::ConvKernel::Auto };
    let rule_bytes = state_bytes + 4 * tt * (c64 + vd64 + 2 * hv64);
    let chunked = t >= GDN_CHUNKED_MIN_TOKENS;
    let fused_pass = if chunked && gdn_chunked::conv_fits(&d, t, &ins) { gdn_chunked::fused_conv_pass(dev, &d) } else { None };
    if let Some(pass) = fused_pass {
        // The bf16 pair's prep convolves x itself (conv, SiLU, q/k norms, gates), then the chunked rule.
        dev.mark("gdn.rule", rule_bytes, 6 * tt * hv64 * dk64 * dv64)?;
        gdn_chunked::delta_rule_conv(dev, &d, t, &x, &g.conv_w, conv, &av, &b, &g.a_log, &g.dt_bias, ins, ssm, &mut a.rule, &mut a.gdn_scratch, pass)?; // [T, Hv, Dv]
    } else {
        // causal conv + SiLU, q/k L2 norm, gates g and beta
        dev.mark("gdn.conv", 4 * (2 * tt * c64 + 2 * (kk - 1) * c64 + kk * c64 + 4 * tt * hv64), 0)?;
        gdn::conv_qk_with(dev, &d, t, &x, &g.conv_w, conv, &av, &b, &g.a_log, &g.dt_bias, &mut a.qkv, &mut a.g, &mut a.beta, ins)?;
        // per token and value head: S·k, the rank-1 update and Sᵀq over [Dk, Dv] (recurrent form)
        dev.mark("gdn.rule", rule_bytes, 6 * tt * hv64 * dk64 * dv64)?;
        if chunked {
            gdn_chunked::delta_rule_chunked(dev, &d, t, &a.qkv, &a.g, &a.beta, ssm, &mut a.rule, &mut a.gdn_scratch)?; // [T, Hv, Dv]
        } else {
            gdn::delta_rule_recurrent(dev, &d, t, &a.qkv, &a.g, &a.beta, ssm, &mut a.rule)?; // [T, Hv, Dv]
        }
    }
    if dec.is_none() {
        return Ok(Some(NormIn { z_at: off[1], z_stride: zs }));
    }
    dev.mark("gdn.norm", 12 * tt * vd64, 0)?;
    gdn::gated_rmsnorm_with(dev, &d, t, &a.rule, &z, zs, &g.norm, cfg.rms_norm_eps, &mut a.normed_rule)?;
    Ok(None)
}

/// Gated attention on a.normed [T, H] at its positions → a.mix [T, H]; appends to the caches.
#[allow(clippy::too_many_arguments)]
fn attn_mixer(
    dev: &Device,
    cfg: &ModelConfig,
    w: &AttnLayer,
    a: &mut Activations,
    t: usize,
    dec: Option<affine_gemv::Fuse>,
    at: AtPos,
    kc: &mut CudaSlice<bf16>,
    vc: &mut CudaSlice<bf16>,
    cap: usize,
) -> Result<()> {
    let dims = attn_dims(cfg);
    let first = normed_opts(a); // a prompt chunk's q projection
    let gate = if dims.gated { Some(&mut a.gate) } else { None };
    let Some(f) = dec.filter(|_| t == 1) else {
        let AtPos::Host(pos0) = at else { return Err(CudaError::Shape("a device-side position takes one token".into())) };
        mark_linear(dev, "attn.qkv", &w.q, t)?;
        linear_with(dev, &w.q, &a.normed, t, &mut a.qg, first)?; // [T, nh·hd·(1+gate)]
        mark_linear(dev, "attn.qkv", &w.k, t)?;
        linear_reuse(dev, &w.k, &a.normed, t, &mut a.k)?; // [T, kvh·hd]
        mark_linear(dev, "attn.qkv", &w.v, t)?;
        linear_reuse(dev, &w.v, &a.normed, t, &mut a.v)?; // [T, kvh·hd]
        // q/k RMSNorm, partial RoPE, K/V appended at pos0..
        mark_attn_prep(dev, &dims, t)?;
        attn_prep::prep(dev, &a.qg, &a.k, &a.v, &w.q_norm, &w.k_norm, dims, Scalar::Host(pos0), t, &mut a.q, gate, kc, vc, cap)?;
        let gate = if dims.gated { Some(&a.gate) } else { None };
        // causal: query i sees pos0 + i + 1 positions
        let (tt, p0) = (t as u64, pos0 as u64);
        let seen = tt * p0 + tt * (tt + 1) / 2;
        let (nh, kvh, hd) = (dims.nh as u64, dims.kvh as u64, dims.hd as u64);
        dev.mark("attn.core", 4 * tt * nh * hd * 3 + KV_BYTES * 2 * (p0 + tt) * kvh * hd, 4 * nh * hd * seen)?;
        attn_prefill::prefill(dev, attn_prefill::Kernel::Auto, &a.q, kc, vc, cap, gate, dims.nh, dims.kvh, dims.hd, pos0, t, &mut a.att)?; // [T, nh, hd]
        mark_linear(dev, "attn.o_proj", &w.o, t)?;
        return linear(dev, &w.o, &a.att, t, &mut a.mix);
    };
    // One token: q, k, v from one fused GEMV when the layer has it, on RMSNorm(x) (normalised in the GEMV).
    let (qn, kvn) = (dims.nh * dims.hd * if dims.gated { 2 } else { 1 }, dims.kvh * dims.hd);
    let (q, k, v) = match &w.qkv_fused {
        Some(fused) => {
            mark_linear(dev, "attn.qkv", fused, 1)?;
            affine_gemv::gemv_fused(dev, fused, Select::matrix(0), &a.x, false, &mut a.proj1, f)?; // [q | k | v]
            let p = &a.proj1;
            (p.slice(0..qn), p.slice(qn..qn + kvn), p.slice(qn + kvn..qn + 2 * kvn))
        }
        None => {
            for (m, y) in [(&w.q, &mut a.qg), (&w.k, &mut a.k), (&w.v, &mut a.v)] {
                mark_linear(dev, "attn.qkv", m, 1)?;
                affine_gemv::gemv_fused(dev, m, Select::matrix(0), &a.x, false, y, f)?;
            }
            (a.qg.slice(0..qn), a.k.slice(0..kvn), a.v.slice(0..kvn))
        }
    };
    // The position and the length after it: from the host, or (a captured graph) from a.step_pos.
    let (pos_at, n_at) = (a.step_pos.slice(0..1), a.step_pos.slice(1..2));
    let (pos, n) = match at {
        AtPos::Host(p) => (Scalar::Host(p), Scalar::Host(p + 1)),
        AtPos::Device { cap } => (Scalar::Device { at: &pos_at, max: cap - 1 }, Scalar::Device { at: &n_at, max: cap }),
    };
    mark_attn_prep(dev, &dims, 1)?;
    attn_prep::prep(dev, &q, &k, &v, &w.q_norm, &w.k_norm, dims, pos, 1, &mut a.q, gate, kc, vc, cap)?;
    {
        // Marked whether recording or not: a knock-out (`Device::set_knockout`) goes by the marks.
        let n = match n {
            Scalar::Host(n) => n as u64,
            Scalar::Device { max, .. } => max as u64,
        };
        let (nh, kvh, hd) = (dims.nh as u64, dims.kvh as u64, dims.hd as u64);
        dev.mark("attn.core", 8 * nh * hd + KV_BYTES * 2 * n * kvh * hd, 4 * nh * hd * n)?;
    }
    let gate = if dims.gated { Some(&a.gate) } else { None };
    attention::decode(dev, attention::Ring::Auto, &a.q, kc, vc, cap, n, dims.nh, dims.kvh, dims.hd, gate, &mut a.att, &mut a.att_scratch)?;
    mark_linear(dev, "attn.o_proj", &w.o, 1)?;
    affine_gemv::gemv_fused(dev, &w.o, Select::matrix(0), &a.att, false, &mut a.x, affine_gemv::Fuse::none().accumulate()) // x += [H]
}

/// Where an attention layer's first new position comes from.
#[derive(Clone, Copy)]
enum AtPos {
    Host(usize),
    /// `act.step_pos` = [pos, pos + 1] on the device; `cap` bounds it (the cache's capacity).
    Device { cap: usize },
}

/// The device addresses of every buffer of `s` (a captured decode graph is valid for these only).
/// Addresses, not an id per state: the stream-ordered allocator often hands a new session (or a
/// clone) the buffers its predecessor freed, and then the graph is replayed without a recapture.
/// (An id per state, tried on 2026-11-29, recaptured for every new session: decode 1–2% slower in
/// `lily bench`, whose decode repeats each start from a fresh clone; see docs/PERF.md.)
fn state_key(dev: &Device, s: &CudaState) -> Vec<u64> {
    let st = dev.stream();
    s.layers
        .iter()
        .flat_map(|l| match l {
            DevLayerState::Gdn { conv, ssm } => [conv.device_ptr(st).0, ssm.device_ptr(st).0],
            DevLayerState::Attn { k, v, .. } => [k.device_ptr(st).0, v.device_ptr(st).0],
        })
        .collect()
}

fn attn_dims(cfg: &ModelConfig) -> attn_prep::AttnDims {

    attn_prep::AttnDims {
        nh: cfg.num_attention_heads,
        kvh: cfg.num_key_value_heads,
        hd: cfg.head_dim,
        rot: cfg.rotary_dim,
        theta: cfg.rope_theta,
        eps: cfg.rms_norm_eps,
        gated: cfg.attn_output_gate,
    }
}

/// The sparse MoE block on a.normed [T, H] → a.mlp [T, H] (prompt chunks; one token: [`moe_decode`]).
/// With `router_plus` (the router with the shared expert's gate as row E) and a shared expert, one GEMM
/// writes both: a.router holds rows of E + 1, the gate logit last. With `then_norm` (the next norm's
/// weight and eps) the combine adds the block's output into a.x and writes RMSNorm(a.x) to a.normed
/// instead (a.mlp untouched). `prestaged`: the device's half-numerics staging holds a.normed (written by
/// the norm with it, and the router's folded staging too where the router takes it), which the router's
/// own staging, where it stages, must leave in place.
#[allow(clippy::too_many_arguments)]
fn moe(
    dev: &Device,
    cfg: &ModelConfig,
    router: &DeviceMatrix,
    router_plus: Option<&DeviceMatrix>,
    ex: &Swiglu,
    shared: &Shared,
    a: &mut Activations,
    t: usize,
    prestaged: bool,
    then_norm: Option<(&CudaSlice<f32>, f32)>,
    stage: bool,
) -> Result<()> {
    let (h, e, k) = (cfg.hidden_size, cfg.num_experts, cfg.num_experts_per_tok);
    let rw = router_matrix(router, router_plus, shared);
    let router_plus = router_plus.filter(|_| !matches!(shared, Shared::None));
    let stride = if router_plus.is_some() { e + 1 } else { e };
    mark_linear(dev, "moe.router", rw, t)?;
    // prestaged: the norm wrote a.normed's half staging (and maybe the router's folded one beside it);
    // the router's own staging, where it stages, leaves the half one in place.
    linear_with(dev, rw, &a.normed, t, &mut a.router, if prestaged { reuse_x() } else { prefill_opts() })?; // [T, E (+1)]
    dev.mark("moe.route", 4 * (t * e + 2 * t * k) as u64, 0)?;
    moe_route::route_strided(dev, &a.router, stride, t, e, k, cfg.norm_topk_prob, &mut a.idx, &mut a.route_w)?; // [T, k]
    // The shared expert: [T, H] and its gate logit [T].
    // (gate, up, down, matrix index, gate row): its own matrices, or matrix E of the expert stacks.
    let shared_mlp = match shared {
        Shared::None => None,
        Shared::Separate { mlp, gate } => Some((&mlp.gate, &mlp.up, &mlp.down, 0, gate)),
        Shared::InStack { gate } => Some((&ex.gate, &ex.up, &ex.down, e, gate)),
    };
    // Every GEMM on a.normed runs before those on other inputs, so that a.normed is staged once.
    if let Some((sg, su, _, m, gate)) = shared_mlp {
        mark_swiglu(dev, "moe.shared", sg, 1, t)?;
        gemm::swiglu_gemm_with(dev, sg, su, m, &a.normed, t, &mut a.shared_act, reuse_x())?; // [T, Is]
        if router_plus.is_none() {
            mark_linear(dev, "moe.shared", gate, t)?;
            gemm::gemm_with(dev, gate, 0, &a.normed, t, &mut a.shared_gate, reuse_x())?; // [T, 1]
        }
    }
    // Sort the T·k slots by expert on the device, run each expert over its slots.
    dev.mark("moe.plan", 4 * 4 * (t * k) as u64, 0)?;
    moe_dispatch::plan(dev, &a.idx, t, k, e, &mut a.counts, &mut a.offsets, &mut a.rows, &mut a.slot_of)?;
    let routed = gemm::Opts { experts: Some(e), ..prefill_opts() }; // not the shared expert after them
    let used = e.min(t * k); // experts with at least one slot (at most)
    mark_grouped(dev, "moe.gate_up", &ex.gate, 2, used, t * k)?;
    let gate_up = gemm::Opts { reuse_x: true, ..routed };
    // x is the chunk's T rows of a.normed, not the whole buffer: a gathered GEMM stages as many rows
    // as x holds, and T rows are what the GEMMs on a.normed before it staged, so that staging is reused.
    let normed = a.normed.slice(0..t * h);
    gemm::grouped_swiglu_gemm_with(dev, &ex.gate, &ex.up, &a.offsets, Some(&a.rows), &normed, t * k, &mut a.act, gate_up)?; // [T·k, I]
    if let Some((_, _, sd, m, _)) = shared_mlp {
        mark_linear(dev, "moe.shared", sd, t)?;
        gemm::gemm_with(dev, sd, m, &a.shared_act, t, &mut a.shared_out, prefill_opts())?; // [T, H]
    }
    // The slots' outputs in bf16 where the down projection's kernels can write them (half the bytes
    // the GEMM writes and the combine reads back), in a.expert_out's memory; else f32.
    let out16 = moe_out_bf16() && gemm::bf16_out_ok(&ex.down, routed);
    let y_bytes = if out16 { 2 } else { 4 } as u64;
    mark_grouped_out(dev, "moe.down", &ex.down, 1, used, t * k, y_bytes)?;
    let Activations { expert_out, offsets, act, router: logits, shared_gate, shared_out, idx, slot_of, route_w, x, normed, mlp, .. } = a;
    // The gate logits: column E of the router's rows, or the shared gate's.
    let (gate_logits, gate_stride) = if router_plus.is_some() { (logits.slice(e..), e + 1) } else { (shared_gate.slice(0..), 1) };
    let combine = Combine {
        idx,
        slot_of,
        route_w,
        shared: shared_mlp.map(|_| (&*shared_out, &gate_logits)),
        gate_stride,
        into: match then_norm {
            Some((w, eps)) => CombineInto::Norm { x, w, eps, normed, stage },
            None => CombineInto::Mlp(mlp),
        },
    };
    if out16 {
        // SAFETY: every bit pattern is a u16; expert_out holds t·k·H f32, twice the bytes needed.
        let mut y16 = unsafe { expert_out.transmute_mut::<u16>(t * k * h) }.ok_or_else(|| CudaError::Shape("moe: expert outputs buffer too small".into()))?;
        down_and_combine(dev, &ex.down, offsets, act, &mut y16, routed, t, k, h, combine)
    } else {
        down_and_combine(dev, &ex.down, offsets, act, expert_out, routed, t, k, h, combine)
    }
}

/// The router's matrix of a prompt chunk's MoE block: with a shared expert, the router with the shared
/// expert's gate as row E where the model has it; else the router.
fn router_matrix<'a>(router: &'a DeviceMatrix, router_plus: Option<&'a DeviceMatrix>, shared: &Shared) -> &'a DeviceMatrix {
    router_plus.filter(|_| !matches!(shared, Shared::None)).unwrap_or(router)
}

/// The combine's inputs besides the slots' outputs, and where its sums go.
struct Combine<'a, G: DevicePtr<f32>> {
    idx: &'a CudaSlice<u32>,         // [T, k] the tokens' experts
    slot_of: &'a CudaSlice<u32>,     // [T·k] each (token, j)'s slot in expert order
    route_w: &'a CudaSlice<f32>,     // [T, k]
    shared: Option<(&'a CudaSlice<f32>, &'a G)>, // the shared expert's rows [T, H] and gate logits
    gate_stride: usize,
    into: CombineInto<'a>,
}

enum CombineInto<'a> {
    /// The MoE's output rows [T, H] (a.mlp).
    Mlp(&'a mut CudaSlice<f32>),
    /// Added into the residual stream x [T, H], which the next RMSNorm (weight w) writes into `normed`
    /// — or, with `stage`, only into the next GEMM's staged copy of `normed` (`prestage_half`).
    Norm { x: &'a mut CudaSlice<f32>, w: &'a CudaSlice<f32>, eps: f32, normed: &'a mut CudaSlice<f32>, stage: bool },
}

/// The routed experts' down projection of `act` [T·k, I] into the slots' rows y [T·k, H] (f32, or bf16
/// bits), then the combine of each token's k rows with its routing weights and the shared expert.
#[allow(clippy::too_many_arguments)]
fn down_and_combine<E: crate::ops::Act, Y: DevicePtr<E> + DevicePtrMut<E>, G: DevicePtr<f32>>(
    dev: &Device,
    down: &DeviceMatrix,
    offsets: &CudaSlice<u32>,
    act: &CudaSlice<f32>,
    y: &mut Y,
    routed: gemm::Opts,
    t: usize,
    k: usize,
    h: usize,
    c: Combine<'_, G>,
) -> Result<()> {
    gemm::grouped_gemm_with(dev, down, offsets, None, act, t * k, y, routed)?; // [T·k, H]
    let (y_bytes, extra) = (
        if E::BF16 { 2 } else { 4 },
        match c.into {
            CombineInto::Norm { stage: true, .. } => 6,
            CombineInto::Norm { .. } => 8,
            CombineInto::Mlp(_) => 0,
        },
    );
    // Bytes: y, shared, out (f32), and with the norm x read and normed written too.
    dev.mark("moe.combine", (y_bytes * (t * k) as u64 + (8 + extra) * t as u64) * h as u64, 2 * (t * (k + 1) * h) as u64)?;
    let (idx, slot_of, w) = (c.idx, Some(c.slot_of), c.route_w);
    match c.into {
        CombineInto::Norm { x, w: nw, eps, normed, stage } => {
            let st = if stage { Some(gemm_wgmma::prestage_half(dev, &*normed, t, h)?) } else { None };
            let out = match &st {
                Some(st) => moe_dispatch::NormOut::Staged(st),
                None => moe_dispatch::NormOut::Rows(normed),
            };
            moe_dispatch::combine_norm(dev, &*y, idx, slot_of, w, c.shared, c.gate_stride, t, k, h, x, nw, eps, out)
        }
        CombineInto::Mlp(out) => moe_dispatch::combine_with(dev, &*y, idx, slot_of, w, c.shared, c.gate_stride, t, k, h, out, false),
    }
}

/// One token: x += MoE(RMSNorm(x)). With the shared expert in the stack and its gate as the router's
/// row E (the full-size model's layout): the router GEMV on RMSNorm(x) (normalised as it stages x),
/// then, opted in and where the shapes fit it, the rest in one persistent kernel (`ops::moe_decode`:
/// two launches in all); else the top-k selection, the experts' gate+up as one indexed SwiGLU GEMV
/// over the k chosen and the shared expert (slot k), the down projections, and the combine adding
/// into x; by default the selection runs inside every block of the gate/up GEMV (no kernel of its
/// own; `LILY_SELECT=0` restores it) — or, with the opt-in fusions (`LILY_FUSE`), inside the router's
/// last block (`route`, when the selection is off), and the combine inside the down projection
/// (`mix`). Otherwise the norm runs as its own kernel and the unfused router, selection, GEMVs and
/// combine follow (slot j of the token is row j of the outputs), the combine adding into x.
#[allow(clippy::too_many_arguments)]
fn moe_decode(
    dev: &Device,
    cfg: &ModelConfig,
    post_norm: &CudaSlice<f32>,
    post: affine_gemv::Fuse,
    router: &DeviceMatrix,
    router_plus: Option<&DeviceMatrix>,
    ex: &Swiglu,
    shared: &Shared,
    a: &mut Activations,
    unfused: u32,
) -> Result<()> {
    let (h, e, k) = (cfg.hidden_size, cfg.num_experts, cfg.num_experts_per_tok);
    let fused_gate = router_plus.is_some() && !matches!(shared, Shared::None);
    if let (Some(rp), Shared::InStack { .. }, true) = (router_plus, shared, k < affine_gemv::MIX_SLOTS && e <= affine_gemv::ROUTE_MAX_EXPERTS && k <= 32) {
        mark_linear(dev, "moe.router", rp, 1)?;
        // The router GEMV, then everything after it in one persistent kernel (with `LILY_MOE_DECODE=1`,
        // where the shapes fit it; else the separate kernels below).
        let plan = if unfused & UNFUSE_MOE == 0 { moe_decode::plan(dev, &ex.gate, &ex.up, &ex.down, e, k)? } else { None };
        if let Some(plan) = plan {
            affine_gemv::gemv_fused(dev, rp, Select::matrix(0), &a.x, false, &mut a.router, post)?; // logits [E + 1]
            let (i, per) = (ex.gate.rows as u64, (2 * ex.gate.bytes_per_matrix() + ex.down.bytes_per_matrix()) as u64);
            let ns = (k + 1) as u64;
            dev.mark("moe.experts", ns * per + 4 * (3 * h as u64 + 2 * ns * i), 6 * ns * i * h as u64)?;
            let logits = a.router.slice(0..e + 1);
            return moe_decode::run(dev, &plan, &ex.gate, &ex.up, &ex.down, &logits, post_norm, cfg.rms_norm_eps, e, k, cfg.norm_topk_prob, &mut a.x, &mut a.act, &mut a.moe_barrier, None, None);
        }
        // The selection: inside the gate/up GEMV's blocks (the default), in the router's last block
        // (`LILY_FUSE=route`), or a kernel of its own.
        let select = unfused & UNFUSE_SELECT == 0 && affine_gemv::select_fits(&ex.gate, &ex.up, e, k);
        if !select && unfused & UNFUSE_ROUTE == 0 {
            let mut chosen = a.idx1.slice_mut(0..k);
            affine_gemv::router_route(dev, rp, &a.x, post, &mut a.router, e, k, cfg.norm_topk_prob, &mut a.route_counter, &mut chosen, &mut a.route_w)?; // logits [E + 1], idx1[..k], w [k]
        } else {
            affine_gemv::gemv_fused(dev, rp, Select::matrix(0), &a.x, false, &mut a.router, post)?; // logits [E + 1]
            if !select {
                dev.mark("moe.route", 4 * (e + 2 * k) as u64, 0)?;
                moe_route::route(dev, &a.router, 1, e, k, cfg.norm_topk_prob, &mut a.idx1, &mut a.route_w)?; // idx1[..k], w [k]
            }
        }
        mark_swiglu(dev, "moe.gate_up", &ex.gate, k + 1, 1)?;
        if select {
            let mut chosen = a.idx1.slice_mut(0..k);
            affine_gemv::swiglu_select(dev, &ex.gate, &ex.up, &a.router.slice(0..e), e, k, cfg.norm_topk_prob, e, &a.x, post, &mut chosen, &mut a.route_w, &mut a.act)?; // idx1[..k], w [k], [k+1, I]
        } else {
            let sel = Select::indexed(dev, &a.idx1.slice(0..k + 1));
            affine_gemv::swiglu_fused(dev, &ex.gate, &ex.up, sel, &a.x, false, &mut a.act, post)?; // [k+1, I]
        }
        let idx = a.idx1.slice(0..k + 1); // the k chosen, then E: the shared expert
        mark_grouped(dev, "moe.down", &ex.down, 1, k + 1, k + 1)?;
        let gate_logit = a.router.slice(e..e + 1);
        if unfused & UNFUSE_MIX == 0 {
            return affine_gemv::down_mix(dev, &ex.down, &idx, &a.act, &a.route_w, Some(&gate_logit), k, true, &mut a.x); // x += [H]
        }
        affine_gemv::gemv(dev, &ex.down, Select::indexed(dev, &idx), &a.act, true, &mut a.expert_out)?; // [k+1, H]
        let (y, shared_row) = (a.expert_out.slice(0..k * h), a.expert_out.slice(k * h..(k + 1) * h));
        dev.mark("moe.combine", 4 * ((k + 3) * h) as u64, 2 * ((k + 1) * h) as u64)?;
        return moe_dispatch::combine_with(dev, &y, &a.idx1.slice(0..k), None::<&CudaSlice<u32>>, &a.route_w, Some((&shared_row, &gate_logit)), 1, 1, k, h, &mut a.x, true);
    }
    dev.mark("norm", 12 * h as u64, 0)?;
    rmsnorm::rms_norm(dev, &a.x, post_norm, cfg.rms_norm_eps, 1, &mut a.normed)?;
    mark_linear(dev, "moe.router", router_plus.unwrap_or(router), 1)?;
    linear(dev, router_plus.unwrap_or(router), &a.normed, 1, &mut a.router)?; // [E (+1)]
    dev.mark("moe.route", 4 * (e + 2 * k) as u64, 0)?;
    moe_route::route(dev, &a.router, 1, e, k, cfg.norm_topk_prob, &mut a.idx1, &mut a.route_w)?; // idx1[..k]
    let slots = match shared {
        Shared::InStack { .. } => k + 1,
        _ => k,
    };
    let idx = a.idx1.slice(0..slots);
    let sel = Select::indexed(dev, &idx);
    mark_swiglu(dev, "moe.gate_up", &ex.gate, slots, 1)?;
    affine_gemv::swiglu(dev, &ex.gate, &ex.up, sel, &a.normed, false, &mut a.act)?; // [slots, I]
    mark_grouped(dev, "moe.down", &ex.down, 1, slots, slots)?;
    affine_gemv::gemv(dev, &ex.down, sel, &a.act, true, &mut a.expert_out)?; // [slots, H]
    match shared {
        Shared::Separate { mlp, .. } => {
            mark_swiglu(dev, "moe.shared", &mlp.gate, 1, 1)?;
            affine_gemv::swiglu(dev, &mlp.gate, &mlp.up, Select::matrix(0), &a.normed, false, &mut a.shared_act)?;
            mark_linear(dev, "moe.shared", &mlp.down, 1)?;
            affine_gemv::gemv(dev, &mlp.down, Select::matrix(0), &a.shared_act, false, &mut a.shared_out)?;
        }
        Shared::InStack { .. } | Shared::None => {}
    }
    if !fused_gate {
        if let Shared::Separate { gate, .. } | Shared::InStack { gate } = shared {
            mark_linear(dev, "moe.shared", gate, 1)?;
            linear(dev, gate, &a.normed, 1, &mut a.shared_gate)?;
        }
    }
    let gate_logit = if fused_gate { a.router.slice(e..e + 1) } else { a.shared_gate.slice(0..1) };
    let shared_row = match shared {
        Shared::InStack { .. } => a.expert_out.slice(k * h..(k + 1) * h),
        _ => a.shared_out.slice(0..h),
    };
    let shared_terms = match shared {
        Shared::None => None,
        _ => Some((&shared_row, &gate_logit)),
    };
    let y = a.expert_out.slice(0..k * h);
    dev.mark("moe.combine", 4 * ((k + 3) * h) as u64, 2 * ((k + 1) * h) as u64)?;
    moe_dispatch::combine_with(dev, &y, &a.idx1.slice(0..k), None::<&CudaSlice<u32>>, &a.route_w, shared_terms, 1, 1, k, h, &mut a.x, true) // x += [H]
}

/// The prefill GEMMs' options: `Precision::Half` (x and each dequantised weight in f16, f32 sums; the
/// 4-bit group-64 weights on the wgmma kernels, every other format Exact), or with
/// `LILY_PREFILL_PRECISION=exact` x as two bf16 planes with the exact codes (the reference runs),
/// `=bf16x` x rounded to bf16 once (read once; A/B runs of speed and parity: PERF.md, 2026-12-03
/// fourth session, has the scores that chose Half).
fn prefill_opts() -> gemm::Opts {
    static P: std::sync::OnceLock<gemm::Precision> = std::sync::OnceLock::new();
    let precision = *P.get_or_init(|| match std::env::var("LILY_PREFILL_PRECISION").as_deref() {
        Ok("bf16x") => gemm::Precision::Bf16x,
        Ok("exact") => gemm::Precision::Exact,
        _ => gemm::Precision::Half,
    });
    gemm::Opts { precision, ..Default::default() }
}

/// Whether a prompt chunk's MoE combine also does the residual add and the next RMSNorm (one kernel
/// instead of two, bit for bit the same results): the default; `LILY_MOE_NORM=0` keeps the norm kernel
/// (A/B runs; read once).
fn moe_norm_fused() -> bool {
    static ON: std::sync::OnceLock<bool> = std::sync::OnceLock::new();
    *ON.get_or_init(|| std::env::var("LILY_MOE_NORM").map(|v| v != "0").unwrap_or(true))
}

/// Whether a prompt chunk's MoE down projection writes its per-slot outputs in bf16 for the combine
/// (where the GEMM has that form: 4-bit group-64 experts in the half numerics): the default;
/// `LILY_MOE_OUT=f32` keeps them in f32 (A/B runs and reference runs; read once).
fn moe_out_bf16() -> bool {
    static ON: std::sync::OnceLock<bool> = std::sync::OnceLock::new();
    *ON.get_or_init(|| std::env::var("LILY_MOE_OUT").map(|v| v != "f32").unwrap_or(true))
}

/// The options of a prompt chunk's first GEMM on a.normed: `x_staged_only` when the MoE combine
/// before it wrote a.normed only as that GEMM's staged x (the flag is consumed).
fn normed_opts(a: &mut Activations) -> gemm::Opts {
    let staged = std::mem::take(&mut a.normed_staged);
    gemm::Opts { x_staged_only: staged, ..prefill_opts() }
}

/// Whether a layer's first prompt-chunk GEMM on a.normed takes x staged by its producer: the GDN
/// input projection (fused, or its qkv part) or the attention q projection, in the half numerics.
fn takes_staged_normed(m: &DevMixer) -> bool {
    let w = match m {
        DevMixer::Gdn(g) => g.in_fused.as_ref().unwrap_or(&g.qkv),
        DevMixer::Attn(at) => &at.q,
    };
    gemm::takes_prestaged_half(w, prefill_opts())
}

/// Whether a prompt chunk's MoE combine writes the next layer's staged x itself (where that layer's
/// first GEMM takes it): the default; `LILY_COMBINE=separate` writes the f32 normed rows for the GEMM
/// to stage (A/B runs; read once).
fn moe_combine_stages() -> bool {
    static ON: std::sync::OnceLock<bool> = std::sync::OnceLock::new();
    *ON.get_or_init(|| std::env::var("LILY_COMBINE").map(|v| v != "separate").unwrap_or(true))
}

/// Whether a prompt chunk's gated norm writes the output projection's staged x itself (where the
/// projection takes it): the default; `LILY_GDN_NORM=separate` writes its f32 output for the
/// projection to stage (A/B runs; read once).
fn gdn_norm_stages() -> bool {
    static ON: std::sync::OnceLock<bool> = std::sync::OnceLock::new();
    *ON.get_or_init(|| std::env::var("LILY_GDN_NORM").map(|v| v != "separate").unwrap_or(true))
}

/// What a prompt chunk's post-mixer norm writes as the MoE GEMMs' staged x (where they take it).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum PostNormStage {
    /// Nothing: the first GEMM of each numerics stages x (`LILY_POST_NORM=separate`).
    Neither,
    /// The half numerics' staging (the experts'); the router stages its own (`LILY_POST_NORM=half`).
    Half,
    /// Both, the router's folded staging beside the experts' (the default).
    HalfAndRouter,
}

/// [`PostNormStage`] from `LILY_POST_NORM` (A/B runs; read once).
fn post_norm_stage() -> PostNormStage {
    static S: std::sync::OnceLock<PostNormStage> = std::sync::OnceLock::new();
    *S.get_or_init(|| match std::env::var("LILY_POST_NORM").as_deref() {
        Ok("separate") => PostNormStage::Neither,
        Ok("half") => PostNormStage::Half,
        _ => PostNormStage::HalfAndRouter,
    })
}

/// [`prefill_opts`] for a GEMM whose x is the previous GEMM's, unwritten since (its staged copy is
/// reused where the staging buffer still holds it).
fn reuse_x() -> gemm::Opts {
    gemm::Opts { reuse_x: true, ..prefill_opts() }
}

/// How one decode token runs a GDN layer's input projection, conv, rule and gated norm.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum GdnStepForm {
    /// The conv, gates, rule and gated norm as separate kernels (`LILY_GDN_STEP=0`).
    Off,
    /// The step in one kernel after the input projection's GEMV (the default).
    Step,
    /// The input projection and the step in one kernel (`LILY_GDN_STEP=in`, opt-in: `ops::gdn_in_step`).
    InStep,
    /// The same with its copies after the PDL wait (`LILY_GDN_STEP=in_after`, A/B).
    InStepAfter,
}

/// How a decode token runs a GDN layer's projection and step (`LILY_GDN_STEP`, read once).
fn gdn_step_form() -> GdnStepForm {
    static FORM: std::sync::OnceLock<GdnStepForm> = std::sync::OnceLock::new();
    *FORM.get_or_init(|| match std::env::var("LILY_GDN_STEP").as_deref() {
        Ok("0") => GdnStepForm::Off,
        Ok("in") => GdnStepForm::InStep,
        Ok("in_after") => GdnStepForm::InStepAfter,
        _ => GdnStepForm::Step,
    })
}

/// How the one-kernel step issues its loads and stores (`gdn::StepLoads`): batched, or with
/// `LILY_GDN_STEP=when_needed` each load where first needed, `narrow` batched with 4-byte copies (A/B
/// runs; read once).
fn gdn_step_loads() -> gdn::StepLoads {
    static LOADS: std::sync::OnceLock<gdn::StepLoads> = std::sync::OnceLock::new();
    *LOADS.get_or_init(|| match std::env::var("LILY_GDN_STEP").as_deref() {
        Ok("when_needed") => gdn::StepLoads::WhenNeeded,
        Ok("narrow") => gdn::StepLoads::BatchedNarrow,
        _ => gdn::StepLoads::Batched,
    })
}

/// Two decode fusions are built and tested but off by default, because they measured slower in the
/// 4K graph (docs/PERF.md, 2026-12-03 fifth session: 2,038 µs without; `route` 2,189, `mix` 2,092 on
/// the tensor cores): `route`, the router's top-k in its GEMV's last block
/// (`affine_gemv::router_route`), and `mix`, the down projections with the combine
/// (`affine_gemv::down_mix`). `LILY_FUSE=route,mix` turns them on (benchmarks); without it
/// the router's selection and the combine run as kernels of their own.
const UNFUSE_ROUTE: u32 = 1;
const UNFUSE_MIX: u32 = 2;
/// The selection inside the gate/up GEMV's blocks (`affine_gemv::swiglu_select`, each block ranking
/// the router's logits itself) is the default (seventeenth session, H100 4K: the graph −28 to −66 µs,
/// decode +3%); `LILY_SELECT=0` runs the selection kernel instead (A/B runs; read once).
const UNFUSE_SELECT: u32 = 8;
/// The fused MoE decode kernel (`ops::moe_decode`) is opt-in: `LILY_MOE_DECODE=1` (it measured even
/// with the separate selection, GEMVs and combine in the 4K graph, docs/PERF.md 2026-12-04).
const UNFUSE_MOE: u32 = 4;

fn unfused_from_env() -> u32 {
    let v = std::env::var("LILY_FUSE").unwrap_or_default();
    let on = v.split(',').map(|w| match w.trim() {
        "route" => UNFUSE_ROUTE,
        "mix" => UNFUSE_MIX,
        _ => 0,
    }).fold(0, |a, b| a | b);
    let moe = if std::env::var("LILY_MOE_DECODE").is_ok_and(|v| v == "1") { 0 } else { UNFUSE_MOE };
    let select = match std::env::var("LILY_SELECT").as_deref() {
        Ok("0") => UNFUSE_SELECT,
        _ => 0,
    };
    ((UNFUSE_ROUTE | UNFUSE_MIX) & !on) | moe | select
}

/// Bytes per element of the KV caches (bf16).
const KV_BYTES: u64 = 2;

/// Marks a `y = x·Wᵀ` of T rows for the profile: its weights, x and y; 2·T·rows·cols operations.
fn mark_linear(dev: &Device, label: &'static str, w: &DeviceMatrix, t: usize) -> Result<()> {
    let (t, r, c) = (t as u64, w.rows as u64, w.cols as u64);
    dev.mark(label, w.bytes_per_matrix() as u64 + 4 * t * (r + c), 2 * t * r * c)
}

/// Marks a SwiGLU over `mats` matrices of each of gate and up, for T rows.
fn mark_swiglu(dev: &Device, label: &'static str, gate: &DeviceMatrix, mats: usize, t: usize) -> Result<()> {
    let (t, r, c, m) = (t as u64, gate.rows as u64, gate.cols as u64, mats as u64);
    dev.mark(label, 2 * m * gate.bytes_per_matrix() as u64 + 4 * t * (c + m * r), 4 * m * t * r * c)
}

/// Marks a grouped product reading `used` matrices (of `per` stacks) for `slots` rows in all (f32 in
/// and out).
fn mark_grouped(dev: &Device, label: &'static str, w: &DeviceMatrix, per: usize, used: usize, slots: usize) -> Result<()> {
    mark_grouped_out(dev, label, w, per, used, slots, 4)
}

/// [`mark_grouped`] with outputs of `y_bytes` bytes each.
fn mark_grouped_out(dev: &Device, label: &'static str, w: &DeviceMatrix, per: usize, used: usize, slots: usize, y_bytes: u64) -> Result<()> {
    let (n, r, c, p) = (slots as u64, w.rows as u64, w.cols as u64, per as u64);
    dev.mark(label, p * used as u64 * w.bytes_per_matrix() as u64 + n * (4 * p * c + y_bytes * r), 2 * p * n * r * c)
}

/// Marks the attention prep of T tokens (q/k norm, RoPE, cache append).
fn mark_attn_prep(dev: &Device, d: &attn_prep::AttnDims, t: usize) -> Result<()> {
    let (t, nh, kvh, hd) = (t as u64, d.nh as u64, d.kvh as u64, d.hd as u64);
    let g = if d.gated { 2 } else { 1 };
    dev.mark("attn.prep", 4 * t * (nh * hd * (2 * g) + 2 * kvh * hd) + KV_BYTES * t * 2 * kvh * hd, 0)
}

fn count_bytes(w: &ModelWeights) -> u64 {
    fn m(x: &lily_model::weights::Matrix) -> u64 {
        let n = (x.count * x.rows * x.cols) as u64;
        match &x.storage {
            lily_model::weights::Storage::Affine { params, .. } => n * params.bits as u64 / 8 + 4 * n / params.group_size as u64,
            lily_model::weights::Storage::Dense(_) => 2 * n,
        }
    }
    fn sw(s: &DenseMlpWeights) -> u64 {
        m(&s.gate_proj) + m(&s.up_proj) + m(&s.down_proj)
    }
    let mut total = m(&w.embed) + if w.config.tie_word_embeddings { 0 } else { m(w.lm_head()) };
    for l in &w.layers {
        total += match &l.mixer {
            Mixer::Linear(g) => m(&g.in_proj_qkv) + m(&g.in_proj_z) + m(&g.in_proj_b) + m(&g.in_proj_a) + m(&g.out_proj),
            Mixer::Full(a) => m(&a.q_proj) + m(&a.k_proj) + m(&a.v_proj) + m(&a.o_proj),
        };
        total += match &l.mlp {
            Mlp::Moe(x) => {
                m(&x.router)
                    + m(&x.gate_proj)
                    + m(&x.up_proj)
                    + m(&x.down_proj)
                    + x.shared.as_ref().map(sw).unwrap_or(0)
                    + x.shared_gate.as_ref().map(m).unwrap_or(0)
            }
            Mlp::Dense(d) => sw(d),
        };
    }
    total
}

impl Activations {
    fn new(dev: &Device, cfg: &ModelConfig, t: usize) -> Result<(Self, usize)> {
        let d = GdnDims::from_config(cfg);
        let h = cfg.hidden_size;
        let has_gdn = cfg.layer_types.contains(&LayerKind::LinearAttention);
        let has_attn = cfg.layer_types.contains(&LayerKind::FullAttention);
        let (c, vd, hv) = if has_gdn { (d.conv_dim(), d.value_dim(), d.num_v_heads) } else { (1, 1, 1) };
        let (nh, kvh, hd) = (cfg.num_attention_heads, cfg.num_key_value_heads, cfg.head_dim);
        let qg = if has_attn { nh * hd * if cfg.attn_output_gate { 2 } else { 1 } } else { 1 };
        let (q, kv) = if has_attn { (nh * hd, kvh * hd) } else { (1, 1) };
        let e = cfg.num_experts.max(1);
        let k = cfg.num_experts_per_tok.max(1);
        let inter = ((k + 1) * cfg.moe_intermediate_size).max(cfg.intermediate_size).max(1);
        let is = cfg.shared_expert_intermediate_size.max(1);
        let v = cfg.vocab_size;
        let mut bytes = 0usize;
        let mut f = |n: usize| -> Result<CudaSlice<f32>> {
            bytes += 4 * n.max(1);
            dev.zeros::<f32>(n.max(1))
        };
        let x = f(t * h)?;
        let normed = f(t * h)?;
        let mix = f(t * h)?;
        let mlp = f(t * h)?;
        let in_proj = f(t * (c + vd + 2 * hv))?;
        let qkv = f(t * c)?;
        let g = f(t * hv)?;
        let beta = f(t * hv)?;
        let rule = f(t * vd)?;
        let normed_rule = f(t * vd)?;
        let proj1 = f(qg + 2 * kv)?;
        let gdn_scratch = f(if has_gdn && t >= GDN_CHUNKED_MIN_TOKENS { gdn_chunked::scratch_len(&d, t) } else { 1 })?;
        let qg_b = f(t * qg)?;
        let kb = f(t * kv)?;
        let vb = f(t * kv)?;
        let qb = f(t * q)?;
        let gate = f(t * q)?;
        let att = f(t * q)?;
        let att_scratch = f(if has_attn { attention::scratch_len(nh, hd) } else { 1 })?;
        let router = f(t * (e + 1))?; // [T, E + 1]: the router fused with the shared expert's gate
        let route_w = f(t * k)?;
        let act = f(t * inter)?;
        let expert_out = f((t * k).max(k + 1) * h)?;
        let shared_act = f(t * is)?;
        let shared_out = f(t * h)?;
        let shared_gate = f(t)?;
        let logits = f(LOGIT_ROWS.min(t) * v)?;
        let pick_scratch = f(sample::scratch_len(v))?;
        let u = |n: usize| dev.zeros::<u32>(n.max(1));
        let ids = u(t)?;
        let idx = u(t * k)?;
        let mut idx1_host = vec![0u32; k + 1];
        idx1_host[k] = cfg.num_experts as u32;
        let idx1 = dev.upload(&idx1_host)?;
        let counts = u(moe_dispatch::plan_scratch_len(t, k, e))?;
        let offsets = u(e + 1)?;
        let rows = u(t * k)?;
        let slot_of = u(t * k)?;
        let pick_out = u(1)?;
        let route_counter = u(1)?;
        let moe_barrier = dev.zeros::<u64>(1)?;
        let pick_mask = u(v.div_ceil(32))?;
        let step_pos = dev.zeros::<i32>(2)?;
        bytes += 4 * (t + 3 * t * k + moe_dispatch::plan_scratch_len(t, k, e) + e + 2);
        let pick_edits = sample::EditBuffer::new(dev)?;
        Ok((
            Activations {
                ids,
                step_pos,
                x,
                normed,
                mix,
                mlp,
                in_proj,
                qkv,
                g,
                beta,
                rule,
                normed_rule,
                proj1,
                gdn_scratch,
                qg: qg_b,
                k: kb,
                v: vb,
                q: qb,
                gate,
                att,
                att_scratch,
                router,
                idx,
                idx1,
                route_w,
                counts,
                offsets,
                rows,
                slot_of,
                act,
                expert_out,
                shared_act,
                shared_out,
                shared_gate,
                logits,
                pick_scratch,
                pick_edits,
                pick_out,
                route_counter,
                moe_barrier,
                pick_mask,
                pick_mask_host: vec![0; v.div_ceil(32)],
                normed_staged: false,
            },
            bytes,
        ))
    }
}

impl Backend for CudaModel {
    type State = CudaState;

    fn name(&self) -> &'static str {
        "cuda"
    }
    fn config(&self) -> &ModelConfig {
        &self.cfg
    }
    fn new_state(&self) -> CudaState {
        // Allocation failure here means the GPU is out of memory: there is no way to go on.
        self.new_state_with(KV_STEP).expect("allocating a session's state on the GPU")
    }
    fn state_len(&self, state: &CudaState) -> usize {
        state.pos
    }
    fn state_bytes(&self, state: &CudaState) -> usize {
        state
            .layers
            .iter()
            .map(|l| match l {
                DevLayerState::Gdn { conv, ssm } => 4 * (conv.len() + ssm.len()),
                DevLayerState::Attn { k, v, .. } => 2 * (k.len() + v.len()),
            })
            .sum()
    }
    fn prefill_chunk(&self) -> usize {
        self.max_chunk
    }
    fn reserve(&mut self, state: &mut CudaState, positions: usize) -> Result<(), BackendError> {
        self.check(state, &[])?;
        self.grow_kv(state, positions).map_err(dev_err)
    }
    fn forward(&mut self, state: &mut CudaState, tokens: &[u32], logits: Logits) -> Result<Vec<f32>, BackendError> {
        self.check(state, tokens)?;
        if tokens.is_empty() {
            return Ok(Vec::new());
        }
        self.forward_impl(state, tokens, logits).map_err(dev_err)
    }
    fn picks_on_device(&self) -> bool {
        true
    }
    fn forward_pick(&mut self, state: &mut CudaState, tokens: &[u32], pick: &DevicePick) -> Result<u32, BackendError> {
        self.check(state, tokens)?;
        if tokens.is_empty() {
            return Err(BackendError::BadState("forward_pick needs at least one token".into()));
        }
        self.pick_impl(state, tokens, pick).map_err(dev_err)
    }
    fn masks_on_device(&self) -> bool {
        true
    }
    fn forward_pick_masked(&mut self, state: &mut CudaState, tokens: &[u32], pick: &DevicePick, fill: &mut MaskFill<'_>) -> Result<u32, BackendError> {
        self.check(state, tokens)?;
        if tokens.is_empty() {
            return Err(BackendError::BadState("forward_pick_masked needs at least one token".into()));
        }
        self.pick_masked_impl(state, tokens, pick, fill)
    }
}

//! Opening a model: picks the backend (CUDA when built in and a GPU is there, else the CPU), loads
//! the checkpoint, and explains what went wrong in words a user can act on. [`LoadedModel`] is itself
//! a [`Backend`] (it forwards to the one it holds), so the server and the CLI are written once.

use std::path::{Path, PathBuf};
use std::sync::Arc;

use lily_cpu::CpuModel;
use lily_model::{Backend, BackendError, DevicePick, LoadOptions, Logits, MaskFill, ModelConfig, ModelWeights};

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum BackendKind {
    /// CUDA if this build has it and a GPU answers, else the CPU.
    Auto,
    Cpu,
    Cuda,
}

impl std::str::FromStr for BackendKind {
    type Err = String;
    fn from_str(s: &str) -> Result<Self, String> {
        match s {
            "auto" => Ok(BackendKind::Auto),
            "cpu" => Ok(BackendKind::Cpu),
            "cuda" => Ok(BackendKind::Cuda),
            _ => Err(format!("unknown backend `{s}` (auto, cpu or cuda)")),
        }
    }
}

#[derive(Debug, thiserror::Error)]
pub enum EngineError {
    #[error(transparent)]
    Model(#[from] lily_model::Error),
    #[error(transparent)]
    Backend(#[from] lily_model::BackendError),
    #[error("the CUDA backend is not available: {0}")]
    NoCuda(String),
}

/// CUDA: the default of [`OpenOptions::max_chunk`], tokens one prefill pass runs at once. 8192 measured
/// 2–5% faster than 4096 on 8K–128K prompts and 16384 no faster (docs/PERF.md, 2026-12-05 twelfth
/// session; the third session had found 4096 10% faster than 2048); its activations take ~3.5 GB on
/// the 35B model (4096: 1.74 GB), so a GPU with little memory to spare wants `--max-chunk 4096`.
pub const DEFAULT_MAX_CHUNK: usize = 8192;
#[cfg(feature = "cuda")]
const _: () = assert!(DEFAULT_MAX_CHUNK == lily_cuda::model::DEFAULT_MAX_CHUNK);

/// How to open a checkpoint.
#[derive(Clone, Debug, Default)]
pub struct OpenOptions {
    pub load: LoadOptions,
    /// CUDA: load kernels from `<dir>/<stem>.sm_90a.cubin` where present (the GPU-machine dev loop).
    pub kernel_dir: Option<PathBuf>,
    /// CUDA: the most tokens one forward pass runs at once (0: [`DEFAULT_MAX_CHUNK`]).
    pub max_chunk: usize,
    /// Show a progress bar and the memory report on stderr while loading onto a GPU.
    pub progress: bool,
}

/// A model opened on one backend.
pub enum LoadedModel {
    Cpu(CpuModel),
    #[cfg(feature = "cuda")]
    Cuda(Box<lily_cuda::model::CudaModel>),
}

/// A session's state on whichever backend holds the model.
#[derive(Clone)]
pub enum LoadedState {
    Cpu(lily_cpu::State),
    #[cfg(feature = "cuda")]
    Cuda(lily_cuda::model::CudaState),
}

#[cfg_attr(not(feature = "cuda"), allow(dead_code))]
fn wrong_state() -> BackendError {
    BackendError::BadState("the state belongs to another backend".into())
}

impl Backend for LoadedModel {
    type State = LoadedState;

    fn name(&self) -> &'static str {
        match self {
            LoadedModel::Cpu(m) => m.name(),
            #[cfg(feature = "cuda")]
            LoadedModel::Cuda(m) => m.name(),
        }
    }
    fn config(&self) -> &ModelConfig {
        match self {
            LoadedModel::Cpu(m) => m.config(),
            #[cfg(feature = "cuda")]
            LoadedModel::Cuda(m) => m.config(),
        }
    }
    fn new_state(&self) -> LoadedState {
        match self {
            LoadedModel::Cpu(m) => LoadedState::Cpu(m.new_state()),
            #[cfg(feature = "cuda")]
            LoadedModel::Cuda(m) => LoadedState::Cuda(m.new_state()),
        }
    }
    fn state_len(&self, state: &LoadedState) -> usize {
        match (self, state) {
            (LoadedModel::Cpu(m), LoadedState::Cpu(s)) => m.state_len(s),
            #[cfg(feature = "cuda")]
            (LoadedModel::Cuda(m), LoadedState::Cuda(s)) => m.state_len(s),
            #[cfg(feature = "cuda")]
            _ => 0,
        }
    }
    fn state_bytes(&self, state: &LoadedState) -> usize {
        match (self, state) {
            (LoadedModel::Cpu(m), LoadedState::Cpu(s)) => m.state_bytes(s),
            #[cfg(feature = "cuda")]
            (LoadedModel::Cuda(m), LoadedState::Cuda(s)) => m.state_bytes(s),
            #[cfg(feature = "cuda")]
            _ => 0,
        }
    }
    fn reserve(&mut self, state: &mut LoadedState, positions: usize) -> Result<(), BackendError> {
        match (self, state) {
            (LoadedModel::Cpu(m), LoadedState::Cpu(s)) => m.reserve(s, positions),
            #[cfg(feature = "cuda")]
            (LoadedModel::Cuda(m), LoadedState::Cuda(s)) => m.reserve(s, positions),
            #[cfg(feature = "cuda")]
            _ => Err(wrong_state()),
        }
    }
    fn prefill_chunk(&self) -> usize {
        match self {
            LoadedModel::Cpu(m) => m.prefill_chunk(),
            #[cfg(feature = "cuda")]
            LoadedModel::Cuda(m) => m.prefill_chunk(),
        }
    }
    fn forward(&mut self, state: &mut LoadedState, tokens: &[u32], logits: Logits) -> Result<Vec<f32>, BackendError> {
        match (self, state) {
            (LoadedModel::Cpu(m), LoadedState::Cpu(s)) => m.forward(s, tokens, logits),
            #[cfg(feature = "cuda")]
            (LoadedModel::Cuda(m), LoadedState::Cuda(s)) => m.forward(s, tokens, logits),
            #[cfg(feature = "cuda")]
            _ => Err(wrong_state()),
        }
    }
    fn picks_on_device(&self) -> bool {
        match self {
            LoadedModel::Cpu(m) => m.picks_on_device(),
            #[cfg(feature = "cuda")]
            LoadedModel::Cuda(m) => m.picks_on_device(),
        }
    }
    fn forward_pick(&mut self, state: &mut LoadedState, tokens: &[u32], pick: &DevicePick) -> Result<u32, BackendError> {
        match (self, state) {
            (LoadedModel::Cpu(m), LoadedState::Cpu(s)) => m.forward_pick(s, tokens, pick),
            #[cfg(feature = "cuda")]
            (LoadedModel::Cuda(m), LoadedState::Cuda(s)) => m.forward_pick(s, tokens, pick),
            #[cfg(feature = "cuda")]
            _ => Err(wrong_state()),
        }
    }
    fn masks_on_device(&self) -> bool {
        match self {
            LoadedModel::Cpu(m) => m.masks_on_device(),
            #[cfg(feature = "cuda")]
            LoadedModel::Cuda(m) => m.masks_on_device(),
        }
    }
    fn forward_pick_masked(
        &mut self,
        state: &mut LoadedState,
        tokens: &[u32],
        pick: &DevicePick,
        fill: &mut MaskFill<'_>,
    ) -> Result<u32, BackendError> {
        match (self, state) {
            (LoadedModel::Cpu(m), LoadedState::Cpu(s)) => m.forward_pick_masked(s, tokens, pick, fill),
            #[cfg(feature = "cuda")]
            (LoadedModel::Cuda(m), LoadedState::Cuda(s)) => m.forward_pick_masked(s, tokens, pick, fill),
            #[cfg(feature = "cuda")]
            _ => Err(wrong_state()),
        }
    }
}

/// Whether `kind` resolves to CUDA here: `Cuda` always (and fails later if it cannot), `Auto` when
/// this build has CUDA and GPU 0 answers.
fn wants_cuda(kind: BackendKind) -> bool {
    match kind {
        BackendKind::Cpu => false,
        BackendKind::Cuda => true,
        #[cfg(feature = "cuda")]
        BackendKind::Auto => !lily_cuda::kernel_names().is_empty() && lily_cuda::probe(0).is_ok(),
        #[cfg(not(feature = "cuda"))]
        BackendKind::Auto => false,
    }
}

/// Loads `dir` on the backend `kind` asks for.
pub fn open(dir: &Path, kind: BackendKind, opts: &OpenOptions) -> Result<LoadedModel, EngineError> {
    if wants_cuda(kind) {
        return open_cuda(dir, opts);
    }
    let w = ModelWeights::load(dir, &opts.load)?;
    Ok(LoadedModel::Cpu(CpuModel::new(Arc::new(w))))
}

#[cfg(not(feature = "cuda"))]
fn open_cuda(_dir: &Path, _opts: &OpenOptions) -> Result<LoadedModel, EngineError> {
    Err(EngineError::NoCuda("this build of lily has no CUDA support (build with `--features cuda`)".into()))
}

#[cfg(feature = "cuda")]
fn open_cuda(dir: &Path, opts: &OpenOptions) -> Result<LoadedModel, EngineError> {
    use indicatif::{ProgressBar, ProgressStyle};
    lily_cuda::probe(0).map_err(|e| EngineError::NoCuda(e.to_string()))?;
    let w = ModelWeights::load(dir, &opts.load)?;
    let copts = lily_cuda::model::CudaOptions {
        ordinal: 0,
        kernel_dir: opts.kernel_dir.clone(),
        max_chunk: if opts.max_chunk == 0 { lily_cuda::model::CudaOptions::default().max_chunk } else { opts.max_chunk },
    };
    let bar = if opts.progress { ProgressBar::new(0) } else { ProgressBar::hidden() };
    bar.set_style(
        ProgressStyle::with_template("uploading weights {bar:30} {bytes}/{total_bytes} {binary_bytes_per_sec} {eta}")
            .unwrap_or_else(|_| ProgressStyle::default_bar()),
    );
    let mut progress = |done: u64, total: u64| {
        bar.set_length(total);
        bar.set_position(done);
    };
    let m = lily_cuda::model::CudaModel::load(&w, &copts, &mut progress).map_err(|e| EngineError::NoCuda(e.to_string()))?;
    bar.finish_and_clear();
    drop(w);
    if opts.progress {
        let r = m.report();
        let gb = |b: usize| b as f64 / 1e9;
        eprintln!(
            "{}: weights {:.2} GB uploaded in {:.1} s ({:.1} GB/s); activations {:.2} GB for chunks of {} tokens; \
             a session holds {:.1} MB + {:.1} KB per token of context",
            r.device,
            gb(r.weight_bytes),
            r.upload_seconds,
            gb(r.weight_bytes) / r.upload_seconds.max(1e-9),
            gb(r.activation_bytes),
            m.max_chunk(),
            r.state_bytes_fixed as f64 / 1e6,
            r.state_bytes_per_token as f64 / 1e3,
        );
    }
    Ok(LoadedModel::Cuda(Box::new(m)))
}

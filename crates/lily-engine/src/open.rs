//! Opening a model: picks the backend (CUDA when built in and a GPU is there, else the CPU), loads
//! the checkpoint, and explains what went wrong in words a user can act on.

use std::path::Path;
use std::sync::Arc;

use lily_cpu::CpuModel;
use lily_model::{LoadOptions, ModelWeights};

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

/// A model opened on one backend.
pub enum LoadedModel {
    Cpu(CpuModel),
}

impl LoadedModel {
    pub fn backend_name(&self) -> &'static str {
        match self {
            LoadedModel::Cpu(_) => "cpu",
        }
    }
    pub fn config(&self) -> &lily_model::ModelConfig {
        match self {
            LoadedModel::Cpu(m) => &m.weights().config,
        }
    }
}

/// Loads `dir` on the backend `kind` asks for.
pub fn open(dir: &Path, kind: BackendKind, opts: &LoadOptions) -> Result<LoadedModel, EngineError> {
    match kind {
        BackendKind::Cuda => Err(EngineError::NoCuda(
            "the CUDA backend's kernels are not written yet in this version; use --backend cpu".into(),
        )),
        BackendKind::Auto | BackendKind::Cpu => {
            let w = ModelWeights::load(dir, opts)?;
            Ok(LoadedModel::Cpu(CpuModel::new(Arc::new(w))))
        }
    }
}

//! Typed errors for configs and checkpoints. Every variant names the file, and where there is one the
//! key or tensor, so that the message alone tells a user what is wrong with their checkpoint.

use std::path::PathBuf;

pub type Result<T, E = Error> = std::result::Result<T, E>;

#[derive(Debug, thiserror::Error)]
pub enum Error {
    #[error("{path}: {source}")]
    Io { path: PathBuf, source: std::io::Error },

    #[error("{path}: not valid JSON: {source}")]
    Json { path: PathBuf, source: serde_json::Error },

    #[error("{path}: key `{key}`: {msg}")]
    ConfigKey { path: PathBuf, key: String, msg: String },

    #[error("{path}: not a valid safetensors file: {msg}")]
    Safetensors { path: PathBuf, msg: String },

    #[error("{dir}: tensor `{name}` is missing from the checkpoint")]
    MissingTensor { dir: PathBuf, name: String },

    #[error("{path}: tensor `{name}` has shape {found:?}, expected {expected}")]
    TensorShape { path: PathBuf, name: String, expected: String, found: Vec<usize> },

    #[error("{path}: tensor `{name}` has dtype {found}, expected {expected}")]
    TensorDtype { path: PathBuf, name: String, expected: String, found: String },

    #[error("{path}: tensor `{name}`: {msg}")]
    Tensor { path: PathBuf, name: String, msg: String },

    #[error("{0}")]
    Invalid(String),
}

impl Error {
    pub(crate) fn io(path: impl Into<PathBuf>, source: std::io::Error) -> Self {
        Error::Io { path: path.into(), source }
    }
    pub(crate) fn key(path: impl Into<PathBuf>, key: impl Into<String>, msg: impl Into<String>) -> Self {
        Error::ConfigKey { path: path.into(), key: key.into(), msg: msg.into() }
    }
}

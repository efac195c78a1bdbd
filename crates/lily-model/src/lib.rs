//! The Qwen3.5/3.6 MoE model family (`qwen3_5_moe`) as data: its configuration, its checkpoints
//! (MLX affine-quantised and Hugging Face bf16 safetensors, memory-mapped), the affine quantisation
//! format and algorithm, and the typed weights every backend computes with.
//!
//! Nothing here computes a forward pass: backends (`lily-cpu`, `lily-cuda`) take [`ModelWeights`].

pub mod affine;
pub mod backend;
pub mod buf;
pub mod checkpoint;
pub mod config;
pub mod error;
pub mod shapes;
pub mod synth;
mod synth_tokenizer;
pub mod weights;

pub use config::{GenerationConfig, LayerKind, ModelConfig, QuantizationConfig};
pub use backend::{Backend, BackendError, DevicePick, Logits, MaskFill};
pub use error::{Error, Result};
pub use shapes::GdnDims;
pub use weights::{LoadOptions, ModelWeights};

//! The CPU backend: the whole Qwen3.5/3.6 MoE forward pass in f32 on the quantised weights, using
//! every core through rayon. It is the reference every other backend is tested against.
//!
//! - `linear`: products with stored (affine-quantised or dense) matrices, split over the cores
//! - `kernels`: their inner loops (row expansion, fused one-token product, rows × tokens tiles),
//!   AVX2 when the CPU has it, else portable, the same bits either way
//! - `norm`: RMSNorm and activations
//! - `gdn`: Gated DeltaNet (conv, gates, delta rule step by step and chunked, gated norm)
//! - `attention`: gated full attention with partial RoPE and a KV cache
//! - `moe`: router, experts, shared expert
//! - `model`: the layer stack, the session state, and the [`lily_model::Backend`] impl
//! - `workspace`: reused buffers for a forward call's activations

pub mod attention;
pub mod gdn;
pub mod kernels;
pub mod linear;
pub mod model;
pub mod moe;
pub mod norm;
pub mod workspace;

pub use model::{CpuModel, LayerState, State, Trace};

//! The CUDA backend (built with `--features cuda`). Kernels live in `kernels/*.cu`, one family per
//! file, compiled by `build.rs` to sm_90a cubins that are embedded in the binary; the CUDA driver is
//! loaded at run time (cudarc, dynamic loading), so a binary built on a machine without CUDA runs on
//! the GPU machine, and on a machine without a GPU says so instead of crashing.
//!
//! # What exists
//! - [`Device`] (`device.rs`): opens GPU `ordinal` on one non-default stream, with cudarc's per-buffer
//!   event tracking switched off before any allocation (we synchronise by hand, and CUDA-graph capture
//!   needs it off), and loads every embedded cubin once, resolving every kernel the ops use by name
//!   (a missing kernel fails at open, not at first use). `Device::open_with_kernel_dir` loads
//!   `<dir>/<stem>.sm_90a.cubin` in place of the embedded bytes where such a file exists (the dev loop on
//!   the GPU machine: edit a `.cu`, build it there with its own nvcc, rerun the same binary).
//! - [`weights`]: [`weights::DeviceMatrix`], a `lily_model::weights::Matrix` on the device, uploaded
//!   through two pinned staging buffers ([`weights::Uploader`]); `upload_concat` joins matrices that share
//!   a format (the decode-only fused projections, the shared expert appended to the expert stacks).
//! - [`ops`], one typed wrapper per kernel file, each held to `lily-cpu` (or an f64 loop) by its own test
//!   file `tests/gpu_<file>.rs` (with an `#[ignore]` timing test): `affine_gemv` (decode GEMV, indexed
//!   expert stacks, fused SwiGLU), `gemm` (prefill tensor-core GEMM: plain, SwiGLU, grouped by expert;
//!   near-f32 by default), `rmsnorm`, `embed`, `gdn` (conv + q/k norm + gates, recurrent rule, gated
//!   norm), `gdn_chunked` (the chunked rule), `attn_prep` (q/k norm, partial RoPE, cache append),
//!   `attn_prefill` (causal flash attention), `attention` (split-KV decode), `moe_route`,
//!   `moe_dispatch` (plan and combine), `sample` (the next token, as `lily_sampler` chooses it), `util`.
//! - [`model::CudaModel`]: the whole forward pass as a `lily_model::Backend` (see `model.rs`), tested
//!   against the CPU backend on the fixtures in `tests/gpu_model.rs`.
//! - `tools/stage_device.sh` and `tools/gpu_suite.sh`: build here, run every GPU test, the full-size
//!   parity and `lily bench` on the GPU machine in one call.
//!
//! Measured on the H200: docs/PERF.md (decode 329 tok/s and prefill 7.9K tok/s at 4K on the full-size
//! random checkpoint at the time of writing).

#[derive(Debug, thiserror::Error)]
pub enum CudaError {
    #[error("this build of lily has no CUDA support (rebuild with `--features cuda`)")]
    NotBuilt,
    #[error("no CUDA driver found (libcuda.so): is this a machine with an NVIDIA GPU and its driver?")]
    NoDriver,
    #[error("CUDA: {0}")]
    Driver(String),
    #[error("kernel module {module}: {msg}")]
    Kernel { module: String, msg: String },
    #[error("{0}")]
    Shape(String),
}

#[cfg(feature = "cuda")]
impl From<cudarc::driver::DriverError> for CudaError {
    fn from(e: cudarc::driver::DriverError) -> Self {
        CudaError::Driver(e.to_string())
    }
}

pub type Result<T, E = CudaError> = std::result::Result<T, E>;

/// What `probe` found.
#[derive(Clone, Debug)]
pub struct DeviceInfo {
    pub ordinal: usize,
    pub name: String,
    pub compute_capability: (i32, i32),
    pub total_memory: usize,
}

/// Kernel files compiled into this binary.
pub fn kernel_names() -> Vec<&'static str> {
    #[cfg(feature = "cuda")]
    {
        kernels::CUBINS.iter().map(|(n, _)| *n).collect()
    }
    #[cfg(not(feature = "cuda"))]
    {
        Vec::new()
    }
}

/// The embedded cubins, `(file stem, bytes)` (used by tests of the `--kernel-dir` override).
#[cfg(feature = "cuda")]
pub fn embedded_cubins() -> &'static [(&'static str, &'static [u8])] {
    kernels::CUBINS
}

#[cfg(feature = "cuda")]
mod kernels {
    include!(concat!(env!("OUT_DIR"), "/cubins.rs"));
}

/// The driver binding, re-exported so callers name the same buffer types (`CudaSlice`, `CudaView`).
#[cfg(feature = "cuda")]
pub use cudarc;
#[cfg(feature = "cuda")]
mod device;
#[cfg(feature = "cuda")]
pub use device::{Device, KernelSource};
#[cfg(feature = "cuda")]
pub mod model;
#[cfg(feature = "cuda")]
pub mod ops;
#[cfg(feature = "cuda")]
pub mod profile;
#[cfg(feature = "cuda")]
pub mod weights;

/// Looks for GPU `ordinal` without panicking when the driver is absent.
pub fn probe(ordinal: usize) -> Result<DeviceInfo, CudaError> {
    #[cfg(feature = "cuda")]
    {
        use cudarc::driver::{sys, CudaContext};
        // SAFETY: only dlopens the driver library and reports whether it is there.
        if !unsafe { sys::is_culib_present() } {
            return Err(CudaError::NoDriver);
        }
        let ctx = CudaContext::new(ordinal)?;
        device::describe(&ctx, ordinal)
    }
    #[cfg(not(feature = "cuda"))]
    {
        let _ = ordinal;
        Err(CudaError::NotBuilt)
    }
}

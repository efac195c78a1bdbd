//! Typed launch wrappers, one module per kernel file (`kernels/<family>.cu` ↔ `ops/<family>.rs`).
//!
//! Every wrapper checks shapes and lengths on the host, builds the kernel's `#[repr(C)]` parameter
//! struct (which must match the `struct ...Params` at the top of the `.cu` file field for field), and
//! launches on the device's stream. Nothing synchronises: results are ready after
//! [`crate::Device::synchronize`] or a download.

use cudarc::driver::{DevicePtr, DevicePtrMut, DeviceRepr, LaunchConfig, PushKernelArg};

use crate::{CudaError, Device, Result};

pub mod affine_gemv;
pub mod affine_gemv_tc;
pub mod attention;
pub mod attn_prefill;
pub mod attn_prep;
pub mod embed;
pub mod gdn;
pub mod gdn_chunked;
pub mod gdn_in_step;
pub mod gemv_chain;
pub mod gemm;
pub mod gemm_wgmma;
pub mod moe_decode;
pub mod moe_dispatch;
pub mod moe_route;
pub mod rmsnorm;
pub mod sample;
pub mod util;

/// Every kernel the ops use, by module (file stem): resolved once when the device opens.
pub(crate) const REGISTRY: &[(&str, &[&str])] = &[
    ("affine_gemv", affine_gemv::KERNELS),
    ("affine_gemv_tc", affine_gemv_tc::KERNELS),
    ("attention", attention::KERNELS),
    ("attn_prefill", attn_prefill::KERNELS),
    ("attn_prep", attn_prep::KERNELS),
    ("embed", embed::KERNELS),
    ("gdn", gdn::KERNELS),
    ("gdn_chunked", gdn_chunked::KERNELS),
    ("gdn_in_step", gdn_in_step::KERNELS),
    ("gemv_chain", gemv_chain::KERNELS),
    ("gemm", gemm::KERNELS),
    ("gemm_wgmma", gemm_wgmma::KERNELS),
    ("moe_decode", moe_decode::KERNELS),
    ("moe_dispatch", moe_dispatch::KERNELS),
    ("moe_route", moe_route::KERNELS),
    ("rmsnorm", rmsnorm::KERNELS),
    ("sample", sample::KERNELS),
    ("util", util::KERNELS),
];

/// One-time function attributes (called by `Device::open`).
pub(crate) fn configure(dev: &Device) -> Result<()> {
    affine_gemv::configure(dev)?;
    affine_gemv_tc::configure(dev)?;
    gemm::configure(dev)?;
    gemm_wgmma::configure(dev)?;
    attention::configure(dev)?;
    gdn_chunked::configure(dev)?;
    gdn_in_step::configure(dev)?;
    moe_decode::configure(dev)?;
    gemv_chain::configure(dev)?;
    attn_prefill::configure(dev)?;
    if carveout_max() {
        prefer_max_smem(dev)?;
    }
    Ok(())
}

/// `LILY_CARVEOUT=max` (read once; A/B runs): every kernel prefers the largest shared-memory carve-out.
/// An SM runs a block of a kernel beside blocks of the one before it (PDL) only if both fit the SM's
/// current split of shared memory and L1, which the driver sets per kernel from its needs; a kernel
/// asking for a small split can keep the next one's large block (`gdn_in_step`'s ~170 KB) off the SM
/// until its blocks drain (the seventh session's staged-weights GEMV found that cost).
fn carveout_max() -> bool {
    static ON: std::sync::OnceLock<bool> = std::sync::OnceLock::new();
    *ON.get_or_init(|| std::env::var("LILY_CARVEOUT").is_ok_and(|v| v == "max"))
}

fn prefer_max_smem(dev: &Device) -> Result<()> {
    use cudarc::driver::sys::CUfunction_attribute as A;
    for (_, names) in REGISTRY {
        for name in names.iter() {
            dev.function(name)?.set_attribute(A::CU_FUNC_ATTRIBUTE_PREFERRED_SHARED_MEMORY_CARVEOUT, 100)?;
        }
    }
    Ok(())
}

/// Lets each kernel in `names` use the device's opt-in shared memory (the limit covers static and
/// dynamic shared memory together: the dynamic part may take what its static part leaves).
pub(crate) fn allow_optin_smem<'a>(dev: &Device, names: impl IntoIterator<Item = &'a &'static str>) -> Result<()> {
    use cudarc::driver::sys::CUfunction_attribute as A;
    for name in names {
        let f = dev.function(name)?;
        let fixed = f.get_attribute(A::CU_FUNC_ATTRIBUTE_SHARED_SIZE_BYTES)?;
        f.set_attribute(A::CU_FUNC_ATTRIBUTE_MAX_DYNAMIC_SHARED_SIZE_BYTES, dev.max_smem_optin() as i32 - fixed)?;
    }
    Ok(())
}

/// A position or a length a kernel takes: known on the host at launch, or read from device memory
/// when the kernel runs (so a captured decode graph replays at each step's value).
#[derive(Clone, Copy)]
pub enum Scalar<'a> {
    Host(usize),
    /// `at[0]` holds the value when the kernel runs; `max` bounds it (the buffers are sized for it).
    Device { at: &'a cudarc::driver::CudaView<'a, i32>, max: usize },
}

impl Scalar<'_> {
    /// (the host value or the device value's bound, the device address or 0).
    pub(crate) fn split(self, dev: &Device, what: &str) -> Result<(usize, u64)> {
        match self {
            Scalar::Host(v) => Ok((v, 0)),
            Scalar::Device { at, max } => Ok((max, addr(dev, at, 1, what)?)),
        }
    }
}

/// The element type of an activation buffer some ops write or read in either of two widths: f32, or
/// bf16 carried as its bits (`u16`): the MoE down projection's per-slot outputs and the combine that
/// reads them ([`gemm::grouped_gemm_with`], [`moe_dispatch::combine_with`]).
pub trait Act: DeviceRepr + Copy {
    /// Whether the buffer holds bf16 bits.
    const BF16: bool;
}
impl Act for f32 {
    const BF16: bool = false;
}
impl Act for u16 {
    const BF16: bool = true;
}

/// The device address of `s`, which must hold at least `need` elements.
pub(crate) fn addr<T, S: DevicePtr<T>>(dev: &Device, s: &S, need: usize, what: &str) -> Result<u64> {
    if s.len() < need {
        return Err(CudaError::Shape(format!("{what}: buffer of {} elements, {need} needed", s.len())));
    }
    let (p, _guard) = s.device_ptr(dev.stream());
    Ok(p)
}

/// The device address of `s` for writing, which must hold at least `need` elements.
pub(crate) fn addr_mut<T, S: DevicePtrMut<T>>(dev: &Device, s: &mut S, need: usize, what: &str) -> Result<u64> {
    if s.len() < need {
        return Err(CudaError::Shape(format!("{what}: buffer of {} elements, {need} needed", s.len())));
    }
    let (p, _guard) = s.device_ptr_mut(dev.stream());
    Ok(p)
}

/// Launches `name` with one by-value parameter struct; with programmatic dependent launch when the
/// device has it on ([`Device::set_pdl`]; every kernel in `kernels/` honours it, see `kernels/pdl.cuh`).
///
/// Safety contract (upheld by each wrapper): `P` is the kernel's parameter struct, and every address
/// in it points to a live buffer of the size the kernel will touch.
pub(crate) fn launch<P: DeviceRepr>(dev: &Device, name: &'static str, cfg: LaunchConfig, params: &P) -> Result<()> {
    let f = dev.function(name)?;
    if dev.knocked_out() {
        return Ok(());
    }
    if dev.pdl() {
        return launch_programmatic(dev, f, cfg, params);
    }
    let mut b = dev.stream().launch_builder(f);
    b.arg(params);
    // SAFETY: see above.
    unsafe { b.launch(cfg) }?;
    Ok(())
}

/// `cuLaunchKernelEx` with the programmatic-stream-serialization attribute: the kernel may be placed
/// while its predecessor on the stream runs, and waits for it in `griddepcontrol.wait`.
fn launch_programmatic<P: DeviceRepr>(dev: &Device, f: &cudarc::driver::CudaFunction, cfg: LaunchConfig, params: &P) -> Result<()> {
    launch_ex(dev, f, cfg, true, 1, params)
}

/// [`launch`] in thread-block clusters of `cluster` consecutive blocks along x (grid x must be a
/// multiple of it), with programmatic dependent launch when the device has it on.
pub(crate) fn launch_cluster<P: DeviceRepr>(dev: &Device, name: &'static str, cfg: LaunchConfig, cluster: u32, params: &P) -> Result<()> {
    if cluster == 0 || !cfg.grid_dim.0.is_multiple_of(cluster) {
        return Err(CudaError::Shape(format!("{name}: a grid of {} blocks in clusters of {cluster}", cfg.grid_dim.0)));
    }
    let f = dev.function(name)?;
    if dev.knocked_out() {
        return Ok(());
    }
    launch_ex(dev, f, cfg, dev.pdl(), cluster, params)
}

/// `cuLaunchKernelEx` with the chosen attributes: programmatic stream serialization, a cluster size.
fn launch_ex<P: DeviceRepr>(dev: &Device, f: &cudarc::driver::CudaFunction, cfg: LaunchConfig, pdl: bool, cluster: u32, params: &P) -> Result<()> {
    use cudarc::driver::sys;
    // SAFETY: zeroed attributes are valid values of this plain C union/struct; ids and values are set below.
    let mut attrs: [sys::CUlaunchAttribute; 2] = unsafe { std::mem::zeroed() };
    let mut n = 0;
    if pdl {
        attrs[n].id = sys::CUlaunchAttributeID::CU_LAUNCH_ATTRIBUTE_PROGRAMMATIC_STREAM_SERIALIZATION;
        attrs[n].value.programmaticStreamSerializationAllowed = 1;
        n += 1;
    }
    if cluster > 1 {
        attrs[n].id = sys::CUlaunchAttributeID::CU_LAUNCH_ATTRIBUTE_CLUSTER_DIMENSION;
        attrs[n].value.clusterDim.x = cluster;
        attrs[n].value.clusterDim.y = 1;
        attrs[n].value.clusterDim.z = 1;
        n += 1;
    }
    let lc = sys::CUlaunchConfig {
        gridDimX: cfg.grid_dim.0,
        gridDimY: cfg.grid_dim.1,
        gridDimZ: cfg.grid_dim.2,
        blockDimX: cfg.block_dim.0,
        blockDimY: cfg.block_dim.1,
        blockDimZ: cfg.block_dim.2,
        sharedMemBytes: cfg.shared_mem_bytes,
        hStream: dev.stream().cu_stream(),
        attrs: attrs.as_mut_ptr(),
        numAttrs: n as u32,
    };
    let mut args = [params as *const P as *mut std::ffi::c_void];
    dev.context().bind_to_thread()?;
    // SAFETY: the kernel takes exactly one parameter, the struct `P` (see `launch`); `args` points to it
    // for the duration of the call, which copies it.
    unsafe { sys::cuLaunchKernelEx(&lc, f.cu_function(), args.as_mut_ptr(), std::ptr::null_mut()) }.result()?;
    Ok(())
}

//! One GPU, one stream, every kernel loaded once.
//!
//! Order at open matters: the context is created, cudarc's event tracking is switched off *before any
//! allocation* (it would otherwise attach read/write events to every buffer and make each launch wait
//! on them, which costs time and breaks CUDA-graph capture), then the one non-default stream is made.
//! All work goes on that stream, in order; the host synchronises explicitly.

use std::collections::HashMap;
use std::path::{Path, PathBuf};
use std::sync::{Arc, Mutex};

use cudarc::driver::sys::CUdevice_attribute as Attr;
use cudarc::driver::{
    CudaContext, CudaFunction, CudaModule, CudaSlice, CudaStream, DevicePtr, DevicePtrMut, DeviceRepr, ValidAsZeroBits,
};
use cudarc::nvrtc::Ptx;

use crate::{kernels, ops, CudaError, DeviceInfo, Result};

/// Where a kernel module was loaded from.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum KernelSource {
    Embedded,
    File(PathBuf),
}

pub struct Device {
    ctx: Arc<CudaContext>,
    stream: Arc<CudaStream>,
    info: DeviceInfo,
    sm_count: u32,
    max_smem_optin: u32,
    modules: Vec<(String, KernelSource, Arc<CudaModule>)>,
    functions: HashMap<&'static str, CudaFunction>,
    /// (kernel, threads per block, dynamic smem) -> resident blocks per SM.
    occupancy: Mutex<HashMap<(&'static str, u32, u32), u32>>,
    /// While recording (`profile.rs`): the marks so far and the current layer.
    pub(crate) recorder: Mutex<Option<(Vec<crate::profile::Mark>, i32)>>,
    /// Launch kernels with programmatic dependent launch (`ops::launch`).
    pdl: std::sync::atomic::AtomicBool,
    /// The decode ledger's knock-outs (`profile.rs`): the op whose kernels are not launched, and the
    /// op being launched (its last mark); `knocking` is the fast check that one is set.
    pub(crate) knockout: Mutex<(Option<&'static str>, &'static str)>,
    pub(crate) knocking: std::sync::atomic::AtomicBool,
    /// Kernel launches skipped by knock-outs so far.
    pub(crate) knocked: std::sync::atomic::AtomicU64,
    /// The wgmma GEMM's staged x (`ops::gemm_wgmma`), a buffer for the half numerics and one for the
    /// folded ones: grown on demand, reused by every call in stream order, with what each holds.
    pub(crate) gemm_stage: Mutex<crate::ops::gemm_wgmma::Stage>,
}

pub(crate) fn describe(ctx: &Arc<CudaContext>, ordinal: usize) -> Result<DeviceInfo> {
    let major = ctx.attribute(Attr::CU_DEVICE_ATTRIBUTE_COMPUTE_CAPABILITY_MAJOR)?;
    let minor = ctx.attribute(Attr::CU_DEVICE_ATTRIBUTE_COMPUTE_CAPABILITY_MINOR)?;
    Ok(DeviceInfo { ordinal, name: ctx.name()?, compute_capability: (major, minor), total_memory: ctx.total_mem()? })
}

impl Device {
    /// Opens GPU `ordinal` with the embedded kernels.
    pub fn open(ordinal: usize) -> Result<Self> {
        Self::open_with_kernel_dir(ordinal, None)
    }

    /// Opens GPU `ordinal`. With `kernel_dir`, each module `<stem>` is loaded from
    /// `<kernel_dir>/<stem>.sm_90a.cubin` when that file exists, else from the embedded bytes
    /// ([`Device::kernel_sources`] says which). A `kernel_dir` that is not a directory is an error.
    pub fn open_with_kernel_dir(ordinal: usize, kernel_dir: Option<&Path>) -> Result<Self> {
        // SAFETY: dlopens the driver library and reports whether it is there.
        if !unsafe { cudarc::driver::sys::is_culib_present() } {
            return Err(CudaError::NoDriver);
        }
        if kernels::CUBINS.is_empty() {
            return Err(CudaError::Kernel {
                module: "*".into(),
                msg: "this binary was built without nvcc, so it carries no GPU kernels: install the CUDA 13 toolkit \
                      (or run tools/install-cuda-toolchain.sh) and rebuild"
                    .into(),
            });
        }
        if let Some(dir) = kernel_dir {
            if !dir.is_dir() {
                return Err(CudaError::Kernel {
                    module: "*".into(),
                    msg: format!("kernel directory {} does not exist", dir.display()),
                });
            }
        }
        let ctx = CudaContext::new(ordinal)?;
        // SAFETY: called before this context allocates anything; from here on we synchronise by hand.
        unsafe { ctx.disable_event_tracking() };
        let stream = ctx.new_stream()?;
        let info = describe(&ctx, ordinal)?;
        if info.compute_capability != (9, 0) {
            return Err(CudaError::Driver(format!(
                "GPU {ordinal} ({}) has compute capability {}.{}; lily's kernels are built for sm_90a (H100/H200)",
                info.name, info.compute_capability.0, info.compute_capability.1
            )));
        }
        let sm_count = ctx.attribute(Attr::CU_DEVICE_ATTRIBUTE_MULTIPROCESSOR_COUNT)? as u32;
        let max_smem_optin = ctx.attribute(Attr::CU_DEVICE_ATTRIBUTE_MAX_SHARED_MEMORY_PER_BLOCK_OPTIN)? as u32;

        let mut modules = Vec::new();
        for (stem, bytes) in kernels::CUBINS {
            let file = kernel_dir.map(|d| d.join(format!("{stem}.sm_90a.cubin"))).filter(|p| p.is_file());
            let (image, source) = match file {
                Some(path) => {
                    let b = std::fs::read(&path)
                        .map_err(|e| CudaError::Kernel { module: stem.to_string(), msg: format!("{}: {e}", path.display()) })?;
                    // cuModuleLoadData takes anything that is not an ELF/fatbin image for NUL-terminated
                    // PTX text and would read past the buffer: refuse it here instead.
                    if !(b.starts_with(b"\x7fELF") || b.starts_with(&0xBA55_ED50u32.to_le_bytes())) {
                        return Err(CudaError::Kernel {
                            module: stem.to_string(),
                            msg: format!("{} is not a cubin (no ELF header)", path.display()),
                        });
                    }
                    (b, KernelSource::File(path))
                }
                None => (bytes.to_vec(), KernelSource::Embedded),
            };
            let module = ctx.load_module(Ptx::from_binary(image)).map_err(|e| CudaError::Kernel {
                module: stem.to_string(),
                msg: format!("loading the cubin ({source:?}) failed: {e}"),
            })?;
            modules.push((stem.to_string(), source, module));
        }

        let mut functions = HashMap::new();
        for (module_name, names) in ops::REGISTRY {
            let module = modules.iter().find(|(n, _, _)| n == module_name).map(|(_, _, m)| m).ok_or_else(|| {
                CudaError::Kernel { module: module_name.to_string(), msg: "not compiled into this binary".into() }
            })?;
            for name in names.iter() {
                let f = module.load_function(name).map_err(|e| CudaError::Kernel {
                    module: module_name.to_string(),
                    msg: format!("kernel `{name}`: {e}"),
                })?;
                functions.insert(*name, f);
            }
        }
        let dev = Device {
            ctx,
            stream,
            info,
            sm_count,
            max_smem_optin,
            modules,
            functions,
            occupancy: Mutex::new(HashMap::new()),
            recorder: Mutex::new(None),
            pdl: std::sync::atomic::AtomicBool::new(false),
            knockout: Mutex::new((None, "")),
            knocking: std::sync::atomic::AtomicBool::new(false),
            knocked: std::sync::atomic::AtomicU64::new(0),
            gemm_stage: Mutex::new(Default::default()),
        };
        ops::configure(&dev)?;
        Ok(dev)
    }

    pub fn info(&self) -> &DeviceInfo {
        &self.info
    }
    pub fn context(&self) -> &Arc<CudaContext> {
        &self.ctx
    }
    /// The stream every op runs on.
    pub fn stream(&self) -> &Arc<CudaStream> {
        &self.stream
    }
    pub fn sm_count(&self) -> u32 {
        self.sm_count
    }
    /// Largest dynamic shared memory a block may opt in to.
    pub fn max_smem_optin(&self) -> u32 {
        self.max_smem_optin
    }
    /// Each loaded module and where it came from.
    pub fn kernel_sources(&self) -> Vec<(&str, &KernelSource)> {
        self.modules.iter().map(|(n, s, _)| (n.as_str(), s)).collect()
    }

    /// Whether kernels are launched with programmatic dependent launch (a kernel may be placed while
    /// its predecessor runs; see `kernels/pdl.cuh`). Off at open.
    pub fn pdl(&self) -> bool {
        self.pdl.load(std::sync::atomic::Ordering::Relaxed)
    }
    /// Turns programmatic dependent launch on or off for later launches.
    pub fn set_pdl(&self, on: bool) {
        self.pdl.store(on, std::sync::atomic::Ordering::Relaxed)
    }

    /// A kernel resolved at open.
    pub fn function(&self, name: &str) -> Result<&CudaFunction> {
        self.functions
            .get(name)
            .ok_or_else(|| CudaError::Kernel { module: "?".into(), msg: format!("kernel `{name}` is not registered in ops::REGISTRY") })
    }

    /// Blocks of `threads` threads with `smem` bytes of dynamic shared memory that fit on the whole GPU.
    pub(crate) fn resident_blocks(&self, name: &'static str, threads: u32, smem: u32) -> Result<u32> {
        let key = (name, threads, smem);
        if let Some(n) = self.occupancy.lock().unwrap().get(&key) {
            return Ok(*n * self.sm_count);
        }
        let n = self.function(name)?.occupancy_max_active_blocks_per_multiprocessor(threads, smem as usize, None)?.max(1);
        self.occupancy.lock().unwrap().insert(key, n);
        Ok(n * self.sm_count)
    }

    /// Waits for all work on the stream.
    pub fn synchronize(&self) -> Result<()> {
        self.stream.synchronize()?;
        Ok(())
    }

    /// A new device buffer holding `host` (pageable copy; for weights use [`crate::weights::Uploader`]).
    pub fn upload<T: DeviceRepr>(&self, host: &[T]) -> Result<CudaSlice<T>> {
        Ok(self.stream.clone_htod(host)?)
    }

    /// Copies `host` into `dst` (whose length must be at least `host.len()`).
    pub fn upload_into<T: DeviceRepr, D: DevicePtrMut<T>>(&self, host: &[T], dst: &mut D) -> Result<()> {
        if dst.len() < host.len() {
            return Err(CudaError::Shape(format!("upload of {} elements into a buffer of {}", host.len(), dst.len())));
        }
        self.stream.memcpy_htod(host, dst)?;
        Ok(())
    }

    /// Reads a device buffer back (synchronises).
    pub fn download<T: DeviceRepr, S: DevicePtr<T>>(&self, src: &S) -> Result<Vec<T>> {
        let v = self.stream.clone_dtoh(src)?;
        self.stream.synchronize()?;
        Ok(v)
    }

    /// A zeroed device buffer.
    pub fn zeros<T: DeviceRepr + ValidAsZeroBits>(&self, n: usize) -> Result<CudaSlice<T>> {
        Ok(self.stream.alloc_zeros(n)?)
    }
}

impl std::fmt::Debug for Device {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Device").field("info", &self.info).field("sm_count", &self.sm_count).finish()
    }
}

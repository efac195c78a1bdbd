//! Helpers (`kernels/util.cu`): fill a buffer (NaN poisoning before a test run), and keep the GPU busy
//! for a while (benchmarks queue their timed launches behind it).

use cudarc::driver::{DevicePtrMut, LaunchConfig, PushKernelArg};

use crate::{Device, Result};

pub(crate) const KERNELS: &[&str] = &["fill_f32", "spin_ns"];

/// Sets every element of `y` to `v`.
pub fn fill<Y: DevicePtrMut<f32>>(dev: &Device, y: &mut Y, v: f32) -> Result<()> {
    let n = y.len() as u64;
    if n == 0 {
        return Ok(());
    }
    let blocks = n.div_ceil(256).min(dev.sm_count() as u64 * 8) as u32;
    let (p, _g) = y.device_ptr_mut(dev.stream());
    let f = dev.function("fill_f32")?;
    let mut b = dev.stream().launch_builder(f);
    b.arg(&p).arg(&n).arg(&v);
    // SAFETY: `fill_f32(float*, unsigned long long, float)` writes n floats at p.
    unsafe { b.launch(LaunchConfig { grid_dim: (blocks, 1, 1), block_dim: (256, 1, 1), shared_mem_bytes: 0 }) }?;
    Ok(())
}

/// One GPU thread busy-waits `ns` nanoseconds on the stream.
pub fn spin(dev: &Device, ns: u64) -> Result<()> {
    let f = dev.function("spin_ns")?;
    let mut b = dev.stream().launch_builder(f);
    b.arg(&ns);
    // SAFETY: `spin_ns(unsigned long long)` touches no memory.
    unsafe { b.launch(LaunchConfig { grid_dim: (1, 1, 1), block_dim: (32, 1, 1), shared_mem_bytes: 0 }) }?;
    Ok(())
}

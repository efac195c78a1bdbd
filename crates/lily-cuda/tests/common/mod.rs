//! What the GPU test files share: opening the GPU (or skipping cleanly without one; kernels from
//! `LILY_TEST_KERNEL_DIR` where it names a directory of cubins), a small seeded
//! generator of test inputs (xorshift64* with Box–Muller normals, as `lily-cpu/tests/gdn.rs`),
//! NaN-poisoned output buffers, and the launch timer of the `#[ignore]` timing tests.
#![allow(dead_code)]

use cudarc::driver::CudaSlice;
use lily_cuda::ops::{attn_prep, util};
use lily_cuda::{probe, Device};

/// Whether this process has found the GPU before: a probe that fails after that means an earlier test
/// faulted the device (its context is gone), not a machine without a GPU.
static FOUND: std::sync::atomic::AtomicBool = std::sync::atomic::AtomicBool::new(false);

/// The GPU, or None (after printing "no GPU, skipped") on a machine without one. Panics when the GPU
/// this process found before is gone, so that the tests after a faulting one fail instead of skipping.
pub fn device() -> Option<Device> {
    use std::sync::atomic::Ordering;
    match probe(0) {
        Err(e) if FOUND.load(Ordering::Relaxed) => {
            panic!("the GPU found earlier in this process is gone (an earlier test faulted it?): {e}")
        }
        Err(e) => {
            println!("no GPU, skipped ({e})");
            None
        }
        // LILY_TEST_KERNEL_DIR: kernels rebuilt on the GPU machine (as `--kernel-dir` does for `lily`).
        Ok(_) => {
            FOUND.store(true, Ordering::Relaxed);
            let dir = std::env::var_os("LILY_TEST_KERNEL_DIR").map(std::path::PathBuf::from);
            Some(Device::open_with_kernel_dir(0, dir.as_deref()).expect("the GPU is there but Device::open failed"))
        }
    }
}

pub struct Rng(u64);

impl Rng {
    pub fn new(seed: u64) -> Self {
        Rng(seed.wrapping_mul(0x9E37_79B9_7F4A_7C15) | 1)
    }
    pub fn next_u64(&mut self) -> u64 {
        self.0 ^= self.0 >> 12;
        self.0 ^= self.0 << 25;
        self.0 ^= self.0 >> 27;
        self.0.wrapping_mul(0x2545_F491_4F6C_DD1D)
    }
    /// In (0, 1).
    pub fn uniform(&mut self) -> f64 {
        ((self.next_u64() >> 11) as f64 + 0.5) / (1u64 << 53) as f64
    }
    pub fn below(&mut self, n: usize) -> usize {
        (self.next_u64() % n as u64) as usize
    }
    pub fn range(&mut self, lo: f64, hi: f64) -> f32 {
        (lo + (hi - lo) * self.uniform()) as f32
    }
    pub fn normal(&mut self, std: f64) -> f32 {
        let (u1, u2) = (self.uniform(), self.uniform());
        (std * (-2.0 * u1.ln()).sqrt() * (2.0 * std::f64::consts::PI * u2).cos()) as f32
    }
    pub fn normals(&mut self, n: usize, std: f64) -> Vec<f32> {
        (0..n).map(|_| self.normal(std)).collect()
    }
}

/// An output buffer of `n` (at least 1) f32 filled with NaN, so an element a kernel fails to write shows.
pub fn poisoned(dev: &Device, n: usize) -> CudaSlice<f32> {
    let mut y = dev.zeros::<f32>(n.max(1)).unwrap();
    util::fill(dev, &mut y, f32::NAN).unwrap();
    y
}

/// Median per-launch time in seconds of `op(i)`, and the max/min batch ratio: after `3 · batch`
/// warm-up calls, `reps` batches of `batch` calls queued behind a GPU spin (so launch gaps do not
/// count), each batch between two CUDA events.
pub fn time_op(dev: &Device, reps: usize, batch: usize, mut op: impl FnMut(usize)) -> (f64, f64) {
    use cudarc::driver::sys::CUevent_flags;
    for i in 0..3 * batch {
        op(i);
    }
    dev.synchronize().unwrap();
    let ctx = dev.context();
    let events: Vec<_> = (0..2 * reps).map(|_| ctx.new_event(Some(CUevent_flags::CU_EVENT_DEFAULT)).unwrap()).collect();
    util::spin(dev, 30_000_000).unwrap();
    let mut i = 0;
    for r in 0..reps {
        events[2 * r].record(dev.stream()).unwrap();
        for _ in 0..batch {
            op(i);
            i += 1;
        }
        events[2 * r + 1].record(dev.stream()).unwrap();
    }
    dev.synchronize().unwrap();
    let mut t: Vec<f64> =
        (0..reps).map(|r| events[2 * r].elapsed_ms(&events[2 * r + 1]).unwrap() as f64 * 1e-3 / batch as f64).collect();
    t.sort_by(|a, b| a.partial_cmp(b).unwrap());
    (t[reps / 2], t[reps - 1] / t[0])
}

/// f32 values rounded to bf16 (nearest even), as the KV cache stores them.
pub fn round_bf16(x: &[f32]) -> Vec<f32> {
    x.iter().map(|&v| half::bf16::from_f32(v).to_f32()).collect()
}

/// The device KV cache of a position-major f32 cache `c` [cap, kvh, hd]: K as bf16 [cap, kvh, hd].
pub fn k_cache_bf16(c: &[f32]) -> Vec<half::bf16> {
    c.iter().map(|&v| half::bf16::from_f32(v)).collect()
}

/// The device V cache of a position-major f32 cache `c` [cap, kvh, hd]: bf16, in transposed tiles
/// (`attn_prep::v_index`; cap a multiple of `attn_prep::V_TILE`).
pub fn v_cache_bf16(c: &[f32], cap: usize, kvh: usize, hd: usize) -> Vec<half::bf16> {
    assert!(cap.is_multiple_of(attn_prep::V_TILE), "a V cache holds whole tiles");
    let mut out = vec![half::bf16::ZERO; cap * kvh * hd];
    for p in 0..cap {
        for kv in 0..kvh {
            for d in 0..hd {
                out[attn_prep::v_index(kv, d, p, hd, cap)] = half::bf16::from_f32(c[(p * kvh + kv) * hd + d]);
            }
        }
    }
    out
}

/// A device V cache (`attn_prep::v_index`) back to position-major f32 [cap, kvh, hd].
pub fn v_cache_f32(vt: &[half::bf16], cap: usize, kvh: usize, hd: usize) -> Vec<f32> {
    let mut out = vec![0.0f32; cap * kvh * hd];
    for p in 0..cap {
        for kv in 0..kvh {
            for d in 0..hd {
                out[(p * kvh + kv) * hd + d] = vt[attn_prep::v_index(kv, d, p, hd, cap)].to_f32();
            }
        }
    }
    out
}

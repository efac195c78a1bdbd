//! What the GPU test files share: opening the GPU (or skipping cleanly without one) and a small
//! seeded generator of test inputs (xorshift64* with Box–Muller normals, as `lily-cpu/tests/gdn.rs`).
#![allow(dead_code)]

use lily_cuda::{probe, Device};

/// The GPU, or None (after printing "no GPU, skipped") on a machine without one.
pub fn device() -> Option<Device> {
    match probe(0) {
        Err(e) => {
            println!("no GPU, skipped ({e})");
            None
        }
        Ok(_) => Some(Device::open(0).expect("the GPU is there but Device::open failed")),
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

//! Shared helpers for the CPU backend's tests: the reference fixtures (made by
//! `tools/make_fixtures.py` with MLX-LM and transformers), comparison metrics and the inputs'
//! random generator.
#![allow(dead_code)]

use std::path::PathBuf;

use lily_model::checkpoint::Checkpoint;

pub fn fixtures_dir() -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("../../tests/fixtures")
}

/// Every fixture (a directory with tokens.json).
pub fn fixture_names() -> Vec<String> {
    let mut v: Vec<String> = std::fs::read_dir(fixtures_dir())
        .expect("tests/fixtures is missing: run tools/make_fixtures.py")
        .filter_map(|e| e.ok())
        .filter(|e| e.path().join("tokens.json").exists())
        .map(|e| e.file_name().to_string_lossy().into_owned())
        .collect();
    v.sort();
    assert!(v.len() >= 2, "expected at least two reference fixtures, found {v:?}");
    v
}

pub fn tokens(name: &str) -> Vec<u32> {
    let text = std::fs::read_to_string(fixtures_dir().join(name).join("tokens.json")).unwrap();
    serde_json::from_str(&text).unwrap()
}

/// A reference JSON (`ref_mlx.json` / `ref_hf.json`): (perplexity, token_logprobs, argmax).
pub fn reference(name: &str, which: &str) -> (f64, Vec<f64>, Vec<u32>) {
    let text = std::fs::read_to_string(fixtures_dir().join(name).join(format!("ref_{which}.json"))).unwrap();
    let v: serde_json::Value = serde_json::from_str(&text).unwrap();
    let lp = v["token_logprobs"].as_array().unwrap().iter().map(|x| x.as_f64().unwrap()).collect();
    let am = v["argmax"].as_array().unwrap().iter().map(|x| x.as_u64().unwrap() as u32).collect();
    (v["perplexity"].as_f64().unwrap(), lp, am)
}

/// A float32 tensor of `ref_<which>_hidden.safetensors`.
pub fn reference_tensor(name: &str, which: &str, tensor: &str) -> Vec<f32> {
    let dir = fixtures_dir().join(name);
    let path = dir.join(format!("ref_{which}_hidden.safetensors"));
    let bytes = std::fs::read(&path).unwrap();
    let st = safetensors::SafeTensors::deserialize(&bytes).unwrap();
    let t = st.tensor(tensor).unwrap_or_else(|_| panic!("{} has no {tensor}", path.display()));
    t.data().chunks_exact(4).map(|c| f32::from_le_bytes(c.try_into().unwrap())).collect()
}

pub fn open_checkpoint(name: &str, sub: &str) -> Checkpoint {
    Checkpoint::open(&fixtures_dir().join(name).join(sub)).unwrap()
}

/// max |a - b| / rms(b): a scale-free error, ~1e-6 for f32 rounding, ~1 for a wrong computation.
pub fn rel_err(a: &[f32], b: &[f32]) -> f64 {
    assert_eq!(a.len(), b.len());
    let rms = (b.iter().map(|&x| (x as f64).powi(2)).sum::<f64>() / b.len() as f64).sqrt().max(1e-30);
    a.iter().zip(b).map(|(&x, &y)| (x as f64 - y as f64).abs()).fold(0.0, f64::max) / rms
}

/// Fraction of equal entries.
pub fn agreement(a: &[u32], b: &[u32]) -> f64 {
    assert_eq!(a.len(), b.len());
    a.iter().zip(b).filter(|(x, y)| x == y).count() as f64 / a.len() as f64
}

/// CPU time of this process so far, in seconds (all threads): timing runs on a shared machine
/// measure this beside wall time, since a descheduled thread costs wall time but no CPU time.
pub fn cpu_seconds() -> f64 {
    let mut ts = libc::timespec { tv_sec: 0, tv_nsec: 0 };
    // SAFETY: clock_gettime writes the timespec it is given.
    let rc = unsafe { libc::clock_gettime(libc::CLOCK_PROCESS_CPUTIME_ID, &mut ts) };
    assert_eq!(rc, 0, "clock_gettime failed");
    ts.tv_sec as f64 + ts.tv_nsec as f64 * 1e-9
}

/// xorshift64* with Box–Muller normals: the tests' inputs, the same stream for a seed on every machine.
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
    /// U(0, 1), never 0.
    pub fn uniform(&mut self) -> f64 {
        ((self.next_u64() >> 11) as f64 + 0.5) / (1u64 << 53) as f64
    }
    pub fn range(&mut self, lo: f64, hi: f64) -> f32 {
        (lo + (hi - lo) * self.uniform()) as f32
    }
    /// 0..n.
    pub fn below(&mut self, n: usize) -> usize {
        (self.next_u64() % n as u64) as usize
    }
    pub fn normal(&mut self, std: f64) -> f32 {
        let (u1, u2) = (self.uniform(), self.uniform());
        (std * (-2.0 * u1.ln()).sqrt() * (2.0 * std::f64::consts::PI * u2).cos()) as f32
    }
    pub fn normals(&mut self, n: usize, std: f64) -> Vec<f32> {
        (0..n).map(|_| self.normal(std)).collect()
    }
}

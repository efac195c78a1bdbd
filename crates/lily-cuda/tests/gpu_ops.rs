//! CPU-vs-GPU tests of every kernel family, plus the timing table (`bench_ops`, ignored by default).
//!
//! Each test skips (prints "no GPU, skipped") when `probe(0)` fails, so `cargo test --features cuda`
//! passes on machines without a GPU. On the GPU machine: `tools/gpu_check.sh`.
//!
//! Every check draws fresh random inputs (never zeros), poisons the output with NaN before the GPU
//! run, requires every element to have been written, and compares with an f64 reference computed from
//! the same stored bytes (and with `lily-cpu`), at a tolerance that an indexing or decoding bug would
//! exceed by orders of magnitude.
#![cfg(feature = "cuda")]

mod common;

use common::{device, poisoned, time_op};
use cudarc::driver::CudaSlice;
use half::{bf16, f16};
use lily_cuda::ops::affine_gemv::{self, Q4Decode, Select};
use lily_cuda::ops::{embed, rmsnorm, util};
use lily_cuda::weights::{upload_matrix, DeviceMatrix, DeviceStorage, Uploader};
use lily_cuda::{Device, KernelSource};
use lily_model::affine::{quantize_bf16, AffineParams};
use lily_model::buf::{Buf, FloatBuf};
use lily_model::weights::{Matrix, Storage};

// ---------------------------------------------------------------------------------------------------
// Helpers


/// splitmix64: a fresh, reproducible stream per test.
struct Rng(u64);
impl Rng {
    fn new(seed: u64) -> Self {
        Rng(seed ^ 0x9E37_79B9_7F4A_7C15)
    }
    fn u64(&mut self) -> u64 {
        self.0 = self.0.wrapping_add(0x9E37_79B9_7F4A_7C15);
        let mut z = self.0;
        z = (z ^ (z >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
        z = (z ^ (z >> 27)).wrapping_mul(0x94D0_49BB_1331_11EB);
        z ^ (z >> 31)
    }
    /// Uniform in [-1, 1), never exactly 0.
    fn f32(&mut self) -> f32 {
        let v = ((self.u64() >> 40) as f32 + 0.5) / (1u64 << 24) as f32;
        2.0 * v - 1.0
    }
    fn vec(&mut self, n: usize) -> Vec<f32> {
        (0..n).map(|_| self.f32()).collect()
    }
    fn below(&mut self, n: usize) -> usize {
        (self.u64() % n as u64) as usize
    }
}

/// A stack of `count` random `[rows, cols]` matrices quantised with MLX's algorithm; scales and biases
/// stored as `dtype` ("bf16", "f16" or "f32", converted from the quantiser's bf16).
fn affine_matrix(rng: &mut Rng, count: usize, rows: usize, cols: usize, bits: u32, gs: usize, dtype: &str) -> Matrix {
    // Rows with different spreads so per-row/per-group scales matter.
    let mut w = Vec::with_capacity(count * rows * cols);
    for _ in 0..count * rows {
        let amp = 0.05 + rng.f32().abs();
        let off = 0.3 * rng.f32();
        w.extend((0..cols).map(|_| bf16::from_f32(off + amp * rng.f32())));
    }
    let q = quantize_bf16(&w, cols, AffineParams::new(bits, gs));
    let conv = |v: Vec<bf16>| match dtype {
        "bf16" => FloatBuf::Bf16(Buf::owned(v)),
        "f16" => FloatBuf::F16(Buf::owned(v.iter().map(|x| f16::from_f32(x.to_f32())).collect())),
        "f32" => FloatBuf::F32(Buf::owned(v.iter().map(|x| x.to_f32()).collect())),
        _ => unreachable!(),
    };
    Matrix {
        count,
        rows,
        cols,
        storage: Storage::Affine {
            params: AffineParams::new(bits, gs),
            packed: Buf::owned(q.packed),
            scales: conv(q.scales),
            biases: conv(q.biases),
        },
    }
}

fn dense_matrix(rng: &mut Rng, count: usize, rows: usize, cols: usize) -> Matrix {
    let v: Vec<bf16> = (0..count * rows * cols).map(|_| bf16::from_f32(rng.f32())).collect();
    Matrix { count, rows, cols, storage: Storage::Dense(FloatBuf::Bf16(Buf::owned(v))) }
}

/// What the device holds for a float (scales/biases/dense values become bf16).
fn as_bf16(v: f32) -> f64 {
    bf16::from_f32(v).to_f32() as f64
}

/// Row `r` of matrix `m`, dequantised exactly (f64) from the values the GPU sees.
fn ref_row(w: &Matrix, m: usize, r: usize) -> Vec<f64> {
    let row = m * w.rows + r;
    match &w.storage {
        Storage::Dense(d) => (0..w.cols).map(|c| as_bf16(d.get(row * w.cols + c))).collect(),
        Storage::Affine { params, packed, scales, biases } => {
            let (bits, gs) = (params.bits, params.group_size);
            let words = w.cols * bits as usize / 32;
            let groups = w.cols / gs;
            (0..w.cols)
                .map(|c| {
                    let q = lily_model::affine::code(&packed[row * words..(row + 1) * words], c, bits) as f64;
                    let g = row * groups + c / gs;
                    as_bf16(scales.get(g)) * q + as_bf16(biases.get(g))
                })
                .collect()
        }
    }
}

/// `W_m x` in f64.
fn ref_gemv(w: &Matrix, m: usize, x: &[f32]) -> Vec<f64> {
    (0..w.rows).map(|r| ref_row(w, m, r).iter().zip(x).map(|(a, b)| a * *b as f64).sum()).collect()
}

fn silu64(g: f64) -> f64 {
    g / (1.0 + (-g).exp())
}

/// max |got - want| / max |want|, after checking every element was written (no NaN).
fn rel_err(got: &[f32], want: &[f64], what: &str) -> f64 {
    assert_eq!(got.len(), want.len(), "{what}: length");
    if let Some(i) = got.iter().position(|v| !v.is_finite()) {
        panic!("{what}: element {i} of {} not written (or not finite): {}", got.len(), got[i]);
    }
    let scale = want.iter().fold(0.0f64, |a, b| a.max(b.abs())).max(1e-30);
    got.iter().zip(want).fold(0.0f64, |a, (g, w)| a.max((*g as f64 - w).abs())) / scale
}

fn check(got: &[f32], want: &[f64], tol: f64, what: &str) -> f64 {
    let e = rel_err(got, want, what);
    assert!(e <= tol, "{what}: relative max error {e:.3e} > {tol:.0e}");
    e
}

/// Tolerance of the f32 GEMV paths against the exact f64 result, relative to the largest output.
/// Measured errors are ~1e-7; a wrong code, group or row shows up as >1e-2.
const GEMV_TOL: f64 = 1e-5;

// ---------------------------------------------------------------------------------------------------
// Device and upload

#[test]
fn device_opens_and_loads_every_kernel() {
    let Some(dev) = device() else { return };
    let info = dev.info();
    println!("{} (sm_{}{}), {} SMs, {:.1} GiB", info.name, info.compute_capability.0, info.compute_capability.1, dev.sm_count(), info.total_memory as f64 / (1u64 << 30) as f64);
    let sources = dev.kernel_sources();
    let names: Vec<&str> = sources.iter().map(|(n, _)| *n).collect();
    for m in ["affine_gemv", "embed", "rmsnorm", "util"] {
        assert!(names.contains(&m), "module {m} not loaded: {names:?}");
    }
    assert!(sources.iter().all(|(_, s)| **s == KernelSource::Embedded));
    assert!(dev.function("affine_gemv_q4_t32_u2r4").is_ok());
    assert!(dev.function("affine_gemv_async_q4_t32_u2r2").is_ok());
    assert!(dev.function("no_such_kernel").is_err());
}

#[test]
fn kernel_dir_override_loads_files() {
    let Some(_) = device() else { return };
    let dir = tempfile::tempdir().unwrap();
    // Only rmsnorm comes from the directory; the rest fall back to the embedded cubins.
    let (_, bytes) = lily_cuda::embedded_cubins().iter().find(|(n, _)| *n == "rmsnorm").unwrap();
    std::fs::write(dir.path().join("rmsnorm.sm_90a.cubin"), bytes).unwrap();
    let dev = Device::open_with_kernel_dir(0, Some(dir.path())).unwrap();
    for (name, src) in dev.kernel_sources() {
        match name {
            "rmsnorm" => assert_eq!(*src, KernelSource::File(dir.path().join("rmsnorm.sm_90a.cubin"))),
            _ => assert_eq!(*src, KernelSource::Embedded, "{name}"),
        }
    }
    // The file-loaded module works.
    let mut rng = Rng::new(11);
    let (x, w) = (rng.vec(256), rng.vec(256));
    let (xd, wd) = (dev.upload(&x).unwrap(), dev.upload(&w).unwrap());
    let mut y = poisoned(&dev, 256);
    rmsnorm::rms_norm(&dev, &xd, &wd, 1e-6, 1, &mut y).unwrap();
    let mut want = vec![0.0; 256];
    lily_cpu::norm::rms_norm(&x, &w, 1e-6, &mut want);
    check(&dev.download(&y).unwrap(), &want.iter().map(|v| *v as f64).collect::<Vec<_>>(), 1e-5, "rmsnorm from file");

    // A corrupt file is a clean error naming the module; a missing directory too.
    std::fs::write(dir.path().join("rmsnorm.sm_90a.cubin"), b"not a cubin").unwrap();
    let err = Device::open_with_kernel_dir(0, Some(dir.path())).unwrap_err().to_string();
    assert!(err.contains("rmsnorm"), "{err}");
    let err = Device::open_with_kernel_dir(0, Some(&dir.path().join("nope"))).unwrap_err().to_string();
    assert!(err.contains("does not exist"), "{err}");
}

#[test]
fn upload_roundtrip_through_small_chunks() {
    let Some(dev) = device() else { return };
    let mut rng = Rng::new(1);
    // 1000-byte chunks (rounded to 1008): every array crosses many chunk boundaries at odd offsets.
    let mut up = Uploader::with_chunk_bytes(&dev, 1000).unwrap();
    for (dtype, bits, gs) in [("bf16", 4, 64), ("f16", 8, 32), ("f32", 4, 128)] {
        let m = affine_matrix(&mut rng, 3, 37, 256, bits, gs, dtype);
        let d = up.upload_matrix(&m).unwrap();
        assert_eq!((d.count, d.rows, d.cols, d.bits(), d.group_size()), (3, 37, 256, bits, Some(gs)));
        let (Storage::Affine { packed, scales, biases, .. }, DeviceStorage::Affine { packed: dp, scales: ds, biases: db, .. }) =
            (&m.storage, &d.storage)
        else {
            panic!()
        };
        assert_eq!(dev.download(dp).unwrap(), packed.to_vec(), "{dtype} packed");
        // Scales and biases carry SCALE_PAD zeros after the real values.
        let want = |f: &FloatBuf| {
            let mut v: Vec<bf16> = (0..f.len()).map(|i| bf16::from_f32(f.get(i))).collect();
            v.extend(std::iter::repeat_n(bf16::ZERO, lily_cuda::weights::SCALE_PAD));
            v
        };
        assert_eq!(dev.download(ds).unwrap(), want(scales), "{dtype} scales");
        assert_eq!(dev.download(db).unwrap(), want(biases), "{dtype} biases");
    }
    let f32_dense = Matrix { count: 1, rows: 5, cols: 77, storage: Storage::Dense(FloatBuf::F32(Buf::owned(rng.vec(5 * 77)))) };
    let d = up.upload_matrix(&f32_dense).unwrap();
    let DeviceStorage::Dense { data } = &d.storage else { panic!() };
    let Storage::Dense(src) = &f32_dense.storage else { panic!() };
    let want: Vec<bf16> = (0..src.len()).map(|i| bf16::from_f32(src.get(i))).collect();
    assert_eq!(dev.download(data).unwrap(), want);
    up.finish().unwrap();

    // Inconsistent shapes are refused.
    let mut bad = affine_matrix(&mut rng, 1, 4, 64, 4, 64, "bf16");
    bad.rows = 5;
    assert!(upload_matrix(&dev, &bad).is_err());
}

// ---------------------------------------------------------------------------------------------------
// GEMV

/// One plain GEMV against the f64 reference (and lily-cpu); returns the GPU error.
fn gemv_case(dev: &Device, rng: &mut Rng, w: &Matrix, dw: &DeviceMatrix, m: usize, decode: Q4Decode, label: &str) -> f64 {
    let x = rng.vec(w.cols);
    let xd = dev.upload(&x).unwrap();
    let mut y = poisoned(dev, w.rows);
    affine_gemv::gemv_with(dev, dw, Select::matrix(m), &xd, false, &mut y, decode).unwrap();
    let got = dev.download(&y).unwrap();
    let want = ref_gemv(w, m, &x);
    let cpu: Vec<f32> = lily_cpu::linear::matmul_new(w, m, &x);
    // lily-cpu dequantises from the stored (possibly f32/f16) scales; the device holds bf16. Only compare
    // it when they agree, i.e. for bf16 storage.
    if matches!(&w.storage, Storage::Affine { scales: FloatBuf::Bf16(_), .. } | Storage::Dense(FloatBuf::Bf16(_))) {
        check(&cpu, &want, GEMV_TOL, &format!("{label} (lily-cpu vs f64)"));
    }
    check(&got, &want, GEMV_TOL, label)
}

#[test]
fn gemv_affine_every_bits_and_group() {
    let Some(dev) = device() else { return };
    let mut rng = Rng::new(2);
    let mut worst = 0.0f64;
    // (rows, cols): rows not multiples of a block's rows; cols giving 1..128 chunks per row (every TPR,
    // idle lanes, and lanes with more chunks than others).
    let shapes: &[(usize, usize)] = &[(1, 128), (3, 256), (37, 512), (100, 1024), (259, 2048), (61, 4096), (17, 8192)];
    for bits in [4u32, 8] {
        for gs in [32usize, 64, 128] {
            let mut cases: Vec<(usize, usize)> = shapes.to_vec();
            if gs == 32 {
                cases.extend([(5, 32), (9, 96), (33, 1056)]);
            }
            for &(rows, cols) in &cases {
                let count = if rows < 50 { 3 } else { 1 };
                let w = affine_matrix(&mut rng, count, rows, cols, bits, gs, "bf16");
                let dw = upload_matrix(&dev, &w).unwrap();
                let m = count - 1;
                let decodes: &[Q4Decode] = if bits == 4 { &[Q4Decode::Fast, Q4Decode::Exact] } else { &[Q4Decode::Fast] };
                for &d in decodes {
                    let e = gemv_case(&dev, &mut rng, &w, &dw, m, d, &format!("q{bits} g{gs} [{count}x{rows}x{cols}] m={m} {d:?}"));
                    worst = worst.max(e);
                }
            }
        }
    }
    // Scales stored as f16/f32 in the checkpoint become bf16 on the device.
    for dtype in ["f16", "f32"] {
        let w = affine_matrix(&mut rng, 1, 70, 512, 4, 64, dtype);
        let dw = upload_matrix(&dev, &w).unwrap();
        worst = worst.max(gemv_case(&dev, &mut rng, &w, &dw, 0, Q4Decode::Fast, &format!("q4 g64 {dtype} scales")));
    }
    println!("gemv affine: worst relative error {worst:.2e} (tolerance {GEMV_TOL:.0e})");
}

#[test]
fn gemv_dense_bf16() {
    let Some(dev) = device() else { return };
    let mut rng = Rng::new(3);
    let mut worst = 0.0f64;
    for &(rows, cols) in &[(1, 8), (7, 24), (130, 520), (257, 2048), (33, 4096)] {
        let w = dense_matrix(&mut rng, 2, rows, cols);
        let dw = upload_matrix(&dev, &w).unwrap();
        worst = worst.max(gemv_case(&dev, &mut rng, &w, &dw, 1, Q4Decode::Fast, &format!("bf16 [{rows}x{cols}]")));
    }
    // cols not a multiple of 8 is refused, not silently wrong.
    let w = dense_matrix(&mut rng, 1, 4, 12);
    let dw = upload_matrix(&dev, &w).unwrap();
    let x = dev.upload(&rng.vec(12)).unwrap();
    let mut y = poisoned(&dev, 4);
    assert!(affine_gemv::gemv(&dev, &dw, Select::matrix(0), &x, false, &mut y).is_err());
    println!("gemv bf16: worst relative error {worst:.2e}");
}

#[test]
fn gemv_indexed_experts() {
    let Some(dev) = device() else { return };
    let mut rng = Rng::new(4);
    let mut worst = 0.0f64;
    let idx_host: Vec<u32> = vec![3, 15, 0, 3, 7, 12, 1, 9];
    let idx = dev.upload(&idx_host).unwrap();
    let slots = idx_host.len();
    // (bits, gs, rows, cols, x per slot): gate/up-like (shared x) and down-like (x per slot).
    let cases = [(4, 64, 200, 512, false), (4, 64, 300, 256, true), (8, 32, 64, 1024, false), (16, 0, 45, 264, true), (4, 128, 513, 2048, false)];
    for (bits, gs, rows, cols, per_slot) in cases {
        let w = if bits == 16 { dense_matrix(&mut rng, 16, rows, cols) } else { affine_matrix(&mut rng, 16, rows, cols, bits, gs, "bf16") };
        let dw = upload_matrix(&dev, &w).unwrap();
        let x = rng.vec(if per_slot { slots * cols } else { cols });
        let xd = dev.upload(&x).unwrap();
        let mut y = poisoned(&dev, slots * rows);
        affine_gemv::gemv(&dev, &dw, Select::indexed(&dev, &idx), &xd, per_slot, &mut y).unwrap();
        let got = dev.download(&y).unwrap();
        let mut want = Vec::new();
        for (k, &e) in idx_host.iter().enumerate() {
            let xk = if per_slot { &x[k * cols..(k + 1) * cols] } else { &x[..] };
            want.extend(ref_gemv(&w, e as usize, xk));
        }
        worst = worst.max(check(&got, &want, GEMV_TOL, &format!("indexed q{bits} g{gs} [16x{rows}x{cols}] per_slot={per_slot}")));
    }

    // An index past the stack gives NaN rows for that slot only.
    let w = affine_matrix(&mut rng, 4, 40, 256, 4, 64, "bf16");
    let dw = upload_matrix(&dev, &w).unwrap();
    let idx_bad = dev.upload(&[2u32, 4, 0]).unwrap();
    let x = rng.vec(256);
    let xd = dev.upload(&x).unwrap();
    let mut y = poisoned(&dev, 3 * 40);
    util::fill(&dev, &mut y, 0.5).unwrap();
    affine_gemv::gemv(&dev, &dw, Select::indexed(&dev, &idx_bad), &xd, false, &mut y).unwrap();
    let got = dev.download(&y).unwrap();
    assert!(got[40..80].iter().all(|v| v.is_nan()), "slot with index 4 of 4 must be NaN");
    check(&got[..40], &ref_gemv(&w, 2, &x), GEMV_TOL, "slot 0 next to a bad index");
    check(&got[80..], &ref_gemv(&w, 0, &x), GEMV_TOL, "slot 2 next to a bad index");
    println!("gemv indexed: worst relative error {worst:.2e}");
}

#[test]
fn swiglu_matches_reference() {
    let Some(dev) = device() else { return };
    let mut rng = Rng::new(5);
    let mut worst = 0.0f64;
    let idx_host: Vec<u32> = vec![5, 0, 9, 5, 2];
    let idx = dev.upload(&idx_host).unwrap();
    for (bits, gs, rows, cols) in [(4, 64, 96, 2048), (8, 32, 33, 512), (4, 32, 7, 96), (16, 0, 50, 1024)] {
        let mk = |rng: &mut Rng| if bits == 16 { dense_matrix(rng, 10, rows, cols) } else { affine_matrix(rng, 10, rows, cols, bits, gs, "bf16") };
        let (g, u) = (mk(&mut rng), mk(&mut rng));
        let (dg, du) = (upload_matrix(&dev, &g).unwrap(), upload_matrix(&dev, &u).unwrap());
        let x = rng.vec(cols);
        let xd = dev.upload(&x).unwrap();
        // Indexed (MoE gate+up) ...
        let mut y = poisoned(&dev, idx_host.len() * rows);
        affine_gemv::swiglu(&dev, &dg, &du, Select::indexed(&dev, &idx), &xd, false, &mut y).unwrap();
        let got = dev.download(&y).unwrap();
        let mut want = Vec::new();
        for &e in &idx_host {
            let (a, b) = (ref_gemv(&g, e as usize, &x), ref_gemv(&u, e as usize, &x));
            want.extend(a.iter().zip(&b).map(|(a, b)| silu64(*a) * b));
        }
        worst = worst.max(check(&got, &want, GEMV_TOL, &format!("swiglu indexed q{bits} g{gs} [{rows}x{cols}]")));
        // ... and one matrix (shared expert).
        let mut y = poisoned(&dev, rows);
        affine_gemv::swiglu(&dev, &dg, &du, Select::matrix(7), &xd, false, &mut y).unwrap();
        let (a, b) = (ref_gemv(&g, 7, &x), ref_gemv(&u, 7, &x));
        let want: Vec<f64> = a.iter().zip(&b).map(|(a, b)| silu64(*a) * b).collect();
        worst = worst.max(check(&dev.download(&y).unwrap(), &want, GEMV_TOL, &format!("swiglu m=7 q{bits} g{gs}")));
    }
    // Mismatched gate/up are refused.
    let g = upload_matrix(&dev, &affine_matrix(&mut rng, 1, 8, 64, 4, 64, "bf16")).unwrap();
    let u = upload_matrix(&dev, &affine_matrix(&mut rng, 1, 8, 64, 4, 32, "bf16")).unwrap();
    let x = dev.upload(&rng.vec(64)).unwrap();
    let mut y = poisoned(&dev, 8);
    assert!(affine_gemv::swiglu(&dev, &g, &u, Select::matrix(0), &x, false, &mut y).is_err());
    println!("swiglu: worst relative error {worst:.2e}");
}

#[test]
fn gemv_every_variant() {
    let Some(dev) = device() else { return };
    let mut rng = Rng::new(9);
    let mut worst = 0.0f64;
    // Rows of 3..256 chunks (tails inside a batch, several batches) through every kernel and (U, NR).
    let shapes = [(4, 64, 77, 2048), (4, 32, 29, 1056), (8, 128, 41, 4096), (16, 0, 19, 2056), (4, 32, 13, 96), (8, 64, 70, 256), (4, 64, 9, 512)];
    for (bits, gs, rows, cols) in shapes {
        let w = if bits == 16 { dense_matrix(&mut rng, 2, rows, cols) } else { affine_matrix(&mut rng, 2, rows, cols, bits, gs, "bf16") };
        let dw = upload_matrix(&dev, &w).unwrap();
        let x = rng.vec(cols);
        let xd = dev.upload(&x).unwrap();
        let want = ref_gemv(&w, 1, &x);
        for variant in [1, 2, 3, 4, 8, 5, 6, 7] {
            let mut y = poisoned(&dev, rows);
            affine_gemv::gemv_tuned(&dev, &dw, Select::matrix(1), &xd, false, &mut y, Q4Decode::Fast, variant).unwrap();
            worst = worst.max(check(&dev.download(&y).unwrap(), &want, GEMV_TOL, &format!("q{bits} [{rows}x{cols}] variant {variant}")));
        }
        let u = if bits == 16 { dense_matrix(&mut rng, 2, rows, cols) } else { affine_matrix(&mut rng, 2, rows, cols, bits, gs, "bf16") };
        let du = upload_matrix(&dev, &u).unwrap();
        let up = ref_gemv(&u, 0, &x);
        let want_sw: Vec<f64> = ref_gemv(&w, 0, &x).iter().zip(&up).map(|(a, b)| silu64(*a) * b).collect();
        for variant in [1, 2, 3, 8, 5, 6, 7] {
            let mut y = poisoned(&dev, rows);
            affine_gemv::swiglu_tuned(&dev, &dw, &du, Select::matrix(0), &xd, false, &mut y, variant).unwrap();
            worst = worst.max(check(&dev.download(&y).unwrap(), &want_sw, GEMV_TOL, &format!("swiglu q{bits} [{rows}x{cols}] variant {variant}")));
        }
    }
    println!("gemv variants: worst relative error {worst:.2e}");
}

/// The tensor-core kernels' tolerance: their f32 accumulation inside the mma does not round to
/// nearest; measured up to 2.9e-5 here (5 rows of 8192 columns, SwiGLU of a normalised x), where the
/// FFMA kernels stay under 2e-6. An indexing or decoding bug costs ≥ 1e-3.
const TC_TOL: f64 = 5e-5;

/// The integer form's tolerance: its products and their sums within a round are exact (int32), x is
/// represented to ~1.2e-7 of each group's largest value, the rest is f32 arithmetic: well under the
/// bf16 form's. An indexing, plane or scale bug costs ≥ 1e-3.
const I8_TOL: f64 = 1e-5;

/// The tensor-core kernels (4-bit, group 64), both forms (bf16 planes: variants 9..=12; byte planes,
/// int8 mmas: 13..=16), with every K split a shape allows, against f64: plain, SwiGLU, rows that are
/// not whole 16-row tiles, 1 to 64 rounds of 128 columns; then each form with the fused norm and
/// residual add and indexed slots with a bad index.
/// A forced tensor-core variant (9..=20, as `affine_gemv::gemv_tuned` numbers them) as the benchmark
/// tables name it: its form and K split.
fn tc_form(variant: u32) -> String {
    let v = variant - 9;
    format!("{} k{}", ["tc", "i8", "tc d2"][v as usize / 4], 1 << (v % 4))
}

#[test]
fn gemv_tensor_cores_every_split() {
    let Some(dev) = device() else { return };
    let mut rng = Rng::new(31);
    let mut worst = 0.0f64;
    // (70000, 256): more row tiles than resident blocks, so blocks stride over tiles (lm_head's case).
    for (rows, cols) in [(77, 2048), (9, 512), (16, 128), (33, 256), (300, 1024), (17, 4096), (5, 8192), (1040, 2048), (70000, 256)] {
        let rounds = cols / 128;
        let w = affine_matrix(&mut rng, 3, rows, cols, 4, 64, "bf16");
        let u = affine_matrix(&mut rng, 3, rows, cols, 4, 64, "bf16");
        let (dw, du) = (upload_matrix(&dev, &w).unwrap(), upload_matrix(&dev, &u).unwrap());
        // x at the residual stream's scale, a norm weight around 1.
        let x: Vec<f32> = rng.vec(cols).iter().map(|v| 5.0 * v).collect();
        let nw: Vec<f32> = rng.vec(cols).iter().map(|v| 1.0 + 0.5 * v).collect();
        let (xd, nwd) = (dev.upload(&x).unwrap(), dev.upload(&nw).unwrap());
        let xn = ref_norm(&x, &nw, 1e-6);
        let y0 = rng.vec(rows);
        // The bf16 form, the integer form, the bf16 form with two rounds in flight (one matrix only).
        for (ks, (first, form, tol)) in [1usize, 2, 4, 8].into_iter().flat_map(|k| [(k, (9, "tc", TC_TOL)), (k, (13, "i8", I8_TOL)), (k, (17, "d2", TC_TOL))]) {
            let variant = first + ks.trailing_zeros();
            let label = format!("{form} [{rows}x{cols}] ks {ks}");
            let mut y = poisoned(&dev, rows);
            let r = affine_gemv::gemv_tuned(&dev, &dw, Select::matrix(2), &xd, false, &mut y, Q4Decode::Fast, variant);
            if rounds % ks != 0 {
                assert!(r.is_err(), "{label}: a split that does not divide the rounds is refused");
                continue;
            }
            r.unwrap();
            worst = worst.max(check(&dev.download(&y).unwrap(), &ref_gemv(&w, 2, &x), tol, &label));
            let mut y = poisoned(&dev, rows);
            let r = affine_gemv::swiglu_tuned(&dev, &dw, &du, Select::matrix(1), &xd, false, &mut y, variant);
            if form == "d2" {
                assert!(r.is_err(), "{label}: no SwiGLU kernel with two rounds in flight");
                continue;
            }
            r.unwrap();
            let want: Vec<f64> = ref_gemv(&w, 1, &x).iter().zip(ref_gemv(&u, 1, &x)).map(|(a, b)| silu64(*a) * b).collect();
            worst = worst.max(check(&dev.download(&y).unwrap(), &want, tol, &format!("{label} swiglu")));
        }
        // The integer form (automatic split) with the fused norm and residual, and indexed slots.
        {
            let fuse = affine_gemv::Fuse::rms_norm(&dev, &nwd, 1e-6);
            let mut y = dev.upload(&y0).unwrap();
            affine_gemv::gemv_fused_tuned(&dev, &dw, Select::matrix(1), &xd, false, &mut y, fuse.accumulate(), 13 + [1usize, 2, 4, 8].iter().rposition(|k| rounds % k == 0).unwrap() as u32).unwrap();
            let want: Vec<f64> = ref_gemv(&w, 1, &xn).iter().zip(&y0).map(|(a, b)| a + *b as f64).collect();
            worst = worst.max(check(&dev.download(&y).unwrap(), &want, I8_TOL, &format!("i8 [{rows}x{cols}] norm + residual")));
            let idx = dev.upload(&[1u32, 3, 2, 0]).unwrap(); // 3 is past the stack of 3
            let mut y = poisoned(&dev, 4 * rows);
            affine_gemv::swiglu_fused_tuned(&dev, &dw, &du, Select::indexed(&dev, &idx), &xd, false, &mut y, fuse, 13).unwrap();
            let got = dev.download(&y).unwrap();
            assert!(got[rows..2 * rows].iter().all(|v| v.is_nan()), "i8 [{rows}x{cols}]: the slot with a bad index must be NaN");
            for (slot, m) in [(0usize, 1usize), (2, 2), (3, 0)] {
                let want: Vec<f64> = ref_gemv(&w, m, &xn).iter().zip(ref_gemv(&u, m, &xn)).map(|(a, b)| silu64(*a) * b).collect();
                worst = worst.max(check(&got[slot * rows..(slot + 1) * rows], &want, I8_TOL, &format!("i8 [{rows}x{cols}] swiglu norm slot {slot}")));
            }
        }
        // Automatic split, with the fusions and indices.
        let fuse = affine_gemv::Fuse::rms_norm(&dev, &nwd, 1e-6);
        let mut y = dev.upload(&y0).unwrap();
        affine_gemv::gemv_fused(&dev, &dw, Select::matrix(0), &xd, false, &mut y, fuse.accumulate()).unwrap();
        let want: Vec<f64> = ref_gemv(&w, 0, &xn).iter().zip(&y0).map(|(a, b)| a + *b as f64).collect();
        worst = worst.max(check(&dev.download(&y).unwrap(), &want, TC_TOL, &format!("tc [{rows}x{cols}] norm + residual")));
        let idx = dev.upload(&[2u32, 0, 3, 1]).unwrap(); // 3 is past the stack of 3
        let mut y = poisoned(&dev, 4 * rows);
        affine_gemv::swiglu_fused(&dev, &dw, &du, Select::indexed(&dev, &idx), &xd, false, &mut y, fuse).unwrap();
        let got = dev.download(&y).unwrap();
        assert!(got[2 * rows..3 * rows].iter().all(|v| v.is_nan()), "tc [{rows}x{cols}]: the slot with a bad index must be NaN");
        for (slot, m) in [(0usize, 2usize), (1, 0), (3, 1)] {
            let want: Vec<f64> = ref_gemv(&w, m, &xn).iter().zip(ref_gemv(&u, m, &xn)).map(|(a, b)| silu64(*a) * b).collect();
            worst = worst.max(check(&got[slot * rows..(slot + 1) * rows], &want, TC_TOL, &format!("tc [{rows}x{cols}] swiglu norm slot {slot}")));
        }
        // Per-slot x (the down projection).
        let xs = rng.vec(2 * cols);
        let xsd = dev.upload(&xs).unwrap();
        let idx = dev.upload(&[1u32, 2]).unwrap();
        let mut y = poisoned(&dev, 2 * rows);
        affine_gemv::gemv(&dev, &dw, Select::indexed(&dev, &idx), &xsd, true, &mut y).unwrap();
        let mut want = ref_gemv(&w, 1, &xs[..cols]);
        want.extend(ref_gemv(&w, 2, &xs[cols..]));
        worst = worst.max(check(&dev.download(&y).unwrap(), &want, TC_TOL, &format!("tc [{rows}x{cols}] per-slot x")));
    }
    // Not for other formats.
    let w8 = upload_matrix(&dev, &affine_matrix(&mut rng, 1, 16, 256, 8, 64, "bf16")).unwrap();
    let x = dev.upload(&rng.vec(256)).unwrap();
    let mut y = poisoned(&dev, 16);
    assert!(affine_gemv::gemv_tuned(&dev, &w8, Select::matrix(0), &x, false, &mut y, Q4Decode::Fast, 9).is_err());
    println!("gemv tensor cores: worst relative error {worst:.2e} (tolerance {TC_TOL:.0e})");
}

#[test]
fn gemv_rejects_bad_lengths() {
    let Some(dev) = device() else { return };
    let mut rng = Rng::new(6);
    let w = affine_matrix(&mut rng, 2, 16, 128, 4, 64, "bf16");
    let dw = upload_matrix(&dev, &w).unwrap();
    let x = dev.upload(&rng.vec(127)).unwrap();
    let mut y = poisoned(&dev, 16);
    assert!(affine_gemv::gemv(&dev, &dw, Select::matrix(0), &x, false, &mut y).is_err(), "short x");
    let x = dev.upload(&rng.vec(128)).unwrap();
    let mut y_short = poisoned(&dev, 15);
    assert!(affine_gemv::gemv(&dev, &dw, Select::matrix(0), &x, false, &mut y_short).is_err(), "short y");
    assert!(affine_gemv::gemv(&dev, &dw, Select::matrix(2), &x, false, &mut y).is_err(), "matrix past the stack");
    let idx = dev.upload(&[0u32, 1]).unwrap();
    assert!(affine_gemv::gemv(&dev, &dw, Select::indexed(&dev, &idx), &x, true, &mut y).is_err(), "per-slot x too short");
}

// ---------------------------------------------------------------------------------------------------
// GEMV fusions (decode): the RMSNorm in the x staging, the residual add, the router's selection,
// the down projection with the combine.

/// RMSNorm(x) · w in f64, as `lily_cpu::norm::rms_norm` defines it.
fn ref_norm(x: &[f32], w: &[f32], eps: f32) -> Vec<f32> {
    let ss: f64 = x.iter().map(|v| (*v as f64) * (*v as f64)).sum();
    let inv = 1.0 / (ss / x.len() as f64 + eps as f64).sqrt();
    x.iter().zip(w).map(|(a, b)| (*a as f64 * inv * *b as f64) as f32).collect()
}

fn any_matrix(rng: &mut Rng, count: usize, rows: usize, cols: usize, bits: u32, gs: usize) -> Matrix {
    if bits == 16 { dense_matrix(rng, count, rows, cols) } else { affine_matrix(rng, count, rows, cols, bits, gs, "bf16") }
}

#[test]
fn gemv_fused_norm_and_residual() {
    let Some(dev) = device() else { return };
    let mut rng = Rng::new(21);
    let mut worst = 0.0f64;
    // Register and pipelined kernels (8192 columns of 4-bit take the pipelined one), every TPR.
    for (bits, gs, rows, cols) in [(4, 64, 300, 2048), (8, 64, 257, 2048), (16, 0, 50, 1024), (4, 32, 13, 96), (4, 64, 70, 8192), (8, 32, 9, 64)] {
        let w = any_matrix(&mut rng, 2, rows, cols, bits, gs);
        let dw = upload_matrix(&dev, &w).unwrap();
        // x with a large scale (the residual stream is not normalised), a norm weight around 1.
        let x: Vec<f32> = rng.vec(cols).iter().map(|v| 7.0 * v).collect();
        let nw: Vec<f32> = rng.vec(cols).iter().map(|v| 1.0 + 0.5 * v).collect();
        let eps = 1e-6f32;
        let (xd, nwd) = (dev.upload(&x).unwrap(), dev.upload(&nw).unwrap());
        let xn = ref_norm(&x, &nw, eps);
        let fuse = affine_gemv::Fuse::rms_norm(&dev, &nwd, eps);
        let mut y = poisoned(&dev, rows);
        affine_gemv::gemv_fused(&dev, &dw, Select::matrix(1), &xd, false, &mut y, fuse).unwrap();
        let want = ref_gemv(&w, 1, &xn);
        worst = worst.max(check(&dev.download(&y).unwrap(), &want, GEMV_TOL, &format!("norm q{bits} [{rows}x{cols}]")));
        // The residual add: y0 + W RMSNorm(x), and y0 + W x.
        let y0 = rng.vec(rows);
        let mut y = dev.upload(&y0).unwrap();
        affine_gemv::gemv_fused(&dev, &dw, Select::matrix(1), &xd, false, &mut y, fuse.accumulate()).unwrap();
        let want_acc: Vec<f64> = want.iter().zip(&y0).map(|(a, b)| a + *b as f64).collect();
        worst = worst.max(check(&dev.download(&y).unwrap(), &want_acc, GEMV_TOL, &format!("norm + residual q{bits} [{rows}x{cols}]")));
        let mut y = dev.upload(&y0).unwrap();
        affine_gemv::gemv_fused(&dev, &dw, Select::matrix(0), &xd, false, &mut y, affine_gemv::Fuse::none().accumulate()).unwrap();
        let want_plain: Vec<f64> = ref_gemv(&w, 0, &x).iter().zip(&y0).map(|(a, b)| a + *b as f64).collect();
        worst = worst.max(check(&dev.download(&y).unwrap(), &want_plain, GEMV_TOL, &format!("residual q{bits} [{rows}x{cols}]")));
        // SwiGLU on RMSNorm(x), indexed (the MoE gate+up) and on one matrix.
        let u = any_matrix(&mut rng, 2, rows, cols, bits, gs);
        let du = upload_matrix(&dev, &u).unwrap();
        let idx = dev.upload(&[1u32, 0, 1]).unwrap();
        let mut y = poisoned(&dev, 3 * rows);
        affine_gemv::swiglu_fused(&dev, &dw, &du, Select::indexed(&dev, &idx), &xd, false, &mut y, fuse).unwrap();
        let mut want_sw = Vec::new();
        for m in [1, 0, 1] {
            let (g, v) = (ref_gemv(&w, m, &xn), ref_gemv(&u, m, &xn));
            want_sw.extend(g.iter().zip(&v).map(|(g, v)| silu64(*g) * v));
        }
        worst = worst.max(check(&dev.download(&y).unwrap(), &want_sw, GEMV_TOL, &format!("swiglu norm q{bits} [{rows}x{cols}]")));
    }
    // Refused: a norm with per-slot inputs, accumulating several slots.
    let w = affine_matrix(&mut rng, 2, 16, 128, 4, 64, "bf16");
    let dw = upload_matrix(&dev, &w).unwrap();
    let nwd = dev.upload(&rng.vec(128)).unwrap();
    let fuse = affine_gemv::Fuse::rms_norm(&dev, &nwd, 1e-6);
    let idx = dev.upload(&[0u32, 1]).unwrap();
    let x2 = dev.upload(&rng.vec(256)).unwrap();
    let mut y = poisoned(&dev, 32);
    assert!(affine_gemv::gemv_fused(&dev, &dw, Select::indexed(&dev, &idx), &x2, true, &mut y, fuse).is_err(), "norm of per-slot x");
    let x1 = dev.upload(&rng.vec(128)).unwrap();
    assert!(affine_gemv::gemv_fused(&dev, &dw, Select::indexed(&dev, &idx), &x1, false, &mut y, affine_gemv::Fuse::none().accumulate()).is_err(), "accumulate 2 slots");
    println!("gemv fusions: worst relative error {worst:.2e} (tolerance {GEMV_TOL:.0e})");
}

#[test]
fn router_with_fused_selection_matches_cpu() {
    let Some(dev) = device() else { return };
    let mut rng = Rng::new(22);
    let mut counter = dev.zeros::<u32>(1).unwrap();
    // (bits, gs, experts, cols, k, renorm): the full-size router (256 + the shared gate row, 8-bit),
    // a tiny one, 4-bit and bf16 ones.
    for (bits, gs, e, cols, k, renorm) in [(8, 64, 256, 2048, 8, true), (8, 64, 256, 2048, 8, false), (4, 64, 64, 512, 4, true), (16, 0, 32, 256, 2, true), (4, 32, 512, 1024, 10, false)] {
        let rows = e + 1;
        let w = any_matrix(&mut rng, 1, rows, cols, bits, gs);
        let dw = upload_matrix(&dev, &w).unwrap();
        let x: Vec<f32> = rng.vec(cols).iter().map(|v| 3.0 * v).collect();
        let nw: Vec<f32> = rng.vec(cols).iter().map(|v| 1.0 + 0.5 * v).collect();
        let (xd, nwd) = (dev.upload(&x).unwrap(), dev.upload(&nw).unwrap());
        let fuse = affine_gemv::Fuse::rms_norm(&dev, &nwd, 1e-6);
        for rep in 0..3 {
            // Repeats: the counter must come back to 0 after each launch.
            let mut logits = poisoned(&dev, rows);
            let mut idx = dev.zeros::<u32>(k).unwrap();
            let mut wts = poisoned(&dev, k);
            affine_gemv::router_route(&dev, &dw, &xd, fuse, &mut logits, e, k, renorm, &mut counter, &mut idx, &mut wts).unwrap();
            let got = dev.download(&logits).unwrap();
            check(&got, &ref_gemv(&w, 0, &ref_norm(&x, &nw, 1e-6)), GEMV_TOL, &format!("router logits q{bits} e{e}"));
            // The selection from those logits, as the CPU makes it: exactly.
            let want = &lily_cpu::moe::route(&got[..e], e, k, renorm)[0];
            let (gi, gw) = (dev.download(&idx).unwrap(), dev.download(&wts).unwrap());
            for (j, &(wi, ww)) in want.iter().enumerate() {
                assert_eq!(gi[j] as usize, wi, "q{bits} e{e} k{k} rep {rep}: pick {j}");
                assert_eq!(gw[j].to_bits(), ww.to_bits(), "q{bits} e{e} k{k} rep {rep}: weight {j} {} vs {ww}", gw[j]);
            }
            assert_eq!(dev.download(&counter).unwrap()[0], 0, "counter left at 0");
        }
    }
    // Refused shapes.
    let w = upload_matrix(&dev, &affine_matrix(&mut rng, 1, 33, 256, 8, 64, "bf16")).unwrap();
    let xd = dev.upload(&rng.vec(256)).unwrap();
    let mut logits = poisoned(&dev, 33);
    let mut idx = dev.zeros::<u32>(40).unwrap();
    let mut wts = poisoned(&dev, 40);
    for (e, k) in [(34, 2), (32, 0), (32, 33), (0, 1)] {
        assert!(affine_gemv::router_route(&dev, &w, &xd, affine_gemv::Fuse::none(), &mut logits, e, k, true, &mut counter, &mut idx, &mut wts).is_err(), "e {e} k {k}");
    }
}

/// The MoE gate/up with the router's selection in each block (`affine_gemv::swiglu_select`): the picks
/// and weights bit for bit the CPU's selection from the same logits (ties included), the outputs bit
/// for bit the unfused indexed SwiGLU's over those picks and the shared expert, and within the GEMV
/// tolerance of f64; fresh logits each round; shapes it does not take refused.
#[test]
fn gate_up_with_fused_selection_matches_unfused() {
    let Some(dev) = device() else { return };
    let mut rng = Rng::new(24);
    let mut worst = 0.0f64;
    // (experts, rows, cols, k, renorm): the full-size MoE (256 + the shared expert, 512 x 2048, top 8)
    // both ways, a small one, and experts not a multiple of 32.
    for (e, rows, cols, k, renorm) in [(256, 512, 2048, 8, true), (256, 512, 2048, 8, false), (64, 128, 256, 4, true), (100, 256, 512, 6, false)] {
        let count = e + 1;
        let (g, u) = (affine_matrix(&mut rng, count, rows, cols, 4, 64, "bf16"), affine_matrix(&mut rng, count, rows, cols, 4, 64, "bf16"));
        let (dg, du) = (upload_matrix(&dev, &g).unwrap(), upload_matrix(&dev, &u).unwrap());
        assert!(affine_gemv::select_fits(&dg, &du, e, k), "e {e} k {k}");
        let x: Vec<f32> = rng.vec(cols).iter().map(|v| 5.0 * v).collect();
        let nw: Vec<f32> = rng.vec(cols).iter().map(|v| 1.0 + 0.5 * v).collect();
        let (xd, nwd) = (dev.upload(&x).unwrap(), dev.upload(&nw).unwrap());
        let fuse = affine_gemv::Fuse::rms_norm(&dev, &nwd, 1e-6);
        let xn = ref_norm(&x, &nw, 1e-6);
        for round in 0..4 {
            let mut logits: Vec<f32> = rng.vec(e).iter().map(|v| 4.0 * v).collect();
            // A tie among the likely picks: ties go to the lower index.
            let top = (0..e).max_by(|&a, &b| logits[a].total_cmp(&logits[b])).unwrap();
            let other = (top + 1 + rng.below(e - 1)) % e;
            logits[other] = logits[top];
            let ld = dev.upload(&logits).unwrap();
            let (mut idx, mut wts, mut y) = (dev.zeros::<u32>(k).unwrap(), poisoned(&dev, k), poisoned(&dev, (k + 1) * rows));
            affine_gemv::swiglu_select(&dev, &dg, &du, &ld, e, k, renorm, e, &xd, fuse, &mut idx, &mut wts, &mut y).unwrap();
            let what = format!("e {e} [{rows}x{cols}] k {k} renorm {renorm} round {round}");
            let want = &lily_cpu::moe::route(&logits, e, k, renorm)[0];
            let (gi, gw) = (dev.download(&idx).unwrap(), dev.download(&wts).unwrap());
            for (j, &(wi, ww)) in want.iter().enumerate() {
                assert_eq!(gi[j] as usize, wi, "{what}: pick {j}");
                assert_eq!(gw[j].to_bits(), ww.to_bits(), "{what}: weight {j} {} vs {ww}", gw[j]);
            }
            // The unfused indexed SwiGLU over the same picks and the shared expert.
            let mut picks: Vec<u32> = want.iter().map(|&(i, _)| i as u32).collect();
            picks.push(e as u32);
            let pd = dev.upload(&picks).unwrap();
            let mut y2 = poisoned(&dev, (k + 1) * rows);
            affine_gemv::swiglu_fused(&dev, &dg, &du, Select::indexed(&dev, &pd), &xd, false, &mut y2, fuse).unwrap();
            let (got, unfused) = (dev.download(&y).unwrap(), dev.download(&y2).unwrap());
            for (i, (a, b)) in got.iter().zip(&unfused).enumerate() {
                assert_eq!(a.to_bits(), b.to_bits(), "{what}: output {i} {a} vs unfused {b}");
            }
            let mut want_y = Vec::new();
            for &m in &picks {
                let (gv, uv) = (ref_gemv(&g, m as usize, &xn), ref_gemv(&u, m as usize, &xn));
                want_y.extend(gv.iter().zip(&uv).map(|(g, u)| silu64(*g) * u));
            }
            worst = worst.max(check(&got, &want_y, GEMV_TOL, &what));
        }
    }
    // Refused: more than 256 experts, k of 0 or past 32 or E, other weight formats.
    let (g, u) = (affine_matrix(&mut rng, 300, 16, 128, 4, 64, "bf16"), affine_matrix(&mut rng, 300, 16, 128, 4, 64, "bf16"));
    let (dg, du) = (upload_matrix(&dev, &g).unwrap(), upload_matrix(&dev, &u).unwrap());
    let (ld, xd) = (dev.upload(&rng.vec(300)).unwrap(), dev.upload(&rng.vec(128)).unwrap());
    let (mut idx, mut wts, mut y) = (dev.zeros::<u32>(40).unwrap(), poisoned(&dev, 40), poisoned(&dev, 41 * 16));
    for (e, k) in [(257, 8), (32, 0), (64, 33), (4, 5)] {
        assert!(!affine_gemv::select_fits(&dg, &du, e, k), "e {e} k {k}");
        assert!(affine_gemv::swiglu_select(&dev, &dg, &du, &ld, e, k, true, 299, &xd, affine_gemv::Fuse::none(), &mut idx, &mut wts, &mut y).is_err(), "e {e} k {k}");
    }
    let (g8, u8_) = (affine_matrix(&mut rng, 9, 16, 128, 8, 64, "bf16"), affine_matrix(&mut rng, 9, 16, 128, 8, 64, "bf16"));
    let (dg8, du8) = (upload_matrix(&dev, &g8).unwrap(), upload_matrix(&dev, &u8_).unwrap());
    assert!(!affine_gemv::select_fits(&dg8, &du8, 8, 2), "8-bit weights");
    println!("gate/up with the selection: worst relative error {worst:.2e} (tolerance {GEMV_TOL:.0e})");
}

#[test]
fn down_with_fused_combine_matches_reference() {
    let Some(dev) = device() else { return };
    let mut rng = Rng::new(23);
    let mut worst = 0.0f64;
    // (bits, gs, count, rows, cols, k): the full-size down projection (512 -> 2048, 8 + shared), and
    // rows of 4..64 chunks.
    // The tensor-core kernel takes the 4-bit, group-64 shapes here of up to 64 (slot, round) units
    // (36, 32, 2, 1, 64, 56, 15, 12); the one of 256 and 240 units takes the FFMA kernel.
    for (bits, gs, count, rows, cols, k) in [
        (4, 64, 12, 2048, 512, 8),
        (8, 32, 6, 100, 256, 3),
        (4, 32, 5, 37, 96, 2),
        (16, 0, 4, 50, 264, 2),
        (4, 64, 20, 64, 2048, 15),
        (4, 64, 9, 33, 128, 1),
        (4, 64, 7, 300, 1024, 7),
        (4, 64, 5, 21, 384, 4),
    ] {
        let w = any_matrix(&mut rng, count, rows, cols, bits, gs);
        let dw = upload_matrix(&dev, &w).unwrap();
        for shared in [true, false] {
            let ns = k + shared as usize;
            let idx_h: Vec<u32> = (0..ns).map(|_| rng.below(count) as u32).collect();
            let x = rng.vec(ns * cols);
            let rw: Vec<f32> = (0..k).map(|_| rng.f32().abs() + 0.01).collect();
            let gate = 2.0 * rng.f32();
            let y0 = rng.vec(rows);
            let (idx, xd, rwd, gd) = (dev.upload(&idx_h).unwrap(), dev.upload(&x).unwrap(), dev.upload(&rw).unwrap(), dev.upload(&[gate]).unwrap());
            let mut want = vec![0.0f64; rows];
            for j in 0..ns {
                let c = if j < k { rw[j] as f64 } else { 1.0 / (1.0 + (-(gate as f64)).exp()) };
                for (o, v) in want.iter_mut().zip(ref_gemv(&w, idx_h[j] as usize, &x[j * cols..(j + 1) * cols])) {
                    *o += c * v;
                }
            }
            let g = if shared { Some(&gd) } else { None };
            // Both kernels: the tensor-core one takes the 4-bit, group-64 shapes of few enough units
            // (its f32 sums are the tensor cores', hence TC_TOL), the FFMA one the rest and, forced, those.
            let tc = bits == 4 && gs == 64 && cols % 128 == 0 && (ns * cols / 128).div_ceil(8) <= 8;
            for use_tc in [true, false] {
                let tol = if use_tc && tc { TC_TOL } else { GEMV_TOL };
                let label = format!("mix q{bits} [{count}x{rows}x{cols}] k{k} shared={shared} {}", if use_tc && tc { "tc" } else { "ffma" });
                let mut y = poisoned(&dev, rows);
                affine_gemv::down_mix_with(&dev, &dw, &idx, &xd, &rwd, g, k, false, &mut y, use_tc).unwrap();
                worst = worst.max(check(&dev.download(&y).unwrap(), &want, tol, &label));
                let mut y = dev.upload(&y0).unwrap();
                affine_gemv::down_mix_with(&dev, &dw, &idx, &xd, &rwd, g, k, true, &mut y, use_tc).unwrap();
                let want_acc: Vec<f64> = want.iter().zip(&y0).map(|(a, b)| a + *b as f64).collect();
                worst = worst.max(check(&dev.download(&y).unwrap(), &want_acc, tol, &format!("{label} + residual")));
            }
        }
    }
    // An index past the stack poisons the output; too many slots are refused.
    let w = any_matrix(&mut rng, 4, 40, 256, 4, 64);
    let dw = upload_matrix(&dev, &w).unwrap();
    let idx = dev.upload(&[1u32, 4, 0]).unwrap();
    let xd = dev.upload(&rng.vec(3 * 256)).unwrap();
    let rwd = dev.upload(&[0.5f32, 0.25, 0.25]).unwrap();
    let mut y = poisoned(&dev, 40);
    util::fill(&dev, &mut y, 0.5).unwrap();
    for use_tc in [true, false] {
        util::fill(&dev, &mut y, 0.5).unwrap();
        affine_gemv::down_mix_with(&dev, &dw, &idx, &xd, &rwd, None::<&CudaSlice<f32>>, 3, false, &mut y, use_tc).unwrap();
        assert!(dev.download(&y).unwrap().iter().all(|v| v.is_nan()), "a bad index must poison the rows (tc {use_tc})");
    }
    let idx17 = dev.upload(&[0u32; 17]).unwrap();
    let x17 = dev.upload(&rng.vec(17 * 256)).unwrap();
    let rw17 = dev.upload(&[0.1f32; 17]).unwrap();
    assert!(affine_gemv::down_mix(&dev, &dw, &idx17, &x17, &rw17, None::<&CudaSlice<f32>>, 17, false, &mut y).is_err());
    println!("down + combine: worst relative error {worst:.2e} (tolerance {GEMV_TOL:.0e})");
}

// ---------------------------------------------------------------------------------------------------
// RMSNorm

/// The fused MoE decode kernel (selection, SwiGLU of the k chosen and the shared expert, down
/// projections, weighted sum, residual add; one grid barrier) against f64 from the stored bytes, its
/// picks against `moe_route::route`'s, over 6 launches with fresh x and logits under PDL (the barrier's
/// counter carries across launches): the full-size shapes (E = 256, k = 8, H = 2048, I = 512) and
/// smaller ones taking each kernel variant.
#[test]
fn moe_decode_fused_matches_reference() {
    use lily_cuda::ops::moe_decode;
    let Some(dev) = device() else { return };
    let mut rng = Rng::new(45);
    let mut worst = 0.0f64;
    // (h, i, e, k, renorm): variants u2 (3 slots x 4 rounds), u5 (5 x 4; 9 x 4), u8 (7 x 8).
    for (h, i, e, k, renorm) in [(512usize, 512usize, 8usize, 2usize, true), (512, 512, 16, 4, false), (2048, 512, 256, 8, true), (1024, 1024, 64, 6, true)] {
        let gate = affine_matrix(&mut rng, e + 1, i, h, 4, 64, "bf16");
        let up = affine_matrix(&mut rng, e + 1, i, h, 4, 64, "bf16");
        let down = affine_matrix(&mut rng, e + 1, h, i, 4, 64, "bf16");
        let (dg, du, dd) = (upload_matrix(&dev, &gate).unwrap(), upload_matrix(&dev, &up).unwrap(), upload_matrix(&dev, &down).unwrap());
        let plan = moe_decode::plan(&dev, &dg, &du, &dd, e, k).unwrap().expect("the fused MoE decode takes these shapes");
        let nw: Vec<f32> = rng.vec(h).iter().map(|v| 1.0 + 0.5 * v).collect();
        let nwd = dev.upload(&nw).unwrap();
        let mut act = poisoned(&dev, (k + 1) * i);
        let mut barrier = dev.zeros::<u64>(1).unwrap();
        let (mut idx, mut w) = (dev.zeros::<u32>(k).unwrap(), dev.zeros::<f32>(k).unwrap());
        let (mut ridx, mut rw) = (dev.zeros::<u32>(k).unwrap(), dev.zeros::<f32>(k).unwrap());
        for round in 0..6 {
            let x: Vec<f32> = rng.vec(h).iter().map(|v| 3.0 * v).collect();
            let logits: Vec<f32> = rng.vec(e + 1).iter().map(|v| 2.0 * v).collect();
            let (mut xd, ld) = (dev.upload(&x).unwrap(), dev.upload(&logits).unwrap());
            dev.set_pdl(true);
            lily_cuda::ops::moe_route::route(&dev, &ld, 1, e, k, renorm, &mut ridx, &mut rw).unwrap();
            let chosen = moe_decode::Chosen { idx: &mut idx, w: &mut w };
            moe_decode::run(&dev, &plan, &dg, &du, &dd, &ld, &nwd, 1e-6, e, k, renorm, &mut xd, &mut act, &mut barrier, Some(chosen), None).unwrap();
            dev.set_pdl(false);
            let label = format!("moe decode h {h} i {i} e {e} k {k} round {round}");
            let (gi, gw) = (dev.download(&idx).unwrap(), dev.download(&w).unwrap());
            assert_eq!(gi, dev.download(&ridx).unwrap(), "{label}: picks differ from moe_route");
            assert!(gw.iter().zip(dev.download(&rw).unwrap()).all(|(a, b)| a.to_bits() == b.to_bits()), "{label}: weights differ from moe_route");
            // f64: the chosen experts and the shared one (matrix e, weight sigmoid(logits[e])).
            let n = ref_norm(&x, &nw, 1e-6);
            let mut slots: Vec<(usize, f64)> = gi.iter().zip(&gw).map(|(&m, &c)| (m as usize, c as f64)).collect();
            slots.push((e, 1.0 / (1.0 + (-(logits[e] as f64)).exp())));
            let mut y = vec![0.0f64; h];
            for &(m, c) in &slots {
                let a: Vec<f64> = ref_gemv(&gate, m, &n).iter().zip(ref_gemv(&up, m, &n)).map(|(g, u)| silu64(*g) * u).collect();
                let a32: Vec<f32> = a.iter().map(|v| *v as f32).collect();
                for (yy, d) in y.iter_mut().zip(ref_gemv(&down, m, &a32)) {
                    *yy += c * d;
                }
            }
            let got: Vec<f32> = dev.download(&xd).unwrap().iter().zip(&x).map(|(a, b)| a - b).collect();
            worst = worst.max(check(&got, &y, 1e-4, &label));
        }
        assert_eq!(dev.download(&barrier).unwrap()[0], 6 * dev.sm_count() as u64, "the barrier counter grows by the grid each launch");
    }
    println!("moe decode fused: picks identical to moe_route; worst relative error {worst:.2e} (tolerance 1e-4)");
}

/// The persistent GEMV chain (`gemv_chain.cu`): every op's output against f64 from the GPU's own input
/// to that op (RMSNorm, then the product), in every form (copies ahead of the wait or after it, and
/// the options of the first), two launches each (the counters' second generation); ops with fewer tiles than blocks and more, an op
/// reading an output two ops back, matrices past the first of their stack; bad shapes refused.
#[test]
fn gemv_chain_matches_reference() {
    use lily_cuda::ops::gemv_chain::{Chain, Form, Link, FORMS};
    let Some(dev) = device() else { return };
    let mut rng = Rng::new(61);
    // (rows, cols, matrix, x buffer, y buffer); buffer 0 is the chain's input.
    let shape: [(usize, usize, usize, usize, usize); 6] =
        [(2048, 512, 1, 0, 1), (512, 2048, 0, 1, 2), (4096, 512, 1, 2, 3), (1024, 4096, 0, 3, 4), (3072, 1024, 1, 4, 5), (512, 2048, 1, 1, 6)];
    let mats: Vec<Matrix> = shape.iter().map(|&(r, c, ..)| affine_matrix(&mut rng, 2, r, c, 4, 64, "bf16")).collect();
    let dmats: Vec<DeviceMatrix> = mats.iter().map(|m| upload_matrix(&dev, m).unwrap()).collect();
    let norms: Vec<Vec<f32>> = shape.iter().map(|&(_, c, ..)| rng.vec(c).iter().map(|v| 1.0 + 0.5 * v).collect()).collect();
    let dnorms: Vec<CudaSlice<f32>> = norms.iter().map(|n| dev.upload(n).unwrap()).collect();
    let sizes = [512usize, 2048, 512, 4096, 1024, 3072, 512];
    let mut bufs: Vec<CudaSlice<f32>> = sizes.iter().map(|&n| poisoned(&dev, n)).collect();
    let eps = 1e-6f32;
    let mut worst = 0.0f64;
    for form in FORMS {
        for launch in 0..2 {
            let x0: Vec<f32> = rng.vec(512).iter().map(|v| 5.0 * v).collect();
            dev.upload_into(&x0, &mut bufs[0]).unwrap();
            for (b, &n) in bufs.iter_mut().zip(&sizes).skip(1) {
                util::fill(&dev, b, f32::NAN).unwrap();
                assert_eq!(b.len(), n);
            }
            let links: Vec<Link> =
                shape.iter().enumerate().map(|(i, &(_, _, m, x, y))| Link { w: &dmats[i], matrix: m, norm_w: &dnorms[i], x, y }).collect();
            let mut chain = Chain::new(&dev, &links, &bufs, eps).unwrap();
            chain.run(&dev, form).unwrap();
            let got: Vec<Vec<f32>> = bufs.iter().map(|b| dev.download(b).unwrap()).collect();
            for (i, &(_, _, m, x, y)) in shape.iter().enumerate() {
                let want = ref_gemv(&mats[i], m, &ref_norm(&got[x], &norms[i], eps));
                let tol = if form == Form::AheadI8 { I8_TOL } else { TC_TOL };
                worst = worst.max(check(&got[y], &want, tol, &format!("chain op {i} ({form:?}, launch {launch})")));
            }
        }
    }
    // Refused: cols not a multiple of 512; an op writing its own input; a buffer out of range.
    let bad = upload_matrix(&dev, &affine_matrix(&mut rng, 1, 16, 256, 4, 64, "bf16")).unwrap();
    let nb = dev.upload(&rng.vec(256)).unwrap();
    assert!(Chain::new(&dev, &[Link { w: &bad, matrix: 0, norm_w: &nb, x: 0, y: 1 }], &bufs, eps).is_err(), "cols 256");
    assert!(Chain::new(&dev, &[Link { w: &dmats[0], matrix: 0, norm_w: &dnorms[0], x: 1, y: 1 }], &bufs, eps).is_err(), "y = x");
    assert!(Chain::new(&dev, &[Link { w: &dmats[0], matrix: 0, norm_w: &dnorms[0], x: 0, y: 9 }], &bufs, eps).is_err(), "no buffer 9");
    assert!(Chain::new(&dev, &[Link { w: &dmats[0], matrix: 2, norm_w: &dnorms[0], x: 0, y: 1 }], &bufs, eps).is_err(), "matrix 2 of 2");
    println!("gemv chain: worst relative error {worst:.2e} (tolerance {TC_TOL:.0e})");
}

/// `Device::set_knockout` (the decode ledger's marginal costs): the kernels launched after a mark of
/// the knocked-out op are skipped (the output keeps its poison), those after another mark run, and
/// none is skipped once the knock-out ends.
#[test]
fn knockout_skips_only_the_named_op() {
    let Some(dev) = device() else { return };
    let mut rng = Rng::new(71);
    let (rows, n) = (3usize, 256usize);
    let x = dev.upload(&rng.vec(rows * n)).unwrap();
    let w = dev.upload(&rng.vec(n)).unwrap();
    let run = |label: &'static str| {
        let mut y = poisoned(&dev, rows * n);
        dev.mark(label, 0, 0).unwrap();
        rmsnorm::rms_norm(&dev, &x, &w, 1e-6, rows, &mut y).unwrap();
        dev.download(&y).unwrap().iter().all(|v| v.is_finite())
    };
    dev.set_knockout(Some("probe.off"));
    assert!(!run("probe.off"), "a knocked-out op's kernel ran");
    assert!(run("probe.on"), "another op's kernel was skipped");
    assert!(!run("probe.off"), "the knock-out did not come back with its mark");
    dev.set_knockout(None);
    assert!(run("probe.off"), "a kernel was skipped after the knock-out ended");
}

/// The fused residual add and norm that also writes its rows as the half numerics' staged x
/// (`rmsnorm::add_rms_norm` with a staging) against it without one, then the GEMM's stager (`gemm_wgmma::
/// stage_half`), bit for bit: the residual stream, y, the f16 plane and the rows' scales (rows' sizes
/// spread over ±20 powers of ten). Then the staging buffers as the MoE uses them: after the norm staged
/// y through `prestage_half`, a GEMM on y in the folded numerics that promises y unwritten (the router)
/// leaves the half staging in place, so a half GEMM that takes only the staged copy runs and equals
/// the one that stages y itself; after a call without the promise it refuses.
#[test]
fn add_rms_norm_stage_equals_norm_then_stage() {
    use lily_cuda::ops::gemm::{self, Opts, Precision};
    use lily_cuda::ops::gemm_wgmma::{self, ExactStage, HalfStage, Stager};
    use rmsnorm::Staging;
    let Some(dev) = device() else { return };
    let mut rng = Rng::new(77);
    for (n, rows) in [(2048usize, 37usize), (512, 5), (4096, 3), (64, 2)] {
        assert!(rmsnorm::stage_fits(n));
        let eps = 1e-6;
        let mut x = rng.vec(rows * n);
        for r in 0..rows {
            let m = 10f32.powf(20.0 * rng.f32());
            x[r * n..(r + 1) * n].iter_mut().for_each(|v| *v *= m);
        }
        let (res, w) = (rng.vec(rows * n), (0..n).map(|_| 1.0 + 0.5 * rng.f32()).collect::<Vec<f32>>());
        let (xd, wd) = (dev.upload(&x).unwrap(), dev.upload(&w).unwrap());
        // The norm, then the stager.
        let mut r_ref = dev.upload(&res).unwrap();
        let mut y_ref = poisoned(&dev, rows * n);
        rmsnorm::add_rms_norm(&dev, &xd, &mut r_ref, &wd, eps, rows, &mut y_ref, None).unwrap();
        let (want, want_s) = gemm_wgmma::stage_half(&dev, &y_ref, rows, n, Stager::Rows).unwrap();
        let (want_hi, want_lo, want_sums) = gemm_wgmma::stage_exact(&dev, &y_ref, rows, n).unwrap();
        let bits = |v: Vec<f32>| v.into_iter().map(f32::to_bits).collect::<Vec<_>>();
        // The fused form: the half staging alone, then with the folded one beside it.
        for with_exact in [false, true] {
            let mut r = dev.upload(&res).unwrap();
            let mut y = poisoned(&dev, rows * n);
            let (mut plane, mut scales) = (dev.zeros::<u16>(rows * n).unwrap(), dev.zeros::<f32>(rows).unwrap());
            // The folded buffers start as garbage (not zeros), so that an unwritten element shows.
            let mut hi = dev.upload(&vec![0xA5A5u16; rows * n]).unwrap();
            let mut lo = dev.upload(&vec![0x5A5Au16; rows * n]).unwrap();
            let mut sums = poisoned(&dev, rows * n / 64);
            let st = HalfStage::into_buffers(&dev, &mut plane, &mut scales, rows, n).unwrap();
            let es = ExactStage::into_buffers(&dev, &mut hi, &mut lo, &mut sums, rows, n).unwrap();
            let staging = Staging { half: &st, exact: with_exact.then_some(&es) };
            rmsnorm::add_rms_norm(&dev, &xd, &mut r, &wd, eps, rows, &mut y, Some(staging)).unwrap();
            assert_eq!(bits(dev.download(&r).unwrap()), bits(dev.download(&r_ref).unwrap()), "n={n}: residual stream");
            assert_eq!(bits(dev.download(&y).unwrap()), bits(dev.download(&y_ref).unwrap()), "n={n}: y");
            assert_eq!(bits(dev.download(&scales).unwrap()), bits(dev.download(&want_s).unwrap()), "n={n}: scales");
            assert_eq!(dev.download(&plane).unwrap(), dev.download(&want).unwrap(), "n={n}: plane");
            if with_exact {
                assert_eq!(dev.download(&hi).unwrap(), dev.download(&want_hi).unwrap(), "n={n}: folded hi plane");
                assert_eq!(dev.download(&lo).unwrap(), dev.download(&want_lo).unwrap(), "n={n}: folded lo plane");
                assert_eq!(bits(dev.download(&sums).unwrap()), bits(dev.download(&want_sums).unwrap()), "n={n}: folded group sums");
            } else {
                assert!(dev.download(&hi).unwrap().iter().all(|&b| b == 0xA5A5), "n={n}: the half form wrote the folded plane");
            }
            println!("add_rms_norm with a staging n={n} rows={rows} (folded too: {with_exact}): bit for bit the norm + stagers");
            // A wrong staging shape is refused, the half's or the folded one's.
            let st_bad = HalfStage::into_buffers(&dev, &mut plane, &mut scales, rows - 1, n).unwrap();
            let bad = Staging { half: &st_bad, exact: None };
            assert!(rmsnorm::add_rms_norm(&dev, &xd, &mut r, &wd, eps, rows, &mut y, Some(bad)).is_err());
            let es_bad = ExactStage::into_buffers(&dev, &mut hi, &mut lo, &mut sums, rows - 1, n).unwrap();
            let bad = Staging { half: &st, exact: Some(&es_bad) };
            assert!(rmsnorm::add_rms_norm(&dev, &xd, &mut r, &wd, eps, rows, &mut y, Some(bad)).is_err());
        }
    }
    assert!(!rmsnorm::stage_fits(100) && !rmsnorm::stage_fits(16 * 1024));

    // The staging buffers between the norm and the MoE's GEMMs.
    let (rows, n, m) = (40usize, 512usize, 96usize);
    let wm = upload_matrix(&dev, &affine_matrix(&mut rng, 1, m, n, 4, 64, "bf16")).unwrap();
    let half = Opts { precision: Precision::Half, ..Default::default() };
    let exact = Opts { precision: Precision::Exact, ..Default::default() };
    assert!(gemm::takes_prestaged_half(&wm, half), "the 4-bit matrix runs on the half wgmma tiles");
    {
        let (xd, wd) = (dev.upload(&rng.vec(rows * n)).unwrap(), dev.upload(&rng.vec(n)).unwrap());
        let mut r = dev.upload(&rng.vec(rows * n)).unwrap();
        let mut y = poisoned(&dev, rows * n);
        let st = gemm_wgmma::prestage_half(&dev, &y, rows, n).unwrap();
        rmsnorm::add_rms_norm(&dev, &xd, &mut r, &wd, 1e-6, rows, &mut y, Some(Staging { half: &st, exact: None })).unwrap();
        let mut ye = poisoned(&dev, rows * m);
        gemm::gemm_with(&dev, &wm, 0, &y, rows, &mut ye, Opts { reuse_x: true, ..exact }).unwrap();
        let mut yh = poisoned(&dev, rows * m);
        gemm::gemm_with(&dev, &wm, 0, &y, rows, &mut yh, Opts { x_staged_only: true, ..half }).unwrap();
        // References, each staging y itself.
        let (mut ye_ref, mut yh_ref) = (poisoned(&dev, rows * m), poisoned(&dev, rows * m));
        gemm::gemm_with(&dev, &wm, 0, &y, rows, &mut ye_ref, exact).unwrap();
        gemm::gemm_with(&dev, &wm, 0, &y, rows, &mut yh_ref, half).unwrap();
        assert_eq!(dev.download(&ye).unwrap(), dev.download(&ye_ref).unwrap(), "the folded GEMM beside the half staging");
        assert_eq!(dev.download(&yh).unwrap(), dev.download(&yh_ref).unwrap(), "the half GEMM on the norm's staging");
        // A folded call without the promise leaves only its own staging.
        gemm::gemm_with(&dev, &wm, 0, &y, rows, &mut ye, exact).unwrap();
        assert!(gemm::gemm_with(&dev, &wm, 0, &y, rows, &mut yh, Opts { x_staged_only: true, ..half }).is_err());
    }
    // Both stagings written by the norm (the post-mixer norm before the router and the experts): an
    // 8-bit router in its folded numerics and the 4-bit experts in the half ones each run on the norm's
    // staging alone — the buffers are filled with a decoy x's staging first, then y's f32 values are
    // overwritten, so a GEMM that staged y itself would read the decoy.
    {
        let router = upload_matrix(&dev, &affine_matrix(&mut rng, 1, m + 1, n, 8, 64, "bf16")).unwrap();
        assert!(gemm::takes_prestaged_exact(&router, half), "the 8-bit router runs on the folded wgmma tiles");
        assert!(!gemm::takes_prestaged_exact(&wm, half) && gemm::takes_prestaged_exact(&wm, exact));
        let (xd, wd, res) = (dev.upload(&rng.vec(rows * n)).unwrap(), dev.upload(&rng.vec(n)).unwrap(), rng.vec(rows * n));
        let mut r = dev.upload(&res).unwrap();
        let mut y = poisoned(&dev, rows * n);
        let (hs, es) = gemm_wgmma::prestage_half_exact(&dev, &y, rows, n).unwrap();
        rmsnorm::add_rms_norm(&dev, &xd, &mut r, &wd, 1e-6, rows, &mut y, Some(Staging { half: &hs, exact: Some(&es) })).unwrap();
        // References on y, each staging it itself (Fresh), into their own outputs.
        let y_host = dev.download(&y).unwrap();
        let (mut yr_ref, mut yh_ref) = (poisoned(&dev, rows * (m + 1)), poisoned(&dev, rows * m));
        gemm::gemm_with(&dev, &router, 0, &y, rows, &mut yr_ref, half).unwrap();
        gemm::gemm_with(&dev, &wm, 0, &y, rows, &mut yh_ref, half).unwrap();
        // Again from the norm's stagings: restage both by the norm, then make y's f32 values a decoy.
        let mut r = dev.upload(&res).unwrap();
        let (hs, es) = gemm_wgmma::prestage_half_exact(&dev, &y, rows, n).unwrap();
        rmsnorm::add_rms_norm(&dev, &xd, &mut r, &wd, 1e-6, rows, &mut y, Some(Staging { half: &hs, exact: Some(&es) })).unwrap();
        assert_eq!(dev.download(&y).unwrap(), y_host);
        let decoy: Vec<f32> = y_host.iter().map(|v| -2.0 * v).collect();
        dev.upload_into(&decoy, &mut y).unwrap();
        let (mut yr, mut yh) = (poisoned(&dev, rows * (m + 1)), poisoned(&dev, rows * m));
        gemm::gemm_with(&dev, &router, 0, &y, rows, &mut yr, Opts { reuse_x: true, ..half }).unwrap();
        gemm::gemm_with(&dev, &wm, 0, &y, rows, &mut yh, Opts { reuse_x: true, ..half }).unwrap();
        let bits = |v: Vec<f32>| v.into_iter().map(f32::to_bits).collect::<Vec<_>>();
        assert_eq!(bits(dev.download(&yr).unwrap()), bits(dev.download(&yr_ref).unwrap()), "the router on the norm's folded staging");
        assert_eq!(bits(dev.download(&yh).unwrap()), bits(dev.download(&yh_ref).unwrap()), "the experts on the norm's half staging");
        println!("the router and the experts on the post-mixer norm's two stagings: bit for bit their own stagings");
    }
}

#[test]
fn rmsnorm_matches_cpu() {
    let Some(dev) = device() else { return };
    let mut rng = Rng::new(7);
    let mut worst = 0.0f64;
    for &n in &[2048usize, 256, 128, 250, 4096, 7] {
        for &rows in &[1usize, 5] {
            let eps = 1e-6;
            let (x, w, r) = (rng.vec(rows * n), rng.vec(n), rng.vec(rows * n));
            let (xd, wd) = (dev.upload(&x).unwrap(), dev.upload(&w).unwrap());
            // Plain.
            let mut y = poisoned(&dev, rows * n);
            rmsnorm::rms_norm(&dev, &xd, &wd, eps, rows, &mut y).unwrap();
            let mut want = vec![0.0f32; rows * n];
            lily_cpu::norm::rms_norm(&x, &w, eps, &mut want);
            let want64: Vec<f64> = want.iter().map(|v| *v as f64).collect();
            worst = worst.max(check(&dev.download(&y).unwrap(), &want64, 1e-5, &format!("rmsnorm n={n} rows={rows}")));
            // Fused residual, in place.
            let mut rd = dev.upload(&r).unwrap();
            let mut y = poisoned(&dev, rows * n);
            rmsnorm::add_rms_norm(&dev, &xd, &mut rd, &wd, eps, rows, &mut y, None).unwrap();
            let h: Vec<f32> = x.iter().zip(&r).map(|(a, b)| a + b).collect();
            assert_eq!(dev.download(&rd).unwrap(), h, "residual stream n={n}");
            lily_cpu::norm::rms_norm(&h, &w, eps, &mut want);
            let want64: Vec<f64> = want.iter().map(|v| *v as f64).collect();
            worst = worst.max(check(&dev.download(&y).unwrap(), &want64, 1e-5, &format!("add_rmsnorm n={n} rows={rows}")));
        }
    }
    // A misaligned view (offset by one float) takes the scalar path and is still right.
    let n = 512;
    let (x, w) = (rng.vec(n + 1), rng.vec(n));
    let (xd, wd) = (dev.upload(&x).unwrap(), dev.upload(&w).unwrap());
    let mut y = poisoned(&dev, n);
    rmsnorm::rms_norm(&dev, &xd.slice(1..), &wd, 1e-6, 1, &mut y).unwrap();
    let mut want = vec![0.0f32; n];
    lily_cpu::norm::rms_norm(&x[1..], &w, 1e-6, &mut want);
    let want64: Vec<f64> = want.iter().map(|v| *v as f64).collect();
    check(&dev.download(&y).unwrap(), &want64, 1e-5, "rmsnorm misaligned");
    println!("rmsnorm: worst relative error {worst:.2e}");
}

// ---------------------------------------------------------------------------------------------------
// Embedding

#[test]
fn embed_matches_cpu_bit_for_bit() {
    let Some(dev) = device() else { return };
    let mut rng = Rng::new(8);
    let mut tables: Vec<Matrix> = Vec::new();
    for bits in [4u32, 8] {
        for gs in [32usize, 64, 128] {
            tables.push(affine_matrix(&mut rng, 1, 301, 384, bits, gs, "bf16"));
        }
    }
    tables.push(dense_matrix(&mut rng, 1, 301, 200));
    for t in &tables {
        let dt = upload_matrix(&dev, t).unwrap();
        let mut ids: Vec<u32> = (0..40).map(|_| rng.below(t.rows) as u32).collect();
        ids.extend([0, t.rows as u32 - 1, ids[3]]);
        let idd = dev.upload(&ids).unwrap();
        let mut out = poisoned(&dev, ids.len() * t.cols);
        embed::embed(&dev, &dt, &idd, &mut out).unwrap();
        let got = dev.download(&out).unwrap();
        let mut want = vec![0.0f32; ids.len() * t.cols];
        for (i, &id) in ids.iter().enumerate() {
            lily_cpu::linear::embed_row(t, id as usize, &mut want[i * t.cols..(i + 1) * t.cols]);
        }
        assert!(got.iter().all(|v| v.is_finite()), "every element written");
        assert_eq!(got, want, "embed {}-bit g{:?}", dt.bits(), dt.group_size());
    }
    // An output that is not 16-byte aligned takes the scalar stores.
    let dt = upload_matrix(&dev, &tables[1]).unwrap();
    let ids: Vec<u32> = (0..9).map(|_| rng.below(301) as u32).collect();
    let idd = dev.upload(&ids).unwrap();
    let mut out = poisoned(&dev, 1 + ids.len() * 384);
    embed::embed(&dev, &dt, &idd, &mut out.slice_mut(1..)).unwrap();
    let got = dev.download(&out).unwrap();
    let mut want = vec![0.0f32; ids.len() * 384];
    for (i, &id) in ids.iter().enumerate() {
        lily_cpu::linear::embed_row(&tables[1], id as usize, &mut want[i * 384..(i + 1) * 384]);
    }
    assert_eq!(&got[1..], &want[..], "embed into a misaligned view");

    // An id past the table gives a NaN row, the others are unaffected.
    let dt = upload_matrix(&dev, &tables[0]).unwrap();
    let idd = dev.upload(&[5u32, 301, 7]).unwrap();
    let mut out = poisoned(&dev, 3 * 384);
    util::fill(&dev, &mut out, 0.25).unwrap();
    embed::embed(&dev, &dt, &idd, &mut out).unwrap();
    let got = dev.download(&out).unwrap();
    assert!(got[384..768].iter().all(|v| v.is_nan()));
    let mut want = vec![0.0f32; 384];
    lily_cpu::linear::embed_row(&tables[0], 7, &mut want);
    assert_eq!(&got[768..], &want[..]);
}

// ---------------------------------------------------------------------------------------------------
// Timing table (run with `--ignored bench_ops`; tools/gpu_check.sh does)

const PEAK: f64 = 4.3e12; // bytes/s: the H200's sustained device-to-device copy rate measured here

/// Random stack of `count` `[rows, cols]` affine matrices built directly (no quantiser: benchmarks only
/// need realistic, non-zero bytes).
fn bench_affine(up: &mut Uploader, rng: &mut Rng, count: usize, rows: usize, cols: usize, bits: u32, gs: usize) -> DeviceMatrix {
    let n = count * rows * cols;
    let packed: Vec<u32> = (0..n * bits as usize / 32).map(|_| rng.u64() as u32).collect();
    let scales: Vec<bf16> = (0..n / gs).map(|_| bf16::from_f32(0.002 + 0.01 * rng.f32().abs())).collect();
    let biases: Vec<bf16> = (0..n / gs).map(|_| bf16::from_f32(-0.05 * rng.f32())).collect();
    up.upload_matrix(&Matrix {
        count,
        rows,
        cols,
        storage: Storage::Affine {
            params: AffineParams::new(bits, gs),
            packed: Buf::owned(packed),
            scales: FloatBuf::Bf16(Buf::owned(scales)),
            biases: FloatBuf::Bf16(Buf::owned(biases)),
        },
    })
    .unwrap()
}

/// What a decode GEMV costs with its weights in HBM and in L2: per shape, µs a launch with the
/// weights cold (rotated past L2) and hot (the same matrix each time), and the smallest dependent
/// kernel's (the router's selection of one token). The answer (docs/PERF.md, 2026-12-03 fifth
/// session): they are latency-bound, not bandwidth-bound — hot weights save under a microsecond, and
/// a GEMV of 0.6 MB costs about what a GEMV of 0.02 MB does.
#[test]
#[ignore = "timing; run on the GPU machine"]
fn bench_gemv_cold_hot() {
    let Some(dev) = device() else { return };
    let mut rng = Rng::new(43);
    let mut up = Uploader::new(&dev).unwrap();
    println!("| GEMV | MB | cold µs | hot µs | cold GB/s |");
    println!("|---|---:|---:|---:|---:|");
    for (rows, cols) in [(8192usize, 2048usize), (2048, 4096), (2048, 512), (512, 2048), (256, 2048), (16, 2048)] {
        let per = rows * cols / 2 + 4 * rows * cols / 64;
        let count = (320usize << 20).div_ceil(per);
        let w = bench_affine(&mut up, &mut rng, count, rows, cols, 4, 64);
        let x = dev.upload(&rng.vec(cols)).unwrap();
        let mut y = dev.zeros::<f32>(rows).unwrap();
        let mut run = |m: usize| affine_gemv::gemv(&dev, &w, Select::matrix(m), &x, false, &mut y).unwrap();
        let (cold, _) = time_op(&dev, 15, 50, |i| run(i % count));
        let (hot, _) = time_op(&dev, 15, 50, |_| run(0));
        println!("| [{rows}x{cols}] | {:.2} | {:.2} | {:.2} | {:.0} |", per as f64 / 1e6, cold * 1e6, hot * 1e6, per as f64 / cold / 1e9);
    }
    let logits = dev.upload(&rng.vec(256)).unwrap();
    let (mut idx, mut wts) = (dev.zeros::<u32>(8).unwrap(), dev.zeros::<f32>(8).unwrap());
    let (t, _) = time_op(&dev, 15, 50, |_| lily_cuda::ops::moe_route::route(&dev, &logits, 1, 256, 8, true, &mut idx, &mut wts).unwrap());
    println!("moe_route, one token (one block): {:.2} µs a launch back to back", t * 1e6);
}

/// The fused MoE decode at the full-size shapes (E = 256, k = 8, H = 2048, I = 512), weights cold:
/// µs a launch alone and after the selection kernel under PDL, then one launch's phase stamps per
/// block (µs from the earliest block's start: median and latest block at each phase).
#[test]
#[ignore = "timing; run on the GPU machine"]
fn bench_moe_decode() {
    use lily_cuda::ops::moe_decode;
    let Some(dev) = device() else { return };
    let mut rng = Rng::new(46);
    let mut up = Uploader::new(&dev).unwrap();
    let (h, i, e, k) = (2048usize, 512usize, 256usize, 8usize);
    // Layers' worth of stacks, rotated past L2.
    let layers = 3;
    let stacks: Vec<(DeviceMatrix, DeviceMatrix, DeviceMatrix)> = (0..layers)
        .map(|_| (bench_affine(&mut up, &mut rng, e + 1, i, h, 4, 64), bench_affine(&mut up, &mut rng, e + 1, i, h, 4, 64), bench_affine(&mut up, &mut rng, e + 1, h, i, 4, 64)))
        .collect();
    let plan = moe_decode::plan(&dev, &stacks[0].0, &stacks[0].1, &stacks[0].2, e, k).unwrap().unwrap();
    let nw = dev.upload(&rng.vec(h).iter().map(|v| 1.0 + 0.5 * v).collect::<Vec<f32>>()).unwrap();
    let logits: Vec<CudaSlice<f32>> = (0..16).map(|_| dev.upload(&rng.vec(e + 1).iter().map(|v| 2.0 * v).collect::<Vec<f32>>()).unwrap()).collect();
    let mut x = dev.upload(&rng.vec(h)).unwrap();
    let mut act = dev.zeros::<f32>((k + 1) * i).unwrap();
    let mut barrier = dev.zeros::<u64>(1).unwrap();
    let mut run = |j: usize, trace: Option<&mut CudaSlice<u64>>| {
        let (g, u, d) = &stacks[j % layers];
        moe_decode::run(&dev, &plan, g, u, d, &logits[j % 16], &nw, 1e-6, e, k, true, &mut x, &mut act, &mut barrier, None, trace).unwrap();
    };
    let (alone, _) = time_op(&dev, 15, 40, |j| run(j, None));
    dev.set_pdl(true);
    let (chained, _) = time_op(&dev, 15, 40, |j| run(j, None));
    dev.set_pdl(false);
    println!("moe_decode fused (E {e}, k {k}, H {h}, I {i}; grid {}): {:.2} µs alone, {:.2} µs a launch chained under PDL", plan.grid(), alone * 1e6, chained * 1e6);
    let mut trace = dev.zeros::<u64>(plan.grid() * moe_decode::TRACE_STAMPS).unwrap();
    for rep in 0..3 {
        run(rep, Some(&mut trace));
        let t = dev.download(&trace).unwrap();
        let n = moe_decode::TRACE_STAMPS;
        let t0 = (0..plan.grid()).map(|b| t[b * n]).min().unwrap();
        let names = ["start", "waited", "picked", "issued", "x staged", "copies in", "swiglu done", "barrier", "act staged", "end"];
        let mut line = format!("trace {rep}:");
        for (ph, name) in names.iter().enumerate() {
            let mut v: Vec<f64> = (0..plan.grid()).map(|b| (t[b * n + ph] - t0) as f64 / 1e3).collect();
            v.sort_by(|a, b| a.partial_cmp(b).unwrap());
            line += &format!(" | {name} {:.2}/{:.2}", v[v.len() / 2], v[v.len() - 1]);
        }
        println!("{line}");
    }
}

/// What an op boundary costs: a chain of 80 normed GEMVs alternating [4096x2048] and [2048x4096]
/// (the shapes of a decode step's input and output projections, every op its own matrix: 377 MB,
/// cold in L2), as one persistent kernel in each form, and as
/// separate kernels (`gemv_fused`, what the model launches) in a CUDA graph under PDL: µs an op.
#[test]
#[ignore = "timing; run on the GPU machine"]
fn bench_gemv_chain() {
    use lily_cuda::ops::affine_gemv::Fuse;
    use lily_cuda::ops::gemv_chain::{self, Chain, Link, FORMS};
    let Some(dev) = device() else { return };
    let mut rng = Rng::new(62);
    let mut up = Uploader::new(&dev).unwrap();
    let n = 80usize;
    let a = bench_affine(&mut up, &mut rng, n / 2, 4096, 2048, 4, 64);
    let b = bench_affine(&mut up, &mut rng, n / 2, 2048, 4096, 4, 64);
    let nw2 = dev.upload(&rng.vec(2048).iter().map(|v| 1.0 + 0.5 * v).collect::<Vec<f32>>()).unwrap();
    let nw4 = dev.upload(&rng.vec(4096).iter().map(|v| 1.0 + 0.5 * v).collect::<Vec<f32>>()).unwrap();
    let mut bufs = vec![dev.upload(&rng.vec(2048)).unwrap(), dev.zeros::<f32>(4096).unwrap()];
    let bytes_op = 2048.0 * 4096.0 * (0.5 + 4.0 / 64.0);
    let floor = n as f64 * bytes_op / PEAK * 1e6;
    println!("chain of {n} GEMVs [4096x2048] / [2048x4096] with the norm, {:.1} MB an op; bandwidth floor {:.2} µs an op", bytes_op / 1e6, floor / n as f64);
    {
        let links: Vec<Link> = (0..n)
            .map(|i| if i % 2 == 0 { Link { w: &a, matrix: i / 2, norm_w: &nw2, x: 0, y: 1 } } else { Link { w: &b, matrix: i / 2, norm_w: &nw4, x: 1, y: 0 } })
            .collect();
        let mut chain = Chain::new(&dev, &links, &bufs, 1e-6).unwrap();
        for form in FORMS {
            let (t, spread) = time_op(&dev, 10, 5, |_| chain.run(&dev, form).unwrap());
            println!("persistent, {form:?}: {:.2} µs an op ({:.0} GB/s; spread {spread:.3})", t * 1e6 / n as f64, n as f64 * bytes_op / t / 1e9);
        }
        // Where an op's time goes: one traced launch of each form, ops 10..70. Per op, the medians over
        // blocks of each phase (µs), and the wake-up: from the last block's arrival at the previous op
        // to each block's wait ending.
        let (g, ns) = (chain.grid(), gemv_chain::TRACE_STAMPS);
        let mut trace = dev.zeros::<u64>(n * g * ns).unwrap();
        for form in FORMS {
            chain.run_traced(&dev, form, Some(&mut trace)).unwrap();
            let t = dev.download(&trace).unwrap();
            let at = |op: usize, b: usize, k: usize| t[(op * g + b) * ns + k] as f64 / 1e3;
            let med = |mut v: Vec<f64>| {
                v.sort_by(|a, b| a.partial_cmp(b).unwrap());
                v[v.len() / 2]
            };
            let names = ["wake", "copies in", "stage x", "products", "arrive", "period"];
            let mut cols: Vec<Vec<f64>> = vec![Vec::new(); names.len()];
            for op in 10..70 {
                let last = (0..g).map(|b| at(op - 1, b, 5)).fold(0.0, f64::max);
                let last_now = (0..g).map(|b| at(op, b, 5)).fold(0.0, f64::max);
                cols[0].push(med((0..g).map(|b| at(op, b, 1) - last).collect()));
                for (k, col) in cols.iter_mut().enumerate().take(5).skip(1) {
                    col.push(med((0..g).map(|b| at(op, b, k + 1) - at(op, b, k)).collect()));
                }
                cols[5].push(last_now - last);
            }
            let line: Vec<String> = names.iter().zip(cols).map(|(nm, c)| format!("{nm} {:.2}", med(c))).collect();
            println!("trace, {form:?} (median op, median block, µs): {}", line.join(" | "));
        }
    }
    {
        // The same chain on two matrices only (hot in L2): what is left is the chain's latency.
        let links: Vec<Link> = (0..n)
            .map(|i| if i % 2 == 0 { Link { w: &a, matrix: 0, norm_w: &nw2, x: 0, y: 1 } } else { Link { w: &b, matrix: 0, norm_w: &nw4, x: 1, y: 0 } })
            .collect();
        let mut chain = Chain::new(&dev, &links, &bufs, 1e-6).unwrap();
        for form in FORMS {
            let (t, spread) = time_op(&dev, 10, 5, |_| chain.run(&dev, form).unwrap());
            println!("persistent, weights hot in L2, {form:?}: {:.2} µs an op (spread {spread:.3})", t * 1e6 / n as f64);
        }
    }
    // The same ops as separate kernels, captured into one graph with PDL.
    let stream = dev.stream().clone();
    stream.begin_capture(cudarc::driver::sys::CUstreamCaptureMode::CU_STREAM_CAPTURE_MODE_THREAD_LOCAL).unwrap();
    dev.set_pdl(true);
    let (mut x2, mut x4) = (bufs.remove(0), bufs.remove(0));
    for i in 0..n {
        if i % 2 == 0 {
            affine_gemv::gemv_fused(&dev, &a, Select::matrix(i / 2), &x2, false, &mut x4, Fuse::rms_norm(&dev, &nw2, 1e-6)).unwrap();
        } else {
            affine_gemv::gemv_fused(&dev, &b, Select::matrix(i / 2), &x4, false, &mut x2, Fuse::rms_norm(&dev, &nw4, 1e-6)).unwrap();
        }
    }
    dev.set_pdl(false);
    let graph = stream.end_capture(cudarc::driver::sys::CUgraphInstantiate_flags(0)).unwrap().unwrap();
    let (t, spread) = time_op(&dev, 10, 5, |_| graph.launch().unwrap());
    println!("separate kernels, one graph with PDL: {:.2} µs an op ({:.0} GB/s; spread {spread:.3})", t * 1e6 / n as f64, n as f64 * bytes_op / t / 1e9);
}

struct Row {
    kernel: String,
    shape: String,
    bytes: f64,
    t: f64,
    spread: f64,
}

#[test]
#[ignore = "timing; run on the GPU machine via tools/gpu_check.sh"]
fn bench_ops() {
    let Some(dev) = device() else { return };
    let mut rng = Rng::new(42);
    let mut rows_out: Vec<Row> = Vec::new();
    let mut up = Uploader::new(&dev).unwrap();
    const ROTATE_BYTES: usize = 320 << 20; // > 5x the 60 MB L2: every launch reads from HBM

    // Ceiling: device-to-device copy of 1 GiB (bytes read + written).
    {
        let n = 1usize << 28;
        let a = dev.zeros::<f32>(n).unwrap();
        let mut b = dev.zeros::<f32>(n).unwrap();
        let (t, s) = time_op(&dev, 9, 2, |_| dev.stream().memcpy_dtod(&a, &mut b).unwrap());
        rows_out.push(Row { kernel: "memcpy d2d (ceiling)".into(), shape: "1 GiB".into(), bytes: 2.0 * (n * 4) as f64, t, spread: s });
    }

    // Upload rate through the pinned stager (host random data already generated).
    {
        let n = 256usize << 20;
        let host: Vec<u32> = (0..n / 4).map(|_| rng.u64() as u32).collect();
        let t0 = std::time::Instant::now();
        let d = up.upload(&host).unwrap();
        dev.synchronize().unwrap();
        let t = t0.elapsed().as_secs_f64();
        println!("upload: {} MiB through 2 x 64 MiB pinned buffers in {:.1} ms = {:.1} GB/s", n >> 20, t * 1e3, n as f64 / t / 1e9);
        drop(d);
        // Where the time goes: host copy into pinned memory (write-combined, and plain), and the DMA alone.
        let chunk = 64usize << 20;
        let ctx = dev.context();
        for (label, flags) in [("write-combined", cudarc::driver::sys::CU_MEMHOSTALLOC_WRITECOMBINED), ("plain", 0)] {
            let mut pinned = unsafe { ctx.alloc_pinned_with_flags::<u8>(chunk, flags) }.unwrap();
            let src: &[u8] = unsafe { std::slice::from_raw_parts(host.as_ptr() as *const u8, chunk) };
            let t0 = std::time::Instant::now();
            for _ in 0..4 {
                pinned.as_mut_slice().unwrap().copy_from_slice(src);
            }
            let fill = t0.elapsed().as_secs_f64() / 4.0;
            let mut dst = dev.zeros::<u8>(chunk).unwrap();
            dev.synchronize().unwrap();
            let t0 = std::time::Instant::now();
            for _ in 0..4 {
                dev.stream().memcpy_htod(&pinned, &mut dst).unwrap();
            }
            dev.synchronize().unwrap();
            let dma = t0.elapsed().as_secs_f64() / 4.0;
            println!(
                "upload parts ({label} pinned, 64 MiB): host copy {:.1} GB/s, DMA {:.1} GB/s",
                chunk as f64 / fill / 1e9,
                chunk as f64 / dma / 1e9
            );
        }
    }

    // Plain GEMVs over model shapes, rotating over a stack larger than L2.
    let dense_cases: &[(&str, usize, usize, u32, usize)] = &[
        ("in_proj_qkv / q_proj", 8192, 2048, 4, 64),
        ("2048 x 8192", 2048, 8192, 4, 64),
        ("in_proj_z", 4096, 2048, 4, 64),
        ("out_proj / o_proj", 2048, 4096, 4, 64),
        ("router (8-bit)", 256, 2048, 8, 64),
        ("lm_head", 248320, 2048, 4, 64),
    ];
    for &(label, rows, cols, bits, gs) in dense_cases {
        let per = rows * cols * bits as usize / 8 + 4 * rows * cols / gs;
        let count = ROTATE_BYTES.div_ceil(per).max(1);
        let w = bench_affine(&mut up, &mut rng, count, rows, cols, bits, gs);
        let x = dev.upload(&rng.vec(cols)).unwrap();
        let mut y = dev.zeros::<f32>(rows).unwrap();
        let bytes = (w.bytes_per_matrix() + 4 * cols + 4 * rows) as f64;
        // (decode, forced kernel): 0 = automatic (4-bit: tensor cores), 8 = register kernel, 9..=12 = tensor
        // cores with a K split of 1, 2, 4, 8, 5..=7 = pipelined
        // with (U, NR) = (1, 4), (2, 2), (4, 1); 1..=4 = register kernel with (1, 8), (2, 4), (4, 2), (8, 1).
        let variants: Vec<(Q4Decode, u32)> = if bits == 4 && (rows == 8192 || rows == 248320 || cols == 8192) {
            let mut v = vec![(Q4Decode::Fast, 0), (Q4Decode::Fast, 8), (Q4Decode::Fast, 5), (Q4Decode::Fast, 6), (Q4Decode::Fast, 7), (Q4Decode::Fast, 9), (Q4Decode::Fast, 10), (Q4Decode::Fast, 11), (Q4Decode::Fast, 12)];
            v.extend((13..=20).map(|f| (Q4Decode::Fast, f)));
            if rows == 248320 {
                v.push((Q4Decode::Exact, 0));
            }
            v
        } else if bits == 4 {
            [0, 8, 9, 10, 11, 12, 13, 14, 15, 16, 17, 18, 19, 20].map(|f| (Q4Decode::Fast, f)).to_vec()
        } else {
            vec![(Q4Decode::Fast, 0), (Q4Decode::Fast, 8)]
        };
        for (d, forced) in variants {
            // A variant this shape does not have (too much shared memory, a K split that does not divide).
            if affine_gemv::gemv_tuned(&dev, &w, Select::matrix(0), &x, false, &mut y, d, forced).is_err() {
                continue;
            }
            let (reps, batch) = if rows > 100_000 { (15, 4) } else { (25, 20) };
            let (t, s) = time_op(&dev, reps, batch, |i| {
                affine_gemv::gemv_tuned(&dev, &w, Select::matrix(i % count), &x, false, &mut y, d, forced).unwrap()
            });
            let kernel = match (bits, d, forced) {
                (4, Q4Decode::Exact, _) => "gemv q4 exact (reg)".to_string(),
                (_, _, 0) => format!("gemv q{bits}"),
                (_, _, 8) => format!("gemv q{bits} reg"),
                (_, _, f @ 9..=20) => format!("gemv q{bits} {}", tc_form(f)),
                (_, _, f) => format!("gemv q{bits} async {}", ["u1r4", "u2r2", "u4r1"][f as usize - 5]),
            };
            rows_out.push(Row { kernel, shape: format!("{label} {rows}x{cols} g{gs}"), bytes, t, spread: s });
        }
    }

    // MoE decode: 8 of 256 experts per launch, indices on the device (64 random sets rotated).
    {
        let (e, inter, hidden, k) = (256usize, 512usize, 2048usize, 8usize);
        let sets: Vec<CudaSlice<u32>> = (0..64)
            .map(|_| {
                let mut s: Vec<u32> = Vec::new();
                while s.len() < k {
                    let v = rng.below(e) as u32;
                    if !s.contains(&v) {
                        s.push(v);
                    }
                }
                dev.upload(&s).unwrap()
            })
            .collect();
        let gate = bench_affine(&mut up, &mut rng, e, inter, hidden, 4, 64);
        let upm = bench_affine(&mut up, &mut rng, e, inter, hidden, 4, 64);
        let down = bench_affine(&mut up, &mut rng, e, hidden, inter, 4, 64);
        let x = dev.upload(&rng.vec(hidden)).unwrap();
        let act = dev.upload(&rng.vec(k * inter)).unwrap();
        let mut y1 = dev.zeros::<f32>(k * inter).unwrap();
        let mut y2 = dev.zeros::<f32>(k * hidden).unwrap();
        let b_gate = (k * gate.bytes_per_matrix() + 4 * hidden + 4 * k * inter) as f64;
        let moe_kernel = |what: &str, forced: u32| match forced {
            0 => format!("{what} (auto)"),
            8 => format!("{what} reg"),
            f => format!("{what} {}", tc_form(f)),
        };
        for forced in [0u32, 8, 9, 10, 11, 12, 13, 14, 15, 16, 17, 18, 19, 20] {
            let (t, s) = time_op(&dev, 25, 20, |i| {
                affine_gemv::gemv_tuned(&dev, &gate, Select::indexed(&dev, &sets[i % 64]), &x, false, &mut y1, Q4Decode::Fast, forced)
                    .unwrap()
            });
            let kernel = moe_kernel("gemv q4 indexed", forced);
            rows_out.push(Row { kernel, shape: format!("gate 8 of {e} x {inter}x{hidden}"), bytes: b_gate, t, spread: s });
        }
        let b_sw = (2 * k * gate.bytes_per_matrix() + 4 * hidden + 4 * k * inter) as f64;
        for forced in [0u32, 8, 9, 10, 11, 12, 13, 14, 15, 16] {
            let (t, s) = time_op(&dev, 25, 20, |i| {
                affine_gemv::swiglu_tuned(&dev, &gate, &upm, Select::indexed(&dev, &sets[i % 64]), &x, false, &mut y1, forced).unwrap()
            });
            let kernel = moe_kernel("swiglu q4 indexed", forced);
            rows_out.push(Row { kernel, shape: format!("gate+up 8 of {e} x {inter}x{hidden}"), bytes: b_sw, t, spread: s });
        }
        let b_down = (k * down.bytes_per_matrix() + 4 * k * inter + 4 * k * hidden) as f64;
        for forced in [0u32, 8, 9, 10, 13, 14, 17, 18] {
            let (t, s) = time_op(&dev, 25, 20, |i| {
                affine_gemv::gemv_tuned(&dev, &down, Select::indexed(&dev, &sets[i % 64]), &act, true, &mut y2, Q4Decode::Fast, forced)
                    .unwrap()
            });
            let kernel = moe_kernel("gemv q4 indexed, x/slot", forced);
            rows_out.push(Row { kernel, shape: format!("down 8 of {e} x {hidden}x{inter}"), bytes: b_down, t, spread: s });
        }
    }

    // Dense bf16 GEMV.
    {
        let (rows, cols) = (8192usize, 2048usize);
        let per = 2 * rows * cols;
        let count = ROTATE_BYTES.div_ceil(per);
        let v: Vec<bf16> = (0..count * rows * cols).map(|_| bf16::from_f32(rng.f32())).collect();
        let w = up.upload_matrix(&Matrix { count, rows, cols, storage: Storage::Dense(FloatBuf::Bf16(Buf::owned(v))) }).unwrap();
        let x = dev.upload(&rng.vec(cols)).unwrap();
        let mut y = dev.zeros::<f32>(rows).unwrap();
        for forced in [0u32, 8] {
            let (t, s) = time_op(&dev, 25, 20, |i| {
                affine_gemv::gemv_tuned(&dev, &w, Select::matrix(i % count), &x, false, &mut y, Q4Decode::Fast, forced).unwrap()
            });
            let kernel = if forced == 0 { "gemv bf16" } else { "gemv bf16 reg" };
            rows_out.push(Row { kernel: kernel.into(), shape: format!("{rows}x{cols}"), bytes: (per + 4 * cols + 4 * rows) as f64, t, spread: s });
        }
    }

    // RMSNorm and embedding.
    {
        let n = 2048;
        let w = dev.upload(&rng.vec(n)).unwrap();
        for rows in [1usize, 4096] {
            let x = dev.upload(&rng.vec(rows * n)).unwrap();
            let mut r = dev.upload(&rng.vec(rows * n)).unwrap();
            let mut y = dev.zeros::<f32>(rows * n).unwrap();
            let (t, s) = time_op(&dev, 25, 20, |_| rmsnorm::add_rms_norm(&dev, &x, &mut r, &w, 1e-6, rows, &mut y, None).unwrap());
            rows_out.push(Row { kernel: "add_rmsnorm".into(), shape: format!("{rows}x{n}"), bytes: (4 * rows * n * 4 + 4 * n) as f64, t, spread: s });
        }
        let table = bench_affine(&mut up, &mut rng, 1, 248320, 2048, 4, 64);
        for tokens in [1usize, 4096] {
            let ids: Vec<u32> = (0..tokens).map(|_| rng.below(248320) as u32).collect();
            let idd = dev.upload(&ids).unwrap();
            let mut out = dev.zeros::<f32>(tokens * 2048).unwrap();
            let (t, s) = time_op(&dev, 25, 20, |_| embed::embed(&dev, &table, &idd, &mut out).unwrap());
            let bytes = (tokens * (table.bytes_per_matrix() / 248320 + 4 * 2048 + 4)) as f64;
            rows_out.push(Row { kernel: "embed q4".into(), shape: format!("{tokens} tok of 248320x2048"), bytes, t, spread: s });
        }
    }
    up.finish().unwrap();

    println!();
    println!("{}, {} SMs; median per launch of back-to-back launches (CUDA events); GB/s = bytes that must move / time", dev.info().name, dev.sm_count());
    println!("{:<26} {:<40} {:>10} {:>10} {:>9} {:>7} {:>7}", "kernel", "shape", "MB", "time us", "GB/s", "% 4.3T", "spread");
    for r in &rows_out {
        let gbs = r.bytes / r.t / 1e9;
        println!(
            "{:<26} {:<40} {:>10.2} {:>10.2} {:>9.0} {:>6.1}% {:>7.2}",
            r.kernel,
            r.shape,
            r.bytes / 1e6,
            r.t * 1e6,
            gbs,
            100.0 * r.bytes / r.t / PEAK,
            r.spread
        );
    }
}

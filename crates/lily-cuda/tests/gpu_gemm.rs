//! CPU-vs-GPU tests of the prefill GEMM family (`ops::gemm`: plain, SwiGLU, grouped, grouped SwiGLU) in
//! all three precisions, plus its timing table (`bench_gemm`, ignored by default).
//!
//! `Precision::Bf16x` rounds X to bf16 and keeps the weights exact (the codes of
//! `Exact` below, the bias term from the unrounded X sums). Its reference forms exactly that in f64:
//! Σ w·bf16(x) + Σ_groups b'·(Σ x − Σ bf16(x)), with w lily-cpu's dequantised weights and b' = b +
//! 2^(bits-1)·s in f32 as the kernel forms it; what is left is f32 accumulation, as for Exact, so the
//! same TOL_EXACT. Against lily-cpu's f32 matmul the difference is the rounding of x (CPU_TOL).
//!
//! `Precision::Fast` rounds X and each dequantised weight (`scale * q + bias` in f32) to bf16, then
//! accumulates the exact products in f32 on the tensor cores. Its reference does the same roundings and
//! sums in f64, so the only difference left is f32 accumulation (over K/16 sequential mma steps, each
//! adding an exactly-formed sum of 16 products): about 2^-24 · √(K/16) · |partial sums| in practice,
//! ~1e-7 of the largest output, and bounded by (K/16) · 2^-23 ≈ 1.5e-5 (K = 2048) times the ratio of
//! the partial sums to the largest output. TOL = 2e-5 leaves room for that; a wrong code, group, row,
//! column or token shows up as > 1e-2. Against `lily_cpu::linear::matmul` (f32 x and weights, no
//! bf16 rounding) the difference is the bf16 rounding itself, ~3e-3, bounded loosely by CPU_TOL.
//!
//! `Precision::Exact` (the default) is compared with an f64 product of the UNROUNDED f32 x and lily-cpu's
//! f32 dequantised weights. What it leaves out: (1) the part of x below its two bf16 pieces, at most
//! 2^-16 |x| per element and ~2^-18 typically, random in sign; it multiplies the centred code products
//! s·(q - 2^(bits-1)) (the bias term uses the exact f32 X sums), so ~2^-18 of an output: a CPU emulation
//! of the kernel (exact products, f32 sums) on shapes like these gives 2e-6 to 4.5e-6 of the largest
//! output, the same as the split alone. (2) f32 accumulation on the tensor cores (truncating adds, as in
//! Fast), but into per-group accumulators restarted every group: 2·group/16 mma steps over partial sums
//! of one group's size, then one rounded FMA per group for the scale and one per 32/64 columns for the
//! bias term; about 2^-24 · √(K/group) · (a group's contribution), ~1e-7 of the largest output.
//! (3) the f32 rounding of `scale * q + bias` in the reference (2^-24). So ~5e-6 at worst and
//! TOL_EXACT = 2e-5; the bf16 roundings Fast makes (~3e-3) are 100× over it, and so is any wrong scale,
//! bias, X sum or group boundary. Against lily-cpu's f32 matmul (its own f32 sums, ~1e-6)
//! CPU_TOL_EXACT = 5e-5.
//!
//! `Precision::Half` (4-bit group-64 weights on the wgmma tiles, and 8-bit group-64 ones in the plain
//! form; every other format, form and tile runs Exact and is checked as Exact): each x row scaled by its power of two 2^-e (the largest scaled value
//! in [2^14, 2^15)) and rounded to f16, each weight formed as f16(f16(s)·q + f16(b)) (one rounding,
//! as the kernel's fused multiply-add), the products accumulated in f32 over all of K, times 2^e. Its
//! reference forms the same roundings in f64, so what is left is f32 accumulation over K/16 steps
//! without the per-group restart, TOL as for Fast; a wrong code, scale, row scale or token is > 1e-2.
//! Against lily-cpu's f32 matmul the difference is the f16 roundings (2^-11 relative each, ~1e-4 of
//! the largest output), CPU_TOL_HALF.
//!
//! Every output is poisoned with NaN first (with spare elements past the end that must stay NaN), and
//! x carries NaN rows past the tokens a kernel may read.
#![cfg(feature = "cuda")]

mod common;

use common::{device, Rng, poisoned};
use cudarc::driver::CudaSlice;
use half::bf16;
use lily_cuda::ops::gemm::{self, Opts, Precision, Tile};
use lily_cuda::ops::util;
use lily_cuda::weights::{upload_matrix, DeviceMatrix, Uploader};
use lily_cuda::Device;
use lily_model::affine::{quantize_bf16, AffineParams};
use lily_model::buf::{Buf, FloatBuf};
use lily_model::weights::{Matrix, Storage};

/// Fast: GPU vs the f64 reference of the same bf16-rounded operands, relative to the largest output.
const TOL: f64 = 2e-5;
/// Fast: GPU vs lily-cpu's f32 matmul (unrounded operands), relative to the largest output.
const CPU_TOL: f64 = 1e-2;
/// Exact: GPU vs the f64 reference of the unrounded operands, relative to the largest output.
const TOL_EXACT: f64 = 2e-5;
/// Exact: GPU vs lily-cpu's f32 matmul, relative to the largest output.
const CPU_TOL_EXACT: f64 = 5e-5;
/// Half: GPU vs lily-cpu's f32 matmul, relative to the largest output.
const CPU_TOL_HALF: f64 = 1e-3;
/// Spare output elements past the end, which must stay NaN.
const SPARE: usize = 37;

const PRECISIONS: [Precision; 4] = [Precision::Exact, Precision::Bf16x, Precision::Fast, Precision::Half];
const TILES: [Tile; 16] = [
    Tile::Auto,
    Tile::M64,
    Tile::M32,
    Tile::Wg64,
    Tile::Wg128,
    Tile::Wg32,
    Tile::Wg64K,
    Tile::Wg64x256,
    Tile::Wg128x256,
    Tile::Ws128,
    Tile::Ws256,
    Tile::Ws4,
    Tile::Ss256,
    Tile::Ws128T256,
    Tile::Ws128T160,
    Tile::Mc256,
];

fn is_q4g64(w: &Matrix) -> bool {
    matches!(&w.storage, Storage::Affine { params, .. } if params.bits == 4 && params.group_size == 64)
}

fn is_q8g64(w: &Matrix) -> bool {
    matches!(&w.storage, Storage::Affine { params, .. } if params.bits == 8 && params.group_size == 64)
}

/// Whether `tile` takes weights `w` in precision `p` in a call of the plain form (`plain`), the grouped
/// ones (`grouped`) or the SwiGLU one (the wgmma tiles: 4-bit group 64, and 8-bit group 64 in the plain
/// form, not Fast; the 256-row and the warp-specialised ones 4-bit in Half only; the 32-token ones 4-bit
/// in Half in the grouped forms only; the split-K ones the plain form of 4-bit in Half or Exact and of
/// 8-bit in Exact; the cluster pairs only where `pairs`: a plain or SwiGLU call of an even count of row
/// tiles). The others must be refused.
fn tile_takes(tile: Tile, w: &Matrix, p: Precision, plain: bool, grouped: bool, pairs: bool) -> bool {
    match tile {
        Tile::Wg32 => is_q4g64(w) && p == Precision::Half && grouped,
        Tile::Wg64K => plain && ((is_q4g64(w) && matches!(p, Precision::Half | Precision::Exact)) || (is_q8g64(w) && p == Precision::Exact)),
        Tile::Mc256 => is_q4g64(w) && p == Precision::Half && pairs,
        Tile::Wg64 | Tile::Wg128 => (is_q4g64(w) || (is_q8g64(w) && plain)) && p != Precision::Fast,
        Tile::Wg64x256 | Tile::Wg128x256 | Tile::Ws128 | Tile::Ws256 | Tile::Ws4 | Tile::Ss256 | Tile::Ws128T256 | Tile::Ws128T160 => {
            is_q4g64(w) && p == Precision::Half
        }
        _ => true,
    }
}

/// The numerics a call runs: Half only on the wgmma tiles (Auto takes them for 4-bit group 64, and
/// with `LILY_ROUTER_WGMMA=1` for 8-bit group 64 in the plain form), else Exact.
fn effective(tile: Tile, w: &Matrix, p: Precision, plain: bool) -> Precision {
    let q8_auto = std::env::var("LILY_ROUTER_WGMMA").is_ok_and(|v| v == "1");
    let half_fmt = is_q4g64(w) || (is_q8g64(w) && plain && (tile != Tile::Auto || q8_auto));
    if p == Precision::Half && (!half_fmt || matches!(tile, Tile::M64 | Tile::M32)) {
        Precision::Exact
    } else {
        p
    }
}

// ---------------------------------------------------------------------------------------------------
// Helpers

/// A weight format: bits (16 = dense bf16) and group size (0 for dense).
#[derive(Clone, Copy, Debug)]
struct Fmt {
    bits: u32,
    gs: usize,
}

impl std::fmt::Display for Fmt {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        if self.bits == 16 {
            write!(f, "bf16")
        } else {
            write!(f, "q{} g{}", self.bits, self.gs)
        }
    }
}

const FORMATS: [Fmt; 5] =
    [Fmt { bits: 4, gs: 64 }, Fmt { bits: 4, gs: 128 }, Fmt { bits: 8, gs: 32 }, Fmt { bits: 8, gs: 64 }, Fmt { bits: 16, gs: 0 }];

/// A stack of `count` random `[rows, cols]` matrices: quantised with MLX's algorithm (bf16 scales and
/// biases), or dense bf16. Rows have different offsets and spreads so that scales and biases matter.
fn matrix(rng: &mut Rng, f: Fmt, count: usize, rows: usize, cols: usize) -> Matrix {
    let mut w = Vec::with_capacity(count * rows * cols);
    for _ in 0..count * rows {
        let amp = 0.05 + rng.uniform();
        let off = rng.range(-0.3, 0.3) as f64;
        w.extend((0..cols).map(|_| bf16::from_f32((off + amp * rng.range(-1.0, 1.0) as f64) as f32)));
    }
    let storage = if f.bits == 16 {
        Storage::Dense(FloatBuf::Bf16(Buf::owned(w)))
    } else {
        let p = AffineParams::new(f.bits, f.gs);
        let q = quantize_bf16(&w, cols, p);
        Storage::Affine {
            params: p,
            packed: Buf::owned(q.packed),
            scales: FloatBuf::Bf16(Buf::owned(q.scales)),
            biases: FloatBuf::Bf16(Buf::owned(q.biases)),
        }
    };
    Matrix { count, rows, cols, storage }
}

fn bf16r(v: f32) -> f32 {
    bf16::from_f32(v).to_f32()
}

/// Matrix `m` dequantised as lily-cpu does (`scale * q + bias` in f32), rounded to bf16 when `fast`
/// (what the Fast kernels multiply). `[rows * cols]`.
fn weights(w: &Matrix, m: usize, fast: bool) -> Vec<f32> {
    let mut out = vec![0.0f32; w.rows * w.cols];
    for (r, row) in out.chunks_exact_mut(w.cols).enumerate() {
        lily_cpu::linear::dequantize_row(w, m, r, row);
        if fast {
            row.iter_mut().for_each(|v| *v = bf16r(*v));
        }
    }
    out
}

/// Matrix `m` of a stack as the references use it: dequantised in f32 (exact, and rounded to bf16) and
/// the bias of the centred codes b' = b + 2^(bits-1)·s per (row, group), formed in f32 as the kernels do.
struct RefMat {
    cols: usize,
    gs: usize,
    exact: Vec<f32>,
    fast: Vec<f32>,
    bprime: Vec<f32>,
    /// 4- and 8-bit group 64: the weights as the Half kernels form them, f16(f16(s)·q + f16(b)).
    half: Option<Vec<f32>>,
}

/// Matrix `m` of a 4- or 8-bit group-64 stack as the Half kernels dequantise it.
fn half_weights(w: &Matrix, m: usize) -> Option<Vec<f32>> {
    let Storage::Affine { params, packed, scales, biases } = &w.storage else { return None };
    if !matches!(params.bits, 4 | 8) || params.group_size != 64 {
        return None;
    }
    let f16r = |v: f32| half::f16::from_f32(v).to_f64();
    let bits = params.bits as usize;
    let per = 32 / bits;
    let words = w.cols / per;
    let mut out = Vec::with_capacity(w.rows * w.cols);
    for r in 0..w.rows {
        let row = m * w.rows + r;
        for c in 0..w.cols {
            let q = (packed[row * words + c / per] >> (bits * (c % per))) & ((1 << bits) - 1);
            let j = row * (w.cols / 64) + c / 64;
            out.push(half::f16::from_f64(q as f64 * f16r(scales.get(j)) + f16r(biases.get(j))).to_f32());
        }
    }
    Some(out)
}

impl RefMat {
    fn new(w: &Matrix, m: usize) -> Self {
        let (exact, fast) = (weights(w, m, false), weights(w, m, true));
        let (gs, bprime) = match &w.storage {
            Storage::Affine { params, scales, biases, .. } => {
                let groups = w.cols / params.group_size;
                let half = (1u32 << (params.bits - 1)) as f32;
                let b = (0..w.rows * groups)
                    .map(|i| {
                        let j = m * w.rows * groups + i;
                        half.mul_add(scales.get(j), biases.get(j))
                    })
                    .collect();
                (params.group_size, b)
            }
            Storage::Dense(_) => (0, Vec::new()),
        };
        RefMat { cols: w.cols, gs, exact, fast, bprime, half: half_weights(w, m) }
    }

    /// One unrounded x row through precision `p`'s reference (every output row).
    fn apply(&self, p: Precision, x: &[f32]) -> Vec<f64> {
        let xr: Vec<f32> = x.iter().map(|v| bf16r(*v)).collect();
        match p {
            Precision::Exact => dot_rows(&self.exact, self.cols, x),
            Precision::Half => match &self.half {
                Some(wh) => {
                    // The row's scale 2^e, as the stager picks it.
                    let m = x.iter().fold(0.0f32, |a, v| a.max(v.abs()));
                    let e = if m > 0.0 && m.is_finite() { (((m.to_bits() >> 23) & 0xff) as i32 - 127 - 14).clamp(-110, 110) } else { 0 };
                    let xh: Vec<f32> = x.iter().map(|v| half::f16::from_f32(v * 2f32.powi(-e)).to_f32()).collect();
                    dot_rows(wh, self.cols, &xh).into_iter().map(|y| y * 2f64.powi(e)).collect()
                }
                None => dot_rows(&self.exact, self.cols, x),
            },
            Precision::Fast => dot_rows(&self.fast, self.cols, &xr),
            Precision::Bf16x => {
                let mut y = dot_rows(&self.exact, self.cols, &xr);
                if let Some(groups) = self.cols.checked_div(self.gs) {
                    let lost: Vec<f64> = (0..groups)
                        .map(|g| (g * self.gs..(g + 1) * self.gs).map(|i| x[i] as f64 - xr[i] as f64).sum())
                        .collect();
                    for (r, yr) in y.iter_mut().enumerate() {
                        *yr += (0..groups).map(|g| self.bprime[r * groups + g] as f64 * lost[g]).sum::<f64>();
                    }
                }
                y
            }
        }
    }
}

/// `W x` in f64 for one x row.
fn dot_rows(wq: &[f32], cols: usize, xr: &[f32]) -> Vec<f64> {
    wq.chunks_exact(cols).map(|row| row.iter().zip(xr).map(|(a, b)| *a as f64 * *b as f64).sum()).collect()
}

fn silu64(g: f64) -> f64 {
    g / (1.0 + (-g).exp())
}

/// max |got - want| / max |want|, after checking every element is finite.
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

/// Downloads the first `n` outputs and checks that the spare elements after them are still NaN.
fn download_checked(dev: &Device, y: &CudaSlice<f32>, n: usize, what: &str) -> Vec<f32> {
    let all = dev.download(y).unwrap();
    assert!(all[n..].iter().all(|v| v.is_nan()), "{what}: wrote past the end of y");
    all[..n].to_vec()
}

/// `t` random x rows of `cols`, followed by `extra` rows of NaN (which no kernel may read); the
/// device copy, the host rows, and the rows rounded to bf16.
fn inputs(dev: &Device, rng: &mut Rng, t: usize, cols: usize, extra: usize) -> (CudaSlice<f32>, Vec<f32>, Vec<f32>) {
    inputs_from(dev, rng.normals(t * cols, 1.0), cols, extra)
}

fn inputs_from(dev: &Device, x: Vec<f32>, cols: usize, extra: usize) -> (CudaSlice<f32>, Vec<f32>, Vec<f32>) {
    let mut padded = x.clone();
    padded.extend(std::iter::repeat_n(f32::NAN, extra * cols));
    let xr: Vec<f32> = x.iter().map(|v| bf16r(*v)).collect();
    (dev.upload(&padded).unwrap(), x, xr)
}

/// The references of one case: f64 from the unrounded operands (Exact), from bf16-rounded x and exact
/// weights (Bf16x), from the bf16-rounded ones (Fast), and lily-cpu's f32 result.
struct Refs {
    exact: Vec<f64>,
    bf16x: Vec<f64>,
    fast: Vec<f64>,
    half: Vec<f64>,
    cpu: Vec<f32>,
}

/// Worst errors seen per precision (index 0 Exact, 1 Bf16x, 2 Fast, 3 Half): vs the reference and vs
/// lily-cpu.
#[derive(Default)]
struct Worst {
    reference: [f64; 4],
    cpu: [f64; 4],
}

fn pidx(p: Precision) -> usize {
    match p {
        Precision::Exact => 0,
        Precision::Bf16x => 1,
        Precision::Fast => 2,
        Precision::Half => 3,
    }
}

impl Worst {
    fn merge(&mut self, o: &Worst) {
        for i in 0..4 {
            self.reference[i] = self.reference[i].max(o.reference[i]);
            self.cpu[i] = self.cpu[i].max(o.cpu[i]);
        }
    }
    fn print(&self, what: &str) {
        println!(
            "{what}: worst relative error, Exact {:.2e} vs the f64 reference (tolerance {TOL_EXACT:.0e}), {:.2e} vs lily-cpu f32 \
             (tolerance {CPU_TOL_EXACT:.0e}); Bf16x {:.2e} vs its f64 reference (tolerance {TOL_EXACT:.0e}), {:.2e} vs lily-cpu f32 \
             (tolerance {CPU_TOL:.0e}); Fast {:.2e} vs the bf16-operand f64 reference (tolerance {TOL:.0e}), {:.2e} vs \
             lily-cpu f32 (tolerance {CPU_TOL:.0e}); Half {:.2e} vs its f64 reference (tolerance {TOL:.0e}), {:.2e} vs lily-cpu \
             f32 (tolerance {CPU_TOL_HALF:.0e})",
            self.reference[0], self.cpu[0], self.reference[1], self.cpu[1], self.reference[2], self.cpu[2], self.reference[3], self.cpu[3]
        );
    }
}

/// Compares a [t, rows] output of precision `p` (the numerics the call ran: see `effective`) with its
/// reference and with lily-cpu's result.
fn compare(got: &[f32], refs: &Refs, p: Precision, worst: &mut Worst, what: &str) {
    let (want, tol, cpu_tol) = match p {
        Precision::Exact => (&refs.exact, TOL_EXACT, CPU_TOL_EXACT),
        Precision::Bf16x => (&refs.bf16x, TOL_EXACT, CPU_TOL),
        Precision::Fast => (&refs.fast, TOL, CPU_TOL),
        Precision::Half => (&refs.half, TOL, CPU_TOL_HALF),
    };
    let e = check(got, want, tol, what);
    let cpu64: Vec<f64> = refs.cpu.iter().map(|v| *v as f64).collect();
    let ec = check(got, &cpu64, cpu_tol, &format!("{what} (vs lily-cpu f32)"));
    let i = pidx(p);
    worst.reference[i] = worst.reference[i].max(e);
    worst.cpu[i] = worst.cpu[i].max(ec);
}

// ---------------------------------------------------------------------------------------------------
// Plain and SwiGLU

/// (rows, cols, t): odd token counts, rows not a multiple of the tile, short and long K, and some real
/// shapes of the 35B model (router, q/k/v-like, o-like, down).
const SHAPES: &[(usize, usize, usize)] = &[
    (200, 64, 1),
    (33, 96, 3),
    (130, 128, 17),
    (200, 256, 130),
    (33, 2048, 17),
    (200, 2048, 130),
    (32, 2048, 65),
    (1024, 2048, 130),
    (2048, 512, 70),
    (256, 4096, 33),
];

/// The references of a plain GEMM with matrix `m`.
fn plain_refs(w: &Matrix, m: usize, x: &[f32], xr: &[f32]) -> Refs {
    let cols = w.cols;
    let _ = xr;
    let rm = RefMat::new(w, m);
    let run = |p: Precision| -> Vec<f64> { x.chunks_exact(cols).flat_map(|xt| rm.apply(p, xt)).collect() };
    let mut cpu = vec![0.0f32; x.len() / cols * w.rows];
    lily_cpu::linear::matmul(w, m, x, &mut cpu);
    Refs { exact: run(Precision::Exact), bf16x: run(Precision::Bf16x), fast: run(Precision::Fast), half: run(Precision::Half), cpu }
}

/// Runs `gemm` in both precisions and all tiles on one case and checks it.
#[allow(clippy::too_many_arguments)]
fn plain_case(dev: &Device, w: &Matrix, m: usize, xd: &CudaSlice<f32>, refs: &Refs, t: usize, what: &str, worst: &mut Worst) {
    let dw = upload_matrix(dev, w).unwrap();
    for p in PRECISIONS {
        for tile in TILES {
            let mut y = poisoned(dev, t * w.rows + SPARE);
            let r = gemm::gemm_with(dev, &dw, m, xd, t, &mut y, Opts { tile, precision: p, ..Default::default() });
            if !tile_takes(tile, w, p, true, false, w.rows.div_ceil(128).is_multiple_of(2)) {
                assert!(r.is_err(), "{what}: {tile:?} took {p:?}");
                continue;
            }
            r.unwrap();
            let what = format!("{what} {p:?} {tile:?}");
            let got = download_checked(dev, &y, t * w.rows, &what);
            compare(&got, refs, effective(tile, w, p, true), worst, &what);
        }
    }
}

#[test]
fn gemm_matches_reference() {
    let Some(dev) = device() else { return };
    let mut rng = Rng::new(101);
    let mut worst = Worst::default();
    for f in FORMATS {
        for &(rows, cols, t) in SHAPES {
            if f.gs != 0 && cols % f.gs != 0 {
                continue;
            }
            let count = if rows * cols <= 200 * 256 { 3 } else { 1 };
            let m = count - 1;
            let w = matrix(&mut rng, f, count, rows, cols);
            let (xd, x, xr) = inputs(&dev, &mut rng, t, cols, 2);
            let refs = plain_refs(&w, m, &x, &xr);
            plain_case(&dev, &w, m, &xd, &refs, t, &format!("gemm {f} [{count}x{rows}x{cols}] m={m} t={t}"), &mut worst);
        }
    }
    worst.print("gemm");
}

/// Activations with a common offset and a few huge channels (as LLM hidden states have): the X sums
/// and the bias term carry most of each group's value.
#[test]
fn gemm_matches_reference_with_outlier_channels() {
    let Some(dev) = device() else { return };
    let mut rng = Rng::new(105);
    let mut worst = Worst::default();
    let (rows, cols, t) = (200, 2048, 70);
    let outliers: Vec<usize> = (0..6).map(|_| rng.below(cols)).collect();
    for f in FORMATS {
        let w = matrix(&mut rng, f, 1, rows, cols);
        let mut x = rng.normals(t * cols, 1.0);
        for (i, v) in x.iter_mut().enumerate() {
            *v += 0.5;
            if outliers.contains(&(i % cols)) {
                *v *= 80.0;
            }
        }
        let (xd, x, xr) = inputs_from(&dev, x, cols, 2);
        let refs = plain_refs(&w, 0, &x, &xr);
        plain_case(&dev, &w, 0, &xd, &refs, t, &format!("gemm (outliers) {f} [{rows}x{cols}] t={t}"), &mut worst);
    }
    worst.print("gemm with outlier channels");
}

/// The default precision is Exact, far closer to the f64 product of the unrounded operands than Bf16x,
/// which is no further than Fast: the switches work (on a real shape: k/v-like [1024, 2048], 4-bit
/// g64, and the MoE down projection's grouped form).
#[test]
fn exact_is_the_default_and_beats_bf16x() {
    let Some(dev) = device() else { return };
    let mut rng = Rng::new(106);
    let f = Fmt { bits: 4, gs: 64 };
    let (rows, cols, t) = (1024, 2048, 130);
    let w = matrix(&mut rng, f, 1, rows, cols);
    let dw = upload_matrix(&dev, &w).unwrap();
    let (xd, x, xr) = inputs(&dev, &mut rng, t, cols, 0);
    let refs = plain_refs(&w, 0, &x, &xr);
    let mut y = poisoned(&dev, t * rows);
    let mut run = |p: Option<Precision>| {
        match p {
            None => gemm::gemm(&dev, &dw, 0, &xd, t, &mut y).unwrap(),
            Some(p) => gemm::gemm_with(&dev, &dw, 0, &xd, t, &mut y, Opts { precision: p, ..Default::default() }).unwrap(),
        }
        dev.download(&y).unwrap()
    };
    let default = run(None);
    let bf16x = run(Some(Precision::Bf16x));
    let halfp = run(Some(Precision::Half));
    let e_half_ref = rel_err(&halfp, &refs.half, "gemm half vs its reference");
    let e_h = rel_err(&halfp, &refs.exact, "gemm half");
    let e_default = rel_err(&bf16x, &refs.bf16x, "gemm bf16x vs its reference");
    let (e_b, e_x, e_f) = (
        rel_err(&bf16x, &refs.exact, "gemm bf16x"),
        rel_err(&default, &refs.exact, "gemm default"),
        rel_err(&run(Some(Precision::Fast)), &refs.exact, "gemm fast"),
    );
    println!(
        "gemm {f} [{rows}x{cols}] t={t}: vs the unrounded f64 product: default (Exact) {e_x:.2e}, Half {e_h:.2e}, Bf16x {e_b:.2e}, Fast {e_f:.2e}"
    );
    assert!(e_half_ref <= TOL, "half is {e_half_ref:.3e} from its reference");
    assert!(e_x * 20.0 <= e_h && e_h * 2.0 <= e_b, "Half ({e_h:.3e}) is not between Exact ({e_x:.3e}) and Bf16x ({e_b:.3e})");
    assert!(e_x <= TOL_EXACT, "the default gemm is not Exact: {e_x:.3e}");
    assert!(e_default <= TOL_EXACT, "bf16x is {e_default:.3e} from its reference");
    assert!(e_x * 20.0 <= e_b, "Exact ({e_x:.3e}) is not 20x closer than Bf16x ({e_b:.3e})");
    assert!(e_b <= e_f, "Bf16x ({e_b:.3e}) is further than Fast ({e_f:.3e})");

    // Grouped, default vs Exact: 2 experts, down-projection-like [2048, 512].
    let (rows, cols, counts) = (2048, 512, [70usize, 61]);
    let n: usize = counts.iter().sum();
    let w = matrix(&mut rng, f, 2, rows, cols);
    let dw = upload_matrix(&dev, &w).unwrap();
    let (xd, x, _) = inputs(&dev, &mut rng, n, cols, 0);
    let off = dev.upload(&offsets_of(&counts)).unwrap();
    let (mut want_b, mut want_x) = (Vec::with_capacity(n * rows), Vec::with_capacity(n * rows));
    for (e, range) in [(0usize, 0..counts[0]), (1, counts[0]..n)] {
        let rm = RefMat::new(&w, e);
        range.for_each(|i| {
            want_b.extend(rm.apply(Precision::Bf16x, &x[i * cols..(i + 1) * cols]));
            want_x.extend(rm.apply(Precision::Exact, &x[i * cols..(i + 1) * cols]));
        });
    }
    let mut y = poisoned(&dev, n * rows);
    gemm::grouped_gemm_with(&dev, &dw, &off, None, &xd, n, &mut y, Opts { precision: Precision::Bf16x, ..Default::default() }).unwrap();
    let got = dev.download(&y).unwrap();
    let e_default = rel_err(&got, &want_b, "grouped bf16x");
    let e_b = rel_err(&got, &want_x, "grouped bf16x vs exact");
    gemm::grouped_gemm(&dev, &dw, &off, None, &xd, n, &mut y).unwrap();
    let e_x = rel_err(&dev.download(&y).unwrap(), &want_x, "grouped default");
    println!("grouped_gemm {f} E=2 [{rows}x{cols}] n={n}: Bf16x {e_default:.2e} from its reference; vs unrounded: Bf16x {e_b:.2e}, default (Exact) {e_x:.2e}");
    assert!(e_default <= TOL_EXACT, "grouped bf16x is {e_default:.3e} from its reference");
    assert!(e_x <= TOL_EXACT, "the default grouped_gemm is not Exact: {e_x:.3e}");
    assert!(e_x * 20.0 <= e_b, "grouped: Exact ({e_x:.3e}) is not 20x closer than Bf16x ({e_b:.3e})");
}

#[test]
fn swiglu_gemm_matches_reference() {
    let Some(dev) = device() else { return };
    let mut rng = Rng::new(102);
    let mut worst = Worst::default();
    // (rows, cols, t): 64 output rows per block here, so 70 and 33 leave partial tiles; (512, 2048) is the
    // shared expert's gate/up.
    let shapes: &[(usize, usize, usize)] = &[(70, 64, 1), (33, 96, 3), (130, 256, 17), (200, 2048, 130), (512, 2048, 65)];
    for f in FORMATS {
        for &(rows, cols, t) in shapes {
            if f.gs != 0 && cols % f.gs != 0 {
                continue;
            }
            let count = 2;
            let m = 1;
            let (g, u) = (matrix(&mut rng, f, count, rows, cols), matrix(&mut rng, f, count, rows, cols));
            let (dg, du) = (upload_matrix(&dev, &g).unwrap(), upload_matrix(&dev, &u).unwrap());
            let (xd, x, _) = inputs(&dev, &mut rng, t, cols, 2);
            let (rg, ru) = (RefMat::new(&g, m), RefMat::new(&u, m));
            let swiglu_ref = |p: Precision| -> Vec<f64> {
                x.chunks_exact(cols)
                    .flat_map(|xt| {
                        let (a, b) = (rg.apply(p, xt), ru.apply(p, xt));
                        a.iter().zip(&b).map(|(a, b)| silu64(*a) * b).collect::<Vec<_>>()
                    })
                    .collect()
            };
            let (mut cg, mut cu) = (vec![0.0f32; t * rows], vec![0.0f32; t * rows]);
            lily_cpu::linear::matmul(&g, m, &x, &mut cg);
            lily_cpu::linear::matmul(&u, m, &x, &mut cu);
            let cpu: Vec<f32> = cg.iter().zip(&cu).map(|(a, b)| (silu64(*a as f64) * *b as f64) as f32).collect();
            let refs = Refs {
                exact: swiglu_ref(Precision::Exact),
                bf16x: swiglu_ref(Precision::Bf16x),
                fast: swiglu_ref(Precision::Fast),
                half: swiglu_ref(Precision::Half),
                cpu,
            };
            for p in PRECISIONS {
                for tile in TILES {
                    let mut y = poisoned(&dev, t * rows + SPARE);
                    let what = format!("swiglu_gemm {f} [{count}x{rows}x{cols}] m={m} t={t} {p:?} {tile:?}");
                    let r = gemm::swiglu_gemm_with(&dev, &dg, &du, m, &xd, t, &mut y, Opts { tile, precision: p, ..Default::default() });
                    if !tile_takes(tile, &g, p, false, false, rows.div_ceil(64).is_multiple_of(2)) {
                        assert!(r.is_err(), "{what}: refused tile taken");
                        continue;
                    }
                    r.unwrap();
                    let got = download_checked(&dev, &y, t * rows, &what);
                    compare(&got, &refs, effective(tile, &g, p, false), &mut worst, &what);
                }
            }
        }
    }
    worst.print("swiglu_gemm");
}

// ---------------------------------------------------------------------------------------------------
// Grouped

/// Per-expert slot counts → offsets (E + 1).
fn offsets_of(counts: &[usize]) -> Vec<u32> {
    let mut o = vec![0u32];
    for c in counts {
        o.push(o.last().unwrap() + *c as u32);
    }
    o
}

/// One grouped case: `counts` slots per expert, with a random gather (`gather_rows` = Some(x rows)) or
/// none; checks `grouped_gemm` (or `grouped_swiglu_gemm` when `swiglu`) slot by slot against the plain
/// references, in both precisions and with every tile.
#[allow(clippy::too_many_arguments)]
fn grouped_case(
    dev: &Device,
    rng: &mut Rng,
    f: Fmt,
    rows: usize,
    cols: usize,
    counts: &[usize],
    gather_rows: Option<usize>,
    swiglu: bool,
) -> Worst {
    let e_count = counts.len();
    let n: usize = counts.iter().sum();
    let off = offsets_of(counts);
    let g = matrix(rng, f, e_count, rows, cols);
    let u = if swiglu { Some(matrix(rng, f, e_count, rows, cols)) } else { None };
    let dg = upload_matrix(dev, &g).unwrap();
    let du = u.as_ref().map(|u| upload_matrix(dev, u).unwrap());
    let x_rows = gather_rows.unwrap_or(n);
    // With a gather, x holds exactly x_rows rows (the kernel must not read past them); without, two NaN
    // rows follow the n rows it may read.
    let (xd, x, _) = inputs(dev, rng, x_rows, cols, if gather_rows.is_some() { 0 } else { 2 });
    let src: Vec<u32> = match gather_rows {
        Some(xr_n) => (0..n).map(|_| rng.below(xr_n) as u32).collect(),
        None => (0..n as u32).collect(),
    };
    let src_d = dev.upload(&src).unwrap();
    let off_d = dev.upload(&off).unwrap();

    let zeros = || vec![0.0f64; n * rows];
    let mut refs = Refs { exact: zeros(), bf16x: zeros(), fast: zeros(), half: zeros(), cpu: vec![0.0f32; n * rows] };
    for e in 0..e_count {
        let (a, b) = (off[e] as usize, off[e + 1] as usize);
        if a == b {
            continue;
        }
        // lily-cpu on the gathered rows of this expert.
        let xe: Vec<f32> = (a..b).flat_map(|i| x[src[i] as usize * cols..(src[i] as usize + 1) * cols].to_vec()).collect();
        let mut cg = vec![0.0f32; (b - a) * rows];
        lily_cpu::linear::matmul(&g, e, &xe, &mut cg);
        let cu = u.as_ref().map(|u| {
            let mut v = vec![0.0f32; (b - a) * rows];
            lily_cpu::linear::matmul(u, e, &xe, &mut v);
            v
        });
        for i in a..b {
            let c = &mut refs.cpu[i * rows..(i + 1) * rows];
            let k = (i - a) * rows;
            match &cu {
                Some(cu) => c.iter_mut().enumerate().for_each(|(j, o)| *o = (silu64(cg[k + j] as f64) * cu[k + j] as f64) as f32),
                None => c.copy_from_slice(&cg[k..k + rows]),
            }
        }
        // The f64 references of each precision.
        let rg = RefMat::new(&g, e);
        let ru = u.as_ref().map(|u| RefMat::new(u, e));
        for (p, want) in
            [(Precision::Exact, &mut refs.exact), (Precision::Bf16x, &mut refs.bf16x), (Precision::Fast, &mut refs.fast), (Precision::Half, &mut refs.half)]
        {
            for i in a..b {
                let s = src[i] as usize;
                let xt = &x[s * cols..(s + 1) * cols];
                let gv = rg.apply(p, xt);
                let out = &mut want[i * rows..(i + 1) * rows];
                match &ru {
                    Some(ru) => {
                        let uv = ru.apply(p, xt);
                        out.iter_mut().zip(gv.iter().zip(&uv)).for_each(|(o, (a, b))| *o = silu64(*a) * b);
                    }
                    None => out.copy_from_slice(&gv),
                }
            }
        }
    }

    let mut worst = Worst::default();
    for p in PRECISIONS {
        for tile in TILES {
            let mut y = poisoned(dev, n * rows + SPARE);
            let gather = gather_rows.map(|_| &src_d);
            let r = match &du {
                Some(du) => gemm::grouped_swiglu_gemm_with(dev, &dg, du, &off_d, gather, &xd, n, &mut y, Opts { tile, precision: p, ..Default::default() }),
                None => gemm::grouped_gemm_with(dev, &dg, &off_d, gather, &xd, n, &mut y, Opts { tile, precision: p, ..Default::default() }),
            };
            if !tile_takes(tile, &g, p, false, true, false) {
                assert!(r.is_err(), "grouped {f}: {tile:?} took {p:?}");
                continue;
            }
            r.unwrap();
            let what = format!(
                "grouped{} {f} E={e_count} [{rows}x{cols}] n={n} gather={:?} {p:?} {tile:?}",
                if swiglu { " swiglu" } else { "" },
                gather_rows
            );
            let got = download_checked(dev, &y, n * rows, &what);
            compare(&got, &refs, effective(tile, &g, p, false), &mut worst, &what);
        }
    }
    worst
}

/// Expert sizes: empty experts, single slots, and experts of more than two tiles (> 128 slots).
const COUNTS: &[usize] = &[0, 1, 150, 0, 37, 64, 1, 0, 200, 5, 0, 0, 33];

/// Random routing of `n` slots over `e` experts (many empty when n is small).
fn random_counts(rng: &mut Rng, e: usize, n: usize) -> Vec<usize> {
    let mut c = vec![0usize; e];
    for _ in 0..n {
        // Skewed: a few popular experts.
        let k = if rng.uniform() < 0.3 { rng.below(e.min(8)) } else { rng.below(e) };
        c[k] += 1;
    }
    c
}

fn grouped_suite(swiglu: bool) {
    let Some(dev) = device() else { return };
    let mut rng = Rng::new(if swiglu { 202 } else { 201 });
    let mut worst = Worst::default();
    for f in FORMATS {
        let cols = match f.gs {
            0 | 32 => 96,
            64 => 128,
            _ => 256,
        };
        for gather in [None, Some(100)] {
            worst.merge(&grouped_case(&dev, &mut rng, f, 70, cols, COUNTS, gather, swiglu));
        }
    }
    // MoE-like: 256 experts with skewed random routing (gate/up-like K = 2048, and down-like K = 512),
    // gathering from 100 token rows (repeated rows); and the 512-expert maximum with tiny matrices.
    let f = Fmt { bits: 4, gs: 64 };
    let counts = random_counts(&mut rng, 256, 800);
    worst.merge(&grouped_case(&dev, &mut rng, f, 40, 2048, &counts, Some(100), swiglu));
    let counts = random_counts(&mut rng, 256, 800);
    worst.merge(&grouped_case(&dev, &mut rng, f, 136, 512, &counts, None, swiglu));
    let counts = random_counts(&mut rng, 512, 1500);
    worst.merge(&grouped_case(&dev, &mut rng, Fmt { bits: 8, gs: 32 }, 8, 64, &counts, Some(300), swiglu));
    // Every slot in the last expert, and a single expert.
    let mut last = vec![0usize; 9];
    last[8] = 131;
    worst.merge(&grouped_case(&dev, &mut rng, f, 33, 128, &last, None, swiglu));
    worst.merge(&grouped_case(&dev, &mut rng, f, 33, 128, &[77], Some(20), swiglu));
    worst.print(if swiglu { "grouped_swiglu_gemm" } else { "grouped_gemm" });
}

#[test]
fn grouped_gemm_matches_reference() {
    grouped_suite(false);
}

#[test]
fn grouped_swiglu_gemm_matches_reference() {
    grouped_suite(true);
}

/// Half scales each x row by its own power of two: rows of wildly different magnitude (1e-9 to 1e9,
/// far outside f16's range of 6e-5 to 65504) each come out as close to their reference as an
/// ordinary row (relative to the row's own largest output), and a row holding an infinity gives a
/// non-finite output row without touching its neighbours.
#[test]
fn half_scales_each_row_into_f16_range() {
    let Some(dev) = device() else { return };
    let mut rng = Rng::new(207);
    let (rows, cols) = (200, 512);
    let mags = [1e-9f32, 1e-3, 1.0, 700.0, 1e5, 3e9, 1.0];
    let t = mags.len();
    let w = matrix(&mut rng, Fmt { bits: 4, gs: 64 }, 1, rows, cols);
    let dw = upload_matrix(&dev, &w).unwrap();
    let mut x = rng.normals(t * cols, 1.0);
    for (r, m) in mags.iter().enumerate() {
        x[r * cols..(r + 1) * cols].iter_mut().for_each(|v| *v *= m);
    }
    let rm = RefMat::new(&w, 0);
    for tile in [Tile::Wg64, Tile::Wg128, Tile::Wg128x256, Tile::Ws128, Tile::Ws256, Tile::Ws4, Tile::Ss256, Tile::Ws128T256, Tile::Ws128T160, Tile::Mc256] {
        let o = Opts { tile, precision: Precision::Half, ..Default::default() };
        let xd = dev.upload(&x).unwrap();
        let mut y = poisoned(&dev, t * rows);
        gemm::gemm_with(&dev, &dw, 0, &xd, t, &mut y, o).unwrap();
        let got = dev.download(&y).unwrap();
        for r in 0..t {
            let xr = &x[r * cols..(r + 1) * cols];
            let what = format!("half {tile:?}: row {r} (|x| ~ {:e})", mags[r]);
            check(&got[r * rows..(r + 1) * rows], &rm.apply(Precision::Half, xr), TOL, &what);
            check(&got[r * rows..(r + 1) * rows], &rm.apply(Precision::Exact, xr), CPU_TOL_HALF, &format!("{what} vs the unrounded product"));
        }
        // An infinity in row 2: that row is not finite, the others unchanged.
        let mut xi = x.clone();
        xi[2 * cols + 7] = f32::INFINITY;
        let xd = dev.upload(&xi).unwrap();
        let mut yi = poisoned(&dev, t * rows);
        gemm::gemm_with(&dev, &dw, 0, &xd, t, &mut yi, o).unwrap();
        let gi = dev.download(&yi).unwrap();
        assert!(gi[2 * rows..3 * rows].iter().any(|v| !v.is_finite()), "half {tile:?}: an infinite x gave a finite row");
        for r in (0..t).filter(|&r| r != 2) {
            assert_eq!(gi[r * rows..(r + 1) * rows], got[r * rows..(r + 1) * rows], "half {tile:?}: row {r} changed with row 2's infinity");
        }
    }
}

/// The half numerics' x staging (`gemm_wgmma::stage_half`), both stagers, against the layout computed
/// here: each row's 2^e from its largest |x| (the largest scaled value in [2^14, 2^15), e within ±110,
/// 0 for a zero row or one whose largest |x| is infinite; NaNs skipped), x·2^-e rounded to f16 at the
/// permuted column 16s + 8h + 2q + e' of element 16q + 8h + 4e' + s of each group of 64. Bit for bit,
/// on rows of 64 to 4,096 columns (a warp a row up to 1,024; 64, 128 and 256 threads a block past it) whose magnitudes span 1e-30 to
/// 1e30, a zero row, rows with an infinity or a NaN, and random values (not zeros) elsewhere.
#[test]
fn half_stagers_match_the_layout_bit_for_bit() {
    use lily_cuda::ops::gemm_wgmma::{stage_half, Stager};
    let Some(dev) = device() else { return };
    let mut rng = Rng::new(311);
    for (rows, cols) in [(9, 64), (7, 512), (5, 1024), (12, 2048), (3, 4096), (2, 320), (4, 1536), (17, 128)] {
        let mut x = rng.normals(rows * cols, 1.0);
        for r in 0..rows {
            let row = &mut x[r * cols..(r + 1) * cols];
            match r {
                0 => row.iter_mut().for_each(|v| *v = 0.0),
                1 => row[cols / 3] = f32::INFINITY,
                2 => row[5] = f32::NAN,
                _ => {
                    let m = 10f32.powf(rng.range(-30.0, 30.0));
                    row.iter_mut().for_each(|v| *v *= m);
                }
            }
        }
        // The layout, computed here.
        let mut want = vec![0u16; rows * cols];
        let mut want_s = vec![0f32; rows];
        for r in 0..rows {
            let row = &x[r * cols..(r + 1) * cols];
            let m = row.iter().fold(0f32, |a, v| if v.is_nan() { a } else { a.max(v.abs()) });
            let e: i32 = if m > 0.0 && m.is_finite() { ((m as f64).log2().floor() as i32 - 14).clamp(-110, 110) } else { 0 };
            let down = 2f32.powi(-e);
            want_s[r] = 2f32.powi(e);
            for (k, &v) in row.iter().enumerate() {
                let (g, mm) = (k / 64, k % 64);
                let (q, rem) = (mm / 16, mm % 16);
                let (h, ee, s4) = (rem / 8, (rem / 4) % 2, rem % 4);
                want[r * cols + 64 * g + 16 * s4 + 8 * h + 2 * q + ee] = half::f16::from_f32(v * down).to_bits();
            }
        }
        let xd = dev.upload(&x).unwrap();
        for kind in [Stager::Warp, Stager::Rows] {
            let (plane, scales) = stage_half(&dev, &xd, rows, cols, kind).unwrap();
            let (got, got_s) = (dev.download(&plane).unwrap(), dev.download(&scales).unwrap());
            for r in 0..rows {
                assert_eq!(got_s[r].to_bits(), want_s[r].to_bits(), "{kind:?} [{rows} x {cols}] row {r}: scale {} vs {}", got_s[r], want_s[r]);
                // A NaN as any f16 NaN (the half crate keeps the payload, the GPU's conversion does not).
                let is_nan16 = |b: u16| b & 0x7c00 == 0x7c00 && b & 0x03ff != 0;
                let same = |a: u16, b: u16| a == b || (is_nan16(a) && is_nan16(b));
                let bad = (0..cols).find(|&c| !same(got[r * cols + c], want[r * cols + c]));
                assert!(bad.is_none(), "{kind:?} [{rows} x {cols}] row {r}: column {bad:?} differs");
            }
        }
    }
    // Columns not a multiple of 64 are refused.
    let xd = dev.upload(&vec![1.0f32; 96]).unwrap();
    assert!(stage_half(&dev, &xd, 1, 96, Stager::Rows).is_err());
}

#[test]
fn grouped_gather_past_x_gives_nan_rows_only() {
    let Some(dev) = device() else { return };
    let mut rng = Rng::new(203);
    let f = Fmt { bits: 4, gs: 64 };
    let (rows, cols) = (50, 128);
    let counts = [3usize, 0, 4];
    let n = 7;
    let w = matrix(&mut rng, f, 3, rows, cols);
    let dw = upload_matrix(&dev, &w).unwrap();
    let (xd, x, _) = inputs(&dev, &mut rng, 5, cols, 0);
    let src: Vec<u32> = vec![0, 4, 5, 2, 1, 99, 3]; // slots 2 and 5 read past the 5 rows of x
    let src_d = dev.upload(&src).unwrap();
    let off_d = dev.upload(&offsets_of(&counts)).unwrap();
    let expert = [0usize, 0, 0, 2, 2, 2, 2];
    // Every precision on the Auto tile, and Half on the warp-specialised ones too.
    let runs = PRECISIONS.iter().map(|&p| (p, Tile::Auto)).chain(
        [Tile::Ws128, Tile::Ws256, Tile::Ws4, Tile::Ss256, Tile::Ws128T256, Tile::Ws128T160].map(|tile| (Precision::Half, tile)),
    );
    for (p, tile) in runs {
        let mut y = poisoned(&dev, n * rows);
        util::fill(&dev, &mut y, 0.5).unwrap();
        gemm::grouped_gemm_with(&dev, &dw, &off_d, Some(&src_d), &xd, n, &mut y, Opts { tile, precision: p, ..Default::default() }).unwrap();
        let got = dev.download(&y).unwrap();
        for i in 0..n {
            let row = &got[i * rows..(i + 1) * rows];
            if src[i] >= 5 {
                assert!(row.iter().all(|v| v.is_nan()), "{p:?} {tile:?}: slot {i} reads row {} of 5: must be NaN", src[i]);
            } else {
                let s = src[i] as usize;
                let tol = if matches!(p, Precision::Fast | Precision::Half) { TOL } else { TOL_EXACT };
                let want = RefMat::new(&w, expert[i]).apply(p, &x[s * cols..(s + 1) * cols]);
                check(row, &want, tol, &format!("{p:?} {tile:?}: slot {i} next to bad gathers"));
            }
        }
    }
}

/// The warp-specialised tiles on calls of more tiles than the GPU has SMs (each block walks several, its
/// ring running on across tile boundaries), in every form: the same sums as the two-warpgroup Wg128
/// tile (the same dequantised f16 weights, the same MMAs in the same order), held to it at TOL and
/// reported as the share of bit-identical outputs.
#[test]
fn warp_specialised_tiles_walk_many_tiles_like_wg128() {
    let Some(dev) = device() else { return };
    let mut rng = Rng::new(208);
    let f = Fmt { bits: 4, gs: 64 };
    let half = |tile| Opts { tile, precision: Precision::Half, ..Default::default() };
    // The cluster pairs (Mc256) take the plain and SwiGLU forms only.
    let compare_ws = |what: &str, run: &mut dyn FnMut(Tile, &mut CudaSlice<f32>), n: usize| {
        let mut want = poisoned(&dev, n);
        run(Tile::Wg128, &mut want);
        let want = dev.download(&want).unwrap();
        let want64: Vec<f64> = want.iter().map(|&v| v as f64).collect();
        let pairs = !what.starts_with("grouped");
        for tile in [Tile::Ws128, Tile::Ws256, Tile::Ws4, Tile::Ss256, Tile::Ws128T256, Tile::Ws128T160, Tile::Mc256] {
            if tile == Tile::Mc256 && !pairs {
                continue;
            }
            let mut y = poisoned(&dev, n);
            run(tile, &mut y);
            let got = dev.download(&y).unwrap();
            let same = got.iter().zip(&want).filter(|(a, b)| a.to_bits() == b.to_bits()).count();
            println!("{what} {tile:?}: {same} of {n} outputs bit-identical to Wg128");
            check(&got, &want64, TOL, &format!("{what} {tile:?} vs Wg128"));
        }
    };
    // Plain: 8192 rows (64 / 32 row tiles) × 5 token tiles (the last of 8 tokens).
    let (rows, cols, t) = (8192, 256, 520);
    let w = upload_matrix(&dev, &matrix(&mut rng, f, 1, rows, cols)).unwrap();
    let (xd, _, _) = inputs(&dev, &mut rng, t, cols, 0);
    compare_ws("plain [8192x256] t=520", &mut |tile, y| gemm::gemm_with(&dev, &w, 0, &xd, t, y, half(tile)).unwrap(), t * rows);
    // SwiGLU: 2048 rows of gate and up (32 / 16 row tiles) × 3 token tiles.
    let (rows, cols, t) = (2048, 512, 300);
    let (g, u) = (upload_matrix(&dev, &matrix(&mut rng, f, 1, rows, cols)).unwrap(), upload_matrix(&dev, &matrix(&mut rng, f, 1, rows, cols)).unwrap());
    let (xd, _, _) = inputs(&dev, &mut rng, t, cols, 0);
    compare_ws("swiglu [2048x512] t=300", &mut |tile, y| gemm::swiglu_gemm_with(&dev, &g, &u, 0, &xd, t, y, half(tile)).unwrap(), t * rows);
    // Grouped (and SwiGLU), 64 experts with skewed routing, gathering from 900 token rows.
    let e = 64;
    let counts = random_counts(&mut rng, e, 3000);
    let n: usize = counts.iter().sum();
    let off = dev.upload(&offsets_of(&counts)).unwrap();
    let src = dev.upload(&(0..n).map(|_| rng.below(900) as u32).collect::<Vec<u32>>()).unwrap();
    let (rows, cols) = (384, 1024);
    let (g, u) = (upload_matrix(&dev, &matrix(&mut rng, f, e, rows, cols)).unwrap(), upload_matrix(&dev, &matrix(&mut rng, f, e, rows, cols)).unwrap());
    let (xd, _, _) = inputs(&dev, &mut rng, 900, cols, 0);
    compare_ws(
        "grouped [64x384x1024] n=3000",
        &mut |tile, y| gemm::grouped_gemm_with(&dev, &g, &off, Some(&src), &xd, n, y, half(tile)).unwrap(),
        n * rows,
    );
    compare_ws(
        "grouped swiglu [64x384x1024] n=3000",
        &mut |tile, y| gemm::grouped_swiglu_gemm_with(&dev, &g, &u, &off, Some(&src), &xd, n, y, half(tile)).unwrap(),
        n * rows,
    );
    // Experts of 0 to 700 slots (one to three 256-slot tiles; tails of 1, 127, 128, 129 and 188 slots),
    // without a gather: Ws128T256's second half on and off within one launch.
    let counts = [0usize, 1, 130, 700, 256, 257, 128, 383, 90, 0, 512, 40];
    let e = counts.len();
    let n: usize = counts.iter().sum();
    let off = dev.upload(&offsets_of(&counts)).unwrap();
    let (rows, cols) = (256, 512);
    let (g, u) = (upload_matrix(&dev, &matrix(&mut rng, f, e, rows, cols)).unwrap(), upload_matrix(&dev, &matrix(&mut rng, f, e, rows, cols)).unwrap());
    let (xd, _, _) = inputs(&dev, &mut rng, n, cols, 0);
    compare_ws("grouped [12x256x512] n=2497", &mut |tile, y| gemm::grouped_gemm_with(&dev, &g, &off, None, &xd, n, y, half(tile)).unwrap(), n * rows);
    compare_ws(
        "grouped swiglu [12x256x512] n=2497",
        &mut |tile, y| gemm::grouped_swiglu_gemm_with(&dev, &g, &u, &off, None, &xd, n, y, half(tile)).unwrap(),
        n * rows,
    );
}

/// The grouped form's bf16 outputs (`grouped_gemm_with` into a u16 buffer: the MoE down projection's
/// slots for the combine) are, bit for bit, the same tile's f32 outputs rounded to nearest even on the
/// host (the f32 outputs are held to the f64 reference by the suites above); spare elements past the
/// end stay untouched; a gathered row past x stays NaN. A forced 256-row or warp-specialised tile runs
/// the 128-row tile of its token width. Row counts that take the 16-byte row stores in every tile, in
/// all but the last, and in none. Refused: Exact, the mma.sync tiles, 8-bit weights.
#[test]
fn grouped_bf16_outputs_are_the_f32_outputs_rounded() {
    let Some(dev) = device() else { return };
    let mut rng = Rng::new(211);
    let f = Fmt { bits: 4, gs: 64 };
    let half = |tile| Opts { tile, precision: Precision::Half, ..Default::default() };
    let (e, cols) = (64, 512);
    const POISON: u16 = 0xFFFF; // a bf16 NaN
    // 384 rows: every tile's rows exist (the 16-byte row stores); 200: the last row tile holds 72 (its
    // outputs one at a time); 84: rows not a multiple of 8 (every tile one at a time).
    for (rows, n_target, gather) in [(384, 3000, true), (384, 3000, false), (384, 9000, false), (384, 700, true), (200, 3000, true), (84, 1500, false)] {
        let w = upload_matrix(&dev, &matrix(&mut rng, f, e, rows, cols)).unwrap();
        let counts = random_counts(&mut rng, e, n_target);
        let n: usize = counts.iter().sum();
        let off = dev.upload(&offsets_of(&counts)).unwrap();
        // With the gather, 5 slots read a row past x (NaN rows).
        let x_rows = if gather { 900 } else { n };
        let src: Vec<u32> = (0..n).map(|i| if gather && i % 601 == 5 { x_rows as u32 + 3 } else { rng.below(x_rows.min(900)) as u32 }).collect();
        let src = dev.upload(&src).unwrap();
        let (xd, _, _) = inputs(&dev, &mut rng, x_rows, cols, 0);
        let rows_arg = gather.then_some(&src);
        for tile in [Tile::Auto, Tile::Wg32, Tile::Wg64, Tile::Wg128, Tile::Wg128x256, Tile::Ws128, Tile::Ws4, Tile::Ws128T256, Tile::Ws128T160] {
            // The f32 outputs of the tile that runs: a forced wide tile runs the 128-row one (not the
            // two-part tiles, which take bf16 outputs themselves; Auto takes the 160-token one from 96
            // slots an expert).
            let f32_tile = match tile {
                Tile::Wg128x256 | Tile::Ws128 | Tile::Ws4 => Tile::Wg128,
                Tile::Auto if n / e < 96 => Tile::Wg64,
                Tile::Auto => Tile::Ws128T160,
                t => t,
            };
            let mut y = poisoned(&dev, n * rows);
            gemm::grouped_gemm_with(&dev, &w, &off, rows_arg, &xd, n, &mut y, half(f32_tile)).unwrap();
            let want: Vec<u16> = dev.download(&y).unwrap().iter().map(|&v| bf16::from_f32(v).to_bits()).collect();
            let mut y16 = dev.upload(&vec![POISON; n * rows + SPARE]).unwrap();
            gemm::grouped_gemm_with(&dev, &w, &off, rows_arg, &xd, n, &mut y16, half(tile)).unwrap();
            let got = dev.download(&y16).unwrap();
            let what = format!("grouped bf16 [{e}x{rows}x{cols}] n={n} gather={gather} {tile:?}");
            assert!(got[n * rows..].iter().all(|&v| v == POISON), "{what}: wrote past the end");
            let nan = |v: u16| bf16::from_bits(v).is_nan();
            let bad = got[..n * rows].iter().zip(&want).filter(|&(&g, &w)| if nan(w) { !nan(g) } else { g != w }).count();
            let nans = want.iter().filter(|&&v| nan(v)).count();
            assert_eq!(bad, 0, "{what}: {bad} outputs differ from the f32 outputs rounded");
            assert_eq!(nans, if gather { rows * (0..n).filter(|i| i % 601 == 5).count() } else { 0 }, "{what}: NaN rows");
            println!("{what}: {} outputs bit for bit bf16(f32 outputs), {nans} NaN", n * rows);
        }
    }
    // Refused: other numerics, the mma.sync tiles, 8-bit weights.
    let rows = 384;
    let w = upload_matrix(&dev, &matrix(&mut rng, f, e, rows, cols)).unwrap();
    let counts = random_counts(&mut rng, e, 500);
    let n: usize = counts.iter().sum();
    let off = dev.upload(&offsets_of(&counts)).unwrap();
    let (xd, _, _) = inputs(&dev, &mut rng, n, cols, 0);
    let mut y16 = dev.upload(&vec![POISON; n * rows]).unwrap();
    let exact = Opts { tile: Tile::Wg128, precision: Precision::Exact, ..Default::default() };
    assert!(gemm::grouped_gemm_with(&dev, &w, &off, None, &xd, n, &mut y16, exact).is_err());
    assert!(gemm::grouped_gemm_with(&dev, &w, &off, None, &xd, n, &mut y16, half(Tile::M64)).is_err());
    let w8 = upload_matrix(&dev, &matrix(&mut rng, Fmt { bits: 8, gs: 64 }, e, rows, cols)).unwrap();
    assert!(gemm::grouped_gemm_with(&dev, &w8, &off, None, &xd, n, &mut y16, half(Tile::Auto)).is_err());
    assert!(dev.download(&y16).unwrap().iter().all(|&v| v == POISON), "a refused call wrote");
    assert!(gemm::bf16_out_ok(&w, half(Tile::Auto)) && !gemm::bf16_out_ok(&w8, half(Tile::Auto)) && !gemm::bf16_out_ok(&w, exact));
}

/// The split-K tiles on shapes of few tiles (each split over 2–8 blocks): the router's (257 × 2048,
/// 8-bit, Exact) and an output projection's (2048 × 4096 and 256 × 4096, 4-bit, Half and Exact). Each
/// call twice on the same inputs gives the same bits (the partials summed in split order whichever
/// block finishes last; a counter not reset would leave the second call's outputs unwritten), and
/// each agrees with `Wg64` (the same tile without the split: the same products, summed in another
/// order) to 2e-6 of the largest output, and with the f64 reference at the suite's tolerances.
#[test]
fn split_k_tiles_are_deterministic_and_match_the_unsplit_tile() {
    let Some(dev) = device() else { return };
    let mut rng = Rng::new(207);
    let q4 = Fmt { bits: 4, gs: 64 };
    let q8 = Fmt { bits: 8, gs: 64 };
    let cases: [(Fmt, usize, usize, usize, &[Precision]); 4] = [
        (q8, 257, 2048, 100, &[Precision::Exact]),
        (q8, 257, 2048, 256, &[Precision::Exact]),
        (q4, 2048, 4096, 256, &[Precision::Half, Precision::Exact]),
        (q4, 256, 4096, 33, &[Precision::Half, Precision::Exact]),
    ];
    for (f, rows, cols, t, precisions) in cases {
        let w = matrix(&mut rng, f, 1, rows, cols);
        let (xd, x, xr) = inputs(&dev, &mut rng, t, cols, 2);
        let refs = plain_refs(&w, 0, &x, &xr);
        let dw = upload_matrix(&dev, &w).unwrap();
        for &p in precisions {
            let what = format!("split-K {f} [{rows}x{cols}] t={t} {p:?}");
            let run = |tile: Tile| {
                let mut y = poisoned(&dev, t * rows + SPARE);
                gemm::gemm_with(&dev, &dw, 0, &xd, t, &mut y, Opts { tile, precision: p, ..Default::default() }).unwrap();
                download_checked(&dev, &y, t * rows, &format!("{what} {tile:?}"))
            };
            let (a, b, unsplit) = (run(Tile::Wg64K), run(Tile::Wg64K), run(Tile::Wg64));
            assert!(a.iter().zip(&b).all(|(u, v)| u.to_bits() == v.to_bits()), "{what}: two calls differ");
            let scale = unsplit.iter().fold(0.0f32, |m, v| m.max(v.abs())) as f64;
            let worst = a.iter().zip(&unsplit).map(|(u, v)| (*u as f64 - *v as f64).abs()).fold(0.0, f64::max) / scale;
            assert!(worst <= 2e-6, "{what}: {worst:.2e} from Wg64");
            let mut wst = Worst::default();
            compare(&a, &refs, p, &mut wst, &what);
            eprintln!("{what}: {worst:.2e} from Wg64 (largest output {scale:.3})");
        }
    }
}

#[test]
fn gemm_rejects_bad_shapes_and_does_nothing_for_zero_tokens() {
    let Some(dev) = device() else { return };
    let mut rng = Rng::new(204);
    let q4 = Fmt { bits: 4, gs: 64 };
    let w = upload_matrix(&dev, &matrix(&mut rng, q4, 2, 40, 128)).unwrap();
    let x = dev.upload(&rng.normals(3 * 128, 1.0)).unwrap();
    let mut y = poisoned(&dev, 3 * 40);
    // Matrix past the stack; x or y too short.
    assert!(gemm::gemm(&dev, &w, 2, &x, 3, &mut y).is_err());
    assert!(gemm::gemm(&dev, &w, 0, &x, 4, &mut y).is_err());
    let mut y_short = poisoned(&dev, 3 * 40 - 1);
    assert!(gemm::gemm(&dev, &w, 0, &x, 3, &mut y_short).is_err());
    // cols not a multiple of 32 (dense, so the upload accepts it).
    let d48 = upload_matrix(&dev, &matrix(&mut rng, Fmt { bits: 16, gs: 0 }, 1, 8, 48)).unwrap();
    let x48 = dev.upload(&rng.normals(48, 1.0)).unwrap();
    let mut y8 = poisoned(&dev, 8);
    assert!(gemm::gemm(&dev, &d48, 0, &x48, 1, &mut y8).is_err());
    // Gate and up of different formats.
    let u32g = upload_matrix(&dev, &matrix(&mut rng, Fmt { bits: 4, gs: 32 }, 2, 40, 128)).unwrap();
    assert!(gemm::swiglu_gemm(&dev, &w, &u32g, 0, &x, 3, &mut y).is_err());
    // Grouped: offsets shorter than E + 1; more than 512 experts.
    let off_short = dev.upload(&[0u32, 3]).unwrap();
    assert!(gemm::grouped_gemm(&dev, &w, &off_short, None, &x, 3, &mut y).is_err());
    let many = upload_matrix(&dev, &matrix(&mut rng, Fmt { bits: 16, gs: 0 }, 513, 1, 32)).unwrap();
    let off_many = dev.upload(&vec![0u32; 514]).unwrap();
    let x32 = dev.upload(&rng.normals(32, 1.0)).unwrap();
    let mut y1 = poisoned(&dev, 1);
    assert!(gemm::grouped_gemm(&dev, &many, &off_many, None, &x32, 0, &mut y1).is_err());
    // Zero tokens: Ok, nothing written.
    gemm::gemm(&dev, &w, 1, &x, 0, &mut y).unwrap();
    gemm::swiglu_gemm(&dev, &w, &w, 1, &x, 0, &mut y).unwrap();
    let off0 = dev.upload(&[0u32, 0, 0]).unwrap();
    gemm::grouped_gemm(&dev, &w, &off0, None, &x, 0, &mut y).unwrap();
    gemm::grouped_swiglu_gemm(&dev, &w, &w, &off0, None, &x, 0, &mut y).unwrap();
    assert!(dev.download(&y).unwrap().iter().all(|v| v.is_nan()), "t = 0 wrote something");
}

// ---------------------------------------------------------------------------------------------------
// Timing table (run with `--ignored bench_gemm`)

/// Random `count` × `[rows, cols]` affine matrices from random bytes (benchmarks need realistic,
/// non-zero bytes, not a quantiser).
fn bench_affine(up: &mut Uploader, rng: &mut Rng, count: usize, rows: usize, cols: usize, bits: u32, gs: usize) -> DeviceMatrix {
    let n = count * rows * cols;
    let packed: Vec<u32> = (0..n * bits as usize / 32).map(|_| rng.next_u64() as u32).collect();
    let scales: Vec<bf16> = (0..n / gs).map(|_| bf16::from_f32(0.002 + 0.01 * rng.uniform() as f32)).collect();
    let biases: Vec<bf16> = (0..n / gs).map(|_| bf16::from_f32(-0.05 * rng.uniform() as f32)).collect();
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

/// Median seconds of `op` over 20 timed runs (CUDA events around each), after 3 warm-up runs.
fn time_op(dev: &Device, mut op: impl FnMut()) -> f64 {
    use cudarc::driver::sys::CUevent_flags;
    for _ in 0..3 {
        op();
    }
    dev.synchronize().unwrap();
    let ctx = dev.context();
    const REPS: usize = 20;
    let ev: Vec<_> = (0..2 * REPS).map(|_| ctx.new_event(Some(CUevent_flags::CU_EVENT_DEFAULT)).unwrap()).collect();
    util::spin(dev, 5_000_000).unwrap(); // the host queues the runs meanwhile
    for r in 0..REPS {
        ev[2 * r].record(dev.stream()).unwrap();
        op();
        ev[2 * r + 1].record(dev.stream()).unwrap();
    }
    dev.synchronize().unwrap();
    let mut t: Vec<f64> = (0..REPS).map(|r| ev[2 * r].elapsed_ms(&ev[2 * r + 1]).unwrap() as f64 * 1e-3).collect();
    t.sort_by(|a, b| a.partial_cmp(b).unwrap());
    t[REPS / 2]
}

fn report(what: &str, flops: f64, t: f64) {
    println!("{what:<66} {:>10.1} us {:>8.1} TFLOP/s", t * 1e6, flops / t / 1e12);
}

/// Times `op(tile, precision)` for every tile and precision that takes the shape; prints one line each, then the
/// Exact/Fast time ratio with the Auto tile. `BENCH_FILTER` (substrings separated by `|`): only the
/// lines whose label contains one of them.
fn bench_both(dev: &Device, what: &str, flops: f64, mut op: impl FnMut(Tile, Precision) -> lily_cuda::Result<()>) {
    let filter = std::env::var("BENCH_FILTER").ok();
    let mut auto = [0.0f64; 4];
    for p in PRECISIONS {
        for tile in TILES {
            let label = format!("{what} {tile:?} {p:?}");
            if filter.as_deref().is_some_and(|f| !f.split('|').any(|part| label.contains(part))) {
                continue;
            }
            if op(tile, p).is_err() {
                continue; // a tile that does not take this format or precision
            }
            let s = time_op(dev, || op(tile, p).unwrap());
            report(&label, flops, s);
            if tile == Tile::Auto {
                auto[pidx(p)] = s;
            }
        }
    }
    println!("{what}: Exact / Bf16x / Half / Fast time (Auto) = {:.2} / {:.2} / {:.2} / 1", auto[0] / auto[2], auto[1] / auto[2], auto[3] / auto[2]);
}

#[test]
#[ignore = "timing; run on the GPU machine"]
fn bench_gemm() {
    let Some(dev) = device() else { return };
    let mut rng = Rng::new(7);
    let mut up = Uploader::new(&dev).unwrap();
    // Plain: (rows, cols, bits, gs, name).
    let plain: &[(usize, usize, u32, usize, &str)] = &[
        (8192, 2048, 4, 64, "attn/GDN in"),
        (4096, 2048, 4, 64, "attn/GDN in"),
        (32, 2048, 4, 64, "GDN gates"),
        (32, 2048, 8, 64, "GDN gates 8-bit"),
        (2048, 4096, 4, 64, "attn/GDN out"),
        (1024, 2048, 4, 64, "k/v"),
        (2048, 512, 4, 64, "shared expert down"),
        (257, 2048, 8, 64, "router + shared gate"),
        (248320, 2048, 4, 64, "lm_head"),
    ];
    let max_t = 4096;
    let x = dev.upload(&rng.normals(max_t * 8 * 2048, 1.0)).unwrap();
    let mut y = dev.zeros::<f32>(max_t * 248320).unwrap();
    println!("{:<66} {:>13} {:>16}", "shape", "median", "rate");
    for &(rows, cols, bits, gs, name) in plain {
        let w = bench_affine(&mut up, &mut rng, 1, rows, cols, bits, gs);
        for t in [512usize, 4096] {
            bench_both(&dev, &format!("gemm q{bits} g{gs} [{rows}x{cols}] t={t} ({name})"), 2.0 * (t * rows * cols) as f64, |tile, p| {
                gemm::gemm_with(&dev, &w, 0, &x, t, &mut y, Opts { tile, precision: p, ..Default::default() })
            });
        }
    }
    // Shared expert gate/up: SwiGLU [512, 2048].
    {
        let (g, u) = (bench_affine(&mut up, &mut rng, 1, 512, 2048, 4, 64), bench_affine(&mut up, &mut rng, 1, 512, 2048, 4, 64));
        for t in [512usize, 4096] {
            bench_both(&dev, &format!("swiglu q4 g64 [512x2048] t={t} (shared expert)"), 4.0 * (t * 512 * 2048) as f64, |tile, p| {
                gemm::swiglu_gemm_with(&dev, &g, &u, 0, &x, t, &mut y, Opts { tile, precision: p, ..Default::default() })
            });
        }
    }
    // MoE: 256 experts, n = 8 t slots with random routing; gate/up fused (gathering token rows), down.
    {
        let e = 256;
        let (g, u) = (bench_affine(&mut up, &mut rng, e, 512, 2048, 4, 64), bench_affine(&mut up, &mut rng, e, 512, 2048, 4, 64));
        let d = bench_affine(&mut up, &mut rng, e, 2048, 512, 4, 64);
        for t in [512usize, 4096] {
            let n = 8 * t;
            // Each token picks 8 distinct experts; slots sorted by expert.
            let mut pairs: Vec<(u32, u32)> = Vec::with_capacity(n);
            for tok in 0..t {
                let mut chosen: Vec<u32> = Vec::new();
                while chosen.len() < 8 {
                    let k = rng.below(e) as u32;
                    if !chosen.contains(&k) {
                        chosen.push(k);
                    }
                }
                pairs.extend(chosen.into_iter().map(|k| (k, tok as u32)));
            }
            pairs.sort();
            let mut counts = vec![0usize; e];
            pairs.iter().for_each(|(k, _)| counts[*k as usize] += 1);
            let off = dev.upload(&offsets_of(&counts)).unwrap();
            let src = dev.upload(&pairs.iter().map(|p| p.1).collect::<Vec<u32>>()).unwrap();
            let mut h = dev.zeros::<f32>(n * 512).unwrap();
            bench_both(&dev, &format!("grouped swiglu q4 E=256 [512x2048] n={n}"), 4.0 * (n * 512 * 2048) as f64, |tile, p| {
                gemm::grouped_swiglu_gemm_with(&dev, &g, &u, &off, Some(&src), &x, n, &mut h, Opts { tile, precision: p, ..Default::default() })
            });
            bench_both(&dev, &format!("grouped q4 E=256 [2048x512] n={n} (down)"), 2.0 * (n * 2048 * 512) as f64, |tile, p| {
                gemm::grouped_gemm_with(&dev, &d, &off, None, &h, n, &mut y, Opts { tile, precision: p, ..Default::default() })
            });
        }
    }
}

/// `Opts::reuse_x`: a wgmma GEMM whose x the previous call staged uses that staging (shown by writing
/// x in between, which breaks the caller's promise on purpose: the result is still the old x's), and
/// one whose x is not what the buffer holds, or whose previous call staged nothing, stages it (the
/// result is its own x's). Bit-for-bit: the same staged operands give the same sums.
#[test]
fn wgmma_gemm_reuses_staged_x_only_when_it_holds_that_x() {
    let Some(dev) = device() else { return };
    let mut rng = Rng::new(303);
    let (cols, t) = (256, 100);
    let f = Fmt { bits: 4, gs: 64 };
    let (w1, w2) = (matrix(&mut rng, f, 1, 128, cols), matrix(&mut rng, f, 1, 192, cols));
    let (d1, d2) = (upload_matrix(&dev, &w1).unwrap(), upload_matrix(&dev, &w2).unwrap());
    let (x1, x2) = (rng.normals(t * cols, 1.0), rng.normals(t * cols, 1.0));
    let plain = Opts { tile: Tile::Wg64, precision: Precision::Exact, ..Default::default() };
    let reuse = Opts { reuse_x: true, ..plain };
    let run = |w: &DeviceMatrix, x: &CudaSlice<f32>, o: Opts| {
        let mut y = poisoned(&dev, t * w.rows);
        gemm::gemm_with(&dev, w, 0, x, t, &mut y, o).unwrap();
        dev.download(&y).unwrap()
    };
    let (mut xa, xb) = (dev.upload(&x1).unwrap(), dev.upload(&x2).unwrap());
    let want1 = run(&d2, &xa, plain); // W2·x1
    let want2 = run(&d2, &xb, plain); // W2·x2
    assert!(want1.iter().all(|v| v.is_finite()) && want1 != want2);

    // Staged by the W1 call, reused by the W2 call: the same numbers as staging it again.
    run(&d1, &xa, plain);
    assert_eq!(run(&d2, &xa, reuse), want1, "reuse after staging the same x");
    // x1's buffer rewritten with x2 after its staging: reuse still reads the staged x1.
    run(&d1, &xa, plain);
    dev.upload_into(&x2, &mut xa).unwrap();
    assert_eq!(run(&d2, &xa, reuse), want1, "reuse must read the staged copy");
    // Without the promise it stages again and sees x2.
    assert_eq!(run(&d2, &xa, plain), want2, "no reuse without the promise");
    // The buffer holds another x (xb, staged last): reuse of xa stages xa (now x2's values) afresh.
    dev.upload_into(&x1, &mut xa).unwrap();
    run(&d1, &xb, plain);
    assert_eq!(run(&d2, &xa, reuse), want1, "a different x in the buffer is staged again");
    // A call that stages nothing (the mma.sync kernels) leaves nothing to reuse: xa staged, then read
    // by an mma.sync GEMM, then rewritten; the promise after that call stages the new values.
    run(&d1, &xa, plain);
    run(&d1, &xa, Opts { tile: Tile::M64, ..plain });
    dev.upload_into(&x2, &mut xa).unwrap();
    assert_eq!(run(&d2, &xa, reuse), want2, "a call that staged nothing in between");
    // A staging of the same x in other numerics (Half: one f16 plane and row scales) is not reused by
    // an Exact call, nor the other way round.
    dev.upload_into(&x1, &mut xa).unwrap();
    let half = Opts { tile: Tile::Wg64, precision: Precision::Half, ..Default::default() };
    let want_half = run(&d2, &xa, half);
    assert!(want_half.iter().all(|v| v.is_finite()) && want_half != want1);
    run(&d1, &xa, half);
    assert_eq!(run(&d2, &xa, reuse), want1, "an Exact call after a Half staging");
    run(&d1, &xa, plain);
    assert_eq!(run(&d2, &xa, Opts { reuse_x: true, ..half }), want_half, "a Half call after an Exact staging");
}

/// One launch each of the large shapes in the Half tiles, for `ncu` (run with `--ignored ncu_gemm`):
/// [8192×2048] t=4096 in Wg128 and Wg128x256, and the grouped down projection of a 4K chunk in Wg128
/// (what `Tile::Auto` takes for it).
#[test]
#[ignore = "for profiling with ncu on the GPU machine"]
fn ncu_gemm_shapes() {
    let Some(dev) = device() else { return };
    let mut rng = Rng::new(8);
    let mut up = Uploader::new(&dev).unwrap();
    let t = 4096;
    let x = dev.upload(&rng.normals(8 * t * 2048, 1.0)).unwrap();
    let mut y = dev.zeros::<f32>(8 * t * 2048).unwrap();
    let w = bench_affine(&mut up, &mut rng, 1, 8192, 2048, 4, 64);
    for tile in [Tile::Wg128, Tile::Wg128x256] {
        gemm::gemm_with(&dev, &w, 0, &x, t, &mut y, Opts { tile, precision: Precision::Half, ..Default::default() }).unwrap();
    }
    let d = bench_affine(&mut up, &mut rng, 256, 2048, 512, 4, 64);
    let n = 8 * t;
    let counts: Vec<usize> = (0..256).map(|e| n / 256 + usize::from(e < n % 256)).collect();
    let off = dev.upload(&offsets_of(&counts)).unwrap();
    let o = Opts { tile: Tile::Wg128, precision: Precision::Half, ..Default::default() };
    gemm::grouped_gemm_with(&dev, &d, &off, None, &x, n, &mut y, o).unwrap();
    dev.synchronize().unwrap();
}

//! CPU-vs-GPU tests of the full-attention preparation (`kernels/attn_prep.cu`, `ops::attn_prep`: q/k
//! RMSNorm, partial RoPE, gate split, bf16 KV-cache append, the cache copy) and of causal prefill
//! attention on the tensor cores (`kernels/attn_prefill.cu`, `ops::attn_prefill`: every form, mma.sync
//! and the two wgmma ones, each held to the CPU), plus a timing at the real shape (`bench_attn_prefill`, ignored by
//! default).
//!
//! References: `lily_cpu::norm::rms_norm_inplace` and `lily_cpu::attention::rope` on the same inputs for
//! prep (the code `lily_cpu::attention::forward` runs); for prefill, an f64 emulation of the kernel's
//! arithmetic (q and p rounded to bf16 where the kernel rounds them, the online softmax over the
//! form's tiles of 32 or 64 positions) and, as a sanity bound, the exact f64 loop of forward's softmax attention; for the
//! chunked-vs-step check, T single-token steps of prep + `ops::attention::decode` (the decode path).
//!
//! Each test skips (prints "no GPU, skipped") when `probe(0)` fails. Inputs are fresh pseudo-random
//! normals (never zeros); outputs are poisoned with NaN before the GPU run and every element must be
//! written; cache positions outside the ones a call may touch hold a sentinel (prep: must stay
//! bit-identical) or NaN (prefill: positions past pos0+T must never be read; one NaN read would make the
//! output NaN).
//!
//! Tolerances, per (token, head) row, as max |got − want| / max |want| over the row:
//! - prep q: 2e-6. Only f32 rounding differs from the CPU: the order of the sum of squares (block
//!   reduction vs sequential) moves 1/rms by a few ulp; cos/sin are computed in f64 and cast, as the CPU
//!   does. An indexing, pairing or angle bug gives errors of order 1. k is stored as bf16: each element
//!   must be the CPU's value rounded to bf16, or one bf16 step away where the two f32 values straddle a
//!   rounding boundary (at most 1% of the elements). gate is a copy and v a rounded copy: bit-identical.
//! - prefill vs the emulation: 2e-5 of the row's largest |value|, plus, per element, the slack of the
//!   p whose bf16 rounding is uncertain: the kernel's p (f32 sums of the scores on the tensor cores,
//!   `expf`, or in the wgmma form `exp2f` of the scores times scale·log2 e) may differ from the emulation's by ~1e-6 relative, so a p within 2e-5 of a bf16 rounding
//!   boundary may round the other way; each such p allows its one-step difference times |v| (rare:
//!   ~1% of the p, each worth 2^-8 of its term). vs the exact loop: 2e-2 (bf16 q and p). A masking error
//!   (one extra or missing position) moves the row by ≳ 1e-3 at the largest n here, far more at small n;
//!   an indexing error by O(1).
//! - chunked vs step: the caches and q must be bit-identical; outputs within 2e-2 (prefill rounds q and
//!   p to bf16, decode splits them into hi + lo).
#![cfg(feature = "cuda")]

mod common;

use common::{device, k_cache_bf16, poisoned, round_bf16, time_op, v_cache_bf16, v_cache_f32, Rng};
use cudarc::driver::CudaSlice;
use half::bf16;
use lily_cuda::ops::attn_prep::{self, AttnDims};
use lily_cuda::ops::attn_prefill::Kernel;
use lily_cuda::ops::{attention, attn_prefill, Scalar};
use lily_cuda::Device;

const TOL_PREP: f64 = 2e-6;
const TOL_EMU: f64 = 2e-5;
const TOL_EXACT: f64 = 2e-2;
const SENTINEL: f32 = 7680.0; // exact in bf16

/// Worst over rows of `row` elements of max |got − want| / max |want|, after checking every element of
/// `got` was written (finite).
fn row_rel_err(got: &[f32], want: &[f64], row: usize, what: &str) -> f64 {
    assert_eq!(got.len(), want.len(), "{what}: length");
    if let Some(i) = got.iter().position(|v| !v.is_finite()) {
        panic!(
            "{what}: element {i} of {} not written (or not finite): {}",
            got.len(),
            got[i]
        );
    }
    let mut worst = 0.0f64;
    for (g, w) in got.chunks(row).zip(want.chunks(row)) {
        let scale = w.iter().fold(0.0f64, |a, b| a.max(b.abs())).max(1e-30);
        let e = g
            .iter()
            .zip(w)
            .fold(0.0f64, |a, (g, w)| a.max((*g as f64 - w).abs()));
        worst = worst.max(e / scale);
    }
    worst
}

fn to_f64(x: &[f32]) -> Vec<f64> {
    x.iter().map(|v| *v as f64).collect()
}

fn dims(nh: usize, kvh: usize, hd: usize, rot: usize, gated: bool) -> AttnDims {
    AttnDims {
        nh,
        kvh,
        hd,
        rot,
        theta: 1.0e7,
        eps: 1e-6,
        gated,
    }
}

// ---------------------------------------------------------------------------------------------------
// prep

/// The CPU's prep (the code of `lily_cpu::attention::forward`): (q, gate, k) from (qg, k).
#[allow(clippy::too_many_arguments)]
fn cpu_prep(qg: &[f32], k: &[f32], qn: &[f32], kn: &[f32], d: AttnDims, pos0: usize, t: usize) -> (Vec<f32>, Vec<f32>, Vec<f32>) {
    let (nh, kvh, hd) = (d.nh, d.kvh, d.hd);
    let per_head = if d.gated { 2 * hd } else { hd };
    let mut q = vec![0.0f32; t * nh * hd];
    let mut gate = vec![0.0f32; t * nh * hd];
    for i in 0..t * nh {
        let src = &qg[i * per_head..(i + 1) * per_head];
        q[i * hd..(i + 1) * hd].copy_from_slice(&src[..hd]);
        if d.gated {
            gate[i * hd..(i + 1) * hd].copy_from_slice(&src[hd..]);
        }
    }
    let mut k = k.to_vec();
    lily_cpu::norm::rms_norm_inplace(&mut q, qn, d.eps);
    lily_cpu::norm::rms_norm_inplace(&mut k, kn, d.eps);
    lily_cpu::attention::rope(&mut q, nh, hd, d.rot, d.theta, pos0);
    lily_cpu::attention::rope(&mut k, kvh, hd, d.rot, d.theta, pos0);
    (q, gate, k)
}

/// (share of elements not equal to bf16(want), worst distance in bf16 steps).
fn bf16_mismatch(got: &[bf16], want: &[f32]) -> (f64, u32) {
    let mut off = 0usize;
    let mut worst = 0u32;
    for (g, w) in got.iter().zip(want) {
        let r = bf16::from_f32(*w);
        if g.to_bits() != r.to_bits() {
            off += 1;
            // same sign: distance in representable steps
            let steps = (g.to_bits() as i32 - r.to_bits() as i32).unsigned_abs();
            worst = worst.max(if (g.to_bits() ^ r.to_bits()) & 0x8000 != 0 { u32::MAX } else { steps });
        }
    }
    (off as f64 / got.len().max(1) as f64, worst)
}

fn check_prep(dev: &Device, d: AttnDims, pos0: usize, t: usize, seed: u64) -> (f64, f64) {
    let (nh, kvh, hd) = (d.nh, d.kvh, d.hd);
    let mut rng = Rng::new(seed);
    let per_head = if d.gated { 2 * hd } else { hd };
    let qg = rng.normals(t * nh * per_head, 2.0);
    let k = rng.normals(t * kvh * hd, 2.0);
    let v = rng.normals(t * kvh * hd, 1.0);
    let qn: Vec<f32> = (0..hd).map(|_| rng.range(0.5, 1.5)).collect();
    let kn: Vec<f32> = (0..hd).map(|_| rng.range(0.5, 1.5)).collect();
    let cap = (pos0 + t + 3).div_ceil(attn_prep::V_TILE) * attn_prep::V_TILE;
    let row = kvh * hd;
    let sentinel = vec![bf16::from_f32(SENTINEL); cap * row];

    let (qd, kd, vd) = (dev.upload(&qg).unwrap(), dev.upload(&k).unwrap(), dev.upload(&v).unwrap());
    let (qnd, knd) = (dev.upload(&qn).unwrap(), dev.upload(&kn).unwrap());
    let mut q_out = poisoned(dev, t * nh * hd);
    let mut gate_out = poisoned(dev, t * nh * hd);
    let mut kc = dev.upload(&sentinel).unwrap();
    let mut vc = dev.upload(&sentinel).unwrap();
    let gate_arg = if d.gated { Some(&mut gate_out) } else { None };
    attn_prep::prep(dev, &qd, &kd, &vd, &qnd, &knd, d, Scalar::Host(pos0), t, &mut q_out, gate_arg, &mut kc, &mut vc, cap).unwrap();

    let (q_want, gate_want, k_want) = cpu_prep(&qg, &k, &qn, &kn, d, pos0, t);
    let what = format!("prep nh {nh} kvh {kvh} hd {hd} rot {} gated {} pos0 {pos0} t {t}", d.rot, d.gated);
    let eq = row_rel_err(&dev.download(&q_out).unwrap(), &to_f64(&q_want), hd, &format!("{what}: q"));
    assert!(eq <= TOL_PREP, "{what}: q err {eq:.3e} > {TOL_PREP:.0e}");
    let kc_got = dev.download(&kc).unwrap();
    let vc_got = dev.download(&vc).unwrap();
    let (lo, hi) = (pos0 * row, (pos0 + t) * row);
    let (share, worst) = bf16_mismatch(&kc_got[lo..hi], &k_want);
    assert!(worst <= 1 && share <= 0.01, "{what}: k cache: {:.2}% of elements off bf16(cpu), worst by {worst} steps", 100.0 * share);
    // V: position pos0 + i, head kv, dim j at attn_prep::v_index(kv, j, pos0 + i, hd, cap).
    let mut touched = vec![false; vc_got.len()];
    for i in 0..t {
        for c in 0..row {
            let at = attn_prep::v_index(c / hd, c % hd, pos0 + i, hd, cap);
            touched[at] = true;
            let got = vc_got[at];
            assert!(got.to_bits() == bf16::from_f32(v[i * row + c]).to_bits(), "{what}: v cache (token {i}, {c}) is {got}, v is {}", v[i * row + c]);
        }
    }
    let touched_v = |idx: usize| touched[idx];
    let k_out = kc_got[..lo].iter().chain(&kc_got[hi..]).position(|x| x.to_f32() != SENTINEL);
    assert!(k_out.is_none(), "{what}: k cache element {k_out:?} outside positions pos0..pos0+t changed");
    let v_out = vc_got.iter().enumerate().position(|(i, x)| !touched_v(i) && x.to_f32() != SENTINEL);
    assert!(v_out.is_none(), "{what}: v cache element {v_out:?} outside positions pos0..pos0+t changed");
    if d.gated {
        assert!(dev.download(&gate_out).unwrap() == gate_want, "{what}: gate differs from the gate halves of qg");
    }
    (eq, share)
}

#[test]
fn prep_matches_cpu() {
    let Some(dev) = device() else { return };
    // (nh, kvh, hd, rot): the real shape, then small odd ones (rot < hd, rot = hd, G = 1, 3, 8).
    let shapes = [(16, 2, 256, 64), (4, 2, 32, 8), (6, 2, 64, 64), (3, 3, 128, 32), (8, 1, 256, 64), (2, 1, 96, 30), (8, 2, 64, 16)];
    for (j, &(nh, kvh, hd, rot)) in shapes.iter().enumerate() {
        for gated in [true, false] {
            // A position near 128K (large angles) only where the sentinel-filled caches stay small.
            let far: &[(usize, usize)] = if kvh * hd <= 128 { &[(131_000, 3)] } else { &[] };
            // T ≥ attn_prep::CHUNK_MIN_TOKENS (16) takes the per-token kernel, shorter ones the per-head one.
            for (i, &(pos0, t)) in [(0, 1), (0, 9), (1000, 1), (1000, 13), (0, 16), (1000, 41)].iter().chain(far).enumerate() {
                let d = dims(nh, kvh, hd, rot, gated);
                let (eq, share) = check_prep(&dev, d, pos0, t, 100 * j as u64 + 10 * gated as u64 + i as u64);
                println!("prep nh {nh:2} kvh {kvh} hd {hd:3} rot {rot:2} gated {gated:5} pos0 {pos0:6} t {t:2}: q {eq:.2e}, k off bf16(cpu) {:.3}%", 100.0 * share);
            }
        }
    }
}

#[test]
fn copy_rows_moves_rows() {
    let Some(dev) = device() else { return };
    let mut rng = Rng::new(3);
    for (rows, from, to, len) in [(512usize, 4096usize, 8192usize, 4001usize), (7, 64, 32, 32), (3, 40, 41, 1)] {
        let src: Vec<bf16> = rng.normals(rows * from, 1.0).into_iter().map(bf16::from_f32).collect();
        let init = vec![bf16::from_f32(SENTINEL); rows * to];
        let (sd, mut dd) = (dev.upload(&src).unwrap(), dev.upload(&init).unwrap());
        attn_prep::copy_rows(&dev, &sd, from, &mut dd, to, rows, len).unwrap();
        let got = dev.download(&dd).unwrap();
        for r in 0..rows {
            for i in 0..to {
                let want = if i < len { src[r * from + i] } else { bf16::from_f32(SENTINEL) };
                assert!(got[r * to + i].to_bits() == want.to_bits(), "rows {rows} {from}->{to} len {len}: row {r} element {i}");
            }
        }
    }
    let (sd, mut dd) = (dev.zeros::<bf16>(10).unwrap(), dev.zeros::<bf16>(10).unwrap());
    assert!(attn_prep::copy_rows(&dev, &sd, 5, &mut dd, 5, 2, 6).is_err()); // len beyond the pitch
    assert!(attn_prep::copy_rows(&dev, &sd, 5, &mut dd, 5, 3, 5).is_err()); // rows beyond the buffers
}

#[test]
fn prep_rejects_bad_shapes() {
    let Some(dev) = device() else { return };
    let (nh, kvh, hd) = (4, 2, 64);
    let qg = dev.zeros::<f32>(3 * nh * 2 * hd).unwrap();
    let k = dev.zeros::<f32>(3 * kvh * hd).unwrap();
    let v = dev.zeros::<f32>(3 * kvh * hd).unwrap();
    let w = dev.zeros::<f32>(hd).unwrap();
    let mut q_out = dev.zeros::<f32>(3 * nh * hd).unwrap();
    let mut g_out = dev.zeros::<f32>(3 * nh * hd).unwrap();
    let mut kc = dev.zeros::<bf16>(32 * kvh * hd).unwrap();
    let mut vc = dev.zeros::<bf16>(32 * kvh * hd).unwrap();
    let d = dims(nh, kvh, hd, 32, true);
    let mut run = |d: AttnDims, pos0: usize, t: usize, gate: bool, cap: usize| {
        let g = if gate { Some(&mut g_out) } else { None };
        attn_prep::prep(&dev, &qg, &k, &v, &w, &w, d, Scalar::Host(pos0), t, &mut q_out, g, &mut kc, &mut vc, cap)
    };
    assert!(run(d, 29, 3, true, 32).is_ok());
    assert!(run(d, 30, 3, true, 32).is_err()); // capacity 32 < 33
    assert!(run(d, 0, 3, true, 64).is_err()); // caches hold 32 positions, not 64
    assert!(run(d, 0, 3, true, 31).is_err()); // not whole tiles of the V cache
    assert!(run(d, 0, 4, true, 32).is_err()); // qg too short
    assert!(run(d, 0, 0, true, 32).is_err()); // t = 0
    assert!(run(d, 0, 3, false, 32).is_err()); // gated without gate_out
    assert!(run(dims(nh, kvh, hd, 32, false), 0, 3, true, 32).is_err()); // gate_out without gate
    assert!(run(dims(nh, kvh, hd, 31, true), 0, 3, true, 32).is_err()); // odd rot
    assert!(run(dims(nh, kvh, hd, 66, true), 0, 3, true, 32).is_err()); // rot > hd
    dev.synchronize().unwrap();
}

// ---------------------------------------------------------------------------------------------------
// prefill

/// The f64 loop of `lily_cpu::attention::forward`'s softmax part: T queries at positions pos0.., causal.
/// With `emulate` = Some(tile), the kernel's arithmetic instead: q rounded to bf16, the online softmax
/// over tiles of `tile` positions (the kernel's KV tile: 32 for the mma.sync form, 64 for wgmma), each
/// p = e^(s − m) rounded to bf16 (through f32) in o's sum but not in l's; and, per output element, the
/// slack of the p whose rounding is uncertain (see the module doc).
#[allow(clippy::too_many_arguments)]
fn cpu_prefill(q: &[f32], k: &[f32], v: &[f32], gate: Option<&[f32]>, nh: usize, kvh: usize, hd: usize, pos0: usize, t: usize, emulate: Option<usize>) -> (Vec<f64>, Vec<f64>) {
    let group = nh / kvh;
    let scale = 1.0 / (hd as f64).sqrt();
    let scale32 = 1.0f32 / (hd as f32).sqrt();
    let q: Vec<f32> = if emulate.is_some() { round_bf16(q) } else { q.to_vec() };
    let mut o = vec![0.0f64; t * nh * hd];
    let mut slack = vec![0.0f64; t * nh * hd];
    let mut scores = Vec::new();
    for ti in 0..t {
        for h in 0..nh {
            let kv = h / group;
            let i = ti * nh + h;
            let qv = &q[i * hd..(i + 1) * hd];
            let n = pos0 + ti + 1;
            scores.clear();
            scores.extend((0..n).map(|p| {
                let kr = &k[(p * kvh + kv) * hd..(p * kvh + kv + 1) * hd];
                let dot = qv.iter().zip(kr).map(|(a, b)| *a as f64 * *b as f64).sum::<f64>();
                if emulate.is_some() { dot * scale32 as f64 } else { dot * scale }
            }));
            let out = &mut o[i * hd..(i + 1) * hd];
            let sl = &mut slack[i * hd..(i + 1) * hd];
            let vrow = |p: usize| &v[(p * kvh + kv) * hd..(p * kvh + kv + 1) * hd];
            if let Some(tile) = emulate {
                let (mut m, mut l) = (f64::NEG_INFINITY, 0.0f64);
                for (j, s) in scores.chunks(tile).enumerate() {
                    let mn = s.iter().copied().fold(m, f64::max);
                    let alpha = (m - mn).exp();
                    l *= alpha;
                    out.iter_mut().for_each(|a| *a *= alpha);
                    sl.iter_mut().for_each(|a| *a *= alpha);
                    for (c, &sv) in s.iter().enumerate() {
                        let pv = (sv - mn).exp();
                        l += pv;
                        let pb = bf16::from_f32(pv as f32).to_f64();
                        let (lo, hi) = (bf16::from_f32((pv * (1.0 - 2e-5)) as f32).to_f64(), bf16::from_f32((pv * (1.0 + 2e-5)) as f32).to_f64());
                        let unsure = hi - lo;
                        for ((a, e), b) in out.iter_mut().zip(sl.iter_mut()).zip(vrow(tile * j + c)) {
                            *a += pb * *b as f64;
                            *e += unsure * (*b as f64).abs();
                        }
                    }
                    m = mn;
                }
                out.iter_mut().for_each(|a| *a /= l);
                sl.iter_mut().for_each(|a| *a /= l);
            } else {
                let m = scores.iter().copied().fold(f64::NEG_INFINITY, f64::max);
                let sum: f64 = scores.iter_mut().map(|s| { *s = (*s - m).exp(); *s }).sum();
                for (p, w) in scores.iter().enumerate() {
                    for (a, b) in out.iter_mut().zip(vrow(p)) {
                        *a += w / sum * *b as f64;
                    }
                }
            }
            if let Some(g) = gate {
                for ((a, e), g) in out.iter_mut().zip(sl.iter_mut()).zip(&g[i * hd..(i + 1) * hd]) {
                    *a /= 1.0 + (-*g as f64).exp();
                    *e /= 1.0 + (-*g as f64).exp();
                }
            }
        }
    }
    (o, slack)
}

/// Worst over rows of max over the row of (|got − want| − slack) / max |want|, after checking every
/// element was written.
fn row_err_with_slack(got: &[f32], want: &[f64], slack: &[f64], row: usize, what: &str) -> f64 {
    row_rel_err(got, want, row, what); // the written check
    let mut worst = 0.0f64;
    for ((g, w), s) in got.chunks(row).zip(want.chunks(row)).zip(slack.chunks(row)) {
        let scale = w.iter().fold(0.0f64, |a, b| a.max(b.abs())).max(1e-30);
        let e = g.iter().zip(w).zip(s).fold(0.0f64, |a, ((g, w), s)| a.max((*g as f64 - w).abs() - s));
        worst = worst.max(e / scale);
    }
    worst
}

/// A position-major cache of `cap` positions: `0..n` bf16-exact random normals, `n..` NaN (never to be read).
fn nan_tail_cache(rng: &mut Rng, n: usize, cap: usize, row: usize) -> Vec<f32> {
    let mut c = round_bf16(&rng.normals(n * row, 1.0));
    c.resize(cap * row, f32::NAN);
    c
}

/// The smallest capacity the kernels take (a multiple of 32) above `n`.
fn cap_for(n: usize) -> usize {
    (n + 5).div_ceil(32) * 32
}

/// The forms a head dim has: mma.sync for every one, the two wgmma forms for 128 and 256.
fn kernels(hd: usize) -> &'static [Kernel] {
    if hd == 128 || hd == 256 { &[Kernel::Mma, Kernel::Wgmma, Kernel::WgmmaOverlap] } else { &[Kernel::Mma] }
}

/// The KV tile of a form (the emulation's online-softmax tile).
fn kv_tile(kernel: Kernel) -> usize {
    if kernel == Kernel::Mma { attn_prefill::KV_TILE } else { attn_prefill::WG_KV_TILE }
}

#[allow(clippy::too_many_arguments)]
fn check_prefill(dev: &Device, kernel: Kernel, nh: usize, kvh: usize, hd: usize, gated: bool, pos0: usize, t: usize, seed: u64) -> (f64, f64) {
    let mut rng = Rng::new(seed);
    let end = pos0 + t;
    let cap = cap_for(end);
    // q and k are RMS-normed in the model (elements ~1): scores (q·k)/√hd then have std ~1.
    let q = rng.normals(t * nh * hd, 1.0);
    let k = nan_tail_cache(&mut rng, end, cap, kvh * hd);
    let v = nan_tail_cache(&mut rng, end, cap, kvh * hd);
    let gate = rng.normals(t * nh * hd, 2.0);
    let g = gated.then_some(&gate[..]);
    let (emu, slack) = cpu_prefill(&q, &k, &v, g, nh, kvh, hd, pos0, t, Some(kv_tile(kernel)));
    let (exact, _) = cpu_prefill(&q, &k, &v, g, nh, kvh, hd, pos0, t, None);
    let (qd, gd) = (dev.upload(&q).unwrap(), dev.upload(&gate).unwrap());
    let kd = dev.upload(&k_cache_bf16(&k)).unwrap();
    let vd = dev.upload(&v_cache_bf16(&v, cap, kvh, hd)).unwrap();
    let mut out = poisoned(dev, t * nh * hd);
    attn_prefill::prefill(dev, kernel, &qd, &kd, &vd, cap, gated.then_some(&gd), nh, kvh, hd, pos0, t, &mut out).unwrap();
    let got = dev.download(&out).unwrap();
    let what = format!("prefill {kernel:?} nh {nh} kvh {kvh} hd {hd} gated {gated} pos0 {pos0} t {t}");
    let e = row_err_with_slack(&got, &emu, &slack, hd, &what);
    let x = row_rel_err(&got, &exact, hd, &what);
    assert!(e <= TOL_EMU, "{what}: relative max error {e:.3e} vs the emulation > {TOL_EMU:.0e}");
    assert!(x <= TOL_EXACT, "{what}: relative max error {x:.3e} vs the exact loop > {TOL_EXACT:.0e}");
    (e, x)
}

const TS: [usize; 5] = [1, 7, 64, 200, 333];
const POS0S: [usize; 3] = [0, 31, 777];

#[test]
fn prefill_real_shape_matches_cpu() {
    let Some(dev) = device() else { return };
    for &kernel in kernels(256) {
        for gated in [true, false] {
            for (a, &pos0) in POS0S.iter().enumerate() {
                for (b, &t) in TS.iter().enumerate() {
                    let (e, x) = check_prefill(&dev, kernel, 16, 2, 256, gated, pos0, t, 1000 + 100 * gated as u64 + 10 * a as u64 + b as u64);
                    println!("prefill {kernel:?} nh 16 kvh 2 hd 256 gated {gated:5} pos0 {pos0:4} t {t:3}: rel err {e:.2e} (emulation), {x:.2e} (exact)");
                }
            }
        }
    }
}

#[test]
fn prefill_small_odd_shapes_match_cpu() {
    let Some(dev) = device() else { return };
    // (nh, kvh, hd, gated): G = 1, 2, 4, 8, 3, 16 over all four head dims (the wgmma form: G = 1, 2, 3
    // and 16 at head dims 128 and 256).
    let shapes = [
        (4, 4, 64, false),
        (8, 4, 128, true),
        (8, 2, 32, true),
        (8, 1, 32, false),
        (16, 2, 64, true),
        (6, 2, 128, false),
        (2, 1, 256, true),
        (16, 1, 32, true),
        (4, 4, 128, false),
        (16, 1, 256, true),
    ];
    for (j, &(nh, kvh, hd, gated)) in shapes.iter().enumerate() {
        for &kernel in kernels(hd) {
            for (a, &pos0) in [0usize, 63, 777].iter().enumerate() {
                for (b, &t) in [1usize, 7, 64, 65, 200].iter().enumerate() {
                    let (e, x) = check_prefill(&dev, kernel, nh, kvh, hd, gated, pos0, t, 5000 + 100 * j as u64 + 10 * a as u64 + b as u64);
                    println!("prefill {kernel:?} nh {nh:2} kvh {kvh} hd {hd:3} gated {gated:5} pos0 {pos0:4} t {t:3}: rel err {e:.2e} / {x:.2e}");
                }
            }
        }
    }
}

#[test]
fn prefill_rejects_bad_shapes() {
    let Some(dev) = device() else { return };
    let (nh, kvh, hd) = (4, 2, 64);
    let q = dev.zeros::<f32>(3 * nh * hd).unwrap();
    let kc = dev.zeros::<bf16>(32 * kvh * hd).unwrap();
    let vc = dev.zeros::<bf16>(32 * kvh * hd).unwrap();
    let mut out = dev.zeros::<f32>(3 * nh * hd).unwrap();
    let none = None::<&CudaSlice<f32>>;
    let mut run = |q: &cudarc::driver::CudaView<f32>, g: Option<&CudaSlice<f32>>, cap: usize, nh: usize, hd: usize, pos0: usize, t: usize| {
        attn_prefill::prefill(&dev, Kernel::Auto, q, &kc, &vc, cap, g, nh, kvh, hd, pos0, t, &mut out)
    };
    let qv = q.slice(0..);
    assert!(run(&qv, none, 32, nh, hd, 7, 3).is_ok());
    assert!(run(&qv, Some(&q), 32, nh, hd, 29, 3).is_ok());
    assert!(run(&qv, none, 32, nh, hd, 30, 3).is_err()); // capacity 32 < 33
    assert!(run(&qv, none, 64, nh, hd, 0, 3).is_err()); // caches hold 32 positions, not 64
    assert!(run(&qv, none, 24, nh, hd, 0, 3).is_err()); // capacity not a multiple of 32
    assert!(run(&qv, none, 32, nh, hd, 0, 4).is_err()); // q too short
    assert!(run(&qv, none, 32, nh, hd, 0, 0).is_err()); // t = 0
    assert!(run(&qv, none, 32, 3, hd, 0, 3).is_err()); // nh % kvh
    assert!(run(&qv, none, 32, nh, 48, 0, 3).is_err()); // hd
    let q_off = q.slice(1..);
    assert!(run(&q_off, none, 32, nh, hd, 0, 1).is_err()); // misaligned
    // The wgmma forms at a head dim they lack (64), refused; the mma.sync form takes it.
    let mut wg = |k: Kernel| attn_prefill::prefill(&dev, k, &qv, &kc, &vc, 32, none, nh, kvh, hd, 0, 3, &mut out);
    assert!(wg(Kernel::Wgmma).is_err());
    assert!(wg(Kernel::WgmmaOverlap).is_err());
    assert!(wg(Kernel::Mma).is_ok());
    dev.synchronize().unwrap();
}

/// prep + prefill of T tokens at once against T single-token steps of prep + decode (gate fused).
#[allow(clippy::too_many_arguments)]
fn check_chunked_vs_step(dev: &Device, kernel: Kernel, d: AttnDims, pos0: usize, t: usize, seed: u64) -> f64 {
    let (nh, kvh, hd) = (d.nh, d.kvh, d.hd);
    let mut rng = Rng::new(seed);
    let per_head = if d.gated { 2 * hd } else { hd };
    let qg = dev.upload(&rng.normals(t * nh * per_head, 2.0)).unwrap();
    let k = dev.upload(&rng.normals(t * kvh * hd, 2.0)).unwrap();
    let v = dev.upload(&rng.normals(t * kvh * hd, 1.0)).unwrap();
    let qn = dev.upload(&(0..hd).map(|_| rng.range(0.5, 1.5)).collect::<Vec<_>>()).unwrap();
    let kn = dev.upload(&(0..hd).map(|_| rng.range(0.5, 1.5)).collect::<Vec<_>>()).unwrap();
    let cap = cap_for(pos0 + t);
    let row = kvh * hd;
    let prefix_k = k_cache_bf16(&nan_tail_cache(&mut rng, pos0, cap, row));
    let prefix_v = v_cache_bf16(&nan_tail_cache(&mut rng, pos0, cap, row), cap, kvh, hd);
    let n = t * nh * hd;

    // Chunked: one prep, one prefill (gate fused).
    let (mut kc1, mut vc1) = (dev.upload(&prefix_k).unwrap(), dev.upload(&prefix_v).unwrap());
    let mut q1 = poisoned(dev, n);
    let mut g1 = poisoned(dev, n);
    let mut o1 = poisoned(dev, n);
    attn_prep::prep(dev, &qg, &k, &v, &qn, &kn, d, Scalar::Host(pos0), t, &mut q1, d.gated.then_some(&mut g1), &mut kc1, &mut vc1, cap).unwrap();
    attn_prefill::prefill(dev, kernel, &q1, &kc1, &vc1, cap, d.gated.then_some(&g1), nh, kvh, hd, pos0, t, &mut o1).unwrap();

    // Stepped: per token, prep of one token, then decode over pos0+i+1 positions (gate fused).
    let (mut kc2, mut vc2) = (dev.upload(&prefix_k).unwrap(), dev.upload(&prefix_v).unwrap());
    let mut q2 = poisoned(dev, n);
    let mut g2 = poisoned(dev, n);
    let mut o2 = poisoned(dev, n);
    let mut scratch = poisoned(dev, attention::scratch_len(nh, hd));
    let (qr, kr) = (nh * per_head, kvh * hd);
    let hr = nh * hd;
    for i in 0..t {
        let (qg_i, k_i, v_i) = (qg.slice(i * qr..(i + 1) * qr), k.slice(i * kr..(i + 1) * kr), v.slice(i * kr..(i + 1) * kr));
        let mut q_i = q2.slice_mut(i * hr..(i + 1) * hr);
        let mut g_i = g2.slice_mut(i * hr..(i + 1) * hr);
        attn_prep::prep(dev, &qg_i, &k_i, &v_i, &qn, &kn, d, Scalar::Host(pos0 + i), 1, &mut q_i, d.gated.then_some(&mut g_i), &mut kc2, &mut vc2, cap).unwrap();
        let mut o_i = o2.slice_mut(i * hr..(i + 1) * hr);
        let g_view = g2.slice(i * hr..(i + 1) * hr);
        attention::decode(dev, attention::Ring::Auto, &q_i, &kc2, &vc2, cap, Scalar::Host(pos0 + i + 1), nh, kvh, hd, d.gated.then_some(&g_view), &mut o_i, &mut scratch).unwrap();
    }

    let what = format!("chunked vs step ({kernel:?}) nh {nh} kvh {kvh} hd {hd} gated {} pos0 {pos0} t {t}", d.gated);
    let bits = |x: Vec<bf16>| x.into_iter().map(|b| b.to_bits()).collect::<Vec<_>>();
    let (kc1h, kc2h) = (bits(dev.download(&kc1).unwrap()), bits(dev.download(&kc2).unwrap()));
    let (vc1h, vc2h) = (bits(dev.download(&vc1).unwrap()), bits(dev.download(&vc2).unwrap()));
    assert!(kc1h == kc2h && vc1h == vc2h, "{what}: caches differ");
    let same = |a: &[f32], b: &[f32]| a.iter().zip(b).all(|(x, y)| x.to_bits() == y.to_bits());
    assert!(same(&dev.download(&q1).unwrap(), &dev.download(&q2).unwrap()), "{what}: q differs");
    // The cache as the decode steps left it, read back position-major (a layout check of prep's V).
    let vt = dev.download(&vc2).unwrap();
    assert!(v_cache_f32(&vt, cap, kvh, hd)[pos0 * row..(pos0 + t) * row].iter().all(|x| x.is_finite()), "{what}: v rows not written");
    let want = to_f64(&dev.download(&o2).unwrap());
    let e = row_rel_err(&dev.download(&o1).unwrap(), &want, hd, &what);
    assert!(e <= TOL_EXACT, "{what}: relative max error {e:.3e} > {TOL_EXACT:.0e}");
    e
}

#[test]
fn prefill_chunked_matches_decode_steps() {
    let Some(dev) = device() else { return };
    let cases = [
        (dims(16, 2, 256, 64, true), 0, 37),
        (dims(16, 2, 256, 64, true), 300, 70),
        (dims(8, 1, 64, 64, false), 129, 20),
        (dims(4, 4, 128, 32, true), 5, 9),
    ];
    for (i, &(d, pos0, t)) in cases.iter().enumerate() {
        for &kernel in kernels(d.hd) {
            let e = check_chunked_vs_step(&dev, kernel, d, pos0, t, 9000 + i as u64);
            println!("chunked vs step ({kernel:?}) nh {:2} kvh {} hd {:3} pos0 {pos0:3} t {t:2}: rel err {e:.2e}", d.nh, d.kvh, d.hd);
        }
    }
}

// ---------------------------------------------------------------------------------------------------
// Timing (run with `--ignored bench_attn_prefill`)

#[test]
#[ignore = "timing; run on the GPU machine"]
fn bench_attn_prefill() {
    let Some(dev) = device() else { return };
    let d = dims(16, 2, 256, 64, true);
    let (nh, kvh, hd) = (d.nh, d.kvh, d.hd);
    let mut rng = Rng::new(42);
    println!("attention prefill, nh 16 kvh 2 hd 256, bf16 cache, tensor cores, gate fused (FLOPs: 4·hd·nh·Σ_t (pos0+t+1))");
    for (pos0, t) in [(0usize, 512usize), (3584, 512), (0, 2048), (2048, 2048), (0, 4096), (32256, 512), (129024, 2048)] {
        let end = pos0 + t;
        let cap = end.div_ceil(32) * 32;
        let host: Vec<bf16> = rng.normals(cap * kvh * hd, 1.0).into_iter().map(bf16::from_f32).collect();
        let k = dev.upload(&host).unwrap();
        let v = dev.upload(&host).unwrap();
        let q = dev.upload(&rng.normals(t * nh * hd, 1.0)).unwrap();
        let g = dev.upload(&rng.normals(t * nh * hd, 1.0)).unwrap();
        let mut out = dev.zeros::<f32>(t * nh * hd).unwrap();
        let reps = if end > 8192 || t > 1024 { 5 } else { 9 };
        for &kernel in kernels(hd) {
            let (secs, spread) = time_op(&dev, reps, 3, |_| {
                attn_prefill::prefill(&dev, kernel, &q, &k, &v, cap, Some(&g), nh, kvh, hd, pos0, t, &mut out).unwrap();
            });
            let pairs = (t * pos0 + t * (t + 1) / 2) as f64;
            let flops = 4.0 * (hd * nh) as f64 * pairs;
            println!("  {kernel:12?} pos0 {pos0:6} T {t:4}: {:10.1} µs  {:6.1} TFLOP/s  (spread {spread:.2})", secs * 1e6, flops / secs / 1e12);
            assert!(dev.download(&out).unwrap().iter().all(|x| x.is_finite()));
        }
    }
    // prep of one 512-token chunk, for scale.
    let t = 512;
    let qg = dev.upload(&rng.normals(t * nh * 2 * hd, 1.0)).unwrap();
    let kv_in = dev.upload(&rng.normals(t * kvh * hd, 1.0)).unwrap();
    let w = dev.upload(&vec![1.0f32; hd]).unwrap();
    let mut q_out = dev.zeros::<f32>(t * nh * hd).unwrap();
    let mut g_out = dev.zeros::<f32>(t * nh * hd).unwrap();
    let mut kc = dev.zeros::<bf16>(4096 * kvh * hd).unwrap();
    let mut vc = dev.zeros::<bf16>(4096 * kvh * hd).unwrap();
    let (secs, spread) = time_op(&dev, 9, 10, |_| {
        attn_prep::prep(&dev, &qg, &kv_in, &kv_in, &w, &w, d, Scalar::Host(3584), t, &mut q_out, Some(&mut g_out), &mut kc, &mut vc, 4096).unwrap();
    });
    println!("  prep T {t}: {:.1} µs (spread {spread:.2})", secs * 1e6);
}

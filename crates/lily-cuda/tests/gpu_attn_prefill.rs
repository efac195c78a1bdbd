//! CPU-vs-GPU tests of the full-attention preparation (`kernels/attn_prep.cu`, `ops::attn_prep`: q/k
//! RMSNorm, partial RoPE, gate split, KV-cache append, sigmoid gate) and of causal prefill attention
//! (`kernels/attn_prefill.cu`, `ops::attn_prefill`), plus a timing at the real shape
//! (`bench_attn_prefill`, ignored by default).
//!
//! References: `lily_cpu::norm::rms_norm_inplace` and `lily_cpu::attention::rope` on the same inputs for
//! prep (the code `lily_cpu::attention::forward` runs), an f64 loop of forward's softmax attention for
//! prefill, and, for the chunked-vs-step check, T single-token steps of prep + `ops::attention::decode` +
//! `apply_gate` (the decode path).
//!
//! Each test skips (prints "no GPU, skipped") when `probe(0)` fails. Inputs are fresh pseudo-random
//! normals (never zeros); outputs are poisoned with NaN before the GPU run and every element must be
//! written; cache rows outside the ones a call may touch hold a sentinel (prep: must stay bit-identical)
//! or NaN (prefill: rows past pos0+T must never be read; one NaN read would make the output NaN).
//!
//! Tolerances, per (token, head) row, as max |got − want| / max |want| over the row:
//! - prep q and k: 2e-6. Only f32 rounding differs from the CPU: the order of the sum of squares
//!   (block reduction vs sequential) moves 1/rms by a few ulp; cos/sin are computed in f64 and cast, as
//!   the CPU does, so they match except at a rare rounding tie. An indexing, pairing or angle bug gives
//!   errors of order 1. gate and v are copies: bit-identical.
//! - prefill: 1e-5 vs the f64 loop, as `gpu_attention.rs`. The f32 dot product of hd terms gives each
//!   score an absolute error of ~√hd·ε·|q_i k_i| / √hd ≈ 1e-6, which moves each softmax weight by that
//!   relative amount; the f32 sum over n ≤ 977 positions adds less (tested: with the accumulator in f64
//!   the error does not change). A CPU emulation of the kernel (same f32 operation order, threads as OS
//!   threads) gave ≤ 2.8e-6 on these shapes. A masking error (one extra or missing position out of
//!   ≤ 977) moves the row by ≳ 1e-3; an indexing error by O(1).
//! - chunked vs step: 1e-5 (two f32 orders of the same sums); the caches must be bit-identical.
#![cfg(feature = "cuda")]

mod common;

use common::{device, Rng, poisoned, time_op};
use cudarc::driver::CudaSlice;
use lily_cuda::ops::attn_prep::{self, AttnDims};
use lily_cuda::ops::{attention, attn_prefill, Scalar};
use lily_cuda::Device;

const TOL_PREP: f64 = 2e-6;
const TOL_ATTN: f64 = 1e-5;
const SENTINEL: f32 = 7777.0;

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
fn cpu_prep(
    qg: &[f32],
    k: &[f32],
    qn: &[f32],
    kn: &[f32],
    d: AttnDims,
    pos0: usize,
    t: usize,
) -> (Vec<f32>, Vec<f32>, Vec<f32>) {
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

fn check_prep(dev: &Device, d: AttnDims, pos0: usize, t: usize, seed: u64) -> (f64, f64) {
    let (nh, kvh, hd) = (d.nh, d.kvh, d.hd);
    let mut rng = Rng::new(seed);
    let per_head = if d.gated { 2 * hd } else { hd };
    let qg = rng.normals(t * nh * per_head, 2.0);
    let k = rng.normals(t * kvh * hd, 2.0);
    let v = rng.normals(t * kvh * hd, 1.0);
    let qn: Vec<f32> = (0..hd).map(|_| rng.range(0.5, 1.5)).collect();
    let kn: Vec<f32> = (0..hd).map(|_| rng.range(0.5, 1.5)).collect();
    let cap = pos0 + t + 3;
    let row = kvh * hd;
    let sentinel = vec![SENTINEL; cap * row];

    let (qd, kd, vd) = (
        dev.upload(&qg).unwrap(),
        dev.upload(&k).unwrap(),
        dev.upload(&v).unwrap(),
    );
    let (qnd, knd) = (dev.upload(&qn).unwrap(), dev.upload(&kn).unwrap());
    let mut q_out = poisoned(dev, t * nh * hd);
    let mut gate_out = poisoned(dev, t * nh * hd);
    let mut kc = dev.upload(&sentinel).unwrap();
    let mut vc = dev.upload(&sentinel).unwrap();
    let gate_arg = if d.gated { Some(&mut gate_out) } else { None };
    attn_prep::prep(
        dev, &qd, &kd, &vd, &qnd, &knd, d, Scalar::Host(pos0), t, &mut q_out, gate_arg, &mut kc, &mut vc,
    )
    .unwrap();

    let (q_want, gate_want, k_want) = cpu_prep(&qg, &k, &qn, &kn, d, pos0, t);
    let what = format!(
        "prep nh {nh} kvh {kvh} hd {hd} rot {} gated {} pos0 {pos0} t {t}",
        d.rot, d.gated
    );
    let eq = row_rel_err(
        &dev.download(&q_out).unwrap(),
        &to_f64(&q_want),
        hd,
        &format!("{what}: q"),
    );
    let kc_got = dev.download(&kc).unwrap();
    let vc_got = dev.download(&vc).unwrap();
    let (lo, hi) = (pos0 * row, (pos0 + t) * row);
    let ek = row_rel_err(
        &kc_got[lo..hi],
        &to_f64(&k_want),
        hd,
        &format!("{what}: k cache"),
    );
    assert!(
        eq <= TOL_PREP && ek <= TOL_PREP,
        "{what}: q err {eq:.3e}, k err {ek:.3e} > {TOL_PREP:.0e}"
    );
    assert!(
        vc_got[lo..hi] == v[..],
        "{what}: v cache rows differ from v"
    );
    for (name, c) in [("k", &kc_got), ("v", &vc_got)] {
        let outside = c[..lo]
            .iter()
            .chain(&c[hi..])
            .position(|x| x.to_bits() != SENTINEL.to_bits());
        assert!(
            outside.is_none(),
            "{what}: {name} cache element {outside:?} outside rows pos0..pos0+t changed"
        );
    }
    if d.gated {
        assert!(
            dev.download(&gate_out).unwrap() == gate_want,
            "{what}: gate differs from the gate halves of qg"
        );
    }
    (eq, ek)
}

#[test]
fn prep_matches_cpu() {
    let Some(dev) = device() else { return };
    // (nh, kvh, hd, rot): the real shape, then small odd ones (rot < hd, rot = hd, G = 1, 3, 8).
    let shapes = [
        (16, 2, 256, 64),
        (4, 2, 32, 8),
        (6, 2, 64, 64),
        (3, 3, 128, 32),
        (8, 1, 256, 64),
        (2, 1, 96, 30),
        (8, 2, 64, 16),
    ];
    for (j, &(nh, kvh, hd, rot)) in shapes.iter().enumerate() {
        for gated in [true, false] {
            // A position near 128K (large angles) only where the sentinel-filled caches stay small.
            let far: &[(usize, usize)] = if kvh * hd <= 128 {
                &[(131_000, 3)]
            } else {
                &[]
            };
            for (i, &(pos0, t)) in [(0, 1), (0, 9), (1000, 1), (1000, 13)]
                .iter()
                .chain(far)
                .enumerate()
            {
                let d = dims(nh, kvh, hd, rot, gated);
                let (eq, ek) = check_prep(
                    &dev,
                    d,
                    pos0,
                    t,
                    100 * j as u64 + 10 * gated as u64 + i as u64,
                );
                println!("prep nh {nh:2} kvh {kvh} hd {hd:3} rot {rot:2} gated {gated:5} pos0 {pos0:6} t {t:2}: q {eq:.2e} k {ek:.2e}");
            }
        }
    }
}

#[test]
fn apply_gate_matches_cpu() {
    let Some(dev) = device() else { return };
    let mut rng = Rng::new(7);
    for n in [1usize, 255, 16 * 256, 3 * 16 * 256 + 5] {
        let o = rng.normals(n, 1.0);
        let g = rng.normals(n, 3.0);
        let want: Vec<f64> = o
            .iter()
            .zip(&g)
            .map(|(o, g)| (*o * lily_cpu::norm::sigmoid(*g)) as f64)
            .collect();
        let mut od = dev.upload(&o).unwrap();
        let gd = dev.upload(&g).unwrap();
        attn_prep::apply_gate(&dev, &mut od, &gd, n).unwrap();
        let got = dev.download(&od).unwrap();
        // Elementwise relative (row of 1): expf is within 2 ulp of the CPU's exp.
        let e = row_rel_err(&got, &want, 1, &format!("apply_gate n {n}"));
        assert!(e <= 1e-6, "apply_gate n {n}: relative error {e:.3e}");
    }
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
    let mut kc = dev.zeros::<f32>(10 * kvh * hd).unwrap();
    let mut vc = dev.zeros::<f32>(10 * kvh * hd).unwrap();
    let d = dims(nh, kvh, hd, 32, true);
    let mut run = |d: AttnDims, pos0: usize, t: usize, gate: bool| {
        let g = if gate { Some(&mut g_out) } else { None };
        attn_prep::prep(
            &dev, &qg, &k, &v, &w, &w, d, Scalar::Host(pos0), t, &mut q_out, g, &mut kc, &mut vc,
        )
    };
    assert!(run(d, 7, 3, true).is_ok());
    assert!(run(d, 8, 3, true).is_err()); // cache capacity 10 < 11
    assert!(run(d, 0, 4, true).is_err()); // qg too short
    assert!(run(d, 0, 0, true).is_err()); // t = 0
    assert!(run(d, 0, 3, false).is_err()); // gated without gate_out
    assert!(run(dims(nh, kvh, hd, 32, false), 0, 3, true).is_err()); // gate_out without gate
    assert!(run(dims(nh, kvh, hd, 31, true), 0, 3, true).is_err()); // odd rot
    assert!(run(dims(nh, kvh, hd, 66, true), 0, 3, true).is_err()); // rot > hd
    dev.synchronize().unwrap();
}

// ---------------------------------------------------------------------------------------------------
// prefill

/// The f64 loop of `lily_cpu::attention::forward`'s softmax part: T queries at positions pos0.., causal.
#[allow(clippy::too_many_arguments)]
fn cpu_prefill(
    q: &[f32],
    k: &[f32],
    v: &[f32],
    gate: Option<&[f32]>,
    nh: usize,
    kvh: usize,
    hd: usize,
    pos0: usize,
    t: usize,
) -> Vec<f64> {
    let group = nh / kvh;
    let scale = 1.0 / (hd as f64).sqrt();
    let mut o = vec![0.0f64; t * nh * hd];
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
                qv.iter()
                    .zip(kr)
                    .map(|(a, b)| *a as f64 * *b as f64)
                    .sum::<f64>()
                    * scale
            }));
            let m = scores.iter().copied().fold(f64::NEG_INFINITY, f64::max);
            let sum: f64 = scores
                .iter_mut()
                .map(|s| {
                    *s = (*s - m).exp();
                    *s
                })
                .sum();
            let out = &mut o[i * hd..(i + 1) * hd];
            for (p, w) in scores.iter().enumerate() {
                let vr = &v[(p * kvh + kv) * hd..(p * kvh + kv + 1) * hd];
                for (a, b) in out.iter_mut().zip(vr) {
                    *a += w / sum * *b as f64;
                }
            }
            if let Some(g) = gate {
                for (a, g) in out.iter_mut().zip(&g[i * hd..(i + 1) * hd]) {
                    *a /= 1.0 + (-*g as f64).exp();
                }
            }
        }
    }
    o
}

/// A cache of `cap` positions: rows `0..n` random normals, rows `n..` NaN (never to be read).
fn nan_tail_cache(rng: &mut Rng, n: usize, cap: usize, row: usize) -> Vec<f32> {
    let mut c = rng.normals(n * row, 1.0);
    c.resize(cap * row, f32::NAN);
    c
}

#[allow(clippy::too_many_arguments)]
fn check_prefill(
    dev: &Device,
    nh: usize,
    kvh: usize,
    hd: usize,
    gated: bool,
    pos0: usize,
    t: usize,
    seed: u64,
) -> f64 {
    let mut rng = Rng::new(seed);
    let end = pos0 + t;
    let cap = end + 5;
    // q and k are RMS-normed in the model (elements ~1): scores (q·k)/√hd then have std ~1.
    let q = rng.normals(t * nh * hd, 1.0);
    let k = nan_tail_cache(&mut rng, end, cap, kvh * hd);
    let v = nan_tail_cache(&mut rng, end, cap, kvh * hd);
    let gate = rng.normals(t * nh * hd, 2.0);
    let want = cpu_prefill(&q, &k, &v, gated.then_some(&gate[..]), nh, kvh, hd, pos0, t);
    let (qd, kd, vd, gd) = (
        dev.upload(&q).unwrap(),
        dev.upload(&k).unwrap(),
        dev.upload(&v).unwrap(),
        dev.upload(&gate).unwrap(),
    );
    let mut out = poisoned(dev, t * nh * hd);
    attn_prefill::prefill(
        dev,
        &qd,
        &kd,
        &vd,
        gated.then_some(&gd),
        nh,
        kvh,
        hd,
        pos0,
        t,
        &mut out,
    )
    .unwrap();
    let got = dev.download(&out).unwrap();
    let what = format!("prefill nh {nh} kvh {kvh} hd {hd} gated {gated} pos0 {pos0} t {t}");
    let e = row_rel_err(&got, &want, hd, &what);
    assert!(
        e <= TOL_ATTN,
        "{what}: relative max error {e:.3e} > {TOL_ATTN:.0e}"
    );
    e
}

const TS: [usize; 4] = [1, 7, 64, 200];
const POS0S: [usize; 2] = [0, 777];

#[test]
fn prefill_real_shape_matches_cpu() {
    let Some(dev) = device() else { return };
    for gated in [true, false] {
        for (a, &pos0) in POS0S.iter().enumerate() {
            for (b, &t) in TS.iter().enumerate() {
                let e = check_prefill(
                    &dev,
                    16,
                    2,
                    256,
                    gated,
                    pos0,
                    t,
                    1000 + 100 * gated as u64 + 10 * a as u64 + b as u64,
                );
                println!("prefill nh 16 kvh 2 hd 256 gated {gated:5} pos0 {pos0:4} t {t:3}: rel err {e:.2e}");
            }
        }
    }
}

#[test]
fn prefill_small_odd_shapes_match_cpu() {
    let Some(dev) = device() else { return };
    // (nh, kvh, hd, gated): G = 1, 2, 4, 8, 3, 16 over all four head dims.
    let shapes = [
        (4, 4, 64, false),
        (8, 4, 128, true),
        (8, 2, 32, true),
        (8, 1, 32, false),
        (16, 2, 64, true),
        (6, 2, 128, false),
        (2, 1, 256, true),
        (16, 1, 32, true),
    ];
    for (j, &(nh, kvh, hd, gated)) in shapes.iter().enumerate() {
        for (a, &pos0) in POS0S.iter().chain(&[63]).enumerate() {
            for (b, &t) in TS.iter().chain(&[65]).enumerate() {
                let e = check_prefill(
                    &dev,
                    nh,
                    kvh,
                    hd,
                    gated,
                    pos0,
                    t,
                    5000 + 100 * j as u64 + 10 * a as u64 + b as u64,
                );
                println!("prefill nh {nh:2} kvh {kvh} hd {hd:3} gated {gated:5} pos0 {pos0:4} t {t:3}: rel err {e:.2e}");
            }
        }
    }
}

#[test]
fn prefill_rejects_bad_shapes() {
    let Some(dev) = device() else { return };
    let (nh, kvh, hd) = (4, 2, 64);
    let q = dev.zeros::<f32>(3 * nh * hd).unwrap();
    let kc = dev.zeros::<f32>(10 * kvh * hd).unwrap();
    let vc = dev.zeros::<f32>(10 * kvh * hd).unwrap();
    let mut out = dev.zeros::<f32>(3 * nh * hd).unwrap();
    let none = None::<&CudaSlice<f32>>;
    assert!(attn_prefill::prefill(&dev, &q, &kc, &vc, none, nh, kvh, hd, 7, 3, &mut out).is_ok());
    assert!(
        attn_prefill::prefill(&dev, &q, &kc, &vc, Some(&q), nh, kvh, hd, 7, 3, &mut out).is_ok()
    );
    assert!(attn_prefill::prefill(&dev, &q, &kc, &vc, none, nh, kvh, hd, 8, 3, &mut out).is_err()); // cache too short
    assert!(attn_prefill::prefill(&dev, &q, &kc, &vc, none, nh, kvh, hd, 0, 4, &mut out).is_err()); // q too short
    assert!(attn_prefill::prefill(&dev, &q, &kc, &vc, none, nh, kvh, hd, 0, 0, &mut out).is_err()); // t = 0
    assert!(attn_prefill::prefill(&dev, &q, &kc, &vc, none, 3, kvh, hd, 0, 3, &mut out).is_err()); // nh % kvh
    assert!(attn_prefill::prefill(&dev, &q, &kc, &vc, none, nh, kvh, 48, 0, 3, &mut out).is_err()); // hd
    let q_off = q.slice(1..);
    assert!(
        attn_prefill::prefill(&dev, &q_off, &kc, &vc, none, nh, kvh, hd, 0, 1, &mut out).is_err()
    ); // misaligned
    dev.synchronize().unwrap();
}

/// prep + prefill of T tokens at once equals T single-token steps of prep + decode + apply_gate.
#[allow(clippy::too_many_arguments)]
fn check_chunked_vs_step(dev: &Device, d: AttnDims, pos0: usize, t: usize, seed: u64) -> f64 {
    let (nh, kvh, hd) = (d.nh, d.kvh, d.hd);
    let mut rng = Rng::new(seed);
    let per_head = if d.gated { 2 * hd } else { hd };
    let qg = dev.upload(&rng.normals(t * nh * per_head, 2.0)).unwrap();
    let k = dev.upload(&rng.normals(t * kvh * hd, 2.0)).unwrap();
    let v = dev.upload(&rng.normals(t * kvh * hd, 1.0)).unwrap();
    let qn = dev
        .upload(&(0..hd).map(|_| rng.range(0.5, 1.5)).collect::<Vec<_>>())
        .unwrap();
    let kn = dev
        .upload(&(0..hd).map(|_| rng.range(0.5, 1.5)).collect::<Vec<_>>())
        .unwrap();
    let cap = pos0 + t + 2;
    let row = kvh * hd;
    let prefix = nan_tail_cache(&mut rng, pos0, cap, row);
    let prefix_v = nan_tail_cache(&mut rng, pos0, cap, row);
    let n = t * nh * hd;

    // Chunked: one prep, one prefill (gate fused).
    let (mut kc1, mut vc1) = (dev.upload(&prefix).unwrap(), dev.upload(&prefix_v).unwrap());
    let mut q1 = poisoned(dev, n);
    let mut g1 = poisoned(dev, n);
    let mut o1 = poisoned(dev, n);
    attn_prep::prep(
        dev,
        &qg,
        &k,
        &v,
        &qn,
        &kn,
        d,
        Scalar::Host(pos0),
        t,
        &mut q1,
        d.gated.then_some(&mut g1),
        &mut kc1,
        &mut vc1,
    )
    .unwrap();
    attn_prefill::prefill(
        dev,
        &q1,
        &kc1,
        &vc1,
        d.gated.then_some(&g1),
        nh,
        kvh,
        hd,
        pos0,
        t,
        &mut o1,
    )
    .unwrap();

    // Stepped: per token, prep of one token, decode over pos0+i+1 positions, then the gate.
    let (mut kc2, mut vc2) = (dev.upload(&prefix).unwrap(), dev.upload(&prefix_v).unwrap());
    let mut q2 = poisoned(dev, n);
    let mut g2 = poisoned(dev, n);
    let mut o2 = poisoned(dev, n);
    let mut scratch = poisoned(dev, attention::scratch_len(nh, hd));
    let (qr, kr) = (nh * per_head, kvh * hd);
    let hr = nh * hd;
    for i in 0..t {
        let (qg_i, k_i, v_i) = (
            qg.slice(i * qr..(i + 1) * qr),
            k.slice(i * kr..(i + 1) * kr),
            v.slice(i * kr..(i + 1) * kr),
        );
        let mut q_i = q2.slice_mut(i * hr..(i + 1) * hr);
        let mut g_i = g2.slice_mut(i * hr..(i + 1) * hr);
        attn_prep::prep(
            dev,
            &qg_i,
            &k_i,
            &v_i,
            &qn,
            &kn,
            d,
            Scalar::Host(pos0 + i),
            1,
            &mut q_i,
            d.gated.then_some(&mut g_i),
            &mut kc2,
            &mut vc2,
        )
        .unwrap();
        let mut o_i = o2.slice_mut(i * hr..(i + 1) * hr);
        attention::decode(
            dev,
            &q_i,
            &kc2,
            &vc2,
            Scalar::Host(pos0 + i + 1),
            nh,
            kvh,
            hd,
            &mut o_i,
            &mut scratch,
        )
        .unwrap();
        if d.gated {
            attn_prep::apply_gate(dev, &mut o_i, &g_i, hr).unwrap();
        }
    }

    let what = format!(
        "chunked vs step nh {nh} kvh {kvh} hd {hd} gated {} pos0 {pos0} t {t}",
        d.gated
    );
    let (kc1h, kc2h) = (dev.download(&kc1).unwrap(), dev.download(&kc2).unwrap());
    let (vc1h, vc2h) = (dev.download(&vc1).unwrap(), dev.download(&vc2).unwrap());
    let same = |a: &[f32], b: &[f32]| a.iter().zip(b).all(|(x, y)| x.to_bits() == y.to_bits());
    assert!(
        same(&kc1h, &kc2h) && same(&vc1h, &vc2h),
        "{what}: caches differ"
    );
    assert!(
        same(&dev.download(&q1).unwrap(), &dev.download(&q2).unwrap()),
        "{what}: q differs"
    );
    let want = to_f64(&dev.download(&o2).unwrap());
    let e = row_rel_err(&dev.download(&o1).unwrap(), &want, hd, &what);
    assert!(
        e <= TOL_ATTN,
        "{what}: relative max error {e:.3e} > {TOL_ATTN:.0e}"
    );
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
        let e = check_chunked_vs_step(&dev, d, pos0, t, 9000 + i as u64);
        println!(
            "chunked vs step nh {:2} kvh {} hd {:3} pos0 {pos0:3} t {t:2}: rel err {e:.2e}",
            d.nh, d.kvh, d.hd
        );
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
    println!("attention prefill, nh 16 kvh 2 hd 256, f32 cache, gate fused (FLOPs: 4·hd·nh·Σ_t (pos0+t+1))");
    for (pos0, t) in [(0usize, 512usize), (3584, 512), (0, 4096), (32256, 512)] {
        let end = pos0 + t;
        let k = dev.upload(&rng.normals(end * kvh * hd, 1.0)).unwrap();
        let v = dev.upload(&rng.normals(end * kvh * hd, 1.0)).unwrap();
        let q = dev.upload(&rng.normals(t * nh * hd, 1.0)).unwrap();
        let g = dev.upload(&rng.normals(t * nh * hd, 1.0)).unwrap();
        let mut out = dev.zeros::<f32>(t * nh * hd).unwrap();
        let reps = if end > 8192 || t > 1024 { 5 } else { 9 };
        let (secs, spread) = time_op(&dev, reps, 3, |_| {
            attn_prefill::prefill(&dev, &q, &k, &v, Some(&g), nh, kvh, hd, pos0, t, &mut out)
                .unwrap();
        });
        let pairs = (t * pos0 + t * (t + 1) / 2) as f64;
        let flops = 4.0 * (hd * nh) as f64 * pairs;
        println!(
            "  pos0 {pos0:5} T {t:4}: {:10.1} µs  {:6.2} TFLOP/s  (spread {spread:.2})",
            secs * 1e6,
            flops / secs / 1e12
        );
        assert!(dev.download(&out).unwrap().iter().all(|x| x.is_finite()));
    }
    // prep of one 512-token chunk, for scale.
    let t = 512;
    let qg = dev.upload(&rng.normals(t * nh * 2 * hd, 1.0)).unwrap();
    let kv_in = dev.upload(&rng.normals(t * kvh * hd, 1.0)).unwrap();
    let w = dev.upload(&vec![1.0f32; hd]).unwrap();
    let mut q_out = dev.zeros::<f32>(t * nh * hd).unwrap();
    let mut g_out = dev.zeros::<f32>(t * nh * hd).unwrap();
    let mut kc = dev.zeros::<f32>(4096 * kvh * hd).unwrap();
    let mut vc = dev.zeros::<f32>(4096 * kvh * hd).unwrap();
    let (secs, spread) = time_op(&dev, 9, 10, |_| {
        attn_prep::prep(
            &dev,
            &qg,
            &kv_in,
            &kv_in,
            &w,
            &w,
            d,
            Scalar::Host(3584),
            t,
            &mut q_out,
            Some(&mut g_out),
            &mut kc,
            &mut vc,
        )
        .unwrap();
    });
    println!("  prep T {t}: {:.1} µs (spread {spread:.2})", secs * 1e6);
}

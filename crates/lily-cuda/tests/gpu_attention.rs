//! CPU-vs-GPU tests of decode attention over the bf16 KV cache (`kernels/attention.cu`,
//! `ops::attention`) against an f64 loop of the maths of `lily_cpu::attention::forward` after RoPE
//! (query head h reads KV head h / (nh/kvh), scores (q·k)/√hd over positions 0..n, softmax, Σ p·v, the
//! sigmoid gate) on the same bf16-rounded K and V, with each ring depth the kernel has (`Ring::Two`,
//! and `Ring::Three` at head dims 128 and 256), plus a timing at the real shape
//! (`bench_attention_decode`, ignored by default).
//!
//! Each test skips (prints "no GPU, skipped") when `probe(0)` fails. Inputs are fresh pseudo-random
//! normals (never zeros); cache positions past n hold NaN (reading one would make the output NaN); the
//! output is poisoned with NaN before the GPU run. Tolerance: relative max error 5e-5. The kernel runs
//! q and p through the tensor cores as bf16 hi + lo pairs, which leaves below 2^-16 of each (≈1.5e-5
//! relative at worst, much less on average), then f32 sums in another order; a masking, indexing or
//! head-mapping error moves the output by ≳ 1e-3, dropping the lo halves by ≈ 3e-3.
#![cfg(feature = "cuda")]

mod common;

use common::{device, k_cache_bf16, poisoned, round_bf16, time_op, v_cache_bf16, Rng};
use lily_cuda::ops::attention::Ring;
use lily_cuda::ops::{attention, Scalar};
use lily_cuda::Device;

/// max |got − want| / max |want|, after checking every element was written (no NaN).
fn rel_err(got: &[f32], want: &[f64], what: &str) -> f64 {
    assert_eq!(got.len(), want.len(), "{what}: length");
    if let Some(i) = got.iter().position(|v| !v.is_finite()) {
        panic!("{what}: element {i} of {} not written (or not finite): {}", got.len(), got[i]);
    }
    let scale = want.iter().fold(0.0f64, |a, b| a.max(b.abs())).max(1e-30);
    got.iter().zip(want).fold(0.0f64, |a, (g, w)| a.max((*g as f64 - w).abs())) / scale
}

const TOL: f64 = 5e-5;

/// The reference, in f64: the loop of `lily_cpu::attention::forward` for one token at position n-1
/// (caches position-major [≥ n, kvh, hd]), then the gate.
#[allow(clippy::too_many_arguments)]
fn cpu_decode(q: &[f32], k: &[f32], v: &[f32], gate: Option<&[f32]>, n: usize, nh: usize, kvh: usize, hd: usize) -> Vec<f64> {
    let group = nh / kvh;
    let scale = 1.0 / (hd as f64).sqrt();
    let mut o = vec![0.0f64; nh * hd];
    for h in 0..nh {
        let kv = h / group;
        let qv = &q[h * hd..(h + 1) * hd];
        let scores: Vec<f64> = (0..n)
            .map(|p| {
                let kr = &k[(p * kvh + kv) * hd..(p * kvh + kv + 1) * hd];
                qv.iter().zip(kr).map(|(a, b)| *a as f64 * *b as f64).sum::<f64>() * scale
            })
            .collect();
        let m = scores.iter().copied().fold(f64::NEG_INFINITY, f64::max);
        let e: Vec<f64> = scores.iter().map(|s| (s - m).exp()).collect();
        let sum: f64 = e.iter().sum();
        let out = &mut o[h * hd..(h + 1) * hd];
        for (p, w) in e.iter().enumerate() {
            let vr = &v[(p * kvh + kv) * hd..(p * kvh + kv + 1) * hd];
            for (a, b) in out.iter_mut().zip(vr) {
                *a += w / sum * *b as f64;
            }
        }
    }
    if let Some(g) = gate {
        for (a, gv) in o.iter_mut().zip(g) {
            *a /= 1.0 + (-(*gv as f64)).exp();
        }
    }
    o
}

/// A position-major cache of `cap ≥ n` positions: 0..n bf16-exact random normals, then NaN.
fn cache(rng: &mut Rng, n: usize, cap: usize, kvh: usize, hd: usize, std: f64) -> Vec<f32> {
    let mut c = round_bf16(&rng.normals(n * kvh * hd, std));
    c.resize(cap * kvh * hd, f32::NAN);
    c
}

/// The ring depths a head dim has: two stages for every one, three for 128 and 256.
fn rings(hd: usize) -> &'static [Ring] {
    if hd == 128 || hd == 256 { &[Ring::Two, Ring::Three] } else { &[Ring::Two] }
}

#[allow(clippy::too_many_arguments)]
fn check(dev: &Device, ring: Ring, nh: usize, kvh: usize, hd: usize, n: usize, gated: bool, device_n: bool, seed: u64) -> f64 {
    let mut rng = Rng::new(seed);
    let cap = (n + 3).div_ceil(attention::STAGE) * attention::STAGE;
    // q and k are RMS-normed in the model (elements ~1); scores (q·k)/√hd then have std ~1.
    let q = rng.normals(nh * hd, 1.0);
    let gate = rng.normals(nh * hd, 2.0);
    let k = cache(&mut rng, n, cap, kvh, hd, 1.0);
    let v = cache(&mut rng, n, cap, kvh, hd, 1.0);
    let want = cpu_decode(&q, &k, &v, gated.then_some(&gate[..]), n, nh, kvh, hd);
    let (qd, gd) = (dev.upload(&q).unwrap(), dev.upload(&gate).unwrap());
    let kd = dev.upload(&k_cache_bf16(&k)).unwrap();
    let vd = dev.upload(&v_cache_bf16(&v, cap, kvh, hd)).unwrap();
    let nd = dev.upload(&[n as i32]).unwrap();
    let nv = nd.slice(0..1);
    let n_arg = if device_n { Scalar::Device { at: &nv, max: cap } } else { Scalar::Host(n) };
    let mut out = poisoned(dev, nh * hd);
    let mut scratch = poisoned(dev, attention::scratch_len(nh, hd));
    attention::decode(dev, ring, &qd, &kd, &vd, cap, n_arg, nh, kvh, hd, gated.then_some(&gd), &mut out, &mut scratch).unwrap();
    let got = dev.download(&out).unwrap();
    let what = format!("{ring:?} ring: nh {nh} kvh {kvh} hd {hd} n {n} gated {gated} device n {device_n}");
    let e = rel_err(&got, &want, &what);
    assert!(e <= TOL, "{what}: relative max error {e:.3e} > {TOL:.0e}");
    e
}

const NS: [usize; 7] = [1, 7, 32, 33, 64, 1000, 4096];

#[test]
fn attention_real_shape_matches_cpu() {
    let Some(dev) = device() else { return };
    for &ring in rings(256) {
        for (i, n) in NS.iter().chain(&[20_000]).enumerate() {
            for (j, (gated, dn)) in [(true, false), (false, true), (true, true)].into_iter().enumerate() {
                let e = check(&dev, ring, 16, 2, 256, *n, gated, dn, 10 + 3 * i as u64 + j as u64);
                println!("{ring:?} ring: nh 16 kvh 2 hd 256 n {n:5} gated {gated} device n {dn}: rel err {e:.2e}");
            }
        }
    }
}

#[test]
fn attention_small_odd_shapes_match_cpu() {
    let Some(dev) = device() else { return };
    // G = 2, 8, 4, 16 (two blocks of 8 heads per KV slice), 3 (partial head block), 1; all four head dims.
    let shapes = [(4, 2, 64), (8, 1, 32), (8, 2, 128), (32, 2, 128), (6, 2, 256), (2, 2, 64), (4, 4, 32)];
    for (j, &(nh, kvh, hd)) in shapes.iter().enumerate() {
        for &ring in rings(hd) {
            for (i, n) in NS.iter().chain(&[257, 8191]).enumerate() {
                let e = check(&dev, ring, nh, kvh, hd, *n, i % 2 == 0, i % 3 == 0, 1000 + 100 * j as u64 + i as u64);
                println!("{ring:?} ring: nh {nh:2} kvh {kvh} hd {hd:3} n {n:5}: rel err {e:.2e}");
            }
        }
    }
}

#[test]
fn attention_rejects_bad_shapes() {
    let Some(dev) = device() else { return };
    let q = dev.zeros::<f32>(4 * 64).unwrap();
    let k = dev.zeros::<half::bf16>(32 * 2 * 64).unwrap();
    let v = dev.zeros::<half::bf16>(32 * 2 * 64).unwrap();
    let mut out = dev.zeros::<f32>(4 * 64).unwrap();
    let mut s = dev.zeros::<f32>(attention::scratch_len(4, 64)).unwrap();
    let none: Option<&cudarc::driver::CudaSlice<f32>> = None;
    let mut run = |n: usize, cap: usize, nh: usize, hd: usize, s: &mut cudarc::driver::CudaSlice<f32>| {
        attention::decode(&dev, Ring::Auto, &q, &k, &v, cap, Scalar::Host(n), nh, 2, hd, none, &mut out, s)
    };
    assert!(run(8, 32, 4, 64, &mut s).is_ok());
    assert!(run(33, 32, 4, 64, &mut s).is_err()); // n beyond the capacity
    assert!(run(8, 64, 4, 64, &mut s).is_err()); // cache too short for its capacity
    assert!(run(8, 24, 4, 64, &mut s).is_err()); // capacity not a multiple of 32
    assert!(run(0, 32, 4, 64, &mut s).is_err()); // n = 0
    assert!(run(8, 32, 3, 64, &mut s).is_err()); // nh % kvh
    assert!(run(8, 32, 4, 48, &mut s).is_err()); // hd
    let mut small = dev.zeros::<f32>(attention::scratch_len(4, 64) - 1).unwrap();
    assert!(run(8, 32, 4, 64, &mut small).is_err());
    // The three-stage ring at a head dim it lacks (64), refused; the two-stage one takes it.
    let mut ring = |r: Ring| attention::decode(&dev, r, &q, &k, &v, 32, Scalar::Host(8), 4, 2, 64, none, &mut out, &mut s);
    assert!(ring(Ring::Three).is_err());
    assert!(ring(Ring::Two).is_ok());
    dev.synchronize().unwrap();
}

#[test]
fn attention_splits_cover_every_position() {
    for max in [1, 7, 132, 256] {
        for n in 1..20_000 {
            let (s, per) = attention::splits_for(n, max);
            let stages = n.div_ceil(attention::STAGE);
            assert!((1..=max).contains(&s) && s * per >= stages && (s - 1) * per < stages, "n {n} max {max}: {s} × {per}");
        }
    }
}

// ---------------------------------------------------------------------------------------------------
// Timing (run with `--ignored bench_attention_decode`)

/// The 35B model's attention shape: (query heads, KV heads, head dim).
const REAL: (usize, usize, usize) = (16, 2, 256);

type Buf = cudarc::driver::CudaSlice<f32>;

/// Random q and gate at the real shape, and the output and split scratch they need.
fn real_shape_io(dev: &Device, rng: &mut Rng) -> (Buf, Buf, Buf, Buf) {
    let (nh, _, hd) = REAL;
    let q = dev.upload(&rng.normals(nh * hd, 1.0)).unwrap();
    let gate = dev.upload(&rng.normals(nh * hd, 1.0)).unwrap();
    (q, gate, dev.zeros::<f32>(nh * hd).unwrap(), dev.zeros::<f32>(attention::scratch_len(nh, hd)).unwrap())
}

#[test]
#[ignore = "timing; run on the GPU machine"]
fn bench_attention_decode() {
    let Some(dev) = device() else { return };
    let (nh, kvh, hd) = REAL;
    let mut rng = Rng::new(42);
    let (q, gate, mut out, mut scratch) = real_shape_io(&dev, &mut rng);
    println!("attention decode, nh 16 kvh 2 hd 256, bf16 cache (+ combine and gate); caches cycled over layers (> 50 MiB L2)");
    for (n, layers) in [(4096usize, 10usize), (32768, 4), (131072, 2)] {
        let host = k_cache_bf16(&rng.normals(n * kvh * hd, 1.0));
        let k: Vec<_> = (0..layers).map(|_| dev.upload(&host).unwrap()).collect();
        let v: Vec<_> = (0..layers).map(|_| dev.upload(&host).unwrap()).collect();
        for &ring in rings(hd) {
            let (t, spread) = time_op(&dev, 15, 2 * layers, |i| {
                let l = i % layers;
                attention::decode(&dev, ring, &q, &k[l], &v[l], n, Scalar::Host(n), nh, kvh, hd, Some(&gate), &mut out, &mut scratch).unwrap();
            });
            let bytes = 2.0 * (kvh * hd * 2 * n) as f64;
            let bw = bytes / t / 1e12;
            println!(
                "  {ring:?} ring, n {n:6} (splits {:?}): {:8.2} µs/call, K+V {:.1} MB → {bw:.2} TB/s ({:.0}% of 4.3 TB/s; spread {spread:.2})",
                attention::splits_for(n, attention::max_splits(&dev, kvh, 1)),
                t * 1e6,
                bytes / 1e6,
                bw / 4.3 * 100.0
            );
            assert!(dev.download(&out).unwrap().iter().all(|x| x.is_finite()));
        }
    }
}

/// One decode attention call at the real shape over a 128K cache (the default ring), for `ncu`
/// (run with `--ignored ncu_attention_decode`): the launch the 128K decode ledger spends 64% of the
/// bandwidth on.
#[test]
#[ignore = "for profiling with ncu on the GPU machine"]
fn ncu_attention_decode() {
    let Some(dev) = device() else { return };
    let ((nh, kvh, hd), n) = (REAL, 131072);
    let mut rng = Rng::new(43);
    let (q, gate, mut out, mut scratch) = real_shape_io(&dev, &mut rng);
    let host = k_cache_bf16(&rng.normals(n * kvh * hd, 1.0));
    let (k, v) = (dev.upload(&host).unwrap(), dev.upload(&host).unwrap());
    attention::decode(&dev, Ring::Auto, &q, &k, &v, n, Scalar::Host(n), nh, kvh, hd, Some(&gate), &mut out, &mut scratch).unwrap();
    assert!(dev.download(&out).unwrap().iter().all(|x| x.is_finite()));
}

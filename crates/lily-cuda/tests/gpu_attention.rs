//! CPU-vs-GPU tests of decode attention over the KV cache (`kernels/attention.cu`, `ops::attention`)
//! against an f64 loop of the maths of `lily_cpu::attention::forward` after RoPE (query head h reads KV
//! head h / (nh/kvh), scores (q·k)/√hd over positions 0..n, softmax, Σ p·v), plus a timing at the real
//! shape (`bench_attention_decode`, ignored by default).
//!
//! Each test skips (prints "no GPU, skipped") when `probe(0)` fails. Inputs are fresh pseudo-random
//! normals (never zeros), the caches hold extra rows past n with huge values (reading them would swamp
//! the softmax), the output is poisoned with NaN before the GPU run, and outputs are compared at a
//! relative max error of 1e-5.
#![cfg(feature = "cuda")]

mod common;

use lily_cuda::ops::{attention, Scalar};
use common::{device, Rng, poisoned, time_op};
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

const TOL: f64 = 1e-5;

/// The reference, in f64: the loop of `lily_cpu::attention::forward` for one token at position n-1.
fn cpu_decode(q: &[f32], k: &[f32], v: &[f32], n: usize, nh: usize, kvh: usize, hd: usize) -> Vec<f64> {
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
    o
}

/// Caches of `cap ≥ n` positions: rows 0..n random normals, rows n.. a huge constant.
fn cache(rng: &mut Rng, n: usize, cap: usize, kvh: usize, hd: usize, std: f64) -> Vec<f32> {
    let mut c = rng.normals(n * kvh * hd, std);
    c.resize(cap * kvh * hd, 1.0e4);
    c
}

fn check(dev: &Device, nh: usize, kvh: usize, hd: usize, n: usize, seed: u64) -> f64 {
    let mut rng = Rng::new(seed);
    let cap = n + 3;
    // q and k are RMS-normed in the model (elements ~1); scores (q·k)/√hd then have std ~1.
    let q = rng.normals(nh * hd, 1.0);
    let k = cache(&mut rng, n, cap, kvh, hd, 1.0);
    let v = cache(&mut rng, n, cap, kvh, hd, 1.0);
    let want = cpu_decode(&q, &k, &v, n, nh, kvh, hd);
    let (qd, kd, vd) = (dev.upload(&q).unwrap(), dev.upload(&k).unwrap(), dev.upload(&v).unwrap());
    let mut out = poisoned(dev, nh * hd);
    let mut scratch = poisoned(dev, attention::scratch_len(nh, hd));
    attention::decode(dev, &qd, &kd, &vd, Scalar::Host(n), nh, kvh, hd, &mut out, &mut scratch).unwrap();
    let got = dev.download(&out).unwrap();
    let what = format!("nh {nh} kvh {kvh} hd {hd} n {n}");
    let e = rel_err(&got, &want, &what);
    assert!(e <= TOL, "{what}: relative max error {e:.3e} > {TOL:.0e}");
    e
}

const NS: [usize; 5] = [1, 7, 64, 1000, 4096];

#[test]
fn attention_real_shape_matches_cpu() {
    let Some(dev) = device() else { return };
    for (i, n) in NS.iter().enumerate() {
        let e = check(&dev, 16, 2, 256, *n, 10 + i as u64);
        println!("nh 16 kvh 2 hd 256 n {n:5} (splits {:?}): rel err {e:.2e}", attention::splits_for(*n));
    }
}

#[test]
fn attention_small_odd_shapes_match_cpu() {
    let Some(dev) = device() else { return };
    // G = 2, 8, 4, 16 (two blocks of 8 heads per KV slice), 3 (partial head block); all four head dims.
    let shapes = [(4, 2, 64), (8, 1, 32), (8, 2, 128), (32, 2, 128), (6, 2, 256), (2, 2, 64)];
    for (j, &(nh, kvh, hd)) in shapes.iter().enumerate() {
        for (i, n) in NS.iter().chain(&[33, 257, 8191]).enumerate() {
            let e = check(&dev, nh, kvh, hd, *n, 1000 + 100 * j as u64 + i as u64);
            println!("nh {nh:2} kvh {kvh} hd {hd:3} n {n:5}: rel err {e:.2e}");
        }
    }
}

#[test]
fn attention_rejects_bad_shapes() {
    let Some(dev) = device() else { return };
    let q = dev.zeros::<f32>(4 * 64).unwrap();
    let k = dev.zeros::<f32>(8 * 2 * 64).unwrap();
    let v = dev.zeros::<f32>(8 * 2 * 64).unwrap();
    let mut out = dev.zeros::<f32>(4 * 64).unwrap();
    let mut s = dev.zeros::<f32>(attention::scratch_len(4, 64)).unwrap();
    assert!(attention::decode(&dev, &q, &k, &v, Scalar::Host(8), 4, 2, 64, &mut out, &mut s).is_ok());
    assert!(attention::decode(&dev, &q, &k, &v, Scalar::Host(9), 4, 2, 64, &mut out, &mut s).is_err()); // cache too short
    assert!(attention::decode(&dev, &q, &k, &v, Scalar::Host(0), 4, 2, 64, &mut out, &mut s).is_err()); // n = 0
    assert!(attention::decode(&dev, &q, &k, &v, Scalar::Host(8), 3, 2, 64, &mut out, &mut s).is_err()); // nh % kvh
    assert!(attention::decode(&dev, &q, &k, &v, Scalar::Host(8), 4, 2, 48, &mut out, &mut s).is_err()); // hd
    let mut small = dev.zeros::<f32>(attention::scratch_len(4, 64) - 1).unwrap();
    assert!(attention::decode(&dev, &q, &k, &v, Scalar::Host(8), 4, 2, 64, &mut out, &mut small).is_err());
    dev.synchronize().unwrap();
}

#[test]
fn attention_splits_cover_every_position() {
    for n in 1..20_000 {
        let (s, c) = attention::splits_for(n);
        assert!((1..=attention::MAX_SPLITS).contains(&s) && s * c >= n && (s - 1) * c < n, "n {n}: {s} × {c}");
    }
}

// ---------------------------------------------------------------------------------------------------
// Timing (run with `--ignored bench_attention_decode`)

#[test]
#[ignore = "timing; run on the GPU machine"]
fn bench_attention_decode() {
    let Some(dev) = device() else { return };
    let (nh, kvh, hd) = (16, 2, 256);
    let mut rng = Rng::new(42);
    let q = dev.upload(&rng.normals(nh * hd, 1.0)).unwrap();
    let mut out = dev.zeros::<f32>(nh * hd).unwrap();
    let mut scratch = dev.zeros::<f32>(attention::scratch_len(nh, hd)).unwrap();
    println!("attention decode, nh 16 kvh 2 hd 256, f32 cache; caches cycled over layers (> 50 MiB L2)");
    for (n, layers) in [(4096usize, 10usize), (32768, 4)] {
        let host = rng.normals(n * kvh * hd, 1.0);
        let k: Vec<_> = (0..layers).map(|_| dev.upload(&host).unwrap()).collect();
        let v: Vec<_> = (0..layers).map(|_| dev.upload(&host).unwrap()).collect();
        let (t, spread) = time_op(&dev, 15, 2 * layers, |i| {
            let l = i % layers;
            attention::decode(&dev, &q, &k[l], &v[l], Scalar::Host(n), nh, kvh, hd, &mut out, &mut scratch).unwrap();
        });
        let bytes = 2.0 * (kvh * hd * 4 * n) as f64;
        let bw = bytes / t / 1e12;
        println!(
            "  n {n:6} (splits {:?}): {:8.2} µs/call, K+V {:.1} MB → {bw:.2} TB/s ({:.0}% of 4.3 TB/s; spread {spread:.2})",
            attention::splits_for(n),
            t * 1e6,
            bytes / 1e6,
            bw / 4.3 * 100.0
        );
        assert!(dev.download(&out).unwrap().iter().all(|x| x.is_finite()));
    }
}

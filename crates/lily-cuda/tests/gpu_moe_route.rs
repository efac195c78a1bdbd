//! CPU-vs-GPU tests of the MoE router selection (`kernels/moe_route.cu`, `ops::moe_route`) against
//! `lily_cpu::moe::route`, plus a timing at E 256, k 8 (`bench_moe_route`, ignored by default).
//!
//! Each test skips (prints "no GPU, skipped") when `probe(0)` fails. Logits are fresh pseudo-random
//! values (never zeros) in several row styles: normals with exact ties planted deliberately (the max
//! copied to a higher and a lower index, other values copied across lanes and within a lane), large
//! magnitudes (std 1000: most probabilities underflow to 0 and tie there), a large offset (1e4 plus
//! tiny noise), values quantised to quarters (many ties), and all-equal rows. Outputs are poisoned
//! (indices 0xFFFFFFFF, weights NaN); indices must equal the CPU's exactly and each weight must be
//! within 1e-6 relative (plus f32::MIN_POSITIVE absolute, for underflowed probabilities).
#![cfg(feature = "cuda")]

mod common;

use lily_cpu::moe as cpu;
use lily_cuda::ops::moe_route;
use common::{device, Rng, time_op};
use lily_cuda::Device;



/// One token's logits of E, in style `style` (see the file comment).
fn row(rng: &mut Rng, e: usize, style: usize) -> Vec<f32> {
    let nz = |v: f32| if v == 0.0 { 0.375 } else { v };
    let mut r: Vec<f32> = match style % 6 {
        0 => (0..e).map(|_| nz(rng.normal(1.0))).collect(),
        1 => (0..e).map(|_| nz(rng.normal(3.0))).collect(),
        2 => (0..e).map(|_| nz(rng.normal(1000.0))).collect(),
        3 => (0..e).map(|_| 1.0e4 + nz(rng.normal(0.01))).collect(),
        4 => (0..e).map(|_| nz((rng.normal(2.0) * 4.0).round() / 4.0)).collect(),
        _ => vec![nz(rng.normal(2.0)); e],
    };
    if style % 6 <= 2 && e > 1 {
        // Plant ties: the max at a lower and a higher index, and some random copies.
        let am = (0..e).fold(0, |b, i| if r[i] > r[b] { i } else { b });
        let (lo, hi) = (rng.below(e), rng.below(e));
        r[lo] = r[am];
        r[hi] = r[am];
        for _ in 0..e / 4 + 1 {
            let (a, b) = (rng.below(e), rng.below(e));
            r[b] = r[a];
        }
        if e > 32 {
            let a = rng.below(e - 32);
            r[a + 32] = r[a]; // same lane, the next slot
        }
    }
    r
}

fn check_case(dev: &Device, t: usize, e: usize, k: usize, renorm: bool, seed: u64) -> f64 {
    let mut rng = Rng::new(seed);
    let logits: Vec<f32> = (0..t).flat_map(|i| row(&mut rng, e, seed as usize + i)).collect();
    assert!(logits.iter().all(|v| *v != 0.0 && v.is_finite()));
    let want = cpu::route(&logits, e, k, renorm);

    // Contiguous rows, and rows of E + 1 (the router fused with the shared expert's gate): the extra
    // column holds a logit far above the others, which a misread row would pick.
    let mut worst = 0.0f64;
    for stride in [e, e + 1] {
        let mut rows = vec![40.0f32; t * stride];
        for ti in 0..t {
            rows[ti * stride..ti * stride + e].copy_from_slice(&logits[ti * e..(ti + 1) * e]);
        }
        let d_logits = dev.upload(&rows).unwrap();
        let mut d_idx = dev.upload(&vec![u32::MAX; t * k]).unwrap();
        let mut d_w = dev.upload(&vec![f32::NAN; t * k]).unwrap();
        if stride == e {
            moe_route::route(dev, &d_logits, t, e, k, renorm, &mut d_idx, &mut d_w).unwrap();
        } else {
            moe_route::route_strided(dev, &d_logits, stride, t, e, k, renorm, &mut d_idx, &mut d_w).unwrap();
        }
        let idx = dev.download(&d_idx).unwrap();
        let w = dev.download(&d_w).unwrap();
        let what = format!("T={t} E={e} k={k} renorm={renorm} rows {stride} apart");
        worst = worst.max(compare(&want, &idx, &w, k, seed, &what));
    }
    worst
}

/// The GPU's picks and weights against the CPU's; returns the worst relative weight error.
fn compare(want: &[Vec<(usize, f32)>], idx: &[u32], w: &[f32], k: usize, seed: u64, what: &str) -> f64 {
    let mut worst = 0.0f64;
    for (ti, r) in want.iter().enumerate() {
        assert_eq!(r.len(), k);
        let got_i: Vec<usize> = idx[ti * k..(ti + 1) * k].iter().map(|&i| i as usize).collect();
        let want_i: Vec<usize> = r.iter().map(|&(i, _)| i).collect();
        assert_eq!(got_i, want_i, "{what}: token {ti} (style {}) indices", (seed as usize + ti) % 6);
        for (j, &(_, ww)) in r.iter().enumerate() {
            let g = w[ti * k + j];
            assert!(g.is_finite(), "{what}: token {ti} weight {j} not written: {g}");
            let diff = (g as f64 - ww as f64).abs();
            assert!(
                diff <= 1e-6 * (ww.abs() as f64) + f32::MIN_POSITIVE as f64,
                "{what}: token {ti} weight {j}: got {g:e}, want {ww:e}"
            );
            if ww != 0.0 {
                worst = worst.max(diff / ww.abs() as f64);
            }
        }
    }
    worst
}

#[test]
fn moe_route_matches_cpu() {
    let Some(dev) = device() else { return };
    let shapes = [(256, 8), (8, 2), (16, 4), (4, 1), (512, 10)];
    let mut seed = 1u64;
    for &(e, k) in &shapes {
        for t in [1, 7, 300] {
            for renorm in [true, false] {
                let mut worst = 0.0f64;
                // T = 1: one call per row style.
                let reps = if t == 1 { 6 } else { 1 };
                for _ in 0..reps {
                    worst = worst.max(check_case(&dev, t, e, k, renorm, seed));
                    seed += 1;
                }
                println!("T={t:3} E={e:3} k={k:2} renorm={renorm:5}: indices exact, weights rel err {worst:.1e}");
            }
        }
    }
}

#[test]
fn moe_route_other_sizes_match_cpu() {
    // E not a multiple of 4 or of 32, k = E, the largest k, every kernel size class.
    let Some(dev) = device() else { return };
    let cases = [(1, 1), (3, 3), (31, 5), (33, 32), (64, 8), (100, 7), (129, 16), (257, 9), (500, 32), (512, 1)];
    for (n, &(e, k)) in cases.iter().enumerate() {
        for renorm in [true, false] {
            let worst = check_case(&dev, 37, e, k, renorm, 1000 + 2 * n as u64 + renorm as u64);
            println!("T= 37 E={e:3} k={k:2} renorm={renorm:5}: indices exact, weights rel err {worst:.1e}");
        }
    }
}

#[test]
fn moe_route_rejects_bad_shapes() {
    let Some(dev) = device() else { return };
    let logits = dev.zeros::<f32>(2 * 256).unwrap();
    let mut idx = dev.zeros::<u32>(2 * 8).unwrap();
    let mut w = dev.zeros::<f32>(2 * 8).unwrap();
    assert!(moe_route::route(&dev, &logits, 3, 256, 8, true, &mut idx, &mut w).is_err()); // short logits
    assert!(moe_route::route(&dev, &logits, 2, 256, 9, true, &mut idx, &mut w).is_err()); // short outputs
    assert!(moe_route::route(&dev, &logits, 1, 513, 8, true, &mut idx, &mut w).is_err()); // E > 512
    assert!(moe_route::route(&dev, &logits, 1, 4, 5, true, &mut idx, &mut w).is_err()); // k > E
    assert!(moe_route::route(&dev, &logits, 1, 256, 0, true, &mut idx, &mut w).is_err()); // k = 0
    assert!(moe_route::route(&dev, &logits, 0, 256, 8, true, &mut idx, &mut w).is_ok()); // nothing to do
    assert!(moe_route::route_strided(&dev, &logits, 255, 1, 256, 8, true, &mut idx, &mut w).is_err()); // stride < E
    assert!(moe_route::route_strided(&dev, &logits, 300, 2, 256, 8, true, &mut idx, &mut w).is_err()); // short strided logits
}

// ---------------------------------------------------------------------------------------------------
// Timing (run with `--ignored bench_moe_route`)

#[test]
#[ignore = "timing; run on the GPU machine"]
fn bench_moe_route() {
    let Some(dev) = device() else { return };
    let (e, k) = (256, 8);
    println!("MoE route, E {e}, k {k}, renormalised");
    for t in [1usize, 4096] {
        let mut rng = Rng::new(77 + t as u64);
        let logits: Vec<f32> = (0..t * e).map(|_| rng.normal(2.0)).collect();
        let d_logits = dev.upload(&logits).unwrap();
        let mut idx = dev.zeros::<u32>(t * k).unwrap();
        let mut w = dev.zeros::<f32>(t * k).unwrap();
        let (med, spread) = time_op(&dev, 15, 100, |_| {
            moe_route::route(&dev, &d_logits, t, e, k, true, &mut idx, &mut w).unwrap();
        });
        let gbs = (t * e * 4) as f64 / med / 1e9;
        println!("  T={t:5}: {:8.2} µs/launch ({:.3} µs/token, {gbs:.0} GB/s of logits, spread {spread:.2})", med * 1e6, med * 1e6 / t as f64);
        let want = cpu::route(&logits, e, k, true);
        let got = dev.download(&idx).unwrap();
        let want_i: Vec<u32> = want.iter().flat_map(|r| r.iter().map(|&(i, _)| i as u32)).collect();
        assert_eq!(got, want_i, "T={t}: bench indices differ from the CPU's");
    }
}

//! CPU-vs-GPU tests of token choice on the device (`kernels/sample.cu`, `ops::sample`) against
//! `lily_sampler::pick_on_cpu`, plus a timing at the real vocabulary (`bench_sample`, ignored by
//! default).
//!
//! Each test skips (prints "no GPU, skipped") when `probe(0)` fails. The chosen id must equal the
//! CPU's exactly: the kernel repeats the CPU's arithmetic and its f64 summation order, so there is no
//! tolerance. Logits rows are fresh pseudo-random values in several styles: normals of scale 1, 3 and
//! 12, values quantised to quarters (many exact ties), a nearly flat row, an LM-like skewed row, a
//! "deep tail" (a few high logits over ~all tokens at -25, which puts top_p 0.99999994's edge bucket
//! where the CPU's walk is not exact in integers), some with -inf entries and a NaN, some with ±0 and
//! a tie at the maximum; vocabularies 37, 1000, 4099 and the real 248,320-row buffer with 248,077
//! valid (padding filled with 1e6, which must never be chosen). Settings: greedy, temperature 0.3 / 1
//! / 2, top_k 1 / 5 / 40 / 1000, top_p 0.1 / 0.9 / 0.999 / 0.99999994, min_p 0.05 / 0.1 and
//! combinations, with and without edits (repetition / presence-frequency penalties and biases
//! including ±0, -100 and +100); u random, 0, 1e-12, 1 - 1e-9 and the largest f64 below 1. Then
//! `u` exactly at the CDF boundaries the CPU has (found by bisection on `pick_on_cpu`, the largest u
//! still choosing one token and the next one up): any different rounding of a deciding f64 sum moves
//! such a boundary by an ulp and fails. The output is poisoned (0xFFFFFFFF) before every call, and
//! the logits buffer is checked unchanged.
#![cfg(feature = "cuda")]

mod common;

use common::{device, Rng};
use cudarc::driver::CudaSlice;
use lily_cuda::ops::sample::{self, EditBuffer};
use lily_cuda::ops::util;
use lily_cuda::Device;
use lily_sampler::{pick_on_cpu, pick_on_cpu_masked, Defaults, DevicePick, LogitEdit, Resolved, Sampler, SamplingParams};

/// The GPU side of one caller: scratch for the largest vocabulary, the edit buffer, the output.
struct Gpu<'a> {
    dev: &'a Device,
    scratch: CudaSlice<f32>,
    edits: EditBuffer,
    out: CudaSlice<u32>,
}

impl<'a> Gpu<'a> {
    fn new(dev: &'a Device, max_vocab: usize) -> Self {
        Gpu {
            dev,
            scratch: dev.zeros::<f32>(sample::scratch_len(max_vocab)).unwrap(),
            edits: EditBuffer::new(dev).unwrap(),
            out: dev.zeros::<u32>(1).unwrap(),
        }
    }

    /// The device's choice (output poisoned first).
    fn pick(&mut self, logits: &CudaSlice<f32>, pick: &DevicePick) -> u32 {
        self.dev.upload_into(&[u32::MAX], &mut self.out).unwrap();
        sample::pick(self.dev, logits, pick, &mut self.edits, &mut self.scratch, &mut self.out).unwrap();
        self.dev.download(&self.out).unwrap()[0]
    }
}

/// A mask over `n` tokens in one of several styles: dense random, sparse, one allowed token, only
/// tokens whose logit is -inf allowed (the fallback to the lowest allowed id), a prefix range,
/// everything allowed.
fn mask_for(rng: &mut Rng, logits: &[f32], n: usize, style: usize) -> Vec<u32> {
    let words = n.div_ceil(32);
    let mut m = vec![0u32; words];
    let set = |m: &mut Vec<u32>, i: usize| m[i / 32] |= 1 << (i % 32);
    match style % 6 {
        0 => (0..n).filter(|_| rng.uniform() < 0.5).for_each(|i| set(&mut m, i)),
        1 => (0..n).filter(|_| rng.uniform() < 0.002).for_each(|i| set(&mut m, i)),
        2 => set(&mut m, rng.below(n)),
        3 => {
            let neg: Vec<usize> = (0..n).filter(|&i| logits[i] == f32::NEG_INFINITY).collect();
            if neg.is_empty() {
                set(&mut m, n - 1);
            } else {
                neg.iter().for_each(|&i| set(&mut m, i));
            }
        }
        4 => (0..(n / 3).max(1)).for_each(|i| set(&mut m, i)),
        _ => (0..n).for_each(|i| set(&mut m, i)),
    }
    if m.iter().all(|w| *w == 0) {
        set(&mut m, rng.below(n));
    }
    m
}

#[test]
fn masked_pick_matches_cpu() {
    let Some(dev) = device() else { return };
    let mut g = Gpu::new(&dev, 248_320);
    let mut rng = Rng::new(17);
    let mut cases = 0;
    for &(n, len) in &[(37usize, 40usize), (1000, 1000), (4099, 4100), (248_077, 248_320)] {
        for style in 0..12 {
            let mut logits = row(&mut rng, n, len, style);
            if style % 6 == 3 {
                // Some -inf logits for the mask to allow, so that every allowed one is -inf.
                for _ in 0..5 {
                    let i = rng.below(n);
                    logits[i] = f32::NEG_INFINITY;
                }
            }
            let d_logits = dev.upload(&logits).unwrap();
            let mask = mask_for(&mut rng, &logits, n, style);
            let d_mask = dev.upload(&mask).unwrap();
            let sets = settings();
            for (si, p) in sets.iter().enumerate().filter(|(si, _)| n < 200_000 || si % 3 == 0) {
                let u = if p.is_greedy() { 0.0 } else { rng.uniform() };
                let ed = if (si + style) % 3 == 0 { edits(&mut rng, n) } else { Vec::new() };
                let pick = DevicePick { vocab: n, params: *p, u, edits: ed };
                let want = pick_on_cpu_masked(&mut logits.clone(), &pick, Some(&mask));
                dev.upload_into(&[u32::MAX], &mut g.out).unwrap();
                sample::pick_masked(&dev, &d_logits, &pick, Some(&d_mask), &mut g.edits, &mut g.scratch, &mut g.out).unwrap();
                let got = dev.download(&g.out).unwrap()[0];
                assert_eq!(got, want, "vocab {n} style {style} setting {si} {p:?}: GPU {got}, CPU {want}");
                assert!(lily_sampler::ops::mask_allows(&mask, got) || style % 6 == 3, "vocab {n} style {style}: {got} not allowed");
                cases += 1;
            }
            let after = dev.download(&d_logits).unwrap();
            assert!(after.iter().zip(&logits).all(|(a, b)| a.to_bits() == b.to_bits()), "the logits were modified");
        }
    }
    // A mask shorter than the vocabulary is refused.
    let d_logits = dev.upload(&vec![0.5f32; 100]).unwrap();
    let short = dev.upload(&[u32::MAX; 3]).unwrap();
    let pick = DevicePick { vocab: 100, params: Resolved { temperature: 0.0, ..Resolved::default() }, u: 0.0, edits: Vec::new() };
    assert!(sample::pick_masked(&dev, &d_logits, &pick, Some(&short), &mut g.edits, &mut g.scratch, &mut g.out).is_err());
    println!("masked picks: {cases} cases, every id equal to the CPU's");
}

/// A logits row of `n` valid entries in a buffer of `len` (padding 1e6), in style `style` (see the
/// file comment).
fn row(rng: &mut Rng, n: usize, len: usize, style: usize) -> Vec<f32> {
    let mut r: Vec<f32> = (0..n)
        .map(|_| match style % 7 {
            0 => rng.normal(1.0),
            1 => rng.normal(3.0),
            2 => (rng.normal(8.0) / 4.0).round() / 4.0 * 4.0,
            3 => rng.normal(0.02),
            4 => {
                let x = rng.uniform();
                (x * x * x * 25.0 - 5.0) as f32
            }
            5 => {
                if rng.below(1000) == 0 {
                    rng.normal(2.0)
                } else {
                    -25.0 + rng.normal(0.5)
                }
            }
            _ => rng.normal(12.0),
        })
        .collect();
    if style % 3 == 1 {
        for _ in 0..3 {
            let i = rng.below(n);
            r[i] = f32::NEG_INFINITY;
        }
        let i = rng.below(n);
        r[i] = f32::NAN;
    }
    if style % 4 == 2 {
        let (a, b) = (rng.below(n), rng.below(n));
        r[a] = 0.0;
        r[b] = -0.0;
        let m = r.iter().cloned().fold(f32::NEG_INFINITY, f32::max);
        let c = rng.below(n);
        r[c] = m; // a tie at the maximum
    }
    r.resize(len, 1e6);
    r
}

/// Edits of the kinds `Sampler::device_pick` makes, on about 5% of the tokens.
fn edits(rng: &mut Rng, n: usize) -> Vec<LogitEdit> {
    let mut ids: Vec<u32> = (0..(n / 20).max(3)).map(|_| rng.below(n) as u32).collect();
    ids.sort_unstable();
    ids.dedup();
    ids.into_iter()
        .map(|id| {
            let mut e = LogitEdit { id, ..LogitEdit::NONE };
            match rng.below(4) {
                0 => e.rep = 1.3,
                1 => e.sub = 0.5 + 0.25 * rng.below(5) as f32,
                2 => e.bias = [2.5f32, -100.0, 0.0, -0.0, 100.0][rng.below(5)],
                _ => {
                    e.rep = 0.8;
                    e.sub = -1.0;
                    e.bias = 3.0;
                }
            }
            e
        })
        .collect()
}

fn settings() -> Vec<Resolved> {
    let d = Resolved::default();
    vec![
        Resolved { temperature: 0.0, ..d },
        d,
        Resolved { temperature: 0.3, ..d },
        Resolved { temperature: 2.0, ..d },
        Resolved { top_k: 1, ..d },
        Resolved { top_k: 5, ..d },
        Resolved { top_k: 40, temperature: 0.7, ..d },
        Resolved { top_k: 1000, ..d },
        Resolved { top_p: 0.1, ..d },
        Resolved { top_p: 0.9, ..d },
        Resolved { top_p: 0.999, temperature: 1.5, ..d },
        Resolved { min_p: 0.05, ..d },
        Resolved { top_k: 40, top_p: 0.9, min_p: 0.05, ..d },
        Resolved { top_p: 0.8, min_p: 0.1, ..d },
        Resolved { top_p: 0.999_999_94, ..d },
        Resolved { top_k: 1000, top_p: 0.95, temperature: 0.8, ..d },
    ]
}

/// Every setting × several u (and edits on a third of the cases) on one row; returns the cases run.
fn check_row(g: &mut Gpu, rng: &mut Rng, logits: &[f32], n: usize, what: &str, us_per: usize) -> usize {
    let d_logits = g.dev.upload(logits).unwrap();
    let mut cases = 0;
    for (si, p) in settings().into_iter().enumerate() {
        let mut us = vec![rng.uniform(), 0.0, 1e-12, 1.0 - 1e-9, 1.0 - f64::EPSILON / 2.0, rng.uniform()];
        us.truncate(us_per.max(1));
        for (ui, &u) in us.iter().enumerate() {
            let ed = if (si + ui + cases) % 3 == 0 { edits(rng, n) } else { Vec::new() };
            let pick = DevicePick { vocab: n, params: p, u: if p.is_greedy() { 0.0 } else { u }, edits: ed };
            let want = pick_on_cpu(&mut logits.to_vec(), &pick);
            let got = g.pick(&d_logits, &pick);
            assert_eq!(
                got,
                want,
                "{what}: setting {si} {p:?}, u {u:e}, {} edits: GPU {got}, CPU {want}",
                pick.edits.len()
            );
            cases += 1;
        }
    }
    let after = g.dev.download(&d_logits).unwrap();
    assert!(after.iter().zip(logits).all(|(a, b)| a.to_bits() == b.to_bits()), "{what}: the logits were modified");
    cases
}

#[test]
fn pick_matches_cpu_small_vocabularies() {
    let Some(dev) = device() else { return };
    let mut g = Gpu::new(&dev, 4100);
    let mut rng = Rng::new(11);
    for &(n, len) in &[(37usize, 40usize), (1000, 1000), (4099, 4100)] {
        let mut cases = 0;
        for style in 0..14 {
            let logits = row(&mut rng, n, len, style);
            cases += check_row(&mut g, &mut rng, &logits, n, &format!("vocab {n} style {style}"), 6);
        }
        println!("vocab {n:5}: {cases} cases, every id equal to the CPU's");
    }
}

#[test]
fn pick_matches_cpu_at_the_real_vocabulary() {
    let Some(dev) = device() else { return };
    let (n, len) = (248_077, 248_320);
    let mut g = Gpu::new(&dev, len);
    let mut rng = Rng::new(12);
    let mut cases = 0;
    for style in 0..7 {
        let logits = row(&mut rng, n, len, style);
        cases += check_row(&mut g, &mut rng, &logits, n, &format!("vocab {n} style {style}"), 2);
    }
    println!("vocab {n} (rows of {len}): {cases} cases, every id equal to the CPU's");
}

/// The largest u in [lo, hi) for which the CPU still chooses `pick_on_cpu(lo)`'s token, by bisection
/// on the f64 bit patterns (u ≥ 0, so they order like the values).
fn boundary(logits: &[f32], pick: &DevicePick, lo: f64, hi: f64) -> f64 {
    let choose = |u: f64| pick_on_cpu(&mut logits.to_vec(), &DevicePick { u, ..pick.clone() });
    let first = choose(lo);
    let (mut a, mut b) = (lo.to_bits(), hi.to_bits());
    while b - a > 1 {
        let mid = a + (b - a) / 2;
        if choose(f64::from_bits(mid)) == first {
            a = mid;
        } else {
            b = mid;
        }
    }
    f64::from_bits(a)
}

#[test]
fn pick_flips_at_the_cpus_exact_boundaries() {
    let Some(dev) = device() else { return };
    let mut g = Gpu::new(&dev, 248_320);
    let mut rng = Rng::new(13);
    let d = Resolved::default();
    let sets = [
        d,
        Resolved { top_p: 0.9, ..d },
        Resolved { top_k: 40, top_p: 0.95, ..d },
        Resolved { min_p: 0.05, temperature: 0.7, ..d },
        Resolved { top_p: 0.999_999_94, ..d },
    ];
    let mut cases = 0;
    for &(n, len, style) in &[(4099usize, 4100usize, 0usize), (4099, 4100, 2), (4099, 4100, 5), (248_077, 248_320, 4)] {
        let logits = row(&mut rng, n, len, style);
        let d_logits = dev.upload(&logits).unwrap();
        for p in sets {
            let ed = if cases % 2 == 0 { edits(&mut rng, n) } else { Vec::new() };
            let pick = DevicePick { vocab: n, params: p, u: 0.0, edits: ed };
            // Boundaries just above a few random u: the last u of one token and the first of the next.
            for _ in 0..3 {
                let u0 = rng.uniform() * 0.98;
                let u1 = boundary(&logits, &pick, u0, 1.0);
                let u2 = f64::from_bits(u1.to_bits() + 1);
                for u in [u1, u2].into_iter().filter(|&u| u < 1.0) {
                    let pk = DevicePick { u, ..pick.clone() };
                    let want = pick_on_cpu(&mut logits.to_vec(), &pk);
                    let got = g.pick(&d_logits, &pk);
                    assert_eq!(
                        got, want,
                        "vocab {n} style {style} {p:?} at the boundary u = {u:e}: GPU {got}, CPU {want}"
                    );
                    cases += 1;
                }
            }
        }
    }
    println!("{cases} picks at exact CPU boundaries, every id equal");
}

/// A sampler driven through `device_pick` + the GPU + `record` chooses the same tokens as a clone
/// driven through `Sampler::sample`, penalties and bias included.
#[test]
fn sampler_on_the_device_replays_the_host() {
    let Some(dev) = device() else { return };
    let (n, len) = (4099, 4100);
    let mut g = Gpu::new(&dev, len);
    let mut rng = Rng::new(14);
    let d = SamplingParams::default;
    let bias = vec![(3, 2.5), (7, -100.0), (11, 0.0), (12, -0.0), (40, 5.0)];
    for (i, p) in [
        SamplingParams { temperature: Some(0.0), repetition_penalty: Some(1.3), ..d() },
        SamplingParams {
            repetition_penalty: Some(1.2),
            presence_penalty: Some(0.5),
            frequency_penalty: Some(0.3),
            ..d()
        },
        SamplingParams { top_p: Some(0.9), logit_bias: bias.clone(), frequency_penalty: Some(1.0), ..d() },
        SamplingParams { top_k: Some(20), top_p: Some(0.95), min_p: Some(0.05), repetition_penalty: Some(0.9), ..d() },
        SamplingParams {
            temperature: Some(0.6),
            min_p: Some(0.1),
            logit_bias: bias,
            presence_penalty: Some(-1.0),
            ..d()
        },
    ]
    .into_iter()
    .enumerate()
    {
        let p = SamplingParams { seed: Some(100 + i as u64), ..p };
        let mut host = Sampler::new(&p, &Defaults::default(), n).unwrap();
        host.observe_prompt(&(0..300).map(|_| rng.below(n) as u32).collect::<Vec<_>>());
        let mut devs = host.clone();
        let mut tokens = Vec::new();
        for step in 0..40 {
            let logits = row(&mut rng, n, len, step % 5);
            let want = host.sample(&mut logits.clone()).token;
            let pick = devs.device_pick().unwrap();
            let got = g.pick(&dev.upload(&logits).unwrap(), &pick);
            devs.record(got);
            assert_eq!(got, want, "params {i} step {step}");
            tokens.push(got);
        }
        println!("params {i}: 40 tokens equal ({} edits at the end)", devs.clone().device_pick().unwrap().edits.len());
    }
}

#[test]
fn pick_rejects_bad_input() {
    let Some(dev) = device() else { return };
    let mut g = Gpu::new(&dev, 1000);
    let logits = dev.upload(&vec![0.5f32; 1000]).unwrap();
    let ok = DevicePick { vocab: 1000, params: Resolved::default(), u: 0.5, edits: Vec::new() };
    let run = |g: &mut Gpu, l: &CudaSlice<f32>, p: &DevicePick| {
        sample::pick(g.dev, l, p, &mut g.edits, &mut g.scratch, &mut g.out)
    };
    assert!(run(&mut g, &logits, &ok).is_ok());
    let short = dev.upload(&vec![0.5f32; 999]).unwrap();
    assert!(run(&mut g, &short, &ok).is_err()); // logits shorter than the vocabulary
    assert!(run(&mut g, &logits, &DevicePick { vocab: 0, ..ok.clone() }).is_err());
    let mut small = Gpu::new(&dev, 500);
    assert!(run(&mut small, &logits, &ok).is_err()); // scratch too small
    let e = |id| LogitEdit { id, bias: 1.0, ..LogitEdit::NONE };
    assert!(run(&mut g, &logits, &DevicePick { edits: vec![e(5), e(3)], ..ok.clone() }).is_err()); // unsorted
    assert!(run(&mut g, &logits, &DevicePick { edits: vec![e(5), e(5)], ..ok.clone() }).is_err()); // repeated
    assert!(run(&mut g, &logits, &DevicePick { edits: vec![e(1000)], ..ok.clone() }).is_err()); // past the vocabulary
    assert!(run(&mut g, &logits, &DevicePick { u: 1.0, ..ok.clone() }).is_err());
    let bad = |f: fn(&mut Resolved)| {
        let mut p = Resolved::default();
        f(&mut p);
        DevicePick { params: p, ..ok.clone() }
    };
    assert!(run(&mut g, &logits, &bad(|p| p.top_p = 0.0)).is_err());
    assert!(run(&mut g, &logits, &bad(|p| p.temperature = f32::NAN)).is_err());
    assert!(run(&mut g, &logits, &bad(|p| p.min_p = 1.5)).is_err());
    // Still correct after the errors (nothing was launched by them).
    let pick = DevicePick { edits: vec![e(7)], u: 0.0, ..ok.clone() };
    assert_eq!(g.pick(&logits, &pick), 0);
    let greedy = DevicePick { params: Resolved { temperature: 0.0, ..Resolved::default() }, edits: vec![e(7)], ..ok };
    assert_eq!(g.pick(&logits, &greedy), 7);
}

// ---------------------------------------------------------------------------------------------------
// Timing (run with `--ignored bench_sample`)

/// Median and minimum GPU time in seconds of one `op()` (one pick: its edit copy and kernels): each of
/// `reps` calls is queued behind a 200 µs GPU spin, between two CUDA events, so the host's launch
/// overhead is hidden and the GPU runs the call's work back to back.
fn time_op(dev: &Device, reps: usize, mut op: impl FnMut()) -> (f64, f64) {
    use cudarc::driver::sys::CUevent_flags;
    for _ in 0..3 {
        op();
    }
    dev.synchronize().unwrap();
    let ctx = dev.context();
    let events: Vec<_> = (0..2 * reps).map(|_| ctx.new_event(Some(CUevent_flags::CU_EVENT_DEFAULT)).unwrap()).collect();
    for r in 0..reps {
        util::spin(dev, 200_000).unwrap();
        events[2 * r].record(dev.stream()).unwrap();
        op();
        events[2 * r + 1].record(dev.stream()).unwrap();
    }
    dev.synchronize().unwrap();
    let mut t: Vec<f64> =
        (0..reps).map(|r| events[2 * r].elapsed_ms(&events[2 * r + 1]).unwrap() as f64 * 1e-3).collect();
    t.sort_by(|a, b| a.partial_cmp(b).unwrap());
    (t[reps / 2], t[0])
}

#[test]
#[ignore = "timing; run on the GPU machine"]
fn bench_sample() {
    let Some(dev) = device() else { return };
    let (n, len) = (248_077, 248_320);
    let mut g = Gpu::new(&dev, len);
    let mut rng = Rng::new(15);
    let d = Resolved::default();
    println!("pick at vocab {n} (rows of {len}): GPU time per call (edit copy + kernels), median of 25");
    for (style, sname) in [(4usize, "LM-like"), (0, "normal(1)")] {
        let logits = row(&mut rng, n, len, style);
        let d_logits = dev.upload(&logits).unwrap();
        for (name, p, with_edits) in [
            ("greedy", Resolved { temperature: 0.0, ..d }, false),
            ("greedy + 2k edits", Resolved { temperature: 0.0, ..d }, true),
            ("T=1", d, false),
            ("top_p 0.9", Resolved { top_p: 0.9, ..d }, false),
            ("top_p 0.95 + 2k edits", Resolved { top_p: 0.95, ..d }, true),
            ("top_p 0.999", Resolved { top_p: 0.999, ..d }, false),
            ("min_p 0.05", Resolved { min_p: 0.05, ..d }, false),
            ("top_k 40", Resolved { top_k: 40, ..d }, false),
            ("top_k 40 top_p 0.95", Resolved { top_k: 40, top_p: 0.95, ..d }, false),
        ] {
            let ed = if with_edits {
                let mut ids: Vec<u32> = (0..2000).map(|_| rng.below(n) as u32).collect();
                ids.sort_unstable();
                ids.dedup();
                ids.into_iter().map(|id| LogitEdit { id, rep: 1.1, ..LogitEdit::NONE }).collect()
            } else {
                Vec::new()
            };
            let pick = DevicePick { vocab: n, params: p, u: 0.37, edits: ed };
            let want = pick_on_cpu(&mut logits.clone(), &pick);
            assert_eq!(g.pick(&d_logits, &pick), want, "{name}: bench pick differs from the CPU's");
            let (med, min) = time_op(&dev, 25, || {
                sample::pick(&dev, &d_logits, &pick, &mut g.edits, &mut g.scratch, &mut g.out).unwrap();
            });
            println!("  {sname:>9} {name:>22}: {:7.2} µs (min {:.2})", med * 1e6, min * 1e6);
        }
    }
}

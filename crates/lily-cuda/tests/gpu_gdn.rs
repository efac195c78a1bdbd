//! CPU-vs-GPU tests of the Gated DeltaNet decode kernels (`kernels/gdn.cu`, `ops::gdn`) against
//! `lily_cpu::gdn`, plus a timing of the real-size decode step (`bench_gdn_decode`, ignored by default).
//!
//! Each test skips (prints "no GPU, skipped") when `probe(0)` fails. Inputs are fresh pseudo-random
//! values in realistic ranges (never zeros; a random nonzero recurrent and conv state), outputs are
//! poisoned with NaN before the GPU run, and every output, the updated recurrent state and the updated
//! conv state are compared with the CPU functions at a relative max error of 1e-5 (an indexing bug shows
//! up as ≥ 1e-2).
#![cfg(feature = "cuda")]

mod common;

use lily_cpu::gdn as cpu;
use lily_cuda::ops::gdn::{self, GdnDims};
use common::{device, Rng, poisoned, time_op};
use lily_cuda::Device;
use lily_cuda::weights::upload_matrix;
use lily_model::affine::{dequantize_row_bf16, quantize_bf16, AffineParams};
use lily_model::buf::{Buf, FloatBuf};
use lily_model::weights::{Matrix, Storage};




/// max |got − want| / max |want|, after checking every element was written (no NaN).
fn rel_err(got: &[f32], want: &[f32], what: &str) -> f64 {
    assert_eq!(got.len(), want.len(), "{what}: length");
    if let Some(i) = got.iter().position(|v| !v.is_finite()) {
        panic!("{what}: element {i} of {} not written (or not finite): {}", got.len(), got[i]);
    }
    let scale = want.iter().fold(0.0f64, |a, b| a.max(b.abs() as f64)).max(1e-30);
    got.iter().zip(want).fold(0.0f64, |a, (g, w)| a.max((*g as f64 - *w as f64).abs())) / scale
}

const TOL: f64 = 1e-5;

fn check(got: &[f32], want: &[f32], what: &str) -> f64 {
    let e = rel_err(got, want, what);
    assert!(e <= TOL, "{what}: relative max error {e:.3e} > {TOL:.0e}");
    e
}

/// A_log = ln U(1, 16); dt_bias: even heads U(0.5, 2) (fast decay), odd heads the Mamba init
/// softplus⁻¹(dt), dt log-uniform in [1e-3, 0.1] (slow decay), as in lily-cpu's tests.
fn gate_params(rng: &mut Rng, hv: usize) -> (Vec<f32>, Vec<f32>) {
    let a_log = (0..hv).map(|_| rng.range(1.0, 16.0).ln()).collect();
    let dt_bias = (0..hv)
        .map(|h| {
            if h % 2 == 0 {
                rng.range(0.5, 2.0)
            } else {
                let dt = (rng.range(1e-3f64.ln(), 0.1f64.ln()) as f64).exp();
                dt.exp_m1().ln() as f32
            }
        })
        .collect();
    (a_log, dt_bias)
}

/// One layer's worth of inputs for T tokens.
struct Inputs {
    x: Vec<f32>,          // [T, C]
    conv_w: Vec<f32>,     // [C, K]
    conv_state: Vec<f32>, // [K-1, C]
    a: Vec<f32>,          // [T, Hv]
    b: Vec<f32>,          // [T, Hv]
    a_log: Vec<f32>,
    dt_bias: Vec<f32>,
    state: Vec<f32>,  // [Hv, Dk, Dv]
    z: Vec<f32>,      // [T, Hv·Dv]
    norm_w: Vec<f32>, // [Dv]
}

fn inputs(rng: &mut Rng, d: &GdnDims, t: usize) -> Inputs {
    let (c, hv, k) = (d.conv_dim(), d.num_v_heads, d.conv_kernel);
    let (a_log, dt_bias) = gate_params(rng, hv);
    Inputs {
        x: rng.normals(t * c, 1.0),
        conv_w: rng.normals(c * k, 0.5),
        conv_state: rng.normals(d.conv_state_len(), 1.0),
        a: rng.normals(t * hv, 1.0),
        b: rng.normals(t * hv, 2.0),
        a_log,
        dt_bias,
        state: rng.normals(d.state_len(), 0.5),
        z: rng.normals(t * d.value_dim(), 1.0),
        norm_w: (0..d.head_v_dim).map(|_| rng.range(0.5, 1.5)).collect(),
    }
}

/// The CPU results: (qkv after conv + norm, conv state, g, beta, o, state, y).
struct Outputs {
    qkv: Vec<f32>,
    conv_state: Vec<f32>,
    g: Vec<f32>,
    beta: Vec<f32>,
    o: Vec<f32>,
    state: Vec<f32>,
    y: Vec<f32>,
}

const EPS: f32 = 1e-6;

fn cpu_layer(inp: &Inputs, d: &GdnDims, t: usize) -> Outputs {
    let cd = *d;
    let mut conv_state = inp.conv_state.clone();
    let mut qkv = vec![f32::NAN; t * d.conv_dim()];
    cpu::causal_conv1d_silu(&inp.x, &inp.conv_w, &mut conv_state, &cd, &mut qkv);
    cpu::normalize_qk(&mut qkv, &cd);
    let (mut g, mut beta) = (vec![f32::NAN; t * d.num_v_heads], vec![f32::NAN; t * d.num_v_heads]);
    cpu::gates(&inp.a, &inp.b, &inp.a_log, &inp.dt_bias, &mut g, &mut beta);
    let mut state = inp.state.clone();
    let mut o = vec![f32::NAN; t * d.value_dim()];
    cpu::delta_rule_recurrent(&qkv, &g, &beta, &mut state, &cd, &mut o);
    let mut y = vec![f32::NAN; t * d.value_dim()];
    cpu::gated_rmsnorm(&o, &inp.z, &inp.norm_w, EPS, &cd, &mut y);
    Outputs { qkv, conv_state, g, beta, o, state, y }
}

fn check_layer(dev: &Device, d: &GdnDims, t: usize, seed: u64) {
    let mut rng = Rng::new(seed);
    let inp = inputs(&mut rng, d, t);
    let want = cpu_layer(&inp, d, t);
    let what = format!("{d:?} T={t}");
    let (c, hv, vd) = (d.conv_dim(), d.num_v_heads, d.value_dim());

    // Stage 1: conv + SiLU + q/k norm + gates.
    let x = dev.upload(&inp.x).unwrap();
    let conv_w = dev.upload(&inp.conv_w).unwrap();
    let mut conv_state = dev.upload(&inp.conv_state).unwrap();
    let (a, b) = (dev.upload(&inp.a).unwrap(), dev.upload(&inp.b).unwrap());
    let (a_log, dt_bias) = (dev.upload(&inp.a_log).unwrap(), dev.upload(&inp.dt_bias).unwrap());
    let mut qkv = poisoned(dev, t * c);
    let (mut g, mut beta) = (poisoned(dev, t * hv), poisoned(dev, t * hv));
    gdn::conv_qk(dev, d, t, &x, &conv_w, &mut conv_state, &a, &b, &a_log, &dt_bias, &mut qkv, &mut g, &mut beta)
        .unwrap();
    let e_qkv = check(&dev.download(&qkv).unwrap(), &want.qkv, &format!("{what}: conv qkv"));
    let e_cs = check(&dev.download(&conv_state).unwrap(), &want.conv_state, &format!("{what}: conv state"));
    let e_g = check(&dev.download(&g).unwrap(), &want.g, &format!("{what}: g"));
    let e_b = check(&dev.download(&beta).unwrap(), &want.beta, &format!("{what}: beta"));

    // Stage 2: the rule, isolated (from the CPU's qkv, g, beta) and chained (from stage 1's).
    let (qkv_c, g_c, beta_c) =
        (dev.upload(&want.qkv).unwrap(), dev.upload(&want.g).unwrap(), dev.upload(&want.beta).unwrap());
    let mut state = dev.upload(&inp.state).unwrap();
    let mut o = poisoned(dev, t * vd);
    gdn::delta_rule_recurrent(dev, d, t, &qkv_c, &g_c, &beta_c, &mut state, &mut o).unwrap();
    let e_o = check(&dev.download(&o).unwrap(), &want.o, &format!("{what}: rule out"));
    let e_s = check(&dev.download(&state).unwrap(), &want.state, &format!("{what}: rule state"));
    let mut state2 = dev.upload(&inp.state).unwrap();
    let mut o2 = poisoned(dev, t * vd);
    gdn::delta_rule_recurrent(dev, d, t, &qkv, &g, &beta, &mut state2, &mut o2).unwrap();
    let e_o2 = check(&dev.download(&o2).unwrap(), &want.o, &format!("{what}: chained rule out"));
    let e_s2 = check(&dev.download(&state2).unwrap(), &want.state, &format!("{what}: chained rule state"));
    // Other warp counts give the same numbers.
    for warps in [1, 4, 8] {
        let mut s = dev.upload(&inp.state).unwrap();
        let mut ow = poisoned(dev, t * vd);
        gdn::delta_rule_recurrent_with(dev, d, t, &qkv_c, &g_c, &beta_c, &mut s, &mut ow, warps).unwrap();
        check(&dev.download(&ow).unwrap(), &want.o, &format!("{what}: rule out, {warps} warps"));
        check(&dev.download(&s).unwrap(), &want.state, &format!("{what}: rule state, {warps} warps"));
    }

    // Stage 3: gated norm, isolated and chained.
    let (o_c, z, nw) = (dev.upload(&want.o).unwrap(), dev.upload(&inp.z).unwrap(), dev.upload(&inp.norm_w).unwrap());
    let mut y = poisoned(dev, t * vd);
    gdn::gated_rmsnorm(dev, d, t, &o_c, &z, &nw, EPS, &mut y).unwrap();
    let e_y = check(&dev.download(&y).unwrap(), &want.y, &format!("{what}: gated norm"));
    let mut y2 = poisoned(dev, t * vd);
    gdn::gated_rmsnorm(dev, d, t, &o2, &z, &nw, EPS, &mut y2).unwrap();
    let e_y2 = check(&dev.download(&y2).unwrap(), &want.y, &format!("{what}: chained gated norm"));

    let e_strided = check_strided(dev, d, t, &inp, &want, &what);

    println!(
        "{what}: qkv {e_qkv:.1e} conv_state {e_cs:.1e} g {e_g:.1e} beta {e_b:.1e} | o {e_o:.1e} state {e_s:.1e} \
         (chained {e_o2:.1e} {e_s2:.1e}) | y {e_y:.1e} (chained {e_y2:.1e}) | strided, every conv kernel {e_strided:.1e}"
    );
}

/// Stages 1 and 3 on the layout the model's fused input projection writes: each token's row is
/// [x (C) | z (Hv·Dv) | b (Hv) | a (Hv)], so x, z, b and a are column ranges `W` floats apart; the conv
/// through each of its kernels (per warp where the shape allows it, tiled, per token). Returns the worst
/// error.
fn check_strided(dev: &Device, d: &GdnDims, t: usize, inp: &Inputs, want: &Outputs, what: &str) -> f64 {
    let (c, hv, vd) = (d.conv_dim(), d.num_v_heads, d.value_dim());
    let w = c + vd + 2 * hv;
    let mut rows = vec![f32::NAN; t * w];
    for i in 0..t {
        let r = &mut rows[i * w..(i + 1) * w];
        r[..c].copy_from_slice(&inp.x[i * c..(i + 1) * c]);
        r[c..c + vd].copy_from_slice(&inp.z[i * vd..(i + 1) * vd]);
        r[c + vd..c + vd + hv].copy_from_slice(&inp.b[i * hv..(i + 1) * hv]);
        r[c + vd + hv..].copy_from_slice(&inp.a[i * hv..(i + 1) * hv]);
    }
    let buf = dev.upload(&rows).unwrap();
    let (x, z, b, a) = (buf.slice(0..), buf.slice(c..), buf.slice(c + vd..), buf.slice(c + vd + hv..));
    let conv_w = dev.upload(&inp.conv_w).unwrap();
    let (a_log, dt_bias) = (dev.upload(&inp.a_log).unwrap(), dev.upload(&inp.dt_bias).unwrap());
    let mut worst = 0.0f64;
    for kernel in [gdn::ConvKernel::Auto, gdn::ConvKernel::Tiled, gdn::ConvKernel::PerToken] {
        let mut conv_state = dev.upload(&inp.conv_state).unwrap();
        let mut qkv = poisoned(dev, t * c);
        let (mut g, mut beta) = (poisoned(dev, t * hv), poisoned(dev, t * hv));
        let ins = gdn::ConvInputs { x_stride: w, ab_stride: w, kernel };
        gdn::conv_qk_with(dev, d, t, &x, &conv_w, &mut conv_state, &a, &b, &a_log, &dt_bias, &mut qkv, &mut g, &mut beta, ins).unwrap();
        let tag = format!("{what}: strided conv ({kernel:?})");
        worst = worst.max(check(&dev.download(&qkv).unwrap(), &want.qkv, &format!("{tag} qkv")));
        worst = worst.max(check(&dev.download(&conv_state).unwrap(), &want.conv_state, &format!("{tag} conv state")));
        worst = worst.max(check(&dev.download(&g).unwrap(), &want.g, &format!("{tag} g")));
        worst = worst.max(check(&dev.download(&beta).unwrap(), &want.beta, &format!("{tag} beta")));
    }
    let (o_c, nw) = (dev.upload(&want.o).unwrap(), dev.upload(&inp.norm_w).unwrap());
    let mut y = poisoned(dev, t * vd);
    gdn::gated_rmsnorm_with(dev, d, t, &o_c, &z, w, &nw, EPS, &mut y).unwrap();
    worst.max(check(&dev.download(&y).unwrap(), &want.y, &format!("{what}: strided gated norm")))
}

fn dims(hk: usize, hv: usize, dk: usize, dv: usize, k: usize) -> GdnDims {
    GdnDims { num_k_heads: hk, num_v_heads: hv, head_k_dim: dk, head_v_dim: dv, conv_kernel: k }
}

/// Qwen3.6-35B-A3B: Hk 16, Hv 32, Dk = Dv = 128, K 4 (C = 8192).
const REAL: GdnDims = GdnDims { num_k_heads: 16, num_v_heads: 32, head_k_dim: 128, head_v_dim: 128, conv_kernel: 4 };

#[test]
fn gdn_real_sizes_match_cpu() {
    let Some(dev) = device() else { return };
    assert_eq!(REAL.conv_dim(), 8192);
    let same = dims(32, 32, 128, 128, 4); // Hv/Hk = 1 at the real head sizes
    for (i, d) in [REAL, same].iter().enumerate() {
        // T ≥ 16 takes the tiled conv (one full tile, a partial last tile).
        for t in [1, 7, 16, 37] {
            check_layer(&dev, d, t, 100 + 10 * i as u64 + t as u64);
        }
    }
}

#[test]
fn gdn_small_odd_sizes_match_cpu() {
    let Some(dev) = device() else { return };
    // Dk not a multiple of 4 (padded row groups), Dv not a multiple of 8 (partial warps), K ≠ 4,
    // Hv/Hk = 1, 2 and 3; a T shorter than K-1 (the conv state keeps some old rows); Dk up to 256.
    let cases = [
        dims(3, 3, 24, 40, 4),
        dims(2, 4, 21, 37, 3),
        dims(1, 3, 7, 5, 5),
        dims(2, 4, 200, 72, 4),
        dims(1, 2, 256, 64, 2),
    ];
    for (i, d) in cases.iter().enumerate() {
        for t in [1, 2, 7, 16, 37] {
            check_layer(&dev, d, t, 1000 + 10 * i as u64 + t as u64);
        }
    }
}

#[test]
fn gdn_split_sequence_equals_whole() {
    // 40 tokens in one call = 20 + 1 + 19 tokens in three calls carrying both states (the tiled conv,
    // the per-token one, the tiled one again).
    let Some(dev) = device() else { return };
    let d = REAL;
    let t = 40;
    let mut rng = Rng::new(7);
    let inp = inputs(&mut rng, &d, t);
    let want = cpu_layer(&inp, &d, t);
    let (c, hv, vd) = (d.conv_dim(), d.num_v_heads, d.value_dim());
    let conv_w = dev.upload(&inp.conv_w).unwrap();
    let (a_log, dt_bias) = (dev.upload(&inp.a_log).unwrap(), dev.upload(&inp.dt_bias).unwrap());
    let mut conv_state = dev.upload(&inp.conv_state).unwrap();
    let mut state = dev.upload(&inp.state).unwrap();
    let mut o_all = Vec::new();
    for (lo, hi) in [(0, 20), (20, 21), (21, 40)] {
        let n = hi - lo;
        let x = dev.upload(&inp.x[lo * c..hi * c]).unwrap();
        let a = dev.upload(&inp.a[lo * hv..hi * hv]).unwrap();
        let b = dev.upload(&inp.b[lo * hv..hi * hv]).unwrap();
        let mut qkv = poisoned(&dev, n * c);
        let (mut g, mut beta) = (poisoned(&dev, n * hv), poisoned(&dev, n * hv));
        gdn::conv_qk(&dev, &d, n, &x, &conv_w, &mut conv_state, &a, &b, &a_log, &dt_bias, &mut qkv, &mut g, &mut beta)
            .unwrap();
        let mut o = poisoned(&dev, n * vd);
        gdn::delta_rule_recurrent(&dev, &d, n, &qkv, &g, &beta, &mut state, &mut o).unwrap();
        o_all.extend(dev.download(&o).unwrap());
    }
    let e_o = check(&o_all, &want.o, "split: out");
    let e_s = check(&dev.download(&state).unwrap(), &want.state, "split: state");
    let e_c = check(&dev.download(&conv_state).unwrap(), &want.conv_state, "split: conv state");
    println!("split 20+1+19 vs CPU whole: out {e_o:.1e} state {e_s:.1e} conv_state {e_c:.1e}");
}

/// The one-launch decode step (`gdn::decode_step`: conv, gates, rule and gated norm), in each of its
/// forms (`StepLoads`: loads where needed; batched, the conv state shifted by every block of a
/// cluster), each from the same states, against the CPU over 4
/// consecutive tokens carrying both states: the gated norm's output, the conv state and
/// the recurrent state after each token. Real sizes, Hv/Hk = 1, 2, 3, 4 and 8, 1 to 8 blocks per head
/// (clusters of 1 to 8 blocks), small and odd head dims, K = 2..5.
#[test]
fn gdn_decode_step_matches_cpu() {
    let Some(dev) = device() else { return };
    // Blocks per head (slices): REAL 4, Hv/Hk = 1 at the real sizes 8, (2, 8, 32, 16) 2, the odd ones 1.
    let cases = [
        REAL,
        dims(32, 32, 128, 128, 4),
        dims(2, 4, 32, 32, 4),
        dims(2, 8, 32, 16, 4),
        dims(3, 9, 21, 40, 3),
        dims(1, 4, 7, 8, 5),
        dims(2, 16, 64, 16, 2),
        dims(4, 4, 200, 72, 4),
    ];
    for (i, d) in cases.iter().enumerate() {
        assert!(gdn::step_fits(d), "{d:?}");
        // Every case runs the batched form but the one of 288-thread blocks (Dv 72 in one slice),
        // which takes the first form under every StepLoads.
        assert_eq!(gdn::step_batched_fits(d), d.head_v_dim != 72, "{d:?}");
        let mut rng = Rng::new(500 + i as u64);
        let mut inp = inputs(&mut rng, d, 1);
        let vd = d.value_dim();
        let conv_w = dev.upload(&inp.conv_w).unwrap();
        let (a_log, dt_bias) = (dev.upload(&inp.a_log).unwrap(), dev.upload(&inp.dt_bias).unwrap());
        let nw = dev.upload(&inp.norm_w).unwrap();
        let mut worst = 0.0f64;
        for step in 0..4 {
            if step > 0 {
                // A new token, the states carried over from the CPU's previous step.
                let next = inputs(&mut rng, d, 1);
                inp.x = next.x;
                inp.a = next.a;
                inp.b = next.b;
                inp.z = next.z;
            }
            let want = cpu_layer(&inp, d, 1);
            let (x, a, b, z) = (dev.upload(&inp.x).unwrap(), dev.upload(&inp.a).unwrap(), dev.upload(&inp.b).unwrap(), dev.upload(&inp.z).unwrap());
            // Both placements of the loads, each from the same states.
            for loads in gdn::StepLoads::ALL {
                let (mut cs, mut st) = (dev.upload(&inp.conv_state).unwrap(), dev.upload(&inp.state).unwrap());
                let mut y = poisoned(&dev, vd);
                gdn::decode_step(&dev, d, &x, &conv_w, &mut cs, &a, &b, &a_log, &dt_bias, &mut st, &z, &nw, EPS, &mut y, loads).unwrap();
                let what = format!("{d:?} step {step} ({loads:?})");
                worst = worst.max(check(&dev.download(&y).unwrap(), &want.y, &format!("{what}: y")));
                worst = worst.max(check(&dev.download(&cs).unwrap(), &want.conv_state, &format!("{what}: conv state")));
                worst = worst.max(check(&dev.download(&st).unwrap(), &want.state, &format!("{what}: state")));
            }
            // The next step starts from the CPU's states, so each step is checked on its own.
            inp.conv_state = want.conv_state;
            inp.state = want.state;
        }
        println!("{d:?}: decode step, 4 tokens: worst {worst:.1e}");
    }
    // Shapes it does not take are refused (Dv not a multiple of 8, Hv/Hk > 8), not run.
    for d in [dims(2, 4, 21, 37, 3), dims(1, 16, 16, 16, 4), dims(1, 1, 16, 256, 4)] {
        assert!(!gdn::step_fits(&d), "{d:?}");
        let inp = inputs(&mut Rng::new(9), &d, 1);
        let up = |v: &Vec<f32>| dev.upload(v).unwrap();
        let (mut cs, mut st, mut y) = (up(&inp.conv_state), up(&inp.state), poisoned(&dev, d.value_dim()));
        let r = gdn::decode_step(&dev, &d, &up(&inp.x), &up(&inp.conv_w), &mut cs, &up(&inp.a), &up(&inp.b), &up(&inp.a_log), &up(&inp.dt_bias), &mut st, &up(&inp.z), &up(&inp.norm_w), EPS, &mut y, gdn::StepLoads::WhenNeeded);
        assert!(r.is_err(), "{d:?}");
    }
}

/// A random fused in_proj ([q | k | v | z | b | a] rows of `hidden` columns) quantised to 4 bits in
/// groups of 64 as MLX does, and its rows dequantised (what the GPU multiplies by).
fn in_proj(rng: &mut Rng, rows: usize, hidden: usize) -> (Matrix, Vec<f32>) {
    let amp = 1.0 / (hidden as f64).sqrt();
    let mut w = Vec::with_capacity(rows * hidden);
    for _ in 0..rows {
        let spread = rng.range(0.5, 2.0) as f64;
        w.extend(rng.normals(hidden, 2.0 * amp * spread).into_iter().map(half::bf16::from_f32));
    }
    let p = AffineParams::new(4, 64);
    let q = quantize_bf16(&w, hidden, p);
    let (words, groups) = (hidden / 8, hidden / 64);
    let mut deq = vec![0.0f32; rows * hidden];
    for r in 0..rows {
        let (pk, sc, bi) = (&q.packed[r * words..(r + 1) * words], &q.scales[r * groups..(r + 1) * groups], &q.biases[r * groups..(r + 1) * groups]);
        dequantize_row_bf16(pk, sc, bi, p, &mut deq[r * hidden..(r + 1) * hidden]);
    }
    let m = Matrix {
        count: 1,
        rows,
        cols: hidden,
        storage: Storage::Affine { params: p, packed: Buf::owned(q.packed), scales: FloatBuf::Bf16(Buf::owned(q.scales)), biases: FloatBuf::Bf16(Buf::owned(q.biases)) },
    };
    (m, deq)
}

/// RMSNorm(x)·w, then W x, in f64 (as lily_cpu's norm and GEMV define them), rounded to f32.
fn ref_in_proj(deq: &[f32], rows: usize, x: &[f32], w: &[f32], eps: f32) -> Vec<f32> {
    let h = x.len();
    let ss: f64 = x.iter().map(|v| (*v as f64).powi(2)).sum();
    let inv = 1.0 / (ss / h as f64 + eps as f64).sqrt();
    let xn: Vec<f64> = x.iter().zip(w).map(|(a, b)| ((*a as f64 * inv * *b as f64) as f32) as f64).collect();
    (0..rows).map(|r| deq[r * h..(r + 1) * h].iter().zip(&xn).map(|(a, b)| *a as f64 * b).sum::<f64>() as f32).collect()
}

/// Within this of the CPU (relative to the largest value): the projection's integer-form product is
/// good to ~1e-6 of its largest output (gemv_tc.cuh), which the q/k norms and the rule carry; an
/// indexing or exchange bug costs O(1).
const IN_STEP_TOL: f64 = 1e-4;

/// The input projection and step in one launch (`gdn_in_step::decode_in_step`) against the CPU: the
/// residual stream x normed and projected by a random 4-bit in_proj (f64), split into q | k | v, z, b,
/// a, then `cpu_layer`; y, the conv state and the recurrent state after each of 3 consecutive tokens
/// (the states carried over from the CPU). The full-size heads (clusters of 8: 16 q rows and 32
/// columns a block, 7 tiles), Hv/Hk = 1, 2 and 4, blocks of fewer than 16 q rows (part-filled tiles),
/// K = 3 and 4; shapes it does not take are refused.
#[test]
fn gdn_in_step_matches_cpu() {
    use lily_cuda::ops::gdn_in_step;
    let Some(dev) = device() else { return };
    let cases = [(REAL, 1024), (dims(2, 4, 32, 32, 4), 512), (dims(2, 2, 64, 128, 4), 1024), (dims(4, 16, 128, 64, 3), 512), (dims(4, 8, 64, 64, 4), 2048)];
    for (i, (d, hidden)) in cases.iter().enumerate() {
        let (d, hidden) = (*d, *hidden);
        let (c, vd, hv) = (d.conv_dim(), d.value_dim(), d.num_v_heads);
        let rows = c + vd + 2 * hv;
        let mut rng = Rng::new(700 + i as u64);
        let (m, deq) = in_proj(&mut rng, rows, hidden);
        let w = upload_matrix(&dev, &m).unwrap();
        assert!(gdn_in_step::fits(&dev, &d, &w), "{d:?} H={hidden}");
        let in_norm: Vec<f32> = (0..hidden).map(|_| rng.range(0.5, 1.5)).collect();
        let mut inp = inputs(&mut rng, &d, 1);
        let (conv_w, a_log, dt_bias) = (dev.upload(&inp.conv_w).unwrap(), dev.upload(&inp.a_log).unwrap(), dev.upload(&inp.dt_bias).unwrap());
        let (nw, inw) = (dev.upload(&inp.norm_w).unwrap(), dev.upload(&in_norm).unwrap());
        let mut worst = 0.0f64;
        for step in 0..3 {
            let x: Vec<f32> = rng.normals(hidden, 3.0);
            let proj = ref_in_proj(&deq, rows, &x, &in_norm, EPS);
            inp.x = proj[..c].to_vec();
            inp.z = proj[c..c + vd].to_vec();
            inp.b = proj[c + vd..c + vd + hv].to_vec();
            inp.a = proj[c + vd + hv..].to_vec();
            let want = cpu_layer(&inp, &d, 1);
            let dx = dev.upload(&x).unwrap();
            // Both placements of the copies, each from the same states; the same bits.
            let mut ys = Vec::new();
            for copies in gdn_in_step::Copies::ALL {
                let (mut cs, mut st) = (dev.upload(&inp.conv_state).unwrap(), dev.upload(&inp.state).unwrap());
                let mut y = poisoned(&dev, vd);
                gdn_in_step::decode_in_step(&dev, &d, &w, &dx, &inw, EPS, &conv_w, &mut cs, &a_log, &dt_bias, &mut st, &nw, EPS, &mut y, copies).unwrap();
                let what = format!("{d:?} H={hidden} step {step} ({copies:?})");
                let chk = |got: &[f32], want: &[f32], part: &str| {
                    let e = rel_err(got, want, &format!("{what}: {part}"));
                    assert!(e <= IN_STEP_TOL, "{what}: {part}: relative max error {e:.3e} > {IN_STEP_TOL:.0e}");
                    e
                };
                let yv = dev.download(&y).unwrap();
                worst = worst.max(chk(&yv, &want.y, "y"));
                worst = worst.max(chk(&dev.download(&cs).unwrap(), &want.conv_state, "conv state"));
                worst = worst.max(chk(&dev.download(&st).unwrap(), &want.state, "state"));
                ys.push(yv);
            }
            assert!(ys[0].iter().zip(&ys[1]).all(|(a, b)| a.to_bits() == b.to_bits()), "{d:?} step {step}: the two placements differ");
            inp.conv_state = want.conv_state;
            inp.state = want.state;
        }
        println!("{d:?} H={hidden}: in_proj + step, 3 tokens: worst {worst:.1e}");
    }
    // Refused, not run: hidden not a multiple of 512; Dk past 128; an in_proj of the wrong rows.
    let d = dims(2, 4, 32, 32, 4);
    let rows = d.conv_dim() + d.value_dim() + 2 * d.num_v_heads;
    let mut rng = Rng::new(799);
    let w384 = upload_matrix(&dev, &in_proj(&mut rng, rows, 384).0).unwrap();
    assert!(!gdn_in_step::fits(&dev, &d, &w384), "hidden 384");
    let short = upload_matrix(&dev, &in_proj(&mut rng, rows - 2, 512).0).unwrap();
    assert!(!gdn_in_step::fits(&dev, &d, &short), "rows - 2");
    let d256 = dims(1, 2, 256, 32, 4);
    let w256 = upload_matrix(&dev, &in_proj(&mut rng, d256.conv_dim() + d256.value_dim() + 4, 512).0).unwrap();
    assert!(!gdn_in_step::fits(&dev, &d256, &w256), "Dk 256");
    let inp = inputs(&mut rng, &d, 1);
    let up = |v: &Vec<f32>| dev.upload(v).unwrap();
    let (mut cs, mut st, mut y) = (up(&inp.conv_state), up(&inp.state), poisoned(&dev, d.value_dim()));
    let r = gdn_in_step::decode_in_step(&dev, &d, &w384, &up(&rng.normals(384, 1.0)), &up(&vec![1.0; 384]), EPS, &up(&inp.conv_w), &mut cs, &up(&inp.a_log), &up(&inp.dt_bias), &mut st, &up(&inp.norm_w), EPS, &mut y, gdn_in_step::Copies::Ahead);
    assert!(r.is_err(), "hidden 384 ran");
}

#[test]
fn gdn_rejects_bad_shapes() {
    let Some(dev) = device() else { return };
    let d = dims(2, 4, 16, 16, 4);
    let t = 1;
    let qkv = dev.zeros::<f32>(d.conv_dim() - 1).unwrap();
    let (g, beta) = (dev.zeros::<f32>(4).unwrap(), dev.zeros::<f32>(4).unwrap());
    let mut state = dev.zeros::<f32>(d.state_len()).unwrap();
    let mut o = dev.zeros::<f32>(d.value_dim()).unwrap();
    assert!(gdn::delta_rule_recurrent(&dev, &d, t, &qkv, &g, &beta, &mut state, &mut o).is_err());
    let bad = dims(3, 4, 16, 16, 4); // Hv not a multiple of Hk
    assert!(gdn::delta_rule_recurrent(&dev, &bad, t, &qkv, &g, &beta, &mut state, &mut o).is_err());
    let big = dims(1, 1, 512, 16, 4); // Dk > MAX_DK
    assert!(gdn::delta_rule_recurrent(&dev, &big, t, &qkv, &g, &beta, &mut state, &mut o).is_err());
    // Row strides below a row's width, and strided inputs shorter than T rows span, are refused.
    let t = 20;
    let (c, hv) = (d.conv_dim(), d.num_v_heads);
    let x = dev.zeros::<f32>(t * (c + 8)).unwrap();
    let ab = dev.zeros::<f32>(t * 8).unwrap();
    let w = dev.zeros::<f32>(c * d.conv_kernel).unwrap();
    let hvs = dev.zeros::<f32>(hv).unwrap();
    let mut cs = dev.zeros::<f32>(d.conv_state_len()).unwrap();
    let (mut out, mut g, mut beta) = (dev.zeros::<f32>(t * c).unwrap(), dev.zeros::<f32>(t * hv).unwrap(), dev.zeros::<f32>(t * hv).unwrap());
    for (xs, abs, ok) in [(c - 1, hv, false), (c, hv - 1, false), (c + 9, hv, false), (c + 8, 8, true)] {
        let ins = gdn::ConvInputs { x_stride: xs, ab_stride: abs, kernel: gdn::ConvKernel::Auto };
        let r = gdn::conv_qk_with(&dev, &d, t, &x, &w, &mut cs, &ab, &ab, &hvs, &hvs, &mut out, &mut g, &mut beta, ins);
        assert_eq!(r.is_ok(), ok, "strides {xs}, {abs}: {r:?}");
    }
    let mut y = dev.zeros::<f32>(t * d.value_dim()).unwrap();
    let o = dev.zeros::<f32>(t * d.value_dim()).unwrap();
    assert!(gdn::gated_rmsnorm_with(&dev, &d, t, &o, &o, d.value_dim() - 1, &hvs, EPS, &mut y).is_err());
    assert!(gdn::gated_rmsnorm_with(&dev, &d, t, &o, &o, d.value_dim() + 1, &hvs, EPS, &mut y).is_err());
}

/// The gated norm that writes the output projection's staged x itself (`gdn::gated_rmsnorm_staged`)
/// against the gated norm's f32 output staged by the GEMM's stager (`gemm_wgmma::stage_half`), bit for
/// bit (the f16 plane and the tokens' scales), and that plane against the CPU's gated norm within f16
/// rounding; z a column range of wider rows; token magnitudes spread over ±20 powers of ten. Then the
/// output projection through `prestage_half` / `x_staged_only` equal to the one on the f32 output.
#[test]
fn gated_norm_staged_equals_norm_then_stage() {
    use lily_cuda::ops::gemm::{self, Opts, Precision};
    use lily_cuda::ops::gemm_wgmma::{self, HalfStage, Stager};
    let Some(dev) = device() else { return };
    for (i, (d, t)) in [(REAL, 37usize), (dims(2, 4, 16, 16, 4), 5), (dims(1, 3, 32, 64, 4), 9)].into_iter().enumerate() {
        let (dv, vd) = (d.head_v_dim, d.value_dim());
        assert!(gdn::gated_norm_stage_fits(&d), "{d:?}");
        let mut rng = Rng::new(900 + i as u64);
        let mut o = rng.normals(t * vd, 1.0);
        for tok in 0..t {
            let m = 10f32.powf(rng.range(-20.0, 20.0));
            o[tok * vd..(tok + 1) * vd].iter_mut().for_each(|v| *v *= m);
        }
        let zs = vd + 24; // z a column range of wider rows
        let zrows = rng.normals(t * zs, 2.0);
        let nw: Vec<f32> = (0..dv).map(|_| rng.range(0.5, 1.5)).collect();
        let (od, zd, nwd) = (dev.upload(&o).unwrap(), dev.upload(&zrows).unwrap(), dev.upload(&nw).unwrap());
        let z = zd.slice(8..);
        // The norm, then the stager.
        let mut y = poisoned(&dev, t * vd);
        gdn::gated_rmsnorm_with(&dev, &d, t, &od, &z, zs, &nwd, EPS, &mut y).unwrap();
        let (want, want_s) = gemm_wgmma::stage_half(&dev, &y, t, vd, Stager::Rows).unwrap();
        let (want, want_s) = (dev.download(&want).unwrap(), dev.download(&want_s).unwrap());
        // The norm writing the staging.
        let (mut plane, mut scales) = (dev.zeros::<u16>(t * vd).unwrap(), dev.zeros::<f32>(t).unwrap());
        let st = HalfStage::into_buffers(&dev, &mut plane, &mut scales, t, vd).unwrap();
        gdn::gated_rmsnorm_staged(&dev, &d, t, &od, &z, zs, &nwd, EPS, &st).unwrap();
        let (got, got_s) = (dev.download(&plane).unwrap(), dev.download(&scales).unwrap());
        assert_eq!(got_s.iter().map(|v| v.to_bits()).collect::<Vec<_>>(), want_s.iter().map(|v| v.to_bits()).collect::<Vec<_>>(), "{d:?}: scales");
        let bad = (0..t * vd).find(|&k| got[k] != want[k]);
        assert!(bad.is_none(), "{d:?}: plane differs at {bad:?}");
        // Against the CPU's gated norm (the plane unpermuted and unscaled), within f16's rounding.
        let mut cpu_y = vec![0f32; t * vd];
        let zc: Vec<f32> = (0..t).flat_map(|tok| zrows[tok * zs + 8..tok * zs + 8 + vd].to_vec()).collect();
        cpu::gated_rmsnorm(&o, &zc, &nw, EPS, &d, &mut cpu_y);
        let mut worst = 0f64;
        for tok in 0..t {
            let row_max = cpu_y[tok * vd..(tok + 1) * vd].iter().fold(0f32, |a, v| a.max(v.abs())) as f64;
            for k in 0..vd {
                let (g, mm) = (k / 64, k % 64);
                let (q, rem) = (mm / 16, mm % 16);
                let col = 64 * g + 16 * (rem % 4) + 8 * (rem / 8) + 2 * q + (rem / 4) % 2;
                let v = half::f16::from_bits(got[tok * vd + col]).to_f64() * got_s[tok] as f64;
                worst = worst.max((v - cpu_y[tok * vd + k] as f64).abs() / row_max);
            }
        }
        assert!(worst < 1e-3, "{d:?}: staged norm vs CPU {worst:.2e} of each token's largest");
        println!("{d:?} t {t}: staged gated norm bit for bit the norm + stager; vs CPU {worst:.1e}");
        // The output projection on the staged x, as the model runs it, against the one staging y.
        let (rows, cols) = (48, vd);
        let wb: Vec<half::bf16> = rng.normals(rows * cols, 0.05).into_iter().map(half::bf16::from_f32).collect();
        let (p, q) = (AffineParams::new(4, 64), quantize_bf16(&wb, cols, AffineParams::new(4, 64)));
        let storage = Storage::Affine { params: p, packed: Buf::owned(q.packed), scales: FloatBuf::Bf16(Buf::owned(q.scales)), biases: FloatBuf::Bf16(Buf::owned(q.biases)) };
        let dw = upload_matrix(&dev, &Matrix { count: 1, rows, cols, storage }).unwrap();
        let o_half = Opts { precision: Precision::Half, ..Default::default() };
        if t > 1 && gemm::takes_prestaged_half(&dw, o_half) {
            let mut y_ref = poisoned(&dev, t * rows);
            gemm::gemm_with(&dev, &dw, 0, &y, t, &mut y_ref, o_half).unwrap();
            let x_unwritten = poisoned(&dev, t * vd);
            let st = gemm_wgmma::prestage_half(&dev, &x_unwritten, t, vd).unwrap();
            gdn::gated_rmsnorm_staged(&dev, &d, t, &od, &z, zs, &nwd, EPS, &st).unwrap();
            let mut y_st = poisoned(&dev, t * rows);
            gemm::gemm_with(&dev, &dw, 0, &x_unwritten, t, &mut y_st, Opts { x_staged_only: true, ..o_half }).unwrap();
            assert_eq!(dev.download(&y_st).unwrap(), dev.download(&y_ref).unwrap(), "{d:?}: the projection on the staged x");
            // Another x is not what the buffer holds: the call refuses rather than read it.
            assert!(gemm::gemm_with(&dev, &dw, 0, &y, t, &mut y_st, Opts { x_staged_only: true, ..o_half }).is_err());
        }
    }
    // Outputs a token of a size not a multiple of 64 are refused.
    let d = dims(1, 3, 16, 16, 4);
    assert!(!gdn::gated_norm_stage_fits(&d));
}

// ---------------------------------------------------------------------------------------------------
// Timing (run with `--ignored bench_gdn_decode`)

#[test]
#[ignore = "timing; run on the GPU machine"]
fn bench_gdn_decode() {
    let Some(dev) = device() else { return };
    let d = REAL;
    let layers = 30;
    let mut rng = Rng::new(42);
    let (c, hv, vd) = (d.conv_dim(), d.num_v_heads, d.value_dim());
    // Per layer: its own weights and states (60 MiB of recurrent state in all, more than the 50 MiB L2).
    let inp: Vec<Inputs> = (0..layers).map(|_| inputs(&mut rng, &d, 1)).collect();
    let up = |v: &Vec<f32>| dev.upload(v).unwrap();
    let x: Vec<_> = inp.iter().map(|i| up(&i.x)).collect();
    let conv_w: Vec<_> = inp.iter().map(|i| up(&i.conv_w)).collect();
    let mut conv_state: Vec<_> = inp.iter().map(|i| up(&i.conv_state)).collect();
    let a: Vec<_> = inp.iter().map(|i| up(&i.a)).collect();
    let b: Vec<_> = inp.iter().map(|i| up(&i.b)).collect();
    let a_log: Vec<_> = inp.iter().map(|i| up(&i.a_log)).collect();
    let dt_bias: Vec<_> = inp.iter().map(|i| up(&i.dt_bias)).collect();
    let mut state: Vec<_> = inp.iter().map(|i| up(&i.state)).collect();
    let z: Vec<_> = inp.iter().map(|i| up(&i.z)).collect();
    let nw: Vec<_> = inp.iter().map(|i| up(&i.norm_w)).collect();
    let mut qkv = dev.zeros::<f32>(c).unwrap();
    let mut g = dev.zeros::<f32>(hv).unwrap();
    let mut beta = dev.zeros::<f32>(hv).unwrap();
    let mut o = dev.zeros::<f32>(vd).unwrap();
    let mut y = dev.zeros::<f32>(vd).unwrap();
    let (reps, batch) = (15, 3 * layers);
    let floor_us = 2.0 * d.state_len() as f64 * 4.0 / 4.3e12 * 1e6;
    println!("GDN decode, T=1, Hk 16 Hv 32 Dk=Dv=128, {layers} layers cycled (state floor {floor_us:.2} µs/layer)");

    let (t1, s1) = time_op(&dev, reps, batch, |i| {
        let l = i % layers;
        gdn::conv_qk(&dev, &d, 1, &x[l], &conv_w[l], &mut conv_state[l], &a[l], &b[l], &a_log[l], &dt_bias[l], &mut qkv, &mut g, &mut beta)
            .unwrap();
    });
    println!("  gdn_conv_qk      {:7.2} µs/layer (spread {s1:.2})", t1 * 1e6);
    for warps in [1u32, 2, 4, 8] {
        let (t2, s2) = time_op(&dev, reps, batch, |i| {
            let l = i % layers;
            gdn::delta_rule_recurrent_with(&dev, &d, 1, &qkv, &g, &beta, &mut state[l], &mut o, warps).unwrap();
        });
        let bw = 2.0 * d.state_len() as f64 * 4.0 / t2 / 1e12;
        println!("  gdn_recurrent w{warps} {:7.2} µs/layer ({bw:.2} TB/s of state, spread {s2:.2})", t2 * 1e6);
    }
    let (t3, s3) = time_op(&dev, reps, batch, |i| {
        let l = i % layers;
        gdn::gated_rmsnorm(&dev, &d, 1, &o, &z[l], &nw[l], EPS, &mut y).unwrap();
    });
    println!("  gdn_gated_norm   {:7.2} µs/layer (spread {s3:.2})", t3 * 1e6);
    let (t4, s4) = time_op(&dev, reps, batch, |i| {
        let l = i % layers;
        gdn::conv_qk(&dev, &d, 1, &x[l], &conv_w[l], &mut conv_state[l], &a[l], &b[l], &a_log[l], &dt_bias[l], &mut qkv, &mut g, &mut beta)
            .unwrap();
        gdn::delta_rule_recurrent(&dev, &d, 1, &qkv, &g, &beta, &mut state[l], &mut o).unwrap();
        gdn::gated_rmsnorm(&dev, &d, 1, &o, &z[l], &nw[l], EPS, &mut y).unwrap();
    });
    println!("  all three        {:7.2} µs/layer (spread {s4:.2}); × 30 layers = {:.1} µs", t4 * 1e6, t4 * 30e6);
    assert!(dev.download(&y).unwrap().iter().all(|v| v.is_finite()));
}

/// The prompt path's conv at the real shape, T = 4096 (`--ignored bench_gdn_conv_prefill`): the tiled
/// kernel and the per-warp one, on x as its own buffer and as the column range of the fused input
/// projection's rows (W = C + Hv·Dv + 2·Hv), against the bytes it must move (x in, out written).
#[test]
#[ignore = "timing; run on the GPU machine"]
fn bench_gdn_conv_prefill() {
    let Some(dev) = device() else { return };
    let d = REAL;
    let t = 4096;
    let (c, hv, vd) = (d.conv_dim(), d.num_v_heads, d.value_dim());
    let w = c + vd + 2 * hv;
    let mut rng = Rng::new(5);
    let rows = dev.upload(&rng.normals(t * w, 1.0)).unwrap();
    let conv_w = dev.upload(&rng.normals(c * d.conv_kernel, 0.5)).unwrap();
    let (a_log, dt_bias) = gate_params(&mut rng, hv);
    let (a_log, dt_bias) = (dev.upload(&a_log).unwrap(), dev.upload(&dt_bias).unwrap());
    let mut conv_state = dev.upload(&rng.normals(d.conv_state_len(), 1.0)).unwrap();
    let mut out = dev.zeros::<f32>(t * c).unwrap();
    let (mut g, mut beta) = (dev.zeros::<f32>(t * hv).unwrap(), dev.zeros::<f32>(t * hv).unwrap());
    let bytes = 2.0 * (t * c) as f64 * 4.0;
    for (stride, name) in [(c, "own buffer"), (w, "fused rows")] {
        let (x, b, a) = if stride == c {
            (rows.slice(0..), rows.slice(t * c..), rows.slice(t * c + t * hv..))
        } else {
            (rows.slice(0..), rows.slice(c + vd..), rows.slice(c + vd + hv..))
        };
        let ab = if stride == c { hv } else { w };
        for kernel in [gdn::ConvKernel::Tiled, gdn::ConvKernel::Auto] {
            let ins = gdn::ConvInputs { x_stride: stride, ab_stride: ab, kernel };
            let (s, sp) = time_op(&dev, 20, 5, |_| {
                gdn::conv_qk_with(&dev, &d, t, &x, &conv_w, &mut conv_state, &a, &b, &a_log, &dt_bias, &mut out, &mut g, &mut beta, ins).unwrap();
            });
            println!("  conv T={t} {name:>10} {kernel:?}: {:7.1} µs ({:.2} TB/s of x in + out, spread {sp:.2})", s * 1e6, bytes / s / 1e12);
        }
    }
    assert!(dev.download(&out).unwrap().iter().all(|v| v.is_finite()));
}

//! CPU-vs-GPU tests of the chunked gated delta rule for prefill (`kernels/gdn_chunked.cu`,
//! `ops::gdn_chunked`), plus a timing against the recurrent kernel (`bench_gdn_chunked`, ignored).
//!
//! Each test skips (prints "no GPU, skipped") without a GPU. Inputs are fresh pseudo-random values as
//! the layer sees them: q, k through `lily_cpu::gdn::normalize_qk` (L2-normed per head, q scaled by
//! 1/√Dk), v normal, g and β through `lily_cpu::gdn::gates` with per-head gate parameters giving strong
//! (g ≈ −5), moderate and near-zero (|g| ≈ 1e-3) decays, a random nonzero initial state. The outputs,
//! the scratch included, are poisoned with NaN first. The GPU chunked output and final state (the
//! default kernels, then every (prep, sequential pass) pair of FFMA and tensor-core kernels that takes
//! the shape) are compared with (a) the GPU recurrent kernel and (b) `lily_cpu::gdn::delta_rule_recurrent`
//! (the definition) and `delta_rule_chunked`, at a relative max error (max |Δ| / max |want|) of 1e-4:
//! the forms sum in different orders in f32, and the tensor cores' 3xTF32 products are good to ~2^-21,
//! which together cost ~1e-6 (the worst is printed); a wrong decay, chunk boundary or index, or a
//! dropped lo part of a 3xTF32 product (~1e-3), costs more. The 1xTF32 pairs are held at 1e-2 and the
//! bf16 pairs (operands rounded to 8 significant bits: ~4e-3 at worst in a float64 emulation of the
//! kernels' roundings, docs/PERF.md twenty-first session) at 2e-2; an index or decay bug costs O(1).
//! The passes that differ only in how the work is tiled or staged give the same bits.
#![cfg(feature = "cuda")]

mod common;

use common::{device, Rng, poisoned, time_op};
use cudarc::driver::CudaSlice;
use lily_cpu::gdn as cpu;
use lily_cuda::ops::gdn::{self, GdnDims};
use lily_cuda::ops::gdn_chunked::{self as chunked, scratch_len, PrepKernel, StateKernel};

/// Every (prep, sequential pass) pair of kernels; the 1xTF32 ones (Tensor1) alone and with the
/// f32-exact ones; the ldmatrix pass (held to the plain 1xTF32 one bit for bit after the 1xTF32 prep);
/// the bf16 passes (held to each other bit for bit after the bf16 prep); the preps whose solve runs
/// on the tensor cores (TensorMs, f32-exact, held to TOL; Bf16Ms before the bf16 pass); the prep on
/// f16 operands (F16) before the bf16 pass.
const KERNELS: [(PrepKernel, StateKernel); 16] = [
    (PrepKernel::Ffma, StateKernel::Ffma16),
    (PrepKernel::Ffma, StateKernel::Ffma32),
    (PrepKernel::Ffma, StateKernel::Tensor),
    (PrepKernel::Tensor, StateKernel::Ffma16),
    (PrepKernel::Tensor, StateKernel::Ffma32),
    (PrepKernel::Tensor, StateKernel::Tensor),
    (PrepKernel::Tensor1, StateKernel::Tensor1),
    (PrepKernel::Tensor1, StateKernel::Ffma32),
    (PrepKernel::Ffma, StateKernel::Tensor1),
    (PrepKernel::Tensor1, StateKernel::Tensor1Ldsmb),
    (PrepKernel::Bf16, StateKernel::Bf16x32),
    (PrepKernel::Bf16, StateKernel::Bf16x32S3),
    (PrepKernel::Bf16, StateKernel::Bf16x32S3L),
    (PrepKernel::TensorMs, StateKernel::Tensor),
    (PrepKernel::Bf16Ms, StateKernel::Bf16x32S3),
    (PrepKernel::F16, StateKernel::Bf16x32S3),
];

/// Whether a pair rounds its operands to tf32 (10 mantissa bits): held to TOL1 against the definition
/// (an indexing or decay bug costs O(1)), the others, good to f32 rounding, to TOL.
fn rounds_to_tf32((prep, state): (PrepKernel, StateKernel)) -> bool {
    prep.rounds_to_tf32() || state.rounds_to_tf32()
}

/// The tolerance of a pair: TOLB for bf16 operands, TOL1 for tf32 ones, TOL for f32-exact products.
fn tol_of(kernel: (PrepKernel, StateKernel)) -> f64 {
    if kernel.1.rounds_to_bf16() {
        TOLB
    } else if rounds_to_tf32(kernel) {
        TOL1
    } else {
        TOL
    }
}

/// The tolerance of the default kernels on this shape.
fn default_tol(dev: &Device, d: &GdnDims) -> f64 {
    tol_of(chunked::default_kernels(dev, d))
}

fn supports(d: &GdnDims, (prep, state): (PrepKernel, StateKernel)) -> bool {
    prep.supports(d) && state.supports(d)
}
use lily_cuda::Device;

/// max |got − want| / max |want|, after checking every element was written (no NaN).
fn rel_err(got: &[f32], want: &[f32], what: &str) -> f64 {
    assert_eq!(got.len(), want.len(), "{what}: length");
    if let Some(i) = got.iter().position(|v| !v.is_finite()) {
        panic!("{what}: element {i} of {} not written (or not finite): {}", got.len(), got[i]);
    }
    let scale = want.iter().fold(0.0f64, |a, b| a.max(b.abs() as f64)).max(1e-30);
    got.iter().zip(want).fold(0.0f64, |a, (g, w)| a.max((*g as f64 - *w as f64).abs())) / scale
}

const TOL: f64 = 1e-4;
const TOL1: f64 = 1e-2;
const TOLB: f64 = 2e-2;

fn check(got: &[f32], want: &[f32], tol: f64, what: &str) -> f64 {
    let e = rel_err(got, want, what);
    assert!(e <= tol, "{what}: relative max error {e:.3e} > {tol:.0e}");
    e
}

fn dims(hk: usize, hv: usize, dk: usize, dv: usize) -> GdnDims {
    GdnDims { num_k_heads: hk, num_v_heads: hv, head_k_dim: dk, head_v_dim: dv, conv_kernel: 4 }
}

/// Qwen3.6-35B-A3B: Hk 16, Hv 32, Dk = Dv = 128.
const REAL: GdnDims = GdnDims { num_k_heads: 16, num_v_heads: 32, head_k_dim: 128, head_v_dim: 128, conv_kernel: 4 };

/// softplus⁻¹(y) = ln(eʸ − 1).
fn inv_softplus(y: f64) -> f32 {
    y.exp_m1().ln() as f32
}

/// The rule's inputs for T tokens: (qkv [T, C], g [T, Hv], beta [T, Hv], state [Hv, Dk, Dv]).
/// Gate parameters by head h % 3 (with a ~ N(0, 1) per token): strong decay A = U(4, 12),
/// softplus(dt_bias) = U(0.3, 1) (g ≈ −5, from −0.5 to −40); moderate A = U(0.5, 2), softplus(dt_bias)
/// = U(0.01, 0.1); near zero A = U(0.05, 0.2), softplus(dt_bias) = U(1e-3, 1e-2) (|g| ≈ 1e-3).
/// β = sigmoid(N(0, 2)).
fn inputs(rng: &mut Rng, d: &GdnDims, t: usize) -> (Vec<f32>, Vec<f32>, Vec<f32>, Vec<f32>) {
    let hv = d.num_v_heads;
    let mut qkv = rng.normals(t * d.conv_dim(), 1.0);
    cpu::normalize_qk(&mut qkv, d);
    let (mut a_log, mut dt_bias) = (Vec::new(), Vec::new());
    for h in 0..hv {
        let ((alo, ahi), (slo, shi)) = match h % 3 {
            0 => ((4.0, 12.0), (0.3, 1.0)),
            1 => ((0.5, 2.0), (0.01, 0.1)),
            _ => ((0.05, 0.2), (1e-3, 1e-2)),
        };
        a_log.push((rng.range(alo, ahi) as f64).ln() as f32);
        dt_bias.push(inv_softplus(rng.range(slo, shi) as f64));
    }
    let a = rng.normals(t * hv, 1.0);
    let b = rng.normals(t * hv, 2.0);
    let (mut g, mut beta) = (vec![f32::NAN; t * hv], vec![f32::NAN; t * hv]);
    cpu::gates(&a, &b, &a_log, &dt_bias, &mut g, &mut beta);
    let state = rng.normals(d.state_len(), 0.5);
    (qkv, g, beta, state)
}

/// Runs the GPU chunked rule (the kernels `kernel`, or the default with None) from `state0`:
/// (out, state).
#[allow(clippy::too_many_arguments)]
fn gpu_chunked(
    dev: &Device,
    d: &GdnDims,
    t: usize,
    qkv: &CudaSlice<f32>,
    g: &CudaSlice<f32>,
    beta: &CudaSlice<f32>,
    state0: &[f32],
    kernel: Option<(PrepKernel, StateKernel)>,
) -> (Vec<f32>, Vec<f32>) {
    let mut state = dev.upload(state0).unwrap();
    let mut out = poisoned(dev, t * d.value_dim());
    let mut scratch = poisoned(dev, scratch_len(d, t));
    match kernel {
        None => chunked::delta_rule_chunked(dev, d, t, qkv, g, beta, &mut state, &mut out, &mut scratch),
        Some((pk, sk)) => {
            chunked::delta_rule_chunked_with(dev, d, t, qkv, g, beta, &mut state, &mut out, &mut scratch, pk, sk)
        }
    }
    .unwrap();
    (dev.download(&out).unwrap(), dev.download(&state).unwrap())
}

/// One case: the GPU chunked rule (the default kernel, then each kernel that takes the shape) vs the
/// CPU recurrent and chunked rules and the GPU recurrent kernel. Returns the worst error.
fn check_case(dev: &Device, d: &GdnDims, t: usize, seed: u64) -> f64 {
    let mut rng = Rng::new(seed);
    let (qkv, g, beta, state0) = inputs(&mut rng, d, t);
    let what = format!("Hk {} Hv {} Dk {} Dv {} T={t}", d.num_k_heads, d.num_v_heads, d.head_k_dim, d.head_v_dim);

    let mut s_rec = state0.clone();
    let mut o_rec = vec![f32::NAN; t * d.value_dim()];
    cpu::delta_rule_recurrent(&qkv, &g, &beta, &mut s_rec, d, &mut o_rec);
    let mut s_chk = state0.clone();
    let mut o_chk = vec![f32::NAN; t * d.value_dim()];
    cpu::delta_rule_chunked(&qkv, &g, &beta, &mut s_chk, d, &mut o_chk);

    let (qkv_d, g_d, beta_d) = (dev.upload(&qkv).unwrap(), dev.upload(&g).unwrap(), dev.upload(&beta).unwrap());
    let mut s_gr = dev.upload(&state0).unwrap();
    let mut o_gr = poisoned(dev, t * d.value_dim());
    gdn::delta_rule_recurrent(dev, d, t, &qkv_d, &g_d, &beta_d, &mut s_gr, &mut o_gr).unwrap();
    let (o_gr, s_gr) = (dev.download(&o_gr).unwrap(), dev.download(&s_gr).unwrap());

    // The default kernels (what the model runs): held to TOL, or to TOL1 where they round to tf32.
    let (o, s) = gpu_chunked(dev, d, t, &qkv_d, &g_d, &beta_d, &state0, None);
    let tol = default_tol(dev, d);
    let errs = [
        check(&o, &o_rec, tol, &format!("{what}: out vs CPU recurrent")),
        check(&s, &s_rec, tol, &format!("{what}: state vs CPU recurrent")),
        check(&o, &o_chk, tol, &format!("{what}: out vs CPU chunked")),
        check(&s, &s_chk, tol, &format!("{what}: state vs CPU chunked")),
        check(&o, &o_gr, tol, &format!("{what}: out vs GPU recurrent")),
        check(&s, &s_gr, tol, &format!("{what}: state vs GPU recurrent")),
    ];
    // Every pair of kernels that takes the shape, against the definition; the two FFMA tile widths
    // after the FFMA prep give the same numbers (the same sums in the same order).
    let mut e_kern = 0.0f64;
    let mut e_tf32 = 0.0f64;
    let mut e_bf16 = 0.0f64;
    let mut ffma = Vec::new();
    let mut tc1 = Vec::new();
    let mut bf = Vec::new();
    let mut solves = Vec::new();
    for kernel in KERNELS {
        if !supports(d, kernel) {
            continue;
        }
        let (ok, sk) = gpu_chunked(dev, d, t, &qkv_d, &g_d, &beta_d, &state0, Some(kernel));
        let tol = tol_of(kernel);
        let eo = check(&ok, &o_rec, tol, &format!("{what}: out, {kernel:?} vs CPU recurrent"));
        let es = check(&sk, &s_rec, tol, &format!("{what}: state, {kernel:?} vs CPU recurrent"));
        let worst = if kernel.1.rounds_to_bf16() {
            &mut e_bf16
        } else if rounds_to_tf32(kernel) {
            &mut e_tf32
        } else {
            &mut e_kern
        };
        *worst = worst.max(eo).max(es);
        if kernel == (PrepKernel::Tensor, StateKernel::Tensor) || kernel.0 == PrepKernel::TensorMs {
            solves.push((ok.clone(), sk.clone()));
        }
        if kernel.0 == PrepKernel::Bf16 {
            bf.push((kernel.1, ok, sk));
        } else if kernel.0 == PrepKernel::Ffma && matches!(kernel.1, StateKernel::Ffma16 | StateKernel::Ffma32) {
            ffma.push((ok, sk));
        } else if kernel.0 == PrepKernel::Tensor1 && kernel.1.rounds_to_tf32() {
            tc1.push((kernel.1, ok, sk));
        }
    }
    // The ldmatrix passes load the same values into the same registers: the same bits.
    if let [(_, o1, s1), rest @ ..] = &tc1[..] {
        for (k, o2, s2) in rest {
            assert!(o1 == o2 && s1 == s2, "{what}: the 1xTF32 pass {k:?} differs from the per-load one");
        }
    }
    // The bf16 passes differ in tile width and ring depth only: the same sums, the same bits.
    if let [(k1, o1, s1), rest @ ..] = &bf[..] {
        for (k, o2, s2) in rest {
            assert!(o1 == o2 && s1 == s2, "{what}: the bf16 pass {k:?} differs from {k1:?}");
        }
    }
    // The solve's blocks below the diagonal on the tensor cores (3xTF32) against the scalar loops,
    // both before the 3xTF32 pass: the same maths summed in another order, ~1e-6 apart; a wrong block,
    // index or sign costs O(1), a dropped lo term of a 3xTF32 product ~1e-3.
    let e_solve = match &solves[..] {
        [(o1, s1), (o2, s2)] => check(o2, o1, 1e-5, &format!("{what}: out, the tensor-core solve vs the scalar one"))
            .max(check(s2, s1, 1e-5, &format!("{what}: state, the tensor-core solve vs the scalar one"))),
        [] => 0.0,
        _ => panic!("{what}: the two 3xTF32 preps should take the same shapes"),
    };
    let e_tiles = check(&ffma[0].0, &ffma[1].0, 1e-6, &format!("{what}: out, FFMA tile 16 vs 32"))
        .max(check(&ffma[0].1, &ffma[1].1, 1e-6, &format!("{what}: state, FFMA tile 16 vs 32")));
    let (gmin, gmax) = g.iter().fold((f32::INFINITY, f32::NEG_INFINITY), |(a, b), &x| (a.min(x), b.max(x)));
    println!(
        "{what}: vs CPU recurrent out {:.1e} state {:.1e} | vs CPU chunked {:.1e} {:.1e} | vs GPU recurrent \
         {:.1e} {:.1e} | each kernel {e_kern:.1e}, 1xTF32 {e_tf32:.1e}, bf16 {e_bf16:.1e}, tiles {e_tiles:.1e}, solves {e_solve:.1e} (g in [{gmin:.2e}, {gmax:.2e}])",
        errs[0], errs[1], errs[2], errs[3], errs[4], errs[5]
    );
    errs.iter().fold(0.0, |a, &b| a.max(b))
}

const TS: [usize; 6] = [1, 5, 64, 65, 200, 1000];

#[test]
fn gdn_chunked_real_shape_matches() {
    let Some(dev) = device() else { return };
    let mut worst = 0.0f64;
    for (i, &t) in TS.iter().enumerate() {
        worst = worst.max(check_case(&dev, &REAL, t, 500 + i as u64));
    }
    println!("worst relative error, 35B shape: {worst:.2e}");
}

#[test]
fn gdn_chunked_small_shapes_match() {
    let Some(dev) = device() else { return };
    // The small shapes, the tiny fixtures' (tiny-a 2/4 heads D 32, tiny-b 4/8 Dk 16 Dv 32,
    // tiny-c 1/1 D 64), and odd ones: Dk, Dv not multiples of 16 or 32 (zero-padded slices, partial
    // column tiles), Dk ≠ Dv both ways, Hv/Hk = 1, 2, 3.
    let cases = [
        dims(2, 4, 32, 32),
        dims(1, 1, 64, 64),
        dims(4, 8, 16, 32),
        dims(3, 3, 24, 40),
        dims(1, 3, 48, 80),
        dims(2, 2, 128, 16),
        dims(1, 2, 16, 128),
        dims(1, 1, 7, 5),
    ];
    let mut worst = 0.0f64;
    for (i, d) in cases.iter().enumerate() {
        for (k, &t) in TS.iter().enumerate() {
            worst = worst.max(check_case(&dev, d, t, 1000 + 10 * i as u64 + k as u64));
        }
    }
    println!("worst relative error, small shapes: {worst:.2e}");
}

/// The f16 prep scales v and X by powers of two into f16's range: v a million times larger than f16's
/// largest value, or so small that its f16 copy would be subnormal, gives the definition's output at
/// the bf16 pairs' tolerance (without the scaling: infinities, or a third of v's digits lost), as the
/// tf32 prep does; on the 35B shape and a small one.
#[test]
fn gdn_chunked_f16_prep_scales_v_into_range() {
    let Some(dev) = device() else { return };
    for (d, t, seed) in [(REAL, 200, 31u64), (dims(2, 4, 32, 32), 130, 32)] {
        for v_scale in [1e6f32, 1e-7] {
            let mut rng = Rng::new(seed);
            let (mut qkv, g, beta, state0) = inputs(&mut rng, &d, t);
            let (c, v0) = (d.conv_dim(), 2 * d.num_k_heads * d.head_k_dim);
            for row in qkv.chunks_mut(c) {
                row[v0..].iter_mut().for_each(|x| *x *= v_scale);
            }
            let state0: Vec<f32> = state0.iter().map(|x| x * v_scale).collect();
            let mut s_rec = state0.clone();
            let mut o_rec = vec![f32::NAN; t * d.value_dim()];
            cpu::delta_rule_recurrent(&qkv, &g, &beta, &mut s_rec, &d, &mut o_rec);
            let (qkv_d, g_d, beta_d) = (dev.upload(&qkv).unwrap(), dev.upload(&g).unwrap(), dev.upload(&beta).unwrap());
            let what = format!("Hv {} Dk {} T={t}, v × {v_scale:e}", d.num_v_heads, d.head_k_dim);
            for kernel in [(PrepKernel::F16, StateKernel::Bf16x32S3), (PrepKernel::Bf16, StateKernel::Bf16x32S3)] {
                let (o, s) = gpu_chunked(&dev, &d, t, &qkv_d, &g_d, &beta_d, &state0, Some(kernel));
                let eo = check(&o, &o_rec, TOLB, &format!("{what}: out, {kernel:?}"));
                let es = check(&s, &s_rec, TOLB, &format!("{what}: state, {kernel:?}"));
                println!("{what}: {kernel:?} out {eo:.1e} state {es:.1e}");
            }
        }
    }
}

#[test]
fn gdn_chunked_split_calls_equal_whole() {
    // 200 tokens in one CPU call = 64 + 1 + 135 tokens in three GPU chunked calls carrying the state.
    let Some(dev) = device() else { return };
    let (d, t) = (dims(2, 4, 32, 32), 200);
    let mut rng = Rng::new(77);
    let (qkv, g, beta, state0) = inputs(&mut rng, &d, t);
    let mut s_want = state0.clone();
    let mut o_want = vec![f32::NAN; t * d.value_dim()];
    cpu::delta_rule_recurrent(&qkv, &g, &beta, &mut s_want, &d, &mut o_want);
    let (c, hv) = (d.conv_dim(), d.num_v_heads);
    let mut state = dev.upload(&state0).unwrap();
    let mut scratch = poisoned(&dev, scratch_len(&d, 135));
    let mut o_all = Vec::new();
    for (lo, hi) in [(0, 64), (64, 65), (65, 200)] {
        let n = hi - lo;
        let q = dev.upload(&qkv[lo * c..hi * c]).unwrap();
        let gg = dev.upload(&g[lo * hv..hi * hv]).unwrap();
        let bb = dev.upload(&beta[lo * hv..hi * hv]).unwrap();
        let mut o = poisoned(&dev, n * d.value_dim());
        chunked::delta_rule_chunked(&dev, &d, n, &q, &gg, &bb, &mut state, &mut o, &mut scratch).unwrap();
        o_all.extend(dev.download(&o).unwrap());
    }
    let tol = default_tol(&dev, &d);
    let e_o = check(&o_all, &o_want, tol, "split: out");
    let e_s = check(&dev.download(&state).unwrap(), &s_want, tol, "split: state");
    println!("split 64+1+135 (GPU chunked) vs CPU recurrent whole: out {e_o:.1e} state {e_s:.1e}");
}

#[test]
fn gdn_chunked_rejects_bad_shapes() {
    let Some(dev) = device() else { return };
    let t = 3;
    let run = |d: &GdnDims, scratch_n: usize, (pk, sk): (PrepKernel, StateKernel)| {
        let qkv = dev.zeros::<f32>(t * d.conv_dim()).unwrap();
        let (g, beta) = (dev.zeros::<f32>(t * d.num_v_heads).unwrap(), dev.zeros::<f32>(t * d.num_v_heads).unwrap());
        let mut state = dev.zeros::<f32>(d.state_len()).unwrap();
        let mut o = dev.zeros::<f32>(t * d.value_dim()).unwrap();
        let mut scratch = dev.zeros::<f32>(scratch_n.max(1)).unwrap();
        chunked::delta_rule_chunked_with(&dev, d, t, &qkv, &g, &beta, &mut state, &mut o, &mut scratch, pk, sk)
    };
    let ok = dims(2, 4, 32, 32);
    for kernel in KERNELS {
        run(&ok, scratch_len(&ok, t), kernel).unwrap();
    }
    let f16 = (PrepKernel::Ffma, StateKernel::Ffma16);
    let (tc_prep, tc_state) = ((PrepKernel::Tensor, StateKernel::Ffma32), (PrepKernel::Ffma, StateKernel::Tensor));
    let err = |r: lily_cuda::Result<()>, what: &str| match r {
        Err(lily_cuda::CudaError::Shape(m)) => println!("{what}: {m}"),
        other => panic!("{what}: expected a Shape error, got {other:?}"),
    };
    err(run(&ok, scratch_len(&ok, t) - 1, f16), "scratch one short");
    err(run(&dims(1, 1, 24, 32), scratch_len(&dims(1, 1, 24, 32), t), tc_state), "tensor pass, Dk 24");
    err(run(&dims(1, 1, 32, 12), scratch_len(&dims(1, 1, 32, 12), t), tc_state), "tensor pass, Dv 12");
    err(run(&dims(1, 1, 24, 32), scratch_len(&dims(1, 1, 24, 32), t), tc_prep), "tensor prep, Dk 24");
    err(run(&dims(1, 1, 32, 12), scratch_len(&dims(1, 1, 32, 12), t), tc_prep), "tensor prep, Dv 12");
    err(run(&dims(1, 1, 144, 32), scratch_len(&dims(1, 1, 144, 32), t), f16), "Dk 144");
    err(run(&dims(1, 1, 32, 256), scratch_len(&dims(1, 1, 32, 256), t), f16), "Dv 256");
    err(run(&dims(3, 4, 32, 32), scratch_len(&dims(3, 4, 32, 32), t), f16), "Hv not a multiple of Hk");
    err(run(&ok, scratch_len(&ok, t), (PrepKernel::Tensor1, StateKernel::Bf16x32)), "bf16 pass after the f32 prep");
    err(run(&ok, scratch_len(&ok, t), (PrepKernel::Bf16, StateKernel::Tensor1Ldsmb)), "f32 pass after the bf16 prep");
    err(run(&dims(1, 1, 24, 32), scratch_len(&dims(1, 1, 24, 32), t), (PrepKernel::Bf16, StateKernel::Bf16x32S3L)), "bf16 pair, Dk 24");
}

// ---------------------------------------------------------------------------------------------------
// The bf16 pair's prep that convolves its own inputs (`delta_rule_conv`)

/// The fused conv's case: x [T, C] and the gate inputs in rows of the model's fused projection layout
/// [x | z | b | a] (padded to a multiple of 4 floats), random conv taps and a nonzero conv state.
struct ConvCase {
    rows: Vec<f32>,
    w: usize,
    conv_w: Vec<f32>,
    conv_state: Vec<f32>,
    a_log: Vec<f32>,
    dt_bias: Vec<f32>,
    state: Vec<f32>,
}

fn conv_case(rng: &mut Rng, d: &GdnDims, t: usize) -> ConvCase {
    let (c, hv, vd) = (d.conv_dim(), d.num_v_heads, d.value_dim());
    let w = (c + vd + 2 * hv).next_multiple_of(4);
    let mut rows = vec![f32::NAN; t * w];
    for r in rows.chunks_mut(w) {
        r[..c + vd].copy_from_slice(&rng.normals(c + vd, 1.0));
        r[c + vd..c + vd + hv].copy_from_slice(&rng.normals(hv, 2.0)); // b
        r[c + vd + hv..c + vd + 2 * hv].copy_from_slice(&rng.normals(hv, 1.0)); // a
    }
    let (_, _, _, state) = inputs(rng, d, 1);
    let a_log = (0..hv).map(|h| [8.0f64, 1.0, 0.1][h % 3].ln() as f32).collect();
    let dt_bias = (0..hv).map(|h| inv_softplus([0.6, 0.05, 5e-3][h % 3])).collect();
    ConvCase { rows, w, conv_w: rng.normals(c * d.conv_kernel, 0.5), conv_state: rng.normals(d.conv_state_len(), 1.0), a_log, dt_bias, state }
}

/// The CPU definition on the case: conv + SiLU, q/k norms, gates, the recurrent rule; (out, state,
/// conv state).
fn conv_case_cpu(d: &GdnDims, t: usize, k: &ConvCase) -> (Vec<f32>, Vec<f32>, Vec<f32>) {
    let (c, hv, vd) = (d.conv_dim(), d.num_v_heads, d.value_dim());
    let x: Vec<f32> = k.rows.chunks(k.w).flat_map(|r| r[..c].to_vec()).collect();
    let b: Vec<f32> = k.rows.chunks(k.w).flat_map(|r| r[c + vd..c + vd + hv].to_vec()).collect();
    let a: Vec<f32> = k.rows.chunks(k.w).flat_map(|r| r[c + vd + hv..c + vd + 2 * hv].to_vec()).collect();
    let (mut conv_state, mut qkv) = (k.conv_state.clone(), vec![f32::NAN; t * c]);
    cpu::causal_conv1d_silu(&x, &k.conv_w, &mut conv_state, d, &mut qkv);
    cpu::normalize_qk(&mut qkv, d);
    let (mut g, mut beta) = (vec![f32::NAN; t * hv], vec![f32::NAN; t * hv]);
    cpu::gates(&a, &b, &k.a_log, &k.dt_bias, &mut g, &mut beta);
    let (mut state, mut out) = (k.state.clone(), vec![f32::NAN; t * vd]);
    cpu::delta_rule_recurrent(&qkv, &g, &beta, &mut state, d, &mut out);
    (out, state, conv_state)
}

/// The GPU on the case: the conv pass then the bf16 pair (`fused` false), or the prep that convolves
/// its inputs (`fused` true), with `pass`; over `split` (token ranges, one call each, carrying both
/// states). (out, state, conv state).
fn conv_case_gpu(dev: &Device, d: &GdnDims, k: &ConvCase, split: &[(usize, usize)], pass: StateKernel, fused: bool) -> (Vec<f32>, Vec<f32>, Vec<f32>) {
    let (c, hv, vd) = (d.conv_dim(), d.num_v_heads, d.value_dim());
    let (conv_w, a_log, dt_bias) = (dev.upload(&k.conv_w).unwrap(), dev.upload(&k.a_log).unwrap(), dev.upload(&k.dt_bias).unwrap());
    let (mut conv_state, mut state) = (dev.upload(&k.conv_state).unwrap(), dev.upload(&k.state).unwrap());
    let mut out_all = Vec::new();
    for &(lo, hi) in split {
        let n = hi - lo;
        let buf = dev.upload(&k.rows[lo * k.w..hi * k.w]).unwrap();
        let (x, b, a) = (buf.slice(0..), buf.slice(c + vd..), buf.slice(c + vd + hv..));
        let ins = gdn::ConvInputs { x_stride: k.w, ab_stride: k.w, kernel: gdn::ConvKernel::Auto };
        let mut out = poisoned(dev, n * vd);
        let mut scratch = poisoned(dev, scratch_len(d, n));
        if fused {
            chunked::delta_rule_conv(dev, d, n, &x, &conv_w, &mut conv_state, &a, &b, &a_log, &dt_bias, ins, &mut state, &mut out, &mut scratch, pass).unwrap();
        } else {
            let mut qkv = poisoned(dev, n * c);
            let (mut g, mut beta) = (poisoned(dev, n * hv), poisoned(dev, n * hv));
            gdn::conv_qk_with(dev, d, n, &x, &conv_w, &mut conv_state, &a, &b, &a_log, &dt_bias, &mut qkv, &mut g, &mut beta, ins).unwrap();
            chunked::delta_rule_chunked_with(dev, d, n, &qkv, &g, &beta, &mut state, &mut out, &mut scratch, PrepKernel::Bf16, pass).unwrap();
        }
        out_all.extend(dev.download(&out).unwrap());
    }
    (out_all, dev.download(&state).unwrap(), dev.download(&conv_state).unwrap())
}

fn same_bits(got: &[f32], want: &[f32], what: &str) {
    assert_eq!(got.len(), want.len(), "{what}: lengths");
    if let Some(i) = (0..got.len()).find(|&i| got[i].to_bits() != want[i].to_bits()) {
        panic!("{what}: element {i} is {} where the separate conv gives {}", got[i], want[i]);
    }
}

/// The fused prep's outputs, recurrent state and conv state are the separate conv + bf16 pair's bit
/// for bit (the same operations in the same order: `kernels/gdn_conv.cuh`), for every bf16 pass, over
/// partial chunks, calls carried on from a previous one, the 35B shape and small ones (Hv/Hk 1, 2, 4;
/// Dk ≠ Dv; a padded row); and within the bf16 pair's tolerance of the CPU's conv, gates and recurrent
/// rule.
#[test]
fn gdn_chunked_conv_prep_equals_conv_then_prep() {
    let Some(dev) = device() else { return };
    let cases: [(GdnDims, &[(usize, usize)]); 6] = [
        (REAL, &[(0, 1000)]),
        (REAL, &[(0, 64), (64, 129)]),
        (dims(2, 4, 32, 32), &[(0, 200)]),
        (dims(1, 1, 64, 64), &[(0, 65), (65, 68), (68, 300)]),
        (dims(4, 8, 16, 32), &[(0, 100)]),
        (dims(1, 4, 48, 80), &[(0, 3), (3, 131)]),
    ];
    let mut worst = 0.0f64;
    for (i, (d, split)) in cases.iter().enumerate() {
        let t = split.last().unwrap().1;
        let case = conv_case(&mut Rng::new(900 + i as u64), d, t);
        let (o_cpu, s_cpu, cs_cpu) = conv_case_cpu(d, t, &case);
        for pass in [StateKernel::Bf16x32, StateKernel::Bf16x32S3, StateKernel::Bf16x32S3L] {
            let what = format!("{d:?} split {split:?} {pass:?}");
            let (o, s, cs) = conv_case_gpu(&dev, d, &case, split, pass, true);
            // Calls of fewer than 16 tokens take the per-token conv kernel, whose norms sum in another
            // order: those splits are held to the CPU only.
            if split.iter().all(|(lo, hi)| hi - lo >= gdn::CONV_TILE) {
                let (o0, s0, cs0) = conv_case_gpu(&dev, d, &case, split, pass, false);
                same_bits(&o, &o0, &format!("{what}: out"));
                same_bits(&s, &s0, &format!("{what}: state"));
                same_bits(&cs, &cs0, &format!("{what}: conv state"));
            }
            same_bits(&cs, &cs_cpu, &format!("{what}: conv state vs the CPU"));
            worst = worst.max(check(&o, &o_cpu, TOLB, &format!("{what}: out vs the CPU")));
            worst = worst.max(check(&s, &s_cpu, TOLB, &format!("{what}: state vs the CPU")));
        }
    }
    println!("fused conv prep vs the CPU: worst relative error {worst:.2e}");

    // Refusals: fewer than K − 1 tokens, an f32 pass, x's stride not a multiple of 4, 5 taps.
    let d = dims(2, 4, 32, 32);
    let case = conv_case(&mut Rng::new(990), &d, 8);
    let refuse = |d: &GdnDims, t: usize, x_stride: usize, pass: StateKernel, what: &str| {
        let (c, hv) = (d.conv_dim(), d.num_v_heads);
        let x = dev.upload(&case.rows).unwrap();
        let w = dev.zeros::<f32>(c * d.conv_kernel).unwrap();
        let mut cs = dev.zeros::<f32>(d.conv_state_len()).unwrap();
        let ab = dev.zeros::<f32>(t * x_stride + hv).unwrap();
        let hvs = dev.zeros::<f32>(hv).unwrap();
        let (mut st, mut o, mut sc) = (dev.zeros::<f32>(d.state_len()).unwrap(), dev.zeros::<f32>(t * d.value_dim()).unwrap(), dev.zeros::<f32>(scratch_len(d, t)).unwrap());
        let ins = gdn::ConvInputs { x_stride, ab_stride: x_stride, kernel: gdn::ConvKernel::Auto };
        match chunked::delta_rule_conv(&dev, d, t, &x, &w, &mut cs, &ab, &ab, &hvs, &hvs, ins, &mut st, &mut o, &mut sc, pass) {
            Err(lily_cuda::CudaError::Shape(m)) => println!("{what}: {m}"),
            other => panic!("{what}: expected a Shape error, got {other:?}"),
        }
    };
    refuse(&d, 2, case.w, StateKernel::Bf16x32S3, "2 tokens for 4 taps");
    refuse(&d, 8, case.w, StateKernel::Tensor1Ldsmb, "an f32 pass");
    refuse(&d, 4, d.conv_dim() + 2, StateKernel::Bf16x32S3, "x's stride not a multiple of 4");
    refuse(&GdnDims { conv_kernel: 5, ..d }, 8, case.w, StateKernel::Bf16x32S3, "5 taps");
}

// ---------------------------------------------------------------------------------------------------
// Timing (run with `--ignored bench_gdn_chunked --nocapture`)

#[test]
#[ignore = "timing; run on the GPU machine"]
fn bench_gdn_chunked() {
    let Some(dev) = device() else { return };
    let d = REAL;
    println!("GDN delta rule, Hk 16 Hv 32 Dk=Dv=128, one layer (µs per call = per layer)");
    for t in [512usize, 2048, 4096] {
        let mut rng = Rng::new(t as u64);
        let (qkv, g, beta, state0) = inputs(&mut rng, &d, t);
        let (qkv, g, beta) = (dev.upload(&qkv).unwrap(), dev.upload(&g).unwrap(), dev.upload(&beta).unwrap());
        let mut state = dev.upload(&state0).unwrap();
        let mut out = dev.zeros::<f32>(t * d.value_dim()).unwrap();
        let mut scratch = dev.zeros::<f32>(scratch_len(&d, t)).unwrap();
        let (reps, batch) = (7, 3);
        let (tr, sr) = time_op(&dev, reps, batch, |_| {
            gdn::delta_rule_recurrent(&dev, &d, t, &qkv, &g, &beta, &mut state, &mut out).unwrap();
        });
        let mut line = format!("  T={t:5}: recurrent {:9.1} µs (spread {sr:.2})", tr * 1e6);
        for kernel in KERNELS {
            let (tc, sc) = time_op(&dev, reps, batch, |_| {
                chunked::delta_rule_chunked_with(
                    &dev,
                    &d,
                    t,
                    &qkv,
                    &g,
                    &beta,
                    &mut state,
                    &mut out,
                    &mut scratch,
                    kernel.0,
                    kernel.1,
                )
                .unwrap();
            });
            line += &format!("\n    {kernel:?} {:8.1} µs (×{:.1}, spread {sc:.2})", tc * 1e6, tr / tc);
        }
        println!("{line}; scratch {:.0} MB", scratch_len(&d, t) as f64 * 4e-6);
        assert!(dev.download(&out).unwrap().iter().all(|v| v.is_finite()));
    }
}

/// One call of the default chunked rule at the 35B shape and a 4096-token chunk, for `ncu` (run with
/// `--ignored ncu_gdn_chunked`): the prep and the sequential state pass, one launch each.
#[test]
#[ignore = "for profiling with ncu on the GPU machine"]
fn ncu_gdn_chunked() {
    let Some(dev) = device() else { return };
    let (d, t) = (REAL, 4096);
    let mut rng = Rng::new(9);
    let (qkv, g, beta, state0) = inputs(&mut rng, &d, t);
    let (qkv, g, beta) = (dev.upload(&qkv).unwrap(), dev.upload(&g).unwrap(), dev.upload(&beta).unwrap());
    let mut state = dev.upload(&state0).unwrap();
    let mut out = dev.zeros::<f32>(t * d.value_dim()).unwrap();
    let mut scratch = dev.zeros::<f32>(scratch_len(&d, t)).unwrap();
    chunked::delta_rule_chunked(&dev, &d, t, &qkv, &g, &beta, &mut state, &mut out, &mut scratch).unwrap();
    dev.synchronize().unwrap();
    assert!(dev.download(&out).unwrap().iter().all(|v| v.is_finite()));
}

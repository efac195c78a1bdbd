//! Tests of the CPU Gated DeltaNet maths (`lily_cpu::gdn`): the chunked rule against the recurrent
//! one, splitting a sequence with carried state, hand-computed tiny cases (the order of operations
//! in the recurrence, the conv taps), the value-head → key-head mapping (repeat_interleave, not
//! tiled), the norms and the gates. Inputs are pseudo-random in realistic ranges, never zeros.
//!
//! `cargo test --release -p lily-cpu --test gdn -- --ignored --nocapture` also times the chunked
//! and recurrent rules at the real Qwen3.6 sizes.

use lily_cpu::gdn::{
    causal_conv1d_silu, delta_rule_chunked, delta_rule_chunked_with, delta_rule_recurrent,
    delta_rule_recurrent_with, gated_rmsnorm, gates, normalize_qk, GdnDims,
};
use lily_cpu::kernels::Isa;

mod common;

use common::Rng;

// ---------------------------------------------------------------------------------------------
// Helpers: comparisons.

fn max_abs(x: &[f32]) -> f32 {
    x.iter().fold(0f32, |m, v| m.max(v.abs()))
}

fn max_abs_diff(a: &[f32], b: &[f32]) -> f32 {
    assert_eq!(a.len(), b.len());
    a.iter().zip(b).fold(0f32, |m, (x, y)| {
        assert!(x.is_finite() && y.is_finite(), "non-finite value");
        m.max((x - y).abs())
    })
}

/// Asserts max|got − want| ≤ rel · max(max|want|, 1e-3).
fn assert_close(what: &str, got: &[f32], want: &[f32], rel: f32) {
    let err = max_abs_diff(got, want);
    let scale = max_abs(want).max(1e-3);
    assert!(
        err <= rel * scale,
        "{what}: max abs diff {err:.3e} > {rel:.0e} × {scale:.3e}"
    );
}

const EPS_RULE: f32 = 1e-4;

/// Hv/Hk = 1 and Hv/Hk = 2, both with Dk ≠ Dv.
const CONFIGS: [GdnDims; 2] = [
    GdnDims {
        num_k_heads: 2,
        num_v_heads: 2,
        head_k_dim: 16,
        head_v_dim: 24,
        conv_kernel: 4,
    },
    GdnDims {
        num_k_heads: 2,
        num_v_heads: 4,
        head_k_dim: 32,
        head_v_dim: 16,
        conv_kernel: 4,
    },
];

/// Rule inputs for T tokens: qkv [T, C] (q, k, v ~ N(0,1), then normalize_qk), g, beta [T, Hv]
/// from a ~ N(0,1), b ~ N(0,2), A_log = ln U(1,16), dt_bias ~ U(0.5, 2).
struct RuleInputs {
    qkv: Vec<f32>,
    g: Vec<f32>,
    beta: Vec<f32>,
}

/// A_log = ln U(1, 16) and dt_bias per value head. Even heads: dt_bias ~ U(0.5, 2), a fast decay
/// (g ≈ −1.5 … −25 per token: the state is forgotten within a few tokens). Odd heads: the Mamba
/// initialisation, dt_bias = softplus⁻¹(dt) with dt log-uniform in [1e-3, 0.1], a slow decay that
/// carries the state across chunks (without it the inter-chunk path would hardly be tested).
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

fn rule_inputs(rng: &mut Rng, dims: &GdnDims, t: usize) -> RuleInputs {
    let hv = dims.num_v_heads;
    let mut qkv = rng.normals(t * dims.conv_dim(), 1.0);
    normalize_qk(&mut qkv, dims);
    let a = rng.normals(t * hv, 1.0);
    let b = rng.normals(t * hv, 2.0);
    let (a_log, dt_bias) = gate_params(rng, hv);
    let (mut g, mut beta) = (vec![0f32; t * hv], vec![0f32; t * hv]);
    gates(&a, &b, &a_log, &dt_bias, &mut g, &mut beta);
    RuleInputs { qkv, g, beta }
}

type Rule = fn(&[f32], &[f32], &[f32], &mut [f32], &GdnDims, &mut [f32]);
type RuleWith = fn(Isa, &[f32], &[f32], &[f32], &mut [f32], &GdnDims, &mut [f32]);

/// Runs a rule on the inputs from `state0`; returns (out [T, Hv, Dv], final state).
fn run_rule(rule: Rule, inp: &RuleInputs, state0: &[f32], dims: &GdnDims) -> (Vec<f32>, Vec<f32>) {
    let t = inp.g.len() / dims.num_v_heads;
    let mut state = state0.to_vec();
    let mut out = vec![f32::NAN; t * dims.value_dim()];
    rule(&inp.qkv, &inp.g, &inp.beta, &mut state, dims, &mut out);
    (out, state)
}

// ---------------------------------------------------------------------------------------------
// Every compilation of the rule loops (AVX2 where the CPU has it, portable) gives the same bits.

#[test]
fn rule_compilations_agree_bit_for_bit() {
    let mut rng = Rng::new(12);
    let isas = Isa::available();
    for dims in &CONFIGS {
        for t in [1, 7, 64, 100] {
            let inp = rule_inputs(&mut rng, dims, t);
            let state0 = rng.normals(dims.state_len(), 0.5);
            for (name, rule) in [
                ("recurrent", delta_rule_recurrent_with as RuleWith),
                ("chunked", delta_rule_chunked_with),
            ] {
                let run = |isa: Isa| {
                    let mut state = state0.clone();
                    let mut out = vec![f32::NAN; t * dims.value_dim()];
                    rule(isa, &inp.qkv, &inp.g, &inp.beta, &mut state, dims, &mut out);
                    (out, state)
                };
                let (out0, st0) = run(isas[0]);
                assert!(out0.iter().chain(&st0).all(|v| v.is_finite()) && max_abs(&out0) > 0.0);
                for &isa in &isas[1..] {
                    let (out, st) = run(isa);
                    let same = |a: &[f32], b: &[f32]| a.iter().zip(b).all(|(x, y)| x.to_bits() == y.to_bits());
                    assert!(same(&out, &out0), "{name} {dims:?} T={t}: {isa:?} output differs from portable");
                    assert!(same(&st, &st0), "{name} {dims:?} T={t}: {isa:?} state differs from portable");
                }
            }
        }
    }
}

// ---------------------------------------------------------------------------------------------
// Chunked against recurrent.

fn chunked_matches_recurrent_on(dims: &GdnDims, inp: &RuleInputs, state0: &[f32], what: &str) {
    let (out_r, st_r) = run_rule(delta_rule_recurrent, inp, state0, dims);
    let (out_c, st_c) = run_rule(delta_rule_chunked, inp, state0, dims);
    assert_close(&format!("{what}: out"), &out_c, &out_r, EPS_RULE);
    assert_close(&format!("{what}: state"), &st_c, &st_r, EPS_RULE);
}

#[test]
fn chunked_matches_recurrent() {
    let mut rng = Rng::new(1);
    for dims in &CONFIGS {
        for t in [1, 5, 63, 64, 65, 130, 200] {
            let inp = rule_inputs(&mut rng, dims, t);
            let zero = vec![0f32; dims.state_len()];
            chunked_matches_recurrent_on(dims, &inp, &zero, &format!("{dims:?} T={t} zero state"));
            let state0 = rng.normals(dims.state_len(), 0.5);
            chunked_matches_recurrent_on(
                dims,
                &inp,
                &state0,
                &format!("{dims:?} T={t} random state"),
            );
            // The initial state must matter to the outputs, or the case above tests nothing more.
            let (out0, _) = run_rule(delta_rule_recurrent, &inp, &zero, dims);
            let (out1, _) = run_rule(delta_rule_recurrent, &inp, &state0, dims);
            assert!(
                max_abs_diff(&out0, &out1) > 1e-2 * max_abs(&out1),
                "T={t}: the initial state does not matter"
            );
        }
    }
}

/// Strong decay (g down to about −100 per token: within-chunk exp(Γ) underflows to 0), almost no
/// decay (g ≈ −1e-6: the state keeps everything over 200 tokens), and a slow decay broken by a few
/// huge drops.
#[test]
fn chunked_matches_recurrent_extreme_decays() {
    let mut rng = Rng::new(2);
    let dims = &CONFIGS[1];
    let hv = dims.num_v_heads;
    let t = 200;
    for (a_log_value, a_mean, what) in [
        (16f32.ln(), 3.0, "strong decay"),
        (-10.0, -5.0, "weak decay"),
    ] {
        let mut inp = rule_inputs(&mut rng, dims, t);
        let a: Vec<f32> = (0..t * hv).map(|_| a_mean + rng.normal(1.0)).collect();
        let b = rng.normals(t * hv, 2.0);
        let (_, dt_bias) = gate_params(&mut rng, hv);
        gates(
            &a,
            &b,
            &vec![a_log_value; hv],
            &dt_bias,
            &mut inp.g,
            &mut inp.beta,
        );
        let state0 = rng.normals(dims.state_len(), 0.5);
        chunked_matches_recurrent_on(dims, &inp, &state0, what);
    }
    // Slow decay with a few huge drops (g = −3000) inside chunks: exp(Γ_i − Γ_j) must not be
    // formed from differences of large cumulative sums.
    let mut inp = rule_inputs(&mut rng, dims, t);
    for (i, g) in inp.g.iter_mut().enumerate() {
        *g = if (i / hv) % 50 == 7 {
            -3000.0
        } else {
            -0.01 * rng.range(0.0, 1.0)
        };
    }
    let state0 = rng.normals(dims.state_len(), 0.5);
    chunked_matches_recurrent_on(dims, &inp, &state0, "huge drops");
}

// ---------------------------------------------------------------------------------------------
// Splitting a sequence with carried state.

/// The rows lo..hi of every tensor of the inputs.
fn slice_inputs(inp: &RuleInputs, dims: &GdnDims, lo: usize, hi: usize) -> RuleInputs {
    let (c, hv) = (dims.conv_dim(), dims.num_v_heads);
    RuleInputs {
        qkv: inp.qkv[lo * c..hi * c].to_vec(),
        g: inp.g[lo * hv..hi * hv].to_vec(),
        beta: inp.beta[lo * hv..hi * hv].to_vec(),
    }
}

#[test]
fn split_sequence_equals_whole_rule() {
    let mut rng = Rng::new(3);
    for dims in &CONFIGS {
        let pieces = [37, 64, 29];
        let t: usize = pieces.iter().sum();
        let inp = rule_inputs(&mut rng, dims, t);
        let state0 = rng.normals(dims.state_len(), 0.5);
        for (rule, name) in [
            (delta_rule_recurrent as Rule, "recurrent"),
            (delta_rule_chunked as Rule, "chunked"),
        ] {
            let (out_whole, st_whole) = run_rule(rule, &inp, &state0, dims);
            let mut state = state0.clone();
            let mut out = Vec::new();
            let mut lo = 0;
            for n in pieces {
                let (o, s) = run_rule(rule, &slice_inputs(&inp, dims, lo, lo + n), &state, dims);
                out.extend_from_slice(&o);
                state = s;
                lo += n;
            }
            assert_close(&format!("{name} split: out"), &out, &out_whole, EPS_RULE);
            assert_close(&format!("{name} split: state"), &state, &st_whole, EPS_RULE);
        }
    }
}

#[test]
fn split_sequence_equals_whole_conv() {
    let mut rng = Rng::new(4);
    let dims = &CONFIGS[1];
    let c = dims.conv_dim();
    let k = dims.conv_kernel;
    // Pieces of 1 and 2 tokens (< K-1) exercise the partial shift of the conv state.
    let pieces = [37, 1, 2, 61, 29];
    let t: usize = pieces.iter().sum();
    let x = rng.normals(t * c, 1.0);
    let weight = rng.normals(c * k, 0.5);
    let state0 = rng.normals(dims.conv_state_len(), 1.0);

    let mut st_whole = state0.clone();
    let mut out_whole = vec![0f32; t * c];
    causal_conv1d_silu(&x, &weight, &mut st_whole, dims, &mut out_whole);
    // The final state is the last K-1 raw input rows.
    assert_eq!(st_whole, x[(t - (k - 1)) * c..]);

    let mut state = state0.clone();
    let mut out = Vec::new();
    let mut lo = 0;
    for n in pieces {
        let mut o = vec![0f32; n * c];
        causal_conv1d_silu(&x[lo * c..(lo + n) * c], &weight, &mut state, dims, &mut o);
        out.extend_from_slice(&o);
        lo += n;
    }
    assert_eq!(out, out_whole, "conv split: out");
    assert_eq!(state, st_whole, "conv split: state");
}

// ---------------------------------------------------------------------------------------------
// Hand-computed tiny cases.

/// Hk=1, Hv=2, Dk=Dv=2, T=2, from a nonzero state. Per token and head: S ← e^g S; kv = Sᵀk;
/// δ = β(v − kv); S ← S + k ⊗ δ; o = Sᵀq on the updated S. Here q = k each token, so reading
/// before the update, or decaying after the delta, would give other numbers.
///
/// Token 0: q = k = (1,0); v0 = (1,2), v1 = (3,4); e^g = 0.5 and β = 0.5 for both heads.
///   head 0: S = I → 0.5 I; kv = (0.5, 0); δ = 0.5·((1,2) − (0.5,0)) = (0.25, 1);
///           S = [[0.75, 1], [0, 0.5]]; o = row 0 = (0.75, 1).
///   head 1: S = [[2,0],[0,0]] → [[1,0],[0,0]]; kv = (1, 0); δ = 0.5·((3,4) − (1,0)) = (1, 2);
///           S = [[2, 2], [0, 0]]; o = (2, 2).
/// Token 1: q = k = (0,1); v0 = (2,0), v1 = (0,2); head 0: e^g = 1, β = 1; head 1: e^g = 0.25, β = 0.5.
///   head 0: kv = row 1 = (0, 0.5); δ = (2,0) − (0,0.5) = (2, −0.5); S = [[0.75, 1], [2, 0]]; o = (2, 0).
///   head 1: S → [[0.5, 0.5], [0, 0]]; kv = (0, 0); δ = 0.5·(0, 2) = (0, 1); S = [[0.5, 0.5], [0, 1]];
///           o = (0, 1).
#[test]
fn recurrence_hand_computed() {
    let dims = GdnDims {
        num_k_heads: 1,
        num_v_heads: 2,
        head_k_dim: 2,
        head_v_dim: 2,
        conv_kernel: 4,
    };
    // qkv rows: q(2) | k(2) | v head 0 (2) | v head 1 (2).
    let qkv = [
        1.0, 0.0, 1.0, 0.0, 1.0, 2.0, 3.0, 4.0, //
        0.0, 1.0, 0.0, 1.0, 2.0, 0.0, 0.0, 2.0,
    ];
    let g = [0.5f32.ln(), 0.5f32.ln(), 0.0, 0.25f32.ln()];
    let beta = [0.5, 0.5, 1.0, 0.5];
    // state [Hv, Dk, Dv]: head 0 = I, head 1 = [[2,0],[0,0]].
    let state0 = [1.0, 0.0, 0.0, 1.0, 2.0, 0.0, 0.0, 0.0];
    let want_out = [0.75, 1.0, 2.0, 2.0, 2.0, 0.0, 0.0, 1.0];
    let want_state = [0.75, 1.0, 2.0, 0.0, 0.5, 0.5, 0.0, 1.0];
    let inp = RuleInputs {
        qkv: qkv.to_vec(),
        g: g.to_vec(),
        beta: beta.to_vec(),
    };
    for (rule, name) in [
        (delta_rule_recurrent as Rule, "recurrent"),
        (delta_rule_chunked as Rule, "chunked"),
    ] {
        let (out, state) = run_rule(rule, &inp, &state0, &dims);
        assert!(
            max_abs_diff(&out, &want_out) < 1e-6,
            "{name}: out {out:?}, want {want_out:?}"
        );
        assert!(
            max_abs_diff(&state, &want_state) < 1e-6,
            "{name}: state {state:?}, want {want_state:?}"
        );
    }
}

/// One channel each of q, k, v (Dk = Dv = 1), K = 4, T = 2 then T = 1, from a nonzero state.
/// xin = concat(state rows s0, s1, s2, x rows); out[t] = silu(Σ_j w[j]·xin[t+j]); tap 3 = current.
#[test]
fn conv_hand_computed() {
    let dims = GdnDims {
        num_k_heads: 1,
        num_v_heads: 1,
        head_k_dim: 1,
        head_v_dim: 1,
        conv_kernel: 4,
    };
    let silu = |x: f32| x / (1.0 + (-x).exp());
    // weight [C=3, K=4]: ch 0 takes only the oldest tap, ch 1 only the current token, ch 2 all.
    let weight = [1.0, 0.0, 0.0, 0.0, 0.0, 0.0, 0.0, 1.0, 0.5, -1.0, 2.0, 1.0];
    // state [3, C]: rows s0, s1, s2.
    let mut state = vec![0.1, 1.0, 1.0, 0.2, 2.0, 2.0, 0.3, 3.0, 3.0];
    // x [2, C]: rows x0, x1.
    let x = [4.0, 0.7, 4.0, 5.0, -0.6, 5.0];
    let mut out = [0f32; 6];
    causal_conv1d_silu(&x, &weight, &mut state, &dims, &mut out);
    let want = [
        silu(0.1),
        silu(0.7),
        silu(0.5 * 1.0 - 2.0 + 2.0 * 3.0 + 4.0), // t=0: 8.5
        silu(0.2),
        silu(-0.6),
        silu(0.5 * 2.0 - 3.0 + 2.0 * 4.0 + 5.0), // t=1: 11
    ];
    assert!(
        max_abs_diff(&out, &want) < 1e-6,
        "out {out:?}, want {want:?}"
    );
    // New state = rows s2, x0, x1.
    assert_eq!(state, [0.3, 3.0, 3.0, 4.0, 0.7, 4.0, 5.0, -0.6, 5.0]);

    // One more token: the state shifts by one row (x0, x1, x2).
    let x2 = [-1.0, 0.25, 6.0];
    let mut out = [0f32; 3];
    causal_conv1d_silu(&x2, &weight, &mut state, &dims, &mut out);
    let want = [
        silu(0.3),
        silu(0.25),
        silu(0.5 * 3.0 - 4.0 + 2.0 * 5.0 + 6.0),
    ];
    assert!(
        max_abs_diff(&out, &want) < 1e-6,
        "out {out:?}, want {want:?}"
    );
    assert_eq!(state, [4.0, 0.7, 4.0, 5.0, -0.6, 5.0, -1.0, 0.25, 6.0]);
}

// ---------------------------------------------------------------------------------------------
// The value-head → key-head mapping.

/// Value head j must equal a single-head run on key head j / (Hv/Hk) and value head j.
#[test]
fn head_mapping_matches_single_head_runs() {
    let mut rng = Rng::new(5);
    let dims = GdnDims {
        num_k_heads: 2,
        num_v_heads: 6,
        head_k_dim: 8,
        head_v_dim: 12,
        conv_kernel: 4,
    };
    let one = GdnDims {
        num_k_heads: 1,
        num_v_heads: 1,
        ..dims
    };
    let (t, hv, dk, dv, c, kd) = (70, 6, 8, 12, dims.conv_dim(), dims.key_dim());
    let inp = rule_inputs(&mut rng, &dims, t);
    let state0 = rng.normals(dims.state_len(), 0.5);
    for (rule, name) in [
        (delta_rule_recurrent as Rule, "recurrent"),
        (delta_rule_chunked as Rule, "chunked"),
    ] {
        let (out, state) = run_rule(rule, &inp, &state0, &dims);
        for j in 0..hv {
            let kh = j / 3;
            let mut single = RuleInputs {
                qkv: Vec::new(),
                g: Vec::new(),
                beta: Vec::new(),
            };
            for tt in 0..t {
                let row = &inp.qkv[tt * c..(tt + 1) * c];
                single.qkv.extend_from_slice(&row[kh * dk..(kh + 1) * dk]);
                single
                    .qkv
                    .extend_from_slice(&row[kd + kh * dk..kd + (kh + 1) * dk]);
                single
                    .qkv
                    .extend_from_slice(&row[2 * kd + j * dv..2 * kd + (j + 1) * dv]);
                single.g.push(inp.g[tt * hv + j]);
                single.beta.push(inp.beta[tt * hv + j]);
            }
            let (o1, s1) = run_rule(rule, &single, &state0[j * dk * dv..(j + 1) * dk * dv], &one);
            let oj: Vec<f32> = (0..t)
                .flat_map(|tt| out[(tt * hv + j) * dv..(tt * hv + j + 1) * dv].to_vec())
                .collect();
            assert_close(&format!("{name} head {j}: out"), &oj, &o1, EPS_RULE);
            assert_close(
                &format!("{name} head {j}: state"),
                &state[j * dk * dv..(j + 1) * dk * dv],
                &s1,
                EPS_RULE,
            );
        }
    }
}

/// Moves value head j's inputs (v, g, beta, state) to head perm[j].
fn permute_value_heads(
    inp: &RuleInputs,
    state: &[f32],
    dims: &GdnDims,
    perm: &[usize],
) -> (RuleInputs, Vec<f32>) {
    let (hv, dk, dv, c, kd) = (
        dims.num_v_heads,
        dims.head_k_dim,
        dims.head_v_dim,
        dims.conv_dim(),
        dims.key_dim(),
    );
    let t = inp.g.len() / hv;
    let mut p = RuleInputs {
        qkv: inp.qkv.clone(),
        g: inp.g.clone(),
        beta: inp.beta.clone(),
    };
    let mut st = state.to_vec();
    for (j, &pj) in perm.iter().enumerate() {
        for tt in 0..t {
            let (src, dst) = (tt * c + 2 * kd + j * dv, tt * c + 2 * kd + pj * dv);
            p.qkv[dst..dst + dv].copy_from_slice(&inp.qkv[src..src + dv]);
            p.g[tt * hv + pj] = inp.g[tt * hv + j];
            p.beta[tt * hv + pj] = inp.beta[tt * hv + j];
        }
        st[pj * dk * dv..(pj + 1) * dk * dv]
            .copy_from_slice(&state[j * dk * dv..(j + 1) * dk * dv]);
    }
    (p, st)
}

/// With Hk = 2, Hv = 4 the value heads {0,1} read key head 0 and {2,3} key head 1. Swapping value
/// heads 0 ↔ 1 keeps every head on its key head, so the output is permuted the same way; swapping
/// 0 ↔ 2 keeps j % Hk (invisible to a tiled mapping) but moves heads across key heads, so it must
/// change the output. A tiled (j % Hk) implementation fails both halves.
#[test]
fn head_mapping_is_repeat_interleave_not_tiled() {
    let mut rng = Rng::new(6);
    let dims = CONFIGS[1];
    let (hv, dv) = (dims.num_v_heads, dims.head_v_dim);
    let t = 90;
    let inp = rule_inputs(&mut rng, &dims, t);
    let state0 = rng.normals(dims.state_len(), 0.5);
    for (rule, name) in [
        (delta_rule_recurrent as Rule, "recurrent"),
        (delta_rule_chunked as Rule, "chunked"),
    ] {
        let (out, _) = run_rule(rule, &inp, &state0, &dims);
        // out of the permuted run, gathered back to the original head order.
        let unpermuted = |perm: &[usize]| {
            let (p, st) = permute_value_heads(&inp, &state0, &dims, perm);
            let (o, _) = run_rule(rule, &p, &st, &dims);
            let mut back = vec![0f32; o.len()];
            for tt in 0..t {
                for (j, &pj) in perm.iter().enumerate() {
                    back[(tt * hv + j) * dv..(tt * hv + j + 1) * dv]
                        .copy_from_slice(&o[(tt * hv + pj) * dv..(tt * hv + pj + 1) * dv]);
                }
            }
            back
        };
        let same_key_heads = unpermuted(&[1, 0, 2, 3]);
        assert_close(
            &format!("{name}: swap 0<->1"),
            &same_key_heads,
            &out,
            EPS_RULE,
        );
        let across_key_heads = unpermuted(&[2, 1, 0, 3]);
        let diff = max_abs_diff(&across_key_heads, &out);
        assert!(
            diff > 0.1 * max_abs(&out),
            "{name}: swapping value heads 0<->2 did not change the output ({diff:.3e})"
        );
    }
}

// ---------------------------------------------------------------------------------------------
// Norms and gates.

#[test]
fn gated_rmsnorm_matches_formula() {
    let mut rng = Rng::new(7);
    let dims = CONFIGS[1];
    let (t, hv, dv) = (9, dims.num_v_heads, dims.head_v_dim);
    let x = rng.normals(t * hv * dv, 0.3);
    let z = rng.normals(t * hv * dv, 2.0);
    let w: Vec<f32> = (0..dv).map(|_| rng.range(0.5, 1.5)).collect();
    let eps = 1e-6;
    let mut y = vec![0f32; x.len()];
    gated_rmsnorm(&x, &z, &w, eps, &dims, &mut y);
    for row in 0..t * hv {
        let xs = &x[row * dv..(row + 1) * dv];
        let ms = xs.iter().map(|&v| (v as f64).powi(2)).sum::<f64>() / dv as f64;
        let r = 1.0 / (ms + eps as f64).sqrt();
        for i in 0..dv {
            let zi = z[row * dv + i] as f64;
            let want = w[i] as f64 * xs[i] as f64 * r * zi / (1.0 + (-zi).exp());
            let got = y[row * dv + i] as f64;
            assert!(
                (got - want).abs() <= 1e-5 * (1.0 + want.abs()),
                "row {row} i {i}: {got} vs {want}"
            );
        }
    }
}

#[test]
fn normalize_qk_norms() {
    let mut rng = Rng::new(8);
    for dims in &CONFIGS {
        let (t, c, dk, kd) = (7, dims.conv_dim(), dims.head_k_dim, dims.key_dim());
        let raw = rng.normals(t * c, 1.0);
        let mut qkv = raw.clone();
        normalize_qk(&mut qkv, dims);
        for tt in 0..t {
            let row = &qkv[tt * c..(tt + 1) * c];
            for (h, head) in row[..2 * kd].chunks_exact(dk).enumerate() {
                let norm = head.iter().map(|&v| (v as f64).powi(2)).sum::<f64>().sqrt();
                let want = if h < dims.num_k_heads {
                    1.0 / (dk as f64).sqrt()
                } else {
                    1.0
                };
                assert!(
                    (norm - want).abs() < 1e-5,
                    "token {tt} head {h}: norm {norm}, want {want}"
                );
                // Same direction as the input.
                let raw_head = &raw[tt * c + h * dk..tt * c + (h + 1) * dk];
                let cos = head
                    .iter()
                    .zip(raw_head)
                    .map(|(&a, &b)| a as f64 * b as f64)
                    .sum::<f64>()
                    / (norm
                        * raw_head
                            .iter()
                            .map(|&v| (v as f64).powi(2))
                            .sum::<f64>()
                            .sqrt());
                assert!(
                    (cos - 1.0).abs() < 1e-5,
                    "token {tt} head {h}: direction changed"
                );
            }
            // v untouched.
            assert_eq!(row[2 * kd..], raw[tt * c + 2 * kd..(tt + 1) * c]);
        }
    }
}

#[test]
fn gates_match_formula() {
    let mut rng = Rng::new(9);
    let (t, hv) = (11, 4);
    let mut a = rng.normals(t * hv, 1.0);
    a[3] = 25.0; // a + dt_bias > 20: softplus is the identity
    a[5] = -30.0; // softplus ≈ e^x
    let b = rng.normals(t * hv, 2.0);
    let (a_log, dt_bias) = gate_params(&mut rng, hv);
    let (mut g, mut beta) = (vec![0f32; t * hv], vec![0f32; t * hv]);
    gates(&a, &b, &a_log, &dt_bias, &mut g, &mut beta);
    for i in 0..t * hv {
        let h = i % hv;
        let x = a[i] as f64 + dt_bias[h] as f64;
        let sp = if x > 20.0 { x } else { x.exp().ln_1p() };
        let want_g = -(a_log[h] as f64).exp() * sp;
        let want_beta = 1.0 / (1.0 + (-(b[i] as f64)).exp());
        assert!(g[i] <= 0.0 && beta[i] > 0.0 && beta[i] < 1.0);
        assert!(
            (g[i] as f64 - want_g).abs() <= 1e-5 * (1.0 + want_g.abs()),
            "g[{i}] {} vs {want_g}",
            g[i]
        );
        assert!(
            (beta[i] as f64 - want_beta).abs() <= 1e-6,
            "beta[{i}] {} vs {want_beta}",
            beta[i]
        );
    }
}

// ---------------------------------------------------------------------------------------------
// Timing at the real sizes (run explicitly, in release).

#[test]
#[ignore = "timing; run with --release --ignored --nocapture"]
fn timing_real_sizes() {
    // Qwen3.6-35B-A3B, 4096 tokens; the demo model (qwen3.6-tiny), one 512-token prefill chunk.
    timing(GdnDims { num_k_heads: 16, num_v_heads: 32, head_k_dim: 128, head_v_dim: 128, conv_kernel: 4 }, 4096);
    timing(GdnDims { num_k_heads: 4, num_v_heads: 8, head_k_dim: 128, head_v_dim: 128, conv_kernel: 4 }, 512);
}

fn timing(dims: GdnDims, t: usize) {
    let mut rng = Rng::new(10);
    let inp = rule_inputs(&mut rng, &dims, t);
    let state0 = rng.normals(dims.state_len(), 0.5);
    let mut results = Vec::new();
    for isa in Isa::available() {
        for (rule, name) in [
            (delta_rule_chunked_with as RuleWith, "chunked"),
            (delta_rule_recurrent_with as RuleWith, "recurrent"),
        ] {
            // The fastest of three runs (the machine may be shared).
            let mut secs = f64::INFINITY;
            let (mut state, mut out) = (Vec::new(), Vec::new());
            for _ in 0..3 {
                state = state0.clone();
                out = vec![f32::NAN; t * dims.value_dim()];
                let start = std::time::Instant::now();
                rule(isa, &inp.qkv, &inp.g, &inp.beta, &mut state, &dims, &mut out);
                secs = secs.min(start.elapsed().as_secs_f64());
            }
            println!(
                "{name:>9} {isa:?}: T={t} Hk={} Hv={} Dk=Dv=128 on {} threads: {secs:.4} s ({:.1} tok/s)",
                dims.num_k_heads,
                dims.num_v_heads,
                rayon::current_num_threads(),
                t as f64 / secs
            );
            results.push((out, state));
        }
    }
    // chunked against recurrent, for every compilation.
    for pair in results.chunks_exact(2) {
        assert_close("timing run: out", &pair[0].0, &pair[1].0, EPS_RULE);
        assert_close("timing run: state", &pair[0].1, &pair[1].1, EPS_RULE);
    }
}

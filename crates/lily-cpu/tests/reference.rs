//! Whole-model parity of the CPU backend against the references stored by
//! `tools/make_fixtures.py`: MLX-LM (float32) on the MLX 4-bit checkpoint, and transformers (float32)
//! on the bf16 checkpoint, per layer and per position. Also: a bf16 checkpoint quantised by lily at
//! load is byte-for-byte what `mlx_lm.convert` wrote, and the tolerances used here do catch the
//! classic bugs (a missing +1 on the norms, a wrong GDN head mapping, the wrong q_proj layout).

mod common;

use std::sync::Arc;

use common::*;
use lily_cpu::{CpuModel, Trace};
use lily_model::affine::AffineParams;
use lily_model::buf::{Buf, FloatBuf};
use lily_model::weights::{HfWeights, Matrix, Mixer, Storage};
use lily_model::{LoadOptions, Logits, ModelConfig, ModelWeights};

/// Per-layer hidden states: max |Δ| / rms within this (f32 vs f32 differs by rounding only).
const HIDDEN_TOL: f64 = 2e-4;
/// Relative perplexity difference: 100× tighter than the 0.1% the project promises.
const PPL_TOL: f64 = 1e-5;

struct Metrics {
    worst_layer: f64,
    final_norm: f64,
    ppl_rel: f64,
    max_logprob_diff: f64,
    agreement: f64,
}

fn run(w: ModelWeights, tokens: &[u32]) -> (Trace, Vec<f32>) {
    let vocab = w.config.vocab_size;
    let m = CpuModel::new(Arc::new(w));
    let mut state = m.fresh_state();
    let mut trace = Trace::default();
    let logits = m.forward_traced(&mut state, tokens, Logits::All, Some(&mut trace)).unwrap();
    assert_eq!(logits.len(), tokens.len() * vocab);
    (trace, logits)
}

fn compare(name: &str, which: &str, w: ModelWeights) -> Metrics {
    let tokens = tokens(name);
    let vocab = w.config.vocab_size;
    let (trace, logits) = run(w, &tokens);
    let worst_layer = trace
        .layers
        .iter()
        .enumerate()
        .map(|(l, h)| rel_err(h, &reference_tensor(name, which, &format!("hidden.{l}"))))
        .fold(0.0, f64::max);
    let final_norm = rel_err(&trace.final_norm, &reference_tensor(name, which, "final"));
    let (ref_ppl, ref_lp, ref_am) = reference(name, which);
    let n = tokens.len() - 1;
    assert_eq!(ref_lp.len(), n);
    let (mut lps, mut ams) = (Vec::new(), Vec::new());
    for i in 0..n {
        let row = &logits[i * vocab..(i + 1) * vocab];
        let m = row.iter().copied().fold(f32::NEG_INFINITY, f32::max);
        let lse = row.iter().map(|&v| ((v - m) as f64).exp()).sum::<f64>().ln() + m as f64;
        lps.push(row[tokens[i + 1] as usize] as f64 - lse);
        ams.push(row.iter().enumerate().fold((0, f32::NEG_INFINITY), |b, (j, &v)| if v > b.1 { (j, v) } else { b }).0 as u32);
    }
    let ppl = (-lps.iter().sum::<f64>() / n as f64).exp();
    Metrics {
        worst_layer,
        final_norm,
        ppl_rel: (ppl - ref_ppl).abs() / ref_ppl,
        max_logprob_diff: lps.iter().zip(&ref_lp).map(|(a, b)| (a - b).abs()).fold(0.0, f64::max),
        agreement: agreement(&ams, &ref_am),
    }
}

fn assert_close(name: &str, which: &str, m: &Metrics) {
    eprintln!(
        "{name} vs {which}: worst layer {:.2e}, final {:.2e}, ppl {:.2e} rel, max Δlogprob {:.2e}, argmax {:.1}%",
        m.worst_layer,
        m.final_norm,
        m.ppl_rel,
        m.max_logprob_diff,
        100.0 * m.agreement
    );
    assert!(m.worst_layer < HIDDEN_TOL, "{name}/{which}: hidden states differ by {:.3e}", m.worst_layer);
    assert!(m.final_norm < HIDDEN_TOL, "{name}/{which}: final hidden differs by {:.3e}", m.final_norm);
    assert!(m.ppl_rel < PPL_TOL, "{name}/{which}: perplexity differs by {:.3e}", m.ppl_rel);
    assert!(m.agreement >= 0.98, "{name}/{which}: argmax agreement {:.3}", m.agreement);
}

fn load(name: &str, sub: &str, opts: LoadOptions) -> ModelWeights {
    ModelWeights::load(&fixtures_dir().join(name).join(sub), &opts).unwrap()
}

#[test]
fn cpu_matches_mlx_lm_on_mlx_checkpoints() {
    for name in fixture_names() {
        let w = load(&name, "mlx", LoadOptions::default());
        assert_close(&name, "mlx", &compare(&name, "mlx", w));
    }
}

#[test]
fn cpu_matches_transformers_on_bf16_checkpoints() {
    for name in fixture_names() {
        let w = load(&name, "hf", LoadOptions { hf: HfWeights::KeepBf16 });
        assert_close(&name, "hf", &compare(&name, "hf", w));
    }
}

/// Every matrix of `a` and `b`, by a readable name.
fn matrices(w: &ModelWeights) -> Vec<(String, &Matrix)> {
    let mut v = vec![("embed".to_string(), &w.embed), ("lm_head".to_string(), w.lm_head())];
    for (l, layer) in w.layers.iter().enumerate() {
        match &layer.mixer {
            Mixer::Linear(g) => {
                for (n, m) in [("in_proj_qkv", &g.in_proj_qkv), ("in_proj_z", &g.in_proj_z), ("in_proj_b", &g.in_proj_b), ("in_proj_a", &g.in_proj_a), ("out_proj", &g.out_proj)] {
                    v.push((format!("{l}.{n}"), m));
                }
            }
            Mixer::Full(a) => {
                for (n, m) in [("q_proj", &a.q_proj), ("k_proj", &a.k_proj), ("v_proj", &a.v_proj), ("o_proj", &a.o_proj)] {
                    v.push((format!("{l}.{n}"), m));
                }
            }
        }
        match &layer.mlp {
            lily_model::weights::Mlp::Moe(m) => {
                for (n, x) in [("router", &m.router), ("gate_proj", &m.gate_proj), ("up_proj", &m.up_proj), ("down_proj", &m.down_proj)] {
                    v.push((format!("{l}.{n}"), x));
                }
                if let Some(s) = &m.shared {
                    for (n, x) in [("shared.gate", &s.gate_proj), ("shared.up", &s.up_proj), ("shared.down", &s.down_proj)] {
                        v.push((format!("{l}.{n}"), x));
                    }
                }
                if let Some(g) = &m.shared_gate {
                    v.push((format!("{l}.shared_expert_gate"), g));
                }
            }
            lily_model::weights::Mlp::Dense(d) => {
                for (n, x) in [("mlp.gate", &d.gate_proj), ("mlp.up", &d.up_proj), ("mlp.down", &d.down_proj)] {
                    v.push((format!("{l}.{n}"), x));
                }
            }
        }
    }
    v
}

fn bits_of(b: &FloatBuf) -> Vec<u16> {
    match b {
        FloatBuf::Bf16(x) => x.iter().map(|v| v.to_bits()).collect(),
        other => panic!("expected bf16 scales, got {}", other.dtype_name()),
    }
}

#[test]
fn bf16_quantised_at_load_is_byte_identical_to_mlx_convert() {
    for name in fixture_names() {
        let mlx = load(&name, "mlx", LoadOptions::default());
        let q = mlx.config.quantization.clone().expect("the MLX fixture has a quantization block");
        let params = AffineParams { bits: q.bits, group_size: q.group_size };
        let ours = load(&name, "hf", LoadOptions { hf: HfWeights::Quantize(params) });
        let (a, b) = (matrices(&ours), matrices(&mlx));
        assert_eq!(a.len(), b.len());
        let mut quantised = 0;
        for ((na, ma), (_, mb)) in a.iter().zip(&b) {
            assert_eq!((ma.count, ma.rows, ma.cols), (mb.count, mb.rows, mb.cols), "{name}: {na}");
            match (&ma.storage, &mb.storage) {
                (Storage::Affine { params: pa, packed: wa, scales: sa, biases: ba }, Storage::Affine { params: pb, packed: wb, scales: sb, biases: bb }) => {
                    assert_eq!(pa, pb, "{name}: {na} quantisation parameters");
                    assert!(wa[..] == wb[..], "{name}: {na} packed weights differ");
                    assert_eq!(bits_of(sa), bits_of(sb), "{name}: {na} scales differ");
                    assert_eq!(bits_of(ba), bits_of(bb), "{name}: {na} biases differ");
                    quantised += 1;
                }
                (Storage::Dense(_), Storage::Dense(_)) => {}
                _ => panic!("{name}: {na} is quantised in one and dense in the other"),
            }
        }
        assert!(quantised > 10, "{name}: only {quantised} quantised matrices compared");
    }
}

// ---- The tolerances catch real bugs -------------------------------------------------------------

/// `m` with its rows reordered: new row r = old row `perm[r]`.
fn permute_rows(m: &Matrix, perm: &[usize]) -> Matrix {
    assert_eq!(m.count, 1);
    assert_eq!(perm.len(), m.rows);
    let floats = |b: &FloatBuf, per_row: usize| {
        let v = b.to_f32_vec();
        FloatBuf::F32(Buf::owned(perm.iter().flat_map(|&r| v[r * per_row..(r + 1) * per_row].to_vec()).collect()))
    };
    let storage = match &m.storage {
        Storage::Dense(d) => Storage::Dense(floats(d, m.cols)),
        Storage::Affine { params, packed, scales, biases } => {
            let words = m.cols * params.bits as usize / 32;
            let groups = m.cols / params.group_size;
            Storage::Affine {
                params: *params,
                packed: Buf::owned(perm.iter().flat_map(|&r| packed[r * words..(r + 1) * words].to_vec()).collect()),
                scales: floats(scales, groups),
                biases: floats(biases, groups),
            }
        }
    };
    Matrix { storage, ..m.clone() }
}

#[test]
fn tolerances_catch_known_bugs() {
    let name = &fixture_names()[0];
    let base = load(name, "mlx", LoadOptions::default());
    let cfg: ModelConfig = base.config.clone();
    let fails = |w: ModelWeights, what: &str| {
        let m = compare(name, "mlx", w);
        eprintln!("{what}: worst layer {:.2e}, ppl {:.2e} rel, argmax {:.1}%", m.worst_layer, m.ppl_rel, 100.0 * m.agreement);
        assert!(m.worst_layer > 20.0 * HIDDEN_TOL && m.ppl_rel > 20.0 * PPL_TOL, "{what} would go unnoticed");
    };

    // A loader that forgets the +1 of the zero-centred norms (or adds it twice).
    for delta in [-1.0f32, 1.0] {
        let mut w = base.clone();
        for l in &mut w.layers {
            l.input_norm.iter_mut().chain(l.post_norm.iter_mut()).for_each(|x| *x += delta);
            if let Mixer::Full(a) = &mut l.mixer {
                a.q_norm.iter_mut().chain(a.k_norm.iter_mut()).for_each(|x| *x += delta);
            }
        }
        w.final_norm.iter_mut().for_each(|x| *x += delta);
        fails(w, &format!("norm offset {delta:+}"));
    }

    // Value heads paired with the wrong key heads (tiled j % Hk instead of j / (Hv/Hk)).
    let (hk, hv, dk, dv) = (cfg.linear_num_key_heads, cfg.linear_num_value_heads, cfg.linear_key_head_dim, cfg.linear_value_head_dim);
    assert!(hv / hk >= 2, "fixture {name} needs Hv/Hk >= 2 for this check");
    let ratio = hv / hk;
    // New value head j holds old head (j % Hk)·ratio + j / Hk: what a tiled reader would pair.
    let head_perm: Vec<usize> = (0..hv).map(|j| (j % hk) * ratio + j / hk).collect();
    let mut w = base.clone();
    for l in &mut w.layers {
        if let Mixer::Linear(g) = &mut l.mixer {
            let vbase = 2 * hk * dk;
            let mut perm: Vec<usize> = (0..vbase).collect();
            perm.extend(head_perm.iter().flat_map(|&h| (0..dv).map(move |i| vbase + h * dv + i)));
            g.in_proj_qkv = permute_rows(&g.in_proj_qkv, &perm);
            let k = cfg.linear_conv_kernel_dim;
            let conv = g.conv1d.clone();
            g.conv1d = perm.iter().flat_map(|&c| conv[c * k..(c + 1) * k].to_vec()).collect();
        }
    }
    fails(w, "GDN head mapping");

    // q_proj read as [all queries | all gates] instead of per head [query | gate].
    if cfg.attn_output_gate {
        let (nh, hd) = (cfg.num_attention_heads, cfg.head_dim);
        let perm: Vec<usize> = (0..nh)
            .flat_map(|h| (0..hd).map(move |i| h * hd + i).chain((0..hd).map(move |i| nh * hd + h * hd + i)))
            .collect();
        let mut w = base.clone();
        for l in &mut w.layers {
            if let Mixer::Full(a) = &mut l.mixer {
                a.q_proj = permute_rows(&a.q_proj, &perm);
            }
        }
        fails(w, "q_proj layout");
    }
}

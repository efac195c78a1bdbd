//! The session state: a prompt processed in chunks, or token by token, or prefilled then decoded,
//! leaves the same state and gives the same logits as one long prefill; a state survives clone and
//! save/load and carries on identically.

mod common;

use std::sync::Arc;

use common::*;
use lily_cpu::{CpuModel, LayerState, State};
use lily_model::{LoadOptions, Logits, ModelWeights};

fn model(name: &str) -> CpuModel {
    let w = ModelWeights::load(&fixtures_dir().join(name).join("mlx"), &LoadOptions::default()).unwrap();
    CpuModel::new(Arc::new(w))
}

/// Runs `tokens` in pieces of the given sizes, collecting every position's logits.
fn run_pieces(m: &CpuModel, tokens: &[u32], sizes: &[usize]) -> (State, Vec<f32>) {
    let mut state = m.fresh_state();
    let mut logits = Vec::new();
    let mut at = 0;
    for &n in sizes.iter().cycle() {
        if at >= tokens.len() {
            break;
        }
        let end = (at + n).min(tokens.len());
        logits.extend(m.forward_traced(&mut state, &tokens[at..end], Logits::All, None).unwrap());
        at = end;
    }
    (state, logits)
}

fn assert_states_close(a: &State, b: &State, tol: f64, what: &str) {
    assert_eq!(a.pos, b.pos, "{what}: positions");
    for (l, (x, y)) in a.layers.iter().zip(&b.layers).enumerate() {
        match (x, y) {
            (LayerState::Linear { conv: c1, ssm: s1 }, LayerState::Linear { conv: c2, ssm: s2 }) => {
                assert!(rel_err(c1, c2) < tol, "{what}: layer {l} conv state {:.2e}", rel_err(c1, c2));
                assert!(rel_err(s1, s2) < tol, "{what}: layer {l} recurrent state {:.2e}", rel_err(s1, s2));
            }
            (LayerState::Full(k1), LayerState::Full(k2)) => {
                assert!(rel_err(&k1.k, &k2.k) < tol, "{what}: layer {l} keys {:.2e}", rel_err(&k1.k, &k2.k));
                assert!(rel_err(&k1.v, &k2.v) < tol, "{what}: layer {l} values {:.2e}", rel_err(&k1.v, &k2.v));
            }
            _ => panic!("{what}: layer {l} kinds differ"),
        }
    }
}

const TOL: f64 = 1e-4;

#[test]
fn chunked_prefill_equals_step_by_step_and_one_long_prefill() {
    for name in fixture_names() {
        let m = model(&name);
        let tokens = &tokens(&name)[..150];
        let (whole, lw) = run_pieces(&m, tokens, &[tokens.len()]);
        // Chunks that use the chunked delta rule, including a ragged tail.
        let (chunked, lc) = run_pieces(&m, tokens, &[64, 40, 17]);
        // One token at a time: the recurrent delta rule, as decode runs it.
        let (stepped, ls) = run_pieces(&m, tokens, &[1]);
        assert_states_close(&chunked, &whole, TOL, &format!("{name}: chunks vs whole"));
        assert_states_close(&stepped, &whole, TOL, &format!("{name}: steps vs whole"));
        assert!(rel_err(&lc, &lw) < TOL, "{name}: chunked logits {:.2e}", rel_err(&lc, &lw));
        assert!(rel_err(&ls, &lw) < TOL, "{name}: stepped logits {:.2e}", rel_err(&ls, &lw));
    }
}

#[test]
fn prefill_then_decode_equals_one_prefill() {
    let name = &fixture_names()[0];
    let m = model(name);
    let tokens = &tokens(name)[..120];
    let vocab = m.weights().config.vocab_size;
    let mut state = m.fresh_state();
    m.forward_traced(&mut state, &tokens[..100], Logits::None, None).unwrap();
    let mut decoded = Vec::new();
    for &t in &tokens[100..] {
        decoded.extend(m.forward_traced(&mut state, &[t], Logits::Last, None).unwrap());
    }
    let (_, all) = run_pieces(&m, tokens, &[tokens.len()]);
    assert!(rel_err(&decoded, &all[100 * vocab..]) < TOL);
}

#[test]
fn state_clone_and_save_resume() {
    let name = &fixture_names()[1];
    let m = model(name);
    let tokens = tokens(name);
    let mut state = m.fresh_state();
    m.forward_traced(&mut state, &tokens[..70], Logits::None, None).unwrap();

    let mut bytes = Vec::new();
    state.save(&mut bytes).unwrap();
    let mut restored = State::load(&bytes[..]).unwrap();
    assert_eq!(restored, state);
    let mut cloned = state.clone();

    let a = m.forward_traced(&mut state, &tokens[70..90], Logits::All, None).unwrap();
    let b = m.forward_traced(&mut restored, &tokens[70..90], Logits::All, None).unwrap();
    let c = m.forward_traced(&mut cloned, &tokens[70..90], Logits::All, None).unwrap();
    assert_eq!(a, b, "a saved and reloaded state must continue bit for bit");
    assert_eq!(a, c);

    assert!(State::load(&b"not a state"[..]).is_err());
    assert!(State::load(&bytes[..bytes.len() / 2]).is_err(), "a truncated state must be an error");
}

#[test]
fn bad_tokens_are_errors_not_panics() {
    let name = &fixture_names()[0];
    let m = model(name);
    let vocab = m.weights().config.vocab_size as u32;
    let mut state = m.fresh_state();
    let e = m.forward_traced(&mut state, &[1, vocab], Logits::Last, None).unwrap_err();
    assert!(e.to_string().contains("outside the vocabulary"), "{e}");
    assert_eq!(state.pos, 0, "a rejected call must leave the state untouched");
}

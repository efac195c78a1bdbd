//! A request sizes its session once, before any model work (`Backend::reserve` with the prompt plus
//! the most tokens it may generate), so that no decode step allocates. Checked on the CPU backend
//! through a wrapper that records every call: the reserve comes first and asks for the right reach,
//! and the KV caches never move afterwards (the CPU backend's reserve is real: it sizes the caches'
//! buffers, so a reallocation would show as a new address).

use std::path::PathBuf;
use std::sync::Arc;

use lily_cpu::{CpuModel, LayerState};
use lily_engine::{generate, Flow, GenSpec, PrefixCache};
use lily_model::{Backend, BackendError, LoadOptions, Logits, ModelConfig, ModelWeights};
use lily_sampler::SamplingParams;
use lily_tokenizer::Tokenizer;

fn fixture() -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("../../tests/fixtures/tiny-b/mlx")
}

#[derive(Debug, PartialEq)]
enum Call {
    Reserve { held: usize, positions: usize },
    Forward { held: usize, tokens: usize, kv: Vec<(usize, usize)> },
}

/// The CPU model, recording each call with the addresses and capacities of its KV buffers.
struct Recording {
    inner: CpuModel,
    calls: Vec<Call>,
}

fn kv_buffers(s: &lily_cpu::State) -> Vec<(usize, usize)> {
    s.layers
        .iter()
        .filter_map(|l| match l {
            LayerState::Full(kv) => Some([(kv.k.as_ptr() as usize, kv.k.capacity()), (kv.v.as_ptr() as usize, kv.v.capacity())]),
            _ => None,
        })
        .flatten()
        .collect()
}

impl Backend for Recording {
    type State = lily_cpu::State;
    fn name(&self) -> &'static str {
        "recording-cpu"
    }
    fn config(&self) -> &ModelConfig {
        self.inner.config()
    }
    fn new_state(&self) -> Self::State {
        self.inner.new_state()
    }
    fn state_len(&self, s: &Self::State) -> usize {
        self.inner.state_len(s)
    }
    fn state_bytes(&self, s: &Self::State) -> usize {
        self.inner.state_bytes(s)
    }
    fn prefill_chunk(&self) -> usize {
        32
    }
    fn reserve(&mut self, s: &mut Self::State, positions: usize) -> Result<(), BackendError> {
        self.calls.push(Call::Reserve { held: s.pos, positions });
        self.inner.reserve(s, positions)
    }
    fn forward(&mut self, s: &mut Self::State, tokens: &[u32], logits: Logits) -> Result<Vec<f32>, BackendError> {
        self.calls.push(Call::Forward { held: s.pos, tokens: tokens.len(), kv: kv_buffers(s) });
        self.inner.forward(s, tokens, logits)
    }
}

fn setup() -> (Recording, Tokenizer, Vec<u32>) {
    let dir = fixture();
    let w = Arc::new(ModelWeights::load(&dir, &LoadOptions::default()).unwrap());
    let tok = Tokenizer::from_dir(&dir).unwrap();
    let vocab = tok.vocab_size().min(w.config.vocab_size) as u32;
    let prompt: Vec<u32> = (0..70u32).map(|i| (i * 7919 + 13) % vocab).collect();
    (Recording { inner: CpuModel::new(w), calls: Vec::new() }, tok, prompt)
}

/// Every forward after the reserve sees the same KV buffers, with room for `positions`.
fn assert_no_kv_moves(calls: &[Call], positions: usize, row: usize) {
    let fwd: Vec<&Vec<(usize, usize)>> = calls.iter().filter_map(|c| if let Call::Forward { kv, .. } = c { Some(kv) } else { None }).collect();
    assert!(fwd.len() > 10, "expected a prefill and several decode steps, got {} calls", fwd.len());
    assert!(!fwd[0].is_empty(), "the fixture has attention layers");
    for (i, kv) in fwd.iter().enumerate() {
        assert_eq!(*kv, fwd[0], "forward call {i}: a KV buffer moved (reallocated) after the reserve");
    }
    assert!(fwd[0].iter().all(|&(_, cap)| cap >= positions * row), "the reserve did not size the caches: {:?}", fwd[0]);
}

#[test]
fn a_request_reserves_its_reach_before_any_forward_and_the_caches_never_move() {
    let (mut b, tok, prompt) = setup();
    let row = b.config().num_key_value_heads * b.config().head_dim;
    let spec = GenSpec { sampling: SamplingParams { temperature: Some(0.0), ..Default::default() }, max_tokens: Some(20), ..Default::default() };
    let mut state = b.new_state();
    let out = generate(&mut b, &mut state, &prompt, &tok, &spec, |_| Flow::Continue).unwrap();
    assert_eq!(out.tokens.len(), 20);
    assert_eq!(b.calls[0], Call::Reserve { held: 0, positions: 90 }, "the first call must size the session");
    assert_eq!(b.calls.iter().filter(|c| matches!(c, Call::Reserve { .. })).count(), 1);
    assert_no_kv_moves(&b.calls, 90, row);
    // 70 prompt tokens in chunks of 32 (3 calls), then 19 decode steps.
    assert_eq!(b.calls.len(), 1 + 3 + 19);
}

#[test]
fn a_resumed_snapshot_is_sized_again_before_its_prefill() {
    let (mut b, tok, prompt) = setup();
    let row = b.config().num_key_value_heads * b.config().head_dim;
    let spec = GenSpec { sampling: SamplingParams { temperature: Some(0.0), ..Default::default() }, max_tokens: Some(16), ..Default::default() };
    let mut cache = PrefixCache::new(1 << 30);
    // Turn 1 snapshots the first 40 tokens as history; turn 2 resumes from it.
    lily_engine::generate_cached(&mut b, &mut cache, &prompt[..50], 40, &tok, &spec, |_| Flow::Continue, |_| Flow::Continue).unwrap().unwrap();
    b.calls.clear();
    lily_engine::generate_cached(&mut b, &mut cache, &prompt, 0, &tok, &spec, |_| Flow::Continue, |_| Flow::Continue).unwrap().unwrap();
    match &b.calls[0] {
        Call::Reserve { held, positions } => {
            assert!(*held >= 40, "turn 2 should resume from a snapshot, held {held}");
            assert_eq!(*positions, 70 + 16);
        }
        other => panic!("the first call of turn 2 is {other:?}, not a reserve"),
    }
    assert_no_kv_moves(&b.calls, 86, row);
}

#[test]
fn without_max_tokens_the_reserve_covers_the_prompt() {
    let (mut b, tok, prompt) = setup();
    let spec = GenSpec { sampling: SamplingParams { temperature: Some(0.0), ..Default::default() }, max_tokens: None, ..Default::default() };
    let mut state = b.new_state();
    let mut n = 0;
    generate(&mut b, &mut state, &prompt, &tok, &spec, |_| {
        n += 1;
        if n == 3 {
            Flow::Cancel
        } else {
            Flow::Continue
        }
    })
    .unwrap();
    assert_eq!(b.calls[0], Call::Reserve { held: 0, positions: 70 });
}

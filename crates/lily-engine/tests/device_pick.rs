//! The generation loop's device-pick path (what the CUDA backend takes: the backend chooses the next
//! token and only its id comes back) against the host path, on the CPU: a backend that "picks on the
//! device" by running `lily_sampler::pick_on_cpu` on its own logits must generate exactly the tokens
//! the host sampler generates, for greedy and seeded sampling with penalties and bias, over a prompt
//! longer than one prefill chunk; a request that wants log-probabilities must take the host path.

use std::path::PathBuf;
use std::sync::Arc;

use lily_cpu::CpuModel;
use lily_engine::{generate, Flow, GenSpec};
use lily_model::{Backend, BackendError, DevicePick, LoadOptions, Logits, ModelConfig, ModelWeights};
use lily_sampler::{pick_on_cpu, SamplingParams};
use lily_tokenizer::Tokenizer;

fn fixture() -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("../../tests/fixtures/tiny-b/mlx")
}

/// The CPU model, choosing tokens "on the device"; prefill chunks of 40 tokens.
struct Picking {
    inner: CpuModel,
    picks: usize,
}

impl Backend for Picking {
    type State = lily_cpu::State;
    fn name(&self) -> &'static str {
        "picking-cpu"
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
        40
    }
    fn forward(&mut self, s: &mut Self::State, tokens: &[u32], logits: Logits) -> Result<Vec<f32>, BackendError> {
        self.inner.forward(s, tokens, logits)
    }
    fn picks_on_device(&self) -> bool {
        true
    }
    fn forward_pick(&mut self, s: &mut Self::State, tokens: &[u32], pick: &DevicePick) -> Result<u32, BackendError> {
        self.picks += 1;
        let mut logits = self.inner.forward(s, tokens, Logits::Last)?;
        Ok(pick_on_cpu(&mut logits, pick))
    }
}

fn run<B: Backend>(b: &mut B, prompt: &[u32], tok: &Tokenizer, spec: &GenSpec) -> (Vec<u32>, Vec<Option<f32>>) {
    let mut state = b.new_state();
    let mut logprobs = Vec::new();
    let out = generate(b, &mut state, prompt, tok, spec, |step| {
        logprobs.push(step.logprob);
        Flow::Continue
    })
    .unwrap();
    assert_eq!(b.state_len(&state), prompt.len() + out.tokens.len() - 1);
    (out.tokens, logprobs)
}

#[test]
fn device_pick_generates_what_the_host_sampler_generates() {
    let dir = fixture();
    let w = Arc::new(ModelWeights::load(&dir, &LoadOptions::default()).unwrap());
    let tok = Tokenizer::from_dir(&dir).unwrap();
    let vocab = tok.vocab_size().min(w.config.vocab_size) as u32;
    // 97 prompt tokens: three prefill chunks of 40 on the picking backend.
    let prompt: Vec<u32> = (0..97u32).map(|i| (i * 7919 + 13) % vocab).collect();
    let cases: Vec<(&str, SamplingParams)> = vec![
        ("greedy", SamplingParams { temperature: Some(0.0), ..Default::default() }),
        ("temperature + top-p, seeded", SamplingParams { temperature: Some(0.9), top_p: Some(0.9), seed: Some(7), ..Default::default() }),
        ("top-k + min-p", SamplingParams { temperature: Some(1.3), top_k: Some(20), min_p: Some(0.02), seed: Some(3), ..Default::default() }),
        (
            "penalties and bias",
            SamplingParams {
                temperature: Some(0.7),
                presence_penalty: Some(0.6),
                frequency_penalty: Some(0.4),
                repetition_penalty: Some(1.3),
                logit_bias: vec![(5, 2.0), (11, -100.0)],
                seed: Some(11),
                ..Default::default()
            },
        ),
    ];
    for (what, sampling) in cases {
        let spec = GenSpec { sampling, max_tokens: Some(24), ..Default::default() };
        let mut host = CpuModel::new(Arc::clone(&w));
        let mut dev = Picking { inner: CpuModel::new(Arc::clone(&w)), picks: 0 };
        let (want, _) = run(&mut host, &prompt, &tok, &spec);
        let (got, lp) = run(&mut dev, &prompt, &tok, &spec);
        assert_eq!(got, want, "{what}: device-picked tokens differ from the host sampler's");
        assert_eq!(dev.picks, got.len(), "{what}: every token should have been picked on the device");
        assert!(lp.iter().all(|l| l.is_none()), "{what}: no log-probabilities were asked for");
    }

    // Log-probabilities need the logits on the host: the device path must not be taken.
    let sampling = SamplingParams { temperature: Some(0.8), seed: Some(5), logprobs: true, top_logprobs: 2, ..Default::default() };
    let spec = GenSpec { sampling, max_tokens: Some(10), ..Default::default() };
    let mut host = CpuModel::new(Arc::clone(&w));
    let mut dev = Picking { inner: CpuModel::new(Arc::clone(&w)), picks: 0 };
    let (want, want_lp) = run(&mut host, &prompt, &tok, &spec);
    let (got, got_lp) = run(&mut dev, &prompt, &tok, &spec);
    assert_eq!(got, want);
    assert_eq!(dev.picks, 0, "a logprobs request went through the device pick");
    // (Prefill chunks of 40 vs 512 tokens: the chunked and the step-by-step delta rules agree to ~1e-6.)
    for (g, w) in got_lp.iter().zip(&want_lp) {
        let (g, w) = (g.expect("a logprob"), w.expect("a logprob"));
        assert!((g - w).abs() <= 1e-4 * w.abs().max(1.0), "logprob {g} vs {w}");
    }
}

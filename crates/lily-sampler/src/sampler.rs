//! [`Sampler`]: one request's resolved parameters, random stream and penalty bookkeeping.

use crate::ops;
use crate::params::{validate_request, Defaults, Resolved, SamplerError, SamplingParams};
use crate::rng::Rng;
use std::collections::{HashMap, HashSet};

/// One sampled token.
#[derive(Clone, Debug, PartialEq)]
pub struct Sampled {
    pub token: u32,
    /// The chosen token's log-probability under the raw distribution (the model's logits over the
    /// valid vocabulary, before penalties, bias, temperature and truncation, as vLLM reports
    /// by default). `None` unless the request asked for `logprobs`.
    pub logprob: Option<f32>,
    /// The `top_logprobs` most likely tokens of that same distribution, best first
    /// (ties: lower id first), as `(id, logprob)`.
    pub top_logprobs: Vec<(u32, f32)>,
}

/// Samples one request's tokens. Create one per request (or per choice), call
/// [`Sampler::observe_prompt`] once with the prompt, then [`Sampler::sample`] per step.
#[derive(Clone, Debug)]
pub struct Sampler {
    params: Resolved,
    bias: Vec<(u32, f32)>,
    vocab: usize,
    logprobs: bool,
    top_logprobs: usize,
    seed: u64,
    rng: Rng,
    /// Counts of generated tokens (presence/frequency penalties); kept only when those are on.
    counts: HashMap<u32, u32>,
    /// Distinct tokens of prompt + generated text (repetition penalty); kept only when it is on.
    seen: HashSet<u32>,
    scratch: ops::Scratch,
    top: Vec<(f32, u32)>,
    raw: Vec<f32>,
}

impl Sampler {
    /// Resolves `params` against `defaults` (see [`Resolved::resolve`]) and validates them.
    /// `valid_vocab` is the tokenizer's vocabulary size: logits rows at or past it (the padding of
    /// the embedding matrix) are never sampled and never counted in log-probabilities.
    pub fn new(params: &SamplingParams, defaults: &Defaults, valid_vocab: usize) -> Result<Self, SamplerError> {
        if valid_vocab == 0 {
            return Err(SamplerError::EmptyVocab);
        }
        let resolved = Resolved::resolve(params, defaults)?;
        validate_request(params, valid_vocab)?;
        let seed = params.seed.unwrap_or_else(Rng::entropy_seed);
        Ok(Sampler {
            params: resolved,
            bias: params.logit_bias.clone(),
            vocab: valid_vocab,
            logprobs: params.logprobs,
            top_logprobs: params.top_logprobs as usize,
            seed,
            rng: Rng::from_seed(seed),
            counts: HashMap::new(),
            seen: HashSet::new(),
            scratch: ops::Scratch::default(),
            top: Vec::new(),
            raw: Vec::new(),
        })
    }

    /// The resolved numeric parameters.
    pub fn params(&self) -> &Resolved {
        &self.params
    }

    /// The seed in use (the request's, or the one drawn from the OS): replaying it with the same
    /// logits reproduces the tokens.
    pub fn seed(&self) -> u64 {
        self.seed
    }

    pub(crate) fn wants_logprobs(&self) -> bool {
        self.logprobs
    }
    pub(crate) fn seen_ids(&self) -> impl Iterator<Item = &u32> {
        self.seen.iter()
    }
    pub(crate) fn counts_map(&self) -> &HashMap<u32, u32> {
        &self.counts
    }
    pub(crate) fn bias(&self) -> &[(u32, f32)] {
        &self.bias
    }
    pub(crate) fn vocab(&self) -> usize {
        self.vocab
    }
    /// The next random number (what `sample` draws for a non-greedy step).
    pub(crate) fn next_u(&mut self) -> f64 {
        self.rng.next_f64()
    }

    fn rep_on(&self) -> bool {
        self.params.repetition_penalty != 1.0
    }

    fn counts_on(&self) -> bool {
        self.params.presence_penalty != 0.0 || self.params.frequency_penalty != 0.0
    }

    /// The prompt's tokens: they count for the repetition penalty (as in transformers and vLLM),
    /// not for presence/frequency penalties (OpenAI/vLLM count only generated tokens).
    pub fn observe_prompt(&mut self, prompt: &[u32]) {
        if self.rep_on() {
            self.seen.extend(prompt.iter().copied());
        }
    }

    /// Records a generated token that did not come from [`Sampler::sample`] (a forced token);
    /// `sample` records its own choices.
    pub fn record(&mut self, token: u32) {
        if self.rep_on() {
            self.seen.insert(token);
        }
        if self.counts_on() {
            *self.counts.entry(token).or_insert(0) += 1;
        }
    }

    /// Chooses the next token from one position's logits (at least `valid_vocab` long; longer rows
    /// are padding and ignored). The slice is used as scratch: the penalties and bias are applied
    /// in place. Order: raw log-probabilities (if asked) → repetition penalty → presence/frequency
    /// → logit bias → [`ops::choose`] (greedy, or temperature → top-k → top-p → min-p → draw).
    /// Consumes one random number per non-greedy step, none when greedy.
    pub fn sample(&mut self, logits: &mut [f32]) -> Sampled {
        self.sample_masked(logits, None)
    }

    /// [`Sampler::sample`] under a token mask (constrained decoding; see [`ops::apply_token_mask`]):
    /// the disallowed tokens' logits become `-inf` after the penalties and the bias, before the
    /// choice ([`ops::masked_choice`] when every allowed logit is `-inf` or NaN). Log-probabilities stay those of the raw logits (the model's distribution, before
    /// the mask, as vLLM reports them).
    pub fn sample_masked(&mut self, logits: &mut [f32], mask: Option<&[u32]>) -> Sampled {
        assert!(
            logits.len() >= self.vocab,
            "logits have {} entries, fewer than the vocabulary's {}",
            logits.len(),
            self.vocab
        );
        let logits = &mut logits[..self.vocab];
        let mut top_logprobs = Vec::new();
        let lse = if self.logprobs {
            self.raw.clear();
            self.raw.extend_from_slice(logits);
            let lse = ops::log_sum_exp(logits);
            ops::top_n(logits, self.top_logprobs, &mut self.top);
            top_logprobs = self.top.iter().map(|&(l, id)| (id, (l as f64 - lse) as f32)).collect();
            Some(lse)
        } else {
            None
        };
        ops::apply_repetition_penalty(logits, self.params.repetition_penalty, self.seen.iter().copied());
        ops::apply_presence_frequency(
            logits,
            self.params.presence_penalty,
            self.params.frequency_penalty,
            self.counts.iter().map(|(&id, &c)| (id, c)),
        );
        ops::apply_logit_bias(logits, &self.bias);
        if let Some(mask) = mask {
            ops::apply_token_mask(logits, mask);
        }
        let mut token = if self.params.is_greedy() {
            ops::argmax(logits)
        } else {
            let u = self.rng.next_f64();
            ops::choose(logits, &self.params, u, &mut self.scratch)
        };
        if let Some(mask) = mask {
            token = ops::masked_choice(token, mask, self.vocab);
        }
        let logprob = lse.map(|lse| (self.raw[token as usize] as f64 - lse) as f32);
        self.record(token);
        Sampled { token, logprob, top_logprobs }
    }
}

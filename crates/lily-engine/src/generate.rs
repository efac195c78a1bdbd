//! The generation loop, the same on every backend: prefill the prompt in chunks (only the last
//! chunk asks for logits), then decode one token at a time — sample, check the stop conditions,
//! detokenise incrementally — handing each step's text to the caller, who may cancel.

use std::time::{Duration, Instant};

use lily_model::{Backend, BackendError, Logits};

use crate::cache::PrefixCache;
use lily_sampler::{Defaults, Finish, Sampled, Sampler, SamplerError, SamplingParams, StopChecker};
use lily_tokenizer::{StreamDecoder, Tokenizer, TokenizerError};

/// What to generate.
#[derive(Clone, Debug, Default)]
pub struct GenSpec {
    pub sampling: SamplingParams,
    pub defaults: Defaults,
    pub stop_strings: Vec<String>,
    /// Token ids that end generation (the model's EOS ids plus any the request adds).
    pub stop_ids: Vec<u32>,
    pub max_tokens: Option<usize>,
    /// Drop control tokens (<|im_end|> …) from the text.
    pub skip_special: bool,
}

/// One decoded token, as handed to the caller.
#[derive(Clone, Debug)]
pub struct Step<'a> {
    pub token: u32,
    /// Text that is now certain (may be empty while a multi-byte character or a possible stop
    /// string is held back).
    pub text: &'a str,
    pub logprob: Option<f32>,
    pub top_logprobs: &'a [(u32, f32)],
}

/// Whether to go on after a step.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Flow {
    Continue,
    Cancel,
}

#[derive(Clone, Debug, PartialEq, Eq)]
pub enum FinishReason {
    Stop,
    Length,
    Cancelled,
}

impl FinishReason {
    pub fn as_str(&self) -> &'static str {
        match self {
            FinishReason::Stop => "stop",
            FinishReason::Length => "length",
            FinishReason::Cancelled => "cancelled",
        }
    }
}

#[derive(Clone, Debug)]
pub struct Outcome {
    pub finish: FinishReason,
    /// Tokens generated (the stop token included when one ended it).
    pub tokens: Vec<u32>,
    /// Prompt tokens actually run (after any cached prefix).
    pub prefilled: usize,
    pub prefill_time: Duration,
    pub decode_time: Duration,
    /// Text held back at the end (emitted through the last step already).
    pub trailing_text: String,
}

impl Outcome {
    pub fn prefill_tok_s(&self) -> f64 {
        self.prefilled as f64 / self.prefill_time.as_secs_f64().max(1e-9)
    }
    pub fn decode_tok_s(&self) -> f64 {
        self.tokens.len() as f64 / self.decode_time.as_secs_f64().max(1e-9)
    }
}

#[derive(Debug, thiserror::Error)]
pub enum GenError {
    #[error(transparent)]
    Backend(#[from] BackendError),
    #[error(transparent)]
    Sampling(#[from] SamplerError),
    #[error(transparent)]
    Tokenizer(#[from] TokenizerError),
    #[error("the prompt is empty")]
    EmptyPrompt,
    #[error("the prompt ({prompt} tokens) is already all in the state ({held} tokens): nothing to predict from")]
    NothingToRun { prompt: usize, held: usize },
}

/// Runs `tokens` into `state` without asking for logits (a prompt's history, before a snapshot).
pub fn prefill<B: Backend>(backend: &mut B, state: &mut B::State, tokens: &[u32]) -> Result<(), BackendError> {
    for chunk in tokens.chunks(backend.prefill_chunk().max(1)) {
        backend.forward(state, chunk, Logits::None)?;
    }
    Ok(())
}

/// Runs `tokens` (at least one) after `state` and returns the token that follows them: chosen on the
/// device when the backend can (only its id crosses back; not when the request wants
/// log-probabilities, which need the logits here), else sampled here from the last row's logits.
pub fn next_token<B: Backend>(backend: &mut B, state: &mut B::State, sampler: &mut Sampler, tokens: &[u32]) -> Result<Sampled, BackendError> {
    if backend.picks_on_device() {
        if let Some(pick) = sampler.device_pick() {
            let token = backend.forward_pick(state, tokens, &pick)?;
            sampler.record(token);
            return Ok(Sampled { token, logprob: None, top_logprobs: Vec::new() });
        }
    }
    let mut logits = backend.forward(state, tokens, Logits::Last)?;
    Ok(sampler.sample(&mut logits))
}

/// Runs a prompt's `tokens` (at least one) as serving does — every prefill chunk but the last
/// without logits — and returns the token that follows ([`next_token`] on the last chunk).
pub fn prefill_and_next<B: Backend>(backend: &mut B, state: &mut B::State, sampler: &mut Sampler, tokens: &[u32]) -> Result<Sampled, BackendError> {
    let chunk = backend.prefill_chunk().max(1);
    let last = tokens.len().saturating_sub(1) / chunk * chunk; // where the last chunk starts
    prefill(backend, state, &tokens[..last])?;
    next_token(backend, state, sampler, &tokens[last..])
}

/// Sizes `state` for all a request can reach: the prompt and at most `max_tokens` more (bounded by
/// the model's positions), so that no decode step allocates.
fn reserve_reach<B: Backend>(backend: &mut B, state: &mut B::State, prompt_len: usize, spec: &GenSpec) -> Result<(), BackendError> {
    let reach = prompt_len.saturating_add(spec.max_tokens.unwrap_or(0));
    backend.reserve(state, reach.min(backend.config().max_position_embeddings))
}

/// Runs `prompt[state_len..]` into `state`, then generates. `state` must hold a prefix of `prompt`
/// (the caller's cache guarantees it). `on_step` sees every generated token.
pub fn generate<B: Backend>(
    backend: &mut B,
    state: &mut B::State,
    prompt: &[u32],
    tokenizer: &Tokenizer,
    spec: &GenSpec,
    mut on_step: impl FnMut(Step<'_>) -> Flow,
) -> Result<Outcome, GenError> {
    if prompt.is_empty() {
        return Err(GenError::EmptyPrompt);
    }
    let held = backend.state_len(state);
    if held >= prompt.len() {
        return Err(GenError::NothingToRun { prompt: prompt.len(), held });
    }
    let mut sampler = Sampler::new(&spec.sampling, &spec.defaults, tokenizer.vocab_size().min(backend.config().vocab_size))?;
    sampler.observe_prompt(prompt);
    let mut stop = StopChecker::new(spec.stop_strings.clone(), spec.stop_ids.clone(), spec.max_tokens);
    let mut detok = StreamDecoder::new(tokenizer, spec.skip_special);

    // Size the state once for all this request can reach (the prompt and at most max_tokens more),
    // so that no decode step allocates; then prefill, the last chunk also giving the first token
    // (unless none is wanted).
    let t0 = Instant::now();
    reserve_reach(backend, state, prompt.len(), spec)?;
    let rest = &prompt[held..];
    let first = if spec.max_tokens == Some(0) {
        prefill(backend, state, rest)?;
        None
    } else {
        Some(prefill_and_next(backend, state, &mut sampler, rest)?)
    };
    let prefill_time = t0.elapsed();

    let t1 = Instant::now();
    let mut tokens = Vec::new();
    let finish = match first {
        None => FinishReason::Length,
        Some(mut s) => loop {
            tokens.push(s.token);
            let piece = detok.push(s.token)?;
            let step = stop.push(s.token, &piece);
            let flow = on_step(Step { token: s.token, text: &step.text, logprob: s.logprob, top_logprobs: &s.top_logprobs });
            match step.finish {
                Some(Finish::Stop(_)) => break FinishReason::Stop,
                Some(Finish::Length) => break FinishReason::Length,
                None => {}
            }
            if flow == Flow::Cancel {
                break FinishReason::Cancelled;
            }
            s = next_token(backend, state, &mut sampler, &[s.token])?;
        },
    };
    let decode_time = t1.elapsed();
    // Text still held back (a partial character, or a prefix of a stop string that never came).
    let mut trailing_text = String::new();
    if finish != FinishReason::Stop {
        let tail = detok.flush();
        let mut t = stop.finish();
        t.push_str(&tail);
        trailing_text = t;
    }
    Ok(Outcome { finish, tokens, prefilled: rest.len(), prefill_time, decode_time, trailing_text })
}

/// What [`generate_cached`] did: the generation, and how many prompt tokens came from the cache.
#[derive(Clone, Debug)]
pub struct CachedOutcome {
    pub outcome: Outcome,
    pub cached_tokens: usize,
}

/// [`generate`] through a prefix cache, for multi-turn work: resumes from the longest snapshot that
/// is a prefix of `prompt`; prefills the first `history` prompt tokens (the conversation a later
/// turn will share; 0 for none) and snapshots there; generates; and snapshots the end state (the
/// prompt and every generated token but the last, which was never run through). The outcome's
/// prefill figures include the history. `on_start(cached_tokens)` runs before any model work and
/// may cancel (then `Ok(None)`).
#[allow(clippy::too_many_arguments)]
pub fn generate_cached<B: Backend>(
    backend: &mut B,
    cache: &mut PrefixCache<B::State>,
    prompt: &[u32],
    history: usize,
    tokenizer: &Tokenizer,
    spec: &GenSpec,
    on_start: impl FnOnce(usize) -> Flow,
    on_step: impl FnMut(Step<'_>) -> Flow,
) -> Result<Option<CachedOutcome>, GenError> {
    let (cached, mut state) = match cache.lookup(prompt) {
        Some((n, s)) => (n, s),
        None => (0, backend.new_state()),
    };
    if on_start(cached) == Flow::Cancel {
        return Ok(None);
    }
    let t = Instant::now();
    let mut history_run = 0;
    if history > cached && history < prompt.len() {
        history_run = history - cached;
        reserve_reach(backend, &mut state, prompt.len(), spec)?;
        prefill(backend, &mut state, &prompt[cached..history])?;
        // Snapshots are clones: they keep what the state holds, not the room reserved for the request.
        let snap = state.clone();
        let bytes = backend.state_bytes(&snap);
        cache.insert(prompt[..history].to_vec(), snap, bytes);
    }
    let history_time = t.elapsed();
    let mut outcome = generate(backend, &mut state, prompt, tokenizer, spec, on_step)?;
    outcome.prefilled += history_run;
    outcome.prefill_time += history_time;
    if let Some((_, kept)) = outcome.tokens.split_last() {
        let mut tokens = prompt.to_vec();
        tokens.extend_from_slice(kept);
        let snap = state.clone();
        drop(state);
        let bytes = backend.state_bytes(&snap);
        cache.insert(tokens, snap, bytes);
    }
    Ok(Some(CachedOutcome { outcome, cached_tokens: cached }))
}

//! The generation loop, the same on every backend: prefill the prompt in chunks (only the last
//! chunk asks for logits), then decode one token at a time — sample, check the stop conditions,
//! detokenise incrementally — handing each step's text to the caller, who may cancel.
//!
//! Under a grammar ([`GenSpec::constraint`], structured outputs) each step is masked: the tokens the
//! grammar allows next are computed on the host *while the backend runs the forward pass* (on
//! another thread when the logits come back to the host, in the backend's mask callback when it
//! applies the mask on the device) and every other token is excluded before the choice. Tokens
//! the grammar makes certain (and the `\n\n` after the model's `</think>`, and the end of the turn
//! once the grammar is complete) are fed without sampling, all in the next forward call — unless
//! the request wants log-probabilities, which then come from the model for every token (the
//! certain ones are then sampled under a one-token mask).

use std::time::{Duration, Instant};

use lily_model::{Backend, BackendError, Logits};

use crate::cache::PrefixCache;
use lily_grammar::{Constraint, GrammarError, Session};
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
    /// Structured outputs: the compiled grammar every token must follow (from `lily-grammar`).
    pub constraint: Option<Constraint>,
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
    /// Under a grammar: the steps that were masked, and the host time their masks took.
    pub masked_steps: usize,
    pub mask_time: Duration,
    /// Under a grammar: tokens fed without sampling (certain by the grammar).
    pub forced_tokens: usize,
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
    #[error(transparent)]
    Grammar(#[from] GrammarError),
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

/// One generation's grammar: its session, the mask buffer and the time spent on masks.
pub struct Guide {
    pub session: Session,
    mask: Vec<u32>,
    pub masked_steps: usize,
    pub mask_time: Duration,
}

impl Guide {
    /// A session of `constraint` whose masks cover `vocab` tokens.
    pub fn new(constraint: &Constraint, vocab: usize) -> Self {
        Guide { session: constraint.start(), mask: vec![0; vocab.div_ceil(32)], masked_steps: 0, mask_time: Duration::ZERO }
    }

    fn fill(&mut self, words: &mut [u32]) -> Result<(), GrammarError> {
        let t = Instant::now();
        let r = self.session.fill_mask(words);
        self.mask_time += t.elapsed();
        self.masked_steps += 1;
        r
    }
}

/// [`next_token`] under a grammar: when the next token is masked, the mask is computed on the host
/// while the forward pass runs — in the backend's callback when it applies masks on the device
/// ([`Backend::masks_on_device`]), else on a second thread while the logits are computed here —
/// and the token is chosen among those it allows. The caller commits the token to the session.
pub fn next_token_guided<B: Backend>(
    backend: &mut B,
    state: &mut B::State,
    sampler: &mut Sampler,
    tokens: &[u32],
    guide: Option<&mut Guide>,
) -> Result<Sampled, GenError> {
    let Some(g) = guide.filter(|g| g.session.masks_next()) else {
        return Ok(next_token(backend, state, sampler, tokens)?);
    };
    if backend.picks_on_device() && backend.masks_on_device() {
        if let Some(pick) = sampler.device_pick() {
            let mut failed = None;
            let picked = backend.forward_pick_masked(state, tokens, &pick, &mut |words: &mut [u32]| {
                g.fill(words).map_err(|e| {
                    let msg = e.to_string();
                    failed = Some(e);
                    BackendError::Mask(msg)
                })
            });
            let token = match (picked, failed) {
                (Ok(t), _) => t,
                (Err(_), Some(e)) => return Err(e.into()),
                (Err(e), None) => return Err(e.into()),
            };
            sampler.record(token);
            return Ok(Sampled { token, logprob: None, top_logprobs: Vec::new() });
        }
    }
    // The logits come back here: the mask is made on a second thread meanwhile.
    let Guide { session, mask, masked_steps, mask_time } = g;
    let (logits, filled) = std::thread::scope(|scope| {
        let worker = scope.spawn(|| {
            let t = Instant::now();
            let r = session.fill_mask(mask);
            (r, t.elapsed())
        });
        let logits = backend.forward(state, tokens, Logits::Last);
        (logits, worker.join())
    });
    let (filled, took) = filled.unwrap_or_else(|panic| std::panic::resume_unwind(panic));
    *mask_time += took;
    *masked_steps += 1;
    let mut logits = logits?;
    filled?;
    Ok(sampler.sample_masked(&mut logits, Some(mask)))
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
    on_step: impl FnMut(Step<'_>) -> Flow,
) -> Result<Outcome, GenError> {
    if prompt.is_empty() {
        return Err(GenError::EmptyPrompt);
    }
    let held = backend.state_len(state);
    if held >= prompt.len() {
        return Err(GenError::NothingToRun { prompt: prompt.len(), held });
    }
    let vocab = tokenizer.vocab_size().min(backend.config().vocab_size);
    let mut sampler = Sampler::new(&spec.sampling, &spec.defaults, vocab)?;
    sampler.observe_prompt(prompt);
    let mut guide = spec.constraint.as_ref().map(|c| Guide::new(c, vocab));
    // Certain tokens are fed without sampling, unless every token needs its log-probability.
    let feed_forced = !spec.sampling.logprobs;
    let mut out = Emitter {
        tokens: Vec::new(),
        detok: StreamDecoder::new(tokenizer, spec.skip_special),
        stop: StopChecker::new(spec.stop_strings.clone(), spec.stop_ids.clone(), spec.max_tokens),
        on_step,
    };

    // Size the state once for all this request can reach (the prompt and at most max_tokens more),
    // so that no decode step allocates; then prefill, the last chunk also giving the first token
    // (unless none is wanted). Tokens a grammar makes certain from the start ride on the prefill.
    let t0 = Instant::now();
    reserve_reach(backend, state, prompt.len(), spec)?;
    let rest = &prompt[held..];
    let mut run = rest.to_vec();
    let mut opening = Vec::new();
    if let (Some(g), true) = (guide.as_mut(), feed_forced && spec.max_tokens != Some(0)) {
        take_forced(g, &mut sampler, &mut opening)?;
        run.extend_from_slice(&opening);
    }
    let first = if spec.max_tokens == Some(0) {
        prefill(backend, state, &run)?;
        None
    } else {
        let chunk = backend.prefill_chunk().max(1);
        let last = run.len().saturating_sub(1) / chunk * chunk;
        prefill(backend, state, &run[..last])?;
        Some(next_token_guided(backend, state, &mut sampler, &run[last..], guide.as_mut())?)
    };
    let prefill_time = t0.elapsed();

    let t1 = Instant::now();
    let mut forced = opening.len();
    let mut ended = None;
    for &t in &opening {
        if let Some(f) = out.emit(t, None, &[])? {
            ended = Some(f);
            break;
        }
    }
    let finish = match (first, ended) {
        (_, Some(f)) => f,
        (None, None) => FinishReason::Length,
        (Some(mut s), None) => 'gen: loop {
            if let Some(f) = out.emit(s.token, s.logprob, &s.top_logprobs)? {
                break f;
            }
            let mut run = vec![s.token];
            if let Some(g) = guide.as_mut() {
                g.session.commit(s.token)?;
                if feed_forced {
                    take_forced(g, &mut sampler, &mut run)?;
                    forced += run.len() - 1;
                    for &t in &run[1..] {
                        if let Some(f) = out.emit(t, None, &[])? {
                            break 'gen f;
                        }
                    }
                }
            }
            s = next_token_guided(backend, state, &mut sampler, &run, guide.as_mut())?;
        },
    };
    let decode_time = t1.elapsed();
    let (masked_steps, mask_time) = guide.as_ref().map_or((0, Duration::ZERO), |g| (g.masked_steps, g.mask_time));
    let Emitter { tokens, mut detok, mut stop, .. } = out;
    // Text still held back (a partial character, or a prefix of a stop string that never came).
    let mut trailing_text = String::new();
    if finish != FinishReason::Stop {
        let tail = detok.flush();
        let mut t = stop.finish();
        t.push_str(&tail);
        trailing_text = t;
    }
    Ok(Outcome {
        finish,
        tokens,
        prefilled: rest.len(),
        prefill_time,
        decode_time,
        trailing_text,
        masked_steps,
        mask_time,
        forced_tokens: forced,
    })
}

/// Most tokens fed without sampling in one forward call.
const MAX_FORCED_RUN: usize = 256;

/// Takes the tokens the grammar makes certain next (committing each, recording it for the
/// penalties) onto `run`, up to [`MAX_FORCED_RUN`].
fn take_forced(g: &mut Guide, sampler: &mut Sampler, run: &mut Vec<u32>) -> Result<(), GrammarError> {
    let start = run.len();
    while run.len() - start < MAX_FORCED_RUN {
        let forced = g.session.forced();
        if forced.is_empty() {
            break;
        }
        for t in forced.into_iter().take(MAX_FORCED_RUN - (run.len() - start)) {
            g.session.commit(t)?;
            sampler.record(t);
            run.push(t);
        }
    }
    Ok(())
}

/// Hands generated tokens to the caller: detokenised, checked against the stop conditions.
struct Emitter<'t, F> {
    tokens: Vec<u32>,
    detok: StreamDecoder<'t>,
    stop: StopChecker,
    on_step: F,
}

impl<F: FnMut(Step<'_>) -> Flow> Emitter<'_, F> {
    /// Emits one token; `Some` when generation ends with it.
    fn emit(&mut self, token: u32, logprob: Option<f32>, top: &[(u32, f32)]) -> Result<Option<FinishReason>, GenError> {
        self.tokens.push(token);
        let piece = self.detok.push(token)?;
        let step = self.stop.push(token, &piece);
        let flow = (self.on_step)(Step { token, text: &step.text, logprob, top_logprobs: top });
        Ok(match step.finish {
            Some(Finish::Stop(_)) => Some(FinishReason::Stop),
            Some(Finish::Length) => Some(FinishReason::Length),
            None if flow == Flow::Cancel => Some(FinishReason::Cancelled),
            None => None,
        })
    }
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
    generate_cached_at(backend, cache, prompt, &[history], tokenizer, spec, on_start, on_step)
}

/// [`generate_cached`] with several snapshot points in the prompt (ascending; each one not yet
/// cached and short of the whole prompt gets a snapshot): e.g. the end of the system prompt and
/// tools, which requests with other conversations share, and the end of the history.
#[allow(clippy::too_many_arguments)]
pub fn generate_cached_at<B: Backend>(
    backend: &mut B,
    cache: &mut PrefixCache<B::State>,
    prompt: &[u32],
    points: &[usize],
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
    let mut at = cached;
    for &point in points {
        if point > at && point < prompt.len() {
            if at == cached {
                reserve_reach(backend, &mut state, prompt.len(), spec)?;
            }
            history_run += point - at;
            prefill(backend, &mut state, &prompt[at..point])?;
            at = point;
            // Snapshots are clones: they keep what the state holds, not the room reserved for the request.
            let snap = state.clone();
            let bytes = backend.state_bytes(&snap);
            cache.insert(prompt[..point].to_vec(), snap, bytes);
        }
    }
    let history_time = t.elapsed();
    let mut outcome = generate(backend, &mut state, prompt, tokenizer, spec, on_step)?;
    outcome.prefilled += history_run;
    outcome.prefill_time += history_time;
    // The state holds the prompt and the generated tokens that were run through it (not the last
    // one, nor forced tokens a stop cut off): the snapshot's key is exactly what it holds.
    let held = backend.state_len(&state);
    if !outcome.tokens.is_empty() && held >= prompt.len() && held <= prompt.len() + outcome.tokens.len() {
        let mut tokens = prompt.to_vec();
        tokens.extend_from_slice(&outcome.tokens[..held - prompt.len()]);
        let snap = state.clone();
        drop(state);
        let bytes = backend.state_bytes(&snap);
        cache.insert(tokens, snap, bytes);
    }
    Ok(Some(CachedOutcome { outcome, cached_tokens: cached }))
}

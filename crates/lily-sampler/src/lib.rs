//! Token sampling for lily: greedy, temperature, top-k, top-p, min-p, presence / frequency /
//! repetition penalties, logit bias, seeds, logprobs and top_logprobs; and the stop conditions
//! (stop token ids, stop strings across token boundaries, max tokens).
//!
//! # Parameters
//!
//! [`SamplingParams`] is what a request says (OpenAI field names; deserialises from the request
//! JSON). Each unset value falls back to the model's [`Defaults`] (`generation_config.json`), then
//! to OpenAI's defaults: temperature 1, top_p 1, no top-k, min_p 0, no penalties
//! ([`Resolved::resolve`]). `do_sample: false` in the defaults makes the fallback temperature 0.
//! Ranges (violations are [`SamplerError`]s naming the field, for a 400): temperature finite >= 0;
//! top_k -1, 0 (off) or >= 1; top_p in (0, 1]; min_p in [0, 1]; presence/frequency penalty in
//! [-2, 2]; repetition penalty in (0, 2]; logit_bias ids below the vocabulary and biases in
//! [-100, 100]; top_logprobs in [0, 20] and only with logprobs.
//!
//! # Order of operations (per token; as transformers and vLLM)
//!
//! 1. Cut the logits row to the tokenizer's vocabulary: padding rows are never sampled and are not
//!    part of any log-probability.
//! 2. If logprobs are asked for: log-softmax of these raw logits (the chosen token's and the
//!    `top_logprobs` best), before anything below; vLLM's default `raw_logprobs`.
//! 3. Repetition penalty over the distinct tokens of prompt + generated text (transformers/vLLM):
//!    positive logits divided by it, negative multiplied.
//! 4. Presence and frequency penalties over the generated tokens only (OpenAI/vLLM):
//!    `logit -= presence * [count > 0] + frequency * count`.
//! 5. Logit bias added; then, under constrained decoding, every token the mask does not allow set to
//!    `-inf` (see *Token masks* below).
//! 6. Temperature < 1e-5: greedy, argmax with ties to the lowest id (no random number used).
//!    Otherwise weights `exp((l - max) / T)` (temperature), then top-k, then top-p on the
//!    renormalised survivors (keep a token while the mass ranked above it is below top_p; the top
//!    token always stays), then min-p (keep probabilities >= min_p x the top one) — transformers'
//!    warper order. Each keeps a prefix of the rank order (logit descending, ties to the lower id).
//!    Then one inverse-CDF draw: `u` in [0, 1) from the request's xoshiro256** stream, times the
//!    kept mass, walked over the kept tokens in ascending id order. Same seed + same logits = same
//!    tokens; no seed = seeded from the OS and the clock ([`Sampler::seed`] tells which). `exp` is
//!    written out ([`ops::exp_f32`]), so the bits do not depend on the platform's libm; tokens
//!    more than 87 nats (after temperature) below the top get weight 0.
//!
//! Cost at vocabulary 248k (one core, SSE2 build): top-k is one pass with a rising threshold, no
//! sort (~0.1 ms); without top-k, one vectorised `exp` pass plus a blocked draw (~0.3-0.5 ms), and
//! top-p adds a histogram of the weights so that only the one bucket holding the cut is sorted
//! (~0.7-1.2 ms); logprobs add a copy, one `exp` pass and a top-n pass (~0.3 ms).
//!
//! # On the GPU
//!
//! The math lives in [`ops`] as pure functions of a logits slice and the plain `Copy` struct
//! [`Resolved`]. [`Sampler::device_pick`] turns one step into a [`DevicePick`]: the penalties and
//! the bias as one [`LogitEdit`] per affected token (the CPU's exact f32 operands), the truncation
//! parameters and the step's `u` (drawn here, as `sample` draws it). `lily_cuda::ops::sample::pick`
//! applies it to the logits on the device and writes only the chosen id, the same token as
//! [`pick_on_cpu`] (the CPU reference: the edits, then [`ops::choose`]); the caller then
//! [`Sampler::record`]s it, so the penalty bookkeeping stays on the host. The kernels mirror
//! `ops::choose` sum for sum (the lanes of `sum_f64`, the draw's 1024-token blocks, the nucleus
//! buckets and the walk orders): a change to that arithmetic here needs the same change in
//! `crates/lily-cuda/kernels/sample.cu` (its tests pick at the CPU's exact CDF boundaries, so they
//! catch a mismatch). Requests with logprobs stay on the host (they need the logits).
//!
//! # Token masks (constrained decoding)
//!
//! [`Sampler::sample_masked`] and [`pick_on_cpu_masked`] take a bitmask over the vocabulary (bit
//! `id % 32` of word `id / 32` set when token `id` may come next, as `lily-grammar` computes it):
//! every other logit becomes `-inf` after the penalties and the bias, before the choice
//! ([`ops::apply_token_mask`]). Log-probabilities stay those of the raw logits. A device applying
//! the mask must choose what `pick_on_cpu_masked` chooses.

pub mod ops;
mod params;
mod pick;
pub mod rng;
mod sampler;
mod stop;

pub use params::{Defaults, Resolved, SamplerError, SamplingParams, GREEDY_EPS, MAX_TOP_LOGPROBS};
pub use pick::{pick_on_cpu, pick_on_cpu_masked, DevicePick, LogitEdit};
pub use sampler::{Sampled, Sampler};
pub use stop::{Finish, StopChecker, StopReason, StopStep};

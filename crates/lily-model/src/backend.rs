//! The boundary between the engine and a compute backend (CPU, CUDA, and one day Metal): a backend
//! owns the weights on its device and runs the whole forward pass of a chunk of tokens against a
//! session state it defines. The engine never sees tensors, only token ids, states and logits.

use crate::config::ModelConfig;
pub use lily_sampler::DevicePick;

/// Which logits a forward call returns.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Logits {
    /// None (prefill of a prompt whose continuation is not needed yet).
    None,
    /// The last token's row: `[V]`.
    Last,
    /// Every token's row: `[T, V]` (teacher-forced scoring).
    All,
}

#[derive(Debug, thiserror::Error)]
pub enum BackendError {
    #[error("token id {id} is outside the vocabulary (size {vocab})")]
    InvalidToken { id: u32, vocab: usize },
    #[error("the context is full: {len} tokens held, {add} more asked, at most {max}")]
    ContextFull { len: usize, add: usize, max: usize },
    #[error("state belongs to another model or backend: {0}")]
    BadState(String),
    #[error("device error: {0}")]
    Device(String),
    /// The token mask of a constrained step could not be made (the caller's callback failed).
    #[error("the token mask could not be computed: {0}")]
    Mask(String),
}

/// Fills the bitmask of the tokens the next pick may choose (constrained decoding): bit `id % 32` of
/// word `id / 32` set when token `id` is allowed, `pick.vocab.div_ceil(32)` words. See
/// [`Backend::forward_pick_masked`].
pub type MaskFill<'a> = dyn FnMut(&mut [u32]) -> Result<(), BackendError> + 'a;

/// A model on a device.
pub trait Backend: Send {
    /// Everything the model remembers about a sequence: KV caches, conv and recurrent states.
    type State: Clone + Send;

    fn name(&self) -> &'static str;
    fn config(&self) -> &ModelConfig;
    /// A fresh sequence.
    fn new_state(&self) -> Self::State;
    /// Tokens processed into `state`.
    fn state_len(&self, state: &Self::State) -> usize;
    /// Memory `state` holds, in bytes (for cache budgets).
    fn state_bytes(&self, state: &Self::State) -> usize;
    /// Runs `tokens` after what `state` holds, advancing it; returns the logits asked for
    /// (row-major `[rows, vocab_size]` f32).
    fn forward(&mut self, state: &mut Self::State, tokens: &[u32], logits: Logits) -> Result<Vec<f32>, BackendError>;

    /// Makes room in `state` for `positions` positions in all (what it holds and what will follow),
    /// so that running that far allocates nothing more. The engine calls it once per request, before
    /// the prefill, with the prompt plus the most tokens the request may generate: a decode step then
    /// never allocates. A backend whose state does not grow ignores it.
    fn reserve(&mut self, state: &mut Self::State, positions: usize) -> Result<(), BackendError> {
        let _ = (state, positions);
        Ok(())
    }
    /// Prompt tokens per prefill call this backend prefers (the engine chunks prompts by it).
    fn prefill_chunk(&self) -> usize {
        512
    }
    /// Whether [`Backend::forward_pick`] works: the backend chooses the next token itself, so only
    /// its id crosses back to the host.
    fn picks_on_device(&self) -> bool {
        false
    }
    /// Runs `tokens` (at least one) after `state` and chooses the token that follows the last one as
    /// `pick` says (the same choice `lily_sampler` makes on the host from the logits).
    fn forward_pick(&mut self, state: &mut Self::State, tokens: &[u32], pick: &DevicePick) -> Result<u32, BackendError> {
        let _ = (state, tokens, pick);
        Err(BackendError::Device(format!("the {} backend does not choose tokens on the device", self.name())))
    }
    /// Whether [`Backend::forward_pick_masked`] works: the backend applies a token mask on the
    /// device before its pick. When it does not, the engine runs constrained steps on the host
    /// (logits back, mask and sampling there): the same tokens, slower.
    fn masks_on_device(&self) -> bool {
        false
    }
    /// [`Backend::forward_pick`] under a token mask: starts the forward pass of `tokens`, then, while
    /// the device works, calls `fill` once with a host buffer of `pick.vocab.div_ceil(32)` words for
    /// the host to write the mask into (the host computes it meanwhile); uploads it, sets every
    /// disallowed logit to `-inf` after the pick's edits and before its choice, and chooses — the
    /// token `lily_sampler::pick_on_cpu_masked` chooses. An error from `fill` ends the step with it.
    fn forward_pick_masked(
        &mut self,
        state: &mut Self::State,
        tokens: &[u32],
        pick: &DevicePick,
        fill: &mut MaskFill<'_>,
    ) -> Result<u32, BackendError> {
        let _ = (state, tokens, pick, fill);
        Err(BackendError::Device(format!("the {} backend does not apply token masks on the device", self.name())))
    }
}

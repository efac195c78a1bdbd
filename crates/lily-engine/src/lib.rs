//! The engine: opens a checkpoint on a backend ([`open`]) and runs work over a backend's session
//! state, independent of which backend it is: teacher-forced scoring ([`score`]), and generation
//! ([`generate`]: chunked prefill, then sampling, stop conditions and streaming detokenisation).

pub mod bench;
pub mod cache;
pub mod chat;
pub mod generate;
pub mod open;
pub mod score;

pub use cache::PrefixCache;
pub use chat::{ChatModel, ChatModelError};
pub use generate::{generate, generate_cached, generate_cached_at, CachedOutcome, Flow, FinishReason, GenError, GenSpec, Outcome, Step};
pub use open::{open, BackendKind, DEFAULT_MAX_CHUNK, EngineError, LoadedModel, LoadedState, OpenOptions};
pub use score::{score, ScoreResult};

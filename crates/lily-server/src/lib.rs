//! lily's OpenAI-compatible server.
//!
//! - `request`: reading and validating request bodies (a bad field is a 400 naming it), with
//!   `fields` (typed readers of single fields) and `messages` (the shape of messages and tools)
//! - `routes`: the HTTP routes, auth, and assembling responses and SSE streams from engine events
//! - `worker`: the engine thread (one sequence at a time, a bounded FIFO queue, the prefix cache)
//! - `structured`: structured outputs (`response_format`, `structured_outputs`, constrained tool
//!   calls) compiled into the grammar the engine applies to every token
//! - `http`: the connection layer (HTTP/1.1 limits, JSON bodies for hyper's refusals, shutdown)
//! - `responses`: OpenAI's Responses API (`/v1/responses`, stored responses, `previous_response_id`)
//! - `anthropic`: Anthropic's Messages API (`/v1/messages`, `count_tokens`, its error shape)
//! - `conversation`: what the three APIs share before the template (several or late system
//!   messages made into what the Qwen template accepts)
//! - `stream`: one generation turned into the events of the Responses or Messages API
//! - `log`: one line per request
//! - `metrics`, `error`
//!
//! The async side never touches the model: handlers render and tokenise the prompt, queue a job,
//! and turn the engine thread's events into OpenAI JSON.

pub mod anthropic;
pub mod conversation;
pub mod error;
pub mod fields;
pub mod http;
pub mod log;
pub mod messages;
pub mod metrics;
pub mod request;
pub mod responses;
pub mod routes;
pub mod stream;
pub mod structured;
pub mod worker;

use std::sync::Arc;
use std::time::{Duration, Instant};

use lily_model::Backend;
use lily_sampler::Defaults;
use lily_template::ChatTemplate;
use lily_tokenizer::Tokenizer;

pub use http::{serve_until, HttpLimits};
pub use log::RequestLog;
pub use routes::{router, AppState};

/// A prompt (rendered, before tokenising) longer than this many bytes per token of the context is
/// refused without tokenising it: real text runs at 3-5 bytes per token, so only text that cannot
/// fit anyway (or pathological runs of whitespace) is refused, and a multi-megabyte prompt costs no
/// tokeniser time (tokenising runs at about 1.5 MB/s on one core).
pub const MAX_PROMPT_BYTES_PER_TOKEN: usize = 32;

/// How to serve.
#[derive(Clone, Debug)]
pub struct ServerConfig {
    pub model_id: String,
    pub demo: bool,
    pub api_key: Option<String>,
    pub ctx_size: usize,
    pub max_queue: usize,
    pub queue_timeout: Duration,
    pub max_body_bytes: usize,
    pub cache_bytes: usize,
    /// `max_tokens` of a request that sets none (None: the rest of the context).
    pub default_max_tokens: Option<usize>,
    /// A request's body must have arrived this long after its headers (else 408).
    pub body_timeout: Duration,
    /// Where the per-request log lines go (None: nowhere).
    pub log: Option<RequestLog>,
}

/// A model's parts, as the server needs them.
pub struct ServedModel<B> {
    pub backend: B,
    pub tokenizer: Tokenizer,
    pub template: ChatTemplate,
    pub defaults: Defaults,
    pub stop_ids: Vec<u32>,
}

/// Starts the engine thread and returns the app to serve.
pub fn build<B>(m: ServedModel<B>, cfg: &ServerConfig) -> AppState
where
    B: Backend + 'static,
    B::State: 'static,
{
    let backend_name = m.backend.name();
    let vocab = m.tokenizer.vocab_size().min(m.backend.config().vocab_size);
    let tokenizer = Arc::new(m.tokenizer);
    let engine = worker::spawn(m.backend, Arc::clone(&tokenizer), cfg.max_queue, cfg.cache_bytes);
    let grammars = Arc::new(structured::GrammarCell::new(Arc::clone(&tokenizer), m.stop_ids.clone()));
    AppState {
        grammars,
        engine,
        tokenizer,
        template: Arc::new(m.template),
        defaults: m.defaults,
        stop_ids: m.stop_ids,
        model_id: cfg.model_id.clone(),
        demo: cfg.demo,
        backend: backend_name,
        api_key: cfg.api_key.clone(),
        ctx_size: cfg.ctx_size,
        vocab,
        max_body_bytes: cfg.max_body_bytes,
        max_prompt_bytes: cfg.ctx_size.saturating_mul(MAX_PROMPT_BYTES_PER_TOKEN),
        default_max_tokens: cfg.default_max_tokens,
        body_timeout: cfg.body_timeout,
        queue_timeout: cfg.queue_timeout,
        metrics: Arc::new(metrics::Metrics::default()),
        started: Instant::now(),
        log: cfg.log.clone(),
        responses: Arc::new(responses::Store::new(responses::STORE_RESPONSES, responses::STORE_BYTES)),
        shutdown: Arc::new(tokio::sync::watch::channel(None).0),
        drain_grace: Duration::from_secs(1),
    }
}

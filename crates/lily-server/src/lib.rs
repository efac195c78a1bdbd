//! lily's OpenAI-compatible server.
//!
//! - `request`: reading and validating request bodies (a bad field is a 400 naming it)
//! - `routes`: the HTTP routes, auth, and assembling responses and SSE streams from engine events
//! - `worker`: the engine thread (one sequence at a time, a bounded FIFO queue, the prefix cache)
//! - `structured`: structured outputs (`response_format`, `structured_outputs`, constrained tool
//!   calls) compiled into the grammar the engine applies to every token
//! - `metrics`, `error`
//!
//! The async side never touches the model: handlers render and tokenise the prompt, queue a job,
//! and turn the engine thread's events into OpenAI JSON.

pub mod error;
pub mod metrics;
pub mod request;
pub mod routes;
pub mod structured;
pub mod worker;

use std::net::SocketAddr;
use std::sync::Arc;
use std::time::{Duration, Instant};

use lily_model::Backend;
use lily_sampler::Defaults;
use lily_template::ChatTemplate;
use lily_tokenizer::Tokenizer;

pub use routes::{router, AppState};

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
        queue_timeout: cfg.queue_timeout,
        metrics: Arc::new(metrics::Metrics::default()),
        started: Instant::now(),
    }
}

/// Serves `app` on `addr` until Ctrl-C.
pub async fn serve(app: AppState, listener: tokio::net::TcpListener) -> std::io::Result<()> {
    axum::serve(listener, router(app)).with_graceful_shutdown(async {
        let _ = tokio::signal::ctrl_c().await;
    })
    .await
}

/// Binds `addr` (a clear error if the port is taken).
pub async fn bind(addr: SocketAddr) -> std::io::Result<tokio::net::TcpListener> {
    tokio::net::TcpListener::bind(addr).await
}

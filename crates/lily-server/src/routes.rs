//! The HTTP surface: routes, authentication, body limits, and the translation between the engine
//! thread's events and OpenAI responses (whole, or streamed as SSE chunks ending in `[DONE]`). Once
//! a shutdown begins, every answer in flight ends: at the engine's next token, or after a short
//! grace if the engine is busy (a long prefill), with a final chunk and `[DONE]` all the same.

use std::convert::Infallible;
use std::future::Future;
use std::pin::Pin;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant, SystemTime, UNIX_EPOCH};

use axum::body::{Body, Bytes};
use axum::extract::{Request, State};
use axum::http::header;
use axum::middleware::Next;
use axum::response::sse::{Event as SseEvent, KeepAlive, Sse};
use axum::response::{IntoResponse, Response};
use axum::routing::{get, post};
use axum::{Json, Router};
use futures::stream::{self, Stream, StreamExt};
use lily_engine::{FinishReason, GenSpec};
use lily_parser::{Event as ParseEvent, OutputParser, ParserConfig};
use lily_sampler::{Defaults, Sampler};
use lily_template::ChatTemplate;
use lily_tokenizer::Tokenizer;
use serde_json::{json, Value};
use tokio::sync::mpsc::{unbounded_channel, UnboundedReceiver};

use crate::error::ApiError;
use crate::log::{GenerationLine, LogsItself, RequestLog};
use crate::metrics::Metrics;
use crate::request::{parse_chat, parse_completion, ChatRequest, Common, ToolChoice};
use crate::worker::{EngineHandle, Event, Job, JobError, SubmitError};

/// Everything a request handler needs; cheap to clone.
#[derive(Clone)]
pub struct AppState {
    pub engine: EngineHandle,
    pub tokenizer: Arc<Tokenizer>,
    pub template: Arc<ChatTemplate>,
    pub defaults: Defaults,
    pub stop_ids: Vec<u32>,
    pub model_id: String,
    pub demo: bool,
    pub backend: &'static str,
    pub api_key: Option<String>,
    pub ctx_size: usize,
    pub vocab: usize,
    pub max_body_bytes: usize,
    /// A rendered prompt longer than this is refused before it is tokenised.
    pub max_prompt_bytes: usize,
    pub default_max_tokens: Option<usize>,
    pub body_timeout: Duration,
    pub queue_timeout: Duration,
    pub metrics: Arc<Metrics>,
    pub started: Instant,
    /// Structured outputs: the grammar factory, built on first use.
    pub grammars: Arc<crate::structured::GrammarCell>,
    pub log: Option<RequestLog>,
    /// Responses kept for `GET /v1/responses/{id}` and `previous_response_id` (bounded).
    pub responses: Arc<crate::responses::Store>,
    /// When the shutdown began (None: serving).
    pub shutdown: Arc<tokio::sync::watch::Sender<Option<Instant>>>,
    /// After a shutdown begins, how long an answer waits for the engine to end it before it ends
    /// itself.
    pub drain_grace: Duration,
}

impl AppState {
    /// Begins the shutdown: the engine stops taking work and ends the running generation at its
    /// next token; every answer in flight ends (see the module's doc).
    pub fn begin_shutdown(&self) {
        self.engine.stop();
        self.shutdown.send_if_modified(|t| {
            let first = t.is_none();
            t.get_or_insert_with(Instant::now);
            first
        });
    }

    /// Resolves `drain_grace` after the shutdown began (never, while serving).
    pub(crate) async fn grace_over(mut rx: tokio::sync::watch::Receiver<Option<Instant>>, grace: Duration) {
        let Ok(t) = rx.wait_for(Option::is_some).await.map(|t| t.unwrap()) else {
            return std::future::pending().await;
        };
        tokio::time::sleep_until((t + grace).into()).await;
    }
}

pub fn router(state: AppState) -> Router {
    let v1 = Router::new()
        .route("/v1/chat/completions", post(chat_completions))
        .route("/v1/completions", post(completions))
        .route("/v1/responses", post(crate::responses::create))
        .route("/v1/responses/{id}", get(crate::responses::retrieve).delete(crate::responses::delete))
        .route("/v1/messages", post(crate::anthropic::messages))
        .route("/v1/messages/count_tokens", post(crate::anthropic::count_tokens))
        .route("/v1/models", get(models))
        .route("/v1/models/{*id}", get(model))
        .route("/metrics", get(metrics))
        .route_layer(axum::middleware::from_fn_with_state(state.clone(), auth));
    Router::new()
        .route("/health", get(health))
        .merge(v1)
        .method_not_allowed_fallback(|| async {
            ApiError::new(axum::http::StatusCode::METHOD_NOT_ALLOWED, "invalid_request_error", "This method is not allowed on this route.")
        })
        .fallback(|| async { ApiError::not_found("This route was") })
        // Errors on the Anthropic routes in Anthropic's shape (auth, routing and body errors too).
        .layer(axum::middleware::from_fn(crate::anthropic::error_shape))
        .layer(axum::middleware::from_fn_with_state(state.clone(), crate::log::log_requests))
        .with_state(state)
}

async fn auth(State(app): State<AppState>, req: Request, next: Next) -> Response {
    if let Some(key) = &app.api_key {
        // `Authorization: Bearer KEY` (OpenAI) or `x-api-key: KEY` (Anthropic), on every route.
        let bearer = req
            .headers()
            .get(header::AUTHORIZATION)
            .and_then(|v| v.to_str().ok())
            .and_then(|v| v.strip_prefix("Bearer "))
            .is_some_and(|k| k.trim() == key);
        let x_api_key = req.headers().get("x-api-key").and_then(|v| v.to_str().ok()).is_some_and(|k| k.trim() == key);
        let ok = bearer || x_api_key;
        if !ok {
            app.metrics.count_status(401);
            return ApiError::unauthorized().into_response();
        }
    }
    next.run(req).await
}

async fn health(State(app): State<AppState>) -> Json<Value> {
    Json(json!({"status": "ok", "model": app.model_id, "demo": app.demo, "backend": app.backend,
        "queue_depth": app.engine.queue_depth.load(Ordering::Relaxed)}))
}

fn model_object(app: &AppState) -> Value {
    let created = unix_now() - app.started.elapsed().as_secs();
    // OpenAI's fields, and Anthropic's (`type`, `display_name`, `created_at`), so that both clients
    // read the same list.
    let mut m = json!({"id": app.model_id, "object": "model", "created": created, "owned_by": "lily",
        "max_model_len": app.ctx_size, "type": "model", "display_name": app.model_id,
        "created_at": crate::anthropic::rfc3339(created)});
    if app.demo {
        m["description"] = json!("lily's built-in demo model: random weights of the Qwen3.6 architecture with the real tokenizer. It does not produce meaningful text.");
    }
    m
}

async fn models(State(app): State<AppState>) -> Json<Value> {
    Json(json!({"object": "list", "data": [model_object(&app)], "has_more": false, "first_id": app.model_id, "last_id": app.model_id}))
}

/// `%XX` escapes decoded (invalid ones kept as they are).
fn percent_decode(s: &str) -> String {
    let b = s.as_bytes();
    let mut out = Vec::with_capacity(b.len());
    let mut i = 0;
    while i < b.len() {
        let hex = |c: u8| (c as char).to_digit(16);
        match (b[i], b.get(i + 1).copied().and_then(hex), b.get(i + 2).copied().and_then(hex)) {
            (b'%', Some(h), Some(l)) => {
                out.push((h * 16 + l) as u8);
                i += 3;
            }
            (c, _, _) => {
                out.push(c);
                i += 1;
            }
        }
    }
    String::from_utf8_lossy(&out).into_owned()
}

/// `GET /v1/models/{id}` (the id may hold slashes, as `org/name` ids do).
async fn model(State(app): State<AppState>, uri: axum::http::Uri) -> Response {
    let id = percent_decode(uri.path().strip_prefix("/v1/models/").unwrap_or(""));
    if id == app.model_id {
        Json(model_object(&app)).into_response()
    } else {
        let mut e = ApiError::new(axum::http::StatusCode::NOT_FOUND, "invalid_request_error", format!("The model `{id}` does not exist; this server serves `{}`.", app.model_id))
            .with_code("model_not_found");
        e.param = Some("model".into());
        e.into_response()
    }
}

async fn metrics(State(app): State<AppState>) -> Response {
    let text = app.metrics.render(&app.engine);
    ([(header::CONTENT_TYPE, "text/plain; version=0.0.4")], text).into_response()
}

pub(crate) fn unix_now() -> u64 {
    SystemTime::now().duration_since(UNIX_EPOCH).map(|d| d.as_secs()).unwrap_or(0)
}

/// A body this many times over the limit is cut off instead of drained (the connection then closes).
const DRAIN_FACTOR: usize = 16;

/// Reads the body (at most `limit` bytes) and parses it as JSON. An oversized body is still read to
/// its end (up to `DRAIN_FACTOR` × the limit, discarding it) before the 413 goes out, so the client
/// gets the error instead of a connection reset in the middle of its upload.
pub(crate) async fn read_json(body: Body, limit: usize, timeout: Duration) -> Result<Value, ApiError> {
    let mut stream = body.into_data_stream();
    let mut bytes: Vec<u8> = Vec::new();
    let mut seen = 0usize;
    let read = async {
        while let Some(chunk) = stream.next().await {
            let chunk: Bytes = chunk.map_err(|e| ApiError::bad_request(format!("Reading the request body failed: {e}")))?;
            seen += chunk.len();
            if seen <= limit {
                bytes.extend_from_slice(&chunk);
            } else if seen > limit.saturating_mul(DRAIN_FACTOR) {
                break;
            }
        }
        Ok::<_, ApiError>(())
    };
    match tokio::time::timeout(timeout, read).await {
        Ok(r) => r?,
        Err(_) => {
            return Err(ApiError::new(
                axum::http::StatusCode::REQUEST_TIMEOUT,
                "invalid_request_error",
                format!("The request body did not arrive within {} s.", timeout.as_secs_f64()),
            )
            .with_code("request_timeout"))
        }
    }
    if seen > limit {
        return Err(ApiError::too_large(limit));
    }
    let text = std::str::from_utf8(&bytes).map_err(|e| ApiError::bad_request(format!("The request body is not valid UTF-8: {e}")))?;
    serde_json::from_str(text).map_err(|e| ApiError::bad_request(format!("The request body is not valid JSON: {e}")))
}

/// A prompt ready for the engine, with what the response needs to know about it.
pub(crate) struct Prepared {
    pub(crate) prompt: Vec<u32>,
    pub(crate) history: usize,
    /// The end of the system prompt (and tools) in `prompt`, where a snapshot is kept (0: none).
    pub(crate) system: usize,
    pub(crate) spec: GenSpec,
    pub(crate) common: Common,
    /// Chat only: how to parse the output, and text forced into the answer before generation.
    pub(crate) parse: Option<(ParserConfig, String)>,
}

fn check_sampling(app: &AppState, common: &Common) -> Result<(), ApiError> {
    Sampler::new(&common.sampling, &app.defaults, app.vocab).map(|_| ()).map_err(|e| match e.param() {
        Some(p) => ApiError::invalid(p, e.to_string()),
        None => ApiError::bad_request(e.to_string()),
    })
}

/// `clamp`: a `max_tokens` beyond what the context leaves is cut to fit instead of refused (the
/// Messages API, whose clients must send one and send the largest their model allows).
fn gen_spec(app: &AppState, common: &Common, prompt_len: usize, prompt_param: &str, clamp: bool) -> Result<GenSpec, ApiError> {
    if prompt_len >= app.ctx_size {
        return Err(ApiError::invalid(
            prompt_param,
            format!(
                "This model's maximum context length is {} tokens, but the prompt has {prompt_len} tokens.",
                app.ctx_size
            ),
        )
        .with_code("context_length_exceeded"));
    }
    let room = app.ctx_size - prompt_len;
    let max_tokens = match common.max_tokens {
        Some(n) if n > room && clamp => room,
        Some(n) if n > room => {
            return Err(ApiError::invalid(
                "max_tokens",
                format!(
                    "max_tokens ({n}) plus the prompt ({prompt_len} tokens) exceeds the context length ({}); at most {room} tokens can be generated.",
                    app.ctx_size
                ),
            )
            .with_code("context_length_exceeded"))
        }
        Some(n) => n,
        // The server's default (`lily serve -n`), within what the context leaves.
        None => app.default_max_tokens.map_or(room, |d| d.min(room)),
    };
    Ok(GenSpec {
        sampling: common.sampling.clone(),
        defaults: app.defaults.clone(),
        stop_strings: common.stop.clone(),
        stop_ids: app.stop_ids.clone(),
        max_tokens: Some(max_tokens),
        skip_special: true,
        constraint: None,
    })
}

/// Refuses a prompt too long to fit before spending tokeniser time on it.
pub(crate) fn check_prompt_bytes(app: &AppState, bytes: usize, param: &str) -> Result<(), ApiError> {
    if bytes > app.max_prompt_bytes {
        return Err(ApiError::invalid(
            param,
            format!(
                "The prompt is {bytes} bytes long: far more than this model's maximum context length of {} tokens can hold (at most {} bytes are accepted).",
                app.ctx_size, app.max_prompt_bytes
            ),
        )
        .with_code("context_length_exceeded"));
    }
    Ok(())
}

pub(crate) fn template_error(e: lily_template::TemplateError) -> ApiError {
    if e.is_request_error() {
        ApiError::invalid("messages", e.to_string())
    } else {
        ApiError::internal(format!("chat template: {e}"))
    }
}

pub(crate) fn prepare_chat(app: &AppState, body: &Value) -> Result<Prepared, ApiError> {
    prepare_chat_with(app, body, false)
}

/// [`prepare_chat`]; `clamp_max_tokens`: see [`gen_spec`].
pub(crate) fn prepare_chat_with(app: &AppState, body: &Value, clamp_max_tokens: bool) -> Result<Prepared, ApiError> {
    let req: ChatRequest = parse_chat(body)?;
    check_sampling(app, &req.common)?;
    let mut body = body.clone();
    // Several system messages, or one late in the conversation: as the template allows them.
    if let Some(Value::Array(m)) = body.get("messages") {
        let normalized = crate::conversation::normalize_system(m);
        body["messages"] = Value::Array(normalized);
    }
    let tools = match req.tool_choice {
        ToolChoice::None => {
            body.as_object_mut().unwrap().remove("tools");
            Vec::new()
        }
        _ => req.tools.clone(),
    };
    let text = app.template.render_request(&body).map_err(template_error)?;
    check_prompt_bytes(app, text.len(), "messages")?;
    let thinking = text.trim_end().ends_with("<think>");
    // Conversation history (no generation prompt): the point to snapshot for the next turn.
    body["add_generation_prompt"] = json!(false);
    let history_text = app.template.render_request(&body).ok().filter(|h| text.starts_with(h.as_str()) && h.len() < text.len());
    // tool_choice required / named: force the start of a call (and close the reasoning first).
    let forced = match &req.tool_choice {
        ToolChoice::Required | ToolChoice::Named(_) => {
            let mut f = String::new();
            if thinking {
                f.push_str("\n</think>\n\n");
            }
            f.push_str("<tool_call>\n<function=");
            // A named tool, or the only tool there is: its name is certain too.
            if let Some(n) = crate::structured::forced_call_name(&req.tool_choice, &tools) {
                f.push_str(n);
                f.push_str(">\n");
            }
            f
        }
        _ => String::new(),
    };
    // The history is encoded once; the rest (from `<|im_start|>assistant`) is appended to it.
    let tok_err = |e: lily_tokenizer::TokenizerError| ApiError::internal(e.to_string());
    let (prompt, history) = match history_text {
        Some(h) => {
            let ids = app.tokenizer.encode(&h).map_err(tok_err)?;
            let rest = format!("{}{forced}", &text[h.len()..]);
            let prompt = app.tokenizer.encode_after(&h, &ids, &rest).map_err(tok_err)?;
            let history = if prompt.starts_with(&ids) { ids.len() } else { 0 };
            (prompt, history)
        }
        None => (app.tokenizer.encode(&format!("{text}{forced}")).map_err(tok_err)?, 0),
    };
    // The system prompt and tools, first in the prompt: their end is a snapshot point too.
    let system = match text.strip_prefix("<|im_start|>system\n").and_then(|t| t.find("<|im_end|>\n")) {
        Some(i) if history > 0 => {
            let end = "<|im_start|>system\n".len() + i + "<|im_end|>\n".len();
            match app.tokenizer.encode(&text[..end]) {
                Ok(ids) if ids.len() < history && prompt.starts_with(&ids) => ids.len(),
                _ => 0,
            }
        }
        _ => 0,
    };
    let mut spec = gen_spec(app, &req.common, prompt.len(), "messages", clamp_max_tokens)?;
    if let Some((plan, param)) = crate::structured::chat_plan(&body, &req.tool_choice, &tools, thinking)? {
        spec.constraint = Some(crate::structured::compile(&app.grammars, &plan, param.as_deref())?);
    }
    let tools = tools.iter().map(crate::structured::parser_tool).collect();
    let cfg = ParserConfig { reasoning: thinking, tools, id_seed: None };
    Ok(Prepared { prompt, history, system, spec, common: req.common, parse: Some((cfg, forced)) })
}

fn prepare_completion(app: &AppState, body: &Value) -> Result<Prepared, ApiError> {
    let (text, common) = parse_completion(body)?;
    check_sampling(app, &common)?;
    check_prompt_bytes(app, text.len(), "prompt")?;
    let prompt = app.tokenizer.encode(&text).map_err(|e| ApiError::internal(e.to_string()))?;
    if prompt.is_empty() {
        return Err(ApiError::invalid("prompt", "the prompt is empty"));
    }
    let mut spec = gen_spec(app, &common, prompt.len(), "prompt", false)?;
    if let Some(a) = crate::structured::parse_answer(body)? {
        let plan = lily_grammar::Plan { answer: Some(a.format), ..Default::default() };
        spec.constraint = Some(crate::structured::compile(&app.grammars, &plan, Some(&a.param))?);
    }
    Ok(Prepared { prompt, history: 0, system: 0, spec, common, parse: None })
}

/// Sets the job's cancel flag when dropped (the client went away, or the response ended).
pub(crate) struct CancelOnDrop(Arc<AtomicBool>);
impl Drop for CancelOnDrop {
    fn drop(&mut self) {
        self.0.store(true, Ordering::SeqCst);
    }
}

pub(crate) fn submit(app: &AppState, p: &Prepared) -> Result<(UnboundedReceiver<Event>, CancelOnDrop), ApiError> {
    let (tx, rx) = unbounded_channel();
    let cancel = Arc::new(AtomicBool::new(false));
    let job = Job {
        prompt: p.prompt.clone(),
        history: p.history,
        system: p.system,
        spec: p.spec.clone(),
        events: tx,
        cancel: Arc::clone(&cancel),
        deadline: Instant::now() + app.queue_timeout,
    };
    app.engine.submit(job).map_err(|e| match e {
        SubmitError::QueueFull => ApiError::queue_full(retry_after(app)),
        SubmitError::Stopped if app.engine.is_stopping() => ApiError::shutting_down(),
        SubmitError::Stopped => ApiError::unavailable("The engine has stopped."),
    })?;
    Ok((rx, CancelOnDrop(cancel)))
}

/// Seconds until the queue is likely to have room: the mean time of a request so far (1 to 60).
fn retry_after(app: &AppState) -> u64 {
    app.engine.stats.mean_job_time().map_or(1, |t| t.as_secs_f64().ceil() as u64).clamp(1, 60)
}

async fn chat_completions(State(app): State<AppState>, req: Request) -> Response {
    handle(app, req, true).await
}

async fn completions(State(app): State<AppState>, req: Request) -> Response {
    handle(app, req, false).await
}

/// A body that is not JSON is refused by its content type (none at all is taken as JSON).
pub(crate) fn check_content_type(req: &Request) -> Result<(), ApiError> {
    let Some(ct) = req.headers().get(header::CONTENT_TYPE) else { return Ok(()) };
    let ct = ct.to_str().unwrap_or("").to_ascii_lowercase();
    let essence = ct.split(';').next().unwrap_or("").trim();
    if essence == "application/json" || essence.ends_with("+json") {
        return Ok(());
    }
    Err(ApiError::new(
        axum::http::StatusCode::UNSUPPORTED_MEDIA_TYPE,
        "invalid_request_error",
        format!("The request body must be JSON, sent with `Content-Type: application/json` (got `{ct}`)."),
    )
    .with_code("unsupported_media_type"))
}

async fn handle(app: AppState, req: Request, chat: bool) -> Response {
    let mut line = GenerationLine::new(app.log.clone(), req.method().as_str(), req.uri().path(), crate::http::peer(&req));
    let result = async {
        check_content_type(&req)?;
        let v = read_json(req.into_body(), app.max_body_bytes, app.body_timeout).await?;
        let a = app.clone();
        let prepared = tokio::task::spawn_blocking(move || if chat { prepare_chat(&a, &v) } else { prepare_completion(&a, &v) })
            .await
            .map_err(|e| ApiError::internal(e.to_string()))??;
        let (rx, guard) = submit(&app, &prepared)?;
        Ok::<_, ApiError>((prepared, rx, guard))
    }
    .await;
    let (prepared, rx, guard) = match result {
        Ok(x) => x,
        Err(e) => {
            app.metrics.count_status(e.status.as_u16());
            // The log middleware writes this request's line (with the error).
            line.disarm();
            return e.into_response();
        }
    };
    app.metrics.count_status(200);
    line.prompt_tokens = prepared.prompt.len();
    let turn = Turn::new(&app, chat, &prepared, line);
    let grace = AppState::grace_over(app.shutdown.subscribe(), app.drain_grace);
    let mut resp = if prepared.common.stream {
        sse(turn, rx, guard, grace).into_response()
    } else {
        whole(turn, rx, guard, grace).await
    };
    // The answer's own line is written when it has ended (the response may still be streaming).
    resp.extensions_mut().insert(LogsItself);
    resp
}

/// One response being assembled from engine events.
struct Turn {
    tokenizer: Arc<Tokenizer>,
    chat: bool,
    id: String,
    created: u64,
    model: String,
    fingerprint: String,
    parser: Option<OutputParser>,
    /// Parser events of forced text, not yet streamed.
    pending: Vec<ParseEvent>,
    want_logprobs: bool,
    include_usage: bool,
    prompt_tokens: usize,
    cached_tokens: usize,
    completion_tokens: usize,
    tool_calls: usize,
    /// Text completions: the text so far. Chat: unused (the parser keeps the message).
    text: String,
    logprobs: Vec<Value>,
    /// Text completions: characters of the tokens given logprobs so far (`text_offset`).
    lp_offset: usize,
    /// The engine has started the job (chat: the role chunk has gone out).
    started: bool,
    line: GenerationLine,
}

/// What one engine event turns into.
enum Out {
    Chunk(Value),
    /// The final chunk(s) have been produced; the message (chat) or text is complete.
    Finished { finish_reason: &'static str, message: Option<lily_parser::ParsedMessage> },
    Error(ApiError),
}

pub(crate) fn rand_id() -> u64 {
    use std::hash::{BuildHasher, Hasher};
    let mut h = std::collections::hash_map::RandomState::new().build_hasher();
    h.write_u128(SystemTime::now().duration_since(UNIX_EPOCH).map(|d| d.as_nanos()).unwrap_or(0));
    h.finish()
}

impl Turn {
    fn new(app: &AppState, chat: bool, p: &Prepared, line: GenerationLine) -> Self {
        let id = format!("{}-{:016x}", if chat { "chatcmpl" } else { "cmpl" }, rand_id());
        let mut parser = p.parse.as_ref().map(|(cfg, _)| OutputParser::new(cfg.clone()));
        let mut pending = Vec::new();
        if let (Some(parser), Some((_, forced))) = (parser.as_mut(), p.parse.as_ref()) {
            if !forced.is_empty() {
                pending = parser.push(forced);
            }
        }
        Turn {
            tokenizer: Arc::clone(&app.tokenizer),
            chat,
            id,
            created: unix_now(),
            model: app.model_id.clone(),
            fingerprint: format!("lily-{}-{}", env!("CARGO_PKG_VERSION"), app.backend),
            parser,
            pending,
            want_logprobs: p.common.sampling.logprobs,
            include_usage: p.common.include_usage,
            prompt_tokens: p.prompt.len(),
            cached_tokens: 0,
            completion_tokens: 0,
            tool_calls: 0,
            text: String::new(),
            logprobs: Vec::new(),
            lp_offset: 0,
            started: false,
            line,
        }
    }

    /// The shutdown's grace is over and the engine has not ended this answer (it is busy in a long
    /// prefill): end it here, as the engine would have.
    fn end_for_shutdown(&mut self) -> Vec<Out> {
        let mut out = Vec::new();
        if !self.started {
            out = self.feed(Event::Started { prompt_tokens: self.prompt_tokens, cached_tokens: 0 });
        }
        out.extend(self.feed(Event::Done { finish: FinishReason::Cancelled, completion_tokens: self.completion_tokens, speed: None }));
        out
    }

    fn usage(&self) -> Value {
        json!({"prompt_tokens": self.prompt_tokens, "completion_tokens": self.completion_tokens,
            "total_tokens": self.prompt_tokens + self.completion_tokens,
            "prompt_tokens_details": {"cached_tokens": self.cached_tokens}})
    }

    fn chunk(&self, delta: Value, logprobs: Option<Value>, finish: Option<&str>) -> Value {
        let choice = if self.chat {
            json!({"index": 0, "delta": delta, "logprobs": logprobs, "finish_reason": finish})
        } else {
            json!({"index": 0, "text": delta.get("content").and_then(Value::as_str).unwrap_or(""), "logprobs": logprobs, "finish_reason": finish})
        };
        json!({"id": self.id, "object": if self.chat { "chat.completion.chunk" } else { "text_completion" },
            "created": self.created, "model": self.model, "system_fingerprint": self.fingerprint, "choices": [choice]})
    }

    fn token_logprob(&self, id: u32, logprob: f32, top: &[(u32, f32)]) -> Value {
        let text = |t: u32| self.tokenizer.decode(&[t], false).unwrap_or_default();
        let entry = |t: u32, lp: f32| {
            let s = text(t);
            json!({"token": s, "logprob": lp, "bytes": s.as_bytes()})
        };
        let mut e = entry(id, logprob);
        e["top_logprobs"] = Value::Array(top.iter().map(|&(t, lp)| entry(t, lp)).collect());
        e
    }

    /// Parser events as chat deltas.
    fn deltas(&mut self, events: Vec<ParseEvent>) -> Vec<Value> {
        let mut out = Vec::new();
        for e in events {
            match e {
                ParseEvent::Reasoning(t) => out.push(json!({"reasoning_content": t})),
                ParseEvent::Content(t) => out.push(json!({"content": t})),
                ParseEvent::ToolCallStart { index, id, name } => {
                    self.tool_calls = self.tool_calls.max(index + 1);
                    out.push(json!({"tool_calls": [{"index": index, "id": id, "type": "function", "function": {"name": name, "arguments": ""}}]}))
                }
                ParseEvent::ToolCallArguments { index, fragment } => {
                    out.push(json!({"tool_calls": [{"index": index, "function": {"arguments": fragment}}]}))
                }
                ParseEvent::ToolCallEnd { .. } => {}
            }
        }
        out
    }

    /// Text of a token (or the tail) as output chunks.
    fn text_chunks(&mut self, text: &str, logprobs: Option<Value>) -> Vec<Out> {
        let deltas = match self.parser.as_mut() {
            Some(p) => {
                let ev = p.push(text);
                self.deltas(ev)
            }
            None => {
                self.text.push_str(text);
                if text.is_empty() { Vec::new() } else { vec![json!({"content": text})] }
            }
        };
        let lp = logprobs.map(|l| if self.chat { json!({"content": [l]}) } else { l });
        let mut out = Vec::new();
        if deltas.is_empty() {
            if lp.is_some() {
                out.push(Out::Chunk(self.chunk(json!({}), lp, None)));
            }
        } else {
            let mut lp = lp;
            for d in deltas {
                out.push(Out::Chunk(self.chunk(d, lp.take(), None)));
            }
        }
        out
    }

    fn feed(&mut self, ev: Event) -> Vec<Out> {
        match ev {
            Event::Started { prompt_tokens, cached_tokens } => {
                self.started = true;
                self.prompt_tokens = prompt_tokens;
                self.cached_tokens = cached_tokens;
                self.line.prompt_tokens = prompt_tokens;
                self.line.cached_tokens = cached_tokens;
                let mut out = Vec::new();
                if self.chat {
                    out.push(Out::Chunk(self.chunk(json!({"role": "assistant", "content": ""}), None, None)));
                    let pending = std::mem::take(&mut self.pending);
                    for d in self.deltas(pending) {
                        out.push(Out::Chunk(self.chunk(d, None, None)));
                    }
                }
                out
            }
            Event::Token { id, text, logprob, top_logprobs } => {
                self.completion_tokens += 1;
                let lp = match (self.want_logprobs, logprob) {
                    (true, Some(l)) => {
                        let e = self.token_logprob(id, l, &top_logprobs);
                        self.logprobs.push(e.clone());
                        if self.chat {
                            Some(e)
                        } else {
                            let legacy = legacy_logprobs(std::slice::from_ref(&e), self.lp_offset);
                            self.lp_offset += e["token"].as_str().map_or(0, |t| t.chars().count());
                            Some(legacy)
                        }
                    }
                    _ => None,
                };
                self.text_chunks(&text, lp)
            }
            Event::Tail(text) => self.text_chunks(&text, None),
            Event::Done { finish, completion_tokens, speed } => {
                self.completion_tokens = completion_tokens;
                self.line.completion_tokens = completion_tokens;
                self.line.speed = speed;
                let mut out = Vec::new();
                let message = match self.parser.take() {
                    Some(p) => {
                        let (events, message) = p.finish();
                        for d in self.deltas(events) {
                            out.push(Out::Chunk(self.chunk(d, None, None)));
                        }
                        Some(message)
                    }
                    None => None,
                };
                let finish_reason = match finish {
                    FinishReason::Length => "length",
                    _ if self.tool_calls > 0 || message.as_ref().is_some_and(|m| !m.tool_calls.is_empty()) => "tool_calls",
                    _ => "stop",
                };
                out.push(Out::Chunk(self.chunk(json!({}), None, Some(finish_reason))));
                self.line.finish = Some(match finish {
                    FinishReason::Cancelled => format!("{finish_reason} (the server is shutting down)"),
                    _ => finish_reason.to_string(),
                });
                out.push(Out::Finished { finish_reason, message });
                out
            }
            Event::Failed(e) => {
                let e = match e {
                    JobError::TimedOut => ApiError::unavailable("The request waited too long in the queue."),
                    JobError::ShuttingDown => ApiError::shutting_down(),
                    JobError::Engine(e) => ApiError::internal(e),
                };
                self.line.status = e.status.as_u16();
                self.line.finish = Some(format!("error: {}", e.message));
                vec![Out::Error(e)]
            }
        }
    }

    fn whole_response(&self, finish_reason: &str, message: Option<lily_parser::ParsedMessage>) -> Value {
        let logprobs = if self.want_logprobs {
            if self.chat { json!({"content": self.logprobs}) } else { legacy_logprobs(&self.logprobs, 0) }
        } else {
            Value::Null
        };
        let choice = match message {
            Some(m) => {
                let mut msg = json!({"role": "assistant", "content": m.content});
                if let Some(r) = m.reasoning {
                    msg["reasoning_content"] = json!(r);
                }
                if !m.tool_calls.is_empty() {
                    msg["tool_calls"] = Value::Array(
                        m.tool_calls
                            .iter()
                            .map(|c| json!({"id": c.id, "type": "function", "function": {"name": c.name, "arguments": c.arguments}}))
                            .collect(),
                    );
                }
                json!({"index": 0, "message": msg, "logprobs": logprobs, "finish_reason": finish_reason})
            }
            None => json!({"index": 0, "text": self.text, "logprobs": logprobs, "finish_reason": finish_reason}),
        };
        json!({"id": self.id, "object": if self.chat { "chat.completion" } else { "text_completion" },
            "created": self.created, "model": self.model, "system_fingerprint": self.fingerprint,
            "choices": [choice], "usage": self.usage()})
    }
}

/// Text completions' logprobs in OpenAI's legacy form (parallel lists), from chat-style entries.
fn legacy_logprobs(entries: &[Value], mut offset: usize) -> Value {
    let (mut tokens, mut lps, mut tops, mut offsets) = (Vec::new(), Vec::new(), Vec::new(), Vec::new());
    for e in entries {
        let t = e["token"].as_str().unwrap_or("");
        tokens.push(json!(t));
        lps.push(e["logprob"].clone());
        let top: serde_json::Map<String, Value> = e["top_logprobs"]
            .as_array()
            .into_iter()
            .flatten()
            .map(|a| (a["token"].as_str().unwrap_or("").to_string(), a["logprob"].clone()))
            .collect();
        tops.push(Value::Object(top));
        offsets.push(json!(offset));
        offset += t.chars().count();
    }
    json!({"tokens": tokens, "token_logprobs": lps, "top_logprobs": tops, "text_offset": offsets})
}

async fn whole(mut turn: Turn, mut rx: UnboundedReceiver<Event>, _guard: CancelOnDrop, grace: impl Future<Output = ()>) -> Response {
    tokio::pin!(grace);
    loop {
        let outs = tokio::select! {
            ev = rx.recv() => match ev {
                Some(ev) => turn.feed(ev),
                None => break,
            },
            _ = &mut grace => {
                if !turn.started {
                    // Still queued: nothing to end; say why it never ran.
                    let e = ApiError::shutting_down();
                    turn.line.status = e.status.as_u16();
                    turn.line.finish = Some(format!("error: {}", e.message));
                    return e.into_response();
                }
                turn.end_for_shutdown()
            }
        };
        for out in outs {
            match out {
                Out::Chunk(_) => {}
                Out::Finished { finish_reason, message } => {
                    return Json(turn.whole_response(finish_reason, message)).into_response();
                }
                Out::Error(e) => return e.into_response(),
            }
        }
    }
    let e = ApiError::internal("the engine ended the request without an answer");
    turn.line.status = e.status.as_u16();
    turn.line.finish = Some(format!("error: {}", e.message));
    e.into_response()
}

fn sse(
    turn: Turn,
    rx: UnboundedReceiver<Event>,
    guard: CancelOnDrop,
    grace: impl Future<Output = ()> + Send + 'static,
) -> Sse<impl Stream<Item = Result<SseEvent, Infallible>>> {
    // State: (turn, receiver, guard, the shutdown's grace). Each engine event becomes zero or more
    // SSE events.
    let grace: Pin<Box<dyn Future<Output = ()> + Send>> = Box::pin(grace);
    let s = stream::unfold(Some((turn, rx, guard, grace)), |st| async move {
        let (mut turn, mut rx, guard, mut grace) = st?;
        let outs = tokio::select! {
            ev = rx.recv() => match ev {
                Some(ev) => turn.feed(ev),
                None => {
                    let e = ApiError::internal("the engine ended the request without an answer");
                    turn.line.finish = Some(format!("error: {}", e.message));
                    let items = vec![SseEvent::default().data(e.body().to_string()), SseEvent::default().data("[DONE]")];
                    return Some((items, None));
                }
            },
            _ = &mut grace => turn.end_for_shutdown(),
        };
        let mut items = Vec::new();
        let mut done = false;
        for out in outs {
            match out {
                Out::Chunk(c) => items.push(SseEvent::default().data(c.to_string())),
                Out::Finished { .. } => {
                    if turn.include_usage {
                        let mut u = turn.chunk(json!({}), None, None);
                        u["choices"] = json!([]);
                        u["usage"] = turn.usage();
                        items.push(SseEvent::default().data(u.to_string()));
                    }
                    items.push(SseEvent::default().data("[DONE]"));
                    done = true;
                }
                Out::Error(e) => {
                    items.push(SseEvent::default().data(e.body().to_string()));
                    items.push(SseEvent::default().data("[DONE]"));
                    done = true;
                }
            }
        }
        Some((items, if done { None } else { Some((turn, rx, guard, grace)) }))
    })
    .flat_map(|items| stream::iter(items.into_iter().map(Ok)));
    Sse::new(s).keep_alive(KeepAlive::default())
}

//! One generation for the Responses and Messages APIs: the engine thread's events, through the same
//! output parser as chat completions (reasoning, content, tool calls), handed to an [`Encoder`] that
//! turns them into the API's named SSE events, and at the end into the whole answer. A non-streamed
//! request runs the same encoder and returns what it built, so a streamed answer and a whole one
//! are the same by construction. Shutdown, queue timeouts and engine failures end an answer as they
//! do on chat completions (see `routes.rs`), in the API's own terms.

use std::convert::Infallible;
use std::future::Future;
use std::pin::Pin;
use std::sync::Arc;

use axum::extract::Request;
use axum::response::sse::{Event as SseEvent, KeepAlive, Sse};
use axum::response::{IntoResponse, Response};
use axum::Json;
use futures::stream::{self, StreamExt};
use lily_engine::FinishReason;
use lily_parser::{Event as ParseEvent, OutputParser};
use lily_tokenizer::Tokenizer;
use serde_json::Value;
use tokio::sync::mpsc::UnboundedReceiver;

use crate::error::ApiError;
use crate::log::{GenerationLine, LogsItself};
use crate::routes::{check_content_type, read_json, submit, AppState, CancelOnDrop, Prepared};
use crate::worker::{Event, JobError};

/// One server-sent event: its `event:` name and its JSON data.
pub struct Out {
    pub event: &'static str,
    pub data: Value,
}

/// Why an answer ended, in the terms both APIs need.
#[derive(Clone, Debug, PartialEq)]
pub enum EndReason {
    /// The model ended its turn.
    Stop,
    /// A stop string of the request (which one).
    StopSequence(String),
    /// The token limit.
    Length,
    /// The model called tools and ended its turn.
    ToolCalls,
    /// The server is shutting down.
    Cancelled,
}

/// The end of an answer, with its token counts.
#[derive(Clone, Debug)]
pub struct End {
    pub reason: EndReason,
    pub prompt_tokens: usize,
    pub cached_tokens: usize,
    pub completion_tokens: usize,
    /// Tokens of the reasoning text (as the tokenizer encodes it).
    pub reasoning_tokens: usize,
}

/// An API's side of a generation: its events as the answer grows, and the whole answer at the end.
pub trait Encoder: Send + 'static {
    /// The engine has started (the prompt is being prefilled).
    fn start(&mut self, prompt_tokens: usize, cached_tokens: usize) -> Vec<Out>;
    /// One piece of parsed output (never an empty text).
    fn event(&mut self, ev: ParseEvent) -> Vec<Out>;
    /// The answer has ended.
    fn end(&mut self, end: &End) -> Vec<Out>;
    /// The whole answer (called after `end`), or the error to answer with instead.
    fn whole(&mut self) -> Result<Value, ApiError>;
    /// A failure while streaming (before or after `start`): the events that end the stream.
    fn fail(&mut self, e: &ApiError) -> Vec<Out>;
}

enum Fed {
    More(Vec<Out>),
    Finished(Vec<Out>),
    Failed(Vec<Out>, ApiError),
}

/// One generation being turned into an API's events.
pub struct Driver<E> {
    pub enc: E,
    parser: Option<OutputParser>,
    pending: Vec<ParseEvent>,
    tokenizer: Arc<Tokenizer>,
    stop_ids: Vec<u32>,
    stop_strings: Vec<String>,
    ids: Vec<u32>,
    reasoning: String,
    started: bool,
    stream: bool,
    prompt_tokens: usize,
    cached_tokens: usize,
    completion_tokens: usize,
    line: GenerationLine,
}

impl<E: Encoder> Driver<E> {
    pub(crate) fn new(app: &AppState, p: &Prepared, enc: E, line: GenerationLine) -> Self {
        let (cfg, forced) = p.parse.clone().expect("the Responses and Messages APIs render chat prompts");
        let mut parser = OutputParser::new(cfg);
        let pending = if forced.is_empty() { Vec::new() } else { parser.push(&forced) };
        Driver {
            enc,
            parser: Some(parser),
            pending,
            tokenizer: Arc::clone(&app.tokenizer),
            stop_ids: p.spec.stop_ids.clone(),
            stop_strings: p.spec.stop_strings.clone(),
            ids: Vec::new(),
            reasoning: String::new(),
            started: false,
            stream: p.common.stream,
            prompt_tokens: p.prompt.len(),
            cached_tokens: 0,
            completion_tokens: 0,
            line,
        }
    }

    fn pieces(&mut self, evs: Vec<ParseEvent>) -> Vec<Out> {
        let mut out = Vec::new();
        for ev in evs {
            match &ev {
                ParseEvent::Reasoning(t) | ParseEvent::Content(t) if t.is_empty() => continue,
                ParseEvent::Reasoning(t) => self.reasoning.push_str(t),
                _ => {}
            }
            out.extend(self.enc.event(ev));
        }
        out
    }

    /// Which stop string ended the answer: the one that occurs first in the generated text.
    fn matched_stop(&self) -> Option<String> {
        if self.stop_strings.is_empty() {
            return None;
        }
        let text = self.tokenizer.decode(&self.ids, false).unwrap_or_default();
        self.stop_strings.iter().filter_map(|s| text.find(s.as_str()).map(|i| (i, s))).min_by_key(|(i, _)| *i).map(|(_, s)| s.clone())
    }

    fn feed(&mut self, ev: Event) -> Fed {
        match ev {
            Event::Started { prompt_tokens, cached_tokens } => {
                self.started = true;
                self.prompt_tokens = prompt_tokens;
                self.cached_tokens = cached_tokens;
                self.line.prompt_tokens = prompt_tokens;
                self.line.cached_tokens = cached_tokens;
                let mut out = self.enc.start(prompt_tokens, cached_tokens);
                let pending = std::mem::take(&mut self.pending);
                out.extend(self.pieces(pending));
                Fed::More(out)
            }
            Event::Token { id, text, .. } => {
                self.completion_tokens += 1;
                self.ids.push(id);
                let evs = self.parser.as_mut().map(|p| p.push(&text)).unwrap_or_default();
                Fed::More(self.pieces(evs))
            }
            Event::Tail(text) => {
                let evs = self.parser.as_mut().map(|p| p.push(&text)).unwrap_or_default();
                Fed::More(self.pieces(evs))
            }
            Event::Done { finish, completion_tokens, speed } => {
                self.completion_tokens = completion_tokens;
                self.line.completion_tokens = completion_tokens;
                self.line.speed = speed;
                let mut out = Vec::new();
                let mut calls = 0;
                if let Some(p) = self.parser.take() {
                    let (evs, message) = p.finish();
                    out = self.pieces(evs);
                    calls = message.tool_calls.len();
                }
                let ended_by_token = self.ids.last().is_some_and(|id| self.stop_ids.contains(id));
                let reason = match finish {
                    FinishReason::Length => EndReason::Length,
                    FinishReason::Cancelled => EndReason::Cancelled,
                    FinishReason::Stop if calls > 0 => EndReason::ToolCalls,
                    FinishReason::Stop if ended_by_token => EndReason::Stop,
                    FinishReason::Stop => self.matched_stop().map_or(EndReason::Stop, EndReason::StopSequence),
                };
                self.line.finish = Some(match &reason {
                    EndReason::Stop | EndReason::StopSequence(_) => "stop".to_string(),
                    EndReason::Length => "length".to_string(),
                    EndReason::ToolCalls => "tool_calls".to_string(),
                    EndReason::Cancelled => "cancelled (the server is shutting down)".to_string(),
                });
                let reasoning_tokens = if self.reasoning.is_empty() { 0 } else { self.tokenizer.encode(&self.reasoning).map_or(0, |v| v.len()) };
                let end = End {
                    reason,
                    prompt_tokens: self.prompt_tokens,
                    cached_tokens: self.cached_tokens,
                    completion_tokens,
                    reasoning_tokens,
                };
                out.extend(self.enc.end(&end));
                Fed::Finished(out)
            }
            Event::Failed(e) => {
                let e = match e {
                    JobError::TimedOut => ApiError::unavailable("The request waited too long in the queue."),
                    JobError::ShuttingDown => ApiError::shutting_down(),
                    JobError::Engine(e) => ApiError::internal(e),
                };
                self.failed(e)
            }
        }
    }

    fn failed(&mut self, e: ApiError) -> Fed {
        self.line.status = e.status.as_u16();
        self.line.finish = Some(format!("error: {}", e.message));
        let out = if self.stream { self.enc.fail(&e) } else { Vec::new() };
        Fed::Failed(out, e)
    }

    /// The shutdown's grace is over and the engine has not ended this answer: end it here.
    fn end_for_shutdown(&mut self) -> Fed {
        let mut out = Vec::new();
        if !self.started {
            if let Fed::More(o) = self.feed(Event::Started { prompt_tokens: self.prompt_tokens, cached_tokens: 0 }) {
                out = o;
            }
        }
        match self.feed(Event::Done { finish: FinishReason::Cancelled, completion_tokens: self.completion_tokens, speed: None }) {
            Fed::Finished(o) => {
                out.extend(o);
                Fed::Finished(out)
            }
            other => other,
        }
    }
}

fn sse_event(o: Out) -> Result<SseEvent, Infallible> {
    Ok(SseEvent::default().event(o.event).data(o.data.to_string()))
}

async fn whole<E: Encoder>(mut d: Driver<E>, mut rx: UnboundedReceiver<Event>, _guard: CancelOnDrop, grace: impl Future<Output = ()>) -> Response {
    tokio::pin!(grace);
    loop {
        let fed = tokio::select! {
            ev = rx.recv() => match ev {
                Some(ev) => d.feed(ev),
                None => break,
            },
            _ = &mut grace => {
                if !d.started {
                    let e = ApiError::shutting_down();
                    d.line.status = e.status.as_u16();
                    d.line.finish = Some(format!("error: {}", e.message));
                    return e.into_response();
                }
                d.end_for_shutdown()
            }
        };
        match fed {
            Fed::More(_) => {}
            Fed::Finished(_) => {
                return match d.enc.whole() {
                    Ok(v) => Json(v).into_response(),
                    Err(e) => e.into_response(),
                }
            }
            Fed::Failed(_, e) => return e.into_response(),
        }
    }
    let e = ApiError::internal("the engine ended the request without an answer");
    d.line.status = e.status.as_u16();
    d.line.finish = Some(format!("error: {}", e.message));
    e.into_response()
}

fn sse<E: Encoder>(d: Driver<E>, rx: UnboundedReceiver<Event>, guard: CancelOnDrop, grace: impl Future<Output = ()> + Send + 'static) -> Response {
    let grace: Pin<Box<dyn Future<Output = ()> + Send>> = Box::pin(grace);
    let s = stream::unfold(Some((d, rx, guard, grace)), |st| async move {
        let (mut d, mut rx, guard, mut grace) = st?;
        let fed = tokio::select! {
            ev = rx.recv() => match ev {
                Some(ev) => d.feed(ev),
                None => d.failed(ApiError::internal("the engine ended the request without an answer")),
            },
            _ = &mut grace => d.end_for_shutdown(),
        };
        match fed {
            Fed::More(out) => Some((out, Some((d, rx, guard, grace)))),
            Fed::Finished(out) | Fed::Failed(out, _) => Some((out, None)),
        }
    })
    .flat_map(|out| stream::iter(out.into_iter().map(sse_event)));
    Sse::new(s).keep_alive(KeepAlive::default()).into_response()
}

/// Serves one generation request of the Responses or Messages API: reads the JSON body, lets
/// `prepare` turn it into a chat prompt and an encoder (on a blocking thread: rendering and
/// tokenising), queues the job, and answers streamed or whole.
pub(crate) async fn serve<E, F>(app: AppState, req: Request, prepare: F) -> Response
where
    E: Encoder,
    F: FnOnce(&AppState, Value) -> Result<(Prepared, E), ApiError> + Send + 'static,
{
    let mut line = GenerationLine::new(app.log.clone(), req.method().as_str(), req.uri().path(), crate::http::peer(&req));
    let result = async {
        check_content_type(&req)?;
        let v = read_json(req.into_body(), app.max_body_bytes, app.body_timeout).await?;
        let a = app.clone();
        let (prepared, enc) = tokio::task::spawn_blocking(move || prepare(&a, v)).await.map_err(|e| ApiError::internal(e.to_string()))??;
        let (rx, guard) = submit(&app, &prepared)?;
        Ok::<_, ApiError>((prepared, enc, rx, guard))
    }
    .await;
    let (prepared, enc, rx, guard) = match result {
        Ok(x) => x,
        Err(e) => {
            app.metrics.count_status(e.status.as_u16());
            line.disarm();
            return e.into_response();
        }
    };
    app.metrics.count_status(200);
    line.prompt_tokens = prepared.prompt.len();
    let d = Driver::new(&app, &prepared, enc, line);
    let grace = AppState::grace_over(app.shutdown.subscribe(), app.drain_grace);
    let mut resp = if prepared.common.stream { sse(d, rx, guard, grace) } else { whole(d, rx, guard, grace).await };
    resp.extensions_mut().insert(LogsItself);
    resp
}

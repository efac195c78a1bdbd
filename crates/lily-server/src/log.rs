//! The request log: one line per request, as llama-server and vLLM print them. A generation says
//! its prompt, cached and generated tokens, how it ended, its prefill and decode speeds and its
//! time (written when the answer has gone out, or the client went away); any other request says
//! its status and time (successful polls of /health and /metrics are left out).

use std::fmt::Write;
use std::net::SocketAddr;
use std::sync::Arc;
use std::time::Instant;

use axum::extract::{Request, State};
use axum::middleware::Next;
use axum::response::Response;

use crate::routes::AppState;
use crate::worker::Speed;

/// Where log lines go (stderr for `lily serve`; a collector in tests).
#[derive(Clone)]
pub struct RequestLog(Arc<dyn Fn(&str) + Send + Sync>);

impl RequestLog {
    pub fn new(f: impl Fn(&str) + Send + Sync + 'static) -> Self {
        RequestLog(Arc::new(f))
    }
    pub fn stderr() -> Self {
        RequestLog::new(|line| eprintln!("{line}"))
    }
    pub fn write(&self, line: &str) {
        (self.0)(line)
    }
}

impl std::fmt::Debug for RequestLog {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str("RequestLog")
    }
}

/// Marks a response whose request writes its own line (a generation: when it has ended).
#[derive(Clone, Copy)]
pub struct LogsItself;

/// A refusal's message, carried on the response for the log line.
#[derive(Clone)]
pub struct ErrorNote(pub String);

fn head(method: &str, path: &str, status: u16, peer: Option<SocketAddr>) -> String {
    match peer {
        Some(p) => format!("{method} {path} {status} {p}"),
        None => format!("{method} {path} {status}"),
    }
}

fn elapsed(t: Instant) -> String {
    let s = t.elapsed().as_secs_f64();
    if s < 1.0 {
        format!("{:.1} ms", s * 1e3)
    } else {
        format!("{s:.2} s")
    }
}

/// The middleware that writes the line of every request that does not write its own.
pub async fn log_requests(State(app): State<AppState>, req: Request, next: Next) -> Response {
    let Some(log) = app.log.clone() else { return next.run(req).await };
    let t = Instant::now();
    let (method, path, peer) = (req.method().to_string(), req.uri().path().to_string(), crate::http::peer(&req));
    let resp = next.run(req).await;
    if resp.extensions().get::<LogsItself>().is_some() {
        return resp;
    }
    let status = resp.status().as_u16();
    if status == 200 && method == "GET" && (path == "/health" || path == "/metrics") {
        return resp;
    }
    let mut line = head(&method, &path, status, peer);
    if let Some(ErrorNote(m)) = resp.extensions().get::<ErrorNote>() {
        let _ = write!(line, " | {m}");
    }
    let _ = write!(line, " | {}", elapsed(t));
    log.write(&line);
    resp
}

/// One generation's line, filled in as it goes and written once when dropped.
pub struct GenerationLine {
    log: Option<RequestLog>,
    start: Instant,
    method: String,
    path: String,
    peer: Option<SocketAddr>,
    /// The HTTP status (a stream that fails midway has sent its 200 already).
    pub status: u16,
    pub prompt_tokens: usize,
    pub cached_tokens: usize,
    pub completion_tokens: usize,
    /// How it ended (`stop`, `length`, `tool_calls`, an error); None: the client went away.
    pub finish: Option<String>,
    pub speed: Option<Speed>,
}

impl GenerationLine {
    pub fn new(log: Option<RequestLog>, method: &str, path: &str, peer: Option<SocketAddr>) -> Self {
        GenerationLine {
            log,
            start: Instant::now(),
            method: method.to_string(),
            path: path.to_string(),
            peer,
            status: 200,
            prompt_tokens: 0,
            cached_tokens: 0,
            completion_tokens: 0,
            finish: None,
            speed: None,
        }
    }

    /// This request's line is not wanted (it was refused before it reached the engine, and the
    /// middleware writes that line).
    pub fn disarm(&mut self) {
        self.log = None;
    }

    fn line(&self) -> String {
        let mut s = format!(
            "{} | prompt {} tokens ({} cached), {} generated, {}",
            head(&self.method, &self.path, self.status, self.peer),
            self.prompt_tokens,
            self.cached_tokens,
            self.completion_tokens,
            self.finish.as_deref().unwrap_or("ended early: the client went away")
        );
        if let Some(sp) = &self.speed {
            let _ = write!(s, " | prefill {} tokens at {:.1} tok/s, decode {:.1} tok/s", sp.prefilled, sp.prefill_tok_s, sp.decode_tok_s);
        }
        let _ = write!(s, " | {}", elapsed(self.start));
        s
    }
}

impl Drop for GenerationLine {
    fn drop(&mut self) {
        if let Some(log) = &self.log {
            log.write(&self.line());
        }
    }
}

//! The connection layer under the router: accepting TCP connections and speaking HTTP/1.1 with
//! limits (the size and count of request headers, a deadline for a request's headers to arrive, so
//! a slow-loris client cannot hold a connection open for ever), giving the refusals hyper makes by
//! itself (a request it cannot parse, headers too large, a URI too long) an OpenAI-shaped JSON
//! body, and the graceful shutdown: stop accepting, let the routes end their generations, wait a
//! bounded time for the connections to close.

use std::future::Future;
use std::io;
use std::net::SocketAddr;
use std::pin::Pin;
use std::sync::Arc;
use std::task::{ready, Context, Poll};
use std::time::Duration;

use axum::extract::ConnectInfo;
use axum::http::StatusCode;
use hyper::body::Incoming;
use hyper_util::rt::{TokioIo, TokioTimer};
use hyper_util::server::graceful::GracefulShutdown;
use tokio::io::{AsyncRead, AsyncWrite, ReadBuf};
use tokio::net::TcpListener;
use tower::ServiceExt;

use crate::error::ApiError;
use crate::routes::{router, AppState};

/// Limits of the connection layer.
#[derive(Clone, Debug)]
pub struct HttpLimits {
    /// A request's line and headers must have arrived this long after the server starts reading
    /// them (also on an idle keep-alive connection: it is then closed).
    pub header_read_timeout: Duration,
    /// The most bytes of request line and headers (beyond: 431).
    pub max_header_bytes: usize,
    /// The most request headers (beyond: 431).
    pub max_headers: usize,
    /// After a shutdown begins, how long to wait for open connections to finish before giving up.
    pub drain_timeout: Duration,
}

impl Default for HttpLimits {
    /// 10 s for the headers, 64 KiB and 100 headers, 3 s to drain.
    fn default() -> Self {
        HttpLimits {
            header_read_timeout: Duration::from_secs(10),
            max_header_bytes: 64 << 10,
            max_headers: 100,
            drain_timeout: Duration::from_secs(3),
        }
    }
}

/// Serves `app` on `listener` until `shutdown` resolves; then stops accepting, tells the routes to
/// end their generations ([`AppState::begin_shutdown`]) and waits up to `limits.drain_timeout`
/// for the open connections to finish.
pub async fn serve_until(app: AppState, listener: TcpListener, limits: HttpLimits, shutdown: impl Future<Output = ()>) -> io::Result<()> {
    let router = router(app.clone());
    let mut http = hyper::server::conn::http1::Builder::new();
    http.timer(TokioTimer::new())
        .header_read_timeout(limits.header_read_timeout)
        .max_header_size(limits.max_header_bytes)
        .max_headers(limits.max_headers);
    let refusals = Arc::new(Refusals::new(&limits));
    let graceful = GracefulShutdown::new();
    tokio::pin!(shutdown);
    loop {
        let (stream, peer) = tokio::select! {
            accepted = listener.accept() => match accepted {
                Ok(x) => x,
                // Out of file descriptors and the like: wait a moment instead of spinning.
                Err(_) => {
                    tokio::time::sleep(Duration::from_millis(50)).await;
                    continue;
                }
            },
            _ = &mut shutdown => break,
        };
        let _ = stream.set_nodelay(true);
        let router = router.clone();
        let service = hyper::service::service_fn(move |mut req: hyper::Request<Incoming>| {
            req.extensions_mut().insert(ConnectInfo(peer));
            router.clone().oneshot(req.map(axum::body::Body::new))
        });
        let io = TokioIo::new(JsonRefusals::new(stream, Arc::clone(&refusals)));
        let conn = graceful.watch(http.serve_connection(io, service));
        tokio::spawn(async move {
            // A connection's errors (a reset, a parse error already answered) concern only it.
            let _ = conn.await;
        });
    }
    drop(listener);
    app.begin_shutdown();
    let _ = tokio::time::timeout(limits.drain_timeout, graceful.shutdown()).await;
    Ok(())
}

/// The address a request came from (set by [`serve_until`]; absent in other servers).
pub fn peer(req: &axum::extract::Request) -> Option<SocketAddr> {
    req.extensions().get::<ConnectInfo<SocketAddr>>().map(|c| c.0)
}

/// The JSON bodies for hyper's own refusals, made once.
struct Refusals {
    bad_request: Vec<u8>,
    uri_too_long: Vec<u8>,
    headers_too_large: Vec<u8>,
}

impl Refusals {
    fn new(l: &HttpLimits) -> Self {
        let body = |e: ApiError| e.body().to_string().into_bytes();
        Refusals {
            bad_request: body(
                ApiError::bad_request("The request is not valid HTTP/1.1: its request line or a header could not be read.").with_code("bad_http_request"),
            ),
            uri_too_long: body(ApiError::new(StatusCode::URI_TOO_LONG, "invalid_request_error", "The request's URI is too long.").with_code("uri_too_long")),
            headers_too_large: body(
                ApiError::new(
                    StatusCode::REQUEST_HEADER_FIELDS_TOO_LARGE,
                    "invalid_request_error",
                    format!("The request's headers are too large: at most {} bytes and {} headers are accepted.", l.max_header_bytes, l.max_headers),
                )
                .with_code("headers_too_large"),
            ),
        }
    }

    fn for_status(&self, status: u16) -> Vec<u8> {
        match status {
            414 => self.uri_too_long.clone(),
            431 => self.headers_too_large.clone(),
            400 => self.bad_request.clone(),
            s => {
                let code = StatusCode::from_u16(s).unwrap_or(StatusCode::BAD_REQUEST);
                let kind = if s >= 500 { "server_error" } else { "invalid_request_error" };
                let reason = code.canonical_reason().unwrap_or("Error");
                ApiError::new(code, kind, format!("HTTP {s}: {reason}.")).body().to_string().into_bytes()
            }
        }
    }
}

/// A connection's stream, which turns the bodiless error responses hyper writes on its own (for a
/// request it could not parse: 400, 414, 431) into responses with a JSON body. Everything else
/// passes through untouched. A response is recognised at the start of a write: a status line of
/// 4xx or 5xx whose head says `content-length: 0` and has no content type (the routes never answer
/// so: their errors always carry JSON).
struct JsonRefusals<T> {
    inner: T,
    refusals: Arc<Refusals>,
    /// A rewritten response, and how much of it is written.
    pending: Vec<u8>,
    sent: usize,
}

impl<T> JsonRefusals<T> {
    fn new(inner: T, refusals: Arc<Refusals>) -> Self {
        JsonRefusals { inner, refusals, pending: Vec::new(), sent: 0 }
    }
}

/// If `buf` starts with a bodiless error head: its length and the response to write instead.
fn rewrite(buf: &[u8], refusals: &Refusals) -> Option<(usize, Vec<u8>)> {
    if !(buf.starts_with(b"HTTP/1.1 ") || buf.starts_with(b"HTTP/1.0 ")) || buf.len() < 12 {
        return None;
    }
    let status: u16 = std::str::from_utf8(&buf[9..12]).ok()?.parse().ok()?;
    if !(400..600).contains(&status) {
        return None;
    }
    let end = buf.windows(4).position(|w| w == b"\r\n\r\n")?;
    let head = std::str::from_utf8(&buf[..end]).ok()?;
    let mut lines = head.split("\r\n");
    let status_line = lines.next()?;
    let mut kept = Vec::new();
    let mut empty = false;
    for line in lines {
        let lower = line.to_ascii_lowercase();
        if lower.starts_with("content-type:") {
            return None;
        }
        if let Some(v) = lower.strip_prefix("content-length:") {
            if v.trim() != "0" {
                return None;
            }
            empty = true;
        } else if !lower.starts_with("connection:") {
            kept.push(line);
        }
    }
    if !empty {
        return None;
    }
    let body = refusals.for_status(status);
    let mut out = format!("{status_line}\r\n").into_bytes();
    for line in kept {
        out.extend_from_slice(line.as_bytes());
        out.extend_from_slice(b"\r\n");
    }
    out.extend_from_slice(format!("content-type: application/json\r\ncontent-length: {}\r\nconnection: close\r\n\r\n", body.len()).as_bytes());
    out.extend_from_slice(&body);
    Some((end + 4, out))
}

impl<T: AsyncWrite + Unpin> JsonRefusals<T> {
    fn poll_pending(&mut self, cx: &mut Context<'_>) -> Poll<io::Result<()>> {
        while self.sent < self.pending.len() {
            let n = ready!(Pin::new(&mut self.inner).poll_write(cx, &self.pending[self.sent..]))?;
            if n == 0 {
                return Poll::Ready(Err(io::ErrorKind::WriteZero.into()));
            }
            self.sent += n;
        }
        self.pending.clear();
        self.sent = 0;
        Poll::Ready(Ok(()))
    }
}

impl<T: AsyncRead + Unpin> AsyncRead for JsonRefusals<T> {
    fn poll_read(mut self: Pin<&mut Self>, cx: &mut Context<'_>, buf: &mut ReadBuf<'_>) -> Poll<io::Result<()>> {
        Pin::new(&mut self.inner).poll_read(cx, buf)
    }
}

impl<T: AsyncWrite + Unpin> AsyncWrite for JsonRefusals<T> {
    fn poll_write(mut self: Pin<&mut Self>, cx: &mut Context<'_>, buf: &[u8]) -> Poll<io::Result<usize>> {
        let this = &mut *self;
        ready!(this.poll_pending(cx))?;
        if let Some((consumed, replacement)) = rewrite(buf, &this.refusals) {
            this.pending = replacement;
            this.sent = 0;
            // Start writing now; what is left goes out on the next write, flush or shutdown.
            if let Poll::Ready(Err(e)) = this.poll_pending(cx) {
                return Poll::Ready(Err(e));
            }
            return Poll::Ready(Ok(consumed));
        }
        Pin::new(&mut this.inner).poll_write(cx, buf)
    }

    fn poll_flush(mut self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<io::Result<()>> {
        ready!(self.poll_pending(cx))?;
        Pin::new(&mut self.inner).poll_flush(cx)
    }

    fn poll_shutdown(mut self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<io::Result<()>> {
        ready!(self.poll_pending(cx))?;
        Pin::new(&mut self.inner).poll_shutdown(cx)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn refusals() -> Refusals {
        Refusals::new(&HttpLimits::default())
    }

    #[test]
    fn bodiless_error_heads_get_a_json_body() {
        let head = b"HTTP/1.1 431 Request Header Fields Too Large\r\ncontent-length: 0\r\ndate: Mon, 01 Jan 2024 00:00:00 GMT\r\n\r\n";
        let (n, out) = rewrite(head, &refusals()).unwrap();
        assert_eq!(n, head.len());
        let text = String::from_utf8(out).unwrap();
        let (h, body) = text.split_once("\r\n\r\n").unwrap();
        assert!(h.starts_with("HTTP/1.1 431 Request Header Fields Too Large\r\n"), "{h}");
        assert!(h.contains("\r\ndate: Mon"), "{h}");
        assert!(h.contains("content-type: application/json"), "{h}");
        assert!(h.contains(&format!("content-length: {}", body.len())), "{h}");
        let v: serde_json::Value = serde_json::from_str(body).unwrap();
        assert_eq!(v["error"]["code"], "headers_too_large");
        assert_eq!(v["error"]["type"], "invalid_request_error");
    }

    #[test]
    fn responses_with_bodies_and_successes_pass_through() {
        let r = refusals();
        for head in [
            &b"HTTP/1.1 200 OK\r\ncontent-length: 0\r\n\r\n"[..],
            b"HTTP/1.1 404 Not Found\r\ncontent-type: application/json\r\ncontent-length: 0\r\n\r\n",
            b"HTTP/1.1 400 Bad Request\r\ncontent-length: 12\r\n\r\n{\"error\": 1}",
            b"HTTP/1.1 400 Bad Request\r\ntransfer-encoding: chunked\r\n\r\n",
            b"HTTP/1.1 400 Bad Req",
            b"data: HTTP/1.1 400\r\ncontent-length: 0\r\n\r\n",
        ] {
            assert!(rewrite(head, &r).is_none(), "{}", String::from_utf8_lossy(head));
        }
    }
}

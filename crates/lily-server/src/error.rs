//! Errors as OpenAI clients expect them: an HTTP status and
//! `{"error": {"message", "type", "param", "code"}}` (and `Retry-After` on a 429 or 503 that says
//! when to come back).

use axum::http::StatusCode;
use axum::response::{IntoResponse, Response};
use serde_json::json;

#[derive(Debug, Clone)]
pub struct ApiError {
    pub status: StatusCode,
    pub message: String,
    pub kind: &'static str,
    pub param: Option<String>,
    pub code: Option<&'static str>,
    /// Seconds after which a retry may succeed (the `Retry-After` header).
    pub retry_after: Option<u64>,
}

impl ApiError {
    pub fn new(status: StatusCode, kind: &'static str, message: impl Into<String>) -> Self {
        ApiError { status, message: message.into(), kind, param: None, code: None, retry_after: None }
    }
    /// 400 about one field of the request.
    pub fn invalid(param: impl Into<String>, message: impl Into<String>) -> Self {
        ApiError { param: Some(param.into()), ..Self::bad_request(message) }
    }
    pub fn bad_request(message: impl Into<String>) -> Self {
        Self::new(StatusCode::BAD_REQUEST, "invalid_request_error", message)
    }
    pub fn with_code(mut self, code: &'static str) -> Self {
        self.code = Some(code);
        self
    }
    pub fn unauthorized() -> Self {
        Self::new(StatusCode::UNAUTHORIZED, "authentication_error", "Invalid or missing API key: send `Authorization: Bearer <key>` (or `x-api-key: <key>`).")
            .with_code("invalid_api_key")
    }
    pub fn not_found(what: &str) -> Self {
        Self::new(StatusCode::NOT_FOUND, "not_found_error", format!("{what} not found"))
    }
    pub fn too_large(limit: usize) -> Self {
        Self::new(StatusCode::PAYLOAD_TOO_LARGE, "invalid_request_error", format!("The request body is larger than {limit} bytes."))
    }
    /// 429; `retry_after`: seconds until a place in the queue is likely to be free.
    pub fn queue_full(retry_after: u64) -> Self {
        let mut e = Self::new(
            StatusCode::TOO_MANY_REQUESTS,
            "rate_limit_error",
            format!("The server is busy: its request queue is full. Retry in about {retry_after} s."),
        )
        .with_code("queue_full");
        e.retry_after = Some(retry_after);
        e
    }
    pub fn shutting_down() -> Self {
        Self::unavailable("The server is shutting down.").with_code("shutting_down")
    }
    pub fn unavailable(message: impl Into<String>) -> Self {
        Self::new(StatusCode::SERVICE_UNAVAILABLE, "server_error", message)
    }
    pub fn internal(message: impl Into<String>) -> Self {
        Self::new(StatusCode::INTERNAL_SERVER_ERROR, "server_error", message)
    }
    pub fn body(&self) -> serde_json::Value {
        json!({"error": {"message": self.message, "type": self.kind, "param": self.param, "code": self.code}})
    }
}

impl IntoResponse for ApiError {
    fn into_response(self) -> Response {
        let self_copy = self.clone();
        let mut r = (self.status, axum::Json(self.body())).into_response();
        if let Some(s) = self.retry_after {
            r.headers_mut().insert(axum::http::header::RETRY_AFTER, s.into());
        }
        let note = match &self.param {
            Some(p) => format!("{p}: {}", self.message),
            None => self.message,
        };
        r.extensions_mut().insert(crate::log::ErrorNote(note));
        // Kept so that the Anthropic routes can give the same error in Anthropic's shape.
        r.extensions_mut().insert(self_copy);
        r
    }
}

//! Anthropic's Messages API: `POST /v1/messages` (streamed or not) and `POST
//! /v1/messages/count_tokens`, with Anthropic's error shape (`{"type": "error", "error": {"type",
//! "message"}}`) on every refusal of these routes — authentication, routing and body errors
//! included (`error_shape`). A request is checked field by field (a bad one is a 400 naming its
//! path), translated into a chat-completions request — `system` into the system message,
//! `tool_use` blocks into tool calls, `tool_result` blocks into tool messages, `thinking` blocks
//! into the reasoning of their message, `tools` with `input_schema` into functions, `tool_choice`
//! auto/any/tool/none, `thinking` enabled/adaptive/disabled into the template's thinking switch —
//! and rendered, tokenised, cached and parsed as chat completions are. The answer is a message
//! object, or the documented stream (`message_start`, `ping`, `content_block_start` / `_delta`
//! (`thinking_delta`, `text_delta`, `input_json_delta`) / `_stop`, `message_delta` with the stop
//! reason and usage, `message_stop`).
//!
//! Claude Code (since 2.1.36) opens its system prompt with a text block
//! `x-anthropic-billing-header: cc_version=…; cc_entrypoint=…; cch=…;` whose values change from
//! one request to the next: at the very start of the prompt it would make every request miss the
//! prefix cache. It is dropped before rendering (it is billing metadata, not an instruction).
//!
//! `max_tokens` is required and clients send the largest their model allows (Claude Code: 32000 to
//! 128000): beyond what the context leaves it is cut to fit (the answer then ends with
//! `max_tokens` at the end of the context) instead of refused.
//!
//! Usage is in Anthropic's terms: `input_tokens` are the prompt tokens prefilled,
//! `cache_read_input_tokens` those taken from the prefix cache (the `cached_tokens` of the OpenAI
//! APIs); their sum is the prompt.

use axum::body::Body;
use axum::extract::{Request, State};
use axum::http::{header, StatusCode};
use axum::middleware::Next;
use axum::response::{IntoResponse, Response};
use axum::Json;
use lily_parser::Event as ParseEvent;
use serde_json::{json, Map, Value};

use crate::error::ApiError;
use crate::fields::{get, opt_array, opt_bool, opt_f32, opt_int, opt_object, opt_str, wrong};
use crate::routes::{check_content_type, check_prompt_bytes, rand_id, read_json, template_error, AppState};
use crate::routes::prepare_chat_with;
use crate::stream::{End, EndReason, Encoder, Out};

/// The prefix of Claude Code's per-request billing block in `system`.
pub const BILLING_HEADER: &str = "x-anthropic-billing-header:";

/// Anthropic's error `type` for an HTTP status.
pub fn error_type(status: StatusCode) -> &'static str {
    match status.as_u16() {
        401 => "authentication_error",
        403 => "permission_error",
        404 => "not_found_error",
        413 => "request_too_large",
        429 => "rate_limit_error",
        503 | 529 => "overloaded_error",
        s if s >= 500 => "api_error",
        _ => "invalid_request_error",
    }
}

/// An error in Anthropic's shape; the field at fault, if any, is named in the message.
pub fn error_body(e: &ApiError) -> Value {
    let message = match &e.param {
        Some(p) if !e.message.contains(p.as_str()) => format!("{p}: {}", e.message),
        _ => e.message.clone(),
    };
    json!({"type": "error", "error": {"type": error_type(e.status), "message": message}, "request_id": format!("req_{:016x}", rand_id())})
}

/// Middleware: on the `/v1/messages` routes, every error response (they all come from an
/// `ApiError`, which travels in the response's extensions) gets Anthropic's shape.
pub async fn error_shape(req: Request, next: Next) -> Response {
    let anthropic = req.uri().path().starts_with("/v1/messages");
    let mut resp = next.run(req).await;
    if !anthropic {
        return resp;
    }
    let Some(e) = resp.extensions().get::<ApiError>().cloned() else { return resp };
    *resp.body_mut() = Body::from(error_body(&e).to_string());
    resp.headers_mut().remove(header::CONTENT_LENGTH);
    resp
}

/// `2026-01-02T03:04:05Z` for a Unix time.
pub fn rfc3339(secs: u64) -> String {
    let days = (secs / 86_400) as i64;
    let rem = secs % 86_400;
    // Howard Hinnant's civil-from-days.
    let z = days + 719_468;
    let era = z.div_euclid(146_097);
    let doe = z - era * 146_097;
    let yoe = (doe - doe / 1460 + doe / 36_524 - doe / 146_096) / 365;
    let doy = doe - (365 * yoe + yoe / 4 - yoe / 100);
    let mp = (5 * doy + 2) / 153;
    let d = doy - (153 * mp + 2) / 5 + 1;
    let m = if mp < 10 { mp + 3 } else { mp - 9 };
    let y = yoe + era * 400 + i64::from(m <= 2);
    format!("{y:04}-{m:02}-{d:02}T{:02}:{:02}:{:02}Z", rem / 3600, rem % 3600 / 60, rem % 60)
}

pub async fn messages(State(app): State<AppState>, req: Request) -> Response {
    crate::stream::serve(app, req, |app, body| {
        let (chat, model, paths) = translate(&body, false)?;
        let prepared = prepare_chat_with(app, &chat, true).map_err(|e| crate::conversation::rename_tool_param(rename_param(e), &paths, "input_schema"))?;
        Ok((prepared, MessagesEncoder::new(model)))
    })
    .await
}

/// `POST /v1/messages/count_tokens`: the prompt's tokens as `/v1/messages` would render it.
pub async fn count_tokens(State(app): State<AppState>, req: Request) -> Response {
    let result = async {
        check_content_type(&req)?;
        let body = read_json(req.into_body(), app.max_body_bytes, app.body_timeout).await?;
        let a = app.clone();
        tokio::task::spawn_blocking(move || {
            let (chat, _, paths) = translate(&body, true)?;
            crate::request::parse_chat(&chat).map_err(|e| crate::conversation::rename_tool_param(rename_param(e), &paths, "input_schema"))?;
            let mut chat = chat;
            if chat.get("tool_choice") == Some(&json!("none")) {
                chat.as_object_mut().unwrap().remove("tools");
            }
            if let Some(Value::Array(m)) = chat.get("messages") {
                chat["messages"] = Value::Array(crate::conversation::normalize_system(m));
            }
            let text = a.template.render_request(&chat).map_err(template_error).map_err(rename_param)?;
            check_prompt_bytes(&a, text.len(), "messages")?;
            let n = a.tokenizer.encode(&text).map_err(|e| ApiError::internal(e.to_string()))?.len();
            Ok::<_, ApiError>(n)
        })
        .await
        .map_err(|e| ApiError::internal(e.to_string()))?
    }
    .await;
    match result {
        Ok(n) => Json(json!({"input_tokens": n})).into_response(),
        Err(e) => e.into_response(),
    }
}

// ---------------------------------------------------------------------------------------------
// The request

/// Tool types Anthropic runs on its side (or that need its computer-use harness): left out.
fn is_server_tool(ty: &str) -> bool {
    ty != "custom" && (ty.starts_with("web_search") || ty.starts_with("web_fetch") || ty.starts_with("code_execution") || ty.starts_with("bash_")
        || ty.starts_with("text_editor") || ty.starts_with("computer_") || ty.starts_with("memory_") || ty.starts_with("tool_search")
        || ty == "mcp_toolset")
}

fn str_field<'a>(m: &'a Map<String, Value>, key: &str, at: &str) -> Result<&'a str, ApiError> {
    match m.get(key) {
        Some(Value::String(s)) => Ok(s),
        None | Some(Value::Null) => Err(ApiError::invalid(format!("{at}.{key}"), format!("`{at}.{key}` is required"))),
        Some(v) => Err(wrong(&format!("{at}.{key}"), "a string", v)),
    }
}

fn block_type<'a>(b: &'a Map<String, Value>, at: &str) -> Result<&'a str, ApiError> {
    match b.get("type") {
        Some(Value::String(t)) => Ok(t),
        None | Some(Value::Null) => Err(ApiError::invalid(format!("{at}.type"), "each content block needs a `type`")),
        Some(v) => Err(wrong(&format!("{at}.type"), "a string", v)),
    }
}

fn media(ty: &str, at: &str) -> ApiError {
    ApiError::invalid(format!("{at}.type"), format!("content blocks of type `{ty}` are not supported: lily serves the text model"))
}

/// The text of `system`: a string, or text blocks (Claude Code's billing block left out).
fn system_text(v: &Value) -> Result<String, ApiError> {
    match v {
        Value::String(s) => Ok(s.clone()),
        Value::Array(blocks) => {
            let mut texts = Vec::new();
            for (i, b) in blocks.iter().enumerate() {
                let at = format!("system[{i}]");
                let Some(o) = b.as_object() else { return Err(wrong(&at, "a text block", b)) };
                match block_type(o, &at)? {
                    "text" => {
                        let t = str_field(o, "text", &at)?;
                        if !t.trim_start().starts_with(BILLING_HEADER) {
                            texts.push(t);
                        }
                    }
                    other => return Err(ApiError::invalid(format!("{at}.type"), format!("`system` takes text blocks, not `{other}`"))),
                }
            }
            Ok(texts.join("\n\n"))
        }
        v => Err(wrong("system", "a string or a list of text blocks", v)),
    }
}

/// A `tool_result`'s content: a string or text blocks.
fn result_text(v: Option<&Value>, at: &str) -> Result<String, ApiError> {
    match v {
        None | Some(Value::Null) => Ok(String::new()),
        Some(Value::String(s)) => Ok(s.clone()),
        Some(Value::Array(blocks)) => {
            let mut out = Vec::new();
            for (j, b) in blocks.iter().enumerate() {
                let bat = format!("{at}[{j}]");
                let Some(o) = b.as_object() else { return Err(wrong(&bat, "a content block", b)) };
                match block_type(o, &bat)? {
                    "text" => out.push(str_field(o, "text", &bat)?.to_string()),
                    t @ ("image" | "document") => return Err(media(t, &bat)),
                    "search_result" | "tool_reference" => {}
                    other => return Err(ApiError::invalid(format!("{bat}.type"), format!("unknown block type `{other}` in a tool result"))),
                }
            }
            Ok(out.join("\n"))
        }
        Some(v) => Err(wrong(at, "a string or a list of content blocks", v)),
    }
}

/// `messages` as chat messages.
fn chat_messages(messages: &[Value], out: &mut Vec<Value>) -> Result<(), ApiError> {
    for (i, msg) in messages.iter().enumerate() {
        let at = format!("messages[{i}]");
        let Some(m) = msg.as_object() else { return Err(wrong(&at, "a message object", msg)) };
        let role = match m.get("role") {
            Some(Value::String(r)) if r == "user" || r == "assistant" => r.as_str(),
            // Claude Code sends system turns in the middle of a conversation.
            Some(Value::String(r)) if r == "system" => "system",
            Some(Value::String(r)) => return Err(ApiError::invalid(format!("{at}.role"), format!("unknown role `{r}` (user or assistant)"))),
            None | Some(Value::Null) => return Err(ApiError::invalid(format!("{at}.role"), "each message needs a `role`")),
            Some(v) => return Err(wrong(&format!("{at}.role"), "a string", v)),
        };
        let blocks: Vec<Value> = match m.get("content") {
            Some(Value::String(s)) => vec![json!({"type": "text", "text": s})],
            Some(Value::Array(b)) => b.clone(),
            None | Some(Value::Null) => return Err(ApiError::invalid(format!("{at}.content"), "a message needs `content`")),
            Some(v) => return Err(wrong(&format!("{at}.content"), "a string or a list of content blocks", v)),
        };
        let mut text = Vec::new();
        let mut thinking = Vec::new();
        let mut calls = Vec::new();
        let mut results = Vec::new();
        for (j, b) in blocks.iter().enumerate() {
            let bat = format!("{at}.content[{j}]");
            let Some(o) = b.as_object() else { return Err(wrong(&bat, "a content block object", b)) };
            match block_type(o, &bat)? {
                "text" => text.push(str_field(o, "text", &bat)?.to_string()),
                "thinking" if role == "assistant" => {
                    thinking.push(str_field(o, "thinking", &bat)?.to_string());
                    opt_str(o, "signature", &format!("{bat}.signature"))?;
                }
                "redacted_thinking" if role == "assistant" => {}
                "tool_use" if role == "assistant" => {
                    let id = str_field(o, "id", &bat)?;
                    let name = str_field(o, "name", &bat)?;
                    if name.is_empty() {
                        return Err(ApiError::invalid(format!("{bat}.name"), "the name must not be empty"));
                    }
                    let input = match o.get("input") {
                        Some(v @ Value::Object(_)) => v.clone(),
                        None | Some(Value::Null) => return Err(ApiError::invalid(format!("{bat}.input"), "a `tool_use` block needs `input`")),
                        Some(v) => return Err(wrong(&format!("{bat}.input"), "an object", v)),
                    };
                    calls.push(json!({"id": id, "type": "function", "function": {"name": name, "arguments": input.to_string()}}));
                }
                "tool_result" if role == "user" => {
                    let id = str_field(o, "tool_use_id", &bat)?;
                    let mut content = result_text(o.get("content"), &format!("{bat}.content"))?;
                    if opt_bool(o, "is_error", &format!("{bat}.is_error"))?.unwrap_or(false) {
                        content = format!("Error: {content}");
                    }
                    results.push(json!({"role": "tool", "tool_call_id": id, "content": content}));
                }
                t @ ("thinking" | "redacted_thinking" | "tool_use" | "tool_result") => {
                    return Err(ApiError::invalid(format!("{bat}.type"), format!("`{t}` blocks belong in {} messages", if t == "tool_result" { "user" } else { "assistant" })))
                }
                t @ ("image" | "document" | "audio" | "video" | "container_upload") => return Err(media(t, &bat)),
                // Results of Anthropic's own tools, and citations: lily made none.
                "server_tool_use" | "web_search_tool_result" | "web_fetch_tool_result" | "code_execution_tool_result" | "mcp_tool_use"
                | "mcp_tool_result" | "search_result" | "tool_reference" => {}
                other => return Err(ApiError::invalid(format!("{bat}.type"), format!("unknown content block type `{other}`"))),
            }
        }
        match role {
            "assistant" => {
                let mut a = json!({"role": "assistant", "content": text.join("")});
                if !thinking.is_empty() {
                    a["reasoning_content"] = json!(thinking.join("\n"));
                }
                if !calls.is_empty() {
                    a["tool_calls"] = Value::Array(calls);
                }
                out.push(a);
            }
            _ => {
                out.extend(results);
                if !text.is_empty() {
                    out.push(json!({"role": role, "content": text.join("\n")}));
                }
            }
        }
    }
    Ok(())
}

/// The tools as chat functions, and each one's path in the request.
fn chat_tools(tools: &[Value]) -> Result<(Vec<Value>, Vec<String>), ApiError> {
    let mut out = Vec::new();
    let mut paths = Vec::new();
    for (i, t) in tools.iter().enumerate() {
        let at = format!("tools[{i}]");
        let Some(o) = t.as_object() else { return Err(wrong(&at, "a tool object", t)) };
        if let Some(ty) = opt_str(o, "type", &format!("{at}.type"))? {
            if is_server_tool(ty) {
                continue;
            }
            if ty != "custom" {
                return Err(ApiError::invalid(format!("{at}.type"), format!("unknown tool type `{ty}` (a tool with `input_schema`, type `custom` or none)")));
            }
        }
        let name = str_field(o, "name", &at)?;
        if name.is_empty() {
            return Err(ApiError::invalid(format!("{at}.name"), "the name must not be empty"));
        }
        let schema = match o.get("input_schema") {
            Some(s @ Value::Object(_)) => s.clone(),
            None | Some(Value::Null) => return Err(ApiError::invalid(format!("{at}.input_schema"), "a tool needs an `input_schema`")),
            Some(v) => return Err(wrong(&format!("{at}.input_schema"), "a JSON schema object", v)),
        };
        let mut f = json!({"name": name, "parameters": schema});
        if let Some(d) = opt_str(o, "description", &format!("{at}.description"))? {
            f["description"] = json!(d);
        }
        if let Some(s) = opt_bool(o, "strict", &format!("{at}.strict"))? {
            f["strict"] = json!(s);
        }
        out.push(json!({"type": "function", "function": f}));
        paths.push(at);
    }
    Ok((out, paths))
}

/// Chat-completions field paths as this API names them.
fn rename_param(e: ApiError) -> ApiError {
    let Some(p) = e.param.clone() else { return e };
    let renamed = if p.starts_with("messages") {
        "messages".to_string()
    } else if p == "stop" {
        "stop_sequences".to_string()
    } else {
        p
    };
    ApiError { param: Some(renamed), ..e }
}

/// Checks a Messages request and translates it into a chat-completions request; also returns the
/// model name to answer with. `counting`: a `count_tokens` request (no `max_tokens`).
fn translate(body: &Value, counting: bool) -> Result<(Value, String, Vec<String>), ApiError> {
    let Some(m) = body.as_object() else { return Err(ApiError::bad_request("The request body must be a JSON object.")) };
    let model = opt_str(m, "model", "model")?.unwrap_or("lily").to_string();
    let stream = opt_bool(m, "stream", "stream")?.unwrap_or(false);
    // Fields lily does not use, checked for their type (a container is an id or an object).
    for key in ["metadata", "context_management", "output_config"] {
        opt_object(m, key, key)?;
    }
    opt_str(m, "service_tier", "service_tier")?;
    let msgs = match m.get("messages") {
        Some(Value::Array(a)) if !a.is_empty() => a,
        Some(Value::Array(_)) => return Err(ApiError::invalid("messages", "`messages` must not be empty")),
        None | Some(Value::Null) => return Err(ApiError::invalid("messages", "`messages` is required")),
        Some(v) => return Err(wrong("messages", "a list of messages", v)),
    };
    let mut messages = Vec::new();
    if let Some(s) = get(m, "system") {
        let text = system_text(s)?;
        if !text.is_empty() {
            messages.push(json!({"role": "system", "content": text}));
        }
    }
    chat_messages(msgs, &mut messages)?;
    let mut chat = json!({"messages": messages, "stream": stream && !counting});
    match opt_int(m, "max_tokens", "max_tokens", 1, i128::from(u64::MAX))? {
        Some(n) => chat["max_tokens"] = json!(n as u64),
        None if counting => {}
        None => return Err(ApiError::invalid("max_tokens", "`max_tokens` is required")),
    }
    let (tools, paths) = match opt_array(m, "tools", "tools")? {
        Some(t) => chat_tools(t)?,
        None => (Vec::new(), Vec::new()),
    };
    let mut parallel = true;
    let mut choice = json!("auto");
    if let Some(tc) = opt_object(m, "tool_choice", "tool_choice")? {
        if opt_bool(tc, "disable_parallel_tool_use", "tool_choice.disable_parallel_tool_use")?.unwrap_or(false) {
            parallel = false;
        }
        choice = match str_field(tc, "type", "tool_choice")? {
            "auto" => json!("auto"),
            "any" => json!("required"),
            "none" => json!("none"),
            "tool" => json!({"type": "function", "function": {"name": str_field(tc, "name", "tool_choice")?}}),
            other => return Err(ApiError::invalid("tool_choice.type", format!("unknown tool_choice type `{other}` (auto, any, tool or none)"))),
        };
    }
    if !tools.is_empty() {
        chat["tools"] = Value::Array(tools);
        chat["tool_choice"] = choice;
        chat["parallel_tool_calls"] = json!(parallel);
    } else if choice != "auto" && choice != "none" {
        return Err(ApiError::invalid("tool_choice", "tool_choice asks for a tool call but the request has no tools"));
    }
    if let Some(stops) = opt_array(m, "stop_sequences", "stop_sequences")? {
        for (i, s) in stops.iter().enumerate() {
            if !s.is_string() {
                return Err(wrong(&format!("stop_sequences[{i}]"), "a string", s));
            }
        }
        if !stops.is_empty() {
            chat["stop"] = Value::Array(stops.to_vec());
        }
    }
    if let Some(t) = opt_f32(m, "temperature", "temperature")? {
        if !(0.0..=1.0).contains(&t) {
            return Err(ApiError::invalid("temperature", format!("`temperature` must be from 0 to 1, got {t}")));
        }
        chat["temperature"] = json!(t);
    }
    if let Some(p) = opt_f32(m, "top_p", "top_p")? {
        chat["top_p"] = json!(p);
    }
    if let Some(k) = opt_int(m, "top_k", "top_k", 0, i128::from(i32::MAX))? {
        chat["top_k"] = json!(k as i64);
    }
    // Thinking: Anthropic's default is off; "enabled" and "adaptive" turn it on.
    let mut thinking = false;
    if let Some(t) = opt_object(m, "thinking", "thinking")? {
        thinking = match str_field(t, "type", "thinking")? {
            "enabled" => {
                opt_int(t, "budget_tokens", "thinking.budget_tokens", 0, i128::from(u64::MAX))?;
                true
            }
            "adaptive" => true,
            "disabled" => false,
            other => return Err(ApiError::invalid("thinking.type", format!("unknown thinking type `{other}` (enabled, adaptive or disabled)"))),
        };
        opt_str(t, "display", "thinking.display")?;
    }
    chat["chat_template_kwargs"] = json!({"enable_thinking": thinking});
    Ok((chat, model, paths))
}

// ---------------------------------------------------------------------------------------------
// The answer

enum Block {
    Thinking,
    Text,
    ToolUse { args: String },
}

pub struct MessagesEncoder {
    id: String,
    model: String,
    content: Vec<Value>,
    open: Option<(Block, usize)>,
    started: bool,
    stop_reason: Value,
    stop_sequence: Value,
    usage: Value,
    cancelled: bool,
}

impl MessagesEncoder {
    fn new(model: String) -> Self {
        MessagesEncoder {
            id: format!("msg_{:016x}{:08x}", rand_id(), rand_id() as u32),
            model,
            content: Vec::new(),
            open: None,
            started: false,
            stop_reason: Value::Null,
            stop_sequence: Value::Null,
            usage: json!({"input_tokens": 0, "output_tokens": 0, "cache_creation_input_tokens": 0, "cache_read_input_tokens": 0}),
            cancelled: false,
        }
    }

    fn message(&self) -> Value {
        json!({"id": self.id, "type": "message", "role": "assistant", "model": self.model, "content": self.content,
            "stop_reason": self.stop_reason, "stop_sequence": self.stop_sequence, "usage": self.usage})
    }

    fn close(&mut self) -> Vec<Out> {
        let Some((block, index)) = self.open.take() else { return Vec::new() };
        if let Block::ToolUse { args } = block {
            let input = serde_json::from_str::<Value>(&args).ok().filter(Value::is_object).unwrap_or_else(|| json!({}));
            self.content[index]["input"] = input;
        }
        vec![Out { event: "content_block_stop", data: json!({"type": "content_block_stop", "index": index}) }]
    }

    fn open(&mut self, block: Block, start: Value) -> Vec<Out> {
        let mut out = self.close();
        let index = self.content.len();
        self.content.push(start.clone());
        out.push(Out { event: "content_block_start", data: json!({"type": "content_block_start", "index": index, "content_block": start}) });
        self.open = Some((block, index));
        out
    }

    fn delta(&self, index: usize, delta: Value) -> Out {
        Out { event: "content_block_delta", data: json!({"type": "content_block_delta", "index": index, "delta": delta}) }
    }

    fn begin(&mut self) -> Vec<Out> {
        self.started = true;
        vec![
            Out { event: "message_start", data: json!({"type": "message_start", "message": self.message()}) },
            Out { event: "ping", data: json!({"type": "ping"}) },
        ]
    }
}

impl Encoder for MessagesEncoder {
    fn start(&mut self, prompt_tokens: usize, cached_tokens: usize) -> Vec<Out> {
        self.usage = json!({"input_tokens": prompt_tokens - cached_tokens, "output_tokens": 0,
            "cache_creation_input_tokens": 0, "cache_read_input_tokens": cached_tokens});
        self.begin()
    }

    fn event(&mut self, ev: ParseEvent) -> Vec<Out> {
        let mut out = Vec::new();
        match ev {
            ParseEvent::Reasoning(t) => {
                if !matches!(self.open, Some((Block::Thinking, _))) {
                    out = self.open(Block::Thinking, json!({"type": "thinking", "thinking": "", "signature": ""}));
                }
                let i = self.open.as_ref().unwrap().1;
                let s = self.content[i]["thinking"].as_str().unwrap_or("").to_string() + &t;
                self.content[i]["thinking"] = json!(s);
                out.push(self.delta(i, json!({"type": "thinking_delta", "thinking": t})));
            }
            ParseEvent::Content(t) => {
                if !matches!(self.open, Some((Block::Text, _))) {
                    out = self.open(Block::Text, json!({"type": "text", "text": ""}));
                }
                let i = self.open.as_ref().unwrap().1;
                let s = self.content[i]["text"].as_str().unwrap_or("").to_string() + &t;
                self.content[i]["text"] = json!(s);
                out.push(self.delta(i, json!({"type": "text_delta", "text": t})));
            }
            ParseEvent::ToolCallStart { id, name, .. } => {
                let id = format!("toolu_{}", id.strip_prefix("call_").unwrap_or(&id));
                out = self.open(Block::ToolUse { args: String::new() }, json!({"type": "tool_use", "id": id, "name": name, "input": {}}));
            }
            ParseEvent::ToolCallArguments { fragment, .. } => {
                if let Some((Block::ToolUse { args }, i)) = self.open.as_mut() {
                    args.push_str(&fragment);
                    let i = *i;
                    out.push(self.delta(i, json!({"type": "input_json_delta", "partial_json": fragment})));
                }
            }
            ParseEvent::ToolCallEnd { .. } => out = self.close(),
        }
        out
    }

    fn end(&mut self, end: &End) -> Vec<Out> {
        let mut out = self.close();
        let (reason, seq) = match &end.reason {
            EndReason::Stop => ("end_turn", Value::Null),
            EndReason::StopSequence(s) => ("stop_sequence", json!(s)),
            EndReason::Length => ("max_tokens", Value::Null),
            EndReason::ToolCalls => ("tool_use", Value::Null),
            EndReason::Cancelled => {
                self.cancelled = true;
                ("end_turn", Value::Null)
            }
        };
        if self.cancelled {
            out.extend(self.fail(&ApiError::shutting_down()));
            return out;
        }
        self.stop_reason = json!(reason);
        self.stop_sequence = seq;
        self.usage["output_tokens"] = json!(end.completion_tokens);
        out.push(Out {
            event: "message_delta",
            data: json!({"type": "message_delta", "delta": {"stop_reason": reason, "stop_sequence": self.stop_sequence}, "usage": self.usage}),
        });
        out.push(Out { event: "message_stop", data: json!({"type": "message_stop"}) });
        out
    }

    fn whole(&mut self) -> Result<Value, ApiError> {
        if self.cancelled {
            return Err(ApiError::shutting_down());
        }
        Ok(self.message())
    }

    fn fail(&mut self, e: &ApiError) -> Vec<Out> {
        let mut out = if self.started { self.close() } else { self.begin() };
        out.push(Out { event: "error", data: error_body(e) });
        out
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn dates() {
        assert_eq!(rfc3339(0), "1970-01-01T00:00:00Z");
        assert_eq!(rfc3339(1_796_178_336), "2026-12-02T02:25:36Z");
        assert_eq!(rfc3339(951_782_400), "2000-02-29T00:00:00Z");
    }

    #[test]
    fn the_billing_block_is_dropped_from_the_system_prompt() {
        let s = json!([
            {"type": "text", "text": "x-anthropic-billing-header: cc_version=2.1.332.0b8; cc_entrypoint=sdk-cli; cch=93a1f;"},
            {"type": "text", "text": "You are Claude Code.", "cache_control": {"type": "ephemeral"}},
        ]);
        assert_eq!(system_text(&s).unwrap(), "You are Claude Code.");
    }

    #[test]
    fn blocks_become_chat_messages() {
        let msgs = json!([
            {"role": "user", "content": "Weather in Paris?"},
            {"role": "assistant", "content": [
                {"type": "thinking", "thinking": "Use the tool.", "signature": "sig"},
                {"type": "text", "text": "Checking."},
                {"type": "tool_use", "id": "toolu_1", "name": "get_weather", "input": {"city": "Paris"}}]},
            {"role": "user", "content": [
                {"type": "tool_result", "tool_use_id": "toolu_1", "content": [{"type": "text", "text": "sunny"}]},
                {"type": "text", "text": "Thanks."}]},
            {"role": "system", "content": [{"type": "text", "text": "Today is Monday."}]},
        ]);
        let mut out = Vec::new();
        chat_messages(msgs.as_array().unwrap(), &mut out).unwrap();
        assert_eq!(out[0], json!({"role": "user", "content": "Weather in Paris?"}));
        assert_eq!(out[1]["reasoning_content"], "Use the tool.");
        assert_eq!(out[1]["content"], "Checking.");
        assert_eq!(out[1]["tool_calls"][0]["function"]["arguments"], "{\"city\":\"Paris\"}");
        assert_eq!(out[2], json!({"role": "tool", "tool_call_id": "toolu_1", "content": "sunny"}));
        assert_eq!(out[3], json!({"role": "user", "content": "Thanks."}));
        assert_eq!(out[4], json!({"role": "system", "content": "Today is Monday."}));
    }
}

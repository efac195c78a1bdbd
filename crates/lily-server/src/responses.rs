//! OpenAI's Responses API: `POST /v1/responses` (streamed or not), `GET` and `DELETE
//! /v1/responses/{id}`. A request is checked field by field (a bad one is a 400 naming its path,
//! e.g. `input[3].call_id`), translated into a chat-completions request — the input items into
//! messages (function calls onto the assistant message before them, their outputs into tool
//! messages, reasoning items into the next assistant message's reasoning), function, custom
//! (freeform, as one string parameter `input`) and namespaced tools into functions — and rendered,
//! tokenised, cached and parsed exactly as chat completions are. The answer goes out as the
//! documented event sequence (`response.created` … `response.completed`) or as one response object.
//! Responses are kept in memory (bounded: the oldest go first) for `GET` and for
//! `previous_response_id`, which continues the stored conversation.

use std::collections::{HashMap, HashSet, VecDeque};
use std::sync::{Arc, Mutex};

use axum::extract::{Path, Request, State};
use axum::http::StatusCode;
use axum::response::{IntoResponse, Response};
use axum::Json;
use lily_parser::Event as ParseEvent;
use serde_json::{json, Map, Value};

use crate::error::ApiError;
use crate::fields::{get, opt_array, opt_bool, opt_f32, opt_int, opt_object, opt_str, wrong};
use crate::routes::{prepare_chat, rand_id, unix_now, AppState, Prepared};
use crate::stream::{End, EndReason, Encoder, Out};

/// At most this many responses are kept, and at most this many bytes of them.
pub const STORE_RESPONSES: usize = 512;
pub const STORE_BYTES: usize = 64 << 20;

/// A stored response: the response object, and the conversation it ends (chat messages, the
/// instructions left out: as OpenAI documents, they do not carry over to the next response).
#[derive(Clone, Debug)]
pub struct Stored {
    pub response: Value,
    pub conversation: Vec<Value>,
    bytes: usize,
}

/// Responses kept in memory, oldest evicted first.
pub struct Store {
    inner: Mutex<StoreInner>,
}

struct StoreInner {
    order: VecDeque<String>,
    map: HashMap<String, Stored>,
    bytes: usize,
    max_items: usize,
    max_bytes: usize,
}

impl Store {
    pub fn new(max_items: usize, max_bytes: usize) -> Self {
        Store { inner: Mutex::new(StoreInner { order: VecDeque::new(), map: HashMap::new(), bytes: 0, max_items, max_bytes }) }
    }

    pub fn insert(&self, id: String, response: Value, conversation: Vec<Value>) {
        let bytes = response.to_string().len() + conversation.iter().map(|m| m.to_string().len()).sum::<usize>();
        let mut s = self.inner.lock().unwrap();
        if bytes > s.max_bytes {
            return;
        }
        s.bytes += bytes;
        s.order.push_back(id.clone());
        if let Some(old) = s.map.insert(id, Stored { response, conversation, bytes }) {
            s.bytes -= old.bytes;
        }
        while s.map.len() > s.max_items || s.bytes > s.max_bytes {
            let Some(oldest) = s.order.pop_front() else { break };
            if let Some(old) = s.map.remove(&oldest) {
                s.bytes -= old.bytes;
            }
        }
    }

    pub fn get(&self, id: &str) -> Option<Stored> {
        self.inner.lock().unwrap().map.get(id).cloned()
    }

    pub fn remove(&self, id: &str) -> bool {
        let mut s = self.inner.lock().unwrap();
        match s.map.remove(id) {
            Some(old) => {
                s.bytes -= old.bytes;
                s.order.retain(|k| k != id);
                true
            }
            None => false,
        }
    }

    pub fn len(&self) -> usize {
        self.inner.lock().unwrap().map.len()
    }

    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }
}

fn not_found(id: &str, param: Option<&str>) -> ApiError {
    let mut e = ApiError::new(StatusCode::NOT_FOUND, "invalid_request_error", format!("Response with id '{id}' not found (responses are kept in memory, the oldest beyond {STORE_RESPONSES} dropped; a restart forgets them)."))
        .with_code("response_not_found");
    e.param = param.map(str::to_string);
    e
}

pub async fn retrieve(State(app): State<AppState>, Path(id): Path<String>) -> Response {
    match app.responses.get(&id) {
        Some(s) => Json(s.response).into_response(),
        None => not_found(&id, None).into_response(),
    }
}

pub async fn delete(State(app): State<AppState>, Path(id): Path<String>) -> Response {
    if app.responses.remove(&id) {
        Json(json!({"id": id, "object": "response.deleted", "deleted": true})).into_response()
    } else {
        not_found(&id, None).into_response()
    }
}

pub async fn create(State(app): State<AppState>, req: Request) -> Response {
    crate::stream::serve(app, req, prepare).await
}

// ---------------------------------------------------------------------------------------------
// The request

/// Tool types that OpenAI runs on its side (search, code, computer use, MCP, ...): lily runs none,
/// so they are left out of the prompt (a client that offers them is not refused).
const BUILTIN_TOOLS: [&str; 16] = [
    "web_search", "web_search_preview", "web_search_2025_08_26", "web_search_preview_2025_03_11", "file_search", "computer_use_preview",
    "computer_use", "code_interpreter", "image_generation", "local_shell", "mcp", "shell", "apply_patch", "tool_search", "computer",
    "image_gen",
];

/// Output items of OpenAI's own tools, given back in `input`: lily made none, so they are skipped.
const BUILTIN_ITEMS: [&str; 20] = [
    "web_search_call", "file_search_call", "computer_call", "computer_call_output", "local_shell_call", "local_shell_call_output",
    "image_generation_call", "code_interpreter_call", "mcp_call", "mcp_list_tools", "mcp_approval_request", "mcp_approval_response",
    "shell_call", "shell_call_output", "apply_patch_call", "apply_patch_call_output", "compaction", "tool_search_call", "tool_search_output",
    "compaction_summary",
];

/// What the response needs to know about its request.
struct Meta {
    /// Custom (freeform) tools: their calls are `custom_tool_call` items with a string `input`.
    custom: HashSet<String>,
    /// Tools given inside a namespace: their calls carry `namespace`.
    namespaces: HashMap<String, String>,
    /// Request fields the response object repeats.
    echo: Map<String, Value>,
    store: bool,
    /// The conversation so far (chat messages, without the instructions), for the store.
    conversation: Vec<Value>,
    /// Each chat tool's path in the request (`tools[3]`, `tools[1].tools[0]`).
    tool_paths: Vec<String>,
}

fn str_field<'a>(m: &'a Map<String, Value>, key: &str, at: &str) -> Result<&'a str, ApiError> {
    match m.get(key) {
        Some(Value::String(s)) => Ok(s),
        None | Some(Value::Null) => Err(ApiError::invalid(format!("{at}.{key}"), format!("`{at}.{key}` is required"))),
        Some(v) => Err(wrong(&format!("{at}.{key}"), "a string", v)),
    }
}

/// The text of an item's `content` or a call's `output`: a string or a list of text parts
/// (`input_text`, `output_text`, `text`, `refusal`, `summary_text`, `reasoning_text`).
fn parts_text(v: &Value, at: &str) -> Result<String, ApiError> {
    match v {
        Value::String(s) => Ok(s.clone()),
        Value::Array(parts) => {
            let mut out = String::new();
            for (j, p) in parts.iter().enumerate() {
                let pat = format!("{at}[{j}]");
                let Some(o) = p.as_object() else { return Err(wrong(&pat, "a content part object", p)) };
                let ty = opt_str(o, "type", &format!("{pat}.type"))?.unwrap_or("input_text");
                match ty {
                    "input_text" | "output_text" | "text" | "summary_text" | "reasoning_text" => out.push_str(str_field(o, "text", &pat)?),
                    "refusal" => out.push_str(str_field(o, "refusal", &pat)?),
                    "input_image" | "input_file" | "input_audio" | "image" | "file" => {
                        return Err(ApiError::invalid(format!("{pat}.type"), format!("content parts of type `{ty}` are not supported: lily serves the text model")))
                    }
                    other => return Err(ApiError::invalid(format!("{pat}.type"), format!("unknown content part type `{other}` (expected `input_text`)"))),
                }
            }
            Ok(out)
        }
        v => Err(wrong(at, "a string or a list of content parts", v)),
    }
}

/// The assistant message that a call item joins: the last message, when it is the assistant's and
/// nothing came after it; else a new one.
fn assistant_for_call<'a>(messages: &'a mut Vec<Value>, reasoning: &mut Option<String>) -> &'a mut Map<String, Value> {
    let reuse = messages.last().is_some_and(|m| m["role"] == "assistant");
    if !reuse {
        let mut m = json!({"role": "assistant", "content": ""});
        if let Some(r) = reasoning.take() {
            m["reasoning_content"] = json!(r);
        }
        messages.push(m);
    }
    let m = messages.last_mut().unwrap().as_object_mut().unwrap();
    if !m.get("tool_calls").is_some_and(Value::is_array) {
        m.insert("tool_calls".into(), json!([]));
    }
    m
}

/// `input` items as chat messages.
fn input_messages(items: &[Value], messages: &mut Vec<Value>) -> Result<(), ApiError> {
    let mut reasoning: Option<String> = None;
    for (i, item) in items.iter().enumerate() {
        let at = format!("input[{i}]");
        let Some(o) = item.as_object() else { return Err(wrong(&at, "an input item object", item)) };
        let ty = match opt_str(o, "type", &format!("{at}.type"))? {
            Some(t) => t,
            None if o.contains_key("role") => "message",
            None => return Err(ApiError::invalid(format!("{at}.type"), "each input item needs a `type` (or a `role`, for a message)")),
        };
        match ty {
            "message" => {
                let role = str_field(o, "role", &at)?;
                if !["user", "assistant", "system", "developer"].contains(&role) {
                    return Err(ApiError::invalid(format!("{at}.role"), format!("unknown role `{role}` (expected user, assistant, system or developer)")));
                }
                let content = match o.get("content") {
                    None | Some(Value::Null) => return Err(ApiError::invalid(format!("{at}.content"), "a message needs `content`")),
                    Some(c) => parts_text(c, &format!("{at}.content"))?,
                };
                let mut m = json!({"role": role, "content": content});
                if role == "assistant" {
                    if let Some(r) = reasoning.take() {
                        m["reasoning_content"] = json!(r);
                    }
                }
                messages.push(m);
            }
            "function_call" | "custom_tool_call" => {
                let call_id = str_field(o, "call_id", &at)?.to_string();
                let name = str_field(o, "name", &at)?;
                if name.is_empty() {
                    return Err(ApiError::invalid(format!("{at}.name"), "the name must not be empty"));
                }
                opt_str(o, "namespace", &format!("{at}.namespace"))?;
                let arguments = if ty == "function_call" {
                    str_field(o, "arguments", &at)?.to_string()
                } else {
                    json!({"input": str_field(o, "input", &at)?}).to_string()
                };
                let m = assistant_for_call(messages, &mut reasoning);
                m["tool_calls"].as_array_mut().unwrap().push(json!({"id": call_id, "type": "function", "function": {"name": name, "arguments": arguments}}));
            }
            "function_call_output" | "custom_tool_call_output" => {
                let call_id = str_field(o, "call_id", &at)?;
                let output = match o.get("output") {
                    None | Some(Value::Null) => return Err(ApiError::invalid(format!("{at}.output"), format!("`{at}.output` is required"))),
                    Some(v) => parts_text(v, &format!("{at}.output"))?,
                };
                messages.push(json!({"role": "tool", "tool_call_id": call_id, "content": output}));
            }
            "reasoning" => {
                let mut text = String::new();
                for key in ["content", "summary"] {
                    if let Some(a) = opt_array(o, key, &format!("{at}.{key}"))? {
                        if text.is_empty() && !a.is_empty() {
                            text = parts_text(&Value::Array(a.to_vec()), &format!("{at}.{key}"))?;
                        }
                    }
                }
                opt_str(o, "encrypted_content", &format!("{at}.encrypted_content"))?;
                if !text.is_empty() {
                    reasoning = Some(text);
                }
            }
            "item_reference" => {
                return Err(ApiError::invalid(format!("{at}.type"), "`item_reference` items are not supported: give the items themselves, or `previous_response_id`"))
            }
            t if BUILTIN_ITEMS.contains(&t) => {}
            t => return Err(ApiError::invalid(format!("{at}.type"), format!("unknown input item type `{t}`"))),
        }
    }
    Ok(())
}

/// One function or custom tool as a chat function.
fn chat_tool(t: &Map<String, Value>, at: &str, meta: &mut Meta, namespace: Option<&str>) -> Result<Value, ApiError> {
    let ty = opt_str(t, "type", &format!("{at}.type"))?.unwrap_or("function");
    let name = str_field(t, "name", at)?;
    if name.is_empty() {
        return Err(ApiError::invalid(format!("{at}.name"), "the name must not be empty"));
    }
    let description = opt_str(t, "description", &format!("{at}.description"))?.unwrap_or("");
    if let Some(ns) = namespace {
        meta.namespaces.insert(name.to_string(), ns.to_string());
    }
    match ty {
        "function" => {
            let strict = opt_bool(t, "strict", &format!("{at}.strict"))?;
            let parameters = match get(t, "parameters") {
                None => json!({"type": "object", "properties": {}}),
                Some(p @ Value::Object(_)) => p.clone(),
                Some(v) => return Err(wrong(&format!("{at}.parameters"), "a JSON schema object", v)),
            };
            let mut f = json!({"name": name, "parameters": parameters});
            if !description.is_empty() {
                f["description"] = json!(description);
            }
            if let Some(s) = strict {
                f["strict"] = json!(s);
            }
            Ok(json!({"type": "function", "function": f}))
        }
        "custom" => {
            meta.custom.insert(name.to_string());
            let mut desc = description.to_string();
            if let Some(fmt) = opt_object(t, "format", &format!("{at}.format"))? {
                match opt_str(fmt, "type", &format!("{at}.format.type"))?.unwrap_or("text") {
                    "text" => {}
                    "grammar" => {
                        let syntax = opt_str(fmt, "syntax", &format!("{at}.format.syntax"))?.unwrap_or("lark");
                        let def = str_field(fmt, "definition", &format!("{at}.format"))?;
                        desc.push_str(&format!("\n\nThe input must follow this {syntax} grammar:\n{def}"));
                    }
                    other => return Err(ApiError::invalid(format!("{at}.format.type"), format!("unknown custom tool format `{other}` (text or grammar)"))),
                }
            }
            let params = json!({"type": "object", "properties": {"input": {"type": "string", "description": "The tool's whole input, as free text."}}, "required": ["input"]});
            let mut f = json!({"name": name, "parameters": params});
            if !desc.is_empty() {
                f["description"] = json!(desc);
            }
            Ok(json!({"type": "function", "function": f}))
        }
        other => Err(ApiError::invalid(format!("{at}.type"), format!("unknown tool type `{other}` inside a namespace (function or custom)"))),
    }
}

fn chat_tools(tools: &[Value], meta: &mut Meta) -> Result<Vec<Value>, ApiError> {
    let mut out = Vec::new();
    for (i, t) in tools.iter().enumerate() {
        let at = format!("tools[{i}]");
        let Some(o) = t.as_object() else { return Err(wrong(&at, "a tool object", t)) };
        let ty = match o.get("type") {
            Some(Value::String(s)) => s.as_str(),
            None | Some(Value::Null) => return Err(ApiError::invalid(format!("{at}.type"), "each tool needs a `type`")),
            Some(v) => return Err(wrong(&format!("{at}.type"), "a string", v)),
        };
        match ty {
            "function" | "custom" => {
                out.push(chat_tool(o, &at, meta, None)?);
                meta.tool_paths.push(at.clone());
            }
            "namespace" => {
                let ns = str_field(o, "name", &at)?.to_string();
                let inner = match o.get("tools") {
                    Some(Value::Array(a)) => a,
                    Some(v) => return Err(wrong(&format!("{at}.tools"), "a list of tools", v)),
                    None => return Err(ApiError::invalid(format!("{at}.tools"), "a namespace needs `tools`")),
                };
                for (j, t) in inner.iter().enumerate() {
                    let iat = format!("{at}.tools[{j}]");
                    let Some(io) = t.as_object() else { return Err(wrong(&iat, "a tool object", t)) };
                    out.push(chat_tool(io, &iat, meta, Some(&ns))?);
                    meta.tool_paths.push(iat);
                }
            }
            t if BUILTIN_TOOLS.contains(&t) || t.starts_with("web_search") || t.starts_with("computer") => {}
            t => return Err(ApiError::invalid(format!("{at}.type"), format!("unknown tool type `{t}` (function, custom or namespace; OpenAI's built-in tools are skipped)"))),
        }
    }
    Ok(out)
}

/// `tool_choice` as chat completions' (with the tools it allows).
fn chat_tool_choice(tc: &Value, tools: &mut Vec<Value>, paths: &mut Vec<String>) -> Result<Value, ApiError> {
    match tc {
        Value::String(s) if ["auto", "none", "required"].contains(&s.as_str()) => Ok(tc.clone()),
        Value::String(s) => Err(ApiError::invalid("tool_choice", format!("unknown tool_choice `{s}` (auto, none, required, or a tool)"))),
        Value::Object(o) => {
            let ty = str_field(o, "type", "tool_choice")?;
            match ty {
                "function" | "custom" => Ok(json!({"type": "function", "function": {"name": str_field(o, "name", "tool_choice")?}})),
                "allowed_tools" => {
                    let mode = opt_str(o, "mode", "tool_choice.mode")?.unwrap_or("auto");
                    if mode != "auto" && mode != "required" {
                        return Err(ApiError::invalid("tool_choice.mode", format!("unknown mode `{mode}` (auto or required)")));
                    }
                    let allowed = match o.get("tools") {
                        Some(Value::Array(a)) => a,
                        _ => return Err(ApiError::invalid("tool_choice.tools", "`allowed_tools` needs a list of `tools`")),
                    };
                    let names: HashSet<&str> = allowed.iter().filter_map(|t| t.get("name").and_then(Value::as_str)).collect();
                    let keep: Vec<bool> = tools.iter().map(|t| names.contains(t["function"]["name"].as_str().unwrap_or(""))).collect();
                    let mut k = keep.iter();
                    tools.retain(|_| *k.next().unwrap());
                    let mut k = keep.iter();
                    paths.retain(|_| *k.next().unwrap());
                    Ok(json!(mode))
                }
                other => Err(ApiError::invalid("tool_choice.type", format!("tool_choice of type `{other}` is not supported (lily runs no built-in tools)"))),
            }
        }
        v => Err(wrong("tool_choice", "\"auto\", \"none\", \"required\" or a tool object", v)),
    }
}

/// `text.format` as chat completions' `response_format`.
fn response_format(text: &Map<String, Value>) -> Result<Option<Value>, ApiError> {
    opt_str(text, "verbosity", "text.verbosity")?;
    let Some(f) = opt_object(text, "format", "text.format")? else { return Ok(None) };
    match str_field(f, "type", "text.format")? {
        "text" => Ok(None),
        "json_object" => Ok(Some(json!({"type": "json_object"}))),
        "json_schema" => {
            opt_str(f, "name", "text.format.name")?;
            let strict = opt_bool(f, "strict", "text.format.strict")?.unwrap_or(false);
            let schema = match f.get("schema") {
                Some(s @ Value::Object(_)) | Some(s @ Value::Bool(_)) => s.clone(),
                None | Some(Value::Null) => return Err(ApiError::invalid("text.format.schema", "`text.format.schema` is required for `json_schema`")),
                Some(v) => return Err(wrong("text.format.schema", "a JSON schema object", v)),
            };
            Ok(Some(json!({"type": "json_schema", "json_schema": {"name": f.get("name").cloned().unwrap_or(json!("response")), "schema": schema, "strict": strict}})))
        }
        other => Err(ApiError::invalid("text.format.type", format!("unknown text format `{other}` (text, json_object or json_schema)"))),
    }
}

/// Chat-completions field paths as this API names them, for errors the shared path finds.
fn rename_param(e: ApiError) -> ApiError {
    let Some(p) = e.param.clone() else { return e };
    let renamed = if p.starts_with("messages") {
        "input".to_string()
    } else if p == "max_tokens" || p == "max_completion_tokens" {
        "max_output_tokens".to_string()
    } else if let Some(rest) = p.strip_prefix("response_format.json_schema.") {
        format!("text.format.{rest}")
    } else if p.starts_with("response_format") {
        "text.format".to_string()
    } else {
        p
    };
    ApiError { param: Some(renamed), ..e }
}

/// Checks a Responses request and renders it as a chat prompt.
fn prepare(app: &AppState, body: Value) -> Result<(Prepared, ResponsesEncoder), ApiError> {
    let Some(m) = body.as_object() else { return Err(ApiError::bad_request("The request body must be a JSON object.")) };
    let model = opt_str(m, "model", "model")?.map(str::to_string);
    let stream = opt_bool(m, "stream", "stream")?.unwrap_or(false);
    let store = opt_bool(m, "store", "store")?.unwrap_or(true);
    if opt_bool(m, "background", "background")?.unwrap_or(false) {
        return Err(ApiError::invalid("background", "`background` responses are not supported"));
    }
    if get(m, "conversation").is_some() {
        return Err(ApiError::invalid("conversation", "`conversation` is not supported: use `previous_response_id`, or give the whole input"));
    }
    for key in ["user", "prompt_cache_key", "safety_identifier", "service_tier", "truncation", "prompt_cache_retention"] {
        opt_str(m, key, key)?;
    }
    opt_object(m, "metadata", "metadata")?;
    opt_object(m, "stream_options", "stream_options")?;
    if let Some(inc) = opt_array(m, "include", "include")? {
        for (i, v) in inc.iter().enumerate() {
            if !v.is_string() {
                return Err(wrong(&format!("include[{i}]"), "a string", v));
            }
        }
    }
    opt_int(m, "max_tool_calls", "max_tool_calls", 0, i128::from(u32::MAX))?;
    if opt_int(m, "top_logprobs", "top_logprobs", 0, 20)?.unwrap_or(0) > 0 {
        return Err(ApiError::invalid("top_logprobs", "`top_logprobs` is not supported on /v1/responses (chat completions give logprobs)"));
    }
    let instructions = match get(m, "instructions") {
        None => None,
        Some(Value::String(s)) => Some(s.clone()),
        Some(v) => return Err(wrong("instructions", "a string", v)),
    };
    let previous = opt_str(m, "previous_response_id", "previous_response_id")?;
    let mut conversation = match previous {
        Some(id) => app.responses.get(id).ok_or_else(|| not_found(id, Some("previous_response_id")))?.conversation,
        None => Vec::new(),
    };
    match m.get("input") {
        Some(Value::String(s)) => conversation.push(json!({"role": "user", "content": s})),
        Some(Value::Array(items)) => {
            if items.is_empty() && previous.is_none() {
                return Err(ApiError::invalid("input", "`input` must not be empty"));
            }
            input_messages(items, &mut conversation)?;
        }
        None | Some(Value::Null) if previous.is_some() => {}
        None | Some(Value::Null) => return Err(ApiError::invalid("input", "`input` is required")),
        Some(v) => return Err(wrong("input", "a string or a list of input items", v)),
    }
    if conversation.is_empty() {
        return Err(ApiError::invalid("input", "`input` has no messages"));
    }
    let mut meta = Meta { custom: HashSet::new(), namespaces: HashMap::new(), echo: Map::new(), store, conversation: conversation.clone(), tool_paths: Vec::new() };
    let mut tools = match opt_array(m, "tools", "tools")? {
        Some(t) => chat_tools(t, &mut meta)?,
        None => Vec::new(),
    };
    let tool_choice = match get(m, "tool_choice") {
        Some(tc) => chat_tool_choice(tc, &mut tools, &mut meta.tool_paths)?,
        None => json!("auto"),
    };
    let parallel = opt_bool(m, "parallel_tool_calls", "parallel_tool_calls")?.unwrap_or(true);
    let mut messages = Vec::new();
    if let Some(i) = &instructions {
        messages.push(json!({"role": "system", "content": i}));
    }
    messages.extend(conversation);
    let mut chat = json!({"messages": messages, "stream": stream, "parallel_tool_calls": parallel});
    if !tools.is_empty() {
        chat["tools"] = Value::Array(tools);
        chat["tool_choice"] = tool_choice.clone();
    } else if let Value::Object(_) = tool_choice {
        return Err(ApiError::invalid("tool_choice", "tool_choice names a tool but the request has no function or custom tools"));
    } else if tool_choice == "required" {
        return Err(ApiError::invalid("tool_choice", "tool_choice is `required` but the request has no function or custom tools"));
    }
    if let Some(n) = opt_int(m, "max_output_tokens", "max_output_tokens", 1, i128::from(u64::MAX))? {
        chat["max_tokens"] = json!(n as u64);
    }
    for key in ["temperature", "top_p"] {
        if let Some(x) = opt_f32(m, key, key)? {
            chat[key] = json!(x);
        }
    }
    let mut effort = None;
    if let Some(r) = opt_object(m, "reasoning", "reasoning")? {
        opt_str(r, "summary", "reasoning.summary")?;
        opt_str(r, "generate_summary", "reasoning.generate_summary")?;
        effort = opt_str(r, "effort", "reasoning.effort")?;
        match effort {
            None | Some("none" | "minimal" | "low" | "medium" | "high" | "xhigh") => {}
            Some(e) => return Err(ApiError::invalid("reasoning.effort", format!("unknown reasoning effort `{e}` (none, minimal, low, medium, high or xhigh)"))),
        }
    }
    // Effort "none" or "minimal" turns thinking off; any other, or none given, leaves it on.
    if let Some(e) = effort {
        chat["chat_template_kwargs"] = json!({"enable_thinking": !matches!(e, "none" | "minimal")});
    }
    if let Some(text) = opt_object(m, "text", "text")? {
        if let Some(rf) = response_format(text)? {
            chat["response_format"] = rf;
        }
    }
    let prepared = prepare_chat(app, &chat).map_err(|e| crate::conversation::rename_tool_param(rename_param(e), &meta.tool_paths, "parameters"))?;
    for key in ["instructions", "max_output_tokens", "previous_response_id", "temperature", "top_p", "metadata", "user", "tools", "text", "reasoning", "truncation", "prompt_cache_key"] {
        meta.echo.insert(key.into(), m.get(key).cloned().unwrap_or(Value::Null));
    }
    meta.echo.insert("tool_choice".into(), m.get("tool_choice").cloned().unwrap_or(json!("auto")));
    meta.echo.insert("parallel_tool_calls".into(), json!(parallel));
    meta.echo.insert("store".into(), json!(store));
    if meta.echo["tools"].is_null() {
        meta.echo.insert("tools".into(), json!([]));
    }
    if meta.echo["metadata"].is_null() {
        meta.echo.insert("metadata".into(), json!({}));
    }
    if meta.echo["text"].is_null() {
        meta.echo.insert("text".into(), json!({"format": {"type": "text"}}));
    }
    if meta.echo["truncation"].is_null() {
        meta.echo.insert("truncation".into(), json!("disabled"));
    }
    let enc = ResponsesEncoder::new(app, model.unwrap_or_else(|| app.model_id.clone()), meta);
    Ok((prepared, enc))
}

// ---------------------------------------------------------------------------------------------
// The answer

enum Kind {
    Reasoning,
    Message,
    Call { custom: bool, args: String },
}

/// The output item being streamed.
struct Open {
    kind: Kind,
    index: usize,
    text: String,
}

pub struct ResponsesEncoder {
    id: String,
    created_at: u64,
    model: String,
    meta: Meta,
    store: Arc<Store>,
    seq: u64,
    output: Vec<Value>,
    open: Option<Open>,
    started: bool,
    status: &'static str,
    incomplete: Value,
    error: Value,
    usage: Value,
}

fn item_id(prefix: &str) -> String {
    format!("{prefix}_{:016x}{:08x}", rand_id(), rand_id() as u32)
}

impl ResponsesEncoder {
    fn new(app: &AppState, model: String, meta: Meta) -> Self {
        ResponsesEncoder {
            id: item_id("resp"),
            created_at: unix_now(),
            model,
            meta,
            store: Arc::clone(&app.responses),
            seq: 0,
            output: Vec::new(),
            open: None,
            started: false,
            status: "in_progress",
            incomplete: Value::Null,
            error: Value::Null,
            usage: Value::Null,
        }
    }

    fn ev(&mut self, event: &'static str, mut data: Value) -> Out {
        data["type"] = json!(event);
        data["sequence_number"] = json!(self.seq);
        self.seq += 1;
        Out { event, data }
    }

    fn response(&self) -> Value {
        let mut r = json!({
            "id": self.id, "object": "response", "created_at": self.created_at, "status": self.status,
            "error": self.error, "incomplete_details": self.incomplete, "model": self.model,
            "output": self.output, "usage": self.usage,
        });
        for (k, v) in &self.meta.echo {
            r[k] = v.clone();
        }
        if self.status == "completed" {
            r["completed_at"] = json!(unix_now());
        }
        r
    }

    fn item_event(&mut self, event: &'static str, index: usize) -> Out {
        let item = self.output[index].clone();
        self.ev(event, json!({"output_index": index, "item": item}))
    }

    /// Closes the open item (`incomplete`: the answer was cut short).
    fn close(&mut self, status: &str) -> Vec<Out> {
        let Some(open) = self.open.take() else { return Vec::new() };
        let i = open.index;
        let id = self.output[i]["id"].clone();
        let mut out = Vec::new();
        match open.kind {
            Kind::Reasoning => {
                out.push(self.ev("response.reasoning_text.done", json!({"item_id": id, "output_index": i, "content_index": 0, "text": open.text})));
                let part = json!({"type": "reasoning_text", "text": open.text});
                out.push(self.ev("response.content_part.done", json!({"item_id": id, "output_index": i, "content_index": 0, "part": part})));
                self.output[i]["content"] = json!([part]);
            }
            Kind::Message => {
                out.push(self.ev("response.output_text.done", json!({"item_id": id, "output_index": i, "content_index": 0, "text": open.text, "logprobs": []})));
                let part = json!({"type": "output_text", "text": open.text, "annotations": [], "logprobs": []});
                out.push(self.ev("response.content_part.done", json!({"item_id": id, "output_index": i, "content_index": 0, "part": part})));
                self.output[i]["content"] = json!([part]);
            }
            Kind::Call { custom: false, args } => {
                let name = self.output[i]["name"].clone();
                out.push(self.ev("response.function_call_arguments.done", json!({"item_id": id, "output_index": i, "arguments": args, "name": name})));
                self.output[i]["arguments"] = json!(args);
            }
            Kind::Call { custom: true, args } => {
                // The model wrote `{"input": "..."}`: the custom tool's input is that string.
                let input = serde_json::from_str::<Value>(&args).ok().and_then(|v| v.get("input").and_then(Value::as_str).map(str::to_string)).unwrap_or(args);
                out.push(self.ev("response.custom_tool_call_input.delta", json!({"item_id": id, "output_index": i, "delta": input})));
                out.push(self.ev("response.custom_tool_call_input.done", json!({"item_id": id, "output_index": i, "input": input})));
                self.output[i]["input"] = json!(input);
            }
        }
        self.output[i]["status"] = json!(status);
        out.push(self.item_event("response.output_item.done", i));
        out
    }

    fn open(&mut self, kind: Kind, item: Value) -> Vec<Out> {
        let mut out = self.close("completed");
        let i = self.output.len();
        let id = item["id"].clone();
        self.output.push(item);
        out.push(self.item_event("response.output_item.added", i));
        match kind {
            Kind::Reasoning => out.push(self.ev("response.content_part.added", json!({"item_id": id, "output_index": i, "content_index": 0, "part": {"type": "reasoning_text", "text": ""}}))),
            Kind::Message => out.push(self.ev(
                "response.content_part.added",
                json!({"item_id": id, "output_index": i, "content_index": 0, "part": {"type": "output_text", "text": "", "annotations": [], "logprobs": []}}),
            )),
            Kind::Call { .. } => {}
        }
        self.open = Some(Open { kind, index: i, text: String::new() });
        out
    }

    /// This response's output as the assistant message that continues the conversation.
    fn output_message(&self) -> Value {
        let mut content = String::new();
        let mut reasoning = String::new();
        let mut calls = Vec::new();
        for it in &self.output {
            match it["type"].as_str() {
                Some("reasoning") => reasoning.push_str(it["content"][0]["text"].as_str().unwrap_or("")),
                Some("message") => content.push_str(it["content"][0]["text"].as_str().unwrap_or("")),
                Some("function_call") => calls.push(json!({"id": it["call_id"], "type": "function", "function": {"name": it["name"], "arguments": it["arguments"]}})),
                Some("custom_tool_call") => calls.push(json!({"id": it["call_id"], "type": "function", "function": {"name": it["name"], "arguments": json!({"input": it["input"]}).to_string()}})),
                _ => {}
            }
        }
        let mut m = json!({"role": "assistant", "content": content});
        if !reasoning.is_empty() {
            m["reasoning_content"] = json!(reasoning);
        }
        if !calls.is_empty() {
            m["tool_calls"] = Value::Array(calls);
        }
        m
    }

    fn begin(&mut self) -> Vec<Out> {
        self.started = true;
        let r = self.response();
        let a = self.ev("response.created", json!({"response": r}));
        let r = self.response();
        let b = self.ev("response.in_progress", json!({"response": r}));
        vec![a, b]
    }
}

impl Encoder for ResponsesEncoder {
    fn start(&mut self, _prompt_tokens: usize, _cached_tokens: usize) -> Vec<Out> {
        self.begin()
    }

    fn event(&mut self, ev: ParseEvent) -> Vec<Out> {
        let mut out = Vec::new();
        match ev {
            ParseEvent::Reasoning(t) => {
                if !matches!(self.open, Some(Open { kind: Kind::Reasoning, .. })) {
                    out = self.open(Kind::Reasoning, json!({"id": item_id("rs"), "type": "reasoning", "summary": [], "content": [], "encrypted_content": null, "status": "in_progress"}));
                }
                let open = self.open.as_mut().unwrap();
                open.text.push_str(&t);
                let (i, id) = (open.index, self.output[open.index]["id"].clone());
                out.push(self.ev("response.reasoning_text.delta", json!({"item_id": id, "output_index": i, "content_index": 0, "delta": t})));
            }
            ParseEvent::Content(t) => {
                if !matches!(self.open, Some(Open { kind: Kind::Message, .. })) {
                    out = self.open(Kind::Message, json!({"id": item_id("msg"), "type": "message", "status": "in_progress", "role": "assistant", "content": []}));
                }
                let open = self.open.as_mut().unwrap();
                open.text.push_str(&t);
                let (i, id) = (open.index, self.output[open.index]["id"].clone());
                out.push(self.ev("response.output_text.delta", json!({"item_id": id, "output_index": i, "content_index": 0, "delta": t, "logprobs": []})));
            }
            ParseEvent::ToolCallStart { id, name, .. } => {
                let custom = self.meta.custom.contains(&name);
                let mut item = if custom {
                    json!({"id": item_id("ctc"), "type": "custom_tool_call", "status": "in_progress", "call_id": id, "name": name, "input": ""})
                } else {
                    json!({"id": item_id("fc"), "type": "function_call", "status": "in_progress", "call_id": id, "name": name, "arguments": ""})
                };
                if let Some(ns) = self.meta.namespaces.get(&name) {
                    item["namespace"] = json!(ns);
                }
                out = self.open(Kind::Call { custom, args: String::new() }, item);
            }
            ParseEvent::ToolCallArguments { fragment, .. } => {
                if let Some(Open { kind: Kind::Call { custom, args }, index, .. }) = self.open.as_mut() {
                    args.push_str(&fragment);
                    let (custom, i) = (*custom, *index);
                    if !custom {
                        let id = self.output[i]["id"].clone();
                        out.push(self.ev("response.function_call_arguments.delta", json!({"item_id": id, "output_index": i, "delta": fragment})));
                    }
                }
            }
            ParseEvent::ToolCallEnd { .. } => out = self.close("completed"),
        }
        out
    }

    fn end(&mut self, end: &End) -> Vec<Out> {
        let cut = matches!(end.reason, EndReason::Length | EndReason::Cancelled);
        let mut out = self.close(if cut { "incomplete" } else { "completed" });
        self.usage = json!({
            "input_tokens": end.prompt_tokens, "input_tokens_details": {"cached_tokens": end.cached_tokens},
            "output_tokens": end.completion_tokens, "output_tokens_details": {"reasoning_tokens": end.reasoning_tokens},
            "total_tokens": end.prompt_tokens + end.completion_tokens,
        });
        let event = match end.reason {
            EndReason::Length => {
                self.status = "incomplete";
                self.incomplete = json!({"reason": "max_output_tokens"});
                "response.incomplete"
            }
            EndReason::Cancelled => {
                self.status = "failed";
                self.error = json!({"code": "server_error", "message": "The server is shutting down: the answer was cut short."});
                "response.failed"
            }
            _ => {
                self.status = "completed";
                "response.completed"
            }
        };
        let r = self.response();
        if self.meta.store {
            let mut conv = std::mem::take(&mut self.meta.conversation);
            conv.push(self.output_message());
            self.store.insert(self.id.clone(), r.clone(), conv);
        }
        out.push(self.ev(event, json!({"response": r})));
        out
    }

    fn whole(&mut self) -> Result<Value, ApiError> {
        Ok(self.response())
    }

    fn fail(&mut self, e: &ApiError) -> Vec<Out> {
        let mut out = if self.started { self.close("incomplete") } else { self.begin() };
        self.status = "failed";
        let code = if e.status == StatusCode::TOO_MANY_REQUESTS { "rate_limit_exceeded" } else { "server_error" };
        self.error = json!({"code": code, "message": e.message});
        let r = self.response();
        out.push(self.ev("response.failed", json!({"response": r})));
        out
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn meta() -> Meta {
        Meta { custom: HashSet::new(), namespaces: HashMap::new(), echo: Map::new(), store: false, conversation: Vec::new(), tool_paths: Vec::new() }
    }

    #[test]
    fn input_items_become_chat_messages() {
        let items = json!([
            {"role": "developer", "content": "Be brief."},
            {"type": "message", "role": "user", "content": [{"type": "input_text", "text": "Weather in "}, {"type": "input_text", "text": "Paris?"}]},
            {"type": "reasoning", "id": "rs_1", "summary": [], "content": [{"type": "reasoning_text", "text": "Call the tool."}], "encrypted_content": null},
            {"type": "function_call", "call_id": "call_1", "name": "get_weather", "arguments": "{\"city\":\"Paris\"}"},
            {"type": "custom_tool_call", "call_id": "call_2", "name": "apply_patch", "input": "*** Begin Patch"},
            {"type": "function_call_output", "call_id": "call_1", "output": "sunny"},
            {"type": "custom_tool_call_output", "call_id": "call_2", "output": [{"type": "input_text", "text": "done"}]},
            {"type": "web_search_call", "id": "ws_1", "status": "completed"},
        ]);
        let mut m = Vec::new();
        input_messages(items.as_array().unwrap(), &mut m).unwrap();
        assert_eq!(m.len(), 5, "{m:?}");
        assert_eq!(m[0], json!({"role": "developer", "content": "Be brief."}));
        assert_eq!(m[1]["content"], "Weather in Paris?");
        assert_eq!(m[2]["role"], "assistant");
        assert_eq!(m[2]["reasoning_content"], "Call the tool.");
        assert_eq!(m[2]["tool_calls"][0]["function"]["name"], "get_weather");
        assert_eq!(m[2]["tool_calls"][1]["function"]["arguments"], "{\"input\":\"*** Begin Patch\"}");
        assert_eq!(m[3], json!({"role": "tool", "tool_call_id": "call_1", "content": "sunny"}));
        assert_eq!(m[4]["content"], "done");
    }

    #[test]
    fn bad_items_name_their_path() {
        let p = |items: Value| {
            let mut m = Vec::new();
            input_messages(items.as_array().unwrap(), &mut m).unwrap_err().param.unwrap()
        };
        assert_eq!(p(json!([{"role": "user", "content": 5}])), "input[0].content");
        assert_eq!(p(json!([{"role": "user", "content": "a"}, {"type": "function_call", "name": "f", "arguments": "{}"}])), "input[1].call_id");
        assert_eq!(p(json!([{"type": "function_call_output", "call_id": "c"}])), "input[0].output");
        assert_eq!(p(json!([{"type": "message", "role": "robot", "content": "x"}])), "input[0].role");
        assert_eq!(p(json!([{"type": "message", "role": "user", "content": [{"type": "input_image", "image_url": "x"}]}])), "input[0].content[0].type");
        assert_eq!(p(json!([{"type": "teleport"}])), "input[0].type");
        assert_eq!(p(json!([7])), "input[0]");
    }

    #[test]
    fn tools_function_custom_namespace_and_builtin() {
        let mut meta = meta();
        let tools = json!([
            {"type": "function", "name": "f", "parameters": {"type": "object", "properties": {"a": {"type": "string"}}}, "strict": false},
            {"type": "custom", "name": "apply_patch", "description": "Patch files.", "format": {"type": "grammar", "syntax": "lark", "definition": "start: /.+/"}},
            {"type": "namespace", "name": "agents", "description": "sub-agents", "tools": [{"type": "function", "name": "spawn", "parameters": {"type": "object"}}]},
            {"type": "web_search", "external_web_access": false},
        ]);
        let out = chat_tools(tools.as_array().unwrap(), &mut meta).unwrap();
        assert_eq!(out.len(), 3);
        assert_eq!(out[0]["function"]["name"], "f");
        assert_eq!(out[1]["function"]["parameters"]["required"], json!(["input"]));
        assert!(out[1]["function"]["description"].as_str().unwrap().contains("start: /.+/"));
        assert!(meta.custom.contains("apply_patch"));
        assert_eq!(meta.namespaces["spawn"], "agents");
        let e = chat_tools(json!([{"type": "teleporter"}]).as_array().unwrap(), &mut Meta { ..meta }).unwrap_err();
        assert_eq!(e.param.as_deref(), Some("tools[0].type"));
    }

    #[test]
    fn the_store_is_bounded() {
        let s = Store::new(3, 1 << 20);
        for i in 0..5 {
            s.insert(format!("r{i}"), json!({"i": i}), vec![]);
        }
        assert_eq!(s.len(), 3);
        assert!(s.get("r0").is_none() && s.get("r1").is_none());
        assert_eq!(s.get("r4").unwrap().response["i"], 4);
        assert!(s.remove("r3") && !s.remove("r3"));
        let s = Store::new(100, 100);
        s.insert("big".into(), json!({"x": "y".repeat(200)}), vec![]);
        assert!(s.is_empty(), "a response larger than the whole store is not kept");
        for i in 0..20 {
            s.insert(format!("r{i}"), json!({"i": i}), vec![]);
        }
        assert!(s.len() < 20 && s.get("r19").is_some());
    }
}

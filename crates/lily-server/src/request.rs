//! Reading OpenAI request bodies: the fields lily honours, validated one by one so that a bad value
//! is a 400 naming its field; unknown fields are accepted and ignored. Also the prompt: a chat
//! request rendered with the checkpoint's template (tools, `tool_choice`, kwargs), or a raw prompt.

use lily_parser::ToolSpec;
use lily_sampler::SamplingParams;
use serde_json::{Map, Value};

use crate::error::ApiError;

#[derive(Clone, Debug, PartialEq)]
pub enum ToolChoice {
    Auto,
    None,
    Required,
    Named(String),
}

/// The generation fields common to chat and text completions.
#[derive(Clone, Debug)]
pub struct Common {
    pub stream: bool,
    pub include_usage: bool,
    pub max_tokens: Option<usize>,
    pub stop: Vec<String>,
    pub sampling: SamplingParams,
}

#[derive(Clone, Debug)]
pub struct ChatRequest {
    pub common: Common,
    pub tools: Vec<ToolSpec>,
    pub tool_choice: ToolChoice,
}

pub const ROLES: [&str; 5] = ["system", "developer", "user", "assistant", "tool"];

fn obj(body: &Value) -> Result<&Map<String, Value>, ApiError> {
    body.as_object().ok_or_else(|| ApiError::bad_request("The request body must be a JSON object."))
}

fn opt_bool(m: &Map<String, Value>, key: &str) -> Result<bool, ApiError> {
    match m.get(key) {
        None | Some(Value::Null) => Ok(false),
        Some(Value::Bool(b)) => Ok(*b),
        Some(v) => Err(ApiError::invalid(key, format!("`{key}` must be a boolean, got {v}"))),
    }
}

fn parse_common(m: &Map<String, Value>, logprobs_field_is_int: bool) -> Result<Common, ApiError> {
    let stream = opt_bool(m, "stream")?;
    let include_usage = match m.get("stream_options") {
        None | Some(Value::Null) => false,
        Some(Value::Object(o)) => opt_bool(o, "include_usage").map_err(|_| ApiError::invalid("stream_options.include_usage", "must be a boolean"))?,
        Some(_) => return Err(ApiError::invalid("stream_options", "`stream_options` must be an object")),
    };
    let mut max_tokens = None;
    for key in ["max_completion_tokens", "max_tokens"] {
        match m.get(key) {
            None | Some(Value::Null) => {}
            Some(v) => match v.as_i64() {
                Some(n) if n >= 1 => {
                    max_tokens.get_or_insert(n as usize);
                }
                _ => return Err(ApiError::invalid(key, format!("`{key}` must be an integer of at least 1, got {v}"))),
            },
        }
    }
    match m.get("n") {
        None | Some(Value::Null) => {}
        Some(v) if v.as_i64() == Some(1) => {}
        Some(v) => return Err(ApiError::invalid("n", format!("only n = 1 is supported (one sequence at a time), got {v}"))),
    }
    let stop = match m.get("stop") {
        None | Some(Value::Null) => Vec::new(),
        Some(Value::String(s)) => vec![s.clone()],
        Some(Value::Array(a)) => a
            .iter()
            .map(|s| s.as_str().map(str::to_string).ok_or_else(|| ApiError::invalid("stop", "`stop` must be a string or a list of strings")))
            .collect::<Result<_, _>>()?,
        Some(_) => return Err(ApiError::invalid("stop", "`stop` must be a string or a list of strings")),
    };
    // Sampling fields (temperature, top_p, top_k, min_p, penalties, seed, logit_bias).
    let mut sm = Map::new();
    for key in ["temperature", "top_p", "top_k", "min_p", "presence_penalty", "frequency_penalty", "repetition_penalty", "seed", "logit_bias"] {
        if let Some(v) = m.get(key) {
            sm.insert(key.into(), v.clone());
        }
    }
    let mut sampling: SamplingParams = serde_json::from_value(Value::Object(sm.clone())).map_err(|e| {
        // serde's message does not name the field: find it by reading the fields one at a time.
        let param = sm
            .iter()
            .find(|(k, v)| serde_json::from_value::<SamplingParams>(Value::Object(Map::from_iter([((*k).clone(), (*v).clone())]))).is_err())
            .map(|(k, _)| k.as_str())
            .unwrap_or("sampling");
        ApiError::invalid(param, format!("invalid `{param}`: {e}"))
    })?;
    // logprobs: a boolean in chat, an integer (how many alternatives) in text completions.
    match m.get("logprobs") {
        None | Some(Value::Null) => {}
        Some(Value::Bool(b)) if !logprobs_field_is_int => sampling.logprobs = *b,
        Some(v) if logprobs_field_is_int && v.as_u64().is_some() => {
            sampling.logprobs = true;
            sampling.top_logprobs = v.as_u64().unwrap() as u32;
        }
        Some(v) => return Err(ApiError::invalid("logprobs", format!("invalid `logprobs`: {v}"))),
    }
    match m.get("top_logprobs") {
        None | Some(Value::Null) => {}
        Some(v) => match v.as_u64() {
            Some(n) => sampling.top_logprobs = n as u32,
            None => return Err(ApiError::invalid("top_logprobs", format!("`top_logprobs` must be a non-negative integer, got {v}"))),
        },
    }
    Ok(Common { stream, include_usage, max_tokens, stop, sampling })
}

/// Validates a chat request body.
pub fn parse_chat(body: &Value) -> Result<ChatRequest, ApiError> {
    let m = obj(body)?;
    let messages = match m.get("messages") {
        Some(Value::Array(a)) if !a.is_empty() => a,
        Some(Value::Array(_)) => return Err(ApiError::invalid("messages", "`messages` must not be empty")),
        Some(_) => return Err(ApiError::invalid("messages", "`messages` must be a list of messages")),
        None => return Err(ApiError::invalid("messages", "`messages` is required")),
    };
    for (i, msg) in messages.iter().enumerate() {
        let Some(mo) = msg.as_object() else {
            return Err(ApiError::invalid(format!("messages[{i}]"), "each message must be an object"));
        };
        match mo.get("role").and_then(Value::as_str) {
            Some(r) if ROLES.contains(&r) => {}
            Some(r) => {
                return Err(ApiError::invalid(
                    format!("messages[{i}].role"),
                    format!("unknown role `{r}` (expected one of {})", ROLES.join(", ")),
                ))
            }
            None => return Err(ApiError::invalid(format!("messages[{i}].role"), "each message needs a string `role`")),
        }
        match mo.get("content") {
            None | Some(Value::Null) | Some(Value::String(_)) | Some(Value::Array(_)) => {}
            Some(_) => return Err(ApiError::invalid(format!("messages[{i}].content"), "`content` must be a string or a list of parts")),
        }
    }
    let common = parse_common(m, false)?;
    let tools = match m.get("tools") {
        None | Some(Value::Null) => Vec::new(),
        Some(Value::Array(a)) => a
            .iter()
            .enumerate()
            .map(|(i, t)| ToolSpec::from_openai(t).map_err(|e| ApiError::invalid(format!("tools[{i}]"), e.to_string())))
            .collect::<Result<_, _>>()?,
        Some(_) => return Err(ApiError::invalid("tools", "`tools` must be a list")),
    };
    let tool_choice = match m.get("tool_choice") {
        None | Some(Value::Null) => ToolChoice::Auto,
        Some(Value::String(s)) => match s.as_str() {
            "auto" => ToolChoice::Auto,
            "none" => ToolChoice::None,
            "required" => ToolChoice::Required,
            other => return Err(ApiError::invalid("tool_choice", format!("unknown tool_choice `{other}`"))),
        },
        Some(Value::Object(o)) => match o.get("function").and_then(|f| f.get("name")).and_then(Value::as_str) {
            Some(name) => ToolChoice::Named(name.to_string()),
            None => return Err(ApiError::invalid("tool_choice", "a named tool_choice needs `function.name`")),
        },
        Some(_) => return Err(ApiError::invalid("tool_choice", "invalid tool_choice")),
    };
    match &tool_choice {
        ToolChoice::Required | ToolChoice::Named(_) if tools.is_empty() => {
            return Err(ApiError::invalid("tool_choice", "tool_choice asks for a tool call but the request has no tools"))
        }
        ToolChoice::Named(n) if !tools.iter().any(|t| &t.name == n) => {
            return Err(ApiError::invalid("tool_choice", format!("tool_choice names `{n}`, which is not in `tools`")))
        }
        _ => {}
    }
    // response_format / structured_outputs: read by `structured` (constrained decoding).
    Ok(ChatRequest { common, tools, tool_choice })
}

/// A text-completion request: the prompt text and the common fields.
pub fn parse_completion(body: &Value) -> Result<(String, Common), ApiError> {
    let m = obj(body)?;
    let prompt = match m.get("prompt") {
        Some(Value::String(s)) => s.clone(),
        Some(Value::Array(a)) if a.len() == 1 && a[0].is_string() => a[0].as_str().unwrap().to_string(),
        Some(Value::Array(_)) => return Err(ApiError::invalid("prompt", "only one prompt string per request is supported")),
        Some(_) => return Err(ApiError::invalid("prompt", "`prompt` must be a string")),
        None => return Err(ApiError::invalid("prompt", "`prompt` is required")),
    };
    if opt_bool(m, "echo")? {
        return Err(ApiError::invalid("echo", "`echo` is not supported"));
    }
    Ok((prompt, parse_common(m, true)?))
}

//! Reading OpenAI request bodies: the fields lily honours, validated one by one so that a bad value
//! is a 400 naming its field; unknown fields are accepted and ignored. Also the prompt: a chat
//! request rendered with the checkpoint's template (tools, `tool_choice`, kwargs), or a raw prompt.

use lily_parser::ToolSpec;
use lily_sampler::SamplingParams;
use serde_json::{Map, Value};

use crate::error::ApiError;
use crate::fields::{self, get, int_in, opt_array, opt_bool, opt_f32, opt_int, opt_object, opt_str, shown};
use crate::messages::{check_messages, check_tool, check_tool_choice};

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

pub use crate::messages::ROLES;

fn obj(body: &Value) -> Result<&Map<String, Value>, ApiError> {
    body.as_object().ok_or_else(|| ApiError::bad_request("The request body must be a JSON object."))
}

/// At most this many stop strings (OpenAI allows 4), each at most this many bytes.
const MAX_STOP_STRINGS: usize = 16;
const MAX_STOP_BYTES: usize = 1024;

fn parse_common(m: &Map<String, Value>, logprobs_field_is_int: bool) -> Result<Common, ApiError> {
    opt_str(m, "model", "model")?;
    opt_str(m, "user", "user")?;
    let stream = opt_bool(m, "stream", "stream")?.unwrap_or(false);
    let include_usage = match opt_object(m, "stream_options", "stream_options")? {
        None => false,
        Some(o) => opt_bool(o, "include_usage", "stream_options.include_usage")?.unwrap_or(false),
    };
    let mut max_tokens = None;
    for key in ["max_completion_tokens", "max_tokens"] {
        if let Some(n) = opt_int(m, key, key, 1, i128::from(u64::MAX))? {
            max_tokens.get_or_insert(usize::try_from(n).unwrap_or(usize::MAX));
        }
    }
    if let Some(v) = get(m, "n") {
        if int_in(v, "n", 1, 1).is_err() {
            return Err(ApiError::invalid("n", format!("only n = 1 is supported (one sequence at a time), got {}", shown(v))));
        }
    }
    let stop_error = || ApiError::invalid("stop", format!("`stop` must be a string or a list of at most {MAX_STOP_STRINGS} non-empty strings of at most {MAX_STOP_BYTES} bytes"));
    let stop: Vec<String> = match get(m, "stop") {
        None => Vec::new(),
        Some(Value::String(s)) => vec![s.clone()],
        Some(Value::Array(a)) if a.len() <= MAX_STOP_STRINGS => {
            a.iter().map(|s| s.as_str().map(str::to_string).ok_or_else(stop_error)).collect::<Result<_, _>>()?
        }
        Some(_) => return Err(stop_error()),
    };
    if stop.iter().any(|s| s.is_empty() || s.len() > MAX_STOP_BYTES) {
        return Err(stop_error());
    }
    // Sampling fields, each of its type; their ranges are the sampler's to check.
    let f = |key: &str| opt_f32(m, key, key);
    let mut sampling = SamplingParams {
        temperature: f("temperature")?,
        top_p: f("top_p")?,
        min_p: f("min_p")?,
        presence_penalty: f("presence_penalty")?,
        frequency_penalty: f("frequency_penalty")?,
        repetition_penalty: f("repetition_penalty")?,
        top_k: opt_int(m, "top_k", "top_k", i128::from(i32::MIN), i128::from(i32::MAX))?.map(|k| k as i32),
        // Any 64-bit integer; a negative seed is read as its two's-complement u64 (as the sampler documents).
        seed: opt_int(m, "seed", "seed", i128::from(i64::MIN), i128::from(u64::MAX))?.map(|s| if s < 0 { s as i64 as u64 } else { s as u64 }),
        ..Default::default()
    };
    if let Some(bias) = opt_object(m, "logit_bias", "logit_bias")? {
        for (k, v) in bias {
            let Ok(id) = k.trim().parse::<u32>() else {
                return Err(ApiError::invalid("logit_bias", format!("`logit_bias` keys must be token ids, got `{}`", shown(&Value::String(k.clone())))));
            };
            let Some(b) = v.as_f64().filter(|b| b.is_finite()) else {
                return Err(fields::wrong(&format!("logit_bias.{id}"), "a number from -100 to 100", v));
            };
            sampling.logit_bias.push((id, b as f32));
        }
        sampling.logit_bias.sort_by_key(|&(id, _)| id);
    }
    // logprobs: a boolean in chat, an integer (how many alternatives) in text completions.
    if logprobs_field_is_int {
        if let Some(n) = opt_int(m, "logprobs", "logprobs", 0, i128::from(lily_sampler::MAX_TOP_LOGPROBS))? {
            sampling.logprobs = true;
            sampling.top_logprobs = n as u32;
        }
    } else {
        sampling.logprobs = opt_bool(m, "logprobs", "logprobs")?.unwrap_or(false);
    }
    if let Some(n) = opt_int(m, "top_logprobs", "top_logprobs", 0, i128::from(lily_sampler::MAX_TOP_LOGPROBS))? {
        sampling.top_logprobs = n as u32;
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
    check_messages(messages)?;
    let common = parse_common(m, false)?;
    opt_bool(m, "parallel_tool_calls", "parallel_tool_calls")?;
    // What the chat template reads (it checks their contents).
    opt_object(m, "chat_template_kwargs", "chat_template_kwargs")?;
    opt_bool(m, "add_generation_prompt", "add_generation_prompt")?;
    opt_bool(m, "continue_final_message", "continue_final_message")?;
    opt_array(m, "documents", "documents")?;
    let tools = match m.get("tools") {
        None | Some(Value::Null) => Vec::new(),
        Some(Value::Array(a)) => a
            .iter()
            .enumerate()
            .map(|(i, t)| {
                check_tool(t, &format!("tools[{i}]"))?;
                ToolSpec::from_openai(t).map_err(|e| ApiError::invalid(format!("tools[{i}]"), e.to_string()))
            })
            .collect::<Result<_, _>>()?,
        Some(v) => return Err(fields::wrong("tools", "a list of tools", v)),
    };
    if let Some(tc) = m.get("tool_choice") {
        check_tool_choice(tc)?;
    }
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
    if opt_bool(m, "echo", "echo")?.unwrap_or(false) {
        return Err(ApiError::invalid("echo", "`echo` is not supported"));
    }
    Ok((prompt, parse_common(m, true)?))
}

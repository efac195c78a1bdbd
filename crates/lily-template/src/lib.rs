//! Chat prompts for Qwen3.5/3.6: a checkpoint's Jinja chat template rendered with minijinja, byte-identical to what
//! transformers renders (`tokenizer.apply_chat_template(..., tokenize=False)`), for OpenAI-style chat requests.
//!
//! ```no_run
//! # use lily_template::ChatTemplate;
//! let template = ChatTemplate::from_dir(std::path::Path::new("/models/Qwen3.6-35B-A3B"))?;
//! let body = serde_json::json!({"messages": [{"role": "user", "content": "Hi"}]});
//! let prompt = template.render_request(&body)?; // "<|im_start|>user\nHi<|im_end|>\n<|im_start|>assistant\n<think>\n"
//! # Ok::<(), lily_template::TemplateError>(())
//! ```
//!
//! What is reproduced (see `tests/golden.rs`, checked against transformers 5.24 / jinja2 3.1.6 by
//! `tools/template_reference.py`):
//! - Where the template comes from, as `AutoTokenizer.from_pretrained` does it: `chat_template.jinja` (which wins),
//!   else `"chat_template"` in `tokenizer_config.json` (a string, or the list of `{name, template}`: "default",
//!   and "tool_use" when the request has tools), else the built-in Qwen3.6 template.
//! - Template variables: `messages`, `tools`, `documents`, `add_generation_prompt`, the tokenizer's special tokens
//!   (`bos_token`, `eos_token`, `pad_token`, ... and model-specific `*_token` entries), and the request's
//!   `chat_template_kwargs` (`enable_thinking`, `preserve_thinking`, ...), which override special tokens.
//! - Message preprocessing: vLLM's (`tool_calls[].function.arguments` JSON strings become objects; invalid JSON,
//!   non-object JSON and null/empty arguments become `{}`; an empty `tool_calls` list is dropped), then
//!   transformers' (top-level null fields dropped; `reasoning`/`thinking`/`reasoning_content` aliased to each other;
//!   `continue_final_message`).
//! - jinja2 semantics where minijinja differs: transformers' `tojson` (Python `json.dumps`: no HTML escaping, key order
//!   kept, `", "`/`": "` separators, `indent`/`separators`/`sort_keys`/`ensure_ascii`), Python's printing of values
//!   (`True`, `None`, `1e-05`, `{'a': 1}`) in `{{ }}` and `|string`, Python whitespace in `strip`/`split`/`|trim`,
//!   the `sequence`/`number` tests, `raise_exception`, `strftime_now`, `{% generation %}`.

mod env;
mod pyfmt;

use std::path::{Path, PathBuf};

use minijinja::value::Serde;
use minijinja::Environment;
use serde_json::{Map, Value};

/// The official Qwen3.6 chat template (`chat_template.jinja` of Qwen/Qwen3.6-27B and Qwen/Qwen3.6-35B-A3B: ChatML,
/// `<think>` blocks with the `preserve_thinking` branch, XML `<tool_call><function=...>` tool calls), kept verbatim
/// (no comment added to the file, so that its text is the checkpoint's byte for byte).
///
/// Provenance (no hub access here): transcribed from the copy quoted verbatim in public code that loads
/// `models--Qwen--Qwen3.6-27B/snapshots/6a9e13bd6fc8f0983b9b99948120bc37f49c13e9`, and cross-checked against two
/// other public copies: a `QWEN3_PROPS.chat_template` test fixture (identical), and the `chat_template.jinja` of
/// github.com/w32zhong/qwen3.6-fp8-config-fix (identical except its patched generation-prompt tail; the character
/// counts agree exactly once that tail is accounted for). It also matches the official Qwen3.5 template (Qwen/Qwen3.5-27B)
/// except for the two lines Qwen3.6 changed (the `preserve_thinking` condition; non-string tool arguments `tojson`-ed
/// instead of Python-`str`-ed), and the format described in docs/qwen36-architecture.md §4.
pub const QWEN3_6_TEMPLATE: &str = include_str!("qwen3_6.jinja");

const DEFAULT: &str = "default";
const TOOL_USE: &str = "tool_use";

/// Template variables that a request's `chat_template_kwargs` may not set (they come from the request itself).
const RESERVED_KWARGS: [&str; 3] = ["messages", "tools", "documents"];

/// The named special tokens transformers passes to every template (`SPECIAL_TOKENS_ATTRIBUTES`), in its order.
const SPECIAL_TOKEN_NAMES: [&str; 7] = [
    "bos_token",
    "eos_token",
    "unk_token",
    "sep_token",
    "pad_token",
    "cls_token",
    "mask_token",
];

/// transformers' marker for `continue_final_message`.
const CONTINUE_TAG: &str = "CONTINUE_FINAL_MESSAGE_TAG ";

#[derive(Debug, thiserror::Error)]
pub enum TemplateError {
    #[error("cannot read {path}: {source}")]
    Io {
        path: PathBuf,
        source: std::io::Error,
    },
    #[error("invalid {path}: {message}")]
    Config { path: PathBuf, message: String },
    #[error("chat template syntax error: {0}")]
    Syntax(String),
    /// The template called `raise_exception(message)`; the message is the template's own, e.g.
    /// "System message must be at the beginning.".
    #[error("{0}")]
    Raised(String),
    /// Any other error while rendering (e.g. the template reads an attribute of an undefined value).
    #[error("chat template rendering failed: {0}")]
    Render(String),
    /// The request cannot be rendered: no `messages`, a message that is not an object with a string `role`, ...
    #[error("invalid chat request: {0}")]
    InvalidRequest(String),
}

impl TemplateError {
    /// Errors caused by what the request contains (an OpenAI server answers these with 400): everything except
    /// reading or compiling the checkpoint's template.
    pub fn is_request_error(&self) -> bool {
        matches!(
            self,
            TemplateError::Raised(_) | TemplateError::Render(_) | TemplateError::InvalidRequest(_)
        )
    }
}

fn invalid(message: impl Into<String>) -> TemplateError {
    TemplateError::InvalidRequest(message.into())
}

/// Where a [`ChatTemplate`]'s text came from.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum TemplateSource {
    /// The checkpoint's `chat_template.jinja` or `tokenizer_config.json` (this path).
    Checkpoint(PathBuf),
    /// The built-in Qwen3.6 template (the checkpoint has none).
    Builtin,
    /// Given as text to [`ChatTemplate::from_source`].
    Inline,
}

impl std::fmt::Display for TemplateSource {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            TemplateSource::Checkpoint(path) => write!(f, "{}", path.display()),
            TemplateSource::Builtin => f.write_str("built-in Qwen3.6 template"),
            TemplateSource::Inline => f.write_str("inline template"),
        }
    }
}

/// A compiled chat template plus the tokenizer's special tokens, ready to render chat requests. Cheap to share
/// (`Send + Sync`); rendering does not mutate it.
pub struct ChatTemplate {
    env: Environment<'static>,
    /// The text of the "default" template as given (before `{% generation %}` tags are rewritten).
    text: String,
    has_tool_use: bool,
    source: TemplateSource,
    special_tokens: Vec<(String, String)>,
}

impl std::fmt::Debug for ChatTemplate {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("ChatTemplate")
            .field("source", &self.source)
            .field("has_tool_use", &self.has_tool_use)
            .field("special_tokens", &self.special_tokens)
            .finish_non_exhaustive()
    }
}

/// The options of one render.
struct RenderArgs<'a> {
    messages: &'a [Value],
    tools: Option<&'a [Value]>,
    documents: Option<&'a [Value]>,
    add_generation_prompt: bool,
    continue_final_message: bool,
    kwargs: &'a Map<String, Value>,
}

impl ChatTemplate {
    /// Loads a checkpoint directory's template the way `AutoTokenizer.from_pretrained` does: `chat_template.jinja`
    /// (plus `additional_chat_templates/tool_use.jinja`), else `"chat_template"` in `tokenizer_config.json` (a
    /// string, or a list of `{"name", "template"}` from which "default" and "tool_use" are taken), else the built-in
    /// Qwen3.6 template ([`source`](Self::source) says which). Special tokens come from `tokenizer_config.json`
    /// (and a legacy `special_tokens_map.json`).
    pub fn from_dir(dir: &Path) -> Result<Self, TemplateError> {
        if !dir.is_dir() {
            return Err(TemplateError::Io {
                path: dir.to_path_buf(),
                source: std::io::Error::new(std::io::ErrorKind::NotFound, "not a directory"),
            });
        }
        let config_path = dir.join("tokenizer_config.json");
        let config = if config_path.is_file() {
            read_json_object(&config_path)?
        } else {
            Map::new()
        };
        let special_tokens = special_tokens(dir, &config)?;

        let jinja_path = dir.join("chat_template.jinja");
        let (templates, source) = if jinja_path.is_file() {
            let mut templates = vec![(DEFAULT.to_string(), read_text(&jinja_path)?)];
            let tool_use = dir.join("additional_chat_templates").join("tool_use.jinja");
            if tool_use.is_file() {
                templates.push((TOOL_USE.to_string(), read_text(&tool_use)?));
            }
            (templates, TemplateSource::Checkpoint(jinja_path))
        } else {
            match config.get("chat_template") {
                None | Some(Value::Null) => (
                    vec![(DEFAULT.to_string(), QWEN3_6_TEMPLATE.to_string())],
                    TemplateSource::Builtin,
                ),
                Some(Value::String(s)) => (
                    vec![(DEFAULT.to_string(), s.clone())],
                    TemplateSource::Checkpoint(config_path.clone()),
                ),
                Some(Value::Array(list)) => {
                    let mut templates = Vec::new();
                    for entry in list {
                        let (Some(name), Some(text)) = (
                            entry.get("name").and_then(Value::as_str),
                            entry.get("template").and_then(Value::as_str),
                        ) else {
                            return Err(TemplateError::Config {
                                path: config_path,
                                message: "chat_template list entries must be {\"name\": str, \"template\": str}".into(),
                            });
                        };
                        if name == DEFAULT || name == TOOL_USE {
                            templates.push((name.to_string(), text.to_string()));
                        }
                    }
                    if !templates.iter().any(|(n, _)| n == DEFAULT) {
                        return Err(TemplateError::Config {
                            path: config_path,
                            message: "chat_template list has no \"default\" entry".into(),
                        });
                    }
                    (templates, TemplateSource::Checkpoint(config_path.clone()))
                }
                Some(_) => {
                    return Err(TemplateError::Config {
                        path: config_path,
                        message: "\"chat_template\" must be a string or a list of {name, template}"
                            .into(),
                    })
                }
            }
        };
        Self::build(templates, source, special_tokens)
    }

    /// The built-in Qwen3.6 template, with Qwen3.6's special tokens (`eos_token` `<|im_end|>`, `pad_token`
    /// `<|endoftext|>`).
    pub fn builtin() -> Self {
        let special = vec![
            ("eos_token".to_string(), "<|im_end|>".to_string()),
            ("pad_token".to_string(), "<|endoftext|>".to_string()),
        ];
        Self::build(
            vec![(DEFAULT.to_string(), QWEN3_6_TEMPLATE.to_string())],
            TemplateSource::Builtin,
            special,
        )
        .expect("the built-in template compiles")
    }

    /// A template given as text, without special tokens.
    pub fn from_source(src: &str) -> Result<Self, TemplateError> {
        Self::build(
            vec![(DEFAULT.to_string(), src.to_string())],
            TemplateSource::Inline,
            Vec::new(),
        )
    }

    fn build(
        templates: Vec<(String, String)>,
        source: TemplateSource,
        special_tokens: Vec<(String, String)>,
    ) -> Result<Self, TemplateError> {
        let mut env = env::new_environment();
        let mut text = String::new();
        let mut has_tool_use = false;
        for (name, src) in templates {
            env.add_template_owned(name.clone(), env::rewrite_generation_tags(&src))
                .map_err(|e| TemplateError::Syntax(describe(&e)))?;
            if name == DEFAULT {
                text = src;
            } else {
                has_tool_use = true;
            }
        }
        Ok(ChatTemplate {
            env,
            text,
            has_tool_use,
            source,
            special_tokens,
        })
    }

    /// Where the template came from.
    pub fn source(&self) -> TemplateSource {
        self.source.clone()
    }

    /// The text of the (default) template.
    pub fn text(&self) -> &str {
        &self.text
    }

    /// The special tokens passed to the template as variables, e.g. `("eos_token", "<|im_end|>")`.
    pub fn special_tokens(&self) -> &[(String, String)] {
        &self.special_tokens
    }

    /// Renders an OpenAI chat-completions request body to the prompt text. Reads `messages` (required), `tools`,
    /// `documents`, `chat_template_kwargs`, `add_generation_prompt` (default true, as in vLLM) and
    /// `continue_final_message` (default false); other fields are ignored. `add_generation_prompt` and
    /// `continue_final_message` may also be given inside `chat_template_kwargs` (which wins, as in vLLM).
    pub fn render_request(&self, body: &Value) -> Result<String, TemplateError> {
        let obj = body
            .as_object()
            .ok_or_else(|| invalid("the request body must be a JSON object"))?;
        let messages = match obj.get("messages") {
            Some(Value::Array(m)) => m.as_slice(),
            None | Some(Value::Null) => return Err(invalid("the request has no \"messages\"")),
            Some(_) => return Err(invalid("\"messages\" must be an array")),
        };
        let tools = optional_array(obj, "tools")?;
        let documents = optional_array(obj, "documents")?;
        let mut kwargs = match obj.get("chat_template_kwargs") {
            None | Some(Value::Null) => Map::new(),
            Some(Value::Object(m)) => m.clone(),
            Some(_) => return Err(invalid("\"chat_template_kwargs\" must be an object")),
        };
        let mut flag = |name: &str, default: bool| -> Result<bool, TemplateError> {
            match kwargs.remove(name).or_else(|| obj.get(name).cloned()) {
                None | Some(Value::Null) => Ok(default),
                Some(Value::Bool(b)) => Ok(b),
                Some(_) => Err(invalid(format!("\"{name}\" must be a boolean"))),
            }
        };
        let add_generation_prompt = flag("add_generation_prompt", true)?;
        let continue_final_message = flag("continue_final_message", false)?;
        self.render_args(&RenderArgs {
            messages,
            tools,
            documents,
            add_generation_prompt,
            continue_final_message,
            kwargs: &kwargs,
        })
    }

    /// Renders messages (OpenAI message objects), tools (OpenAI tool objects, passed as given) and template kwargs
    /// (`enable_thinking`, `preserve_thinking`, ...) to the prompt text, with the same preprocessing as
    /// [`render_request`](Self::render_request).
    pub fn render(
        &self,
        messages: &[Value],
        tools: Option<&[Value]>,
        add_generation_prompt: bool,
        kwargs: &Map<String, Value>,
    ) -> Result<String, TemplateError> {
        self.render_args(&RenderArgs {
            messages,
            tools,
            documents: None,
            add_generation_prompt,
            continue_final_message: false,
            kwargs,
        })
    }

    fn render_args(&self, args: &RenderArgs) -> Result<String, TemplateError> {
        for key in args.kwargs.keys() {
            if RESERVED_KWARGS.contains(&key.as_str()) || key == "add_generation_prompt" {
                return Err(invalid(format!(
                    "chat_template_kwargs may not set \"{key}\""
                )));
            }
        }
        if args.messages.is_empty() {
            return Err(invalid("Cannot apply chat template to an empty conversation. Provide at least one message."));
        }
        if let Some(tools) = args.tools {
            if let Some(i) = tools.iter().position(|t| !t.is_object()) {
                return Err(invalid(format!(
                    "tools[{i}] must be an object (a JSON schema)"
                )));
            }
        }
        if let Some(docs) = args.documents {
            if let Some(i) = docs.iter().position(|d| !d.is_object()) {
                return Err(invalid(format!("documents[{i}] must be an object")));
            }
        }
        let mut messages = preprocess_messages(args.messages)?;

        // transformers' continue_final_message: tag the final message's content, render, cut at the tag.
        let mut final_text = None;
        if args.continue_final_message {
            if args.add_generation_prompt {
                return Err(invalid(
                    "continue_final_message and add_generation_prompt are not compatible. Use continue_final_message when you want the model to continue the final message, and add_generation_prompt when you want to add a header that will prompt it to start a new assistant message instead.",
                ));
            }
            final_text = Some(tag_final_message(&mut messages, &self.text)?);
        }

        let mut ctx = Map::new();
        for (name, token) in &self.special_tokens {
            ctx.insert(name.clone(), Value::String(token.clone()));
        }
        for (k, v) in args.kwargs {
            ctx.insert(k.clone(), v.clone());
        }
        ctx.insert("messages".into(), Value::Array(messages));
        ctx.insert(
            "tools".into(),
            args.tools.map_or(Value::Null, |t| Value::Array(t.to_vec())),
        );
        ctx.insert(
            "documents".into(),
            args.documents
                .map_or(Value::Null, |d| Value::Array(d.to_vec())),
        );
        ctx.insert(
            "add_generation_prompt".into(),
            Value::Bool(args.add_generation_prompt),
        );

        let name = if args.tools.is_some() && self.has_tool_use {
            TOOL_USE
        } else {
            DEFAULT
        };
        let template = self
            .env
            .get_template(name)
            .map_err(|e| TemplateError::Render(describe(&e)))?;
        let rendered = template
            .render(minijinja::Value::from(Serde(&ctx)))
            .map_err(render_error)?;

        match final_text {
            None => Ok(rendered),
            Some(final_text) => cut_at_continue_tag(rendered, &final_text),
        }
    }
}

fn read_text(path: &Path) -> Result<String, TemplateError> {
    std::fs::read_to_string(path).map_err(|source| TemplateError::Io {
        path: path.to_path_buf(),
        source,
    })
}

fn read_json_object(path: &Path) -> Result<Map<String, Value>, TemplateError> {
    let text = read_text(path)?;
    match serde_json::from_str(&text) {
        Ok(Value::Object(m)) => Ok(m),
        Ok(_) => Err(TemplateError::Config {
            path: path.to_path_buf(),
            message: "not a JSON object".into(),
        }),
        Err(e) => Err(TemplateError::Config {
            path: path.to_path_buf(),
            message: e.to_string(),
        }),
    }
}

/// A special token's text: a string, or an AddedToken object (`{"content": ..., ...}`).
fn token_text(v: &Value) -> Option<String> {
    match v {
        Value::String(s) => Some(s.clone()),
        Value::Object(o) => o.get("content").and_then(Value::as_str).map(str::to_string),
        _ => None,
    }
}

/// The tokenizer's `special_tokens_map` as transformers 5 builds it: the named tokens (bos, eos, unk, sep, pad, cls,
/// mask) that are set, then the model-specific ones (other `*_token` string entries, `extra_special_tokens` or
/// `model_specific_special_tokens` given as a dict). A legacy `special_tokens_map.json` is read when the config
/// has no `added_tokens_decoder`.
fn special_tokens(
    dir: &Path,
    config: &Map<String, Value>,
) -> Result<Vec<(String, String)>, TemplateError> {
    let mut config = config.clone();
    let legacy = dir.join("special_tokens_map.json");
    if !config.contains_key("added_tokens_decoder") && legacy.is_file() {
        for (k, v) in read_json_object(&legacy)? {
            config.insert(k, v);
        }
    }
    let mut out: Vec<(String, String)> = Vec::new();
    let mut add = |name: &str, v: &Value| {
        if let Some(text) = token_text(v) {
            match out.iter_mut().find(|(n, _)| n == name) {
                Some(entry) => entry.1 = text,
                None => out.push((name.to_string(), text)),
            }
        }
    };
    for name in SPECIAL_TOKEN_NAMES {
        if let Some(v) = config.get(name) {
            add(name, v);
        }
    }
    for (k, v) in &config {
        if k.ends_with("_token") && !SPECIAL_TOKEN_NAMES.contains(&k.as_str()) {
            add(k, v);
        }
    }
    for key in ["extra_special_tokens", "model_specific_special_tokens"] {
        if let Some(Value::Object(m)) = config.get(key) {
            for (k, v) in m {
                add(k, v);
            }
        }
    }
    Ok(out)
}

fn optional_array<'a>(
    obj: &'a Map<String, Value>,
    key: &str,
) -> Result<Option<&'a [Value]>, TemplateError> {
    match obj.get(key) {
        None | Some(Value::Null) => Ok(None),
        Some(Value::Array(a)) => Ok(Some(a.as_slice())),
        Some(_) => Err(invalid(format!("\"{key}\" must be an array"))),
    }
}

/// vLLM's message preprocessing (`_postprocess_messages` in vllm/entrypoints/chat_utils), then transformers'
/// (`_normalize_chat_messages`: top-level null fields dropped; `_alias_reasoning_fields`).
fn preprocess_messages(messages: &[Value]) -> Result<Vec<Value>, TemplateError> {
    let mut out = Vec::with_capacity(messages.len());
    for (i, message) in messages.iter().enumerate() {
        let Some(obj) = message.as_object() else {
            return Err(invalid(format!("messages[{i}] must be an object")));
        };
        let Some(role) = obj.get("role").and_then(Value::as_str) else {
            return Err(invalid(format!("messages[{i}] has no string \"role\"")));
        };
        let mut obj = obj.clone();
        if role == "assistant" {
            let mut drop_calls = false;
            if let Some(Value::Array(calls)) = obj.get_mut("tool_calls") {
                drop_calls = calls.is_empty();
                for (j, call) in calls.iter_mut().enumerate() {
                    let Some(call) = call.as_object_mut() else {
                        return Err(invalid(format!(
                            "messages[{i}].tool_calls[{j}] must be an object"
                        )));
                    };
                    let is_function = call
                        .get("type")
                        .is_none_or(|t| t.as_str() == Some("function"));
                    match call.get_mut("function") {
                        Some(Value::Object(function)) if is_function => {
                            let args = function.get("arguments").cloned().unwrap_or(Value::Null);
                            function.insert("arguments".into(), normalize_arguments(args));
                        }
                        _ => {
                            return Err(invalid(format!(
                                "messages[{i}].tool_calls[{j}] must be a tool call of type \"function\" with a \"function\" object"
                            )))
                        }
                    }
                }
            }
            if drop_calls {
                obj.remove("tool_calls");
            }
        }
        obj.retain(|_, v| !v.is_null());

        // transformers: {"thinking": r, **message, "reasoning_content": r} with r the first non-null of
        // reasoning_content, thinking, reasoning.
        let reasoning = ["reasoning_content", "thinking", "reasoning"]
            .iter()
            .find_map(|k| obj.get(*k))
            .cloned();
        if let Some(reasoning) = reasoning {
            let mut aliased = Map::new();
            aliased.insert("thinking".into(), reasoning.clone());
            for (k, v) in obj {
                aliased.insert(k, v);
            }
            aliased.insert("reasoning_content".into(), reasoning);
            obj = aliased;
        }
        out.push(Value::Object(obj));
    }
    Ok(out)
}

/// vLLM: arguments given as a JSON string are parsed; anything that is not an object in the end (invalid JSON, JSON
/// that is not an object, null, "") becomes `{}`, so a malformed call in the history cannot break every later turn.
fn normalize_arguments(args: Value) -> Value {
    let parsed = match args {
        Value::String(s) if !s.is_empty() => serde_json::from_str(&s).unwrap_or(Value::Null),
        other => other,
    };
    match parsed {
        Value::Object(_) => parsed,
        _ => Value::Object(Map::new()),
    }
}

/// Appends transformers' continue tag to the final message's content (a string, or the last text part of a list);
/// returns the text to continue.
fn tag_final_message(messages: &mut [Value], template_text: &str) -> Result<String, TemplateError> {
    let last = messages
        .last_mut()
        .and_then(Value::as_object_mut)
        .expect("messages are non-empty objects");
    if !template_text.contains("content") {
        return Err(invalid(
            "continue_final_message is set to \"content\" but this is not an accepted field in the chat_template",
        ));
    }
    match last.get_mut("content") {
        Some(Value::String(s)) => {
            let text = s.clone();
            s.push_str(CONTINUE_TAG);
            Ok(text)
        }
        Some(Value::Array(parts)) => {
            for part in parts.iter_mut().rev() {
                if let Some(Value::String(text)) =
                    part.as_object_mut().and_then(|p| p.get_mut("text"))
                {
                    let original = text.clone();
                    text.push_str(CONTINUE_TAG);
                    return Ok(original);
                }
            }
            Err(invalid("continue_final_message is set but we could not find any text to continue in the final message!"))
        }
        Some(_) => Err(invalid(
            "continue_final_message is set but the final message's content is not text",
        )),
        None => Err(invalid(
            "continue_final_message is set but the final message has no \"content\" to continue!",
        )),
    }
}

fn cut_at_continue_tag(rendered: String, final_text: &str) -> Result<String, TemplateError> {
    let tag = CONTINUE_TAG.trim_end();
    let final_stripped = pyfmt::py_strip(final_text, None, true, true);
    let Some(loc) = rendered
        .rfind(tag)
        .filter(|_| rendered.contains(final_stripped))
    else {
        return Err(invalid(
            "continue_final_message is set but the final message does not appear in the chat after applying the chat template",
        ));
    };
    if rendered[loc..].starts_with(CONTINUE_TAG) {
        Ok(rendered[..loc].to_string())
    } else {
        Ok(pyfmt::py_strip(&rendered[..loc], None, false, true).to_string())
    }
}

/// minijinja's error with its chain of causes, on one line.
fn describe(err: &minijinja::Error) -> String {
    let mut text = err.to_string();
    let mut source = std::error::Error::source(err);
    while let Some(s) = source {
        text.push_str(": ");
        text.push_str(&s.to_string());
        source = s.source();
    }
    text
}

fn render_error(err: minijinja::Error) -> TemplateError {
    let mut source: Option<&(dyn std::error::Error + 'static)> = Some(&err);
    while let Some(s) = source {
        if let Some(raised) = s.downcast_ref::<env::RaisedException>() {
            return TemplateError::Raised(raised.0.clone());
        }
        source = s.source();
    }
    TemplateError::Render(describe(&err))
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;

    #[test]
    fn send_sync() {
        fn check<T: Send + Sync>() {}
        check::<ChatTemplate>();
    }

    #[test]
    fn builtin_basic() {
        let t = ChatTemplate::builtin();
        let out = t
            .render_request(&json!({"messages": [{"role": "user", "content": "Hi"}]}))
            .unwrap();
        assert_eq!(
            out,
            "<|im_start|>user\nHi<|im_end|>\n<|im_start|>assistant\n<think>\n"
        );
        let out = t
            .render_request(&json!({"messages": [{"role": "user", "content": "Hi"}], "chat_template_kwargs": {"enable_thinking": false}}))
            .unwrap();
        assert_eq!(
            out,
            "<|im_start|>user\nHi<|im_end|>\n<|im_start|>assistant\n<think>\n\n</think>\n\n"
        );
    }

    #[test]
    fn request_errors() {
        let t = ChatTemplate::builtin();
        for body in [
            json!({}),
            json!([]),
            json!({"messages": "hi"}),
            json!({"messages": []}),
            json!({"messages": [{"content": "no role"}]}),
            json!({"messages": ["just a string"]}),
            json!({"messages": [{"role": "user", "content": "x"}], "tools": {"a": 1}}),
            json!({"messages": [{"role": "user", "content": "x"}], "tools": ["not an object"]}),
            json!({"messages": [{"role": "user", "content": "x"}], "chat_template_kwargs": {"messages": []}}),
            json!({"messages": [{"role": "user", "content": "x"}], "add_generation_prompt": "yes"}),
            json!({"messages": [{"role": "assistant", "content": "x", "tool_calls": ["bad"]}]}),
            json!({"messages": [{"role": "user", "content": "x"}], "continue_final_message": true}),
        ] {
            let err = t.render_request(&body).unwrap_err();
            assert!(
                matches!(err, TemplateError::InvalidRequest(_)),
                "{body}: {err:?}"
            );
            assert!(err.is_request_error());
        }
    }

    #[test]
    fn raise_exception_reaches_user() {
        let t = ChatTemplate::builtin();
        let body = json!({"messages": [{"role": "user", "content": "a"}, {"role": "system", "content": "late"}]});
        let err = t.render_request(&body).unwrap_err();
        assert!(
            matches!(&err, TemplateError::Raised(m) if m == "System message must be at the beginning."),
            "{err:?}"
        );
        assert_eq!(err.to_string(), "System message must be at the beginning.");
        // raised inside a macro
        let body = json!({"messages": [{"role": "system", "content": [{"type": "image_url", "image_url": {"url": "x"}}]}, {"role": "user", "content": "a"}]});
        let err = t.render_request(&body).unwrap_err();
        assert_eq!(err.to_string(), "System message cannot contain images.");
    }

    #[test]
    fn syntax_and_render_errors() {
        let err = ChatTemplate::from_source("{% for x in %}").unwrap_err();
        assert!(matches!(err, TemplateError::Syntax(_)), "{err:?}");
        let t = ChatTemplate::from_source("{{ messages[0].nope.deeper }}").unwrap();
        let err = t
            .render(
                &[json!({"role": "user", "content": "x"})],
                None,
                true,
                &Map::new(),
            )
            .unwrap_err();
        assert!(matches!(err, TemplateError::Render(_)), "{err:?}");
    }

    #[test]
    fn python_semantics() {
        let t = ChatTemplate::from_source(
            "{{ x }}|{{ x|string }}|{{ x|tojson }}|{{ s|trim }}|{{ s.split()|length }}|{{ 'a b'.split(none, 1) }}|{{ d|tojson(indent=1) }}|{{ d|tojson(separators=[',', ':'], sort_keys=true) }}|{{ 'é<>'|tojson(true) }}",
        )
        .unwrap();
        let kwargs = json!({"x": [true, null, 1.0, 1e-5, "it's"], "s": "\u{1f} a b \u{3000}", "d": {"b": [], "a": {}, "c": [1]}});
        let out = t
            .render(
                &[json!({"role": "user"})],
                None,
                false,
                kwargs.as_object().unwrap(),
            )
            .unwrap();
        assert_eq!(
            out,
            "[True, None, 1.0, 1e-05, \"it's\"]|[True, None, 1.0, 1e-05, \"it's\"]|[true, null, 1.0, 1e-05, \"it's\"]|a b|2|['a', 'b']|{\n \"b\": [],\n \"a\": {},\n \"c\": [\n  1\n ]\n}|{\"a\":{},\"b\":[],\"c\":[1]}|\"\\u00e9<>\""
        );
    }
}

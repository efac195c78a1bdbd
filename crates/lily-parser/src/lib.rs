//! Streaming parser of Qwen3.5 / Qwen3.6 assistant output.
//!
//! The model's raw text is split into three channels: reasoning (`<think>…</think>`), content, and
//! tool calls written in Qwen's XML form
//!
//! ```text
//! <tool_call>
//! <function=NAME>
//! <parameter=ARG>
//! VALUE
//! </parameter>
//! </function>
//! </tool_call>
//! ```
//!
//! which become OpenAI tool calls whose `arguments` is a JSON object text, each value typed by the
//! tool's JSON schema. The parser works on a stream of decoded text pieces split anywhere (even inside
//! a tag such as `"<tool_c"`), emits an [`Event`] only once it is certain, never panics, and never
//! silently drops text: whatever is not recognised markup ends up in reasoning, content or a tool
//! call.
//!
//! ```
//! use lily_parser::{Event, OutputParser, ParserConfig, ToolSpec};
//! let tools = vec![ToolSpec::new("get_weather", serde_json::json!({
//!     "type": "object", "properties": {"city": {"type": "string"}, "days": {"type": "integer"}}}))];
//! let mut p = OutputParser::new(ParserConfig { reasoning: true, tools, id_seed: Some(0) });
//! let mut events = p.push("Rain?\n</think>\n\n");
//! events.extend(p.push("<tool_call>\n<function=get_weather>\n<parameter=city>\nParis\n</parameter>\n"));
//! events.extend(p.push("<parameter=days>\n3\n</parameter>\n</function>\n</tool_call>"));
//! let (tail, msg) = p.finish();
//! events.extend(tail);
//! assert_eq!(msg.reasoning.as_deref(), Some("Rain?"));
//! assert_eq!(msg.content, None);
//! assert_eq!(msg.tool_calls[0].name, "get_weather");
//! assert_eq!(msg.tool_calls[0].arguments, r#"{"city":"Paris","days":3}"#);
//! assert!(matches!(events[0], Event::Reasoning(_)));
//! ```
//!
//! # Rules
//!
//! **Reasoning and content.**
//! * `ParserConfig::reasoning` says the prompt already opened the think block (the generation prompt
//!   ends in `<think>\n`). Then the output starts in reasoning; text after `</think>` is content. If
//!   `</think>` never comes, everything (except extracted tool calls) is reasoning.
//! * With `reasoning == false` the output starts in content. A `<think>` emitted by the model before
//!   any content opens a reasoning block (closed by `</think>`). A `<think>` or `</think>` that comes
//!   after content has been emitted is literal text (the model writing about the tags); so is a second
//!   `<think>` once reasoning text has been emitted. A stray `</think>` before any content (and a
//!   duplicated `<think>` at the very start of reasoning) is dropped as markup. Known limit: with
//!   `reasoning == false`, reasoning that the model emits *without* an opening `<think>` has already
//!   been streamed as content when the `</think>` arrives; it stays content (with the literal tag).
//! * Whitespace around markup is trimmed, as the chat template writes it (`<think>\n…\n</think>\n\n`,
//!   `\n\n<tool_call>`, `\n` between calls) and as vLLM's `qwen3` reasoning parser strips it: each
//!   run of reasoning or content text loses its leading whitespace when it starts the message or
//!   follows markup (the `\n\n` after `</think>`), and its trailing whitespace when markup or the
//!   end of generation follows (the `\n` before `</think>`). Whitespace inside is kept. When text
//!   of one channel resumes after markup (content before and after a tool call), the whitespace
//!   held before the markup is kept as the separator. Trailing whitespace is therefore held back
//!   while streaming until non-whitespace text follows.
//! * `ParsedMessage::reasoning`/`content` is `None` when empty; it always equals the concatenation of
//!   the corresponding events.
//!
//! **Tool calls.**
//! * Tool calls are parsed only if `ParserConfig::tools` is non-empty; with no tools every tag is
//!   literal text. Unknown function names are kept (the client decides).
//! * A tool call inside the reasoning (Qwen3.5/3.6 often call tools without closing `</think>`) is
//!   extracted as a tool call; afterwards the parser is back in reasoning. A call inside content
//!   returns to content. Events keep stream order, so content/reasoning may follow a call.
//! * `<tool_call>` counts as markup only when it is followed (after whitespace) by
//!   `<function=NAME>` or by a JSON object `{"name": …, "arguments": …}` (Hermes style, also
//!   accepted). Otherwise it is literal text (e.g. the model mentions the tag while thinking). A
//!   `<function=NAME>` without `<tool_call>` is accepted only if NAME is one of the tools and the
//!   tag is followed by `<parameter=`, `</function>` or `{`. Names are at most 256 bytes, on one line;
//!   surrounding quotes are stripped. Several `<function=…>` blocks inside one `<tool_call>` are
//!   several calls.
//! * Parameter values: exactly one leading and one trailing `\n` are removed (the template adds
//!   them). Values are raw text: `&`, `<`, `>` are kept as they are (no XML entity decoding). A value
//!   ends at `</parameter>` only if what follows (after whitespace) is `<parameter=`, `</function>`,
//!   `</tool_call>`, `<tool_call>`, `<function=`, `</think>` or the end of generation; otherwise the
//!   `</parameter>` is part of the value (source code that contains the tag). Malformed closings are
//!   accepted: a value also ends at `</function>` (followed by `</tool_call>`, `<tool_call>`,
//!   `<function=`, `</think>` or the end), at `</tool_call>` (followed by `<tool_call>`, `</think>` or
//!   the end), and at a line starting with `<parameter=NAME>` where NAME is a not-yet-given
//!   parameter of the tool's schema (any name for a tool without schema).
//! * Typing by the schema (`parameters.properties[ARG]`: `type` string or list, else the branches of
//!   `anyOf`/`oneOf`/`allOf`, else the kinds of `enum`/`const` values, else `properties` ⇒ object,
//!   `items` ⇒ array): if the type admits `string`, or is unknown, or the parameter is not in the
//!   schema, the value is a JSON string, streamed piece by piece as it arrives. Otherwise the value is
//!   held until it ends and parsed: JSON objects/arrays/booleans/null of an admitted type are used
//!   (re-serialised compactly), a JSON number is used as written for `number` and normalised for
//!   `integer` (`4.0` ⇒ `4`; `4.5` is not an integer), `True`/`False` are booleans, a JSON string
//!   holding a matching value (`"5"` for an integer) is unwrapped. A value that does not match (e.g.
//!   `abc` for an integer, a truncated object) is kept as a JSON string; the call is never dropped.
//! * A parameter given twice appears twice in the arguments text (JSON readers keep the last).
//! * A function body that is a JSON object (`<function=f>\n{"a":1}\n</function>`) is taken as the
//!   arguments. Other text between parameters is not dropped: it is emitted as reasoning/content
//!   (whichever the call is inside of), in stream order.
//! * Unclosed at the end of generation: an open `<parameter=ARG>` value is kept as the value (typed
//!   like any other); a call whose `<function=NAME>` tag was complete is kept with the arguments
//!   parsed so far; a tag that never completed (`<tool_call>` alone, `<function=na`, `<parameter=na`)
//!   is emitted as text. Truncated closing tags (`</func`) at the very end are dropped as markup.
//! * Arguments stream as [`Event::ToolCallArguments`] fragments whose concatenation is exactly
//!   `ToolCall::arguments` (compact JSON: `{"a":"x","b":1}`, `{}` when there are no parameters):
//!   `{"ARG":"` is sent when the parameter opens, string values follow as JSON-escaped pieces, typed
//!   values when they end, `}` when the call ends.
//! * Known limit: at the text level a `<tool_call>` spelled out in an answer (e.g. documenting the
//!   format) cannot be told from the special token; a well-formed one is parsed as a call.
//! * Ids are `call_` + 16 hex digits, unique within a message (a bijective mix of seed + index); the
//!   seed is random per parser unless `ParserConfig::id_seed` is set (deterministic, for tests).
//!
//! **Streaming.** [`OutputParser::push`] takes `&str`, so pieces are whole UTF-8 characters (the
//! caller holds back an incomplete byte sequence at a token boundary); any split of the text gives
//! the same [`ParsedMessage`]. Held back at most: a partial tag (a name is at most 256 bytes),
//! trailing whitespace of reasoning/content, one trailing `\n` of a string value, the lookahead
//! after a closing tag, a non-string value until it ends, and a JSON-form call until it is complete.

#![forbid(unsafe_code)]

use serde::{Deserialize, Serialize};
use serde_json::Value;
use std::cell::Cell;

/// A tool the request offers: function name plus the JSON schema of its parameters.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct ToolSpec {
    pub name: String,
    /// JSON schema of the arguments object (`{"type":"object","properties":{…}}`); `Null` if absent.
    #[serde(default)]
    pub parameters: Value,
}

/// Why [`ToolSpec::from_openai`] rejected a tool definition.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum ToolSpecError {
    #[error("tool definition is not a JSON object")]
    NotAnObject,
    #[error("tool type {0:?} is not \"function\"")]
    NotFunction(String),
    #[error("tool definition has no function name")]
    MissingName,
}

impl ToolSpec {
    pub fn new(name: impl Into<String>, parameters: Value) -> Self {
        ToolSpec {
            name: name.into(),
            parameters,
        }
    }

    /// From an OpenAI `tools[]` entry (`{"type":"function","function":{"name","parameters"}}`) or a
    /// bare function object (`{"name","parameters"}`).
    pub fn from_openai(tool: &Value) -> Result<Self, ToolSpecError> {
        let obj = tool.as_object().ok_or(ToolSpecError::NotAnObject)?;
        if let Some(t) = obj.get("type").and_then(Value::as_str) {
            if t != "function" {
                return Err(ToolSpecError::NotFunction(t.to_string()));
            }
        }
        let f = match obj.get("function") {
            Some(Value::Object(f)) => f,
            _ => obj,
        };
        let name = f
            .get("name")
            .and_then(Value::as_str)
            .filter(|n| !n.is_empty())
            .ok_or(ToolSpecError::MissingName)?;
        let parameters = f.get("parameters").cloned().unwrap_or(Value::Null);
        Ok(ToolSpec::new(name, parameters))
    }
}

/// How to parse one generation.
#[derive(Debug, Clone, Default)]
pub struct ParserConfig {
    /// The prompt opened `<think>` (thinking mode): output starts in reasoning.
    pub reasoning: bool,
    /// The request's tools; empty disables tool-call parsing.
    pub tools: Vec<ToolSpec>,
    /// Seed of the tool-call ids; `None` picks a random one. Set it in tests.
    pub id_seed: Option<u64>,
}

/// One certain piece of output, in stream order. Adjacent events of the same kind returned by one
/// call are merged.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Event {
    Reasoning(String),
    Content(String),
    ToolCallStart {
        index: usize,
        id: String,
        name: String,
    },
    ToolCallArguments {
        index: usize,
        fragment: String,
    },
    ToolCallEnd {
        index: usize,
    },
}

/// The whole parsed message.
#[derive(Debug, Clone, PartialEq, Eq, Default, Serialize, Deserialize)]
pub struct ParsedMessage {
    pub reasoning: Option<String>,
    pub content: Option<String>,
    pub tool_calls: Vec<ToolCall>,
}

/// An OpenAI-style function call.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct ToolCall {
    pub id: String,
    pub name: String,
    /// JSON object text.
    pub arguments: String,
}

/// Parse a complete output in one go.
pub fn parse(cfg: ParserConfig, text: &str) -> ParsedMessage {
    let mut p = OutputParser::new(cfg);
    p.push(text);
    p.finish().1
}

// ---------------------------------------------------------------------------------------------
// Internals
// ---------------------------------------------------------------------------------------------

const THINK_OPEN: &str = "<think>";
const THINK_CLOSE: &str = "</think>";
const TC_OPEN: &str = "<tool_call>";
const TC_CLOSE: &str = "</tool_call>";
const FN_OPEN: &str = "<function=";
const FN_CLOSE: &str = "</function>";
const P_OPEN: &str = "<parameter=";
const P_CLOSE: &str = "</parameter>";
const MAX_NAME: usize = 256;

/// What may follow a `</parameter>` that really closes a value.
const AFTER_PARAM: &[&str] = &[P_OPEN, FN_CLOSE, TC_CLOSE, TC_OPEN, FN_OPEN, THINK_CLOSE];
/// What may follow a `</function>` that closes a value whose `</parameter>` is missing.
const AFTER_FUNC: &[&str] = &[TC_CLOSE, TC_OPEN, FN_OPEN, THINK_CLOSE];
/// What may follow a `</tool_call>` that closes a value whose closers are missing.
const AFTER_TC: &[&str] = &[TC_OPEN, THINK_CLOSE];
/// Closing tags that are dropped when truncated at the end of generation.
const CLOSERS: &[&str] = &[P_CLOSE, FN_CLOSE, TC_CLOSE];

// JSON-schema type bits ([`schema_types`]).
pub const T_STR: u8 = 1;
pub const T_INT: u8 = 2;
pub const T_NUM: u8 = 4;
pub const T_BOOL: u8 = 8;
pub const T_OBJ: u8 = 16;
pub const T_ARR: u8 = 32;
pub const T_NULL: u8 = 64;

/// Result of matching at the head of the buffer.
#[derive(Debug, Clone, PartialEq, Eq)]
enum M<T> {
    Yes(T),
    No,
    /// The buffer ends before the answer is certain.
    More,
}

/// Does `s` start with tag `t` (Yes(len)), could it once more text arrives (More), or not (No)?
fn tag(s: &str, t: &str) -> M<usize> {
    if s.starts_with(t) {
        M::Yes(t.len())
    } else if t.starts_with(s) {
        M::More
    } else {
        M::No
    }
}

fn ws_len(s: &str) -> usize {
    s.len() - s.trim_start().len()
}

/// `s` is the text right after `<function=` / `<parameter=`: the name up to `>`, and the bytes used.
fn name_after(s: &str) -> M<(String, usize)> {
    for (i, c) in s.char_indices() {
        if i > MAX_NAME {
            return M::No;
        }
        if c == '>' {
            let n = s[..i].trim();
            let n = strip_quotes(n).trim();
            return if n.is_empty() {
                M::No
            } else {
                M::Yes((n.to_string(), i + 1))
            };
        }
        if c == '\n' || c == '<' {
            return M::No;
        }
    }
    if s.len() > MAX_NAME {
        M::No
    } else {
        M::More
    }
}

fn strip_quotes(s: &str) -> &str {
    for q in ['"', '\''] {
        if s.len() >= 2 && s.starts_with(q) && s.ends_with(q) {
            return &s[1..s.len() - 1];
        }
    }
    s
}

/// After a closing tag: whitespace, then one of `set` or the end of generation.
fn followed_by(s: &str, set: &[&str], eof: bool) -> M<()> {
    let r = &s[ws_len(s)..];
    if r.is_empty() {
        return if eof { M::Yes(()) } else { M::More };
    }
    let mut more = false;
    for t in set {
        match tag(r, t) {
            M::Yes(_) => return M::Yes(()),
            M::More => more = true,
            M::No => {}
        }
    }
    match (more, eof) {
        (true, false) => M::More,
        // Cut off while writing the next tag: accept.
        (true, true) => M::Yes(()),
        _ => M::No,
    }
}

fn json_escape_inner(s: &str) -> String {
    let q = serde_json::to_string(s).unwrap_or_else(|_| String::from("\"\""));
    q[1..q.len() - 1].to_string()
}

fn json_string(s: &str) -> String {
    serde_json::to_string(s).unwrap_or_else(|_| String::from("\"\""))
}

fn splitmix64(mut z: u64) -> u64 {
    z = z.wrapping_add(0x9E37_79B9_7F4A_7C15);
    z = (z ^ (z >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
    z = (z ^ (z >> 27)).wrapping_mul(0x94D0_49BB_1331_11EB);
    z ^ (z >> 31)
}

fn random_seed() -> u64 {
    use std::hash::{BuildHasher, Hasher};
    use std::sync::atomic::{AtomicU64, Ordering};
    static COUNTER: AtomicU64 = AtomicU64::new(0);
    let mut h = std::collections::hash_map::RandomState::new().build_hasher();
    h.write_u64(COUNTER.fetch_add(1, Ordering::Relaxed));
    if let Ok(d) = std::time::SystemTime::now().duration_since(std::time::UNIX_EPOCH) {
        h.write_u128(d.as_nanos());
    }
    h.finish()
}

fn type_bit(t: &str) -> u8 {
    match t {
        "string" => T_STR,
        "integer" => T_INT,
        "number" => T_NUM,
        "boolean" => T_BOOL,
        "object" => T_OBJ,
        "array" => T_ARR,
        "null" => T_NULL,
        _ => 0,
    }
}

fn value_bit(v: &Value) -> u8 {
    match v {
        Value::String(_) => T_STR,
        Value::Number(n) if n.is_i64() || n.is_u64() => T_INT | T_NUM,
        Value::Number(_) => T_NUM,
        Value::Bool(_) => T_BOOL,
        Value::Object(_) => T_OBJ,
        Value::Array(_) => T_ARR,
        Value::Null => T_NULL,
    }
}

/// The JSON types a schema admits, as `T_*` bits (0 = unknown), looking at most 8 levels into
/// `anyOf`/`oneOf`/`allOf` from `depth`. A tool parameter with no known type or one admitting a
/// string is read as raw text, any other as JSON: `lily-grammar` builds its tool-call grammar on this
/// same reading, so that the parser's reading of a value and the grammar's cannot drift apart.
pub fn schema_types(s: &Value, depth: usize) -> u8 {
    if depth > 8 {
        return 0;
    }
    let mut bits = 0;
    match s.get("type") {
        Some(Value::String(t)) => bits |= type_bit(t),
        Some(Value::Array(ts)) => {
            for t in ts {
                if let Some(t) = t.as_str() {
                    bits |= type_bit(t);
                }
            }
        }
        _ => {}
    }
    if bits == 0 {
        for key in ["anyOf", "oneOf", "allOf"] {
            if let Some(Value::Array(branches)) = s.get(key) {
                for b in branches {
                    bits |= schema_types(b, depth + 1);
                }
            }
        }
    }
    if bits == 0 {
        if let Some(Value::Array(vs)) = s.get("enum") {
            for v in vs {
                bits |= value_bit(v);
            }
        }
        if let Some(v) = s.get("const") {
            bits |= value_bit(v);
        }
    }
    if bits == 0 {
        if s.get("properties").is_some() {
            bits |= T_OBJ;
        } else if s.get("items").is_some() {
            bits |= T_ARR;
        }
    }
    if s.get("nullable").and_then(Value::as_bool) == Some(true) && bits != 0 {
        bits |= T_NULL;
    }
    bits
}

fn integral(n: &serde_json::Number) -> Option<String> {
    if n.is_i64() || n.is_u64() {
        return Some(n.to_string());
    }
    let f = n.as_f64()?;
    if f.is_finite() && f.fract() == 0.0 && f.abs() < 9.0e15 {
        Some(format!("{}", f as i64))
    } else {
        None
    }
}

/// Typed value text for a non-string parameter, or `None` if it does not match `bits`.
fn coerce_typed(bits: u8, t: &str, depth: usize) -> Option<String> {
    let t = t.trim();
    if let Ok(v) = serde_json::from_str::<Value>(t) {
        match &v {
            Value::Object(_) if bits & T_OBJ != 0 => return Some(v.to_string()),
            Value::Array(_) if bits & T_ARR != 0 => return Some(v.to_string()),
            Value::Bool(_) if bits & T_BOOL != 0 => return Some(v.to_string()),
            Value::Null if bits & T_NULL != 0 => return Some("null".into()),
            Value::Number(n) => {
                if bits & T_NUM != 0 {
                    return Some(t.to_string());
                }
                if bits & T_INT != 0 {
                    if let Some(i) = integral(n) {
                        return Some(i);
                    }
                }
            }
            Value::String(s) if depth == 0 => return coerce_typed(bits, s, 1),
            _ => {}
        }
    }
    if bits & T_BOOL != 0 {
        if t.eq_ignore_ascii_case("true") {
            return Some("true".into());
        }
        if t.eq_ignore_ascii_case("false") {
            return Some("false".into());
        }
    }
    if bits & (T_NUM | T_INT) != 0
        && !t.is_empty()
        && t.chars()
            .all(|c| c.is_ascii_digit() || matches!(c, '+' | '-' | '.' | 'e' | 'E'))
        && t.chars().any(|c| c.is_ascii_digit())
    {
        if let Ok(f) = t.parse::<f64>() {
            if f.is_finite() {
                if bits & T_NUM != 0 {
                    if let Some(n) = serde_json::Number::from_f64(f) {
                        return Some(n.to_string());
                    }
                }
                if bits & T_INT != 0 && f.fract() == 0.0 && f.abs() < 9.0e15 {
                    return Some(format!("{}", f as i64));
                }
            }
        }
    }
    None
}

/// The first JSON value of `s`: its value and byte length.
fn first_json(s: &str) -> M<(Value, usize)> {
    let mut it = serde_json::Deserializer::from_str(s).into_iter::<Value>();
    match it.next() {
        Some(Ok(v)) => M::Yes((v, it.byte_offset())),
        Some(Err(e)) if e.is_eof() => M::More,
        Some(Err(_)) => M::No,
        None => M::More,
    }
}

/// Arguments of a JSON-form call as object text.
fn json_args_text(a: Option<&Value>) -> Option<String> {
    match a {
        None | Some(Value::Null) => Some("{}".into()),
        Some(v @ Value::Object(_)) => Some(v.to_string()),
        Some(Value::String(s)) => match serde_json::from_str::<Value>(s) {
            Ok(v @ Value::Object(_)) => Some(v.to_string()),
            _ => None,
        },
        _ => None,
    }
}

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Mode {
    Reasoning,
    Content,
}

#[derive(Debug, Default)]
struct TextAcc {
    text: String,
    /// Trailing whitespace not yet emitted.
    pending: String,
    /// Something other than whitespace was emitted.
    any: bool,
}

#[derive(Debug)]
struct CallAcc {
    id: String,
    name: String,
    tool: Option<usize>,
    args: String,
    n_params: usize,
    seen: Vec<String>,
    args_done: bool,
}

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Kind {
    Str,
    Typed(u8),
}

#[derive(Debug)]
struct ParamSt {
    kind: Kind,
    at_start: bool,
    held_nl: bool,
    nonempty: bool,
    raw: String,
}

#[derive(Debug)]
enum State {
    Text,
    /// Inside `<function=…>`, between parameters. `stray`: the last thing was non-markup text.
    Function {
        stray: bool,
    },
    Param(ParamSt),
    /// After `</function>`, expecting `</tool_call>`.
    AfterFunction,
}

enum OuterAct {
    Drop(usize),
    OpenThink(usize),
    CloseThink(usize),
    Call {
        len: usize,
        name: String,
    },
    JsonCall {
        len: usize,
        name: String,
        args: String,
    },
}

enum FnAct {
    Param { len: usize, name: String },
    CloseFunction(usize),
    EndCall(usize),
    NewCall { len: usize, name: String },
    Drop(usize),
    JsonBody { len: usize, args: String },
    Stray(usize),
}

/// A closing tag of a value, what may follow it, and the resulting end.
type Closer = (&'static str, &'static [&'static str], fn(usize) -> ParamEnd);

enum ParamEnd {
    CloseParam(usize),
    CloseFunction(usize),
    CloseCall(usize),
    NextParam,
}

/// Incremental parser; see the crate documentation for the rules.
#[derive(Debug)]
pub struct OutputParser {
    tools: Vec<ToolSpec>,
    seed: u64,
    mode: Mode,
    state: State,
    buf: String,
    /// Just after markup (or at the start): leading whitespace is dropped.
    seg_start: bool,
    reasoning: TextAcc,
    content: TextAcc,
    calls: Vec<CallAcc>,
    out: Vec<Event>,
    /// Buffer length at the last incomplete JSON attempt: retry only after a new `}`.
    json_gate: Cell<Option<usize>>,
}

impl OutputParser {
    pub fn new(cfg: ParserConfig) -> Self {
        OutputParser {
            tools: cfg.tools,
            seed: cfg.id_seed.unwrap_or_else(random_seed),
            mode: if cfg.reasoning {
                Mode::Reasoning
            } else {
                Mode::Content
            },
            state: State::Text,
            buf: String::new(),
            seg_start: true,
            reasoning: TextAcc::default(),
            content: TextAcc::default(),
            calls: Vec::new(),
            out: Vec::new(),
            json_gate: Cell::new(None),
        }
    }

    /// Feed a piece of decoded text; returns the events that became certain.
    pub fn push(&mut self, text: &str) -> Vec<Event> {
        self.buf.push_str(text);
        self.run(false);
        std::mem::take(&mut self.out)
    }

    /// End of generation: flush everything held back and return the whole message.
    pub fn finish(mut self) -> (Vec<Event>, ParsedMessage) {
        self.run(true);
        match std::mem::replace(&mut self.state, State::Text) {
            State::Param(p) => {
                self.state = State::Param(p);
                self.finalize_param();
                self.end_call();
            }
            State::Function { .. } | State::AfterFunction => self.end_call(),
            State::Text => {}
        }
        if !self.buf.is_empty() {
            // Safety net; the state machine consumes everything at the end.
            let rest = std::mem::take(&mut self.buf);
            self.emit_text(&rest);
        }
        let nonempty = |s: String| if s.is_empty() { None } else { Some(s) };
        let msg = ParsedMessage {
            reasoning: nonempty(std::mem::take(&mut self.reasoning.text)),
            content: nonempty(std::mem::take(&mut self.content.text)),
            tool_calls: self
                .calls
                .drain(..)
                .map(|c| ToolCall {
                    id: c.id,
                    name: c.name,
                    arguments: c.args,
                })
                .collect(),
        };
        (std::mem::take(&mut self.out), msg)
    }

    fn run(&mut self, eof: bool) {
        let mut budget = 4 * self.buf.len() + 64;
        while budget > 0 && self.step(eof) {
            budget -= 1;
        }
    }

    fn drain(&mut self, n: usize) {
        self.buf.drain(..n);
        self.json_gate.set(None);
    }

    fn take(&mut self, n: usize) -> String {
        let s = self.buf[..n].to_string();
        self.drain(n);
        s
    }

    fn step(&mut self, eof: bool) -> bool {
        if self.buf.is_empty() {
            return false;
        }
        match self.state {
            State::Text => self.step_text(eof),
            State::Function { stray } => self.step_function(stray, eof),
            State::Param(_) => self.step_param(eof),
            State::AfterFunction => self.step_after_function(eof),
        }
    }

    // ----- events -----------------------------------------------------------------------------

    fn push_event(&mut self, e: Event) {
        match (self.out.last_mut(), e) {
            (Some(Event::Reasoning(a)), Event::Reasoning(b)) => a.push_str(&b),
            (Some(Event::Content(a)), Event::Content(b)) => a.push_str(&b),
            (
                Some(Event::ToolCallArguments {
                    index: i,
                    fragment: a,
                }),
                Event::ToolCallArguments {
                    index: j,
                    fragment: b,
                },
            ) if *i == j => a.push_str(&b),
            (_, e) => self.out.push(e),
        }
    }

    /// Text of the current outer channel (reasoning or content), with whitespace trimming.
    fn emit_text(&mut self, s: &str) {
        let mut s = s;
        if self.seg_start {
            s = s.trim_start();
            if s.is_empty() {
                return;
            }
            self.seg_start = false;
        }
        let mode = self.mode;
        let acc = match mode {
            Mode::Reasoning => &mut self.reasoning,
            Mode::Content => &mut self.content,
        };
        let core = s.trim_end();
        let tail = &s[core.len()..];
        if core.is_empty() {
            acc.pending.push_str(tail);
            return;
        }
        let mut out = String::new();
        if acc.any {
            out.push_str(&acc.pending);
        }
        acc.pending.clear();
        out.push_str(core);
        acc.pending.push_str(tail);
        acc.any = true;
        acc.text.push_str(&out);
        self.push_event(match mode {
            Mode::Reasoning => Event::Reasoning(out),
            Mode::Content => Event::Content(out),
        });
    }

    fn emit_args(&mut self, frag: &str) {
        if frag.is_empty() || self.calls.is_empty() {
            return;
        }
        let index = self.calls.len() - 1;
        if let Some(c) = self.calls.last_mut() {
            c.args.push_str(frag);
        }
        self.push_event(Event::ToolCallArguments {
            index,
            fragment: frag.to_string(),
        });
    }

    fn tool_index(&self, name: &str) -> Option<usize> {
        self.tools.iter().position(|t| t.name == name)
    }

    fn start_call(&mut self, name: String) {
        let index = self.calls.len();
        let id = format!(
            "call_{:016x}",
            splitmix64(self.seed.wrapping_add(index as u64))
        );
        let tool = self.tool_index(&name);
        self.calls.push(CallAcc {
            id: id.clone(),
            name: name.clone(),
            tool,
            args: String::new(),
            n_params: 0,
            seen: Vec::new(),
            args_done: false,
        });
        self.push_event(Event::ToolCallStart { index, id, name });
        self.seg_start = true;
        self.state = State::Function { stray: false };
    }

    fn end_call(&mut self) {
        if let Some(c) = self.calls.last() {
            if !c.args_done {
                let frag = if c.n_params == 0 { "{}" } else { "}" };
                self.emit_args(frag);
            }
            if let Some(c) = self.calls.last_mut() {
                c.args_done = true;
            }
            let index = self.calls.len() - 1;
            self.push_event(Event::ToolCallEnd { index });
        }
        self.seg_start = true;
        self.state = State::Text;
    }

    fn param_schema(&self, param: &str) -> Option<&Value> {
        let call = self.calls.last()?;
        let tool = &self.tools[call.tool?];
        tool.parameters.get("properties")?.get(param)
    }

    fn param_kind(&self, param: &str) -> Kind {
        let bits = self
            .param_schema(param)
            .map(|s| schema_types(s, 0))
            .unwrap_or(0);
        if bits == 0 || bits & T_STR != 0 {
            Kind::Str
        } else {
            Kind::Typed(bits)
        }
    }

    /// May `<parameter=name>` close the current value whose `</parameter>` is missing?
    fn is_expected_param(&self, name: &str) -> bool {
        let Some(call) = self.calls.last() else {
            return false;
        };
        if call.seen.iter().any(|s| s == name) {
            return false;
        }
        let props = call
            .tool
            .and_then(|i| self.tools[i].parameters.get("properties"))
            .and_then(Value::as_object);
        match props {
            Some(p) if !p.is_empty() => p.contains_key(name),
            _ => true,
        }
    }

    // ----- JSON (gated so that a long JSON body is not re-parsed at every piece) --------------

    fn json_at(&self, start: usize, eof: bool) -> M<(Value, usize)> {
        if !eof {
            if let Some(l) = self.json_gate.get() {
                if l <= self.buf.len() && !self.buf[l..].contains('}') {
                    return M::More;
                }
            }
        }
        let r = first_json(&self.buf[start..]);
        if r == M::More {
            self.json_gate.set(Some(self.buf.len()));
        }
        r
    }

    // ----- outer text -------------------------------------------------------------------------

    fn step_text(&mut self, eof: bool) -> bool {
        let i = self.buf.find('<').unwrap_or(self.buf.len());
        if i > 0 {
            let s = self.take(i);
            self.emit_text(&s);
            return true;
        }
        match self.match_outer(eof) {
            M::More if !eof => false,
            M::More | M::No => {
                self.drain(1);
                self.emit_text("<");
                true
            }
            M::Yes(act) => {
                match act {
                    OuterAct::Drop(n) => {
                        self.drain(n);
                        self.seg_start = true;
                    }
                    OuterAct::OpenThink(n) => {
                        self.drain(n);
                        self.mode = Mode::Reasoning;
                        self.seg_start = true;
                    }
                    OuterAct::CloseThink(n) => {
                        self.drain(n);
                        self.mode = Mode::Content;
                        self.seg_start = true;
                    }
                    OuterAct::Call { len, name } => {
                        self.drain(len);
                        self.start_call(name);
                    }
                    OuterAct::JsonCall { len, name, args } => {
                        self.drain(len);
                        self.start_call(name);
                        self.emit_args(&args);
                        if let Some(c) = self.calls.last_mut() {
                            c.args_done = true;
                        }
                        self.end_call();
                    }
                }
                true
            }
        }
    }

    fn match_outer(&self, eof: bool) -> M<OuterAct> {
        let s = self.buf.as_str();
        let mut more = false;
        let mut check = |m: M<usize>, f: &dyn Fn(usize) -> OuterAct| -> Option<OuterAct> {
            match m {
                M::Yes(n) => Some(f(n)),
                M::More => {
                    more = true;
                    None
                }
                M::No => None,
            }
        };
        match self.mode {
            Mode::Reasoning => {
                if let Some(a) = check(tag(s, THINK_CLOSE), &OuterAct::CloseThink) {
                    return M::Yes(a);
                }
                if !self.reasoning.any {
                    if let Some(a) = check(tag(s, THINK_OPEN), &OuterAct::Drop) {
                        return M::Yes(a);
                    }
                }
            }
            Mode::Content => {
                if !self.content.any {
                    if let Some(a) = check(tag(s, THINK_OPEN), &OuterAct::OpenThink) {
                        return M::Yes(a);
                    }
                    if let Some(a) = check(tag(s, THINK_CLOSE), &OuterAct::Drop) {
                        return M::Yes(a);
                    }
                }
            }
        }
        if !self.tools.is_empty() {
            match self.match_tool_call(eof) {
                M::Yes(a) => return M::Yes(a),
                M::More => more = true,
                M::No => {}
            }
            match self.match_bare_function(eof) {
                M::Yes(a) => return M::Yes(a),
                M::More => more = true,
                M::No => {}
            }
        }
        if more {
            M::More
        } else {
            M::No
        }
    }

    /// `<tool_call>` ws* (`<function=NAME>` | `{json}` [ws* `</tool_call>`]).
    fn match_tool_call(&self, eof: bool) -> M<OuterAct> {
        let s = self.buf.as_str();
        let n = match tag(s, TC_OPEN) {
            M::Yes(n) => n,
            M::No => return M::No,
            M::More => return M::More,
        };
        let p = n + ws_len(&s[n..]);
        let r = &s[p..];
        if r.is_empty() {
            return M::More;
        }
        if r.starts_with('{') {
            let (v, used) = match self.json_at(p, eof) {
                M::Yes(x) => x,
                M::No => return M::No,
                M::More => return M::More,
            };
            let Some(obj) = v.as_object() else {
                return M::No;
            };
            let Some(name) = obj.get("name").and_then(Value::as_str).map(str::trim) else {
                return M::No;
            };
            if name.is_empty() {
                return M::No;
            }
            let Some(args) = json_args_text(obj.get("arguments").or_else(|| obj.get("parameters")))
            else {
                return M::No;
            };
            let mut len = p + used;
            let q = &s[len..];
            let w = ws_len(q);
            match tag(&q[w..], TC_CLOSE) {
                M::Yes(m) => len += w + m,
                M::More if !eof => return M::More,
                _ => {}
            }
            return M::Yes(OuterAct::JsonCall {
                len,
                name: name.to_string(),
                args,
            });
        }
        match tag(r, FN_OPEN) {
            M::Yes(m) => match name_after(&r[m..]) {
                M::Yes((name, k)) => M::Yes(OuterAct::Call {
                    len: p + m + k,
                    name,
                }),
                M::No => M::No,
                M::More => M::More,
            },
            M::No => M::No,
            M::More => M::More,
        }
    }

    /// `<function=KNOWN_TOOL>` ws* (`<parameter=` | `</function>` | `{`), without `<tool_call>`.
    fn match_bare_function(&self, _eof: bool) -> M<OuterAct> {
        let s = self.buf.as_str();
        let m = match tag(s, FN_OPEN) {
            M::Yes(m) => m,
            M::No => return M::No,
            M::More => return M::More,
        };
        let (name, k) = match name_after(&s[m..]) {
            M::Yes(x) => x,
            M::No => return M::No,
            M::More => return M::More,
        };
        if self.tool_index(&name).is_none() {
            return M::No;
        }
        let rest = &s[m + k..];
        let r = &rest[ws_len(rest)..];
        if r.is_empty() {
            return M::More;
        }
        let mut more = false;
        for t in [P_OPEN, FN_CLOSE, "{"] {
            match tag(r, t) {
                M::Yes(_) => return M::Yes(OuterAct::Call { len: m + k, name }),
                M::More => more = true,
                M::No => {}
            }
        }
        if more {
            M::More
        } else {
            M::No
        }
    }

    // ----- inside <function=…> ----------------------------------------------------------------

    fn step_function(&mut self, stray: bool, eof: bool) -> bool {
        let w = ws_len(&self.buf);
        if w > 0 {
            let s = self.take(w);
            if stray {
                self.emit_text(&s);
            }
            return true;
        }
        let act = match self.match_function(stray, eof) {
            M::Yes(a) => a,
            M::More => return false,
            // match_function answers Yes or More; keep a safe fallback anyway.
            M::No => FnAct::Stray(self.buf.chars().next().map_or(0, char::len_utf8)),
        };
        match act {
            FnAct::Param { len, name } => {
                self.drain(len);
                let kind = self.param_kind(&name);
                let first = match self.calls.last_mut() {
                    Some(c) => {
                        c.n_params += 1;
                        c.seen.push(name.clone());
                        c.n_params == 1
                    }
                    None => true,
                };
                let mut frag = String::from(if first { "{" } else { "," });
                frag.push_str(&json_string(&name));
                frag.push(':');
                if kind == Kind::Str {
                    frag.push('"');
                }
                self.emit_args(&frag);
                self.state = State::Param(ParamSt {
                    kind,
                    at_start: true,
                    held_nl: false,
                    nonempty: false,
                    raw: String::new(),
                });
            }
            FnAct::CloseFunction(n) => {
                self.drain(n);
                self.state = State::AfterFunction;
            }
            FnAct::EndCall(n) => {
                self.drain(n);
                self.end_call();
            }
            FnAct::NewCall { len, name } => {
                self.drain(len);
                self.end_call();
                self.start_call(name);
            }
            FnAct::Drop(n) => {
                self.drain(n);
                self.state = State::Function { stray: false };
            }
            FnAct::JsonBody { len, args } => {
                self.drain(len);
                self.emit_args(&args);
                if let Some(c) = self.calls.last_mut() {
                    c.args_done = true;
                }
                self.state = State::Function { stray: false };
            }
            FnAct::Stray(n) => {
                let s = self.take(n);
                self.emit_text(&s);
                self.state = State::Function { stray: true };
            }
        }
        true
    }

    fn match_function(&self, stray: bool, eof: bool) -> M<FnAct> {
        let s = self.buf.as_str();
        let (args_done, n_params) = self
            .calls
            .last()
            .map(|c| (c.args_done, c.n_params))
            .unwrap_or((true, 0));
        let mut more = false;
        if !args_done {
            match tag(s, P_OPEN) {
                M::Yes(m) => match name_after(&s[m..]) {
                    M::Yes((name, k)) => return M::Yes(FnAct::Param { len: m + k, name }),
                    M::More => more = true,
                    M::No => {}
                },
                M::More => more = true,
                M::No => {}
            }
        }
        match tag(s, FN_CLOSE) {
            M::Yes(n) => return M::Yes(FnAct::CloseFunction(n)),
            M::More => more = true,
            M::No => {}
        }
        match tag(s, TC_CLOSE) {
            M::Yes(n) => return M::Yes(FnAct::EndCall(n)),
            M::More => more = true,
            M::No => {}
        }
        for t in [TC_OPEN, THINK_CLOSE] {
            match tag(s, t) {
                M::Yes(_) => return M::Yes(FnAct::EndCall(0)),
                M::More => more = true,
                M::No => {}
            }
        }
        match tag(s, FN_OPEN) {
            M::Yes(m) => match name_after(&s[m..]) {
                M::Yes((name, k)) => return M::Yes(FnAct::NewCall { len: m + k, name }),
                M::More => more = true,
                M::No => {}
            },
            M::More => more = true,
            M::No => {}
        }
        match tag(s, P_CLOSE) {
            M::Yes(n) => return M::Yes(FnAct::Drop(n)),
            M::More => more = true,
            M::No => {}
        }
        if s.starts_with('{') && !stray && !args_done && n_params == 0 {
            match self.json_at(0, eof) {
                M::Yes((v @ Value::Object(_), used)) => {
                    return M::Yes(FnAct::JsonBody {
                        len: used,
                        args: v.to_string(),
                    })
                }
                M::More => more = true,
                _ => {}
            }
        }
        if more {
            if !eof {
                return M::More;
            }
            // Truncated closing tag at the very end: markup, dropped.
            if s.len() >= 2 && CLOSERS.iter().any(|c| c.starts_with(s)) {
                return M::Yes(FnAct::Drop(s.len()));
            }
        }
        // Not markup: text up to the next '<' goes to the outer channel.
        let n = if s.starts_with('<') {
            1
        } else {
            s.find('<').unwrap_or(s.len())
        };
        M::Yes(FnAct::Stray(n))
    }

    fn step_after_function(&mut self, eof: bool) -> bool {
        let w = ws_len(&self.buf);
        if w > 0 {
            self.drain(w);
            return true;
        }
        let s = self.buf.as_str();
        match tag(s, TC_CLOSE) {
            M::Yes(n) => {
                self.drain(n);
                self.end_call();
                return true;
            }
            M::More if !eof => return false,
            M::More if s.len() >= 2 => {
                let n = s.len();
                self.drain(n);
                self.end_call();
                return true;
            }
            _ => {}
        }
        match tag(s, FN_OPEN) {
            M::Yes(m) => match name_after(&s[m..]) {
                M::Yes((name, k)) => {
                    self.drain(m + k);
                    self.end_call();
                    self.start_call(name);
                    return true;
                }
                M::More if !eof => return false,
                _ => {}
            },
            M::More if !eof => return false,
            _ => {}
        }
        // `</tool_call>` missing: the call ends here, the text is outer text again.
        self.end_call();
        true
    }

    // ----- inside <parameter=…> ---------------------------------------------------------------

    fn param(&mut self) -> &mut ParamSt {
        match &mut self.state {
            State::Param(p) => p,
            _ => unreachable!("not in a parameter"),
        }
    }

    fn step_param(&mut self, eof: bool) -> bool {
        if self.param().at_start {
            if self.buf.starts_with('\n') {
                self.drain(1);
            } else if self.buf.starts_with("\r\n") {
                self.drain(2);
            } else if self.buf == "\r" && !eof {
                return false;
            }
            self.param().at_start = false;
            return true;
        }
        let i = self.buf.find('<').unwrap_or(self.buf.len());
        if i > 0 {
            let t = self.take(i);
            self.value_push(&t);
            return true;
        }
        match self.match_param_end(eof) {
            M::More if !eof => false,
            M::More | M::No => {
                self.drain(1);
                self.value_push("<");
                true
            }
            M::Yes(end) => {
                self.finalize_param();
                match end {
                    ParamEnd::CloseParam(n) => {
                        self.drain(n);
                        self.state = State::Function { stray: false };
                    }
                    ParamEnd::CloseFunction(n) => {
                        self.drain(n);
                        self.state = State::AfterFunction;
                    }
                    ParamEnd::CloseCall(n) => {
                        self.drain(n);
                        self.end_call();
                    }
                    ParamEnd::NextParam => self.state = State::Function { stray: false },
                }
                true
            }
        }
    }

    fn match_param_end(&self, eof: bool) -> M<ParamEnd> {
        let s = self.buf.as_str();
        let mut more = false;
        let closers: [Closer; 3] = [
            (P_CLOSE, AFTER_PARAM, ParamEnd::CloseParam),
            (FN_CLOSE, AFTER_FUNC, ParamEnd::CloseFunction),
            (TC_CLOSE, AFTER_TC, ParamEnd::CloseCall),
        ];
        for (t, after, f) in closers {
            match tag(s, t) {
                M::Yes(n) => match followed_by(&s[n..], after, eof) {
                    M::Yes(()) => return M::Yes(f(n)),
                    M::More => more = true,
                    M::No => {}
                },
                M::More => more = true,
                M::No => {}
            }
        }
        let (nonempty, held_nl) = match &self.state {
            State::Param(p) => (p.nonempty, p.held_nl),
            _ => (true, false),
        };
        if !nonempty || held_nl {
            match tag(s, P_OPEN) {
                M::Yes(m) => match name_after(&s[m..]) {
                    M::Yes((name, _)) if self.is_expected_param(&name) => {
                        return M::Yes(ParamEnd::NextParam)
                    }
                    M::More => more = true,
                    _ => {}
                },
                M::More => more = true,
                M::No => {}
            }
        }
        if more {
            M::More
        } else {
            M::No
        }
    }

    /// Value text; one trailing `\n` is held back until it is known not to be the last.
    fn value_push(&mut self, t: &str) {
        if t.is_empty() {
            return;
        }
        let p = self.param();
        let (body, nl) = match t.strip_suffix('\n') {
            Some(b) => (b, true),
            None => (t, false),
        };
        let mut out = String::new();
        if p.held_nl {
            out.push('\n');
        }
        out.push_str(body);
        p.held_nl = nl;
        p.nonempty = true;
        if out.is_empty() {
            return;
        }
        match p.kind {
            Kind::Str => {
                let frag = json_escape_inner(&out);
                self.emit_args(&frag);
            }
            Kind::Typed(_) => p.raw.push_str(&out),
        }
    }

    fn finalize_param(&mut self) {
        let p = self.param();
        match p.kind {
            Kind::Str => self.emit_args("\""),
            Kind::Typed(bits) => {
                let raw = std::mem::take(&mut p.raw);
                let v = coerce_typed(bits, &raw, 0).unwrap_or_else(|| json_string(&raw));
                self.emit_args(&v);
            }
        }
    }
}

//! Structured outputs on the HTTP API: reads what a request constrains — OpenAI's `response_format`
//! (`text`, `json_object`, `json_schema`), vLLM's `structured_outputs` (`json`, `regex`, `choice`,
//! `grammar` in Lark, `json_object`, `disable_any_whitespace`; the older `guided_*` fields too),
//! and the tool calls (`tool_choice` "required" or named, tools marked `strict`,
//! `parallel_tool_calls`) — and compiles it once per request into the `lily_grammar::Constraint`
//! the engine applies to every token. A schema, grammar or regex that does not compile is a 400
//! naming the field and saying what is wrong.
//!
//! When the grammar starts: with thinking on, an answer's grammar waits for the model's own
//! `</think>` (the reasoning is free). A forced tool call (required or named) keeps lily's prompt
//! prefix (the reasoning closed, `<tool_call>\n<function=` written) and the grammar constrains the
//! rest of the call. "auto" with strict tools waits for the model's own `<tool_call>`.

use std::sync::{Arc, OnceLock};

use lily_grammar::{CallStart, CallTool, Constraint, Format, GrammarError, Grammars, Plan, ToolCalls, Whitespace};
use lily_parser::ToolSpec;
use lily_tokenizer::Tokenizer;
use serde_json::{Map, Value};

use crate::error::ApiError;
use crate::request::ToolChoice;

/// The model's grammar factory, made on first use (the vocabulary's token trie takes a second or two
/// to build, which a server that never sees a constrained request need not pay).
pub struct GrammarCell {
    tokenizer: Arc<Tokenizer>,
    stop_ids: Vec<u32>,
    cell: OnceLock<Result<Grammars, GrammarError>>,
}

impl GrammarCell {
    pub fn new(tokenizer: Arc<Tokenizer>, stop_ids: Vec<u32>) -> Self {
        GrammarCell { tokenizer, stop_ids, cell: OnceLock::new() }
    }

    /// The factory (built now if this is the first call; concurrent callers wait for it).
    pub fn get(&self) -> Result<&Grammars, ApiError> {
        self.cell
            .get_or_init(|| Grammars::new(Arc::clone(&self.tokenizer), &self.stop_ids))
            .as_ref()
            .map_err(|e| ApiError::internal(e.to_string()))
    }

    /// Builds the factory on a background thread now, so the first constrained request does not wait.
    pub fn warm_in_background(self: &Arc<Self>) {
        let me = Arc::clone(self);
        let _ = std::thread::Builder::new().name("lily-grammar-setup".into()).spawn(move || {
            let _ = me.get();
        });
    }
}

/// The answer's form a request asks for, and the field that asked.
#[derive(Clone, Debug)]
pub struct Answer {
    pub format: Format,
    pub param: String,
}

fn bool_field(m: &Map<String, Value>, key: &str, param: &str) -> Result<bool, ApiError> {
    match m.get(key) {
        None | Some(Value::Null) => Ok(false),
        Some(Value::Bool(b)) => Ok(*b),
        Some(v) => Err(ApiError::invalid(format!("{param}.{key}"), format!("`{key}` must be a boolean, got {v}"))),
    }
}

fn string_field(v: &Value, param: &str) -> Result<String, ApiError> {
    v.as_str().map(str::to_string).ok_or_else(|| ApiError::invalid(param, format!("`{param}` must be a string, got {v}")))
}

/// A schema given as an object (or `true`), or as a string holding one (vLLM takes both).
fn schema_field(v: &Value, param: &str) -> Result<Value, ApiError> {
    match v {
        Value::Object(_) | Value::Bool(_) => Ok(v.clone()),
        Value::String(s) => serde_json::from_str(s).map_err(|e| ApiError::invalid(param, format!("`{param}` is not valid JSON: {e}"))),
        _ => Err(ApiError::invalid(param, format!("`{param}` must be a JSON schema object"))),
    }
}

fn choices_field(v: &Value, param: &str) -> Result<Vec<String>, ApiError> {
    let err = || ApiError::invalid(param, format!("`{param}` must be a non-empty list of strings"));
    let a = v.as_array().filter(|a| !a.is_empty()).ok_or_else(err)?;
    a.iter().map(|c| c.as_str().map(str::to_string).ok_or_else(err)).collect()
}

/// `response_format` (OpenAI).
fn response_format(rf: &Value) -> Result<Option<Answer>, ApiError> {
    let p = "response_format";
    let Some(o) = rf.as_object() else {
        return Err(ApiError::invalid(p, "`response_format` must be an object"));
    };
    match o.get("type").and_then(Value::as_str) {
        None | Some("text") => Ok(None),
        Some("json_object") => Ok(Some(Answer { format: Format::JsonObject { whitespace: Whitespace::Bounded }, param: p.into() })),
        Some("json_schema") => {
            let Some(js) = o.get("json_schema").and_then(Value::as_object) else {
                return Err(ApiError::invalid("response_format.json_schema", "`json_schema` (an object with `name` and `schema`) is required"));
            };
            let param = "response_format.json_schema.schema";
            let schema = match js.get("schema") {
                None | Some(Value::Null) => Value::Bool(true),
                Some(s) => schema_field(s, param)?,
            };
            let strict = bool_field(js, "strict", "response_format.json_schema")?;
            Ok(Some(Answer { format: Format::JsonSchema { schema, strict, whitespace: Whitespace::Bounded }, param: param.into() }))
        }
        Some(t) => Err(ApiError::invalid(p, format!("unknown response_format type `{t}` (text, json_object or json_schema)"))),
    }
}

/// `structured_outputs` (vLLM): exactly one of `json`, `regex`, `choice`, `grammar`, `json_object`.
fn structured_outputs(so: &Value, param: &str) -> Result<Option<Answer>, ApiError> {
    let Some(o) = so.as_object() else {
        return Err(ApiError::invalid(param, format!("`{param}` must be an object")));
    };
    let whitespace = if bool_field(o, "disable_any_whitespace", param)? { Whitespace::None } else { Whitespace::Bounded };
    let kinds: Vec<&str> =
        ["json", "regex", "choice", "grammar", "json_object"].into_iter().filter(|k| o.get(*k).is_some_and(|v| !v.is_null())).collect();
    let kind = match kinds.as_slice() {
        [] => return Ok(None),
        [one] => *one,
        _ => {
            return Err(ApiError::invalid(param, format!("give one kind of constraint, not several ({})", kinds.join(", "))));
        }
    };
    let field = format!("{param}.{kind}");
    let v = &o[kind];
    let format = match kind {
        "json" => Format::JsonSchema { schema: schema_field(v, &field)?, strict: true, whitespace },
        "regex" => Format::Regex(string_field(v, &field)?),
        "choice" => Format::Choice(choices_field(v, &field)?),
        "grammar" => Format::Lark(string_field(v, &field)?),
        _ => {
            if !bool_field(o, "json_object", param)? {
                return Ok(None);
            }
            Format::JsonObject { whitespace }
        }
    };
    Ok(Some(Answer { format, param: field }))
}

/// The older vLLM fields (`guided_json`, `guided_regex`, `guided_choice`, `guided_grammar`), as a
/// `structured_outputs` object.
fn guided_fields(m: &Map<String, Value>) -> Option<Value> {
    let mut so = Map::new();
    for (old, new) in [("guided_json", "json"), ("guided_regex", "regex"), ("guided_choice", "choice"), ("guided_grammar", "grammar")] {
        if let Some(v) = m.get(old).filter(|v| !v.is_null()) {
            so.insert(new.into(), v.clone());
        }
    }
    if so.is_empty() {
        return None;
    }
    Some(Value::Object(so))
}

/// The answer's form the request body asks for (`response_format`, `structured_outputs`, or the
/// older `guided_*` fields; at most one of them).
pub fn parse_answer(body: &Value) -> Result<Option<Answer>, ApiError> {
    let Some(m) = body.as_object() else { return Ok(None) };
    let mut found: Vec<Answer> = Vec::new();
    if let Some(rf) = m.get("response_format").filter(|v| !v.is_null()) {
        found.extend(response_format(rf)?);
    }
    if let Some(so) = m.get("structured_outputs").filter(|v| !v.is_null()) {
        found.extend(structured_outputs(so, "structured_outputs")?);
    }
    if let Some(g) = guided_fields(m) {
        found.extend(structured_outputs(&g, "guided")?);
    }
    if found.len() > 1 {
        return Err(ApiError::invalid(
            found[1].param.clone(),
            format!("the request constrains its answer twice (`{}` and `{}`): give one", found[0].param, found[1].param),
        ));
    }
    Ok(found.pop())
}

/// The tool a forced call is to, when it is certain before generation: a named `tool_choice`, or
/// "required" with only one tool. The prompt then ends with `<tool_call>\n<function=NAME>\n`.
pub fn forced_call_name<'a>(choice: &'a ToolChoice, tools: &'a [ToolSpec]) -> Option<&'a str> {
    match choice {
        ToolChoice::Named(n) => Some(n.as_str()),
        ToolChoice::Required if tools.len() == 1 => Some(tools[0].name.as_str()),
        _ => None,
    }
}

/// A tool as the output parser should see it: top-level `$ref` properties resolved, so that it
/// types their values as the grammar wrote them.
pub fn parser_tool(t: &ToolSpec) -> ToolSpec {
    ToolSpec { name: t.name.clone(), parameters: lily_grammar::resolve_property_refs(&t.parameters) }
}

/// Whether `tools[i]` is marked `"strict": true` (in `function`, or on a bare function object).
fn strict_flags(body: &Value, n: usize) -> Vec<bool> {
    let tools = body.get("tools").and_then(Value::as_array);
    (0..n)
        .map(|i| {
            let t = tools.and_then(|a| a.get(i));
            let f = t.and_then(|t| t.get("function")).or(t);
            f.and_then(|f| f.get("strict")).and_then(Value::as_bool).unwrap_or(false)
        })
        .collect()
}

/// What a chat request constrains, if anything. `tools` are those left in the prompt (none for
/// `tool_choice: none`); `thinking`: the prompt leaves the model reasoning.
pub fn chat_plan(body: &Value, choice: &ToolChoice, tools: &[ToolSpec], thinking: bool) -> Result<Option<(Plan, Option<String>)>, ApiError> {
    let answer = parse_answer(body)?;
    let parallel = match body.get("parallel_tool_calls") {
        None | Some(Value::Null) => true,
        Some(Value::Bool(b)) => *b,
        Some(v) => return Err(ApiError::invalid("parallel_tool_calls", format!("`parallel_tool_calls` must be a boolean, got {v}"))),
    };
    let strict = strict_flags(body, tools.len());
    let call_tools = |typed_all: bool| -> Vec<CallTool> {
        tools.iter().zip(&strict).map(|(t, &s)| CallTool { spec: t.clone(), typed: typed_all || s }).collect()
    };
    let param = answer.as_ref().map(|a| a.param.clone());
    let plan = match choice {
        // A forced call: the prompt already opened it (and closed the reasoning).
        ToolChoice::Required | ToolChoice::Named(_) if !tools.is_empty() => {
            let start = match forced_call_name(choice, tools) {
                Some(n) => CallStart::Body(n.to_string()),
                None => CallStart::Name,
            };
            let parallel = parallel && matches!(choice, ToolChoice::Required);
            Plan { calls: Some(ToolCalls { tools: call_tools(true), start, parallel }), ..Default::default() }
        }
        _ if !tools.is_empty() && (answer.is_some() || strict.iter().any(|&s| s)) => {
            let calls = Some(ToolCalls { tools: call_tools(false), start: CallStart::Open, parallel });
            match answer {
                // The answer or a call, after the reasoning (or a call from inside it).
                Some(a) => Plan { answer: Some(a.format), calls, after_reasoning: thinking, at_tool_call: thinking },
                // Free text, and the model's own calls constrained.
                None => Plan { calls, at_tool_call: true, ..Default::default() },
            }
        }
        _ => match answer {
            Some(a) => Plan { answer: Some(a.format), after_reasoning: thinking, ..Default::default() },
            None => return Ok(None),
        },
    };
    Ok(Some((plan, param)))
}

/// Compiles `plan`; a failure is a 400 naming the answer's field, or the tool whose schema failed.
pub fn compile(cell: &GrammarCell, plan: &Plan, answer_param: Option<&str>) -> Result<Constraint, ApiError> {
    let grammars = cell.get()?;
    let invalid = |param: &str, e: GrammarError| match e {
        GrammarError::Invalid(msg) => ApiError::invalid(param, format!("`{param}` cannot be used for constrained decoding: {msg}")),
        other => ApiError::internal(other.to_string()),
    };
    // The answer alone first, so that its errors name its field.
    if let (Some(answer), Some(_)) = (&plan.answer, &plan.calls) {
        let alone = Plan { answer: Some(answer.clone()), ..Default::default() };
        grammars.compile(&alone).map_err(|e| invalid(answer_param.unwrap_or("response_format"), e))?;
    }
    grammars.compile(plan).map_err(|e| {
        if plan.calls.is_none() {
            return invalid(answer_param.unwrap_or("response_format"), e);
        }
        // Find the tool whose schema does not compile.
        let calls = plan.calls.as_ref().expect("checked");
        for (i, t) in calls.tools.iter().enumerate().filter(|(_, t)| t.typed) {
            let one = Plan {
                calls: Some(ToolCalls { tools: vec![t.clone()], start: CallStart::Open, parallel: false }),
                ..Default::default()
            };
            if let Err(e) = grammars.compile(&one) {
                return invalid(&format!("tools[{i}].function.parameters"), e);
            }
        }
        invalid("tools", e)
    })
}

//! Tool calls in Qwen's own XML format, as a Lark grammar (llguidance's dialect): the format the
//! model was trained on and that the chat template writes,
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
//! with calls after the first one separated by `\n`. `<tool_call>` and `</tool_call>` are the
//! tokenizer's own tokens (named by id); everything else is text. A tool whose arguments are typed
//! (a forced tool choice, or `strict: true`) gets its parameters in the order of its schema, the
//! required ones present, each value valid for its schema *as `lily-parser` reads it*: a parameter
//! whose schema admits a string is raw text (its `enum`/`const`, `pattern` and length bounds are
//! kept; markup tags cannot appear in it, so the parser cannot mistake where it ends), any other is
//! compact JSON constrained by the parameter's schema. An untyped tool's body is free text up to
//! `</function>`.

use lily_parser::ToolSpec;
use serde_json::{json, Map, Value};

use crate::format::lark_string;
use crate::GrammarError;

/// One tool the grammar can call.
#[derive(Clone, Debug, PartialEq)]
pub struct CallTool {
    pub spec: ToolSpec,
    /// The arguments follow the tool's schema (a forced tool choice, or `strict: true`); otherwise
    /// the body is free text.
    pub typed: bool,
}

/// Where the grammar starts in the first call.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum CallStart {
    /// At `<tool_call>`: the model writes the whole call.
    Open,
    /// The prompt already ends with `<tool_call>\n<function=`: the grammar starts at the name.
    Name,
    /// The prompt already ends with `<tool_call>\n<function=NAME>\n`: the grammar starts at that
    /// tool's parameters, and there is exactly one call.
    Body(String),
}

/// The tool calls a grammar writes.
#[derive(Clone, Debug, PartialEq)]
pub struct ToolCalls {
    pub tools: Vec<CallTool>,
    pub start: CallStart,
    /// More than one call may follow (`parallel_tool_calls`).
    pub parallel: bool,
}

/// The token ids the grammar names.
pub(crate) struct Ids {
    pub tool_call: u32,
    pub tool_call_end: u32,
}

/// Text that cannot hold markup the parser would take for the end of a value or a call.
const SAFE: &str = r"SAFE: /(?s:.*)/ & ~/(?s:.*)(<parameter=|<\/parameter>|<function=|<\/function>|<tool_call>|<\/tool_call>)(?s:.*)/";
/// A free function body: anything up to `</function>`, which ends the terminal (the `\n` after it is
/// a terminal of its own: with the `\n` inside, llguidance's forced-token computation panicked at
/// the end of the body, before the `</tool_call>` token, and failed the request).
const FREE_BODY: &str = r"FREE_BODY: (/(?s:.*)/ & ~/(?s:.*)(<\/function>|<tool_call>|<\/tool_call>)(?s:.*)/) ";

/// The grammar's rules; its entry is the rule `calls`.
pub(crate) fn lark(calls: &ToolCalls, ids: &Ids) -> Result<String, GrammarError> {
    if calls.tools.is_empty() {
        return Err(GrammarError::Invalid("no tools to call".into()));
    }
    let mut g = String::new();
    g.push_str(SAFE);
    g.push('\n');
    g.push_str(FREE_BODY);
    g.push_str(&lark_string("</function>"));
    g.push('\n');
    let first = match &calls.start {
        CallStart::Open => "call".to_string(),
        CallStart::Name => "fn".to_string(),
        CallStart::Body(name) => {
            let i = calls
                .tools
                .iter()
                .position(|t| &t.spec.name == name)
                .ok_or_else(|| GrammarError::Invalid(format!("no tool named `{name}`")))?;
            format!("body_{i}")
        }
    };
    let more = calls.parallel && !matches!(calls.start, CallStart::Body(_));
    if more {
        g.push_str(&format!("calls: {first} (\"\\n\" call)*\n"));
    } else {
        g.push_str(&format!("calls: {first}\n"));
    }
    g.push_str(&format!("call: <[{}]> {} fn\n", ids.tool_call, lark_string("\n<function=")));
    let fns: Vec<String> = (0..calls.tools.len()).map(|i| format!("fn_{i}")).collect();
    g.push_str(&format!("fn: {}\n", fns.join(" | ")));
    for (i, tool) in calls.tools.iter().enumerate() {
        g.push_str(&format!("fn_{i}: {} body_{i}\n", lark_string(&format!("{}>\n", tool.spec.name))));
        let end = format!("<[{}]>", ids.tool_call_end);
        if !tool.typed {
            g.push_str(&format!("body_{i}: FREE_BODY {} {end}\n", lark_string("\n")));
            continue;
        }
        let params = parameters(&tool.spec.parameters).map_err(|e| GrammarError::Invalid(format!("tool `{}`: {e}", tool.spec.name)))?;
        let mut items = Vec::new();
        for (j, p) in params.iter().enumerate() {
            let rule = format!("p_{i}_{j}");
            let open = lark_string(&format!("<parameter={}>\n", p.name));
            let close = lark_string("\n</parameter>\n");
            match &p.value {
                Value_::Text(expr) => {
                    let term = format!("V_{i}_{j}");
                    match expr {
                        Some(e) => g.push_str(&format!("{term}: (SAFE & {e}) {close}\n")),
                        None => g.push_str(&format!("{term}: SAFE {close}\n")),
                    }
                    g.push_str(&format!("{rule}: {open} {term}\n"));
                }
                Value_::Json(schema) => g.push_str(&format!("{rule}: {open} %json {schema} {close}\n")),
            }
            items.push(if p.required { rule } else { format!("{rule}?") });
        }
        items.push(lark_string("</function>\n"));
        items.push(end);
        g.push_str(&format!("body_{i}: {}\n", items.join(" ")));
    }
    Ok(g)
}

/// One parameter's grammar.
struct Param {
    name: String,
    required: bool,
    value: Value_,
}

enum Value_ {
    /// Raw text matching this Lark terminal expression (`None`: any text).
    Text(Option<String>),
    /// Compact JSON for this schema.
    Json(Value),
}

// The parser's reading of a parameter's schema (raw text or JSON), which the grammar must share.
use lily_parser::{schema_types, T_STR};

/// The parameters of an arguments schema, in its order.
fn parameters(schema: &Value) -> Result<Vec<Param>, String> {
    let schema = resolve_property_refs(schema);
    let props = match schema.get("properties") {
        None | Some(Value::Null) => return Ok(Vec::new()),
        Some(Value::Object(p)) => p,
        Some(_) => return Err("`parameters.properties` is not an object".into()),
    };
    let required: Vec<&str> = schema.get("required").and_then(Value::as_array).map(|a| a.iter().filter_map(Value::as_str).collect()).unwrap_or_default();
    if let Some(missing) = required.iter().find(|r| !props.contains_key(**r)) {
        return Err(format!("required parameter `{missing}` is not in `properties`"));
    }
    let defs: Map<String, Value> = ["$defs", "definitions"]
        .iter()
        .filter_map(|k| schema.get(*k).map(|v| ((*k).to_string(), v.clone())))
        .collect();
    let mut out = Vec::new();
    for (name, p) in props {
        let bits = schema_types(p, 0);
        let value = if bits == 0 || bits & T_STR != 0 {
            Value_::Text(text_expr(p, 0)?)
        } else {
            let mut s = match p {
                Value::Object(m) => m.clone(),
                _ => return Err(format!("the schema of parameter `{name}` is not an object")),
            };
            for (k, v) in &defs {
                s.entry(k.clone()).or_insert_with(|| v.clone());
            }
            s.insert("x-guidance".into(), json!({"whitespace_flexible": false, "lenient": false}));
            Value_::Json(Value::Object(s))
        };
        out.push(Param { name: name.clone(), required: required.contains(&name.as_str()), value });
    }
    Ok(out)
}

/// The Lark terminal expression a raw-text value must match, from the string side of its schema
/// (`None`: any text).
fn text_expr(s: &Value, depth: usize) -> Result<Option<String>, String> {
    if depth > 8 {
        return Ok(None);
    }
    let own_type = schema_types(&json!({"type": s.get("type").cloned().unwrap_or(Value::Null)}), 0);
    // anyOf / oneOf without a type of their own: any of the branches that admit a string.
    if own_type == 0 {
        for key in ["anyOf", "oneOf"] {
            if let Some(Value::Array(branches)) = s.get(key) {
                let mut alts = Vec::new();
                for b in branches {
                    let t = schema_types(b, depth + 1);
                    if t != 0 && t & T_STR == 0 {
                        continue;
                    }
                    match text_expr(b, depth + 1)? {
                        Some(e) => alts.push(e),
                        None => return Ok(None), // a free branch: any text
                    }
                }
                return Ok(match alts.len() {
                    0 => None,
                    1 => alts.pop(),
                    _ => Some(format!("({})", alts.join(" | "))),
                });
            }
        }
    }
    let mut parts = Vec::new();
    let literal = |v: &Value| v.as_str().map(|s| llguidance::regex_to_lark(&regex_syntax::escape(s), ""));
    if let Some(Value::Array(vs)) = s.get("enum") {
        let alts: Vec<String> = vs.iter().filter_map(literal).collect();
        if alts.is_empty() {
            return Err("an `enum` without string values for a text parameter".into());
        }
        parts.push(format!("/(?:{})/", alts.join("|")));
    }
    if let Some(c) = s.get("const") {
        match literal(c) {
            Some(rx) => parts.push(format!("/{rx}/")),
            None => return Err(format!("`const` {c} is not a string")),
        }
    }
    if let Some(p) = s.get("pattern") {
        let p = p.as_str().ok_or("`pattern` is not a string")?;
        regex_syntax::Parser::new().parse(p).map_err(|e| format!("`pattern` {p:?} is not a valid regular expression: {e}"))?;
        parts.push(format!("/(?:{})/", llguidance::regex_to_lark(anchorless(p), "dw")));
    }
    let len = |k: &str| s.get(k).and_then(Value::as_u64);
    match (len("minLength"), len("maxLength")) {
        (None, None) => {}
        (a, b) => {
            let a = a.unwrap_or(0);
            if let Some(b) = b.filter(|&b| b < a) {
                return Err(format!("`maxLength` {b} is below `minLength` {a}"));
            }
            parts.push(match b {
                Some(b) => format!("/(?s:.){{{a},{b}}}/"),
                None => format!("/(?s:.){{{a},}}/"),
            });
        }
    }
    Ok(match parts.len() {
        0 => None,
        1 => parts.pop(),
        _ => Some(format!("({})", parts.join(" & "))),
    })
}

/// A JSON Schema `pattern` matches anywhere in the text; a value is matched as a whole, so a
/// leading `^` and trailing `$` are dropped (and a pattern without them still has to match all).
fn anchorless(p: &str) -> &str {
    let p = p.strip_prefix('^').unwrap_or(p);
    match p.strip_suffix('$') {
        Some(q) if !q.ends_with('\\') => q,
        _ => p,
    }
}

/// `schema` with each top-level property that is a local `$ref` (`#/$defs/X`, `#/definitions/X`)
/// replaced by what it refers to (its sibling keywords kept), so that a reader of the properties
/// (the grammar, `lily-parser`'s typing) sees their types. Nested references stay, and resolve
/// against the `$defs` a property's grammar carries.
pub fn resolve_property_refs(schema: &Value) -> Value {
    let mut out = schema.clone();
    let Some(Value::Object(props)) = out.get_mut("properties") else {
        return out;
    };
    for p in props.values_mut() {
        let mut seen = 0;
        while let Some(target) = p.get("$ref").and_then(Value::as_str).and_then(|r| lookup(schema, r)) {
            seen += 1;
            if seen > 8 {
                break;
            }
            let mut merged = target.as_object().cloned().unwrap_or_default();
            if let Value::Object(m) = p {
                for (k, v) in m.iter().filter(|(k, _)| k.as_str() != "$ref") {
                    merged.insert(k.clone(), v.clone());
                }
            }
            *p = Value::Object(merged);
        }
    }
    out
}

fn lookup<'a>(root: &'a Value, reference: &str) -> Option<&'a Value> {
    let path = reference.strip_prefix("#/")?;
    let mut v = root;
    for seg in path.split('/') {
        let seg = seg.replace("~1", "/").replace("~0", "~");
        v = v.get(seg.as_str())?;
    }
    Some(v)
}

//! The shape of a chat request's `messages` and `tools`, checked field by field before anything is
//! rendered: roles, content (a string, or text parts), names, tool calls and their arguments, tool
//! call ids, reasoning; each tool's name, description and JSON-schema parameters (walked, so that
//! a `type` of 5 deep inside a schema is a 400 naming that spot, not silently ignored). Unknown
//! keys are accepted and ignored, as OpenAI's API does.

use serde_json::{Map, Value};

use crate::error::ApiError;
use crate::fields::{get, opt_bool, opt_str, wrong};

pub const ROLES: [&str; 5] = ["system", "developer", "user", "assistant", "tool"];

/// Content part types that carry media: lily serves the text model.
const MEDIA_PARTS: [&str; 8] = ["image_url", "image", "input_image", "video", "video_url", "input_audio", "audio", "file"];

/// How deep a tool's JSON schema may nest.
const MAX_SCHEMA_DEPTH: usize = 32;

pub fn check_messages(messages: &[Value]) -> Result<(), ApiError> {
    for (i, msg) in messages.iter().enumerate() {
        let at = format!("messages[{i}]");
        let Some(m) = msg.as_object() else {
            return Err(wrong(&at, "a message object", msg));
        };
        let role = match m.get("role") {
            Some(Value::String(r)) if ROLES.contains(&r.as_str()) => r.as_str(),
            Some(Value::String(r)) => {
                return Err(ApiError::invalid(format!("{at}.role"), format!("unknown role `{r}` (expected one of {})", ROLES.join(", "))))
            }
            None | Some(Value::Null) => return Err(ApiError::invalid(format!("{at}.role"), "each message needs a string `role`")),
            Some(v) => return Err(wrong(&format!("{at}.role"), "a string", v)),
        };
        match get(m, "content") {
            None if role == "assistant" => {}
            None => return Err(ApiError::invalid(format!("{at}.content"), format!("a `{role}` message needs `content`"))),
            Some(Value::String(_)) => {}
            Some(Value::Array(parts)) => check_parts(parts, &format!("{at}.content"))?,
            Some(v) => return Err(wrong(&format!("{at}.content"), "a string or a list of content parts", v)),
        }
        opt_str(m, "name", &format!("{at}.name"))?;
        for key in ["reasoning_content", "reasoning", "thinking"] {
            opt_str(m, key, &format!("{at}.{key}"))?;
        }
        opt_str(m, "tool_call_id", &format!("{at}.tool_call_id"))?;
        if let Some(calls) = get(m, "tool_calls") {
            let at = format!("{at}.tool_calls");
            if role != "assistant" {
                return Err(ApiError::invalid(at, format!("only assistant messages carry `tool_calls`, not `{role}` ones")));
            }
            let Value::Array(calls) = calls else { return Err(wrong(&at, "an array of tool calls", calls)) };
            for (j, call) in calls.iter().enumerate() {
                check_tool_call(call, &format!("{at}[{j}]"))?;
            }
        }
    }
    Ok(())
}

fn check_parts(parts: &[Value], at: &str) -> Result<(), ApiError> {
    for (j, part) in parts.iter().enumerate() {
        let at = format!("{at}[{j}]");
        let Some(p) = part.as_object() else { return Err(wrong(&at, "a content part object", part)) };
        match p.get("type") {
            Some(Value::String(t)) if t == "text" => match p.get("text") {
                Some(Value::String(_)) => {}
                Some(v) => return Err(wrong(&format!("{at}.text"), "a string", v)),
                None => return Err(ApiError::invalid(format!("{at}.text"), "a text part needs `text`")),
            },
            Some(Value::String(t)) if MEDIA_PARTS.contains(&t.as_str()) => {
                return Err(ApiError::invalid(format!("{at}.type"), format!("content parts of type `{t}` are not supported: lily serves the text model")))
            }
            Some(Value::String(t)) => return Err(ApiError::invalid(format!("{at}.type"), format!("unknown content part type `{t}` (expected `text`)"))),
            Some(v) => return Err(wrong(&format!("{at}.type"), "a string", v)),
            None => return Err(ApiError::invalid(format!("{at}.type"), "each content part needs a `type`")),
        }
    }
    Ok(())
}

fn check_tool_call(call: &Value, at: &str) -> Result<(), ApiError> {
    let Some(c) = call.as_object() else { return Err(wrong(at, "a tool call object", call)) };
    opt_str(c, "id", &format!("{at}.id"))?;
    if let Some(t) = opt_str(c, "type", &format!("{at}.type"))? {
        if t != "function" {
            return Err(ApiError::invalid(format!("{at}.type"), format!("unknown tool call type `{t}` (expected `function`)")));
        }
    }
    let f = match c.get("function") {
        Some(Value::Object(f)) => f,
        None | Some(Value::Null) => return Err(ApiError::invalid(format!("{at}.function"), "a tool call needs a `function` object")),
        Some(v) => return Err(wrong(&format!("{at}.function"), "an object", v)),
    };
    check_name(f, &format!("{at}.function.name"))?;
    match get(f, "arguments") {
        None | Some(Value::String(_)) | Some(Value::Object(_)) => Ok(()),
        Some(v) => Err(wrong(&format!("{at}.function.arguments"), "a string (JSON text) or an object", v)),
    }
}

fn check_name(f: &Map<String, Value>, at: &str) -> Result<(), ApiError> {
    match f.get("name") {
        Some(Value::String(n)) if !n.is_empty() => Ok(()),
        Some(Value::String(_)) => Err(ApiError::invalid(at, "the name must not be empty")),
        None | Some(Value::Null) => Err(ApiError::invalid(at, "a name is required")),
        Some(v) => Err(wrong(at, "a string", v)),
    }
}

/// One `tools[i]` entry: `{"type": "function", "function": {"name", "description", "parameters",
/// "strict"}}` (a bare function object is accepted too).
pub fn check_tool(tool: &Value, at: &str) -> Result<(), ApiError> {
    let Some(t) = tool.as_object() else { return Err(wrong(at, "a tool object", tool)) };
    if let Some(ty) = opt_str(t, "type", &format!("{at}.type"))? {
        if ty != "function" {
            return Err(ApiError::invalid(format!("{at}.type"), format!("unknown tool type `{ty}` (lily calls functions)")));
        }
    }
    let (f, fat) = match t.get("function") {
        Some(Value::Object(f)) => (f, format!("{at}.function")),
        // A bare function object ({"name", "parameters"}), as some clients send.
        None | Some(Value::Null) if t.contains_key("name") => (t, at.to_string()),
        None | Some(Value::Null) => return Err(ApiError::invalid(format!("{at}.function"), "a tool needs a `function` object")),
        Some(v) => return Err(wrong(&format!("{at}.function"), "an object", v)),
    };
    check_name(f, &format!("{fat}.name"))?;
    opt_str(f, "description", &format!("{fat}.description"))?;
    opt_bool(f, "strict", &format!("{fat}.strict"))?;
    if let Some(p) = get(f, "parameters") {
        let at = format!("{fat}.parameters");
        if !p.is_object() {
            return Err(wrong(&at, "a JSON schema object", p));
        }
        check_schema(p, &at, 0)?;
    }
    Ok(())
}

/// `tool_choice`: "auto", "none", "required", or `{"type": "function", "function": {"name"}}`.
pub fn check_tool_choice(v: &Value) -> Result<(), ApiError> {
    match v {
        Value::Null | Value::String(_) => Ok(()),
        Value::Object(o) => {
            if let Some(t) = opt_str(o, "type", "tool_choice.type")? {
                if t != "function" {
                    return Err(ApiError::invalid("tool_choice.type", format!("unknown tool_choice type `{t}` (expected `function`)")));
                }
            }
            match o.get("function") {
                Some(Value::Object(f)) => check_name(f, "tool_choice.function.name"),
                None | Some(Value::Null) => Err(ApiError::invalid("tool_choice", "a named tool_choice needs `function.name`")),
                Some(v) => Err(wrong("tool_choice.function", "an object", v)),
            }
        }
        v => Err(wrong("tool_choice", "\"auto\", \"none\", \"required\" or a named function object", v)),
    }
}

fn key_path(at: &str, key: &str) -> String {
    if !key.is_empty() && key.chars().all(|c| c.is_ascii_alphanumeric() || c == '_' || c == '-' || c == '$') {
        format!("{at}.{key}")
    } else {
        format!("{at}[{}]", Value::String(key.to_string()))
    }
}

/// A JSON schema (or a subschema): an object or a boolean, whose keywords have their types.
fn check_schema(s: &Value, at: &str, depth: usize) -> Result<(), ApiError> {
    if depth > MAX_SCHEMA_DEPTH {
        return Err(ApiError::invalid(at, format!("the schema nests deeper than {MAX_SCHEMA_DEPTH} levels")));
    }
    let o = match s {
        Value::Bool(_) => return Ok(()),
        Value::Object(o) => o,
        v => return Err(wrong(at, "a JSON schema (an object or a boolean)", v)),
    };
    let sub = |v: &Value, p: String| check_schema(v, &p, depth + 1);
    for (k, v) in o {
        let p = key_path(at, k);
        match k.as_str() {
            "type" => match v {
                Value::String(_) => {}
                Value::Array(a) if a.iter().all(Value::is_string) => {}
                v => return Err(wrong(&p, "a type name or a list of type names", v)),
            },
            "properties" | "patternProperties" | "$defs" | "definitions" | "dependentSchemas" => {
                let Value::Object(props) = v else { return Err(wrong(&p, "an object of schemas", v)) };
                for (name, schema) in props {
                    sub(schema, key_path(&p, name))?;
                }
            }
            "items" => match v {
                Value::Array(a) => {
                    for (i, x) in a.iter().enumerate() {
                        sub(x, format!("{p}[{i}]"))?;
                    }
                }
                v => sub(v, p)?,
            },
            "prefixItems" | "anyOf" | "oneOf" | "allOf" => {
                let Value::Array(a) = v else { return Err(wrong(&p, "a list of schemas", v)) };
                for (i, x) in a.iter().enumerate() {
                    sub(x, format!("{p}[{i}]"))?;
                }
            }
            "additionalProperties" | "additionalItems" | "unevaluatedProperties" | "unevaluatedItems" | "not" | "contains"
            | "propertyNames" | "if" | "then" | "else" => sub(v, p)?,
            "required" => match v {
                Value::Array(a) if a.iter().all(Value::is_string) => {}
                v => return Err(wrong(&p, "a list of property names", v)),
            },
            "enum" if !v.is_array() => return Err(wrong(&p, "a list of values", v)),
            "description" | "title" | "$ref" | "pattern" | "format" | "$schema" | "$id" | "$comment" if !v.is_string() => {
                return Err(wrong(&p, "a string", v))
            }
            "minimum" | "maximum" | "exclusiveMinimum" | "exclusiveMaximum" | "multipleOf" if !v.is_number() => {
                return Err(wrong(&p, "a number", v))
            }
            "minLength" | "maxLength" | "minItems" | "maxItems" | "minProperties" | "maxProperties" | "minContains" | "maxContains"
                if v.as_u64().is_none() =>
            {
                return Err(wrong(&p, "a non-negative integer", v))
            }
            "uniqueItems" | "nullable" | "deprecated" | "readOnly" | "writeOnly" if !v.is_boolean() => return Err(wrong(&p, "a boolean", v)),
            _ => {}
        }
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;

    fn param(r: Result<(), ApiError>) -> String {
        r.unwrap_err().param.unwrap()
    }

    #[test]
    fn good_messages_pass() {
        check_messages(&[
            json!({"role": "system", "content": "s"}),
            json!({"role": "user", "content": [{"type": "text", "text": "a"}], "name": "bob"}),
            json!({"role": "assistant", "content": null, "reasoning_content": "r",
                "tool_calls": [{"id": "c1", "type": "function", "function": {"name": "f", "arguments": "{\"a\": 1}"}},
                               {"function": {"name": "g", "arguments": {"b": 2}}}]}),
            json!({"role": "tool", "tool_call_id": "c1", "content": "42", "refusal": null, "whatever": [1]}),
        ])
        .unwrap();
    }

    #[test]
    fn wrong_types_inside_messages_name_the_spot() {
        let one = |m: Value| param(check_messages(&[json!({"role": "user", "content": "hi"}), m]));
        assert_eq!(one(json!({"role": "user", "content": "x", "name": 5})), "messages[1].name");
        assert_eq!(one(json!({"role": "user"})), "messages[1].content");
        assert_eq!(one(json!({"role": 3, "content": "x"})), "messages[1].role");
        assert_eq!(one(json!({"role": "user", "content": [{"type": "text", "text": 1}]})), "messages[1].content[0].text");
        assert_eq!(one(json!({"role": "user", "content": [{"type": "image_url", "image_url": {"url": "x"}}]})), "messages[1].content[0].type");
        assert_eq!(one(json!({"role": "user", "content": ["text"]})), "messages[1].content[0]");
        assert_eq!(one(json!({"role": "assistant", "tool_calls": {"a": 1}})), "messages[1].tool_calls");
        assert_eq!(one(json!({"role": "assistant", "tool_calls": [{"function": {"name": 1}}]})), "messages[1].tool_calls[0].function.name");
        assert_eq!(one(json!({"role": "assistant", "tool_calls": [{"function": {"name": "f", "arguments": 5}}]})), "messages[1].tool_calls[0].function.arguments");
        assert_eq!(one(json!({"role": "assistant", "tool_calls": [{"type": "web", "function": {"name": "f"}}]})), "messages[1].tool_calls[0].type");
        assert_eq!(one(json!({"role": "assistant", "tool_calls": [{"id": 7, "function": {"name": "f"}}]})), "messages[1].tool_calls[0].id");
        assert_eq!(one(json!({"role": "user", "content": "x", "tool_calls": []})), "messages[1].tool_calls");
        assert_eq!(one(json!({"role": "tool", "content": "x", "tool_call_id": ["a"]})), "messages[1].tool_call_id");
        assert_eq!(one(json!({"role": "assistant", "content": "x", "reasoning_content": {"a": 1}})), "messages[1].reasoning_content");
    }

    #[test]
    fn tools_and_their_schemas_are_checked_all_the_way_down() {
        let t = |params: Value| check_tool(&json!({"type": "function", "function": {"name": "f", "parameters": params}}), "tools[0]");
        t(json!({"type": "object", "properties": {"a": {"type": ["string", "null"], "enum": ["x"]}, "b": {"type": "array", "items": {"type": "integer", "minimum": 0}}},
            "required": ["a"], "additionalProperties": false}))
        .unwrap();
        assert_eq!(param(t(json!({"type": "object", "properties": {"city": {"type": 5}}}))), "tools[0].function.parameters.properties.city.type");
        assert_eq!(param(t(json!({"type": "object", "required": "city"}))), "tools[0].function.parameters.required");
        assert_eq!(param(t(json!({"properties": {"a b": {"items": {"anyOf": [{"type": "string"}, 3]}}}}))), "tools[0].function.parameters.properties[\"a b\"].items.anyOf[1]");
        assert_eq!(param(t(json!("object"))), "tools[0].function.parameters");
        let mut deep = json!({"type": "string"});
        for _ in 0..40 {
            deep = json!({"type": "array", "items": deep});
        }
        assert!(t(deep).is_err());
        assert_eq!(param(check_tool(&json!({"type": "function", "function": {"name": "f", "description": 1}}), "tools[3]")), "tools[3].function.description");
        assert_eq!(param(check_tool(&json!({"type": "retrieval", "function": {"name": "f"}}), "tools[0]")), "tools[0].type");
        assert_eq!(param(check_tool(&json!({"type": "function", "function": "f"}), "tools[0]")), "tools[0].function");
        assert_eq!(param(check_tool(&json!({"type": "function", "function": {"name": ""}}), "tools[0]")), "tools[0].function.name");
    }

    #[test]
    fn tool_choice_shapes() {
        check_tool_choice(&json!("auto")).unwrap();
        check_tool_choice(&json!({"type": "function", "function": {"name": "f"}})).unwrap();
        assert_eq!(param(check_tool_choice(&json!({"type": "function", "function": {"name": 3}}))), "tool_choice.function.name");
        assert_eq!(param(check_tool_choice(&json!({"type": "other", "function": {"name": "f"}}))), "tool_choice.type");
        assert_eq!(param(check_tool_choice(&json!(7))), "tool_choice");
    }
}

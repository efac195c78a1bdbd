//! What the three APIs (chat completions, Responses, Messages) share before the chat template:
//! system messages made into what the Qwen3.6 template accepts. The template takes one system
//! message, first, and raises "System message must be at the beginning." for any other; clients
//! send several (opencode), a `developer` one (OpenAI's newer name, Codex), or one in the middle of
//! a conversation (Claude Code's environment turn, reminders). So: the system and developer
//! messages at the start are joined (blank line between) into the one system message, and a later
//! one becomes a user turn in its place, its text unchanged: where the template allows it, and
//! without touching the prefix before it (a prefix cache keeps working when a client adds one).

use serde_json::{json, Value};

fn is_system(m: &Value) -> bool {
    matches!(m.get("role").and_then(Value::as_str), Some("system" | "developer"))
}

/// The text of a message's content: a string, or its text parts joined as the template joins them.
pub fn content_text(content: &Value) -> String {
    match content {
        Value::String(s) => s.clone(),
        Value::Array(parts) => parts.iter().filter_map(|p| p.get("text").and_then(Value::as_str)).collect(),
        _ => String::new(),
    }
}

/// The messages with their system messages as the template accepts them (see the module's doc).
/// A conversation that already has at most one system message, first, and no `developer` one comes
/// back unchanged.
pub fn normalize_system(messages: &[Value]) -> Vec<Value> {
    let lead = messages.iter().take_while(|m| is_system(m)).count();
    let plain = lead <= 1
        && messages.iter().skip(lead).all(|m| !is_system(m))
        && messages.iter().all(|m| m.get("role").and_then(Value::as_str) != Some("developer"));
    if plain {
        return messages.to_vec();
    }
    let mut out = Vec::with_capacity(messages.len());
    if lead > 0 {
        let texts: Vec<String> = messages[..lead].iter().map(|m| content_text(m.get("content").unwrap_or(&Value::Null))).collect();
        out.push(json!({"role": "system", "content": texts.join("\n\n")}));
    }
    for m in &messages[lead..] {
        if is_system(m) {
            out.push(json!({"role": "user", "content": content_text(m.get("content").unwrap_or(&Value::Null))}));
        } else {
            out.push(m.clone());
        }
    }
    out
}

/// An error about `tools[i].function…` of the chat request a translator built, renamed to the tool's
/// path in the request as sent (`paths[i]`), its schema being `schema_key` there
/// (`tools[2].parameters`, `tools[0].input_schema`, `tools[1].tools[0].parameters`).
pub fn rename_tool_param(e: crate::error::ApiError, paths: &[String], schema_key: &str) -> crate::error::ApiError {
    let Some(p) = e.param.clone() else { return e };
    let Some((i, rest)) = p.strip_prefix("tools[").and_then(|r| r.split_once(']')) else { return e };
    let Some(path) = i.parse::<usize>().ok().and_then(|i| paths.get(i)) else { return e };
    let rest = rest.strip_prefix(".function").unwrap_or(rest);
    let renamed = match rest.strip_prefix(".parameters") {
        Some(r) => format!("{path}.{schema_key}{r}"),
        None => format!("{path}{rest}"),
    };
    crate::error::ApiError { message: e.message.replace(&p, &renamed), param: Some(renamed), ..e }
}

#[cfg(test)]
mod tests {
    use super::*;
    use lily_template::ChatTemplate;

    fn render(messages: &[Value]) -> Result<String, lily_template::TemplateError> {
        ChatTemplate::builtin().render(messages, None, true, &Default::default())
    }

    #[test]
    fn one_leading_system_message_is_left_alone() {
        let m = vec![json!({"role": "system", "content": [{"type": "text", "text": "S"}]}), json!({"role": "user", "content": "hi"})];
        assert_eq!(normalize_system(&m), m);
        let m = vec![json!({"role": "user", "content": "hi"})];
        assert_eq!(normalize_system(&m), m);
    }

    #[test]
    fn several_and_late_system_messages_render() {
        let m = vec![
            json!({"role": "system", "content": "You are terse."}),
            json!({"role": "developer", "content": [{"type": "text", "text": "Use tools."}]}),
            json!({"role": "user", "content": "hi"}),
            json!({"role": "assistant", "content": "hello"}),
            json!({"role": "system", "content": "The date is Monday."}),
            json!({"role": "user", "content": "what day is it?"}),
        ];
        // The official template refuses them as sent (the developer role, and a late system message) ...
        let e = render(&m).unwrap_err();
        assert!(e.to_string().contains("Unexpected message role"), "{e}");
        let mut late = m.clone();
        late[1]["role"] = json!("user");
        let e = render(&late).unwrap_err();
        assert!(e.to_string().contains("System message must be at the beginning"), "{e}");
        // ... and renders them once normalised: the leading ones joined, the late one a user turn.
        let n = normalize_system(&m);
        let text = render(&n).unwrap();
        assert!(text.starts_with("<|im_start|>system\nYou are terse.\n\nUse tools.<|im_end|>\n<|im_start|>user\nhi<|im_end|>\n"), "{text}");
        assert!(text.contains("<|im_start|>user\nThe date is Monday.<|im_end|>\n<|im_start|>user\nwhat day is it?<|im_end|>"), "{text}");
        // A late system message leaves everything before it as it was (the prefix cache's point).
        let before = ChatTemplate::builtin().render(&normalize_system(&m[..3]), None, false, &Default::default()).unwrap();
        assert!(text.starts_with(&before), "{before}\n---\n{text}");
    }

    #[test]
    fn a_developer_message_alone_is_the_system_message() {
        let m = vec![json!({"role": "developer", "content": "D"}), json!({"role": "user", "content": "hi"})];
        let text = render(&normalize_system(&m)).unwrap();
        assert!(text.starts_with("<|im_start|>system\nD<|im_end|>\n<|im_start|>user\nhi"), "{text}");
    }
}

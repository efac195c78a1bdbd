//! Golden tests: every request in `tests/data/requests/` rendered with every test checkpoint in `tests/data/models/`
//! must give exactly the bytes transformers gives (`tests/data/expected/<model>/<request>.txt`, written by
//! `tools/template_reference.py`), or fail the way transformers fails (`<request>.error.json`): the same
//! `raise_exception` message, a rendering error, or a rejected request.

use std::fs;
use std::path::{Path, PathBuf};

use lily_template::{ChatTemplate, TemplateError, TemplateSource, QWEN3_6_TEMPLATE};
use serde_json::Value;

fn data() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR"))
        .join("tests")
        .join("data")
}

fn requests() -> Vec<(String, Value)> {
    let mut out: Vec<(String, Value)> = fs::read_dir(data().join("requests"))
        .unwrap()
        .map(|e| e.unwrap().path())
        .filter(|p| p.extension().is_some_and(|e| e == "json"))
        .map(|p| {
            let name = p.file_stem().unwrap().to_string_lossy().into_owned();
            let body = serde_json::from_str(&fs::read_to_string(&p).unwrap()).unwrap();
            (name, body)
        })
        .collect();
    out.sort_by(|a, b| a.0.cmp(&b.0));
    assert!(
        out.len() >= 20,
        "expected at least 20 golden requests, found {}",
        out.len()
    );
    out
}

/// Shows where two texts first differ.
fn first_difference(got: &str, want: &str) -> String {
    let at = got
        .bytes()
        .zip(want.bytes())
        .position(|(a, b)| a != b)
        .unwrap_or(got.len().min(want.len()));
    let ctx = |s: &str| {
        let mut start = at.saturating_sub(60);
        while !s.is_char_boundary(start) {
            start -= 1;
        }
        let mut end = (at + 60).min(s.len());
        while !s.is_char_boundary(end) {
            end += 1;
        }
        format!("{:?}", &s[start..end])
    };
    format!(
        "first difference at byte {at} (len got {}, want {}):\n  got:  {}\n  want: {}",
        got.len(),
        want.len(),
        ctx(got),
        ctx(want)
    )
}

fn check_model(model: &str, expect_source: TemplateSource) {
    let dir = data().join("models").join(model);
    let template = ChatTemplate::from_dir(&dir).unwrap_or_else(|e| panic!("{model}: {e}"));
    assert_eq!(template.source(), expect_source, "{model}");
    let expected_dir = data().join("expected").join(model);
    let mut failures = Vec::new();
    let mut checked = 0;
    for (name, body) in requests() {
        let txt = expected_dir.join(format!("{name}.txt"));
        let err = expected_dir.join(format!("{name}.error.json"));
        let got = template.render_request(&body);
        checked += 1;
        if txt.is_file() {
            let want = fs::read_to_string(&txt).unwrap();
            match got {
                Ok(got) if got == want => {}
                Ok(got) => {
                    failures.push(format!("{model}/{name}: {}", first_difference(&got, &want)))
                }
                Err(e) => failures.push(format!("{model}/{name}: expected text, got error {e:?}")),
            }
        } else {
            let want: Value = serde_json::from_str(&fs::read_to_string(&err).unwrap()).unwrap();
            let (kind, message) = (
                want["kind"].as_str().unwrap(),
                want["message"].as_str().unwrap(),
            );
            match (kind, &got) {
                ("raise_exception", Err(TemplateError::Raised(m))) if m == message => {}
                ("template", Err(TemplateError::Render(_))) => {}
                ("request", Err(TemplateError::InvalidRequest(_))) => {}
                _ => failures.push(format!(
                    "{model}/{name}: expected {kind} error {message:?}, got {got:?}"
                )),
            }
            if let Err(e) = &got {
                assert!(e.is_request_error());
            }
        }
    }
    assert!(
        failures.is_empty(),
        "{} of {checked} renders differ:\n{}",
        failures.len(),
        failures.join("\n")
    );
}

#[test]
fn builtin_template_matches_transformers() {
    check_model("builtin", TemplateSource::Builtin);
}

#[test]
fn qwen36_checkpoint_template_matches_transformers() {
    let dir = data().join("models").join("qwen36");
    check_model(
        "qwen36",
        TemplateSource::Checkpoint(dir.join("tokenizer_config.json")),
    );
    // The checkpoint's template is the built-in one.
    assert_eq!(
        ChatTemplate::from_dir(&dir).unwrap().text(),
        QWEN3_6_TEMPLATE
    );
}

#[test]
fn qwen35_chat_template_jinja_matches_transformers() {
    // chat_template.jinja wins over tokenizer_config.json's "chat_template", as in transformers.
    let dir = data().join("models").join("qwen35");
    check_model(
        "qwen35",
        TemplateSource::Checkpoint(dir.join("chat_template.jinja")),
    );
}

#[test]
fn variant_template_list_form_matches_transformers() {
    let dir = data().join("models").join("variant");
    check_model(
        "variant",
        TemplateSource::Checkpoint(dir.join("tokenizer_config.json")),
    );
    let t = ChatTemplate::from_dir(&dir).unwrap();
    assert_eq!(
        t.special_tokens()[0],
        ("bos_token".to_string(), "<|bos|>".to_string())
    );
}

#[test]
fn builtin_constructor_equals_builtin_dir() {
    let from_dir = ChatTemplate::from_dir(&data().join("models").join("builtin")).unwrap();
    let builtin = ChatTemplate::builtin();
    assert_eq!(builtin.source(), TemplateSource::Builtin);
    assert_eq!(builtin.special_tokens(), from_dir.special_tokens());
    for (name, body) in requests() {
        let a = from_dir.render_request(&body).map_err(|e| e.to_string());
        let b = builtin.render_request(&body).map_err(|e| e.to_string());
        assert_eq!(a, b, "{name}");
    }
}

#[test]
fn render_api_matches_render_request() {
    let t = ChatTemplate::builtin();
    let body: Value = serde_json::from_str(
        &fs::read_to_string(
            data()
                .join("requests")
                .join("14_tool_calls_object_args.json"),
        )
        .unwrap(),
    )
    .unwrap();
    let messages = body["messages"].as_array().unwrap();
    let tools = body["tools"].as_array().unwrap();
    let kwargs = body["chat_template_kwargs"].as_object().unwrap();
    let got = t.render(messages, Some(tools), true, kwargs).unwrap();
    let want = fs::read_to_string(
        data()
            .join("expected")
            .join("builtin")
            .join("14_tool_calls_object_args.txt"),
    )
    .unwrap();
    assert_eq!(got, want);
}

#[test]
fn missing_dir_and_bad_config() {
    let tmp = std::env::temp_dir().join(format!("lily-template-test-{}", std::process::id()));
    fs::create_dir_all(&tmp).unwrap();
    // No files at all: the built-in template, no special tokens.
    let t = ChatTemplate::from_dir(&tmp).unwrap();
    assert_eq!(t.source(), TemplateSource::Builtin);
    assert!(t.special_tokens().is_empty());
    // Unparsable config.
    fs::write(tmp.join("tokenizer_config.json"), "{not json").unwrap();
    assert!(matches!(
        ChatTemplate::from_dir(&tmp),
        Err(TemplateError::Config { .. })
    ));
    // A template with a syntax error.
    fs::write(
        tmp.join("tokenizer_config.json"),
        r#"{"chat_template": "{% if %}"}"#,
    )
    .unwrap();
    let err = ChatTemplate::from_dir(&tmp).unwrap_err();
    assert!(matches!(err, TemplateError::Syntax(_)), "{err:?}");
    assert!(!err.is_request_error());
    // A list without "default".
    fs::write(
        tmp.join("tokenizer_config.json"),
        r#"{"chat_template": [{"name": "rag", "template": "x"}]}"#,
    )
    .unwrap();
    assert!(matches!(
        ChatTemplate::from_dir(&tmp),
        Err(TemplateError::Config { .. })
    ));
    fs::remove_dir_all(&tmp).unwrap();
    // A directory that does not exist is an error, not a silent fallback to the built-in template.
    assert!(matches!(
        ChatTemplate::from_dir(&tmp),
        Err(TemplateError::Io { .. })
    ));
}

#[test]
fn long_conversation_renders_quickly() {
    let t = ChatTemplate::builtin();
    let mut messages = vec![serde_json::json!({"role": "system", "content": "sys"})];
    for i in 0..400 {
        messages.push(serde_json::json!({"role": "user", "content": format!("question {i} {}", "x".repeat(2000))}));
        messages.push(serde_json::json!({"role": "assistant", "content": "answer", "reasoning_content": "r",
            "tool_calls": [{"type": "function", "function": {"name": "f", "arguments": "{\"a\": [1, 2, {\"b\": null}]}"}}]}));
        messages.push(serde_json::json!({"role": "tool", "content": "result"}));
    }
    let body = serde_json::json!({"messages": messages});
    let start = std::time::Instant::now();
    let out = t.render_request(&body).unwrap();
    let elapsed = start.elapsed();
    assert!(out.len() > 800_000);
    assert!(
        elapsed.as_secs_f64() < 2.0,
        "rendering 1201 messages took {elapsed:?}"
    );
    eprintln!(
        "rendered {} messages ({} bytes) in {elapsed:?}",
        messages.len(),
        out.len()
    );
}

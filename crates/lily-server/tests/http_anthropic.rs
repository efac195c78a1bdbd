//! Anthropic's Messages API over real HTTP, with the scripted backend (a "model" that writes a known
//! answer: reasoning, content and a tool call): the whole message and every event of the stream in
//! order, the stream equal to the whole message, the same prompt and answer as chat completions
//! give, tool calls round-tripped through `tool_result`, stop reasons (`end_turn`, `tool_use`,
//! `max_tokens`, `stop_sequence`), `tool_choice`, thinking on and off, `count_tokens`, Claude Code's
//! per-request billing block kept out of the prompt (the prefix cache still hits; a changed block
//! that is not the billing one misses), its mid-conversation system turns, 30+ bad requests each
//! refused in Anthropic's error shape with the server healthy after them; and on the CPU backend a
//! 10-turn conversation whose turns, from the second, take the previous turns from the cache and
//! answer as a server without a cache does.

mod common;

use std::time::Duration;

use common::*;
use lily_template::ChatTemplate;
use serde_json::{json, Value};

const HEADERS: [(&str, &str); 2] = [("anthropic-version", "2023-06-01"), ("anthropic-beta", "interleaved-thinking-2025-05-14,claude-code-20250219")];

async fn scripted() -> Server {
    start_scripted(default_config(), Duration::ZERO).await.0
}

fn prompt_tokens(body: &Value) -> u64 {
    let text = ChatTemplate::builtin().render_request(body).unwrap();
    tokenizer().encode(&text).unwrap().len() as u64
}

fn weather_tool_a() -> Value {
    json!({"name": "get_weather", "description": "Weather of a city", "cache_control": {"type": "ephemeral"},
        "input_schema": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}})
}

fn weather_request() -> Value {
    json!({"model": "claude-sonnet-4-5", "max_tokens": 1024, "system": [{"type": "text", "text": "Be brief.", "cache_control": {"type": "ephemeral"}}],
        "messages": [{"role": "user", "content": "What's the weather in Paris?"}], "tools": [weather_tool_a()],
        "thinking": {"type": "enabled", "budget_tokens": 2000}, "metadata": {"user_id": "u"}, "some_future_field": 1})
}

fn weather_chat() -> Value {
    json!({"messages": [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "What's the weather in Paris?"}],
        "tools": [weather_tool()]})
}

async fn message(s: &Server, body: &Value) -> Value {
    let (status, v) = s.post_with("/v1/messages", &HEADERS, body).await;
    assert_eq!(status, 200, "{v}");
    assert_eq!(v["type"], "message", "{v}");
    v
}

/// Anthropic's error shape: `{"type": "error", "error": {"type": string, "message": non-empty}}`.
fn assert_anthropic_error(status: u16, v: &Value, want_status: u16, want_in_message: &str) {
    assert_eq!(status, want_status, "expected {want_status}, got {status}: {v}");
    assert_eq!(v["type"], "error", "{v}");
    let t = v["error"]["type"].as_str().unwrap_or_else(|| panic!("no error.type: {v}"));
    let want_type = match want_status {
        401 => "authentication_error",
        404 => "not_found_error",
        413 => "request_too_large",
        429 => "rate_limit_error",
        500 => "api_error",
        503 => "overloaded_error",
        _ => "invalid_request_error",
    };
    assert_eq!(t, want_type, "{v}");
    let m = v["error"]["message"].as_str().unwrap();
    assert!(!m.is_empty() && m.contains(want_in_message), "message {m:?} should name {want_in_message:?}");
    assert!(v.get("param").is_none() && v["error"].get("param").is_none(), "no OpenAI fields: {v}");
}

/// The usage's prompt: prefilled plus cached.
fn prompt_of(v: &Value) -> u64 {
    v["usage"]["input_tokens"].as_u64().unwrap() + v["usage"]["cache_read_input_tokens"].as_u64().unwrap()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_whole_message_is_what_chat_completions_answers() {
    let s = scripted().await;
    let m = message(&s, &weather_request()).await;
    assert!(m["id"].as_str().unwrap().starts_with("msg_"));
    assert_eq!(m["role"], "assistant");
    assert_eq!(m["model"], "claude-sonnet-4-5");
    assert_eq!(m["stop_reason"], "tool_use");
    assert_eq!(m["stop_sequence"], Value::Null);
    let c = m["content"].as_array().unwrap();
    let types: Vec<&str> = c.iter().map(|b| b["type"].as_str().unwrap()).collect();
    assert_eq!(types, ["thinking", "text", "tool_use"], "{m}");
    assert_eq!(c[0]["thinking"], "The user wants the weather.");
    assert!(c[0]["signature"].is_string());
    assert_eq!(c[1]["text"], "Let me check.");
    assert!(c[2]["id"].as_str().unwrap().starts_with("toolu_"));
    assert_eq!(c[2]["name"], "get_weather");
    assert_eq!(c[2]["input"], json!({"city": "Paris & <Lyon>"}));
    let u = &m["usage"];
    assert_eq!(u["cache_read_input_tokens"], 0);
    assert_eq!(u["cache_creation_input_tokens"], 0);
    assert_eq!(prompt_of(&m), prompt_tokens(&weather_chat()));
    let chat = s.chat(weather_chat()).await;
    let cm = &chat["choices"][0]["message"];
    assert_eq!(cm["reasoning_content"], c[0]["thinking"]);
    assert_eq!(cm["content"], c[1]["text"]);
    assert_eq!(serde_json::from_str::<Value>(cm["tool_calls"][0]["function"]["arguments"].as_str().unwrap()).unwrap(), c[2]["input"]);
    assert_eq!(chat["usage"]["completion_tokens"], u["output_tokens"]);
    // The chat request left its prompt in the cache: cached_tokens and cache_read_input_tokens agree.
    let again = message(&s, &weather_request()).await;
    assert!(again["usage"]["cache_read_input_tokens"].as_u64().unwrap() > 0);
    assert_eq!(prompt_of(&again), prompt_of(&m));
}

fn shape(events: &[(String, Value)]) -> Vec<String> {
    let mut out: Vec<String> = Vec::new();
    for (name, e) in events {
        let label = match name.as_str() {
            "content_block_start" => format!("start:{}", e["content_block"]["type"].as_str().unwrap()),
            "content_block_delta" => format!("delta:{}", e["delta"]["type"].as_str().unwrap()),
            n => n.to_string(),
        };
        if label.starts_with("delta:") && out.last() == Some(&label) {
            continue;
        }
        out.push(label);
    }
    out
}

/// A stream put together as the SDKs do: the message of `message_start`, blocks from their deltas.
fn accumulate(events: &[(String, Value)]) -> Value {
    let mut m = events[0].1["message"].clone();
    let mut partial = Vec::<String>::new();
    for (name, e) in events {
        match name.as_str() {
            "content_block_start" => {
                assert_eq!(e["index"].as_u64().unwrap() as usize, m["content"].as_array().unwrap().len());
                m["content"].as_array_mut().unwrap().push(e["content_block"].clone());
                partial.push(String::new());
            }
            "content_block_delta" => {
                let i = e["index"].as_u64().unwrap() as usize;
                let b = &mut m["content"][i];
                let d = &e["delta"];
                match d["type"].as_str().unwrap() {
                    "text_delta" => b["text"] = json!(b["text"].as_str().unwrap().to_string() + d["text"].as_str().unwrap()),
                    "thinking_delta" => b["thinking"] = json!(b["thinking"].as_str().unwrap().to_string() + d["thinking"].as_str().unwrap()),
                    "input_json_delta" => partial[i].push_str(d["partial_json"].as_str().unwrap()),
                    t => panic!("unknown delta {t}"),
                }
            }
            "content_block_stop" => {
                let i = e["index"].as_u64().unwrap() as usize;
                if m["content"][i]["type"] == "tool_use" {
                    m["content"][i]["input"] = serde_json::from_str(&partial[i]).unwrap();
                }
            }
            "message_delta" => {
                m["stop_reason"] = e["delta"]["stop_reason"].clone();
                m["stop_sequence"] = e["delta"]["stop_sequence"].clone();
                for (k, v) in e["usage"].as_object().unwrap() {
                    m["usage"][k] = v.clone();
                }
            }
            _ => {}
        }
    }
    m
}

fn comparable(m: &Value) -> Value {
    let mut m = m.clone();
    m.as_object_mut().unwrap().remove("id");
    m["usage"]["cache_read_input_tokens"] = json!(0);
    m["usage"]["input_tokens"] = json!(0);
    for b in m["content"].as_array_mut().unwrap() {
        if b["type"] == "tool_use" {
            b["id"] = json!("toolu");
        }
    }
    m
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_stream_is_the_documented_event_sequence_and_equals_the_whole_message() {
    let s = scripted().await;
    let whole = message(&s, &weather_request()).await;
    let mut body = weather_request();
    body["stream"] = json!(true);
    let events = s.stream_events("/v1/messages", &HEADERS, &body).await;
    let expected = [
        "message_start",
        "ping",
        "start:thinking",
        "delta:thinking_delta",
        "content_block_stop",
        "start:text",
        "delta:text_delta",
        "content_block_stop",
        "start:tool_use",
        "delta:input_json_delta",
        "content_block_stop",
        "message_delta",
        "message_stop",
    ];
    assert_eq!(shape(&events), expected, "{events:#?}");
    let start = &events[0].1["message"];
    assert_eq!(start["content"], json!([]));
    assert_eq!(start["stop_reason"], Value::Null);
    assert!(start["usage"]["input_tokens"].as_u64().unwrap() + start["usage"]["cache_read_input_tokens"].as_u64().unwrap() > 0);
    let (_, delta) = &events[events.len() - 2];
    assert_eq!(delta["delta"]["stop_reason"], "tool_use");
    assert_eq!(delta["usage"]["output_tokens"], whole["usage"]["output_tokens"]);
    // The tool_use block starts with an empty input; its JSON comes in deltas.
    let tool_start = events.iter().find(|(n, e)| n == "content_block_start" && e["content_block"]["type"] == "tool_use").unwrap();
    assert_eq!(tool_start.1["content_block"]["input"], json!({}));
    assert_eq!(comparable(&accumulate(&events)), comparable(&whole));
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_tool_call_round_trips_through_tool_result() {
    let s = scripted().await;
    let first = message(&s, &weather_request()).await;
    let tool_use = first["content"][2].clone();
    let id = tool_use["id"].as_str().unwrap();
    let mut body = weather_request();
    body["messages"].as_array_mut().unwrap().push(json!({"role": "assistant", "content": first["content"]}));
    body["messages"].as_array_mut().unwrap().push(json!({"role": "user", "content": [
        {"type": "tool_result", "tool_use_id": id, "content": [{"type": "text", "text": "{\"temp_c\": 21}"}]},
        {"type": "text", "text": "And tomorrow?"}]}));
    let second = message(&s, &body).await;
    let chat = json!({"messages": [
        {"role": "system", "content": "Be brief."},
        {"role": "user", "content": "What's the weather in Paris?"},
        {"role": "assistant", "content": "Let me check.", "reasoning_content": "The user wants the weather.",
            "tool_calls": [{"id": id, "type": "function", "function": {"name": "get_weather", "arguments": tool_use["input"].to_string()}}]},
        {"role": "tool", "tool_call_id": id, "content": "{\"temp_c\": 21}"},
        {"role": "user", "content": "And tomorrow?"}],
        "tools": [weather_tool()]});
    assert_eq!(prompt_of(&second), prompt_tokens(&chat));
    let text = ChatTemplate::builtin().render_request(&chat).unwrap();
    assert!(text.contains("<tool_response>\n{\"temp_c\": 21}\n</tool_response><|im_end|>\n<|im_start|>user\nAnd tomorrow?"), "{text}");
    // The first turn's prompt came from the cache.
    let cached = second["usage"]["cache_read_input_tokens"].as_u64().unwrap();
    assert!(cached >= prompt_of(&first) - 8, "cached {cached} of {}", prompt_of(&first));
    // An error result is marked as one.
    let mut body2 = body.clone();
    body2["messages"][2]["content"][0]["is_error"] = json!(true);
    let third = message(&s, &body2).await;
    assert!(prompt_of(&third) > prompt_of(&second));
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn stop_reasons_and_thinking() {
    let s = scripted().await;
    let hi = |extra: Value| {
        let mut b = json!({"model": "m", "max_tokens": 100, "messages": [{"role": "user", "content": "Say hello."}]});
        for (k, v) in extra.as_object().unwrap() {
            b[k] = v.clone();
        }
        b
    };
    // Thinking is off unless asked for (Anthropic's default).
    let m = message(&s, &hi(json!({}))).await;
    assert_eq!(m["stop_reason"], "end_turn");
    assert_eq!(m["content"], json!([{"type": "text", "text": "Hello there! Ünïcödé 🌷 works."}]));
    assert_eq!(prompt_of(&m), prompt_tokens(&json!({"messages": user("Say hello."), "chat_template_kwargs": {"enable_thinking": false}})));
    let m = message(&s, &hi(json!({"thinking": {"type": "disabled"}}))).await;
    assert_eq!(m["content"].as_array().unwrap().len(), 1);
    let m = message(&s, &hi(json!({"thinking": {"type": "adaptive", "display": "omitted"}}))).await;
    assert_eq!(m["content"][0], json!({"type": "thinking", "thinking": "Just greet.", "signature": ""}));
    assert_eq!(prompt_of(&m), prompt_tokens(&json!({"messages": user("Say hello.")})));
    // A max_tokens beyond the context is cut to fit (clients send their model's largest).
    let m = message(&s, &hi(json!({"max_tokens": 1_000_000}))).await;
    assert_eq!(m["stop_reason"], "end_turn");
    let m = message(&s, &hi(json!({"max_tokens": 3}))).await;
    assert_eq!(m["stop_reason"], "max_tokens");
    assert_eq!(m["usage"]["output_tokens"], 3);
    let m = message(&s, &hi(json!({"stop_sequences": ["nothing", "Ünï"]}))).await;
    assert_eq!(m["stop_reason"], "stop_sequence");
    assert_eq!(m["stop_sequence"], "Ünï");
    assert_eq!(m["content"][0]["text"], "Hello there!");
    let events = s.stream_events("/v1/messages", &HEADERS, &hi(json!({"stop_sequences": ["there"], "stream": true}))).await;
    let (_, d) = &events[events.len() - 2];
    assert_eq!(d["delta"], json!({"stop_reason": "stop_sequence", "stop_sequence": "there"}));
    // Sampling fields are taken.
    let m = message(&s, &hi(json!({"temperature": 0.5, "top_p": 0.9, "top_k": 40}))).await;
    assert_eq!(m["stop_reason"], "end_turn");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn tool_choice_any_tool_and_none() {
    let s = scripted().await;
    let body = |choice: Value| {
        json!({"model": "m", "max_tokens": 200, "messages": [{"role": "user", "content": "Weather in Paris?"}],
            "tools": [weather_tool_a(), {"name": "get_time", "input_schema": {"type": "object", "properties": {"city": {"type": "string"}}}}], "tool_choice": choice})
    };
    for choice in [json!({"type": "any"}), json!({"type": "tool", "name": "get_weather"})] {
        let m = message(&s, &body(choice.clone())).await;
        assert_eq!(m["stop_reason"], "tool_use", "{choice}: {m}");
        let calls: Vec<&Value> = m["content"].as_array().unwrap().iter().filter(|b| b["type"] == "tool_use").collect();
        assert!(!calls.is_empty(), "{m}");
        assert!(calls[0]["input"].is_object());
    }
    let m = message(&s, &body(json!({"type": "tool", "name": "get_weather", "disable_parallel_tool_use": true}))).await;
    assert_eq!(m["content"].as_array().unwrap().iter().filter(|b| b["type"] == "tool_use").count(), 1);
    // none: the tools are left out of the prompt, and no call is parsed.
    let m = message(&s, &body(json!({"type": "none"}))).await;
    assert_eq!(m["stop_reason"], "end_turn");
    assert!(m["content"].as_array().unwrap().iter().all(|b| b["type"] != "tool_use"));
    assert_eq!(prompt_of(&m), prompt_tokens(&json!({"messages": user("Weather in Paris?"), "chat_template_kwargs": {"enable_thinking": false}})));
}

/// Claude Code's system prompt: the per-request billing block first, then the instructions.
fn claude_code_request(billing: &str, extra_system: Option<&str>) -> Value {
    let mut system = vec![
        json!({"type": "text", "text": billing}),
        json!({"type": "text", "text": "You are a Claude agent, built on Anthropic's Claude Agent SDK.", "cache_control": {"type": "ephemeral"}}),
        json!({"type": "text", "text": "You are an interactive CLI tool that helps users with software engineering tasks. ".repeat(20), "cache_control": {"type": "ephemeral"}}),
    ];
    if let Some(x) = extra_system {
        system.insert(0, json!({"type": "text", "text": x}));
    }
    json!({"model": "claude-opus-4-5", "max_tokens": 32000, "system": system, "stream": false,
        "messages": [
            {"role": "user", "content": [{"type": "text", "text": "<system-reminder>\nAs you answer, follow the rules.\n</system-reminder>\n"}, {"type": "text", "text": "Say hello."}]},
            // Claude Code's environment turn, in the middle of the conversation.
            {"role": "system", "content": [{"type": "text", "text": "# Environment\n - Primary working directory: /tmp"}]}],
        "tools": [weather_tool_a()], "thinking": {"type": "adaptive"}, "context_management": {"edits": [{"type": "clear_thinking_20251015", "keep": "all"}]},
        "output_config": {"effort": "medium"}, "metadata": {"user_id": "{\"device_id\":\"d\"}"}})
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn claude_codes_billing_block_does_not_defeat_the_prefix_cache() {
    let s = scripted().await;
    let a = message(&s, &claude_code_request("x-anthropic-billing-header: cc_version=2.1.37.3a3; cc_entrypoint=cli; cch=0f1e2;", None)).await;
    let b = message(&s, &claude_code_request("x-anthropic-billing-header: cc_version=2.1.37.9b7; cc_entrypoint=cli; cch=a7c41;", None)).await;
    // The same prompt, and the second found it in the cache, all of it but the generation prompt.
    assert_eq!(prompt_of(&a), prompt_of(&b));
    assert_eq!(a["usage"]["cache_read_input_tokens"], 0);
    let cached = b["usage"]["cache_read_input_tokens"].as_u64().unwrap();
    assert!(cached + 12 >= prompt_of(&b) && cached > 300, "cached {cached} of {}", prompt_of(&b));
    // count_tokens sees the same prompt, with or without the block.
    let (status, n) = s.post_with("/v1/messages/count_tokens", &HEADERS, &claude_code_request("x-anthropic-billing-header: cch=1;", None)).await;
    assert_eq!(status, 200, "{n}");
    assert_eq!(n["input_tokens"].as_u64().unwrap(), prompt_of(&a));
    // The control: a per-request block that is not the billing one does change the prompt's start,
    // and the cache misses (so the hit above is the billing block's removal, not luck).
    let c = message(&s, &claude_code_request("x-anthropic-billing-header: cch=2;", Some("request 1"))).await;
    let d = message(&s, &claude_code_request("x-anthropic-billing-header: cch=3;", Some("request 2"))).await;
    assert_eq!(prompt_of(&c), prompt_of(&d));
    assert!(d["usage"]["cache_read_input_tokens"].as_u64().unwrap() < 10, "{}", d["usage"]);
    // The mid-conversation system turn rendered as a user turn after the first one.
    let mut chat = json!({"messages": [
        {"role": "system", "content": format!("You are a Claude agent, built on Anthropic's Claude Agent SDK.\n\n{}", "You are an interactive CLI tool that helps users with software engineering tasks. ".repeat(20))},
        {"role": "user", "content": "<system-reminder>\nAs you answer, follow the rules.\n</system-reminder>\n\nSay hello."},
        {"role": "user", "content": "# Environment\n - Primary working directory: /tmp"}],
        "tools": [weather_tool()]});
    assert_eq!(prompt_of(&a), prompt_tokens(&chat));
    chat["messages"][1]["content"] = json!("changed");
    assert_ne!(prompt_of(&a), prompt_tokens(&chat), "the comparison can fail");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn count_tokens_counts_what_messages_would_prefill() {
    let s = scripted().await;
    let m = message(&s, &weather_request()).await;
    let mut body = weather_request();
    body.as_object_mut().unwrap().remove("max_tokens");
    let (status, n) = s.post_with("/v1/messages/count_tokens?beta=true", &HEADERS, &body).await;
    assert_eq!(status, 200, "{n}");
    assert_eq!(n, json!({"input_tokens": prompt_of(&m)}));
    let (status, v) = s.post_with("/v1/messages/count_tokens", &HEADERS, &json!({"model": "m"})).await;
    assert_anthropic_error(status, &v, 400, "messages");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn bad_requests_get_anthropic_errors_and_the_server_stays_healthy() {
    let mut cfg = default_config();
    cfg.api_key = Some("sekret".into());
    let (mut s, _) = start_scripted(cfg, Duration::ZERO).await;
    s.api_key = None;
    let key = [("x-api-key", "sekret"), HEADERS[0], HEADERS[1]];
    let ok = json!({"model": "m", "max_tokens": 10, "messages": [{"role": "user", "content": "hi"}]});
    let with = |k: &str, v: Value| {
        let mut b = ok.clone();
        b[k] = v;
        b
    };
    let cases: Vec<(Value, &str)> = vec![
        (json!([]), "JSON object"),
        (json!({"model": "m", "max_tokens": 10}), "messages"),
        (with("messages", json!([])), "messages"),
        (with("messages", json!("hi")), "messages"),
        (with("messages", json!([5])), "messages[0]"),
        (with("messages", json!([{"content": "hi"}])), "messages[0].role"),
        (with("messages", json!([{"role": "robot", "content": "hi"}])), "messages[0].role"),
        (with("messages", json!([{"role": "user"}])), "messages[0].content"),
        (with("messages", json!([{"role": "user", "content": 5}])), "messages[0].content"),
        (with("messages", json!([{"role": "user", "content": [{"text": "x"}]}])), "messages[0].content[0].type"),
        (with("messages", json!([{"role": "user", "content": [{"type": "text"}]}])), "messages[0].content[0].text"),
        (with("messages", json!([{"role": "user", "content": [{"type": "image", "source": {}}]}])), "messages[0].content[0].type"),
        (with("messages", json!([{"role": "user", "content": [{"type": "hologram"}]}])), "messages[0].content[0].type"),
        (with("messages", json!([{"role": "user", "content": [{"type": "tool_result", "content": "x"}]}])), "messages[0].content[0].tool_use_id"),
        (with("messages", json!([{"role": "user", "content": [{"type": "tool_result", "tool_use_id": "t", "content": 5}]}])), "messages[0].content[0].content"),
        (with("messages", json!([{"role": "user", "content": [{"type": "tool_use", "id": "t", "name": "f", "input": {}}]}])), "messages[0].content[0].type"),
        (with("messages", json!([{"role": "user", "content": "hi"}, {"role": "assistant", "content": [{"type": "tool_use", "name": "f", "input": {}}]}])), "messages[1].content[0].id"),
        (with("messages", json!([{"role": "user", "content": "hi"}, {"role": "assistant", "content": [{"type": "tool_use", "id": "t", "name": "f", "input": "x"}]}])), "messages[1].content[0].input"),
        (with("messages", json!([{"role": "user", "content": "hi"}, {"role": "assistant", "content": [{"type": "thinking"}]}])), "messages[1].content[0].thinking"),
        (with("messages", json!([{"role": "assistant", "content": "hi"}])), "No user query"),
        (with("max_tokens", json!(0)), "max_tokens"),
        (with("max_tokens", json!("ten")), "max_tokens"),
        (with("max_tokens", json!(-5)), "max_tokens"),
        (json!({"model": "m", "messages": [{"role": "user", "content": "hi"}]}), "max_tokens"),
        (with("system", json!(5)), "system"),
        (with("system", json!([{"type": "image"}])), "system[0].type"),
        (with("system", json!([{"type": "text"}])), "system[0].text"),
        (with("tools", json!({"name": "f"})), "tools"),
        (with("tools", json!([{"name": "f"}])), "tools[0].input_schema"),
        (with("tools", json!([{"input_schema": {"type": "object"}}])), "tools[0].name"),
        (with("tools", json!([{"name": "f", "input_schema": "x"}])), "tools[0].input_schema"),
        (with("tools", json!([{"name": "f", "input_schema": {"type": "object", "properties": {"a": {"type": 5}}}}])), "tools[0].input_schema.properties.a.type"),
        (with("tools", json!([{"type": "teleport_2030", "name": "f"}])), "tools[0].type"),
        (with("tool_choice", json!({"type": "any"})), "tool_choice"),
        (with("tool_choice", json!("auto")), "tool_choice"),
        (with("tool_choice", json!({"type": "sometimes"})), "tool_choice.type"),
        (json!({"model": "m", "max_tokens": 10, "messages": [{"role": "user", "content": "hi"}], "tools": [weather_tool_a()], "tool_choice": {"type": "tool", "name": "nope"}}), "nope"),
        (with("stop_sequences", json!("x")), "stop_sequences"),
        (with("stop_sequences", json!([1])), "stop_sequences[0]"),
        (with("stop_sequences", json!([""])), "stop_sequences"),
        (with("temperature", json!(1.5)), "temperature"),
        (with("temperature", json!("warm")), "temperature"),
        (with("top_p", json!(3)), "top_p"),
        (with("top_k", json!(-1)), "top_k"),
        (with("thinking", json!({"type": "maybe"})), "thinking.type"),
        (with("thinking", json!({"type": "enabled", "budget_tokens": "lots"})), "thinking.budget_tokens"),
        (with("thinking", json!(true)), "thinking"),
        (with("stream", json!("yes")), "stream"),
        (with("metadata", json!("x")), "metadata"),
        (with("model", json!(5)), "model"),
        (with("messages", json!([{"role": "user", "content": "x".repeat(200_000)}])), "messages"),
    ];
    assert!(cases.len() >= 30);
    for (body, needle) in &cases {
        let (status, v) = s.post_with("/v1/messages", &key, body).await;
        assert_anthropic_error(status, &v, 400, needle);
    }
    // Authentication, routing, the body itself: the same shape.
    let (status, v) = s.post_with("/v1/messages", &HEADERS, &ok).await;
    assert_anthropic_error(status, &v, 401, "API key");
    let (status, v) = s.post_with("/v1/messages", &[("x-api-key", "wrong")], &ok).await;
    assert_anthropic_error(status, &v, 401, "API key");
    let (status, v) = s.post_with("/v1/messages/nope", &key, &ok).await;
    assert_anthropic_error(status, &v, 404, "not found");
    let r = s.http.get(s.url("/v1/messages")).header("x-api-key", "sekret").send().await.unwrap();
    assert_eq!(r.status().as_u16(), 405);
    let v: Value = r.json().await.unwrap();
    assert_anthropic_error(405, &v, 405, "method");
    let r = s.http.post(s.url("/v1/messages")).header("x-api-key", "sekret").header("content-type", "application/json").body("{nope").send().await.unwrap();
    assert_eq!(r.status().as_u16(), 400);
    let v: Value = r.json().await.unwrap();
    assert_anthropic_error(400, &v, 400, "JSON");
    let r = s.http.post(s.url("/v1/messages")).header("x-api-key", "sekret").header("content-type", "text/plain").body("hi").send().await.unwrap();
    let v: Value = r.json().await.unwrap();
    assert_anthropic_error(415, &v, 415, "JSON");
    let (status, v) = s.post_with("/v1/messages/count_tokens", &key, &with("messages", json!([5]))).await;
    assert_anthropic_error(status, &v, 400, "messages[0]");
    // An engine failure: a 500 whole, an `error` event in a stream.
    let (status, v) = s.post_with("/v1/messages", &key, &with("messages", json!([{"role": "user", "content": "[[panic]]"}]))).await;
    assert_anthropic_error(status, &v, 500, "");
    let mut sb = with("messages", json!([{"role": "user", "content": "[[panic]]"}]));
    sb["stream"] = json!(true);
    s.api_key = Some("sekret".into());
    let events = s.stream_events("/v1/messages", &key, &sb).await;
    let names: Vec<&str> = events.iter().map(|(n, _)| n.as_str()).collect();
    assert_eq!(names.first(), Some(&"message_start"));
    assert_eq!(names.last(), Some(&"error"), "{names:?}");
    assert_eq!(events.last().unwrap().1["error"]["type"], "api_error");
    // The OpenAI routes keep OpenAI's shape.
    let (status, v) = s.post_with("/v1/chat/completions", &[("x-api-key", "sekret")], &json!({"messages": 5})).await;
    assert_error(status, &v, 400, Some("messages"));
    // And the server still answers, on every API.
    s.assert_healthy().await;
    let (status, v) = s.post_with("/v1/messages", &key, &ok).await;
    assert_eq!(status, 200, "{v}");
    let (status, v) = s.post_with("/v1/responses", &key, &json!({"input": "hi", "max_output_tokens": 4})).await;
    assert_eq!(status, 200, "{v}");
    // The model list carries both APIs' fields.
    let (status, v) = s.get("/v1/models").await;
    assert_eq!(status, 200);
    let v: Value = serde_json::from_str(&v).unwrap();
    assert_eq!(v["data"][0]["type"], "model");
    assert_eq!(v["data"][0]["object"], "model");
    assert!(v["data"][0]["created_at"].as_str().unwrap().ends_with('Z'));
    assert_eq!(v["has_more"], false);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_ten_turn_conversation_takes_the_previous_turns_from_the_cache() {
    let warm = start_cpu(default_config()).await;
    let mut cold_cfg = default_config();
    cold_cfg.cache_bytes = 0;
    let cold = start_cpu(cold_cfg).await;
    let system = "You are a helpful assistant who answers briefly.";
    let mut messages: Vec<Value> = vec![json!({"role": "user", "content": "Tell me about the first city."})];
    // The generation prompt after the history (thinking off), which a later turn never shares.
    let gen_prompt = tokenizer().encode("<|im_start|>assistant\n<think>\n\n</think>\n\n").unwrap().len() as u64;
    let mut prev_prompt = 0;
    let mut prefilled = 0;
    let mut total = 0;
    for turn in 1..=10 {
        let body = json!({"model": "m", "max_tokens": 6, "temperature": 0, "system": system, "messages": messages, "stream": turn % 2 == 0});
        let w = if turn % 2 == 0 {
            accumulate(&warm.stream_events("/v1/messages", &HEADERS, &body).await)
        } else {
            message(&warm, &body).await
        };
        let mut cb = body.clone();
        cb["stream"] = json!(false);
        let c = message(&cold, &cb).await;
        let prompt = prompt_of(&w);
        let cached = w["usage"]["cache_read_input_tokens"].as_u64().unwrap();
        assert_eq!(prompt_of(&c), prompt);
        assert_eq!(c["usage"]["cache_read_input_tokens"], 0);
        if turn >= 2 {
            // Everything before this turn's new messages came from the cache.
            assert!(cached + gen_prompt >= prev_prompt, "turn {turn}: cached {cached}, previous prompt {prev_prompt}");
            assert!(cached < prompt);
            assert!(prompt - cached < 40, "turn {turn}: {} tokens prefilled of {prompt}", prompt - cached);
        } else {
            assert_eq!(cached, 0);
        }
        prefilled += prompt - cached;
        total += prompt;
        // The cache changes nothing in the answer.
        assert_eq!(w["content"], c["content"], "turn {turn}");
        assert_eq!(w["stop_reason"], c["stop_reason"]);
        prev_prompt = prompt;
        messages.push(json!({"role": "assistant", "content": w["content"]}));
        messages.push(json!({"role": "user", "content": format!("Now tell me about city number {}.", turn + 1)}));
    }
    assert!(prefilled * 3 < total, "prefilled {prefilled} of {total}");
    eprintln!("10 turns: {prefilled} of {total} prompt tokens prefilled");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn requests_sharing_the_system_prompt_and_tools_share_their_cache() {
    // Claude Code's sub-agents, and its retries of a first turn, share the (long) system prompt and
    // tools but not the first user message: the end of the system block is a snapshot point too.
    let s = scripted().await;
    let a = claude_code_request("x-anthropic-billing-header: cch=1;", None);
    let mut b = claude_code_request("x-anthropic-billing-header: cch=2;", None);
    b["messages"][0]["content"][1]["text"] = json!("Now something else entirely.");
    let ma = message(&s, &a).await;
    let mb = message(&s, &b).await;
    // The system message as the template writes it, tools first.
    let sys = json!({"messages": [{"role": "system", "content": format!("You are a Claude agent, built on Anthropic's Claude Agent SDK.\n\n{}", "You are an interactive CLI tool that helps users with software engineering tasks. ".repeat(20))}],
        "tools": [weather_tool()]});
    let mut sys = sys;
    sys["messages"].as_array_mut().unwrap().push(json!({"role": "user", "content": "x"}));
    let text = ChatTemplate::builtin().render_request(&sys).unwrap();
    let end = text.find("<|im_end|>\n").unwrap() + "<|im_end|>\n".len();
    let system_tokens = tokenizer().encode(&text[..end]).unwrap().len() as u64;
    assert_eq!(ma["usage"]["cache_read_input_tokens"], 0);
    assert_eq!(mb["usage"]["cache_read_input_tokens"].as_u64().unwrap(), system_tokens, "{}", mb["usage"]);
    assert!(system_tokens > 400);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn parallel_requests_on_all_three_apis_are_all_answered() {
    // Claude Code runs sub-agents in parallel; they queue in front of the one engine thread.
    let s = std::sync::Arc::new(scripted().await);
    let mut tasks = Vec::new();
    for i in 0..6 {
        let s = std::sync::Arc::clone(&s);
        tasks.push(tokio::spawn(async move {
            let text = format!("Say hello, agent {i}.");
            match i % 3 {
                0 => {
                    let m = message(&s, &json!({"model": "m", "max_tokens": 64, "messages": [{"role": "user", "content": text}], "stream": false})).await;
                    m["content"][0]["text"].as_str().unwrap().to_string()
                }
                1 => {
                    let (status, r) = s.post("/v1/responses", &json!({"input": text, "reasoning": {"effort": "none"}})).await;
                    assert_eq!(status, 200, "{r}");
                    r["output"][0]["content"][0]["text"].as_str().unwrap().to_string()
                }
                _ => {
                    let v = s.chat(json!({"messages": user(&text), "chat_template_kwargs": {"enable_thinking": false}})).await;
                    v["choices"][0]["message"]["content"].as_str().unwrap().to_string()
                }
            }
        }));
    }
    for t in tasks {
        assert_eq!(t.await.unwrap(), "Hello there! Ünïcödé 🌷 works.");
    }
}

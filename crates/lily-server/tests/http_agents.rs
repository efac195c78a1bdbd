//! The real agents' first requests, recorded by `tools/agent_clients_test.py` from Codex CLI 0.171.0
//! (`/v1/responses`) and Claude Code 2.1.332 (`/v1/messages`) with their default prompts and tools
//! (tests/data/agents/), replayed over real HTTP against the scripted backend, headers and all:
//! each is understood (200), its stream is well-formed and ends with the API's terminal event, the
//! whole answer is the streamed one, and Claude Code's per-request billing block does not keep the
//! same conversation from the prefix cache. The real agents themselves run in .ci/run.

mod common;

use std::time::Duration;

use common::*;
use serde_json::{json, Value};

/// The agents' prompts are 9-12K tokens.
fn config() -> lily_server::ServerConfig {
    let mut c = default_config();
    c.ctx_size = 32768;
    c
}

fn fixture(name: &str) -> Value {
    let p = manifest().join("tests/data/agents").join(name);
    serde_json::from_str(&std::fs::read_to_string(&p).unwrap_or_else(|e| panic!("{}: {e}", p.display()))).unwrap()
}

fn headers(f: &Value) -> Vec<(String, String)> {
    f["headers"].as_object().unwrap().iter().map(|(k, v)| (k.clone(), v.as_str().unwrap().to_string())).collect()
}

async fn replay(s: &Server, f: &Value, body: &Value) -> Vec<(String, Value)> {
    let h = headers(f);
    let h: Vec<(&str, &str)> = h.iter().map(|(k, v)| (k.as_str(), v.as_str())).collect();
    s.stream_events(f["path"].as_str().unwrap(), &h, body).await
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn codex_exec_first_request_is_understood() {
    let (s, _) = start_scripted(config(), Duration::ZERO).await;
    let f = fixture("codex-0.171.0-responses.json");
    let body = &f["body"];
    assert_eq!(body["stream"], true);
    // What Codex sends: developer messages, function tools, a namespace of tools, a built-in tool.
    let tools = body["tools"].as_array().unwrap();
    assert!(tools.iter().any(|t| t["type"] == "namespace") && tools.iter().any(|t| t["type"] == "web_search"));
    assert_eq!(body["input"][0]["role"], "developer");
    let events = replay(&s, &f, body).await;
    let names: Vec<&str> = events.iter().map(|(n, _)| n.as_str()).collect();
    assert_eq!(&names[..2], ["response.created", "response.in_progress"]);
    assert_eq!(names.last(), Some(&"response.completed"), "{names:?}");
    for (i, (_, e)) in events.iter().enumerate() {
        assert_eq!(e["sequence_number"], i as u64);
    }
    let done = &events.last().unwrap().1["response"];
    assert_eq!(done["status"], "completed");
    assert!(done["usage"]["input_tokens"].as_u64().unwrap() > 5000, "{}", done["usage"]);
    // Codex asked for store: false: nothing kept.
    let (status, _) = s.get(&format!("/v1/responses/{}", done["id"].as_str().unwrap())).await;
    assert_eq!(status, 404);
    // The same request whole: the same output, its prompt from the cache.
    let mut whole_body = body.clone();
    whole_body["stream"] = json!(false);
    let (status, whole) = s.post("/v1/responses", &whole_body).await;
    assert_eq!(status, 200, "{whole}");
    assert_eq!(whole["usage"]["input_tokens"], done["usage"]["input_tokens"]);
    assert!(whole["usage"]["input_tokens_details"]["cached_tokens"].as_u64().unwrap() > 5000);
    let kinds = |r: &Value| r["output"].as_array().unwrap().iter().map(|i| i["type"].clone()).collect::<Vec<_>>();
    assert_eq!(kinds(&whole), kinds(done));
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn claude_code_first_request_is_understood_and_its_billing_block_is_no_cache_miss() {
    let (s, _) = start_scripted(config(), Duration::ZERO).await;
    let f = fixture("claude-code-2.1.332-messages.json");
    assert!(f["path"].as_str().unwrap().starts_with("/v1/messages?beta=true"));
    let body = &f["body"];
    // What Claude Code sends: the billing block first, a system turn after the first user
    // message, adaptive thinking, fields lily does not use. (Its max_tokens is the 64 the recording
    // set through CLAUDE_CODE_MAX_OUTPUT_TOKENS; unset, it asks for 128000: the second replay does.)
    assert!(body["system"][0]["text"].as_str().unwrap().starts_with("x-anthropic-billing-header:"));
    assert!(body["messages"].as_array().unwrap().iter().any(|m| m["role"] == "system"));
    assert_eq!(body["thinking"]["type"], "adaptive");
    let events = replay(&s, &f, body).await;
    let names: Vec<&str> = events.iter().map(|(n, _)| n.as_str()).collect();
    assert_eq!(&names[..2], ["message_start", "ping"]);
    assert_eq!(&names[names.len() - 2..], ["message_delta", "message_stop"], "{names:?}");
    let start = &events[0].1["message"]["usage"];
    let prompt = start["input_tokens"].as_u64().unwrap() + start["cache_read_input_tokens"].as_u64().unwrap();
    assert!(prompt > 5000, "{start}");
    // The next request carries another billing block (its values change per request): the same
    // conversation is still found in the cache, all of it but the generation prompt.
    let mut next = body.clone();
    next["system"][0]["text"] = json!("x-anthropic-billing-header: cc_version=2.1.332.a1b; cc_entrypoint=sdk-cli; cch=5e2c9;");
    next["max_tokens"] = json!(128000);
    let again = replay(&s, &f, &next).await;
    let u = &again[0].1["message"]["usage"];
    let cached = u["cache_read_input_tokens"].as_u64().unwrap();
    assert_eq!(cached + u["input_tokens"].as_u64().unwrap(), prompt);
    assert!(cached + 12 >= prompt, "cached {cached} of {prompt}");
    // count_tokens agrees, and the whole answer too.
    let h = headers(&f);
    let h: Vec<(&str, &str)> = h.iter().map(|(k, v)| (k.as_str(), v.as_str())).collect();
    let (status, n) = s.post_with("/v1/messages/count_tokens?beta=true", &h, body).await;
    assert_eq!(status, 200, "{n}");
    assert_eq!(n["input_tokens"].as_u64().unwrap(), prompt);
    let mut whole_body = body.clone();
    whole_body["stream"] = json!(false);
    let (status, whole) = s.post_with("/v1/messages?beta=true", &h, &whole_body).await;
    assert_eq!(status, 200, "{whole}");
    assert_eq!(whole["type"], "message");
    assert!(whole["stop_reason"].is_string());
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn codex_apply_patch_freeform_tool_is_offered_and_its_call_comes_back_as_text() {
    let (s, _) = start_scripted(config(), Duration::ZERO).await;
    let f = fixture("codex-0.171.0-gpt-5.5-responses.json");
    let mut body = f["body"].clone();
    let patch_tool = body["tools"].as_array().unwrap().iter().find(|t| t["type"] == "custom").expect("Codex's apply_patch").clone();
    assert_eq!(patch_tool["name"], "apply_patch");
    assert_eq!(patch_tool["format"]["syntax"], "lark");
    assert!(body["tools"].as_array().unwrap().iter().any(|t| t["type"] == "tool_search"));
    // As sent: understood.
    let events = replay(&s, &f, &body).await;
    assert_eq!(events.last().unwrap().0, "response.completed");
    // The scripted model, asked for a patch, calls apply_patch: a custom_tool_call whose input is
    // the patch text itself, as Codex expects it (not JSON).
    let last = body["input"].as_array().unwrap().len() - 1;
    body["input"][last]["content"][0]["text"] = json!("[[patch]] Create hello.txt.");
    let events = replay(&s, &f, &body).await;
    let done = &events.last().unwrap().1["response"];
    let call = done["output"].as_array().unwrap().iter().find(|i| i["type"] == "custom_tool_call").unwrap_or_else(|| panic!("{done}"));
    assert_eq!(call["name"], "apply_patch");
    assert_eq!(call["input"], "*** Begin Patch\n*** Add File: hello.txt\n+Hello \"world\"\n*** End Patch");
    assert!(events.iter().any(|(n, _)| n == "response.custom_tool_call_input.done"));
}

//! Hundreds of malformed requests for the Responses and Messages APIs, made by replacing one random
//! part of a rich valid request (any field, at any depth, of the recorded agents' requests too)
//! with a value of another type: each is answered — 200, or an error in that API's own shape, never
//! a 500 or a dropped connection — and the server answers good requests after them. The mutations
//! come from a fixed seed, so a failure reproduces.

mod common;

use std::time::Duration;

use common::*;
use serde_json::{json, Value};

struct Rng(u64);

impl Rng {
    fn next(&mut self) -> u64 {
        self.0 ^= self.0 << 13;
        self.0 ^= self.0 >> 7;
        self.0 ^= self.0 << 17;
        self.0
    }
    fn below(&mut self, n: usize) -> usize {
        (self.next() % n as u64) as usize
    }
}

/// Every path into `v` (object keys and array indices), depth first.
fn paths(v: &Value, at: &mut Vec<Value>, out: &mut Vec<Vec<Value>>) {
    out.push(at.clone());
    match v {
        Value::Object(m) => {
            for (k, x) in m {
                at.push(json!(k));
                paths(x, at, out);
                at.pop();
            }
        }
        Value::Array(a) => {
            for (i, x) in a.iter().enumerate() {
                at.push(json!(i));
                paths(x, at, out);
                at.pop();
            }
        }
        _ => {}
    }
}

fn at_mut<'a>(v: &'a mut Value, path: &[Value]) -> &'a mut Value {
    let mut cur = v;
    for p in path {
        cur = match p {
            Value::String(k) => &mut cur[k.as_str()],
            Value::Number(i) => &mut cur[i.as_u64().unwrap() as usize],
            _ => unreachable!(),
        };
    }
    cur
}

fn replacement(rng: &mut Rng) -> Value {
    match rng.below(12) {
        0 => Value::Null,
        1 => json!(true),
        2 => json!(-7),
        3 => json!(1e300),
        4 => json!(""),
        5 => json!("nonsense"),
        6 => json!([]),
        7 => json!({}),
        8 => json!([1, "a", null]),
        9 => json!({"type": "what"}),
        10 => json!(2.5),
        _ => json!({"type": "text", "text": 5}),
    }
}

async fn hammer(s: &Server, path: &str, base: &Value, n: usize, seed: u64, anthropic: bool) -> (usize, usize) {
    let mut all = Vec::new();
    paths(base, &mut Vec::new(), &mut all);
    let mut rng = Rng(seed);
    let (mut ok, mut refused) = (0, 0);
    for i in 0..n {
        let mut body = base.clone();
        let p = &all[1 + rng.below(all.len() - 1)];
        *at_mut(&mut body, p) = replacement(&mut rng);
        // Streamed or not, at random (the stream's own failures are covered elsewhere).
        if rng.below(2) == 0 {
            body["stream"] = json!(false);
        }
        let (status, v) = s.post_with(path, &[("x-api-key", "k"), ("anthropic-version", "2023-06-01")], &body).await;
        match status {
            200 => ok += 1,
            400 | 404 => {
                refused += 1;
                if anthropic {
                    assert_eq!(v["type"], "error", "mutation {i} at {p:?}: {v}");
                    assert!(v["error"]["message"].as_str().is_some_and(|m| !m.is_empty()), "mutation {i}: {v}");
                } else {
                    assert_error_shape(&v);
                }
            }
            s => panic!("mutation {i} at {p:?} of {path}: status {s}: {v}\n{body}"),
        }
    }
    (ok, refused)
}

fn fixture(name: &str) -> Value {
    let p = manifest().join("tests/data/agents").join(name);
    serde_json::from_str::<Value>(&std::fs::read_to_string(p).unwrap()).unwrap()["body"].clone()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn mutated_requests_are_answered_or_refused_in_each_apis_shape() {
    let mut cfg = default_config();
    cfg.ctx_size = 32768;
    cfg.max_body_bytes = 4 << 20;
    let (s, _) = start_scripted(cfg, Duration::ZERO).await;
    let responses = json!({"model": "m", "instructions": "Be brief.", "max_output_tokens": 40, "temperature": 0.5, "top_p": 0.9,
        "reasoning": {"effort": "low", "summary": "auto"}, "text": {"format": {"type": "json_schema", "name": "g", "schema": {"type": "object", "properties": {"a": {"enum": ["x", "y"]}}, "required": ["a"]}}},
        "tools": [{"type": "function", "name": "get_weather", "parameters": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}},
                  {"type": "custom", "name": "apply_patch", "format": {"type": "grammar", "syntax": "lark", "definition": "start: /.+/"}},
                  {"type": "namespace", "name": "ns", "tools": [{"type": "function", "name": "f", "parameters": {"type": "object"}}]}],
        "tool_choice": "auto", "parallel_tool_calls": true, "store": true, "stream": true,
        "input": [{"role": "developer", "content": "D"}, {"type": "message", "role": "user", "content": [{"type": "input_text", "text": "Weather?"}]},
                  {"type": "reasoning", "summary": [{"type": "summary_text", "text": "r"}], "content": [{"type": "reasoning_text", "text": "r"}]},
                  {"type": "function_call", "call_id": "c1", "name": "get_weather", "arguments": "{\"city\": \"Paris\"}"},
                  {"type": "function_call_output", "call_id": "c1", "output": [{"type": "input_text", "text": "sunny"}]},
                  {"type": "custom_tool_call", "call_id": "c2", "name": "apply_patch", "input": "p"},
                  {"type": "custom_tool_call_output", "call_id": "c2", "output": "done"},
                  {"role": "assistant", "content": [{"type": "output_text", "text": "ok"}]}, {"role": "user", "content": "more"}]});
    let messages = json!({"model": "m", "max_tokens": 40, "system": [{"type": "text", "text": "x-anthropic-billing-header: cch=1;"}, {"type": "text", "text": "S"}],
        "temperature": 0.5, "top_p": 0.9, "top_k": 5, "stop_sequences": ["zz"], "thinking": {"type": "enabled", "budget_tokens": 100}, "stream": true,
        "tools": [{"name": "get_weather", "input_schema": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}}],
        "tool_choice": {"type": "auto", "disable_parallel_tool_use": false}, "metadata": {"user_id": "u"},
        "messages": [{"role": "user", "content": "Weather?"},
                     {"role": "assistant", "content": [{"type": "thinking", "thinking": "t", "signature": "s"}, {"type": "text", "text": "Checking."},
                                                       {"type": "tool_use", "id": "t1", "name": "get_weather", "input": {"city": "Paris"}}]},
                     {"role": "user", "content": [{"type": "tool_result", "tool_use_id": "t1", "content": [{"type": "text", "text": "sunny"}], "is_error": false},
                                                  {"type": "text", "text": "And?"}]},
                     {"role": "system", "content": [{"type": "text", "text": "late"}]}]});
    let mut totals = Vec::new();
    totals.push(hammer(&s, "/v1/responses", &responses, 300, 0x9E3779B97F4A7C15, false).await);
    totals.push(hammer(&s, "/v1/messages", &messages, 300, 0xD1B54A32D192ED03, true).await);
    totals.push(hammer(&s, "/v1/messages/count_tokens", &messages, 100, 0x94D049BB133111EB, true).await);
    // The agents' own requests, mutated anywhere (they are large: a path is picked at random).
    totals.push(hammer(&s, "/v1/responses", &fixture("codex-0.171.0-gpt-5.5-responses.json"), 60, 0xBF58476D1CE4E5B9, false).await);
    totals.push(hammer(&s, "/v1/messages", &fixture("claude-code-2.1.332-messages.json"), 60, 0x2545F4914F6CDD1D, true).await);
    for (ok, refused) in &totals {
        assert!(*ok > 0 && *refused > 0, "{totals:?}: both outcomes should occur");
    }
    eprintln!("(answered, refused) per run: {totals:?}");
    s.assert_healthy().await;
    let (status, _) = s.post("/v1/responses", &json!({"input": "Say hello."})).await;
    assert_eq!(status, 200);
    let (status, _) = s.post("/v1/messages", &json!({"model": "m", "max_tokens": 10, "messages": [{"role": "user", "content": "hi"}]})).await;
    assert_eq!(status, 200);
}

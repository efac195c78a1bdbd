//! The server under abuse and at its edges, over real sockets: the shutdown (answers in flight end
//! with a final chunk and `[DONE]`, even when the engine is stuck; queued requests get a 503; the
//! server stops), refusals below the router (a request hyper cannot parse, headers too large, a
//! non-JSON body, a slow client) answered with OpenAI-shaped JSON or a closed connection, a huge
//! prompt refused before it is tokenised, wrong types anywhere in a request, `Retry-After`, the
//! models route, the per-request log and the server's default `max_tokens`.

mod common;

use std::sync::{Arc, Mutex};
use std::time::Duration;

use common::*;
use serde_json::{json, Value};
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::TcpStream;

const TOKEN_DELAY: Duration = Duration::from_millis(20);
/// Generous bounds for things that should happen in well under a second (never a speed test).
const SOON: Duration = Duration::from_secs(30);

fn endless(stream: bool) -> Value {
    json!({"messages": user("[[endless]] go on forever"), "stream": stream, "temperature": 0})
}

/// Sends raw bytes on a fresh connection and reads until the server closes it (or `SOON`).
async fn raw(s: &Server, bytes: &[u8]) -> String {
    let mut c = TcpStream::connect(s.addr).await.unwrap();
    c.write_all(bytes).await.unwrap();
    let mut out = Vec::new();
    let _ = tokio::time::timeout(SOON, c.read_to_end(&mut out)).await.expect("the server should close the connection");
    String::from_utf8_lossy(&out).into_owned()
}

/// An HTTP/1.1 response's status, headers (lowercase names) and body.
fn split_response(r: &str) -> (u16, String, String) {
    let (head, body) = r.split_once("\r\n\r\n").unwrap_or_else(|| panic!("no head in {r:?}"));
    let status = head[9..12].parse().unwrap();
    (status, head.to_ascii_lowercase(), body.to_string())
}

fn assert_json_refusal(r: &str, status: u16, code: &str) {
    let (st, head, body) = split_response(r);
    assert_eq!(st, status, "{r}");
    assert!(head.contains("content-type: application/json"), "{head}");
    let v: Value = serde_json::from_str(&body).unwrap_or_else(|e| panic!("{e}: {body:?}"));
    assert_error_shape(&v);
    assert_eq!(v["error"]["code"], code, "{v}");
}

// ---------------------------------------------------------------------------------------------
// Shutdown

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn shutdown_ends_a_stream_in_flight_with_a_final_chunk_and_done() {
    let (mut s, _) = start_scripted(default_config(), TOKEN_DELAY).await;
    let r = s.http.post(s.url("/v1/chat/completions")).json(&endless(true)).send().await.unwrap();
    let mut sse = SseReader::new(r);
    for _ in 0..5 {
        sse.next().await.expect("a chunk");
    }
    s.stop.take().unwrap().send(()).unwrap();
    let mut rest = Vec::new();
    while let Some(d) = tokio::time::timeout(SOON, sse.next()).await.expect("the stream should end") {
        rest.push(d);
    }
    assert_eq!(rest.last().map(String::as_str), Some("[DONE]"), "{rest:?}");
    let last: Value = serde_json::from_str(&rest[rest.len() - 2]).unwrap();
    assert_eq!(last["choices"][0]["finish_reason"], "stop", "{last}");
    // The server stops, and new connections are refused.
    tokio::time::timeout(SOON, &mut s.served).await.expect("the server should stop").unwrap().unwrap();
    assert!(TcpStream::connect(s.addr).await.is_err());
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn shutdown_ends_answers_even_while_the_engine_is_stuck() {
    // The engine sleeps a minute in its first forward pass that gives logits (a long prefill).
    let (mut s, _) = start_scripted(default_config(), Duration::from_secs(60)).await;
    let s2 = s.http.clone();
    let url = s.url("/v1/chat/completions");
    let streamed = tokio::spawn(async move {
        let r = s2.post(&url).json(&endless(true)).send().await.unwrap();
        assert_eq!(r.status().as_u16(), 200);
        let mut sse = SseReader::new(r);
        let mut all = Vec::new();
        while let Some(d) = sse.next().await {
            all.push(d);
        }
        all
    });
    wait_for("the engine to be busy", SOON, async || s.metric("lily_engine_busy").await == 1.0).await;
    // A second request waits in the queue behind it.
    let (s3, url) = (s.http.clone(), s.url("/v1/chat/completions"));
    let queued = tokio::spawn(async move {
        let r = s3.post(&url).json(&json!({"messages": user("hi")})).send().await.unwrap();
        (r.status().as_u16(), r.json::<Value>().await.unwrap())
    });
    wait_for("the request to be queued", SOON, async || s.metric("lily_queue_depth").await == 1.0).await;
    s.stop.take().unwrap().send(()).unwrap();
    let all = tokio::time::timeout(SOON, streamed).await.expect("the stream should end").unwrap();
    assert_eq!(all.last().map(String::as_str), Some("[DONE]"), "{all:?}");
    let chunks: Vec<Value> = all[..all.len() - 1].iter().map(|d| serde_json::from_str(d).unwrap()).collect();
    assert_eq!(chunks[0]["choices"][0]["delta"]["role"], "assistant");
    assert_eq!(chunks.last().unwrap()["choices"][0]["finish_reason"], "stop");
    let (st, v) = tokio::time::timeout(SOON, queued).await.unwrap().unwrap();
    assert_error(st, &v, 503, None);
    assert_eq!(v["error"]["code"], "shutting_down");
    tokio::time::timeout(SOON, &mut s.served).await.expect("the server should stop").unwrap().unwrap();
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_whole_answer_in_flight_at_shutdown_is_answered() {
    let (mut s, _) = start_scripted(default_config(), TOKEN_DELAY).await;
    let (h, url) = (s.http.clone(), s.url("/v1/chat/completions"));
    let whole = tokio::spawn(async move { h.post(&url).json(&endless(false)).send().await.unwrap().json::<Value>().await.unwrap() });
    wait_for("tokens to be generated", SOON, async || s.metric("lily_engine_busy").await == 1.0).await;
    tokio::time::sleep(TOKEN_DELAY * 5).await;
    s.stop.take().unwrap().send(()).unwrap();
    let v = tokio::time::timeout(SOON, whole).await.unwrap().unwrap();
    assert_eq!(v["object"], "chat.completion", "{v}");
    assert_eq!(v["choices"][0]["finish_reason"], "stop");
    assert!(v["usage"]["completion_tokens"].as_u64().unwrap() >= 1, "{v}");
    tokio::time::timeout(SOON, &mut s.served).await.unwrap().unwrap().unwrap();
}

// ---------------------------------------------------------------------------------------------
// Below the router

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn refusals_below_the_router_speak_json() {
    let (s, _) = start_scripted(default_config(), Duration::ZERO).await;
    // Headers too large (one huge header; too many headers).
    let big = format!("GET /health HTTP/1.1\r\nhost: x\r\nx-big: {}\r\n\r\n", "a".repeat(100 << 10));
    assert_json_refusal(&raw(&s, big.as_bytes()).await, 431, "headers_too_large");
    let many: String = (0..150).map(|i| format!("x-h{i}: v\r\n")).collect();
    assert_json_refusal(&raw(&s, format!("GET /health HTTP/1.1\r\nhost: x\r\n{many}\r\n").as_bytes()).await, 431, "headers_too_large");
    // Not HTTP at all; a broken header line.
    assert_json_refusal(&raw(&s, b"HELLO THERE\r\n\r\n").await, 400, "bad_http_request");
    assert_json_refusal(&raw(&s, b"GET /health HTTP/1.1\r\nhost x\r\n\r\n").await, 400, "bad_http_request");
    // A good request on a raw connection still works (and a keep-alive answer is not touched).
    let ok = raw(&s, b"GET /health HTTP/1.1\r\nhost: x\r\nconnection: close\r\n\r\n").await;
    assert_eq!(split_response(&ok).0, 200, "{ok}");
    // Wrong methods and routes.
    let r = raw(&s, b"DELETE /v1/chat/completions HTTP/1.1\r\nhost: x\r\nconnection: close\r\n\r\n").await;
    let (st, head, body) = split_response(&r);
    assert_eq!(st, 405);
    assert!(head.contains("content-type: application/json"), "{head}");
    assert_error_shape(&serde_json::from_str(&body).unwrap());
    // Bodies that are not JSON, by content type.
    for ct in ["text/plain", "application/x-www-form-urlencoded", "multipart/form-data; boundary=x"] {
        let r = s.http.post(s.url("/v1/chat/completions")).header("content-type", ct).body(r#"{"messages": []}"#).send().await.unwrap();
        assert_eq!(r.status().as_u16(), 415, "{ct}");
        let v: Value = r.json().await.unwrap();
        assert_eq!(v["error"]["code"], "unsupported_media_type");
    }
    let r = s
        .http
        .post(s.url("/v1/chat/completions"))
        .header("content-type", "application/json; charset=utf-8")
        .body(json!({"messages": user("hi"), "max_tokens": 2}).to_string())
        .send()
        .await
        .unwrap();
    assert_eq!(r.status().as_u16(), 200);
    s.assert_healthy().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn slow_clients_are_cut_off() {
    let mut cfg = default_config();
    cfg.body_timeout = Duration::from_millis(300);
    let limits = lily_server::HttpLimits { header_read_timeout: Duration::from_millis(300), ..Default::default() };
    let (m, _) = scripted_model(Duration::ZERO);
    let s = start_with(m, cfg, limits).await;
    // Headers that never end: the connection is closed (no answer is owed to half a request).
    let mut c = TcpStream::connect(s.addr).await.unwrap();
    c.write_all(b"POST /v1/chat/completions HTTP/1.1\r\nhost: x\r\nx-slow: ").await.unwrap();
    let mut out = Vec::new();
    tokio::time::timeout(SOON, c.read_to_end(&mut out)).await.expect("a slow-loris connection must be closed").unwrap();
    // A connection that sends nothing at all, and one left idle after a request, are closed too.
    let mut c = TcpStream::connect(s.addr).await.unwrap();
    tokio::time::timeout(SOON, c.read_to_end(&mut out)).await.expect("a silent connection must be closed").unwrap();
    let mut c = TcpStream::connect(s.addr).await.unwrap();
    c.write_all(b"GET /health HTTP/1.1\r\nhost: x\r\n\r\n").await.unwrap();
    let mut out = Vec::new();
    tokio::time::timeout(SOON, c.read_to_end(&mut out)).await.expect("an idle keep-alive connection must be closed").unwrap();
    assert!(String::from_utf8_lossy(&out).starts_with("HTTP/1.1 200"));
    // A body that never comes: 408.
    let mut c = TcpStream::connect(s.addr).await.unwrap();
    c.write_all(b"POST /v1/chat/completions HTTP/1.1\r\nhost: x\r\ncontent-type: application/json\r\ncontent-length: 100\r\n\r\n{\"messages\"").await.unwrap();
    let mut buf = vec![0u8; 4096];
    let n = tokio::time::timeout(SOON, c.read(&mut buf)).await.expect("a 408 should come").unwrap();
    assert_json_refusal(&String::from_utf8_lossy(&buf[..n]), 408, "request_timeout");
    s.assert_healthy().await;
}

// ---------------------------------------------------------------------------------------------
// Requests

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_huge_prompt_is_refused_by_its_size_before_tokenising() {
    let (s, _) = start_scripted(default_config(), Duration::ZERO).await;
    // 4096 tokens of context: at most 128 KiB of prompt is read.
    let (st, v) = s.post("/v1/chat/completions", &json!({"messages": user(&"word ".repeat(40_000))})).await;
    assert_error(st, &v, 400, Some("messages"));
    assert_eq!(v["error"]["code"], "context_length_exceeded");
    assert!(v["error"]["message"].as_str().unwrap().contains("bytes"), "{v}");
    let (st, v) = s.post("/v1/completions", &json!({"prompt": "x".repeat(200_000)})).await;
    assert_error(st, &v, 400, Some("prompt"));
    assert_eq!(s.metric("lily_generations_total").await, 0.0);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn wrong_types_anywhere_are_400s_naming_the_field() {
    let (s, _) = start_scripted(default_config(), Duration::ZERO).await;
    let ok = || json!({"messages": user("hi"), "max_tokens": 2});
    let with = |k: &str, v: Value| {
        let mut b = ok();
        b[k] = v;
        b
    };
    let msgs = |m: Value| json!({"messages": [{"role": "user", "content": "hi"}, m], "max_tokens": 2});
    let tool = |params: Value| with("tools", json!([{"type": "function", "function": {"name": "f", "parameters": params}}]));
    let cases: Vec<(Value, &str)> = vec![
        (with("temperature", json!("0.7")), "temperature"),
        (with("model", json!(5)), "model"),
        (with("user", json!({"id": 1})), "user"),
        (with("top_logprobs", json!(4294967297u64)), "top_logprobs"),
        (with("top_k", json!(4294967296u64)), "top_k"),
        (with("max_tokens", json!(1e30)), "max_tokens"),
        (with("seed", json!(1e30)), "seed"),
        (with("seed", json!(1.5)), "seed"),
        (with("logit_bias", json!({"1": "x"})), "logit_bias.1"),
        (with("logit_bias", json!({"a": 1})), "logit_bias"),
        (with("logit_bias", json!([1])), "logit_bias"),
        (with("stop", json!([""])), "stop"),
        (with("stop", json!(vec!["s"; 17])), "stop"),
        (with("parallel_tool_calls", json!("yes")), "parallel_tool_calls"),
        (with("chat_template_kwargs", json!("x")), "chat_template_kwargs"),
        (with("add_generation_prompt", json!(1)), "add_generation_prompt"),
        (with("stream_options", json!({"include_usage": "yes"})), "stream_options.include_usage"),
        (msgs(json!({"role": "user", "content": "x", "name": 5})), "messages[1].name"),
        (msgs(json!({"role": "user", "content": [{"type": "text", "text": 5}]})), "messages[1].content[0].text"),
        (msgs(json!({"role": "user", "content": [{"type": "image_url", "image_url": {"url": "data:,"}}]})), "messages[1].content[0].type"),
        (msgs(json!({"role": "assistant", "tool_calls": [{"type": "function", "function": {"name": "f", "arguments": 5}}]})), "messages[1].tool_calls[0].function.arguments"),
        (msgs(json!({"role": "assistant", "tool_calls": [{"type": "function", "function": {"name": ["f"]}}]})), "messages[1].tool_calls[0].function.name"),
        (msgs(json!({"role": "tool", "content": "x", "tool_call_id": 3})), "messages[1].tool_call_id"),
        (tool(json!({"type": "object", "properties": {"city": {"type": 5}}})), "tools[0].function.parameters.properties.city.type"),
        (tool(json!({"type": "object", "required": [1]})), "tools[0].function.parameters.required"),
        (tool(json!("object")), "tools[0].function.parameters"),
        (json!({"messages": user("hi"), "tools": [weather_tool()], "tool_choice": {"type": "function", "function": {"name": 5}}}), "tool_choice.function.name"),
        (with("n", json!("1")), "n"),
    ];
    for (body, param) in &cases {
        let (st, v) = s.post("/v1/chat/completions", body).await;
        assert_error(st, &v, 400, Some(param));
        let msg = v["error"]["message"].as_str().unwrap();
        for rust in ["invalid type", "expected f32", "expected u32", "expected i32", "untagged"] {
            assert!(!msg.contains(rust), "{body}: serde's wording leaks: {msg}");
        }
    }
    // The issue's example, word for word.
    let (_, v) = s.post("/v1/chat/completions", &with("temperature", json!("0.7"))).await;
    assert_eq!(v["error"]["message"], "`temperature` must be a number, got a string: \"0.7\"");
    let (st, v) = s.post("/v1/completions", &json!({"prompt": "hi", "logprobs": 4294967297u64})).await;
    assert_error(st, &v, 400, Some("logprobs"));
    // Integral floats are the integers they spell; negative seeds are fine (any 64-bit integer).
    s.chat(json!({"messages": user("hi"), "max_tokens": 2.0, "seed": -1, "top_k": 20.0})).await;
    assert_eq!(s.metric("lily_generations_total").await, 1.0, "bad requests never reach the engine");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_full_queue_says_when_to_retry() {
    let mut cfg = default_config();
    cfg.max_queue = 1;
    let (s, _) = start_scripted(cfg, TOKEN_DELAY).await;
    let (h, url) = (s.http.clone(), s.url("/v1/chat/completions"));
    let running = tokio::spawn(async move { h.post(&url).json(&json!({"messages": user("[[endless]]"), "max_tokens": 40})).send().await.unwrap().status() });
    wait_for("the engine to be busy", SOON, async || s.metric("lily_engine_busy").await == 1.0).await;
    let (h, url) = (s.http.clone(), s.url("/v1/chat/completions"));
    let queued = tokio::spawn(async move { h.post(&url).json(&json!({"messages": user("hi"), "max_tokens": 2})).send().await.unwrap().status() });
    wait_for("the request to be queued", SOON, async || s.metric("lily_queue_depth").await == 1.0).await;
    let r = s.http.post(s.url("/v1/chat/completions")).json(&json!({"messages": user("hi")})).send().await.unwrap();
    assert_eq!(r.status().as_u16(), 429);
    let retry: u64 = r.headers().get("retry-after").expect("Retry-After").to_str().unwrap().parse().unwrap();
    assert!((1..=60).contains(&retry), "{retry}");
    assert_eq!(r.json::<Value>().await.unwrap()["error"]["code"], "queue_full");
    assert_eq!(running.await.unwrap().as_u16(), 200);
    assert_eq!(queued.await.unwrap().as_u16(), 200);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_model_can_be_retrieved_by_id() {
    let mut cfg = default_config();
    cfg.model_id = "org/some-model".into();
    cfg.api_key = Some("k".into());
    let (s, _) = start_scripted(cfg, Duration::ZERO).await;
    for path in ["/v1/models/org/some-model", "/v1/models/org%2Fsome-model"] {
        let (st, text) = s.get(path).await;
        assert_eq!(st, 200, "{path}: {text}");
        let v: Value = serde_json::from_str(&text).unwrap();
        assert_eq!(v["id"], "org/some-model");
        assert_eq!(v["object"], "model");
    }
    let (st, text) = s.get("/v1/models/gpt-4").await;
    let v: Value = serde_json::from_str(&text).unwrap();
    assert_error(st, &v, 404, Some("model"));
    assert_eq!(v["error"]["code"], "model_not_found");
    // Behind the API key like the rest of /v1.
    let r = s.http.get(s.url("/v1/models/org/some-model")).send().await.unwrap();
    assert_eq!(r.status().as_u16(), 401);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn every_request_gets_one_log_line() {
    let lines = Arc::new(Mutex::new(Vec::<String>::new()));
    let mut cfg = default_config();
    let l = Arc::clone(&lines);
    cfg.log = Some(lily_server::RequestLog::new(move |line| l.lock().unwrap().push(line.to_string())));
    let (s, _) = start_scripted(cfg, Duration::ZERO).await;
    s.chat(json!({"messages": user("hi"), "max_tokens": 3, "temperature": 0})).await;
    s.stream_chunks("/v1/chat/completions", &json!({"messages": user("hi"), "stream": true, "temperature": 0})).await;
    let (st, _) = s.post("/v1/chat/completions", &json!({"messages": user("hi"), "temperature": "hot"})).await;
    assert_eq!(st, 400);
    s.get("/v1/models").await;
    s.get("/health").await;
    s.get("/nope").await;
    wait_for("five log lines", SOON, async || lines.lock().unwrap().len() >= 5).await;
    let lines = lines.lock().unwrap().clone();
    assert_eq!(lines.len(), 5, "{lines:#?}");
    let whole = &lines[0];
    assert!(whole.starts_with("POST /v1/chat/completions 200 127.0.0.1:"), "{whole}");
    assert!(whole.contains("prompt ") && whole.contains("(0 cached), 3 generated, length"), "{whole}");
    assert!(whole.contains("tok/s") && whole.contains("prefill ") && whole.contains("decode "), "{whole}");
    let streamed = &lines[1];
    assert!(streamed.contains("generated, stop") && streamed.contains("cached)"), "{streamed}");
    assert!(lines[2].starts_with("POST /v1/chat/completions 400") && lines[2].contains("temperature"), "{}", lines[2]);
    assert!(lines[3].starts_with("GET /v1/models 200"), "{}", lines[3]);
    // /health polls are left out; a 404 is not.
    assert!(lines[4].starts_with("GET /nope 404"), "{}", lines[4]);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_servers_default_max_tokens_applies_when_a_request_sets_none() {
    let mut cfg = default_config();
    cfg.default_max_tokens = Some(4);
    let (s, _) = start_scripted(cfg, Duration::ZERO).await;
    let v = s.chat(json!({"messages": user("[[endless]]")})).await;
    assert_eq!(v["usage"]["completion_tokens"], 4);
    assert_eq!(v["choices"][0]["finish_reason"], "length");
    let v = s.chat(json!({"messages": user("[[endless]]"), "max_tokens": 6})).await;
    assert_eq!(v["usage"]["completion_tokens"], 6);
}

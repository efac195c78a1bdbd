//! The OpenAI protocol over real HTTP, with the scripted backend (a "model" that writes a known
//! answer: reasoning, content and a tool call), plus every kind of bad request, auth and routing.
//! Each test starts its own server on 127.0.0.1:0.

mod common;

use std::time::Duration;

use common::*;
use lily_template::ChatTemplate;
use serde_json::{json, Value};

fn now() -> u64 {
    std::time::SystemTime::now().duration_since(std::time::UNIX_EPOCH).unwrap().as_secs()
}

/// Prompt tokens of a chat request as the server should count them (template + tokenizer).
fn prompt_tokens(body: &Value) -> usize {
    let text = ChatTemplate::builtin().render_request(body).unwrap();
    tokenizer().encode(&text).unwrap().len()
}

async fn scripted() -> Server {
    start_scripted(default_config(), Duration::ZERO).await.0
}

fn weather_request() -> Value {
    json!({
        "model": "whatever-the-client-says",
        "messages": [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "What's the weather in Paris?"}],
        "tools": [weather_tool()],
        // Extras lily honours, and fields it does not know (accepted and ignored).
        "top_k": 5, "min_p": 0.05, "repetition_penalty": 1.1, "seed": 7,
        "chat_template_kwargs": {"enable_thinking": true},
        "parallel_tool_calls": true, "user": "someone", "metadata": {"a": "b"}, "some_future_field": [1, {"x": null}],
        "store": false, "service_tier": "auto",
    })
}

/// Common fields of a completion object or chunk.
fn check_envelope(v: &Value, object: &str, id_prefix: &str) {
    assert_eq!(v["object"], object, "{v}");
    assert!(v["id"].as_str().unwrap().starts_with(id_prefix), "{v}");
    let created = v["created"].as_u64().unwrap();
    assert!(created.abs_diff(now()) < 60, "created {created}");
    assert_eq!(v["model"], "test-model");
    assert!(v["system_fingerprint"].as_str().is_some_and(|s| s.starts_with("lily-")), "{v}");
    assert!(v["choices"].as_array().map(Vec::len).unwrap_or(0) <= 1);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn chat_whole_response_has_reasoning_content_and_a_tool_call() {
    let s = scripted().await;
    let body = weather_request();
    let v = s.chat(body.clone()).await;
    check_envelope(&v, "chat.completion", "chatcmpl-");
    let c = &v["choices"][0];
    assert_eq!(c["index"], 0);
    assert_eq!(c["finish_reason"], "tool_calls", "{v}");
    let m = &c["message"];
    assert_eq!(m["role"], "assistant");
    assert_eq!(m["reasoning_content"], "The user wants the weather.");
    assert_eq!(m["content"], "Let me check.");
    let calls = m["tool_calls"].as_array().unwrap();
    assert_eq!(calls.len(), 1);
    assert!(calls[0]["id"].as_str().unwrap().starts_with("call_"));
    assert_eq!(calls[0]["type"], "function");
    assert_eq!(calls[0]["function"]["name"], "get_weather");
    let args: Value = serde_json::from_str(calls[0]["function"]["arguments"].as_str().unwrap()).unwrap();
    assert_eq!(args, json!({"city": "Paris & <Lyon>"}));
    // Usage: the prompt as the template renders it, every generated token (the end-of-turn too).
    let u = &v["usage"];
    assert_eq!(u["prompt_tokens"].as_u64().unwrap() as usize, prompt_tokens(&body));
    let script_tokens = tokenizer().encode(TOOL_SCRIPT).unwrap().len() as u64;
    let completion = u["completion_tokens"].as_u64().unwrap();
    assert!(completion >= script_tokens / 2 && completion <= script_tokens + 2, "{completion} vs {script_tokens}");
    assert_eq!(u["total_tokens"].as_u64().unwrap(), u["prompt_tokens"].as_u64().unwrap() + completion);
    assert_eq!(u["prompt_tokens_details"]["cached_tokens"], 0);
    assert_eq!(c["logprobs"], Value::Null);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn chat_stream_follows_the_openai_chunk_protocol() {
    let s = scripted().await;
    let mut body = weather_request();
    let whole = s.chat(body.clone()).await;
    body["stream"] = json!(true);
    body["stream_options"] = json!({"include_usage": true});
    let chunks = s.stream_chunks("/v1/chat/completions", &body).await;
    assert!(chunks.len() > 5, "{chunks:?}");
    let id = chunks[0]["id"].as_str().unwrap();
    for c in &chunks {
        check_envelope(c, "chat.completion.chunk", "chatcmpl-");
        assert_eq!(c["id"], id, "one id per stream");
    }
    // The role comes first.
    assert_eq!(chunks[0]["choices"][0]["delta"]["role"], "assistant");
    // The last chunk carries the usage (and no choices); the one before it the finish reason.
    let (usage_chunk, rest) = chunks.split_last().unwrap();
    assert_eq!(usage_chunk["choices"], json!([]));
    let mut usage = usage_chunk["usage"].clone();
    let mut whole_usage = whole["usage"].clone();
    // The identical request found its prompt in the prefix cache the second time.
    assert!(usage["prompt_tokens_details"]["cached_tokens"].as_u64().unwrap() > 0, "{usage}");
    usage["prompt_tokens_details"]["cached_tokens"] = json!(0);
    whole_usage["prompt_tokens_details"]["cached_tokens"] = json!(0);
    assert_eq!(usage, whole_usage, "streamed usage = whole usage");
    for c in rest {
        assert!(c.get("usage").is_none_or(Value::is_null), "usage only in the last chunk: {c}");
    }
    let (finish, deltas) = rest.split_last().unwrap();
    assert_eq!(finish["choices"][0]["finish_reason"], "tool_calls");
    let mut reasoning = String::new();
    let mut content = String::new();
    let mut args = String::new();
    let mut order = Vec::new();
    let mut call_id = None;
    for c in deltas {
        let ch = &c["choices"][0];
        assert_eq!(ch["finish_reason"], Value::Null);
        let d = &ch["delta"];
        if let Some(r) = d["reasoning_content"].as_str() {
            reasoning.push_str(r);
            order.push("reasoning");
        }
        if let Some(t) = d["content"].as_str() {
            if !t.is_empty() {
                content.push_str(t);
                order.push("content");
            }
        }
        if let Some(calls) = d["tool_calls"].as_array() {
            assert_eq!(calls.len(), 1);
            let tc = &calls[0];
            assert_eq!(tc["index"], 0);
            if call_id.is_none() {
                // The first fragment names the call; later ones only add arguments.
                call_id = Some(tc["id"].as_str().expect("the first tool-call fragment has the id").to_string());
                assert_eq!(tc["type"], "function");
                assert_eq!(tc["function"]["name"], "get_weather");
                order.push("call");
            } else {
                assert!(tc.get("id").is_none() && tc["function"].get("name").is_none(), "{tc}");
            }
            args.push_str(tc["function"]["arguments"].as_str().unwrap_or(""));
        }
    }
    order.dedup();
    assert_eq!(order, ["reasoning", "content", "call"]);
    let m = &whole["choices"][0]["message"];
    assert_eq!(reasoning, m["reasoning_content"].as_str().unwrap());
    assert_eq!(content, m["content"].as_str().unwrap());
    assert_eq!(args, m["tool_calls"][0]["function"]["arguments"].as_str().unwrap());
    assert!(call_id.unwrap().starts_with("call_"));
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn plain_answer_streamed_equals_whole_without_usage_unless_asked() {
    let s = scripted().await;
    let body = json!({"messages": user("Say hello."), "temperature": 0.7});
    let whole = s.chat(body.clone()).await;
    let m = &whole["choices"][0]["message"];
    assert_eq!(m["content"], "Hello there! Ünïcödé 🌷 works.");
    assert_eq!(m["reasoning_content"], "Just greet.");
    assert!(m.get("tool_calls").is_none_or(|t| t.as_array().is_none_or(Vec::is_empty)));
    assert_eq!(whole["choices"][0]["finish_reason"], "stop");
    let mut sb = body.clone();
    sb["stream"] = json!(true);
    let chunks = s.stream_chunks("/v1/chat/completions", &sb).await;
    assert!(chunks.iter().all(|c| c.get("usage").is_none_or(Value::is_null)), "no usage chunk unless include_usage");
    let text: String = chunks.iter().filter_map(|c| c["choices"][0]["delta"]["content"].as_str()).collect();
    assert_eq!(text, m["content"].as_str().unwrap());
    assert_eq!(chunks.last().unwrap()["choices"][0]["finish_reason"], "stop");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn chat_template_kwargs_can_turn_thinking_off() {
    let s = scripted().await;
    let body = json!({"messages": user("Say hello."), "chat_template_kwargs": {"enable_thinking": false}});
    let v = s.chat(body.clone()).await;
    let m = &v["choices"][0]["message"];
    assert_eq!(m["content"], "Hello there! Ünïcödé 🌷 works.");
    assert!(m.get("reasoning_content").is_none_or(Value::is_null), "{v}");
    assert_eq!(v["usage"]["prompt_tokens"].as_u64().unwrap() as usize, prompt_tokens(&body));
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn length_and_stop_strings_end_the_answer() {
    let s = scripted().await;
    let v = s.chat(json!({"messages": user("Say hello."), "max_tokens": 3})).await;
    assert_eq!(v["choices"][0]["finish_reason"], "length");
    assert_eq!(v["usage"]["completion_tokens"], 3);
    let v = s.chat(json!({"messages": user("Say hello."), "max_completion_tokens": 2})).await;
    assert_eq!(v["usage"]["completion_tokens"], 2);
    let v = s.chat(json!({"messages": user("Say hello."), "stop": ["Ünï"]})).await;
    assert_eq!(v["choices"][0]["finish_reason"], "stop");
    assert_eq!(v["choices"][0]["message"]["content"], "Hello there!");
    let v = s.chat(json!({"messages": user("Say hello."), "stop": "there"})).await;
    assert_eq!(v["choices"][0]["message"]["content"], "Hello");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn text_completions_whole_streamed_stopped_and_with_logprobs() {
    let s = scripted().await;
    let body = json!({"model": "x", "prompt": "[[count]] Count:", "temperature": 0});
    let (status, v) = s.post("/v1/completions", &body).await;
    assert_eq!(status, 200, "{v}");
    check_envelope(&v, "text_completion", "cmpl-");
    assert_eq!(v["choices"][0]["text"], " one two three four five six seven eight nine ten.");
    assert_eq!(v["choices"][0]["finish_reason"], "stop");
    assert_eq!(v["usage"]["prompt_tokens"].as_u64().unwrap() as usize, tokenizer().encode("[[count]] Count:").unwrap().len());
    let mut sb = body.clone();
    sb["stream"] = json!(true);
    sb["stream_options"] = json!({"include_usage": true});
    let chunks = s.stream_chunks("/v1/completions", &sb).await;
    let (usage, rest) = chunks.split_last().unwrap();
    for c in rest {
        check_envelope(c, "text_completion", "cmpl-");
    }
    let text: String = rest.iter().filter_map(|c| c["choices"][0]["text"].as_str()).collect();
    assert_eq!(text, v["choices"][0]["text"].as_str().unwrap());
    assert_eq!(rest.last().unwrap()["choices"][0]["finish_reason"], "stop");
    assert_eq!(usage["usage"]["completion_tokens"], v["usage"]["completion_tokens"]);
    assert_eq!(usage["usage"]["prompt_tokens"], v["usage"]["prompt_tokens"]);

    let (_, v) = s.post("/v1/completions", &json!({"prompt": ["[[count]] Count:"], "max_tokens": 3})).await;
    assert_eq!(v["choices"][0]["finish_reason"], "length");
    assert_eq!(v["choices"][0]["text"], " one two three");
    let (_, v) = s.post("/v1/completions", &json!({"prompt": "[[count]] Count:", "stop": [" five", "nine"]})).await;
    assert_eq!(v["choices"][0]["text"], " one two three four");
    assert_eq!(v["choices"][0]["finish_reason"], "stop");

    // logprobs (an integer here): OpenAI's legacy object of parallel lists.
    let (status, v) = s.post("/v1/completions", &json!({"prompt": "[[count]] Count:", "max_tokens": 4, "logprobs": 2})).await;
    assert_eq!(status, 200, "{v}");
    let lp = &v["choices"][0]["logprobs"];
    let tokens = lp["tokens"].as_array().unwrap_or_else(|| panic!("legacy logprobs object expected: {lp}"));
    assert_eq!(tokens.len(), 4);
    let joined: String = tokens.iter().map(|t| t.as_str().unwrap()).collect();
    assert_eq!(joined, v["choices"][0]["text"].as_str().unwrap());
    assert_eq!(lp["token_logprobs"].as_array().unwrap().len(), 4);
    assert!(lp["token_logprobs"].as_array().unwrap().iter().all(|x| x.as_f64().unwrap() > -1e-3));
    let top = lp["top_logprobs"].as_array().unwrap();
    assert_eq!(top.len(), 4);
    assert_eq!(top[0].as_object().unwrap().len(), 2, "{lp}");
    assert_eq!(lp["text_offset"].as_array().unwrap().len(), 4);
    let mut sb = json!({"prompt": "[[count]] Count:", "max_tokens": 4, "logprobs": 1, "stream": true});
    let chunks = s.stream_chunks("/v1/completions", &sb).await;
    let n: usize = chunks.iter().filter_map(|c| c["choices"][0]["logprobs"]["tokens"].as_array()).map(Vec::len).sum();
    assert_eq!(n, 4, "{chunks:?}");
    sb["echo"] = json!(true);
    let (status, v) = s.post("/v1/completions", &sb).await;
    assert_error(status, &v, 400, Some("echo"));
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn chat_logprobs_whole_and_streamed() {
    let s = scripted().await;
    let body = json!({"messages": user("Say hello."), "logprobs": true, "top_logprobs": 3, "max_tokens": 6});
    let v = s.chat(body.clone()).await;
    let lp = v["choices"][0]["logprobs"]["content"].as_array().unwrap_or_else(|| panic!("{v}"));
    assert_eq!(lp.len(), 6);
    for e in lp {
        assert!(e["token"].is_string() && e["bytes"].is_array());
        // The scripted logits make each token certain.
        assert!(e["logprob"].as_f64().unwrap() > -1e-3, "{e}");
        let top = e["top_logprobs"].as_array().unwrap();
        assert_eq!(top.len(), 3);
        assert_eq!(top[0]["token"], e["token"]);
    }
    let mut sb = body;
    sb["stream"] = json!(true);
    let chunks = s.stream_chunks("/v1/chat/completions", &sb).await;
    let streamed: Vec<Value> = chunks
        .iter()
        .filter_map(|c| c["choices"][0]["logprobs"]["content"].as_array())
        .flatten()
        .cloned()
        .collect();
    assert_eq!(streamed.len(), 6);
    let t1: Vec<&Value> = lp.iter().map(|e| &e["token"]).collect();
    let t2: Vec<&Value> = streamed.iter().map(|e| &e["token"]).collect();
    assert_eq!(t1, t2);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn tool_choice_none_required_and_named() {
    let s = scripted().await;
    let ask = |tc: Value, tools: Value| json!({"messages": user("What's the weather in Paris?"), "tools": tools, "tool_choice": tc});
    let auto = s.chat(ask(json!("auto"), json!([weather_tool()]))).await;
    assert_eq!(auto["choices"][0]["finish_reason"], "tool_calls");

    // none: the tools leave the prompt, and no call comes back.
    let none = s.chat(ask(json!("none"), json!([weather_tool()]))).await;
    let m = &none["choices"][0]["message"];
    assert!(m.get("tool_calls").is_none_or(|t| t.as_array().is_none_or(Vec::is_empty)), "{none}");
    assert_eq!(none["choices"][0]["finish_reason"], "stop");
    assert!(none["usage"]["prompt_tokens"].as_u64() < auto["usage"]["prompt_tokens"].as_u64());

    // required: the answer is forced to open a call (the reasoning is closed first).
    let req = s.chat(ask(json!("required"), json!([weather_tool()]))).await;
    let m = &req["choices"][0]["message"];
    assert_eq!(req["choices"][0]["finish_reason"], "tool_calls", "{req}");
    assert_eq!(m["tool_calls"][0]["function"]["name"], "get_weather");
    assert_eq!(m["tool_calls"][0]["function"]["arguments"], r#"{"city":"Paris & <Lyon>"}"#);
    assert!(m.get("reasoning_content").is_none_or(Value::is_null), "{req}");

    // named: the call is to that function, even one the "model" would not have chosen.
    let named = s
        .chat(ask(json!({"type": "function", "function": {"name": "get_time"}}), json!([weather_tool(), time_tool()])))
        .await;
    let m = &named["choices"][0]["message"];
    assert_eq!(m["tool_calls"].as_array().unwrap().len(), 1, "{named}");
    assert_eq!(m["tool_calls"][0]["function"]["name"], "get_time");
    assert_eq!(named["choices"][0]["finish_reason"], "tool_calls");

    // Streamed, the forced call arrives like any other: index, id and name first.
    let mut sb = ask(json!({"type": "function", "function": {"name": "get_weather"}}), json!([weather_tool()]));
    sb["stream"] = json!(true);
    let chunks = s.stream_chunks("/v1/chat/completions", &sb).await;
    let first_call = chunks.iter().find_map(|c| c["choices"][0]["delta"]["tool_calls"].as_array().cloned()).unwrap();
    assert_eq!(first_call[0]["index"], 0);
    assert_eq!(first_call[0]["function"]["name"], "get_weather");
    assert!(first_call[0]["id"].is_string());
    let args: String = chunks
        .iter()
        .filter_map(|c| c["choices"][0]["delta"]["tool_calls"][0]["function"]["arguments"].as_str())
        .collect();
    assert_eq!(args, r#"{"city":"Paris & <Lyon>"}"#);
    assert_eq!(chunks.last().unwrap()["choices"][0]["finish_reason"], "tool_calls");

    // A call the request cannot satisfy is a 400 naming tool_choice.
    let (st, v) = s.post("/v1/chat/completions", &ask(json!({"type": "function", "function": {"name": "nope"}}), json!([weather_tool()]))).await;
    assert_error(st, &v, 400, Some("tool_choice"));
    let (st, v) = s.post("/v1/chat/completions", &json!({"messages": user("hi"), "tool_choice": "required"})).await;
    assert_error(st, &v, 400, Some("tool_choice"));
    let (st, v) = s.post("/v1/chat/completions", &ask(json!("sometimes"), json!([weather_tool()]))).await;
    assert_error(st, &v, 400, Some("tool_choice"));
    s.assert_healthy().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn multi_turn_tool_conversation_feeds_back_and_hits_the_cache() {
    let s = scripted().await;
    let mut messages = vec![json!({"role": "user", "content": "What's the weather in Paris?"})];
    let mut total_prefilled = 0;
    for turn in 0..4 {
        let body = json!({"messages": messages, "tools": [weather_tool()]});
        let v = s.chat(body.clone()).await;
        let u = &v["usage"];
        let (prompt, cached) = (u["prompt_tokens"].as_u64().unwrap(), u["prompt_tokens_details"]["cached_tokens"].as_u64().unwrap());
        assert_eq!(prompt as usize, prompt_tokens(&body));
        if turn > 0 {
            assert!(cached > 0, "turn {turn}: no cache hit: {u}");
        }
        total_prefilled += prompt - cached;
        let mut msg = v["choices"][0]["message"].clone();
        let id = msg["tool_calls"][0]["id"].as_str().unwrap().to_string();
        msg.as_object_mut().unwrap().remove("reasoning_content");
        messages.push(msg);
        messages.push(json!({"role": "tool", "tool_call_id": id, "content": format!("{{\"temp\": {}}}", 20 + turn)}));
    }
    assert_eq!(s.metric("lily_prefilled_tokens_total").await as u64, total_prefilled);
    assert!(s.metric("lily_cache_hits_total").await >= 3.0);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn models_health_and_metrics() {
    let s = scripted().await;
    let (st, text) = s.get("/v1/models").await;
    assert_eq!(st, 200);
    let v: Value = serde_json::from_str(&text).unwrap();
    assert_eq!(v["object"], "list");
    assert_eq!(v["data"][0]["id"], "test-model");
    assert_eq!(v["data"][0]["object"], "model");
    assert_eq!(v["data"][0]["owned_by"], "lily");
    assert!(v["data"][0]["created"].is_u64());
    let (st, text) = s.get("/health").await;
    assert_eq!(st, 200);
    let h: Value = serde_json::from_str(&text).unwrap();
    assert_eq!(h["status"], "ok");
    assert_eq!(h["backend"], "scripted");
    s.chat(json!({"messages": user("hi"), "max_tokens": 3})).await;
    let (st, v) = s.post("/v1/chat/completions", &json!({"messages": []})).await;
    assert_eq!(st, 400, "{v}");
    let (st, m) = s.get("/metrics").await;
    assert_eq!(st, 200);
    assert_eq!(metric_value(&m, "lily_requests_total{status=\"200\"}"), Some(1.0), "{m}");
    assert_eq!(metric_value(&m, "lily_requests_total{status=\"400\"}"), Some(1.0));
    assert_eq!(metric_value(&m, "lily_generations_total"), Some(1.0));
    assert_eq!(metric_value(&m, "lily_completion_tokens_total"), Some(3.0));
    assert_eq!(metric_value(&m, "lily_queue_depth"), Some(0.0));
}

// ---------------------------------------------------------------------------------------------
// Bad requests

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn bad_requests_get_openai_errors_and_harm_nothing() {
    let mut cfg = default_config();
    cfg.ctx_size = 512;
    let (s, _) = start_scripted(cfg, Duration::ZERO).await;
    let chat = "/v1/chat/completions";
    let ok = || json!({"messages": user("hi"), "max_tokens": 2});
    let with = |k: &str, v: Value| {
        let mut b = ok();
        b[k] = v;
        b
    };
    // (path, body, param the error must name; None: any)
    let cases: Vec<(&str, Value, Option<&str>)> = vec![
        (chat, json!([1, 2]), None),
        (chat, json!("hello"), None),
        (chat, json!({}), Some("messages")),
        (chat, json!({"messages": []}), Some("messages")),
        (chat, json!({"messages": "hi"}), Some("messages")),
        (chat, json!({"messages": [42]}), Some("messages[0]")),
        (chat, json!({"messages": [{"content": "hi"}]}), Some("messages[0].role")),
        (chat, json!({"messages": [{"role": "wizard", "content": "hi"}]}), Some("messages[0].role")),
        (chat, json!({"messages": [{"role": "user", "content": 5}]}), Some("messages[0].content")),
        (chat, json!({"messages": [{"role": "system", "content": "only a system message"}]}), Some("messages")),
        (chat, with("max_tokens", json!(0)), Some("max_tokens")),
        (chat, with("max_tokens", json!(-5)), Some("max_tokens")),
        (chat, with("max_tokens", json!("10")), Some("max_tokens")),
        (chat, with("max_tokens", json!(2.5)), Some("max_tokens")),
        (chat, with("max_tokens", json!(100000)), Some("max_tokens")),
        (chat, with("max_completion_tokens", json!(0)), Some("max_completion_tokens")),
        (chat, with("n", json!(2)), Some("n")),
        (chat, with("n", json!(0)), Some("n")),
        (chat, with("stream", json!("yes")), Some("stream")),
        (chat, with("stream_options", json!(true)), Some("stream_options")),
        (chat, with("stop", json!(5)), Some("stop")),
        (chat, with("stop", json!(["a", 5])), Some("stop")),
        (chat, with("temperature", json!("hot")), Some("temperature")),
        (chat, with("temperature", json!(-1)), Some("temperature")),
        (chat, with("top_p", json!(0)), Some("top_p")),
        (chat, with("top_p", json!(1.5)), Some("top_p")),
        (chat, with("top_k", json!(-3)), Some("top_k")),
        (chat, with("top_k", json!("many")), Some("top_k")),
        (chat, with("min_p", json!(2)), Some("min_p")),
        (chat, with("repetition_penalty", json!(0)), Some("repetition_penalty")),
        (chat, with("presence_penalty", json!(5)), Some("presence_penalty")),
        (chat, with("seed", json!("abc")), Some("seed")),
        (chat, with("logit_bias", json!({"999999999": 5})), Some("logit_bias")),
        (chat, with("logit_bias", json!({"12": 500})), Some("logit_bias")),
        (chat, with("logprobs", json!(3)), Some("logprobs")),
        (chat, with("top_logprobs", json!(50)), Some("top_logprobs")),
        (chat, with("top_logprobs", json!(-1)), Some("top_logprobs")),
        (chat, with("tools", json!("get_weather")), Some("tools")),
        (chat, with("tools", json!([{"type": "function"}])), Some("tools[0].function")),
        (chat, with("tool_choice", json!(7)), Some("tool_choice")),
        (chat, with("chat_template_kwargs", json!("x")), None),
        (chat, with("response_format", json!({"type": "yaml"})), Some("response_format")),
        (chat, json!({"messages": user("hi"), "max_tokens": 0, "stream": true}), Some("max_tokens")),
        (chat, json!({"messages": [{"role": "user", "content": "hi"}, {"role": "assistant", "tool_calls": [5]}, {"role": "user", "content": "x"}]}), Some("messages[1].tool_calls[0]")),
        (chat, json!({"messages": [{"role": "user", "content": [{"type": "mystery"}]}]}), Some("messages[0].content[0].type")),
        // A prompt longer than the context (512 tokens here).
        (chat, json!({"messages": user(&"hello ".repeat(600))}), Some("messages")),
        ("/v1/completions", json!({}), Some("prompt")),
        ("/v1/completions", json!({"prompt": 5}), Some("prompt")),
        ("/v1/completions", json!({"prompt": ["a", "b"]}), Some("prompt")),
        ("/v1/completions", json!({"prompt": ""}), Some("prompt")),
        ("/v1/completions", json!({"prompt": "hi", "max_tokens": 0}), Some("max_tokens")),
        ("/v1/completions", json!({"prompt": "hi", "logprobs": true}), Some("logprobs")),
        ("/v1/completions", json!({"prompt": "hello ".repeat(600)}), Some("prompt")),
    ];
    for (path, body, param) in &cases {
        let (st, v) = s.post(path, body).await;
        assert_eq!(st, 400, "{path} {body}: expected 400, got {st}: {v}");
        assert_error_shape(&v);
        assert_eq!(v["error"]["type"], "invalid_request_error", "{body}: {v}");
        if let Some(p) = param {
            assert_eq!(v["error"]["param"].as_str(), Some(*p), "{path} {body}: {v}");
        }
    }
    // The context errors say so in `code`.
    let (_, v) = s.post(chat, &json!({"messages": user(&"hello ".repeat(600))})).await;
    assert_eq!(v["error"]["code"], "context_length_exceeded");
    let (_, v) = s.post(chat, &with("max_tokens", json!(100000))).await;
    assert_eq!(v["error"]["code"], "context_length_exceeded");
    // Not JSON, not UTF-8.
    for raw in [b"{\"messages\": [".to_vec(), b"not json at all".to_vec(), vec![b'{', 0xff, 0xfe, b'}'], Vec::new()] {
        let (st, v) = s.post_raw(chat, raw.clone()).await;
        assert_error(st, &v, 400, None);
        let msg = v["error"]["message"].as_str().unwrap();
        assert!(msg.contains("JSON") || msg.contains("UTF-8"), "{msg}");
    }
    let mut bad_utf8 = br#"{"messages": [{"role": "user", "content": "caf"#.to_vec();
    bad_utf8.extend_from_slice(&[0xc3, 0x28]);
    bad_utf8.extend_from_slice(br#""}]}"#);
    let (st, v) = s.post_raw(chat, bad_utf8).await;
    assert_error(st, &v, 400, None);
    assert!(v["error"]["message"].as_str().unwrap().contains("UTF-8"));
    // Content as a list of text parts is fine.
    s.chat(json!({"messages": [{"role": "user", "content": [{"type": "text", "text": "hi"}, {"type": "text", "text": " there"}]}], "max_tokens": 2})).await;
    // n = 1 and nulls everywhere are fine.
    s.chat(json!({"messages": user("hi"), "n": 1, "max_tokens": 2, "temperature": null, "stop": null, "tools": null, "seed": null})).await;
    s.assert_healthy().await;
    let m = s.get("/metrics").await.1;
    let errors = metric_value(&m, "lily_requests_total{status=\"400\"}").unwrap() as usize;
    assert!(errors >= cases.len(), "{m}");
    assert_eq!(metric_value(&m, "lily_generations_total"), Some(3.0), "bad requests never reach the engine");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_body_over_the_limit_is_413() {
    let mut cfg = default_config();
    cfg.max_body_bytes = 64 << 10;
    let (s, _) = start_scripted(cfg, Duration::ZERO).await;
    let big = json!({"messages": user(&"x".repeat(200 << 10))});
    let (st, v) = s.post("/v1/chat/completions", &big).await;
    assert_error(st, &v, 413, None);
    let (st, v) = s.post("/v1/completions", &json!({"prompt": "y".repeat(100 << 10)})).await;
    assert_error(st, &v, 413, None);
    // A body just under the limit is read (and then judged on its merits: too long a prompt).
    let (st, _) = s.post("/v1/completions", &json!({"prompt": "hi", "pad": "z".repeat(60 << 10), "max_tokens": 1})).await;
    assert_eq!(st, 200);
    s.assert_healthy().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn unknown_routes_are_404_and_wrong_methods_405() {
    let s = scripted().await;
    for path in ["/v1/nope", "/", "/v1/chat/completion", "/v2/models"] {
        let r = s.http.get(s.url(path)).send().await.unwrap();
        assert_eq!(r.status().as_u16(), 404, "{path}");
        let v: Value = r.json().await.unwrap();
        assert_error_shape(&v);
    }
    let r = s.http.post(s.url("/v1/embeddings")).json(&json!({"input": "x"})).send().await.unwrap();
    assert_eq!(r.status().as_u16(), 404);
    let r = s.http.get(s.url("/v1/chat/completions")).send().await.unwrap();
    assert_eq!(r.status().as_u16(), 405);
    let v: Value = r.json().await.unwrap_or(Value::Null);
    assert_error_shape(&v);
    s.assert_healthy().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_api_key_guards_v1_and_metrics_but_not_health() {
    let mut cfg = default_config();
    cfg.api_key = Some("sekrit-key".into());
    let (s, _) = start_scripted(cfg, Duration::ZERO).await;
    let good = json!({"messages": user("hi"), "max_tokens": 2});
    // With the right key (Server sends it).
    assert_eq!(s.get("/v1/models").await.0, 200);
    s.chat(good.clone()).await;
    assert_eq!(s.get("/metrics").await.0, 200);
    // Without, with a wrong one, with another scheme.
    for auth in [None, Some("Bearer wrong"), Some("sekrit-key"), Some("Basic c2Vrcml0LWtleQ=="), Some("Bearer ")] {
        for (method, path) in [("GET", "/v1/models"), ("POST", "/v1/chat/completions"), ("POST", "/v1/completions"), ("GET", "/metrics")] {
            let mut rb = if method == "GET" { s.http.get(s.url(path)) } else { s.http.post(s.url(path)).json(&good) };
            if let Some(a) = auth {
                rb = rb.header("authorization", a);
            }
            let r = rb.send().await.unwrap();
            let st = r.status().as_u16();
            let v: Value = r.json().await.unwrap_or(Value::Null);
            assert_error(st, &v, 401, None);
            assert_eq!(v["error"]["type"], "authentication_error");
            assert_eq!(v["error"]["code"], "invalid_api_key");
        }
    }
    // Auth comes before the body is looked at.
    let r = s.http.post(s.url("/v1/chat/completions")).body("garbage").send().await.unwrap();
    assert_eq!(r.status().as_u16(), 401);
    // /health stays open.
    let r = s.http.get(s.url("/health")).send().await.unwrap();
    assert_eq!(r.status().as_u16(), 200);
    s.assert_healthy().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_panic_in_the_engine_fails_one_request_not_the_server() {
    let s = scripted().await;
    let (st, v) = s.post("/v1/chat/completions", &json!({"messages": user("[[panic]]")})).await;
    assert_error(st, &v, 500, None);
    let chunks = s.stream("/v1/chat/completions", &json!({"messages": user("[[panic]]"), "stream": true})).await;
    assert_eq!(chunks.last().map(String::as_str), Some("[DONE]"));
    assert!(chunks.iter().any(|c| c.contains("\"error\"")), "{chunks:?}");
    s.assert_healthy().await;
    s.assert_healthy().await;
}

//! The real CPU backend with a tiny random checkpoint (the real vocabulary, tokenizer and chat
//! template) behind the server: greedy decoding is deterministic, seeded sampling reproducible,
//! streaming gives exactly what a whole response gives, logprobs are there, and a 20-turn agent
//! conversation reuses the prefix cache every turn while answering token for token what a server
//! without a cache answers.

mod common;

use common::*;
use lily_template::ChatTemplate;
use serde_json::{json, Value};

/// The text of a chat answer: reasoning and content (a random model rarely closes its thinking).
fn answer(v: &Value) -> (Value, Value) {
    let m = &v["choices"][0]["message"];
    (m["reasoning_content"].clone(), m["content"].clone())
}

fn usage_without_cache(v: &Value) -> (u64, u64, u64) {
    let u = &v["usage"];
    (u["prompt_tokens"].as_u64().unwrap(), u["completion_tokens"].as_u64().unwrap(), u["total_tokens"].as_u64().unwrap())
}

/// A streamed chat answer put together: (reasoning, content, finish_reason, usage chunk).
fn assemble(chunks: &[Value]) -> (String, String, Value, Value) {
    let (mut r, mut c) = (String::new(), String::new());
    let mut finish = Value::Null;
    let mut usage = Value::Null;
    for ch in chunks {
        if let Some(u) = ch.get("usage").filter(|u| !u.is_null()) {
            usage = u.clone();
        }
        let Some(choice) = ch["choices"].get(0) else { continue };
        r.push_str(choice["delta"]["reasoning_content"].as_str().unwrap_or(""));
        c.push_str(choice["delta"]["content"].as_str().unwrap_or(""));
        if !choice["finish_reason"].is_null() {
            finish = choice["finish_reason"].clone();
        }
    }
    (r, c, finish, usage)
}

fn opt_text(s: String) -> Value {
    if s.is_empty() { Value::Null } else { Value::String(s) }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn greedy_is_deterministic_and_streaming_matches_whole() {
    let s = start_cpu(default_config()).await;
    let body = json!({"messages": user("Tell me about the sea."), "temperature": 0, "max_tokens": 12});
    let a = s.chat(body.clone()).await;
    let b = s.chat(body.clone()).await;
    assert_eq!(answer(&a), answer(&b));
    assert_eq!(usage_without_cache(&a), usage_without_cache(&b));
    assert_eq!(a["usage"]["completion_tokens"], 12);
    assert_eq!(a["choices"][0]["finish_reason"], "length");
    assert_eq!(a["system_fingerprint"].as_str(), Some("lily-0.1.0-cpu"));
    // The second identical request resumed from the cache, and still gave the same answer.
    assert!(b["usage"]["prompt_tokens_details"]["cached_tokens"].as_u64().unwrap() > 0);
    let mut sb = body.clone();
    sb["stream"] = json!(true);
    sb["stream_options"] = json!({"include_usage": true});
    let chunks = s.stream_chunks("/v1/chat/completions", &sb).await;
    let (r, c, finish, usage) = assemble(&chunks);
    assert_eq!((opt_text(r), opt_text(c)), answer(&a), "streamed text = whole text");
    assert_eq!(finish, a["choices"][0]["finish_reason"]);
    assert_eq!(
        (usage["prompt_tokens"].as_u64().unwrap(), usage["completion_tokens"].as_u64().unwrap(), usage["total_tokens"].as_u64().unwrap()),
        usage_without_cache(&a),
        "streamed usage = whole usage"
    );
    // Text completions too.
    let cb = json!({"prompt": "Once upon a time", "temperature": 0, "max_tokens": 10});
    let (_, x) = s.post("/v1/completions", &cb).await;
    let (_, y) = s.post("/v1/completions", &cb).await;
    assert_eq!(x["choices"][0]["text"], y["choices"][0]["text"]);
    let mut scb = cb.clone();
    scb["stream"] = json!(true);
    let chunks = s.stream_chunks("/v1/completions", &scb).await;
    let text: String = chunks.iter().filter_map(|c| c["choices"][0]["text"].as_str()).collect();
    assert_eq!(text, x["choices"][0]["text"].as_str().unwrap());
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn seeded_sampling_is_reproducible_and_the_seed_matters() {
    let s = start_cpu(default_config()).await;
    let ask = |seed: u64| json!({"messages": user("Write a poem."), "temperature": 1.0, "top_p": 0.95, "top_k": 50, "seed": seed, "max_tokens": 16});
    let a = s.chat(ask(42)).await;
    let b = s.chat(ask(42)).await;
    assert_eq!(answer(&a), answer(&b), "same seed, same answer");
    let c = s.chat(ask(43)).await;
    let d = s.chat(ask(44)).await;
    assert!(answer(&a) != answer(&c) || answer(&a) != answer(&d), "different seeds gave the same answer");
    // Streamed with the same seed: the same tokens.
    let mut sb = ask(42);
    sb["stream"] = json!(true);
    let (r, c2, _, _) = assemble(&s.stream_chunks("/v1/chat/completions", &sb).await);
    assert_eq!((opt_text(r), opt_text(c2)), answer(&a));
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn logprobs_are_reported_for_every_token() {
    let s = start_cpu(default_config()).await;
    let v = s.chat(json!({"messages": user("Hi"), "temperature": 0, "max_tokens": 8, "logprobs": true, "top_logprobs": 4})).await;
    let lp = v["choices"][0]["logprobs"]["content"].as_array().unwrap();
    assert_eq!(lp.len(), 8);
    for e in lp {
        let l = e["logprob"].as_f64().unwrap();
        assert!(l <= 0.0 && l.is_finite());
        let top = e["top_logprobs"].as_array().unwrap();
        assert_eq!(top.len(), 4);
        let tl: Vec<f64> = top.iter().map(|t| t["logprob"].as_f64().unwrap()).collect();
        assert!(tl.windows(2).all(|w| w[0] >= w[1]), "best first: {tl:?}");
        // Greedy: the chosen token is the most likely one.
        assert!((tl[0] - l).abs() < 1e-5, "{e}");
    }
    let (_, c) = s.post("/v1/completions", &json!({"prompt": "Hello", "temperature": 0, "max_tokens": 5, "logprobs": 3})).await;
    let lp = &c["choices"][0]["logprobs"];
    assert_eq!(lp["tokens"].as_array().unwrap().len(), 5, "{c}");
    assert_eq!(lp["top_logprobs"][0].as_object().unwrap().len(), 3);
}

/// Prompt tokens of a chat request rendered without the generation prompt (the conversation
/// history the next turn shares).
fn history_tokens(body: &Value) -> usize {
    let mut b = body.clone();
    b["add_generation_prompt"] = json!(false);
    let text = ChatTemplate::builtin().render_request(&b).unwrap();
    tokenizer().encode(&text).unwrap().len()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_twenty_turn_agent_conversation_hits_the_cache_and_matches_cold_runs() {
    let warm = start_cpu(default_config()).await;
    let mut cold_cfg = default_config();
    cold_cfg.cache_bytes = 0;
    let cold = start_cpu(cold_cfg).await;

    let mut messages = vec![
        json!({"role": "system", "content": "You are a weather agent. Call tools until you know the answer."}),
        json!({"role": "user", "content": "Compare the weather in twenty cities, one call at a time."}),
    ];
    let mut prev_history = 0usize;
    let (mut warm_prefilled, mut cold_prefilled) = (0u64, 0u64);
    for turn in 1..=20 {
        let body = json!({
            "messages": messages,
            "tools": [weather_tool()],
            "tool_choice": {"type": "function", "function": {"name": "get_weather"}},
            "temperature": 0,
            "max_tokens": 6,
            "logprobs": true,
            "top_logprobs": 5,
        });
        let w = warm.chat(body.clone()).await;
        let c = cold.chat(body.clone()).await;
        let (wu, cu) = (&w["usage"], &c["usage"]);
        let prompt = wu["prompt_tokens"].as_u64().unwrap();
        let cached = wu["prompt_tokens_details"]["cached_tokens"].as_u64().unwrap();
        assert_eq!(cu["prompt_tokens"].as_u64().unwrap(), prompt);
        assert_eq!(cu["prompt_tokens_details"]["cached_tokens"], 0, "the cold server has no cache");
        warm_prefilled += prompt - cached;
        cold_prefilled += prompt;
        if turn >= 2 {
            // At least the whole previous conversation came from the cache: only this turn's new
            // tokens (the last answer as the template writes it, the tool result, the headers) ran.
            assert!(cached as usize >= prev_history, "turn {turn}: cached {cached} < previous history {prev_history}");
            assert!(cached < prompt);
            let new = prompt - cached;
            assert!(new <= prompt - prev_history as u64, "turn {turn}");
            assert!(new < 80, "turn {turn}: {new} new tokens prefilled of {prompt}");
        }
        // Token for token what the cold server answers.
        let (wl, cl) = (&w["choices"][0]["logprobs"]["content"], &c["choices"][0]["logprobs"]["content"]);
        let toks = |l: &Value| l.as_array().unwrap().iter().map(|e| e["token"].as_str().unwrap().to_string()).collect::<Vec<_>>();
        assert_eq!(toks(wl), toks(cl), "turn {turn}: tokens differ from the cold run");
        // And the distributions agree (chunking the prefill differently moves them by ~1e-6).
        for (a, b) in wl.as_array().unwrap().iter().zip(cl.as_array().unwrap()) {
            let (x, y) = (a["logprob"].as_f64().unwrap(), b["logprob"].as_f64().unwrap());
            assert!((x - y).abs() < 1e-4, "turn {turn}: logprobs {x} vs {y}");
            let top = |e: &Value| -> Vec<(String, f64)> {
                e["top_logprobs"].as_array().unwrap().iter().map(|t| (t["token"].as_str().unwrap().to_string(), t["logprob"].as_f64().unwrap())).collect()
            };
            let (ta, tb) = (top(a), top(b));
            assert_eq!(ta.len(), 5);
            let mut common = 0;
            for (t, x) in &ta {
                if let Some((_, y)) = tb.iter().find(|(u, _)| u == t) {
                    common += 1;
                    assert!((x - y).abs() < 1e-4, "turn {turn}: top logprob of {t:?}: {x} vs {y}");
                }
            }
            assert!(common >= 4, "turn {turn}: top tokens {ta:?} vs {tb:?}");
        }
        let (wm, cm) = (&w["choices"][0]["message"], &c["choices"][0]["message"]);
        assert_eq!(wm["content"], cm["content"], "turn {turn}");
        assert_eq!(wm["reasoning_content"], cm["reasoning_content"], "turn {turn}");
        assert_eq!(wu["completion_tokens"], cu["completion_tokens"]);
        assert_eq!(w["choices"][0]["finish_reason"], c["choices"][0]["finish_reason"]);
        let calls = wm["tool_calls"].as_array().unwrap_or_else(|| panic!("turn {turn}: no tool call: {w}"));
        assert_eq!(calls[0]["function"]["name"], "get_weather");
        assert_eq!(calls[0]["function"]["arguments"], cm["tool_calls"][0]["function"]["arguments"]);

        // The agent loop: the answer goes back as history, then the tool's result.
        prev_history = history_tokens(&body);
        let mut msg = wm.clone();
        msg.as_object_mut().unwrap().remove("logprobs");
        let id = calls[0]["id"].as_str().unwrap().to_string();
        messages.push(msg);
        messages.push(json!({"role": "tool", "tool_call_id": id, "content": format!("{{\"city\": \"city {turn}\", \"temp_c\": {}}}", 10 + turn)}));
    }
    // The engine's own count agrees: the warm server prefilled only the new tokens.
    assert_eq!(warm.metric("lily_prefilled_tokens_total").await as u64, warm_prefilled);
    assert_eq!(cold.metric("lily_prefilled_tokens_total").await as u64, cold_prefilled);
    assert!(warm_prefilled * 4 < cold_prefilled, "warm {warm_prefilled} vs cold {cold_prefilled}");
    assert!(warm.metric("lily_cache_hits_total").await >= 19.0);
    eprintln!("20 turns: prefilled {warm_prefilled} tokens with the cache, {cold_prefilled} without");
}

//! One engine, many clients, over real HTTP: a client that hangs up (mid-stream or waiting for a
//! whole answer) cancels its generation at once; the queue is FIFO and bounded (429 beyond it, 503
//! after waiting too long); a queued request whose client left is skipped; bad requests and
//! errors never disturb a generation in progress. The scripted backend is slowed down (a sleep per
//! decoded token) so that the timing is under the test's control, and counts its forward calls.

mod common;

use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use common::*;
use serde_json::{json, Value};

const TOKEN_DELAY: Duration = Duration::from_millis(20);

fn endless(max_tokens: usize, stream: bool) -> Value {
    json!({"messages": user("[[endless]] go on forever"), "max_tokens": max_tokens, "stream": stream, "temperature": 0})
}

/// Starts a stream and reads its first `n` events (the engine is then busy with it).
async fn start_stream(s: &Server, body: &Value, n: usize) -> SseReader {
    let r = s.http.post(s.url("/v1/chat/completions")).json(body).send().await.unwrap();
    assert_eq!(r.status().as_u16(), 200);
    let mut sse = SseReader::new(r);
    for _ in 0..n {
        sse.next().await.expect("an event");
    }
    sse
}

/// Waits until the forward calls stop (no new one for a while); returns how many there were.
async fn wait_until_idle(forwards: &AtomicUsize) -> usize {
    let t = Instant::now();
    loop {
        let a = forwards.load(Ordering::SeqCst);
        tokio::time::sleep(TOKEN_DELAY * 8).await;
        let b = forwards.load(Ordering::SeqCst);
        if a == b {
            return b;
        }
        assert!(t.elapsed() < Duration::from_secs(5), "the engine never stopped ({b} forward calls)");
    }
}

async fn queue_depth(s: &Server) -> u64 {
    let v: Value = serde_json::from_str(&s.get("/health").await.1).unwrap();
    v["queue_depth"].as_u64().unwrap()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_client_that_hangs_up_mid_stream_cancels_its_generation() {
    let (s, forwards) = start_scripted(default_config(), TOKEN_DELAY).await;
    // 2000 tokens would take 40 s.
    let sse = start_stream(&s, &endless(2000, true), 4).await;
    assert_eq!(s.metric("lily_engine_busy").await, 1.0);
    let t = Instant::now();
    drop(sse);
    let n = wait_until_idle(&forwards).await;
    assert!(n < 40, "generation went on after the client left: {n} forward calls");
    assert!(t.elapsed() < Duration::from_secs(2));
    assert_eq!(s.metric("lily_engine_busy").await, 0.0);
    assert_eq!(s.metric("lily_queue_depth").await, 0.0);
    // The next request starts at once and gets its whole answer.
    let t = Instant::now();
    let v = s.chat(json!({"messages": user("Say hello.")})).await;
    assert_eq!(v["choices"][0]["message"]["content"], "Hello there! Ünïcödé 🌷 works.");
    assert!(t.elapsed() < Duration::from_secs(3), "{:?}", t.elapsed());
    assert_eq!(s.metric("lily_generations_total").await, 2.0);
    assert!(s.metric("lily_completion_tokens_total").await < 80.0);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_client_that_gives_up_on_a_whole_response_cancels_it() {
    let (s, forwards) = start_scripted(default_config(), TOKEN_DELAY).await;
    let r = s
        .http
        .post(s.url("/v1/chat/completions"))
        .json(&endless(2000, false))
        .timeout(Duration::from_millis(300))
        .send()
        .await;
    assert!(r.is_err(), "the request should have timed out");
    let n = wait_until_idle(&forwards).await;
    assert!(n < 60, "generation went on after the client left: {n} forward calls");
    assert_eq!(s.metric("lily_engine_busy").await, 0.0);
    s.assert_healthy().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_queue_is_fifo_and_bounded_with_429_beyond_it() {
    let mut cfg = default_config();
    cfg.max_queue = 2;
    let (s, _) = start_scripted(cfg, TOKEN_DELAY).await;
    let s = Arc::new(s);
    // A runs (about 0.6 s)...
    let mut a = start_stream(&s, &endless(30, true), 2).await;
    // ...B and C wait, in that order.
    let done = Arc::new(Mutex::new(Vec::new()));
    let mut waiting = Vec::new();
    for (i, name) in ["B", "C"].into_iter().enumerate() {
        let (s2, done2) = (Arc::clone(&s), Arc::clone(&done));
        waiting.push(tokio::spawn(async move {
            let (st, v) = s2.post("/v1/chat/completions", &json!({"messages": user("Say hello."), "max_tokens": 3})).await;
            done2.lock().unwrap().push(name);
            (st, v)
        }));
        wait_for("the request to be queued", Duration::from_secs(5), async || queue_depth(&s).await == i as u64 + 1).await;
    }
    // D finds the queue full, at once.
    let t = Instant::now();
    let (st, v) = s.post("/v1/chat/completions", &json!({"messages": user("Say hello.")})).await;
    assert_error(st, &v, 429, None);
    assert_eq!(v["error"]["type"], "rate_limit_error");
    assert!(t.elapsed() < Duration::from_millis(500));
    let (st, v) = s.post("/v1/completions", &json!({"prompt": "x"})).await;
    assert_error(st, &v, 429, None);
    // Bad requests are still judged while the engine is busy, and do not disturb it.
    for _ in 0..5 {
        let (st, _) = s.post("/v1/chat/completions", &json!({"messages": []})).await;
        assert_eq!(st, 400);
    }
    assert_eq!(s.get("/health").await.0, 200);
    // A finishes intact, then B, then C.
    let mut events = 0;
    let mut text = String::new();
    while let Some(d) = a.next().await {
        events += 1;
        if d != "[DONE]" {
            let c: Value = serde_json::from_str(&d).unwrap();
            text.push_str(c["choices"][0]["delta"]["reasoning_content"].as_str().unwrap_or(""));
        }
    }
    assert!(events > 20);
    // 30 tokens, the first of them read above (with the role chunk).
    assert_eq!(text.matches("la").count(), 29, "A's stream: {text:?}");
    for w in waiting {
        let (st, v) = w.await.unwrap();
        assert_eq!(st, 200, "{v}");
    }
    assert_eq!(*done.lock().unwrap(), ["B", "C"]);
    assert_eq!(s.metric("lily_requests_total{status=\"429\"}").await, 2.0);
    s.assert_healthy().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_request_that_waits_too_long_gets_503() {
    let mut cfg = default_config();
    cfg.queue_timeout = Duration::from_millis(150);
    let (s, _) = start_scripted(cfg, TOKEN_DELAY).await;
    let s = Arc::new(s);
    let mut a = start_stream(&s, &endless(25, true), 2).await;
    let s2 = Arc::clone(&s);
    let whole = tokio::spawn(async move { s2.post("/v1/chat/completions", &json!({"messages": user("Say hello.")})).await });
    wait_for("the request to be queued", Duration::from_secs(5), async || queue_depth(&s).await == 1).await;
    let s3 = Arc::clone(&s);
    let streamed = tokio::spawn(async move {
        s3.stream("/v1/chat/completions", &json!({"messages": user("Say hello."), "stream": true})).await
    });
    wait_for("the stream to be queued", Duration::from_secs(5), async || queue_depth(&s).await == 2).await;
    // A goes on for about half a second: B and C have waited too long when the engine gets to them.
    while a.next().await.is_some() {}
    let (st, v) = whole.await.unwrap();
    assert_error(st, &v, 503, None);
    assert_eq!(v["error"]["type"], "server_error");
    // A stream has already answered 200: the error comes as an event, then [DONE].
    let data = streamed.await.unwrap();
    assert_eq!(data.len(), 2, "{data:?}");
    assert_error_shape(&serde_json::from_str(&data[0]).unwrap());
    assert_eq!(data[1], "[DONE]");
    s.assert_healthy().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_queued_request_whose_client_left_is_skipped() {
    let (s, forwards) = start_scripted(default_config(), TOKEN_DELAY).await;
    // A runs for about 0.8 s.
    let a = start_stream(&s, &endless(40, true), 2).await;
    // B gives up while it waits.
    let r = s
        .http
        .post(s.url("/v1/chat/completions"))
        .json(&endless(500, false))
        .timeout(Duration::from_millis(150))
        .send()
        .await;
    assert!(r.is_err());
    let mut a = a;
    while a.next().await.is_some() {}
    wait_until_idle(&forwards).await;
    assert_eq!(s.metric("lily_generations_total").await, 1.0, "B must never have run");
    assert_eq!(s.metric("lily_queue_depth").await, 0.0);
    s.assert_healthy().await;
    assert_eq!(s.metric("lily_generations_total").await, 2.0);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn many_clients_at_once_each_get_their_own_answer() {
    let mut cfg = default_config();
    cfg.max_queue = 16;
    let (s, _) = start_scripted(cfg, Duration::from_millis(1)).await;
    let s = Arc::new(s);
    let mut tasks = Vec::new();
    for i in 0..8 {
        let s2 = Arc::clone(&s);
        tasks.push(tokio::spawn(async move {
            if i % 2 == 0 {
                let (st, v) = s2.post("/v1/completions", &json!({"prompt": "[[count]] Count:", "max_tokens": 2 + i})).await;
                assert_eq!(st, 200, "{v}");
                assert_eq!(v["usage"]["completion_tokens"], 2 + i);
                v["choices"][0]["text"].as_str().unwrap().to_string()
            } else {
                let chunks = s2
                    .stream_chunks("/v1/chat/completions", &json!({"messages": user("What's the weather?"), "tools": [weather_tool()], "stream": true}))
                    .await;
                let args: String = chunks
                    .iter()
                    .filter_map(|c| c["choices"][0]["delta"]["tool_calls"][0]["function"]["arguments"].as_str())
                    .collect();
                args
            }
        }));
    }
    let words = [" one", " two", " three", " four", " five", " six", " seven", " eight", " nine", " ten."];
    for (i, t) in tasks.into_iter().enumerate() {
        let out = t.await.unwrap();
        if i % 2 == 0 {
            assert_eq!(out, words[..2 + i].concat());
        } else {
            assert_eq!(out, r#"{"city":"Paris & <Lyon>"}"#);
        }
    }
}

//! Shared pieces of the server's end-to-end tests: the real server started in-process on
//! 127.0.0.1:0 and spoken to over real HTTP (reqwest), a scripted backend that makes a chosen text
//! certain, the real tokenizer, a tiny random checkpoint for the CPU backend, an SSE reader and
//! the OpenAI error-shape check.
#![allow(dead_code)]

use std::io::Read;
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::{Arc, OnceLock};
use std::time::{Duration, Instant};

use futures::StreamExt;
use lily_model::{Backend, BackendError, Logits, ModelConfig};
use lily_sampler::Defaults;
use lily_server::{ServedModel, ServerConfig};
use lily_template::ChatTemplate;
use lily_tokenizer::Tokenizer;
use serde_json::{json, Value};

pub fn manifest() -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR"))
}

/// The real Qwen3.5/3.6 tokenizer (assets/qwen3.6-tokenizer.json.gz), loaded once per test binary.
pub fn tokenizer() -> Tokenizer {
    static TOK: OnceLock<Tokenizer> = OnceLock::new();
    TOK.get_or_init(|| {
        let gz = manifest().join("../../assets/qwen3.6-tokenizer.json.gz");
        let file = std::fs::File::open(&gz).unwrap_or_else(|e| panic!("{}: {e}", gz.display()));
        let mut json = Vec::new();
        flate2::read::GzDecoder::new(file).read_to_end(&mut json).unwrap();
        let config = br#"{"add_bos_token": false, "bos_token": null, "eos_token": "<|im_end|>", "pad_token": "<|endoftext|>", "split_special_tokens": false}"#;
        Tokenizer::from_json_bytes_with_config(&json, Some(config)).unwrap()
    })
    .clone()
}

pub fn token_id(t: &str) -> u32 {
    tokenizer().token_id(t).unwrap_or_else(|| panic!("no token {t}"))
}

pub fn default_config() -> ServerConfig {
    ServerConfig {
        model_id: "test-model".into(),
        demo: false,
        api_key: None,
        ctx_size: 4096,
        max_queue: 8,
        queue_timeout: Duration::from_secs(60),
        max_body_bytes: 1 << 20,
        cache_bytes: 256 << 20,
        default_max_tokens: None,
        body_timeout: Duration::from_secs(60),
        log: None,
    }
}

// ---------------------------------------------------------------------------------------------
// The scripted backend

/// The scripted answer to a prompt that offers tools: reasoning, content, one tool call whose
/// argument needs escaping and holds markup-like characters, then the end of the turn.
pub const TOOL_SCRIPT: &str = "<think>\nThe user wants the weather.\n</think>\n\nLet me check.<tool_call>\n<function=get_weather>\n<parameter=city>\nParis & <Lyon>\n</parameter>\n</function>\n</tool_call><|im_end|>";
/// The scripted answer to a prompt without tools (multi-byte characters on purpose).
pub const PLAIN_SCRIPT: &str = "<think>\nJust greet.\n</think>\n\nHello there! Ünïcödé 🌷 works.<|im_end|>";
/// The scripted answer to a prompt holding `[[patch]]`: a call of a freeform tool `apply_patch`
/// whose one parameter, `input`, is a patch (as Codex's custom tool is offered to the model).
pub const PATCH_SCRIPT: &str = "<think>\nA patch.\n</think>\n\n<tool_call>\n<function=apply_patch>\n<parameter=input>\n*** Begin Patch\n*** Add File: hello.txt\n+Hello \"world\"\n*** End Patch\n</parameter>\n</function>\n</tool_call><|im_end|>";
/// Raw-prompt script (text completions): a prompt ending in "Count:" continues with it.
pub const COUNT_SCRIPT: &str = "Count: one two three four five six seven eight nine ten.<|im_end|>";

/// A backend whose "model" is a script: it looks at the text so far (prompt and generated tokens
/// decoded), finds where it stands in the script (the longest suffix of the text that occurs in
/// the script) and gives the next script token a logit of +100, every other token 0, so any
/// sampling settings produce the script. The script is chosen by the prompt: `[[endless]]`
/// repeats " la" forever, `[[count]]` is [`COUNT_SCRIPT`], a prompt with a `<tools>` section
/// gets [`TOOL_SCRIPT`], anything else [`PLAIN_SCRIPT`]. Text forced into the prompt (the
/// tool_choice prefix) is followed from wherever it matches the script. `[[panic]]` panics (a
/// bug in the engine thread).
pub struct Scripted {
    config: ModelConfig,
    tok: Tokenizer,
    /// Sleep per forward call that asks for logits (slows decoding down to test the queue).
    pub delay: Duration,
    /// Forward calls so far (shared with the test).
    pub forwards: Arc<AtomicUsize>,
}

pub fn scripted_config() -> ModelConfig {
    let cfg = lily_model::synth::builtin_config("qwen3.6-tiny").unwrap();
    let m = ModelConfig::from_json_str(&cfg.to_string(), Path::new("scripted.json")).unwrap();
    assert_eq!(m.vocab_size, 248320);
    m
}

impl Scripted {
    pub fn new(delay: Duration) -> Self {
        Scripted { config: scripted_config(), tok: tokenizer(), delay, forwards: Arc::new(AtomicUsize::new(0)) }
    }

    fn next_token(&self, seq: &[u32]) -> u32 {
        // Tokens that end in an incomplete character (a multi-byte character split over tokens)
        // are set aside: the position is found from the complete text before them, and they are
        // the first `partial` tokens of the script's rest.
        let mut partial = 0;
        let mut text = self.tok.decode(seq, false).unwrap();
        while text.ends_with('\u{FFFD}') && partial < 4 && partial < seq.len() {
            partial += 1;
            text = self.tok.decode(&seq[..seq.len() - partial], false).unwrap();
        }
        if text.contains("[[panic]]") {
            panic!("the scripted backend panics on purpose");
        }
        if text.contains("[[endless]]") {
            return self.tok.encode(" la").unwrap()[0];
        }
        let script = if text.contains("[[count]]") {
            COUNT_SCRIPT
        } else if text.contains("[[patch]]") {
            PATCH_SCRIPT
        } else if text.contains("<tools>") {
            TOOL_SCRIPT
        } else {
            PLAIN_SCRIPT
        };
        // Forced to call some function (tool_choice): the script's call, under that name.
        if script == TOOL_SCRIPT {
            if let Some(i) = text.rfind("<function=") {
                if let Some(j) = text[i..].find('>') {
                    text = format!("{}<function=get_weather{}", &text[..i], &text[i + j..]);
                }
            }
        }
        // Longest suffix of `text` that occurs in the script: if a suffix does not occur, no longer
        // one does, so grow it until it fails.
        let mut rest = script;
        let bounds: Vec<usize> = text.char_indices().map(|(i, _)| i).rev().collect();
        for start in bounds {
            let suffix = &text[start..];
            if suffix.len() > script.len() {
                break;
            }
            match script.find(suffix) {
                Some(pos) => rest = &script[pos + suffix.len()..],
                None => break,
            }
        }
        let ids = self.tok.encode(rest).unwrap();
        match ids.get(partial) {
            Some(&id) => id,
            None => self.tok.token_id("<|im_end|>").unwrap(),
        }
    }
}

impl Backend for Scripted {
    type State = Vec<u32>;

    fn name(&self) -> &'static str {
        "scripted"
    }
    fn config(&self) -> &ModelConfig {
        &self.config
    }
    fn new_state(&self) -> Vec<u32> {
        Vec::new()
    }
    fn state_len(&self, state: &Vec<u32>) -> usize {
        state.len()
    }
    fn state_bytes(&self, state: &Vec<u32>) -> usize {
        state.len() * 4 + 64
    }
    fn forward(&mut self, state: &mut Vec<u32>, tokens: &[u32], logits: Logits) -> Result<Vec<f32>, BackendError> {
        self.forwards.fetch_add(1, Ordering::SeqCst);
        let vocab = self.config.vocab_size;
        if let Some(&id) = tokens.iter().find(|&&t| t as usize >= vocab) {
            return Err(BackendError::InvalidToken { id, vocab });
        }
        state.extend_from_slice(tokens);
        match logits {
            Logits::None => Ok(Vec::new()),
            Logits::Last => {
                if !self.delay.is_zero() {
                    std::thread::sleep(self.delay);
                }
                let mut row = vec![0.0f32; vocab];
                row[self.next_token(state) as usize] = 100.0;
                Ok(row)
            }
            Logits::All => Err(BackendError::Device("the scripted backend has no teacher forcing".into())),
        }
    }
}

pub fn scripted_model(delay: Duration) -> (ServedModel<Scripted>, Arc<AtomicUsize>) {
    let backend = Scripted::new(delay);
    let forwards = Arc::clone(&backend.forwards);
    let tokenizer = tokenizer();
    let stop_ids = vec![tokenizer.token_id("<|im_end|>").unwrap(), tokenizer.token_id("<|endoftext|>").unwrap()];
    let m = ServedModel { backend, tokenizer, template: ChatTemplate::builtin(), defaults: Defaults::default(), stop_ids };
    (m, forwards)
}

// ---------------------------------------------------------------------------------------------
// A tiny random checkpoint on the CPU backend

/// A small Qwen3.6-architecture config with the real vocabulary (so the real tokenizer and chat
/// template apply): hidden 64, 4 layers (3 GDN : 1 full attention), 4 experts top 2.
pub fn tiny_config() -> Value {
    json!({
        "architectures": ["Qwen3_5MoeForConditionalGeneration"],
        "model_type": "qwen3_5_moe",
        "text_config": {
            "model_type": "qwen3_5_moe_text",
            "vocab_size": 248320,
            "hidden_size": 64,
            "num_hidden_layers": 4,
            "full_attention_interval": 4,
            "layer_types": ["linear_attention", "linear_attention", "linear_attention", "full_attention"],
            "num_attention_heads": 2,
            "num_key_value_heads": 1,
            "head_dim": 64,
            "attn_output_gate": true,
            "linear_num_key_heads": 1,
            "linear_num_value_heads": 2,
            "linear_key_head_dim": 64,
            "linear_value_head_dim": 64,
            "linear_conv_kernel_dim": 4,
            "num_experts": 4,
            "num_experts_per_tok": 2,
            "moe_intermediate_size": 64,
            "shared_expert_intermediate_size": 64,
            "max_position_embeddings": 8192,
            "rms_norm_eps": 1e-6,
            "tie_word_embeddings": false,
            "eos_token_id": 248044,
            "bos_token_id": 248044,
            "rope_parameters": {"rope_type": "default", "rope_theta": 10000000, "partial_rotary_factor": 0.25,
                "mrope_section": [4, 2, 2], "mrope_interleaved": true}
        },
        "tie_word_embeddings": false
    })
}

/// The tiny checkpoint's directory: written once into cargo's scratch directory for integration
/// tests (target/tmp), then reused (the synthesis is deterministic).
pub fn tiny_model_dir() -> &'static Path {
    static DIR: OnceLock<PathBuf> = OnceLock::new();
    DIR.get_or_init(|| {
        let dir = PathBuf::from(env!("CARGO_TARGET_TMPDIR")).join("lily-server-tiny-v1");
        if !dir.join("config.json").exists() {
            // Written beside, then renamed: another test binary may be doing the same.
            let tmp = tempfile::tempdir_in(env!("CARGO_TARGET_TMPDIR")).unwrap();
            let out = tmp.path().join("tiny");
            let opts = lily_model::synth::SynthOptions::new(tiny_config(), &out);
            lily_model::synth::synthesize(&opts, &indicatif::ProgressBar::hidden()).unwrap();
            if std::fs::rename(&out, &dir).is_err() {
                assert!(dir.join("config.json").exists(), "could not write {}", dir.display());
            }
        }
        dir
    })
}

// ---------------------------------------------------------------------------------------------
// The server and HTTP

pub struct Server {
    pub base: String,
    pub addr: std::net::SocketAddr,
    pub http: reqwest::Client,
    pub api_key: Option<String>,
    pub app: lily_server::AppState,
    /// Resolves the server's shutdown future (what Ctrl-C does in `lily serve`).
    pub stop: Option<tokio::sync::oneshot::Sender<()>>,
    /// The serving task: done once the shutdown has drained.
    pub served: tokio::task::JoinHandle<std::io::Result<()>>,
}

/// Starts the real server (engine thread + the connection layer of `lily serve` on the current
/// tokio runtime) on 127.0.0.1:0.
pub async fn start<B>(m: ServedModel<B>, cfg: ServerConfig) -> Server
where
    B: Backend + 'static,
    B::State: 'static,
{
    start_with(m, cfg, lily_server::HttpLimits::default()).await
}

pub async fn start_with<B>(m: ServedModel<B>, cfg: ServerConfig, limits: lily_server::HttpLimits) -> Server
where
    B: Backend + 'static,
    B::State: 'static,
{
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let addr = listener.local_addr().unwrap();
    let app = lily_server::build(m, &cfg);
    let (stop, stopped) = tokio::sync::oneshot::channel::<()>();
    let served = tokio::spawn(lily_server::serve_until(app.clone(), listener, limits, async move {
        let _ = stopped.await;
    }));
    Server { base: format!("http://{addr}"), addr, http: reqwest::Client::new(), api_key: cfg.api_key.clone(), app, stop: Some(stop), served }
}

pub async fn start_scripted(cfg: ServerConfig, delay: Duration) -> (Server, Arc<AtomicUsize>) {
    let (m, forwards) = scripted_model(delay);
    (start(m, cfg).await, forwards)
}

pub async fn start_cpu(cfg: ServerConfig) -> Server {
    let dir = tiny_model_dir().to_path_buf();
    let m = tokio::task::spawn_blocking(move || {
        lily_engine::ChatModel::open(&dir, lily_engine::BackendKind::Cpu, &lily_engine::OpenOptions::default()).unwrap()
    })
    .await
    .unwrap();
    let served = ServedModel { backend: m.model, tokenizer: m.tokenizer, template: m.template, defaults: m.defaults, stop_ids: m.stop_ids };
    start(served, cfg).await
}

impl Server {
    pub fn url(&self, path: &str) -> String {
        format!("{}{path}", self.base)
    }

    fn auth(&self, rb: reqwest::RequestBuilder) -> reqwest::RequestBuilder {
        match &self.api_key {
            Some(k) => rb.bearer_auth(k),
            None => rb,
        }
    }

    /// POSTs a JSON body; returns the status and the body parsed as JSON (Null if it is not JSON).
    pub async fn post(&self, path: &str, body: &Value) -> (u16, Value) {
        let r = self.auth(self.http.post(self.url(path))).json(body).send().await.unwrap();
        let status = r.status().as_u16();
        let text = r.text().await.unwrap();
        (status, serde_json::from_str(&text).unwrap_or(Value::Null))
    }

    /// POSTs raw bytes (with a JSON content type).
    pub async fn post_raw(&self, path: &str, body: Vec<u8>) -> (u16, Value) {
        let r = self
            .auth(self.http.post(self.url(path)))
            .header("content-type", "application/json")
            .body(body)
            .send()
            .await
            .unwrap();
        let status = r.status().as_u16();
        let text = r.text().await.unwrap();
        (status, serde_json::from_str(&text).unwrap_or(Value::Null))
    }

    /// POSTs a JSON body with extra headers (no bearer key unless given); the status and the body
    /// as JSON (Null if it is not JSON).
    pub async fn post_with(&self, path: &str, headers: &[(&str, &str)], body: &Value) -> (u16, Value) {
        let mut rb = self.http.post(self.url(path)).json(body);
        for (k, v) in headers {
            rb = rb.header(*k, *v);
        }
        let r = rb.send().await.unwrap();
        let status = r.status().as_u16();
        let text = r.text().await.unwrap();
        (status, serde_json::from_str(&text).unwrap_or(Value::Null))
    }

    /// A streamed request's named events, `(event, data as JSON)`, checking that each event's name
    /// is its data's `type` (as both the Responses and the Messages API send them).
    pub async fn stream_events(&self, path: &str, headers: &[(&str, &str)], body: &Value) -> Vec<(String, Value)> {
        let mut rb = self.auth(self.http.post(self.url(path))).json(body);
        for (k, v) in headers {
            rb = rb.header(*k, *v);
        }
        let r = rb.send().await.unwrap();
        assert_eq!(r.status().as_u16(), 200);
        let ct = r.headers().get("content-type").unwrap().to_str().unwrap().to_string();
        assert!(ct.starts_with("text/event-stream"), "content-type {ct}");
        let mut stream = r.bytes_stream();
        let mut buf: Vec<u8> = Vec::new();
        let mut out = Vec::new();
        loop {
            while let Some(pos) = buf.windows(2).position(|w| w == b"\n\n") {
                let raw: Vec<u8> = buf.drain(..pos + 2).collect();
                let text = String::from_utf8(raw).expect("SSE must be UTF-8");
                let mut name = None;
                let mut data = Vec::new();
                for l in text.lines() {
                    if let Some(n) = l.strip_prefix("event:") {
                        name = Some(n.trim().to_string());
                    } else if let Some(d) = l.strip_prefix("data:") {
                        data.push(d.strip_prefix(' ').unwrap_or(d).to_string());
                    }
                }
                if data.is_empty() {
                    continue;
                }
                let v: Value = serde_json::from_str(&data.join("\n")).unwrap_or_else(|e| panic!("bad event data {data:?}: {e}"));
                let name = name.unwrap_or_else(|| panic!("an event without a name: {v}"));
                assert_eq!(v["type"].as_str(), Some(name.as_str()), "event name vs type: {v}");
                out.push((name, v));
            }
            match stream.next().await {
                Some(Ok(b)) => buf.extend_from_slice(&b),
                Some(Err(e)) => panic!("stream error: {e}"),
                None => break,
            }
        }
        assert!(buf.iter().all(u8::is_ascii_whitespace), "stream ended mid-event");
        out
    }

    pub async fn get(&self, path: &str) -> (u16, String) {
        let r = self.auth(self.http.get(self.url(path))).send().await.unwrap();
        (r.status().as_u16(), r.text().await.unwrap())
    }

    pub async fn chat(&self, body: Value) -> Value {
        let (status, v) = self.post("/v1/chat/completions", &body).await;
        assert_eq!(status, 200, "chat failed: {v}");
        v
    }

    /// A streamed request read to the end: the `data:` payloads in order (`[DONE]` included).
    pub async fn stream(&self, path: &str, body: &Value) -> Vec<String> {
        let r = self.auth(self.http.post(self.url(path))).json(body).send().await.unwrap();
        assert_eq!(r.status().as_u16(), 200);
        let ct = r.headers().get("content-type").unwrap().to_str().unwrap().to_string();
        assert!(ct.starts_with("text/event-stream"), "content-type {ct}");
        let mut sse = SseReader::new(r);
        let mut out = Vec::new();
        while let Some(d) = sse.next().await {
            out.push(d);
        }
        out
    }

    /// A streamed request's chunks as JSON, checking it ends with exactly one `[DONE]`.
    pub async fn stream_chunks(&self, path: &str, body: &Value) -> Vec<Value> {
        let data = self.stream(path, body).await;
        assert_eq!(data.last().map(String::as_str), Some("[DONE]"), "stream must end with [DONE]: {data:?}");
        assert_eq!(data.iter().filter(|d| *d == "[DONE]").count(), 1);
        data[..data.len() - 1].iter().map(|d| serde_json::from_str(d).unwrap_or_else(|e| panic!("bad chunk {d}: {e}"))).collect()
    }

    /// Parses /metrics: the value of one sample (`name` or `name{labels}`).
    pub async fn metric(&self, sample: &str) -> f64 {
        let (status, text) = self.get("/metrics").await;
        assert_eq!(status, 200);
        metric_value(&text, sample).unwrap_or(0.0)
    }

    /// A good request still gets a good answer.
    pub async fn assert_healthy(&self) {
        let (status, _) = self.get("/health").await;
        assert_eq!(status, 200);
        let v = self
            .chat(json!({"messages": [{"role": "user", "content": "hi"}], "max_tokens": 4, "temperature": 0}))
            .await;
        assert_eq!(v["object"], "chat.completion");
        assert!(v["usage"]["completion_tokens"].as_u64().unwrap() >= 1);
    }
}

pub fn metric_value(text: &str, sample: &str) -> Option<f64> {
    text.lines().find_map(|l| {
        let (name, v) = l.rsplit_once(' ')?;
        if name == sample {
            v.parse().ok()
        } else {
            None
        }
    })
}

/// Reads `data:` events of a server-sent-event stream as they arrive.
pub struct SseReader {
    stream: std::pin::Pin<Box<dyn futures::Stream<Item = reqwest::Result<axum::body::Bytes>> + Send>>,
    buf: Vec<u8>,
}

impl SseReader {
    pub fn new(r: reqwest::Response) -> Self {
        SseReader { stream: Box::pin(r.bytes_stream()), buf: Vec::new() }
    }

    /// The next event's data (None at the end of the stream). Comments (keep-alives) are skipped.
    pub async fn next(&mut self) -> Option<String> {
        loop {
            if let Some(pos) = self.buf.windows(2).position(|w| w == b"\n\n") {
                let event: Vec<u8> = self.buf.drain(..pos + 2).collect();
                let text = String::from_utf8(event).expect("SSE must be UTF-8");
                let data: Vec<&str> = text.lines().filter_map(|l| l.strip_prefix("data:")).map(|d| d.strip_prefix(' ').unwrap_or(d)).collect();
                if data.is_empty() {
                    continue;
                }
                return Some(data.join("\n"));
            }
            match self.stream.next().await {
                Some(Ok(b)) => self.buf.extend_from_slice(&b),
                Some(Err(e)) => panic!("stream error: {e}"),
                None => {
                    assert!(self.buf.iter().all(u8::is_ascii_whitespace), "stream ended mid-event: {:?}", String::from_utf8_lossy(&self.buf));
                    return None;
                }
            }
        }
    }
}

/// Checks OpenAI's error shape: `{"error": {"message": non-empty string, "type": string,
/// "param": string or null, "code": string or null}}`.
pub fn assert_error_shape(v: &Value) {
    let e = v.get("error").unwrap_or_else(|| panic!("no `error` object in {v}"));
    assert!(e["message"].as_str().is_some_and(|m| !m.is_empty()), "message: {v}");
    assert!(e["type"].is_string(), "type: {v}");
    assert!(e.get("param").is_some_and(|p| p.is_null() || p.is_string()), "param: {v}");
    assert!(e.get("code").is_some_and(|c| c.is_null() || c.is_string()), "code: {v}");
}

/// Asserts an error response: status, shape, and (when given) `param`.
pub fn assert_error(status: u16, v: &Value, want_status: u16, want_param: Option<&str>) {
    assert_eq!(status, want_status, "expected {want_status}, got {status}: {v}");
    assert_error_shape(v);
    if let Some(p) = want_param {
        assert_eq!(v["error"]["param"].as_str(), Some(p), "param of {v}");
    }
}

pub fn user(text: &str) -> Value {
    json!([{"role": "user", "content": text}])
}

pub fn weather_tool() -> Value {
    json!({"type": "function", "function": {"name": "get_weather", "description": "Weather of a city",
        "parameters": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}}})
}

pub fn time_tool() -> Value {
    json!({"type": "function", "function": {"name": "get_time", "description": "Time in a city",
        "parameters": {"type": "object", "properties": {"city": {"type": "string"}}}}})
}

/// Waits until `cond` holds (polling), or panics after `timeout`.
pub async fn wait_for(what: &str, timeout: Duration, mut cond: impl AsyncFnMut() -> bool) {
    let t = Instant::now();
    while t.elapsed() < timeout {
        if cond().await {
            return;
        }
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
    panic!("timed out waiting for {what}");
}

//! What the host costs a streamed token when the model costs nothing (issue #10 item 6: at 1,200
//! tok/s a decode step has 833 µs in all, so the host's part must stay a small share of that). A
//! backend that "picks on the device" (as the CUDA backend does: only the id comes back) replays a
//! fixed token sequence at no cost, so everything timed is the host's: the generation loop
//! (detokenisation, stop strings, the sampler's bookkeeping), the engine-to-connection channel, the
//! reasoning and tool-call parsers, the JSON and SSE framing of the three streaming APIs, and a client
//! reading the stream over loopback HTTP on the same machine.
//!
//! Timing, not a test (run it: `cargo test --release -p lily-server --test host_rate -- --ignored
//! --nocapture`); it asserts only that each stream delivered what was asked for. Two texts: reasoning
//! then a markdown answer, and reasoning then one tool call whose argument is a long source file
//! (the tool-call parser holds and streams a growing argument).

mod common;

use std::time::Instant;

use common::*;
use lily_engine::{generate, Flow, GenSpec};
use lily_model::{Backend, BackendError, DevicePick, Logits, ModelConfig};
use lily_sampler::SamplingParams;
use lily_template::ChatTemplate;
use serde_json::{json, Value};

/// Tokens generated per measured stream.
const TOKENS: usize = 3000;

/// Replays `seq` (then its last token forever), one token per pick, at no cost; from its start again
/// for every sequence (a state that is not the one the last call left).
struct Replay {
    config: ModelConfig,
    seq: Vec<u32>,
    at: usize,
    /// The state length the last call left.
    end: usize,
}

impl Replay {
    fn new(seq: &[u32]) -> Self {
        Replay { config: scripted_config(), seq: seq.to_vec(), at: 0, end: usize::MAX }
    }
    fn advance(&mut self, s: &mut usize, tokens: &[u32]) {
        if *s != self.end {
            self.at = 0;
        }
        *s += tokens.len();
        self.end = *s;
    }
    fn next(&mut self) -> u32 {
        let t = self.seq[self.at.min(self.seq.len() - 1)];
        self.at += 1;
        t
    }
}

impl Backend for Replay {
    type State = usize;
    fn name(&self) -> &'static str {
        "replay"
    }
    fn config(&self) -> &ModelConfig {
        &self.config
    }
    fn new_state(&self) -> usize {
        0
    }
    fn state_len(&self, s: &usize) -> usize {
        *s
    }
    fn state_bytes(&self, s: &usize) -> usize {
        8 * *s + 64
    }
    fn forward(&mut self, s: &mut usize, tokens: &[u32], logits: Logits) -> Result<Vec<f32>, BackendError> {
        self.advance(s, tokens);
        match logits {
            Logits::None => Ok(Vec::new()),
            Logits::Last => {
                let mut row = vec![0.0f32; self.config.vocab_size];
                row[self.next() as usize] = 100.0;
                Ok(row)
            }
            Logits::All => Err(BackendError::Device("the replay backend has no teacher forcing".into())),
        }
    }
    fn picks_on_device(&self) -> bool {
        true
    }
    fn forward_pick(&mut self, s: &mut usize, tokens: &[u32], _pick: &DevicePick) -> Result<u32, BackendError> {
        self.advance(s, tokens);
        Ok(self.next())
    }
}

/// About `words` words of varied English with markdown, code and non-ASCII characters.
fn prose(words: usize, seed: u64) -> String {
    const PIECES: &[&str] = &[
        "The function reads the file line by line and keeps a running total of the bytes it has seen.",
        "Use `std::fs::read_to_string` when the whole file fits in memory; otherwise stream it.",
        "**Note:** the cache is keyed by the prompt's token ids, so a changed system prompt misses it.",
        "- first, check the input;\n- then, compute the result;\n- finally, write it out.",
        "Größe, naïve café, 東京, and 🌷 all survive the round trip through the tokenizer.",
        "```rust\nfn add(a: i32, b: i32) -> i32 {\n    a + b\n}\n```",
        "If the test fails with `expected 3, got 4`, the off-by-one is in the loop bound.",
        "In short: 42 items, 3.5 ms each, about 147 ms in all (±5%).",
    ];
    let mut s = String::new();
    let mut x = seed;
    let mut n = 0;
    while n < words {
        x = x.wrapping_mul(6364136223846793005).wrapping_add(1442695040888963407);
        let p = PIECES[(x >> 33) as usize % PIECES.len()];
        s.push_str(p);
        s.push_str(if (x >> 20).is_multiple_of(3) { "\n\n" } else { " " });
        n += p.split_whitespace().count();
    }
    s
}

/// About `lines` lines of Rust-like source.
fn source(lines: usize) -> String {
    (0..lines).map(|i| format!("    let value_{i} = compute(&input[{i}..], {}) * 2; // step {i} of the \"plan\" <ok>\n", i % 7)).collect()
}

fn tokens_of(text: &str) -> Vec<u32> {
    tokenizer().encode(text).unwrap()
}

/// The two replayed answers: (name, token sequence, whether the request offers tools).
fn answers() -> Vec<(&'static str, Vec<u32>, bool)> {
    let chat = format!("<think>\n{}\n</think>\n\n{}", prose(600, 1), prose(4000, 2));
    let tool = format!(
        "<think>\n{}\n</think>\n\n<tool_call>\n<function=write_file>\n<parameter=path>\nsrc/main.rs\n</parameter>\n<parameter=content>\n{}",
        prose(300, 3),
        source(600)
    );
    let (a, b) = (tokens_of(&chat), tokens_of(&tool));
    assert!(a.len() > TOKENS && b.len() > TOKENS, "the replayed texts are too short: {} and {} tokens", a.len(), b.len());
    vec![("reasoning + markdown answer", a, false), ("reasoning + one tool call with a long argument", b, true)]
}

fn write_file_tool() -> Value {
    json!({"type": "function", "function": {"name": "write_file", "description": "Write a file",
        "parameters": {"type": "object", "properties": {"path": {"type": "string"}, "content": {"type": "string"}}, "required": ["path", "content"]}}})
}

/// The engine's generation loop alone (no server): µs a token.
fn engine_loop(seq: &[u32]) -> f64 {
    let tok = tokenizer();
    let mut b = Replay::new(seq);
    let mut state = 0usize;
    let prompt = tokens_of("<|im_start|>user\nWrite it.<|im_end|>\n<|im_start|>assistant\n");
    let spec = GenSpec {
        sampling: SamplingParams { temperature: Some(0.0), ..Default::default() },
        defaults: Default::default(),
        stop_strings: vec!["<|im_end|>".into()],
        stop_ids: vec![token_id("<|im_end|>")],
        max_tokens: Some(TOKENS),
        skip_special: true,
        constraint: None,
    };
    let mut n = 0;
    let t = Instant::now();
    let out = generate(&mut b, &mut state, &prompt, &tok, &spec, |_| {
        n += 1;
        Flow::Continue
    })
    .unwrap();
    let dt = t.elapsed().as_secs_f64();
    assert_eq!(out.tokens.len(), TOKENS);
    assert_eq!(n, TOKENS);
    dt / TOKENS as f64 * 1e6
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
#[ignore = "timing; run with --ignored --nocapture"]
async fn bench_host_stream_rate() {
    let budget_us = 1e6 / 1200.0;
    println!(
        "host cost of a streamed token with a free model ({} CPUs here; {TOKENS} tokens a stream; budget at 1,200 tok/s: {budget_us:.0} µs a token)",
        std::thread::available_parallelism().map(|n| n.get()).unwrap_or(1)
    );
    println!("{:<48} {:<34} {:>9} {:>9} {:>9}", "answer", "path", "µs/token", "tok/s", "% budget");
    for (name, seq, tools) in answers() {
        let us = engine_loop(&seq);
        println!("{name:<48} {:<34} {us:>9.2} {:>9.0} {:>8.2}%", "engine loop (no server)", 1e6 / us, 100.0 * us / budget_us);

        let backend = Replay::new(&seq);
        let tokenizer = tokenizer();
        let stop_ids = vec![token_id("<|im_end|>"), token_id("<|endoftext|>")];
        let m = lily_server::ServedModel { backend, tokenizer, template: ChatTemplate::builtin(), defaults: Default::default(), stop_ids };
        let mut cfg = default_config();
        cfg.ctx_size = 8192;
        let s = start(m, cfg).await;
        let tool_list = if tools { vec![write_file_tool()] } else { vec![] };
        let msgs = json!([{"role": "user", "content": "Write it."}]);
        let mut chat = json!({"messages": msgs, "max_tokens": TOKENS, "temperature": 0, "stream": true});
        let mut responses = json!({"input": "Write it.", "max_output_tokens": TOKENS, "temperature": 0, "stream": true});
        let mut messages = json!({"model": "test-model", "messages": msgs, "max_tokens": TOKENS, "temperature": 0, "stream": true});
        if tools {
            chat["tools"] = json!(tool_list);
            responses["tools"] = json!([{"type": "function", "name": "write_file", "description": "Write a file",
                "parameters": tool_list[0]["function"]["parameters"].clone()}]);
            messages["tools"] = json!([{"name": "write_file", "description": "Write a file",
                "input_schema": tool_list[0]["function"]["parameters"].clone()}]);
        }
        let cases = [
            ("chat completions", "/v1/chat/completions", &chat),
            ("responses", "/v1/responses", &responses),
            ("anthropic messages", "/v1/messages", &messages),
        ];
        for (label, path, body) in cases {
            // The request, then every event read by the client, to the end of the stream.
            let t = Instant::now();
            let events = s.stream(path, body).await.len();
            let us = t.elapsed().as_secs_f64() / TOKENS as f64 * 1e6;
            println!(
                "{name:<48} {:<34} {us:>9.2} {:>9.0} {:>8.2}%",
                format!("{label} ({events} events)"),
                1e6 / us,
                100.0 * us / budget_us
            );
        }
        s.assert_healthy().await;
    }
}

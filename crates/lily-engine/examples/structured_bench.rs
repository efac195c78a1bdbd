//! Decode speed with a grammar against without, through the engine's own generation loop on the
//! CPU backend (or `--backend cuda`; the demo model unless `--model DIR`; `--context N` puts about N
//! tokens of filler before the request, so decoding starts that far in): the same prompt, `--tokens` tokens each run
//! (the grammar keeps the answer going: an array with at least that many items), medians of
//! `--repeats` runs; with the host time the masks took. A benchmark, not a test.
//!
//! ```sh
//! cargo run --release -p lily-engine --example structured_bench [-- --model DIR] [--tokens 256] [--repeats 3]
//! ```
//!
//! The demo model is tiny (its forward pass is a few milliseconds), so the masks weigh far more here
//! than beside a full-size model.

use std::path::PathBuf;
use std::sync::Arc;
use std::time::Instant;

use lily_engine::{generate, BackendKind, ChatModel, Flow, GenSpec, OpenOptions};
use lily_grammar::{Format, Grammars, Plan, Whitespace};
use lily_model::Backend;
use lily_sampler::SamplingParams;
use serde_json::json;

fn arg<T: std::str::FromStr>(args: &[String], name: &str, default: T) -> T {
    args.iter().position(|a| a == name).and_then(|i| args.get(i + 1)).and_then(|v| v.parse().ok()).unwrap_or(default)
}

fn median(mut v: Vec<f64>) -> f64 {
    v.sort_by(f64::total_cmp);
    v[v.len() / 2]
}

fn main() {
    let args: Vec<String> = std::env::args().skip(1).collect();
    let tokens: usize = arg(&args, "--tokens", 256);
    let repeats: usize = arg(&args, "--repeats", 3);
    let model: Option<PathBuf> = args.iter().position(|a| a == "--model").and_then(|i| args.get(i + 1)).map(PathBuf::from);
    let backend: BackendKind = arg(&args, "--backend", BackendKind::Cpu);
    let context: usize = arg(&args, "--context", 0);
    let mut m = match &model {
        Some(dir) => ChatModel::open(dir, backend, &OpenOptions::default()).unwrap(),
        None => ChatModel::open_demo(backend, &OpenOptions::default()).unwrap(),
    };
    let tok = Arc::new(m.tokenizer.clone());
    let t = Instant::now();
    let grammars = Grammars::new(Arc::clone(&tok), &m.stop_ids).unwrap();
    println!("model {} ({}), vocabulary {} tokens; grammar set-up {:.2} s", m.dir.display(), m.model.name(), tok.vocab_size(), t.elapsed().as_secs_f64());
    // `--context N`: a system message of filler text first, so that decoding starts about N tokens in.
    let filler = tok.encode("The records below were collected over many years and are kept in order. ").unwrap();
    let mut prompt = tok.encode("<|im_start|>system\n").unwrap();
    while prompt.len() + filler.len() < context {
        prompt.extend_from_slice(&filler);
    }
    prompt.extend(tok.encode("<|im_end|>\n<|im_start|>user\nList some records as JSON.<|im_end|>\n<|im_start|>assistant\n<think>\n\n</think>\n\n").unwrap());
    println!("prompt: {} tokens", prompt.len());

    let n = tokens; // at least this many items: the array never ends within the run
    let cases: Vec<(&str, Option<Format>)> = vec![
        ("no grammar", None),
        ("array of free strings", Some(Format::JsonSchema { schema: json!({"type": "array", "items": {"type": "string"}, "minItems": n}), strict: true, whitespace: Whitespace::Bounded })),
        (
            "array of records (bounded string, integer, enum)",
            Some(Format::JsonSchema {
                schema: json!({"type": "array", "minItems": n, "items": {"type": "object", "properties": {
                    "name": {"type": "string", "maxLength": 12}, "n": {"type": "integer", "minimum": 0, "maximum": 999}, "kind": {"enum": ["a", "b", "c"]}},
                    "required": ["name", "n", "kind"], "additionalProperties": false}}),
                strict: true,
                whitespace: Whitespace::Bounded,
            }),
        ),
    ];
    let constraints: Vec<_> = cases.iter().map(|(_, f)| f.clone().map(|f| grammars.compile(&Plan { answer: Some(f), ..Default::default() }).unwrap())).collect();
    #[derive(Default)]
    struct Runs {
        speeds: Vec<f64>,
        masked: usize,
        forced: usize,
        mask_ms: Vec<f64>,
        share: Vec<f64>,
    }
    let mut runs: Vec<Runs> = cases.iter().map(|_| Runs::default()).collect();
    // Rounds alternate the cases, so that a change in the machine's load hits them alike.
    for r in 0..repeats {
        for (i, (name, _)) in cases.iter().enumerate() {
            let spec = GenSpec {
                sampling: SamplingParams { temperature: Some(1.0), seed: Some(r as u64), ..Default::default() },
                stop_ids: m.stop_ids.clone(),
                max_tokens: Some(tokens),
                skip_special: true,
                constraint: constraints[i].clone(),
                ..Default::default()
            };
            let mut state = m.model.new_state();
            let out = generate(&mut m.model, &mut state, &prompt, &tok, &spec, |_| Flow::Continue).unwrap();
            assert_eq!(out.tokens.len(), tokens, "{name}: the run ended early ({:?})", out.finish);
            let c = &mut runs[i];
            c.speeds.push(out.decode_tok_s());
            c.masked = out.masked_steps;
            c.forced = out.forced_tokens;
            if out.masked_steps > 0 {
                c.mask_ms.push(out.mask_time.as_secs_f64() * 1e3 / out.masked_steps as f64);
                c.share.push(out.mask_time.as_secs_f64() / out.decode_time.as_secs_f64());
            }
        }
    }
    println!("\n| grammar | decode tok/s | vs none | masked steps | forced tokens | mask ms / masked step | mask time / decode time |");
    println!("|---|---|---|---|---|---|---|");
    let base = median(runs[0].speeds.clone());
    for ((name, _), c) in cases.iter().zip(runs) {
        let speed = median(c.speeds);
        let (mm, sh) = if c.mask_ms.is_empty() {
            ("-".to_string(), "-".to_string())
        } else {
            (format!("{:.3}", median(c.mask_ms)), format!("{:.1}%", 100.0 * median(c.share)))
        };
        println!("| {name} | {speed:.1} | {:.0}% | {} | {} | {mm} | {sh} |", 100.0 * speed / base, c.masked, c.forced);
    }
    println!("\n{tokens} tokens per run, medians of {repeats} runs, temperature 1 (seeded).");
}

//! Per-token cost of constrained decoding on the real Qwen3.6 vocabulary (248,077 tokens): the
//! one-off set-up (token trie and llguidance's slicer), each grammar's compile time, and for every
//! token of a valid document (teacher-forced: the document's own tokenisation) the time to compute
//! the next-token mask, to commit the token, and to ask for forced tokens. A benchmark, not a test.
//!
//! ```sh
//! cargo run --release -p lily-grammar --example mask_bench [-- TOKENIZER.json.gz] [--repeats N]
//! ```
//!
//! The tokenizer defaults to `assets/qwen3.6-tokenizer.json.gz` (the same file as
//! `/work/shared/tokenizer/qwen3.6/tokenizer.json.gz`). `MASK_TRACE=NAME` prints each token's mask
//! time for the grammars whose name contains NAME (the time of the mask computed before the token).

use std::io::Read;
use std::sync::Arc;
use std::time::Instant;

use lily_grammar::{CallStart, CallTool, Format, Grammars, Plan, ToolCalls, Whitespace};
use lily_parser::ToolSpec;
use serde_json::{json, Value};

fn load_tokenizer(path: &str) -> lily_tokenizer::Tokenizer {
    let file = std::fs::File::open(path).unwrap_or_else(|e| panic!("{path}: {e}"));
    let mut bytes = Vec::new();
    if path.ends_with(".gz") {
        flate2::read::GzDecoder::new(file).read_to_end(&mut bytes).unwrap();
    } else {
        std::io::BufReader::new(file).read_to_end(&mut bytes).unwrap();
    }
    let config = br#"{"add_bos_token": false, "bos_token": null, "eos_token": "<|im_end|>", "pad_token": "<|endoftext|>", "split_special_tokens": false}"#;
    lily_tokenizer::Tokenizer::from_json_bytes_with_config(&bytes, Some(config)).unwrap()
}

fn json_case(name: &'static str, schema: Value, doc: Value, pretty: bool) -> (&'static str, Plan, String) {
    let text = if pretty { serde_json::to_string_pretty(&doc).unwrap() } else { serde_json::to_string(&doc).unwrap() };
    let plan = Plan { answer: Some(Format::JsonSchema { schema, strict: true, whitespace: Whitespace::Bounded }), ..Default::default() };
    (name, plan, text)
}

fn percentile(sorted: &[f64], p: f64) -> f64 {
    if sorted.is_empty() {
        return f64::NAN;
    }
    let i = ((sorted.len() as f64 - 1.0) * p).round() as usize;
    sorted[i.min(sorted.len() - 1)]
}

fn main() {
    let args: Vec<String> = std::env::args().skip(1).collect();
    let repeats: usize = args.iter().position(|a| a == "--repeats").and_then(|i| args.get(i + 1)).map_or(5, |n| n.parse().unwrap());
    let path = args
        .iter()
        .find(|a| a.ends_with(".gz") || a.ends_with(".json"))
        .cloned()
        .unwrap_or_else(|| concat!(env!("CARGO_MANIFEST_DIR"), "/../../assets/qwen3.6-tokenizer.json.gz").to_string());

    let t = Instant::now();
    let tok = Arc::new(load_tokenizer(&path));
    let load = t.elapsed();
    let stops = vec![tok.token_id("<|im_end|>").unwrap(), tok.token_id("<|endoftext|>").unwrap()];
    let t = Instant::now();
    let grammars = Grammars::new(Arc::clone(&tok), &stops).unwrap();
    let setup = t.elapsed();
    println!("vocabulary: {} tokens ({} mask words); tokenizer load {:.2} s; grammar set-up (trie + slicer) {:.2} s",
        tok.vocab_size(), tok.vocab_size().div_ceil(32), load.as_secs_f64(), setup.as_secs_f64());

    let city = json!({"type": "object", "properties": {
        "name": {"enum": ["Paris", "Lyon", "Nice"]}, "population": {"type": "integer", "minimum": 0, "maximum": 10000000},
        "coastal": {"type": "boolean"}, "tags": {"type": "array", "items": {"enum": ["old", "big", "sunny"]}, "maxItems": 2}},
        "required": ["name", "population", "coastal", "tags"], "additionalProperties": false});
    let person = json!({"type": "object", "properties": {
        "name": {"type": "string"}, "email": {"type": "string"}, "age": {"type": "integer", "minimum": 0, "maximum": 150},
        "address": {"type": "object", "properties": {"street": {"type": "string"}, "city": {"type": "string"}, "zip": {"type": "string", "pattern": "^[0-9]{5}$"}},
            "required": ["street", "city", "zip"], "additionalProperties": false},
        "phones": {"type": "array", "items": {"type": "string", "pattern": "^\\+?[0-9 ]{6,15}$"}}},
        "required": ["name", "age", "address"], "additionalProperties": false});
    let order = json!({"type": "object", "properties": {
        "id": {"type": "string", "pattern": "^ORD-[0-9]{6}$"},
        "items": {"type": "array", "items": {"type": "object", "properties": {
            "sku": {"type": "string", "maxLength": 12}, "qty": {"type": "integer", "minimum": 1}, "price": {"type": "number", "minimum": 0}},
            "required": ["sku", "qty", "price"], "additionalProperties": false}},
        "express": {"type": "boolean"}, "notes": {"anyOf": [{"type": "string"}, {"type": "null"}]}},
        "required": ["id", "items", "express", "notes"], "additionalProperties": false});
    let mut cases = vec![
        json_case("enums and bounded ints (compact)", city.clone(),
            json!({"name": "Nice", "population": 342669, "coastal": true, "tags": ["sunny", "old"]}), false),
        json_case("free strings, nested, patterns (pretty)", person,
            json!({"name": "Ada Lovelace", "email": "ada@example.org", "age": 36,
                   "address": {"street": "12 St James's Square", "city": "London", "zip": "12345"}, "phones": ["+44 20 7946 0000"]}), true),
        json_case("array of objects, numbers, anyOf (pretty)", order,
            json!({"id": "ORD-004217", "items": [{"sku": "KB-101", "qty": 2, "price": 49.9}, {"sku": "MS-7", "qty": 1, "price": 19.5},
                   {"sku": "CBL-USB-C", "qty": 3, "price": 7.25}], "express": false, "notes": "Leave it at the door, please. Thanks!"}), true),
    ];
    cases.push((
        "JSON object mode",
        Plan { answer: Some(Format::JsonObject { whitespace: Whitespace::Bounded }), ..Default::default() },
        serde_json::to_string(&json!({"summary": "The meeting moved to Tuesday.", "attendees": ["Ann", "Bo"], "count": 2, "final": true})).unwrap(),
    ));
    let tools = vec![
        CallTool { spec: ToolSpec::new("get_weather", json!({"type": "object", "properties": {"city": {"type": "string"}, "days": {"type": "integer", "minimum": 1, "maximum": 14}}, "required": ["city"]})), typed: true },
        CallTool { spec: ToolSpec::new("search", json!({"type": "object", "properties": {"query": {"type": "string"}, "limit": {"type": "integer"}}, "required": ["query"]})), typed: true },
    ];
    cases.push((
        "Qwen XML tool call (2 tools)",
        Plan { calls: Some(ToolCalls { tools, start: CallStart::Open, parallel: true }), ..Default::default() },
        "<tool_call>\n<function=search>\n<parameter=query>\nbest ramen in Kyoto open late\n</parameter>\n<parameter=limit>\n5\n</parameter>\n</function>\n</tool_call>".into(),
    ));
    cases.push((
        "regex (ISO date-time)",
        Plan { answer: Some(Format::Regex(r"[0-9]{4}-[0-9]{2}-[0-9]{2}T[0-9]{2}:[0-9]{2}:[0-9]{2}Z".into())), ..Default::default() },
        "2026-03-14T15:09:26Z".into(),
    ));

    println!("\n| grammar | compile ms | tokens | mask mean µs | mask p50 µs | mask p99 µs | mask max µs | commit mean µs | forced-check mean µs |");
    println!("|---|---|---|---|---|---|---|---|---|");
    let mut all_masks = Vec::new();
    for (name, plan, text) in &cases {
        let mut ids = tok.encode(text).unwrap();
        ids.push(stops[0]);
        let (mut masks, mut commits, mut forced, mut compiles) = (Vec::new(), Vec::new(), Vec::new(), Vec::new());
        for _ in 0..repeats {
            let t = Instant::now();
            let c = grammars.compile(plan).unwrap();
            compiles.push(t.elapsed().as_secs_f64() * 1e3);
            let mut s = c.start();
            let mut mask = vec![0u32; tok.vocab_size().div_ceil(32)];
            for &id in &ids {
                if s.is_done() {
                    break;
                }
                let t = Instant::now();
                s.fill_mask(&mut mask).unwrap_or_else(|e| panic!("{name}: {e}"));
                masks.push(t.elapsed().as_secs_f64() * 1e6);
                if std::env::var("MASK_TRACE").is_ok_and(|v| name.contains(v.as_str())) { eprintln!("{:?} {:.0}", tok.decode(&[id], false).unwrap(), masks.last().unwrap()); }
                assert!(mask[id as usize / 32] >> (id % 32) & 1 == 1, "{name}: the document's token {id} {:?} is masked out", tok.decode(&[id], false));
                let t = Instant::now();
                s.commit(id).unwrap();
                commits.push(t.elapsed().as_secs_f64() * 1e6);
                let t = Instant::now();
                let _ = s.forced();
                forced.push(t.elapsed().as_secs_f64() * 1e6);
            }
        }
        all_masks.extend_from_slice(&masks);
        let mean = |v: &[f64]| v.iter().sum::<f64>() / v.len().max(1) as f64;
        let (m, cm, fm) = (mean(&masks), mean(&commits), mean(&forced));
        masks.sort_by(f64::total_cmp);
        compiles.sort_by(f64::total_cmp);
        println!(
            "| {name} | {:.2} | {} | {m:.0} | {:.0} | {:.0} | {:.0} | {cm:.1} | {fm:.1} |",
            percentile(&compiles, 0.5),
            ids.len(),
            percentile(&masks, 0.5),
            percentile(&masks, 0.99),
            masks.last().copied().unwrap_or(f64::NAN)
        );
    }
    all_masks.sort_by(f64::total_cmp);
    let mean = all_masks.iter().sum::<f64>() / all_masks.len() as f64;
    println!("\nall masks: {} samples, mean {mean:.0} µs, p50 {:.0} µs, p99 {:.0} µs, max {:.0} µs ({} repeats)",
        all_masks.len(), percentile(&all_masks, 0.5), percentile(&all_masks, 0.99), all_masks.last().unwrap(), repeats);
}
